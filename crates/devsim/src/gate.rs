//! A device wrapper that can hold a write or a read "in flight": a write waits at a gate
//! before it reaches the device, a read after it read the device (so it returns what the
//! device held when it began), until the test releases it. Lets a test run another request
//! (say a FLUSH on another connection) at exactly that moment, deterministically.

use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;

/// How long a held write waits for its release before it fails with `TimedOut`: a test that
/// forgets to release (or fails before it does) ends instead of hanging.
pub const GATE_LIMIT: Duration = Duration::from_secs(30);

/// Wraps a device; see the module documentation.
pub struct GateDevice {
    inner: Arc<dyn BlockDevice>,
    gate: Mutex<Gate>,
    changed: Condvar,
}

#[derive(Default)]
struct Gate {
    /// The next write or write_zeroes stops at the gate.
    armed: bool,
    /// The next read stops at the gate (after reading the device).
    read_armed: bool,
    /// A write is waiting at the gate.
    holding: bool,
    /// The waiting write may go on.
    released: bool,
}

impl GateDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> GateDevice {
        GateDevice {
            inner,
            gate: Mutex::new(Gate::default()),
            changed: Condvar::new(),
        }
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        // The gate is three flags, consistent after any panic.
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the next write or write_zeroes wait at the gate until [`release`](Self::release).
    pub fn hold_next_write(&self) {
        let mut gate = self.gate();
        gate.armed = true;
        gate.released = false;
    }

    /// Makes the next read wait at the gate, once it read the device, until
    /// [`release`](Self::release).
    pub fn hold_next_read(&self) {
        let mut gate = self.gate();
        gate.read_armed = true;
        gate.released = false;
    }

    /// Waits up to `timeout` for a write (or read) to arrive at the gate; true when one is waiting.
    pub fn wait_until_held(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut gate = self.gate();
        while !gate.holding {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            gate = self
                .changed
                .wait_timeout(gate, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Lets the write waiting at the gate (or the next one to arrive) go on to the device.
    pub fn release(&self) {
        self.gate().released = true;
        self.changed.notify_all();
    }

    /// Stops at the gate if it is armed for this kind of request (`read`), for at most
    /// [`GATE_LIMIT`].
    fn pass(&self, read: bool) -> io::Result<()> {
        let deadline = Instant::now() + GATE_LIMIT;
        let mut gate = self.gate();
        let armed = if read {
            &mut gate.read_armed
        } else {
            &mut gate.armed
        };
        if !*armed {
            return Ok(());
        }
        *armed = false;
        gate.holding = true;
        self.changed.notify_all();
        while !gate.released {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                gate.holding = false;
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "request held at the test gate was never released",
                ));
            }
            gate = self
                .changed
                .wait_timeout(gate, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        gate.holding = false;
        Ok(())
    }
}

impl BlockDevice for GateDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)?;
        self.pass(true)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.pass(false)?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.pass(false)?;
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    #[test]
    fn a_held_write_lands_only_after_release() -> io::Result<()> {
        let mem = Arc::new(MemDevice::new("mem", 1 << 20));
        let gate = Arc::new(GateDevice::new(mem.clone()));
        gate.hold_next_write();
        let g = gate.clone();
        let writer = std::thread::spawn(move || g.write_at(&[5; 4096], 0));
        assert!(gate.wait_until_held(Duration::from_secs(10)));
        let mut buf = [0u8; 4096];
        mem.read_at(&mut buf, 0)?;
        assert_eq!(buf, [0; 4096], "held, not yet written");
        gate.release();
        assert!(matches!(writer.join(), Ok(Ok(()))));
        mem.read_at(&mut buf, 0)?;
        assert_eq!(buf, [5; 4096]);
        // Disarmed after one write.
        gate.write_at(&[6; 4096], 0)?;
        assert!(!gate.wait_until_held(Duration::from_millis(10)));
        Ok(())
    }
}
