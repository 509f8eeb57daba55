//! `journal::decode_block`: never panics, on blocks of any length; a 4 KiB block whose
//! checksum is right is never refused as corrupt for its checksum's sake, and one of another
//! generation or sequence is refused; what it accepts encodes back to a block that decodes
//! the same.
//!
//! Input: byte 0 selects the line size (4 KiB << (b % 9)), the rest is the block. It is
//! decoded as given (any length), then cut or padded to 4 KiB with its checksum recomputed.
//! The generation and sequence the caller expects are taken from the block itself.

use ssdcache_format::journal::{
    decode_block, encode_block, entries_per_block, BlockHeader, JournalEntry, JournalError,
};
use ssdcache_format::{LineRecord, SECTOR_SIZE};

use crate::{fix_crc, le_u64, line_size_from, line_size_selector, padded, trimmed};

const BLOCK: usize = SECTOR_SIZE as usize;
const CRC_AT: usize = 4;
const SEQUENCE_AT: usize = 8;
const GENERATION_AT: usize = 16;

pub fn check(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let line_size = line_size_from(selector);
    if body.len() != BLOCK {
        let refused = decode_block(body, 0, 0, line_size);
        assert_eq!(
            refused,
            Err(JournalError::Corrupt),
            "a block of {} bytes",
            body.len()
        );
    }
    let mut block = padded(body, BLOCK);
    let (generation, sequence) = (le_u64(&block, GENERATION_AT), le_u64(&block, SEQUENCE_AT));
    let _ = decode_block(&block, generation, sequence, line_size);

    fix_crc(&mut block, CRC_AT);
    let Ok(decoded) = decode_block(&block, generation, sequence, line_size) else {
        return;
    };
    assert!(decoded.entries.len() <= entries_per_block(line_size));
    assert!(matches!(
        decode_block(&block, generation.wrapping_add(1), sequence, line_size),
        Err(JournalError::OtherGeneration { .. })
    ));
    assert!(matches!(
        decode_block(&block, generation, sequence.wrapping_add(1), line_size),
        Err(JournalError::OutOfSequence { .. })
    ));

    let head = BlockHeader {
        generation,
        seq: sequence,
        last_in_commit: decoded.last_in_commit,
    };
    let mut again = vec![0u8; BLOCK];
    encode_block(head, line_size, &decoded.entries, &mut again);
    assert_eq!(
        decode_block(&again, generation, sequence, line_size),
        Ok(decoded),
        "decode(encode(block)) changed the block"
    );
}

/// Valid blocks: empty, one entry, full; last of a commit or not; three line sizes.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for line_size in [4096u64, 65536, 1 << 20] {
        let mut record = LineRecord::FREE;
        record.volume = 1;
        record.backing_line = 4242;
        record.crcs = (0..LineRecord::sectors(line_size) as u32)
            .map(|s| 0xfeed_0000 | s)
            .collect();
        record.valid.set(0, true);
        record.dirty.set(0, true);
        let entry = |slot| JournalEntry {
            slot,
            record: record.clone(),
        };
        let full = entries_per_block(line_size) as u64;
        let blocks: [(Vec<JournalEntry>, bool); 3] = [
            (Vec::new(), true),
            (vec![entry(9)], true),
            ((0..full).map(entry).collect(), false),
        ];
        for (entries, last_in_commit) in blocks {
            let head = BlockHeader {
                generation: 0x5eed,
                seq: 17,
                last_in_commit,
            };
            let mut block = vec![0u8; BLOCK];
            encode_block(head, line_size, &entries, &mut block);
            let mut seed = vec![line_size_selector(line_size)];
            seed.extend(trimmed(block));
            seeds.push(seed);
        }
    }
    seeds
}
