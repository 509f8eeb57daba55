//! The index from line key to cache slot: an open-addressing hash table (linear probing) of
//! 4-byte entries, sized once for every slot, that never grows or rehashes.
//!
//! An entry holds a slot number, not a key: the key of each slot is already stored (in
//! `Residency`'s per-slot keys), and a probe compares against it. The bits of the entry
//! that slot numbers do not need (a cache of n slots needs the bits of n) carry, first, the
//! entry's distance from its home position (5 bits, saturating: `Fields`), so a removal
//! finds which entries may move back without reading and hashing their keys, then as many
//! bits of the key's hash as are left, so a probe reads the per-slot key (another cache
//! line) only when those match: for a cache of up to 2^21 slots (128 GiB at 64 KiB lines)
//! that is one probe in 64 of the others or fewer. With fewer spare bits the hash bits, then
//! the distance bits go, and the index reads and hashes keys instead: slower, still correct.
//!
//! Load factor at most 1/2 with every slot mapped (`new`): 8 bytes per slot, where a
//! `HashMap<u64, u32>` took about 34 (16-byte entries in a power-of-two table at most 7/8
//! full). At that load linear probing looks at 1.5 entries on average for a key it holds and
//! 2.5 for one it does not (Knuth), and a removal shifts about as many. At 3/4 (5.3 bytes)
//! those are 2.5 and 8.5, and the simulator, which looks up, removes and inserts a key for
//! nearly every request, ran 60% slower than with `HashMap` on the ARC trace P6 (18% at 1/2).
//!
//! Removal shifts the entries that follow back into the gap (backward-shift deletion), so
//! no tombstones accumulate and the probe lengths above hold however long the cache runs.

use std::hash::BuildHasher;

use crate::locks::LineKey;

/// An entry that holds no slot. Never a real entry: the slot field of an entry is below
/// the slot count, which `Fields` makes smaller than an all-ones field.
const EMPTY: u32 = u32::MAX;

/// Most bits an entry spends on its distance from home.
const DISTANCE_BITS: u32 = 5;

/// How an entry's 32 bits divide: slot number (low), distance from home, hash bits (high).
#[derive(Debug, Clone, Copy)]
struct Fields {
    slot_bits: u32,
    /// The largest distance field, which means "this far or farther: hash the key".
    /// 0 when there are no distance bits (then every entry's distance is unknown).
    distance_max: u32,
    /// The entry bits that carry hash bits.
    tag_mask: u32,
}

impl Fields {
    /// The division for slot numbers below `slots`: enough slot bits for the number `slots`
    /// itself, so every slot number is below the all-ones field and no entry equals EMPTY.
    fn for_slots(slots: u32) -> Fields {
        let slot_bits = u32::BITS - slots.leading_zeros();
        let distance_bits = (u32::BITS - slot_bits).min(DISTANCE_BITS);
        let low_bits = slot_bits + distance_bits;
        Fields {
            slot_bits,
            distance_max: (1 << distance_bits) - 1,
            tag_mask: u32::MAX.checked_shl(low_bits).unwrap_or(0),
        }
    }

    fn slot(self, entry: u32) -> u32 {
        entry & ((1u64 << self.slot_bits) - 1) as u32
    }

    fn tag(self, entry: u32) -> u32 {
        entry & self.tag_mask
    }

    /// The distance the entry records; `distance_max` when unknown.
    fn distance(self, entry: u32) -> u32 {
        (entry.checked_shr(self.slot_bits).unwrap_or(0)) & self.distance_max
    }

    fn entry(self, tag: u32, distance: usize, slot: u32) -> u32 {
        let distance = distance.min(self.distance_max as usize) as u32;
        tag | distance.checked_shl(self.slot_bits).unwrap_or(0) | slot
    }
}

/// MurmurHash3's fmix64: a bijection of u64 in which every input bit affects every output bit.
fn mix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

pub struct SlotIndex<S> {
    table: Vec<u32>,
    fields: Fields,
    /// Slots the index is for: every slot number is below it.
    slots: u32,
    len: usize,
    hasher: S,
}

impl<S: BuildHasher> SlotIndex<S> {
    /// An empty index with room for `slots` slots at most 1/2 full.
    pub fn new(slots: u32, hasher: S) -> SlotIndex<S> {
        let capacity = slots as usize * 2 + 1;
        SlotIndex {
            table: vec![EMPTY; capacity],
            fields: Fields::for_slots(slots),
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
        // Mixed once more (the 64-bit finaliser of MurmurHash3) so that every key bit reaches
        // the high bits the home comes from and the low bits the tag comes from, whatever the
        // hasher: the simulator's Fx hash leaves its high bits blind to a key's volume bits,
        // which put the same block of every volume at one home (review 15).
        let hash = mix64(self.hasher.hash_one(key));
        // The high half of hash × capacity: a position in 0..capacity from the hash's high
        // bits (Lemire's multiply-shift, no division); the tag comes from its low bits.
        let home = ((u128::from(hash) * self.table.len() as u128) >> 64) as usize;
        (home, hash as u32 & self.fields.tag_mask)
    }

    /// The home position of the entry at `at`: from its distance, or when that is unknown
    /// from its key's hash.
    fn home_of(&self, entry: u32, at: usize, keys: &[LineKey]) -> usize {
        let distance = self.fields.distance(entry);
        if distance < self.fields.distance_max {
            return self.back(at, distance as usize);
        }
        let key = keys
            .get(self.fields.slot(entry) as usize)
            .copied()
            .unwrap_or(LineKey::MAX);
        self.place(key).0
    }

    /// The position `by` (below the capacity) before `at`, wrapping. No division: this runs
    /// for every entry a removal passes.
    fn back(&self, at: usize, by: usize) -> usize {
        if by <= at {
            at - by
        } else {
            at + self.table.len() - by
        }
    }

    /// How many steps forward (wrapping) lead from `from` to `to`.
    fn steps(&self, from: usize, to: usize) -> usize {
        if from <= to {
            to - from
        } else {
            to + self.table.len() - from
        }
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
            if self.fields.tag(entry) == tag
                && keys.get(self.fields.slot(entry) as usize) == Some(&key)
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
            .map(|at| self.fields.slot(self.table[at]))
    }

    /// Adds `key` → `slot`, in one pass: a key the index holds lies before the first empty
    /// entry of its probe sequence (nothing leaves a hole behind it). The caller has checked
    /// that `slot` is not in the index. Returns false (changing nothing) when `key` is held
    /// already, when `slot` is not below the slot count, or when no entry is empty (which
    /// cannot be while each slot is in at most once).
    #[must_use]
    pub fn insert(&mut self, key: LineKey, slot: u32, keys: &[LineKey]) -> bool {
        if slot >= self.slots {
            return false;
        }
        let (mut at, tag) = self.place(key);
        for distance in 0..self.table.len() {
            let entry = self.table[at];
            if entry == EMPTY {
                self.table[at] = self.fields.entry(tag, distance, slot);
                self.len += 1;
                return true;
            }
            if self.fields.tag(entry) == tag
                && keys.get(self.fields.slot(entry) as usize) == Some(&key)
            {
                return false;
            }
            at = self.next(at);
        }
        false
    }

    /// Removes `key`, held in `slot`; `keys` must still hold the key of every slot in the
    /// index. Finds the entry by its slot number (unique in the table), so it reads no key
    /// but those of the entries it shifts. Returns whether the index held it.
    pub fn remove(&mut self, key: LineKey, slot: u32, keys: &[LineKey]) -> bool {
        if keys.get(slot as usize) != Some(&key) {
            return false;
        }
        let (mut at, _) = self.place(key);
        let mut found = None;
        for _ in 0..self.table.len() {
            let entry = self.table[at];
            if entry == EMPTY {
                break;
            }
            if self.fields.slot(entry) == slot {
                found = Some(at);
                break;
            }
            at = self.next(at);
        }
        let Some(mut gap) = found else {
            return false;
        };
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
            let home = self.home_of(entry, at, keys);
            if !cyclically_within(home, gap, at) {
                let distance = self.steps(home, gap);
                let moved =
                    self.fields
                        .entry(self.fields.tag(entry), distance, self.fields.slot(entry));
                self.table[gap] = moved;
                gap = at;
            }
        }
        self.table[gap] = EMPTY;
        self.len -= 1;
        true
    }
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

    /// Keys from the small range `0..KEYS`, so inserts meet mapped keys and removes meet
    /// absent ones.
    const KEYS: u64 = 96;

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        // Inserts twice as likely, so the table fills up (long runs, distances past the
        // field's maximum).
        let op = prop_oneof![
            2 => (0..KEYS).prop_map(Op::Insert),
            1 => (0..KEYS).prop_map(Op::Remove),
        ];
        prop::collection::vec(op, 0..400)
    }

    /// Runs `ops` on a `Residency`-like pair (keys per slot, the index) and on a `HashMap`;
    /// after each, every key in 0..KEYS must be found exactly where the model has it, and the
    /// table must hold exactly the model's entries.
    fn check_against_model<S: BuildHasher>(slots: u32, hasher: S, ops: Vec<Op>) {
        let mut index = SlotIndex::new(slots, hasher);
        let mut keys = vec![LineKey::MAX; slots as usize];
        let mut free: Vec<u32> = (0..slots).rev().collect();
        let mut model: HashMap<LineKey, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(key) => {
                    let Some(slot) = free.pop() else { continue };
                    if model.contains_key(&key) {
                        assert!(!index.insert(key, slot, &keys), "second insert of {key}");
                        free.push(slot);
                        continue;
                    }
                    assert!(
                        index.insert(key, slot, &keys),
                        "insert {key} into slot {slot}"
                    );
                    keys[slot as usize] = key;
                    model.insert(key, slot);
                }
                Op::Remove(key) => {
                    // An absent key is asked with some slot: held by another key, or free.
                    let slot = model
                        .get(&key)
                        .copied()
                        .unwrap_or((key as u32) % slots.max(1));
                    let removed = index.remove(key, slot, &keys);
                    assert_eq!(removed, model.remove(&key).is_some(), "remove {key}");
                    if removed {
                        keys[slot as usize] = LineKey::MAX;
                        free.push(slot);
                    }
                }
            }
            assert_eq!(index.len(), model.len());
            for key in 0..KEYS {
                assert_eq!(index.get(key, &keys), model.get(&key).copied(), "key {key}");
            }
            let held = index.table.iter().filter(|&&e| e != EMPTY).count();
            assert_eq!(held, model.len(), "entries in the table");
            check_entries(&index, &keys);
        }
    }

    /// Every entry lies after its home with no empty entry between (what lookups rely on),
    /// and carries its true distance from home (saturated) and its key's hash bits.
    fn check_entries<S: BuildHasher>(index: &SlotIndex<S>, keys: &[LineKey]) {
        let f = index.fields;
        for (at, &entry) in index.table.iter().enumerate() {
            if entry == EMPTY {
                continue;
            }
            let key = keys[f.slot(entry) as usize];
            let (home, tag) = index.place(key);
            let distance = index.steps(home, at);
            assert_eq!(f.tag(entry), tag, "hash bits of the entry at {at}");
            let recorded = (distance as u32).min(f.distance_max);
            assert_eq!(f.distance(entry), recorded, "distance of the entry at {at}");
            for step in 0..distance {
                let between = (home + step) % index.table.len();
                assert_ne!(
                    index.table[between], EMPTY,
                    "a hole before the entry at {at}"
                );
            }
        }
    }

    /// review15: rustc-hash 2.1.3's `FxHasher` for one u64 (what `ssdcache simulate` gives its
    /// `Residency`: crates/sim/src/simulate.rs), restated: (0 + key) × K, rotated left 26.
    #[derive(Clone, Default)]
    struct Fx213(u64);

    impl Hasher for Fx213 {
        fn finish(&self) -> u64 {
            self.0.rotate_left(26)
        }
        fn write(&mut self, _: &[u8]) {
            unreachable!("keys are u64")
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = self.0.wrapping_add(n).wrapping_mul(0xf135_7aea_2e62_a9c5);
        }
    }

    #[derive(Clone, Default)]
    struct BuildFx213;

    impl BuildHasher for BuildFx213 {
        type Hasher = Fx213;
        fn build_hasher(&self) -> Fx213 {
            Fx213::default()
        }
    }

    /// Mean entries a lookup of each held key looks at.
    fn mean_probes<S: BuildHasher>(index: &SlotIndex<S>, keys: &[LineKey]) -> f64 {
        let total: usize = keys
            .iter()
            .map(|&key| {
                let at = index.find(key, keys).expect("held");
                index.steps(index.place(key).0, at) + 1
            })
            .sum();
        total as f64 / keys.len() as f64
    }

    /// review15: a multi-volume trace in the simulator. Its keys are `volume << 48 | block`
    /// (crates/sim/src/trace/blocks.rs); the home comes from the hash's top bits, which for
    /// Fx (× K, rotate left 26) are bits 37 and below of key × K, which no key bit from 48 up
    /// changes: the same block of every volume has the same home (and the same hash bits), so
    /// 32 volumes make runs of 32. The module promises 1.5 entries per lookup at this load;
    /// `HashMap` (hashbrown takes the hash's low bits, which the volume bits do reach) did
    /// not have this. Only speed: lookups stay correct.
    #[test]
    fn review15_fx_keys_of_many_volumes_do_not_share_homes() {
        let (volumes, blocks) = (32u64, 2048u64);
        let keys: Vec<LineKey> = (0..volumes)
            .flat_map(|v| (0..blocks).map(move |b| v << 48 | b))
            .collect();
        let slots = keys.len() as u32;
        let mut fx = SlotIndex::new(slots, BuildFx213);
        let mut keyed = SlotIndex::new(slots, RandomState::new());
        for (slot, &key) in keys.iter().enumerate() {
            assert!(fx.insert(key, slot as u32, &keys));
            assert!(keyed.insert(key, slot as u32, &keys));
        }
        let (fx_probes, keyed_probes) = (mean_probes(&fx, &keys), mean_probes(&keyed, &keys));
        assert!(
            fx_probes < 3.0,
            "Fx: {fx_probes:.1} entries per lookup at load 1/2 (keyed hasher: {keyed_probes:.1})"
        );
    }

    /// review15: as `check_against_model`, with the entry fields of a cache of `wide_slots`
    /// slots (few or no distance and hash bits), which the other property tests (under 80
    /// slots: 5 distance bits and hash bits always) never reach.
    fn check_with_fields_of<S: BuildHasher>(wide_slots: u32, slots: u32, hasher: S, ops: Vec<Op>) {
        let mut index = SlotIndex::new(slots, hasher);
        index.fields = Fields::for_slots(wide_slots);
        let mut keys = vec![LineKey::MAX; slots as usize];
        let mut free: Vec<u32> = (0..slots).rev().collect();
        let mut model: HashMap<LineKey, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(key) => {
                    let Some(slot) = free.pop() else { continue };
                    let inserted = index.insert(key, slot, &keys);
                    assert_eq!(inserted, !model.contains_key(&key), "insert {key}");
                    if inserted {
                        keys[slot as usize] = key;
                        model.insert(key, slot);
                    } else {
                        free.push(slot);
                    }
                }
                Op::Remove(key) => {
                    let slot = model
                        .get(&key)
                        .copied()
                        .unwrap_or((key as u32) % slots.max(1));
                    let removed = index.remove(key, slot, &keys);
                    assert_eq!(removed, model.remove(&key).is_some(), "remove {key}");
                    if removed {
                        keys[slot as usize] = LineKey::MAX;
                        free.push(slot);
                    }
                }
            }
            for key in 0..KEYS {
                assert_eq!(index.get(key, &keys), model.get(&key).copied(), "key {key}");
            }
            check_entries(&index, &keys);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn review15_wide_cache_fields_match_a_hash_map(
            wide in prop::sample::select(vec![1u32 << 26, 1 << 27, 1 << 28, 1 << 29, 1 << 30, 1 << 31, u32::MAX - 1]),
            slots in 1u32..80,
            clustered in any::<bool>(),
            ops in ops(),
        ) {
            if clustered {
                check_with_fields_of(wide, slots, BuildClustering, ops);
            } else {
                check_with_fields_of(wide, slots, RandomState::new(), ops);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn matches_a_hash_map_with_the_keyed_hasher(slots in 0u32..80, ops in ops()) {
            check_against_model(slots, RandomState::new(), ops);
        }

        #[test]
        fn matches_a_hash_map_when_every_key_collides(slots in 0u32..80, ops in ops()) {
            check_against_model(slots, BuildClustering, ops);
        }
    }

    #[test]
    fn a_full_index_finds_every_slot_and_the_table_is_twice_as_large() {
        let slots = 10_000u32;
        let mut index = SlotIndex::new(slots, RandomState::new());
        let keys: Vec<LineKey> = (0..u64::from(slots)).map(|k| k * 7919).collect();
        for (slot, &key) in keys.iter().enumerate() {
            assert!(index.insert(key, slot as u32, &keys));
        }
        assert_eq!(index.table.len(), 20_001);
        for (slot, &key) in keys.iter().enumerate() {
            assert_eq!(index.get(key, &keys), Some(slot as u32));
        }
        assert_eq!(index.get(1, &keys), None);
        assert!(
            !index.insert(5, slots + 100_000, &keys),
            "slot past the count"
        );
        assert!(!index.insert(keys[7], 0, &keys), "a key held already");
        assert!(
            !index.remove(keys[7], 8, &keys),
            "a key with another's slot"
        );
        assert!(index.remove(keys[7], 7, &keys));
        assert_eq!(index.get(keys[7], &keys), None);
        assert_eq!(index.len(), slots as usize - 1);
    }

    /// The slot field always has room for an all-ones value no slot takes, up to the
    /// largest slot count a layout allows (then no distance or hash bits are left), and the
    /// fields read back what was put in.
    #[test]
    fn no_entry_looks_empty_at_any_slot_count() {
        for slots in [
            1,
            4,
            7,
            8,
            1 << 20,
            1 << 27,
            (1 << 31) - 1,
            1 << 31,
            u32::MAX - 1,
        ] {
            let f = Fields::for_slots(slots);
            let last = slots - 1;
            let full = f.entry(f.tag_mask, usize::MAX, last);
            assert_ne!(full, EMPTY, "{slots} slots: {f:?}");
            assert_eq!(f.slot(full), last, "{slots} slots");
            assert_eq!(f.distance(full), f.distance_max, "{slots} slots");
            assert_eq!(f.tag(full), f.tag_mask, "{slots} slots");
            let near = f.entry(0, 3, last);
            let expect = if f.distance_max > 3 {
                3
            } else {
                f.distance_max
            };
            assert_eq!(f.distance(near), expect, "{slots} slots");
        }
        let f = Fields::for_slots(1 << 20);
        assert_eq!(
            (f.slot_bits, f.distance_max, f.tag_mask),
            (21, 31, !0 << 26)
        );
        let f = Fields::for_slots(u32::MAX - 1);
        assert_eq!((f.slot_bits, f.distance_max, f.tag_mask), (32, 0, 0));
    }
}
