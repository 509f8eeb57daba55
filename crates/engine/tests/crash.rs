//! Simulated power cuts in write-back mode. Both devices keep a written and a durable image;
//! at a crash point each write since the last flush is kept, dropped or torn (per 4 KiB
//! sector). After every crash point the cache is reopened (journal replay) and every sector the
//! workload touched is checked against the durability contract (docs/design.md §9):
//! - it reads as the last value made durable (a FUA write, or a write completed before a
//!   completed flush) or as a value written after that, never older, never garbage;
//! - it reads the same again after all dirty data is written back and the cache restarts
//!   without its clean lines (no flip-flop).
//!
//! CI runs at least 10,000 crash points. The long run (1,000,000):
//!   SSDCACHE_CRASH_POINTS=1000000 cargo test --release -p ssdcache-engine --test crash -- --nocapture

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ssdcache_device::{BlockDevice, CrashDevice, SplitMix64 as Rng};
use ssdcache_engine::{format, read_superblock, Cache, CleanerConfig, NewVolume, Select};
use ssdcache_format::{BackingIdentity, BackingKind, CacheMode};

const SECTOR: u64 = 4096;
const CACHE: u64 = 16 << 20;
const BACKING: u64 = 24 << 20;
const LINE: u64 = 16 << 10;
/// The workload writes every 4th sector of the backing device: all lines are touched, more
/// than fit in the cache, so lines are evicted and the cache fills with dirty data.
const STRIDE: u64 = 4;
const SLOTS: u64 = BACKING / SECTOR / STRIDE;
const OPS_PER_WORKLOAD: usize = 400;
const CRASH_EVERY: usize = 8;
const SEEDS_PER_CRASH: u64 = 4;

fn identity() -> BackingIdentity {
    BackingIdentity {
        kind: BackingKind::File,
        size: BACKING,
        path: "crash-backing".into(),
        stable_id: "crash".into(),
        st_dev: 0,
        st_ino: 0,
        st_rdev: 0,
        btime_ns: 0,
    }
}

/// A sector's content: its tag in the first 8 bytes, the rest derived from it, so a reader can
/// tell which write it holds and that it is whole. Tag 0 is all zeroes.
fn content(tag: u64) -> Vec<u8> {
    if tag == 0 {
        return vec![0; SECTOR as usize];
    }
    let mut v = Vec::with_capacity(SECTOR as usize);
    let mut x = tag;
    while v.len() < SECTOR as usize {
        v.extend_from_slice(&x.to_le_bytes());
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
    }
    v
}

fn tag_of(data: &[u8]) -> Option<u64> {
    let tag = u64::from_le_bytes(data[..8].try_into().ok()?);
    (content(tag) == data).then_some(tag)
}

/// What each touched sector may read as after a crash.
#[derive(Default)]
struct Contract {
    /// Sector -> (durable tag, tags written since).
    sectors: BTreeMap<u64, (u64, Vec<u64>)>,
}

impl Contract {
    fn write(&mut self, sector: u64, tag: u64, fua: bool) {
        let e = self.sectors.entry(sector).or_insert((0, Vec::new()));
        if fua {
            *e = (tag, Vec::new());
        } else {
            e.1.push(tag);
        }
    }
    fn flush(&mut self) {
        for e in self.sectors.values_mut() {
            if let Some(&last) = e.1.last() {
                *e = (last, Vec::new());
            }
        }
    }
    fn latest(&self, sector: u64) -> u64 {
        self.sectors
            .get(&sector)
            .map_or(0, |(d, p)| *p.last().unwrap_or(d))
    }
    fn allows(&self, sector: u64, tag: u64) -> bool {
        self.sectors
            .get(&sector)
            .map_or(tag == 0, |(d, p)| *d == tag || p.contains(&tag))
    }
}

fn open(cache: Arc<CrashDevice>, backing: Arc<CrashDevice>) -> Cache {
    let sb = read_superblock(&*cache).expect("superblock after crash");
    Cache::open(cache, sb, vec![backing as Arc<dyn BlockDevice>])
        .expect("open after crash")
        .0
}

/// Reads every touched sector (plus untouched neighbours, which must be zero).
fn read_all(cache: &Cache, sectors: &BTreeSet<u64>) -> BTreeMap<u64, u64> {
    let vol = &cache.volumes()[0];
    let mut out = BTreeMap::new();
    let mut buf = vec![0u8; SECTOR as usize];
    for &s in sectors {
        vol.read(s * SECTOR, &mut buf).expect("read after crash");
        let tag = tag_of(&buf).unwrap_or(u64::MAX);
        out.insert(s, tag);
    }
    out
}

struct Stats {
    points: AtomicU64,
    dirty_recovered: AtomicU64,
}

/// One seeded workload with a crash check every few operations.
fn workload(seed: u64, stats: &Stats) {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    format(
        &*cache_dev,
        LINE,
        NewVolume {
            name: "v".into(),
            mode: CacheMode::WriteBack,
            backing: identity(),
            sequential_cutoff: 0,
            policy: 0,
            admission: Default::default(),
        },
    )
    .expect("format");
    cache_dev.flush().expect("flush");
    let mut cache = open(cache_dev.clone(), backing.clone());
    let mut rng = Rng(seed);
    let mut contract = Contract::default();
    let mut touched = BTreeSet::new();
    let mut next_tag = seed << 32 | 1;
    let cfg = CleanerConfig {
        batch_lines: 16,
        ..CleanerConfig::default()
    };
    for op in 0..OPS_PER_WORKLOAD {
        let vol = cache.volumes()[0].clone();
        match rng.below(100) {
            0..=59 => {
                let first = rng.below(SLOTS - 8);
                let n = 1 + rng.below(4);
                let fua = rng.below(10) == 0;
                // Sectors first*STRIDE, (first+1)*STRIDE, ...: one request per sector run.
                for i in 0..n {
                    let s = (first + i) * STRIDE;
                    let tag = next_tag;
                    next_tag += 1;
                    vol.write(s * SECTOR, &content(tag), fua).expect("write");
                    contract.write(s, tag, fua);
                    touched.insert(s);
                }
            }
            60..=64 => {
                let s = rng.below(SLOTS) * STRIDE;
                vol.write_zeroes(s * SECTOR, SECTOR, false)
                    .expect("write zeroes");
                contract.write(s, 0, false);
                touched.insert(s);
            }
            65..=74 => {
                vol.flush().expect("flush");
                contract.flush();
            }
            75..=84 => {
                cache
                    .clean_batch(&cfg, 4, Select::All)
                    .expect("writeback batch");
            }
            85..=86 => {
                cache.shutdown().expect("shutdown");
                drop(vol);
                cache = open(cache_dev.clone(), backing.clone());
            }
            _ => {
                let s = rng.below(SLOTS) * STRIDE;
                let mut buf = vec![0u8; SECTOR as usize];
                vol.read(s * SECTOR, &mut buf).expect("read");
                assert_eq!(
                    tag_of(&buf),
                    Some(contract.latest(s)),
                    "seed {seed} op {op}: live read of sector {s} is not the last write"
                );
            }
        }
        if op % CRASH_EVERY == CRASH_EVERY - 1 {
            for k in 0..SEEDS_PER_CRASH {
                check_crash(
                    &cache_dev, &backing, &contract, &touched, seed, op, k, stats,
                );
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_crash(
    cache_dev: &CrashDevice,
    backing: &CrashDevice,
    contract: &Contract,
    touched: &BTreeSet<u64>,
    seed: u64,
    op: usize,
    k: u64,
    stats: &Stats,
) {
    let crash_seed = seed.wrapping_mul(1_000_003) ^ (op as u64) << 8 ^ k;
    let cache_img = Arc::new(cache_dev.crashed("cache", crash_seed));
    let backing_img = Arc::new(backing.crashed("backing", crash_seed ^ 0x5555));
    let mut check: BTreeSet<u64> = touched.clone();
    // A few never-written sectors must read as zeroes.
    check.extend([1, 2, BACKING / SECTOR - 1]);
    let cache = open(cache_img.clone(), backing_img.clone());
    stats
        .dirty_recovered
        .fetch_add(cache.dirty_lines(), Ordering::Relaxed);
    let first = read_all(&cache, &check);
    for (&s, &tag) in &first {
        assert!(
            contract.allows(s, tag),
            "seed {seed} op {op} crash {k}: sector {s} reads tag {tag:#x}, allowed {:?}",
            contract.sectors.get(&s)
        );
    }
    // Write everything back, then restart without clean lines: every sector must come back
    // the same from the backing device.
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .expect("drain after crash");
    drop(cache);
    let cache = open(cache_img, backing_img);
    let second = read_all(&cache, &check);
    assert_eq!(
        first, second,
        "seed {seed} op {op} crash {k}: sectors changed across writeback and restart"
    );
    stats.points.fetch_add(1, Ordering::Relaxed);
}

#[test]
fn write_back_survives_simulated_crashes() {
    let wanted: u64 = std::env::var("SSDCACHE_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_240);
    let per_workload = (OPS_PER_WORKLOAD / CRASH_EVERY) as u64 * SEEDS_PER_CRASH;
    let workloads = wanted.div_ceil(per_workload);
    let stats = Arc::new(Stats {
        points: AtomicU64::new(0),
        dirty_recovered: AtomicU64::new(0),
    });
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let next = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (stats, next) = (stats.clone(), next.clone());
            std::thread::spawn(move || loop {
                let w = next.fetch_add(1, Ordering::Relaxed);
                if w >= workloads {
                    break;
                }
                workload(w + 1, &stats);
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().is_ok(), "a crash workload failed (see above)");
    }
    let points = stats.points.load(Ordering::Relaxed);
    println!(
        "simulated crash points checked: {points} ({workloads} workloads; {} dirty lines recovered in all)",
        stats.dirty_recovered.load(Ordering::Relaxed)
    );
    assert!(points >= wanted);
}
