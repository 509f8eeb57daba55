//! `LineRecord::decode`: any bytes of a record's size decode, and encoding the result gives
//! the same bytes back (apart from the reserved field, which is written as zero).
//!
//! Input: byte 0 selects the line size (4 KiB << (b % 9)), the rest is the record, cut or
//! padded with zeros to the record size of that line size.

use ssdcache_format::{LineRecord, SECTOR_SIZE};

use crate::{line_size_from, line_size_selector, padded};

/// Bytes 12..16 of a record are reserved: decode ignores them, encode writes zeros.
const RESERVED: std::ops::Range<usize> = 12..16;

pub fn check(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let line_size = line_size_from(selector);
    let size = LineRecord::encoded_size(line_size);
    let input = padded(body, size);
    let record = LineRecord::decode(line_size, &input);
    assert_eq!(record.crcs.len() as u64, line_size / SECTOR_SIZE);

    let mut encoded = vec![0u8; size];
    record.encode(line_size, &mut encoded);
    let mut expected = input;
    expected[RESERVED].fill(0);
    assert_eq!(encoded, expected, "encode(decode(bytes)) changed the bytes");
    assert_eq!(LineRecord::decode(line_size, &encoded), record);
}

/// Records of every line size: free, clean, dirty, with checksums.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for line_size in [4096u64, 65536, 1 << 20] {
        let sectors = LineRecord::sectors(line_size);
        let mut record = LineRecord::FREE;
        record.crcs = vec![0; sectors];
        seeds.push(encode(line_size, &record));
        record.volume = 2;
        record.backing_line = 12345;
        for s in (0..sectors).step_by(3) {
            record.valid.set(s, true);
            record.dirty.set(s, s % 2 == 0);
            record.crcs[s] = 0x1000_0000 + s as u32;
        }
        seeds.push(encode(line_size, &record));
    }
    seeds
}

fn encode(line_size: u64, record: &LineRecord) -> Vec<u8> {
    let mut out = vec![line_size_selector(line_size)];
    let at = out.len();
    out.resize(at + LineRecord::encoded_size(line_size), 0);
    record.encode(line_size, &mut out[at..]);
    out
}
