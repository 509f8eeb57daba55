//! Review 48: the engine's new rules for a backing device that can be "unreachable"
//! (f4fd8e9): a NotConnected flush error is not sticky, the cleaner skips unreachable
//! volumes, and FLUSHes are meant to go on during an outage.

mod common;

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{data, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{read_superblock, Cache, CleanerConfig, Select, VolumeState};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;

/// The model network export of network_backing.rs, plus a switch that takes it away right
/// after the next write returned (an outage that begins while the cleaner works: the write
/// went through, the flush that was to cover it cannot reach the export).
struct Export {
    inner: MemDevice,
    away: AtomicBool,
    away_after_next_write: AtomicBool,
}

impl Export {
    fn new(size: u64) -> Export {
        Export {
            inner: MemDevice::new("export", size),
            away: AtomicBool::new(false),
            away_after_next_write: AtomicBool::new(false),
        }
    }
    fn refuse(&self) -> io::Result<()> {
        if self.away.load(Ordering::SeqCst) {
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
        self.inner.write_at(buf, offset)?;
        if self.away_after_next_write.swap(false, Ordering::SeqCst) {
            self.away.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.refuse()?;
        self.inner.flush()
    }
    fn reachable(&self) -> Result<(), String> {
        self.refuse().map_err(|e| e.to_string())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.refuse()?;
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        "nbd://model/export".into()
    }
}

/// A local backing FILE as FileDevice sees it on a FUSE / network file system (GlusterFS's
/// FUSE client, which answers ENOTCONN while its bricks are unreachable and recovers; the
/// kernel reports a writeback error once per fd, errseq): written data sits in a volatile
/// cache until fdatasync; one fdatasync fails with ENOTCONN having DROPPED it, and the next
/// one succeeds (the error was reported once). This is exactly what fsyncgate is about, and
/// it is what `FileDevice::flush` (`self.file.sync_data()`) returns as
/// `io::ErrorKind::NotConnected`.
struct FuseFile {
    durable: MemDevice,
    pending: Mutex<BTreeMap<u64, Vec<u8>>>,
    fail_next_flush: AtomicBool,
}

impl BlockDevice for FuseFile {
    fn size(&self) -> u64 {
        self.durable.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.durable.read_at(buf, offset)?;
        for (&at, d) in self.pending.lock().unwrap().iter() {
            let (s, e) = (
                at.max(offset),
                (at + d.len() as u64).min(offset + buf.len() as u64),
            );
            if s < e {
                buf[(s - offset) as usize..(e - offset) as usize]
                    .copy_from_slice(&d[(s - at) as usize..(e - at) as usize]);
            }
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        // (Tests write whole, non-overlapping blocks.)
        self.pending.lock().unwrap().insert(offset, buf.to_vec());
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let mut pending = self.pending.lock().unwrap();
        if self.fail_next_flush.swap(false, Ordering::SeqCst) {
            pending.clear(); // the writeback failed; the pages are gone
            return Err(io::Error::from_raw_os_error(107)); // ENOTCONN
        }
        for (at, d) in std::mem::take(&mut *pending) {
            self.durable.write_at(&d, at)?;
        }
        Ok(())
    }
    fn discard(&self, _: u64, _: u64) -> io::Result<bool> {
        Ok(false)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_at(&vec![0; len as usize], offset)
    }
    fn describe(&self) -> String {
        "/mnt/gluster/disk.img".into()
    }
}

#[test]
fn review48_enotconn_from_fdatasync_of_a_local_file_escapes_the_sticky_flush_rule() {
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    common::format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, 8 * MIB, 0);
    let file = Arc::new(FuseFile {
        durable: MemDevice::new("file", 8 * MIB),
        pending: Mutex::new(BTreeMap::new()),
        fail_next_flush: AtomicBool::new(false),
    });
    let (cache, _) = common::open_dyn(cache_dev, file.clone());
    let vol = cache.volumes()[0].clone();
    // A client (a database) writes, and fsyncs; the fsync fails...
    vol.write(LINE, &data(1, 4096), false).expect("write");
    file.fail_next_flush.store(true, Ordering::SeqCst);
    assert!(vol.flush().is_err(), "the failed fdatasync is reported");
    // ...so it retries the fsync, as PostgreSQL did before fsyncgate.
    let retried = vol.flush();
    let mut on_disk = vec![0u8; 4096];
    file.durable.read_at(&mut on_disk, LINE).unwrap();
    let lost = on_disk != data(1, 4096);
    assert!(
        !(retried.is_ok() && lost),
        "a FLUSH succeeded although the write it covers never reached the file (state {:?}): \
         ENOTCONN from fdatasync is taken for 'not reached, nothing lost', which only \
         NbdDevice promises",
        vol.stats().state
    );
}

/// Two volumes: "a" on the model export, "b" on a local device.
fn two_volumes() -> (Arc<Export>, Arc<MemDevice>, Cache) {
    let (cache_dev, _) = common::two_volume_cache(32 * MIB, LINE, [8 * MIB, 8 * MIB]);
    let export = Arc::new(Export::new(8 * MIB));
    let local = Arc::new(MemDevice::new("local", 8 * MIB));
    let sb = read_superblock(&*cache_dev).expect("superblock");
    let backings: Vec<Arc<dyn BlockDevice>> = vec![export.clone(), local.clone()];
    let cache = Cache::open(cache_dev, sb, backings).expect("open").0;
    (export, local, cache)
}

#[test]
fn review48_an_outage_that_begins_during_writeback_fails_every_flush_of_every_volume() {
    let (export, _local, cache) = two_volumes();
    let a = cache.volumes()[0].clone();
    let b = cache.volumes()[1].clone();
    a.write(0, &data(1, LINE as usize), false).unwrap();
    a.flush().unwrap();
    // The cleaner writes the line back; the export goes away before the flush that covers it.
    export.away_after_next_write.store(true, Ordering::SeqCst);
    let r = cache.clean_batch(&CleanerConfig::default(), 4, Select::All);
    assert!(
        r.is_err(),
        "the batch's flush could not reach the export: {r:?}"
    );
    assert_eq!(a.stats().state, VolumeState::BackingUnreachable);

    // docs/operations.md: "hits, write-back writes and their FLUSHes go on" while away;
    // network_backing.rs: "a client's FLUSH needs only the cache".
    a.write(2 * LINE, &data(2, LINE as usize), false)
        .expect("write-back write while away");
    let fa = a.flush();
    // A volume on a LOCAL disk has nothing to do with the export.
    b.write(0, &data(3, LINE as usize), false)
        .expect("write to the local volume");
    let fb = b.flush();
    assert!(
        fa.is_ok() && fb.is_ok(),
        "while the export is away, FLUSH of the export's volume: {fa:?}; FLUSH of the volume \
         on a local disk: {fb:?} (every commit flushes every backing device, and the export's \
         has a write due)"
    );
}

#[test]
fn review48_a_drain_during_a_short_blip_fails_at_once_instead_of_waiting() {
    let (export, _local, cache) = two_volumes();
    let a = cache.volumes()[0].clone();
    for i in 0..4u64 {
        a.write(i * LINE, &data(i, LINE as usize), false).unwrap();
    }
    a.flush().unwrap();
    // The connection drops; the export is back 300 ms later (well inside the 60 s that
    // requests are documented to wait through).
    export.away.store(true, Ordering::SeqCst);
    let back = {
        let export = export.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            export.away.store(false, Ordering::SeqCst);
        })
    };
    let started = Instant::now();
    let r = cache.drain(&CleanerConfig::default(), &mut |_| true);
    let took = started.elapsed();
    back.join().unwrap();
    assert!(
        r.is_ok(),
        "`ssdcache flush` during a 0.3 s reconnection failed after {took:?}: {r:?}"
    );
}
