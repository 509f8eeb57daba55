//! Second adversarial review (issue #10), memory bounds: a test binary of its own, because it
//! measures the resident memory of the whole process (other tests running beside it would
//! disturb the measurement).

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SECTOR: u64 = 4096;
/// Prefetch requests in flight at once (a server runs connections × --threads workers: 4096 at
/// the defaults, 2048 in the load test of issue #10).
const WORKERS: usize = 128;

/// A backing device whose reads wait (at most 20 s) until the test opens the gate: a hard
/// drive with a deep queue, so that every worker is inside the engine at the same time.
struct SlowBacking {
    inner: MemDevice,
    gate: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl SlowBacking {
    /// Waits (at most 20 s) until `n` reads are waiting at the gate.
    fn wait_for_readers(&self, n: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut g = self.gate.lock().unwrap();
        while g.0 < n && Instant::now() < deadline {
            g = self
                .changed
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        g.0
    }

    fn open(&self) {
        self.gate.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
}

impl BlockDevice for SlowBacking {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut g = self.gate.lock().unwrap();
        g.0 += 1;
        self.changed.notify_all();
        while !g.1 && Instant::now() < deadline {
            g = self
                .changed
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        drop(g);
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
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
        "slow backing".into()
    }
}

fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

/// Finding R2-2 (fixed: a CACHE request now holds at most one line of its own, and the
/// WRITE_ZEROES fallback writes from one shared buffer). docs/design.md §6.1 says the daemon's resident memory is at most the sum of
/// its rows, and the only engine memory a client request holds outside the request-memory
/// limit is "read misses: a worker whose read misses part of a line holds one line (64 KiB by
/// default) while it reads the disk". But `Volume::prefetch` (NBD_CMD_CACHE, which carries no
/// payload, so the request-memory limit never sees it) allocates and zeroes a 1 MiB buffer
/// whatever the request's length, and holds it while the disk reads: a 4 KiB CACHE costs
/// 1 MiB + one line. At the defaults (128 connections × 32 workers) that is 4 GiB outside
/// every documented bound; in the load test's shape (64 × 32), 2 GiB against a 512 MiB
/// request budget. (`write_zeroes_by_writing`, the WRITE_ZEROES fallback for a backing file
/// without FALLOC_FL_ZERO_RANGE, holds another 1 MiB per request the same way.)
#[test]
fn r2_2_cache_requests_hold_a_megabyte_each_outside_the_memory_bounds() {
    let cache_dev = Arc::new(MemDevice::new("cache", 64 << 20));
    let backing_size = 256 << 20;
    common::format_mem(&cache_dev, LINE, CacheMode::WriteBack, backing_size);
    let backing = Arc::new(SlowBacking {
        inner: MemDevice::new("backing", backing_size),
        gate: Mutex::new((0, false)),
        changed: Condvar::new(),
    });
    let sb = ssdcache_engine::read_superblock(&*cache_dev).unwrap();
    let (cache, _) = ssdcache_engine::Cache::open(
        cache_dev.clone(),
        sb,
        vec![backing.clone() as Arc<dyn BlockDevice>],
    )
    .unwrap();
    let vol = cache.volumes()[0].clone();

    let before = resident_kib();
    let (waiting, during) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..WORKERS as u64)
            .map(|i| {
                let vol = &vol;
                // One 4 KiB prefetch per worker, each in a line of its own (2 MiB apart).
                s.spawn(move || vol.prefetch(i * (2 << 20), SECTOR))
            })
            .collect();
        let waiting = backing.wait_for_readers(WORKERS);
        let during = resident_kib();
        backing.open();
        for w in workers {
            w.join().unwrap().expect("prefetch");
        }
        (waiting, during)
    });
    assert_eq!(
        waiting, WORKERS,
        "every prefetch reached the backing device"
    );
    let grown_kib = during.saturating_sub(before);
    // The documented allowance: one line per worker, plus 64 KiB each for its thread's stack
    // and whatever else (generous).
    let allowed_kib = WORKERS as u64 * (LINE + (64 << 10)) / 1024;
    assert!(
        grown_kib <= allowed_kib,
        "{WORKERS} prefetches of 4 KiB in flight grew the resident memory by {} MiB; the \
         documented allowance (one line each, with generous slack) is {} MiB",
        grown_kib / 1024,
        allowed_kib / 1024
    );
}
