//! A device wrapper that records every call, so tests can check the order of I/O (say, that
//! data is flushed before the metadata that points at it is written) and not only its result.

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use ssdcache_device::BlockDevice;

/// One call made on a [`RecordingDevice`], with its arguments (lengths in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Read { offset: u64, len: u64 },
    Write { offset: u64, len: u64 },
    Flush,
    Discard { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64 },
}

/// A log shared by several recorders: each call with the tag of the recorder that saw it, in
/// call order across all of them (to check, say, that a backing flush precedes a cache write).
pub type SharedOpLog = Arc<Mutex<Vec<(u32, Op)>>>;

/// Forwards every call to `inner` and records it first, in call order, whether or not it then
/// succeeds: a test cares about what was asked of the device, failed attempts included.
///
/// Generic so a test can keep the concrete inner type (to reach, say, a `CrashDevice`'s
/// switches); `D` defaults to `dyn BlockDevice` for code that only has a trait object.
pub struct RecordingDevice<D: ?Sized + BlockDevice = dyn BlockDevice> {
    inner: Arc<D>,
    log: SharedOpLog,
    tag: u32,
}

impl<D: ?Sized + BlockDevice> RecordingDevice<D> {
    pub fn new(inner: Arc<D>) -> RecordingDevice<D> {
        Self::sharing(inner, 0, SharedOpLog::default())
    }

    /// A recorder that writes into `log`, marking its calls with `tag`.
    pub fn sharing(inner: Arc<D>, tag: u32, log: SharedOpLog) -> RecordingDevice<D> {
        RecordingDevice { inner, log, tag }
    }

    /// The device this one forwards to.
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }

    /// A copy of the calls this device recorded so far, oldest first.
    pub fn ops(&self) -> Vec<Op> {
        self.log()
            .iter()
            .filter(|(tag, _)| *tag == self.tag)
            .map(|(_, op)| *op)
            .collect()
    }

    /// Forgets the calls this device recorded so far, so a test can look at one phase alone.
    pub fn clear(&self) {
        self.log().retain(|(tag, _)| *tag != self.tag);
    }

    /// The log, even after a panic on another thread while it was held: pushing a `Copy` value
    /// cannot leave it half changed, and a recorder must not turn one failed test into errors
    /// everywhere.
    fn log(&self) -> MutexGuard<'_, Vec<(u32, Op)>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, op: Op) {
        self.log().push((self.tag, op));
    }
}

impl<D: ?Sized + BlockDevice> BlockDevice for RecordingDevice<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.record(Op::Read {
            offset,
            len: buf.len() as u64,
        });
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.record(Op::Write {
            offset,
            len: buf.len() as u64,
        });
        self.inner.write_at(buf, offset)
    }

    fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> io::Result<Vec<ssdcache_device::Run>> {
        self.inner.allocation(offset, len, max_runs)
    }

    fn flush(&self) -> io::Result<()> {
        self.record(Op::Flush);
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.record(Op::Discard { offset, len });
        self.inner.discard(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.record(Op::WriteZeroes { offset, len });
        self.inner.write_zeroes(offset, len)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CrashDevice, MemDevice};

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn is_send_and_sync() {
        assert_send_sync::<RecordingDevice>();
        assert_send_sync::<RecordingDevice<CrashDevice>>();
        // A concrete device becomes the trait object where the type asks for it.
        let dev: RecordingDevice = RecordingDevice::new(Arc::new(MemDevice::new("mem", 4096)));
        assert_eq!(dev.size(), 4096);
    }

    #[test]
    fn records_every_call_in_order_and_forwards_it() -> io::Result<()> {
        let inner: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem", 1 << 20));
        let dev = RecordingDevice::new(inner);
        dev.write_at(&[5; 4096], 8192)?;
        let mut buf = [0u8; 4096];
        dev.read_at(&mut buf, 8192)?;
        assert_eq!(buf, [5; 4096]);
        dev.flush()?;
        assert!(dev.discard(0, 4096)?);
        dev.write_zeroes(8192, 4096)?;
        dev.read_at(&mut buf[..512], 8192)?;
        assert_eq!(buf[..512], [0; 512]);
        assert_eq!(dev.size(), 1 << 20);
        assert_eq!(dev.describe(), "mem");
        assert_eq!(
            dev.ops(),
            [
                Op::Write {
                    offset: 8192,
                    len: 4096
                },
                Op::Read {
                    offset: 8192,
                    len: 4096
                },
                Op::Flush,
                Op::Discard {
                    offset: 0,
                    len: 4096
                },
                Op::WriteZeroes {
                    offset: 8192,
                    len: 4096
                },
                Op::Read {
                    offset: 8192,
                    len: 512
                },
            ]
        );
        dev.clear();
        assert!(dev.ops().is_empty());
        dev.flush()?;
        assert_eq!(dev.ops(), [Op::Flush]);
        Ok(())
    }

    #[test]
    fn failed_calls_are_recorded_and_their_errors_passed_on() {
        let dev = RecordingDevice::new(Arc::new(CrashDevice::new("crash", 1 << 20)));
        dev.inner().fail_flushes(true);
        assert!(dev.flush().is_err());
        assert!(dev.write_at(&[0; 4096], 1 << 20).is_err());
        assert_eq!(
            dev.ops(),
            [
                Op::Flush,
                Op::Write {
                    offset: 1 << 20,
                    len: 4096
                }
            ]
        );
    }
}
