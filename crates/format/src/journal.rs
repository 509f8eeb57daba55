//! Metadata journal blocks. A block is 4 KiB: a header, then entries that each replace the
//! line record of one slot. Blocks are written in commits of one or more blocks; the last block
//! of a commit carries `LAST_IN_COMMIT`. Replay applies whole commits in sequence order and stops
//! at the first block whose checksum, generation or sequence does not follow: that is the end
//! of the log (a torn or never-written commit is ignored whole).
//!
//! Header (32 bytes, little-endian): magic u32 @0, crc32c u32 @4 (of the block with this
//! field zeroed), sequence u64 @8, generation u64 @16, entry count u16 @24, flags u16 @26,
//! entry size u32 @28. Entries from byte 32: slot u64, then the line record.

use crate::bytes::{crc_with_hole, get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::lines::LineRecord;
use crate::SECTOR_SIZE;

pub const JOURNAL_MAGIC: u32 = 0x424a_4353; // "SCJB"
const HEADER: usize = 32;
const ENTRY_HEADER: usize = 8;
/// Flag of the last block of a commit.
pub const LAST_IN_COMMIT: u16 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    pub slot: u64,
    pub record: LineRecord,
}

/// A decoded block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalBlock {
    pub entries: Vec<JournalEntry>,
    pub last_in_commit: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JournalError {
    #[error("journal block has bad magic or checksum")]
    Corrupt,
    #[error("journal block belongs to generation {found}, expected {expected}")]
    OtherGeneration { found: u64, expected: u64 },
    #[error("journal block sequence {found}, expected {expected}")]
    OutOfSequence { found: u64, expected: u64 },
}

pub fn entries_per_block(line_size: u64) -> usize {
    (SECTOR_SIZE as usize - HEADER) / (ENTRY_HEADER + LineRecord::encoded_size(line_size))
}

/// Where a block sits in the journal and what it says about itself.
#[derive(Debug, Clone, Copy)]
pub struct BlockHeader {
    pub generation: u64,
    pub seq: u64,
    pub last_in_commit: bool,
}

/// Encodes a block into `out` (4 KiB).
pub fn encode_block(head: BlockHeader, line_size: u64, entries: &[JournalEntry], out: &mut [u8]) {
    assert_eq!(out.len(), SECTOR_SIZE as usize);
    assert!(entries.len() <= entries_per_block(line_size));
    let es = ENTRY_HEADER + LineRecord::encoded_size(line_size);
    out.fill(0);
    put_u32(out, 0, JOURNAL_MAGIC);
    put_u64(out, 8, head.seq);
    put_u64(out, 16, head.generation);
    put_u16(out, 24, entries.len() as u16);
    put_u16(
        out,
        26,
        if head.last_in_commit {
            LAST_IN_COMMIT
        } else {
            0
        },
    );
    put_u32(out, 28, es as u32);
    for (i, e) in entries.iter().enumerate() {
        let at = HEADER + i * es;
        put_u64(out, at, e.slot);
        e.record
            .encode(line_size, &mut out[at + ENTRY_HEADER..at + es]);
    }
    let crc = crc_with_hole(out, 4);
    put_u32(out, 4, crc);
}

/// Decodes a block, which must belong to `generation` and carry sequence `expected`.
pub fn decode_block(
    buf: &[u8],
    generation: u64,
    expected: u64,
    line_size: u64,
) -> Result<JournalBlock, JournalError> {
    if buf.len() != SECTOR_SIZE as usize || get_u32(buf, 0) != JOURNAL_MAGIC {
        return Err(JournalError::Corrupt);
    }
    if get_u32(buf, 4) != crc_with_hole(buf, 4) {
        return Err(JournalError::Corrupt);
    }
    let found_gen = get_u64(buf, 16);
    if found_gen != generation {
        return Err(JournalError::OtherGeneration {
            found: found_gen,
            expected: generation,
        });
    }
    let found = get_u64(buf, 8);
    if found != expected {
        return Err(JournalError::OutOfSequence { found, expected });
    }
    let count = usize::from(get_u16(buf, 24));
    let es = ENTRY_HEADER + LineRecord::encoded_size(line_size);
    if count > entries_per_block(line_size) || get_u32(buf, 28) as usize != es {
        return Err(JournalError::Corrupt);
    }
    let entries = (0..count)
        .map(|i| {
            let at = HEADER + i * es;
            JournalEntry {
                slot: get_u64(buf, at),
                record: LineRecord::decode(line_size, &buf[at + ENTRY_HEADER..]),
            }
        })
        .collect();
    Ok(JournalBlock {
        entries,
        last_in_commit: get_u16(buf, 26) & LAST_IN_COMMIT != 0,
    })
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
        rec.valid.set(3, true);
        rec.crcs = (0..16).map(|s| 0xabc0 + s).collect();
        let entries = vec![JournalEntry {
            slot: 5,
            record: rec,
        }];
        let mut block = vec![0u8; 4096];
        let head = BlockHeader {
            generation: 7,
            seq: 12,
            last_in_commit: true,
        };
        encode_block(head, 65536, &entries, &mut block);
        assert_eq!(
            decode_block(&block, 7, 12, 65536),
            Ok(JournalBlock {
                entries,
                last_in_commit: true
            })
        );
        assert_eq!(
            decode_block(&block, 7, 13, 65536),
            Err(JournalError::OutOfSequence {
                found: 12,
                expected: 13
            })
        );
        assert_eq!(
            decode_block(&block, 8, 12, 65536),
            Err(JournalError::OtherGeneration {
                found: 7,
                expected: 8
            })
        );
        block[2000] ^= 4;
        assert_eq!(
            decode_block(&block, 7, 12, 65536),
            Err(JournalError::Corrupt)
        );
    }
}
