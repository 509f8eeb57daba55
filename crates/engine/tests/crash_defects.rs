//! One deterministic test per write-back loss defect: the two found in review (issue #10) and
//! those the crash simulator found (crashsim/, documented at each test). Each builds
//! the exact sequence that loses data, cuts the power with the worst outcome the device model
//! allows, reopens and checks the durability contract (docs/design.md §4.1) for the sector at
//! stake. The randomized crash tests (crash.rs, crash_concurrent.rs) find the same defects;
//! these name them.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::identity;
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, GateDevice, Keep};
use ssdcache_engine::{
    format, format_with_journal, read_superblock, Cache, CleanerConfig, NewVolume, Volume,
};
use ssdcache_format::{CacheMode, Layout};

const SECTOR: u64 = 4096;
const CACHE: u64 = 16 << 20;
const BACKING: u64 = 32 << 20;
const LINE: u64 = 64 << 10;

fn volume() -> NewVolume {
    NewVolume {
        name: "v".into(),
        mode: CacheMode::WriteBack,
        backing: identity(BACKING),
        sequential_cutoff: 0,
        policy: 0,
        admission: Default::default(),
    }
}

fn open(cache: Arc<dyn BlockDevice>, backing: Arc<dyn BlockDevice>) -> Cache {
    let sb = read_superblock(&*cache).expect("superblock");
    Cache::open(cache, sb, vec![backing]).expect("open").0
}

/// One sector's worth of a recognizable byte.
fn data(byte: u8) -> Vec<u8> {
    vec![byte; SECTOR as usize]
}

fn read_byte(vol: &Volume, offset: u64) -> u8 {
    let mut buf = data(0xEE);
    vol.read(offset, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == buf[0]), "torn sector at {offset}");
    buf[0]
}

/// Defect 1: a FLUSH on one connection while a write to the backing device (here a
/// WRITE_ZEROES over a dirty line) is in flight on another cleared the "backing device needs a
/// flush" flag before that write landed. The next commit then skipped the backing flush and
/// durably recorded the superseded dirty line free: after a power cut the sector read data
/// older than the dirty data a FLUSH had already made durable.
#[test]
fn flush_racing_a_write_to_the_backing_device() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    let gate = Arc::new(GateDevice::new(backing.clone()));
    format(&*cache_dev, LINE, volume()).expect("format");
    let cache = open(cache_dev.clone(), gate.clone());
    let vol = cache.volumes()[0].clone();
    let at = 0;
    // The backing device durably holds 0x0D (old data), the cache durably holds 0xD1 dirty.
    vol.write(at, &data(0x0D), false).expect("write old");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("write back old");
    vol.write(at, &data(0xD1), false).expect("write dirty");
    vol.flush().expect("flush: 0xD1 is durable now");

    // WRITE_ZEROES over the dirty sector, held in flight at the backing device...
    gate.hold_next_write();
    let v = vol.clone();
    let zeroing = std::thread::spawn(move || v.write_zeroes(at, SECTOR, false));
    assert!(
        gate.wait_until_held(Duration::from_secs(10)),
        "the zeroing never reached the backing device"
    );
    // ... while another connection's FLUSH completes.
    vol.flush().expect("racing flush");
    gate.release();
    assert!(matches!(zeroing.join(), Ok(Ok(()))), "zeroing failed");
    // A FUA write elsewhere commits the journal, which now says the dirty line is gone.
    let elsewhere = 16 * LINE;
    vol.write(elsewhere, &data(0xF0), true).expect("FUA write");

    // Power cut: no unflushed write survives on either device.
    let cache_img: Arc<dyn BlockDevice> =
        Arc::new(cache_dev.crashed_keeping("cache", Keep::Nothing));
    let backing_img: Arc<dyn BlockDevice> =
        Arc::new(backing.crashed_keeping("backing", Keep::Nothing));
    let cache = open(cache_img, backing_img);
    let vol = &cache.volumes()[0];
    assert_eq!(read_byte(vol, elsewhere), 0xF0, "the FUA write was lost");
    let got = read_byte(vol, at);
    assert!(
        got == 0xD1 || got == 0,
        "the sector at byte {at} reads {got:#x} after the power cut: older than 0xD1, which a \
         FLUSH had made durable (allowed: 0xd1, or the zeroes written after it)"
    );
}

/// The smallest journal write-back accepts (two compactions and one block), in blocks: the
/// line count, and so a compaction's size, grows as the journal shrinks.
fn smallest_journal(cache: u64, line: u64) -> u64 {
    (3..4096)
        .find(|&blocks| Layout::with_journal_blocks(cache, line, blocks).is_ok())
        .expect("a journal size write-back accepts")
}

/// Defect 2: a failed journal commit left its blocks on the device with sequence numbers the
/// next commit reuses. A compaction starting at that sequence wrote fewer blocks (here none:
/// nothing was dirty), so replay ran on into the failed commit's blocks and restored its
/// stale dirty lines, over newer data that a FLUSH had made durable on the backing device.
#[test]
fn failed_commit_replayed_after_a_later_compaction() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    // The smallest journal write-back accepts: two compactions and one block.
    let journal = smallest_journal(CACHE, LINE);
    let compaction = (journal - 1) / 2;
    format_with_journal(&*cache_dev, LINE, journal, volume()).expect("format");
    let cache = open(cache_dev.clone(), backing.clone());
    assert_eq!(cache.layout().compaction_blocks(), compaction);
    let vol = cache.volumes()[0].clone();
    let line = |n: u64| n * LINE;

    // `compaction` one-block commits: the live journal is `compaction` blocks long, so one
    // more block still fits beside room for a compaction, and two do not.
    for n in 0..compaction {
        vol.write(line(100 + n), &data(0x11), false).expect("write");
        cache.commit().expect("one-block commit");
    }
    // A one-block commit naming lines 0..10 dirty reaches the journal; the flush after it fails.
    for n in 0..10 {
        vol.write(line(n), &data(0xD1), false).expect("write");
    }
    cache_dev.fail_flush_after(1);
    assert!(
        cache.commit().is_err(),
        "the injected flush failure was not seen"
    );
    // More changed lines than one block holds, so the next commit is a compaction; the
    // writeback makes every line clean first, so the compaction writes no block at all.
    for n in 0..120 {
        vol.write(line(200 + n), &data(0x22), false).expect("write");
    }
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_lines(), 0);
    // Newer data for line 5, made durable by a FLUSH that succeeds.
    let at = line(5);
    vol.write_zeroes(at, SECTOR, false).expect("zero");
    vol.flush()
        .expect("flush after the dirty data was written back");
    assert_eq!(read_byte(&vol, at), 0);

    let cache_img: Arc<dyn BlockDevice> =
        Arc::new(cache_dev.crashed_keeping("cache", Keep::Nothing));
    let backing_img: Arc<dyn BlockDevice> =
        Arc::new(backing.crashed_keeping("backing", Keep::Nothing));
    let cache = open(cache_img, backing_img);
    let got = read_byte(&cache.volumes()[0], at);
    assert_eq!(
        got, 0,
        "the sector at byte {at} reads {got:#x} after the power cut, not the zeroes a FLUSH \
         made durable"
    );
    assert_eq!(
        cache.dirty_lines(),
        0,
        "recovery restored dirty lines of a commit that failed"
    );
}

/// Found by the concurrent crash simulator (not in the issue): while a volume leaves
/// write-back (`set_mode` serves writes in write-through while it writes the dirty data
/// back), a write-through write to a line that is still dirty writes the backing device (FUA:
/// and flushes it) and then rewrites the cached copy, which stays marked dirty and is not
/// flushed. After a power cut the journal still names the line dirty, recovery restores it,
/// and the sector reads the older data left in the slot instead of the FUA write's.
#[test]
fn write_through_over_a_dirty_line_while_leaving_write_back() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    format(&*cache_dev, LINE, volume()).expect("format");
    let cache = open(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let at = 3 * SECTOR;
    vol.write(at, &data(0xD1), false).expect("write dirty");
    vol.flush()
        .expect("flush: 0xD1 is durable and dirty in the cache");
    // What `set_mode` does first when a volume leaves write-back: writes go through.
    cache.hold_writes_through(0);
    vol.write(at, &data(0xD2), true)
        .expect("FUA write: 0xD2 is durable");

    let cache_img: Arc<dyn BlockDevice> =
        Arc::new(cache_dev.crashed_keeping("cache", Keep::Nothing));
    let backing_img: Arc<dyn BlockDevice> =
        Arc::new(backing.crashed_keeping("backing", Keep::Nothing));
    let cache = open(cache_img, backing_img);
    let got = read_byte(&cache.volumes()[0], at);
    assert_eq!(
        got, 0xD2,
        "the sector at byte {at} reads {got:#x} after the power cut, not the FUA write's 0xd2"
    );
}

/// Found by the concurrent crash simulator (not in the issue): once a volume's configured
/// mode is no longer write-back (`set_mode` sets it before writing the dirty data back), a
/// FLUSH commits only when it sees dirty lines or changed records. While the writeback's
/// commit is in flight it has taken the changes (here: a WRITE_ZEROES that superseded a dirty
/// line), so the FLUSH sees neither and returns at once; a power cut before that commit lands
/// leaves the journal naming the superseded line dirty, and recovery brings its older data
/// back over the zeroes the FLUSH had made durable.
#[test]
fn flush_after_leaving_write_back_does_not_wait_for_the_commit_in_flight() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    let cache_gate = Arc::new(GateDevice::new(cache_dev.clone()));
    let backing_gate = Arc::new(GateDevice::new(backing.clone()));
    format(&*cache_dev, LINE, volume()).expect("format");
    let cache = Arc::new(open(cache_gate.clone(), backing_gate.clone()));
    let vol = cache.volumes()[0].clone();
    let (first, second) = (0, 8 * LINE);
    vol.write(first, &data(0xD1), false).expect("write");
    vol.write(second, &data(0xD2), false).expect("write");
    vol.flush().expect("flush: both lines durably dirty");

    // Leave write-back; its writeback of the first line is held at the backing device.
    backing_gate.hold_next_write();
    let c = cache.clone();
    let leaving = std::thread::spawn(move || {
        let one_at_a_time = CleanerConfig {
            max_in_flight: 1,
            ..CleanerConfig::default()
        };
        c.set_mode(0, CacheMode::WriteThrough, &one_at_a_time, &mut |_| true)
    });
    assert!(backing_gate.wait_until_held(Duration::from_secs(10)));
    // Zeroes supersede the second dirty line; then the writeback's commit, which records
    // that, is held in flight at the cache device.
    vol.write_zeroes(second, SECTOR, false).expect("zero");
    cache_gate.hold_next_write();
    backing_gate.release();
    assert!(cache_gate.wait_until_held(Duration::from_secs(10)));
    let v = vol.clone();
    let (done_tx, done) = std::sync::mpsc::channel();
    let flushing = std::thread::spawn(move || {
        let r = v.flush();
        let _ = done_tx.send(());
        r
    });
    // A FLUSH that returns while the commit is still held skipped it: cut the power now.
    let returned_early = done.recv_timeout(Duration::from_secs(2)).is_ok();
    let images = |keep| {
        let c: Arc<dyn BlockDevice> = Arc::new(cache_dev.crashed_keeping("cache", keep));
        let b: Arc<dyn BlockDevice> = Arc::new(backing.crashed_keeping("backing", keep));
        (c, b)
    };
    let early = returned_early.then(|| images(Keep::Nothing));
    cache_gate.release();
    assert!(matches!(flushing.join(), Ok(Ok(()))), "the FLUSH failed");
    assert!(
        matches!(leaving.join(), Ok(Ok(()))),
        "the mode change failed"
    );
    let (c, b) = early.unwrap_or_else(|| images(Keep::Nothing));
    let cache = open(c, b);
    let got = read_byte(&cache.volumes()[0], second);
    assert_eq!(
        got, 0,
        "the sector at byte {second} reads {got:#x} after the power cut, not the zeroes a \
         completed FLUSH made durable (the FLUSH returned before the commit in flight landed: \
         {returned_early})"
    );
}

/// Found by the concurrent crash simulator on the engine with sector checksums (seeds 71 and
/// 155 of crash_concurrent): WRITE_ZEROES over one durably dirty sector of a line that keeps
/// other dirty sectors, then a read that refills the line, rewrites that sector in the slot
/// (with the zeroes) while the journal still names it dirty with the old data's checksum.
/// After a power cut that keeps the refill, recovery finds zeroes that do not match and calls
/// the sector damaged: the read fails, where the contract allows the old data or the zeroes.
#[test]
fn zeroes_over_a_dirty_sector_then_a_refill_read_as_damage_after_a_power_cut() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    format(&*cache_dev, LINE, volume()).expect("format");
    let cache = open(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let at = 5 * LINE;
    vol.write(at, &[data(0xD1), data(0xD2)].concat(), false)
        .expect("write two sectors");
    vol.flush().expect("flush: both sectors durably dirty");
    vol.write_zeroes(at, SECTOR, false).expect("zero the first");
    // Refills the line's missing sector from the backing device (the zeroes).
    assert_eq!(read_byte(&vol, at), 0);

    // Power cut: every unflushed write to the cache lands, none to the backing device.
    let cache_img: Arc<dyn BlockDevice> =
        Arc::new(cache_dev.crashed_keeping("cache", Keep::Everything));
    let backing_img: Arc<dyn BlockDevice> =
        Arc::new(backing.crashed_keeping("backing", Keep::Nothing));
    let cache = open(cache_img, backing_img);
    let mut buf = data(0xEE);
    let read = cache.volumes()[0].read(at, &mut buf);
    assert!(
        read.is_ok(),
        "the sector at byte {at} cannot be read after the power cut: {read:?} (allowed: 0xd1, \
         or the zeroes written after it)"
    );
    assert!(
        buf.iter().all(|&b| b == 0) || buf.iter().all(|&b| b == 0xD1),
        "the sector at byte {at} reads {:#x}",
        buf[0]
    );
}

/// Found by the crash simulator on the engine that counts backing writes against flushes
/// (seed 13 of crash.rs): a FLUSH after a restart flushes the backing device only if this
/// process wrote to it, so a write that completed before the daemon was killed, and that
/// reads back after the restart from the backing device's volatile cache, is not made durable
/// by the FLUSH that follows; a power cut then brings the older data back.
#[test]
fn flush_after_a_restart_makes_writes_before_it_durable() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    format(&*cache_dev, LINE, volume()).expect("format");
    let cache = open(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let at = 2 * LINE;
    vol.write(at, &data(0xD1), false).expect("write");
    vol.flush().expect("flush");
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("write back: 0xd1 is durable on the backing device");
    vol.write_zeroes(at, SECTOR, false)
        .expect("zeroes complete");
    // kill -9: no clean stop; the zeroes are still in the backing device's volatile cache.
    drop(vol);
    drop(cache);
    let cache = open(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    assert_eq!(read_byte(&vol, at), 0);
    vol.flush()
        .expect("FLUSH: every completed write is durable now");

    let cache_img: Arc<dyn BlockDevice> =
        Arc::new(cache_dev.crashed_keeping("cache", Keep::Nothing));
    let backing_img: Arc<dyn BlockDevice> =
        Arc::new(backing.crashed_keeping("backing", Keep::Nothing));
    let cache = open(cache_img, backing_img);
    let got = read_byte(&cache.volumes()[0], at);
    assert_eq!(
        got, 0,
        "the sector at byte {at} reads {got:#x} after the power cut, not the zeroes that read \
         back before a completed FLUSH"
    );
}
