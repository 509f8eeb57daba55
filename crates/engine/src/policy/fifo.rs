//! First in, first out: slots leave in the order they were filled, whatever their hits (a hit
//! costs nothing at all). An intrusive list over slots, 9 bytes per slot.
//!
//! A slot the engine cannot evict (in use, dirty, awaiting a commit) found at the old end is
//! reinserted at the new end, as FIFO-reinsertion does, so the next search does not walk over
//! it again; one search examines each slot at most once.

use super::list::Lists;
use super::ReplacementPolicy;

const QUEUE: usize = 0;

pub struct Fifo {
    queue: Lists,
}

impl Fifo {
    pub fn new(slots: u32) -> Fifo {
        Fifo {
            queue: Lists::new(slots as usize, 1),
        }
    }
}

impl ReplacementPolicy for Fifo {
    fn insert(&mut self, slot: u32, _key: u64) {
        self.queue.move_to_newest(QUEUE, slot);
    }

    fn touch(&mut self, _slot: u32) {}

    fn remove(&mut self, slot: u32) {
        self.queue.unlink(slot);
    }

    fn victim(&mut self, _incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        for _ in 0..self.queue.len(QUEUE) {
            let s = self.queue.oldest(QUEUE)?;
            if evictable(s) {
                return Some(s);
            }
            self.queue.move_to_newest(QUEUE, s);
        }
        None
    }

    fn tracked(&self) -> u32 {
        self.queue.len(QUEUE)
    }

    fn name(&self) -> &'static str {
        "fifo"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_in_insertion_order_regardless_of_hits() {
        let mut f = Fifo::new(4);
        for s in [2, 0, 3, 1] {
            f.insert(s, u64::from(s) + 100);
        }
        for _ in 0..10 {
            f.touch(2);
            f.touch(0);
        }
        let mut order = Vec::new();
        while let Some(v) = f.victim(u64::MAX, &mut |_| true) {
            order.push(v);
            f.remove(v);
        }
        assert_eq!(order, [2, 0, 3, 1]);
        assert_eq!(f.tracked(), 0);
    }

    #[test]
    fn respects_the_predicate() {
        let mut f = Fifo::new(4);
        for s in 0..4 {
            f.insert(s, u64::from(s));
        }
        assert_eq!(f.victim(u64::MAX, &mut |s| s >= 2), Some(2));
        assert_eq!(f.victim(u64::MAX, &mut |_| false), None);
        assert_eq!(f.tracked(), 4);
        // 0 and 1 were passed over and moved on, behind 3.
        assert_eq!(f.victim(u64::MAX, &mut |s| s != 2), Some(3));
        f.remove(3);
        f.remove(2);
        assert_eq!(f.victim(u64::MAX, &mut |_| true), Some(0));
        f.remove(0);
        f.remove(1);
        assert_eq!(f.victim(u64::MAX, &mut |_| true), None);
    }
}
