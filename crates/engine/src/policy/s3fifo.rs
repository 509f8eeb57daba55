//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23): a small
//! FIFO S (10% of the slots) where new lines start, a main FIFO M (the rest), and a ghost FIFO
//! G of the keys recently evicted from S (90% of the slots). A hit only bumps a small
//! saturating counter; nothing moves on a hit.
//!
//! - Insert: a key found in G goes to M, any other to S; the counter starts at 0. G is
//!   looked up when the miss happens, before the eviction it causes records a ghost (as
//!   libCacheSim does): `victim(key)` takes the key out of G, so the victim's ghost can
//!   neither push it out of a full G nor find G without room, and the `insert` of that key
//!   that follows goes to M.
//! - Eviction from S (unless M holds more than its 90% or S is empty): the oldest line of S
//!   moves to M (counter cleared) if it was hit enough while in S, otherwise it is the victim
//!   and its key goes to G. So one-hit wonders leave from S after a short stay.
//! - Eviction from M: FIFO-reinsertion, the oldest line goes round again with its counter
//!   decremented while the counter is above 0, otherwise it is the victim (no ghost).
//!
//! The counter is 2 bits (0..=3, the paper's) for `s3fifo`, 1 bit (0..=1) for `s3fifo-1bit`:
//! with one bit a line in M survives one extra round per hit burst instead of up to three.
//! Promotion from S takes 2 hits with 2 bits, libCacheSim's current default
//! (`move-to-main-threshold=2`); promotion after 1 hit, the paper's description and the only
//! choice with 1 bit, gives a higher miss ratio on the ARC traces (P3 and P6 at 10%: 0.5948
//! and 0.4722 against 0.5840 and 0.4536 with 2 bits). `with_params` sets it. Sizes are
//! libCacheSim's defaults (`fifo-size-ratio=0.10,ghost-size-ratio=0.90`): S's share is
//! `floor(c / 10)` (at least 1), G holds `floor(0.9 c)` keys. With these `s3fifo` gives
//! libCacheSim's `S3FIFO` miss ratios (`bench/libcachesim/reference.csv`).
//!
//! The ghost of a victim from S is recorded in the `remove` that follows the `victim`.
//! A slot the engine cannot evict is moved on like a reinsertion (to the new end of its queue,
//! counter kept). The search does a bounded number of passes: a pass over M takes at most
//! (max counter + 1) rounds, after which every line left in M is unevictable, a pass over S
//! leaves only unevictable lines there, so at most M, S, M (when M is first) or S, M finds any
//! evictable slot, in O((max counter + 2) * slots) steps at worst.

use super::ghost::{fingerprint, Fingerprint, Ghosts};
use super::list::Lists;
use super::ReplacementPolicy;

const SMALL: usize = 0;
const MAIN: usize = 1;
const NO_SLOT: u32 = u32::MAX;

pub struct S3Fifo {
    queues: Lists,
    freq: Vec<u8>,
    /// The fingerprint of each slot's key, for its ghost (the engine holds the key itself).
    prints: Vec<Fingerprint>,
    ghosts: Ghosts,
    /// M's share of the slots: eviction takes from M when M holds more, or S is empty.
    main_target: u32,
    max_freq: u8,
    /// Hits in S that move a line to M.
    promote_after: u8,
    name: &'static str,
    /// The slot the last `victim` returned, until the next call.
    victim: u32,
    /// The key whose ghost the last `victim` took out of G, until its `insert`.
    ghost_hit: Option<u64>,
}

/// libCacheSim's `(int64_t)(c * 0.9)`, at least 1, in integers: for a u32 `c` the rounding
/// error of the double product is far too small to cross an integer, so both agree.
fn ghost_capacity(slots: u32) -> u32 {
    (u64::from(slots) * 9 / 10).max(1) as u32
}

impl S3Fifo {
    /// `bits` is the width of the access counter: 2 (the paper's) or 1. A line moves from S
    /// to M after 2 hits with 2 bits, after 1 with 1 bit.
    pub fn new(slots: u32, bits: u8) -> S3Fifo {
        S3Fifo::with_params(slots, bits, bits.min(2))
    }

    /// Like `new` with the number of hits in S that move a line to M (1 to the counter's
    /// maximum), for the simulator to explore.
    pub fn with_params(slots: u32, bits: u8, promote_after: u8) -> S3Fifo {
        assert!(bits == 1 || bits == 2, "S3-FIFO counter of {bits} bits");
        let max_freq = (1 << bits) - 1;
        assert!(
            (1..=max_freq).contains(&promote_after),
            "S3-FIFO promotion after {promote_after} hits with a {bits}-bit counter"
        );
        let small_target = (slots / 10).max(1);
        S3Fifo {
            queues: Lists::new(slots as usize, 2),
            freq: vec![0; slots as usize],
            prints: vec![0; slots as usize],
            ghosts: Ghosts::new(ghost_capacity(slots), 1),
            ghost_hit: None,
            main_target: slots - small_target.min(slots),
            max_freq,
            promote_after,
            name: if bits == 2 { "s3fifo" } else { "s3fifo-1bit" },
            victim: NO_SLOT,
        }
    }

    /// Looks once at each line in S: promotes the hit ones to M, returns the first evictable
    /// one, moves the others on.
    fn pass_small(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        for _ in 0..self.queues.len(SMALL) {
            let s = self.queues.oldest(SMALL)?;
            if self.freq[s as usize] >= self.promote_after {
                self.freq[s as usize] = 0;
                self.queues.move_to_newest(MAIN, s);
            } else if evictable(s) {
                return Some(s);
            } else {
                self.queues.move_to_newest(SMALL, s);
            }
        }
        None
    }

    /// FIFO-reinsertion over M until an evictable line with a zero counter comes up, for at
    /// most as many rounds as it takes to bring every counter to zero and look once more.
    fn pass_main(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let steps = self.queues.len(MAIN) * (u32::from(self.max_freq) + 1);
        for _ in 0..steps {
            let s = self.queues.oldest(MAIN)?;
            let f = &mut self.freq[s as usize];
            if *f > 0 {
                *f -= 1;
            } else if evictable(s) {
                return Some(s);
            }
            self.queues.move_to_newest(MAIN, s);
        }
        None
    }

    /// Forgets the ghost of `key`; false when there was none.
    fn take_ghost(&mut self, key: u64) -> bool {
        match self.ghosts.find(key) {
            Some(e) => {
                self.ghosts.remove(e);
                true
            }
            None => false,
        }
    }

    #[cfg(test)]
    fn queue_of(&self, slot: u32) -> Option<usize> {
        self.queues.list_of(slot)
    }
}

impl ReplacementPolicy for S3Fifo {
    fn insert(&mut self, slot: u32, key: u64) {
        self.queues.unlink(slot);
        self.victim = NO_SLOT;
        self.prints[slot as usize] = fingerprint(key);
        self.freq[slot as usize] = 0;
        let queue = if self.ghost_hit.take() == Some(key) || self.take_ghost(key) {
            MAIN
        } else {
            SMALL
        };
        self.queues.push_newest(queue, slot);
    }

    fn touch(&mut self, slot: u32) {
        if self.queues.contains(slot) {
            self.victim = NO_SLOT;
            let f = &mut self.freq[slot as usize];
            *f = (*f + 1).min(self.max_freq);
        }
    }

    fn remove(&mut self, slot: u32) {
        let evicted = std::mem::replace(&mut self.victim, NO_SLOT) == slot;
        let Some(queue) = self.queues.list_of(slot) else {
            return;
        };
        self.queues.unlink(slot);
        if evicted && queue == SMALL {
            if self.ghosts.is_full() {
                self.ghosts.pop_oldest(0);
            }
            self.ghosts.push_print(0, self.prints[slot as usize]);
        }
    }

    fn victim(&mut self, incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        if self.ghost_hit != Some(incoming) {
            self.ghost_hit = self.take_ghost(incoming).then_some(incoming);
        }
        let small_first = self.queues.len(SMALL) > 0 && self.queues.len(MAIN) <= self.main_target;
        let found = if small_first {
            self.pass_small(evictable)
                .or_else(|| self.pass_main(evictable))
        } else {
            self.pass_main(evictable)
                .or_else(|| self.pass_small(evictable))
                // Lines S just promoted.
                .or_else(|| self.pass_main(evictable))
        };
        self.victim = found.unwrap_or(NO_SLOT);
        found
    }

    fn tracked(&self) -> u32 {
        self.queues.len(SMALL) + self.queues.len(MAIN)
    }

    fn name(&self) -> &'static str {
        self.name
    }
}

#[cfg(test)]
mod tests {
    use super::super::simulate_hits;
    use super::*;
    use ssdcache_device::SplitMix64 as Rng;
    use std::collections::VecDeque;

    fn evict(p: &mut S3Fifo) -> u32 {
        let v = p.victim(u64::MAX, &mut |_| true).unwrap();
        p.remove(v);
        v
    }

    #[test]
    fn one_hit_wonders_leave_from_small_and_a_ghost_returns_to_main() {
        for bits in [1, 2] {
            // 20 slots: S's target is 2.
            let mut p = S3Fifo::new(20, bits);
            for s in 0..20 {
                p.insert(s, 100 + u64::from(s));
            }
            for _ in 0..p.promote_after {
                p.touch(0);
                p.touch(2);
            }
            // All in S. 0 was hit: it moves to M; 1 was not: it is the victim.
            assert_eq!(evict(&mut p), 1);
            assert_eq!(p.queue_of(0), Some(MAIN));
            assert_eq!(evict(&mut p), 3);
            assert_eq!(p.queue_of(2), Some(MAIN));
            // Key 101 (slot 1) is a ghost: when it comes back it goes to M.
            p.insert(1, 101);
            assert_eq!(p.queue_of(1), Some(MAIN));
            // Key 103 was evicted too, but a new key goes to S.
            p.insert(3, 999);
            assert_eq!(p.queue_of(3), Some(SMALL));
            // Invalidation leaves no ghost.
            p.remove(4);
            p.insert(4, 104);
            assert_eq!(p.queue_of(4), Some(SMALL));
        }
    }

    #[test]
    fn promotion_takes_two_hits_with_two_bits() {
        let mut p = S3Fifo::new(20, 2);
        for s in 0..20 {
            p.insert(s, u64::from(s));
        }
        p.touch(0);
        p.touch(1);
        p.touch(1);
        assert_eq!(evict(&mut p), 0);
        assert_eq!(evict(&mut p), 2);
        assert_eq!(p.queue_of(1), Some(MAIN));
        let mut p = S3Fifo::with_params(20, 2, 1);
        for s in 0..20 {
            p.insert(s, u64::from(s));
        }
        p.touch(0);
        assert_eq!(evict(&mut p), 1);
        assert_eq!(p.queue_of(0), Some(MAIN));
    }

    #[test]
    fn main_is_fifo_reinsertion_with_a_counter() {
        // Three hits buy a line in M three extra rounds with 2 bits, one with 1 bit.
        for (bits, rounds) in [(2u8, 3), (1, 1)] {
            let mut p = S3Fifo::new(10, bits);
            // Slots 0..=8 reach M through the ghost, slot 9 stays in S (its target is 1).
            for s in 0..9 {
                p.ghosts.push(0, u64::from(s));
                p.insert(s, u64::from(s));
                assert_eq!(p.queue_of(s), Some(MAIN));
            }
            p.insert(9, 9);
            for _ in 0..3 {
                p.touch(0);
            }
            // S is at its target, so S gives first: slot 9, a one-hit wonder.
            assert_eq!(evict(&mut p), 9);
            // From M, oldest first, each victim refilled with a key that goes to M: slot 0
            // goes round while its counter lasts, 8 evictions of the others per round.
            let mut others = 0;
            let mut key = 1000;
            loop {
                let v = evict(&mut p);
                if v == 0 {
                    break;
                }
                others += 1;
                key += 1;
                p.ghosts.push(0, key);
                p.insert(v, key);
                assert_eq!(p.queue_of(v), Some(MAIN));
            }
            assert_eq!(others, 8 * rounds, "{bits}-bit counter");
        }
    }

    #[test]
    fn respects_the_predicate() {
        let mut p = S3Fifo::new(10, 2);
        for s in 0..10 {
            p.insert(s, u64::from(s));
            p.touch(s);
            p.touch(s);
            p.touch(s);
        }
        assert_eq!(p.victim(u64::MAX, &mut |_| false), None);
        assert_eq!(p.tracked(), 10);
        // The hit lines went to M (counters cleared); only slot 7 may go.
        assert_eq!(p.victim(u64::MAX, &mut |s| s == 7), Some(7));
        p.remove(7);
        assert_eq!(p.victim(u64::MAX, &mut |s| s == 7), None);
        p.insert(7, 7);
        // Slot 7 in S (its ghost was not recorded: it left from M).
        assert_eq!(p.queue_of(7), Some(SMALL));
        assert_eq!(p.victim(u64::MAX, &mut |s| s == 3), Some(3));
    }

    /// libCacheSim's `S3FIFO.c` with its defaults, over keys: S and M are FIFOs of
    /// (key, counter), G a FIFO of keys; S holds `floor(0.1 c)`, G `floor(0.9 c)`.
    struct LibCacheSimS3Fifo {
        c: usize,
        main_share: usize,
        ghost_size: usize,
        small: VecDeque<(u64, u32)>,
        main: VecDeque<(u64, u32)>,
        ghost: VecDeque<u64>,
    }

    impl LibCacheSimS3Fifo {
        fn new(c: usize) -> LibCacheSimS3Fifo {
            LibCacheSimS3Fifo {
                c,
                main_share: c - c / 10,
                ghost_size: c * 9 / 10,
                small: VecDeque::new(),
                main: VecDeque::new(),
                ghost: VecDeque::new(),
            }
        }

        fn bump(queue: &mut VecDeque<(u64, u32)>, x: u64) -> bool {
            match queue.iter_mut().find(|(k, _)| *k == x) {
                Some((_, f)) => {
                    *f += 1;
                    true
                }
                None => false,
            }
        }

        /// True on a hit.
        fn access(&mut self, x: u64) -> bool {
            if Self::bump(&mut self.small, x) {
                return true;
            }
            let ghost_hit = match self.ghost.iter().position(|&k| k == x) {
                Some(i) => self.ghost.remove(i).is_some(),
                None => false,
            };
            if Self::bump(&mut self.main, x) {
                return true;
            }
            while self.small.len() + self.main.len() + 1 > self.c {
                if self.main.len() > self.main_share || self.small.is_empty() {
                    self.evict_main();
                } else {
                    self.evict_small();
                }
            }
            if ghost_hit {
                self.main.push_back((x, 0));
            } else {
                self.small.push_back((x, 0));
            }
            false
        }

        fn evict_small(&mut self) {
            while let Some((k, f)) = self.small.pop_front() {
                if f >= 2 {
                    self.main.push_back((k, 0));
                } else {
                    if self.ghost.len() == self.ghost_size {
                        self.ghost.pop_front();
                    }
                    self.ghost.push_back(k);
                    return;
                }
            }
        }

        fn evict_main(&mut self) {
            while let Some((k, f)) = self.main.pop_front() {
                if f >= 1 {
                    self.main.push_back((k, f.min(3) - 1));
                } else {
                    return;
                }
            }
        }
    }

    #[test]
    fn two_bits_hits_exactly_as_libcachesim() {
        // From 20 slots up: below, libCacheSim's S of fewer than 2 objects admits nothing.
        for c in [20u32, 21, 37, 64, 150] {
            for seed in 0..10 {
                let mut rng = Rng(seed);
                let universe = u64::from(c) * 5;
                let keys: Vec<u64> = (0..8000)
                    .map(|i| {
                        if rng.next_u64().is_multiple_of(3) {
                            (i / 3) % universe // a slow scan
                        } else {
                            let r = rng.unit();
                            (r * r * r * universe as f64) as u64
                        }
                    })
                    .collect();
                let mut model = LibCacheSimS3Fifo::new(c as usize);
                let expected = keys.iter().filter(|&&k| model.access(k)).count() as u64;
                let mut p = S3Fifo::new(c, 2);
                let (hits, _) = simulate_hits(&mut p, c, keys.iter().copied());
                assert_eq!(hits, expected, "c {c} seed {seed}");
            }
        }
    }
}
