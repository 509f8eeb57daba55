//! The order of writes on a backing device, in one place (docs/design.md §3, "Backing order").
//!
//! Some writes to a backing device run without the lines they concern: the cleaner's
//! writebacks, and a client's write-through writes (so hits on their lines, and on the other
//! sectors of them, never wait for the disk). Two rules keep what the cache holds equal to what
//! the disk holds:
//!
//! 1. Overlapping writes never run at once. A write waits for every overlapping write in
//!    flight before it starts, so the later one lands last; a client read of the backing device
//!    waits too, so it never reads (and caches) a half-written range. A write in flight ends
//!    when its device write returns and needs no lock to get there, so a waiter may hold lines.
//! 2. A write-through write puts its data in the cache after its disk write, under its lines
//!    again. It does so only if no other write to an overlapping range began after it
//!    ([`PendingFill::finish`] says whether one did): that other write landed later on the disk,
//!    so the first one's data would be stale in the cache. The range then stays out of the
//!    cache (the write invalidated it before its disk write) and the disk serves it.
//! 3. A read miss of one line reads the disk without its line and uses what it read, under the
//!    line again, only if no write to the line began after it registered (while it still held
//!    the line). Such a write may have landed before or during the read, and its data may by
//!    now be clean in the cache (the cleaner's writeback) where nothing lays it over what the
//!    read got; so the read starts over holding the line instead. A second miss of a line
//!    being read so waits, without the line, until the first used what it read
//!    ([`BackingOrder::wait_for_reads`]), and is then served from the cache: the line is read
//!    from the disk once, as when the first miss held it.
//!
//! Bounds: the ranges in flight are at most the writes in flight on the device: the cleaner's
//! (32) plus one per client request running (connections × workers); the pending fills at most
//! one per client request running.

use crate::sync::{Condvar, Mutex, MutexGuard};

/// Writes in flight on one backing device and write-through fills waiting to be made.
pub(crate) struct BackingOrder {
    state: Mutex<OrderState>,
    /// Notified when a write in flight ends and when a read miss's pending fill ends.
    ended: Condvar,
}

#[derive(Default)]
struct OrderState {
    /// Byte ranges `(start, end)` being written on the device right now.
    in_flight: Vec<(u64, u64)>,
    /// Write-through writes between their disk write's start and their cache fill, and read
    /// misses between their registration and their use of what they read.
    pending_fills: Vec<Pending>,
    next_fill: u64,
}

struct Pending {
    id: u64,
    range: (u64, u64),
    /// A write to an overlapping range began after this one: its fill must not happen.
    superseded: bool,
    /// A read miss that will cache the whole line (rule 3): a second miss of the line waits
    /// for it. (Not a write-through write's fill, nor a miss that caches nothing.)
    caches_line: bool,
}

fn overlaps((s1, e1): (u64, u64), (s2, e2): (u64, u64)) -> bool {
    s1 < e2 && s2 < e1
}

fn byte_range(offset: u64, len: u64) -> (u64, u64) {
    (offset, offset.saturating_add(len))
}

/// A write in flight on the backing device; ends (waking waiters) when dropped.
pub(crate) struct WriteInFlight<'a> {
    order: &'a BackingOrder,
    range: (u64, u64),
}

impl Drop for WriteInFlight<'_> {
    fn drop(&mut self) {
        let mut state = self.order.state();
        if let Some(i) = state.in_flight.iter().position(|&r| r == self.range) {
            state.in_flight.swap_remove(i);
        }
        drop(state);
        self.order.ended.notify_all();
    }
}

/// A write-through write's right to fill the cache after its disk write, or a read miss's
/// right to use what it read from the disk, unless superseded.
pub(crate) struct PendingFill<'a> {
    order: &'a BackingOrder,
    id: u64,
}

impl PendingFill<'_> {
    /// Ends the wait; true when the fill may be made (no overlapping write began since).
    /// Called with the write's lines held again, so no other write of them can begin between
    /// this answer and the fill.
    pub fn finish(self) -> bool {
        // `Drop` finds nothing more to remove.
        self.end().is_some_and(|p| !p.superseded)
    }

    /// Removes the pending fill (waking reads waiting for it); what it was, if still there.
    fn end(&self) -> Option<Pending> {
        let mut state = self.order.state();
        let ended = state
            .pending_fills
            .iter()
            .position(|p| p.id == self.id)
            .map(|i| state.pending_fills.swap_remove(i));
        drop(state);
        if ended.as_ref().is_some_and(|p| p.caches_line) {
            self.order.ended.notify_all();
        }
        ended
    }
}

impl Drop for PendingFill<'_> {
    fn drop(&mut self) {
        self.end();
    }
}

impl BackingOrder {
    pub fn new() -> BackingOrder {
        BackingOrder {
            state: Mutex::new(OrderState::default()),
            ended: Condvar::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, OrderState> {
        // Plain lists, consistent after any panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until no write in flight overlaps the range, then marks it in flight and tells
    /// every pending fill it overlaps that it is superseded. The caller writes the device,
    /// then drops the guard.
    pub fn begin_write(&self, offset: u64, len: u64) -> WriteInFlight<'_> {
        let range = byte_range(offset, len);
        let mut state = self.wait_for_overlapping(self.state(), range);
        for pending in &mut state.pending_fills {
            if overlaps(pending.range, range) {
                pending.superseded = true;
            }
        }
        state.in_flight.push(range);
        WriteInFlight { order: self, range }
    }

    /// [`begin_write`](Self::begin_write) for a write-through write that fills the cache
    /// after its disk write: also registers the fill, which a later overlapping write
    /// supersedes.
    pub fn begin_write_then_fill(
        &self,
        offset: u64,
        len: u64,
    ) -> (WriteInFlight<'_>, PendingFill<'_>) {
        let in_flight = self.begin_write(offset, len);
        (
            in_flight,
            self.register_fill(byte_range(offset, len), false),
        )
    }

    /// Registers a read of the disk that will use what it read only if no write overlapping
    /// the range begins from now on (rule 3); `caches_line`: it will cache what it read, so a
    /// second miss of the range should wait for it. The caller holds the range's lines, so no
    /// write of it can begin before this.
    pub fn begin_read_then_fill(
        &self,
        offset: u64,
        len: u64,
        caches_line: bool,
    ) -> PendingFill<'_> {
        self.register_fill(byte_range(offset, len), caches_line)
    }

    /// Whether a read miss (rule 3) that will cache an overlapping range has not yet used what
    /// it read.
    pub fn read_in_flight(&self, offset: u64, len: u64) -> bool {
        let range = byte_range(offset, len);
        self.state()
            .pending_fills
            .iter()
            .any(|p| p.caches_line && overlaps(p.range, range))
    }

    /// Waits until every read miss (rule 3) that will cache an overlapping range has used what
    /// it read. A read miss needs no lock to get there but its line, which the caller must not
    /// hold.
    pub fn wait_for_reads(&self, offset: u64, len: u64) {
        let range = byte_range(offset, len);
        let state = self.state();
        drop(
            self.ended
                .wait_while(state, |s| {
                    s.pending_fills
                        .iter()
                        .any(|p| p.caches_line && overlaps(p.range, range))
                })
                .unwrap_or_else(|p| p.into_inner()),
        );
    }

    fn register_fill(&self, range: (u64, u64), caches_line: bool) -> PendingFill<'_> {
        let mut state = self.state();
        let id = state.next_fill;
        state.next_fill += 1;
        state.pending_fills.push(Pending {
            id,
            range,
            superseded: false,
            caches_line,
        });
        PendingFill { order: self, id }
    }

    /// Waits until no write in flight overlaps the range (a client read of the backing device:
    /// it must not read, and cache, a half-written range).
    pub fn wait_for_writes(&self, offset: u64, len: u64) {
        drop(self.wait_for_overlapping(self.state(), byte_range(offset, len)));
    }

    /// Whether a write overlapping the range is in flight now.
    pub fn write_in_flight(&self, offset: u64, len: u64) -> bool {
        let range = byte_range(offset, len);
        self.state().in_flight.iter().any(|&r| overlaps(r, range))
    }

    fn wait_for_overlapping<'a>(
        &self,
        state: MutexGuard<'a, OrderState>,
        range: (u64, u64),
    ) -> MutexGuard<'a, OrderState> {
        self.ended
            .wait_while(state, |s| s.in_flight.iter().any(|&r| overlaps(r, range)))
            .unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_overlapping_write_supersedes_a_pending_fill() {
        let order = BackingOrder::new();
        let (first, fill) = order.begin_write_then_fill(0, 8192);
        drop(first);
        let second = order.begin_write(4096, 4096);
        drop(second);
        assert!(!fill.finish(), "the later write landed last: no fill");
    }

    #[test]
    fn a_write_elsewhere_leaves_a_pending_fill_alone() {
        let order = BackingOrder::new();
        let (first, fill) = order.begin_write_then_fill(0, 4096);
        drop(first);
        drop(order.begin_write(4096, 4096));
        assert!(fill.finish());
        assert!(order.state().pending_fills.is_empty());
    }

    #[test]
    fn a_fill_registered_after_a_write_is_not_superseded_by_it() {
        let order = BackingOrder::new();
        let earlier = order.begin_write(0, 4096);
        drop(earlier);
        let (w, fill) = order.begin_write_then_fill(0, 4096);
        drop(w);
        assert!(fill.finish());
    }

    #[test]
    fn a_write_beginning_during_a_read_supersedes_it_and_an_earlier_one_does_not() {
        let order = BackingOrder::new();
        drop(order.begin_write(0, 4096));
        let read = order.begin_read_then_fill(0, 65536, true);
        assert!(
            read.finish(),
            "a write that ended before the read does not count"
        );
        let read = order.begin_read_then_fill(0, 65536, true);
        drop(order.begin_write(65536, 4096));
        assert!(read.finish(), "a write of another line does not count");
        let read = order.begin_read_then_fill(0, 65536, true);
        drop(order.begin_write(8192, 4096));
        assert!(
            !read.finish(),
            "a write of the line that began during the read"
        );
        assert!(order.state().pending_fills.is_empty());
    }

    #[test]
    fn an_overlapping_write_waits_for_the_one_in_flight() {
        let order = std::sync::Arc::new(BackingOrder::new());
        let first = order.begin_write(0, 4096);
        let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waiter = {
            let (order, started) = (order.clone(), started.clone());
            std::thread::spawn(move || {
                let _w = order.begin_write(0, 4096);
                started.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!started.load(std::sync::atomic::Ordering::SeqCst));
        drop(first);
        waiter.join().expect("waiter");
        assert!(started.load(std::sync::atomic::Ordering::SeqCst));
    }
}
