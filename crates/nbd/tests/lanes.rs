//! The two worker lanes of a connection (issue #11): a request the export calls fast is read
//! and answered while every slow worker waits for the slow device and more slow requests
//! queue; a graceful shutdown still answers the queued ones; a full slow queue stops reading.

mod common;

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::{
    Command, ConnectionError, Errno, Export, Lane, Server, ServerConfig, SLOW_LANE_QUEUE,
};

const SIZE: u64 = 64 << 20;
/// Reads below this offset are fast (and answered at once); everything else is slow.
const SLOW_FROM: u64 = 32 << 20;
/// Byte every fast read returns.
const FAST_BYTE: u8 = 0xfa;
/// How long a bounded wait in these tests lasts before the test fails.
const LIMIT: Duration = Duration::from_secs(10);

/// An export with a fast region (reads there return [`FAST_BYTE`] at once) whose slow
/// requests wait at a gate, counting how many wait at once. The gate gives up after
/// [`LIMIT`] so a broken test fails instead of hanging.
struct LaneExport {
    open: Mutex<bool>,
    opened: Condvar,
    inside: AtomicUsize,
    most_inside: AtomicUsize,
    slow_done: AtomicUsize,
}

impl LaneExport {
    fn new() -> Arc<LaneExport> {
        Arc::new(LaneExport {
            open: Mutex::new(false),
            opened: Condvar::new(),
            inside: AtomicUsize::new(0),
            most_inside: AtomicUsize::new(0),
            slow_done: AtomicUsize::new(0),
        })
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn inside(&self) -> usize {
        self.inside.load(Ordering::SeqCst)
    }

    fn slow_done(&self) -> usize {
        self.slow_done.load(Ordering::SeqCst)
    }

    fn wait_at_gate(&self) -> Result<(), Errno> {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_inside.fetch_max(now, Ordering::SeqCst);
        let open = self.open.lock().unwrap();
        let (open, _) = self
            .opened
            .wait_timeout_while(open, LIMIT, |open| !*open)
            .unwrap();
        self.inside.fetch_sub(1, Ordering::SeqCst);
        self.slow_done.fetch_add(1, Ordering::SeqCst);
        if *open {
            Ok(())
        } else {
            Err(Errno::Io)
        }
    }
}

impl Export for LaneExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        if offset < SLOW_FROM {
            buf.fill(FAST_BYTE);
            return Ok(());
        }
        self.wait_at_gate()
    }
    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<(), Errno> {
        self.wait_at_gate()
    }
    fn flush(&self) -> Result<(), Errno> {
        self.wait_at_gate()
    }
    fn trim(&self, _offset: u64, _length: u64, _fua: bool) -> Result<(), Errno> {
        self.wait_at_gate()
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), Errno> {
        self.wait_at_gate()
    }
    fn cache(&self, _offset: u64, _length: u64) -> Result<(), Errno> {
        self.wait_at_gate()
    }
    fn lane(&self, command: Command, offset: u64, _length: u64) -> Lane {
        if command == Command::Read && offset < SLOW_FROM {
            Lane::Fast
        } else {
            Lane::Slow
        }
    }
}

/// A server, its export, and a client connected and negotiated, with the connection's thread.
struct Connected {
    server: Server,
    backend: Arc<LaneExport>,
    client: Client<UnixStream>,
    handle: JoinHandle<Result<(), ConnectionError>>,
}

/// A server with `slow` slow workers and one fast worker per connection, and a connected,
/// negotiated client whose reads give up after [`LIMIT`].
fn connect(slow: usize) -> Connected {
    let backend = LaneExport::new();
    let config = ServerConfig {
        threads_per_connection: slow,
        fast_threads_per_connection: 1,
        ..ServerConfig::default()
    };
    let (server, client, handle) =
        serve_disk(Arc::clone(&backend) as Arc<dyn Export>, SIZE, config, LIMIT);
    Connected {
        server,
        backend,
        client,
        handle,
    }
}

fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(2));
    }
}

fn slow_read(client: &mut Client<UnixStream>, i: u64) -> u64 {
    client.send(
        Command::Read,
        0,
        SLOW_FROM + i * BLOCK as u64,
        BLOCK as u32,
        &[],
    )
}

fn fast_read(client: &mut Client<UnixStream>) -> u64 {
    client.send(Command::Read, 0, 0, BLOCK as u32, &[])
}

/// Receives `count` replies, all successful, whatever their order.
fn expect_successes(client: &mut Client<UnixStream>, count: usize) {
    for _ in 0..count {
        let reply = client.recv();
        assert_eq!(reply.error, 0, "request {} failed", reply.cookie);
    }
}

#[test]
fn a_fast_read_is_answered_while_slow_requests_hold_every_slow_worker() {
    let Connected {
        backend,
        mut client,
        handle,
        ..
    } = connect(2);
    // Two slow reads take both slow workers; a slow write and a FLUSH queue behind them.
    for i in 0..2 {
        slow_read(&mut client, i);
    }
    client.send(
        Command::Write,
        0,
        SLOW_FROM,
        BLOCK as u32,
        &pattern(3, BLOCK),
    );
    client.send(Command::Flush, 0, 0, 0, &[]);
    eventually("both slow workers at the gate", || backend.inside() == 2);

    let fast = fast_read(&mut client);
    let reply = client.recv();
    assert_eq!(reply.cookie, fast, "the fast read is answered first");
    assert_eq!(reply.error, 0);
    assert!(reply.data.iter().all(|&b| b == FAST_BYTE));
    assert_eq!(
        (backend.inside(), backend.slow_done()),
        (2, 0),
        "the slow requests were still blocked when the fast reply arrived"
    );

    backend.open();
    expect_successes(&mut client, 4);
    assert_eq!(
        backend.most_inside.load(Ordering::SeqCst),
        2,
        "threads_per_connection bounds the slow requests in the backend"
    );
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}

#[test]
fn a_graceful_shutdown_answers_the_queued_slow_requests() {
    let Connected {
        server,
        backend,
        mut client,
        handle,
    } = connect(1);
    for i in 0..3 {
        slow_read(&mut client, i);
    }
    // Requests are read in order: the fast reply shows the slow ones were read and queued
    // (the slow worker, started on demand, reaches the gate in its own time).
    let fast = fast_read(&mut client);
    assert_eq!(client.recv().cookie, fast);
    eventually("the slow worker at the gate", || backend.inside() == 1);

    server.shutdown();
    backend.open();
    expect_successes(&mut client, 3);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
    assert!(server.wait_idle_timeout(LIMIT));
}

#[test]
fn a_full_slow_queue_stops_reading_until_a_slow_worker_frees_room() {
    let Connected {
        backend,
        mut client,
        handle,
        ..
    } = connect(1);
    // One slow read in the backend, SLOW_LANE_QUEUE queued, one more held by the reader.
    let slow = 1 + SLOW_LANE_QUEUE + 1;
    for i in 0..slow {
        slow_read(&mut client, i as u64);
    }
    fast_read(&mut client);
    eventually("a slow read at the gate", || backend.inside() == 1);
    client
        .stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut byte = [0u8; 1];
    let early = client.stream.read(&mut byte);
    assert!(
        matches!(&early, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "nothing is answered while the slow queue is full: {early:?}"
    );
    client.stream.set_read_timeout(Some(LIMIT)).unwrap();

    backend.open();
    expect_successes(&mut client, slow + 1);
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}
