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
//! A long read or write is cut into pieces of at most [`PIECE`] bytes first, so its scratch
//! buffer stays small.
//!
//! The last bytes of a backing device whose size is not a multiple of 4 KiB form no whole
//! sector and are not served (the NBD export's size is rounded down to a whole sector).

use ssdcache_device::AlignedBuf;
use ssdcache_format::{CacheMode, SECTOR_SIZE};

use super::{DiskImage, Fill, Volume};
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

    /// Where the sectors a write of `length` bytes only partly covers begin, relative to
    /// `start`: the first, the last, or both (one sector when they are the same).
    fn partial_edges(&self, length: usize) -> [Option<u64>; 2] {
        let last = self.len - SECTOR_SIZE;
        let head = self.head_is_partial().then_some(0);
        let tail = (self.tail_is_partial(length) && head != Some(last)).then_some(last);
        [head, tail]
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
    /// Serves a read that is not made of whole sectors, piece by piece (`pieces`): a piece of
    /// whole sectors straight into `buf`, a partial one through the whole sectors around it.
    /// True when every sector was in the cache.
    ///
    /// The stream detector sees the request once, as the client sent it (review 44: each
    /// piece taken for a request continued the one before, and the rest of one long request
    /// bypassed the cache as a stream).
    pub(super) fn read_partial(&self, offset: u64, buf: &mut [u8]) -> Result<bool> {
        let bypass = Some(self.stream_bypass(offset, buf.len() as u64));
        let mut all_hit = true;
        for (at, len) in pieces(offset, buf.len() as u64) {
            let part = &mut buf[(at - offset) as usize..][..len as usize];
            all_hit &= match Widened::of(at, len) {
                Some(wide) => {
                    let mut whole = AlignedBuf::zeroed(wide.len as usize);
                    let hit = self.read_sectors(wide.start, &mut whole, bypass)?;
                    part.copy_from_slice(&whole[wide.at..wide.at + part.len()]);
                    hit
                }
                None => self.read_sectors(at, part, bypass)?,
            };
        }
        Ok(all_hit)
    }

    /// Serves a write that is not made of whole sectors, piece by piece (`pieces`): a piece of
    /// whole sectors as any write, a partial one by read-modify-write (`write_partial_piece`).
    /// The caller holds the mode gate. The stream detector sees the request once and it counts
    /// one write hit at most, whatever its pieces (review 44).
    pub(super) fn write_partial(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let bypass = self.write_bypasses(offset, data.len() as u64);
        let mut hit = false;
        for (at, len) in pieces(offset, data.len() as u64) {
            let part = &data[(at - offset) as usize..][..len as usize];
            hit |= match Widened::of(at, len) {
                Some(wide) => self.write_partial_piece(wide, part, fua, bypass)?,
                None => self.write_sectors(at, part, fua, bypass)?,
            };
        }
        self.count_write_hit(hit);
        Ok(())
    }

    /// Read-modify-write of a partial-sector write: its lines are held from the read of its
    /// partial sectors to the end of the write of the whole ones (which never releases them
    /// across the disk write, as whole-sector writes may), so no other write of those sectors
    /// can land in between and be overwritten with the old bytes. The caller holds the mode
    /// gate.
    fn write_partial_piece(
        &self,
        wide: Widened,
        data: &[u8],
        fua: bool,
        bypass: bool,
    ) -> Result<bool> {
        let mut whole = AlignedBuf::zeroed(wide.len as usize);
        let held = match self.read_edges_before_holding(wide, data.len(), &mut whole)? {
            Some(held) => held,
            None => {
                // Waits for disk writes of the range in flight first, as a read of the disk or
                // a write to it must; a write-back write whose partial sectors are cached needs
                // neither.
                let range = (wide.start, wide.len);
                let held = self.lock_lines_disk_idle(range, range, || {
                    self.mode() == CacheMode::WriteBack && self.edges_cached(wide.start, wide.len)
                });
                for edge in wide.partial_edges(data.len()).into_iter().flatten() {
                    self.read_edge_held(wide, edge, &mut whole, None)?;
                }
                held
            }
        };
        whole[wide.at..wide.at + data.len()].copy_from_slice(data);
        self.write_held(wide.start, &whole, fua, (held, KeepHeld::Always), bypass)
    }

    /// In write-back, a partial sector the cache does not hold is read from the disk without
    /// the lines held (as a read miss is, `read_line_unheld`), so hits on the lines' other
    /// sectors and write-back writes of them do not wait for the disk (review 42, F1). What
    /// it read is used only if no disk write of the range began since (the lines were taken
    /// with none in flight): then the partial sectors are in `whole` and the lines are held
    /// again, returned. `None`: the caller reads them holding the lines (outside write-back,
    /// where the write holds them across its disk write anyway; when the cache holds them;
    /// when a disk write of the range began meanwhile).
    fn read_edges_before_holding(
        &self,
        wide: Widened,
        length: usize,
        whole: &mut [u8],
    ) -> Result<Option<super::RangeGuard<'_>>> {
        let edges = wide.partial_edges(length);
        let uncached = |at: u64| !self.all_cached(wide.start + at, SECTOR_SIZE);
        let from_disk: Vec<u64> = edges
            .into_iter()
            .flatten()
            .filter(|&at| uncached(at))
            .collect();
        if self.mode() != CacheMode::WriteBack || from_disk.is_empty() {
            return Ok(None);
        }
        let range = (wide.start, wide.len);
        let held = self.lock_lines_disk_idle(range, range, || false);
        let current = self
            .backing()
            .begin_read_then_fill(wide.start, wide.len, false);
        drop(held);
        let mut images = Vec::with_capacity(from_disk.len());
        for at in from_disk {
            let mut data = AlignedBuf::zeroed(SECTOR_SIZE as usize);
            self.read_backing(&mut data, wide.start + at)?;
            images.push(DiskImage {
                offset: wide.start + at,
                data,
            });
        }
        let held = self.lock_lines(wide.start, wide.len);
        if !current.finish() {
            return Ok(None);
        }
        for edge in edges.into_iter().flatten() {
            let image = images.iter().position(|i| i.offset == wide.start + edge);
            let image = image.map(|i| images.swap_remove(i));
            self.read_edge_held(wide, edge, whole, image)?;
        }
        Ok(Some(held))
    }

    /// Reads the partial sector at `at` within `whole`, its lines held by the caller: a dirty
    /// or cached sector from the cache, else from `image` (the disk's bytes, still current)
    /// or the disk.
    fn read_edge_held(
        &self,
        wide: Widened,
        at: u64,
        whole: &mut [u8],
        mut image: Option<DiskImage>,
    ) -> Result<()> {
        let sector = &mut whole[at as usize..(at + SECTOR_SIZE) as usize];
        self.read_locked(wide.start + at, sector, Fill::Nothing, &mut image)
            .map(|_| ())
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

/// The longest piece of a partial request served at once: a request that is not made of whole
/// sectors is cut at multiples of it, so the scratch buffer of its partial pieces (the whole
/// sectors around them, outside the server's request-memory limit) holds at most this plus two
/// sectors, whatever the request's length. The pieces between are whole sectors, served as any
/// request (NBD promises no atomicity to a request overlapping another in flight).
pub(super) const PIECE: u64 = 1 << 20;

/// `[offset, offset + length)` cut at multiples of [`PIECE`]: (offset, length) of each piece.
fn pieces(offset: u64, length: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset + length;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let piece_end = (at / PIECE + 1).saturating_mul(PIECE).min(end);
        let piece = (at, piece_end - at);
        at = piece_end;
        Some(piece)
    })
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
    fn partial_edges_name_each_partly_covered_sector_once() {
        let one = Widened::of(512, 512).expect("partial");
        assert_eq!(one.partial_edges(512), [Some(0), None]);
        let both = Widened::of(1024, 8192).expect("partial");
        assert_eq!(both.partial_edges(8192), [Some(0), Some(8192)]);
        let tail = Widened::of(4096, 5000).expect("partial");
        assert_eq!(tail.partial_edges(5000), [None, Some(4096)]);
        let head = Widened::of(100, 3996).expect("partial");
        assert_eq!(head.partial_edges(3996), [Some(0), None]);
    }

    #[test]
    fn partial_requests_are_cut_at_piece_multiples() {
        let cut: Vec<_> = pieces(512, 3 * PIECE).collect();
        assert_eq!(
            cut,
            [
                (512, PIECE - 512),
                (PIECE, PIECE),
                (2 * PIECE, PIECE),
                (3 * PIECE, 512)
            ]
        );
        assert_eq!(pieces(100, 10).collect::<Vec<_>>(), [(100, 10)]);
        let near_end = u64::MAX - 10;
        assert_eq!(pieces(near_end, 10).collect::<Vec<_>>(), [(near_end, 10)]);
        for (_, len) in pieces(4095, 5 * PIECE + 7) {
            assert!(len <= PIECE);
        }
    }

    #[test]
    fn trims_keep_only_whole_sectors_inside() {
        assert_eq!(whole_sectors_inside(512, 512).1, 0);
        assert_eq!(whole_sectors_inside(512, 8192), (4096, 4096));
        assert_eq!(whole_sectors_inside(0, 4096), (0, 4096));
        assert_eq!(whole_sectors_inside(4000, 100).1, 0);
    }
}
