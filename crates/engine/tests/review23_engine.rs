//! Review 23: the map's lock as crossbeam's `ShardedLock` (cedaf91): more threads than its
//! eight shards, short-lived threads, and a writer beside a storm of readers. Nothing broke;
//! these stay as regression tests. Every test is bounded: a deadlock fails on a watchdog, it
//! does not hang. (The review's check of `SectorBitmap::range` and `union_with` against the
//! loops they replaced, every range of 256 sectors, is in `format/src/lines.rs`'s unit test.)

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use common::{data, setup, Rng};
use ssdcache_device::BlockDevice;
use ssdcache_engine::{Cache, CleanerConfig, Volume};
use ssdcache_format::CacheMode;

const SECTOR: usize = 4096;
const LINE: u64 = 64 << 10;
const LIMIT: Duration = Duration::from_secs(60);

/// Runs `f` on a thread; panics (names a deadlock) if it does not end within `limit`.
fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{what}: no end within {limit:?} (deadlock?)"),
    }
}

/// What block `block` holds at `version` (0: never written).
fn block_data(block: u64, version: u64) -> Vec<u8> {
    if version == 0 {
        vec![0; SECTOR]
    } else {
        data((block << 20) | version, SECTOR)
    }
}

fn check_block(got: &[u8], block: u64, version: u64, what: &str) {
    assert!(
        got == block_data(block, version),
        "{what} of block {block} v{version} returned other data"
    );
}

fn cleaner_cfg() -> CleanerConfig {
    CleanerConfig {
        high_watermark: 0.05,
        low_watermark: 0.01,
        max_age: Duration::from_millis(1),
        idle_after: Duration::from_millis(1),
        busy_pause: Duration::ZERO,
        ..CleanerConfig::default()
    }
}

/// 24 client threads (three to a shard), each owning every 24th 4 KiB block of 2 MiB, in a
/// 2 MiB cache (evictions), write-back, cleaner running; reads both by `Volume::read` and by
/// `begin_hit`/`finish_hit`. Each thread checks every read against its own model; at the end
/// a drain and a check of the backing device.
#[test]
fn r23_threads_past_eight_shards_hits_writes_cleaner_keep_data() {
    bounded("24-thread stress", LIMIT, || {
        const THREADS: usize = 24;
        const SPAN: u64 = 48 << 20;
        let (cache_dev, backing, cache) = setup(16 << 20, SPAN, LINE, CacheMode::WriteBack);
        let cache = Arc::new(cache);
        cache.start_cleaner(cleaner_cfg());
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let blocks = SPAN / SECTOR as u64;
        let mut handles = Vec::new();
        for t in 0..THREADS {
            let (cache, cache_dev, stop, ops) =
                (cache.clone(), cache_dev.clone(), stop.clone(), ops.clone());
            handles.push(thread::spawn(move || {
                let vol = cache.volumes()[0].clone();
                let mine: Vec<u64> = (0..blocks).filter(|b| *b as usize % THREADS == t).collect();
                let mut version = vec![0u64; mine.len()];
                let mut rng = Rng(t as u64 + 1);
                let mut buf = vec![0u8; SECTOR];
                while !stop.load(Ordering::Relaxed) {
                    let i = (rng.next_u64() % mine.len() as u64) as usize;
                    let off = mine[i] * SECTOR as u64;
                    match rng.next_u64() % 8 {
                        0..=2 => {
                            version[i] += 1;
                            vol.write(off, &block_data(mine[i], version[i]), false)
                                .expect("write");
                        }
                        3 => vol.flush().expect("flush"),
                        4 | 5 => {
                            if let Some(plan) = vol.begin_hit(off, SECTOR as u64, true) {
                                let ok: Vec<bool> = plan
                                    .device_ranges()
                                    .map(|(at, r)| cache_dev.read_at(&mut buf[r], at).is_ok())
                                    .collect();
                                if vol.finish_hit(&plan, &buf, &ok) {
                                    let what = format!("thread {t}'s hit");
                                    check_block(&buf, mine[i], version[i], &what);
                                }
                            }
                        }
                        _ => {
                            vol.read(off, &mut buf).expect("read");
                            check_block(&buf, mine[i], version[i], &format!("thread {t}'s read"));
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                (mine, version)
            }));
        }
        thread::sleep(Duration::from_secs(6));
        stop.store(true, Ordering::Relaxed);
        let models: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("client"))
            .collect();
        eprintln!("r23 stress: {} ops", ops.load(Ordering::Relaxed));
        cache.drain(&cleaner_cfg(), &mut |_| true).expect("drain");
        cache.stop_cleaner();
        assert_eq!(cache.dirty_lines(), 0);
        let mut buf = vec![0u8; SECTOR];
        for (mine, version) in models {
            for (b, v) in mine.iter().zip(version) {
                backing.read_at(&mut buf, b * SECTOR as u64).unwrap();
                check_block(&buf, *b, v, "the backing device after the drain");
            }
        }
        cache.shutdown().expect("shutdown");
    });
}

/// A write-back cache of 16 MiB over 4 MiB with its first `blocks` 4 KiB blocks written.
fn cache_with_blocks(blocks: u64) -> (Cache, Arc<Volume>) {
    let (_cache_dev, _backing, cache) = setup(16 << 20, 4 << 20, LINE, CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    for b in 0..blocks {
        vol.write(b * SECTOR as u64, &data(b, SECTOR), false)
            .expect("write");
    }
    (cache, vol)
}

/// Hits from 4000 short-lived threads (16 at a time): each registers a crossbeam thread index
/// (global mutex, HashMap) on its first read lock and frees it on exit. Must stay correct and
/// not be slow; a writer runs throughout.
#[test]
fn r23_short_lived_threads_register_and_hit() {
    bounded("short-lived threads", LIMIT, || {
        let (_cache, vol) = cache_with_blocks(64);
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (vol, stop) = (vol.clone(), stop.clone());
            thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    vol.write(
                        (100 + n % 64) * SECTOR as u64,
                        &data(1000 + n, SECTOR),
                        false,
                    )
                    .unwrap();
                    n += 1;
                }
                n
            })
        };
        let start = Instant::now();
        for round in 0..250u64 {
            let hs: Vec<_> = (0..16u64)
                .map(|k| {
                    let vol = vol.clone();
                    thread::spawn(move || {
                        let b = (round * 16 + k) % 64;
                        let mut buf = vec![0u8; SECTOR];
                        vol.read(b * SECTOR as u64, &mut buf).unwrap();
                        assert!(buf == data(b, SECTOR), "block {b}");
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        }
        let took = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        let writes = writer.join().unwrap();
        eprintln!("r23 short-lived: 4000 threads in {took:?}, {writes} writes beside");
    });
}

/// A writer's latency while 16 threads (two to a shard) hit the same lines without pause:
/// the writer locks eight shards in turn and must not starve.
#[test]
fn r23_writer_not_starved_by_reader_storm() {
    bounded("writer under read storm", LIMIT, || {
        let (_cache, vol) = cache_with_blocks(32);
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..16u64)
            .map(|k| {
                let (vol, stop) = (vol.clone(), stop.clone());
                thread::spawn(move || {
                    let mut buf = vec![0u8; SECTOR];
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let b = (k + n) % 32;
                        vol.read(b * SECTOR as u64, &mut buf).unwrap();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let mut worst = Duration::ZERO;
        let mut writes = 0u64;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            let t = Instant::now();
            vol.write(
                (64 + writes % 32) * SECTOR as u64,
                &data(5000 + writes, SECTOR),
                false,
            )
            .unwrap();
            worst = worst.max(t.elapsed());
            writes += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let reads: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
        eprintln!("r23 storm: {writes} writes (worst {worst:?}) beside {reads} reads");
        assert!(worst < Duration::from_secs(2), "a write waited {worst:?}");
    });
}
