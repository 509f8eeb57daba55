//! Little-endian field access on fixed buffers. Callers pass offsets from the format tables;
//! every buffer handed here has a length fixed by the format, so the slices cannot fail for
//! in-range constant offsets (checked by the unit tests of each record).

pub(crate) fn get_u16(buf: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([buf[at], buf[at + 1]])
}

pub(crate) fn get_u32(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

pub(crate) fn get_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

pub(crate) fn put_u16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A NUL-padded UTF-8 string field. Invalid UTF-8 decodes lossily: a name is for display.
pub(crate) fn get_str(buf: &[u8], at: usize, len: usize) -> String {
    let field = &buf[at..at + len];
    let end = field.iter().position(|&b| b == 0).unwrap_or(len);
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// Writes `s` NUL-padded; the caller has checked that it fits (see `fits_str`).
pub(crate) fn put_str(buf: &mut [u8], at: usize, len: usize, s: &str) {
    let field = &mut buf[at..at + len];
    field.fill(0);
    let n = s.len().min(len);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// CRC32C of `buf` with the 4-byte checksum field at `crc_at` taken as zero.
pub(crate) fn crc_with_hole(buf: &[u8], crc_at: usize) -> u32 {
    let crc = crc32c::crc32c(&buf[..crc_at]);
    let crc = crc32c::crc32c_append(crc, &[0u8; 4]);
    crc32c::crc32c_append(crc, &buf[crc_at + 4..])
}
