//! Replacement policies. A policy only decides (which slot to evict); the engine does the I/O
//! and the bookkeeping. Slots are dense indices `0..line_count`, so a policy keeps its state in
//! flat arrays indexed by slot, not in per-entry allocations.

mod lru;

pub use lru::Lru;

/// What the engine tells a policy and asks of it. Every call happens under the engine's map
/// lock, so implementations need no locking of their own.
pub trait ReplacementPolicy: Send {
    /// A slot now holds data (newly filled).
    fn insert(&mut self, slot: u32);
    /// The data of a slot was used (read or written).
    fn touch(&mut self, slot: u32);
    /// A slot was freed (invalidated); it must not be returned as a victim any more.
    fn remove(&mut self, slot: u32);
    /// The slot to evict next, skipping slots for which `evictable` is false (in use by a
    /// request). `None` when no tracked slot is evictable.
    fn victim(&mut self, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
    fn name(&self) -> &'static str;
}

/// Builds the policy stored in a volume's configuration. Id 0 is LRU; more ids come with
/// more policies (the simulator issue).
pub fn by_id(id: u32, slots: u32) -> Option<Box<dyn ReplacementPolicy>> {
    match id {
        0 => Some(Box::new(Lru::new(slots))),
        _ => None,
    }
}
