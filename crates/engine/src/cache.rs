//! A cache device with its volumes: open (load the checkpoint or start cold), serve through
//! [`Volume`]s, and shut down (write the checkpoint, mark clean).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ssdcache_device::counted::WriteCounted;
use ssdcache_device::{AlignedBuf, BlockDevice};
use ssdcache_format::{
    sector_crc, BackingIdentity, CacheMode, CacheState, Layout, LineRecord, MetaPage, Superblock,
    VolumeCounters, VolumeSlot, FORMAT_VERSION, SECTOR_SIZE,
};

use crate::admission::Admission;
use crate::checksums::{self, ChecksumPages, ChecksumUsage, PageContent, PageRead, Pressure};
use crate::commit::{self, Backing, CommitPurpose, Commits};
use crate::error::{EngineError, Result};
use crate::journal::{self, JournalPosition};
use crate::locks::LineLocks;
use crate::map::{dirty_limit_lines, Invariant, MapState, NeedPages, RestoreChecksums};
use crate::policy;
use crate::superblock::write_superblock;
use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use crate::sync::{MapLock, MapReadGuard, MapWriteGuard, Mutex, RwLock};
use crate::touches::TouchLog;
use crate::volume::Volume;

/// Metadata pages are read and written this many at a time (1 MiB).
const META_BATCH_PAGES: usize = 256;

/// Times an operation needing checksum pages reads them without the map's lock before it
/// reads them under it (`CacheCore::read_map_paged`); and the most rounds of that.
const PAGE_IN_ATTEMPTS: usize = 3;
const LOCKED_PAGE_IN_ROUNDS: usize = 1024;
/// Modified checksum pages written per round when the frames are over their budget.
const PAGE_WRITES_PER_ROUND: usize = 64;

/// Keeps checksum frames in RAM while it lives (`CacheCore::hold_checksum_pages`).
pub(crate) struct ChecksumHold<'c>(&'c CacheCore);

impl Drop for ChecksumHold<'_> {
    fn drop(&mut self) {
        let mut map = self.0.map();
        map.checksums_mut().release();
        map.checksums_mut().shrink_to_budget();
    }
}

type Checked<T = ()> = std::result::Result<T, Invariant>;

/// Bytes written to the cache device: before this start (from the superblock) and since.
pub(crate) struct Wear {
    before: u64,
    counted: Arc<WriteCounted>,
}

impl Wear {
    pub fn total(&self) -> u64 {
        self.before.saturating_add(self.counted.bytes_written())
    }

    pub fn since_start(&self) -> u64 {
        self.counted.bytes_written()
    }
}

/// What the volumes of one cache device share.
pub(crate) struct CacheCore {
    /// The cache device, its writes counted (`wear`).
    pub dev: Arc<dyn BlockDevice>,
    pub wear: Wear,
    pub layout: Layout,
    /// Hits read it (`map_read`) and record their uses aside (`touches`); everything that
    /// changes it writes.
    map: MapLock<MapState>,
    /// The map's per-volume occupancy figures, read without its lock (statistics, metrics).
    pub occupancy: Arc<crate::map::Occupancies>,
    touches: TouchLog,
    pub locks: LineLocks,
    /// The commit protocol's state: the journal, the committer's requests and the superblock
    /// naming the live log (`commit.rs` owns it; only its methods change it).
    pub commits: Commits,
    /// Every volume's backing device, each counting its writes against its flushes: what a
    /// commit flushes. A volume added while serving is appended before it takes requests.
    pub backings: RwLock<Vec<Arc<Backing>>>,
    /// The cache's clock: dirty ages and idle detection count from here.
    clock: Instant,
    /// When a client request last went to a backing device (nanoseconds on `clock`).
    last_client_backing_io: AtomicU64,
    /// Set once a check that guards user data failed: from then on the engine refuses every
    /// request, commit, writeback and checkpoint, so the cache stays as the journal last
    /// recorded it (marked running: the next start replays it).
    halted: AtomicBool,
    halt_reason: Mutex<String>,
}

impl CacheCore {
    pub fn map(&self) -> MapWriteGuard<'_, MapState> {
        // The map is only changed in short non-panicking sections; a poisoned lock still holds
        // a consistent map.
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The map for looking only: hits on different lines hold it together.
    pub fn map_read(&self) -> MapReadGuard<'_, MapState> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a hit's use of `slot` for the replacement policy without the write lock; a full
    /// stripe of uses is applied here (`TouchLog`).
    pub fn note_touch(&self, slot: u32) {
        if let Some(log) = self.touches.record(slot) {
            self.map().apply_touches(&log);
            self.touches.recycle(log);
        }
    }

    /// Applies the uses hits recorded aside, before a victim is chosen.
    pub fn apply_recorded_touches(&self, map: &mut MapState) {
        self.touches.drain(|slots| map.apply_touches(slots));
    }

    /// Runs `op` on the map; a failed invariant halts the engine.
    pub fn with_map<T>(
        &self,
        op: impl FnOnce(&mut MapState) -> std::result::Result<T, Invariant>,
    ) -> Result<T> {
        let result = op(&mut self.map());
        result.map_err(|Invariant(what)| self.halt(what))
    }

    /// Runs `op` on the map under its read lock. When it returns `NeedPages` (checksums it
    /// needs are not in RAM), those metadata pages are read without the lock and `op` runs
    /// again; after `PAGE_IN_ATTEMPTS` such rounds (other threads' pages took the frames
    /// meanwhile) the pages are read under the write lock, which keeps them until `op` ran.
    /// `op` must change nothing before it returns `NeedPages`.
    pub fn read_map_paged<T>(
        &self,
        mut op: impl FnMut(&MapState) -> std::result::Result<T, NeedPages>,
    ) -> Result<T> {
        for _ in 0..PAGE_IN_ATTEMPTS {
            // The read guard must be gone before `page_in` takes the lock.
            let tried = op(&self.map_read());
            match tried {
                Ok(t) => return Ok(t),
                Err(NeedPages(pages)) => self.page_in(&pages)?,
            }
        }
        self.locked_page_in(|map| op(map))
    }

    /// As `read_map_paged`, under the write lock; a failed invariant halts the engine.
    pub fn write_map_paged<T>(
        &self,
        mut op: impl FnMut(&mut MapState) -> std::result::Result<Checked<T>, NeedPages>,
    ) -> Result<T> {
        for _ in 0..PAGE_IN_ATTEMPTS {
            let (tried, pressure) = {
                let mut map = self.map();
                let tried = op(&mut map);
                (tried, map.checksums().pressure())
            };
            self.relieve(pressure)?;
            let need = match tried {
                Ok(result) => return result.map_err(|Invariant(what)| self.halt(what)),
                Err(NeedPages(pages)) => pages,
            };
            self.page_in(&need)?;
        }
        self.locked_page_in(|map| op(map))?
            .map_err(|Invariant(what)| self.halt(what))
    }

    /// Runs `op` under the write lock, reading the pages it asks for under the lock and
    /// keeping every frame until it ran (bounded: each round installs what it asked for).
    fn locked_page_in<T>(
        &self,
        mut op: impl FnMut(&mut MapState) -> std::result::Result<T, NeedPages>,
    ) -> Result<T> {
        let mut map = self.map();
        map.checksums_mut().hold();
        let mut result = Err(self.cache_err(std::io::Error::other(
            "the checksum pages a request needs kept being asked for",
        )));
        for _ in 0..LOCKED_PAGE_IN_ROUNDS {
            match op(&mut map) {
                Ok(t) => {
                    result = Ok(t);
                    break;
                }
                Err(NeedPages(pages)) => {
                    for page in pages {
                        let plan = map.checksums().read_plan(page);
                        let content = self.read_checksum_page(&plan);
                        map.install_checksums(&plan, content);
                    }
                }
            }
        }
        map.checksums_mut().release();
        map.checksums_mut().shrink_to_budget();
        let pressure = map.checksums().pressure();
        drop(map);
        self.relieve(pressure)?;
        result
    }

    /// Reads checksum pages without the map's lock and installs them (docs/design.md §3,
    /// "Checksums out of RAM"); then writes modified pages if the frames are over budget.
    pub fn page_in(&self, pages: &[u32]) -> Result<()> {
        let plans: Vec<PageRead> = {
            let map = self.map_read();
            pages
                .iter()
                .filter(|&&p| !map.checksums().is_page_resident(p))
                .map(|&p| map.checksums().read_plan(p))
                .collect()
        };
        let contents: Vec<PageContent> = plans.iter().map(|p| self.read_checksum_page(p)).collect();
        let pressure = {
            let mut map = self.map();
            for (plan, content) in plans.iter().zip(contents) {
                map.install_checksums(plan, content);
            }
            map.checksums().pressure()
        };
        self.relieve(pressure)
    }

    /// Modified checksum frames over their budget are written by the committer when one
    /// runs (asked here), so no client request waits for them; by the caller when none runs
    /// (tests, offline tools) or when the frames reached their hard limit.
    fn relieve(&self, pressure: Pressure) -> Result<()> {
        match pressure {
            Pressure::None => Ok(()),
            Pressure::WriteSoon if self.commits.requests().ask_for_page_writes() => Ok(()),
            Pressure::WriteSoon | Pressure::WriteNow => self.write_due_checksum_pages(),
        }
    }

    /// One checksum page as `plan` says: zeroes when the device holds nothing of it this run;
    /// lost when it cannot be read twice in a row or fails its checks.
    fn read_checksum_page(&self, plan: &PageRead) -> PageContent {
        let Some(offset) = plan.from else {
            return PageContent::Zeroes;
        };
        let mut page = AlignedBuf::zeroed(SECTOR_SIZE as usize);
        let read = self
            .dev
            .read_at(&mut page, offset)
            .or_else(|_| self.dev.read_at(&mut page, offset));
        match read {
            Ok(()) => ChecksumPages::decode(self.layout.line_size, plan, &page),
            Err(e) => {
                tracing::warn!(
                    "metadata page {} of {} could not be read ({e}): the checksums of its \
                     lines are lost",
                    plan.page,
                    self.dev.describe()
                );
                PageContent::Lost
            }
        }
    }

    /// Writes modified checksum pages while the frames are over their budget, so they can be
    /// dropped (a few rounds at most; what is left waits for the next call). A failed write
    /// keeps its frame modified and in RAM, and is not tried again before
    /// `retry_failed_checksum_writes` (the committer's, once a second): a failing cache device
    /// costs each request no write, and the log one line per failing burst.
    pub fn write_due_checksum_pages(&self) -> Result<()> {
        let line_size = self.layout.line_size;
        let mut page = AlignedBuf::zeroed(SECTOR_SIZE as usize);
        for _ in 0..4 {
            let writes = {
                let mut map = self.map();
                if !map.checksums().writes_due() {
                    return Ok(());
                }
                map.checksums_mut()
                    .take_due_writes(PAGE_WRITES_PER_ROUND, false)
            };
            if writes.is_empty() {
                return Ok(());
            }
            // After a failure the rest of the round is not tried (handed back as failed).
            let mut failed = false;
            let done: Vec<bool> = writes
                .iter()
                .map(|w| {
                    if failed {
                        return false;
                    }
                    ChecksumPages::encode(line_size, w, &mut page);
                    if let Err(e) = self.dev.write_at(&page, w.offset) {
                        failed = true;
                        self.warn_page_write_failed(w.page, &e);
                    }
                    !failed
                })
                .collect();
            let mut map = self.map();
            for (w, ok) in writes.iter().zip(done) {
                map.checksums_mut().written(w, ok);
            }
            map.checksums_mut().shrink_to_budget();
            if failed {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Frames whose write failed may be written again (the committer, once a second).
    pub fn retry_failed_checksum_writes(&self) {
        self.map().checksums_mut().retry_failed_writes();
    }

    /// Logs a failed page write, at most once a minute (a failing device fails every one).
    fn warn_page_write_failed(&self, page: u32, e: &std::io::Error) {
        static LAST: AtomicU64 = AtomicU64::new(0);
        let now = self.clock.elapsed().as_secs() + 60;
        if LAST.swap(now, Ordering::Relaxed) + 60 <= now {
            tracing::warn!(
                "metadata page {page} of {} could not be written ({e}): its checksums stay in \
                 memory, and the write is tried again every second (further failures are not \
                 logged for a minute)",
                self.dev.describe()
            );
        }
    }

    /// Keeps every checksum frame in RAM while the guard lives (a commit gathering its
    /// records: pages it reads are not dropped before it has them all).
    pub fn hold_checksum_pages(&self) -> ChecksumHold<'_> {
        self.map().checksums_mut().hold();
        ChecksumHold(self)
    }

    /// Stops the engine after a failed check (docs/design.md §4.7) and returns the error to
    /// give the request that found it.
    pub fn halt(&self, what: String) -> EngineError {
        if !self.halted.swap(true, Ordering::SeqCst) {
            tracing::error!(
                "internal check failed: {what}. The cache stops here: no further writes to \
                 either device; restart the daemon to replay the journal"
            );
            *self.halt_reason.lock().unwrap_or_else(|p| p.into_inner()) = what.clone();
        }
        EngineError::Halted(what)
    }

    /// Why the engine halted, if it did.
    pub fn halted(&self) -> Option<String> {
        self.halted.load(Ordering::SeqCst).then(|| {
            self.halt_reason
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
        })
    }

    /// Refuses work once the engine halted.
    pub fn check_running(&self) -> Result<()> {
        match self.halted() {
            Some(reason) => Err(EngineError::Halted(reason)),
            None => Ok(()),
        }
    }

    pub fn cache_err(&self, source: std::io::Error) -> EngineError {
        EngineError::CacheDevice {
            device: self.dev.describe(),
            source,
        }
    }

    /// Seconds since the cache opened, for dirty ages.
    pub fn now_secs(&self) -> u32 {
        self.clock.elapsed().as_secs().min(u64::from(u32::MAX)) as u32
    }

    pub fn note_client_backing_io(&self) {
        let nanos = self.clock.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        self.last_client_backing_io.store(nanos, Ordering::Relaxed);
    }

    /// How long ago a client request last used a backing device.
    pub fn backing_idle_for(&self) -> Duration {
        let last = Duration::from_nanos(self.last_client_backing_io.load(Ordering::Relaxed));
        self.clock.elapsed().saturating_sub(last)
    }

    /// Settles a sector read from `slot` whose data does not match its checksum. After an
    /// unclean stop the data may be a write newer than the last commit (the contract lets it
    /// survive), so it is accepted, unless it reads as zeroes: that is what a lost, truncated or
    /// discarded region returns. After a write that failed everywhere (`allow_either`) only
    /// that write's data is accepted. Otherwise the sector is damaged (and, if dirty, marked
    /// so the cleaner never writes it back); damaged data is never accepted later.
    pub fn settle_mismatch(&self, slot: u32, sector: usize, data: &[u8]) -> Mismatch {
        let zeroes = data.iter().all(|&b| b == 0);
        let crc = sector_crc(data);
        let settled = self.write_map_paged(|map| {
            map.need_checksums([slot])?;
            if map.checksums().checksum_unknown(slot, sector)
                && map.dirty_of(slot).is_some_and(|d| !d.get(sector))
            {
                // Its checksum was lost with its page: nothing is known to be wrong.
                return Ok(map
                    .invalidate_slot(slot, sector, 1)
                    .map(|()| Mismatch::Unknown));
            }
            if map.accept_newer_data(slot, sector, crc, zeroes) {
                return Ok(Ok(Mismatch::NewerWrite));
            }
            map.mark_damaged(slot, sector);
            Ok(Ok(Mismatch::Damaged))
        });
        // Only a halted engine fails here; nothing is accepted then.
        settled.unwrap_or(Mismatch::Damaged)
    }
}

/// What a checksum mismatch turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mismatch {
    /// Data written after the last commit before an unclean stop: kept.
    NewerWrite,
    /// The cache lost or damaged the sector.
    Damaged,
    /// A clean sector whose checksum was lost with its metadata page: dropped from the cache
    /// (the backing device has it), no error.
    Unknown,
}

/// A new volume to record at create.
pub struct NewVolume {
    pub name: String,
    pub mode: CacheMode,
    pub backing: BackingIdentity,
    /// A sequential stream bypasses the cache after this many bytes; 0 = never.
    pub sequential_cutoff: u64,
    /// Replacement policy id (`policy::NAMES`).
    pub policy: u32,
    /// Which missed lines are cached.
    pub admission: Admission,
}

/// How `open` found the cache.
#[derive(Debug, Clone, Default)]
pub struct OpenReport {
    pub warm: bool,
    pub restored_lines: u64,
    pub restored_bytes: u64,
    /// Why the cache starts cold, when it does.
    pub cold_reason: Option<String>,
    /// After an unclean stop: the journal replay.
    pub recovery: Option<RecoveryReport>,
}

/// What replaying the journal after an unclean stop found.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
    pub commits: u64,
    pub journal_blocks: u64,
    pub millis: u64,
}

/// The volumes of a cache at one moment, in the order they were opened or added
/// ([`Cache::add_volume`], [`Cache::remove_volume`] replace the list whole). An index into a
/// snapshot names the same volume in later ones until a volume is removed; additions and
/// removals while serving are made only by the control socket's one thread, which is also
/// the only one using indices across calls (`set-mode`).
#[derive(Clone)]
pub struct VolumeList(Arc<[Arc<Volume>]>);

impl std::ops::Deref for VolumeList {
    type Target = [Arc<Volume>];
    fn deref(&self) -> &[Arc<Volume>] {
        &self.0
    }
}

impl<'a> IntoIterator for &'a VolumeList {
    type Item = &'a Arc<Volume>;
    type IntoIter = std::slice::Iter<'a, Arc<Volume>>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

pub struct Cache {
    core: Arc<CacheCore>,
    /// Replaced whole (never changed in place) when a volume is added or removed.
    volumes: RwLock<VolumeList>,
    /// `retired_volume_ids`.
    retired_ids: AtomicU32,
    /// `record_latencies`, for volumes added later.
    latencies_on: AtomicBool,
    /// What the last open recovered from the journal, for `info`.
    recovery: Option<RecoveryReport>,
    pub(crate) cleaner: crate::cleaner::CleanerState,
}

pub(crate) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn format_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Format(e.to_string())
}

/// Formats `dev` as a cache holding one volume. Writes only the two superblocks.
pub fn format(dev: &dyn BlockDevice, line_size: u64, volume: NewVolume) -> Result<Superblock> {
    let layout = Layout::compute(dev.size(), line_size).map_err(format_err)?;
    format_layout(dev, layout, volume)
}

/// Like [`format`], with a journal of exactly `journal_blocks` 4 KiB blocks (at least two
/// compactions and one block): for tests, which need compactions to run often.
pub fn format_with_journal(
    dev: &dyn BlockDevice,
    line_size: u64,
    journal_blocks: u64,
    volume: NewVolume,
) -> Result<Superblock> {
    let layout =
        Layout::with_journal_blocks(dev.size(), line_size, journal_blocks).map_err(format_err)?;
    format_layout(dev, layout, volume)
}

fn format_layout(dev: &dyn BlockDevice, layout: Layout, volume: NewVolume) -> Result<Superblock> {
    if policy::by_id(volume.policy, 1).is_none() {
        return Err(format_err(format!(
            "unknown replacement policy id {}",
            volume.policy
        )));
    }
    let cache_uuid = *uuid::Uuid::new_v4().as_bytes();
    let sb = Superblock {
        version: FORMAT_VERSION,
        sequence: 1,
        cache_uuid,
        layout,
        state: CacheState::Clean,
        checkpoint_seq: 0,
        created_unix: now_unix(),
        updated_unix: now_unix(),
        unclean_starts: 0,
        // Random, so journal blocks left by an earlier format of the same device never match.
        journal_generation: u64::from_le_bytes(cache_uuid[..8].try_into().unwrap_or([1; 8])),
        journal_start_seq: 1,
        journal_start_block: 0,
        cache_bytes_written: 0,
        ssd_tbw_bytes: 0,
        volumes: vec![VolumeSlot {
            id: 0,
            uuid: *uuid::Uuid::new_v4().as_bytes(),
            name: volume.name,
            mode: volume.mode,
            read_only: false,
            backing: volume.backing,
            policy: volume.policy,
            admission: volume.admission.to_disk(),
            sequential_cutoff: volume.sequential_cutoff,
            counters: VolumeCounters::default(),
            dirty_lines: 0,
            dirty_bytes: 0,
        }],
    };
    write_superblock(dev, &sb)?;
    Ok(sb)
}

fn new_map(sb: &Superblock) -> Result<MapState> {
    let layout = sb.layout;
    let policy_id = sb
        .volumes
        .first()
        .map_or(policy::default_id(), |v| v.policy);
    let policy = policy::by_id(policy_id, layout.line_count as u32)
        .ok_or_else(|| format_err(format!("unknown replacement policy id {policy_id}")))?;
    Ok(MapState::new(
        layout.line_count as u32,
        layout.sectors_per_line() as usize,
        policy,
        layout.meta_offset,
    ))
}

fn start_position(sb: &Superblock) -> JournalPosition {
    JournalPosition {
        generation: sb.journal_generation,
        start_seq: sb.journal_start_seq,
        start_block: sb.journal_start_block % sb.layout.journal_blocks().max(1),
        next_seq: sb.journal_start_seq,
    }
}

/// Loads what the cache durably holds into `map`: after a clean stop the checkpoint (every
/// line); after an unclean one the journal's dirty lines (clean ones are dropped: their data
/// may have been overwritten by writes the metadata never recorded). Returns the report and
/// the end of the live journal.
fn load_state(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    map: &mut MapState,
) -> Result<(OpenReport, JournalPosition)> {
    let start = start_position(sb);
    match (sb.state, sb.checkpoint_seq) {
        (CacheState::Running, _) => {
            let began = Instant::now();
            let replayed = journal::replay(dev, &sb.layout, start, &mut |slot, rec| {
                apply_record(sb, map, slot, rec)
            })?;
            if replayed.commits == 0 {
                return Err(journal_lost(dev, sb));
            }
            map.rebuild_free_list();
            let (lines, bytes) = dirty_totals(sb, map);
            let recovery = RecoveryReport {
                dirty_lines: lines,
                dirty_bytes: bytes,
                commits: replayed.commits,
                journal_blocks: replayed.blocks,
                millis: began.elapsed().as_millis() as u64,
            };
            let report = OpenReport {
                warm: lines > 0,
                restored_lines: lines,
                restored_bytes: bytes,
                cold_reason: Some(
                    "the daemon did not stop cleanly (crash or kill -9): clean cached data is \
                     discarded, dirty data was recovered from the journal"
                        .into(),
                ),
                recovery: Some(recovery),
            };
            Ok((report, replayed.end))
        }
        (CacheState::Clean, 0) => Ok((cold("the cache is new"), start)),
        (CacheState::Clean, seq) => Ok((load_checkpoint(dev, sb, seq, map)?, start)),
    }
}

/// Every journal generation starts with a commit written before the superblock that names it;
/// a running cache whose log has none lost its journal region.
fn journal_lost(dev: &dyn BlockDevice, sb: &Superblock) -> EngineError {
    format_err(format!(
        "{}: the cache stopped uncleanly, but its journal has no commit where the superblock \
         says the log starts (generation {:#x}, block {}): the journal region was lost or \
         overwritten (was the cache file truncated or written by something else?). The dirty \
         data it recorded cannot be found, and the backing device may lack recent writes. \
         Nothing was changed. Keep the device as it is if you want to try to save data; to \
         start over without that data, `ssdcache create --discard-dirty-data`",
        dev.describe(),
        sb.journal_generation,
        sb.journal_start_block
    ))
}

/// Applies one replayed record (records come in journal order): it replaces whatever its slot
/// held, and a line recorded in a newer slot leaves its older one, so the last record of each
/// slot wins. Only dirty data is restored (clean lines are dropped after a crash).
fn apply_record(sb: &Superblock, map: &mut MapState, slot: u32, rec: &LineRecord) -> Result<()> {
    map.forget_slot(slot).map_err(metadata_inconsistent)?;
    if rec.dirty.is_empty() || !record_fits(sb, rec) {
        return Ok(());
    }
    map.forget_line(rec.volume, rec.backing_line)
        .and_then(|()| map.restore(slot, rec, true, RestoreChecksums::FromRecord))
        .map_err(metadata_inconsistent)
}

fn metadata_inconsistent(Invariant(what): Invariant) -> EngineError {
    format_err(format!("the cache metadata is inconsistent: {what}"))
}

fn dirty_totals(sb: &Superblock, map: &MapState) -> (u64, u64) {
    sb.volumes.iter().fold((0, 0), |(l, b), v| {
        let o = map.occupancy(v.id);
        (l + o.dirty_lines, b + o.dirty_sectors * SECTOR_SIZE)
    })
}

/// A volume's backing device as [`Cache::open_volumes`] takes it.
pub enum VolumeBacking {
    /// Opened, and proven to be the recorded device.
    Device(Arc<dyn BlockDevice>),
    /// Could not be opened or is not the recorded device: the volume is offline, `reason`
    /// says why (shown in its state and in the errors of its requests).
    Offline { reason: String },
}

impl Cache {
    /// Opens a cache whose superblock is `sb`, with `backings[i]` the device of
    /// `sb.volumes[i]` (identity already checked by the caller). Loads the checkpoint after a
    /// clean stop, replays the journal after an unclean one, then starts a new journal
    /// generation holding every dirty line and marks the cache running.
    pub fn open(
        dev: Arc<dyn BlockDevice>,
        sb: Superblock,
        backings: Vec<Arc<dyn BlockDevice>>,
    ) -> Result<(Cache, OpenReport)> {
        let backings = backings.into_iter().map(VolumeBacking::Device).collect();
        Cache::open_volumes(dev, sb, backings)
    }

    /// [`Cache::open`] where some volumes may be offline: their backing devices could not be
    /// opened (missing, or not the recorded device). An offline volume keeps its cached and
    /// dirty data untouched (nothing is written back, its requests fail, its lines may be
    /// evicted only while clean) until a later open finds its device; the others serve.
    pub fn open_volumes(
        dev: Arc<dyn BlockDevice>,
        mut sb: Superblock,
        backings: Vec<VolumeBacking>,
    ) -> Result<(Cache, OpenReport)> {
        if backings.len() != sb.volumes.len() {
            return Err(format_err("one backing device per volume is needed"));
        }
        let admissions = volume_admissions(&sb)?;
        let layout = sb.layout;
        // Every write from here on is counted (the SSD's wear, kept in the superblock).
        let wear = Wear {
            before: sb.cache_bytes_written,
            counted: Arc::new(WriteCounted::new(dev)),
        };
        let dev: Arc<dyn BlockDevice> = wear.counted.clone();
        if has_dirty_modes(&sb) && layout.journal_blocks() < 2 * layout.compaction_blocks() + 1 {
            return Err(format_err(format!(
                "{}: this cache's journal ({} blocks) is too small for write-back (made by an \
                 early development build); re-create the cache with `ssdcache create --force`",
                dev.describe(),
                layout.journal_blocks()
            )));
        }
        let backings: Vec<Arc<Backing>> = backings
            .into_iter()
            .zip(&sb.volumes)
            .map(|(b, slot)| {
                Arc::new(match b {
                    VolumeBacking::Device(dev) => Backing::new(dev),
                    VolumeBacking::Offline { reason } => {
                        Backing::offline(slot.backing.size, reason)
                    }
                })
            })
            .collect();
        flush_before_reading(&*dev, &backings)?;
        let mut map = new_map(&sb)?;
        let (report, end) = match load_state(&*dev, &sb, &mut map) {
            Ok(loaded) => loaded,
            Err(e) if !matches!(e, EngineError::CacheDevice { .. }) && !has_dirty_modes(&sb) => {
                tracing::warn!("cache metadata unreadable, starting cold: {e}");
                map = new_map(&sb)?;
                (
                    cold(&format!("the cache metadata could not be read ({e})")),
                    start_position(&sb),
                )
            }
            Err(e) => return Err(e),
        };
        if sb.state == CacheState::Running {
            sb.unclean_starts += 1;
        }
        // A fresh generation past the live blocks: a crash before the superblock below lands
        // leaves the old journal (or checkpoint) intact and authoritative.
        // Every dirty slot's checksums are in RAM: replayed from the journal, or the pages of
        // the checkpoint holding dirty lines, kept at load (nothing has a budget yet).
        let records = map.take_all_dirty().map_err(metadata_inconsistent)?;
        let pos = commit::start_generation(&*dev, &layout, end, &records)?;
        map.commit_done(&records, true);
        sb.journal_generation = pos.generation;
        sb.journal_start_seq = pos.start_seq;
        sb.journal_start_block = pos.start_block;
        sb.state = CacheState::Running;
        sb.sequence += 1;
        sb.updated_unix = now_unix();
        sb.cache_bytes_written = wear.total();
        write_superblock(&*dev, &sb)?;
        // The superblock says running: checksum pages may be written from here on (a
        // checkpoint a clean superblock names is never overwritten).
        map.checksums_mut()
            .allow_writes(commit::new_generation_id(pos.generation));
        let frames = frames_for(
            &layout,
            checksums::default_checksum_memory(layout.line_count * layout.line_size),
        );
        map.checksums_mut().set_budget(frames);
        map.checksums_mut().shrink_to_budget();
        let slots = sb.volumes.clone();
        let core = Arc::new(CacheCore {
            dev,
            wear,
            layout,
            occupancy: map.occupancies(),
            map: MapLock::new(map),
            touches: TouchLog::new(),
            locks: LineLocks::new(),
            commits: Commits::new(pos, sb),
            backings: RwLock::new(backings.clone()),
            clock: Instant::now(),
            last_client_backing_io: AtomicU64::new(0),
            halted: AtomicBool::new(false),
            halt_reason: Mutex::new(String::new()),
        });
        let volumes = slots
            .iter()
            .zip(admissions)
            .zip(backings)
            .map(|((slot, admission), backing)| {
                Arc::new(Volume::new(slot, admission, backing, core.clone()))
            })
            .collect::<Vec<_>>();
        core.write_due_checksum_pages()?;
        Ok((
            Cache {
                core,
                volumes: RwLock::new(VolumeList(volumes.into())),
                retired_ids: AtomicU32::new(0),
                latencies_on: AtomicBool::new(false),
                recovery: report.recovery.clone(),
                cleaner: Default::default(),
            },
            report,
        ))
    }

    /// The volumes now (a snapshot: one added later is not in it).
    pub fn volumes(&self) -> VolumeList {
        self.volumes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn layout(&self) -> Layout {
        self.core.layout
    }

    pub(crate) fn core(&self) -> &Arc<CacheCore> {
        &self.core
    }

    /// The superblock with live counters, modes and dirty totals folded in.
    pub fn superblock(&self) -> Superblock {
        let mut sb = self.core.commits.superblock();
        self.fold_volumes(&mut sb);
        sb
    }

    fn fold_volumes(&self, sb: &mut Superblock) {
        let volumes = self.volumes();
        let map = self.core.map();
        for slot in sb.volumes.iter_mut() {
            // A slot being added has no volume yet: it keeps what it was given.
            let Some(vol) = volumes.iter().find(|v| v.id() == slot.id) else {
                continue;
            };
            slot.counters = vol.counters();
            slot.mode = vol.configured_mode();
            slot.admission = vol.admission().to_disk();
            slot.sequential_cutoff = vol.sequential_cutoff();
            let o = map.occupancy(slot.id);
            slot.dirty_lines = o.dirty_lines;
            slot.dirty_bytes = o.dirty_sectors * SECTOR_SIZE;
        }
    }

    /// What this open recovered from the journal after an unclean stop.
    pub fn recovery(&self) -> Option<&RecoveryReport> {
        self.recovery.as_ref()
    }

    /// Writes the superblock with the volumes' current configuration (modes), so a change
    /// survives a crash.
    pub fn persist_config(&self) -> Result<()> {
        self.core.check_running()?;
        let _no_commit = self.core.commits.exclusive();
        self.core.update_superblock(|sb| self.fold_volumes(sb))
    }

    /// Adds a volume to the open cache: `slot` (a free id, a name no volume has, the backing
    /// device's identity) backed by `backing`, which the caller opened and identified. It is
    /// appended to [`Cache::volumes`]; requests reach it only through the returned volume.
    ///
    /// The backing device is flushed first, outside the commit lock (a slow or hung new disk
    /// must not hold up every volume's FLUSH; review 39). Then under the commit lock (no
    /// commit, checkpoint or configuration write in between): the map must hold no line under
    /// the id (what a restart would load comes from this map: the journal generation started
    /// at open and every checkpoint since hold only its records), and the superblock naming
    /// the new volume is written. A crash before that write leaves the cache as it was, one
    /// after it a cache with the new, empty volume (docs/design.md §5.2).
    pub fn add_volume(
        &self,
        slot: VolumeSlot,
        backing: Arc<dyn BlockDevice>,
    ) -> Result<Arc<Volume>> {
        self.core.check_running()?;
        let refuse = |why: String| EngineError::AddRefused {
            name: slot.name.clone(),
            why,
        };
        let admission = Admission::from_disk(slot.admission).map_err(|e| refuse(e.to_string()))?;
        // The caller holds the device locked: nothing of ours writes to it before it is added.
        let device = backing.clone();
        let backing = Arc::new(Backing::new(backing));
        backing.flush_device()?;
        let _no_commit = self.core.commits.exclusive();
        self.refuse_new_slot(&self.core.commits.superblock(), &slot, &*device)
            .map_err(refuse)?;
        self.core.update_superblock(|sb| {
            sb.volumes.push(slot.clone());
            self.fold_volumes(sb);
        })?;
        // A slot id is never reused while the cache is open, but a cap is the volume's own.
        self.core.occupancy.set_cap(slot.id, None);
        let volume = Arc::new(Volume::new(
            &slot,
            admission,
            backing.clone(),
            self.core.clone(),
        ));
        volume.record_latencies(self.latencies_on.load(Ordering::Acquire));
        self.change_lists(|backings, volumes| {
            backings.push(backing);
            volumes.push(volume.clone());
        });
        tracing::info!("volume '{}' added (slot {})", slot.name, slot.id);
        Ok(volume)
    }

    /// Takes the volume at `index` out of the open cache: a removal while serving, once no
    /// request can reach it (its export removed and its connections ended) and its dirty data
    /// was written back ([`Cache::request_volume_drain`]); refused while it holds dirty data,
    /// and for the only volume. Drops every line of it under its line lock, flushes its
    /// backing device (what was written through is durable there before it leaves), commits,
    /// then, under the commit lock, writes the superblock without its slot; only then does it
    /// leave the lists (its device is closed when the last user lets it go). Its id is not
    /// given to a volume added later while this cache is open (docs/design.md §5.3).
    pub fn remove_volume(&self, index: usize) -> Result<()> {
        self.core.check_running()?;
        let v = self.volume_at(index)?;
        let refuse = |why: String| {
            EngineError::Format(format!("cannot remove volume '{}': {why}", v.name()))
        };
        if self.volumes().len() == 1 {
            return Err(refuse(
                "it is the cache's only volume (use `ssdcache detach`)".into(),
            ));
        }
        let dirty = v.stats().dirty_bytes;
        if dirty > 0 {
            return Err(refuse(format!(
                "it still holds {dirty} bytes of dirty data"
            )));
        }
        self.drop_all_lines_of(&v)?;
        v.backing().flush_checked()?;
        self.commit()?;
        let _no_commit = self.core.commits.exclusive();
        let held = self.core.occupancy.of(v.id()).lines;
        if held > 0 {
            return Err(self.core.halt(format!(
                "volume '{}' holds {held} lines again while it is removed (no request may reach it)",
                v.name()
            )));
        }
        self.core.update_superblock(|sb| {
            sb.volumes.retain(|slot| slot.id != v.id());
            self.fold_volumes(sb);
        })?;
        self.change_lists(|backings, volumes| {
            backings.retain(|b| !std::ptr::eq(&**b, v.backing()));
            volumes.retain(|o| !Arc::ptr_eq(o, &v));
        });
        self.lock_volume_sweeps().remove(&v.id());
        self.retired_ids.fetch_or(1 << v.id(), Ordering::AcqRel);
        self.core.occupancy.set_cap(v.id(), None);
        tracing::info!("volume '{}' removed (slot {} freed)", v.name(), v.id());
        Ok(())
    }

    /// Changes the list of backing devices commits flush and the volume list together (an
    /// added volume's device is in the first before the volume is in the second; a removed
    /// one leaves both). The volume list is replaced whole: readers keep their snapshot.
    fn change_lists(&self, change: impl FnOnce(&mut Vec<Arc<Backing>>, &mut Vec<Arc<Volume>>)) {
        let mut backings = self
            .core
            .backings
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let mut list = self.volumes.write().unwrap_or_else(|p| p.into_inner());
        let mut volumes = list.to_vec();
        change(&mut backings, &mut volumes);
        *list = VolumeList(volumes.into());
    }

    /// Slot ids of volumes removed while this cache is open: not given to a new volume until
    /// the next open (bit `id`).
    pub fn retired_volume_ids(&self) -> u32 {
        self.retired_ids.load(Ordering::Acquire)
    }

    /// Why `slot` cannot join the volumes of `sb` (the superblock as last written), if it
    /// cannot.
    fn refuse_new_slot(
        &self,
        sb: &Superblock,
        slot: &VolumeSlot,
        backing: &dyn BlockDevice,
    ) -> std::result::Result<(), String> {
        use ssdcache_format::superblock::MAX_VOLUMES;
        if sb.volumes.len() >= MAX_VOLUMES || usize::from(slot.id) >= MAX_VOLUMES {
            return Err(format!(
                "the cache has {} volumes; its format holds {MAX_VOLUMES}",
                sb.volumes.len()
            ));
        }
        if let Some(other) = sb.volumes.iter().find(|v| v.id == slot.id) {
            return Err(format!("slot {} is volume '{}'s", slot.id, other.name));
        }
        if self.retired_volume_ids() & (1 << slot.id) != 0 {
            return Err(format!(
                "slot {} was freed by a removal while this cache is open; use another (a \
                 later start may reuse it)",
                slot.id
            ));
        }
        if sb.volumes.iter().any(|v| v.name == slot.name) {
            return Err("the cache already has a volume of that name".into());
        }
        let policy = sb.volumes.first().map(|v| v.policy);
        if policy.is_some_and(|p| p != slot.policy) {
            return Err("its replacement policy differs from the cache's".into());
        }
        if backing.size() != slot.backing.size {
            return Err(format!(
                "its backing device has {} bytes, its slot records {}",
                backing.size(),
                slot.backing.size
            ));
        }
        if slot.mode == CacheMode::WriteBack
            && self.core.layout.journal_blocks() < 2 * self.core.layout.compaction_blocks() + 1
        {
            return Err("this cache's journal is too small for write-back".into());
        }
        let lines = self.core.map_read().occupancy(slot.id).lines;
        if lines > 0 {
            return Err(format!(
                "the cache still holds {lines} lines under slot {}",
                slot.id
            ));
        }
        Ok(())
    }

    /// Makes every completed write of every volume durable.
    pub fn commit(&self) -> Result<()> {
        self.core.commit(CommitPurpose::Durability)
    }

    /// Commits the journal as the cleaner's periodic commit does: it runs after a failed commit
    /// too, because it promises nothing about the durability of writes (`commit` does).
    pub fn commit_in_background(&self) -> Result<()> {
        self.core.commit(CommitPurpose::Writeback)
    }

    /// Why the engine stopped itself, if a check that guards user data failed: the daemon
    /// should then stop without a checkpoint (the journal is replayed at the next start).
    pub fn halted(&self) -> Option<String> {
        self.core.halted()
    }

    /// Dirty lines in the whole cache.
    pub fn dirty_lines(&self) -> u64 {
        self.core.map_read().total_dirty_lines()
    }

    /// Lines holding data of any volume, as the map counts them (the per-volume figures of
    /// [`Volume::stats`] are kept apart and must add up to it). Takes the map's read lock.
    pub fn used_lines(&self) -> u64 {
        self.core.map_read().used_lines() as u64
    }

    /// Sets the share of the cache's lines that may be dirty (0 to 1; default
    /// [`crate::DEFAULT_DIRTY_LIMIT`]): past it, write-back writes to lines without dirty data go to
    /// the backing device, overwrites of dirty lines are still absorbed. Values outside 0..=1
    /// are clamped.
    ///
    /// Dirty lines of offline volumes (which stay until their devices are back) are added to
    /// the limit, and the share applies to the other lines: otherwise a missing disk's dirty
    /// data could push every other volume's writes to its hard drive.
    pub fn set_dirty_limit(&self, share: f64) {
        let line_count = u32::try_from(self.layout().line_count).unwrap_or(u32::MAX);
        let offline_dirty: u64 = self
            .volumes()
            .iter()
            .filter(|v| v.offline_reason().is_some())
            .map(|v| v.stats().dirty_lines)
            .sum();
        let stuck = u32::try_from(offline_dirty)
            .unwrap_or(u32::MAX)
            .min(line_count);
        let lines = stuck + dirty_limit_lines(line_count - stuck, share.clamp(0.0, 1.0));
        self.core.map().set_dirty_limit(lines);
    }

    /// The most dirty lines (see `set_dirty_limit`).
    /// Bytes written to the cache device in all (across restarts, as the superblock kept
    /// them) and since this start.
    pub fn cache_bytes_written(&self) -> (u64, u64) {
        (self.core.wear.total(), self.core.wear.since_start())
    }

    /// The cache device's endurance rating (TBW) in bytes, 0 if never given.
    pub fn ssd_tbw_bytes(&self) -> u64 {
        self.core.commits.superblock().ssd_tbw_bytes
    }

    /// Records the cache device's endurance rating (`serve --ssd-tbw`) in the superblock.
    pub fn set_ssd_tbw_bytes(&self, bytes: u64) -> Result<()> {
        if self.ssd_tbw_bytes() == bytes {
            return Ok(());
        }
        let _no_commit = self.core.commits.exclusive();
        self.core.update_superblock(|sb| sb.ssd_tbw_bytes = bytes)
    }

    /// Turns the request latency histograms on or off (`serve --metrics` turns them on; off,
    /// a request pays one relaxed load for them).
    pub fn record_latencies(&self, on: bool) {
        self.latencies_on.store(on, Ordering::Release);
        for v in self.volumes().iter() {
            v.record_latencies(on);
        }
    }

    /// The metadata commits since the start.
    pub fn commit_stats(&self) -> crate::commit::CommitStats {
        self.core.commits.stats()
    }

    pub fn dirty_limit_lines(&self) -> u64 {
        u64::from(self.core.map().dirty_limit())
    }

    /// Sets the RAM kept for data checksums (default
    /// [`crate::checksums::default_checksum_memory`]): the metadata pages of that many bytes
    /// of checksums stay in RAM, the rest are read from the cache device when needed
    /// (docs/design.md §3, "Checksums out of RAM"). `u64::MAX` keeps every page once read.
    /// Pages past a smaller budget are written and dropped now.
    pub fn set_checksum_memory(&self, bytes: u64) -> Result<()> {
        let frames = frames_for(&self.layout(), bytes);
        {
            let mut map = self.core.map();
            map.checksums_mut().set_budget(frames);
            map.checksums_mut().shrink_to_budget();
        }
        self.core.write_due_checksum_pages()
    }

    /// What the checksum pages hold in RAM, and the pages read and written since open.
    pub fn checksum_usage(&self) -> ChecksumUsage {
        self.core.map_read().checksums().usage()
    }

    /// Writes the checkpoint of every line (dirty ones included) and marks the cache cleanly
    /// stopped. Call after the last request finished and the cleaner stopped.
    pub fn shutdown(&self) -> Result<()> {
        self.close(false)
    }

    /// Like `shutdown`, but the cache is left empty (the next start is cold): for detach,
    /// after everything was written back. Refuses while dirty data remains.
    pub fn shutdown_discarding(&self) -> Result<()> {
        if self.dirty_lines() > 0 {
            return Err(format_err(format!(
                "{} dirty lines are still in the cache; write them back first (ssdcache flush)",
                self.dirty_lines()
            )));
        }
        self.close(true)
    }

    fn close(&self, discard: bool) -> Result<()> {
        // A halted engine leaves the cache marked running: the journal, not a checkpoint of a
        // state that failed a check, is what the next start trusts.
        self.core.check_running()?;
        let _no_commit = self.core.commits.exclusive();
        // The superblock written below takes this sequence number.
        let checkpoint = self.core.commits.superblock().sequence + 1;
        if !discard {
            self.core.flush_backings()?;
            write_checkpoint(&self.core, checkpoint)?;
        }
        self.core.update_superblock(|sb| {
            self.fold_volumes(sb);
            sb.state = CacheState::Clean;
            sb.checkpoint_seq = if discard { 0 } else { checkpoint };
        })?;
        // The checkpoint is authoritative now: no page of this run may overwrite it.
        self.core.map().checksums_mut().forbid_writes();
        Ok(())
    }
}

/// Each volume's admission policy, refusing a code this version does not know (before the
/// cache is touched: a newer ssdcache's setting must not be silently replaced).
fn volume_admissions(sb: &Superblock) -> Result<Vec<Admission>> {
    sb.volumes
        .iter()
        .map(|v| {
            Admission::from_disk(v.admission).map_err(|e| {
                format_err(format!(
                    "volume '{}': {e}; set a known one with `admission = \"always\"` or \
                     `\"2-hit\"` under [volume.{}] in serve's config file, or re-create the cache",
                    v.name, v.name
                ))
            })
        })
        .collect()
}

fn has_dirty_modes(sb: &Superblock) -> bool {
    sb.volumes.iter().any(|v| v.mode == CacheMode::WriteBack)
}

fn cold(reason: &str) -> OpenReport {
    OpenReport {
        cold_reason: Some(reason.to_owned()),
        ..OpenReport::default()
    }
}

/// Writes every slot's record in pages stamped with `seq`, then flushes the cache device. The
/// superblock that names `seq` is written only after this returns.
///
/// Records are taken a batch of pages at a time, each batch's checksums read into RAM first
/// (pages not in RAM are read from the device: the checksums of most lines live there while
/// running, docs/design.md §3).
fn write_checkpoint(core: &CacheCore, seq: u64) -> Result<()> {
    let layout = core.layout;
    let per_page = MetaPage::records_per_page(layout.line_size) as u32;
    let slots = layout.line_count as u32;
    let batch_slots = per_page * META_BATCH_PAGES as u32;
    let mut batch = AlignedBuf::zeroed(META_BATCH_PAGES * SECTOR_SIZE as usize);
    let mut first = 0u32;
    while first < slots {
        let range = first..(first + batch_slots).min(slots);
        let records = {
            let _held = core.hold_checksum_pages();
            core.write_map_paged(|map| {
                let used: Vec<u32> = range
                    .clone()
                    .filter(|&s| map.key_of(s) != crate::residency::NO_KEY)
                    .collect();
                map.need_checksums(used)?;
                Ok(map.records(range.clone()))
            })?
        };
        let pages = records.len().div_ceil(per_page as usize);
        for (i, page_records) in records.chunks(per_page as usize).enumerate() {
            let first_slot = u64::from(first) + (i as u64) * u64::from(per_page);
            let page = &mut batch[i * SECTOR_SIZE as usize..(i + 1) * SECTOR_SIZE as usize];
            MetaPage::encode(seq, first_slot, layout.line_size, page_records, page);
        }
        let offset = layout.meta_offset + u64::from(first / per_page) * SECTOR_SIZE;
        let written = core
            .dev
            .write_at(&batch[..pages * SECTOR_SIZE as usize], offset);
        // From here these pages hold this checkpoint's stamp (or, after a failed write, an
        // unknown mix): a clean stop that fails later leaves a running engine that must read
        // them as such.
        let first_page = first / per_page;
        core.map()
            .checksums_mut()
            .checkpoint_written(first_page..first_page + pages as u32, seq);
        written.map_err(|e| core.cache_err(e))?;
        first = range.end;
    }
    core.dev.flush().map_err(|e| core.cache_err(e))
}

/// Frames of checksum pages that `bytes` of RAM hold.
fn frames_for(layout: &Layout, bytes: u64) -> usize {
    usize::try_from(bytes / ChecksumPages::frame_bytes(layout.line_size) as u64)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// Loads the checkpoint stamped `seq` into `map`, keeping only records of known volumes that
/// lie inside their volume.
fn load_checkpoint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    seq: u64,
    map: &mut MapState,
) -> Result<OpenReport> {
    let layout = sb.layout;
    let per_page = MetaPage::records_per_page(layout.line_size);
    let pages = layout.meta_pages();
    let mut batch = AlignedBuf::zeroed(META_BATCH_PAGES * SECTOR_SIZE as usize);
    let mut page_no = 0u64;
    // The pages hold every line's checksums; those of pages with dirty lines stay in RAM
    // until open has taken every dirty record, the rest are read again when needed.
    map.checksums_mut().opened_from_checkpoint(seq);
    let spl = LineRecord::sectors(layout.line_size);
    let mut crcs = vec![0u32; per_page as usize * spl];
    while page_no < pages {
        let n = (pages - page_no).min(META_BATCH_PAGES as u64) as usize;
        let buf = &mut batch[..n * SECTOR_SIZE as usize];
        dev.read_at(buf, layout.meta_offset + page_no * SECTOR_SIZE)
            .map_err(|e| EngineError::CacheDevice {
                device: dev.describe(),
                source: e,
            })?;
        for (i, page) in buf.chunks(SECTOR_SIZE as usize).enumerate() {
            let first = (page_no + i as u64) * per_page;
            let records = MetaPage::decode(page, seq, first, layout.line_size)
                .map_err(|e| format_err(format!("metadata page {}: {e}", page_no + i as u64)))?;
            let holds_dirty = records.iter().enumerate().any(|(j, rec)| {
                first + (j as u64) < layout.line_count
                    && record_fits(sb, rec)
                    && !rec.dirty.is_empty()
            });
            if holds_dirty {
                crcs.fill(0);
                for (j, rec) in records.iter().enumerate() {
                    for s in 0..spl {
                        crcs[j * spl + s] = rec.crc(s);
                    }
                }
                map.install_loaded_checksums((page_no + i as u64) as u32, &crcs);
            }
            for (j, rec) in records.iter().enumerate() {
                let slot = first + j as u64;
                if slot < layout.line_count && record_fits(sb, rec) {
                    map.restore(slot as u32, rec, false, RestoreChecksums::InPage)
                        .map_err(metadata_inconsistent)?;
                }
            }
        }
        page_no += n as u64;
    }
    map.rebuild_free_list();
    let restored_lines = map.used_lines() as u64;
    let restored_bytes = sb
        .volumes
        .iter()
        .map(|v| map.occupancy(v.id).sectors * SECTOR_SIZE)
        .sum();
    Ok(OpenReport {
        warm: restored_lines > 0,
        restored_lines,
        restored_bytes,
        ..OpenReport::default()
    })
}

fn record_fits(sb: &Superblock, rec: &LineRecord) -> bool {
    !rec.is_free()
        && sb.volumes.iter().any(|v| {
            v.id == rec.volume
                && rec
                    .backing_line
                    .checked_mul(sb.layout.line_size)
                    .is_some_and(|o| o < v.backing.size)
        })
}

/// Statistics of a cache that no daemon has open, from its superblock and its checkpoint
/// (after a clean stop) or journal (after an unclean one, when only dirty lines count).
pub fn offline_stats(dev: &dyn BlockDevice, sb: &Superblock) -> Result<Vec<crate::VolumeStats>> {
    let mut map = new_map(sb)?;
    load_state(dev, sb, &mut map)?;
    Ok(sb
        .volumes
        .iter()
        .map(|v| {
            let o = map.occupancy(v.id);
            crate::VolumeStats {
                name: v.name.clone(),
                mode: v.mode,
                configured_mode: v.mode,
                size: v.backing.size,
                counters: v.counters,
                lines_used: o.lines,
                bytes_cached: o.sectors * SECTOR_SIZE,
                dirty_lines: o.dirty_lines,
                dirty_bytes: o.dirty_sectors * SECTOR_SIZE,
                state: crate::VolumeState::Healthy,
                dirty_cap_lines: None,
                occupancy_cap_lines: None,
            }
        })
        .collect())
}

/// Flushes every device before the cache reads anything. A run that ended without a clean stop
/// (`kill -9`) may have left writes in the devices' volatile caches: the journal blocks of a
/// commit in progress, data written through or around the cache. Served or replayed unflushed,
/// they could be lost at the next power cut after clients saw them: a sector would read one
/// value after this start and an older one after the cut.
/// (An offline volume's stand-in has nothing to flush.)
fn flush_before_reading(dev: &dyn BlockDevice, backings: &[Arc<Backing>]) -> Result<()> {
    dev.flush().map_err(|source| EngineError::CacheDevice {
        device: dev.describe(),
        source,
    })?;
    for backing in backings {
        backing.flush_device()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::superblock::read_superblock;
    use ssdcache_devsim::MemDevice;
    use ssdcache_format::{BackingIdentity, BackingKind, CacheMode};

    fn write_back_cache() -> (Arc<MemDevice>, Cache) {
        let dev = Arc::new(MemDevice::new("cache", 16 << 20));
        let backing = Arc::new(MemDevice::new("backing", 32 << 20));
        let identity = BackingIdentity {
            kind: BackingKind::File,
            size: 32 << 20,
            path: "mem".into(),
            stable_id: "mem".into(),
            st_dev: 0,
            st_ino: 0,
            st_rdev: 0,
            btime_ns: 0,
        };
        let volume = NewVolume {
            name: "v".into(),
            mode: CacheMode::WriteBack,
            backing: identity,
            sequential_cutoff: 0,
            policy: 0,
            admission: Admission::Always,
        };
        let sb = format(&*dev, 64 << 10, volume).unwrap();
        let (cache, _) = Cache::open(dev.clone(), sb, vec![backing]).unwrap();
        (dev, cache)
    }

    /// A broken slot-reuse invariant stops the engine: the write that found it fails, every
    /// later request and the checkpoint are refused, and the cache stays marked running so the
    /// next start replays the journal (which still has the data flushed before).
    #[test]
    fn a_broken_invariant_halts_the_engine_and_leaves_the_journal_authoritative() {
        let (dev, cache) = write_back_cache();
        let vol = cache.volumes()[0].clone();
        vol.write(0, &[7u8; 4096], true).unwrap();
        cache.core.map().break_free_list_for_test();
        let err = vol.write(1 << 20, &[8u8; 4096], false).unwrap_err();
        assert!(matches!(err, EngineError::Halted(_)), "{err}");
        assert!(cache.halted().is_some());
        let mut buf = [0u8; 4096];
        assert!(matches!(vol.read(0, &mut buf), Err(EngineError::Halted(_))));
        assert!(matches!(vol.flush(), Err(EngineError::Halted(_))));
        assert!(matches!(cache.commit(), Err(EngineError::Halted(_))));
        assert!(
            cache.shutdown().is_err(),
            "no checkpoint of a state that failed a check"
        );
        let sb = read_superblock(&*dev).unwrap();
        assert_eq!(sb.state, CacheState::Running);
    }
}
