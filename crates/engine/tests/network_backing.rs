//! The engine with a backing device that behaves as a network export does
//! (`ssdcache_remote::NbdDevice`): it can be unreachable for a while (its flush then fails
//! with `ssdcache_device::unreached`, and it keeps what the flush would have covered), and it makes single
//! writes durable with FUA.

mod common;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use common::{counter, data, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{CleanerConfig, Select, VolumeState};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;

/// A memory device that can be "unreachable" and counts FUA writes and flushes.
struct Export {
    inner: MemDevice,
    away: AtomicBool,
    fua_writes: AtomicUsize,
    flushes: AtomicUsize,
}

impl Export {
    fn refuse(&self) -> io::Result<()> {
        if self.away.load(Ordering::SeqCst) {
            // As `NbdDevice` says it: the request never reached the export.
            return Err(ssdcache_device::unreached("export unreachable".into()));
        }
        Ok(())
    }
}

impl BlockDevice for Export {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.refuse()?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.refuse()?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.refuse()?;
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
    fn write_fua(&self, buf: &[u8], offset: u64) -> Option<io::Result<()>> {
        self.fua_writes.fetch_add(1, Ordering::SeqCst);
        Some(self.write_at(buf, offset))
    }
    fn reachable(&self) -> Result<(), String> {
        self.refuse().map_err(|e| e.to_string())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        "nbd://model/export".into()
    }
}

fn setup(mode: CacheMode) -> (Arc<Export>, ssdcache_engine::Cache) {
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    // Sequential cutoff 0: every write is cached, none bypasses to the export.
    common::format_dev(&*cache_dev, LINE, mode, 8 * MIB, 0);
    let export = Arc::new(Export {
        inner: MemDevice::new("export", 8 * MIB),
        away: AtomicBool::new(false),
        fua_writes: AtomicUsize::new(0),
        flushes: AtomicUsize::new(0),
    });
    let (cache, _) = common::open_dyn(cache_dev, export.clone());
    (export, cache)
}

#[test]
fn an_outage_keeps_data_dirty_and_leaves_no_lasting_flush_failure() {
    let (export, cache) = setup(CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    for i in 0..4u64 {
        vol.write(i * LINE, &data(i, LINE as usize), false)
            .expect("write");
    }
    vol.flush().expect("flush");
    let dirty = cache.dirty_bytes();
    assert_eq!(dirty, 4 * LINE);

    export.away.store(true, Ordering::SeqCst);
    assert_eq!(vol.stats().state, VolumeState::BackingUnreachable);
    let cfg = CleanerConfig::default();
    // The cleaner leaves the volume alone while its export is away (writes would only fail).
    let r = cache
        .clean_batch(&cfg, 4, Select::All)
        .expect("a batch with nothing to do");
    assert_eq!((r.lines_cleaned, r.extents_failed), (0, 0), "{r:?}");
    assert_eq!(
        cache.dirty_bytes(),
        dirty,
        "nothing clean while the export is away"
    );
    // A drain waits for it (bounded); stopped by its caller here after 0.3 s.
    let started = std::time::Instant::now();
    cache
        .drain(&cfg, &mut |_| {
            started.elapsed() < std::time::Duration::from_millis(300)
        })
        .expect("a drain stopped by its caller");
    assert_eq!(cache.dirty_bytes(), dirty, "still dirty while away");
    // Write-back goes on absorbing writes, and a client's FLUSH needs only the cache.
    vol.write(8 * LINE, &data(8, LINE as usize), false)
        .expect("write while away");
    vol.flush().expect("FLUSH while away");

    // Back: the volume is healthy again (an unreached flush lost nothing) and drains.
    export.away.store(false, Ordering::SeqCst);
    assert_eq!(vol.stats().state, VolumeState::Healthy);
    cache.drain(&cfg, &mut |_| true).expect("drain once back");
    assert_eq!(cache.dirty_bytes(), 0);
    vol.flush().expect("FLUSH once back");
    let mut back = vec![0u8; LINE as usize];
    for i in [0u64, 1, 2, 3, 8] {
        export.inner.read_at(&mut back, i * LINE).expect("read");
        assert!(back == data(i, LINE as usize), "line {i} on the export");
    }
    assert_eq!(
        counter(&vol, "backing_errors"),
        0,
        "nothing was tried while away"
    );
}

#[test]
fn a_fua_write_through_write_is_one_fua_write_and_no_flush() {
    let (export, cache) = setup(CacheMode::WriteThrough);
    let vol = cache.volumes()[0].clone();
    let flushes = export.flushes.load(Ordering::SeqCst);
    vol.write(LINE, &data(1, 4096), true).expect("FUA write");
    assert_eq!(export.fua_writes.load(Ordering::SeqCst), 1);
    assert_eq!(export.flushes.load(Ordering::SeqCst), flushes);
    let mut back = vec![0u8; 4096];
    export.inner.read_at(&mut back, LINE).expect("read");
    assert!(back == data(1, 4096));
}
