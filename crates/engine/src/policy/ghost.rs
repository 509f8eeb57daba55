//! Ghost entries: fingerprints of the keys of recently evicted lines, without their data, for
//! the policies that learn from a line coming back soon after its eviction (ARC, S3-FIFO, LIRS)
//! and for N-hit admission. A fixed number of entries, allocated once: a 32-bit fingerprint
//! per entry, the entries of each ghost list in age order (an intrusive list), and an
//! open-addressing hash index of 4-byte entry numbers (linear probing, deletion by backward
//! shift, so no tombstones) of 2 × capacity + 1 places, so at most half full. Unused entries
//! are chained through their fingerprint field. 20 bytes per entry with one list, 21 with more.
//!
//! A fingerprint, not the key: two keys with the same fingerprint (one pair in 2^32) share a
//! ghost, so a line may now and then be taken for one that was evicted, or a ghost be
//! forgotten early. That changes a ranking (a line protected, or admitted, a little sooner);
//! it never changes data, which the engine finds through its own index of full keys.

use super::list::Lists;

const EMPTY: u32 = u32::MAX;

/// The most entries a table holds: its index (2 × capacity + 1 places) then has at most
/// `u32::MAX` places, so `home` scales a fingerprint in 64 bits without overflow.
const MAX_CAPACITY: u32 = (u32::MAX - 1) / 2;

/// A 32-bit digest of a line key: what a ghost remembers of it.
pub(crate) type Fingerprint = u32;

/// The salt of every fingerprint this process makes (`fingerprint_salt`).
static SALT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// A random value drawn once per process, mixed into every fingerprint: keys come from client
/// offsets, and with a fixed hash a client could pick offsets whose fingerprints share one
/// home, making every ghost lookup walk one long probe run under the map's lock (review 27,
/// S1: 1,000 times slower per miss), or pick two keys that always share a ghost (F2). The
/// simulator fixes it to 0 (`use_fixed_fingerprints`) so its results do not depend on the run.
fn fingerprint_salt() -> u64 {
    // The engine's own unit tests pick keys whose fingerprints must not collide: fixed there.
    if cfg!(test) {
        return 0;
    }
    *SALT.get_or_init(|| uuid::Uuid::new_v4().as_u64_pair().0)
}

/// Makes every fingerprint of this process unsalted (salt 0), for the simulator: its results
/// are then the same on every run. False when fingerprints were made with a random salt
/// already (then they stay so).
pub fn use_fixed_fingerprints() -> bool {
    SALT.set(0).is_ok() || SALT.get() == Some(&0)
}

/// The fingerprint of `key`: the high half of MurmurHash3's 64-bit finaliser of the key with
/// the process's salt, in which every key bit affects every fingerprint bit (keys of
/// neighbouring lines differ in low bits only).
pub(crate) fn fingerprint(key: u64) -> Fingerprint {
    let mut h = key ^ fingerprint_salt();
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    (h >> 32) as Fingerprint
}

pub(crate) struct Ghosts {
    order: Lists,
    /// The fingerprint of each entry in use; for an unused one, the next unused entry (or
    /// `EMPTY`).
    prints: Vec<Fingerprint>,
    /// The first unused entry, `EMPTY` when the table is full.
    free: u32,
    /// Entry numbers, `EMPTY` where no entry hashes.
    index: Vec<u32>,
}

impl Ghosts {
    /// Room for `capacity` keys (at least one, at most `MAX_CAPACITY`) spread over `lists`
    /// lists.
    pub fn new(capacity: u32, lists: usize) -> Ghosts {
        let capacity = capacity.clamp(1, MAX_CAPACITY);
        Ghosts {
            order: Lists::new(capacity as usize, lists),
            // Entry e is chained to e + 1; the last one to EMPTY.
            prints: (1..capacity).chain([EMPTY]).collect(),
            free: 0,
            index: vec![EMPTY; capacity as usize * 2 + 1],
        }
    }

    pub fn is_full(&self) -> bool {
        self.free == EMPTY
    }

    pub fn len(&self, list: usize) -> u32 {
        self.order.len(list)
    }

    /// The index place a fingerprint hashes to: fingerprints are uniform, so scaling one to
    /// the table's size (multiply and keep the high half) spreads them evenly.
    fn home(&self, print: Fingerprint) -> usize {
        ((u64::from(print) * self.index.len() as u64) >> 32) as usize
    }

    fn next_place(&self, i: usize) -> usize {
        if i + 1 == self.index.len() {
            0
        } else {
            i + 1
        }
    }

    /// The entry holding `key` (or a key with its fingerprint).
    pub fn find(&self, key: u64) -> Option<u32> {
        self.find_print(fingerprint(key))
    }

    /// The entry holding `print`.
    pub fn find_print(&self, print: Fingerprint) -> Option<u32> {
        let mut i = self.home(print);
        loop {
            let e = self.index[i];
            if e == EMPTY {
                return None;
            }
            if self.prints[e as usize] == print {
                return Some(e);
            }
            i = self.next_place(i);
        }
    }

    pub fn list_of(&self, entry: u32) -> usize {
        self.order.list_of(entry).expect("unused ghost entry")
    }

    pub fn oldest(&self, list: usize) -> Option<u32> {
        self.order.oldest(list)
    }

    /// Forgets an entry.
    pub fn remove(&mut self, entry: u32) {
        let mut i = self.home(self.prints[entry as usize]);
        while self.index[i] != entry {
            debug_assert_ne!(self.index[i], EMPTY, "ghost entry missing from its index");
            i = self.next_place(i);
        }
        // Backward shift: pull later entries of the probe run into the hole when their home
        // position is not between the hole and where they sit.
        let size = self.index.len();
        // How far `to` is past `from`, going round the end.
        let distance = |from: usize, to: usize| {
            if to >= from {
                to - from
            } else {
                to + size - from
            }
        };
        self.index[i] = EMPTY;
        let mut hole = i;
        let mut j = i;
        loop {
            j = self.next_place(j);
            let e = self.index[j];
            if e == EMPTY {
                break;
            }
            let home = self.home(self.prints[e as usize]);
            if distance(home, j) >= distance(hole, j) {
                self.index[hole] = e;
                self.index[j] = EMPTY;
                hole = j;
            }
        }
        self.order.unlink(entry);
        self.prints[entry as usize] = self.free;
        self.free = entry;
    }

    /// Forgets the oldest entry of `list`; false when the list is empty.
    pub fn pop_oldest(&mut self, list: usize) -> bool {
        match self.oldest(list) {
            Some(e) => {
                self.remove(e);
                true
            }
            None => false,
        }
    }

    /// Records `key` as the newest entry of `list` and returns its entry. A key already
    /// present (or one with its fingerprint) is moved. The caller makes room first: pushing
    /// into a full table panics.
    pub fn push(&mut self, list: usize, key: u64) -> u32 {
        self.push_print(list, fingerprint(key))
    }

    /// [`push`](Self::push) of a fingerprint.
    pub fn push_print(&mut self, list: usize, print: Fingerprint) -> u32 {
        if let Some(e) = self.find_print(print) {
            self.remove(e);
        }
        let e = self.free;
        assert_ne!(e, EMPTY, "push into a full ghost table");
        self.free = self.prints[e as usize];
        self.prints[e as usize] = print;
        let mut i = self.home(print);
        while self.index[i] != EMPTY {
            i = self.next_place(i);
        }
        self.index[i] = e;
        self.order.push_newest(list, e);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    #[test]
    fn bounded_fifo_of_keys() {
        let mut g = Ghosts::new(4, 1);
        for k in 0..4u64 {
            g.push(0, k << 48 | k);
        }
        assert!(g.is_full());
        assert!(g.pop_oldest(0));
        assert_eq!(g.find(0), None);
        let e = g.push(0, 99);
        assert_eq!(g.find(99), Some(e));
        for k in 1..4u64 {
            assert!(g.find(k << 48 | k).is_some());
        }
        g.remove(g.find(2 << 48 | 2).unwrap());
        assert_eq!(g.find(2 << 48 | 2), None);
        assert_eq!(g.len(0), 3);
    }

    /// Keys are told apart by their fingerprints only: one that shares another's fingerprint
    /// finds its ghost, and pushing it replaces that ghost (a ranking error, never data).
    #[test]
    fn keys_with_one_fingerprint_share_a_ghost() {
        let mut g = Ghosts::new(8, 1);
        let e = g.push(0, 5);
        assert_eq!(g.find_print(fingerprint(5)), Some(e));
        assert_eq!(g.find(6), None);
        let moved = g.push_print(0, fingerprint(5));
        assert_eq!(g.len(0), 1);
        assert_eq!(g.find(5), Some(moved));
    }

    /// Against a model, with keys crowded into a small table so probe runs wrap and shift.
    #[test]
    fn matches_a_model_under_churn() {
        let mut g = Ghosts::new(37, 2);
        let mut model: [VecDeque<u64>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 97;
            let list = (x >> 32) as usize % 2;
            match (x >> 40) % 3 {
                0 => {
                    let found = g.find(key);
                    let in_model = model.iter().position(|m| m.contains(&key));
                    assert_eq!(found.map(|e| g.list_of(e)), in_model);
                    if let Some(e) = found {
                        g.remove(e);
                        model[in_model.unwrap()].retain(|&k| k != key);
                    }
                }
                _ => {
                    for m in model.iter_mut() {
                        m.retain(|&k| k != key);
                    }
                    if g.find(key).is_none() && g.is_full() {
                        let victim = if g.len(list) > 0 { list } else { 1 - list };
                        assert!(g.pop_oldest(victim));
                        model[victim].pop_front();
                    }
                    g.push(list, key);
                    model[list].push_back(key);
                }
            }
            for (l, m) in model.iter().enumerate() {
                assert_eq!(g.len(l) as usize, m.len());
                assert_eq!(
                    g.oldest(l).map(|e| g.prints[e as usize]),
                    m.front().map(|&k| fingerprint(k))
                );
            }
        }
        for m in &model {
            for &k in m {
                assert!(g.find(k).is_some());
            }
        }
    }
}
