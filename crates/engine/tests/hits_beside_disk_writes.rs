//! Issue 11, item 3: a hit never waits for the hard drive. A write-through or write-around write
//! holds its lines only while it changes the cache map, not across its disk write, so hits on
//! the other sectors of its lines go on meanwhile; reads of the sectors it writes wait for the
//! disk write and return its data; and what the cache holds afterwards equals the disk, also
//! when two writes of the same range overlap.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::{counter, data, gated_cache, on_disk, read_in_thread, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_engine::Volume;
use ssdcache_format::CacheMode;

const SECTOR: usize = 4096;
const LINE: u64 = 64 * 1024;
const BACKING: u64 = 16 * MIB;
/// Long enough for a hit on an idle machine many times over; a hit that waits for the held
/// disk write never returns before the test releases it.
const HIT_LIMIT: Duration = Duration::from_secs(3);

fn write_in_thread(vol: &Arc<Volume>, offset: u64, payload: Vec<u8>) -> thread::JoinHandle<()> {
    let vol = vol.clone();
    thread::spawn(move || vol.write(offset, &payload, false).expect("write"))
}

/// A line cached whole, then a write of its first sector held at the disk: a hit on its second
/// sector returns at once, a read of the first returns the new data once the write landed, and
/// afterwards the cache serves the new data as a hit.
fn hit_beside_a_held_disk_write(mode: CacheMode) {
    let (mem, gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let old = data(1, LINE as usize);
    mem.write_at(&old, 0).expect("seed backing");
    let mut line = vec![0u8; LINE as usize];
    vol.read(0, &mut line).expect("fill the line");
    let new = data(2, SECTOR);

    gate.hold_next_write();
    let writer = write_in_thread(&vol, 0, new.clone());
    assert!(
        gate.wait_until_held(Duration::from_secs(10)),
        "the write reached the disk"
    );
    let hits_before = counter(&vol, "read_hits");
    let hit = read_in_thread(&vol, SECTOR as u64, SECTOR).recv_timeout(HIT_LIMIT);
    let hits_after = counter(&vol, "read_hits");
    let same_sector = read_in_thread(&vol, 0, SECTOR);
    let early = same_sector.recv_timeout(Duration::from_millis(200));
    gate.release();
    writer.join().expect("writer thread");

    let hit = hit.expect("a hit on another sector of the line waited for the disk write");
    assert_eq!(
        hit,
        old[SECTOR..2 * SECTOR],
        "the hit returns the cached data"
    );
    assert_eq!(hits_after, hits_before + 1, "it was a hit");
    assert!(
        early.is_err(),
        "a read of the sector being written returned before the disk write landed"
    );
    let same = same_sector
        .recv_timeout(Duration::from_secs(10))
        .expect("read of the written sector");
    assert_eq!(
        same, new,
        "the read after the write landed returns its data"
    );
    assert_eq!(on_disk(&mem, 0, SECTOR), new, "the disk has the write");
    let mut after = vec![0u8; SECTOR];
    vol.read(0, &mut after).expect("read after");
    assert_eq!(after, new, "the cache serves the new data");
}

#[test]
fn write_through_a_hit_on_the_same_line_does_not_wait_for_the_disk_write() {
    hit_beside_a_held_disk_write(CacheMode::WriteThrough);
}

#[test]
fn write_around_a_hit_on_the_same_line_does_not_wait_for_the_disk_write() {
    hit_beside_a_held_disk_write(CacheMode::WriteAround);
}

/// Two write-through writes of one sector: the first is held at the disk, the second waits for
/// it, then both land in order. The cache must end with the second one's data (or without the
/// sector), never the first one's: the first write's fill comes after its disk write, and the
/// second began meanwhile.
#[test]
fn write_through_overlapping_writes_leave_the_cache_equal_to_the_disk() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let mut line = vec![0u8; LINE as usize];
    vol.read(0, &mut line).expect("fill the line");
    let first = data(3, SECTOR);
    let second = data(4, SECTOR);

    gate.hold_next_write();
    let first_writer = write_in_thread(&vol, 0, first);
    assert!(gate.wait_until_held(Duration::from_secs(10)));
    let second_writer = write_in_thread(&vol, 0, second.clone());
    // Let the second write reach its wait for the first.
    thread::sleep(Duration::from_millis(100));
    gate.release();
    first_writer.join().expect("first writer");
    second_writer.join().expect("second writer");

    assert_eq!(
        on_disk(&mem, 0, SECTOR),
        second,
        "the disk has the later write"
    );
    let mut got = vec![0u8; SECTOR];
    vol.read(0, &mut got).expect("read");
    assert_eq!(got, second, "the cache agrees with the disk");
}

/// A write-through write held at the disk, then WRITE_ZEROES of its range (any client write
/// to the disk supersedes a pending fill): the zeroes land last, and the write-through write
/// must not put its data in the cache afterwards.
#[test]
fn write_through_a_trim_during_the_disk_write_wins() {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteThrough, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let mut line = vec![0u8; LINE as usize];
    vol.read(0, &mut line).expect("fill the line");
    gate.hold_next_write();
    let writer = write_in_thread(&vol, 0, data(5, SECTOR));
    assert!(gate.wait_until_held(Duration::from_secs(10)));
    let trimmer = {
        let vol = vol.clone();
        thread::spawn(move || vol.write_zeroes(0, SECTOR as u64, false).expect("zeroes"))
    };
    thread::sleep(Duration::from_millis(100));
    gate.release();
    writer.join().expect("writer");
    trimmer.join().expect("trimmer");
    assert_eq!(
        on_disk(&mem, 0, SECTOR),
        vec![0u8; SECTOR],
        "zeroes landed last"
    );
    let mut got = vec![1u8; SECTOR];
    vol.read(0, &mut got).expect("read");
    assert_eq!(got, vec![0u8; SECTOR], "the cache agrees with the disk");
}

/// Threads write through, write zeroes and read over four lines at random, so writes of one
/// range overlap with their disk writes and fills interleaved every way; afterwards every
/// sector the cache serves equals the disk's, and every read returned whole sectors some
/// write (or the seed) put there.
#[test]
fn write_through_racing_writes_and_reads_leave_the_cache_equal_to_the_disk() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let (mem, _gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
        let vol = cache.volumes()[0].clone();
        let span = 4 * LINE;
        mem.write_at(&vec![0u8; span as usize], 0).expect("seed");
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let vol = vol.clone();
                thread::spawn(move || {
                    let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    for i in 0..1500u64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let sector = x % (span / SECTOR as u64);
                        let count = 1 + (x >> 20) % 3;
                        let count = count.min(span / SECTOR as u64 - sector);
                        let offset = sector * SECTOR as u64;
                        let len = (count as usize) * SECTOR;
                        match (x >> 32) % 4 {
                            0 | 1 => {
                                // Every sector carries its writer's tag in its first 8 bytes.
                                let tag = (t << 32) | i | 1;
                                let mut payload = vec![0u8; len];
                                for chunk in payload.chunks_mut(SECTOR) {
                                    chunk[..8].copy_from_slice(&tag.to_le_bytes());
                                }
                                vol.write(offset, &payload, false).expect("write");
                            }
                            2 => vol.write_zeroes(offset, len as u64, false).expect("zeroes"),
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
        let mut via_cache = vec![0u8; span as usize];
        vol.read(0, &mut via_cache).expect("read all");
        let mut on_disk = vec![0u8; span as usize];
        mem.read_at(&mut on_disk, 0).expect("disk");
        assert!(
            via_cache == on_disk,
            "{mode:?}: the cache serves data the disk does not hold"
        );
        // And sector by sector, as hits of the lines the cache still holds.
        for s in 0..span / SECTOR as u64 {
            let mut one = vec![0u8; SECTOR];
            vol.read(s * SECTOR as u64, &mut one).expect("read sector");
            assert_eq!(
                one,
                on_disk[(s as usize) * SECTOR..(s as usize + 1) * SECTOR],
                "{mode:?}: sector {s}"
            );
        }
    }
}

/// Review 16: a request that must wait for the held disk write (a read of the sector being
/// written, which misses; a second write of it, which must land after it) waits before it
/// takes the line, so a hit on the line's other sectors still returns at once.
#[test]
fn requests_waiting_for_a_disk_write_do_not_hold_the_line_meanwhile() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        for second_is_write in [false, true] {
            let (mem, gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
            let vol = cache.volumes()[0].clone();
            let old = data(6, LINE as usize);
            mem.write_at(&old, 0).expect("seed backing");
            let mut line = vec![0u8; LINE as usize];
            vol.read(0, &mut line).expect("fill the line");
            gate.hold_next_write();
            let writer = write_in_thread(&vol, 0, data(7, SECTOR));
            assert!(gate.wait_until_held(Duration::from_secs(10)));
            let waiter = if second_is_write {
                let w = write_in_thread(&vol, 0, data(8, SECTOR));
                Box::new(move || w.join().expect("second writer")) as Box<dyn FnOnce()>
            } else {
                let r = read_in_thread(&vol, 0, SECTOR);
                Box::new(move || drop(r.recv_timeout(Duration::from_secs(10)).expect("read")))
            };
            thread::sleep(Duration::from_millis(100));
            let hit = read_in_thread(&vol, 2 * SECTOR as u64, SECTOR).recv_timeout(HIT_LIMIT);
            gate.release();
            writer.join().expect("writer");
            waiter();
            let hit = hit.unwrap_or_else(|_| {
                panic!("{mode:?}, second request a write: {second_is_write}: the hit waited")
            });
            assert_eq!(hit, old[2 * SECTOR..3 * SECTOR]);
            let mut got = vec![0u8; SECTOR];
            vol.read(0, &mut got).expect("read");
            assert_eq!(
                got,
                on_disk(&mem, 0, SECTOR),
                "the cache agrees with the disk"
            );
        }
    }
}
