//! Shared by the libCacheSim parity tests and the `parity_table` example: the reference miss
//! ratios of libCacheSim's `cachesim` (`bench/libcachesim/reference.csv` on the shared traces,
//! `synthetic.csv` on the synthetic ones) and one simulator pass per trace over the same 4 KiB
//! block references.
#![allow(dead_code)]

// Where the shared traces are: `tests/common/shared_traces.rs`, which every includer of this
// module has at its root.
use super::shared_traces;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ssdcache_engine::admission::Admission;
use ssdcache_sim::simulate::{self, Mode, SimConfig, SimCounters};
use ssdcache_sim::trace::{self, Format};

pub const REFERENCE_CSV: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../bench/libcachesim/reference.csv"
);
/// libCacheSim's miss ratios on the synthetic traces (`bench/libcachesim/synthetic`), which a
/// clone of the repository alone can check.
pub const SYNTHETIC_CSV: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../bench/libcachesim/synthetic.csv"
);
pub const LINE_SIZE: u64 = 4096;

/// One row of reference.csv.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// Path under the shared traces directory.
    pub trace: String,
    pub unique_blocks: u64,
    /// Block references (not trace lines).
    pub requests: u64,
    pub policy: String,
    pub cache_blocks: u64,
    pub miss_ratio: f64,
}

/// Reads reference.csv; a malformed line is an error naming it.
pub fn read_reference(path: &Path) -> Result<Vec<Reference>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, l)| l);
    let expected = "trace,unique_blocks,requests,policy,cache_blocks,miss_ratio";
    if header != Some(expected) {
        return Err(format!(
            "{}: header {header:?}, expected {expected:?}",
            path.display()
        ));
    }
    lines
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            parse_row(line).ok_or_else(|| format!("{} line {}: {line:?}", path.display(), i + 1))
        })
        .collect()
}

fn parse_row(line: &str) -> Option<Reference> {
    let fields: Vec<&str> = line.split(',').collect();
    let [trace, unique, requests, policy, blocks, miss] = fields[..] else {
        return None;
    };
    Some(Reference {
        trace: trace.to_owned(),
        unique_blocks: unique.parse().ok()?,
        requests: requests.parse().ok()?,
        policy: policy.to_owned(),
        cache_blocks: blocks.parse().ok()?,
        miss_ratio: miss.parse().ok()?,
    })
}

/// The rows grouped by trace, in file order within a trace.
pub fn by_trace(rows: &[Reference]) -> BTreeMap<&str, Vec<&Reference>> {
    let mut map: BTreeMap<&str, Vec<&Reference>> = BTreeMap::new();
    for row in rows {
        map.entry(row.trace.as_str()).or_default().push(row);
    }
    map
}

/// The reader for each shared trace the reference covers (the script's reader per file).
pub fn format_of(trace: &str) -> Option<Format> {
    let dir = trace.split('/').next()?;
    Some(match dir {
        "arc" => Format::Arc,
        "cloudphysics" if trace.ends_with(".csv") => Format::VscsiCsv,
        "tencent_cbs" => Format::SniaTencent,
        "msr" => Format::Msr,
        "systor17" => Format::Systor,
        "mqsim" => Format::Disksim,
        "lirs" => Format::Lirs,
        _ => return None,
    })
}

/// The shared trace file; panics (fails the test) when `SSDCACHE_TRACES` is not set or the
/// file is missing.
pub fn trace_path(trace: &str) -> PathBuf {
    shared_traces::shared_trace(trace)
}

/// A cache that counts exactly libCacheSim's block references: every 4 KiB block a request
/// touches is one reference, reads and writes alike, and every miss is cached.
pub fn config(policy: &str, cache_blocks: u64) -> SimConfig {
    SimConfig {
        policy: policy.to_owned(),
        cache_lines: cache_blocks,
        line_size: LINE_SIZE,
        admission: Admission::Always,
        sequential_cutoff: 0,
        mode: Mode::WriteThrough,
        writeback: Default::default(),
    }
}

/// What one simulated cache gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub policy: String,
    pub cache_blocks: u64,
    /// Line references counted (reads and writes).
    pub references: u64,
    pub miss_ratio: f64,
}

/// Runs every (policy, size) over one pass of the trace.
pub fn simulate_trace(
    trace: &str,
    caches: &[(String, u64)],
    jobs: usize,
) -> Result<Vec<Outcome>, String> {
    let format = format_of(trace).ok_or_else(|| format!("{trace}: no reader chosen for it"))?;
    simulate_file(&trace_path(trace), format, caches, jobs)
}

/// Runs every (policy, size) over one pass of the trace file `path` read as `format`.
pub fn simulate_file(
    path: &Path,
    format: Format,
    caches: &[(String, u64)],
    jobs: usize,
) -> Result<Vec<Outcome>, String> {
    let name = path.display();
    let requests = trace::open(path, format).map_err(|e| e.to_string())?;
    let configs: Vec<SimConfig> = caches.iter().map(|(p, n)| config(p, *n)).collect();
    let results = simulate::run(requests, &configs, jobs)
        .map_err(|e| format!("{name}: {e}"))?
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(results
        .into_iter()
        .map(|r| Outcome {
            policy: r.config.policy,
            cache_blocks: r.config.cache_lines,
            references: r.counters.read_refs + r.counters.write_refs,
            miss_ratio: miss_ratio(&r.counters),
        })
        .collect())
}

/// Misses over references, computed as cachesim does (not `1 - hit ratio`, which can round
/// the other way at the 4th decimal).
fn miss_ratio(c: &SimCounters) -> f64 {
    let references = c.read_refs + c.write_refs;
    let misses = references - (c.read_hits + c.write_hits);
    if references == 0 {
        0.0
    } else {
        misses as f64 / references as f64
    }
}

/// A miss ratio as cachesim prints it (4 decimals), so a comparison shows only real
/// differences.
pub fn printed(miss_ratio: f64) -> f64 {
    format!("{miss_ratio:.4}").parse().unwrap_or(miss_ratio)
}
