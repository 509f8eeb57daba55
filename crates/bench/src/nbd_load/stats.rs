//! Per-operation counts, bytes and latency percentiles.

use std::fmt::Write as _;
use std::time::Duration;

/// Sub-buckets per power of two: latencies are kept to within 1/32 (about 3%).
const SUB_BUCKETS: u64 = 32;
/// Microseconds below this get a bucket each.
const LINEAR_LIMIT: u64 = 2 * SUB_BUCKETS;
/// Octaves above the linear range: up to 2^40 µs (12 days), far past any I/O timeout.
const OCTAVES: u64 = 40;
const BUCKETS: usize = (LINEAR_LIMIT + OCTAVES * SUB_BUCKETS) as usize;

/// A fixed-size log-linear histogram of microseconds (no allocation after creation).
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
        }
    }
}

fn bucket_of(micros: u64) -> usize {
    if micros < LINEAR_LIMIT {
        return micros as usize;
    }
    let octave = u64::from(63 - micros.leading_zeros()) - u64::from(LINEAR_LIMIT.trailing_zeros());
    let sub = (micros >> (octave + 1)) - SUB_BUCKETS;
    let index = LINEAR_LIMIT + octave * SUB_BUCKETS + sub;
    (index as usize).min(BUCKETS - 1)
}

/// The smallest value of a bucket.
fn bucket_floor(index: usize) -> u64 {
    let index = index as u64;
    if index < LINEAR_LIMIT {
        return index;
    }
    let octave = (index - LINEAR_LIMIT) / SUB_BUCKETS;
    let sub = (index - LINEAR_LIMIT) % SUB_BUCKETS;
    (SUB_BUCKETS + sub) << (octave + 1)
}

impl Histogram {
    pub fn record(&mut self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.counts[bucket_of(micros)] += 1;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The latency below which `quantile` (0..=1) of the samples lie, in microseconds.
    pub fn quantile(&self, quantile: f64) -> u64 {
        let total = self.count();
        let rank = ((total as f64 * quantile).ceil() as u64).clamp(1, total.max(1));
        let mut seen = 0;
        for (index, count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return bucket_floor(index);
            }
        }
        0
    }
}

/// The operations the load test sends, as reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
    WriteFua,
    Trim,
    Zeroes,
    Flush,
}

pub const OP_KINDS: [OpKind; 6] = [
    OpKind::Read,
    OpKind::Write,
    OpKind::WriteFua,
    OpKind::Trim,
    OpKind::Zeroes,
    OpKind::Flush,
];

impl OpKind {
    fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::WriteFua => "write+fua",
            OpKind::Trim => "trim",
            OpKind::Zeroes => "write-zeroes",
            OpKind::Flush => "flush",
        }
    }
}

/// Counts, bytes and latencies per operation.
#[derive(Clone, Default)]
pub struct OpStats {
    per_op: [(u64, Histogram); OP_KINDS.len()],
}

impl OpStats {
    pub fn record(&mut self, kind: OpKind, bytes: u64, latency: Duration) {
        let (total_bytes, histogram) = &mut self.per_op[kind.index()];
        *total_bytes += bytes;
        histogram.record(latency);
    }

    pub fn merge(&mut self, other: &OpStats) {
        for (mine, theirs) in self.per_op.iter_mut().zip(&other.per_op) {
            mine.0 += theirs.0;
            mine.1.merge(&theirs.1);
        }
    }

    pub fn requests(&self) -> u64 {
        self.per_op.iter().map(|(_, h)| h.count()).sum()
    }

    /// Bytes moved by READ and WRITE (TRIM and WRITE_ZEROES carry none).
    pub fn data_bytes(&self) -> u64 {
        let data = [OpKind::Read, OpKind::Write, OpKind::WriteFua];
        data.iter().map(|k| self.per_op[k.index()].0).sum()
    }

    /// One line per operation: count, rate, MiB/s, p50, p99, max bucket.
    pub fn report(&self, seconds: f64) -> String {
        let mut out = String::new();
        let seconds = seconds.max(1e-9);
        for kind in OP_KINDS {
            let (bytes, histogram) = &self.per_op[kind.index()];
            let count = histogram.count();
            if count == 0 {
                continue;
            }
            let _ = writeln!(
                out,
                "  {:<13} {:>10} requests {:>9.0}/s {:>9.1} MiB/s   p50 {:>8} µs   p99 {:>8} µs   p99.9 {:>8} µs",
                kind.name(),
                count,
                count as f64 / seconds,
                *bytes as f64 / seconds / (1 << 20) as f64,
                histogram.quantile(0.5),
                histogram.quantile(0.99),
                histogram.quantile(0.999),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_close() {
        let mut last = 0;
        for micros in (0..200_000u64).chain([1 << 30, 1 << 39]) {
            let bucket = bucket_of(micros);
            assert!(bucket >= last, "{micros}");
            last = bucket;
            let floor = bucket_floor(bucket);
            assert!(
                floor <= micros && micros - floor <= micros / 16,
                "{micros} -> {floor}"
            );
        }
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        let mut h = Histogram::default();
        for micros in 1..=1000u64 {
            h.record(Duration::from_micros(micros));
        }
        assert_eq!(h.count(), 1000);
        let p50 = h.quantile(0.5);
        assert!((480..=500).contains(&p50), "{p50}");
        let p99 = h.quantile(0.99);
        assert!((960..=990).contains(&p99), "{p99}");
        assert_eq!(Histogram::default().quantile(0.5), 0);
    }
}
