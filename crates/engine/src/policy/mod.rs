//! Replacement policies. A policy only decides (which slot to evict); the engine does the I/O
//! and the bookkeeping. Slots are dense indices `0..line_count`, so a policy keeps its state in
//! flat arrays indexed by slot, not in per-entry allocations; the policies that remember
//! evicted lines (ghosts) keep them in tables of fixed size allocated at construction. Nothing
//! allocates per request.
//!
//! Ids are stable (they are stored in the superblock): see [`NAMES`].

mod arc;
mod clock;
mod fifo;
pub(crate) mod ghost;
mod lirs;
mod list;
mod lru;
mod s3fifo;

use std::collections::HashMap;

pub use arc::ArcPolicy;
pub use clock::Clock;
pub use fifo::Fifo;
pub use lirs::Lirs;
pub use lru::Lru;
pub use s3fifo::S3Fifo;

/// What the engine tells a policy and asks of it. Every call happens under the engine's map
/// lock, so implementations need no locking of their own.
///
/// The engine calls `insert` when a slot is filled (allocation, or restore at open), `touch`
/// on a lookup that finds the line, `remove` whenever a slot is released, and `victim` when it
/// needs a slot for a missing line and none is free. `victim` is told the key of the line that
/// will take the slot, so a policy can act on the miss before it chooses (ARC adapts its
/// target and applies its tie rule for a key in its B2 ghost list; S3-FIFO takes the key out
/// of its ghost queue before the eviction adds one). The engine releases the slot `victim`
/// returns right away, so the next call is `remove` of that slot: policies with ghosts record
/// the evicted line's key there, in the `remove` that follows the `victim` returning that
/// slot. Any other `remove` is an invalidation (TRIM, overwrite-around, recovery dropping a
/// line) and leaves no ghost. After a `victim` that is not followed by the `remove` of its
/// slot, the slot stays tracked and no ghost is recorded. Usually `insert` of the key comes
/// next; the engine may instead ask `victim` again for the same key (the released slot did not
/// come free), or give up (nothing evictable).
pub trait ReplacementPolicy: Send {
    /// A slot now holds the line `key` (newly filled). `key` identifies the line across
    /// evictions (the engine passes `line_key(volume, line)`), so a policy can tell a line
    /// that comes back after its eviction. The engine inserts only untracked slots and never
    /// one key in two slots; a tracked slot is dropped first, without a ghost.
    fn insert(&mut self, slot: u32, key: u64);
    /// The data of a slot was used (read or written). Ignored for an untracked slot.
    fn touch(&mut self, slot: u32);
    /// A slot was freed; it must not be returned as a victim any more. Ignored for an
    /// untracked slot.
    fn remove(&mut self, slot: u32);
    /// The slot to evict next to make room for the line `incoming` (a key as in `insert`, not
    /// tracked), never one for which `evictable` is false (the engine's predicate excludes
    /// lines in use, dirty lines and lines pending a journal commit).
    /// `None` exactly when no tracked slot is evictable. The policy may reorder its state
    /// while it looks (a CLOCK hand moves on, a non-evictable slot is reinserted) but it keeps
    /// every slot tracked, and the search is bounded.
    fn victim(&mut self, incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
    /// How many slots the policy tracks (inserted and not removed).
    fn tracked(&self) -> u32;
    fn name(&self) -> &'static str;
}

/// The policy `create`, `simulate` and `advise` use when none is given.
pub const DEFAULT_POLICY: &str = "lru";

/// Policy names by id: the id is the index. Ids are stored on disk, so they never change.
pub const NAMES: [&str; 7] = [
    "lru",
    "fifo",
    "clock",
    "arc",
    "s3fifo",
    "s3fifo-1bit",
    "lirs",
];

/// Every policy name, in id order.
pub fn names() -> &'static [&'static str] {
    &NAMES
}

/// The id of a policy name.
pub fn id_of(name: &str) -> Option<u32> {
    NAMES.iter().position(|&n| n == name).map(|i| i as u32)
}

/// Builds the policy stored in a volume's configuration, for a cache of `slots` slots.
pub fn by_id(id: u32, slots: u32) -> Option<Box<dyn ReplacementPolicy>> {
    let p: Box<dyn ReplacementPolicy> = match id {
        0 => Box::new(Lru::new(slots)),
        1 => Box::new(Fifo::new(slots)),
        2 => Box::new(Clock::new(slots)),
        3 => Box::new(ArcPolicy::new(slots)),
        4 => Box::new(S3Fifo::new(slots, 2)),
        5 => Box::new(S3Fifo::new(slots, 1)),
        6 => Box::new(Lirs::new(slots)),
        _ => return None,
    };
    debug_assert_eq!(p.name(), NAMES[id as usize]);
    Some(p)
}

/// Builds a policy by name (see [`names`]).
pub fn by_name(name: &str, slots: u32) -> Option<Box<dyn ReplacementPolicy>> {
    by_id(id_of(name)?, slots)
}

/// Replays a stream of line keys against `policy` over a cache of `slots` slots and counts
/// hits and misses, the way the engine drives a policy: a hit touches, a miss takes a free slot
/// or the policy's victim (every slot evictable), removes the victim and inserts the key.
/// The policy must be new (tracking nothing) and built for at least `slots` slots.
pub fn simulate_hits(
    policy: &mut dyn ReplacementPolicy,
    slots: u32,
    keys: impl Iterator<Item = u64>,
) -> (u64, u64) {
    let mut map: HashMap<u64, u32> = HashMap::with_capacity(slots as usize);
    let mut key_of: Vec<u64> = vec![0; slots as usize];
    let mut free: Vec<u32> = (0..slots).rev().collect();
    let (mut hits, mut misses) = (0u64, 0u64);
    for key in keys {
        if let Some(&slot) = map.get(&key) {
            hits += 1;
            policy.touch(slot);
            continue;
        }
        misses += 1;
        let slot = match free.pop() {
            Some(s) => s,
            None => {
                let Some(v) = policy.victim(key, &mut |_| true) else {
                    continue; // no slot at all
                };
                map.remove(&key_of[v as usize]);
                policy.remove(v);
                v
            }
        };
        key_of[slot as usize] = key;
        map.insert(key, slot);
        policy.insert(slot, key);
    }
    (hits, misses)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    #[test]
    fn ids_and_names_are_stable() {
        assert_eq!(
            names(),
            [
                "lru",
                "fifo",
                "clock",
                "arc",
                "s3fifo",
                "s3fifo-1bit",
                "lirs"
            ]
        );
        for (id, &name) in names().iter().enumerate() {
            assert_eq!(id_of(name), Some(id as u32));
            assert_eq!(by_id(id as u32, 8).unwrap().name(), name);
            assert_eq!(by_name(name, 8).unwrap().name(), name);
        }
        assert!(by_id(names().len() as u32, 8).is_none());
        assert!(by_name("mru", 8).is_none());
        assert_eq!(id_of("S3FIFO"), None);
    }

    #[test]
    fn policies_are_send() {
        fn send<T: Send>(_: &T) {}
        for id in 0..names().len() as u32 {
            send(&by_id(id, 4).unwrap());
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32, u64),
        Touch(u32),
        Remove(u32),
        /// Victim for an incoming key with an evictable mask over slots; then, as asked,
        /// nothing, remove the victim, or remove it and insert the incoming key there (what
        /// the engine does).
        Victim(u64, u64, After),
    }

    #[derive(Debug, Clone, Copy)]
    enum After {
        Nothing,
        Remove,
        RemoveInsert,
    }

    fn ops(slots: u32) -> impl Strategy<Value = Vec<Op>> {
        let mask = prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>(), any::<u64>()];
        let op = prop_oneof![
            4 => (0..slots, 0..48u64).prop_map(|(s, k)| Op::Insert(s, k)),
            3 => (0..slots).prop_map(Op::Touch),
            1 => (0..slots).prop_map(Op::Remove),
            4 => (
                mask,
                0..48u64,
                prop_oneof![Just(After::Nothing), Just(After::Remove), Just(After::RemoveInsert)]
            )
                .prop_map(|(m, k, a)| Op::Victim(m, k, a)),
        ];
        prop::collection::vec(op, 0..300)
    }

    /// A key the generated operations never insert.
    const NOT_HELD: u64 = 1 << 40;

    /// Drives a policy like the engine does and checks it against the set of tracked slots.
    fn check(id: u32, slots: u32, ops: &[Op]) -> Result<(), TestCaseError> {
        let mut p = by_id(id, slots).unwrap();
        let name = p.name();
        // Slot -> key of the lines held; keys are unique among them, as in the engine's map.
        let mut held: BTreeMap<u32, u64> = BTreeMap::new();
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Insert(s, k) => {
                    if held.contains_key(&s) || held.values().any(|&v| v == k) {
                        continue;
                    }
                    p.insert(s, k);
                    held.insert(s, k);
                }
                Op::Touch(s) => p.touch(s),
                Op::Remove(s) => {
                    p.remove(s);
                    held.remove(&s);
                }
                Op::Victim(mask, key, after) => {
                    let ok = |s: u32| mask >> (s % 64) & 1 == 1;
                    // The incoming line is never one held (the engine allocates for a miss);
                    // NOT_HELD stands in for it then, and is not inserted.
                    let (incoming, after) = match after {
                        _ if !held.values().any(|&v| v == key) => (key, after),
                        After::RemoveInsert => (NOT_HELD, After::Remove),
                        _ => (NOT_HELD, after),
                    };
                    let mut asked_untracked = BTreeSet::new();
                    let got = p.victim(incoming, &mut |s| {
                        if !held.contains_key(&s) {
                            asked_untracked.insert(s);
                        }
                        ok(s)
                    });
                    prop_assert!(
                        asked_untracked.is_empty(),
                        "{name}: op {i}: predicate asked about untracked slots {asked_untracked:?}"
                    );
                    match got {
                        Some(v) => {
                            prop_assert!(
                                held.contains_key(&v),
                                "{name}: op {i}: victim {v} untracked"
                            );
                            prop_assert!(ok(v), "{name}: op {i}: victim {v} not evictable");
                            if !matches!(after, After::Nothing) {
                                p.remove(v);
                                held.remove(&v);
                            }
                            if matches!(after, After::RemoveInsert) {
                                p.insert(v, incoming);
                                held.insert(v, incoming);
                            }
                        }
                        None => prop_assert!(
                            !held.keys().any(|&s| ok(s)),
                            "{name}: op {i}: no victim though one was evictable"
                        ),
                    }
                }
            }
            prop_assert_eq!(p.tracked() as usize, held.len(), "{}: op {}", name, i);
        }
        // Drain: every tracked slot comes out exactly once.
        let mut drained = BTreeSet::new();
        while let Some(v) = p.victim(NOT_HELD, &mut |_| true) {
            prop_assert!(drained.insert(v), "{name}: {v} returned twice");
            p.remove(v);
        }
        prop_assert_eq!(drained, held.keys().copied().collect::<BTreeSet<_>>());
        prop_assert_eq!(p.tracked(), 0);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        #[test]
        fn every_policy_matches_the_set_model(
            (slots, ops) in (1u32..=16).prop_flat_map(|n| (Just(n), ops(n)))
        ) {
            for id in 0..names().len() as u32 {
                check(id, slots, &ops)?;
            }
        }
    }

    use ssdcache_device::SplitMix64 as Rng;

    /// `count` keys out of `universe`, Zipf-distributed with exponent `s` (inverse CDF).
    fn zipf(universe: usize, s: f64, count: usize, seed: u64) -> Vec<u64> {
        let mut cdf = Vec::with_capacity(universe);
        let mut total = 0.0;
        for rank in 1..=universe {
            total += 1.0 / (rank as f64).powf(s);
            cdf.push(total);
        }
        let mut rng = Rng(seed);
        (0..count)
            .map(|_| {
                let u = rng.unit() * total;
                let rank = cdf.partition_point(|&c| c <= u).min(universe - 1);
                1 << 48 | rank as u64
            })
            .collect()
    }

    /// Hit ratio of every policy on a stream, by name.
    fn hit_ratios(slots: u32, keys: &[u64], what: &str) -> BTreeMap<&'static str, f64> {
        let mut out = BTreeMap::new();
        for id in 0..names().len() as u32 {
            let mut p = by_id(id, slots).unwrap();
            let (hits, misses) = simulate_hits(p.as_mut(), slots, keys.iter().copied());
            assert_eq!(hits + misses, keys.len() as u64);
            let ratio = hits as f64 / keys.len() as f64;
            eprintln!("{what}: {:12} hit ratio {ratio:.4}", p.name());
            out.insert(p.name(), ratio);
        }
        out
    }

    #[test]
    fn simulate_counts_hits_and_misses() {
        let mut p = Lru::new(2);
        let keys = [1u64, 2, 1, 3, 2, 1, 1];
        // 1 2 miss, 1 hit, 3 miss (evicts 2), 2 miss (evicts 1), 1 miss (evicts 3), 1 hit.
        assert_eq!(simulate_hits(&mut p, 2, keys.into_iter()), (2, 5));
        assert_eq!(
            simulate_hits(&mut Fifo::new(0), 0, keys.into_iter()),
            (0, 7)
        );
    }

    #[test]
    fn a_loop_one_longer_than_the_cache() {
        let n = 1000u32;
        let keys: Vec<u64> = (0..20).flat_map(|_| 0..=u64::from(n)).collect();
        let r = hit_ratios(n, &keys, "loop of n+1 over n");
        // Recency-only policies miss every time; so does ARC (every key of a loop is in T1,
        // and ARC evicts from a full T1 without a ghost).
        for name in ["lru", "fifo", "clock", "arc"] {
            assert_eq!(r[name], 0.0, "{name}");
        }
        for name in ["s3fifo", "s3fifo-1bit"] {
            assert!(r[name] > 0.3, "{name}: {}", r[name]);
        }
        assert!(r["lirs"] > 0.9, "lirs: {}", r["lirs"]);
    }

    #[test]
    fn a_hot_set_under_a_scan() {
        // 400 hot keys, 75% of the requests a one-time scan, over 1000 slots.
        let mut rng = Rng(7);
        let mut scan = 1u64 << 40;
        let keys: Vec<u64> = (0..200_000)
            .map(|_| {
                if rng.next_u64().is_multiple_of(4) {
                    rng.next_u64() % 400
                } else {
                    scan += 1;
                    scan
                }
            })
            .collect();
        let r = hit_ratios(1000, &keys, "hot set + scan");
        // At most the hot quarter of the requests can hit.
        for (name, &h) in &r {
            assert!(h <= 0.25, "{name}: {h}");
        }
        for name in ["arc", "s3fifo", "s3fifo-1bit", "lirs"] {
            assert!(r[name] > 0.2, "{name}: {}", r[name]);
            assert!(
                r[name] > r["lru"] + 0.05,
                "{name}: {} lru {}",
                r[name],
                r["lru"]
            );
        }
    }

    #[test]
    fn a_zipf_stream() {
        let keys = zipf(10_000, 0.9, 300_000, 42);
        let r = hit_ratios(1000, &keys, "zipf 0.9, 10% cache");
        for (name, &h) in &r {
            assert!((0.3..0.9).contains(&h), "{name}: {h}");
        }
        for name in ["arc", "s3fifo", "s3fifo-1bit", "lirs"] {
            assert!(
                r[name] >= r["fifo"],
                "{name}: {} fifo {}",
                r[name],
                r["fifo"]
            );
        }
        assert!(r["lru"] >= r["fifo"]);
    }
}
