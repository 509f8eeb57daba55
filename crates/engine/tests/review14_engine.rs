//! Review 14: adversarial tests of the cleaner's pacing (commit ae30d24, `Pace::WhileIdle`: a
//! batch begun at full depth on an idle backing device starts no further write once a client
//! uses the device).
//!
//! R14-1 (failed on ae30d24; fixed: `Volume::flush` counts as client use when it reaches the disk): a client FLUSH uses the backing device (`Volume::flush` flushes
//! it, and the cleaner's completed writes make that a real device flush) but is not counted as
//! client use (`note_client_backing_io` is called only for reads, writes, TRIM and
//! WRITE_ZEROES), so a full-depth batch goes on to its end under a client that only flushes.
//!
//! The other tests pin what was found sound: lines split over several writes keep the sectors
//! a deferral left dirty (nothing recorded clean that the backing device lacks), and the
//! trickle still makes progress while a client uses the disk at every instant.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{data, format_dev, open_dyn, wait_for, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{CleanerConfig, Volume};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
const BACKING: u64 = 64 * MIB;
/// Dirty lines live below this; the client's own disk I/O goes above it.
const CLIENT_REGION: u64 = 32 * MIB;
const DIRTY_LINES: u64 = 150;

/// A backing device whose writes below `CLIENT_REGION` (the cleaner's) take 5 ms each and are
/// counted; its flushes take 2 ms. Optionally, the cleaner's first write runs a client read
/// (of `CLIENT_REGION`) while it is in flight, so exactly the writes after it are deferred.
struct SlowDisk {
    inner: Arc<MemDevice>,
    cleaner_writes: AtomicU64,
    cleaner_offsets: Mutex<Vec<u64>>,
    client_on_first_write: OnceLock<Arc<Volume>>,
    client_came: AtomicBool,
}

impl BlockDevice for SlowDisk {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if offset < CLIENT_REGION {
            self.cleaner_offsets
                .lock()
                .expect("offsets lock")
                .push(offset);
            if let Some(vol) = self.client_on_first_write.get() {
                if !self.client_came.swap(true, Ordering::SeqCst) {
                    let mut buf = vec![0u8; SECTOR as usize];
                    vol.read(CLIENT_REGION, &mut buf)
                        .expect("client read during the cleaner's first write");
                }
            }
            std::thread::sleep(Duration::from_millis(5));
            self.cleaner_writes.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        std::thread::sleep(Duration::from_millis(2));
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

fn pacing(cfg: CleanerConfig) -> CleanerConfig {
    CleanerConfig {
        max_in_flight: 4,
        busy_in_flight: 1,
        busy_pause: Duration::from_millis(100),
        busy_batch_lines: 8,
        idle_after: Duration::from_millis(100),
        ..cfg
    }
}

/// Under dirty pressure: every line is cleaned, the coldest first.
fn pressure() -> CleanerConfig {
    pacing(CleanerConfig {
        high_watermark: 0.0,
        low_watermark: 0.0,
        ..CleanerConfig::default()
    })
}

/// The sectors written dirty: `(offset, tag)`.
type Written = Vec<(u64, u64)>;

struct Rig {
    mem: Arc<MemDevice>,
    disk: Arc<SlowDisk>,
    cache: Arc<ssdcache_engine::Cache>,
    written: Written,
}

/// A write-back cache over a `SlowDisk` with the sectors `layout` names written dirty, and
/// the disk idle since (so the cleaner's first batch is `WhileIdle`).
fn rig(cfg: &CleanerConfig, layout: &[u64]) -> Rig {
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let disk = Arc::new(SlowDisk {
        inner: mem.clone(),
        cleaner_writes: AtomicU64::new(0),
        cleaner_offsets: Mutex::new(Vec::new()),
        client_on_first_write: OnceLock::new(),
        client_came: AtomicBool::new(false),
    });
    let cache_dev = Arc::new(MemDevice::new("cache", 24 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, disk.clone());
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    let mut written = Vec::new();
    for (i, &offset) in layout.iter().enumerate() {
        let tag = i as u64 + 1;
        vol.write(offset, &data(tag, SECTOR as usize), false)
            .expect("write-back write");
        written.push((offset, tag));
    }
    std::thread::sleep(cfg.idle_after + Duration::from_millis(50));
    Rig {
        mem,
        disk,
        cache,
        written,
    }
}

impl Rig {
    /// Waits for every line to be written back, stops the cleaner, and checks that the
    /// backing device holds every sector written: nothing was recorded clean that it lacks.
    fn check_all_written_back(&self) {
        wait_for("every line written back", Duration::from_secs(30), || {
            self.cache.dirty_lines() == 0
        });
        self.cache.stop_cleaner();
        for &(offset, tag) in &self.written {
            let mut on_disk = vec![0u8; SECTOR as usize];
            self.mem
                .read_at(&mut on_disk, offset)
                .expect("read backing");
            assert!(
                on_disk == data(tag, SECTOR as usize),
                "sector at byte {offset}: recorded clean, but the backing device does not hold \
                 its data"
            );
        }
    }
}

/// One sector in every other line: no two lines merge into one write.
fn one_sector_per_line() -> Vec<u64> {
    (0..DIRTY_LINES)
        .map(|i| 2 * i * LINE + (i % 16) * SECTOR)
        .collect()
}

/// R14-1. A client whose writes the cache absorbs and who flushes every 10 ms (a database's
/// fsyncs) uses the backing device with each FLUSH: it flushes the backing device, behind the
/// cleaner's writes. The full-depth batch should leave the disk to it as it does for a
/// client's reads and writes; on ae30d24 it goes on to its end.
#[test]
fn r14_1_a_client_flush_stops_a_full_depth_batch() {
    let cfg = pressure();
    let rig = rig(&cfg, &one_sector_per_line());
    rig.cache.start_cleaner(cfg.clone());
    wait_for("the cleaner's first write", Duration::from_secs(5), || {
        rig.disk.cleaner_writes.load(Ordering::SeqCst) >= 1
    });
    let stop = Arc::new(AtomicBool::new(false));
    let flushes = AtomicU64::new(0);
    let during = std::thread::scope(|s| {
        let vol = rig.cache.volumes()[0].clone();
        let (stop_c, flushes) = (stop.clone(), &flushes);
        s.spawn(move || {
            let began = Instant::now();
            while !stop_c.load(Ordering::SeqCst) && began.elapsed() < Duration::from_secs(5) {
                vol.flush().expect("client flush");
                flushes.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        // The window opens once the client's first FLUSH returned: it told the cleaner the
        // disk is in use when it began, and waited for the writes then in flight. Counting
        // from the thread's start instead flaked under load (18 writes: the client's first
        // FLUSH came late, with the batch at full depth meanwhile).
        wait_for("the client's first flush", Duration::from_secs(5), || {
            flushes.load(Ordering::SeqCst) >= 1
        });
        let at_client_start = rig.disk.cleaner_writes.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(600));
        let during = rig.disk.cleaner_writes.load(Ordering::SeqCst) - at_client_start;
        stop.store(true, Ordering::SeqCst);
        during
    });
    assert!(
        flushes.load(Ordering::SeqCst) > 0,
        "the client never flushed"
    );
    // As for a client's reads and writes (cleaner_pacing.rs): the 4 writes in flight finish,
    // then the trickle, one write per 100 ms.
    assert!(
        during <= 4 + 8,
        "the cleaner wrote {during} of {DIRTY_LINES} lines at full depth in the 600 ms a client \
         flushed the backing device every 10 ms (its FLUSHes wait behind them; at most the 4 in \
         flight and a trickle of one per 100 ms expected): Volume::flush does not count as \
         client use of the backing device"
    );
    rig.check_all_written_back();
}

/// Sound: every line holds two separate dirty sectors (two writes each), and a client read
/// arrives while the batch's very first write is in flight (one write in flight, so the
/// deferral is deterministic: the first line's second sector and everything after are
/// deferred). The half-written line stays dirty for its other sector; at the end the backing
/// device holds every sector.
#[test]
fn r14_lines_split_by_a_deferral_keep_their_unwritten_sectors_dirty() {
    let cfg = CleanerConfig {
        max_in_flight: 1,
        ..pressure()
    };
    let lines = 40u64;
    let layout: Vec<u64> = (0..lines)
        .flat_map(|i| [2 * i * LINE + SECTOR, 2 * i * LINE + 3 * SECTOR])
        .collect();
    let rig = rig(&cfg, &layout);
    rig.disk
        .client_on_first_write
        .set(rig.cache.volumes()[0].clone())
        .unwrap_or_else(|_| panic!("hook set twice"));
    let dirty_before = rig.cache.dirty_bytes();
    rig.cache.start_cleaner(cfg.clone());
    wait_for("the cleaner's first write", Duration::from_secs(5), || {
        rig.disk.cleaner_writes.load(Ordering::SeqCst) >= 1
    });
    // The first batch ended after its first write; the trickle (one write, then 100 ms)
    // began at once: at most two sectors, and at most one line, are clean 50 ms on.
    std::thread::sleep(Duration::from_millis(50));
    let dirty_after = rig.cache.dirty_bytes();
    let written = rig.disk.cleaner_writes.load(Ordering::SeqCst);
    assert!(
        written <= 2 && dirty_after >= dirty_before - written * SECTOR,
        "{written} writes, dirty bytes {dirty_before} -> {dirty_after}: more recorded clean \
         than written"
    );
    assert!(
        rig.cache.dirty_lines() >= lines - 1,
        "{} of {lines} lines dirty after {written} single-sector writes",
        rig.cache.dirty_lines()
    );
    rig.check_all_written_back();
}

/// Sound: with a client on the disk at every instant (one request per 10 ms, well under
/// `idle_after`) under dirty pressure, the cleaner never gets a full-depth batch but the
/// trickle still writes back (no livelock of deferred batches), and all data lands.
#[test]
fn r14_the_trickle_progresses_under_a_client_that_never_leaves_the_disk_idle() {
    let cfg = pressure();
    let rig = rig(&cfg, &one_sector_per_line());
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let vol = rig.cache.volumes()[0].clone();
        let stop_c = stop.clone();
        s.spawn(move || {
            let (began, mut i) = (Instant::now(), 0u64);
            while !stop_c.load(Ordering::SeqCst) && began.elapsed() < Duration::from_secs(5) {
                vol.write_zeroes(CLIENT_REGION + (i % 256) * SECTOR, SECTOR, false)
                    .expect("client write_zeroes");
                i += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        // The client is on the disk before the cleaner starts: no batch is WhileIdle.
        std::thread::sleep(Duration::from_millis(30));
        rig.cache.start_cleaner(cfg.clone());
        std::thread::sleep(Duration::from_millis(1500));
        let written = rig.disk.cleaner_writes.load(Ordering::SeqCst);
        stop.store(true, Ordering::SeqCst);
        // One write (5 ms) and a 100 ms pause each: about 14 in 1.5 s.
        assert!(
            (5..=20).contains(&written),
            "the trickle wrote {written} lines in 1.5 s under a busy client (about 14 expected)"
        );
    });
    rig.check_all_written_back();
}
