//! Opening cache and backing devices with the checks and messages users need: every command
//! that opens one (serve, create, flush, detach, recover, set-mode, info, stats, hdd-emulator)
//! opens it here, so a backing device is proven to be the recorded one in one place.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ssdcache_device::{identity, BlockDevice, FileDevice, OpenOptions};
use ssdcache_engine::superblock::{read_superblock_copies, SuperblockRead};
use ssdcache_engine::VolumeBacking;
use ssdcache_format::{BackingIdentity, BackingKind, Superblock, VolumeSlot};
use ssdcache_remote::{is_nbd_uri, Endpoint, NbdDevice, NbdUri, RemoteConfig, RemoteError};

use crate::size::human;

pub fn open_device(path: &Path, what: &str, write: bool, lock: bool) -> Result<Arc<FileDevice>> {
    check_kind(path, what)?;
    let dev = FileDevice::open(
        path,
        OpenOptions {
            write,
            direct: true,
            lock,
        },
    )
    .with_context(|| format!("cannot open {what} {}", path.display()))?;
    if dev.size() % 4096 != 0 {
        bail!(
            "{what} {} is {} bytes, not a multiple of 4096; use a size in whole 4 KiB sectors \
             (for a file: truncate -s to a multiple of 4096)",
            path.display(),
            dev.size()
        );
    }
    Ok(Arc::new(dev))
}

/// Opens a cache read-write and locked (no daemon or other command may hold it) and reads its
/// superblock: for the commands that change it.
pub fn open_cache_device(path: &Path) -> Result<(Arc<FileDevice>, Superblock)> {
    let dev = open_device(path, "cache", true, true)?;
    let sb = ssdcache_engine::read_superblock(&*dev)
        .with_context(|| format!("cannot use cache {}", path.display()))?;
    Ok((dev, sb))
}

/// Opens a cache read-only, unlocked (a daemon may hold it), and reads its superblock: for
/// commands that only look. Whatever is not a cache is refused in one line that says why.
pub fn read_cache(path: &Path) -> Result<(Arc<FileDevice>, SuperblockRead)> {
    if let Ok(meta) = std::fs::metadata(path) {
        if let Some(kind) = kind_problem(&meta.file_type()) {
            return Err(crate::usage_error(format!(
                "{} is not an ssdcache cache ({kind}; a cache is a regular file or a block \
                 device)",
                path.display()
            )));
        }
    }
    let options = OpenOptions {
        write: false,
        direct: true,
        lock: false,
    };
    let dev = FileDevice::open(path, options)
        .with_context(|| format!("cannot open cache {}", path.display()))?;
    let read = read_superblock_copies(&dev)?;
    Ok((Arc::new(dev), read))
}

/// Refuses, as a usage error, a path that exists but is neither a regular file nor a block
/// device (a directory, a character device such as /dev/null, a socket): no cache or backing
/// device can live there. A path that does not exist is left to the open, which names it.
pub fn check_kind(path: &Path, what: &str) -> Result<()> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    match kind_problem(&meta.file_type()) {
        Some(kind) => Err(crate::usage_error(format!(
            "{what} {} is {kind}, not a regular file or a block device; give the path of a \
             file or of a disk or partition (/dev/sdX, /dev/nvme0n1pN)",
            path.display()
        ))),
        None => Ok(()),
    }
}

/// What a file type is, when it is one a device cannot be.
pub fn kind_problem(kind: &std::fs::FileType) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_file() || kind.is_block_device() {
        None
    } else if kind.is_dir() {
        Some("a directory")
    } else if kind.is_char_device() {
        Some("a character device")
    } else if kind.is_socket() {
        Some("a socket")
    } else if kind.is_fifo() {
        Some("a named pipe")
    } else {
        Some("not a file")
    }
}

/// The NBD URI `path` is written as (`nbd://`, `nbd+unix://`...), or `None` for a path. A
/// URI that does not parse is a usage error naming what is wrong.
pub fn nbd_uri(path: &Path) -> Result<Option<NbdUri>> {
    let uri = match path.to_str() {
        Some(text) if is_nbd_uri(text) => {
            NbdUri::parse(text).map_err(|e| crate::usage_error(e.to_string()))?
        }
        _ => return Ok(None),
    };
    if uri
        .tls_certificates
        .as_ref()
        .is_some_and(|d| d.is_relative())
    {
        return Err(crate::usage_error(format!(
            "{uri}: give the certificates folder's absolute path (tls-certificates=/etc/...): \
             the URI is recorded and used from other directories"
        )));
    }
    if let Endpoint::Unix { socket } = &uri.endpoint {
        if socket.is_relative() {
            return Err(crate::usage_error(format!(
                "{uri}: give the socket's absolute path (socket=/run/...): the URI is recorded \
                 and used from other directories"
            )));
        }
    }
    Ok(Some(uri))
}

/// Refuses to record an export the server does not describe, unless `trusted`: its name and
/// size would be all ssdcache could check, and another image exported under the same name
/// and size would be taken for it (dirty data written onto it, its clean data served stale).
pub fn refuse_undescribed_export(ident: &BackingIdentity, trusted: bool) -> Result<()> {
    if ident.kind != BackingKind::Nbd || ident.stable_id.contains('#') || trusted {
        return Ok(());
    }
    bail!(
        "the export {} has no description, so ssdcache could not tell it from another image \
         exported under the same name and size (and would write this cache's data onto that \
         one). Give the export a unique description (qemu-nbd -D ID, qemu-storage-daemon \
         --export ...,description=ID, nbdkit description=ID) and run this again, or pass \
         --trust-export-name to rely on its name and size alone",
        ident.path
    );
}

/// Where host-wide export locks live: /run/lock/ssdcache (tmpfs: they go at a reboot, when
/// no process can hold them anyway), else a folder in the temporary directory.
fn export_lock_dir() -> PathBuf {
    let run_lock = Path::new("/run/lock");
    if run_lock.is_dir() {
        run_lock.join("ssdcache")
    } else {
        std::env::temp_dir().join("ssdcache-locks")
    }
}

/// Opens a backing device, local (`open_device`, locked) or an NBD export, and reads its
/// identity: what `create` records and every start checks. A local device is opened
/// read-write only with `write`; an export must always be writable.
pub fn open_backing_device(
    path: &Path,
    what: &str,
    write: bool,
) -> Result<(Arc<dyn BlockDevice>, BackingIdentity)> {
    if let Some(uri) = nbd_uri(path)? {
        let dev = open_export(uri.canonical(), what)?;
        let ident = dev.identity();
        return Ok((Arc::new(dev), ident));
    }
    let dev = open_device(path, what, write, true)?;
    let ident = identity::probe(path, dev.size())
        .with_context(|| format!("cannot identify {what} {}", path.display()))?;
    Ok((dev, ident))
}

fn open_export(uri: NbdUri, what: &str) -> Result<NbdDevice> {
    let text = uri.to_string();
    let mut dev = NbdDevice::open(uri, RemoteConfig::default()).map_err(|e| {
        let absent = matches!(e, RemoteError::Connect { .. });
        let message = format!("cannot use {what} {text}: {}", e.reason());
        if absent {
            // Nothing listening (yet): like a disk that has not appeared, the volume can wait
            // for it (`serve --backing-wait`) while the others are served.
            anyhow::Error::new(NotThere::Absent(message))
        } else {
            anyhow::anyhow!(message)
        }
    })?;
    if dev.size() % 4096 != 0 {
        bail!(
            "{what} {text} is {} bytes, not a multiple of 4096; export a size in whole 4 KiB sectors",
            dev.size()
        );
    }
    dev.lock_on_host(&export_lock_dir())
        .with_context(|| format!("cannot use {what} {text}"))?;
    tracing::info!(
        "{what} {text}: {} over {} connection(s){}",
        human(dev.size()),
        dev.connections(),
        dev.export()
            .description
            .as_deref()
            .map_or(String::new(), |d| format!(", described as {d:?}"))
    );
    Ok(dev)
}

/// True when both paths name the same file or block device (also through links).
pub fn same_device(a: &Path, b: &Path) -> Result<bool> {
    let ma = std::fs::metadata(a).with_context(|| format!("cannot stat {}", a.display()))?;
    let mb = std::fs::metadata(b).with_context(|| format!("cannot stat {}", b.display()))?;
    let block = |m: &std::fs::Metadata| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_block_device()
    };
    Ok(if block(&ma) && block(&mb) {
        ma.rdev() == mb.rdev()
    } else {
        (ma.dev(), ma.ino()) == (mb.dev(), mb.ino())
    })
}

/// A `--backing NAME=PATH` value.
pub fn parse_backing(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_owned(), PathBuf::from(path)))
        }
        _ => Err(format!("{s:?} is not NAME=PATH")),
    }
}

/// Opens the backing device of a volume and proves it is the one recorded at create.
/// `dirty` tells the volume's dirty data in the cache, for the message when the device is
/// missing or different (asked only then: it reads the cache's metadata).
pub fn open_backing(
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
    refuse_tls_downgrade(slot, &path)?;
    let what = format!("backing device of volume '{}'", slot.name);
    let (dev, found) = open_backing_device(&path, &what, true).map_err(|e| {
        if is_absent(&e) {
            anyhow::Error::new(NotThere::Absent(format!(
                "{e:#}; if the disk moved, point to it with --backing {}=PATH.{}",
                slot.name,
                at_risk()
            )))
        } else {
            anyhow::anyhow!("{e:#}{}", at_risk())
        }
    })?;
    if let Some(why) = identity::mismatch(&slot.backing, &found) {
        let at_risk = at_risk();
        return Err(anyhow::Error::new(NotThere::Wrong(format!(
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
        ))));
    }
    Ok(dev)
}

/// Refuses `--backing NAME=nbd://...` for a volume recorded as `nbds://` (review 50): an export
/// reached over TLS is never used in plaintext, not even through an override.
fn refuse_tls_downgrade(slot: &VolumeSlot, path: &Path) -> Result<()> {
    let recorded_tls = NbdUri::parse(&slot.backing.path).is_ok_and(|u| u.tls);
    if recorded_tls && !nbd_uri(path)?.is_some_and(|u| u.tls) {
        return Err(crate::usage_error(format!(
            "volume '{}' was created with its export reached over TLS ({}); give --backing {}= \
             an nbds:// URI, or move the export back to the same TLS settings",
            slot.name, slot.backing.path, slot.name
        )));
    }
    Ok(())
}

/// Why a volume's recorded backing device cannot be used, when that takes only its volume
/// offline: nothing at the path (a disk missing after a reboot, or appearing late), or
/// another device there. Carries the message for the user.
#[derive(Debug)]
pub enum NotThere {
    Absent(String),
    Wrong(String),
}

impl std::fmt::Display for NotThere {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotThere::Absent(m) | NotThere::Wrong(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for NotThere {}

/// A stop (SIGTERM, SIGINT) asked for while waiting for absent backing devices; carries why.
#[derive(Debug)]
pub struct StoppedWaiting(pub String);

impl std::fmt::Display for StoppedWaiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} while waiting for backing devices", self.0)
    }
}

impl std::error::Error for StoppedWaiting {}

/// Whether an open failed because nothing is at the path: ENOENT, or a device node without
/// its device (ENXIO, ENODEV, ENOMEDIUM).
fn is_absent(e: &anyhow::Error) -> bool {
    if matches!(e.downcast_ref::<NotThere>(), Some(NotThere::Absent(_))) {
        return true;
    }
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| {
            io.kind() == std::io::ErrorKind::NotFound
                || matches!(
                    io.raw_os_error(),
                    Some(libc::ENXIO | libc::ENODEV | libc::ENOMEDIUM)
                )
        })
    })
}

/// Why opening a volume's backing device failed, as far as taking the volume offline goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Unavailable {
    /// No device at the path (ENOENT, ENXIO, ENODEV, ENOMEDIUM): a disk missing after a
    /// reboot, or appearing late.
    Absent,
    /// Another device at the path: never written, the volume waits for the right one.
    Wrong,
    /// Anything else (in use, mounted, locked by another process, permissions, I/O): the
    /// start is refused, as for one volume. Serving the others while, say, the disk is mounted
    /// elsewhere would invite writes behind the cache's back (review 35).
    Refused,
}

fn unavailable(e: &anyhow::Error) -> Unavailable {
    match e.downcast_ref::<NotThere>() {
        Some(NotThere::Absent(_)) => Unavailable::Absent,
        Some(NotThere::Wrong(_)) => Unavailable::Wrong,
        None => Unavailable::Refused,
    }
}

/// Opens every volume's backing device (at `overrides`' path where one is given, else the
/// recorded one) and checks each is the one recorded at create.
pub fn open_backings(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    overrides: &BTreeMap<String, PathBuf>,
) -> Result<Vec<Arc<dyn BlockDevice>>> {
    let dirty = |i: usize| dirty_per_volume(dev, sb).get(i).copied().unwrap_or(0);
    sb.volumes
        .iter()
        .enumerate()
        .map(|(i, v)| open_backing(v, overrides, &|| dirty(i)))
        .collect()
}

/// Opens every volume's backing device as [`open_backings`] does, except that a volume whose
/// recorded device is absent (a disk missing after a reboot) or is another device is offline:
/// logged as an error, its cached and dirty data kept, while the others are used
/// (docs/design.md §5.1). An absent device is waited for first, up to `wait`, retried every
/// second (disks may appear after the daemon starts), when another volume's device opened.
/// Refused outright, with the first error:
/// any other failure (in use, mounted, permissions), a device whose volume `required` names
/// (given on the command line: the user asked for that one), and every volume failing.
pub fn open_backings_allowing_offline(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    overrides: &BTreeMap<String, PathBuf>,
    required: &dyn Fn(&str) -> bool,
    wait: Duration,
    stop: &dyn Fn() -> Option<String>,
) -> Result<Vec<VolumeBacking>> {
    let dirty = std::cell::OnceCell::new();
    let dirty_of = |i: usize| {
        let all = dirty.get_or_init(|| dirty_per_volume(dev, sb));
        all.get(i).copied().unwrap_or(0)
    };
    let deadline = Instant::now() + wait;
    let mut opened: Vec<Option<Result<Arc<dyn BlockDevice>>>> =
        sb.volumes.iter().map(|_| None).collect();
    let mut waiting_said = false;
    loop {
        let mut absent = Vec::new();
        for (i, slot) in sb.volumes.iter().enumerate() {
            if matches!(opened[i], Some(Ok(_))) {
                continue;
            }
            opened[i] = match open_backing(slot, overrides, &|| dirty_of(i)) {
                Ok(d) => Some(Ok(d)),
                Err(e) if required(&slot.name) || unavailable(&e) == Unavailable::Refused => {
                    return Err(e)
                }
                Err(e) => {
                    if unavailable(&e) == Unavailable::Absent {
                        absent.push(slot.name.as_str());
                    }
                    Some(Err(e))
                }
            };
        }
        // With nothing opened there is nothing to serve: fail at once, as for one volume (a
        // service manager retries); the wait is for serving some volumes without others.
        let none_opened = !opened.iter().any(|o| matches!(o, Some(Ok(_))));
        if absent.is_empty() || none_opened || Instant::now() >= deadline {
            break;
        }
        if !waiting_said {
            tracing::warn!(
                "backing device of volume {} not found; waiting up to {} s for it to appear \
                 (--backing-wait)",
                absent
                    .iter()
                    .map(|n| format!("'{n}'"))
                    .collect::<Vec<_>>()
                    .join(", "),
                wait.as_secs()
            );
            waiting_said = true;
        }
        // In 100 ms steps: a stop asked for meanwhile ends the wait at once (review 36).
        let next = Instant::now() + Duration::from_secs(1);
        while Instant::now() < next.min(deadline) {
            if let Some(why) = stop() {
                return Err(anyhow::Error::new(StoppedWaiting(why)));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let mut backings = Vec::new();
    let mut first_error = None;
    for result in opened.into_iter().flatten() {
        match result {
            Ok(d) => backings.push(VolumeBacking::Device(d)),
            Err(e) => {
                backings.push(VolumeBacking::Offline {
                    reason: format!("{e:#}"),
                });
                first_error.get_or_insert(e);
            }
        }
    }
    let served = backings
        .iter()
        .filter(|b| matches!(b, VolumeBacking::Device(_)))
        .count();
    if let (0, Some(e)) = (served, first_error) {
        return Err(e);
    }
    for (i, (slot, b)) in sb.volumes.iter().zip(&backings).enumerate() {
        if let VolumeBacking::Offline { reason } = b {
            tracing::error!(
                "volume '{}' is OFFLINE (not served, nothing written back): {}. Its cached \
                 and dirty data ({}) stay in the cache, untouched, until a start finds its \
                 device (restart the daemon once it is back); the other volumes are used. Do \
                 not write to the disk meanwhile: the cache's copy of its data would hide \
                 those writes",
                slot.name,
                reason.trim_end_matches('.'),
                human(dirty_of(i))
            );
        }
    }
    Ok(backings)
}

/// Dirty bytes of each volume as the cache's metadata records them (journal replayed after
/// an unclean stop); zero where the metadata cannot be read (opening reports that).
pub fn dirty_per_volume(dev: &dyn BlockDevice, sb: &Superblock) -> Vec<u64> {
    match ssdcache_engine::offline_stats(dev, sb) {
        Ok(vols) => vols.iter().map(|v| v.dirty_bytes).collect(),
        Err(_) => sb.volumes.iter().map(|v| v.dirty_bytes).collect(),
    }
}
