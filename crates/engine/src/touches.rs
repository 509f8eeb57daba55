//! Uses of cached lines seen by hits, kept aside so a hit never takes the map's write lock: the
//! replacement policy hears of them in batches (as Caffeine's read buffers and foyer's do).
//!
//! A hit records its slot in one of `STRIPES` small logs, picked by the thread, under that
//! stripe's own mutex (a few stores); hits on different threads mostly use different stripes.
//! A log that fills is handed to the policy by the thread that filled it, under the map's write
//! lock; a victim search first drains every log, so eviction sees the uses that came before
//! it. A use recorded for a slot that was evicted or reused meanwhile reaches the policy as a
//! use of the slot's current line (or of nothing, for a free slot): a small error in the
//! ranking, never in the data. Memory: `STRIPES × STRIPE_CAPACITY` slots (16 KiB).

use crate::sync::Mutex;

const STRIPES: usize = 16;
const STRIPE_CAPACITY: usize = 256;

pub(crate) struct TouchLog {
    stripes: [Mutex<Vec<u32>>; STRIPES],
}

impl TouchLog {
    pub fn new() -> TouchLog {
        TouchLog {
            stripes: std::array::from_fn(|_| Mutex::new(Vec::with_capacity(STRIPE_CAPACITY))),
        }
    }

    /// Records a use of `slot`. Returns the stripe's log when this use filled it: the caller
    /// hands it to the policy (`MapState::apply_touches`) and gives it back (`recycle`).
    pub fn record(&self, slot: u32) -> Option<Vec<u32>> {
        let stripe = &self.stripes[thread_index() % STRIPES];
        let mut log = stripe.lock().unwrap_or_else(|p| p.into_inner());
        log.push(slot);
        if log.len() < STRIPE_CAPACITY {
            return None;
        }
        Some(std::mem::take(&mut *log))
    }

    /// Gives an emptied log back to this thread's stripe if it has none with room, so the
    /// stripes do not allocate again.
    pub fn recycle(&self, mut log: Vec<u32>) {
        log.clear();
        let stripe = &self.stripes[thread_index() % STRIPES];
        let mut current = stripe.lock().unwrap_or_else(|p| p.into_inner());
        if current.capacity() < STRIPE_CAPACITY {
            log.extend_from_slice(&current);
            *current = log;
        }
    }

    /// Hands every recorded use to `apply`, stripe by stripe, for a victim search (the caller
    /// holds the map's write lock; a stripe's lock is taken inside it, never the other way).
    pub fn drain(&self, mut apply: impl FnMut(&[u32])) {
        for stripe in &self.stripes {
            let mut log = stripe.lock().unwrap_or_else(|p| p.into_inner());
            if !log.is_empty() {
                apply(&log);
                log.clear();
            }
        }
    }
}

/// A number per thread, fixed for the thread's life and handed out in turn, for picking a
/// stripe (`% stripes`): threads started one after another land on different stripes.
pub(crate) fn thread_index() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    INDEX.with(|i| {
        if i.get() == usize::MAX {
            i.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        i.get()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_stripe_is_handed_out_and_drains_take_the_rest() {
        let log = TouchLog::new();
        for slot in 0..STRIPE_CAPACITY as u32 - 1 {
            assert!(log.record(slot).is_none());
        }
        let full = log.record(999).expect("the stripe filled");
        assert_eq!(full.len(), STRIPE_CAPACITY);
        assert_eq!(full[STRIPE_CAPACITY - 1], 999);
        log.recycle(full);
        assert!(log.record(5).is_none());
        let mut out = Vec::new();
        log.drain(|slots| out.extend_from_slice(slots));
        assert_eq!(out, [5]);
        out.clear();
        log.drain(|slots| out.extend_from_slice(slots));
        assert!(out.is_empty());
    }
}
