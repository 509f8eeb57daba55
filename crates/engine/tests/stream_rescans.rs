//! Streams read again (a nightly backup): every pass after the first must cache nothing more
//! of them. The stream detector counts a stream's cached head, served by hits, so the stream
//! is past its cutoff when it reaches data the cache does not hold. Review 24 wrote these
//! against a change that took hits off the detector's lock by recording a hit only near a
//! stream already tracked (14c6326, reverted): each pass then cached one more cutoff of every
//! stream (MiB cached per pass [4, 4, 4, 4, 4] instead of [4, 0, 0, 0, 0]; eight 16 MiB
//! extents were all cached after four nights). Any later attempt must keep them passing.

mod common;

use std::sync::Arc;

use common::{counter, format_dev, open_dyn, MIB};
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{Cache, Volume};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;

fn scan(vol: &Volume, from: u64, to: u64, chunk: usize) {
    let mut buf = vec![0u8; chunk];
    let mut at = from;
    while at < to {
        vol.read(at, &mut buf).expect("scan read");
        at += chunk as u64;
    }
}

/// A write-through cache of `cache_size` over `backing_size`, 4 MiB sequential cutoff.
fn write_through(backing_size: u64, cache_size: u64) -> (Cache, Arc<Volume>) {
    let backing = Arc::new(MemDevice::new("backing", backing_size));
    let cache_dev = Arc::new(MemDevice::new("cache", cache_size));
    format_dev(
        &*cache_dev,
        LINE,
        CacheMode::WriteThrough,
        backing_size,
        4 * MIB,
    );
    let (cache, _) = open_dyn(cache_dev, backing);
    let vol = cache.volumes()[0].clone();
    (cache, vol)
}

/// A backup read again and again (nightly): each pass should not cache more of it. Prints
/// what each pass put in the cache.
#[test]
fn a_stream_read_again_caches_nothing_more() {
    let (_cache, vol) = write_through(MIB * 256, MIB * 128);
    let mut per_pass = Vec::new();
    for _ in 0..5 {
        let before = counter(&vol, "bytes_to_cache");
        scan(&vol, 0, 48 * MIB, 256 << 10);
        per_pass.push((counter(&vol, "bytes_to_cache") - before) / MIB);
    }
    println!(
        "repeated scans: MiB cached per pass {per_pass:?}, cached now {} MiB, bypassed {} MiB",
        vol.stats().bytes_cached / MIB,
        counter(&vol, "bytes_bypassed") / MIB
    );
    assert!(
        per_pass[1..].iter().all(|&m| m == 0),
        "a later pass of the same stream cached more of it: {per_pass:?} MiB per pass"
    );
}

/// Many files (extents of 16 MiB) backed up every night: how much of them is cached after
/// a few nights.
#[test]
fn a_nightly_backup_of_many_files_caches_nothing_more() {
    let (_cache, vol) = write_through(MIB * 512, MIB * 512);
    let mut cached = Vec::new();
    for _night in 0..5 {
        // 8 extents of 16 MiB, 32 MiB apart.
        for e in 0..8u64 {
            let start = e * 32 * MIB + 8 * MIB;
            scan(&vol, start, start + 16 * MIB, 128 << 10);
        }
        cached.push(vol.stats().bytes_cached / MIB);
    }
    println!("nightly backup of 8 x 16 MiB extents: cached MiB after each night {cached:?}");
    assert!(
        cached.windows(2).all(|w| w[0] == w[1]),
        "each night cached more of the backup: {cached:?}"
    );
}
