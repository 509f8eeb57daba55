//! Review 31: ways to break the connection's ring lane (RingLane, ring_completer).

mod common;

use std::os::unix::net::UnixStream;
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

fn serve(backend: &Arc<Backend>, config: ServerConfig) -> (Server, Client<UnixStream>, Serving) {
    serve_disk(Arc::clone(backend) as Arc<dyn Export>, SIZE, config, LIMIT)
}

/// F2: a panic in a backend call on the connection's own thread (its first fast worker)
/// unwinds out of `run_workers` without `ring.open = false` and `wake()`: the scope then
/// waits for the completion thread, which waits in `RingReads::wait` for ever. Before the
/// ring (and with a panic on any other worker) the panic ends the connection.
#[test]
fn a_backend_panic_on_the_connection_thread_still_ends_the_connection() {
    let backend = Backend::new();
    let config = ServerConfig {
        // The connection's own thread is the only fast worker: the panic lands there.
        fast_threads_per_connection: 1,
        ..ServerConfig::default()
    };
    let (server, mut client, handle) = serve(&backend, config);
    // A ring read first (the completion thread is busy for nothing), then the panic.
    assert!(client.read(0, BLOCK as u32).unwrap() == pattern(0, BLOCK));
    backend.panic_odd.store(true, Ordering::SeqCst);
    client.send(Command::Read, 0, BLOCK as u64, BLOCK as u32, &[]);
    assert!(
        client.at_eof(),
        "the panic closed the socket (AbortOnPanic)"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !handle.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let finished = handle.is_finished();
    let open = server.open_connections();
    if !finished {
        // Unstick it for the test process: the completion thread waits for this.
        backend.set(|s| s.woken = true);
        let t = Instant::now();
        while !handle.is_finished() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!(
            "after a wake-up sent by hand the connection ended: {} (ring.open stays true: the completer waits again)",
            handle.is_finished()
        );
    }
    assert!(
        finished,
        "the connection thread never ended after the panic ({open} connections open): the \
         completion thread waits in RingReads::wait for a wake-up nobody sends"
    );
    assert!(handle.join().is_err(), "the panic propagates");
}

/// F4: when the ring fails, RingLane's drop forgets every request in flight with its
/// InBackend guard and its lease: the server counts those requests inside the engine for
/// ever (`requests_in_backend`, what `serve`'s stop reports as stuck), and their request
/// memory is never given back to the server-wide pool.
#[test]
fn a_failed_ring_leaks_only_its_buffers_not_backend_counts_or_pool_memory() {
    let backend = Backend::new();
    let config = ServerConfig {
        max_request: 64 << 10,
        buffer_memory: 64 << 10,
        connection_buffer_memory: 64 << 10,
        buffer_wait: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let (server, mut client, handle) = serve(&backend, config);
    backend.set(|s| s.shut = true);
    for block in 0..8usize {
        client.send(
            Command::Read,
            0,
            (block * 2 * BLOCK) as u64,
            BLOCK as u32,
            &[],
        );
    }
    let deadline = Instant::now() + LIMIT;
    while backend.started.load(Ordering::SeqCst) < 8 {
        assert!(Instant::now() < deadline, "never started");
        std::thread::sleep(Duration::from_millis(2));
    }
    backend.set(|s| s.fail = true);
    assert!(handle.join().unwrap().is_err());
    assert!(client.at_eof());
    backend.set(|s| {
        s.fail = false;
        s.shut = false;
        s.queue.clear();
    });
    std::thread::sleep(Duration::from_millis(200));
    let inside = server.requests_in_backend();
    let memory = server.buffer_memory_in_use();
    eprintln!("after the failed connection closed: {inside} requests inside the backend, {memory} bytes of request memory held");
    // A new connection: reads of 64 KiB cannot get memory any more (32 KiB is leaked).
    let (mine, theirs) = UnixStream::pair().unwrap();
    mine.set_read_timeout(Some(LIMIT)).unwrap();
    let serving = server.clone();
    let second = std::thread::spawn(move || serving.serve_stream(theirs));
    let mut client = Client::go(mine, "disk");
    let big = client.read(BLOCK as u64, 64 << 10);
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(second.join().unwrap().is_ok());
    assert_eq!(
        (inside, big.is_ok()),
        (0, true),
        "requests counted inside the backend with no connection open; a 64 KiB read on a \
         new connection: {big:?} (the pool's memory is leaked)"
    );
}
