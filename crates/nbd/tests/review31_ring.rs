//! Review 31: ways to break the connection's ring lane (RingLane, ring_completer).

mod common;

use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ring_backend::{Backend, SIZE};
use common::*;
use ssdcache_nbd::{Command, Export, Server, ServerConfig};

const LIMIT: Duration = Duration::from_secs(10);

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
