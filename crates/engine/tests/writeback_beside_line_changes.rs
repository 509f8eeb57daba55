//! The cleaner writes a line's dirty sectors back without holding the line, so clients go on
//! using the line meanwhile. What it wrote is recorded clean unless the data of a sector it
//! wrote changed after it read them: a change to the line's *other* sectors (a write, a fill
//! by a read miss, a TRIM) must not keep the written sectors dirty, or a drain beside steady
//! use of a dirty line never ends (it used to: every change of the line threw the writeback
//! away). A rewrite of a written sector keeps that sector dirty, with the new data, which a
//! later writeback brings to the disk.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::{data, gated_cache, on_disk, read_in_thread, MIB};
use ssdcache_devsim::GateDevice;
use ssdcache_engine::{Cache, CleanerConfig, Select, Volume};
use ssdcache_format::CacheMode;

const SECTOR: usize = 4096;
const LINE: u64 = 64 * 1024;
const BACKING: u64 = 16 * MIB;
const HELD: Duration = Duration::from_secs(10);

struct Rig {
    mem: Arc<ssdcache_devsim::MemDevice>,
    gate: Arc<GateDevice>,
    cache: Arc<Cache>,
    vol: Arc<Volume>,
}

/// A write-back cache whose line 0 has its first sector dirty (`dirty`), the rest of the line
/// cached clean from the disk (`old`).
fn line_with_one_dirty_sector() -> (Rig, Vec<u8>, Vec<u8>) {
    let (mem, gate, cache) = gated_cache(CacheMode::WriteBack, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let old = data(1, LINE as usize);
    ssdcache_device::BlockDevice::write_at(&*mem, &old, 0).expect("seed backing");
    let mut line = vec![0u8; LINE as usize];
    vol.read(0, &mut line).expect("cache the line");
    let dirty = data(2, SECTOR);
    vol.write(0, &dirty, false).expect("dirty the first sector");
    assert_eq!(cache.dirty_bytes(), SECTOR as u64);
    (
        Rig {
            mem,
            gate,
            cache,
            vol,
        },
        old,
        dirty,
    )
}

/// Runs one cleaner batch whose disk write is held at the gate while `meanwhile` uses the
/// line, then lets it end. Returns the batch's count of lines recorded clean.
fn batch_with_its_write_held(rig: &Rig, meanwhile: impl FnOnce(&Volume)) -> u64 {
    rig.gate.hold_next_write();
    let batch = {
        let cache = rig.cache.clone();
        thread::spawn(move || {
            cache
                .clean_batch(&CleanerConfig::default(), 1, Select::All)
                .expect("cleaner batch")
        })
    };
    assert!(
        rig.gate.wait_until_held(HELD),
        "the batch's write reached the disk"
    );
    meanwhile(&rig.vol);
    rig.gate.release();
    batch.join().expect("batch thread").lines_cleaned
}

/// The batch's writeback of the first sector (`dirty`) landed and was recorded clean.
fn assert_recorded_clean(rig: &Rig, dirty: &[u8], cleaned: u64) {
    assert!(
        on_disk(&rig.mem, 0, SECTOR) == dirty,
        "the writeback landed"
    );
    assert_eq!(cleaned, 1, "the written sector was recorded clean");
}

#[test]
fn a_write_to_another_sector_does_not_keep_the_written_sector_dirty() {
    let (rig, _old, dirty) = line_with_one_dirty_sector();
    let other = data(3, SECTOR);
    let cleaned = batch_with_its_write_held(&rig, |vol| {
        vol.write(5 * SECTOR as u64, &other, false)
            .expect("write another sector")
    });
    assert_recorded_clean(&rig, &dirty, cleaned);
    assert_eq!(
        rig.cache.dirty_bytes(),
        SECTOR as u64,
        "only the sector written meanwhile is dirty"
    );
}

/// A read miss of another sector reads the whole line from the disk, so it waits for the
/// writeback to land (backing order rule 1) and fills the line around the time the batch
/// records it clean, before or after: either way nothing is left dirty and the miss returns the
/// disk's data.
#[test]
fn a_read_miss_filling_another_sector_does_not_keep_the_written_sector_dirty() {
    let (rig, _old, dirty) = line_with_one_dirty_sector();
    rig.vol
        .trim(7 * SECTOR as u64, SECTOR as u64, false)
        .expect("drop a sector so that a read of it misses");
    let mut miss = None;
    let cleaned = batch_with_its_write_held(&rig, |_| {
        miss = Some(read_in_thread(&rig.vol, 7 * SECTOR as u64, SECTOR));
        thread::sleep(Duration::from_millis(100));
    });
    let got = miss
        .expect("miss started")
        .recv_timeout(HELD)
        .expect("the read miss ended");
    assert!(
        got == on_disk(&rig.mem, 7 * SECTOR as u64, SECTOR),
        "the miss returns the disk's data"
    );
    assert_recorded_clean(&rig, &dirty, cleaned);
    assert_eq!(rig.cache.dirty_bytes(), 0, "nothing is dirty");
}

#[test]
fn a_trim_of_another_sector_does_not_keep_the_written_sector_dirty() {
    let (rig, _old, dirty) = line_with_one_dirty_sector();
    let mut trim = None;
    let cleaned = batch_with_its_write_held(&rig, |_| {
        // A TRIM reaches the disk after the writeback it does not overlap; on a thread of its
        // own, so the gate is released whatever it waits for.
        let vol = rig.vol.clone();
        trim = Some(thread::spawn(move || {
            vol.trim(9 * SECTOR as u64, SECTOR as u64, false)
        }));
        thread::sleep(Duration::from_millis(100));
    });
    trim.expect("trim started")
        .join()
        .expect("trim thread")
        .expect("trim");
    assert_recorded_clean(&rig, &dirty, cleaned);
    assert_eq!(rig.cache.dirty_bytes(), 0, "nothing is dirty");
}

/// The safety side: a sector rewritten while its older data is on its way to the disk stays
/// dirty; the disk gets the new data from the next writeback, and reads return it throughout.
#[test]
fn a_rewrite_of_the_written_sector_keeps_it_dirty_with_the_new_data() {
    let (rig, _old, dirty) = line_with_one_dirty_sector();
    let newer = data(4, SECTOR);
    let other = data(5, SECTOR);
    let cleaned = batch_with_its_write_held(&rig, |vol| {
        vol.write(0, &newer, false).expect("rewrite the sector");
        vol.write(3 * SECTOR as u64, &other, false)
            .expect("write another sector");
    });
    assert_eq!(cleaned, 0, "no line was recorded clean");
    assert!(
        on_disk(&rig.mem, 0, SECTOR) == dirty,
        "the older writeback landed"
    );
    assert_eq!(
        rig.cache.dirty_bytes(),
        2 * SECTOR as u64,
        "the rewritten sector and the other one are dirty"
    );
    let mut buf = vec![0u8; SECTOR];
    rig.vol.read(0, &mut buf).expect("read");
    assert!(buf == newer, "reads return the rewrite");
    rig.cache
        .clean_batch(&CleanerConfig::default(), 1, Select::All)
        .expect("second batch");
    assert_eq!(rig.cache.dirty_bytes(), 0);
    assert!(
        on_disk(&rig.mem, 0, SECTOR) == newer,
        "the disk has the rewrite"
    );
    assert!(
        on_disk(&rig.mem, 3 * SECTOR as u64, SECTOR) == other,
        "and the other sector"
    );
}

/// A WRITE_ZEROES of the sector being written back is a rewrite too. (It may go to the disk,
/// where it waits for the writeback it overlaps: it runs on a thread of its own.)
#[test]
fn write_zeroes_of_the_written_sector_keeps_it_dirty_or_lands_after() {
    let (rig, _old, _dirty) = line_with_one_dirty_sector();
    let mut zeroes = None;
    batch_with_its_write_held(&rig, |_| {
        let vol = rig.vol.clone();
        zeroes = Some(thread::spawn(move || {
            vol.write_zeroes(0, SECTOR as u64, false)
        }));
        thread::sleep(Duration::from_millis(100));
    });
    zeroes
        .expect("write zeroes started")
        .join()
        .expect("write zeroes thread")
        .expect("write zeroes");
    let mut buf = vec![1u8; SECTOR];
    rig.vol.read(0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0), "reads return zeroes");
    rig.cache
        .clean_batch(&CleanerConfig::default(), 1, Select::All)
        .expect("second batch");
    assert_eq!(rig.cache.dirty_bytes(), 0);
    assert!(
        on_disk(&rig.mem, 0, SECTOR).iter().all(|&b| b == 0),
        "the disk has the zeroes"
    );
}
