//! The server's limits (issue #10, items 5 and 6): connections, request memory per
//! connection and in total, time limits once past the handshake, huge TRIM/WRITE_ZEROES/CACHE
//! split into pieces, and a forced close that no client can hold up.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{
    transmission_flags, Command, ConnectionError, Errno, Export, Server, ServerConfig, ServerError,
    DATALESS_CHUNK_BYTES,
};

const SIZE: usize = 1 << 20;
const MIB: u32 = 1 << 20;

fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn mem_server(config: ServerConfig) -> (Server, Arc<MemExport>) {
    let backend = MemExport::new(SIZE);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let server = Server::new(vec![served(info, Arc::clone(&backend))], config).unwrap();
    (server, backend)
}

fn go_pair(server: &Server) -> (Client<UnixStream>, JoinHandle<Result<(), ConnectionError>>) {
    let (client, server_end) = UnixStream::pair().unwrap();
    let serving = server.clone();
    let handle = thread::spawn(move || serving.serve_stream(server_end));
    (Client::go(client, "disk"), handle)
}

/// Joins a connection thread, failing the test if it takes more than 10 s.
fn join_within(handle: JoinHandle<Result<(), ConnectionError>>) -> Result<(), ConnectionError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !handle.is_finished() {
        assert!(Instant::now() < deadline, "connection did not end in 10 s");
        thread::sleep(Duration::from_millis(5));
    }
    handle.join().unwrap()
}

/// An export whose reads and writes wait at a gate until it opens, counting how many wait at
/// once; the data itself is not kept.
struct GateExport {
    open: Mutex<bool>,
    opened: Condvar,
    inside: AtomicUsize,
    most_inside: AtomicUsize,
}

impl GateExport {
    fn closed() -> Arc<GateExport> {
        Arc::new(GateExport {
            open: Mutex::new(false),
            opened: Condvar::new(),
            inside: AtomicUsize::new(0),
            most_inside: AtomicUsize::new(0),
        })
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn inside(&self) -> usize {
        self.inside.load(Ordering::SeqCst)
    }

    /// Waits at most 10 s so a broken test fails instead of hanging.
    fn pass(&self) -> Result<(), Errno> {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_inside.fetch_max(now, Ordering::SeqCst);
        let open = self.open.lock().unwrap();
        let (open, _) = self
            .opened
            .wait_timeout_while(open, Duration::from_secs(10), |open| !*open)
            .unwrap();
        self.inside.fetch_sub(1, Ordering::SeqCst);
        if *open {
            Ok(())
        } else {
            Err(Errno::Io)
        }
    }
}

impl Export for GateExport {
    fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<(), Errno> {
        self.pass()
    }
    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<(), Errno> {
        self.pass()
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

fn gate_server(config: ServerConfig) -> (Server, Arc<GateExport>) {
    let backend = GateExport::closed();
    let mut info = export_info("disk", 64 << 20, transmission_flags(false));
    info.max_block = config.max_request;
    let export = ssdcache_nbd::ServerExport {
        info,
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    (Server::new(vec![export], config).unwrap(), backend)
}

#[test]
fn connections_beyond_the_limit_are_closed_before_the_greeting() {
    let config = ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    };
    let (server, _backend) = mem_server(config);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let serving = server.clone();
    let accept = thread::spawn(move || serving.serve_unix(listener));

    let mut first = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    let second = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    let mut refused = UnixStream::connect(&path).unwrap();
    refused
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(
        refused.read(&mut [0u8; 18]).unwrap(),
        0,
        "the third client is closed without a greeting"
    );
    assert_eq!(server.open_connections(), 2);
    assert_eq!(
        first.write(0, &pattern(1, BLOCK)),
        0,
        "the others still work"
    );

    drop(second);
    eventually("the second connection to close", || {
        server.open_connections() == 1
    });
    let mut third = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    assert_eq!(third.read(0, BLOCK as u32), Ok(pattern(1, BLOCK)));

    server.shutdown();
    assert!(accept.join().unwrap().is_ok());
    assert!(server.wait_idle_timeout(Duration::from_secs(10)));
}

#[test]
fn request_memory_is_bounded_per_connection_and_in_total() {
    let config = ServerConfig {
        threads_per_connection: 8,
        max_request: MIB,
        connection_buffer_memory: 2 << 20,
        buffer_memory: 3 << 20,
        ..ServerConfig::default()
    };
    let (server, backend) = gate_server(config);
    let (a, _a) = go_pair(&server);
    let (b, _b) = go_pair(&server);
    // Each client sends from its own thread: a connection out of memory stops reading, and
    // its client's sends block.
    let senders = [a, b].map(|mut client| {
        thread::spawn(move || {
            let payload = vec![0x5a; MIB as usize];
            for i in 0..8u64 {
                client.send(Command::Write, 0, i * u64::from(MIB), MIB, &payload);
            }
            client
        })
    });
    eventually("three writes in the backend", || backend.inside() == 3);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(backend.inside(), 3, "3 MiB in all: no fourth 1 MiB write");
    assert!(server.buffer_memory_in_use() <= 3 << 20);

    backend.open();
    for sender in senders {
        let mut client = sender.join().unwrap();
        for _ in 0..8 {
            assert_eq!(
                client.recv().error,
                0,
                "every write completes once memory frees"
            );
        }
    }
    assert_eq!(backend.most_inside.load(Ordering::SeqCst), 3);
    assert_eq!(
        server.buffer_memory_in_use(),
        0,
        "1 MiB buffers are not kept when a quarter of the limit is smaller"
    );
}

#[test]
fn a_request_that_gets_no_memory_in_time_fails_with_enomem_and_the_connection_survives() {
    let config = ServerConfig {
        max_request: MIB,
        connection_buffer_memory: 1 << 20,
        buffer_wait: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let (server, backend) = gate_server(config);
    let (mut client, _handle) = go_pair(&server);
    let payload = vec![0x33; MIB as usize];
    let held = client.send(Command::Write, 0, 0, MIB, &payload);
    eventually("the first write in the backend", || backend.inside() == 1);

    let started = Instant::now();
    let starved = client.call(Command::Write, 0, u64::from(MIB), MIB, &payload);
    assert_eq!(starved.error, NBD_ENOMEM);
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(started.elapsed() < Duration::from_secs(5));
    let read = client.call(Command::Read, 0, 0, BLOCK as u32, &[]);
    assert_eq!(read.error, NBD_ENOMEM, "reads wait for memory too");

    backend.open();
    let reply = client.recv();
    assert_eq!((reply.cookie, reply.error), (held, 0));
    assert_eq!(
        client.write(0, &pattern(2, BLOCK)),
        0,
        "the stream stayed in sync"
    );
}

#[test]
fn large_buffers_are_freed_after_their_request_and_small_ones_kept() {
    let backend = MemExport::new(64 << 20);
    let mut info = export_info("disk", 64 << 20, transmission_flags(false));
    info.max_block = 32 << 20;
    let server = Server::new(
        vec![served(info, Arc::clone(&backend))],
        ServerConfig::default(),
    )
    .unwrap();
    let (mut client, _handle) = go_pair(&server);
    let big = pattern(7, 32 << 20);
    assert_eq!(client.write(0, &big), 0);
    assert_eq!(client.read(0, 32 << 20).unwrap(), big);
    assert_eq!(server.buffer_memory_in_use(), 0, "32 MiB buffers are freed");
    assert_eq!(client.write(0, &pattern(8, BLOCK)), 0);
    assert_eq!(
        server.buffer_memory_in_use(),
        BLOCK,
        "a 4 KiB buffer is kept"
    );
}

#[test]
fn a_client_that_stops_reading_replies_is_disconnected_after_the_io_timeout() {
    let config = ServerConfig {
        io_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let (server, _backend) = mem_server(config);
    let (mut client, handle) = go_pair(&server);
    for _ in 0..64 {
        client.send(Command::Read, 0, 0, MIB, &[]);
    }
    let started = Instant::now();
    let result = join_within(handle);
    assert!(
        matches!(result, Err(ConnectionError::TimedOut { .. })),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(server.open_connections(), 0);
}

#[test]
fn a_request_cut_off_midway_times_out() {
    let config = ServerConfig {
        io_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let (server, backend) = mem_server(config);

    let (mut half_header, handle) = go_pair(&server);
    let header = RequestHeader {
        flags: 0,
        command: Command::Write,
        cookie: 1,
        offset: 0,
        length: BLOCK as u32,
    }
    .encode();
    half_header.stream.write_all(&header[..10]).unwrap();
    let result = join_within(handle);
    assert!(
        matches!(result, Err(ConnectionError::TimedOut { .. })),
        "{result:?}"
    );

    let (mut half_payload, handle) = go_pair(&server);
    half_payload.stream.write_all(&header).unwrap();
    half_payload.stream.write_all(&[9u8; 1000]).unwrap();
    let result = join_within(handle);
    assert!(
        matches!(result, Err(ConnectionError::TimedOut { .. })),
        "{result:?}"
    );
    assert!(
        backend.calls().is_empty(),
        "the partial write was not applied"
    );
}

#[test]
fn idle_connections_close_after_the_idle_timeout_but_not_while_a_reply_is_owed() {
    let (started_tx, started_rx) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let config = ServerConfig {
        idle_timeout: Some(Duration::from_millis(300)),
        ..ServerConfig::default()
    };
    let server = Server::new(vec![served(info, Arc::clone(&backend))], config).unwrap();

    let (mut busy, busy_handle) = go_pair(&server);
    let slow = busy.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let (mut idle, idle_handle) = go_pair(&server);
    assert!(join_within(idle_handle).is_ok(), "an idle close is clean");
    assert!(idle.at_eof());

    thread::sleep(Duration::from_millis(300));
    assert_eq!(server.open_connections(), 1, "a reply is owed: not idle");
    backend.release();
    let reply = busy.recv();
    assert_eq!((reply.cookie, reply.error), (slow, 0));
    assert_eq!(busy.write(BLOCK as u64, &pattern(3, BLOCK)), 0);
    assert!(
        join_within(busy_handle).is_ok(),
        "idle after its last reply"
    );
}

#[test]
fn without_an_idle_timeout_a_quiet_connection_stays_open() {
    let (server, _backend) = mem_server(ServerConfig::default());
    let (mut client, _handle) = go_pair(&server);
    thread::sleep(Duration::from_millis(500));
    assert_eq!(server.open_connections(), 1);
    assert_eq!(client.write(0, &pattern(4, BLOCK)), 0);
}

/// An export that records dataless calls and nothing else, so it can be as large as a test
/// needs.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<Call>>,
}

impl Export for Recorder {
    fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<(), Errno> {
        Ok(())
    }
    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        self.calls.lock().unwrap().push(Call::Flush);
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno> {
        let call = Call::Trim {
            offset,
            length,
            fua,
        };
        self.calls.lock().unwrap().push(call);
        Ok(())
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno> {
        let call = Call::WriteZeroes {
            offset,
            length,
            fua,
            may_trim,
        };
        self.calls.lock().unwrap().push(call);
        Ok(())
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), Errno> {
        self.calls
            .lock()
            .unwrap()
            .push(Call::Cache { offset, length });
        Ok(())
    }
}

/// The (offset, length, fua) of each call, in order, and whether a flush came last.
fn pieces(calls: &[Call]) -> (Vec<(u64, u64, bool)>, bool) {
    let ranges = calls
        .iter()
        .filter_map(|call| match *call {
            Call::Trim {
                offset,
                length,
                fua,
            }
            | Call::WriteZeroes {
                offset,
                length,
                fua,
                ..
            } => Some((offset, length, fua)),
            Call::Cache { offset, length } => Some((offset, length, false)),
            _ => None,
        })
        .collect();
    (ranges, calls.last() == Some(&Call::Flush))
}

fn assert_covers(ranges: &[(u64, u64, bool)], offset: u64, length: u64) {
    let mut next = offset;
    for &(start, len, fua) in ranges {
        assert_eq!(start, next, "pieces are contiguous and in order");
        assert!(
            len <= DATALESS_CHUNK_BYTES && len > 0,
            "piece of {len} bytes"
        );
        assert!(!fua, "no piece carries FUA");
        next += len;
    }
    assert_eq!(next, offset + length, "the pieces cover the request");
}

#[test]
fn huge_dataless_requests_reach_the_backend_in_pieces_with_one_flush_for_fua() {
    let backend = Arc::new(Recorder::default());
    let info = export_info("big", 8 << 30, transmission_flags(false));
    let export = ssdcache_nbd::ServerExport {
        info,
        backend: Arc::clone(&backend) as Arc<dyn Export>,
    };
    let server = Server::new(vec![export], ServerConfig::default()).unwrap();
    let (client, server_end) = UnixStream::pair().unwrap();
    let serving = server.clone();
    let _handle = thread::spawn(move || serving.serve_stream(server_end));
    let mut client = Client::go(client, "big");
    let huge = u32::MAX - 4095;
    let offset = 4096;
    let take = || std::mem::take(&mut *backend.calls.lock().unwrap());

    let cases = [
        (Command::Trim, NBD_CMD_FLAG_FUA, true),
        (
            Command::WriteZeroes,
            NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE,
            true,
        ),
        (Command::WriteZeroes, 0, false),
        (Command::Cache, 0, false),
    ];
    for (command, flags, flushed) in cases {
        assert_eq!(client.call(command, flags, offset, huge, &[]).error, 0);
        let calls = take();
        let (ranges, ends_with_flush) = pieces(&calls);
        assert_eq!(ranges.len(), 64, "{command:?}: 4 GiB in 64 MiB pieces");
        assert_covers(&ranges, offset, u64::from(huge));
        assert_eq!(ends_with_flush, flushed, "{command:?}: {calls:?}");
        assert_eq!(calls.len(), ranges.len() + usize::from(flushed));
    }

    assert_eq!(
        client
            .call(Command::Trim, NBD_CMD_FLAG_FUA, 0, 1 << 20, &[])
            .error,
        0
    );
    assert_eq!(
        take(),
        vec![Call::Trim {
            offset: 0,
            length: 1 << 20,
            fua: true
        }],
        "a request that fits one piece keeps its FUA"
    );
}

#[test]
fn force_close_ends_connections_held_by_a_client_that_stopped_reading() {
    let (server, _backend) = mem_server(ServerConfig::default());
    let (mut client, handle) = go_pair(&server);
    for _ in 0..64 {
        client.send(Command::Read, 0, 0, MIB, &[]);
    }
    // Replies fill the socket; a worker blocks writing the rest (for the 30 s I/O timeout).
    thread::sleep(Duration::from_millis(200));
    server.shutdown();
    assert!(
        !server.wait_idle_timeout(Duration::from_millis(300)),
        "a graceful shutdown waits for the owed replies"
    );
    let started = Instant::now();
    server.force_close();
    assert!(server.wait_idle_timeout(Duration::from_secs(5)));
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        join_within(handle).is_err(),
        "the owed replies were not sent"
    );
    assert_eq!(server.requests_in_backend(), 0);
}

#[test]
fn force_close_leaves_a_request_inside_the_backend_visible() {
    let (started_tx, started_rx) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let server = Server::new(
        vec![served(info, Arc::clone(&backend))],
        ServerConfig::default(),
    )
    .unwrap();
    let (mut client, handle) = go_pair(&server);
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    server.force_close();
    assert!(!server.wait_idle_timeout(Duration::from_millis(300)));
    assert_eq!(server.requests_in_backend(), 1, "stuck in the backend");
    backend.release();
    assert!(server.wait_idle_timeout(Duration::from_secs(5)));
    assert_eq!(server.requests_in_backend(), 0);
    let _ = join_within(handle);
}

#[test]
fn limits_that_cannot_work_are_refused() {
    let base = ServerConfig::default();
    let bad = [
        ServerConfig {
            max_connections: 0,
            ..base.clone()
        },
        ServerConfig {
            connection_buffer_memory: (32 << 20) - 4096,
            ..base.clone()
        },
        ServerConfig {
            buffer_memory: 32 << 20,
            connection_buffer_memory: 64 << 20,
            ..base.clone()
        },
        ServerConfig {
            io_timeout: Duration::ZERO,
            ..base.clone()
        },
        ServerConfig {
            idle_timeout: Some(Duration::ZERO),
            ..base.clone()
        },
    ];
    for config in bad {
        assert!(
            matches!(
                Server::check_config(&config),
                Err(ServerError::InvalidConfig(_))
            ),
            "{config:?}"
        );
    }
    assert!(Server::check_config(&base).is_ok());
}

/// Issue 13 item 2: a client that sends every request before it reads any reply. Before the
/// outbox, workers blocked writing replies the client was not reading yet and stopped reading
/// its requests, so its sending never ended (over a Unix socket: 106 s and more, or forever).
/// Now the requests are read while their replies wait, up to the connection's request memory.
#[test]
fn a_client_that_sends_every_request_before_reading_a_reply_is_served() {
    const READS: u64 = 12_000; // 336 KB of requests, 47 MiB of replies: under 64 MiB
    let (server, backend) = mem_server(ServerConfig::default());
    let (mut client, handle) = go_pair(&server);
    let pattern: Vec<u8> = (0..SIZE).map(|i| (i / BLOCK) as u8).collect();
    assert_eq!(client.write(0, &pattern), 0);
    assert_eq!(backend.contents(0, SIZE), pattern);
    client
        .stream
        .set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let started = Instant::now();
    let blocks = (SIZE / BLOCK) as u64;
    for i in 0..READS {
        // Panics if the server stops reading for 20 s (it waits for us to read replies).
        client.send(
            Command::Read,
            0,
            (i % blocks) * BLOCK as u64,
            BLOCK as u32,
            &[],
        );
    }
    let sent = started.elapsed();
    for _ in 0..READS {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
        let block = ((reply.cookie - 2) % blocks) as usize;
        assert_eq!(reply.data, pattern[block * BLOCK..(block + 1) * BLOCK]);
    }
    assert!(sent < Duration::from_secs(10), "sending took {sent:?}");
    drop(client);
    join_within(handle).unwrap();
}
