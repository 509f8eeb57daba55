//! The trace-driven simulator. It drives the engine's own replacement policies
//! (`ssdcache_engine::policy`) and admission code (`ssdcache_engine::admission`) over a
//! trace, the way the engine's map drives them, and counts what a cache of each size would
//! have done: hits, SSD writes (endurance) and the traffic left for the backing device.
//!
//! What is modelled, and what is simplified (so a user can judge the numbers):
//! - A request touches the cache lines of `[offset, offset + len)`, one reference each, in
//!   order; a line is cached whole. The engine keeps per-sector validity, so a partly written
//!   line can miss in the engine where it hits here; with 4 KiB lines and 4 KiB-aligned I/O
//!   the two agree.
//! - Read miss (admitted): the line is read whole from the backing device and written to the
//!   cache. Not admitted, or part of a bypassed stream: only the bytes asked for are read.
//! - write-through: every write goes to the backing device; a hit or an admitted miss also
//!   writes the cache. write-back: a hit or an admitted miss writes only the cache and makes
//!   the line dirty; other writes go around the cache. An evicted dirty line is written back
//!   first (the engine's cleaner does that ahead of time; the bytes are the same), and dirty
//!   lines left at the end are counted as written back. write-around: writes go to the
//!   backing device and drop the line from the cache.
//! - The stream detector and the n-hit ghost table are the engine's, one detector per volume.

use std::collections::HashMap;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde::Serialize;
use ssdcache_engine::admission::{Admission, NHitAdmission, StreamDetector};
use ssdcache_engine::policy::{self, ReplacementPolicy};

use crate::trace::{block_key, Op, Request, MIN_LINE_SIZE};

/// How writes are handled (the engine's modes that cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    WriteThrough,
    WriteBack,
    WriteAround,
}

impl Mode {
    pub const NAMES: [&'static str; 3] = ["write-through", "write-back", "write-around"];

    pub fn name(self) -> &'static str {
        match self {
            Mode::WriteThrough => Self::NAMES[0],
            Mode::WriteBack => Self::NAMES[1],
            Mode::WriteAround => Self::NAMES[2],
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "write-through" => Ok(Mode::WriteThrough),
            "write-back" => Ok(Mode::WriteBack),
            "write-around" => Ok(Mode::WriteAround),
            _ => Err(format!(
                "unknown mode {s:?}; choose one of: {}",
                Mode::NAMES.join(", ")
            )),
        }
    }
}

/// One simulated cache.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimConfig {
    /// A name from `ssdcache_engine::policy::names()`.
    pub policy: String,
    /// Cache capacity in lines (at least 1).
    pub cache_lines: u64,
    /// Power of two, at least 512.
    pub line_size: u64,
    #[serde(serialize_with = "display")]
    pub admission: Admission,
    /// Bytes after which a sequential stream bypasses the cache; 0 = never.
    pub sequential_cutoff: u64,
    pub mode: Mode,
}

fn display<S: serde::Serializer>(a: &Admission, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(a)
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("unknown policy {name:?}; choose from: {}", policy::names().join(", "))]
    UnknownPolicy { name: String },
    #[error("a cache of {lines} lines cannot be simulated: between 1 and {} lines", u32::MAX - 1)]
    BadSize { lines: u64 },
    #[error("line size {0} must be a power of two of at least 512 bytes")]
    BadLineSize(u64),
}

/// What one simulated cache did over the trace. Line references count every line a request
/// touched; bytes are bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimCounters {
    pub requests: u64,
    pub read_refs: u64,
    pub read_hits: u64,
    pub write_refs: u64,
    pub write_hits: u64,
    /// Line references of requests that continued a stream past the cutoff.
    pub bypassed_refs: u64,
    /// Misses the admission policy did not let into the cache.
    pub not_admitted_refs: u64,
    pub evictions: u64,
    /// Bytes written to the cache device: fills on read misses, cached writes.
    pub cache_bytes_written: u64,
    pub backing_bytes_read: u64,
    /// Bytes written to the backing device, including the write-back of dirty lines evicted
    /// or left dirty at the end of the trace.
    pub backing_bytes_written: u64,
    /// Of `backing_bytes_written`, the dirty lines left at the end of the trace.
    pub dirty_bytes_at_end: u64,
}

impl SimCounters {
    pub fn hit_ratio(&self) -> f64 {
        ratio(
            self.read_hits + self.write_hits,
            self.read_refs + self.write_refs,
        )
    }
    pub fn read_hit_ratio(&self) -> f64 {
        ratio(self.read_hits, self.read_refs)
    }
    pub fn write_hit_ratio(&self) -> f64 {
        ratio(self.write_hits, self.write_refs)
    }
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    pub config: SimConfig,
    pub counters: SimCounters,
}

/// One cache being simulated.
pub struct Simulation {
    config: SimConfig,
    policy: Box<dyn ReplacementPolicy>,
    slot_of: FxHashMap<u64, u32>,
    key_of: Vec<u64>,
    dirty: Vec<bool>,
    free: Vec<u32>,
    admission: Option<NHitAdmission>,
    streams: HashMap<u32, StreamDetector>,
    line_shift: u32,
    counters: SimCounters,
}

impl Simulation {
    pub fn new(config: SimConfig) -> Result<Simulation, SimError> {
        let lines = config.cache_lines;
        if lines == 0 || lines >= u64::from(u32::MAX) {
            return Err(SimError::BadSize { lines });
        }
        if !config.line_size.is_power_of_two() || config.line_size < MIN_LINE_SIZE {
            return Err(SimError::BadLineSize(config.line_size));
        }
        let slots = lines as u32;
        let policy =
            policy::by_name(&config.policy, slots).ok_or_else(|| SimError::UnknownPolicy {
                name: config.policy.clone(),
            })?;
        let admission = config.admission.table(slots as usize);
        Ok(Simulation {
            policy,
            slot_of: FxHashMap::with_capacity_and_hasher(slots as usize, Default::default()),
            key_of: vec![0; slots as usize],
            dirty: vec![false; slots as usize],
            free: (0..slots).rev().collect(),
            admission,
            streams: HashMap::new(),
            line_shift: config.line_size.trailing_zeros(),
            counters: SimCounters::default(),
            config,
        })
    }

    pub fn request(&mut self, r: &Request) {
        self.counters.requests += 1;
        if r.len == 0 {
            return;
        }
        let bypass = self.config.sequential_cutoff > 0
            && self
                .streams
                .entry(r.volume)
                .or_insert_with(|| StreamDetector::new(self.config.sequential_cutoff))
                .bypass(r.offset, r.len);
        let line_size = self.config.line_size;
        let first = r.offset >> self.line_shift;
        let last = (r.offset + r.len - 1) >> self.line_shift;
        for line in first..=last {
            let start = (line << self.line_shift).max(r.offset);
            let end = ((line + 1) << self.line_shift).min(r.offset + r.len);
            let bytes = end - start;
            debug_assert!(bytes > 0 && bytes <= line_size);
            let key = block_key(r.volume, line);
            if bypass {
                self.counters.bypassed_refs += 1;
            }
            match r.op {
                Op::Read => self.read_line(key, bytes, bypass),
                Op::Write => self.write_line(key, bytes, bypass),
            }
        }
    }

    fn read_line(&mut self, key: u64, bytes: u64, bypass: bool) {
        let c = &mut self.counters;
        c.read_refs += 1;
        if let Some(&slot) = self.slot_of.get(&key) {
            c.read_hits += 1;
            self.policy.touch(slot);
            return;
        }
        if bypass || !self.admit(key) {
            self.counters.backing_bytes_read += bytes;
            return;
        }
        let line_size = self.config.line_size;
        self.counters.backing_bytes_read += line_size;
        self.counters.cache_bytes_written += line_size;
        self.insert(key, false);
    }

    fn write_line(&mut self, key: u64, bytes: u64, bypass: bool) {
        self.counters.write_refs += 1;
        let cached = self.slot_of.get(&key).copied();
        match self.config.mode {
            Mode::WriteAround => {
                self.counters.backing_bytes_written += bytes;
                if let Some(slot) = cached {
                    self.release(slot);
                    self.free.push(slot);
                }
            }
            Mode::WriteThrough => {
                self.counters.backing_bytes_written += bytes;
                if let Some(slot) = cached {
                    self.counters.write_hits += 1;
                    self.counters.cache_bytes_written += bytes;
                    self.policy.touch(slot);
                } else if !bypass && self.admit(key) {
                    self.counters.cache_bytes_written += bytes;
                    self.insert(key, false);
                }
            }
            Mode::WriteBack => {
                if let Some(slot) = cached {
                    self.counters.write_hits += 1;
                    self.counters.cache_bytes_written += bytes;
                    self.dirty[slot as usize] = true;
                    self.policy.touch(slot);
                } else if !bypass && self.admit(key) {
                    self.counters.cache_bytes_written += bytes;
                    self.insert(key, true);
                } else {
                    self.counters.backing_bytes_written += bytes;
                }
            }
        }
    }

    /// Asks the admission policy about a miss; counts a refusal.
    fn admit(&mut self, key: u64) -> bool {
        let admitted = self.admission.as_mut().is_none_or(|a| a.admit(key));
        if !admitted {
            self.counters.not_admitted_refs += 1;
        }
        admitted
    }

    fn insert(&mut self, key: u64, dirty: bool) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let Some(victim) = self.policy.victim(key, &mut |_| true) else {
                    unreachable!("a full cache of evictable lines has a victim");
                };
                self.counters.evictions += 1;
                self.release(victim);
                victim
            }
        };
        self.key_of[slot as usize] = key;
        self.dirty[slot as usize] = dirty;
        self.slot_of.insert(key, slot);
        self.policy.insert(slot, key);
    }

    /// Empties a slot (eviction or invalidation), writing a dirty line back first; the
    /// caller reuses it or puts it on the free list.
    fn release(&mut self, slot: u32) {
        if std::mem::take(&mut self.dirty[slot as usize]) {
            self.counters.backing_bytes_written += self.config.line_size;
        }
        self.slot_of.remove(&self.key_of[slot as usize]);
        self.policy.remove(slot);
    }

    pub fn finish(mut self) -> SimResult {
        let dirty = self.dirty.iter().filter(|&&d| d).count() as u64;
        self.counters.dirty_bytes_at_end = dirty * self.config.line_size;
        self.counters.backing_bytes_written += self.counters.dirty_bytes_at_end;
        SimResult {
            config: self.config,
            counters: self.counters,
        }
    }
}

/// Requests handed to the workers at a time: large enough that the channel costs nothing per
/// request, small enough that memory stays bounded (a few MiB per worker).
const BATCH: usize = 16 * 1024;

/// Runs every configuration over one pass of `requests`, spreading the configurations over
/// `jobs` threads (each thread sees every request, in order). Results come back in the order
/// of `configs`. The first error of the request stream stops the run and is returned.
pub fn run<E: Send>(
    requests: impl Iterator<Item = Result<Request, E>>,
    configs: &[SimConfig],
    jobs: usize,
) -> Result<Result<Vec<SimResult>, E>, SimError> {
    let mut sims = configs
        .iter()
        .cloned()
        .map(Simulation::new)
        .collect::<Result<Vec<_>, _>>()?;
    let jobs = jobs.clamp(1, sims.len().max(1));
    if jobs == 1 {
        for r in requests {
            match r {
                Ok(r) => sims.iter_mut().for_each(|s| s.request(&r)),
                Err(e) => return Ok(Err(e)),
            }
        }
        return Ok(Ok(sims.into_iter().map(Simulation::finish).collect()));
    }
    Ok(run_parallel(requests, sims, jobs))
}

fn run_parallel<E: Send>(
    requests: impl Iterator<Item = Result<Request, E>>,
    sims: Vec<Simulation>,
    jobs: usize,
) -> Result<Vec<SimResult>, E> {
    let count = sims.len();
    // Round-robin, so sizes of one policy (whose costs differ) spread over the threads.
    let mut groups: Vec<Vec<(usize, Simulation)>> = (0..jobs).map(|_| Vec::new()).collect();
    for (i, s) in sims.into_iter().enumerate() {
        groups[i % jobs].push((i, s));
    }
    std::thread::scope(|scope| {
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for group in groups {
            let (tx, rx) = sync_channel::<Arc<Vec<Request>>>(4);
            senders.push(tx);
            handles.push(scope.spawn(move || simulate_group(group, rx)));
        }
        let mut batch = Vec::with_capacity(BATCH);
        let mut failed = None;
        for r in requests {
            match r {
                Ok(r) => batch.push(r),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            if batch.len() == BATCH {
                let full = Arc::new(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)));
                senders
                    .iter()
                    .for_each(|tx| drop(tx.send(Arc::clone(&full))));
            }
        }
        let last = Arc::new(batch);
        senders
            .iter()
            .for_each(|tx| drop(tx.send(Arc::clone(&last))));
        drop(senders);
        let mut results: Vec<Option<SimResult>> = vec![None; count];
        for h in handles {
            // A worker panics only on a bug; carry the panic to the caller.
            let done = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            for (i, r) in done {
                results[i] = Some(r);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(results.into_iter().flatten().collect()),
        }
    })
}

fn simulate_group(
    mut group: Vec<(usize, Simulation)>,
    batches: Receiver<Arc<Vec<Request>>>,
) -> Vec<(usize, SimResult)> {
    for batch in batches {
        for (_, sim) in group.iter_mut() {
            batch.iter().for_each(|r| sim.request(r));
        }
    }
    group.into_iter().map(|(i, s)| (i, s.finish())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(policy: &str, lines: u64, mode: Mode) -> SimConfig {
        SimConfig {
            policy: policy.into(),
            cache_lines: lines,
            line_size: 4096,
            admission: Admission::Always,
            sequential_cutoff: 0,
            mode,
        }
    }

    fn read(block: u64) -> Request {
        Request {
            time_ns: 0,
            volume: 0,
            op: Op::Read,
            offset: block * 4096,
            len: 4096,
        }
    }

    fn write(block: u64) -> Request {
        Request {
            op: Op::Write,
            ..read(block)
        }
    }

    fn run_one(cfg: SimConfig, reqs: &[Request]) -> SimCounters {
        let results = run(reqs.iter().map(|r| Ok::<_, ()>(*r)), &[cfg], 1);
        let mut results = results.expect("valid config").expect("no trace error");
        results.remove(0).counters
    }

    #[test]
    fn matches_the_engines_policy_replay_for_every_policy() {
        let mut rng = ssdcache_device::SplitMix64(7);
        let keys: Vec<u64> = (0..20_000)
            .map(|_| {
                let hot = rng.below(4) != 0;
                if hot {
                    rng.below(300)
                } else {
                    rng.below(5_000)
                }
            })
            .collect();
        for name in policy::names() {
            let reqs: Vec<Request> = keys.iter().map(|&k| read(k)).collect();
            let c = run_one(config(name, 256, Mode::WriteThrough), &reqs);
            let mut p = policy::by_name(name, 256).expect("known policy");
            let (hits, misses) = policy::simulate_hits(&mut *p, 256, keys.iter().copied());
            assert_eq!(
                (c.read_hits, c.read_refs - c.read_hits),
                (hits, misses),
                "{name}"
            );
        }
    }

    #[test]
    fn bytes_follow_each_mode() {
        // Write block 0 twice, read it, read block 1 (miss), in a one-line cache.
        let reqs = [write(0), write(0), read(0), read(1)];
        let wt = run_one(config("lru", 1, Mode::WriteThrough), &reqs);
        assert_eq!((wt.write_hits, wt.read_hits), (1, 1));
        assert_eq!(wt.backing_bytes_written, 2 * 4096);
        assert_eq!(wt.backing_bytes_read, 4096);
        assert_eq!(wt.cache_bytes_written, 3 * 4096);

        let wb = run_one(config("lru", 1, Mode::WriteBack), &reqs);
        assert_eq!((wb.write_hits, wb.read_hits), (1, 1));
        // The dirty line is written back once, when block 1 evicts it.
        assert_eq!(wb.backing_bytes_written, 4096);
        assert_eq!(wb.dirty_bytes_at_end, 0);

        let wa = run_one(config("lru", 1, Mode::WriteAround), &reqs);
        assert_eq!((wa.write_hits, wa.read_hits), (0, 0));
        assert_eq!(wa.backing_bytes_written, 2 * 4096);
        assert_eq!(wa.cache_bytes_written, 2 * 4096);
    }

    #[test]
    fn dirty_lines_left_at_the_end_count_as_written_back() {
        let wb = run_one(config("lru", 4, Mode::WriteBack), &[write(0), write(1)]);
        assert_eq!(wb.dirty_bytes_at_end, 2 * 4096);
        assert_eq!(wb.backing_bytes_written, 2 * 4096);
    }

    #[test]
    fn two_hit_admission_keeps_one_hit_wonders_out() {
        let mut cfg = config("lru", 8, Mode::WriteThrough);
        cfg.admission = Admission::NHit(2);
        // The ghost table remembers as many misses as the cache has lines (8).
        let reqs: Vec<Request> = (0..8).map(read).chain([read(5), read(5)]).collect();
        let c = run_one(cfg, &reqs);
        // Only block 5 (missed twice) was cached; its third read hits.
        assert_eq!(c.read_hits, 1);
        assert_eq!(c.cache_bytes_written, 4096);
        assert_eq!(c.not_admitted_refs, 8);
    }

    #[test]
    fn a_long_stream_bypasses_after_the_cutoff() {
        let mut cfg = config("lru", 1024, Mode::WriteThrough);
        cfg.sequential_cutoff = 64 * 4096;
        let reqs: Vec<Request> = (0..1000).map(read).collect();
        let c = run_one(cfg, &reqs);
        assert!(c.bypassed_refs > 900, "{c:?}");
        assert!(c.cache_bytes_written <= 70 * 4096, "{c:?}");
    }

    #[test]
    fn parallel_and_serial_runs_agree() {
        let mut rng = ssdcache_device::SplitMix64(3);
        let reqs: Vec<Request> = (0..50_000)
            .map(|_| {
                let b = rng.below(3_000);
                if rng.below(3) == 0 {
                    write(b)
                } else {
                    read(b)
                }
            })
            .collect();
        let configs: Vec<SimConfig> = ["lru", "arc", "s3fifo"]
            .iter()
            .flat_map(|p| [100, 1000].map(|n| config(p, n, Mode::WriteBack)))
            .collect();
        let go = |jobs| {
            run(reqs.iter().map(|r| Ok::<_, ()>(*r)), &configs, jobs)
                .expect("valid")
                .expect("no error")
        };
        assert_eq!(go(1), go(3));
    }

    #[test]
    fn a_trace_error_stops_the_run() {
        let reqs = [Ok(read(0)), Err("line 2: bad"), Ok(read(1))];
        for jobs in [1, 2] {
            let out = run(
                reqs.iter().cloned(),
                &[
                    config("lru", 4, Mode::WriteThrough),
                    config("fifo", 4, Mode::WriteThrough),
                ],
                jobs,
            );
            assert_eq!(out.expect("valid").err(), Some("line 2: bad"));
        }
    }

    #[test]
    fn bad_configurations_are_refused() {
        assert!(matches!(
            Simulation::new(config("lfu-ish", 4, Mode::WriteBack)),
            Err(SimError::UnknownPolicy { .. })
        ));
        assert!(matches!(
            Simulation::new(config("lru", 0, Mode::WriteBack)),
            Err(SimError::BadSize { .. })
        ));
    }
}
