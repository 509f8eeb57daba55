//! Sequential stream detection. A backup, a scan or a large copy reads or writes each block
//! once; caching it evicts the data that is reused and costs an SSD write per block. Once a
//! stream has moved `cutoff` bytes, the rest of it bypasses the cache (bcache's
//! sequential_cutoff; Open CAS's stream detection). Several streams are tracked at once, so
//! concurrent copies and out-of-order arrivals from a deep queue are still recognised.
//!
//! [`StreamDetector`] has no locking inside. [`Streams`] is what a volume keeps: one detector per
//! 256 MiB region modulo 16 shards, each behind its own mutex, so requests to different regions
//! do not take the same lock; a stream that crosses into the next region is handed over to
//! that region's shard, so it stays one stream. The engine and the simulator both use
//! `Streams`. Fixed state (32 streams per shard), no allocation per request.
//!
//! Cache hits take no lock here. A read the cache serves whole cannot go around the cache, so
//! the detector needs it only as evidence for a later request the cache cannot serve whole: a
//! stream read again starts on its cached head, and must arrive at its first miss already
//! counted past the cutoff, or every pass would cache one more cutoff of it (review 24,
//! `tests/stream_rescans.rs`). So a hit only leaves a note in [`HitRuns`], a fixed table of
//! atomics keyed by where a run of hits ends, and a request the cache cannot serve whole looks
//! up the run of hits ending exactly where it starts (walking back through runs that end where
//! the next begins) and counts it as if the detector had seen those hits (`Streams::bypass`).
//! Random hits thus neither wait for a lock nor push a tracked stream out of its detector.

/// Streams tracked per detector; the least recently used one is replaced.
const STREAMS: usize = 32;
/// `Streams`: shards, and the size of the regions they take in turn.
const SHARDS: usize = 16;
const REGION_SHIFT: u32 = 28;
/// A request starting within this distance, plus a few of its own lengths, of where a stream
/// is expected continues it (the requests of a deep sequential queue arrive out of order).
const SLACK: u64 = 1 << 20;
const SLACK_REQUESTS: u64 = 2;
/// `HitRuns`: notes kept (a power of two), and runs followed back from a request at most.
const HIT_NOTES: usize = 1 << 15;
const HIT_WALK_STEPS: usize = 64;
/// `HitRuns` counts in 512-byte units: 40 bits of a run's end (512 TiB, ends beyond wrap
/// round, which can only make a note miss) and 24 bits of its length (up to 8 GiB).
const NOTE_UNIT_SHIFT: u32 = 9;
const NOTE_LEN_BITS: u32 = 24;

#[derive(Debug, Clone, Copy, Default)]
struct Stream {
    /// Where the stream is expected to continue.
    next: u64,
    /// Bytes moved in exact continuation.
    run: u64,
    last_used: u64,
}

impl Stream {
    /// Counts a request that continues or lands near this stream. Only an exact continuation
    /// is evidence of a stream. A request that merely lands nearby (out of order, or random
    /// I/O in a small region) halves the evidence: a real stream with an occasional
    /// reordering still reaches the cutoff, random requests that now and then continue one
    /// another do not. (A stream whose every neighbouring pair arrives swapped is not
    /// recognised: holding an early request until its gap fills recognised it, but took
    /// random large requests for streams 1.7 times as often — review13 R13-3.)
    fn record(&mut self, offset: u64, len: u64) {
        if offset == self.next {
            self.run += len;
        } else {
            self.run /= 2;
        }
        self.next = self.next.max(offset.saturating_add(len));
    }
}

#[derive(Debug, Clone)]
pub struct StreamDetector {
    cutoff: u64,
    /// Requests seen, for least-recently-used replacement of streams.
    clock: u64,
    streams: [Stream; STREAMS],
}

impl StreamDetector {
    /// `cutoff` = 0 turns detection off (everything is cached).
    pub fn new(cutoff: u64) -> StreamDetector {
        StreamDetector {
            cutoff,
            clock: 0,
            streams: [Stream::default(); STREAMS],
        }
    }

    /// The cutoff in bytes; 0 = detection off.
    pub fn cutoff(&self) -> u64 {
        self.cutoff
    }

    /// Whether a request at `offset` continues one of the streams exactly.
    fn continues_exactly(&self, offset: u64) -> bool {
        self.streams.iter().any(|s| s.run > 0 && offset == s.next)
    }

    /// Takes out the stream that has crossed into the region starting at `region_start`, as a
    /// request at `offset` of `len` bytes shows: one it continues exactly, else one that has
    /// reached the region already (its `next` is in it) and that the request lands near. A
    /// stream still short of the region stays, whatever lands near it: another stream ahead,
    /// or a random request past the boundary, must not take it.
    fn take_crossing(&mut self, offset: u64, len: u64, region_start: u64) -> Option<Stream> {
        let slack = SLACK + SLACK_REQUESTS.saturating_mul(len);
        let exact = self
            .streams
            .iter()
            .position(|s| s.run > 0 && offset == s.next);
        let crossed = || {
            self.streams.iter().position(|s| {
                s.run > 0 && s.next >= region_start && offset.abs_diff(s.next) <= slack
            })
        };
        let i = exact.or_else(crossed)?;
        Some(std::mem::take(&mut self.streams[i]))
    }

    /// Tracks a stream handed over from another detector, in place of the least recently used.
    fn adopt(&mut self, stream: Stream) {
        self.clock += 1;
        if let Some(oldest) = self.streams.iter_mut().min_by_key(|s| s.last_used) {
            *oldest = Stream {
                last_used: self.clock,
                ..stream
            };
        }
    }

    /// Records a request and says whether it should bypass the cache: true when it continues
    /// a stream that had already moved `cutoff` bytes.
    pub fn bypass(&mut self, offset: u64, len: u64) -> bool {
        self.bypass_after_hits(offset, len, 0)
    }

    /// As [`StreamDetector::bypass`], for a request that `hits` bytes of cache hits ran up to
    /// (a run of hits ending exactly at `offset`, which this detector did not see): when the
    /// request does not continue a stream exactly, the hits are counted first as one request
    /// of their own, so a stream that reached them, or that began on them, has moved them too.
    pub fn bypass_after_hits(&mut self, offset: u64, len: u64, hits: u64) -> bool {
        if self.cutoff == 0 {
            return false;
        }
        if hits > 0 && !self.continues_exactly(offset) {
            self.bypass(offset - hits.min(offset), hits.min(offset));
        }
        self.clock += 1;
        let now = self.clock;
        let cutoff = self.cutoff;
        let streams = &mut self.streams;
        let slack = SLACK + SLACK_REQUESTS.saturating_mul(len);
        let continues = |s: &Stream| s.run > 0 && offset.abs_diff(s.next) <= slack;
        // The stream this request continues exactly, else one it lands near: a stream must not
        // be taken for a neighbour it merely passes (whose evidence the request would halve).
        let exact = streams.iter().position(|s| s.run > 0 && offset == s.next);
        let found = exact.or_else(|| streams.iter().position(continues));
        if let Some(s) = found.map(|i| &mut streams[i]) {
            let bypass = s.run >= cutoff;
            s.record(offset, len);
            s.last_used = now;
            return bypass;
        }
        if let Some(oldest) = streams.iter_mut().min_by_key(|s| s.last_used) {
            *oldest = Stream {
                next: offset + len,
                run: len,
                last_used: now,
            };
        }
        false
    }
}

/// A volume's stream detection without one lock for every request: see the module
/// documentation.
pub struct Streams {
    shards: [std::sync::Mutex<StreamDetector>; SHARDS],
    hits: HitRuns,
    cutoff: u64,
}

impl Streams {
    /// `cutoff` = 0 turns detection off.
    pub fn new(cutoff: u64) -> Streams {
        Streams {
            shards: std::array::from_fn(|_| std::sync::Mutex::new(StreamDetector::new(cutoff))),
            hits: HitRuns::new(if cutoff == 0 { 0 } else { HIT_NOTES }),
            cutoff,
        }
    }

    /// Notes a read the cache served whole (see the module documentation): no lock, one
    /// load and one store of the table's atomics.
    pub fn note_hit(&self, offset: u64, len: u64) {
        if self.cutoff > 0 {
            self.hits.note(offset, len, self.cutoff);
        }
    }

    pub fn cutoff(&self) -> u64 {
        self.cutoff
    }

    /// As [`StreamDetector::bypass`], for the whole volume: a request the cache may not serve
    /// whole (a read that misses, in part or whole, or a write). Hits noted up to `offset` count
    /// first (the module documentation).
    pub fn bypass(&self, offset: u64, len: u64) -> bool {
        if self.cutoff == 0 {
            return false;
        }
        let hits = self.hits.run_ending_at(offset, self.cutoff);
        let region = offset >> REGION_SHIFT;
        let region_start = region << REGION_SHIFT;
        // Where the evidence begins: the run of hits, else the request.
        let (first, first_len) = (offset - hits, hits + len);
        let slack = SLACK + SLACK_REQUESTS.saturating_mul(len);
        // Held across the handover, so the stream's next request (on another thread) waits
        // for it instead of starting a second copy of the stream here.
        let mut own = self.shard(region);
        let near_start = first < region_start || first - region_start <= slack;
        if region > 0 && near_start && !own.continues_exactly(first) {
            // A stream of the previous region may have crossed into this one: move it over.
            // Only tried, never waited for: no thread waits for a second shard while holding
            // one, so threads at different boundaries cannot wait for each other in a ring.
            let previous = &self.shards[((region - 1) % SHARDS as u64) as usize];
            let taken = match previous.try_lock() {
                Ok(mut prev) => prev.take_crossing(first, first_len, region_start),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    p.into_inner().take_crossing(first, first_len, region_start)
                }
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(stream) = taken {
                own.adopt(stream);
            }
        }
        own.bypass_after_hits(offset, len, hits)
    }

    fn shard(&self, region: u64) -> std::sync::MutexGuard<'_, StreamDetector> {
        // A detector is consistent after any panic (plain numbers).
        self.shards[(region % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}

/// Where recent runs of cache hits end, and how long they are: a fixed table of `AtomicU64`,
/// one note per place, a note packing a run's end and length (`NOTE_UNIT_SHIFT`). A hit that
/// starts where a noted run ends extends it (the note moves to the hit's end); a run that
/// another thread's hit broke in two stays walkable, each part noted at its own end. Places
/// are shared by hashing, so a note may be overwritten by another run's: evidence lost, never
/// invented (a note counts only where its end matches exactly). Relaxed atomics: a note is a
/// hint about access order, which nothing else depends on.
struct HitRuns {
    notes: Box<[std::sync::atomic::AtomicU64]>,
}

impl HitRuns {
    /// `places` a power of two, or 0 for none (detection off).
    fn new(places: usize) -> HitRuns {
        debug_assert!(places == 0 || places.is_power_of_two());
        HitRuns {
            notes: (0..places)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    fn unit(bytes: u64) -> u64 {
        bytes >> NOTE_UNIT_SHIFT
    }

    fn place(&self, end_unit: u64) -> Option<&std::sync::atomic::AtomicU64> {
        if self.notes.is_empty() {
            return None;
        }
        let hash = end_unit.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        self.notes.get(hash as usize & (self.notes.len() - 1))
    }

    fn pack(end_unit: u64, len_units: u64) -> u64 {
        let most = (1u64 << NOTE_LEN_BITS) - 1;
        (end_unit << NOTE_LEN_BITS) | len_units.min(most)
    }

    /// The run noted as ending exactly at `end_unit`, in units.
    fn noted_at(&self, end_unit: u64) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let note = self.place(end_unit)?.load(Relaxed);
        let end_bits = 64 - NOTE_LEN_BITS;
        let mask = (1u64 << end_bits) - 1;
        let len = note & ((1u64 << NOTE_LEN_BITS) - 1);
        (len > 0 && note >> NOTE_LEN_BITS == end_unit & mask).then_some(len)
    }

    /// Notes a hit of `len` bytes at `offset`; runs are kept up to `most` bytes.
    fn note(&self, offset: u64, len: u64, most: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let (start, end) = (Self::unit(offset), Self::unit(offset.saturating_add(len)));
        if end <= start {
            return;
        }
        let before = self.noted_at(start).unwrap_or(0);
        let run = (before + (end - start)).min(Self::unit(most).max(1));
        if let Some(place) = self.place(end) {
            place.store(Self::pack(end, run), Relaxed);
        }
    }

    /// Bytes of hits run up to `offset` (followed back through runs that end where the next
    /// begins, at most `HIT_WALK_STEPS` of them), at most `most`.
    fn run_ending_at(&self, offset: u64, most: u64) -> u64 {
        let most_units = Self::unit(most).max(1);
        let mut at = Self::unit(offset);
        let mut total = 0u64;
        for _ in 0..HIT_WALK_STEPS {
            let Some(len) = self.noted_at(at) else { break };
            total += len;
            if total >= most_units || len > at {
                break;
            }
            at -= len;
        }
        (total.min(most_units) << NOTE_UNIT_SHIFT).min(offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream stays one stream across regions (it is handed over to the next shard), and
    /// requests to different regions use different detectors.
    #[test]
    fn a_stream_crossing_regions_stays_one_stream() {
        let mib = 1u64 << 20;
        let streams = Streams::new(4 * mib);
        let start = (1 << REGION_SHIFT) - 8 * mib;
        let bypassed: Vec<bool> = (0..32)
            .map(|i| streams.bypass(start + i * mib, mib))
            .collect();
        assert!(!bypassed[..4].iter().any(|&b| b), "{bypassed:?}");
        assert!(bypassed[4..].iter().all(|&b| b), "{bypassed:?}");
        assert!(!Streams::new(0).bypass(0, mib));
    }

    #[test]
    fn long_streams_bypass_after_the_cutoff_random_requests_never() {
        let mut d = StreamDetector::new(4 << 20);
        let mib = 1u64 << 20;
        let bypassed: Vec<bool> = (0..8).map(|i| d.bypass(i * mib, mib)).collect();
        assert_eq!(
            bypassed,
            [false, false, false, false, true, true, true, true]
        );
        // Random 4 KiB requests far apart never form a stream.
        let mut x = 12345u64;
        for _ in 0..1000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            assert!(!d.bypass((x >> 20) % (1 << 40) / 4096 * 4096 + (1 << 41), 4096));
        }
    }

    /// A stream passing near another request (a write in the middle of a file being read)
    /// is still the stream: the request that continues it exactly counts for it.
    #[test]
    fn a_stream_passing_a_neighbour_is_still_a_stream() {
        let mib = 1u64 << 20;
        let mut d = StreamDetector::new(mib);
        // A lone 4 KiB request at 2.5 MiB, tracked first.
        d.bypass(5 * mib / 2, 4096);
        let chunk = 256 << 10;
        let bypassed: Vec<bool> = (0..16).map(|i| d.bypass(i * chunk, chunk)).collect();
        assert!(bypassed[4..].iter().all(|&b| b), "{bypassed:?}");
    }

    #[test]
    fn random_large_requests_in_a_small_region_are_not_a_stream() {
        let mut d = StreamDetector::new(4 << 20);
        let mib = 1u64 << 20;
        let mut x = 99u64;
        let bypassed = (0..2000)
            .filter(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                d.bypass((x >> 33) % 256 * mib, mib)
            })
            .count();
        assert!(
            bypassed < 20,
            "{bypassed} of 2000 random 1 MiB reads in 256 MiB were taken for a stream"
        );
    }

    #[test]
    fn concurrent_and_reordered_streams_are_tracked() {
        let mut d = StreamDetector::new(2 << 20);
        let mib = 1u64 << 20;
        let (a, b) = (0u64, 100 << 30);
        for i in 0..4 {
            d.bypass(a + i * mib, mib);
            d.bypass(b + i * mib, mib);
        }
        // Out of order by one request: still the same stream.
        assert!(d.bypass(a + 5 * mib, mib));
        assert!(d.bypass(a + 4 * mib, mib));
        assert!(d.bypass(b + 4 * mib, mib));
        assert!(
            !StreamDetector::new(0).bypass(a + 6 * mib, mib),
            "cutoff 0 = off"
        );
    }
    /// Hits noted by threads that broke a run in two (each part noted at its own end), or
    /// arriving out of order, still add up: a request after them finds the whole run.
    #[test]
    fn runs_of_hits_add_up_through_broken_and_reordered_notes() {
        let kib = 1u64 << 10;
        let runs = HitRuns::new(HIT_NOTES);
        let cutoff = 4 << 20;
        // 0..64 KiB in order, 128..192 KiB before 64..128 KiB (another thread's hit first).
        runs.note(0, 64 * kib, cutoff);
        runs.note(128 * kib, 64 * kib, cutoff);
        runs.note(64 * kib, 64 * kib, cutoff);
        assert_eq!(runs.run_ending_at(192 * kib, cutoff), 192 * kib);
        // Nothing ends at 96 KiB, and a run is capped at the cutoff.
        assert_eq!(runs.run_ending_at(96 * kib, cutoff), 0);
        assert_eq!(runs.run_ending_at(192 * kib, 100 * kib), 100 * kib);
        // A run is followed back no further than its notes go.
        runs.note(1 << 30, 4 * kib, cutoff);
        assert_eq!(runs.run_ending_at((1 << 30) + 4 * kib, cutoff), 4 * kib);
        // Detection off: no notes at all.
        let off = HitRuns::new(0);
        off.note(0, 64 * kib, cutoff);
        assert_eq!(off.run_ending_at(64 * kib, cutoff), 0);
    }

    /// Hits a detector did not see count for the stream that reached them, and for a stream
    /// that began on them; a random request after a short run of hits is no stream.
    #[test]
    fn hits_before_a_request_count_for_its_stream() {
        let mib = 1u64 << 20;
        let mut d = StreamDetector::new(4 * mib);
        // A stream moved 1 MiB, then 2 MiB of hits, then misses: past the cutoff at 4 MiB.
        assert!(!d.bypass(0, mib));
        assert!(!d.bypass_after_hits(3 * mib, mib, 2 * mib));
        assert!(d.bypass(4 * mib, mib));
        // A stream read again from its cached head (4 MiB of hits): past the cutoff at once.
        let far = 100 << 30;
        assert!(d.bypass_after_hits(far + 4 * mib, mib, 4 * mib));
        // One 64 KiB hit before a random request: not a stream.
        assert!(!d.bypass_after_hits(50 << 30, 4096, 64 << 10));
    }

    /// Through `Streams`: random hits take no place in a detector, and a stream read again
    /// over its cached head goes around the cache from its first miss.
    #[test]
    fn streams_count_noted_hits() {
        let mib = 1u64 << 20;
        let streams = Streams::new(4 * mib);
        for i in 0..4 {
            streams.note_hit(i * mib, mib);
        }
        for i in 0..1000u64 {
            streams.note_hit((i * 7919 % 4096) * 64 * mib + 8 * mib, 4096);
        }
        assert!(streams.bypass(4 * mib, mib), "the stream's head was noted");
        assert!(!streams.bypass(64 * mib + 8 * mib + 4096 * 3, 4096));
    }
}
