//! The engine against a plain byte array: random reads, writes, trims, write-zeroes, flushes,
//! prefetches, writeback batches, clean restarts and crashes (restart without shutdown), in
//! every mode.

use std::sync::Arc;

mod common;

use common::setup;
use proptest::prelude::*;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{Cache, CleanerConfig, Select};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const BACKING: u64 = 32 << 20;
const CACHE: u64 = 16 << 20;
const LINE: u64 = 64 << 10;

#[derive(Debug, Clone)]
enum Op {
    /// Consecutive 64 KiB requests: past the cutoff they bypass the cache.
    Stream {
        sector: u64,
        requests: u64,
        write: bool,
        seed: u8,
    },
    Write {
        sector: u64,
        sectors: u64,
        seed: u8,
        fua: bool,
    },
    Read {
        sector: u64,
        sectors: u64,
    },
    Trim {
        sector: u64,
        sectors: u64,
    },
    Zero {
        sector: u64,
        sectors: u64,
    },
    Prefetch {
        sector: u64,
        sectors: u64,
    },
    /// Byte offsets and lengths (issue 13): partial sectors are read, modified and written.
    WriteBytes {
        offset: u64,
        len: u64,
        seed: u8,
        fua: bool,
    },
    ReadBytes {
        offset: u64,
        len: u64,
    },
    ZeroBytes {
        offset: u64,
        len: u64,
    },
    Flush,
    /// One writeback batch (write-back mode).
    Clean,
    CleanRestart,
    Crash,
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    let total = BACKING / SECTOR;
    // Mostly small requests in a hot region so lines are reused and evicted.
    prop_oneof![
        (0..total / 4, 1..=4u64),
        (0..total - 64, 1..=64u64),
        (0..total - 600, 1..=600u64),
    ]
}

/// A byte range, mostly small and in the hot region.
fn byte_range() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        (0..BACKING / 4, 1..=4096u64),
        (0..BACKING - (1 << 20), 1..=(1u64 << 20)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (range(), any::<u8>(), any::<bool>()).prop_map(|((sector, sectors), seed, fua)| Op::Write { sector, sectors, seed, fua }),
        6 => range().prop_map(|(sector, sectors)| Op::Read { sector, sectors }),
        1 => range().prop_map(|(sector, sectors)| Op::Trim { sector, sectors }),
        1 => range().prop_map(|(sector, sectors)| Op::Zero { sector, sectors }),
        1 => range().prop_map(|(sector, sectors)| Op::Prefetch { sector, sectors }),
        1 => (0..BACKING / SECTOR - 16 * 40, 1..40u64, any::<bool>(), any::<u8>())
            .prop_map(|(sector, requests, write, seed)| Op::Stream { sector, requests, write, seed }),
        3 => (byte_range(), any::<u8>(), any::<bool>()).prop_map(|((offset, len), seed, fua)| Op::WriteBytes { offset, len, seed, fua }),
        3 => byte_range().prop_map(|(offset, len)| Op::ReadBytes { offset, len }),
        1 => byte_range().prop_map(|(offset, len)| Op::ZeroBytes { offset, len }),
        1 => Just(Op::Flush),
        1 => Just(Op::Clean),
        1 => Just(Op::CleanRestart),
        1 => Just(Op::Crash),
    ]
}

fn pattern(seed: u8, len: usize, offset: u64) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add(((offset as usize + i) / 512) as u8))
        .collect()
}

fn open(cache_dev: &Arc<MemDevice>, backing: &Arc<MemDevice>) -> Cache {
    common::open(cache_dev, backing).0
}

fn run(mode: CacheMode, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let (cache_dev, backing, mut cache) = setup(CACHE, BACKING, LINE, mode);
    let mut model = vec![0u8; BACKING as usize];
    for op in ops {
        let vol = cache.volumes()[0].clone();
        match op {
            Op::Write {
                sector,
                sectors,
                seed,
                fua,
            } => {
                let (off, len) = (sector * SECTOR, (sectors * SECTOR) as usize);
                let data = pattern(seed, len, off);
                vol.write(off, &data, fua).expect("write");
                model[off as usize..off as usize + len].copy_from_slice(&data);
            }
            Op::Read { sector, sectors } => {
                let (off, len) = (sector * SECTOR, (sectors * SECTOR) as usize);
                let mut buf = vec![0xAAu8; len];
                vol.read(off, &mut buf).expect("read");
                prop_assert!(
                    buf == model[off as usize..off as usize + len],
                    "read mismatch at sector {} len {} in {:?}",
                    sector,
                    sectors,
                    mode
                );
            }
            // The memory backing device zeroes on discard, so the model does too.
            Op::Trim { sector, sectors } => {
                vol.trim(sector * SECTOR, sectors * SECTOR, false)
                    .expect("trim");
                model[(sector * SECTOR) as usize..((sector + sectors) * SECTOR) as usize].fill(0);
            }
            Op::Zero { sector, sectors } => {
                vol.write_zeroes(sector * SECTOR, sectors * SECTOR, false)
                    .expect("zero");
                model[(sector * SECTOR) as usize..((sector + sectors) * SECTOR) as usize].fill(0);
            }
            Op::Prefetch { sector, sectors } => vol
                .prefetch(sector * SECTOR, sectors * SECTOR)
                .expect("prefetch"),
            Op::Stream {
                sector,
                requests,
                write,
                seed,
            } => {
                for i in 0..requests {
                    let off = (sector + 16 * i) * SECTOR;
                    let range = off as usize..off as usize + 65536;
                    if write {
                        let data = pattern(seed, 65536, off);
                        vol.write(off, &data, false).expect("stream write");
                        model[range].copy_from_slice(&data);
                    } else {
                        let mut buf = vec![0u8; 65536];
                        vol.read(off, &mut buf).expect("stream read");
                        prop_assert!(
                            buf == model[range],
                            "stream read mismatch at sector {}",
                            sector + 16 * i
                        );
                    }
                }
            }
            Op::WriteBytes {
                offset,
                len,
                seed,
                fua,
            } => {
                let data = pattern(seed, len as usize, offset);
                vol.write(offset, &data, fua).expect("byte write");
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
            }
            Op::ReadBytes { offset, len } => {
                let mut buf = vec![0xAAu8; len as usize];
                vol.read(offset, &mut buf).expect("byte read");
                prop_assert!(
                    buf == model[offset as usize..(offset + len) as usize],
                    "read mismatch at byte {} len {} in {:?}",
                    offset,
                    len,
                    mode
                );
            }
            Op::ZeroBytes { offset, len } => {
                vol.write_zeroes(offset, len, false).expect("byte zero");
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            Op::Flush => vol.flush().expect("flush"),
            Op::Clean => {
                cache
                    .clean_batch(&CleanerConfig::default(), 4, Select::All)
                    .expect("clean");
            }
            Op::CleanRestart => {
                cache.shutdown().expect("shutdown");
                drop(vol);
                cache = open(&cache_dev, &backing);
            }
            Op::Crash => {
                // Memory devices lose nothing, but the journal loses what was not committed:
                // flushing first makes the model exact (crash_tests.rs checks unflushed loss).
                if mode == CacheMode::WriteBack {
                    vol.flush().expect("flush before crash");
                }
                drop(vol);
                cache = open(&cache_dev, &backing);
            }
        }
    }
    if mode == CacheMode::WriteBack {
        cache
            .drain(&CleanerConfig::default(), &mut |_| true)
            .expect("drain");
        prop_assert_eq!(cache.dirty_bytes(), 0);
    }
    // The backing device alone holds everything (after the drain in write-back).
    prop_assert!(
        backing.snapshot() == model,
        "backing differs from the model"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn write_through_matches_model(ops in proptest::collection::vec(op(), 1..120)) {
        run(CacheMode::WriteThrough, ops)?;
    }

    #[test]
    fn write_around_matches_model(ops in proptest::collection::vec(op(), 1..120)) {
        run(CacheMode::WriteAround, ops)?;
    }

    #[test]
    fn write_back_matches_model(ops in proptest::collection::vec(op(), 1..160)) {
        run(CacheMode::WriteBack, ops)?;
    }

    /// Every replacement policy under the write-back model (evictions skip dirty and busy
    /// lines, so the policy's predicate handling is what is tested here).
    #[test]
    fn every_policy_matches_model_in_write_back(
        policy in 0u32..ssdcache_engine::policy::NAMES.len() as u32,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        common::POLICY.with(|p| p.set(policy));
        let result = run(CacheMode::WriteBack, ops);
        common::POLICY.with(|p| p.set(0));
        result?;
    }

    /// 2-hit admission in every mode: lines missed once are served without being cached,
    /// write misses not admitted go around the cache (in write-back too); data stays right.
    #[test]
    fn two_hit_admission_matches_model_in_every_mode(
        mode in prop_oneof![
            Just(CacheMode::WriteBack),
            Just(CacheMode::WriteThrough),
            Just(CacheMode::WriteAround),
            Just(CacheMode::PassThrough),
        ],
        ops in proptest::collection::vec(op(), 1..140),
    ) {
        common::ADMISSION.with(|a| a.set(Admission::NHit(2)));
        let result = run(mode, ops);
        common::ADMISSION.with(|a| a.set(Admission::Always));
        result?;
    }

    #[test]
    fn pass_through_matches_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(CacheMode::PassThrough, ops)?;
    }
}

#[test]
fn warm_after_clean_restart_cold_after_crash() {
    let (cache_dev, backing, cache) = setup(CACHE, BACKING, LINE, CacheMode::WriteThrough);
    let mut buf = vec![0u8; 1 << 20];
    cache.volumes()[0].read(0, &mut buf).expect("read");
    cache.shutdown().expect("shutdown");
    drop(cache);
    let (cache, report) = common::open(&cache_dev, &backing);
    assert!(report.warm);
    assert_eq!(report.restored_bytes, 1 << 20);
    let vol = cache.volumes()[0].clone();
    let hits = vol.counters().0[2];
    vol.read(0, &mut buf).expect("read");
    assert_eq!(
        vol.counters().0[2],
        hits + 1,
        "second read must hit after a clean restart"
    );
    drop((vol, cache));
    let (cache, report) = common::open(&cache_dev, &backing);
    assert!(!report.warm, "a crash must discard the cache");
    assert_eq!(cache.volumes()[0].stats().bytes_cached, 0);
}

/// Threads write and verify interleaved sectors of the same lines: no torn or stale data.
#[test]
fn concurrent_requests_on_shared_lines() {
    let (_cache_dev, _backing, cache) = setup(CACHE, BACKING, LINE, CacheMode::WriteThrough);
    let threads = 4u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let vol = cache.volumes()[0].clone();
            std::thread::spawn(move || {
                for round in 0..300u64 {
                    // Sectors t, t+4, t+8, ... across 8 MiB (more than fits with the others).
                    let sector = (round * 37 % 512) * threads + t;
                    let data = pattern((round + t) as u8, SECTOR as usize, sector * SECTOR);
                    vol.write(sector * SECTOR, &data, false).expect("write");
                    let mut back = vec![0u8; SECTOR as usize];
                    vol.read(sector * SECTOR, &mut back).expect("read");
                    assert!(back == data, "thread {t} round {round}: stale or torn data");
                }
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().is_ok());
    }
}
