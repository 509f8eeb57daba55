//! Requests that do not cover whole 4 KiB sectors (docs/design.md §3, "Byte-granular
//! requests"). The cache keeps whole sectors (their validity, dirtiness and checksums are per
//! sector), so a request whose offset or length is not a multiple of [`SECTOR_SIZE`] is served
//! through the whole sectors around it:
//!
//! * a read reads them and returns the bytes asked for;
//! * a write reads the partial first and last sectors, lays the new bytes over them and writes
//!   the whole sectors, all while holding the lines of the range (read-modify-write under the
//!   line lock): two writes of different bytes of one sector, sent together, both land, and
//!   the write takes the normal path of its mode for the whole sectors (durability unchanged:
//!   FUA, FLUSH, the journal and the cleaner see only whole sectors);
//! * write-zeroes writes zeroed bytes into its partial sectors that way and zeroes the whole
//!   sectors between them on the backing device;
//! * trim discards only the whole sectors inside its range (a discard is advisory: NBD lets a
//!   server discard less than asked);
//! * a prefetch caches the whole sectors around its range.
//!
//! The last bytes of a backing device whose size is not a multiple of 4 KiB form no whole
//! sector and are not served (the NBD export's size is rounded down to a whole sector).

use ssdcache_device::AlignedBuf;
use ssdcache_format::{CacheMode, SECTOR_SIZE};

use super::{Fill, Volume};
use crate::error::Result;

/// The whole sectors around a byte range that is not made of whole sectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Widened {
    /// Where the sectors begin (a multiple of [`SECTOR_SIZE`]).
    pub start: u64,
    /// Their length in bytes (a multiple of [`SECTOR_SIZE`]).
    pub len: u64,
    /// Where the request's bytes begin within them.
    pub at: usize,
}

impl Widened {
    /// The whole sectors around `[offset, offset + length)`, or `None` when the range is made
    /// of whole sectors already. `offset + length` must not overflow (the caller checked it).
    pub fn of(offset: u64, length: u64) -> Option<Widened> {
        if offset.is_multiple_of(SECTOR_SIZE) && length.is_multiple_of(SECTOR_SIZE) {
            return None;
        }
        let start = offset - offset % SECTOR_SIZE;
        let end = round_up(offset + length);
        Some(Widened {
            start,
            len: end - start,
            at: (offset - start) as usize,
        })
    }

    /// Whether the first sector holds bytes outside the request (bytes the write must keep).
    fn head_is_partial(&self) -> bool {
        self.at != 0
    }

    /// Whether the last sector holds bytes outside a request of `length` bytes.
    fn tail_is_partial(&self, length: usize) -> bool {
        !(self.at + length).is_multiple_of(SECTOR_SIZE as usize)
    }
}

/// `value` rounded up to a whole sector (`None` past `u64::MAX`).
pub(super) fn checked_round_up(value: u64) -> Option<u64> {
    value.checked_next_multiple_of(SECTOR_SIZE)
}

fn round_up(value: u64) -> u64 {
    value.next_multiple_of(SECTOR_SIZE)
}

impl Volume {
    /// Reads the whole sectors around a partial-sector read, then copies out the bytes asked
    /// for. True when every sector was in the cache.
    pub(super) fn read_partial(&self, wide: Widened, buf: &mut [u8]) -> Result<bool> {
        let mut whole = AlignedBuf::zeroed(wide.len as usize);
        let hit = self.read_sectors(wide.start, &mut whole)?;
        buf.copy_from_slice(&whole[wide.at..wide.at + buf.len()]);
        Ok(hit)
    }

    /// Read-modify-write of a partial-sector write: its lines are held from the read of its
    /// partial sectors to the end of the write of the whole ones (which never releases them
    /// across the disk write, as whole-sector writes may), so no other write of those sectors
    /// can land in between and be overwritten with the old bytes. The caller holds the mode
    /// gate.
    pub(super) fn write_partial(&self, wide: Widened, data: &[u8], fua: bool) -> Result<()> {
        // Waits for disk writes of the range in flight first, as a read of the disk or a write
        // to it must; a write-back write whose partial sectors are cached needs neither.
        let range = (wide.start, wide.len);
        let held = self.lock_lines_disk_idle(range, range, || {
            self.mode() == CacheMode::WriteBack && self.edges_cached(wide.start, wide.len)
        });
        let mut whole = AlignedBuf::zeroed(wide.len as usize);
        self.read_partial_sectors_held(wide, data.len(), &mut whole)?;
        whole[wide.at..wide.at + data.len()].copy_from_slice(data);
        self.write_held(wide.start, &whole, fua, held, KeepHeld::Always)
    }

    /// Reads the partial first and last sectors of a write into `whole`, the range's lines
    /// held by the caller (dirty sectors from the cache, the rest from wherever they are).
    fn read_partial_sectors_held(
        &self,
        wide: Widened,
        length: usize,
        whole: &mut [u8],
    ) -> Result<()> {
        let sector = SECTOR_SIZE as usize;
        let last = whole.len() - sector;
        if wide.head_is_partial() {
            self.read_locked(wide.start, &mut whole[..sector], Fill::Nothing, &mut None)?;
        }
        let tail_read_already = wide.head_is_partial() && last == 0;
        if wide.tail_is_partial(length) && !tail_read_already {
            let at = wide.start + last as u64;
            self.read_locked(at, &mut whole[last..], Fill::Nothing, &mut None)?;
        }
        Ok(())
    }

    /// Zeroes `[offset, offset + length)` where it is not whole sectors: its partial first
    /// and last sectors by read-modify-write, the whole sectors between with `zero_whole`.
    pub(super) fn write_zeroes_partial(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        zero_whole: impl FnOnce(u64, u64) -> Result<()>,
    ) -> Result<()> {
        let (inner_start, inner_len) = whole_sectors_inside(offset, length);
        let inner_end = inner_start + inner_len;
        let end = offset + length;
        let zeroes = vec![0u8; SECTOR_SIZE as usize];
        for (from, to) in [(offset, inner_start), (inner_end, end)] {
            if to > from {
                self.write_checked(from, &zeroes[..(to - from) as usize], fua)?;
            }
        }
        if inner_len > 0 {
            zero_whole(inner_start, inner_len)?;
        }
        Ok(())
    }
}

/// The whole sectors inside `[offset, offset + length)`: what a trim may discard.
pub(super) fn whole_sectors_inside(offset: u64, length: u64) -> (u64, u64) {
    let end = offset + length;
    let start = round_up(offset).min(end);
    let inner_end = (end - end % SECTOR_SIZE).max(start);
    (start, inner_end - start)
}

/// Whether a write of whole sectors may release its lines across the disk write
/// (`Volume::write_held`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeepHeld {
    /// Lines without dirty data are released across the disk write outside write-back.
    WhenDirty,
    /// The lines stay held to the end (a read-modify-write).
    Always,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_sectors_are_not_widened() {
        assert_eq!(Widened::of(0, 4096), None);
        assert_eq!(Widened::of(8192, 65536), None);
    }

    #[test]
    fn partial_ranges_widen_to_the_sectors_around_them() {
        assert_eq!(
            Widened::of(512, 512),
            Some(Widened {
                start: 0,
                len: 4096,
                at: 512
            })
        );
        assert_eq!(
            Widened::of(4095, 2),
            Some(Widened {
                start: 0,
                len: 8192,
                at: 4095
            })
        );
        assert_eq!(
            Widened::of(8192, 1),
            Some(Widened {
                start: 8192,
                len: 4096,
                at: 0
            })
        );
        let w = Widened::of(1024, 8192).expect("partial");
        assert!(w.head_is_partial() && w.tail_is_partial(8192));
        let w = Widened::of(4096, 5000).expect("partial");
        assert!(!w.head_is_partial() && w.tail_is_partial(5000));
    }

    #[test]
    fn trims_keep_only_whole_sectors_inside() {
        assert_eq!(whole_sectors_inside(512, 512).1, 0);
        assert_eq!(whole_sectors_inside(512, 8192), (4096, 4096));
        assert_eq!(whole_sectors_inside(0, 4096), (0, 4096));
        assert_eq!(whole_sectors_inside(4000, 100).1, 0);
    }
}
