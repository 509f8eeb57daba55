//! Metadata journal blocks, reserved for write-back (the region exists from format version 1
//! so a write-back cache needs no re-format). A block is 4 KiB: a header, then entries that
//! each replace the line record of one slot. Replay applies blocks in sequence order and stops
//! at the first block whose checksum or sequence does not follow: that is the torn tail.

use crate::bytes::{crc_with_hole, get_u32, get_u64, put_u32, put_u64};
use crate::lines::LineRecord;
use crate::SECTOR_SIZE;

pub const JOURNAL_MAGIC: u32 = 0x424a_4353; // "SCJB"
const HEADER: usize = 32;
const ENTRY_HEADER: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    pub slot: u64,
    pub record: LineRecord,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JournalError {
    #[error("journal block has bad magic or checksum")]
    Corrupt,
    #[error("journal block sequence {found}, expected {expected}")]
    OutOfSequence { found: u64, expected: u64 },
}

pub fn entries_per_block(line_size: u64) -> usize {
    (SECTOR_SIZE as usize - HEADER) / (ENTRY_HEADER + LineRecord::encoded_size(line_size))
}

/// Encodes a block with sequence `seq` into `out` (4 KiB).
pub fn encode_block(seq: u64, line_size: u64, entries: &[JournalEntry], out: &mut [u8]) {
    assert_eq!(out.len(), SECTOR_SIZE as usize);
    assert!(entries.len() <= entries_per_block(line_size));
    let es = ENTRY_HEADER + LineRecord::encoded_size(line_size);
    out.fill(0);
    put_u32(out, 0, JOURNAL_MAGIC);
    put_u64(out, 8, seq);
    put_u32(out, 16, entries.len() as u32);
    put_u32(out, 20, es as u32);
    for (i, e) in entries.iter().enumerate() {
        let at = HEADER + i * es;
        put_u64(out, at, e.slot);
        e.record
            .encode(line_size, &mut out[at + ENTRY_HEADER..at + es]);
    }
    let crc = crc_with_hole(out, 4);
    put_u32(out, 4, crc);
}

/// Decodes a block, which must carry sequence `expected`.
pub fn decode_block(
    buf: &[u8],
    expected: u64,
    line_size: u64,
) -> Result<Vec<JournalEntry>, JournalError> {
    if buf.len() != SECTOR_SIZE as usize || get_u32(buf, 0) != JOURNAL_MAGIC {
        return Err(JournalError::Corrupt);
    }
    if get_u32(buf, 4) != crc_with_hole(buf, 4) {
        return Err(JournalError::Corrupt);
    }
    let found = get_u64(buf, 8);
    if found != expected {
        return Err(JournalError::OutOfSequence { found, expected });
    }
    let count = get_u32(buf, 16) as usize;
    let es = ENTRY_HEADER + LineRecord::encoded_size(line_size);
    if count > entries_per_block(line_size) || get_u32(buf, 20) as usize != es {
        return Err(JournalError::Corrupt);
    }
    Ok((0..count)
        .map(|i| {
            let at = HEADER + i * es;
            JournalEntry {
                slot: get_u64(buf, at),
                record: LineRecord::decode(line_size, &buf[at + ENTRY_HEADER..]),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_round_trip_and_torn_tail() {
        let mut rec = LineRecord::FREE;
        rec.volume = 1;
        rec.backing_line = 99;
        rec.dirty.set(3, true);
        let entries = vec![JournalEntry {
            slot: 5,
            record: rec,
        }];
        let mut block = vec![0u8; 4096];
        encode_block(12, 65536, &entries, &mut block);
        assert_eq!(decode_block(&block, 12, 65536), Ok(entries));
        assert_eq!(
            decode_block(&block, 13, 65536),
            Err(JournalError::OutOfSequence {
                found: 12,
                expected: 13
            })
        );
        block[2000] ^= 4;
        assert_eq!(decode_block(&block, 12, 65536), Err(JournalError::Corrupt));
    }
}
