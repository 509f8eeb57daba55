//! CLOCK (second chance): FIFO order plus a reference bit per slot that a hit sets. The hand
//! is the old end of the queue: a slot found there with its bit set has the bit cleared and
//! goes round again (to the new end) instead of being evicted. Kept as a queue rather than a
//! hand over slot numbers because the engine fills whichever slot is free, not the one under
//! the hand: a new slot must go behind the hand whatever its number.
//!
//! A slot the engine cannot evict goes round like a referenced one (its bit is kept). One
//! search examines each slot at most twice (the first time clears its bit), so if any slot is
//! evictable it is found and the search is bounded by twice the number of slots.

use super::list::Lists;
use super::ReplacementPolicy;

const RING: usize = 0;

pub struct Clock {
    ring: Lists,
    referenced: Vec<bool>,
}

impl Clock {
    pub fn new(slots: u32) -> Clock {
        Clock {
            ring: Lists::new(slots as usize, 1),
            referenced: vec![false; slots as usize],
        }
    }
}

impl ReplacementPolicy for Clock {
    fn insert(&mut self, slot: u32, _key: u64) {
        self.ring.move_to_newest(RING, slot);
        self.referenced[slot as usize] = false;
    }

    fn touch(&mut self, slot: u32) {
        if self.ring.contains(slot) {
            self.referenced[slot as usize] = true;
        }
    }

    fn remove(&mut self, slot: u32) {
        self.ring.unlink(slot);
    }

    fn victim(&mut self, _incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        for _ in 0..2 * self.ring.len(RING) {
            let s = self.ring.oldest(RING)?;
            if self.referenced[s as usize] {
                self.referenced[s as usize] = false;
            } else if evictable(s) {
                return Some(s);
            }
            self.ring.move_to_newest(RING, s);
        }
        None
    }

    fn tracked(&self) -> u32 {
        self.ring.len(RING)
    }

    fn name(&self) -> &'static str {
        "clock"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touched_slot_gets_a_second_chance() {
        let mut c = Clock::new(4);
        for s in 0..4 {
            c.insert(s, u64::from(s));
        }
        c.touch(0);
        c.touch(2);
        assert_eq!(c.victim(u64::MAX, &mut |_| true), Some(1));
        c.remove(1);
        assert_eq!(c.victim(u64::MAX, &mut |_| true), Some(3));
        c.remove(3);
        // 0 and 2 had their second chance: now they go, oldest first.
        assert_eq!(c.victim(u64::MAX, &mut |_| true), Some(0));
        c.remove(0);
        c.insert(0, 10);
        assert_eq!(c.victim(u64::MAX, &mut |_| true), Some(2));
    }

    #[test]
    fn all_referenced_degenerates_to_fifo() {
        let mut c = Clock::new(3);
        for s in 0..3 {
            c.insert(s, u64::from(s));
            c.touch(s);
        }
        assert_eq!(c.victim(u64::MAX, &mut |_| true), Some(0));
    }

    #[test]
    fn respects_the_predicate() {
        let mut c = Clock::new(4);
        for s in 0..4 {
            c.insert(s, u64::from(s));
            c.touch(s);
        }
        assert_eq!(c.victim(u64::MAX, &mut |_| false), None);
        assert_eq!(c.tracked(), 4);
        assert_eq!(c.victim(u64::MAX, &mut |s| s == 3), Some(3));
        c.remove(3);
        c.remove(2);
        c.remove(1);
        assert_eq!(c.victim(u64::MAX, &mut |s| s == 1), None);
        assert_eq!(c.victim(u64::MAX, &mut |_| true), Some(0));
    }
}
