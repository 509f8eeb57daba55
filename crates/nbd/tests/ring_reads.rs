//! READs ended on the connection's completion thread (`Export::ring_reads`, issue 11): the
//! thread that reads requests starts them and goes on; each reply leaves when its read ends;
//! a disconnect waits for reads in flight; a ring that fails closes only its connection.

mod common;

use std::collections::{HashMap, VecDeque};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::{Command, Errno, Export, Lane, RingReads, RingStart, Server, ServerConfig};

const SIZE: u64 = 16 << 20;
const LIMIT: Duration = Duration::from_secs(10);

/// Memory whose block `i` holds `pattern(i)`. The ring takes READs of even blocks; it ends
/// them only while the gate is open, and fails its `wait` once told to.
struct RingExport {
    data: Vec<u8>,
    ring: Mutex<RingState>,
    changed: Condvar,
    started: AtomicUsize,
    worker_reads: AtomicUsize,
}

#[derive(Default)]
struct RingState {
    /// (tag, offset, buffer address, length) of the reads started and not ended.
    queue: VecDeque<(u64, u64, usize, usize)>,
    open: bool,
    woken: bool,
    fail: bool,
    /// Blocks 2, 6, 10... end unserved.
    unserved_every_other: bool,
}

impl RingExport {
    fn new() -> Arc<RingExport> {
        let data = (0..SIZE as usize / BLOCK)
            .flat_map(|i| pattern(i as u8, BLOCK))
            .collect();
        Arc::new(RingExport {
            data,
            ring: Mutex::new(RingState::default()),
            changed: Condvar::new(),
            started: AtomicUsize::new(0),
            worker_reads: AtomicUsize::new(0),
        })
    }

    fn set(&self, change: impl FnOnce(&mut RingState)) {
        change(&mut self.ring.lock().unwrap());
        self.changed.notify_all();
    }

    fn wait_for_started(&self, count: usize) {
        let deadline = Instant::now() + LIMIT;
        while self.started.load(Ordering::SeqCst) < count {
            assert!(
                Instant::now() < deadline,
                "the ring never started {count} reads"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

fn block_of(offset: u64) -> usize {
    offset as usize / BLOCK
}

impl Export for RingExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.worker_reads.fetch_add(1, Ordering::SeqCst);
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
        Some(Box::new(TestRing(self)))
    }
}

struct TestRing<'e>(&'e RingExport);

impl RingReads for TestRing<'_> {
    unsafe fn start(&self, reads: &mut [RingStart]) {
        let mut state = self.0.ring.lock().unwrap();
        for read in reads
            .iter_mut()
            .filter(|r| block_of(r.offset).is_multiple_of(2))
        {
            state
                .queue
                .push_back((read.tag, read.offset, read.buf as usize, read.len));
            read.started = true;
            self.0.started.fetch_add(1, Ordering::SeqCst);
        }
        self.0.changed.notify_all();
    }
    fn wait(&self, ended: &mut Vec<(u64, bool)>) -> std::io::Result<()> {
        let state = self.0.ring.lock().unwrap();
        let (mut state, _) = self
            .0
            .changed
            .wait_timeout_while(state, LIMIT, |s| {
                let ready = s.open && !s.queue.is_empty();
                !s.fail && !s.woken && !ready
            })
            .unwrap();
        if state.fail {
            return Err(std::io::Error::other("the test broke the ring"));
        }
        state.woken = false;
        if !state.open {
            return Ok(());
        }
        let unserved_every_other = state.unserved_every_other;
        for (tag, offset, buf, len) in state.queue.drain(..) {
            if unserved_every_other && block_of(offset) % 4 == 2 {
                // A damaged hit: nothing useful in the buffer; served again by a worker.
                ended.push((tag, false));
                continue;
            }
            let source = &self.0.data[offset as usize..offset as usize + len];
            // SAFETY: the connection keeps the buffer to itself until this reports its tag.
            unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), buf as *mut u8, len) };
            ended.push((tag, true));
        }
        Ok(())
    }
    fn wake(&self) {
        self.0.set(|s| s.woken = true);
    }
}

fn connect(backend: &Arc<RingExport>) -> (Server, Client<UnixStream>, Serving) {
    serve_disk(
        Arc::clone(backend) as Arc<dyn Export>,
        SIZE,
        ServerConfig::default(),
        LIMIT,
    )
}

fn expect_block(reply: &Reply, cookies: &HashMap<u64, usize>) {
    let block = cookies[&reply.cookie];
    assert_eq!(reply.error, 0, "read of block {block} failed");
    assert!(
        reply.data == pattern(block as u8, BLOCK),
        "block {block}: wrong data"
    );
}

#[test]
fn reads_in_the_ring_do_not_hold_up_the_others() {
    let backend = RingExport::new();
    let (_server, mut client, handle) = connect(&backend);
    let mut cookies = HashMap::new();
    for block in 0..40usize {
        let cookie = client.send(Command::Read, 0, (block * BLOCK) as u64, BLOCK as u32, &[]);
        cookies.insert(cookie, block);
    }
    backend.wait_for_started(20);
    // The gate is shut: the 20 odd blocks, served by workers, come back first.
    for _ in 0..20 {
        let reply = client.recv();
        assert_eq!(
            cookies[&reply.cookie] % 2,
            1,
            "a ring read ended with the gate shut"
        );
        expect_block(&reply, &cookies);
    }
    backend.set(|s| s.open = true);
    for _ in 0..20 {
        let reply = client.recv();
        assert_eq!(cookies[&reply.cookie] % 2, 0);
        expect_block(&reply, &cookies);
    }
    assert_eq!(backend.worker_reads.load(Ordering::SeqCst), 20);
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}

#[test]
fn a_disconnect_is_answered_after_the_reads_in_flight() {
    let backend = RingExport::new();
    let (_server, mut client, handle) = connect(&backend);
    let mut cookies = HashMap::new();
    for block in (0..16usize).map(|i| i * 2) {
        let cookie = client.send(Command::Read, 0, (block * BLOCK) as u64, BLOCK as u32, &[]);
        cookies.insert(cookie, block);
    }
    backend.wait_for_started(16);
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !handle.is_finished(),
        "the connection ended with reads in flight"
    );
    backend.set(|s| s.open = true);
    for _ in 0..16 {
        expect_block(&client.recv(), &cookies);
    }
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}

#[test]
fn a_failing_ring_closes_its_connection_only() {
    let backend = RingExport::new();
    let (server, mut client, handle) = connect(&backend);
    for block in 0..8usize {
        client.send(
            Command::Read,
            0,
            (block * 2 * BLOCK) as u64,
            BLOCK as u32,
            &[],
        );
    }
    backend.wait_for_started(8);
    backend.set(|s| s.fail = true);
    let error = handle.join().unwrap().expect_err("the connection fails");
    assert!(
        error.to_string().contains("reading the cache device"),
        "{error}"
    );
    assert!(client.at_eof(), "the client sees the connection closed");
    // The server goes on: a new connection is served (through workers and the ring).
    backend.set(|s| {
        s.fail = false;
        s.queue.clear(); // the failed connection's buffers, leaked, are never touched
        s.open = true;
    });
    let (mine, theirs) = UnixStream::pair().unwrap();
    mine.set_read_timeout(Some(LIMIT)).unwrap();
    let serving = server.clone();
    let second = std::thread::spawn(move || serving.serve_stream(theirs));
    let mut client = Client::go(mine, "disk");
    for block in 0..4usize {
        assert!(
            client.read((block * BLOCK) as u64, BLOCK as u32).unwrap()
                == pattern(block as u8, BLOCK)
        );
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(second.join().unwrap().is_ok());
}

/// A ring READ that ends unserved (a damaged hit) is read again with `Export::read` by a
/// worker, not on the completion thread, and answered with the right data once.
#[test]
fn reads_the_ring_did_not_serve_are_read_again_by_a_worker() {
    let backend = RingExport::new();
    backend.set(|s| {
        s.open = true;
        s.unserved_every_other = true;
    });
    let (_server, mut client, handle) = connect(&backend);
    let mut cookies = HashMap::new();
    for block in (0..32usize).map(|i| i * 2) {
        let cookie = client.send(Command::Read, 0, (block * BLOCK) as u64, BLOCK as u32, &[]);
        cookies.insert(cookie, block);
    }
    for _ in 0..32 {
        expect_block(&client.recv(), &cookies);
    }
    assert_eq!(
        backend.worker_reads.load(Ordering::SeqCst),
        16,
        "each unserved ring read read again once"
    );
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}
