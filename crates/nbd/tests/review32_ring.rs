//! Review 32: the ring sender (with the fake ring of `common::ring_backend`).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ring_backend::{Backend, SIZE};
use common::*;
use ssdcache_nbd::{Command, Export, Server, ServerConfig};

const LIMIT: Duration = Duration::from_secs(10);

/// The ring sender takes every reply queued so far and sends them in ONE `write_replies`
/// call, which has ONE io_timeout deadline for the whole batch. The batch is bounded only by
/// the connection's request memory (64 MiB by default), not by MAX_READ_BATCH (32) as the
/// worker path's are. A client that reads its replies steadily, each 64 KiB reply in ~16 ms,
/// is cut off as "the client stopped reading" once a backlog of replies takes longer than
/// io_timeout to drain as a whole.
#[test]
fn a_client_reading_steadily_is_not_timed_out_by_a_large_ring_reply_batch() {
    const READS: usize = 192;
    const LEN: usize = 64 << 10;
    let backend = Backend::new();
    let config = ServerConfig {
        io_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    // Over TCP: a blocking send's SO_SNDTIMEO bounds the whole call there (not each wait, as
    // on a Unix socket), so write_all_by's deadline is reached mid-batch.
    let export = ssdcache_nbd::ServerExport {
        info: export_info("disk", SIZE, ssdcache_nbd::transmission_flags(false)),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], config).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server_end, _) = listener.accept().unwrap();
    {
        use std::os::unix::io::AsRawFd;
        let small: libc::c_int = 128 << 10;
        // SAFETY: a valid socket and option.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                &small as *const _ as *const libc::c_void,
                std::mem::size_of_val(&small) as libc::socklen_t,
            )
        };
    }
    stream.set_read_timeout(Some(LIMIT)).unwrap();
    let serving = server.clone();
    let handle = std::thread::spawn(move || serving.serve_stream(server_end));
    let mut client = Client::go(stream, "disk");
    backend.set(|s| s.shut = true);
    for i in 0..READS {
        // Even blocks: the ring takes them.
        client.send(Command::Read, 0, (i * LEN) as u64, LEN as u32, &[]);
    }
    let deadline = Instant::now() + LIMIT;
    while backend.started.load(Ordering::SeqCst) < READS {
        assert!(Instant::now() < deadline, "never started");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Every read ends at once (one reap, as io_uring can give back 128+ completions).
    backend.set(|s| s.shut = false);
    let start = Instant::now();
    let mut got = 0;
    for _ in 0..READS {
        std::thread::sleep(Duration::from_millis(16)); // ~4 MiB/s, 16 ms per reply
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| client.recv()));
        match reply {
            Ok(r) if r.error == 0 => got += 1,
            _ => break,
        }
    }
    let elapsed = start.elapsed();
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    let result = handle.join().unwrap();
    assert_eq!(
        got, READS,
        "after {elapsed:?} the server gave up on a client that read every reply within 16 ms \
         of the previous one (io_timeout 1 s); connection ended with {result:?}"
    );
}
