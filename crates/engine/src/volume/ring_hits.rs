//! Hits that complete on another thread (docs/design.md §6, "Hits without waiting"): a whole
//! hit's lines are held and its cache-device reads submitted to a [`ReadRing`] straight into
//! the caller's buffer; the thread that called [`RingHits::start`] goes on at once, and the
//! thread in [`RingHits::wait`] checks each hit as its reads complete and releases its lines;
//! a hit that failed its check is left to the caller to serve, on another thread. The NBD
//! server keeps one per connection, so the thread reading requests never waits for the cache
//! device and each reply leaves as soon as its own data is in.
//!
//! No deadlock, as in a batch (`batch.rs`): a hit is started only with lines it could take
//! without waiting (try-lock, all or none), and the thread in `wait` never waits for a line,
//! so a holder of lines waiting for another (a write, the cleaner, a read) waits only for
//! reads of the cache device to complete.

use std::os::unix::io::RawFd;

use slab::Slab;
use smallvec::SmallVec;
use ssdcache_device::read_ring::{ReadRing, RingBroken, RingRead, ENTRIES};

use super::{lock, HitPlan, Volume};
use crate::sync::Mutex;

/// One read for [`RingHits::start`].
#[derive(Debug, Clone, Copy)]
pub struct RingHit {
    /// Reported back by [`RingHits::wait`].
    pub tag: u64,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
    /// Set by `start`: the hit is in flight and `wait` will report its tag.
    pub started: bool,
}

/// A hit [`RingHits::wait`] reports as ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingEnd {
    pub tag: u64,
    pub offset: u64,
    pub len: usize,
    /// False: the caller must serve the read with [`Volume::read`], on another thread.
    pub served: bool,
}

/// Reads of segments one hit may have: a hit of more lines is served the usual way.
const MAX_SEGMENTS: usize = 16;

/// A started hit: its lines, where its data goes, which of its reads are still out.
struct Pending<'v> {
    plan: HitPlan<'v>,
    tag: u64,
    /// The caller's buffer, by address (only dereferenced once every read completed).
    buf: usize,
    len: usize,
    outstanding: usize,
    ok: SmallVec<[bool; 2]>,
}

pub struct RingHits<'v> {
    volume: &'v Volume,
    ring: ReadRing,
    fd: RawFd,
    pending: Mutex<InFlight<'v>>,
}

/// The hits started and not yet reported, and their device reads not yet completed.
struct InFlight<'v> {
    hits: Slab<Pending<'v>>,
    /// At most [`ENTRIES`], so the completion queue (twice that) never overflows.
    reads: usize,
}

impl Volume {
    /// Hits through a ring of their own, if the cache device can be read through one (a file
    /// or block device, io_uring available); `None` otherwise.
    pub fn ring_hits(&self) -> Option<RingHits<'_>> {
        let fd = self.core.dev.ring_fd()?;
        Some(RingHits {
            volume: self,
            ring: ReadRing::new()?,
            fd,
            pending: Mutex::new(InFlight {
                hits: Slab::with_capacity(ENTRIES as usize),
                reads: 0,
            }),
        })
    }
}

impl<'v> RingHits<'v> {
    /// Cache-device reads in flight at most (a hit of several lines has one per line):
    /// `start` starts no hit beyond it.
    pub const MAX_READS_IN_FLIGHT: usize = ENTRIES as usize;

    /// Starts each read of `hits` that is a whole hit now (its lines free, every sector
    /// cached, its checksums in RAM, buffer and segments aligned for O_DIRECT) while fewer
    /// than [`RingHits::MAX_READS_IN_FLIGHT`] device reads are out, marking it `started`;
    /// the others are left for the caller to serve with [`Volume::read`].
    ///
    /// # Safety
    /// The buffer of every started read must stay valid, and unread and unwritten by anyone
    /// else, until [`RingHits::wait`] reported its tag; if `wait` returned [`RingBroken`],
    /// forever (the caller leaks it).
    pub unsafe fn start(&self, hits: &mut [RingHit]) {
        let mut reads: SmallVec<[RingRead; 32]> = SmallVec::new();
        let mut started: SmallVec<[(usize, usize); 32]> = SmallVec::new();
        let mut pending = lock(&self.pending);
        let pending = &mut *pending;
        for (at, hit) in hits.iter_mut().enumerate() {
            if pending.reads + reads.len() >= Self::MAX_READS_IN_FLIGHT || self.ring.is_broken() {
                break;
            }
            let Some(plan) = self.volume.begin_hit(hit.offset, hit.len as u64, false) else {
                continue;
            };
            let entry = pending.hits.vacant_entry();
            let key = entry.key() as u64;
            let first = reads.len();
            for (index, (device_offset, range)) in plan.device_ranges().enumerate() {
                reads.push(RingRead {
                    fd: self.fd,
                    offset: device_offset,
                    buf: hit.buf.wrapping_add(range.start),
                    len: range.len() as u32,
                    tag: key << 16 | index as u64,
                });
            }
            let segments = reads.len() - first;
            if segments > MAX_SEGMENTS
                || pending.reads + reads.len() > Self::MAX_READS_IN_FLIGHT
                || !reads[first..].iter().all(RingRead::is_aligned)
            {
                reads.truncate(first);
                continue;
            }
            entry.insert(Pending {
                plan,
                tag: hit.tag,
                buf: hit.buf as usize,
                len: hit.len,
                outstanding: segments,
                ok: SmallVec::from_elem(false, segments),
            });
            started.push((at, key as usize));
        }
        // SAFETY: the buffers stay valid until `wait` reports them (the caller's promise), and
        // every read is inside its hit's buffer (the plan's ranges are).
        let submitted = unsafe { self.ring.submit(&reads) };
        pending.reads += submitted;
        // Reads not submitted (the ring failed): their hits end when the reads submitted
        // complete, unserved, or now (not started) if none was.
        for read in &reads[submitted..] {
            let key = (read.tag >> 16) as usize;
            if let Some(p) = pending.hits.get_mut(key) {
                p.outstanding -= 1;
            }
        }
        for (at, key) in started {
            if pending.hits.get(key).is_some_and(|p| p.outstanding == 0) {
                pending.hits.remove(key);
            } else {
                hits[at].started = true;
            }
        }
    }

    /// Waits until at least one started hit ended (or [`RingHits::wake`]), and appends each
    /// that ended, its lines released. Served: its data is in its buffer, checked against its
    /// checksums, and counted. Not served (a device read failed or the data did not match):
    /// the caller serves it with [`Volume::read`], which reports or repairs what went wrong,
    /// but never on the thread that waits here: `read` may wait for lines that hits still in
    /// flight hold, and only this thread releases them (review 31: a damaged hit served here
    /// waited for a write that waited for another hit's line). One thread waits at a time.
    pub fn wait(&self, ended: &mut Vec<RingEnd>) -> std::result::Result<(), RingBroken> {
        let mut completions = Vec::with_capacity(Self::MAX_READS_IN_FLIGHT);
        self.ring.reap(&mut completions)?;
        let mut finished: SmallVec<[Pending<'v>; 32]> = SmallVec::new();
        {
            let mut pending = lock(&self.pending);
            let pending = &mut *pending;
            for (tag, result) in completions {
                let (key, index) = ((tag >> 16) as usize, (tag & 0xffff) as usize);
                let Some(p) = pending.hits.get_mut(key) else {
                    continue;
                };
                pending.reads = pending.reads.saturating_sub(1);
                let expected = p.plan.device_ranges().nth(index).map(|(_, r)| r.len());
                if let Some(ok) = p.ok.get_mut(index) {
                    *ok = usize::try_from(result).ok() == expected;
                }
                p.outstanding = p.outstanding.saturating_sub(1);
                if p.outstanding == 0 {
                    finished.push(pending.hits.remove(key));
                }
            }
        }
        for p in finished {
            // SAFETY: every read into the buffer completed, and the caller keeps the buffer
            // alive and to itself until this reports its tag.
            let buf = unsafe { std::slice::from_raw_parts(p.buf as *const u8, p.len) };
            ended.push(RingEnd {
                tag: p.tag,
                offset: p.plan.offset,
                len: p.len,
                served: self.volume.finish_hit(&p.plan, buf, &p.ok),
            });
            // The plan's lines are released here, before the next hit is checked.
        }
        Ok(())
    }

    /// Makes a thread in [`RingHits::wait`] return.
    pub fn wake(&self) {
        self.ring.wake();
    }

    /// Hits started and not yet reported by `wait`.
    pub fn in_flight(&self) -> usize {
        lock(&self.pending).hits.len()
    }
}

impl Drop for RingHits<'_> {
    /// Waits for every read still in flight: the callers' buffers outlive this, not the reads.
    /// A read that gives no sign for [`DRAIN_LIMIT`] (a hit recorded and never submitted,
    /// after a panic) retires the ring: leaked with whatever is in it.
    fn drop(&mut self) {
        let mut ended = Vec::new();
        let mut last_progress = std::time::Instant::now();
        while self.in_flight() > 0 {
            if last_progress.elapsed() > DRAIN_LIMIT {
                self.ring.retire();
                return;
            }
            if self.wait(&mut ended).is_err() {
                // The ring is leaked with its reads (ReadRing's drop); the caller must leak
                // their buffers too.
                return;
            }
            if !ended.is_empty() {
                last_progress = std::time::Instant::now();
            }
            ended.clear();
        }
    }
}

/// How long dropping a [`RingHits`] waits for reads that give no sign.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
