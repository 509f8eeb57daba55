//! `stats --watch`: a running daemon's statistics redrawn every few seconds, with request and
//! byte rates and read hit ratios over the last interval, the last 5 minutes and the last hour
//! (the windows bcache's `stats_five_minute` and `stats_hour` show). The daemon's counters
//! are totals; the rates are differences between samples this command keeps.

use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ssdcache_format::VolumeCounters;

use crate::report::{StatsReport, VolumeReport};
use crate::size::human;

/// The windows shown beside the last interval's, as (label, length).
const WINDOWS: [(&str, Duration); 2] = [
    ("5 min", Duration::from_secs(300)),
    ("1 hour", Duration::from_secs(3600)),
];
/// Samples older than the longest window are dropped.
const HISTORY: Duration = Duration::from_secs(3600);
/// Kept samples are at least this far apart, so the history holds at most 721 of them
/// whatever the interval (a window's start is then known to within this).
const HISTORY_STEP: Duration = Duration::from_secs(5);

/// The shortest and longest refresh interval `--watch` accepts, in seconds.
pub const MIN_INTERVAL: f64 = 0.2;
pub const MAX_INTERVAL: f64 = 3600.0;

/// One reading of every volume's counters.
#[derive(Clone)]
struct Sample {
    at: Instant,
    volumes: Vec<(String, Vec<u64>)>,
}

impl Sample {
    fn of(report: &StatsReport, at: Instant) -> Sample {
        let volumes = report
            .volumes
            .iter()
            .map(|v| {
                let counters = VolumeCounters::NAMES
                    .iter()
                    .map(|n| v.counters.get(*n).copied().unwrap_or(0))
                    .collect();
                (v.name.clone(), counters)
            })
            .collect();
        Sample { at, volumes }
    }

    fn counters(&self, volume: &str) -> Option<&[u64]> {
        self.volumes
            .iter()
            .find(|(n, _)| n == volume)
            .map(|(_, c)| c.as_slice())
    }

    /// False if `later` cannot follow this sample: a volume came or went, or a counter went
    /// back (the daemon restarted, and its totals restarted from the saved ones).
    fn continues_into(&self, later: &Sample) -> bool {
        self.volumes.len() == later.volumes.len()
            && self.volumes.iter().all(|(name, old)| {
                later
                    .counters(name)
                    .is_some_and(|new| old.iter().zip(new).all(|(a, b)| a <= b))
            })
    }
}

/// The samples the rates are computed from.
#[derive(Default)]
struct History {
    /// At least [`HISTORY_STEP`] apart, but for the newest, over at most [`HISTORY`].
    samples: VecDeque<Sample>,
    /// The reading before the newest: the last interval's start.
    previous: Option<Sample>,
}

impl History {
    /// Adds a sample; returns false if the history had to restart (see `continues_into`).
    fn push(&mut self, sample: Sample) -> bool {
        let continued = self
            .samples
            .back()
            .is_none_or(|last| last.continues_into(&sample));
        self.previous = if continued {
            self.samples.back().cloned()
        } else {
            self.samples.clear();
            None
        };
        // The newest reading replaces the one before it while that one is less than a step
        // after its predecessor: every pair but the last is a step apart or more, and the
        // history always ends with the latest reading.
        let n = self.samples.len();
        if n >= 2
            && self.samples[n - 1]
                .at
                .duration_since(self.samples[n - 2].at)
                < HISTORY_STEP
        {
            self.samples.pop_back();
        }
        self.samples.push_back(sample);
        while let Some(first) = self.samples.front() {
            let newest = self.samples.back().map_or(first.at, |s| s.at);
            if newest.duration_since(first.at) > HISTORY && self.samples.len() > 2 {
                self.samples.pop_front();
            } else {
                break;
            }
        }
        continued
    }

    /// The oldest sample no older than `window` before the newest, if it is not the newest.
    fn start_of(&self, window: Duration) -> Option<&Sample> {
        let newest = self.samples.back()?;
        self.samples
            .iter()
            .find(|s| newest.at.duration_since(s.at) <= window)
            .filter(|s| s.at < newest.at)
    }
}

/// What happened to one volume between two samples.
struct Delta {
    seconds: f64,
    counters: Vec<u64>,
}

impl Delta {
    fn between(old: &Sample, new: &Sample, volume: &str) -> Option<Delta> {
        let (a, b) = (old.counters(volume)?, new.counters(volume)?);
        Some(Delta {
            seconds: new.at.duration_since(old.at).as_secs_f64(),
            counters: a.iter().zip(b).map(|(a, b)| b - a).collect(),
        })
    }

    fn get(&self, name: &str) -> u64 {
        VolumeCounters::NAMES
            .iter()
            .position(|n| *n == name)
            .map_or(0, |i| self.counters[i])
    }

    fn per_second(&self, name: &str) -> f64 {
        self.get(name) as f64 / self.seconds.max(1e-9)
    }

    fn hit_ratio(&self) -> Option<f64> {
        let (hits, misses) = (self.get("read_hits"), self.get("read_misses"));
        (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64)
    }
}

/// `ssdcache stats --watch`: redraws the daemon's statistics every `interval` until
/// interrupted, or `count` times. Fails when the daemon stops answering.
pub fn run(control: &Path, interval: Duration, count: Option<u64>) -> Result<()> {
    let mut history = History::default();
    let terminal = std::io::stdout().is_terminal();
    let started = Instant::now();
    let mut shown = 0u64;
    loop {
        let report = query(control)?;
        let now = Instant::now();
        let continued = history.push(Sample::of(&report, now));
        let mut screen = String::new();
        render(
            &mut screen,
            &report,
            &history,
            interval,
            now.duration_since(started),
            continued,
        );
        let mut out = std::io::stdout().lock();
        if terminal {
            // Home and clear, so the screen is redrawn in place.
            write!(out, "\x1b[H\x1b[2J")?;
        } else if shown > 0 {
            writeln!(out)?;
        }
        write!(out, "{screen}")?;
        out.flush()?;
        shown += 1;
        if count.is_some_and(|c| shown >= c) {
            return Ok(());
        }
        std::thread::sleep(interval.saturating_sub(now.elapsed()));
    }
}

fn query(control: &Path) -> Result<StatsReport> {
    crate::report::live_stats_from(control)?.with_context(|| {
        format!(
            "no daemon answers on control socket {}: `stats --watch` shows a running daemon's \
             statistics (start `ssdcache serve`, or leave out --watch for the statistics saved \
             at the last stop)",
            control.display()
        )
    })
}

fn render(
    s: &mut String,
    r: &StatsReport,
    history: &History,
    interval: Duration,
    running: Duration,
    continued: bool,
) {
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "cache {}: {} lines of {}, {}   every {}, watching for {}   (Ctrl-C to stop)",
        r.cache,
        r.lines,
        human(r.line_size),
        human(r.capacity_bytes),
        span(interval),
        span(Duration::from_secs(running.as_secs()))
    );
    if history.previous.is_none() {
        let _ = writeln!(s, "(rates and ratios from the next refresh on)");
    }
    if !continued {
        let _ = writeln!(
            s,
            "(the daemon's totals went back or its volumes changed: it restarted; rates start again)"
        );
    }
    let newest = history.samples.back();
    let previous = history.previous.as_ref();
    let windows: Vec<(String, Option<&Sample>)> = std::iter::once(("last".to_owned(), previous))
        .chain(WINDOWS.iter().map(|(label, length)| {
            let start = history.start_of(*length);
            let label = match (start, newest) {
                (Some(first), Some(last))
                    if last.at.duration_since(first.at) + HISTORY_STEP < *length =>
                {
                    format!(
                        "{label} ({} so far)",
                        span(last.at.duration_since(first.at))
                    )
                }
                _ => (*label).to_owned(),
            };
            (label, start)
        }))
        .collect();
    for v in &r.volumes {
        render_volume(s, r, v, newest, &windows);
    }
}

fn render_volume(
    s: &mut String,
    r: &StatsReport,
    v: &VolumeReport,
    newest: Option<&Sample>,
    windows: &[(String, Option<&Sample>)],
) {
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "\nvolume {} ({}, {}, {})   dirty {} in {} lines   occupancy {} ({:.1}% of the cache)",
        v.name,
        v.mode,
        human(v.size),
        v.state,
        human(v.dirty_bytes),
        v.dirty_lines,
        human(v.occupancy_bytes),
        100.0 * v.lines_used as f64 / r.lines.max(1) as f64
    );
    let deltas: Vec<Option<Delta>> = windows
        .iter()
        .map(|(_, start)| Delta::between((*start)?, newest?, &v.name))
        .collect();
    let _ = write!(s, "  {:<22}", "");
    for (label, _) in windows {
        let _ = write!(s, "{label:>22}");
    }
    let _ = writeln!(s);
    let row = |s: &mut String, name: &str, cell: &dyn Fn(&Delta) -> String| {
        let _ = write!(s, "  {name:<22}");
        for d in &deltas {
            let text = d.as_ref().map_or_else(|| "-".to_owned(), cell);
            let _ = write!(s, "{text:>22}");
        }
        let _ = writeln!(s);
    };
    let count = |k: &'static str| move |d: &Delta| format!("{:.1}", d.per_second(k));
    let bytes = |k: &'static str| move |d: &Delta| format!("{}/s", human(d.per_second(k) as u64));
    row(s, "read hit ratio", &|d| {
        d.hit_ratio()
            .map_or_else(|| "no reads".to_owned(), |h| format!("{:.1}%", 100.0 * h))
    });
    row(s, "reads/s", &count("reads"));
    row(s, "writes/s", &count("writes"));
    row(s, "write hits/s", &count("write_hits"));
    row(s, "read from cache", &bytes("bytes_from_cache"));
    row(s, "read from backing", &bytes("bytes_from_backing"));
    row(s, "written to cache", &bytes("bytes_to_cache"));
    row(s, "written to backing", &bytes("bytes_to_backing"));
    row(s, "written back", &bytes("bytes_cleaned"));
    row(s, "sequential bypass", &bytes("bytes_bypassed"));
    row(s, "not admitted", &bytes("bytes_not_admitted"));
    row(
        s,
        "around (dirty limit)",
        &bytes("bytes_written_around_full"),
    );
    row(s, "errors", &|d| {
        (d.get("cache_errors") + d.get("backing_errors") + d.get("dirty_read_errors")).to_string()
    });
}

/// A duration as people read it: "2 s", "1m10s", "1h05m".
fn span(d: Duration) -> String {
    let ms = d.as_millis();
    let secs = d.as_secs();
    if secs < 60 {
        if ms.is_multiple_of(1000) || secs >= 10 {
            format!("{secs} s")
        } else {
            format!("{:.1} s", d.as_secs_f64())
        }
    } else if secs < 3600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{}h{:02}m", secs / 3600, secs % 3600 / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, reads: u64, hits: u64) -> Sample {
        let mut c = vec![0; VolumeCounters::NAMES.len()];
        c[0] = reads;
        c[2] = hits;
        c[3] = reads - hits;
        Sample {
            at,
            volumes: vec![("vol0".to_owned(), c)],
        }
    }

    #[test]
    fn rates_and_ratios_over_each_window() {
        let t0 = Instant::now();
        let mut h = History::default();
        // 100 reads a second for 10 minutes, all hits after the first 5 minutes.
        for i in 0..=600u64 {
            let misses = i.min(300) * 100;
            assert!(h.push(sample(
                t0 + Duration::from_secs(i),
                i * 100,
                i * 100 - misses
            )));
        }
        assert!(h.samples.len() <= 600 / 5 + 2, "{}", h.samples.len());
        let newest = h.samples.back().expect("newest");
        let five = h.start_of(Duration::from_secs(300)).expect("5 min");
        let d = Delta::between(five, newest, "vol0").expect("delta");
        assert!((d.per_second("reads") - 100.0).abs() < 1e-9);
        assert_eq!(d.hit_ratio(), Some(1.0));
        let hour = h.start_of(HISTORY).expect("hour");
        let d = Delta::between(hour, newest, "vol0").expect("delta");
        assert!((d.hit_ratio().expect("reads") - 0.5).abs() < 0.01);
    }

    #[test]
    fn a_restarted_daemon_restarts_the_rates() {
        let t0 = Instant::now();
        let mut h = History::default();
        assert!(h.push(sample(t0, 1000, 10)));
        assert!(h.push(sample(t0 + Duration::from_secs(10), 2000, 20)));
        assert!(!h.push(sample(t0 + Duration::from_secs(20), 5, 5)));
        assert_eq!(h.samples.len(), 1);
        assert!(h.previous.is_none());
        assert!(h.start_of(Duration::from_secs(300)).is_none());
        assert!(h.push(sample(t0 + Duration::from_secs(22), 7, 7)));
        let d = Delta::between(
            h.previous.as_ref().expect("previous"),
            &sample(t0 + Duration::from_secs(22), 7, 7),
            "vol0",
        );
        assert!((d.expect("delta").per_second("reads") - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_history_stays_bounded() {
        let t0 = Instant::now();
        let mut h = History::default();
        for i in 0..20_000u64 {
            h.push(sample(t0 + Duration::from_millis(i * 400), i, i));
        }
        assert!(h.samples.len() <= 3600 / 5 + 2, "{}", h.samples.len());
        let newest = h.samples.back().expect("newest").at;
        let oldest = h.samples.front().expect("oldest").at;
        assert!(newest.duration_since(oldest) <= HISTORY + HISTORY_STEP);
    }

    #[test]
    fn spans_read_naturally() {
        assert_eq!(span(Duration::from_secs(2)), "2 s");
        assert_eq!(span(Duration::from_millis(500)), "0.5 s");
        assert_eq!(span(Duration::from_secs(70)), "1m10s");
        assert_eq!(span(Duration::from_secs(3900)), "1h05m");
    }
}
