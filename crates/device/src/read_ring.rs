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

    fn enter_submit(&self) -> io::Result<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // The completion queue is full: the reaper frees it; the entries stay queued
                // and the next enter (the reaper's) submits them.
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

    /// Waits for at least one completion (or a wake-up) and appends each completed read as
    /// (tag, bytes read or -errno). Only one thread reaps at a time.
    pub fn reap(&self, done: &mut Vec<(u64, i32)>) -> Result<(), RingBroken> {
        let _reaping = self.reaping.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => {}
                // The completion queue is full: it is emptied below.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break,
                Err(e) => {
                    self.broken.store(true, Ordering::SeqCst);
                    return Err(RingBroken(e));
                }
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
