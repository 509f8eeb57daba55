//! Write-back mode end to end: the cleaner's batches are sorted and merged, the backing device
//! is flushed before the journal records data clean, dirty data survives a crash and is
//! reported, a cache full of dirty data still takes writes, and leaving write-back drains.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use common::{counter, data, format_dev, open_dyn, Rng, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, MemDevice, Op, RecordingDevice, SharedOpLog};
use ssdcache_engine::{Cache, CleanerConfig, Select, VolumeState};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
const SECTORS_PER_LINE: u64 = LINE / SECTOR;

/// A write-back cache over `backing` (any device), cutoff 0 so every write is cached.
fn open_wb(
    cache_size: u64,
    backing: Arc<dyn BlockDevice>,
    line: u64,
) -> (Arc<MemDevice>, Cache, ssdcache_engine::OpenReport) {
    let cache_dev = Arc::new(MemDevice::new("cache", cache_size));
    format_dev(&*cache_dev, line, CacheMode::WriteBack, backing.size(), 0);
    let (cache, report) = open_dyn(cache_dev.clone(), backing);
    (cache_dev, cache, report)
}

/// Writes `buf` through the volume and into the model.
fn write(cache: &Cache, model: &mut [u8], offset: u64, buf: &[u8]) {
    cache.volumes()[0]
        .write(offset, buf, false)
        .unwrap_or_else(|e| panic!("write of {} bytes at {offset}: {e}", buf.len()));
    model[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
}

/// Reads the whole volume 1 MiB at a time and compares it with the model.
fn assert_reads_match(cache: &Cache, model: &[u8], what: &str) {
    let vol = &cache.volumes()[0];
    let mut buf = vec![0u8; MIB as usize];
    for (i, want) in model.chunks(MIB as usize).enumerate() {
        let at = i as u64 * MIB;
        vol.read(at, &mut buf[..want.len()])
            .unwrap_or_else(|e| panic!("{what}: read at {at}: {e}"));
        if let Some(bad) = (0..want.len()).find(|&j| buf[j] != want[j]) {
            panic!(
                "{what}: read differs from what was written at byte {}",
                at + bad as u64
            );
        }
    }
}

/// Byte extents (offset, length) of the maximal runs of consecutive sectors.
fn runs(sectors: &BTreeSet<u64>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &s in sectors {
        match out.last_mut() {
            Some((off, len)) if *off + *len == s * SECTOR => *len += SECTOR,
            _ => out.push((s * SECTOR, SECTOR)),
        }
    }
    out
}

fn writes_of(ops: &[Op]) -> Vec<(u64, u64)> {
    ops.iter()
        .filter_map(|op| match *op {
            Op::Write { offset, len } => Some((offset, len)),
            _ => None,
        })
        .collect()
}

/// Runs of adjacent sectors (first sector, count) written last to first; each crosses at
/// least one line boundary except the one that is exactly two whole lines.
const RUNS: [(u64, u64); 5] = [
    (100 * SECTORS_PER_LINE - 3, 6),
    (300 * SECTORS_PER_LINE + 5, 40),
    (500 * SECTORS_PER_LINE, 2 * SECTORS_PER_LINE),
    (700 * SECTORS_PER_LINE - 1, 2),
    (900 * SECTORS_PER_LINE + 15, 1 + SECTORS_PER_LINE),
];

/// Dirties 200 scattered 4 KiB sectors (random order) and the runs above (each in reverse
/// order); returns the dirty sectors.
fn dirty_scattered(cache: &Cache, model: &mut [u8], seed: u64) -> BTreeSet<u64> {
    let total = model.len() as u64 / SECTOR;
    let mut rng = Rng(seed);
    let mut dirty = BTreeSet::new();
    let mut tag = seed << 20;
    for _ in 0..200 {
        let s = rng.below(total);
        tag += 1;
        write(cache, model, s * SECTOR, &data(tag, SECTOR as usize));
        dirty.insert(s);
    }
    for (first, count) in RUNS {
        for s in (first..first + count).rev() {
            tag += 1;
            write(cache, model, s * SECTOR, &data(tag, SECTOR as usize));
            dirty.insert(s);
        }
    }
    dirty
}

/// One batch writes back every dirty sector: in ascending order with one writer, as exactly
/// the maximal runs of adjacent dirty sectors (merged across line boundaries, scattered ones
/// apart) with any depth.
fn sorted_and_merged(depth: usize) {
    const BACKING: u64 = 64 * MIB;
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let rec = Arc::new(RecordingDevice::new(mem.clone()));
    let (_cache_dev, cache, _) = open_wb(32 * MIB, rec.clone() as Arc<dyn BlockDevice>, LINE);
    let mut model = vec![0u8; BACKING as usize];
    let dirty = dirty_scattered(&cache, &mut model, 7 + depth as u64);
    assert!(
        writes_of(&rec.ops()).is_empty(),
        "write-back wrote to the backing device before any cleaning"
    );
    let vol = cache.volumes()[0].clone();
    assert_eq!(
        vol.stats().dirty_bytes,
        dirty.len() as u64 * SECTOR,
        "dirty bytes after the writes"
    );
    let dirty_lines = vol.stats().dirty_lines;
    assert_eq!(
        dirty_lines,
        dirty
            .iter()
            .map(|s| s / SECTORS_PER_LINE)
            .collect::<BTreeSet<_>>()
            .len() as u64
    );

    rec.clear();
    let report = cache
        .clean_batch(&CleanerConfig::default(), depth, Select::All)
        .expect("writeback batch");
    let ops = rec.ops();
    let writes = writes_of(&ops);
    let expected = runs(&dirty);
    assert!(
        expected.len() < dirty.len(),
        "the workload must contain adjacent sectors to merge"
    );
    if depth == 1 {
        assert!(
            writes.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
            "one writer must write back in strictly ascending order: {writes:?}"
        );
        assert_eq!(writes, expected, "backing writes of the batch");
    } else {
        let mut sorted = writes.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, expected, "backing writes of the batch (any order)");
    }
    let last_write = ops
        .iter()
        .rposition(|op| matches!(op, Op::Write { .. }))
        .expect("writes");
    assert!(
        ops[last_write..].contains(&Op::Flush),
        "the batch must flush the backing device after its writes: {ops:?}"
    );
    assert_eq!(report.writes, expected.len() as u64);
    assert_eq!(report.bytes_written, dirty.len() as u64 * SECTOR);
    assert_eq!(report.lines_cleaned, dirty_lines);
    assert_eq!((report.extents_failed, report.extents_skipped), (0, 0));
    assert_eq!(cache.dirty_bytes(), 0, "one batch covers every dirty line");
    assert!(
        mem.snapshot() == model,
        "backing differs from what was written"
    );
    assert_eq!(counter(&vol, "bytes_cleaned"), dirty.len() as u64 * SECTOR);

    rec.clear();
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(
        writes_of(&rec.ops()).is_empty(),
        "nothing left to write back after the batch"
    );
    // The cache still serves the data (now clean).
    assert_reads_match(&cache, &model, "after writeback");
}

#[test]
fn batch_is_sorted_and_merged_one_writer() {
    sorted_and_merged(1);
}

#[test]
fn batch_is_merged_with_many_writers() {
    sorted_and_merged(8);
}

/// Merged writes stop at `max_write`, and the pieces still cover the run exactly, in order.
#[test]
fn merged_writes_respect_max_write() {
    const BACKING: u64 = 16 * MIB;
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let rec = Arc::new(RecordingDevice::new(mem.clone()));
    let (_cache_dev, cache, _) = open_wb(32 * MIB, rec.clone() as Arc<dyn BlockDevice>, LINE);
    let mut model = vec![0u8; BACKING as usize];
    // 100 sectors from the middle of a line: 7 lines, written backwards.
    let first = 10 * SECTORS_PER_LINE + 5;
    for (i, s) in (first..first + 100).rev().enumerate() {
        write(
            &cache,
            &mut model,
            s * SECTOR,
            &data(i as u64 + 1, SECTOR as usize),
        );
    }
    rec.clear();
    let cfg = CleanerConfig {
        max_write: 128 << 10,
        ..CleanerConfig::default()
    };
    cache.clean_batch(&cfg, 1, Select::All).expect("batch");
    let writes = writes_of(&rec.ops());
    assert!(
        writes.iter().all(|&(_, len)| len <= cfg.max_write),
        "{writes:?}"
    );
    // Contiguous pieces, in order, covering exactly the run.
    let mut at = first * SECTOR;
    for &(off, len) in &writes {
        assert_eq!(off, at, "pieces must follow each other: {writes:?}");
        at += len;
    }
    assert_eq!(at, (first + 100) * SECTOR, "{writes:?}");
    // Merging still happens: far fewer writes than lines touched (7) or sectors (100).
    assert!(writes.len() <= 5, "{writes:?}");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(mem.snapshot() == model);
}

// ---------------------------------------------------------------------------------------
// Flush before clean: one log for both devices.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dev {
    Cache,
    Backing,
}

fn lock(log: &SharedOpLog) -> MutexGuard<'_, Vec<(u32, Op)>> {
    log.lock().unwrap_or_else(|p| p.into_inner())
}

fn flush_before_clean(depth: usize) {
    const BACKING: u64 = 16 * MIB;
    let log = SharedOpLog::default();
    let cache_mem = Arc::new(MemDevice::new("cache", 16 * MIB));
    let backing_mem = Arc::new(MemDevice::new("backing", BACKING));
    format_dev(&*cache_mem, LINE, CacheMode::WriteBack, BACKING, 0);
    let cache_dev: Arc<dyn BlockDevice> = Arc::new(RecordingDevice::sharing(
        cache_mem.clone() as Arc<dyn BlockDevice>,
        Dev::Cache as u32,
        log.clone(),
    ));
    let backing: Arc<dyn BlockDevice> = Arc::new(RecordingDevice::sharing(
        backing_mem.clone() as Arc<dyn BlockDevice>,
        Dev::Backing as u32,
        log.clone(),
    ));
    let (cache, _) = open_dyn(cache_dev, backing);
    let layout = cache.layout();
    let journal = layout.journal_offset..layout.journal_offset + layout.journal_len;
    let mut model = vec![0u8; BACKING as usize];
    // Whole lines, partial lines, and a run across a boundary.
    for (i, line) in [3u64, 4, 40, 41, 90, 200].into_iter().enumerate() {
        write(
            &cache,
            &mut model,
            line * LINE,
            &data(i as u64 + 1, LINE as usize),
        );
    }
    write(
        &cache,
        &mut model,
        120 * LINE + 8 * SECTOR,
        &data(50, 3 * SECTOR as usize),
    );
    write(
        &cache,
        &mut model,
        150 * LINE - 2 * SECTOR,
        &data(51, 4 * SECTOR as usize),
    );
    cache.volumes()[0].flush().expect("flush");
    let dirty_lines = cache.dirty_lines();
    assert!(dirty_lines >= 8);

    lock(&log).clear();
    let report = cache
        .clean_batch(&CleanerConfig::default(), depth, Select::All)
        .expect("batch");
    assert_eq!(report.lines_cleaned, dirty_lines);
    let ops = lock(&log).clone();
    let is = |i: usize, dev: Dev, f: &dyn Fn(&Op) -> bool| ops[i].0 == dev as u32 && f(&ops[i].1);
    let backing_writes: Vec<usize> = (0..ops.len())
        .filter(|&i| is(i, Dev::Backing, &|op| matches!(op, Op::Write { .. })))
        .collect();
    let journal_writes: Vec<usize> = (0..ops.len())
        .filter(|&i| {
            is(
                i,
                Dev::Cache,
                &|op| matches!(op, Op::Write { offset, .. } if journal.contains(offset)),
            )
        })
        .collect();
    let first_bw = *backing_writes
        .first()
        .expect("the batch wrote to the backing device");
    let last_bw = *backing_writes.last().expect("backing writes");
    let backing_flush = (first_bw..ops.len())
        .find(|&i| is(i, Dev::Backing, &|op| *op == Op::Flush))
        .unwrap_or_else(|| panic!("no backing flush after the batch's writes: {ops:?}"));
    assert!(
        last_bw < backing_flush,
        "every backing write of the batch must come before the backing flush: {ops:?}"
    );
    assert!(
        !journal_writes
            .iter()
            .any(|&j| (first_bw..=backing_flush).contains(&j)),
        "journal written between the first backing write and the backing flush: {ops:?}"
    );
    let first_jw = *journal_writes
        .iter()
        .find(|&&j| j > backing_flush)
        .unwrap_or_else(|| panic!("no journal write after the backing flush: {ops:?}"));
    assert!(
        journal_writes.iter().all(|&j| j > backing_flush),
        "a journal write before the backing flush: {ops:?}"
    );
    // The commit protocol: cache data flushed before the records, records flushed after.
    assert!(
        (backing_flush..first_jw).any(|i| is(i, Dev::Cache, &|op| *op == Op::Flush)),
        "no cache flush between the backing flush and the journal write: {ops:?}"
    );
    let last_jw = *journal_writes.last().expect("journal writes");
    assert!(
        (last_jw..ops.len()).any(|i| is(i, Dev::Cache, &|op| *op == Op::Flush)),
        "journal records not flushed: {ops:?}"
    );
    assert!(backing_mem.snapshot() == model);

    // What those journal records say: after a crash, nothing is dirty any more.
    drop(cache);
    let (cache, report) = open_dyn(cache_mem, backing_mem.clone());
    let recovery = report
        .recovery
        .expect("unclean stop: the journal is replayed");
    assert_eq!(
        (recovery.dirty_lines, recovery.dirty_bytes),
        (0, 0),
        "the batch's journal records must mark the written-back lines clean"
    );
    assert_reads_match(&cache, &model, "after crash following a batch");
}

#[test]
fn backing_flushed_before_journal_marks_clean_one_writer() {
    flush_before_clean(1);
}

#[test]
fn backing_flushed_before_journal_marks_clean_many_writers() {
    flush_before_clean(4);
}

// ---------------------------------------------------------------------------------------
// Recovery.

/// Dirties lines of several shapes; returns nothing, the model holds the data.
fn dirty_some(cache: &Cache, model: &mut [u8]) {
    for (i, line) in [0u64, 1, 2, 17, 64].into_iter().enumerate() {
        write(
            cache,
            model,
            line * LINE,
            &data(100 + i as u64, LINE as usize),
        );
    }
    // Partial lines and one write across a boundary.
    write(
        cache,
        model,
        30 * LINE + 4 * SECTOR,
        &data(200, SECTOR as usize),
    );
    write(
        cache,
        model,
        31 * LINE + 15 * SECTOR,
        &data(201, 3 * SECTOR as usize),
    );
    write(
        cache,
        model,
        80 * LINE + 9 * SECTOR,
        &data(202, 2 * SECTOR as usize),
    );
    // A rewrite of part of a dirty line.
    write(cache, model, LINE + 2 * SECTOR, &data(203, SECTOR as usize));
}

#[test]
fn crash_recovers_and_reports_dirty_data() {
    const BACKING: u64 = 16 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let (cache_dev, cache, _) = open_wb(16 * MIB, backing.clone(), LINE);
    let mut model = vec![0u8; BACKING as usize];
    dirty_some(&cache, &mut model);
    cache.volumes()[0].flush().expect("flush");
    let before = cache.volumes()[0].stats();
    assert_eq!(before.dirty_lines, 9);
    assert_eq!(before.dirty_bytes, (5 * 16 + 1 + 3 + 2) * SECTOR);
    assert!(
        backing.snapshot().iter().all(|&b| b == 0),
        "write-back data reached the backing device before any cleaning"
    );
    // Crash: no shutdown.
    drop(cache);

    let (cache, report) = open_dyn(cache_dev.clone(), backing.clone());
    let recovery = report
        .recovery
        .clone()
        .expect("recovery report after a crash");
    assert_eq!(recovery.dirty_lines, before.dirty_lines, "{report:?}");
    assert_eq!(recovery.dirty_bytes, before.dirty_bytes, "{report:?}");
    assert!(
        recovery.commits >= 1 && recovery.journal_blocks >= 1,
        "{report:?}"
    );
    assert!(report.warm);
    let after = cache.volumes()[0].stats();
    assert_eq!(
        (after.dirty_lines, after.dirty_bytes),
        (before.dirty_lines, before.dirty_bytes)
    );
    assert_reads_match(&cache, &model, "after recovery");
    assert!(backing.snapshot().iter().all(|&b| b == 0));

    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(
        backing.snapshot() == model,
        "drain must write the recovered data back"
    );
    // A second crash after the drain recovers nothing dirty and still reads right.
    drop(cache);
    let (cache, report) = open_dyn(cache_dev, backing);
    let recovery = report.recovery.expect("recovery report");
    assert_eq!((recovery.dirty_lines, recovery.dirty_bytes), (0, 0));
    assert_reads_match(&cache, &model, "after a second crash");
}

/// Like the above with a real power cut: whatever the unflushed writes of either device do,
/// flushed dirty data comes back.
#[test]
fn power_cut_after_flush_keeps_dirty_data() {
    const BACKING: u64 = 16 * MIB;
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    cache_dev.flush().expect("flush format");
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let mut model = vec![0u8; BACKING as usize];
    dirty_some(&cache, &mut model);
    cache.volumes()[0].flush().expect("flush");
    let before = cache.volumes()[0].stats();
    for seed in 0..8 {
        let c = Arc::new(cache_dev.crashed("cache", seed));
        let b = Arc::new(backing.crashed("backing", seed ^ 0xAB));
        let (after, report) = open_dyn(c, b.clone());
        let recovery = report.recovery.expect("recovery report");
        assert_eq!(
            (recovery.dirty_lines, recovery.dirty_bytes),
            (before.dirty_lines, before.dirty_bytes),
            "seed {seed}"
        );
        assert_reads_match(&after, &model, &format!("power cut, seed {seed}"));
        after
            .drain(&CleanerConfig::default(), &mut |_| true)
            .expect("drain");
        assert!(
            b.written_image() == model,
            "seed {seed}: backing after drain"
        );
    }
}

// ---------------------------------------------------------------------------------------
// A cache full of dirty data.

#[test]
fn full_cache_of_dirty_data_still_takes_writes() {
    const BACKING: u64 = 64 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let (_cache_dev, cache, _) = open_wb(16 * MIB, backing.clone(), LINE);
    // No dirty limit: every line may be dirty, so writes find no line at all.
    cache.set_dirty_limit(1.0);
    let vol = cache.volumes()[0].clone();
    let line_count = cache.layout().line_count;
    let backing_lines = BACKING / LINE;
    assert!(backing_lines > 2 * line_count + 8);
    let mut model = vec![0u8; BACKING as usize];
    let mut rng = Rng(42);
    let mut slowest = Duration::ZERO;
    let mut timed_write = |model: &mut [u8], offset: u64, buf: &[u8]| {
        let t = Instant::now();
        write(&cache, model, offset, buf);
        slowest = slowest.max(t.elapsed());
    };
    let mut tag = 0u64;
    // Twice as many distinct lines as the cache has, in random order, 16 KiB each somewhere in
    // the line; every 8th write crosses into the next line.
    let order = rng.shuffled(2 * line_count + 4);
    for (i, &line) in order.iter().enumerate() {
        tag += 1;
        if i % 8 == 7 {
            let at = (line + 1) * LINE - 2 * SECTOR;
            timed_write(&mut model, at, &data(tag, 4 * SECTOR as usize));
        } else {
            let at = line * LINE + rng.below(SECTORS_PER_LINE - 3) * SECTOR;
            timed_write(&mut model, at, &data(tag, 4 * SECTOR as usize));
        }
    }
    let stats = vol.stats();
    assert_eq!(
        stats.dirty_lines, line_count,
        "every line of the cache should be dirty"
    );
    let around = counter(&vol, "bytes_written_around_full");
    assert!(
        around > 0,
        "writes past a full cache must go to the backing device"
    );
    // Rewrites: of lines that are dirty in the cache and of lines that went around it, plus
    // fresh lines beyond.
    for _ in 0..200 {
        tag += 1;
        let line = order[rng.below(order.len() as u64) as usize];
        let at = line * LINE + rng.below(SECTORS_PER_LINE) * SECTOR;
        timed_write(&mut model, at, &data(tag, SECTOR as usize));
    }
    for line in 2 * line_count + 8..2 * line_count + 40 {
        tag += 1;
        timed_write(&mut model, line * LINE, &data(tag, LINE as usize));
    }
    assert!(counter(&vol, "bytes_written_around_full") > around);
    assert!(
        slowest < Duration::from_secs(1),
        "a write into a full dirty cache took {slowest:?}"
    );
    assert_eq!(vol.state(), VolumeState::Healthy);
    assert_reads_match(&cache, &model, "full dirty cache");
    vol.flush().expect("flush");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(
        backing.snapshot() == model,
        "data lost in a full dirty cache"
    );
    // The cache is usable again: new writes are cached, none go around it.
    let around = counter(&vol, "bytes_written_around_full");
    for line in 0..16 {
        tag += 1;
        write(&cache, &mut model, line * LINE, &data(tag, SECTOR as usize));
    }
    assert_eq!(counter(&vol, "bytes_written_around_full"), around);
    assert_eq!(vol.stats().dirty_lines, 16);
    assert_reads_match(&cache, &model, "after draining a full cache");
}

/// Past the dirty limit, writes to lines without dirty data go to the backing device (lines
/// cached clean are dropped), overwrites of dirty lines are still absorbed, clean lines stay
/// available for read misses, and nothing is lost.
#[test]
fn writes_past_the_dirty_limit_go_around_and_overwrites_are_absorbed() {
    const BACKING: u64 = 64 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let (_cache_dev, cache, _) = open_wb(16 * MIB, backing.clone(), LINE);
    cache.set_dirty_limit(0.5);
    let vol = cache.volumes()[0].clone();
    let line_count = cache.layout().line_count;
    let limit = cache.dirty_limit_lines();
    assert_eq!(limit, line_count / 2);
    let mut model = vec![0u8; BACKING as usize];
    let mut tag = 0u64;
    let mut rng = Rng(7);
    for line in 0..line_count {
        tag += 1;
        write(&cache, &mut model, line * LINE, &data(tag, SECTOR as usize));
    }
    assert_eq!(
        vol.stats().dirty_lines,
        limit,
        "dirty lines stop at the limit"
    );
    let around = counter(&vol, "bytes_written_around_full");
    assert_eq!(around, (line_count - limit) * SECTOR);
    // Overwrites of dirty lines are absorbed: nothing more goes around.
    let hits = counter(&vol, "write_hits");
    for _ in 0..100 {
        tag += 1;
        let line = rng.below(limit);
        let at = line * LINE + rng.below(SECTORS_PER_LINE) * SECTOR;
        write(&cache, &mut model, at, &data(tag, SECTOR as usize));
    }
    assert_eq!(counter(&vol, "bytes_written_around_full"), around);
    assert_eq!(counter(&vol, "write_hits"), hits + 100);
    assert_eq!(vol.stats().dirty_lines, limit);
    // Read misses still get lines: the clean ones are there for them.
    let mut buf = vec![0u8; LINE as usize];
    for line in 2 * line_count..2 * line_count + 8 {
        vol.read(line * LINE, &mut buf).expect("read");
    }
    assert!(vol.stats().lines_used > limit, "read misses were cached");
    // A write to a line cached clean goes around and drops the cached copy.
    tag += 1;
    write(
        &cache,
        &mut model,
        2 * line_count * LINE,
        &data(tag, SECTOR as usize),
    );
    assert_eq!(vol.stats().dirty_lines, limit);
    assert_reads_match(&cache, &model, "past the dirty limit");
    // Raised, the limit lets new lines become dirty again.
    cache.set_dirty_limit(1.0);
    tag += 1;
    write(
        &cache,
        &mut model,
        (3 * line_count) * LINE,
        &data(tag, SECTOR as usize),
    );
    assert_eq!(vol.stats().dirty_lines, limit + 1);
    vol.flush().expect("flush");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert!(
        backing.snapshot() == model,
        "data lost past the dirty limit"
    );
}

/// Under dirty pressure the cleaner writes back the least recently used dirty lines first,
/// in address order, and leaves the hot ones dirty.
#[test]
fn under_dirty_pressure_the_coldest_dirty_lines_are_written_back_first() {
    const BACKING: u64 = 64 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let (_cache_dev, cache, _) = open_wb(16 * MIB, backing.clone(), LINE);
    cache.set_dirty_limit(1.0);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; BACKING as usize];
    // Lines 0..64 dirty; then the even ones written again (hot).
    for line in 0..64u64 {
        write(
            &cache,
            &mut model,
            line * LINE,
            &data(line + 1, SECTOR as usize),
        );
    }
    for line in (0..64u64).step_by(2) {
        write(
            &cache,
            &mut model,
            line * LINE + SECTOR,
            &data(line + 100, SECTOR as usize),
        );
    }
    let cfg = CleanerConfig {
        batch_lines: 32,
        ..CleanerConfig::default()
    };
    let report = cache.clean_batch(&cfg, 4, Select::Coldest).expect("batch");
    assert_eq!(report.lines_cleaned, 32);
    // The odd lines (cold) were written back, as 32 single-line writes in address order.
    let mut buf = vec![0u8; SECTOR as usize];
    for line in 0..64u64 {
        backing
            .read_at(&mut buf, line * LINE)
            .expect("read backing");
        let written_back = buf[..] == data(line + 1, SECTOR as usize)[..];
        assert_eq!(written_back, line % 2 == 1, "line {line}");
    }
    assert_eq!(vol.stats().dirty_lines, 32);
    assert_reads_match(&cache, &model, "after a coldest-first batch");
}

// ---------------------------------------------------------------------------------------
// Leaving write-back.

#[test]
fn leaving_write_back_drains_first() {
    const BACKING: u64 = 16 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let (cache_dev, cache, _) = open_wb(16 * MIB, backing.clone(), LINE);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; BACKING as usize];
    dirty_some(&cache, &mut model);
    let dirty = cache.dirty_bytes();
    assert!(dirty > 0);
    let cfg = CleanerConfig {
        batch_lines: 2,
        ..CleanerConfig::default()
    };

    // Interrupted: nothing changes mode, the dirty data stays.
    let err = cache.set_mode(0, CacheMode::WriteThrough, &cfg, &mut |_| false);
    assert!(err.is_err(), "an interrupted mode change must fail");
    assert_eq!(vol.configured_mode(), CacheMode::WriteBack);
    assert_eq!(vol.mode(), CacheMode::WriteBack);
    assert_eq!(cache.dirty_bytes(), dirty);

    let mut reports = Vec::new();
    cache
        .set_mode(0, CacheMode::WriteThrough, &cfg, &mut |left| {
            reports.push(left);
            true
        })
        .expect("set mode");
    assert_eq!(cache.dirty_bytes(), 0);
    assert_eq!(vol.stats().dirty_lines, 0);
    assert!(
        backing.snapshot() == model,
        "leaving write-back must write the data back"
    );
    assert_eq!(vol.configured_mode(), CacheMode::WriteThrough);
    assert_eq!(vol.stats().mode, CacheMode::WriteThrough);
    assert_eq!(
        reports.first(),
        Some(&dirty),
        "progress starts at the dirty total"
    );
    // The first reports repeat the total while the dirty data is checked against its
    // checksums; then every batch lowers it.
    assert!(
        reports.windows(2).all(|w| w[1] <= w[0]) && reports.last() < reports.first(),
        "progress must go down: {reports:?}"
    );
    assert!(
        reports.len() > 2,
        "small batches report progress: {reports:?}"
    );

    // Write-through now: a write reaches the backing device at once and nothing is dirty.
    write(&cache, &mut model, 5 * LINE, &data(999, LINE as usize));
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(backing.snapshot() == model);
    assert_reads_match(&cache, &model, "after leaving write-back");
    // The mode is kept across a restart.
    cache.shutdown().expect("shutdown");
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_dev, backing);
    assert_eq!(
        cache.volumes()[0].configured_mode(),
        CacheMode::WriteThrough
    );
}

// ---------------------------------------------------------------------------------------
// FUA writes that go around the cache must not be undone by the journal.

/// A sequential stream past the cutoff bypasses the cache; a FUA write of it over a sector
/// the journal durably records dirty drops the cached copy in memory only. After a crash the
/// journal's old record must not bring the old data back over the acknowledged FUA write.
#[test]
fn fua_write_around_dirty_sector_survives_crash() {
    const BACKING: u64 = 16 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(
        &*cache_dev,
        LINE,
        CacheMode::WriteBack,
        BACKING,
        common::TEST_CUTOFF,
    );
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let target = 40 * LINE;
    vol.write(target, &data(1, SECTOR as usize), false)
        .expect("dirty write");
    vol.flush().expect("flush");
    // Restart, so the stream detector does not take the stream below for a continuation of
    // this write; the new journal generation records the sector dirty.
    cache.shutdown().expect("shutdown");
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    assert_eq!(vol.stats().dirty_lines, 1);
    // A stream of whole lines up to the target line; the target's request is FUA.
    let first = 40 - common::TEST_CUTOFF / LINE - 2;
    let mut bypassed = false;
    for line in first..=40 {
        let before = counter(&vol, "bytes_bypassed");
        vol.write(line * LINE, &data(100 + line, LINE as usize), line == 40)
            .expect("stream write");
        bypassed = counter(&vol, "bytes_bypassed") > before;
    }
    assert!(
        bypassed,
        "the last request of the stream must bypass the cache"
    );
    let want = data(140, LINE as usize);
    let mut buf = vec![0u8; LINE as usize];
    vol.read(target, &mut buf).expect("read");
    assert!(buf == want, "live read after the FUA write");
    // Crash: no flush, no shutdown. The FUA write was acknowledged, so it must survive.
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_dev, backing);
    cache.volumes()[0].read(target, &mut buf).expect("read");
    let old = buf[..SECTOR as usize] == data(1, SECTOR as usize)[..];
    assert!(
        buf[..SECTOR as usize] == want[..SECTOR as usize],
        "after the crash the sector reads as {}, not the acknowledged FUA write",
        if old {
            "the old dirty copy"
        } else {
            "something else"
        }
    );
}
