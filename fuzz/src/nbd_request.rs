//! The transmission request parser and validator (`RequestHeader::parse`,
//! `validate_request`) and the reply encoder: parse accepts exactly the headers with the
//! request magic and encodes them back to the same bytes; a request validation accepts obeys
//! every rule of the export (command advertised, flags allowed, writable, length limit,
//! alignment, inside the export); errors map to NBD error values and back.
//!
//! Input: 28 header bytes, then the export the request is checked against: size (u64), flags
//! (u16), min_block (a power of two, 1 << (b % 17)), max_block (u32) and the server's payload
//! limit (u32), all big-endian; missing bytes are zeros.

use ssdcache_nbd::proto::{
    simple_reply_header, validate_request, Session, NBD_CMD_FLAG_FUA, NBD_CMD_FLAG_NO_HOLE,
    NBD_CMD_FLAG_REQ_ONE, NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_CACHE, NBD_FLAG_SEND_FLUSH,
    NBD_FLAG_SEND_FUA, NBD_FLAG_SEND_TRIM, NBD_FLAG_SEND_WRITE_ZEROES, NBD_REQUEST_MAGIC,
    NBD_SIMPLE_REPLY_MAGIC, REQUEST_HEADER_LEN,
};
use ssdcache_nbd::{Command, Errno, ExportInfo, ProtocolError, RequestHeader};

use crate::padded;

/// Bytes of the export description after the header.
const EXPORT_LEN: usize = 8 + 2 + 1 + 4 + 4;

pub fn check(data: &[u8]) {
    let input = padded(data, REQUEST_HEADER_LEN + EXPORT_LEN);
    let mut raw = [0u8; REQUEST_HEADER_LEN];
    raw.copy_from_slice(&input[..REQUEST_HEADER_LEN]);
    let magic = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]);
    let header = match RequestHeader::parse(&raw) {
        Ok(header) => header,
        Err(ProtocolError::BadRequestMagic { found }) => {
            assert_ne!(magic, NBD_REQUEST_MAGIC);
            assert_eq!(found, magic);
            return;
        }
    };
    assert_eq!(magic, NBD_REQUEST_MAGIC);
    assert_eq!(
        header.encode(),
        raw,
        "encode(parse(header)) changed the bytes"
    );
    assert_eq!(header.has_payload(), header.command == Command::Write);

    let (export, max_payload) = export_from(&input[REQUEST_HEADER_LEN..]);
    let verdict = validate_request(&header, &export, max_payload, &Session::default());
    if verdict.is_ok() {
        check_accepted(&header, &export, max_payload);
    }
    // Negotiating block status changes the verdict of BLOCK_STATUS only.
    let negotiated = Session {
        structured_replies: true,
        block_status: true,
    };
    let with_status = validate_request(&header, &export, max_payload, &negotiated);
    if header.command == Command::BlockStatus {
        assert_eq!(
            verdict,
            Err(Errno::Invalid),
            "BLOCK_STATUS needs base:allocation"
        );
        if with_status.is_ok() {
            assert!(header.length > 0, "a block status of nothing accepted");
            check_accepted(&header, &export, max_payload);
        }
    } else {
        assert_eq!(
            with_status, verdict,
            "{header:?}: the session changed the verdict"
        );
    }
    check_reply(verdict.err(), header.cookie);
}

fn export_from(bytes: &[u8]) -> (ExportInfo, u32) {
    let size = u64::from_be_bytes(bytes[0..8].try_into().unwrap_or_default());
    let flags = u16::from_be_bytes([bytes[8], bytes[9]]);
    let min_block = 1u32 << (u32::from(bytes[10]) % 17);
    let max_block = u32::from_be_bytes(bytes[11..15].try_into().unwrap_or_default());
    let max_payload = u32::from_be_bytes(bytes[15..19].try_into().unwrap_or_default());
    let export = ExportInfo {
        name: "disk".into(),
        description: String::new(),
        size,
        flags,
        min_block,
        preferred_block: min_block.max(4096),
        max_block,
    };
    (export, max_payload)
}

/// Every rule a request validation let through must hold.
fn check_accepted(header: &RequestHeader, export: &ExportInfo, max_payload: u32) {
    let flags = export.flags;
    let required = match header.command {
        Command::Read | Command::Write | Command::Disconnect => 0,
        Command::Flush => NBD_FLAG_SEND_FLUSH,
        Command::Trim => NBD_FLAG_SEND_TRIM,
        Command::Cache => NBD_FLAG_SEND_CACHE,
        Command::WriteZeroes => NBD_FLAG_SEND_WRITE_ZEROES,
        // Offered with base:allocation, not by a transmission flag.
        Command::BlockStatus => 0,
        Command::Unknown(value) => panic!("unknown command {value} accepted"),
    };
    assert_eq!(
        flags & required,
        required,
        "{header:?} accepted but not advertised"
    );
    let mut allowed = 0;
    if flags & NBD_FLAG_SEND_FUA != 0 {
        allowed |= NBD_CMD_FLAG_FUA;
    }
    if header.command == Command::WriteZeroes {
        allowed |= NBD_CMD_FLAG_NO_HOLE;
    }
    if header.command == Command::BlockStatus {
        allowed |= NBD_CMD_FLAG_REQ_ONE;
    }
    assert_eq!(
        header.flags & !allowed,
        0,
        "{header:?} accepted with flags not allowed"
    );
    let modifies = matches!(
        header.command,
        Command::Write | Command::Trim | Command::WriteZeroes
    );
    assert!(
        !(modifies && flags & NBD_FLAG_READ_ONLY != 0),
        "{header:?} accepted on a read-only export"
    );
    if matches!(header.command, Command::Flush | Command::Disconnect) {
        return;
    }
    if matches!(header.command, Command::Read | Command::Write) {
        assert!(
            header.length <= max_payload,
            "{header:?} over the payload limit {max_payload}"
        );
    }
    let block = u64::from(export.min_block);
    assert!(
        header.offset.is_multiple_of(block) && u64::from(header.length).is_multiple_of(block),
        "{header:?} misaligned"
    );
    let end = header.offset.checked_add(u64::from(header.length));
    assert!(
        end.is_some_and(|end| end <= export.size),
        "{header:?} beyond the export's {} bytes",
        export.size
    );
}

fn check_reply(error: Option<Errno>, cookie: u64) {
    let reply = simple_reply_header(error, cookie);
    assert_eq!(reply[0..4], NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    let code = u32::from_be_bytes([reply[4], reply[5], reply[6], reply[7]]);
    assert_eq!(Errno::from_code(code), error);
    assert_eq!(reply[8..16], cookie.to_be_bytes());
}

/// Headers of every command against a writable 1 MiB export.
pub fn seeds() -> Vec<Vec<u8>> {
    let commands = [
        (Command::Read, 0, 0u64, 4096u32),
        (Command::Write, NBD_CMD_FLAG_FUA, 4096, 8192),
        (Command::Flush, 0, 0, 0),
        (Command::Trim, 0, 0, 1 << 20),
        (Command::WriteZeroes, NBD_CMD_FLAG_NO_HOLE, 8192, 4096),
        (Command::Cache, 0, 0, 65536),
        (Command::Disconnect, 0, 0, 0),
        (Command::BlockStatus, 0, 0, 4096),
    ];
    commands
        .into_iter()
        .enumerate()
        .map(|(index, (command, flags, offset, length))| {
            let header = RequestHeader {
                flags,
                command,
                cookie: 0x1000 + index as u64,
                offset,
                length,
            };
            let mut seed = header.encode().to_vec();
            seed.extend_from_slice(&(1u64 << 20).to_be_bytes());
            seed.extend_from_slice(&ssdcache_nbd::transmission_flags(index == 7).to_be_bytes());
            seed.push(12);
            seed.extend_from_slice(&(32u32 << 20).to_be_bytes());
            seed.extend_from_slice(&(1u32 << 20).to_be_bytes());
            seed
        })
        .collect()
}
