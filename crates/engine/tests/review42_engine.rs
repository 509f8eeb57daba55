//! Review 42: adversarial tests of byte-granular requests (commit 470d5e3): partial 4 KiB
//! sectors read, modified and written under the line lock in every mode.
//!
//! Every loop is bounded in count and, where threads race, in time.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::{data, Rng, MIB};
use ssdcache_device::{BlockDevice, FileDevice, OpenOptions};
use ssdcache_devsim::{CrashClock, CrashDevice, Keep};
use ssdcache_engine::{CleanerConfig, EngineError, Volume};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
const MODES: [CacheMode; 4] = [
    CacheMode::WriteBack,
    CacheMode::WriteThrough,
    CacheMode::WriteAround,
    CacheMode::PassThrough,
];
/// No test thread runs longer than this, whatever the machine's load.
const TIME_LIMIT: Duration = Duration::from_secs(60);

fn fast_cleaner() -> CleanerConfig {
    CleanerConfig {
        max_age: Duration::from_millis(2),
        idle_after: Duration::from_millis(1),
        ..CleanerConfig::default()
    }
}

fn read(vol: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xA5u8; len];
    vol.read(offset, &mut buf)
        .unwrap_or_else(|e| panic!("read of {len} bytes at {offset}: {e}"));
    buf
}

/// Random bytes, never a whole sector of zeroes by accident.
fn bytes(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    if let Some(b) = v.first_mut() {
        *b |= 1;
    }
    v
}

// ---------------------------------------------------------------------------------------------
// R42-1: a whole-sector write and a partial write of the same sector race (plus a reader whose
// miss of the line reads the disk without the line), in every mode, with the cleaner running
// in write-back. After each round the sector is one of the two serial orders; after a FLUSH
// and a power cut it is still the last round's result.
// ---------------------------------------------------------------------------------------------

fn whole_and_partial_race(mode: CacheMode, line: u64) {
    const ROUNDS: u64 = 1500;
    const S: u64 = 5; // the contended sector
    const T: u64 = 9; // a sector the reader drops and misses (same line with 64 KiB lines)
    let (cache_dev, backing, cache) = common::setup_crash(16 * MIB, 16 * MIB, line, mode);
    let cache = Arc::new(cache);
    if mode == CacheMode::WriteBack {
        cache.start_cleaner(fast_cleaner());
    }
    let vol = cache.volumes()[0].clone();
    vol.write(0, &data(1, LINE as usize), false).expect("seed");
    let partial_at = 1000usize;
    let partial_len = 700usize;
    let barrier = Arc::new(Barrier::new(3));
    let began = Instant::now();
    let mut finals: Vec<Vec<u8>> = Vec::new();
    let mut prev = read(&vol, S * SECTOR, SECTOR as usize);
    for round in 0..ROUNDS {
        if began.elapsed() > TIME_LIMIT {
            break;
        }
        let x = data(1000 + round, SECTOR as usize);
        let y = data(5000 + round, partial_len);
        let a = {
            let (vol, barrier, x) = (vol.clone(), barrier.clone(), x.clone());
            std::thread::spawn(move || {
                barrier.wait();
                vol.write(S * SECTOR, &x, round % 7 == 0)
                    .expect("whole write");
            })
        };
        let b = {
            let (vol, barrier, y) = (vol.clone(), barrier.clone(), y.clone());
            std::thread::spawn(move || {
                barrier.wait();
                vol.write(S * SECTOR + partial_at as u64, &y, round % 5 == 0)
                    .expect("partial write");
            })
        };
        // The reader: drops sector T (a trim discards whole sectors) so the line is cached in
        // part, then reads T (a miss of one line: read without the line) and S's bytes.
        vol.trim(T * SECTOR, SECTOR, false).expect("trim");
        barrier.wait();
        let _ = read(&vol, T * SECTOR, 512);
        let seen = read(&vol, S * SECTOR, SECTOR as usize);
        a.join().expect("a");
        b.join().expect("b");
        let mut xy = x.clone();
        xy[partial_at..partial_at + partial_len].copy_from_slice(&y);
        let mut py = prev.clone();
        py[partial_at..partial_at + partial_len].copy_from_slice(&y);
        assert!(
            seen == prev || seen == py || seen == x || seen == xy,
            "{mode:?} round {round}: a read during the race saw a state no order gives"
        );
        let got = read(&vol, S * SECTOR, SECTOR as usize);
        assert!(
            got == x || got == xy,
            "{mode:?} round {round}: sector is neither order of the two writes ({})",
            if got == prev {
                "the previous round's data"
            } else {
                "other data"
            }
        );
        // The disk must agree once nothing is cached (outside write-back nothing may differ).
        if mode != CacheMode::WriteBack {
            let mut disk = vec![0u8; SECTOR as usize];
            backing.read_at(&mut disk, S * SECTOR).expect("disk");
            assert!(
                disk == got,
                "{mode:?} round {round}: the cache serves data the disk does not hold"
            );
        }
        prev = got.clone();
        finals.push(got);
    }
    cache.stop_cleaner();
    let last = finals.last().expect("a round ran").clone();
    vol.flush().expect("flush");
    drop(vol);
    drop(cache);
    let (cache, _) = common::open_dyn(
        Arc::new(cache_dev.crashed("cache", 3)),
        Arc::new(backing.crashed("backing", 4)),
    );
    let got = read(&cache.volumes()[0], S * SECTOR, SECTOR as usize);
    assert!(
        got == last,
        "{mode:?}: after a FLUSH and a power cut the sector changed"
    );
}

#[test]
fn r42_1a_whole_and_partial_write_race_on_one_sector_64k_lines() {
    for mode in MODES {
        whole_and_partial_race(mode, LINE);
    }
}

#[test]
fn r42_1b_whole_and_partial_write_race_on_one_sector_4k_lines() {
    for mode in MODES {
        whole_and_partial_race(mode, SECTOR);
    }
}

// ---------------------------------------------------------------------------------------------
// R42-2: threads owning interleaved 512-byte pieces of shared sectors (and whole sectors of
// the same lines) write, zero, trim, prefetch and read them at byte offsets, while the cleaner
// runs, a tuner changes the mode (set_mode with its drain), admission and cutoff, and a flusher
// takes power-cut images right after FLUSHes. Every byte a thread reads of its own must be its
// last write; every image, reopened, must hold what was written before the FLUSH (bytes written
// after it began may be either); so must a power cut at the end.
// ---------------------------------------------------------------------------------------------

const REGION: u64 = 1 << 20; // 16 lines of 64 KiB
const HALF: u64 = REGION / 2;
const PIECE: u64 = 512;
const WRITERS: u64 = 4;

fn owner(byte: u64) -> u64 {
    if byte < HALF {
        (byte / PIECE) % WRITERS
    } else {
        (byte / SECTOR) % WRITERS
    }
}

struct Shared {
    model: Mutex<Vec<u8>>,
    /// Bytes a failed request wrote: old or new (faults only).
    unknown: Mutex<Vec<bool>>,
    /// Requests may fail (devices fail on purpose).
    tolerate: bool,
    /// Bytes written since the flusher's last snapshot.
    touched: Mutex<Vec<bool>>,
    /// Writers hold it shared for each op; the flusher exclusively to snapshot and capture.
    pause: RwLock<()>,
    stop: AtomicBool,
    ops: AtomicU64,
}

impl Shared {
    fn set(&self, offset: u64, data: &[u8]) {
        let at = offset as usize;
        self.model.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        self.touched.lock().unwrap()[at..at + data.len()].fill(true);
    }
}

struct Capture {
    cache: CrashDevice,
    backing: CrashDevice,
    model: Vec<u8>,
    touched: Vec<bool>,
}

fn own_piece(rng: &mut Rng, t: u64) -> u64 {
    // A piece of the shared half owned by t.
    let pieces = HALF / PIECE;
    let p = (rng.next_u64() % (pieces / WRITERS)) * WRITERS + t;
    p * PIECE
}

fn own_sector(rng: &mut Rng, t: u64) -> u64 {
    let sectors = HALF / SECTOR;
    let s = (rng.next_u64() % (sectors / WRITERS)) * WRITERS + t;
    HALF + s * SECTOR
}

fn writer(vol: Arc<Volume>, sh: Arc<Shared>, t: u64, seed: u64, ops: u64) {
    let mut rng = Rng(seed * 131 + t);
    let began = Instant::now();
    // Records a write's outcome: with faults on, a failed one leaves its bytes unknown.
    let done = |r: ssdcache_engine::Result<()>, at: u64, d: &[u8], what: &str, op: u64| {
        if let Err(e) = &r {
            assert!(sh.tolerate, "t{t} op {op}: {what}: {e}");
        }
        sh.set(at, d);
        let at = at as usize;
        sh.unknown.lock().unwrap()[at..at + d.len()].fill(r.is_err());
    };
    for op in 0..ops {
        if began.elapsed() > TIME_LIMIT || sh.stop.load(Ordering::Relaxed) {
            break;
        }
        let _p = sh.pause.read().unwrap();
        let fua = rng.next_u64().is_multiple_of(8);
        match rng.next_u64() % 20 {
            0..=6 => {
                // Partial write inside an owned piece.
                let piece = own_piece(&mut rng, t);
                let a = rng.next_u64() % PIECE;
                let len = 1 + rng.next_u64() % (PIECE - a);
                let d = bytes(&mut rng, len as usize);
                done(
                    vol.write(piece + a, &d, fua),
                    piece + a,
                    &d,
                    "partial write",
                    op,
                );
            }
            7 | 8 => {
                // Partial write-zeroes inside an owned piece: makes whole zero sectors at times.
                let piece = own_piece(&mut rng, t);
                let a = rng.next_u64() % PIECE;
                let len = 1 + rng.next_u64() % (PIECE - a);
                let r = vol.write_zeroes(piece + a, len, fua);
                done(r, piece + a, &vec![0u8; len as usize], "write_zeroes", op);
            }
            9 => {
                // A trim inside an owned piece discards nothing (no whole sector inside).
                let piece = own_piece(&mut rng, t);
                let r = vol.trim(piece + 1, PIECE - 2, fua);
                assert!(sh.tolerate || r.is_ok(), "t{t} op {op}: trim: {r:?}");
            }
            10..=12 => {
                // An owned whole sector: whole write (zeroes at times), partial write across
                // it, zeroing or trimming it.
                let s = own_sector(&mut rng, t);
                match rng.next_u64() % 6 {
                    0 | 1 => {
                        let d = bytes(&mut rng, SECTOR as usize);
                        done(vol.write(s, &d, fua), s, &d, "whole write", op);
                    }
                    2 => {
                        let d = vec![0u8; SECTOR as usize];
                        done(vol.write(s, &d, fua), s, &d, "zero write", op);
                    }
                    3 => {
                        let a = rng.next_u64() % SECTOR;
                        let len = 1 + rng.next_u64() % (SECTOR - a);
                        let d = bytes(&mut rng, len as usize);
                        done(vol.write(s + a, &d, fua), s + a, &d, "partial write", op);
                    }
                    4 => {
                        let d = vec![0u8; SECTOR as usize];
                        done(vol.write_zeroes(s, SECTOR, fua), s, &d, "write_zeroes", op);
                    }
                    _ => {
                        // What a trim leaves is undefined (the crash device keeps the disk's
                        // old bytes): rewritten at once, within the same op.
                        let trimmed = vol.trim(s, SECTOR, fua);
                        let d = bytes(&mut rng, SECTOR as usize);
                        let r = trimmed.and_then(|()| vol.write(s, &d, fua));
                        done(r, s, &d, "trim and write", op);
                    }
                }
            }
            13..=17 => {
                // A read at byte granularity: the bytes this thread owns must be its last.
                let at = rng.next_u64() % (REGION - 1);
                let len = 1 + rng.next_u64() % (REGION - at).min(20_000);
                let mut buf = vec![0u8; len as usize];
                if let Err(e) = vol.read(at, &mut buf) {
                    assert!(sh.tolerate, "t{t} op {op}: read: {e}");
                    continue;
                }
                let model = sh.model.lock().unwrap();
                let unknown = sh.unknown.lock().unwrap();
                for (i, &b) in buf.iter().enumerate() {
                    let byte = at + i as u64;
                    let u = byte as usize;
                    if owner(byte) == t && !unknown[u] && b != model[u] {
                        panic!(
                            "t{t} op {op}: byte {byte} (sector {}) reads {b:#x}, its last write \
                             was {:#x}: another thread's request changed it (mode {:?}, state \
                             {:?})",
                            byte / SECTOR,
                            model[u],
                            vol.mode(),
                            vol.state()
                        );
                    }
                }
            }
            18 => {
                let at = rng.next_u64() % (REGION - 1);
                let len = 1 + rng.next_u64() % (REGION - at).min(70_000);
                let r = vol.prefetch(at, len);
                assert!(sh.tolerate || r.is_ok(), "t{t} op {op}: prefetch: {r:?}");
            }
            _ => {
                let _ = vol.flush();
            }
        }
        sh.ops.fetch_add(1, Ordering::Relaxed);
    }
}

fn check_image(cap: &Capture, what: &str) {
    let (cache, _) = common::open_dyn(
        Arc::new(CrashDevice::from_image("c", cap.cache.written_image())),
        Arc::new(CrashDevice::from_image("b", cap.backing.written_image())),
    );
    let got = read(&cache.volumes()[0], 0, REGION as usize);
    for (i, &b) in got.iter().enumerate() {
        if !cap.touched[i] && b != cap.model[i] {
            panic!(
                "{what}: byte {i} (sector {}, owner t{}) reads {b:#x} after a power cut right \
                 after a FLUSH; it held {:#x} before the FLUSH began and nothing wrote it since",
                i as u64 / SECTOR,
                owner(i as u64),
                cap.model[i]
            );
        }
    }
}

fn stress(seed: u64, line: u64, tune_modes: bool) {
    let clock = CrashClock::new();
    let cache_dev = Arc::new(clock.device("cache", 16 * MIB));
    let backing = Arc::new(clock.device("backing", 8 * MIB));
    common::format_dev(&*cache_dev, line, CacheMode::WriteBack, 8 * MIB, 0);
    let (cache, _) = common::open_dyn(cache_dev.clone(), backing.clone());
    let cache = Arc::new(cache);
    if seed.is_multiple_of(2) {
        // One frame of checksums in RAM: hits and writes page them in and out.
        cache
            .set_checksum_memory(ssdcache_engine::checksums::checksum_frame_bytes(line))
            .expect("checksum memory");
    }
    cache.start_cleaner(fast_cleaner());
    let vol = cache.volumes()[0].clone();
    let sh = Arc::new(Shared {
        model: Mutex::new(vec![0u8; REGION as usize]),
        unknown: Mutex::new(vec![false; REGION as usize]),
        tolerate: false,
        touched: Mutex::new(vec![false; REGION as usize]),
        pause: RwLock::new(()),
        stop: AtomicBool::new(false),
        ops: AtomicU64::new(0),
    });
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let (vol, sh) = (vol.clone(), sh.clone());
            std::thread::spawn(move || writer(vol, sh, t, seed, 2500))
        })
        .collect();
    let tuner = {
        let (cache, sh) = (cache.clone(), sh.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(seed ^ 0xabc);
            let vol = cache.volumes()[0].clone();
            let modes = [
                CacheMode::WriteThrough,
                CacheMode::WriteBack,
                CacheMode::WriteAround,
                CacheMode::WriteBack,
                CacheMode::PassThrough,
                CacheMode::WriteBack,
            ];
            let began = Instant::now();
            let mut i = 0;
            let mut changes = 0u32;
            while !sh.stop.load(Ordering::Relaxed) && began.elapsed() < TIME_LIMIT {
                if tune_modes {
                    let m = modes[i % modes.len()];
                    i += 1;
                    if cache.set_mode(0, m, &fast_cleaner(), &mut |_| true).is_ok() {
                        changes += 1;
                    }
                }
                // Small caps make lines leave and writes go around a full cache.
                match rng.next_u64() % 6 {
                    0 => vol.set_admission(ssdcache_engine::admission::Admission::NHit(2)),
                    1 => vol.set_admission(ssdcache_engine::admission::Admission::Always),
                    2 => vol.set_sequential_cutoff([0, 16 << 10, 256 << 10][i % 3]),
                    3 => vol.set_occupancy_cap([None, Some(0.02), Some(0.05)][i % 3]),
                    4 => vol.set_dirty_cap([None, Some(0.01), Some(0.03)][i % 3]),
                    _ => {}
                }
                i += usize::from(!tune_modes);
                std::thread::sleep(Duration::from_millis(15));
            }
            changes
        })
    };
    let mut captures = Vec::new();
    let began = Instant::now();
    while captures.len() < 4 && began.elapsed() < TIME_LIMIT {
        std::thread::sleep(Duration::from_millis(40));
        if writers.iter().all(|w| w.is_finished()) {
            break;
        }
        let model = {
            let _all = sh.pause.write().unwrap();
            sh.touched.lock().unwrap().fill(false);
            sh.model.lock().unwrap().clone()
        };
        if vol.flush().is_err() {
            continue;
        }
        let _all = sh.pause.write().unwrap();
        // The cache device first: what the cleaner does after it only adds clean copies on the
        // disk of data the cache image holds dirty.
        let c = cache_dev.crashed_keeping("c", Keep::Random(captures.len() as u64 + seed));
        let b = backing.crashed_keeping("b", Keep::Random(captures.len() as u64 + 77));
        captures.push(Capture {
            cache: c,
            backing: b,
            model,
            touched: sh.touched.lock().unwrap().clone(),
        });
    }
    for w in writers {
        w.join().expect("writer");
    }
    sh.stop.store(true, Ordering::Relaxed);
    let changes = tuner.join().expect("tuner");
    cache.stop_cleaner();
    let model = sh.model.lock().unwrap().clone();
    let got = read(&vol, 0, REGION as usize);
    if let Some(i) = (0..REGION as usize).find(|&i| got[i] != model[i]) {
        panic!(
            "seed {seed}: byte {i} (sector {}, owner t{}) differs at the end ({} ops, {changes} \
             mode changes, mode {:?})",
            i as u64 / SECTOR,
            owner(i as u64),
            sh.ops.load(Ordering::Relaxed),
            vol.mode()
        );
    }
    eprintln!(
        "seed {seed}: {} ops, {changes} mode changes, {} captures, counters {:?}",
        sh.ops.load(Ordering::Relaxed),
        captures.len(),
        vol.counters()
    );
    vol.flush().expect("final flush");
    let end = Capture {
        cache: cache_dev.crashed_keeping("c", Keep::Random(seed)),
        backing: backing.crashed_keeping("b", Keep::Random(seed + 1)),
        model,
        touched: vec![false; REGION as usize],
    };
    drop(vol);
    drop(cache);
    for (k, cap) in captures.iter().enumerate() {
        check_image(cap, &format!("seed {seed}, capture {k}"));
    }
    check_image(&end, &format!("seed {seed}, power cut at the end"));
}

#[test]
fn r42_2a_byte_owners_beside_mode_changes_cleaner_and_power_cuts() {
    for seed in 1..=6 {
        stress(seed, LINE, true);
    }
}

#[test]
fn r42_2b_byte_owners_4k_lines_admission_and_cutoff_changes_write_back() {
    for seed in 11..=13 {
        stress(seed, SECTOR, false);
    }
}

// ---------------------------------------------------------------------------------------------
// R42-3: devices fail in the middle of read-modify-writes. A failed request may leave its own
// bytes old or new (they are then "unknown" until written again), but never another thread's
// bytes of the same sector; once the faults stop, every byte that is not unknown reads back,
// and after a FLUSH and a power cut too.
// ---------------------------------------------------------------------------------------------

/// Which device fails.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Failing {
    Backing,
    Cache,
}

fn faults(mode: CacheMode, seed: u64, failing: Failing) {
    let (cache_dev, backing, cache) = common::setup_crash(16 * MIB, 8 * MIB, LINE, mode);
    let cache = Arc::new(cache);
    if mode == CacheMode::WriteBack {
        cache.start_cleaner(fast_cleaner());
    }
    let vol = cache.volumes()[0].clone();
    let sh = Arc::new(Shared {
        model: Mutex::new(vec![0u8; REGION as usize]),
        unknown: Mutex::new(vec![false; REGION as usize]),
        tolerate: true,
        touched: Mutex::new(vec![false; REGION as usize]),
        pause: RwLock::new(()),
        stop: AtomicBool::new(false),
        ops: AtomicU64::new(0),
    });
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let (vol, sh) = (vol.clone(), sh.clone());
            std::thread::spawn(move || writer(vol, sh, t, seed, 2500))
        })
        .collect();
    let dev: &CrashDevice = match failing {
        Failing::Backing => &backing,
        Failing::Cache => &cache_dev,
    };
    let mut rng = Rng(seed ^ 0xfa11);
    let began = Instant::now();
    let mut bursts = 0;
    while !writers.iter().all(|w| w.is_finished()) && began.elapsed() < TIME_LIMIT {
        // Short bursts (a cache device fails rarely: each burst may degrade the volume).
        std::thread::sleep(Duration::from_millis(if failing == Failing::Cache {
            60
        } else {
            8
        }));
        // A failed backing flush fails every later FLUSH by design: only reads and writes
        // fail there, so the power cut after the final FLUSH is checked.
        let kinds = if failing == Failing::Cache { 3 } else { 2 };
        match rng.next_u64() % kinds {
            0 => dev.fail_reads(true),
            1 => dev.fail_writes(true),
            _ => dev.fail_flushes(true),
        }
        std::thread::sleep(Duration::from_micros(300));
        dev.fail_reads(false);
        dev.fail_writes(false);
        dev.fail_flushes(false);
        bursts += 1;
    }
    for w in writers {
        w.join().expect("writer");
    }
    cache.stop_cleaner();
    let m = sh.model.lock().unwrap().clone();
    let u = sh.unknown.lock().unwrap().clone();
    eprintln!(
        "{mode:?} {failing:?} seed {seed}: {} ops, {bursts} bursts, {} unknown bytes, state {:?}",
        sh.ops.load(Ordering::Relaxed),
        u.iter().filter(|&&x| x).count(),
        vol.state()
    );
    match vol.read_bytes_or(0, REGION) {
        Ok(got) => {
            if let Some(i) = (0..REGION as usize).find(|&i| !u[i] && got[i] != m[i]) {
                panic!(
                    "{mode:?} {failing:?} seed {seed}: byte {i} (sector {}, owner t{}) lost \
                     after the faults (state {:?})",
                    i as u64 / SECTOR,
                    owner(i as u64),
                    vol.state()
                );
            }
        }
        Err(e) => {
            let bad: Vec<u64> = (0..REGION / SECTOR)
                .filter(|s| vol.read_bytes_or(s * SECTOR, SECTOR).is_err())
                .collect();
            panic!(
                "{mode:?} {failing:?} seed {seed}: reads fail after the faults ended ({e}); \
                 sectors {bad:?} (state {:?})",
                vol.state()
            );
        }
    }
    if vol.flush().is_ok() {
        drop(vol);
        drop(cache);
        let (cache, _) = common::open_dyn(
            Arc::new(cache_dev.crashed("c", seed)),
            Arc::new(backing.crashed("b", seed + 1)),
        );
        let got = cache.volumes()[0]
            .read_bytes_or(0, REGION)
            .unwrap_or_else(|e| panic!("{mode:?} {failing:?}: after a power cut: {e}"));
        if let Some(i) = (0..REGION as usize).find(|&i| !u[i] && got[i] != m[i]) {
            panic!(
                "{mode:?} {failing:?} seed {seed}: byte {i} (sector {}) lost after a FLUSH and \
                 a power cut",
                i as u64 / SECTOR
            );
        }
    } else {
        eprintln!("{mode:?} {failing:?} seed {seed}: the final FLUSH failed; no power cut");
    }
}

trait ReadBytes {
    fn read_bytes_or(&self, offset: u64, len: u64) -> ssdcache_engine::Result<Vec<u8>>;
}

impl ReadBytes for Volume {
    fn read_bytes_or(&self, offset: u64, len: u64) -> ssdcache_engine::Result<Vec<u8>> {
        let mut buf = vec![0u8; len as usize];
        self.read(offset, &mut buf).map(|()| buf)
    }
}

#[test]
fn r42_3a_backing_faults_in_the_middle_of_read_modify_writes() {
    for seed in 5..=7 {
        for mode in MODES {
            faults(mode, seed, Failing::Backing);
        }
    }
}

#[test]
fn r42_3b_cache_faults_in_the_middle_of_read_modify_writes() {
    for seed in 5..=7 {
        for mode in MODES {
            faults(mode, seed, Failing::Cache);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// R42-4: partial writes that turn a flushed dirty sector into zeroes and back (design.md §4.8:
// a dirty sector reading as zeroes counts as a lost cache region after an unclean stop).
// ---------------------------------------------------------------------------------------------

#[test]
fn r42_4_partial_writes_zeroing_a_flushed_dirty_sector_then_power_cut() {
    for variant in 0..4u64 {
        for seed in 0..6u64 {
            let (cache_dev, backing, cache) = common::crash_cache();
            let vol = cache.volumes()[0].clone();
            let s = 3 * LINE + 2 * SECTOR;
            // Dirty, only its first 512 bytes non-zero, flushed (the journal names it).
            let mut d1 = vec![0u8; SECTOR as usize];
            d1[..512].copy_from_slice(&data(1, 512));
            vol.write(s, &d1, false).expect("d1");
            // The line's other sectors dirty too, so the line stays.
            vol.write(3 * LINE, &data(2, SECTOR as usize), false)
                .expect("neighbour");
            vol.flush().expect("flush");
            // A partial write of zeroes makes the sector all zeroes: it goes around the cache.
            match variant {
                0 => vol.write(s, &[0u8; 512], false).expect("zero bytes"),
                1 => vol
                    .write_zeroes(s + 100, 412, false)
                    .and_then(|()| vol.write_zeroes(s, 100, false))
                    .expect("write_zeroes"),
                _ => vol.write(s, &[0u8; 512], false).expect("zero bytes"),
            }
            let mut want = vec![0u8; SECTOR as usize];
            if variant >= 2 {
                // Then non-zero bytes elsewhere in the sector: read from the disk (zeroes),
                // patched, into the cache slot that held d1.
                let p = data(3, 100);
                vol.write(s + 2000, &p, false).expect("p");
                want[2000..2100].copy_from_slice(&p);
            }
            if variant == 3 {
                vol.flush().expect("flush 2");
            }
            drop(vol);
            drop(cache);
            let (cache, _) = common::open_dyn(
                Arc::new(cache_dev.crashed("c", seed)),
                Arc::new(backing.crashed("b", seed + 100)),
            );
            let got = cache.volumes()[0].read_bytes_or(s, SECTOR);
            // Variant 1's first write_zeroes leaves d1's first 100 bytes: a state a cut may
            // keep too (the second one unflushed).
            let mut mid = d1.clone();
            mid[100..512].fill(0);
            let ok = match &got {
                Ok(g) if variant == 3 => *g == want,
                Ok(g) if variant == 1 && *g == mid => true,
                Ok(g) => *g == want || *g == d1 || g.iter().all(|&b| b == 0),
                Err(_) => false,
            };
            assert!(
                ok,
                "variant {variant} seed {seed}: after a power cut the sector reads {}",
                match &got {
                    Err(e) => format!("an error ({e})"),
                    Ok(g) if *g == d1 => "the flushed data".into(),
                    Ok(g) if g.iter().all(|&b| b == 0) => "zeroes".into(),
                    Ok(_) => "other data".into(),
                }
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// R42-5: offsets near u64::MAX: refused, never a panic (the engine API is public; the NBD
// server checks bounds first, an embedding program may not).
// ---------------------------------------------------------------------------------------------

fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| panic!("{what} panicked"))
}

#[test]
fn r42_5a_write_zeroes_near_u64_max_is_refused_not_a_panic() {
    let (_c, _b, cache) = common::setup(16 * MIB, 8 * MIB, LINE, CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    let r = no_panic("write_zeroes(u64::MAX - 10, 100)", {
        let vol = vol.clone();
        move || vol.write_zeroes(u64::MAX - 10, 100, false)
    });
    assert!(matches!(r, Err(EngineError::OutOfRange { .. })), "{r:?}");
}

#[test]
fn r42_5b_other_requests_near_u64_max_are_refused_not_a_panic() {
    let (_c, _b, cache) = common::setup(16 * MIB, 8 * MIB, LINE, CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    for (offset, len) in [(u64::MAX - 10, 100u64), (u64::MAX - 4095, 1), (u64::MAX, 1)] {
        let v = vol.clone();
        let r = no_panic("write", move || {
            v.write(offset, &vec![1u8; len as usize], true)
        });
        assert!(r.is_err(), "write at {offset}");
        let v = vol.clone();
        let r = no_panic("read", move || v.read(offset, &mut vec![0u8; len as usize]));
        assert!(r.is_err(), "read at {offset}");
        let v = vol.clone();
        assert!(no_panic("trim", move || v.trim(offset, len, false)).is_err());
        let v = vol.clone();
        assert!(no_panic("prefetch", move || v.prefetch(offset, len)).is_err());
        let v = vol.clone();
        assert!(!no_panic("hint", move || v
            .likely_served_from_cache(true, offset, len)));
    }
}

// ---------------------------------------------------------------------------------------------
// R42-6: a backing file whose size is not a multiple of 4 KiB, opened with O_DIRECT as the
// daemon opens it: the last whole sector is exported and must be served (read miss, partial
// write, write-back and writeback).
// ---------------------------------------------------------------------------------------------

#[test]
fn r42_6_odd_size_direct_io_backing_file_serves_its_last_whole_sector() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut failures = Vec::new();
    // 1000 odd bytes: O_DIRECT cannot read them; 512 (a whole logical block): it can.
    for (mode, odd) in MODES.iter().flat_map(|&m| [(m, 1000u64), (m, 512)]) {
        let size = 4 * LINE + SECTOR + odd;
        let path = dir.path().join(format!("backing-{mode:?}-{odd}"));
        let content = data(9, size as usize);
        std::fs::write(&path, &content).expect("backing file");
        let opts = OpenOptions {
            write: true,
            direct: true,
            lock: false,
        };
        let backing: Arc<dyn BlockDevice> =
            Arc::new(FileDevice::open(&path, opts).expect("open backing"));
        let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
        common::format_dev(&*cache_dev, LINE, mode, size, 0);
        let (cache, _) = common::open_dyn(cache_dev, backing);
        let vol = cache.volumes()[0].clone();
        let last = size - size % SECTOR - SECTOR; // the last whole sector, exported
        let got = vol.read_bytes_or(last, SECTOR);
        match got {
            Ok(g) if g[..] == content[last as usize..(last + SECTOR) as usize] => {}
            Ok(_) => failures.push(format!(
                "{mode:?} +{odd}: read of the last sector: wrong data"
            )),
            Err(e) => failures.push(format!("{mode:?} +{odd}: read of the last sector: {e}")),
        }
        if let Err(e) = vol.write(last + 10, &[7u8; 20], true) {
            failures.push(format!(
                "{mode:?} +{odd}: partial write of the last sector: {e}"
            ));
        }
        if let Err(e) = vol.write(last, &data(4, SECTOR as usize), true) {
            failures.push(format!(
                "{mode:?} +{odd}: whole write of the last sector: {e}"
            ));
        }
        if let Err(e) = cache.drain(&CleanerConfig::default(), &mut |_| true) {
            failures.push(format!("{mode:?} +{odd}: drain: {e}"));
        }
        if let Err(e) = vol.read_bytes_or(last + 5, 10) {
            failures.push(format!(
                "{mode:?} +{odd}: partial read of the last sector: {e}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// R42-7: a write-back partial write of a sector the cache does not hold reads it from the disk
// holding its line. A hit on another sector of that line, and a write-back write of another
// sector (which the lane hint sends to the fast lane), wait for that disk read.
// ---------------------------------------------------------------------------------------------

#[test]
fn r42_7_hit_beside_a_partial_write_waits_for_its_disk_read() {
    let (mem, gate, cache) = common::gated_cache(CacheMode::WriteBack, LINE, 16 * MIB, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    mem.write_at(&data(1, LINE as usize), 0).expect("seed");
    // Sectors 1 and 2 cached (write-back writes), sector 7 not.
    vol.write(SECTOR, &data(2, SECTOR as usize), false)
        .expect("w");
    vol.write(2 * SECTOR, &data(3, SECTOR as usize), false)
        .expect("w");
    assert!(vol.likely_served_from_cache(false, SECTOR, SECTOR));
    assert!(vol.likely_served_from_cache(true, 2 * SECTOR, SECTOR));
    gate.hold_next_read();
    let partial = {
        let vol = vol.clone();
        std::thread::spawn(move || vol.write(7 * SECTOR + 100, &[9u8; 100], false))
    };
    assert!(
        gate.wait_until_held(Duration::from_secs(10)),
        "the partial write reads the disk"
    );
    let hit = common::read_in_thread(&vol, SECTOR, SECTOR as usize);
    let (tx, fast_write) = std::sync::mpsc::channel();
    {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let r = vol.write(2 * SECTOR, &data(4, SECTOR as usize), false);
            let _ = tx.send(r);
        });
    }
    let hit_waited = hit.recv_timeout(Duration::from_secs(3)).is_err();
    let write_waited = fast_write.recv_timeout(Duration::from_millis(500)).is_err();
    gate.release();
    partial.join().expect("partial").expect("partial write");
    let _ = hit.recv_timeout(Duration::from_secs(10));
    let _ = fast_write.recv_timeout(Duration::from_secs(10));
    assert!(
        !hit_waited && !write_waited,
        "while a partial write read an uncached sector of the line from the disk: a hit on a \
         cached sector waited: {hit_waited}; a write-back write of another sector (fast-lane \
         hint true) waited: {write_waited}"
    );
}

// ---------------------------------------------------------------------------------------------
// R42-8: FUA on partial writes and on write-zeroes with partial edges: durable at once, with
// no FLUSH, in every mode; the bytes around them unchanged.
// ---------------------------------------------------------------------------------------------

#[test]
fn r42_8_fua_partial_writes_and_write_zeroes_survive_a_power_cut_without_flush() {
    for mode in MODES {
        for seed in 0..4u64 {
            let (cache_dev, backing, cache) = common::setup_crash(16 * MIB, 8 * MIB, LINE, mode);
            let vol = cache.volumes()[0].clone();
            let base = data(77, (2 * LINE) as usize);
            vol.write(0, &base, false).expect("base");
            vol.flush().expect("flush");
            let mut want = base.clone();
            // Unflushed, un-FUA neighbours in the same sectors (may be lost, but not torn into
            // the FUA requests' bytes).
            let p = data(78, 300);
            vol.write(5 * SECTOR + 3000, &p, true).expect("fua partial");
            want[(5 * SECTOR + 3000) as usize..(5 * SECTOR + 3300) as usize].copy_from_slice(&p);
            let (z, zl) = (9 * SECTOR + 100, 3 * SECTOR + 200);
            vol.write_zeroes(z, zl, true).expect("fua write_zeroes");
            want[z as usize..(z + zl) as usize].fill(0);
            let q = data(79, 5000);
            vol.write(LINE - 2500, &q, true).expect("fua across lines");
            want[(LINE - 2500) as usize..(LINE + 2500) as usize].copy_from_slice(&q);
            drop(vol);
            drop(cache);
            let (cache, _) = common::open_dyn(
                Arc::new(cache_dev.crashed("c", seed)),
                Arc::new(backing.crashed("b", seed + 9)),
            );
            let got = cache.volumes()[0]
                .read_bytes_or(0, 2 * LINE)
                .unwrap_or_else(|e| panic!("{mode:?}: read after the cut: {e}"));
            if let Some(i) = (0..(2 * LINE) as usize).find(|&i| got[i] != want[i]) {
                panic!(
                    "{mode:?} seed {seed}: byte {i} (sector {}) not as the FUA requests left it",
                    i / 4096
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// R42-9: liveness and cache/disk agreement. Threads send overlapping unaligned requests that
// span many lines (writes, zeroes, trims, prefetches, reads alone and in batches) while the
// cleaner runs and the mode changes: nothing may hang (lines are taken across line
// boundaries, partial edges read under them, the cleaner's extents cross lines), and once
// everything is written back, every byte read through the cache equals the disk's.
// ---------------------------------------------------------------------------------------------

fn overlap_storm(line: u64, seed: u64) {
    const SPAN: u64 = 2 * MIB;
    let (_cache_dev, backing, cache) =
        common::setup_crash(16 * MIB, 8 * MIB, line, CacheMode::WriteBack);
    let cache = Arc::new(cache);
    cache.start_cleaner(fast_cleaner());
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let (cache, stop, done) = (cache.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let vol = cache.volumes()[0].clone();
                let mut rng = Rng(seed * 1000 + t);
                let began = Instant::now();
                for _ in 0..1500 {
                    if stop.load(Ordering::Relaxed) || began.elapsed() > TIME_LIMIT {
                        break;
                    }
                    let at = rng.next_u64() % (SPAN - 1);
                    let len = 1 + rng.next_u64() % (SPAN - at).min(300_000);
                    let fua = rng.next_u64().is_multiple_of(10);
                    let r = match rng.next_u64() % 10 {
                        0..=3 => vol.write(at, &bytes(&mut rng, len as usize), fua),
                        4 => vol.write_zeroes(at, len, fua),
                        5 => vol.trim(at, len, fua),
                        6 => vol.prefetch(at, len),
                        7 => {
                            let mut bufs: Vec<Vec<u8>> = (0..4)
                                .map(|_| vec![0u8; 1 + (rng.next_u64() % 9000) as usize])
                                .collect();
                            let offs: Vec<u64> = bufs
                                .iter()
                                .map(|b| rng.next_u64() % (SPAN - b.len() as u64))
                                .collect();
                            let mut reads: Vec<ssdcache_engine::BatchRead<'_>> = bufs
                                .iter_mut()
                                .zip(&offs)
                                .map(|(b, &o)| ssdcache_engine::BatchRead::new(o, b))
                                .collect();
                            vol.read_many(&mut reads);
                            reads.into_iter().try_for_each(|r| r.result)
                        }
                        8 => vol.flush(),
                        _ => vol.read(at, &mut vec![0u8; len as usize]),
                    };
                    r.unwrap_or_else(|e| panic!("t{t}: {e}"));
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let tuner = {
        let (cache, stop) = (cache.clone(), stop.clone());
        std::thread::spawn(move || {
            let modes = [
                CacheMode::WriteThrough,
                CacheMode::WriteBack,
                CacheMode::WriteAround,
                CacheMode::PassThrough,
                CacheMode::WriteBack,
            ];
            let began = Instant::now();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) && began.elapsed() < TIME_LIMIT {
                let _ = cache.set_mode(0, modes[i % modes.len()], &fast_cleaner(), &mut |_| true);
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let began = Instant::now();
    while !workers.iter().all(|w| w.is_finished()) {
        assert!(
            began.elapsed() < TIME_LIMIT + Duration::from_secs(30),
            "line {line} seed {seed}: requests hang ({} done)",
            done.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker");
    }
    tuner.join().expect("tuner");
    cache.stop_cleaner();
    let vol = cache.volumes()[0].clone();
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain");
    let through_cache = read(&vol, 0, SPAN as usize);
    let mut disk = vec![0u8; SPAN as usize];
    backing.read_at(&mut disk, 0).expect("disk");
    if let Some(i) = (0..SPAN as usize).find(|&i| through_cache[i] != disk[i]) {
        panic!(
            "line {line} seed {seed}: after the drain the cache serves byte {i} (sector {}) \
             unlike the disk (mode {:?})",
            i as u64 / SECTOR,
            vol.mode()
        );
    }
}

#[test]
fn r42_9_overlapping_unaligned_requests_never_hang_and_cache_equals_disk() {
    for seed in 1..=3 {
        overlap_storm(LINE, seed);
        overlap_storm(SECTOR, seed);
    }
}
