//! One client connection: handshake I/O, then the transmission workers.
//!
//! Thread model (nbdkit's "parallel"): N workers share the connection. Each
//! loops { lock the reader, read one request (and its write payload) into
//! its own aligned buffer, unlock; call the backend; lock the writer, send
//! the reply, unlock }. No queue or hand-off between threads, no per-request
//! allocation, and replies go out in completion order.

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::handshake::{CloseReason, Handshake, HandshakeOutcome};
use crate::proto::{
    simple_reply_header, validate_request, Command, Errno, ProtocolError, RequestHeader,
    NBD_CMD_FLAG_FUA, NBD_CMD_FLAG_NO_HOLE, REQUEST_HEADER_LEN,
};
use crate::server::{lock, NbdStream, Registration, ServerExport, Shared};
use ssdcache_device::AlignedBuf;

/// Read-ahead buffer: big enough to pick up many pipelined request headers
/// (and small writes) per syscall.
const READ_BUFFER_BYTES: usize = 256 * 1024;

/// Why a connection ended badly. Clean ends are `Ok(())`.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("{peer}: handshake failed: {reason}")]
    Handshake { peer: String, reason: CloseReason },
    #[error("{peer}: client disconnected during the handshake")]
    HandshakeEof { peer: String },
    #[error("{peer}: no export with index {index}")]
    NoSuchExport { peer: String, index: usize },
    #[error("{peer}: {source}")]
    Protocol {
        peer: String,
        #[source]
        source: ProtocolError,
    },
    #[error("{peer}: client disconnected in the middle of a request")]
    Truncated { peer: String },
    #[error("{peer}: {context}: {source}")]
    Io {
        peer: String,
        context: &'static str,
        #[source]
        source: io::Error,
    },
}

impl ConnectionError {
    pub(crate) fn io(peer: String, context: &'static str, source: io::Error) -> Self {
        ConnectionError::Io {
            peer,
            context,
            source,
        }
    }
}

/// Where a connection starts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Start {
    /// Negotiate the export with the NBD handshake.
    Handshake,
    /// Go straight to transmission on this export (the Linux kernel client
    /// after `NBD_SET_SOCK` skips the handshake).
    Transmission { export: usize },
}

/// Runs a whole connection; the registration is released when it ends.
pub(crate) fn serve<S: NbdStream>(
    shared: &Shared,
    stream: S,
    start: Start,
    registration: Registration,
) -> Result<(), ConnectionError> {
    let peer = stream.peer_label();
    info!(%peer, "NBD connection opened");
    let result = run(shared, stream, start, &peer);
    match &result {
        Ok(()) => info!(%peer, "NBD connection closed"),
        Err(error @ (ConnectionError::Handshake { .. } | ConnectionError::Protocol { .. })) => {
            warn!(%error, "NBD connection closed after a protocol error");
        }
        Err(error) => info!(%error, "NBD connection closed"),
    }
    drop(registration);
    result
}

fn run<S: NbdStream>(
    shared: &Shared,
    mut stream: S,
    start: Start,
    peer: &str,
) -> Result<(), ConnectionError> {
    let index = match start {
        Start::Transmission { export } => export,
        Start::Handshake => match drive_handshake(&mut stream, shared, peer)? {
            Some(export) => export,
            None => return Ok(()),
        },
    };
    let Some(export) = shared.exports.get(index) else {
        return Err(ConnectionError::NoSuchExport {
            peer: peer.to_owned(),
            index,
        });
    };
    debug!(%peer, export = %export.info.name, "entering transmission");
    transmit(shared, stream, export, peer)
}

fn transmit<S: NbdStream>(
    shared: &Shared,
    stream: S,
    export: &ServerExport,
    peer: &str,
) -> Result<(), ConnectionError> {
    let io_error = |context| move |source| ConnectionError::io(peer.to_owned(), context, source);
    stream
        .set_stream_timeouts(None)
        .map_err(io_error("clearing handshake timeouts"))?;
    let writer = stream
        .try_clone_stream()
        .map_err(io_error("cloning socket"))?;
    let control = stream
        .try_clone_stream()
        .map_err(io_error("cloning socket"))?;
    let connection = Connection {
        reader: Mutex::new(BufReader::with_capacity(READ_BUFFER_BYTES, stream)),
        writer: Mutex::new(writer),
        control,
        closed: AtomicBool::new(false),
        export,
        max_payload: shared.config.max_request.min(export.info.max_block),
        shared,
        peer,
    };
    let result = connection.run_workers(shared.config.threads_per_connection);
    // Closing explicitly (rather than when the last clone drops) makes the
    // client see EOF right after the final reply.
    let _ = connection.control.shutdown_stream(Shutdown::Both);
    result
}

/// Runs the sans-I/O handshake over the socket. Reads exactly what the
/// machine needs so no transmission bytes are swallowed. Returns the chosen
/// export, or `None` after a client abort.
fn drive_handshake<S: NbdStream>(
    stream: &mut S,
    shared: &Shared,
    peer: &str,
) -> Result<Option<usize>, ConnectionError> {
    let deadline = Instant::now() + shared.config.handshake_timeout;
    let mut machine = Handshake::new(Arc::clone(&shared.infos));
    let mut chunk = [0u8; 4096];
    loop {
        set_remaining_timeout(stream, deadline, peer)?;
        stream
            .write_all(&machine.take_output())
            .map_err(|source| ConnectionError::io(peer.to_owned(), "sending handshake", source))?;
        match machine.outcome() {
            Some(HandshakeOutcome::Transmission { export, .. }) => return Ok(Some(*export)),
            Some(HandshakeOutcome::Closed(CloseReason::ClientAbort)) => return Ok(None),
            Some(HandshakeOutcome::Closed(reason)) => {
                return Err(handshake_error(peer, reason.clone()))
            }
            None => {}
        }
        let wanted = machine.bytes_needed().min(chunk.len());
        let received = read_some(stream, &mut chunk[..wanted])
            .map_err(|source| ConnectionError::io(peer.to_owned(), "reading handshake", source))?;
        if received == 0 {
            return Err(ConnectionError::HandshakeEof {
                peer: peer.to_owned(),
            });
        }
        machine.feed(&chunk[..received]);
    }
}

/// The handshake has one overall deadline, so a client trickling bytes
/// cannot hold the connection open forever.
fn set_remaining_timeout<S: NbdStream>(
    stream: &S,
    deadline: Instant,
    peer: &str,
) -> Result<(), ConnectionError> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    if remaining.is_zero() {
        let source = io::Error::new(io::ErrorKind::TimedOut, "handshake time limit reached");
        return Err(ConnectionError::io(peer.to_owned(), "handshake", source));
    }
    stream
        .set_stream_timeouts(Some(remaining.max(Duration::from_millis(1))))
        .map_err(|source| ConnectionError::io(peer.to_owned(), "setting timeouts", source))
}

fn handshake_error(peer: &str, reason: CloseReason) -> ConnectionError {
    ConnectionError::Handshake {
        peer: peer.to_owned(),
        reason,
    }
}

fn read_some(stream: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match stream.read(buf) {
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

/// A request read off the wire, with the verdict of validation (a write's
/// payload is consumed either way).
struct Request {
    header: RequestHeader,
    verdict: Result<(), Errno>,
}

/// State shared by the workers of one connection in transmission.
struct Connection<'a, S> {
    reader: Mutex<BufReader<S>>,
    writer: Mutex<S>,
    /// Lock-free handle used to shut the socket down from any thread.
    control: S,
    /// Set when no further request may be read (DISC, EOF, error, shutdown).
    closed: AtomicBool,
    export: &'a ServerExport,
    max_payload: u32,
    shared: &'a Shared,
    peer: &'a str,
}

impl<S: NbdStream> Connection<'_, S> {
    /// Runs `threads` workers (this thread included) until all have stopped;
    /// returns the first error any of them hit.
    fn run_workers(&self, threads: usize) -> Result<(), ConnectionError> {
        thread::scope(|scope| {
            let mut helpers = Vec::with_capacity(threads.saturating_sub(1));
            for _ in 1..threads {
                let spawned = thread::Builder::new()
                    .name("nbd-worker".into())
                    .spawn_scoped(scope, || self.worker());
                match spawned {
                    Ok(handle) => helpers.push(handle),
                    Err(error) => {
                        warn!(peer = %self.peer, %error, "running with fewer worker threads");
                        break;
                    }
                }
            }
            let mut first_error = self.worker().err();
            for helper in helpers {
                match helper.join() {
                    Ok(Err(error)) => {
                        first_error.get_or_insert(error);
                    }
                    Ok(Ok(())) => {}
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            first_error.map_or(Ok(()), Err)
        })
    }

    fn worker(&self) -> Result<(), ConnectionError> {
        let _abort_on_panic = AbortOnPanic(self);
        let mut buf = AlignedBuf::try_zeroed(0).ok_or_else(|| self.out_of_memory())?;
        loop {
            let Some(request) = self.next_request(&mut buf)? else {
                return Ok(());
            };
            let outcome = self.execute(&request, &mut buf);
            if let Err(errno) = outcome {
                debug!(peer = %self.peer, header = ?request.header, %errno, "request failed");
            }
            self.send_reply(&request.header, outcome, &buf)?;
        }
    }

    /// Reads the next request under the reader lock, or `None` when this
    /// connection should read no more.
    fn next_request(&self, buf: &mut AlignedBuf) -> Result<Option<Request>, ConnectionError> {
        let mut reader = lock(&self.reader);
        if self.closed.load(Ordering::SeqCst) || self.shared.is_shutting_down() {
            self.closed.store(true, Ordering::SeqCst);
            return Ok(None);
        }
        let result = self.read_request(&mut reader, buf);
        if !matches!(result, Ok(Some(_))) {
            self.closed.store(true, Ordering::SeqCst);
        }
        result
    }

    fn read_request(
        &self,
        input: &mut BufReader<S>,
        buf: &mut AlignedBuf,
    ) -> Result<Option<Request>, ConnectionError> {
        let mut raw = [0u8; REQUEST_HEADER_LEN];
        if !self.read_header(input, &mut raw)? {
            debug!(peer = %self.peer, "client closed the connection");
            return Ok(None);
        }
        let header = RequestHeader::parse(&raw).map_err(|source| ConnectionError::Protocol {
            peer: self.peer.to_owned(),
            source,
        })?;
        if header.command == Command::Disconnect {
            debug!(peer = %self.peer, "client sent NBD_CMD_DISC");
            return Ok(None);
        }
        let mut verdict = validate_request(&header, &self.export.info, self.max_payload);
        if header.has_payload() {
            verdict = self.read_payload(input, &header, verdict, buf)?;
        }
        Ok(Some(Request { header, verdict }))
    }

    /// Fills `raw`; false on EOF before the first byte (a clean close).
    fn read_header(
        &self,
        input: &mut BufReader<S>,
        raw: &mut [u8; REQUEST_HEADER_LEN],
    ) -> Result<bool, ConnectionError> {
        let mut filled = 0;
        while filled < raw.len() {
            match input.read(&mut raw[filled..]) {
                Ok(0) if filled == 0 => return Ok(false),
                Ok(0) => return Err(self.truncated()),
                Ok(n) => filled += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(self.io_error("reading request", error)),
            }
        }
        Ok(true)
    }

    /// Reads a write payload into `buf` if the request is valid, otherwise
    /// streams it into the void so the next header is found where expected.
    fn read_payload(
        &self,
        input: &mut BufReader<S>,
        header: &RequestHeader,
        mut verdict: Result<(), Errno>,
        buf: &mut AlignedBuf,
    ) -> Result<Result<(), Errno>, ConnectionError> {
        if verdict.is_ok() {
            match prefix_mut(buf, header.length as usize) {
                Ok(destination) => {
                    input
                        .read_exact(destination)
                        .map_err(|e| self.payload_error(e))?;
                    return Ok(verdict);
                }
                Err(errno) => verdict = Err(errno),
            }
        }
        let length = u64::from(header.length);
        // io::copy uses a fixed stack buffer: no allocation of `length` bytes.
        let discarded = io::copy(&mut input.by_ref().take(length), &mut io::sink())
            .map_err(|e| self.payload_error(e))?;
        if discarded < length {
            return Err(self.truncated());
        }
        Ok(verdict)
    }

    fn execute(&self, request: &Request, buf: &mut AlignedBuf) -> Result<(), Errno> {
        request.verdict?;
        let header = &request.header;
        if header.length == 0 && header.command != Command::Flush {
            return Ok(());
        }
        let backend = &*self.export.backend;
        let (offset, length) = (header.offset, u64::from(header.length));
        let fua = header.flags & NBD_CMD_FLAG_FUA != 0;
        match header.command {
            Command::Read => backend.read(offset, prefix_mut(buf, header.length as usize)?),
            Command::Write => backend.write(offset, prefix(buf, header.length as usize), fua),
            Command::Flush => backend.flush(),
            Command::Trim => backend.trim(offset, length, fua),
            Command::WriteZeroes => {
                let may_trim = header.flags & NBD_CMD_FLAG_NO_HOLE == 0;
                backend.write_zeroes(offset, length, fua, may_trim)
            }
            Command::Cache => backend.cache(offset, length),
            // Validation rejects these; answering EINVAL keeps this total.
            Command::Disconnect | Command::Unknown(_) => Err(Errno::Invalid),
        }
    }

    /// Header and read data leave in one writev under the writer lock, so
    /// replies from different workers never interleave.
    fn send_reply(
        &self,
        header: &RequestHeader,
        outcome: Result<(), Errno>,
        buf: &AlignedBuf,
    ) -> Result<(), ConnectionError> {
        let reply = simple_reply_header(outcome.err(), header.cookie);
        let data = match (outcome, header.command) {
            (Ok(()), Command::Read) => prefix(buf, header.length as usize),
            _ => &[],
        };
        let mut slices = [IoSlice::new(&reply), IoSlice::new(data)];
        let written = write_all_vectored(&mut *lock(&self.writer), &mut slices);
        written.map_err(|error| {
            self.abort();
            self.io_error("sending reply", error)
        })
    }

    /// Stops every worker: no more reads, and blocked reads return EOF.
    fn abort(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.control.shutdown_stream(Shutdown::Both);
    }

    fn payload_error(&self, error: io::Error) -> ConnectionError {
        if error.kind() == io::ErrorKind::UnexpectedEof {
            self.truncated()
        } else {
            self.io_error("reading write payload", error)
        }
    }

    fn truncated(&self) -> ConnectionError {
        ConnectionError::Truncated {
            peer: self.peer.to_owned(),
        }
    }

    fn io_error(&self, context: &'static str, source: io::Error) -> ConnectionError {
        ConnectionError::io(self.peer.to_owned(), context, source)
    }

    fn out_of_memory(&self) -> ConnectionError {
        let source = io::Error::from(io::ErrorKind::OutOfMemory);
        self.io_error("allocating a request buffer", source)
    }
}

/// If a backend call panics, the other workers would otherwise stay blocked
/// reading from a client that is still connected; closing the socket ends
/// them so the panic can propagate and the connection is released.
struct AbortOnPanic<'c, 'a, S: NbdStream>(&'c Connection<'a, S>);

impl<S: NbdStream> Drop for AbortOnPanic<'_, '_, S> {
    fn drop(&mut self) {
        if thread::panicking() {
            self.0.abort();
        }
    }
}

fn write_all_vectored(writer: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match writer.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut slices, written),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// The first `len` bytes of a worker's buffer, growing it if needed (contents are scratch).
fn prefix_mut(buf: &mut AlignedBuf, len: usize) -> Result<&mut [u8], Errno> {
    if !buf.try_resize_discarding(len) {
        return Err(Errno::NoMem);
    }
    Ok(&mut buf[..])
}

/// The first `len` bytes of a worker's buffer, clamped to what it holds.
fn prefix(buf: &AlignedBuf, len: usize) -> &[u8] {
    &buf[..len.min(buf.len())]
}
