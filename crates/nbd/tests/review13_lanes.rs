//! review13: adversarial tests of the NBD server's two lanes (merge 5ba3c7c, main at 635b009).
//! Each test fails there; its comment names the mechanism.

mod common;

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::{
    transmission_flags, Command, Errno, Export, Server, ServerConfig, ServerExport,
};

const KIB: usize = 1024;
/// How long a bounded wait in these tests lasts before the test fails.
const LIMIT: Duration = Duration::from_secs(10);

/// Every request is slow (the default `Export::lane`). The first write waits at a gate (a
/// write-through write waiting for the disk); everything else returns at once.
struct GateExport {
    open: Mutex<bool>,
    opened: Condvar,
    writes: AtomicUsize,
    inside: AtomicUsize,
}

impl GateExport {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl Export for GateExport {
    fn read(&self, _offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        buf.fill(0x5a);
        Ok(())
    }
    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<(), Errno> {
        if self.writes.fetch_add(1, Ordering::SeqCst) > 0 {
            return Ok(());
        }
        self.inside.fetch_add(1, Ordering::SeqCst);
        let open = self.open.lock().unwrap();
        let (open, _) = self
            .opened
            .wait_timeout_while(open, LIMIT, |open| !*open)
            .unwrap();
        self.inside.fetch_sub(1, Ordering::SeqCst);
        if *open {
            Ok(())
        } else {
            Err(Errno::Io)
        }
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, _offset: u64, _length: u64, _fua: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn cache(&self, _offset: u64, _length: u64) -> Result<(), Errno> {
        Ok(())
    }
}

fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(2));
    }
}

/// R13-1. A slow READ leases its buffer only when a slow worker runs it
/// (connection.rs `execute`, `Command::Read`), but a slow WRITE holds its payload's lease
/// from the moment a fast worker read it, all the time it waits in the slow queue
/// (connection.rs `read_payload`, `SlowLane::push`). So a slow worker that pops a read from
/// the queue can wait for request memory that only the writes queued *behind* that read hold,
/// and only slow workers can free it by running them. With every slow worker in that wait
/// (here the one of `threads_per_connection: 1`; with the default 32, 32 large reads ahead of
/// the writes), nothing frees memory: the read waits the whole `buffer_wait` (30 s by default)
/// and is answered ENOMEM, a read the server could have served (the client gets EIO), and the
/// queued writes stall behind it. Before the lanes a write's worker ran it right after
/// reading it, so the memory a waiting request needed was always held by requests that were
/// running. A graceful stop in this state waits for the same circle (`--shutdown-timeout`).
#[test]
fn r13_1_a_queued_read_does_not_wait_for_memory_held_by_writes_queued_behind_it() {
    let backend = Arc::new(GateExport {
        open: Mutex::new(false),
        opened: Condvar::new(),
        writes: AtomicUsize::new(0),
        inside: AtomicUsize::new(0),
    });
    let export = ServerExport {
        info: export_info("disk", 64 << 20, transmission_flags(false)),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let buffer_wait = Duration::from_secs(2);
    let config = ServerConfig {
        threads_per_connection: 1,
        fast_threads_per_connection: 1,
        max_request: (128 * KIB) as u32,
        connection_buffer_memory: 256 * KIB,
        buffer_wait,
        ..ServerConfig::default()
    };
    let server = Server::new(vec![export], config).unwrap();
    let (stream, server_end) = UnixStream::pair().unwrap();
    stream.set_read_timeout(Some(LIMIT)).unwrap();
    let serving = server.clone();
    let handle = thread::spawn(move || serving.serve_stream(server_end));
    let mut client = Client::go(stream, "disk");

    // A write the disk holds: the connection's only slow worker waits in it.
    client.send(Command::Write, 0, 0, BLOCK as u32, &pattern(1, BLOCK));
    eventually("the first write in the backend", || {
        backend.inside.load(Ordering::SeqCst) == 1
    });
    // A 128 KiB read queues (no memory yet), then three 64 KiB writes queue behind it, their
    // payloads leased: 4 KiB + 192 KiB of the connection's 256 KiB.
    let read = client.send(Command::Read, 0, 1 << 20, (128 * KIB) as u32, &[]);
    for i in 0..3u64 {
        let offset = (2 << 20) + i * (64 * KIB) as u64;
        client.send(
            Command::Write,
            0,
            offset,
            (64 * KIB) as u32,
            &pattern(2, 64 * KIB),
        );
    }
    eventually("the three queued writes' payloads leased", || {
        server.buffer_memory_in_use() >= 4 * KIB + 3 * 64 * KIB
    });

    // The disk finishes the first write; the slow worker pops the read next.
    let started = Instant::now();
    backend.open();
    let mut read_reply = None;
    for _ in 0..5 {
        let reply = client.recv();
        if reply.cookie == read {
            read_reply = Some((reply.error, started.elapsed()));
        } else {
            assert_eq!(reply.error, 0, "write {} failed", reply.cookie);
        }
    }
    let (error, waited) = read_reply.unwrap();
    assert_eq!(
        error, 0,
        "the queued read was answered errno {error} after {waited:?} (buffer_wait \
         {buffer_wait:?}): its slow worker waited for memory that only the writes queued \
         behind it held"
    );
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}
