//! Request latency histograms of a volume, by kind (a read that hit, a read that missed, a
//! write, FLUSH, TRIM, WRITE_ZEROES): the time inside the engine, from the call to its return
//! (for a batched or ring hit, from `begin_hit` to `finish_hit`), not the time a request
//! waited in the NBD server's queues. Striped like the counters (`counters.rs`): recording is
//! two clock reads and two relaxed additions on the thread's own cache line. Off until
//! [`crate::Cache::record_latencies`] turns it on (`serve --metrics`): then a request costs one
//! relaxed load more, and with it on about 50 ns (review 34 measured 5% of an in-memory hit
//! at a million hits a second; an NBD hit takes about 10 µs of CPU).

use std::time::{Duration, Instant};

use crate::counters::StripedCounters;

/// What a latency is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatencyKind {
    ReadHit,
    ReadMiss,
    Write,
    Flush,
    Trim,
    WriteZeroes,
}

impl LatencyKind {
    pub const ALL: [LatencyKind; 6] = [
        LatencyKind::ReadHit,
        LatencyKind::ReadMiss,
        LatencyKind::Write,
        LatencyKind::Flush,
        LatencyKind::Trim,
        LatencyKind::WriteZeroes,
    ];

    /// (request kind, outcome) as metrics label them.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            LatencyKind::ReadHit => ("read", "hit"),
            LatencyKind::ReadMiss => ("read", "miss"),
            LatencyKind::Write => ("write", "any"),
            LatencyKind::Flush => ("flush", "any"),
            LatencyKind::Trim => ("trim", "any"),
            LatencyKind::WriteZeroes => ("write_zeroes", "any"),
        }
    }
}

/// Upper bounds of the buckets, in microseconds (a last bucket takes the rest): from a RAM
/// hit to a hard drive's worst seeks and a FLUSH behind a full disk cache.
pub const BUCKET_BOUNDS_US: [u64; 16] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 5_000_000,
];
const BUCKETS: usize = BUCKET_BOUNDS_US.len() + 1;
/// Per kind: the buckets, then the sum of the latencies in nanoseconds.
const PER_KIND: usize = BUCKETS + 1;
const KINDS: usize = LatencyKind::ALL.len();

pub(crate) struct LatencyHistograms {
    on: std::sync::atomic::AtomicBool,
    counts: StripedCounters<{ KINDS * PER_KIND }>,
}

/// One kind's histogram at one moment.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    pub kind: LatencyKind,
    /// (upper bound in seconds, requests over the bound before it and at or under this one);
    /// the last bound is infinite.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_seconds: f64,
}

impl LatencyHistograms {
    pub fn new() -> Self {
        LatencyHistograms {
            on: std::sync::atomic::AtomicBool::new(false),
            counts: StripedCounters::new([0; KINDS * PER_KIND]),
        }
    }

    pub fn set_on(&self, on: bool) {
        self.on.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Now, if latencies are recorded.
    pub fn start(&self) -> Option<Instant> {
        self.on
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(Instant::now)
    }

    pub fn record(&self, kind: LatencyKind, took: Duration) {
        let us = took.as_micros();
        let bucket = BUCKET_BOUNDS_US
            .iter()
            .position(|&bound| us <= u128::from(bound))
            .unwrap_or(BUCKETS - 1);
        let base = kind as usize * PER_KIND;
        self.counts.add(base + bucket, 1);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.counts.add(base + BUCKETS, nanos);
    }

    /// Records the time from now until the guard is dropped, however the request ends.
    pub fn timer(&self, kind: LatencyKind) -> LatencyTimer<'_> {
        LatencyTimer {
            histograms: self,
            kind,
            started: self.start(),
        }
    }

    pub fn snapshot(&self) -> Vec<LatencyHistogram> {
        let totals = self.counts.totals();
        LatencyKind::ALL
            .iter()
            .map(|&kind| {
                let base = kind as usize * PER_KIND;
                let buckets: Vec<(f64, u64)> = (0..BUCKETS)
                    .map(|b| {
                        let bound = BUCKET_BOUNDS_US
                            .get(b)
                            .map_or(f64::INFINITY, |&us| us as f64 / 1e6);
                        (bound, totals[base + b])
                    })
                    .collect();
                LatencyHistogram {
                    kind,
                    count: buckets.iter().map(|b| b.1).sum(),
                    buckets,
                    sum_seconds: totals[base + BUCKETS] as f64 / 1e9,
                }
            })
            .collect()
    }
}

pub(crate) struct LatencyTimer<'h> {
    histograms: &'h LatencyHistograms,
    kind: LatencyKind,
    started: Option<Instant>,
}

impl Drop for LatencyTimer<'_> {
    fn drop(&mut self) {
        if let Some(started) = self.started {
            self.histograms.record(self.kind, started.elapsed());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_land_in_their_buckets() {
        let h = LatencyHistograms::new();
        assert!(h.start().is_none(), "off until turned on");
        drop(h.timer(LatencyKind::Flush));
        assert_eq!(h.snapshot()[3].count, 0);
        h.set_on(true);
        assert!(h.start().is_some());
        h.record(LatencyKind::ReadHit, Duration::from_micros(20));
        h.record(LatencyKind::ReadHit, Duration::from_micros(300));
        h.record(LatencyKind::ReadHit, Duration::from_secs(10));
        h.record(LatencyKind::Write, Duration::from_millis(3));
        let s = h.snapshot();
        let hit = &s[0];
        assert_eq!(hit.count, 3);
        assert_eq!(hit.buckets[0], (25e-6, 1));
        assert_eq!(hit.buckets[4], (500e-6, 1));
        assert_eq!(hit.buckets[3], (250e-6, 0));
        assert_eq!(hit.buckets.last().copied(), Some((f64::INFINITY, 1)));
        assert!((hit.sum_seconds - 10.00032).abs() < 1e-9);
        assert_eq!(s[2].kind, LatencyKind::Write);
        assert_eq!(s[2].count, 1);
        assert_eq!(s[1].count, 0);
    }
}
