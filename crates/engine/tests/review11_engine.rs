//! Eleventh adversarial review of the data path (issue #11), against 5867a8a: the background
//! committer (5360e87), writeback without the line locks (f0eddb0), hits under the map's read
//! lock (fbcb9a6), unwritten lines to the warm end (a642cc4).
//!
//! R11-1 (its tests fail against 5867a8a): two cleaning batches running at once can both have a
//! writeback of the same range in flight. `write_extent` registers its range
//! (`Backing::begin_writeback`) and writes without the lines, but registering never waits for
//! an overlapping writeback already in flight: only client I/O does (`wait_for_writebacks`).
//! A first batch's older data, still in flight, can land after a second batch wrote the newer
//! data, flushed and recorded the line clean (its epoch is current). The cache then calls the
//! line clean while the backing device holds older data: reads served by the backing device
//! (pass-through, an evicted or dropped line, a lost cache) return the stale data, and a crash
//! brings nothing back. Before f0eddb0 the first batch held the lines across its write, so the
//! second read the newer data only after the older write had returned.
//!
//! Two batches run at once whenever `Cache::drain` (or `set_mode` leaving write-back, which
//! drains the whole cache in the calling thread) runs beside the cleaner thread: the daemon's
//! `set-mode` of a write-back volume with no dirty data of its own calls `Cache::set_mode`,
//! whose drain takes every volume's dirty lines while the cleaner thread cleans them too.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{data, format_dev, open_dyn, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{GateDevice, MemDevice};
use ssdcache_engine::{CleanerConfig, Select};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 * 1024;
const BACKING: u64 = 16 * MIB;

/// A write-back cache on a gated backing device (the gate holds one backing write in flight).
fn gated_cache() -> (Arc<MemDevice>, Arc<GateDevice>, Arc<ssdcache_engine::Cache>) {
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let gate = Arc::new(GateDevice::new(mem.clone()));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, gate.clone());
    (mem, gate, Arc::new(cache))
}

/// R11-1: a batch writes back a line's older data and its write is held in flight; a client
/// overwrites the line in the cache; a second batch writes the newer data back, flushes and
/// records the line clean; then the first batch's older write lands. The line is clean in
/// the cache, the backing device holds the older data, and a read the backing device serves
/// returns it.
#[test]
fn r11_1_two_batches_land_older_data_over_a_line_recorded_clean() {
    let (mem, gate, cache) = gated_cache();
    let vol = cache.volumes()[0].clone();
    let older = data(1, SECTOR as usize);
    let newer = data(2, SECTOR as usize);
    vol.write(0, &older, false).expect("dirty write");
    gate.hold_next_write();
    let first_batch = {
        let cache = cache.clone();
        std::thread::spawn(move || cache.clean_batch(&CleanerConfig::default(), 1, Select::All))
    };
    assert!(
        gate.wait_until_held(Duration::from_secs(10)),
        "the first batch's writeback reached the disk"
    );
    // A client overwrites the line in the cache while the older data is in flight.
    vol.write(0, &newer, false).expect("overwrite in the cache");
    // A second batch (a drain beside the cleaner thread) writes the newer data back. It waits
    // for the first batch's write of the line (backing order), so the gate opens by itself
    // after a moment instead of at the gate's 30 s limit.
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            gate.release();
        })
    };
    let second = cache
        .clean_batch(&CleanerConfig::default(), 1, Select::Coldest)
        .expect("second batch");
    assert_eq!(second.lines_cleaned, 1, "the second batch cleaned the line");
    opener.join().expect("gate opener thread");
    first_batch
        .join()
        .expect("first batch thread")
        .expect("first batch");
    assert_eq!(cache.dirty_lines(), 0, "the cache calls the line clean");
    let mut on_disk = vec![0u8; SECTOR as usize];
    mem.read_at(&mut on_disk, 0).expect("read backing");
    let stale = on_disk == older;
    // What a client sees once the backing device serves the range.
    cache
        .set_mode(
            0,
            CacheMode::PassThrough,
            &CleanerConfig::default(),
            &mut |_| true,
        )
        .expect("to pass-through");
    let mut buf = vec![0u8; SECTOR as usize];
    vol.read(0, &mut buf).expect("read");
    assert!(
        !stale && buf == newer,
        "a line recorded clean has older data on the backing device (the first batch's \
         writeback landed after the second's), and a read returns it: got the {} data",
        if buf == older { "older" } else { "newer" }
    );
}

/// R11-1 as the daemon meets it: the cleaner thread runs while `Cache::drain` (what
/// `set_mode` leaving write-back calls) runs in another thread, a client overwriting a line
/// meanwhile. Bounded: 200 rounds, 60 s.
#[test]
fn r11_1_drain_beside_the_cleaner_thread_never_leaves_older_data_clean() {
    use std::time::Instant;
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let slow = Arc::new(SlowWrites {
        inner: mem.clone(),
        writes: std::sync::atomic::AtomicU64::new(0),
    });
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, slow);
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    let cfg = CleanerConfig {
        high_watermark: 0.0,
        low_watermark: 0.0,
        idle_after: Duration::ZERO,
        ..CleanerConfig::default()
    };
    cache.start_cleaner(cfg.clone());
    let began = Instant::now();
    let mut found = None;
    for round in 0..200u64 {
        if began.elapsed() > Duration::from_secs(60) {
            break;
        }
        let older = data(round * 2 + 10, SECTOR as usize);
        let newer = data(round * 2 + 11, SECTOR as usize);
        vol.write(0, &older, false).expect("write");
        let drain = {
            let cache = cache.clone();
            let cfg = cfg.clone();
            std::thread::spawn(move || cache.drain(&cfg, &mut |_| true))
        };
        std::thread::sleep(Duration::from_micros(500 + (round % 7) * 300));
        vol.write(0, &newer, false).expect("overwrite");
        drain.join().expect("drain thread").expect("drain");
        // Everything written back: both the drain and the cleaner thread are done with it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while cache.dirty_lines() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(20));
        if cache.dirty_lines() > 0 {
            continue;
        }
        let mut on_disk = vec![0u8; SECTOR as usize];
        mem.read_at(&mut on_disk, 0).expect("read backing");
        if on_disk != newer {
            found = Some(round);
            break;
        }
    }
    cache.stop_cleaner();
    assert!(
        found.is_none(),
        "round {found:?}: the line is recorded clean, but the backing device holds older data"
    );
}

/// A backing device whose writes take 0 to 9 ms each (a disk serving its queue in its own
/// order), so overlapping writebacks may complete in either order.
struct SlowWrites {
    inner: Arc<MemDevice>,
    writes: std::sync::atomic::AtomicU64,
}

impl BlockDevice for SlowWrites {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let n = self
            .writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(n * 7 % 10));
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}
