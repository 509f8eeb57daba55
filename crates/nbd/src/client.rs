//! NBD client side: the fixed-newstyle handshake with `NBD_OPT_GO`, then
//! pipelined requests matched to their simple replies by cookie.
//!
//! [`connect`] negotiates one export over any [`NbdStream`] and splits the
//! connection into a [`RequestSender`] and a [`ReplyReceiver`], meant for two
//! threads: one thread that both sends and reads can deadlock, because the
//! server stops reading requests while its replies are not read.
//! [`connect_tls`] does the same over TLS: `NBD_OPT_STARTTLS` first, the TLS
//! handshake (rustls, `ClientTls`), then the same halves over the session's
//! plaintext end (the pump of `tls.rs`).
//!
//! # Bounds
//!
//! * Requests in flight: at most [`ClientConfig::max_in_flight`]; `send`
//!   waits for a free slot. Each slot holds the request's header and the
//!   caller's tag `T` (its payload is never kept).
//! * Reply data: a READ reply is exactly as long as its request, and requests
//!   are at most [`ClientConfig::max_request`] bytes (and the export's
//!   `max_block`), so a reply buffer never grows past that.
//! * Handshake: the whole exchange within [`ClientConfig::handshake_timeout`];
//!   option replies of at most [`MAX_OPTION_REPLY_LEN`] bytes each and at most
//!   [`MAX_OPTION_REPLIES`] of them.
//! * Waits: every socket write, every wait for a reply while requests are in
//!   flight, and every wait for a free slot, ends after
//!   [`ClientConfig::io_timeout`] (if set) with an error. An idle connection
//!   (nothing in flight) is not timed out.
//!
//! Only simple replies are used (structured replies are never requested), so
//! the client handles no `BLOCK_STATUS`. Requests are checked against the
//! export (advertised command, alignment, bounds, length) before they are
//! sent, so a caller's mistake never desynchronises the stream.

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::proto::*;
use crate::server::NbdStream;
use crate::tls::ClientTls;

/// Largest option reply payload accepted during the handshake. Real replies
/// are an info block or an error message of a few hundred bytes.
pub const MAX_OPTION_REPLY_LEN: u32 = 64 * 1024;
/// Most option replies accepted for one `NBD_OPT_GO` (one per info type the
/// server offers, plus the final ACK).
pub const MAX_OPTION_REPLIES: usize = 32;
/// Longest export name the spec allows.
pub const MAX_EXPORT_NAME_LEN: usize = 4096;

/// Client settings; every field bounds something (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// Requests in flight at once (the queue depth), at least 1.
    pub max_in_flight: usize,
    /// Largest READ or WRITE this client sends; the export's `max_block`
    /// lowers it further.
    pub max_request: u32,
    /// Bound of the whole handshake.
    pub handshake_timeout: Duration,
    /// Bound of each socket read and write and of each wait for a slot in
    /// transmission; `None` waits forever.
    pub io_timeout: Option<Duration>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            max_in_flight: 32,
            max_request: 32 << 20,
            handshake_timeout: Duration::from_secs(30),
            io_timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// What `NBD_OPT_GO` told about the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDetails {
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    /// Alignment of offsets and lengths (1 if the server sent no block size).
    pub min_block: u32,
    pub preferred_block: u32,
    /// Largest READ/WRITE the client sends: the server's `max_block` and
    /// [`ClientConfig::max_request`], whichever is smaller.
    pub max_request: u32,
    /// The server's `NBD_INFO_DESCRIPTION` of the export, if it sent one (at most
    /// [`MAX_OPTION_REPLY_LEN`] bytes; invalid UTF-8 replaced).
    pub description: Option<String>,
}

impl ExportDetails {
    /// True if the server advertised `flag` (an `NBD_FLAG_*` value).
    pub fn has_flag(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the server closed the connection ({in_flight} requests unanswered)")]
    Closed { in_flight: usize },
    #[error("the server broke the NBD protocol: {0}")]
    Protocol(String),
    #[error("the server refused export {export:?} (reply type {reply_type:#x}): {message}")]
    Refused {
        export: String,
        reply_type: u32,
        message: String,
    },
    #[error("the server does not offer TLS (reply type {reply_type:#x} to NBD_OPT_STARTTLS: {message}); an nbds:// export is never used in plaintext")]
    TlsRefused { reply_type: u32, message: String },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("no request slot became free within {0:?} (the server answers nothing)")]
    SlotTimeout(Duration),
}

impl ClientError {
    fn io(context: &'static str) -> impl FnOnce(io::Error) -> ClientError {
        move |source| ClientError::Io { context, source }
    }

    /// True for a time limit reached (a socket timeout, a handshake deadline).
    pub fn is_timeout(&self) -> bool {
        matches!(self, ClientError::Io { source, .. } if is_timeout(source))
            || matches!(self, ClientError::SlotTimeout(_))
    }

    /// True if the error means the server went away (EOF, reset, broken
    /// pipe), as opposed to a protocol violation or a timeout.
    pub fn is_disconnect(&self) -> bool {
        match self {
            ClientError::Closed { .. } => true,
            ClientError::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}

/// One request to send. Build it with the constructors; `fua` adds
/// `NBD_CMD_FLAG_FUA`.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub command: Command,
    pub flags: u16,
    pub offset: u64,
    pub length: u32,
    /// The payload of a WRITE (exactly `length` bytes), else empty.
    pub data: &'a [u8],
}

impl<'a> Request<'a> {
    pub fn read(offset: u64, length: u32) -> Request<'a> {
        Request::dataless(Command::Read, offset, length)
    }

    /// A WRITE of `data`, which must fit in a `u32` length (checked by `send`).
    pub fn write(offset: u64, data: &'a [u8]) -> Request<'a> {
        let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
        Request {
            data,
            ..Request::dataless(Command::Write, offset, length)
        }
    }

    pub fn flush() -> Request<'a> {
        Request::dataless(Command::Flush, 0, 0)
    }

    pub fn trim(offset: u64, length: u32) -> Request<'a> {
        Request::dataless(Command::Trim, offset, length)
    }

    pub fn write_zeroes(offset: u64, length: u32) -> Request<'a> {
        Request::dataless(Command::WriteZeroes, offset, length)
    }

    /// The same request with `NBD_CMD_FLAG_FUA`.
    pub fn fua(self) -> Request<'a> {
        Request {
            flags: self.flags | NBD_CMD_FLAG_FUA,
            ..self
        }
    }

    fn dataless(command: Command, offset: u64, length: u32) -> Request<'a> {
        Request {
            command,
            flags: 0,
            offset,
            length,
            data: &[],
        }
    }
}

/// How the server answered one request, with the caller's tag back.
#[derive(Debug)]
pub struct Reply<T> {
    pub cookie: u64,
    pub header: RequestHeader,
    /// `Err` carries the NBD error value (see [`Errno::from_code`]).
    pub result: Result<(), u32>,
    pub tag: T,
}

/// One connection's requests in flight, shared by its two halves.
struct InFlight<T> {
    state: Mutex<InFlightState<T>>,
    slot_freed: Condvar,
    capacity: usize,
}

struct InFlightState<T> {
    requests: HashMap<u64, (RequestHeader, T)>,
    /// Set by the receiver when the connection is gone, so a waiting sender
    /// returns at once.
    closed: bool,
}

impl<T> InFlight<T> {
    fn lock(&self) -> MutexGuard<'_, InFlightState<T>> {
        // A panic elsewhere leaves the map consistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn close(&self) {
        self.lock().closed = true;
        self.slot_freed.notify_all();
    }
}

/// The two halves of a connection in transmission, for two threads.
pub type Connection<S, T> = (RequestSender<S, T>, ReplyReceiver<S, T>);

/// Negotiates `export_name` with `NBD_OPT_GO` and returns the two halves of
/// the transmission phase.
pub fn connect<S: NbdStream, T>(
    mut stream: S,
    export_name: &str,
    config: &ClientConfig,
) -> Result<Connection<S, T>, ClientError> {
    check_config(export_name, config)?;
    let deadline = Instant::now() + config.handshake_timeout;
    let mut io = HandshakeIo {
        stream: &mut stream,
        deadline,
    };
    greet(&mut io)?;
    let export = go(&mut io, export_name, config)?;
    transmission(stream, export, config)
}

/// As [`connect`], over TLS: `NBD_OPT_STARTTLS` first (a server that refuses it is refused:
/// an `nbds://` export must never be reached in plaintext), the TLS handshake, then
/// `NBD_OPT_GO` and the transmission phase over the session, whose plaintext end (a Unix
/// socket to the TLS pump thread, `tls.rs`) the two halves use.
pub fn connect_tls<S: NbdStream, T>(
    mut stream: S,
    export_name: &str,
    config: &ClientConfig,
    tls: &ClientTls,
) -> Result<Connection<UnixStream, T>, ClientError> {
    check_config(export_name, config)?;
    let deadline = Instant::now() + config.handshake_timeout;
    let mut io = HandshakeIo {
        stream: &mut stream,
        deadline,
    };
    greet(&mut io)?;
    start_tls(&mut io)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let (mut plain, session_end) = crate::tls::start_client(stream, tls, left)
        .map_err(ClientError::io("the TLS handshake with the server"))?;
    let mut io = HandshakeIo {
        stream: &mut plain,
        deadline,
    };
    match go(&mut io, export_name, config) {
        Ok(export) => transmission(plain, export, config),
        // Under TLS 1.3 a server refuses a client certificate (or the lack of one) only after
        // the client's side of the handshake ended: the session ends under NBD_OPT_GO, and
        // the reason is the pump's, not the broken pipe's. A time limit reached is its own
        // reason (the pump lives on until `plain` is dropped).
        Err(error @ (ClientError::Io { .. } | ClientError::Closed { .. }))
            if !error.is_timeout() =>
        {
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1));
            Err(
                tls_session_reason(&session_end, wait).map_or(error, |why| ClientError::Io {
                    context: "the TLS session with the server",
                    source: io::Error::new(io::ErrorKind::InvalidData, why),
                }),
            )
        }
        Err(error) => Err(error),
    }
}

/// Why the TLS session ended, if its pump says so within `wait`.
fn tls_session_reason(session_end: &crate::tls::SessionEnd, wait: Duration) -> Option<String> {
    let deadline = Instant::now() + wait;
    loop {
        let why = session_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if why.is_some() || Instant::now() >= deadline {
            return why;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn check_config(export_name: &str, config: &ClientConfig) -> Result<(), ClientError> {
    if config.max_in_flight == 0 {
        return Err(ClientError::InvalidRequest(
            "max_in_flight must be at least 1".into(),
        ));
    }
    if export_name.len() > MAX_EXPORT_NAME_LEN {
        let message = format!("export name longer than {MAX_EXPORT_NAME_LEN} bytes");
        return Err(ClientError::InvalidRequest(message));
    }
    Ok(())
}

/// The two halves of the transmission phase on a negotiated `stream`.
fn transmission<S: NbdStream, T>(
    stream: S,
    export: ExportDetails,
    config: &ClientConfig,
) -> Result<Connection<S, T>, ClientError> {
    stream
        .set_read_timeout_stream(config.io_timeout)
        .and_then(|()| stream.set_write_timeout_stream(config.io_timeout))
        .map_err(ClientError::io("setting socket timeouts"))?;
    let reader = stream
        .try_clone_stream()
        .map_err(ClientError::io("cloning the socket"))?;
    let in_flight = Arc::new(InFlight {
        state: Mutex::new(InFlightState {
            requests: HashMap::with_capacity(config.max_in_flight),
            closed: false,
        }),
        slot_freed: Condvar::new(),
        capacity: config.max_in_flight,
    });
    let sender = RequestSender {
        stream,
        export,
        in_flight: Arc::clone(&in_flight),
        next_cookie: 1,
        slot_timeout: config.io_timeout,
    };
    let receiver = ReplyReceiver {
        stream: reader,
        in_flight,
    };
    Ok((sender, receiver))
}

/// The server's greeting and the client's flags.
fn greet<S: NbdStream>(io: &mut HandshakeIo<'_, S>) -> Result<(), ClientError> {
    let mut greeting = [0u8; 18];
    io.read(&mut greeting)?;
    let magic = be_u64(&greeting[0..8]);
    let newstyle = be_u64(&greeting[8..16]);
    let server_flags = u16::from_be_bytes([greeting[16], greeting[17]]);
    if magic != NBDMAGIC || newstyle != IHAVEOPT {
        let message = format!("greeting {magic:#018x} {newstyle:#018x} is not fixed newstyle");
        return Err(ClientError::Protocol(message));
    }
    if server_flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ClientError::Protocol(
            "the server does not offer fixed newstyle negotiation".into(),
        ));
    }
    let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
    if server_flags & NBD_FLAG_NO_ZEROES != 0 {
        client_flags |= NBD_FLAG_C_NO_ZEROES;
    }
    io.write(&client_flags.to_be_bytes())
}

/// `NBD_OPT_GO` and its replies.
fn go<S: NbdStream>(
    io: &mut HandshakeIo<'_, S>,
    export_name: &str,
    config: &ClientConfig,
) -> Result<ExportDetails, ClientError> {
    io.write(&go_option(export_name))?;
    read_go_replies(io, export_name, config)
}

/// `NBD_OPT_STARTTLS` and its reply, which must be an ACK.
fn start_tls<S: NbdStream>(io: &mut HandshakeIo<'_, S>) -> Result<(), ClientError> {
    let mut option = Vec::with_capacity(16);
    option.extend_from_slice(&IHAVEOPT.to_be_bytes());
    option.extend_from_slice(&NBD_OPT_STARTTLS.to_be_bytes());
    option.extend_from_slice(&0u32.to_be_bytes());
    io.write(&option)?;
    let (reply_type, payload) = read_option_reply(io, NBD_OPT_STARTTLS)?;
    match reply_type {
        NBD_REP_ACK if payload.is_empty() => Ok(()),
        NBD_REP_ACK => Err(ClientError::Protocol(
            "an NBD_OPT_STARTTLS acknowledgement with data".into(),
        )),
        _ => Err(ClientError::TlsRefused {
            reply_type,
            message: String::from_utf8_lossy(&payload).into_owned(),
        }),
    }
}

/// One option reply to `option`: its type and payload (at most [`MAX_OPTION_REPLY_LEN`]).
fn read_option_reply<S: NbdStream>(
    io: &mut HandshakeIo<'_, S>,
    option: u32,
) -> Result<(u32, Vec<u8>), ClientError> {
    let mut header = [0u8; 20];
    io.read(&mut header)?;
    let magic = be_u64(&header[0..8]);
    let reply_option = be_u32(&header[8..12]);
    let reply_type = be_u32(&header[12..16]);
    let length = be_u32(&header[16..20]);
    if magic != NBD_REP_MAGIC || reply_option != option {
        let message = format!("option reply magic {magic:#018x} for option {reply_option}");
        return Err(ClientError::Protocol(message));
    }
    if length > MAX_OPTION_REPLY_LEN {
        let message = format!("option reply of {length} bytes (limit {MAX_OPTION_REPLY_LEN})");
        return Err(ClientError::Protocol(message));
    }
    // Lossless: bounded by MAX_OPTION_REPLY_LEN just above.
    let mut payload = vec![0u8; length as usize];
    io.read(&mut payload)?;
    Ok((reply_type, payload))
}

/// `NBD_OPT_GO` for `name`, asking for the block sizes and the description.
fn go_option(name: &str) -> Vec<u8> {
    let name_len = u32::try_from(name.len()).unwrap_or(u32::MAX);
    let data_len = 4 + name.len() + 2 + 2 * 2;
    let mut out = Vec::with_capacity(16 + data_len);
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
    out.extend_from_slice(&u32::try_from(data_len).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&name_len.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&2u16.to_be_bytes());
    out.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&NBD_INFO_DESCRIPTION.to_be_bytes());
    out
}

/// Reads option replies until the ACK, collecting the export info.
fn read_go_replies<S: NbdStream>(
    io: &mut HandshakeIo<'_, S>,
    export_name: &str,
    config: &ClientConfig,
) -> Result<ExportDetails, ClientError> {
    let mut info = GoInfo {
        size_and_flags: None,
        block_sizes: (1, 4096, u32::MAX),
        description: None,
    };
    for _ in 0..MAX_OPTION_REPLIES {
        let (reply_type, payload) = read_option_reply(io, NBD_OPT_GO)?;
        match reply_type {
            NBD_REP_ACK => {
                return export_details(info, config);
            }
            NBD_REP_INFO => parse_info(&payload, &mut info)?,
            error if error & NBD_REP_FLAG_ERROR != 0 => {
                return Err(ClientError::Refused {
                    export: export_name.to_owned(),
                    reply_type,
                    message: String::from_utf8_lossy(&payload).into_owned(),
                })
            }
            other => {
                let message = format!("unexpected reply type {other:#x} to NBD_OPT_GO");
                return Err(ClientError::Protocol(message));
            }
        }
    }
    let message = format!("more than {MAX_OPTION_REPLIES} replies to NBD_OPT_GO");
    Err(ClientError::Protocol(message))
}

/// What the `NBD_REP_INFO` replies to `NBD_OPT_GO` said.
struct GoInfo {
    size_and_flags: Option<(u64, u16)>,
    /// Minimum, preferred and maximum block sizes.
    block_sizes: (u32, u32, u32),
    description: Option<String>,
}

/// One `NBD_REP_INFO` payload; unknown info types are ignored (the spec
/// lets servers send more than asked).
fn parse_info(payload: &[u8], info_seen: &mut GoInfo) -> Result<(), ClientError> {
    let malformed = |what: &str| ClientError::Protocol(format!("malformed {what} info"));
    let Some(info) = payload.get(0..2).map(|b| u16::from_be_bytes([b[0], b[1]])) else {
        return Err(malformed("empty"));
    };
    match info {
        NBD_INFO_EXPORT => {
            if payload.len() != 12 {
                return Err(malformed("NBD_INFO_EXPORT"));
            }
            let flags = u16::from_be_bytes([payload[10], payload[11]]);
            info_seen.size_and_flags = Some((be_u64(&payload[2..10]), flags));
        }
        NBD_INFO_BLOCK_SIZE => {
            if payload.len() != 14 {
                return Err(malformed("NBD_INFO_BLOCK_SIZE"));
            }
            info_seen.block_sizes = (
                be_u32(&payload[2..6]),
                be_u32(&payload[6..10]),
                be_u32(&payload[10..14]),
            );
        }
        NBD_INFO_DESCRIPTION => {
            let text = String::from_utf8_lossy(&payload[2..]).into_owned();
            info_seen.description = Some(text);
        }
        _ => {}
    }
    Ok(())
}

fn export_details(info: GoInfo, config: &ClientConfig) -> Result<ExportDetails, ClientError> {
    let Some((size, flags)) = info.size_and_flags else {
        return Err(ClientError::Protocol(
            "NBD_OPT_GO acknowledged without NBD_INFO_EXPORT".into(),
        ));
    };
    let (min_block, preferred_block, max_block) = info.block_sizes;
    if min_block == 0 || !min_block.is_power_of_two() || max_block < min_block {
        let message = format!("block sizes min {min_block}, max {max_block} are inconsistent");
        return Err(ClientError::Protocol(message));
    }
    // Round the limit down to the alignment so a request of the full limit
    // is valid.
    let max_request = max_block.min(config.max_request) / min_block * min_block;
    Ok(ExportDetails {
        size,
        flags,
        min_block,
        preferred_block,
        max_request,
        description: info.description,
    })
}

/// Blocking reads and writes that all end by one deadline.
struct HandshakeIo<'a, S: NbdStream> {
    stream: &'a mut S,
    deadline: Instant,
}

impl<S: NbdStream> HandshakeIo<'_, S> {
    fn arm(&self) -> Result<(), ClientError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let source = io::Error::new(io::ErrorKind::TimedOut, "handshake time limit");
            return Err(ClientError::Io {
                context: "handshake",
                source,
            });
        }
        self.stream
            .set_read_timeout_stream(Some(left))
            .and_then(|()| self.stream.set_write_timeout_stream(Some(left)))
            .map_err(ClientError::io("setting the handshake timeout"))
    }

    /// Reads all of `buf`, the deadline checked before each socket read (a server trickling
    /// a byte per read timeout must not stretch the handshake past it: review 50).
    fn read(&mut self, buf: &mut [u8]) -> Result<(), ClientError> {
        let mut got = 0;
        while got < buf.len() {
            self.arm()?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    let eof = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection",
                    );
                    return Err(handshake_error("reading the handshake", eof));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(handshake_error("reading the handshake", e)),
            }
        }
        Ok(())
    }

    /// Writes all of `buf`, the deadline checked before each socket write.
    fn write(&mut self, buf: &[u8]) -> Result<(), ClientError> {
        let mut sent = 0;
        while sent < buf.len() {
            self.arm()?;
            match self.stream.write(&buf[sent..]) {
                Ok(0) => {
                    let closed =
                        io::Error::new(io::ErrorKind::WriteZero, "the socket took nothing");
                    return Err(handshake_error("writing the handshake", closed));
                }
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(handshake_error("writing the handshake", e)),
            }
        }
        Ok(())
    }
}

/// A handshake I/O error; a socket timeout says which limit it was (not "resource
/// temporarily unavailable").
fn handshake_error(context: &'static str, e: io::Error) -> ClientError {
    let source = if is_timeout(&e) {
        io::Error::new(
            io::ErrorKind::TimedOut,
            "the server did not answer within the handshake time limit",
        )
    } else {
        e
    };
    ClientError::Io { context, source }
}

/// The sending half: one thread sends, in any order, up to
/// [`ClientConfig::max_in_flight`] requests at a time.
pub struct RequestSender<S: NbdStream, T> {
    stream: S,
    export: ExportDetails,
    in_flight: Arc<InFlight<T>>,
    next_cookie: u64,
    slot_timeout: Option<Duration>,
}

impl<S: NbdStream, T> RequestSender<S, T> {
    /// The same sender over a wrapper of its stream (a type that carries more about it).
    pub fn map_stream<U: NbdStream>(self, wrap: impl FnOnce(S) -> U) -> RequestSender<U, T> {
        RequestSender {
            stream: wrap(self.stream),
            export: self.export,
            in_flight: self.in_flight,
            next_cookie: self.next_cookie,
            slot_timeout: self.slot_timeout,
        }
    }

    /// Another handle to the socket requests are sent on.
    pub fn try_clone_stream(&self) -> io::Result<S> {
        self.stream.try_clone_stream()
    }

    pub fn export(&self) -> &ExportDetails {
        &self.export
    }

    /// Requests sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.lock().requests.len()
    }

    /// Waits until a request can be sent without waiting; fails if the
    /// connection closed or no slot freed within the I/O timeout.
    pub fn wait_for_slot(&self) -> Result<(), ClientError> {
        let capacity = self.in_flight.capacity;
        self.wait_while(|requests| requests >= capacity)
    }

    /// Waits while `busy(requests in flight)`; each reply that arrives restarts the timeout.
    fn wait_while(&self, busy: impl Fn(usize) -> bool) -> Result<(), ClientError> {
        let mut state = self.in_flight.lock();
        loop {
            if !busy(state.requests.len()) {
                return Ok(());
            }
            if state.closed {
                let in_flight = state.requests.len();
                return Err(ClientError::Closed { in_flight });
            }
            let freed = &self.in_flight.slot_freed;
            state = match self.slot_timeout {
                None => freed.wait(state).unwrap_or_else(PoisonError::into_inner),
                Some(timeout) => {
                    let (state, waited) = freed
                        .wait_timeout(state, timeout)
                        .unwrap_or_else(PoisonError::into_inner);
                    if waited.timed_out() && busy(state.requests.len()) && !state.closed {
                        return Err(ClientError::SlotTimeout(timeout));
                    }
                    state
                }
            };
        }
    }

    /// Waits until every request sent has been answered (or the connection closed, or no
    /// reply came within the I/O timeout).
    pub fn wait_until_idle(&self) -> Result<(), ClientError> {
        self.wait_while(|requests| requests > 0)
    }

    /// Checks and sends `request`; `tag` comes back with its reply. Waits
    /// for a free slot first. Returns the cookie.
    pub fn send(&mut self, request: Request<'_>, tag: T) -> Result<u64, ClientError> {
        self.check(&request)?;
        self.wait_for_slot()?;
        let cookie = self.next_cookie;
        self.next_cookie = self.next_cookie.wrapping_add(1);
        let header = RequestHeader {
            flags: request.flags,
            command: request.command,
            cookie,
            offset: request.offset,
            length: request.length,
        };
        // Registered before the bytes leave: the reply can arrive before
        // write_all returns. Not after the receiver gave up (its
        // `into_unanswered` would never hand the tag back).
        {
            let mut state = self.in_flight.lock();
            if state.closed {
                let in_flight = state.requests.len();
                return Err(ClientError::Closed { in_flight });
            }
            state.requests.insert(cookie, (header, tag));
        }
        self.stream
            .write_all(&header.encode())
            .and_then(|()| self.stream.write_all(request.data))
            .map_err(ClientError::io("sending a request"))?;
        Ok(cookie)
    }

    /// Sends `NBD_CMD_DISC` and closes the sending side. Requests in flight
    /// are still answered to the receiver.
    pub fn disconnect(mut self) -> Result<(), ClientError> {
        let header = RequestHeader {
            flags: 0,
            command: Command::Disconnect,
            cookie: self.next_cookie,
            offset: 0,
            length: 0,
        };
        self.stream
            .write_all(&header.encode())
            .map_err(ClientError::io("sending NBD_CMD_DISC"))?;
        self.stream
            .shutdown_stream(Shutdown::Write)
            .map_err(ClientError::io("closing the sending side"))
    }

    fn check(&self, request: &Request<'_>) -> Result<(), ClientError> {
        let invalid = |message: String| Err(ClientError::InvalidRequest(message));
        let export = &self.export;
        let needed_flag = match request.command {
            Command::Read | Command::Write => 0,
            Command::Flush => NBD_FLAG_SEND_FLUSH,
            Command::Trim => NBD_FLAG_SEND_TRIM,
            Command::WriteZeroes => NBD_FLAG_SEND_WRITE_ZEROES,
            Command::Cache => NBD_FLAG_SEND_CACHE,
            other => return invalid(format!("{other:?} is not sent with send()")),
        };
        if needed_flag != 0 && !export.has_flag(needed_flag) {
            return invalid(format!("the server does not offer {:?}", request.command));
        }
        if request.flags & NBD_CMD_FLAG_FUA != 0 && !export.has_flag(NBD_FLAG_SEND_FUA) {
            return invalid("the server does not offer FUA".into());
        }
        let expected_data = if request.command == Command::Write {
            request.length as usize
        } else {
            0
        };
        if request.data.len() != expected_data {
            let length = request.data.len();
            return invalid(format!(
                "payload of {length} bytes, expected {expected_data}"
            ));
        }
        if request.command == Command::Flush {
            return Ok(());
        }
        self.check_range(request)
    }

    fn check_range(&self, request: &Request<'_>) -> Result<(), ClientError> {
        let export = &self.export;
        let (offset, length) = (request.offset, request.length);
        let block = u64::from(export.min_block);
        if !offset.is_multiple_of(block) || !u64::from(length).is_multiple_of(block) {
            let message = format!("offset {offset} or length {length} not aligned to {block}");
            return Err(ClientError::InvalidRequest(message));
        }
        let carries_data = matches!(request.command, Command::Read | Command::Write);
        if carries_data && length > export.max_request {
            let message = format!("length {length} over the limit {}", export.max_request);
            return Err(ClientError::InvalidRequest(message));
        }
        let end = offset.checked_add(u64::from(length));
        if end.is_none_or(|end| end > export.size) {
            let message = format!("{offset}+{length} is past the end ({})", export.size);
            return Err(ClientError::InvalidRequest(message));
        }
        Ok(())
    }
}

/// The receiving half: one thread reads the replies, in the order the
/// server sends them.
pub struct ReplyReceiver<S: NbdStream, T> {
    stream: S,
    in_flight: Arc<InFlight<T>>,
}

impl<S: NbdStream, T> ReplyReceiver<S, T> {
    /// The same receiver over a wrapper of its stream.
    pub fn map_stream<U: NbdStream>(self, wrap: impl FnOnce(S) -> U) -> ReplyReceiver<U, T> {
        ReplyReceiver {
            stream: wrap(self.stream),
            in_flight: self.in_flight,
        }
    }

    /// Requests sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.lock().requests.len()
    }

    /// Reads the next reply. For a successful READ the data is placed in
    /// `data` (resized to the request's length); otherwise `data` is left
    /// empty. After any error the connection is unusable and a sender
    /// waiting for a slot is woken.
    pub fn recv(&mut self, data: &mut Vec<u8>) -> Result<Reply<T>, ClientError> {
        let reply = self.recv_inner(data);
        if reply.is_err() {
            self.in_flight.close();
        }
        reply
    }

    fn recv_inner(&mut self, data: &mut Vec<u8>) -> Result<Reply<T>, ClientError> {
        data.clear();
        let mut header = [0u8; SIMPLE_REPLY_HEADER_LEN];
        self.read_header(&mut header)?;
        let magic = be_u32(&header[0..4]);
        if magic != NBD_SIMPLE_REPLY_MAGIC {
            let message = format!("reply magic {magic:#010x} (only simple replies were asked for)");
            return Err(ClientError::Protocol(message));
        }
        let error = be_u32(&header[4..8]);
        let cookie = be_u64(&header[8..16]);
        let request = self.in_flight.lock().requests.get(&cookie).map(|(r, _)| *r);
        let Some(request) = request else {
            return Err(ClientError::Protocol(format!(
                "reply to cookie {cookie:#x}, which has no request in flight"
            )));
        };
        if error == 0 && request.command == Command::Read {
            // The length was checked against max_request when sent. Read before the request
            // leaves the map: if its data never arrives whole, `into_unanswered` still hands
            // its tag back.
            data.resize(request.length as usize, 0);
            self.stream
                .read_exact(data)
                .map_err(ClientError::io("reading READ data"))?;
        }
        let Some((request, tag)) = self.in_flight.lock().requests.remove(&cookie) else {
            return Err(ClientError::Protocol(format!(
                "request {cookie:#x} left the map while its reply was read"
            )));
        };
        self.in_flight.slot_freed.notify_all();
        Ok(Reply {
            cookie,
            header: request,
            result: if error == 0 { Ok(()) } else { Err(error) },
            tag,
        })
    }

    /// Ends the connection's reading and hands back the tags of every request
    /// still unanswered (after an error of [`ReplyReceiver::recv`], say), so
    /// their callers can be told. A sender waiting for a slot is woken.
    pub fn into_unanswered(self) -> Vec<T> {
        self.in_flight.close();
        let mut state = self.in_flight.lock();
        state.requests.drain().map(|(_, (_, tag))| tag).collect()
    }

    /// A clean EOF before the first byte of a header is `Closed`.
    fn read_header(&mut self, header: &mut [u8]) -> Result<(), ClientError> {
        let mut filled = 0;
        while filled < header.len() {
            match self.stream.read(&mut header[filled..]) {
                Ok(0) if filled == 0 => {
                    let in_flight = self.in_flight();
                    return Err(ClientError::Closed { in_flight });
                }
                Ok(0) => {
                    let source = io::ErrorKind::UnexpectedEof.into();
                    return Err(ClientError::Io {
                        context: "reading a reply header",
                        source,
                    });
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The I/O timeout bounds the wait for a reply, not an idle connection.
                Err(e) if filled == 0 && is_timeout(&e) && self.in_flight() == 0 => {}
                Err(source) => {
                    return Err(ClientError::Io {
                        context: "reading a reply header",
                        source,
                    })
                }
            }
        }
        Ok(())
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn be_u32(bytes: &[u8]) -> u32 {
    let mut out = [0u8; 4];
    out.copy_from_slice(&bytes[..4]);
    u32::from_be_bytes(out)
}

fn be_u64(bytes: &[u8]) -> u64 {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(out)
}
