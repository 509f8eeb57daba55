//! The index from line key to cache slot: an open-addressing hash table (linear probing) of
//! 4-byte entries, sized once for every slot, that never grows or rehashes.
//!
//! An entry holds a slot number, not a key: the key of each slot is already stored (in
//! `Residency`'s per-slot keys), and a probe compares against it. The bits of the entry
//! that slot numbers do not need (a cache of n slots needs the bits of n: `slot_mask`) carry
//! as many bits of the key's hash, so a probe reads the per-slot key (another cache line)
//! only when those bits match: for a cache of up to 2^24 slots (1 TiB at 64 KiB lines) that
//! is one probe in 256 of the others, and a miss seldom reads a key at all.
//!
//! Load factor at most 3/4 with every slot mapped (`capacity`): 5.3 bytes per slot, where a
//! `HashMap<u64, u32>` took about 34 (16-byte entries in a power-of-two table at most 7/8
//! full). At that load linear probing looks at 2.5 entries on average for a key it holds and
//! 8.5 for one it does not (Knuth), consecutive 4-byte entries, mostly in one cache line.
//!
//! Removal shifts the entries that follow back into the gap (backward-shift deletion), so
//! no tombstones accumulate and the probe lengths above hold however long the cache runs.

use std::hash::BuildHasher;

use crate::locks::LineKey;

/// An entry that holds no slot. Never a real entry: the slot field of an entry is below
/// the slot count, which `slot_mask` makes smaller than an all-ones field.
const EMPTY: u32 = u32::MAX;

pub struct SlotIndex<S> {
    table: Vec<u32>,
    /// Low bits of an entry that hold the slot number; the bits above carry hash bits.
    slot_mask: u32,
    /// Slots the index is for: every slot number is below it.
    slots: u32,
    len: usize,
    hasher: S,
}

impl<S: BuildHasher> SlotIndex<S> {
    /// An empty index with room for `slots` slots at most 3/4 full.
    pub fn new(slots: u32, hasher: S) -> SlotIndex<S> {
        let capacity = slots as usize + slots as usize / 3 + 1;
        SlotIndex {
            table: vec![EMPTY; capacity],
            slot_mask: slot_mask(slots),
            slots,
            len: 0,
            hasher,
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The key's home position and the hash bits its entries carry.
    fn place(&self, key: LineKey) -> (usize, u32) {
        let hash = self.hasher.hash_one(key);
        // The high half of hash × capacity: a position in 0..capacity from the hash's high
        // bits (Lemire's multiply-shift, no division); the tag comes from its low bits.
        let home = ((u128::from(hash) * self.table.len() as u128) >> 64) as usize;
        (home, hash as u32 & !self.slot_mask)
    }

    fn next(&self, at: usize) -> usize {
        if at + 1 == self.table.len() {
            0
        } else {
            at + 1
        }
    }

    /// The table position holding `key`, comparing against `keys` (the key of each slot).
    fn find(&self, key: LineKey, keys: &[LineKey]) -> Option<usize> {
        let (mut at, tag) = self.place(key);
        // Bounded by the capacity; an empty entry ends it first (the table is never full).
        for _ in 0..self.table.len() {
            let entry = self.table[at];
            if entry == EMPTY {
                return None;
            }
            if entry & !self.slot_mask == tag
                && keys.get((entry & self.slot_mask) as usize) == Some(&key)
            {
                return Some(at);
            }
            at = self.next(at);
        }
        None
    }

    /// The slot holding `key`.
    pub fn get(&self, key: LineKey, keys: &[LineKey]) -> Option<u32> {
        self.find(key, keys)
            .map(|at| self.table[at] & self.slot_mask)
    }

    /// Adds `key` → `slot`. The caller has checked that `key` is absent and `slot` is not in
    /// the index. Returns false (changing nothing) when `slot` is not below the slot count,
    /// or when no entry is empty (which cannot be while each slot is in at most once).
    #[must_use]
    pub fn insert(&mut self, key: LineKey, slot: u32) -> bool {
        if slot >= self.slots {
            return false;
        }
        let (mut at, tag) = self.place(key);
        for _ in 0..self.table.len() {
            if self.table[at] == EMPTY {
                self.table[at] = tag | slot;
                self.len += 1;
                return true;
            }
            at = self.next(at);
        }
        false
    }

    /// Removes `key`, comparing against `keys`, which must still hold the key of every slot
    /// in the index (this one's too). Returns its slot.
    pub fn remove(&mut self, key: LineKey, keys: &[LineKey]) -> Option<u32> {
        let mut gap = self.find(key, keys)?;
        let slot = self.table[gap] & self.slot_mask;
        // Backward shift: walk the run after the gap; an entry whose home is not in
        // (gap, at] may move back into the gap (its probe from home passes the gap), which
        // opens a new gap where it was. The run ends at an empty entry.
        let mut at = gap;
        for _ in 0..self.table.len() {
            at = self.next(at);
            let entry = self.table[at];
            if entry == EMPTY {
                break;
            }
            let key_there = keys
                .get((entry & self.slot_mask) as usize)
                .copied()
                .unwrap_or(LineKey::MAX);
            let (home, _) = self.place(key_there);
            if !cyclically_within(home, gap, at) {
                self.table[gap] = entry;
                gap = at;
            }
        }
        self.table[gap] = EMPTY;
        self.len -= 1;
        Some(slot)
    }
}

/// The entry bits for slot numbers below `slots`: enough for the number `slots` itself, so
/// every slot number is below the all-ones field and no entry equals `EMPTY`.
fn slot_mask(slots: u32) -> u32 {
    let slot_bits = u32::BITS - slots.leading_zeros();
    u32::MAX.checked_shr(u32::BITS - slot_bits).unwrap_or(0)
}

/// Whether `x` lies in the cyclic interval (`after`, `upto`].
fn cyclically_within(x: usize, after: usize, upto: usize) -> bool {
    if after <= upto {
        after < x && x <= upto
    } else {
        after < x || x <= upto
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::hash_map::RandomState;
    use std::collections::HashMap;
    use std::hash::Hasher;

    /// A hash that puts every key among 3 homes: long runs that wrap around the table's
    /// end, so the backward shift meets every case.
    #[derive(Clone, Default)]
    struct Clustering(u64);

    impl Hasher for Clustering {
        fn finish(&self) -> u64 {
            (self.0 % 3).wrapping_mul(u64::MAX / 3)
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = self.0.wrapping_mul(31).wrapping_add(u64::from(b));
            }
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = n;
        }
    }

    #[derive(Clone, Default)]
    struct BuildClustering;

    impl BuildHasher for BuildClustering {
        type Hasher = Clustering;
        fn build_hasher(&self) -> Clustering {
            Clustering::default()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(LineKey),
        Remove(LineKey),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        // Keys from a small range, so inserts meet mapped keys and removes meet absent ones.
        let op = prop_oneof![
            (0u64..48).prop_map(Op::Insert),
            (0u64..48).prop_map(Op::Remove),
        ];
        prop::collection::vec(op, 0..300)
    }

    /// Runs `ops` on a `Residency`-like pair (keys per slot, the index) and on a `HashMap`;
    /// after each, every key in 0..48 must be found exactly where the model has it, and the
    /// table must hold exactly the model's entries.
    fn check_against_model<S: BuildHasher>(slots: u32, hasher: S, ops: Vec<Op>) {
        let mut index = SlotIndex::new(slots, hasher);
        let mut keys = vec![LineKey::MAX; slots as usize];
        let mut free: Vec<u32> = (0..slots).rev().collect();
        let mut model: HashMap<LineKey, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(key) => {
                    if model.contains_key(&key) {
                        assert_eq!(index.get(key, &keys), model.get(&key).copied());
                        continue;
                    }
                    let Some(slot) = free.pop() else { continue };
                    assert!(index.insert(key, slot), "insert {key} into slot {slot}");
                    keys[slot as usize] = key;
                    model.insert(key, slot);
                }
                Op::Remove(key) => {
                    let got = index.remove(key, &keys);
                    assert_eq!(got, model.remove(&key), "remove {key}");
                    if let Some(slot) = got {
                        keys[slot as usize] = LineKey::MAX;
                        free.push(slot);
                    }
                }
            }
            assert_eq!(index.len(), model.len());
            for key in 0..48 {
                assert_eq!(index.get(key, &keys), model.get(&key).copied(), "key {key}");
            }
            let held = index.table.iter().filter(|&&e| e != EMPTY).count();
            assert_eq!(held, model.len(), "entries in the table");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn matches_a_hash_map_with_the_keyed_hasher(slots in 0u32..40, ops in ops()) {
            check_against_model(slots, RandomState::new(), ops);
        }

        #[test]
        fn matches_a_hash_map_when_every_key_collides(slots in 0u32..40, ops in ops()) {
            check_against_model(slots, BuildClustering, ops);
        }
    }

    #[test]
    fn a_full_index_finds_every_slot_and_the_table_is_a_third_larger() {
        let slots = 10_000u32;
        let mut index = SlotIndex::new(slots, RandomState::new());
        let keys: Vec<LineKey> = (0..u64::from(slots)).map(|k| k * 7919).collect();
        for (slot, &key) in keys.iter().enumerate() {
            assert!(index.insert(key, slot as u32));
        }
        assert_eq!(index.table.len(), 13_334);
        for (slot, &key) in keys.iter().enumerate() {
            assert_eq!(index.get(key, &keys), Some(slot as u32));
        }
        assert_eq!(index.get(1, &keys), None);
        assert!(!index.insert(5, slots + 100_000), "slot past the count");
    }

    /// The slot field always has room for an all-ones value no slot takes, up to the
    /// largest slot count a layout allows (then no hash bits are left).
    #[test]
    fn no_entry_looks_empty_at_any_slot_count() {
        for slots in [1, 4, 7, 8, 1 << 20, (1 << 31) - 1, 1 << 31, u32::MAX - 1] {
            let mask = slot_mask(slots);
            assert!(slots - 1 < mask, "{slots} slots, mask {mask:#x}");
            assert_eq!(mask.count_ones(), u32::BITS - slots.leading_zeros());
        }
        assert_eq!(slot_mask(4), 0b111);
        assert_eq!(slot_mask(0), 0);
    }
}
