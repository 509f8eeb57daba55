//! Review 43: attacks on the reply outbox (commit 871916f): one sender thread per connection
//! writing every reply from a bounded queue, `Buffer::Small` request buffers, TRIM /
//! WRITE_ZEROES pieces on chunk multiples.
//!
//! Every test bounds its loops in count and time and joins the connection with a deadline,
//! so a hang shows as a failed assertion, not a stuck test. `f2_*` measures the process's
//! RSS, so the file's tests take turns (`serial`).

mod common;

/// The tests of this file run one at a time: `f2_*` measures the process's RSS.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::ring_backend;
use common::*;
use ssdcache_nbd::proto::NBD_CMD_FLAG_FUA;
use ssdcache_nbd::{
    transmission_flags, Command, ConnectionError, Errno, Export, ExportInfo, Lane, RequestHeader,
    Server, ServerConfig, ServerExport, DATALESS_CHUNK_BYTES,
};

type Handle = JoinHandle<Result<(), ConnectionError>>;

const MIB: u64 = 1 << 20;

/// A byte-granular export (minimum block 1), as the server advertises since issue 13 item 1.
fn byte_info(size: u64) -> ExportInfo {
    ExportInfo {
        name: "disk".into(),
        description: "review 43".into(),
        size,
        flags: transmission_flags(false),
        min_block: 1,
        preferred_block: 4096,
        max_block: 32 << 20,
    }
}

fn setsockopt_int(fd: i32, option: libc::c_int, value: libc::c_int) {
    // SAFETY: a valid socket and an int option.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            &value as *const _ as *const libc::c_void,
            std::mem::size_of_val(&value) as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt");
}

/// A negotiated client over a socket pair; with `small_sndbuf` the server's end buffers
/// little, so replies stay in the outbox rather than in the kernel.
fn connect(server: &Server, small_sndbuf: bool) -> (Client<UnixStream>, Handle) {
    let (client, server_end) = UnixStream::pair().unwrap();
    if small_sndbuf {
        setsockopt_int(server_end.as_raw_fd(), libc::SO_SNDBUF, 4096);
    }
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let serving = server.clone();
    let handle = thread::spawn(move || serving.serve_stream(server_end));
    (Client::go(client, "disk"), handle)
}

fn finished_within(handle: &Handle, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while !handle.is_finished() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    handle.is_finished()
}

fn zero_read(cookie: u64) -> [u8; 28] {
    RequestHeader {
        flags: 0,
        command: Command::Read,
        cookie,
        offset: 0,
        length: 0,
    }
    .encode()
}

/// Sends `count` zero-length READs (no request memory, no backend call, a 16-byte reply
/// each) from another thread, without reading a reply. Returns the thread and how many
/// headers it wrote so far. It gives up once a write waits 3 s.
fn flood(stream: &UnixStream, count: usize) -> (JoinHandle<()>, Arc<AtomicUsize>) {
    let mut out = stream.try_clone().unwrap();
    out.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let progress = Arc::new(AtomicUsize::new(0));
    let written = Arc::clone(&progress);
    let handle = thread::spawn(move || {
        const CHUNK: usize = 512;
        let mut cookie = 1u64 << 40;
        let mut sent = 0;
        while sent < count {
            let mut bytes = Vec::with_capacity(CHUNK * 28);
            for _ in 0..CHUNK {
                bytes.extend_from_slice(&zero_read(cookie));
                cookie += 1;
            }
            if out.write_all(&bytes).is_err() {
                return;
            }
            sent += CHUNK;
            written.store(sent, Ordering::SeqCst);
        }
    });
    (handle, progress)
}

/// Waits until the flood stopped making progress for 700 ms with at least `at_least`
/// headers written (the server stopped reading: every worker waits for room in the outbox).
fn wait_for_stall(progress: &AtomicUsize, at_least: usize, limit: Duration) -> Option<usize> {
    let deadline = Instant::now() + limit;
    let mut last = progress.load(Ordering::SeqCst);
    let mut since = Instant::now();
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
        let now = progress.load(Ordering::SeqCst);
        if now != last {
            last = now;
            since = Instant::now();
        } else if now >= at_least && since.elapsed() > Duration::from_millis(700) {
            return Some(now);
        }
    }
    None
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

// ------------------------------------------------------------------------------------------
// Findings
// ------------------------------------------------------------------------------------------

/// F0: `BufferPool::take` asks `reuse` for a kept buffer BEFORE it filters out small
/// requests (`self.reuse(&mut state, size).filter(|_| !is_small(len))`). A request of
/// 4033..=4080 bytes has `buffer_size` = (len + 16) rounded to 64 = 4096, a kept class: `reuse`
/// pops a kept page and takes it off `kept_bytes`, the filter drops (frees) it, but
/// `state.charged` still counts it. Every such READ or WRITE after any 4 KiB request leaks
/// 4096 bytes of the SERVER-WIDE request memory for good: after `--request-memory` / 4 KiB
/// of them every request of every connection waits `buffer_wait` and fails ENOMEM.
#[test]
fn f0_reads_of_4080_bytes_leak_server_request_memory_until_every_request_fails() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let config = ServerConfig {
        max_request: 64 << 10,
        buffer_memory: 256 << 10,
        connection_buffer_memory: 256 << 10,
        buffer_wait: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let export = ServerExport {
        info: byte_info(MIB),
        backend,
    };
    let server = Server::new(vec![export], config).unwrap();
    let (mut client, handle) = connect(&server, false);
    let page = pattern(7, 4096);
    let started = Instant::now();
    let mut charged = Vec::new();
    let mut failed_at = None;
    for i in 0..80 {
        if started.elapsed() > Duration::from_secs(15) {
            break;
        }
        // A 4 KiB write: its page is kept for reuse when the request ends.
        let written = client.write(0, &page);
        // A 4080-byte read: `reuse` pops that page, the filter frees it, the charge stays.
        let read = client.read(0, 4080);
        charged.push(server.buffer_memory_in_use());
        if written != 0 || read.is_err() {
            failed_at = Some((i, written, read.err()));
            break;
        }
    }
    eprintln!(
        "server request memory charged after each write+read pair: {:?}...{:?}",
        &charged[..charged.len().min(4)],
        charged.last()
    );
    // A fresh connection finds the server's memory gone too.
    let (mut other, other_handle) = connect(&server, false);
    let fresh = other.read(0, 4096);
    other.send(Command::Disconnect, 0, 0, 0, &[]);
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(finished_within(&handle, Duration::from_secs(10)));
    assert!(finished_within(&other_handle, Duration::from_secs(10)));
    let idle_charge = server.buffer_memory_in_use();
    assert!(
        failed_at.is_none() && fresh.is_ok() && idle_charge <= 64 << 10,
        "request memory leaks: charged grows by 4096 per 4080-byte read ({:?}); the pair \
         failed at {failed_at:?} (errno 12 = ENOMEM); a 4 KiB read on a new connection: \
         {fresh:?}; {idle_charge} bytes still charged with no connection open (only kept \
         buffers, at most 64 KiB, should be)",
        &charged[..charged.len().min(6)]
    );
}

/// F1: the ring's completion thread now hands its replies to the shared outbox with
/// `push_all`, which WAITS while the outbox is full (connection.rs `ring_completer` ->
/// `queue_replies`). Before, the ring had its own unbounded (ring-bounded) reply list, so the
/// completer never waited for the client (review 31 F3). A client that fills the outbox with
/// 65,536 cheap replies (zero-length READs: no request memory) and stops reading now parks
/// the completer: hits still in the ring are not reaped, so in the engine their lines stay
/// locked (a write from another client to them waits), for up to --io-timeout (30 s), and
/// for as long as the client keeps trickling.
#[test]
fn f1_a_full_outbox_parks_the_ring_completer_and_leaves_ring_hits_unreaped() {
    let _serial = serial();
    let backend = ring_backend::Backend::new();
    let export = ServerExport {
        info: export_info("disk", ring_backend::SIZE, transmission_flags(false)),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, true);
    // Two ring hits, A (block 0) and B (block 2), in flight.
    backend.set(|s| s.shut = true);
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    client.send(Command::Read, 0, 2 * BLOCK as u64, BLOCK as u32, &[]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while backend.started.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        backend.started.load(Ordering::SeqCst),
        2,
        "both on the ring"
    );
    // Fill the outbox; the client reads nothing.
    let (flooder, progress) = flood(&client.stream, 160_000);
    let stalled = wait_for_stall(&progress, 70_000, Duration::from_secs(15));
    // A ends (the completer reaps it and queues its reply); B is held back for now.
    let mut held_back = None;
    backend.set(|s| {
        let at = s.queue.iter().position(|q| q.1 == 2 * BLOCK as u64);
        held_back = at.map(|at| s.queue.remove(at));
        s.shut = false;
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut a_reaped = false;
    while Instant::now() < deadline && !a_reaped {
        thread::sleep(Duration::from_millis(10));
        backend.set(|s| a_reaped = s.queue.is_empty());
    }
    thread::sleep(Duration::from_millis(200));
    // B ends now: a completer that is not waiting for the client reaps it at once.
    let b = held_back.expect("B was in the ring's queue");
    backend.set(|s| s.queue.push(b));
    let t = Instant::now();
    let mut b_reaped = false;
    while t.elapsed() < Duration::from_secs(3) && !b_reaped {
        thread::sleep(Duration::from_millis(10));
        backend.set(|s| b_reaped = s.queue.is_empty());
    }
    let waited = t.elapsed();
    // Clean up: the client goes away, the sender's write fails, the outbox fails.
    let _ = client.stream.shutdown(Shutdown::Both);
    let _ = flooder.join();
    let ended = finished_within(&handle, Duration::from_secs(10));
    assert!(
        stalled.is_some(),
        "the outbox never filled (flood never stalled)"
    );
    assert!(a_reaped, "A was never reaped");
    assert!(ended, "the connection did not end after the client closed");
    assert!(
        b_reaped,
        "a ring hit that ended was not reaped for {waited:?}: the completion thread waits in \
         Outbox::push_all for room that only the client's reading makes (review 31 F3 \
         again; io_timeout 30 s)"
    );
}

/// F2: each queued reply costs `size_of::<Reply>()` = 104 bytes (Request 96: header 32, lease
/// 48, in-flight guard), not the "about 40 bytes" docs/design.md §6's limits table and
/// `REPLY_QUEUE`'s doc claim (2.5 MiB a connection): 65,536 replies holding no request memory
/// at all take 6.8 MiB per connection (870 MiB at 128 connections), none of it counted by
/// --request-memory, and the VecDeque keeps that capacity for the connection's life.
#[test]
fn f2_a_full_outbox_costs_more_than_the_documented_bound() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let export = ServerExport {
        info: export_info("disk", MIB, transmission_flags(false)),
        backend,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, true);
    // Warm up: every slow worker started, the pool touched.
    for i in 0..400u64 {
        client.stream.write_all(&zero_read(i + 10)).unwrap();
    }
    let mut header = [0u8; 16];
    for _ in 0..400 {
        client.stream.read_exact(&mut header).unwrap();
    }
    thread::sleep(Duration::from_millis(200));
    let before = rss_bytes();
    let (flooder, progress) = flood(&client.stream, 160_000);
    let stalled = wait_for_stall(&progress, 70_000, Duration::from_secs(15));
    let full = rss_bytes();
    let held_memory = server.buffer_memory_in_use();
    let _ = client.stream.shutdown(Shutdown::Both);
    let _ = flooder.join();
    assert!(finished_within(&handle, Duration::from_secs(10)));
    let grew = full.saturating_sub(before);
    eprintln!(
        "RSS grew {} KiB with the outbox full ({} KiB of request memory charged); documented: \
         65,536 x 104 B = 6656 KiB",
        grew >> 10,
        held_memory >> 10
    );
    assert!(stalled.is_some(), "the outbox never filled");
    assert!(
        grew < 65536 * 104 * 3 / 2,
        "a full outbox of replies that hold no request memory grew the process by {} KiB, \
         past 1.5 x the documented 6.5 MiB (104 bytes a reply)",
        grew >> 10
    );
}

/// F3: the sender batches up to 32 replies of ANY kind per `writev`, each call under ONE
/// --io-timeout deadline (connection.rs `sender` -> `send_replies` -> `write_all_by`). Before,
/// a slow-lane reply (a cache miss) was its own call; only fast batches shared a deadline.
/// Now 32 slow READs of 256 KiB (8 MiB) must all leave within io_timeout, so a client that
/// reads every reply well within io_timeout (256 KiB per 80 ms, 3 MB/s; io_timeout 1 s) is
/// cut off as "the client stopped reading" (review 32's bug, now on every lane). Over TCP,
/// where SO_SNDTIMEO bounds a whole call.
#[test]
fn f3_a_client_reading_slow_lane_replies_steadily_is_cut_off() {
    let _serial = serial();
    const READS: usize = 48;
    const LEN: usize = 256 << 10;
    let backend = MemExport::new(READS * LEN);
    let export = ServerExport {
        info: export_info("disk", (READS * LEN) as u64, transmission_flags(false)),
        backend,
    };
    let config = ServerConfig {
        io_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    let server = Server::new(vec![export], config).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server_end, _) = listener.accept().unwrap();
    setsockopt_int(stream.as_raw_fd(), libc::SO_RCVBUF, 128 << 10);
    setsockopt_int(server_end.as_raw_fd(), libc::SO_SNDBUF, 64 << 10);
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let serving = server.clone();
    let handle = thread::spawn(move || serving.serve_stream(server_end));
    let mut client = Client::go(stream, "disk");
    for i in 0..READS {
        // MemExport keeps every request in the slow lane (Export::lane's default).
        client.send(Command::Read, 0, (i * LEN) as u64, LEN as u32, &[]);
    }
    let start = Instant::now();
    let mut got = 0;
    for _ in 0..READS {
        thread::sleep(Duration::from_millis(80));
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| client.recv()));
        match reply {
            Ok(r) if r.error == 0 => got += 1,
            _ => break,
        }
    }
    let elapsed = start.elapsed();
    let _ = client.stream.shutdown(Shutdown::Both);
    assert!(finished_within(&handle, Duration::from_secs(10)));
    let result = handle.join().unwrap();
    assert_eq!(
        got, READS,
        "after {elapsed:?} the server cut off a client that read each 256 KiB reply 80 ms \
         after the previous one (io_timeout 1 s): {result:?}"
    );
}

/// F4 (contract): `RingStart`'s doc says its buffer is 4096-aligned, and RingReads
/// implementations may rely on it; `start_ring_reads` now hands `Buffer::Small` leases (plain
/// `Vec` allocations, 16-byte aligned) of reads under 4 KiB to `RingReads::start`. The
/// engine's RingHits checks (`RingRead::is_aligned`) and falls back, so no harm there; any
/// other implementation of the public trait trusting the doc would do O_DIRECT into them.
#[test]
fn f4_ring_start_is_handed_buffers_that_are_not_4096_aligned() {
    let _serial = serial();
    let backend = ring_backend::Backend::new();
    let export = ServerExport {
        info: byte_info(ring_backend::SIZE),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, false);
    backend.set(|s| s.shut = true);
    let mut addresses = Vec::new();
    for i in 0..8u64 {
        // Even blocks: the fake ring takes them.
        client.send(Command::Read, 0, 2 * i * BLOCK as u64, 100 + i as u32, &[]);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while backend.started.load(Ordering::SeqCst) < 8 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    backend.set(|s| {
        addresses = s.queue.iter().map(|q| q.2).collect();
        s.shut = false;
    });
    for _ in 0..8 {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(finished_within(&handle, Duration::from_secs(10)));
    let misaligned = addresses.iter().filter(|a| *a % 4096 != 0).count();
    assert_eq!(
        misaligned,
        0,
        "{misaligned} of {} buffers given to RingReads::start are not 4096-aligned (RingStart: \
         \"into buf (4096-aligned)\")",
        addresses.len()
    );
}

// ------------------------------------------------------------------------------------------
// Attacks that held
// ------------------------------------------------------------------------------------------

/// remove_export with the outbox full and the client not reading: the socket is shut both
/// ways, the sender's write fails, `fail` wakes every producer waiting for room.
#[test]
fn held_remove_export_with_a_full_outbox_ends_the_connection() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let export = ServerExport {
        info: export_info("disk", MIB, transmission_flags(false)),
        backend,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (client, handle) = connect(&server, true);
    let (flooder, progress) = flood(&client.stream, 160_000);
    let stalled = wait_for_stall(&progress, 70_000, Duration::from_secs(15));
    let t = Instant::now();
    let removed = server.remove_export("disk", Duration::from_secs(5));
    let took = t.elapsed();
    let ended = finished_within(&handle, Duration::from_secs(5));
    drop(client);
    let _ = flooder.join();
    assert!(stalled.is_some(), "the outbox never filled");
    assert!(
        removed && ended,
        "remove_export waited {took:?}: {removed}, {ended}"
    );
}

/// force_close with the outbox full and the client not reading.
#[test]
fn held_force_close_with_a_full_outbox_ends_the_connection() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let export = ServerExport {
        info: export_info("disk", MIB, transmission_flags(false)),
        backend,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (client, handle) = connect(&server, true);
    let (flooder, progress) = flood(&client.stream, 160_000);
    let stalled = wait_for_stall(&progress, 70_000, Duration::from_secs(15));
    server.force_close();
    let idle = server.wait_idle_timeout(Duration::from_secs(5));
    let ended = finished_within(&handle, Duration::from_secs(5));
    drop(client);
    let _ = flooder.join();
    assert!(stalled.is_some(), "the outbox never filled");
    assert!(idle && ended);
    assert_eq!(server.buffer_memory_in_use(), 0);
}

/// A graceful shutdown with the outbox full and a client that never reads ends within about
/// --io-timeout (the sender's write times out, the connection aborts).
#[test]
fn held_graceful_shutdown_with_a_full_outbox_ends_within_the_io_timeout() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let export = ServerExport {
        info: export_info("disk", MIB, transmission_flags(false)),
        backend,
    };
    let config = ServerConfig {
        io_timeout: Duration::from_secs(2),
        ..ServerConfig::default()
    };
    let server = Server::new(vec![export], config).unwrap();
    let (client, handle) = connect(&server, true);
    let (flooder, progress) = flood(&client.stream, 160_000);
    let stalled = wait_for_stall(&progress, 70_000, Duration::from_secs(15));
    let t = Instant::now();
    server.shutdown();
    let idle = server.wait_idle_timeout(Duration::from_secs(8));
    let took = t.elapsed();
    let ended = finished_within(&handle, Duration::from_secs(2));
    drop(client);
    let _ = flooder.join();
    assert!(stalled.is_some(), "the outbox never filled");
    assert!(idle && ended, "shutdown still waiting after {took:?}");
    assert!(matches!(
        handle.join().unwrap(),
        Err(ConnectionError::TimedOut { .. })
    ));
}

/// Replies queued and not sent count as owed: the idle timeout (0.5 s) does not close a
/// connection whose client reads its replies only 2 s later.
#[test]
fn held_queued_replies_keep_the_idle_timeout_off() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let export = ServerExport {
        info: export_info("disk", MIB, transmission_flags(false)),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let config = ServerConfig {
        idle_timeout: Some(Duration::from_millis(500)),
        io_timeout: Duration::from_secs(10),
        ..ServerConfig::default()
    };
    let server = Server::new(vec![export], config).unwrap();
    let (mut client, handle) = connect(&server, true);
    let data = pattern(3, MIB as usize);
    assert_eq!(client.write(0, &data), 0);
    for i in 0..200u64 {
        client.send(Command::Read, 0, (i % 16) * 65536, 65536, &[]);
    }
    thread::sleep(Duration::from_secs(2));
    let mut ok = 0;
    for _ in 0..200 {
        let reply = client.recv();
        let i = (reply.cookie - 2) % 16;
        if reply.error == 0 && reply.data[..] == data[(i * 65536) as usize..][..65536] {
            ok += 1;
        }
    }
    assert_eq!(ok, 200);
    // Then idle for real: closed.
    assert!(finished_within(&handle, Duration::from_secs(5)));
    assert!(client.at_eof());
}

/// A backend panic in a slow worker while every fast worker waits for room in a full outbox:
/// AbortOnPanic -> abort -> Outbox::fail releases them; the connection ends and the panic
/// propagates.
#[test]
fn held_a_backend_panic_with_a_full_outbox_ends_the_connection() {
    let _serial = serial();
    struct PanicOnFlush {
        go: AtomicBool,
    }
    impl Export for PanicOnFlush {
        fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), Errno> {
            buf.fill(0);
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), Errno> {
            Ok(())
        }
        fn flush(&self) -> Result<(), Errno> {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !self.go.load(Ordering::SeqCst) && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            panic!("flush panics (review 43)");
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
    }
    let backend = Arc::new(PanicOnFlush {
        go: AtomicBool::new(false),
    });
    let export = ServerExport {
        info: export_info("disk", MIB, transmission_flags(false)),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, true);
    client.send(Command::Flush, 0, 0, 0, &[]);
    let (flooder, progress) = flood(&client.stream, 160_000);
    let stalled = wait_for_stall(&progress, 70_000, Duration::from_secs(15));
    backend.go.store(true, Ordering::SeqCst);
    let ended = finished_within(&handle, Duration::from_secs(8));
    drop(client);
    let _ = flooder.join();
    assert!(stalled.is_some(), "the outbox never filled");
    assert!(ended, "the connection hangs after the panic");
    assert!(handle.join().is_err(), "the panic propagates");
    assert_eq!(server.open_connections(), 0);
}

/// Byte-granular reads of every small length, pipelined and mixed with page-sized ones:
/// each reply carries its own data (no buffer freed or reused before it is written), and
/// request memory goes back to the kept buffers only.
#[test]
fn held_small_reads_pipelined_each_get_their_own_data() {
    let _serial = serial();
    let size = MIB as usize;
    let backend = MemExport::new(size);
    let export = ServerExport {
        info: byte_info(size as u64),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, true);
    let data: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8).collect();
    assert_eq!(client.write(0, &data), 0);
    let mut seed = 12345u64;
    let mut expect = std::collections::HashMap::new();
    for _ in 0..3000 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = match seed % 5 {
            0 => 4096,
            1 => 4097,
            _ => 1 + (seed >> 20) % 4095,
        };
        let offset = (seed >> 33) % (size as u64 - len);
        let cookie = client.send(Command::Read, 0, offset, len as u32, &[]);
        expect.insert(cookie, (offset as usize, len as usize));
    }
    let mut bad = 0;
    for _ in 0..3000 {
        let reply = client.recv();
        let (offset, len) = expect[&reply.cookie];
        if reply.error != 0 || reply.data != data[offset..offset + len] {
            bad += 1;
        }
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(finished_within(&handle, Duration::from_secs(10)));
    assert_eq!(bad, 0);
    assert!(server.buffer_memory_in_use() <= ssdcache_nbd::KEEP_BYTES);
}

/// TRIM / WRITE_ZEROES pieces: contiguous, covering the range exactly, inner boundaries on
/// chunk multiples, FUA only as one flush after the last piece.
#[test]
fn held_dataless_pieces_end_on_chunk_multiples_and_cover_the_range() {
    let _serial = serial();
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<(char, u64, u64, bool)>>,
    }
    impl Export for Recorder {
        fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), Errno> {
            buf.fill(0);
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), Errno> {
            Ok(())
        }
        fn flush(&self) -> Result<(), Errno> {
            self.calls.lock().unwrap().push(('f', 0, 0, false));
            Ok(())
        }
        fn trim(&self, o: u64, l: u64, f: bool) -> Result<(), Errno> {
            self.calls.lock().unwrap().push(('t', o, l, f));
            Ok(())
        }
        fn write_zeroes(&self, o: u64, l: u64, f: bool, _: bool) -> Result<(), Errno> {
            self.calls.lock().unwrap().push(('z', o, l, f));
            Ok(())
        }
        fn cache(&self, o: u64, l: u64) -> Result<(), Errno> {
            self.calls.lock().unwrap().push(('c', o, l, false));
            Ok(())
        }
    }
    let backend = Arc::new(Recorder::default());
    let size = 1u64 << 33;
    let export = ServerExport {
        info: byte_info(size),
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, false);
    let cases: [(Command, u16, u64, u32); 4] = [
        (Command::Trim, NBD_CMD_FLAG_FUA, 1, (130 * MIB) as u32),
        (
            Command::WriteZeroes,
            0,
            3 * DATALESS_CHUNK_BYTES - 5,
            u32::MAX,
        ),
        (Command::Cache, 0, 64 * MIB + 7, (64 * MIB) as u32),
        (Command::Trim, 0, size - (200 * MIB) - 1, (200 * MIB) as u32),
    ];
    let mut problems = Vec::new();
    for (command, flags, offset, length) in cases {
        backend.calls.lock().unwrap().clear();
        let reply = client.call(command, flags, offset, length, &[]);
        let calls = backend.calls.lock().unwrap().clone();
        let pieces: Vec<_> = calls.iter().filter(|c| c.0 != 'f').collect();
        let flushes = calls.iter().filter(|c| c.0 == 'f').count();
        let mut at = offset;
        for (i, p) in pieces.iter().enumerate() {
            let inner_end = i + 1 < pieces.len();
            if p.1 != at || p.2 == 0 || p.2 > DATALESS_CHUNK_BYTES || p.3 {
                problems.push(format!("{command:?}: piece {p:?} at {at}"));
            }
            if inner_end && (p.1 + p.2) % DATALESS_CHUNK_BYTES != 0 {
                problems.push(format!("{command:?}: inner piece {p:?} ends off a chunk"));
            }
            at = p.1 + p.2;
        }
        if reply.error != 0 || at != offset + u64::from(length) {
            problems.push(format!(
                "{command:?}: error {} covered to {at}",
                reply.error
            ));
        }
        let want_flush = usize::from(flags & NBD_CMD_FLAG_FUA != 0);
        if flushes != want_flush || (want_flush == 1 && calls.last().unwrap().0 != 'f') {
            problems.push(format!("{command:?}: flushes {flushes}"));
        }
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(finished_within(&handle, Duration::from_secs(10)));
    assert!(problems.is_empty(), "{problems:?}");
}

/// A client that sends DISC after a burst and reads every reply afterwards gets all of them
/// (the sender drains the outbox after the producers finish), then EOF.
#[test]
fn held_disconnect_after_a_burst_answers_everything_then_closes() {
    let _serial = serial();
    let backend = MemExport::new(MIB as usize);
    let export = ServerExport {
        info: byte_info(MIB),
        backend,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (mut client, handle) = connect(&server, true);
    let mut cookies = std::collections::HashSet::new();
    for i in 0..5000u64 {
        cookies.insert(client.send(Command::Read, 0, i * 17, 1 + (i % 300) as u32, &[]));
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    let mut answered = 0;
    for _ in 0..5000 {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
        assert!(
            cookies.remove(&reply.cookie),
            "answered twice: {}",
            reply.cookie
        );
        answered += 1;
    }
    assert!(client.at_eof());
    assert!(finished_within(&handle, Duration::from_secs(10)));
    assert_eq!(answered, 5000);
    assert!(handle.join().unwrap().is_ok());
    let mut rest = Vec::new();
    let _ = client.stream.read_to_end(&mut rest);
    assert!(rest.is_empty());
}
