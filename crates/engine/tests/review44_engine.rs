//! Review 44: adversarial tests of commits 4c2c9ef and d3bcf45 (byte-granular requests: a
//! write-back partial write reads an uncached partial sector from the disk before taking its
//! lines; a volume's size is its whole sectors; partial requests are served in 1 MiB pieces).
//!
//! Every loop is bounded in count and, where threads race, in time.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{counter, data, Rng, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, GateDevice};
use ssdcache_engine::{Cache, CleanerConfig, Volume};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
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

fn deltas(vol: &Volume, before: &[u64]) -> Vec<u64> {
    vol.counters()
        .0
        .iter()
        .zip(before)
        .map(|(a, b)| a - b)
        .collect()
}

fn named(d: &[u64], name: &str) -> u64 {
    let i = ssdcache_format::VolumeCounters::NAMES
        .iter()
        .position(|n| *n == name)
        .expect("counter");
    d[i]
}

// ---------------------------------------------------------------------------------------------
// R44-1: one write counts at most one write hit. A partial write longer than a piece (1 MiB) is
// now served piece by piece, and each piece's `write_back` / `cache_written_through` counts a
// write hit of its own: one request counts up to four (a 32 MiB one up to 33), so write_hits
// exceeds writes. (Read hits and misses were moved to `read_counted` for exactly this; write
// hits were not.)
// ---------------------------------------------------------------------------------------------

#[test]
fn r44_1_a_multi_piece_write_counts_one_write_hit() {
    let mut failures = Vec::new();
    for mode in [CacheMode::WriteBack, CacheMode::WriteThrough] {
        let (_c, _b, cache) = common::setup_crash(32 * MIB, 16 * MIB, LINE, mode);
        let vol = cache.volumes()[0].clone();
        vol.set_sequential_cutoff(0);
        // Every line of [0, 4 MiB) cached: the next writes of it are hits.
        vol.write(0, &data(1, (4 * MIB) as usize), false)
            .expect("seed");
        let before = vol.counters().0;
        vol.write(512, &data(2, (3 * MIB) as usize), false)
            .expect("unaligned write of 3 MiB");
        let d = deltas(&vol, &before);
        let (writes, hits) = (named(&d, "writes"), named(&d, "write_hits"));
        if hits > writes {
            failures.push(format!(
                "{mode:?}: one write of 3 MiB at byte 512 counted {writes} write(s) and {hits} \
                 write hits"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// R44-2: one request is not a stream. The stream detector is shown each piece of an unaligned
// request as a request of its own, so a single unaligned write or read longer than the
// sequential cutoff continues "its own stream" and its later pieces bypass the cache, where
// the same request at an aligned offset (shown once, as a new stream) is cached whole.
// ---------------------------------------------------------------------------------------------

#[test]
fn r44_2_one_unaligned_request_is_not_taken_for_a_stream() {
    let (_c, _b, cache) = common::setup_crash(64 * MIB, 64 * MIB, LINE, CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    vol.set_sequential_cutoff(MIB);
    let len = (4 * MIB) as usize;
    // Control: aligned, one request of 4 MiB at a fresh place: nothing bypassed.
    let before = vol.counters().0;
    vol.write(0, &data(1, len), false).expect("aligned write");
    let aligned_write = named(&deltas(&vol, &before), "bytes_bypassed");
    // The same request 512 bytes further, far from the first (not its continuation).
    let before = vol.counters().0;
    vol.write(20 * MIB + 512, &data(2, len), false)
        .expect("unaligned write");
    let unaligned_write = named(&deltas(&vol, &before), "bytes_bypassed");
    let before = vol.counters().0;
    let mut buf = vec![0u8; len];
    vol.read(40 * MIB + 512, &mut buf).expect("unaligned read");
    let unaligned_read = named(&deltas(&vol, &before), "bytes_bypassed");
    assert!(
        aligned_write == 0 && unaligned_write == 0 && unaligned_read == 0,
        "one request of 4 MiB, cutoff 1 MiB, bytes bypassed: aligned write {aligned_write}, \
         the same write at +512 {unaligned_write}, a read at +512 {unaligned_read}"
    );
}

// ---------------------------------------------------------------------------------------------
// R44-3: the window of `read_edges_before_holding`, made deterministic: a write-back partial
// write of an uncached sector S is held at the gate right after its disk read (no lines held,
// a pending read registered), while another request changes S or its line; then it goes on.
// S must be one of the two serial orders (never the old disk bytes under the other request's
// effect lost), the disk must agree after a drain, and after a power cut (both FUA) S must be
// what was read before it.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq)]
enum Meanwhile {
    /// A whole-sector write-back write of S (into the cache, no disk write).
    WholeWrite,
    /// The same, then the cleaner writes S back (a disk write) during the window.
    WholeWriteThenDrain,
    /// The same, then S's line leaves the cache (clean, evicted by the occupancy cap).
    WholeWriteDrainEvict,
    /// A whole write of S above the dirty limit: written around to the disk.
    WriteAroundDirtyLimit,
    /// A whole write of S of zeroes (goes to the disk even in write-back).
    ZeroWrite,
    /// write_zeroes of S (on the disk, the range uncached).
    WriteZeroes,
    /// A trim of S, then a whole write of it.
    TrimThenWrite,
    /// A partial write of other bytes of S (its own unheld read, not held at the gate).
    OtherPartial,
    /// A read miss of S's line fills it (clean, the disk's old bytes), then a whole write.
    ReadFillThenWrite,
    /// The cache device fails a write of another line: the volume stops caching writes.
    CacheFailsElsewhere,
    /// The cache device fails the whole write of S: it goes to the disk instead.
    CacheFailsOnS,
}

const MEANWHILE: [Meanwhile; 11] = [
    Meanwhile::WholeWrite,
    Meanwhile::WholeWriteThenDrain,
    Meanwhile::WholeWriteDrainEvict,
    Meanwhile::WriteAroundDirtyLimit,
    Meanwhile::ZeroWrite,
    Meanwhile::WriteZeroes,
    Meanwhile::TrimThenWrite,
    Meanwhile::OtherPartial,
    Meanwhile::ReadFillThenWrite,
    Meanwhile::CacheFailsElsewhere,
    Meanwhile::CacheFailsOnS,
];

/// A write-back cache on a crash device over a gated crash device.
fn gated_crash_cache(
    line: u64,
) -> (
    Arc<CrashDevice>,
    Arc<CrashDevice>,
    Arc<GateDevice>,
    Arc<Cache>,
) {
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    let backing = Arc::new(CrashDevice::new("backing", 8 * MIB));
    let gate = Arc::new(GateDevice::new(backing.clone()));
    common::format_dev(&*cache_dev, line, CacheMode::WriteBack, 8 * MIB, 0);
    let (cache, _) = common::open_dyn(cache_dev.clone(), gate.clone());
    (cache_dev, backing, gate, Arc::new(cache))
}

fn window_case(what: Meanwhile, line: u64, head: bool) -> Result<(), String> {
    const S: u64 = 7;
    let (cache_dev, backing, gate, cache) = gated_crash_cache(line);
    let vol = cache.volumes()[0].clone();
    let d0 = data(100, SECTOR as usize);
    let base = data(1, LINE as usize);
    backing.write_at(&base, 0).expect("seed");
    backing.flush().expect("flush");
    // The line cached (clean) but S: a trim drops S (then the disk gets S's bytes again).
    vol.prefetch(0, LINE).expect("prefetch");
    vol.trim(S * SECTOR, SECTOR, false).expect("trim");
    backing.write_at(&d0, S * SECTOR).expect("seed S");
    backing.flush().expect("flush");
    if vol.likely_served_from_cache(false, S * SECTOR, SECTOR)
        || !vol.likely_served_from_cache(false, SECTOR, SECTOR)
    {
        return Err(format!("{what:?}: setup: S cached or its line not"));
    }
    if what == Meanwhile::WriteAroundDirtyLimit {
        vol.set_dirty_cap(Some(0.0));
    }
    // P: 100 bytes of S (at its head or tail), FUA.
    let (p_at, p) = if head {
        (100usize, vec![9u8; 100])
    } else {
        (3000usize, vec![9u8; 1096])
    };
    gate.hold_next_read();
    let partial = {
        let (vol, p) = (vol.clone(), p.clone());
        std::thread::spawn(move || vol.write(S * SECTOR + p_at as u64, &p, true))
    };
    if !gate.wait_until_held(Duration::from_secs(10)) {
        gate.release();
        let r = partial.join();
        return Err(format!(
            "{what:?}: the partial write never read the disk ({r:?})"
        ));
    }
    let d1 = data(200, SECTOR as usize);
    let zero = vec![0u8; SECTOR as usize];
    let mut other_bytes: Option<(usize, Vec<u8>)> = None;
    let x: Vec<u8> = match what {
        Meanwhile::WholeWrite | Meanwhile::WriteAroundDirtyLimit => {
            vol.write(S * SECTOR, &d1, true)
                .map_err(|e| e.to_string())?;
            d1.clone()
        }
        Meanwhile::WholeWriteThenDrain | Meanwhile::WholeWriteDrainEvict => {
            vol.write(S * SECTOR, &d1, true)
                .map_err(|e| e.to_string())?;
            cache
                .drain(&CleanerConfig::default(), &mut |_| true)
                .map_err(|e| format!("drain: {e}"))?;
            if what == Meanwhile::WholeWriteDrainEvict {
                vol.set_occupancy_cap(Some(0.0));
                for l in 8..24u64 {
                    let _ = read(&vol, l * LINE, SECTOR as usize);
                }
                if vol.likely_served_from_cache(false, S * SECTOR, SECTOR) {
                    gate.release();
                    let _ = partial.join();
                    return Err(format!("{what:?}: S's line was not evicted (test setup)"));
                }
            }
            d1.clone()
        }
        Meanwhile::ZeroWrite => {
            vol.write(S * SECTOR, &zero, true)
                .map_err(|e| e.to_string())?;
            zero.clone()
        }
        Meanwhile::WriteZeroes => {
            vol.write_zeroes(S * SECTOR, SECTOR, true)
                .map_err(|e| e.to_string())?;
            zero.clone()
        }
        Meanwhile::TrimThenWrite => {
            vol.trim(S * SECTOR, SECTOR, false)
                .map_err(|e| e.to_string())?;
            vol.write(S * SECTOR, &d1, true)
                .map_err(|e| e.to_string())?;
            d1.clone()
        }
        Meanwhile::OtherPartial => {
            let (at, b) = if head {
                (2000usize, vec![7u8; 300])
            } else {
                (10, vec![7u8; 50])
            };
            vol.write(S * SECTOR + at as u64, &b, true)
                .map_err(|e| e.to_string())?;
            let mut x = d0.clone();
            x[at..at + b.len()].copy_from_slice(&b);
            other_bytes = Some((at, b));
            x
        }
        Meanwhile::ReadFillThenWrite => {
            let _ = read(&vol, S * SECTOR + 5, 10);
            vol.write(S * SECTOR, &d1, true)
                .map_err(|e| e.to_string())?;
            d1.clone()
        }
        Meanwhile::CacheFailsElsewhere => {
            cache_dev.fail_writes(true);
            let _ = vol.write(3 * LINE, &data(5, SECTOR as usize), false);
            cache_dev.fail_writes(false);
            d0.clone()
        }
        Meanwhile::CacheFailsOnS => {
            cache_dev.fail_writes(true);
            let r = vol.write(S * SECTOR, &d1, false);
            cache_dev.fail_writes(false);
            r.map_err(|e| format!("whole write with the cache failing: {e}"))?;
            vol.flush().map_err(|e| format!("flush: {e}"))?;
            d1.clone()
        }
    };
    gate.release();
    partial
        .join()
        .map_err(|_| "partial write panicked".to_string())?
        .map_err(|e| format!("{what:?}: partial write: {e}"))?;
    // X then P, or P then X.
    let mut xp = x.clone();
    xp[p_at..p_at + p.len()].copy_from_slice(&p);
    let mut px = d0.clone();
    px[p_at..p_at + p.len()].copy_from_slice(&p);
    let px = match what {
        Meanwhile::OtherPartial => {
            let (at, b) = other_bytes.expect("set");
            px[at..at + b.len()].copy_from_slice(&b);
            px
        }
        Meanwhile::CacheFailsElsewhere => px,
        _ => x.clone(),
    };
    let got = read(&vol, S * SECTOR, SECTOR as usize);
    let name = |g: &[u8]| {
        if g == xp {
            "X then P"
        } else if g == px {
            "P then X"
        } else if g == x {
            "X alone (P lost)"
        } else if g == d0 {
            "the old disk bytes"
        } else {
            let mut d0p = d0.clone();
            d0p[p_at..p_at + p.len()].copy_from_slice(&p);
            if g == d0p {
                "P over the old disk bytes (X lost)"
            } else {
                "other data"
            }
        }
    };
    if got != xp && got != px {
        return Err(format!(
            "{what:?} (line {line}, head {head}): S reads {}",
            name(&got)
        ));
    }
    let _ = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let mut disk = vec![0u8; SECTOR as usize];
    backing.read_at(&mut disk, S * SECTOR).expect("disk");
    if disk != got && vol.stats().dirty_bytes == 0 {
        return Err(format!(
            "{what:?} (line {line}, head {head}): after a drain the disk holds {} but the \
             cache serves {}",
            name(&disk),
            name(&got)
        ));
    }
    let (c, b) = (cache_dev.crashed("c", 3), backing.crashed("b", 5));
    drop(vol);
    drop(cache);
    let (cache, _) = common::open_dyn(Arc::new(c), Arc::new(b));
    let after = read(&cache.volumes()[0], S * SECTOR, SECTOR as usize);
    if after != got {
        return Err(format!(
            "{what:?} (line {line}, head {head}): after a power cut S reads {} (before: {})",
            name(&after),
            name(&got)
        ));
    }
    Ok(())
}

#[test]
fn r44_3_requests_in_the_window_of_an_unheld_partial_sector_read() {
    let mut failures = Vec::new();
    for line in [LINE, SECTOR] {
        for head in [true, false] {
            for what in MEANWHILE {
                if let Err(e) = window_case(what, line, head) {
                    failures.push(e);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// R44-4: partial writes of several pieces (crossing 1 MiB boundaries) by threads owning
// interleaved bytes of the same sectors (512-byte pieces), beside whole-sector writes of their
// own sectors, reads, trims, the cleaner, a small occupancy cap (lines leave), a dirty cap
// (writes go around) and mode changes; every byte a thread reads of its own must be its last
// write, and after the end, a FLUSH and a power cut, every byte.
// ---------------------------------------------------------------------------------------------

const REGION: u64 = 3 * MIB;
const OWN: u64 = 512;
const WRITERS: u64 = 3;

fn owner(byte: u64) -> u64 {
    (byte / OWN) % WRITERS
}

fn multi_piece_stress(seed: u64, line: u64) {
    let (cache_dev, backing, cache) =
        common::setup_crash(16 * MIB, 8 * MIB, line, CacheMode::WriteBack);
    let cache = Arc::new(cache);
    cache.start_cleaner(fast_cleaner());
    let vol = cache.volumes()[0].clone();
    let model = Arc::new(Mutex::new(vec![0u8; REGION as usize]));
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let (vol, model, stop, ops) = (vol.clone(), model.clone(), stop.clone(), ops.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(seed * 77 + t);
                let began = Instant::now();
                for op in 0..2000u64 {
                    if began.elapsed() > TIME_LIMIT || stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let fua = rng.next_u64().is_multiple_of(6);
                    match rng.next_u64() % 10 {
                        0..=4 => {
                            // Own 512-byte pieces, written one request each, around a 1 MiB
                            // boundary; or one piece at a random place.
                            let boundary = (1 + rng.next_u64() % 2) * MIB;
                            let k = rng.next_u64() % 64;
                            let i = boundary / OWN - 96 + k * WRITERS;
                            let at = (i - i % WRITERS + t) * OWN;
                            let a = rng.next_u64() % OWN;
                            let len = 1 + rng.next_u64() % (OWN - a);
                            let d = bytes(&mut rng, len as usize);
                            // The model first, under its lock with the write: a read that sees
                            // the new bytes must find them in the model.
                            let mut m = model.lock().unwrap();
                            vol.write(at + a, &d, fua)
                                .unwrap_or_else(|e| panic!("t{t} op {op}: write: {e}"));
                            m[(at + a) as usize..(at + a + len) as usize].copy_from_slice(&d);
                        }
                        5 | 6 => {
                            // A long read across both boundaries at an odd offset.
                            let at = MIB - 1 - rng.next_u64() % 60_000;
                            let len = MIB + 2 + rng.next_u64() % 100_000;
                            let mut buf = vec![0u8; len as usize];
                            vol.read(at, &mut buf)
                                .unwrap_or_else(|e| panic!("t{t} op {op}: read: {e}"));
                            let m = model.lock().unwrap();
                            for (i, &b) in buf.iter().enumerate() {
                                let byte = at + i as u64;
                                if owner(byte) == t && b != m[byte as usize] {
                                    panic!(
                                        "seed {seed} t{t} op {op}: byte {byte} reads {b:#x}, \
                                         its last write was {:#x} (mode {:?})",
                                        m[byte as usize],
                                        vol.mode()
                                    );
                                }
                            }
                        }
                        7 => {
                            let _ = vol.flush();
                        }
                        _ => {
                            // Read a far line to push lines out under the occupancy cap.
                            let at = 4 * MIB + (rng.next_u64() % 64) * LINE;
                            let _ = read(&vol, at + 1, 100);
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // A thread of its own region [5 MiB, 8 MiB): long unaligned writes (two to four pieces)
    // and reads of them at odd offsets, each checked against its model.
    let long_writer = {
        let (vol, stop) = (vol.clone(), stop.clone());
        std::thread::spawn(move || {
            const BASE: u64 = 5 * MIB;
            let mut own = vec![0u8; (3 * MIB) as usize];
            let mut rng = Rng(seed ^ 0x1f);
            let began = Instant::now();
            for op in 0..300u64 {
                if began.elapsed() > TIME_LIMIT || stop.load(Ordering::Relaxed) {
                    break;
                }
                let at = rng.next_u64() % (MIB + 1000);
                let len = MIB + 1 + rng.next_u64() % (MIB + 500);
                if rng.next_u64().is_multiple_of(3) {
                    let mut buf = vec![0u8; len as usize];
                    vol.read(BASE + at, &mut buf)
                        .unwrap_or_else(|e| panic!("long read: {e}"));
                    if let Some(i) = (0..len as usize).find(|&i| buf[i] != own[at as usize + i]) {
                        panic!(
                            "seed {seed} long op {op}: byte {} of its own region reads {:#x},                              its last write was {:#x} (mode {:?})",
                            BASE + at + i as u64,
                            buf[i],
                            own[at as usize + i],
                            vol.mode()
                        );
                    }
                } else {
                    let d = bytes(&mut rng, len as usize);
                    vol.write(BASE + at, &d, rng.next_u64().is_multiple_of(4))
                        .unwrap_or_else(|e| panic!("long write: {e}"));
                    own[at as usize..(at + len) as usize].copy_from_slice(&d);
                }
            }
            own
        })
    };
    let tuner = {
        let (cache, stop) = (cache.clone(), stop.clone());
        std::thread::spawn(move || {
            let vol = cache.volumes()[0].clone();
            let began = Instant::now();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) && began.elapsed() < TIME_LIMIT {
                match i % 5 {
                    0 => vol.set_occupancy_cap(Some(0.02)),
                    1 => vol.set_dirty_cap(Some(0.01)),
                    2 => {
                        let _ = cache.set_mode(
                            0,
                            CacheMode::WriteThrough,
                            &fast_cleaner(),
                            &mut |_| true,
                        );
                    }
                    3 => {
                        vol.set_occupancy_cap(None);
                        vol.set_dirty_cap(None);
                    }
                    _ => {
                        let _ =
                            cache.set_mode(0, CacheMode::WriteBack, &fast_cleaner(), &mut |_| true);
                    }
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let began = Instant::now();
    while !writers.iter().all(|w| w.is_finished()) || !long_writer.is_finished() {
        assert!(
            began.elapsed() < TIME_LIMIT + Duration::from_secs(30),
            "seed {seed}: requests hang ({} ops)",
            ops.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().expect("writer");
    }
    let own = long_writer.join().expect("long writer");
    tuner.join().expect("tuner");
    cache.stop_cleaner();
    let want = model.lock().unwrap().clone();
    let got = read(&vol, 0, REGION as usize);
    if let Some(i) = (0..REGION as usize).find(|&i| got[i] != want[i]) {
        panic!("seed {seed} line {line}: byte {i} differs at the end");
    }
    vol.flush().expect("flush");
    let (c, b) = (cache_dev.crashed("c", seed), backing.crashed("b", seed + 1));
    drop(vol);
    drop(cache);
    let (cache, _) = common::open_dyn(Arc::new(c), Arc::new(b));
    let got = read(&cache.volumes()[0], 0, REGION as usize);
    if let Some(i) = (0..REGION as usize).find(|&i| got[i] != want[i]) {
        panic!("seed {seed} line {line}: byte {i} differs after a FLUSH and a power cut");
    }
    let got = read(&cache.volumes()[0], 5 * MIB, own.len());
    if let Some(i) = (0..own.len()).find(|&i| got[i] != own[i]) {
        panic!(
            "seed {seed} line {line}: byte {} of the long writes differs after a FLUSH and a \
             power cut",
            5 * MIB + i as u64
        );
    }
}

#[test]
fn r44_4_multi_piece_partial_writes_of_shared_sectors_beside_evictions_and_mode_changes() {
    for seed in 1..=3 {
        multi_piece_stress(seed, LINE);
        multi_piece_stress(seed + 10, SECTOR);
    }
}

#[allow(dead_code)]
fn unused(vol: &Volume) -> u64 {
    counter(vol, "writes")
}
