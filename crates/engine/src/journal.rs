//! The metadata journal: a circular log of line records in the journal region. A commit makes
//! every completed write durable; its steps and why each survives a crash are in
//! docs/design.md, "Write-back commit protocol".

use ssdcache_device::{AlignedBuf, BlockDevice};
use ssdcache_format::journal::JournalEntry;
use ssdcache_format::journal::{decode_block, encode_block, entries_per_block, BlockHeader};
use ssdcache_format::{Layout, LineRecord, SECTOR_SIZE};

use crate::error::{EngineError, Result};

/// Blocks read at a time during replay (1 MiB).
const REPLAY_BATCH: u64 = 256;

/// Where the next commit goes.
#[derive(Debug, Clone, Copy)]
pub struct JournalPosition {
    pub generation: u64,
    /// Sequence number and block index of the first live block.
    pub start_seq: u64,
    pub start_block: u64,
    /// Sequence number of the next block to write; `next_seq - start_seq` blocks are live.
    pub next_seq: u64,
}

impl JournalPosition {
    pub fn live_blocks(&self) -> u64 {
        self.next_seq - self.start_seq
    }

    fn block_of(&self, seq: u64, layout: &Layout) -> u64 {
        (self.start_block + (seq - self.start_seq)) % layout.journal_blocks()
    }

    /// The block just past the live ones, where a fresh start (compaction) goes so the live
    /// blocks stay intact until the superblock names the new start.
    pub fn block_after_live(&self, layout: &Layout) -> u64 {
        self.block_of(self.next_seq, layout)
    }

    /// True when `blocks` more fit while leaving room for a compaction.
    pub fn has_room(&self, blocks: u64, layout: &Layout) -> bool {
        self.live_blocks() + blocks + layout.compaction_blocks() <= layout.journal_blocks()
    }
}

pub fn blocks_for(records: usize, layout: &Layout) -> u64 {
    records.div_ceil(entries_per_block(layout.line_size)) as u64
}

/// Writes `records` as one commit at `pos.next_seq` (wrapping around the region), without
/// flushing. Returns the number of blocks written. An empty commit writes nothing, unless
/// `at_least_one_block` (a generation's first commit), which writes one empty block.
pub fn write_commit(
    dev: &dyn BlockDevice,
    layout: &Layout,
    pos: &mut JournalPosition,
    records: &[(u32, LineRecord)],
    at_least_one_block: bool,
) -> Result<u64> {
    if records.is_empty() && !at_least_one_block {
        return Ok(0);
    }
    let per_block = entries_per_block(layout.line_size);
    let blocks = blocks_for(records.len(), layout).max(1);
    let mut buf = AlignedBuf::zeroed((blocks * SECTOR_SIZE) as usize);
    for i in 0..blocks as usize {
        let chunk =
            &records[(i * per_block).min(records.len())..((i + 1) * per_block).min(records.len())];
        let entries: Vec<JournalEntry> = chunk
            .iter()
            .map(|(slot, record)| JournalEntry {
                slot: u64::from(*slot),
                record: record.clone(),
            })
            .collect();
        let head = BlockHeader {
            generation: pos.generation,
            seq: pos.next_seq + i as u64,
            last_in_commit: i as u64 == blocks - 1,
        };
        let at = i * SECTOR_SIZE as usize;
        encode_block(
            head,
            layout.line_size,
            &entries,
            &mut buf[at..at + SECTOR_SIZE as usize],
        );
    }
    // Up to the end of the region, then the rest from its start.
    let first_block = pos.block_of(pos.next_seq, layout);
    let until_end = (layout.journal_blocks() - first_block).min(blocks);
    let io = |e| EngineError::CacheDevice {
        device: dev.describe(),
        source: e,
    };
    let split = (until_end * SECTOR_SIZE) as usize;
    dev.write_at(
        &buf[..split],
        layout.journal_offset + first_block * SECTOR_SIZE,
    )
    .map_err(io)?;
    if until_end < blocks {
        dev.write_at(&buf[split..], layout.journal_offset)
            .map_err(io)?;
    }
    pos.next_seq += blocks;
    Ok(blocks)
}

/// What replay found.
#[derive(Debug)]
pub struct Replayed {
    pub commits: u64,
    pub blocks: u64,
    /// Where the next block would go.
    pub end: JournalPosition,
}

/// Replays the live journal from `start`: calls `apply` with every entry of every complete
/// commit, in order (the slot, then its record). A first pass finds where the log ends (the
/// first block that does not follow, or the blocks of a commit torn by a crash, which is
/// ignored whole); a second applies what lies before. Memory stays at one read buffer however
/// long the log: records are applied as they are read, never collected.
pub fn replay(
    dev: &dyn BlockDevice,
    layout: &Layout,
    start: JournalPosition,
    apply: &mut dyn FnMut(u32, &LineRecord) -> Result<()>,
) -> Result<Replayed> {
    let (commits, blocks) = find_end(dev, layout, start)?;
    let mut seq = start.start_seq;
    for_each_block(dev, layout, start, blocks, &mut |raw| {
        let decoded = decode_block(raw, start.generation, seq, layout.line_size).map_err(|e| {
            EngineError::Format(format!(
                "journal block {seq} changed between the two passes of replay: {e}"
            ))
        })?;
        seq += 1;
        for e in &decoded.entries {
            if let Some(slot) = u32::try_from(e.slot)
                .ok()
                .filter(|&s| u64::from(s) < layout.line_count)
            {
                apply(slot, &e.record)?;
            }
        }
        Ok(true)
    })?;
    Ok(Replayed {
        commits,
        blocks,
        end: JournalPosition {
            next_seq: start.start_seq + blocks,
            ..start
        },
    })
}

/// The complete commits of the live journal from `start`, and the blocks they span.
fn find_end(dev: &dyn BlockDevice, layout: &Layout, start: JournalPosition) -> Result<(u64, u64)> {
    let (mut commits, mut blocks, mut seq) = (0u64, 0u64, start.start_seq);
    for_each_block(dev, layout, start, layout.journal_blocks(), &mut |raw| {
        let Ok(decoded) = decode_block(raw, start.generation, seq, layout.line_size) else {
            return Ok(false);
        };
        seq += 1;
        if decoded.last_in_commit {
            commits += 1;
            blocks = seq - start.start_seq;
        }
        Ok(true)
    })?;
    Ok((commits, blocks))
}

/// Reads up to `count` blocks of the log from `start`, in order, 1 MiB at a time, calling
/// `visit` with each until it returns false.
fn for_each_block(
    dev: &dyn BlockDevice,
    layout: &Layout,
    start: JournalPosition,
    count: u64,
    visit: &mut dyn FnMut(&[u8]) -> Result<bool>,
) -> Result<()> {
    let total = layout.journal_blocks();
    let mut buf = AlignedBuf::zeroed((REPLAY_BATCH * SECTOR_SIZE) as usize);
    let mut read = 0u64;
    while read < count.min(total) {
        let block = (start.start_block + read) % total;
        let n = (total - block)
            .min(REPLAY_BATCH)
            .min(count.min(total) - read);
        let chunk = &mut buf[..(n * SECTOR_SIZE) as usize];
        dev.read_at(chunk, layout.journal_offset + block * SECTOR_SIZE)
            .map_err(|e| EngineError::CacheDevice {
                device: dev.describe(),
                source: e,
            })?;
        for raw in chunk.chunks(SECTOR_SIZE as usize) {
            if !visit(raw)? {
                return Ok(());
            }
        }
        read += n;
    }
    Ok(())
}
