//! A device whose writes take time: a hard drive busy with them, for tests of what waits for
//! the backing device (the cleaner's pacing, stops during a writeback batch).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ssdcache_device::BlockDevice;

/// Wraps a device; writes that begin below a limit (every write unless one is set) sleep for a
/// fixed time first, are counted once they are done, and their offsets are kept in the order
/// they began (one `u64` each: meant for tests of a bounded number of writes). Its flush can be
/// made to fail.
pub struct SlowWriteDevice {
    inner: Arc<dyn BlockDevice>,
    delay: Duration,
    slow_below: u64,
    slow_writes: AtomicU64,
    offsets: Mutex<Vec<u64>>,
    fail_flush: AtomicBool,
}

impl SlowWriteDevice {
    pub fn new(inner: Arc<dyn BlockDevice>, delay: Duration) -> SlowWriteDevice {
        SlowWriteDevice {
            inner,
            delay,
            slow_below: u64::MAX,
            slow_writes: AtomicU64::new(0),
            offsets: Mutex::new(Vec::new()),
            fail_flush: AtomicBool::new(false),
        }
    }

    /// Only writes that begin below `offset` are slow, counted and kept.
    pub fn slow_below(mut self, offset: u64) -> SlowWriteDevice {
        self.slow_below = offset;
        self
    }

    /// Slow writes done so far.
    pub fn slow_writes(&self) -> u64 {
        self.slow_writes.load(Ordering::SeqCst)
    }

    /// Where each slow write went, in the order they began.
    pub fn slow_write_offsets(&self) -> Vec<u64> {
        self.offsets.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// Makes every flush fail (`true`) or pass to the wrapped device again.
    pub fn fail_flush(&self, on: bool) {
        self.fail_flush.store(on, Ordering::SeqCst);
    }
}

impl BlockDevice for SlowWriteDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if offset >= self.slow_below {
            return self.inner.write_at(buf, offset);
        }
        if let Ok(mut offsets) = self.offsets.lock() {
            offsets.push(offset);
        }
        std::thread::sleep(self.delay);
        let result = self.inner.write_at(buf, offset);
        self.slow_writes.fetch_add(1, Ordering::SeqCst);
        result
    }
    fn flush(&self) -> io::Result<()> {
        if self.fail_flush.load(Ordering::SeqCst) {
            return Err(io::Error::other(
                "simulated flush failure (SlowWriteDevice)",
            ));
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}
