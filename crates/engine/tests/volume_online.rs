//! Adding and removing volumes of an open cache (`Cache::add_volume`, `Cache::remove_volume`:
//! what `ssdcache volume add` and `remove` ask the serving daemon to do). Added: the other
//! volume's writes and commits go on meanwhile; the new volume's dirty data survives a power
//! cut right after its FLUSH and is written back onto its own device; refusals (a taken name
//! or slot, a wrong size, a full cache) change nothing. Removed: its dirty data written back
//! first, the other volume's left alone, nothing of it left after a power cut.

mod common;

use std::sync::Arc;

use common::{data, format_dev, identity, read_volume, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, MemDevice};
use ssdcache_engine::{read_superblock, Cache, CleanerConfig, EngineError};
use ssdcache_format::superblock::MAX_VOLUMES;
use ssdcache_format::{CacheMode, VolumeSlot};

const LINE: u64 = 64 << 10;
const CACHE: u64 = 16 * MIB;
const SIZE: u64 = 8 * MIB;

/// A slot for a new volume like the first one (same policy, mode, admission).
fn slot(cache: &Cache, id: u16, name: &str, size: u64) -> VolumeSlot {
    VolumeSlot {
        id,
        uuid: [id as u8 + 1; 16],
        name: name.into(),
        backing: identity(size),
        dirty_lines: 0,
        dirty_bytes: 0,
        counters: Default::default(),
        ..cache.superblock().volumes[0].clone()
    }
}

#[test]
fn a_volume_added_while_serving_keeps_its_flushed_data_across_a_power_cut() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, SIZE, 0);
    let backing_a = Arc::new(CrashDevice::new("backing-a", SIZE));
    let backing_b = Arc::new(CrashDevice::new("backing-b", SIZE));
    let cache = Arc::new(common::open_crash(&cache_dev, &[&backing_a]));
    // Volume a is written and committed throughout the addition.
    let writer = {
        let cache = cache.clone();
        std::thread::spawn(move || {
            let a = cache.volumes()[0].clone();
            for i in 0..96u64 {
                a.write((i % 32) * LINE, &data(100 + i, LINE as usize), false)
                    .expect("write a");
                if i % 8 == 0 {
                    cache.commit().expect("commit");
                }
            }
        })
    };
    let b = cache
        .add_volume(slot(&cache, 1, "b", SIZE), backing_b.clone())
        .expect("add b while a is written");
    writer.join().expect("writer of a");
    assert_eq!(cache.volumes().len(), 2);
    assert_eq!(b.name(), "b");
    let b_data = data(2, 2 * MIB as usize);
    b.write(MIB, &b_data, false).expect("write b");
    b.flush().expect("flush b");
    cache.volumes()[0].flush().expect("flush a");
    let a_data = read_volume(&cache, 0, 0, 32 * LINE as usize);
    assert!(
        backing_b.durable_image()[MIB as usize..3 * MIB as usize]
            .iter()
            .all(|&x| x == 0),
        "b's writes are in the cache only (write-back)"
    );

    // Power cut: every device keeps only what was flushed.
    let cache_after = Arc::new(cache_dev.crashed("cache-after", 7));
    let a_after = Arc::new(backing_a.crashed("a-after", 7));
    let b_after = Arc::new(backing_b.crashed("b-after", 7));
    drop(cache);
    let names: Vec<String> = read_superblock(&*cache_after)
        .expect("superblock")
        .volumes
        .iter()
        .map(|v| v.name.clone())
        .collect();
    assert_eq!(names, ["v", "b"], "the superblock names the added volume");
    let cache = common::open_crash(&cache_after, &[&a_after, &b_after]);
    assert!(
        read_volume(&cache, 1, MIB, b_data.len()) == b_data,
        "b's data survived"
    );
    assert!(
        read_volume(&cache, 0, 0, a_data.len()) == a_data,
        "a's data survived"
    );
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    b_after.flush().expect("flush");
    a_after.flush().expect("flush");
    assert!(
        b_after.durable_image()[MIB as usize..3 * MIB as usize] == b_data[..],
        "b's dirty data was written back onto b's own device"
    );
    assert!(
        a_after.durable_image()[..a_data.len()] == a_data[..],
        "a's onto a's"
    );
    cache.shutdown().expect("shutdown");
}

#[test]
fn an_added_volume_is_warm_after_a_clean_restart() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, SIZE, 0);
    let backing_a = Arc::new(CrashDevice::new("backing-a", SIZE));
    let backing_b = Arc::new(CrashDevice::new("backing-b", SIZE));
    let cache = common::open_crash(&cache_dev, &[&backing_a]);
    cache.record_latencies(true); // `serve --metrics`
    let b = cache
        .add_volume(slot(&cache, 1, "b", SIZE), backing_b.clone())
        .expect("add b");
    b.write(0, &data(5, MIB as usize), false).expect("write b");
    assert!(
        b.latencies().iter().map(|h| h.count).sum::<u64>() > 0,
        "an added volume records latencies when the others do (review 39)"
    );
    let cached = b.stats().lines_used;
    assert!(cached > 0);
    cache.shutdown().expect("shutdown");
    drop(cache);
    let cache = common::open_crash(&cache_dev, &[&backing_a, &backing_b]);
    assert_eq!(
        cache.volumes()[1].stats().lines_used,
        cached,
        "the checkpoint of the clean stop holds the added volume's lines"
    );
    cache.shutdown().expect("shutdown");
}

#[test]
fn refused_additions_change_nothing() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, SIZE, 0);
    let backing_a = Arc::new(CrashDevice::new("backing-a", SIZE));
    let cache = common::open_crash(&cache_dev, &[&backing_a]);
    let dev = || Arc::new(MemDevice::new("added", SIZE)) as Arc<dyn BlockDevice>;
    let refused = |slot: VolumeSlot, backing: Arc<dyn BlockDevice>, why: &str| {
        let sequence = read_superblock(&*cache_dev).expect("superblock").sequence;
        match cache.add_volume(slot, backing) {
            Err(EngineError::AddRefused { why: got, .. }) => {
                assert!(got.contains(why), "refusal {got:?} should say {why:?}")
            }
            Err(e) => panic!("expected a refusal saying {why:?}, got {e}"),
            Ok(_) => panic!("expected a refusal saying {why:?}"),
        }
        assert_eq!(
            read_superblock(&*cache_dev).expect("superblock").sequence,
            sequence,
            "a refusal writes nothing"
        );
        assert_eq!(cache.volumes().len(), 1);
    };
    refused(slot(&cache, 0, "b", SIZE), dev(), "slot 0");
    refused(slot(&cache, 1, "v", SIZE), dev(), "volume of that name");
    refused(slot(&cache, 1, "b", 2 * SIZE), dev(), "slot records");
    let mut other_policy = slot(&cache, 1, "b", SIZE);
    other_policy.policy += 1;
    refused(other_policy, dev(), "policy");
    refused(
        slot(&cache, MAX_VOLUMES as u16, "b", SIZE),
        dev(),
        "format holds",
    );
    // Up to the format's limit, then no more.
    for id in 1..MAX_VOLUMES as u16 {
        cache
            .add_volume(slot(&cache, id, &format!("v{id}"), SIZE), dev())
            .expect("add up to the limit");
    }
    assert_eq!(cache.volumes().len(), MAX_VOLUMES);
    let sequence = read_superblock(&*cache_dev).expect("superblock").sequence;
    assert!(matches!(
        cache.add_volume(slot(&cache, 5, "one-more", SIZE), dev()),
        Err(EngineError::AddRefused { .. })
    ));
    assert_eq!(
        read_superblock(&*cache_dev).expect("superblock").sequence,
        sequence
    );
    cache.shutdown().expect("shutdown");
}

/// A volume removed while serving (`ssdcache volume remove` through the daemon): the cleaner
/// writes its dirty data back first (`request_volume_drain`) while the other volume's stays
/// dirty; `remove_volume` then takes it out. After a power cut the superblock names only the
/// other volume, which kept its data, and the removed volume's device holds all of its own.
/// Its slot id is not reused while the cache is open.
#[test]
fn a_volume_removed_while_serving_leaves_its_data_on_its_device() {
    let (cache_dev, [backing_a, backing_b]) = common::two_volume_cache(CACHE, LINE, [SIZE, SIZE]);
    let cache = Arc::new(common::open_crash(&cache_dev, &[&backing_a, &backing_b]));
    let a_data = data(11, 2 * MIB as usize);
    let b_data = data(12, 3 * MIB as usize);
    cache.volumes()[0]
        .write(0, &a_data, false)
        .expect("write a");
    cache.volumes()[1]
        .write(MIB, &b_data, false)
        .expect("write b");
    cache.volumes()[0].flush().expect("flush a");
    let a_dirty = cache.volumes()[0].stats().dirty_bytes;
    assert!(a_dirty > 0 && cache.volumes()[1].stats().dirty_bytes > 0);
    let refused = cache.remove_volume(1);
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("dirty data")),
        "removal with dirty data is refused: {refused:?}"
    );
    // Only the drain request may write anything back: no age, no dirty pressure (80 dirty
    // lines of about 230 are above the default high watermark).
    cache.start_cleaner(CleanerConfig {
        max_age: std::time::Duration::from_secs(3600),
        high_watermark: 0.99,
        low_watermark: 0.98,
        ..CleanerConfig::default()
    });
    cache.request_volume_drain(1, true);
    common::wait_for(
        "b's dirty data written back",
        std::time::Duration::from_secs(20),
        || cache.volumes()[1].stats().dirty_bytes == 0,
    );
    cache.request_volume_drain(1, false);
    assert_eq!(
        cache.volumes()[0].stats().dirty_bytes,
        a_dirty,
        "a's dirty data is not written back by b's removal"
    );
    cache.remove_volume(1).expect("remove b");
    assert_eq!(cache.volumes().len(), 1);
    assert_eq!(cache.volumes()[0].name(), "a");
    assert!(
        matches!(
            cache.add_volume(slot(&cache, 1, "c", SIZE), backing_b.clone()),
            Err(EngineError::AddRefused { why, .. }) if why.contains("freed by a removal")
        ),
        "b's slot is not reused while the cache is open"
    );
    let b_image = backing_b.durable_image();
    assert!(
        b_image[MIB as usize..4 * MIB as usize] == b_data[..],
        "b's data is durable on b's device when the removal returns"
    );

    let cache_after = Arc::new(cache_dev.crashed("cache-after", 3));
    let a_after = Arc::new(backing_a.crashed("a-after", 3));
    cache.stop_cleaner();
    drop(cache);
    let sb = read_superblock(&*cache_after).expect("superblock");
    let names: Vec<&str> = sb.volumes.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["a"], "the superblock names only a");
    let cache = common::open_crash(&cache_after, &[&a_after]);
    assert!(
        read_volume(&cache, 0, 0, a_data.len()) == a_data,
        "a kept its data"
    );
    assert_eq!(cache.volumes()[0].stats().dirty_bytes, a_dirty);
    // After a restart the slot may be used again, and the new volume reads its own device.
    let c = cache
        .add_volume(
            slot(&cache, 1, "c", SIZE),
            Arc::new(MemDevice::new("c", SIZE)),
        )
        .expect("slot 1 after a restart");
    let mut buf = vec![0xAAu8; 4 * MIB as usize];
    c.read(0, &mut buf).expect("read c");
    assert!(
        buf.iter().all(|&x| x == 0),
        "c reads its own (empty) device, not b's data"
    );
    cache.shutdown().expect("shutdown");
}
