//! The NBD server end to end: `Server::serve_stream` on one end of a Unix socket pair, the
//! fuzz input written into the other end as everything a client sends, then the server's
//! whole answer read back. Checked: no panic; the connection ends within [`TIME_LIMIT`]; the
//! answer is exactly what the protocol asks for: the handshake machine's output for the same
//! bytes, then, in transmission, one reply per request in order (one reading thread and
//! one worker thread per connection make the order fixed: the export keeps every request in
//! the slow lane), with the error `validate_request` gives or success: simple replies, or when
//! the handshake negotiated structured replies, one chunk for a READ or BLOCK_STATUS (an error
//! chunk for a failure) and simple replies for the rest; for a successful READ the data a
//! model of the export holds, for BLOCK_STATUS one data descriptor of the request's length
//! (RAM exports cannot tell holes) (writes, TRIM and WRITE_ZEROES
//! applied as the replies say); and the connection ends cleanly exactly when the client ended
//! cleanly (`NBD_OPT_ABORT`, `NBD_CMD_DISC`, or EOF between requests).
//!
//! Input: the client's bytes (at most [`MAX_INPUT`]: more may not fit the socket buffer
//! before the server reads, and the test writes everything before it reads).
//!
//! Public API used: `Server::new`, `Server::serve_stream`, `ServerConfig` (its `Default` plus
//! `threads_per_connection`, `fast_threads_per_connection` and `max_request`), `ServerExport`, `Export`, `Handshake`,
//! `RequestHeader::parse`, `validate_request`, `ReplyHead`, `block_status_payload`.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use ssdcache_nbd::proto::{
    block_status_payload, validate_request, ReplyHead, Session, NBD_CMD_FLAG_NO_HOLE,
    NBD_CMD_FLAG_REQ_ONE, REQUEST_HEADER_LEN,
};
use ssdcache_nbd::{
    CloseReason, Command, ConnectionError, Errno, Export, HandshakeOutcome, RequestHeader, Server,
    ServerConfig, ServerExport,
};

use crate::nbd_handshake::{self, exports};

/// Longest input written to the server.
pub const MAX_INPUT: usize = 64 << 10;
/// How long one input may take before it counts as a hang.
pub const TIME_LIMIT: Duration = Duration::from_secs(10);
/// The server's payload limit (below each export's `max_block`).
const MAX_REQUEST: u32 = 32 << 10;

/// A RAM export; TRIM zeroes, as WRITE_ZEROES does.
struct RamDisk(Mutex<Vec<u8>>);

impl RamDisk {
    fn with<T>(&self, f: impl FnOnce(&mut Vec<u8>) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The server checked offsets and lengths against the export, so slicing cannot fail unless
/// the server let a bad request through: then the panic is the finding.
impl Export for RamDisk {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let at = offset as usize;
        self.with(|disk| buf.copy_from_slice(&disk[at..at + buf.len()]));
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        let at = offset as usize;
        self.with(|disk| disk[at..at + data.len()].copy_from_slice(data));
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), Errno> {
        self.write_zeroes(offset, length, false, true)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        _fua: bool,
        _may_trim: bool,
    ) -> Result<(), Errno> {
        let (at, len) = (offset as usize, length as usize);
        self.with(|disk| disk[at..at + len].fill(0));
        Ok(())
    }
    fn cache(&self, _offset: u64, _length: u64) -> Result<(), Errno> {
        Ok(())
    }
}

/// A connection for the serving thread.
struct Job {
    server: Server,
    stream: UnixStream,
    done: Sender<Result<(), ConnectionError>>,
}

/// One long-lived thread serves every input's connection: spawning a thread per input would
/// cost more than the input. (A panic there aborts the process through libFuzzer's hook.)
fn serving_thread() -> Sender<Job> {
    static JOBS: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();
    let jobs = JOBS.get_or_init(|| {
        let (sender, receiver) = mpsc::channel::<Job>();
        std::thread::spawn(move || serve_jobs(receiver));
        Mutex::new(sender)
    });
    jobs.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

fn serve_jobs(jobs: Receiver<Job>) {
    for job in jobs {
        let result = job.server.serve_stream(job.stream);
        let _ = job.done.send(result);
    }
}

pub fn check(data: &[u8]) {
    let input = &data[..data.len().min(MAX_INPUT)];
    let expected = expected_answer(input);
    let (answer, result) = serve(input);
    assert_eq!(
        result.is_ok(),
        expected.clean_end,
        "connection result {result:?}"
    );
    if answer != expected.bytes {
        let at = answer
            .iter()
            .zip(&expected.bytes)
            .take_while(|(a, b)| a == b)
            .count();
        panic!(
            "the server's answer differs from the protocol's at byte {at}: {} bytes sent, {} expected ({result:?})",
            answer.len(),
            expected.bytes.len()
        );
    }
}

/// Runs a fresh server with fresh exports on `input`; returns what it sent and how the
/// connection ended.
fn serve(input: &[u8]) -> (Vec<u8>, Result<(), ConnectionError>) {
    let exports = exports()
        .into_iter()
        .map(|info| ServerExport {
            backend: Arc::new(RamDisk(Mutex::new(vec![0; info.size as usize]))),
            info,
        })
        .collect();
    let config = ServerConfig {
        threads_per_connection: 1,
        fast_threads_per_connection: 1,
        max_request: MAX_REQUEST,
        ..ServerConfig::default()
    };
    let server = Server::new(exports, config).expect("the fuzzed server's configuration is valid");
    let (mut client, stream) = UnixStream::pair().expect("socket pair");
    let (done, finished) = mpsc::channel();
    serving_thread()
        .send(Job {
            server,
            stream,
            done,
        })
        .expect("the serving thread is running");
    client
        .set_read_timeout(Some(TIME_LIMIT))
        .expect("read timeout");
    client
        .write_all(input)
        .expect("the input fits the socket buffer");
    client.shutdown(Shutdown::Write).expect("shutdown");
    let mut answer = Vec::new();
    match client.read_to_end(&mut answer) {
        Ok(_) => {}
        // The server closed with input left unread (after NBD_CMD_DISC, NBD_OPT_ABORT or a
        // protocol error): Linux reports that as a reset once the queued answer is read.
        Err(error) if error.kind() == ErrorKind::ConnectionReset => {}
        Err(error) => {
            panic!("the server did not close the connection within {TIME_LIMIT:?}: {error}")
        }
    }
    let result = finished.recv_timeout(TIME_LIMIT).unwrap_or_else(|error| {
        panic!("serve_stream did not return within {TIME_LIMIT:?}: {error}")
    });
    (answer, result)
}

/// What the server must send for `input`, and whether the connection ends cleanly.
pub struct Expected {
    pub bytes: Vec<u8>,
    pub clean_end: bool,
}

fn expected_answer(input: &[u8]) -> Expected {
    let handshake = nbd_handshake::run(input, 0);
    let mut bytes = handshake.output;
    let (export, session) = match handshake.outcome {
        Some(HandshakeOutcome::Transmission {
            export, session, ..
        }) => (export, session),
        Some(HandshakeOutcome::Closed(CloseReason::ClientAbort)) => {
            return Expected {
                bytes,
                clean_end: true,
            }
        }
        Some(HandshakeOutcome::Closed(CloseReason::Protocol(_))) | None => {
            return Expected {
                bytes,
                clean_end: false,
            }
        }
    };
    let clean_end = transmission(&input[handshake.consumed..], export, session, &mut bytes);
    Expected { bytes, clean_end }
}

/// Appends the replies to the requests in `input` on export `export`; true if the requests
/// end cleanly (EOF between requests, or `NBD_CMD_DISC`).
fn transmission(mut input: &[u8], export: usize, session: Session, out: &mut Vec<u8>) -> bool {
    let info = &exports()[export];
    let max_payload = MAX_REQUEST.min(info.max_block);
    let mut disk = vec![0u8; info.size as usize];
    loop {
        if input.is_empty() {
            return true;
        }
        let Some((raw, rest)) = input.split_first_chunk::<REQUEST_HEADER_LEN>() else {
            return false;
        };
        let Ok(header) = RequestHeader::parse(raw) else {
            return false;
        };
        if header.command == Command::Disconnect {
            return true;
        }
        let payload_len = if header.has_payload() {
            header.length as usize
        } else {
            0
        };
        if rest.len() < payload_len {
            return false;
        }
        let (payload, rest) = rest.split_at(payload_len);
        input = rest;
        let verdict = validate_request(&header, info, max_payload, &session);
        let structured = session.structured_replies && header.command.replies_with_data();
        match verdict {
            Err(error) if structured => {
                out.extend_from_slice(ReplyHead::error_chunk(error, header.cookie).as_bytes())
            }
            Err(error) => {
                out.extend_from_slice(ReplyHead::simple(Some(error), header.cookie).as_bytes())
            }
            Ok(()) => {
                reply_head(&header, structured, out);
                apply(&header, payload, &mut disk, out);
            }
        }
    }
}

/// The head of the reply to an accepted request.
fn reply_head(header: &RequestHeader, structured: bool, out: &mut Vec<u8>) {
    let head = match header.command {
        Command::Read if structured && header.length == 0 => ReplyHead::none(header.cookie),
        Command::Read if structured => {
            ReplyHead::read_data(header.cookie, header.offset, header.length)
        }
        Command::BlockStatus => {
            let payload = block_status_payload([(header.length, false)].into_iter());
            ReplyHead::block_status(header.cookie, payload.len())
        }
        _ => ReplyHead::simple(None, header.cookie),
    };
    out.extend_from_slice(head.as_bytes());
}

/// What an accepted request does to the model of the export, and the data a READ returns.
fn apply(header: &RequestHeader, payload: &[u8], disk: &mut [u8], out: &mut Vec<u8>) {
    // Only the commands with data have an offset and length the server checked.
    let range = || header.offset as usize..header.offset as usize + header.length as usize;
    match header.command {
        Command::Read => out.extend_from_slice(&disk[range()]),
        Command::BlockStatus => {
            out.extend_from_slice(&block_status_payload([(header.length, false)].into_iter()))
        }
        Command::Write => disk[range()].copy_from_slice(payload),
        Command::Trim | Command::WriteZeroes => disk[range()].fill(0),
        Command::Flush | Command::Cache | Command::Disconnect | Command::Unknown(_) => {}
    }
}

/// Whole sessions: each handshake of the handshake target, followed on the writable export
/// by writes, reads of what was written, TRIM, WRITE_ZEROES, FLUSH, an invalid request and
/// a disconnect.
pub fn seeds() -> Vec<Vec<u8>> {
    let requests = requests();
    nbd_handshake::sessions()
        .into_iter()
        .map(|mut session| {
            session.extend_from_slice(&requests);
            session
        })
        .collect()
}

fn requests() -> Vec<u8> {
    let mut out = Vec::new();
    let mut request = |command, flags, offset: u64, length: u32, payload: &[u8]| {
        let cookie = out.len() as u64;
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        out.extend_from_slice(&header.encode());
        out.extend_from_slice(payload);
    };
    request(Command::Write, 0, 4096, 1024, &[0xab; 1024]);
    request(Command::Read, 0, 4096, 2048, &[]);
    request(Command::WriteZeroes, NBD_CMD_FLAG_NO_HOLE, 4096, 512, &[]);
    request(Command::Trim, 0, 0, 4096, &[]);
    request(Command::Flush, 0, 0, 0, &[]);
    request(Command::Cache, 0, 0, 8192, &[]);
    request(Command::Read, 0, 100, 512, &[]);
    request(Command::Read, 0, 0, 4096, &[]);
    request(Command::BlockStatus, 0, 0, 65536, &[]);
    request(Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 100, 7, &[]);
    request(Command::Disconnect, 0, 0, 0, &[]);
    out
}
