//! Replacement policies. A policy only decides (which slot to evict); the engine does the I/O
//! and the bookkeeping. Slots are dense indices `0..line_count`, so a policy keeps its state in
//! flat arrays indexed by slot, not in per-entry allocations; the policies that remember
//! evicted lines (ghosts) keep them in tables of fixed size allocated at construction. Nothing
//! allocates per request.

mod arc;
mod clock;
mod fifo;
mod ghost;
mod lirs;
mod list;
mod lru;
mod s3fifo;

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
/// needs a slot and none is free. It releases the slot `victim` returns right away, so the
/// next call is `remove` of that slot: policies with ghosts record the evicted line's key
/// there, in the `remove` that follows the `victim` returning that slot. Any other `remove`
/// is an invalidation (TRIM, overwrite-around, recovery dropping a line) and leaves no ghost.
/// After a `victim` that is not followed by the `remove` of its slot, the slot stays tracked
/// and no ghost is recorded.
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
    /// The slot to evict next, never one for which `evictable` is false (the engine's
    /// predicate excludes lines in use, dirty lines and lines pending a journal commit).
    /// `None` exactly when no tracked slot is evictable. The policy may reorder its state
    /// while it looks (a CLOCK hand moves on, a non-evictable slot is reinserted) but it keeps
    /// every slot tracked, and the search is bounded.
    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
    /// How many slots the policy tracks (inserted and not removed).
    fn tracked(&self) -> u32;
    fn name(&self) -> &'static str;
}

/// Builds the policy stored in a volume's configuration, for a cache of `slots` slots. Ids
/// are stored on disk, so they never change: 0 lru, 1 fifo, 2 clock, 3 arc, 4 s3fifo, 5 s3fifo-1bit, 6 lirs.
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
    Some(p)
}
