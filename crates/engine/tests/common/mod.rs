//! Shared setup of the engine's integration tests: memory devices and a formatted cache.

#![allow(dead_code)] // each test file uses a different part

use std::sync::Arc;

use ssdcache_device::{BlockDevice, MemDevice};
use ssdcache_engine::{format, read_superblock, Cache, NewVolume};
use ssdcache_format::{BackingIdentity, BackingKind, CacheMode};

pub const MIB: u64 = 1 << 20;

pub fn identity(size: u64) -> BackingIdentity {
    BackingIdentity {
        kind: BackingKind::File,
        size,
        path: "mem".into(),
        stable_id: "mem".into(),
        st_dev: 0,
        st_ino: 0,
        st_rdev: 0,
        btime_ns: 0,
    }
}

/// Sequential cutoff of test volumes: small, so the property tests' streams bypass the cache.
pub const TEST_CUTOFF: u64 = 256 << 10;

/// Formats `cache_dev` for one volume of `backing_size` bytes.
pub fn format_mem(cache_dev: &MemDevice, line_size: u64, mode: CacheMode, backing_size: u64) {
    let volume = NewVolume {
        name: "v".into(),
        mode,
        backing: identity(backing_size),
        sequential_cutoff: TEST_CUTOFF,
    };
    format(cache_dev, line_size, volume).expect("format");
}

/// Opens the cache on `cache_dev` with `backing` as its only volume.
pub fn open(
    cache_dev: &Arc<MemDevice>,
    backing: &Arc<MemDevice>,
) -> (Cache, ssdcache_engine::OpenReport) {
    let sb = read_superblock(&**cache_dev).expect("superblock");
    Cache::open(
        cache_dev.clone(),
        sb,
        vec![backing.clone() as Arc<dyn BlockDevice>],
    )
    .expect("open")
}

/// A fresh cache of `cache_size` over a fresh backing device of `backing_size`.
pub fn setup(
    cache_size: u64,
    backing_size: u64,
    line_size: u64,
    mode: CacheMode,
) -> (Arc<MemDevice>, Arc<MemDevice>, Cache) {
    let cache_dev = Arc::new(MemDevice::new("cache", cache_size));
    let backing = Arc::new(MemDevice::new("backing", backing_size));
    format_mem(&cache_dev, line_size, mode, backing_size);
    let (cache, _) = open(&cache_dev, &backing);
    (cache_dev, backing, cache)
}
