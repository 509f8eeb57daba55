//! Sixth adversarial review of the data path (issue #10), against 717ce3e (a write-back write
//! failing on both devices whose read-back fails too marks its slot *unverified*). Each test
//! reproduces one finding: it fails against 717ce3e and names the sequence of events and the
//! rule of docs/design.md (§4.1, §4.8) it breaks.
//!
//! The common root: the mark is one bit per *slot* that stays until the slot holds no dirty
//! data, and a marked sector accepts *any* data that is not all zeroes. 717ce3e sets it while
//! the engine knows exactly which sectors the failed write touched and the two checksums each
//! may hold, so the mark reaches further than what the failed write left uncertain: checksums
//! that are exact stop catching damage (§4.8: "Otherwise the checkpoint's and the running
//! engine's checksums are exact and any mismatch is damage").

mod common;

use common::data;
use common::failing::{
    damage_sector, dirty_flushed_line_0, fail_everywhere, sector_of, slot_holding,
};
use ssdcache_device::BlockDevice;
use ssdcache_engine::CleanerConfig;

const LINE: u64 = 64 << 10;
const SECTOR: usize = 4096;

/// Finding R6-1 (the mark covers dirty sectors the failed write never touched). Line 0 holds
/// 16 dirty, FLUSHed sectors A. A 4 KiB write to sector 0 fails on both devices and its
/// read-back fails: `after_failing_everywhere` calls `mark_unverified(slot)`, which marks the
/// whole slot, so sector 8, whose checksum the engine knows exactly (the failed write never
/// went near it), now accepts any non-zero data. The cache device then damages sector 8
/// (garbage, not zeroes). The read returns the garbage as if it were the client's data and
/// records its checksum (`accept_newer_data`), and the cleaner writes it to the backing
/// device over the older copy: silent corruption where, without the mark, the read fails with
/// EIO and the cleaner refuses the sector. Rules: §4.8 (exact checksums, any mismatch is
/// damage; damaged dirty data never reaches the backing device) and §4.1 rule 2 (a sector
/// holds its last durable value or a failed write's, never a third value). A fix might mark
/// only the sectors of the failed segment that were dirty (a per-sector set, like `damaged`).
#[test]
fn r6_1_the_mark_covers_sectors_the_failed_write_never_touched() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    fail_everywhere(&cache_dev, &backing, &cache, 0, &data(2, SECTOR));

    let garbage = damage_sector(&cache_dev, slot, 8);
    let read = common::read_vec(&cache, 0, LINE);
    let returned_garbage = read.as_ref().is_ok_and(|r| sector_of(r, 8) == garbage);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; len];
    backing.read_at(&mut on_disk, 0).unwrap();
    assert!(
        !returned_garbage && sector_of(&on_disk, 8) != garbage,
        "line 0 (16 dirty FLUSHed sectors A; a 4 KiB write to sector 0 failed on both devices \
         and its read-back failed; then the cache device damaged sector 8 with non-zero \
         garbage): the read {} and the backing device's sector 8 {} after writeback \
         ({drained:?}); sector 8's checksum is exact, so the damage must be detected (EIO, \
         refused by the cleaner), not accepted as a newer write",
        match &read {
            Err(e) => format!("failed ({e})"),
            Ok(_) if returned_garbage => "returned the garbage as sector 8".into(),
            Ok(_) => "returned other data for sector 8".into(),
        },
        if sector_of(&on_disk, 8) == garbage {
            "is the garbage"
        } else {
            "is not the garbage"
        }
    );
}

/// Finding R6-2 (the mark outlives the uncertainty: a later successful write of every dirty
/// sector does not clear it). Line 0: A dirty and FLUSHed; a whole-line write B fails on both
/// devices with a failed read-back (slot marked); the daemon is stopped cleanly and started
/// again (the checkpoint keeps the mark, `RECORD_UNVERIFIED`); then the client rewrites the whole line with
/// C, successfully, and FLUSHes. Every dirty sector now has C's exact checksum and nothing is
/// uncertain, but `set_dirty` leaves the slot's bit set (only `store` with no dirty data,
/// `unmap` and `restore` touch it), and the next commit records it (`RECORD_UNVERIFIED`), so
/// it also survives clean stops, for as long as the line stays dirty (a hot line rewritten
/// faster than the cleaner's age threshold: indefinitely). The cache device then damages
/// sector 3 with non-zero garbage: the read returns it as C's data and the cleaner writes it
/// back. Rules: §4.8 (exact checksums, any mismatch is damage) and §4.1 rule 2. A fix might
/// clear the mark of each sector a successful write (or a fill, or an accepted newer write)
/// gives an exact checksum, which needs a per-sector mark.
#[test]
fn r6_2_a_later_successful_write_of_every_dirty_sector_keeps_the_mark() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    fail_everywhere(&cache_dev, &backing, &cache, 0, &data(2, len));
    // The failure left the volume `cache failed` (writes go around the cache until the next
    // start); the daemon is stopped cleanly and started again, the usual way back.
    cache.shutdown().expect("clean stop");
    drop(cache);
    let (cache, _) = common::open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let rewritten = data(3, len);
    vol.write(0, &rewritten, false)
        .expect("the devices answer again: the rewrite succeeds");
    vol.flush().expect("the rewrite is durable");
    assert_eq!(
        slot_holding(&cache_dev, &rewritten),
        slot,
        "the rewrite went into line 0's slot (write-back, the line stays cached)"
    );

    let garbage = damage_sector(&cache_dev, slot, 3);
    let read = common::read_vec(&cache, 0, LINE);
    let returned_garbage = read.as_ref().is_ok_and(|r| sector_of(r, 3) == garbage);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; len];
    backing.read_at(&mut on_disk, 0).unwrap();
    assert!(
        !returned_garbage && sector_of(&on_disk, 3) != garbage,
        "line 0 (A FLUSHed; a whole-line write failed on both devices with a failed \
         read-back; then the whole line rewritten with C successfully and FLUSHed; then the \
         cache device damaged sector 3 with non-zero garbage): the read {} and the backing \
         device's sector 3 {} after writeback ({drained:?}); every dirty sector has C's exact \
         checksum, so the damage must be detected, not accepted as a newer write",
        match &read {
            Err(e) => format!("failed ({e})"),
            Ok(_) if returned_garbage => "returned the garbage as sector 3".into(),
            Ok(_) => "returned other data for sector 3".into(),
        },
        if sector_of(&on_disk, 3) == garbage {
            "is the garbage"
        } else {
            "is not the garbage"
        }
    );
}

/// Finding R6-3 (a sector already found damaged becomes readable). Line 0: A dirty and
/// FLUSHed; the cache device damages sector 8 (non-zero garbage); a writeback (`drain`, which
/// checks all dirty data first, as offline `flush` does) refuses and marks sector 8 damaged,
/// as §4.8 requires; the volume stays healthy (the check degrades nothing). Then a 4 KiB write
/// to sector 0 fails on both devices with a failed read-back: the whole slot is marked
/// unverified, sector 8 included. The read path does not consult `damaged`: it re-checks the
/// checksum and asks `settle_mismatch`, which now calls the garbage a newer write, records its
/// checksum, and the read returns it. The engine contradicts itself: `damaged_ranges` (what
/// `status`, `detach` and `--discard-damaged` use) still names sector 8 and the cleaner still
/// leaves it alone, while clients read the garbage as data. Rules: §4.8 (a dirty sector that
/// fails fails the read; a sector leaves the damaged set only when rewritten, dropped or made
/// clean) and §4.1 rule 2. A fix might have `settle_mismatch` refuse sectors already damaged,
/// and mark only the failed segment's sectors (R6-1).
#[test]
fn r6_3_a_damaged_sector_reads_as_data_once_its_slot_is_marked() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    let garbage = damage_sector(&cache_dev, slot, 8);
    assert!(
        cache
            .drain(&CleanerConfig::default(), &mut |_| true)
            .is_err(),
        "a writeback of damaged dirty data is refused (§4.8)"
    );
    let found = cache.damaged_ranges();
    assert!(!found.is_empty(), "the check marked sector 8 damaged");

    fail_everywhere(&cache_dev, &backing, &cache, 0, &data(2, SECTOR));
    let read = common::read_vec(&cache, 0, LINE);
    let returned_garbage = read.as_ref().is_ok_and(|r| sector_of(r, 8) == garbage);
    assert!(
        read.is_err(),
        "line 0 (A FLUSHed; sector 8 damaged by the cache device and found damaged by a \
         writeback's check ({found:?}); then a 4 KiB write to sector 0 failed on both devices \
         with a failed read-back): the read must still fail on sector 8, but it {}, while the \
         engine still reports damage: {:?}",
        if returned_garbage {
            "returned the garbage as sector 8"
        } else {
            "succeeded"
        },
        cache.damaged_ranges()
    );
}

/// Finding R6-4 (inside the failed segment, "either value" is widened to "any value but
/// zeroes"). Line 0: A dirty and FLUSHed; a whole-line write B fails on both devices with a
/// failed read-back. §3 and §4.8 say the mark makes a later read accept "either value", and
/// the engine holds both checksums at that moment (the map's A and `new_crcs`), yet the mark
/// accepts any data that is not all zeroes. The cache device then damages sector 5 with
/// garbage that is neither A nor B: the read returns it and the cleaner writes it back.
/// (After an unclean stop the engine cannot know the newer write's checksum, so the wide
/// acceptance is its only choice there; here it is not.) Rule: §4.1 rule 2 (after a failed
/// write a sector holds the last durable value or the failed write's; a third value is
/// damage). The crash harness cannot see this: its devices never invent data, so "any
/// non-zero value" and "A or B" look alike to `contract.rs`. A fix might keep the failed
/// write's checksum beside the old one for the marked sectors and accept only those two.
#[test]
fn r6_4_a_marked_sector_accepts_data_that_is_neither_value() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    let failed = data(2, len);
    fail_everywhere(&cache_dev, &backing, &cache, 0, &failed);

    let garbage = damage_sector(&cache_dev, slot, 5);
    let read = common::read_vec(&cache, 0, LINE);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; len];
    backing.read_at(&mut on_disk, 0).unwrap();
    let returned = match &read {
        Err(e) => format!("an error ({e})"),
        Ok(r) => common::sector_map(
            sector_of(r, 5),
            sector_of(&flushed, 5),
            sector_of(&failed, 5),
            sector_of(&oldest, 5),
        ),
    };
    assert!(
        read.is_err() && sector_of(&on_disk, 5) != garbage,
        "line 0 (A FLUSHed; a whole-line write B failed on both devices with a failed \
         read-back; then the cache device put garbage, neither A nor B, in sector 5): the read \
         returned {returned} for sector 5 (A, B, O older, ? anything else) and writeback \
         ({drained:?}) left the backing device's sector 5 {}; only A or B is a value the failed \
         write permits",
        if sector_of(&on_disk, 5) == garbage {
            "holding the garbage"
        } else {
            "without the garbage"
        }
    );
}
