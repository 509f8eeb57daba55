//! `ssdcache volume add`: another backing device on an existing cache, offline. The cache's
//! lines stay one pool ranked by one policy, so whichever volume is hot gets the space; the new
//! volume is served as its own NBD export at the next `serve`. Only the superblock changes
//! (a free volume slot filled, both copies written in turn): no line record names the new
//! volume's id, since no volume was ever removed from a slot (removal is not built yet).

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
