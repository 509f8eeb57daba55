//! The cache device's wear while serving: bytes written (the engine counts them and the
//! superblock keeps the total across restarts), the recent write rate, and the lifetime
//! left at that rate against the drive's endurance rating (`serve --ssd-tbw`), in the terms
//! `ssdcache advise` uses (TB of 10^12 bytes, bytes per day, years). A thread samples the
//! count every 10 s; the rate is over the last hour of samples (since the start, before).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use ssdcache_engine::Cache;

const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// The rate's window; with a sample every 10 s, at most 361 samples are kept.
const RATE_WINDOW: Duration = Duration::from_secs(3600);
/// Below this projected lifetime, `stats` and the log warn.
pub const WARN_BELOW_YEARS: f64 = 1.0;
/// The log repeats its warning at most this often.
const WARN_EVERY: Duration = Duration::from_secs(24 * 3600);
pub const TB: f64 = 1e12;

/// What `stats` and the metrics show of the cache device's wear.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct WearReport {
    /// Bytes written to the cache device by ssdcache, across restarts (as of the last
    /// superblock write when offline).
    pub bytes_written: u64,
    /// The endurance rating given with `serve --ssd-tbw`, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tbw_bytes: Option<u64>,
    /// Live: the write rate over `rate_window_seconds` (the last hour, or since the start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_written_per_day: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_window_seconds: Option<f64>,
    /// Live, with a rating and a rate above zero: the rating left over the rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projected_lifetime_years: Option<f64>,
}

impl WearReport {
    /// From the superblock alone (offline): no rate.
    pub fn saved(bytes_written: u64, tbw_bytes: u64) -> WearReport {
        WearReport {
            bytes_written,
            tbw_bytes: (tbw_bytes > 0).then_some(tbw_bytes),
            ..WearReport::default()
        }
    }

    pub fn short_of_a_year(&self) -> bool {
        self.projected_lifetime_years
            .is_some_and(|y| y < WARN_BELOW_YEARS)
    }
}

/// The samples of the bytes-written count.
pub struct WearWatch {
    cache: Arc<Cache>,
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

impl WearWatch {
    pub fn new(cache: Arc<Cache>) -> Arc<WearWatch> {
        let (_, since_start) = cache.cache_bytes_written();
        Arc::new(WearWatch {
            samples: Mutex::new(VecDeque::from([(Instant::now(), since_start)])),
            cache,
        })
    }

    /// Samples every 10 s and warns in the log (at most daily) when the projected lifetime
    /// falls under a year; on a thread of its own until the process exits.
    pub fn spawn(self: &Arc<Self>) -> Result<()> {
        let watch = self.clone();
        std::thread::Builder::new()
            .name("wear".into())
            .spawn(move || {
                let mut warned: Option<Instant> = None;
                loop {
                    std::thread::sleep(SAMPLE_EVERY);
                    watch.sample();
                    let report = watch.report();
                    if report.short_of_a_year() && warned.is_none_or(|w| w.elapsed() > WARN_EVERY) {
                        tracing::warn!("{}", lifetime_warning(&report));
                        warned = Some(Instant::now());
                    }
                }
            })
            .context("cannot start the wear sampler's thread")?;
        Ok(())
    }

    fn sample(&self) {
        let (_, since_start) = self.cache.cache_bytes_written();
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        samples.push_back((now, since_start));
        while samples.len() > 2
            && samples
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > RATE_WINDOW)
        {
            samples.pop_front();
        }
    }

    pub fn report(&self) -> WearReport {
        let (total, since_start) = self.cache.cache_bytes_written();
        let tbw = self.cache.ssd_tbw_bytes();
        let (first_at, first_bytes) = *self
            .samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .front()
            .unwrap_or(&(Instant::now(), since_start));
        let seconds = first_at.elapsed().as_secs_f64();
        let per_day = (seconds >= 1.0)
            .then(|| since_start.saturating_sub(first_bytes) as f64 * 86_400.0 / seconds);
        let projected = match (per_day, tbw) {
            (Some(rate), tbw) if rate > 0.0 && tbw > 0 => {
                Some(tbw.saturating_sub(total) as f64 / rate / 365.0)
            }
            _ => None,
        };
        WearReport {
            bytes_written: total,
            tbw_bytes: (tbw > 0).then_some(tbw),
            bytes_written_per_day: per_day,
            rate_window_seconds: per_day.map(|_| seconds),
            projected_lifetime_years: projected,
        }
    }
}

/// The line `stats` and the log show when the rating runs out within a year.
pub fn lifetime_warning(r: &WearReport) -> String {
    format!(
        "the cache device's endurance rating ({} written, serve --ssd-tbw) runs out in {} at \
         the recent rate of {}/day: plan its replacement, or reduce what is cached (admission, \
         sequential cutoff, write-around)",
        rating_text(r.tbw_bytes.unwrap_or(0)),
        lifetime_text(r.projected_lifetime_years.unwrap_or(0.0)),
        crate::size::human(r.bytes_written_per_day.unwrap_or(0.0) as u64)
    )
}

/// A rating as data sheets give it (TB of 10^12 bytes), or in bytes when under 1 TB.
pub fn rating_text(bytes: u64) -> String {
    if bytes as f64 >= TB {
        format!("{:.1} TB", bytes as f64 / TB)
    } else {
        crate::size::human(bytes)
    }
}

/// Years, days or hours, whichever reads best.
pub fn lifetime_text(years: f64) -> String {
    if years >= 1.0 {
        format!("{years:.1} years")
    } else if years * 365.0 >= 1.0 {
        format!("{:.1} days", years * 365.0)
    } else {
        format!("{:.1} hours", years * 365.0 * 24.0)
    }
}

/// `--ssd-tbw TB`: terabytes (10^12 bytes), above zero.
pub fn parse_tbw(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(tb) if tb.is_finite() && tb > 0.0 => Ok(tb),
        _ => Err(format!(
            "'{s}' is not a rating in terabytes written above zero (for example 600 for 600 TBW)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratings_parse_as_terabytes() {
        assert_eq!(parse_tbw("600"), Ok(600.0));
        assert_eq!(parse_tbw("0.5"), Ok(0.5));
        assert!(parse_tbw("0").is_err());
        assert!(parse_tbw("-3").is_err());
        assert!(parse_tbw("lots").is_err());
    }

    #[test]
    fn a_short_lifetime_warns() {
        let r = WearReport {
            bytes_written: 1 << 30,
            tbw_bytes: Some(2 << 30),
            bytes_written_per_day: Some(f64::from(1 << 30)),
            rate_window_seconds: Some(60.0),
            projected_lifetime_years: Some(1.0 / 365.0),
        };
        assert!(r.short_of_a_year());
        assert!(
            lifetime_warning(&r).contains("runs out in 1.0 days"),
            "{}",
            lifetime_warning(&r)
        );
        assert_eq!(lifetime_text(2.5), "2.5 years");
        assert_eq!(lifetime_text(0.5), "182.5 days");
        assert_eq!(lifetime_text(0.5 / 365.0), "12.0 hours");
        assert_eq!(rating_text(600_000_000_000_000), "600.0 TB");
        assert!(!WearReport::saved(5, 0).short_of_a_year());
    }
}
