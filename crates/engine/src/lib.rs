//! The cache engine: maps backing lines to cache slots, runs the write-through, write-around
//! and pass-through modes, persists its map at clean shutdown and recovers at start.
//! It reaches devices only through `ssdcache_device::BlockDevice`.

pub mod admission;
mod cache;
mod error;
mod locks;
mod map;
pub mod policy;
mod volume;

pub use cache::{
    format, offline_stats, read_superblock, write_superblock, Cache, NewVolume, OpenReport,
};
pub use error::{EngineError, Result};
pub use volume::{Volume, VolumeStats};
