//! review19: tries to break the NBD side of batched cache hits (issue 11) with pipelined
//! mixes, an error inside a batch, hundreds of unread replies, and disconnect or shutdown
//! while a batch is held in the export.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::{
    BatchedRead, Command, Errno, Export, Lane, Server, ServerConfig, MAX_READ_BATCH,
};

const SIZE: u64 = 16 << 20;
const LIMIT: Duration = Duration::from_secs(20);
/// `read_many` fails the read at this offset with EIO (test 5).
const FAILING_OFFSET: u64 = 5 * BLOCK as u64;

/// Memory served with every READ on the fast lane; the first batch waits at a gate.
struct GatedExport {
    data: Mutex<Vec<u8>>,
    gate: Mutex<bool>,
    opened: Condvar,
    batches: Mutex<Vec<usize>>,
    fail_one: bool,
}

impl GatedExport {
    fn new(fail_one: bool) -> Arc<GatedExport> {
        let data = (0..SIZE as usize / BLOCK)
            .flat_map(|i| pattern(i as u8, BLOCK))
            .collect();
        Arc::new(GatedExport {
            data: Mutex::new(data),
            gate: Mutex::new(false),
            opened: Condvar::new(),
            batches: Mutex::new(Vec::new()),
            fail_one,
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

impl Export for GatedExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
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
    fn lane(&self, command: Command, _offset: u64, _length: u64) -> Lane {
        if command == Command::Read {
            Lane::Fast
        } else {
            Lane::Slow
        }
    }
    fn batches_reads(&self) -> bool {
        true
    }
    fn read_many(&self, reads: &mut [BatchedRead<'_>]) {
        let first = {
            let mut batches = self.batches.lock().unwrap();
            batches.push(reads.len());
            batches.len() == 1
        };
        if first {
            let gate = self.gate.lock().unwrap();
            let _ = self
                .opened
                .wait_timeout_while(gate, LIMIT, |open| !*open)
                .unwrap();
        }
        for read in reads {
            if self.fail_one && read.offset == FAILING_OFFSET {
                read.result = Err(Errno::Io);
                continue;
            }
            self.copy_out(read.offset, read.buf);
            read.result = Ok(());
        }
    }
}

fn connect(backend: &Arc<GatedExport>) -> (Server, Client<UnixStream>, Serving) {
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

fn wait_for_first_batch(backend: &GatedExport) {
    let deadline = Instant::now() + LIMIT;
    while backend.batches.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no batch reached the export");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Joins `handle` within `limit`, or fails (a hang).
fn join_within(handle: Serving, limit: Duration) -> Result<(), ssdcache_nbd::ConnectionError> {
    let deadline = Instant::now() + limit;
    while !handle.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the connection did not end in {limit:?}"
        );
        thread::sleep(Duration::from_millis(5));
    }
    handle.join().unwrap()
}

/// What a reply may hold: any of these contents (a READ racing a WRITE to its offsets may
/// see either), or just success / just an error.
enum Want {
    OneOf(Vec<Vec<u8>>),
    Ok,
    Error,
    Either,
}

fn check_replies(client: &mut Client<UnixStream>, mut expected: HashMap<u64, Want>) {
    for _ in 0..expected.len() {
        let reply = client.recv();
        let want = expected
            .remove(&reply.cookie)
            .expect("one reply per request");
        match want {
            Want::OneOf(options) => {
                assert_eq!(reply.error, 0, "request {} failed", reply.cookie);
                assert!(
                    options.contains(&reply.data),
                    "request {} got wrong data",
                    reply.cookie
                );
            }
            Want::Ok => assert_eq!(reply.error, 0, "request {} failed", reply.cookie),
            Want::Error => assert_ne!(reply.error, 0, "request {} succeeded", reply.cookie),
            Want::Either => {}
        }
    }
    assert!(expected.is_empty());
}

fn block_bytes(seed: u64, blocks: usize) -> Vec<u8> {
    (0..blocks)
        .flat_map(|i| pattern((seed + i as u64) as u8, BLOCK))
        .collect()
}

/// (1) Many READs of different offsets and lengths, WRITEs to the same offsets, FLUSH, TRIM,
/// a READ past the end and an unaligned READ, all pipelined behind a held batch.
#[test]
fn r19_1_mixed_pipeline_replies_carry_right_handle_and_data() {
    let backend = GatedExport::new(false);
    let (_server, mut client, handle) = connect(&backend);
    let mut expected = HashMap::new();
    let first = client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    expected.insert(first, Want::OneOf(vec![pattern(0, BLOCK)]));
    wait_for_first_batch(&backend);
    for i in 1..=120u64 {
        let block = (i * 7) % 200 + 1;
        let blocks = (i % 4 + 1) as usize;
        let old = block_bytes(block, blocks);
        let new = vec![0xA5u8; blocks * BLOCK];
        let cookie = client.send(
            Command::Read,
            0,
            block * BLOCK as u64,
            (blocks * BLOCK) as u32,
            &[],
        );
        // Reads that may overlap a block written in flight (every fifth) only need success.
        expected.insert(
            cookie,
            if block % 5 == 0 {
                Want::Ok
            } else {
                Want::OneOf(vec![old])
            },
        );
        match i % 10 {
            0 => {
                // A one-block write to a multiple of five: reads covering it are `Want::Ok`.
                let target = ((i * 7) % 200 + 1) / 5 * 5;
                let target = if target == 0 { 5 } else { target };
                let w = client.send(
                    Command::Write,
                    0,
                    target * BLOCK as u64,
                    BLOCK as u32,
                    &new[..BLOCK],
                );
                expected.insert(w, Want::Ok);
            }
            3 => {
                let f = client.send(Command::Flush, 0, 0, 0, &[]);
                expected.insert(f, Want::Ok);
            }
            5 => {
                let t = client.send(Command::Trim, 0, 300 * BLOCK as u64, BLOCK as u32, &[]);
                expected.insert(t, Want::Ok);
            }
            7 => {
                let past =
                    client.send(Command::Read, 0, SIZE - BLOCK as u64, 2 * BLOCK as u32, &[]);
                expected.insert(past, Want::Error);
                let unaligned = client.send(Command::Read, 0, 1000 * BLOCK as u64 + 1, 100, &[]);
                // Unaligned reads are legal NBD here; their bytes are checked alone below.
                expected.insert(unaligned, Want::Either);
            }
            _ => {}
        }
    }
    backend.open();
    check_replies(&mut client, expected);
    // Unaligned read, alone, returns the right bytes or an error (never wrong bytes).
    match client.read(1000 * BLOCK as u64 + 1, 100) {
        Ok(data) => assert_eq!(data, block_bytes(1000, 1)[1..101].to_vec()),
        Err(errno) => assert_ne!(errno, 0),
    }
    let batches = backend.batches.lock().unwrap().clone();
    assert!(batches.iter().all(|&n| n <= MAX_READ_BATCH), "{batches:?}");
    assert!(batches.iter().any(|&n| n > 1), "no real batch: {batches:?}");
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(join_within(handle, LIMIT).is_ok());
}

/// (2) The payload of a request in a batch is not there at once: the header of a WRITE
/// arrives, then READs wait behind it; and a READ header arrives in two pieces.
#[test]
fn r19_2_split_request_bytes_inside_a_batch() {
    let backend = GatedExport::new(false);
    let (_server, mut client, handle) = connect(&backend);
    let first = client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    wait_for_first_batch(&backend);
    let mut expected = HashMap::new();
    expected.insert(first, Want::OneOf(vec![pattern(0, BLOCK)]));
    for i in 1..10u64 {
        let c = client.send(Command::Read, 0, i * BLOCK as u64, BLOCK as u32, &[]);
        expected.insert(c, Want::OneOf(vec![pattern(i as u8, BLOCK)]));
    }
    // A READ header split in two writes with a pause in between, while the batch is open.
    let mut raw = client.stream.try_clone().unwrap();
    let header = ssdcache_nbd::RequestHeader {
        flags: 0,
        command: Command::Read,
        cookie: 9_999,
        offset: 42 * BLOCK as u64,
        length: BLOCK as u32,
    }
    .encode();
    raw.write_all(&header[..11]).unwrap();
    backend.open();
    thread::sleep(Duration::from_millis(200));
    raw.write_all(&header[11..]).unwrap();
    check_replies(&mut client, expected);
    // The split request's reply: read by hand (the client does not know the cookie).
    let mut head = [0u8; 16];
    std::io::Read::read_exact(&mut client.stream, &mut head).unwrap();
    assert_eq!(u32::from_be_bytes(head[4..8].try_into().unwrap()), 0);
    assert_eq!(u64::from_be_bytes(head[8..16].try_into().unwrap()), 9_999);
    let mut data = vec![0u8; BLOCK];
    std::io::Read::read_exact(&mut client.stream, &mut data).unwrap();
    assert_eq!(data, pattern(42, BLOCK));
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(join_within(handle, LIMIT).is_ok());
}

/// (3) Hundreds of READs sent without reading a reply, then all replies read: no stall,
/// nothing lost, bounded time.
#[test]
fn r19_3_hundreds_of_unread_reads_then_all_replies() {
    const COUNT: u64 = 600;
    let backend = GatedExport::new(false);
    backend.open();
    let (_server, client, handle) = connect(&backend);
    let mut sender = client.stream.try_clone().unwrap();
    let started = Instant::now();
    let sending = thread::spawn(move || {
        for i in 0..COUNT {
            let header = ssdcache_nbd::RequestHeader {
                flags: 0,
                command: Command::Read,
                cookie: 1_000 + i,
                offset: (i % 4000) * BLOCK as u64,
                length: BLOCK as u32,
            }
            .encode();
            sender.write_all(&header).unwrap();
        }
    });
    // Do not read for a while: the server must hold, not drop, what it cannot send yet.
    thread::sleep(Duration::from_millis(500));
    let mut stream = client.stream;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..COUNT {
        let mut head = [0u8; 16];
        std::io::Read::read_exact(&mut stream, &mut head).expect("a reply in time");
        assert_eq!(u32::from_be_bytes(head[4..8].try_into().unwrap()), 0);
        let cookie = u64::from_be_bytes(head[8..16].try_into().unwrap());
        let i = cookie - 1_000;
        assert!(
            i < COUNT && seen.insert(cookie),
            "bad or repeated cookie {cookie}"
        );
        let mut data = vec![0u8; BLOCK];
        std::io::Read::read_exact(&mut stream, &mut data).unwrap();
        assert_eq!(data, pattern((i % 4000) as u8, BLOCK), "cookie {cookie}");
    }
    sending.join().unwrap();
    assert!(started.elapsed() < LIMIT, "took {:?}", started.elapsed());
    drop(stream);
    let _ = join_within(handle, LIMIT);
}

/// (4a) The client goes away while a batch is held in the export.
#[test]
fn r19_4a_disconnect_with_a_batch_in_flight() {
    let backend = GatedExport::new(false);
    let (_server, mut client, handle) = connect(&backend);
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    wait_for_first_batch(&backend);
    for i in 1..40u64 {
        client.send(Command::Read, 0, i * BLOCK as u64, BLOCK as u32, &[]);
    }
    drop(client);
    thread::sleep(Duration::from_millis(100));
    backend.open();
    let _ = join_within(handle, LIMIT);
}

/// (4b) Shutdown, then force_close, while a batch is held: the connection ends in bounded
/// time even though the export holds the batch until the gate opens (LIMIT).
#[test]
fn r19_4b_shutdown_with_a_batch_in_flight() {
    let backend = GatedExport::new(false);
    let (server, mut client, handle) = connect(&backend);
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    wait_for_first_batch(&backend);
    for i in 1..40u64 {
        client.send(Command::Read, 0, i * BLOCK as u64, BLOCK as u32, &[]);
    }
    server.shutdown();
    thread::sleep(Duration::from_millis(200));
    server.force_close();
    let opener = {
        let backend = Arc::clone(&backend);
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(500));
            backend.open();
        })
    };
    let _ = join_within(handle, LIMIT);
    opener.join().unwrap();
}

/// (5) read_many fails one read of a batch: only that reply is an error.
#[test]
fn r19_5_one_failed_read_in_a_batch_fails_only_its_reply() {
    let backend = GatedExport::new(true);
    let (_server, mut client, handle) = connect(&backend);
    let mut expected = HashMap::new();
    let first = client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    expected.insert(first, Want::OneOf(vec![pattern(0, BLOCK)]));
    wait_for_first_batch(&backend);
    for i in 1..20u64 {
        let c = client.send(Command::Read, 0, i * BLOCK as u64, BLOCK as u32, &[]);
        let want = if i * BLOCK as u64 == FAILING_OFFSET {
            Want::Error
        } else {
            Want::OneOf(vec![pattern(i as u8, BLOCK)])
        };
        expected.insert(c, want);
    }
    backend.open();
    check_replies(&mut client, expected);
    assert!(backend.batches.lock().unwrap().iter().any(|&n| n > 1));
    assert_eq!(
        client.read(6 * BLOCK as u64, BLOCK as u32),
        Ok(pattern(6, BLOCK))
    );
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(join_within(handle, LIMIT).is_ok());
}
