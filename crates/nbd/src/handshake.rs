//! Sans-I/O fixed-newstyle handshake (option haggling) for the server side.
//!
//! The machine never touches a socket: the caller feeds it what the client
//! sent ([`Handshake::feed`]), sends what it produced
//! ([`Handshake::take_output`]) and stops once [`Handshake::outcome`] is set.
//! [`Handshake::bytes_needed`] says how many more bytes the current step needs,
//! so a driver can read exactly that much and never swallow the first
//! transmission request that a client may pipeline right behind `NBD_OPT_GO`.

use std::fmt;
use std::sync::Arc;

use crate::proto::*;

/// Largest option payload accepted. Real options are a name (at most 4096
/// bytes) plus a few fields; anything bigger is a client trying to make the
/// server buffer unbounded data, so the connection is dropped.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;

/// Size of the client's option header: magic, option, length.
const OPTION_HEADER_LEN: usize = 16;
/// Client flags this server understands; any other bit closes the session.
const KNOWN_CLIENT_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
/// Reserved bytes ending an `NBD_OPT_EXPORT_NAME` reply unless `NO_ZEROES`.
const EXPORT_NAME_PADDING: [u8; 124] = [0; 124];

/// What a client can learn about, and select, during the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    /// Shown to humans by `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
    pub description: String,
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`, see
    /// [`crate::proto::transmission_flags`]).
    /// `NBD_FLAG_HAS_FLAGS` is always sent even if missing here.
    pub flags: u16,
    /// Required alignment of offsets and lengths (a power of two).
    pub min_block: u32,
    pub preferred_block: u32,
    /// Largest request length the client may send.
    pub max_block: u32,
}

/// Whether a server offers TLS (`NBD_OPT_STARTTLS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsPolicy {
    /// STARTTLS is answered `NBD_REP_ERR_UNSUP`.
    #[default]
    Off,
    /// Clients may start TLS or stay in plaintext.
    Offered,
    /// Every option but STARTTLS and ABORT is refused (`NBD_REP_ERR_TLS_REQD`) until TLS
    /// runs; `NBD_OPT_EXPORT_NAME` closes the connection.
    Required,
}

/// Why the handshake ended without entering transmission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// The client sent `NBD_OPT_ABORT` (a normal, soft disconnect).
    ClientAbort,
    /// The client broke the protocol in a way that cannot be answered.
    Protocol(String),
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::ClientAbort => f.write_str("client aborted the handshake"),
            CloseReason::Protocol(message) => write!(f, "protocol error: {message}"),
        }
    }
}

/// How the handshake ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeOutcome {
    /// Enter transmission on `exports[export]`, with what `session` says was negotiated.
    Transmission {
        export: usize,
        no_zeroes: bool,
        session: Session,
    },
    /// Close the connection (after sending any pending output).
    Closed(CloseReason),
}

/// The step the machine waits for; each needs a known number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    ClientFlags,
    OptionHeader,
    OptionData { option: u32, length: usize },
}

impl Step {
    fn bytes_needed(self) -> usize {
        match self {
            Step::ClientFlags => 4,
            Step::OptionHeader => OPTION_HEADER_LEN,
            Step::OptionData { length, .. } => length,
        }
    }
}

/// The parsed body of `NBD_OPT_INFO` / `NBD_OPT_GO`.
struct InfoRequest<'a> {
    name: &'a [u8],
    wants_name: bool,
    wants_description: bool,
}

/// Server side of the fixed-newstyle handshake. See the module docs.
#[derive(Debug)]
pub struct Handshake {
    exports: Arc<[ExportInfo]>,
    step: Step,
    /// Bytes of the current step received so far (never more than it needs).
    pending: Vec<u8>,
    output: Vec<u8>,
    no_zeroes: bool,
    /// `NBD_OPT_STRUCTURED_REPLY` was acknowledged.
    structured_replies: bool,
    /// The export for which the last `NBD_OPT_SET_META_CONTEXT` selected
    /// `base:allocation`.
    allocation_for: Option<usize>,
    tls: TlsPolicy,
    /// STARTTLS was acknowledged: the driver must start TLS before feeding more.
    starting_tls: bool,
    /// TLS runs: the rest of the handshake came through it.
    tls_active: bool,
    /// The client set `NBD_FLAG_C_FIXED_NEWSTYLE`: without it the spec allows no TLS.
    fixed_newstyle: bool,
    outcome: Option<HandshakeOutcome>,
}

impl Handshake {
    /// Starts a handshake; the server greeting is queued as output at once.
    pub fn new(exports: impl Into<Arc<[ExportInfo]>>) -> Handshake {
        let mut output = Vec::with_capacity(18);
        output.extend_from_slice(&NBDMAGIC.to_be_bytes());
        output.extend_from_slice(&IHAVEOPT.to_be_bytes());
        output.extend_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
        Handshake {
            exports: exports.into(),
            step: Step::ClientFlags,
            pending: Vec::new(),
            output,
            no_zeroes: false,
            structured_replies: false,
            allocation_for: None,
            tls: TlsPolicy::Off,
            starting_tls: false,
            tls_active: false,
            fixed_newstyle: false,
            outcome: None,
        }
    }

    /// A handshake on a server whose TLS is `tls`.
    pub fn with_tls(exports: impl Into<Arc<[ExportInfo]>>, tls: TlsPolicy) -> Handshake {
        Handshake {
            tls,
            ..Handshake::new(exports)
        }
    }

    /// True once STARTTLS was acknowledged (send the output first): the driver runs the TLS
    /// handshake on the socket, calls [`Handshake::tls_started`], and feeds what comes
    /// through TLS from then on. [`Handshake::feed`] takes nothing meanwhile.
    pub fn wants_tls(&self) -> bool {
        self.starting_tls
    }

    /// TLS runs: negotiation goes on through it. What was negotiated before it (structured
    /// replies, metadata contexts) is forgotten, as the spec requires.
    pub fn tls_started(&mut self) {
        self.starting_tls = false;
        self.tls_active = true;
        self.structured_replies = false;
        self.allocation_for = None;
    }

    /// Consumes client bytes and returns how many were used. Bytes after the
    /// end of the handshake are left unconsumed: they belong to the
    /// transmission phase.
    pub fn feed(&mut self, mut input: &[u8]) -> usize {
        let mut consumed = 0;
        while self.outcome.is_none() && !self.starting_tls && !input.is_empty() {
            let missing = self.step.bytes_needed() - self.pending.len();
            let take = missing.min(input.len());
            self.pending.extend_from_slice(&input[..take]);
            input = &input[take..];
            consumed += take;
            self.advance_if_complete();
        }
        consumed
    }

    /// Bytes the current step still needs; 0 once the handshake is over.
    pub fn bytes_needed(&self) -> usize {
        if self.outcome.is_some() || self.starting_tls {
            return 0;
        }
        self.step.bytes_needed() - self.pending.len()
    }

    /// Takes the bytes to send to the client (possibly empty).
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.output)
    }

    /// Set once the handshake is over; send the remaining output first.
    pub fn outcome(&self) -> Option<&HandshakeOutcome> {
        self.outcome.as_ref()
    }

    /// Runs every step whose bytes are all there. Zero-length option data is
    /// complete as soon as its header is, hence the loop.
    fn advance_if_complete(&mut self) {
        while self.outcome.is_none()
            && !self.starting_tls
            && self.pending.len() == self.step.bytes_needed()
        {
            let data = std::mem::take(&mut self.pending);
            self.step = match self.step {
                Step::ClientFlags => self.on_client_flags(&data),
                Step::OptionHeader => self.on_option_header(&data),
                Step::OptionData { option, .. } => self.on_option(option, &data),
            };
            // Reuse the allocation for the next step.
            self.pending = data;
            self.pending.clear();
        }
    }

    fn close(&mut self, reason: CloseReason) -> Step {
        self.outcome = Some(HandshakeOutcome::Closed(reason));
        Step::OptionHeader
    }

    fn on_client_flags(&mut self, data: &[u8]) -> Step {
        let flags = read_u32(data, 0).unwrap_or(0);
        if flags & !KNOWN_CLIENT_FLAGS != 0 {
            let message = format!("unknown client flags {flags:#x}");
            return self.close(CloseReason::Protocol(message));
        }
        // A client without FIXED_NEWSTYLE is still served fixed newstyle: the
        // spec allows it and such clients only send EXPORT_NAME anyway.
        self.no_zeroes = flags & NBD_FLAG_C_NO_ZEROES != 0;
        self.fixed_newstyle = flags & NBD_FLAG_C_FIXED_NEWSTYLE != 0;
        Step::OptionHeader
    }

    fn on_option_header(&mut self, data: &[u8]) -> Step {
        let magic = read_u64(data, 0).unwrap_or(0);
        let option = read_u32(data, 8).unwrap_or(0);
        let length = read_u32(data, 12).unwrap_or(0);
        if magic != IHAVEOPT {
            let message = format!("bad option magic {magic:#018x}");
            return self.close(CloseReason::Protocol(message));
        }
        if length > MAX_OPTION_LEN {
            let message = format!("option {option} is {length} bytes (limit {MAX_OPTION_LEN})");
            return self.close(CloseReason::Protocol(message));
        }
        // The bound above makes this conversion lossless.
        let length = length as usize;
        Step::OptionData { option, length }
    }

    fn on_option(&mut self, option: u32, data: &[u8]) -> Step {
        if self.tls == TlsPolicy::Required && !self.tls_active {
            return self.refuse_before_tls(option, data);
        }
        match option {
            NBD_OPT_EXPORT_NAME => return self.on_export_name(data),
            NBD_OPT_ABORT => {
                self.reply(option, NBD_REP_ACK, &[]);
                return self.close(CloseReason::ClientAbort);
            }
            NBD_OPT_LIST => self.on_list(data),
            NBD_OPT_INFO | NBD_OPT_GO => self.on_info_or_go(option, data),
            NBD_OPT_STRUCTURED_REPLY => self.on_structured_reply(data),
            NBD_OPT_STARTTLS if self.tls != TlsPolicy::Off => self.on_starttls(data),
            NBD_OPT_LIST_META_CONTEXT | NBD_OPT_SET_META_CONTEXT => {
                self.on_meta_context(option, data)
            }
            _ => {
                let message = format!("option {option} is not supported");
                self.reply(option, NBD_REP_ERR_UNSUP, message.as_bytes());
            }
        }
        Step::OptionHeader
    }

    /// With TLS required and not running: only STARTTLS and ABORT are served.
    fn refuse_before_tls(&mut self, option: u32, data: &[u8]) -> Step {
        match option {
            NBD_OPT_STARTTLS => self.on_starttls(data),
            NBD_OPT_ABORT => {
                self.reply(option, NBD_REP_ACK, &[]);
                return self.close(CloseReason::ClientAbort);
            }
            NBD_OPT_EXPORT_NAME => {
                let message = "TLS is required (NBD_OPT_STARTTLS) before NBD_OPT_EXPORT_NAME";
                return self.close(CloseReason::Protocol(message.into()));
            }
            _ => {
                let message = "TLS is required: send NBD_OPT_STARTTLS first";
                self.reply(option, NBD_REP_ERR_TLS_REQD, message.as_bytes());
            }
        }
        Step::OptionHeader
    }

    fn on_starttls(&mut self, data: &[u8]) {
        if !self.fixed_newstyle {
            // The spec: a client without fixed newstyle gets a server without TLS (review 46).
            let message = "TLS needs fixed newstyle negotiation (NBD_FLAG_C_FIXED_NEWSTYLE)";
            self.reply(NBD_OPT_STARTTLS, NBD_REP_ERR_UNSUP, message.as_bytes());
            return;
        }
        let refusal = if !data.is_empty() {
            Some("NBD_OPT_STARTTLS takes no data")
        } else if self.tls_active {
            Some("TLS is already running")
        } else {
            None
        };
        match refusal {
            Some(message) => self.reply(NBD_OPT_STARTTLS, NBD_REP_ERR_INVALID, message.as_bytes()),
            None => {
                self.reply(NBD_OPT_STARTTLS, NBD_REP_ACK, &[]);
                self.starting_tls = true;
            }
        }
    }

    fn on_export_name(&mut self, name: &[u8]) -> Step {
        let Some(index) = self.find_export(name) else {
            // EXPORT_NAME has no error reply; the spec mandates closing.
            let message = format!("unknown export {:?}", String::from_utf8_lossy(name));
            return self.close(CloseReason::Protocol(message));
        };
        let export = &self.exports[index];
        let (size, flags) = (export.size, export.flags | NBD_FLAG_HAS_FLAGS);
        self.output.extend_from_slice(&size.to_be_bytes());
        self.output.extend_from_slice(&flags.to_be_bytes());
        if !self.no_zeroes {
            self.output.extend_from_slice(&EXPORT_NAME_PADDING);
        }
        self.outcome = Some(HandshakeOutcome::Transmission {
            export: index,
            no_zeroes: self.no_zeroes,
            session: self.session_for(index),
        });
        Step::OptionHeader
    }

    /// What transmission on `exports[index]` may use.
    fn session_for(&self, index: usize) -> Session {
        Session {
            structured_replies: self.structured_replies,
            block_status: self.structured_replies && self.allocation_for == Some(index),
        }
    }

    fn on_structured_reply(&mut self, data: &[u8]) {
        if !data.is_empty() {
            let message = "NBD_OPT_STRUCTURED_REPLY takes no data";
            self.reply(
                NBD_OPT_STRUCTURED_REPLY,
                NBD_REP_ERR_INVALID,
                message.as_bytes(),
            );
            return;
        }
        self.structured_replies = true;
        self.reply(NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK, &[]);
    }

    /// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`: the one context
    /// offered is `base:allocation`. A SET replaces the selection even when it fails.
    fn on_meta_context(&mut self, option: u32, data: &[u8]) {
        let set = option == NBD_OPT_SET_META_CONTEXT;
        if set {
            self.allocation_for = None;
        }
        if !self.structured_replies {
            let message = "negotiate structured replies (NBD_OPT_STRUCTURED_REPLY) first";
            self.reply(option, NBD_REP_ERR_INVALID, message.as_bytes());
            return;
        }
        let Some(request) = parse_meta_request(data) else {
            let message = "malformed metadata context request";
            self.reply(option, NBD_REP_ERR_INVALID, message.as_bytes());
            return;
        };
        let Some(index) = self.export_or_error(option, request.name) else {
            return;
        };
        // LIST with no query lists everything; "base:" is LIST's wildcard for the namespace.
        let matches =
            |query: &[u8]| query == BASE_ALLOCATION.as_bytes() || (!set && query == b"base:");
        let offered = if set {
            request.queries.iter().any(|q| matches(q))
        } else {
            request.queries.is_empty() || request.queries.iter().any(|q| matches(q))
        };
        if offered {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            let mut payload = id.to_be_bytes().to_vec();
            payload.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.reply(option, NBD_REP_META_CONTEXT, &payload);
            if set {
                self.allocation_for = Some(index);
            }
        }
        self.reply(option, NBD_REP_ACK, &[]);
    }

    fn on_list(&mut self, data: &[u8]) {
        if !data.is_empty() {
            let message = "NBD_OPT_LIST takes no data";
            self.reply(NBD_OPT_LIST, NBD_REP_ERR_INVALID, message.as_bytes());
            return;
        }
        let exports = Arc::clone(&self.exports);
        for export in exports.iter() {
            let mut payload = Vec::with_capacity(4 + export.name.len() + export.description.len());
            payload.extend_from_slice(&len_u32(export.name.as_bytes()).to_be_bytes());
            payload.extend_from_slice(export.name.as_bytes());
            payload.extend_from_slice(export.description.as_bytes());
            self.reply(NBD_OPT_LIST, NBD_REP_SERVER, &payload);
        }
        self.reply(NBD_OPT_LIST, NBD_REP_ACK, &[]);
    }

    fn on_info_or_go(&mut self, option: u32, data: &[u8]) {
        let Some(request) = parse_info_request(data) else {
            let message = "malformed NBD_OPT_INFO/NBD_OPT_GO payload";
            self.reply(option, NBD_REP_ERR_INVALID, message.as_bytes());
            return;
        };
        let Some(index) = self.export_or_error(option, request.name) else {
            return;
        };
        self.send_export_infos(option, index, &request);
        self.reply(option, NBD_REP_ACK, &[]);
        if option == NBD_OPT_GO {
            self.outcome = Some(HandshakeOutcome::Transmission {
                export: index,
                no_zeroes: self.no_zeroes,
                session: self.session_for(index),
            });
        }
    }

    /// EXPORT and BLOCK_SIZE are always sent (the block size is not the
    /// default, and the spec wants servers to advertise it); NAME and
    /// DESCRIPTION only when asked for.
    fn send_export_infos(&mut self, option: u32, index: usize, request: &InfoRequest<'_>) {
        let exports = Arc::clone(&self.exports);
        let export = &exports[index];
        let mut payload = Vec::with_capacity(2 + 12);
        payload.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
        payload.extend_from_slice(&export.size.to_be_bytes());
        payload.extend_from_slice(&(export.flags | NBD_FLAG_HAS_FLAGS).to_be_bytes());
        self.reply(option, NBD_REP_INFO, &payload);
        if request.wants_name {
            self.reply_info_string(option, NBD_INFO_NAME, &export.name);
        }
        if request.wants_description {
            self.reply_info_string(option, NBD_INFO_DESCRIPTION, &export.description);
        }
        payload.clear();
        payload.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
        for size in [export.min_block, export.preferred_block, export.max_block] {
            payload.extend_from_slice(&size.to_be_bytes());
        }
        self.reply(option, NBD_REP_INFO, &payload);
    }

    fn reply_info_string(&mut self, option: u32, info: u16, text: &str) {
        let mut payload = Vec::with_capacity(2 + text.len());
        payload.extend_from_slice(&info.to_be_bytes());
        payload.extend_from_slice(text.as_bytes());
        self.reply(option, NBD_REP_INFO, &payload);
    }

    fn reply(&mut self, option: u32, reply_type: u32, payload: &[u8]) {
        self.output.extend_from_slice(&NBD_REP_MAGIC.to_be_bytes());
        self.output.extend_from_slice(&option.to_be_bytes());
        self.output.extend_from_slice(&reply_type.to_be_bytes());
        self.output
            .extend_from_slice(&len_u32(payload).to_be_bytes());
        self.output.extend_from_slice(payload);
    }

    /// The export named `name`, or `None` after replying `NBD_REP_ERR_UNKNOWN` to `option`.
    fn export_or_error(&mut self, option: u32, name: &[u8]) -> Option<usize> {
        let index = self.find_export(name);
        if index.is_none() {
            let message = format!("unknown export {:?}", String::from_utf8_lossy(name));
            self.reply(option, NBD_REP_ERR_UNKNOWN, message.as_bytes());
        }
        index
    }

    /// The empty name is the default export: the first one.
    fn find_export(&self, name: &[u8]) -> Option<usize> {
        if name.is_empty() {
            return (!self.exports.is_empty()).then_some(0);
        }
        self.exports.iter().position(|e| e.name.as_bytes() == name)
    }
}

/// Layout: u32 name length, name, u16 request count, u16 per request. Returns
/// `None` unless the lengths add up exactly.
fn parse_info_request(data: &[u8]) -> Option<InfoRequest<'_>> {
    let name_len = usize::try_from(read_u32(data, 0)?).ok()?;
    let name_end = 4usize.checked_add(name_len)?;
    let name = data.get(4..name_end)?;
    let count = usize::from(read_u16(data, name_end)?);
    let requests = data.get(name_end + 2..)?;
    if requests.len() != count * 2 {
        return None;
    }
    let mut request = InfoRequest {
        name,
        wants_name: false,
        wants_description: false,
    };
    for info in requests.chunks_exact(2) {
        match u16::from_be_bytes([info[0], info[1]]) {
            NBD_INFO_NAME => request.wants_name = true,
            NBD_INFO_DESCRIPTION => request.wants_description = true,
            // EXPORT and BLOCK_SIZE are sent anyway; unknown types are
            // ignored as the spec requires.
            _ => {}
        }
    }
    Some(request)
}

/// The parsed body of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
struct MetaRequest<'a> {
    name: &'a [u8],
    queries: Vec<&'a [u8]>,
}

/// Layout: u32 name length, name, u32 query count, then per query a u32 length and the
/// query. Returns `None` unless the lengths add up exactly (the option's data is at most
/// [`MAX_OPTION_LEN`] bytes, which bounds the queries).
fn parse_meta_request(data: &[u8]) -> Option<MetaRequest<'_>> {
    let name_len = usize::try_from(read_u32(data, 0)?).ok()?;
    let name_end = 4usize.checked_add(name_len)?;
    let name = data.get(4..name_end)?;
    let count = read_u32(data, name_end)?;
    let mut at = name_end + 4;
    let mut queries = Vec::new();
    for _ in 0..count {
        let len = usize::try_from(read_u32(data, at)?).ok()?;
        let end = (at + 4).checked_add(len)?;
        queries.push(data.get(at + 4..end)?);
        at = end;
    }
    (at == data.len()).then_some(MetaRequest { name, queries })
}

fn read_u16(data: &[u8], at: usize) -> Option<u16> {
    let bytes = data.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([bytes[0], bytes[1]]))
}

fn read_u32(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes(bytes.try_into().ok()?))
}

fn read_u64(data: &[u8], at: usize) -> Option<u64> {
    let bytes = data.get(at..at.checked_add(8)?)?;
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

/// Length field of a reply payload. Payloads are built from export names and
/// descriptions, which the server validates to be far below 4 GiB; saturating
/// keeps this total without a panic path.
fn len_u32(bytes: &[u8]) -> u32 {
    u32::try_from(bytes.len()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
