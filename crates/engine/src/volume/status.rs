//! Block status: which ranges of a volume are holes (NBD's `base:allocation` context,
//! docs/design.md §3 "Block status"). A range is a hole when the backing device has nothing
//! allocated there (`BlockDevice::allocation`: SEEK_DATA/SEEK_HOLE on files) and the cache
//! holds no dirty sector of it; it then reads as zeroes (a clean cached sector equals the
//! backing device's). Dirty sectors are looked up *before* the backing device is asked: data
//! only moves from dirty in the cache to allocated on the disk (the cleaner marks a sector
//! clean after its disk write returned), so a sector clean at the first look is allocated at
//! the second, and no written data is ever reported as a hole.

use ssdcache_device::Run;
use ssdcache_format::SECTOR_SIZE;

use super::Volume;
use crate::error::Result;

/// Most runs one answer holds (NBD lets a server describe less than asked; the client asks
/// again from where the answer ends).
pub const MAX_STATUS_RUNS: usize = 256;
/// Most cache lines one answer looks up for dirty sectors (under the map's read lock), so a
/// query of gigabytes of a volume with dirty data holds that lock briefly.
const MAX_STATUS_LINES: u64 = 16_384;

impl Volume {
    /// How `[offset, offset + length)` reads: consecutive runs of data and of holes from
    /// `offset`, at most [`MAX_STATUS_RUNS`]; they may cover less than `length`, never more.
    pub fn allocation(&self, offset: u64, length: u64) -> Result<Vec<Run>> {
        self.check_bytes(offset, length)?;
        let mut length = length;
        let dirty = if self.has_dirty() {
            length = length.min(MAX_STATUS_LINES * self.core.layout.line_size);
            let (dirty, looked_up_to) = self.dirty_ranges(offset, length);
            // Past the dirty ranges kept, the answer would not know what is dirty: it ends
            // there (the client asks again from its end).
            length = length.min(looked_up_to.saturating_sub(offset));
            dirty
        } else {
            Vec::new()
        };
        if length == 0 {
            return Ok(Vec::new());
        }
        let runs = self
            .backing()
            .allocation(offset, length, MAX_STATUS_RUNS)
            .map_err(|e| self.backing_err(e))?;
        Ok(overlay_dirty(offset, &runs, &dirty, MAX_STATUS_RUNS))
    }

    /// The dirty sectors of the whole sectors around `[offset, offset + length)`, as sorted,
    /// merged byte ranges `(start, end)`, at most [`MAX_STATUS_RUNS`] of them (more could
    /// not show in one answer: each splits a hole): then also where the look-up stopped, the
    /// start of the first range left out; else the end of the range (review 45: scattered
    /// dirty sectors of 16,384 lines made millions of ranges, outside every memory limit).
    fn dirty_ranges(&self, offset: u64, length: u64) -> (Vec<(u64, u64)>, u64) {
        let start = offset - offset % SECTOR_SIZE;
        let end = (offset + length)
            .next_multiple_of(SECTOR_SIZE)
            .min(self.size());
        let map = self.core.map_read();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for seg in self.segments(start, end - start) {
            let Some(dirty) = map
                .peek(self.id, seg.line)
                .and_then(|hit| map.dirty_of(hit.slot))
            else {
                continue;
            };
            for sector in seg.first_sector..seg.first_sector + seg.sectors {
                if !dirty.get(sector) {
                    continue;
                }
                let at = seg.offset + (sector - seg.first_sector) as u64 * SECTOR_SIZE;
                if let Some(last) = ranges.last_mut().filter(|last| last.1 == at) {
                    last.1 = at + SECTOR_SIZE;
                } else if ranges.len() == MAX_STATUS_RUNS {
                    return (ranges, at);
                } else {
                    ranges.push((at, at + SECTOR_SIZE));
                }
            }
        }
        (ranges, offset + length)
    }
}

/// `runs` from `offset` with every part of a hole that a dirty range covers turned to data,
/// neighbours of one kind merged, at most `max_runs` (the last cut where the limit falls).
fn overlay_dirty(offset: u64, runs: &[Run], dirty: &[(u64, u64)], max_runs: usize) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    let mut push = |len: u64, hole: bool| match out.last_mut() {
        Some(last) if last.hole == hole => last.len += len,
        _ => out.push(Run { len, hole }),
    };
    let mut at = offset;
    for run in runs {
        let end = at + run.len;
        if !run.hole {
            push(run.len, false);
            at = end;
            continue;
        }
        let mut pos = at;
        for &(d_start, d_end) in dirty.iter().filter(|d| d.1 > at && d.0 < end) {
            let d_start = d_start.max(at);
            if d_start > pos {
                push(d_start - pos, true);
            }
            let d_end = d_end.min(end);
            push(d_end - d_start.max(pos), false);
            pos = d_end;
        }
        if end > pos {
            push(end - pos, true);
        }
        at = end;
    }
    out.truncate(max_runs);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(len: u64, hole: bool) -> Run {
        Run { len, hole }
    }

    #[test]
    fn dirty_sectors_in_a_hole_are_data() {
        let runs = [run(8192, false), run(16384, true), run(4096, false)];
        let dirty = [(12288, 16384)];
        assert_eq!(
            overlay_dirty(0, &runs, &dirty, 16),
            [
                run(8192, false),
                run(4096, true),
                run(4096, false),
                run(8192, true),
                run(4096, false)
            ]
        );
    }

    #[test]
    fn dirty_data_at_a_hole_edge_merges_with_its_neighbour() {
        let runs = [run(4096, false), run(8192, true)];
        let dirty = [(4096, 8192)];
        assert_eq!(
            overlay_dirty(0, &runs, &dirty, 16),
            [run(8192, false), run(4096, true)]
        );
        let whole = [(0, 1 << 20)];
        assert_eq!(overlay_dirty(4096, &runs, &whole, 16), [run(12288, false)]);
    }

    #[test]
    fn dirty_ranges_outside_the_runs_change_nothing_and_runs_are_capped() {
        let runs = [run(4096, true), run(4096, false), run(4096, true)];
        assert_eq!(overlay_dirty(8192, &runs, &[(0, 4096)], 16), runs);
        assert_eq!(overlay_dirty(8192, &runs, &[], 2), &runs[..2]);
    }
}
