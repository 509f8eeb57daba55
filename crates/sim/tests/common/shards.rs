//! SHARDS against an exact curve, over several hash seeds (the miss-ratio curve tests).

use ssdcache_sim::mrc::{mean_absolute_error, Correction, CurvePoint, Sampling, ShardsMrc};

struct Run {
    pub error: f64,
    pub sampled_keys: f64,
    pub exact: bool,
}

fn shards_runs(keys: &[u64], sampling: Sampling, seeds: u64, reference: &[CurvePoint]) -> Vec<Run> {
    let sizes: Vec<u64> = reference.iter().map(|p| p.cache_lines).collect();
    (0..seeds)
        .map(|seed| {
            let mut shards = ShardsMrc::new(sampling, seed).expect("valid sampling");
            shards.extend(keys.iter().copied());
            let curve = shards.histogram(Correction::None).curve(&sizes);
            Run {
                error: mean_absolute_error(reference, &curve).expect("same sizes"),
                sampled_keys: shards.stats().sampled_keys as f64,
                exact: shards.stats().effective_rate == 1.0,
            }
        })
        .collect()
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, count) = values.fold((0.0, 0), |(s, n), v| (s + v, n + 1));
    sum / f64::from(count)
}

/// `ssdcache mrc`'s default fixed-size sample (`--max-keys`).
pub const DEFAULT_MAX_KEYS: usize = 65_536;
const RATE_SEEDS: u64 = 10;
const SIZE_SEEDS: u64 = 3;

/// The mean errors of SHARDS on one trace.
pub struct Errors {
    pub unique: u64,
    /// Fixed rate 1%: mean MAE over the seeds, and the mean number of keys sampled.
    pub rate_mean: f64,
    pub rate_keys: f64,
    /// Fixed size `DEFAULT_MAX_KEYS`: mean MAE over the seeds.
    pub size_mean: f64,
}

impl std::fmt::Display for Errors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} unique, rate 1% {:.4} ({:.0} keys), size {DEFAULT_MAX_KEYS} {:.4}",
            self.unique, self.rate_mean, self.rate_keys, self.size_mean
        )
    }
}

/// Asserts the bounds docs/mrc.md states for SHARDS against the exact curve `reference` of
/// `keys` (`unique` distinct keys): fixed size `DEFAULT_MAX_KEYS` errs by at most 0.01 for
/// every seed, and is exact when it holds every key; fixed rate 1% errs by at most 1.5/√K on
/// average over the seeds and 3.5/√K for each seed, K the keys sampled. A fixed-size pass over
/// a trace with more unique keys than the sample costs about as much as the exact pass, so it
/// runs with fewer seeds than the cheap fixed-rate pass, and only one where the sample holds
/// every key (then the seed does not matter).
pub fn check_shards_bounds(
    name: &str,
    keys: &[u64],
    unique: u64,
    reference: &[CurvePoint],
) -> Errors {
    let whole_sample = unique as usize <= DEFAULT_MAX_KEYS;
    let fixed_size = shards_runs(
        keys,
        Sampling::FixedSize {
            max_keys: DEFAULT_MAX_KEYS,
        },
        if whole_sample { 1 } else { SIZE_SEEDS },
        reference,
    );
    for (seed, run) in fixed_size.iter().enumerate() {
        assert!(
            run.error <= 0.01,
            "{name}: fixed size {DEFAULT_MAX_KEYS}, seed {seed}: MAE {}",
            run.error
        );
        if whole_sample {
            assert!(run.exact && run.error == 0.0, "{name}: sample of all keys");
        }
    }

    let rate = shards_runs(
        keys,
        Sampling::FixedRate { rate: 0.01 },
        RATE_SEEDS,
        reference,
    );
    let rate_mean = mean(rate.iter().map(|r| r.error));
    let rate_keys = mean(rate.iter().map(|r| r.sampled_keys));
    assert!(
        rate_mean <= 1.5 / rate_keys.sqrt(),
        "{name}: rate 1%: mean MAE {rate_mean} with {rate_keys} keys"
    );
    for (seed, run) in rate.iter().enumerate() {
        assert!(
            run.error <= 3.5 / run.sampled_keys.max(1.0).sqrt(),
            "{name}: rate 1%, seed {seed}: MAE {} with {} keys",
            run.error,
            run.sampled_keys
        );
    }
    Errors {
        unique,
        rate_mean,
        rate_keys,
        size_mean: mean(fixed_size.iter().map(|r| r.error)),
    }
}
