//! Wire constants, request parsing, reply encoding and request validation.
//!
//! Everything here is pure: no I/O, no allocation. Values follow
//! `doc/proto.md` of the NetworkBlockDevice/nbd repository; the constant names
//! match the spec so they can be grepped against it.

use crate::handshake::ExportInfo;

// ---- Magics -------------------------------------------------------------

/// First 8 bytes the server sends: ASCII `NBDMAGIC`.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// Newstyle magic, sent by the server after `NBDMAGIC` and by the client
/// before every option: ASCII `IHAVEOPT`.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic starting every option reply.
pub const NBD_REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic starting every transmission request.
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic starting every simple reply.
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic starting every structured reply chunk.
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---- Handshake flags (server, 16 bits) and client flags (32 bits) --------

/// Server supports fixed newstyle negotiation.
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client speaks fixed newstyle.
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client does not want the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---- Option numbers ------------------------------------------------------

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---- Option reply types --------------------------------------------------

pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// Bit set in every error reply type.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;

// ---- Info types (inside NBD_REP_INFO, requested by NBD_OPT_INFO/GO) ------

pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---- Transmission flags (16 bits, per export) ----------------------------

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---- Command types and command flags -------------------------------------

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// ---- Structured replies and block status ---------------------------------

/// The last chunk of a structured reply.
pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const NBD_REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;
/// `base:allocation`: the extent is not allocated.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// `base:allocation`: the extent reads as zeroes.
pub const NBD_STATE_ZERO: u32 = 1 << 1;
/// The one metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in `NBD_OPT_SET_META_CONTEXT` replies and block-status chunks.
pub const BASE_ALLOCATION_ID: u32 = 1;

// ---- Error values --------------------------------------------------------

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// Size of a transmission request header on the wire.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Size of a simple reply header on the wire.
pub const SIMPLE_REPLY_HEADER_LEN: usize = 16;
/// Size of a structured reply chunk header on the wire.
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;
/// Longest reply header this server writes before a reply's data: a structured
/// `OFFSET_DATA` chunk header with its offset.
pub const MAX_REPLY_HEAD_LEN: usize = STRUCTURED_REPLY_HEADER_LEN + 8;

/// What the handshake negotiated for the transmission phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Session {
    /// `NBD_OPT_STRUCTURED_REPLY` succeeded: READ replies are structured.
    pub structured_replies: bool,
    /// `base:allocation` was selected for the export in use: `NBD_CMD_BLOCK_STATUS` is
    /// valid.
    pub block_status: bool,
}

/// The usual transmission flags of an export served by this crate: every
/// command the [`Export`](crate::Export) trait offers, plus multi-connection
/// safety (the backend is shared by all connections), plus `READ_ONLY` when
/// asked.
pub const fn transmission_flags(read_only: bool) -> u16 {
    let all = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_SEND_TRIM
        | NBD_FLAG_SEND_WRITE_ZEROES
        | NBD_FLAG_SEND_CACHE
        | NBD_FLAG_CAN_MULTI_CONN;
    if read_only {
        all | NBD_FLAG_READ_ONLY
    } else {
        all
    }
}

/// An error a request can fail with; each maps to one NBD error value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Errno {
    #[error("operation not permitted (EPERM)")]
    Perm,
    #[error("input/output error (EIO)")]
    Io,
    #[error("cannot allocate memory (ENOMEM)")]
    NoMem,
    #[error("invalid argument (EINVAL)")]
    Invalid,
    #[error("no space left on device (ENOSPC)")]
    NoSpace,
    #[error("value too large (EOVERFLOW)")]
    Overflow,
    #[error("operation not supported (ENOTSUP)")]
    NotSupported,
    #[error("server is shutting down (ESHUTDOWN)")]
    Shutdown,
}

impl Errno {
    /// The value sent in the error field of a reply.
    pub const fn code(self) -> u32 {
        match self {
            Errno::Perm => NBD_EPERM,
            Errno::Io => NBD_EIO,
            Errno::NoMem => NBD_ENOMEM,
            Errno::Invalid => NBD_EINVAL,
            Errno::NoSpace => NBD_ENOSPC,
            Errno::Overflow => NBD_EOVERFLOW,
            Errno::NotSupported => NBD_ENOTSUP,
            Errno::Shutdown => NBD_ESHUTDOWN,
        }
    }

    /// The inverse of [`Errno::code`]; `None` for 0 and unknown values.
    pub const fn from_code(code: u32) -> Option<Errno> {
        match code {
            NBD_EPERM => Some(Errno::Perm),
            NBD_EIO => Some(Errno::Io),
            NBD_ENOMEM => Some(Errno::NoMem),
            NBD_EINVAL => Some(Errno::Invalid),
            NBD_ENOSPC => Some(Errno::NoSpace),
            NBD_EOVERFLOW => Some(Errno::Overflow),
            NBD_ENOTSUP => Some(Errno::NotSupported),
            NBD_ESHUTDOWN => Some(Errno::Shutdown),
            _ => None,
        }
    }
}

/// A transmission command type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disconnect,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    /// Valid once `base:allocation` was negotiated ([`Session::block_status`]).
    BlockStatus,
    /// Any type this server does not implement.
    Unknown(u16),
}

impl Command {
    pub const fn from_wire(value: u16) -> Command {
        match value {
            NBD_CMD_READ => Command::Read,
            NBD_CMD_WRITE => Command::Write,
            NBD_CMD_DISC => Command::Disconnect,
            NBD_CMD_FLUSH => Command::Flush,
            NBD_CMD_TRIM => Command::Trim,
            NBD_CMD_CACHE => Command::Cache,
            NBD_CMD_WRITE_ZEROES => Command::WriteZeroes,
            NBD_CMD_BLOCK_STATUS => Command::BlockStatus,
            other => Command::Unknown(other),
        }
    }

    pub const fn to_wire(self) -> u16 {
        match self {
            Command::Read => NBD_CMD_READ,
            Command::Write => NBD_CMD_WRITE,
            Command::Disconnect => NBD_CMD_DISC,
            Command::Flush => NBD_CMD_FLUSH,
            Command::Trim => NBD_CMD_TRIM,
            Command::Cache => NBD_CMD_CACHE,
            Command::WriteZeroes => NBD_CMD_WRITE_ZEROES,
            Command::BlockStatus => NBD_CMD_BLOCK_STATUS,
            Command::Unknown(other) => other,
        }
    }

    /// Commands whose successful reply carries data after its header: a READ's, a
    /// BLOCK_STATUS chunk's payload.
    pub const fn replies_with_data(self) -> bool {
        matches!(self, Command::Read | Command::BlockStatus)
    }

    /// Commands that modify the export, refused on read-only exports.
    const fn modifies_data(self) -> bool {
        matches!(self, Command::Write | Command::Trim | Command::WriteZeroes)
    }
}

/// A transmission-phase protocol violation after which the byte stream cannot
/// be resynchronised, so the connection must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad request magic {found:#010x} (expected {NBD_REQUEST_MAGIC:#010x})")]
    BadRequestMagic { found: u32 },
}

/// A parsed transmission request header (without any write payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: Command,
    /// Opaque value echoed in the reply (the spec's "handle").
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    /// Parses the 28-byte header; only a wrong magic is an error because every
    /// other field is checked by [`validate_request`], which can answer it
    /// without losing sync.
    pub fn parse(bytes: &[u8; REQUEST_HEADER_LEN]) -> Result<RequestHeader, ProtocolError> {
        let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if magic != NBD_REQUEST_MAGIC {
            return Err(ProtocolError::BadRequestMagic { found: magic });
        }
        Ok(RequestHeader {
            flags: u16::from_be_bytes([bytes[4], bytes[5]]),
            command: Command::from_wire(u16::from_be_bytes([bytes[6], bytes[7]])),
            cookie: u64::from_be_bytes(array_at(bytes, 8)),
            offset: u64::from_be_bytes(array_at(bytes, 16)),
            length: u32::from_be_bytes(array_at(bytes, 24)),
        })
    }

    /// Encodes the header as a client would send it (used by tests and tools).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut out = [0u8; REQUEST_HEADER_LEN];
        out[0..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..28].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// True if a write payload of `length` bytes follows this header.
    pub fn has_payload(&self) -> bool {
        self.command == Command::Write
    }
}

/// Copies `N` bytes starting at `start` out of a header whose size is fixed,
/// so the indices are always in bounds.
fn array_at<const N: usize>(bytes: &[u8; REQUEST_HEADER_LEN], start: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[start..start + N]);
    out
}

/// Encodes a simple reply header; `error` is `None` for success.
pub fn simple_reply_header(error: Option<Errno>, cookie: u64) -> [u8; SIMPLE_REPLY_HEADER_LEN] {
    let mut out = [0u8; SIMPLE_REPLY_HEADER_LEN];
    out[0..4].copy_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.map_or(0, Errno::code).to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// A structured reply chunk header: `flags` (`NBD_REPLY_FLAG_*`), `reply_type`
/// (`NBD_REPLY_TYPE_*`) and the length of the payload after it.
pub fn structured_reply_header(
    flags: u16,
    reply_type: u16,
    cookie: u64,
    length: u32,
) -> [u8; STRUCTURED_REPLY_HEADER_LEN] {
    let mut out = [0u8; STRUCTURED_REPLY_HEADER_LEN];
    out[0..4].copy_from_slice(&NBD_STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&reply_type.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
    out
}

/// The bytes a reply begins with, before its data (if any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHead {
    bytes: [u8; MAX_REPLY_HEAD_LEN],
    len: usize,
}

impl ReplyHead {
    fn new(parts: &[&[u8]]) -> ReplyHead {
        let mut head = ReplyHead {
            bytes: [0; MAX_REPLY_HEAD_LEN],
            len: 0,
        };
        for part in parts {
            head.bytes[head.len..head.len + part.len()].copy_from_slice(part);
            head.len += part.len();
        }
        head
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// A simple reply header; `error` is `None` for success.
    pub fn simple(error: Option<Errno>, cookie: u64) -> ReplyHead {
        ReplyHead::new(&[&simple_reply_header(error, cookie)])
    }

    /// The one chunk of a successful structured READ reply: `length` bytes of data
    /// read at `offset` follow it.
    pub fn read_data(cookie: u64, offset: u64, length: u32) -> ReplyHead {
        let payload = length.saturating_add(8);
        let header = structured_reply_header(
            NBD_REPLY_FLAG_DONE,
            NBD_REPLY_TYPE_OFFSET_DATA,
            cookie,
            payload,
        );
        ReplyHead::new(&[&header, &offset.to_be_bytes()])
    }

    /// The one chunk of a successful structured reply without content (a READ of nothing).
    pub fn none(cookie: u64) -> ReplyHead {
        let header = structured_reply_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, cookie, 0);
        ReplyHead::new(&[&header])
    }

    /// The one chunk of a failed structured reply: the error, no message.
    pub fn error_chunk(error: Errno, cookie: u64) -> ReplyHead {
        let header =
            structured_reply_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_ERROR, cookie, 4 + 2);
        ReplyHead::new(&[&header, &error.code().to_be_bytes(), &0u16.to_be_bytes()])
    }

    /// The one chunk of a block-status reply; its payload (`block_status_payload`)
    /// follows it.
    pub fn block_status(cookie: u64, payload_len: usize) -> ReplyHead {
        let length = u32::try_from(payload_len).unwrap_or(u32::MAX);
        let header = structured_reply_header(
            NBD_REPLY_FLAG_DONE,
            NBD_REPLY_TYPE_BLOCK_STATUS,
            cookie,
            length,
        );
        ReplyHead::new(&[&header])
    }
}

/// The payload of a `base:allocation` block-status chunk: the context id, then one
/// descriptor (length, flags) per extent. Holes read as zeroes here, so they carry
/// both `NBD_STATE_HOLE` and `NBD_STATE_ZERO`.
pub fn block_status_payload(extents: impl Iterator<Item = (u32, bool)>) -> Vec<u8> {
    let mut out = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
    for (length, hole) in extents {
        let flags = if hole {
            NBD_STATE_HOLE | NBD_STATE_ZERO
        } else {
            0
        };
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
    out
}

/// Checks a request against the export before any backend call, returning the
/// error the spec asks for. `max_payload` bounds READ and WRITE lengths (the
/// requests that need a buffer); TRIM, WRITE_ZEROES and CACHE carry no data so
/// they may span up to the full 32-bit length (Linux sends discards that big).
///
/// `Disconnect` is valid here; the caller handles it (it has no reply).
pub fn validate_request(
    request: &RequestHeader,
    export: &ExportInfo,
    max_payload: u32,
    session: &Session,
) -> Result<(), Errno> {
    check_command_advertised(request.command, export.flags, session)?;
    check_flags(request, export.flags)?;
    if request.command.modifies_data() && export.flags & NBD_FLAG_READ_ONLY != 0 {
        return Err(Errno::Perm);
    }
    if matches!(request.command, Command::Disconnect | Command::Flush) {
        // Offset and length are reserved (zero) for these; being lenient
        // costs nothing and helps clients that leave garbage there.
        return Ok(());
    }
    check_length_limit(request, max_payload)?;
    if request.command == Command::BlockStatus && request.length == 0 {
        // Unspecified by the spec; a reply must describe at least one byte.
        return Err(Errno::Invalid);
    }
    check_alignment(request, export.min_block)?;
    check_bounds(request, export.size)
}

fn check_command_advertised(
    command: Command,
    export_flags: u16,
    session: &Session,
) -> Result<(), Errno> {
    let required_flag = match command {
        Command::Read | Command::Write | Command::Disconnect => return Ok(()),
        Command::BlockStatus if session.block_status => return Ok(()),
        Command::BlockStatus => return Err(Errno::Invalid),
        Command::Flush => NBD_FLAG_SEND_FLUSH,
        Command::Trim => NBD_FLAG_SEND_TRIM,
        Command::Cache => NBD_FLAG_SEND_CACHE,
        Command::WriteZeroes => NBD_FLAG_SEND_WRITE_ZEROES,
        Command::Unknown(_) => return Err(Errno::Invalid),
    };
    if export_flags & required_flag == 0 {
        return Err(Errno::Invalid);
    }
    Ok(())
}

/// FUA is valid on every command once advertised; NO_HOLE only on
/// WRITE_ZEROES; REQ_ONE only on BLOCK_STATUS. Everything else (DF, FAST_ZERO,
/// unknown bits) needs features this server does not offer.
fn check_flags(request: &RequestHeader, export_flags: u16) -> Result<(), Errno> {
    let mut allowed = 0;
    if export_flags & NBD_FLAG_SEND_FUA != 0 {
        allowed |= NBD_CMD_FLAG_FUA;
    }
    if request.command == Command::WriteZeroes {
        allowed |= NBD_CMD_FLAG_NO_HOLE;
    }
    if request.command == Command::BlockStatus {
        allowed |= NBD_CMD_FLAG_REQ_ONE;
    }
    if request.flags & !allowed != 0 {
        return Err(Errno::Invalid);
    }
    Ok(())
}

fn check_length_limit(request: &RequestHeader, max_payload: u32) -> Result<(), Errno> {
    if request.length <= max_payload {
        return Ok(());
    }
    match request.command {
        Command::Write => Err(Errno::Overflow),
        Command::Read => Err(Errno::Invalid),
        _ => Ok(()),
    }
}

fn check_alignment(request: &RequestHeader, min_block: u32) -> Result<(), Errno> {
    let block = u64::from(min_block.max(1));
    if !request.offset.is_multiple_of(block) || !u64::from(request.length).is_multiple_of(block) {
        return Err(Errno::Invalid);
    }
    Ok(())
}

fn check_bounds(request: &RequestHeader, export_size: u64) -> Result<(), Errno> {
    let end = request.offset.checked_add(u64::from(request.length));
    if end.is_some_and(|end| end <= export_size) {
        return Ok(());
    }
    if request.command.modifies_data() {
        Err(Errno::NoSpace)
    } else {
        Err(Errno::Invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(flags: u16) -> ExportInfo {
        ExportInfo {
            name: "disk".into(),
            description: String::new(),
            size: 1 << 20,
            flags,
            min_block: 4096,
            preferred_block: 4096,
            max_block: 1 << 25,
        }
    }

    fn request(command: Command, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 7,
            offset,
            length,
        }
    }

    const LIMIT: u32 = 1 << 25;

    #[test]
    fn header_round_trips_and_rejects_bad_magic() {
        let header = request(Command::WriteZeroes, NBD_CMD_FLAG_FUA, 1 << 40, 8192);
        let bytes = header.encode();
        assert_eq!(RequestHeader::parse(&bytes), Ok(header));
        let mut bad = bytes;
        bad[0] ^= 0xff;
        assert_eq!(
            RequestHeader::parse(&bad),
            Err(ProtocolError::BadRequestMagic { found: 0xda60_9513 })
        );
    }

    #[test]
    fn unknown_command_numbers_survive_parsing() {
        let header = request(Command::Unknown(0x1234), 0, 0, 0);
        let parsed = RequestHeader::parse(&header.encode());
        assert_eq!(parsed.map(|h| h.command), Ok(Command::Unknown(0x1234)));
    }

    #[test]
    fn simple_reply_layout() {
        let bytes = simple_reply_header(Some(Errno::NoSpace), 0x0102_0304_0506_0708);
        assert_eq!(&bytes[0..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(&bytes[4..8], &28u32.to_be_bytes());
        assert_eq!(&bytes[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&simple_reply_header(None, 0)[4..8], &[0, 0, 0, 0]);
    }

    #[test]
    fn errno_codes_round_trip() {
        for errno in [
            Errno::Perm,
            Errno::Io,
            Errno::NoMem,
            Errno::Invalid,
            Errno::NoSpace,
            Errno::Overflow,
            Errno::NotSupported,
            Errno::Shutdown,
        ] {
            assert_eq!(Errno::from_code(errno.code()), Some(errno));
        }
        assert_eq!(Errno::Overflow.code(), 75);
        assert_eq!(Errno::Shutdown.code(), 108);
        assert_eq!(Errno::from_code(0), None);
    }

    #[test]
    fn usual_flags_include_every_implemented_command() {
        let flags = transmission_flags(false);
        assert_eq!(flags & NBD_FLAG_READ_ONLY, 0);
        assert_eq!(flags, 0b101_0110_1101);
        assert_eq!(
            transmission_flags(true),
            flags | NBD_FLAG_READ_ONLY,
            "read-only only adds the READ_ONLY bit"
        );
    }

    #[test]
    fn validation_accepts_well_formed_requests() {
        let info = export(transmission_flags(false));
        for command in [
            Command::Read,
            Command::Write,
            Command::Trim,
            Command::Cache,
            Command::WriteZeroes,
        ] {
            let req = request(command, NBD_CMD_FLAG_FUA, 4096, 8192);
            assert_eq!(
                validate_request(&req, &info, LIMIT, &Session::default()),
                Ok(()),
                "{command:?}"
            );
        }
        let flush = request(Command::Flush, 0, 0, 0);
        assert_eq!(
            validate_request(&flush, &info, LIMIT, &Session::default()),
            Ok(())
        );
        let end = request(Command::Read, 0, (1 << 20) - 4096, 4096);
        assert_eq!(
            validate_request(&end, &info, LIMIT, &Session::default()),
            Ok(())
        );
    }

    #[test]
    fn validation_errors_follow_the_spec() {
        let info = export(transmission_flags(false));
        let cases = [
            (request(Command::Unknown(99), 0, 0, 0), Errno::Invalid),
            (request(Command::Read, 1 << 7, 0, 4096), Errno::Invalid),
            (
                request(Command::Read, NBD_CMD_FLAG_DF, 0, 4096),
                Errno::Invalid,
            ),
            (
                request(Command::Write, NBD_CMD_FLAG_NO_HOLE, 0, 4096),
                Errno::Invalid,
            ),
            (request(Command::Read, 0, 512, 4096), Errno::Invalid),
            (request(Command::Write, 0, 0, 1000), Errno::Invalid),
            (request(Command::Read, 0, 1 << 20, 4096), Errno::Invalid),
            (request(Command::Cache, 0, 1 << 20, 4096), Errno::Invalid),
            (request(Command::Write, 0, 1 << 20, 4096), Errno::NoSpace),
            (request(Command::Trim, 0, 1 << 20, 4096), Errno::NoSpace),
            (
                request(Command::WriteZeroes, 0, 1 << 20, 4096),
                Errno::NoSpace,
            ),
            (request(Command::Write, 0, 0, LIMIT + 4096), Errno::Overflow),
            (request(Command::Read, 0, 0, LIMIT + 4096), Errno::Invalid),
        ];
        for (req, expected) in cases {
            assert_eq!(
                validate_request(&req, &info, LIMIT, &Session::default()),
                Err(expected),
                "{req:?}"
            );
        }
    }

    #[test]
    fn validation_survives_u64_overflow() {
        let info = export(transmission_flags(false));
        let offset = u64::MAX - 4095;
        let write = request(Command::Write, 0, offset, 8192);
        assert_eq!(
            validate_request(&write, &info, LIMIT, &Session::default()),
            Err(Errno::NoSpace)
        );
        let read = request(Command::Read, 0, offset, 8192);
        assert_eq!(
            validate_request(&read, &info, LIMIT, &Session::default()),
            Err(Errno::Invalid)
        );
    }

    #[test]
    fn unadvertised_features_are_invalid() {
        let info = export(NBD_FLAG_HAS_FLAGS);
        for command in [
            Command::Flush,
            Command::Trim,
            Command::Cache,
            Command::WriteZeroes,
        ] {
            let req = request(command, 0, 0, 4096);
            assert_eq!(
                validate_request(&req, &info, LIMIT, &Session::default()),
                Err(Errno::Invalid)
            );
        }
        let fua = request(Command::Write, NBD_CMD_FLAG_FUA, 0, 4096);
        assert_eq!(
            validate_request(&fua, &info, LIMIT, &Session::default()),
            Err(Errno::Invalid)
        );
    }

    #[test]
    fn read_only_exports_refuse_modifications() {
        let info = export(transmission_flags(true));
        for command in [Command::Write, Command::Trim, Command::WriteZeroes] {
            let req = request(command, 0, 0, 4096);
            assert_eq!(
                validate_request(&req, &info, LIMIT, &Session::default()),
                Err(Errno::Perm)
            );
        }
        for command in [Command::Read, Command::Cache, Command::Flush] {
            let req = request(command, 0, 0, 4096);
            assert_eq!(
                validate_request(&req, &info, LIMIT, &Session::default()),
                Ok(())
            );
        }
    }

    #[test]
    fn dataless_commands_may_exceed_the_payload_limit() {
        let mut info = export(transmission_flags(false));
        info.size = 1 << 33;
        let trim = request(Command::Trim, 0, 0, u32::MAX - 4095);
        assert_eq!(
            validate_request(&trim, &info, LIMIT, &Session::default()),
            Ok(())
        );
    }
}
