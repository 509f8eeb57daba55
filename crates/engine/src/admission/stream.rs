//! Sequential stream detection. A backup, a scan or a large copy reads or writes each block
//! once; caching it evicts the data that is reused and costs an SSD write per block. Once a
//! stream has moved `cutoff` bytes, the rest of it bypasses the cache (bcache's
//! sequential_cutoff; Open CAS's stream detection). Several streams are tracked at once, so
//! concurrent copies and out-of-order arrivals from a deep queue are still recognised.
//!
//! [`StreamDetector`] has no locking inside. [`Streams`] is what a volume keeps: one detector per
//! 256 MiB region modulo 16 shards, each behind its own mutex, so requests to different regions
//! (most hits) do not take the same lock; a stream that crosses into the next region is handed
//! over to that region's shard, so it stays one stream. The engine and the simulator both use
//! `Streams`. Fixed state (32 streams per shard), no allocation per request.

/// Streams tracked per detector; the least recently used one is replaced.
const STREAMS: usize = 32;
/// `Streams`: shards, and the size of the regions they take in turn.
const SHARDS: usize = 16;
const REGION_SHIFT: u32 = 28;
/// A request starting within this distance, plus a few of its own lengths, of where a stream
/// is expected continues it (the requests of a deep sequential queue arrive out of order).
const SLACK: u64 = 1 << 20;
const SLACK_REQUESTS: u64 = 2;

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
        let exact = self.exact_continuation(offset);
        let crossed = || {
            self.streams.iter().position(|s| {
                s.run > 0 && s.next >= region_start && offset.abs_diff(s.next) <= slack
            })
        };
        let i = exact.or_else(crossed)?;
        Some(std::mem::take(&mut self.streams[i]))
    }

    /// The stream a request at `offset` continues exactly. Two streams may expect the same
    /// request (a long one reaching where a short one left behind stopped): it continues the
    /// one with the most evidence (taking the first found restarted a long stream whenever it
    /// met a short one). The others short of the cutoff, which now describe the same place,
    /// are forgotten: kept, they doubled how often random requests in a small region add up to
    /// a stream (review 28). Those past it stay: two readers of the same data, one caught up
    /// with the other, each go on continuing their own (review 28, F3).
    fn exact_continuation(&mut self, offset: u64) -> Option<usize> {
        let expects = |s: &Stream| s.run > 0 && offset == s.next;
        let best = (0..STREAMS)
            .filter(|&i| expects(&self.streams[i]))
            .max_by_key(|&i| self.streams[i].run)?;
        let cutoff = self.cutoff;
        for (i, s) in self.streams.iter_mut().enumerate() {
            if i != best && expects(s) && s.run < cutoff {
                *s = Stream::default();
            }
        }
        Some(best)
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
        if self.cutoff == 0 {
            return false;
        }
        self.clock += 1;
        let now = self.clock;
        let cutoff = self.cutoff;
        let slack = SLACK + SLACK_REQUESTS.saturating_mul(len);
        let continues = |s: &Stream| s.run > 0 && offset.abs_diff(s.next) <= slack;
        // The stream this request continues exactly, else one it lands near: a stream must not
        // be taken for a neighbour it merely passes (whose evidence the request would halve).
        let exact = self.exact_continuation(offset);
        let streams = &mut self.streams;
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
    /// Each shard's detector holds it too (`set_cutoff` changes both).
    cutoff: std::sync::atomic::AtomicU64,
}

impl Streams {
    /// `cutoff` = 0 turns detection off.
    pub fn new(cutoff: u64) -> Streams {
        Streams {
            shards: std::array::from_fn(|_| std::sync::Mutex::new(StreamDetector::new(cutoff))),
            cutoff: std::sync::atomic::AtomicU64::new(cutoff),
        }
    }

    pub fn cutoff(&self) -> u64 {
        self.cutoff.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Changes the cutoff of every shard; 0 turns detection off. Streams being tracked keep
    /// the length they have moved, so one already past the new cutoff bypasses at once.
    pub fn set_cutoff(&self, cutoff: u64) {
        self.cutoff
            .store(cutoff, std::sync::atomic::Ordering::Relaxed);
        for shard in &self.shards {
            shard.lock().unwrap_or_else(|p| p.into_inner()).cutoff = cutoff;
        }
    }

    /// As [`StreamDetector::bypass`], for the whole volume.
    pub fn bypass(&self, offset: u64, len: u64) -> bool {
        if self.cutoff() == 0 {
            return false;
        }
        let region = offset >> REGION_SHIFT;
        let region_start = region << REGION_SHIFT;
        let slack = SLACK + SLACK_REQUESTS.saturating_mul(len);
        // Held across the handover, so the stream's next request (on another thread) waits
        // for it instead of starting a second copy of the stream here.
        let mut own = self.shard(region);
        if region > 0 && offset - region_start <= slack && !own.continues_exactly(offset) {
            // A stream of the previous region may have crossed into this one: move it over.
            // Only tried, never waited for: no thread waits for a second shard while holding
            // one, so threads at different boundaries cannot wait for each other in a ring.
            let previous = &self.shards[((region - 1) % SHARDS as u64) as usize];
            let taken = match previous.try_lock() {
                Ok(mut prev) => prev.take_crossing(offset, len, region_start),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    p.into_inner().take_crossing(offset, len, region_start)
                }
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(stream) = taken {
                own.adopt(stream);
            }
        }
        own.bypass(offset, len)
    }

    fn shard(&self, region: u64) -> std::sync::MutexGuard<'_, StreamDetector> {
        // A detector is consistent after any panic (plain numbers).
        self.shards[(region % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
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

    /// A stream that reaches the end of a short one left behind (a 64 KiB read a while ago,
    /// tracked first) continues itself, not that one: both expect the same next request, and
    /// taking the first found restarted a long stream at 64 KiB, so the cutoff's worth of it
    /// after that point went through the cache (the warm 1 MiB sequential reads of the
    /// benchmark's twice-the-cache set lost their stream this way about once per pass).
    #[test]
    fn a_stream_reaching_a_short_one_left_behind_is_still_a_stream() {
        let mib = 1u64 << 20;
        let mut d = StreamDetector::new(4 * mib);
        // Left behind by a random 64 KiB read: it expects a request at 20 MiB.
        d.bypass(20 * mib - (64 << 10), 64 << 10);
        let bypassed: Vec<bool> = (0..32).map(|i| d.bypass(i * mib, mib)).collect();
        assert!(!bypassed[..4].iter().any(|&b| b), "{bypassed:?}");
        assert!(bypassed[4..].iter().all(|&b| b), "{bypassed:?}");
        // Handed over at a region boundary the same way.
        let streams = Streams::new(4 * mib);
        let region = 1u64 << REGION_SHIFT;
        streams.bypass(region + 4 * mib - (64 << 10), 64 << 10);
        let bypassed: Vec<bool> = (0..16)
            .map(|i| streams.bypass(region - 8 * mib + i * mib, mib))
            .collect();
        assert!(bypassed[4..].iter().all(|&b| b), "{bypassed:?}");
    }

    /// Two readers of the same data: A reads ahead and pauses; B, started far behind, catches
    /// up to where A stopped (both streams expect the same request), then the two go on in
    /// lockstep. Each continues its own stream and every lockstep request bypasses (forgetting
    /// A's stream when B reached it made A's requests halve B's: 10 of 128 bypassed; review 28).
    #[test]
    fn two_readers_in_lockstep_after_one_caught_up_stay_streams() {
        let mib = 1u64 << 20;
        let s = Streams::new(4 * mib);
        // A to 64 MiB, then B from 0 to where A stopped.
        for _reader in 0..2 {
            for i in 0..64 {
                s.bypass(i * mib, mib);
            }
        }
        let mut bypassed = 0;
        for i in 64..128 {
            bypassed += usize::from(s.bypass(i * mib, mib));
            bypassed += usize::from(s.bypass(i * mib, mib));
        }
        assert!(
            bypassed >= 120,
            "only {bypassed} of 128 lockstep requests bypassed"
        );
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
}
