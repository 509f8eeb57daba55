//! Measures SHARDS against the exact LRU miss-ratio curve on the shared traces.
//!
//! `cargo run --release -p ssdcache-sim --example mrc_accuracy [TRACES_DIR] [SEEDS]`
//!
//! Every request is split into the 4 KiB blocks it touches, one reference each. For each
//! trace it prints the mean absolute error against the exact curve, over 100 sizes evenly
//! spaced from 1% to 100% of the unique blocks, as "mean / max" over SEEDS hash seeds
//! (default 20): one seed is one random sample, and on a small trace the error of one draw
//! says little. Configurations: fixed-rate 1% without and with SHARDS_adj; the mean of 10
//! fixed-rate 1% curves with different seeds (each group of 10 seeds is one estimate);
//! fixed-size with 8192 keys, and with 1% of the unique blocks.
//!
//! The parsers here are minimal stand-ins with just enough checking for these files; the
//! crate's trace readers are the real thing.

use ssdcache_sim::mrc::{
    average_curves, evenly_spaced_sizes, mean_absolute_error, Correction, CurvePoint, ExactMrc,
    Sampling, ShardsMrc,
};
use std::error::Error;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const BLOCK: u64 = 4096;
const SECTOR: u64 = 512;

/// The 4 KiB blocks `[offset, offset + len)` touches, tagged with the device.
fn push_blocks(keys: &mut Vec<u64>, device: u64, offset: u64, len: u64) {
    if len == 0 {
        return;
    }
    let (first, last) = (offset / BLOCK, (offset + len - 1) / BLOCK);
    keys.extend((first..=last).map(|block| device << 48 | block));
}

fn lines(path: &Path) -> Result<Vec<String>> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let reader: Box<dyn Read> = match path.extension().and_then(|e| e.to_str()) {
        Some("zst") => Box::new(zstd::Decoder::new(file)?),
        Some("gz") => Box::new(flate2::read::GzDecoder::new(file)),
        _ => Box::new(file),
    };
    let lines: std::io::Result<Vec<String>> = BufReader::new(reader).lines().collect();
    Ok(lines.map_err(|e| format!("{}: {e}", path.display()))?)
}

fn field(fields: &[&str], index: usize, path: &Path, line: usize) -> Result<u64> {
    let text = fields.get(index).ok_or_else(|| {
        format!(
            "{}:{line}: expected at least {} fields",
            path.display(),
            index + 1
        )
    })?;
    let parsed = text.trim().parse().map_err(|e| {
        format!(
            "{}:{line}: field {}: {text:?}: {e}",
            path.display(),
            index + 1
        )
    })?;
    Ok(parsed)
}

/// ARC `.lis`: `start_sector sectors ignored request_number`.
fn arc(path: &Path) -> Result<Vec<u64>> {
    let mut keys = Vec::new();
    for (i, line) in lines(path)?.iter().enumerate() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (start, sectors) = (
            field(&fields, 0, path, i + 1)?,
            field(&fields, 1, path, i + 1)?,
        );
        push_blocks(&mut keys, 0, start * SECTOR, sectors * SECTOR);
    }
    Ok(keys)
}

/// LIRS: one block number per line; `*` lines are the original simulator's breakpoints.
fn lirs(path: &Path) -> Result<Vec<u64>> {
    let mut keys = Vec::new();
    for (i, line) in lines(path)?.iter().enumerate() {
        let line = line.trim();
        if !line.is_empty() && line != "*" {
            keys.push(field(&[line], 0, path, i + 1)?);
        }
    }
    Ok(keys)
}

/// DiskSim ASCII: `time device start_sector sectors type`.
fn disksim(path: &Path) -> Result<Vec<u64>> {
    let mut keys = Vec::new();
    for (i, line) in lines(path)?.iter().enumerate() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let device = field(&fields, 1, path, i + 1)?;
        let (start, sectors) = (
            field(&fields, 2, path, i + 1)?,
            field(&fields, 3, path, i + 1)?,
        );
        push_blocks(&mut keys, device, start * SECTOR, sectors * SECTOR);
    }
    Ok(keys)
}

/// CloudPhysics csv: `version,time,op,size,lbn`, size in bytes, lbn in sectors.
fn cloudphysics(path: &Path) -> Result<Vec<u64>> {
    let mut keys = Vec::new();
    for (i, line) in lines(path)?.iter().enumerate().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let (bytes, lbn) = (
            field(&fields, 3, path, i + 1)?,
            field(&fields, 4, path, i + 1)?,
        );
        push_blocks(&mut keys, 0, lbn * SECTOR, bytes);
    }
    Ok(keys)
}

fn shards(keys: &[u64], sampling: Sampling, seed: u64) -> Result<ShardsMrc> {
    let mut mrc = ShardsMrc::new(sampling, seed)?;
    mrc.extend(keys.iter().copied());
    Ok(mrc)
}

/// The mean and the largest of the errors of one SHARDS configuration over `seeds` hash seeds.
struct Spread {
    mean: f64,
    max: f64,
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.4} / {:.4}", self.mean, self.max)
    }
}

fn spread(errors: &[f64]) -> Spread {
    Spread {
        mean: errors.iter().sum::<f64>() / errors.len() as f64,
        max: errors.iter().copied().fold(0.0, f64::max),
    }
}

/// One sampling run with several hash seeds.
struct SeedRuns {
    unadjusted: Spread,
    adjusted: Spread,
    mean_rate: f64,
    /// Per seed, the curves without and with SHARDS_adj.
    curves: Vec<[Vec<CurvePoint>; 2]>,
}

fn over_seeds(
    keys: &[u64],
    sampling: Sampling,
    seeds: u64,
    reference: &[CurvePoint],
    sizes: &[u64],
) -> Result<SeedRuns> {
    let (mut unadjusted, mut adjusted, mut rates, mut curves) = (vec![], vec![], 0.0, vec![]);
    for seed in 0..seeds {
        let run = shards(keys, sampling, seed)?;
        let pair = [Correction::None, Correction::Adjusted].map(|c| run.histogram(c).curve(sizes));
        unadjusted.push(mean_absolute_error(reference, &pair[0])?);
        adjusted.push(mean_absolute_error(reference, &pair[1])?);
        rates += run.stats().effective_rate;
        curves.push(pair);
    }
    Ok(SeedRuns {
        unadjusted: spread(&unadjusted),
        adjusted: spread(&adjusted),
        mean_rate: rates / seeds as f64,
        curves,
    })
}

fn measure(name: &str, keys: &[u64], seeds: u64) -> Result<()> {
    let started = Instant::now();
    let mut exact = ExactMrc::new();
    exact.extend(keys.iter().copied());
    let exact_seconds = started.elapsed().as_secs_f64();
    let unique = exact.unique_keys();
    let sizes = evenly_spaced_sizes(unique, 100);
    let reference = exact.histogram().curve(&sizes);

    let started = Instant::now();
    let sampled = shards(keys, Sampling::FixedRate { rate: 0.01 }, 0)?
        .stats()
        .sampled_keys;
    let shards_seconds = started.elapsed().as_secs_f64();

    let one_percent = over_seeds(
        keys,
        Sampling::FixedRate { rate: 0.01 },
        seeds,
        &reference,
        &sizes,
    )?;
    // Averages of groups of 10 seeds: each group is one 10-seed estimate.
    let mut averaged = [vec![], vec![]];
    for group in one_percent.curves.chunks_exact(10) {
        for (correction, errors) in averaged.iter_mut().enumerate() {
            let members: Vec<Vec<CurvePoint>> =
                group.iter().map(|pair| pair[correction].clone()).collect();
            errors.push(mean_absolute_error(&reference, &average_curves(&members)?)?);
        }
    }
    let fixed = Sampling::FixedSize { max_keys: 8192 };
    let fixed = over_seeds(keys, fixed, seeds, &reference, &sizes)?;
    let small = Sampling::FixedSize {
        max_keys: (unique as usize / 100).max(1),
    };
    let small = over_seeds(keys, small, seeds, &reference, &sizes)?;

    println!(
        "| {name} | {} | {unique} | {sampled} | {} | {} | {} | {} | {} | {} | {:.3} | {} | {} \
         | {exact_seconds:.2} / {shards_seconds:.3} |",
        keys.len(),
        one_percent.unadjusted,
        one_percent.adjusted,
        spread(&averaged[0]),
        spread(&averaged[1]),
        fixed.unadjusted,
        fixed.adjusted,
        fixed.mean_rate,
        small.unadjusted,
        small.adjusted,
    );
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let dir =
        PathBuf::from(args.next().unwrap_or_else(|| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/traces").into()
        }));
    let seeds: u64 = args.next().map_or(Ok(20), |s| s.parse())?;
    if seeds < 10 {
        return Err("SEEDS must be at least 10 (seeds are averaged in groups of 10)".into());
    }
    let mut traces: Vec<(String, Vec<u64>)> = Vec::new();
    for name in ["P3", "P6"] {
        traces.push((
            format!("arc/{name}"),
            arc(&dir.join(format!("arc/{name}.lis.zst")))?,
        ));
    }
    traces.push((
        "cloudphysics".into(),
        cloudphysics(&dir.join("cloudphysics/cloudPhysicsIO.csv"))?,
    ));
    for name in ["tpcc-small", "wsrch-small"] {
        traces.push((
            format!("mqsim/{name}"),
            disksim(&dir.join(format!("mqsim/{name}.trace")))?,
        ));
    }
    let mut lirs_names: Vec<PathBuf> = std::fs::read_dir(dir.join("lirs"))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    lirs_names.retain(|p| p.to_string_lossy().ends_with(".trace.gz"));
    lirs_names.sort();
    for path in lirs_names {
        let stem = path
            .file_name()
            .map(|n| n.to_string_lossy().replace(".trace.gz", ""));
        traces.push((format!("lirs/{}", stem.unwrap_or_default()), lirs(&path)?));
    }

    println!("MAE against exact LRU, mean / max over {seeds} hash seeds");
    println!(
        "| trace | refs | unique | keys at 1% | rate 1% | rate 1% adj | 10 seeds of 1% averaged \
         | same, adj | size 8192 | size 8192 adj | its rate | size 1% | size 1% adj \
         | exact s / 1% s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, keys) in &traces {
        measure(name, keys, seeds)?;
    }
    Ok(())
}
