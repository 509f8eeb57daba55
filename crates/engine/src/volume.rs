//! One backing device served through the cache: the read and write paths of each mode.

use std::sync::Arc;

use ssdcache_device::{AlignedBuf, BlockDevice};
use ssdcache_format::{
    sector_crc, CacheMode, SectorBitmap, VolumeCounters, VolumeSlot, SECTOR_SIZE,
};

use crate::admission::{Admission, NHitAdmission, Streams};
use crate::backing_order::WriteInFlight;
use crate::cache::{CacheCore, Mismatch};
use crate::commit::{Backing, CommitPurpose};
use crate::counters::StripedCounters;
use crate::error::{EngineError, Result};
use crate::latency::{LatencyHistogram, LatencyHistograms, LatencyKind};
use crate::locks::RangeGuard;
use crate::map::MapState;
use crate::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use crate::sync::{Mutex, MutexGuard, RwLock};

mod batch;
mod partial;
mod ring_hits;
mod status;
pub use batch::{BatchRead, HitPlan};
use partial::{KeepHeld, Widened};
pub use ring_hits::{RingEnd, RingHit, RingHits};

/// Counter indices, in the order of `VolumeCounters::NAMES`.
#[derive(Clone, Copy)]
#[repr(usize)]
pub enum Counter {
    Reads,
    Writes,
    ReadHits,
    ReadMisses,
    WriteHits,
    BytesRead,
    BytesWritten,
    BytesFromCache,
    BytesFromBacking,
    BytesToCache,
    BytesToBacking,
    Trims,
    WriteZeroes,
    Flushes,
    CacheErrors,
    BackingErrors,
    BytesBypassed,
    /// Dirty bytes the cleaner wrote back.
    BytesCleaned,
    /// Write-back writes that went to the backing device because no line could be freed.
    BytesWrittenAroundFull,
    /// Client reads refused because their dirty data could not be read from the cache.
    DirtyReadErrors,
    /// Dirty lines the cleaner could not read from the cache.
    DirtyLinesLost,
    /// Bytes of missed lines that admission kept out of the cache (served from or written to
    /// the backing device only).
    BytesNotAdmitted,
    /// Sectors read from the cache whose data did not match its checksum (a damaged or lost
    /// cache region): clean ones were dropped and read from the backing device, dirty ones
    /// refused.
    ChecksumErrors,
}

/// The part of a request that falls in one cache line.
#[derive(Debug, Clone, Copy)]
struct Segment {
    line: u64,
    /// Byte offset on the volume.
    offset: u64,
    /// Byte offset inside the request buffer.
    buf_at: usize,
    len: usize,
    first_sector: usize,
    sectors: usize,
    in_line: u64,
}

/// Health of a volume's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeState {
    Healthy,
    /// Write-through or write-around after cache-device errors: serving from the backing
    /// device only (no data lost).
    PassThroughAfterErrors,
    /// Write-back after cache-device errors: new writes go to the backing device; dirty data
    /// still in the cache is at risk (reads of it fail rather than return stale data).
    CacheFailed,
    /// The backing device failed a flush: writes it covered may be lost, so every FLUSH of the
    /// volume fails until the daemon restarts (reads and writes go on).
    BackingFlushFailed,
    /// The backing device could not be opened at start (missing, or not the recorded
    /// device): nothing is served or written back; cached and dirty data are kept for the
    /// next start that finds it.
    Offline,
    /// The backing device is a network export that cannot be reached now: it is being
    /// reconnected; hits and write-back writes go on, what needs the device waits, then fails.
    BackingUnreachable,
}

impl VolumeState {
    pub fn name(self) -> &'static str {
        match self {
            VolumeState::Healthy => "healthy",
            VolumeState::PassThroughAfterErrors => "pass-through after cache errors",
            VolumeState::CacheFailed => "cache failed, dirty data at risk",
            VolumeState::BackingFlushFailed => "backing device failed a flush, FLUSH refused",
            VolumeState::Offline => "offline, backing device unavailable",
            VolumeState::BackingUnreachable => "backing device unreachable, reconnecting",
        }
    }
}

/// Occupancy and counters of a volume at one moment.
#[derive(Debug, Clone)]
pub struct VolumeStats {
    pub name: String,
    /// The mode requests are served in now (pass-through after cache errors).
    pub mode: CacheMode,
    /// The mode the volume is configured with.
    pub configured_mode: CacheMode,
    pub size: u64,
    pub counters: VolumeCounters,
    pub lines_used: u64,
    pub bytes_cached: u64,
    /// Data in the cache that the backing device does not have yet.
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
    pub state: VolumeState,
    /// The volume's own cap on dirty lines (`Volume::set_dirty_cap`), if it has one.
    pub dirty_cap_lines: Option<u64>,
    /// The volume's cap on the lines it holds (`Volume::set_occupancy_cap`), if it has one.
    pub occupancy_cap_lines: Option<u64>,
}

/// Cache-device errors a write-through or write-around volume tolerates before it stops using
/// the cache (a failing device tends to fail more; a single bad sector does not end caching).
pub const CACHE_ERROR_LIMIT: u64 = 8;

pub struct Volume {
    id: u16,
    /// Its backing device, with its writes counted against its flushes (the cache's list of
    /// backing devices, which commits flush, holds it too).
    backing: Arc<Backing>,
    name: String,
    mode: AtomicU8,
    configured_mode: AtomicU8,
    /// Held (shared) by every write for its whole duration and (exclusive) by a mode change:
    /// once a change to a mode that makes no dirty data returns, no write-back write that
    /// read the old mode is still running, so every dirty line is in the map for the drain.
    mode_gate: RwLock<()>,
    state: AtomicU8,
    read_only: bool,
    size: u64,
    core: Arc<CacheCore>,
    streams: Streams,
    /// The admission's on-disk code (`Admission::to_disk`): 0, `always`, needs no table.
    admission: AtomicU32,
    /// The N-hit miss table; `None` under `always` admission. Replaced whole when the
    /// admission changes (`set_admission`).
    admission_table: Mutex<Option<NHitAdmission>>,
    counters: StripedCounters<{ VolumeCounters::COUNT }>,
    /// Time inside the engine per request, by kind and outcome (metrics).
    latency: LatencyHistograms,
    /// Most lines this volume may hold dirty (`set_dirty_cap`), `u64::MAX` for no cap of its
    /// own (the cache's dirty limit still applies).
    dirty_cap: AtomicU64,
}

fn mode_code(m: CacheMode) -> u8 {
    match m {
        CacheMode::PassThrough => 0,
        CacheMode::WriteThrough => 1,
        CacheMode::WriteAround => 2,
        CacheMode::WriteBack => 3,
    }
}

fn mode_of(code: u8) -> CacheMode {
    match code {
        1 => CacheMode::WriteThrough,
        2 => CacheMode::WriteAround,
        3 => CacheMode::WriteBack,
        _ => CacheMode::PassThrough,
    }
}

/// What the backing device held at `offset` when a read that ran without its lines read it,
/// still current when the read took its lines again (`Volume::read_line_unheld`).
struct DiskImage {
    offset: u64,
    data: AlignedBuf,
}

impl DiskImage {
    /// The image's bytes of `[offset, offset + len)`, if it holds all of them.
    fn part(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let at = usize::try_from(offset.checked_sub(self.offset)?).ok()?;
        self.data.get(at..at.checked_add(len)?)
    }
}

/// Whether a run of missed segments is still to be read from the backing device, or the
/// request buffer holds the backing device's bytes of it already (`Volume::serve_spanned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunData {
    ToRead,
    InBuffer,
}

/// Whether a read caches the lines it missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// Nothing is cached: pass-through, a stream past its cutoff, a failing cache device.
    Nothing,
    /// Missed lines are cached as the volume's admission decides.
    Admitted,
    /// Every missed line is cached: a client's explicit prefetch (NBD_CMD_CACHE).
    Everything,
}

/// Locks a mutex that guards plain counting state: a panic elsewhere cannot leave it invalid
/// for the next request.
/// How often a request re-takes its lines because a disk write it must wait for began while
/// it took them, before it waits holding them (`Volume::lock_when_disk_idle`).
const LOCK_RETRIES: usize = 4;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Volume {
    /// `admission` is the slot's decoded admission code (the caller refuses unknown codes).
    pub(crate) fn new(
        slot: &VolumeSlot,
        admission: Admission,
        backing: Arc<Backing>,
        core: Arc<CacheCore>,
    ) -> Volume {
        let lines = usize::try_from(core.layout.line_count).unwrap_or(usize::MAX);
        Volume {
            id: slot.id,
            backing,
            name: slot.name.clone(),
            mode: AtomicU8::new(mode_code(slot.mode)),
            configured_mode: AtomicU8::new(mode_code(slot.mode)),
            mode_gate: RwLock::new(()),
            state: AtomicU8::new(0),
            read_only: slot.read_only,
            // A trailing piece of a sector is never served: a direct-I/O read of it fails.
            size: slot.backing.size - slot.backing.size % SECTOR_SIZE,
            core,
            streams: Streams::new(slot.sequential_cutoff),
            admission: AtomicU32::new(admission.to_disk()),
            admission_table: Mutex::new(admission.table(lines)),
            counters: StripedCounters::new(slot.counters.0),
            latency: LatencyHistograms::new(),
            dirty_cap: AtomicU64::new(u64::MAX),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn id(&self) -> u16 {
        self.id
    }
    /// The mode requests are served in now.
    pub fn mode(&self) -> CacheMode {
        mode_of(self.mode.load(Ordering::Acquire))
    }
    /// The mode the volume is configured with (kept across restarts).
    pub fn configured_mode(&self) -> CacheMode {
        mode_of(self.configured_mode.load(Ordering::Acquire))
    }
    pub fn state(&self) -> VolumeState {
        match self.state.load(Ordering::Acquire) {
            1 => VolumeState::PassThroughAfterErrors,
            2 => VolumeState::CacheFailed,
            _ => VolumeState::Healthy,
        }
    }
    /// Caps the lines this volume may hold dirty at `share` (0 to 1) of the cache's lines, or
    /// removes the cap (`None`). Past it, a write-back write to a line without dirty data goes
    /// to the backing device (counted as written around a full cache), overwrites of dirty
    /// lines are still absorbed, and the cleaner writes this volume's dirty lines back: one
    /// busy volume cannot take the whole cache's write-back room from the others.
    pub fn set_dirty_cap(&self, share: Option<f64>) {
        let lines = share.map_or(u64::MAX, |s| {
            (self.core.layout.line_count as f64 * s.clamp(0.0, 1.0)) as u64
        });
        self.dirty_cap.store(lines, Ordering::Relaxed);
    }

    /// The cap of `set_dirty_cap`, in lines.
    pub fn dirty_cap_lines(&self) -> Option<u64> {
        Some(self.dirty_cap.load(Ordering::Relaxed)).filter(|&l| l != u64::MAX)
    }

    /// Caps the lines this volume may hold, clean and dirty, at `share` (0 to 1) of the
    /// cache's lines (at least one line), or removes the cap (`None`). At its cap a line it
    /// misses takes the place of one of its own clean lines, never another volume's (see
    /// `MapState::allocate`); when none of its lines can go the line is not cached (a
    /// write-back write goes to the backing device). Its dirty lines are held to the cap too
    /// (`dirty_room_lines`), so the cleaner writes them back before they fill it. Open CAS's
    /// per-class occupancy limit.
    pub fn set_occupancy_cap(&self, share: Option<f64>) {
        let lines = share.map(|s| (self.core.layout.line_count as f64 * s.clamp(0.0, 1.0)) as u64);
        self.core.occupancy.set_cap(self.id, lines);
    }

    /// The cap of `set_occupancy_cap`, in lines.
    pub fn occupancy_cap_lines(&self) -> Option<u64> {
        self.core.occupancy.cap(self.id)
    }

    /// Most lines this volume may hold dirty: its own dirty cap, and no more than its
    /// occupancy cap. `None` when neither is set (the cache's dirty limit still applies).
    pub fn dirty_room_lines(&self) -> Option<u64> {
        match (self.dirty_cap_lines(), self.occupancy_cap_lines()) {
            (Some(d), Some(o)) => Some(d.min(o)),
            (d, o) => d.or(o),
        }
    }

    /// Whether this volume may dirty one more line: below the cache's dirty limit and its own.
    fn may_dirty_another_line(&self, map: &MapState) -> bool {
        map.may_dirty_another_line()
            && self
                .dirty_room_lines()
                .is_none_or(|cap| map.occupancy(self.id).dirty_lines < cap)
    }

    /// Why the volume's backing device cannot be reached now (a network export
    /// reconnecting), if it cannot.
    pub fn backing_unreachable(&self) -> Option<String> {
        self.backing().reachable().err()
    }

    /// Why the volume is offline (its backing device could not be opened at start), if it is.
    pub fn offline_reason(&self) -> Option<&str> {
        self.backing().offline_reason()
    }
    /// The backing device, with its writes counted against its flushes (`commit.rs`).
    pub(crate) fn backing(&self) -> &Backing {
        &self.backing
    }
    pub(crate) fn count_pub(&self, c: Counter, n: u64) {
        self.count(c, n);
    }

    /// Serves requests in `mode` from now on. Leaving write-back needs the dirty data written
    /// back first: see `Cache::set_mode`.
    pub(crate) fn set_mode(&self, mode: CacheMode) {
        let _no_write_running = self.mode_gate.write().unwrap_or_else(|p| p.into_inner());
        self.mode.store(mode_code(mode), Ordering::Release);
        self.configured_mode
            .store(mode_code(mode), Ordering::Release);
    }

    /// Serves writes in `mode` for now, the configured mode unchanged (while a mode change
    /// waits for the dirty data to be written back). Returns once no write that read the old
    /// mode is still running.
    pub(crate) fn set_serving_mode(&self, mode: CacheMode) {
        let _no_write_running = self.mode_gate.write().unwrap_or_else(|p| p.into_inner());
        self.mode.store(mode_code(mode), Ordering::Release);
    }

    /// Writes may dirty the cache only in write-back mode with a working cache device.
    fn caches_writes_back(&self) -> bool {
        self.mode() == CacheMode::WriteBack && self.state() == VolumeState::Healthy
    }
    /// The size served: the backing device's whole 4 KiB sectors (the bytes of a trailing
    /// partial sector are neither served nor ever written).
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn read_only(&self) -> bool {
        self.read_only
    }
    pub fn line_size(&self) -> u64 {
        self.core.layout.line_size
    }
    pub fn admission(&self) -> Admission {
        Admission::from_disk(self.admission.load(Ordering::Relaxed)).unwrap_or_default()
    }

    /// Admits missed lines by `admission` from now on, with a new, empty miss table (the
    /// misses counted so far are forgotten). The superblock keeps it once
    /// `Cache::persist_config` writes it.
    pub fn set_admission(&self, admission: Admission) {
        let lines = usize::try_from(self.core.layout.line_count).unwrap_or(usize::MAX);
        let table = admission.table(lines);
        let mut current = lock(&self.admission_table);
        *current = table;
        self.admission.store(admission.to_disk(), Ordering::Relaxed);
    }

    /// A sequential stream bypasses the cache after this many bytes; 0 = never.
    pub fn sequential_cutoff(&self) -> u64 {
        self.streams.cutoff()
    }

    /// Sets the sequential cutoff from now on (streams already tracked keep their length).
    /// The superblock keeps it once `Cache::persist_config` writes it.
    pub fn set_sequential_cutoff(&self, bytes: u64) {
        self.streams.set_cutoff(bytes);
    }

    /// Records a request with the stream detector: true when it continues a stream past the
    /// cutoff and bypasses the cache.
    fn stream_bypass(&self, offset: u64, length: u64) -> bool {
        self.streams.bypass(offset, length)
    }

    /// Whether a segment's line may take cache space. A line already in the cache (some of
    /// its sectors missing at most) is a hit and always may; under `always` every line may;
    /// under N-hit the table counts this miss and decides. A refusal is counted.
    fn admits(&self, seg: &Segment) -> bool {
        if self.admission.load(Ordering::Relaxed) == Admission::Always.to_disk() {
            return true;
        }
        if self.core.map().peek(self.id, seg.line).is_some() {
            return true;
        }
        let admitted = lock(&self.admission_table)
            .as_mut()
            .is_none_or(|table| table.admit(seg.line));
        if !admitted {
            self.count(Counter::BytesNotAdmitted, seg.len as u64);
        }
        admitted
    }

    /// Whether a read that missed `seg` caches it.
    fn fills(&self, fill: Fill, seg: &Segment) -> bool {
        match fill {
            Fill::Nothing => false,
            Fill::Admitted => self.admits(seg),
            Fill::Everything => true,
        }
    }

    fn count(&self, c: Counter, n: u64) {
        self.counters.add(c as usize, n);
    }

    /// The latency histograms of the requests served since the daemon started.
    pub fn latencies(&self) -> Vec<LatencyHistogram> {
        self.latency.snapshot()
    }

    pub(crate) fn record_latencies(&self, on: bool) {
        self.latency.set_on(on);
    }

    pub fn counters(&self) -> VolumeCounters {
        VolumeCounters(self.counters.totals())
    }

    pub fn stats(&self) -> VolumeStats {
        // Without the map's lock: statistics and metrics never hold up a request.
        let o = self.core.occupancy.of(self.id);
        VolumeStats {
            name: self.name.clone(),
            mode: self.mode(),
            configured_mode: self.configured_mode(),
            size: self.size,
            counters: self.counters(),
            lines_used: o.lines,
            bytes_cached: o.sectors * SECTOR_SIZE,
            dirty_lines: o.dirty_lines,
            dirty_bytes: o.dirty_sectors * SECTOR_SIZE,
            dirty_cap_lines: self.dirty_cap_lines(),
            occupancy_cap_lines: self.occupancy_cap_lines(),
            state: if self.offline_reason().is_some() {
                VolumeState::Offline
            } else if self.backing().flush_failed() {
                VolumeState::BackingFlushFailed
            } else if self.backing().reachable().is_err() {
                VolumeState::BackingUnreachable
            } else {
                self.state()
            },
        }
    }

    /// Refuses a request past the end or not of whole sectors, and every request once the
    /// engine halted: the check of the paths that handle whole sectors only.
    fn check(&self, offset: u64, length: u64) -> Result<()> {
        self.check_bytes(offset, length)?;
        if !offset.is_multiple_of(SECTOR_SIZE) || !length.is_multiple_of(SECTOR_SIZE) {
            return Err(EngineError::Misaligned { offset, length });
        }
        Ok(())
    }

    /// Refuses a request past the end, and every request once the engine halted. A request
    /// need not be of whole sectors (`partial.rs`), but the sectors around it must lie within
    /// the volume: the last bytes of a device whose size is not a multiple of 4 KiB form no
    /// whole sector and are not served.
    fn check_bytes(&self, offset: u64, length: u64) -> Result<()> {
        self.core.check_running()?;
        self.check_online()?;
        match offset
            .checked_add(length)
            .and_then(partial::checked_round_up)
        {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(EngineError::OutOfRange {
                offset,
                length,
                size: self.size,
            }),
        }
    }

    /// Refuses every request of an offline volume (no backing device): it is not exported,
    /// and nothing may reach the stand-in.
    fn check_online(&self) -> Result<()> {
        match self.offline_reason() {
            Some(reason) => Err(EngineError::VolumeOffline {
                name: self.name.clone(),
                reason: reason.to_owned(),
            }),
            None => Ok(()),
        }
    }

    fn check_writable(&self, offset: u64, length: u64) -> Result<()> {
        self.check_writable_bytes(offset, length)?;
        self.check(offset, length)
    }

    fn check_writable_bytes(&self, offset: u64, length: u64) -> Result<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly(self.name.clone()));
        }
        self.check_bytes(offset, length)
    }

    fn segments(&self, offset: u64, length: u64) -> impl Iterator<Item = Segment> {
        let line_size = self.core.layout.line_size;
        let end = offset + length;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let in_line = pos % line_size;
            let len = (line_size - in_line).min(end - pos);
            let seg = Segment {
                line: pos / line_size,
                offset: pos,
                buf_at: (pos - offset) as usize,
                len: len as usize,
                first_sector: (in_line / SECTOR_SIZE) as usize,
                sectors: (len / SECTOR_SIZE) as usize,
                in_line,
            };
            pos += len;
            Some(seg)
        })
    }

    fn line_range(&self, offset: u64, length: u64) -> (u64, u64) {
        let ls = self.core.layout.line_size;
        (offset / ls, (offset + length - 1) / ls)
    }

    fn backing_err(&self, source: std::io::Error) -> EngineError {
        self.count(Counter::BackingErrors, 1);
        EngineError::Backing {
            device: self.backing().describe(),
            source,
        }
    }

    /// Counts a cache-device error and, past the limit (or at once in write-back, where the
    /// cache may hold the only copy of data), stops using the cache for new data.
    fn cache_failed(&self, source: std::io::Error) {
        self.count(Counter::CacheErrors, 1);
        let errors = self.counters.total(Counter::CacheErrors as usize);
        tracing::warn!(volume = %self.name, "{}", self.core.cache_err(source));
        let write_back = self.mode() == CacheMode::WriteBack
            || self.core.map().occupancy(self.id).dirty_lines > 0;
        if write_back {
            self.degrade(VolumeState::CacheFailed);
        } else if errors >= CACHE_ERROR_LIMIT {
            self.degrade(VolumeState::PassThroughAfterErrors);
            self.mode
                .store(mode_code(CacheMode::PassThrough), Ordering::Release);
        }
    }

    /// The cleaner could not read dirty data back from the cache.
    pub(crate) fn cleaner_read_failed(&self, source: std::io::Error) {
        self.cache_failed(source);
    }

    fn degrade(&self, state: VolumeState) {
        let code = match state {
            VolumeState::PassThroughAfterErrors => 1,
            VolumeState::CacheFailed => 2,
            // Not states of the cache device (the backing one's is read from it directly).
            VolumeState::Healthy
            | VolumeState::BackingFlushFailed
            | VolumeState::Offline
            | VolumeState::BackingUnreachable => return,
        };
        if self.state.swap(code, Ordering::AcqRel) != code {
            let dirty = self.core.map().occupancy(self.id).dirty_sectors * SECTOR_SIZE;
            tracing::error!(
                volume = %self.name,
                "cache device failing: volume now {}; {} bytes of dirty data are only in the cache",
                state.name(),
                dirty
            );
        }
    }

    /// Reads `buf` at `offset` from `image` where it holds the range (the disk's data read
    /// without the lines and still current, `read_line_unheld`), else from the disk.
    fn read_backing_or_image(
        &self,
        buf: &mut [u8],
        offset: u64,
        image: &Option<DiskImage>,
    ) -> Result<()> {
        match image.as_ref().and_then(|i| i.part(offset, buf.len())) {
            Some(part) => {
                buf.copy_from_slice(part);
                Ok(())
            }
            None => self.read_backing(buf, offset),
        }
    }

    fn read_backing(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.core.note_client_backing_io();
        // A writeback in flight (the cleaner writes without the lines) may leave the range half
        // written; its sectors are dirty now, but they may be recorded clean before the caller
        // looks (and lays only dirty sectors over what it read). Once it ended, the backing
        // device holds them whole, and the caller's lines keep another from starting.
        self.backing().wait_for_writes(offset, buf.len() as u64);
        self.backing()
            .read_at(buf, offset)
            .map_err(|e| self.backing_err(e))?;
        self.count(Counter::BytesFromBacking, buf.len() as u64);
        Ok(())
    }

    fn write_backing(&self, data: &[u8], offset: u64, fua: bool) -> Result<()> {
        // Older writes of the range in flight without their lines (the cleaner's, a
        // write-through write's) land first; a pending write-through fill of it is superseded.
        let in_flight = self.backing().begin_client_write(offset, data.len() as u64);
        self.write_backing_begun(data, offset, fua, in_flight)
    }

    /// Writes the backing device once the write is in flight in the device's order
    /// (`backing_order.rs`); ends it when the device write returns.
    fn write_backing_begun(
        &self,
        data: &[u8],
        offset: u64,
        fua: bool,
        in_flight: WriteInFlight<'_>,
    ) -> Result<()> {
        self.core.note_client_backing_io();
        let written = if fua {
            self.backing().write_durable(data, offset)
        } else {
            self.backing().write_at(data, offset)
        };
        drop(in_flight);
        written.map_err(|e| self.backing_err(e))?;
        self.count(Counter::BytesToBacking, data.len() as u64);
        Ok(())
    }

    /// Makes every write that returned from the backing device before this call durable.
    fn flush_backing(&self) -> Result<()> {
        self.backing()
            .flush_client_writes()
            .map_err(|e| self.backing_err(e))
    }

    fn slot_offset(&self, slot: u32, seg: &Segment) -> u64 {
        self.core.layout.slot_offset(u64::from(slot)) + seg.in_line
    }

    fn has_dirty(&self) -> bool {
        self.core.map().occupancy(self.id).dirty_lines > 0
    }

    /// Reads `buf.len()` bytes at `offset` (any offset and length: `partial.rs`).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let Some(started) = self.latency.start() else {
            return self.read_counted(offset, buf).map(|_| ());
        };
        let hit = self.read_counted(offset, buf)?;
        let kind = if hit {
            LatencyKind::ReadHit
        } else {
            LatencyKind::ReadMiss
        };
        self.latency.record(kind, started.elapsed());
        Ok(())
    }

    /// [`Volume::read`], counted; true for a hit (every sector was in the cache).
    fn read_counted(&self, offset: u64, buf: &mut [u8]) -> Result<bool> {
        let length = buf.len() as u64;
        self.check_bytes(offset, length)?;
        self.count(Counter::Reads, 1);
        self.count(Counter::BytesRead, length);
        if length == 0 {
            return Ok(true);
        }
        let hit = match Widened::of(offset, length) {
            Some(_) => self.read_partial(offset, buf)?,
            None => self.read_sectors(offset, buf, None)?,
        };
        self.count(
            if hit {
                Counter::ReadHits
            } else {
                Counter::ReadMisses
            },
            1,
        );
        Ok(hit)
    }

    /// Reads whole sectors; true for a hit (every sector was in the cache). The caller counts
    /// the hit or miss. `bypass`: the stream detector's verdict on the request this is a
    /// piece of (`partial.rs`), which asked it once for the whole request; `None`: this is the
    /// request, ask it here.
    fn read_sectors(&self, offset: u64, buf: &mut [u8], bypass: Option<bool>) -> Result<bool> {
        let length = buf.len() as u64;
        if self.mode() == CacheMode::PassThrough && !self.has_dirty() {
            return self.read_backing(buf, offset).map(|()| false);
        }
        let held = self.lock_for_read(offset, length);
        let bypass = bypass.unwrap_or_else(|| self.stream_bypass(offset, length));
        if bypass && !self.all_cached(offset, length) {
            // A stream reads on from the backing device in one piece: serving the cached parts
            // from the cache would break the disk's streaming into seeks. Dirty sectors are
            // laid over it from the cache.
            self.count(Counter::BytesBypassed, length);
            self.read_backing(buf, offset)?;
            return self.overlay_cached(offset, buf).map(|()| false);
        }
        let fill = if !bypass
            && self.mode() != CacheMode::PassThrough
            && self.state() == VolumeState::Healthy
        {
            Fill::Admitted
        } else {
            Fill::Nothing
        };
        if fill == Fill::Admitted && self.misses_in_one_line(offset, length) {
            self.read_line_unheld(offset, buf, held)
        } else {
            self.read_locked(offset, buf, fill, &mut None)
        }
    }

    /// Whether a write-back write would find a slot to dirty for every segment now (as
    /// `slot_to_dirty` decides, without allocating): below the dirty limit, or every line
    /// holds dirty data already.
    fn absorbable(&self, offset: u64, length: u64) -> bool {
        let map = self.core.map_read();
        self.may_dirty_another_line(&map)
            || self.segments(offset, length).all(|seg| {
                map.peek(self.id, seg.line)
                    .and_then(|hit| map.dirty_of(hit.slot))
                    .is_some_and(|d| !d.is_empty())
            })
    }

    /// True when the first and the last sector of a range of whole sectors are in the cache.
    fn edges_cached(&self, offset: u64, length: u64) -> bool {
        let last = offset + length - SECTOR_SIZE;
        self.all_cached(offset, SECTOR_SIZE) && self.all_cached(last, SECTOR_SIZE)
    }

    /// True when every sector of the range is in the cache.
    fn all_cached(&self, offset: u64, length: u64) -> bool {
        let map = self.core.map_read();
        self.segments(offset, length)
            .all(|seg| Self::cached_slot(&map, self.id, &seg).is_some())
    }

    /// The slot holding every sector of a segment, if one does (not counted as a use).
    fn cached_slot(map: &MapState, volume: u16, seg: &Segment) -> Option<u32> {
        let hit = map.peek(volume, seg.line)?;
        (seg.first_sector..seg.first_sector + seg.sectors)
            .all(|s| hit.valid.get(s))
            .then_some(hit.slot)
    }

    /// Whether a read of `[offset, offset + length)` lies in one line and misses some of it.
    fn misses_in_one_line(&self, offset: u64, length: u64) -> bool {
        let (first, last) = self.line_range(offset, length);
        first == last && !self.all_cached(offset, length)
    }

    /// A read that misses part of one line, without holding the line across the disk read
    /// (`backing_order.rs`, rule 3), so hits on the line's cached sectors go on meanwhile. It
    /// reads what a miss under the line would (the whole line if admission lets it in: a miss
    /// on part of a line caches it whole; else just the request), takes the line again and
    /// serves and fills from what it read, unless a write of the line began meanwhile: then it
    /// starts over holding the line. While another miss reads the line so, it waits for that
    /// one instead (without the line) and is then, most likely, a hit. `held`: the read's
    /// line, released here.
    fn read_line_unheld<'a>(
        &'a self,
        offset: u64,
        buf: &mut [u8],
        mut held: RangeGuard<'a>,
    ) -> Result<bool> {
        let length = buf.len() as u64;
        let Some(seg) = self.segments(offset, length).next() else {
            return self.read_locked(offset, buf, Fill::Admitted, &mut None);
        };
        let whole = self.whole_line(seg.line);
        for _ in 0..LOCK_RETRIES {
            if !self
                .backing()
                .read_in_flight(whole.offset, whole.len as u64)
            {
                break;
            }
            drop(held);
            self.backing()
                .wait_for_reads(whole.offset, whole.len as u64);
            held = self.lock_lines(offset, length);
            if self.all_cached(offset, length) {
                return self.read_locked(offset, buf, Fill::Admitted, &mut None);
            }
        }
        // Admission is asked once, here: the read under the line below caches what it read
        // only if it was admitted.
        let (fill, at, len) = if self.admits(&seg) {
            (Fill::Everything, whole.offset, whole.len)
        } else {
            (Fill::Nothing, offset, buf.len())
        };
        let current = self
            .backing()
            .begin_read_then_fill(at, len as u64, fill == Fill::Everything);
        drop(held);
        // Allocated per miss, not kept per thread (as `read_missing_partial_line`).
        let mut data = AlignedBuf::zeroed(len);
        self.read_backing(&mut data, at)?;
        let _held = self.lock_lines(offset, length);
        let mut image = current.finish().then_some(DiskImage { offset: at, data });
        self.read_locked(offset, buf, fill, &mut image)
    }

    /// Reads a range whose lines the caller holds: cached segments from the cache, each run of
    /// consecutive missing segments with one backing read (a disk streams it; from `image`
    /// where that holds the run) with any cached sectors laid over it, then fills the cache
    /// from what was read as `fill` says. Returns whether every segment hit.
    fn read_locked(
        &self,
        offset: u64,
        buf: &mut [u8],
        fill: Fill,
        image: &mut Option<DiskImage>,
    ) -> Result<bool> {
        if image.is_none() {
            if let Some(span) = self.miss_span(offset, buf.len() as u64) {
                // If that one read fails (a bad sector under a cached line between the runs,
                // say; counted as a backing error), the runs are read one by one below, every
                // byte of `buf` again: the cached line still hides the disk's error under it
                // (review 28, F1).
                let (start, end) = span;
                if self
                    .read_backing(&mut buf[start..end], offset + start as u64)
                    .is_ok()
                {
                    self.serve_spanned(offset, buf, fill, span)?;
                    return Ok(false);
                }
            }
        }
        let mut all_hit = true;
        let mut run: Option<(Segment, Segment)> = None;
        for seg in self.segments(offset, buf.len() as u64) {
            if self.read_hit(&seg, &mut buf[seg.buf_at..seg.buf_at + seg.len])? {
                if let Some(missed) = run.take() {
                    self.read_missing(missed, buf, fill, image)?;
                }
                continue;
            }
            all_hit = false;
            run = Some(match run {
                Some((first, _)) => (first, seg),
                None => (seg, seg),
            });
        }
        if let Some(missed) = run {
            self.read_missing(missed, buf, fill, image)?;
        }
        Ok(all_hit)
    }

    /// Serves a segment from the cache if every sector of it is there. A cache read error on
    /// clean data drops it and reports a miss, so the backing device serves it; on dirty data
    /// it is an error (the backing device's copy is stale).
    fn read_hit(&self, seg: &Segment, buf: &mut [u8]) -> Result<bool> {
        let mut crcs = [0u32; MAX_SECTORS];
        let crcs = &mut crcs[..seg.sectors];
        // The map is only read: hits on different lines do not wait for one another, and the
        // use is recorded aside for the policy (`TouchLog`).
        // The checksums may have to be read from their metadata page first (`read_map_paged`);
        // the held line keeps the slot and its checksums as they are meanwhile.
        let snapshot = self.core.read_map_paged(|map| {
            let Some(slot) = Self::cached_slot(map, self.id, seg) else {
                return Ok(None);
            };
            let confirm = map.sector_crcs(slot, seg.first_sector, crcs)?;
            Ok(Some(CrcSnapshot { slot, confirm }))
        })?;
        let Some(snapshot) = snapshot else {
            return Ok(false);
        };
        let slot = snapshot.slot;
        self.core.note_touch(slot);
        if let Err(e) = self.core.dev.read_at(buf, self.slot_offset(slot, seg)) {
            return self.cache_read_failed(slot, seg.first_sector, seg.sectors, e);
        }
        if !self.verify_cached(snapshot, seg.line, seg.first_sector, buf, crcs)? {
            return Ok(false);
        }
        self.count(Counter::BytesFromCache, seg.len as u64);
        Ok(true)
    }

    /// Checks sectors read from `slot` (sector `first` onwards, of `line`) against their
    /// checksums. A sector that fails (and is not a newer write kept after an unclean stop:
    /// `CacheCore::settle_mismatch`) is handled as a cache read error of that sector: a clean
    /// one is dropped and `Ok(false)` says to read it from the backing device; a dirty one
    /// fails the read, since the backing device's copy is older.
    fn verify_cached(
        &self,
        snapshot: CrcSnapshot,
        line: u64,
        first: usize,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<bool> {
        let slot = snapshot.slot;
        let mut matched = SectorBitmap::default();
        for (i, sector) in data.chunks(SECTOR_SIZE as usize).enumerate() {
            if sector_crc(sector) == crcs[i] {
                matched.set(first + i, true);
                continue;
            }
            let s = first + i;
            match self.core.settle_mismatch(slot, s, sector) {
                Mismatch::NewerWrite => continue,
                // Its checksum was lost with its metadata page, and it was dropped: read it
                // from the backing device, no error (review 26, R26-2).
                Mismatch::Unknown => return Ok(false),
                Mismatch::Damaged => {}
            }
            self.count(Counter::ChecksumErrors, 1);
            let at = line * self.core.layout.line_size + s as u64 * SECTOR_SIZE;
            let err = std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "cached data of volume '{}' bytes [{at}, +{SECTOR_SIZE}) does not match its \
                     checksum (a lost, zeroed or damaged cache region)",
                    self.name
                ),
            );
            if !self.cache_read_failed(slot, s, 1, err)? {
                return Ok(false);
            }
        }
        if snapshot.confirm {
            self.core.map().confirm_sectors(slot, &matched);
        }
        Ok(true)
    }

    /// After a failed cache read of sectors of `slot`: clean ones are dropped (the backing
    /// device has them) and `Ok(false)` says to read them there; dirty ones make the read fail.
    fn cache_read_failed(
        &self,
        slot: u32,
        first: usize,
        count: usize,
        e: std::io::Error,
    ) -> Result<bool> {
        let mut map = self.core.map();
        let dirty = map
            .dirty_of(slot)
            .is_some_and(|d| (first..first + count).any(|s| d.get(s)));
        if dirty {
            drop(map);
            self.count(Counter::DirtyReadErrors, 1);
            let err = self.core.cache_err(e);
            self.cache_failed(std::io::Error::other(err.to_string()));
            return Err(err);
        }
        let dropped = map.invalidate_slot(slot, first, count);
        drop(map);
        dropped.map_err(|crate::map::Invariant(what)| self.core.halt(what))?;
        self.cache_failed(e);
        Ok(false)
    }

    /// Lays the dirty sectors of a range over `buf`, which holds the backing device's data:
    /// they are newer than the backing device's copy. Clean cached sectors hold what the
    /// backing device holds, so they are not read (a stream read past the cutoff, or a miss
    /// next to cached data, costs the cache device nothing unless the range has dirty data).
    fn overlay_cached(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut crcs = [0u32; MAX_SECTORS];
        for seg in self.segments(offset, buf.len() as u64) {
            let found = self.core.read_map_paged(|map| {
                let Some(hit) = map.peek(self.id, seg.line) else {
                    return Ok(None);
                };
                let dirty = map.dirty_of(hit.slot).unwrap_or_default();
                if (seg.first_sector..seg.first_sector + seg.sectors).all(|s| !dirty.get(s)) {
                    return Ok(None);
                }
                let confirm =
                    map.sector_crcs(hit.slot, seg.first_sector, &mut crcs[..seg.sectors])?;
                Ok(Some((hit.slot, dirty, confirm)))
            })?;
            let Some((slot, dirty, confirm)) = found else {
                continue;
            };
            let end = seg.first_sector + seg.sectors;
            let mut s = seg.first_sector;
            while s < end {
                if !dirty.get(s) {
                    s += 1;
                    continue;
                }
                let run_end = (s..end).find(|&t| !dirty.get(t)).unwrap_or(end);
                let at = seg.buf_at + (s - seg.first_sector) * SECTOR_SIZE as usize;
                let run = &mut buf[at..at + (run_end - s) * SECTOR_SIZE as usize];
                let snapshot = CrcSnapshot { slot, confirm };
                self.overlay_dirty_run(&seg, snapshot, s, run, &crcs[s - seg.first_sector..])?;
                s = run_end;
            }
        }
        Ok(())
    }

    /// Reads dirty sectors `first..` of `slot` into `run` (in place of the backing device's
    /// older copy), checked against `crcs`. A dirty sector the cache cannot give back fails the
    /// read (the backing copy is stale), so reading straight into the request's buffer is
    /// safe: on any failure the caller gets an error, never the buffer. (A sector that became
    /// clean meanwhile, written back by the cleaner, holds the same bytes as the backing
    /// device.)
    fn overlay_dirty_run(
        &self,
        seg: &Segment,
        snapshot: CrcSnapshot,
        first: usize,
        run: &mut [u8],
        crcs: &[u32],
    ) -> Result<()> {
        let slot = snapshot.slot;
        let from = self.core.layout.slot_offset(u64::from(slot)) + first as u64 * SECTOR_SIZE;
        let run_offset = seg.offset + ((first - seg.first_sector) as u64) * SECTOR_SIZE;
        if let Err(e) = self.core.dev.read_at(run, from) {
            // Fails the read if any sector is still dirty; else they were all written back
            // meanwhile, and the backing device has them.
            self.cache_read_failed(slot, first, run.len() / SECTOR_SIZE as usize, e)?;
            return self.read_backing(run, run_offset);
        }
        let sector = SECTOR_SIZE as usize;
        for (i, data) in run.chunks_mut(sector).enumerate() {
            // A dirty sector that fails fails the read; one that fails and was written back
            // meanwhile is dropped and read from the backing device.
            if self.verify_cached(snapshot, seg.line, first + i, data, &crcs[i..=i])? {
                self.count(Counter::BytesFromCache, SECTOR_SIZE);
            } else {
                self.read_backing(data, run_offset + (i * sector) as u64)?;
            }
        }
        Ok(())
    }

    /// Where in a request buffer the backing device's bytes of its missed segments go when
    /// they are read at once: `[start, end)`, from the first missed byte to the last.
    fn miss_span(&self, offset: u64, length: u64) -> Option<(usize, usize)> {
        // Two runs of misses need a cached line between them: three lines at least. Hits of
        // one or two lines (most of them) so never take the map here.
        if length == 0 {
            return None;
        }
        let (first, last) = self.line_range(offset, length);
        if last - first < 2 {
            return None;
        }
        let map = self.core.map_read();
        let (mut runs, mut missed_bytes, mut cached_between) = (0usize, 0usize, 0usize);
        let (mut span, mut cached_since_miss, mut after_hit) = (None, 0usize, true);
        for seg in self.segments(offset, length) {
            if Self::cached_slot(&map, self.id, &seg).is_some() {
                cached_since_miss += seg.len;
                after_hit = true;
                continue;
            }
            if seg.len < self.whole_line(seg.line).len {
                // A missed part of a line (at the request's edges) is read whole, on its
                // own, to cache the line whole (`read_missing_partial_line`): reading it in
                // the span too read it twice (review 28, F2).
                continue;
            }
            runs += usize::from(after_hit);
            missed_bytes += seg.len;
            let (start, _) = span.get_or_insert((seg.buf_at, 0));
            if *start != seg.buf_at {
                cached_between += cached_since_miss;
            }
            span = Some((*start, seg.buf_at + seg.len));
            cached_since_miss = 0;
            after_hit = false;
        }
        // Two or more runs of misses, and no more cached bytes between them than missed ones:
        // a backing device that reads fast reads at most twice what the request misses.
        (runs >= 2 && cached_between <= missed_bytes).then_some(span?)
    }

    /// Serves a request whose misses lie in two or more runs between cached lines after one
    /// backing read over `span` (`miss_span`) put the disk's bytes in `buf`, instead of one
    /// read per run: on a hard drive every further read costs a seek and most of a rotation
    /// (about 5 ms), the cached bytes read with them a fraction of a millisecond per line. (A
    /// sequential read whose stream has not reached the cutoff, over a partly cached range,
    /// took one disk read per missed line.) The cached segments are served from the cache
    /// over what the disk gave (dirty sectors must be; clean ones are the same bytes) and the
    /// missed runs finished from the buffer as `read_missing` finishes them. A cached segment
    /// the cache fails to give back may have left the cache's bytes in the buffer: it is read
    /// again on its own, as is a missed part of a line (outside the span). The caller holds
    /// every line of the request, so no write to them began since the span was read.
    fn serve_spanned(
        &self,
        offset: u64,
        buf: &mut [u8],
        fill: Fill,
        (start, end): (usize, usize),
    ) -> Result<()> {
        let mut run: Option<(Segment, Segment)> = None;
        for seg in self.segments(offset, buf.len() as u64) {
            let in_span = seg.buf_at >= start && seg.buf_at + seg.len <= end;
            let cached = self.all_cached(seg.offset, seg.len as u64);
            if !cached && in_span {
                run = Some(match run {
                    Some((first, _)) => (first, seg),
                    None => (seg, seg),
                });
                continue;
            }
            if let Some(missed) = run.take() {
                self.finish_missing(missed, buf, fill, &mut None, RunData::InBuffer)?;
            }
            if cached && self.read_hit(&seg, &mut buf[seg.buf_at..seg.buf_at + seg.len])? {
                continue;
            }
            self.read_missing((seg, seg), buf, fill, &mut None)?;
        }
        if let Some(missed) = run {
            self.finish_missing(missed, buf, fill, &mut None, RunData::InBuffer)?;
        }
        Ok(())
    }

    /// Reads the consecutive missing segments `first..=last` (positions in `buf` as the
    /// segments say) from the backing device and caches those `fill` lets in. Admission is
    /// asked once per missed segment.
    fn read_missing(
        &self,
        run: (Segment, Segment),
        buf: &mut [u8],
        fill: Fill,
        image: &mut Option<DiskImage>,
    ) -> Result<()> {
        self.finish_missing(run, buf, fill, image, RunData::ToRead)
    }

    /// Serves a run of missed segments (reading it first, or not, as `data` says), lays any
    /// cached sectors over it and fills the cache from it as `fill` says.
    fn finish_missing(
        &self,
        (first, last): (Segment, Segment),
        buf: &mut [u8],
        mut fill: Fill,
        image: &mut Option<DiskImage>,
        data: RunData,
    ) -> Result<()> {
        let part_of_one_line =
            first.line == last.line && first.len < self.whole_line(first.line).len;
        if part_of_one_line {
            if self.fills(fill, &first) {
                return self.read_missing_partial_line(
                    &first,
                    &mut buf[first.buf_at..first.buf_at + first.len],
                    image,
                );
            }
            // Not cached: read just what was asked, not the whole line.
            fill = Fill::Nothing;
        }
        let (start, end) = (first.buf_at, last.buf_at + last.len);
        if data == RunData::ToRead {
            self.read_backing_or_image(&mut buf[start..end], first.offset, image)?;
        }
        self.overlay_cached(first.offset, &mut buf[start..end])?;
        if fill != Fill::Nothing {
            for seg in self.segments(first.offset, (end - start) as u64) {
                if self.fills(fill, &seg) {
                    let at = start + seg.buf_at;
                    self.fill(&seg, &buf[at..at + seg.len])?;
                }
            }
        }
        Ok(())
    }

    /// A miss on part of one line reads and caches the whole line: one larger read costs a
    /// disk little more than a small one, and it keeps lines full so the cache's capacity is
    /// used (4 KiB random reads would otherwise fill 1/16 of each 64 KiB line).
    fn read_missing_partial_line(
        &self,
        seg: &Segment,
        buf: &mut [u8],
        image: &mut Option<DiskImage>,
    ) -> Result<()> {
        let whole = self.whole_line(seg.line);
        let mut scratch = match image.take() {
            Some(line) if line.offset == whole.offset && line.data.len() == whole.len => line.data,
            other => {
                *image = other;
                // Allocated per miss, not kept per thread: a server runs thousands of worker
                // threads, and a miss waits for the disk anyway.
                let mut scratch = AlignedBuf::zeroed(whole.len);
                self.read_backing(&mut scratch, whole.offset)?;
                scratch
            }
        };
        // Dirty data elsewhere in the line that is unreadable: serve just the request.
        let filled = self.overlay_cached(whole.offset, &mut scratch).is_ok();
        if filled {
            let at = (seg.offset - whole.offset) as usize;
            buf.copy_from_slice(&scratch[at..at + seg.len]);
            self.fill(&whole, &scratch)?;
        } else {
            self.read_backing(buf, seg.offset)?;
            self.overlay_cached(seg.offset, buf)?;
        }
        Ok(())
    }

    /// The segment covering all of `line` (the last line of a volume may be short).
    fn whole_line(&self, line: u64) -> Segment {
        let ls = self.core.layout.line_size;
        let offset = line * ls;
        let len = ls.min(self.size - offset);
        Segment {
            line,
            offset,
            buf_at: 0,
            len: len as usize,
            first_sector: 0,
            sectors: (len / SECTOR_SIZE) as usize,
            in_line: 0,
        }
    }

    /// Puts a segment's current data in the cache (allocating a line if needed). `data` must
    /// already carry the cached sectors of the segment (a fill never changes dirty data). A
    /// cache error only drops the line: the backing device has the data. Returns whether the
    /// line was cached already.
    fn fill(&self, seg: &Segment, data: &[u8]) -> Result<bool> {
        self.put_clean(seg, data, false)
    }

    /// Puts data that a write just wrote through to the backing device in the cache: it
    /// supersedes any dirty sectors of the segment (left by write-back while a mode change
    /// drains), which become clean with the new data and its checksums.
    fn put_written_through(&self, seg: &Segment, data: &[u8]) -> Result<bool> {
        self.put_clean(seg, data, true)
    }

    fn put_clean(&self, seg: &Segment, data: &[u8], supersedes_dirty: bool) -> Result<bool> {
        let Some((slot, cached)) = self.slot_for(seg)? else {
            return Ok(false); // every line busy or dirty: skip caching this one
        };
        // Sectors the durable metadata may still call dirty keep their bytes: a crash may
        // bring that record back, and its checksum must still match what the slot holds. A
        // fill skips those no longer dirty (it rewrites dirty ones with the same bytes); data
        // written through drops them all from the cache instead (the backing device has it).
        let keep = {
            let map = self.core.map();
            let mut keep = map.recorded_dirty_of(slot);
            if !supersedes_dirty {
                let dirty = map.dirty_of(slot).unwrap_or_default();
                for w in 0..4 {
                    keep.0[w] &= !dirty.0[w];
                }
            }
            keep
        };
        for (run, kept) in split_runs(*seg, |i| keep.get(seg.first_sector + i)) {
            if !kept {
                let at = run.buf_at - seg.buf_at;
                self.put_clean_run(slot, &run, &data[at..at + run.len], supersedes_dirty)?;
            } else if supersedes_dirty {
                self.core
                    .with_map(|m| m.invalidate_slot(slot, run.first_sector, run.sectors))?;
            }
        }
        Ok(cached)
    }

    fn put_clean_run(
        &self,
        slot: u32,
        run: &Segment,
        data: &[u8],
        supersedes_dirty: bool,
    ) -> Result<()> {
        match self.core.dev.write_at(data, self.slot_offset(slot, run)) {
            Ok(()) => {
                self.count(Counter::BytesToCache, run.len as u64);
                let mut crcs = [0u32; MAX_SECTORS];
                let crcs = sector_crcs(data, &mut crcs);
                self.core.write_map_paged(|m| {
                    m.need_checksums([slot])?;
                    Ok(if supersedes_dirty {
                        m.set_written_through(slot, run.first_sector, crcs)
                    } else {
                        m.set_clean_valid(slot, run.first_sector, crcs)
                    })
                })
            }
            Err(e) => {
                // The slot's bytes in the run are unknown now, except in dirty sectors a fill
                // rewrote with their own cached bytes: whatever landed there is the same
                // data, and it may be the only copy. Data written through is on the disk, so
                // the whole run goes.
                self.core.with_map(|m| {
                    if supersedes_dirty {
                        m.invalidate_slot(slot, run.first_sector, run.sectors)
                    } else {
                        m.invalidate_clean(self.id, run.line, run.first_sector, run.sectors)
                    }
                })?;
                self.cache_failed(e);
                Ok(())
            }
        }
    }

    /// The slot caching a segment's line, allocated if needed, and whether the line was cached
    /// already; `None` when no slot can be freed.
    fn slot_for(&self, seg: &Segment) -> Result<Option<(u32, bool)>> {
        self.core
            .with_map(|map| match map.lookup(self.id, seg.line) {
                Some(hit) => Ok(Some((hit.slot, true))),
                None => {
                    self.core.apply_recorded_touches(map);
                    Ok(map
                        .allocate(self.id, seg.line, &self.core.locks)?
                        .map(|slot| (slot, false)))
                }
            })
    }

    /// The slot a write-back write of `seg` may make dirty: its line's slot when the line
    /// holds dirty data already (an overwrite is absorbed whatever the dirty limit), else,
    /// below the cache's dirty limit and the volume's cap, the line's slot or a newly
    /// allocated one. `None` when the write must go around: the cache or the volume is at its
    /// dirty limit, or no slot can be freed.
    fn slot_to_dirty(&self, seg: &Segment) -> Result<Option<(u32, bool)>> {
        self.core.with_map(|map| {
            let found = map.lookup(self.id, seg.line);
            let dirty_already =
                found.is_some_and(|l| map.dirty_of(l.slot).is_some_and(|d| !d.is_empty()));
            if !dirty_already && !self.may_dirty_another_line(map) {
                return Ok(None);
            }
            match found {
                Some(hit) => Ok(Some((hit.slot, true))),
                None => {
                    self.core.apply_recorded_touches(map);
                    Ok(map
                        .allocate(self.id, seg.line, &self.core.locks)?
                        .map(|slot| (slot, false)))
                }
            }
        })
    }

    fn invalidate(&self, offset: u64, length: u64) -> Result<()> {
        self.core.with_map(|map| {
            self.segments(offset, length).try_for_each(|seg| {
                map.invalidate(self.id, seg.line, seg.first_sector, seg.sectors)
            })
        })
    }

    /// After a failed backing write of a range: clean cached copies no longer match the
    /// backing device and are dropped; dirty ones stay (they are newer than either).
    fn invalidate_clean(&self, offset: u64, length: u64) -> Result<()> {
        self.core.with_map(|map| {
            self.segments(offset, length).try_for_each(|seg| {
                map.invalidate_clean(self.id, seg.line, seg.first_sector, seg.sectors)
            })
        })
    }

    /// Writes `data` at `offset` (any offset and length: `partial.rs`); with `fua`, durable
    /// before returning.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let _timed = self.latency.timer(LatencyKind::Write);
        let length = data.len() as u64;
        self.check_writable_bytes(offset, length)?;
        self.count(Counter::Writes, 1);
        self.count(Counter::BytesWritten, length);
        self.write_checked(offset, data, fua)
    }

    /// [`Volume::write`] after its checks and counts.
    fn write_checked(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let length = data.len() as u64;
        if length == 0 {
            return Ok(());
        }
        let _mode_fixed = self.mode_gate.read().unwrap_or_else(|p| p.into_inner());
        if Widened::of(offset, length).is_some() {
            return self.write_partial(offset, data, fua);
        }
        let bypass = self.write_bypasses(offset, length);
        let hit = self.write_sectors(offset, data, fua, bypass)?;
        self.count_write_hit(hit);
        Ok(())
    }

    /// The stream detector's verdict on a write request (asked once per request).
    fn write_bypasses(&self, offset: u64, length: u64) -> bool {
        self.mode() != CacheMode::PassThrough && self.stream_bypass(offset, length)
    }

    /// One write hit per request that put data into a cached line.
    fn count_write_hit(&self, hit: bool) {
        if hit {
            self.count(Counter::WriteHits, 1);
        }
    }

    /// Writes whole sectors of a request whose stream verdict is `bypass`, the mode gate held
    /// by the caller; true when data went into a cached line (a write hit, counted by the
    /// caller once per request).
    fn write_sectors(&self, offset: u64, data: &[u8], fua: bool, bypass: bool) -> Result<bool> {
        let length = data.len() as u64;
        let held = if self.mode() == CacheMode::WriteBack {
            // Into the cache, most of them: no wait for the disk.
            self.lock_lines(offset, length)
        } else {
            self.lock_when_disk_idle(offset, length)
        };
        self.write_held(offset, data, fua, (held, KeepHeld::WhenDirty), bypass)
    }

    /// Writes whole sectors whose lines `held` holds, the mode gate held by the caller;
    /// `bypass`: the request's stream verdict. True for a write hit.
    fn write_held(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
        (held, keep): (RangeGuard<'_>, KeepHeld),
        bypass: bool,
    ) -> Result<bool> {
        let length = data.len() as u64;
        let mode = self.mode();
        if bypass {
            self.count(Counter::BytesBypassed, length);
        }
        // Outside write-back no write can dirty a line while this one runs (the mode is fixed),
        // so lines without dirty data need not be held across the disk write.
        let unheld = keep == KeepHeld::WhenDirty
            && mode != CacheMode::WriteBack
            && !self.lines_hold_dirty_data(offset, length);
        match mode {
            CacheMode::WriteThrough if !bypass && self.state() == VolumeState::Healthy => {
                let hit = if unheld {
                    self.write_through_unheld(offset, data, fua, held)?
                } else {
                    let hit = self.write_through(offset, data, fua)?;
                    drop(held);
                    hit
                };
                if fua && self.needs_commit() {
                    // The write may have superseded dirty sectors (while a mode change drains
                    // them): the journal must say so before the write counts as durable, or
                    // recovery would bring the old data back.
                    self.commit()?;
                }
                Ok(hit)
            }
            CacheMode::WriteBack if !bypass && self.caches_writes_back() => {
                let hit = self.write_back(offset, data)?;
                drop(held);
                if fua {
                    self.commit()?;
                } else {
                    self.commit_if_batch_full()?;
                }
                Ok(hit)
            }
            _ => {
                if unheld {
                    self.write_around_unheld(offset, data, fua, held)?;
                } else {
                    self.write_around(offset, data, fua)?;
                    drop(held);
                }
                if fua && self.needs_commit() {
                    // The write may have superseded dirty data: the journal must say so before
                    // the write counts as durable, or recovery would bring the old data back.
                    self.commit()?;
                }
                Ok(false)
            }
        }
    }

    /// Whether a FLUSH or FUA must run a commit: the cache may hold dirty data, or a change to
    /// it waits to be recorded. When neither shows, a commit another thread runs may still be
    /// recording a change this request depends on (it took the change from the list): wait for
    /// it to end, then look again (a failed one puts its changes back).
    fn needs_commit(&self) -> bool {
        if self.dirty_possible() {
            return true;
        }
        self.core.wait_for_commit_in_flight();
        self.dirty_possible()
    }

    fn dirty_possible(&self) -> bool {
        self.configured_mode() == CacheMode::WriteBack || {
            let map = self.core.map();
            map.total_dirty_lines() > 0 || map.changes_pending() > 0
        }
    }

    /// Commits the journal for a FLUSH or FUA. After a failed commit the dirty data in the
    /// cache may not be durable: every such commit fails while any of it is left (checked by
    /// the commit under the journal lock), and the volume stops caching new writes (they go to
    /// the backing device) until the cleaner has written it all back.
    fn commit(&self) -> Result<()> {
        let result = self.core.commit(CommitPurpose::Durability);
        if let Err(EngineError::CacheDevice { source, .. }) = &result {
            self.cache_failed(std::io::Error::new(source.kind(), source.to_string()));
        }
        result
    }

    /// To the backing device only; cached copies of the range are dropped after the write
    /// succeeded (dirty ones included: the new data supersedes them).
    fn write_around(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        if let Err(e) = self.write_backing(data, offset, fua) {
            self.invalidate_clean(offset, data.len() as u64)?;
            return Err(e);
        }
        self.invalidate(offset, data.len() as u64)
    }

    /// The lines of `[offset, offset + length)`, taken in order.
    fn lock_lines(&self, offset: u64, length: u64) -> RangeGuard<'_> {
        let (first, last) = self.line_range(offset, length);
        self.core.locks.lock_range(self.id, first, last)
    }

    /// Takes the lines of `[offset, offset + length)` at a moment when no disk write
    /// overlapping `(watch_offset, watch_len)` is in flight, unless `no_disk_needed` says the
    /// request will not touch the disk: a request that must wait for such a write waits before
    /// taking its lines, not holding them, so hits on the lines' other sectors never wait
    /// behind it (review 16). Every disk write begins with its lines held, so none can begin
    /// while they are held. After `LOCK_RETRIES` tries it takes them anyway and waits holding
    /// them: correct, only slower for those hits.
    fn lock_lines_disk_idle(
        &self,
        (offset, length): (u64, u64),
        (watch_offset, watch_len): (u64, u64),
        no_disk_needed: impl Fn() -> bool,
    ) -> RangeGuard<'_> {
        for _ in 0..LOCK_RETRIES {
            let held = self.lock_lines(offset, length);
            if no_disk_needed() || !self.backing().write_in_flight(watch_offset, watch_len) {
                return held;
            }
            drop(held);
            self.backing().wait_for_writes(watch_offset, watch_len);
        }
        self.lock_lines(offset, length)
    }

    /// Takes the lines of a request that writes `[offset, offset + length)` to the disk: it
    /// must land after any write of that range in flight.
    fn lock_when_disk_idle(&self, offset: u64, length: u64) -> RangeGuard<'_> {
        self.lock_lines_disk_idle((offset, length), (offset, length), || false)
    }

    /// Takes a read's lines. A read that will need the disk (not all cached) waits for disk
    /// writes in flight on its lines' span first: a miss reads whole lines, and waits for
    /// every write of them in flight (`read_backing`). A read served from the cache never
    /// waits for the disk.
    fn lock_for_read(&self, offset: u64, length: u64) -> RangeGuard<'_> {
        let (first, last) = self.line_range(offset, length);
        let ls = self.core.layout.line_size;
        let span_start = first * ls;
        let span_len = ((last + 1) * ls).min(self.size) - span_start;
        self.lock_lines_disk_idle((offset, length), (span_start, span_len), || {
            self.all_cached(offset, length)
        })
    }

    /// Whether any line of the range holds dirty sectors, or sectors the durable journal may
    /// still call dirty: writes of such lines keep them held throughout (their dirty data is
    /// superseded under the lines, `put_written_through`).
    fn lines_hold_dirty_data(&self, offset: u64, length: u64) -> bool {
        let map = self.core.map_read();
        self.segments(offset, length).any(|seg| {
            map.peek(self.id, seg.line).is_some_and(|hit| {
                map.dirty_of(hit.slot).is_some_and(|d| !d.is_empty())
                    || !map.recorded_dirty_of(hit.slot).is_empty()
            })
        })
    }

    /// Write-around whose lines hold no dirty data, without holding them across the disk
    /// write (`backing_order.rs`): the range leaves the cache first, so a read of it misses and
    /// waits for this write on the disk; hits on the lines' other sectors go on meanwhile.
    fn write_around_unheld(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
        held: RangeGuard<'_>,
    ) -> Result<()> {
        let length = data.len() as u64;
        let in_flight = self.backing().begin_client_write(offset, length);
        self.invalidate(offset, length)?;
        drop(held);
        let written = self.write_backing_begun(data, offset, fua, in_flight);
        if written.is_err() {
            // A read meanwhile may have cached what the failed write left: drop it.
            let _held = self.lock_lines(offset, length);
            self.invalidate_clean(offset, length)?;
        }
        written
    }

    /// Write-through whose lines hold no dirty data, without holding them across the disk
    /// write (`backing_order.rs`): the range leaves the cache, the lines are released, the
    /// disk write runs (hits on the lines' other sectors go on; reads of the range miss and
    /// wait for it), then the lines are taken again and the data is cached, unless another
    /// write of the range began meanwhile (it landed later, so this data would be stale).
    fn write_through_unheld(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
        held: RangeGuard<'_>,
    ) -> Result<bool> {
        let length = data.len() as u64;
        let (in_flight, fill) = self.backing().begin_write_through(offset, length);
        self.invalidate(offset, length)?;
        drop(held);
        let written = self.write_backing_begun(data, offset, fua, in_flight);
        let _held = self.lock_lines(offset, length);
        let may_fill = fill.finish();
        if let Err(e) = written {
            // The backing contents of the range are unknown: a read meanwhile may have cached
            // what the failed write left.
            self.invalidate_clean(offset, length)?;
            return Err(e);
        }
        if may_fill && self.state() == VolumeState::Healthy {
            return self.cache_written_through(offset, data);
        }
        Ok(false)
    }

    /// Backing first (the cache never holds the only copy), then the cache. True for a write
    /// hit.
    fn write_through(&self, offset: u64, data: &[u8], fua: bool) -> Result<bool> {
        if let Err(e) = self.write_backing(data, offset, fua) {
            // The backing contents of the range are now unknown: the cache must not claim them.
            self.invalidate_clean(offset, data.len() as u64)?;
            return Err(e);
        }
        self.cache_written_through(offset, data)
    }

    /// Puts data just written through to the backing device in the cache, line by line as
    /// admission lets it; true when a line was cached already (a write hit).
    fn cache_written_through(&self, offset: u64, data: &[u8]) -> Result<bool> {
        let mut hit = false;
        for seg in self.segments(offset, data.len() as u64) {
            // A line not admitted stays out of the cache: the write went around it (the line
            // has no cached copy to drop).
            if self.admits(&seg) {
                hit |= self.put_written_through(&seg, &data[seg.buf_at..seg.buf_at + seg.len])?;
            }
        }
        Ok(hit)
    }

    /// Into the cache only, marked dirty; the cleaner writes it back later. A segment whose
    /// line admission keeps out, that gets no line (the cache is full of dirty data) or whose
    /// cache write fails goes to the backing device instead (as write-around: the FLUSH or
    /// FUA that follows flushes the backing device too).
    ///
    /// Sectors of zeroes go to the backing device too: after an unclean stop a dirty sector
    /// that reads as zeroes but whose recorded checksum says otherwise is taken for a lost
    /// cache region (docs/design.md §4.8), so a zero sector must never be written in place
    /// of dirty data the journal may still name.
    fn write_back(&self, offset: u64, data: &[u8]) -> Result<bool> {
        let mut hit = false;
        let now = self.core.now_secs();
        for seg in self.segments(offset, data.len() as u64) {
            if !self.admits(&seg) {
                self.write_around(seg.offset, &data[seg.buf_at..seg.buf_at + seg.len], false)?;
                continue;
            }
            for (run, zeroes) in sector_runs(seg, data) {
                let part = &data[run.buf_at..run.buf_at + run.len];
                if zeroes {
                    self.write_around(run.offset, part, false)?;
                } else {
                    hit |= self.write_back_segment(&run, part, now)?;
                }
            }
        }
        Ok(hit)
    }

    /// After a write-back write, its lines released: when the changes waiting for a commit fill
    /// a batch, asks the background committer for one (bounding the records a commit writes and
    /// what a crash can lose), or commits here when no committer runs (tests, offline tools).
    fn commit_if_batch_full(&self) -> Result<()> {
        if self.core.map().changes_pending() < COMMIT_BATCH || self.core.commits.requests().ask() {
            return Ok(());
        }
        self.commit()
    }

    /// Writes one segment into its cache line, marked dirty. Returns whether the line was
    /// cached already.
    fn write_back_segment(&self, seg: &Segment, part: &[u8], now: u32) -> Result<bool> {
        let Some((slot, cached)) = self.slot_to_dirty(seg)? else {
            self.count(Counter::BytesWrittenAroundFull, seg.len as u64);
            self.write_around(seg.offset, part, false)?;
            return Ok(false);
        };
        match self.core.dev.write_at(part, self.slot_offset(slot, seg)) {
            Ok(()) => {
                self.count(Counter::BytesToCache, seg.len as u64);
                let mut crcs = [0u32; MAX_SECTORS];
                let crcs = sector_crcs(part, &mut crcs);
                self.core.write_map_paged(|m| {
                    m.need_checksums([slot])?;
                    Ok(m.set_dirty(slot, seg.first_sector, crcs, now))
                })?;
            }
            Err(e) => {
                // What the slot now holds for these sectors is unknown; the new data goes
                // to the backing device and supersedes any older dirty copy.
                self.cache_failed(e);
                if let Err(e) = self.write_backing(part, seg.offset, false) {
                    self.after_failing_everywhere(slot, seg, part, now)?;
                    return Err(e);
                }
                self.core
                    .with_map(|m| m.invalidate_slot(slot, seg.first_sector, seg.sectors))?;
            }
        }
        Ok(cached)
    }

    /// A write that failed on the cache device and on the backing device may have landed on
    /// either, sector by sector. A dirty sector is the only copy of its data: it keeps the
    /// old data's checksum where the slot still holds the old data and takes the new one's
    /// where the new data landed (either is a value the failed write may leave), read back
    /// to tell which. Clean sectors are dropped: the backing device holds one of the two.
    fn after_failing_everywhere(
        &self,
        slot: u32,
        seg: &Segment,
        part: &[u8],
        now: u32,
    ) -> Result<()> {
        let mut landed = AlignedBuf::zeroed(part.len());
        let read_back = self
            .core
            .dev
            .read_at(&mut landed, self.slot_offset(slot, seg));
        let mut new_crcs = [0u32; MAX_SECTORS];
        let new_crcs = sector_crcs(part, &mut new_crcs);
        self.core.write_map_paged(|m| {
            m.need_checksums([slot])?;
            Ok(self.keep_either_write(m, slot, seg, &landed, read_back.is_ok(), new_crcs, now))
        })
    }

    /// `after_failing_everywhere`'s change of the map, its checksums in RAM: each dirty sector
    /// that holds the failed write's data takes its checksum; with nothing read back, each
    /// accepts either value.
    #[allow(clippy::too_many_arguments)]
    fn keep_either_write(
        &self,
        m: &mut MapState,
        slot: u32,
        seg: &Segment,
        landed: &[u8],
        read_back_ok: bool,
        new_crcs: &[u32],
        now: u32,
    ) -> std::result::Result<(), crate::map::Invariant> {
        let dirty = m.dirty_of(slot).unwrap_or_default();
        let sector = SECTOR_SIZE as usize;
        let holds_new = |i: usize| {
            read_back_ok
                && dirty.get(seg.first_sector + i)
                && sector_crc(&landed[i * sector..(i + 1) * sector]) == new_crcs[i]
        };
        for (run, new) in split_runs(*seg, holds_new) {
            let at = (run.buf_at - seg.buf_at) / sector;
            if new {
                m.set_dirty(slot, run.first_sector, &new_crcs[at..at + run.sectors], now)?;
            }
        }
        if !read_back_ok {
            // Which data each dirty sector holds is unknown: a later read or writeback
            // accepts the old data or the failed write's, nothing else.
            m.allow_either(slot, seg.first_sector, new_crcs);
        }
        m.invalidate_clean(self.id, seg.line, seg.first_sector, seg.sectors)
    }

    /// Makes every completed write durable: the backing device flushed and, when the cache
    /// may hold dirty data, the journal committed.
    pub fn flush(&self) -> Result<()> {
        let _timed = self.latency.timer(LatencyKind::Flush);
        self.core.check_running()?;
        self.check_online()?;
        self.count(Counter::Flushes, 1);
        if self.backing().has_unflushed_writes() {
            // The client waits for the disk (often for the cleaner's writes): it is using
            // the disk, so a cleaner batch begun while it was idle stops (review 14).
            self.core.note_client_backing_io();
        }
        self.flush_backing()?;
        if self.needs_commit() {
            self.commit()?;
        }
        Ok(())
    }

    /// Drops a range from the cache and discards it on the backing device where supported;
    /// of a range not made of whole sectors, only the whole sectors inside it.
    pub fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        let _timed = self.latency.timer(LatencyKind::Trim);
        self.count(Counter::Trims, 1);
        self.check_writable_bytes(offset, length)?;
        let (offset, length) = partial::whole_sectors_inside(offset, length);
        if length == 0 {
            return Ok(());
        }
        self.on_backing_then_uncache(offset, length, fua, |b| {
            b.discard(offset, length).map(|_| ())
        })
    }

    /// Makes a range read as zeroes (any offset and length: `partial.rs`).
    pub fn write_zeroes(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        let _timed = self.latency.timer(LatencyKind::WriteZeroes);
        self.count(Counter::WriteZeroes, 1);
        let zero_whole = |offset, length| {
            self.on_backing_then_uncache(offset, length, fua, |b| b.write_zeroes(offset, length))
        };
        // Checked before widening: an offset near u64::MAX must be refused, not rounded.
        self.check_writable_bytes(offset, length)?;
        if Widened::of(offset, length).is_none() {
            return zero_whole(offset, length);
        }
        self.write_zeroes_partial(offset, length, fua, zero_whole)
    }

    /// Applies `on_backing` to the backing device, then drops the range from the cache, with
    /// the range's lines held so no read sees the old cached copy after the change.
    fn on_backing_then_uncache(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        on_backing: impl FnOnce(&dyn BlockDevice) -> std::io::Result<()>,
    ) -> Result<()> {
        self.check_writable(offset, length)?;
        if length == 0 {
            return Ok(());
        }
        let held = self.lock_when_disk_idle(offset, length);
        self.core.note_client_backing_io();
        let in_flight = self.backing().begin_client_write(offset, length);
        let done = self.backing().write_with(on_backing);
        drop(in_flight);
        if let Err(e) = done {
            self.invalidate_clean(offset, length)?;
            return Err(self.backing_err(e));
        }
        self.invalidate(offset, length)?;
        drop(held);
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Brings a range into the cache (NBD_CMD_CACHE), one line at a time; a range not made
    /// of whole sectors, with the whole sectors around it.
    pub fn prefetch(&self, offset: u64, length: u64) -> Result<()> {
        self.check_bytes(offset, length)?;
        let (offset, length) = match Widened::of(offset, length) {
            Some(wide) => (wide.start, wide.len),
            None => (offset, length),
        };
        if self.mode() == CacheMode::PassThrough
            || self.state() != VolumeState::Healthy
            || length == 0
        {
            return Ok(());
        }
        // One line at a time, into a buffer of at most one line: a CACHE request carries no
        // payload, so the server's request-memory limit does not see what it holds here
        // (design.md §6.1 counts it with the read misses).
        let line_size = self.core.layout.line_size;
        let end = offset + length;
        let mut buf = AlignedBuf::zeroed(length.min(line_size) as usize);
        let mut pos = offset;
        while pos < end {
            let n = (end - pos).min(line_size - pos % line_size);
            let _held = self.lock_lines(pos, n);
            // The client asked for this data to be cached: admission does not apply.
            self.read_locked(pos, &mut buf[..n as usize], Fill::Everything, &mut None)?;
            pos += n;
        }
        Ok(())
    }

    /// Whether a read (`is_write` false) or write of `length` bytes at `offset` will probably
    /// be served by the cache device alone, never waiting for the backing device: a read whose
    /// every sector is in the cache now, or a write in write-back mode on a healthy cache that
    /// is below its dirty limit or whose every line holds dirty data already (at the limit a
    /// write to any other line goes to the backing device). Write-through and write-around
    /// writes, reads that miss, and requests out of range are `false`. Cheap: one look at the map per line, no line lock, no change to the policy's
    /// view of use. It is a hint (the NBD server picks a worker lane with it): the answer may
    /// be wrong by the time the request runs (a line evicted, a write sent around a full cache
    /// or a stream), which costs latency only, never correctness.
    pub fn likely_served_from_cache(&self, is_write: bool, offset: u64, length: u64) -> bool {
        let in_range = offset
            .checked_add(length)
            .is_some_and(|end| end <= self.size);
        if length == 0 || !in_range {
            return false;
        }
        let (offset, length, partial_edges) = match Widened::of(offset, length) {
            Some(wide) if wide.start + wide.len <= self.size => (wide.start, wide.len, true),
            Some(_) => return false,
            None => (offset, length, false),
        };
        if is_write {
            // A partial-sector write reads its partial sectors first: from the cache only if
            // they are there (the middle ones are overwritten, cached or not).
            return self.caches_writes_back()
                && self.absorbable(offset, length)
                && (!partial_edges || self.edges_cached(offset, length));
        }
        if self.mode() == CacheMode::PassThrough {
            return false;
        }
        // The read lock, as hits take it (review13 R13-2: the write lock here made every READ
        // exclude every hit).
        self.all_cached(offset, length)
    }
}

/// Changed line records that make a write-back writer commit on its own.
const COMMIT_BATCH: usize = 4096;

/// Sectors in the largest line (1 MiB), for per-segment arrays on the stack.
const MAX_SECTORS: usize = (ssdcache_format::MAX_LINE_SIZE / SECTOR_SIZE) as usize;

/// Splits a segment into runs of whole sectors that are all zeroes in `data` (the request's
/// buffer) and runs that are not: `(run, zeroes)`.
fn sector_runs(seg: Segment, data: &[u8]) -> impl Iterator<Item = (Segment, bool)> + '_ {
    let sector = SECTOR_SIZE as usize;
    split_runs(seg, move |i| {
        let at = seg.buf_at + i * sector;
        data[at..at + sector].iter().all(|&b| b == 0)
    })
}

/// Splits a segment into runs of consecutive sectors for which `pred` (given the sector's
/// index in the segment) is the same: `(run, pred)`.
fn split_runs(seg: Segment, pred: impl Fn(usize) -> bool) -> impl Iterator<Item = (Segment, bool)> {
    let sector = SECTOR_SIZE as usize;
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= seg.sectors {
            return None;
        }
        let value = pred(i);
        let end = (i + 1..seg.sectors)
            .find(|&j| pred(j) != value)
            .unwrap_or(seg.sectors);
        let run = Segment {
            line: seg.line,
            offset: seg.offset + (i * sector) as u64,
            buf_at: seg.buf_at + i * sector,
            len: (end - i) * sector,
            first_sector: seg.first_sector + i,
            sectors: end - i,
            in_line: seg.in_line + (i * sector) as u64,
        };
        i = end;
        Some((run, value))
    })
}

/// A slot whose checksums were taken for a read, and whether sectors that match them must be
/// reported back to the map (`MapState::sector_crcs`).
#[derive(Debug, Clone, Copy)]
struct CrcSnapshot {
    slot: u32,
    confirm: bool,
}

/// The checksum of each 4 KiB sector of `data`, in `out`; returns the filled part.
pub(crate) fn sector_crcs<'a>(data: &[u8], out: &'a mut [u32; MAX_SECTORS]) -> &'a [u32] {
    let n = data.len() / SECTOR_SIZE as usize;
    for (crc, sector) in out.iter_mut().zip(data.chunks(SECTOR_SIZE as usize)) {
        *crc = sector_crc(sector);
    }
    &out[..n]
}
