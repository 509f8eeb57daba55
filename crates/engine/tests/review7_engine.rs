//! Seventh adversarial review of the data path (issue #10), against 92b075b (the *unverified*
//! mark is per sector and goes when a sector's checksum is exact again; a write failing on
//! both devices whose read-back fails marks the sectors it covered `either`: the old checksum
//! or the failed write's). Each test reproduces one finding: it fails against 92b075b and
//! names the sequence of events and the rule of docs/design.md (§4.1, §4.8) it breaks.
//!
//! The devices are `CrashDevice`s. Where a test puts a value into the cache device by hand, it
//! is a value the device model allows there (§4.1: "a write that failed may have landed in
//! part"; an unflushed write may land whole): the test only fixes which of the legal outcomes
//! happened, so that the finding does not depend on which sectors `CrashDevice` lets land.

mod common;

use common::data;
use common::failing::{
    check_while_unreadable, damage_sector, dirty_flushed_line_0, fail_everywhere, sector_of,
};
use ssdcache_device::BlockDevice;
use ssdcache_engine::CleanerConfig;

const LINE: u64 = 64 << 10;
const SECTOR: usize = 4096;

fn describe_sector(
    read: &ssdcache_engine::Result<Vec<u8>>,
    sector: usize,
    a: &[u8],
    b: &[u8],
    o: &[u8],
) -> String {
    match read {
        Err(e) => format!("an error ({e})"),
        Ok(r) => common::sector_map(
            sector_of(r, sector),
            sector_of(a, sector),
            sector_of(b, sector),
            sector_of(o, sector),
        ),
    }
}

/// Finding R7-1 (a moment of unreadability erases the `either` mark, so the failed write's
/// data, a value the contract permits, can never be read again). Line 0: A dirty and
/// FLUSHed. A 4 KiB write B to sector 0 fails on both devices and its read-back fails:
/// `allow_either` lets sector 0 hold A or B. While the link is still down, a check of the
/// dirty data runs (`drain`, or offline `flush`/`detach`: `verify_dirty`): `verify_line`
/// cannot read the line and calls `mark_damaged` on every dirty sector, which since 92b075b
/// also drops the sector's marks (`settle_marks`). Nothing was learnt about the data (it was
/// not read), yet the mark is gone. The link comes back; sector 0 holds B (the failed write
/// landed there, which the device model allows). A read of line 0 now compares B with A's
/// checksum, `accept_newer_data` refuses it (damaged, and no mark left), and the read fails
/// with EIO; the cleaner never writes sector 0 back; the next checkpoint records the slot
/// without `RECORD_UNVERIFIED` (no mark remains, and `mark_damaged` notes no change anyway),
/// so after a restart B is plain damage for good. The unclean-stop mark (R7-2) goes the same
/// way. Before 92b075b the slot's bit survived `mark_damaged` and B was read back. Rules:
/// §4.1 rule 2 (a sector reads as the last durable value or one written after it: B was
/// written after A, and an EIO is neither) and §4.8 (a failed write's data is accepted).
/// "Unreadable" is not "found damaged": sectors 1..15, equally marked damaged, read fine
/// because their data matches. A fix might keep the marks when a check could not read the
/// sector (only a read that returned data proves damage), or keep unreadability apart from
/// damage.
#[test]
fn r7_1_an_unreadable_check_erases_the_either_mark_and_the_failed_writes_data_reads_eio() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    let failed = data(2, SECTOR);
    fail_everywhere(&cache_dev, &backing, &cache, 0, &failed);
    check_while_unreadable(&cache_dev, &cache);
    // The failed write landed in sector 0 (a legal outcome; CrashDevice may or may not have
    // applied it already).
    cache_dev.write_at(&failed, slot).unwrap();

    let read = common::read_vec(&cache, 0, LINE);
    let mut b_line = flushed.clone();
    b_line[..SECTOR].copy_from_slice(&failed);
    assert!(
        read.as_ref()
            .is_ok_and(|r| sector_of(r, 0) == failed.as_slice()),
        "line 0 (A FLUSHed; a 4 KiB write B to sector 0 failed on both devices with a failed \
         read-back, so sector 0 may hold A or B; a check of the dirty data ran while the cache \
         device could not be read; then the link came back and sector 0 holds B): the read \
         returned {} for sector 0 (A, B, O older, ? anything else); B is the failed write's \
         data, a value the contract permits, and the check that could not read it learnt \
         nothing about it. Damage reported: {:?}",
        describe_sector(&read, 0, &flushed, &b_line, &oldest),
        cache.damaged_ranges()
    );
}

/// Finding R7-2 (the same erasure after an unclean stop: a newer write that landed before the
/// cut reads as EIO). Line 0: A written and FLUSHed; then sector 0 rewritten with C, not
/// flushed; the power is cut with C on the cache device (the journal still records A's
/// checksum, a legal outcome). After the restart every dirty sector is unverified, so C would
/// be accepted as the newer write (§4.8). But a check of the dirty data runs while the cache
/// device cannot be read (a moment's unreadability, as in R7-1): `mark_damaged` drops every
/// sector's unverified mark. The device answers again; the read compares C with A's checksum,
/// refuses it (damaged, no mark) and fails with EIO; after a clean stop the checkpoint has no
/// `RECORD_UNVERIFIED` for the slot, so C is refused for good. Before 92b075b the slot's bit
/// stayed. Rule: §4.1 rule 2 (after a crash a sector reads as the last durable value or a
/// value written after it; C was written after A) and §4.8 (after an unclean stop a non-zero
/// mismatch is accepted as the newer write).
#[test]
fn r7_2_an_unreadable_check_after_an_unclean_stop_erases_the_unverified_mark() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    let newer = data(3, SECTOR);
    cache.volumes()[0]
        .write(0, &newer, false)
        .expect("a write after the FLUSH, not flushed");
    let (cut_cache, cut_backing) = common::cut_keeping_cache_writes(&cache_dev, &backing);
    drop(cache);
    let (cache, _) = common::open_dyn(cut_cache.clone(), cut_backing.clone());
    let on_cache = cut_cache.written_image();
    assert_eq!(
        &on_cache[slot as usize..slot as usize + SECTOR],
        newer.as_slice(),
        "the cut kept C in sector 0 of line 0's slot"
    );
    check_while_unreadable(&cut_cache, &cache);

    let read = common::read_vec(&cache, 0, LINE);
    let mut c_line = flushed.clone();
    c_line[..SECTOR].copy_from_slice(&newer);
    assert!(
        read.as_ref()
            .is_ok_and(|r| sector_of(r, 0) == newer.as_slice()),
        "line 0 (A FLUSHed; sector 0 rewritten with C, not flushed; power cut keeping C on the \
         cache device; restart; a check of the dirty data ran while the cache device could not \
         be read; then it answered again): the read returned {} for sector 0 (A, B = C, O \
         older, ? anything else); C was written after the FLUSH, a value the contract \
         permits, and the check that could not read it learnt nothing about it. Damage \
         reported: {:?}",
        describe_sector(&read, 0, &flushed, &c_line, &oldest),
        cache.damaged_ranges()
    );
}

/// Finding R7-3 (a matching read does not settle a mark, so the mark outlives its evidence
/// and, across the clean stop that is the only way out of `cache failed`, widens back into
/// R6-1). Line 0: A dirty and FLUSHed. A 4 KiB write B to sector 0 fails on both devices with
/// a failed read-back: sector 0 gets an `either` mark. The failed write did not land (sector 0
/// still holds A, a legal outcome). The client reads line 0: every sector matches its
/// checksum, sector 0 included, so the engine now knows sector 0 holds A and nothing is
/// uncertain, but a matching read settles nothing (`verify_cached` only calls
/// `settle_mismatch` on a mismatch), so the mark stays and the next record carries
/// `RECORD_UNVERIFIED`. The volume is `cache failed` (writes go around the cache until the next
/// start), so the daemon is stopped cleanly and started again: the checkpoint's flag marks all
/// 16 dirty sectors unverified. The cache device then damages sector 8 (non-zero garbage),
/// which the failed write never touched: the read returns the garbage as a newer write and
/// the cleaner writes it to the backing device. design.md §4.8 documents the widening, but
/// here it is avoidable without a format change: the read proved the mark void (and a clean
/// stop could read the few marked sectors and settle them before its checkpoint). Rules:
/// §4.8 (exact checksums, any mismatch is damage; damaged dirty data never reaches the
/// backing device) and §4.1 rule 2.
#[test]
fn r7_3_a_matching_read_leaves_the_mark_which_widens_across_the_clean_restart() {
    let len = LINE as usize;
    let (oldest, flushed) = (data(9, len), data(1, len));
    let (cache_dev, backing, cache, slot) = dirty_flushed_line_0(&flushed, &oldest);
    fail_everywhere(&cache_dev, &backing, &cache, 0, &data(2, SECTOR));
    // The failed write did not land (a legal outcome).
    cache_dev.write_at(sector_of(&flushed, 0), slot).unwrap();
    let before = common::read_vec(&cache, 0, LINE);
    assert!(
        before.as_ref().is_ok_and(|r| *r == flushed),
        "line 0 reads as A: every sector matches its checksum"
    );
    cache.shutdown().expect("clean stop");
    drop(cache);
    let (cache, _) = common::open_dyn(cache_dev.clone(), backing.clone());

    let garbage = damage_sector(&cache_dev, slot, 8);
    let read = common::read_vec(&cache, 0, LINE);
    let returned_garbage = read.as_ref().is_ok_and(|r| sector_of(r, 8) == garbage);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; len];
    backing.read_at(&mut on_disk, 0).unwrap();
    assert!(
        !returned_garbage && sector_of(&on_disk, 8) != garbage,
        "line 0 (A FLUSHed; a 4 KiB write to sector 0 failed on both devices with a failed \
         read-back and did not land; a read of line 0 matched every checksum; clean stop and \
         start; then the cache device damaged sector 8 with non-zero garbage): the read {} and \
         the backing device's sector 8 {} after writeback ({drained:?}); sector 8 was never \
         touched by the failed write and every mark was disproved by the read, so the damage \
         must be detected",
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
