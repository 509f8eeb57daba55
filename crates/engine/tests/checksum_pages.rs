//! Checksums out of RAM (docs/design.md §3): with room for one metadata page of checksums,
//! nearly every request reads its slot's page from the cache device and every change soon
//! writes one. Data must read back right across clean restarts and crashes, damage must still
//! be caught, a page the device lost must cost no data, and the RAM must stay within budget.

mod common;

use std::sync::Arc;

use common::*;
use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::checksums::checksum_frame_bytes;
use ssdcache_engine::{read_superblock, Cache};
use ssdcache_format::{CacheMode, SECTOR_SIZE};

const LINE: u64 = 64 << 10;
const CACHE: u64 = 32 << 20;
const BACKING: u64 = 64 << 20;

fn one_frame(cache: &Cache) {
    cache
        .set_checksum_memory(checksum_frame_bytes(LINE))
        .expect("checksum memory");
}

fn open_one_frame(cache_dev: &Arc<MemDevice>, backing: &Arc<MemDevice>) -> Cache {
    let (cache, _) = open(cache_dev, backing);
    one_frame(&cache);
    cache
}

/// Writes 16 KiB at every third line (dirty in write-back), then reads every fifth line
/// (fills clean lines), keeping `model` in step.
fn mixed_load(cache: &Cache, model: &mut [u8], tag: u64) {
    let vol = cache.volumes()[0].clone();
    for i in 0..150u64 {
        let offset = i * 3 * LINE + (i % 4) * 16384;
        let d = data(tag + i, 16384);
        vol.write(offset, &d, false).expect("write");
        model[offset as usize..offset as usize + d.len()].copy_from_slice(&d);
    }
    let mut buf = vec![0u8; LINE as usize];
    for i in 0..100u64 {
        vol.read(i * 5 * LINE, &mut buf).expect("fill");
    }
    vol.flush().expect("flush");
}

fn assert_reads(cache: &Cache, model: &[u8], what: &str) {
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; LINE as usize];
    for line in 0..BACKING / LINE {
        let at = (line * LINE) as usize;
        vol.read(line * LINE, &mut buf)
            .unwrap_or_else(|e| panic!("{what}: line {line}: {e}"));
        assert!(
            buf == model[at..at + LINE as usize],
            "{what}: line {line} differs"
        );
    }
}

#[test]
fn data_reads_back_across_clean_restarts_with_one_page_of_checksums_in_ram() {
    let (cache_dev, backing, cache) = setup(CACHE, BACKING, LINE, CacheMode::WriteBack);
    one_frame(&cache);
    let mut model = vec![0u8; BACKING as usize];
    mixed_load(&cache, &mut model, 100);
    assert_reads(&cache, &model, "running");
    let usage = cache.checksum_usage();
    assert!(usage.pages_written > 0 && usage.pages_read > 0, "{usage:?}");
    assert!(
        usage.resident_frames <= 2,
        "one frame, and one waiting for its write: {usage:?}"
    );
    cache.shutdown().expect("clean stop");
    drop(cache);

    let cache = open_one_frame(&cache_dev, &backing);
    assert!(cache.dirty_lines() > 0, "the dirty lines came back warm");
    assert_reads(&cache, &model, "after a clean restart");
    mixed_load(&cache, &mut model, 900);
    cache.shutdown().expect("clean stop");
    drop(cache);
    let cache = open_one_frame(&cache_dev, &backing);
    assert_reads(&cache, &model, "after a second clean restart");
    cache
        .drain(&Default::default(), &mut |_| true)
        .expect("drain");
    assert_eq!(cache.dirty_lines(), 0);
    let disk = on_disk(&backing, 0, BACKING as usize);
    assert!(
        disk == model,
        "the backing device holds everything after the drain"
    );
}

#[test]
fn dirty_data_survives_a_crash_with_one_page_of_checksums_in_ram() {
    let (cache_dev, backing, cache) = setup_crash(CACHE, BACKING, LINE, CacheMode::WriteBack);
    one_frame(&cache);
    let mut model = vec![0u8; BACKING as usize];
    mixed_load(&cache, &mut model, 300);
    // A power cut right after the FLUSH: unflushed page writes may be lost or torn.
    drop(cache);
    let cache_dev = Arc::new(cache_dev.crashed("cache", 7));
    let backing = Arc::new(backing.crashed("backing", 8));
    let sb = read_superblock(&*cache_dev).expect("superblock");
    let (cache, _) = Cache::open(
        cache_dev.clone() as Arc<dyn BlockDevice>,
        sb,
        vec![backing.clone() as Arc<dyn BlockDevice>],
    )
    .expect("recovery");
    one_frame(&cache);
    assert_reads(&cache, &model, "after the crash");
    cache
        .drain(&Default::default(), &mut |_| true)
        .expect("drain");
    assert_reads(&cache, &model, "after writeback");
}

#[test]
fn damage_to_a_line_whose_checksums_are_on_the_device_is_caught() {
    let (cache_dev, backing, cache) = setup_crash(CACHE, BACKING, LINE, CacheMode::WriteThrough);
    one_frame(&cache);
    let vol = cache.volumes()[0].clone();
    let lines: Vec<Vec<u8>> = (0..60u64).map(|i| data(7000 + i, LINE as usize)).collect();
    for (i, line) in lines.iter().enumerate() {
        vol.write(i as u64 * LINE, line, false)
            .expect("write-through");
    }
    // Line 3's slot: its page went to the device long ago (sixty lines, one frame).
    let slot = common::failing::slot_holding(&cache_dev, &lines[3]);
    common::failing::damage_sector(&cache_dev, slot, 2);
    let mut buf = vec![0u8; LINE as usize];
    vol.read(3 * LINE, &mut buf).expect("read");
    assert!(
        buf == lines[3],
        "the damaged sector was read from the backing device"
    );
    assert_eq!(counter(&vol, "checksum_errors"), 1);
    drop(backing);
}

#[test]
fn a_lost_page_of_checksums_costs_no_data() {
    let (cache_dev, backing, cache) = setup(CACHE, BACKING, LINE, CacheMode::WriteBack);
    one_frame(&cache);
    let mut model = vec![0u8; BACKING as usize];
    mixed_load(&cache, &mut model, 500);
    // Every page of the metadata region overwritten with garbage while running: the
    // checksums of every line not in RAM are lost.
    let layout = cache.layout();
    let garbage = data(0xdead, layout.meta_len as usize);
    cache_dev
        .write_at(&garbage, layout.meta_offset)
        .expect("garbage");
    assert_reads(&cache, &model, "with every page lost");
    let usage = cache.checksum_usage();
    assert!(usage.pages_lost > 0, "{usage:?}");
    cache
        .drain(&Default::default(), &mut |_| true)
        .expect("drain");
    let disk = on_disk(&backing, 0, BACKING as usize);
    assert!(
        disk == model,
        "the dirty data went to the backing device whole"
    );
    assert_eq!(SECTOR_SIZE, 4096);
}

#[test]
fn checksum_ram_stays_within_the_budget_on_a_large_cache() {
    // 1 GiB of 64 KiB lines: 16,384 lines, 391 pages; 8 pages of room.
    let cache_dev = Arc::new(MemDevice::new("cache", 1 << 30));
    let backing = Arc::new(MemDevice::new("backing", 2 << 30));
    format_mem(&cache_dev, LINE, CacheMode::WriteBack, 2 << 30);
    let (cache, _) = open(&cache_dev, &backing);
    cache
        .set_checksum_memory(8 * checksum_frame_bytes(LINE))
        .expect("budget");
    let vol = cache.volumes()[0].clone();
    let piece = data(1, 4096);
    for line in 0..(1u64 << 30) / LINE {
        vol.write(line * 2 * LINE, &piece, false).expect("write");
    }
    let usage = cache.checksum_usage();
    assert!(usage.resident_frames <= 9, "{usage:?}");
    vol.flush().expect("flush");
    let mut buf = vec![0u8; 4096];
    vol.read(77 * 2 * LINE, &mut buf).expect("read");
    assert!(buf == piece);
}
