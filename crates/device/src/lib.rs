//! Every byte ssdcache reads or writes goes through [`BlockDevice`], so tests can put memory,
//! fault-injecting or crash-simulating devices (crate `ssdcache-devsim`) where real files and
//! disks would be. This crate is the production side only: files and block devices
//! ([`FileDevice`], O_DIRECT), aligned buffers and the backing device's identity.

mod aligned;
pub mod counted;
mod file;
pub mod identity;
pub mod read_ring;
mod rng;
pub mod uring;

pub use aligned::AlignedBuf;
pub use file::{FileDevice, OpenOptions};
pub use rng::SplitMix64;

use std::io;

/// Alignment of buffers, offsets and lengths for O_DIRECT.
pub const ALIGN: usize = 4096;

/// A device addressed in bytes. Offsets and lengths passed by the engine are multiples of 4096;
/// buffers need not be aligned (implementations that need alignment bounce).
pub trait BlockDevice: Send + Sync {
    fn size(&self) -> u64;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable (fdatasync). An error made by [`unreached`] says
    /// the flush could not reach the device (a network device reconnecting) and that no write
    /// it would have covered is lost: the device keeps them, and a later flush covers them.
    /// Any other error (whatever its kind: a network filesystem's `ENOTCONN` is not this) means
    /// writes may be lost.
    fn flush(&self) -> io::Result<()>;
    /// Writes `buf` at `offset` durably on its own (a client's FUA), without flushing other
    /// writes, where the device can (an NBD export with `NBD_FLAG_SEND_FUA`): `Some(result)`.
    /// `None` (the default) where it cannot: the caller writes, then flushes.
    fn write_fua(&self, buf: &[u8], offset: u64) -> Option<io::Result<()>> {
        let _ = (buf, offset);
        None
    }
    /// `Err(why)` while the device cannot be reached (a network device reconnecting); local
    /// devices are always reachable (the default). For the volume's state in `stats`.
    fn reachable(&self) -> Result<(), String> {
        Ok(())
    }
    /// Discards a range. Returns `Ok(false)` when the device cannot discard (a hint, not an error).
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool>;
    /// Makes a range read as zeroes, cheaply where the device can.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()>;
    /// A short description for logs and errors (the path, usually).
    fn describe(&self) -> String;
    /// Reads every entry, each result into its `result`. Devices that can submit many reads
    /// at once ([`FileDevice`]: io_uring) override it; the default reads one after another.
    fn read_many(&self, reads: &mut [DeviceRead<'_>]) {
        for read in reads {
            read.result = self.read_at(read.buf, read.offset);
        }
    }
    /// The file descriptor a [`read_ring::ReadRing`] may read this device's data through,
    /// with the same bytes as [`BlockDevice::read_at`] (offsets equal). `None` (the default)
    /// where reads must go through `read_at`: memory and simulated devices, wrappers.
    fn ring_fd(&self) -> Option<std::os::unix::io::RawFd> {
        None
    }
    /// How `[offset, offset + len)` is allocated: consecutive runs from `offset`, at most
    /// `max_runs` of them (they may cover less than `len` then). A hole reads as zeroes. The
    /// default, for devices that cannot tell: all data (always a safe answer).
    fn allocation(&self, offset: u64, len: u64, max_runs: usize) -> io::Result<Vec<Run>> {
        let _ = (offset, max_runs);
        Ok(vec![Run { len, hole: false }])
    }
}

/// The error of a request that never reached its device: a network device that is
/// reconnecting. Made only by devices that can promise it ([`unreached`]): a write failing so
/// did not land anywhere, and a flush failing so lost nothing it would have covered.
#[derive(Debug)]
pub struct Unreached(pub String);

impl std::fmt::Display for Unreached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unreached {}

/// An [`Unreached`] error (kind `NotConnected`) saying `why`.
pub fn unreached(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, Unreached(why))
}

/// Whether `e` was made by [`unreached`]: the request never reached its device.
pub fn is_unreached(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Unreached>())
}

/// A run of bytes that are all allocated or all a hole ([`BlockDevice::allocation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub len: u64,
    /// A hole: nothing allocated, reads as zeroes.
    pub hole: bool,
}

/// One read of a batch ([`BlockDevice::read_many`]).
pub struct DeviceRead<'b> {
    pub offset: u64,
    pub buf: &'b mut [u8],
    /// An error until the read succeeded.
    pub result: io::Result<()>,
}

impl<'b> DeviceRead<'b> {
    pub fn new(offset: u64, buf: &'b mut [u8]) -> Self {
        DeviceRead {
            offset,
            buf,
            // Replaced by every `read_many`; a kind, not a message, so a batch of hits
            // allocates nothing per read for it.
            result: Err(io::ErrorKind::Other.into()),
        }
    }
}

/// Writes zeroes with ordinary writes, 1 MiB at a time, for devices with no cheaper way.
/// Every caller writes from one shared, never-written buffer: a request does not hold 1 MiB
/// of its own outside the server's request-memory limit.
pub fn write_zeroes_by_writing(dev: &dyn BlockDevice, offset: u64, len: u64) -> io::Result<()> {
    static ZEROES: std::sync::OnceLock<AlignedBuf> = std::sync::OnceLock::new();
    let chunk = ZEROES.get_or_init(|| AlignedBuf::zeroed(1 << 20));
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(chunk.len() as u64) as usize;
        dev.write_at(&chunk[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}
