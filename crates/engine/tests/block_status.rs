//! Block status (issue 13, item 3): a volume reports the backing file's holes, with what the
//! cache holds dirty counted as data, in every mode, before and after writeback.

mod common;

use std::sync::Arc;

use common::{data, MIB};
use ssdcache_device::{BlockDevice, FileDevice, OpenOptions, Run};
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{Cache, CleanerConfig};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SIZE: u64 = 16 * MIB;

/// A sparse backing file of `SIZE` with data at 1 MiB (64 KiB) and 8 MiB (4 KiB), and a cache
/// over it.
fn sparse_cache(dir: &std::path::Path, mode: CacheMode) -> Cache {
    let path = dir.join(format!("backing-{mode:?}"));
    let file = std::fs::File::create(&path).expect("backing file");
    file.set_len(SIZE).expect("size");
    drop(file);
    let opts = OpenOptions {
        write: true,
        direct: false,
        lock: false,
    };
    let backing = FileDevice::open(&path, opts).expect("open backing");
    backing
        .write_at(&data(1, LINE as usize), MIB)
        .expect("data");
    backing.write_at(&data(2, 4096), 8 * MIB).expect("data");
    let backing: Arc<dyn BlockDevice> = Arc::new(backing);
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    common::format_dev(&*cache_dev, LINE, mode, SIZE, 0);
    common::open_dyn(cache_dev, backing).0
}

/// Whether byte `at` is in a hole, by the runs from `offset`.
fn is_hole(runs: &[Run], offset: u64, at: u64) -> Option<bool> {
    let mut end = offset;
    runs.iter()
        .find(|r| {
            end += r.len;
            at < end
        })
        .map(|r| r.hole)
}

fn whole_status(cache: &Cache) -> Vec<Run> {
    let vol = &cache.volumes()[0];
    let runs = vol.allocation(0, SIZE).expect("allocation");
    assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), SIZE, "{runs:?}");
    runs
}

#[test]
fn holes_of_the_backing_file_and_dirty_data_over_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    for mode in [
        CacheMode::WriteBack,
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::PassThrough,
    ] {
        let cache = sparse_cache(dir.path(), mode);
        let vol = cache.volumes()[0].clone();
        let runs = whole_status(&cache);
        assert_eq!(is_hole(&runs, 0, 0), Some(true), "{mode:?}: {runs:?}");
        assert_eq!(is_hole(&runs, 0, MIB), Some(false), "{mode:?}");
        assert_eq!(is_hole(&runs, 0, 8 * MIB), Some(false), "{mode:?}");
        assert_eq!(is_hole(&runs, 0, 4 * MIB), Some(true), "{mode:?}");
        // A read of a hole caches zeroes (clean): still a hole.
        let mut buf = vec![1u8; 8192];
        vol.read(4 * MIB, &mut buf).expect("read");
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(
            is_hole(&whole_status(&cache), 0, 4 * MIB),
            Some(true),
            "{mode:?}"
        );
        // A write into a hole: data at once (dirty in write-back, on the disk otherwise),
        // including a partial-sector write; the rest of its line stays a hole.
        vol.write(12 * MIB, &data(3, 4096), false).expect("write");
        vol.write(13 * MIB + 100, &[7u8; 10], false)
            .expect("partial write");
        for when in ["written", "after writeback"] {
            let runs = whole_status(&cache);
            assert_eq!(is_hole(&runs, 0, 12 * MIB), Some(false), "{mode:?} {when}");
            assert_eq!(
                is_hole(&runs, 0, 13 * MIB + 100),
                Some(false),
                "{mode:?} {when}"
            );
            assert_eq!(
                is_hole(&runs, 0, 12 * MIB + 8192),
                Some(true),
                "{mode:?} {when}"
            );
            cache
                .drain(&CleanerConfig::default(), &mut |_| true)
                .expect("drain");
        }
        // A query from the middle of a hole, and one of a few bytes.
        let runs = vol.allocation(5 * MIB + 7, 100).expect("allocation");
        assert_eq!(
            runs,
            [Run {
                len: 100,
                hole: true
            }],
            "{mode:?}"
        );
        let runs = vol.allocation(12 * MIB + 5, 10).expect("allocation");
        assert_eq!(
            runs,
            [Run {
                len: 10,
                hole: false
            }],
            "{mode:?}"
        );
        assert!(vol.allocation(SIZE - 10, 20).is_err(), "past the end");
    }
}

/// Dirty data in the cache spread over many lines: every dirty sector is data, and an answer
/// never claims more than it describes.
#[test]
fn scattered_dirty_sectors_in_a_hole_are_each_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = sparse_cache(dir.path(), CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    // More dirty ranges than one answer can show (256 runs): answers end early, never wrong.
    let written: Vec<u64> = (0..600u64)
        .map(|i| 2 * MIB + i * 3 * 4096 + (i % 3) * 512)
        .collect();
    for (i, &at) in written.iter().enumerate() {
        vol.write(at, &data(i as u64, 512), false).expect("write");
    }
    let mut runs = Vec::new();
    let mut at = 0;
    for _ in 0..10_000 {
        if at >= SIZE {
            break;
        }
        let answer = vol.allocation(at, SIZE - at).expect("allocation");
        assert!(!answer.is_empty() && answer.len() <= 256);
        for r in answer {
            runs.push((at, r));
            at += r.len;
        }
    }
    assert_eq!(at, SIZE, "the answers cover the volume");
    for &w in &written {
        let hole = runs
            .iter()
            .find(|(start, r)| w >= *start && w < start + r.len)
            .map(|(_, r)| r.hole);
        assert_eq!(
            hole,
            Some(false),
            "a dirty sector at {w} reported as a hole"
        );
    }
    let holes: u64 = runs
        .iter()
        .filter(|(_, r)| r.hole)
        .map(|(_, r)| r.len)
        .sum();
    assert!(
        holes >= SIZE - 4 * MIB,
        "most of the volume is a hole: {holes}"
    );
}
