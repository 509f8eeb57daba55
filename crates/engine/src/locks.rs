//! Per-line exclusion: a request holds every line it touches for its whole duration, so
//! concurrent requests on the same line never see torn or stale data, and a line in use is
//! never chosen for eviction. Locks are taken in ascending line order (no deadlock) and
//! sharded so unrelated requests rarely meet on a mutex.

use crate::sync::{Condvar, Mutex, MutexGuard};
use std::collections::HashSet;

const SHARDS: usize = 64;

/// A line of a volume, packed as `volume << 48 | line` (lines stay below 2^48: 2^60 bytes).
pub type LineKey = u64;

pub fn line_key(volume: u16, line: u64) -> LineKey {
    debug_assert!(line < 1 << 48);
    (u64::from(volume) << 48) | line
}

#[derive(Default)]
struct Shard {
    held: Mutex<Held>,
    freed: Condvar,
}

/// A shard's held lines, and how many requests wait for one of them: an unlock wakes waiters
/// only when there are some (a wake is a system call, and most unlocks have no waiter).
#[derive(Default)]
struct Held {
    keys: HashSet<LineKey>,
    waiters: usize,
}

pub struct LineLocks {
    shards: Vec<Shard>,
}

fn shard_of(key: LineKey) -> usize {
    // Neighbouring lines land in different shards.
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS
}

fn lock_set(shard: &Shard) -> MutexGuard<'_, Held> {
    // A panic while holding this mutex leaves the set consistent (insert/remove only).
    shard.held.lock().unwrap_or_else(|p| p.into_inner())
}

impl LineLocks {
    pub fn new() -> LineLocks {
        LineLocks {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }

    /// Holds lines `first..=last` of `volume` until the guard drops.
    pub fn lock_range(&self, volume: u16, first: u64, last: u64) -> RangeGuard<'_> {
        for line in first..=last {
            let key = line_key(volume, line);
            let shard = &self.shards[shard_of(key)];
            let mut held = lock_set(shard);
            while held.keys.contains(&key) {
                held.waiters += 1;
                held = shard.freed.wait(held).unwrap_or_else(|p| p.into_inner());
                held.waiters -= 1;
            }
            held.keys.insert(key);
        }
        RangeGuard {
            locks: self,
            volume,
            first,
            last,
        }
    }

    /// Like `lock_range`, but never waits: `None` (holding nothing) when a line is held.
    /// A batch of hits takes its later requests' lines so (docs/design.md §6.1): it never
    /// waits for a line while it holds others.
    pub fn try_lock_range(&self, volume: u16, first: u64, last: u64) -> Option<RangeGuard<'_>> {
        for line in first..=last {
            let key = line_key(volume, line);
            let taken = lock_set(&self.shards[shard_of(key)]).keys.insert(key);
            if !taken {
                if line > first {
                    // Gives back the lines taken so far (and wakes their waiters).
                    drop(RangeGuard {
                        locks: self,
                        volume,
                        first,
                        last: line - 1,
                    });
                }
                return None;
            }
        }
        Some(RangeGuard {
            locks: self,
            volume,
            first,
            last,
        })
    }

    pub fn is_held(&self, key: LineKey) -> bool {
        lock_set(&self.shards[shard_of(key)]).keys.contains(&key)
    }
}

impl Default for LineLocks {
    fn default() -> Self {
        Self::new()
    }
}

pub struct RangeGuard<'a> {
    locks: &'a LineLocks,
    volume: u16,
    first: u64,
    last: u64,
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        for line in self.first..=self.last {
            let key = line_key(self.volume, line);
            let shard = &self.locks.shards[shard_of(key)];
            let mut held = lock_set(shard);
            held.keys.remove(&key);
            if held.waiters > 0 {
                shard.freed.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn overlapping_ranges_exclude_each_other() {
        let locks = Arc::new(LineLocks::new());
        let inside = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (locks, inside) = (locks.clone(), inside.clone());
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        let _g = locks.lock_range(1, (i + t) % 3, 3 + (i % 2));
                        assert!(
                            !inside.swap(true, Ordering::SeqCst),
                            "two holders of line 3"
                        );
                        assert!(locks.is_held(line_key(1, 3)));
                        inside.store(false, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok());
        }
        assert!(!locks.is_held(line_key(1, 3)));
    }

    #[test]
    fn try_lock_takes_all_or_nothing() {
        let locks = LineLocks::new();
        let held = locks.lock_range(1, 5, 5);
        assert!(locks.try_lock_range(1, 3, 6).is_none());
        for line in [3, 4, 6] {
            assert!(!locks.is_held(line_key(1, line)), "line {line} kept");
        }
        assert!(locks.try_lock_range(1, 5, 5).is_none());
        drop(held);
        let all = locks.try_lock_range(1, 3, 6);
        assert!(all.is_some());
        assert!(locks.is_held(line_key(1, 5)));
        drop(all);
        assert!(!locks.is_held(line_key(1, 5)));
    }
}
