//! Review 45: `Volume::allocation` (block status) against what the volume reads, under
//! concurrency: write-back writes of any offset and length (partial sectors), the cleaner
//! writing back at the same time, mode changes, TRIM / WRITE_ZEROES, evictions (a cache much
//! smaller than the data), backing writes that fail after landing in part, odd backing sizes,
//! line sizes 4 KiB..1 MiB, and the 16,384-line cap.
//!
//! The invariants checked:
//! * a byte a write had *acknowledged before* `allocation` was called is never in a hole
//!   (no TRIM or WRITE_ZEROES touches the range these writes go to);
//! * once quiet, every hole reads as zeroes through the volume.

mod common;

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{identity, MIB};
use ssdcache_device::{BlockDevice, FileDevice, OpenOptions, Run, SplitMix64};
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{format, read_superblock, Cache, CleanerConfig, NewVolume, Select, Volume};
use ssdcache_format::CacheMode;

/// A file backing device whose writes can be made to fail after landing in part (the first
/// half of the buffer written, then EIO), as a disk failing mid-write would.
struct Flaky {
    file: FileDevice,
    fail_writes: AtomicBool,
    failed: AtomicU64,
    rng: Mutex<SplitMix64>,
}

impl BlockDevice for Flaky {
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let fail =
            self.fail_writes.load(Ordering::SeqCst) && self.rng.lock().unwrap().below(4) == 0;
        if fail {
            self.failed.fetch_add(1, Ordering::SeqCst);
            let half = (buf.len() / 2) & !4095;
            if half > 0 {
                self.file.write_at(&buf[..half], offset)?;
            }
            return Err(io::Error::from_raw_os_error(libc_eio()));
        }
        self.file.write_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.file.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.file.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.file.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        "flaky".into()
    }
    fn allocation(&self, offset: u64, len: u64, max_runs: usize) -> io::Result<Vec<Run>> {
        self.file.allocation(offset, len, max_runs)
    }
}

fn libc_eio() -> i32 {
    5
}

/// A sparse file of `size` bytes with some data scattered in it, as a backing device.
fn sparse_backing(dir: &Path, name: &str, size: u64, direct: bool) -> Arc<Flaky> {
    let path = dir.join(name);
    let file = std::fs::File::create(&path).expect("backing file");
    file.set_len(size).expect("size");
    drop(file);
    let opts = OpenOptions {
        write: true,
        direct,
        lock: false,
    };
    let dev = FileDevice::open(&path, opts).expect("open backing");
    // Some data already on the disk: every 3rd MiB has 64 KiB.
    let mut at = 0;
    while at + (64 << 10) <= size {
        dev.write_at(&nonzero(at, 64 << 10), at).expect("seed data");
        at += 3 * MIB;
    }
    Arc::new(Flaky {
        file: dev,
        fail_writes: AtomicBool::new(false),
        failed: AtomicU64::new(0),
        rng: Mutex::new(SplitMix64(size ^ 0x45)),
    })
}

/// Bytes that are never zero.
fn nonzero(tag: u64, len: usize) -> Vec<u8> {
    common::data(tag, len).into_iter().map(|b| b | 1).collect()
}

fn cache_over(backing: Arc<Flaky>, line: u64, cache_size: u64, mode: CacheMode) -> Cache {
    let cache_dev = Arc::new(CrashDevice::new("cache", cache_size));
    let volume = NewVolume {
        name: "v".into(),
        mode,
        backing: identity(backing.size()),
        sequential_cutoff: 0,
        policy: common::policy_under_test(),
        admission: common::admission_under_test(),
    };
    format(&*cache_dev, line, volume).expect("format");
    let sb = read_superblock(&*cache_dev).expect("superblock");
    let backing: Arc<dyn BlockDevice> = backing;
    Cache::open(cache_dev, sb, vec![backing]).expect("open").0
}

/// The runs of `[offset, offset + len)`, asking again where an answer ends.
fn status_of(vol: &Volume, offset: u64, len: u64) -> Vec<(u64, Run)> {
    let mut out = Vec::new();
    let mut at = offset;
    let end = offset + len;
    for _ in 0..100_000 {
        if at >= end {
            return out;
        }
        let runs = vol.allocation(at, end - at).expect("allocation");
        assert!(!runs.is_empty(), "an empty answer at {at}");
        for r in runs {
            assert!(
                r.len > 0 && at + r.len <= end,
                "a run past the request: {r:?}"
            );
            out.push((at, r));
            at += r.len;
        }
    }
    panic!("no progress");
}

/// Every hole of the whole volume reads as zeroes.
fn holes_read_as_zeroes(vol: &Volume, what: &str) {
    let size = vol.size();
    let mut checked = 0u64;
    for (at, r) in status_of(vol, 0, size) {
        if !r.hole {
            continue;
        }
        let mut pos = at;
        while pos < at + r.len {
            let n = (at + r.len - pos).min(MIB);
            let mut buf = vec![0xeeu8; n as usize];
            vol.read(pos, &mut buf).expect("read");
            if let Some(i) = buf.iter().position(|&b| b != 0) {
                panic!(
                    "{what}: byte {} is in a hole [{at}, +{}) but reads {:#x}",
                    pos + i as u64,
                    r.len,
                    buf[i]
                );
            }
            pos += n;
            checked += n;
        }
    }
    assert!(checked > 0, "{what}: no hole at all");
}

/// Acknowledged writes in `[0, half)`, cleaner, mode changes, and TRIM / WRITE_ZEROES / writes
/// in `[half, size)`, with block-status queries checking every acknowledged range.
fn concurrent_round(line: u64, direct: bool, flaky: bool, seed: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let size = 32 * MIB + 100; // a trailing partial sector the volume does not serve
    let backing = sparse_backing(dir.path(), "backing", size, direct);
    let cache = Arc::new(cache_over(
        backing.clone(),
        line,
        (16 * MIB).max(80 * line),
        CacheMode::WriteBack,
    ));
    let vol = cache.volumes()[0].clone();
    assert_eq!(vol.size(), 32 * MIB);
    let half = 16 * MIB;
    backing.fail_writes.store(flaky, Ordering::SeqCst);
    let acked: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs(6);
    let cfg = CleanerConfig::default();
    let max_len = (2 * line).min(256 << 10);
    std::thread::scope(|s| {
        for w in 0..2u64 {
            let (vol, acked, stop) = (&vol, &acked, &stop);
            s.spawn(move || {
                let mut rng = SplitMix64(seed * 31 + w);
                for i in 0..3000u64 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        break;
                    }
                    let len = 1 + rng.below(max_len);
                    let at = rng.below(half - len);
                    if vol
                        .write(at, &nonzero(i + 1000 * w, len as usize), false)
                        .is_ok()
                    {
                        acked.lock().unwrap().push((at, at + len));
                    }
                }
            });
        }
        {
            let (vol, stop) = (&vol, &stop);
            s.spawn(move || {
                let mut rng = SplitMix64(seed * 17);
                for i in 0..3000u64 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        break;
                    }
                    let len = 1 + rng.below(max_len);
                    let at = half + rng.below(half - len);
                    let _ = match i % 3 {
                        0 => vol.trim(at, len, false),
                        1 => vol.write_zeroes(at, len, false),
                        _ => vol.write(at, &nonzero(i, len as usize), false),
                    };
                }
            });
        }
        {
            let (cache, stop, cfg) = (&cache, &stop, &cfg);
            s.spawn(move || {
                for _ in 0..100_000 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        break;
                    }
                    let _ = cache.clean_batch(cfg, 4, Select::All);
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
        }
        {
            let (cache, stop, cfg) = (&cache, &stop, &cfg);
            s.spawn(move || {
                for i in 0..20 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                    let mode = if i % 2 == 0 {
                        CacheMode::WriteThrough
                    } else {
                        CacheMode::WriteBack
                    };
                    let _ = cache.set_mode(0, mode, cfg, &mut |_| {
                        !stop.load(Ordering::SeqCst) && Instant::now() < deadline
                    });
                }
            });
        }
        // The checker.
        let mut rng = SplitMix64(seed * 7 + 3);
        let mut queries = 0;
        for _ in 0..100_000 {
            if Instant::now() > deadline {
                break;
            }
            let before: Vec<(u64, u64)> = acked.lock().unwrap().clone();
            let at = rng.below(half);
            let len = 1 + rng.below(half - at);
            let runs = match vol.allocation(at, len) {
                Ok(runs) => runs,
                Err(e) => panic!("allocation({at}, {len}): {e}"),
            };
            queries += 1;
            let mut pos = at;
            for r in runs {
                if r.hole {
                    if let Some(w) = before.iter().find(|w| w.0 < pos + r.len && w.1 > pos) {
                        stop.store(true, Ordering::SeqCst);
                        panic!(
                            "line {line} direct {direct} flaky {flaky}: hole [{pos}, +{}) \
                             covers acknowledged write {w:?}",
                            r.len
                        );
                    }
                }
                pos += r.len;
            }
        }
        stop.store(true, Ordering::SeqCst);
        assert!(queries > 10, "only {queries} queries");
    });
    backing.fail_writes.store(false, Ordering::SeqCst);
    // Quiet now: every hole reads as zeroes, before and after everything is written back.
    let what = format!("line {line} direct {direct} flaky {flaky}");
    holes_read_as_zeroes(&vol, &format!("{what}, dirty"));
    for (a, b) in acked.lock().unwrap().iter().copied() {
        for (at, r) in status_of(&vol, a, b - a) {
            assert!(
                !r.hole,
                "{what}: acknowledged write [{a}, {b}) has a hole at {at}"
            );
        }
    }
    let _ = cache.set_mode(0, CacheMode::WriteBack, &cfg, &mut |_| true);
    cache.drain(&cfg, &mut |_| true).expect("drain");
    holes_read_as_zeroes(&vol, &format!("{what}, drained"));
}

#[test]
fn acknowledged_writes_are_never_holes_and_holes_read_as_zeroes() {
    for (i, line) in [4096u64, 64 << 10, 1 << 20].into_iter().enumerate() {
        concurrent_round(line, false, false, i as u64);
    }
}

#[test]
fn the_same_with_o_direct_and_backing_writes_failing_in_part() {
    for (i, line) in [4096u64, 64 << 10, 1 << 20].into_iter().enumerate() {
        concurrent_round(line, true, true, 10 + i as u64);
    }
}

/// More dirty lines than one answer looks at (16,384): every dirty sector is still data when
/// the client walks the volume answer by answer, from unaligned offsets too.
#[test]
fn many_dirty_lines_past_the_cap_are_all_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let size = 160 * MIB;
    let backing = sparse_backing(dir.path(), "big", size, false);
    let cache = cache_over(backing, 4096, 160 * MIB, CacheMode::WriteBack);
    let vol = cache.volumes()[0].clone();
    // Every other 4 KiB line of the first 144 MiB dirty (18,432 lines), written 16 sectors
    // at a time with holes between.
    let mut dirty = Vec::new();
    let mut at = 0;
    while at < 144 * MIB {
        let mut buf = vec![0u8; 128 << 10];
        for s in (0..32).step_by(2) {
            buf[s * 4096..(s + 1) * 4096].copy_from_slice(&nonzero(at + s as u64, 4096));
            dirty.push(at + s as u64 * 4096);
        }
        // Zero sectors go to the disk as data; write only the nonzero ones.
        for s in (0..32).step_by(2) {
            vol.write(at + s as u64 * 4096, &buf[s * 4096..(s + 1) * 4096], false)
                .expect("write");
        }
        at += 128 << 10;
    }
    for start in [0u64, 1, 4095, 12345] {
        let runs = status_of(&vol, start, vol.size() - start);
        for &d in &dirty {
            if d + 4096 <= start {
                continue;
            }
            let hole = runs
                .iter()
                .find(|(a, r)| d.max(start) >= *a && d.max(start) < a + r.len)
                .map(|(_, r)| r.hole);
            assert_eq!(hole, Some(false), "dirty sector {d} from {start}");
        }
    }
    holes_read_as_zeroes(&vol, "many dirty lines");
}

/// Dirty data survives a clean shutdown and a restart: it is still data in the map.
#[test]
fn dirty_data_after_a_restart_is_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let backing = sparse_backing(dir.path(), "b", 16 * MIB, false);
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    let volume = NewVolume {
        name: "v".into(),
        mode: CacheMode::WriteBack,
        backing: identity(backing.size()),
        sequential_cutoff: 0,
        policy: common::policy_under_test(),
        admission: common::admission_under_test(),
    };
    format(&*cache_dev, 64 << 10, volume).expect("format");
    let open = || {
        let sb = read_superblock(&*cache_dev).expect("superblock");
        let b: Arc<dyn BlockDevice> = backing.clone();
        let dev: Arc<dyn BlockDevice> = cache_dev.clone();
        Cache::open(dev, sb, vec![b]).expect("open").0
    };
    let cache = open();
    let vol = cache.volumes()[0].clone();
    vol.write(MIB + 100, &nonzero(1, 5000), false)
        .expect("write");
    vol.flush().expect("flush");
    cache.shutdown().expect("shutdown");
    drop(vol);
    drop(cache);
    let cache = open();
    let vol = cache.volumes()[0].clone();
    for (at, r) in status_of(&vol, MIB, 64 << 10) {
        if r.hole {
            assert!(
                at >= MIB + 100 + 5000 || at + r.len <= MIB + 100,
                "the dirty write is a hole after a restart: [{at}, +{})",
                r.len
            );
        }
    }
    holes_read_as_zeroes(&vol, "after a restart");
}
