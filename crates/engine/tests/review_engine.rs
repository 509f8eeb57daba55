//! Adversarial review of the write-back trust changes (commit protocol, checksums): each test
//! here reproduces one finding and fails until the engine is fixed. Each names the sequence of
//! events and the rule of docs/design.md §4.1 it breaks.

mod common;

use std::ops::Range;
use std::sync::{Arc, Mutex};

use common::{data, format_dev, open_dyn};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{read_superblock, Cache};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SECTOR: u64 = 4096;
const CACHE_SIZE: u64 = 32 << 20;
const BACKING_SIZE: u64 = 64 << 20;

/// A crash-simulating device whose next write overlapping a chosen byte range fails (once),
/// changing nothing: a transient I/O error at one chosen step of a commit.
struct FailOnce {
    inner: Arc<CrashDevice>,
    next_write_fails_in: Mutex<Option<Range<u64>>>,
}

impl FailOnce {
    fn new(inner: Arc<CrashDevice>) -> Arc<FailOnce> {
        Arc::new(FailOnce {
            inner,
            next_write_fails_in: Mutex::new(None),
        })
    }

    /// The next write that overlaps `range` fails with EIO.
    fn fail_next_write_in(&self, range: Range<u64>) {
        *self.next_write_fails_in.lock().unwrap() = Some(range);
    }
}

impl BlockDevice for FailOnce {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        {
            let mut fail = self.next_write_fails_in.lock().unwrap();
            let end = offset + buf.len() as u64;
            if fail
                .as_ref()
                .is_some_and(|r| offset < r.end && r.start < end)
            {
                *fail = None;
                return Err(std::io::Error::from_raw_os_error(libc_eio()));
            }
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

fn libc_eio() -> i32 {
    5
}

fn read_vec(cache: &Cache, offset: u64, len: u64) -> ssdcache_engine::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    cache.volumes()[0].read(offset, &mut buf)?;
    Ok(buf)
}

/// Compares two buffers, saying only where they first differ (they are large).
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        let all_zero = got.iter().all(|&b| b == 0);
        panic!("{what} (first difference at byte {at}; the read returned all zeroes: {all_zero})");
    }
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
}

/// Reopens what a power cut now leaves of both devices (only flushed writes survive).
fn power_cut(cache_dev: &CrashDevice, backing: &CrashDevice) -> (Arc<CrashDevice>, Cache) {
    let cache_img = Arc::new(CrashDevice::from_image("cache", cache_dev.durable_image()));
    let backing_img = Arc::new(CrashDevice::from_image("backing", backing.durable_image()));
    let (cache, _) = open_dyn(cache_img.clone(), backing_img);
    (cache_img, cache)
}

/// Finding 1. A compaction (fresh journal generation) whose superblock copy A landed but whose
/// copy B write failed is treated as not having happened: the in-memory journal position and
/// superblock stay at the old generation, so the next commit writes its own fresh generation
/// over the very blocks that the landed copy A names. From that commit's journal flush until
/// its own copy A lands, the durable superblock names a generation whose blocks are gone:
/// a power cut there replays nothing, and every dirty line — flushed ones included — is lost
/// (§4.1 rule 1). Here the second attempt's copy A write fails too, which leaves exactly that
/// durable state; a crash at the same point of a successful attempt does the same.
#[test]
fn f1_compaction_after_a_half_written_superblock_loses_flushed_data() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE_SIZE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING_SIZE));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING_SIZE, 0);
    let faulty = FailOnce::new(cache_dev.clone());
    let (cache, _) = open_dyn(faulty.clone(), backing.clone());
    let layout = cache.layout();
    let vol = cache.volumes()[0].clone();

    let flushed = data(1, LINE as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().expect("FLUSH acknowledged: line 0 is durable");

    // A journal write fails: the next commit must start a fresh generation.
    vol.write(LINE, &data(2, SECTOR as usize), false).unwrap();
    let journal = layout.journal_offset..layout.journal_offset + layout.journal_len;
    faulty.fail_next_write_in(journal);
    assert!(cache.commit().is_err(), "journal write fails");

    // The compaction (the cleaner's periodic commit: a FLUSH is refused after the failure):
    // its blocks land and are flushed, superblock copy A lands, copy B fails.
    faulty.fail_next_write_in(65536..65536 + 4096);
    assert!(
        cache.commit_in_background().is_err(),
        "superblock copy B fails"
    );
    let on_disk = read_superblock(&*cache_dev).unwrap();
    assert_ne!(
        on_disk.journal_generation,
        cache.superblock().journal_generation,
        "copy A names the new generation; the engine believes the old one is live"
    );

    // Up to here a power cut is harmless: copy A names the new generation, whose blocks landed.
    {
        let (_dev, cache) = power_cut(&cache_dev, &backing);
        assert_same(
            &read_vec(&cache, 0, LINE).expect("read"),
            &flushed,
            "power cut right after the failed copy B",
        );
    }

    // The next commit (the cleaner's periodic one, say) must not compact again over the same
    // blocks while a copy may name them. Whichever superblock copy fails this time, a power
    // cut must find the data.
    // (The superblock write puts copy A's newer state last, so copy B is its first write:
    // failing it leaves copy A naming the generation whose blocks a second compaction at the
    // same place would have overwritten.)
    faulty.fail_next_write_in(65536..65536 + 4096);
    let _ = cache.commit_in_background();

    drop((vol, cache));
    let (_dev, cache) = power_cut(&cache_dev, &backing);
    assert_same(
        &read_vec(&cache, 0, LINE).expect("read after the power cut"),
        &flushed,
        "data acknowledged by a FLUSH was lost: the durable superblock names a journal \
         generation whose blocks the next compaction overwrote",
    );
}

/// A write-back cache on crash-simulating devices, sequential cutoff 0.
fn crash_cache() -> (Arc<CrashDevice>, Arc<CrashDevice>, Cache) {
    common::setup_crash(CACHE_SIZE, BACKING_SIZE, LINE, CacheMode::WriteBack)
}

/// Finding 2. While a volume leaves write-back (`set-mode`: `hold_writes_through`, then the
/// drain), writes are served in write-through. A write-through write over a sector that is
/// still dirty puts the new data in the slot (`fill`), but `set_clean_valid` keeps the dirty
/// sector's old checksum. The next read of the sector sees a mismatch on a dirty sector,
/// calls it damage, fails with EIO and puts the whole volume in "cache failed"; the cleaner
/// never writes it back, and `drain` (hence the mode change itself) refuses. A legitimate
/// client write made good data look damaged.
#[test]
fn f2_write_through_over_a_dirty_sector_leaves_a_stale_checksum() {
    let (_cache_dev, backing, cache) = crash_cache();
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, SECTOR as usize), false).unwrap();
    assert_eq!(vol.stats().dirty_lines, 1);

    // `ssdcache set-mode write-through` on the running daemon: writes go through while the
    // dirty data is written back.
    cache.hold_writes_through(0);
    let newer = data(2, SECTOR as usize);
    vol.write(0, &newer, false).expect("write-through write");

    let read = read_vec(&cache, 0, SECTOR);
    assert!(
        read.as_ref().is_ok_and(|r| *r == newer),
        "the sector just written reads back as an error or wrong data: {:?}; volume state {:?}",
        read.map(|_| "wrong data"),
        vol.state()
    );
    cache
        .drain(&ssdcache_engine::CleanerConfig::default(), &mut |_| true)
        .expect("the drain of the mode change");
    assert!(backing.written_image()[..SECTOR as usize] == newer[..]);
}

/// Finding 3 (older than this change, same path as finding 2). A write-through write with FUA
/// over a dirty sector flushes the backing device and returns, but the slot keeps the sector
/// dirty and the new data in the slot is not flushed. After a power cut the journal still
/// names the slot as dirty, the slot still holds the old data, and replay serves it over the
/// FUA write that reached the backing device: a FUA-acknowledged write is lost (§4.1 rule 1).
#[test]
fn f3_fua_write_through_over_a_dirty_sector_is_lost_at_a_power_cut() {
    let (cache_dev, backing, cache) = crash_cache();
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, SECTOR as usize), false).unwrap();
    vol.flush()
        .expect("the old data is durable, dirty in the cache");
    cache.hold_writes_through(0);
    let fua = data(2, SECTOR as usize);
    vol.write(0, &fua, true).expect("FUA write acknowledged");

    drop((vol, cache));
    let (_dev, cache) = power_cut(&cache_dev, &backing);
    assert_same(
        &read_vec(&cache, 0, SECTOR).expect("read after the power cut"),
        &fua,
        "a write acknowledged with FUA reads as the older data after a power cut",
    );
}

/// Finding 4. After an unclean stop a recovered dirty sector carries the checksum of the last
/// commit, and a newer unflushed write may have replaced its data; the engine accepts such a
/// sector on its first read (`unverified`). But a clean stop before that first read writes the
/// stale checksum into the checkpoint, and after a clean stop checksums count as exact: the
/// next start calls the good, newer data damage (EIO on read, the volume goes "cache failed",
/// `flush`/`detach` refuse, and `--discard-damaged` would drop data a FLUSH made durable).
/// Sequence: write, FLUSH, overwrite (lands, not flushed), crash, restart, clean stop, start.
#[test]
fn f4_a_clean_stop_after_recovery_turns_a_newer_write_into_damage() {
    let (cache_dev, backing, cache) = crash_cache();
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, SECTOR as usize), false).unwrap();
    vol.flush().unwrap();
    let newer = data(2, SECTOR as usize);
    vol.write(0, &newer, false).unwrap();
    // The power cut keeps every write (a legal outcome: the newer write landed).
    let cache_img = Arc::new(CrashDevice::from_image("cache", cache_dev.written_image()));
    let backing_img = Arc::new(CrashDevice::from_image("backing", backing.written_image()));
    drop((vol, cache));

    let (cache, report) = open_dyn(cache_img.clone(), backing_img.clone());
    assert!(report.recovery.is_some(), "an unclean start");
    cache
        .shutdown()
        .expect("clean stop, nothing read meanwhile");
    drop(cache);

    let (cache, _) = open_dyn(cache_img, backing_img);
    let read = read_vec(&cache, 0, SECTOR);
    assert!(
        read.as_ref()
            .is_ok_and(|r| *r == newer || *r == data(1, SECTOR as usize)),
        "after a crash, a restart and a clean stop the sector reads as {:?} (state {:?})",
        read.map(|_| "wrong data"),
        cache.volumes()[0].state()
    );
}

/// Finding 5 (older path, made far more reachable by `drain` now refusing damaged data).
/// `Cache::set_mode` leaving write-back sets the *configured* mode to write-through before the
/// drain, and returns early when the drain fails (damaged data, a backing error): the volume
/// stays configured write-through while it holds dirty data, and the offline `set-mode` then
/// writes that into the superblock at its clean stop. From then on the cache is treated as one
/// without dirty data: at the next start a metadata error no longer refuses the cache but
/// starts it cold, silently dropping the dirty data (the only copy) and serving the backing
/// device's older data (§4.1 rule 2; promise 7 of DESIGN.md).
#[test]
fn f5_a_failed_mode_change_leaves_dirty_data_in_a_write_through_volume() {
    let (cache_dev, backing, cache) = crash_cache();
    let vol = cache.volumes()[0].clone();
    let dirty = data(1, LINE as usize);
    vol.write(0, &dirty, false).unwrap();
    vol.flush().unwrap();

    backing.fail_writes(true);
    let err = cache.set_mode(
        0,
        CacheMode::WriteThrough,
        &ssdcache_engine::CleanerConfig::default(),
        &mut |_| true,
    );
    assert!(err.is_err(), "the drain cannot write to the backing device");
    backing.fail_writes(false);
    assert_eq!(
        vol.stats().dirty_lines,
        1,
        "the dirty data is still in the cache"
    );
    let configured = vol.configured_mode();
    // What the offline `ssdcache set-mode` does after a failed change: a clean stop.
    cache.shutdown().expect("clean stop");
    drop((vol, cache));

    // One damaged checkpoint page (a bit flip on the SSD).
    let sb = read_superblock(&*cache_dev).unwrap();
    cache_dev
        .write_at(&[0xA5; 4096], sb.layout.meta_offset)
        .unwrap();
    let reopened = Cache::open(
        cache_dev.clone(),
        sb.clone(),
        vec![backing.clone() as Arc<dyn BlockDevice>],
    );
    let outcome = match &reopened {
        Err(e) => format!("refused: {e}"),
        Ok((cache, _)) => match read_vec(cache, 0, LINE) {
            Ok(r) if r == dirty => "served the dirty data".to_owned(),
            Ok(_) => "started cold and served the backing device's older data".to_owned(),
            Err(e) => format!("read failed: {e}"),
        },
    };
    assert!(
        configured == CacheMode::WriteBack && sb.volumes[0].mode == CacheMode::WriteBack,
        "after a failed mode change the volume is configured {configured:?} and the superblock \
         says {:?} while it holds dirty data; with a damaged checkpoint the next start {outcome}",
        sb.volumes[0].mode
    );
}

/// Finding 6. The `unverified` bits of a recovered slot are cleared only by a rewrite
/// (`set_dirty`) or by releasing the slot. A recovered dirty sector that is trimmed (or zeroed,
/// or written around) while other sectors keep the slot mapped stays "unverified"; when the
/// line is filled again, that sector is clean with an exact checksum, yet a later mismatch on it
/// is still "accepted as a newer write": data the cache damaged is served instead of being
/// dropped and read from the backing device.
#[test]
fn f6_a_stale_unverified_bit_lets_a_damaged_clean_sector_through() {
    let (cache_dev, backing, cache) = crash_cache();
    let vol = cache.volumes()[0].clone();
    let two = data(1, 2 * SECTOR as usize);
    vol.write(0, &two, false).unwrap();
    vol.flush().unwrap();
    let cache_img = Arc::new(CrashDevice::from_image("cache", cache_dev.written_image()));
    let backing_img = Arc::new(CrashDevice::from_image("backing", backing.written_image()));
    drop((vol, cache));

    let (cache, _) = open_dyn(cache_img.clone(), backing_img.clone());
    let vol = cache.volumes()[0].clone();
    vol.trim(0, SECTOR, false).expect("trim sector 0");
    let backing_copy = read_vec(&cache, 0, SECTOR).expect("read fills the line again");
    // Find the slot (its sector 1 holds the second half of the write) and damage sector 0.
    let layout = cache.layout();
    let slot_at = (0..layout.line_count)
        .map(|s| layout.data_offset + s * LINE)
        .find(|&at| {
            let mut b = vec![0u8; SECTOR as usize];
            cache_img.read_at(&mut b, at + SECTOR).unwrap();
            b[..] == two[SECTOR as usize..]
        })
        .expect("the line's slot");
    cache_img.write_at(&[0x5A; 4096], slot_at).unwrap();

    let read = read_vec(&cache, 0, SECTOR).expect("read");
    assert!(
        read == backing_copy,
        "a clean sector the cache damaged was served (read {:#04x}...) instead of the backing \
         device's copy",
        read[0]
    );
}

/// A crash-simulating cache device whose next flush, once armed, says it entered, waits until
/// the test releases it (at most 10 s) and then fails: a cache flush error at a chosen moment.
struct FlushGate {
    inner: Arc<CrashDevice>,
    armed: Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl FlushGate {
    /// Arms the gate; returns (entered, release).
    fn arm(&self) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel();
        *self.armed.lock().unwrap() = Some((entered_tx, release_rx));
        (entered_rx, release_tx)
    }
}

impl BlockDevice for FlushGate {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        let armed = self.armed.lock().unwrap().take();
        if let Some((entered, release)) = armed {
            entered.send(()).unwrap();
            release
                .recv_timeout(std::time::Duration::from_secs(10))
                .unwrap();
            return Err(std::io::Error::from_raw_os_error(libc_eio()));
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// Finding 7. After a commit fails on the cache device, every FLUSH must fail while dirty data
/// remains (a failed flush is never "retried and forgotten": the device may have dropped the
/// writes it held). `Volume::commit` checks the `failed` flag *before* it waits for the journal
/// lock, and clears it after its own commit succeeds. A FLUSH that arrives while another
/// commit (the cleaner's) is inside a cache flush that then fails waits, runs a fresh
/// generation whose retried cache flush succeeds, acknowledges, and clears the flag that the
/// failure had just set: the data the failed flush may have lost is reported durable, and
/// every later FLUSH succeeds too.
#[test]
fn f7_a_flush_waiting_for_a_failing_commit_is_acknowledged_and_clears_the_failure() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE_SIZE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING_SIZE));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING_SIZE, 0);
    let gate = Arc::new(FlushGate {
        inner: cache_dev.clone(),
        armed: Mutex::new(None),
    });
    let (cache, _) = open_dyn(gate.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, LINE as usize), false).unwrap();

    let (entered, release) = gate.arm();
    let flush_result = std::thread::scope(|s| {
        let cleaner_commit = s.spawn(|| cache.commit());
        entered
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the commit reached its cache flush");
        let client_flush = s.spawn(|| vol.flush());
        // Let the FLUSH pass its check and queue on the journal lock.
        std::thread::sleep(std::time::Duration::from_millis(300));
        release.send(()).unwrap();
        assert!(
            cleaner_commit.join().unwrap().is_err(),
            "the cache flush failed"
        );
        client_flush.join().unwrap()
    });
    let later = vol.flush();
    assert!(
        flush_result.is_err() && later.is_err(),
        "a cache flush failed with dirty data in the cache, yet the FLUSH queued behind it \
         returned {:?} and a later FLUSH returned {:?}",
        flush_result.map(|_| "Ok"),
        later.map(|_| "Ok")
    );
}

/// Finding 8 (documented in §4.8 as the one wrong refusal, but its cost is high). A client that
/// writes a block of zeroes (an ordinary WRITE: a filesystem zeroing a block, a database page,
/// a guest) over a flushed dirty sector just before a crash: the sector reads as zeroes, which
/// recovery calls damage. Reads of it fail with EIO, the whole volume goes "cache failed"
/// (writes bypass the cache from then on), `flush`/`detach` refuse, and the only way out,
/// `--discard-damaged`, returns the backing device's data, which is *older* than the write a
/// FLUSH made durable (§4.1 rule 2). Both legal values (the flushed data, the zeroes) are lost.
#[test]
fn f8_an_ordinary_write_of_zeroes_before_a_crash_becomes_damage() {
    let (cache_dev, backing, cache) = crash_cache();
    let oldest = data(9, SECTOR as usize);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, SECTOR as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    vol.write(0, &[0u8; SECTOR as usize], false).unwrap();
    let cache_img = Arc::new(CrashDevice::from_image("cache", cache_dev.written_image()));
    let backing_img = Arc::new(CrashDevice::from_image("backing", backing.written_image()));
    drop((vol, cache));

    let (cache, _) = open_dyn(cache_img, backing_img);
    let read = read_vec(&cache, 0, SECTOR);
    let legal = |r: &Vec<u8>| *r == flushed || r.iter().all(|&b| b == 0);
    let after_discard = if read.is_err() {
        cache.discard_damaged().expect("--discard-damaged");
        read_vec(&cache, 0, SECTOR).ok().map(|r| {
            if r == oldest {
                "older than the FLUSH"
            } else {
                "other"
            }
        })
    } else {
        None
    };
    assert!(
        read.as_ref().is_ok_and(legal),
        "a sector last written with zeroes reads as {:?} after the crash; after \
         --discard-damaged it reads as {after_discard:?}",
        read.map(|_| "wrong data")
    );
}

/// A crash-simulating device whose next write overlapping an armed range says it entered and
/// waits (at most 10 s) until the test releases it, then goes through: a write in flight at a
/// chosen moment.
struct WriteGate {
    inner: Arc<CrashDevice>,
    armed: Mutex<Option<GateArm>>,
}

type GateArm = (
    Range<u64>,
    std::sync::mpsc::Sender<()>,
    std::sync::mpsc::Receiver<()>,
);

impl WriteGate {
    fn new(inner: Arc<CrashDevice>) -> Arc<WriteGate> {
        Arc::new(WriteGate {
            inner,
            armed: Mutex::new(None),
        })
    }

    /// Arms the gate for the next write overlapping `range`; returns (entered, release).
    fn arm(
        &self,
        range: Range<u64>,
    ) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel();
        *self.armed.lock().unwrap() = Some((range, entered_tx, release_rx));
        (entered_rx, release_tx)
    }
}

impl BlockDevice for WriteGate {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let end = offset + buf.len() as u64;
        let hit = {
            let mut armed = self.armed.lock().unwrap();
            match armed.as_ref() {
                Some((r, _, _)) if offset < r.end && r.start < end => armed.take(),
                _ => None,
            }
        };
        if let Some((_, entered, release)) = hit {
            entered.send(()).unwrap();
            release
                .recv_timeout(std::time::Duration::from_secs(10))
                .unwrap();
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// Finding 9. Leaving write-back with no dirty data switches at once (`set_mode_online` calls
/// `Cache::set_mode` directly): nothing stops a write-back write already in flight, which read
/// the mode before the switch, from marking its data dirty after the switch. The volume is then
/// configured (and persisted) write-through or pass-through with dirty data: the state of
/// finding 5 (a damaged checkpoint starts it cold and drops the data; write-through writes over
/// it hit findings 2 and 3).
#[test]
fn f9_a_write_in_flight_across_a_mode_change_leaves_dirty_data_behind() {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE_SIZE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING_SIZE));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING_SIZE, 0);
    let gate = WriteGate::new(cache_dev.clone());
    let (cache, _) = open_dyn(gate.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let layout = cache.layout();

    let (entered, release) = gate.arm(layout.data_offset..layout.cache_size);
    std::thread::scope(|s| {
        let writer = s.spawn(|| vol.write(0, &data(1, SECTOR as usize), false));
        entered
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the write reached the cache");
        // The mode change waits for the write in flight (then drains what it left dirty).
        let changer = s.spawn(|| {
            cache.set_mode(
                0,
                CacheMode::WriteThrough,
                &ssdcache_engine::CleanerConfig::default(),
                &mut |_| true,
            )
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        release.send(()).unwrap();
        writer.join().unwrap().expect("the write completes");
        changer.join().unwrap().expect("the mode change completes");
    });
    assert!(
        vol.configured_mode() == CacheMode::WriteBack || vol.stats().dirty_lines == 0,
        "the volume is configured {:?} and holds {} dirty line(s)",
        vol.configured_mode(),
        vol.stats().dirty_lines
    );
}

/// Finding 10 (older than this change; the checksums do not reach it). After an unclean stop
/// the journal alone says what is dirty. If the journal region was lost (zeroed: a cache file
/// truncated into its metadata and extended again, a discard by another tool), replay finds no
/// block of the superblock's generation, takes that as an empty log, and the cache starts with
/// no dirty data: every flushed write still dirty in the cache silently reads as the backing
/// device's older data, without an error (§4.1 rule 1; promise 7). A clean stop's checkpoint is
/// refused in the same situation. Every generation starts with a commit written before the
/// superblock names it, so a missing first block could be told apart from an empty log.
#[test]
fn f10_a_lost_journal_after_a_crash_silently_drops_the_dirty_data() {
    let (cache_dev, backing, cache) = crash_cache();
    let oldest = data(9, LINE as usize);
    backing.write_at(&oldest, 0).unwrap();
    backing.flush().unwrap();
    let vol = cache.volumes()[0].clone();
    let flushed = data(1, LINE as usize);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    let layout = cache.layout();
    drop((vol, cache));

    let img = Arc::new(CrashDevice::from_image("cache", cache_dev.durable_image()));
    img.write_at(
        &vec![0u8; layout.journal_len as usize],
        layout.journal_offset,
    )
    .unwrap();
    let sb = read_superblock(&*img).unwrap();
    let outcome = match Cache::open(img, sb, vec![backing.clone() as Arc<dyn BlockDevice>]) {
        Err(e) => format!("refused: {e}"),
        Ok((cache, report)) => match read_vec(&cache, 0, LINE) {
            Ok(r) if r == flushed => "served the flushed data".to_owned(),
            Ok(r) if r == oldest => format!(
                "opened ({:?} dirty lines recovered) and served the older backing data",
                report.recovery.map(|r| r.dirty_lines)
            ),
            Ok(_) => "served other data".to_owned(),
            Err(e) => format!("read failed: {e}"),
        },
    };
    assert!(
        outcome.starts_with("refused") || outcome == "served the flushed data",
        "with its journal zeroed after a crash the cache {outcome}"
    );
}
