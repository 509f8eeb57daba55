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
//!   writes the cache. write-around: writes go to the backing device and drop the line from
//!   the cache.
//! - write-back, with the engine's own map and victim code (`ssdcache_engine::residency`):
//!   dirty lines are never evicted (the policy ranks only clean ones). A write to a dirty line
//!   is absorbed; below the dirty limit a hit or an admitted miss makes its line dirty; past
//!   it, or when every line is dirty, the write goes to the backing device (a clean cached copy
//!   is dropped). The cleaner writes back lines dirty for longer than the maximum age, and the
//!   least recently used dirty lines from the high watermark down to the low one, at most
//!   `WritebackModel::rate` bytes per second of trace time (by default as fast as needed, so the
//!   dirty limit binds only with a rate). A line written back costs the bytes written into it
//!   since it became dirty (at most a line): the engine writes back dirty sectors only. Dirty
//!   lines left at the end are counted as written back.
//! - The stream detector and the n-hit ghost table are the engine's, one detector per volume.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use rustc_hash::FxBuildHasher;
use serde::Serialize;
use ssdcache_engine::admission::{Admission, NHitAdmission, Streams};
use ssdcache_engine::dirty_limit_lines;
use ssdcache_engine::policy;
use ssdcache_engine::residency::{Residency, Standing};

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
    /// Write-back: the dirty limit and the cleaner.
    pub writeback: WritebackModel,
}

/// The engine's write-back machinery as the simulator models it: the dirty limit, and a
/// cleaner that writes back the coldest dirty lines above the high watermark (down to the low
/// one) and lines dirty for longer than the maximum age, at most `rate` bytes per second of
/// trace time. Defaults are the engine's (`serve`'s).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WritebackModel {
    /// Share of the lines that may be dirty (`serve --dirty-limit`, as a share).
    pub dirty_limit: f64,
    /// Share of dirty lines above which the cleaner writes back the coldest ones.
    pub high_watermark: f64,
    /// ... down to this share.
    pub low_watermark: f64,
    /// Lines dirty for longer than this (trace time) are written back; 0 = never by age.
    pub max_age_ns: u64,
    /// Bytes per second of trace time the backing device takes from the cleaner; `None` = as
    /// many as needed (the cleaner always keeps up). A trace without times (every request at
    /// time 0) gives a rate-limited cleaner no time at all.
    pub rate: Option<u64>,
}

impl Default for WritebackModel {
    fn default() -> Self {
        let cleaner = ssdcache_engine::CleanerConfig::default();
        WritebackModel {
            dirty_limit: ssdcache_engine::DEFAULT_DIRTY_LIMIT,
            high_watermark: cleaner.high_watermark,
            low_watermark: cleaner.low_watermark,
            max_age_ns: cleaner.max_age.as_nanos().min(u128::from(u64::MAX)) as u64,
            rate: None,
        }
    }
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
    /// Write-back: writes to dirty lines (absorbed: the backing device sees them once, when
    /// the line is written back).
    pub overwrite_refs: u64,
    /// Write-back: write references that went to the backing device because the cache was at
    /// its dirty limit or had no clean line to give (the engine's `bytes_written_around_full`).
    pub written_around_refs: u64,
    /// Of `backing_bytes_written`, what the cleaner wrote back during the trace.
    pub cleaned_bytes: u64,
    /// The most lines dirty at once.
    pub peak_dirty_lines: u64,
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
    /// The engine's own map and victim code: clean lines ranked by the policy, dirty ones
    /// apart (never evicted; the cleaner writes them back).
    slots: Residency<'static, FxBuildHasher>,
    /// Bytes written into each dirty line since it became dirty (at most a line): what the
    /// cleaner writes back for it.
    dirty_bytes: Vec<u64>,
    /// Dirty lines in the order they became dirty, for cleaning by age: (slot, since, the
    /// slot's `dirty_round` then). An entry whose round is no longer the slot's is stale.
    aging: VecDeque<(u32, u64, u32)>,
    /// Counts each slot's dirty periods.
    dirty_round: Vec<u32>,
    dirty_limit_lines: u64,
    high_lines: u64,
    low_lines: u64,
    /// The cleaner is bringing the dirty lines down from the high watermark to the low one.
    cleaning: bool,
    /// Bytes the cleaner may still write (with a rate), and the trace time it was topped up.
    budget: f64,
    now_ns: u64,
    admission: Option<NHitAdmission>,
    streams: HashMap<u32, Streams>,
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
        // The same results on every run: a trace has no client to craft keys against the
        // ghosts' hash (the engine salts it, `ghost.rs`).
        policy::use_fixed_fingerprints();
        let policy =
            policy::by_name(&config.policy, slots).ok_or_else(|| SimError::UnknownPolicy {
                name: config.policy.clone(),
            })?;
        let admission = config.admission.table(slots as usize);
        let wb = &config.writeback;
        let share_of = |share: f64| u64::from(dirty_limit_lines(slots, share));
        Ok(Simulation {
            slots: Residency::with_hasher(slots, policy, FxBuildHasher),
            dirty_bytes: vec![0; slots as usize],
            aging: VecDeque::new(),
            dirty_round: vec![0; slots as usize],
            dirty_limit_lines: share_of(wb.dirty_limit),
            high_lines: share_of(wb.high_watermark),
            low_lines: share_of(wb.low_watermark),
            cleaning: false,
            budget: 0.0,
            now_ns: 0,
            admission,
            streams: HashMap::new(),
            line_shift: config.line_size.trailing_zeros(),
            counters: SimCounters::default(),
            config,
        })
    }

    pub fn request(&mut self, r: &Request) {
        self.counters.requests += 1;
        if self.config.mode == Mode::WriteBack {
            self.run_cleaner(r.time_ns);
        }
        if r.len == 0 {
            return;
        }
        let bypass = self.config.sequential_cutoff > 0
            && self
                .streams
                .entry(r.volume)
                .or_insert_with(|| Streams::new(self.config.sequential_cutoff))
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
        if let Some(slot) = self.slots.slot_of(key) {
            c.read_hits += 1;
            self.slots.touch(slot);
            return;
        }
        if bypass || !self.admit(key) {
            self.counters.backing_bytes_read += bytes;
            return;
        }
        if self.take_slot(key).is_none() {
            // Every line dirty: nothing to fill.
            self.counters.backing_bytes_read += bytes;
            return;
        }
        let line_size = self.config.line_size;
        self.counters.backing_bytes_read += line_size;
        self.counters.cache_bytes_written += line_size;
    }

    fn write_line(&mut self, key: u64, bytes: u64, bypass: bool) {
        self.counters.write_refs += 1;
        let cached = self.slots.slot_of(key);
        if bypass {
            // As the engine: a write continuing a stream past the cutoff goes around the cache
            // and drops the cached copy of what it wrote. A line is cached whole here, so a
            // dirty one stays (its other sectors are still dirty in the engine).
            self.counters.backing_bytes_written += bytes;
            if let Some(slot) = cached {
                if self.slots.standing(slot) != Some(Standing::Dirty) {
                    self.drop_line(slot);
                }
            }
            return;
        }
        match self.config.mode {
            Mode::WriteAround => {
                self.counters.backing_bytes_written += bytes;
                if let Some(slot) = cached {
                    self.drop_line(slot);
                }
            }
            Mode::WriteThrough => {
                self.counters.backing_bytes_written += bytes;
                if let Some(slot) = cached {
                    self.counters.write_hits += 1;
                    self.counters.cache_bytes_written += bytes;
                    self.slots.touch(slot);
                } else if self.admit(key) && self.take_slot(key).is_some() {
                    self.counters.cache_bytes_written += bytes;
                }
            }
            Mode::WriteBack => self.write_back(key, cached, bytes),
        }
    }

    /// As the engine: an overwrite of a dirty line is absorbed; below the dirty limit a write
    /// makes its line dirty (allocating one on a miss); past it, or with no clean line to give,
    /// it goes to the backing device (dropping a clean cached copy).
    fn write_back(&mut self, key: u64, cached: Option<u32>, bytes: u64) {
        if let Some(slot) = cached {
            self.counters.write_hits += 1;
            if self.slots.standing(slot) == Some(Standing::Dirty) {
                self.counters.overwrite_refs += 1;
            } else if !self.may_dirty_another_line() {
                self.counters.write_hits -= 1;
                self.write_around(bytes);
                self.drop_line(slot);
                return;
            }
            self.counters.cache_bytes_written += bytes;
            self.make_dirty(slot, bytes);
            self.slots.touch(slot);
            return;
        }
        if !self.admit(key) {
            self.counters.backing_bytes_written += bytes;
            return;
        }
        let slot = match self.may_dirty_another_line() {
            true => self.take_slot(key),
            false => None,
        };
        match slot {
            Some(slot) => {
                self.counters.cache_bytes_written += bytes;
                self.make_dirty(slot, bytes);
            }
            None => self.write_around(bytes),
        }
    }

    fn write_around(&mut self, bytes: u64) {
        self.counters.written_around_refs += 1;
        self.counters.backing_bytes_written += bytes;
    }

    fn may_dirty_another_line(&self) -> bool {
        u64::from(self.slots.dirty_count()) < self.dirty_limit_lines
    }

    /// Asks the admission policy about a miss; counts a refusal.
    fn admit(&mut self, key: u64) -> bool {
        let admitted = self.admission.as_mut().is_none_or(|a| a.admit(key));
        if !admitted {
            self.counters.not_admitted_refs += 1;
        }
        admitted
    }

    /// A slot for `key`, clean: a free one or the policy's victim among clean lines. `None`
    /// when every line is dirty.
    fn take_slot(&mut self, key: u64) -> Option<u32> {
        let slot = match self.slots.take_free() {
            Some(slot) => slot,
            None => {
                let victim = self.slots.victim(key, &mut |_, _| true)?;
                self.counters.evictions += 1;
                self.slots.vacate(victim);
                victim
            }
        };
        let placed = self.slots.occupy(slot, key);
        debug_assert!(placed, "a free slot for a key not cached");
        Some(slot)
    }

    /// Drops a clean line (write-around, or a write past the dirty limit).
    fn drop_line(&mut self, slot: u32) {
        debug_assert_ne!(self.slots.standing(slot), Some(Standing::Dirty));
        self.slots.vacate(slot);
        self.slots.give_free(slot);
    }

    fn make_dirty(&mut self, slot: u32, bytes: u64) {
        let s = slot as usize;
        if self.slots.standing(slot) != Some(Standing::Dirty) {
            self.slots.set_standing(slot, Standing::Dirty);
            self.aging
                .push_back((slot, self.now_ns, self.dirty_round[s]));
            self.counters.peak_dirty_lines = self
                .counters
                .peak_dirty_lines
                .max(u64::from(self.slots.dirty_count()));
        }
        self.dirty_bytes[s] = (self.dirty_bytes[s] + bytes).min(self.config.line_size);
    }

    /// The cleaner, up to trace time `now`: lines dirty for longer than the maximum age, then
    /// the coldest dirty lines from the high watermark down to the low one, within the bytes
    /// the rate allows.
    fn run_cleaner(&mut self, now: u64) {
        let wb = &self.config.writeback;
        if let Some(rate) = wb.rate {
            let elapsed = now.saturating_sub(self.now_ns) as f64 / 1e9;
            // At most a second's worth saved up (and at least one line, so a slow rate still
            // cleans).
            let most = (rate as f64).max(self.config.line_size as f64);
            self.budget = (self.budget + rate as f64 * elapsed).min(most);
        }
        self.now_ns = self.now_ns.max(now);
        let max_age = wb.max_age_ns;
        if max_age > 0 {
            self.clean_aged(max_age);
        }
        let dirty = u64::from(self.slots.dirty_count());
        self.cleaning =
            dirty >= self.high_lines.max(1) || (self.cleaning && dirty > self.low_lines);
        while self.cleaning && u64::from(self.slots.dirty_count()) > self.low_lines {
            let Some(slot) = self.slots.coldest_dirty().next() else {
                break;
            };
            if !self.clean(slot) {
                break;
            }
        }
        if self.aging.len() > 4 * self.dirty_round.len() {
            // Bounds the stale entries a trace without times (or a long max age) leaves.
            let (rounds, slots) = (&self.dirty_round, &self.slots);
            self.aging.retain(|&(slot, _, round)| {
                round == rounds[slot as usize] && slots.standing(slot) == Some(Standing::Dirty)
            });
        }
    }

    /// Writes back the lines dirty for longer than `max_age`, oldest first, while the rate
    /// allows.
    fn clean_aged(&mut self, max_age: u64) {
        while let Some(&(slot, since, round)) = self.aging.front() {
            if round != self.dirty_round[slot as usize] {
                self.aging.pop_front(); // cleaned or dropped since
                continue;
            }
            if self.now_ns.saturating_sub(since) < max_age || !self.clean(slot) {
                break;
            }
        }
    }

    /// Writes a dirty line back, if the rate allows it now.
    fn clean(&mut self, slot: u32) -> bool {
        let s = slot as usize;
        let cost = self.dirty_bytes[s];
        if self.config.writeback.rate.is_some() {
            if self.budget < cost as f64 {
                return false;
            }
            self.budget -= cost as f64;
        }
        self.counters.backing_bytes_written += cost;
        self.counters.cleaned_bytes += cost;
        self.dirty_bytes[s] = 0;
        self.dirty_round[s] = self.dirty_round[s].wrapping_add(1);
        self.slots.set_standing(slot, Standing::Clean);
        true
    }

    pub fn finish(mut self) -> SimResult {
        let dirty: u64 = self
            .slots
            .coldest_dirty()
            .map(|s| self.dirty_bytes[s as usize])
            .sum();
        self.counters.dirty_bytes_at_end = dirty;
        self.counters.backing_bytes_written += dirty;
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
            writeback: WritebackModel::default(),
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
        assert_eq!(wb.overwrite_refs, 1);
        // A dirty line is never evicted: block 1 is read around it, and the line is written
        // back once, at the end.
        assert_eq!(wb.evictions, 0);
        assert_eq!(wb.backing_bytes_read, 4096);
        assert_eq!(wb.backing_bytes_written, 4096);
        assert_eq!(wb.dirty_bytes_at_end, 4096);

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

    fn at(ms: u64, r: Request) -> Request {
        Request {
            time_ns: ms * 1_000_000,
            ..r
        }
    }

    /// A write-back config whose cleaner never runs unless a test turns it on.
    fn wb_config(lines: u64, dirty_limit: f64) -> SimConfig {
        let mut c = config("lru", lines, Mode::WriteBack);
        c.writeback = WritebackModel {
            dirty_limit,
            high_watermark: 1.0,
            low_watermark: 1.0,
            max_age_ns: 0,
            rate: None,
        };
        c
    }

    #[test]
    fn dirty_lines_are_never_evicted_and_the_limit_sends_writes_around() {
        // 10 lines, at most 5 dirty.
        let mut reqs: Vec<Request> = (0..10).map(write).collect();
        reqs.extend((0..5).map(write)); // overwrites of the dirty lines
        reqs.extend((100..120).map(read)); // read misses cycle through the 5 clean lines
        reqs.extend((0..5).map(read)); // the dirty lines are still there
        let c = run_one(wb_config(10, 0.5), &reqs);
        assert_eq!(c.written_around_refs, 5);
        assert_eq!(c.overwrite_refs, 5);
        assert_eq!(c.peak_dirty_lines, 5);
        assert_eq!(
            c.evictions, 15,
            "20 read misses, 5 free slots, only clean lines go"
        );
        assert_eq!(c.read_hits, 5);
        assert_eq!(c.dirty_bytes_at_end, 5 * 4096);
        assert_eq!(c.backing_bytes_written, 5 * 4096 + 5 * 4096);
    }

    #[test]
    fn a_write_to_a_clean_line_past_the_limit_goes_around_and_drops_it() {
        let reqs = [read(7), write(0), write(7), read(7)];
        let c = run_one(wb_config(4, 0.25), &reqs);
        assert_eq!(c.written_around_refs, 1);
        assert_eq!(c.read_hits, 0, "the clean copy of 7 was dropped");
        assert_eq!(c.write_hits, 0);
    }

    #[test]
    fn the_cleaner_writes_back_the_coldest_dirty_lines_above_the_high_watermark() {
        let mut cfg = wb_config(10, 1.0);
        cfg.writeback.high_watermark = 0.5;
        cfg.writeback.low_watermark = 0.2;
        // Lines 0..4 dirty, 0 written again (warm), then 4: the next request finds 5 dirty
        // lines (the high watermark) and the cleaner takes the coldest (1, 2, 3) down to 2.
        let mut reqs: Vec<Request> = (0..4).map(write).collect();
        reqs.extend([write(0), write(4), read(50)]);
        // 0 and 4 are still dirty (absorbed); 1 was written back (dirty again, not absorbed).
        reqs.extend([write(0), write(4), write(1)]);
        let c = run_one(cfg, &reqs);
        assert_eq!(c.cleaned_bytes, 3 * 4096, "lines 1, 2, 3");
        assert_eq!(c.overwrite_refs, 1 + 2);
        assert_eq!(c.dirty_bytes_at_end, 3 * 4096);
    }

    #[test]
    fn lines_dirty_longer_than_the_max_age_are_written_back() {
        let mut cfg = wb_config(10, 1.0);
        cfg.writeback.max_age_ns = 1_000_000_000;
        let reqs = [at(0, write(0)), at(500, write(1)), at(1200, read(9))];
        let c = run_one(cfg, &reqs);
        assert_eq!(c.cleaned_bytes, 4096, "only line 0 is older than a second");
        assert_eq!(c.dirty_bytes_at_end, 4096);
    }

    #[test]
    fn a_slow_cleaner_lets_the_dirty_limit_bind() {
        // 1000 distinct 4 KiB writes, 1 ms apart, into a 100-line cache.
        let reqs: Vec<Request> = (0..1000).map(|i| at(i, write(i))).collect();
        let fast = run_one(config("lru", 100, Mode::WriteBack), &reqs);
        assert_eq!(fast.written_around_refs, 0, "{fast:?}");
        assert!(fast.peak_dirty_lines <= 50, "{fast:?}");
        let mut slow = config("lru", 100, Mode::WriteBack);
        slow.writeback.rate = Some(400 * 1024); // 100 lines a second; 1000 arrive
        let slow = run_one(slow, &reqs);
        assert_eq!(slow.peak_dirty_lines, 80, "{slow:?}");
        assert!(slow.written_around_refs > 500, "{slow:?}");
        assert!(
            slow.cleaned_bytes > 0 && slow.cleaned_bytes < fast.cleaned_bytes,
            "{slow:?}"
        );
    }

    #[test]
    fn a_write_past_the_cutoff_goes_around_and_drops_a_clean_copy() {
        let mut cfg = config("lru", 1024, Mode::WriteThrough);
        cfg.sequential_cutoff = 4 * 4096;
        // Block 10 cached by a read (then 32 reads far away, so the stream detector forgets
        // it), then a write stream over blocks 0..20.
        let mut reqs = vec![read(10)];
        reqs.extend((1..=32).map(|k| read(k * 1000)));
        reqs.extend((0..20).map(write));
        reqs.push(read(10));
        let c = run_one(cfg, &reqs);
        assert_eq!(c.read_hits, 0, "the stream's write dropped block 10's copy");
        assert!(c.bypassed_refs >= 10, "{c:?}");
        assert_eq!(c.backing_bytes_written, 20 * 4096);
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
