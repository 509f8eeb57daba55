//! The two workloads: the mixed load checked against the model, and the read-back of the
//! whole export.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use ssdcache_device::SplitMix64;
use ssdcache_nbd::{Command, Errno};

use super::connections::{Spec, Workload};
use super::model::{Allowed, Change, Model, Snapshot};
use super::pattern::{self, Observed, BLOCK};
use super::stats::{OpKind, OpStats};

/// Failure messages kept for the report; the counts go on past it.
const MAX_MESSAGES: usize = 30;
/// Tries at finding a free range before waiting for a request to finish.
const PICK_ATTEMPTS: usize = 64;
/// Longest wait for a request to finish when every range tried was busy.
const PICK_WAIT: Duration = Duration::from_millis(10);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Verify errors, failed requests, and the first few messages.
#[derive(Default)]
pub struct Findings {
    pub verify_errors: AtomicU64,
    pub request_errors: AtomicU64,
    messages: Mutex<Vec<String>>,
}

impl Findings {
    /// Keeps the message if there is room (built only then: a broken server can cause
    /// millions of errors).
    fn note(&self, message: impl FnOnce() -> String) {
        let mut messages = lock(&self.messages);
        if messages.len() < MAX_MESSAGES {
            messages.push(message());
        }
    }

    fn verify_error(&self, message: impl FnOnce() -> String) {
        self.verify_errors.fetch_add(1, Ordering::Relaxed);
        self.note(|| format!("VERIFY ERROR: {}", message()));
    }

    fn request_error(&self, what: &str, code: u32) {
        self.request_errors.fetch_add(1, Ordering::Relaxed);
        let name =
            Errno::from_code(code).map_or_else(|| format!("error {code}"), |e| e.to_string());
        self.note(|| format!("REQUEST FAILED: {what}: {name}"));
    }

    pub fn messages(&self) -> Vec<String> {
        lock(&self.messages).clone()
    }

    pub fn verify_error_count(&self) -> u64 {
        self.verify_errors.load(Ordering::Relaxed)
    }

    pub fn request_error_count(&self) -> u64 {
        self.request_errors.load(Ordering::Relaxed)
    }
}

/// Relative weights of the operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mix {
    pub read: u32,
    pub write: u32,
    pub trim: u32,
    pub zeroes: u32,
    pub flush: u32,
}

impl Mix {
    fn total(&self) -> u32 {
        self.read + self.write + self.trim + self.zeroes + self.flush
    }

    fn pick(&self, rng: &mut SplitMix64) -> Command {
        let mut roll = rng.below(u64::from(self.total().max(1))) as u32;
        for (weight, command) in [
            (self.read, Command::Read),
            (self.write, Command::Write),
            (self.trim, Command::Trim),
            (self.zeroes, Command::WriteZeroes),
        ] {
            if roll < weight {
                return command;
            }
            roll -= weight;
        }
        Command::Flush
    }
}

/// What the load sends, and for how long.
pub struct LoadPlan {
    pub mix: Mix,
    pub fua_percent: u64,
    /// Request sizes in blocks: a power of two chosen uniformly between these two, then a
    /// size uniformly within that octave (so small and large requests are equally common
    /// per octave).
    pub min_blocks: u64,
    pub max_blocks: u64,
    pub deadline: Instant,
    pub max_requests: u64,
}

impl LoadPlan {
    fn pick_blocks(&self, rng: &mut SplitMix64) -> u64 {
        let low = self.min_blocks.ilog2();
        let high = self.max_blocks.ilog2();
        let octave = low + rng.below(u64::from(high - low + 1)) as u32;
        let base = 1u64 << octave;
        (base + rng.below(base)).clamp(self.min_blocks, self.max_blocks)
    }
}

pub enum Detail {
    Read(Vec<Allowed>),
    Change,
    Flush(u64),
}

pub struct LoadTag {
    kind: OpKind,
    first: u64,
    count: u64,
    fua: bool,
    started: Instant,
    detail: Detail,
}

/// Random mixed requests checked against the model.
pub struct LoadWorkload {
    model: Mutex<Model>,
    /// Signalled whenever blocks become free.
    freed: Condvar,
    plan: LoadPlan,
    salt: u64,
    blocks: u64,
    issued: AtomicU64,
    stopped: AtomicBool,
    pub stats: Vec<Mutex<OpStats>>,
    pub findings: Findings,
    pub completed: AtomicU64,
}

impl LoadWorkload {
    pub fn new(model: Model, plan: LoadPlan, connections: usize) -> LoadWorkload {
        let (salt, blocks) = (model.salt(), model.blocks());
        LoadWorkload {
            model: Mutex::new(model),
            freed: Condvar::new(),
            plan,
            salt,
            blocks,
            issued: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            stats: (0..connections).map(|_| Mutex::default()).collect(),
            findings: Findings::default(),
            completed: AtomicU64::new(0),
        }
    }

    pub fn into_parts(self) -> (Model, Findings) {
        let model = self
            .model
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        (model, self.findings)
    }

    pub fn merged_stats(&self) -> OpStats {
        let mut total = OpStats::default();
        for stats in &self.stats {
            total.merge(&lock(stats));
        }
        total
    }

    fn tag(&self, kind: OpKind, first: u64, count: u64, fua: bool, detail: Detail) -> LoadTag {
        LoadTag {
            kind,
            first,
            count,
            fua,
            started: Instant::now(),
            detail,
        }
    }

    fn spec(command: Command, fua: bool, first: u64, count: u64) -> Spec {
        Spec {
            command,
            fua,
            offset: first * BLOCK as u64,
            // Bounded by max_blocks, which fits the export's request limit.
            length: (count * BLOCK as u64) as u32,
        }
    }

    /// Reserves a free range for `command` and builds its request.
    fn pick_range(
        &self,
        command: Command,
        fua: bool,
        rng: &mut SplitMix64,
        payload: &mut Vec<u8>,
    ) -> Option<(Spec, LoadTag)> {
        let mut model = lock(&self.model);
        while !self.finished() {
            for _ in 0..PICK_ATTEMPTS {
                let count = self.plan.pick_blocks(rng).min(self.blocks);
                let first = rng.below(self.blocks - count + 1);
                if let Some(found) = self.reserve(&mut model, command, fua, first, count) {
                    drop(model);
                    if let Some(version) = found.1 {
                        fill_payload(payload, self.salt, first, count, version);
                    }
                    return Some(found.0);
                }
            }
            model = self
                .freed
                .wait_timeout(model, PICK_WAIT)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        None
    }

    /// The request and, for a WRITE, the version its payload must carry.
    fn reserve(
        &self,
        model: &mut Model,
        command: Command,
        fua: bool,
        first: u64,
        count: u64,
    ) -> Option<((Spec, LoadTag), Option<u64>)> {
        let spec = Self::spec(command, fua, first, count);
        if command == Command::Read {
            let allowed = model.try_read(first, count)?;
            let tag = self.tag(OpKind::Read, first, count, false, Detail::Read(allowed));
            return Some(((spec, tag), None));
        }
        let (change, kind) = match command {
            Command::Write if fua => (Change::Write, OpKind::WriteFua),
            Command::Write => (Change::Write, OpKind::Write),
            Command::Trim => (Change::Trim, OpKind::Trim),
            _ => (Change::Zeroes, OpKind::Zeroes),
        };
        let version = model.try_change(first, count, change)?;
        let tag = self.tag(kind, first, count, fua, Detail::Change);
        let version = (change == Change::Write).then_some(version);
        Some(((spec, tag), version))
    }

    fn finished(&self) -> bool {
        self.stopped.load(Ordering::SeqCst) || Instant::now() >= self.plan.deadline
    }

    fn check_read(&self, conn: usize, tag: &LoadTag, allowed: &[Allowed], data: &[u8]) {
        for (index, (block_data, allowed)) in data.chunks_exact(BLOCK).zip(allowed).enumerate() {
            let block = tag.first + index as u64;
            let observed = pattern::classify(block_data, self.salt, block);
            if !allowed.admits(observed) {
                self.findings.verify_error(|| {
                    format!(
                        "READ of {} blocks at block {} (connection {conn}): block {block} \
                         (offset {}) read as {observed}, expected {allowed}",
                        tag.count,
                        tag.first,
                        block * BLOCK as u64
                    )
                });
            }
        }
    }
}

fn fill_payload(payload: &mut Vec<u8>, salt: u64, first: u64, count: u64, version: u64) {
    payload.resize(count as usize * BLOCK, 0);
    for (index, block) in payload.chunks_exact_mut(BLOCK).enumerate() {
        pattern::fill(block, salt, first + index as u64, version);
    }
}

impl Workload for LoadWorkload {
    type Tag = LoadTag;

    fn next(
        &self,
        _conn: usize,
        rng: &mut SplitMix64,
        payload: &mut Vec<u8>,
    ) -> Option<(Spec, LoadTag)> {
        if self.finished() || self.issued.fetch_add(1, Ordering::Relaxed) >= self.plan.max_requests
        {
            return None;
        }
        let command = self.plan.mix.pick(rng);
        let fua = matches!(command, Command::Write | Command::WriteZeroes)
            && rng.below(100) < self.plan.fua_percent;
        if command == Command::Flush {
            let mark = lock(&self.model).flush_mark();
            let spec = Self::spec(Command::Flush, false, 0, 0);
            return Some((
                spec,
                self.tag(OpKind::Flush, 0, 0, false, Detail::Flush(mark)),
            ));
        }
        self.pick_range(command, fua, rng, payload)
    }

    fn done(&self, conn: usize, result: Result<(), u32>, tag: LoadTag, data: &[u8]) {
        let latency = tag.started.elapsed();
        if let (Detail::Read(allowed), Ok(())) = (&tag.detail, result) {
            self.check_read(conn, &tag, allowed, data);
        }
        if let Err(code) = result {
            let what = format!(
                "{} of {} blocks at block {} (connection {conn})",
                tag.kind.name(),
                tag.count,
                tag.first
            );
            self.findings.request_error(&what, code);
        }
        let mut model = lock(&self.model);
        match (&tag.detail, result) {
            (Detail::Read(_), _) => model.end_read(tag.first, tag.count),
            (Detail::Change, Ok(())) => model.end_change(tag.first, tag.count, tag.fua),
            (Detail::Change, Err(_)) => model.fail_change(tag.first, tag.count),
            (Detail::Flush(mark), Ok(())) => model.end_flush(*mark),
            (Detail::Flush(_), Err(_)) => {}
        }
        drop(model);
        self.freed.notify_all();
        let bytes = match tag.kind {
            OpKind::Read | OpKind::Write | OpKind::WriteFua => tag.count * BLOCK as u64,
            _ => 0,
        };
        lock(&self.stats[conn]).record(tag.kind, bytes, latency);
        self.completed.fetch_add(1, Ordering::Relaxed);
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

/// An observation kept per block between the passes of a read-back.
const NOT_READ: u64 = 0;
const SAW_ZERO: u64 = 1;
const SAW_BAD: u64 = 2;
const FIRST_VERSION_CODE: u64 = 3;

fn encode(observed: Observed) -> u64 {
    match observed {
        Observed::Zero => SAW_ZERO,
        Observed::Data(version) => version.saturating_add(FIRST_VERSION_CODE),
        _ => SAW_BAD,
    }
}

fn decode(code: u64) -> Option<Observed> {
    match code {
        NOT_READ | SAW_BAD => None,
        SAW_ZERO => Some(Observed::Zero),
        version => Some(Observed::Data(version - FIRST_VERSION_CODE)),
    }
}

/// Reads the whole export in order, in chunks, checking every block against a snapshot; a
/// second pass must read exactly what the first did.
pub struct ReadBack<'a> {
    snapshot: &'a Snapshot,
    chunk_blocks: u64,
    next_chunk: AtomicU64,
    observations: Vec<AtomicU64>,
    second_pass: bool,
    stopped: AtomicBool,
    pub findings: &'a Findings,
    pub bytes: AtomicU64,
}

impl<'a> ReadBack<'a> {
    pub fn new(snapshot: &'a Snapshot, chunk_blocks: u64, findings: &'a Findings) -> Self {
        ReadBack {
            snapshot,
            chunk_blocks,
            next_chunk: AtomicU64::new(0),
            observations: snapshot
                .blocks
                .iter()
                .map(|_| AtomicU64::new(NOT_READ))
                .collect(),
            second_pass: false,
            stopped: AtomicBool::new(false),
            findings,
            bytes: AtomicU64::new(0),
        }
    }

    /// Starts the second pass: every block is read again and compared with the first.
    pub fn start_second_pass(&mut self) {
        self.second_pass = true;
        self.next_chunk.store(0, Ordering::SeqCst);
    }

    /// The snapshot narrowed to what the first pass saw (see [`Allowed::narrowed_to`]).
    pub fn narrowed(&self) -> Snapshot {
        let blocks = self
            .snapshot
            .blocks
            .iter()
            .zip(&self.observations)
            .map(
                |(allowed, seen)| match decode(seen.load(Ordering::Relaxed)) {
                    Some(observed) => allowed.narrowed_to(observed),
                    None => allowed.clone(),
                },
            )
            .collect();
        Snapshot {
            blocks,
            ..self.snapshot.clone()
        }
    }

    /// Blocks that read as zeroes and as data in the first pass.
    pub fn counts(&self) -> (u64, u64) {
        let mut zero = 0;
        let mut data = 0;
        for seen in &self.observations {
            match decode(seen.load(Ordering::Relaxed)) {
                Some(Observed::Zero) => zero += 1,
                Some(_) => data += 1,
                None => {}
            }
        }
        (zero, data)
    }

    fn check_block(&self, block: u64, data: &[u8]) {
        let observed = pattern::classify(data, self.snapshot.salt, block);
        let allowed = &self.snapshot.blocks[block as usize];
        let seen = &self.observations[block as usize];
        if !self.second_pass {
            seen.store(encode(observed), Ordering::Relaxed);
            if !allowed.admits(observed) {
                self.findings.verify_error(|| {
                    format!(
                        "read-back: block {block} (offset {}) read as {observed}, expected \
                         {allowed}",
                        block * BLOCK as u64
                    )
                });
            }
            return;
        }
        let first = seen.load(Ordering::Relaxed);
        if first != encode(observed) || first == SAW_BAD {
            self.findings.verify_error(|| {
                let before = decode(first).map_or("damaged data".to_owned(), |o| o.to_string());
                format!(
                    "read-back: block {block} (offset {}) read as {before}, then as {observed}",
                    block * BLOCK as u64
                )
            });
        }
    }
}

impl Workload for ReadBack<'_> {
    type Tag = u64;

    fn next(
        &self,
        _conn: usize,
        _rng: &mut SplitMix64,
        _payload: &mut Vec<u8>,
    ) -> Option<(Spec, u64)> {
        let blocks = self.snapshot.blocks.len() as u64;
        let chunk = self.next_chunk.fetch_add(1, Ordering::Relaxed);
        let first = chunk.checked_mul(self.chunk_blocks)?;
        if first >= blocks || self.stopped.load(Ordering::SeqCst) {
            return None;
        }
        let count = self.chunk_blocks.min(blocks - first);
        let spec = LoadWorkload::spec(Command::Read, false, first, count);
        Some((spec, first))
    }

    fn done(&self, conn: usize, result: Result<(), u32>, first: u64, data: &[u8]) {
        if let Err(code) = result {
            let what = format!("read-back READ at block {first} (connection {conn})");
            self.findings.request_error(&what, code);
            return;
        }
        self.bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        for (index, block_data) in data.chunks_exact(BLOCK).enumerate() {
            self.check_block(first + index as u64, block_data);
        }
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_stay_in_bounds_and_cover_every_octave() {
        let plan = LoadPlan {
            mix: Mix {
                read: 1,
                write: 1,
                trim: 1,
                zeroes: 1,
                flush: 1,
            },
            fua_percent: 0,
            min_blocks: 1,
            max_blocks: 256,
            deadline: Instant::now(),
            max_requests: 0,
        };
        let mut rng = SplitMix64(5);
        let mut octaves = [0u32; 9];
        for _ in 0..10_000 {
            let blocks = plan.pick_blocks(&mut rng);
            assert!((1..=256).contains(&blocks));
            octaves[blocks.ilog2() as usize] += 1;
        }
        assert!(octaves.iter().all(|&n| n > 500), "{octaves:?}");
    }

    #[test]
    fn mix_weights_are_respected() {
        let mix = Mix {
            read: 0,
            write: 3,
            trim: 0,
            zeroes: 0,
            flush: 1,
        };
        let mut rng = SplitMix64(1);
        let writes = (0..4000)
            .filter(|_| mix.pick(&mut rng) == Command::Write)
            .count();
        assert!((2800..3200).contains(&writes), "{writes}");
    }
}
