//! The NBD client (`ssdcache_nbd::client`) against this crate's server with
//! an in-memory export.

mod common;

use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use common::*;
use ssdcache_nbd::client::{connect, ClientConfig, ClientError, Request};
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{transmission_flags, Command, Errno, Server, ServerConfig};

const SIZE: usize = 1 << 20;

fn server(read_only: bool) -> (Server, Arc<MemExport>) {
    let backend = MemExport::new(SIZE);
    let info = export_info("disk", SIZE as u64, transmission_flags(read_only));
    let served = served(info, Arc::clone(&backend));
    let server = Server::new(vec![served], ServerConfig::default()).unwrap();
    (server, backend)
}

/// The client end of a socket pair whose other end the server serves.
fn serve_pair(server: &Server) -> UnixStream {
    let (client, server_end) = UnixStream::pair().unwrap();
    let server = server.clone();
    thread::spawn(move || server.serve_stream(server_end));
    client
}

fn config(depth: usize) -> ClientConfig {
    ClientConfig {
        max_in_flight: depth,
        io_timeout: Some(Duration::from_secs(10)),
        ..ClientConfig::default()
    }
}

#[test]
fn go_reports_the_export_and_block_sizes() {
    let (server, _) = server(false);
    let (sender, _receiver) = connect::<_, ()>(serve_pair(&server), "disk", &config(4)).unwrap();
    let export = sender.export();
    assert_eq!(export.size, SIZE as u64);
    assert_eq!(export.flags, transmission_flags(false));
    assert_eq!((export.min_block, export.preferred_block), (4096, 4096));
    assert_eq!(export.max_request, 32 << 20);
}

#[test]
fn pipelined_requests_come_back_with_their_tags_and_data() {
    let (server, backend) = server(false);
    let (mut sender, mut receiver) =
        connect::<_, &str>(serve_pair(&server), "disk", &config(8)).unwrap();
    let first = pattern(1, 8192);
    let second = pattern(2, 4096);
    sender.send(Request::write(0, &first), "w0").unwrap();
    sender
        .send(Request::write(65536, &second).fua(), "w1")
        .unwrap();
    sender.send(Request::flush(), "flush").unwrap();
    let mut data = Vec::new();
    let mut tags = Vec::new();
    for _ in 0..3 {
        let reply = receiver.recv(&mut data).unwrap();
        assert_eq!(reply.result, Ok(()), "{}", reply.tag);
        assert!(data.is_empty(), "no data for {}", reply.tag);
        tags.push(reply.tag);
    }
    tags.sort_unstable();
    assert_eq!(tags, ["flush", "w0", "w1"]);
    assert_eq!(backend.contents(0, 8192), first);

    sender.send(Request::read(65536, 4096), "r1").unwrap();
    let reply = receiver.recv(&mut data).unwrap();
    assert_eq!((reply.tag, reply.header.command), ("r1", Command::Read));
    assert_eq!(data, second);
    sender.send(Request::write_zeroes(0, 4096), "z").unwrap();
    sender.send(Request::trim(4096, 4096), "t").unwrap();
    for _ in 0..2 {
        assert_eq!(receiver.recv(&mut data).unwrap().result, Ok(()));
    }
    sender.send(Request::read(0, 8192), "r0").unwrap();
    receiver.recv(&mut data).unwrap();
    assert_eq!(
        &data[..4096],
        &[0u8; 4096][..],
        "WRITE_ZEROES reads as zeroes"
    );
    assert_eq!(receiver.in_flight(), 0);
}

#[test]
fn server_errors_are_returned_per_request() {
    let (server, _) = server(true);
    let (mut sender, mut receiver) =
        connect::<_, ()>(serve_pair(&server), "disk", &config(2)).unwrap();
    sender.send(Request::write(0, &[7; 4096]), ()).unwrap();
    let reply = receiver.recv(&mut Vec::new()).unwrap();
    assert_eq!(reply.result, Err(Errno::Perm.code()));
    sender.send(Request::read(0, 4096), ()).unwrap();
    let mut data = Vec::new();
    assert_eq!(receiver.recv(&mut data).unwrap().result, Ok(()));
    assert_eq!(
        data.len(),
        4096,
        "the connection stays in sync after an error"
    );
}

#[test]
fn unknown_export_is_refused_with_the_servers_message() {
    let (server, _) = server(false);
    let error = connect::<_, ()>(serve_pair(&server), "nope", &config(1)).err();
    match error {
        Some(ClientError::Refused {
            export,
            reply_type,
            message,
        }) => {
            assert_eq!(export, "nope");
            assert_eq!(reply_type, NBD_REP_ERR_UNKNOWN);
            assert!(message.contains("nope"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn bad_requests_are_refused_before_they_are_sent() {
    let (server, _) = server(false);
    let (mut sender, _receiver) =
        connect::<_, ()>(serve_pair(&server), "disk", &config(2)).unwrap();
    let bad = [
        Request::read(512, 4096),
        Request::read(0, 1000),
        Request::read(SIZE as u64, 4096),
        Request::trim(u64::MAX - 4095, 8192),
        Request::read(0, (32 << 20) + 4096),
        Request {
            length: 8192,
            ..Request::write(0, &[0; 4096])
        },
        Request {
            command: Command::Disconnect,
            ..Request::flush()
        },
    ];
    for request in bad {
        let result = sender.send(request, ());
        assert!(
            matches!(result, Err(ClientError::InvalidRequest(_))),
            "{request:?}: {result:?}"
        );
    }
    assert_eq!(sender.in_flight(), 0, "nothing was registered");
}

#[test]
fn a_full_queue_waits_until_a_reply_frees_a_slot() {
    let (started_tx, started_rx) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let server = Server::new(
        vec![served(info, Arc::clone(&backend))],
        ServerConfig::default(),
    )
    .unwrap();
    let config = ClientConfig {
        io_timeout: Some(Duration::from_millis(300)),
        ..config(1)
    };
    let (mut sender, mut receiver) =
        connect::<_, u32>(serve_pair(&server), "disk", &config).unwrap();
    sender.send(Request::read(0, 4096), 1).unwrap();
    started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(
        sender.wait_for_slot(),
        Err(ClientError::SlotTimeout(_))
    ));
    backend.release();
    assert_eq!(receiver.recv(&mut Vec::new()).unwrap().tag, 1);
    sender.wait_for_slot().unwrap();
    sender.send(Request::read(4096, 4096), 2).unwrap();
    assert_eq!(receiver.recv(&mut Vec::new()).unwrap().tag, 2);
}

#[test]
fn after_disconnect_the_receiver_sees_a_clean_close() {
    let (client, server_end) = UnixStream::pair().unwrap();
    let (server, _) = server(false);
    let handle = thread::spawn(move || server.serve_stream(server_end));
    let (mut sender, mut receiver) = connect::<_, ()>(client, "disk", &config(1)).unwrap();
    sender.send(Request::read(0, 4096), ()).unwrap();
    receiver.recv(&mut Vec::new()).unwrap();
    sender.disconnect().unwrap();
    handle.join().unwrap().unwrap();
    let error = receiver.recv(&mut Vec::new()).unwrap_err();
    assert!(error.is_disconnect(), "{error:?}");
    assert!(matches!(error, ClientError::Closed { in_flight: 0 }));
}

#[test]
fn a_server_that_is_not_nbd_is_a_protocol_error() {
    let (client, mut other_end) = UnixStream::pair().unwrap();
    thread::spawn(move || {
        use std::io::Write;
        let _ = other_end.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        thread::sleep(Duration::from_secs(1));
    });
    let error = connect::<_, ()>(client, "disk", &config(1)).err();
    assert!(matches!(error, Some(ClientError::Protocol(_))), "{error:?}");
}
