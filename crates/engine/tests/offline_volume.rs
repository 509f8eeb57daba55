//! A volume whose backing device is missing at start is offline; the others serve (issue 12
//! item 1: "a missing backing device takes only its own volume offline"). Its requests fail,
//! nothing is written to its (stand-in) device, commits and write-back of the other volume go
//! on, its dirty data survives restarts in the cache, and a later start that finds its device
//! serves and writes back exactly what it held. Under dirty pressure, its dirty lines (which
//! cannot be written back) do not keep the cleaner from the other volume's.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{data, wait_for, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{
    read_superblock, Cache, CleanerConfig, EngineError, VolumeBacking, VolumeState,
};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const CACHE: u64 = 16 * MIB;
const SIZES: [u64; 2] = [8 * MIB, 8 * MIB];

fn open_with(
    cache_dev: &Arc<CrashDevice>,
    a: Option<&Arc<CrashDevice>>,
    b: &Arc<CrashDevice>,
) -> Cache {
    let sb = read_superblock(&**cache_dev).expect("superblock");
    let a = match a {
        Some(d) => VolumeBacking::Device(d.clone()),
        None => VolumeBacking::Offline {
            reason: "cannot open /dev/missing: No such file or directory".into(),
        },
    };
    let (cache, _) = Cache::open_volumes(
        cache_dev.clone(),
        sb,
        vec![a, VolumeBacking::Device(b.clone())],
    )
    .expect("open with volume a offline");
    cache
}

#[test]
fn an_offline_volume_keeps_its_dirty_data_while_the_other_serves() {
    let (cache_dev, [backing_a, backing_b]) = common::two_volume_cache(CACHE, LINE, SIZES);
    let a_data = data(1, MIB as usize);
    let b_data = data(2, MIB as usize);
    {
        let cache = open_with(&cache_dev, Some(&backing_a), &backing_b);
        cache.volumes()[0]
            .write(0, &a_data, false)
            .expect("write a");
        cache.volumes()[0].flush().expect("flush a");
        cache.shutdown().expect("shutdown");
    }
    let a_before = backing_a.durable_image();
    assert!(
        a_before[..MIB as usize] != a_data[..],
        "a's data is only in the cache"
    );

    // Volume a's disk is missing: a is offline, b serves, writes back, commits.
    let cache = Arc::new(open_with(&cache_dev, None, &backing_b));
    let a = &cache.volumes()[0];
    assert_eq!(a.stats().state, VolumeState::Offline);
    assert_eq!(a.stats().dirty_bytes, MIB, "a's dirty data is kept");
    let mut buf = vec![0u8; 4096];
    assert!(matches!(
        a.read(0, &mut buf),
        Err(EngineError::VolumeOffline { .. })
    ));
    assert!(matches!(
        a.write(0, &buf, false),
        Err(EngineError::VolumeOffline { .. })
    ));
    assert!(matches!(a.flush(), Err(EngineError::VolumeOffline { .. })));
    let b = &cache.volumes()[1];
    assert_eq!(b.stats().state, VolumeState::Healthy);
    b.write(MIB, &b_data, false).expect("write b");
    b.flush().expect("FLUSH of b commits while a is offline");
    assert_eq!(cache.writable_dirty_bytes(), MIB, "b's dirty data only");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("a drain writes back what it can and ends");
    assert_eq!(b.stats().dirty_bytes, 0);
    assert_eq!(a.stats().dirty_bytes, MIB, "a's dirty data waits");
    backing_b.flush().expect("flush");
    assert!(backing_b.durable_image()[MIB as usize..2 * MIB as usize] == b_data[..]);
    // Age-based write-back passes a's lines over (the cleaner does not spin on them), while
    // the published age still counts them.
    cache.start_cleaner(CleanerConfig {
        max_age: Duration::ZERO,
        ..CleanerConfig::default()
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        cache.oldest_dirty_age().is_some(),
        "the age counts the offline volume's dirty data, the most at risk"
    );
    cache.stop_cleaner();
    assert_eq!(a.stats().dirty_bytes, MIB);
    cache.shutdown().expect("shutdown with a offline");
    drop(cache);
    assert!(
        backing_a.durable_image() == a_before,
        "nothing was written to a's device while it was offline"
    );

    // The disk is back: a serves the data it held and the cleaner writes it back.
    let sb = read_superblock(&*cache_dev).expect("superblock");
    let backings: Vec<Arc<dyn BlockDevice>> = vec![backing_a.clone(), backing_b.clone()];
    let (cache, _) = Cache::open(cache_dev.clone(), sb, backings).expect("open");
    assert_eq!(cache.volumes()[0].stats().state, VolumeState::Healthy);
    assert!(
        common::read_volume(&cache, 0, 0, MIB as usize) == a_data,
        "a's data after the disk came back"
    );
    assert!(common::read_volume(&cache, 1, MIB, MIB as usize) == b_data);
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    backing_a.flush().expect("flush");
    assert!(
        backing_a.durable_image()[..MIB as usize] == a_data[..],
        "a written back"
    );
    cache.shutdown().expect("shutdown");
}

#[test]
fn dirty_pressure_from_an_offline_volume_does_not_stop_the_others_write_back() {
    let (cache_dev, [backing_a, backing_b]) = common::two_volume_cache(CACHE, LINE, SIZES);
    {
        // Volume a fills most of the cache with dirty lines.
        let cache = open_with(&cache_dev, Some(&backing_a), &backing_b);
        cache.set_dirty_limit(1.0);
        let a_data = data(3, 6 * MIB as usize);
        cache.volumes()[0]
            .write(0, &a_data, false)
            .expect("write a");
        cache.shutdown().expect("shutdown");
    }
    let cache = Arc::new(open_with(&cache_dev, None, &backing_b));
    cache.set_dirty_limit(1.0);
    let b_data = data(4, 4 * MIB as usize);
    cache.volumes()[1]
        .write(0, &b_data, false)
        .expect("write b");
    // Above the high watermark (the cleaner takes the coldest lines, a's first, and must
    // skip them), with no age-based write-back to fall back on. (It also moves them to the
    // warm end, for caches where more than one scan's worth, 65,536 lines, are offline and
    // would otherwise fill every scan: a size this test does not reach.)
    cache.start_cleaner(CleanerConfig {
        high_watermark: 0.1,
        low_watermark: 0.05,
        max_age: Duration::from_secs(3600),
        ..CleanerConfig::default()
    });
    wait_for(
        "b's dirty data written back",
        Duration::from_secs(20),
        || cache.volumes()[1].stats().dirty_bytes == 0,
    );
    cache.stop_cleaner();
    assert_eq!(cache.volumes()[0].stats().dirty_bytes, 6 * MIB);
    backing_b.flush().expect("flush");
    assert!(backing_b.durable_image()[..4 * MIB as usize] == b_data[..]);
    cache.shutdown().expect("shutdown");
}

/// Review 35: a mode change of a healthy volume was refused while another, offline, held
/// dirty data (the check counted the whole cache's); and an offline volume's dirty data at the
/// dirty limit sent every write of the others to their hard drive.
#[test]
fn an_offline_volumes_dirty_data_holds_up_neither_mode_changes_nor_the_others_write_back() {
    let (cache_dev, [backing_a, backing_b]) = common::two_volume_cache(CACHE, LINE, SIZES);
    {
        let cache = open_with(&cache_dev, Some(&backing_a), &backing_b);
        cache.set_dirty_limit(1.0);
        cache.volumes()[0]
            .write(0, &data(5, 4 * MIB as usize), false)
            .expect("write a");
        cache.shutdown().expect("shutdown");
    }
    let cache = open_with(&cache_dev, None, &backing_b);
    // 64 offline dirty lines, above what a 20% limit of the cache's lines allows.
    cache.set_dirty_limit(0.2);
    let b = &cache.volumes()[1];
    b.write(0, &data(6, MIB as usize), false).expect("write b");
    assert_eq!(
        b.stats().dirty_bytes,
        MIB,
        "b's writes are absorbed, not sent around"
    );
    cache
        .set_mode(
            1,
            CacheMode::WriteThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .expect("b's mode changes while a is offline with dirty data");
    assert_eq!(b.configured_mode(), CacheMode::WriteThrough);
    assert_eq!(b.stats().dirty_bytes, 0);
    assert_eq!(cache.volumes()[0].stats().dirty_bytes, 4 * MIB);
    cache.shutdown().expect("shutdown");
}

/// Damages the cache slot holding `content` (its first 4 KiB).
fn damage_slot_holding(cache_dev: &CrashDevice, cache: &Cache, content: &[u8]) {
    let l = cache.layout();
    let at = (0..l.line_count)
        .map(|s| l.data_offset + s * l.line_size)
        .find(|&at| {
            let mut b = vec![0u8; 4096];
            cache_dev.read_at(&mut b, at).expect("read");
            b == content[..4096]
        })
        .expect("the slot holding the data");
    cache_dev.write_at(&[0xEE; 4096], at).expect("damage");
}

/// Review 36: damaged dirty data of volume a (offline here, as after a reboot without its
/// disk) kept volume b from a mode change and from its removal, though neither touches a.
/// Each checks only its own volume's dirty data now; giving up b's damage leaves a's alone.
#[test]
fn another_volumes_damage_holds_up_neither_a_mode_change_nor_a_removal() {
    let (cache_dev, [backing_a, backing_b]) = common::two_volume_cache(CACHE, LINE, SIZES);
    let a_data = data(11, LINE as usize);
    let b_data = data(12, MIB as usize);
    {
        let cache = open_with(&cache_dev, Some(&backing_a), &backing_b);
        cache.volumes()[0]
            .write(0, &a_data, false)
            .expect("write a");
        cache.volumes()[1]
            .write(0, &b_data, false)
            .expect("write b");
        cache.shutdown().expect("shutdown");
    }
    let cache = open_with(&cache_dev, None, &backing_b);
    damage_slot_holding(&cache_dev, &cache, &a_data);
    // Giving up b's damaged data finds none, and leaves a's alone.
    let dropped = cache
        .discard_damaged_of_volume(1, &mut |_| true)
        .expect("check b");
    assert!(dropped.is_empty(), "b has no damage: {dropped:?}");
    cache
        .set_mode(
            1,
            CacheMode::WriteThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .expect("b's mode changes despite a's damage");
    cache
        .empty_volume(1, &CleanerConfig::default(), &mut |_| true)
        .expect("b is emptied despite a's damage");
    assert_eq!(cache.volumes()[1].stats().lines_used, 0);
    backing_b.flush().expect("flush");
    assert!(backing_b.durable_image()[..MIB as usize] == b_data[..]);
    assert_eq!(
        cache.volumes()[0].stats().dirty_bytes,
        LINE,
        "a's data is kept"
    );
    cache.verify_dirty(&mut |_| true).expect("verify");
    assert!(
        cache.damaged_ranges().iter().any(|r| r.volume == "a"),
        "a's damage is still known"
    );
    cache.shutdown().expect("shutdown");
}
