//! `ssdcache volume add` and `remove`, on a stopped cache. The cache's lines stay one pool
//! ranked by one policy, so whichever volume is hot gets the space; a new volume is served as
//! its own NBD export at the next `serve`. Adding changes only the superblock (a free volume
//! slot filled, both copies written in turn). A slot freed by `remove` may be filled again:
//! `remove` drops every line of its volume before the slot goes (`Cache::empty_volume`), and
//! `add` checks, before it writes anything, that the cache's metadata names no line under the
//! slot's id, so a new volume can never be served a removed one's data.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ssdcache_device::{identity, BlockDevice};
use ssdcache_engine::admission::Admission;
use ssdcache_format::superblock::MAX_VOLUMES;
use ssdcache_format::{CacheState, VolumeCounters, VolumeSlot};

use crate::devices::{check_kind, open_cache_device, open_device, same_device};
use crate::size::{human, parse_size};
use crate::ModeArg;

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Add a backing device to a stopped cache as a new volume (its own NBD export)
    Add(AddArgs),
    /// Remove a volume from a stopped cache, writing its dirty data back first
    #[command(
        long_about = "Removes a volume from a stopped cache. Its dirty data is written \
back to its backing device first, with progress (Ctrl-C stops; what was written back stays \
clean, and running it again resumes); then every line it holds in the cache is dropped and its \
slot is freed. Afterwards its backing device holds all of its data and can be used without \
ssdcache. The other volumes are untouched and stay warm.\n\n\
Refused while a daemon serves the cache (stop it first), for the cache's only volume (use \
`ssdcache detach`), after an unclean stop (start and stop `serve` once), and when the volume \
holds dirty data its backing device is missing for (bring it back, or `ssdcache recover` onto a \
replacement first). Other volumes whose devices are missing are left offline and untouched."
    )]
    Remove(RemoveArgs),
}

#[derive(Args)]
pub struct RemoveArgs {
    /// Cache device or file made by `ssdcache create` (stopped: no daemon may hold it)
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
    /// written back. Other volumes' data is not looked at
    #[arg(long)]
    discard_damaged: bool,
}

#[derive(Args)]
pub struct AddArgs {
    /// Cache device or file made by `ssdcache create` (stopped: no daemon may hold it)
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Backing device or file of the new volume; read to learn its identity, never written
    #[arg(long, value_name = "PATH")]
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
}

pub fn run(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Add(args) => add(args),
        VolumeCommand::Remove(args) => crate::writeback::remove_volume(
            &args.cache,
            &args.name,
            &args.backing,
            args.discard_damaged,
        ),
    }
}

fn add(args: AddArgs) -> Result<()> {
    check_kind(&args.backing, "backing device")?;
    if same_device(&args.cache, &args.backing)? {
        return Err(crate::usage_error(format!(
            "--cache {} and --backing {} are the same file or device",
            args.cache.display(),
            args.backing.display()
        )));
    }
    let name = crate::create::volume_name(args.name.as_deref(), &args.backing)?;
    // Locked: a daemon serving the cache, or any other ssdcache command on it, makes this fail.
    let (cache, mut sb) = open_cache_device(&args.cache)?;
    if sb.state == CacheState::Running {
        bail!(
            "cache {} was not stopped cleanly (a daemon died or the machine went down): start \
             `ssdcache serve` once and stop it, so its journal is replayed, then add the volume",
            args.cache.display()
        );
    }
    if sb.volume_by_name(&name).is_some() {
        return Err(crate::usage_error(format!(
            "cache {} already has a volume named '{name}'; choose another with --name",
            args.cache.display()
        )));
    }
    let Some(id) = (0..MAX_VOLUMES as u16).find(|id| sb.volumes.iter().all(|v| v.id != *id)) else {
        bail!(
            "cache {} has {MAX_VOLUMES} volumes, the most its format holds",
            args.cache.display()
        );
    };
    let backing = open_device(&args.backing, "backing device", false, true)?;
    let ident = identity::probe(&args.backing, backing.size())
        .with_context(|| format!("cannot identify backing device {}", args.backing.display()))?;
    if let Some(other) = sb.volumes.iter().find(|v| {
        v.backing.stable_id == ident.stable_id
            || (v.backing.st_dev, v.backing.st_ino, v.backing.st_rdev)
                == (ident.st_dev, ident.st_ino, ident.st_rdev)
    }) {
        bail!(
            "{} is already the backing device of volume '{}'; a device can back one volume only",
            args.backing.display(),
            other.name
        );
    }
    let policy = sb
        .volumes
        .first()
        .map_or(ssdcache_engine::policy::default_id(), |v| v.policy);
    sb.volumes.push(VolumeSlot {
        id,
        uuid: *uuid::Uuid::new_v4().as_bytes(),
        name: name.clone(),
        mode: args.mode.mode(),
        read_only: false,
        backing: ident,
        policy,
        admission: args.admission.to_disk(),
        sequential_cutoff: args.sequential_cutoff,
        counters: VolumeCounters::default(),
        dirty_lines: 0,
        dirty_bytes: 0,
    });
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
