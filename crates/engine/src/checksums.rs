//! The data checksums of the cache's lines (one CRC32C per 4 KiB sector, docs/design.md §4.8),
//! kept in RAM only for a bounded set of metadata pages (docs/design.md §3, "Checksums out of
//! RAM"). The cache device's metadata region already holds one record per slot in slot order
//! (§2.2); while the engine runs, a page of it is where the checksums of its slots live when
//! they are not in RAM. This type is the in-RAM part: which pages are resident (a *frame*
//! each), their checksums, which of them changed since they were last written (*modified*),
//! what the device holds for every page this run, and the CLOCK that picks the frame to reuse.
//! It does no I/O: the cache core reads pages outside the map's lock and installs them here
//! ([`ChecksumPages::install`]), and writes modified frames this type hands out
//! ([`ChecksumPages::take_due_writes`]) when the frames exceed their budget.
//!
//! Why this is crash safe: pages written while running carry this run's stamp and only their
//! checksums (every record free), and no later run reads them: after a crash the
//! journal is replayed and every page counts as holding nothing ([`PageSource::Nothing`]);
//! after a clean stop the checkpoint has rewritten every page. A page is written only once the
//! superblock says running ([`ChecksumPages::allow_writes`]), so a checkpoint that a clean
//! superblock names is never overwritten by this. A read of a page planned before the page was
//! written again is recognised by the page's epoch and thrown away, so a stale copy never
//! replaces newer checksums.
//!
//! Everything here runs under the map's lock (a write lock, but for [`ChecksumPages::get`]
//! and [`ChecksumPages::is_resident`], which hits call under the read lock).

use crate::map::Invariant;
use crate::sync::atomic::{AtomicBool, Ordering};
use ssdcache_format::{LineRecord, MetaPage, SECTOR_SIZE};

const NO_FRAME: u32 = u32::MAX;
const NO_PAGE: u32 = u32::MAX;
/// Frames the background may leave beyond the budget at the least (`Pressure`).
const HARD_SLACK_FRAMES: usize = 64;

/// See [`ChecksumPages::pressure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pressure {
    None,
    WriteSoon,
    WriteNow,
}

/// What the cache device holds for a page, this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum PageSource {
    /// Nothing of this run: every checksum of the page is 0 unless a resident frame says
    /// otherwise (a new cache, or every page after a crash).
    Nothing,
    /// The checkpoint the cache opened from (stamped with its sequence number).
    Checkpoint,
    /// A page this run wrote (stamped with the run's stamp).
    ThisRun,
    /// A page a checkpoint of this run wrote (a clean stop that may yet fail; stamped with
    /// that checkpoint's sequence number, one of `known_stamps`).
    Closing,
}

/// How to read a page that is not resident: planned under the lock, done without it, and
/// installed only if the page's epoch is still the one planned.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageRead {
    pub page: u32,
    epoch: u32,
    /// Where the page is on the cache device; `None` when the device holds nothing of it
    /// this run (installed as zeroes, nothing is read).
    pub from: Option<u64>,
    /// The page's first slot, which its header must name.
    pub first_slot: u64,
}

/// What a read of a page gave.
pub(crate) enum PageContent {
    /// The page's checksums, `per_page × sectors` values, and the stamp it carries (checked
    /// when it is installed: any stamp of this run is accepted, see `known_stamps`).
    Checksums(Vec<u32>, u64),
    /// Nothing of this run on the device: zeroes.
    Zeroes,
    /// The page could not be read or failed its checks: its checksums are unknown.
    Lost,
}

/// A modified frame to write: its checksums as they were when handed out.
pub(crate) struct PageWrite {
    pub page: u32,
    version: u32,
    pub offset: u64,
    pub stamp: u64,
    pub first_slot: u64,
    pub checksums: Vec<u32>,
}

struct Frame {
    page: u32,
    checksums: Box<[u32]>,
    /// Set on every use; the CLOCK hand clears it and passes over the frame once.
    referenced: AtomicBool,
    /// Changed since the device last got a copy: the frame may not be dropped before a write.
    modified: bool,
    /// A write of a copy is under way (`take_due_writes` .. `written`).
    writing: bool,
    /// The last write of it failed: not taken again until `retry_failed_writes`.
    write_failed: bool,
    /// Counts changes, so `written` knows whether the copy written is still the newest.
    version: u32,
}

/// The result of installing a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Installed {
    /// Installed from the content given.
    Yes,
    /// Installed as zeroes because the page was lost: the caller marks what it must.
    Lost,
    /// Not installed: resident already, or the read was planned before a newer copy was
    /// written (read it again).
    No,
}

pub(crate) struct ChecksumPages {
    line_size: u64,
    sectors: usize,
    per_page: u32,
    slots: u32,
    meta_offset: u64,
    /// The frame holding each page, or `NO_FRAME`.
    frame_of: Vec<u32>,
    source: Vec<PageSource>,
    /// Bumped each time the device's copy of a page changes (a write of it ended).
    epoch: Vec<u32>,
    frames: Vec<Frame>,
    unused_frames: Vec<u32>,
    resident: usize,
    modified: usize,
    hand: usize,
    /// Frames kept at most unless more are needed at once (`holds`, frames not yet written).
    budget_frames: usize,
    /// While above zero nothing is dropped (a commit or compaction gathering its records).
    holds: u32,
    run_stamp: u64,
    /// Every stamp a page of this run may carry: the checkpoint's it opened from (if any),
    /// the run's, and those of every clean stop of this run (one that failed leaves its pages
    /// with its stamp). A page not in RAM is as its last write that ended well left it, so
    /// any of them is its newest copy (review 26, R26-4).
    known_stamps: Vec<u64>,
    /// Pages whose checksums were lost (unreadable, or failing their checks): their clean
    /// sectors' checksums are 0 = unknown, until new data gives them one (`checksum_unknown`).
    lost_pages: std::collections::HashSet<u32>,
    writes_allowed: bool,
    pages_read: u64,
    pages_written: u64,
    pages_lost: u64,
}

impl ChecksumPages {
    /// Checksums of `slots` slots of `line_size` bytes whose pages start at `meta_offset`, none
    /// resident, the device holding nothing of them; `budget_frames` frames kept at most.
    pub fn new(slots: u32, line_size: u64, meta_offset: u64, budget_frames: usize) -> Self {
        let per_page = MetaPage::records_per_page(line_size) as u32;
        let pages = slots.div_ceil(per_page.max(1)) as usize;
        ChecksumPages {
            line_size,
            sectors: LineRecord::sectors(line_size),
            per_page,
            slots,
            meta_offset,
            frame_of: vec![NO_FRAME; pages],
            source: vec![PageSource::Nothing; pages],
            epoch: vec![0; pages],
            frames: Vec::new(),
            unused_frames: Vec::new(),
            resident: 0,
            modified: 0,
            hand: 0,
            budget_frames: budget_frames.max(1),
            holds: 0,
            run_stamp: 1 << 63,
            known_stamps: Vec::new(),
            lost_pages: std::collections::HashSet::new(),
            writes_allowed: false,
            pages_read: 0,
            pages_written: 0,
            pages_lost: 0,
        }
    }

    /// Bytes of RAM one resident page takes (its checksums).
    pub fn frame_bytes(line_size: u64) -> usize {
        MetaPage::records_per_page(line_size) as usize * LineRecord::sectors(line_size) * 4
    }

    pub fn page_of(&self, slot: u32) -> u32 {
        slot / self.per_page
    }

    /// The slots of a page.
    pub fn slots_of(&self, page: u32) -> std::ops::Range<u32> {
        let first = page * self.per_page;
        first..(first + self.per_page).min(self.slots)
    }

    /// Every page is the checkpoint's (stamped `seq`): the cache opened from it.
    pub fn opened_from_checkpoint(&mut self, seq: u64) {
        self.known_stamps.push(seq);
        self.source.fill(PageSource::Checkpoint);
    }

    /// A checkpoint stamped `seq` wrote `pages` (or tried to: after a failed write, a read
    /// that finds another stamp counts the page as lost). Resident frames are unchanged: RAM
    /// holds what the checkpoint wrote, or newer.
    pub fn checkpoint_written(&mut self, pages: std::ops::Range<u32>, seq: u64) {
        if !self.known_stamps.contains(&seq) {
            self.known_stamps.push(seq);
        }
        for page in pages {
            let p = page as usize;
            if p < self.source.len() {
                self.source[p] = PageSource::Closing;
                self.epoch[p] = self.epoch[p].wrapping_add(1);
            }
        }
    }

    /// Whether a page is resident (in a frame).
    pub fn is_page_resident(&self, page: u32) -> bool {
        self.frame_of
            .get(page as usize)
            .is_some_and(|&f| f != NO_FRAME)
    }

    /// Pages written from now on carry `stamp` (a random value with the top bit set, never a
    /// checkpoint's sequence number), and may be written: the superblock says running.
    pub fn allow_writes(&mut self, stamp: u64) {
        self.run_stamp = stamp | 1 << 63;
        self.known_stamps.push(self.run_stamp);
        self.writes_allowed = true;
    }

    /// No page is written from now on: a clean stop wrote the checkpoint a clean superblock
    /// now names, and nothing may overwrite it (a caller using the cache after `shutdown`).
    pub fn forbid_writes(&mut self) {
        self.writes_allowed = false;
    }

    pub fn set_budget(&mut self, frames: usize) {
        self.budget_frames = frames.max(1);
    }

    /// Frames resident, of them modified; pages read, written and lost since open.
    pub fn usage(&self) -> ChecksumUsage {
        ChecksumUsage {
            resident_frames: self.resident as u64,
            modified_frames: self.modified as u64,
            budget_frames: self.budget_frames as u64,
            frame_bytes: Self::frame_bytes(self.line_size) as u64,
            pages_read: self.pages_read,
            pages_written: self.pages_written,
            pages_lost: self.pages_lost,
        }
    }

    /// Whether the checksums of `slot` are in RAM (a page the device holds nothing of counts:
    /// it is zeroes, installed without a read).
    pub fn is_resident(&self, slot: u32) -> bool {
        let page = self.page_of(slot) as usize;
        page < self.frame_of.len()
            && (self.frame_of[page] != NO_FRAME || self.source[page] == PageSource::Nothing)
    }

    /// Makes the pages of `slots` the device holds nothing of resident (zeroes, no read) and
    /// appends the others that are not in RAM to `out`.
    pub fn ensure(&mut self, slots: impl IntoIterator<Item = u32>, out: &mut Vec<u32>) {
        for slot in slots {
            let page = self.page_of(slot);
            let Some(&frame) = self.frame_of.get(page as usize) else {
                continue;
            };
            if frame != NO_FRAME {
                continue;
            }
            if self.source[page as usize] == PageSource::Nothing {
                self.put(page, None);
            } else if !out.contains(&page) {
                out.push(page);
            }
        }
    }

    /// How to read `page`.
    pub fn read_plan(&self, page: u32) -> PageRead {
        let p = page as usize;
        PageRead {
            page,
            epoch: self.epoch[p],
            from: (self.source[p] != PageSource::Nothing).then(|| self.page_offset(page)),
            first_slot: u64::from(page) * u64::from(self.per_page),
        }
    }

    fn page_offset(&self, page: u32) -> u64 {
        self.meta_offset + u64::from(page) * SECTOR_SIZE
    }

    /// Decodes a page read for `plan` on a cache of `line_size` lines.
    /// The stamp is checked when the page is installed (`install`).
    pub fn decode(line_size: u64, plan: &PageRead, bytes: &[u8]) -> PageContent {
        if plan.from.is_none() {
            return PageContent::Zeroes;
        }
        let per_page = MetaPage::records_per_page(line_size) as usize;
        let mut checksums = vec![0u32; per_page * LineRecord::sectors(line_size)];
        let stamp = MetaPage::stamp_of(bytes);
        match MetaPage::decode_checksums(bytes, stamp, plan.first_slot, line_size, &mut checksums) {
            Ok(()) => PageContent::Checksums(checksums, stamp),
            Err(e) => {
                tracing::warn!(
                    "metadata page {} of the cache device failed its checks ({e}): the \
                     checksums of its {per_page} lines are lost; their clean data will be read \
                     from the backing device, their dirty data is accepted unless it reads as \
                     zeroes",
                    plan.page
                );
                PageContent::Lost
            }
        }
    }

    /// Encodes a page write into `page` (4 KiB).
    pub fn encode(line_size: u64, write: &PageWrite, page: &mut [u8]) {
        MetaPage::encode_checksums(
            write.stamp,
            write.first_slot,
            line_size,
            &write.checksums,
            page,
        );
    }

    /// Installs a page read as `plan` planned, unless it is resident already or was written
    /// since (its epoch moved: the read may be stale). A lost page is installed as zeroes and
    /// reported, so that the map marks its dirty sectors unverified.
    pub fn install(&mut self, plan: &PageRead, content: PageContent) -> Installed {
        let p = plan.page as usize;
        if p >= self.frame_of.len() || self.frame_of[p] != NO_FRAME || self.epoch[p] != plan.epoch {
            return Installed::No;
        }
        if plan.from.is_some() {
            self.pages_read += 1;
        }
        let content = match content {
            PageContent::Checksums(_, stamp) if !self.known_stamps.contains(&stamp) => {
                tracing::warn!(
                    "metadata page {} of the cache device carries stamp {stamp:#x}, which no \
                     write of this run made: its checksums are lost; their clean data will be \
                     read from the backing device",
                    plan.page
                );
                PageContent::Lost
            }
            other => other,
        };
        match content {
            PageContent::Checksums(checksums, _) => {
                self.put(plan.page, Some(&checksums));
                Installed::Yes
            }
            PageContent::Zeroes => {
                self.put(plan.page, None);
                Installed::Yes
            }
            PageContent::Lost => {
                self.pages_lost += 1;
                self.lost_pages.insert(plan.page);
                self.put(plan.page, None);
                Installed::Lost
            }
        }
    }

    /// Installs a page whose checksums the caller read itself (the checkpoint at open), as
    /// the device holds them: not modified.
    pub fn install_loaded(&mut self, page: u32, checksums: &[u32]) {
        if self.frame_of.get(page as usize) == Some(&NO_FRAME) {
            self.put(page, Some(checksums));
        }
    }

    /// Puts a page into a frame (a free one, else the CLOCK's pick, else a new one).
    fn put(&mut self, page: u32, checksums: Option<&[u32]>) {
        let frame = self.free_frame();
        let f = &mut self.frames[frame as usize];
        f.page = page;
        match checksums {
            Some(c) => f.checksums.copy_from_slice(c),
            None => f.checksums.fill(0),
        }
        f.referenced.store(true, Ordering::Relaxed);
        f.modified = false;
        f.writing = false;
        f.write_failed = false;
        self.frame_of[page as usize] = frame;
        self.resident += 1;
    }

    /// A frame to reuse: an unused one, else (at the budget, nothing held) the first the CLOCK
    /// finds that is neither referenced, modified nor being written; else a new one (the
    /// budget is exceeded until `take_due_writes` lets the modified ones go).
    fn free_frame(&mut self) -> u32 {
        if self.resident >= self.budget_frames && self.holds == 0 {
            if let Some(frame) = self.clock_victim() {
                let page = self.frames[frame as usize].page;
                self.frame_of[page as usize] = NO_FRAME;
                self.frames[frame as usize].page = NO_PAGE;
                self.resident -= 1;
                return frame;
            }
        }
        if let Some(frame) = self.unused_frames.pop() {
            let f = &mut self.frames[frame as usize];
            if f.checksums.is_empty() {
                f.checksums = vec![0u32; self.per_page as usize * self.sectors].into_boxed_slice();
            }
            return frame;
        }
        self.frames.push(Frame {
            page: NO_PAGE,
            checksums: vec![0u32; self.per_page as usize * self.sectors].into_boxed_slice(),
            referenced: AtomicBool::new(false),
            modified: false,
            writing: false,
            write_failed: false,
            version: 0,
        });
        (self.frames.len() - 1) as u32
    }

    /// At most two sweeps of the frames: a referenced frame gets a second chance, modified
    /// ones and ones being written are passed over.
    fn clock_victim(&mut self) -> Option<u32> {
        let n = self.frames.len();
        for _ in 0..2 * n {
            let at = self.hand % n;
            self.hand = at + 1;
            let f = &self.frames[at];
            if f.page == NO_PAGE || f.modified || f.writing {
                continue;
            }
            if f.referenced.swap(false, Ordering::Relaxed) {
                continue;
            }
            return Some(at as u32);
        }
        None
    }

    fn frame(&self, slot: u32) -> Option<&Frame> {
        let page = self.page_of(slot) as usize;
        let frame = *self.frame_of.get(page)?;
        (frame != NO_FRAME).then(|| &self.frames[frame as usize])
    }

    fn at(&self, slot: u32, sector: usize) -> usize {
        (slot % self.per_page) as usize * self.sectors + sector
    }

    /// The checksums of `out.len()` sectors of `slot` from `first`; false (nothing written)
    /// when its page is not resident.
    pub fn get(&self, slot: u32, first: usize, out: &mut [u32]) -> bool {
        match self.frame(slot) {
            Some(f) => {
                f.referenced.store(true, Ordering::Relaxed);
                let at = self.at(slot, first);
                out.copy_from_slice(&f.checksums[at..at + out.len()]);
                true
            }
            None if self.is_resident(slot) => {
                out.fill(0);
                true
            }
            None => false,
        }
    }

    /// One sector's checksum, if its page is resident.
    pub fn get_one(&self, slot: u32, sector: usize) -> Option<u32> {
        let mut one = [0u32];
        self.get(slot, sector, &mut one).then_some(one[0])
    }

    /// Sets the checksums of sectors `first..` of `slot`. The page must be resident (or the
    /// device hold nothing of it): a caller that did not make it so broke the protocol.
    pub fn set(&mut self, slot: u32, first: usize, checksums: &[u32]) -> Result<(), Invariant> {
        let page = self.page_of(slot);
        let frame = match self.frame_of.get(page as usize) {
            Some(&f) if f != NO_FRAME => f,
            Some(_) if self.source[page as usize] == PageSource::Nothing => {
                self.put(page, None);
                self.frame_of[page as usize]
            }
            _ => {
                return Err(Invariant(format!(
                    "the checksums of slot {slot} were changed while their metadata page {page} \
                     was not in memory"
                )))
            }
        };
        let at = self.at(slot, first);
        let f = &mut self.frames[frame as usize];
        f.checksums[at..at + checksums.len()].copy_from_slice(checksums);
        f.referenced.store(true, Ordering::Relaxed);
        f.version = f.version.wrapping_add(1);
        if !f.modified {
            f.modified = true;
            self.modified += 1;
        }
        Ok(())
    }

    /// Keeps every frame resident until `release`: a commit or compaction gathering records.
    pub fn hold(&mut self) {
        self.holds += 1;
    }

    pub fn release(&mut self) {
        self.holds = self.holds.saturating_sub(1);
    }

    /// Whether frames beyond the budget wait for a write before they can go.
    pub fn writes_due(&self) -> bool {
        self.writes_allowed
            && self.holds == 0
            && self.resident > self.budget_frames
            && self.modified > 0
    }

    /// What the frames ask of the caller who just changed them: nothing, writes the
    /// committer may do in the background, or writes the caller must do now because the
    /// frames reached the hard limit (the budget plus as much again, at least 64 frames:
    /// the bound on what the background may leave, documented in docs/design.md §3).
    pub fn pressure(&self) -> Pressure {
        if !self.writes_due() {
            Pressure::None
        } else if self.resident
            >= self
                .budget_frames
                .saturating_add(self.budget_frames.max(HARD_SLACK_FRAMES))
        {
            Pressure::WriteNow
        } else {
            Pressure::WriteSoon
        }
    }

    /// Copies of up to `most` modified frames to write, enough to bring the frames back to the
    /// budget (all of them with `everything`), taken in CLOCK order. Each is marked as being
    /// written until `written` is called for it.
    pub fn take_due_writes(&mut self, most: usize, everything: bool) -> Vec<PageWrite> {
        if !self.writes_allowed {
            return Vec::new();
        }
        let want = if everything {
            most
        } else {
            self.resident.saturating_sub(self.budget_frames).min(most)
        };
        let mut out = Vec::new();
        let n = self.frames.len();
        for step in 0..n {
            if out.len() >= want {
                break;
            }
            let at = (self.hand + step) % n;
            let (page, version, modified, writing) = {
                let f = &self.frames[at];
                (f.page, f.version, f.modified, f.writing || f.write_failed)
            };
            if page == NO_PAGE || !modified || writing {
                continue;
            }
            self.frames[at].writing = true;
            out.push(PageWrite {
                page,
                version,
                offset: self.page_offset(page),
                stamp: self.run_stamp,
                first_slot: u64::from(page) * u64::from(self.per_page),
                checksums: self.frames[at].checksums.to_vec(),
            });
        }
        out
    }

    /// A write handed out by `take_due_writes` ended. On success the page's device copy is
    /// this run's, and the frame is no longer modified unless it changed meanwhile. Either way
    /// the device's copy changed (a failed write may have landed in part), so reads planned
    /// before are stale.
    pub fn written(&mut self, write: &PageWrite, ok: bool) {
        let p = write.page as usize;
        self.epoch[p] = self.epoch[p].wrapping_add(1);
        if ok {
            self.pages_written += 1;
            self.source[p] = PageSource::ThisRun;
        }
        let frame = self.frame_of[p];
        if frame == NO_FRAME {
            return;
        }
        let f = &mut self.frames[frame as usize];
        f.writing = false;
        f.write_failed = !ok;
        if ok && f.modified && f.version == write.version {
            f.modified = false;
            self.modified -= 1;
        }
    }

    /// Frames whose last write failed may be taken again (the committer calls this once a
    /// second: a failing device is retried that often, not on every request).
    pub fn retry_failed_writes(&mut self) {
        for f in &mut self.frames {
            f.write_failed = false;
        }
    }

    /// Whether sector `sector` of `slot` is clean and its checksum was lost with its page
    /// (0 in a lost page): its data cannot be checked, so it is dropped, not counted as
    /// damage (its copy on the backing device is the same).
    pub fn checksum_unknown(&self, slot: u32, sector: usize) -> bool {
        !self.lost_pages.is_empty()
            && self.lost_pages.contains(&self.page_of(slot))
            && self.get_one(slot, sector) == Some(0)
    }

    /// Drops unmodified frames beyond the budget (after a hold, or a smaller budget).
    pub fn shrink_to_budget(&mut self) {
        while self.resident > self.budget_frames && self.holds == 0 {
            let Some(frame) = self.clock_victim() else {
                return;
            };
            let page = self.frames[frame as usize].page;
            self.frame_of[page as usize] = NO_FRAME;
            self.frames[frame as usize].page = NO_PAGE;
            self.resident -= 1;
            self.unused_frames.push(frame);
        }
        // Unused frames past the budget give their memory back (allocated again if reused).
        let keep = self.budget_frames.saturating_sub(self.resident);
        for &frame in self.unused_frames.iter().skip(keep) {
            self.frames[frame as usize].checksums = Box::new([]);
        }
    }
}

/// What the checksum pages hold in RAM, for statistics and the metadata benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChecksumUsage {
    pub resident_frames: u64,
    pub modified_frames: u64,
    pub budget_frames: u64,
    pub frame_bytes: u64,
    pub pages_read: u64,
    pub pages_written: u64,
    pub pages_lost: u64,
}

/// RAM for the checksum pages unless set otherwise (`serve --checksum-memory`): this share of
/// the cache's data, at least `MIN_CHECKSUM_MEMORY`. With 64 KiB lines all checksums take
/// 0.1% of the cache; this keeps a tenth of them in RAM (docs/design.md §3).
pub const DEFAULT_CHECKSUM_MEMORY_SHARE: f64 = 0.0001;
pub const MIN_CHECKSUM_MEMORY: u64 = 1 << 20;

/// The default RAM for checksum pages of a cache holding `data_bytes` of lines.
pub fn default_checksum_memory(data_bytes: u64) -> u64 {
    ((data_bytes as f64 * DEFAULT_CHECKSUM_MEMORY_SHARE) as u64).max(MIN_CHECKSUM_MEMORY)
}

/// RAM one resident metadata page of checksums takes on a cache of `line_size` lines (2,688
/// bytes at 64 KiB lines, 452 at 4 KiB): the unit `Cache::set_checksum_memory` counts in.
pub fn checksum_frame_bytes(line_size: u64) -> u64 {
    ChecksumPages::frame_bytes(line_size) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: u64 = 64 << 10;
    const PER_PAGE: u32 = 42;
    const RUN_STAMP: u64 = 1 << 63 | 7;

    fn pages(slots: u32, budget: usize) -> ChecksumPages {
        let mut p = ChecksumPages::new(slots, LINE, 1 << 20, budget);
        p.allow_writes(7);
        p
    }

    fn read(p: &ChecksumPages, slot: u32) -> Option<u32> {
        p.get_one(slot, 3)
    }

    /// What `CacheCore::page_in` does, with the device a map of page contents.
    fn page_in(
        p: &mut ChecksumPages,
        device: &std::collections::HashMap<u32, Vec<u32>>,
        page: u32,
    ) {
        let plan = p.read_plan(page);
        let content = match plan.from {
            None => PageContent::Zeroes,
            Some(_) => PageContent::Checksums(device[&page].clone(), RUN_STAMP),
        };
        p.install(&plan, content);
    }

    fn write_due(p: &mut ChecksumPages, device: &mut std::collections::HashMap<u32, Vec<u32>>) {
        for w in p.take_due_writes(64, false) {
            device.insert(w.page, w.checksums.clone());
            p.written(&w, true);
        }
        p.shrink_to_budget();
    }

    #[test]
    fn an_unbounded_budget_never_asks_for_writes() {
        let mut p = pages(10 * PER_PAGE, usize::MAX);
        for page in 0..10 {
            p.set(page * PER_PAGE, 3, &[page]).unwrap();
        }
        assert_eq!(p.pressure(), Pressure::None);
        assert!(p.take_due_writes(64, false).is_empty());
        assert_eq!(p.usage().resident_frames, 10);
    }

    #[test]
    fn pages_the_device_holds_nothing_of_need_no_read() {
        let mut p = pages(10 * PER_PAGE, 2);
        assert!(p.is_resident(5), "a new cache: zeroes, no read");
        p.set(5, 3, &[0xabc]).unwrap();
        assert_eq!(read(&p, 5), Some(0xabc));
        assert_eq!(read(&p, 6), Some(0), "the same page");
        assert_eq!(p.usage().pages_read, 0);
    }

    #[test]
    fn frames_beyond_the_budget_are_written_then_dropped_and_read_back() {
        let mut device = std::collections::HashMap::new();
        let mut p = pages(10 * PER_PAGE, 2);
        for page in 0..10 {
            p.set(page * PER_PAGE, 3, &[page + 100]).unwrap();
            write_due(&mut p, &mut device);
        }
        let usage = p.usage();
        assert!(usage.resident_frames <= 2, "{usage:?}");
        assert_eq!(usage.pages_written, 8, "{usage:?}");
        // Page 0 went to the device: not resident, read back with its value.
        assert!(!p.is_resident(0));
        assert_eq!(read(&p, 0), None);
        let mut missing = Vec::new();
        p.ensure([0, 1, PER_PAGE * 9], &mut missing);
        assert_eq!(missing, vec![0]);
        page_in(&mut p, &device, 0);
        assert_eq!(read(&p, 0), Some(100));
        assert_eq!(p.usage().pages_read, 1);
    }

    /// Writes every modified frame and drops frames down to the budget.
    fn write_all(p: &mut ChecksumPages, device: &mut std::collections::HashMap<u32, Vec<u32>>) {
        for w in p.take_due_writes(64, true) {
            device.insert(w.page, w.checksums.clone());
            p.written(&w, true);
        }
        p.shrink_to_budget();
    }

    #[test]
    fn a_read_planned_before_a_newer_copy_was_written_is_not_installed() {
        let mut device = std::collections::HashMap::new();
        let mut p = pages(4 * PER_PAGE, 1);
        p.set(0, 3, &[1]).unwrap();
        p.set(PER_PAGE, 3, &[1]).unwrap();
        write_all(&mut p, &mut device);
        // Whichever of the two pages went to the device is the subject.
        let page = if p.is_resident(0) { 1 } else { 0 };
        let other = 1 - page;
        assert!(!p.is_resident(page * PER_PAGE) && p.is_resident(other * PER_PAGE));
        // A reader plans the page (value 1 on the device) ...
        let stale_plan = p.read_plan(page);
        let stale = device[&page].clone();
        // ... meanwhile another installs it, changes it to 3, writes it and drops it.
        page_in(&mut p, &device, page);
        p.set(page * PER_PAGE, 3, &[3]).unwrap();
        write_all(&mut p, &mut device);
        if p.is_resident(page * PER_PAGE) {
            page_in(&mut p, &device, 2);
            p.set(2 * PER_PAGE, 3, &[9]).unwrap();
            write_all(&mut p, &mut device);
            page_in(&mut p, &device, 3);
        }
        assert!(!p.is_resident(page * PER_PAGE));
        // The first reader's copy is refused; a fresh read gives 3.
        assert_eq!(
            p.install(&stale_plan, PageContent::Checksums(stale, RUN_STAMP)),
            Installed::No
        );
        page_in(&mut p, &device, page);
        assert_eq!(read(&p, page * PER_PAGE), Some(3));
    }

    #[test]
    fn held_frames_stay_and_modified_frames_are_never_dropped_unwritten() {
        let mut p = pages(8 * PER_PAGE, 1);
        p.hold();
        for page in 0..8 {
            p.set(page * PER_PAGE, 3, &[page]).unwrap();
        }
        assert_eq!(p.usage().resident_frames, 8);
        p.release();
        p.shrink_to_budget();
        // All modified: none can go before it is written.
        assert_eq!(p.usage().resident_frames, 8);
        assert!(p.writes_due());
        for page in 0..8 {
            assert_eq!(read(&p, page * PER_PAGE), Some(page));
        }
    }

    #[test]
    fn a_failed_write_keeps_the_frame_modified_and_a_change_during_a_write_keeps_it_too() {
        let mut p = pages(4 * PER_PAGE, 1);
        p.set(0, 3, &[1]).unwrap();
        p.set(PER_PAGE, 3, &[2]).unwrap();
        let writes = p.take_due_writes(64, false);
        assert_eq!(writes.len(), 1);
        let page = writes[0].page;
        // A change while the write is under way: the frame stays modified after it.
        p.set(page * PER_PAGE, 4, &[5]).unwrap();
        p.written(&writes[0], true);
        assert_eq!(p.usage().modified_frames, 2);
        let writes = p.take_due_writes(64, false);
        p.written(&writes[0], false);
        assert_eq!(
            p.usage().modified_frames,
            2,
            "a failed write changes nothing"
        );
        assert_eq!(p.usage().resident_frames, 2);
    }

    #[test]
    fn nothing_is_written_before_writes_are_allowed_and_lost_pages_read_as_zeroes() {
        let mut p = ChecksumPages::new(4 * PER_PAGE, LINE, 0, 1);
        p.opened_from_checkpoint(5);
        p.set(0, 3, &[1]).unwrap_err();
        let plan = p.read_plan(0);
        assert_eq!(plan.from, Some(0));
        // A stamp no write of this run made (an older run's page) is refused as lost.
        let other_run = PageContent::Checksums(vec![1; 42 * 16], 1 << 63 | 99);
        assert_eq!(p.install(&plan, other_run), Installed::Lost);
        assert!(p.checksum_unknown(0, 3));
        let mut fresh = ChecksumPages::new(4 * PER_PAGE, LINE, 0, 1);
        fresh.opened_from_checkpoint(5);
        let checkpoint = PageContent::Checksums(vec![1; 42 * 16], 5);
        assert_eq!(
            fresh.install(&fresh.read_plan(0), checkpoint),
            Installed::Yes
        );
        assert!(!fresh.checksum_unknown(0, 3));
        p.set(0, 3, &[1]).unwrap();
        assert!(
            p.take_due_writes(64, true).is_empty(),
            "the superblock is not running yet"
        );
        assert_eq!(read(&p, 1), Some(0));
        assert_eq!(p.usage().pages_lost, 1);
    }
}
