//! Hits in batches (`Volume::read_many`, issue 11): the cache device is a real file read
//! through io_uring, and every read returns what a one-at-a-time `read` would.

mod common;

use std::time::{Duration, Instant};

use common::file_cache::*;
use common::*;
use ssdcache_device::{uring, BlockDevice, FileDevice, OpenOptions};
use ssdcache_engine::{BatchRead, Cache};

/// Every loop of the concurrent tests ends after this many rounds or this long.
const ROUNDS: usize = 300;
const TIME_LIMIT: Duration = Duration::from_secs(20);

/// Reads `ranges` (offset, length) as one batch; the buffers and results.
fn batch(cache: &Cache, ranges: &[(u64, usize)]) -> Vec<(Vec<u8>, ssdcache_engine::Result<()>)> {
    let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, len)| vec![0u8; len]).collect();
    let mut reads: Vec<BatchRead<'_>> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, _), buf)| BatchRead::new(offset, buf))
        .collect();
    cache.volumes()[0].read_many(&mut reads);
    let results: Vec<_> = reads.into_iter().map(|r| r.result).collect();
    bufs.into_iter().zip(results).collect()
}

#[test]
fn a_batch_of_hits_misses_and_repeats_reads_what_the_device_holds() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    let vol = cache.volumes()[0].clone();
    // Lines 0..8 cached by reading them once.
    for line in 0..8 {
        read_vec(&cache, line * LINE, LINE).expect("warm");
    }
    let hits_before = counter(&vol, "read_hits");
    let ring_before = uring::io_uring_reads();
    let ranges = [
        (0, 4096),
        (LINE + 8192, 16384),
        (40 * LINE, 4096),             // a miss
        (LINE + 8192, 4096),           // the same line as a hit before it in the batch
        (8 * LINE - 4096, 8192),       // across two lines: one cached, one not
        (2 * LINE, 2 * LINE as usize), // two whole cached lines
    ];
    for ((buf, result), &(offset, _)) in batch(&cache, &ranges).iter().zip(&ranges) {
        assert!(result.is_ok(), "read at {offset}: {result:?}");
        assert_whole_sectors(offset, buf, 0);
    }
    assert_eq!(
        counter(&vol, "read_hits") - hits_before,
        4,
        "hits counted once each"
    );
    assert!(
        uring::io_uring_reads() > ring_before,
        "the hits went through io_uring"
    );
}

#[test]
fn a_checksum_mismatch_in_a_batch_is_read_from_the_backing_device() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    let vol = cache.volumes()[0].clone();
    for line in 0..16 {
        read_vec(&cache, line * LINE, LINE).expect("warm");
    }
    // Damage every cached line's data behind the engine's back.
    let layout = cache.layout();
    let region = layout.data_offset..layout.data_offset + layout.line_count * layout.line_size;
    let damage = FileDevice::open(
        &dir.path().join("cache"),
        OpenOptions {
            write: true,
            direct: false,
            lock: false,
        },
    )
    .expect("second handle");
    damage
        .write_at(
            &vec![0xa5; (region.end - region.start) as usize],
            region.start,
        )
        .expect("damage");
    damage.flush().expect("flush");
    let ranges: Vec<(u64, usize)> = (0..16).map(|line| (line * LINE + 4096, 8192)).collect();
    for ((buf, result), &(offset, _)) in batch(&cache, &ranges).iter().zip(&ranges) {
        assert!(result.is_ok(), "read at {offset}: {result:?}");
        assert_whole_sectors(offset, buf, 0);
    }
    let caught = counter(&vol, "checksum_errors");
    let hits = counter(&vol, "read_hits");
    // Each damaged read is caught and served from the backing device, until the volume stops
    // using a cache device that fails this often (CACHE_ERROR_LIMIT).
    assert!(caught >= 8, "damaged sectors caught: {caught}");
    assert_eq!(hits, 0, "no damaged read counted as a hit");
}

#[test]
fn evictions_and_writes_racing_batches_never_give_wrong_data() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // 16 MiB of cache (a few hundred lines) under reads of 256 MiB: lines are evicted all along.
    let (_backing, cache) = file_cache(&dir, 16 << 20, 256 << 20);
    let vol = cache.volumes()[0].clone();
    let start = Instant::now();
    let max_version = ROUNDS as u64;
    std::thread::scope(|scope| {
        // Whole-sector writes to lines the batches read (versions 1..=ROUNDS).
        let writer = vol.clone();
        scope.spawn(move || {
            for version in 1..=max_version {
                if start.elapsed() > TIME_LIMIT {
                    break;
                }
                for s in [1u64, 17, 40, 100] {
                    let d = sector_data(s, version);
                    writer.write(s * SECTOR as u64, &d, false).expect("write");
                }
            }
        });
        // Misses all over the volume, which evict.
        let evictor = vol.clone();
        scope.spawn(move || {
            let mut rng = Rng(7);
            for _ in 0..ROUNDS * 4 {
                if start.elapsed() > TIME_LIMIT {
                    break;
                }
                let offset = rng.next_u64() % 4096 * LINE;
                let mut buf = vec![0u8; LINE as usize];
                evictor.read(offset, &mut buf).expect("evicting read");
            }
        });
        for round in 0..ROUNDS {
            if start.elapsed() > TIME_LIMIT {
                break;
            }
            let ranges: Vec<(u64, usize)> = (0..24)
                .map(|i| (((round as u64 + i * 5) % 12) * 4 * SECTOR as u64, 8192))
                .collect();
            for ((buf, result), &(offset, _)) in batch(&cache, &ranges).iter().zip(&ranges) {
                assert!(result.is_ok(), "read at {offset}: {result:?}");
                assert_whole_sectors(offset, buf, max_version);
            }
        }
    });
    assert!(counter(&vol, "read_hits") > 0, "some batched reads hit");
}

#[test]
fn without_io_uring_a_batch_is_served_by_synchronous_reads() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    for line in 0..4 {
        read_vec(&cache, line * LINE, LINE).expect("warm");
    }
    uring::set_io_uring_enabled(false);
    let ring_before = uring::io_uring_reads();
    let ranges: Vec<(u64, usize)> = (0..32)
        .map(|i| ((i % 4) * LINE + (i / 4) * 4096, 4096))
        .collect();
    let results = batch(&cache, &ranges);
    let ring_after = uring::io_uring_reads();
    uring::set_io_uring_enabled(true);
    for ((buf, result), &(offset, _)) in results.iter().zip(&ranges) {
        assert!(result.is_ok(), "read at {offset}: {result:?}");
        assert_whole_sectors(offset, buf, 0);
    }
    assert_eq!(ring_after, ring_before, "io_uring used while disabled");
    assert_eq!(
        counter(&cache.volumes()[0], "read_hits"),
        32,
        "every read hit"
    );
}
