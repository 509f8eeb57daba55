//! `ssdcache mrc`: the LRU miss-ratio curve of a block trace over cache sizes, from one pass,
//! exact or estimated with SHARDS, with the error of the estimate stated (docs/mrc.md).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use ssdcache_sim::mrc::{
    evenly_spaced_sizes, Correction, CurvePoint, ExactMrc, ReuseHistogram, Sampling, ShardsMrc,
    ShardsStats,
};
use ssdcache_sim::plot::{LineChart, RatioAxis, Series, SizeAxis};
use ssdcache_sim::trace::{block_keys, Format, Request, TraceError, TraceInfo};

use crate::simulate::{self, parse_cache_size, CacheSize, TraceArgs};
use crate::size::human;

pub const LONG_ABOUT: &str = "\
Reads a block I/O trace once and prints the miss-ratio curve of an LRU cache: for every cache \
size, the fraction of references that miss. Every request is split into the --line-size blocks \
(cache lines) it touches, one reference each, reads and writes alike. The curve shows how much a \
bigger cache would help (where it flattens, more SSD buys little) and is the input for sizing a \
cache; `ssdcache simulate` runs the engine's other policies over the same trace.\n\n\
Methods (--method):\n  \
exact: every reference's LRU stack distance (Mattson et al.), which gives the miss ratio at \
every size at once. Memory grows with the trace's footprint: about 65 bytes per unique line at \
its peak (a trace touching 100 GiB in 4 KiB lines: 26 million lines, 1.7 GB of memory), and time \
with it: from 0.1 µs per reference when the lines fit in the CPU caches to 1 µs with millions.\n  \
shards-size: SHARDS (Waldspurger et al., FAST'15) with a fixed-size sample: tracks only the lines \
whose hash falls under a threshold, at most --max-keys of them (the threshold drops as the \
sample fills), and scales the distances up. Memory is bounded (under 10 MB at the default) \
whatever the trace, and a reference not sampled costs only a hash; a trace with fewer unique \
lines than --max-keys is computed exactly.\n  \
shards-rate: SHARDS with a fixed rate: samples --sample-rate of the lines; memory grows with the \
footprint times the rate.\n  \
auto (default): exact while the trace has at most --exact-max-lines unique lines (4 Mi: about \
270 MB, a footprint of 16 GiB in 4 KiB lines), fixed-size SHARDS (computed alongside in the same \
pass) beyond.\n\n\
Error: SHARDS' mean absolute error over the curve is about 1/sqrt(K) for K sampled lines (0.004 \
at the default 65536), rarely above 3.5/sqrt(K); measured against the exact curve on every shared \
trace in docs/mrc.md. The output states K and the expected error; --check also computes the exact \
curve and prints the actual error. A trace recorded with `serve --record-trace --record-sample` is \
already a sample of the disk's regions: sizes and the footprint are scaled up by the rate, and the \
output states the error the region sampling adds.\n\n\
Output: a summary and a table of selected sizes on standard output (--json for all of it as \
JSON), --csv for every size, --plot for an SVG chart of the hit ratio against cache size. Long \
traces show progress on a terminal.";

/// SHARDS' mean absolute error is about this over √(sampled lines); measured on the shared
/// traces (docs/mrc.md: at most 1.07 for the mean over 20 seeds).
const SHARDS_TYPICAL_ERROR: f64 = 1.0;
/// The largest error × √(sampled lines) of any one sample seen on the shared traces (3.3).
const SHARDS_WORST_ERROR: f64 = 3.5;
/// Region sampling of a recording errs by about this over √(regions kept) (docs/mrc.md:
/// at most 0.7 on average, 1.8 for one sample).
const REGION_TYPICAL_ERROR: f64 = 1.0;
/// Above this expected error the output suggests another method.
const USEFUL_ERROR: f64 = 0.02;
/// Sizes of the default table, in percent of the footprint.
const TABLE_PERCENTS: [f64; 7] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0];
/// Default curve: this many sizes evenly spaced up to the footprint.
const DEFAULT_POINTS: u64 = 100;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Method {
    /// Exact while the trace has at most --exact-max-lines unique lines, fixed-size SHARDS beyond
    Auto,
    /// Every line tracked: exact, memory proportional to the footprint
    Exact,
    /// SHARDS sampling a fixed fraction (--sample-rate) of the lines
    ShardsRate,
    /// SHARDS sampling at most --max-keys lines: bounded memory
    ShardsSize,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(rate) if rate > 0.0 && rate <= 1.0 => Ok(rate),
        _ => Err(format!("{s:?} is not a sampling rate in (0, 1] (try 0.01)")),
    }
}

#[derive(Args)]
pub struct MrcArgs {
    #[command(flatten)]
    trace: TraceArgs,
    /// How to compute the curve
    #[arg(long, value_enum, default_value_t = Method::Auto)]
    method: Method,
    /// shards-rate: the fraction of lines sampled
    #[arg(long, value_name = "R", default_value = "0.01", value_parser = parse_rate)]
    sample_rate: f64,
    /// shards-size and auto: the most lines the sample holds (about 100 bytes each)
    #[arg(long, value_name = "N", default_value_t = 65536,
          value_parser = clap::value_parser!(u64).range(1..))]
    max_keys: u64,
    /// auto: the most unique lines computed exactly (about 65 bytes each) before falling back to
    /// fixed-size SHARDS
    #[arg(long, value_name = "N", default_value_t = 4 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    exact_max_lines: u64,
    /// SHARDS: selects the hash function; another seed draws another sample
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
    /// Cache sizes, comma-separated: bytes (64GiB) or percent of the footprint (10%) [default:
    /// 100 sizes evenly spaced from 1% to 100% of the footprint]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_cache_size)]
    sizes: Vec<CacheSize>,
    /// Write every size's point as CSV to FILE (- for standard output; the summary then goes to
    /// standard error): cache_bytes,cache_lines,fraction_of_footprint,miss_ratio,hit_ratio
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Print the summary and every point as JSON instead of text
    #[arg(long)]
    json: bool,
    /// Draw the hit ratio against cache size as an SVG chart in FILE
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Also compute the exact curve and a SHARDS curve (the method's, or fixed-size) and print
    /// the mean absolute error of the sampled one against the exact one
    #[arg(long)]
    check: bool,
}

impl MrcArgs {
    fn csv_to_stdout(&self) -> bool {
        self.csv.as_deref() == Some(Path::new("-"))
    }

    fn fixed_size(&self) -> Sampling {
        Sampling::FixedSize {
            max_keys: usize::try_from(self.max_keys).unwrap_or(usize::MAX),
        }
    }
}

pub fn run(args: MrcArgs) -> Result<()> {
    if args.json && args.csv_to_stdout() {
        usage_error("--json and --csv - both write to standard output; give --csv a file");
    }
    let trace = simulate::open_trace(&args.trace)?;
    let info = trace.info().clone();
    let mut pass = Pass::new(&args, &info)?;
    pass.read(simulate::progress(trace, "reading"), &args.trace.trace)?;
    let measured = pass.finish(&args, &info)?;
    let sizes = resolve_sizes(&args, &measured);
    let points = curve_points(&measured.histogram, &measured, &sizes);
    let check = match &measured.check {
        Some(pair) => Some(check_error(pair)?),
        None => None,
    };
    let report = Report::new(&args, &measured, points, check);
    write_outputs(&args, &report, &measured, &sizes)
}

/// Ends like a clap usage error: the message and exit status 2.
fn usage_error(message: &str) -> ! {
    use clap::CommandFactory;
    let mut command = crate::Cli::command();
    // Building names the subcommand `ssdcache mrc` in the usage line.
    command.build();
    let mut command = command.find_subcommand("mrc").cloned().unwrap_or(command);
    command
        .error(clap::error::ErrorKind::ArgumentConflict, message)
        .exit()
}

/// The estimators one pass over the trace feeds.
struct Pass {
    line_size: u64,
    exact: Option<ExactMrc>,
    shards: Option<ShardsMrc>,
    /// Auto without --check: the exact estimator is dropped once the trace has more unique
    /// lines than this, and fixed-size SHARDS carries on alone.
    drop_exact_past: Option<u64>,
    requests: u64,
    references: u64,
    /// Recorded traces sampled by region: the regions seen, to state the sampling's error.
    regions: Option<RegionCounter>,
}

struct RegionCounter {
    region_bytes: u64,
    seen: HashSet<(u32, u64)>,
}

impl Pass {
    fn new(args: &MrcArgs, info: &TraceInfo) -> Result<Pass> {
        let (with_exact, sampling) = match args.method {
            Method::Exact => (true, args.check.then(|| args.fixed_size())),
            Method::Auto => (true, Some(args.fixed_size())),
            Method::ShardsRate => (
                args.check,
                Some(Sampling::FixedRate {
                    rate: args.sample_rate,
                }),
            ),
            Method::ShardsSize => (args.check, Some(args.fixed_size())),
        };
        let shards = match sampling {
            Some(sampling) => Some(ShardsMrc::new(sampling, args.seed)?),
            None => None,
        };
        let regions = match info.sample_region {
            Some(region_bytes) if info.sample_rate < 1.0 && region_bytes > 0 => {
                Some(RegionCounter {
                    region_bytes,
                    seen: HashSet::new(),
                })
            }
            _ => None,
        };
        Ok(Pass {
            line_size: args.trace.line_size,
            exact: with_exact.then(ExactMrc::new),
            shards,
            drop_exact_past: (args.method == Method::Auto && !args.check)
                .then_some(args.exact_max_lines),
            requests: 0,
            references: 0,
            regions,
        })
    }

    fn read(
        &mut self,
        requests: impl Iterator<Item = Result<Request, TraceError>>,
        path: &Path,
    ) -> Result<()> {
        for request in requests {
            let request =
                request.with_context(|| format!("cannot read trace {}", path.display()))?;
            self.request(&request);
        }
        Ok(())
    }

    fn request(&mut self, request: &Request) {
        self.requests += 1;
        if let Some(regions) = &mut self.regions {
            let region = request.offset / regions.region_bytes;
            regions.seen.insert((request.volume, region));
        }
        for key in block_keys(request, self.line_size) {
            self.references += 1;
            if let Some(exact) = &mut self.exact {
                exact.reference(key);
            }
            if let Some(shards) = &mut self.shards {
                shards.reference(key);
            }
        }
        if let (Some(limit), Some(exact)) = (self.drop_exact_past, &self.exact) {
            if exact.unique_keys() > limit {
                self.exact = None;
            }
        }
    }

    fn finish(self, args: &MrcArgs, info: &TraceInfo) -> Result<Measured> {
        let exact = self.exact.map(|e| e.histogram());
        let shards = self
            .shards
            .map(|s| (s.histogram(Correction::None), s.stats()));
        let exact_chosen = match args.method {
            Method::Exact => true,
            Method::Auto => exact
                .as_ref()
                .is_some_and(|e| e.unique_keys() <= args.exact_max_lines as f64),
            Method::ShardsRate | Method::ShardsSize => false,
        };
        let (histogram, method, check) = match (exact, shards) {
            (Some(exact), shards) if exact_chosen => {
                let check = shards
                    .filter(|_| args.check)
                    .map(|(sampled, stats)| CheckPair {
                        exact: exact.clone(),
                        sampled,
                        stats,
                    });
                (exact, MethodUsed::Exact, check)
            }
            (exact, Some((sampled, stats))) => {
                let method = MethodUsed::Shards {
                    sampling: match args.method {
                        Method::ShardsRate => Sampling::FixedRate {
                            rate: args.sample_rate,
                        },
                        _ => args.fixed_size(),
                    },
                    stats,
                };
                let check = exact.filter(|_| args.check).map(|exact| CheckPair {
                    exact,
                    sampled: sampled.clone(),
                    stats,
                });
                (sampled, method, check)
            }
            (_, None) => unreachable!("every method without the exact curve runs SHARDS"),
        };
        if self.references == 0 || histogram.unique_keys() <= 0.0 {
            bail!(
                "{}: no request of the trace reads or writes any data, so there is no curve",
                args.trace.trace.display()
            );
        }
        Ok(Measured {
            histogram,
            method,
            check,
            requests: self.requests,
            references: self.references,
            line_size: args.trace.line_size,
            format: info.format,
            compression: info.compression.to_string(),
            trace_sample_rate: info.sample_rate,
            trace_sample_region: info.sample_region,
            regions_kept: self.regions.map(|r| r.seen.len() as u64),
        })
    }
}

#[derive(Clone, Copy)]
enum MethodUsed {
    Exact,
    Shards {
        sampling: Sampling,
        stats: ShardsStats,
    },
}

/// The exact and a SHARDS curve of the same pass, for --check.
struct CheckPair {
    exact: ReuseHistogram,
    sampled: ReuseHistogram,
    stats: ShardsStats,
}

/// What the pass measured.
struct Measured {
    /// The curve reported, in lines of the trace as recorded (see `scale`).
    histogram: ReuseHistogram,
    method: MethodUsed,
    check: Option<CheckPair>,
    requests: u64,
    references: u64,
    line_size: u64,
    format: Format,
    compression: String,
    trace_sample_rate: f64,
    trace_sample_region: Option<u64>,
    regions_kept: Option<u64>,
}

impl Measured {
    /// A line of the trace stands for this many lines of the workload (1 / the recording's
    /// sample rate).
    fn scale(&self) -> f64 {
        1.0 / self.trace_sample_rate
    }

    /// Unique lines of the trace as recorded (estimated under SHARDS).
    fn unique_trace_lines(&self) -> f64 {
        self.histogram.unique_keys()
    }

    fn footprint_bytes(&self) -> f64 {
        self.unique_trace_lines() * self.scale() * self.line_size as f64
    }
}

/// One size: where the curve is read (lines of the trace as recorded) and what it stands for.
#[derive(Clone, Copy)]
struct Size {
    trace_lines: u64,
    cache_bytes: u64,
}

fn resolve_sizes(args: &MrcArgs, measured: &Measured) -> Vec<Size> {
    let unique_lines = measured.unique_trace_lines().round().max(1.0) as u64;
    let bytes_per_trace_line = measured.line_size as f64 * measured.scale();
    let from_trace_lines = |trace_lines: u64| Size {
        trace_lines,
        cache_bytes: (trace_lines as f64 * bytes_per_trace_line).round() as u64,
    };
    let mut sizes: Vec<Size> = if args.sizes.is_empty() {
        evenly_spaced_sizes(unique_lines, DEFAULT_POINTS)
            .into_iter()
            .map(from_trace_lines)
            .collect()
    } else {
        args.sizes
            .iter()
            .map(|&spec| match spec {
                // As `simulate` reads the same sizes, so the two agree on LRU.
                CacheSize::Bytes(cache_bytes) => Size {
                    trace_lines: simulate::cache_lines(
                        spec,
                        measured.line_size,
                        unique_lines,
                        measured.trace_sample_rate,
                    ),
                    cache_bytes,
                },
                CacheSize::Percent(_) => from_trace_lines(simulate::cache_lines(
                    spec,
                    measured.line_size,
                    unique_lines,
                    measured.trace_sample_rate,
                )),
            })
            .collect()
    };
    sizes.sort_by_key(|s| (s.cache_bytes, s.trace_lines));
    sizes.dedup_by_key(|s| s.cache_bytes);
    sizes
}

#[derive(Clone, Copy, Serialize)]
struct Point {
    cache_bytes: u64,
    cache_lines: u64,
    fraction_of_footprint: f64,
    miss_ratio: f64,
    hit_ratio: f64,
}

/// `histogram`'s curve at `sizes` (the reported one, or the exact one of --check).
fn curve_points(histogram: &ReuseHistogram, measured: &Measured, sizes: &[Size]) -> Vec<Point> {
    let footprint = measured.footprint_bytes();
    sizes
        .iter()
        .map(|size| {
            let miss_ratio = histogram.miss_ratio(size.trace_lines);
            Point {
                cache_bytes: size.cache_bytes,
                cache_lines: size.cache_bytes / measured.line_size,
                fraction_of_footprint: size.cache_bytes as f64 / footprint,
                miss_ratio,
                hit_ratio: 1.0 - miss_ratio,
            }
        })
        .collect()
}

/// How far the sampled curve is from the exact one, over the sizes docs/mrc.md measures.
#[derive(Serialize)]
struct CheckResult {
    mean_absolute_error: f64,
    max_absolute_error: f64,
    /// Where the largest error is, as a fraction of the footprint.
    max_at_fraction_of_footprint: f64,
    points: usize,
    sampled_lines: u64,
    effective_rate: f64,
}

fn check_error(pair: &CheckPair) -> Result<CheckResult> {
    let unique = pair.exact.unique_keys().round() as u64;
    let sizes = evenly_spaced_sizes(unique, DEFAULT_POINTS);
    let exact = pair.exact.curve(&sizes);
    let sampled = pair.sampled.curve(&sizes);
    let mean_absolute_error = ssdcache_sim::mrc::mean_absolute_error(&exact, &sampled)?;
    let (worst, max_absolute_error) = exact
        .iter()
        .zip(&sampled)
        .map(|(e, s): (&CurvePoint, &CurvePoint)| {
            (e.cache_lines, (e.miss_ratio - s.miss_ratio).abs())
        })
        .fold(
            (0, 0.0),
            |best, next| if next.1 > best.1 { next } else { best },
        );
    Ok(CheckResult {
        mean_absolute_error,
        max_absolute_error,
        max_at_fraction_of_footprint: worst as f64 / unique as f64,
        points: sizes.len(),
        sampled_lines: pair.stats.sampled_keys,
        effective_rate: pair.stats.effective_rate,
    })
}

/// The expected error of a SHARDS sample of `sampled_lines` lines: (typical, rarely above).
fn shards_expected_error(sampled_lines: u64) -> (f64, f64) {
    let root = (sampled_lines.max(1) as f64).sqrt();
    // Miss ratios are in [0, 1], so no curve errs by more than 1.
    (
        (SHARDS_TYPICAL_ERROR / root).min(1.0),
        (SHARDS_WORST_ERROR / root).min(1.0),
    )
}

#[derive(Serialize)]
struct ShardsReport {
    sampling: &'static str,
    /// fixed-rate: the rate asked for; fixed-size: the sample's bound.
    sample_rate: Option<f64>,
    max_keys: Option<u64>,
    seed: u64,
    sampled_lines: u64,
    sampled_references: u64,
    effective_rate: f64,
    /// The sample held every line of the trace: the curve is exact.
    whole_trace: bool,
    expected_mean_absolute_error: f64,
    rarely_above: f64,
}

#[derive(Serialize)]
struct RecordingReport {
    sample_rate: f64,
    sample_region: Option<u64>,
    regions_kept: Option<u64>,
    /// About 1/√(regions kept).
    expected_mean_absolute_error: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    trace: String,
    format: String,
    compression: String,
    requests: u64,
    line_size: u64,
    line_references: u64,
    unique_lines: f64,
    footprint_bytes: f64,
    method_asked: String,
    method: &'static str,
    /// Auto fell back to SHARDS because the trace passed --exact-max-lines.
    exact_max_lines_passed: bool,
    shards: Option<ShardsReport>,
    recording: Option<RecordingReport>,
    check: Option<CheckResult>,
    points: Vec<Point>,
}

impl Report {
    fn new(
        args: &MrcArgs,
        measured: &Measured,
        points: Vec<Point>,
        check: Option<CheckResult>,
    ) -> Report {
        let (method, shards) = match measured.method {
            MethodUsed::Exact => ("exact", None),
            MethodUsed::Shards { sampling, stats } => {
                let (typical, worst) = shards_expected_error(stats.sampled_keys);
                let (name, sampling, sample_rate, max_keys) = match sampling {
                    Sampling::FixedRate { rate } => ("shards-rate", "fixed-rate", Some(rate), None),
                    Sampling::FixedSize { max_keys } => {
                        ("shards-size", "fixed-size", None, Some(max_keys as u64))
                    }
                };
                let whole_trace = stats.effective_rate >= 1.0;
                let report = ShardsReport {
                    sampling,
                    sample_rate,
                    max_keys,
                    seed: args.seed,
                    sampled_lines: stats.sampled_keys,
                    sampled_references: stats.sampled_references,
                    effective_rate: stats.effective_rate,
                    whole_trace,
                    expected_mean_absolute_error: if whole_trace { 0.0 } else { typical },
                    rarely_above: if whole_trace { 0.0 } else { worst },
                };
                (name, Some(report))
            }
        };
        let recording = (measured.trace_sample_rate < 1.0).then(|| RecordingReport {
            sample_rate: measured.trace_sample_rate,
            sample_region: measured.trace_sample_region,
            regions_kept: measured.regions_kept,
            expected_mean_absolute_error: measured
                .regions_kept
                .map(|n| REGION_TYPICAL_ERROR / (n.max(1) as f64).sqrt()),
        });
        Report {
            trace: args.trace.trace.display().to_string(),
            format: measured.format.to_string(),
            compression: measured.compression.clone(),
            requests: measured.requests,
            line_size: measured.line_size,
            line_references: measured.references,
            unique_lines: measured.unique_trace_lines() * measured.scale(),
            footprint_bytes: measured.footprint_bytes(),
            method_asked: Method::to_possible_value(&args.method)
                .map(|v| v.get_name().to_owned())
                .unwrap_or_default(),
            method,
            exact_max_lines_passed: args.method == Method::Auto
                && !matches!(measured.method, MethodUsed::Exact),
            shards,
            recording,
            check,
            points,
        }
    }
}

fn write_outputs(
    args: &MrcArgs,
    report: &Report,
    measured: &Measured,
    sizes: &[Size],
) -> Result<()> {
    if let Some(path) = &args.plot {
        let svg = plot(report, measured, sizes, &args.trace.trace)?;
        std::fs::write(path, svg)
            .with_context(|| format!("cannot write the plot to {}", path.display()))?;
    }
    if let Some(path) = &args.csv {
        let csv = csv(&report.points);
        if args.csv_to_stdout() {
            write_stdout(&csv)?;
        } else {
            std::fs::write(path, csv)
                .with_context(|| format!("cannot write the CSV to {}", path.display()))?;
        }
    }
    if args.json {
        let mut json = serde_json::to_string_pretty(report)?;
        json.push('\n');
        return write_stdout(&json);
    }
    let text = text(args, report);
    if args.csv_to_stdout() {
        eprint!("{text}");
        Ok(())
    } else {
        write_stdout(&text)
    }
}

fn write_stdout(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write to standard output")
}

fn csv(points: &[Point]) -> String {
    let mut csv =
        String::from("cache_bytes,cache_lines,fraction_of_footprint,miss_ratio,hit_ratio\n");
    for p in points {
        let _ = writeln!(
            csv,
            "{},{},{:.6},{:.6},{:.6}",
            p.cache_bytes, p.cache_lines, p.fraction_of_footprint, p.miss_ratio, p.hit_ratio
        );
    }
    csv
}

fn plot(report: &Report, measured: &Measured, sizes: &[Size], trace: &Path) -> Result<String> {
    let name = trace.file_name().map_or_else(
        || trace.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let series_name = match &report.shards {
        None => "LRU, exact".to_owned(),
        Some(s) if s.whole_trace => "LRU, exact (SHARDS sample of every line)".to_owned(),
        Some(s) => format!(
            "LRU, SHARDS {} ({} lines sampled)",
            s.sampling, s.sampled_lines
        ),
    };
    let points = |curve: &[Point]| {
        curve
            .iter()
            .map(|p| (p.cache_bytes as f64, p.hit_ratio))
            .collect()
    };
    let mut series = vec![Series {
        name: series_name,
        points: points(&report.points),
    }];
    if let (Some(pair), MethodUsed::Shards { .. }) = (&measured.check, measured.method) {
        series.push(Series {
            name: "LRU, exact (--check)".into(),
            points: points(&curve_points(&pair.exact, measured, sizes)),
        });
    }
    let chart = LineChart {
        title: format!("{name}: LRU hit ratio, {} lines", human(measured.line_size)),
        x: SizeAxis::Bytes,
        y: RatioAxis::HitRatio,
        log_x: false,
        series,
    };
    Ok(chart.to_svg()?)
}

fn text(args: &MrcArgs, report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "trace      {} ({}, {})",
        report.trace, report.format, report.compression
    );
    let _ = writeln!(out, "requests   {}", report.requests);
    let _ = writeln!(
        out,
        "references {} to {} lines",
        report.line_references,
        human(report.line_size)
    );
    let sampled = report.shards.as_ref().is_some_and(|s| !s.whole_trace);
    let estimated = if sampled || report.recording.is_some() {
        "about "
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "footprint  {estimated}{:.0} unique lines = {}",
        report.unique_lines,
        human(report.footprint_bytes.round() as u64)
    );
    method_lines(&mut out, args, report);
    if let Some(recording) = &report.recording {
        recording_lines(&mut out, recording);
    }
    if let Some(check) = &report.check {
        let _ = writeln!(
            out,
            "check      against the exact curve, SHARDS ({} sampled lines, rate {:.6}) has a mean\n           \
             absolute error of {:.4} over {} sizes 1%..100% of the footprint, at most {:.4} (at {:.0}%)",
            check.sampled_lines,
            check.effective_rate,
            check.mean_absolute_error,
            check.points,
            check.max_absolute_error,
            check.max_at_fraction_of_footprint * 100.0
        );
    }
    out.push('\n');
    table(&mut out, args, report);
    out
}

fn method_lines(out: &mut String, args: &MrcArgs, report: &Report) {
    let Some(shards) = &report.shards else {
        let why = if args.method == Method::Auto {
            format!(
                " (auto: at most --exact-max-lines {} unique lines)",
                args.exact_max_lines
            )
        } else {
            String::new()
        };
        let _ = writeln!(out, "method     exact LRU stack distances{why}");
        let _ = writeln!(out, "error      none: every line was tracked");
        return;
    };
    let what = match (shards.sample_rate, shards.max_keys) {
        (Some(rate), _) => format!("SHARDS, fixed rate {rate}"),
        (None, Some(max_keys)) => format!("SHARDS, fixed size (at most {max_keys} lines)"),
        (None, None) => "SHARDS".to_owned(),
    };
    let why = if report.exact_max_lines_passed {
        format!(
            "\n           (auto: the trace has more than --exact-max-lines {} unique lines)",
            args.exact_max_lines
        )
    } else {
        String::new()
    };
    let _ = writeln!(out, "method     {what}, seed {}{why}", shards.seed);
    if shards.whole_trace {
        let _ = writeln!(
            out,
            "error      none: the sample held every line of the trace ({}), so the curve is exact",
            shards.sampled_lines
        );
        return;
    }
    let _ = writeln!(
        out,
        "sampled    {} lines, effective rate {:.6}, {} of the references",
        shards.sampled_lines, shards.effective_rate, shards.sampled_references
    );
    let _ = writeln!(
        out,
        "error      expect a mean absolute error of about {:.4} (1/sqrt(K), K = {} sampled lines),\n           \
         rarely above {:.4} (3.5/sqrt(K)), as measured on every shared trace (docs/mrc.md){}",
        shards.expected_mean_absolute_error,
        shards.sampled_lines,
        shards.rarely_above,
        if args.check {
            ""
        } else {
            "\n           (--check computes the exact curve too and measures it)"
        }
    );
    if shards.expected_mean_absolute_error > USEFUL_ERROR {
        let _ = writeln!(
            out,
            "warning    too few lines sampled for a precise curve: use --method shards-size,\n           \
             a higher --sample-rate, or --method exact"
        );
    }
}

fn recording_lines(out: &mut String, recording: &RecordingReport) {
    let region = recording
        .sample_region
        .map_or_else(|| "regions".to_owned(), |r| format!("{} regions", human(r)));
    let _ = writeln!(
        out,
        "recording  the trace holds {} of the disk's {region} (its header says);\n           \
         cache sizes, lines and the footprint are scaled by {:.0}",
        recording.sample_rate,
        1.0 / recording.sample_rate
    );
    if let (Some(kept), Some(error)) = (
        recording.regions_kept,
        recording.expected_mean_absolute_error,
    ) {
        let _ = writeln!(
            out,
            "           {kept} regions in the trace: the region sampling adds an error of about \
             {error:.4}\n           (1/sqrt(regions); docs/mrc.md)"
        );
    }
}

fn table(out: &mut String, args: &MrcArgs, report: &Report) {
    let rows: Vec<Point> = if args.sizes.is_empty() {
        TABLE_PERCENTS
            .iter()
            .filter_map(|&percent| nearest_point(&report.points, percent / 100.0))
            .collect()
    } else {
        report.points.clone()
    };
    let _ = writeln!(
        out,
        "{:>12}  {:>11}  {:>10}  {:>9}",
        "cache size", "% footprint", "miss ratio", "hit ratio"
    );
    let mut shown = HashSet::new();
    for p in rows {
        if !shown.insert(p.cache_bytes) {
            continue;
        }
        let _ = writeln!(
            out,
            "{:>12}  {:>10.1}%  {:>10.4}  {:>9.4}",
            human(p.cache_bytes),
            p.fraction_of_footprint * 100.0,
            p.miss_ratio,
            p.hit_ratio
        );
    }
}

/// The point whose share of the footprint is nearest `fraction`.
fn nearest_point(points: &[Point], fraction: f64) -> Option<Point> {
    points.iter().copied().min_by(|a, b| {
        let distance = |p: &Point| (p.fraction_of_footprint - fraction).abs();
        distance(a).total_cmp(&distance(b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("0.01"), Ok(0.01));
        assert_eq!(parse_rate("1"), Ok(1.0));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("1.5").is_err());
        assert!(parse_rate("NaN").is_err());
    }

    #[test]
    fn expected_error_follows_the_square_root() {
        let (typical, worst) = shards_expected_error(65536);
        assert!((typical - 1.0 / 256.0).abs() < 1e-12);
        assert!((worst - 3.5 / 256.0).abs() < 1e-12);
        assert_eq!(shards_expected_error(1), (1.0, 1.0));
    }
}
