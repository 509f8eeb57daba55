//! Opening cache and backing devices with the checks and messages users need.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ssdcache_device::{BlockDevice, FileDevice, OpenOptions};

pub fn open_device(path: &Path, what: &str, write: bool, lock: bool) -> Result<Arc<FileDevice>> {
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
