//! Who a backing device is: recorded at create, checked at every start, so a cache is never
//! served in front of the wrong disk (a renamed path, a replaced file, another disk in the slot).

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use ssdcache_format::{BackingIdentity, BackingKind};

/// Reads the identity of the file or block device at `path`; `size` is the device's size.
pub fn probe(path: &Path, size: u64) -> io::Result<BackingIdentity> {
    let canonical = std::fs::canonicalize(path)?;
    let meta = std::fs::metadata(&canonical)?;
    let is_block = meta.file_type().is_block_device();
    let (kind, stable_id) = if is_block {
        (
            BackingKind::BlockDevice,
            block_stable_id(&canonical, meta.rdev()),
        )
    } else {
        (
            BackingKind::File,
            format!("file:{}:{}", meta.dev(), meta.ino()),
        )
    };
    let btime_ns = meta
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    Ok(BackingIdentity {
        kind,
        size,
        path: canonical.display().to_string(),
        stable_id,
        st_dev: meta.dev(),
        st_ino: if is_block { 0 } else { meta.ino() },
        st_rdev: meta.rdev(),
        btime_ns: if is_block { 0 } else { btime_ns },
    })
}

/// A /dev/disk/by-id name that points at the device (serial-number based, survives reboots and
/// renumbering), or its device number when udev gives none (loop devices, some VMs).
fn block_stable_id(canonical: &Path, rdev: u64) -> String {
    let mut names: Vec<String> = std::fs::read_dir("/dev/disk/by-id")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| std::fs::canonicalize(e.path()).is_ok_and(|t| t == canonical))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    // Prefer a WWN (worldwide unique), then any stable name, in a fixed order.
    names.sort_by_key(|n| (!n.starts_with("wwn-"), n.clone()));
    names.into_iter().next().unwrap_or_else(|| {
        let (maj, min) = (libc::major(rdev), libc::minor(rdev));
        format!("devnum:{maj}:{min}")
    })
}

/// Explains why `actual` is not the device recorded as `recorded`, or `None` when it is.
pub fn mismatch(recorded: &BackingIdentity, actual: &BackingIdentity) -> Option<String> {
    if recorded.kind != actual.kind {
        return Some(format!(
            "recorded a {:?}, found a {:?}",
            recorded.kind, actual.kind
        ));
    }
    if recorded.size != actual.size {
        return Some(format!(
            "size was {} bytes, is now {} bytes",
            recorded.size, actual.size
        ));
    }
    match recorded.kind {
        BackingKind::BlockDevice if recorded.stable_id != actual.stable_id => Some(format!(
            "device id was {}, is now {}",
            recorded.stable_id, actual.stable_id
        )),
        BackingKind::Nbd if recorded.stable_id != actual.stable_id => Some(format!(
            "the export was {:?}, is now {:?}",
            recorded.stable_id, actual.stable_id
        )),
        BackingKind::File
            if (recorded.st_dev, recorded.st_ino) != (actual.st_dev, actual.st_ino)
                || (recorded.btime_ns != 0
                    && actual.btime_ns != 0
                    && recorded.btime_ns != actual.btime_ns) =>
        {
            Some(format!(
                "it is a different file (recorded {} created at {} ns; found {} created at {} ns)",
                recorded.stable_id, recorded.btime_ns, actual.stable_id, actual.btime_ns
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_file_matches_and_a_replacement_does_not() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, vec![0u8; 8192])?;
        std::fs::write(&b, vec![0u8; 8192])?;
        let ia = probe(&a, 8192)?;
        assert_eq!(mismatch(&ia, &probe(&a, 8192)?), None);
        assert!(mismatch(&ia, &probe(&b, 8192)?).is_some());
        assert!(mismatch(&ia, &probe(&a, 4096)?).is_some_and(|m| m.contains("size")));
        Ok(())
    }
}
