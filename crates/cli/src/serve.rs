//! The daemon: open and check devices, serve NBD, answer the control socket, stop cleanly.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ssdcache_device::{BlockDevice, FileDevice};
use ssdcache_devsim::hdd::{HddDevice, HddParams};
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{
    BatchRead, Cache, CleanerConfig, EngineError, RingHit, RingHits, Volume, VolumeBacking,
};
use ssdcache_format::{CacheState, Superblock};
use ssdcache_nbd::{
    transmission_flags, BatchedRead, Command, Errno, Export, ExportInfo, Lane, RingReads,
    RingStart, Server, ServerConfig, ServerError, ServerExport,
};
use ssdcache_trace::record::{RecordConfig, Recorder, VolumeRecorder, MIN_MAX_BYTES};
use ssdcache_trace::Op;

use crate::config::{FileConfig, SizeValue};
use crate::control;
use crate::devices::{
    open_backings_allowing_offline, open_cache_device, parse_backing, StoppedWaiting,
};
use crate::notify::Notifier;
use crate::signals::StopEvents;
use crate::size::{human, parse_size};
use crate::tuning::CacheTuning;
use crate::usage::{as_usage_error, usage_error};

const MAX_REQUEST: u32 = 32 << 20;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML configuration file (see docs/operations.md); flags override its keys. It also
    /// sets the cache's replacement `policy` and, under [volume.NAME], a volume's `admission`
    /// and `sequential_cutoff` (kept in the cache's superblock), `dirty_limit` and
    /// `occupancy_limit`. SIGHUP (`systemctl reload`) reads it again: `dirty_limit` and every
    /// [volume.NAME] key but `policy` apply at once, the other keys at the next start
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Cache device or file made by `ssdcache create`
    #[arg(long, value_name = "PATH")]
    cache: Option<PathBuf>,
    /// Unix socket for NBD clients, mode 0600 [default: /run/ssdcache/VOLUME.sock as root]
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also serve NBD over TCP on this address, e.g. 127.0.0.1:10809 (with --tls, over TLS)
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Control socket for `stats` and `info` [default: /run/ssdcache/CACHE-UUID.ctl as root]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics: per volume
    /// requests, hits and misses, bytes by device, bypass reasons, occupancy, dirty data,
    /// write-back and errors (docs/operations.md lists them). Given without ADDR:
    /// 127.0.0.1:9871. Any other address than loopback is logged as a warning: the
    /// endpoint has no authentication
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = crate::metrics::DEFAULT_ADDR)]
    metrics: Option<String>,
    /// Export every volume read-only
    #[arg(long)]
    read_only: bool,
    /// Slow-lane worker threads per NBD connection: requests that may touch the backing
    /// device (misses, write-through and write-around writes, FLUSH, TRIM...) in flight per
    /// connection (a hard drive reorders up to 32). Cache hits and write-back writes run on
    /// 32 fast-lane workers per connection besides, and never wait for these [default: 32]
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Put the HDD model (7200 rpm, see `ssdcache hdd-emulator --help`) between the cache and
    /// each backing device, so a backing file on fast storage behaves like a hard drive: for
    /// benchmarks and demos
    #[arg(long)]
    emulate_hdd: bool,
    /// Where a volume's backing device is now, if not at its recorded path (repeatable); PATH
    /// may be an NBD URI (a volume created with nbds:// takes only an nbds:// one). A
    /// device named here that cannot be opened or is not the recorded one refuses the start.
    /// A volume whose recorded device (or the config file's [backing] one) is absent or is
    /// another device is offline instead (not served, its data kept in the cache) while the
    /// others serve, unless every volume fails; any other failure (in use, mounted,
    /// permissions) refuses the start
    #[arg(long, value_name = "NAME=PATH", value_parser = parse_backing)]
    backing: Vec<(String, PathBuf)>,
    /// Seconds to wait, retrying every second, for a backing device that is absent at start
    /// (disks may appear after the daemon starts) before its volume goes offline while the
    /// others serve. With no volume's device there, the start fails at once [default: 30]
    #[arg(long, value_name = "SECONDS")]
    backing_wait: Option<u64>,
    /// Write-back: share of the cache's lines dirty at which the cleaner writes back every
    /// dirty line (at full depth while clients leave the disk idle, a trickle while they use
    /// it) [default: 50]
    #[arg(long, value_name = "PERCENT")]
    writeback_high: Option<f64>,
    /// Write-back: cleaning started at the high watermark goes on down to this share
    /// [default: 40]
    #[arg(long, value_name = "PERCENT")]
    writeback_low: Option<f64>,
    /// Write-back: dirty data older than this many seconds is written back even below the
    /// watermarks, at a pace that leaves the backing device to clients [default: 30]
    #[arg(long, value_name = "SECONDS")]
    writeback_max_age: Option<u64>,
    /// Write-back: most of the cache's lines that may be dirty, 0 to 100. Past it, a write to
    /// a line without dirty data goes to the backing device (dropping a clean cached copy),
    /// while overwrites of dirty lines are still absorbed: clean lines stay available for read
    /// misses, and the cleaner catches up. Counted as `bytes_written_around_full`
    /// [default: 80]
    #[arg(long, value_name = "PERCENT")]
    dirty_limit: Option<f64>,
    /// RAM kept for data checksums (one CRC32C per 4 KiB of cache, 0.1% of the cache in all).
    /// The metadata pages holding the checksums of this much stay in RAM; the others are
    /// read from the cache device when a request needs them (a 4 KiB read beside the data)
    /// and written back when they changed. `all` keeps every page once read: no extra reads,
    /// 0.1% of the cache in RAM [default: 0.01% of the cache, at least 1MiB]
    #[arg(long, value_name = "SIZE|all", value_parser = parse_checksum_memory)]
    checksum_memory: Option<u64>,
    /// The cache device's endurance rating in terabytes written (TBW, 10^12 bytes, from its
    /// data sheet), kept in the cache's superblock. With it, `stats` and the metrics project
    /// the lifetime left at the recent write rate, and the log warns when that is under a
    /// year. The bytes ssdcache writes to the cache device are counted with or without it
    #[arg(long, value_name = "TB", value_parser = crate::wear::parse_tbw)]
    ssd_tbw: Option<f64>,
    /// Record the clients' reads and writes to FILE (time, volume, offset, length; never
    /// data), for `ssdcache simulate`, `mrc` and `advise`. Write-zeroes count as writes;
    /// trims, flushes and cache hints are not recorded. About 30 bytes per request. The
    /// request path never waits for the file: a background thread writes it, and if the
    /// disk holding it falls behind, records are dropped and counted (`ssdcache stats`).
    /// Refuses an existing FILE
    #[arg(long, value_name = "FILE", help_heading = "Recording a workload")]
    record_trace: Option<PathBuf>,
    /// Record only this fraction of each volume's 1 MiB regions (every request to a chosen
    /// region, none to the others, so reuse stays visible), e.g. 0.01 to record a busy disk
    /// for days in little space [default: 1, everything]
    #[arg(long, value_name = "RATE", help_heading = "Recording a workload")]
    record_sample: Option<f64>,
    /// Stop recording (serving goes on) before the trace file would grow beyond SIZE
    /// [default: 1GiB, about 30 million requests]
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Recording a workload")]
    record_max_size: Option<u64>,
    /// Replace the trace file if it exists
    #[arg(long, help_heading = "Recording a workload")]
    record_trace_force: bool,
    /// Most NBD connections open at once, 1 to 4096; a client beyond it is closed before the
    /// greeting and the refusal logged. Each connection has 32 fast-lane and up to --threads
    /// slow-lane worker threads [default: 128]
    #[arg(long, value_name = "N", help_heading = "Limits")]
    max_connections: Option<usize>,
    /// Memory all NBD request buffers together may hold (in use, or kept for reuse). A request
    /// that does not fit waits for others to give memory back, at most --io-timeout, then
    /// fails with ENOMEM [default: 512MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Limits")]
    request_memory: Option<u64>,
    /// Memory the requests in flight on one connection may hold, at least 32MiB (one request
    /// of the largest size) and at most --request-memory; a connection at its limit reads no
    /// new request until one finishes [default: 64MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Limits")]
    connection_memory: Option<u64>,
    /// Seconds a request may take to arrive once its first byte did (header and write data),
    /// a reply may take to be written (a client that stops reading replies is disconnected),
    /// and a request may wait for memory [default: 30]
    #[arg(long, value_name = "SECONDS", help_heading = "Limits")]
    io_timeout: Option<u64>,
    /// Close a connection that has sent no request and is owed no reply for this many
    /// seconds; 0 never does. Off by default: the kernel NBD client sends nothing while the
    /// filesystem on it is idle and cannot reconnect by itself [default: 0]
    #[arg(long, value_name = "SECONDS", help_heading = "Limits")]
    idle_timeout: Option<u64>,
    /// TLS for NBD clients (NBD_OPT_STARTTLS, x509 certificates from --tls-certificates):
    /// `off`; `on`: a client may start TLS or stay in plaintext; `require`: no export is
    /// reachable without TLS (a plaintext client is refused every option but STARTTLS).
    /// Applies to the Unix socket and --listen alike [default: off]
    #[arg(long, value_enum, value_name = "MODE", help_heading = "TLS")]
    tls: Option<TlsMode>,
    /// Directory of the server's x509 credentials, laid out as nbdkit and qemu lay them out:
    /// server-cert.pem (the certificate, then its chain), server-key.pem (its private key),
    /// and for --tls-verify-peer ca-cert.pem (the CAs client certificates must chain to).
    /// PSK is not offered: rustls has no pre-shared-key support
    #[arg(long, value_name = "DIR", help_heading = "TLS")]
    tls_certificates: Option<PathBuf>,
    /// Refuse TLS clients without a certificate signed by a CA of ca-cert.pem
    #[arg(long, help_heading = "TLS")]
    tls_verify_peer: bool,
    /// On SIGTERM or SIGINT, wait this many seconds for requests in flight to finish and be
    /// answered, then close every client socket; a second signal stops waiting at once. The
    /// cache map is written unless a request is stuck inside a device (then the journal is
    /// committed and the next start replays it) [default: 30]
    #[arg(long, value_name = "SECONDS", help_heading = "Limits")]
    shutdown_timeout: Option<u64>,
}

struct Settings {
    cache: PathBuf,
    socket: Option<PathBuf>,
    listen: Option<String>,
    control: Option<PathBuf>,
    /// `--metrics`: the Prometheus endpoint's address.
    metrics: Option<String>,
    /// `--ssd-tbw`, in TB.
    ssd_tbw: Option<f64>,
    read_only: bool,
    backing: BTreeMap<String, PathBuf>,
    /// Volumes whose device was given on the command line: one that fails refuses the start.
    backing_required: std::collections::BTreeSet<String>,
    /// `--backing-wait`: how long an absent backing device is waited for.
    backing_wait: Duration,
    /// Volume names the config file mentions (`[backing]`, `[volume.NAME]`), with its path.
    config_naming: BTreeMap<String, PathBuf>,
    /// `--config`: re-read at SIGHUP (`reload_config`).
    config_path: Option<PathBuf>,
    /// `--dirty-limit` was given: it wins over the file's, at start and at a reload.
    dirty_limit_on_command_line: bool,
    emulate_hdd: bool,
    cleaner: CleanerConfig,
    /// Share of lines that may be dirty (`Cache::set_dirty_limit`).
    dirty_limit: f64,
    /// RAM for checksum pages (`Cache::set_checksum_memory`); `None`: the engine's default.
    checksum_memory: Option<u64>,
    tuning: CacheTuning,
    record: Option<(PathBuf, RecordConfig)>,
    limits: Limits,
}

/// `--tls`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    Off,
    On,
    Require,
}

/// TLS from flags and the config file: `None` when off. Bad combinations are bad usage;
/// unreadable or unusable credentials are errors naming the file.
fn tls_settings(args: &ServeArgs, file: &FileConfig) -> Result<Option<ssdcache_nbd::TlsConfig>> {
    let mode = args.tls.or(file.tls).unwrap_or(TlsMode::Off);
    let dir = args
        .tls_certificates
        .clone()
        .or(file.tls_certificates.clone());
    let verify_peer = args.tls_verify_peer || file.tls_verify_peer.unwrap_or(false);
    let dir =
        match (mode, dir) {
            (TlsMode::Off, None) if !verify_peer => return Ok(None),
            (TlsMode::Off, _) => {
                return Err(usage_error(
                    "--tls-certificates and --tls-verify-peer need --tls on or --tls require",
                ))
            }
            (_, None) => return Err(usage_error(
                "--tls on/require needs --tls-certificates DIR (server-cert.pem, server-key.pem)",
            )),
            (_, Some(dir)) => dir,
        };
    let config =
        ssdcache_nbd::TlsConfig::from_certificates_dir(&dir, verify_peer, mode == TlsMode::Require)
            .with_context(|| {
                format!(
                    "cannot set up TLS from --tls-certificates {}",
                    dir.display()
                )
            })?;
    Ok(Some(config))
}

/// The NBD server's limits and the bound of a stop (docs/design.md §6.1, §6.2).
struct Limits {
    server: ServerConfig,
    shutdown_timeout: Duration,
}

fn settings(args: ServeArgs) -> Result<Settings> {
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let tuning = CacheTuning::from(&file);
    let record = record_settings(&args, &file)?;
    let threads = args.threads.or(file.threads).unwrap_or(32);
    if !(1..=256).contains(&threads) {
        return Err(usage_error(format!(
            "--threads {threads} is out of range (1 to 256)"
        )));
    }
    let mut limits = limit_settings(&args, &file, threads)?;
    limits.server.tls = tls_settings(&args, &file)?;
    let Some(cache) = args.cache.or(file.cache) else {
        return Err(usage_error(
            "no cache given: use --cache PATH or `cache = \"PATH\"` in the config file",
        ));
    };
    let backing_required = args.backing.iter().map(|(name, _)| name.clone()).collect();
    let backing_wait = Duration::from_secs(args.backing_wait.or(file.backing_wait).unwrap_or(30));
    let config_naming = match &args.config {
        Some(path) => file
            .backing
            .keys()
            .chain(file.volume.keys())
            .map(|name| (name.clone(), path.clone()))
            .collect(),
        None => BTreeMap::new(),
    };
    let mut backing = file.backing;
    backing.extend(args.backing);
    let defaults = CleanerConfig::default();
    let high = args
        .writeback_high
        .or(file.writeback_high)
        .unwrap_or(defaults.high_watermark * 100.0);
    let low = args
        .writeback_low
        .or(file.writeback_low)
        .unwrap_or(defaults.low_watermark * 100.0);
    if !(0.0..=100.0).contains(&high) || !(0.0..=100.0).contains(&low) || low > high {
        return Err(usage_error(format!(
            "write-back watermarks must be percentages with low <= high (got high {high}, low {low})"
        )));
    }
    let dirty_limit_on_command_line = args.dirty_limit.is_some();
    let dirty_limit = args
        .dirty_limit
        .or(file.dirty_limit)
        .unwrap_or(ssdcache_engine::DEFAULT_DIRTY_LIMIT * 100.0);
    if !(0.0..=100.0).contains(&dirty_limit) {
        return Err(usage_error(format!(
            "--dirty-limit must be a percentage from 0 to 100 (got {dirty_limit})"
        )));
    }
    let checksum_memory = match (args.checksum_memory, &file.checksum_memory) {
        (Some(bytes), _) => Some(bytes),
        (None, Some(value)) => Some(value.checksum_memory().map_err(as_usage_error)?),
        (None, None) => None,
    };
    let max_age = args
        .writeback_max_age
        .or(file.writeback_max_age)
        .unwrap_or(defaults.max_age.as_secs());
    let cleaner = CleanerConfig {
        high_watermark: high / 100.0,
        low_watermark: low / 100.0,
        max_age: std::time::Duration::from_secs(max_age),
        ..defaults
    };
    Ok(Settings {
        cleaner,
        dirty_limit: dirty_limit / 100.0,
        checksum_memory,
        cache,
        socket: args.socket.or(file.socket),
        listen: args.listen.or(file.listen),
        control: args.control.or(file.control),
        metrics: args.metrics.or(file.metrics),
        ssd_tbw: args.ssd_tbw.or(file.ssd_tbw),
        read_only: args.read_only || file.read_only.unwrap_or(false),
        backing,
        backing_required,
        backing_wait,
        config_naming,
        config_path: args.config.clone(),
        dirty_limit_on_command_line,
        emulate_hdd: args.emulate_hdd,
        tuning,
        record,
        limits,
    })
}

/// `--checksum-memory`: a size, or `all` (every page kept once read).
fn parse_checksum_memory(s: &str) -> std::result::Result<u64, String> {
    if s.eq_ignore_ascii_case("all") {
        Ok(u64::MAX)
    } else {
        parse_size(s)
    }
}

const DEFAULT_MAX_CONNECTIONS: usize = 128;
const DEFAULT_REQUEST_MEMORY: u64 = 512 << 20;
const DEFAULT_CONNECTION_MEMORY: u64 = 64 << 20;
const DEFAULT_IO_TIMEOUT_SECS: u64 = 30;
const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 30;

/// The NBD server's limits from flags and the config file, refused as bad usage when they
/// cannot work (before anything is opened).
fn limit_settings(args: &ServeArgs, file: &FileConfig, threads: usize) -> Result<Limits> {
    let size = |flag: Option<u64>, key: &str, value: &Option<SizeValue>, default: u64| {
        let bytes = match (flag, value) {
            (Some(n), _) => n,
            (None, Some(v)) => v.bytes(key).map_err(|e| usage_error(format!("{e:#}")))?,
            (None, None) => default,
        };
        usize::try_from(bytes)
            .map_err(|_| usage_error(format!("--{} {bytes} is too large", key.replace('_', "-"))))
    };
    let max_connections = args
        .max_connections
        .or(file.max_connections)
        .unwrap_or(DEFAULT_MAX_CONNECTIONS);
    if !(1..=4096).contains(&max_connections) {
        return Err(usage_error(format!(
            "--max-connections {max_connections} is out of range (1 to 4096)"
        )));
    }
    let request_memory = size(
        args.request_memory,
        "request_memory",
        &file.request_memory,
        DEFAULT_REQUEST_MEMORY,
    )?;
    let connection_memory = size(
        args.connection_memory,
        "connection_memory",
        &file.connection_memory,
        DEFAULT_CONNECTION_MEMORY,
    )?;
    if connection_memory < MAX_REQUEST as usize || connection_memory > request_memory {
        return Err(usage_error(format!(
            "--connection-memory {} must be at least {} (one request of the largest size) and \
             at most --request-memory ({})",
            human(connection_memory as u64),
            human(u64::from(MAX_REQUEST)),
            human(request_memory as u64)
        )));
    }
    let io_timeout = args
        .io_timeout
        .or(file.io_timeout)
        .unwrap_or(DEFAULT_IO_TIMEOUT_SECS);
    if io_timeout == 0 {
        return Err(usage_error(
            "--io-timeout must be at least 1 second".to_owned(),
        ));
    }
    let idle_timeout = args.idle_timeout.or(file.idle_timeout).unwrap_or(0);
    let shutdown_timeout = args
        .shutdown_timeout
        .or(file.shutdown_timeout)
        .unwrap_or(DEFAULT_SHUTDOWN_TIMEOUT_SECS);
    let server = ServerConfig {
        threads_per_connection: threads,
        max_request: MAX_REQUEST,
        max_connections,
        buffer_memory: request_memory,
        connection_buffer_memory: connection_memory,
        buffer_wait: Duration::from_secs(io_timeout),
        io_timeout: Duration::from_secs(io_timeout),
        idle_timeout: (idle_timeout > 0).then(|| Duration::from_secs(idle_timeout)),
        ..ServerConfig::default()
    };
    Server::check_config(&server).map_err(|e| usage_error(e.to_string()))?;
    Ok(Limits {
        server,
        shutdown_timeout: Duration::from_secs(shutdown_timeout),
    })
}

/// The trace recording asked for by flags or the config file, checked before anything is
/// opened, so a wrong setting or an existing file costs no cache start.
fn record_settings(args: &ServeArgs, file: &FileConfig) -> Result<Option<(PathBuf, RecordConfig)>> {
    let path = args
        .record_trace
        .clone()
        .or_else(|| file.record_trace.clone());
    let max_bytes = match (args.record_max_size, &file.record_max_size) {
        (Some(n), _) => Some(n),
        (None, Some(v)) => Some(v.bytes("record_max_size")?),
        (None, None) => None,
    };
    let sample_rate = args.record_sample.or(file.record_sample);
    let Some(path) = path else {
        if sample_rate.is_some() || max_bytes.is_some() || args.record_trace_force {
            return Err(usage_error(
                "--record-sample, --record-max-size and --record-trace-force need --record-trace FILE",
            ));
        }
        return Ok(None);
    };
    let defaults = RecordConfig::default();
    let config = RecordConfig {
        sample_rate: sample_rate.unwrap_or(defaults.sample_rate),
        max_bytes: max_bytes.unwrap_or(defaults.max_bytes),
        overwrite: args.record_trace_force || file.record_trace_force.unwrap_or(false),
        ..defaults
    };
    if !(config.sample_rate > 0.0 && config.sample_rate <= 1.0) {
        return Err(usage_error(format!(
            "--record-sample {} is out of range: give a fraction above 0 and at most 1 (0.01 records 1%)",
            config.sample_rate
        )));
    }
    if config.max_bytes < MIN_MAX_BYTES {
        return Err(usage_error(format!(
            "--record-max-size {} is too small (at least {MIN_MAX_BYTES} bytes)",
            config.max_bytes
        )));
    }
    if !config.overwrite && std::fs::symlink_metadata(&path).is_ok() {
        bail!(
            "trace file {} already exists; choose another name, move it away, or replace it \
             with --record-trace-force",
            path.display()
        );
    }
    // Absolute, so `stats` names the file wherever it is asked from.
    let path = std::path::absolute(&path)
        .with_context(|| format!("cannot resolve trace file path {}", path.display()))?;
    Ok(Some((path, config)))
}

pub(crate) fn with_hdd_model(dev: Arc<dyn BlockDevice>, emulate: bool) -> Arc<dyn BlockDevice> {
    if !emulate {
        return dev;
    }
    tracing::info!(
        "backing {} is slowed to the speed of a 7200 rpm hard drive (--emulate-hdd)",
        dev.describe()
    );
    let full_stroke = HddParams {
        capacity: dev.size(),
        ..HddParams::default()
    };
    Arc::new(HddDevice::new(dev, full_stroke))
}

struct VolumeExport {
    volume: Arc<Volume>,
    /// Set when `--record-trace` records this volume's requests.
    recorder: Option<VolumeRecorder>,
}

fn errno(e: EngineError) -> Errno {
    tracing::debug!("request failed: {e}");
    match e {
        EngineError::OutOfRange { .. } | EngineError::Misaligned { .. } => Errno::Invalid,
        EngineError::ReadOnly(_) => Errno::Perm,
        EngineError::VolumeOffline { .. } => Errno::Io,
        EngineError::Backing { .. }
        | EngineError::CacheDevice { .. }
        | EngineError::Format(_)
        | EngineError::AddRefused { .. }
        | EngineError::DataDamaged(_)
        | EngineError::Invariant(_)
        | EngineError::Halted(_) => Errno::Io,
    }
}

impl VolumeExport {
    /// Records the request as the client sent it, before the cache handles it.
    fn record(&self, op: Op, offset: u64, length: u64) {
        if let Some(r) = &self.recorder {
            r.record(op, offset, length);
        }
    }
}

impl Export for VolumeExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.record(Op::Read, offset, buf.len() as u64);
        self.volume.read(offset, buf).map_err(errno)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        self.record(Op::Write, offset, data.len() as u64);
        self.volume.write(offset, data, fua).map_err(errno)
    }
    fn flush(&self) -> Result<(), Errno> {
        self.volume.flush().map_err(errno)
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno> {
        self.volume.trim(offset, length, fua).map_err(errno)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), Errno> {
        // The client writes these bytes, even if no data crosses the wire: a write to the
        // simulator.
        self.record(Op::Write, offset, length);
        self.volume.write_zeroes(offset, length, fua).map_err(errno)
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), Errno> {
        self.volume.prefetch(offset, length).map_err(errno)
    }
    /// The backing device's holes, with dirty data in the cache counted as data.
    fn allocation(&self, offset: u64, length: u64) -> Result<Vec<ssdcache_nbd::Run>, Errno> {
        self.volume.allocation(offset, length).map_err(errno)
    }
    /// Only with io_uring is a batch cheaper than its reads on separate workers.
    fn batches_reads(&self) -> bool {
        ssdcache_device::uring::io_uring_available()
    }
    /// Hits of the batch have their cache-device reads submitted together (io_uring).
    fn read_many(&self, reads: &mut [BatchedRead<'_>]) {
        let mut batch: Vec<BatchRead<'_>> = reads
            .iter_mut()
            .map(|read| {
                self.record(Op::Read, read.offset, read.buf.len() as u64);
                BatchRead::new(read.offset, &mut *read.buf)
            })
            .collect();
        self.volume.read_many(&mut batch);
        let results: Vec<_> = batch.into_iter().map(|done| done.result).collect();
        for (read, result) in reads.iter_mut().zip(results) {
            read.result = result.map_err(errno);
        }
    }
    /// Whole hits have their cache-device reads in flight while the connection reads on.
    fn ring_reads(&self) -> Option<Box<dyn RingReads + '_>> {
        let hits = self.volume.ring_hits()?;
        Some(Box::new(VolumeRingReads { export: self, hits }))
    }
    /// Cache hits, and writes in write-back, run on the NBD connection's fast lane: they
    /// never wait for a worker stuck on the backing device.
    fn lane(&self, command: Command, offset: u64, length: u64) -> Lane {
        let is_write = match command {
            Command::Read => false,
            Command::Write => true,
            _ => return Lane::Slow,
        };
        if self
            .volume
            .likely_served_from_cache(is_write, offset, length)
        {
            Lane::Fast
        } else {
            Lane::Slow
        }
    }
}

/// One connection's hits through io_uring ([`Export::ring_reads`]).
struct VolumeRingReads<'e> {
    export: &'e VolumeExport,
    hits: RingHits<'e>,
}

impl RingReads for VolumeRingReads<'_> {
    unsafe fn start(&self, reads: &mut [RingStart]) {
        let mut hits: Vec<RingHit> = reads
            .iter()
            .map(|r| RingHit {
                tag: r.tag,
                offset: r.offset,
                buf: r.buf,
                len: r.len,
                started: false,
            })
            .collect();
        // SAFETY: the caller's promise for `reads` is the one `start` asks for.
        unsafe { self.hits.start(&mut hits) };
        for (read, hit) in reads.iter_mut().zip(&hits) {
            read.started = hit.started;
        }
    }
    /// Recorded as they end when served (requests in flight together have no order); one
    /// not served is recorded when the connection reads it again with `Export::read`.
    fn wait(&self, ended: &mut Vec<(u64, bool)>) -> std::io::Result<()> {
        let mut hits = Vec::new();
        self.hits.wait(&mut hits).map_err(|broken| broken.0)?;
        for hit in hits {
            if hit.served {
                self.export.record(Op::Read, hit.offset, hit.len as u64);
            }
            ended.push((hit.tag, hit.served));
        }
        Ok(())
    }
    fn wake(&self) {
        self.hits.wake();
    }
}

fn exports(cache: &Cache, read_only: bool, recorder: Option<&Recorder>) -> Vec<ServerExport> {
    cache
        .volumes()
        .iter()
        .filter(|v| v.offline_reason().is_none())
        .map(|v| volume_export(v, read_only, recorder))
        .collect()
}

/// The NBD export of a volume (its name is the export's).
pub(crate) fn volume_export(
    v: &Arc<Volume>,
    read_only: bool,
    recorder: Option<&Recorder>,
) -> ServerExport {
    let ro = read_only || v.read_only();
    ServerExport {
        info: ExportInfo {
            name: v.name().to_owned(),
            description: format!("ssdcache volume {} ({})", v.name(), v.mode()),
            // The last bytes of a device whose size is not a multiple of 4 KiB form no whole
            // sector: the cache cannot hold them, so the export ends before them.
            size: v.size(),
            flags: transmission_flags(ro),
            // Any offset and length (the engine reads, modifies and writes partial sectors),
            // as the NBD spec asks of a server whose clients may not negotiate block sizes.
            min_block: 1,
            preferred_block: v.line_size().min(u64::from(MAX_REQUEST)) as u32,
            max_block: MAX_REQUEST,
        },
        backend: Arc::new(VolumeExport {
            volume: v.clone(),
            recorder: recorder.map(|r| r.volume(v.name())),
        }),
    }
}

/// The cache device and its superblock with the config file's settings applied, read without
/// changing anything; the volume names given with `--backing` are checked here.
fn read_cache(s: &Settings) -> Result<(Arc<FileDevice>, Superblock)> {
    let (dev, mut sb) = open_cache_device(&s.cache)?;
    // Cache::open writes the superblock, which makes these settings persistent.
    for change in s.tuning.apply(&mut sb).map_err(crate::as_usage_error)? {
        tracing::info!("config file: {change}");
    }
    check_backing_names(&s.backing, &sb)?;
    Ok((dev, sb))
}

/// A `--backing NAME=PATH` (or `[backing]` key) naming no volume of the cache would be
/// ignored: refuse it, naming the volumes there are.
fn check_backing_names(backing: &BTreeMap<String, PathBuf>, sb: &Superblock) -> Result<()> {
    let Some(unknown) = backing
        .keys()
        .find(|name| sb.volume_by_name(name).is_none())
    else {
        return Ok(());
    };
    let known: Vec<&str> = sb.volumes.iter().map(|v| v.name.as_str()).collect();
    Err(usage_error(format!(
        "--backing {unknown}=PATH (or [backing] {unknown} in the config file): this cache has no \
         volume named {unknown:?}; its volumes: {} (the names given to `ssdcache create --name`)",
        known.join(", ")
    )))
}

/// Opens every volume's backing device, checked as every command checks it, behind the HDD
/// model when `--emulate-hdd` asks for it; a volume whose recorded device fails is offline
/// (`devices::open_backings_allowing_offline`).
fn open_backings_to_serve(
    s: &Settings,
    dev: &dyn BlockDevice,
    sb: &Superblock,
    stops: &StopEvents,
) -> Result<Vec<VolumeBacking>> {
    let required = |name: &str| s.backing_required.contains(name);
    let stop = || stops.try_next();
    let opened =
        open_backings_allowing_offline(dev, sb, &s.backing, &required, s.backing_wait, &stop)?;
    Ok(opened
        .into_iter()
        .map(|b| match b {
            VolumeBacking::Device(d) => VolumeBacking::Device(with_hdd_model(d, s.emulate_hdd)),
            offline => offline,
        })
        .collect())
}

/// Opens the cache: from here on it is marked running until `Cache::shutdown`.
fn open_cache(
    s: &Settings,
    dev: Arc<FileDevice>,
    sb: Superblock,
    backings: Vec<VolumeBacking>,
) -> Result<Arc<Cache>> {
    if !dev.is_direct() {
        tracing::warn!(
            "cache {}: no O_DIRECT on this filesystem",
            s.cache.display()
        );
    }
    let (cache, report) = Cache::open_volumes(dev, sb, backings)
        .with_context(|| format!("cannot open cache {}", s.cache.display()))?;
    match (&report.cold_reason, &report.recovery) {
        (_, Some(r)) => tracing::warn!(
            "recovered after an unclean stop: {} dirty lines ({}) from {} journal commits in {} ms; \
             clean cached data was dropped",
            r.dirty_lines,
            human(r.dirty_bytes),
            r.commits,
            r.millis
        ),
        (None, None) => tracing::info!(
            "cache warm: {} lines, {} restored from the clean-stop checkpoint",
            report.restored_lines,
            human(report.restored_bytes)
        ),
        (Some(why), None) => tracing::info!("cache starts cold: {why}"),
    }
    Ok(Arc::new(cache))
}

pub fn run(args: ServeArgs) -> Result<()> {
    let s = settings(args).map_err(crate::as_usage_error)?;
    return_freed_buffers_to_the_system();
    // Before anything is opened: a signal during a long start (journal replay) is honoured
    // as soon as serving starts, with a clean stop, instead of killing the process midway.
    let stops = StopEvents::install()?;
    // SIGHUP reloads the config file once serving (`reload_config`); caught
    // from here on, so one sent during the start does not kill the process.
    let hangups = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])
        .context("cannot install the SIGHUP handler")?;
    // The trace file is created first, so a path that cannot be written fails before the
    // cache is opened; if serving then fails to start, the empty trace goes again, so the
    // next start is not refused for an existing file.
    let recorder = match &s.record {
        Some((path, config)) => Some(Arc::new(start_recording(path, config)?)),
        None => None,
    };
    let manager = Arc::new(Notifier::from_env());
    let result = serve(&s, &stops, hangups, recorder.clone(), &manager);
    if let (Err(_), Some(recorder), Some((path, _))) = (&result, &recorder, &s.record) {
        if recorder.finish().records_written == 0 {
            let _ = std::fs::remove_file(path);
        }
    }
    result
}

/// Everything that can fail is checked or made before `Cache::open`, which marks the cache
/// running: a mistake at start leaves a warm cache warm. After it, a failed start closes the
/// cache cleanly, and a stop is bounded (docs/design.md §6.2).
fn serve(
    s: &Settings,
    stops: &StopEvents,
    hangups: signal_hook::iterator::Signals,
    recorder: Option<Arc<Recorder>>,
    manager: &Arc<Notifier>,
) -> Result<()> {
    let (dev, sb) = read_cache(s)?;
    let Endpoints {
        nbd,
        tcp,
        control,
        metrics,
        files: _socket_files,
    } = Endpoints::bind(s, &sb)?;
    let backings = match open_backings_to_serve(s, &*dev, &sb, stops) {
        Err(e) if e.downcast_ref::<StoppedWaiting>().is_some() => {
            // Nothing was opened or changed: a stop is a clean one (status 0 for a signal).
            let why = e
                .downcast_ref::<StoppedWaiting>()
                .map_or("", |w| w.0.as_str());
            tracing::info!("{e}: stopped before the cache was opened");
            if crate::signals::is_stop_signal(why) {
                return Ok(());
            }
            return Err(e);
        }
        other => other?,
    };
    manager.status(match sb.state {
        CacheState::Clean => "opening the cache (clean stop: restoring the cache map)",
        CacheState::Running => "opening the cache (no clean stop: replaying the journal)",
    });
    let cache = open_cache(s, dev, sb, backings)?;
    let server = match Server::new(
        exports(&cache, s.read_only, recorder.as_deref()),
        s.limits.server.clone(),
    ) {
        Ok(server) => Arc::new(server),
        Err(e) => {
            let e = anyhow::Error::new(e).context("cannot start the NBD server");
            return Err(close_after_failed_start(&cache, None, e));
        }
    };
    if let Err(e) = start_serving(
        s,
        &cache,
        &server,
        (nbd, tcp, control, metrics),
        stops,
        (&recorder, manager),
    ) {
        return Err(close_after_failed_start(&cache, Some(&server), e));
    }
    if let Err(e) = spawn_reloader(hangups, cache.clone(), s) {
        return Err(close_after_failed_start(&cache, Some(&server), e));
    }
    manager.ready(&serving_status(&cache));
    let why = stops.wait();
    manager.stopping(&format!(
        "{why}: stopping (requests finish, then the cache map is written)"
    ));
    tracing::info!(
        "{why}: stopping; requests in flight get up to {} s to finish (a second signal does not wait)",
        s.limits.shutdown_timeout.as_secs()
    );
    let ending = drain(&server, stops, s.limits.shutdown_timeout);
    close(&cache, ending, recorder.as_ref())?;
    if !crate::signals::is_stop_signal(&why) {
        // Stopped cleanly, but not because anyone asked: a service manager must see a
        // failure (and restart it), not a stop.
        bail!("stopped because of {why}; the cache was closed cleanly (see the log above)");
    }
    Ok(())
}

/// What `systemctl status` shows while serving (sent again when a volume is added, removed or
/// changes mode: `control::Daemon::refresh_status`).
pub(crate) fn serving_status(cache: &Cache) -> String {
    let volumes = cache.volumes();
    let (online, offline): (Vec<_>, Vec<_>) =
        volumes.iter().partition(|v| v.offline_reason().is_none());
    let online: Vec<String> = online
        .iter()
        .map(|v| format!("'{}' ({})", v.name(), v.mode()))
        .collect();
    let mut status = format!("serving {}", online.join(", "));
    if !offline.is_empty() {
        let names: Vec<String> = offline.iter().map(|v| format!("'{}'", v.name())).collect();
        status.push_str(&format!(
            "; OFFLINE (backing device unavailable, see the log): {}",
            names.join(", ")
        ));
    }
    status
}

fn start_serving(
    s: &Settings,
    cache: &Arc<Cache>,
    server: &Arc<Server>,
    (nbd, tcp, control, metrics): (
        UnixListener,
        Option<TcpListener>,
        UnixListener,
        Option<TcpListener>,
    ),
    stops: &StopEvents,
    (recorder, manager): (&Option<Arc<Recorder>>, &Arc<Notifier>),
) -> Result<()> {
    if let Some(tb) = s.ssd_tbw {
        cache
            .set_ssd_tbw_bytes((tb * crate::wear::TB) as u64)
            .context("recording --ssd-tbw in the superblock")?;
    }
    let wear = crate::wear::WearWatch::new(cache.clone());
    wear.spawn()?;
    control::spawn(
        control,
        control::Daemon {
            cache: cache.clone(),
            cache_path: s.cache.clone(),
            server: server.clone(),
            read_only: s.read_only,
            emulate_hdd: s.emulate_hdd,
            recorder: recorder.clone(),
            wear: wear.clone(),
            removed: Default::default(),
            removing: Default::default(),
            volume_ops: Default::default(),
            config_naming: s.config_naming.clone(),
            manager: manager.clone(),
            // What `ready` sends once serving starts: only changes are sent from here on.
            status_sent: std::sync::Mutex::new(Some(serving_status(cache))),
        },
    )?;
    if let Some(metrics) = metrics {
        crate::metrics::spawn(metrics, cache.clone(), wear)?;
    }
    for v in cache
        .volumes()
        .iter()
        .filter(|v| v.offline_reason().is_none())
    {
        tracing::info!(
            "serving volume '{}' ({}, {}) as NBD export '{}'",
            v.name(),
            v.mode(),
            human(v.size()),
            v.name()
        );
    }
    cache.set_dirty_limit(s.dirty_limit);
    set_volume_limits(cache, &s.tuning, false);
    if let Some(bytes) = s.checksum_memory {
        cache
            .set_checksum_memory(bytes)
            .context("setting --checksum-memory")?;
    }
    cache.start_cleaner(s.cleaner.clone());
    watch_halt(cache.clone(), stops.sender())?;
    spawn_listener(server, "unix", stops, move |server| server.serve_unix(nbd))?;
    if let Some(tcp) = tcp {
        spawn_listener(server, "tcp", stops, move |server| server.serve_tcp(tcp))?;
    }
    Ok(())
}

/// Reloads the config file at each SIGHUP (`systemctl reload`), on a thread of its own.
fn spawn_reloader(
    mut hangups: signal_hook::iterator::Signals,
    cache: Arc<Cache>,
    s: &Settings,
) -> Result<()> {
    let path = s.config_path.clone();
    let dirty_limit_fixed = s.dirty_limit_on_command_line;
    std::thread::Builder::new()
        .name("reload".into())
        .spawn(move || {
            for _ in hangups.forever() {
                let Some(path) = &path else {
                    tracing::info!(
                        "SIGHUP: no configuration file to reload (serve has no --config)"
                    );
                    continue;
                };
                match reload_config(&cache, path, dirty_limit_fixed) {
                    Ok(()) => tracing::info!("SIGHUP: reloaded {}", path.display()),
                    Err(e) => tracing::warn!(
                        "SIGHUP: {} not reloaded, nothing changed: {e:#}",
                        path.display()
                    ),
                }
            }
        })
        .context("cannot start the reload thread")?;
    Ok(())
}

/// Sets each volume's `[volume.NAME] dirty_limit` and `occupancy_limit` (a volume the file
/// does not limit has no limit of its own) and logs them; `every` also logs the volumes
/// without (a reload says what changed back).
fn set_volume_limits(cache: &Cache, tuning: &CacheTuning, every: bool) {
    for v in cache.volumes().iter() {
        v.set_dirty_cap(tuning.volume_dirty_limit(v.name()));
        v.set_occupancy_cap(tuning.volume_occupancy_limit(v.name()));
        let name = v.name();
        match (v.occupancy_cap_lines(), v.dirty_cap_lines()) {
            (None, None) if every => {
                tracing::info!("volume '{name}' has no limits of its own")
            }
            (None, None) => {}
            (lines, dirty) => tracing::info!(
                "volume '{name}' may hold {} lines and {} dirty lines ([volume.{name}] \
                 occupancy_limit, dirty_limit)",
                lines.map_or("any number of".into(), |l| format!("at most {l}")),
                dirty.map_or("any number of".into(), |l| format!("at most {l}"))
            ),
        }
    }
}

/// Applies what a reload can change while serving: the cache's `dirty_limit` (unless given on
/// the command line), and each volume's `[volume.NAME]` `admission` and `sequential_cutoff`
/// (written to the superblock, as at a start), `dirty_limit` and `occupancy_limit`. The file
/// is checked whole first (it must parse, name only volumes the cache has, with valid values),
/// and nothing changes if it fails. A new replacement policy takes effect at the next start,
/// which the log says; so do the other keys, read only at a start.
fn reload_config(cache: &Cache, path: &std::path::Path, dirty_limit_fixed: bool) -> Result<()> {
    let file = FileConfig::load(path)?;
    let tuning = CacheTuning::from(&file);
    let mut sb = cache.superblock();
    let policy_was = sb.volumes.first().map(|v| v.policy);
    let changes = tuning.apply(&mut sb)?;
    let limit = file
        .dirty_limit
        .unwrap_or(ssdcache_engine::DEFAULT_DIRTY_LIMIT * 100.0);
    if !(0.0..=100.0).contains(&limit) {
        bail!("dirty_limit = {limit}: a percentage from 0 to 100");
    }
    for change in changes {
        tracing::info!("config file: {change}");
    }
    if sb.volumes.first().map(|v| v.policy) != policy_was {
        tracing::warn!("config file: the replacement policy changes at the next start");
    }
    if !dirty_limit_fixed {
        cache.set_dirty_limit(limit / 100.0);
        tracing::info!("dirty limit: {limit}% of the cache's lines");
    }
    let retuned = retune_volumes(cache, &sb);
    set_volume_limits(cache, &tuning, true);
    // Last, once every change is made: a failed write must not leave half of them undone
    // (review 41). The values stay in force, and the next superblock write keeps them.
    if retuned {
        if let Err(e) = cache.persist_config() {
            tracing::warn!(
                "config file: the new admission and sequential cutoffs apply, but writing them \
                 to the superblock failed ({e}); the next superblock write keeps them"
            );
        }
    }
    Ok(())
}

/// Gives the open volumes the admission and sequential cutoff of their slots in `tuned` (a
/// superblock the config file was applied to); true when one changed.
fn retune_volumes(cache: &Cache, tuned: &Superblock) -> bool {
    let mut changed = false;
    for v in cache.volumes().iter() {
        let Some(slot) = tuned.volumes.iter().find(|s| s.id == v.id()) else {
            continue;
        };
        // `CacheTuning::apply` wrote only codes it parsed.
        if let Ok(admission) = Admission::from_disk(slot.admission) {
            if admission != v.admission() {
                v.set_admission(admission);
                changed = true;
            }
        }
        if slot.sequential_cutoff != v.sequential_cutoff() {
            v.set_sequential_cutoff(slot.sequential_cutoff);
            changed = true;
        }
    }
    changed
}

/// Accepts connections on a thread of its own; a listener that fails stops the daemon.
fn spawn_listener(
    server: &Arc<Server>,
    kind: &'static str,
    stops: &StopEvents,
    accept: impl FnOnce(&Server) -> Result<(), ServerError> + Send + 'static,
) -> Result<()> {
    let server = server.clone();
    let stop = stops.sender();
    std::thread::Builder::new()
        .name(format!("nbd-{kind}"))
        .spawn(move || {
            if let Err(e) = accept(&server) {
                tracing::error!("NBD {kind} listener failed: {e}");
                let _ = stop.send(format!("the {kind} listener failing"));
            }
        })
        .with_context(|| format!("cannot start the NBD {kind} listener's thread"))?;
    Ok(())
}

/// Every socket `serve` listens on, made before the cache is opened, so that a path in use, a
/// missing directory or a bad address costs no cache start.
struct Endpoints {
    nbd: UnixListener,
    tcp: Option<TcpListener>,
    control: UnixListener,
    metrics: Option<TcpListener>,
    files: SocketFiles,
}

/// Socket files (and the control link) this daemon made, removed when dropped: on every way
/// out of `serve`, so no stale socket or dangling link is left behind after a stop.
struct SocketFiles(Vec<PathBuf>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Endpoints {
    fn bind(s: &Settings, sb: &Superblock) -> Result<Endpoints> {
        let mut files = SocketFiles(Vec::new());
        let nbd = match &s.socket {
            Some(path) => (control::bind(path)?, path.clone()),
            None => {
                let first = sb.volumes.first().map_or("ssdcache", |v| v.name.as_str());
                let path = crate::runtime_dir().join(format!("{first}.sock"));
                (control::bind_creating_dir(&path)?, path)
            }
        };
        files.0.push(nbd.1.clone());
        let tcp = s.listen.as_deref().map(listen_tcp).transpose()?;
        if let Some(listener) = &tcp {
            warn_if_exposed(listener, s.limits.server.tls.as_ref());
        }
        let metrics = s.metrics.as_deref().map(crate::metrics::bind).transpose()?;
        let default_control = control::default_path(&sb.cache_uuid);
        let control = match &s.control {
            Some(path) => (control::bind(path)?, path.clone()),
            None => (
                control::bind_creating_dir(&default_control)?,
                default_control.clone(),
            ),
        };
        files.0.push(control.1.clone());
        // `stats --cache` looks for the control socket at the default path: point it there.
        if control.1 != default_control {
            files.0.push(control::link(&control.1, &default_control)?);
        }
        tracing::info!(
            "listening on unix:{}{}; control socket {}{}",
            nbd.1.display(),
            s.listen
                .as_deref()
                .map(|a| format!(" and tcp:{a}"))
                .unwrap_or_default(),
            control.1.display(),
            s.metrics
                .as_deref()
                .map(|a| format!("; metrics at http://{a}/metrics"))
                .unwrap_or_default()
        );
        Ok(Endpoints {
            nbd: nbd.0,
            tcp,
            control: control.0,
            metrics,
            files,
        })
    }
}

/// Listens on TCP `addr`; an address that is not HOST:PORT is bad usage.
/// A TCP listener beyond loopback without `--tls require` lets anyone who reaches it read and
/// write the volumes: said once, at start.
fn warn_if_exposed(listener: &TcpListener, tls: Option<&ssdcache_nbd::TlsConfig>) {
    let loopback = listener.local_addr().is_ok_and(|a| a.ip().is_loopback());
    if !loopback && !tls.is_some_and(|t| t.required) {
        tracing::warn!(
            "NBD over TCP beyond loopback without --tls require: anyone who can reach it can \
             read and write the volumes in plaintext"
        );
    }
}

fn listen_tcp(addr: &str) -> Result<TcpListener> {
    let well_formed = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !well_formed {
        return Err(usage_error(format!(
            "--listen {addr:?} is not HOST:PORT (for example 127.0.0.1:10809)"
        )));
    }
    TcpListener::bind(addr).with_context(|| {
        format!("cannot listen on tcp {addr}; is another server using it? choose another --listen")
    })
}

/// How long the connections' threads get to unwind after their sockets were closed.
const UNWIND_GRACE: Duration = Duration::from_secs(2);
/// How often a stop checks for a second signal while it waits for requests.
const STOP_POLL: Duration = Duration::from_millis(50);
/// Bounds of the steps of a stop after the requests: the cleaner's batch (writes to the
/// backing device), the trace file, the checkpoint (proportional to the cache's metadata) or,
/// when requests are stuck, the journal commit. A step that does not finish in time is left
/// behind: exiting then is a crash, which the journal is made for.
const CLEANER_STOP_BOUND: Duration = Duration::from_secs(20);
const RECORDING_BOUND: Duration = Duration::from_secs(5);
const CHECKPOINT_BOUND: Duration = Duration::from_secs(120);
const COMMIT_BOUND: Duration = Duration::from_secs(20);

/// How the requests ended when the server stopped.
enum Ending {
    /// No request is left inside the engine: the cache map can be written.
    Drained,
    /// Requests still inside the engine (a hung device), and connections still open.
    Stuck { requests: usize, connections: usize },
}

/// Stops the server: no new request is read, those in flight get `timeout` (or until a second
/// signal) to finish and be answered, then every client socket is closed.
fn drain(server: &Server, stops: &StopEvents, timeout: Duration) -> Ending {
    server.shutdown();
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if server.wait_idle_timeout(left.min(STOP_POLL)) {
            return Ending::Drained;
        }
        if left.is_zero() {
            tracing::warn!(
                "{} NBD connections still busy after {} s: closing every client socket",
                server.open_connections(),
                timeout.as_secs()
            );
            break;
        }
        if let Some(why) = stops.try_next() {
            tracing::warn!("{why} again: closing every client socket without waiting");
            break;
        }
    }
    close_connections(server)
}

/// Closes every client socket and gives the connections' threads a moment to end. After
/// `force_close` no request enters the engine any more, so the engine is left alone for good
/// once none is inside, even if a connection's thread is still unwinding.
fn close_connections(server: &Server) -> Ending {
    server.force_close();
    if server.wait_idle_timeout(UNWIND_GRACE) {
        return Ending::Drained;
    }
    match server.requests_in_backend() {
        0 => {
            tracing::warn!(
                "{} NBD connections still closing, none inside the engine",
                server.open_connections()
            );
            Ending::Drained
        }
        requests => Ending::Stuck {
            requests,
            connections: server.open_connections(),
        },
    }
}

/// The end of a daemon that served: a clean stop when no request is left inside the engine,
/// else the journal committed and an error.
fn close(cache: &Arc<Cache>, ending: Ending, recorder: Option<&Arc<Recorder>>) -> Result<()> {
    match ending {
        Ending::Drained => close_cleanly(cache, recorder),
        Ending::Stuck {
            requests,
            connections,
        } => Err(close_with_journal(
            cache,
            &format!(
                "{requests} requests are still inside the engine ({connections} connections \
                 open), waiting for a device that does not answer"
            ),
            recorder,
        )),
    }
}

/// Stops the cleaner and the recording, then writes the cache map: the next start is warm.
fn close_cleanly(cache: &Arc<Cache>, recorder: Option<&Arc<Recorder>>) -> Result<()> {
    stop_recording(recorder);
    let cleaner = cache.clone();
    if bounded("cleaner-stop", CLEANER_STOP_BOUND, move || {
        cleaner.stop_cleaner()
    })
    .is_none()
    {
        return Err(close_with_journal(
            cache,
            "the cleaner did not stop (a write to a backing device does not finish)",
            None,
        ));
    }
    tracing::info!(
        "all requests finished; writing the cache map ({} dirty, kept in the cache)",
        human(cache.dirty_bytes())
    );
    let closing = cache.clone();
    match bounded("checkpoint", CHECKPOINT_BOUND, move || closing.shutdown()) {
        Some(Ok(())) => {
            tracing::info!("stopped cleanly");
            Ok(())
        }
        Some(Err(e)) => Err(anyhow::Error::new(e).context(
            "writing the cache map failed; the next start replays the journal (dirty data is \
             kept, clean cached data is dropped)",
        )),
        None => bail!(
            "writing the cache map did not finish within {} s; the next start replays the \
             journal (dirty data is kept, clean cached data is dropped)",
            CHECKPOINT_BOUND.as_secs()
        ),
    }
}

/// The stop when the cache map cannot be written safely: writing it would race requests
/// still inside the engine. The journal is committed instead (safe while requests run: a
/// FLUSH does the same), so every write completed before the stop is durable; the cache stays
/// marked running and the next start replays the journal.
fn close_with_journal(
    cache: &Arc<Cache>,
    why: &str,
    recorder: Option<&Arc<Recorder>>,
) -> anyhow::Error {
    tracing::warn!("{why}: not writing the cache map (it would race them); committing the journal");
    let cleaner = cache.clone();
    // Only tells the cleaner to stop: its thread may be the one waiting for the device.
    let _ = bounded("cleaner-stop", Duration::from_millis(100), move || {
        cleaner.stop_cleaner()
    });
    let committing = cache.clone();
    match bounded("commit", COMMIT_BOUND, move || committing.commit()) {
        Some(Ok(())) => {
            tracing::info!("journal committed: every write completed before the stop is durable")
        }
        Some(Err(e)) => tracing::error!(
            "journal commit failed ({e}); writes acknowledged by a FLUSH or FUA are durable, \
             later ones may be lost"
        ),
        None => tracing::error!(
            "journal commit did not finish within {} s; writes acknowledged by a FLUSH or FUA \
             are durable, later ones may be lost",
            COMMIT_BOUND.as_secs()
        ),
    }
    stop_recording(recorder);
    anyhow::anyhow!(
        "stopped without writing the cache map: {why}. The next start replays the journal: \
         dirty data is kept, clean cached data is dropped"
    )
}

/// A start that failed after `Cache::open` (which marked the cache running): close what was
/// started and the cache cleanly, so the mistake does not turn a warm cache cold.
fn close_after_failed_start(
    cache: &Arc<Cache>,
    server: Option<&Server>,
    error: anyhow::Error,
) -> anyhow::Error {
    tracing::error!("start failed after the cache was opened ({error:#}); closing it cleanly");
    let ending = server.map_or(Ending::Drained, close_connections);
    if let Err(e) = close(cache, ending, None) {
        tracing::error!("{e:#}");
    }
    error
}

/// Runs `work` on a thread of its own and waits at most `limit` for it; `None` when it did not
/// finish in time (it goes on, and ends with the process) or its thread could not start.
fn bounded<T: Send + 'static>(
    name: &str,
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (done, result) = mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = done.send(work());
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start a thread for {name}: {e}");
        return None;
    }
    result.recv_timeout(limit).ok()
}

fn stop_recording(recorder: Option<&Arc<Recorder>>) {
    let Some(recorder) = recorder.cloned() else {
        return;
    };
    if bounded("recording", RECORDING_BOUND, move || {
        finish_recording(&recorder)
    })
    .is_none()
    {
        tracing::warn!(
            "the trace file was not closed within {} s",
            RECORDING_BOUND.as_secs()
        );
    }
}

fn start_recording(path: &std::path::Path, config: &RecordConfig) -> Result<Recorder> {
    let recorder = Recorder::create(path, config.clone())
        .with_context(|| "cannot start recording the workload (--record-trace)")?;
    tracing::info!(
        "recording requests to {} ({}, at most {})",
        path.display(),
        if config.sample_rate >= 1.0 {
            "all of them".to_owned()
        } else {
            format!(
                "those to {}% of the {} regions",
                100.0 * config.sample_rate,
                human(config.sample_region)
            )
        },
        human(config.max_bytes)
    );
    Ok(recorder)
}

fn finish_recording(recorder: &Recorder) {
    let st = recorder.finish();
    let summary = format!(
        "trace {}: {} requests recorded ({}), {} dropped",
        st.path,
        st.records_written,
        human(st.bytes_written),
        st.records_dropped
    );
    match &st.error {
        Some(e) => tracing::warn!("{summary}; recording failed: {e}"),
        None => tracing::info!("{summary}; {}", st.state),
    }
}

/// Makes glibc give request buffers back when they are freed. By default glibc raises its
/// mmap threshold to the size of each large block freed (up to 32 MiB), after which blocks of
/// that size come from heap arenas that thousands of worker threads fragment and never shrink:
/// measured under 64 connections × 32 requests, the daemon's resident memory grew to 1.4–3 GiB
/// against a 256 MiB request budget. A fixed threshold keeps every block of 128 KiB or more in
/// its own mapping, returned at free.
fn return_freed_buffers_to_the_system() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes an allocator tunable; it is called before the daemon starts
    // any thread, and M_MMAP_THRESHOLD with this value is documented as valid.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Stops the daemon once the engine halted after a failed internal check: requests already
/// fail, and the stop that follows cannot write the cache map (the engine refuses), so the
/// cache stays marked running and the next start replays the journal.
fn watch_halt(cache: Arc<Cache>, stop: mpsc::Sender<String>) -> Result<()> {
    std::thread::Builder::new()
        .name("halt-watch".into())
        .spawn(move || loop {
            if let Some(reason) = cache.halted() {
                let _ = stop.send(format!("the cache halting ({reason})"));
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        })
        .context("cannot start the halt watcher's thread")?;
    Ok(())
}
