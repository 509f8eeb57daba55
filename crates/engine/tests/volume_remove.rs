//! Removing a volume (`Cache::empty_volume`, then its slot taken out of the superblock): its
//! dirty data reaches its own backing device, no line of it is left, the other volume keeps
//! its data and stays warm, and a volume added later in the same slot id reads its own device,
//! never the removed volume's cached data.

mod common;

use std::sync::Arc;

use common::{data, identity, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{read_superblock, write_superblock, CleanerConfig};

const LINE: u64 = 64 << 10;
const CACHE: u64 = 16 * MIB;
const SIZES: [u64; 2] = [8 * MIB, 8 * MIB];

#[test]
fn a_removed_volume_leaves_nothing_a_new_volume_in_its_slot_could_read() {
    let (cache_dev, [backing_a, backing_b]) = common::two_volume_cache(CACHE, LINE, SIZES);
    let a_data = data(1, 2 * MIB as usize);
    let b_dirty = data(2, MIB as usize);
    let b_clean = data(3, MIB as usize);
    let cache = common::open_crash(&cache_dev, &[&backing_a, &backing_b]);
    cache.volumes()[0]
        .write(0, &a_data, false)
        .expect("write a");
    // b: 1 MiB dirty, and 1 MiB written, written back (clean in the cache) and read again.
    cache.volumes()[1]
        .write(2 * MIB, &b_clean, false)
        .expect("write b");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert!(common::read_volume(&cache, 1, 2 * MIB, MIB as usize) == b_clean);
    cache.volumes()[1]
        .write(0, &b_dirty, false)
        .expect("write b");
    cache.volumes()[0]
        .write(4 * MIB, &a_data[..MIB as usize], false)
        .expect("write a");
    let a_dirty_before = cache.volumes()[0].stats().dirty_bytes;
    assert!(cache.volumes()[1].stats().lines_used > 0);

    let mut reports = Vec::new();
    cache
        .empty_volume(1, &CleanerConfig::default(), &mut |left| {
            reports.push(left);
            true
        })
        .expect("empty volume b");
    assert!(
        reports.first() == Some(&MIB),
        "progress starts at b's dirty bytes: {reports:?}"
    );
    let b = cache.volumes()[1].stats();
    assert_eq!(
        (b.lines_used, b.dirty_bytes),
        (0, 0),
        "nothing of b is left"
    );
    assert_eq!(
        cache.volumes()[0].stats().dirty_bytes,
        a_dirty_before,
        "a's dirty data is not written back by b's removal"
    );
    backing_b.flush().expect("flush");
    let image = backing_b.durable_image();
    assert!(
        image[..MIB as usize] == b_dirty[..],
        "b's dirty data on its device"
    );
    assert!(image[2 * MIB as usize..3 * MIB as usize] == b_clean[..]);
    cache.shutdown().expect("shutdown");
    drop(cache);

    // b's slot goes; a new volume c takes the same id, on a device of zeroes.
    let mut sb = read_superblock(&*cache_dev).expect("superblock");
    let mut slot_c = sb.volumes[1].clone();
    sb.volumes.retain(|v| v.id != 1);
    sb.sequence += 1;
    write_superblock(&*cache_dev, &sb).expect("write superblock");
    slot_c.name = "c".into();
    slot_c.uuid = [9; 16];
    slot_c.backing = identity(SIZES[1]);
    sb.volumes.push(slot_c);
    sb.sequence += 1;
    write_superblock(&*cache_dev, &sb).expect("write superblock");
    let backing_c = Arc::new(CrashDevice::new("backing-c", SIZES[1]));
    let cache = common::open_crash(&cache_dev, &[&backing_a, &backing_c]);
    assert_eq!(cache.volumes()[1].name(), "c");
    assert_eq!(cache.volumes()[1].stats().lines_used, 0, "c starts empty");
    assert!(
        common::read_volume(&cache, 1, 0, 3 * MIB as usize)
            .iter()
            .all(|&b| b == 0),
        "c reads its own device (zeroes), not b's data"
    );
    assert!(
        common::read_volume(&cache, 0, 0, 2 * MIB as usize) == a_data,
        "a kept its data"
    );
    assert_eq!(cache.volumes()[0].stats().dirty_bytes, a_dirty_before);
    cache.shutdown().expect("shutdown");
}
