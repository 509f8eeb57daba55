//! Two volumes on one cache (issue 12 item 1's ground: the format has 32 volume slots, and
//! until now every engine test used one). Both write-back, their working sets together
//! larger than the cache so lines of each evict lines of the other: every read matches its
//! own volume's model, a power cut after a FLUSH of each loses nothing of either, write-back
//! puts each volume's data on its own backing device only, and the per-volume occupancy adds
//! up to what the cache holds.

mod common;

use std::sync::Arc;

use common::{data, Rng, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{Cache, CleanerConfig};

const LINE: u64 = 64 << 10;
const CACHE: u64 = 16 * MIB;
const SIZES: [u64; 2] = [32 * MIB, 24 * MIB];

fn two_volume_cache() -> (Arc<CrashDevice>, [Arc<CrashDevice>; 2]) {
    common::two_volume_cache(CACHE, LINE, SIZES)
}

fn open(cache_dev: &Arc<CrashDevice>, backings: &[Arc<CrashDevice>; 2]) -> Cache {
    common::open_crash(cache_dev, &[&backings[0], &backings[1]])
}

fn assert_matches(cache: &Cache, models: &[Vec<u8>; 2], what: &str) {
    for (v, model) in cache.volumes().iter().zip(models) {
        let mut buf = vec![0u8; MIB as usize];
        for (i, want) in model.chunks(MIB as usize).enumerate() {
            v.read(i as u64 * MIB, &mut buf).expect("read");
            if let Some(bad) = (0..want.len()).find(|&j| buf[j] != want[j]) {
                panic!(
                    "{what}: volume {} differs at byte {}",
                    v.name(),
                    i as u64 * MIB + bad as u64
                );
            }
        }
    }
}

/// Random 4–64 KiB writes to both volumes (tagged by volume), into the models.
fn write_both(cache: &Cache, models: &mut [Vec<u8>; 2], rng: &mut Rng, count: usize, tag: u64) {
    for i in 0..count {
        let v = i % 2;
        let sectors = 1 + rng.next_u64() % 16;
        let len = sectors * 4096;
        let at = (rng.next_u64() % (SIZES[v] / 4096 - sectors)) * 4096;
        let buf = data(
            tag * 1_000_000 + (v as u64) * 100_000 + i as u64,
            len as usize,
        );
        cache.volumes()[v].write(at, &buf, false).expect("write");
        models[v][at as usize..(at + len) as usize].copy_from_slice(&buf);
    }
}

#[test]
fn two_volumes_share_the_cache_and_keep_their_own_data() {
    let (cache_dev, backings) = two_volume_cache();
    let cache = open(&cache_dev, &backings);
    assert_eq!(cache.volumes().len(), 2);
    let mut models = [vec![0u8; SIZES[0] as usize], vec![0u8; SIZES[1] as usize]];
    let mut rng = Rng(12);
    // 56 MiB of address space behind 16 MiB of cache (about 13 for data): the volumes evict each other's lines.
    write_both(&cache, &mut models, &mut rng, 6_000, 1);
    assert_matches(&cache, &models, "while both write");
    let used: u64 = cache.volumes().iter().map(|v| v.stats().lines_used).sum();
    assert!(
        used <= CACHE / LINE,
        "{used} lines used by the volumes together"
    );
    assert!(
        cache.volumes().iter().all(|v| v.stats().lines_used > 0),
        "both volumes hold lines"
    );
    for v in cache.volumes().iter() {
        v.flush().expect("flush");
    }
    // A power cut right after the FLUSHes: only flushed data is left on either device.
    let crashed_cache = Arc::new(cache_dev.crashed("cache", 99));
    let crashed_backings = [
        Arc::new(backings[0].crashed("backing-a", 98)),
        Arc::new(backings[1].crashed("backing-b", 97)),
    ];
    drop(cache);
    let cache = open(&crashed_cache, &crashed_backings);
    assert_matches(&cache, &models, "after a power cut after FLUSH");
    // Write-back puts each volume's data on its own backing device.
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_bytes(), 0);
    for (i, b) in crashed_backings.iter().enumerate() {
        b.flush().expect("flush backing");
        assert!(
            b.durable_image() == models[i],
            "backing device of volume {} differs from what was written to it",
            ["a", "b"][i]
        );
    }
    // More writes, a clean stop, a restart: both volumes intact.
    write_both(&cache, &mut models, &mut rng, 1_000, 2);
    cache.shutdown().expect("shutdown");
    drop(cache);
    let cache = open(&crashed_cache, &crashed_backings);
    assert_matches(&cache, &models, "after a clean restart");
    let dirty: u64 = cache.volumes().iter().map(|v| v.stats().dirty_bytes).sum();
    assert_eq!(dirty, cache.dirty_bytes(), "per-volume dirty bytes add up");
}

/// A volume's own dirty cap (`Volume::set_dirty_cap`, the config file's per-volume
/// `dirty_limit`): past it, its writes to new lines go around while the other volume's are
/// still absorbed, its data reads back exactly, and the cleaner writes its lines back (not the
/// other's) once it nears the cap.
#[test]
fn a_volumes_dirty_cap_leaves_the_others_their_write_back_room() {
    let (cache_dev, backings) = two_volume_cache();
    let cache = Arc::new(open(&cache_dev, &backings));
    let lines = cache.layout().line_count;
    let (a, b) = (&cache.volumes()[0], &cache.volumes()[1]);
    a.set_dirty_cap(Some(0.1));
    let cap = a.dirty_cap_lines().expect("a cap");
    assert_eq!(cap, lines / 10);
    let a_data = data(31, 8 * MIB as usize);
    a.write(0, &a_data, false).expect("write a");
    assert!(
        a.stats().dirty_lines <= cap,
        "a holds {} dirty lines, its cap is {cap}",
        a.stats().dirty_lines
    );
    assert!(
        common::counter(a, "bytes_written_around_full") > 0,
        "a's writes past its cap went around"
    );
    let b_data = data(32, 4 * MIB as usize);
    b.write(0, &b_data, false).expect("write b");
    assert_eq!(
        b.stats().dirty_bytes,
        4 * MIB,
        "b's writes are all absorbed"
    );
    let mut buf = vec![0u8; a_data.len()];
    a.read(0, &mut buf).expect("read a");
    assert!(
        buf == a_data,
        "a reads back what it wrote, around the cache or not"
    );
    // No watermark or age applies: only the cap makes the cleaner write a's lines back.
    cache.start_cleaner(CleanerConfig {
        high_watermark: 0.95,
        low_watermark: 0.9,
        max_age: std::time::Duration::from_secs(3600),
        ..CleanerConfig::default()
    });
    common::wait_for(
        "a below 90% of its cap",
        std::time::Duration::from_secs(20),
        || a.stats().dirty_lines * 10 < cap * 9,
    );
    cache.stop_cleaner();
    assert_eq!(
        b.stats().dirty_bytes,
        4 * MIB,
        "b's dirty data was left alone"
    );
    a.set_dirty_cap(None);
    assert_eq!(a.dirty_cap_lines(), None);
    cache.shutdown().expect("shutdown");
}

/// Reads `lines` whole lines of volume `v` in a scrambled order (no stream forms), starting
/// at line `first`.
fn read_lines(v: &ssdcache_engine::Volume, first: u64, lines: u64) {
    let mut buf = vec![0u8; LINE as usize];
    for k in 0..lines {
        let line = first + (k * 7919) % lines;
        v.read(line * LINE, &mut buf).expect("read");
    }
}

/// A volume's occupancy cap (`Volume::set_occupancy_cap`, the config file's per-volume
/// `occupancy_limit`): however much it reads or writes, it holds no more lines than its cap
/// and never takes the other volume's lines for its own; its dirty lines stay within the cap
/// (writes past it go around and read back exactly); a lowered cap shrinks it as it misses; a
/// cap removed lets it grow again.
#[test]
fn a_volumes_occupancy_cap_keeps_it_to_its_share_and_off_the_others_lines() {
    let (cache_dev, backings) = two_volume_cache();
    let cache = open(&cache_dev, &backings);
    let lines = cache.layout().line_count;
    let (a, b) = (&cache.volumes()[0], &cache.volumes()[1]);
    read_lines(b, 0, 64);
    assert_eq!(b.stats().lines_used, 64, "b's reads were cached");
    a.set_occupancy_cap(Some(0.25));
    let cap = a.occupancy_cap_lines().expect("a cap");
    assert_eq!(cap, lines / 4);
    assert_eq!(a.dirty_room_lines(), Some(cap), "its dirty lines too");
    read_lines(a, 0, SIZES[0] / LINE);
    assert_eq!(a.stats().lines_used, cap, "a fills its cap and stays there");
    assert_eq!(b.stats().lines_used, 64, "a took none of b's lines");
    // Write-back writes to new lines: dirty lines within the cap, the rest written around.
    let a_data = data(41, 12 * MIB as usize);
    a.write(0, &a_data, false).expect("write a");
    assert!(a.stats().lines_used <= cap, "{:?}", a.stats());
    assert!(a.stats().dirty_lines <= cap, "{:?}", a.stats());
    assert!(
        common::counter(a, "bytes_written_around_full") > 0,
        "a's writes past its cap went around"
    );
    let mut buf = vec![0u8; a_data.len()];
    a.read(0, &mut buf).expect("read a");
    assert!(buf == a_data, "a reads back what it wrote");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    // A lowered cap: a shrinks to it as it misses, b still untouched.
    a.set_occupancy_cap(Some(0.1));
    let lower = a.occupancy_cap_lines().expect("a cap");
    read_lines(a, 200, cap);
    assert!(
        a.stats().lines_used <= lower,
        "a holds {} lines, its lowered cap is {lower}",
        a.stats().lines_used
    );
    assert_eq!(b.stats().lines_used, 64, "a took none of b's lines");
    // No cap: a takes what the policy gives it.
    a.set_occupancy_cap(None);
    assert_eq!(a.occupancy_cap_lines(), None);
    read_lines(a, 300, 100);
    assert!(a.stats().lines_used > lower + 50, "{:?}", a.stats());
    let mut buf = vec![0u8; a_data.len()];
    a.read(0, &mut buf).expect("read a");
    assert!(buf == a_data, "a still reads back what it wrote");
    cache.shutdown().expect("shutdown");
}

/// Admission and the sequential cutoff change while the cache is open (`serve`'s reload and
/// `ssdcache volume set`), take effect on the next request, and are kept in the superblock.
#[test]
fn admission_and_sequential_cutoff_change_online_and_are_kept() {
    use ssdcache_engine::admission::Admission;
    let (cache_dev, backings) = two_volume_cache();
    let cache = open(&cache_dev, &backings);
    let a = cache.volumes()[0].clone();
    assert_eq!(a.admission(), Admission::Always);
    a.set_admission(Admission::NHit(2));
    let mut buf = vec![0u8; LINE as usize];
    a.read(5 * LINE, &mut buf).expect("read");
    assert_eq!(a.stats().lines_used, 0, "2-hit: a first miss is not cached");
    a.read(5 * LINE, &mut buf).expect("read");
    assert_eq!(a.stats().lines_used, 1, "2-hit: the second miss is");
    a.set_admission(Admission::Always);
    a.read(9 * LINE, &mut buf).expect("read");
    assert_eq!(a.stats().lines_used, 2, "always: a first miss is cached");
    assert_eq!(a.sequential_cutoff(), 0);
    a.set_sequential_cutoff(MIB);
    let mut big = vec![0u8; 256 << 10];
    for i in 0..32u64 {
        a.read(8 * MIB + i * (256 << 10), &mut big).expect("read");
    }
    assert!(
        common::counter(&a, "bytes_bypassed") >= 4 * MIB,
        "a stream past the new cutoff bypassed the cache: {}",
        common::counter(&a, "bytes_bypassed")
    );
    a.set_admission(Admission::NHit(3));
    cache.persist_config().expect("persist");
    drop(a);
    cache.shutdown().expect("shutdown");
    drop(cache);
    let cache = open(&cache_dev, &backings);
    let a = &cache.volumes()[0];
    assert_eq!(a.admission(), Admission::NHit(3), "kept across a restart");
    assert_eq!(a.sequential_cutoff(), MIB, "kept across a restart");
    assert_eq!(cache.volumes()[1].admission(), Admission::Always);
    cache.shutdown().expect("shutdown");
}
