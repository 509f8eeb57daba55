//! Which line lives in which cache slot, and which slot goes next: the one map/victim
//! implementation the engine, the simulator and the policy tests share.
//!
//! Every slot is in exactly one of these places:
//! - **free**: on the free list, holding no line;
//! - **clean**: ranked by the replacement policy, which names victims among these only;
//! - **dirty**: holding data the backing device does not have yet, ranked by last use in a
//!   queue of its own; the oldest are the ones the cleaner writes back first under dirty
//!   pressure (`coldest_dirty`), since they are the ones the policy would evict next;
//! - **held**: clean, but the durable metadata may still call it dirty (a crash would bring
//!   that record back), so it waits for the next commit before it may be evicted.
//!
//! This is how dm-cache's smq keeps clean and dirty lines in separate queues: a victim is the
//! policy's first choice among lines that can go, found in O(1) however many lines are dirty
//! (the only lines a victim search steps over are those a request holds at that moment, a
//! number bounded by the requests in flight). A line that becomes dirty leaves the policy
//! (without a ghost: it was not evicted) and comes back as a new line when it is clean again.
//!
//! Everything is allocated at construction (the index with room for every slot, `SlotIndex`),
//! so nothing rehashes or grows under load. The free list is threaded through the same
//! per-slot links as the dirty queue and the held list (a slot is in at most one of them), so
//! it costs no memory of its own. The engine's index uses the standard library's
//! keyed hasher (the keys come from client offsets, so a fixed hash could be steered into
//! collisions); the simulator, which reads traces, may use a faster one.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use crate::locks::LineKey;
use crate::policy::list::Lists;
use crate::policy::ReplacementPolicy;
use crate::slot_index::SlotIndex;

/// The key of a slot that holds no line.
pub const NO_KEY: LineKey = u64::MAX;

/// Where a mapped slot stands (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    Clean,
    Dirty,
    Held,
}

const DIRTY: usize = 0;
const HELD: usize = 1;
const FREE: usize = 2;

/// `'p`: how long the policy lives (`'static` but for a replay of a borrowed policy).
pub struct Residency<'p, S = RandomState> {
    /// Key to slot; compares against `keys`.
    index: SlotIndex<S>,
    /// The key each slot holds, `NO_KEY` when free.
    keys: Vec<LineKey>,
    /// Ranks the clean slots.
    policy: Box<dyn ReplacementPolicy + 'p>,
    /// The dirty queue and the held list (oldest end first), and the free list (taken from
    /// the oldest end).
    unevictable: Lists,
}

impl<'p> Residency<'p> {
    /// `slots` empty slots, handed out lowest first; `policy` built for at least `slots`.
    pub fn new(slots: u32, policy: Box<dyn ReplacementPolicy + 'p>) -> Residency<'p> {
        Residency::with_hasher(slots, policy, RandomState::new())
    }
}

impl<'p, S: BuildHasher> Residency<'p, S> {
    /// As `new`, hashing keys with `hasher`.
    pub fn with_hasher(
        slots: u32,
        policy: Box<dyn ReplacementPolicy + 'p>,
        hasher: S,
    ) -> Residency<'p, S> {
        let mut residency = Residency {
            index: SlotIndex::new(slots, hasher),
            keys: vec![NO_KEY; slots as usize],
            policy,
            unevictable: Lists::new(slots as usize, 3),
        };
        residency.rebuild_free_list();
        residency
    }

    pub fn slots(&self) -> u32 {
        self.keys.len() as u32
    }

    /// The slot holding `key`.
    pub fn slot_of(&self, key: LineKey) -> Option<u32> {
        self.index.get(key, &self.keys)
    }

    /// The key a slot holds, `NO_KEY` when it is free (or out of range).
    pub fn key_of(&self, slot: u32) -> LineKey {
        self.keys.get(slot as usize).copied().unwrap_or(NO_KEY)
    }

    pub fn is_mapped(&self, slot: u32) -> bool {
        self.key_of(slot) != NO_KEY
    }

    /// Lines held (mapped slots).
    pub fn used(&self) -> usize {
        self.index.len()
    }

    /// The line in `slot` was used: its rank rises in the policy, or in the dirty queue.
    pub fn touch(&mut self, slot: u32) {
        match self.unevictable.list_of(slot) {
            Some(DIRTY) => self.unevictable.move_to_newest(DIRTY, slot),
            Some(_) => {}
            None => self.policy.touch(slot),
        }
    }

    /// A free slot, if any: the one longest free (at first, the lowest).
    pub fn take_free(&mut self) -> Option<u32> {
        let slot = self.unevictable.oldest(FREE)?;
        self.unevictable.unlink(slot);
        Some(slot)
    }

    /// Puts an empty slot back on the free list (a slot already there stays where it is).
    pub fn give_free(&mut self, slot: u32) {
        debug_assert!(!self.is_mapped(slot));
        if (slot as usize) < self.keys.len() && !self.unevictable.contains(slot) {
            self.unevictable.push_newest(FREE, slot);
        }
    }

    /// Rebuilds the free list from the slots that hold no line, lowest first.
    pub fn rebuild_free_list(&mut self) {
        while self.take_free().is_some() {}
        for slot in 0..self.slots() {
            if !self.is_mapped(slot) {
                self.give_free(slot);
            }
        }
    }

    pub fn free_slots(&self) -> usize {
        self.unevictable.len(FREE) as usize
    }

    /// The policy's victim among clean slots for the line `incoming`, never one `evictable`
    /// refuses (a slot a request holds). The caller must `vacate` it next (the policy records
    /// its ghost there).
    pub fn victim(
        &mut self,
        incoming: LineKey,
        evictable: &mut dyn FnMut(u32, LineKey) -> bool,
    ) -> Option<u32> {
        let keys = &self.keys;
        self.policy
            .victim(incoming, &mut |s| evictable(s, keys[s as usize]))
    }

    /// Puts `key` in the free slot `slot`, as a clean line. Returns false (changing nothing)
    /// when the slot is mapped or the key is held elsewhere.
    #[must_use]
    pub fn occupy(&mut self, slot: u32, key: LineKey) -> bool {
        if key == NO_KEY
            || (slot as usize) >= self.keys.len()
            || self.is_mapped(slot)
            || !self.index.insert(key, slot, &self.keys)
        {
            return false;
        }
        // A slot restored in place (recovery) may still be on the free list.
        if self.unevictable.list_of(slot) == Some(FREE) {
            self.unevictable.unlink(slot);
        }
        self.keys[slot as usize] = key;
        self.policy.insert(slot, key);
        true
    }

    /// Empties a mapped slot (it does not go on the free list: see `give_free`). Returns the
    /// key it held, `NO_KEY` if it was free.
    pub fn vacate(&mut self, slot: u32) -> LineKey {
        let key = self.key_of(slot);
        if key == NO_KEY {
            return NO_KEY;
        }
        if !self.unevictable.unlink(slot) {
            self.policy.remove(slot);
        }
        // Before the key goes: the index compares against it.
        let removed = self.index.remove(key, slot, &self.keys);
        debug_assert!(removed, "slot {slot}'s key was not in the index");
        self.keys[slot as usize] = NO_KEY;
        key
    }

    pub fn standing(&self, slot: u32) -> Option<Standing> {
        if !self.is_mapped(slot) {
            return None;
        }
        Some(match self.unevictable.list_of(slot) {
            Some(DIRTY) => Standing::Dirty,
            Some(_) => Standing::Held,
            None => Standing::Clean,
        })
    }

    /// Moves a mapped slot to where it now stands. A slot that becomes clean enters the
    /// policy as a new line; one that stays where it is keeps its rank.
    pub fn set_standing(&mut self, slot: u32, to: Standing) {
        let Some(from) = self.standing(slot) else {
            return;
        };
        if from == to {
            return;
        }
        match from {
            Standing::Clean => self.policy.remove(slot),
            Standing::Dirty | Standing::Held => {
                self.unevictable.unlink(slot);
            }
        }
        match to {
            Standing::Clean => self.policy.insert(slot, self.keys[slot as usize]),
            Standing::Dirty => self.unevictable.push_newest(DIRTY, slot),
            Standing::Held => self.unevictable.push_newest(HELD, slot),
        }
    }

    /// Dirty slots, least recently used first: the ones the policy would evict next if they
    /// were clean.
    pub fn coldest_dirty(&self) -> impl Iterator<Item = u32> + '_ {
        self.oldest_first(DIRTY)
    }

    /// Slots waiting for a commit before they may be evicted.
    pub fn held_slots(&self) -> Vec<u32> {
        self.oldest_first(HELD).collect()
    }

    fn oldest_first(&self, list: usize) -> impl Iterator<Item = u32> + '_ {
        let mut next = self.unevictable.oldest(list);
        std::iter::from_fn(move || {
            let slot = next?;
            next = self.unevictable.newer(slot);
            Some(slot)
        })
    }

    pub fn dirty_count(&self) -> u32 {
        self.unevictable.len(DIRTY)
    }

    /// Slots the policy ranks (clean ones).
    pub fn clean_count(&self) -> u32 {
        self.policy.tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy;

    fn residency(slots: u32, policy_name: &str) -> Residency<'static> {
        Residency::new(slots, policy::by_name(policy_name, slots).expect("policy"))
    }

    /// Fills every slot, makes all but one dirty; the victim is the one clean slot whatever
    /// the policy, and no call walks the dirty ones (the policy never sees them).
    #[test]
    fn the_victim_is_the_clean_line_among_dirty_ones() {
        for name in policy::names() {
            let mut r = residency(64, name);
            for key in 0..64u64 {
                let slot = r.take_free().expect("free slot");
                assert!(r.occupy(slot, key));
            }
            for slot in (0..64).filter(|&s| s != 17) {
                r.set_standing(slot, Standing::Dirty);
            }
            assert_eq!(r.clean_count(), 1, "{name}");
            let mut asked = 0;
            let v = r.victim(1000, &mut |_, _| {
                asked += 1;
                true
            });
            assert_eq!(v, Some(17), "{name}");
            assert_eq!(asked, 1, "{name}: one slot examined");
            assert_eq!(r.vacate(17), 17);
            r.set_standing(3, Standing::Held);
            r.set_standing(3, Standing::Clean);
            assert_eq!(r.victim(1001, &mut |_, _| true), Some(3), "{name}");
        }
    }

    #[test]
    fn the_coldest_dirty_lines_come_first_and_a_touch_warms_one() {
        let mut r = residency(8, "lru");
        for key in 0..8u64 {
            let slot = r.take_free().expect("free slot");
            assert!(r.occupy(slot, key));
            r.set_standing(slot, Standing::Dirty);
        }
        r.touch(0);
        let order: Vec<u32> = r.coldest_dirty().collect();
        assert_eq!(order, [1, 2, 3, 4, 5, 6, 7, 0]);
        r.set_standing(4, Standing::Held);
        assert_eq!(r.held_slots(), [4]);
        assert_eq!(r.dirty_count(), 7);
        assert_eq!(r.victim(99, &mut |_, _| true), None, "nothing clean");
        assert_eq!(r.vacate(4), 4);
        assert_eq!(r.held_slots(), Vec::<u32>::new());
    }

    /// The free list lives in the slots' links: lowest slots first, a freed slot after the
    /// others, a slot given twice listed once, a slot occupied in place (recovery) taken off
    /// it, and a rebuild lists exactly the unmapped slots.
    #[test]
    fn the_free_list_hands_out_each_free_slot_once() {
        let mut r = residency(6, "lru");
        assert_eq!(r.free_slots(), 6);
        let (a, b) = (r.take_free().unwrap(), r.take_free().unwrap());
        assert_eq!((a, b), (0, 1));
        assert!(r.occupy(a, 10) && r.occupy(b, 11));
        assert_eq!(r.vacate(a), 10);
        r.give_free(a);
        r.give_free(a);
        assert_eq!(r.free_slots(), 5);
        assert!(r.occupy(4, 14), "restored in place");
        assert_eq!(r.standing(4), Some(Standing::Clean));
        let order: Vec<u32> = std::iter::from_fn(|| r.take_free()).collect();
        assert_eq!(order, [2, 3, 5, 0]);
        assert_eq!(r.vacate(4), 14);
        r.rebuild_free_list();
        assert_eq!(r.free_slots(), 5);
        let order: Vec<u32> = std::iter::from_fn(|| r.take_free()).collect();
        assert_eq!(order, [0, 2, 3, 4, 5]);
    }

    #[test]
    fn occupy_refuses_a_mapped_slot_or_a_second_slot_for_a_key() {
        let mut r = residency(4, "clock");
        assert!(r.occupy(0, 7));
        assert!(!r.occupy(0, 8));
        assert!(!r.occupy(1, 7));
        assert!(!r.occupy(9, 9));
        assert_eq!(r.slot_of(7), Some(0));
        assert_eq!(r.used(), 1);
    }
}
