//! The engine core under load (issue 11): what a request costs the cache device.

mod common;

use std::sync::Arc;

use common::{data, format_dev, open_dyn, reads_of, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, GateDevice, MemDevice, Op, RecordingDevice};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;

fn cache_reads(ops: &[Op]) -> Vec<u64> {
    reads_of(ops).into_iter().map(|(_, len)| len).collect()
}

/// A stream past the sequential cutoff over lines partly cached reads on from the backing
/// device, and lays only the *dirty* sectors over it from the cache: clean cached sectors hold
/// what the backing device holds, so reading them (what the overlay did before) cost the cache
/// device a read per cached run and made warm streams slower than the bare disk.
#[test]
fn a_stream_past_the_cutoff_reads_only_dirty_sectors_from_the_cache() {
    const BACKING: u64 = 64 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let mut model = common::seed_sectors(&*backing, BACKING, 1_000_000);
    let cache_mem = Arc::new(MemDevice::new("cache", 32 * MIB));
    format_dev(&*cache_mem, LINE, CacheMode::WriteBack, BACKING, MIB);
    let cache_dev = Arc::new(RecordingDevice::new(cache_mem.clone()));
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    // Every even line of the first 4 MiB cached clean (read one at a time, backwards: no
    // stream for the detector to bypass).
    let mut buf = vec![0u8; LINE as usize];
    for line in (0..32u64).rev().map(|i| 2 * i) {
        vol.read(line * LINE, &mut buf).expect("warm-up read");
    }
    // Two dirty sectors past where the stream will cross the cutoff.
    for (line, sector) in [(40u64, 3u64), (50, 0)] {
        let at = line * LINE + sector * SECTOR;
        let new = data(line * 100 + sector, SECTOR as usize);
        vol.write(at, &new, false).expect("write");
        model[at as usize..(at + SECTOR) as usize].copy_from_slice(&new);
    }
    // A clean stop and a fresh start: the cache stays warm (and dirty), and the stream
    // detector, which saw the warm-up as a stream running backwards, starts empty.
    cache.shutdown().expect("clean stop");
    drop((vol, cache));
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    // The stream: 4 MiB in 256 KiB reads (each spans two cached and two uncached lines); the
    // first MiB is cached as usual, the rest is past the cutoff.
    let mut got = vec![0u8; 256 << 10];
    for i in 0..16u64 {
        if i == 4 {
            cache_dev.clear();
        }
        let at = i * (256 << 10);
        vol.read(at, &mut got).expect("stream read");
        assert!(
            got[..] == model[at as usize..at as usize + got.len()],
            "stream read at {at} differs from what was written"
        );
    }
    let after_cutoff = cache_reads(&cache_dev.ops());
    assert_eq!(
        after_cutoff,
        vec![SECTOR, SECTOR],
        "past the cutoff only the two dirty sectors come from the cache"
    );
    assert!(
        common::counter(&vol, "bytes_bypassed") >= 3 * MIB,
        "the stream went past the cutoff"
    );
}

/// A cache device whose flushes wait while `hold` is set (at most 30 s).
struct SlowFlush {
    inner: MemDevice,
    hold: std::sync::atomic::AtomicBool,
    waiting: std::sync::atomic::AtomicUsize,
}

impl BlockDevice for SlowFlush {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.hold.load(SeqCst) {
            self.waiting.fetch_add(1, SeqCst);
            let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while self.hold.load(SeqCst) && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            self.waiting.fetch_sub(1, SeqCst);
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        "slow-flush cache".into()
    }
}

/// A write-back writer whose changes fill a commit batch asks the background committer for
/// the commit and returns: it does not wait for the commit's device flushes (which a cache
/// device slow to flush makes long), as it did when it ran the commit itself, holding its
/// lines.
#[test]
fn a_full_commit_batch_never_makes_a_writer_wait_for_the_commit() {
    use std::sync::atomic::Ordering::SeqCst;
    const BACKING: u64 = 64 * MIB;
    let backing = Arc::new(MemDevice::new("backing", BACKING));
    let cache_dev = Arc::new(SlowFlush {
        inner: MemDevice::new("cache", 64 * MIB),
        hold: false.into(),
        waiting: 0.into(),
    });
    format_dev(&*cache_dev, SECTOR, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let cache = Arc::new(cache);
    cache.set_dirty_limit(1.0);
    // No cleaning: only the committer runs.
    cache.start_cleaner(ssdcache_engine::CleanerConfig {
        high_watermark: 1.0,
        low_watermark: 1.0,
        max_age: std::time::Duration::from_secs(3600),
        ..Default::default()
    });
    cache_dev.hold.store(true, SeqCst);
    let writes = 5000u64; // more than a commit batch (4096 changed lines)
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let writer = {
        let cache = cache.clone();
        std::thread::spawn(move || {
            let vol = cache.volumes()[0].clone();
            for i in 0..writes {
                vol.write(i * SECTOR, &data(i + 1, SECTOR as usize), false)
                    .expect("write");
            }
            let _ = done_tx.send(());
        })
    };
    let finished = done_rx.recv_timeout(std::time::Duration::from_secs(20));
    // The committer, asked at the batch, reaches the held flush (bounded wait).
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while cache_dev.waiting.load(SeqCst) == 0 && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let committer_waited = cache_dev.waiting.load(SeqCst) > 0;
    cache_dev.hold.store(false, SeqCst);
    writer.join().expect("writer");
    assert!(
        finished.is_ok(),
        "the writer waited for a commit's flush (more than 20 s for {writes} writes)"
    );
    assert!(
        committer_waited,
        "the committer was asked for the commit and ran it"
    );
    cache.stop_cleaner();
    cache.commit().expect("commit");
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; SECTOR as usize];
    for i in (0..writes).step_by(97) {
        vol.read(i * SECTOR, &mut buf).expect("read");
        assert!(buf == data(i + 1, SECTOR as usize), "write {i} reads back");
    }
}

/// The cleaner writes a line back without holding it: a hit on the line is served while the
/// disk write is in flight (before, it waited for the disk), and a client write that goes to
/// the disk for the same range waits for the writeback, so the older data cannot land after
/// it.
#[test]
fn hits_do_not_wait_for_a_writeback_and_disk_writes_wait_for_it() {
    use std::sync::mpsc::channel;
    use std::time::Duration;
    const BACKING: u64 = 16 * MIB;
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let gate = Arc::new(GateDevice::new(mem.clone()));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, gate.clone());
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    let old = data(1, SECTOR as usize);
    vol.write(0, &old, false).expect("dirty write");
    gate.hold_next_write();
    let cleaner = {
        let cache = cache.clone();
        std::thread::spawn(move || {
            cache.clean_batch(
                &ssdcache_engine::CleanerConfig::default(),
                1,
                ssdcache_engine::Select::All,
            )
        })
    };
    assert!(
        gate.wait_until_held(Duration::from_secs(10)),
        "the writeback reached the disk"
    );
    // A hit on the line, while its writeback waits at the disk.
    let (tx, rx) = channel();
    {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; SECTOR as usize];
            let r = vol.read(0, &mut buf).map(|()| buf);
            let _ = tx.send(r);
        });
    }
    let hit = rx.recv_timeout(Duration::from_secs(10));
    // A write of zeroes to the same sector goes to the disk (write-back sends zero sectors
    // around the cache): it must wait for the writeback in flight.
    let (wtx, wrx) = channel();
    {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let _ = wtx.send(vol.write(0, &[0u8; SECTOR as usize], false));
        });
    }
    let early = wrx.recv_timeout(Duration::from_millis(300));
    gate.release();
    let batch = cleaner.join().expect("cleaner thread");
    let hit = hit.expect("the hit was served while the writeback waited at the disk");
    assert!(hit.expect("read") == old, "the hit returned the dirty data");
    assert!(
        early.is_err(),
        "the disk write did not wait for the writeback in flight"
    );
    wrx.recv_timeout(Duration::from_secs(10))
        .expect("the disk write ended after the writeback")
        .expect("write of zeroes");
    batch.expect("batch");
    let mut on_disk = vec![0u8; SECTOR as usize];
    mem.read_at(&mut on_disk, 0).expect("read backing");
    assert!(
        on_disk.iter().all(|&b| b == 0),
        "the newer write is on the disk, not the older writeback"
    );
    let mut buf = vec![1u8; SECTOR as usize];
    vol.read(0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0));
}

/// A FLUSH costs the hard drive an fdatasync only when something was written to it since the
/// last one: FLUSHes after hits and write-back writes leave the disk alone.
#[test]
fn a_flush_syncs_the_disk_only_after_a_write_to_it() {
    const BACKING: u64 = 16 * MIB;
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    let cache_dev = Arc::new(MemDevice::new("cache", 16 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, backing.clone());
    let vol = cache.volumes()[0].clone();
    let opened = backing.flush_count();
    vol.write(0, &data(1, SECTOR as usize), false)
        .expect("write");
    let mut buf = vec![0u8; SECTOR as usize];
    for _ in 0..3 {
        vol.read(0, &mut buf).expect("hit");
        vol.flush().expect("flush");
    }
    assert_eq!(backing.flush_count(), opened, "nothing reached the disk");
    // A write of zeroes goes to the disk (write-back sends zero sectors around): the next
    // FLUSH syncs it, once.
    vol.write(SECTOR, &[0u8; SECTOR as usize], false)
        .expect("zeroes");
    vol.flush().expect("flush");
    vol.flush().expect("flush");
    assert_eq!(backing.flush_count(), opened + 1);
}

/// A backing device of `size` bytes seeded with a known pattern, recorded, and its model.
fn seeded_backing(size: u64) -> (Arc<RecordingDevice<MemDevice>>, Vec<u8>) {
    let mem = Arc::new(MemDevice::new("backing", size));
    let model = common::seed_sectors(&*mem, size, 2_000_000);
    (Arc::new(RecordingDevice::new(mem)), model)
}

/// A read whose misses lie in several runs between cached lines reads the backing device
/// once, from its first missed byte to its last, not once per run: on a hard drive every
/// further read is a seek and a rotation. (A 1 MiB sequential read over a half-cached range,
/// before its stream reached the cutoff, made eight disk reads, and the warm sequential cells
/// of the benchmark's twice-the-cache set ran below the bare disk.) Dirty sectors, in a
/// cached line and in a line the cache holds only part of, still come from the cache.
#[test]
fn a_read_missing_lines_between_cached_ones_reads_the_disk_once() {
    const BACKING: u64 = 16 * MIB;
    let (backing, mut model) = seeded_backing(BACKING);
    let cache_mem = Arc::new(MemDevice::new("cache", 32 * MIB));
    format_dev(&*cache_mem, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_mem.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    // Every even line of the first MiB cached clean.
    let mut line_buf = vec![0u8; LINE as usize];
    for line in (0..8u64).map(|i| 2 * i) {
        vol.read(line * LINE, &mut line_buf).expect("warm-up read");
    }
    // A dirty sector in a cached line, and one in an uncached line (which the cache then
    // holds in part: a miss for the read, its dirty sector laid over the disk's bytes).
    for (line, sector) in [(4u64, 1u64), (7, 2)] {
        let at = line * LINE + sector * SECTOR;
        let new = data(line * 1000 + sector, SECTOR as usize);
        vol.write(at, &new, false).expect("write");
        model[at as usize..(at + SECTOR) as usize].copy_from_slice(&new);
    }
    backing.clear();
    let mut got = vec![0u8; MIB as usize];
    vol.read(0, &mut got).expect("read");
    assert!(
        got[..] == model[..MIB as usize],
        "the read differs from what was written"
    );
    assert_eq!(
        reads_of(&backing.ops()),
        vec![(LINE, MIB - LINE)],
        "one backing read from the first missed line to the last"
    );
    // The missed lines were cached: the same read is now a hit.
    backing.clear();
    vol.read(0, &mut got).expect("read again");
    assert!(got[..] == model[..MIB as usize], "the second read differs");
    assert_eq!(reads_of(&backing.ops()), vec![], "all cached now");
}

/// Cached lines between the misses that the cache fails to give back are read from the
/// backing device on their own (they are clean: dropped, no error), and the read is right.
#[test]
fn a_spanning_read_whose_cached_lines_fail_reads_them_again() {
    const BACKING: u64 = 16 * MIB;
    let (backing, model) = seeded_backing(BACKING);
    let cache_dev = Arc::new(CrashDevice::new("cache", 32 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteThrough, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let vol = cache.volumes()[0].clone();
    let mut line_buf = vec![0u8; LINE as usize];
    for line in (0..8u64).map(|i| 2 * i) {
        vol.read(line * LINE, &mut line_buf).expect("warm-up read");
    }
    let data_area = cache.layout().data_offset..cache.layout().cache_size;
    cache_dev.fail_reads_in(Some(data_area));
    backing.clear();
    let mut got = vec![0u8; MIB as usize];
    vol.read(0, &mut got)
        .expect("read with failing cache reads");
    cache_dev.fail_reads_in(None);
    assert!(
        got[..] == model[..MIB as usize],
        "the read differs from the disk"
    );
    let reads = reads_of(&backing.ops());
    assert_eq!(reads[0], (LINE, MIB - LINE), "{reads:?}");
    for line in [0u64, 2, 4, 6, 8, 10, 12, 14] {
        assert!(
            reads.contains(&(line * LINE, LINE)),
            "cached line {line} read again from the disk: {reads:?}"
        );
    }
    vol.read(0, &mut got).expect("read after");
    assert!(got[..] == model[..MIB as usize], "the read after differs");
}
