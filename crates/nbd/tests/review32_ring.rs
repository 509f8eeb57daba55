//! Review 32: the ring sender (copy of review31_ring.rs's fake ring backend).

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::{Command, Errno, Export, Lane, RingReads, RingStart, Server, ServerConfig};

const SIZE: u64 = 16 << 20;
const LIMIT: Duration = Duration::from_secs(10);

/// Memory whose block `i` holds `pattern(i)`. The ring takes READs of even blocks and ends
/// them at once (in `wait`); a READ of an odd block served by a worker panics if `panic_odd`;
/// the ring's `wait` fails once `fail` is set. `wait` blocks until something ended or it is
/// woken, as io_uring's does.
struct Backend {
    data: Vec<u8>,
    state: Mutex<State>,
    changed: Condvar,
    panic_odd: AtomicBool,
    started: AtomicUsize,
    waits_returned: AtomicUsize,
}

#[derive(Default)]
struct State {
    queue: Vec<(u64, u64, usize, usize)>,
    /// The ring ends nothing while shut.
    shut: bool,
    woken: bool,
    fail: bool,
}

impl Backend {
    fn new() -> Arc<Backend> {
        Arc::new(Backend {
            data: (0..SIZE as usize / BLOCK)
                .flat_map(|i| pattern(i as u8, BLOCK))
                .collect(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            panic_odd: AtomicBool::new(false),
            started: AtomicUsize::new(0),
            waits_returned: AtomicUsize::new(0),
        })
    }
    fn set(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap());
        self.changed.notify_all();
    }
}

impl Export for Backend {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        if self.panic_odd.load(Ordering::SeqCst) && (offset as usize / BLOCK) % 2 == 1 {
            panic!("the backend panics (test)");
        }
        buf.copy_from_slice(&self.data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
    fn lane(&self, command: Command, _: u64, _: u64) -> Lane {
        if command == Command::Read {
            Lane::Fast
        } else {
            Lane::Slow
        }
    }
    fn ring_reads(&self) -> Option<Box<dyn RingReads + '_>> {
        Some(Box::new(Ring(self)))
    }
}

struct Ring<'e>(&'e Backend);

impl RingReads for Ring<'_> {
    unsafe fn start(&self, reads: &mut [RingStart]) {
        let mut state = self.0.state.lock().unwrap();
        for read in reads
            .iter_mut()
            .filter(|r| (r.offset as usize / BLOCK).is_multiple_of(2))
        {
            state
                .queue
                .push((read.tag, read.offset, read.buf as usize, read.len));
            read.started = true;
            self.0.started.fetch_add(1, Ordering::SeqCst);
        }
        self.0.changed.notify_all();
    }
    fn wait(&self, ended: &mut Vec<(u64, bool)>) -> std::io::Result<()> {
        let state = self.0.state.lock().unwrap();
        let mut state = self
            .0
            .changed
            .wait_while(state, |s| {
                !s.fail && !s.woken && (s.shut || s.queue.is_empty())
            })
            .unwrap();
        self.0.waits_returned.fetch_add(1, Ordering::SeqCst);
        if state.fail {
            return Err(std::io::Error::other("the test broke the ring"));
        }
        state.woken = false;
        if state.shut {
            return Ok(());
        }
        for (tag, offset, buf, len) in state.queue.drain(..) {
            let source = &self.0.data[offset as usize..offset as usize + len];
            // SAFETY: the connection keeps the buffer until this reports its tag.
            unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), buf as *mut u8, len) };
            ended.push((tag, true));
        }
        Ok(())
    }
    fn wake(&self) {
        self.0.set(|s| s.woken = true);
    }
}

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
