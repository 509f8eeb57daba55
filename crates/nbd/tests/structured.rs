//! Structured replies and block status over a real connection (issue 13, item 3): the
//! chunks' framing, errors as error chunks, `NBD_CMD_FLAG_REQ_ONE`, descriptors never past
//! the request, and commands that keep simple replies.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread;

use common::*;
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{
    transmission_flags, Command, Errno, Export, RequestHeader, Run, Server, ServerConfig,
    ServerExport,
};

const SIZE: u64 = 1 << 20;

/// A memory export whose allocation is fixed: data in the first 64 KiB, then a hole to 512 KiB,
/// then data to the end, with the runs deliberately reaching past what was asked.
struct Sparse(Arc<MemExport>);

impl Export for Sparse {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        self.0.write(offset, data, fua)
    }
    fn flush(&self) -> Result<(), Errno> {
        self.0.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno> {
        self.0.trim(offset, length, fua)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno> {
        self.0.write_zeroes(offset, length, fua, may_trim)
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), Errno> {
        self.0.cache(offset, length)
    }
    fn allocation(&self, offset: u64, _length: u64) -> Result<Vec<Run>, Errno> {
        let bounds = [
            (0, 64 << 10, false),
            (64 << 10, 512 << 10, true),
            (512 << 10, SIZE, false),
        ];
        Ok(bounds
            .iter()
            .filter(|(_, end, _)| *end > offset)
            .map(|&(start, end, hole)| Run {
                len: end - start.max(offset),
                hole,
            })
            .collect())
    }
}

/// One structured reply chunk.
#[derive(Debug)]
struct Chunk {
    flags: u16,
    kind: u16,
    cookie: u64,
    payload: Vec<u8>,
}

fn be32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap())
}

/// Reads one option reply: (type, payload).
fn option_reply(stream: &mut UnixStream) -> (u32, Vec<u8>) {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    let mut payload = vec![0; be32(&header, 16) as usize];
    stream.read_exact(&mut payload).unwrap();
    (be32(&header, 12), payload)
}

fn meta_option(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    option_bytes(NBD_OPT_SET_META_CONTEXT, &data)
}

/// Connects with structured replies and, if `block_status`, `base:allocation`.
fn connect(block_status: bool) -> UnixStream {
    let backend = Arc::new(Sparse(MemExport::new(SIZE as usize)));
    let mut info = export_info("disk", SIZE, transmission_flags(false));
    info.min_block = 1;
    let server = Server::new(
        vec![ServerExport { info, backend }],
        ServerConfig::default(),
    )
    .expect("server");
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
    if block_status {
        client
            .write_all(&meta_option("disk", &[BASE_ALLOCATION]))
            .unwrap();
        let (kind, payload) = option_reply(&mut client);
        assert_eq!(kind, NBD_REP_META_CONTEXT);
        assert_eq!(be32(&payload, 0), BASE_ALLOCATION_ID);
        assert_eq!(&payload[4..], BASE_ALLOCATION.as_bytes());
        assert_eq!(option_reply(&mut client).0, NBD_REP_ACK);
    }
    client.write_all(&go_bytes("disk")).unwrap();
    read_go_replies(&mut client);
    client
}

fn send(stream: &mut UnixStream, command: Command, flags: u16, offset: u64, length: u32) -> u64 {
    let cookie = offset ^ u64::from(length) ^ 0x5a5a;
    let header = RequestHeader {
        flags,
        command,
        cookie,
        offset,
        length,
    };
    stream.write_all(&header.encode()).unwrap();
    if command == Command::Write {
        stream.write_all(&pattern(7, length as usize)).unwrap();
    }
    cookie
}

fn chunk(stream: &mut UnixStream) -> Chunk {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    assert_eq!(
        be32(&header, 0),
        NBD_STRUCTURED_REPLY_MAGIC,
        "a structured chunk"
    );
    let mut payload = vec![0; be32(&header, 16) as usize];
    stream.read_exact(&mut payload).unwrap();
    Chunk {
        flags: u16::from_be_bytes([header[4], header[5]]),
        kind: u16::from_be_bytes([header[6], header[7]]),
        cookie: u64::from_be_bytes(header[8..16].try_into().unwrap()),
        payload,
    }
}

/// The error of a final error chunk.
fn error_of(chunk: &Chunk) -> u32 {
    assert_eq!(chunk.kind, NBD_REPLY_TYPE_ERROR, "{chunk:?}");
    assert_eq!(chunk.flags, NBD_REPLY_FLAG_DONE);
    assert_eq!(chunk.payload.len(), 6, "error and an empty message");
    be32(&chunk.payload, 0)
}

/// (length, flags) descriptors of a final base:allocation chunk.
fn descriptors(chunk: &Chunk) -> Vec<(u32, u32)> {
    assert_eq!(chunk.kind, NBD_REPLY_TYPE_BLOCK_STATUS, "{chunk:?}");
    assert_eq!(chunk.flags, NBD_REPLY_FLAG_DONE);
    assert_eq!(be32(&chunk.payload, 0), BASE_ALLOCATION_ID);
    chunk.payload[4..]
        .chunks_exact(8)
        .map(|d| (be32(d, 0), be32(d, 4)))
        .collect()
}

#[test]
fn reads_are_one_offset_data_chunk_and_errors_are_error_chunks() {
    let mut client = connect(false);
    let cookie = send(&mut client, Command::Write, 0, 1000, 3000);
    let mut simple = [0u8; 16];
    client.read_exact(&mut simple).unwrap();
    assert_eq!(
        be32(&simple, 0),
        NBD_SIMPLE_REPLY_MAGIC,
        "a write keeps a simple reply"
    );
    assert_eq!(be32(&simple, 4), 0);
    assert_eq!(
        u64::from_be_bytes(simple[8..16].try_into().unwrap()),
        cookie
    );

    let cookie = send(&mut client, Command::Read, 0, 1000, 3000);
    let read = chunk(&mut client);
    assert_eq!(
        (read.kind, read.flags, read.cookie),
        (NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_FLAG_DONE, cookie)
    );
    assert_eq!(
        u64::from_be_bytes(read.payload[..8].try_into().unwrap()),
        1000
    );
    assert_eq!(&read.payload[8..], &pattern(7, 3000)[..]);

    send(&mut client, Command::Read, 0, SIZE - 10, 20);
    assert_eq!(
        error_of(&chunk(&mut client)),
        NBD_EINVAL,
        "a read past the end"
    );
    send(&mut client, Command::Read, NBD_CMD_FLAG_REQ_ONE, 0, 20);
    assert_eq!(
        error_of(&chunk(&mut client)),
        NBD_EINVAL,
        "a flag a read does not take"
    );
    send(&mut client, Command::BlockStatus, 0, 0, 4096);
    assert_eq!(
        error_of(&chunk(&mut client)),
        NBD_EINVAL,
        "block status not negotiated"
    );
    // Still in step.
    send(&mut client, Command::Read, 0, 0, 10);
    assert_eq!(chunk(&mut client).payload.len(), 18);
}

#[test]
fn block_status_describes_holes_within_the_request() {
    let mut client = connect(true);
    let cookie = send(&mut client, Command::BlockStatus, 0, 0, SIZE as u32);
    let status = chunk(&mut client);
    assert_eq!(status.cookie, cookie);
    let hole_zero = NBD_STATE_HOLE | NBD_STATE_ZERO;
    assert_eq!(
        descriptors(&status),
        [(64 << 10, 0), (448 << 10, hole_zero), (512 << 10, 0)]
    );
    // From inside the hole, shorter than it: one descriptor, no longer than asked.
    send(&mut client, Command::BlockStatus, 0, 100 << 10, 4096);
    assert_eq!(descriptors(&chunk(&mut client)), [(4096, hole_zero)]);
    // REQ_ONE: only the first descriptor.
    send(
        &mut client,
        Command::BlockStatus,
        NBD_CMD_FLAG_REQ_ONE,
        0,
        SIZE as u32,
    );
    assert_eq!(descriptors(&chunk(&mut client)), [(64 << 10, 0)]);
    // Byte offsets (minimum block 1).
    send(&mut client, Command::BlockStatus, 0, (64 << 10) - 1, 2);
    assert_eq!(descriptors(&chunk(&mut client)), [(1, 0), (1, hole_zero)]);
    // Refusals: length 0, past the end, an unknown flag.
    send(&mut client, Command::BlockStatus, 0, 0, 0);
    assert_eq!(error_of(&chunk(&mut client)), NBD_EINVAL, "length 0");
    send(&mut client, Command::BlockStatus, 0, SIZE - 4096, 8192);
    assert_eq!(error_of(&chunk(&mut client)), NBD_EINVAL, "past the end");
    send(&mut client, Command::BlockStatus, NBD_CMD_FLAG_DF, 0, 4096);
    assert_eq!(error_of(&chunk(&mut client)), NBD_EINVAL, "DF");
    send(&mut client, Command::BlockStatus, 0, 0, 4096);
    assert_eq!(
        descriptors(&chunk(&mut client)),
        [(4096, 0)],
        "still in step"
    );
}
