//! Review 16: adversarial tests of commit 29d7437 (write-through and write-around writes
//! release their lines during the disk write; `backing_order.rs`). Each test holds one disk
//! write at the gate (`GateDevice`) and runs another request in the gap, then checks that the
//! cache serves what the disk holds, or that a hit on another sector did not wait.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{counter, data, format_dev, gated_cache, on_disk, open_dyn, read_in_thread, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{GateDevice, MemDevice};
use ssdcache_engine::{CleanerConfig, Volume};
use ssdcache_format::CacheMode;

const SECTOR: usize = 4096;
const LINE: u64 = 64 * 1024;
const BACKING: u64 = 16 * MIB;
/// Far longer than a hit takes on an idle machine; a hit that waits for the held disk write
/// never returns before the test releases it.
const HIT_LIMIT: Duration = Duration::from_secs(3);
/// How long a test gives a thread to reach its wait behind the held write.
const SETTLE: Duration = Duration::from_millis(150);
const HELD_LIMIT: Duration = Duration::from_secs(10);

fn write_in_thread(
    vol: &Arc<Volume>,
    offset: u64,
    payload: Vec<u8>,
) -> thread::JoinHandle<ssdcache_engine::Result<()>> {
    let vol = vol.clone();
    thread::spawn(move || vol.write(offset, &payload, false))
}

fn via_cache(vol: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    vol.read(offset, &mut buf).expect("read");
    buf
}

/// Every sector of `[offset, offset + len)` read alone through the cache equals the disk.
fn assert_cache_equals_disk(vol: &Volume, mem: &MemDevice, offset: u64, len: usize, what: &str) {
    assert!(
        via_cache(vol, offset, len) == on_disk(mem, offset, len),
        "{what}: a read of the range serves data the disk does not hold"
    );
    for s in 0..len / SECTOR {
        let at = offset + (s * SECTOR) as u64;
        assert!(
            via_cache(vol, at, SECTOR) == on_disk(mem, at, SECTOR),
            "{what}: sector at byte {at} served from the cache differs from the disk"
        );
    }
}

/// A line cached whole with `old` on the disk, then a write-through of its first sector held
/// at the disk: returns the writer.
fn hold_a_write_of_sector_zero(
    vol: &Arc<Volume>,
    mem: &MemDevice,
    gate: &GateDevice,
    cache_line: bool,
) -> (
    Vec<u8>,
    Vec<u8>,
    thread::JoinHandle<ssdcache_engine::Result<()>>,
) {
    let old = data(1, LINE as usize);
    mem.write_at(&old, 0).expect("seed backing");
    if cache_line {
        via_cache(vol, 0, LINE as usize);
    }
    let new = data(2, SECTOR);
    gate.hold_next_write();
    let writer = write_in_thread(vol, 0, new.clone());
    assert!(
        gate.wait_until_held(HELD_LIMIT),
        "the write reached the disk"
    );
    (old, new, writer)
}

/// R16-1 (latency, issue 11's goal): a read of the sector being written waits for the disk
/// write *holding the line* (`read_backing` waits under the caller's lines), so a hit on
/// another sector of the line that arrives after it waits for the disk too.
#[test]
fn r16_1_a_hit_does_not_wait_behind_a_read_of_the_sector_being_written() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let (old, _new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, true);
    let same_sector = read_in_thread(&vol, 0, SECTOR);
    thread::sleep(SETTLE);
    let hit = read_in_thread(&vol, SECTOR as u64, SECTOR).recv_timeout(HIT_LIMIT);
    gate.release();
    writer.join().expect("writer").expect("write");
    same_sector
        .recv_timeout(HELD_LIMIT)
        .expect("same-sector read");
    let hit = hit.expect(
        "a hit on sector 1 waited for the disk write of sector 0: a read of sector 0 queued \
         behind that write holds the line meanwhile",
    );
    assert_eq!(hit, old[SECTOR..2 * SECTOR]);
}

/// R16-1b, the commoner form of R16-1: a read miss of a third, uncached sector of the line
/// reads the whole line from the disk, so it waits for the held write of sector 0 holding the
/// line, and a hit on the cached sector 1 waits behind it.
#[test]
fn r16_1b_a_hit_does_not_wait_behind_a_miss_on_another_sector_of_the_line() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    mem.write_at(&data(1, LINE as usize), 0)
        .expect("seed backing");
    // Only sector 1 of the line is cached (a write-through write caches what it wrote).
    let cached = data(7, SECTOR);
    vol.write(SECTOR as u64, &cached, false)
        .expect("write sector 1");
    assert!(vol.likely_served_from_cache(false, SECTOR as u64, SECTOR as u64));
    assert!(!vol.likely_served_from_cache(false, 2 * SECTOR as u64, SECTOR as u64));
    gate.hold_next_write();
    let writer = write_in_thread(&vol, 0, data(2, SECTOR));
    assert!(
        gate.wait_until_held(HELD_LIMIT),
        "the write reached the disk"
    );
    let miss = read_in_thread(&vol, 2 * SECTOR as u64, SECTOR);
    thread::sleep(SETTLE);
    let hit = read_in_thread(&vol, SECTOR as u64, SECTOR).recv_timeout(HIT_LIMIT);
    gate.release();
    writer.join().expect("writer").expect("write");
    miss.recv_timeout(HELD_LIMIT).expect("the miss");
    assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, "after the write");
    let hit = hit.expect(
        "a hit on sector 1 waited for the disk write of sector 0: a miss on sector 2 reads the \
         whole line, waiting for that write with the line held",
    );
    assert_eq!(hit, cached);
}

/// R16-2 (latency, issue 11's goal): a second write of the sector being written waits for the
/// first's disk write in `begin_write` *holding the line*, so hits on the line's other sectors
/// wait for the disk again.
#[test]
fn r16_2_a_hit_does_not_wait_behind_an_overlapping_write() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let (old, _new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, true);
    let second = write_in_thread(&vol, 0, data(3, SECTOR));
    thread::sleep(SETTLE);
    let hit = read_in_thread(&vol, SECTOR as u64, SECTOR).recv_timeout(HIT_LIMIT);
    gate.release();
    writer.join().expect("writer").expect("write");
    second.join().expect("second writer").expect("second write");
    assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, "after both writes");
    let hit = hit.expect(
        "a hit on sector 1 waited for the disk write of sector 0: a second write of sector 0 \
         waits for it holding the line",
    );
    assert_eq!(hit, old[SECTOR..2 * SECTOR]);
}

/// The line is evicted (and its slot reused) while its write-through write is at the disk;
/// the write's fill afterwards must go to the line's new slot, and the cache then equals the
/// disk.
#[test]
fn r16_3_eviction_of_the_line_during_the_disk_write() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        // 16 MiB of cache holds fewer lines than the 256 of the disk (its metadata).
        let (mem, gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
        let vol = cache.volumes()[0].clone();
        let (_old, new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, true);
        for line in 1..BACKING / LINE {
            via_cache(&vol, line * LINE, LINE as usize);
        }
        assert!(
            !vol.likely_served_from_cache(false, SECTOR as u64, SECTOR as u64),
            "{mode:?}: line 0 was evicted meanwhile"
        );
        gate.release();
        writer.join().expect("writer").expect("write");
        assert_eq!(on_disk(&mem, 0, SECTOR), new);
        assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, &format!("{mode:?}"));
    }
}

/// NBD CMD_CACHE of the line while a write of its first sector is at the disk: the prefetch
/// reads the whole line, so it must wait and cache the new data, never the old.
#[test]
fn r16_4_prefetch_during_the_disk_write_caches_the_new_data() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (mem, gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
        let vol = cache.volumes()[0].clone();
        let (_old, new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, false);
        let prefetcher = {
            let vol = vol.clone();
            thread::spawn(move || vol.prefetch(0, LINE))
        };
        thread::sleep(SETTLE);
        gate.release();
        writer.join().expect("writer").expect("write");
        prefetcher.join().expect("prefetcher").expect("prefetch");
        let hits = counter(&vol, "read_hits");
        assert_eq!(via_cache(&vol, 0, SECTOR), new, "{mode:?}");
        assert_eq!(
            counter(&vol, "read_hits"),
            hits + 1,
            "{mode:?}: served as a hit"
        );
        assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, &format!("{mode:?}"));
    }
}

/// TRIM (discard: the memory disk zeroes) of the range while a write-through write of it is
/// at the disk: the TRIM lands last and the write's fill must not bring the data back.
#[test]
fn r16_5_trim_during_the_disk_write_wins() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let (_old, _new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, true);
    let trimmer = {
        let vol = vol.clone();
        thread::spawn(move || vol.trim(0, SECTOR as u64, false))
    };
    thread::sleep(SETTLE);
    gate.release();
    writer.join().expect("writer").expect("write");
    trimmer.join().expect("trimmer").expect("trim");
    assert_eq!(
        on_disk(&mem, 0, SECTOR),
        vec![0u8; SECTOR],
        "TRIM landed last"
    );
    assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, "after TRIM");
}

/// The held disk write fails while a read of the line's other sector waits for it (the read
/// fills the whole line from the disk): afterwards the cache holds what the disk holds.
#[test]
fn r16_6_failed_disk_write_with_a_whole_line_fill_waiting() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (mem, gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
        let vol = cache.volumes()[0].clone();
        let (old, _new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, false);
        let reader = read_in_thread(&vol, SECTOR as u64, SECTOR);
        thread::sleep(SETTLE);
        mem.fail_writes.store(true, Ordering::SeqCst);
        gate.release();
        let written = writer.join().expect("writer");
        mem.fail_writes.store(false, Ordering::SeqCst);
        assert!(written.is_err(), "{mode:?}: the disk write failed");
        let got = reader.recv_timeout(HELD_LIMIT).expect("reader");
        assert_eq!(got, old[SECTOR..2 * SECTOR], "{mode:?}");
        assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, &format!("{mode:?}"));
    }
}

/// A mode change to write-back requested while a write-through write is at the disk: it
/// waits for the write (the mode gate), hits go on, nothing deadlocks, and a write-back write
/// of the range afterwards is what every read returns.
#[test]
fn r16_7_mode_change_during_the_disk_write() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let (old, new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, true);
    let changer = {
        let cache = cache.clone();
        thread::spawn(move || {
            cache.set_mode(
                0,
                CacheMode::WriteBack,
                &CleanerConfig::default(),
                &mut |_| true,
            )
        })
    };
    thread::sleep(SETTLE);
    let hit = read_in_thread(&vol, SECTOR as u64, SECTOR).recv_timeout(HIT_LIMIT);
    gate.release();
    writer.join().expect("writer").expect("write");
    changer.join().expect("changer").expect("mode change");
    assert_eq!(
        hit.expect("a hit during the mode change"),
        old[SECTOR..2 * SECTOR]
    );
    assert_eq!(via_cache(&vol, 0, SECTOR), new);
    let newer = data(9, SECTOR);
    vol.write(0, &newer, false).expect("write-back write");
    assert_eq!(via_cache(&vol, 0, SECTOR), newer);
}

/// Threads write through (or around), TRIM, write zeroes, prefetch and read at random over 256
/// lines (the whole disk) of a cache with room for fewer, so lines are evicted and reused while writes
/// of them are at the disk; afterwards every sector the cache serves equals the disk. Bounded:
/// 4 threads × 1500 operations, and 60 s.
#[test]
fn r16_8_racing_requests_with_eviction_leave_the_cache_equal_to_the_disk() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (mem, _gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
        let vol = cache.volumes()[0].clone();
        let span = BACKING;
        let sectors = span / SECTOR as u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let vol = vol.clone();
                thread::spawn(move || {
                    let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    for i in 0..1500u64 {
                        if Instant::now() > deadline {
                            break;
                        }
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        // Four hot lines take most requests, so they overlap.
                        let sector = if x % 3 == 0 { x % sectors } else { x % 64 };
                        let count = (1 + (x >> 20) % 4).min(sectors - sector);
                        let offset = sector * SECTOR as u64;
                        let len = count as usize * SECTOR;
                        match (x >> 32) % 6 {
                            0 | 1 => {
                                let tag = (t << 32) | i | 1;
                                let mut payload = vec![0u8; len];
                                for chunk in payload.chunks_mut(SECTOR) {
                                    chunk[..8].copy_from_slice(&tag.to_le_bytes());
                                }
                                vol.write(offset, &payload, false).expect("write");
                            }
                            2 => vol.trim(offset, len as u64, false).expect("trim"),
                            3 => vol.prefetch(offset, len as u64).expect("prefetch"),
                            _ => {
                                let mut buf = vec![0u8; len];
                                vol.read(offset, &mut buf).expect("read");
                                for chunk in buf.chunks(SECTOR) {
                                    assert!(
                                        chunk[8..].iter().all(|&b| b == 0),
                                        "a read returned a sector no write wrote"
                                    );
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("worker");
        }
        assert_cache_equals_disk(&vol, &mem, 0, span as usize, &format!("{mode:?}"));
    }
}

/// The cache device fails the write-through write's fill after the gap (and a whole-line fill
/// of a read waiting in the gap): the write still succeeds (the disk has it), and afterwards
/// the cache serves what the disk holds.
#[test]
fn r16_9_the_fill_after_the_gap_fails_on_the_cache_device() {
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let gate = Arc::new(GateDevice::new(mem.clone()));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), gate.clone());
    let vol = cache.volumes()[0].clone();
    let (old, new, writer) = hold_a_write_of_sector_zero(&vol, &mem, &gate, false);
    let reader = read_in_thread(&vol, SECTOR as u64, SECTOR);
    thread::sleep(SETTLE);
    cache_dev.fail_writes.store(true, Ordering::SeqCst);
    gate.release();
    writer
        .join()
        .expect("writer")
        .expect("the write reached the disk");
    let got = reader.recv_timeout(HELD_LIMIT).expect("reader");
    cache_dev.fail_writes.store(false, Ordering::SeqCst);
    assert_eq!(got, old[SECTOR..2 * SECTOR]);
    assert_eq!(on_disk(&mem, 0, SECTOR), new);
    assert_cache_equals_disk(&vol, &mem, 0, LINE as usize, "after the failed fills");
}
