//! Tables on stdout and the JSON file of `ssdcache-bench engine`.

use std::path::Path;

use anyhow::{Context, Result};

use super::cases::{gib, AdmitRow, HitsResult, MetadataRow};
use super::volumes::{SetupPhase, VolumesResult};
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

pub fn print_volumes(v: &VolumesResult) {
    println!(
        "\nvolumes: {} {} volumes of {} MiB, policy {}, admission {}, cutoff {} MiB; 4 KiB reads, \
         {:.0}% to the hot volume (uniform over {} lines: {:.0}% of the shared cache, {:.1}x a \
         partition), the rest uniform over the three cold volumes",
        v.volumes,
        v.mode,
        v.volume_size >> 20,
        v.policy,
        v.admission,
        v.sequential_cutoff >> 20,
        v.hot_share * 100.0,
        v.hot_set_lines,
        v.hot_set_of_shared * 100.0,
        v.hot_set_of_partition
    );
    println!(
        "         shared: one {} cache of {} lines of {} KiB; partitioned: {} caches of {} lines; \
         per phase {} warm-up + {} measured requests, seed {}",
        gib(v.cache_size),
        v.shared_lines,
        v.line_size >> 10,
        v.volumes,
        v.partition_lines,
        v.warmup_requests,
        v.measured_requests,
        v.seed
    );
    println!(
        "{:>6} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} | {:>6}",
        "phase", "hot", "hot", "cold", "cold", "cold", "overall", "warm-up", "hot", "cold", "cold",
        "cold", "overall", "warm-up", "hot"
    );
    println!(
        "{:>6} {:>6} | {:^53} | {:^53} | {:>6}",
        "", "", "shared: read hit ratio", "partitioned: read hit ratio", "ratio"
    );
    for (i, p) in v.phases.iter().enumerate() {
        let cols = |s: &SetupPhase| {
            let hot = &s.volumes[p.hot];
            let mut text = format!("{:>8.3}", hot.hit_ratio);
            for c in s.volumes.iter().filter(|c| !c.hot) {
                text += &format!(" {:>8.3}", c.hit_ratio);
            }
            text + &format!(
                " {:>8.3} {:>9.3}",
                s.overall_hit_ratio, s.warmup_hot_hit_ratio
            )
        };
        println!(
            "{:>6} {:>6} | {} | {} | {:>6.2}",
            i + 1,
            p.shared.volumes[p.hot].name,
            cols(&p.shared),
            cols(&p.partitioned),
            p.hot_ratio
        );
    }
    for (i, p) in v.phases.iter().enumerate() {
        let used = |s: &SetupPhase| {
            s.volumes
                .iter()
                .map(|u| format!("{} {}", u.name, u.lines_used))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "  lines held after phase {}: shared {}; partitioned {}",
            i + 1,
            used(&p.shared),
            used(&p.partitioned)
        );
    }
    println!(
        "  wall time: shared {:.1} s, partitioned {:.1} s (side by side, one thread each)",
        v.shared_secs, v.partitioned_secs
    );
}

pub fn write_json(
    path: &Path,
    a: &EngineArgs,
    cpus: usize,
    admit: &[AdmitRow],
    hits: Option<&HitsResult>,
    metadata: &[MetadataRow],
    volumes: Option<&VolumesResult>,
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
        "volumes": volumes,
    });
    let text = serde_json::to_string_pretty(&out)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}
