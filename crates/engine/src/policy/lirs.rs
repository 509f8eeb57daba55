//! LIRS, low inter-reference recency set (Jiang and Zhang, SIGMETRICS'02): the scan-resistant
//! policy of the set.
//!
//! Why LIRS and not an SMQ-like multiqueue: dm-cache's smq owes most of its scan resistance to
//! its hotspot queue, which decides whether a block is promoted into the cache at all; in
//! ssdcache that decision belongs to admission (`admission.rs`), and the replacement part of
//! smq alone (multiqueue levels by hit count, periodic redistribution) behaves like LRU on a
//! scan or a loop until hits sort the levels out, and needs tuning of its level count and
//! period. LIRS is a replacement policy only, O(1) per call, with one parameter (the HIR
//! share, 1%), and it resists both one-time scans and loops larger than the cache: a line
//! only becomes LIR (protected, 99% of the slots) by being re-referenced sooner than the least
//! recent LIR line, so a scan only cycles through the 1% of HIR slots, and a loop of N + 1
//! lines over N slots keeps N - 1 of them. It needs ghosts (non-resident HIR entries) and
//! the trace set has the LIRS paper's traces (`shared/traces/lirs`) to check it against.
//!
//! Structure: the stack S holds, by recency, LIR lines, resident HIR lines and ghosts
//! (non-resident HIR keys), with a LIR line at its bottom (pruning drops HIR entries from the
//! bottom); the queue Q holds the resident HIR lines, victims first. Nodes of S are slots
//! `0..slots` and ghost entries `slots..2 * slots` (the ghost table holds `slots` key
//! fingerprints, `ghost.rs`; when it is full the oldest ghost is forgotten, which only makes
//! LIRS forget a long reuse distance).
//!
//! RAM per slot, at full occupancy: S 16 bytes (two 4-byte links for the slot and for its
//! ghost entry), Q 8, the key's 4-byte fingerprint, the ghost table 20 (links 8, fingerprint
//! 4, index 8): 48 bytes. It was 65 (at 1 M slots) with 8-byte keys per slot and per ghost, a
//! list byte per node, a state byte per slot, a free-entry stack and a power-of-two ghost
//! index.
//!
//! The engine's calls: `insert` is a miss (a key found among the ghosts becomes LIR), `touch`
//! a hit, `remove` after `victim` turns the victim into a ghost where it stood in S, any other
//! `remove` drops the slot without a ghost. `victim(key)` looks the missed key up first and
//! takes its ghost out of S: the paper settles the missed block's status (a non-resident HIR
//! block in S or not) before the eviction, and here the eviction could otherwise change it, as
//! the victim's ghost, pushed into a full ghost table, would forget the oldest ghost, which may
//! be the missed key's (a scan followed by a re-read of its start does exactly that). While fewer than the LIR target are LIR (warm-up,
//! or after invalidations) new lines become LIR. The victim is the first evictable line of
//! Q; unevictable ones are moved on to Q's end. If Q has none, the least recent evictable LIR
//! line goes (walking up from the bottom of S); it leaves a ghost like any victim.

use super::ghost::{fingerprint, Fingerprint, Ghosts};
use super::list::Lists;
use super::ReplacementPolicy;

const ONLY: usize = 0;
const NO_SLOT: u32 = u32::MAX;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Free,
    Lir,
    /// Resident HIR: in Q, maybe in S.
    Hir,
}

pub struct Lirs {
    stack: Lists,
    queue: Lists,
    /// The fingerprint of each slot's key, for its ghost when it is evicted (the engine holds
    /// the key itself; a policy needs no more of it than a ghost keeps).
    prints: Vec<Fingerprint>,
    ghosts: Ghosts,
    slots: u32,
    lir_target: u32,
    lir_count: u32,
    /// The slot the last `victim` returned, until the next call.
    victim: u32,
    /// The key whose ghost the last `victim` took out of S, until its `insert`.
    ghost_hit: Option<u64>,
}

impl Lirs {
    pub fn new(slots: u32) -> Lirs {
        let hir_target = (slots / 100).max(1);
        Lirs {
            stack: Lists::new(2 * slots as usize, 1),
            queue: Lists::new(slots as usize, 1),
            prints: vec![0; slots as usize],
            ghosts: Ghosts::new(slots, 1),
            slots,
            lir_target: slots.saturating_sub(hir_target),
            lir_count: 0,
            victim: NO_SLOT,
            ghost_hit: None,
        }
    }

    fn is_ghost(&self, node: u32) -> bool {
        node >= self.slots
    }

    /// Drops HIR entries (resident or ghosts) from the bottom of S until a LIR line is there.
    fn prune(&mut self) {
        while let Some(n) = self.stack.oldest(ONLY) {
            if self.is_ghost(n) {
                self.stack.unlink(n);
                self.ghosts.remove(n - self.slots);
            } else if self.state(n) == State::Hir {
                self.stack.unlink(n);
            } else {
                break;
            }
        }
    }

    /// Turns LIR lines from the bottom of S into resident HIR lines until there are no more
    /// than the target.
    fn demote_excess(&mut self) {
        while self.lir_count > self.lir_target {
            let Some(b) = self.stack.oldest(ONLY) else {
                break;
            };
            debug_assert_eq!(self.state(b), State::Lir);
            self.stack.unlink(b);
            self.lir_count -= 1;
            self.queue.push_newest(ONLY, b);
            self.prune();
        }
    }

    fn make_lir(&mut self, slot: u32) {
        self.lir_count += 1;
        self.queue.unlink(slot);
        self.stack.move_to_newest(ONLY, slot);
    }

    /// Takes the ghost of `key` out of S; false when there was none. Its place in S does not
    /// matter once it is found: a ghost hit moves the line to the top of S.
    fn take_ghost(&mut self, key: u64) -> bool {
        match self.ghosts.find(key) {
            Some(e) => {
                self.stack.unlink(self.slots + e);
                self.ghosts.remove(e);
                true
            }
            None => false,
        }
    }

    /// Leaves a ghost of `slot`'s key in its place in S.
    fn leave_ghost(&mut self, slot: u32) {
        if self.ghosts.is_full() {
            let oldest = self.ghosts.oldest(ONLY).expect("a full table has entries");
            self.stack.unlink(self.slots + oldest);
            self.ghosts.remove(oldest);
        }
        let e = self.ghosts.push_print(ONLY, self.prints[slot as usize]);
        self.stack.replace(slot, self.slots + e);
    }

    /// A slot's state, read from the lists rather than stored: the resident HIR lines are
    /// exactly those in Q, every LIR line is in S (only a demotion or a removal takes one
    /// out), and a free slot is in neither.
    fn state(&self, slot: u32) -> State {
        if slot >= self.slots {
            State::Free // a ghost's node number, not a slot
        } else if self.queue.contains(slot) {
            State::Hir
        } else if self.stack.contains(slot) {
            State::Lir
        } else {
            State::Free
        }
    }

    #[cfg(test)]
    fn state_of(&self, slot: u32) -> State {
        self.state(slot)
    }

    /// Review 27: LIR (true), resident HIR (false), untracked (None); and whether a slot's
    /// node is in S.
    #[cfg(test)]
    pub(crate) fn review_state(&self, slot: u32) -> (Option<bool>, bool) {
        let st = match self.state(slot) {
            State::Free => None,
            State::Lir => Some(true),
            State::Hir => Some(false),
        };
        (st, self.stack.contains(slot))
    }

    /// Review 27: whether `key` has a ghost, and whether the ghost table is full.
    #[cfg(test)]
    pub(crate) fn review_ghost(&self, key: u64) -> (bool, bool) {
        (self.ghosts.find(key).is_some(), self.ghosts.is_full())
    }
}

impl ReplacementPolicy for Lirs {
    fn insert(&mut self, slot: u32, key: u64) {
        self.victim = NO_SLOT;
        if self.state(slot) != State::Free {
            self.remove(slot);
        }
        self.prints[slot as usize] = fingerprint(key);
        if self.ghost_hit.take() == Some(key) || self.take_ghost(key) {
            // Its reuse distance beat the least recent LIR line's: it becomes LIR.
            self.make_lir(slot);
            self.demote_excess();
        } else if self.lir_count < self.lir_target {
            self.make_lir(slot);
        } else {
            self.stack.push_newest(ONLY, slot);
            self.queue.push_newest(ONLY, slot);
        }
        self.prune();
    }

    fn touch(&mut self, slot: u32) {
        match self.state(slot) {
            State::Lir => {
                self.victim = NO_SLOT;
                self.stack.move_to_newest(ONLY, slot);
                self.prune();
            }
            State::Hir => {
                self.victim = NO_SLOT;
                if self.stack.contains(slot) {
                    self.make_lir(slot);
                    self.demote_excess();
                    self.prune();
                } else {
                    self.stack.push_newest(ONLY, slot);
                    self.queue.move_to_newest(ONLY, slot);
                    self.prune(); // no LIR line below it when there is none at all
                }
            }
            State::Free => {}
        }
    }

    fn remove(&mut self, slot: u32) {
        let evicted = std::mem::replace(&mut self.victim, NO_SLOT) == slot;
        let state = self.state(slot);
        if state == State::Free {
            return;
        }
        self.queue.unlink(slot);
        if state == State::Lir {
            self.lir_count -= 1;
        }
        if self.stack.contains(slot) {
            if evicted {
                self.leave_ghost(slot);
            } else {
                self.stack.unlink(slot);
            }
        }
        self.prune();
    }

    fn victim(&mut self, incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.victim = NO_SLOT;
        if self.ghost_hit != Some(incoming) {
            self.ghost_hit = self.take_ghost(incoming).then_some(incoming);
        }
        for _ in 0..self.queue.len(ONLY) {
            let s = self.queue.oldest(ONLY)?;
            if evictable(s) {
                self.victim = s;
                return Some(s);
            }
            self.queue.move_to_newest(ONLY, s);
        }
        let mut n = self.stack.oldest(ONLY);
        while let Some(node) = n {
            if self.state(node) == State::Lir && evictable(node) {
                self.victim = node;
                return Some(node);
            }
            n = self.stack.newer(node);
        }
        None
    }

    fn tracked(&self) -> u32 {
        self.lir_count + self.queue.len(ONLY)
    }

    fn name(&self) -> &'static str {
        "lirs"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evict(p: &mut Lirs) -> u32 {
        let v = p.victim(u64::MAX, &mut |_| true).unwrap();
        p.remove(v);
        v
    }

    #[test]
    fn warm_up_fills_lir_then_new_lines_are_hir() {
        // 100 slots: 99 LIR, 1 HIR.
        let mut p = Lirs::new(100);
        for s in 0..100 {
            p.insert(s, u64::from(s));
        }
        assert!((0..99).all(|s| p.state_of(s) == State::Lir));
        assert_eq!(p.state_of(99), State::Hir);
        assert_eq!(p.tracked(), 100);
    }

    #[test]
    fn a_scan_only_cycles_through_the_hir_slots() {
        let mut p = Lirs::new(100);
        for s in 0..100 {
            p.insert(s, u64::from(s));
        }
        for k in 0..10_000u64 {
            let v = evict(&mut p);
            assert_eq!(v, 99, "the scan evicted a LIR line");
            p.insert(v, 1000 + k);
        }
        assert!((0..99).all(|s| p.state_of(s) == State::Lir));
    }

    #[test]
    fn a_ghost_hit_becomes_lir_and_demotes_the_bottom() {
        let mut p = Lirs::new(100);
        for s in 0..100 {
            p.insert(s, u64::from(s));
        }
        // Slot 99 (key 99, HIR) is evicted and leaves a ghost above every LIR line but the
        // ones touched after it.
        p.touch(5);
        assert_eq!(evict(&mut p), 99);
        p.insert(99, 99);
        assert_eq!(p.state_of(99), State::Lir);
        // The bottom LIR line (slot 0, least recent) was demoted to HIR.
        assert_eq!(p.state_of(0), State::Hir);
        assert_eq!(evict(&mut p), 0);
    }

    #[test]
    fn a_miss_on_the_oldest_ghost_of_a_full_table_still_becomes_lir() {
        let mut p = Lirs::new(100);
        for s in 0..100 {
            p.insert(s, u64::from(s));
        }
        // A scan through the HIR slot leaves 100 ghosts (keys 99, 1000..1099), all above the
        // bottom LIR line: the ghost table (100 keys) is full and key 99 is its oldest.
        for k in 0..100 {
            assert_eq!(evict(&mut p), 99);
            p.insert(99, 1000 + k);
        }
        assert!(p.ghosts.is_full());
        // Key 99 misses: its ghost counts although the victim's ghost needs room.
        let v = p.victim(99, &mut |_| true).unwrap();
        assert_eq!(v, 99);
        p.remove(v);
        p.insert(v, 99);
        assert_eq!(p.state_of(99), State::Lir);
        assert_eq!(p.state_of(0), State::Hir, "the bottom LIR line was demoted");
        // The victim (key 1099) left a ghost: it comes back as LIR too.
        let v = p.victim(1099, &mut |_| true).unwrap();
        assert_eq!(v, 0);
        p.remove(v);
        p.insert(v, 1099);
        assert_eq!(p.state_of(0), State::Lir);
    }

    #[test]
    fn a_resident_hir_hit_in_the_stack_becomes_lir() {
        let mut p = Lirs::new(100);
        for s in 0..100 {
            p.insert(s, u64::from(s));
        }
        p.touch(99); // HIR in S: becomes LIR, slot 0 demoted
        assert_eq!(p.state_of(99), State::Lir);
        assert_eq!(p.state_of(0), State::Hir);
        // Slot 0 is now HIR but not in S (pruned): a hit keeps it HIR, at Q's end.
        p.touch(0);
        assert_eq!(p.state_of(0), State::Hir);
        p.touch(1);
        p.touch(0); // in S again and more recent than slot 2, the bottom LIR: promoted
        assert_eq!(p.state_of(0), State::Lir);
        assert_eq!(p.state_of(2), State::Hir);
    }

    #[test]
    fn respects_the_predicate() {
        let mut p = Lirs::new(100);
        for s in 0..100 {
            p.insert(s, u64::from(s));
        }
        assert_eq!(p.victim(u64::MAX, &mut |_| false), None);
        // Q (slot 99) is busy: the least recent evictable LIR line goes.
        assert_eq!(p.victim(u64::MAX, &mut |s| s != 99 && s >= 10), Some(10));
        p.remove(10);
        assert_eq!(p.tracked(), 99);
        assert_eq!(p.victim(u64::MAX, &mut |s| s == 10), None);
        // Invalidation of the HIR line, then every slot: nothing left.
        for s in 0..100 {
            p.remove(s);
        }
        assert_eq!(p.tracked(), 0);
        assert_eq!(p.victim(u64::MAX, &mut |_| true), None);
    }
}
