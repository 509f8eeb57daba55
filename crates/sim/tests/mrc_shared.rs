//! SHARDS against the exact LRU miss-ratio curve on every shared trace, read by the real trace
//! readers with every request split into the 4 KiB blocks it touches (what `ssdcache mrc`
//! does). The bounds are the ones docs/mrc.md states and `ssdcache mrc` prints:
//!
//! - fixed size, `DEFAULT_MAX_KEYS` keys: a mean absolute error of at most 0.01 on every trace,
//!   for every seed;
//! - fixed rate 1%: about 1/√K for K sampled keys (the mean over seeds at most 1.5/√K, one seed
//!   at most 3.5/√K), which is at most 0.01 on average on the traces where 1% samples about
//!   1000 keys or more, except CloudPhysics (0.016);
//! - every curve is exact where the sample holds every key;
//! - the exact curve matches libCacheSim's LRU at shared/traces/README.md's reference points.
//!
//! `examples/mrc_accuracy.rs` prints the full table over more seeds and sample sizes. In a
//! debug build a fixed-size pass over a trace with more unique blocks than the sample costs
//! about as much as the exact pass (most references are sampled), so it runs with fewer seeds
//! than the cheap fixed-rate pass, and only one where the sample holds every key (then the
//! seed does not matter): the whole file takes about 40 s unoptimised.

mod common;

use common::shards::check_shards_bounds;
use common::shared;
use common::shared_traces::SHARED_TRACES;
use ssdcache_sim::mrc::{evenly_spaced_sizes, ExactMrc};
use ssdcache_sim::trace::{self, block_keys, Format};

const LINE_SIZE: u64 = 4096;

fn block_references(relative: &str, format: Format) -> Vec<u64> {
    let path = shared(relative);
    let trace = trace::open(&path, format)
        .unwrap_or_else(|e| panic!("opening {relative} as {format}: {e}"));
    let mut keys = Vec::new();
    for request in trace {
        let request = request.unwrap_or_else(|e| panic!("reading {relative}: {e}"));
        keys.extend(block_keys(&request, LINE_SIZE));
    }
    keys
}

/// Traces on which fixed-rate 1% errs by at most 0.01 on average over the seeds.
const RATE_WITHIN_ONE_PERCENT: &[&str] = &[
    "arc/P3.lis.zst",
    "arc/P6.lis.zst",
    "tencent_cbs/cloud_storage-sample.bz2",
    "mqsim/tpcc-small.trace",
    "mqsim/wsrch-small.trace",
];

/// LRU miss ratios libCacheSim's `cachesim` gives (shared/traces/README.md): trace, cache
/// size in 4 KiB blocks, miss ratio.
const LIBCACHESIM_LRU: &[(&str, u64, f64)] = &[
    ("arc/P3.lis.zst", 10_234, 0.7350),
    ("arc/P6.lis.zst", 10_190, 0.6488),
];

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn shards_error_on_every_shared_trace() {
    let mut report = Vec::new();
    for &(relative, format) in SHARED_TRACES {
        let keys = block_references(relative, format);
        let mut exact = ExactMrc::new();
        exact.extend(keys.iter().copied());
        let unique = exact.unique_keys();
        let histogram = exact.histogram();
        if let Some(&(_, cache_lines, miss_ratio)) =
            LIBCACHESIM_LRU.iter().find(|(r, ..)| *r == relative)
        {
            let ours = histogram.miss_ratio(cache_lines);
            assert!(
                (ours - miss_ratio).abs() < 0.0005,
                "{relative} at {cache_lines} lines: {ours}, libCacheSim {miss_ratio}"
            );
        }
        let reference = histogram.curve(&evenly_spaced_sizes(unique, 100));
        let errors = check_shards_bounds(relative, &keys, unique, &reference);
        if RATE_WITHIN_ONE_PERCENT.contains(&relative) {
            assert!(
                errors.rate_mean <= 0.01,
                "{relative}: rate 1%: mean MAE {}",
                errors.rate_mean
            );
        }
        report.push(format!("{relative}: {errors}"));
    }
    println!("{}", report.join("\n"));
}

/// Every LIRS trace in the shared directory is in the list the measurements cover.
#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn every_lirs_trace_is_measured() {
    let directory = shared("lirs/README");
    let directory = directory.parent().expect("a file has a directory");
    let mut on_disk: Vec<String> = std::fs::read_dir(directory)
        .expect("the lirs directory reads")
        .map(|entry| entry.expect("a directory entry").file_name())
        .map(|name| format!("lirs/{}", name.to_string_lossy()))
        .filter(|name| name.ends_with(".trace.gz"))
        .collect();
    on_disk.sort();
    let listed: Vec<String> = SHARED_TRACES
        .iter()
        .map(|(relative, _)| relative.to_string())
        .filter(|name| name.starts_with("lirs/"))
        .collect();
    assert_eq!(on_disk, listed);
}
