//! The cleaner's address-ordered sweep works from a snapshot of the dirty lines taken when it
//! starts: lines dirtied, rewritten or dropped while it runs must neither be recorded clean
//! with data the backing device lacks nor keep a drain from ending with every line written
//! back.

mod common;

use std::sync::Arc;

use common::{data, format_dev, open_dyn, MIB};
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{Cache, CleanerConfig, Select};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
const BACKING: u64 = 64 * MIB;

fn open_wb() -> (Arc<MemDevice>, Cache) {
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, backing.clone());
    cache.set_dirty_limit(1.0);
    (backing, cache)
}

fn write(cache: &Cache, model: &mut [u8], offset: u64, buf: &[u8]) {
    cache.volumes()[0]
        .write(offset, buf, false)
        .unwrap_or_else(|e| panic!("write of {} bytes at {offset}: {e}", buf.len()));
    model[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
}

/// A sweep is begun (its first batch takes 8 of 64 dirty lines); then lines are dirtied
/// behind and ahead of it, lines it has yet to reach are written again or dropped (TRIM),
/// and a dropped line's slot goes to a new dirty line. The sweep's batches go on; then a
/// drain must end with no dirty line left and the backing device holding exactly what was
/// written, and no batch may record clean a sector whose newest data the disk lacks.
#[test]
fn a_sweep_begun_before_new_writes_still_drains_everything() {
    let (backing, cache) = open_wb();
    let mut model = vec![0u8; BACKING as usize];
    let mut tag = 0u64;
    let mut next = |len: u64| {
        tag += 1;
        data(tag, len as usize)
    };
    for line in (0..128).step_by(2) {
        write(&cache, &mut model, line * LINE, &next(SECTOR));
    }
    let cfg = CleanerConfig {
        batch_lines: 8,
        ..CleanerConfig::default()
    };
    let first = cache
        .clean_batch(&cfg, 4, Select::All)
        .expect("first batch");
    assert_eq!(first.lines_cleaned, 8);
    assert_eq!(cache.dirty_lines(), 56);
    // Behind the sweep, ahead of it, rewrites of lines it has not reached, a line dropped
    // (its slot free for the next new line) and lines past every line it knows.
    write(&cache, &mut model, LINE + 3 * SECTOR, &next(2 * SECTOR));
    write(&cache, &mut model, 61 * LINE, &next(SECTOR));
    write(&cache, &mut model, 100 * LINE + 5 * SECTOR, &next(SECTOR));
    write(&cache, &mut model, 102 * LINE, &next(SECTOR));
    cache.volumes()[0]
        .trim(90 * LINE, LINE, false)
        .expect("trim of a dirty line");
    model[(90 * LINE) as usize..(91 * LINE) as usize].fill(0);
    write(&cache, &mut model, 200 * LINE + SECTOR, &next(SECTOR));
    write(&cache, &mut model, 300 * LINE, &next(LINE));
    // The sweep goes on through its snapshot; each batch cleans what the disk now has.
    for _ in 0..3 {
        cache.clean_batch(&cfg, 4, Select::All).expect("batch");
    }
    for (line, what) in [(100, "rewritten ahead"), (102, "rewritten ahead")] {
        let at = (line * LINE) as usize;
        let cached = common::read_vec(&cache, line * LINE, LINE).expect("read");
        assert_eq!(
            cached,
            model[at..at + LINE as usize],
            "line {line} ({what})"
        );
    }
    cache
        .drain(&cfg, &mut |_| true)
        .expect("drain after new writes");
    assert_eq!(
        cache.dirty_lines(),
        0,
        "a drain ended with dirty lines left"
    );
    assert_eq!(cache.dirty_bytes(), 0);
    // Trimmed data is not read back from the disk, so compare all but the trimmed line.
    let disk = backing.snapshot();
    let trimmed = (90 * LINE) as usize..(91 * LINE) as usize;
    for (i, (got, want)) in disk.iter().zip(&model).enumerate() {
        if !trimmed.contains(&i) && got != want {
            panic!(
                "backing byte {i} differs from what was written (line {})",
                i as u64 / LINE
            );
        }
    }
}

/// Batches of the sweep, with nothing written meanwhile, take every dirty line once and in
/// address order: 64 lines in batches of 8 are 8 batches, then nothing is dirty.
#[test]
fn a_sweep_takes_each_dirty_line_once_in_address_order() {
    let (backing, cache) = open_wb();
    let mut model = vec![0u8; BACKING as usize];
    for (i, line) in (0..64u64).map(|i| (i * 37) % 64).enumerate() {
        write(
            &cache,
            &mut model,
            line * 3 * LINE,
            &data(i as u64 + 1, SECTOR as usize),
        );
    }
    let cfg = CleanerConfig {
        batch_lines: 8,
        ..CleanerConfig::default()
    };
    for batch in 0..8u64 {
        let report = cache.clean_batch(&cfg, 1, Select::All).expect("batch");
        assert_eq!(report.lines_cleaned, 8, "batch {batch}");
        assert_eq!(cache.dirty_lines(), 64 - 8 * (batch + 1));
        let disk = backing.snapshot();
        // The batch wrote the next 8 lines in address order and nothing beyond them.
        for line in 0..64u64 {
            let at = (line * 3 * LINE) as usize;
            let written = disk[at..at + SECTOR as usize] == model[at..at + SECTOR as usize];
            assert_eq!(
                written,
                line < 8 * (batch + 1),
                "line {line} after batch {batch}"
            );
        }
    }
    let idle = cache.clean_batch(&cfg, 1, Select::All).expect("batch");
    assert_eq!(idle.lines_cleaned, 0);
}
