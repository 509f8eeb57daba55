//! Fast READs already received are served in batches (issue 11): one `Export::read_many`
//! per batch, replies in one writev, and every other request the usual way in between.

mod common;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use common::*;
use ssdcache_nbd::{
    BatchedRead, Command, Errno, Export, Lane, Server, ServerConfig, MAX_READ_BATCH,
};

const SIZE: u64 = 16 << 20;
/// Reads below this offset are fast; the rest (and every write) slow.
const SLOW_FROM: u64 = 8 << 20;
const LIMIT: Duration = Duration::from_secs(10);

/// Memory whose block `i` starts as `pattern(i)`; the first batch waits at a gate (so the
/// test can queue requests behind it), and the size of every batch is kept.
struct BatchExport {
    data: Mutex<Vec<u8>>,
    gate: Mutex<bool>,
    opened: Condvar,
    batches: Mutex<Vec<usize>>,
    single_reads: AtomicUsize,
    /// What `batches_reads` answers.
    batching: bool,
}

impl BatchExport {
    fn new(batching: bool) -> Arc<BatchExport> {
        let data = (0..SIZE as usize / BLOCK)
            .flat_map(|i| pattern(i as u8, BLOCK))
            .collect();
        Arc::new(BatchExport {
            data: Mutex::new(data),
            gate: Mutex::new(false),
            opened: Condvar::new(),
            batches: Mutex::new(Vec::new()),
            single_reads: AtomicUsize::new(0),
            batching,
        })
    }

    fn open(&self) {
        *self.gate.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn copy_out(&self, offset: u64, buf: &mut [u8]) {
        let data = self.data.lock().unwrap();
        buf.copy_from_slice(&data[offset as usize..offset as usize + buf.len()]);
    }
}

impl Export for BatchExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.single_reads.fetch_add(1, Ordering::SeqCst);
        self.copy_out(offset, buf);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        self.data.lock().unwrap()[offset as usize..offset as usize + data.len()]
            .copy_from_slice(data);
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
    fn lane(&self, command: Command, offset: u64, _length: u64) -> Lane {
        if command == Command::Read && offset < SLOW_FROM {
            Lane::Fast
        } else {
            Lane::Slow
        }
    }
    fn batches_reads(&self) -> bool {
        self.batching
    }
    fn read_many(&self, reads: &mut [BatchedRead<'_>]) {
        let first = {
            let mut batches = self.batches.lock().unwrap();
            batches.push(reads.len());
            batches.len() == 1
        };
        if first {
            let gate = self.gate.lock().unwrap();
            let (open, _) = self
                .opened
                .wait_timeout_while(gate, LIMIT, |open| !*open)
                .unwrap();
            assert!(*open, "the test never opened the gate");
        }
        for read in reads {
            self.copy_out(read.offset, read.buf);
            read.result = Ok(());
        }
    }
}

/// A server with one fast worker per connection over `backend`, and a negotiated client.
fn connect(backend: &Arc<BatchExport>) -> (Server, Client<UnixStream>, Serving) {
    serve_disk(
        Arc::clone(backend) as Arc<dyn Export>,
        SIZE,
        ServerConfig {
            fast_threads_per_connection: 1,
            ..ServerConfig::default()
        },
        LIMIT,
    )
}

/// Waits (bounded) until the first batch is at the gate.
fn wait_for_first_batch(backend: &BatchExport) {
    let deadline = std::time::Instant::now() + LIMIT;
    while backend.batches.lock().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "no batch reached the export"
        );
        thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn an_export_that_does_not_batch_gets_one_read_at_a_time() {
    let backend = BatchExport::new(false);
    let (_server, mut client, handle) = connect(&backend);
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    wait_for_first_batch(&backend);
    for i in 1..20u64 {
        client.send(Command::Read, 0, i * BLOCK as u64, BLOCK as u32, &[]);
    }
    backend.open();
    for _ in 0..20 {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
        assert_eq!(reply.data, pattern((reply.cookie - 1) as u8, BLOCK));
    }
    let batches = backend.batches.lock().unwrap().clone();
    assert_eq!(batches, vec![1; 20], "every read on its own");
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}

#[test]
fn reads_received_together_are_served_as_one_batch_between_other_requests() {
    let backend = BatchExport::new(true);
    let (_server, mut client, handle) = connect(&backend);

    // The first READ holds the only fast worker at the gate while the rest arrive.
    let mut expected: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    let first = client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    expected.insert(first, Some(pattern(0, BLOCK)));
    wait_for_first_batch(&backend);
    for i in 1..=40u64 {
        let block = i * 3 % 2048;
        let cookie = client.send(Command::Read, 0, block * BLOCK as u64, BLOCK as u32, &[]);
        expected.insert(cookie, Some(pattern(block as u8, BLOCK)));
        if i == 10 {
            // A slow READ, a WRITE, an invalid READ: each goes the usual way between
            // batches.
            let slow = client.send(Command::Read, 0, SLOW_FROM, BLOCK as u32, &[]);
            expected.insert(slow, Some(pattern((SLOW_FROM / BLOCK as u64) as u8, BLOCK)));
            let write = client.send(
                Command::Write,
                0,
                2047 * BLOCK as u64,
                BLOCK as u32,
                &pattern(99, BLOCK),
            );
            expected.insert(write, None);
            let past_end = client.send(Command::Read, 0, SIZE, BLOCK as u32, &[]);
            expected.insert(past_end, None);
        }
    }
    backend.open();
    for _ in 0..expected.len() {
        let reply = client.recv();
        let wanted = expected.remove(&reply.cookie).expect("a reply per request");
        if let Some(data) = wanted {
            assert_eq!(reply.error, 0, "request {} failed", reply.cookie);
            assert!(
                reply.data == data,
                "request {} got wrong data",
                reply.cookie
            );
        }
    }
    assert!(expected.is_empty());
    // After the write's reply, reads of its block see it.
    assert_eq!(
        client.read(2047 * BLOCK as u64, BLOCK as u32),
        Ok(pattern(99, BLOCK))
    );

    let batches = backend.batches.lock().unwrap().clone();
    assert!(
        batches.iter().any(|&n| n > 1),
        "no batch of several reads: {batches:?}"
    );
    assert!(
        batches.iter().all(|&n| n <= MAX_READ_BATCH),
        "a batch too big: {batches:?}"
    );
    assert_eq!(
        batches.iter().sum::<usize>() + backend.single_reads.load(Ordering::SeqCst),
        43,
        "each read served once"
    );
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
}
