//! Cache device failures never cost data or serve garbage in write-through; bad superblocks
//! and truncated caches are refused with a message.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{format_mem, MIB};
use ssdcache_device::{BlockDevice, MemDevice};
use ssdcache_engine::{read_superblock, Cache};
use ssdcache_format::CacheMode;

fn setup(mode: CacheMode) -> (Arc<MemDevice>, Arc<MemDevice>, Cache) {
    common::setup(16 * MIB, 8 * MIB, 64 << 10, mode)
}

#[test]
fn cache_read_errors_fall_back_to_backing() {
    let (cache_dev, _backing, cache) = setup(CacheMode::WriteThrough);
    let vol = cache.volumes()[0].clone();
    vol.write(0, &[7u8; 65536], false).expect("write");
    cache_dev.fail_reads.store(true, Ordering::Relaxed);
    let mut buf = vec![0u8; 65536];
    vol.read(0, &mut buf)
        .expect("read served from the backing device");
    assert!(buf.iter().all(|&b| b == 7));
    assert!(vol.counters().0[14] >= 1, "cache error counted");
}

#[test]
fn cache_write_errors_keep_the_write_and_drop_the_line() {
    let (cache_dev, _backing, cache) = setup(CacheMode::WriteThrough);
    let vol = cache.volumes()[0].clone();
    vol.write(0, &[1u8; 65536], false).expect("write");
    cache_dev.fail_writes.store(true, Ordering::Relaxed);
    vol.write(0, &[2u8; 65536], false)
        .expect("write succeeds: the backing device has it");
    cache_dev.fail_writes.store(false, Ordering::Relaxed);
    let mut buf = vec![0u8; 65536];
    vol.read(0, &mut buf).expect("read");
    assert!(
        buf.iter().all(|&b| b == 2),
        "the old cached copy must not resurface"
    );
}

#[test]
fn backing_errors_reach_the_client() {
    let (_cache_dev, backing, cache) = setup(CacheMode::WriteThrough);
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; 4096];
    vol.read(0, &mut buf).expect("read");
    backing.fail_writes.store(true, Ordering::Relaxed);
    assert!(vol.write(0, &[3u8; 4096], false).is_err());
    backing.fail_writes.store(false, Ordering::Relaxed);
    backing.fail_reads.store(true, Ordering::Relaxed);
    // The failed write dropped the cached copy, so this read must go to the (failing) backing.
    assert!(vol.read(0, &mut buf).is_err());
    assert!(vol.counters().0[15] >= 2);
}

#[test]
fn requests_outside_or_misaligned_are_refused() {
    let (_c, _b, cache) = setup(CacheMode::WriteAround);
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; 4096];
    assert!(vol.read(8 * MIB, &mut buf).is_err());
    assert!(vol.read(512, &mut buf).is_err());
    assert!(vol.write(u64::MAX - 4095, &buf, false).is_err());
}

#[test]
fn corrupt_and_truncated_caches_are_refused() {
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_mem(&cache_dev, 64 << 10, CacheMode::WriteThrough, 8 * MIB);
    // One bad copy is survived.
    cache_dev.write_at(&[0xEE; 4096], 0).expect("corrupt A");
    assert!(read_superblock(&*cache_dev).is_ok());
    cache_dev.write_at(&[0xEE; 4096], 65536).expect("corrupt B");
    let err = read_superblock(&*cache_dev)
        .expect_err("both copies bad")
        .to_string();
    assert!(err.contains("superblock"), "{err}");

    let big = Arc::new(MemDevice::new("big", 32 * MIB));
    format_mem(&big, 64 << 10, CacheMode::WriteThrough, 8 * MIB);
    let truncated = MemDevice::new("truncated", 16 * MIB);
    truncated
        .write_at(&big.snapshot()[..(16 * MIB) as usize], 0)
        .expect("copy");
    let err = read_superblock(&truncated)
        .expect_err("truncated")
        .to_string();
    assert!(err.contains("truncated"), "{err}");
}
