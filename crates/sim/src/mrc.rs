//! Miss-ratio curves for LRU from one pass over a stream of cache-line keys.
//!
//! [`ExactMrc`] computes every reference's LRU stack distance (Mattson et al.): the number of
//! distinct keys referenced since the previous reference to the same key, plus one. A cache
//! of `c` lines hits exactly the references whose distance is at most `c`, so one histogram of
//! distances gives the miss ratio at every size. Each key is remembered at the time of its
//! latest reference, and a counted bitmap of those times gives the number of keys referenced
//! since any time, so a reference costs a hash lookup and a few cache lines, and memory stays
//! proportional to the number of unique keys (about 40 bytes each).
//!
//! [`ShardsMrc`] is SHARDS (Waldspurger et al., "Efficient MRC Construction with SHARDS",
//! FAST'15): it tracks only the keys whose hash falls under a threshold, which samples a
//! fixed fraction of the key space, and scales the sampled distances up by the sampling rate.
//! The fixed-size variant keeps at most `max_keys` keys and lowers the threshold whenever the
//! sample grows past that, so its memory is bounded whatever the trace.
//!
//! SHARDS' error depends on how many keys it samples, not on the rate: its mean absolute error
//! is about 1/√K for K sampled keys (docs/mrc.md has the table on every shared trace, from
//! `examples/mrc_accuracy.rs`; `tests/mrc_shared.rs` checks it). 1% of a trace with about
//! 100,000 unique blocks (1,000 keys) errs by about 0.01, 1% of the small LIRS traces (10 to
//! 100 keys) by 0.05 to 0.3; a fixed-size sample of 65,536 keys stays below 0.008 on every
//! shared trace and seed, and is exact on traces with fewer unique blocks than that.
//! SHARDS_adj ([`Correction::Adjusted`]) helps traces with a few very hot keys and hurts
//! traces that are mostly first references.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// What can go wrong building or comparing curves.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MrcError {
    #[error("SHARDS sampling rate {0} is not in (0, 1]")]
    InvalidRate(f64),
    #[error("SHARDS fixed-size sample must hold at least one key")]
    EmptySample,
    #[error("curves have {left} and {right} points; they must be taken at the same sizes")]
    LengthMismatch { left: usize, right: usize },
    #[error("curves differ in size at point {index}: {left} and {right} cache lines")]
    SizeMismatch { index: usize, left: u64, right: u64 },
    #[error("a curve needs at least one point")]
    EmptyCurve,
}

/// The murmur3 64-bit finaliser: a bijection on `u64` with full avalanche. SHARDS samples a
/// key when its hash is below a threshold, so the hash must spread any key set (block numbers
/// are dense and sequential) uniformly; being a bijection, distinct keys never share a hash.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// Hasher for the key maps. It mixes with an offset so that the map's bucket hash is unrelated
/// to the SHARDS sampling hash: sampled keys all have small sampling hashes, and a map hashing
/// them the same way would put them all in the same buckets.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = fmix64(self.0 ^ u64::from(b) ^ MAP_HASH_OFFSET);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = fmix64(key ^ MAP_HASH_OFFSET);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

const MAP_HASH_OFFSET: u64 = 0x9e37_79b9_7f4a_7c15;

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// A Fenwick (binary indexed) tree of counts: point update and prefix sum in O(log n).
struct Fenwick {
    /// 1-based: `tree[i]` sums the counts of positions `(i - lowbit(i), i]`; `tree[0]` unused.
    tree: Vec<u32>,
}

impl Fenwick {
    /// A tree holding `counts`, built in O(n).
    fn from_counts(counts: &[u32]) -> Fenwick {
        let len = counts.len();
        let mut tree = Vec::with_capacity(len + 1);
        tree.push(0);
        tree.extend_from_slice(counts);
        for i in 1..=len {
            let parent = i + (i & i.wrapping_neg());
            if parent <= len {
                tree[parent] += tree[i];
            }
        }
        Fenwick { tree }
    }

    fn add(&mut self, position: usize, delta: i32) {
        let mut i = position + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// The sum of the counts at positions `0..position` (exclusive).
    fn sum_before(&self, position: usize) -> u32 {
        let mut i = position;
        let mut sum = 0;
        while i > 0 {
            sum += self.tree[i];
            i &= i - 1;
        }
        sum
    }
}

/// Words (of 64 times) per chunk, whose set bits `LiveTimes::chunk_counts` holds.
const CHUNK_WORDS: usize = 8;
/// Chunks per group: 32 `u16` counts fill one cache line.
const GROUP_CHUNKS: usize = 32;
const GROUP_TIMES: usize = 64 * CHUNK_WORDS * GROUP_CHUNKS;

/// A set of times that counts its members at or before a time. A bitmap with set-bit counts
/// per 512-bit chunk and a Fenwick tree over groups of 32 chunks: a count reads one word run
/// and one line of chunk counts, and the group tree is small enough to stay in cache. A
/// Fenwick tree over the times themselves would touch about log2(range) scattered lines per
/// operation, which made one pass over a trace with a million unique blocks several times
/// slower.
struct LiveTimes {
    words: Vec<u64>,
    chunk_counts: Vec<u16>,
    group_counts: Fenwick,
}

impl LiveTimes {
    /// A set over `0..len` (rounded up to whole groups) holding the times `0..members`.
    fn with_leading(len: usize, members: usize) -> LiveTimes {
        let groups = len.div_ceil(GROUP_TIMES).max(1);
        assert!(members <= groups * GROUP_TIMES);
        let mut words = vec![0u64; groups * GROUP_TIMES / 64];
        words[..members / 64].fill(u64::MAX);
        if !members.is_multiple_of(64) {
            words[members / 64] = (1u64 << (members % 64)) - 1;
        }
        let chunk_counts: Vec<u16> = words
            .chunks(CHUNK_WORDS)
            .map(|chunk| chunk.iter().map(|w| w.count_ones() as u16).sum())
            .collect();
        let per_group: Vec<u32> = chunk_counts
            .chunks(GROUP_CHUNKS)
            .map(|group| group.iter().map(|&c| u32::from(c)).sum())
            .collect();
        LiveTimes {
            words,
            chunk_counts,
            group_counts: Fenwick::from_counts(&per_group),
        }
    }

    fn len(&self) -> usize {
        self.words.len() * 64
    }

    fn insert(&mut self, time: usize) {
        let bit = 1u64 << (time % 64);
        debug_assert_eq!(self.words[time / 64] & bit, 0);
        self.words[time / 64] |= bit;
        self.chunk_counts[time / (64 * CHUNK_WORDS)] += 1;
        self.group_counts.add(time / GROUP_TIMES, 1);
    }

    fn remove(&mut self, time: usize) {
        let bit = 1u64 << (time % 64);
        debug_assert_ne!(self.words[time / 64] & bit, 0);
        self.words[time / 64] &= !bit;
        self.chunk_counts[time / (64 * CHUNK_WORDS)] -= 1;
        self.group_counts.add(time / GROUP_TIMES, -1);
    }

    /// How many members are at or before `time`.
    fn count_through(&self, time: usize) -> u32 {
        let (word, chunk, group) = (time / 64, time / (64 * CHUNK_WORDS), time / GROUP_TIMES);
        let through_bit = u64::MAX >> (63 - time % 64);
        let in_word = (self.words[word] & through_bit).count_ones();
        let in_chunk: u32 = self.words[chunk * CHUNK_WORDS..word]
            .iter()
            .map(|w| w.count_ones())
            .sum();
        let in_group: u32 = self.chunk_counts[group * GROUP_CHUNKS..chunk]
            .iter()
            .map(|&c| u32::from(c))
            .sum();
        self.group_counts.sum_before(group) + in_group + in_chunk + in_word
    }
}

/// An LRU stack that reports stack distances. Each key lives at the time of its latest
/// reference, and [`LiveTimes`] marks those times, so the keys referenced after time `t` are
/// counted at once. Times are renumbered (compacted) when they run out, which keeps the time
/// range at most about twice the number of live keys.
struct LruStack {
    time_of: KeyMap<u32>,
    latest: LiveTimes,
    now: usize,
}

impl LruStack {
    fn new() -> LruStack {
        LruStack {
            time_of: KeyMap::default(),
            latest: LiveTimes::with_leading(GROUP_TIMES, 0),
            now: 0,
        }
    }

    fn len(&self) -> usize {
        self.time_of.len()
    }

    /// References `key`: its stack distance (1 for a key referenced twice in a row), or `None`
    /// on its first reference.
    fn reference(&mut self, key: u64) -> Option<u64> {
        if self.now == self.latest.len() {
            self.compact();
        }
        let now = self.now;
        self.now += 1;
        self.latest.insert(now);
        let previous = self.time_of.insert(key, now as u32)? as usize;
        // Marked now: every key's latest time, plus `previous` until it is cleared below.
        let referenced_since = self.len() as u32 - self.latest.count_through(previous);
        self.latest.remove(previous);
        Some(u64::from(referenced_since) + 1)
    }

    /// Forgets `key` (SHARDS dropping it from the sample).
    fn remove(&mut self, key: u64) {
        if let Some(time) = self.time_of.remove(&key) {
            self.latest.remove(time as usize);
        }
    }

    /// Renumbers the live keys' times `0..live`, keeping their order (a key's new time is the
    /// count of live times up to its old one), and sizes the range to twice that.
    fn compact(&mut self) {
        let live = self.len();
        for time in self.time_of.values_mut() {
            *time = self.latest.count_through(*time as usize) - 1;
        }
        self.latest = LiveTimes::with_leading(2 * live, live);
        assert!(self.latest.len() <= 1 << 32, "more keys than u32 times");
        self.now = live;
    }
}

/// One point of a miss-ratio curve.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CurvePoint {
    pub cache_lines: u64,
    pub miss_ratio: f64,
}

/// A histogram of (possibly estimated, possibly weighted) stack distances: the weight of the
/// references a cache of each size hits, the weight of first references (cold misses) and
/// the total. The miss ratio at any size is read from it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReuseHistogram {
    /// Ascending distances; a reference counted at `distances[i]` hits in any cache of at
    /// least that many lines.
    distances: Vec<f64>,
    /// `hits_within[i]`: the weight of the references with distance at most `distances[i]`.
    hits_within: Vec<f64>,
    cold: f64,
    total: f64,
}

impl ReuseHistogram {
    /// From (distance, weight) buckets in ascending distance order.
    fn from_buckets(buckets: impl Iterator<Item = (f64, f64)>, cold: f64, total: f64) -> Self {
        let (mut distances, mut hits_within) = (Vec::new(), Vec::new());
        let mut cumulative = 0.0;
        for (distance, weight) in buckets {
            if weight == 0.0 {
                continue;
            }
            debug_assert!(distances.last().is_none_or(|&d| d < distance));
            cumulative += weight;
            distances.push(distance);
            hits_within.push(cumulative);
        }
        ReuseHistogram {
            distances,
            hits_within,
            cold,
            total,
        }
    }

    /// The (weighted) number of references.
    pub fn references(&self) -> f64 {
        self.total
    }

    /// The (estimated) number of distinct keys: every one of them missed once, cold.
    pub fn unique_keys(&self) -> f64 {
        self.cold
    }

    /// The (weighted) number of references a cache of `cache_lines` lines hits.
    pub fn hits(&self, cache_lines: u64) -> f64 {
        let within = self.distances.partition_point(|&d| d <= cache_lines as f64);
        match within {
            0 => 0.0,
            n => self.hits_within[n - 1],
        }
    }

    /// The LRU miss ratio of a cache of `cache_lines` lines, in [0, 1] (0 for no references).
    pub fn miss_ratio(&self, cache_lines: u64) -> f64 {
        if self.total <= 0.0 {
            return 0.0;
        }
        // (total - hits) / total, not 1 - hits / total: exact counts give the exact quotient.
        ((self.total - self.hits(cache_lines)) / self.total).clamp(0.0, 1.0)
    }

    /// The curve at the given sizes, in their order.
    pub fn curve(&self, sizes: &[u64]) -> Vec<CurvePoint> {
        sizes
            .iter()
            .map(|&cache_lines| CurvePoint {
                cache_lines,
                miss_ratio: self.miss_ratio(cache_lines),
            })
            .collect()
    }
}

/// `count` cache sizes evenly spaced from `footprint / count` to `footprint` lines (rounded
/// up, at least 1, without repeats).
pub fn evenly_spaced_sizes(footprint: u64, count: u64) -> Vec<u64> {
    let mut sizes: Vec<u64> = (1..=count)
        .map(|i| {
            ((u128::from(footprint) * u128::from(i)).div_ceil(u128::from(count)) as u64).max(1)
        })
        .collect();
    sizes.dedup();
    sizes
}

/// The mean of |a - b| over two curves taken at the same sizes.
pub fn mean_absolute_error(a: &[CurvePoint], b: &[CurvePoint]) -> Result<f64, MrcError> {
    if a.len() != b.len() {
        return Err(MrcError::LengthMismatch {
            left: a.len(),
            right: b.len(),
        });
    }
    if a.is_empty() {
        return Err(MrcError::EmptyCurve);
    }
    let mut sum = 0.0;
    for (index, (p, q)) in a.iter().zip(b).enumerate() {
        if p.cache_lines != q.cache_lines {
            return Err(MrcError::SizeMismatch {
                index,
                left: p.cache_lines,
                right: q.cache_lines,
            });
        }
        sum += (p.miss_ratio - q.miss_ratio).abs();
    }
    Ok(sum / a.len() as f64)
}

/// The point-by-point mean of curves taken at the same sizes (for example SHARDS runs with
/// different hash seeds, whose errors are independent).
pub fn average_curves(curves: &[Vec<CurvePoint>]) -> Result<Vec<CurvePoint>, MrcError> {
    let Some(first) = curves.first() else {
        return Err(MrcError::EmptyCurve);
    };
    for curve in &curves[1..] {
        mean_absolute_error(first, curve)?;
    }
    let n = curves.len() as f64;
    Ok((0..first.len())
        .map(|i| CurvePoint {
            cache_lines: first[i].cache_lines,
            miss_ratio: curves.iter().map(|c| c[i].miss_ratio).sum::<f64>() / n,
        })
        .collect())
}

/// The exact LRU miss-ratio curve of a key stream, in one pass.
pub struct ExactMrc {
    stack: LruStack,
    /// `at_distance[d]`: references with stack distance `d` (index 0 unused).
    at_distance: Vec<u64>,
    cold: u64,
    references: u64,
}

impl Default for ExactMrc {
    fn default() -> Self {
        ExactMrc::new()
    }
}

impl ExactMrc {
    pub fn new() -> ExactMrc {
        ExactMrc {
            stack: LruStack::new(),
            at_distance: vec![0],
            cold: 0,
            references: 0,
        }
    }

    /// One reference to the cache line `key`.
    pub fn reference(&mut self, key: u64) {
        self.references += 1;
        match self.stack.reference(key) {
            None => self.cold += 1,
            Some(distance) => {
                let d = distance as usize;
                if d >= self.at_distance.len() {
                    self.at_distance.resize(d + 1, 0);
                }
                self.at_distance[d] += 1;
            }
        }
    }

    pub fn extend(&mut self, keys: impl IntoIterator<Item = u64>) {
        keys.into_iter().for_each(|key| self.reference(key));
    }

    pub fn references(&self) -> u64 {
        self.references
    }

    pub fn unique_keys(&self) -> u64 {
        self.cold
    }

    /// The distance histogram so far. Its weights are exact counts (integers below 2^53).
    pub fn histogram(&self) -> ReuseHistogram {
        let buckets = self
            .at_distance
            .iter()
            .enumerate()
            .map(|(d, &n)| (d as f64, n as f64));
        ReuseHistogram::from_buckets(buckets, self.cold as f64, self.references as f64)
    }
}

/// How SHARDS picks its sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// Sample the keys whose hash falls in a fixed fraction `rate` of the hash space; memory
    /// grows with the trace's unique keys times `rate`.
    FixedRate { rate: f64 },
    /// Start with every key and keep at most `max_keys`: when the sample grows past that, the
    /// key with the largest hash leaves and the threshold drops to its hash.
    FixedSize { max_keys: usize },
}

/// Whether to apply SHARDS_adj: the number of sampled references deviates from its expected
/// value (references × rate), mostly because a few hot keys were or were not sampled; the
/// correction credits the difference to the smallest distance bucket, where hot keys' reuses
/// fall, and normalises by the expected count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Correction {
    None,
    Adjusted,
}

/// How approximate a SHARDS run was.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ShardsStats {
    /// References seen (sampled or not).
    pub references: u64,
    /// References to sampled keys.
    pub sampled_references: u64,
    /// Keys in the sample at the end.
    pub sampled_keys: u64,
    /// The sampling rate at the end: the fraction of the hash space (so of the keys, in
    /// expectation) sampled.
    pub effective_rate: f64,
}

/// Histogram bins SHARDS keeps before it doubles their width: bounded memory whatever the
/// distances, and bins narrow enough (distances up to 256Ki before any merge) that
/// quantisation is far below the sampling error.
const MAX_BINS: usize = 1 << 18;

/// A histogram of weights over distances, in bins that double in width when a distance falls
/// past the last bin. Distances are given in `unit`s, so that integer positions (fixed-rate
/// sampled distances) land in their own bin without rounding.
struct Bins {
    /// `weights[i]` covers positions in `(i * 2^merges, (i + 1) * 2^merges]`.
    weights: Vec<f64>,
    merges: u32,
    /// The distance one position stands for.
    unit: f64,
}

impl Bins {
    fn new(unit: f64) -> Bins {
        Bins {
            weights: Vec::new(),
            merges: 0,
            unit,
        }
    }

    fn bin_of(&self, position: f64) -> usize {
        // Dividing by a power of two is exact, so an integer position k starts in bin k - 1.
        (position / f64::from(1u32 << self.merges)).ceil() as usize - 1
    }

    fn add(&mut self, position: f64, weight: f64) {
        debug_assert!(position >= 1.0);
        let mut bin = self.bin_of(position);
        while bin >= MAX_BINS {
            self.halve_resolution();
            bin = self.bin_of(position);
        }
        if bin >= self.weights.len() {
            self.weights.resize(bin + 1, 0.0);
        }
        self.weights[bin] += weight;
    }

    fn halve_resolution(&mut self) {
        let merged: Vec<f64> = self
            .weights
            .chunks(2)
            .map(|pair| pair.iter().sum())
            .collect();
        self.weights = merged;
        self.merges += 1;
        assert!(self.merges < 31, "distances beyond 2^48 lines");
    }

    /// The largest distance bin `i` holds (a cache that large hits all of it).
    fn upper_distance(&self, bin: usize) -> f64 {
        (bin + 1) as f64 * f64::from(1u32 << self.merges) * self.unit
    }

    fn total(&self) -> f64 {
        self.weights.iter().sum()
    }
}

const SAMPLING_SALT: u64 = 0x243f_6a88_85a3_08d3;

/// 2^64: a threshold of this samples every key.
const HASH_SPACE: u128 = 1 << 64;

/// A SHARDS approximation of the LRU miss-ratio curve.
pub struct ShardsMrc {
    sampling: Sampling,
    seed: u64,
    /// A key is sampled when its hash is below this; at most [`HASH_SPACE`].
    threshold: u128,
    stack: LruStack,
    /// Fixed size only: the sampled keys by hash, largest first, to know which leaves next.
    by_hash: BinaryHeap<(u64, u64)>,
    /// Each sampled reference weighs 1 / (rate when it was sampled), an estimate of the
    /// references it stands for; this equals the paper's rescaling of the histogram by
    /// R_new / R_old at each threshold drop, up to the common factor the normalisation removes.
    bins: Bins,
    cold: f64,
    references: u64,
    sampled_references: u64,
}

impl ShardsMrc {
    /// `seed` selects the hash function (different seeds sample independent key sets).
    pub fn new(sampling: Sampling, seed: u64) -> Result<ShardsMrc, MrcError> {
        let threshold = match sampling {
            Sampling::FixedRate { rate } => {
                if !(rate > 0.0 && rate <= 1.0) {
                    return Err(MrcError::InvalidRate(rate));
                }
                ((rate * HASH_SPACE as f64) as u128).clamp(1, HASH_SPACE)
            }
            Sampling::FixedSize { max_keys: 0 } => return Err(MrcError::EmptySample),
            Sampling::FixedSize { .. } => HASH_SPACE,
        };
        // At a fixed rate, positions are sampled distances and a unit is 1 / rate lines, so
        // each sampled distance has its own bin (until MAX_BINS); a fixed-size sample changes
        // rate, so its positions are distances in lines.
        let unit = match sampling {
            Sampling::FixedRate { .. } => HASH_SPACE as f64 / threshold as f64,
            Sampling::FixedSize { .. } => 1.0,
        };
        Ok(ShardsMrc {
            sampling,
            seed,
            threshold,
            stack: LruStack::new(),
            by_hash: BinaryHeap::new(),
            bins: Bins::new(unit),
            cold: 0.0,
            references: 0,
            sampled_references: 0,
        })
    }

    fn rate(&self) -> f64 {
        self.threshold as f64 / HASH_SPACE as f64
    }

    fn hash(&self, key: u64) -> u64 {
        // Salted: fmix64 maps 0 to 0, which would always sample block 0, often a hot block.
        fmix64(key ^ fmix64(self.seed ^ SAMPLING_SALT))
    }

    /// One reference to the cache line `key`.
    pub fn reference(&mut self, key: u64) {
        self.references += 1;
        let hash = self.hash(key);
        if u128::from(hash) >= self.threshold {
            return;
        }
        self.sampled_references += 1;
        let scale = HASH_SPACE as f64 / self.threshold as f64;
        match self.stack.reference(key) {
            Some(distance) => self.bins.add(self.position(distance, scale), scale),
            None => {
                self.cold += scale;
                if let Sampling::FixedSize { max_keys } = self.sampling {
                    self.by_hash.push((hash, key));
                    if self.stack.len() > max_keys {
                        self.drop_largest_hash();
                    }
                }
            }
        }
    }

    /// Where a sampled distance goes in the bins: it stands for `sampled_distance * scale`
    /// lines, and at a fixed rate the bins' unit is `scale` already.
    fn position(&self, sampled_distance: u64, scale: f64) -> f64 {
        match self.sampling {
            Sampling::FixedRate { .. } => sampled_distance as f64,
            Sampling::FixedSize { .. } => sampled_distance as f64 * scale,
        }
    }

    fn drop_largest_hash(&mut self) {
        let Some((hash, key)) = self.by_hash.pop() else {
            unreachable!("the heap holds every sampled key and the sample is over its size");
        };
        self.stack.remove(key);
        self.threshold = u128::from(hash);
        debug_assert_eq!(self.by_hash.len(), self.stack.len());
    }

    pub fn extend(&mut self, keys: impl IntoIterator<Item = u64>) {
        keys.into_iter().for_each(|key| self.reference(key));
    }

    pub fn stats(&self) -> ShardsStats {
        ShardsStats {
            references: self.references,
            sampled_references: self.sampled_references,
            sampled_keys: self.stack.len() as u64,
            effective_rate: self.rate(),
        }
    }

    /// The estimated distance histogram, normalised by the estimated number of references
    /// (`Correction::None`, the sampled weight) or by the actual number (`Adjusted`).
    pub fn histogram(&self, correction: Correction) -> ReuseHistogram {
        let sampled_total = self.cold + self.bins.total();
        let (total, first_bin_extra) = match correction {
            Correction::None => (sampled_total, 0.0),
            Correction::Adjusted => {
                let expected = self.references as f64;
                (expected, expected - sampled_total)
            }
        };
        // With no reuse at all there is no bin yet, but the adjustment still needs the first.
        let bin_count = self.bins.weights.len().max(1);
        let buckets = (0..bin_count).map(|i| {
            let weight = self.bins.weights.get(i).copied().unwrap_or(0.0);
            let extra = if i == 0 { first_bin_extra } else { 0.0 };
            (self.bins.upper_distance(i), weight + extra)
        });
        ReuseHistogram::from_buckets(buckets, self.cold, total)
    }
}

#[cfg(test)]
mod tests;
