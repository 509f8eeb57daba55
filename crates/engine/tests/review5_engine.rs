//! Fifth adversarial review of the data path (issue #10), against d8b10a7 (a write-back write
//! failing on both devices) and b1dbe96 (a failed fresh generation gives back its change
//! list). Each test reproduces one finding: it failed before the engine was fixed (it passes
//! now) and names the sequence of events and the rule of docs/design.md §4.1 it breaks.

mod common;

use common::data;
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::CleanerConfig;

const LINE: u64 = 64 << 10;
const SECTOR: usize = 4096;

/// Finding R5-1 (the R4-1 fix does nothing when the cache device also fails the read-back).
/// `after_failing_everywhere` reads the slot back to tell, per dirty sector, whether the
/// failed cache write landed; when that read fails (`read_back.is_err()`) every dirty sector
/// keeps the old data's checksum. But the failed write may have landed all the same: the
/// slot then holds B where the map promises A, exactly the state R4-1 reported. Once the
/// device answers again, every read of those sectors fails its checksum on dirty data and
/// returns EIO, the cleaner marks them damaged and never writes them back, and
/// `--discard-damaged` gives the backing device's data, older than the FLUSH. Rule 2 of §4.1
/// (after a failed write a sector holds the last durable value or the failed write's) and
/// rule 4 (dirty data reaches the backing device). This is the scenario R4-1 and d8b10a7
/// name as realistic, "an SSD and a disk on one failing controller, a cable": a failing
/// controller or cable fails the read that follows the failed write as surely as the write.
/// A clean stop keeps the damage (the checkpoint carries the old checksum). A fix cannot
/// learn which value landed without a read; it might keep such sectors dirty under either
/// checksum (unverified, accepting the failed write's checksum as well), or retry the
/// read-back later, before anything reads or writes back the line.
#[test]
fn r5_1_a_failed_read_back_leaves_the_flushed_dirty_data_damaged() {
    let (cache_dev, backing, cache) = common::crash_cache();
    let len = LINE as usize;
    let oldest = data(9, len);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, len);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().expect("line 0 durable, dirty in the cache");

    // One failing controller (or cable) under both devices: the write fails on both and so
    // does the cache read that follows it; then the link comes back.
    cache_dev.fail_writes(true);
    cache_dev.fail_reads(true);
    backing.fail_writes(true);
    let failed = data(2, len);
    assert!(vol.write(0, &failed, false).is_err(), "the write fails");
    cache_dev.fail_writes(false);
    cache_dev.fail_reads(false);
    backing.fail_writes(false);

    let mut in_slot = vec![0u8; len];
    cache_dev
        .read_at(
            &mut in_slot,
            slot_offset_of_line_0(&cache_dev, &flushed, &failed),
        )
        .unwrap();
    let mut live = vec![0u8; len];
    let read = vol.read(0, &mut live);
    let drained = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut on_disk = vec![0u8; len];
    backing.read_at(&mut on_disk, 0).unwrap();
    let disk = common::sector_map(&on_disk, &flushed, &failed, &oldest);
    assert!(
        read.is_ok() && drained.is_ok() && !disk.contains(['O', '?']),
        "line 0 (written, FLUSHed, then a write that failed on both devices and whose \
         read-back failed too): the slot holds {} (per 4 KiB sector: A flushed, B the failed \
         write), the read returned {read:?} ({}), writeback {drained:?}, the backing device \
         holds {disk} (O older than the FLUSH): every sector must stay A or B and reach the \
         backing device",
        common::sector_map(&in_slot, &flushed, &failed, &oldest),
        if read.is_ok() {
            common::sector_map(&live, &flushed, &failed, &oldest)
        } else {
            "-".into()
        }
    );
}

/// Where line 0's slot sits on the cache device: the one line-sized, line-aligned region
/// whose sectors each hold line 0's flushed or failed data (the test's only cached line).
fn slot_offset_of_line_0(cache_dev: &CrashDevice, a: &[u8], b: &[u8]) -> u64 {
    let image = cache_dev.written_image();
    let len = a.len();
    (0..image.len() / len)
        .map(|i| i * len)
        .find(|&at| {
            image[at..at + len]
                .chunks(SECTOR)
                .enumerate()
                .all(|(i, s)| {
                    s == &a[i * SECTOR..(i + 1) * SECTOR] || s == &b[i * SECTOR..(i + 1) * SECTOR]
                })
        })
        .expect("line 0's slot on the cache device") as u64
}
