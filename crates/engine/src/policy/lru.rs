//! Least recently used: an intrusive doubly linked list over slot indices (8 bytes per slot).

use super::ReplacementPolicy;

const NONE: u32 = u32::MAX;

pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Most recently used end.
    head: u32,
    /// Least recently used end; victims are taken from here.
    tail: u32,
    linked: Vec<bool>,
    len: u32,
}

impl Lru {
    pub fn new(slots: u32) -> Lru {
        let n = slots as usize;
        Lru {
            prev: vec![NONE; n],
            next: vec![NONE; n],
            head: NONE,
            tail: NONE,
            linked: vec![false; n],
            len: 0,
        }
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NONE {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[s as usize] = false;
        self.len -= 1;
    }

    fn push_head(&mut self, s: u32) {
        self.prev[s as usize] = NONE;
        self.next[s as usize] = self.head;
        if self.head != NONE {
            self.prev[self.head as usize] = s;
        }
        self.head = s;
        if self.tail == NONE {
            self.tail = s;
        }
        self.linked[s as usize] = true;
        self.len += 1;
    }
}

impl ReplacementPolicy for Lru {
    fn insert(&mut self, slot: u32, _key: u64) {
        if self.linked[slot as usize] {
            self.unlink(slot);
        }
        self.push_head(slot);
    }

    fn touch(&mut self, slot: u32) {
        if self.linked[slot as usize] && self.head != slot {
            self.unlink(slot);
            self.push_head(slot);
        }
    }

    fn remove(&mut self, slot: u32) {
        if self.linked[slot as usize] {
            self.unlink(slot);
        }
    }

    fn victim(&mut self, _incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let mut s = self.tail;
        while s != NONE {
            if evictable(s) {
                return Some(s);
            }
            s = self.prev[s as usize];
        }
        None
    }

    fn tracked(&self) -> u32 {
        self.len
    }

    fn name(&self) -> &'static str {
        "lru"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent_and_skips_busy() {
        let mut lru = Lru::new(4);
        for s in 0..4 {
            lru.insert(s, u64::from(s));
        }
        lru.touch(0);
        assert_eq!(lru.victim(u64::MAX, &mut |_| true), Some(1));
        assert_eq!(lru.victim(u64::MAX, &mut |s| s != 1), Some(2));
        lru.remove(1);
        lru.remove(2);
        assert_eq!(lru.victim(u64::MAX, &mut |_| true), Some(3));
        lru.remove(3);
        lru.remove(0);
        assert_eq!(lru.victim(u64::MAX, &mut |_| true), None);
    }
}
