//! Sector checksums: data the cache lost or damaged (a cache file truncated and re-extended, a
//! region zeroed, a failing SSD) never reaches a client or the backing device.

mod common;

use std::sync::Arc;

use common::*;
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{Cache, CleanerConfig, EngineError, Select};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;

/// The cache's data region (where line contents live) on its device.
fn data_region(cache: &Cache) -> std::ops::Range<u64> {
    let l = cache.layout();
    l.data_offset..l.data_offset + l.line_count * l.line_size
}

/// Zeroes the cache's data region from its 50th line on, as truncating the cache file and
/// extending it again would (the first lines the tests dirty sit in the low slots).
fn zero_half_of_data(dev: &dyn BlockDevice, cache: &Cache) {
    let region = data_region(cache);
    let from = region.start + 50 * LINE;
    let zeros = vec![0u8; (region.end - from) as usize];
    dev.write_at(&zeros, from).expect("zero the region");
}

/// Writes `count` scattered 16 KiB pieces and flushes: dirty data in the cache only.
fn write_dirty(cache: &Cache, count: u64, model: &mut [u8]) {
    let vol = cache.volumes()[0].clone();
    for i in 0..count {
        let offset = i * 3 * LINE + (i % 4) * 16384;
        let d = data(1000 + i, 16384);
        vol.write(offset, &d, false).expect("write");
        model[offset as usize..offset as usize + d.len()].copy_from_slice(&d);
    }
    vol.flush().expect("flush");
}

fn read_vec(cache: &Cache, offset: u64, len: usize) -> ssdcache_engine::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    cache.volumes()[0].read(offset, &mut buf)?;
    Ok(buf)
}

#[test]
fn drain_refuses_a_lost_cache_region_after_a_clean_stop_and_changes_nothing() {
    let (cache_dev, backing, cache) = setup(32 << 20, 64 << 20, LINE, CacheMode::WriteBack);
    let mut model = vec![0u8; 64 << 20];
    write_dirty(&cache, 100, &mut model);
    let dirty = cache.dirty_bytes();
    cache.shutdown().expect("clean stop");
    drop(cache);

    let (cache, _) = open(&cache_dev, &backing);
    zero_half_of_data(&*cache_dev, &cache);
    let before = backing.snapshot();
    let err = cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect_err("damaged dirty data must not be written back");
    let msg = err.to_string();
    assert!(matches!(err, EngineError::DataDamaged(_)), "{msg}");
    assert!(
        msg.contains("volume 'v' bytes ["),
        "names the ranges: {msg}"
    );
    assert!(msg.contains("--discard-damaged"), "says what to do: {msg}");
    assert!(
        backing.snapshot() == before,
        "the backing device was changed"
    );
    assert_eq!(
        cache.dirty_bytes(),
        dirty,
        "the dirty data stays in the cache"
    );

    // The operator gives the damaged ranges up: everything else is written back, and the
    // damaged ranges keep the backing device's older data (zeroes here).
    let dropped = cache.discard_damaged().expect("discard damaged");
    assert!(!dropped.is_empty());
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain the rest");
    let after = backing.snapshot();
    let mut expected = model.clone();
    for r in &dropped {
        let range = r.offset as usize..(r.offset + r.length) as usize;
        expected[range.clone()].copy_from_slice(&before[range]);
    }
    assert!(
        after == expected,
        "intact dirty data written back, damaged left as it was"
    );
}

#[test]
fn the_cleaner_never_writes_back_a_region_lost_while_running() {
    let (cache_dev, backing, cache) = setup(32 << 20, 64 << 20, LINE, CacheMode::WriteBack);
    let mut model = vec![0u8; 64 << 20];
    write_dirty(&cache, 100, &mut model);
    zero_half_of_data(&*cache_dev, &cache);
    for _ in 0..4 {
        let _ = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
    }
    let vol = cache.volumes()[0].clone();
    assert!(counter(&vol, "checksum_errors") > 0);
    let damaged = cache.damaged_ranges();
    assert!(!damaged.is_empty(), "the damage is known");
    let after = backing.snapshot();
    for r in &damaged {
        let range = r.offset as usize..(r.offset + r.length) as usize;
        assert!(
            after[range.clone()].iter().all(|&b| b == 0),
            "damaged data reached the backing device at {r}"
        );
        // A client never gets the zeroes: the dirty data is newer than the backing copy.
        assert!(read_vec(&cache, r.offset, 4096).is_err(), "read of {r}");
    }
    // Everything that was intact went back.
    let intact = (0..100u64)
        .map(|i| i * 3 * LINE + (i % 4) * 16384)
        .find(|&o| {
            !damaged
                .iter()
                .any(|r| o < r.offset + r.length && r.offset < o + 16384)
        });
    let o = intact.expect("some data lay in the intact half") as usize;
    assert_eq!(&after[o..o + 16384], &model[o..o + 16384]);
}

#[test]
fn damaged_clean_data_is_read_from_the_backing_device() {
    let (cache_dev, backing, cache) = setup(32 << 20, 64 << 20, LINE, CacheMode::WriteThrough);
    let d = data(7, 1 << 20);
    backing.write_at(&d, 0).expect("backing data");
    assert_eq!(
        read_vec(&cache, 0, d.len()).unwrap(),
        d,
        "first read fills the cache"
    );
    let vol = cache.volumes()[0].clone();
    assert!(vol.stats().bytes_cached >= d.len() as u64);
    let region = data_region(&cache);
    cache_dev
        .write_at(
            &vec![0u8; (region.end - region.start) as usize],
            region.start,
        )
        .expect("zero the cache data");
    assert_eq!(
        read_vec(&cache, 0, d.len()).unwrap(),
        d,
        "served from the backing device"
    );
    assert!(counter(&vol, "checksum_errors") > 0);
}

/// After an unclean stop the journal's checksums are those of the last commit: a write made
/// after it (not yet flushed) may have replaced the data in place, and is kept; a sector that
/// reads as zeroes is what a lost region returns, and is refused.
#[test]
fn after_a_crash_unflushed_overwrites_are_kept_and_zeroed_sectors_refused() {
    let cache_dev = Arc::new(CrashDevice::new("cache", 32 << 20));
    let backing = Arc::new(CrashDevice::new("backing", 64 << 20));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, 64 << 20, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, 8192), false).unwrap();
    vol.write(LINE, &data(2, 4096), false).unwrap();
    vol.flush().unwrap();
    // Not flushed: the commit recorded the old checksums.
    vol.write(0, &data(3, 4096), false).unwrap();
    // Every unflushed write landed.
    let image = cache_dev.written_image();
    let data_offset = cache.layout().data_offset;
    drop((vol, cache));

    let crashed = Arc::new(CrashDevice::from_image("cache", image));
    let backing2: Arc<dyn BlockDevice> =
        Arc::new(CrashDevice::from_image("backing", backing.written_image()));
    let (cache, report) = open_dyn(crashed.clone(), backing2.clone());
    assert!(report.recovery.is_some());
    let mut expected = data(3, 4096);
    expected.extend_from_slice(&data(1, 8192)[4096..]);
    assert_eq!(
        read_vec(&cache, 0, 8192).unwrap(),
        expected,
        "the newer write is kept"
    );

    // The other line's slot lost its data (zeroes): refused, not served.
    let slot_of_line_1 = (0..cache.layout().line_count)
        .map(|s| data_offset + s * LINE)
        .find(|&at| {
            let mut b = vec![0u8; 4096];
            crashed.read_at(&mut b, at).unwrap();
            b == data(2, 4096)
        })
        .expect("line 1's slot");
    crashed.write_at(&[0u8; 4096], slot_of_line_1).unwrap();
    assert!(
        read_vec(&cache, LINE, 4096).is_err(),
        "zeroed dirty data is an error"
    );
    let err = cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect_err("drain refuses");
    assert!(
        err.to_string()
            .contains(&format!("bytes [{LINE}, {})", LINE + 4096)),
        "{err}"
    );
}

/// While a mode change drains, writes go through: one that lands on a dirty sector supersedes
/// it (new data and checksum, clean), so the drain finds nothing damaged and the backing
/// device ends with the newest data.
#[test]
fn a_write_through_over_dirty_data_during_a_mode_change_is_not_damage() {
    let (_cache_dev, backing, cache) = setup(32 << 20, 64 << 20, LINE, CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, 16384), false).unwrap();
    vol.flush().unwrap();
    cache.hold_writes_through(0);
    vol.write(4096, &data(2, 4096), false).unwrap();
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("nothing is damaged");
    let mut expected = data(1, 16384);
    expected[4096..8192].copy_from_slice(&data(2, 4096));
    assert_eq!(read_vec(&cache, 0, 16384).unwrap(), expected);
    assert_eq!(&backing.snapshot()[..16384], &expected[..]);
    assert_eq!(counter(&vol, "checksum_errors"), 0);
}
