//! ARC, adaptive replacement cache (Megiddo and Modha, FAST'03). Two LRU lists of resident
//! slots, T1 (seen once since they entered) and T2 (seen again), and two ghost lists of
//! evicted keys, B1 (evicted from T1) and B2 (evicted from T2). `p` is the target size of T1:
//! a miss on a key in B1 says T1 was too small and grows it, one in B2 shrinks it. A one-time
//! scan only passes through T1, so it cannot flush T2 (scan resistance); a loop longer than the
//! cache, on the other hand, gets no hits, as with LRU (every key of the loop is in T1 and
//! ARC drops T1's evictions without a ghost when T1 fills the cache).
//!
//! The paper's algorithm step by step, as libCacheSim's `ARC.c` does it (same miss ratios on
//! the shared traces, see `bench/libcachesim/`): `p` is a real number, the adaptation step
//! is `max(|B2| / |B1|, 1)` (or `max(|B1| / |B2|, 1)`) with the hit ghost still counted, and
//! REPLACE evicts from T1 when `|T1| > 0` and (`|T1| > p`, or `|T1| = p` and the missing key
//! is in B2), or when T2 is empty.
//!
//! How the engine's calls map onto the paper: `victim(x)` is a miss on `x` in a full cache.
//! If `x` is a ghost, its case (II or III) is applied there (adapt `p`, forget the ghost) and
//! REPLACE picks the victim; otherwise case IV trims the directory (the LRU ghost of B1 when
//! `|T1| + |B1| = c`, that of B2 when the directory holds 2c) and REPLACE picks the victim,
//! except when T1 alone fills L1 (B1 empty): then T1's LRU goes without a ghost. The ghost of
//! the victim is recorded in the `remove` that follows. `insert(x)` puts a ghost hit in T2 and
//! a new key in T1; an `insert` with no `victim` before it (a free slot) applies case II or III
//! there, without REPLACE, as libCacheSim does when the cache is not full.
//!
//! Calls beyond the paper: when the engine asks for a victim again for the same key (the slot
//! it released did not become free), each call is one more eviction, as libCacheSim's evict
//! loop. A ghost hit already applied is not applied twice; if its `insert` never comes, the
//! ghost is simply forgotten. Non-evictable slots are skipped in LRU order without being
//! moved (they keep their recency); if the list REPLACE chose has none evictable, the other
//! list gives the victim. The ghost table holds c + 1 keys; when it is full all the same
//! (evictions while invalidated slots wait for a commit), the oldest ghost of B2 (or B1) makes
//! room.

use super::ghost::Ghosts;
use super::list::Lists;
use super::ReplacementPolicy;

const T1: usize = 0;
const T2: usize = 1;
const B1: usize = 0;
const B2: usize = 1;
const NO_SLOT: u32 = u32::MAX;

/// A miss on a key found among the ghosts, already applied by `victim` (its ghost is gone and
/// `p` adapted), waiting for the `insert` of the key.
#[derive(Clone, Copy)]
struct GhostHit {
    key: u64,
    list: usize,
}

pub struct ArcPolicy {
    /// T1 and T2, by recency (oldest = LRU end).
    lists: Lists,
    keys: Vec<u64>,
    /// B1 and B2.
    ghosts: Ghosts,
    c: u32,
    /// Target size of T1, `0.0..=c`.
    p: f64,
    /// The slot the last `victim` returned, until the next call.
    victim: u32,
    /// Whether that victim leaves a ghost (not when T1 alone fills L1).
    victim_leaves_ghost: bool,
    ghost_hit: Option<GhostHit>,
}

impl ArcPolicy {
    pub fn new(slots: u32) -> ArcPolicy {
        ArcPolicy {
            lists: Lists::new(slots as usize, 2),
            keys: vec![0; slots as usize],
            ghosts: Ghosts::new(slots + 1, 2),
            c: slots,
            p: 0.0,
            victim: NO_SLOT,
            victim_leaves_ghost: false,
            ghost_hit: None,
        }
    }

    /// The current target size of T1.
    pub fn target_t1(&self) -> f64 {
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

    /// Cases II and III: a miss on `key`, a ghost of `list`, adapts `p`; the ghost is
    /// forgotten (the key is about to be resident).
    fn apply_ghost_hit(&mut self, entry: u32, key: u64) -> GhostHit {
        let list = self.ghosts.list_of(entry);
        let (b1, b2) = (
            f64::from(self.ghosts.len(B1)),
            f64::from(self.ghosts.len(B2)),
        );
        let c = f64::from(self.c);
        self.p = if list == B1 {
            (self.p + (b2 / b1).max(1.0)).min(c)
        } else {
            (self.p - (b1 / b2).max(1.0)).max(0.0)
        };
        self.ghosts.remove(entry);
        GhostHit { key, list }
    }

    /// The list REPLACE takes the victim from, for a miss on a key in B2 or not.
    fn replace_from(&self, missing_in_b2: bool) -> usize {
        let t1 = self.lists.len(T1);
        let t1_size = f64::from(t1);
        let t1_over_target = t1_size > self.p || (t1_size == self.p && missing_in_b2);
        if (t1 > 0 && t1_over_target) || self.lists.len(T2) == 0 {
            T1
        } else {
            T2
        }
    }

    /// Case IV's directory trimming before REPLACE; false when T1 alone fills L1 and its LRU
    /// must go without a ghost.
    fn trim_for_new_key(&mut self) -> bool {
        let (t1, t2) = (self.lists.len(T1), self.lists.len(T2));
        let (b1, b2) = (self.ghosts.len(B1), self.ghosts.len(B2));
        if t1 + b1 >= self.c {
            // Case IV(A): L1 holds c pages.
            return self.ghosts.pop_oldest(B1);
        }
        if t1 + t2 + b1 + b2 >= 2 * self.c {
            self.ghosts.pop_oldest(B2);
        }
        true
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
        let applied = self.ghost_hit.take().filter(|hit| hit.key == key);
        let was_ghost = applied.is_some()
            || match self.ghosts.find(key) {
                Some(entry) => {
                    self.apply_ghost_hit(entry, key);
                    true
                }
                None => false,
            };
        self.lists
            .push_newest(if was_ghost { T2 } else { T1 }, slot);
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
        if evicted && self.victim_leaves_ghost {
            self.record_ghost(list, self.keys[slot as usize]);
        }
    }

    fn victim(&mut self, incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        if self.ghost_hit.is_some_and(|hit| hit.key != incoming) {
            self.ghost_hit = None;
        }
        if self.ghost_hit.is_none() {
            if let Some(entry) = self.ghosts.find(incoming) {
                self.ghost_hit = Some(self.apply_ghost_hit(entry, incoming));
            }
        }
        let (first, leaves_ghost) = match self.ghost_hit {
            Some(hit) => (self.replace_from(hit.list == B2), true),
            None => {
                if self.trim_for_new_key() {
                    (self.replace_from(false), true)
                } else {
                    (T1, false)
                }
            }
        };
        let found = self
            .first_evictable(first, evictable)
            .or_else(|| self.first_evictable(1 - first, evictable));
        self.victim = found.unwrap_or(NO_SLOT);
        self.victim_leaves_ghost = leaves_ghost;
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
    use super::super::simulate_hits;
    use super::*;
    use ssdcache_device::SplitMix64 as Rng;
    use std::collections::VecDeque;

    /// A miss on `key` in a full cache, the way the engine drives it; returns the victim.
    fn miss(a: &mut ArcPolicy, key: u64) -> u32 {
        let v = a.victim(key, &mut |_| true).unwrap();
        a.remove(v);
        a.insert(v, key);
        v
    }

    fn keys_of(a: &ArcPolicy, list: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut s = a.lists.oldest(list);
        while let Some(slot) = s {
            out.push(a.keys[slot as usize]);
            s = a.lists.newer(slot);
        }
        out
    }

    #[test]
    fn ghost_hits_adapt_p_before_replace_and_b2_wins_the_tie() {
        let mut a = ArcPolicy::new(4);
        for s in 0..4 {
            a.insert(s, 10 + u64::from(s));
        }
        a.touch(3); // T1 = [10, 11, 12], T2 = [13]
        assert_eq!(miss(&mut a, 20), 0); // 10 -> B1
                                         // B1 hit: p = 1 before REPLACE, |T1| = 3 > 1: 11 -> B1.
        assert_eq!(miss(&mut a, 10), 1);
        assert_eq!(a.target_t1(), 1.0);
        assert_eq!(keys_of(&a, T2), [13, 10]);
        // B1 hit: p = 2 = |T1|, the key is not in B2: T2 gives 13 -> B2.
        assert_eq!(miss(&mut a, 11), 3);
        assert_eq!(a.target_t1(), 2.0);
        assert_eq!(keys_of(&a, T1), [12, 20]);
        // B2 hit: p = 1 < |T1| = 2: 12 -> B1.
        assert_eq!(miss(&mut a, 13), 2);
        assert_eq!(a.target_t1(), 1.0);
        // B1 hit: p = 2 > |T1| = 1: T2 gives 10 -> B2.
        assert_eq!(miss(&mut a, 12), 1);
        assert_eq!(a.target_t1(), 2.0);
        assert_eq!(keys_of(&a, T1), [20]);
        // B2 hit: p = 1 = |T1| and the key is in B2: the paper's tie rule takes T1's 20.
        assert_eq!(miss(&mut a, 10), 0);
        assert_eq!(a.target_t1(), 1.0);
        assert_eq!(keys_of(&a, T1), Vec::<u64>::new());
        assert_eq!(keys_of(&a, T2), [11, 13, 12, 10]);
    }

    #[test]
    fn t1_filling_l1_evicts_without_a_ghost_and_a_full_l1_drops_b1s_oldest() {
        let mut a = ArcPolicy::new(2);
        a.insert(0, 1);
        a.insert(1, 2);
        assert_eq!(miss(&mut a, 3), 0); // |T1| = c: 1 leaves no ghost
        assert_eq!(a.ghosts.len(B1) + a.ghosts.len(B2), 0);
        a.touch(1); // T1 = [3], T2 = [2]
        assert_eq!(miss(&mut a, 4), 0); // |T1| + |B1| = 1 < c: REPLACE, 3 -> B1
        assert_eq!(a.ghosts.len(B1), 1);
        // |T1| + |B1| = c with B1 not empty: B1's oldest (3) goes, then REPLACE (4 -> B1).
        assert_eq!(miss(&mut a, 5), 0);
        assert!(a.ghosts.find(3).is_none());
        assert!(a.ghosts.find(4).is_some());
    }

    #[test]
    fn asking_again_for_the_same_key_applies_its_ghost_hit_once() {
        let mut a = ArcPolicy::new(3);
        for s in 0..3 {
            a.insert(s, u64::from(s));
        }
        a.touch(2);
        assert_eq!(miss(&mut a, 7), 0); // key 0 -> B1
        let v = a.victim(0, &mut |_| true).unwrap();
        assert_eq!((v, a.target_t1()), (1, 1.0));
        a.remove(v);
        // The slot did not come free (it waits for a commit): the engine asks again.
        let w = a.victim(0, &mut |_| true).unwrap();
        assert_ne!(v, w);
        assert_eq!(a.target_t1(), 1.0);
        a.remove(w);
        a.insert(w, 0);
        assert_eq!(a.lists.list_of(w), Some(T2));
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
            let v = miss(&mut a, 10_000 + k);
            assert!(!hot.contains(&v), "scan evicted hot slot {v}");
        }
        for &s in &hot {
            assert_eq!(a.lists.list_of(s), Some(T2));
        }
        // The scan left no reason to grow T1.
        assert_eq!(a.target_t1(), 0.0);
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
        assert_eq!(a.victim(9, &mut |s| s < 2), Some(0));
        assert_eq!(a.victim(9, &mut |s| s == 3), Some(3));
        assert_eq!(a.victim(9, &mut |_| false), None);
        a.remove(3); // follows a None: an invalidation, no ghost
        assert_eq!(a.ghosts.len(B1) + a.ghosts.len(B2), 0);
        assert_eq!(a.tracked(), 3);
        assert_eq!(a.victim(9, &mut |s| s == 3), None);
    }

    /// ARC as the paper's pseudo-code (Megiddo and Modha, FAST'03, Fig. 4) over keys, lists
    /// oldest first; plus libCacheSim's guard that REPLACE takes T1 when T2 is empty.
    struct PaperArc {
        c: usize,
        p: f64,
        t1: VecDeque<u64>,
        t2: VecDeque<u64>,
        b1: VecDeque<u64>,
        b2: VecDeque<u64>,
    }

    fn take(list: &mut VecDeque<u64>, x: u64) -> bool {
        match list.iter().position(|&k| k == x) {
            Some(i) => list.remove(i).is_some(),
            None => false,
        }
    }

    impl PaperArc {
        fn new(c: usize) -> PaperArc {
            PaperArc {
                c,
                p: 0.0,
                t1: VecDeque::new(),
                t2: VecDeque::new(),
                b1: VecDeque::new(),
                b2: VecDeque::new(),
            }
        }

        fn replace(&mut self, x_in_b2: bool) {
            let t1 = self.t1.len() as f64;
            let from_t1 = !self.t1.is_empty() && ((x_in_b2 && t1 == self.p) || t1 > self.p);
            if from_t1 || self.t2.is_empty() {
                let k = self.t1.pop_front().unwrap();
                self.b1.push_back(k);
            } else {
                let k = self.t2.pop_front().unwrap();
                self.b2.push_back(k);
            }
        }

        /// True on a hit.
        fn access(&mut self, x: u64) -> bool {
            if take(&mut self.t1, x) || take(&mut self.t2, x) {
                self.t2.push_back(x);
                return true;
            }
            let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
            if take(&mut self.b1, x) {
                let delta = if b1 >= b2 { 1.0 } else { b2 / b1 };
                self.p = (self.p + delta).min(self.c as f64);
                self.replace(false);
                self.t2.push_back(x);
                return false;
            }
            if take(&mut self.b2, x) {
                let delta = if b2 >= b1 { 1.0 } else { b1 / b2 };
                self.p = (self.p - delta).max(0.0);
                self.replace(true);
                self.t2.push_back(x);
                return false;
            }
            let l1 = self.t1.len() + self.b1.len();
            if l1 == self.c {
                if self.t1.len() < self.c {
                    self.b1.pop_front();
                    self.replace(false);
                } else {
                    self.t1.pop_front();
                }
            } else {
                let total = l1 + self.t2.len() + self.b2.len();
                if total >= self.c {
                    if total == 2 * self.c {
                        self.b2.pop_front();
                    }
                    self.replace(false);
                }
            }
            self.t1.push_back(x);
            false
        }
    }

    /// Streams with reuse at all distances: a hot set, loops and a scan, over a universe a few
    /// times the cache so the ghosts are hit from both lists.
    fn mixed_stream(c: u32, len: usize, seed: u64) -> Vec<u64> {
        let mut rng = Rng(seed);
        let universe = u64::from(c) * 4;
        let mut keys = Vec::with_capacity(len);
        while keys.len() < len {
            match rng.next_u64() % 4 {
                0 => {
                    let start = rng.next_u64() % universe;
                    let n = rng.next_u64() % (u64::from(c) * 2) + 1;
                    keys.extend((start..start + n).map(|k| k % universe));
                }
                1 => keys.push(rng.next_u64() % (u64::from(c) / 2 + 1)),
                _ => {
                    let r = rng.unit();
                    keys.push((r * r * r * universe as f64) as u64);
                }
            }
        }
        keys.truncate(len);
        keys
    }

    #[test]
    fn hits_exactly_as_the_paper() {
        for c in [1u32, 2, 3, 5, 8, 13, 40, 101] {
            for seed in 0..12 {
                let keys = mixed_stream(c, 6000, seed);
                let mut model = PaperArc::new(c as usize);
                let expected = keys.iter().filter(|&&k| model.access(k)).count() as u64;
                let mut a = ArcPolicy::new(c);
                let (hits, misses) = simulate_hits(&mut a, c, keys.iter().copied());
                assert_eq!(
                    (hits, misses),
                    (expected, 6000 - expected),
                    "c {c} seed {seed}"
                );
                assert_eq!(a.target_t1(), model.p, "c {c} seed {seed}");
                assert_eq!(keys_of(&a, T1), Vec::from(model.t1.clone()));
                assert_eq!(keys_of(&a, T2), Vec::from(model.t2.clone()));
            }
        }
    }
}
