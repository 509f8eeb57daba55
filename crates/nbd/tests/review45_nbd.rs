//! Review 45: structured replies and meta contexts over a real connection.
//!
//! F-NBD-1 (fails on 4dc6201): a zero-length READ with structured replies is answered with an
//! `NBD_REPLY_TYPE_OFFSET_DATA` chunk whose length is 8 (an offset and no data). The spec
//! (doc/proto.md, "Structured reply types") says of OFFSET_DATA "*length* MUST be at least 9",
//! and of structured READ replies "each chunk MUST describe at least one byte"; a client
//! checking the framing (libnbd) treats such a chunk as a protocol error and drops the
//! connection, while the spec says the server "SHOULD NOT disconnect" on a zero-length READ.
//! A conforming answer: one `NBD_REPLY_TYPE_NONE` chunk (length 0, DONE), or an error chunk.
//!
//! The rest held on 4dc6201 and are kept as regression checks.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::thread;

use common::*;
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{
    transmission_flags, Command, RequestHeader, Server, ServerConfig, ServerExport,
};

const SIZE: u64 = 1 << 20;

fn be32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn option_reply(stream: &mut UnixStream) -> (u32, Vec<u8>) {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    let mut payload = vec![0; be32(&header, 16) as usize];
    stream.read_exact(&mut payload).unwrap();
    (be32(&header, 12), payload)
}

fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// A server with exports "disk" and "other", a client past the greeting with structured
/// replies negotiated.
fn structured_client() -> UnixStream {
    let exports = ["disk", "other"]
        .into_iter()
        .map(|name| {
            let mut info = export_info(name, SIZE, transmission_flags(false));
            info.min_block = 1;
            ServerExport {
                info,
                backend: MemExport::new(SIZE as usize),
            }
        })
        .collect();
    let server = Server::new(exports, ServerConfig::default()).expect("server");
    let (mut client, server_end) = UnixStream::pair().unwrap();
    thread::spawn(move || server.serve_stream(server_end));
    read_greeting(&mut client);
    client
        .write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    client
        .write_all(&option_bytes(NBD_OPT_STRUCTURED_REPLY, &[]))
        .unwrap();
    assert_eq!(option_reply(&mut client).0, NBD_REP_ACK);
    client
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    client
}

fn send(stream: &mut UnixStream, command: Command, flags: u16, offset: u64, length: u32) -> u64 {
    let cookie = 0x4545 ^ offset ^ u64::from(length);
    let header = RequestHeader {
        flags,
        command,
        cookie,
        offset,
        length,
    };
    stream.write_all(&header.encode()).unwrap();
    cookie
}

/// (flags, type, cookie, payload) of one structured chunk.
fn chunk(stream: &mut UnixStream) -> (u16, u16, u64, Vec<u8>) {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    assert_eq!(be32(&header, 0), NBD_STRUCTURED_REPLY_MAGIC, "{header:?}");
    let mut payload = vec![0; be32(&header, 16) as usize];
    stream.read_exact(&mut payload).unwrap();
    (
        u16::from_be_bytes([header[4], header[5]]),
        u16::from_be_bytes([header[6], header[7]]),
        u64::from_be_bytes(header[8..16].try_into().unwrap()),
        payload,
    )
}

#[test]
fn a_zero_length_read_is_not_an_offset_data_chunk_of_no_data() {
    let mut client = structured_client();
    client.write_all(&go_bytes("disk")).unwrap();
    read_go_replies(&mut client);
    let cookie = send(&mut client, Command::Read, 0, 4096, 0);
    let (flags, kind, got, payload) = chunk(&mut client);
    assert_eq!(
        (got, flags & NBD_REPLY_FLAG_DONE),
        (cookie, NBD_REPLY_FLAG_DONE)
    );
    match kind {
        NBD_REPLY_TYPE_OFFSET_DATA => assert!(
            payload.len() >= 9,
            "OFFSET_DATA chunk of length {} (the spec: at least 9; a chunk describes at least \
             one byte)",
            payload.len()
        ),
        0 => assert!(payload.is_empty(), "NONE has no payload"),
        k if k & 0x8000 != 0 => assert!(payload.len() >= 6),
        other => panic!("chunk type {other}"),
    }
    // Still in step.
    send(&mut client, Command::Read, 0, 0, 10);
    assert_eq!(chunk(&mut client).3.len(), 18);
}

/// Held: base:allocation selected for "other", then GO "disk": BLOCK_STATUS is refused.
#[test]
fn held_meta_context_of_another_export_does_not_carry_over() {
    let mut client = structured_client();
    client
        .write_all(&option_bytes(
            NBD_OPT_SET_META_CONTEXT,
            &meta_data("other", &[BASE_ALLOCATION]),
        ))
        .unwrap();
    assert_eq!(option_reply(&mut client).0, NBD_REP_META_CONTEXT);
    assert_eq!(option_reply(&mut client).0, NBD_REP_ACK);
    client.write_all(&go_bytes("disk")).unwrap();
    read_go_replies(&mut client);
    send(&mut client, Command::BlockStatus, 0, 0, 4096);
    let (_, kind, _, payload) = chunk(&mut client);
    assert_eq!(kind, NBD_REPLY_TYPE_ERROR);
    assert_eq!(be32(&payload, 0), NBD_EINVAL);
}

/// Held: malformed LIST/SET payloads are refused with ERR_INVALID and the handshake goes on;
/// a failed SET leaves nothing selected.
#[test]
fn held_malformed_meta_context_requests() {
    let mut client = structured_client();
    let mut huge_count = meta_data("disk", &[]);
    let n = huge_count.len();
    huge_count[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
    let mut long_name = meta_data("disk", &[BASE_ALLOCATION]);
    long_name[..4].copy_from_slice(&u32::MAX.to_be_bytes());
    let mut trailing = meta_data("disk", &[BASE_ALLOCATION]);
    trailing.push(0);
    let mut short_query = meta_data("disk", &[BASE_ALLOCATION]);
    short_query.pop();
    for option in [NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT] {
        // SET first selects the context, so each malformed SET must undo it.
        client
            .write_all(&option_bytes(
                NBD_OPT_SET_META_CONTEXT,
                &meta_data("disk", &[BASE_ALLOCATION]),
            ))
            .unwrap();
        assert_eq!(option_reply(&mut client).0, NBD_REP_META_CONTEXT);
        assert_eq!(option_reply(&mut client).0, NBD_REP_ACK);
        for bad in [&huge_count, &long_name, &trailing, &short_query] {
            client.write_all(&option_bytes(option, bad)).unwrap();
            assert_eq!(
                option_reply(&mut client).0,
                NBD_REP_ERR_INVALID,
                "{option} {bad:?}"
            );
        }
    }
    // Many empty queries within the option limit: bounded work, no context.
    let mut many = meta_data("disk", &[]);
    let n = many.len();
    many[n - 4..].copy_from_slice(&10_000u32.to_be_bytes());
    many.extend(std::iter::repeat_n(0u8, 40_000));
    client
        .write_all(&option_bytes(NBD_OPT_LIST_META_CONTEXT, &many))
        .unwrap();
    assert_eq!(option_reply(&mut client).0, NBD_REP_ACK);
    client.write_all(&go_bytes("disk")).unwrap();
    read_go_replies(&mut client);
    send(&mut client, Command::BlockStatus, 0, 0, 4096);
    let (_, kind, _, _) = chunk(&mut client);
    assert_eq!(
        kind, NBD_REPLY_TYPE_ERROR,
        "the last SET failed: nothing selected"
    );
}
