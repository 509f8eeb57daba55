use super::*;
use proptest::prelude::*;
use ssdcache_engine::policy::{simulate_hits, Lru};

/// Hits of the engine's own LRU over `keys` with a cache of `lines` lines.
fn lru_hits(keys: &[u64], lines: u32) -> u64 {
    simulate_hits(&mut Lru::new(lines), lines, keys.iter().copied()).0
}

fn exact(keys: &[u64]) -> ReuseHistogram {
    let mut mrc = ExactMrc::new();
    mrc.extend(keys.iter().copied());
    mrc.histogram()
}

fn shards(keys: &[u64], sampling: Sampling, seed: u64) -> ShardsMrc {
    let mut mrc = ShardsMrc::new(sampling, seed).expect("valid sampling");
    mrc.extend(keys.iter().copied());
    mrc
}

/// A uniform number in [0, 1) from a counter: the hash is a bijection with full avalanche.
fn uniform(counter: u64) -> f64 {
    (fmix64(counter) >> 11) as f64 / (1u64 << 53) as f64
}

/// A skewed (power-law) stream over `keys` keys with occasional sequential runs, as block
/// traces have: `u^3` puts most references on the low keys.
fn zipfish(references: usize, keys: u64, seed: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(references);
    let mut i = seed << 32;
    while out.len() < references {
        i += 1;
        let start = (uniform(i).powi(3) * keys as f64) as u64;
        let run = if uniform(i ^ 0x5555) < 0.05 { 16 } else { 1 };
        out.extend(
            (start..start + run)
                .map(|k| k % keys)
                .take(references - out.len()),
        );
    }
    out
}

fn assert_matches_engine_lru(keys: &[u64], sizes: &[u32]) {
    let histogram = exact(keys);
    for &lines in sizes {
        let hits = lru_hits(keys, lines);
        assert_eq!(
            histogram.hits(u64::from(lines)),
            hits as f64,
            "{lines} lines"
        );
        let misses = (keys.len() as u64 - hits) as f64 / keys.len() as f64;
        assert_eq!(
            histogram.miss_ratio(u64::from(lines)),
            misses,
            "{lines} lines"
        );
    }
}

#[test]
fn stack_distances_of_a_short_stream() {
    let mut stack = LruStack::new();
    let distances: Vec<Option<u64>> = [1, 2, 1, 1, 3, 2, 1]
        .into_iter()
        .map(|k| stack.reference(k))
        .collect();
    assert_eq!(
        distances,
        [None, None, Some(2), Some(1), None, Some(3), Some(3)]
    );
    stack.remove(3);
    assert_eq!(stack.reference(1), Some(1));
    assert_eq!(stack.reference(2), Some(2), "3 no longer counts");
    assert_eq!(stack.reference(3), None);
}

#[test]
fn live_times_count_their_members() {
    for members in [
        0,
        1,
        63,
        64,
        65,
        511,
        512,
        513,
        GROUP_TIMES,
        GROUP_TIMES + 1,
    ] {
        let len = 3 * GROUP_TIMES;
        let mut times = LiveTimes::with_leading(len, members);
        assert_eq!(times.len(), len);
        for time in [
            0,
            1,
            62,
            63,
            64,
            511,
            512,
            GROUP_TIMES - 1,
            GROUP_TIMES,
            len - 1,
        ] {
            assert_eq!(times.count_through(time) as usize, (time + 1).min(members));
        }
        times.insert(len - 1);
        times.insert(2 * GROUP_TIMES + 5);
        assert_eq!(times.count_through(len - 2) as usize, members + 1);
        assert_eq!(times.count_through(len - 1) as usize, members + 2);
        times.remove(2 * GROUP_TIMES + 5);
        assert_eq!(times.count_through(len - 1) as usize, members + 1);
    }
}

#[test]
fn exact_curve_of_loops_matches_engine_lru() {
    // A loop over more keys than the cache misses every time under LRU; one that fits hits
    // after the first pass. 10,000 keys x 3 passes also compacts the time range.
    let keys: Vec<u64> = (0..3).flat_map(|_| 0..10_000u64).collect();
    let histogram = exact(&keys);
    assert_eq!(histogram.miss_ratio(9_999), 1.0);
    assert_eq!(histogram.miss_ratio(10_000), 1.0 / 3.0);
    assert_eq!(histogram.unique_keys(), 10_000.0);
    assert_matches_engine_lru(&keys, &[1, 5_000, 9_999, 10_000, 20_000]);

    let nested: Vec<u64> = (0..40u64)
        .flat_map(|pass| (0..500u64).chain((0..50).map(move |k| 1_000 + (k + pass) % 60)))
        .collect();
    assert_matches_engine_lru(&nested, &[1, 50, 59, 60, 61, 500, 559, 560, 561, 600]);
}

#[test]
fn exact_curve_of_a_long_random_stream_matches_engine_lru() {
    let keys = zipfish(60_000, 5_000, 1);
    assert_matches_engine_lru(&keys, &[1, 10, 100, 1_000, 2_500, 4_999, 5_000]);
}

#[test]
fn empty_stream_has_zero_miss_ratio() {
    let histogram = exact(&[]);
    assert_eq!(histogram.miss_ratio(10), 0.0);
    assert_eq!(histogram.references(), 0.0);
    let histogram = shards(&[], Sampling::FixedRate { rate: 0.5 }, 0);
    assert_eq!(
        histogram.histogram(Correction::Adjusted).miss_ratio(10),
        0.0
    );
}

#[test]
fn invalid_sampling_is_refused() {
    for rate in [0.0, -0.5, 1.5, f64::NAN] {
        assert!(matches!(
            ShardsMrc::new(Sampling::FixedRate { rate }, 0),
            Err(MrcError::InvalidRate(_))
        ));
    }
    assert_eq!(
        ShardsMrc::new(Sampling::FixedSize { max_keys: 0 }, 0).err(),
        Some(MrcError::EmptySample)
    );
}

#[test]
fn shards_samples_about_its_rate_of_keys() {
    let keys: Vec<u64> = (0..200_000).collect();
    let run = shards(&keys, Sampling::FixedRate { rate: 0.01 }, 7);
    let stats = run.stats();
    assert_eq!(stats.references, 200_000);
    assert!((1_800..2_200).contains(&stats.sampled_keys), "{stats:?}");
    assert_eq!(stats.sampled_keys, stats.sampled_references);
    assert!((stats.effective_rate - 0.01).abs() < 1e-12);

    let run = shards(&keys, Sampling::FixedSize { max_keys: 1_000 }, 7);
    let stats = run.stats();
    assert_eq!(stats.sampled_keys, 1_000);
    assert!((0.004..0.006).contains(&stats.effective_rate), "{stats:?}");
    let estimated = run.histogram(Correction::None).unique_keys();
    assert!((180_000.0..220_000.0).contains(&estimated), "{estimated}");
}

/// The paper's accuracy claim, MAE at most 0.01 at 1% sampling, holds for traces with many
/// keys: here 2M references to 692k keys, about 7,000 sampled. The stream's hottest keys take
/// a large share of references, so whether they are sampled swings the unadjusted estimate;
/// SHARDS_adj corrects that. Over hash seeds 0..30 the mean MAE is 0.029 unadjusted and
/// 0.0075 adjusted at fixed rate, 0.022 and 0.0046 at fixed size; the worst seeds' adjusted
/// MAE is 0.018 and 0.015, so one seed is one draw and this checks a typical one.
#[test]
fn shards_on_a_large_skewed_stream_is_within_one_percent() {
    let footprint = 1_000_000u64;
    let keys = zipfish(2_000_000, footprint, 2);
    let exact = exact(&keys);
    let unique = exact.unique_keys() as u64;
    let sizes = evenly_spaced_sizes(unique, 100);
    let reference = exact.curve(&sizes);
    let samplings = [
        Sampling::FixedRate { rate: 0.01 },
        Sampling::FixedSize {
            max_keys: (unique / 100) as usize,
        },
    ];
    for sampling in samplings {
        let run = shards(&keys, sampling, 3);
        let [unadjusted, adjusted] = [Correction::None, Correction::Adjusted].map(|correction| {
            let curve = run.histogram(correction).curve(&sizes);
            mean_absolute_error(&reference, &curve).expect("same sizes")
        });
        let stats = run.stats();
        assert!(adjusted <= 0.01, "{sampling:?}: MAE {adjusted} ({stats:?})");
        assert!(
            adjusted < unadjusted,
            "{sampling:?}: {adjusted} vs {unadjusted}"
        );
        assert!((0.009..0.011).contains(&stats.effective_rate), "{stats:?}");
    }
}

#[test]
fn averaging_seeds_reduces_the_error_of_a_small_sample() {
    let keys = zipfish(200_000, 20_000, 4);
    let exact = exact(&keys);
    let sizes = evenly_spaced_sizes(20_000, 50);
    let reference = exact.curve(&sizes);
    let curves: Vec<Vec<CurvePoint>> = (0..16)
        .map(|seed| {
            shards(&keys, Sampling::FixedRate { rate: 0.01 }, seed)
                .histogram(Correction::Adjusted)
                .curve(&sizes)
        })
        .collect();
    let single: f64 = curves
        .iter()
        .map(|c| mean_absolute_error(&reference, c).expect("same sizes"))
        .sum::<f64>()
        / curves.len() as f64;
    let averaged = mean_absolute_error(&reference, &average_curves(&curves).expect("same sizes"))
        .expect("same sizes");
    assert!(averaged < single, "averaged {averaged}, single {single}");
}

#[test]
fn shards_bins_merge_without_losing_weight() {
    let mut bins = Bins::new(1.0);
    bins.add(1.0, 1.0);
    bins.add(MAX_BINS as f64, 2.0);
    assert_eq!(bins.merges, 0);
    bins.add(MAX_BINS as f64 + 1.0, 4.0);
    assert_eq!(bins.merges, 1);
    assert_eq!(bins.total(), 7.0);
    assert_eq!(bins.weights[0], 1.0);
    assert_eq!(bins.upper_distance(0), 2.0);
    assert_eq!(*bins.weights.last().expect("bins"), 4.0);
}

#[test]
fn curve_helpers_check_their_inputs() {
    assert_eq!(evenly_spaced_sizes(10, 4), [3, 5, 8, 10]);
    assert_eq!(evenly_spaced_sizes(2, 4), [1, 2]);
    let a = [
        CurvePoint {
            cache_lines: 1,
            miss_ratio: 0.5,
        },
        CurvePoint {
            cache_lines: 2,
            miss_ratio: 0.25,
        },
    ];
    let mut b = a;
    b[1].miss_ratio = 0.75;
    assert_eq!(mean_absolute_error(&a, &b), Ok(0.25));
    assert_eq!(
        mean_absolute_error(&a, &b[..1]),
        Err(MrcError::LengthMismatch { left: 2, right: 1 })
    );
    b[1].cache_lines = 3;
    assert_eq!(
        mean_absolute_error(&a, &b),
        Err(MrcError::SizeMismatch {
            index: 1,
            left: 2,
            right: 3
        })
    );
    assert_eq!(mean_absolute_error(&[], &[]), Err(MrcError::EmptyCurve));
}

proptest! {
    #[test]
    fn exact_curve_matches_engine_lru(
        keys in prop::collection::vec(0..80u64, 0..600),
        sizes in prop::collection::vec(1..90u32, 1..6),
    ) {
        let histogram = exact(&keys);
        for &lines in &sizes {
            prop_assert_eq!(histogram.hits(u64::from(lines)), lru_hits(&keys, lines) as f64);
        }
    }

    #[test]
    fn shards_at_full_rate_is_exact(
        keys in prop::collection::vec(0..200u64, 0..600),
        seed in any::<u64>(),
    ) {
        let expected = exact(&keys);
        let sizes: Vec<u64> = (1..=210).collect();
        let full_rate = shards(&keys, Sampling::FixedRate { rate: 1.0 }, seed);
        let large_enough = shards(&keys, Sampling::FixedSize { max_keys: 200 }, seed);
        for run in [full_rate, large_enough] {
            prop_assert_eq!(run.stats().effective_rate, 1.0);
            for correction in [Correction::None, Correction::Adjusted] {
                prop_assert_eq!(run.histogram(correction).curve(&sizes), expected.curve(&sizes));
            }
        }
    }
}
