//! The cache device with a count of the bytes written to it, for the SSD's wear: `stats`,
//! metrics and the superblock (which carries the count across restarts). Every call goes to
//! the device inside; reads and the ring's file descriptor pass through untouched.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{BlockDevice, DeviceRead};

pub struct WriteCounted {
    inner: Arc<dyn BlockDevice>,
    written: AtomicU64,
}

impl WriteCounted {
    pub fn new(inner: Arc<dyn BlockDevice>) -> WriteCounted {
        WriteCounted {
            inner,
            written: AtomicU64::new(0),
        }
    }

    /// Bytes written since this wrapper was made: writes that succeeded, and the length of
    /// every WRITE_ZEROES that did (the device may have written them or not: counted as
    /// written, so a projection of wear errs on the safe side).
    pub fn bytes_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn count(&self, bytes: u64) {
        self.written.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl BlockDevice for WriteCounted {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)?;
        self.count(buf.len() as u64);
        Ok(())
    }

    fn allocation(&self, offset: u64, len: u64, max_runs: usize) -> io::Result<Vec<crate::Run>> {
        self.inner.allocation(offset, len, max_runs)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.write_zeroes(offset, len)?;
        self.count(len);
        Ok(())
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn read_many(&self, reads: &mut [DeviceRead<'_>]) {
        self.inner.read_many(reads)
    }

    fn ring_fd(&self) -> Option<std::os::unix::io::RawFd> {
        self.inner.ring_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records which calls reached it.
    #[derive(Default)]
    struct Probe(std::sync::Mutex<Vec<&'static str>>);

    impl BlockDevice for Probe {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<()> {
            self.0.lock().unwrap().push("read_at");
            Ok(())
        }
        fn write_at(&self, _: &[u8], offset: u64) -> io::Result<()> {
            if offset == 4096 {
                return Err(io::Error::other("failed write"));
            }
            self.0.lock().unwrap().push("write_at");
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            self.0.lock().unwrap().push("flush");
            Ok(())
        }
        fn discard(&self, _: u64, _: u64) -> io::Result<bool> {
            self.0.lock().unwrap().push("discard");
            Ok(true)
        }
        fn write_zeroes(&self, _: u64, _: u64) -> io::Result<()> {
            self.0.lock().unwrap().push("write_zeroes");
            Ok(())
        }
        fn describe(&self) -> String {
            "probe".into()
        }
        fn read_many(&self, _: &mut [DeviceRead<'_>]) {
            self.0.lock().unwrap().push("read_many");
        }
        fn ring_fd(&self) -> Option<std::os::unix::io::RawFd> {
            Some(42)
        }
    }

    #[test]
    fn every_call_reaches_the_device_and_only_successful_writes_count() {
        let probe = Arc::new(Probe::default());
        let dev = WriteCounted::new(probe.clone());
        let mut buf = vec![0u8; 8192];
        dev.write_at(&buf, 0).unwrap();
        assert!(dev.write_at(&buf, 4096).is_err());
        dev.write_zeroes(0, 65536).unwrap();
        dev.read_at(&mut buf, 0).unwrap();
        dev.read_many(&mut [DeviceRead::new(0, &mut buf)]);
        dev.flush().unwrap();
        assert!(dev.discard(0, 4096).unwrap());
        assert_eq!(dev.ring_fd(), Some(42));
        assert_eq!(dev.describe(), "probe");
        assert_eq!(dev.size(), 1 << 20);
        assert_eq!(dev.bytes_written(), 8192 + 65536);
        assert_eq!(
            *probe.0.lock().unwrap(),
            [
                "write_at",
                "write_zeroes",
                "read_at",
                "read_many",
                "flush",
                "discard"
            ]
        );
    }
}
