//! End-to-end tests of the threaded server with an in-memory export.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::*;
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{
    transmission_flags, Command, ConnectionError, Server, ServerConfig, ServerError, ServerExport,
};

const SIZE: usize = 1 << 20;

fn server_with(exports: Vec<ServerExport>) -> Server {
    Server::new(exports, ServerConfig::default()).expect("valid server")
}

fn rw_server() -> (Server, Arc<MemExport>) {
    let backend = MemExport::new(SIZE);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    (
        server_with(vec![served(info, Arc::clone(&backend))]),
        backend,
    )
}

/// Serves one end of a socket pair on a thread; returns the client end.
fn connect_pair(server: &Server) -> (UnixStream, JoinHandle<Result<(), ConnectionError>>) {
    let (client, server_end) = UnixStream::pair().unwrap();
    let server = server.clone();
    let handle = thread::spawn(move || server.serve_stream(server_end));
    (client, handle)
}

fn go_pair(
    server: &Server,
    name: &str,
) -> (Client<UnixStream>, JoinHandle<Result<(), ConnectionError>>) {
    let (stream, handle) = connect_pair(server);
    (Client::go(stream, name), handle)
}

/// Reads the greeting, then asks for `name` the old way (`NBD_OPT_EXPORT_NAME`).
fn ask_export_name(stream: &mut UnixStream, name: &[u8]) {
    read_greeting(stream);
    choose_export_name(stream, name);
}

/// After the greeting: the client's flags, then `NBD_OPT_EXPORT_NAME` for `name`.
fn choose_export_name(stream: &mut UnixStream, name: &[u8]) {
    stream
        .write_all(&NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .unwrap();
    stream
        .write_all(&option_bytes(NBD_OPT_EXPORT_NAME, name))
        .unwrap();
}

fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn pipelined_writes_then_reads_match_by_cookie() {
    let (server, backend) = rw_server();
    let (mut client, handle) = go_pair(&server, "disk");
    assert_eq!(client.size, SIZE as u64);
    assert_eq!(client.flags, transmission_flags(false));

    let mut expected = HashMap::new();
    for i in 0..32u64 {
        let len = BLOCK * (1 + i as usize % 3);
        let offset = i * 3 * BLOCK as u64;
        let data = pattern(i as u8, len);
        let cookie = client.send(Command::Write, 0, offset, len as u32, &data);
        expected.insert(cookie, (offset, data));
    }
    for _ in 0..expected.len() {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
        assert!(expected.contains_key(&reply.cookie));
    }

    let mut reads = HashMap::new();
    for (offset, data) in expected.values() {
        let cookie = client.send(Command::Read, 0, *offset, data.len() as u32, &[]);
        reads.insert(cookie, data.clone());
    }
    for _ in 0..reads.len() {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
        assert_eq!(reply.data, reads[&reply.cookie], "cookie {}", reply.cookie);
    }
    assert!(
        !backend.saw_misaligned_buffer(),
        "backend buffers must be 4096-aligned"
    );
    assert_eq!(backend.contents(0, BLOCK), pattern(0, BLOCK));

    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(client.at_eof());
    assert!(handle.join().unwrap().is_ok());
    assert_eq!(server.open_connections(), 0);
}

#[test]
fn replies_can_overtake_slower_requests() {
    let (started_tx, started_rx) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let server = server_with(vec![served(info, Arc::clone(&backend))]);
    let (mut client, _handle) = go_pair(&server, "disk");

    let slow = client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let fast = client.send(
        Command::Write,
        0,
        BLOCK as u64,
        BLOCK as u32,
        &pattern(9, BLOCK),
    );
    assert_eq!(
        client.recv().cookie,
        fast,
        "the write finishes while the read is held"
    );
    backend.release();
    let reply = client.recv();
    assert_eq!((reply.cookie, reply.error), (slow, 0));
}

/// One malformed request and the error the spec wants for it.
struct BadRequest<'a> {
    what: &'a str,
    command: Command,
    flags: u16,
    offset: u64,
    length: u32,
    payload: &'a [u8],
    error: u32,
}

fn bad(what: &str, command: Command, offset: u64, length: u32, error: u32) -> BadRequest<'_> {
    BadRequest {
        what,
        command,
        flags: 0,
        offset,
        length,
        payload: &[],
        error,
    }
}

#[test]
fn invalid_requests_get_errors_and_the_connection_survives() {
    let (server, backend) = rw_server();
    let (mut client, _handle) = go_pair(&server, "disk");
    let block = vec![7u8; BLOCK];
    let (end, len) = (SIZE as u64, BLOCK as u32);
    let with_payload = |request: BadRequest<'static>, payload| BadRequest { payload, ..request };
    let with_flags = |request: BadRequest<'static>, flags| BadRequest { flags, ..request };

    let cases = [
        bad("read past end", Command::Read, end, len, NBD_EINVAL),
        with_payload(
            bad("write past end", Command::Write, end, len, NBD_ENOSPC),
            &block,
        ),
        bad("trim past end", Command::Trim, end - 4096, 8192, NBD_ENOSPC),
        bad(
            "zeroes past end",
            Command::WriteZeroes,
            end,
            len,
            NBD_ENOSPC,
        ),
        bad("cache past end", Command::Cache, end, len, NBD_EINVAL),
        with_payload(
            bad(
                "offset overflow",
                Command::Write,
                u64::MAX - 4095,
                len,
                NBD_ENOSPC,
            ),
            &block,
        ),
        with_payload(
            bad("misaligned write", Command::Write, 512, len, NBD_EINVAL),
            &block,
        ),
        with_payload(
            bad("short write", Command::Write, 0, 100, NBD_EINVAL),
            &block[..100],
        ),
        bad("misaligned read", Command::Read, 100, len, NBD_EINVAL),
        bad("huge read", Command::Read, 0, 33 << 20, NBD_EINVAL),
        bad("unknown command", Command::Unknown(42), 0, 0, NBD_EINVAL),
        bad(
            "block status",
            Command::Unknown(NBD_CMD_BLOCK_STATUS),
            0,
            len,
            NBD_EINVAL,
        ),
        with_flags(
            bad("unknown flag", Command::Read, 0, len, NBD_EINVAL),
            1 << 9,
        ),
        with_flags(
            bad("DF flag", Command::Read, 0, len, NBD_EINVAL),
            NBD_CMD_FLAG_DF,
        ),
        bad("backend error", Command::Cache, 0, 3 * len, NBD_EIO),
    ];
    for case in cases {
        let reply = client.call(
            case.command,
            case.flags,
            case.offset,
            case.length,
            case.payload,
        );
        assert_eq!(reply.error, case.error, "{}", case.what);
        assert_eq!(
            client.write(0, &pattern(1, BLOCK)),
            0,
            "after {}",
            case.what
        );
    }
    let rejected_writes = backend
        .calls()
        .iter()
        .filter(|call| matches!(call, Call::Write { offset, .. } if *offset != 0))
        .count();
    assert_eq!(rejected_writes, 0, "invalid writes never reach the backend");
    assert_eq!(client.read(0, BLOCK as u32), Ok(pattern(1, BLOCK)));
}

#[test]
fn oversized_write_is_discarded_and_the_connection_survives() {
    let (server, backend) = rw_server();
    let (mut client, _handle) = go_pair(&server, "disk");
    let huge = vec![0xeeu8; 33 << 20];
    let reply = client.call(Command::Write, 0, 0, huge.len() as u32, &huge);
    assert_eq!(reply.error, NBD_EOVERFLOW);
    assert_eq!(client.write(BLOCK as u64, &pattern(3, BLOCK)), 0);
    assert_eq!(
        client.read(BLOCK as u64, BLOCK as u32),
        Ok(pattern(3, BLOCK))
    );
    assert_eq!(
        backend.contents(0, BLOCK),
        vec![0; BLOCK],
        "huge write not applied"
    );
}

#[test]
fn commands_reach_the_backend_with_their_flags() {
    let (server, backend) = rw_server();
    let (mut client, _handle) = go_pair(&server, "disk");
    let fua = NBD_CMD_FLAG_FUA;
    let b = BLOCK as u64;
    assert_eq!(
        client
            .call(Command::Write, fua, 0, BLOCK as u32, &pattern(5, BLOCK))
            .error,
        0
    );
    assert_eq!(client.call(Command::Flush, 0, 0, 0, &[]).error, 0);
    assert_eq!(
        client
            .call(Command::Trim, fua, b, 2 * BLOCK as u32, &[])
            .error,
        0
    );
    assert_eq!(
        client
            .call(
                Command::WriteZeroes,
                NBD_CMD_FLAG_NO_HOLE,
                0,
                BLOCK as u32,
                &[]
            )
            .error,
        0
    );
    assert_eq!(
        client
            .call(Command::WriteZeroes, 0, b, BLOCK as u32, &[])
            .error,
        0
    );
    assert_eq!(
        client.call(Command::Cache, 0, b, BLOCK as u32, &[]).error,
        0
    );
    assert_eq!(
        backend.calls(),
        vec![
            Call::Write {
                offset: 0,
                len: BLOCK,
                fua: true
            },
            Call::Flush,
            Call::Trim {
                offset: b,
                length: 2 * b,
                fua: true
            },
            Call::WriteZeroes {
                offset: 0,
                length: b,
                fua: false,
                may_trim: false
            },
            Call::WriteZeroes {
                offset: b,
                length: b,
                fua: false,
                may_trim: true
            },
            Call::Cache {
                offset: b,
                length: b
            },
        ]
    );
    assert_eq!(backend.contents(0, BLOCK), vec![0; BLOCK], "zeroed");
}

#[test]
fn zero_length_requests_skip_the_backend() {
    let (server, backend) = rw_server();
    let (mut client, _handle) = go_pair(&server, "disk");
    for command in [
        Command::Read,
        Command::Write,
        Command::Trim,
        Command::WriteZeroes,
        Command::Cache,
    ] {
        assert_eq!(
            client.call(command, 0, BLOCK as u64, 0, &[]).error,
            0,
            "{command:?}"
        );
    }
    assert_eq!(backend.calls(), vec![]);
}

#[test]
fn read_only_export_refuses_modifications() {
    let backend = MemExport::new(SIZE);
    let info = export_info("ro", SIZE as u64, transmission_flags(true));
    let server = server_with(vec![served(info, Arc::clone(&backend))]);
    let (mut client, _handle) = go_pair(&server, "ro");
    assert_ne!(client.flags & NBD_FLAG_READ_ONLY, 0);
    let block = pattern(2, BLOCK);
    assert_eq!(
        client
            .call(Command::Write, 0, 0, BLOCK as u32, &block)
            .error,
        NBD_EPERM
    );
    assert_eq!(
        client.call(Command::Trim, 0, 0, BLOCK as u32, &[]).error,
        NBD_EPERM
    );
    assert_eq!(
        client
            .call(Command::WriteZeroes, 0, 0, BLOCK as u32, &[])
            .error,
        NBD_EPERM
    );
    assert_eq!(client.read(0, BLOCK as u32), Ok(vec![0; BLOCK]));
    assert_eq!(client.call(Command::Flush, 0, 0, 0, &[]).error, 0);
    assert!(!backend
        .calls()
        .iter()
        .any(|c| matches!(c, Call::Write { .. } | Call::Trim { .. })));
}

#[test]
fn unadvertised_commands_are_invalid() {
    let backend = MemExport::new(SIZE);
    let info = export_info("plain", SIZE as u64, NBD_FLAG_HAS_FLAGS);
    let server = server_with(vec![served(info, Arc::clone(&backend))]);
    let (mut client, _handle) = go_pair(&server, "plain");
    for command in [
        Command::Flush,
        Command::Trim,
        Command::WriteZeroes,
        Command::Cache,
    ] {
        assert_eq!(
            client.call(command, 0, 0, BLOCK as u32, &[]).error,
            NBD_EINVAL,
            "{command:?}"
        );
    }
    let fua_write = client.call(
        Command::Write,
        NBD_CMD_FLAG_FUA,
        0,
        BLOCK as u32,
        &pattern(1, BLOCK),
    );
    assert_eq!(fua_write.error, NBD_EINVAL);
    assert_eq!(backend.calls(), vec![]);
}

#[test]
fn export_name_handshake_keeps_pipelined_requests() {
    let (server, _backend) = rw_server();
    let (mut stream, handle) = connect_pair(&server);
    read_greeting(&mut stream);
    // Flags, EXPORT_NAME and a first request in one write: the server must
    // not swallow the request while finishing the handshake.
    let mut burst = NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    burst.extend(option_bytes(NBD_OPT_EXPORT_NAME, b"disk"));
    let request = ssdcache_nbd::RequestHeader {
        flags: 0,
        command: Command::Read,
        cookie: 77,
        offset: 0,
        length: BLOCK as u32,
    };
    burst.extend_from_slice(&request.encode());
    stream.write_all(&burst).unwrap();

    let mut export_reply = [0u8; 8 + 2 + 124];
    stream.read_exact(&mut export_reply).unwrap();
    assert_eq!(&export_reply[0..8], &(SIZE as u64).to_be_bytes());
    let mut reply = [0u8; 16 + BLOCK];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[4..16], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 77]);
    drop(stream);
    assert!(
        handle.join().unwrap().is_ok(),
        "EOF between requests is clean"
    );
}

#[test]
fn handshake_abort_and_unknown_export_end_the_connection() {
    let (server, _backend) = rw_server();
    let (mut stream, handle) = connect_pair(&server);
    read_greeting(&mut stream);
    stream
        .write_all(&NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .unwrap();
    stream.write_all(&option_bytes(NBD_OPT_ABORT, &[])).unwrap();
    let mut ack = [0u8; 20];
    stream.read_exact(&mut ack).unwrap();
    assert_eq!(&ack[12..16], &NBD_REP_ACK.to_be_bytes());
    assert!(handle.join().unwrap().is_ok(), "abort is a clean end");

    let (mut stream, handle) = connect_pair(&server);
    ask_export_name(&mut stream, b"missing");
    assert!(matches!(
        handle.join().unwrap(),
        Err(ConnectionError::Handshake { .. })
    ));
    assert_eq!(
        stream.read(&mut [0u8; 1]).unwrap(),
        0,
        "closed without a reply"
    );
}

#[test]
fn bad_magic_closes_only_that_connection() {
    let (server, _backend) = rw_server();
    let (mut good, _good_handle) = go_pair(&server, "disk");
    let (mut bad, bad_handle) = go_pair(&server, "disk");
    bad.stream.write_all(&[0x55; 28]).unwrap();
    assert!(bad.at_eof());
    assert!(matches!(
        bad_handle.join().unwrap(),
        Err(ConnectionError::Protocol { .. })
    ));
    assert_eq!(good.write(0, &pattern(4, BLOCK)), 0);
    assert_eq!(good.read(0, BLOCK as u32), Ok(pattern(4, BLOCK)));
}

#[test]
fn silent_client_hits_the_handshake_time_limit() {
    let backend = MemExport::new(SIZE);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let config = ServerConfig {
        handshake_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let server = Server::new(vec![served(info, backend)], config).unwrap();
    let (mut stream, handle) = connect_pair(&server);
    read_greeting(&mut stream);
    stream
        .write_all(&NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .unwrap();
    stream.write_all(&IHAVEOPT.to_be_bytes()).unwrap(); // half an option, then silence
    let started = Instant::now();
    assert!(matches!(
        handle.join().unwrap(),
        Err(ConnectionError::Io { .. })
    ));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(stream.read(&mut [0u8; 1]).unwrap(), 0);
}

fn unix_server(
    server: &Server,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    JoinHandle<Result<(), ServerError>>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let server = server.clone();
    let handle = thread::spawn(move || server.serve_unix(listener));
    (dir, path, handle)
}

#[test]
fn client_vanishing_mid_payload_does_not_disturb_others() {
    let (server, backend) = rw_server();
    let (_dir, path, serve) = unix_server(&server);
    let mut steady = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    let mut doomed = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    assert_eq!(server.open_connections(), 2);

    doomed.send(Command::Write, 0, 0, 8192, &[1u8; 100]);
    drop(doomed);
    eventually("the truncated connection to close", || {
        server.open_connections() == 1
    });

    assert_eq!(steady.write(0, &pattern(6, BLOCK)), 0);
    assert_eq!(steady.read(0, BLOCK as u32), Ok(pattern(6, BLOCK)));
    assert!(!backend
        .calls()
        .iter()
        .any(|c| matches!(c, Call::Write { len: 8192, .. })));

    server.shutdown();
    assert!(steady.at_eof());
    assert!(serve.join().unwrap().is_ok());
}

#[test]
fn graceful_shutdown_answers_in_flight_requests() {
    let (started_tx, started_rx) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let server = server_with(vec![served(info, Arc::clone(&backend))]);
    let (_dir, path, serve) = unix_server(&server);
    let mut client = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    assert_eq!(client.write(0, &pattern(8, BLOCK)), 0);

    let in_flight = client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    server.shutdown();
    thread::sleep(Duration::from_millis(50));
    assert_eq!(server.open_connections(), 1, "waits for the in-flight read");
    backend.release();

    let reply = client.recv();
    assert_eq!((reply.cookie, reply.error), (in_flight, 0));
    assert_eq!(reply.data, pattern(8, BLOCK));
    assert!(client.at_eof(), "closed after the last reply");
    assert!(
        serve.join().unwrap().is_ok(),
        "serve_unix returns after shutdown"
    );
    assert!(server.wait_idle_timeout(Duration::from_secs(5)));
    assert_eq!(server.open_connections(), 0);
    assert!(UnixStream::connect(&path).is_err(), "no longer accepting");
}

#[test]
fn unix_and_tcp_listeners_serve_together_and_stop_together() {
    let (server, _backend) = rw_server();
    let (_dir, path, serve_unix) = unix_server(&server);
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = tcp.local_addr().unwrap();
    let tcp_server = server.clone();
    let serve_tcp = thread::spawn(move || tcp_server.serve_tcp(tcp));

    let mut over_unix = Client::go(UnixStream::connect(&path).unwrap(), "disk");
    let mut over_tcp = Client::go(TcpStream::connect(address).unwrap(), "");
    assert_eq!(over_unix.write(0, &pattern(11, BLOCK)), 0);
    assert_eq!(over_tcp.read(0, BLOCK as u32), Ok(pattern(11, BLOCK)));

    // Shutdown also ends a connection still in its handshake.
    let mut handshaking = TcpStream::connect(address).unwrap();
    read_greeting(&mut handshaking);

    server.shutdown();
    assert!(serve_unix.join().unwrap().is_ok());
    assert!(serve_tcp.join().unwrap().is_ok());
    assert!(server.wait_idle_timeout(Duration::from_secs(10)));
    assert_eq!(server.open_connections(), 0);
    assert!(over_unix.at_eof() && over_tcp.at_eof());
    assert_eq!(handshaking.read(&mut [0u8; 1]).unwrap_or(0), 0);
}

#[test]
fn shutdown_before_serving_returns_at_once() {
    let (server, _backend) = rw_server();
    server.shutdown();
    server.shutdown();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    assert!(server.serve_tcp(listener).is_ok());
    let (mut stream, handle) = connect_pair(&server);
    assert!(
        handle.join().unwrap().is_err(),
        "late connections are stopped"
    );
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(stream.read(&mut [0u8; 1]).unwrap(), 0);
}

#[test]
fn misconfigured_exports_are_rejected() {
    let backend = MemExport::new(SIZE);
    let mut bad_min = export_info("a", SIZE as u64, transmission_flags(false));
    bad_min.min_block = 3000;
    let mut bad_max = export_info("b", SIZE as u64, transmission_flags(false));
    bad_max.max_block = 4097;
    let dup = export_info("c", SIZE as u64, transmission_flags(false));
    for exports in [
        vec![served(bad_min, Arc::clone(&backend))],
        vec![served(bad_max, Arc::clone(&backend))],
        vec![
            served(dup.clone(), Arc::clone(&backend)),
            served(dup, Arc::clone(&backend)),
        ],
    ] {
        let result = Server::new(exports, ServerConfig::default());
        assert!(matches!(result, Err(ServerError::InvalidExport { .. })));
    }
    let no_threads = ServerConfig {
        threads_per_connection: 0,
        ..ServerConfig::default()
    };
    assert!(matches!(
        Server::new(vec![], no_threads),
        Err(ServerError::InvalidConfig(_))
    ));
}

#[test]
fn serve_transmission_skips_the_handshake() {
    let (server, backend) = rw_server();
    let (client_end, server_end) = UnixStream::pair().unwrap();
    let serving = server.clone();
    let handle = thread::spawn(move || serving.serve_transmission(server_end, "disk"));
    let mut client = Client::preconnected(client_end, SIZE as u64);
    assert_eq!(client.write(0, &pattern(12, BLOCK)), 0);
    assert_eq!(client.read(0, BLOCK as u32), Ok(pattern(12, BLOCK)));
    assert_eq!(backend.contents(0, BLOCK), pattern(12, BLOCK));
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    assert!(handle.join().unwrap().is_ok());

    let (_client_end, server_end) = UnixStream::pair().unwrap();
    let result = server.serve_transmission(server_end, "missing");
    assert!(matches!(
        result,
        Err(ConnectionError::NoSuchExport { name, .. }) if name == "missing"
    ));
    assert_eq!(server.open_connections(), 0);
}

/// Exports added and removed while serving (`ssdcache volume add` / `remove` through the
/// daemon): a new export is negotiated by new connections; a removed one is no longer offered,
/// its connections are closed, `remove_export` returns once they ended, and a connection on
/// another export goes on.
#[test]
fn exports_added_and_removed_while_serving() {
    let (server, backend) = rw_server();
    let (mut disk, disk_handle) = go_pair(&server, "disk");
    let second = MemExport::new(SIZE);
    let info = export_info("second", SIZE as u64, transmission_flags(false));
    server
        .add_export(served(info.clone(), Arc::clone(&second)))
        .expect("add an export");
    assert!(
        server
            .add_export(served(info, MemExport::new(SIZE)))
            .is_err(),
        "a name already exported is refused"
    );
    let (mut client, handle) = go_pair(&server, "second");
    assert_eq!(client.write(4096, &[7u8; 4096]), 0);
    assert_eq!(second.contents(4096, 4096), vec![7u8; 4096]);

    assert!(
        server.remove_export("second", Duration::from_secs(10)),
        "its connection ended within the wait"
    );
    let _ended = handle.join().expect("the connection's thread ended");
    let after = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| client.read(0, 4096)));
    assert!(
        !matches!(after, Ok(Ok(_))),
        "the removed export's connection is closed"
    );
    // A new connection is not offered it.
    let (mut stream, refused) = connect_pair(&server);
    ask_export_name(&mut stream, b"second");
    assert!(matches!(
        refused.join().unwrap(),
        Err(ConnectionError::Handshake { .. })
    ));
    // The other export's connection was not touched.
    assert_eq!(disk.write(0, &[9u8; 4096]), 0);
    assert_eq!(backend.contents(0, 4096), vec![9u8; 4096]);
    assert_eq!(disk.read(0, 4096).expect("read"), vec![9u8; 4096]);
    drop(disk);
    assert!(disk_handle.join().unwrap().is_ok());
}

/// A connection whose handshake began before its export was removed may still choose it (the
/// handshake offers what the table held when it began), but ends before any request reaches
/// the removed export's backend.
#[test]
fn an_export_removed_during_a_handshake_takes_no_request() {
    let (server, _backend) = rw_server();
    let second = MemExport::new(SIZE);
    let info = export_info("second", SIZE as u64, transmission_flags(false));
    server
        .add_export(served(info, Arc::clone(&second)))
        .expect("add an export");
    let (mut stream, handle) = connect_pair(&server);
    read_greeting(&mut stream);
    assert!(server.remove_export("second", Duration::from_secs(10)));
    choose_export_name(&mut stream, b"second");
    let mut request = Vec::new();
    request.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
    request.extend_from_slice(&0u16.to_be_bytes());
    request.extend_from_slice(&NBD_CMD_WRITE.to_be_bytes());
    request.extend_from_slice(&1u64.to_be_bytes());
    request.extend_from_slice(&0u64.to_be_bytes());
    request.extend_from_slice(&4096u32.to_be_bytes());
    request.extend_from_slice(&[5u8; 4096]);
    let _ = stream.write_all(&request);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = handle.join().expect("the connection's thread ended");
    assert!(
        second.calls().is_empty(),
        "no request reached the removed export: {:?}",
        second.calls()
    );
}
