use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ssdcache_device::BlockDevice;
use ssdcache_engine::admission::Admission;
use ssdcache_engine::superblock::{self, Copies};
use ssdcache_engine::NewVolume;
use ssdcache_format::{CacheMode, CacheState, Superblock, VolumeSlot};

use crate::devices::{
    check_kind, nbd_uri, open_backing_device, open_device, refuse_undescribed_export, same_device,
};
use crate::size::{human, parse_size};
use crate::ModeArg;

#[derive(Args)]
pub struct CreateArgs {
    /// Cache device or file (SSD, NVMe partition, file on fast storage); it is overwritten
    #[arg(long, value_name = "PATH")]
    cache: PathBuf,
    /// Backing device or file (the slow disk), or an NBD export in front of networked
    /// storage: nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH, over TLS
    /// nbds://HOST[:PORT]/EXPORT?tls-certificates=DIR (DIR holds ca-cert.pem and, for a
    /// server that checks clients, client-cert.pem and client-key.pem; add
    /// &tls-hostname=NAME when the certificate names another host). The export must be
    /// writable; its size and description are recorded as its identity. Read to learn its
    /// identity, never written
    #[arg(long, value_name = "PATH|URI")]
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
    /// Replacement policy: lirs-lean, lirs, lru, fifo, clock, arc, s3fifo (2-bit counter),
    /// s3fifo-1bit. The default, lirs-lean, is LIRS (the best mean hit ratio over the shared
    /// traces, and it keeps part of a loop larger than the cache: docs/policies.md) in 19
    /// bytes of RAM per cache line instead of lirs's 48
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
    /// Overwrite an existing ssdcache cache (its cached data is dropped; backing untouched).
    /// Never discards dirty data: a cache that holds some, or may (truncated, metadata
    /// unreadable, both superblock copies damaged), is refused
    #[arg(long)]
    force: bool,
    /// Overwrite the cache even though it holds, or may hold, dirty write-back data: writes
    /// that exist NOWHERE else, not on the backing device. They are destroyed. Implies
    /// --force. Write them back first with `ssdcache flush` (or `ssdcache recover`) unless
    /// they are lost anyway
    #[arg(long)]
    discard_dirty_data: bool,
    /// With an NBD export as --backing: accept an export the server gives no description,
    /// identified then by its name and size alone (another image exported under the same name
    /// and size would be taken for it). Better: give the export a unique description
    /// (qemu-nbd -D ID)
    #[arg(long)]
    trust_export_name: bool,
}

pub fn run(args: CreateArgs) -> Result<()> {
    let export = nbd_uri(&args.backing)?;
    for (what, path) in [("cache", &args.cache), ("backing device", &args.backing)] {
        if what == "backing device" && export.is_some() {
            continue;
        }
        check_kind(path, what)?;
        std::fs::metadata(path)
            .with_context(|| format!("cannot open {what} {}", path.display()))?;
    }
    if export.is_none() && same_device(&args.cache, &args.backing)? {
        return Err(crate::usage_error(format!(
            "--cache {} and --backing {} are the same file or device; the cache must be a different, faster device",
            args.cache.display(),
            args.backing.display()
        )));
    }
    // An export is named after the export (its URI's last path component).
    let name_source = export
        .as_ref()
        .map_or(args.backing.clone(), |u| PathBuf::from(&u.export));
    let name = volume_name(args.name.as_deref(), &name_source)?;
    // Locks make a running ssdcache that holds either device refuse us, and us it.
    let (backing, ident) = open_backing_device(&args.backing, "backing device", false)?;
    refuse_undescribed_export(&ident, args.trust_export_name)?;
    let cache = open_device(&args.cache, "cache", true, true)?;
    check_overwrite(&args, &*cache)?;
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
pub(crate) fn volume_name(given: Option<&str>, backing: &Path) -> Result<String> {
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

/// Decides, before anything is written, whether the cache device may be overwritten: a
/// device that is not a cache may; a cache needs --force; a cache that holds dirty data, or
/// may and cannot say how much, needs --discard-dirty-data.
fn check_overwrite(args: &CreateArgs, cache: &dyn BlockDevice) -> Result<()> {
    let path = args.cache.display();
    let (a, b) = match superblock::read_copies(cache)
        .with_context(|| format!("cannot read the start of {path}"))?
    {
        Copies::Valid(read) => return check_cache_overwrite(args, cache, &read.superblock),
        Copies::Invalid { a, b } => (a, b),
    };
    let traces = superblock::traces_of_cache(cache);
    if !a.has_magic() && !b.has_magic() && traces.is_empty() {
        return Ok(());
    }
    let damage = format!(
        "copy A: {a}; copy B: {b}{}",
        superblock::found_text(&traces)
    );
    if args.discard_dirty_data {
        eprintln!(
            "create: --discard-dirty-data: overwriting {path}, an ssdcache cache whose \
             superblock copies are both damaged ({damage}); any dirty data it held is lost"
        );
        return Ok(());
    }
    bail!(
        "{path} looks like an ssdcache cache whose two superblock copies are both damaged \
         ({damage}). It may hold dirty write-back data that exists nowhere else, and how much \
         cannot be known without its superblock.{} Keep the device as it is (copy it first if \
         you want to try to save the data). If the backing devices hold all data (the cache \
         was write-through or write-around, or flushed), re-create it with \
         --discard-dirty-data",
        force_is_not_enough(args)
    )
}

fn force_is_not_enough(args: &CreateArgs) -> &'static str {
    if args.force {
        " --force never discards dirty data."
    } else {
        ""
    }
}

/// A cache with a valid superblock: refused while it holds dirty data (or may), else
/// overwritten with --force.
fn check_cache_overwrite(
    args: &CreateArgs,
    cache: &dyn BlockDevice,
    sb: &Superblock,
) -> Result<()> {
    let advice = Advice::new(&args.cache, cache, sb);
    match dirty_at_stake(cache, sb) {
        DirtyData::Known(vols) if vols.iter().any(|v| v.bytes > 0) => {
            refuse_dirty(args, &advice, &vols)
        }
        DirtyData::Unknown { recorded, why } => refuse_unknown(args, &advice, &recorded, &why),
        DirtyData::Known(_) if args.force || args.discard_dirty_data => Ok(()),
        DirtyData::Known(_) => {
            let vols: Vec<&str> = sb.volumes.iter().map(|v| v.name.as_str()).collect();
            bail!(
                "{}{} already holds an ssdcache cache (volumes: {}; no dirty data); add \
                 --force to overwrite it (its cached data is dropped; backing devices are not \
                 touched)",
                advice.truncated,
                args.cache.display(),
                vols.join(", ")
            )
        }
    }
}

/// What a refusal to overwrite a cache with a valid superblock says besides the amount.
struct Advice {
    /// A note when the device is smaller than the cache its superblock records, else empty.
    truncated: String,
    /// How to keep the dirty data.
    keep: String,
}

impl Advice {
    fn new(path: &Path, cache: &dyn BlockDevice, sb: &Superblock) -> Advice {
        let path = path.display();
        let recorded = sb.layout.cache_size;
        let (truncated, restore) = if recorded > cache.size() {
            (
                format!(
                    "{path} is {} but its superblock describes a cache of {}: it was truncated \
                     or replaced (data past its end is gone). ",
                    human(cache.size()),
                    human(recorded)
                ),
                format!("restore its size (for a file: truncate -s {recorded}) so it can be opened, then "),
            )
        } else {
            (String::new(), String::new())
        };
        let keep = format!(
            "{restore}write the dirty data back with `ssdcache flush --cache {path}` (or \
             `ssdcache recover --cache {path} --backing DEVICE` if the daemon cannot start) and \
             create again"
        );
        Advice { truncated, keep }
    }
}

fn refuse_dirty(args: &CreateArgs, advice: &Advice, vols: &[VolumeDirty]) -> Result<()> {
    let total = human(vols.iter().map(|v| v.bytes).sum());
    if args.discard_dirty_data {
        eprintln!(
            "create: --discard-dirty-data: discarding {total} of dirty data ({})",
            describe_dirty(vols)
        );
        return Ok(());
    }
    bail!(
        "{}{} holds {total} of dirty data (write-back) that its backing device does not have: \
         {}. Overwriting it would lose that data.{} To keep it, {}; to throw it away, add \
         --discard-dirty-data",
        advice.truncated,
        args.cache.display(),
        describe_dirty(vols),
        force_is_not_enough(args),
        advice.keep
    )
}

fn refuse_unknown(
    args: &CreateArgs,
    advice: &Advice,
    recorded: &[VolumeDirty],
    why: &str,
) -> Result<()> {
    if args.discard_dirty_data {
        eprintln!(
            "create: --discard-dirty-data: discarding an unknown amount of dirty data (the \
             metadata cannot be read: {why})"
        );
        return Ok(());
    }
    bail!(
        "{}{} was stopped uncleanly with write-back volumes, and its metadata cannot be read \
         ({why}), so how much dirty data it holds cannot be known (at its last superblock \
         write: {}). Overwriting it could lose data that exists nowhere else.{} To keep it, \
         {}; to throw it away, add --discard-dirty-data",
        advice.truncated,
        args.cache.display(),
        describe_dirty(recorded),
        force_is_not_enough(args),
        advice.keep
    )
}

/// Dirty data of one volume of a cache about to be overwritten.
struct VolumeDirty {
    name: String,
    backing: String,
    bytes: u64,
    lines: u64,
}

enum DirtyData {
    /// From the checkpoint or the journal, or from the superblock of a clean stop (which
    /// records the totals exactly).
    Known(Vec<VolumeDirty>),
    /// A write-back cache stopped uncleanly whose journal cannot be read: only the totals of
    /// its last superblock write are known, and the journal may hold more.
    Unknown {
        recorded: Vec<VolumeDirty>,
        why: String,
    },
}

fn dirty_at_stake(cache: &dyn BlockDevice, sb: &Superblock) -> DirtyData {
    let volume = |slot: &VolumeSlot, bytes: u64, lines: u64| VolumeDirty {
        name: slot.name.clone(),
        backing: slot.backing.path.clone(),
        bytes,
        lines,
    };
    let recorded = || {
        sb.volumes
            .iter()
            .map(|slot| volume(slot, slot.dirty_bytes, slot.dirty_lines))
            .collect()
    };
    match ssdcache_engine::offline_stats(cache, sb) {
        Ok(stats) => DirtyData::Known(
            sb.volumes
                .iter()
                .zip(&stats)
                .map(|(slot, v)| volume(slot, v.dirty_bytes, v.dirty_lines))
                .collect(),
        ),
        Err(_) if sb.state == CacheState::Clean => DirtyData::Known(recorded()),
        Err(_) if !sb.volumes.iter().any(|v| v.mode == CacheMode::WriteBack) => {
            DirtyData::Known(Vec::new())
        }
        Err(e) => DirtyData::Unknown {
            recorded: recorded(),
            why: e.to_string(),
        },
    }
}

fn describe_dirty(vols: &[VolumeDirty]) -> String {
    vols.iter()
        .map(|v| {
            format!(
                "volume '{}' (backing {}) {} in {} lines",
                v.name,
                v.backing,
                human(v.bytes),
                v.lines
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
