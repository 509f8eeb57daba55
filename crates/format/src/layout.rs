//! Where each region of a cache device lives, derived from the cache size and line size.

use crate::journal::entries_per_block as journal_entries_per_block;
use crate::lines::MetaPage;
use crate::{MAX_LINE_SIZE, MIN_LINE_SIZE, SECTOR_SIZE};

/// Two superblock copies, 64 KiB each, at the very start.
pub const SUPERBLOCK_COPY_SIZE: u64 = 64 * 1024;
/// Metadata starts at 1 MiB so the superblocks never share an erase block with it.
pub const META_OFFSET: u64 = 1 << 20;
/// The smallest cache accepted: below this the metadata overhead dominates.
pub const MIN_CACHE_SIZE: u64 = 16 << 20;
/// The fewest lines a useful cache has.
pub const MIN_LINE_COUNT: u64 = 64;
/// Slots are u32 indices in memory (u32::MAX marks "none").
pub const MAX_LINE_COUNT: u64 = u32::MAX as u64 - 1;
const MIN_JOURNAL: u64 = 4 << 20;
const REGION_ALIGN: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub cache_size: u64,
    pub line_size: u64,
    pub meta_offset: u64,
    pub meta_len: u64,
    pub journal_offset: u64,
    pub journal_len: u64,
    pub data_offset: u64,
    pub line_count: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("size {0} bytes is not a multiple of 4096; use a size in whole 4 KiB sectors")]
    Unaligned(u64),
    #[error("line size {0} is not a power of two between 4 KiB and 1 MiB")]
    BadLineSize(u64),
    #[error(
        "cache of {size} bytes is too small: at least {min} bytes and {lines} lines of the chosen \
         line size are needed; use a bigger cache device or a smaller --line-size"
    )]
    TooSmall { size: u64, min: u64, lines: u64 },
    #[error("{lines} lines of {line_size} bytes are more than one cache can index; use a larger --line-size")]
    TooManyLines { lines: u64, line_size: u64 },
    #[error(
        "a journal of {blocks} blocks is too small: write-back needs room for two compactions \
         and one more block ({needed} blocks for this cache)"
    )]
    JournalTooSmall { blocks: u64, needed: u64 },
}

impl Layout {
    /// Lays out a cache of `cache_size` bytes with lines of `line_size` bytes.
    pub fn compute(cache_size: u64, line_size: u64) -> Result<Layout, LayoutError> {
        Self::compute_with(cache_size, line_size, None)
    }

    /// Like [`compute`](Self::compute), with a journal of exactly `journal_blocks` 4 KiB
    /// blocks: for tests, which need compactions to run often. Refuses a journal smaller than
    /// write-back needs (two compactions and one block).
    pub fn with_journal_blocks(
        cache_size: u64,
        line_size: u64,
        journal_blocks: u64,
    ) -> Result<Layout, LayoutError> {
        let layout = Self::compute_with(cache_size, line_size, Some(journal_blocks))?;
        let needed = 2 * layout.compaction_blocks() + 1;
        if journal_blocks < needed {
            return Err(LayoutError::JournalTooSmall {
                blocks: journal_blocks,
                needed,
            });
        }
        Ok(layout)
    }

    fn compute_with(
        cache_size: u64,
        line_size: u64,
        journal_blocks: Option<u64>,
    ) -> Result<Layout, LayoutError> {
        if !cache_size.is_multiple_of(SECTOR_SIZE) {
            return Err(LayoutError::Unaligned(cache_size));
        }
        if !line_size.is_power_of_two() || !(MIN_LINE_SIZE..=MAX_LINE_SIZE).contains(&line_size) {
            return Err(LayoutError::BadLineSize(line_size));
        }
        let too_small = LayoutError::TooSmall {
            size: cache_size,
            min: MIN_CACHE_SIZE,
            lines: MIN_LINE_COUNT,
        };
        if cache_size < MIN_CACHE_SIZE {
            return Err(too_small);
        }
        // Overhead shrinks as the line count shrinks, so this converges from above.
        let mut lines = cache_size / line_size;
        loop {
            let layout = Self::with_lines(cache_size, line_size, lines, journal_blocks);
            let room = cache_size.saturating_sub(layout.data_offset) / line_size;
            if room >= lines {
                if lines < MIN_LINE_COUNT {
                    return Err(too_small);
                }
                if lines > MAX_LINE_COUNT {
                    return Err(LayoutError::TooManyLines { lines, line_size });
                }
                return Ok(layout);
            }
            lines = room;
        }
    }

    fn with_lines(
        cache_size: u64,
        line_size: u64,
        line_count: u64,
        fixed_journal_blocks: Option<u64>,
    ) -> Layout {
        let per_page = MetaPage::records_per_page(line_size);
        let pages = line_count.div_ceil(per_page);
        let meta_len = align_up((pages * SECTOR_SIZE).max(SECTOR_SIZE), REGION_ALIGN);
        let journal_offset = META_OFFSET + meta_len;
        let compaction = line_count.div_ceil(journal_entries_per_block(line_size) as u64);
        let journal_blocks = 2 * compaction + (compaction / 2).max(256);
        let journal_len = match fixed_journal_blocks {
            Some(blocks) => blocks * SECTOR_SIZE,
            None => align_up(
                (journal_blocks * SECTOR_SIZE).max(MIN_JOURNAL),
                REGION_ALIGN,
            ),
        };
        let data_offset = align_up(journal_offset + journal_len, line_size.max(REGION_ALIGN));
        Layout {
            cache_size,
            line_size,
            meta_offset: META_OFFSET,
            meta_len,
            journal_offset,
            journal_len,
            data_offset,
            line_count,
        }
    }

    /// Number of 4 KiB journal blocks.
    pub fn journal_blocks(&self) -> u64 {
        self.journal_len / SECTOR_SIZE
    }

    /// Journal blocks a compaction needs when every line is dirty: the journal keeps this
    /// much free so a compaction always fits beside the live blocks it replaces.
    pub fn compaction_blocks(&self) -> u64 {
        self.line_count
            .div_ceil(journal_entries_per_block(self.line_size) as u64)
    }

    pub fn sectors_per_line(&self) -> u64 {
        self.line_size / SECTOR_SIZE
    }

    /// Number of 4 KiB metadata pages that hold the line records.
    pub fn meta_pages(&self) -> u64 {
        self.line_count
            .div_ceil(MetaPage::records_per_page(self.line_size))
    }

    /// Byte offset on the cache device of the data of line `slot`.
    pub fn slot_offset(&self, slot: u64) -> u64 {
        debug_assert!(slot < self.line_count, "slot {slot} out of range");
        self.data_offset + slot * self.line_size
    }

    /// Checks that the regions are in order and inside the device (for a decoded superblock).
    pub fn is_consistent(&self) -> bool {
        let lines_ok = self.line_size.is_power_of_two()
            && (MIN_LINE_SIZE..=MAX_LINE_SIZE).contains(&self.line_size);
        let data_end = self
            .line_count
            .checked_mul(self.line_size)
            .and_then(|d| d.checked_add(self.data_offset));
        // Checked sums: the fields come from disk, and a wrapped sum would pass the checks.
        let meta_end = self.meta_offset.checked_add(self.meta_len);
        let journal_end = self.journal_offset.checked_add(self.journal_len);
        lines_ok
            && self.line_count <= MAX_LINE_COUNT
            && self.meta_offset >= 2 * SUPERBLOCK_COPY_SIZE
            && self.meta_len >= self.meta_pages() * SECTOR_SIZE
            && meta_end.is_some_and(|end| self.journal_offset >= end)
            && journal_end.is_some_and(|end| self.data_offset >= end)
            && data_end.is_some_and(|end| end <= self.cache_size)
    }
}

fn align_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_ordered_and_fit() {
        for size in [16u64 << 20, 64 << 20, 1 << 30, 100 << 30, (1 << 40) + 4096] {
            for line in [4096u64, 65536, 1 << 20] {
                let Ok(l) = Layout::compute(size, line) else {
                    assert!(size <= 64 << 20, "{size} {line} should fit");
                    continue;
                };
                assert!(l.is_consistent(), "{l:?}");
                assert!(l.line_count >= MIN_LINE_COUNT);
                assert_eq!(l.data_offset % line, 0);
                assert!(l.journal_blocks() >= 2 * l.compaction_blocks() + 256);
            }
        }
    }

    /// Found by the format_superblock fuzz target: region ends that overflow u64 panicked in
    /// debug builds and, wrapped in release builds, let overlapping regions through.
    #[test]
    fn overflowing_region_ends_are_inconsistent() {
        let good = Layout::compute(64 << 20, 65536).expect("layout");
        assert!(good.is_consistent());
        let meta_wraps = Layout {
            meta_offset: u64::MAX - 4095,
            meta_len: 8192,
            journal_offset: 1 << 20,
            ..good
        };
        assert!(!meta_wraps.is_consistent());
        let journal_wraps = Layout {
            journal_offset: u64::MAX - 4095,
            journal_len: 8192,
            data_offset: 1 << 20,
            ..good
        };
        assert!(!journal_wraps.is_consistent());
    }

    #[test]
    fn metadata_overhead_is_small() {
        let l = Layout::compute(100 << 30, 65536).expect("layout");
        let overhead = l.data_offset as f64 / l.cache_size as f64;
        // Checkpoint (0.15%: 96-byte records, a third of them sector checksums) plus a journal
        // with room for two compactions (0.4%).
        assert!(overhead < 0.006, "overhead {overhead}");
    }

    #[test]
    fn a_fixed_journal_has_exactly_its_blocks_and_room_for_two_compactions() {
        // The smallest journal accepted holds exactly two compactions and one block more.
        let (n, l) = (1..=64)
            .find_map(|n| {
                Layout::with_journal_blocks(16 << 20, 65536, n)
                    .ok()
                    .map(|l| (n, l))
            })
            .expect("a journal of at most 64 blocks is accepted");
        assert!(l.is_consistent(), "{l:?}");
        assert_eq!(l.journal_blocks(), n);
        assert_eq!(n, 2 * l.compaction_blocks() + 1, "{l:?}");
        assert!(l.line_count > Layout::compute(16 << 20, 65536).expect("layout").line_count);
        assert!(matches!(
            Layout::with_journal_blocks(16 << 20, 65536, n - 1),
            Err(LayoutError::JournalTooSmall { blocks, needed }) if blocks == n - 1 && needed >= n
        ));
    }

    #[test]
    fn rejects_bad_sizes() {
        assert_eq!(
            Layout::compute(4095 + (64 << 20), 65536),
            Err(LayoutError::Unaligned(4095 + (64 << 20)))
        );
        assert!(matches!(
            Layout::compute(8 << 20, 65536),
            Err(LayoutError::TooSmall { .. })
        ));
        assert!(matches!(
            Layout::compute(64 << 20, 3 * 4096),
            Err(LayoutError::BadLineSize(_))
        ));
        assert!(matches!(
            Layout::compute(64 << 20, 2 << 20),
            Err(LayoutError::BadLineSize(_))
        ));
        assert!(matches!(
            Layout::compute(16 << 20, 1 << 20),
            Err(LayoutError::TooSmall { .. })
        ));
    }
}
