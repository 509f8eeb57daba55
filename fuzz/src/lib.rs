//! The checks behind the fuzz targets in `fuzz_targets/`, one module per target, and the
//! seed inputs each target's corpus starts from (`examples/seeds.rs` writes them).
//!
//! Every `check` takes the raw bytes libFuzzer made and panics only when the code under test
//! broke a property: a panic inside a decoder, a round trip that changes a value, a reply
//! that is not well-formed, a server that hangs. docs/fuzzing.md lists what each checks.

pub mod format_journal_block;
pub mod format_line_record;
pub mod format_meta_page;
pub mod format_superblock;
pub mod nbd_handshake;
pub mod nbd_request;
pub mod nbd_server;
pub mod sim_trace;

/// Line sizes the format accepts: 4 KiB to 1 MiB, powers of two.
pub(crate) fn line_size_from(selector: u8) -> u64 {
    1u64 << (12 + u32::from(selector % 9))
}

/// The selector byte [`line_size_from`] maps to `line_size`.
pub(crate) fn line_size_selector(line_size: u64) -> u8 {
    (line_size.trailing_zeros() - 12) as u8
}

/// `bytes` cut or padded with zeros to exactly `len` bytes.
pub(crate) fn padded(bytes: &[u8], len: usize) -> Vec<u8> {
    let mut out = bytes[..bytes.len().min(len)].to_vec();
    out.resize(len, 0);
    out
}

/// Drops trailing zero bytes: seeds are stored short, and the targets pad them back.
pub(crate) fn trimmed(mut bytes: Vec<u8>) -> Vec<u8> {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1);
    bytes.truncate(end);
    bytes
}

/// Stores the CRC32C of `buf` (with its 4-byte checksum field taken as zero) at `crc_at`, as
/// every checksummed structure of the format does, so the fuzzer's mutations reach the
/// decoders' field checks instead of stopping at the checksum.
pub(crate) fn fix_crc(buf: &mut [u8], crc_at: usize) {
    buf[crc_at..crc_at + 4].fill(0);
    let crc = crc32c::crc32c(buf);
    buf[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
}

pub(crate) fn le_u64(buf: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(bytes)
}
