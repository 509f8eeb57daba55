//! Failures the review tests (review6–8) stage on a crash cache: a failing controller under both
//! devices, an unreadable cache device during a check, a damaged cache sector.

use std::sync::Arc;

use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{Cache, CleanerConfig};

const SECTOR: usize = 4096;

/// Line 0 written with `flushed` and FLUSHed (dirty in the cache, durable), over a backing
/// device holding `oldest`. Returns the devices, the cache and line 0's slot offset.
pub fn dirty_flushed_line_0(
    flushed: &[u8],
    oldest: &[u8],
) -> (Arc<CrashDevice>, Arc<CrashDevice>, Cache, u64) {
    let (cache_dev, backing, cache) = super::crash_cache();
    backing.write_at(oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    vol.write(0, flushed, false).unwrap();
    vol.flush().expect("line 0 durable, dirty in the cache");
    let slot = slot_holding(&cache_dev, flushed);
    (cache_dev, backing, cache, slot)
}

/// One failing controller under both devices (as in R5-1): a write of `failed` at `offset`
/// fails on the cache device and on the backing device, and so does the cache read-back that
/// follows; then the link comes back.
pub fn fail_everywhere(
    cache_dev: &CrashDevice,
    backing: &CrashDevice,
    cache: &Cache,
    offset: u64,
    failed: &[u8],
) {
    cache_dev.fail_writes(true);
    cache_dev.fail_reads(true);
    backing.fail_writes(true);
    let r = cache.volumes()[0].write(offset, failed, false);
    cache_dev.fail_writes(false);
    cache_dev.fail_reads(false);
    backing.fail_writes(false);
    assert!(r.is_err(), "the write fails on both devices");
}

/// A check of every dirty sector (`drain` runs `verify_dirty` first, as offline `flush`,
/// `detach` and `recover` do) while the cache device cannot be read (the same failing link),
/// then the link comes back. Every dirty sector is counted damaged (unreadable).
pub fn check_while_unreadable(cache_dev: &CrashDevice, cache: &Cache) {
    cache_dev.fail_reads(true);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    cache_dev.fail_reads(false);
    assert!(
        drained.is_err(),
        "nothing is written back while the cache device cannot be read"
    );
    assert!(
        !cache.damaged_ranges().is_empty(),
        "the check counts the unreadable dirty sectors as damaged"
    );
}

/// Damages one 4 KiB sector of a slot on the cache device with bytes that are not zeroes (bit
/// rot, a misdirected write: what the data checksums exist to catch, §4.8).
pub fn damage_sector(cache_dev: &CrashDevice, slot: u64, sector: usize) -> Vec<u8> {
    let garbage = super::data(0xbad, SECTOR);
    cache_dev
        .write_at(&garbage, slot + (sector * SECTOR) as u64)
        .unwrap();
    garbage
}

/// The line-sized, line-aligned region of the cache device that holds exactly `line`.
pub fn slot_holding(cache_dev: &CrashDevice, line: &[u8]) -> u64 {
    let image = cache_dev.written_image();
    let len = line.len();
    (0..image.len() / len)
        .map(|i| i * len)
        .find(|&at| image[at..at + len] == *line)
        .expect("the line's slot on the cache device") as u64
}

/// Sector `sector` (4 KiB) of `buf`.
pub fn sector_of(buf: &[u8], sector: usize) -> &[u8] {
    &buf[sector * SECTOR..(sector + 1) * SECTOR]
}
