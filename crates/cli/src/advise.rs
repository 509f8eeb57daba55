//! `ssdcache advise`: how big a cache a workload needs for a target hit ratio, how fast it
//! wears the SSD out, and what the hybrid costs against all-flash.

use std::io::Write;

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use ssdcache_engine::admission::Admission;
use ssdcache_sim::advise::{self, Cost, Economics, Endurance, SizePoint, TB};
use ssdcache_sim::simulate::{Mode, SimConfig};

use crate::simulate::{
    cache_lines, simulate_all, summarize, CacheSize, Row, TraceArgs, TraceSummary,
};
use crate::size::{human, parse_size};

/// Shares of the footprint the first pass simulates.
const COARSE_PERCENTS: [f64; 16] = [
    1.0, 2.0, 3.0, 5.0, 7.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0,
];
/// Sizes the second pass simulates between the two coarse points around the target.
const FINE_STEPS: u64 = 15;

#[derive(Args)]
pub struct AdviseArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// The hit ratio to reach, of the cache lines requests touch (0 < R < 1)
    #[arg(long, value_name = "R", value_parser = parse_ratio)]
    target_hit_ratio: f64,
    /// Replacement policy [default: the engine's default]
    #[arg(long, value_name = "NAME", value_parser = crate::simulate::parse_policy)]
    policy: Option<String>,
    /// Admission: always, 2-hit, 3-hit, ... [default: the engine's default]
    #[arg(long, value_name = "NAME")]
    admission: Option<Admission>,
    /// A sequential stream bypasses the cache after this much (0 = off), as in the engine
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_size)]
    sequential_cutoff: u64,
    /// How writes are handled: write-through, write-back or write-around
    #[arg(long, value_name = "MODE", default_value = "write-through")]
    mode: Mode,
    #[command(flatten)]
    writeback: crate::simulate::WritebackArgs,
    /// The SSD's endurance rating in terabytes written (TBW, from its data sheet)
    /// [default: 550 TBW per TB of cache, a mainstream TLC drive: 0.3 drive writes per day for
    /// 5 years]
    #[arg(long, value_name = "TB")]
    ssd_tbw: Option<f64>,
    /// Price of SSD capacity, per TB (any currency; the same as --hdd-price-per-tb)
    #[arg(long, value_name = "PRICE", default_value_t = 60.0)]
    ssd_price_per_tb: f64,
    /// Price of HDD capacity, per TB
    #[arg(long, value_name = "PRICE", default_value_t = 15.0)]
    hdd_price_per_tb: f64,
    /// Capacity to provision (the backing disk's size) for the cost comparison [default: the
    /// highest address the trace reaches, summed over its volumes]
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    capacity: Option<u64>,
    /// How long the trace lasted in seconds, for traces without timestamps (arc, lirs,
    /// sector-list, oracle-general without time); needed for writes per day
    #[arg(long, value_name = "SECONDS")]
    trace_duration: Option<f64>,
    /// Print the advice as JSON
    #[arg(long)]
    json: bool,
    /// Threads simulating caches side by side [default: the number of CPUs]
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r > 0.0 && r < 1.0 => Ok(r),
        _ => Err(format!(
            "{s:?}: a hit ratio is a number above 0 and below 1, e.g. 0.9"
        )),
    }
}

#[derive(Debug, Serialize)]
struct Advice {
    trace: String,
    policy: String,
    admission: String,
    mode: &'static str,
    target_hit_ratio: f64,
    footprint_bytes: u64,
    summary: TraceSummary,
    /// Every simulated size, smallest first.
    points: Vec<SizePoint>,
    /// The highest hit ratio any simulated size reached.
    best_hit_ratio: f64,
    /// `None` when no size reaches the target.
    recommended: Option<SizePoint>,
    /// The gap between the recommended size and the largest simulated size below the target.
    precision_bytes: Option<u64>,
    trace_seconds: Option<f64>,
    /// The smallest common SSD holding the recommended cache: its rating and price count.
    ssd_bytes: Option<u64>,
    endurance: Option<Endurance>,
    capacity_bytes: u64,
    capacity_assumed: bool,
    cost: Option<Cost>,
}

pub fn run(args: AdviseArgs) -> Result<()> {
    let policy = args
        .policy
        .clone()
        .unwrap_or_else(|| ssdcache_engine::policy::DEFAULT_POLICY.to_string());
    let admission = args.admission.unwrap_or_default();
    let writeback = args.writeback.model()?;
    let (summary, info) = summarize(&args.trace)?;
    let config = |lines: u64| SimConfig {
        policy: policy.clone(),
        cache_lines: lines,
        line_size: args.trace.line_size,
        admission,
        sequential_cutoff: args.sequential_cutoff,
        mode: args.mode,
        writeback: writeback.clone(),
    };
    let coarse: Vec<SimConfig> = COARSE_PERCENTS
        .iter()
        .map(|&p| {
            config(cache_lines(
                CacheSize::Percent(p),
                args.trace.line_size,
                summary.unique_lines,
                info.sample_rate,
            ))
        })
        .collect();
    let mut rows = simulate_all(&args.trace, &info, summary, &dedup(coarse), args.jobs)?.rows;
    let unit = args.trace.line_size;
    if let Some((low, high)) = advise::bracket(&points(&rows), args.target_hit_ratio) {
        let fine: Vec<SimConfig> = advise::sizes_between(low, high, FINE_STEPS, unit)
            .into_iter()
            .map(|b| config(cache_lines(CacheSize::Bytes(b), unit, 0, info.sample_rate)))
            .collect();
        if !fine.is_empty() {
            rows.extend(simulate_all(&args.trace, &info, summary, &dedup(fine), args.jobs)?.rows);
        }
    }
    let advice = advice(&args, policy, admission, summary, info.sample_rate, &rows);
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &advice)?;
        writeln!(out)?;
    } else {
        write_advice(&mut out, &advice)?;
    }
    Ok(())
}

fn dedup(mut configs: Vec<SimConfig>) -> Vec<SimConfig> {
    configs.dedup_by_key(|c| c.cache_lines);
    configs
}

fn points(rows: &[Row]) -> Vec<SizePoint> {
    let mut pts: Vec<SizePoint> = rows
        .iter()
        .map(|r| SizePoint {
            cache_bytes: r.cache_bytes,
            hit_ratio: r.hit_ratio,
            cache_bytes_written: r.cache_bytes_written,
        })
        .collect();
    pts.sort_by_key(|p| p.cache_bytes);
    pts.dedup_by_key(|p| p.cache_bytes);
    pts
}

fn advice(
    args: &AdviseArgs,
    policy: String,
    admission: Admission,
    summary: TraceSummary,
    sample_rate: f64,
    rows: &[Row],
) -> Advice {
    let pts = points(rows);
    let recommended = advise::smallest_reaching(&pts, args.target_hit_ratio);
    let precision_bytes = recommended.and_then(|r| {
        let below = pts
            .iter()
            .filter(|p| p.cache_bytes < r.cache_bytes)
            .map(|p| p.cache_bytes)
            .max()?;
        Some(r.cache_bytes - below)
    });
    let trace_seconds = args
        .trace_duration
        .or((summary.seconds > 0.0).then_some(summary.seconds));
    let (capacity_bytes, capacity_assumed) = match args.capacity {
        Some(c) => (c, false),
        None => (
            ((summary.address_span as f64) / sample_rate.max(f64::MIN_POSITIVE)) as u64,
            true,
        ),
    };
    let econ = Economics {
        ssd_tbw_bytes: args.ssd_tbw.map(|t| t * TB),
        ssd_price_per_tb: args.ssd_price_per_tb,
        hdd_price_per_tb: args.hdd_price_per_tb,
        capacity_bytes,
    };
    let ssd_bytes = recommended.map(|r| advise::ssd_to_buy(r.cache_bytes));
    let endurance = recommended
        .zip(ssd_bytes)
        .zip(trace_seconds.filter(|&s| s > 0.0))
        .map(|((r, ssd), secs)| advise::endurance(ssd, r.cache_bytes_written, secs, &econ));
    Advice {
        trace: args.trace.trace.display().to_string(),
        policy,
        admission: admission.to_string(),
        mode: args.mode.name(),
        target_hit_ratio: args.target_hit_ratio,
        footprint_bytes: ((summary.unique_lines * args.trace.line_size) as f64 / sample_rate)
            as u64,
        summary,
        best_hit_ratio: pts.iter().map(|p| p.hit_ratio).fold(0.0, f64::max),
        recommended,
        precision_bytes,
        trace_seconds,
        endurance,
        capacity_bytes,
        capacity_assumed,
        ssd_bytes,
        cost: ssd_bytes.map(|ssd| advise::cost(ssd, &econ)),
        points: pts,
    }
}

fn write_advice(out: &mut impl Write, a: &Advice) -> Result<()> {
    writeln!(
        out,
        "trace {}: {} requests, footprint {}{}",
        a.trace,
        a.summary.requests,
        human(a.footprint_bytes),
        a.trace_seconds
            .map_or(String::new(), |s| format!(", {}", duration(s)))
    )?;
    writeln!(
        out,
        "simulated: policy {}, admission {}, mode {}, {} cache sizes\n",
        a.policy,
        a.admission,
        a.mode,
        a.points.len()
    )?;
    let Some(r) = a.recommended else {
        writeln!(
            out,
            "No cache reaches a hit ratio of {:.3}: the best is {:.3}, with the whole footprint \
             cached. The other references are first touches of a line (or bypassed streams), \
             which no cache can serve. Lower --target-hit-ratio.",
            a.target_hit_ratio, a.best_hit_ratio
        )?;
        return Ok(());
    };
    writeln!(
        out,
        "Cache size for a hit ratio of {:.3}: {} ({:.1}% of the footprint; simulated hit ratio {:.4}{})",
        a.target_hit_ratio,
        human(r.cache_bytes),
        100.0 * r.cache_bytes as f64 / a.footprint_bytes.max(1) as f64,
        r.hit_ratio,
        a.precision_bytes
            .map_or(String::new(), |p| format!("; the next smaller size simulated, {} less, falls short", human(p)))
    )?;
    let ssd = a.ssd_bytes.unwrap_or(r.cache_bytes);
    writeln!(
        out,
        "It fits on a {} SSD (the smallest common size holding it; its rating and price count below)",
        tb(ssd)
    )?;
    write_endurance(out, a, r, ssd)?;
    if let Some(c) = &a.cost {
        writeln!(
            out,
            "\nCost for {} of capacity{}:\n  hybrid: {} HDD + {} SSD = {:.2} ({:.2} per TB)\n  \
             all-flash: {:.2} ({:.2} per TB)\n  the hybrid costs {:.0}% of all-flash",
            tb(a.capacity_bytes),
            if a.capacity_assumed {
                " (the trace's address span; pass --capacity for your disk)"
            } else {
                ""
            },
            tb(a.capacity_bytes),
            tb(ssd),
            c.hybrid,
            c.hybrid_per_tb,
            c.all_flash,
            c.all_flash_per_tb,
            c.ratio * 100.0
        )?;
    }
    writeln!(out, "\nhit ratio by cache size (simulated):")?;
    for p in &a.points {
        writeln!(out, "  {:>10}  {:.4}", human(p.cache_bytes), p.hit_ratio)?;
    }
    Ok(())
}

/// Drive and price sizes in decimal terabytes, as vendors sell them.
fn tb(bytes: u64) -> String {
    format!("{:.2} TB", bytes as f64 / TB)
}

fn write_endurance(out: &mut impl Write, a: &Advice, r: SizePoint, ssd: u64) -> Result<()> {
    let Some(e) = &a.endurance else {
        writeln!(
            out,
            "\nSSD writes: {} over the trace. The trace has no timestamps: pass --trace-duration \
             SECONDS for writes per day and the SSD's lifetime.",
            human(r.cache_bytes_written)
        )?;
        return Ok(());
    };
    writeln!(
        out,
        "\nSSD writes: {} over the trace = {} per day ({:.3} drive writes per day of the {} SSD)",
        human(r.cache_bytes_written),
        human(e.ssd_bytes_written_per_day as u64),
        e.ssd_bytes_written_per_day / ssd.max(1) as f64,
        tb(ssd)
    )?;
    let rating = format!(
        "{:.1} TBW{}",
        e.tbw_bytes / TB,
        if e.tbw_assumed {
            " (assumed: 550 TBW per TB; pass --ssd-tbw)"
        } else {
            ""
        }
    );
    match e.lifetime_years {
        Some(y) => writeln!(out, "SSD lifetime at a rating of {rating}: {y:.1} years")?,
        None => writeln!(
            out,
            "SSD lifetime at a rating of {rating}: nothing is written"
        )?,
    }
    Ok(())
}

fn duration(seconds: f64) -> String {
    match seconds {
        s if s < 120.0 => format!("{s:.1} s"),
        s if s < 7200.0 => format!("{:.1} min", s / 60.0),
        s if s < 172_800.0 => format!("{:.1} h", s / 3600.0),
        s => format!("{:.1} days", s / 86_400.0),
    }
}
