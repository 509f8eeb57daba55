//! Where each crash point fell, from the clock's op log and the cache's layout, and the
//! counts the run prints.

use std::sync::atomic::{AtomicU64, Ordering};

use ssdcache_devsim::{OpKind, OpRecord};
use ssdcache_format::layout::SUPERBLOCK_COPY_SIZE;
use ssdcache_format::Layout;

use super::Activity;

/// Index of the cache device and of the backing device on a run's clock.
pub const CACHE_DEV: usize = 0;
pub const BACKING_DEV: usize = 1;

/// Kinds of place a crash point can fall in (bits of a mask; a point can be in several).
pub const IN_COMMIT: u8 = 1;
pub const IN_COMPACTION: u8 = 2;
pub const SUPERBLOCK: u8 = 4;
pub const CHECKPOINT: u8 = 8;
pub const WRITEBACK: u8 = 16;
pub const CLIENT_IO: u8 = 32;
pub const FAILED_OP: u8 = 64;
pub const MODE_CHANGE: u8 = 128;

const NAMES: [(u8, &str); 8] = [
    (IN_COMMIT, "inside a journal commit"),
    (IN_COMPACTION, "inside a compaction"),
    (SUPERBLOCK, "at a superblock write"),
    (CHECKPOINT, "inside a checkpoint (clean stop)"),
    (WRITEBACK, "inside a writeback batch"),
    (CLIENT_IO, "at a client's data write"),
    (FAILED_OP, "at an injected I/O error"),
    (MODE_CHANGE, "inside a mode change"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Region {
    Superblock,
    Checkpoint,
    Journal,
    Data,
    Backing,
}

fn region(r: &OpRecord, layout: &Layout) -> Region {
    if r.device != CACHE_DEV {
        return Region::Backing;
    }
    if r.offset < 2 * SUPERBLOCK_COPY_SIZE {
        Region::Superblock
    } else if r.offset < layout.journal_offset {
        Region::Checkpoint
    } else if r.offset < layout.data_offset {
        Region::Journal
    } else {
        Region::Data
    }
}

fn is_write(r: &OpRecord) -> bool {
    matches!(r.kind, OpKind::Write | OpKind::WriteZeroes)
}

fn is_cache_flush(r: &OpRecord) -> bool {
    r.device == CACHE_DEV && r.kind == OpKind::Flush
}

/// What a run's op log says.
pub struct Classified {
    /// A mask of the kinds above per op, indexed by op number - 1.
    pub masks: Vec<u8>,
    pub compactions: u64,
    pub journal_writes: u64,
}

impl Classified {
    pub fn mask(&self, op: u64) -> u8 {
        op.checked_sub(1)
            .and_then(|i| self.masks.get(i as usize))
            .copied()
            .unwrap_or(0)
    }
}

/// Marks every op of each commit (from the cache flush before its journal write to the flush
/// after it; a compaction on to the flush after its second superblock copy), superblock and
/// checkpoint writes with the flush that follows each, and the ops of writeback batches,
/// client requests and mode changes. Commits run one at a time (the journal lock), so a
/// commit's cache-device ops are in order in the log; other threads' data writes may sit
/// between them.
pub fn classify(log: &[OpRecord], layout: &Layout) -> Classified {
    let mut masks = vec![0u8; log.len()];
    let cache_ops: Vec<usize> = (0..log.len())
        .filter(|&i| log[i].device == CACHE_DEV)
        .collect();
    let (mut compactions, mut journal_writes) = (0, 0);
    let mut covered_until = 0usize; // cache_ops index up to which a commit was marked
    for (ci, &i) in cache_ops.iter().enumerate() {
        let r = &log[i];
        let reg = region(r, layout);
        let label = Activity::from_label(r.label);
        if r.failed {
            masks[i] |= FAILED_OP;
        }
        match label {
            Activity::Writeback => masks[i] |= WRITEBACK,
            Activity::ModeChange => masks[i] |= MODE_CHANGE,
            _ => {}
        }
        if is_write(r) && reg == Region::Data && label.is_client() {
            masks[i] |= CLIENT_IO;
        }
        let flush_after = |kind: Region| {
            ci.checked_sub(1)
                .map(|p| &log[cache_ops[p]])
                .is_some_and(|p| is_write(p) && region(p, layout) == kind)
        };
        if (is_write(r) && reg == Region::Superblock)
            || (is_cache_flush(r) && flush_after(Region::Superblock))
        {
            masks[i] |= SUPERBLOCK;
        }
        if (is_write(r) && reg == Region::Checkpoint)
            || (is_cache_flush(r) && flush_after(Region::Checkpoint))
        {
            masks[i] |= CHECKPOINT;
        }
        let opens_commit = is_write(r) && reg == Region::Journal;
        let empty_compaction = is_write(r)
            && reg == Region::Superblock
            && r.offset == 0
            && !matches!(label, Activity::Setup | Activity::Restart)
            && ci >= covered_until;
        if opens_commit {
            journal_writes += 1;
        }
        if ci < covered_until || !(opens_commit || empty_compaction) {
            continue;
        }
        // Back to the flush before it (the commit's data flush).
        let start = (0..ci)
            .rev()
            .find(|&p| is_cache_flush(&log[cache_ops[p]]))
            .unwrap_or(ci);
        let mut end = ci;
        let mut compaction = empty_compaction;
        if opens_commit {
            // On to the flush after the journal write(s).
            end = (ci..cache_ops.len())
                .find(|&p| is_cache_flush(&log[cache_ops[p]]))
                .unwrap_or(cache_ops.len() - 1);
            // A compaction writes the superblock next.
            compaction = cache_ops.get(end + 1).is_some_and(|&n| {
                is_write(&log[n]) && region(&log[n], layout) == Region::Superblock
            });
        }
        if compaction {
            // Two copies, each flushed: end at the second copy's flush.
            let mut flushes = 0;
            let from = if opens_commit { end + 1 } else { ci };
            end = from;
            for p in from..cache_ops.len() {
                end = p;
                if is_cache_flush(&log[cache_ops[p]]) {
                    flushes += 1;
                    if flushes == 2 {
                        break;
                    }
                }
            }
            compactions += 1;
        }
        let (first_op, last_op) = (cache_ops[start], cache_ops[end]);
        for m in &mut masks[first_op..=last_op] {
            *m |= IN_COMMIT | if compaction { IN_COMPACTION } else { 0 };
        }
        covered_until = end + 1;
    }
    // Backing-device ops: client writes and writeback.
    for (i, r) in log.iter().enumerate() {
        if r.device == BACKING_DEV {
            let label = Activity::from_label(r.label);
            if r.failed {
                masks[i] |= FAILED_OP;
            }
            match label {
                // The cleaner writes from threads of its own, which carry no label.
                Activity::Writeback | Activity::Other => masks[i] |= WRITEBACK,
                Activity::ModeChange => masks[i] |= MODE_CHANGE,
                l if l.is_client() && is_write(r) => masks[i] |= CLIENT_IO,
                _ => {}
            }
        }
    }
    Classified {
        masks,
        compactions,
        journal_writes,
    }
}

/// Counts over a whole test run, shared by its worker threads.
#[derive(Default)]
pub struct Stats {
    pub points: AtomicU64,
    pub captures: AtomicU64,
    pub workloads: AtomicU64,
    pub threads: AtomicU64,
    pub ops: AtomicU64,
    pub compactions: AtomicU64,
    pub journal_writes: AtomicU64,
    pub injected_errors: AtomicU64,
    pub dirty_lines_recovered: AtomicU64,
    pub second_crashes: AtomicU64,
    pub by_place: [AtomicU64; 8],
    /// Bit `p` set: policy id `p` ran; bit 8 + log2(line size / 4 KiB): that line size ran.
    pub covered: AtomicU64,
}

impl Stats {
    pub fn add(&self, counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn place(&self, mask: u8) {
        for (i, (bit, _)) in NAMES.iter().enumerate() {
            if mask & bit != 0 {
                self.by_place[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn cover(&self, policy: u32, line_size: u64) {
        let line_bit = 8 + (line_size / 4096).trailing_zeros();
        self.covered
            .fetch_or(1 << policy | 1 << line_bit, Ordering::Relaxed);
    }

    /// The report printed at the end of a run.
    pub fn report(&self, what: &str) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let covered = get(&self.covered);
        let policies: Vec<&str> = (0..8)
            .filter(|p| covered & 1 << p != 0)
            .filter_map(|p| ssdcache_engine::policy::NAMES.get(p).copied())
            .collect();
        let lines: Vec<String> = (0..9)
            .filter(|b| covered & 1 << (8 + b) != 0)
            .map(|b| format!("{} KiB", 4u64 << b))
            .collect();
        let mut out = format!(
            "{what}: {} crash points checked ({} power-cut instants captured, each materialized \
             several ways; {} second cuts during the recovery's writeback)\n  \
             {} workloads, {} threads in all, {} device ops; {} compactions, {} journal writes; \
             {} injected I/O errors; {} dirty lines recovered\n  \
             policies: {}; line sizes: {}\n  crash points by place:",
            get(&self.points),
            get(&self.captures),
            get(&self.second_crashes),
            get(&self.workloads),
            get(&self.threads),
            get(&self.ops),
            get(&self.compactions),
            get(&self.journal_writes),
            get(&self.injected_errors),
            get(&self.dirty_lines_recovered),
            policies.join(", "),
            lines.join(", "),
        );
        for (i, (_, name)) in NAMES.iter().enumerate() {
            out.push_str(&format!("\n    {:>8} {name}", get(&self.by_place[i])));
        }
        out
    }
}

/// The places a crash point fell in, for messages.
pub fn describe(mask: u8) -> String {
    let places: Vec<&str> = NAMES
        .iter()
        .filter(|(bit, _)| mask & bit != 0)
        .map(|(_, n)| *n)
        .collect();
    if places.is_empty() {
        "between operations".into()
    } else {
        places.join(", ")
    }
}
