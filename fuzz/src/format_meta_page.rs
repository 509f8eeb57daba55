//! `MetaPage::decode` (a 4 KiB page of the line-record checkpoint): never panics; a page
//! whose checksum is right is never refused for its checksum; what it accepts has the record
//! count the header says and encodes back to a page that decodes to the same records.
//!
//! Input: byte 0 selects the line size (4 KiB << (b % 9)), the rest is the page, cut or
//! padded with zeros to 4 KiB. Each input is decoded twice: as given, and with its checksum
//! recomputed (so mutations reach the field checks behind it). The checkpoint number and
//! first slot the caller expects are taken from the page itself, so both paths get past
//! those checks; a second decode expecting the next checkpoint must refuse it.
//! `MetaPage::decode_checksums` accepts exactly the pages `decode` accepts and gives the
//! checksums of the records `decode` returns (zeroes past the record count).

use ssdcache_format::{LineRecord, MetaPage, MetaPageError, SECTOR_SIZE};

use crate::{fix_crc, le_u64, line_size_from, line_size_selector, padded, trimmed};

const PAGE: usize = SECTOR_SIZE as usize;
const CRC_AT: usize = 4;
const CHECKPOINT_AT: usize = 8;
const FIRST_SLOT_AT: usize = 16;
const COUNT_AT: usize = 24;

pub fn check(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let line_size = line_size_from(selector);
    let mut page = padded(body, PAGE);
    let (checkpoint, first) = (le_u64(&page, CHECKPOINT_AT), le_u64(&page, FIRST_SLOT_AT));
    let _ = MetaPage::decode(&page, checkpoint, first, line_size);

    fix_crc(&mut page, CRC_AT);
    let decoded = MetaPage::decode(&page, checkpoint, first, line_size);
    let spl = LineRecord::sectors(line_size);
    let mut crcs = vec![0u32; MetaPage::records_per_page(line_size) as usize * spl];
    let only_crcs = MetaPage::decode_checksums(&page, checkpoint, first, line_size, &mut crcs);
    assert_eq!(only_crcs.is_ok(), decoded.is_ok(), "decode_checksums and decode disagree");
    if let Ok(records) = &decoded {
        let expected: Vec<u32> = (0..crcs.len() / spl)
            .flat_map(|i| (0..spl).map(move |s| records.get(i).map_or(0, |r| r.crc(s))))
            .collect();
        assert_eq!(crcs, expected, "decode_checksums gave other checksums than decode");
    }
    let records = match decoded {
        Ok(records) => records,
        Err(MetaPageError::BadChecksum { stored, computed }) => {
            panic!("a page with a recomputed checksum was refused: stored {stored:#x}, computed {computed:#x}")
        }
        Err(_) => return,
    };
    let count = u32::from_le_bytes([
        page[COUNT_AT],
        page[COUNT_AT + 1],
        page[COUNT_AT + 2],
        page[COUNT_AT + 3],
    ]);
    assert_eq!(records.len() as u64, u64::from(count));
    assert!(records.len() as u64 <= MetaPage::records_per_page(line_size));
    assert!(records
        .iter()
        .all(|r| r.crcs.len() == LineRecord::sectors(line_size)));
    assert!(matches!(
        MetaPage::decode(&page, checkpoint.wrapping_add(1), first, line_size),
        Err(MetaPageError::WrongCheckpoint { .. })
    ));

    let mut again = vec![0u8; PAGE];
    MetaPage::encode(checkpoint, first, line_size, &records, &mut again);
    assert_eq!(
        MetaPage::decode(&again, checkpoint, first, line_size),
        Ok(records),
        "decode(encode(records)) changed the records"
    );
}

/// Valid pages: empty, full of free records, and with clean and dirty records, at three
/// line sizes.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for line_size in [4096u64, 65536, 1 << 20] {
        let per_page = MetaPage::records_per_page(line_size) as usize;
        let sectors = LineRecord::sectors(line_size);
        let mut used = LineRecord::FREE;
        used.volume = 0;
        used.backing_line = 77;
        used.crcs = (0..sectors as u32).map(|s| 0xc0de_0000 | s).collect();
        for s in 0..sectors.min(5) {
            used.valid.set(s, true);
        }
        used.dirty.set(0, true);
        let free = LineRecord::FREE;
        let pages: [Vec<LineRecord>; 3] = [
            Vec::new(),
            vec![free; per_page],
            (0..per_page.min(4)).map(|_| used.clone()).collect(),
        ];
        for records in pages {
            let mut page = vec![0u8; PAGE];
            MetaPage::encode(3, per_page as u64 * 2, line_size, &records, &mut page);
            let mut seed = vec![line_size_selector(line_size)];
            seed.extend(trimmed(page));
            seeds.push(seed);
        }
        // A page of checksums only, as a running engine writes them.
        let crcs: Vec<u32> = (0..(per_page * sectors) as u32).map(|i| 0xc5c5_0000 | i).collect();
        let mut page = vec![0u8; PAGE];
        MetaPage::encode_checksums(1 << 63 | 5, per_page as u64, line_size, &crcs, &mut page);
        let mut seed = vec![line_size_selector(line_size)];
        seed.extend(trimmed(page));
        seeds.push(seed);
    }
    seeds
}
