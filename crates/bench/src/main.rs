//! `ssdcache-bench`: engine-level measurements for bench/run, where NBD would only add noise:
//! how fast the cleaner destages dirty data onto the HDD model (against a naive one-at-a-time
//! destage in arrival order), and how long recovery after a crash takes for a cache full of
//! dirty data. Prints one JSON object. `engine`: the engine core alone — write admission with
//! free slots and with every line dirty, cache-hit reads by thread count, metadata per line,
//! four volumes on one cache against four partitions (see engine_bench/mod.rs). And `nbd-load`/`nbd-verify`: a verifying NBD load generator for a
//! running `ssdcache serve` (see nbd_load/mod.rs).

mod engine_bench;
mod nbd_load;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use ssdcache_device::{AlignedBuf, BlockDevice, FileDevice, OpenOptions, SplitMix64 as Rng};
use ssdcache_devsim::hdd::{HddDevice, HddModel, HddParams};
use ssdcache_devsim::{Op, RecordingDevice};
use ssdcache_engine::{read_superblock, Cache, CleanerConfig};
use ssdcache_format::{BackingIdentity, BackingKind, CacheMode};

/// Counts live heap bytes, for `engine`'s metadata measurement (relaxed atomics: cheap).
#[global_allocator]
static ALLOCATOR: engine_bench::alloc::CountingAlloc = engine_bench::alloc::CountingAlloc;

#[derive(Parser)]
#[command(
    name = "ssdcache-bench",
    about = "Engine-level benchmarks of ssdcache (used by bench/run)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Pattern {
    /// 4 KiB writes at random offsets over the whole backing device
    Scattered,
    /// 64 KiB writes covering one contiguous region, in random order
    Dense,
}

#[derive(Subcommand)]
enum Command {
    /// Dirty the cache with a burst of writes, then time the cleaner writing it all back onto
    /// the HDD model; compare with the model's time for a naive destage (one write at a time,
    /// in arrival order)
    Destage(DestageArgs),
    // The engine core alone: its help text is on `EngineArgs` (a doc comment here would
    // replace its long help).
    Engine(engine_bench::EngineArgs),
    /// A verifying NBD load: N connections × queue depth D of random READ, WRITE (some FUA),
    /// TRIM, WRITE_ZEROES and FLUSH, every read checked against a model of the export
    NbdLoad(nbd_load::LoadArgs),
    /// Read a whole NBD export back (twice) and check it against a model saved by nbd-load
    NbdVerify(nbd_load::VerifyArgs),
    /// Fill a cache with dirty data (every line, whole), crash (no shutdown), time the restart
    Recovery {
        #[arg(long)]
        cache: PathBuf,
        #[arg(long)]
        cache_size: u64,
        #[arg(long)]
        backing: PathBuf,
        #[arg(long, default_value_t = 65536)]
        line_size: u64,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Destage(a) => destage(&a),
        Command::Engine(a) => engine_bench::run(&a),
        Command::NbdLoad(a) => nbd_load::load(&a),
        Command::NbdVerify(a) => nbd_load::verify(&a),
        Command::Recovery {
            cache,
            cache_size,
            backing,
            line_size,
        } => recovery(&cache, cache_size, &backing, line_size),
    }
}

#[derive(Args)]
struct DestageArgs {
    #[arg(long)]
    cache: PathBuf,
    /// Replacement policy of the cache
    #[arg(long, default_value = ssdcache_engine::policy::DEFAULT_POLICY)]
    policy: String,
    #[arg(long)]
    cache_size: u64,
    #[arg(long)]
    backing: PathBuf,
    #[arg(long)]
    backing_size: u64,
    #[arg(long, default_value_t = 4096)]
    line_size: u64,
    #[arg(long, value_enum)]
    pattern: Pattern,
    /// Bytes written in the burst
    #[arg(long)]
    bytes: u64,
    /// Dense pattern: where the region starts on the backing device
    #[arg(long, default_value_t = 0)]
    region_offset: u64,
    /// Writes of the naive destage also replayed in real time on the model, to check the
    /// simulated figure
    #[arg(long, default_value_t = 0)]
    naive_sample: usize,
    /// Cleaner writes in flight
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// Dirty lines the cleaner plans per batch [default: the cleaner's default]
    #[arg(long)]
    batch_lines: Option<usize>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// A sparse file of `size` bytes, opened with O_DIRECT.
fn sparse_file(path: &Path, size: u64) -> Result<Arc<FileDevice>> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.set_len(size)?;
    drop(f);
    let dev = FileDevice::open(
        path,
        OpenOptions {
            write: true,
            direct: true,
            lock: true,
        },
    )
    .with_context(|| format!("cannot open {}", path.display()))?;
    Ok(Arc::new(dev))
}

fn identity(size: u64) -> BackingIdentity {
    BackingIdentity {
        kind: BackingKind::File,
        size,
        path: "bench".into(),
        stable_id: "bench".into(),
        st_dev: 0,
        st_ino: 0,
        st_rdev: 0,
        btime_ns: 0,
    }
}

/// A write-back cache on `cache_dev` in front of `backing`.
fn write_back_cache(
    cache_dev: Arc<FileDevice>,
    backing: Arc<dyn BlockDevice>,
    line_size: u64,
    policy: &str,
) -> Result<Cache> {
    let cache = engine_bench::open_cache(
        cache_dev,
        backing,
        line_size,
        CacheMode::WriteBack,
        policy,
        0,
    )?;
    // These measurements need every line dirty (a burst destaged whole, the recovery of a cache
    // full of dirty data), past the default dirty limit.
    cache.set_dirty_limit(1.0);
    Ok(cache)
}

/// The burst: (offset, length) in arrival order.
fn burst(a: &DestageArgs) -> Vec<(u64, u64)> {
    let mut rng = Rng(a.seed);
    match a.pattern {
        Pattern::Scattered => {
            let sectors = a.backing_size / 4096;
            (0..a.bytes / 4096)
                .map(|_| (rng.below(sectors) * 4096, 4096))
                .collect()
        }
        Pattern::Dense => {
            let chunk = 65536;
            rng.shuffled(a.bytes / chunk)
                .into_iter()
                .map(|i| (a.region_offset + i * chunk, chunk))
                .collect()
        }
    }
}

/// Runs `writes` through the volume with 8 threads.
fn load(cache: &Cache, writes: &[(u64, u64)]) -> Result<()> {
    let vol = cache.volumes()[0].clone();
    let next = AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                // Not zeroes: write-back sends all-zero sectors to the backing device (they
                // cost a journal record, not cache space), so a zeroed buffer would measure
                // the disk, not the cache.
                let mut buf = AlignedBuf::zeroed(65536);
                buf.fill(0xa5);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(off, len)) = writes.get(i) else {
                        break;
                    };
                    buf[..8].copy_from_slice(&off.to_le_bytes());
                    if let Err(e) = vol.write(off, &buf[..len as usize], false) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        bail!("write failed during the burst: {e}");
    }
    Ok(cache.commit()?)
}

fn model_params(capacity: u64) -> HddParams {
    HddParams {
        capacity,
        ..HddParams::default()
    }
}

fn destage(a: &DestageArgs) -> Result<()> {
    let params = model_params(a.backing_size);
    let writes = burst(a);
    let backing_file = sparse_file(&a.backing, a.backing_size)?;
    let hdd: Arc<dyn BlockDevice> = Arc::new(HddDevice::new(backing_file.clone(), params));
    let recording = Arc::new(RecordingDevice::new(hdd));
    let cache = write_back_cache(
        sparse_file(&a.cache, a.cache_size)?,
        recording.clone(),
        a.line_size,
        &a.policy,
    )?;
    let t0 = Instant::now();
    load(&cache, &writes)?;
    let load_secs = t0.elapsed().as_secs_f64();
    let dirty_bytes = cache.dirty_bytes();
    let dirty_lines = cache.dirty_lines();
    let around = cache.volumes()[0].stats().counters.0[18];
    if around > 0 {
        bail!("the cache was too small: {around} bytes went around it; use a bigger --cache-size");
    }
    recording.clear();
    let defaults = CleanerConfig::default();
    let cfg = CleanerConfig {
        max_in_flight: a.depth,
        batch_lines: a.batch_lines.unwrap_or(defaults.batch_lines),
        ..defaults
    };
    let t1 = Instant::now();
    cache.drain(&cfg, &mut |_| true)?;
    let destage_secs = t1.elapsed().as_secs_f64();
    let ops = recording.ops();
    let backing_writes = ops.iter().filter(|o| matches!(o, Op::Write { .. })).count();
    let backing_flushes = ops.iter().filter(|o| matches!(o, Op::Flush)).count();
    // Naive: each write of the burst alone, in arrival order, at queue depth 1.
    let mut model = HddModel::new(params);
    let naive_secs = writes
        .iter()
        .fold(0.0, |now, &(off, len)| model.service(off, len, now));
    let naive_sample_secs = naive_sample(&backing_file, params, &writes, a.naive_sample)?;
    let seq_rate = HddModel::new(params).rate(a.region_offset);
    let destage_rate = dirty_bytes as f64 / destage_secs;
    let out = serde_json::json!({
        "pattern": match a.pattern { Pattern::Scattered => "scattered", Pattern::Dense => "dense" },
        "burst_bytes": a.bytes,
        "burst_writes": writes.len(),
        "line_size": a.line_size,
        "backing_size": a.backing_size,
        "cache_size": a.cache_size,
        "depth": a.depth,
        "batch_lines": cfg.batch_lines,
        "load_secs": load_secs,
        "dirty_bytes": dirty_bytes,
        "dirty_lines": dirty_lines,
        "destage_secs": destage_secs,
        "destage_bytes_per_sec": destage_rate,
        "backing_writes": backing_writes,
        "backing_flushes": backing_flushes,
        "naive_model_secs": naive_secs,
        "naive_sample_writes": a.naive_sample,
        "naive_sample_real_secs": naive_sample_secs,
        "naive_sample_model_secs": naive_prefix_secs(params, &writes, a.naive_sample),
        "speedup_vs_naive": naive_secs / destage_secs,
        "model_seq_bytes_per_sec": seq_rate,
        "share_of_sequential": destage_rate / seq_rate,
    });
    drop(cache);
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// The model's time for the first `n` writes alone in arrival order.
fn naive_prefix_secs(p: HddParams, writes: &[(u64, u64)], n: usize) -> f64 {
    let mut model = HddModel::new(p);
    writes
        .iter()
        .take(n)
        .fold(0.0, |now, &(off, len)| model.service(off, len, now))
}

/// The first `n` writes replayed one at a time in real time on a fresh model device.
fn naive_sample(
    file: &Arc<FileDevice>,
    p: HddParams,
    writes: &[(u64, u64)],
    n: usize,
) -> Result<f64> {
    if n == 0 {
        return Ok(0.0);
    }
    let hdd = HddDevice::new(file.clone(), p);
    let buf = AlignedBuf::zeroed(65536);
    let t = Instant::now();
    for &(off, len) in writes.iter().take(n) {
        hdd.write_at(&buf[..len as usize], off)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

fn recovery(cache_path: &Path, cache_size: u64, backing_path: &Path, line_size: u64) -> Result<()> {
    let cache_dev = sparse_file(cache_path, cache_size)?;
    let backing_size = 2 * cache_size;
    let backing: Arc<dyn BlockDevice> = sparse_file(backing_path, backing_size)?;
    let cache = write_back_cache(
        cache_dev.clone(),
        backing.clone(),
        line_size,
        ssdcache_engine::policy::DEFAULT_POLICY,
    )?;
    let lines = cache.layout().line_count;
    let writes: Vec<(u64, u64)> = (0..lines).map(|i| (i * line_size, line_size)).collect();
    let t0 = Instant::now();
    load(&cache, &writes)?;
    let fill_secs = t0.elapsed().as_secs_f64();
    let dirty_before = cache.dirty_bytes();
    if cache.dirty_lines() != lines {
        bail!("only {} of {lines} lines are dirty", cache.dirty_lines());
    }
    // The crash: no shutdown, no checkpoint; the superblock still says "running".
    drop(cache);
    drop(cache_dev);
    let cache_dev = Arc::new(FileDevice::open(
        cache_path,
        OpenOptions {
            write: true,
            direct: true,
            lock: true,
        },
    )?);
    let t1 = Instant::now();
    let sb = read_superblock(&*cache_dev)?;
    let (cache, report) = Cache::open(cache_dev, sb, vec![backing])?;
    let open_secs = t1.elapsed().as_secs_f64();
    let r = report
        .recovery
        .context("the restart did not replay the journal")?;
    // Spot-check that recovered lines read back what was written.
    let vol = cache.volumes()[0].clone();
    let mut buf = AlignedBuf::zeroed(line_size as usize);
    for i in (0..lines).step_by((lines / 64).max(1) as usize) {
        vol.read(i * line_size, &mut buf)?;
        if buf[..8] != (i * line_size).to_le_bytes() {
            bail!("line {i} did not read back after recovery");
        }
    }
    let out = serde_json::json!({
        "cache_size": cache_size,
        "line_size": line_size,
        "lines": lines,
        "fill_secs": fill_secs,
        "dirty_bytes_before": dirty_before,
        "recovered_dirty_lines": r.dirty_lines,
        "recovered_dirty_bytes": r.dirty_bytes,
        "journal_commits": r.commits,
        "journal_blocks": r.journal_blocks,
        "replay_ms": r.millis,
        "open_secs": open_secs,
    });
    drop(cache);
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
