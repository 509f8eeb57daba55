//! A memory export with a fake read ring, for tests of the connection's ring lane: block `i`
//! holds `pattern(i)`; the ring takes READs of even blocks and ends them in `wait`, served
//! (data copied into the request's buffer) or, with [`Backend::unserving`], unserved (as a
//! hit whose checksum failed: the connection reads it again on its slow lane). `wait` blocks
//! until something ended or it is woken, as io_uring's does; with a tick it also returns
//! every 50 ms, as the real ring's reaper does (`REAP_TICK`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ssdcache_nbd::{Command, Errno, Export, Lane, RingReads, RingStart};

use super::{pattern, BLOCK};

pub const SIZE: u64 = 16 << 20;
const TICK: Duration = Duration::from_millis(50);

pub struct Backend {
    data: Vec<u8>,
    state: Mutex<State>,
    changed: Condvar,
    /// A READ of an odd block served by a worker panics while set.
    pub panic_odd: AtomicBool,
    /// Ring reads started so far.
    pub started: AtomicUsize,
    /// Ring reads end served (their data copied), else unserved.
    ends_served: bool,
    /// `wait` returns at least every 50 ms, with or without anything ended.
    ticks: bool,
    /// How long a FLUSH takes.
    flush_takes: Duration,
}

#[derive(Default)]
pub struct State {
    pub queue: Vec<(u64, u64, usize, usize)>,
    /// The ring ends nothing while shut.
    pub shut: bool,
    pub woken: bool,
    /// `wait` fails once set.
    pub fail: bool,
}

impl Backend {
    /// Ends ring reads served; `wait` blocks until something ended.
    pub fn new() -> Arc<Backend> {
        Self::with(true, false, Duration::ZERO)
    }

    /// Ends ring reads unserved; `wait` ticks every 50 ms; a FLUSH takes `flush_takes`.
    pub fn unserving(flush_takes: Duration) -> Arc<Backend> {
        Self::with(false, true, flush_takes)
    }

    fn with(ends_served: bool, ticks: bool, flush_takes: Duration) -> Arc<Backend> {
        Arc::new(Backend {
            data: (0..SIZE as usize / BLOCK)
                .flat_map(|i| pattern(i as u8, BLOCK))
                .collect(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            panic_odd: AtomicBool::new(false),
            started: AtomicUsize::new(0),
            ends_served,
            ticks,
            flush_takes,
        })
    }

    pub fn set(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap());
        self.changed.notify_all();
    }
}

impl Export for Backend {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        if self.panic_odd.load(Ordering::SeqCst) && (offset as usize / BLOCK) % 2 == 1 {
            panic!("the backend panics (test)");
        }
        buf.copy_from_slice(&self.data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        std::thread::sleep(self.flush_takes);
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
    fn lane(&self, command: Command, _: u64, _: u64) -> Lane {
        if command == Command::Read {
            Lane::Fast
        } else {
            Lane::Slow
        }
    }
    fn ring_reads(&self) -> Option<Box<dyn RingReads + '_>> {
        Some(Box::new(Ring(self)))
    }
}

struct Ring<'e>(&'e Backend);

impl RingReads for Ring<'_> {
    unsafe fn start(&self, reads: &mut [RingStart]) {
        let mut state = self.0.state.lock().unwrap();
        for read in reads
            .iter_mut()
            .filter(|r| (r.offset as usize / BLOCK).is_multiple_of(2))
        {
            state
                .queue
                .push((read.tag, read.offset, read.buf as usize, read.len));
            read.started = true;
            self.0.started.fetch_add(1, Ordering::SeqCst);
        }
        self.0.changed.notify_all();
    }
    fn wait(&self, ended: &mut Vec<(u64, bool)>) -> std::io::Result<()> {
        let state = self.0.state.lock().unwrap();
        let nothing = |s: &mut State| !s.fail && !s.woken && (s.shut || s.queue.is_empty());
        let mut state = if self.0.ticks {
            self.0
                .changed
                .wait_timeout_while(state, TICK, nothing)
                .unwrap()
                .0
        } else {
            self.0.changed.wait_while(state, nothing).unwrap()
        };
        if state.fail {
            return Err(std::io::Error::other("the test broke the ring"));
        }
        state.woken = false;
        if state.shut {
            return Ok(());
        }
        for (tag, offset, buf, len) in state.queue.drain(..) {
            if self.0.ends_served {
                let source = &self.0.data[offset as usize..offset as usize + len];
                // SAFETY: the connection keeps the buffer until this reports its tag.
                unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), buf as *mut u8, len) };
            }
            ended.push((tag, self.0.ends_served));
        }
        Ok(())
    }
    fn wake(&self) {
        self.0.set(|s| s.woken = true);
    }
}
