//! `serve --metrics ADDR`: the daemon's statistics as a Prometheus endpoint (OpenMetrics text
//! at `/metrics`). Every value is read when scraped, from the same per-volume statistics as
//! `ssdcache stats` (relaxed atomic counters and occupancy figures kept beside the map: no
//! lock a request takes). Names follow Prometheus conventions (`ssdcache_` prefix, units in
//! names, `_total` counters); docs/operations.md lists them.
//!
//! The HTTP side is deliberately small: one thread answers one connection at a time (the
//! kernel's backlog queues the rest), a request head may be at most 8 KiB and must arrive
//! within 5 s, and every connection is closed after its answer. A scrape every few seconds
//! needs no more, and nothing a scraper does can hold memory or threads.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use ssdcache_engine::{Cache, VolumeState, VolumeStats};

use crate::wear::{WearReport, WearWatch};

/// The address `--metrics` binds when given without one: loopback only.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9871";
/// The longest request head read, and how long it may take to arrive.
const MAX_REQUEST_HEAD: u64 = 8192;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the endpoint (before the cache opens, as every other socket of `serve`).
pub fn bind(addr: &str) -> Result<TcpListener> {
    let well_formed = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !well_formed {
        return Err(crate::usage_error(format!(
            "--metrics {addr:?} is not HOST:PORT (for example {DEFAULT_ADDR})"
        )));
    }
    let listener = TcpListener::bind(addr).with_context(|| {
        format!("cannot listen for metrics on tcp {addr}; is another server using it? choose another --metrics")
    })?;
    if let Ok(local) = listener.local_addr() {
        if !local.ip().is_loopback() {
            tracing::warn!(
                "metrics on {local}, not loopback: anyone who reaches it sees volume names and \
                 traffic figures"
            );
        }
    }
    Ok(listener)
}

/// Answers scrapes on a thread of its own until the process exits.
pub fn spawn(listener: TcpListener, cache: Arc<Cache>, wear: Arc<WearWatch>) -> Result<()> {
    cache.record_latencies(true);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(CacheCollector { cache, wear }));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                if let Err(e) = answer(conn, &registry) {
                    tracing::debug!("metrics request failed: {e:#}");
                }
            }
        })
        .context("cannot start the metrics endpoint's thread")?;
    Ok(())
}

fn answer(mut conn: TcpStream, registry: &Registry) -> Result<()> {
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    conn.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let head = read_head(&mut conn, REQUEST_TIMEOUT)?;
    let request_line = head.lines().next().unwrap_or_default();
    let mut words = request_line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => {
            let mut body = String::new();
            prometheus_client::encoding::text::encode(&mut body, registry)
                .context("encoding the metrics")?;
            (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            )
        }
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "ssdcache serves its metrics at /metrics\n".to_owned(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET /metrics\n".to_owned(),
        ),
    };
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        reply.extend_from_slice(body.as_bytes());
    }
    conn.write_all(&reply)?;
    Ok(())
}

/// The request line and headers, up to the blank line that ends them, all within
/// [`REQUEST_TIMEOUT`] (one deadline for the whole head: a client trickling a byte every few
/// seconds must not hold the endpoint's one thread, review 34).
fn read_head(conn: &mut TcpStream, timeout: Duration) -> Result<String> {
    let deadline = std::time::Instant::now() + timeout;
    let mut head = Vec::new();
    let mut chunk = [0u8; 512];
    while !ends_head(&head) && (head.len() as u64) < MAX_REQUEST_HEAD {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            anyhow::bail!("request head not complete within {timeout:?}");
        }
        conn.set_read_timeout(Some(left))?;
        let room = (MAX_REQUEST_HEAD as usize - head.len()).min(chunk.len());
        let n = conn.read(&mut chunk[..room])?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

/// Whether the blank line ending the head arrived (anything after it, a body or a pipelined
/// request, is ignored: the connection closes after the answer).
fn ends_head(head: &[u8]) -> bool {
    head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n")
}

/// Reads the cache's statistics at each scrape.
struct CacheCollector {
    cache: Arc<Cache>,
    wear: Arc<WearWatch>,
}

impl std::fmt::Debug for CacheCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheCollector")
    }
}

type Labels = Vec<(&'static str, String)>;

/// One metric family: its name (without `_total` or the unit), help, unit and rows.
struct Family {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    kind: MetricType,
    rows: Vec<(Labels, f64)>,
}

impl Family {
    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family =
            encoder.encode_descriptor(self.name, self.help, self.unit.as_ref(), self.kind)?;
        for (labels, value) in &self.rows {
            let mut metric = family.encode_family(labels)?;
            match self.kind {
                // Whole counts print as integers; sums of seconds keep their fraction.
                MetricType::Counter if value.fract() == 0.0 => {
                    metric.encode_counter::<NoLabelSet, _, f64>(&(*value as u64), None)?
                }
                MetricType::Counter => metric.encode_counter::<NoLabelSet, _, f64>(value, None)?,
                _ => metric.encode_gauge(value)?,
            }
        }
        Ok(())
    }
}

/// A gauge family.
fn gauge(
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    rows: Vec<(Labels, f64)>,
) -> Family {
    Family {
        name,
        help,
        unit,
        kind: MetricType::Gauge,
        rows,
    }
}

/// A counter taken from a volume's statistics: metric, help (given once per metric), unit,
/// the label that tells the rows of one metric apart, and the name of the volume counter.
type CounterRow = (
    &'static str,
    &'static str,
    Option<Unit>,
    Option<(&'static str, &'static str)>,
    &'static str,
);

const VOLUME_COUNTERS: &[CounterRow] = &[
    ("ssdcache_requests", "Client requests by kind.", None, Some(("kind", "read")), "reads"),
    ("ssdcache_requests", "", None, Some(("kind", "write")), "writes"),
    ("ssdcache_requests", "", None, Some(("kind", "trim")), "trims"),
    ("ssdcache_requests", "", None, Some(("kind", "write_zeroes")), "write_zeroes"),
    ("ssdcache_requests", "", None, Some(("kind", "flush")), "flushes"),
    (
        "ssdcache_read_requests",
        "Client reads by outcome: hit (every sector cached) or miss (some sector read from the backing device).",
        None,
        Some(("outcome", "hit")),
        "read_hits",
    ),
    ("ssdcache_read_requests", "", None, Some(("outcome", "miss")), "read_misses"),
    (
        "ssdcache_write_hits",
        "Client writes that touched a cached line.",
        None,
        None,
        "write_hits",
    ),
    (
        "ssdcache_client_read",
        "Bytes clients read.",
        Some(Unit::Bytes),
        None,
        "bytes_read",
    ),
    (
        "ssdcache_client_written",
        "Bytes clients wrote.",
        Some(Unit::Bytes),
        None,
        "bytes_written",
    ),
    (
        "ssdcache_device_read",
        "Bytes read from the cache device and the backing device for this volume's requests.",
        Some(Unit::Bytes),
        Some(("device", "cache")),
        "bytes_from_cache",
    ),
    ("ssdcache_device_read", "", Some(Unit::Bytes), Some(("device", "backing")), "bytes_from_backing"),
    (
        "ssdcache_device_written",
        "Bytes written to the cache device and the backing device for this volume (data; the backing side includes write-back).",
        Some(Unit::Bytes),
        Some(("device", "cache")),
        "bytes_to_cache",
    ),
    ("ssdcache_device_written", "", Some(Unit::Bytes), Some(("device", "backing")), "bytes_to_backing"),
    (
        "ssdcache_bypassed",
        "Bytes that went to the backing device without being cached, by reason: sequential (the stream cutoff), not_admitted (the admission policy), dirty_limit (a write around a cache at its dirty limit).",
        Some(Unit::Bytes),
        Some(("reason", "sequential")),
        "bytes_bypassed",
    ),
    ("ssdcache_bypassed", "", Some(Unit::Bytes), Some(("reason", "not_admitted")), "bytes_not_admitted"),
    ("ssdcache_bypassed", "", Some(Unit::Bytes), Some(("reason", "dirty_limit")), "bytes_written_around_full"),
    (
        "ssdcache_writeback",
        "Dirty bytes written back to the backing device.",
        Some(Unit::Bytes),
        None,
        "bytes_cleaned",
    ),
    (
        "ssdcache_errors",
        "I/O errors by source: cache_device, backing_device, dirty_read (dirty data that could not be read), checksum (cached data that failed its checksum).",
        None,
        Some(("source", "cache_device")),
        "cache_errors",
    ),
    ("ssdcache_errors", "", None, Some(("source", "backing_device")), "backing_errors"),
    ("ssdcache_errors", "", None, Some(("source", "dirty_read")), "dirty_read_errors"),
    ("ssdcache_errors", "", None, Some(("source", "checksum")), "checksum_errors"),
    (
        "ssdcache_dirty_lines_lost",
        "Dirty lines lost (their data could not be recovered).",
        None,
        None,
        "dirty_lines_lost",
    ),
];

impl Collector for CacheCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let volumes: Vec<VolumeStats> = self.cache.volumes().iter().map(|v| v.stats()).collect();
        for family in families(&self.cache, &volumes)
            .into_iter()
            .chain(wear_families(&self.wear.report()))
        {
            family.encode(&mut encoder)?;
        }
        self.encode_latencies(&mut encoder)
    }
}

impl CacheCollector {
    /// `ssdcache_request_duration_seconds{volume,kind,outcome}`: time inside the engine.
    fn encode_latencies(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "ssdcache_request_duration",
            "Time a request spent in the cache engine (not queued in the NBD server), by kind and, for reads, outcome (hit or miss).",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for volume in self.cache.volumes().iter() {
            for h in volume.latencies() {
                let (kind, outcome) = h.kind.labels();
                let labels: Labels = vec![
                    ("volume", volume.name().to_owned()),
                    ("kind", kind.to_owned()),
                    ("outcome", outcome.to_owned()),
                ];
                family
                    .encode_family(&labels)?
                    .encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &h.buckets, None)?;
            }
        }
        Ok(())
    }
}

fn families(cache: &Cache, volumes: &[VolumeStats]) -> Vec<Family> {
    let mut out: Vec<Family> = Vec::new();
    for (name, help, unit, extra, counter) in VOLUME_COUNTERS {
        let (name, help, extra, counter) = (*name, *help, *extra, *counter);
        let index = ssdcache_format::VolumeCounters::NAMES
            .iter()
            .position(|n| *n == counter);
        let rows = volumes.iter().map(|v| {
            let mut labels: Labels = vec![("volume", v.name.clone())];
            if let Some((k, value)) = extra {
                labels.push((k, value.to_owned()));
            }
            (labels, index.map_or(0, |i| v.counters.0[i]) as f64)
        });
        match out.last_mut() {
            Some(last) if last.name == name => last.rows.extend(rows),
            _ => out.push(Family {
                name,
                help,
                unit: unit.clone(),
                kind: MetricType::Counter,
                rows: rows.collect(),
            }),
        }
    }
    let per_volume = |f: &dyn Fn(&VolumeStats) -> f64| -> Vec<(Labels, f64)> {
        volumes
            .iter()
            .map(|v| (vec![("volume", v.name.clone())], f(v)))
            .collect()
    };
    out.push(gauge(
        "ssdcache_volume_size",
        "The volume's size.",
        Some(Unit::Bytes),
        per_volume(&|v| v.size as f64),
    ));
    out.push(gauge(
        "ssdcache_cached",
        "Bytes of the volume held in the cache (valid sectors).",
        Some(Unit::Bytes),
        per_volume(&|v| v.bytes_cached as f64),
    ));
    out.push(gauge(
        "ssdcache_cached_lines",
        "Cache lines holding the volume's data.",
        None,
        per_volume(&|v| v.lines_used as f64),
    ));
    out.push(gauge(
        "ssdcache_dirty",
        "Dirty bytes: in the cache, not yet on the backing device (the write-back backlog).",
        Some(Unit::Bytes),
        per_volume(&|v| v.dirty_bytes as f64),
    ));
    out.push(gauge(
        "ssdcache_dirty_lines",
        "Cache lines holding dirty data.",
        None,
        per_volume(&|v| v.dirty_lines as f64),
    ));
    out.push(gauge(
        "ssdcache_read_hit_ratio",
        "Read hits over reads since the counters started (rates: use ssdcache_read_requests_total).",
        None,
        per_volume(&|v| {
            let (hits, misses) = (v.counters.0[2], v.counters.0[3]);
            if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            }
        }),
    ));
    out.push(gauge(
        "ssdcache_volume_state",
        "1 for the volume's state: healthy, pass_through (after cache errors), cache_failed, backing_flush_failed.",
        None,
        volumes
            .iter()
            .map(|v| {
                let state = state_label(v.state);
                (vec![("volume", v.name.clone()), ("state", state.to_owned())], 1.0)
            })
            .collect(),
    ));
    out.push(gauge(
        "ssdcache_volume_dirty_limit_lines",
        "The volume's own cap on dirty lines ([volume.NAME] dirty_limit); only volumes with one.",
        None,
        volumes
            .iter()
            .filter_map(|v| Some((vec![("volume", v.name.clone())], v.dirty_cap_lines? as f64)))
            .collect(),
    ));
    out.push(gauge(
        "ssdcache_volume_occupancy_limit_lines",
        "The volume's cap on the cache lines it holds ([volume.NAME] occupancy_limit); only volumes with one.",
        None,
        volumes
            .iter()
            .filter_map(|v| {
                Some((vec![("volume", v.name.clone())], v.occupancy_cap_lines? as f64))
            })
            .collect(),
    ));
    out.push(gauge(
        "ssdcache_volume_mode",
        "1 for the mode the volume serves in, and the mode it is configured with.",
        None,
        volumes
            .iter()
            .map(|v| {
                (
                    vec![
                        ("volume", v.name.clone()),
                        ("mode", v.mode.to_string()),
                        ("configured_mode", v.configured_mode.to_string()),
                    ],
                    1.0,
                )
            })
            .collect(),
    ));
    out.extend(cache_families(cache, volumes));
    out
}

fn cache_families(cache: &Cache, volumes: &[VolumeStats]) -> Vec<Family> {
    let layout = cache.layout();
    let used: u64 = volumes.iter().map(|v| v.lines_used).sum();
    let checksums = cache.checksum_usage();
    let commits = cache.commit_stats();
    let one = |value: f64| vec![(Labels::new(), value)];
    vec![
        gauge(
            "ssdcache_cache_capacity",
            "Bytes of cache lines on the cache device.",
            Some(Unit::Bytes),
            one((layout.line_count * layout.line_size) as f64),
        ),
        gauge(
            "ssdcache_cache_line_size",
            "Size of a cache line.",
            Some(Unit::Bytes),
            one(layout.line_size as f64),
        ),
        gauge(
            "ssdcache_cache_lines",
            "Cache lines by state: used (holding data of any volume) or free.",
            None,
            vec![
                (vec![("state", "used".to_owned())], used as f64),
                (
                    vec![("state", "free".to_owned())],
                    layout.line_count.saturating_sub(used) as f64,
                ),
            ],
        ),
        gauge(
            "ssdcache_dirty_limit_lines",
            "Most lines that may be dirty (serve --dirty-limit).",
            None,
            one(cache.dirty_limit_lines() as f64),
        ),
        gauge(
            "ssdcache_dirty_oldest_age",
            "How long the oldest dirty data has been dirty, 0 without dirty data (refreshed by the cleaner about every second; data dirty before the daemon started counts from its start).",
            Some(Unit::Seconds),
            one(cache.oldest_dirty_age().map_or(0.0, |age| age.as_secs_f64())),
        ),
        gauge(
            "ssdcache_checksum_memory",
            "Data checksums in RAM: resident bytes and the budget (serve --checksum-memory).",
            Some(Unit::Bytes),
            vec![
                (
                    vec![("kind", "resident".to_owned())],
                    (checksums.resident_frames * checksums.frame_bytes) as f64,
                ),
                (
                    vec![("kind", "budget".to_owned())],
                    checksums.budget_frames.saturating_mul(checksums.frame_bytes) as f64,
                ),
            ],
        ),
        Family {
            name: "ssdcache_journal_commits",
            help: "Metadata commits (journal writes with the flushes before them), by result.",
            unit: None,
            kind: MetricType::Counter,
            rows: vec![
                (vec![("result", "ok".to_owned())], commits.done as f64),
                (vec![("result", "failed".to_owned())], commits.failed as f64),
            ],
        },
        Family {
            name: "ssdcache_journal_commit",
            help: "Time spent in commits (backing device flushes, cache device flush, journal write); over ssdcache_journal_commits_total, the mean commit latency.",
            unit: Some(Unit::Seconds),
            kind: MetricType::Counter,
            rows: one(commits.seconds),
        },
        Family {
            name: "ssdcache_journal_records",
            help: "Line records written to the journal by successful commits.",
            unit: None,
            kind: MetricType::Counter,
            rows: one(commits.records as f64),
        },
        Family {
            name: "ssdcache_checksum_pages",
            help: "Metadata pages of checksums read from and written to the cache device, and lost (unreadable).",
            unit: None,
            kind: MetricType::Counter,
            rows: vec![
                (vec![("op", "read".to_owned())], checksums.pages_read as f64),
                (vec![("op", "written".to_owned())], checksums.pages_written as f64),
                (vec![("op", "lost".to_owned())], checksums.pages_lost as f64),
            ],
        },
    ]
}

/// The cache device's wear (`serve --ssd-tbw`, docs/operations.md).
fn wear_families(w: &WearReport) -> Vec<Family> {
    let mut out = vec![Family {
        name: "ssdcache_cache_device_written",
        help: "Bytes ssdcache wrote to the cache device (data, journal, metadata, superblocks), across restarts.",
        unit: Some(Unit::Bytes),
        kind: MetricType::Counter,
        rows: vec![(Labels::new(), w.bytes_written as f64)],
    }];
    if let Some(tbw) = w.tbw_bytes {
        out.push(gauge(
            "ssdcache_cache_device_rated_written",
            "The cache device's endurance rating in bytes written (serve --ssd-tbw).",
            Some(Unit::Bytes),
            vec![(Labels::new(), tbw as f64)],
        ));
    }
    if let Some(years) = w.projected_lifetime_years {
        out.push(gauge(
            "ssdcache_cache_device_projected_lifetime",
            "Time until the rating is used up at the write rate of the last hour.",
            Some(Unit::Seconds),
            vec![(Labels::new(), years * 365.0 * 86_400.0)],
        ));
    }
    out
}

/// A volume state as a label value.
fn state_label(state: VolumeState) -> &'static str {
    match state {
        VolumeState::Healthy => "healthy",
        VolumeState::PassThroughAfterErrors => "pass_through",
        VolumeState::CacheFailed => "cache_failed",
        VolumeState::BackingFlushFailed => "backing_flush_failed",
        VolumeState::Offline => "offline",
        VolumeState::BackingUnreachable => "backing_unreachable",
    }
}

/// Metric names the scrape always has (docs/operations.md lists them; the dashboard uses
/// only these).
#[cfg(test)]
pub fn all_names() -> Vec<String> {
    let mut names: Vec<String> = VOLUME_COUNTERS
        .iter()
        .map(|(n, _, unit, _, _)| match unit {
            Some(_) => format!("{n}_bytes_total"),
            None => format!("{n}_total"),
        })
        .collect();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_names_follow_the_conventions() {
        for name in all_names() {
            assert!(
                name.starts_with("ssdcache_") && name.ends_with("_total"),
                "{name}"
            );
        }
        assert!(all_names().contains(&"ssdcache_read_requests_total".to_owned()));
    }

    #[test]
    fn families_with_several_rows_have_one_help() {
        let mut seen = std::collections::BTreeSet::new();
        for (name, help, ..) in VOLUME_COUNTERS {
            if seen.insert(*name) {
                assert!(!help.is_empty(), "{name} has no help");
            } else {
                assert!(help.is_empty(), "{name} listed twice with help");
            }
        }
    }

    /// Review 34: a client trickling a byte at a time, each within the per-read timeout,
    /// held the endpoint's one thread for hours; the whole head now has one deadline.
    #[test]
    fn a_trickling_client_is_cut_off_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            for _ in 0..20 {
                if s.write_all(b"G").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (mut conn, _) = listener.accept().expect("accept");
        let started = std::time::Instant::now();
        let result = read_head(&mut conn, Duration::from_millis(500));
        assert!(result.is_err(), "{result:?}");
        assert!(started.elapsed() < Duration::from_millis(1500));
        drop(conn);
        client.join().expect("client");
        // A head followed at once by a body still ends at the blank line.
        assert!(ends_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nbody"));
        assert!(!ends_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"));
    }

    #[test]
    fn bad_addresses_are_usage_errors() {
        let e = bind("9871").expect_err("no host");
        assert!(e.to_string().contains("HOST:PORT"), "{e}");
    }
}
