//! Fourth adversarial review of the data path (issue #10), against the fixes of 6c78063: each
//! test reproduces one finding and failed before the engine was fixed (it passes now). Each
//! names the sequence of events and the rule of docs/design.md §4.1 it breaks.

mod common;

use common::data;
use ssdcache_device::BlockDevice;
use ssdcache_engine::CleanerConfig;

const LINE: u64 = 64 << 10;

/// Finding R4-1 (flushed data destroyed by a write that failed). `write_back_segment`, when the
/// cache write of a write-back write fails, writes the data to the backing device and only
/// then drops the sectors from the map (`invalidate_slot`). When that backing write fails too,
/// the `?` returns before the map is touched: the sectors stay dirty with the checksum of the
/// older, flushed data A. But the failed cache write may have landed (design.md §4.1, the
/// CrashDevice model since 6c78063): the slot now holds B where the map promises A. Every read
/// of those sectors fails the checksum on dirty data and returns EIO; the cleaner marks them
/// damaged and never writes them back; offline `flush` refuses; `--discard-damaged` gives the
/// backing device's data, older than the FLUSH. Rule 2 of §4.1 (after a failed write a sector
/// holds the last durable value or the failed write's, never neither) and rule 4 (the dirty
/// data never reaches the backing device). The engine still assumes here that a failed cache
/// write changed nothing. A clean stop and restart keeps the damage (the checkpoint carries the
/// old checksum); only an unclean restart heals it (the slot is then unverified and the landed
/// bytes are accepted as a newer write). Realistic beyond a shared controller: cache and
/// backing files on one full copy-on-write filesystem both fail with ENOSPC, and
/// `FileDevice::write_at` (`write_all_at`) may have written a prefix before the error. A fix
/// might drop the sectors from the map before the backing write, or read the slot back and
/// keep, per sector, whichever of the old and new checksums it matches.
#[test]
fn r4_1_a_write_failing_on_both_devices_destroys_the_flushed_dirty_data() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let len = LINE as usize;
    let oldest = data(9, len);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, len);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().expect("line 0 durable, dirty in the cache");

    // Both devices fail the next write of line 0 (an SSD and a disk on one failing
    // controller, a cable): the client gets an error.
    cache_dev.fail_writes(true);
    backing.fail_writes(true);
    let failed = data(2, len);
    assert!(vol.write(0, &failed, false).is_err(), "the write fails");
    cache_dev.fail_writes(false);
    backing.fail_writes(false);

    let mut live = vec![0u8; len];
    let read = vol.read(0, &mut live);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; len];
    backing.read_at(&mut on_disk, 0).unwrap();
    let disk = common::sector_map(&on_disk, &flushed, &failed, &oldest);
    assert!(
        read.is_ok() && drained.is_ok() && !disk.contains(['O', '?']),
        "line 0 (written, FLUSHed, then a write that failed on both devices): the read \
         returned {read:?} ({}), writeback {drained:?}, the backing device holds {disk} \
         (per 4 KiB sector: A flushed, B the failed write, O older than the FLUSH): every \
         sector must stay A or B and reach the backing device",
        if read.is_ok() {
            common::sector_map(&live, &flushed, &failed, &oldest)
        } else {
            "-".into()
        }
    );
}
