//! Requests as the cache sees them: the fixed-size lines (blocks) each one touches, keyed by
//! volume and block number in one `u64`.

use super::Request;

/// The volume goes in the top 16 bits of a key, the block number in the low 48.
pub const VOLUME_SHIFT: u32 = 48;
/// The largest block number a key holds.
pub const MAX_BLOCK: u64 = (1 << VOLUME_SHIFT) - 1;
/// The smallest line size [`block_keys`] accepts: with the readers' limit of
/// [`super::MAX_TRACE_BYTES`] (2^57) every block number of such a line fits in 48 bits.
pub const MIN_LINE_SIZE: u64 = 512;

const _: () = assert!(super::MAX_TRACE_BYTES / MIN_LINE_SIZE <= MAX_BLOCK + 1);
const _: () = assert!(super::MAX_VOLUMES as u64 <= 1 << (64 - VOLUME_SHIFT));

/// The key of block `block` of volume `volume`: `volume << 48 | block`. Unique as long as
/// `volume < 2^16` and `block < 2^48`, which the readers guarantee (at most
/// [`super::MAX_VOLUMES`] volumes, offsets below [`super::MAX_TRACE_BYTES`]) for line sizes of at
/// least [`MIN_LINE_SIZE`].
#[inline]
pub fn block_key(volume: u32, block: u64) -> u64 {
    debug_assert!(
        volume < super::MAX_VOLUMES,
        "volume {volume} has no room in a key"
    );
    debug_assert!(block <= MAX_BLOCK, "block {block} has no room in a key");
    (u64::from(volume) << VOLUME_SHIFT) | block
}

/// The keys of the `line_size`-byte blocks `request` touches, in address order: blocks
/// `offset / line_size` through `(offset + len - 1) / line_size`; none for a zero-length
/// request.
///
/// # Panics
/// If `line_size` is not a power of two of at least [`MIN_LINE_SIZE`] (the caller validates
/// the user's choice once), or if `request` breaks the readers' limits.
#[inline]
pub fn block_keys(request: &Request, line_size: u64) -> BlockKeys {
    assert!(
        line_size.is_power_of_two() && line_size >= MIN_LINE_SIZE,
        "line size {line_size} is not a power of two of at least {MIN_LINE_SIZE} bytes"
    );
    let end = request
        .offset
        .checked_add(request.len)
        .filter(|&end| end <= super::MAX_TRACE_BYTES)
        .unwrap_or_else(|| panic!("request {request:?} ends beyond the readers' limit"));
    assert!(
        request.volume < super::MAX_VOLUMES,
        "volume {} has no room in a key",
        request.volume
    );
    let shift = line_size.trailing_zeros();
    let (first, end_block) = if request.len == 0 {
        (0, 0)
    } else {
        (request.offset >> shift, ((end - 1) >> shift) + 1)
    };
    BlockKeys {
        volume_bits: u64::from(request.volume) << VOLUME_SHIFT,
        next: first,
        end: end_block,
    }
}

/// Iterator of [`block_keys`].
#[derive(Debug, Clone)]
pub struct BlockKeys {
    volume_bits: u64,
    next: u64,
    end: u64,
}

impl Iterator for BlockKeys {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        if self.next == self.end {
            return None;
        }
        let key = self.volume_bits | self.next;
        self.next += 1;
        Some(key)
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        let remaining = (self.end - self.next) as usize;
        (remaining, Some(remaining))
    }
}

impl ExactSizeIterator for BlockKeys {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Op, Request};

    fn request(volume: u32, offset: u64, len: u64) -> Request {
        Request {
            time_ns: 0,
            volume,
            op: Op::Read,
            offset,
            len,
        }
    }

    #[test]
    fn a_request_touches_every_line_it_overlaps() {
        let keys: Vec<u64> = block_keys(&request(0, 4095, 2), 4096).collect();
        assert_eq!(keys, vec![0, 1]);
        let keys: Vec<u64> = block_keys(&request(0, 8192, 4096), 4096).collect();
        assert_eq!(keys, vec![2]);
        let keys: Vec<u64> = block_keys(&request(0, 512, 8192), 4096).collect();
        assert_eq!(keys, vec![0, 1, 2]);
    }

    #[test]
    fn a_zero_length_request_touches_nothing() {
        assert_eq!(block_keys(&request(3, 4096, 0), 4096).count(), 0);
    }

    #[test]
    fn the_volume_is_in_the_top_bits() {
        let keys: Vec<u64> = block_keys(&request(2, 0, 512), 512).collect();
        assert_eq!(keys, vec![2 << 48]);
        assert_eq!(block_key(65535, MAX_BLOCK), u64::MAX);
    }

    #[test]
    fn the_largest_request_at_the_end_of_the_address_space_keeps_its_keys_apart() {
        let last = request(1, crate::trace::MAX_TRACE_BYTES - 512, 512);
        let keys: Vec<u64> = block_keys(&last, MIN_LINE_SIZE).collect();
        assert_eq!(keys, vec![(1 << 48) | MAX_BLOCK]);
    }

    #[test]
    #[should_panic(expected = "not a power of two")]
    fn a_line_size_that_is_not_a_power_of_two_is_refused() {
        let _ = block_keys(&request(0, 0, 1), 3000);
    }
}
