//! The stream detector and cache hits (issue 11, "no global lock on the hit path"): a read the
//! cache serves whole takes no lock of the detector and never pushes a tracked stream out of
//! it; it leaves a note of where its run of hits ends, which a request the cache cannot serve
//! whole looks up, so a stream that ran through cached data still counts every byte of it.

mod common;

use std::sync::Arc;

use common::{counter, format_dev, open_dyn, MIB};
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{Cache, Volume};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const CUTOFF: u64 = 4 * MIB;
/// One region of the detector (256 MiB), so every request below meets the same detector.
const BACKING: u64 = 256 * MIB;
/// Lines cached far apart (6 MiB: beyond any request's slack from the next), more of them than
/// the 32 streams a detector tracks.
const FAR_LINES: u64 = 40;
const FAR_STEP: u64 = 6 * MIB;

fn far_line(i: u64) -> u64 {
    (i + 1) * FAR_STEP
}

/// A write-through cache of 16 MiB over `BACKING`, the `FAR_LINES` lines cached, and opened
/// again so the detector starts empty.
fn cache_with_far_lines() -> (Arc<MemDevice>, Arc<MemDevice>, Cache, Arc<Volume>) {
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, BACKING, CUTOFF);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let mut line = vec![0u8; LINE as usize];
    for i in 0..FAR_LINES {
        cache.volumes()[0]
            .read(far_line(i), &mut line)
            .expect("warm-up read");
    }
    cache.shutdown().expect("clean stop");
    drop(cache);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    (backing, cache_dev, cache, vol)
}

fn stream_reads(vol: &Volume, from: u64, to: u64) {
    let mut chunk = vec![0u8; 256 << 10];
    let mut at = from;
    while at < to {
        vol.read(at, &mut chunk).expect("stream read");
        at += chunk.len() as u64;
    }
}

fn hit_every_far_line(vol: &Volume) {
    let mut sector = vec![0u8; 4096];
    let hits = counter(vol, "read_hits");
    for i in 0..FAR_LINES {
        vol.read(far_line(i) + 8192, &mut sector).expect("hit");
    }
    assert_eq!(
        counter(vol, "read_hits") - hits,
        FAR_LINES,
        "every far read hit"
    );
}

/// A backup streaming through a region while clients hit cached blocks all over it: the
/// hits (more of them than the detector's 32 streams, far apart) used to each start a
/// "stream" of their own and push the backup's out, so the backup started counting again
/// from zero and 2 MiB more of it went into the cache.
#[test]
fn random_hits_beside_a_stream_do_not_make_the_detector_forget_it() {
    let (_backing, _cache_dev, _cache, vol) = cache_with_far_lines();
    stream_reads(&vol, 0, 2 * MIB);
    hit_every_far_line(&vol);
    stream_reads(&vol, 2 * MIB, 8 * MIB);
    assert_eq!(
        counter(&vol, "bytes_bypassed"),
        4 * MIB,
        "the stream goes around the cache from its cutoff (4 MiB) on"
    );
}

/// A stream read over cached data counts the cached part: it goes around the cache from its
/// cutoff on, as if the detector had seen every hit (the first 2 MiB were hits, so 6 MiB of
/// the 10 go around).
#[test]
fn a_stream_over_cached_data_counts_the_hits() {
    let backing = Arc::new(MemDevice::new("backing", 64 * MIB));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, 64 * MIB, CUTOFF);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    // The first 2 MiB cached, one line at a time from the end (no stream).
    let mut line = vec![0u8; LINE as usize];
    for l in (0..2 * MIB / LINE).rev() {
        cache.volumes()[0]
            .read(l * LINE, &mut line)
            .expect("warm-up read");
    }
    cache.shutdown().expect("clean stop");
    drop(cache);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    stream_reads(&vol, 0, 10 * MIB);
    assert_eq!(counter(&vol, "read_hits"), 8, "the cached 2 MiB were hits");
    assert_eq!(
        counter(&vol, "bytes_bypassed"),
        6 * MIB,
        "the stream went around the cache from its cutoff (4 MiB) on"
    );
}
