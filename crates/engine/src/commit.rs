//! The commit protocol, in one place: what makes completed writes durable (docs/design.md §4.3).
//!
//! Two pieces of state decide it, and both live here:
//! - [`Backing`]: a backing device with two counters, the writes that have returned and the
//!   writes its last successful flush covered. A flush is due exactly when the first is ahead
//!   of the second, and a flush covers the writes counted before it started, so a FLUSH (or a
//!   commit) covers every backing write that completed before it, on every connection, however
//!   many flushes run at once. (A single "needs a flush" flag cannot say that: a flush clearing
//!   it while another write is still in flight forgets that write.)
//! - [`Journal`]: where the next commit goes, in which generation, and whether the blocks after
//!   the live log may hold part of a commit that failed. After any failed commit the next one
//!   starts a fresh generation (a compaction), so replay can never run from a later commit into
//!   the failed one's leftover blocks.

use std::io;
use std::sync::Arc;

use ssdcache_device::BlockDevice;
use ssdcache_format::{Layout, LineRecord, Superblock};

use crate::backing_order::{BackingOrder, PendingFill, WriteInFlight};
use crate::cache::{now_unix, CacheCore};
use crate::error::{EngineError, Result};
use crate::journal::{self, JournalPosition};
use crate::superblock::write_superblock;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{Condvar, Mutex, MutexGuard};

/// A backing device whose writes are counted against its flushes.
pub(crate) struct Backing {
    dev: Arc<dyn BlockDevice>,
    /// Writes (also TRIM, WRITE_ZEROES, and failed ones, which may have landed in part) that
    /// have returned; not those that never reached the device (`ssdcache_device::unreached`).
    completed: AtomicU64,
    /// The value of `completed` after the last client write (not the cleaner's writebacks)
    /// returned: what a commit and a client's FLUSH need durable. The cleaner marks nothing
    /// clean before its own flush covered its writes, so no record depends on them.
    client_completed: AtomicU64,
    /// The value of `completed` read just before the last successful flush began: every write
    /// counted up to there is durable.
    flushed: AtomicU64,
    /// A flush failed: the device may have dropped writes it covered, and no later flush can
    /// bring them back, so every later flush fails too (a failed flush is never retried and
    /// forgotten) until the daemon restarts.
    flush_failed: AtomicBool,
    /// Which writes run on the device now and which write-through fills wait (the order of
    /// writes that run without their lines: `backing_order.rs`).
    order: BackingOrder,
    /// Why the volume is offline (its device could not be opened at start), or `None`.
    offline: Option<String>,
}

impl Backing {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Backing {
        Backing {
            dev,
            // Nothing unflushed yet: `Cache::open` flushed the device before reading it.
            completed: AtomicU64::new(0),
            client_completed: AtomicU64::new(0),
            flushed: AtomicU64::new(0),
            flush_failed: AtomicBool::new(false),
            order: BackingOrder::new(),
            offline: None,
        }
    }

    /// The backing of a volume whose device could not be opened: every read and write fails
    /// (no request or write-back is meant to reach it: `Volume::check`, the cleaner's plans),
    /// and a flush has nothing to cover, so commits of the other volumes go on.
    pub fn offline(size: u64, reason: String) -> Backing {
        let mut backing = Backing::new(Arc::new(OfflineDevice {
            size,
            reason: reason.clone(),
        }));
        backing.offline = Some(reason);
        backing
    }

    /// Why the volume is offline, if it is.
    pub fn offline_reason(&self) -> Option<&str> {
        self.offline.as_deref()
    }

    /// Marks `[offset, offset + len)` as being written back by the cleaner until the returned
    /// guard is dropped. The cleaner takes it while it still holds the range's lines, having
    /// read and checked the dirty data, then releases the lines and writes. An overlapping
    /// write still in flight (another batch: a drain beside the cleaner thread; a client's
    /// write-through write) is waited for first: its data is older than what this one read
    /// (it was read before the lines were released to the writes this one carries), so it must
    /// land first (review11 R11-1). It holds no lock, so the wait ends when its device write
    /// returns.
    pub fn begin_writeback(&self, offset: u64, len: u64) -> WriteInFlight<'_> {
        self.order.begin_write(offset, len)
    }

    /// A client write to the device: waits for overlapping writes in flight (the cleaner's
    /// older data, or an earlier client write that released its lines) and supersedes pending
    /// write-through fills of the range (`backing_order.rs`).
    pub fn begin_client_write(&self, offset: u64, len: u64) -> WriteInFlight<'_> {
        self.order.begin_write(offset, len)
    }

    /// A client write-through write that releases its lines during the disk write and fills
    /// the cache afterwards if no overlapping write began meanwhile.
    pub fn begin_write_through(
        &self,
        offset: u64,
        len: u64,
    ) -> (WriteInFlight<'_>, PendingFill<'_>) {
        self.order.begin_write_then_fill(offset, len)
    }

    /// A client read miss that reads the device without its line and uses what it read only
    /// if no write of `[offset, offset + len)` began meanwhile (`backing_order.rs`, rule 3);
    /// `caches_line`: it will cache the line, so a second miss of it waits for this one.
    pub fn begin_read_then_fill(
        &self,
        offset: u64,
        len: u64,
        caches_line: bool,
    ) -> PendingFill<'_> {
        self.order.begin_read_then_fill(offset, len, caches_line)
    }

    /// Whether a read miss that will cache `[offset, offset + len)` is reading the device
    /// without its line.
    pub fn read_in_flight(&self, offset: u64, len: u64) -> bool {
        self.order.read_in_flight(offset, len)
    }

    /// Waits until every read miss of `[offset, offset + len)` reading the device without its
    /// line has used what it read; the caller holds no line.
    pub fn wait_for_reads(&self, offset: u64, len: u64) {
        self.order.wait_for_reads(offset, len);
    }

    /// Waits until no write in flight overlaps `[offset, offset + len)`: a client read of the
    /// device must not read, and cache, a half-written range.
    pub fn wait_for_writes(&self, offset: u64, len: u64) {
        self.order.wait_for_writes(offset, len);
    }

    /// Whether a write overlapping `[offset, offset + len)` is in flight now. Every write of
    /// the device begins with the lines of its range held, so a caller holding the lines of
    /// the range knows none can begin until it releases them.
    pub fn write_in_flight(&self, offset: u64, len: u64) -> bool {
        self.order.write_in_flight(offset, len)
    }

    pub fn describe(&self) -> String {
        self.dev.describe()
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.dev.read_at(buf, offset)
    }

    pub fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> io::Result<Vec<ssdcache_device::Run>> {
        self.dev.allocation(offset, len, max_runs)
    }

    /// Runs a write-like operation and counts it once it returned, whatever the outcome: from
    /// then on the next flush covers it. Callers change the cache map only after this returns,
    /// so any commit that records the change also sees the count.
    pub fn write_with<T>(
        &self,
        op: impl FnOnce(&dyn BlockDevice) -> io::Result<T>,
    ) -> io::Result<T> {
        let result = self.write_counted(op);
        self.client_completed
            .fetch_max(self.completed.load(Ordering::SeqCst), Ordering::SeqCst);
        result
    }

    /// Counts the write as [`Backing::write_with`] does, unless it never reached the device.
    fn write_counted<T>(
        &self,
        op: impl FnOnce(&dyn BlockDevice) -> io::Result<T>,
    ) -> io::Result<T> {
        let result = op(&*self.dev);
        if !matches!(&result, Err(e) if ssdcache_device::is_unreached(e)) {
            self.completed.fetch_add(1, Ordering::SeqCst);
        }
        result
    }

    /// A client's write (write-through, write-around, a bypass): commits and FLUSHes cover it.
    pub fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_with(|dev| dev.write_at(data, offset))
    }

    /// The cleaner's writeback: covered by its own flush ([`Backing::flush`]) before anything
    /// is marked clean, not needed by commits or a client's FLUSH.
    pub fn write_back_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_counted(|dev| dev.write_at(data, offset))
    }

    /// A write that is durable when it returns: one FUA write where the device has them
    /// ([`BlockDevice::write_fua`]), else a write and a [`Backing::flush`] (whose failure is
    /// remembered as any flush's is).
    pub fn write_durable(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let fua = self.write_with(|dev| Ok(dev.write_fua(data, offset)))?;
        match fua {
            Some(result) => result,
            None => {
                self.write_at(data, offset)?;
                self.flush()
            }
        }
    }

    /// Why the device cannot be reached now, if it cannot ([`BlockDevice::reachable`]).
    pub fn reachable(&self) -> std::result::Result<(), String> {
        self.dev.reachable()
    }

    /// [`Backing::flush`] with the engine's error naming the device.
    pub fn flush_checked(&self) -> Result<()> {
        self.flush().map_err(|source| EngineError::Backing {
            device: self.describe(),
            source,
        })
    }

    /// Flushes the device itself whatever was counted: at open, for writes of an earlier run
    /// that may still sit in its volatile cache.
    pub fn flush_device(&self) -> Result<()> {
        self.dev.flush().map_err(|source| EngineError::Backing {
            device: self.describe(),
            source,
        })
    }

    /// Makes every client write that returned before this call durable (what a commit and a
    /// client's FLUSH need; [`Backing::flush`] covers the cleaner's too). No device flush when
    /// none returned since the last flush, so an unreachable device whose only unflushed
    /// writes are the cleaner's holds up no commit.
    pub fn flush_client_writes(&self) -> io::Result<()> {
        if self.flush_failed() {
            return self.flush();
        }
        let target = self.client_completed.load(Ordering::SeqCst);
        if self.flushed.load(Ordering::SeqCst) >= target {
            return Ok(());
        }
        self.flush()
    }

    /// [`Backing::flush_client_writes`] with the engine's error naming the device.
    pub fn flush_client_writes_checked(&self) -> Result<()> {
        self.flush_client_writes()
            .map_err(|source| EngineError::Backing {
                device: self.describe(),
                source,
            })
    }

    /// Makes every write that returned before this call durable; no device flush when none
    /// returned since the last flush that covered them.
    pub fn flush(&self) -> io::Result<()> {
        if self.flush_failed() {
            return Err(io::Error::other(
                "an earlier flush of this device failed, so writes it covered may be lost and \
                 no later flush can vouch for them; check the device, then restart the daemon",
            ));
        }
        let target = self.completed.load(Ordering::SeqCst);
        if self.flushed.load(Ordering::SeqCst) >= target {
            return Ok(());
        }
        if let Err(e) = self.dev.flush() {
            if ssdcache_device::is_unreached(&e) {
                // Not reached (a network device reconnecting): nothing it covers is lost
                // (`BlockDevice::flush`), so a later flush may still vouch for the writes.
                // Only a device that can promise it says so: a network filesystem's ENOTCONN
                // from fdatasync is a lost write like any other (review 48).
                return Err(e);
            }
            self.flush_failed.store(true, Ordering::SeqCst);
            tracing::error!(
                "{}: flush failed ({e}); every later FLUSH of its volume fails until the daemon \
                 restarts",
                self.dev.describe()
            );
            return Err(e);
        }
        self.flushed.fetch_max(target, Ordering::SeqCst);
        Ok(())
    }

    pub fn flush_failed(&self) -> bool {
        self.flush_failed.load(Ordering::SeqCst)
    }

    /// Whether a flush now would reach the device (a write returned since the last flush).
    pub fn has_unflushed_writes(&self) -> bool {
        self.flushed.load(Ordering::SeqCst) < self.completed.load(Ordering::SeqCst)
    }
}

/// Stands in for the backing device of an offline volume. Nothing reaches a device that is
/// not there: reads and writes fail, naming why it is offline, and a flush succeeds (no
/// write of this run can have landed anywhere).
struct OfflineDevice {
    size: u64,
    reason: String,
}

impl OfflineDevice {
    fn refuse(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::NotConnected,
            format!("the volume is offline: {}", self.reason),
        )
    }
}

impl BlockDevice for OfflineDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<()> {
        Err(self.refuse())
    }
    fn write_at(&self, _: &[u8], _: u64) -> io::Result<()> {
        Err(self.refuse())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn discard(&self, _: u64, _: u64) -> io::Result<bool> {
        Err(self.refuse())
    }
    fn write_zeroes(&self, _: u64, _: u64) -> io::Result<()> {
        Err(self.refuse())
    }
    fn describe(&self) -> String {
        format!("(offline: {})", self.reason)
    }
}

/// Commits asked of the background committer. A client write whose changes fill a batch
/// (`Volume`'s `COMMIT_BATCH`) asks for a commit and returns: it never runs one itself while a
/// committer runs, so no client write waits for a commit's device flushes (least of all
/// holding its lines). The committer also commits every second while changes wait, bounding
/// what a crash can lose when clients never flush.
pub(crate) struct CommitRequests {
    asked: Mutex<Asked>,
    wake: Condvar,
    /// A committer thread is running; without one (tests, offline tools) writers commit
    /// themselves, after releasing their lines.
    running: AtomicBool,
    stop: AtomicBool,
}

/// What writers asked the committer for since it last looked.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Asked {
    /// A commit: a batch of changes is full.
    pub commit: bool,
    /// Writes of modified checksum pages: the frames are over their budget (`checksums.rs`).
    pub pages: bool,
}

impl CommitRequests {
    pub fn new() -> CommitRequests {
        CommitRequests {
            asked: Mutex::new(Asked::default()),
            wake: Condvar::new(),
            running: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        }
    }

    /// Asks the committer for a commit; false when none runs (the caller commits itself).
    pub fn ask(&self) -> bool {
        self.ask_for(|a| a.commit = true)
    }

    /// Asks the committer to write modified checksum pages; false when none runs (the caller
    /// writes them itself).
    pub fn ask_for_page_writes(&self) -> bool {
        self.ask_for(|a| a.pages = true)
    }

    fn ask_for(&self, what: impl FnOnce(&mut Asked)) -> bool {
        if !self.running.load(Ordering::Acquire) {
            return false;
        }
        what(&mut self.asked.lock().unwrap_or_else(|p| p.into_inner()));
        self.wake.notify_one();
        true
    }

    /// The committer's wait: until asked, stopped or `most` passed. Returns what it was asked.
    pub fn wait(&self, most: std::time::Duration) -> Asked {
        let asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        let (mut asked, _) = self
            .wake
            .wait_timeout_while(asked, most, |asked| {
                !asked.commit && !asked.pages && !self.stop.load(Ordering::Acquire)
            })
            .unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *asked)
    }

    /// Marks a committer as running (`true`) or asks it to stop and marks it gone (`false`).
    pub fn set_running(&self, on: bool) {
        self.stop.store(!on, Ordering::Release);
        self.running.store(on, Ordering::Release);
        if !on {
            let _asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.notify_all();
        }
    }

    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// The journal's write position, held for a whole commit so commits run one at a time.
pub(crate) struct JournalState {
    pub pos: JournalPosition,
    /// The blocks just past the live log may hold part of a commit that failed (its write or
    /// its flush returned an error, so some or all of its blocks may have landed, with the
    /// sequence numbers the next commit would use). The next commit must start a fresh
    /// generation so those blocks can never be read as part of the log.
    fresh_generation_due: bool,
    /// A fresh generation whose blocks are written and flushed but whose superblock write
    /// failed part way: a superblock copy on the device may name it, or the old log. Until a
    /// superblock write lands, both must stay intact, so the next commit first writes the
    /// superblock naming it again (its blocks are whole) before anything else touches the
    /// journal.
    unconfirmed: Option<JournalPosition>,
}

/// The metadata journal's commit state.
pub(crate) struct Journal {
    state: Mutex<JournalState>,
    /// A commit failed on the cache device: the data that dirty records name may not be
    /// durable (a failed flush is never retried and forgotten). FLUSH keeps failing while the
    /// cache holds dirty data; see `Volume::commit`.
    failed: AtomicBool,
}

/// Why a commit runs, which decides whether an earlier failure refuses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitPurpose {
    /// A client's FLUSH or FUA, or anyone promising that completed writes are durable: refused
    /// while an earlier failed commit leaves dirty data of unknown durability.
    Durability,
    /// The cleaner recording what it wrote back (or its periodic commit): it promises nothing
    /// about other data, so it runs after a failure too (it is how dirty data drains).
    Writeback,
}

/// How a commit writes its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitKind {
    /// The changed records, appended to the live log.
    Append,
    /// Every dirty record, as the first commit of a new generation that the superblock then
    /// names: complete by itself (replay of it starts from nothing).
    FreshGeneration,
}

impl Journal {
    pub fn new(pos: JournalPosition) -> Journal {
        Journal {
            state: Mutex::new(JournalState {
                pos,
                fresh_generation_due: false,
                unconfirmed: None,
            }),
            failed: AtomicBool::new(false),
        }
    }

    /// Holds the journal: no commit runs until the guard drops (superblock writers take it so
    /// they never race a compaction's superblock).
    pub fn lock(&self) -> MutexGuard<'_, JournalState> {
        // Every change to the state is a plain assignment after its I/O succeeded.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn clear_failed(&self) {
        self.failed.store(false, Ordering::Release);
    }

    pub fn note_failure(&self, state: &mut JournalState, error: &EngineError) {
        state.fresh_generation_due = true;
        if matches!(error, EngineError::CacheDevice { .. }) {
            self.failed.store(true, Ordering::Release);
        }
    }
}

impl JournalState {
    /// Which kind the next commit of `changed` records must be.
    pub fn kind_for(&self, changed: usize, layout: &Layout) -> CommitKind {
        let need = journal::blocks_for(changed, layout);
        if self.fresh_generation_due || !self.pos.has_room(need, layout) {
            CommitKind::FreshGeneration
        } else {
            CommitKind::Append
        }
    }

    /// Appends `records` as one commit (steps 4 and 5 of the protocol; the caller did steps
    /// 2 and 3). Checks, also in release builds, that the commit leaves room for a compaction.
    pub fn append(
        &mut self,
        dev: &dyn BlockDevice,
        layout: &Layout,
        records: &[(u32, LineRecord)],
    ) -> Result<()> {
        let blocks = journal::blocks_for(records.len(), layout);
        if !self.pos.has_room(blocks, layout) {
            return Err(EngineError::Invariant(format!(
                "a journal commit of {blocks} blocks would leave no room for a compaction \
                 ({} live of {} blocks)",
                self.pos.live_blocks(),
                layout.journal_blocks()
            )));
        }
        let mut next = self.pos;
        if journal::write_commit(dev, layout, &mut next, records, false)? > 0 {
            flush_cache(dev)?;
        }
        self.pos = next;
        Ok(())
    }

    /// Writes `records` (every dirty slot) as the first commit of the next generation, just past
    /// the live blocks, and flushes it. The caller then writes the superblock naming
    /// [`JournalState::fresh_position`]'s result and calls [`JournalState::adopt`].
    pub fn write_fresh_generation(
        &self,
        dev: &dyn BlockDevice,
        layout: &Layout,
        records: &[(u32, LineRecord)],
    ) -> Result<JournalPosition> {
        let mut next = fresh_position(self.pos, layout);
        let blocks = journal::blocks_for(records.len(), layout).max(1);
        if self.pos.live_blocks() + blocks > layout.journal_blocks() {
            return Err(EngineError::Invariant(format!(
                "a compaction of {blocks} blocks does not fit beside {} live journal blocks \
                 ({} in all)",
                self.pos.live_blocks(),
                layout.journal_blocks()
            )));
        }
        // At least one block, even with nothing dirty: replay after an unclean stop requires
        // the generation's first commit, so a journal region that was lost (zeroed, truncated)
        // is refused rather than read as an empty log.
        journal::write_commit(dev, layout, &mut next, records, true)?;
        flush_cache(dev)?;
        Ok(next)
    }

    /// Makes `next` (whose superblock has landed) the live log.
    pub fn adopt(&mut self, next: JournalPosition) {
        self.pos = next;
        self.fresh_generation_due = false;
        self.unconfirmed = None;
    }

    /// `next`'s blocks are whole but the superblock naming it may or may not have landed.
    pub fn leave_unconfirmed(&mut self, next: JournalPosition) {
        self.unconfirmed = Some(next);
    }

    pub fn unconfirmed(&self) -> Option<JournalPosition> {
        self.unconfirmed
    }
}

/// The start of a new generation right after the live blocks of `pos`: a crash before the
/// superblock names it leaves the old log intact and authoritative.
///
/// The generation is a random 64-bit id, not a counter: an attempt that wrote blocks and then
/// failed (or crashed before its superblock landed) must never share its generation with a later
/// log, in this run or after a restart, or replay could run on from the later log's last commit
/// into the failed attempt's leftover blocks. A counter kept in the superblock cannot promise
/// that, since the failed attempt's superblock never landed.
pub(crate) fn fresh_position(pos: JournalPosition, layout: &Layout) -> JournalPosition {
    JournalPosition {
        generation: new_generation_id(pos.generation),
        start_seq: pos.next_seq,
        start_block: pos.block_after_live(layout),
        next_seq: pos.next_seq,
    }
}

/// Writes `records` as the first commit of a fresh generation after `pos` on a cache no request
/// uses yet (at open), flushed; the caller writes the superblock.
pub(crate) fn start_generation(
    dev: &dyn BlockDevice,
    layout: &Layout,
    pos: JournalPosition,
    records: &[(u32, LineRecord)],
) -> Result<JournalPosition> {
    flush_cache(dev)?;
    let state = JournalState {
        pos,
        fresh_generation_due: true,
        unconfirmed: None,
    };
    state.write_fresh_generation(dev, layout, records)
}

/// A random journal generation id other than `current` (and other than 0, which a zeroed
/// journal region would carry).
pub(crate) fn new_generation_id(current: u64) -> u64 {
    loop {
        let id = uuid::Uuid::new_v4().as_u64_pair().0;
        if id != current && id != 0 {
            return id;
        }
    }
}

pub(crate) fn flush_cache(dev: &dyn BlockDevice) -> Result<()> {
    dev.flush().map_err(|e| EngineError::CacheDevice {
        device: dev.describe(),
        source: e,
    })
}

/// The commit protocol's state, owned by this module: the journal (where the next commit goes
/// and whether the last one failed), the background committer's requests, and the superblock
/// that names the live log. Other modules reach it only through the methods below and
/// [`CacheCore::commit`] / [`CacheCore::update_superblock`].
pub(crate) struct Commits {
    journal: Journal,
    requests: CommitRequests,
    superblock: Mutex<Superblock>,
    tally: CommitTally,
}

/// Commits since the start, for metrics: counted after each commit's writes, read without
/// the journal's lock.
#[derive(Default)]
struct CommitTally {
    done: std::sync::atomic::AtomicU64,
    failed: std::sync::atomic::AtomicU64,
    records: std::sync::atomic::AtomicU64,
    nanos: std::sync::atomic::AtomicU64,
}

/// The commits since the daemon started ([`crate::Cache::commit_stats`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CommitStats {
    pub done: u64,
    pub failed: u64,
    /// Line records written to the journal by the commits that succeeded.
    pub records: u64,
    /// Time spent in commits' writes and flushes (backing devices, cache device, journal).
    pub seconds: f64,
}

impl Commits {
    pub fn new(pos: JournalPosition, sb: Superblock) -> Commits {
        Commits {
            journal: Journal::new(pos),
            requests: CommitRequests::new(),
            superblock: Mutex::new(sb),
            tally: CommitTally::default(),
        }
    }

    pub fn stats(&self) -> CommitStats {
        use std::sync::atomic::Ordering::Relaxed;
        let t = &self.tally;
        CommitStats {
            done: t.done.load(Relaxed),
            failed: t.failed.load(Relaxed),
            records: t.records.load(Relaxed),
            seconds: t.nanos.load(Relaxed) as f64 / 1e9,
        }
    }

    fn count(&self, ok: bool, records: usize, took: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let t = &self.tally;
        if ok {
            t.done.fetch_add(1, Relaxed);
            t.records.fetch_add(records as u64, Relaxed);
        } else {
            t.failed.fetch_add(1, Relaxed);
        }
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        t.nanos.fetch_add(nanos, Relaxed);
    }

    fn sb(&self) -> MutexGuard<'_, Superblock> {
        // Replaced whole after each successful write; consistent after any panic.
        self.superblock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The superblock as last written.
    pub fn superblock(&self) -> Superblock {
        self.sb().clone()
    }

    /// The background committer's requests (writers ask; the committer waits on them).
    pub fn requests(&self) -> &CommitRequests {
        &self.requests
    }

    /// Holds off every commit until the guard is dropped (a checkpoint or a configuration
    /// write must not interleave with one: both write the superblock).
    pub fn exclusive(&self) -> MutexGuard<'_, JournalState> {
        self.journal.lock()
    }

    /// Returns once no commit is running (commits hold the journal for their whole length).
    pub fn wait_for_commit_in_flight(&self) {
        drop(self.journal.lock());
    }
}

/// The protocol's steps. They live here, beside the state they change, though they need the
/// cache's map, devices and halt switch (`CacheCore`).
impl CacheCore {
    /// Returns once no commit is running.
    pub fn wait_for_commit_in_flight(&self) {
        self.commits.wait_for_commit_in_flight();
    }

    /// Makes every write that returned from a backing device before this call durable.
    pub fn flush_backings(&self) -> Result<()> {
        // A copy of the list, so adding a volume never waits for a disk flush.
        let backings = self
            .backings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for backing in &backings {
            backing.flush_client_writes_checked()?;
        }
        Ok(())
    }

    /// Makes every completed write durable (docs/design.md §4.3): the records of every slot
    /// whose dirty state changed are taken in one snapshot, then the backing devices are
    /// flushed, the cache device is flushed, and the records are written to the journal and
    /// flushed. When the journal is nearly full, or after a failed commit, the commit starts a
    /// fresh generation holding every dirty record instead (a compaction).
    pub fn commit(&self, purpose: CommitPurpose) -> Result<()> {
        self.check_running()?;
        let mut journal = self.commits.journal.lock();
        // Checked under the journal lock: a FLUSH that waited behind a commit which failed
        // must see that failure (the data that commit's flush covered may be lost).
        let refuse = purpose == CommitPurpose::Durability
            && self.commits.journal.failed()
            && self.map().total_dirty_lines() > 0;
        if refuse {
            return Err(self.cache_err(std::io::Error::other(
                "an earlier metadata commit failed; dirty data in the cache may not be durable \
                 until it is written back",
            )));
        }
        if let Some(next) = journal.unconfirmed() {
            // Its blocks are whole and flushed; name it again before anything else is written.
            if let Err(e) = self.write_journal_start(next) {
                self.commits.journal.note_failure(&mut journal, &e);
                return Err(e);
            }
            journal.adopt(next);
        }
        let (records, kind, changed) = {
            // The records carry checksums, most of which live in metadata pages on the device
            // (`checksums.rs`): the pages of the slots taken are read first, without the map's
            // lock, and kept in RAM until the records are taken.
            let _held = self.hold_checksum_pages();
            self.write_map_paged(|map| {
                let kind = journal.kind_for(map.changes_pending(), &self.layout);
                // A fresh generation records only dirty slots (the rest is free by omission)
                // and takes the whole change list: keep it, so a failure can give it back.
                Ok(match kind {
                    CommitKind::Append => {
                        map.need_checksums_of_changes()?;
                        map.take_changes().map(|r| (r, kind, Vec::new()))
                    }
                    CommitKind::FreshGeneration => {
                        map.need_checksums_of_dirty()?;
                        let changed = map.changed_slots();
                        map.take_all_dirty().map(|r| (r, kind, changed))
                    }
                })
            })?
        };
        let started = std::time::Instant::now();
        let result = self.write_commit(&mut journal, &records, kind);
        self.commits
            .count(result.is_ok(), records.len(), started.elapsed());
        match result {
            Ok(()) => {
                self.map()
                    .commit_done(&records, kind == CommitKind::FreshGeneration);
                if purpose == CommitPurpose::Durability {
                    // No dirty data of unknown durability was left when this commit began,
                    // and everything since is durable now.
                    self.commits.journal.clear_failed();
                }
                Ok(())
            }
            Err(e) => {
                // Every slot whose change this commit took is still owed to the journal, the
                // ones a fresh generation left out (now clean or free) too: else a FLUSH with
                // nothing dirty left would skip the commit and the durable journal would go on
                // naming superseded dirty data (found by the million-point crash run).
                let mut map = self.map();
                map.requeue(&records);
                map.requeue_slots(&changed);
                drop(map);
                self.commits.journal.note_failure(&mut journal, &e);
                match e {
                    EngineError::Invariant(what) => Err(self.halt(what)),
                    e => Err(e),
                }
            }
        }
    }

    fn write_commit(
        &self,
        journal: &mut JournalState,
        records: &[(u32, LineRecord)],
        kind: CommitKind,
    ) -> Result<()> {
        // A record that drops dirty bits because newer data went to a backing device must not
        // become durable before that data.
        self.flush_backings()?;
        // The data a record names is durable before the record.
        flush_cache(&*self.dev)?;
        match kind {
            CommitKind::Append => journal.append(&*self.dev, &self.layout, records),
            CommitKind::FreshGeneration => {
                let next = journal.write_fresh_generation(&*self.dev, &self.layout, records)?;
                if let Err(e) = self.write_journal_start(next) {
                    // A copy naming `next` may have landed: keep both logs intact until a
                    // superblock write lands (the next commit retries this one first).
                    journal.leave_unconfirmed(next);
                    return Err(e);
                }
                journal.adopt(next);
                Ok(())
            }
        }
    }

    /// Writes the superblock naming `next` as the live log.
    fn write_journal_start(&self, next: JournalPosition) -> Result<()> {
        self.update_superblock(|sb| {
            sb.journal_generation = next.generation;
            sb.journal_start_seq = next.start_seq;
            sb.journal_start_block = next.start_block;
        })
    }

    /// Writes the superblock with `change` applied and the next sequence number. The in-memory
    /// superblock takes the change only once both copies landed, so a failed write is never
    /// repeated by a later, unrelated superblock write; but it keeps the sequence number the
    /// failed write used, so no later write can reuse it (a copy of the failed write may have
    /// landed, and two valid copies must never share a sequence number).
    pub fn update_superblock(&self, change: impl FnOnce(&mut Superblock)) -> Result<()> {
        let mut sb = self.commits.sb().clone();
        change(&mut sb);
        sb.cache_bytes_written = self.wear.total();
        sb.sequence += 1;
        sb.updated_unix = now_unix();
        match write_superblock(&*self.dev, &sb) {
            Ok(()) => {
                *self.commits.sb() = sb;
                Ok(())
            }
            Err(e) => {
                self.commits.sb().sequence = sb.sequence;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ssdcache_devsim::{CrashDevice, MemDevice};

    struct CountingFlushes {
        inner: MemDevice,
        flushes: AtomicU64,
    }

    impl BlockDevice for CountingFlushes {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.inner.write_at(buf, offset)
        }
        fn flush(&self) -> io::Result<()> {
            self.flushes.fetch_add(1, Ordering::SeqCst);
            self.inner.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
            self.inner.discard(offset, len)
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
            self.inner.write_zeroes(offset, len)
        }
        fn describe(&self) -> String {
            "counting".into()
        }
    }

    #[test]
    fn a_flush_is_issued_only_after_a_write_returned() {
        let dev = Arc::new(CountingFlushes {
            inner: MemDevice::new("counting", 1 << 20),
            flushes: AtomicU64::new(0),
        });
        let backing = Backing::new(dev.clone());
        backing.flush().unwrap();
        assert_eq!(dev.flushes.load(Ordering::SeqCst), 0, "nothing written");
        backing.write_at(&[1u8; 4096], 0).unwrap();
        backing.flush().unwrap();
        backing.flush().unwrap();
        assert_eq!(dev.flushes.load(Ordering::SeqCst), 1);
        backing.write_with(|d| d.write_zeroes(0, 4096)).unwrap();
        backing.flush().unwrap();
        assert_eq!(dev.flushes.load(Ordering::SeqCst), 2);
    }

    /// The race a single flag lost: a flush that starts while a write is in flight must not
    /// count as covering it.
    #[test]
    fn a_flush_during_a_write_does_not_cover_it() {
        let dev = Arc::new(CountingFlushes {
            inner: MemDevice::new("counting", 1 << 20),
            flushes: AtomicU64::new(0),
        });
        let backing = Backing::new(dev.clone());
        backing
            .write_with(|d| {
                // Another thread's FLUSH runs while this write is in flight.
                backing.flush()?;
                d.write_at(&[2u8; 4096], 0)
            })
            .unwrap();
        assert_eq!(dev.flushes.load(Ordering::SeqCst), 0);
        backing.flush().unwrap();
        assert_eq!(
            dev.flushes.load(Ordering::SeqCst),
            1,
            "the write still needs its flush"
        );
    }

    /// After a failed flush the device may have dropped the writes it covered: a later flush
    /// that succeeds would vouch for them wrongly, so every later flush fails.
    #[test]
    fn a_failed_flush_is_never_retried_and_forgotten() {
        let dev = Arc::new(CrashDevice::new("failing", 1 << 20));
        let backing = Backing::new(dev.clone());
        backing.write_at(&[3u8; 4096], 0).unwrap();
        dev.fail_flushes(true);
        assert!(backing.flush().is_err());
        dev.fail_flushes(false);
        let flushes = dev.flush_count();
        let err = backing.flush().unwrap_err();
        assert!(err.to_string().contains("earlier flush"), "{err}");
        assert_eq!(dev.flush_count(), flushes, "not issued again");
        assert_eq!(backing.flushed.load(Ordering::SeqCst), 0);
    }
}
