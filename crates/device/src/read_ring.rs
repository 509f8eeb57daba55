//! Reads that complete on another thread: a ring that many threads submit to and one thread
//! reaps (docs/design.md §6.1, "Hits without waiting"). The NBD server keeps one per
//! connection: the thread that reads requests submits each hit's cache-device read and goes
//! back to reading; the connection's completion thread answers each hit as its read ends.
//!
//! The kernel reads straight into the caller's buffer (no staging copy). That is why the
//! submitting functions are `unsafe`: the buffer must stay alive and untouched until its
//! completion has been reaped. If the ring fails while reads are in flight, [`ReadRing::reap`]
//! says so ([`RingBroken`]) and the caller must never free or reuse those buffers (it leaks
//! them); the ring itself is leaked on drop then too, so the kernel never loses its queues.

use std::io;
use std::mem::ManuallyDrop;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use io_uring::{opcode, types, IoUring};

use crate::ALIGN;

/// User data of the entry that only wakes the reaping thread.
const WAKE: u64 = u64::MAX;

/// The longest [`ReadRing::reap`] waits before it returns, having submitted anything
/// queued meanwhile; a caller waiting for reads calls it again.
pub const REAP_TICK: std::time::Duration = std::time::Duration::from_millis(50);

/// Submission queue entries, and the reads a caller may keep in flight at most: the
/// completion queue holds twice as many, so completions never overflow it.
pub const ENTRIES: u32 = 128;

/// The ring failed while reads were in flight: their buffers may still be written by the
/// kernel and must never be freed or reused.
#[derive(Debug, thiserror::Error)]
#[error("io_uring read ring failed with reads in flight: {0}")]
pub struct RingBroken(#[source] pub io::Error);

/// One read to submit: `len` bytes at `offset` of `fd` into `buf`, reported with `tag`.
#[derive(Debug, Clone, Copy)]
pub struct RingRead {
    pub fd: RawFd,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: u32,
    pub tag: u64,
}

impl RingRead {
    /// Whether the read may go to the ring: O_DIRECT needs an aligned buffer, length and
    /// offset; the tag must not be the wake-up's.
    pub fn is_aligned(&self) -> bool {
        (self.buf as usize).is_multiple_of(ALIGN)
            && (self.len as usize).is_multiple_of(ALIGN)
            && self.offset.is_multiple_of(ALIGN as u64)
            && self.tag != WAKE
    }
}

pub struct ReadRing {
    /// Dropped only while not broken (see `Drop`).
    ring: ManuallyDrop<IoUring>,
    /// Held while writing submission entries: many threads submit.
    submitting: Mutex<()>,
    /// Held by the one thread that reaps (the completion queue has one reader).
    reaping: Mutex<()>,
    broken: AtomicBool,
}

impl ReadRing {
    /// A new ring; `None` where io_uring is unavailable or turned off (then callers read
    /// the usual way).
    pub fn new() -> Option<ReadRing> {
        if !crate::uring::io_uring_available() {
            return None;
        }
        let ring = IoUring::builder()
            .setup_cqsize(ENTRIES * 2)
            .build(ENTRIES)
            .ok()?;
        // `reap` waits with a timeout (Linux 5.11 and later).
        if !ring.params().is_feature_ext_arg() {
            return None;
        }
        Some(ReadRing {
            ring: ManuallyDrop::new(ring),
            submitting: Mutex::new(()),
            reaping: Mutex::new(()),
            broken: AtomicBool::new(false),
        })
    }

    /// Queues and submits `reads` with as few system calls as the queue allows. Returns how
    /// many were submitted, in order; the rest were not (the caller reads them another way).
    ///
    /// # Safety
    /// Each submitted read's buffer must stay valid and unused by anything else until
    /// [`ReadRing::reap`] returned its tag, or forever if `reap` returned [`RingBroken`].
    pub unsafe fn submit(&self, reads: &[RingRead]) -> usize {
        if self.broken.load(Ordering::SeqCst) {
            return 0;
        }
        let _submitting = self
            .submitting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut submitted = 0;
        while submitted < reads.len() {
            // SAFETY: only threads holding `submitting` touch the submission queue.
            let mut queue = unsafe { self.ring.submission_shared() };
            let before = submitted;
            for read in &reads[submitted..] {
                if !read.is_aligned() {
                    break;
                }
                let entry = opcode::Read::new(types::Fd(read.fd), read.buf, read.len)
                    .offset(read.offset)
                    .build()
                    .user_data(read.tag);
                // SAFETY: the buffer stays valid until its completion (the caller's promise).
                if unsafe { queue.push(&entry) }.is_err() {
                    break;
                }
                submitted += 1;
            }
            drop(queue);
            if submitted == before {
                return submitted;
            }
            if let Err(error) = self.enter_submit() {
                // What was queued may or may not be in the kernel's hands: the reaper finds
                // out. Nothing more is queued.
                tracing::error!(%error, "io_uring submission failed");
                return submitted;
            }
        }
        submitted
    }

    /// Submits what is queued. On EAGAIN or EBUSY (the kernel short of resources) the
    /// entries stay queued and the reaper's next enter, at most [`REAP_TICK`] away, submits
    /// them (review 31 F5: a reaper asleep with nothing in flight never did).
    fn enter_submit(&self) -> io::Result<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                    return Ok(())
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Wakes the thread in [`ReadRing::reap`] (it returns with nothing or with what completed).
    pub fn wake(&self) {
        let _submitting = self
            .submitting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // SAFETY: only threads holding `submitting` touch the submission queue.
        let mut queue = unsafe { self.ring.submission_shared() };
        let entry = opcode::Nop::new().build().user_data(WAKE);
        // SAFETY: a no-op refers to no memory.
        let pushed = unsafe { queue.push(&entry) }.is_ok();
        drop(queue);
        if pushed {
            let _ = self.enter_submit();
        }
    }

    /// Waits for at least one completion (or a wake-up), at most [`REAP_TICK`], and appends
    /// each completed read as (tag, bytes read or -errno). Only one thread reaps at a time.
    pub fn reap(&self, done: &mut Vec<(u64, i32)>) -> Result<(), RingBroken> {
        let _reaping = self.reaping.lock().unwrap_or_else(PoisonError::into_inner);
        let tick = types::Timespec::new()
            .sec(REAP_TICK.as_secs())
            .nsec(REAP_TICK.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&tick);
        // Each enter also submits whatever is queued and not yet submitted.
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            // The tick passed or a signal came: whatever completed is taken below.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
            // The kernel is short of resources or the completion queue is full: take what
            // completed, after a pause so a caller looping on this does not spin (review 32).
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) => {
                self.broken.store(true, Ordering::SeqCst);
                return Err(RingBroken(e));
            }
        }
        // SAFETY: only the thread holding `reaping` reads the completion queue.
        let completions = unsafe { self.ring.completion_shared() };
        for entry in completions {
            if entry.user_data() != WAKE {
                done.push((entry.user_data(), entry.result()));
            }
        }
        Ok(())
    }

    /// Takes the ring out of use as if it had failed: reads still in flight are never waited
    /// for, and the ring is leaked on drop (their buffers must be too).
    pub fn retire(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }

    /// Whether the ring failed: nothing is submitted any more.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }
}

impl Drop for ReadRing {
    fn drop(&mut self) {
        if !self.is_broken() {
            // SAFETY: dropped once, here; nothing uses the ring after its owner drops it.
            unsafe { ManuallyDrop::drop(&mut self.ring) };
        }
        // Broken: reads may be in flight into buffers the caller leaked; the ring's queues
        // are leaked with them.
    }
}
