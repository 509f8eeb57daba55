//! Measures SHARDS against the exact LRU miss-ratio curve on every shared trace, read by the
//! crate's own trace readers; docs/mrc.md quotes its output.
//!
//! `SSDCACHE_TRACES=DIR cargo run --release -p ssdcache-sim --example mrc_accuracy [SEEDS] [MAX_KEYS,...]`
//! (DIR: the shared traces folder; a relative path is taken from the workspace root)
//!
//! Every request is split into the 4 KiB blocks it touches, one reference each (what
//! `ssdcache mrc` does). For each trace it prints the mean absolute error against the exact
//! curve over 100 sizes evenly spaced from 1% to 100% of the unique blocks, as "mean / max"
//! over SEEDS hash seeds (default 20; one seed is one random sample, and on a small trace the
//! error of one draw says little), for fixed-rate 1% and for fixed-size samples of each
//! MAX_KEYS (default 8192,16384,32768,65536), each without and with SHARDS_adj, and the sampled
//! keys (mean over seeds). A summary gives the largest MAE × √(sampled keys): the constant of
//! the error `ssdcache mrc` states.
//!
//! A second table measures what a recording sampled by region (`serve --record-trace
//! --record-sample`) does to the curve: requests are kept when their first region is picked by
//! the recorder's own sampler (seeds vary the volume names it hashes), the kept trace's exact
//! curve is read at sizes scaled by the rate, and compared with the whole trace's.

#[path = "../tests/common/shared_traces.rs"]
mod shared_traces;

use shared_traces::{traces_dir, SHARED_TRACES, TRACES_VAR};
use ssdcache_sim::mrc::{
    evenly_spaced_sizes, mean_absolute_error, Correction, CurvePoint, ExactMrc, Sampling, ShardsMrc,
};
use ssdcache_sim::trace::{self, block_keys, Format, Request};
use ssdcache_trace::record::{volume_hash, Sampler};
use std::collections::HashSet;
use std::error::Error;
use std::path::Path;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const LINE_SIZE: u64 = 4096;
/// The region `serve --record-trace` samples by (its default).
const RECORDER_REGION: u64 = 1 << 20;

fn read_requests(path: &Path, format: Format) -> Result<Vec<Request>> {
    let mut requests = Vec::new();
    for request in trace::open(path, format)? {
        requests.push(request?);
    }
    Ok(requests)
}

fn block_references<'a>(requests: impl IntoIterator<Item = &'a Request>) -> Vec<u64> {
    requests
        .into_iter()
        .flat_map(|request| block_keys(request, LINE_SIZE))
        .collect()
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(0.0, f64::max)
}

fn mean_max(values: &[f64]) -> String {
    format!("{:.4} / {:.4}", mean(values), max(values))
}

/// The errors of one SHARDS configuration over several hash seeds.
struct Spread {
    unadjusted: Vec<f64>,
    adjusted: Vec<f64>,
    sampled_keys: Vec<f64>,
    /// Whether some seed's sample held fewer keys than the trace has (it is not exact).
    sampled: bool,
}

fn over_seeds(
    keys: &[u64],
    sampling: Sampling,
    seeds: u64,
    reference: &[CurvePoint],
    sizes: &[u64],
) -> Result<Spread> {
    let mut spread = Spread {
        unadjusted: vec![],
        adjusted: vec![],
        sampled_keys: vec![],
        sampled: false,
    };
    for seed in 0..seeds {
        let mut run = ShardsMrc::new(sampling, seed)?;
        run.extend(keys.iter().copied());
        let curve = |correction| run.histogram(correction).curve(sizes);
        spread
            .unadjusted
            .push(mean_absolute_error(reference, &curve(Correction::None))?);
        spread.adjusted.push(mean_absolute_error(
            reference,
            &curve(Correction::Adjusted),
        )?);
        spread.sampled_keys.push(run.stats().sampled_keys as f64);
        spread.sampled |= run.stats().effective_rate < 1.0;
    }
    Ok(spread)
}

/// The largest MAE × √(sampled keys) seen: of a mean over seeds, and of one seed.
#[derive(Default)]
struct Constants {
    of_mean: (f64, String),
    of_one: (f64, String),
}

impl Constants {
    fn add(&mut self, spread: &Spread, what: &str) {
        if !spread.sampled {
            return;
        }
        let root_keys = mean(&spread.sampled_keys).sqrt();
        let of_mean = mean(&spread.unadjusted) * root_keys;
        if of_mean > self.of_mean.0 {
            self.of_mean = (of_mean, what.to_owned());
        }
        for (error, keys) in spread.unadjusted.iter().zip(&spread.sampled_keys) {
            let of_one = error * keys.sqrt();
            if of_one > self.of_one.0 {
                self.of_one = (of_one, what.to_owned());
            }
        }
    }
}

fn measure(
    name: &str,
    keys: &[u64],
    seeds: u64,
    max_keys: &[usize],
    constants: &mut Constants,
) -> Result<()> {
    let started = Instant::now();
    let mut exact = ExactMrc::new();
    exact.extend(keys.iter().copied());
    let exact_seconds = started.elapsed().as_secs_f64();
    let unique = exact.unique_keys();
    let sizes = evenly_spaced_sizes(unique, 100);
    let reference = exact.histogram().curve(&sizes);

    let one_percent = Sampling::FixedRate { rate: 0.01 };
    let rate = over_seeds(keys, one_percent, seeds, &reference, &sizes)?;
    constants.add(&rate, &format!("{name} rate 1%"));
    let mut row = format!(
        "| {name} | {} | {unique} | {exact_seconds:.2} | {:.0} | {} | {} |",
        keys.len(),
        mean(&rate.sampled_keys),
        mean_max(&rate.unadjusted),
        mean_max(&rate.adjusted),
    );
    for &max_keys in max_keys {
        let fixed = over_seeds(
            keys,
            Sampling::FixedSize { max_keys },
            seeds,
            &reference,
            &sizes,
        )?;
        constants.add(&fixed, &format!("{name} size {max_keys}"));
        row += &format!(
            " {} | {} |",
            mean_max(&fixed.unadjusted),
            mean_max(&fixed.adjusted)
        );
    }
    println!("{row}");
    Ok(())
}

/// The exact curve of the requests a recorder sampling `rate` of `region`-byte regions keeps,
/// against the whole trace's, over `seeds` samples: MAE mean / max and sampled regions.
fn region_sampling(
    name: &str,
    requests: &[Request],
    region: u64,
    rate: f64,
    seeds: u64,
) -> Result<()> {
    let mut whole = ExactMrc::new();
    whole.extend(block_references(requests));
    let sizes = evenly_spaced_sizes(whole.unique_keys(), 100);
    let reference = whole.histogram().curve(&sizes);
    let sampler = Sampler::new(rate, region)?;
    let (mut errors, mut regions) = (vec![], vec![]);
    for seed in 0..seeds {
        let volume_hashes: Vec<u64> = (0..=requests.iter().map(|r| r.volume).max().unwrap_or(0))
            .map(|volume| volume_hash(&format!("seed{seed}/volume{volume}")))
            .collect();
        let kept: Vec<&Request> = requests
            .iter()
            .filter(|r| sampler.sampled(volume_hashes[r.volume as usize], r.offset))
            .collect();
        let distinct: HashSet<(u32, u64)> =
            kept.iter().map(|r| (r.volume, r.offset / region)).collect();
        let mut sampled = ExactMrc::new();
        sampled.extend(block_references(kept));
        let histogram = sampled.histogram();
        // A cache of `lines` for the whole trace is `lines × rate` for the kept part.
        let curve: Vec<CurvePoint> = sizes
            .iter()
            .map(|&lines| CurvePoint {
                cache_lines: lines,
                miss_ratio: histogram.miss_ratio((lines as f64 * rate).round() as u64),
            })
            .collect();
        errors.push(mean_absolute_error(&reference, &curve)?);
        regions.push(distinct.len() as f64);
    }
    let mean_regions = mean(&regions);
    println!(
        "| {name} | {} KiB | {rate} | {mean_regions:.0} | {} | {:.2} / {:.2} |",
        region / 1024,
        mean_max(&errors),
        mean(&errors) * mean_regions.sqrt(),
        max(&errors) * mean_regions.sqrt(),
    );
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let seeds: u64 = args.next().map_or(Ok(20), |s| s.parse())?;
    if seeds == 0 {
        return Err("SEEDS must be at least 1".into());
    }
    let max_keys: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "8192,16384,32768,65536".into())
        .split(',')
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    let dir = traces_dir().ok_or(format!(
        "{TRACES_VAR} is not set: set it to the shared traces folder"
    ))?;

    println!(
        "MAE against exact LRU over 100 evenly spaced sizes, mean / max over {seeds} hash seeds"
    );
    let mut header = String::from(
        "| trace | references | unique | exact s | keys at 1% | rate 1% | rate 1% adj |",
    );
    for k in &max_keys {
        header += &format!(" size {k} | size {k} adj |");
    }
    println!("{header}");
    println!("{}", "|---".repeat(7 + 2 * max_keys.len()) + "|");
    let mut constants = Constants::default();
    let mut traces = Vec::new();
    for &(relative, format) in SHARED_TRACES {
        let requests = read_requests(&dir.join(relative), format)?;
        let name = relative.split('.').next().unwrap_or(relative);
        measure(
            name,
            &block_references(&requests),
            seeds,
            &max_keys,
            &mut constants,
        )?;
        traces.push((name, requests));
    }
    println!(
        "\nLargest MAE × √(sampled keys), without adj, where the sample is not the whole trace: \
         {:.2} for a mean over seeds ({}), {:.2} for one seed ({})",
        constants.of_mean.0, constants.of_mean.1, constants.of_one.0, constants.of_one.1
    );

    println!("\nRegion-sampled recordings: MAE of the kept trace's exact curve (sizes × rate) against the whole trace's, mean / max over {seeds} samples");
    println!("| trace | region | rate | regions kept | MAE | MAE × √regions (mean / max) |");
    println!("|---|---|---|---|---|---|");
    for (name, requests) in &traces {
        // Only traces of at least 100,000 unique blocks (400 MiB) span enough 1 MiB regions.
        let unique: HashSet<u64> = block_references(requests.iter()).into_iter().collect();
        if unique.len() < 100_000 {
            continue;
        }
        for rate in [0.5, 0.2, 0.1] {
            region_sampling(name, requests, RECORDER_REGION, rate, seeds)?;
        }
    }
    Ok(())
}
