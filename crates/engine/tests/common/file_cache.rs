//! A write-through cache on a real file (read through io_uring) over a memory backing device
//! whose every sector says which sector and which write it is: for the tests of hits read in
//! batches and through a ring.

use std::sync::{Arc, Mutex, MutexGuard};

use ssdcache_device::{BlockDevice, FileDevice, OpenOptions};
use ssdcache_devsim::MemDevice;
use ssdcache_engine::Cache;
use ssdcache_format::CacheMode;

use super::{format_dev, open_dyn};

pub const LINE: u64 = 64 << 10;
pub const SECTOR: usize = 4096;

/// The io_uring switch and counter are process-wide: the tests of a file that use them run
/// one by one.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A write-through cache on a file (`cache_size`) over a memory backing device whose sector
/// `i` holds `sector_data(i, 0)`.
pub fn file_cache(
    dir: &tempfile::TempDir,
    cache_size: u64,
    backing_size: u64,
) -> (Arc<MemDevice>, Cache) {
    let path = dir.path().join("cache");
    std::fs::write(&path, vec![0u8; cache_size as usize]).expect("cache file");
    let opts = OpenOptions {
        write: true,
        direct: true,
        lock: false,
    };
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(&path, opts).expect("open cache file"));
    format_dev(&*dev, LINE, CacheMode::WriteThrough, backing_size, 0);
    let backing = Arc::new(MemDevice::new("backing", backing_size));
    let chunk = 1 << 20;
    for at in (0..backing_size).step_by(chunk) {
        let first = at / SECTOR as u64;
        let fill: Vec<u8> = (first..first + (chunk / SECTOR) as u64)
            .flat_map(|s| sector_data(s, 0))
            .collect();
        backing.write_at(&fill, at).expect("fill backing");
    }
    let (cache, _) = open_dyn(dev, backing.clone());
    (backing, cache)
}

/// Sector `s` after its `version`th whole-sector write: its number, the version, then a
/// byte that depends on both.
pub fn sector_data(s: u64, version: u64) -> Vec<u8> {
    let mut d = vec![(s.wrapping_mul(31) + version * 7) as u8; SECTOR];
    d[..8].copy_from_slice(&s.to_le_bytes());
    d[8..16].copy_from_slice(&version.to_le_bytes());
    d
}

/// Checks that every sector of a read at `offset` is one whole write of that sector.
pub fn assert_whole_sectors(offset: u64, data: &[u8], max_version: u64) {
    for (i, sector) in data.chunks(SECTOR).enumerate() {
        let s = offset / SECTOR as u64 + i as u64;
        let version = u64::from_le_bytes(sector[8..16].try_into().expect("8 bytes"));
        assert!(
            version <= max_version,
            "sector {s}: version {version} never written"
        );
        assert!(
            sector == sector_data(s, version),
            "sector {s} is not one whole write"
        );
    }
}
