//! A `BlockDevice` wrapper that adds up the time spent in each kind of call, so a request's
//! time can be split into device time and the engine's own work.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ssdcache_device::BlockDevice;

#[derive(Default)]
struct Tally {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl Tally {
    fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        out
    }

    fn read(&self) -> (u64, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            self.nanos.load(Ordering::Relaxed),
        )
    }
}

pub struct TimedDevice {
    inner: Arc<dyn BlockDevice>,
    reads: Tally,
    writes: Tally,
    flushes: Tally,
}

/// Calls and nanoseconds per kind of call, at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceTimes {
    pub reads: u64,
    pub read_ns: u64,
    pub writes: u64,
    pub write_ns: u64,
    pub flushes: u64,
    pub flush_ns: u64,
}

impl DeviceTimes {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &DeviceTimes) -> DeviceTimes {
        DeviceTimes {
            reads: self.reads - before.reads,
            read_ns: self.read_ns - before.read_ns,
            writes: self.writes - before.writes,
            write_ns: self.write_ns - before.write_ns,
            flushes: self.flushes - before.flushes,
            flush_ns: self.flush_ns - before.flush_ns,
        }
    }

    pub fn total_ns(&self) -> u64 {
        self.read_ns + self.write_ns + self.flush_ns
    }
}

impl TimedDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> TimedDevice {
        TimedDevice {
            inner,
            reads: Tally::default(),
            writes: Tally::default(),
            flushes: Tally::default(),
        }
    }

    pub fn times(&self) -> DeviceTimes {
        let (reads, read_ns) = self.reads.read();
        let (writes, write_ns) = self.writes.read();
        let (flushes, flush_ns) = self.flushes.read();
        DeviceTimes {
            reads,
            read_ns,
            writes,
            write_ns,
            flushes,
            flush_ns,
        }
    }
}

impl BlockDevice for TimedDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.reads.time(|| self.inner.read_at(buf, offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.writes.time(|| self.inner.write_at(buf, offset))
    }

    fn flush(&self) -> io::Result<()> {
        self.flushes.time(|| self.inner.flush())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.writes.time(|| self.inner.write_zeroes(offset, len))
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
