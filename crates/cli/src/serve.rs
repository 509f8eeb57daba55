//! The daemon: open and check devices, serve NBD, answer the control socket, stop cleanly.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use ssdcache_device::hdd::{HddDevice, HddParams};
use ssdcache_device::{identity, BlockDevice};
use ssdcache_engine::{Cache, CleanerConfig, EngineError, Volume};
use ssdcache_format::{Superblock, VolumeSlot};
use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};
use ssdcache_sim::record::{RecordConfig, Recorder, VolumeRecorder, MIN_MAX_BYTES};
use ssdcache_sim::trace::Op;

use crate::config::FileConfig;
use crate::control;
use crate::devices::open_device;
use crate::size::{human, parse_size};
use crate::tuning::CacheTuning;

const MAX_REQUEST: u32 = 32 << 20;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML configuration file (see docs/operations.md); flags override its keys. It also
    /// sets the cache's replacement `policy` and, under [volume.NAME], a volume's `admission`
    /// and `sequential_cutoff` (kept in the cache's superblock)
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Cache device or file made by `ssdcache create`
    #[arg(long, value_name = "PATH")]
    cache: Option<PathBuf>,
    /// Unix socket for NBD clients, mode 0600 [default: /run/ssdcache/VOLUME.sock as root]
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also serve NBD over TCP on this address, e.g. 127.0.0.1:10809 (no TLS yet)
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Control socket for `stats` and `info` [default: /run/ssdcache/CACHE-UUID.ctl as root]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Export every volume read-only
    #[arg(long)]
    read_only: bool,
    /// Worker threads per NBD connection: requests in flight per connection, to the cache and
    /// to the backing device (a hard drive reorders up to 32) [default: 32]
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Put the HDD model (7200 rpm, see `ssdcache hdd-emulator --help`) between the cache and
    /// each backing device, so a backing file on fast storage behaves like a hard drive: for
    /// benchmarks and demos
    #[arg(long)]
    emulate_hdd: bool,
    /// Where a volume's backing device is now, if not at its recorded path (repeatable)
    #[arg(long, value_name = "NAME=PATH", value_parser = parse_backing)]
    backing: Vec<(String, PathBuf)>,
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
}

pub(crate) fn parse_backing(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_owned(), PathBuf::from(path)))
        }
        _ => Err(format!("{s:?} is not NAME=PATH")),
    }
}

struct Settings {
    cache: PathBuf,
    socket: Option<PathBuf>,
    listen: Option<String>,
    control: Option<PathBuf>,
    read_only: bool,
    threads: usize,
    backing: BTreeMap<String, PathBuf>,
    emulate_hdd: bool,
    cleaner: CleanerConfig,
    tuning: CacheTuning,
    record: Option<(PathBuf, RecordConfig)>,
}

fn settings(args: ServeArgs) -> Result<Settings> {
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let tuning = CacheTuning::from(&file);
    let record = record_settings(&args, &file)?;
    let Some(cache) = args.cache.or(file.cache) else {
        bail!("no cache given: use --cache PATH or `cache = \"PATH\"` in the config file");
    };
    let mut backing = file.backing;
    backing.extend(args.backing);
    let threads = args.threads.or(file.threads).unwrap_or(32);
    if !(1..=256).contains(&threads) {
        bail!("--threads {threads} is out of range (1 to 256)");
    }
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
        bail!(
            "write-back watermarks must be percentages with low <= high (got high {high}, low {low})"
        );
    }
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
        cache,
        socket: args.socket.or(file.socket),
        listen: args.listen.or(file.listen),
        control: args.control.or(file.control),
        read_only: args.read_only || file.read_only.unwrap_or(false),
        threads,
        backing,
        emulate_hdd: args.emulate_hdd,
        tuning,
        record,
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
            bail!(
                "--record-sample, --record-max-size and --record-trace-force need --record-trace FILE"
            );
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
        bail!(
            "--record-sample {} is out of range: give a fraction above 0 and at most 1 (0.01 records 1%)",
            config.sample_rate
        );
    }
    if config.max_bytes < MIN_MAX_BYTES {
        bail!(
            "--record-max-size {} is too small (at least {MIN_MAX_BYTES} bytes)",
            config.max_bytes
        );
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

/// Opens the backing device of a volume and proves it is the one recorded at create.
/// `dirty` tells the volume's dirty data in the cache, for the message when the device is
/// missing or different (asked only then: it reads the cache's metadata).
pub(crate) fn open_backing(
    slot: &VolumeSlot,
    overrides: &BTreeMap<String, PathBuf>,
    dirty: &dyn Fn() -> u64,
) -> Result<Arc<dyn BlockDevice>> {
    let at_risk = || {
        let dirty = dirty();
        if dirty == 0 {
            return String::new();
        }
        format!(
            " The cache holds {} of dirty data for this volume that this device does not have: \
             serving the cache in front of another device would corrupt both. If the device is \
             lost, write the dirty data onto a copy or replacement with `ssdcache recover \
             --cache CACHE --backing NEW --force`.",
            human(dirty)
        )
    };
    let path = overrides
        .get(&slot.name)
        .cloned()
        .unwrap_or_else(|| PathBuf::from(&slot.backing.path));
    let what = format!("backing device of volume '{}'", slot.name);
    let dev = open_device(&path, &what, true, true).map_err(|e| {
        let missing = e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound)
        });
        if missing {
            anyhow::anyhow!(
                "{e:#}; if the disk moved, point to it with --backing {}=PATH.{}",
                slot.name,
                at_risk()
            )
        } else {
            anyhow::anyhow!("{e:#}{}", at_risk())
        }
    })?;
    let found = identity::probe(&path, dev.size())
        .with_context(|| format!("cannot identify {}", path.display()))?;
    if let Some(why) = identity::mismatch(&slot.backing, &found) {
        let at_risk = at_risk();
        bail!(
            "refusing to serve volume '{}': {} is not the backing device this cache was created for ({why}). \
             Point to the right device with --backing {}=PATH.{}",
            slot.name,
            path.display(),
            slot.name,
            if !at_risk.is_empty() {
                at_risk
            } else {
                " If the cache really belongs to this device now, re-create it with `ssdcache create --force` \
                 (the cache holds no dirty data, so nothing is lost)".to_owned()
            }
        );
    }
    Ok(dev)
}

fn with_hdd_model(dev: Arc<dyn BlockDevice>, emulate: bool) -> Arc<dyn BlockDevice> {
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
        EngineError::Backing { .. }
        | EngineError::CacheDevice { .. }
        | EngineError::Format(_)
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
}

fn exports(cache: &Cache, read_only: bool, recorder: Option<&Recorder>) -> Vec<ServerExport> {
    cache
        .volumes()
        .iter()
        .map(|v| {
            let ro = read_only || v.read_only();
            ServerExport {
                info: ExportInfo {
                    name: v.name().to_owned(),
                    description: format!("ssdcache volume {} ({})", v.name(), v.mode()),
                    size: v.size(),
                    flags: transmission_flags(ro),
                    min_block: 4096,
                    preferred_block: v.line_size().min(u64::from(MAX_REQUEST)) as u32,
                    max_block: MAX_REQUEST,
                },
                backend: Arc::new(VolumeExport {
                    volume: v.clone(),
                    recorder: recorder.map(|r| r.volume(v.name())),
                }),
            }
        })
        .collect()
}

fn open_cache(s: &Settings) -> Result<(Arc<Cache>, Superblock)> {
    let dev = open_device(&s.cache, "cache", true, true)?;
    let mut sb = ssdcache_engine::read_superblock(&*dev)
        .with_context(|| format!("cannot use cache {}", s.cache.display()))?;
    // Cache::open writes the superblock, which makes these settings persistent.
    for change in s.tuning.apply(&mut sb).map_err(crate::as_usage_error)? {
        tracing::info!("config file: {change}");
    }
    let dirty = |i: usize| dirty_per_volume(&*dev, &sb).get(i).copied().unwrap_or(0);
    let backings = sb
        .volumes
        .iter()
        .enumerate()
        .map(|(i, v)| open_backing(v, &s.backing, &|| dirty(i)))
        .map(|dev| dev.map(|d| with_hdd_model(d, s.emulate_hdd)))
        .collect::<Result<Vec<_>>>()?;
    if !dev.is_direct() {
        tracing::warn!(
            "cache {}: no O_DIRECT on this filesystem",
            s.cache.display()
        );
    }
    let (cache, report) = Cache::open(dev, sb.clone(), backings)
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
    Ok((Arc::new(cache), sb))
}

/// Dirty bytes of each volume as the cache's metadata records them (journal replayed after
/// an unclean stop); zero where the metadata cannot be read (opening reports that).
pub(crate) fn dirty_per_volume(dev: &dyn BlockDevice, sb: &Superblock) -> Vec<u64> {
    match ssdcache_engine::offline_stats(dev, sb) {
        Ok(vols) => vols.iter().map(|v| v.dirty_bytes).collect(),
        Err(_) => sb.volumes.iter().map(|v| v.dirty_bytes).collect(),
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let s = settings(args).map_err(crate::as_usage_error)?;
    // The trace file is created first, so a path that cannot be written fails before the
    // cache is opened; if serving then fails to start, the empty trace goes again, so the
    // next start is not refused for an existing file.
    let recorder = match &s.record {
        Some((path, config)) => Some(Arc::new(start_recording(path, config)?)),
        None => None,
    };
    let result = serve(&s, recorder.clone());
    if let (Err(_), Some(recorder), Some((path, _))) = (&result, &recorder, &s.record) {
        if recorder.finish().records_written == 0 {
            let _ = std::fs::remove_file(path);
        }
    }
    result
}

fn serve(s: &Settings, recorder: Option<Arc<Recorder>>) -> Result<()> {
    let (cache, sb) = open_cache(s)?;
    let first = sb
        .volumes
        .first()
        .map(|v| v.name.clone())
        .unwrap_or_default();
    let socket = s
        .socket
        .clone()
        .unwrap_or_else(|| crate::runtime_dir().join(format!("{first}.sock")));
    let control_path = s
        .control
        .clone()
        .unwrap_or_else(|| control::default_path(&sb.cache_uuid));
    let server = Arc::new(
        Server::new(
            exports(&cache, s.read_only, recorder.as_deref()),
            ServerConfig {
                threads_per_connection: s.threads,
                max_request: MAX_REQUEST,
                ..ServerConfig::default()
            },
        )
        .context("cannot start the NBD server")?,
    );
    let unix = control::bind(&socket)?;
    let tcp = match &s.listen {
        Some(addr) => Some(
            std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen on {addr}"))?,
        ),
        None => None,
    };
    control::spawn(
        control::bind(&control_path)?,
        cache.clone(),
        s.cache.clone(),
        recorder.clone(),
    );
    // `stats --cache` looks for the control socket at the default path: point it there.
    let default_control = control::default_path(&sb.cache_uuid);
    let control_link =
        (default_control != control_path).then(|| control::link(&control_path, &default_control));
    for v in cache.volumes() {
        tracing::info!(
            "serving volume '{}' ({}, {}) as NBD export '{}'",
            v.name(),
            v.mode(),
            human(v.size()),
            v.name()
        );
    }
    tracing::info!(
        "listening on unix:{}{}; control socket {}",
        socket.display(),
        s.listen
            .as_deref()
            .map(|a| format!(" and tcp:{a}"))
            .unwrap_or_default(),
        control_path.display()
    );
    cache.start_cleaner(s.cleaner.clone());
    watch_signals(server.clone())?;
    watch_halt(cache.clone(), server.clone());
    let mut listeners = vec![{
        let server = server.clone();
        std::thread::spawn(move || server.serve_unix(unix))
    }];
    if let Some(tcp) = tcp {
        let server = server.clone();
        listeners.push(std::thread::spawn(move || server.serve_tcp(tcp)));
    }
    for l in listeners {
        match l.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("listener stopped: {e}"),
            Err(_) => tracing::error!("listener thread panicked"),
        }
    }
    server.wait_idle();
    if let Some(recorder) = &recorder {
        finish_recording(recorder);
    }
    cache.stop_cleaner();
    tracing::info!(
        "all requests finished; writing the cache map ({} dirty, kept in the cache)",
        human(cache.dirty_bytes())
    );
    cache
        .shutdown()
        .context("clean shutdown failed; the next start will be cold (no data lost)")?;
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_file(&control_path);
    if let Some(Ok(link)) = control_link {
        let _ = std::fs::remove_file(link);
    }
    tracing::info!("stopped cleanly");
    Ok(())
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

/// Stops serving once the engine halted after a failed internal check: requests already fail,
/// and the shutdown that follows leaves the cache marked running (no checkpoint of a state that
/// failed a check), so the next start replays the journal.
fn watch_halt(cache: Arc<Cache>, server: Arc<Server>) {
    std::thread::spawn(move || loop {
        if let Some(reason) = cache.halted() {
            tracing::error!("stopping: the cache halted ({reason})");
            server.shutdown();
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    });
}

/// On SIGTERM or SIGINT, starts a graceful stop; a second signal is logged, not fatal, so
/// the map is still written.
pub fn watch_signals(server: Arc<Server>) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .context("cannot install signal handlers")?;
    std::thread::spawn(move || {
        for sig in signals.forever() {
            tracing::info!("signal {sig}: stopping (in-flight requests finish first)");
            server.shutdown();
        }
    });
    Ok(())
}
