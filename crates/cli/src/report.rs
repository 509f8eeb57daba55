//! `info` and `stats`: the same reports from a running daemon (control socket) or offline
//! from the devices, printed for people or as JSON.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use ssdcache_engine::{Cache, VolumeStats};
use ssdcache_format::{CacheState, Superblock, VolumeCounters};
use ssdcache_trace::record::RecordStatus;

use crate::control;
use crate::devices::read_cache;
use crate::size::human;
use crate::wear::{WearReport, WearWatch};

#[derive(Args)]
pub struct InfoArgs {
    /// Cache device or file
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Print JSON instead of text
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct StatsArgs {
    /// Cache device or file (finds the daemon's control socket, or reads offline)
    #[arg(long, value_name = "PATH", required_unless_present = "control")]
    cache: Option<PathBuf>,
    /// Control socket of a running daemon; given, it must answer (no offline fallback)
    /// [default: derived from the cache's UUID]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Print JSON instead of text
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Redraw the running daemon's statistics every SECONDS (default 2, from 0.2 to 3600)
    /// until Ctrl-C, with per-volume request and byte rates and read hit ratios over the last
    /// interval, the last 5 minutes and the last hour (counted from when the watch started).
    /// Needs a running daemon.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// With --watch: stop after N screens (for scripts; default: until interrupted)
    #[arg(long, value_name = "N", requires = "watch")]
    count: Option<u64>,
}

#[derive(Serialize, Deserialize)]
pub struct VolumeReport {
    pub name: String,
    pub mode: String,
    pub size: u64,
    #[serde(flatten)]
    pub counters: std::collections::BTreeMap<String, u64>,
    pub read_hit_ratio: f64,
    pub lines_used: u64,
    pub occupancy_bytes: u64,
    /// The mode the volume is configured with (`mode` is what it serves in now).
    pub configured_mode: String,
    /// "healthy", "pass-through after cache errors", or "cache failed, dirty data at risk".
    pub state: String,
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
    /// False while the cache holds data the backing device lacks.
    pub backing_consistent: bool,
    /// Live: the volume's own cap on dirty lines (`[volume.NAME] dirty_limit`), if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_limit_lines: Option<u64>,
    /// Live: the volume's cap on the lines it holds (`[volume.NAME] occupancy_limit`), if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occupancy_limit_lines: Option<u64>,
    /// Live: its admission and sequential cutoff now (the superblock keeps them too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequential_cutoff: Option<u64>,
}

#[derive(Serialize, Deserialize)]
pub struct StatsReport {
    /// "live" (from the daemon) or "offline" (saved at the last clean stop).
    pub source: String,
    pub cache: String,
    pub line_size: u64,
    pub lines: u64,
    pub capacity_bytes: u64,
    pub volumes: Vec<VolumeReport>,
    /// Live: the most lines that may be dirty (`serve --dirty-limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_limit_lines: Option<u64>,
    /// Live: seconds the oldest dirty data has been dirty (the cleaner writes back what is
    /// older than `--writeback-max-age`); absent without dirty data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_dirty_age_seconds: Option<u64>,
    /// Live: the lines in use and the dirty lines as the cache map counts them, for the whole
    /// cache; the volumes' figures add up to them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_used_lines: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dirty_lines: Option<u64>,
    /// The workload recording of `serve --record-trace`, while the daemon records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recording: Option<RecordStatus>,
    /// Live: the data checksums kept in RAM (`serve --checksum-memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum_pages: Option<ChecksumPagesReport>,
    /// The cache device's wear: bytes written, rating, rate and projected lifetime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssd: Option<WearReport>,
}

/// The metadata pages of data checksums in RAM, and their reads and writes since the start.
#[derive(Serialize, Deserialize)]
pub struct ChecksumPagesReport {
    pub resident_bytes: u64,
    pub budget_bytes: u64,
    pub modified_pages: u64,
    pub pages_read: u64,
    pub pages_written: u64,
    pub pages_lost: u64,
}

fn volume_report(v: &VolumeStats) -> VolumeReport {
    let c = &v.counters.0;
    let counters = VolumeCounters::NAMES
        .iter()
        .zip(c)
        .map(|(n, &x)| ((*n).to_owned(), x))
        .collect();
    let (hits, misses) = (c[2], c[3]);
    VolumeReport {
        name: v.name.clone(),
        mode: v.mode.to_string(),
        size: v.size,
        counters,
        read_hit_ratio: if hits + misses == 0 {
            0.0
        } else {
            hits as f64 / (hits + misses) as f64
        },
        lines_used: v.lines_used,
        occupancy_bytes: v.bytes_cached,
        configured_mode: v.configured_mode.to_string(),
        state: v.state.name().to_owned(),
        dirty_lines: v.dirty_lines,
        dirty_bytes: v.dirty_bytes,
        backing_consistent: v.dirty_bytes == 0,
        dirty_limit_lines: v.dirty_cap_lines,
        occupancy_limit_lines: v.occupancy_cap_lines,
        admission: None,
        sequential_cutoff: None,
    }
}

fn stats_report(
    source: &str,
    sb: &Superblock,
    cache_path: &Path,
    vols: &[VolumeStats],
) -> StatsReport {
    let l = sb.layout;
    StatsReport {
        source: source.to_owned(),
        cache: cache_path.display().to_string(),
        line_size: l.line_size,
        lines: l.line_count,
        capacity_bytes: l.line_count * l.line_size,
        volumes: vols.iter().map(volume_report).collect(),
        dirty_limit_lines: None,
        oldest_dirty_age_seconds: None,
        cache_used_lines: None,
        cache_dirty_lines: None,
        recording: None,
        checksum_pages: None,
        ssd: Some(WearReport::saved(sb.cache_bytes_written, sb.ssd_tbw_bytes)),
    }
}

pub fn live_stats(
    cache: &Cache,
    cache_path: &Path,
    recording: Option<RecordStatus>,
    wear: &WearWatch,
) -> StatsReport {
    let volumes = cache.volumes();
    let vols: Vec<VolumeStats> = volumes.iter().map(|v| v.stats()).collect();
    let c = cache.checksum_usage();
    let mut report = StatsReport {
        recording,
        ssd: Some(wear.report()),
        dirty_limit_lines: Some(cache.dirty_limit_lines()),
        oldest_dirty_age_seconds: cache.oldest_dirty_age().map(|age| age.as_secs()),
        cache_used_lines: Some(cache.used_lines()),
        cache_dirty_lines: Some(cache.dirty_lines()),
        checksum_pages: Some(ChecksumPagesReport {
            resident_bytes: c.resident_frames * c.frame_bytes,
            budget_bytes: c.budget_frames.saturating_mul(c.frame_bytes),
            modified_pages: c.modified_frames,
            pages_read: c.pages_read,
            pages_written: c.pages_written,
            pages_lost: c.pages_lost,
        }),
        ..stats_report("live", &cache.superblock(), cache_path, &vols)
    };
    for (r, v) in report.volumes.iter_mut().zip(volumes.iter()) {
        r.admission = Some(v.admission().to_string());
        r.sequential_cutoff = Some(v.sequential_cutoff());
    }
    report
}

pub fn stats(args: StatsArgs) -> Result<()> {
    if let Some(seconds) = args.watch {
        return watch(&args, seconds);
    }
    let report = match (&args.control, &args.cache) {
        (Some(ctl), _) => live_stats_from(ctl)?.ok_or_else(|| {
            anyhow::anyhow!(
                "no daemon answers on control socket {} (given with --control): start `ssdcache \
                 serve --control {}`, or leave --control out: `ssdcache stats --cache PATH` finds \
                 the daemon serving the cache, or reads the statistics saved at its last stop",
                ctl.display(),
                ctl.display()
            )
        })?,
        (None, Some(cache)) => stats_of_cache(cache)?,
        (None, None) => return Err(crate::usage_error("give --cache PATH or --control PATH")),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_stats(&report);
    }
    Ok(())
}

/// `stats --watch`: finds the daemon's control socket, then hands over to [`crate::watch`].
fn watch(args: &StatsArgs, seconds: f64) -> Result<()> {
    use crate::watch::{MAX_INTERVAL, MIN_INTERVAL};
    if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&seconds) {
        return Err(crate::usage_error(format!(
            "--watch {seconds}: the interval must be from {MIN_INTERVAL} to {MAX_INTERVAL} seconds"
        )));
    }
    if args.count == Some(0) {
        return Err(crate::usage_error("--count 0: give at least 1 screen"));
    }
    let control = match (&args.control, &args.cache) {
        (Some(ctl), _) => ctl.clone(),
        (None, Some(cache)) => {
            let (_dev, read) = read_cache(cache)?;
            control::default_path(&read.superblock.cache_uuid)
        }
        (None, None) => return Err(crate::usage_error("give --cache PATH or --control PATH")),
    };
    crate::watch::run(
        &control,
        std::time::Duration::from_secs_f64(seconds),
        args.count,
    )
}

pub(crate) fn live_stats_from(control_path: &Path) -> Result<Option<StatsReport>> {
    control::query(control_path, "stats")?
        .map(|v| serde_json::from_value(v).context("daemon sent stats in an unknown shape"))
        .transpose()
}

/// Live from the daemon serving the cache (found by the cache's UUID), else offline.
fn stats_of_cache(cache: &Path) -> Result<StatsReport> {
    let (dev, read) = read_cache(cache)?;
    if let Some(damaged) = &read.damaged {
        tracing::warn!("cache {}: {}", cache.display(), damaged.warning());
    }
    let sb = read.superblock;
    if let Some(live) = live_stats_from(&control::default_path(&sb.cache_uuid))? {
        return Ok(live);
    }
    let vols = ssdcache_engine::offline_stats(&*dev, &sb)?;
    Ok(stats_report("offline", &sb, cache, &vols))
}

fn print_stats(r: &StatsReport) {
    println!(
        "cache {} ({}): {} lines of {}, {}",
        r.cache,
        r.source,
        r.lines,
        human(r.line_size),
        human(r.capacity_bytes)
    );
    if let Some(limit) = r.dirty_limit_lines {
        let dirty: u64 = r.volumes.iter().map(|v| v.dirty_lines).sum();
        let age = match r.oldest_dirty_age_seconds {
            Some(s) => format!("; the oldest dirty for {s} s"),
            None => String::new(),
        };
        println!(
            "dirty lines {dirty} of at most {limit} ({:.0}% of the cache: the dirty limit){age}",
            100.0 * limit as f64 / r.lines.max(1) as f64
        );
    }
    if let Some(c) = &r.checksum_pages {
        // All the checksums take 4 bytes per 4 KiB of cache.
        let budget = if c.budget_bytes >= r.capacity_bytes / 1024 {
            "every page".to_owned()
        } else {
            human(c.budget_bytes)
        };
        println!(
            "checksums in RAM {} (budget {budget}); metadata pages read {}, written {}{}",
            human(c.resident_bytes),
            c.pages_read,
            c.pages_written,
            if c.pages_lost > 0 {
                format!(
                    ", LOST {} (their clean data is read from the backing device)",
                    c.pages_lost
                )
            } else {
                String::new()
            }
        );
    }
    if let Some(w) = &r.ssd {
        print_wear(w);
    }
    if let Some(t) = &r.recording {
        print_recording(t);
    }
    for v in &r.volumes {
        let c = |k: &str| v.counters.get(k).copied().unwrap_or(0);
        println!("volume {} ({}, {})", v.name, v.mode, human(v.size));
        if v.mode != v.configured_mode {
            println!(
                "  MODE         serving {} (configured {})",
                v.mode, v.configured_mode
            );
        }
        if v.state != "healthy" {
            println!("  STATE        {}", v.state.to_uppercase());
        }
        if v.dirty_bytes > 0 {
            println!(
                "  DIRTY        {} in {} lines: the backing device alone is NOT consistent \
                 (run `ssdcache flush` before using it without ssdcache)",
                human(v.dirty_bytes),
                v.dirty_lines
            );
        }
        if let Some(cap) = v.dirty_limit_lines {
            println!(
                "  dirty limit  {cap} lines of its own ({} dirty now)",
                v.dirty_lines
            );
        }
        if let Some(cap) = v.occupancy_limit_lines {
            println!(
                "  occupancy limit {cap} lines of its own ({} held now)",
                v.lines_used
            );
        }
        println!(
            "  reads        {:>12}   hits {} / misses {}   hit ratio {:.1}%",
            c("reads"),
            c("read_hits"),
            c("read_misses"),
            100.0 * v.read_hit_ratio
        );
        println!(
            "  writes       {:>12}   write hits {}",
            c("writes"),
            c("write_hits")
        );
        println!(
            "  from cache   {:>12}   from backing {}",
            human(c("bytes_from_cache")),
            human(c("bytes_from_backing"))
        );
        println!(
            "  to cache     {:>12}   to backing {}",
            human(c("bytes_to_cache")),
            human(c("bytes_to_backing"))
        );
        println!(
            "  trims {}  write-zeroes {}  flushes {}  sequential bypass {}  not admitted {}",
            c("trims"),
            c("write_zeroes"),
            c("flushes"),
            human(c("bytes_bypassed")),
            human(c("bytes_not_admitted"))
        );
        println!(
            "  occupancy    {:>12}   in {} lines ({:.1}% of the cache)",
            human(v.occupancy_bytes),
            v.lines_used,
            100.0 * v.lines_used as f64 / r.lines.max(1) as f64
        );
        if c("bytes_cleaned") + c("bytes_written_around_full") > 0 {
            println!(
                "  written back {:>12}   written around (at the dirty limit) {}",
                human(c("bytes_cleaned")),
                human(c("bytes_written_around_full"))
            );
        }
        if c("cache_errors") + c("backing_errors") + c("dirty_read_errors") > 0 {
            println!(
                "  ERRORS       cache device {}   backing device {}   reads of unreadable dirty data {}",
                c("cache_errors"),
                c("backing_errors"),
                c("dirty_read_errors")
            );
        }
    }
}

fn print_wear(w: &WearReport) {
    let rating = w.tbw_bytes.map_or_else(
        || " (no rating: serve --ssd-tbw TB)".to_owned(),
        |t| {
            format!(
                " of {} rated ({:.2}% used)",
                crate::wear::rating_text(t),
                100.0 * w.bytes_written as f64 / t as f64
            )
        },
    );
    let rate = match (w.bytes_written_per_day, w.rate_window_seconds) {
        (Some(day), Some(window)) => {
            format!("; {}/day over the last {:.0} s", human(day as u64), window)
        }
        _ => String::new(),
    };
    let left = w.projected_lifetime_years.map_or_else(String::new, |y| {
        format!("; {} left at that rate", crate::wear::lifetime_text(y))
    });
    println!(
        "cache device written {}{rating}{rate}{left}",
        human(w.bytes_written)
    );
    if w.short_of_a_year() {
        println!("WARNING: {}", crate::wear::lifetime_warning(w));
    }
}

fn print_recording(t: &RecordStatus) {
    let sampled = if t.sample_rate >= 1.0 {
        "every request".to_owned()
    } else {
        format!(
            "{}% of {} regions",
            100.0 * t.sample_rate,
            human(t.sample_region)
        )
    };
    println!(
        "trace {} ({}): {} requests, {} of at most {} ({sampled}), {} dropped",
        t.path,
        t.state,
        t.records_written,
        human(t.bytes_written),
        human(t.max_bytes),
        t.records_dropped
    );
    if let Some(e) = &t.error {
        println!("  TRACE ERROR  {e}");
    }
}

#[derive(Serialize, Deserialize)]
pub struct InfoReport {
    pub cache: String,
    pub uuid: String,
    pub format_version: u32,
    pub state: String,
    pub sequence: u64,
    pub unclean_starts: u64,
    pub created_unix: u64,
    pub cache_size: u64,
    pub line_size: u64,
    pub lines: u64,
    pub metadata_offset: u64,
    pub metadata_bytes: u64,
    pub journal_offset: u64,
    pub journal_bytes: u64,
    pub data_offset: u64,
    pub volumes: Vec<InfoVolume>,
    /// What the running daemon recovered from the journal at its start, if it started after
    /// an unclean stop.
    pub recovered: Option<Recovered>,
    /// Set when one superblock copy is damaged: which, why, and that it gets rewritten.
    #[serde(default)]
    pub superblock_warning: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub struct Recovered {
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
    pub journal_commits: u64,
    pub millis: u64,
}

#[derive(Serialize, Deserialize)]
pub struct InfoVolume {
    pub id: u16,
    pub name: String,
    pub uuid: String,
    pub mode: String,
    pub read_only: bool,
    pub policy: String,
    /// "always" or "N-hit".
    #[serde(default)]
    pub admission: String,
    pub sequential_cutoff: u64,
    pub backing_path: String,
    pub backing_kind: String,
    pub backing_size: u64,
    pub backing_id: String,
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
}

/// The daemon's `info`: the superblock with live modes and dirty data, and what it recovered.
pub fn live_info(cache: &Cache, cache_path: &Path) -> InfoReport {
    let mut r = info_report(&cache.superblock(), cache_path);
    r.state = "running (served by a daemon)".into();
    r.recovered = cache.recovery().map(|x| Recovered {
        dirty_lines: x.dirty_lines,
        dirty_bytes: x.dirty_bytes,
        journal_commits: x.commits,
        millis: x.millis,
    });
    r
}

pub fn info_report(sb: &Superblock, cache_path: &Path) -> InfoReport {
    let l = sb.layout;
    InfoReport {
        cache: cache_path.display().to_string(),
        uuid: uuid::Uuid::from_bytes(sb.cache_uuid).to_string(),
        format_version: sb.version,
        state: match sb.state {
            CacheState::Clean => "clean".into(),
            CacheState::Running => {
                "running, or stopped uncleanly (the next start replays the journal: dirty data is \
                 recovered, clean data dropped)"
                    .into()
            }
        },
        sequence: sb.sequence,
        unclean_starts: sb.unclean_starts,
        created_unix: sb.created_unix,
        cache_size: l.cache_size,
        line_size: l.line_size,
        lines: l.line_count,
        metadata_offset: l.meta_offset,
        metadata_bytes: l.meta_len,
        journal_offset: l.journal_offset,
        journal_bytes: l.journal_len,
        data_offset: l.data_offset,
        volumes: sb
            .volumes
            .iter()
            .map(|v| InfoVolume {
                id: v.id,
                name: v.name.clone(),
                uuid: uuid::Uuid::from_bytes(v.uuid).to_string(),
                mode: v.mode.to_string(),
                read_only: v.read_only,
                policy: ssdcache_engine::policy::NAMES
                    .get(v.policy as usize)
                    .map_or_else(|| format!("unknown ({})", v.policy), |n| (*n).to_owned()),
                admission: ssdcache_engine::admission::Admission::from_disk(v.admission)
                    .map_or_else(|_| format!("unknown ({})", v.admission), |a| a.to_string()),
                sequential_cutoff: v.sequential_cutoff,
                backing_path: v.backing.path.clone(),
                backing_kind: format!("{:?}", v.backing.kind),
                backing_size: v.backing.size,
                backing_id: v.backing.stable_id.clone(),
                dirty_lines: v.dirty_lines,
                dirty_bytes: v.dirty_bytes,
            })
            .collect(),
        recovered: None,
        superblock_warning: None,
    }
}

pub fn info(args: InfoArgs) -> Result<()> {
    let (dev, read) = read_cache(&args.cache)?;
    let mut sb = read.superblock;
    let mut r: InfoReport = match control::query(&control::default_path(&sb.cache_uuid), "info")? {
        Some(v) => serde_json::from_value(v).context("daemon sent info in an unknown shape")?,
        None => {
            // The superblock's dirty totals are from the last clean stop; the metadata (the
            // journal after a crash) says what the cache holds now.
            if let Ok(vols) = ssdcache_engine::offline_stats(&*dev, &sb) {
                for (slot, v) in sb.volumes.iter_mut().zip(vols) {
                    slot.dirty_lines = v.dirty_lines;
                    slot.dirty_bytes = v.dirty_bytes;
                }
            }
            info_report(&sb, &args.cache)
        }
    };
    r.superblock_warning = read.damaged.map(|d| d.warning());
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!("cache       {} (uuid {})", r.cache, r.uuid);
    println!(
        "format      version {}, sequence {}, state {}",
        r.format_version, r.sequence, r.state
    );
    if let Some(warning) = &r.superblock_warning {
        println!("WARNING     {warning}");
    }
    println!(
        "size        {} = {} lines of {} + {} metadata/journal",
        human(r.cache_size),
        r.lines,
        human(r.line_size),
        human(r.data_offset)
    );
    println!(
        "unclean     {} starts after an unclean stop",
        r.unclean_starts
    );
    for v in &r.volumes {
        println!(
            "volume {}   '{}' mode {}{} policy {} admission {} sequential cutoff {}",
            v.id,
            v.name,
            v.mode,
            if v.read_only { " read-only" } else { "" },
            v.policy,
            v.admission,
            if v.sequential_cutoff == 0 {
                "off".to_owned()
            } else {
                human(v.sequential_cutoff)
            }
        );
        println!(
            "  backing   {} ({}, {}, id {})",
            v.backing_path,
            v.backing_kind,
            human(v.backing_size),
            v.backing_id
        );
        if v.dirty_bytes == 0 {
            println!("  dirty     none (the backing device alone is consistent)");
        } else {
            println!(
                "  DIRTY     {} in {} lines: the backing device alone is NOT consistent; \
                 `ssdcache flush` (or `ssdcache recover`) writes it back",
                human(v.dirty_bytes),
                v.dirty_lines
            );
        }
    }
    if let Some(x) = &r.recovered {
        println!(
            "recovered   {} dirty lines ({}) from {} journal commits in {} ms at the last start",
            x.dirty_lines,
            human(x.dirty_bytes),
            x.journal_commits,
            x.millis
        );
    }
    Ok(())
}
