//! Commands that move dirty data: `flush` (write it all back now), `detach` (flush, then hand
//! the backing device back as a plain disk), `recover` (write back the dirty data of a cache
//! whose daemon is gone or will not start, offline) and `set-mode`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ssdcache_device::identity;
use ssdcache_engine::{Cache, CleanerConfig, OpenReport, VolumeState};
use ssdcache_format::{CacheMode, CacheState, Superblock};

use crate::control;
use crate::devices::{
    open_backing, open_backing_device, open_backings, open_backings_allowing_offline,
    open_cache_device, parse_backing, read_cache,
};
use crate::size::human;
use crate::ModeArg;

#[derive(Args)]
pub struct FlushArgs {
    /// Cache device or file
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Control socket of the running daemon; given, it must answer (no offline fallback)
    /// [default: derived from the cache's UUID]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Where a volume's backing device is now, when flushing offline (repeatable)
    #[arg(long, value_name = "NAME=PATH", value_parser = parse_backing)]
    backing: Vec<(String, PathBuf)>,
    /// Give up dirty data that fails its checksum or cannot be read back from the cache
    /// device (the cache lost or damaged it; without this flag nothing is written back while
    /// any is found, and the error names the ranges). That data is lost: the backing device
    /// keeps its older contents there. Everything else is written back.
    #[arg(long)]
    discard_damaged: bool,
}

#[derive(Args)]
pub struct DetachArgs {
    /// Cache device or file (the daemon must be stopped)
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Where a volume's backing device is now, if it moved (repeatable)
    #[arg(long, value_name = "NAME=PATH", value_parser = parse_backing)]
    backing: Vec<(String, PathBuf)>,
    /// Give up dirty data that fails its checksum or cannot be read back from the cache
    /// device (the cache lost or damaged it; without this flag nothing is written back while
    /// any is found, and the error names the ranges). That data is lost: the backing device
    /// keeps its older contents there. Everything else is written back.
    #[arg(long)]
    discard_damaged: bool,
}

#[derive(Args)]
pub struct RecoverArgs {
    /// Cache device or file holding the dirty data
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Device or file to write the dirty data onto (the volume's backing device, or a
    /// replacement with --force)
    #[arg(long, value_name = "PATH")]
    backing: PathBuf,
    /// Volume whose data to write [default: the cache's first volume]
    #[arg(long, value_name = "NAME")]
    volume: Option<String>,
    /// Write even though --backing is not the device recorded at create (a replacement disk
    /// that holds a copy of the old one)
    #[arg(long)]
    force: bool,
    /// Give up dirty data that fails its checksum or cannot be read back from the cache
    /// device (the cache lost or damaged it; without this flag nothing is written back while
    /// any is found, and the error names the ranges). That data is lost: the backing device
    /// keeps its older contents there. Everything else is written back.
    #[arg(long)]
    discard_damaged: bool,
}

#[derive(Args)]
pub struct SetModeArgs {
    /// Cache device or file
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// The new caching mode
    #[arg(long, value_enum)]
    mode: ModeArg,
    /// Volume to change [default: the cache's first volume]
    #[arg(long, value_name = "NAME")]
    volume: Option<String>,
    /// Control socket of the running daemon; given, it must answer (no offline fallback)
    /// [default: derived from the cache's UUID]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
}

/// An online flush that writes nothing back for this long gives up (device errors).
const STUCK_AFTER: Duration = Duration::from_secs(120);

/// Set by SIGINT/SIGTERM/SIGHUP (a closed terminal) so a long write-back stops between
/// batches, keeping its progress.
pub(crate) fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, flag.clone()).context("cannot install signal handler")?;
    }
    Ok(flag)
}

/// Shows bytes left, rate and ETA: a bar on a terminal, a line every few seconds otherwise.
pub(crate) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    total: u64,
    started: Instant,
    last_line: Instant,
    what: &'static str,
}

impl Progress {
    pub(crate) fn new(total: u64, what: &'static str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:40}] {bytes}/{total_bytes} written back, {bytes_per_sec}, ETA {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_message(what);
            bar
        });
        eprintln!("{what}: {} of dirty data to write back", human(total));
        Progress {
            bar,
            total,
            started: Instant::now(),
            last_line: Instant::now(),
            what,
        }
    }

    pub(crate) fn update(&mut self, left: u64) {
        let done = self.total.saturating_sub(left);
        if let Some(bar) = &self.bar {
            bar.set_position(done);
            return;
        }
        if self.last_line.elapsed() >= Duration::from_secs(2) {
            self.last_line = Instant::now();
            let secs = self.started.elapsed().as_secs_f64().max(1e-3);
            let rate = done as f64 / secs;
            let eta = if rate > 0.0 {
                format!("{:.0} s", left as f64 / rate)
            } else {
                "unknown".into()
            };
            eprintln!(
                "{}: {} left, {}/s, ETA {eta}",
                self.what,
                human(left),
                human(rate as u64)
            );
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// The superblock, to find the daemon (a damaged copy is reported when the cache is opened).
fn read_sb(path: &Path) -> Result<Superblock> {
    Ok(read_cache(path)?.1.superblock)
}

/// Asks the daemon: the one at --control if given (which must answer), else the one serving
/// the cache, if any (`None`: no daemon serves it).
pub(crate) fn ask_daemon(
    sb: &Superblock,
    given: &Option<PathBuf>,
    request: &str,
) -> Result<Option<(PathBuf, serde_json::Value)>> {
    let path = given
        .clone()
        .unwrap_or_else(|| control::default_path(&sb.cache_uuid));
    match control::query(&path, request)? {
        Some(answer) => Ok(Some((path, answer))),
        None if given.is_some() => bail!(
            "no daemon answers on control socket {} (given with --control); start the daemon, \
             or leave --control out to use the daemon serving the cache, or the cache offline \
             when none does",
            path.display()
        ),
        None => Ok(None),
    }
}

/// Refuses a `--backing NAME=PATH` for a volume the cache does not have (a typo would
/// otherwise be ignored and the recorded path used).
fn check_backing_names(sb: &Superblock, overrides: &[(String, PathBuf)]) -> Result<()> {
    for (name, path) in overrides {
        if sb.volume_by_name(name).is_none() {
            let known: Vec<&str> = sb.volumes.iter().map(|v| v.name.as_str()).collect();
            return Err(crate::usage_error(format!(
                "--backing {name}={}: the cache has no volume '{name}' (its volumes: {})",
                path.display(),
                known.join(", ")
            )));
        }
    }
    Ok(())
}

/// The index of the volume named by `flag` (--volume; default: the first), refusing an
/// unknown name.
fn volume_index(sb: &Superblock, flag: &str, given: Option<&str>) -> Result<usize> {
    let Some(name) = given else {
        return if sb.volumes.is_empty() {
            bail!("the cache has no volume")
        } else {
            Ok(0)
        };
    };
    sb.volumes
        .iter()
        .position(|v| v.name == name)
        .ok_or_else(|| {
            let known: Vec<&str> = sb.volumes.iter().map(|v| v.name.as_str()).collect();
            crate::usage_error(format!(
                "{flag} {name}: the cache has no volume '{name}' (its volumes: {})",
                known.join(", ")
            ))
        })
}

/// Dirty bytes the daemon can write back: offline volumes' (no backing device) wait.
fn dirty_of(stats: &serde_json::Value) -> u64 {
    stats["volumes"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .filter(|v| v["state"].as_str() != Some(VolumeState::Offline.name()))
                .filter_map(|v| v["dirty_bytes"].as_u64())
                .sum()
        })
        .unwrap_or(0)
}

/// Opens a cache offline, every backing device checked as `serve` checks it.
fn open_offline(
    cache_path: &Path,
    overrides: &[(String, PathBuf)],
) -> Result<(Arc<Cache>, OpenReport)> {
    let (dev, sb) = open_cache_device(cache_path)?;
    check_backing_names(&sb, overrides)?;
    let overrides = overrides.iter().cloned().collect();
    let backings = open_backings(&*dev, &sb, &overrides)?;
    let (cache, report) = Cache::open(dev, sb, backings)
        .with_context(|| format!("cannot open cache {}", cache_path.display()))?;
    Ok((Arc::new(cache), report))
}

/// Writes back every dirty line in this process, with progress; returns false when
/// interrupted (what was written back stays clean). Every dirty sector is first checked
/// against its checksum: damaged data is never written back; with `discard_damaged` it is
/// given up first, otherwise nothing is written. On an error the cache is closed cleanly
/// (still warm, its dirty data kept) before the error is returned.
fn drain_here(cache: &Cache, what: &'static str, discard_damaged: bool) -> Result<bool> {
    let stop = interrupt_flag()?;
    let total = cache.dirty_bytes();
    if total == 0 {
        return Ok(true);
    }
    let result = (|| {
        if discard_damaged {
            give_up_damaged(cache, what, &stop)?;
        }
        let mut progress = Progress::new(cache.dirty_bytes(), what);
        eprintln!("{what}: checking the dirty data against its checksums, then writing it back");
        let result = cache.drain(&CleanerConfig::default(), &mut |left| {
            progress.update(left);
            !stop.load(Ordering::Relaxed)
        });
        progress.finish();
        result.context("write-back failed")
    })();
    if let Err(e) = result {
        if let Err(close) = cache.shutdown() {
            eprintln!("{what}: could not close the cache cleanly either: {close}");
        }
        return Err(e);
    }
    Ok(cache.dirty_bytes() == 0)
}

/// `--discard-damaged`: finds the dirty data that fails its checksum or cannot be read, and
/// drops it from the cache, saying what was lost.
fn give_up_damaged(cache: &Cache, what: &str, stop: &AtomicBool) -> Result<()> {
    eprintln!("{what}: checking the dirty data against its checksums");
    cache
        .verify_dirty(&mut |_| !stop.load(Ordering::Relaxed))
        .context("checking the dirty data failed")?;
    if stop.load(Ordering::Relaxed) {
        bail!("interrupted while checking the dirty data; nothing was written back");
    }
    let dropped = cache
        .discard_damaged()
        .context("cannot drop the damaged data")?;
    let bytes: u64 = dropped.iter().map(|r| r.length).sum();
    if dropped.is_empty() {
        eprintln!("{what}: --discard-damaged: no damaged dirty data found");
    } else {
        eprintln!(
            "{what}: --discard-damaged: gave up {} of damaged dirty data (the backing device keeps \
             its older contents there):",
            human(bytes)
        );
        for r in &dropped {
            eprintln!("  {r}");
        }
    }
    Ok(())
}

fn interrupted(left: u64, again: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "interrupted with {} still dirty; what was written back stays clean: run `{again}` again to resume",
        human(left)
    )
}

pub fn flush(args: FlushArgs) -> Result<()> {
    let sb = read_sb(&args.cache)?;
    check_backing_names(&sb, &args.backing)?;
    if args.discard_damaged && ask_daemon(&sb, &args.control, "info")?.is_some() {
        bail!(
            "--discard-damaged works on a stopped cache: stop the daemon serving {} (SIGTERM), \
             then run `ssdcache flush --discard-damaged` again",
            args.cache.display()
        );
    }
    if let Some((ctl, first)) = ask_daemon(&sb, &args.control, "flush")? {
        return flush_online(&ctl, dirty_of(&first));
    }
    let (cache, _) = open_offline(&args.cache, &args.backing)?;
    let done = drain_here(&cache, "flush", args.discard_damaged)?;
    let left = cache.dirty_bytes();
    cache.shutdown().context("cannot close the cache")?;
    if !done {
        return Err(interrupted(left, "ssdcache flush"));
    }
    eprintln!("flush: done, no dirty data left (offline)");
    Ok(())
}

/// Asks the daemon's cleaner to write everything back and follows its progress.
fn flush_online(ctl: &Path, initial: u64) -> Result<()> {
    let stop = interrupt_flag()?;
    let mut progress = Progress::new(initial, "flush");
    let started = Instant::now();
    let (mut best, mut last_progress) = (u64::MAX, Instant::now());
    let offline_dirty = loop {
        let stats = control::query(ctl, "stats")?
            .ok_or_else(|| anyhow::anyhow!("the daemon went away during the flush"))?;
        let left = dirty_of(&stats);
        progress.update(left);
        if left == 0 {
            break offline_dirty(&stats);
        }
        if left < best {
            (best, last_progress) = (left, Instant::now());
        }
        let stuck = last_progress.elapsed() >= STUCK_AFTER;
        if stop.load(Ordering::Relaxed) || stuck {
            progress.finish();
            control::query(ctl, "flush-stop")?;
            if stuck {
                bail!(
                    "no progress for {} s with {} still dirty: the daemon cannot write it back \
                     (see its log for device errors)",
                    STUCK_AFTER.as_secs(),
                    human(left)
                );
            }
            return Err(interrupted(left, "ssdcache flush"));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // Record the clean state durably before reporting success.
    control::query(ctl, "commit")?;
    progress.finish();
    eprintln!(
        "flush: done in {:.1} s, no dirty data left{}",
        started.elapsed().as_secs_f64(),
        if offline_dirty.is_empty() {
            String::new()
        } else {
            format!(
                " but on offline volumes ({}: kept in the cache until a restart finds their \
                 backing devices)",
                offline_dirty.join(", ")
            )
        }
    );
    Ok(())
}

/// "NAME (SIZE dirty)" for each offline volume with dirty data.
fn offline_dirty(stats: &serde_json::Value) -> Vec<String> {
    let Some(volumes) = stats["volumes"].as_array() else {
        return Vec::new();
    };
    volumes
        .iter()
        .filter(|v| v["state"].as_str() == Some(VolumeState::Offline.name()))
        .filter_map(|v| Some((v["name"].as_str()?, v["dirty_bytes"].as_u64()?)))
        .filter(|(_, dirty)| *dirty > 0)
        .map(|(name, dirty)| format!("'{name}' {} dirty", human(dirty)))
        .collect()
}

/// `ssdcache volume remove`: writes back the volume's dirty data (with progress; Ctrl-C stops
/// it, keeping what was written back), drops every line of it, stops the cache cleanly, then
/// takes its slot out of the superblock. The other volumes stay as they were, warm; one whose
/// device is missing is left offline and untouched.
pub fn remove_volume(
    cache_path: &Path,
    name: &str,
    overrides: &[(String, PathBuf)],
    discard_damaged: bool,
) -> Result<()> {
    let sb = read_sb(cache_path)?;
    check_backing_names(&sb, overrides)?;
    let index = volume_index(&sb, "--name", Some(name))?;
    if sb.volumes.len() == 1 {
        return Err(crate::usage_error(format!(
            "'{name}' is the cache's only volume; to stop using the cache for it, run `ssdcache \
             detach --cache {}` (writes its dirty data back and leaves the disk usable alone)",
            cache_path.display()
        )));
    }
    if ask_daemon(&sb, &None, "info")?.is_some() {
        bail!(
            "a daemon started serving {} meanwhile; run `ssdcache volume remove` again (it \
             removes the volume through the daemon)",
            cache_path.display()
        );
    }
    // Locked from here on: no daemon or other command can open the cache meanwhile.
    let (dev, sb) = open_cache_device(cache_path)?;
    if sb.state == CacheState::Running {
        bail!(
            "cache {} was not stopped cleanly: start `ssdcache serve` once and stop it, so its \
             journal is replayed, then remove the volume",
            cache_path.display()
        );
    }
    // Other volumes' devices may be missing (they stay offline and untouched); one named with
    // --backing must open. The removed volume's own is checked by `empty_here`.
    let required = |name: &str| overrides.iter().any(|(n, _)| n == name);
    let backings = open_backings_allowing_offline(
        &*dev,
        &sb,
        &overrides.iter().cloned().collect(),
        &required,
        Duration::ZERO,
        &|| None,
    )?;
    let removed = sb.volumes[index].clone();
    let (cache, _) = Cache::open_volumes(dev.clone(), sb, backings)
        .with_context(|| format!("cannot open cache {}", cache_path.display()))?;
    let was_offline = cache.volumes()[index].offline_reason().is_some();
    let emptied = empty_here(&cache, index, name, discard_damaged);
    let closed = cache.shutdown();
    drop(cache);
    emptied?;
    closed?;
    // The checkpoint just written names no line of the volume: only now may its slot go.
    let mut sb = ssdcache_engine::read_superblock(&*dev)
        .with_context(|| format!("cannot read the superblock of {}", cache_path.display()))?;
    sb.volumes.retain(|v| v.id != removed.id);
    sb.sequence += 1;
    ssdcache_engine::write_superblock(&*dev, &sb)
        .with_context(|| format!("cannot write the superblock of {}", cache_path.display()))?;
    let whereabouts = if was_offline {
        format!(
            "its data is on the disk recorded at create ({}, which was not found there now)",
            removed.backing.path
        )
    } else {
        format!(
            "its backing device {} holds all of its data",
            removed.backing.path
        )
    };
    eprintln!(
        "volume remove: volume '{name}' removed from cache {}; {whereabouts}, and the cache no \
         longer uses it; {} volumes left. Remove the entries of a configuration file that name \
         '{name}' ([backing] {name} and [volume.{name}]): `serve` refuses a file naming a volume \
         the cache does not have",
        cache_path.display(),
        sb.volumes.len()
    );
    Ok(())
}

/// Writes back and drops a volume's lines (`Cache::empty_volume`), with progress.
fn empty_here(cache: &Cache, index: usize, name: &str, discard_damaged: bool) -> Result<()> {
    let stop = interrupt_flag()?;
    let vol = &cache.volumes()[index];
    if discard_damaged && vol.offline_reason().is_none() {
        eprintln!("volume remove: checking the dirty data of '{name}' against its checksums");
        let dropped = cache
            .discard_damaged_of_volume(index, &mut |_| !stop.load(Ordering::Relaxed))
            .context("checking the dirty data failed")?;
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted while checking the dirty data; nothing was written back");
        }
        for r in &dropped {
            eprintln!("volume remove: --discard-damaged: gave up {r}");
        }
    }
    let dirty = vol.stats().dirty_bytes;
    if let (Some(reason), true) = (vol.offline_reason(), dirty > 0) {
        bail!(
            "volume '{name}' holds {} of dirty data that only the cache has, and its backing \
             device cannot be used ({reason}). Bring the device back (or point to it with \
             --backing {name}=PATH) and run this again; if the disk is lost, write the data onto \
             a replacement with `ssdcache recover --cache CACHE --volume {name} --backing NEW \
             --force` first",
            human(dirty)
        );
    }
    let mut progress = Progress::new(dirty, "volume remove");
    let result = cache.empty_volume(index, &CleanerConfig::default(), &mut |left| {
        progress.update(left);
        !stop.load(Ordering::Relaxed)
    });
    progress.finish();
    if stop.load(Ordering::Relaxed) {
        let left = vol.stats().dirty_bytes;
        return Err(interrupted(left, "ssdcache volume remove"));
    }
    result.with_context(|| format!("cannot empty volume '{name}'; nothing was removed"))
}

pub fn detach(args: DetachArgs) -> Result<()> {
    let sb = read_sb(&args.cache)?;
    check_backing_names(&sb, &args.backing)?;
    if ask_daemon(&sb, &None, "info")?.is_some() {
        bail!(
            "a daemon is serving {}; stop it first (SIGTERM lets in-flight requests finish), then \
             run `ssdcache detach` again",
            args.cache.display()
        );
    }
    let (cache, _) = open_offline(&args.cache, &args.backing)?;
    if !drain_here(&cache, "detach", args.discard_damaged)? {
        let left = cache.dirty_bytes();
        cache.shutdown()?;
        return Err(interrupted(left, "ssdcache detach"));
    }
    cache
        .shutdown_discarding()
        .context("cannot mark the cache empty")?;
    for v in &sb.volumes {
        eprintln!(
            "detach: volume '{}': {} holds all of its data and can be used without ssdcache \
             (mount it directly); the cache is now empty, so serving it again starts cold",
            v.name, v.backing.path
        );
    }
    Ok(())
}

pub fn recover(args: RecoverArgs) -> Result<()> {
    let (dev, sb) = open_cache_device(&args.cache)?;
    let target = volume_index(&sb, "--volume", args.volume.as_deref())?;
    let mut backings = Vec::new();
    for (i, v) in sb.volumes.iter().enumerate() {
        if i != target {
            backings.push(open_backing(v, &Default::default(), &|| v.dirty_bytes)?);
            continue;
        }
        let (b, found) = open_backing_device(&args.backing, "backing device", true)?;
        if let Some(why) = identity::mismatch(&v.backing, &found) {
            if !args.force || b.size() < v.backing.size {
                bail!(
                    "{} is not the backing device of volume '{}' ({why}); writing its dirty data \
                     there would corrupt it. If it is a replacement holding a copy of the old \
                     device (at least {} bytes), add --force",
                    args.backing.display(),
                    v.name,
                    v.backing.size
                );
            }
            eprintln!(
                "recover: --force: writing onto {} although {why}",
                args.backing.display()
            );
        }
        backings.push(b);
    }
    let began = Instant::now();
    let (cache, report) = Cache::open(dev, sb, backings)
        .with_context(|| format!("cannot read the metadata of {}", args.cache.display()))?;
    let dirty = cache.dirty_bytes();
    let lines = cache.dirty_lines();
    if let Some(r) = &report.recovery {
        eprintln!(
            "recover: journal replayed: {} commits, {} dirty lines ({}) in {} ms",
            r.commits,
            r.dirty_lines,
            human(r.dirty_bytes),
            r.millis
        );
    }
    let done = drain_here(&cache, "recover", args.discard_damaged)?;
    if !done {
        let left = cache.dirty_bytes();
        cache.shutdown()?;
        return Err(interrupted(left, "ssdcache recover"));
    }
    cache.shutdown_discarding()?;
    println!(
        "recover: wrote {} of dirty data ({} lines) onto {} in {:.1} s; it now holds all data, \
         and the cache is empty",
        human(dirty),
        lines,
        args.backing.display(),
        began.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn set_mode(args: SetModeArgs) -> Result<()> {
    let sb = read_sb(&args.cache)?;
    let index = volume_index(&sb, "--volume", args.volume.as_deref())?;
    let name = sb.volumes[index].name.clone();
    let mode = args.mode.mode();
    let request = format!("set-mode {name} {}", mode.name());
    if let Some((ctl, first)) = ask_daemon(&sb, &args.control, &request)? {
        if first["done"].as_bool() != Some(true) {
            flush_online(&ctl, dirty_of(&first))?;
            let last = control::query(&ctl, &request)?
                .ok_or_else(|| anyhow::anyhow!("the daemon went away"))?;
            if last["done"].as_bool() != Some(true) {
                bail!("the daemon did not switch the mode: {last}");
            }
        }
        eprintln!("set-mode: volume '{name}' is now {mode}");
        return Ok(());
    }
    let (cache, _) = open_offline(&args.cache, &[])?;
    let stop = interrupt_flag()?;
    let mut progress = Progress::new(cache.dirty_bytes(), "set-mode");
    let result = cache.set_mode(index, mode, &CleanerConfig::default(), &mut |left| {
        progress.update(left);
        !stop.load(Ordering::Relaxed)
    });
    progress.finish();
    let persisted = cache.shutdown();
    result?;
    persisted?;
    eprintln!("set-mode: volume '{name}' is now {mode}");
    Ok(())
}

/// The daemon's side of `set-mode`: switches at once when no dirty data must be written back
/// first; otherwise stops new dirty data (writes go through) and starts writing back, and the
/// client asks again when the dirty data is gone.
pub fn set_mode_online(cache: &Cache, name: &str, mode: &str) -> Result<serde_json::Value> {
    let mode = match mode {
        "write-back" => CacheMode::WriteBack,
        "write-through" => CacheMode::WriteThrough,
        "write-around" => CacheMode::WriteAround,
        "pass-through" => CacheMode::PassThrough,
        other => bail!("unknown mode {other:?}"),
    };
    let index = cache
        .volumes()
        .iter()
        .position(|v| v.name() == name)
        .ok_or_else(|| anyhow::anyhow!("no volume '{name}'"))?;
    let vol = &cache.volumes()[index];
    if let Some(reason) = vol.offline_reason() {
        bail!("volume '{name}' is offline ({reason}); restart the daemon once its backing device is back, then change its mode");
    }
    let leaving_wb = vol.configured_mode() == CacheMode::WriteBack && mode != CacheMode::WriteBack;
    let dirty = vol.stats().dirty_bytes;
    if leaving_wb && dirty > 0 {
        cache.hold_writes_through(index);
        cache.request_drain(true);
        return Ok(serde_json::json!({ "done": false, "volumes": [{ "dirty_bytes": dirty }] }));
    }
    cache.set_mode(index, mode, &CleanerConfig::default(), &mut |_| true)?;
    cache.persist_config()?;
    tracing::info!("volume '{name}' is now {mode}");
    Ok(serde_json::json!({ "done": true }))
}
