//! Writeback ("cleaning"): dirty lines are written to their backing devices in batches swept
//! in address order, contiguous dirty sectors merged into large writes and many writes kept in
//! flight (a disk reorders its queue; one sorted write at a time still misses a rotation each).
//! The backing devices are flushed before any line is recorded clean (docs/design.md,
//! "Writeback").

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ssdcache_device::AlignedBuf;
use ssdcache_format::{sector_crc, CacheMode, SectorBitmap, SECTOR_SIZE};

use crate::cache::{Cache, CacheCore, Mismatch};
use crate::commit::CommitPurpose;
use crate::error::{EngineError, Result};
use crate::locks::LineKey;
use crate::map::{line_of, volume_of, DamagedLines, DirtyLine, DirtySweep, SweepEntry};
use crate::residency::NO_KEY;
use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use crate::sync::thread::{self, JoinHandle};
use crate::sync::Mutex;
use crate::volume::{Counter, Volume};

/// When and how fast the cleaner writes back. Defaults are in docs/operations.md.
#[derive(Debug, Clone)]
pub struct CleanerConfig {
    /// Share of the cache's lines dirty at which cleaning of every dirty line starts (without
    /// pauses; at full depth while clients leave the backing device idle).
    pub high_watermark: f64,
    /// Cleaning started by the high watermark goes on until this share is reached.
    pub low_watermark: f64,
    /// Dirty data older than this is written back even below the watermarks.
    pub max_age: Duration,
    /// Backing writes in flight when the backing device is idle, or during `ssdcache flush`.
    pub max_in_flight: usize,
    /// Backing writes in flight while clients use the backing device.
    pub busy_in_flight: usize,
    /// While clients use the backing device: the pause after each backing write, and the
    /// lines per batch. A hard drive serves its nearest request first, and the cleaner's
    /// address-ordered writes are often the nearest, so without a pause they would take a
    /// large share of the disk from the clients.
    pub busy_pause: Duration,
    pub busy_batch_lines: usize,
    /// The backing device counts as idle after this long without a client request.
    pub idle_after: Duration,
    /// Largest merged write.
    pub max_write: u64,
    /// Lines planned per batch.
    pub batch_lines: usize,
}

impl Default for CleanerConfig {
    fn default() -> Self {
        CleanerConfig {
            high_watermark: 0.5,
            low_watermark: 0.4,
            max_age: Duration::from_secs(30),
            max_in_flight: 32,
            busy_in_flight: 1,
            busy_pause: Duration::from_millis(50),
            busy_batch_lines: 32,
            idle_after: Duration::from_millis(100),
            max_write: 4 << 20,
            batch_lines: 2048,
        }
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchReport {
    pub lines_cleaned: u64,
    pub bytes_written: u64,
    pub writes: u64,
    /// Extents skipped because a client changed them meanwhile, or that failed.
    pub extents_skipped: u64,
    pub extents_failed: u64,
    /// Extents not begun because a client used the backing device meanwhile, or because the
    /// cleaner was stopped (they stay dirty for a later batch).
    pub extents_deferred: u64,
}

/// A drain whose writebacks clients pass over (they change the lines meanwhile, nothing fails)
/// pauses this long between tries ...
const DRAIN_BUSY_PAUSE: Duration = Duration::from_millis(10);
/// ... and gives up after this many tries in a row (30 s of pauses).
const DRAIN_BUSY_ROUNDS: u32 = 3000;
/// How long a drain waits for a backing device that cannot be reached (a network export
/// reconnecting) before it fails naming it: as long as that device's requests wait
/// (`ssdcache_remote::RemoteConfig::retry_timeout`'s default).
const DRAIN_UNREACHABLE_WAIT: Duration = Duration::from_secs(60);

/// The state a cache keeps for its cleaner thread.
pub(crate) struct CleanerState {
    /// The address-ordered sweep under way (`Select::All`, `Select::DirtySince`).
    sweep: Mutex<DirtySweep>,
    /// The sweeps of single volumes' lines (`Select::Volume`), one per volume: capped volumes
    /// are served in turns, and one shared sweep would start over at each turn (review 38).
    volume_sweeps: Mutex<HashMap<u16, DirtySweep>>,
    draining: AtomicBool,
    /// Volumes whose dirty data the cleaner writes back at full speed before anything else
    /// (removals while serving, [`Cache::request_volume_drain`]): bit `id` (32 volume slots).
    volumes_to_drain: AtomicU32,
    stop: Arc<AtomicBool>,
    /// When the oldest dirty line the cleaner can write back became dirty (`now_secs`), as
    /// the cleaner last saw it (about every second), `u64::MAX` for none: read by
    /// [`Cache::oldest_dirty_age`] without the map's lock.
    oldest_dirty_since: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The background committer (`CommitRequests`), started and stopped with the cleaner.
    committer: Mutex<Option<JoinHandle<()>>>,
}

impl Default for CleanerState {
    fn default() -> Self {
        CleanerState {
            sweep: Default::default(),
            volume_sweeps: Default::default(),
            draining: AtomicBool::new(false),
            volumes_to_drain: AtomicU32::new(0),
            stop: Default::default(),
            oldest_dirty_since: AtomicU64::new(u64::MAX),
            thread: Default::default(),
            committer: Default::default(),
        }
    }
}

/// Which volume over its own dirty cap the cleaner serves next (`Cache::volume_near_dirty_cap`).
#[derive(Default)]
struct CapTurns {
    /// The volume of the last `Select::Volume` batch.
    last: Option<u16>,
    /// The last batch was a `Select::Volume` one.
    last_was_volume: bool,
    /// Volumes whose last batch wrote nothing back, and until when they rest.
    rest_until: HashMap<u16, Instant>,
}

impl CapTurns {
    /// How long a capped volume whose batch wrote nothing back (a failing disk, damage) is
    /// left out, so it cannot take every batch.
    const REST: Duration = Duration::from_secs(1);

    fn resting(&self, id: u16) -> bool {
        self.rest_until
            .get(&id)
            .is_some_and(|until| Instant::now() < *until)
    }

    fn after_batch(&mut self, select: Select, lines_cleaned: u64) {
        self.last_was_volume = matches!(select, Select::Volume(_));
        if let Select::Volume(id) = select {
            self.last = Some(id);
            if lines_cleaned == 0 {
                self.rest_until.insert(id, Instant::now() + Self::REST);
            } else {
                self.rest_until.remove(&id);
            }
        }
    }
}

/// A set of volume ids (slots of the superblock's table, fewer than 64).
#[derive(Default, Clone, Copy)]
pub(crate) struct VolumeSet(u64);

impl VolumeSet {
    fn insert(&mut self, id: u16) {
        if id < 64 {
            self.0 |= 1 << id;
        }
    }
    fn contains(self, id: u16) -> bool {
        id < 64 && self.0 & (1 << id) != 0
    }
    fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// How a batch's writes share the backing device with clients.
///
/// Every pace but `ToTheEnd` belongs to the cleaner thread, and its batch ends early when the
/// cleaner is stopped (the daemon's stop): the writes in flight finish, no further one starts,
/// and the rest stays dirty in place (`Outcome::Deferred`), so a stop never waits for thousands
/// of scattered writes at the disk's speed.
#[derive(Debug, Clone, Copy)]
enum Pace {
    /// Every write at the batch's depth, to the end (`Cache::drain`, `set_mode` in the caller's
    /// thread).
    ToTheEnd,
    /// Every write at the batch's depth until the cleaner is stopped (`ssdcache flush` through
    /// the daemon).
    Flush,
    /// At the batch's depth while no client has used the backing device for this long; from
    /// the first client request on, no further write starts and the batch ends with what it
    /// wrote (the writes in flight finish).
    WhileIdle(Duration),
    /// This pause after each write (with one write in flight: the trickle).
    Trickle(Duration),
}

/// Which dirty lines a batch takes.
#[derive(Debug, Clone, Copy)]
pub enum Select {
    /// The next dirty lines of the address-ordered sweep.
    All,
    /// Only lines dirty since before this time (seconds on the cache's clock), in the sweep.
    DirtySince(u32),
    /// The least recently used dirty lines (the ones the replacement policy would evict next
    /// if they were clean), then sorted by address: under dirty pressure the lines written
    /// back are those the cache has least use for, and hot dirty lines stay to absorb their
    /// overwrites.
    Coldest,
    /// The dirty lines of one volume (by id), in the sweep: removing a volume.
    Volume(u16),
}

/// A run of dirty sectors of one line, as part of a merged write.
#[derive(Debug, Clone, Copy)]
struct Part {
    line: DirtyLine,
    first: usize,
    count: usize,
}

impl Part {
    /// The part's sectors as a bitmap of its line.
    fn sectors(&self) -> SectorBitmap {
        SectorBitmap::range(self.first, self.count)
    }
}

/// One backing write: contiguous sectors of one volume, possibly across lines.
#[derive(Debug)]
struct Extent {
    volume: u16,
    offset: u64,
    len: u64,
    parts: Vec<Part>,
}

enum Outcome {
    Written,
    Skipped,
    Failed,
    /// Not begun: the batch began at full depth on an idle backing device, and a client used
    /// the device since (`Pace::WhileIdle`), or the cleaner was stopped. The lines stay dirty
    /// where they are, for a later batch.
    Deferred,
}

/// The slots of one batch's extents being written back, watched from their read (under the
/// lines' locks) to the batch's end, so that `MapState::mark_clean` leaves out sectors whose
/// data changed meanwhile. Dropping it ends the watches (also when the batch ends early on an
/// error); it must not be dropped while the map's lock is held.
struct WritebackWatches<'a> {
    core: &'a CacheCore,
    batch: u64,
    slots: Mutex<Vec<u32>>,
}

impl<'a> WritebackWatches<'a> {
    fn new(core: &'a CacheCore) -> WritebackWatches<'a> {
        WritebackWatches {
            core,
            batch: core.map().new_writeback_batch(),
            slots: Mutex::new(Vec::new()),
        }
    }

    /// Watches the extent's slots; called holding its lines, once its data was read.
    fn watch(&self, extent: &Extent) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mut map = self.core.map();
        for p in &extent.parts {
            map.watch_writeback(p.line.slot, self.batch, &p.sectors());
            slots.push(p.line.slot);
        }
    }
}

impl Drop for WritebackWatches<'_> {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut *self.slots.lock().unwrap_or_else(|p| p.into_inner()));
        let mut map = self.core.map();
        for slot in slots {
            map.unwatch_writeback(slot, self.batch);
        }
    }
}

impl Cache {
    /// Plans and writes back one batch of dirty lines in address order, `depth` writes in
    /// flight, then flushes the backing devices, records the lines clean and commits.
    pub fn clean_batch(
        &self,
        cfg: &CleanerConfig,
        depth: usize,
        select: Select,
    ) -> Result<BatchReport> {
        self.clean_batch_paced(cfg, depth, select, cfg.batch_lines, Pace::ToTheEnd)
    }

    /// `clean_batch` with `batch_lines` lines, its writes paced by `pace`.
    fn clean_batch_paced(
        &self,
        cfg: &CleanerConfig,
        depth: usize,
        select: Select,
        batch_lines: usize,
        pace: Pace,
    ) -> Result<BatchReport> {
        self.core().check_running()?;
        let lines = self.plan(batch_lines, select);
        if lines.is_empty() {
            return Ok(BatchReport::default());
        }
        let extents = merge_extents(&lines, self.layout().line_size, cfg.max_write);
        let watches = WritebackWatches::new(self.core());
        let outcomes = self.write_extents(&extents, depth.max(1), pace, &watches);
        let mut report = BatchReport::default();
        let mut cleaned: HashMap<u32, (DirtyLine, SectorBitmap)> = HashMap::new();
        // One snapshot: a volume added meanwhile has no line in this batch.
        let volumes = self.volumes();
        let mut touched = vec![false; volumes.len()];
        let index_of = |id: u16| volumes.iter().position(|v| v.id() == id);
        for (extent, outcome) in extents.iter().zip(&outcomes) {
            match outcome {
                Outcome::Written => {
                    report.writes += 1;
                    report.bytes_written += extent.len;
                    if let Some(i) = index_of(extent.volume) {
                        touched[i] = true;
                    }
                    for p in &extent.parts {
                        let entry = cleaned
                            .entry(p.line.slot)
                            .or_insert((p.line, SectorBitmap::default()));
                        entry.1.union_with(&p.sectors());
                    }
                }
                Outcome::Skipped => report.extents_skipped += 1,
                Outcome::Failed => report.extents_failed += 1,
                Outcome::Deferred => report.extents_deferred += 1,
            }
        }
        self.pass_over_unwritten(&extents, &outcomes);
        self.resume_sweep_at_deferred(select, &extents, &outcomes);
        self.lock_sweep().release_if_done();
        // Finished sweeps go: their memory, and a fresh snapshot at the next turn.
        self.lock_volume_sweeps()
            .retain(|_, sweep| !sweep.is_done());
        // Clean before forgetting: nothing is recorded clean until the backing device says
        // the data is durable.
        for (vol, _) in touched.iter().enumerate().filter(|(_, t)| **t) {
            let v = &volumes[vol];
            v.backing()
                .flush_checked()
                .inspect_err(|_| v.count_pub(Counter::BackingErrors, 1))?;
        }
        report.lines_cleaned = self.core().with_map(|map| {
            let mut marked = 0;
            for (line, sectors) in cleaned.values() {
                marked += u64::from(map.mark_clean(line, sectors, watches.batch)?);
            }
            Ok(marked)
        })?;
        drop(watches);
        for (e, outcome) in extents.iter().zip(&outcomes) {
            if let (Outcome::Written, Some(i)) = (outcome, index_of(e.volume)) {
                volumes[i].count_pub(Counter::BytesCleaned, e.len);
            }
        }
        self.core().commit(CommitPurpose::Writeback)?;
        Ok(report)
    }

    /// Lines of extents not written back go to the warm end of the dirty queue, so batches
    /// of the coldest lines move on past lines that cannot be written back now (a cache read
    /// error, a backing write error, damage), as the address-ordered sweep moves its cursor.
    fn pass_over_unwritten(&self, extents: &[Extent], outcomes: &[Outcome]) {
        let mut map = self.core().map();
        for (extent, outcome) in extents.iter().zip(outcomes) {
            if matches!(outcome, Outcome::Skipped | Outcome::Failed) {
                for p in &extent.parts {
                    map.pass_over_dirty(p.line.slot, p.line.key);
                }
            }
        }
    }

    /// The address-ordered sweep goes on from the first line a batch deferred, not past it
    /// (the sweep moved past the whole batch when it was planned). The coldest-first
    /// selection needs nothing: deferred lines are still the coldest.
    fn resume_sweep_at_deferred(&self, select: Select, extents: &[Extent], outcomes: &[Outcome]) {
        if let Select::Coldest = select {
            return;
        }
        let first_deferred = extents
            .iter()
            .zip(outcomes)
            .filter(|(_, o)| matches!(o, Outcome::Deferred))
            .flat_map(|(e, _)| e.parts.iter().map(|p| p.line.key))
            .min();
        match (select, first_deferred) {
            (Select::Volume(id), Some(key)) => {
                if let Some(sweep) = self.lock_volume_sweeps().get_mut(&id) {
                    sweep.rewind_to(key);
                }
            }
            (_, Some(key)) => self.lock_sweep().rewind_to(key),
            (_, None) => {}
        }
    }

    pub(crate) fn lock_volume_sweeps(
        &self,
    ) -> crate::sync::MutexGuard<'_, HashMap<u16, DirtySweep>> {
        // Changed only in short non-panicking sections, as the shared sweep.
        self.cleaner
            .volume_sweeps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn lock_sweep(&self) -> crate::sync::MutexGuard<'_, DirtySweep> {
        // The sweep is only changed in short non-panicking sections.
        self.cleaner.sweep.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A sweep snapshot of the lines dirty now: their (key, slot) pairs copied under the map's
    /// read lock `SNAPSHOT_CHUNK` slots at a time (room reserved before each, so the lock is
    /// never held across an allocation), then sorted with no lock held. Its memory, 12 bytes
    /// per dirty line, is bounded by the cache's lines.
    /// Only the lines whose key `keep` takes are kept (after each chunk's copy).
    fn snapshot_dirty(&self, keep: &dyn Fn(LineKey) -> bool) -> DirtySweep {
        let (slots, dirty) = {
            let map = self.core().map_read();
            (map.slot_count(), map.total_dirty_lines())
        };
        let mut entries: Vec<SweepEntry> = Vec::with_capacity(dirty as usize);
        let mut first = 0u32;
        while first < slots {
            let end = first.saturating_add(SNAPSHOT_CHUNK).min(slots);
            // Exact: growing by doubling could take twice the snapshot's memory for a moment.
            entries.reserve_exact((end - first) as usize);
            let before = entries.len();
            self.core()
                .map_read()
                .copy_dirty_slots(first..end, &mut entries);
            let mut i = before;
            while i < entries.len() {
                if keep(entries[i].key()) {
                    i += 1;
                } else {
                    entries.swap_remove(i);
                }
            }
            first = end;
        }
        entries.shrink_to_fit();
        DirtySweep::new(entries)
    }

    /// The dirty lines of the next batch, in address order.
    fn plan(&self, batch_lines: usize, select: Select) -> Vec<DirtyLine> {
        // A batch of no lines would never move the sweep (review 17: a drain spun for ever).
        let batch_lines = batch_lines.max(1);
        let offline = self.unwritable_volumes();
        if let Select::Coldest = select {
            let mut map = self.core().map();
            let mut passed = Vec::new();
            let mut lines =
                map.coldest_dirty_lines(batch_lines, COLDEST_SCAN_LIMIT, &mut |l: &DirtyLine| {
                    let writable = !offline.contains(volume_of(l.key));
                    if !writable {
                        passed.push((l.slot, l.key));
                    }
                    writable
                });
            // An offline volume's lines go to the warm end, as unwritable ones do
            // (`pass_over_unwritten`): otherwise they could fill every scan of the coldest.
            for (slot, key) in passed {
                map.pass_over_dirty(slot, key);
            }
            drop(map);
            lines.sort_unstable_by_key(|l| l.key);
            return lines;
        }
        let mut want = |l: &DirtyLine| {
            !offline.contains(volume_of(l.key))
                && match select {
                    Select::All => true,
                    Select::DirtySince(t) => l.since <= t,
                    Select::Coldest => true,
                    Select::Volume(id) => volume_of(l.key) == id,
                }
        };
        if let Select::Volume(id) = select {
            // A sweep of its own: taking one volume's lines from the shared sweep would use
            // up the other volumes' entries, delaying their aged lines by a whole cycle
            // (review 37).
            let mut sweeps = self.lock_volume_sweeps();
            let sweep = sweeps
                .entry(id)
                .or_insert_with(|| DirtySweep::new(Vec::new()));
            let snapshot = || self.snapshot_dirty(&|key| volume_of(key) == id);
            return self.plan_from(sweep, batch_lines, &mut want, &snapshot);
        }
        let snapshot = || self.snapshot_dirty(&|_| true);
        self.plan_from(&mut self.lock_sweep(), batch_lines, &mut want, &snapshot)
    }

    /// The next `batch_lines` lines `want` takes from `sweep`, in address order; a fresh
    /// `snapshot` once when it is done.
    fn plan_from(
        &self,
        sweep: &mut DirtySweep,
        batch_lines: usize,
        want: &mut dyn FnMut(&DirtyLine) -> bool,
        snapshot: &dyn Fn() -> DirtySweep,
    ) -> Vec<DirtyLine> {
        let mut fresh = false;
        let mut lines = Vec::new();
        let mut holds = 0;
        // Ends: each round looks at one entry at least, or takes a fresh snapshot (once).
        loop {
            if sweep.is_done() {
                if !lines.is_empty() {
                    return lines;
                }
                if fresh {
                    // Nothing to take: give the snapshot's memory back now, not at the next plan.
                    sweep.release_if_done();
                    return lines;
                }
                *sweep = snapshot();
                fresh = true;
            }
            lines.extend(sweep.take(
                &self.core().map_read(),
                batch_lines - lines.len(),
                PLAN_SCAN_LIMIT,
                DamagedLines::Skip,
                want,
            ));
            holds += 1;
            if lines.len() >= batch_lines || (!lines.is_empty() && holds >= PLAN_HOLDS) {
                return lines;
            }
        }
    }

    fn write_extents(
        &self,
        extents: &[Extent],
        depth: usize,
        pace: Pace,
        watches: &WritebackWatches,
    ) -> Vec<Outcome> {
        // Once a client used the disk, no write of this batch starts any more (latched: the
        // batch's remaining lines wait for a trickled one rather than resume at full depth).
        let client_came = AtomicBool::new(false);
        in_parallel(extents, depth, |extent| {
            if !matches!(pace, Pace::ToTheEnd) && self.cleaner.stop.load(Ordering::Acquire) {
                return Outcome::Deferred;
            }
            if let Pace::WhileIdle(idle_after) = pace {
                if client_came.load(Ordering::Acquire)
                    || self.core().backing_idle_for() < idle_after
                {
                    client_came.store(true, Ordering::Release);
                    return Outcome::Deferred;
                }
            }
            // A halted engine starts no further writeback (§4.7).
            let outcome = match self.core().check_running() {
                Ok(()) => self.write_extent(extent, watches),
                Err(_) => Outcome::Failed,
            };
            if let Pace::Trickle(p) = pace {
                std::thread::sleep(p);
            }
            outcome
        })
        .into_iter()
        .map(|r| r.unwrap_or(Outcome::Failed))
        .collect()
    }

    /// Reads an extent's dirty sectors from the cache holding its lines, checks them, marks the
    /// range as being written back, releases the lines and writes the backing device: hits on
    /// the lines never wait for the disk, and a client write to the backing device of the
    /// range waits for this one (`Backing::wait_for_writebacks`), so this older data can never
    /// land after it. From the read on, the extent's slots are watched (`watches`): a sector
    /// whose data changes meanwhile is not recorded clean; the line's other sectors may change.
    fn write_extent(&self, extent: &Extent, watches: &WritebackWatches) -> Outcome {
        let core = self.core();
        let line_size = self.layout().line_size;
        let (first, last) = (
            extent.offset / line_size,
            (extent.offset + extent.len - 1) / line_size,
        );
        let held = core.locks.lock_range(extent.volume, first, last);
        let mut crcs = vec![0u32; (extent.len / SECTOR_SIZE) as usize];
        // The checksums may have to be read from their metadata pages first.
        let planned = core.read_map_paged(|map| {
            let changed = extent
                .parts
                .iter()
                .any(|p| !map.still_dirty(&p.line, p.first, p.count));
            if changed {
                return Ok(false);
            }
            let mut at = 0;
            for p in &extent.parts {
                map.sector_crcs(p.line.slot, p.first, &mut crcs[at..at + p.count])?;
                at += p.count;
            }
            Ok(true)
        });
        match planned {
            Ok(true) => {}
            Ok(false) => return Outcome::Skipped,
            Err(_) => return Outcome::Failed,
        }
        let Some(volume) = self
            .volumes()
            .iter()
            .find(|v| v.id() == extent.volume)
            .cloned()
        else {
            return Outcome::Failed;
        };
        let Some(mut buf) = AlignedBuf::try_zeroed(extent.len as usize) else {
            return Outcome::Failed;
        };
        let mut at = 0usize;
        for p in &extent.parts {
            let len = p.count * SECTOR_SIZE as usize;
            let from =
                self.layout().slot_offset(u64::from(p.line.slot)) + p.first as u64 * SECTOR_SIZE;
            if let Err(e) = core.dev.read_at(&mut buf[at..at + len], from) {
                volume.count_pub(Counter::DirtyLinesLost, 1);
                volume.cleaner_read_failed(e);
                return Outcome::Failed;
            }
            at += len;
        }
        if let Err(e) = self.check_extent(&volume, extent, &buf, &crcs) {
            volume.cleaner_read_failed(e);
            return Outcome::Failed;
        }
        watches.watch(extent);
        let _in_flight = volume.backing().begin_writeback(extent.offset, extent.len);
        drop(held);
        if let Err(e) = volume.backing().write_back_at(&buf, extent.offset) {
            volume.count_pub(Counter::BackingErrors, 1);
            tracing::warn!(volume = %volume.name(), "writeback to {} failed: {e}", volume.backing().describe());
            return Outcome::Failed;
        }
        Outcome::Written
    }

    /// Checks an extent's data against its checksums before it may reach the backing device.
    /// Damaged sectors are marked (the next batches leave them alone) and the extent is
    /// refused whole, naming them.
    fn check_extent(
        &self,
        volume: &Volume,
        extent: &Extent,
        data: &[u8],
        crcs: &[u32],
    ) -> std::io::Result<()> {
        let sectors = extent
            .parts
            .iter()
            .flat_map(|p| (p.first..p.first + p.count).map(move |s| (p.line.slot, s)));
        let mut damaged = Vec::new();
        for (i, ((slot, s), sector)) in sectors.zip(data.chunks(SECTOR_SIZE as usize)).enumerate() {
            if sector_crc(sector) != crcs[i]
                && self.core().settle_mismatch(slot, s, sector) == Mismatch::Damaged
            {
                volume.count_pub(Counter::ChecksumErrors, 1);
                damaged.push(extent.offset + i as u64 * SECTOR_SIZE);
            }
        }
        if damaged.is_empty() {
            return Ok(());
        }
        let msg = format!(
            "writeback refused: {} dirty sector(s) of volume '{}' in bytes [{}, +{}) do not match \
             their checksums (first at byte {}): the cache lost or damaged them. They stay dirty \
             in the cache and are never written back; the backing device keeps its older data",
            damaged.len(),
            volume.name(),
            extent.offset,
            extent.len,
            damaged[0]
        );
        tracing::error!("{msg}");
        Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg))
    }

    /// Reads every dirty sector back from the cache and checks it against its checksum,
    /// holding each line while it does, so nothing is written back before the whole dirty set
    /// is known to be sound. `progress` gets the dirty bytes checked so far and may stop the
    /// check (returning false). Returns the ranges that are damaged or unreadable (empty when
    /// everything can be written back).
    pub fn verify_dirty(&self, progress: &mut dyn FnMut(u64) -> bool) -> Result<Vec<DamagedRange>> {
        self.verify_dirty_of(&|_| true, progress)
    }

    /// [`Cache::verify_dirty`] of the volumes (by id) `scope` takes: the damage it reports, and
    /// the lines it reads, are theirs only.
    fn verify_dirty_of(
        &self,
        scope: &dyn Fn(u16) -> bool,
        progress: &mut dyn FnMut(u64) -> bool,
    ) -> Result<Vec<DamagedRange>> {
        self.core().check_running()?;
        // Lines dirtied after the snapshot are new writes, checked as every extent is before
        // it is written back (`check_extent`).
        let mut sweep = self.snapshot_dirty(&|key| scope(volume_of(key)));
        let mut checked = 0u64;
        while !sweep.is_done() {
            let lines = sweep.take(
                &self.core().map_read(),
                VERIFY_CHUNK,
                VERIFY_CHUNK,
                DamagedLines::Include,
                &mut |l: &DirtyLine| scope(volume_of(l.key)),
            );
            if lines.is_empty() {
                continue;
            }
            for bytes in in_parallel(&lines, VERIFY_DEPTH, |line| self.verify_line(line)) {
                checked += bytes.unwrap_or(Ok(0))?;
            }
            if !progress(checked) {
                break;
            }
        }
        Ok(self.damaged_ranges_of(scope))
    }

    /// Checks the dirty sectors of one line as it is now, one read per run of dirty sectors;
    /// returns the bytes checked. A run that cannot be read is read again once, then its
    /// sectors count as damaged (they cannot be written back either).
    fn verify_line(&self, planned: &DirtyLine) -> Result<u64> {
        let core = self.core();
        let (volume_id, line) = (volume_of(planned.key), line_of(planned.key));
        let _held = core.locks.lock_range(volume_id, line, line);
        let spl = self.layout().sectors_per_line() as usize;
        let mut crcs = [0u32; 256];
        let found = core.read_map_paged(|map| {
            if map.key_of(planned.slot) != planned.key {
                return Ok(None); // written back or dropped meanwhile
            }
            let confirm = map.sector_crcs(planned.slot, 0, &mut crcs[..spl])?;
            Ok(Some((
                map.dirty_of(planned.slot).unwrap_or_default(),
                confirm,
            )))
        })?;
        let Some((dirty, confirm)) = found else {
            return Ok(0);
        };
        let mut matched = SectorBitmap::default();
        let mut buf = AlignedBuf::zeroed(self.layout().line_size as usize);
        let base = self.layout().slot_offset(u64::from(planned.slot));
        let mut bytes = 0;
        let mut s = 0;
        while s < spl {
            if !dirty.get(s) {
                s += 1;
                continue;
            }
            let end = (s..spl).find(|&t| !dirty.get(t)).unwrap_or(spl);
            let run = &mut buf[..(end - s) * SECTOR_SIZE as usize];
            let at = base + s as u64 * SECTOR_SIZE;
            let readable = core.dev.read_at(run, at).is_ok() || core.dev.read_at(run, at).is_ok();
            for (i, sector) in run.chunks(SECTOR_SIZE as usize).enumerate() {
                if !readable {
                    core.map().mark_unreadable(planned.slot, s + i);
                } else if sector_crc(sector) == crcs[s + i] {
                    matched.set(s + i, true);
                } else {
                    // Marks the sector damaged unless the data is a newer write it accepts.
                    core.settle_mismatch(planned.slot, s + i, sector);
                }
            }
            bytes += run.len() as u64;
            s = end;
        }
        if confirm {
            core.map().confirm_sectors(planned.slot, &matched);
        }
        Ok(bytes)
    }

    /// The dirty ranges known to be damaged or unreadable, merged, in volume and address order.
    pub fn damaged_ranges(&self) -> Vec<DamagedRange> {
        self.damaged_ranges_of(&|_| true)
    }

    /// [`Cache::damaged_ranges`] of the volumes (by id) `scope` takes.
    fn damaged_ranges_of(&self, scope: &dyn Fn(u16) -> bool) -> Vec<DamagedRange> {
        let line_size = self.layout().line_size;
        let mut sectors: Vec<(u16, u64)> = self
            .core()
            .map()
            .damaged_slots()
            .into_iter()
            .filter(|(_, key, _)| scope(volume_of(*key)))
            .flat_map(|(_, key, bits)| {
                (0..256).filter(move |&s| bits.get(s)).map(move |s| {
                    (
                        volume_of(key),
                        line_of(key) * line_size + s as u64 * SECTOR_SIZE,
                    )
                })
            })
            .collect();
        sectors.sort_unstable();
        let mut out: Vec<DamagedRange> = Vec::new();
        for (id, offset) in sectors {
            let name = self
                .volumes()
                .iter()
                .find(|v| v.id() == id)
                .map_or_else(|| format!("#{id}"), |v| v.name().to_owned());
            match out.last_mut() {
                Some(r) if r.volume == name && r.offset + r.length == offset => {
                    r.length += SECTOR_SIZE
                }
                _ => out.push(DamagedRange {
                    volume: name,
                    offset,
                    length: SECTOR_SIZE,
                }),
            }
        }
        out
    }

    /// Gives up the damaged dirty sectors: they are dropped from the cache (the backing device
    /// keeps its older data there) and the change is committed. For an operator who decided
    /// that data is lost (`--discard-damaged`). Returns what was dropped.
    pub fn discard_damaged(&self) -> Result<Vec<DamagedRange>> {
        self.discard_damaged_of(&|_| true)
    }

    /// Checks one volume's dirty data (by index in [`Cache::volumes`]) and gives up its damaged
    /// sectors only, as [`Cache::discard_damaged`] does: `volume remove --discard-damaged`.
    pub fn discard_damaged_of_volume(
        &self,
        volume: usize,
        progress: &mut dyn FnMut(u64) -> bool,
    ) -> Result<Vec<DamagedRange>> {
        let id = self.volume_at(volume)?.id();
        let scope = move |v: u16| v == id;
        let mut stopped = false;
        self.verify_dirty_of(&scope, &mut |checked| {
            stopped = !progress(checked);
            !stopped
        })?;
        if stopped {
            // Interrupted: nothing is given up on a partial check (review 38).
            return Ok(Vec::new());
        }
        self.discard_damaged_of(&scope)
    }

    fn discard_damaged_of(&self, scope: &dyn Fn(u16) -> bool) -> Result<Vec<DamagedRange>> {
        let ranges = self.damaged_ranges_of(scope);
        let damaged = self.core().map().damaged_slots();
        for (slot, key, _) in damaged
            .into_iter()
            .filter(|(_, key, _)| scope(volume_of(*key)))
        {
            let (volume_id, line) = (volume_of(key), line_of(key));
            let _held = self.core().locks.lock_range(volume_id, line, line);
            self.core().with_map(|map| {
                if map.key_of(slot) != key {
                    return Ok(());
                }
                // As it is now, under the line's lock (a write may have replaced some).
                let bits = map.damaged_of(slot);
                (0..256)
                    .filter(|&s| bits.get(s))
                    .try_for_each(|s| map.invalidate_slot(slot, s, 1))
            })?;
        }
        for r in &ranges {
            tracing::warn!("discarded damaged dirty data: {r}");
        }
        self.commit()?;
        Ok(ranges)
    }

    /// Starts the background cleaner thread and the background committer (once).
    pub fn start_cleaner(self: &Arc<Self>, cfg: CleanerConfig) {
        let mut slot = self
            .cleaner
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return;
        }
        self.cleaner.stop.store(false, Ordering::Release);
        let cache = Arc::clone(self);
        *slot = Some(thread::spawn(move || cache.cleaner_loop(&cfg)));
        self.core().commits.requests().set_running(true);
        let cache = Arc::clone(self);
        *self
            .cleaner
            .committer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) =
            Some(thread::spawn(move || cache.committer_loop()));
    }

    /// Commits when a writer asks (its changes filled a batch) and every second while changes
    /// wait, until stopped. A failed commit is logged; the changes stay queued for the next.
    /// Also writes the modified checksum pages past their budget (`checksums.rs`), when asked
    /// and every second, so no client request writes them.
    fn committer_loop(&self) {
        let requests = self.core().commits.requests();
        while !requests.stopping() {
            requests.wait(Duration::from_secs(1));
            if requests.stopping() {
                continue;
            }
            self.core().retry_failed_checksum_writes();
            if let Err(e) = self.core().write_due_checksum_pages() {
                tracing::warn!("writing checksum pages failed: {e}");
            }
            if self.core().map().changes_pending() == 0 {
                continue;
            }
            if let Err(e) = self.core().commit(CommitPurpose::Writeback) {
                tracing::warn!("background metadata commit failed, retrying in 1 s: {e}");
                if self.core().check_running().is_err() {
                    return;
                }
                // Writers keep asking while their changes wait: pace the retries.
                for _ in 0..10 {
                    if requests.stopping() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// Stops the cleaner thread and the committer and waits for them to finish (the
    /// cleaner's batch, the committer's commit).
    pub fn stop_cleaner(&self) {
        self.cleaner.stop.store(true, Ordering::Release);
        self.core().commits.requests().set_running(false);
        let handles = [&self.cleaner.thread, &self.cleaner.committer]
            .map(|slot| slot.lock().unwrap_or_else(|p| p.into_inner()).take());
        for h in handles.into_iter().flatten() {
            let _ = h.join();
        }
    }

    /// Asks the cleaner to write back everything now (`ssdcache flush`), or to stop doing so.
    pub fn request_drain(&self, on: bool) {
        self.cleaner.draining.store(on, Ordering::Release);
    }

    pub fn draining(&self) -> bool {
        self.cleaner.draining.load(Ordering::Acquire)
    }

    /// Asks the cleaner to write back the dirty data of volume `id` first, at full speed
    /// (`on`), or to stop doing so. For removals while serving (several may be under way); a
    /// request stays until withdrawn, and is passed over once the volume has no dirty data.
    pub fn request_volume_drain(&self, id: u16, on: bool) {
        let bit = 1u32.checked_shl(u32::from(id)).unwrap_or(0);
        if on {
            self.cleaner
                .volumes_to_drain
                .fetch_or(bit, Ordering::AcqRel);
        } else {
            self.cleaner
                .volumes_to_drain
                .fetch_and(!bit, Ordering::AcqRel);
        }
    }

    /// A volume whose drain was requested and which has dirty data to write back.
    fn volume_to_drain(&self) -> Option<u16> {
        let mask = self.cleaner.volumes_to_drain.load(Ordering::Acquire);
        (0..32u16)
            .filter(|id| mask & (1 << id) != 0)
            .find(|&id| self.core().occupancy.of(id).dirty_lines > 0)
    }

    /// The volumes that are offline (`Cache::open_volumes`): nothing of theirs is written back.
    pub(crate) fn offline_volumes(&self) -> VolumeSet {
        let mut set = VolumeSet::default();
        for v in self.volumes().iter() {
            if v.offline_reason().is_some() {
                set.insert(v.id());
            }
        }
        set
    }

    /// The volumes the cleaner writes nothing back to now: the offline ones, and those whose
    /// backing device cannot be reached (a network export reconnecting). Writing to an
    /// unreachable device would only fail, and each failed write is due for the next backing
    /// flush (`commit.rs`), which would then fail every commit and client FLUSH of the volume
    /// while it is away, when write-back can otherwise go on absorbing writes.
    fn unwritable_volumes(&self) -> VolumeSet {
        let mut set = self.offline_volumes();
        for v in self.volumes().iter() {
            if v.backing_unreachable().is_some() {
                set.insert(v.id());
            }
        }
        set
    }

    /// Why no dirty data of the volumes `scope` takes can be written back now, if a backing
    /// device is unreachable.
    fn unreachable_note(&self, scope: &dyn Fn(u16) -> bool) -> String {
        let away: Vec<String> = self
            .volumes()
            .iter()
            .filter(|v| scope(v.id()))
            .filter_map(|v| {
                v.backing_unreachable()
                    .map(|why| format!("volume '{}': {why}", v.name()))
            })
            .collect();
        if away.is_empty() {
            return String::new();
        }
        format!("; backing device unreachable ({})", away.join("; "))
    }

    /// Dirty lines of the volumes that are not offline and whose backing device can be
    /// reached: what the cleaner can write back now (with only others' dirty lines, it waits
    /// instead of planning empty batches). From the occupancy figures, without the map's lock.
    pub fn writable_dirty_lines(&self) -> u64 {
        self.volumes()
            .iter()
            .filter(|v| v.offline_reason().is_none() && v.backing_unreachable().is_none())
            .map(|v| self.core().occupancy.of(v.id()).dirty_lines)
            .sum()
    }

    /// A volume (not offline) whose dirty lines reached 90% of its own cap
    /// (`Volume::dirty_room_lines`: its dirty cap or occupancy cap): the cleaner writes its
    /// lines back before its writes must go around.
    /// Taken in turns after `turns.last`, skipping volumes resting after a batch that wrote
    /// nothing back (review 37: the first one found, stuck on a failing disk, hid the others).
    fn volume_near_dirty_cap(&self, turns: &CapTurns) -> Option<u16> {
        let volumes = self.volumes();
        let start = turns
            .last
            .and_then(|id| volumes.iter().position(|v| v.id() == id))
            .map_or(0, |i| i + 1);
        (0..volumes.len())
            .map(|k| &volumes[(start + k) % volumes.len()])
            .filter(|v| v.offline_reason().is_none() && !turns.resting(v.id()))
            .find(|v| {
                v.dirty_room_lines().is_some_and(|cap| {
                    let dirty = self.core().occupancy.of(v.id()).dirty_lines;
                    dirty > 0 && dirty * 10 >= cap * 9
                })
            })
            .map(|v| v.id())
    }

    /// Dirty lines of every volume, offline ones included, from the occupancy figures (no lock).
    fn all_dirty_lines(&self) -> u64 {
        self.volumes()
            .iter()
            .map(|v| self.core().occupancy.of(v.id()).dirty_lines)
            .sum()
    }

    /// How long the oldest dirty data has been dirty (offline volumes' included), as the
    /// running cleaner last saw it (it looks about every second, between batches, so a long
    /// batch may leave it a little behind); `None` without dirty data or before the cleaner
    /// has looked. Takes no lock. Data dirty before the daemon started counts from the start:
    /// the metadata keeps no time.
    pub fn oldest_dirty_age(&self) -> Option<Duration> {
        let since = self.cleaner.oldest_dirty_since.load(Ordering::Relaxed);
        if since == u64::MAX || self.all_dirty_lines() == 0 {
            return None;
        }
        let now = u64::from(self.core().now_secs());
        Some(Duration::from_secs(now.saturating_sub(since)))
    }

    /// Sleeps for `pause`, in 20 ms steps, returning early once the cleaner is stopped: a
    /// stop never waits out a retry pause.
    fn pause_unless_stopped(&self, pause: Duration) {
        let until = Instant::now() + pause;
        while !self.cleaner.stop.load(Ordering::Acquire) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
    }

    fn cleaner_loop(&self, cfg: &CleanerConfig) {
        let line_count = self.layout().line_count.max(1) as f64;
        let mut above_high = false;
        let mut oldest: Option<u32> = None;
        let mut oldest_checked = Instant::now() - Duration::from_secs(10);
        let mut turns = CapTurns::default();
        while !self.cleaner.stop.load(Ordering::Acquire) {
            // Dirty data of offline volumes cannot be written back: the watermarks apply to
            // the other lines (docs/design.md §5.1), and with only that, the cleaner waits.
            let writable = self.writable_dirty_lines();
            let stuck = self.all_dirty_lines().saturating_sub(writable) as f64;
            let share = writable as f64 / (line_count - stuck).max(1.0);
            above_high = share >= cfg.high_watermark || (above_high && share > cfg.low_watermark);
            if oldest_checked.elapsed() >= Duration::from_secs(1) {
                let offline = self.unwritable_volumes();
                let map = self.core().map_read();
                oldest = map.oldest_dirty_since(&|volume| !offline.contains(volume));
                // What the metric shows includes offline volumes' dirty data: the most at risk.
                let oldest_of_all = if offline.is_empty() {
                    oldest
                } else {
                    map.oldest_dirty_since(&|_| true)
                };
                drop(map);
                oldest_checked = Instant::now();
                let published = oldest_of_all.map_or(u64::MAX, u64::from);
                self.cleaner
                    .oldest_dirty_since
                    .store(published, Ordering::Relaxed);
            }
            let now = self.core().now_secs();
            let age_limit = cfg.max_age.as_secs().min(u64::from(u32::MAX)) as u32;
            let aged = oldest.is_some_and(|t| now.saturating_sub(t) >= age_limit);
            let draining = self.draining();
            if draining && writable == 0 {
                self.request_drain(false);
            }
            let capped = self.volume_near_dirty_cap(&turns);
            let volume_drain = self.volume_to_drain();
            let urgent = draining || volume_drain.is_some();
            if writable == 0 || !(urgent || above_high || aged || capped.is_some()) {
                // (The committer commits every second meanwhile.)
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            // Clients come first on the backing device, also above the watermark: while they
            // use it the cleaner trickles (one write in flight, a pause after each; when the
            // cache is full of dirty data the clients' writes go to the disk, and they would
            // otherwise lose it to the cleaner's). Only an explicit flush takes it whole.
            // A batch begun on an idle disk ends early, at the first client request that uses
            // it (`Pace::WhileIdle`): otherwise a batch of thousands of scattered lines, begun
            // while a write burst filled the cache, would keep its full depth for many seconds
            // after the clients' writes began to go to the disk (measured: half the disk, and
            // random writes at 0.58x the bare disk; issue 11).
            let idle = self.core().backing_idle_for() >= cfg.idle_after;
            let (depth, batch, pace) = if urgent {
                (cfg.max_in_flight, cfg.batch_lines, Pace::Flush)
            } else if idle {
                (
                    cfg.max_in_flight,
                    cfg.batch_lines,
                    Pace::WhileIdle(cfg.idle_after),
                )
            } else {
                (
                    cfg.busy_in_flight,
                    cfg.busy_batch_lines,
                    Pace::Trickle(cfg.busy_pause),
                )
            };
            // A drain takes everything, fastest in address order; dirty pressure takes the
            // lines nearest eviction.
            let select = if let Some(id) = volume_drain {
                Select::Volume(id)
            } else if draining {
                Select::All
            } else if above_high {
                Select::Coldest
            } else if let Some(id) = capped.filter(|_| !(aged && turns.last_was_volume)) {
                // Aged data of every volume gets every other batch (review 37).
                Select::Volume(id)
            } else {
                Select::DirtySince(now.saturating_sub(age_limit))
            };
            let result = self.clean_batch_paced(cfg, depth, select, batch, pace);
            turns.after_batch(select, result.as_ref().map_or(0, |r| r.lines_cleaned));
            match result {
                Ok(r) => {
                    if r.lines_cleaned == 0 {
                        if aged && !draining && !above_high {
                            oldest_checked = Instant::now() - Duration::from_secs(10);
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                Err(e) => {
                    tracing::warn!("writeback batch failed, retrying in 1 s: {e}");
                    self.pause_unless_stopped(Duration::from_secs(1));
                }
            }
        }
    }

    /// Writes back every dirty line now, in the calling thread, calling `progress` after each
    /// batch with the dirty bytes left; `progress` returning false stops early (what was
    /// written back stays clean, so a later call resumes). Fails when lines cannot be written
    /// back after repeated tries.
    ///
    /// First every dirty sector is checked against its checksum (`verify_dirty`): if any is
    /// damaged, nothing is written back and the error names the ranges.
    pub fn drain(&self, cfg: &CleanerConfig, progress: &mut dyn FnMut(u64) -> bool) -> Result<()> {
        self.drain_scope(cfg, None, progress)
    }

    /// [`Cache::drain`] of one volume's dirty data only (by index in [`Cache::volumes`]), or
    /// of every volume that is not offline.
    fn drain_scope(
        &self,
        cfg: &CleanerConfig,
        volume: Option<usize>,
        progress: &mut dyn FnMut(u64) -> bool,
    ) -> Result<()> {
        // Only the volumes drained are checked: another's damage (or an offline volume's) must
        // not hold this up (review 36).
        let offline = self.offline_volumes();
        let target = volume.map(|i| self.volume_at(i)).transpose()?;
        let target = target.as_deref();
        let select = target.map_or(Select::All, |v| Select::Volume(v.id()));
        let scope = |id: u16| target.map_or(!offline.contains(id), |v| id == v.id());
        let dirty_left =
            || target.map_or_else(|| self.writable_dirty_bytes(), |v| v.stats().dirty_bytes);
        let left = dirty_left();
        if left > 0 {
            let damaged = self.verify_dirty_of(&scope, &mut |_| progress(left))?;
            if !damaged.is_empty() {
                return Err(EngineError::DataDamaged(describe_damage(&damaged)));
            }
        }
        let mut stuck_rounds = 0;
        let mut busy_rounds = 0;
        let mut unreachable_since: Option<Instant> = None;
        loop {
            let left = dirty_left();
            if left == 0 || !progress(left) {
                return self.commit();
            }
            let r = match self.clean_batch(cfg, cfg.max_in_flight, select) {
                Ok(r) => r,
                // Its flush could not reach a device that went away meanwhile (review 49):
                // wait for it as below.
                Err(e) if !self.unreachable_note(&scope).is_empty() => {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < DRAIN_UNREACHABLE_WAIT {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            if r.lines_cleaned == 0 && !self.unreachable_note(&scope).is_empty() {
                // A backing device reconnecting: wait for it as its requests do, bounded.
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                if since.elapsed() < DRAIN_UNREACHABLE_WAIT {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            } else {
                unreachable_since = None;
            }
            if r.lines_cleaned == 0 {
                let damaged = self.damaged_ranges_of(&scope);
                if !damaged.is_empty() {
                    return Err(EngineError::DataDamaged(describe_damage(&damaged)));
                }
                if r.extents_failed == 0 && r.extents_skipped + r.extents_deferred > 0 {
                    // Nothing failed: clients changed the lines (or used the disk) while
                    // each writeback ran, which passes it over. Try again after a pause, for
                    // a bounded time.
                    busy_rounds += 1;
                    if busy_rounds > DRAIN_BUSY_ROUNDS {
                        return Err(EngineError::Format(format!(
                            "{left} dirty bytes could not be written back: clients changed \
                             their lines during every try for {} s; stop writes to the volume \
                             (or switch it to write-through) and retry",
                            (DRAIN_BUSY_PAUSE * DRAIN_BUSY_ROUNDS).as_secs()
                        )));
                    }
                    std::thread::sleep(DRAIN_BUSY_PAUSE);
                    continue;
                }
                stuck_rounds += 1;
                if stuck_rounds > 3 {
                    return Err(EngineError::Format(format!(
                        "{} dirty bytes cannot be written back ({} extents failed in the last \
                         batch){}: see the log for the device errors",
                        left,
                        r.extents_failed,
                        self.unreachable_note(&scope)
                    )));
                }
            } else {
                stuck_rounds = 0;
                busy_rounds = 0;
            }
        }
    }

    /// Dirty bytes in the whole cache.
    pub fn dirty_bytes(&self) -> u64 {
        self.volumes().iter().map(|v| v.stats().dirty_bytes).sum()
    }

    /// Dirty bytes of the volumes that are not offline: what a drain writes back (an offline
    /// volume's wait for a start that finds its backing device).
    pub fn writable_dirty_bytes(&self) -> u64 {
        self.volumes()
            .iter()
            .filter(|v| v.offline_reason().is_none())
            .map(|v| v.stats().dirty_bytes)
            .sum()
    }

    /// The volume at `index` in [`Cache::volumes`], or an error naming the index.
    pub(crate) fn volume_at(&self, index: usize) -> Result<Arc<Volume>> {
        self.volumes()
            .get(index)
            .cloned()
            .ok_or_else(|| EngineError::Format(format!("no volume {index}")))
    }

    /// Empties a volume before its slot is removed from the superblock (`ssdcache volume
    /// remove`, with no client connected): its dirty data is written back (with `progress`,
    /// which may stop it), then every line of it is dropped, so no record in the checkpoint
    /// the following [`Cache::shutdown`] writes names its id, and a volume added later in the
    /// same slot can never be served this one's data. Its mode becomes write-through first, so
    /// nothing new is dirtied meanwhile.
    pub fn empty_volume(
        &self,
        volume: usize,
        cfg: &CleanerConfig,
        progress: &mut dyn FnMut(u64) -> bool,
    ) -> Result<()> {
        let v = self.volume_at(volume)?;
        if let Some(reason) = v.offline_reason() {
            if v.stats().dirty_bytes > 0 {
                return Err(EngineError::VolumeOffline {
                    name: v.name().to_owned(),
                    reason: reason.to_owned(),
                });
            }
        }
        if v.configured_mode() == CacheMode::WriteBack {
            v.set_serving_mode(CacheMode::WriteThrough);
        }
        self.drain_scope(cfg, Some(volume), progress)?;
        let left = v.stats().dirty_bytes;
        if left > 0 {
            return Err(EngineError::Format(format!(
                "interrupted with {left} dirty bytes of volume '{}' not written back; nothing \
                 was removed",
                v.name()
            )));
        }
        self.drop_all_lines_of(&v)
    }

    /// Drops every line of `v`, which holds no dirty data, and checks none is left (a broken
    /// invariant halts).
    pub(crate) fn drop_all_lines_of(&self, v: &Volume) -> Result<()> {
        self.drop_lines_of(v.id())?;
        let held = self.core().occupancy.of(v.id()).lines;
        if held > 0 {
            return Err(self.core().halt(format!(
                "volume '{}' still holds {held} lines after they were all dropped",
                v.name()
            )));
        }
        Ok(())
    }

    /// Drops every line of a volume that holds no dirty data, each under its line lock.
    /// A dirty one would be a broken invariant (its data written back just before).
    fn drop_lines_of(&self, id: u16) -> Result<()> {
        let sectors = self.layout().sectors_per_line() as usize;
        let slots = self.core().map_read().slot_count();
        for slot in 0..slots {
            let key = self.core().map_read().key_of(slot);
            if key == NO_KEY || volume_of(key) != id {
                continue;
            }
            let _held = self.core().locks.lock_range(id, line_of(key), line_of(key));
            self.core().with_map(|map| {
                if map.key_of(slot) != key {
                    return Ok(());
                }
                if map.dirty_of(slot).is_some_and(|d| !d.is_empty()) {
                    return Err(crate::map::Invariant(format!(
                        "slot {slot} of volume {id} is dirty while the volume is emptied"
                    )));
                }
                map.invalidate_slot(slot, 0, sectors)
            })?;
        }
        Ok(())
    }

    /// Stops a write-back volume from making new dirty data (its writes go through) while
    /// its dirty data is written back; `set_mode` then completes the change.
    pub fn hold_writes_through(&self, volume: usize) {
        if let Some(v) = self.volumes().get(volume) {
            v.set_serving_mode(CacheMode::WriteThrough);
        }
    }

    /// Undoes `hold_writes_through` for volumes whose mode change was abandoned: they serve
    /// writes in write-back again.
    pub fn release_held_modes(&self) {
        for v in self.volumes().iter() {
            if v.configured_mode() == CacheMode::WriteBack && v.mode() == CacheMode::WriteThrough {
                v.set_serving_mode(CacheMode::WriteBack);
            }
        }
    }

    /// Changes a volume's mode. Leaving write-back first stops new dirty data (writes go
    /// through), then writes every dirty line back, reporting progress, then switches.
    pub fn set_mode(
        &self,
        volume: usize,
        mode: CacheMode,
        cfg: &CleanerConfig,
        progress: &mut dyn FnMut(u64) -> bool,
    ) -> Result<()> {
        let v = self.volume_at(volume)?;
        if v.configured_mode() == CacheMode::WriteBack && mode != CacheMode::WriteBack {
            // Writes go through from here on (once those in flight finished), so the drain
            // below sees all the dirty data; the configured (persisted) mode changes only
            // once it is all written back, and a failed drain leaves the volume write-back.
            v.set_serving_mode(CacheMode::WriteThrough);
            let drained = self.drain_scope(cfg, Some(volume), progress);
            if drained.is_err() || v.stats().dirty_bytes > 0 {
                v.set_serving_mode(CacheMode::WriteBack);
                drained?;
                return Err(EngineError::Format(
                    "mode change interrupted before the dirty data was written back; the volume \
                     stays in write-back"
                        .into(),
                ));
            }
        }
        v.set_mode(mode);
        Ok(())
    }
}

/// Lines checked at once by `verify_dirty` (an SSD serves a queue much faster than one read
/// at a time).
const VERIFY_DEPTH: usize = 8;

/// Sweep entries `verify_dirty` plans at once (and looks at per hold of the map's lock).
const VERIFY_CHUNK: usize = 256;

/// Slots a sweep snapshot copies per hold of the map's read lock: at most 0.57 ms on this
/// 2-vCPU machine with every slot dirty, when not preempted (writers wait that long; hits
/// share the read lock). Measured by `map::tests::sweep_cost_at_64_gib_all_dirty`.
const SNAPSHOT_CHUNK: u32 = 1 << 16;

/// Snapshot entries a sweep's plan looks at per hold of the map's read lock (entries whose
/// line is no longer dirty there, or not wanted, are passed over; the plan goes on under a
/// new hold until it has a batch, or some lines after `PLAN_HOLDS` holds, or the sweep is
/// done). About 135 ns per entry looked at on this machine, so about 1.1 ms per hold (review
/// 17: at 65,536 entries an age-based plan, whose lines are mostly too young, held it ~9 ms).
const PLAN_SCAN_LIMIT: usize = 1 << 13;

/// Holds after which a plan with some lines returns them (as one hold of 65,536 did before).
const PLAN_HOLDS: usize = 8;

/// Runs `work` on every item with up to `depth` threads taking the next item in turn; the
/// results come back in the items' order (`None` for an item a panicking thread never did).
/// With a depth of 1 it runs in the calling thread.
fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    depth: usize,
    work: impl Fn(&T) -> R + Sync,
) -> Vec<Option<R>> {
    if depth <= 1 || items.len() <= 1 {
        return items.iter().map(|item| Some(work(item))).collect();
    }
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    thread::scope(|scope| {
        for _ in 0..depth.min(items.len()) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let result = work(item);
                *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
}

/// A range of a volume whose dirty data in the cache is damaged or unreadable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedRange {
    pub volume: String,
    pub offset: u64,
    pub length: u64,
}

impl std::fmt::Display for DamagedRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "volume '{}' bytes [{}, {})",
            self.volume,
            self.offset,
            self.offset + self.length
        )
    }
}

/// The ranges for an error message (the first 16, then a count).
fn describe_damage(ranges: &[DamagedRange]) -> String {
    const SHOWN: usize = 16;
    let bytes: u64 = ranges.iter().map(|r| r.length).sum();
    let mut list: Vec<String> = ranges.iter().take(SHOWN).map(|r| r.to_string()).collect();
    if ranges.len() > SHOWN {
        list.push(format!("and {} more ranges", ranges.len() - SHOWN));
    }
    format!(
        "{bytes} bytes of dirty data in the cache fail their checksums or cannot be read ({}); \
         nothing was written back, and neither device was changed. The cache device lost or \
         damaged this data (was it truncated, overwritten or failing?). The rest of the dirty \
         data is intact. To write back everything else and give these ranges up (the backing \
         device keeps its older data there), run the same command with --discard-damaged",
        list.join(", ")
    )
}

/// Merges the dirty sector runs of address-ordered lines into backing writes.
/// Dirty lines a `Select::Coldest` plan examines at most (it skips only lines whose dirty
/// sectors are all damaged), bounding the time it holds the map lock.
const COLDEST_SCAN_LIMIT: usize = 1 << 16;

fn merge_extents(lines: &[DirtyLine], line_size: u64, max_write: u64) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    let spl = (line_size / SECTOR_SIZE) as usize;
    for line in lines {
        let mut s = 0;
        while s < spl {
            if !line.dirty.get(s) {
                s += 1;
                continue;
            }
            let end = (s..spl).find(|&t| !line.dirty.get(t)).unwrap_or(spl);
            let part = Part {
                line: *line,
                first: s,
                count: end - s,
            };
            let volume = volume_of(line.key);
            let offset = line_of(line.key) * line_size + s as u64 * SECTOR_SIZE;
            let len = (end - s) as u64 * SECTOR_SIZE;
            match out.last_mut() {
                Some(e)
                    if e.volume == volume
                        && e.offset + e.len == offset
                        && e.len + len <= max_write =>
                {
                    e.len += len;
                    e.parts.push(part);
                }
                _ => out.push(Extent {
                    volume,
                    offset,
                    len,
                    parts: vec![part],
                }),
            }
            s = end;
        }
    }
    out
}
