//! What the load test writes into a 4 KiB block, and how a read block is recognised.
//!
//! Every block written holds a header (magic, the run's salt, the block number, the write's
//! version) and a body of pseudo-random words derived from those, so a reader can tell which
//! write of which block it sees, and whether it is intact: zeroes, a known write, another
//! block's data, a damaged write, or anything else.

use ssdcache_device::SplitMix64;

/// The unit the model tracks (and the smallest request).
pub const BLOCK: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"SSDLOAD1");
const HEADER_WORDS: usize = 4;

/// What one 4 KiB block read back turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    Zero,
    /// Intact data of this block's write `version`.
    Data(u64),
    /// Intact-looking data that belongs to another block.
    Foreign {
        block: u64,
        version: u64,
    },
    /// The header of write `version` of this block with a damaged body.
    Damaged {
        version: u64,
    },
    /// Neither zeroes nor anything this run (salt) wrote.
    Garbage,
}

impl std::fmt::Display for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Observed::Zero => f.write_str("zeroes"),
            Observed::Data(version) => write!(f, "version {version}"),
            Observed::Foreign { block, version } => {
                write!(f, "block {block}'s version {version} (misplaced)")
            }
            Observed::Damaged { version } => write!(f, "version {version} with a damaged body"),
            Observed::Garbage => f.write_str("unrecognised data"),
        }
    }
}

fn body_seed(salt: u64, block: u64, version: u64) -> u64 {
    salt ^ block.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
}

/// Fills `out` (exactly [`BLOCK`] bytes) with write `version` of `block`.
pub fn fill(out: &mut [u8], salt: u64, block: u64, version: u64) {
    let header = [MAGIC, salt, block, version];
    let mut rng = SplitMix64(body_seed(salt, block, version));
    for (index, word) in out.chunks_exact_mut(8).enumerate() {
        let value = match header.get(index) {
            Some(&value) => value,
            None => rng.next_u64(),
        };
        word.copy_from_slice(&value.to_le_bytes());
    }
}

/// Recognises a block read at `block` (exactly [`BLOCK`] bytes).
pub fn classify(data: &[u8], salt: u64, block: u64) -> Observed {
    if data.iter().all(|&b| b == 0) {
        return Observed::Zero;
    }
    let word = |i: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&data[i * 8..i * 8 + 8]);
        u64::from_le_bytes(bytes)
    };
    if word(0) != MAGIC || word(1) != salt {
        return Observed::Garbage;
    }
    let (found_block, version) = (word(2), word(3));
    let mut rng = SplitMix64(body_seed(salt, found_block, version));
    let intact = (HEADER_WORDS..BLOCK / 8).all(|i| word(i) == rng.next_u64());
    match (found_block == block, intact) {
        (true, true) => Observed::Data(version),
        (true, false) => Observed::Damaged { version },
        (false, true) => Observed::Foreign {
            block: found_block,
            version,
        },
        (false, false) => Observed::Garbage,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_recognised_and_damage_is_caught() {
        let mut buf = vec![0u8; BLOCK];
        assert_eq!(classify(&buf, 9, 3), Observed::Zero);
        fill(&mut buf, 9, 3, 77);
        assert_eq!(classify(&buf, 9, 3), Observed::Data(77));
        assert_eq!(
            classify(&buf, 9, 4),
            Observed::Foreign {
                block: 3,
                version: 77
            }
        );
        assert_eq!(
            classify(&buf, 10, 3),
            Observed::Garbage,
            "another run's data"
        );
        buf[BLOCK - 1] ^= 1;
        assert_eq!(classify(&buf, 9, 3), Observed::Damaged { version: 77 });
        buf[..8].fill(0xff);
        assert_eq!(classify(&buf, 9, 3), Observed::Garbage);
    }
}
