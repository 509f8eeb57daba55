//! The cleaner leaves the backing device to clients: a batch it began at full depth while the
//! disk was idle stops taking new writes as soon as a client uses the disk again, and the rest
//! waits for the trickle.
//!
//! Found by issue 11's per-request breakdown of write-back random 4 KiB writes with a working
//! set twice the cache (BENCHMARKS.md, 0.58× the bare disk): the cache filled with dirty data
//! while the disk was idle, so the cleaner began a batch of 2,048 scattered lines at 32 writes
//! in flight, and that batch went on at full depth for the whole measurement, taking half the
//! disk from the clients' writes sent around the full cache (with `--writeback-high 100` the
//! same cell ran at 1.67×).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{data, format_dev, open_dyn, wait_for, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{MemDevice, SlowWriteDevice};
use ssdcache_engine::CleanerConfig;
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
const BACKING: u64 = 64 * MIB;
/// Dirty lines live below this; the client's own disk I/O goes above it.
const CLIENT_REGION: u64 = 32 * MIB;
const DIRTY_LINES: u64 = 150;

/// Dirty lines written, the cleaner started on an idle disk with `cfg`, and a client that
/// uses the disk every 10 ms from the cleaner's first write on until `stop` is set.
struct Scene {
    mem: Arc<MemDevice>,
    disk: Arc<SlowWriteDevice>,
    cache: Arc<ssdcache_engine::Cache>,
    client_stop: Arc<AtomicBool>,
    client: std::thread::JoinHandle<()>,
    writes_at_client_start: u64,
}

/// One sector in every other line: no two lines merge into one write.
fn sector_of(i: u64) -> u64 {
    2 * i * LINE + (i % 16) * SECTOR
}

/// `DIRTY_LINES` dirty lines in a write-back cache over a backing device whose writes below
/// `CLIENT_REGION` (the cleaner's) take 5 ms each and are counted.
fn dirty_cache() -> (
    Arc<MemDevice>,
    Arc<SlowWriteDevice>,
    Arc<ssdcache_engine::Cache>,
) {
    let mem = Arc::new(MemDevice::new("backing", BACKING));
    let disk = Arc::new(
        SlowWriteDevice::new(mem.clone(), Duration::from_millis(5)).slow_below(CLIENT_REGION),
    );
    let cache_dev = Arc::new(MemDevice::new("cache", 24 * MIB));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let (cache, _) = open_dyn(cache_dev, disk.clone());
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    for i in 0..DIRTY_LINES {
        vol.write(sector_of(i), &data(i + 1, SECTOR as usize), false)
            .expect("write-back write");
    }
    (mem, disk, cache)
}

fn scene(cfg: &CleanerConfig) -> Scene {
    let (mem, disk, cache) = dirty_cache();
    let vol = cache.volumes()[0].clone();
    // No client has used the disk since the cache opened: the first batch runs at full depth.
    std::thread::sleep(cfg.idle_after + Duration::from_millis(50));
    cache.start_cleaner(cfg.clone());
    wait_for("the cleaner's first write", Duration::from_secs(5), || {
        disk.slow_writes() >= 1
    });
    // A client now uses the disk every 10 ms (zeroing above the dirty region).
    let client_stop = Arc::new(AtomicBool::new(false));
    let client_began = Arc::new(AtomicBool::new(false));
    let client = {
        let stop = client_stop.clone();
        let began_flag = client_began.clone();
        std::thread::spawn(move || {
            let mut i = 0u64;
            let began = Instant::now();
            while !stop.load(Ordering::SeqCst) && began.elapsed() < Duration::from_secs(30) {
                vol.write_zeroes(CLIENT_REGION + (i % 256) * SECTOR, SECTOR, false)
                    .expect("client write_zeroes");
                began_flag.store(true, Ordering::SeqCst);
                i += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    // Counted from the client's first use of the disk (on a loaded machine its thread may
    // start late, and until then the batch rightly runs at full depth).
    wait_for(
        "the client's first disk write",
        Duration::from_secs(5),
        || client_began.load(Ordering::SeqCst),
    );
    let writes_at_client_start = disk.slow_writes();
    Scene {
        mem,
        disk,
        cache,
        client_stop,
        client,
        writes_at_client_start,
    }
}

impl Scene {
    /// The client leaves; the cleaner takes the disk again and finishes; the backing device
    /// holds every line's data.
    fn finish(self) {
        self.client_stop.store(true, Ordering::SeqCst);
        self.client.join().expect("client thread");
        wait_for("every line written back", Duration::from_secs(20), || {
            self.cache.dirty_lines() == 0
        });
        self.cache.stop_cleaner();
        for i in 0..DIRTY_LINES {
            let mut on_disk = vec![0u8; SECTOR as usize];
            self.mem
                .read_at(&mut on_disk, sector_of(i))
                .expect("read backing");
            assert!(
                on_disk == data(i + 1, SECTOR as usize),
                "line {i}: the backing device does not hold the written data"
            );
        }
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

/// Under dirty pressure (the coldest lines first).
#[test]
fn a_full_depth_batch_stops_when_a_client_uses_the_disk() {
    let cfg = pacing(CleanerConfig {
        high_watermark: 0.0,
        low_watermark: 0.0,
        ..CleanerConfig::default()
    });
    let scene = scene(&cfg);
    let window = Instant::now();
    std::thread::sleep(Duration::from_millis(600));
    let during = scene.disk.slow_writes() - scene.writes_at_client_start;
    // The writes already in flight (4) finish; then the trickle: one write, a 100 ms pause.
    // Counted against the time that really passed (a loaded machine oversleeps), plus the
    // trickle's write under way at each end of the window.
    let trickle = window.elapsed().as_millis() as u64 / 100 + 2;
    assert!(
        during <= 4 + trickle,
        "the cleaner wrote {during} of {DIRTY_LINES} lines in the {:?} a client used the disk \
         (at most the 4 in flight and a trickle of one per 100 ms expected)",
        window.elapsed()
    );
    assert!(
        scene.cache.dirty_lines() > 0,
        "the full-depth batch went on: every line is clean"
    );
    scene.finish();
}

/// In the address-ordered sweep (aged data), the trickle resumes at the first line the
/// stopped batch left, not after the whole batch it had planned.
#[test]
fn the_sweep_resumes_at_the_first_line_a_stopped_batch_left() {
    let cfg = pacing(CleanerConfig {
        high_watermark: 1.0,
        low_watermark: 1.0,
        max_age: Duration::ZERO,
        batch_lines: 64,
        ..CleanerConfig::default()
    });
    let scene = scene(&cfg);
    let started = scene.writes_at_client_start as usize;
    wait_for("the trickle's writes", Duration::from_secs(10), || {
        scene.disk.slow_write_offsets().len() >= started + 4 + 2
    });
    let offsets = scene.disk.slow_write_offsets();
    // Past the writes in flight when the client came, the trickle's first write.
    let trickled = offsets[started + 4];
    assert!(
        trickled < sector_of(64),
        "the trickle began at byte {trickled}, past the 64 lines of the stopped batch \
         (it should go on from the first line that batch did not write)"
    );
    scene.finish();
}

/// Stopping the cleaner (the daemon's SIGTERM, `systemctl stop`) ends the batch under way: the
/// writes in flight finish, no further one starts, and the rest stays dirty for the next run.
/// Before, the stop waited for the whole batch (up to 2,048 scattered lines at the disk's
/// speed: `bench/run --quick` saw a write-back server ignore SIGTERM for 10 s and killed it).
#[test]
fn stopping_the_cleaner_ends_its_batch_without_writing_the_rest() {
    let (mem, disk, cache) = dirty_cache();
    let vol = cache.volumes()[0].clone();
    let cfg = CleanerConfig {
        max_in_flight: 1,
        ..pacing(CleanerConfig {
            high_watermark: 0.0,
            low_watermark: 0.0,
            ..CleanerConfig::default()
        })
    };
    std::thread::sleep(cfg.idle_after + Duration::from_millis(50));
    cache.start_cleaner(cfg.clone());
    wait_for("the cleaner's first write", Duration::from_secs(5), || {
        disk.slow_writes() >= 1
    });
    let at_stop = disk.slow_writes();
    cache.stop_cleaner();
    let after = disk.slow_writes();
    assert!(
        after <= at_stop + 1,
        "the cleaner wrote {} more lines after it was told to stop (its one write in flight \
         expected)",
        after - at_stop
    );
    assert!(cache.dirty_lines() > 0, "the whole batch was written back");
    // Nothing is lost: every line reads its data, and a later run writes the rest back.
    for i in 0..DIRTY_LINES {
        let mut buf = vec![0u8; SECTOR as usize];
        vol.read(sector_of(i), &mut buf).expect("read");
        assert!(
            buf == data(i + 1, SECTOR as usize),
            "line {i} reads other data"
        );
    }
    cache.start_cleaner(cfg);
    wait_for("every line written back", Duration::from_secs(20), || {
        cache.dirty_lines() == 0
    });
    cache.stop_cleaner();
    for i in 0..DIRTY_LINES {
        let mut on_disk = vec![0u8; SECTOR as usize];
        mem.read_at(&mut on_disk, sector_of(i))
            .expect("read backing");
        assert!(
            on_disk == data(i + 1, SECTOR as usize),
            "line {i}: the backing device does not hold the written data"
        );
    }
}
