//! Batched reads through io_uring: many reads of one file go to the kernel with one
//! `io_uring_enter` instead of one `pread` (and one wait) each. The NBD server uses it for
//! cache hits (docs/design.md §6.1): a batch of hits costs one system call and one wait.
//!
//! The process keeps a bounded set of rings, each with its own staging buffer ([`max_rings`]:
//! the NBD server has up to 32 fast workers per connection, and a ring each would cost 256 KiB
//! per worker). A batch takes an idle ring (or makes one while fewer than the bound were
//! made), uses it and gives it back; a batch that finds every ring busy reads synchronously.
//! The kernel reads into the staging buffer, which this module owns, and the
//! data is copied to the caller's buffer after the completion: the caller's memory is never
//! in the kernel's hands, so an error in the ring can never leave the kernel writing into a
//! buffer that was given back (the ring and its buffer are then leaked, not freed), and the
//! staging buffer is 4 KiB aligned as O_DIRECT requires whatever the caller's alignment.
//!
//! Where io_uring is unavailable (an old kernel, a seccomp filter, `SSDCACHE_NO_IO_URING=1`
//! or [`set_io_uring_enabled`]) every read goes through the fallback (`pread`), and the log
//! says so once.

use std::io;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, PoisonError};

use io_uring::{opcode, types, IoUring};

use crate::{AlignedBuf, DeviceRead, ALIGN};

/// Submission queue entries per ring, so reads in flight per batch at most; a longer batch
/// goes in rounds of this many.
pub const RING_ENTRIES: u32 = 64;

/// Staging memory per ring: the bytes one round reads at most. A read bigger
/// than this goes through the fallback on its own.
pub const STAGING_BYTES: usize = 256 * 1024;

/// Set by `set_io_uring_enabled(false)` (tests) or `SSDCACHE_NO_IO_URING` (operators).
static DISABLED: AtomicBool = AtomicBool::new(false);
static READ_ENV: Once = Once::new();
static WARNED: Once = Once::new();
/// Reads completed through a ring, for tests and diagnostics.
static RING_READS: AtomicU64 = AtomicU64::new(0);
/// Rings made since the process started, for tests and diagnostics.
static RINGS_MADE: AtomicU64 = AtomicU64::new(0);

/// Turns batched reads through io_uring on or off for the whole process (rings already made
/// stop being used too). Off, every read takes the fallback.
pub fn set_io_uring_enabled(enabled: bool) {
    read_env();
    DISABLED.store(!enabled, Ordering::SeqCst);
}

/// Reads that completed through io_uring since the process started.
pub fn io_uring_reads() -> u64 {
    RING_READS.load(Ordering::Relaxed)
}

/// Rings (each with its staging buffer) the process makes at most: four per CPU, at least 8
/// and at most 64 (so at most 16 MiB of staging). A batch that finds every ring busy reads
/// synchronously, as without io_uring.
pub fn max_rings() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        (cpus * 4).clamp(8, 64)
    })
}

/// Rings (each with its staging buffer) made since the process started.
pub fn io_uring_rings_made() -> u64 {
    RINGS_MADE.load(Ordering::Relaxed)
}

/// Whether batched reads go through io_uring in this process: it is not turned off and the
/// kernel gives a ring (probed once). Without it a batch is no cheaper than its reads one by
/// one, so callers that can spread reads over threads instead should.
pub fn io_uring_available() -> bool {
    static PROBED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    read_env();
    if DISABLED.load(Ordering::SeqCst) {
        return false;
    }
    *PROBED.get_or_init(|| match IoUring::new(1) {
        Ok(_) => true,
        Err(error) => {
            WARNED.call_once(|| {
                tracing::warn!(%error, "io_uring is unavailable; cache hits use one synchronous read each");
            });
            false
        }
    })
}

fn read_env() {
    READ_ENV.call_once(|| {
        if std::env::var_os("SSDCACHE_NO_IO_URING").is_some_and(|v| !v.is_empty() && v != "0") {
            DISABLED.store(true, Ordering::SeqCst);
            tracing::info!("SSDCACHE_NO_IO_URING is set: cache hits use one synchronous read each");
        }
    });
}

/// The process's rings that no batch is using. A batch takes one (or makes one, while fewer
/// than [`max_rings`] were made) and gives it back; a ring that failed, or whose batch
/// panicked, is never given back nor freed (the kernel may still hold its staging buffer), so
/// the memory rings take, leaked ones included, stays under `max_rings() × STAGING_BYTES`.
static IDLE: Mutex<Vec<RingReader>> = Mutex::new(Vec::new());
/// Rings made or tried (a failed try counts too: at most [`max_rings`] tries in all).
static RINGS_TRIED: AtomicUsize = AtomicUsize::new(0);

struct RingReader {
    ring: IoUring,
    staging: AlignedBuf,
}

/// Reads every entry of `reads` from `fd`, each result into its `result`; `fallback` reads one
/// entry synchronously where the ring cannot (unavailable, all busy, too big, a short read).
pub(crate) fn read_batch(
    fd: RawFd,
    reads: &mut [DeviceRead<'_>],
    fallback: &dyn Fn(&mut [u8], u64) -> io::Result<()>,
) {
    read_env();
    let ring = if DISABLED.load(Ordering::SeqCst) {
        None
    } else {
        take_ring()
    };
    let Some(mut ring) = ring else {
        for read in reads.iter_mut() {
            read.result = fallback(read.buf, read.offset);
        }
        return;
    };
    // A panic with reads in flight must not free the staging buffer on its way out: the ring
    // is leaked as after an error, then the panic goes on (review 18).
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ring.read_all(fd, reads, fallback)
    }));
    match outcome {
        Ok(Ok(())) => idle_rings().push(ring),
        Ok(Err(error)) => {
            // The kernel may still hold its staging buffer: never free it.
            std::mem::forget(ring);
            tracing::error!(
                %error,
                "an io_uring ring failed and is retired; batches that find no ring read synchronously"
            );
        }
        Err(panic) => {
            std::mem::forget(ring);
            std::panic::resume_unwind(panic);
        }
    }
}

fn idle_rings() -> std::sync::MutexGuard<'static, Vec<RingReader>> {
    IDLE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An idle ring, or a new one while fewer than [`max_rings`] were tried; `None` when every
/// ring is busy (or io_uring is unavailable).
fn take_ring() -> Option<RingReader> {
    if let Some(ring) = idle_rings().pop() {
        return Some(ring);
    }
    RINGS_TRIED
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < max_rings()).then_some(n + 1)
        })
        .ok()?;
    open_ring()
}

fn open_ring() -> Option<RingReader> {
    match IoUring::new(RING_ENTRIES) {
        Ok(ring) => {
            let staging = AlignedBuf::try_zeroed(STAGING_BYTES)?;
            RINGS_MADE.fetch_add(1, Ordering::Relaxed);
            Some(RingReader { ring, staging })
        }
        Err(error) => {
            WARNED.call_once(|| {
                tracing::warn!(%error, "io_uring is unavailable; cache hits use one synchronous read each");
            });
            None
        }
    }
}

/// Where one read of a round lands in the staging buffer.
struct Staged {
    index: usize,
    at: usize,
}

impl RingReader {
    /// Reads everything in rounds; an `Err` means the ring is broken (every read has its
    /// result all the same, from the fallback where the ring did not give one).
    fn read_all(
        &mut self,
        fd: RawFd,
        reads: &mut [DeviceRead<'_>],
        fallback: &dyn Fn(&mut [u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut next = 0;
        let mut round = Vec::with_capacity(RING_ENTRIES as usize);
        while next < reads.len() {
            round.clear();
            let mut used = 0;
            while next < reads.len() && round.len() < RING_ENTRIES as usize {
                let len = reads[next].buf.len();
                if len > STAGING_BYTES || len > u32::MAX as usize {
                    let read = &mut reads[next];
                    read.result = fallback(read.buf, read.offset);
                    next += 1;
                    continue;
                }
                if used + len > STAGING_BYTES {
                    break;
                }
                round.push(Staged {
                    index: next,
                    at: used,
                });
                used += len.div_ceil(ALIGN) * ALIGN;
                next += 1;
            }
            if let Err(error) = self.run_round(fd, &round, reads, fallback) {
                // Reads of this round without a result, and every later one, go through the
                // fallback: into the caller's buffers, which the kernel never had.
                let first = round.first().map_or(next, |staged| staged.index);
                for read in reads[first..].iter_mut().filter(|r| r.result.is_err()) {
                    read.result = fallback(read.buf, read.offset);
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Submits one round with one system call, waits for all of it and copies the data out.
    fn run_round(
        &mut self,
        fd: RawFd,
        round: &[Staged],
        reads: &mut [DeviceRead<'_>],
        fallback: &dyn Fn(&mut [u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let base = self.staging.as_mut_ptr();
        for (slot, staged) in round.iter().enumerate() {
            let read = &reads[staged.index];
            // SAFETY: `at + len` lies inside the staging buffer (checked when the round was
            // planned), which outlives the read: this function waits for every completion,
            // and on a failure that could leave one pending the buffer is leaked.
            let target = unsafe { base.add(staged.at) };
            let entry = opcode::Read::new(types::Fd(fd), target, read.buf.len() as u32)
                .offset(read.offset)
                .build()
                .user_data(slot as u64);
            // SAFETY: the entry points into memory that stays valid until its completion (above).
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_err() {
                // Cannot happen: a round has at most RING_ENTRIES entries and the queue is
                // empty between rounds. Anything pushed so far is still submitted and awaited.
                return self.finish_round(round, slot, reads, fallback);
            }
        }
        self.finish_round(round, round.len(), reads, fallback)
    }

    /// Submits the `pushed` first entries of `round`, waits for their completions and
    /// copies; the rest (if any) go through the fallback.
    fn finish_round(
        &mut self,
        round: &[Staged],
        pushed: usize,
        reads: &mut [DeviceRead<'_>],
        fallback: &dyn Fn(&mut [u8], u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut done = 0;
        while done < pushed {
            match self.ring.submit_and_wait(pushed - done) {
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                Err(error) => return Err(error),
            }
            for completion in self.ring.completion() {
                let Some(staged) = round.get(completion.user_data() as usize) else {
                    continue;
                };
                done += 1;
                let read = &mut reads[staged.index];
                let len = read.buf.len();
                read.result = match usize::try_from(completion.result()) {
                    Ok(n) if n == len => {
                        read.buf
                            .copy_from_slice(&self.staging[staged.at..staged.at + len]);
                        RING_READS.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    // A short read (the end of a file): the fallback says what it is.
                    Ok(_) => fallback(read.buf, read.offset),
                    Err(_) => Err(io::Error::from_raw_os_error(-completion.result())),
                };
            }
        }
        for staged in &round[pushed..] {
            let read = &mut reads[staged.index];
            read.result = fallback(read.buf, read.offset);
        }
        Ok(())
    }
}
