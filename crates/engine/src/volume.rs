//! One backing device served through the cache: the read and write paths of each mode.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ssdcache_device::{AlignedBuf, BlockDevice};
use ssdcache_format::{CacheMode, VolumeCounters, VolumeSlot, SECTOR_SIZE};

use crate::admission::StreamDetector;
use crate::cache::CacheCore;
use crate::error::{EngineError, Result};
use crate::map::MapState;

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
}

thread_local! {
    /// One line of scratch space per thread for whole-line fills (no allocation per miss).
    static LINE_SCRATCH: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::zeroed(0));
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

/// Occupancy and counters of a volume at one moment.
#[derive(Debug, Clone)]
pub struct VolumeStats {
    pub name: String,
    pub mode: CacheMode,
    pub size: u64,
    pub counters: VolumeCounters,
    pub lines_used: u64,
    pub bytes_cached: u64,
}

pub struct Volume {
    id: u16,
    name: String,
    mode: CacheMode,
    read_only: bool,
    size: u64,
    backing: Arc<dyn BlockDevice>,
    core: Arc<CacheCore>,
    streams: StreamDetector,
    counters: [AtomicU64; VolumeCounters::COUNT],
}

impl Volume {
    pub(crate) fn new(
        slot: &VolumeSlot,
        backing: Arc<dyn BlockDevice>,
        core: Arc<CacheCore>,
    ) -> Volume {
        Volume {
            id: slot.id,
            name: slot.name.clone(),
            mode: slot.mode,
            read_only: slot.read_only,
            size: slot.backing.size,
            backing,
            core,
            streams: StreamDetector::new(slot.sequential_cutoff),
            counters: slot.counters.0.map(AtomicU64::new),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn mode(&self) -> CacheMode {
        self.mode
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn read_only(&self) -> bool {
        self.read_only
    }
    pub fn line_size(&self) -> u64 {
        self.core.layout.line_size
    }

    fn count(&self, c: Counter, n: u64) {
        self.counters[c as usize].fetch_add(n, Ordering::Relaxed);
    }

    pub fn counters(&self) -> VolumeCounters {
        VolumeCounters(std::array::from_fn(|i| {
            self.counters[i].load(Ordering::Relaxed)
        }))
    }

    pub fn stats(&self) -> VolumeStats {
        let (lines_used, sectors) = self.core.map().occupancy(self.id);
        VolumeStats {
            name: self.name.clone(),
            mode: self.mode,
            size: self.size,
            counters: self.counters(),
            lines_used,
            bytes_cached: sectors * SECTOR_SIZE,
        }
    }

    fn check(&self, offset: u64, length: u64) -> Result<()> {
        if !offset.is_multiple_of(SECTOR_SIZE) || !length.is_multiple_of(SECTOR_SIZE) {
            return Err(EngineError::Misaligned { offset, length });
        }
        match offset.checked_add(length) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(EngineError::OutOfRange {
                offset,
                length,
                size: self.size,
            }),
        }
    }

    fn check_writable(&self, offset: u64, length: u64) -> Result<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly(self.name.clone()));
        }
        self.check(offset, length)
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
            device: self.backing.describe(),
            source,
        }
    }

    fn cache_failed(&self, source: std::io::Error) {
        self.count(Counter::CacheErrors, 1);
        tracing::warn!(volume = %self.name, "{}", self.core.cache_err(source));
    }

    fn read_backing(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.backing
            .read_at(buf, offset)
            .map_err(|e| self.backing_err(e))?;
        self.count(Counter::BytesFromBacking, buf.len() as u64);
        Ok(())
    }

    fn write_backing(&self, data: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.backing
            .write_at(data, offset)
            .map_err(|e| self.backing_err(e))?;
        self.count(Counter::BytesToBacking, data.len() as u64);
        if fua {
            self.backing.flush().map_err(|e| self.backing_err(e))?;
        }
        Ok(())
    }

    fn slot_offset(&self, slot: u32, seg: &Segment) -> u64 {
        self.core.layout.slot_offset(u64::from(slot)) + seg.in_line
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let length = buf.len() as u64;
        self.check(offset, length)?;
        self.count(Counter::Reads, 1);
        self.count(Counter::BytesRead, length);
        if length == 0 {
            return Ok(());
        }
        if self.mode == CacheMode::PassThrough {
            self.count(Counter::ReadMisses, 1);
            return self.read_backing(buf, offset);
        }
        let (first, last) = self.line_range(offset, length);
        let _held = self.core.locks.lock_range(self.id, first, last);
        let bypass = self.streams.bypass(offset, length);
        if bypass && !self.all_cached(offset, length) {
            // A stream reads on from the backing device in one piece: serving the cached parts
            // from the cache would break the disk's streaming into seeks.
            self.count(Counter::BytesBypassed, length);
            self.count(Counter::ReadMisses, 1);
            return self.read_backing(buf, offset);
        }
        let all_hit = self.read_locked(offset, buf, !bypass)?;
        self.count(
            if all_hit {
                Counter::ReadHits
            } else {
                Counter::ReadMisses
            },
            1,
        );
        Ok(())
    }

    /// True when every sector of the range is in the cache.
    fn all_cached(&self, offset: u64, length: u64) -> bool {
        let mut map = self.core.map();
        self.segments(offset, length)
            .all(|seg| Self::cached_slot(&mut map, self.id, &seg).is_some())
    }

    /// The slot holding every sector of a segment, if one does.
    fn cached_slot(map: &mut MapState, volume: u16, seg: &Segment) -> Option<u32> {
        let hit = map.lookup(volume, seg.line)?;
        (seg.first_sector..seg.first_sector + seg.sectors)
            .all(|s| hit.valid.get(s))
            .then_some(hit.slot)
    }

    /// Reads a range whose lines the caller holds: cached segments from the cache, each run of
    /// consecutive missing segments with one backing read (a disk streams it), then, with
    /// `admit`, fills the cache from what was read. Returns whether every segment hit.
    /// Reading partly cached segments from the backing device is right because these modes
    /// never hold dirty data.
    fn read_locked(&self, offset: u64, buf: &mut [u8], admit: bool) -> Result<bool> {
        debug_assert_ne!(
            self.mode,
            CacheMode::WriteBack,
            "write-back needs dirty-aware reads"
        );
        let mut all_hit = true;
        let mut run: Option<(Segment, Segment)> = None;
        for seg in self.segments(offset, buf.len() as u64) {
            if self.read_hit(&seg, &mut buf[seg.buf_at..seg.buf_at + seg.len]) {
                if let Some(missed) = run.take() {
                    self.read_missing(missed, buf, admit)?;
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
            self.read_missing(missed, buf, admit)?;
        }
        Ok(all_hit)
    }

    /// Serves a segment from the cache if every sector of it is there. A cache read error
    /// drops the line and reports a miss, so the backing device serves it.
    fn read_hit(&self, seg: &Segment, buf: &mut [u8]) -> bool {
        let Some(slot) = Self::cached_slot(&mut self.core.map(), self.id, seg) else {
            return false;
        };
        match self.core.dev.read_at(buf, self.slot_offset(slot, seg)) {
            Ok(()) => {
                self.count(Counter::BytesFromCache, seg.len as u64);
                true
            }
            Err(e) => {
                self.cache_failed(e);
                self.core
                    .map()
                    .set_valid(slot, seg.first_sector, seg.sectors, false);
                false
            }
        }
    }

    /// Reads the consecutive missing segments `first..=last` (positions in `buf` as the
    /// segments say) from the backing device and, with `admit`, caches them.
    fn read_missing(
        &self,
        (first, last): (Segment, Segment),
        buf: &mut [u8],
        admit: bool,
    ) -> Result<()> {
        if admit && first.line == last.line && first.len < self.whole_line(first.line).len {
            return self.read_missing_partial_line(
                &first,
                &mut buf[first.buf_at..first.buf_at + first.len],
            );
        }
        let (start, end) = (first.buf_at, last.buf_at + last.len);
        self.read_backing(&mut buf[start..end], first.offset)?;
        if admit {
            for seg in self.segments(first.offset, (end - start) as u64) {
                let at = start + seg.buf_at;
                self.fill(&seg, &buf[at..at + seg.len]);
            }
        }
        Ok(())
    }

    /// A miss on part of one line reads and caches the whole line: one larger read costs a
    /// disk little more than a small one, and it keeps lines full so the cache's capacity is
    /// used (4 KiB random reads would otherwise fill 1/16 of each 64 KiB line).
    fn read_missing_partial_line(&self, seg: &Segment, buf: &mut [u8]) -> Result<()> {
        let whole = self.whole_line(seg.line);
        LINE_SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            scratch.resize_discarding(whole.len);
            self.read_backing(&mut scratch, whole.offset)?;
            let at = (seg.offset - whole.offset) as usize;
            buf.copy_from_slice(&scratch[at..at + seg.len]);
            self.fill(&whole, &scratch);
            Ok(())
        })
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

    /// Puts a segment's data in the cache (allocating a line if needed). A cache error only
    /// drops the line: the backing device has the data.
    fn fill(&self, seg: &Segment, data: &[u8]) {
        let slot = {
            let mut map = self.core.map();
            match map.lookup(self.id, seg.line) {
                Some(hit) => hit.slot,
                None => match map.allocate(self.id, seg.line, &self.core.locks) {
                    Some(slot) => slot,
                    None => return, // every line busy: skip caching this one
                },
            }
        };
        let result = self.core.dev.write_at(data, self.slot_offset(slot, seg));
        let ok = result.is_ok();
        if let Err(e) = result {
            self.cache_failed(e);
        } else {
            self.count(Counter::BytesToCache, seg.len as u64);
        }
        self.core
            .map()
            .set_valid(slot, seg.first_sector, seg.sectors, ok);
    }

    fn invalidate(&self, offset: u64, length: u64) {
        let mut map = self.core.map();
        for seg in self.segments(offset, length) {
            map.invalidate(self.id, seg.line, seg.first_sector, seg.sectors);
        }
    }

    /// Writes `data` at `offset`; with `fua`, durable on the backing device before returning.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let length = data.len() as u64;
        self.check_writable(offset, length)?;
        self.count(Counter::Writes, 1);
        self.count(Counter::BytesWritten, length);
        if length == 0 {
            return Ok(());
        }
        let (first, last) = self.line_range(offset, length);
        let _held = self.core.locks.lock_range(self.id, first, last);
        let bypass = self.mode != CacheMode::PassThrough && self.streams.bypass(offset, length);
        if bypass {
            self.count(Counter::BytesBypassed, length);
        }
        match self.mode {
            CacheMode::WriteThrough if !bypass => self.write_through(offset, data, fua),
            CacheMode::WriteThrough | CacheMode::WriteAround | CacheMode::PassThrough => {
                self.invalidate(offset, length);
                self.write_backing(data, offset, fua)
            }
            CacheMode::WriteBack => Err(EngineError::Format(
                "write-back is not implemented yet".into(),
            )),
        }
    }

    /// Backing first (the cache never holds the only copy), then the cache.
    fn write_through(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        if let Err(e) = self.write_backing(data, offset, fua) {
            // The backing contents of the range are now unknown: the cache must not claim them.
            self.invalidate(offset, data.len() as u64);
            return Err(e);
        }
        let mut hit = false;
        for seg in self.segments(offset, data.len() as u64) {
            hit |= self.core.map().lookup(self.id, seg.line).is_some();
            self.fill(&seg, &data[seg.buf_at..seg.buf_at + seg.len]);
        }
        if hit {
            self.count(Counter::WriteHits, 1);
        }
        Ok(())
    }

    /// Makes every completed write durable.
    pub fn flush(&self) -> Result<()> {
        self.count(Counter::Flushes, 1);
        self.backing.flush().map_err(|e| self.backing_err(e))
    }

    /// Drops a range from the cache and discards it on the backing device where supported.
    pub fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.count(Counter::Trims, 1);
        self.uncache_then(offset, length, fua, |b| {
            b.discard(offset, length).map(|_| ())
        })
    }

    /// Makes a range read as zeroes.
    pub fn write_zeroes(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.count(Counter::WriteZeroes, 1);
        self.uncache_then(offset, length, fua, |b| b.write_zeroes(offset, length))
    }

    /// Invalidates a range in the cache, then applies `on_backing` to the backing device, with
    /// the range's lines held so no read can refill them in between.
    fn uncache_then(
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
        let (first, last) = self.line_range(offset, length);
        let _held = self.core.locks.lock_range(self.id, first, last);
        self.invalidate(offset, length);
        on_backing(&*self.backing).map_err(|e| self.backing_err(e))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Brings a range into the cache (NBD_CMD_CACHE), 1 MiB at a time.
    pub fn prefetch(&self, offset: u64, length: u64) -> Result<()> {
        self.check(offset, length)?;
        if self.mode == CacheMode::PassThrough || length == 0 {
            return Ok(());
        }
        const CHUNK: u64 = 1 << 20;
        let mut buf = AlignedBuf::zeroed(CHUNK as usize);
        let mut pos = offset;
        while pos < offset + length {
            let n = (offset + length - pos).min(CHUNK);
            let (first, last) = self.line_range(pos, n);
            let _held = self.core.locks.lock_range(self.id, first, last);
            self.read_locked(pos, &mut buf[..n as usize], true)?;
            pos += n;
        }
        Ok(())
    }
}
