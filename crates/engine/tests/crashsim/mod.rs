//! The crash simulator shared by the crash test targets: seeded write-back workloads on a
//! cache and backing device that keep written and durable images ([`CrashDevice`] on one
//! [`CrashClock`]), power cuts captured at device ops chosen from the seed (inside commits,
//! compactions, superblock writes, checkpoints and writeback batches, not only between
//! requests), and every touched sector checked against the durability contract
//! (docs/design.md §4.1) after each cut, then again after writeback, restarts and a second
//! cut (no flip-flop).
//!
//! `crash.rs` runs one thread per workload with clean restarts in between; `crash_concurrent.rs`
//! runs 2-4 threads under shuttle's randomized scheduler (the engine built with its `shuttle`
//! feature), every device call a scheduling point, so a seed replays the same interleaving.
//!
//! [`CrashDevice`]: ssdcache_devsim::CrashDevice
//! [`CrashClock`]: ssdcache_devsim::CrashClock

#![allow(dead_code)] // each target uses a different part

pub mod check;
pub mod contract;
pub mod coverage;
pub mod workload;

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ssdcache_device::SplitMix64 as Rng;
use ssdcache_format::{BackingIdentity, BackingKind};

use coverage::Stats;
use workload::{Plan, Run};

#[cfg(feature = "shuttle")]
use shuttle::thread_local;

pub const SECTOR: u64 = 4096;

/// A sector's content: its tag in the first 8 bytes, the rest derived from it, so a reader can
/// tell which write it holds and that it is whole. Tag 0 is all zeroes.
pub fn content(tag: u64) -> Vec<u8> {
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

/// The tag of a sector's content, `None` when it is no whole tagged sector.
pub fn tag_of(data: &[u8]) -> Option<u64> {
    let tag = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    (content(tag) == data).then_some(tag)
}

pub fn identity(size: u64) -> BackingIdentity {
    BackingIdentity {
        kind: BackingKind::File,
        size,
        path: "crash-backing".into(),
        stable_id: "crash".into(),
        st_dev: 0,
        st_ino: 0,
        st_rdev: 0,
        btime_ns: 0,
    }
}

/// What a workload thread is doing; each device op is labelled with it for the coverage
/// counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Activity {
    Other = 0,
    Setup,
    Write,
    FuaWrite,
    Stream,
    Zeroes,
    Trim,
    Flush,
    Read,
    Writeback,
    Commit,
    ModeChange,
    Restart,
}

impl Activity {
    const ALL: [Activity; 13] = [
        Activity::Other,
        Activity::Setup,
        Activity::Write,
        Activity::FuaWrite,
        Activity::Stream,
        Activity::Zeroes,
        Activity::Trim,
        Activity::Flush,
        Activity::Read,
        Activity::Writeback,
        Activity::Commit,
        Activity::ModeChange,
        Activity::Restart,
    ];

    pub fn from_label(label: u8) -> Activity {
        Self::ALL
            .get(usize::from(label))
            .copied()
            .unwrap_or(Activity::Other)
    }

    /// A client request (what an NBD client sends).
    pub fn is_client(self) -> bool {
        matches!(
            self,
            Activity::Write
                | Activity::FuaWrite
                | Activity::Stream
                | Activity::Zeroes
                | Activity::Trim
                | Activity::Flush
                | Activity::Read
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Activity::Other => "other",
            Activity::Setup => "setup",
            Activity::Write => "write",
            Activity::FuaWrite => "FUA write",
            Activity::Stream => "stream write",
            Activity::Zeroes => "write zeroes",
            Activity::Trim => "trim",
            Activity::Flush => "flush",
            Activity::Read => "read",
            Activity::Writeback => "writeback batch",
            Activity::Commit => "commit",
            Activity::ModeChange => "mode change",
            Activity::Restart => "clean stop and restart",
        }
    }
}

thread_local! {
    /// What this (workload) thread is doing now.
    static ACTIVITY: Cell<u8> = const { Cell::new(0) };
    /// Which workload thread this is (for traces).
    static WORKER: Cell<u8> = const { Cell::new(0) };
}

pub fn current_worker() -> u8 {
    WORKER.with(|w| w.get())
}

pub fn set_worker(t: usize) {
    WORKER.with(|w| w.set(t as u8));
}

pub fn current_activity() -> u8 {
    ACTIVITY.with(|a| a.get())
}

pub fn with_activity<T>(activity: Activity, f: impl FnOnce() -> T) -> T {
    ACTIVITY.with(|a| a.set(activity as u8));
    let out = f();
    ACTIVITY.with(|a| a.set(0));
    out
}

/// Which crash test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One thread per workload, clean restarts in between.
    Sequential,
    /// 2-4 threads per workload under shuttle.
    Concurrent,
}

impl Kind {
    fn target(self) -> &'static str {
        match self {
            Kind::Sequential => "--test crash",
            Kind::Concurrent => "--features shuttle --test crash_concurrent",
        }
    }

    fn plan(self, seed: u64) -> Plan {
        match self {
            Kind::Sequential => Plan::new(seed, 1, 240, 5),
            Kind::Concurrent => Plan::new(seed, 2 + (seed % 3) as usize, 70, 6),
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.parse() {
        Ok(n) => Some(n),
        Err(_) => panic!("{name}={v:?} is not a number"),
    }
}

/// Runs one workload: the requests, then every crash point's checks.
fn run_workload(kind: Kind, seed: u64, stats: &Stats) {
    let plan = kind.plan(seed);
    stats.cover(plan.policy, plan.line_size);
    stats.add(&stats.threads, plan.threads as u64);
    let (run, cache) = Run::setup(plan);
    match kind {
        Kind::Sequential => {
            let mut cache = cache;
            let mut rng = Rng(seed ^ 0x7a11);
            for _ in 0..run.plan.ops_per_thread {
                if run.step(&cache, 0, &mut rng) {
                    cache = run.restart(cache);
                }
            }
        }
        Kind::Concurrent => concurrent::requests(&run, cache),
    }
    let captured = run.clock.take_captured();
    check::check_run(&run, captured, stats);
    stats.add(&stats.workloads, 1);
}

#[cfg(feature = "shuttle")]
mod concurrent {
    use super::*;
    use ssdcache_engine::Cache;

    /// Each thread makes its requests; every device call is a scheduling point.
    pub fn requests(run: &Arc<Run>, cache: Cache) {
        run.clock.set_before_op(shuttle::thread::yield_now);
        let cache = Arc::new(cache);
        let handles: Vec<_> = (0..run.plan.threads)
            .map(|t| {
                let (run, cache) = (run.clone(), cache.clone());
                shuttle::thread::spawn(move || {
                    set_worker(t);
                    let mut rng = Rng(run.plan.seed ^ (t as u64 + 1) << 40);
                    for _ in 0..run.plan.ops_per_thread {
                        run.step(&cache, t, &mut rng);
                    }
                })
            })
            .collect();
        for h in handles {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    }

    /// One workload under shuttle's random scheduler seeded with the workload's seed.
    pub fn run_scheduled(seed: u64, stats: &Arc<Stats>) {
        let mut config = shuttle::Config::new();
        config.stack_size = 4 << 20;
        config.max_steps = shuttle::MaxSteps::FailAfter(200_000_000);
        config.failure_persistence = shuttle::FailurePersistence::None;
        // Its warning: it treats every atomic ordering as SeqCst. The engine's orderings are
        // not what this test is about (its locks and the order of its device calls are).
        config.silence_warnings = true;
        let scheduler = shuttle::scheduler::RandomScheduler::new_from_seed(seed, 1);
        let stats = stats.clone();
        shuttle::Runner::new(scheduler, config)
            .run(move || run_workload(Kind::Concurrent, seed, &stats));
    }
}

#[cfg(not(feature = "shuttle"))]
mod concurrent {
    use super::*;
    use ssdcache_engine::Cache;

    pub fn requests(_: &Arc<Run>, _: Cache) {
        panic!("concurrent workloads need the engine's shuttle feature");
    }

    pub fn run_scheduled(_: u64, _: &Arc<Stats>) {
        panic!("concurrent workloads need the engine's shuttle feature");
    }
}

/// Runs the workloads of these seeds, one after another: seeds that once caught a defect the
/// default run's seeds miss, kept so a regression fails every CI run.
#[allow(dead_code)] // used by crash.rs only
pub fn run_seeds(kind: Kind, seeds: &[u64]) {
    let stats = Stats::default();
    for &seed in seeds {
        let outcome = catch_unwind(AssertUnwindSafe(|| run_workload(kind, seed, &stats)));
        assert!(
            outcome.is_ok(),
            "crash workload seed {seed} failed ({:?}); replay it with:\n  \
             SSDCACHE_CRASH_SEED={seed} cargo test --release -p ssdcache-engine {} -- --nocapture",
            kind.plan(seed),
            kind.target()
        );
    }
    println!(
        "{}",
        stats.report(&format!("pinned seeds {seeds:?} ({kind:?})"))
    );
}

/// Runs workloads (seeds 1, 2, ..., or from `SSDCACHE_CRASH_FIRST_SEED`) on every core until
/// `default_points` crash points were checked (`SSDCACHE_CRASH_POINTS` overrides), or only
/// `SSDCACHE_CRASH_SEED`'s workload.
/// A failing workload prints its seed and the command that replays it.
pub fn run_test(kind: Kind, default_points: u64) {
    let wanted = env_u64("SSDCACHE_CRASH_POINTS").unwrap_or(default_points);
    let only = env_u64("SSDCACHE_CRASH_SEED");
    let first_seed = env_u64("SSDCACHE_CRASH_FIRST_SEED").unwrap_or(1);
    // Every workload checks dozens of points: this many workloads is far more than needed.
    let max_workloads = wanted.max(1);
    // Far more than a run needs on 2 cores (about 3 ms a point), so only a hang ends one.
    let time_limit = Duration::from_secs(1200 + wanted / 20);
    let stats = Arc::new(Stats::default());
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let failed: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let began = Instant::now();
    let workers = if only.is_some() {
        1
    } else {
        std::thread::available_parallelism().map_or(2, |n| n.get())
    };
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                if stop.load(Ordering::Relaxed)
                    || stats.points.load(Ordering::Relaxed) >= wanted && only.is_none()
                    || began.elapsed() > time_limit
                {
                    break;
                }
                let w = next.fetch_add(1, Ordering::Relaxed);
                if w >= max_workloads || (only.is_some() && w > 0) {
                    break;
                }
                let seed = only.unwrap_or(first_seed + w);
                let outcome = catch_unwind(AssertUnwindSafe(|| match kind {
                    Kind::Sequential => run_workload(kind, seed, &stats),
                    Kind::Concurrent => concurrent::run_scheduled(seed, &stats),
                }));
                if outcome.is_err() {
                    eprintln!(
                        "crash workload seed {seed} failed ({:?}); replay it with:\n  \
                         SSDCACHE_CRASH_SEED={seed} cargo test --release -p ssdcache-engine {} \
                         -- --nocapture",
                        kind.plan(seed),
                        kind.target()
                    );
                    failed.lock().unwrap_or_else(|p| p.into_inner()).push(seed);
                    stop.store(true, Ordering::Relaxed);
                }
            });
        }
    });
    let elapsed: Duration = began.elapsed();
    println!(
        "{} in {:.1} s",
        stats.report(&format!("crash test ({kind:?})")),
        elapsed.as_secs_f64()
    );
    let failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    assert!(
        failed.is_empty(),
        "crash workloads failed: seeds {failed:?} (replay commands above)"
    );
    let points = stats.points.load(Ordering::Relaxed);
    assert!(
        only.is_some() || points >= wanted,
        "only {points} of {wanted} crash points were checked (time limit {} s)",
        time_limit.as_secs()
    );
}
