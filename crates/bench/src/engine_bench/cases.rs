//! The three measurements of `ssdcache-bench engine`.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use ssdcache_device::{AlignedBuf, BlockDevice, SplitMix64};
use ssdcache_devsim::{MemDevice, StripedMemDevice};
use ssdcache_engine::{Cache, Volume};
use ssdcache_format::CacheMode;

use super::timed::{DeviceTimes, TimedDevice};
use super::{alloc, counter, open_cache, EngineArgs, MetaCase, Scratch};

const WRITE_LEN: usize = 4096;

/// Per-request latency of a timed series.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub requests: usize,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Latency {
    fn of(mut nanos: Vec<u64>) -> Latency {
        if nanos.is_empty() {
            return Latency {
                requests: 0,
                mean_us: 0.0,
                p50_us: 0.0,
                p99_us: 0.0,
                max_us: 0.0,
            };
        }
        nanos.sort_unstable();
        let n = nanos.len().max(1);
        // Nearest rank: the smallest value with at least p of the requests at or below it.
        let rank = |p: f64| nanos[((p * n as f64).ceil() as usize).clamp(1, n) - 1] as f64 / 1e3;
        Latency {
            requests: nanos.len(),
            mean_us: nanos.iter().sum::<u64>() as f64 / n as f64 / 1e3,
            p50_us: rank(0.50),
            p99_us: rank(0.99),
            max_us: nanos.last().map_or(0.0, |&x| x as f64 / 1e3),
        }
    }
}

/// Where a timed series' time went, in microseconds per request.
#[derive(Debug, Clone, Serialize)]
pub struct Breakdown {
    /// Cache-device calls: the data write, journal writes and flushes of commits.
    pub cache_device_us: f64,
    /// Backing-device calls: the write-around when no slot could be had.
    pub backing_device_us: f64,
    /// Everything else: the engine's own work (map lock, policy, line locks, bookkeeping).
    pub engine_us: f64,
    pub cache_writes_per_request: f64,
    pub backing_writes_per_request: f64,
}

/// A timed series and its breakdown.
#[derive(Debug, Clone, Serialize)]
pub struct Timed {
    pub latency: Latency,
    pub breakdown: Breakdown,
}

/// Heap the engine holds for a cache at full occupancy.
#[derive(Debug, Clone, Serialize)]
pub struct MetadataRow {
    pub cache_size: u64,
    pub line_size: u64,
    pub lines: u64,
    pub fill_secs: f64,
    /// Live heap bytes after the fill minus before the format.
    pub heap_bytes: u64,
    /// The most heap bytes live at once during open and fill, minus before the format.
    pub heap_peak_bytes: u64,
    pub bytes_per_line: f64,
    pub percent_of_cache: f64,
    pub vmrss_kib: u64,
    pub vmhwm_kib: u64,
    /// Whether the admit measurement's fill of the same cache was used.
    pub from_admit: bool,
    /// Of `heap_bytes`: the metadata pages of checksums in RAM (`--checksum-memory`), and
    /// their budget.
    pub checksum_bytes: u64,
    pub checksum_budget_bytes: u64,
}

impl MetadataRow {
    pub fn taken_from_admit(mut self) -> MetadataRow {
        self.from_admit = true;
        self
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AdmitRow {
    pub cache_size: u64,
    pub line_size: u64,
    pub lines: u64,
    pub policy: String,
    /// The share of lines that may be dirty (1: every line, the state before the limit).
    pub dirty_limit: f64,
    pub free: Timed,
    pub all_dirty: Timed,
    pub fill_secs: f64,
    pub fill_lines_per_sec: f64,
    pub metadata: MetadataRow,
    /// Cache-hit reads of dirty lines by one thread, alone and beside writes into the
    /// all-dirty cache: how long a hit waits for the map lock the writes hold.
    pub hits_beside: Beside,
}

/// One reader thread's cache hits alone, and beside a writer admitting into the all-dirty
/// cache (the reader's latency grows by the time it waits for the map lock).
#[derive(Debug, Clone, Serialize)]
pub struct Beside {
    pub reader_alone: Latency,
    pub reader_beside_writes: Latency,
    pub writer: Latency,
}

impl AdmitRow {
    pub fn same_cache(&self, case: MetaCase) -> bool {
        self.cache_size == case.cache_size && self.line_size == case.line_size
    }
}

/// A write-back cache on a sparse file, a sparse backing file twice its size, both timed.
struct FileCache {
    cache: Cache,
    cache_dev: Arc<TimedDevice>,
    backing_dev: Arc<TimedDevice>,
    heap_before: usize,
}

fn file_cache(a: &EngineArgs, scratch: &Scratch, size: u64, line_size: u64) -> Result<FileCache> {
    let o_direct = "(opened with O_DIRECT: --tmp must be on a disk filesystem, not tmpfs)";
    let cache_file = crate::sparse_file(&scratch.path("cache.img"), size).context(o_direct)?;
    let backing_file =
        crate::sparse_file(&scratch.path("backing.img"), 2 * size).context(o_direct)?;
    let cache_dev = Arc::new(TimedDevice::new(cache_file));
    let backing_dev = Arc::new(TimedDevice::new(backing_file));
    reset_vmhwm();
    let heap_before = alloc::live();
    alloc::reset_peak();
    let cache = open_cache(
        cache_dev.clone(),
        backing_dev.clone(),
        line_size,
        CacheMode::WriteBack,
        &a.policy,
        0,
    )?;
    cache.set_dirty_limit(a.dirty_limit);
    if let Some(bytes) = a.checksum_memory {
        cache.set_checksum_memory(bytes)?;
    }
    Ok(FileCache {
        cache,
        cache_dev,
        backing_dev,
        heap_before,
    })
}

/// The admit measurement for one cache size.
pub fn admit(a: &EngineArgs, size: u64, scratch: &Scratch) -> Result<AdmitRow> {
    let fc = file_cache(a, scratch, size, a.line_size)?;
    let vol = fc.cache.volumes()[0].clone();
    let lines = fc.cache.layout().line_count;
    let n = a.writes as u64;
    if 3 * n > lines {
        bail!(
            "3 x --writes {n} is more than the {lines} lines of a {} cache: give fewer --writes or larger --sizes",
            gib(size)
        );
    }
    eprintln!(
        "admit: {} cache, {lines} lines of {} KiB",
        gib(size),
        a.line_size >> 10
    );
    if n > fc.cache.dirty_limit_lines() {
        bail!("--writes {n} is more than the dirty limit's lines; raise --dirty-limit");
    }
    let free = timed_writes(&fc, &vol, 0..n, a.line_size)?;
    let fill_secs = fill_full(&fc, &vol, n, a.line_size, a.fill_threads, "admit")?;
    let metadata = metadata_row(&fc, size, a.line_size, fill_secs);
    let around_before = counter(&vol, "bytes_written_around_full")?;
    // A profiler attaches on this line to see the full state alone (bench/analysis.md).
    eprintln!("admit: timing {n} writes with every line dirty (up to the dirty limit)");
    let all_dirty = timed_writes(&fc, &vol, lines..lines + n, a.line_size)?;
    let around = counter(&vol, "bytes_written_around_full")? - around_before;
    if around != n * WRITE_LEN as u64 {
        bail!(
            "in the full cache {around} bytes went around it, not {}: the state measured is not the one meant",
            n * WRITE_LEN as u64
        );
    }
    let hits_beside = beside(&vol, 0..lines, lines + n..lines + 2 * n, a.line_size)?;
    Ok(AdmitRow {
        hits_beside,
        cache_size: size,
        line_size: a.line_size,
        lines,
        policy: a.policy.clone(),
        dirty_limit: a.dirty_limit,
        free,
        all_dirty,
        fill_secs,
        fill_lines_per_sec: (lines - n) as f64 / fill_secs,
        metadata,
    })
}

/// At most this many reads are timed per reader series.
const MAX_READER_SAMPLES: usize = 1 << 20;

/// `Beside`: `reads` of random cached lines alone (as many as the writer will take, at most
/// `writes`' count), then again while one thread writes once to each line of `writes`.
fn beside(vol: &Volume, cached: Range<u64>, writes: Range<u64>, line_size: u64) -> Result<Beside> {
    let count = (writes.end - writes.start) as usize;
    let reader_alone = Latency::of(reader(
        vol,
        &cached,
        line_size,
        count,
        &AtomicBool::new(false),
    )?);
    let stop = AtomicBool::new(false);
    let (read_nanos, write_nanos) = std::thread::scope(|s| {
        let r = s.spawn(|| reader(vol, &cached, line_size, MAX_READER_SAMPLES, &stop));
        let w = writer(vol, writes, line_size);
        stop.store(true, Ordering::Relaxed);
        let r = r.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (r, w)
    });
    Ok(Beside {
        reader_alone,
        reader_beside_writes: Latency::of(read_nanos?),
        writer: Latency::of(write_nanos?),
    })
}

/// Times reads of 4 KiB at random lines of `lines` until `stop` or `max` reads.
fn reader(
    vol: &Volume,
    lines: &Range<u64>,
    line_size: u64,
    max: usize,
    stop: &AtomicBool,
) -> Result<Vec<u64>> {
    let mut rng = SplitMix64(lines.end);
    let mut buf = AlignedBuf::zeroed(WRITE_LEN);
    let mut nanos = Vec::with_capacity(max.min(1 << 16));
    while nanos.len() < max && !stop.load(Ordering::Relaxed) {
        let line = lines.start + rng.below(lines.end - lines.start);
        let t = Instant::now();
        vol.read(line * line_size, &mut buf)
            .with_context(|| format!("read of line {line} failed"))?;
        nanos.push(t.elapsed().as_nanos() as u64);
    }
    Ok(nanos)
}

/// One timed 4 KiB write at the start of each line of `lines`.
fn writer(vol: &Volume, lines: Range<u64>, line_size: u64) -> Result<Vec<u64>> {
    let mut buf = AlignedBuf::zeroed(WRITE_LEN);
    buf.fill(0xa5);
    let mut nanos = Vec::with_capacity((lines.end - lines.start) as usize);
    for line in lines {
        buf[..8].copy_from_slice(&line.to_le_bytes());
        let t = Instant::now();
        vol.write(line * line_size, &buf, false)
            .with_context(|| format!("write to line {line} failed"))?;
        nanos.push(t.elapsed().as_nanos() as u64);
    }
    Ok(nanos)
}

/// The metadata measurement for one cache.
pub fn metadata(a: &EngineArgs, case: MetaCase, scratch: &Scratch) -> Result<MetadataRow> {
    let fc = file_cache(a, scratch, case.cache_size, case.line_size)?;
    let vol = fc.cache.volumes()[0].clone();
    let lines = fc.cache.layout().line_count;
    eprintln!(
        "metadata: {} cache, {lines} lines of {} KiB",
        gib(case.cache_size),
        case.line_size >> 10
    );
    let fill_secs = fill_full(&fc, &vol, 0, case.line_size, a.fill_threads, "metadata")?;
    Ok(metadata_row(
        &fc,
        case.cache_size,
        case.line_size,
        fill_secs,
    ))
}

/// Fills every line from `first` on: dirty (one 4 KiB write each) up to the dirty limit, the
/// rest clean (one 4 KiB read miss each). Checks that every line is cached and exactly the
/// dirty limit's lines are dirty. Returns the seconds it took.
fn fill_full(
    fc: &FileCache,
    vol: &Volume,
    first: u64,
    line_size: u64,
    threads: usize,
    what: &str,
) -> Result<f64> {
    let lines = fc.cache.layout().line_count;
    let dirty = fc.cache.dirty_limit_lines().min(lines);
    let t0 = Instant::now();
    fill(vol, first..dirty, line_size, threads, Fill::Write, what)?;
    fill(vol, dirty..lines, line_size, threads, Fill::Read, what)?;
    fc.cache.commit()?;
    let used = vol.stats().lines_used;
    if fc.cache.dirty_lines() != dirty || used != lines {
        bail!(
            "after the fill {used} of {lines} lines are cached, {} dirty (meant: all, {dirty} dirty)",
            fc.cache.dirty_lines()
        );
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn metadata_row(fc: &FileCache, size: u64, line_size: u64, fill_secs: f64) -> MetadataRow {
    let lines = fc.cache.layout().line_count;
    let heap = alloc::live().saturating_sub(fc.heap_before) as u64;
    let (vmrss_kib, vmhwm_kib) = memory_status();
    let bytes_per_line = heap as f64 / lines as f64;
    let checksums = fc.cache.checksum_usage();
    MetadataRow {
        checksum_bytes: checksums.resident_frames * checksums.frame_bytes,
        checksum_budget_bytes: checksums
            .budget_frames
            .saturating_mul(checksums.frame_bytes),
        cache_size: size,
        line_size,
        lines,
        fill_secs,
        heap_bytes: heap,
        heap_peak_bytes: alloc::peak().saturating_sub(fc.heap_before) as u64,
        bytes_per_line,
        percent_of_cache: bytes_per_line / line_size as f64 * 100.0,
        vmrss_kib,
        vmhwm_kib,
        from_admit: false,
    }
}

/// One 4 KiB write at the start of each line of `lines`, one at a time, each timed.
fn timed_writes(fc: &FileCache, vol: &Volume, lines: Range<u64>, line_size: u64) -> Result<Timed> {
    let (cache0, backing0) = (fc.cache_dev.times(), fc.backing_dev.times());
    let nanos = writer(vol, lines, line_size)?;
    let cache = fc.cache_dev.times().since(&cache0);
    let backing = fc.backing_dev.times().since(&backing0);
    let latency = Latency::of(nanos);
    let breakdown = breakdown(&latency, &cache, &backing);
    Ok(Timed { latency, breakdown })
}

fn breakdown(l: &Latency, cache: &DeviceTimes, backing: &DeviceTimes) -> Breakdown {
    let n = l.requests.max(1) as f64;
    let cache_us = cache.total_ns() as f64 / 1e3 / n;
    let backing_us = backing.total_ns() as f64 / 1e3 / n;
    Breakdown {
        cache_device_us: cache_us,
        backing_device_us: backing_us,
        engine_us: l.mean_us - cache_us - backing_us,
        cache_writes_per_request: cache.writes as f64 / n,
        backing_writes_per_request: backing.writes as f64 / n,
    }
}

/// How `fill` brings a line into the cache.
#[derive(Clone, Copy)]
enum Fill {
    /// Dirty: 4 KiB of non-zero data (zero sectors would go around the cache by design).
    Write,
    /// Clean: a 4 KiB read miss.
    Read,
}

/// Brings every line of `lines` into the cache, from `threads` threads; returns the seconds
/// it took. Prints progress on stderr every 5 s.
fn fill(
    vol: &Volume,
    lines: Range<u64>,
    line_size: u64,
    threads: usize,
    how: Fill,
    what: &str,
) -> Result<f64> {
    let total = lines.end - lines.start;
    let next = AtomicU64::new(lines.start);
    let done = AtomicU64::new(0);
    let running = AtomicUsize::new(threads);
    let stop = AtomicBool::new(false);
    let failed = Mutex::new(None);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                if let Err(e) = fill_worker(vol, &next, lines.end, line_size, how, &done, &stop) {
                    stop.store(true, Ordering::Relaxed);
                    *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
                running.fetch_sub(1, Ordering::Relaxed);
            });
        }
        // Ends when every worker has: each writes at most `total` lines.
        let mut shown = Instant::now();
        while running.load(Ordering::Relaxed) > 0 {
            std::thread::sleep(Duration::from_millis(100));
            if shown.elapsed() >= Duration::from_secs(5) {
                let d = done.load(Ordering::Relaxed);
                let secs = t0.elapsed().as_secs_f64();
                eprintln!(
                    "{what}: fill {d}/{total} lines ({:.0}%), {:.0} lines/s, {secs:.0} s",
                    d as f64 * 100.0 / total.max(1) as f64,
                    d as f64 / secs
                );
                shown = Instant::now();
            }
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e.context("the fill failed"));
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn fill_worker(
    vol: &Volume,
    next: &AtomicU64,
    end: u64,
    line_size: u64,
    how: Fill,
    done: &AtomicU64,
    stop: &AtomicBool,
) -> Result<()> {
    let mut buf = AlignedBuf::zeroed(WRITE_LEN);
    buf.fill(0xa5);
    while !stop.load(Ordering::Relaxed) {
        let line = next.fetch_add(1, Ordering::Relaxed);
        if line >= end {
            break;
        }
        let offset = line * line_size;
        match how {
            Fill::Write => {
                buf[..8].copy_from_slice(&line.to_le_bytes());
                vol.write(offset, &buf, false)
                    .with_context(|| format!("write to line {line} failed"))?;
            }
            Fill::Read => vol
                .read(offset, &mut buf)
                .with_context(|| format!("read of line {line} failed"))?,
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Cache-hit reads per second with one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct HitRun {
    pub threads: usize,
    /// More threads than the machine has CPUs.
    pub oversubscribed: bool,
    pub seconds: f64,
    pub requests: u64,
    pub requests_per_sec: f64,
    pub per_thread_per_sec: f64,
    /// Wall time per request in one thread.
    pub mean_us: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct HitsResult {
    pub cache_size: u64,
    pub line_size: u64,
    pub lines: u64,
    pub policy: String,
    /// The volume's sequential cutoff in bytes (0: stream detection off).
    pub sequential_cutoff: u64,
    pub cpus: usize,
    pub runs: Vec<HitRun>,
}

/// The hits measurement: an in-memory cache with every line cached, random 4 KiB reads. The
/// cache device is striped (a lock per 64 KiB): `MemDevice`'s one lock, taken by every read,
/// would be what the threads contend for.
pub fn hits(a: &EngineArgs, cpus: usize) -> Result<HitsResult> {
    let cache_dev: Arc<dyn BlockDevice> =
        Arc::new(StripedMemDevice::new("cache", a.hit_cache_size));
    let backing: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("backing", 2 * a.hit_cache_size));
    let cache = open_cache(
        cache_dev,
        backing,
        a.hit_line_size,
        CacheMode::WriteThrough,
        &a.policy,
        a.hit_cutoff.unwrap_or(0),
    )?;
    let vol = cache.volumes()[0].clone();
    let lines = cache.layout().line_count;
    cache_every_line(&vol, lines, a.hit_line_size, a.seed)?;
    eprintln!(
        "hits: {lines} lines of {} KiB cached, in memory, sequential cutoff {}",
        a.hit_line_size >> 10,
        match a.hit_cutoff {
            None => "off".to_string(),
            Some(c) => format!("{} KiB", c >> 10),
        }
    );
    let mut runs = Vec::new();
    for &threads in &a.threads {
        let run = hit_run(a, &vol, lines * a.hit_line_size, threads, cpus)?;
        runs.push(run);
    }
    Ok(HitsResult {
        cache_size: a.hit_cache_size,
        line_size: a.hit_line_size,
        lines,
        policy: a.policy.clone(),
        sequential_cutoff: a.hit_cutoff.unwrap_or(0),
        cpus,
        runs,
    })
}

/// Writes every line once, in a shuffled order (no stream for a stream detector to bypass).
fn cache_every_line(vol: &Volume, lines: u64, line_size: u64, seed: u64) -> Result<()> {
    let mut buf = AlignedBuf::zeroed(line_size as usize);
    buf.fill(0x5a);
    let mut order: Vec<u64> = (0..lines).collect();
    let mut rng = SplitMix64(seed);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for line in order {
        buf[..8].copy_from_slice(&line.to_le_bytes());
        vol.write(line * line_size, &buf, false)
            .with_context(|| format!("write to line {line} failed"))?;
    }
    if vol.stats().lines_used != lines {
        bail!(
            "only {} of {lines} lines are cached",
            vol.stats().lines_used
        );
    }
    Ok(())
}

/// At most this many reads per thread and run, whatever the clock says.
const MAX_READS_PER_THREAD: u64 = 1 << 32;

fn hit_run(a: &EngineArgs, vol: &Volume, span: u64, threads: usize, cpus: usize) -> Result<HitRun> {
    let (reads0, hits0) = (counter(vol, "reads")?, counter(vol, "read_hits")?);
    let total = AtomicU64::new(0);
    let failed = Mutex::new(None);
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(a.seconds);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (total, failed) = (&total, &failed);
            s.spawn(move || {
                let seed = a.seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                match hit_worker(vol, span, seed, deadline) {
                    Ok(n) => {
                        total.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e),
                }
            });
        }
    });
    let seconds = t0.elapsed().as_secs_f64();
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e.context("a cache-hit read failed"));
    }
    let (reads, hits) = (
        counter(vol, "reads")? - reads0,
        counter(vol, "read_hits")? - hits0,
    );
    let requests = total.into_inner();
    if reads != requests || hits != reads {
        bail!("of {requests} reads the volume counted {reads}, {hits} of them hits: not all hits");
    }
    let rate = requests as f64 / seconds;
    Ok(HitRun {
        threads,
        oversubscribed: threads > cpus,
        seconds,
        requests,
        requests_per_sec: rate,
        per_thread_per_sec: rate / threads as f64,
        mean_us: threads as f64 / rate * 1e6,
    })
}

fn hit_worker(vol: &Volume, span: u64, seed: u64, deadline: Instant) -> Result<u64> {
    let mut rng = SplitMix64(seed);
    let mut buf = AlignedBuf::zeroed(WRITE_LEN);
    let blocks = span / WRITE_LEN as u64;
    let mut n = 0;
    // The clock is read once per 64 reads, so it costs little next to them.
    while n < MAX_READS_PER_THREAD && Instant::now() < deadline {
        for _ in 0..64 {
            let offset = rng.below(blocks) * WRITE_LEN as u64;
            vol.read(offset, &mut buf)
                .with_context(|| format!("read at {offset} failed"))?;
        }
        n += 64;
    }
    Ok(n)
}

/// VmRSS and VmHWM of this process, in KiB (0 when /proc does not say).
fn memory_status() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Starts VmHWM again from the current RSS (Linux: `clear_refs` value 5); a hint only.
fn reset_vmhwm() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let l = Latency::of((1..=100).rev().map(|us| us * 1000).collect());
        assert_eq!(l.requests, 100);
        assert_eq!(l.p50_us, 50.0);
        assert_eq!(l.p99_us, 99.0);
        assert_eq!(l.max_us, 100.0);
        assert!((l.mean_us - 50.5).abs() < 1e-9);
        assert_eq!(Latency::of(Vec::new()).requests, 0);
    }

    /// The admit measurement end to end on a small cache: the all-dirty writes must all go
    /// around the cache (the function checks it), and the metadata count must be plausible.
    #[test]
    fn admit_measures_the_all_dirty_state() {
        let dir = tempfile::tempdir().unwrap();
        let cli = <crate::Cli as clap::Parser>::try_parse_from([
            "ssdcache-bench",
            "engine",
            "--writes",
            "50",
            "--fill-threads",
            "2",
        ])
        .unwrap();
        let crate::Command::Engine(a) = cli.command else {
            panic!("not the engine subcommand")
        };
        let scratch = Scratch::create(dir.path()).unwrap();
        let row = admit(&a, 64 << 20, &scratch).unwrap();
        assert_eq!(row.all_dirty.latency.requests, 50);
        assert_eq!(row.free.latency.requests, 50);
        assert!(row.metadata.bytes_per_line > 64.0, "{:?}", row.metadata);
        assert!(row.hits_beside.reader_alone.requests == 50);
    }
}
