//! ARC, adaptive replacement cache (Megiddo and Modha, FAST'03). Two LRU lists of resident
//! slots, T1 (seen once since they entered) and T2 (seen again), and two ghost lists of
//! evicted keys, B1 (evicted from T1) and B2 (evicted from T2). `p` is the target size of T1:
//! a miss on a key in B1 says T1 was too small and grows it, one in B2 shrinks it. A one-time
//! scan only passes through T1, so it cannot flush T2 (scan resistance); a loop longer than the
//! cache, on the other hand, gets no hits, as with LRU (every key of the loop is in T1 and
//! ARC drops T1's evictions without a ghost when T1 fills the cache).
//!
//! Differences from the paper, forced by the engine's order of calls (victim, then remove of
//! the victim, then insert of the new key):
//! - REPLACE runs before the missing key is known, so its tie rule "x in B2 and |T1| = p" is
//!   not applied: T1 gives the victim when `|T1| > p` (or T2 is empty). The adaptation of `p`
//!   happens at the insert, so it steers the next eviction, not this one. (Replaying the ARC
//!   traces P3 and P6 with the key known before REPLACE changed the miss ratio by 0.0001; the
//!   miss ratios at 10%, 0.6234 and 0.5567, are within 0.0025 of the reference points in
//!   `shared/traces/README.md`.)
//! - The ghost of the victim is recorded in the `remove` that follows it; the directory is
//!   trimmed at the insert (`|T1| + |B1| <= c`, `|T1| + |T2| + |B1| + |B2| <= 2c`), which ends in
//!   the same state as the paper's case IV.
//! - The ghost table holds c + 1 keys: room for the victim's ghost before the insert that
//!   follows trims the directory (the paper trims before REPLACE). When it is full all the same
//!   (evictions while invalidated slots wait for a commit, or no insert after an eviction), the
//!   oldest ghost of B2 (or B1) makes room.
//!
//! Non-evictable slots are skipped in LRU order without being moved (they keep their recency);
//! if the list REPLACE chose has none evictable, the other list gives the victim.

use super::ghost::Ghosts;
use super::list::Lists;
use super::ReplacementPolicy;

const T1: usize = 0;
const T2: usize = 1;
const B1: usize = 0;
const B2: usize = 1;
const NO_SLOT: u32 = u32::MAX;

pub struct ArcPolicy {
    /// T1 and T2, by recency (oldest = LRU end).
    lists: Lists,
    keys: Vec<u64>,
    /// B1 and B2.
    ghosts: Ghosts,
    c: u32,
    /// Target size of T1, `0..=c`.
    p: u32,
    /// The slot the last `victim` returned, until the next call.
    victim: u32,
}

impl ArcPolicy {
    pub fn new(slots: u32) -> ArcPolicy {
        ArcPolicy {
            lists: Lists::new(slots as usize, 2),
            keys: vec![0; slots as usize],
            ghosts: Ghosts::new(slots + 1, 2),
            c: slots,
            p: 0,
            victim: NO_SLOT,
        }
    }

    /// The current target size of T1.
    pub fn target_t1(&self) -> u32 {
        self.p
    }

    fn first_evictable(&self, list: usize, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let mut s = self.lists.oldest(list);
        while let Some(slot) = s {
            if evictable(slot) {
                return Some(slot);
            }
            s = self.lists.newer(slot);
        }
        None
    }

    /// Records the ghost of an evicted slot of `list` (T1 -> B1, T2 -> B2).
    fn record_ghost(&mut self, list: usize, key: u64) {
        if self.ghosts.is_full() && !self.ghosts.pop_oldest(B2) {
            self.ghosts.pop_oldest(B1);
        }
        let ghost_list = if list == T1 { B1 } else { B2 };
        self.ghosts.push(ghost_list, key);
    }
}

impl ReplacementPolicy for ArcPolicy {
    fn insert(&mut self, slot: u32, key: u64) {
        if self.lists.contains(slot) {
            self.lists.unlink(slot);
        }
        self.victim = NO_SLOT;
        self.keys[slot as usize] = key;
        if let Some(e) = self.ghosts.find(key) {
            let (b1, b2) = (self.ghosts.len(B1), self.ghosts.len(B2));
            if self.ghosts.list_of(e) == B1 {
                self.p = (self.p + (b2 / b1).max(1)).min(self.c);
            } else {
                self.p = self.p.saturating_sub((b1 / b2).max(1));
            }
            self.ghosts.remove(e);
            self.lists.push_newest(T2, slot);
            return;
        }
        // A new key: keep the directory within the paper's bounds once it is in T1.
        let (t1, t2) = (self.lists.len(T1), self.lists.len(T2));
        let (b1, b2) = (self.ghosts.len(B1), self.ghosts.len(B2));
        if t1 + b1 >= self.c {
            self.ghosts.pop_oldest(B1);
        } else if t1 + t2 + b1 + b2 >= 2 * self.c {
            self.ghosts.pop_oldest(B2);
        }
        self.lists.push_newest(T1, slot);
    }

    fn touch(&mut self, slot: u32) {
        if self.lists.contains(slot) {
            self.victim = NO_SLOT;
            self.lists.move_to_newest(T2, slot);
        }
    }

    fn remove(&mut self, slot: u32) {
        let evicted = std::mem::replace(&mut self.victim, NO_SLOT) == slot;
        let Some(list) = self.lists.list_of(slot) else {
            return;
        };
        self.lists.unlink(slot);
        if evicted {
            self.record_ghost(list, self.keys[slot as usize]);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let t1 = self.lists.len(T1);
        let first = if t1 > 0 && (t1 > self.p || self.lists.len(T2) == 0) {
            T1
        } else {
            T2
        };
        let found = self
            .first_evictable(first, evictable)
            .or_else(|| self.first_evictable(1 - first, evictable));
        self.victim = found.unwrap_or(NO_SLOT);
        found
    }

    fn tracked(&self) -> u32 {
        self.lists.len(T1) + self.lists.len(T2)
    }

    fn name(&self) -> &'static str {
        "arc"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evict(a: &mut ArcPolicy) -> u32 {
        let v = a.victim(&mut |_| true).unwrap();
        a.remove(v);
        v
    }

    #[test]
    fn ghost_hit_in_b1_grows_p_and_in_b2_shrinks_it() {
        let mut a = ArcPolicy::new(4);
        for s in 0..4 {
            a.insert(s, 10 + u64::from(s));
        }
        a.touch(3); // T1 = {0, 1, 2}, T2 = {3}
        assert_eq!(evict(&mut a), 0); // key 10 -> B1
        a.insert(0, 20);
        assert_eq!(evict(&mut a), 1); // key 11 -> B1
        assert_eq!(a.target_t1(), 0);
        a.insert(1, 10); // B1 hit
        assert_eq!(a.target_t1(), 1);
        assert_eq!(a.lists.list_of(1), Some(T2));
        // T1 = {2, 0}, T2 = {3, 1}: |T1| > p, so T1 still gives the victim.
        assert_eq!(evict(&mut a), 2); // key 12 -> B1
        a.insert(2, 11); // B1 hit again
        assert_eq!(a.target_t1(), 2);
        // Now |T1| = 1 <= p: T2's LRU (slot 3, key 13) goes to B2.
        assert_eq!(evict(&mut a), 3);
        a.insert(3, 13); // B2 hit
        assert_eq!(a.target_t1(), 1);
    }

    #[test]
    fn a_scan_does_not_flush_the_frequent_set() {
        let c = 16;
        let mut a = ArcPolicy::new(c);
        let hot: Vec<u32> = (0..8).collect();
        for &s in &hot {
            a.insert(s, u64::from(s));
            a.touch(s);
        }
        for s in 8..c {
            a.insert(s, 1000 + u64::from(s));
        }
        for k in 0..1000u64 {
            let v = evict(&mut a);
            assert!(!hot.contains(&v), "scan evicted hot slot {v}");
            a.insert(v, 10_000 + k);
        }
        for &s in &hot {
            assert_eq!(a.lists.list_of(s), Some(T2));
        }
        // The scan left no reason to grow T1.
        assert_eq!(a.target_t1(), 0);
    }

    #[test]
    fn respects_the_predicate() {
        let mut a = ArcPolicy::new(4);
        for s in 0..4 {
            a.insert(s, u64::from(s));
        }
        a.touch(0);
        a.touch(1);
        // T1 = {2, 3} is preferred; with both busy T2 gives the victim.
        assert_eq!(a.victim(&mut |s| s < 2), Some(0));
        assert_eq!(a.victim(&mut |s| s == 3), Some(3));
        assert_eq!(a.victim(&mut |_| false), None);
        a.remove(3); // follows a None: an invalidation, no ghost
        assert_eq!(a.ghosts.len(B1) + a.ghosts.len(B2), 0);
        assert_eq!(a.tracked(), 3);
        assert_eq!(a.victim(&mut |s| s == 3), None);
    }
}
