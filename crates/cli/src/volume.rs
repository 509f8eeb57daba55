//! `ssdcache volume add` and `remove`. The cache's lines stay one pool ranked by one policy,
//! so whichever volume is hot gets the space. Adding changes only the superblock (a free
//! volume slot filled, both copies written in turn): on a stopped cache here, the new volume
//! served at the next `serve`; through the daemon serving the cache (`add_online`), the new
//! export served at once. A slot freed by `remove` (stopped cache) may be filled again:
//! `remove` drops every line of its volume before the slot goes (`Cache::empty_volume`), and
//! `add` checks, before it writes anything, that the cache's metadata (offline) or map
//! (online, `Cache::add_volume`) names no line under the slot's id, so a new volume can never
//! be served a removed one's data.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ssdcache_device::BlockDevice;
use ssdcache_engine::admission::Admission;
use ssdcache_format::superblock::MAX_VOLUMES;
use ssdcache_format::{
    BackingIdentity, BackingKind, CacheState, Superblock, VolumeCounters, VolumeSlot,
};

use crate::devices::{
    check_kind, open_backing_device, open_cache_device, refuse_undescribed_export, same_device,
};
use crate::size::{human, parse_size};
use crate::ModeArg;

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Add a backing device to a cache as a new volume (its own NBD export)
    #[command(
        long_about = "Adds a backing device to a cache as a new volume, served as its own NBD \
export named after it. The cache's lines are one pool shared by every volume, ranked by one \
policy: whichever volume is hot gets the space.\n\n\
While a daemon serves the cache, it adds the volume at once: the daemon opens and locks the \
backing device, records the volume in the superblock, and the new export is listed and served \
from then on; the other volumes' clients are not interrupted. Otherwise the stopped cache is \
changed and the volume is served at the next `ssdcache serve`.\n\n\
The backing device is read to learn its identity (kind, size, serial or inode), never written \
by the addition. Up to 32 volumes fit in one cache. Refused: a name or device another volume \
has, the cache device itself, a cache that was not stopped cleanly (offline addition only)."
    )]
    Add(AddArgs),
    /// Remove a volume from a cache, writing its dirty data back first
    #[command(
        long_about = "Removes a volume from a cache. Its dirty data is written back to its \
backing device first, with progress (Ctrl-C stops; what was written back stays clean, and \
running it again resumes); then every line it holds in the cache is dropped and its slot is \
freed. Afterwards its backing device holds all of its data and can be used without ssdcache. \
The other volumes are untouched and stay warm.\n\n\
While a daemon serves the cache, it removes the volume while the others keep serving: the \
volume's NBD export is withdrawn and its connections are closed at once (stop its clients \
first: their unflushed writes are lost like at a disconnect), its dirty data is written back \
at full speed, then it is removed and its device closed. Ctrl-C (or no progress for 2 \
minutes) withdraws the removal and serves the volume again. Otherwise the stopped cache is \
changed.\n\n\
Refused for the cache's only volume (use `ssdcache detach`), after an unclean stop (offline: \
start and stop `serve` once), and when the volume holds dirty data its backing device is \
missing for (bring it back, or `ssdcache recover` onto a replacement first). Other volumes \
whose devices are missing are left offline and untouched."
    )]
    Remove(RemoveArgs),
}

#[derive(Args)]
pub struct RemoveArgs {
    /// Cache device or file made by `ssdcache create` (served by a daemon, or stopped)
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// The volume to remove (its name, as `ssdcache info` lists it)
    #[arg(long)]
    name: String,
    /// Where a volume's backing device is now, if not at its recorded path (repeatable)
    #[arg(long, value_name = "NAME=PATH", value_parser = crate::devices::parse_backing)]
    backing: Vec<(String, PathBuf)>,
    /// Give up this volume's dirty data that fails its checksum or cannot be read from the
    /// cache (its backing device keeps its older data there) instead of refusing; the rest is
    /// written back. Other volumes' data is not looked at. Stopped cache only
    #[arg(long)]
    discard_damaged: bool,
    /// The serving daemon's control socket [default: the one of the daemon serving the cache,
    /// if any; without one the stopped cache is changed]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
}

#[derive(Args)]
pub struct AddArgs {
    /// Cache device or file made by `ssdcache create` (served by a daemon, or stopped)
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Backing device or file of the new volume, or an NBD export (nbd://HOST[:PORT]/EXPORT,
    /// nbd+unix:///EXPORT?socket=PATH, nbds://...?tls-certificates=DIR; see `ssdcache
    /// create --help`); read to learn its
    /// identity, never written by the addition
    #[arg(long, value_name = "PATH|URI")]
    backing: PathBuf,
    /// Volume name, also the NBD export name [default: the backing file's name]
    #[arg(long)]
    name: Option<String>,
    /// Caching mode of the volume
    #[arg(long, value_enum, default_value = "write-through")]
    mode: ModeArg,
    /// A sequential stream bypasses the cache once it has moved this much (0 = cache
    /// everything)
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_size)]
    sequential_cutoff: u64,
    /// Which missed lines are cached: `always`, or `N-hit` (see `ssdcache create --help`)
    #[arg(long, value_name = "always|N-hit", default_value_t = ssdcache_engine::admission::DEFAULT_ADMISSION)]
    admission: Admission,
    /// The serving daemon's control socket [default: the one of the daemon serving the cache,
    /// if any; without one the stopped cache is changed]
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// With an NBD export as --backing: accept an export the server gives no description,
    /// identified then by its name and size alone (another image exported under the same name
    /// and size would be taken for it). Better: give the export a unique description
    /// (qemu-nbd -D ID)
    #[arg(long)]
    trust_export_name: bool,
}

/// What a new volume is to be, as `add` takes it and sends it to a daemon.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct AddSpec {
    /// Absolute: the daemon's working directory is not the user's.
    backing: PathBuf,
    name: String,
    /// As `--mode` takes it (`write-back`, ...).
    mode: String,
    sequential_cutoff: u64,
    /// As `--admission` takes it (`always`, `N-hit`).
    admission: String,
    /// `--trust-export-name`.
    #[serde(default)]
    trust_export_name: bool,
}

pub fn run(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Add(args) => add(args),
        VolumeCommand::Remove(args) => remove(args),
    }
}

/// How long a removal through the daemon may go without its dirty data shrinking before it
/// is withdrawn (a failing disk, damaged data: the offline removal reports those).
const REMOVE_STALL_LIMIT: Duration = Duration::from_secs(120);

/// A removal whose client has not asked for this long (it was killed, its terminal closed) is
/// withdrawn by the daemon: the volume is served again. The client asks every 200 ms; one
/// answer takes at most about 3 s (`remove_online`'s wait for connections).
pub const REMOVAL_LEASE: Duration = Duration::from_secs(15);

fn remove(args: RemoveArgs) -> Result<()> {
    let seen = crate::devices::read_cache(&args.cache)?.1.superblock;
    let cache = std::fs::canonicalize(&args.cache)
        .with_context(|| format!("cannot resolve {}", args.cache.display()))?;
    let offline_only = !args.backing.is_empty() || args.discard_damaged;
    // Before the first request: a Ctrl-C from here on withdraws the removal.
    let stop = crate::writeback::interrupt_flag()?;
    let request = if offline_only {
        "info".to_owned()
    } else {
        remove_request("volume-remove", &args.name, &cache)?
    };
    let asked = crate::writeback::ask_daemon(&seen, &args.control, &request);
    if asked.is_err() && !offline_only {
        withdraw_after_error(&seen, &args.control, &args.name, &cache);
    }
    match asked? {
        Some(_) if offline_only => Err(crate::usage_error(format!(
            "--backing and --discard-damaged apply to a stopped cache, and a daemon serves {}; \
             leave them out to remove the volume through the daemon, or stop it first",
            args.cache.display()
        ))),
        Some((ctl, first)) => remove_through_daemon(&ctl, &args.name, &cache, first, &stop),
        None => crate::writeback::remove_volume(
            &args.cache,
            &args.name,
            &args.backing,
            args.discard_damaged,
        ),
    }
}

/// After the first removal request failed (refused, or no answer in time), asks the daemon to
/// withdraw whatever it began, so the volume is served again; best effort (the daemon also
/// withdraws a removal nobody asks about, `REMOVAL_LEASE`).
fn withdraw_after_error(sb: &Superblock, control: &Option<PathBuf>, name: &str, cache: &Path) {
    if let Ok(cancel) = remove_request("volume-remove-cancel", name, cache) {
        let _ = crate::writeback::ask_daemon(sb, control, &cancel);
    }
}

/// A removal request for volume `name` of the cache at `cache` (absolute: the daemon checks
/// it serves that very cache, `refuse_other_cache`).
fn remove_request(request: &str, name: &str, cache: &Path) -> Result<String> {
    Ok(serde_json::to_string(
        &serde_json::json!({ "request": request, "name": name, "cache": cache }),
    )?)
}

/// Refuses a request naming another cache than the daemon's: a copy of a cache image shares
/// its UUID, and so its default control socket, and `--control` may name any daemon (review
/// 39: a volume was added to the wrong cache).
pub fn refuse_other_cache(
    daemon: &crate::control::Daemon,
    request: &serde_json::Value,
) -> Result<()> {
    let Some(named) = request["cache"].as_str() else {
        bail!("the request names no cache (\"cache\": PATH)");
    };
    if !same_device(&daemon.cache_path, Path::new(named))? {
        bail!(
            "this daemon serves cache {}, not {named} (a copy of a cache image shares its \
             UUID and so its default control socket; stop using the copy, or name the daemon \
             of that cache with --control)",
            daemon.cache_path.display()
        );
    }
    Ok(())
}

/// Asks the daemon again until the removal is done, showing the dirty data left; Ctrl-C or
/// no progress for `REMOVE_STALL_LIMIT` withdraws it (the volume is served again).
fn remove_through_daemon(
    ctl: &Path,
    name: &str,
    cache: &Path,
    first: serde_json::Value,
    stop: &AtomicBool,
) -> Result<()> {
    let request = remove_request("volume-remove", name, cache)?;
    let cancel = remove_request("volume-remove-cancel", name, cache)?;
    let dirty = |a: &serde_json::Value| a["dirty_bytes"].as_u64().unwrap_or(0);
    let mut progress = crate::writeback::Progress::new(dirty(&first), "volume remove");
    let (mut answer, mut least, mut moved) = (first, u64::MAX, Instant::now());
    while answer["done"].as_bool() != Some(true) {
        let left = dirty(&answer);
        progress.update(left);
        if left < least {
            (least, moved) = (left, Instant::now());
        }
        let why = if stop.load(Ordering::Relaxed) {
            Some("interrupted".to_owned())
        } else if moved.elapsed() > REMOVE_STALL_LIMIT {
            Some(format!(
                "no progress for {} s ({}; the daemon's log says why)",
                REMOVE_STALL_LIMIT.as_secs(),
                answer["phase"].as_str().unwrap_or("writing back")
            ))
        } else {
            None
        };
        if let Some(why) = why {
            progress.finish();
            let withdrawn = crate::control::query(ctl, &cancel)?;
            if withdrawn.is_some_and(|w| w["removed"].as_bool() == Some(true)) {
                bail!("{why}, but volume '{name}' had been removed just before");
            }
            bail!(
                "{why}: volume '{name}' was not removed and is served again (what was written \
                 back stays clean; run the command again to go on). To see what holds it up, \
                 stop the daemon and remove it offline: that names damaged data \
                 (--discard-damaged) and failing devices"
            );
        }
        std::thread::sleep(Duration::from_millis(200));
        answer = match crate::control::query(ctl, &request) {
            Ok(Some(answer)) => answer,
            Ok(None) => bail!("the daemon at {} went away", ctl.display()),
            Err(e) => {
                progress.finish();
                let withdrawn = crate::control::query(ctl, &cancel);
                return Err(e.context(match withdrawn {
                    Ok(_) => format!("volume '{name}' was not removed; it is served again"),
                    Err(_) => format!("volume '{name}' was not removed"),
                }));
            }
        };
    }
    progress.finish();
    println!(
        "removed volume '{name}' through the daemon at {}: its dirty data is on its backing \
         device, its export and slot are gone, and the device is closed",
        ctl.display()
    );
    if let Some(config) = answer["config_names_it"].as_str() {
        eprintln!(
            "volume remove: NOTE: the daemon's configuration file {config} names volume \
             '{name}' ([backing] {name} or [volume.{name}]): remove those entries now; a start \
             with a file naming a volume the cache does not have is refused"
        );
    }
    Ok(())
}

/// Withdraws the removals whose client stopped asking for `REMOVAL_LEASE` (run every second
/// by the control socket's watchdog thread).
pub fn withdraw_abandoned_removals(daemon: &crate::control::Daemon) {
    let _one_at_a_time = daemon.volume_ops.lock().unwrap_or_else(|p| p.into_inner());
    let abandoned: Vec<String> = lock_removing(daemon)
        .iter()
        .filter(|(_, asked)| asked.elapsed() > REMOVAL_LEASE)
        .map(|(name, _)| name.clone())
        .collect();
    for name in abandoned {
        tracing::warn!(
            "removal of volume '{name}' withdrawn: its client stopped asking for {} s (killed, \
             or its terminal closed); serving it again",
            REMOVAL_LEASE.as_secs()
        );
        if let Err(e) = cancel_remove_online(daemon, &name) {
            tracing::warn!("withdrawing the removal of volume '{name}': {e:#}");
            lock_removing(daemon).remove(&name);
        }
    }
}

fn lock_removing(
    daemon: &crate::control::Daemon,
) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Instant>> {
    daemon.removing.lock().unwrap_or_else(|p| p.into_inner())
}

/// The daemon's side of `volume remove` (control request `volume-remove`), asked again until
/// it answers `done`. First the export is withdrawn and its connections closed (waiting a
/// little each time until they ended: then no request can reach the volume); then the
/// cleaner writes its dirty data back first and at full speed; once it has none, the cache
/// takes it out (`Cache::remove_volume`). Answers `dirty_bytes` left meanwhile.
pub fn remove_online(daemon: &crate::control::Daemon, name: &str) -> Result<serde_json::Value> {
    let cache = &daemon.cache;
    let volumes = cache.volumes();
    let Some(index) = volumes.iter().position(|v| v.name() == name) else {
        if lock_removed(daemon).iter().any(|n| n == name) {
            return Ok(serde_json::json!({ "done": true }));
        }
        bail!("the cache has no volume '{name}'");
    };
    let volume = volumes[index].clone();
    if volumes.len() == 1 {
        bail!("'{name}' is the cache's only volume; stop the daemon and use `ssdcache detach`");
    }
    let dirty = volume.stats().dirty_bytes;
    if let Some(reason) = volume.offline_reason() {
        if dirty > 0 {
            bail!(
                "volume '{name}' is offline ({reason}) and holds {} of dirty data; bring its \
                 device back (restart the daemon) or `ssdcache recover` it onto a replacement",
                human(dirty)
            );
        }
    }
    let phase = |phase: &str, dirty: u64| serde_json::json!({ "done": false, "phase": phase, "dirty_bytes": dirty });
    lock_removing(daemon).insert(name.to_owned(), Instant::now());
    if !daemon.server.remove_export(name, Duration::from_secs(3)) {
        return Ok(phase("closing its connections", dirty));
    }
    // No request reaches the volume from here on.
    cache.request_volume_drain(volume.id(), true);
    let dirty = volume.stats().dirty_bytes;
    if dirty > 0 {
        return Ok(phase("writing back", dirty));
    }
    cache.request_volume_drain(volume.id(), false);
    cache.remove_volume(index)?;
    lock_removing(daemon).remove(name);
    lock_removed(daemon).push(name.to_owned());
    tracing::info!("volume '{name}' removed while serving; its backing device is closed");
    let mut done = serde_json::json!({ "done": true });
    if let Some(config) = daemon.config_naming.get(name) {
        tracing::warn!(
            "the configuration file {} names the removed volume '{name}': remove those entries, \
             or the next start is refused",
            config.display()
        );
        done["config_names_it"] = serde_json::json!(config.display().to_string());
    }
    Ok(done)
}

/// Withdraws a removal that was not finished: the cleaner stops favouring the volume and its
/// export is served again.
pub fn cancel_remove_online(
    daemon: &crate::control::Daemon,
    name: &str,
) -> Result<serde_json::Value> {
    let volumes = daemon.cache.volumes();
    let Some(volume) = volumes.iter().find(|v| v.name() == name) else {
        if lock_removed(daemon).iter().any(|n| n == name) {
            return Ok(serde_json::json!({ "removed": true }));
        }
        bail!("the cache has no volume '{name}'");
    };
    daemon.cache.request_volume_drain(volume.id(), false);
    lock_removing(daemon).remove(name);
    if volume.offline_reason().is_none() {
        let export =
            crate::serve::volume_export(volume, daemon.read_only, daemon.recorder.as_deref());
        // Refused only as a duplicate: the removal had not withdrawn it yet.
        if daemon.server.add_export(export).is_ok() {
            tracing::info!("removal of volume '{name}' withdrawn; serving it again");
        }
    }
    Ok(serde_json::json!({ "ok": true }))
}

fn lock_removed(daemon: &crate::control::Daemon) -> std::sync::MutexGuard<'_, Vec<String>> {
    daemon.removed.lock().unwrap_or_else(|p| p.into_inner())
}

fn add(args: AddArgs) -> Result<()> {
    let export = crate::devices::nbd_uri(&args.backing)?;
    if export.is_none() {
        check_kind(&args.backing, "backing device")?;
        if same_device(&args.cache, &args.backing)? {
            return Err(crate::usage_error(format!(
                "--cache {} and --backing {} are the same file or device",
                args.cache.display(),
                args.backing.display()
            )));
        }
    }
    // An export is named after the export (its URI's last path component).
    let name_source = export
        .as_ref()
        .map_or(args.backing.clone(), |u| PathBuf::from(&u.export));
    let name = crate::create::volume_name(args.name.as_deref(), &name_source)?;
    let seen = crate::devices::read_cache(&args.cache)?.1.superblock;
    refuse_taken_name(&seen, &name, &args.cache)?;
    let backing_path = match export {
        Some(_) => args.backing.clone(),
        None => std::fs::canonicalize(&args.backing)
            .with_context(|| format!("cannot resolve {}", args.backing.display()))?,
    };
    let spec = AddSpec {
        backing: backing_path,
        name: name.clone(),
        mode: args.mode.mode().name().to_owned(),
        sequential_cutoff: args.sequential_cutoff,
        admission: args.admission.to_string(),
        trust_export_name: args.trust_export_name,
    };
    let request = serde_json::to_string(&serde_json::json!({
        "request": "volume-add",
        "spec": spec,
        "cache": std::fs::canonicalize(&args.cache)
            .with_context(|| format!("cannot resolve {}", args.cache.display()))?,
    }))?;
    if let Some((ctl, answer)) = crate::writeback::ask_daemon(&seen, &args.control, &request)? {
        println!(
            "added volume '{name}' ({}, admission {}) to cache {} through the daemon at {}: \
             backing {} ({}), served now as NBD export '{name}'; {} volumes now",
            args.mode.mode(),
            args.admission,
            args.cache.display(),
            ctl.display(),
            spec.backing.display(),
            human(answer["size"].as_u64().unwrap_or(0)),
            answer["volumes"].as_u64().unwrap_or(0)
        );
        return Ok(());
    }
    // Locked: a daemon serving the cache, or any other ssdcache command on it, makes this fail.
    let (cache, mut sb) = open_cache_device(&args.cache)?;
    if sb.state == CacheState::Running {
        bail!(
            "cache {} was not stopped cleanly (a daemon died or the machine went down): start \
             `ssdcache serve` once and stop it, so its journal is replayed, then add the volume",
            args.cache.display()
        );
    }
    refuse_taken_name(&sb, &name, &args.cache)?;
    let (backing, ident) = open_backing_device(&args.backing, "backing device", false)?;
    refuse_undescribed_export(&ident, args.trust_export_name)?;
    let slot = new_slot(&sb, &spec, ident, &args.cache, 0)?;
    let id = slot.id;
    sb.volumes.push(slot);
    sb.volumes.sort_by_key(|v| v.id);
    refuse_stale_lines(&*cache, &sb, id)?;
    sb.sequence += 1;
    ssdcache_engine::write_superblock(&*cache, &sb)
        .with_context(|| format!("cannot write the superblock of {}", args.cache.display()))?;
    println!(
        "added volume '{name}' ({}, admission {}) to cache {}: backing {} ({}), export name \
         '{name}'; {} volumes now",
        args.mode.mode(),
        args.admission,
        args.cache.display(),
        args.backing.display(),
        human(backing.size()),
        sb.volumes.len()
    );
    println!("next: ssdcache serve --cache {}", args.cache.display());
    Ok(())
}

/// Refuses a name a volume of the cache has (a usage error: the user chooses names).
fn refuse_taken_name(sb: &Superblock, name: &str, cache: &Path) -> Result<()> {
    if sb.volume_by_name(name).is_some() {
        return Err(crate::usage_error(format!(
            "cache {} already has a volume named '{name}'; choose another with --name",
            cache.display()
        )));
    }
    Ok(())
}

/// Refuses `path` when it is the device or file of a volume of `sb` (same inode, or same
/// block device number), from its metadata alone.
fn refuse_device_of_another_volume(sb: &Superblock, path: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot look at {}", path.display()))?;
    let same = |v: &&VolumeSlot| {
        (meta.rdev() != 0 && meta.rdev() == v.backing.st_rdev)
            || (meta.dev(), meta.ino()) == (v.backing.st_dev, v.backing.st_ino)
    };
    if let Some(other) = sb.volumes.iter().find(same) {
        bail!(
            "{} is already the backing device of volume '{}'; a device can back one volume only",
            path.display(),
            other.name
        );
    }
    Ok(())
}

/// The slot of a new volume of `sb`: the lowest free id, the cache's policy, the backing
/// device's identity `ident` (opened at `spec.backing`), refusing a device another volume has.
fn new_slot(
    sb: &Superblock,
    spec: &AddSpec,
    ident: BackingIdentity,
    cache: &Path,
    retired: u32,
) -> Result<VolumeSlot> {
    let free = |id: &u16| retired & (1 << id) == 0 && sb.volumes.iter().all(|v| v.id != *id);
    let Some(id) = (0..MAX_VOLUMES as u16).find(free) else {
        if retired != 0 {
            bail!(
                "cache {} has no free volume slot: {} of its {MAX_VOLUMES} slots were freed by \
                 removals while this daemon runs, and are free again after a restart",
                cache.display(),
                retired.count_ones()
            );
        }
        bail!(
            "cache {} has {MAX_VOLUMES} volumes, the most its format holds",
            cache.display()
        );
    };
    let mode = <ModeArg as clap::ValueEnum>::from_str(&spec.mode, false)
        .map_err(|e| anyhow::anyhow!("mode {:?}: {e}", spec.mode))?
        .mode();
    let admission: Admission = spec
        .admission
        .parse()
        .map_err(|e| anyhow::anyhow!("admission {:?}: {e}", spec.admission))?;
    if let Some(other) = sb.volumes.iter().find(|v| same_backing(&v.backing, &ident)) {
        bail!(
            "{} is already the backing device of volume '{}'; a device can back one volume only",
            spec.backing.display(),
            other.name
        );
    }
    let policy = sb
        .volumes
        .first()
        .map_or(ssdcache_engine::policy::default_id(), |v| v.policy);
    Ok(VolumeSlot {
        id,
        uuid: *uuid::Uuid::new_v4().as_bytes(),
        name: spec.name.clone(),
        mode,
        read_only: false,
        backing: ident,
        policy,
        admission: admission.to_disk(),
        sequential_cutoff: spec.sequential_cutoff,
        counters: VolumeCounters::default(),
        dirty_lines: 0,
        dirty_bytes: 0,
    })
}

/// The daemon's side of `volume add` (control request `volume-add`): opens and locks the
/// backing device, records the volume (`Cache::add_volume`, which writes the superblock
/// before the volume takes a request), then exports it. Returns the new volume's figures.
pub fn add_online(
    daemon: &crate::control::Daemon,
    request: &serde_json::Value,
) -> Result<serde_json::Value> {
    let spec: AddSpec =
        serde_json::from_value(request["spec"].clone()).context("bad volume-add request")?;
    let export = crate::devices::nbd_uri(&spec.backing)?;
    if export.is_none() {
        if !spec.backing.is_absolute() {
            bail!(
                "backing path {} is not absolute (the daemon's working directory is not yours)",
                spec.backing.display()
            );
        }
        check_kind(&spec.backing, "backing device")?;
        if same_device(&daemon.cache_path, &spec.backing)? {
            bail!("{} is the cache device itself", spec.backing.display());
        }
    }
    let cache = &daemon.cache;
    let sb = cache.superblock();
    refuse_taken_name(&sb, &spec.name, &daemon.cache_path)?;
    if export.is_none() {
        // Before opening: the daemon holds its volumes' devices locked, so opening one of
        // them again would fail with a message about a lock instead of saying which volume
        // has it. (An export is compared by identity in `new_slot`.)
        refuse_device_of_another_volume(&sb, &spec.backing)?;
    }
    // Written through the cache from now on, and locked like every backing device it serves.
    let (backing, ident) = open_backing_device(&spec.backing, "backing device", true)?;
    refuse_undescribed_export(&ident, spec.trust_export_name)?;
    let slot = new_slot(
        &sb,
        &spec,
        ident,
        &daemon.cache_path,
        cache.retired_volume_ids(),
    )?;
    let backing = crate::serve::with_hdd_model(backing, daemon.emulate_hdd);
    let volume = cache.add_volume(slot, backing)?;
    let export = crate::serve::volume_export(&volume, daemon.read_only, daemon.recorder.as_deref());
    daemon.server.add_export(export).with_context(|| {
        format!(
            "volume '{}' was added to the cache but cannot be exported; restart the daemon \
             to serve it",
            spec.name
        )
    })?;
    tracing::info!(
        "volume '{}' added while serving ({}, {}, backing {}): serving it as NBD export '{}'",
        volume.name(),
        volume.mode(),
        human(volume.size()),
        spec.backing.display(),
        volume.name()
    );
    Ok(serde_json::json!({
        "ok": true,
        "name": volume.name(),
        "size": volume.size(),
        "volumes": cache.volumes().len(),
    }))
}

/// Whether two identities name one device. Local devices: the stable id, or the device and
/// inode numbers. NBD exports (which have no such numbers): the URI, or a stable id that
/// carries the server's description (a bare export name is shared by many servers).
fn same_backing(a: &BackingIdentity, b: &BackingIdentity) -> bool {
    match (a.kind, b.kind) {
        (BackingKind::Nbd, BackingKind::Nbd) => {
            // In one spelling: a cache recorded before URIs were (review 49), and whatever
            // its TLS settings (review 50).
            let canonical = |path: &str| {
                ssdcache_remote::NbdUri::parse(path)
                    .map_or_else(|_| path.to_owned(), |u| u.address())
            };
            canonical(&a.path) == canonical(&b.path)
                || (a.stable_id == b.stable_id && a.stable_id.contains('#'))
        }
        (BackingKind::Nbd, _) | (_, BackingKind::Nbd) => false,
        _ => {
            a.stable_id == b.stable_id
                || (a.st_dev, a.st_ino, a.st_rdev) == (b.st_dev, b.st_ino, b.st_rdev)
        }
    }
}

/// Refuses a slot id that a line record of the cache's metadata still names (left by a removed
/// volume whose lines were not all dropped): the new volume would be served its data.
fn refuse_stale_lines(
    cache: &dyn BlockDevice,
    sb: &ssdcache_format::Superblock,
    id: u16,
) -> Result<()> {
    let stats = ssdcache_engine::offline_stats(cache, sb)
        .context("cannot read the cache's metadata to check the new volume's slot")?;
    let held = sb
        .volumes
        .iter()
        .zip(&stats)
        .find(|(v, _)| v.id == id)
        .map_or(0, |(_, s)| s.lines_used);
    if held > 0 {
        bail!(
            "the cache's metadata still names {held} lines under volume slot {id} (left by a \
             removed volume); nothing was changed. Start and stop `ssdcache serve` once, or \
             report this with the output of `ssdcache info`"
        );
    }
    Ok(())
}
