//! Review 37: the per-volume dirty cap and the cleaner's `Select::Volume`. A capped volume,
//! busy or on a failing disk, must not stop age-based write-back of the others, nor hide a
//! second capped volume; writes around the cap read back exactly, across a power cut and with
//! writers racing at the cap.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{data, MIB};
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{Cache, CleanerConfig};

const LINE: u64 = 64 << 10;
const CACHE: u64 = 16 * MIB;
const SIZES: [u64; 2] = [32 * MIB, 24 * MIB];

fn open(cache_dev: &Arc<CrashDevice>, backings: &[Arc<CrashDevice>; 2]) -> Cache {
    common::open_crash(cache_dev, &[&backings[0], &backings[1]])
}

fn cfg() -> CleanerConfig {
    CleanerConfig {
        high_watermark: 0.95,
        low_watermark: 0.9,
        max_age: Duration::from_secs(1),
        ..CleanerConfig::default()
    }
}

/// Waits up to `limit` for `done`; returns whether it came.
fn within(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// Volume a at its cap, its backing device failing writes: b's dirty data, far past the
/// max age, must still be written back.
fn capped_volume_with_failing_backing(cap: Option<f64>) -> (bool, u64) {
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = Arc::new(open(&cache_dev, &backings));
    let (a, b) = (&cache.volumes()[0], &cache.volumes()[1]);
    a.set_dirty_cap(Some(0.1));
    a.write(0, &data(1, 8 * MIB as usize), false)
        .expect("write a");
    b.write(0, &data(2, MIB as usize), false).expect("write b");
    a.set_dirty_cap(cap);
    assert!(a.stats().dirty_lines > 0 && b.stats().dirty_lines > 0);
    backings[0].fail_writes(true);
    let errors_before = common::counter(a, "backing_errors");
    cache.start_cleaner(cfg());
    let cleaned = within(Duration::from_secs(8), || b.stats().dirty_bytes == 0);
    let errors = common::counter(a, "backing_errors") - errors_before;
    cache.stop_cleaner();
    eprintln!(
        "cap {cap:?}: b dirty {} bytes after 8 s, a's backing write errors meanwhile {errors}",
        b.stats().dirty_bytes
    );
    backings[0].fail_writes(false);
    (cleaned, errors)
}

#[test]
fn control_uncapped_failing_volume_leaves_age_writeback_to_the_other() {
    let (cleaned, _) = capped_volume_with_failing_backing(None);
    assert!(cleaned, "without a cap b's aged data is written back");
}

#[test]
fn a_capped_failing_volume_leaves_age_writeback_to_the_other() {
    let (cleaned, errors) = capped_volume_with_failing_backing(Some(0.1));
    assert!(
        cleaned,
        "b's dirty data, past max_age, was never written back while a sat at its cap \
         ({errors} failed writebacks of a meanwhile)"
    );
}

/// No fault at all: a client keeps volume a at its cap (its writes to new lines); b's dirty
/// data, past the max age, must be written back meanwhile.
#[test]
fn a_busy_capped_volume_leaves_age_writeback_to_the_other() {
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = Arc::new(open(&cache_dev, &backings));
    let (a, b) = (cache.volumes()[0].clone(), cache.volumes()[1].clone());
    a.set_dirty_cap(Some(0.1));
    b.write(0, &data(2, MIB as usize), false).expect("write b");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let buf = data(3, LINE as usize);
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut at = 0;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                a.write(at, &buf, false).expect("write a");
                at = (at + LINE) % SIZES[0];
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    cache.start_cleaner(cfg());
    let cleaned = within(Duration::from_secs(8), || b.stats().dirty_bytes == 0);
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    cache.stop_cleaner();
    assert!(
        cleaned,
        "b's dirty data ({} bytes), past max_age, was never written back while a's writes kept \
         a near its cap (a dirty {} lines of cap {:?})",
        b.stats().dirty_bytes,
        a.stats().dirty_lines,
        a.dirty_cap_lines()
    );
}

/// Random multi-line writes (some sectors zero) to a volume with a tiny cap while the cleaner
/// runs and the other volume writes too: every read matches the model, and after FLUSH and a
/// power cut both volumes are intact.
#[test]
fn capped_volume_reads_back_exactly_across_a_power_cut() {
    use common::Rng;
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = Arc::new(open(&cache_dev, &backings));
    let mut models = [vec![0u8; SIZES[0] as usize], vec![0u8; SIZES[1] as usize]];
    cache.volumes()[0].set_dirty_cap(Some(0.03));
    cache.start_cleaner(CleanerConfig {
        max_age: Duration::from_secs(1),
        ..CleanerConfig::default()
    });
    let mut rng = Rng(37);
    for i in 0..6000u64 {
        let v = if rng.next_u64().is_multiple_of(3) {
            1
        } else {
            0
        };
        let sectors = 1 + rng.next_u64() % 40;
        let len = sectors * 4096;
        let at = (rng.next_u64() % (SIZES[v] / 4096 - sectors)) * 4096;
        let mut buf = data(i * 7 + v as u64, len as usize);
        if rng.next_u64().is_multiple_of(4) {
            let z = (rng.next_u64() % sectors) as usize * 4096;
            buf[z..z + 4096].fill(0);
        }
        let vol = &cache.volumes()[v];
        vol.write(at, &buf, false).expect("write");
        models[v][at as usize..(at + len) as usize].copy_from_slice(&buf);
        if i % 7 == 0 {
            let rl = (1 + rng.next_u64() % 40) * 4096;
            let ra = (rng.next_u64() % (SIZES[v] / 4096 - rl / 4096)) * 4096;
            let mut got = vec![0u8; rl as usize];
            vol.read(ra, &mut got).expect("read");
            assert!(
                got == models[v][ra as usize..(ra + rl) as usize],
                "op {i}: volume {v} read at {ra}+{rl} differs"
            );
        }
    }
    assert!(common::counter(&cache.volumes()[0], "bytes_written_around_full") > 0);
    for v in cache.volumes().iter() {
        v.flush().expect("flush");
    }
    cache.stop_cleaner();
    let crashed_cache = Arc::new(cache_dev.crashed("cache", 5));
    let crashed = [
        Arc::new(backings[0].crashed("backing-a", 6)),
        Arc::new(backings[1].crashed("backing-b", 7)),
    ];
    drop(cache);
    let cache = open(&crashed_cache, &crashed);
    for (v, model) in cache.volumes().iter().zip(&models) {
        let mut got = vec![0u8; model.len()];
        v.read(0, &mut got).expect("read all");
        if let Some(bad) = (0..got.len()).find(|&j| got[j] != model[j]) {
            panic!(
                "after the power cut volume {} differs at byte {bad}",
                v.name()
            );
        }
    }
}

/// Writers racing at the cap on disjoint regions of the capped volume: each reads back its
/// own data; how far past the cap the volume's dirty lines go is reported.
#[test]
fn writers_racing_at_the_cap() {
    use common::Rng;
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = Arc::new(open(&cache_dev, &backings));
    cache.volumes()[0].set_dirty_cap(Some(0.05));
    let cap = cache.volumes()[0].dirty_cap_lines().unwrap();
    cache.start_cleaner(cfg());
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (cache, peak) = (cache.clone(), peak.clone());
            std::thread::spawn(move || {
                let region = SIZES[0] / 4;
                let base = t * region;
                let mut model = vec![0u8; region as usize];
                let mut rng = Rng(100 + t);
                let a = &cache.volumes()[0];
                for i in 0..1500u64 {
                    let sectors = 1 + rng.next_u64() % 32;
                    let len = sectors * 4096;
                    let at = (rng.next_u64() % (region / 4096 - sectors)) * 4096;
                    let buf = data(t * 1_000_000 + i, len as usize);
                    a.write(base + at, &buf, false).expect("write");
                    model[at as usize..(at + len) as usize].copy_from_slice(&buf);
                    peak.fetch_max(a.stats().dirty_lines, Ordering::Relaxed);
                    let mut got = vec![0u8; len as usize];
                    a.read(base + at, &mut got).expect("read");
                    assert!(got == buf, "thread {t} op {i}: read after write differs");
                }
                let mut got = vec![0u8; region as usize];
                a.read(base, &mut got).expect("read all");
                assert!(got == model, "thread {t}: region differs");
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    cache.stop_cleaner();
    eprintln!(
        "cap {cap} lines, peak dirty seen {}",
        peak.load(Ordering::Relaxed)
    );
}

/// Both volumes capped, a's lines unwritable: b near its own cap must still be written back
/// (else every write of b to a new line goes to its disk for as long as a's disk fails).
#[test]
fn the_first_capped_volume_does_not_hide_the_second() {
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = Arc::new(open(&cache_dev, &backings));
    let (a, b) = (&cache.volumes()[0], &cache.volumes()[1]);
    a.set_dirty_cap(Some(0.1));
    b.set_dirty_cap(Some(0.1));
    a.write(0, &data(1, 8 * MIB as usize), false)
        .expect("write a");
    b.write(0, &data(2, 8 * MIB as usize), false)
        .expect("write b");
    backings[0].fail_writes(true);
    cache.start_cleaner(CleanerConfig {
        max_age: Duration::from_secs(3600),
        ..cfg()
    });
    let cap = b.dirty_cap_lines().unwrap();
    let ok = within(Duration::from_secs(6), || {
        b.stats().dirty_lines * 10 < cap * 9
    });
    cache.stop_cleaner();
    backings[0].fail_writes(false);
    assert!(
        ok,
        "b stayed at {} dirty lines of its cap {cap}",
        b.stats().dirty_lines
    );
}
