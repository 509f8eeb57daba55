//! Cache device failures never cost data or serve garbage in write-through; bad superblocks
//! and truncated caches are refused with a message. In write-back, a failing cache never
//! serves stale backing data for dirty sectors, new writes still land, a journal that cannot
//! be made durable fails the flush, and a failing backing device keeps data dirty.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{counter, data, format_mem, setup_crash, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, MemDevice};
use ssdcache_engine::{
    read_superblock, Cache, CleanerConfig, Select, VolumeState, CACHE_ERROR_LIMIT,
};
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
fn requests_outside_are_refused_and_partial_sectors_served() {
    let (_c, _b, cache) = setup(CacheMode::WriteAround);
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; 4096];
    assert!(vol.read(8 * MIB, &mut buf).is_err());
    assert!(vol.read(8 * MIB - 512, &mut buf).is_err());
    assert!(vol.write(u64::MAX - 4095, &buf, false).is_err());
    assert!(vol.write(u64::MAX - 10, &buf[..5], false).is_err());
    // Refused before it is widened to whole sectors (review 42 F3: an overflow).
    assert!(vol.write_zeroes(u64::MAX - 10, 100, false).is_err());
    // Issue 13: byte offsets and lengths are served (partial.rs).
    vol.write(512, &[9u8; 700], false).expect("partial write");
    vol.read(512, &mut buf).expect("partial read");
    assert_eq!(&buf[..700], &[9u8; 700][..]);
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

// ---------------------------------------------------------------------------------------
// Fault switches of crash-simulating devices, in write-through and write-back.

const LINE: u64 = 64 << 10;
const SECTOR: u64 = 4096;
const BACKING: u64 = 8 * MIB;

fn crash_setup(mode: CacheMode) -> (Arc<CrashDevice>, Arc<CrashDevice>, Cache) {
    setup_crash(16 * MIB, BACKING, LINE, mode)
}

/// The cache's data area: failing reads there leaves the superblock and journal readable.
fn data_area(cache: &Cache) -> std::ops::Range<u64> {
    let l = cache.layout();
    l.data_offset..l.cache_size
}

fn write_model(cache: &Cache, model: &mut [u8], offset: u64, buf: &[u8]) {
    cache.volumes()[0]
        .write(offset, buf, false)
        .unwrap_or_else(|e| panic!("write at {offset}: {e}"));
    model[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
}

fn read_vec(cache: &Cache, offset: u64, len: u64) -> ssdcache_engine::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    cache.volumes()[0].read(offset, &mut buf)?;
    Ok(buf)
}

fn assert_reads(cache: &Cache, model: &[u8], offset: u64, len: u64, what: &str) {
    let got = read_vec(cache, offset, len).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        got == model[offset as usize..(offset + len) as usize],
        "{what}: read at {offset} (+{len}) differs from what was written"
    );
}

/// Writes `old` data straight to the backing device (durably), before the cache opens, so a
/// read that wrongly returns the backing device's copy of newer dirty data shows it.
fn backing_with_old_data() -> (Arc<CrashDevice>, Arc<CrashDevice>, Cache, Vec<u8>) {
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    let old = data(0x01d, BACKING as usize);
    backing.write_at(&old, 0).expect("old data");
    backing.flush().expect("flush");
    common::format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = common::open_dyn(cache_dev.clone(), backing.clone());
    (cache_dev, backing, cache, old)
}

#[test]
fn write_through_survives_cache_read_errors_then_passes_through() {
    let (cache_dev, backing, cache) = crash_setup(CacheMode::WriteThrough);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; BACKING as usize];
    let lines: Vec<u64> = (0..2 * CACHE_ERROR_LIMIT).map(|i| i * 3 + 1).collect();
    for (i, &line) in lines.iter().enumerate() {
        write_model(
            &cache,
            &mut model,
            line * LINE,
            &data(i as u64 + 1, LINE as usize),
        );
    }
    assert_eq!(vol.stats().lines_used, lines.len() as u64, "all cached");
    cache_dev.fail_reads_in(Some(data_area(&cache)));
    for &line in &lines {
        let errors = counter(&vol, "cache_errors");
        assert_reads(
            &cache,
            &model,
            line * LINE,
            LINE,
            "cached line, cache failing",
        );
        if counter(&vol, "cache_errors") < CACHE_ERROR_LIMIT {
            assert_eq!(
                (vol.state(), vol.stats().mode),
                (VolumeState::Healthy, CacheMode::WriteThrough),
                "fewer errors than the limit must not end caching"
            );
            assert_eq!(counter(&vol, "cache_errors"), errors + 1);
        }
    }
    let stats = vol.stats();
    assert!(counter(&vol, "cache_errors") >= CACHE_ERROR_LIMIT);
    assert_eq!(stats.state, VolumeState::PassThroughAfterErrors);
    assert_eq!(stats.mode, CacheMode::PassThrough);
    assert_eq!(stats.configured_mode, CacheMode::WriteThrough);
    // No data lost: everything reads right, partial reads too, and new writes land.
    for &line in &lines {
        assert_reads(&cache, &model, line * LINE, LINE, "after pass-through");
        assert_reads(
            &cache,
            &model,
            line * LINE + 3 * SECTOR,
            2 * SECTOR,
            "partial",
        );
    }
    write_model(
        &cache,
        &mut model,
        2 * LINE + SECTOR,
        &data(77, 3 * SECTOR as usize),
    );
    assert_reads(&cache, &model, 2 * LINE, LINE, "written in pass-through");
    assert!(backing.written_image() == model);
}

#[test]
fn write_back_dirty_data_unreadable_is_an_error_never_stale() {
    let (cache_dev, _backing, cache, old) = backing_with_old_data();
    let vol = cache.volumes()[0].clone();
    let mut model = old.clone();
    let cfg = CleanerConfig::default();
    // Line 9: written, then cleaned (the cache has it clean, the backing device has it too).
    write_model(&cache, &mut model, 9 * LINE, &data(9, LINE as usize));
    cache.clean_batch(&cfg, 1, Select::All).expect("clean");
    // Line 5: one dirty sector. Line 6: a whole dirty line.
    write_model(
        &cache,
        &mut model,
        5 * LINE + 3 * SECTOR,
        &data(5, SECTOR as usize),
    );
    write_model(&cache, &mut model, 6 * LINE, &data(6, LINE as usize));
    assert_eq!(vol.stats().dirty_lines, 2);
    cache_dev.fail_reads_in(Some(data_area(&cache)));

    let dirty_sector = 5 * LINE + 3 * SECTOR;
    match read_vec(&cache, dirty_sector, SECTOR) {
        Err(_) => {}
        Ok(buf) if buf == old[dirty_sector as usize..][..SECTOR as usize] => {
            panic!("stale backing data returned for a dirty sector")
        }
        Ok(_) => panic!("read of an unreadable dirty sector succeeded"),
    }
    assert_eq!(vol.state(), VolumeState::CacheFailed);
    assert!(counter(&vol, "dirty_read_errors") >= 1);
    assert!(counter(&vol, "cache_errors") >= 1);
    // Every read touching dirty sectors fails the same way, whole or partial.
    assert!(read_vec(&cache, 5 * LINE, LINE).is_err());
    assert!(read_vec(&cache, 6 * LINE + 4 * SECTOR, SECTOR).is_err());
    assert!(read_vec(&cache, 6 * LINE - SECTOR, 2 * SECTOR).is_err());
    assert!(counter(&vol, "dirty_read_errors") >= 4);
    // Clean cached data, never-cached data and the clean sectors of a dirty line still read.
    assert_reads(&cache, &model, 9 * LINE, LINE, "clean cached line");
    assert_reads(&cache, &model, 20 * LINE, LINE, "uncached line");
    assert_reads(
        &cache,
        &model,
        5 * LINE,
        3 * SECTOR,
        "clean sectors of a dirty line",
    );
    assert_reads(
        &cache,
        &model,
        5 * LINE + 4 * SECTOR,
        12 * SECTOR,
        "clean sectors after it",
    );
    // The dirty data is still counted as such (it is at risk, not forgotten).
    assert_eq!(vol.stats().dirty_lines, 2);
    // A new write of a dirty sector goes to the backing device and supersedes the lost copy.
    write_model(&cache, &mut model, dirty_sector, &data(55, SECTOR as usize));
    assert_reads(
        &cache,
        &model,
        5 * LINE,
        LINE,
        "rewritten after the failure",
    );
    assert_eq!(vol.stats().dirty_lines, 1);
}

/// The first read after the cache broke asks for a clean, uncached sector of a line that also
/// holds a dirty sector: the backing device has the data asked for, so the read should work.
#[test]
fn clean_sector_beside_unreadable_dirty_one_is_served() {
    let (cache_dev, _backing, cache, old) = backing_with_old_data();
    let mut model = old;
    write_model(&cache, &mut model, 7 * LINE, &data(7, SECTOR as usize));
    cache_dev.fail_reads_in(Some(data_area(&cache)));
    // Sector 8 of line 7 is not cached; its only copy is on the backing device.
    assert_reads(
        &cache,
        &model,
        7 * LINE + 8 * SECTOR,
        SECTOR,
        "clean sector of a dirty line",
    );
}

#[test]
fn write_back_cache_write_errors_send_writes_to_backing() {
    let (cache_dev, backing, cache) = crash_setup(CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; BACKING as usize];
    write_model(&cache, &mut model, LINE, &data(1, LINE as usize));
    let to_backing = counter(&vol, "bytes_to_backing");
    cache_dev.fail_writes(true);
    // A fresh line, a rewrite of part of the dirty line, and a request across lines.
    write_model(&cache, &mut model, 4 * LINE, &data(2, LINE as usize));
    assert_eq!(vol.state(), VolumeState::CacheFailed);
    write_model(
        &cache,
        &mut model,
        LINE + 2 * SECTOR,
        &data(3, 2 * SECTOR as usize),
    );
    write_model(
        &cache,
        &mut model,
        8 * LINE - SECTOR,
        &data(4, 2 * SECTOR as usize),
    );
    assert!(counter(&vol, "bytes_to_backing") >= to_backing + LINE + 4 * SECTOR);
    assert_eq!(vol.state(), VolumeState::CacheFailed);
    for line in [1, 4, 7, 8] {
        assert_reads(
            &cache,
            &model,
            line * LINE,
            LINE,
            "after cache write errors",
        );
    }
    // New data is on the backing device itself.
    let img = backing.written_image();
    assert!(
        img[4 * LINE as usize..5 * LINE as usize] == model[4 * LINE as usize..5 * LINE as usize]
    );
    assert!(
        img[(LINE + 2 * SECTOR) as usize..][..2 * SECTOR as usize]
            == model[(LINE + 2 * SECTOR) as usize..][..2 * SECTOR as usize]
    );
    // The journal cannot be written: it still names the superseded dirty copy, so a flush
    // must not claim durability.
    assert!(
        vol.flush().is_err(),
        "flush with an unwritable journal must fail"
    );
    // Once the device works again the rest is written back and nothing is lost.
    cache_dev.fail_writes(false);
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(backing.written_image() == model);
}

#[test]
fn write_back_cache_flush_errors_fail_the_flush() {
    let (cache_dev, backing, cache) = crash_setup(CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; BACKING as usize];
    write_model(&cache, &mut model, 3 * LINE, &data(1, LINE as usize));
    cache_dev.fail_flushes(true);
    assert!(
        vol.flush().is_err(),
        "a flush must fail when the journal cannot be made durable"
    );
    assert!(
        vol.write(10 * LINE, &data(2, SECTOR as usize), true)
            .is_err(),
        "a FUA write must fail when the journal cannot be made durable"
    );
    model[10 * LINE as usize..][..SECTOR as usize].copy_from_slice(&data(2, SECTOR as usize));
    cache_dev.fail_flushes(false);
    assert_reads(&cache, &model, 3 * LINE, LINE, "after the failed flush");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(backing.written_image() == model);
    vol.flush().expect("flush once everything is written back");
}

/// After a failed commit and a drain that wrote every dirty line back, new dirty data is
/// committed normally: flushes work again.
#[test]
fn flush_works_again_after_a_failed_commit_is_drained() {
    let (cache_dev, _backing, cache) = crash_setup(CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, SECTOR as usize), false)
        .expect("write");
    cache_dev.fail_flushes(true);
    assert!(vol.flush().is_err());
    cache_dev.fail_flushes(false);
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    vol.flush().expect("flush with nothing dirty");
    vol.write(LINE, &data(2, SECTOR as usize), false)
        .expect("write");
    vol.flush()
        .expect("flush of new dirty data on a working cache device");
}

#[test]
fn write_back_backing_errors_keep_data_dirty() {
    let (cache_dev, backing, cache) = crash_setup(CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; BACKING as usize];

    // A read miss on a failing backing device is an error, and counted.
    backing.fail_reads(true);
    let errors = counter(&vol, "backing_errors");
    assert!(read_vec(&cache, 30 * LINE, SECTOR).is_err());
    assert!(read_vec(&cache, 31 * LINE, LINE).is_err());
    assert!(counter(&vol, "backing_errors") >= errors + 2);
    backing.fail_reads(false);

    for (i, line) in [2u64, 3, 9, 40].into_iter().enumerate() {
        write_model(
            &cache,
            &mut model,
            line * LINE + SECTOR,
            &data(i as u64 + 1, 8 * SECTOR as usize),
        );
    }
    vol.flush().expect("flush");
    let dirty = cache.dirty_bytes();
    assert_eq!(dirty, 4 * 8 * SECTOR);
    let cfg = CleanerConfig::default();

    // Backing writes fail: the batch writes nothing back and the data stays dirty.
    backing.fail_writes(true);
    let image = backing.written_image();
    let errors = counter(&vol, "backing_errors");
    if let Ok(r) = cache.clean_batch(&cfg, 4, Select::All) {
        assert_eq!(r.lines_cleaned, 0, "{r:?}");
        assert!(r.extents_failed > 0, "{r:?}");
    }
    assert_eq!(cache.dirty_bytes(), dirty);
    assert!(counter(&vol, "backing_errors") > errors);
    // A failed write may land in part (the crash device lands some of its sectors): every
    // byte that changed on the backing device is the data being written back.
    let after = backing.written_image();
    assert!(
        after
            .iter()
            .zip(&image)
            .zip(&model)
            .all(|((now, before), want)| now == before || now == want),
        "a failed writeback put something other than the dirty data on the backing device"
    );
    assert!(
        cache.drain(&cfg, &mut |_| true).is_err(),
        "a drain that cannot write back must fail"
    );
    assert_eq!(cache.dirty_bytes(), dirty);
    for line in [2u64, 3, 9, 40] {
        assert_reads(
            &cache,
            &model,
            line * LINE,
            LINE,
            "dirty data while backing fails",
        );
    }
    backing.fail_writes(false);

    // The backing flush fails: the writes happened but are not durable, so nothing is clean.
    backing.fail_flushes(true);
    assert!(cache.clean_batch(&cfg, 4, Select::All).is_err());
    assert_eq!(cache.dirty_bytes(), dirty);
    backing.fail_flushes(false);

    // The device may have dropped what that flush covered: no later flush vouches for it, so
    // batches and FLUSHes keep failing until a restart, and the stats say why.
    assert!(cache.clean_batch(&cfg, 4, Select::All).is_err());
    let err = vol.flush().expect_err("FLUSH after a failed backing flush");
    assert!(err.to_string().contains("earlier flush"), "{err}");
    assert_eq!(vol.stats().state, VolumeState::BackingFlushFailed);
    assert_eq!(cache.dirty_bytes(), dirty);

    // After a restart (the fault cleared) the journal still holds the dirty data, and it all
    // goes back.
    drop(vol);
    drop(cache);
    let (cache, _) = common::open_dyn(cache_dev.clone(), backing.clone());
    assert_eq!(cache.dirty_bytes(), dirty);
    cache
        .drain(&cfg, &mut |_| true)
        .expect("drain after the restart");
    assert_eq!(cache.dirty_bytes(), 0);
    assert!(backing.written_image() == model);
    assert!(backing.durable_image() == model, "written back and flushed");
}

/// In write-back after cache read errors, writes go to the backing device; a FUA one over a
/// durably dirty sector must still be durable: after a crash (the cache device readable again)
/// the journal's old record must not bring the old copy back.
#[test]
fn fua_write_after_cache_failure_is_not_undone_by_recovery() {
    let (cache_dev, backing) = (
        Arc::new(CrashDevice::new("cache", 16 * MIB)),
        Arc::new(CrashDevice::new("backing", BACKING)),
    );
    common::format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = common::open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let x = 12 * LINE + 2 * SECTOR;
    vol.write(x, &data(1, SECTOR as usize), false)
        .expect("write");
    vol.write(13 * LINE, &data(2, SECTOR as usize), false)
        .expect("write");
    vol.flush().expect("flush");
    cache_dev.fail_reads_in(Some(data_area(&cache)));
    assert!(read_vec(&cache, 13 * LINE, SECTOR).is_err());
    assert_eq!(vol.state(), VolumeState::CacheFailed);
    let new = data(3, SECTOR as usize);
    vol.write(x, &new, true)
        .expect("FUA write around the failed cache");
    assert_eq!(read_vec(&cache, x, SECTOR).expect("read"), new);
    // Power cut; the cache device comes back readable.
    let c = Arc::new(cache_dev.crashed("cache", 1));
    let b = Arc::new(backing.crashed("backing", 2));
    drop((vol, cache));
    let (cache, _) = common::open_dyn(c, b);
    let got = read_vec(&cache, x, SECTOR).expect("read after crash");
    assert!(
        got == new,
        "after the crash the sector reads as {}, not the acknowledged FUA write",
        if got == data(1, SECTOR as usize) {
            "the old dirty copy"
        } else {
            "something else"
        }
    );
}
