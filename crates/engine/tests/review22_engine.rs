//! Twenty-second adversarial review of the data path: the cleaner's per-sector writeback
//! watches (`WritebackWatches`, `MapState::watch_writeback` / `note_data_changed` /
//! `mark_clean`), which replaced the per-slot epoch.
//!
//! The watch records clean every written sector whose data *in the map* did not change
//! (`note_data_changed`: `set_dirty`, `set_written_through`, `allow_either`,
//! `accept_newer_data`) between the batch's read and its end. It assumes that after the
//! batch's disk write the disk holds exactly what the batch read. A client write to the
//! *backing device* that fails may still land there (in whole or in part: §4.8, "a failed write
//! may have landed"), and on failure the engine keeps the range's dirty sectors
//! (`invalidate_clean`) precisely so that a later writeback puts their data back over
//! whatever the failed write left. `invalidate_clean` changed the old epoch (it stores the
//! slot's bits) but is no `note_data_changed`: a dirty sector being written back when such a
//! failed write lands over it is recorded clean, and the disk keeps what the failed write left.
//!
//! R22-1 (`r22_1_*`, fail): the failing client write is a write-back write of zeroes (goes
//! around the cache), a write-through write while a mode change drains, or a WRITE_ZEROES.
//! After the batch the sector is clean in the cache with the old data; the disk holds the
//! failed write's data. Reads return the old data until the line leaves the cache (or the volume
//! goes pass-through), then the failed write's data: a read changes without a write.
//!
//! The rest (pass) document what was tried and held: a rewrite / TRIM+rewrite / drop and
//! re-take of the slot by the same line while a writeback is in flight, a held read miss
//! filling the line, a write-through beside a writeback (mode change), the backing flush
//! failing mid-batch (watches dropped, the next batch cleans), two batches at once beside
//! rewrites, and a bounded random stress of clients on shared lines beside two cleaners
//! checked against a model after a drain and a switch to pass-through.

mod common;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use common::{data, format_dev, on_disk, open_dyn, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{Cache, CleanerConfig, Select, Volume};
use ssdcache_format::CacheMode;

const SECTOR: usize = 4096;
const LINE: u64 = 64 * 1024;
const BACKING: u64 = 16 * MIB;
const WAIT: Duration = Duration::from_secs(10);

// ---- a backing device the test controls ----

/// A backing device over memory that can hold the next write (before it lands) or the next
/// flush, and can make the next write, write_zeroes or discard land (its first `n` sectors)
/// and then fail with EIO, as a failing disk's write may.
struct Ctl {
    inner: Arc<MemDevice>,
    st: Mutex<CtlState>,
    cv: Condvar,
}

/// One gate: armed for the next request, holding one, or letting it go.
#[derive(Default)]
struct Hold {
    armed: bool,
    held: bool,
    go: bool,
}

#[derive(Default)]
struct CtlState {
    write: Hold,
    flush: Hold,
    /// The next write lands its first `n` sectors, then fails.
    land_then_fail: Option<usize>,
    failed_writes: u64,
}

impl Ctl {
    fn new(inner: Arc<MemDevice>) -> Ctl {
        Ctl {
            inner,
            st: Mutex::new(CtlState::default()),
            cv: Condvar::new(),
        }
    }

    fn st(&self) -> MutexGuard<'_, CtlState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hold_next(&self, gate: fn(&mut CtlState) -> &mut Hold) {
        let mut s = self.st();
        let hold = gate(&mut s);
        hold.armed = true;
        hold.go = false;
    }

    fn hold_next_write(&self) {
        self.hold_next(|s| &mut s.write);
    }

    fn hold_next_flush(&self) {
        self.hold_next(|s| &mut s.flush);
    }

    fn fail_next_write_landing(&self, sectors: usize) {
        self.st().land_then_fail = Some(sectors);
    }

    fn failed_writes(&self) -> u64 {
        self.st().failed_writes
    }

    fn wait(&self, what: &str, held: impl Fn(&CtlState) -> bool) {
        let deadline = Instant::now() + WAIT;
        let mut s = self.st();
        while !held(&s) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{what} never arrived");
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn wait_write_held(&self) {
        self.wait("held write", |s| s.write.held);
    }

    fn wait_flush_held(&self) {
        self.wait("held flush", |s| s.flush.held);
    }

    fn release_write(&self) {
        self.st().write.go = true;
        self.cv.notify_all();
    }

    fn release_flush(&self) {
        self.st().flush.go = true;
        self.cv.notify_all();
    }

    /// Stops at `gate` if armed, until released (at most `WAIT`).
    fn pass(&self, gate: fn(&mut CtlState) -> &mut Hold) {
        let mut s = self.st();
        if !gate(&mut s).armed {
            return;
        }
        gate(&mut s).armed = false;
        gate(&mut s).held = true;
        self.cv.notify_all();
        let deadline = Instant::now() + WAIT;
        while !gate(&mut s).go && Instant::now() < deadline {
            s = self
                .cv
                .wait_timeout(s, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        gate(&mut s).held = false;
    }

    fn pass_write(&self) {
        self.pass(|s| &mut s.write);
    }

    fn pass_flush(&self) {
        self.pass(|s| &mut s.flush);
    }

    /// Applies `data` (or zeroes) at `offset`, or, when armed, its first sectors and EIO.
    fn land(&self, data: Option<&[u8]>, offset: u64, len: usize) -> io::Result<()> {
        self.pass_write();
        let fail = {
            let mut s = self.st();
            let f = s.land_then_fail.take();
            if f.is_some() {
                s.failed_writes += 1;
            }
            f
        };
        let zeroes;
        let bytes = match data {
            Some(d) => d,
            None => {
                zeroes = vec![0u8; len];
                &zeroes[..]
            }
        };
        match fail {
            None => self.inner.write_at(bytes, offset),
            Some(n) => {
                let n = (n * SECTOR).min(len);
                if n > 0 {
                    self.inner.write_at(&bytes[..n], offset)?;
                }
                Err(io::Error::other("EIO (test: a failed write that landed)"))
            }
        }
    }
}

impl BlockDevice for Ctl {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.land(Some(buf), offset, buf.len())
    }
    fn flush(&self) -> io::Result<()> {
        self.pass_flush();
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.land(None, offset, len as usize)?;
        Ok(true)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.land(None, offset, len as usize)
    }
    fn describe(&self) -> String {
        "ctl".into()
    }
}

struct Rig {
    mem: Arc<MemDevice>,
    ctl: Arc<Ctl>,
    cache: Arc<Cache>,
    vol: Arc<Volume>,
}

fn rig(mode: CacheMode) -> Rig {
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let ctl = Arc::new(Ctl::new(mem.clone()));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, mode, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, ctl.clone());
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    Rig {
        mem,
        ctl,
        cache,
        vol,
    }
}

/// One cleaner batch (depth 1) on a thread of its own.
fn spawn_batch(
    cache: &Arc<Cache>,
    select: Select,
) -> thread::JoinHandle<ssdcache_engine::Result<ssdcache_engine::BatchReport>> {
    let cache = cache.clone();
    thread::spawn(move || cache.clean_batch(&CleanerConfig::default(), 1, select))
}

/// Line 0 cached whole from the disk (`old`), its first sector then written dirty (`a`).
fn rig_with_dirty_sector_0() -> (Rig, Vec<u8>, Vec<u8>) {
    let r = rig(CacheMode::WriteBack);
    let old = data(1, LINE as usize);
    r.mem.write_at(&old, 0).unwrap();
    let mut line = vec![0u8; LINE as usize];
    r.vol.read(0, &mut line).unwrap();
    let a = data(2, SECTOR);
    r.vol.write(0, &a, false).unwrap();
    assert_eq!(r.cache.dirty_bytes(), SECTOR as u64);
    (r, old, a)
}

fn read(vol: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    vol.read(offset, &mut buf).expect("read");
    buf
}

fn name(got: &[u8], names: &[(&str, &[u8])]) -> String {
    if got.iter().all(|&b| b == 0) {
        return "zeroes".into();
    }
    for (n, d) in names {
        if got == *d {
            return (*n).into();
        }
    }
    "other data".into()
}

/// Starts one cleaner batch on a thread; it is let run until its backing flush, which is held.
/// Returns the batch's thread.
fn batch_held_at_its_flush(r: &Rig) -> thread::JoinHandle<ssdcache_engine::Result<u64>> {
    r.ctl.hold_next_flush();
    let cache = r.cache.clone();
    let t = thread::spawn(move || {
        cache
            .clean_batch(&CleanerConfig::default(), 1, Select::All)
            .map(|b| b.lines_cleaned)
    });
    r.ctl.wait_flush_held();
    t
}

/// After a failing client write, what the cache serves now and what it serves once the volume
/// goes pass-through (which drains first) must be the same data.
fn assert_reads_stable(r: &Rig, offset: u64, names: &[(&str, &[u8])]) {
    let now = read(&r.vol, offset, SECTOR);
    let dirty = r.cache.dirty_bytes();
    r.cache
        .set_mode(
            0,
            CacheMode::PassThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .expect("set pass-through");
    let later = read(&r.vol, offset, SECTOR);
    let disk = on_disk(&r.mem, offset, SECTOR);
    assert!(
        now == later,
        "a read returned {} from the cache after the failed write ({} dirty bytes left), \
         then {} once the volume went pass-through (the disk holds {}): the sector was \
         recorded clean over what the failed write left on the disk",
        name(&now, names),
        dirty,
        name(&later, names),
        name(&disk, names),
    );
}

// ---- R22-1: a failed client write to the disk over a sector being written back ----

/// R22-1a. Sector 0 of line 0 is dirty (`A`). A batch writes it back and is held at its backing
/// flush. A client writes zeroes to sector 0 in write-back mode: a zero sector goes around the
/// cache to the disk (after the writeback, backing order), where it lands and fails with EIO;
/// the engine keeps the dirty sector (`invalidate_clean`) so that it is written back again.
/// The batch then ends. Expected: sector 0 stays dirty (or the disk ends with `A`), and reads
/// return the same data before and after the switch to pass-through. Found: the batch records
/// it clean (`invalidate_clean` is no `note_data_changed`), the cache serves `A`, the disk holds
/// zeroes, and after pass-through reads return zeroes. FAILS.
#[test]
fn r22_1a_failed_zero_write_around_over_a_sector_being_written_back() {
    let (r, _old, a) = rig_with_dirty_sector_0();
    let batch = batch_held_at_its_flush(&r);
    r.ctl.fail_next_write_landing(1);
    let zeroes = vec![0u8; SECTOR];
    assert!(
        r.vol.write(0, &zeroes, false).is_err(),
        "the zero write fails on the disk"
    );
    assert_eq!(r.ctl.failed_writes(), 1);
    r.ctl.release_flush();
    batch.join().unwrap().expect("batch");
    assert_reads_stable(&r, 0, &[("A", &a)]);
}

/// R22-1b. As R22-1a, the failing write being a write-through write while a mode change drains
/// (`hold_writes_through`, as the daemon's online set-mode does): the line holds dirty data,
/// so the write runs under its lines (`Volume::write_through`), lands `B` and fails; the dirty
/// `A` is kept. Expected: stable reads (A, or B once written back... either, but the same
/// before and after pass-through). Found: A recorded clean; the disk holds B. FAILS.
#[test]
fn r22_1b_failed_write_through_during_a_mode_change_over_a_sector_being_written_back() {
    let (r, _old, a) = rig_with_dirty_sector_0();
    r.cache.hold_writes_through(0);
    let batch = batch_held_at_its_flush(&r);
    r.ctl.fail_next_write_landing(1);
    let b = data(3, SECTOR);
    assert!(
        r.vol.write(0, &b, false).is_err(),
        "the write-through write fails on the disk"
    );
    r.ctl.release_flush();
    batch.join().unwrap().expect("batch");
    assert_reads_stable(&r, 0, &[("A", &a), ("B", &b)]);
}

/// R22-1c. As R22-1a, the failing request a WRITE_ZEROES of sector 0 (it goes to the disk and
/// drops the range from the cache only when it succeeded). FAILS.
#[test]
fn r22_1c_failed_write_zeroes_over_a_sector_being_written_back() {
    let (r, _old, a) = rig_with_dirty_sector_0();
    let batch = batch_held_at_its_flush(&r);
    r.ctl.fail_next_write_landing(1);
    assert!(r.vol.write_zeroes(0, SECTOR as u64, false).is_err());
    r.ctl.release_flush();
    batch.join().unwrap().expect("batch");
    assert_reads_stable(&r, 0, &[("A", &a)]);
}

/// R22-1d. Control for R22-1a..c: the same failed write *without* a batch in flight keeps the
/// sector dirty, and the drain of the switch to pass-through writes `A` back over what the
/// failed write left: reads are stable. (This is what the epoch also gave when the failure
/// fell inside a batch.) Passes.
#[test]
fn r22_1d_control_failed_write_without_a_batch_in_flight_is_repaired_by_the_drain() {
    let (r, _old, a) = rig_with_dirty_sector_0();
    r.ctl.fail_next_write_landing(1);
    assert!(r.vol.write(0, &vec![0u8; SECTOR], false).is_err());
    assert_eq!(r.cache.dirty_bytes(), SECTOR as u64, "A is kept dirty");
    assert_reads_stable(&r, 0, &[("A", &a)]);
    assert!(on_disk(&r.mem, 0, SECTOR) == a);
}

// ---- what held ----

/// A rewrite of the sector while its writeback is held in flight, then a TRIM of it and a
/// second rewrite, then the whole line dropped and the line taken again (most likely the same
/// slot) and written once more, all before the batch ends. Expected: nothing written meanwhile
/// is recorded clean; a second batch writes the last data; after pass-through the disk serves
/// it. Passes.
#[test]
fn rewrites_trims_and_retaking_the_slot_while_a_writeback_is_in_flight() {
    let (r, old, _a) = rig_with_dirty_sector_0();
    r.ctl.hold_next_write();
    let batch = spawn_batch(&r.cache, Select::All);
    r.ctl.wait_write_held();
    let b = data(4, SECTOR);
    r.vol.write(0, &b, false).unwrap();
    // The TRIM waits for the writeback in flight: run it aside and open the gate.
    let trims = {
        let vol = r.vol.clone();
        thread::spawn(move || {
            vol.trim(0, SECTOR as u64, false)?;
            let c = data(5, SECTOR);
            vol.write(0, &c, false)?;
            vol.trim(0, LINE, false)?;
            let d = data(6, SECTOR);
            vol.write(0, &d, false)?;
            Ok::<_, ssdcache_engine::EngineError>(d)
        })
    };
    thread::sleep(Duration::from_millis(50));
    r.ctl.release_write();
    let d = trims.join().unwrap().expect("trims and rewrites");
    batch.join().unwrap().expect("batch");
    assert_eq!(
        r.cache.dirty_bytes(),
        SECTOR as u64,
        "the last write is dirty"
    );
    assert!(read(&r.vol, 0, SECTOR) == d);
    r.cache
        .set_mode(
            0,
            CacheMode::PassThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .unwrap();
    assert!(read(&r.vol, 0, SECTOR) == d, "the disk has the last write");
    // The rest of the line was trimmed (zeroes on this disk).
    let rest = read(&r.vol, SECTOR as u64, LINE as usize - SECTOR);
    assert!(rest.iter().all(|&x| x == 0) || rest == old[SECTOR..]);
}

/// A held read miss of another sector of the line (`read_line_unheld`) runs while the batch's
/// write is in flight, and a client rewrites sector 0 once the miss registered. Expected: the
/// rewrite stays dirty, the miss returns the disk's data, and after a drain and pass-through
/// every sector of the line reads as written. Passes.
#[test]
fn a_held_read_miss_and_a_rewrite_beside_a_writeback_in_flight() {
    let (r, old, _a) = rig_with_dirty_sector_0();
    r.vol.trim(7 * SECTOR as u64, SECTOR as u64, false).unwrap();
    r.ctl.hold_next_write();
    let batch = spawn_batch(&r.cache, Select::All);
    r.ctl.wait_write_held();
    let miss = common::read_in_thread(&r.vol, 7 * SECTOR as u64, SECTOR);
    thread::sleep(Duration::from_millis(30));
    let b = data(7, SECTOR);
    let writer = {
        let vol = r.vol.clone();
        let b = b.clone();
        thread::spawn(move || vol.write(0, &b, false))
    };
    thread::sleep(Duration::from_millis(30));
    r.ctl.release_write();
    writer.join().unwrap().unwrap();
    let got = miss.recv_timeout(WAIT).expect("miss ends");
    batch.join().unwrap().expect("batch");
    assert!(
        got.iter().all(|&x| x == 0),
        "trimmed sector reads zeroes from the disk"
    );
    assert!(read(&r.vol, 0, SECTOR) == b);
    r.cache
        .set_mode(
            0,
            CacheMode::PassThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .unwrap();
    let line = read(&r.vol, 0, LINE as usize);
    assert!(line[..SECTOR] == b[..], "the rewrite reached the disk");
    assert!(line[SECTOR..7 * SECTOR] == old[SECTOR..7 * SECTOR]);
}

/// A write-through write of the sector (mode change under way) while its older writeback is
/// held in flight. Expected: it lands after the writeback; the sector is clean with its data
/// either way; after pass-through the disk serves the new data. Passes.
#[test]
fn a_write_through_beside_a_writeback_in_flight() {
    let (r, _old, _a) = rig_with_dirty_sector_0();
    r.cache.hold_writes_through(0);
    r.ctl.hold_next_write();
    let batch = spawn_batch(&r.cache, Select::All);
    r.ctl.wait_write_held();
    let b = data(8, SECTOR);
    let writer = {
        let vol = r.vol.clone();
        let b = b.clone();
        thread::spawn(move || vol.write(0, &b, false))
    };
    thread::sleep(Duration::from_millis(50));
    r.ctl.release_write();
    writer.join().unwrap().unwrap();
    batch.join().unwrap().expect("batch");
    assert_eq!(r.cache.dirty_bytes(), 0);
    assert!(read(&r.vol, 0, SECTOR) == b);
    assert!(on_disk(&r.mem, 0, SECTOR) == b);
}

/// The batch's backing flush fails (its disk write landed): the batch ends in an error before
/// recording anything clean, its watches are dropped with it (RAII, on the `?` path).
/// Expected: the sector stays dirty, a rewrite meanwhile is served, and later batches fail
/// with the latched backing error (an earlier flush failed: by design no later flush vouches
/// for the writes), never with an invariant (a watch left behind, or missing). Passes.
#[test]
fn a_failing_backing_flush_drops_the_watches_and_keeps_the_sector_dirty() {
    let (r, _old, a) = rig_with_dirty_sector_0();
    r.ctl.hold_next_flush();
    let batch = spawn_batch(&r.cache, Select::All);
    r.ctl.wait_flush_held();
    assert!(on_disk(&r.mem, 0, SECTOR) == a);
    let b = data(9, SECTOR);
    r.vol.write(0, &b, false).unwrap();
    r.mem.fail_writes.store(true, Ordering::SeqCst);
    r.ctl.release_flush();
    let failed = batch.join().unwrap();
    r.mem.fail_writes.store(false, Ordering::SeqCst);
    assert!(
        matches!(failed, Err(ssdcache_engine::EngineError::Backing { .. })),
        "the batch fails on its flush: {failed:?}"
    );
    assert_eq!(r.cache.dirty_bytes(), SECTOR as u64, "still dirty");
    assert!(read(&r.vol, 0, SECTOR) == b);
    for _ in 0..3 {
        let again = r
            .cache
            .clean_batch(&CleanerConfig::default(), 1, Select::All);
        assert!(
            matches!(again, Err(ssdcache_engine::EngineError::Backing { .. })),
            "later batches: {again:?}"
        );
    }
    assert_eq!(r.cache.dirty_bytes(), SECTOR as u64);
    assert!(read(&r.vol, 0, SECTOR) == b);
}

/// Two batches at once (`Select::All` and `Select::Coldest`, as a drain beside the cleaner
/// thread) with a rewrite between their reads, in both orders of ending. Expected: the disk
/// ends with the newest data and the cache calls the sector clean only when it does. Passes.
#[test]
fn two_batches_with_a_rewrite_between_their_reads() {
    for first_ends_first in [true, false] {
        let (r, _old, _a) = rig_with_dirty_sector_0();
        // Batch 1 reads A, its write is held.
        r.ctl.hold_next_write();
        let b1 = spawn_batch(&r.cache, Select::All);
        r.ctl.wait_write_held();
        let b = data(10, SECTOR);
        r.vol.write(0, &b, false).unwrap();
        // Batch 2 reads B; its write waits for batch 1's (backing order).
        let b2 = spawn_batch(&r.cache, Select::Coldest);
        thread::sleep(Duration::from_millis(50));
        if first_ends_first {
            r.ctl.release_write();
            b1.join().unwrap().unwrap();
            b2.join().unwrap().unwrap();
        } else {
            r.ctl.hold_next_flush();
            r.ctl.release_write();
            // Batch 1's flush or batch 2's, whichever comes first, is held; let it go later.
            r.ctl.wait_flush_held();
            thread::sleep(Duration::from_millis(30));
            r.ctl.release_flush();
            b2.join().unwrap().unwrap();
            b1.join().unwrap().unwrap();
        }
        let dirty = r.cache.dirty_bytes();
        let disk = on_disk(&r.mem, 0, SECTOR);
        assert!(
            disk == b || dirty == SECTOR as u64,
            "clean while the disk lacks the rewrite ({first_ends_first})"
        );
        r.cache
            .set_mode(
                0,
                CacheMode::PassThrough,
                &CleanerConfig::default(),
                &mut |_| true,
            )
            .unwrap();
        assert!(read(&r.vol, 0, SECTOR) == b);
    }
}

/// Random clients on shared lines (writes, zero writes, TRIMs, WRITE_ZEROES, reads; each
/// thread owns its own sectors, interleaved within lines, so it knows what each must hold)
/// beside two cleaners at once (the cleaner thread, draining, and `clean_batch` loops with
/// `Select::All` and `Select::Coldest`), for about 4 s. Then a drain, pass-through, and every
/// sector read from the disk equals the model. Bounded by count and time. Passes.
#[test]
fn stress_clients_on_shared_lines_beside_two_cleaners_match_the_model_on_the_disk() {
    const THREADS: usize = 3;
    const LINES: u64 = 8;
    const SPL: usize = (LINE as usize) / SECTOR;
    let r = rig(CacheMode::WriteBack);
    let stop = Arc::new(AtomicBool::new(false));
    let cleaned = Arc::new(AtomicU64::new(0));
    let mut cleaners = Vec::new();
    for select in [Select::All, Select::Coldest] {
        let cache = r.cache.clone();
        let stop = stop.clone();
        let cleaned = cleaned.clone();
        cleaners.push(thread::spawn(move || {
            let cfg = CleanerConfig {
                max_write: 16 * 1024,
                ..CleanerConfig::default()
            };
            let began = Instant::now();
            for _ in 0..100_000 {
                if stop.load(Ordering::Acquire) || began.elapsed() > Duration::from_secs(8) {
                    break;
                }
                let b = cache.clean_batch(&cfg, 4, select).expect("batch");
                cleaned.fetch_add(b.lines_cleaned, Ordering::Relaxed);
            }
        }));
    }
    let mut clients = Vec::new();
    for t in 0..THREADS {
        let vol = r.vol.clone();
        clients.push(thread::spawn(move || {
            let mut rng = common::Rng(0x22 + t as u64);
            // model: sector index -> expected bytes (None = unknown after TRIM: zeroes here)
            let mine: Vec<u64> = (0..LINES * SPL as u64)
                .filter(|s| (*s as usize) % THREADS == t)
                .collect();
            let mut model: std::collections::HashMap<u64, Vec<u8>> = Default::default();
            let began = Instant::now();
            let mut tag = (t as u64 + 1) << 32;
            for _ in 0..200_000 {
                if began.elapsed() > Duration::from_secs(4) {
                    break;
                }
                let s = mine[(rng.next_u64() % mine.len() as u64) as usize];
                let off = s * SECTOR as u64;
                match rng.next_u64() % 10 {
                    0..=4 => {
                        tag += 1;
                        let d = data(tag, SECTOR);
                        vol.write(off, &d, false).expect("write");
                        model.insert(s, d);
                    }
                    5 => {
                        vol.write(off, &vec![0u8; SECTOR], false)
                            .expect("zero write");
                        model.insert(s, vec![0u8; SECTOR]);
                    }
                    6 => {
                        vol.trim(off, SECTOR as u64, false).expect("trim");
                        model.insert(s, vec![0u8; SECTOR]); // MemDevice discards to zeroes
                    }
                    7 => {
                        vol.write_zeroes(off, SECTOR as u64, false).expect("wz");
                        model.insert(s, vec![0u8; SECTOR]);
                    }
                    _ => {
                        let mut buf = vec![0u8; SECTOR];
                        vol.read(off, &mut buf).expect("read");
                        let want = model.get(&s).cloned().unwrap_or(vec![0u8; SECTOR]);
                        assert!(
                            buf == want,
                            "thread {t} sector {s}: a read returned other data"
                        );
                    }
                }
            }
            model
        }));
    }
    let models: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    stop.store(true, Ordering::Release);
    for c in cleaners {
        c.join().unwrap();
    }
    r.cache
        .set_mode(
            0,
            CacheMode::PassThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .expect("drain and pass-through");
    assert_eq!(r.cache.dirty_bytes(), 0);
    for (t, model) in models.iter().enumerate() {
        for (s, want) in model {
            let got = on_disk(&r.mem, s * SECTOR as u64, SECTOR);
            assert!(
                got == *want,
                "thread {t} sector {s}: the disk lacks the last write"
            );
            assert!(read(&r.vol, s * SECTOR as u64, SECTOR) == *want);
        }
    }
    assert!(
        cleaned.load(Ordering::Relaxed) > 0,
        "the cleaners cleaned something"
    );
}
