//! Line records: what one cache line holds (which volume, which backing line, which sectors are
//! valid and dirty, and a CRC32C of each valid sector's data), and the 4 KiB checksummed pages
//! that store them.

use crate::bytes::{crc_with_hole, get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::SECTOR_SIZE;

/// Per-sector bits of one line; 256 bits cover the largest line (1 MiB / 4 KiB).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SectorBitmap(pub [u64; 4]);

impl SectorBitmap {
    /// The `count` sectors from `first`.
    pub fn range(first: usize, count: usize) -> Self {
        let mut bits = Self::default();
        for s in first..first + count {
            bits.set(s, true);
        }
        bits
    }
    /// Adds `other`'s sectors to these.
    pub fn union_with(&mut self, other: &SectorBitmap) {
        for (mine, theirs) in self.0.iter_mut().zip(other.0) {
            *mine |= theirs;
        }
    }
    pub fn get(&self, sector: usize) -> bool {
        self.0[sector / 64] >> (sector % 64) & 1 == 1
    }
    pub fn set(&mut self, sector: usize, on: bool) {
        let bit = 1u64 << (sector % 64);
        if on {
            self.0[sector / 64] |= bit;
        } else {
            self.0[sector / 64] &= !bit;
        }
    }
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }
    pub fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// Volume id of a free line record.
pub const FREE_VOLUME: u16 = u16::MAX;

/// Record flag: the checksums of the line's dirty sectors came from a journal replay after an
/// unclean stop and may predate a write that landed before it (docs/design.md §4.8).
pub const RECORD_UNVERIFIED: u16 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineRecord {
    /// Volume slot index, or `FREE_VOLUME`.
    pub volume: u16,
    pub flags: u16,
    /// Index of the line on the backing volume (byte offset / line size).
    pub backing_line: u64,
    pub valid: SectorBitmap,
    pub dirty: SectorBitmap,
    /// CRC32C of each sector's data (index = sector of the line); meaningful for valid
    /// sectors, 0 for the others. Empty means all zero (a free record). Data written back or
    /// served from the cache is checked against it, so a lost or damaged cache region is
    /// caught before its contents reach a client or the backing device.
    pub crcs: Vec<u32>,
}

/// CRC32C of one sector's data, as line records store it.
pub fn sector_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

impl LineRecord {
    pub const FREE: LineRecord = LineRecord {
        volume: FREE_VOLUME,
        flags: 0,
        backing_line: 0,
        valid: SectorBitmap([0; 4]),
        dirty: SectorBitmap([0; 4]),
        crcs: Vec::new(),
    };

    /// Bytes of one bitmap on disk: one bit per sector, at least 8 bytes.
    pub fn bitmap_bytes(line_size: u64) -> usize {
        ((line_size / SECTOR_SIZE) as usize).div_ceil(8).max(8)
    }

    /// Sectors in a line, which is also the number of sector checksums a record holds.
    pub fn sectors(line_size: u64) -> usize {
        (line_size / SECTOR_SIZE) as usize
    }

    /// Bytes of one encoded record: 16-byte header, valid bitmap, dirty bitmap, one CRC32C per
    /// sector.
    pub fn encoded_size(line_size: u64) -> usize {
        16 + 2 * Self::bitmap_bytes(line_size) + 4 * Self::sectors(line_size)
    }

    /// The stored checksum of sector `s` (0 when none is stored).
    pub fn crc(&self, s: usize) -> u32 {
        self.crcs.get(s).copied().unwrap_or(0)
    }

    pub fn is_free(&self) -> bool {
        self.volume == FREE_VOLUME
    }

    pub fn encode(&self, line_size: u64, out: &mut [u8]) {
        let bm = Self::bitmap_bytes(line_size);
        put_u64(out, 0, self.backing_line);
        put_u16(out, 8, self.volume);
        put_u16(out, 10, self.flags);
        put_u32(out, 12, 0);
        put_bitmap(&mut out[16..16 + bm], &self.valid);
        put_bitmap(&mut out[16 + bm..16 + 2 * bm], &self.dirty);
        for s in 0..Self::sectors(line_size) {
            put_u32(out, 16 + 2 * bm + 4 * s, self.crc(s));
        }
    }

    pub fn decode(line_size: u64, buf: &[u8]) -> LineRecord {
        let bm = Self::bitmap_bytes(line_size);
        LineRecord {
            backing_line: get_u64(buf, 0),
            volume: get_u16(buf, 8),
            flags: get_u16(buf, 10),
            valid: get_bitmap(&buf[16..16 + bm]),
            dirty: get_bitmap(&buf[16 + bm..16 + 2 * bm]),
            crcs: (0..Self::sectors(line_size))
                .map(|s| get_u32(buf, 16 + 2 * bm + 4 * s))
                .collect(),
        }
    }
}

fn put_bitmap(out: &mut [u8], bits: &SectorBitmap) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&bits.0[i].to_le_bytes()[..chunk.len()]);
    }
}

fn get_bitmap(buf: &[u8]) -> SectorBitmap {
    let mut bits = SectorBitmap::default();
    for (i, chunk) in buf.chunks(8).enumerate() {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        bits.0[i] = u64::from_le_bytes(w);
    }
    bits
}

pub const META_PAGE_MAGIC: u32 = 0x504d_4353; // "SCMP"
const META_HEADER: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetaPageError {
    #[error("metadata page has bad magic {0:#x}")]
    BadMagic(u32),
    #[error("metadata page checksum mismatch (stored {stored:#x}, computed {computed:#x})")]
    BadChecksum { stored: u32, computed: u32 },
    #[error("metadata page belongs to checkpoint {found}, expected {expected}")]
    WrongCheckpoint { found: u64, expected: u64 },
    #[error("metadata page holds slots {first}..+{count}, expected slot {expected_first}")]
    WrongSlots {
        first: u64,
        count: u32,
        expected_first: u64,
    },
    #[error("metadata page record size {found} does not match line size (expected {expected})")]
    WrongRecordSize { found: u32, expected: u32 },
}

/// One 4 KiB page of the checkpoint: header + consecutive line records.
pub struct MetaPage;

impl MetaPage {
    pub fn records_per_page(line_size: u64) -> u64 {
        ((SECTOR_SIZE as usize - META_HEADER) / LineRecord::encoded_size(line_size)) as u64
    }

    /// Encodes `records` (slots `first_slot..`) into a 4 KiB `page`.
    pub fn encode(
        checkpoint: u64,
        first_slot: u64,
        line_size: u64,
        records: &[LineRecord],
        page: &mut [u8],
    ) {
        assert_eq!(page.len(), SECTOR_SIZE as usize);
        assert!(records.len() as u64 <= Self::records_per_page(line_size));
        let rs = LineRecord::encoded_size(line_size);
        page.fill(0);
        put_u32(page, 0, META_PAGE_MAGIC);
        put_u64(page, 8, checkpoint);
        put_u64(page, 16, first_slot);
        put_u32(page, 24, records.len() as u32);
        put_u32(page, 28, rs as u32);
        for (i, rec) in records.iter().enumerate() {
            let at = META_HEADER + i * rs;
            rec.encode(line_size, &mut page[at..at + rs]);
        }
        let crc = crc_with_hole(page, 4);
        put_u32(page, 4, crc);
    }

    /// Decodes a page, checking magic, checksum, checkpoint number and slot range.
    pub fn decode(
        page: &[u8],
        checkpoint: u64,
        expected_first: u64,
        line_size: u64,
    ) -> Result<Vec<LineRecord>, MetaPageError> {
        Self::check_header(page, checkpoint, expected_first, line_size)?;
        let count = get_u32(page, 24);
        let rs = LineRecord::encoded_size(line_size);
        Ok((0..count as usize)
            .map(|i| LineRecord::decode(line_size, &page[META_HEADER + i * rs..]))
            .collect())
    }

    /// Magic, checksum, checkpoint number (or stamp), slot range and record size of a page.
    fn check_header(
        page: &[u8],
        checkpoint: u64,
        expected_first: u64,
        line_size: u64,
    ) -> Result<(), MetaPageError> {
        let magic = get_u32(page, 0);
        if magic != META_PAGE_MAGIC {
            return Err(MetaPageError::BadMagic(magic));
        }
        let stored = get_u32(page, 4);
        let computed = crc_with_hole(page, 4);
        if stored != computed {
            return Err(MetaPageError::BadChecksum { stored, computed });
        }
        let found = get_u64(page, 8);
        if found != checkpoint {
            return Err(MetaPageError::WrongCheckpoint {
                found,
                expected: checkpoint,
            });
        }
        let first = get_u64(page, 16);
        let count = get_u32(page, 24);
        if first != expected_first || u64::from(count) > Self::records_per_page(line_size) {
            return Err(MetaPageError::WrongSlots {
                first,
                count,
                expected_first,
            });
        }
        let rs = LineRecord::encoded_size(line_size);
        let found_rs = get_u32(page, 28);
        if found_rs as usize != rs {
            return Err(MetaPageError::WrongRecordSize {
                found: found_rs,
                expected: rs as u32,
            });
        }
        Ok(())
    }

    /// The checkpoint number (or stamp) a page's header names, unchecked: what
    /// [`MetaPage::decode_checksums`] is then asked to expect when any of several stamps will do.
    pub fn stamp_of(page: &[u8]) -> u64 {
        get_u64(page, 8)
    }

    /// Encodes a page of checksums only, as a running engine writes the checksums it keeps out
    /// of RAM (docs/design.md §2.2, "Pages written while running"): `crcs` holds
    /// `records_per_page × sectors` checksums of slots `first_slot..`, and every record is a
    /// free one (volume `FREE_VOLUME`, empty bitmaps) carrying its slot's checksums. `stamp`
    /// takes the place of the checkpoint number.
    pub fn encode_checksums(
        stamp: u64,
        first_slot: u64,
        line_size: u64,
        crcs: &[u32],
        page: &mut [u8],
    ) {
        let spl = LineRecord::sectors(line_size);
        let count = Self::records_per_page(line_size) as usize;
        assert_eq!(page.len(), SECTOR_SIZE as usize);
        assert_eq!(crcs.len(), count * spl);
        let rs = LineRecord::encoded_size(line_size);
        let bm = LineRecord::bitmap_bytes(line_size);
        page.fill(0);
        put_u32(page, 0, META_PAGE_MAGIC);
        put_u64(page, 8, stamp);
        put_u64(page, 16, first_slot);
        put_u32(page, 24, count as u32);
        put_u32(page, 28, rs as u32);
        for (i, slot_crcs) in crcs.chunks(spl).enumerate() {
            let at = META_HEADER + i * rs;
            put_u16(page, at + 8, FREE_VOLUME);
            for (s, &crc) in slot_crcs.iter().enumerate() {
                put_u32(page, at + 16 + 2 * bm + 4 * s, crc);
            }
        }
        let crc = crc_with_hole(page, 4);
        put_u32(page, 4, crc);
    }

    /// The checksums of every record of a page (checked as [`MetaPage::decode`] checks it)
    /// into `out` (`records_per_page × sectors` values, slot by slot; slots past the page's
    /// record count get 0), without building records.
    pub fn decode_checksums(
        page: &[u8],
        stamp: u64,
        expected_first: u64,
        line_size: u64,
        out: &mut [u32],
    ) -> Result<(), MetaPageError> {
        let spl = LineRecord::sectors(line_size);
        assert_eq!(out.len(), Self::records_per_page(line_size) as usize * spl);
        Self::check_header(page, stamp, expected_first, line_size)?;
        let count = get_u32(page, 24) as usize;
        let rs = LineRecord::encoded_size(line_size);
        let bm = LineRecord::bitmap_bytes(line_size);
        out.fill(0);
        for (i, slot_crcs) in out.chunks_mut(spl).take(count).enumerate() {
            let at = META_HEADER + i * rs + 16 + 2 * bm;
            for (s, crc) in slot_crcs.iter_mut().enumerate() {
                *crc = get_u32(page, at + 4 * s);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(vol: u16, line: u64, valid: [u64; 4]) -> LineRecord {
        LineRecord {
            volume: vol,
            flags: 0,
            backing_line: line,
            valid: SectorBitmap(valid),
            dirty: SectorBitmap::default(),
            crcs: (0..16).map(|s| 0x1000 + s).collect(),
        }
    }

    #[test]
    fn bitmap_ranges_cross_words_and_union_adds() {
        let mut bits = SectorBitmap::range(62, 4);
        assert_eq!(bits, SectorBitmap([0b11 << 62, 0b11, 0, 0]));
        bits.union_with(&SectorBitmap::range(255, 1));
        assert_eq!(bits.count(), 5);
        assert!(bits.get(255) && !bits.get(66));
        assert!(SectorBitmap::range(9, 0).is_empty());
    }

    #[test]
    fn record_sizes() {
        assert_eq!(LineRecord::encoded_size(4096), 36);
        assert_eq!(LineRecord::encoded_size(65536), 96);
        assert_eq!(LineRecord::encoded_size(1 << 20), 1104);
        assert_eq!(MetaPage::records_per_page(65536), 42);
        assert_eq!(MetaPage::records_per_page(1 << 20), 3);
    }

    #[test]
    fn page_detects_corruption_and_wrong_checkpoint() {
        let recs = vec![record(0, 7, [0xffff, 0, 0, 0]), LineRecord::FREE];
        let mut page = vec![0u8; 4096];
        MetaPage::encode(5, 42, 65536, &recs, &mut page);
        let mut free_decoded = LineRecord::FREE;
        free_decoded.crcs = vec![0; 16];
        assert_eq!(
            MetaPage::decode(&page, 5, 42, 65536),
            Ok(vec![recs[0].clone(), free_decoded])
        );
        assert!(matches!(
            MetaPage::decode(&page, 6, 42, 65536),
            Err(MetaPageError::WrongCheckpoint { .. })
        ));
        assert!(matches!(
            MetaPage::decode(&page, 5, 0, 65536),
            Err(MetaPageError::WrongSlots { .. })
        ));
        page[100] ^= 1;
        assert!(matches!(
            MetaPage::decode(&page, 5, 42, 65536),
            Err(MetaPageError::BadChecksum { .. })
        ));
    }

    #[test]
    fn checksum_pages_round_trip_and_read_checkpoint_pages() {
        let per_page = MetaPage::records_per_page(65536) as usize;
        let crcs: Vec<u32> = (0..per_page as u32 * 16).map(|i| i * 7 + 1).collect();
        let mut page = vec![0u8; 4096];
        MetaPage::encode_checksums(1 << 63 | 9, 84, 65536, &crcs, &mut page);
        let mut out = vec![0u32; crcs.len()];
        MetaPage::decode_checksums(&page, 1 << 63 | 9, 84, 65536, &mut out).unwrap();
        assert_eq!(out, crcs);
        // Every record is free: read as a checkpoint, nothing is cached.
        let recs = MetaPage::decode(&page, 1 << 63 | 9, 84, 65536).unwrap();
        assert!(recs.iter().all(LineRecord::is_free));
        assert!(matches!(
            MetaPage::decode_checksums(&page, 9, 84, 65536, &mut out),
            Err(MetaPageError::WrongCheckpoint { .. })
        ));
        // A checkpoint page gives its records' checksums, zeroes past its record count.
        let recs = vec![record(0, 7, [0xffff, 0, 0, 0])];
        MetaPage::encode(5, 42, 65536, &recs, &mut page);
        MetaPage::decode_checksums(&page, 5, 42, 65536, &mut out).unwrap();
        assert_eq!(&out[..16], &recs[0].crcs[..]);
        assert!(out[16..].iter().all(|&c| c == 0));
        page[200] ^= 1;
        assert!(matches!(
            MetaPage::decode_checksums(&page, 5, 42, 65536, &mut out),
            Err(MetaPageError::BadChecksum { .. })
        ));
    }

    proptest! {
        #[test]
        fn records_round_trip(vol in 0u16..40, line in any::<u64>(), v in any::<[u64; 4]>(), d in any::<[u64; 4]>(), seed in any::<u32>(), shift in 12u32..=20) {
            let line_size = 1u64 << shift;
            let spl = (line_size / SECTOR_SIZE) as usize;
            let mask = |w: [u64; 4]| {
                let mut b = SectorBitmap::default();
                for s in 0..spl { b.set(s, SectorBitmap(w).get(s)); }
                b
            };
            let crcs = (0..spl as u32).map(|s| seed.wrapping_mul(s + 1)).collect();
            let rec = LineRecord { volume: vol, flags: 3, backing_line: line, valid: mask(v), dirty: mask(d), crcs };
            let mut buf = vec![0u8; LineRecord::encoded_size(line_size)];
            rec.encode(line_size, &mut buf);
            prop_assert_eq!(LineRecord::decode(line_size, &buf), rec);
        }

        #[test]
        fn garbage_pages_never_panic(bytes in proptest::collection::vec(any::<u8>(), 4096)) {
            let _ = MetaPage::decode(&bytes, 1, 0, 65536);
            let mut out = vec![0u32; 42 * 16];
            let _ = MetaPage::decode_checksums(&bytes, 1, 0, 65536, &mut out);
        }
    }
}
