//! Cache hits in batches: many whole-hit reads have their cache-device reads submitted at
//! once ([`BlockDevice::read_many`]: one io_uring_enter for the lot) instead of one
//! synchronous read each. A hit is split in two: [`Volume::begin_hit`] (line locks, lookup,
//! checksums) and [`Volume::finish_hit`] (verify, count). Anything that is not a clean whole
//! hit (a miss, a busy line, a read error, a checksum mismatch) is served by
//! [`Volume::read`], the path that handles every case, after the batch's lines are released.
//!
//! No deadlock (docs/design.md §6.1): a batch waits for a line only for its first request,
//! while it holds no line; every later request's lines are taken with a try-lock, all or
//! none, and a request that cannot get them is served by `Volume::read` once the batch has
//! released every line it held. So a batch never waits while holding a line, and a holder of
//! lines (a batch, `read`, `write`, the cleaner) never waits for a batch that waits.
//!
//! [`BlockDevice::read_many`]: ssdcache_device::BlockDevice::read_many

use smallvec::SmallVec;
use ssdcache_device::DeviceRead;
use ssdcache_format::{sector_crc, SectorBitmap, SECTOR_SIZE};

use super::{Counter, Segment, Volume};
use crate::error::Result;
use crate::locks::RangeGuard;
use ssdcache_format::CacheMode;

/// One read of a batch ([`Volume::read_many`]).
pub struct BatchRead<'b> {
    pub offset: u64,
    pub buf: &'b mut [u8],
    /// What the read came to; set by `read_many`.
    pub result: Result<()>,
}

impl<'b> BatchRead<'b> {
    pub fn new(offset: u64, buf: &'b mut [u8]) -> Self {
        BatchRead {
            offset,
            buf,
            result: Ok(()),
        }
    }
}

/// A whole hit whose lines are held: where each segment lies on the cache device and the
/// checksums its sectors must match. Dropping it releases the lines.
pub struct HitPlan<'v> {
    _lines: RangeGuard<'v>,
    pub(super) offset: u64,
    length: u64,
    /// Inline for a request of up to two lines (every 4 KiB hit): nothing allocated.
    segments: SmallVec<[PlannedSegment; 2]>,
    /// When `begin_hit` was called, if latencies are recorded: the hit's is counted from here.
    started: Option<std::time::Instant>,
}

struct PlannedSegment {
    seg: Segment,
    slot: u32,
    /// Byte offset of the segment's data on the cache device.
    device_offset: u64,
    /// The checksum of each sector of the segment, as the map had them under the lock
    /// (inline up to a 64 KiB line of 4 KiB sectors).
    crcs: SmallVec<[u32; 16]>,
    /// The checksums are to be confirmed once matched (`MapState::sector_crcs`).
    confirm: bool,
}

impl HitPlan<'_> {
    /// The cache-device reads of the hit: (device offset, range in the request's buffer).
    pub fn device_ranges(&self) -> impl Iterator<Item = (u64, std::ops::Range<usize>)> + '_ {
        self.segments
            .iter()
            .map(|p| (p.device_offset, p.seg.buf_at..p.seg.buf_at + p.seg.len))
    }
}

impl Volume {
    /// Starts a read of `length` bytes at `offset` if every sector of it is in the cache:
    /// holds its lines (waiting for them if `wait`, else giving up when one is held) and
    /// notes where its data lies and the checksums it must match. `None` (holding nothing)
    /// when it is not a whole hit now, the volume passes through or the request is invalid:
    /// [`Volume::read`] serves it then.
    pub fn begin_hit(&self, offset: u64, length: u64, wait: bool) -> Option<HitPlan<'_>> {
        let started = self.latency.start();
        if length == 0 || self.check(offset, length).is_err() {
            return None;
        }
        if self.mode() == CacheMode::PassThrough {
            return None;
        }
        let (first, last) = self.line_range(offset, length);
        let lines = if wait {
            self.core.locks.lock_range(self.id, first, last)
        } else {
            self.core.locks.try_lock_range(self.id, first, last)?
        };
        let map = self.core.map_read();
        let mut segments = SmallVec::new();
        for seg in self.segments(offset, length) {
            let slot = Self::cached_slot(&map, self.id, &seg)?;
            let mut crcs = SmallVec::from_elem(0u32, seg.sectors);
            // A checksum page not in RAM: served by `Volume::read`, which reads it.
            let confirm = map.sector_crcs(slot, seg.first_sector, &mut crcs).ok()?;
            segments.push(PlannedSegment {
                seg,
                slot,
                device_offset: self.slot_offset(slot, &seg),
                crcs,
                confirm,
            });
        }
        drop(map);
        Some(HitPlan {
            _lines: lines,
            offset,
            length,
            segments,
            started,
        })
    }

    /// Ends a hit begun with [`Volume::begin_hit`] whose cache-device reads (in the order of
    /// [`HitPlan::device_ranges`]) succeeded as `read_ok` says, with the data in `buf`. True
    /// when every sector matched its checksum: the read is served and counted. False
    /// otherwise, with nothing changed: the caller drops the plan and serves the request
    /// with [`Volume::read`], which handles the error or mismatch (and counts the read).
    pub fn finish_hit(&self, plan: &HitPlan<'_>, buf: &[u8], read_ok: &[bool]) -> bool {
        let all_match = plan.segments.len() == read_ok.len()
            && plan.segments.iter().zip(read_ok).all(|(p, &ok)| {
                ok && buf[p.seg.buf_at..p.seg.buf_at + p.seg.len]
                    .chunks(SECTOR_SIZE as usize)
                    .zip(&p.crcs)
                    .all(|(sector, &crc)| sector_crc(sector) == crc)
            });
        if !all_match {
            return false;
        }
        for p in &plan.segments {
            self.core.note_touch(p.slot);
            if p.confirm {
                let matched = SectorBitmap::range(p.seg.first_sector, p.seg.sectors);
                self.core.map().confirm_sectors(p.slot, &matched);
            }
            self.count(Counter::BytesFromCache, p.seg.len as u64);
        }
        // The stream detector sees every read once, as `read` shows them to it.
        self.stream_bypass(plan.offset, plan.length);
        self.count(Counter::Reads, 1);
        self.count(Counter::BytesRead, plan.length);
        self.count(Counter::ReadHits, 1);
        if let Some(started) = plan.started {
            self.latency
                .record(crate::latency::LatencyKind::ReadHit, started.elapsed());
        }
        true
    }

    /// Serves every read of `reads`, each result into its `result`: whole hits with their
    /// cache-device reads submitted together, everything else through [`Volume::read`].
    pub fn read_many(&self, reads: &mut [BatchRead<'_>]) {
        let mut plans: Vec<Option<HitPlan<'_>>> = Vec::with_capacity(reads.len());
        for read in reads.iter() {
            // Only the first hit of the batch may wait for its lines: it holds none yet.
            let wait = plans.iter().all(Option::is_none);
            plans.push(self.begin_hit(read.offset, read.buf.len() as u64, wait));
        }
        let read_ok = self.read_planned(reads, &plans);
        let mut at = 0;
        let mut served = vec![false; reads.len()];
        for ((read, plan), served) in reads.iter().zip(&plans).zip(&mut served) {
            if let Some(plan) = plan {
                let count = plan.segments.len();
                *served = self.finish_hit(plan, read.buf, &read_ok[at..at + count]);
                at += count;
            }
        }
        // Every line of the batch is released before a request waits for one in `read`.
        drop(plans);
        for (read, served) in reads.iter_mut().zip(served) {
            read.result = if served {
                Ok(())
            } else {
                self.read(read.offset, read.buf)
            };
        }
    }

    /// Reads the planned hits' segments from the cache device in one batch; whether each
    /// segment's read succeeded, in plan order.
    fn read_planned(
        &self,
        reads: &mut [BatchRead<'_>],
        plans: &[Option<HitPlan<'_>>],
    ) -> Vec<bool> {
        let planned = plans.iter().flatten().map(|p| p.segments.len()).sum();
        let mut device_reads = Vec::with_capacity(planned);
        for (read, plan) in reads.iter_mut().zip(plans) {
            let Some(plan) = plan else { continue };
            let mut rest: &mut [u8] = read.buf;
            let mut consumed = 0;
            for (device_offset, range) in plan.device_ranges() {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - consumed);
                let (piece, after) = tail.split_at_mut(range.len());
                device_reads.push(DeviceRead::new(device_offset, piece));
                rest = after;
                consumed = range.end;
            }
        }
        self.core.dev.read_many(&mut device_reads);
        device_reads.iter().map(|r| r.result.is_ok()).collect()
    }
}
