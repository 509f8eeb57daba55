//! Regular files and block devices, opened with O_DIRECT so the page cache neither doubles
//! the cache nor hides whether data reached the device.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::aligned::{is_aligned, AlignedBuf};
use crate::{BlockDevice, DeviceRead, Run};

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;

#[derive(Debug, Clone, Copy)]
pub struct OpenOptions {
    pub write: bool,
    /// Ask for O_DIRECT; filesystems without it (tmpfs) fall back to buffered I/O with a warning.
    pub direct: bool,
    /// Take an exclusive advisory lock (flock) so a second ssdcache cannot open it too; a
    /// block device is also opened with O_EXCL, so the kernel refuses to mount it (or to let
    /// another exclusive opener, such as mkfs or an md/LVM/bcache assembly, have it) while
    /// ssdcache holds it.
    pub lock: bool,
}

pub struct FileDevice {
    file: File,
    path: PathBuf,
    size: u64,
    is_block: bool,
    direct: bool,
}

impl FileDevice {
    pub fn open(path: &Path, opts: OpenOptions) -> io::Result<FileDevice> {
        let exclusive =
            opts.lock && std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
        let open = |direct| open_file(path, opts.write, direct, exclusive);
        let (file, direct) = match open(opts.direct) {
            Err(e) if opts.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(), "O_DIRECT not supported here; using buffered I/O (durability still by fdatasync)");
                (open(false)?, false)
            }
            Err(e) if exclusive && e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!(
                        "{} is in use: mounted, or held by another program (a filesystem, md, \
                         LVM, bcache, another ssdcache); ssdcache must have it to itself (see \
                         `findmnt {}`, `lsblk {}`)",
                        path.display(),
                        path.display(),
                        path.display()
                    ),
                ));
            }
            other => (other?, opts.direct),
        };
        if opts.lock {
            lock_exclusive(&file, path)?;
        }
        let meta = file.metadata()?;
        let is_block = meta.file_type().is_block_device();
        let size = if is_block {
            block_device_size(&file)?
        } else {
            meta.len()
        };
        Ok(FileDevice {
            file,
            path: path.to_owned(),
            size,
            is_block,
            direct,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    fn ioctl_range(&self, request: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
        let range = [offset, len];
        // SAFETY: BLKDISCARD/BLKZEROOUT read a [u64; 2] from the pointer, which lives across the call.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), request as _, range.as_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// `lseek(2)` with `SEEK_DATA` or `SEEK_HOLE` from `offset`: where the next data or hole
    /// begins; `None` when there is none (ENXIO: no data after `offset`).
    fn seek(&self, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
        let from = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: plain syscall on an fd we own. It moves the file position, which nothing
        // here uses (every read and write names its offset).
        let at = unsafe { libc::lseek(self.file.as_raw_fd(), from, whence) };
        if at < 0 {
            let error = io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::ENXIO) => Ok(None),
                _ => Err(error),
            };
        }
        Ok(Some(at as u64))
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain syscall on an fd we own; offsets are checked by the kernel.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, offset as i64, len as i64) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `exclusive` (block devices only): O_EXCL, which for a block device means no mount and no
/// other exclusive opener while this file is open.
fn open_file(path: &Path, write: bool, direct: bool, exclusive: bool) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(write);
    let mut flags = 0;
    if direct {
        flags |= libc::O_DIRECT;
    }
    if exclusive {
        flags |= libc::O_EXCL;
    }
    o.custom_flags(flags);
    o.open(path)
}

fn lock_exclusive(file: &File, path: &Path) -> io::Result<()> {
    // SAFETY: flock on an fd we own.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another ssdcache process (it holds the lock); stop that one first", path.display()),
            ));
        }
        return Err(e);
    }
    Ok(())
}

fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EINVAL)
    )
}

impl BlockDevice for FileDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if !self.direct || is_aligned(buf, offset) {
            return self.file.read_exact_at(buf, offset);
        }
        let mut bounce = AlignedBuf::zeroed(buf.len());
        self.file.read_exact_at(&mut bounce, offset)?;
        buf.copy_from_slice(&bounce);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if !self.direct || is_aligned(buf, offset) {
            return self.file.write_all_at(buf, offset);
        }
        let mut bounce = AlignedBuf::zeroed(buf.len());
        bounce.copy_from_slice(buf);
        self.file.write_all_at(&bounce, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Holes from `SEEK_DATA`/`SEEK_HOLE` (files on filesystems that track them; a block
    /// device or a filesystem without them answers all data). A file system that cannot
    /// seek so (EINVAL, EOPNOTSUPP) is all data too.
    fn allocation(&self, offset: u64, len: u64, max_runs: usize) -> io::Result<Vec<Run>> {
        let end = offset.saturating_add(len).min(self.size);
        let mut runs: Vec<Run> = Vec::new();
        let mut at = offset;
        while at < end && runs.len() < max_runs.max(1) {
            let data = match self.seek(at, libc::SEEK_DATA) {
                Ok(data) => data.unwrap_or(end).min(end),
                Err(e) if is_unsupported(&e) || e.raw_os_error() == Some(libc::EINVAL) => at,
                Err(e) => return Err(e),
            };
            let (run_end, hole) = if data > at {
                (data, true)
            } else {
                let hole = match self.seek(at, libc::SEEK_HOLE) {
                    Ok(hole) => hole.unwrap_or(end),
                    Err(e) if is_unsupported(&e) || e.raw_os_error() == Some(libc::EINVAL) => end,
                    Err(e) => return Err(e),
                };
                // A hole must lie past `at` (it is data); else the file changed meanwhile:
                // call the rest data, the safe answer.
                (if hole > at { hole.min(end) } else { end }, false)
            };
            runs.push(Run {
                len: run_end - at,
                hole,
            });
            at = run_end;
        }
        Ok(runs)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        let result = if self.is_block {
            self.ioctl_range(BLKDISCARD, offset, len)
        } else {
            self.fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
        };
        match result {
            Ok(()) => Ok(true),
            Err(e) if is_unsupported(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let result = if self.is_block {
            self.ioctl_range(BLKZEROOUT, offset, len)
        } else {
            self.fallocate(
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
        };
        match result {
            Err(e) if is_unsupported(&e) => crate::write_zeroes_by_writing(self, offset, len),
            other => other,
        }
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn read_many(&self, reads: &mut [DeviceRead<'_>]) {
        crate::uring::read_batch(self.file.as_raw_fd(), reads, &|buf, offset| {
            self.read_at(buf, offset)
        });
    }

    fn ring_fd(&self) -> Option<std::os::unix::io::RawFd> {
        Some(self.file.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_round_trip_discard_and_lock() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("dev");
        std::fs::write(&path, vec![7u8; 1 << 20])?;
        let opts = OpenOptions {
            write: true,
            direct: true,
            lock: true,
        };
        let dev = FileDevice::open(&path, opts)?;
        assert_eq!(dev.size(), 1 << 20);
        let mut unaligned = vec![0u8; 4097];
        let data = vec![9u8; 8192];
        dev.write_at(&data[1..4097], 4096)?;
        dev.read_at(&mut unaligned[1..], 4096)?;
        assert!(unaligned[1..].iter().all(|&b| b == 9));
        dev.write_zeroes(0, 8192)?;
        let mut back = AlignedBuf::zeroed(8192);
        back.fill(1);
        dev.read_at(&mut back, 0)?;
        assert!(back.iter().all(|&b| b == 0));
        assert!(dev.discard(65536, 65536)?);
        dev.flush()?;
        let second = FileDevice::open(&path, opts);
        assert!(matches!(second, Err(e) if e.kind() == io::ErrorKind::WouldBlock));
        Ok(())
    }
}

#[cfg(test)]
mod allocation_tests {
    use super::*;

    #[test]
    fn a_sparse_file_reports_its_holes_and_data() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("sparse");
        let file = File::create(&path)?;
        file.set_len(4 << 20)?;
        file.write_all_at(&[1u8; 4096], 1 << 20)?;
        file.write_all_at(&[2u8; 8192], 3 << 20)?;
        drop(file);
        let opts = OpenOptions {
            write: false,
            direct: false,
            lock: false,
        };
        let dev = FileDevice::open(&path, opts)?;
        let runs = dev.allocation(0, 4 << 20, 64)?;
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), 4 << 20, "{runs:?}");
        let at = |offset: u64| {
            let mut start = 0;
            runs.iter()
                .find(|r| {
                    start += r.len;
                    offset < start
                })
                .map(|r| r.hole)
        };
        assert_eq!(at(1 << 20), Some(false), "written: data ({runs:?})");
        assert_eq!(
            at((3 << 20) + 4096),
            Some(false),
            "written: data ({runs:?})"
        );
        if at(0) == Some(true) {
            // A filesystem that tracks holes: the unwritten start is one, and so is the end.
            assert_eq!(at((4 << 20) - 1), Some(true), "{runs:?}");
        }
        let one = dev.allocation(0, 4 << 20, 1)?;
        assert_eq!(one.len(), 1, "at most max_runs");
        let tail = dev.allocation((3 << 20) + 4096, 100, 8)?;
        assert_eq!(
            tail,
            [Run {
                len: 100,
                hole: false
            }],
            "a range inside data"
        );
        Ok(())
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    /// A file whose 4 KiB block `i` is filled with byte `i`.
    fn numbered_file(dir: &Path, blocks: usize) -> io::Result<FileDevice> {
        let path = dir.join("dev");
        let data: Vec<u8> = (0..blocks).flat_map(|i| [i as u8; 4096]).collect();
        std::fs::write(&path, data)?;
        let opts = OpenOptions {
            write: false,
            direct: true,
            lock: false,
        };
        FileDevice::open(&path, opts)
    }

    /// Reads blocks (in a scrambled order, some two blocks long, one past the end) as a batch
    /// and checks every result and byte.
    fn check_batch(dev: &FileDevice) {
        let offsets: Vec<u64> = (0..150u64).map(|i| (i * 37) % 200 * 4096).collect();
        let mut bufs: Vec<Vec<u8>> = offsets
            .iter()
            .enumerate()
            .map(|(i, _)| vec![0xee; if i % 5 == 0 { 8192 } else { 4096 }])
            .collect();
        let mut past_end = vec![0u8; 4096];
        let mut reads: Vec<DeviceRead<'_>> = offsets
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&o, b)| DeviceRead::new(o, &mut b[..]))
            .collect();
        reads.push(DeviceRead::new(300 * 4096, &mut past_end));
        dev.read_many(&mut reads);
        let (last, batch) = reads.split_last().expect("non-empty");
        assert!(last.result.is_err(), "a read past the end fails");
        for read in batch {
            assert!(read.result.is_ok(), "read at {} failed", read.offset);
            let block = (read.offset / 4096) as usize;
            for (k, chunk) in read.buf.chunks(4096).enumerate() {
                assert!(chunk.iter().all(|&b| b == (block + k) as u8));
            }
        }
    }

    #[test]
    fn batched_reads_through_io_uring_and_without() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let dev = numbered_file(dir.path(), 201)?;
        let before = crate::uring::io_uring_reads();
        check_batch(&dev);
        // This test needs io_uring (the server's hits use it): fail, not skip, without it.
        assert!(
            crate::uring::io_uring_reads() > before,
            "no read went through io_uring"
        );
        crate::uring::set_io_uring_enabled(false);
        let before = crate::uring::io_uring_reads();
        check_batch(&dev);
        let after = crate::uring::io_uring_reads();
        crate::uring::set_io_uring_enabled(true);
        assert_eq!(after, before, "io_uring used while disabled");
        Ok(())
    }
}
