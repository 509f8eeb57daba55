//! The on-disk format of an ssdcache cache device.
//!
//! Pure encode/decode with checksums; no I/O. `docs/design.md` carries the same layout as
//! byte tables; keep the two in step. Everything is little-endian.
//!
//! Cache device layout (offsets in bytes):
//!
//! | region | offset | length |
//! |---|---|---|
//! | superblock copy A | 0 | 64 KiB |
//! | superblock copy B | 64 KiB | 64 KiB |
//! | metadata (line-record checkpoint) | 1 MiB | `meta_len` |
//! | journal (circular log of line records) | `journal_offset` | `journal_len` |
//! | data (cache lines) | `data_offset` | `line_count * line_size` |

mod bytes;
pub mod journal;
pub mod layout;
pub mod lines;
pub mod superblock;

pub use layout::{Layout, LayoutError};
pub use lines::{sector_crc, LineRecord, MetaPage, MetaPageError, SectorBitmap};
pub use superblock::{
    BackingIdentity, BackingKind, CacheMode, CacheState, Superblock, SuperblockError,
    VolumeCounters, VolumeSlot,
};

/// The unit of validity and of I/O alignment: one 4 KiB sector.
pub const SECTOR_SIZE: u64 = 4096;
/// Smallest and largest cache line size accepted at create.
pub const MIN_LINE_SIZE: u64 = 4096;
pub const MAX_LINE_SIZE: u64 = 1 << 20;
/// Current on-disk format version. A reader refuses a newer version, and version 1 (development
/// builds before line records carried sector checksums).
pub const FORMAT_VERSION: u32 = 2;
