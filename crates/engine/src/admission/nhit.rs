//! N-hit admission: a missed line takes a cache slot only on its n-th miss. The misses of lines
//! not (yet) admitted are counted in a ghost table (keys and counts, no data) of fixed
//! capacity, allocated once; when it is full the key whose last miss is the oldest is
//! forgotten, so "n-th miss" means n misses within the table's memory.
//!
//! Why: on an SSD every fill is a write that wears it, and in block traces a large share of the
//! lines read are read once and never again ("one-hit wonders"). With 2-hit admission such a
//! line never costs an SSD write, and it does not push reused data out of the cache either.
//! The cost: the first reuse of a line also misses (it is cached on that miss and hits from the
//! next access on), so a workload that reuses everything once soon after the first access
//! gains later than with `always`.

use crate::policy::ghost::Ghosts;

/// The one ghost list the table uses (the ghost table supports several).
const LIST: usize = 0;

/// Counts misses per key and says when a key has missed often enough to be cached. Plain
/// data: no locking inside (the engine keeps one per volume behind a mutex; a simulator owns
/// one outright). Nothing allocates after [`NHitAdmission::new`].
pub struct NHitAdmission {
    n: u32,
    ghosts: Ghosts,
    /// Misses so far of the key in each ghost entry (indexed by entry), always below `n`.
    misses: Vec<u32>,
}

impl NHitAdmission {
    /// Admits a key on its `n`-th miss, remembering the misses of at most `ghost_entries`
    /// keys (at least one; the engine gives the cache's line count, so the table remembers
    /// about as many lines as the cache holds). `n` ≤ 1 admits every key and keeps no table.
    pub fn new(n: u32, ghost_entries: usize) -> NHitAdmission {
        let capacity = if n <= 1 {
            1
        } else {
            u32::try_from(ghost_entries).unwrap_or(u32::MAX - 1).max(1)
        };
        NHitAdmission {
            n,
            ghosts: Ghosts::new(capacity, 1),
            misses: vec![0; capacity as usize],
        }
    }

    /// The miss count at which a key is admitted.
    pub fn n(&self) -> u32 {
        self.n
    }

    /// How many keys the table can remember.
    pub fn capacity(&self) -> usize {
        self.misses.len()
    }

    /// How many keys it remembers now (keys with at least one miss, not yet admitted).
    pub fn remembered(&self) -> usize {
        self.ghosts.len(LIST) as usize
    }

    /// Records a miss of `key` and says whether the key is admitted (may be cached) now: on
    /// its n-th remembered miss, after which the table forgets it (a line evicted later starts
    /// counting afresh). Call it for misses only; hits are never subject to admission.
    pub fn admit(&mut self, key: u64) -> bool {
        if self.n <= 1 {
            return true;
        }
        let seen = match self.ghosts.find(key) {
            Some(entry) => {
                let seen = self.misses[entry as usize] + 1;
                if seen >= self.n {
                    self.ghosts.remove(entry);
                    return true;
                }
                seen
            }
            None => {
                if self.ghosts.is_full() {
                    self.ghosts.pop_oldest(LIST);
                }
                1
            }
        };
        // Pushing an existing key moves it to the newest end: forgetting goes by last miss.
        let entry = self.ghosts.push(LIST, key);
        self.misses[entry as usize] = seen;
        false
    }

    /// Forgets every remembered miss.
    pub fn clear(&mut self) {
        while self.ghosts.pop_oldest(LIST) {}
    }
}

impl std::fmt::Debug for NHitAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NHitAdmission")
            .field("n", &self.n)
            .field("capacity", &self.capacity())
            .field("remembered", &self.remembered())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_on_the_nth_miss_then_counts_afresh() {
        for n in 2..=5u32 {
            let mut a = NHitAdmission::new(n, 100);
            for miss in 1..n {
                assert!(!a.admit(7), "n={n}: admitted on miss {miss}");
            }
            assert!(a.admit(7), "n={n}: not admitted on miss {n}");
            assert_eq!(a.remembered(), 0, "an admitted key leaves the table");
            // Evicted later and missed again: it must earn its slot again.
            assert!(!a.admit(7));
        }
    }

    #[test]
    fn keys_are_counted_separately() {
        let mut a = NHitAdmission::new(2, 100);
        assert!(!a.admit(1));
        assert!(!a.admit(2));
        assert!(!a.admit(3));
        assert!(a.admit(2));
        assert!(a.admit(1));
        assert!(!a.admit(4));
        assert!(a.admit(3));
        assert_eq!(a.remembered(), 1);
    }

    #[test]
    fn always_and_one_hit_admit_everything() {
        let mut a = NHitAdmission::new(1, 1000);
        assert!((0..1000u64).all(|k| a.admit(k)));
        assert_eq!(a.capacity(), 1, "n = 1 keeps no table");
        let mut z = NHitAdmission::new(0, 10);
        assert!(z.admit(5));
    }

    /// The memory is bounded: after `capacity` other keys missed, the first one is forgotten
    /// and its next miss counts as a first one.
    #[test]
    fn bounded_memory_forgets_the_oldest_miss() {
        let capacity = 64;
        let mut a = NHitAdmission::new(2, capacity);
        assert!(!a.admit(1_000));
        for k in 0..capacity as u64 - 1 {
            assert!(!a.admit(k));
        }
        assert_eq!(a.remembered(), capacity, "table full, key 1000 still in it");
        // One more key pushes out the oldest miss: key 1000.
        assert!(!a.admit(5_000));
        assert_eq!(a.remembered(), capacity);
        assert!(
            !a.admit(1_000),
            "a forgotten key starts from its first miss"
        );
        // Its miss refreshed nothing else: key 0 was the oldest and went for key 1000.
        assert!(!a.admit(0));
        // The recent keys are still remembered and admitted on their second miss.
        assert!(a.admit(capacity as u64 - 2));
        assert!(a.admit(5_000));
        assert!(a.remembered() <= capacity);
    }

    /// A miss moves a key to the newest end: a key missed regularly is never forgotten, however
    /// many one-hit wonders pass through.
    #[test]
    fn a_remissed_key_is_kept_over_one_hit_wonders() {
        let mut a = NHitAdmission::new(3, 16);
        assert!(!a.admit(42));
        let mut wonder = 1_000u64;
        let mut admitted = 0;
        for _ in 0..10 {
            for _ in 0..8 {
                assert!(!a.admit(wonder));
                wonder += 1;
            }
            if a.admit(42) {
                admitted += 1;
                // Admitted on its third miss; then it starts over.
                assert!(!a.admit(42));
            }
        }
        // Its 3rd miss comes every second round (the miss after an admission is a 1st).
        assert_eq!(admitted, 5);
        assert!(a.remembered() <= 16);
    }

    #[test]
    fn clear_forgets_everything() {
        let mut a = NHitAdmission::new(2, 8);
        for k in 0..8 {
            a.admit(k);
        }
        a.clear();
        assert_eq!(a.remembered(), 0);
        assert!(!a.admit(3));
    }
}
