//! A device in RAM, for tests and the simulator, with switches that make it fail.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use ssdcache_device::BlockDevice;

pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    name: String,
    pub fail_reads: AtomicBool,
    pub fail_writes: AtomicBool,
}

impl MemDevice {
    pub fn new(name: &str, size: u64) -> MemDevice {
        MemDevice {
            data: RwLock::new(vec![0; size as usize]),
            name: name.to_owned(),
            fail_reads: AtomicBool::new(false),
            fail_writes: AtomicBool::new(false),
        }
    }

    /// A copy of the whole contents, for comparisons in tests.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().map(|d| d.clone()).unwrap_or_default()
    }

    fn range(&self, offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
        let size = self.size();
        match offset.checked_add(len as u64) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{}: access past the end", self.name),
            )),
        }
    }

    fn injected(&self, flag: &AtomicBool) -> io::Result<()> {
        if flag.load(Ordering::Relaxed) {
            return Err(io::Error::other(format!(
                "{}: injected I/O error",
                self.name
            )));
        }
        Ok(())
    }
}

fn poisoned() -> io::Error {
    io::Error::other("memory device lock poisoned")
}

impl BlockDevice for MemDevice {
    fn size(&self) -> u64 {
        self.data.read().map(|d| d.len() as u64).unwrap_or(0)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.injected(&self.fail_reads)?;
        let r = self.range(offset, buf.len())?;
        buf.copy_from_slice(&self.data.read().map_err(|_| poisoned())?[r]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.injected(&self.fail_writes)?;
        let r = self.range(offset, buf.len())?;
        self.data.write().map_err(|_| poisoned())?[r].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.injected(&self.fail_writes)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.write_zeroes(offset, len)?;
        Ok(true)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.injected(&self.fail_writes)?;
        let r = self.range(offset, len as usize)?;
        self.data.write().map_err(|_| poisoned())?[r].fill(0);
        Ok(())
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}
