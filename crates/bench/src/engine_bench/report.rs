//! Tables on stdout and the JSON file of `ssdcache-bench engine`.

use std::path::Path;

use anyhow::{Context, Result};

use super::cases::{gib, AdmitRow, HitsResult, MetadataRow};
use super::EngineArgs;

pub fn print_admit(rows: &[AdmitRow], header: bool) {
    if header {
        println!("\nadmit: 4 KiB write-back writes to lines not in the cache (us per request; engine = total - device time;");
        println!("       hit p99: one thread's cache hits alone, and beside writes into the all-dirty cache, with their max)");
        println!(
            "{:>8} {:>9} | {:>8} {:>8} {:>8} {:>8} | {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} | {:>8} | {:>9} {:>9} {:>9}",
            "cache", "lines", "free", "p50", "p99", "engine", "all-dirty", "p50", "p99",
            "engine", "backing", "cache-dev", "fill s", "hit p99", "beside", "max"
        );
    }
    for r in rows {
        let (f, d) = (&r.free, &r.all_dirty);
        println!(
            "{:>8} {:>9} | {:>8.1} {:>8.1} {:>8.1} {:>8.1} | {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} | {:>8.1} | {:>9.1} {:>9.1} {:>9.1}",
            gib(r.cache_size),
            r.lines,
            f.latency.mean_us,
            f.latency.p50_us,
            f.latency.p99_us,
            f.breakdown.engine_us,
            d.latency.mean_us,
            d.latency.p50_us,
            d.latency.p99_us,
            d.breakdown.engine_us,
            d.breakdown.backing_device_us,
            d.breakdown.cache_device_us,
            r.fill_secs,
            r.hits_beside.reader_alone.p99_us,
            r.hits_beside.reader_beside_writes.p99_us,
            r.hits_beside.reader_beside_writes.max_us
        );
    }
}

pub fn print_hits(h: &HitsResult) {
    println!(
        "\nhits: random 4 KiB reads, all hits, {} in-memory cache, {} KiB lines, policy {}; this machine has {} CPUs",
        gib(h.cache_size),
        h.line_size >> 10,
        h.policy,
        h.cpus
    );
    println!(
        "{:>8} {:>12} {:>14} {:>10}",
        "threads", "req/s", "req/s/thread", "us/req"
    );
    for r in &h.runs {
        let note = if r.oversubscribed {
            " (more threads than CPUs)"
        } else {
            ""
        };
        println!(
            "{:>8} {:>12.0} {:>14.0} {:>10.2}{note}",
            r.threads, r.requests_per_sec, r.per_thread_per_sec, r.mean_us
        );
    }
}

pub fn print_metadata(rows: &[MetadataRow], header: bool) {
    if header {
        println!("\nmetadata: engine heap at full occupancy (all lines dirty)");
        println!(
            "{:>8} {:>6} {:>10} {:>12} {:>8} {:>8} {:>12} {:>10} {:>10} {:>16}",
            "cache",
            "line",
            "lines",
            "heap MiB",
            "B/line",
            "% cache",
            "peak MiB",
            "VmRSS MiB",
            "VmHWM MiB",
            "checksums MiB"
        );
    }
    for r in rows {
        println!(
            "{:>8} {:>5}K {:>10} {:>12.1} {:>8.1} {:>8.3} {:>12.1} {:>10.1} {:>10.1} {:>7.1} of {:.1}{}",
            gib(r.cache_size),
            r.line_size >> 10,
            r.lines,
            r.heap_bytes as f64 / 1048576.0,
            r.bytes_per_line,
            r.percent_of_cache,
            r.heap_peak_bytes as f64 / 1048576.0,
            r.vmrss_kib as f64 / 1024.0,
            r.vmhwm_kib as f64 / 1024.0,
            r.checksum_bytes as f64 / 1048576.0,
            r.checksum_budget_bytes.min(1 << 50) as f64 / 1048576.0,
            if r.from_admit { " (admit's fill)" } else { "" }
        );
    }
}

pub fn write_json(
    path: &Path,
    a: &EngineArgs,
    cpus: usize,
    admit: &[AdmitRow],
    hits: Option<&HitsResult>,
    metadata: &[MetadataRow],
) -> Result<()> {
    let out = serde_json::json!({
        "cpus": cpus,
        "policy": a.policy,
        "writes": a.writes,
        "fill_threads": a.fill_threads,
        "seconds": a.seconds,
        "admit": admit,
        "hits": hits,
        "metadata": metadata,
    });
    let text = serde_json::to_string_pretty(&out)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}
