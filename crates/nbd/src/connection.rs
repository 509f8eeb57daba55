//! One client connection: handshake I/O, then the transmission workers.
//!
//! Thread model: two lanes of workers per connection, so that a request the cache serves
//! never waits for a worker that waits for the slow (backing) device (issue #11).
//!
//! * Fast workers (`fast_threads_per_connection`; the connection's own thread is one) take
//!   turns reading: lock the reader, read one request header (and a write's payload, into a
//!   buffer leased from the server's pool), unlock. Then they ask the export where the
//!   request runs ([`Export::lane`]). A fast one (a cache hit) the worker runs and answers
//!   itself, as in nbdkit's "parallel" model: no hand-off between threads. A slow one (it may
//!   touch the backing device; every command but READ and WRITE) goes into the connection's
//!   slow queue, and the worker goes back to reading.
//! * Slow workers (`threads_per_connection`, started when a queued request finds none idle)
//!   take requests from the queue in order, run them and answer.
//! * If the export has [`Export::ring_reads`](crate::Export::ring_reads), a completion thread:
//!   a fast worker starts the READs of its batch that the export can end there and goes back
//!   to reading; the completion thread answers each as it ends ([`RingLane`]).
//!
//! Replies go out in completion order through the connection's outbox ([`Outbox`]): a worker
//! queues each reply and goes back to reading; one sender thread (`nbd-sender`) writes them,
//! up to [`MAX_READ_BATCH`] per `writev`. A client that sends many requests before it reads a
//! reply never stops the connection from reading them: requests go on being read while their
//! replies wait, up to the connection's request memory (a READ's reply holds its buffer until
//! sent) and [`REPLY_QUEUE`] replies. The slow queue holds at most [`SLOW_LANE_QUEUE`] requests; while it is full, a fast worker
//! with a slow request waits for room, and once every fast worker waits so, the connection
//! reads nothing more (back-pressure, as when its request memory is used up).
//!
//! Time limits: the wait for a request's first byte is bounded only by the idle timeout, and
//! only while no reply is owed; the rest of the request and every reply are bounded by the
//! I/O timeout.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, IoSlice, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, Scope};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::buffers::{ConnectionMemory, Lease};
use crate::handshake::{CloseReason, Handshake, HandshakeOutcome, TlsPolicy};
use crate::outbox::Outbox;
use crate::proto::{
    block_status_payload, validate_request, Command, Errno, ProtocolError, ReplyHead,
    RequestHeader, Session, NBD_CMD_FLAG_FUA, NBD_CMD_FLAG_NO_HOLE, NBD_CMD_FLAG_REQ_ONE,
    REQUEST_HEADER_LEN,
};
use crate::server::{
    lock, BatchedRead, ExportTable, InBackend, Lane, NbdStream, Registration, RingReads, RingStart,
    Run, ServerExport, Shared, DATALESS_CHUNK_BYTES, MAX_READ_BATCH, REPLY_QUEUE, SLOW_LANE_QUEUE,
};
use crate::tls;

/// Read-ahead buffer: big enough to pick up many pipelined request headers
/// (and small writes) per syscall.
const READ_BUFFER_BYTES: usize = 256 * 1024;

/// Most reply data one write call of the sender carries under one I/O-timeout deadline: a
/// batch of 32 hits of 4 KiB; a bigger reply goes alone.
const CALL_BYTES: usize = 128 * 1024;

/// How long a connection that ends with reads still in its ring waits for them to end
/// without any ending before it leaks their buffers instead ([`RingLane`]'s drop).
const RING_DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// How often a fast worker waiting for room in the slow queue checks whether the server
/// closes every connection (which wakes no condition variable of the connection).
const QUEUE_WAIT_CHECK: Duration = Duration::from_millis(100);
/// How long requests the ring handed to the slow lane may wait for a worker that cannot be
/// started (thread creation failing: a pids limit, memory) before the connection is closed.
const SLOW_WORKER_START_LIMIT: Duration = Duration::from_secs(2);

/// Why a connection ended badly. Clean ends are `Ok(())`.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("{peer}: handshake failed: {reason}")]
    Handshake { peer: String, reason: CloseReason },
    #[error("{peer}: client disconnected during the handshake")]
    HandshakeEof { peer: String },
    #[error("{peer}: no export named {name:?}")]
    NoSuchExport { peer: String, name: String },
    #[error("{peer}: {source}")]
    Protocol {
        peer: String,
        #[source]
        source: ProtocolError,
    },
    #[error("{peer}: client disconnected in the middle of a request")]
    Truncated { peer: String },
    #[error("{peer}: {what} took longer than the I/O timeout ({limit:?}); connection closed")]
    TimedOut {
        peer: String,
        what: &'static str,
        limit: Duration,
    },
    #[error("{peer}: {limit} connections are open, the server's limit; connection closed")]
    TooManyConnections { peer: String, limit: usize },
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
#[derive(Debug, Clone)]
pub(crate) enum Start {
    /// Negotiate the export with the NBD handshake.
    Handshake,
    /// Go straight to transmission on the export of this name (the Linux kernel client after
    /// `NBD_SET_SOCK` skips the handshake). By name: exports are added and removed while
    /// serving, so an index taken earlier could name another one now.
    Transmission { export: String },
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
    let result = run(shared, stream, start, &peer, &registration);
    // Free the connection's place before saying so: a client that reads the
    // log line and reconnects must find it free.
    drop(registration);
    match &result {
        Ok(()) => info!(%peer, "NBD connection closed"),
        Err(
            error @ (ConnectionError::Handshake { .. }
            | ConnectionError::Protocol { .. }
            | ConnectionError::TimedOut { .. }),
        ) => {
            warn!(%error, "NBD connection closed");
        }
        Err(error) => info!(%error, "NBD connection closed"),
    }
    result
}

fn run<S: NbdStream>(
    shared: &Shared,
    stream: S,
    start: Start,
    peer: &str,
    registration: &Registration,
) -> Result<(), ConnectionError> {
    // One table for the handshake and the lookup of the export it chose.
    let exports = shared.exports();
    let name = match start {
        Start::Transmission { export } => export,
        Start::Handshake => return negotiate(shared, stream, &exports, peer, registration),
    };
    let export = exports.list.iter().find(|e| e.info.name == name);
    let export = export.ok_or_else(|| ConnectionError::NoSuchExport {
        peer: peer.to_owned(),
        name,
    })?;
    enter_transmission(
        shared,
        stream,
        export,
        Session::default(),
        peer,
        registration,
    )
}

/// Runs the handshake, over TLS from STARTTLS on, then the transmission phase on the export
/// it chose (from this very table).
fn negotiate<S: NbdStream>(
    shared: &Shared,
    mut stream: S,
    exports: &ExportTable,
    peer: &str,
    registration: &Registration,
) -> Result<(), ConnectionError> {
    let deadline = Instant::now() + shared.config.handshake_timeout;
    let tls = shared.config.tls.as_ref();
    let policy = match tls {
        None => TlsPolicy::Off,
        Some(tls) if tls.required => TlsPolicy::Required,
        Some(_) => TlsPolicy::Offered,
    };
    let mut machine = Handshake::with_tls(Arc::clone(&exports.infos), policy);
    let chosen = drive_handshake(&mut stream, &mut machine, deadline, peer)?;
    let (Some(tls), true) = (tls, machine.wants_tls()) else {
        return match chosen {
            Some((index, session)) => {
                let export = &exports.list[index];
                enter_transmission(shared, stream, export, session, peer, registration)
            }
            None => Ok(()),
        };
    };
    let mut plain = tls::start(stream, &tls.server, shared.config.io_timeout, peer)
        .map_err(|source| ConnectionError::io(peer.to_owned(), "starting TLS", source))?;
    machine.tls_started();
    let peer = &format!("{peer} (TLS)");
    match drive_handshake(&mut plain, &mut machine, deadline, peer)? {
        Some((index, session)) => {
            let export = &exports.list[index];
            enter_transmission(shared, plain, export, session, peer, registration)
        }
        None => Ok(()),
    }
}

fn enter_transmission<S: NbdStream>(
    shared: &Shared,
    stream: S,
    export: &ServerExport,
    session: Session,
    peer: &str,
    registration: &Registration,
) -> Result<(), ConnectionError> {
    if !registration.enter_export(export) {
        info!(%peer, export = %export.info.name, "export removed during the handshake; closing");
        return Ok(());
    }
    debug!(%peer, export = %export.info.name, ?session, "entering transmission");
    transmit(shared, stream, export, session, peer)
}

fn transmit<S: NbdStream>(
    shared: &Shared,
    stream: S,
    export: &ServerExport,
    session: Session,
    peer: &str,
) -> Result<(), ConnectionError> {
    let io_error = |context| move |source| ConnectionError::io(peer.to_owned(), context, source);
    let config = &shared.config;
    stream
        .set_write_timeout_stream(Some(config.io_timeout))
        .map_err(io_error("setting the reply timeout"))?;
    let writer = stream
        .try_clone_stream()
        .map_err(io_error("cloning socket"))?;
    let control = stream
        .try_clone_stream()
        .map_err(io_error("cloning socket"))?;
    // Outside the connection, which holds the requests that borrow them.
    let activity = Activity::new();
    let memory = ConnectionMemory::new(config.connection_buffer_memory);
    let connection = Connection {
        input: Mutex::new(Input::new(stream)),
        writer: Mutex::new(writer),
        control,
        outbox: Outbox::new(REPLY_QUEUE),
        closed: AtomicBool::new(false),
        aborted: AtomicBool::new(false),
        activity: &activity,
        first_error: Mutex::new(None),
        memory: &memory,
        slow: SlowLane::new(config.threads_per_connection),
        ring: export.backend.ring_reads().map(|reads| RingLane {
            reads,
            pending: Mutex::new(slab::Slab::new()),
            open: AtomicBool::new(false),
            broken: AtomicBool::new(false),
        }),
        export,
        session,
        max_payload: config.max_request.min(export.info.max_block),
        shared,
        peer,
    };
    let result = connection.run_workers(config.fast_threads_per_connection);
    // Closing explicitly (rather than when the last clone drops) makes the
    // client see EOF right after the final reply.
    let _ = connection.control.shutdown_stream(Shutdown::Both);
    result
}

/// Runs the sans-I/O handshake over the socket. Reads exactly what the
/// machine needs so no transmission bytes (or TLS records) are swallowed. Returns the chosen
/// export, or `None` after a client abort or once STARTTLS was acknowledged
/// ([`Handshake::wants_tls`]).
fn drive_handshake<S: NbdStream>(
    stream: &mut S,
    machine: &mut Handshake,
    deadline: Instant,
    peer: &str,
) -> Result<Option<(usize, Session)>, ConnectionError> {
    let mut chunk = [0u8; 4096];
    loop {
        set_remaining_timeout(stream, deadline, peer)?;
        stream
            .write_all(&machine.take_output())
            .map_err(|source| ConnectionError::io(peer.to_owned(), "sending handshake", source))?;
        match machine.outcome() {
            Some(HandshakeOutcome::Transmission {
                export, session, ..
            }) => return Ok(Some((*export, *session))),
            Some(HandshakeOutcome::Closed(CloseReason::ClientAbort)) => return Ok(None),
            Some(HandshakeOutcome::Closed(reason)) => {
                return Err(handshake_error(peer, reason.clone()))
            }
            None if machine.wants_tls() => return Ok(None),
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
    let timeout = Some(remaining.max(Duration::from_millis(1)));
    stream
        .set_read_timeout_stream(timeout)
        .and_then(|()| stream.set_write_timeout_stream(timeout))
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

/// How a socket read or write with a time limit failed.
enum IoFailure {
    /// The client closed its side before all bytes arrived.
    Eof,
    TimedOut,
    Io(io::Error),
}

impl From<io::Error> for IoFailure {
    fn from(error: io::Error) -> Self {
        match error.kind() {
            // SO_RCVTIMEO and SO_SNDTIMEO expire with EAGAIN.
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => IoFailure::TimedOut,
            _ => IoFailure::Io(error),
        }
    }
}

/// What is left until `deadline`, rounded up to whole milliseconds (so a
/// fresh deadline gives back the same value and the socket option is not set
/// again), or `TimedOut` once it passed.
fn remaining(deadline: Instant) -> Result<Duration, IoFailure> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(IoFailure::TimedOut);
    }
    let millis = left.as_nanos().div_ceil(1_000_000);
    Ok(Duration::from_millis(
        u64::try_from(millis).unwrap_or(u64::MAX),
    ))
}

/// The read side of a connection: a buffered reader that remembers its
/// socket's read timeout, so the option is set only when a read will
/// really wait and the value changes.
struct Input<S: NbdStream> {
    reader: BufReader<S>,
    /// The read timeout on the socket; `None` until first set here.
    timeout: Option<Option<Duration>>,
}

impl<S: NbdStream> Input<S> {
    fn new(stream: S) -> Self {
        Input {
            reader: BufReader::with_capacity(READ_BUFFER_BYTES, stream),
            timeout: None,
        }
    }

    /// Sets the timeout of the next socket read, if one is needed.
    fn before_read(&mut self, timeout: Option<Duration>) -> Result<(), IoFailure> {
        if self.reader.buffer().is_empty() && self.timeout != Some(timeout) {
            self.reader
                .get_ref()
                .set_read_timeout_stream(timeout)
                .map_err(IoFailure::Io)?;
            self.timeout = Some(timeout);
        }
        Ok(())
    }

    /// Waits up to `timeout` (`None`: without limit) for a byte; false on EOF.
    fn wait_readable(&mut self, timeout: Option<Duration>) -> Result<bool, IoFailure> {
        self.before_read(timeout)?;
        loop {
            match self.reader.fill_buf() {
                Ok(bytes) => return Ok(!bytes.is_empty()),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// Fills `buf` completely by `deadline`.
    fn read_exact_by(&mut self, mut buf: &mut [u8], deadline: Instant) -> Result<(), IoFailure> {
        while !buf.is_empty() {
            self.before_read(Some(remaining(deadline)?))?;
            match self.reader.read(buf) {
                Ok(0) => return Err(IoFailure::Eof),
                Ok(n) => buf = &mut buf[n..],
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }

    /// Reads and drops `len` bytes by `deadline`, without a buffer of that size.
    fn discard_by(&mut self, mut len: u64, deadline: Instant) -> Result<(), IoFailure> {
        while len > 0 {
            self.before_read(Some(remaining(deadline)?))?;
            let available = match self.reader.fill_buf() {
                Ok([]) => return Err(IoFailure::Eof),
                Ok(bytes) => bytes.len(),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error.into()),
            };
            let taken = len.min(available as u64);
            self.reader.consume(taken as usize);
            len -= taken;
        }
        Ok(())
    }
}

/// What the idle timeout looks at: replies owed, and when the last one was
/// sent.
struct Activity {
    epoch: Instant,
    /// Requests read and not yet answered.
    in_flight: AtomicUsize,
    /// When the last request was answered, in milliseconds since `epoch`.
    last_answer_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            epoch: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_answer_ms: AtomicU64::new(0),
        }
    }

    /// How long no reply has been owed; `None` while one is.
    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_answer_ms.load(Ordering::SeqCst));
        Some(self.epoch.elapsed().saturating_sub(last))
    }
}

/// Counts a request as read and not yet answered until dropped.
struct InFlight<'c>(&'c Activity);

impl<'c> InFlight<'c> {
    fn enter(activity: &'c Activity) -> Self {
        activity.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(activity)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let now = u64::try_from(self.0.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.last_answer_ms.fetch_max(now, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request read off the wire, with the verdict of validation (a write's
/// payload is consumed either way).
struct Request<'a> {
    header: RequestHeader,
    verdict: Result<(), Errno>,
    /// A write's payload, or a read's data once leased.
    buffer: Option<Lease<'a>>,
    _in_flight: InFlight<'a>,
}

/// A request served, and its outcome: what the sender thread writes.
struct Reply<'a> {
    request: Request<'a>,
    outcome: Result<(), Errno>,
}

impl Reply<'_> {
    /// The error the reply carries. A successful READ without its data cannot happen (a read
    /// leases its buffer before it runs); it is never sent as a success without its data.
    fn error(&self) -> Option<Errno> {
        let header = &self.request.header;
        let has_data = header.command.replies_with_data();
        match (self.outcome, &self.request.buffer) {
            (Err(errno), _) => Some(errno),
            (Ok(()), None) if has_data && header.length > 0 => Some(Errno::Io),
            (Ok(()), _) => None,
        }
    }

    /// The data that follows the header: a successful READ's, or a BLOCK_STATUS chunk's
    /// payload.
    fn data(&self) -> Option<&[u8]> {
        if self.request.header.command.replies_with_data() && self.error().is_none() {
            self.request.buffer.as_deref()
        } else {
            None
        }
    }

    /// The bytes before the data: a simple reply header, or with structured replies
    /// negotiated, a READ's `OFFSET_DATA` chunk header (one chunk, the whole read), a block
    /// status chunk header, or an error chunk for either (other commands keep simple
    /// replies, as the spec allows).
    fn head(&self, session: &Session) -> ReplyHead {
        let header = &self.request.header;
        let structured = session.structured_replies && header.command.replies_with_data();
        match (structured, self.error()) {
            (false, error) => ReplyHead::simple(error, header.cookie),
            (true, Some(error)) => ReplyHead::error_chunk(error, header.cookie),
            // A data chunk must carry at least one byte (review 45): an empty read ends with
            // the NONE chunk.
            (true, None) if header.command == Command::Read && header.length == 0 => {
                ReplyHead::none(header.cookie)
            }
            (true, None) if header.command == Command::Read => {
                ReplyHead::read_data(header.cookie, header.offset, header.length)
            }
            (true, None) => {
                ReplyHead::block_status(header.cookie, self.data().map_or(0, <[u8]>::len))
            }
        }
    }
}

/// The payload of a block-status reply to a request of `length` bytes from the export's
/// runs: at least one descriptor, none past `length` (the export promises so; checked here
/// too, as a descriptor past the request would break the client), only the first with
/// `req_one` (`NBD_CMD_FLAG_REQ_ONE`).
fn block_status_of(runs: Vec<Run>, length: u64, req_one: bool) -> Result<Vec<u8>, Errno> {
    let mut left = length;
    let mut extents = Vec::with_capacity(if req_one { 1 } else { runs.len() });
    for run in runs.into_iter().filter(|r| r.len > 0) {
        let len = run.len.min(left);
        if len == 0 || (req_one && !extents.is_empty()) {
            break;
        }
        // `length` came from the request's 32-bit field, so `len` fits.
        extents.push((u32::try_from(len).map_err(|_| Errno::Invalid)?, run.hole));
        left -= len;
    }
    if extents.is_empty() {
        return Err(Errno::Io);
    }
    Ok(block_status_payload(extents.into_iter()))
}

/// Whether `buffered` starts with a whole READ request header. Gathering a batch reads
/// nothing else: a WRITE's payload may still be on its way, or wait for request memory the
/// batch holds, and the batch's replies would wait with it.
fn next_is_read(buffered: &[u8]) -> bool {
    buffered
        .get(..REQUEST_HEADER_LEN)
        .and_then(|raw| RequestHeader::parse(raw.try_into().ok()?).ok())
        .is_some_and(|header| header.command == Command::Read)
}

/// What a fast worker read in one turn at the reader ([`Connection::next_batch`]).
struct Batch<'a> {
    /// Fast READs with their buffers, at most [`MAX_READ_BATCH`], served together.
    reads: Vec<Request<'a>>,
    /// The request that ended the gathering (not a fast READ), served after the batch.
    other: Option<Request<'a>>,
    /// The error that ended the reading, recorded after the batch is answered.
    error: Option<ConnectionError>,
}

/// The requests of one connection that wait for a slow worker, and those workers.
struct SlowLane<'a> {
    state: Mutex<SlowState<'a>>,
    /// Signalled when a request is queued or the lane closes.
    work: Condvar,
    /// Signalled when a request leaves the queue or the lane closes.
    room: Condvar,
    /// Slow workers of the connection at most (`threads_per_connection`).
    max_workers: usize,
}

struct SlowState<'a> {
    /// At most [`SLOW_LANE_QUEUE`] requests, oldest first.
    queue: VecDeque<Request<'a>>,
    /// Workers started, or being started.
    workers: usize,
    /// Workers waiting for a request.
    idle: usize,
    /// Fast workers serving the queue themselves because no slow worker could be started
    /// (`queue_slow`): the lane has a worker meanwhile, so the completion thread does not
    /// close the connection for want of one (review 34).
    stand_ins: usize,
    /// No request is queued any more (the readers stopped, or the connection aborted):
    /// workers finish what is queued and stop.
    closed: bool,
}

/// A fast worker serving the slow queue itself ([`SlowLane::stand_in`]).
struct StandIn<'l, 'a>(&'l SlowLane<'a>);

impl Drop for StandIn<'_, '_> {
    fn drop(&mut self) {
        lock(&self.0.state).stand_ins -= 1;
    }
}

/// What became of a request handed to the slow lane.
enum Queued {
    /// A worker will take it.
    Yes,
    /// Queued, and no worker is idle: the caller starts one (already counted).
    NeedsWorker,
    /// The lane closed (the connection aborted): the request was dropped unanswered.
    Dropped,
}

impl<'a> SlowLane<'a> {
    fn new(max_workers: usize) -> Self {
        SlowLane {
            state: Mutex::new(SlowState {
                queue: VecDeque::new(),
                workers: 0,
                idle: 0,
                stand_ins: 0,
                closed: false,
            }),
            work: Condvar::new(),
            room: Condvar::new(),
            max_workers,
        }
    }

    /// Queues `request`, waiting while the queue is full (for a slow worker to take one, so
    /// bounded by the slow device) unless `give_up()` turns true.
    fn push(&self, request: Request<'a>, give_up: &dyn Fn() -> bool) -> Queued {
        let mut state = lock(&self.state);
        while state.queue.len() >= SLOW_LANE_QUEUE && !state.closed && !give_up() {
            state = self
                .room
                .wait_timeout(state, QUEUE_WAIT_CHECK)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let full = state.queue.len() >= SLOW_LANE_QUEUE;
        self.enqueue(state, request, full)
    }

    /// Queues `request` at once, even past [`SLOW_LANE_QUEUE`] (for the completion thread,
    /// which must never wait: bounded by the connection's request memory, as each holds its
    /// buffer).
    fn push_now(&self, request: Request<'a>) -> Queued {
        let state = lock(&self.state);
        self.enqueue(state, request, false)
    }

    /// Queues `request` unless the lane is closed or `refuse` (then drops it unanswered).
    fn enqueue(
        &self,
        mut state: MutexGuard<'_, SlowState<'a>>,
        request: Request<'a>,
        refuse: bool,
    ) -> Queued {
        if state.closed || refuse {
            // Its lease goes back to the pool outside the lane's lock.
            drop(state);
            drop(request);
            return Queued::Dropped;
        }
        state.queue.push_back(request);
        self.work.notify_one();
        if state.queue.len() > state.idle && state.workers < self.max_workers {
            state.workers += 1;
            return Queued::NeedsWorker;
        }
        Queued::Yes
    }

    /// The next request for a slow worker, waiting for one; `None` once the lane is closed
    /// and empty.
    fn pop(&self) -> Option<Request<'a>> {
        let mut state = lock(&self.state);
        loop {
            if let Some(request) = state.queue.pop_front() {
                self.room.notify_one();
                return Some(request);
            }
            if state.closed {
                return None;
            }
            state.idle += 1;
            state = self
                .work
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            state.idle -= 1;
        }
    }

    /// True (and counted as a worker) when requests are queued and no slow worker runs to
    /// serve them: the caller starts one (review 33: a READ the ring left unserved while no
    /// worker could be started waited for a slow request that a client reading only hits
    /// never sends).
    fn claim_missing_worker(&self) -> bool {
        let mut state = lock(&self.state);
        let missing = state.workers == 0 && state.stand_ins == 0 && !state.queue.is_empty();
        if missing {
            state.workers += 1;
        }
        missing
    }

    /// Counts the calling fast worker as the lane's stand-in worker until the guard drops.
    fn stand_in(&self) -> StandIn<'_, 'a> {
        lock(&self.state).stand_ins += 1;
        StandIn(self)
    }

    /// A worker `push` asked for could not be started.
    fn worker_not_started(&self) {
        lock(&self.state).workers -= 1;
    }

    /// The oldest queued request, if no slow worker runs at all (for the caller to serve).
    fn take_if_no_worker(&self) -> Option<Request<'a>> {
        let mut state = lock(&self.state);
        if state.workers > 0 {
            return None;
        }
        let request = state.queue.pop_front();
        self.room.notify_one();
        request
    }

    /// No request will be queued any more: the workers serve what is queued, then stop.
    fn close(&self) {
        lock(&self.state).closed = true;
        self.work.notify_all();
        self.room.notify_all();
    }

    /// Closes the lane and drops what is queued unanswered (the socket is shut already).
    fn abort(&self) {
        let dropped = {
            let mut state = lock(&self.state);
            state.closed = true;
            std::mem::take(&mut state.queue)
        };
        self.work.notify_all();
        self.room.notify_all();
        drop(dropped);
    }
}

/// READs whose cache-device reads are in flight while the connection reads on
/// ([`crate::Export::ring_reads`]), and what ends them.
struct RingLane<'a> {
    /// Declared first, so it drops first: its drop waits for every read still in flight,
    /// before the buffers in `pending` are freed.
    reads: Box<dyn RingReads + 'a>,
    /// The requests started, by tag, each counted inside the backend until it ends.
    pending: Mutex<slab::Slab<(Request<'a>, InBackend<'a>)>>,
    /// Reads may start: the completion thread runs and the readers have not stopped. Once
    /// it is false again the completion thread ends as soon as `pending` is empty.
    open: AtomicBool,
    /// `wait` failed: reads may never end, so the buffers in `pending` are leaked.
    broken: AtomicBool,
}

impl Drop for RingLane<'_> {
    /// Ends every read still in the ring before the buffers in `pending` are freed, whatever
    /// became of the completion thread (review 31 F6: it may have panicked, or never run);
    /// their requests go unanswered (the connection is over). If the ring failed, or gives
    /// nothing back for [`RING_DRAIN_LIMIT`], the buffers are leaked instead: the kernel may
    /// still write into them. Only the buffers: the requests' backend counts and request
    /// memory are given back (review 31 F4: leaking them left a later stop waiting for
    /// requests that no longer existed, and new requests without memory).
    fn drop(&mut self) {
        let pending = self
            .pending
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let mut ended = Vec::new();
        let mut last_progress = Instant::now();
        while !pending.is_empty() && !*self.broken.get_mut() {
            if last_progress.elapsed() > RING_DRAIN_LIMIT || self.reads.wait(&mut ended).is_err() {
                *self.broken.get_mut() = true;
                break;
            }
            if !ended.is_empty() {
                last_progress = Instant::now();
            }
            for (tag, _) in ended.drain(..) {
                pending.try_remove(tag as usize);
            }
        }
        if *self.broken.get_mut() {
            for (mut request, _inside) in pending.drain() {
                if let Some(lease) = request.buffer.take() {
                    lease.leak();
                }
            }
        }
    }
}

/// State shared by the workers of one connection in transmission.
struct Connection<'a, S: NbdStream> {
    input: Mutex<Input<S>>,
    writer: Mutex<S>,
    /// Lock-free handle used to shut the socket down from any thread.
    control: S,
    /// Replies waiting for the sender thread, in the order they are sent.
    outbox: Outbox<Reply<'a>>,
    /// Set when no further request may be read (DISC, EOF, error, shutdown).
    closed: AtomicBool,
    /// Set when the socket was shut down after an error: requests still in
    /// flight stop as early as they can.
    aborted: AtomicBool,
    /// Replies owed and the time of the last one, for the idle timeout.
    activity: &'a Activity,
    /// The first error a worker hit: what the connection ends with.
    first_error: Mutex<Option<ConnectionError>>,
    memory: &'a ConnectionMemory,
    /// Requests that may wait for the slow device, and their workers.
    slow: SlowLane<'a>,
    /// Fast READs in flight without a worker, if the export has them.
    ring: Option<RingLane<'a>>,
    export: &'a ServerExport,
    /// What the handshake negotiated (structured replies, block status).
    session: Session,
    max_payload: u32,
    shared: &'a Shared,
    peer: &'a str,
}

impl<'a, S: NbdStream> Connection<'a, S> {
    /// Runs `fast_threads` fast workers (this thread included) and the slow workers they
    /// start until all have stopped; returns the first error any of them hit.
    fn run_workers(&self, fast_threads: usize) -> Result<(), ConnectionError> {
        thread::scope(|outer| {
            let sender = thread::Builder::new()
                .name("nbd-sender".into())
                .spawn_scoped(outer, || self.sender());
            if let Err(error) = sender {
                return self.record(self.io_error("starting the reply sender thread", error));
            }
            // Every producer of replies runs in this scope; once it ended, none is left.
            self.run_producers(fast_threads);
            self.outbox.finish();
        });
        lock(&self.first_error).take().map_or(Ok(()), Err)
    }

    /// Runs the fast workers (this thread one of them), the completion thread and the slow
    /// workers they start, until all have stopped.
    fn run_producers(&self, fast_threads: usize) {
        thread::scope(|scope| {
            let completer = self.ring.as_ref().and_then(|ring| {
                ring.open.store(true, Ordering::SeqCst);
                let spawned = thread::Builder::new()
                    .name("nbd-completer".into())
                    .spawn_scoped(scope, move || self.ring_completer(ring, scope));
                spawned
                    .inspect_err(|error| {
                        ring.open.store(false, Ordering::SeqCst);
                        warn!(peer = %self.peer, %error, "serving every read on workers");
                    })
                    .ok()
                    .map(|handle| (ring, handle))
            });
            let mut helpers = Vec::with_capacity(fast_threads.saturating_sub(1));
            for _ in 1..fast_threads {
                let spawned = thread::Builder::new()
                    .name("nbd-worker".into())
                    .spawn_scoped(scope, || self.fast_worker(scope));
                match spawned {
                    Ok(handle) => helpers.push(handle),
                    Err(error) => {
                        warn!(peer = %self.peer, %error, "running with fewer worker threads");
                        break;
                    }
                }
            }
            let _stop_ring = StopRingOnUnwind(completer.as_ref().map(|(ring, _)| *ring));
            self.fast_worker(scope);
            let mut panics: Vec<_> = helpers.into_iter().filter_map(|h| h.join().err()).collect();
            if let Some((ring, handle)) = completer {
                // No READ starts any more: the completion thread answers those in flight
                // and stops.
                ring.open.store(false, Ordering::SeqCst);
                ring.reads.wake();
                panics.extend(handle.join().err());
            }
            // Nothing is read any more: the slow workers finish the queue and stop (the
            // scope waits for them).
            self.slow.close();
            if let Some(panic) = panics.into_iter().next() {
                std::panic::resume_unwind(panic);
            }
        });
    }

    /// Reads requests, runs the fast ones and queues the slow ones, until no more can be read.
    /// Fast READs already received are served together ([`Connection::next_batch`]).
    fn fast_worker<'scope>(&'scope self, scope: &'scope Scope<'scope, '_>) {
        let _abort_on_panic = AbortOnPanic(self);
        loop {
            let batch = match self.next_batch() {
                Ok(Some(batch)) => batch,
                Ok(None) => return,
                Err(error) => return self.record(error),
            };
            if !batch.reads.is_empty() && !self.serve_reads(batch.reads) {
                return;
            }
            if let Some(request) = batch.other {
                let answered = match self.lane_of(&request) {
                    Lane::Fast => self.serve(request),
                    Lane::Slow => self.queue_slow(request, scope),
                };
                if !answered {
                    return;
                }
            }
            if let Some(error) = batch.error {
                return self.record(error);
            }
        }
    }

    /// Reads the next request (waiting for it) and, while it and those after it are fast
    /// READs, every further request already in the read buffer: up to [`MAX_READ_BATCH`]
    /// READs with their buffers leased, then at most one other request. Only READs whose
    /// header is received already are read after the first, so gathering never waits for
    /// the client.
    fn next_batch(&self) -> Result<Option<Batch<'a>>, ConnectionError> {
        let mut input = lock(&self.input);
        if self.closed.load(Ordering::SeqCst) || self.shared.is_shutting_down() {
            self.closed.store(true, Ordering::SeqCst);
            return Ok(None);
        }
        let most = if self.export.backend.batches_reads() {
            MAX_READ_BATCH
        } else {
            1
        };
        let mut batch = Batch {
            // Sized once: growing it while the input is held cost more than its memory.
            reads: Vec::with_capacity(most),
            other: None,
            error: None,
        };
        let mut wait = true;
        while batch.reads.len() < most {
            if !wait && !next_is_read(input.reader.buffer()) {
                break;
            }
            let request = match self.read_request(&mut input) {
                Ok(Some(request)) => request,
                Ok(None) if wait => {
                    self.closed.store(true, Ordering::SeqCst);
                    return Ok(None);
                }
                Ok(None) => {
                    self.closed.store(true, Ordering::SeqCst);
                    break;
                }
                Err(error) if wait => {
                    self.closed.store(true, Ordering::SeqCst);
                    return Err(error);
                }
                Err(error) => {
                    // The requests gathered are answered first.
                    self.closed.store(true, Ordering::SeqCst);
                    batch.error = Some(error);
                    break;
                }
            };
            // The first request may wait for its buffer, as `execute` would; later ones take
            // one only if it is free now, so the batch never waits for memory it holds.
            match self.batchable(request, wait) {
                Ok(read) => batch.reads.push(read),
                Err(other) => {
                    batch.other = Some(other);
                    break;
                }
            }
            wait = false;
        }
        Ok(Some(batch))
    }

    /// The request with its buffer leased if it is a valid fast READ that can join a batch;
    /// otherwise the request, to be served the usual way.
    fn batchable(
        &self,
        mut request: Request<'a>,
        may_wait: bool,
    ) -> Result<Request<'a>, Request<'a>> {
        let header = request.header;
        if header.command != Command::Read
            || request.verdict.is_err()
            || header.length == 0
            || self.lane_of(&request) != Lane::Fast
        {
            return Err(request);
        }
        let leased = if may_wait {
            self.lease(header.length as usize)
        } else {
            let now = Instant::now();
            self.shared
                .buffers
                .take(self.memory, header.length as usize, now, &|| true)
        };
        match leased {
            Ok(lease) => {
                request.buffer = Some(lease);
                Ok(request)
            }
            Err(errno) if may_wait => {
                request.verdict = Err(errno);
                Err(request)
            }
            // `execute` waits for it after the batch gave its memory back.
            Err(_) => Err(request),
        }
    }

    /// Serves a batch of fast READs (each with its buffer): those the export can end on the
    /// completion thread are started there; the others with one call to the export, their
    /// replies sent in one writev. False when the replies could not be sent.
    fn serve_reads(&self, requests: Vec<Request<'a>>) -> bool {
        let requests = match &self.ring {
            Some(ring) if ring.open.load(Ordering::SeqCst) => self.start_ring_reads(ring, requests),
            _ => requests,
        };
        if requests.is_empty() {
            return true;
        }
        self.serve_read_batch(requests)
    }

    /// Starts what it can of `requests` on the ring; gives back the others.
    fn start_ring_reads(
        &self,
        ring: &RingLane<'a>,
        requests: Vec<Request<'a>>,
    ) -> Vec<Request<'a>> {
        let mut rest = Vec::new();
        let mut starts = Vec::with_capacity(requests.len());
        let mut pending = lock(&ring.pending);
        for mut request in requests {
            let inside = match self.shared.enter_backend() {
                Ok(inside) => inside,
                Err(_) => {
                    rest.push(request);
                    continue;
                }
            };
            let offset = request.header.offset;
            // Only page-aligned buffers (a page or more) go to the ring (review 43 F4).
            let Some(buf) = request.buffer.as_deref_mut().filter(|b| b.len() >= 4096) else {
                rest.push(request);
                continue;
            };
            let (buf, len) = (buf.as_mut_ptr(), buf.len());
            let tag = pending.insert((request, inside)) as u64;
            starts.push(RingStart {
                tag,
                offset,
                buf,
                len,
                started: false,
            });
        }
        // SAFETY: each buffer belongs to its request, which stays in `pending` untouched until
        // the completion thread takes it out after `wait` reported its tag; if `wait` fails,
        // `pending` is leaked (RingLane's drop), and the ring is dropped before `pending`.
        unsafe { ring.reads.start(&mut starts) };
        for start in starts.iter().filter(|s| !s.started) {
            if let Some((request, _inside)) = pending.try_remove(start.tag as usize) {
                rest.push(request);
            }
        }
        rest
    }

    /// Answers ring READs as they end, until the readers stopped and none is in flight.
    fn ring_completer<'scope>(&'scope self, ring: &RingLane<'a>, scope: &'scope Scope<'scope, '_>) {
        let _abort_on_panic = AbortOnPanic(self);
        let mut ended = Vec::new();
        // Since when requests the ring queued for the slow lane have had no worker.
        let mut no_worker_since: Option<Instant> = None;
        loop {
            if !ring.open.load(Ordering::SeqCst) && lock(&ring.pending).is_empty() {
                return;
            }
            ended.clear();
            if let Err(source) = ring.reads.wait(&mut ended) {
                ring.broken.store(true, Ordering::SeqCst);
                ring.open.store(false, Ordering::SeqCst);
                self.record(ConnectionError::io(
                    self.peer.to_owned(),
                    "reading the cache device",
                    source,
                ));
                self.abort();
                return;
            }
            let mut served = Vec::with_capacity(ended.len());
            let mut again = Vec::new();
            {
                let mut pending = lock(&ring.pending);
                for &(tag, was_served) in &ended {
                    if let Some((request, _inside)) = pending.try_remove(tag as usize) {
                        if was_served {
                            served.push(request);
                        } else {
                            again.push(request);
                        }
                    }
                }
            }
            for request in again {
                self.read_again_off_ring(request, scope);
            }
            if self.start_missing_slow_worker(scope) {
                no_worker_since = None;
            } else if no_worker_since.get_or_insert_with(Instant::now).elapsed()
                > SLOW_WORKER_START_LIMIT
            {
                warn!(
                    peer = %self.peer,
                    "no slow-lane worker could be started for {} s: closing the connection \
                     (the requests waiting for one are not answered; the client sees a \
                     disconnect, never a hang)",
                    SLOW_WORKER_START_LIMIT.as_secs()
                );
                self.abort();
                no_worker_since = None;
            }
            // Handed to the sender, so a client that stops reading its replies never keeps
            // ring hits (and their lines) from being reaped (review 31 F3).
            // Past the outbox's bound if need be: waiting for room here would leave the
            // ring's hits unreaped (review 43 F1).
            self.outbox
                .push_all_now(served.into_iter().map(|request| Reply {
                    request,
                    outcome: Ok(()),
                }));
        }
    }

    /// Sends the replies the workers queue, in order, until every worker stopped and none is
    /// left. After a failed send the connection is aborted and the rest are dropped.
    fn sender(&self) {
        let _abort_on_panic = AbortOnPanic(self);
        // At most MAX_READ_BATCH replies per call: each call has one I/O-timeout deadline for
        // all it writes, so a backlog sent in one call cut off a client that reads steadily
        // but not that fast (review 32).
        let mut replies = Vec::with_capacity(MAX_READ_BATCH);
        while self.outbox.take(MAX_READ_BATCH, &mut replies) {
            let sent = if self.aborted.load(Ordering::SeqCst) {
                Ok(())
            } else {
                self.send_in_calls(&replies)
            };
            // The requests end here: their buffers go back, their replies are no longer owed.
            replies.clear();
            if let Err(error) = sent {
                // Recorded before the abort, so the errors the abort causes in other
                // workers do not hide the cause.
                self.record(error);
                self.abort();
            }
        }
    }

    /// A ring READ that ended unserved (a failed device read, a checksum mismatch) goes to
    /// the slow lane, whose worker reads it with [`crate::Export::read`]. Never on the
    /// completion thread, which must not wait for lines that ring hits in flight hold until
    /// it reaps them (review 31), and never waiting for room: such reads go past the slow
    /// queue's bound, each holding its request memory, so the connection's memory limit
    /// bounds them (review 33: not the ring's 128, since reads keep coming while these wait).
    fn read_again_off_ring<'scope>(
        &'scope self,
        request: Request<'a>,
        scope: &'scope Scope<'scope, '_>,
    ) {
        if let Queued::NeedsWorker = self.slow.push_now(request) {
            let spawned = thread::Builder::new()
                .name("nbd-slow-worker".into())
                .spawn_scoped(scope, || self.slow_worker());
            if let Err(error) = spawned {
                // Left queued: the completion thread tries again at each reap
                // (`start_missing_slow_worker`), and the next slow request a fast worker
                // queues starts a worker or serves the queue itself.
                warn!(peer = %self.peer, %error, "cannot start a slow-lane worker thread");
                self.slow.worker_not_started();
            }
        }
    }

    /// Tried again at every reap (at least every 50 ms): a slow worker for requests the ring
    /// queued when none could be started. The completion thread never serves them itself (it
    /// must not wait for a line, review 31). False while requests wait with no worker.
    fn start_missing_slow_worker<'scope>(&'scope self, scope: &'scope Scope<'scope, '_>) -> bool {
        if !self.slow.claim_missing_worker() {
            return true;
        }
        let spawned = thread::Builder::new()
            .name("nbd-slow-worker".into())
            .spawn_scoped(scope, || self.slow_worker());
        match spawned {
            Ok(_) => true,
            Err(error) => {
                debug!(peer = %self.peer, %error, "still cannot start a slow-lane worker thread");
                self.slow.worker_not_started();
                false
            }
        }
    }

    /// Serves a batch of fast READs (each with its buffer) with one call to the export and
    /// sends their replies in one writev. False when the replies could not be sent.
    fn serve_read_batch(&self, mut requests: Vec<Request<'a>>) -> bool {
        let outcomes = self.read_batch(&mut requests);
        for (request, outcome) in requests.iter().zip(&outcomes) {
            if let Err(errno) = outcome {
                debug!(peer = %self.peer, header = ?request.header, %errno, "request failed");
            }
        }
        let replies = requests
            .into_iter()
            .zip(outcomes)
            .map(|(request, outcome)| Reply { request, outcome });
        self.outbox.push_all(replies)
    }

    fn read_batch(&self, requests: &mut [Request<'a>]) -> Vec<Result<(), Errno>> {
        let _inside = match self.shared.enter_backend() {
            Ok(inside) => inside,
            Err(errno) => return vec![Err(errno); requests.len()],
        };
        let mut reads: Vec<BatchedRead<'_>> = requests
            .iter_mut()
            .filter_map(|request| {
                let offset = request.header.offset;
                let buf = request.buffer.as_deref_mut()?;
                Some(BatchedRead {
                    offset,
                    buf,
                    result: Err(Errno::Io),
                })
            })
            .collect();
        self.export.backend.read_many(&mut reads);
        reads.into_iter().map(|read| read.result).collect()
    }

    /// Serves queued slow requests until the lane closes and is empty.
    fn slow_worker(&self) {
        let _abort_on_panic = AbortOnPanic(self);
        while let Some(request) = self.slow.pop() {
            if !self.serve(request) {
                return;
            }
        }
    }

    /// Where a request runs: as the export says for READ and WRITE (even one answered without
    /// it, invalid or empty, so that an export that keeps everything in the slow lane sees
    /// its replies in the order of the queue), slow for every other command.
    fn lane_of(&self, request: &Request<'_>) -> Lane {
        let header = &request.header;
        if request.verdict.is_err() {
            // Answered without the export: no need to ask it (review13 R13-2: a huge invalid
            // READ made the hint walk the map for nothing). Slow keeps a slow-only export's
            // replies in queue order.
            return Lane::Slow;
        }
        match header.command {
            Command::Read | Command::Write => {
                let length = u64::from(header.length);
                self.export
                    .backend
                    .lane(header.command, header.offset, length)
            }
            _ => Lane::Slow,
        }
    }

    /// Hands a request to the slow lane, starting a slow worker if none is idle. False when
    /// the connection is over.
    fn queue_slow<'scope>(
        &'scope self,
        mut request: Request<'a>,
        scope: &'scope Scope<'scope, '_>,
    ) -> bool {
        // A read takes its buffer before it is queued, as a write's payload already has: then
        // a slow worker never waits for memory that only requests queued behind it hold (which
        // only slow workers can free; review13 R13-1), and a reader short of memory stops
        // reading instead. A read that cannot get memory is answered ENOMEM from the queue.
        if request.header.command == Command::Read
            && request.verdict.is_ok()
            && request.header.length > 0
            && request.buffer.is_none()
        {
            match self.lease(request.header.length as usize) {
                Ok(lease) => request.buffer = Some(lease),
                Err(errno) => request.verdict = Err(errno),
            }
        }
        match self.slow.push(request, &|| self.stopping_early()) {
            Queued::Yes => true,
            Queued::Dropped => false,
            Queued::NeedsWorker => {
                let spawned = thread::Builder::new()
                    .name("nbd-slow-worker".into())
                    .spawn_scoped(scope, || self.slow_worker());
                let Err(error) = spawned else {
                    return true;
                };
                warn!(peer = %self.peer, %error, "cannot start a slow-lane worker thread");
                // Counted as the lane's worker before the failed one is uncounted, so the
                // completion thread never sees the queue without one (review 34).
                let _stand_in = self.slow.stand_in();
                self.slow.worker_not_started();
                // With no slow worker at all, serve what is queued here rather than never
                // (review13 R13-4: requests queued meanwhile had no worker); a worker started
                // by a later push takes over.
                while let Some(request) = self.slow.take_if_no_worker() {
                    if !self.serve(request) {
                        return false;
                    }
                }
                true
            }
        }
    }

    /// Runs a request and queues its reply. False when the connection is over (its replies
    /// can no longer be sent).
    fn serve(&self, mut request: Request<'a>) -> bool {
        let outcome = self.execute(&mut request);
        if let Err(errno) = outcome {
            debug!(peer = %self.peer, header = ?request.header, %errno, "request failed");
        }
        if !request.header.command.replies_with_data() || outcome.is_err() {
            // Only a READ's data and a BLOCK_STATUS's payload go out: other memory is free
            // before the reply waits.
            request.buffer = None;
        }
        self.outbox.push_all([Reply { request, outcome }])
    }

    /// Keeps the first error of the connection (what it ends with).
    fn record(&self, error: ConnectionError) {
        lock(&self.first_error).get_or_insert(error);
    }

    fn read_request(&self, input: &mut Input<S>) -> Result<Option<Request<'a>>, ConnectionError> {
        let mut raw = [0u8; REQUEST_HEADER_LEN];
        if !self.read_header(input, &mut raw)? {
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
        let mut request = Request {
            header,
            verdict: validate_request(&header, &self.export.info, self.max_payload, &self.session),
            buffer: None,
            _in_flight: InFlight::enter(self.activity),
        };
        if header.has_payload() {
            self.read_payload(input, &mut request)?;
        }
        Ok(Some(request))
    }

    /// Fills `raw`; false on EOF before the first byte (a clean close) or
    /// when the connection stayed idle too long.
    fn read_header(
        &self,
        input: &mut Input<S>,
        raw: &mut [u8; REQUEST_HEADER_LEN],
    ) -> Result<bool, ConnectionError> {
        if !self.wait_for_request(input)? {
            return Ok(false);
        }
        let deadline = Instant::now() + self.shared.config.io_timeout;
        input
            .read_exact_by(raw, deadline)
            .map_err(|failure| self.read_failure(failure, "receiving a request header"))?;
        Ok(true)
    }

    /// Waits for the first byte of the next request: false on EOF, or when
    /// no reply has been owed for the idle timeout.
    fn wait_for_request(&self, input: &mut Input<S>) -> Result<bool, ConnectionError> {
        let idle_limit = self.shared.config.idle_timeout;
        let mut wait = idle_limit;
        loop {
            match input.wait_readable(wait) {
                Ok(true) => return Ok(true),
                Ok(false) | Err(IoFailure::Eof) => {
                    debug!(peer = %self.peer, "client closed the connection");
                    return Ok(false);
                }
                Err(IoFailure::TimedOut) => {
                    let Some(limit) = idle_limit else {
                        continue;
                    };
                    match self.activity.idle_for() {
                        Some(idle) if idle >= limit => {
                            info!(peer = %self.peer, ?limit, "closing an idle connection (idle timeout)");
                            return Ok(false);
                        }
                        // Idle for part of the limit: wait out the rest.
                        Some(idle) => wait = Some((limit - idle).max(Duration::from_millis(1))),
                        // A reply is owed: the client waits for us, it is not idle.
                        None => wait = Some(limit),
                    }
                }
                Err(IoFailure::Io(error)) => return Err(self.io_error("reading request", error)),
            }
        }
    }

    /// Reads a write payload into a leased buffer if the request is valid and
    /// memory can be had, otherwise streams it into the void so the next
    /// header is found where expected.
    fn read_payload(
        &self,
        input: &mut Input<S>,
        request: &mut Request<'a>,
    ) -> Result<(), ConnectionError> {
        let length = request.header.length;
        if request.verdict.is_ok() {
            match self.lease(length as usize) {
                Ok(mut buffer) => {
                    let deadline = Instant::now() + self.shared.config.io_timeout;
                    input
                        .read_exact_by(&mut buffer, deadline)
                        .map_err(|failure| self.read_failure(failure, "receiving a write"))?;
                    request.buffer = Some(buffer);
                    return Ok(());
                }
                Err(errno) => request.verdict = Err(errno),
            }
        }
        let deadline = Instant::now() + self.shared.config.io_timeout;
        input
            .discard_by(u64::from(length), deadline)
            .map_err(|failure| self.read_failure(failure, "receiving a write"))
    }

    /// A buffer for one request, waiting (bounded) for memory other requests
    /// hold.
    fn lease(&self, len: usize) -> Result<Lease<'a>, Errno> {
        let deadline = Instant::now() + self.shared.config.buffer_wait;
        let give_up = || self.stopping_early();
        let leased = self
            .shared
            .buffers
            .take(self.memory, len, deadline, &give_up);
        if leased.as_ref().err() == Some(&Errno::NoMem) {
            warn!(
                peer = %self.peer,
                len,
                "no request memory free within {:?}: answering ENOMEM",
                self.shared.config.buffer_wait
            );
        }
        leased
    }

    /// True once requests in flight should end as soon as they can: the
    /// connection was aborted or the server closes every connection.
    fn stopping_early(&self) -> bool {
        self.aborted.load(Ordering::SeqCst) || self.shared.is_force_closed()
    }

    fn execute(&self, request: &mut Request<'a>) -> Result<(), Errno> {
        request.verdict?;
        let header = request.header;
        if header.length == 0 && header.command != Command::Flush {
            return Ok(());
        }
        let backend = &*self.export.backend;
        let (offset, length) = (header.offset, u64::from(header.length));
        let fua = header.flags & NBD_CMD_FLAG_FUA != 0;
        match header.command {
            Command::Read => {
                // A slow read leased its buffer before it was queued.
                let buffer = match request.buffer.take() {
                    Some(lease) => request.buffer.insert(lease),
                    None => request.buffer.insert(self.lease(header.length as usize)?),
                };
                let _inside = self.shared.enter_backend()?;
                backend.read(offset, buffer)
            }
            Command::Write => {
                // A valid write always has its payload; this keeps the match total.
                let Some(data) = request.buffer.as_deref() else {
                    return Err(Errno::Invalid);
                };
                let _inside = self.shared.enter_backend()?;
                backend.write(offset, data, fua)
            }
            Command::Flush => {
                let _inside = self.shared.enter_backend()?;
                backend.flush()
            }
            Command::Trim => self.in_pieces(offset, length, fua, |o, l, f| backend.trim(o, l, f)),
            Command::WriteZeroes => {
                let may_trim = header.flags & NBD_CMD_FLAG_NO_HOLE == 0;
                self.in_pieces(offset, length, fua, |o, l, f| {
                    backend.write_zeroes(o, l, f, may_trim)
                })
            }
            Command::Cache => self.in_pieces(offset, length, false, |o, l, _| backend.cache(o, l)),
            Command::BlockStatus => {
                let one = header.flags & NBD_CMD_FLAG_REQ_ONE != 0;
                let payload = {
                    let _inside = self.shared.enter_backend()?;
                    block_status_of(backend.allocation(offset, length)?, length, one)?
                };
                let mut lease = self.lease(payload.len())?;
                lease.copy_from_slice(&payload);
                request.buffer = Some(lease);
                Ok(())
            }
            // Validation rejects these; answering EINVAL keeps this total.
            Command::Disconnect | Command::Unknown(_) => Err(Errno::Invalid),
        }
    }

    /// Runs a TRIM, WRITE_ZEROES or CACHE in pieces of at most
    /// [`DATALESS_CHUNK_BYTES`]. With `fua` the pieces go without it and one
    /// flush follows the last, which makes the whole range durable.
    fn in_pieces(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        op: impl Fn(u64, u64, bool) -> Result<(), Errno>,
    ) -> Result<(), Errno> {
        if length <= DATALESS_CHUNK_BYTES {
            let _inside = self.shared.enter_backend()?;
            return op(offset, length, fua);
        }
        // Validation checked that the range lies inside the export.
        let end = offset.saturating_add(length);
        let mut start = offset;
        while start < end {
            if self.stopping_early() {
                return Err(Errno::Shutdown);
            }
            // Pieces end on multiples of the chunk size, so a range that does not start on a
            // block boundary has partial blocks only in its first and last piece.
            let piece = (end - start).min(DATALESS_CHUNK_BYTES - start % DATALESS_CHUNK_BYTES);
            let _inside = self.shared.enter_backend()?;
            op(start, piece, false)?;
            start += piece;
        }
        if fua {
            let _inside = self.shared.enter_backend()?;
            self.export.backend.flush()?;
        }
        Ok(())
    }

    /// Writes `replies` in calls of at most [`CALL_BYTES`] of data (at least one reply each),
    /// each under its own I/O-timeout deadline: a client reading big replies steadily is
    /// given the timeout per reply, as when each worker wrote its own (review 43 F3).
    fn send_in_calls(&self, replies: &[Reply<'_>]) -> Result<(), ConnectionError> {
        let mut rest = replies;
        while !rest.is_empty() {
            let mut bytes = 0;
            let count = rest
                .iter()
                .take_while(|reply| {
                    bytes += reply.data().map_or(0, <[u8]>::len);
                    bytes <= CALL_BYTES
                })
                .count()
                .max(1);
            let (call, after) = rest.split_at(count);
            self.send_replies(call)?;
            rest = after;
        }
        Ok(())
    }

    /// Writes `replies` in one writev (as few as the socket takes) under the writer lock.
    fn send_replies(&self, replies: &[Reply<'_>]) -> Result<(), ConnectionError> {
        let heads: Vec<_> = replies
            .iter()
            .map(|reply| reply.head(&self.session))
            .collect();
        let mut slices = Vec::with_capacity(2 * replies.len());
        for (head, reply) in heads.iter().zip(replies) {
            slices.push(IoSlice::new(head.as_bytes()));
            if let Some(data) = reply.data() {
                slices.push(IoSlice::new(data));
            }
        }
        self.write_replies(&mut slices)
    }

    /// Writes whole replies under the writer lock within the I/O timeout.
    fn write_replies(&self, slices: &mut [IoSlice<'_>]) -> Result<(), ConnectionError> {
        let limit = self.shared.config.io_timeout;
        let written = write_all_by(&mut *lock(&self.writer), slices, limit);
        written.map_err(|failure| match failure {
            IoFailure::TimedOut => ConnectionError::TimedOut {
                peer: self.peer.to_owned(),
                what: "sending a reply (the client stopped reading)",
                limit,
            },
            IoFailure::Eof => self.io_error("sending reply", io::ErrorKind::WriteZero.into()),
            IoFailure::Io(error) => self.io_error("sending reply", error),
        })
    }

    /// Stops every worker: no more reads, blocked reads and writes return,
    /// waits for memory give up.
    fn abort(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.aborted.store(true, Ordering::SeqCst);
        let _ = self.control.shutdown_stream(Shutdown::Both);
        self.outbox.fail();
        self.slow.abort();
        self.shared.buffers.wake_all();
    }

    fn read_failure(&self, failure: IoFailure, what: &'static str) -> ConnectionError {
        match failure {
            IoFailure::Eof => ConnectionError::Truncated {
                peer: self.peer.to_owned(),
            },
            IoFailure::TimedOut => ConnectionError::TimedOut {
                peer: self.peer.to_owned(),
                what,
                limit: self.shared.config.io_timeout,
            },
            IoFailure::Io(error) => self.io_error(what, error),
        }
    }

    fn io_error(&self, context: &'static str, source: io::Error) -> ConnectionError {
        ConnectionError::io(self.peer.to_owned(), context, source)
    }
}

/// If a backend call panics, the other workers would otherwise stay blocked
/// reading from a client that is still connected; closing the socket ends
/// them so the panic can propagate and the connection is released.
/// Tells the completion thread to stop once its reads are answered if the connection's own
/// thread unwinds (review 31 F2: it went on waiting for reads, and the connection's scope for
/// it, forever). The normal path tells it after the other fast workers stopped.
struct StopRingOnUnwind<'r, 'a>(Option<&'r RingLane<'a>>);

impl Drop for StopRingOnUnwind<'_, '_> {
    fn drop(&mut self) {
        if let Some(ring) = self.0.filter(|_| thread::panicking()) {
            ring.open.store(false, Ordering::SeqCst);
            ring.reads.wake();
        }
    }
}

struct AbortOnPanic<'c, 'a, S: NbdStream>(&'c Connection<'a, S>);

impl<S: NbdStream> Drop for AbortOnPanic<'_, '_, S> {
    fn drop(&mut self) {
        if thread::panicking() {
            self.0.abort();
        }
    }
}

/// Writes every slice within `limit`. The socket's send timeout is `limit`;
/// after a partial write it is lowered to what is left, and restored after.
fn write_all_by<S: NbdStream>(
    writer: &mut S,
    mut slices: &mut [IoSlice<'_>],
    limit: Duration,
) -> Result<(), IoFailure> {
    let deadline = Instant::now() + limit;
    let mut lowered = false;
    IoSlice::advance_slices(&mut slices, 0);
    let result = loop {
        if slices.is_empty() {
            break Ok(());
        }
        match writer.write_vectored(slices) {
            Ok(0) => break Err(IoFailure::Io(io::ErrorKind::WriteZero.into())),
            Ok(written) => {
                IoSlice::advance_slices(&mut slices, written);
                if slices.is_empty() {
                    continue;
                }
                let left = match remaining(deadline) {
                    Ok(left) => left,
                    Err(failure) => break Err(failure),
                };
                if let Err(error) = writer.set_write_timeout_stream(Some(left)) {
                    break Err(IoFailure::Io(error));
                }
                lowered = true;
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => break Err(error.into()),
        }
    };
    if lowered {
        // A failure here shows on the next write.
        let _ = writer.set_write_timeout_stream(Some(limit));
    }
    result
}
