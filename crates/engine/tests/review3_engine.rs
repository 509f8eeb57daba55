//! Third adversarial review of the data path (issue #10), against branch h-engine: each test
//! reproduces one finding and failed before the engine was fixed (they pass now). Each names the
//! sequence of events and the rule of docs/design.md §4.1 it breaks.

mod common;

use std::sync::Arc;

use common::{data, open_dyn};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SECTOR: u64 = 4096;
const CACHE_SIZE: u64 = 32 << 20;
const BACKING_SIZE: u64 = 64 << 20;

/// Finding R3-1 (data loss without a crash). A fill rewrites the line's dirty sectors "with
/// the same cached bytes" (`put_clean` leaves them out of `keep`), so a failed cache write of
/// a fill run that contains a dirty sector ends in `put_clean_run`'s error branch, which
/// calls `invalidate_slot` on the whole run: the dirty sector is dropped from the map (valid
/// and dirty cleared). Nothing then remembers that the cache held the only copy: reads are
/// served from the backing device (its older data), the cleaner never writes the sector
/// back, and the next commit records the slot free, so even a crash cannot bring it back.
/// Rule 2 of §4.1 ("nothing older is ever lost") and §3 ("a read of a dirty sector that
/// cannot be read from the cache fails with EIO, never returning the stale backing copy").
/// The bytes the failed write tried to put there were the same as the dirty data, so the
/// slot is no worse than before; the sector should have stayed dirty.
#[test]
fn r3_1_a_failed_fill_write_drops_flushed_dirty_data() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let oldest = data(9, SECTOR as usize);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, SECTOR as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().expect("sector 0 durable, dirty in the cache");

    // A read of sector 1 (same line) misses and fills the whole line, sector 0 included
    // (rewritten with its own cached bytes). The cache device fails that write.
    cache_dev.fail_writes(true);
    let neighbour = common::read_vec(&cache, SECTOR, SECTOR);
    cache_dev.fail_writes(false);
    assert!(
        neighbour.is_ok(),
        "the backing device serves the read of sector 1"
    );

    let live = common::read_vec(&cache, 0, SECTOR);
    vol.flush().ok();
    let after_flush = common::read_vec(&cache, 0, SECTOR);
    assert!(
        live.as_ref().is_ok_and(|r| *r == flushed) || live.is_err() && after_flush.is_err(),
        "sector 0 (written, FLUSHed, then a fill of its line failed on the cache device) \
         reads as {} live and {} after another FLUSH (volume state {:?}): must be the flushed \
         data, or EIO while the cache cannot give it back",
        common::outcome(&live, &flushed, &oldest),
        common::outcome(&after_flush, &flushed, &oldest),
        vol.state()
    );
}

/// Finding R3-2 (flip-flop after a kill -9). `Backing::new` now makes the first FLUSH after a
/// restart reach the device, because writes of the killed run may still sit in the backing
/// device's volatile cache. But nothing flushes them at open, and reads are served from that
/// volatile cache meanwhile: a sector written (not flushed) before a kill -9 reads as the new
/// value after the restart, and a power cut before the first FLUSH then brings the older
/// value back. Rule 3 of §4.1: after the restart a sector keeps reading the same value until
/// it is written again, across further restarts. Opening the cache could flush the backing
/// devices (and the cache device) before serving, as recovery already does for the journal.
#[test]
fn r3_2_a_read_after_a_kill_9_restart_flips_back_at_the_next_power_cut() {
    let (cache_dev, backing, cache) =
        common::setup_crash(CACHE_SIZE, BACKING_SIZE, LINE, CacheMode::WriteThrough);
    let newer = data(5, SECTOR as usize);
    cache.volumes()[0]
        .write(0, &newer, false)
        .expect("write-through write, not flushed");
    // kill -9: the process ends without a clean stop; the devices (and their volatile
    // caches) live on.
    drop(cache);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let after_restart = common::read_vec(&cache, 0, SECTOR).expect("read after the restart");
    assert_eq!(after_restart, newer, "the restart serves the newer value");
    drop(cache);

    // A power cut now, before any client FLUSH: only what was flushed survives.
    let cache_img = Arc::new(CrashDevice::from_image("cache", cache_dev.durable_image()));
    let backing_img = Arc::new(CrashDevice::from_image("backing", backing.durable_image()));
    let (cache, _) = open_dyn(cache_img, backing_img);
    let after_cut = common::read_vec(&cache, 0, SECTOR);
    assert!(
        after_cut.as_ref().is_ok_and(|r| *r == newer),
        "sector 0 read as the newer value after the kill -9 restart, but as {} after the \
         next power cut (flip-flop)",
        common::outcome(&after_cut, &newer, &vec![0u8; SECTOR as usize])
    );
}

/// Finding R3-3 (the crash model is narrower than the contract it checks). docs/design.md
/// §4.1 and crashsim/contract.rs say a failed write may or may not have landed, and the
/// engine is built on that (`Backing::write_with` counts failed writes so the next flush
/// covers them; a failed journal write forces a fresh generation; `put_clean_run` and
/// `write_back_segment` treat the slot's bytes as unknown). But `CrashDevice` drops a failed
/// write entirely: it never reaches the written image, nor the pending writes a power cut may
/// keep. So no crash test (crash.rs, crash_concurrent.rs, crash_defects.rs) can see the
/// effect of a failed write that landed, and a regression in any of those paths (say, not
/// counting failed backing writes) passes every crash test. The model should put a failed
/// write among the pending writes (kept, dropped or torn at a cut) and, by a seed, in the
/// written image.
#[test]
fn r3_3_a_failed_write_never_lands_in_the_crash_model() {
    let dev = CrashDevice::new("dev", 1 << 20);
    dev.fail_writes(true);
    let payload = data(3, SECTOR as usize);
    assert!(
        dev.write_at(&payload, 0).is_err(),
        "the switch fails the write"
    );
    dev.fail_writes(false);
    let mut buf = vec![0u8; SECTOR as usize];
    dev.read_at(&mut buf, 0).unwrap();
    let everything = dev.crashed_keeping("cut", ssdcache_devsim::Keep::Everything);
    let mut after_cut = vec![0u8; SECTOR as usize];
    everything.read_at(&mut after_cut, 0).unwrap();
    assert!(
        buf == payload || after_cut == payload,
        "a failed write may land (§4.1), but neither reads nor any power cut of the model can \
         ever show it"
    );
}
