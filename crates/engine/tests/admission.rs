//! Admission in the engine, seen on the devices: with N-hit, lines missed once cost no cache
//! write, write misses not admitted go to the backing device (durably in write-back), hits
//! are never refused, and the setting survives a restart.

use std::sync::Arc;

mod common;

use common::{counter, format_dev, open_dyn, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{MemDevice, Op, RecordingDevice};
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{read_superblock, write_superblock, Cache, EngineError};
use ssdcache_format::CacheMode;

const CACHE: u64 = 16 * MIB;
const BACKING: u64 = 64 * MIB;
const LINE: u64 = 64 << 10;

struct Rig {
    cache_dev: Arc<RecordingDevice<MemDevice>>,
    backing: Arc<RecordingDevice<MemDevice>>,
    cache: Cache,
}

impl Rig {
    /// A cache with `admission` and no sequential cutoff, both devices recorded; the records
    /// start empty (the writes of format and open are forgotten).
    fn new(mode: CacheMode, admission: Admission) -> Rig {
        let cache_dev = Arc::new(RecordingDevice::new(Arc::new(MemDevice::new(
            "cache", CACHE,
        ))));
        let backing = Arc::new(RecordingDevice::new(Arc::new(MemDevice::new(
            "backing", BACKING,
        ))));
        common::ADMISSION.with(|a| a.set(admission));
        format_dev(&*cache_dev, LINE, mode, BACKING, 0);
        common::ADMISSION.with(|a| a.set(Admission::Always));
        let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
        cache_dev.clear();
        backing.clear();
        Rig {
            cache_dev,
            backing,
            cache,
        }
    }

    fn vol(&self) -> Arc<ssdcache_engine::Volume> {
        self.cache.volumes()[0].clone()
    }

    /// Bytes written to the cache's data area since the last `clear` (metadata excluded).
    fn cache_data_written(&self) -> u64 {
        let data_offset = self.cache.layout().data_offset;
        writes(&self.cache_dev.ops(), data_offset)
    }

    fn backing_written(&self) -> u64 {
        writes(&self.backing.ops(), 0)
    }

    fn clear(&self) {
        self.cache_dev.clear();
        self.backing.clear();
    }
}

fn writes(ops: &[Op], from: u64) -> u64 {
    ops.iter()
        .map(|op| match *op {
            Op::Write { offset, len } if offset >= from => len,
            _ => 0,
        })
        .sum()
}

/// Lines far apart (no stream), in an order that is not sequential either.
fn scattered_lines(count: u64) -> Vec<u64> {
    (0..count).map(|i| (i * 37) % 512 * LINE).collect()
}

#[test]
fn one_hit_wonders_cost_no_cache_write_and_the_second_miss_caches() {
    for mode in [
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::WriteBack,
    ] {
        let rig = Rig::new(mode, Admission::NHit(2));
        let vol = rig.vol();
        let lines = scattered_lines(100);
        let mut buf = vec![0u8; 8192];
        for &at in &lines {
            vol.read(at + 4096, &mut buf).expect("read");
        }
        assert_eq!(
            rig.cache_data_written(),
            0,
            "{mode}: lines read once were written to the cache"
        );
        assert_eq!(counter(&vol, "bytes_to_cache"), 0, "{mode}");
        assert_eq!(
            counter(&vol, "bytes_not_admitted"),
            100 * 8192,
            "{mode}: every first miss is counted as not admitted"
        );
        assert_eq!(counter(&vol, "read_misses"), 100, "{mode}");
        // A refused partial-line miss reads what was asked, not the whole line.
        let backing_reads: u64 = rig
            .backing
            .ops()
            .iter()
            .map(|op| match *op {
                Op::Read { len, .. } => len,
                _ => 0,
            })
            .sum();
        assert_eq!(backing_reads, 100 * 8192, "{mode}");

        // The second miss of each line admits it: the whole line is cached.
        rig.clear();
        for &at in &lines {
            vol.read(at + 4096, &mut buf).expect("read");
        }
        assert_eq!(rig.cache_data_written(), 100 * LINE, "{mode}");
        assert_eq!(counter(&vol, "read_hits"), 0, "{mode}");
        // From then on the line is a hit, served by the cache alone.
        rig.clear();
        for &at in &lines {
            vol.read(at, &mut buf).expect("read");
        }
        assert_eq!(counter(&vol, "read_hits"), 100, "{mode}");
        assert!(rig.backing.ops().is_empty(), "{mode}: hits read the disk");
        assert_eq!(
            counter(&vol, "bytes_not_admitted"),
            100 * 8192,
            "{mode}: hits are never refused"
        );
    }
}

#[test]
fn always_admits_the_first_miss() {
    let rig = Rig::new(CacheMode::WriteThrough, Admission::Always);
    let vol = rig.vol();
    let mut buf = vec![0u8; 4096];
    for &at in &scattered_lines(10) {
        vol.read(at, &mut buf).expect("read");
    }
    assert_eq!(rig.cache_data_written(), 10 * LINE);
    assert_eq!(counter(&vol, "bytes_not_admitted"), 0);
}

#[test]
fn write_back_write_misses_not_admitted_go_to_the_disk_durably() {
    let rig = Rig::new(CacheMode::WriteBack, Admission::NHit(2));
    let vol = rig.vol();
    let data = common::data(1, 16384);
    vol.write(3 * LINE, &data, true).expect("fua write");
    assert_eq!(rig.cache_data_written(), 0, "first write miss cached");
    assert_eq!(rig.backing_written(), 16384);
    let flushed = rig
        .backing
        .ops()
        .iter()
        .skip_while(|op| !matches!(op, Op::Write { .. }))
        .any(|op| *op == Op::Flush);
    assert!(flushed, "a FUA write that went around must flush the disk");
    assert_eq!(counter(&vol, "bytes_not_admitted"), 16384);
    assert_eq!(rig.cache.dirty_bytes(), 0);

    // The second write miss of the line is admitted: into the cache, dirty, disk untouched.
    rig.clear();
    let newer = common::data(2, 16384);
    vol.write(3 * LINE, &newer, false).expect("write");
    assert_eq!(rig.cache_data_written(), 16384);
    assert_eq!(rig.backing_written(), 0);
    assert_eq!(rig.cache.dirty_bytes(), 16384);
    // A write hit is never refused, even to a part of the line not cached yet.
    rig.clear();
    vol.write(3 * LINE + 32768, &newer[..4096], false)
        .expect("write hit");
    assert_eq!(rig.cache_data_written(), 4096);
    assert_eq!(rig.backing_written(), 0);
    assert_eq!(counter(&vol, "write_hits"), 1);
    let mut back = vec![0u8; 16384];
    vol.read(3 * LINE, &mut back).expect("read");
    assert!(back == newer, "read after write-back writes");
}

#[test]
fn write_through_write_misses_not_admitted_are_not_cached() {
    let rig = Rig::new(CacheMode::WriteThrough, Admission::NHit(3));
    let vol = rig.vol();
    for round in 1..=3u64 {
        rig.clear();
        vol.write(5 * LINE, &common::data(round, 65536), false)
            .expect("write");
        assert_eq!(rig.backing_written(), 65536, "round {round}");
        let cached = rig.cache_data_written();
        assert_eq!(cached, if round == 3 { 65536 } else { 0 }, "round {round}");
    }
    let mut back = vec![0u8; 65536];
    rig.clear();
    vol.read(5 * LINE, &mut back).expect("read");
    assert!(back == common::data(3, 65536));
    assert!(
        rig.backing.ops().is_empty(),
        "the third write cached the line"
    );
}

#[test]
fn prefetch_is_not_subject_to_admission() {
    let rig = Rig::new(CacheMode::WriteThrough, Admission::NHit(2));
    let vol = rig.vol();
    vol.prefetch(0, 4 * LINE).expect("prefetch");
    assert_eq!(rig.cache_data_written(), 4 * LINE);
    assert_eq!(counter(&vol, "bytes_not_admitted"), 0);
}

#[test]
fn admission_survives_a_restart_and_unknown_codes_are_refused() {
    let rig = Rig::new(CacheMode::WriteThrough, Admission::NHit(4));
    assert_eq!(rig.vol().admission(), Admission::NHit(4));
    rig.cache.shutdown().expect("shutdown");
    let Rig {
        cache_dev,
        backing,
        cache,
    } = rig;
    drop(cache);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    assert_eq!(cache.volumes()[0].admission(), Admission::NHit(4));
    assert_eq!(
        cache.superblock().volumes[0].admission,
        4,
        "the superblock keeps the code"
    );
    cache.shutdown().expect("shutdown");
    drop(cache);

    let mut sb = read_superblock(&*cache_dev).expect("superblock");
    sb.volumes[0].admission = 1;
    write_superblock(&*cache_dev, &sb).expect("write superblock");
    let sb = read_superblock(&*cache_dev).expect("superblock");
    let err = Cache::open(
        cache_dev.clone() as Arc<dyn BlockDevice>,
        sb,
        vec![backing.clone() as Arc<dyn BlockDevice>],
    )
    .err()
    .expect("an unknown admission code must be refused");
    assert!(matches!(err, EngineError::Format(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("volume 'v'") && msg.contains("admission code 1"),
        "{msg}"
    );
    // Refused before anything was written: the cache is still cleanly stopped.
    let after = read_superblock(&*cache_dev).expect("superblock");
    assert_eq!(after.state, ssdcache_format::CacheState::Clean);
}
