//! The cache engine: maps backing lines to cache slots, runs the write-back, write-through,
//! write-around and pass-through modes, journals dirty state, writes it back (the cleaner),
//! persists its map at clean shutdown and recovers after a crash.
//! It reaches devices only through `ssdcache_device::BlockDevice`.

pub mod admission;
mod backing_order;
mod cache;
pub mod checksums;
pub mod cleaner;
mod commit;
mod counters;
mod error;
mod journal;
pub mod latency;
mod locks;
mod map;
pub mod policy;
pub mod residency;
mod sector_bits;
mod slot_index;
pub mod superblock;
mod sync;
mod touches;
mod volume;

pub use cache::{
    format, format_with_journal, offline_stats, Cache, NewVolume, OpenReport, RecoveryReport,
    VolumeBacking, VolumeList,
};
pub use checksums::{default_checksum_memory, ChecksumUsage};
pub use cleaner::{BatchReport, CleanerConfig, DamagedRange, Select};
pub use commit::CommitStats;
pub use error::{EngineError, Result};
pub use map::{dirty_limit_lines, DEFAULT_DIRTY_LIMIT};
pub use superblock::{read_superblock, write_superblock};
pub use volume::{
    BatchRead, HitPlan, RingEnd, RingHit, RingHits, Volume, VolumeState, VolumeStats,
    CACHE_ERROR_LIMIT,
};
