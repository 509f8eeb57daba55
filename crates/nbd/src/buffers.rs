//! Request buffers under a memory limit.
//!
//! Every byte of every request buffer (a write's payload, a read's data) is charged to the
//! server's limit ([`ServerConfig::buffer_memory`](crate::ServerConfig)) for as long as the
//! buffer exists, and to its connection's limit
//! ([`ServerConfig::connection_buffer_memory`](crate::ServerConfig)) while a request uses it.
//! A request that does not fit waits (bounded) for other requests to give memory back, then
//! fails with `ENOMEM` instead of pinning more.
//!
//! A buffer for less than a page (a request of a few hundred bytes, served by
//! read-modify-write anyway) is a plain allocation of its length, charged at what the
//! allocator spends on it, so a client's many small requests waiting for their replies pin
//! what they need, not a page each. Page-sized and larger buffers are page-aligned (O_DIRECT
//! reads go straight into them).
//!
//! Buffers of a page up to [`KEEP_MAX_BUFFER`] are kept after use for the next request of that size,
//! up to [`KEEP_BYTES`] in all, so the usual small requests allocate nothing. Kept buffers stay
//! charged but never make a request wait: they are freed first when room is needed. Larger
//! buffers are freed when their request ends, so one huge request pins nothing afterwards.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use ssdcache_device::AlignedBuf;

use crate::proto::Errno;
use crate::server::lock;

/// Smallest aligned buffer (one page, the O_DIRECT alignment); sizes up to
/// [`KEEP_MAX_BUFFER`] are rounded up to a power of two so kept buffers fit the next request
/// of about that size. Shorter requests get a [`Buffer::Small`].
const MIN_BUFFER: usize = 4096;
/// What a small buffer is charged beyond its length: the allocator's header and rounding
/// (glibc: 8 bytes and 16-byte chunks), rounded up generously.
const SMALL_OVERHEAD: usize = 16;
const SMALL_GRAIN: usize = 64;
/// Largest buffer kept for reuse: covers the requests kernel clients, fio and qemu usually
/// send (4 KiB to 1 MiB). Larger requests are rare, and one allocation costs little next to
/// moving that much data.
pub const KEEP_MAX_BUFFER: usize = 1 << 20;
/// Most bytes kept for reuse in all (never more than a quarter of the server's limit).
pub const KEEP_BYTES: usize = 32 << 20;
/// Size classes: 4 KiB, 8 KiB, ... [`KEEP_MAX_BUFFER`].
const CLASSES: usize = (KEEP_MAX_BUFFER / MIN_BUFFER).trailing_zeros() as usize + 1;

/// The buffers of one server.
pub(crate) struct BufferPool {
    /// Bytes all buffers together may hold.
    limit: usize,
    /// Bytes kept buffers may hold.
    keep_limit: usize,
    state: Mutex<PoolState>,
    /// Signalled when memory is given back or a waiter should give up.
    returned: Condvar,
}

#[derive(Default)]
struct PoolState {
    /// Bytes of every buffer that exists: in use by requests, or kept.
    charged: usize,
    /// Unused buffers by size class, each charged.
    kept: [Vec<AlignedBuf>; CLASSES],
    kept_bytes: usize,
    /// Requests waiting for memory (so a return only signals when someone listens).
    waiters: usize,
}

/// The memory one connection's requests hold. Changed only under the pool's lock.
pub(crate) struct ConnectionMemory {
    limit: usize,
    in_use: AtomicUsize,
}

impl ConnectionMemory {
    pub(crate) fn new(limit: usize) -> ConnectionMemory {
        ConnectionMemory {
            limit,
            in_use: AtomicUsize::new(0),
        }
    }
}

/// A buffer in use by one request, given back to the pool on drop. Dereferences to exactly
/// the request's length.
pub(crate) struct Lease<'p> {
    pool: &'p BufferPool,
    connection: &'p ConnectionMemory,
    buf: Option<Buffer>,
}

/// The memory behind a lease.
enum Buffer {
    /// A page or more, page-aligned, resized to the request's length.
    Aligned(AlignedBuf),
    /// Less than a page: exactly the request's length.
    Small(Box<[u8]>),
}

impl Buffer {
    /// What the buffer is charged.
    fn charge(&self) -> usize {
        match self {
            Buffer::Aligned(buf) => buf.capacity(),
            Buffer::Small(buf) => buffer_size(buf.len()),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Aligned(buf) => buf,
            Buffer::Small(buf) => buf,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Buffer::Aligned(buf) => buf,
            Buffer::Small(buf) => buf,
        }
    }
}

impl std::ops::Deref for Lease<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], Buffer::bytes)
    }
}

impl std::ops::DerefMut for Lease<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], Buffer::bytes_mut)
    }
}

impl Lease<'_> {
    /// Ends the lease without freeing its memory, which something outside Rust may still
    /// write (a read the kernel was given and may not have finished): the buffer is leaked,
    /// and no longer counted against the server's or the connection's limit.
    pub(crate) fn leak(mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.forget(self.connection, buf);
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(self.connection, buf);
        }
    }
}

/// What a buffer of `len` bytes costs: its capacity (for less than a page, what the
/// allocator spends on it).
pub(crate) fn buffer_size(len: usize) -> usize {
    if is_small(len) {
        return (len + SMALL_OVERHEAD).next_multiple_of(SMALL_GRAIN);
    }
    let len = len.max(MIN_BUFFER);
    if len <= KEEP_MAX_BUFFER {
        len.next_power_of_two()
    } else {
        len.div_ceil(MIN_BUFFER).saturating_mul(MIN_BUFFER)
    }
}

/// Whether a buffer of `len` bytes is a [`Buffer::Small`].
fn is_small(len: usize) -> bool {
    len > 0 && len < MIN_BUFFER
}

/// The kept-buffer class of a buffer of `size` bytes, if buffers that size are kept.
fn class_of(size: usize) -> Option<usize> {
    (size.is_power_of_two() && (MIN_BUFFER..=KEEP_MAX_BUFFER).contains(&size))
        .then(|| (size / MIN_BUFFER).trailing_zeros() as usize)
}

impl BufferPool {
    pub(crate) fn new(limit: usize) -> BufferPool {
        BufferPool {
            limit,
            keep_limit: KEEP_BYTES.min(limit / 4),
            state: Mutex::new(PoolState::default()),
            returned: Condvar::new(),
        }
    }

    /// Bytes all buffers hold now (in use and kept).
    pub(crate) fn charged(&self) -> usize {
        lock(&self.state).charged
    }

    /// A buffer of `len` bytes for one request of `connection`, waiting until `deadline` for
    /// memory to be given back. `ENOMEM` when the wait runs out or the memory cannot be
    /// allocated; `ESHUTDOWN` as soon as `give_up()` is true (checked on every wake-up; call
    /// [`BufferPool::wake_all`] after making it true).
    pub(crate) fn take<'p>(
        &'p self,
        connection: &'p ConnectionMemory,
        len: usize,
        deadline: Instant,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Lease<'p>, Errno> {
        let size = buffer_size(len);
        if size > connection.limit || size > self.limit {
            return Err(Errno::NoMem);
        }
        let mut state = lock(&self.state);
        loop {
            let in_use = connection.in_use.load(Ordering::Relaxed);
            if in_use + size <= connection.limit {
                // A small buffer may cost a kept class's size (4,033 to 4,080 bytes cost 4 KiB)
                // but is never a kept buffer: taking one out of the kept list for it would
                // leak the kept buffer's charge (review 43 F0).
                let kept = if is_small(len) {
                    None
                } else {
                    self.reuse(&mut state, size)
                };
                if let Some(buf) = kept {
                    connection.in_use.store(in_use + size, Ordering::Relaxed);
                    return Ok(self.lease(connection, buf, len));
                }
                self.free_kept_for(&mut state, size);
                if state.charged + size <= self.limit {
                    state.charged += size;
                    connection.in_use.store(in_use + size, Ordering::Relaxed);
                    drop(state);
                    return self.allocate(connection, size, len);
                }
            }
            if give_up() {
                return Err(Errno::Shutdown);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Errno::NoMem);
            }
            state.waiters += 1;
            let (woken, _) = self
                .returned
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            state = woken;
            state.waiters -= 1;
        }
    }

    /// Wakes every waiting request so it can check whether to give up.
    pub(crate) fn wake_all(&self) {
        let _state = lock(&self.state);
        self.returned.notify_all();
    }

    fn reuse(&self, state: &mut PoolState, size: usize) -> Option<AlignedBuf> {
        let buf = state.kept[class_of(size)?].pop()?;
        state.kept_bytes -= size;
        Some(buf)
    }

    /// Frees kept buffers, largest first, until `size` more bytes fit or none are left.
    fn free_kept_for(&self, state: &mut PoolState, size: usize) {
        for class in (0..CLASSES).rev() {
            while state.charged + size > self.limit {
                let Some(buf) = state.kept[class].pop() else {
                    break;
                };
                state.kept_bytes -= buf.capacity();
                state.charged -= buf.capacity();
            }
        }
    }

    /// Allocates a buffer whose `size` bytes are already charged (outside the lock: zeroing
    /// megabytes takes time).
    fn allocate<'p>(
        &'p self,
        connection: &'p ConnectionMemory,
        size: usize,
        len: usize,
    ) -> Result<Lease<'p>, Errno> {
        if is_small(len) {
            return Ok(Lease {
                pool: self,
                connection,
                buf: Some(Buffer::Small(vec![0u8; len].into_boxed_slice())),
            });
        }
        match AlignedBuf::try_zeroed(size) {
            Some(buf) => Ok(self.lease(connection, buf, len)),
            None => {
                let mut state = lock(&self.state);
                state.charged -= size;
                connection.in_use.fetch_sub(size, Ordering::Relaxed);
                self.notify_waiters(&state);
                Err(Errno::NoMem)
            }
        }
    }

    fn lease<'p>(
        &'p self,
        connection: &'p ConnectionMemory,
        mut buf: AlignedBuf,
        len: usize,
    ) -> Lease<'p> {
        // Never reallocates: len <= capacity by construction.
        let fits = buf.try_resize_discarding(len);
        debug_assert!(fits);
        Lease {
            pool: self,
            connection,
            buf: Some(Buffer::Aligned(buf)),
        }
    }

    fn give_back(&self, connection: &ConnectionMemory, buf: Buffer) {
        let size = buf.charge();
        let mut state = lock(&self.state);
        connection.in_use.fetch_sub(size, Ordering::Relaxed);
        let freed = match (buf, class_of(size)) {
            (Buffer::Aligned(buf), Some(class)) if state.kept_bytes + size <= self.keep_limit => {
                state.kept[class].push(buf);
                state.kept_bytes += size;
                None
            }
            (buf, _) => {
                state.charged -= size;
                Some(buf)
            }
        };
        self.notify_waiters(&state);
        drop(state);
        drop(freed);
    }

    /// [`Lease::leak`]: uncounts `buf` and never frees it.
    fn forget(&self, connection: &ConnectionMemory, buf: Buffer) {
        let size = buf.charge();
        let mut state = lock(&self.state);
        connection.in_use.fetch_sub(size, Ordering::Relaxed);
        state.charged -= size;
        self.notify_waiters(&state);
        drop(state);
        std::mem::forget(buf);
    }

    fn notify_waiters(&self, state: &PoolState) {
        if state.waiters > 0 {
            self.returned.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    const NEVER: &dyn Fn() -> bool = &|| false;

    #[test]
    fn sizes_round_to_classes_and_pages() {
        assert_eq!(buffer_size(0), 4096);
        assert_eq!(buffer_size(1), 64);
        assert_eq!(buffer_size(1024), 1088);
        assert_eq!(buffer_size(4095), 4160);
        assert_eq!(buffer_size(4096), 4096);
        assert_eq!(buffer_size(4097), 8192);
        assert_eq!(buffer_size(768 << 10), 1 << 20);
        assert_eq!(buffer_size((1 << 20) + 1), (1 << 20) + 4096);
        assert_eq!(class_of(4096), Some(0));
        assert_eq!(class_of(1 << 20), Some(CLASSES - 1));
        assert_eq!(class_of(2 << 20), None);
    }

    #[test]
    fn small_buffers_are_kept_and_reused_large_ones_freed() {
        let pool = BufferPool::new(64 << 20);
        let conn = ConnectionMemory::new(64 << 20);
        let first = pool.take(&conn, 4096, soon(), NEVER).unwrap();
        let address = first.as_ptr();
        drop(first);
        assert_eq!(pool.charged(), 4096, "kept");
        let again = pool.take(&conn, 4000 + 96, soon(), NEVER).unwrap();
        assert_eq!(again.as_ptr(), address, "reused");
        assert_eq!(again.len(), 4096);
        drop(again);
        let small = pool.take(&conn, 1000, soon(), NEVER).unwrap();
        assert_eq!(small.len(), 1000);
        assert_eq!(
            pool.charged(),
            4096 + 1024,
            "charged at what it costs, not a page"
        );
        drop(small);
        assert_eq!(pool.charged(), 4096, "small buffers are freed, not kept");
        let huge = pool.take(&conn, 32 << 20, soon(), NEVER).unwrap();
        assert_eq!(pool.charged(), (32 << 20) + 4096);
        drop(huge);
        assert_eq!(pool.charged(), 4096, "the huge buffer is freed");
        assert_eq!(conn.in_use.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn limits_make_requests_wait_then_fail() {
        let pool = BufferPool::new(4 << 20);
        let a = ConnectionMemory::new(2 << 20);
        let b = ConnectionMemory::new(4 << 20);
        let held = pool.take(&a, 2 << 20, soon(), NEVER).unwrap();
        assert_eq!(
            pool.take(&a, 4096, soon(), NEVER).err(),
            Some(Errno::NoMem),
            "connection limit"
        );
        let other = pool.take(&b, 2 << 20, soon(), NEVER).unwrap();
        assert_eq!(
            pool.take(&b, 4096, soon(), NEVER).err(),
            Some(Errno::NoMem),
            "server limit"
        );
        assert_eq!(
            pool.take(&b, 8 << 20, soon(), NEVER).err(),
            Some(Errno::NoMem),
            "larger than any limit"
        );
        drop(other);
        drop(held);
        assert_eq!(pool.charged(), 0);
    }

    #[test]
    fn a_waiting_request_gets_memory_given_back() {
        let pool = BufferPool::new(1 << 20);
        let conn = ConnectionMemory::new(1 << 20);
        let held = pool.take(&conn, 1 << 20, soon(), NEVER).unwrap();
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(10);
                pool.take(&conn, 1 << 20, deadline, NEVER).map(|l| l.len())
            });
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
            assert_eq!(waiter.join().unwrap(), Ok(1 << 20));
        });
    }

    #[test]
    fn kept_buffers_never_block_a_request() {
        let pool = BufferPool::new(4 << 20);
        let conn = ConnectionMemory::new(4 << 20);
        let leases: Vec<_> = (0..4)
            .map(|_| pool.take(&conn, 256 << 10, soon(), NEVER).unwrap())
            .collect();
        drop(leases);
        assert_eq!(
            pool.charged(),
            1 << 20,
            "kept, up to a quarter of the limit"
        );
        let big = pool.take(&conn, 4 << 20, soon(), NEVER).unwrap();
        assert_eq!(
            pool.charged(),
            4 << 20,
            "kept buffers were freed to make room"
        );
        drop(big);
    }

    #[test]
    fn waiters_give_up_when_told() {
        let pool = BufferPool::new(1 << 20);
        let conn = ConnectionMemory::new(1 << 20);
        let _held = pool.take(&conn, 1 << 20, soon(), NEVER).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(10);
                let started = Instant::now();
                let result = pool.take(&conn, 4096, deadline, &|| stop.load(Ordering::SeqCst));
                (result.err(), started.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            stop.store(true, Ordering::SeqCst);
            pool.wake_all();
            let (error, waited) = waiter.join().unwrap();
            assert_eq!(error, Some(Errno::Shutdown));
            assert!(waited < Duration::from_secs(5));
        });
    }
}
