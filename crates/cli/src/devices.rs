//! Opening cache and backing devices with the checks and messages users need.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ssdcache_device::{BlockDevice, FileDevice, OpenOptions};
use ssdcache_engine::superblock::{read_superblock_copies, SuperblockRead};

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
