//! Eighth adversarial review of the data path (issue #10), against c6c0d24 (a read or check
//! whose data matches the checksum snapshot settles the sector's marks and an earlier damage
//! finding, `MapState::confirm_sectors`; a check that could not read a sector keeps its marks,
//! `mark_unreadable`; a damaged sector is no longer refused by `accept_newer_data`).
//!
//! One finding, R8-1 (its test fails against c6c0d24): a check never re-reads a line whose
//! dirty sectors all carry a damage finding, so an unreadable moment is damage for good after
//! all. The review found no sequence in which a confirm settles a sector whose data it did not
//! check (every path that takes the snapshot holds the line's lock until it confirms, and
//! nothing that changes a slot's checksums, marks or owner runs without that lock except
//! `mark_clean`, which only clears dirty bits, and a confirm touches dirty sectors only). The
//! other tests pin the properties checked, so a later change that breaks them fails here:
//!
//! - a confirm settles exactly the sectors the read returned, by their sector number in the
//!   line, on the full-hit path (`read_hit`) and on the overlay path (`overlay_run`);
//! - a sector whose data was proven damaged stays damaged through later matching reads of the
//!   other sectors, is named by the check (`drain`, as `detach` and offline `flush` run it) and
//!   never reaches the backing device.
//!
//! The devices are `CrashDevice`s; where a test puts a value into the cache device by hand it
//! is one the device model allows there (bit rot is what the checksums exist to catch, §4.8).

mod common;

use common::data;
use common::failing::{check_while_unreadable, sector_of, slot_holding};
use ssdcache_device::BlockDevice;
use ssdcache_engine::{Cache, CleanerConfig};

const LINE: u64 = 64 << 10;
const SECTOR: usize = 4096;

/// The damaged ranges as (offset, length) pairs of volume 0.
fn damaged(cache: &Cache) -> Vec<(u64, u64)> {
    cache
        .damaged_ranges()
        .iter()
        .map(|r| (r.offset, r.length))
        .collect()
}

/// A read of one sector of a fully cached dirty line (the `read_hit` path) settles the
/// unreadable finding of that sector and of no other.
#[test]
fn a_full_hit_read_settles_exactly_the_sectors_it_read() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let (oldest, flushed) = (data(9, LINE as usize), data(1, LINE as usize));
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    check_while_unreadable(&cache_dev, &cache);
    assert_eq!(
        damaged(&cache),
        vec![(0, LINE)],
        "all 16 dirty sectors unreadable"
    );

    let read = common::read_vec(&cache, 2 * SECTOR as u64, SECTOR as u64).unwrap();
    assert_eq!(
        read,
        sector_of(&flushed, 2),
        "sector 2 reads as the flushed data"
    );
    assert_eq!(
        damaged(&cache),
        vec![
            (0, 2 * SECTOR as u64),
            (3 * SECTOR as u64, LINE - 3 * SECTOR as u64)
        ],
        "the read settles sector 2 (it matched) and only sector 2"
    );
}

/// A read over a partly cached line without a fill (the volume no longer caches: the overlay
/// path, `overlay_run`) settles the dirty sector it laid over the backing data, by its sector
/// number in the line, and not another dirty sector of the line that it did not read.
#[test]
fn an_overlay_read_settles_only_the_dirty_sector_it_read() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let oldest = data(9, LINE as usize);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let (two, five) = (data(2, SECTOR), data(5, SECTOR));
    vol.write(2 * SECTOR as u64, &two, false).unwrap();
    vol.write(5 * SECTOR as u64, &five, false).unwrap();
    vol.flush().unwrap();
    check_while_unreadable(&cache_dev, &cache);
    assert_eq!(
        damaged(&cache),
        vec![
            (2 * SECTOR as u64, SECTOR as u64),
            (5 * SECTOR as u64, SECTOR as u64)
        ]
    );
    // A write to line 1 fails on both devices: the volume stops caching (no fills), so the
    // next read of a partly cached line lays the cached sectors over the backing data.
    cache_dev.fail_writes(true);
    backing.fail_writes(true);
    let failed = vol.write(LINE, &data(7, SECTOR), false);
    cache_dev.fail_writes(false);
    backing.fail_writes(false);
    assert!(failed.is_err(), "the write to line 1 fails on both devices");

    let read = common::read_vec(&cache, 4 * SECTOR as u64, 3 * SECTOR as u64).unwrap();
    assert_eq!(
        sector_of(&read, 0),
        sector_of(&oldest, 4),
        "sector 4 from the disk"
    );
    assert_eq!(
        sector_of(&read, 1),
        five.as_slice(),
        "sector 5 from the cache"
    );
    assert_eq!(
        sector_of(&read, 2),
        sector_of(&oldest, 6),
        "sector 6 from the disk"
    );
    assert_eq!(
        damaged(&cache),
        vec![(2 * SECTOR as u64, SECTOR as u64)],
        "sector 5 settled by the read that matched it; sector 2 was not read and keeps its \
         finding"
    );
}

/// A sector proven damaged (its data read back and failed its checksum) stays damaged while
/// reads and checks settle the other sectors of its line (the slot has a damage finding, so
/// every matching read reports back); the check names it and it never reaches the backing
/// device.
#[test]
fn proven_damage_survives_matching_reads_is_named_and_never_written_back() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let (oldest, flushed) = (data(9, LINE as usize), data(1, LINE as usize));
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    let slot = slot_holding(&cache_dev, &flushed);
    let garbage = data(0xbad, SECTOR);
    cache_dev
        .write_at(&garbage, slot + 8 * SECTOR as u64)
        .unwrap();
    let only_sector_8 = vec![(8 * SECTOR as u64, SECTOR as u64)];

    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    assert!(
        drained.is_err(),
        "the check refuses to write back: {drained:?}"
    );
    assert_eq!(
        damaged(&cache),
        only_sector_8,
        "the check names sector 8 only"
    );
    let three = common::read_vec(&cache, 3 * SECTOR as u64, SECTOR as u64).unwrap();
    assert_eq!(
        three,
        sector_of(&flushed, 3),
        "sector 3 reads as the flushed data"
    );
    assert!(
        common::read_vec(&cache, 0, LINE).is_err(),
        "a read of the whole line fails on sector 8"
    );
    assert_eq!(
        damaged(&cache),
        only_sector_8,
        "matching reads settle nothing else"
    );
    let again = cache.drain(&CleanerConfig::default(), &mut |_| true);
    assert!(again.is_err(), "the second check refuses too: {again:?}");
    assert_eq!(damaged(&cache), only_sector_8);
    let mut on_disk = vec![0u8; LINE as usize];
    backing.read_at(&mut on_disk, 0).unwrap();
    assert_eq!(
        on_disk, oldest,
        "nothing of the line was written back, garbage least of all"
    );
}

/// Finding R8-1 (a check never re-reads a line whose every dirty sector carries a damage
/// finding, so a moment of unreadability keeps readable, matching, FLUSHed data "damaged"
/// for the life of the process). Line 0: A written and FLUSHed (16 dirty sectors). A check of
/// the dirty data runs while the cache device cannot be read (`drain`, as `set_mode` runs it
/// in the daemon when a volume leaves write-back): `verify_line` marks all 16 sectors
/// unreadable (`mark_unreadable`, damaged bit set). The link comes back. Since c6c0d24 that
/// finding is meant to be settled by "a read or check whose data matches" (commit message,
/// design.md §4.8: "it counts as damaged until a read matches or accepts it"; map.rs
/// `confirm_sectors`). But the next check never reads line 0: `verify_dirty` takes its lines
/// from `dirty_lines_from`, which leaves out every line whose dirty sectors are all damaged
/// (that filter is meant for the cleaner: damaged sectors are never written back). So the
/// second `drain` refuses with `DataDamaged` naming all of line 0, `damaged_ranges` (what
/// `detach`/`flush` print, and what `--discard-damaged` would drop) lists 64 KiB of sound
/// data, and the cleaner never writes it back (its plan leaves damaged sectors out) until a
/// client happens to read each sector or the process restarts. A line with one sound sector
/// left is re-read and settled, so the outcome depends on whether the unreadable moment
/// covered every dirty sector of a line. Rules: §4.8 (an unreadable sector is not damage for
/// good; a check whose data matches settles it) and §4.2/§4.7 (FLUSHed dirty data is written
/// back; a damage report names only data that is damaged or unreadable). A fix might let
/// `verify_dirty` take every dirty line (damaged sectors included), keeping the filter for
/// the cleaner's plan only.
#[test]
fn r8_1_a_check_never_rereads_a_fully_damaged_line_so_sound_data_stays_damaged() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let (oldest, flushed) = (data(9, LINE as usize), data(1, LINE as usize));
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    check_while_unreadable(&cache_dev, &cache);

    // The link is back and every sector of line 0 reads as A, matching its checksum.
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; LINE as usize];
    backing.read_at(&mut on_disk, 0).unwrap();
    assert!(
        drained.is_ok() && on_disk == flushed && damaged(&cache).is_empty(),
        "line 0 (A FLUSHed and dirty; a check ran while the cache device could not be read; \
         the link came back and every sector reads as A): the second check+writeback gave \
         {drained:?}, the backing device holds {}, and the damage report names {:?}; the \
         check must re-read the line, find it sound and write A back",
        if on_disk == flushed {
            "A"
        } else if on_disk == oldest {
            "the older data"
        } else {
            "other data"
        },
        damaged(&cache)
    );
}
