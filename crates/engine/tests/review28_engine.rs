//! Review 28: attacks on the spanning read (`Volume::serve_spanned`, one backing read for a
//! request whose misses lie in several runs between cached lines). F1 and F2 failed on the
//! first version of it; the rest held and stay as regression tests.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{data, format_dev, open_dyn, reads_of, Rng, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, MemDevice, RecordingDevice};
use ssdcache_engine::{CleanerConfig, Select};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;

fn seed(dev: &dyn BlockDevice, size: u64) -> Vec<u8> {
    common::seed_sectors(dev, size, 3_000_000)
}

/// F1: a latent bad sector on the backing device under a line the cache holds is masked by the
/// cache (the cached line is served from the cache, the misses around it read per run). The
/// first spanning read read the disk over the cached line too and failed the whole request,
/// although every byte of it was available; now a failed span read falls back to the runs.
fn bad_sector_under_cached_line(mode: CacheMode, dirty: bool) {
    const BACKING: u64 = 16 * MIB;
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    let mut model = seed(&*backing, BACKING);
    let cache_dev = Arc::new(MemDevice::new("cache", 32 * MIB));
    format_dev(&*cache_dev, LINE, mode, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let mut line_buf = vec![0u8; LINE as usize];
    for line in (0..8u64).map(|i| 2 * i) {
        vol.read(line * LINE, &mut line_buf).expect("warm-up read");
    }
    if dirty {
        let new = data(77, LINE as usize);
        vol.write(4 * LINE, &new, false).expect("write");
        model[(4 * LINE) as usize..(5 * LINE) as usize].copy_from_slice(&new);
    }
    // A sector of cached line 4 goes bad on the disk.
    backing.fail_reads_in(Some(4 * LINE + SECTOR..4 * LINE + 2 * SECTOR));
    // Each run of misses alone is readable, and so is the cached line (from the cache).
    let mut got = vec![0u8; MIB as usize];
    let r = vol.read(0, &mut got);
    backing.fail_reads_in(None);
    r.expect("read of a range whose every byte is available (cached or readable on disk)");
    assert!(got[..] == model[..MIB as usize], "wrong data");
}

#[test]
fn f1_a_bad_disk_sector_under_a_clean_cached_line_does_not_fail_the_read() {
    bad_sector_under_cached_line(CacheMode::WriteThrough, false);
}

#[test]
fn f1_a_bad_disk_sector_under_a_dirty_cached_line_does_not_fail_the_read() {
    bad_sector_under_cached_line(CacheMode::WriteBack, true);
}

/// F2: an unaligned request whose first and last (partial) lines miss: they are read whole on
/// their own (to cache them whole) and stay out of the span; the first version read them in
/// the span too, so their bytes came from the disk twice.
#[test]
fn f2_no_disk_sector_is_read_twice_by_one_request() {
    const BACKING: u64 = 16 * MIB;
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let model = seed(&*mem, BACKING);
    let backing = Arc::new(RecordingDevice::new(mem));
    let cache_dev = Arc::new(MemDevice::new("cache", 32 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let mut line_buf = vec![0u8; LINE as usize];
    for line in [1u64, 3, 5, 7] {
        vol.read(line * LINE, &mut line_buf).expect("warm-up read");
    }
    backing.clear();
    // From the middle of line 0 to the middle of line 8.
    let (at, len) = (LINE / 2, 8 * LINE);
    let mut got = vec![0u8; len as usize];
    vol.read(at, &mut got).expect("read");
    assert!(
        got[..] == model[at as usize..(at + len) as usize],
        "wrong data"
    );
    let reads = reads_of(&backing.ops());
    let mut seen = vec![0u8; (BACKING / SECTOR) as usize];
    for &(o, l) in &reads {
        for s in o / SECTOR..(o + l) / SECTOR {
            seen[s as usize] += 1;
        }
    }
    assert!(
        seen.iter().all(|&n| n <= 1),
        "some disk sectors read twice by one request: {reads:?}"
    );
}

/// Differential model test: write-back, random writes (4 KiB multiples, any alignment to
/// lines), random reads, prefetches, clean batches and FLUSH, a small cache (evictions),
/// cutoff 0; a short last line. Every read is compared with the model.
fn model_run(mode: CacheMode, seed_n: u64, backing_size: u64, with_cleaner_thread: bool) {
    let backing = Arc::new(MemDevice::new("backing", backing_size));
    let mut model = seed(&*backing, backing_size);
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, mode, backing_size, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    let stop = Arc::new(AtomicBool::new(false));
    let cleaner = with_cleaner_thread.then(|| {
        let (cache, stop) = (cache.clone(), stop.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(60) {
                let _ = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
                std::thread::yield_now();
            }
        })
    });
    let mut rng = Rng(seed_n);
    let sectors = backing_size / SECTOR;
    let t0 = Instant::now();
    for i in 0..4000u64 {
        if t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        let r = rng.next_u64() % 100;
        let start = rng.next_u64() % sectors;
        let max = (sectors - start).min(64);
        let n = 1 + rng.next_u64() % max;
        let (at, len) = (start * SECTOR, n * SECTOR);
        if r < 35 {
            let d = data(seed_n * 1_000_000 + i, len as usize);
            vol.write(at, &d, false).expect("write");
            model[at as usize..(at + len) as usize].copy_from_slice(&d);
        } else if r < 90 {
            let mut got = vec![0u8; len as usize];
            vol.read(at, &mut got).expect("read");
            if got[..] != model[at as usize..(at + len) as usize] {
                let bad = (0..n)
                    .filter(|&s| {
                        let a = (s * SECTOR) as usize;
                        got[a..a + SECTOR as usize]
                            != model[at as usize + a..at as usize + a + SECTOR as usize]
                    })
                    .map(|s| at + s * SECTOR)
                    .collect::<Vec<_>>();
                panic!("op {i}: read [{at}, +{len}) wrong at sectors {bad:?}");
            }
        } else if r < 94 {
            vol.prefetch(at, len).expect("prefetch");
        } else if r < 97 {
            let _ = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
        } else {
            vol.flush().expect("flush");
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = cleaner {
        t.join().unwrap();
    }
    let mut all = vec![0u8; backing_size as usize];
    vol.read(0, &mut all).expect("final read");
    assert!(all == model, "final read differs");
}

#[test]
fn model_write_back_short_last_line() {
    for s in 1..4 {
        model_run(CacheMode::WriteBack, s, 40 * MIB + 5 * SECTOR, false);
    }
}

#[test]
fn model_write_through() {
    for s in 10..13 {
        model_run(CacheMode::WriteThrough, s, 40 * MIB + 5 * SECTOR, false);
    }
}

#[test]
fn model_write_back_with_cleaner_thread() {
    for s in 20..23 {
        model_run(CacheMode::WriteBack, s, 40 * MIB + 5 * SECTOR, true);
    }
}

/// Random op on a model, returning whether a read was checked.
#[allow(clippy::too_many_arguments)]
fn random_op(
    vol: &ssdcache_engine::Volume,
    rng: &mut Rng,
    model: &mut [u8],
    base: u64,
    size: u64,
    tag: u64,
    reads_may_fail: bool,
) -> Result<(), String> {
    let sectors = size / SECTOR;
    let r = rng.next_u64() % 100;
    let start = rng.next_u64() % sectors;
    let max = (sectors - start).min(96);
    let n = 1 + rng.next_u64() % max;
    let (at, len) = (base + start * SECTOR, n * SECTOR);
    let m = |x: u64| (x - base) as usize;
    if r < 30 {
        let d = data(tag, len as usize);
        match vol.write(at, &d, false) {
            Ok(()) => model[m(at)..m(at + len)].copy_from_slice(&d),
            Err(e) => return Err(format!("write [{at}, +{len}) failed: {e}")),
        }
    } else if r < 97 {
        let mut got = vec![0u8; len as usize];
        match vol.read(at, &mut got) {
            Ok(()) => {
                if got[..] != model[m(at)..m(at + len)] {
                    let bad = (0..n)
                        .filter(|&s| {
                            let a = (s * SECTOR) as usize;
                            got[a..a + SECTOR as usize]
                                != model[m(at) + a..m(at) + a + SECTOR as usize]
                        })
                        .map(|s| at + s * SECTOR)
                        .collect::<Vec<_>>();
                    return Err(format!("read [{at}, +{len}) wrong at sectors {bad:?}"));
                }
            }
            Err(e) if reads_may_fail => {
                let _ = e;
            }
            Err(e) => return Err(format!("read [{at}, +{len}) failed: {e}")),
        }
    } else {
        vol.flush().map_err(|e| format!("flush: {e}"))?;
    }
    Ok(())
}

/// Several client threads, each on its own region (a model each), a cleaner thread, and
/// checksum pages mostly out of RAM (`read_map_paged` pages in on hits).
#[test]
fn concurrent_regions_cleaner_and_checksum_paging() {
    const BACKING: u64 = 48 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let model = seed(&*backing, BACKING);
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let _ = cache.set_checksum_memory(4096);
    let cache = Arc::new(cache);
    let stop = Arc::new(AtomicBool::new(false));
    let cleaner = {
        let (cache, stop) = (cache.clone(), stop.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(90) {
                let _ = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let threads: Vec<_> = (0..3u64)
        .map(|t| {
            let cache = cache.clone();
            let region = BACKING / 3 / LINE * LINE;
            let base = t * region;
            let mut m = model[base as usize..(base + region) as usize].to_vec();
            std::thread::spawn(move || {
                let vol = cache.volumes()[0].clone();
                let mut rng = Rng(100 + t);
                let t0 = Instant::now();
                for i in 0..6000u64 {
                    if t0.elapsed() > Duration::from_secs(60) {
                        break;
                    }
                    random_op(&vol, &mut rng, &mut m, base, region, (t << 40) | i, false)
                        .map_err(|e| format!("thread {t} op {i}: {e}"))?;
                }
                let mut all = vec![0u8; region as usize];
                vol.read(base, &mut all).map_err(|e| e.to_string())?;
                if all != m {
                    return Err(format!("thread {t}: final read differs"));
                }
                Ok::<(), String>(())
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    cleaner.join().unwrap();
    for r in results {
        r.unwrap();
    }
}

/// Cache read faults on part of the data area: in write-through every read must succeed and
/// be right; in write-back a read may fail (dirty data unreadable) but never be wrong, and
/// once the faults end every read succeeds and is right.
fn faults_run(mode: CacheMode, seed_n: u64) {
    const BACKING: u64 = 40 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let mut model = seed(&*backing, BACKING);
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, mode, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let layout = cache.layout();
    let mut rng = Rng(seed_n);
    let t0 = Instant::now();
    for i in 0..6000u64 {
        if t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        let faulty = (i / 500) % 2 == 1;
        if i % 500 == 0 {
            let area = layout.cache_size - layout.data_offset;
            let from = layout.data_offset + rng.next_u64() % (area / 2) / SECTOR * SECTOR;
            cache_dev.fail_reads_in(faulty.then_some(from..from + area / 8));
        }
        if i % 500 == 499 {
            cache_dev.fail_reads_in(None);
        }
        let may_fail = mode == CacheMode::WriteBack && cache_dev_faulty(i);
        random_op(
            &vol,
            &mut rng,
            &mut model,
            0,
            BACKING,
            seed_n << 32 | i,
            may_fail,
        )
        .unwrap_or_else(|e| panic!("seed {seed_n} op {i} ({:?}): {e}", vol.state()));
    }
    cache_dev.fail_reads_in(None);
    let mut all = vec![0u8; BACKING as usize];
    vol.read(0, &mut all).expect("final read");
    assert!(all == model, "final read differs");
}

fn cache_dev_faulty(i: u64) -> bool {
    (i / 500) % 2 == 1
}

#[test]
fn faults_write_through() {
    for s in 1..3 {
        faults_run(CacheMode::WriteThrough, s);
    }
}

#[test]
fn faults_write_back() {
    for s in 5..7 {
        faults_run(CacheMode::WriteBack, s);
    }
}

/// Restart: dirty and clean lines, a clean shutdown and an unclean one (the cache device's
/// written image), then spanning reads compared with the model.
#[test]
fn restart_then_spanning_reads() {
    const BACKING: u64 = 40 * MIB;
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    let mut model = seed(&*backing, BACKING);
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let mut rng = Rng(77);
    for i in 0..3000u64 {
        random_op(&vol, &mut rng, &mut model, 0, BACKING, 77 << 32 | i, false).unwrap();
    }
    vol.flush().unwrap();
    drop(vol);
    // Unclean: reopen from what both devices hold (everything written, flushed).
    let c2 = Arc::new(CrashDevice::from_image("cache", cache_dev.written_image()));
    let b2 = Arc::new(CrashDevice::from_image("backing", backing.written_image()));
    drop(cache);
    let (cache, _) = open_dyn(c2.clone(), b2.clone());
    let vol = cache.volumes()[0].clone();
    let mut rng = Rng(78);
    for i in 0..3000u64 {
        random_op(&vol, &mut rng, &mut model, 0, BACKING, 78 << 32 | i, false).unwrap();
    }
    let mut all = vec![0u8; BACKING as usize];
    vol.read(0, &mut all).expect("final read");
    assert!(all == model, "final read differs");
}

/// Dense spanning: single-line reads warm lines, small writes leave lines partly valid,
/// big unaligned reads (4..24 lines) span them; optional cache read faults toggled.
fn dense_run(mode: CacheMode, seed_n: u64, faults: bool, cleaner: bool) {
    const BACKING: u64 = 24 * MIB + 3 * SECTOR;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let mut model = seed(&*backing, BACKING);
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, mode, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let layout = cache.layout();
    let mut rng = Rng(seed_n);
    let sectors = BACKING / SECTOR;
    let t0 = Instant::now();
    let mut faulty = false;
    for i in 0..8000u64 {
        if t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        if faults && i % 300 == 0 {
            faulty = !faulty && rng.next_u64().is_multiple_of(2);
            let area = layout.cache_size - layout.data_offset;
            let from = layout.data_offset + rng.next_u64() % (area / 2) / SECTOR * SECTOR;
            cache_dev.fail_reads_in(faulty.then_some(from..from + area / 4));
        }
        let r = rng.next_u64() % 100;
        let (at, len) = if r < 25 {
            let line = rng.next_u64() % (BACKING / LINE);
            (line * LINE, LINE)
        } else if r < 45 {
            let s = rng.next_u64() % (sectors - 3);
            (s * SECTOR, (1 + rng.next_u64() % 3) * SECTOR)
        } else {
            let n = (4 + rng.next_u64() % 21) * (LINE / SECTOR) + rng.next_u64() % 16;
            let n = n.min(sectors);
            let s = rng.next_u64() % (sectors - n + 1);
            (s * SECTOR, n * SECTOR)
        };
        let range = at as usize..(at + len) as usize;
        if (25..45).contains(&r) {
            let d = data(seed_n << 32 | i, len as usize);
            vol.write(at, &d, false).expect("write");
            model[range].copy_from_slice(&d);
        } else {
            let mut got = vec![0u8; len as usize];
            match vol.read(at, &mut got) {
                Ok(()) => assert!(
                    got[..] == model[range],
                    "seed {seed_n} op {i}: read [{at}, +{len}) wrong (faulty {faulty}, {:?})",
                    vol.state()
                ),
                Err(e) => assert!(
                    faulty && mode == CacheMode::WriteBack,
                    "seed {seed_n} op {i}: read [{at}, +{len}) failed: {e}"
                ),
            }
        }
        if cleaner && i % 50 == 0 {
            let _ = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
        }
        if i % 200 == 0 {
            vol.flush().expect("flush");
        }
    }
    cache_dev.fail_reads_in(None);
    let mut all = vec![0u8; BACKING as usize];
    vol.read(0, &mut all).expect("final read");
    assert!(all == model, "final read differs");
}

#[test]
fn zz_dense() {
    for s in 1..3 {
        dense_run(CacheMode::WriteThrough, s, false, false);
    }
    for s in 1..3 {
        dense_run(CacheMode::WriteBack, s, false, true);
    }
    for s in 1..4 {
        dense_run(CacheMode::WriteThrough, s, true, false);
    }
    for s in 1..4 {
        dense_run(CacheMode::WriteBack, s, true, true);
    }
}

fn versioned_sector(index: u64, version: u64) -> Vec<u8> {
    let mut v = data(
        index.wrapping_mul(1_000_003) ^ version.wrapping_mul(7_919),
        SECTOR as usize,
    );
    v[..8].copy_from_slice(&index.to_le_bytes());
    v[8..16].copy_from_slice(&version.to_le_bytes());
    v
}

/// One writer (versioned sectors), readers doing spanning reads of the same lines, a cleaner
/// thread: every sector read must be whole and of a version between the last one whose write
/// returned before the read began and the last one whose write began before it returned.
fn versioned_run(mode: CacheMode, secs: u64) {
    use std::sync::atomic::AtomicU64;
    const BACKING: u64 = 24 * MIB;
    let sectors = BACKING / SECTOR;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let mut init = Vec::with_capacity(BACKING as usize);
    for s in 0..sectors {
        init.extend_from_slice(&versioned_sector(s, 0));
    }
    backing.write_at(&init, 0).unwrap();
    drop(init);
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, mode, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let cache = Arc::new(cache);
    let started: Arc<Vec<AtomicU64>> = Arc::new((0..sectors).map(|_| AtomicU64::new(0)).collect());
    let committed: Arc<Vec<AtomicU64>> =
        Arc::new((0..sectors).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut handles = vec![];
    {
        let (cache, stop) = (cache.clone(), stop.clone());
        handles.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let _ = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
                std::thread::sleep(Duration::from_micros(300));
            }
            Ok::<u64, String>(0)
        }));
    }
    {
        let (cache, stop, started, committed) = (
            cache.clone(),
            stop.clone(),
            started.clone(),
            committed.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let vol = cache.volumes()[0].clone();
            let mut rng = Rng(991);
            let mut version = 0u64;
            let mut n_ops = 0;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                version += 1;
                let n = 1 + rng.next_u64() % 20;
                let s0 = rng.next_u64() % (sectors - n);
                let mut buf = Vec::with_capacity((n * SECTOR) as usize);
                for s in s0..s0 + n {
                    buf.extend_from_slice(&versioned_sector(s, version));
                    started[s as usize].store(version, Ordering::SeqCst);
                }
                vol.write(s0 * SECTOR, &buf, rng.next_u64().is_multiple_of(10))
                    .map_err(|e| format!("write: {e}"))?;
                for s in s0..s0 + n {
                    committed[s as usize].store(version, Ordering::SeqCst);
                }
                if version.is_multiple_of(64) {
                    vol.flush().map_err(|e| format!("flush: {e}"))?;
                }
                n_ops += 1;
            }
            Ok(n_ops)
        }));
    }
    for t in 0..3u64 {
        let (cache, stop, started, committed) = (
            cache.clone(),
            stop.clone(),
            started.clone(),
            committed.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let vol = cache.volumes()[0].clone();
            let mut rng = Rng(500 + t);
            let mut n_ops = 0;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let r = rng.next_u64() % 100;
                let n = if r < 30 {
                    LINE / SECTOR
                } else {
                    (2 + rng.next_u64() % 14) * (LINE / SECTOR) + rng.next_u64() % 16
                };
                let s0 = if r < 30 {
                    rng.next_u64() % (sectors / 16) * 16
                } else {
                    rng.next_u64() % (sectors - n)
                };
                let before: Vec<u64> = (s0..s0 + n)
                    .map(|s| committed[s as usize].load(Ordering::SeqCst))
                    .collect();
                let mut got = vec![0u8; (n * SECTOR) as usize];
                vol.read(s0 * SECTOR, &mut got).map_err(|e| format!("read: {e}"))?;
                for (k, chunk) in got.chunks(SECTOR as usize).enumerate() {
                    let s = s0 + k as u64;
                    let idx = u64::from_le_bytes(chunk[..8].try_into().unwrap());
                    let ver = u64::from_le_bytes(chunk[8..16].try_into().unwrap());
                    let after = started[s as usize].load(Ordering::SeqCst);
                    if idx != s || chunk != &versioned_sector(s, ver)[..] {
                        return Err(format!("reader {t}: sector {s} torn/misplaced (idx {idx} ver {ver})"));
                    }
                    if ver < before[k] || ver > after {
                        return Err(format!(
                            "reader {t}: sector {s} read [{}, +{n} sectors): version {ver}, expected in [{}, {after}]",
                            s0, before[k]
                        ));
                    }
                }
                n_ops += 1;
            }
            Ok(n_ops)
        }));
    }
    let mut errs = vec![];
    let mut counts = vec![];
    for h in handles {
        match h.join().unwrap() {
            Ok(n) => counts.push(n),
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                errs.push(e)
            }
        }
    }
    eprintln!("{mode:?}: ops {counts:?}");
    assert!(errs.is_empty(), "{errs:?}");
}

#[test]
fn zz_versioned_write_through() {
    versioned_run(CacheMode::WriteThrough, 8);
}

#[test]
fn zz_versioned_write_back() {
    versioned_run(CacheMode::WriteBack, 8);
}
