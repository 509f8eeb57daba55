//! One seeded workload: its plan (policy, line size, journal size, threads, faults, where the
//! power is cut), the requests each thread makes, and the log of events the contract is
//! rebuilt from.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ssdcache_device::{BlockDevice, SplitMix64 as Rng};
use ssdcache_devsim::{CrashClock, CrashDevice};
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{
    format_with_journal, read_superblock, Cache, CleanerConfig, NewVolume, Select,
};
use ssdcache_format::{CacheMode, Layout};

use super::contract::{Contract, Event, Value};
use super::{content, identity, tag_of, with_activity, Activity, SECTOR};

/// Sectors are owned in runs of this many: run `r` belongs to thread `r % threads`, so every
/// sector has one writer, while lines (up to 256 sectors) are shared by the threads.
pub const RUN: u64 = 8;
/// Sectors at the end of the backing device no request touches: they must read as zeroes.
const UNTOUCHED_RUNS: u64 = 2;

/// Everything a seed decides about a workload.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    pub threads: usize,
    pub ops_per_thread: usize,
    pub policy: u32,
    pub line_size: u64,
    pub cache_size: u64,
    pub backing_size: u64,
    pub journal_blocks: u64,
    pub sequential_cutoff: u64,
    pub admission: Admission,
    /// Clean stops and restarts in the middle (one thread only: a restart needs every
    /// request stopped).
    pub restarts: bool,
    /// Mean gap between crash points, in device ops.
    pub crash_gap: u64,
    /// Op numbers (after setup) that fail with EIO.
    pub faults: Vec<u64>,
    /// The cache device's flush that fails (counting from the first after setup), if any:
    /// most cache flushes are a commit's, before or after its journal write.
    pub failing_cache_flush: Option<u32>,
    /// Likewise for the backing device.
    pub failing_backing_flush: Option<u32>,
    /// The first of the runs most requests go to (`HOT_RUNS` per thread, interleaved), so
    /// sectors are written back, dirtied again, written around and zeroed over and over.
    pub hot_start: u64,
    /// Metadata pages of checksums kept in RAM (`Cache::set_checksum_memory`), or `None` for
    /// the default (every page of these small caches): with 1 to 3, nearly every request
    /// reads a page and every change soon writes one, so crash points fall inside page-ins
    /// and page writes too.
    pub checksum_frames: Option<u64>,
    /// The volume's occupancy cap (`Volume::set_occupancy_cap`) as a share of the cache, set
    /// at each open; with one, the workload's write-back steps also change it now and then.
    pub occupancy_cap: Option<f64>,
}

/// Hot runs per thread.
const HOT_RUNS: u64 = 4;

const LINE_SIZES: [u64; 3] = [4 << 10, 64 << 10, 1 << 20];

impl Plan {
    /// Rotates policy and line size so 3 × (number of policies) consecutive seeds cover
    /// every pair.
    pub fn new(seed: u64, threads: usize, ops_per_thread: usize, crash_gap: u64) -> Plan {
        let mut rng = Rng(seed ^ 0x005e_ed0f_c4a5_u64);
        let policies = ssdcache_engine::policy::NAMES.len() as u64;
        let policy = (seed % policies) as u32;
        let line_size = LINE_SIZES[((seed / policies) % 3) as usize];
        let (cache_size, backing_size) = match line_size {
            l if l >= 1 << 20 => (72 << 20, 80 << 20),
            l if l >= 64 << 10 => (16 << 20, 24 << 20),
            _ => (16 << 20, 16 << 20),
        };
        let journal_blocks = smallest_journal(cache_size, line_size) + rng.below(6);
        let sequential_cutoff = if rng.below(2) == 0 { 0 } else { 8 << 10 };
        let admission = if rng.below(4) == 0 {
            Admission::NHit(2)
        } else {
            Admission::Always
        };
        // About two device ops per request.
        let expected_ops = (threads * ops_per_thread) as u64 * 2;
        let faults = if rng.below(2) == 0 {
            let mut f = Vec::new();
            for _ in 0..1 + rng.below(4) {
                let at = 1 + rng.below(expected_ops);
                f.extend(at..at + 1 + rng.below(3));
            }
            f
        } else {
            Vec::new()
        };
        let failing_cache_flush = (rng.below(4) == 0).then(|| rng.below(60) as u32);
        let failing_backing_flush = (rng.below(8) == 0).then(|| rng.below(30) as u32);
        // From the seed alone (not the generator), so earlier seeds' other choices stay.
        let checksum_frames = match (seed / 3) % 4 {
            0 => None,
            frames => Some(frames),
        };
        // From the seed alone too; a quarter of the seeds (not the pinned 179 and 2791).
        let occupancy_cap = ((seed / 5) % 4 == 1).then(|| [0.05, 0.2][((seed / 20) % 2) as usize]);
        let runs = backing_size / SECTOR / RUN - UNTOUCHED_RUNS;
        let hot_start = rng.below(runs - HOT_RUNS * threads as u64);
        let hot_start = hot_start - hot_start % threads as u64;
        Plan {
            seed,
            threads,
            ops_per_thread,
            policy,
            line_size,
            cache_size,
            backing_size,
            journal_blocks,
            sequential_cutoff,
            admission,
            restarts: threads == 1,
            // Checking a cut of a cache of 1 MiB lines refills dozens of them: fewer cuts.
            failing_cache_flush,
            failing_backing_flush,
            hot_start,
            checksum_frames,
            occupancy_cap,
            crash_gap: if line_size >= 1 << 20 {
                5 * crash_gap
            } else {
                crash_gap
            },
            faults,
        }
    }
}

/// The smallest journal write-back accepts (two compactions and a block), so compactions run
/// every few commits.
pub fn smallest_journal(cache: u64, line: u64) -> u64 {
    (3..1 << 16)
        .find(|&blocks| Layout::with_journal_blocks(cache, line, blocks).is_ok())
        .unwrap_or(1 << 16)
}

/// A workload in progress: devices on one clock, the event log and the live contract.
pub struct Run {
    pub plan: Plan,
    pub clock: CrashClock,
    pub cache_dev: Arc<CrashDevice>,
    pub backing: Arc<CrashDevice>,
    pub layout: Layout,
    /// Ops the setup (format and first open) took; crash points and faults come after.
    pub setup_ops: u64,
    /// Every request step, stamped with the clock's op count when it happened.
    events: Mutex<Vec<(u64, Event)>>,
    /// The worker thread of each event (for traces).
    workers: Mutex<Vec<u8>>,
    live: Mutex<Contract>,
    next_tag: AtomicU64,
    next_flush: AtomicU64,
    first_fault: u64,
    pub untouched: Vec<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a request completed.
type Outcome = bool;

impl Run {
    /// Formats and opens the cache; the clock starts cutting power after this.
    pub fn setup(plan: Plan) -> (Arc<Run>, Cache) {
        // Unsalted ghost fingerprints, so a seed replays the same policy decisions.
        ssdcache_engine::policy::use_fixed_fingerprints();
        let clock = CrashClock::new();
        let cache_dev = Arc::new(clock.device("cache", plan.cache_size));
        let backing = Arc::new(clock.device("backing", plan.backing_size));
        clock.keep_log();
        clock.set_labeler(super::current_activity);
        let volume = NewVolume {
            name: "v".into(),
            mode: CacheMode::WriteBack,
            backing: identity(plan.backing_size),
            sequential_cutoff: plan.sequential_cutoff,
            policy: plan.policy,
            admission: plan.admission,
        };
        let cache = with_activity(Activity::Setup, || {
            format_with_journal(&*cache_dev, plan.line_size, plan.journal_blocks, volume)
                .expect("format");
            open(&cache_dev, &backing, &plan)
        });
        let layout = cache.layout();
        let setup_ops = clock.ops();
        let mut rng = Rng(plan.seed ^ 0xc_4a54_c10c);
        // Crash points: gaps of 1..2*gap ops, up to far past any workload's end.
        let mut at = setup_ops;
        let horizon = setup_ops + 64 * (plan.threads * plan.ops_per_thread) as u64 + 10_000;
        let mut points = Vec::new();
        while at < horizon {
            at += 1 + rng.below(2 * plan.crash_gap.max(1));
            points.push(at);
        }
        clock.crash_at(points);
        clock.fail_at(plan.faults.iter().map(|f| setup_ops + f));
        let mut first_fault = plan.faults.iter().min().map_or(u64::MAX, |f| setup_ops + f);
        if let Some(n) = plan.failing_cache_flush {
            cache_dev.fail_flush_after(n);
            first_fault = setup_ops;
        }
        if let Some(n) = plan.failing_backing_flush {
            backing.fail_flush_after(n);
            first_fault = setup_ops;
        }
        let sectors = plan.backing_size / SECTOR;
        let untouched = (0..4)
            .map(|_| sectors - 1 - rng.below(UNTOUCHED_RUNS * RUN))
            .collect();
        let run = Run {
            plan,
            clock,
            cache_dev,
            backing,
            layout,
            setup_ops,
            events: Mutex::new(Vec::new()),
            workers: Mutex::new(Vec::new()),
            live: Mutex::new(Contract::default()),
            next_tag: AtomicU64::new(1),
            next_flush: AtomicU64::new(1),
            first_fault,
            untouched,
        };
        (Arc::new(run), cache)
    }

    pub fn events(&self) -> Vec<(u64, Event)> {
        lock(&self.events).clone()
    }

    /// With `SSDCACHE_CRASH_TRACE` set: the events of `sector`, every FLUSH, and every device
    /// op up to `until`, for finding out why a check failed.
    pub fn trace(&self, log: &[ssdcache_devsim::OpRecord], sector: u64, until: u64) -> String {
        if std::env::var_os("SSDCACHE_CRASH_TRACE").is_none() {
            return "(set SSDCACHE_CRASH_TRACE=1 for the history)".into();
        }
        let events = lock(&self.events);
        let workers = lock(&self.workers);
        let mut lines = Vec::new();
        for ((stamp, e), w) in events.iter().zip(workers.iter()) {
            let relevant = match e {
                Event::Start { sector: s, .. } | Event::Done { sector: s, .. } => *s == sector,
                _ => true,
            };
            if relevant && *stamp <= until + 2 {
                lines.push((*stamp, 0, format!("  after op {stamp}: thread {w}: {e:?}")));
            }
        }
        for r in log.iter().filter(|r| r.op <= until + 2) {
            let dev = if r.device == 0 { "cache" } else { "backing" };
            lines.push((
                r.op,
                1,
                format!(
                    "  op {}: {dev} {:?} {}+{}{} [{}]",
                    r.op,
                    r.kind,
                    r.offset,
                    r.len,
                    if r.failed { " FAILED" } else { "" },
                    super::Activity::from_label(r.label).name()
                ),
            ));
        }
        lines.sort_by_key(|l| (l.0, l.1));
        let text: Vec<String> = lines.into_iter().map(|l| l.2).collect();
        format!("history:\n{}", text.join("\n"))
    }

    fn log(&self, event: Event) {
        let stamp = self.clock.ops();
        lock(&self.live).apply(&event);
        lock(&self.events).push((stamp, event));
        lock(&self.workers).push(super::current_worker());
    }

    /// Whether an injected fault may have hit by now (errors are expected from then on).
    fn faults_reached(&self) -> bool {
        self.clock.ops() >= self.first_fault
    }

    /// A request's outcome: an error is a test failure unless a fault was injected before it.
    fn outcome<T>(&self, r: ssdcache_engine::Result<T>, what: &str) -> Outcome {
        match r {
            Ok(_) => true,
            Err(_) if self.faults_reached() => false,
            Err(e) => panic!(
                "seed {}: {what} failed with no I/O error injected: {e}",
                self.plan.seed
            ),
        }
    }

    fn tag(&self) -> u64 {
        self.plan.seed << 24 | self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    /// Sectors `first..first + count` inside one of thread `t`'s runs.
    fn own_range(&self, t: usize, rng: &mut Rng) -> (u64, u64) {
        let threads = self.plan.threads as u64;
        let runs = self.plan.backing_size / SECTOR / RUN - UNTOUCHED_RUNS;
        let run = t as u64
            + threads
                * if rng.below(10) < 7 {
                    self.plan.hot_start / threads + rng.below(HOT_RUNS)
                } else {
                    rng.below(runs / threads)
                };
        if rng.below(4) == 0 {
            return (run * RUN, RUN);
        }
        let at = rng.below(RUN);
        (run * RUN + at, (1 + rng.below(2)).min(RUN - at))
    }

    /// Writes `values` (one per sector) from `first`, logging each sector's start and end.
    fn write(
        &self,
        first: u64,
        values: &[Value],
        activity: Activity,
        request: impl FnOnce() -> ssdcache_engine::Result<()>,
        fua: bool,
    ) {
        for (i, &value) in values.iter().enumerate() {
            self.log(Event::Start {
                sector: first + i as u64,
                value,
            });
        }
        let ok = self.outcome(with_activity(activity, request), activity.name());
        for i in 0..values.len() as u64 {
            self.log(Event::Done {
                sector: first + i,
                ok,
                fua,
            });
        }
    }

    fn tagged_write(&self, cache: &Cache, first: u64, count: u64, fua: bool, activity: Activity) {
        let tags: Vec<u64> = (0..count).map(|_| self.tag()).collect();
        let mut buf = Vec::with_capacity((count * SECTOR) as usize);
        for &t in &tags {
            buf.extend_from_slice(&content(t));
        }
        let values: Vec<Value> = tags.iter().map(|&t| Value::Tag(t)).collect();
        let vol = &cache.volumes()[0];
        self.write(
            first,
            &values,
            activity,
            || vol.write(first * SECTOR, &buf, fua),
            fua,
        );
    }

    fn flush(&self, cache: &Cache) {
        let id = self.next_flush.fetch_add(1, Ordering::Relaxed);
        self.log(Event::FlushStart { id });
        let vol = &cache.volumes()[0];
        let ok = self.outcome(with_activity(Activity::Flush, || vol.flush()), "flush");
        self.log(Event::FlushDone { id, ok });
    }

    /// Reads one of thread `t`'s runs and checks every sector against the live contract.
    fn read_own(&self, cache: &Cache, t: usize, rng: &mut Rng) {
        let (first, count) = self.own_range(t, rng);
        let mut buf = vec![0u8; (count * SECTOR) as usize];
        let vol = &cache.volumes()[0];
        let r = with_activity(Activity::Read, || vol.read(first * SECTOR, &mut buf));
        if !self.outcome(r, "read") {
            return;
        }
        let live = lock(&self.live);
        for (i, data) in buf.chunks(SECTOR as usize).enumerate() {
            let sector = first + i as u64;
            let tag = tag_of(data).unwrap_or(u64::MAX);
            if !live.allows_live(sector, tag) {
                let until = self.clock.ops();
                panic!(
                    "seed {}: live read of sector {sector} returned {tag:#x}; {}\n{}",
                    self.plan.seed,
                    live.describe(sector),
                    self.trace(&self.clock.take_log(), sector, until)
                );
            }
        }
    }

    /// One random request of thread `t`. Returns true when it asks for a clean stop and
    /// restart, which the caller does (single-threaded workloads only).
    pub fn step(&self, cache: &Cache, t: usize, rng: &mut Rng) -> bool {
        let vol = &cache.volumes()[0];
        match rng.below(100) {
            0..=39 => {
                let (first, count) = self.own_range(t, rng);
                let fua = rng.below(10) == 0;
                let activity = if fua {
                    Activity::FuaWrite
                } else {
                    Activity::Write
                };
                self.tagged_write(cache, first, count, fua, activity);
            }
            40..=45 => {
                // A sequential stream through a run, one sector per request: past the cutoff
                // it bypasses the cache (written around, dropping dirty copies).
                let (first, _) = self.own_range(t, rng);
                let start = first - first % RUN;
                for s in start..start + RUN {
                    self.tagged_write(cache, s, 1, false, Activity::Stream);
                }
            }
            46..=50 => {
                let (first, count) = self.own_range(t, rng);
                let fua = rng.below(4) == 0;
                let values = vec![Value::Tag(0); count as usize];
                let request = || vol.write_zeroes(first * SECTOR, count * SECTOR, fua);
                self.write(first, &values, Activity::Zeroes, request, fua);
            }
            51..=53 => {
                let (first, count) = self.own_range(t, rng);
                let fua = rng.below(4) == 0;
                let values = vec![Value::Anything; count as usize];
                let request = || vol.trim(first * SECTOR, count * SECTOR, fua);
                self.write(first, &values, Activity::Trim, request, fua);
            }
            54..=65 => self.flush(cache),
            66..=75 => self.read_own(cache, t, rng),
            76..=83 => {
                let cfg = CleanerConfig {
                    batch_lines: 1 + rng.below(64) as usize,
                    max_write: (64 << 10) << rng.below(7),
                    ..CleanerConfig::default()
                };
                let depth = 1 + rng.below(4) as usize;
                // The address sweep, or the coldest lines as under dirty pressure.
                let select = if rng.below(2) == 0 {
                    Select::All
                } else {
                    Select::Coldest
                };
                if rng.below(8) == 0 {
                    // Writes past the limit go around the cache; overwrites stay absorbed.
                    cache.set_dirty_limit([0.0, 0.25, 0.5, 0.8, 1.0][rng.below(5) as usize]);
                }
                if self.plan.occupancy_cap.is_some() && rng.below(4) == 0 {
                    // A capped volume at its cap evicts its own lines; a lowered cap shrinks it.
                    cache.volumes()[0].set_occupancy_cap(
                        [None, Some(0.002), Some(0.02), Some(0.1), Some(0.5)]
                            [rng.below(5) as usize],
                    );
                }
                let r = with_activity(Activity::Writeback, || {
                    cache.clean_batch(&cfg, depth, select)
                });
                self.outcome(r, "writeback batch");
            }
            84..=87 => {
                let r = with_activity(Activity::Commit, || cache.commit());
                self.outcome(r, "commit");
            }
            88..=90 => {
                let mode = match rng.below(8) {
                    0 => CacheMode::PassThrough,
                    1 | 2 => CacheMode::WriteAround,
                    3 | 4 => CacheMode::WriteThrough,
                    _ => CacheMode::WriteBack,
                };
                let cfg = CleanerConfig::default();
                let r = with_activity(Activity::ModeChange, || {
                    cache.set_mode(0, mode, &cfg, &mut |_| true)
                });
                // Leaving write-back while other threads write can be interrupted by their
                // writes (the volume stays in write-back): an outcome, not a failure.
                if self.plan.threads == 1 {
                    self.outcome(r, "mode change");
                }
            }
            91..=92 if self.plan.restarts => return true,
            _ => {
                // A read of a whole line anywhere (not checked: other threads' sectors may be
                // in flight): fills, evictions and overlays of shared lines.
                let line = rng.below(self.plan.backing_size / self.layout.line_size);
                let len = self.layout.line_size.min(1 << 20);
                let mut buf = vec![0u8; len as usize];
                let r = with_activity(Activity::Read, || {
                    vol.read(line * self.layout.line_size, &mut buf)
                });
                self.outcome(r, "read");
            }
        }
        false
    }

    /// A clean stop (checkpoint) and a start from it, on the same devices.
    pub fn restart(&self, cache: Cache) -> Cache {
        with_activity(Activity::Restart, || {
            let stopped = cache.shutdown();
            let clean = self.outcome(stopped, "clean stop");
            drop(cache);
            let cache = self.start();
            if !clean {
                self.resync_after_unclean_stop(&cache);
            }
            cache
        })
    }

    /// After a clean stop failed the start is a recovery, as after a crash of the process:
    /// each sector reads as the contract allows after a crash, and from then on that value is
    /// the sector's latest (logged as a write of it).
    fn resync_after_unclean_stop(&self, cache: &Cache) {
        let sectors: Vec<u64> = lock(&self.live).sectors().collect();
        let vol = &cache.volumes()[0];
        let mut buf = vec![0u8; SECTOR as usize];
        for sector in sectors {
            let r = vol.read(sector * SECTOR, &mut buf);
            let tag = match r {
                Ok(()) => tag_of(&buf).unwrap_or(u64::MAX),
                Err(e) => panic!(
                    "seed {}: read of sector {sector} after an unclean restart failed: {e}",
                    self.plan.seed
                ),
            };
            let allowed = lock(&self.live).allows_after_crash(sector, tag);
            assert!(
                allowed,
                "seed {}: after a clean stop failed and the cache restarted, sector {sector} \
                 reads {tag:#x}; {}",
                self.plan.seed,
                lock(&self.live).describe(sector)
            );
            self.log(Event::Start {
                sector,
                value: Value::Tag(tag),
            });
            self.log(Event::Done {
                sector,
                ok: true,
                fua: false,
            });
        }
    }

    /// Opens the cache again after a stop.
    fn start(&self) -> Cache {
        // An injected error can fail a start too; the daemon would be started again. Each
        // failed start used up at least one injected error (a planned failing op, or a
        // one-shot failing flush), so more starts than that mean a real failure.
        let limit = self.plan.faults.len() + 3;
        let mut tries = 0;
        loop {
            tries += 1;
            match try_open(&self.cache_dev, &self.backing, &self.plan) {
                Ok(cache) => return cache,
                Err(e) if tries >= limit || !self.faults_reached() => {
                    panic!("seed {}: restart failed: {e}", self.plan.seed)
                }
                Err(_) => {}
            }
        }
    }
}

/// Opens the cache on these devices (after a clean stop or a crash).
pub fn open(cache: &Arc<CrashDevice>, backing: &Arc<CrashDevice>, plan: &Plan) -> Cache {
    try_open(cache, backing, plan).expect("open")
}

/// Opens the cache, with the plan's checksum memory.
pub fn try_open(
    cache: &Arc<CrashDevice>,
    backing: &Arc<CrashDevice>,
    plan: &Plan,
) -> ssdcache_engine::Result<Cache> {
    let sb = read_superblock(&**cache)?;
    let cache = Cache::open(
        cache.clone(),
        sb,
        vec![backing.clone() as Arc<dyn BlockDevice>],
    )?
    .0;
    if let Some(share) = plan.occupancy_cap {
        cache.volumes()[0].set_occupancy_cap(Some(share));
    }
    if let Some(frames) = plan.checksum_frames {
        let bytes = frames * ssdcache_engine::checksums::checksum_frame_bytes(plan.line_size);
        cache.set_checksum_memory(bytes)?;
    }
    Ok(cache)
}
