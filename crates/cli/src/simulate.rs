//! `ssdcache simulate`: replays a block trace against simulated caches (the engine's own
//! policies and admission) and reports, per policy and size, hit ratios, SSD writes and the
//! traffic left for the backing device.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use rustc_hash::FxHashSet;
use serde::Serialize;
use ssdcache_engine::admission::Admission;
use ssdcache_sim::plot::{LineChart, RatioAxis, Series, SizeAxis};
use ssdcache_sim::simulate::{self, Mode, SimConfig, SimResult, WritebackModel};
use ssdcache_sim::trace::{self, block_keys, Format, Request, Trace, TraceError, TraceInfo};

use crate::size::{human, parse_size};

/// Sizes `simulate` tries when none is given.
const DEFAULT_SIZES: &str = "1%,2%,5%,10%,20%,50%";

#[derive(Args, Clone)]
pub struct TraceArgs {
    /// The trace file (may be compressed with zstd, gzip, bzip2 or xz)
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,
    /// Trace format: auto, msr, arc, blkparse, oracle-general, vscsi, vscsi-csv, sector-list,
    /// fio-iolog, snia-tencent, systor, disksim, lirs, ssdcache (docs/traces.md)
    #[arg(long, value_name = "NAME", default_value = "auto")]
    pub format: Format,
    /// Cache line size: a power of two from 512 bytes. 4KiB compares with other simulators;
    /// to predict a cache made by `ssdcache create` pass its line size (64KiB by default)
    #[arg(long, value_name = "SIZE", default_value = "4KiB", value_parser = parse_line_size)]
    pub line_size: u64,
}

#[derive(Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Replacement policies to compare, comma-separated [default: all of them] (a cache made
    /// by `ssdcache create` uses lirs-lean unless told otherwise: docs/policies.md)
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_policy)]
    pub policy: Vec<String>,
    /// Cache sizes, comma-separated: bytes (1GiB, 500MB) or a share of the trace's footprint
    /// (10%)
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = DEFAULT_SIZES, value_parser = parse_cache_size)]
    pub cache_size: Vec<CacheSize>,
    /// Admission policies to compare, comma-separated: always, 2-hit, 3-hit, ...
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "always"
    )]
    pub admission: Vec<Admission>,
    /// A sequential stream bypasses the cache once it has moved this much (0 = off), as the
    /// engine's stream detector does
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_size)]
    pub sequential_cutoff: u64,
    /// How writes are handled: write-through, write-back or write-around
    #[arg(long, value_name = "MODE", default_value = "write-through")]
    pub mode: Mode,
    #[command(flatten)]
    pub writeback: WritebackArgs,
    /// Print the results as JSON instead of a table
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print the results as CSV instead of a table
    #[arg(long)]
    pub csv: bool,
    /// Also draw hit ratio against cache size, one line per policy, as an SVG file
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Threads simulating caches side by side [default: the number of CPUs]
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,
}

/// The write-back model (`--mode write-back`): the engine's dirty limit and cleaner, with the
/// same defaults as `serve`.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Write-back model (with --mode write-back)")]
pub struct WritebackArgs {
    /// Most of the cache's lines that may be dirty, 0 to 100; past it writes to lines without
    /// dirty data go to the backing device, as `serve --dirty-limit` [default: 80]
    #[arg(long, value_name = "PERCENT")]
    pub dirty_limit: Option<f64>,
    /// The cleaner writes back the least recently used dirty lines above this share of dirty
    /// lines [default: 50]
    #[arg(long, value_name = "PERCENT")]
    pub writeback_high: Option<f64>,
    /// ... down to this share [default: 40]
    #[arg(long, value_name = "PERCENT")]
    pub writeback_low: Option<f64>,
    /// Lines dirty for longer than this many seconds of trace time are written back; 0 = never
    /// by age [default: 30]
    #[arg(long, value_name = "SECONDS")]
    pub writeback_max_age: Option<f64>,
    /// Bytes per second of trace time the backing device takes from the cleaner (e.g. 20MiB
    /// for scattered writes to one hard drive); without it the cleaner always keeps up, so the
    /// dirty limit never binds. Needs a trace with times
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub writeback_rate: Option<u64>,
}

impl WritebackArgs {
    /// The model, or a usage error naming the bad value.
    pub fn model(&self) -> Result<WritebackModel> {
        let d = WritebackModel::default();
        let pct = |v: Option<f64>, flag: &str, default: f64| -> Result<f64> {
            match v {
                None => Ok(default),
                Some(p) if (0.0..=100.0).contains(&p) => Ok(p / 100.0),
                Some(p) => Err(crate::usage_error(format!(
                    "--{flag} must be a percentage from 0 to 100 (got {p})"
                ))),
            }
        };
        let high = pct(self.writeback_high, "writeback-high", d.high_watermark)?;
        let low = pct(self.writeback_low, "writeback-low", d.low_watermark)?;
        if low > high {
            return Err(crate::usage_error(format!(
                "--writeback-low ({}) must not be above --writeback-high ({})",
                low * 100.0,
                high * 100.0
            )));
        }
        let max_age_ns = match self.writeback_max_age {
            None => d.max_age_ns,
            Some(s) if s.is_finite() && s >= 0.0 => (s * 1e9) as u64,
            Some(s) => {
                return Err(crate::usage_error(format!(
                    "--writeback-max-age must be a number of seconds, 0 or more (got {s})"
                )))
            }
        };
        if self.writeback_rate == Some(0) {
            return Err(crate::usage_error(
                "--writeback-rate 0 would never write anything back; leave it out for a cleaner \
                 that keeps up",
            ));
        }
        Ok(WritebackModel {
            dirty_limit: pct(self.dirty_limit, "dirty-limit", d.dirty_limit)?,
            high_watermark: high,
            low_watermark: low,
            max_age_ns,
            rate: self.writeback_rate,
        })
    }
}

/// A cache size as given: absolute or relative to the trace's footprint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheSize {
    Bytes(u64),
    /// Percent of the footprint (unique lines × line size).
    Percent(f64),
}

pub fn parse_cache_size(s: &str) -> Result<CacheSize, String> {
    let t = s.trim();
    if let Some(p) = t.strip_suffix('%') {
        let pct: f64 = p
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a percentage (try 10%)"))?;
        if !(pct > 0.0 && pct <= 1000.0) {
            return Err(format!(
                "{s:?}: a share of the footprint is above 0% and at most 1000%"
            ));
        }
        return Ok(CacheSize::Percent(pct));
    }
    match parse_size(t)? {
        0 => Err(format!("{s:?}: a cache size must be above 0")),
        b => Ok(CacheSize::Bytes(b)),
    }
}

fn parse_line_size(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if !v.is_power_of_two() || v < trace::MIN_LINE_SIZE {
        return Err(format!(
            "{s:?}: the line size is a power of two of at least {} bytes",
            trace::MIN_LINE_SIZE
        ));
    }
    Ok(v)
}

/// A policy's name, as `create --policy` checks it.
pub fn parse_policy(s: &str) -> Result<String, String> {
    crate::create::parse_policy(s).map(|id| ssdcache_engine::policy::NAMES[id as usize].to_owned())
}

/// What one pass over a trace found: its size in requests, line references, unique lines and
/// time.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TraceSummary {
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub line_refs: u64,
    pub unique_lines: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Time between the first and the last request, 0 when the format has no times.
    pub seconds: f64,
    /// The sum over volumes of the highest byte a request reached: a lower bound of the
    /// disks' capacity.
    pub address_span: u64,
}

/// Opens a trace. Trace errors name the file and the line or offset themselves.
pub fn open_trace(args: &TraceArgs) -> Result<Trace> {
    Ok(trace::open(&args.trace, args.format)?)
}

/// One pass counting the footprint (unique lines) and the shape of a trace.
pub fn summarize(args: &TraceArgs) -> Result<(TraceSummary, TraceInfo)> {
    let trace = open_trace(args)?;
    let info = trace.info().clone();
    let mut seen: FxHashSet<u64> = FxHashSet::default();
    let mut s = TraceSummary::default();
    let mut last_ns = 0;
    let mut ends: rustc_hash::FxHashMap<u32, u64> = Default::default();
    for r in progress(trace, "reading") {
        let r = r?;
        s.requests += 1;
        match r.op {
            trace::Op::Read => (s.reads += 1, s.bytes_read += r.len).1,
            trace::Op::Write => (s.writes += 1, s.bytes_written += r.len).1,
        };
        last_ns = last_ns.max(r.time_ns);
        let end = ends.entry(r.volume).or_default();
        *end = (*end).max(r.offset + r.len);
        for key in block_keys(&r, args.line_size) {
            s.line_refs += 1;
            seen.insert(key);
        }
    }
    if s.requests == 0 {
        bail!(
            "trace {} holds no read or write requests",
            args.trace.display()
        );
    }
    s.unique_lines = seen.len() as u64;
    s.seconds = last_ns as f64 / 1e9;
    s.address_span = ends.values().sum();
    Ok((s, info))
}

/// Wraps a trace in a spinner on stderr (only when stderr is a terminal), cleared when the
/// trace is dropped.
pub fn progress(trace: Trace, what: &'static str) -> Progress {
    use std::io::IsTerminal;
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new_spinner();
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} {pos} requests ({per_sec})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        bar.set_message(what);
        bar
    });
    Progress {
        trace,
        bar,
        count: 0,
    }
}

pub struct Progress {
    trace: Trace,
    bar: Option<indicatif::ProgressBar>,
    count: u64,
}

impl Iterator for Progress {
    type Item = Result<Request, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.count += 1;
        if self.count.is_multiple_of(65_536) {
            if let Some(bar) = &self.bar {
                bar.set_position(self.count);
            }
        }
        self.trace.next()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// The number of lines a cache size stands for, scaled by the trace's sampling rate (a trace
/// that kept 1% of the address space sees 1% of the cache).
pub fn cache_lines(size: CacheSize, line_size: u64, unique_lines: u64, sample_rate: f64) -> u64 {
    let lines = match size {
        CacheSize::Bytes(b) => (b.div_ceil(line_size) as f64 * sample_rate).round(),
        // Rounded down, as libCacheSim does, so shares compare with its numbers.
        CacheSize::Percent(p) => (unique_lines as f64 * p / 100.0).floor(),
    };
    (lines as u64).max(1)
}

pub fn run(args: SimulateArgs) -> Result<()> {
    let policies = if args.policy.is_empty() {
        ssdcache_engine::policy::names()
            .iter()
            .map(|s| s.to_string())
            .collect()
    } else {
        args.policy.clone()
    };
    let writeback = args.writeback.model()?;
    let (summary, info) = summarize(&args.trace)?;
    let mut configs = Vec::new();
    for policy in &policies {
        for &admission in &args.admission {
            for &size in &args.cache_size {
                configs.push(SimConfig {
                    policy: policy.clone(),
                    cache_lines: cache_lines(
                        size,
                        args.trace.line_size,
                        summary.unique_lines,
                        info.sample_rate,
                    ),
                    line_size: args.trace.line_size,
                    admission,
                    sequential_cutoff: args.sequential_cutoff,
                    mode: args.mode,
                    writeback: writeback.clone(),
                });
            }
        }
    }
    let report = simulate_all(&args.trace, &info, summary, &configs, args.jobs)?;
    if let Some(path) = &args.plot {
        write_plot(path, &report)?;
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else if args.csv {
        report.write_csv(&mut out)?;
    } else {
        report.write_table(&mut out)?;
    }
    Ok(())
}

/// Simulates `configs` over one more pass of the trace.
pub fn simulate_all(
    args: &TraceArgs,
    info: &TraceInfo,
    summary: TraceSummary,
    configs: &[SimConfig],
    jobs: Option<usize>,
) -> Result<Report> {
    let jobs = jobs.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let trace = open_trace(args)?;
    let results = simulate::run(progress(trace, "simulating"), configs, jobs)
        .context("invalid simulation settings")??;
    Ok(Report::new(args, info, summary, results))
}

/// One row of the results, scaled to the whole trace when it was sampled.
#[derive(Debug, Serialize)]
pub struct Row {
    pub policy: String,
    pub admission: String,
    pub mode: &'static str,
    pub cache_bytes: u64,
    pub cache_lines: u64,
    pub hit_ratio: f64,
    pub read_hit_ratio: f64,
    pub write_hit_ratio: f64,
    pub read_refs: u64,
    pub write_refs: u64,
    pub bypassed_refs: u64,
    pub not_admitted_refs: u64,
    pub cache_bytes_written: u64,
    pub backing_bytes_read: u64,
    pub backing_bytes_written: u64,
    /// Write-back: write references to lines already dirty (absorbed).
    pub overwrite_refs: u64,
    /// Write-back: write references sent to the backing device because the cache was at its
    /// dirty limit (or had no clean line).
    pub written_around_refs: u64,
    /// Write-back: what the cleaner wrote back during the trace (part of
    /// `backing_bytes_written`).
    pub cleaned_bytes: u64,
    /// Write-back: the most lines dirty at once, as a share of the cache's lines.
    pub peak_dirty_share: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub trace: String,
    pub format: String,
    pub sample_rate: f64,
    pub line_size: u64,
    pub footprint_bytes: u64,
    pub summary: TraceSummary,
    pub rows: Vec<Row>,
}

impl Report {
    fn new(
        args: &TraceArgs,
        info: &TraceInfo,
        summary: TraceSummary,
        results: Vec<SimResult>,
    ) -> Report {
        let scale = 1.0 / info.sample_rate;
        let up = |v: u64| (v as f64 * scale).round() as u64;
        let rows = results
            .into_iter()
            .map(|r| {
                let c = &r.counters;
                Row {
                    policy: r.config.policy.clone(),
                    admission: r.config.admission.to_string(),
                    mode: r.config.mode.name(),
                    cache_bytes: up(r.config.cache_lines * r.config.line_size),
                    cache_lines: up(r.config.cache_lines),
                    hit_ratio: c.hit_ratio(),
                    read_hit_ratio: c.read_hit_ratio(),
                    write_hit_ratio: c.write_hit_ratio(),
                    read_refs: c.read_refs,
                    write_refs: c.write_refs,
                    bypassed_refs: c.bypassed_refs,
                    not_admitted_refs: c.not_admitted_refs,
                    cache_bytes_written: up(c.cache_bytes_written),
                    backing_bytes_read: up(c.backing_bytes_read),
                    backing_bytes_written: up(c.backing_bytes_written),
                    overwrite_refs: c.overwrite_refs,
                    written_around_refs: c.written_around_refs,
                    cleaned_bytes: up(c.cleaned_bytes),
                    peak_dirty_share: c.peak_dirty_lines as f64
                        / r.config.cache_lines.max(1) as f64,
                }
            })
            .collect();
        Report {
            trace: args.trace.display().to_string(),
            format: info.format.name().to_string(),
            sample_rate: info.sample_rate,
            line_size: args.line_size,
            footprint_bytes: up(summary.unique_lines * args.line_size),
            summary,
            rows,
        }
    }

    fn write_table(&self, out: &mut impl Write) -> Result<()> {
        let s = &self.summary;
        writeln!(
            out,
            "trace {} ({}): {} requests ({} reads, {} writes), {} line references of {}{}",
            self.trace,
            self.format,
            s.requests,
            s.reads,
            s.writes,
            s.line_refs,
            human(self.line_size),
            if s.seconds > 0.0 {
                format!(", {:.1} s", s.seconds)
            } else {
                String::new()
            }
        )?;
        writeln!(
            out,
            "footprint {} ({} unique lines){}",
            human(self.footprint_bytes),
            s.unique_lines,
            if self.sample_rate < 1.0 {
                format!(
                    "; the trace recorded {:.3}% of the address space: sizes and bytes are scaled to the whole",
                    self.sample_rate * 100.0
                )
            } else {
                String::new()
            }
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "{:<12} {:<9} {:>10} {:>7} {:>7} {:>7} {:>11} {:>11} {:>11}",
            "policy",
            "admission",
            "cache",
            "hit%",
            "read%",
            "write%",
            "SSD writes",
            "HDD reads",
            "HDD writes"
        )?;
        for r in &self.rows {
            writeln!(
                out,
                "{:<12} {:<9} {:>10} {:>7.2} {:>7.2} {:>7} {:>11} {:>11} {:>11}",
                r.policy,
                r.admission,
                human(r.cache_bytes),
                r.hit_ratio * 100.0,
                r.read_hit_ratio * 100.0,
                if r.write_refs == 0 {
                    "-".to_string()
                } else {
                    format!("{:.2}", r.write_hit_ratio * 100.0)
                },
                human(r.cache_bytes_written),
                human(r.backing_bytes_read),
                human(r.backing_bytes_written),
            )?;
        }
        if self
            .rows
            .first()
            .is_some_and(|r| r.mode == Mode::WriteBack.name())
        {
            self.write_writeback_table(out)?;
        }
        writeln!(out)?;
        writeln!(
            out,
            "hit% counts line references; SSD writes are the cache device's writes (endurance); \
             HDD writes include writing back dirty lines. Mode {}, see docs/simulator.md.",
            self.rows.first().map_or("-", |r| r.mode)
        )?;
        Ok(())
    }

    /// Write-back: how much the dirty lines absorbed and what the dirty limit sent around.
    fn write_writeback_table(&self, out: &mut impl Write) -> Result<()> {
        writeln!(out)?;
        writeln!(
            out,
            "{:<12} {:<9} {:>10} {:>10} {:>9} {:>11} {:>11}",
            "policy", "admission", "cache", "absorbed%", "around%", "peak dirty", "written back"
        )?;
        let share = |n: u64, of: u64| {
            if of == 0 {
                "-".to_string()
            } else {
                format!("{:.2}", n as f64 * 100.0 / of as f64)
            }
        };
        for r in &self.rows {
            writeln!(
                out,
                "{:<12} {:<9} {:>10} {:>10} {:>9} {:>10.1}% {:>11}",
                r.policy,
                r.admission,
                human(r.cache_bytes),
                share(r.overwrite_refs, r.write_refs),
                share(r.written_around_refs, r.write_refs),
                r.peak_dirty_share * 100.0,
                human(r.cleaned_bytes),
            )?;
        }
        writeln!(
            out,
            "absorbed%: writes to lines already dirty; around%: writes sent to the disk at the \
             dirty limit; written back: by the cleaner during the trace (the rest at the end)."
        )?;
        Ok(())
    }

    fn write_csv(&self, out: &mut impl Write) -> Result<()> {
        writeln!(
            out,
            "policy,admission,mode,cache_bytes,cache_lines,hit_ratio,read_hit_ratio,write_hit_ratio,\
             read_refs,write_refs,bypassed_refs,not_admitted_refs,cache_bytes_written,\
             backing_bytes_read,backing_bytes_written,overwrite_refs,written_around_refs,\
             cleaned_bytes,peak_dirty_share"
        )?;
        for r in &self.rows {
            writeln!(
                out,
                "{},{},{},{},{},{:.6},{:.6},{:.6},{},{},{},{},{},{},{},{},{},{},{:.6}",
                r.policy,
                r.admission,
                r.mode,
                r.cache_bytes,
                r.cache_lines,
                r.hit_ratio,
                r.read_hit_ratio,
                r.write_hit_ratio,
                r.read_refs,
                r.write_refs,
                r.bypassed_refs,
                r.not_admitted_refs,
                r.cache_bytes_written,
                r.backing_bytes_read,
                r.backing_bytes_written,
                r.overwrite_refs,
                r.written_around_refs,
                r.cleaned_bytes,
                r.peak_dirty_share
            )?;
        }
        Ok(())
    }
}

fn write_plot(path: &Path, report: &Report) -> Result<()> {
    let mut series: Vec<Series> = Vec::new();
    for r in &report.rows {
        let name = if r.admission == "always" {
            r.policy.clone()
        } else {
            format!("{} {}", r.policy, r.admission)
        };
        let point = (r.cache_bytes as f64, r.hit_ratio);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![point],
            }),
        }
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let chart = LineChart {
        title: format!(
            "{}: hit ratio by cache size",
            Path::new(&report.trace)
                .file_name()
                .map_or(report.trace.clone(), |f| f.to_string_lossy().into_owned())
        ),
        x: SizeAxis::Bytes,
        y: RatioAxis::HitRatio,
        log_x: true,
        series,
    };
    let svg = chart.to_svg().context("cannot draw the plot")?;
    std::fs::write(path, svg).with_context(|| format!("cannot write plot {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_bytes_or_shares() {
        assert_eq!(parse_cache_size("1GiB"), Ok(CacheSize::Bytes(1 << 30)));
        assert_eq!(parse_cache_size("10%"), Ok(CacheSize::Percent(10.0)));
        assert!(parse_cache_size("0").is_err());
        assert!(parse_cache_size("-5%").is_err());
        assert!(parse_cache_size("ten%").is_err());
    }

    #[test]
    fn sizes_become_lines_scaled_by_the_sampling_rate() {
        assert_eq!(cache_lines(CacheSize::Bytes(1 << 20), 4096, 0, 1.0), 256);
        assert_eq!(cache_lines(CacheSize::Bytes(1 << 20), 4096, 0, 0.01), 3);
        assert_eq!(
            cache_lines(CacheSize::Percent(10.0), 4096, 102_348, 1.0),
            10_234
        );
        assert_eq!(cache_lines(CacheSize::Bytes(1), 4096, 0, 0.001), 1);
    }
}
