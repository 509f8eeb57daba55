//! Ghost entries: the keys of recently evicted lines, without their data, for the policies that
//! learn from a line coming back soon after its eviction (ARC, S3-FIFO, LIRS). A fixed number
//! of entries, allocated once: keys in a flat array, the entries of each ghost list in age
//! order (an intrusive list), and an open-addressing hash index (linear probing, deletion by
//! backward shift, so no tombstones) at most half full. About 29 bytes per entry.

use super::list::Lists;

const EMPTY: u32 = u32::MAX;

pub(crate) struct Ghosts {
    order: Lists,
    keys: Vec<u64>,
    /// Unused entries (a stack; never grows past the capacity it was created with).
    free: Vec<u32>,
    /// Entry numbers, `EMPTY` where no entry hashes.
    index: Vec<u32>,
    mask: usize,
    shift: u32,
}

impl Ghosts {
    /// Room for `capacity` keys (at least one) spread over `lists` lists.
    pub fn new(capacity: u32, lists: usize) -> Ghosts {
        let capacity = capacity.max(1);
        let size = (capacity as usize * 2).next_power_of_two().max(2);
        Ghosts {
            order: Lists::new(capacity as usize, lists),
            keys: vec![0; capacity as usize],
            free: (0..capacity).rev().collect(),
            index: vec![EMPTY; size],
            mask: size - 1,
            shift: 64 - size.trailing_zeros(),
        }
    }

    pub fn is_full(&self) -> bool {
        self.free.is_empty()
    }

    pub fn len(&self, list: usize) -> u32 {
        self.order.len(list)
    }

    fn home(&self, key: u64) -> usize {
        // Fibonacci hashing: neighbouring lines spread over the whole table.
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// The entry holding `key`.
    pub fn find(&self, key: u64) -> Option<u32> {
        let mut i = self.home(key);
        loop {
            let e = self.index[i];
            if e == EMPTY {
                return None;
            }
            if self.keys[e as usize] == key {
                return Some(e);
            }
            i = (i + 1) & self.mask;
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
        let mut i = self.home(self.keys[entry as usize]);
        while self.index[i] != entry {
            debug_assert_ne!(self.index[i], EMPTY, "ghost entry missing from its index");
            i = (i + 1) & self.mask;
        }
        // Backward shift: pull later entries of the probe run into the hole when their home
        // position is not between the hole and where they sit.
        self.index[i] = EMPTY;
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let e = self.index[j];
            if e == EMPTY {
                break;
            }
            let home = self.home(self.keys[e as usize]);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(hole) & self.mask) {
                self.index[hole] = e;
                self.index[j] = EMPTY;
                hole = j;
            }
        }
        self.order.unlink(entry);
        self.free.push(entry);
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
    /// present is moved. The caller makes room first: pushing into a full table panics.
    pub fn push(&mut self, list: usize, key: u64) -> u32 {
        if let Some(e) = self.find(key) {
            self.remove(e);
        }
        let e = self.free.pop().expect("push into a full ghost table");
        self.keys[e as usize] = key;
        let mut i = self.home(key);
        while self.index[i] != EMPTY {
            i = (i + 1) & self.mask;
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
                assert_eq!(g.oldest(l).map(|e| g.keys[e as usize]), m.front().copied());
            }
        }
        for m in &model {
            for &k in m {
                assert!(g.find(k).is_some());
            }
        }
    }
}
