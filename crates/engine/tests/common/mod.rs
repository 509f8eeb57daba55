//! Shared setup of the engine's integration tests: memory devices and a formatted cache.

#![allow(dead_code)] // each test file uses a different part

pub mod failing;
pub mod file_cache;

use std::sync::Arc;

use ssdcache_device::BlockDevice;
use ssdcache_devsim::{CrashDevice, MemDevice, Op};
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{format, read_superblock, Cache, NewVolume};
use ssdcache_format::{BackingIdentity, BackingKind, CacheMode};

pub const MIB: u64 = 1 << 20;

pub fn identity(size: u64) -> BackingIdentity {
    BackingIdentity {
        kind: BackingKind::File,
        size,
        path: "mem".into(),
        stable_id: "mem".into(),
        st_dev: 0,
        st_ino: 0,
        st_rdev: 0,
        btime_ns: 0,
    }
}

thread_local! {
    /// The replacement policy of caches this thread formats (0 = LRU).
    pub static POLICY: std::cell::Cell<u32> = std::cell::Cell::new(
        // Review 27: SSDCACHE_TEST_POLICY=<name> makes every test cache use that policy.
        std::env::var("SSDCACHE_TEST_POLICY")
            .ok()
            .and_then(|n| ssdcache_engine::policy::id_of(&n))
            .unwrap_or(0),
    );
}

/// The policy `format_mem` and `format_dev` give new caches on this thread.
pub fn policy_under_test() -> u32 {
    POLICY.with(|p| p.get())
}

thread_local! {
    /// The admission of caches this thread formats.
    pub static ADMISSION: std::cell::Cell<Admission> = const { std::cell::Cell::new(Admission::Always) };
}

/// The admission `format_mem` and `format_dev` give new caches on this thread.
pub fn admission_under_test() -> Admission {
    ADMISSION.with(|a| a.get())
}

/// Sequential cutoff of test volumes: small, so the property tests' streams bypass the cache.
pub const TEST_CUTOFF: u64 = 256 << 10;

/// Formats `cache_dev` for one volume of `backing_size` bytes.
pub fn format_mem(cache_dev: &MemDevice, line_size: u64, mode: CacheMode, backing_size: u64) {
    let volume = NewVolume {
        name: "v".into(),
        mode,
        backing: identity(backing_size),
        sequential_cutoff: TEST_CUTOFF,
        policy: policy_under_test(),
        admission: admission_under_test(),
    };
    format(cache_dev, line_size, volume).expect("format");
}

/// Opens the cache on `cache_dev` with `backing` as its only volume.
pub fn open(
    cache_dev: &Arc<MemDevice>,
    backing: &Arc<MemDevice>,
) -> (Cache, ssdcache_engine::OpenReport) {
    let sb = read_superblock(&**cache_dev).expect("superblock");
    Cache::open(
        cache_dev.clone(),
        sb,
        vec![backing.clone() as Arc<dyn BlockDevice>],
    )
    .expect("open")
}

/// A fresh cache of `cache_size` over a fresh backing device of `backing_size`.
pub fn setup(
    cache_size: u64,
    backing_size: u64,
    line_size: u64,
    mode: CacheMode,
) -> (Arc<MemDevice>, Arc<MemDevice>, Cache) {
    let cache_dev = Arc::new(MemDevice::new("cache", cache_size));
    let backing = Arc::new(MemDevice::new("backing", backing_size));
    format_mem(&cache_dev, line_size, mode, backing_size);
    let (cache, _) = open(&cache_dev, &backing);
    (cache_dev, backing, cache)
}

/// A volume's counter by its name in `VolumeCounters::NAMES`.
pub fn counter(vol: &ssdcache_engine::Volume, name: &str) -> u64 {
    let i = ssdcache_format::VolumeCounters::NAMES
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("no counter named {name}"));
    vol.counters().0[i]
}

/// Formats any device for one volume of `backing_size` bytes with the given sequential cutoff
/// (0 = every request is cached, so tests control exactly what is dirty).
pub fn format_dev(
    dev: &dyn BlockDevice,
    line_size: u64,
    mode: CacheMode,
    backing_size: u64,
    sequential_cutoff: u64,
) {
    let volume = NewVolume {
        name: "v".into(),
        mode,
        backing: identity(backing_size),
        sequential_cutoff,
        policy: policy_under_test(),
        admission: admission_under_test(),
    };
    format(dev, line_size, volume).expect("format");
}

/// Opens the cache on any cache device with `backing` as its only volume.
pub fn open_dyn(
    cache_dev: Arc<dyn BlockDevice>,
    backing: Arc<dyn BlockDevice>,
) -> (Cache, ssdcache_engine::OpenReport) {
    let sb = read_superblock(&*cache_dev).expect("superblock");
    Cache::open(cache_dev, sb, vec![backing]).expect("open")
}

/// A fresh cache on crash-simulating devices (whose fault switches tests can flip), with
/// sequential cutoff 0.
pub fn setup_crash(
    cache_size: u64,
    backing_size: u64,
    line_size: u64,
    mode: CacheMode,
) -> (
    Arc<ssdcache_devsim::CrashDevice>,
    Arc<ssdcache_devsim::CrashDevice>,
    Cache,
) {
    let cache_dev = Arc::new(ssdcache_devsim::CrashDevice::new("cache", cache_size));
    let backing = Arc::new(ssdcache_devsim::CrashDevice::new("backing", backing_size));
    format_dev(&*cache_dev, line_size, mode, backing_size, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    (cache_dev, backing, cache)
}

/// A small deterministic generator (splitmix64) for reproducible workloads.
#[allow(unused_imports)] // not every test file uses it
pub use ssdcache_device::SplitMix64 as Rng;

/// `len` bytes that differ for every `tag` and every 8-byte word, so a read of the wrong write
/// or of the wrong place is visible.
pub fn data(tag: u64, len: usize) -> Vec<u8> {
    let mut x = tag.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&x.to_le_bytes());
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
    }
    v.truncate(len);
    v
}

// ---- helpers of the adversarial-review tests (review*_engine.rs) ----

const REVIEW_SECTOR: usize = 4096;

/// A write-back cache of 32 MiB with 64 KiB lines over a 64 MiB backing device, both
/// crash-simulating, sequential cutoff 0.
pub fn crash_cache() -> (Arc<CrashDevice>, Arc<CrashDevice>, Cache) {
    setup_crash(32 << 20, 64 << 20, 64 << 10, CacheMode::WriteBack)
}

pub fn read_vec(cache: &Cache, offset: u64, len: u64) -> ssdcache_engine::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    cache.volumes()[0].read(offset, &mut buf)?;
    Ok(buf)
}

/// What a power cut leaves when every write to the cache device landed but the backing
/// device kept only what was flushed (a legal outcome: the two devices' volatile caches are
/// independent).
pub fn cut_keeping_cache_writes(
    cache_dev: &CrashDevice,
    backing: &CrashDevice,
) -> (Arc<CrashDevice>, Arc<CrashDevice>) {
    (
        Arc::new(CrashDevice::from_image("cache", cache_dev.written_image())),
        Arc::new(CrashDevice::from_image("backing", backing.durable_image())),
    )
}

/// Describes what a read after the restart returned, for the failure message.
pub fn outcome(read: &ssdcache_engine::Result<Vec<u8>>, flushed: &[u8], oldest: &[u8]) -> String {
    match read {
        Err(e) => format!("an error ({e})"),
        Ok(r) if r == flushed => "the flushed data".into(),
        Ok(r) if r.iter().all(|&b| b == 0) => "zeroes".into(),
        Ok(r) if r == oldest => "the backing device's data, older than the FLUSH".into(),
        Ok(_) => "other data".into(),
    }
}

/// Names what each 4 KiB sector of `got` is: 'A' (the flushed value), 'B' (the failed
/// write's), 'O' (older than the FLUSH), '?' (anything else).
pub fn sector_map(got: &[u8], a: &[u8], b: &[u8], o: &[u8]) -> String {
    got.chunks(REVIEW_SECTOR)
        .enumerate()
        .map(|(i, s)| {
            let at = i * REVIEW_SECTOR..(i + 1) * REVIEW_SECTOR;
            if s == &a[at.clone()] {
                'A'
            } else if s == &b[at.clone()] {
                'B'
            } else if s == &o[at] {
                'O'
            } else {
                '?'
            }
        })
        .collect()
}

/// Polls `done` every 2 ms; fails the test naming `what` when it is not true within `limit`.
pub fn wait_for(what: &str, limit: std::time::Duration, mut done: impl FnMut() -> bool) {
    let began = std::time::Instant::now();
    while !done() {
        assert!(began.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// A cache of `cache_size` bytes of `line`-byte lines in `mode`, over a backing device of
/// `backing_size` bytes behind a gate (`GateDevice`: holds one backing write in flight on
/// demand); the backing memory, the gate and the cache.
pub fn gated_cache(
    mode: CacheMode,
    line: u64,
    backing_size: u64,
    cache_size: u64,
) -> (Arc<MemDevice>, Arc<ssdcache_devsim::GateDevice>, Arc<Cache>) {
    let mem = Arc::new(MemDevice::new("backing", backing_size));
    let gate = Arc::new(ssdcache_devsim::GateDevice::new(mem.clone()));
    let cache_dev = Arc::new(MemDevice::new("cache", cache_size));
    format_dev(&*cache_dev, line, mode, backing_size, 0);
    let (cache, _) = open_dyn(cache_dev, gate.clone());
    (mem, gate, Arc::new(cache))
}

/// Reads `len` bytes at `offset` on a thread of its own; the data arrives on the channel.
pub fn read_in_thread(
    vol: &Arc<ssdcache_engine::Volume>,
    offset: u64,
    len: usize,
) -> std::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let vol = vol.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; len];
        vol.read(offset, &mut buf).expect("read");
        let _ = tx.send(buf);
    });
    rx
}

/// What a memory device holds at `offset`.
pub fn on_disk(mem: &MemDevice, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    mem.read_at(&mut buf, offset).expect("backing read");
    buf
}

/// Writes a known pattern over all `size` bytes of `dev` (each 4 KiB sector its own
/// `data(tag + sector number)`) and returns it: the model of what the device holds.
pub fn seed_sectors(dev: &dyn BlockDevice, size: u64, tag: u64) -> Vec<u8> {
    let mut model = vec![0u8; size as usize];
    for (i, chunk) in model.chunks_mut(4096).enumerate() {
        chunk.copy_from_slice(&data(tag + i as u64, 4096));
    }
    dev.write_at(&model, 0).expect("seed the device");
    model
}

/// The reads (offset, length) among a `RecordingDevice`'s calls, in order.
pub fn reads_of(ops: &[Op]) -> Vec<(u64, u64)> {
    ops.iter()
        .filter_map(|op| match *op {
            Op::Read { offset, len } => Some((offset, len)),
            _ => None,
        })
        .collect()
}

/// A cache of `cache` bytes with volume "a" (id 0) and volume "b" (id 1) of `sizes`, both
/// write-back, cutoff 0, on crash-simulating devices.
pub fn two_volume_cache(
    cache: u64,
    line: u64,
    sizes: [u64; 2],
) -> (Arc<CrashDevice>, [Arc<CrashDevice>; 2]) {
    let cache_dev = Arc::new(CrashDevice::new("cache", cache));
    format_dev(&*cache_dev, line, CacheMode::WriteBack, sizes[0], 0);
    let mut sb = read_superblock(&*cache_dev).expect("superblock");
    sb.volumes[0].name = "a".into();
    let second = ssdcache_format::VolumeSlot {
        id: 1,
        uuid: [7; 16],
        name: "b".into(),
        backing: identity(sizes[1]),
        ..sb.volumes[0].clone()
    };
    sb.volumes.push(second);
    sb.sequence += 1;
    ssdcache_engine::write_superblock(&*cache_dev, &sb).expect("write superblock");
    cache_dev.flush().expect("flush");
    let backings = [
        Arc::new(CrashDevice::new("backing-a", sizes[0])),
        Arc::new(CrashDevice::new("backing-b", sizes[1])),
    ];
    (cache_dev, backings)
}

/// Opens a cache on crash-simulating devices, `backings[i]` the device of volume `i`.
pub fn open_crash(cache_dev: &Arc<CrashDevice>, backings: &[&Arc<CrashDevice>]) -> Cache {
    let sb = read_superblock(&**cache_dev).expect("superblock");
    let b: Vec<Arc<dyn BlockDevice>> = backings
        .iter()
        .map(|d| (*d).clone() as Arc<dyn BlockDevice>)
        .collect();
    Cache::open(cache_dev.clone(), sb, b).expect("open").0
}

/// Reads `len` bytes at `offset` of volume `volume` (by index).
pub fn read_volume(cache: &Cache, volume: usize, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    cache.volumes()[volume]
        .read(offset, &mut buf)
        .expect("read");
    buf
}
