use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ssdcache_device::identity;
use ssdcache_device::BlockDevice;
use ssdcache_engine::admission::Admission;
use ssdcache_engine::NewVolume;

use crate::devices::{check_kind, open_device, same_device};
use crate::size::{human, parse_size};
use crate::ModeArg;

#[derive(Args)]
pub struct CreateArgs {
    /// Cache device or file (SSD, NVMe partition, file on fast storage); it is overwritten
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Backing device or file (the slow disk); read to learn its identity, never written
    #[arg(long, value_name = "PATH")]
    backing: PathBuf,
    /// Cache line size: a power of two from 4KiB to 1MiB
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_line_size)]
    line_size: u64,
    /// Caching mode of the volume
    #[arg(long, value_enum, default_value = "write-through")]
    mode: ModeArg,
    /// A sequential stream bypasses the cache once it has moved this much (0 = cache
    /// everything); keeps backups and scans from evicting the working set
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_size)]
    sequential_cutoff: u64,
    /// Replacement policy: lru, fifo, clock, arc, s3fifo (2-bit counter), s3fifo-1bit, lirs.
    /// The default, lirs, had the best mean hit ratio over the shared traces and keeps part of
    /// a loop larger than the cache (docs/policies.md)
    #[arg(long, value_name = "NAME", default_value = ssdcache_engine::policy::DEFAULT_POLICY, value_parser = parse_policy)]
    policy: u32,
    /// Which missed lines are cached: `always`, or `N-hit` (2-hit, 3-hit, ... 16-hit): a line
    /// is cached on its N-th miss, so data read or written once never costs an SSD write (the
    /// price: its first reuse misses too; docs/policies.md measures both). Changeable later in
    /// serve's config file
    #[arg(long, value_name = "always|N-hit", default_value_t = ssdcache_engine::admission::DEFAULT_ADMISSION)]
    admission: Admission,
    /// Volume name, also the NBD export name [default: the backing file's name]
    #[arg(long)]
    name: Option<String>,
    /// Overwrite an existing ssdcache cache (its cached data is dropped; backing untouched)
    #[arg(long)]
    force: bool,
}

pub fn run(args: CreateArgs) -> Result<()> {
    for (what, path) in [("cache", &args.cache), ("backing device", &args.backing)] {
        check_kind(path, what)?;
        std::fs::metadata(path)
            .with_context(|| format!("cannot open {what} {}", path.display()))?;
    }
    if same_device(&args.cache, &args.backing)? {
        return Err(crate::usage_error(format!(
            "--cache {} and --backing {} are the same file or device; the cache must be a different, faster device",
            args.cache.display(),
            args.backing.display()
        )));
    }
    let name = volume_name(args.name.as_deref(), &args.backing)?;
    // Locks make a running ssdcache that holds either device refuse us, and us it.
    let backing = open_device(&args.backing, "backing device", false, true)?;
    let cache = open_device(&args.cache, "cache", true, true)?;
    if let Ok(existing) = ssdcache_engine::read_superblock(&*cache) {
        if !args.force {
            let vols: Vec<&str> = existing.volumes.iter().map(|v| v.name.as_str()).collect();
            bail!(
                "{} already holds an ssdcache cache (volumes: {}); add --force to overwrite it \
                 (its cached data is dropped; backing devices are not touched)",
                args.cache.display(),
                vols.join(", ")
            );
        }
        let dirty: u64 = crate::serve::dirty_per_volume(&*cache, &existing)
            .iter()
            .sum();
        if dirty > 0 {
            bail!(
                "{} holds {} of dirty data (write-back) that its backing device does not have; \
                 overwriting it would lose that data. Write it back first: `ssdcache flush --cache {}` \
                 (or `ssdcache recover` if the daemon cannot start), then create again",
                args.cache.display(),
                human(dirty),
                args.cache.display()
            );
        }
    }
    let ident = identity::probe(&args.backing, backing.size())
        .with_context(|| format!("cannot identify backing device {}", args.backing.display()))?;
    let sb = ssdcache_engine::format(
        &*cache,
        args.line_size,
        NewVolume {
            name: name.clone(),
            mode: args.mode.mode(),
            backing: ident,
            sequential_cutoff: args.sequential_cutoff,
            policy: args.policy,
            admission: args.admission,
        },
    )
    .with_context(|| format!("cannot format {}", args.cache.display()))?;
    let l = sb.layout;
    println!(
        "created cache {}: {} lines of {} ({} for data, {} for metadata)",
        args.cache.display(),
        l.line_count,
        human(l.line_size),
        human(l.line_count * l.line_size),
        human(l.data_offset),
    );
    println!(
        "volume '{}' ({}, admission {}): backing {} ({}), export name '{}'",
        name,
        args.mode.mode(),
        args.admission,
        args.backing.display(),
        human(backing.size()),
        name
    );
    println!(
        "next: ssdcache serve --cache {} --socket PATH",
        args.cache.display()
    );
    Ok(())
}

fn parse_line_size(text: &str) -> Result<u64, String> {
    let size = parse_size(text)?;
    let range = ssdcache_format::MIN_LINE_SIZE..=ssdcache_format::MAX_LINE_SIZE;
    if !size.is_power_of_two() || !range.contains(&size) {
        return Err(format!(
            "{text:?} is not a power of two from 4KiB to 1MiB (4KiB, 8KiB, ... 64KiB, ... 1MiB)"
        ));
    }
    Ok(size)
}

pub(crate) fn parse_policy(name: &str) -> Result<u32, String> {
    ssdcache_engine::policy::id_of(&name.trim().to_ascii_lowercase()).ok_or_else(|| {
        format!(
            "unknown policy {name:?}; choose one of: {}",
            ssdcache_engine::policy::names().join(", ")
        )
    })
}

/// The given name, or the backing file's name with characters NBD URIs dislike replaced.
fn volume_name(given: Option<&str>, backing: &Path) -> Result<String> {
    let name = match given {
        Some(n) => n.to_owned(),
        None => backing
            .file_name()
            .map(|f| {
                f.to_string_lossy()
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect()
            })
            .unwrap_or_else(|| "volume".to_owned()),
    };
    if name.is_empty()
        || name.len() > ssdcache_format::superblock::NAME_LEN
        || name.contains(['/', '?', '#'])
    {
        return Err(crate::usage_error(format!(
            "volume name {name:?} must be 1 to 64 bytes without '/', '?' or '#'; choose one with --name"
        )));
    }
    Ok(name)
}
