//! Second adversarial review of the data path (issue #10): each test reproduces one finding
//! and failed before the engine was fixed (they pass now). Each names the sequence of events
//! and the rule of docs/design.md §4.1 (or the documented bound) it breaks.

mod common;

use common::{data, open_dyn};
use ssdcache_device::BlockDevice;

const SECTOR: u64 = 4096;

/// Finding R2-1 (the F8 fix is incomplete). Zero sectors of write-back writes no longer go
/// into a slot, but zeroes still reach a slot whose durable journal record names older dirty
/// data in the same sector, through a *fill*: a WRITE_ZEROES (or TRIM on a hole-punching
/// backing file, or a write-back write of zeroes) drops the dirty sector from the map and
/// zeroes the backing device; any read miss in the same line (the sector itself, or a
/// neighbour: a partial miss fills the whole line) then copies the backing device's zeroes
/// into the slot, in place, while the line stays mapped by its other sectors. Until the next
/// commit (up to a second with the cleaner's periodic commit) the journal still says the
/// sector is dirty with the old checksum. A crash there: recovery marks the slot unverified,
/// finds zeroes, and calls them a lost cache region. The read fails with EIO, the volume goes
/// "cache failed", `flush`/`detach` refuse, and `--discard-damaged` returns the backing
/// device's data, older than the FLUSH (§4.1 rule 2). Legal values were only the flushed data
/// or zeroes.
#[test]
fn r2_1_a_fill_after_write_zeroes_turns_flushed_data_into_damage() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let oldest = data(9, 2 * SECTOR as usize);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, 2 * SECTOR as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush()
        .expect("sectors 0 and 1 are durable, dirty in the cache");

    vol.write_zeroes(0, SECTOR, false)
        .expect("WRITE_ZEROES of sector 0");
    // An ordinary read of a neighbouring sector of the same line (sector 2, never written)
    // misses and fills the whole line from the backing device.
    common::read_vec(&cache, 2 * SECTOR, SECTOR).expect("read of sector 2");

    let (cache_img, backing_img) = common::cut_keeping_cache_writes(&cache_dev, &backing);
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_img, backing_img);
    let read = common::read_vec(&cache, 0, SECTOR);
    let after_discard = match &read {
        Err(_) => {
            cache.discard_damaged().expect("--discard-damaged");
            common::outcome(
                &common::read_vec(&cache, 0, SECTOR),
                &flushed[..SECTOR as usize],
                &oldest[..SECTOR as usize],
            )
        }
        Ok(_) => "not needed".into(),
    };
    let legal = read
        .as_ref()
        .is_ok_and(|r| r[..] == flushed[..SECTOR as usize] || r.iter().all(|&b| b == 0));
    assert!(
        legal,
        "sector 0 (flushed, then WRITE_ZEROES, crash) reads as {} (volume state {:?}); after \
         --discard-damaged it reads as {after_discard}",
        common::outcome(
            &read,
            &flushed[..SECTOR as usize],
            &oldest[..SECTOR as usize]
        ),
        cache.volumes()[0].state()
    );
}

/// Finding R2-1, second path: a write-back write of zeroes (routed to the backing device by
/// the F8 fix) followed by a read of the same sector, which fills the line from the backing
/// device's zeroes.
#[test]
fn r2_1_a_fill_after_a_write_of_zeroes_turns_flushed_data_into_damage() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, 2 * SECTOR as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    vol.write(0, &[0u8; SECTOR as usize], false)
        .expect("a write of zeroes to sector 0");
    assert!(common::read_vec(&cache, 0, SECTOR)
        .unwrap()
        .iter()
        .all(|&b| b == 0));

    let (cache_img, backing_img) = common::cut_keeping_cache_writes(&cache_dev, &backing);
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_img, backing_img);
    let read = common::read_vec(&cache, 0, SECTOR);
    assert!(
        read.as_ref()
            .is_ok_and(|r| r[..] == flushed[..SECTOR as usize] || r.iter().all(|&b| b == 0)),
        "sector 0 (flushed, then written with zeroes and read, crash) reads as {} (volume \
         state {:?})",
        common::outcome(&read, &flushed[..SECTOR as usize], &[]),
        cache.volumes()[0].state()
    );
}

/// Finding R2-1, third path: while a volume leaves write-back (`set-mode`), writes are served
/// write-through; a write-through write of zeroes over a flushed dirty sector puts the zeroes
/// into the slot in place (`put_written_through`). Until the next commit the journal names the
/// older data; a crash there turns both legal values into "damage".
#[test]
fn r2_1_a_write_through_write_of_zeroes_during_a_mode_change_becomes_damage() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, SECTOR as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    cache.hold_writes_through(0);
    vol.write(0, &[0u8; SECTOR as usize], false)
        .expect("write-through write of zeroes");

    let (cache_img, backing_img) = common::cut_keeping_cache_writes(&cache_dev, &backing);
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_img, backing_img);
    let read = common::read_vec(&cache, 0, SECTOR);
    assert!(
        read.as_ref()
            .is_ok_and(|r| *r == flushed || r.iter().all(|&b| b == 0)),
        "sector 0 (flushed, then written through with zeroes during a mode change, crash) \
         reads as {} (volume state {:?})",
        common::outcome(&read, &flushed, &[]),
        cache.volumes()[0].state()
    );
}
