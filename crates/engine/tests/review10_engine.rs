//! Tenth adversarial review of the data path (issue #11), against c28987e (the engine core of
//! f258d6d: `Residency`, the dirty limit, `Select::Coldest`, the dirty-only read overlay).
//!
//! R10-1 (its test fails against c28987e): under dirty pressure the cleaner takes the coldest
//! dirty lines (`Select::Coldest`) and has no cursor, so lines it cannot write back (a cache
//! region it cannot read, a backing range that refuses writes) stay the coldest and fill every
//! batch again: once a batch's worth of them sit at the cold end, no other dirty line is ever
//! written back while the dirty share stays above the low watermark. With a failing cache
//! device (the volume is `cache-failed`) the readable dirty data, the only copy of it, stays
//! in the cache that is failing. The address-ordered sweep (`Select::All`) moves its cursor
//! past a failed extent and would have written the rest.
//!
//! The devices are `CrashDevice`s; the unreadable region is one the device model allows
//! (`fail_reads_in`: a worn-out area of flash).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{data, setup_crash};
use ssdcache_engine::{CleanerConfig, Select};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SECTOR: usize = 4096;

/// A write-back cache whose `unreadable` coldest dirty lines sit in a cache region that cannot
/// be read, with `dirty` dirty lines in all (one sector each, written in line order, so line 0
/// is the coldest). Returns the devices, the cache and its line count.
fn cold_lines_unreadable(
    dirty_share: f64,
    unreadable: u64,
) -> (
    Arc<ssdcache_devsim::CrashDevice>,
    Arc<ssdcache_devsim::CrashDevice>,
    Arc<ssdcache_engine::Cache>,
    u64,
) {
    let (cache_dev, backing, cache) = setup_crash(32 << 20, 64 << 20, LINE, CacheMode::WriteBack);
    cache.set_dirty_limit(1.0);
    let layout = cache.layout();
    let line_count = layout.line_count;
    let dirty = (line_count as f64 * dirty_share) as u64;
    let vol = cache.volumes()[0].clone();
    for line in 0..dirty {
        vol.write(line * LINE, &data(line + 1, SECTOR), false)
            .expect("write-back write");
    }
    vol.flush().expect("flush");
    assert_eq!(vol.stats().dirty_lines, dirty);
    // An empty cache hands out its lowest slots first: line i is in slot i.
    let region = layout.slot_offset(0)..layout.slot_offset(unreadable);
    cache_dev.fail_reads_in(Some(region));
    (cache_dev, backing, Arc::new(cache), line_count)
}

/// R10-1: 32 unreadable lines at the cold end (one busy batch, `busy_batch_lines` = 32 by
/// default) and 90% of the cache dirty. The cleaner runs for up to 10 seconds; the readable
/// dirty lines must be written back down to the low watermark. Against c28987e not one is:
/// every batch is the same 32 unreadable lines.
#[test]
fn r10_1_unreadable_cold_lines_stall_cleaning_under_dirty_pressure() {
    let (_cache_dev, backing, cache, line_count) = cold_lines_unreadable(0.9, 32);
    let cfg = CleanerConfig {
        busy_pause: Duration::from_millis(1),
        batch_lines: 32,
        busy_batch_lines: 32,
        ..CleanerConfig::default()
    };
    let low_lines = (line_count as f64 * cfg.low_watermark).ceil() as u64;
    let vol = cache.volumes()[0].clone();
    let dirty_before = vol.stats().dirty_lines;
    cache.start_cleaner(cfg);
    let deadline = Instant::now() + Duration::from_secs(10);
    while vol.stats().dirty_lines > low_lines && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    cache.stop_cleaner();
    let dirty_after = vol.stats().dirty_lines;
    // The readable lines that were written back hold their data on the backing device.
    let mut written_back = 0;
    let mut buf = vec![0u8; SECTOR];
    for line in 32..dirty_before {
        ssdcache_device::BlockDevice::read_at(&*backing, &mut buf, line * LINE).expect("read");
        written_back += u64::from(buf == data(line + 1, SECTOR));
    }
    assert!(
        dirty_after <= low_lines,
        "{dirty_before} dirty lines of {line_count}, 32 of them unreadable: after 10 s of \
         cleaning {dirty_after} are still dirty (low watermark {low_lines} lines), {written_back} \
         readable lines written back; volume state {:?}. Select::Coldest picks the same 32 \
         unreadable lines for every batch",
        vol.stats().state
    );
}

/// The same stall, one batch at a time: 20 `Select::Coldest` batches wrote back nothing (the
/// same 32 unreadable lines every time), while the address-ordered sweep from the same state
/// wrote back readable lines. Fixed: lines not written back go to the warm end of the dirty
/// queue, and every readable line is written back.
#[test]
fn r10_1_coldest_batches_repeat_the_same_failed_lines() {
    let (_cache_dev, _backing, cache, _) = cold_lines_unreadable(0.9, 32);
    let cfg = CleanerConfig {
        batch_lines: 32,
        ..CleanerConfig::default()
    };
    let vol = cache.volumes()[0].clone();
    let dirty_before = vol.stats().dirty_lines;
    let mut cleaned = 0;
    let mut failed = 0;
    for _ in 0..20 {
        let r = cache.clean_batch(&cfg, 4, Select::Coldest).expect("batch");
        cleaned += r.lines_cleaned;
        failed += r.extents_failed;
    }
    assert!(
        cleaned > 0,
        "20 coldest-first batches over {dirty_before} dirty lines (32 unreadable) wrote back \
         nothing: {failed} extents failed, every one of them the same 32 lines"
    );
    assert_eq!(
        vol.stats().dirty_lines,
        32,
        "every readable dirty line was written back ({cleaned} cleaned, {failed} extents failed)"
    );
}
