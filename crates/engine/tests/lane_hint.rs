//! `Volume::likely_served_from_cache`, the hint the NBD server picks a worker lane with
//! (issue #11): true only for reads whose every sector is cached and for write-back writes.

mod common;

use std::sync::Arc;

use common::{format_dev, open_dyn, MIB};
use ssdcache_devsim::MemDevice;
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SECTOR: u64 = 4096;
const BACKING: u64 = 64 * MIB;

fn volume(mode: CacheMode) -> (ssdcache_engine::Cache, Arc<ssdcache_engine::Volume>) {
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let cache_dev = Arc::new(MemDevice::new("cache", 32 * MIB));
    format_dev(&*cache_dev, LINE, mode, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, backing);
    let volume = cache.volumes()[0].clone();
    (cache, volume)
}

#[test]
fn reads_are_fast_only_when_every_sector_is_cached() {
    let (_cache, vol) = volume(CacheMode::WriteThrough);
    assert!(!vol.likely_served_from_cache(false, 0, SECTOR), "cold");
    let mut line = vec![0u8; LINE as usize];
    vol.read(0, &mut line).expect("read line 0 into the cache");
    assert!(vol.likely_served_from_cache(false, 0, SECTOR));
    assert!(
        vol.likely_served_from_cache(false, 0, LINE),
        "the whole line"
    );
    assert!(
        !vol.likely_served_from_cache(false, LINE - SECTOR, 2 * SECTOR),
        "one sector in the next, uncached line"
    );
    assert!(!vol.likely_served_from_cache(false, 0, 0), "empty");
    assert!(
        !vol.likely_served_from_cache(false, BACKING - SECTOR, 2 * SECTOR),
        "past the end"
    );
    assert!(!vol.likely_served_from_cache(false, u64::MAX - SECTOR, 2 * SECTOR));
}

#[test]
fn only_write_back_writes_are_fast() {
    let (_cache, through) = volume(CacheMode::WriteThrough);
    let mut line = vec![0u8; LINE as usize];
    through
        .read(0, &mut line)
        .expect("read line 0 into the cache");
    assert!(
        !through.likely_served_from_cache(true, 0, SECTOR),
        "a write-through write waits for the backing device, cached line or not"
    );
    let (_cache, back) = volume(CacheMode::WriteBack);
    assert!(back.likely_served_from_cache(true, 0, SECTOR));
    assert!(
        !back.likely_served_from_cache(true, BACKING, SECTOR),
        "past the end"
    );
    let (_cache, around) = volume(CacheMode::WriteAround);
    assert!(!around.likely_served_from_cache(true, 0, SECTOR));
}

/// At the dirty limit a write-back write to a line without dirty data goes to the backing
/// device, so the hint sends it to the slow lane (on a fast worker it would hold a worker a
/// hit may need for a disk write); an overwrite of a dirty line is still absorbed: fast.
#[test]
fn write_back_writes_at_the_dirty_limit_are_slow_unless_they_overwrite_dirty_lines() {
    let (cache, vol) = volume(CacheMode::WriteBack);
    let limit = cache.dirty_limit_lines();
    assert!(
        limit >= 2,
        "the test needs a limit of a few lines, got {limit}"
    );
    for line in 0..limit {
        assert!(
            vol.likely_served_from_cache(true, line * LINE, SECTOR),
            "below the limit (line {line})"
        );
        vol.write(line * LINE, &common::data(line + 1, SECTOR as usize), false)
            .expect("write-back write");
    }
    assert_eq!(cache.dirty_lines(), limit, "every write dirtied a line");
    assert!(
        vol.likely_served_from_cache(true, SECTOR, SECTOR),
        "an overwrite of a dirty line is absorbed at the limit"
    );
    assert!(
        !vol.likely_served_from_cache(true, limit * LINE, SECTOR),
        "a write to a line without dirty data goes around at the limit"
    );
    assert!(
        !vol.likely_served_from_cache(true, (limit - 1) * LINE, 2 * LINE),
        "a write reaching past the last dirty line goes around in part"
    );
}
