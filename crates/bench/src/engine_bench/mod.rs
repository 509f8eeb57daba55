//! `ssdcache-bench engine`: the engine core on its own, through its public API, no NBD.
//!
//! * **admit** — the cost of a write-back write to a line not in the cache, with free slots
//!   and with every line dirty (issue 11: such a write finds no clean victim and goes to the
//!   backing device), by cache size; with each request's time split into cache-device time,
//!   backing-device time and the rest (the engine's own work).
//! * **hits** — cache-hit reads per second from T threads on an in-memory cache.
//! * **metadata** — heap bytes the engine holds per cache line at full occupancy.
//! * **volumes** — four volumes (one hot, three cold) sharing one cache against the same cache
//!   split into four fixed partitions: each volume's read hit ratio (issue 12).

pub mod alloc;
mod cases;
mod report;
mod timed;
mod volumes;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use ssdcache_device::BlockDevice;
use ssdcache_engine::{format, read_superblock, Cache, NewVolume, Volume};
use ssdcache_format::CacheMode;

/// Which measurements `engine` runs.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Part {
    Admit,
    Hits,
    Metadata,
    Volumes,
}

/// One cache of the metadata measurement: its size and line size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaCase {
    pub cache_size: u64,
    pub line_size: u64,
}

#[derive(Args)]
#[command(
    about = "The engine core alone (no NBD): write admission with free slots and with every \
             line dirty, cache-hit reads per second by thread count, metadata bytes per line, \
             hit ratios of four volumes on one cache against four partitions",
    long_about = "The engine core alone, through its public API (no NBD, no cleaner).\n\n\
admit: for each --sizes, a write-back cache on a sparse file in --tmp (backing: a sparse file \
twice its size, both O_DIRECT). Times --writes single 4 KiB writes to lines not in the cache \
while slots are free, then fills every line with dirty data (one 4 KiB write per line, \
--fill-threads threads, progress on stderr) and times --writes more such writes with every \
line dirty (they find no victim and go to the backing device). With --dirty-limit below 1 \
the fill makes only that share dirty and the rest clean (read misses), and the timed writes \
meet the full cache at its dirty limit. Each request's time is split \
into cache-device time (data and journal writes), backing-device time and the rest: the \
engine's own work (map lock, policy, bookkeeping).\n\n\
hits: an in-memory cache (--hit-cache-size, write-through, memory backing) with every line \
cached; for each --threads, T threads read random 4 KiB blocks for --seconds: requests per \
second in total and per thread. Thread counts above the machine's CPUs are oversubscribed and \
say so.\n\n\
metadata: for each --metadata SIZE:LINE, a cache filled through the engine (every line dirty, or \
up to --dirty-limit and the rest clean); \
the heap bytes it holds (a counting allocator: live after the fill minus live before the \
format) per line and as a share of the cache size, plus VmRSS/VmHWM for reference. A case \
that admit already filled (same size and line size) is taken from there.\n\n\
volumes: four write-through volumes on memory backings, each 16 x --volumes-cache-size, with \
the default sequential cutoff (4 MiB), --policy and --volumes-admission. Shared: one in-memory \
cache of --volumes-cache-size holds all four. Partitioned: four in-memory caches of a quarter \
of its lines each (a little over a quarter of its bytes: each keeps its own metadata and \
journal), one volume each. Both get the same 4 KiB reads (--seed): --volumes-hot-share of them to \
the hot volume, uniform over its first --volumes-hot-set of the shared cache's lines, the rest \
spread evenly over the three cold volumes, uniform over each whole volume. Phase 1: v0 hot; \
phase 2: v1 hot, v0 cold, the caches as phase 1 left them. Each phase: 10 x the shared cache's \
lines of warm-up requests, then 20 x of measured ones. Prints each volume's read hit ratio \
(the engine's counters) in both setups and the hot volume's shared/partitioned ratio.\n\n\
Prints one table per measurement; --json FILE also writes them for bench/report.py. Sizes \
take the units KiB, MiB, GiB, TiB (K, M, G, T are the same, powers of two). Scratch files \
are removed afterwards (a killed run leaves them in --tmp/ssdcache-engine-bench.PID).\n\n\
Example: ssdcache-bench engine --sizes 1GiB,4GiB --only admit --json admit.json"
)]
pub struct EngineArgs {
    /// Measurements to run, comma-separated
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "admit,hits,metadata,volumes"
    )]
    pub only: Vec<Part>,
    /// admit: cache sizes, comma-separated (the sparse files grow by one 4 KiB block per line)
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "1GiB,4GiB,16GiB,64GiB")]
    pub sizes: Vec<u64>,
    /// admit: cache line size
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    pub line_size: u64,
    /// admit: timed writes per series (free slots, all dirty, beside a reader); at most a third
    /// of the cache's lines
    #[arg(long, default_value_t = 2000, value_parser = parse_count)]
    pub writes: usize,
    /// admit, metadata: the share of lines that may be dirty (the engine's dirty limit). The
    /// fill makes that many lines dirty and the rest clean (read misses); 1 = every line dirty
    #[arg(long, default_value_t = 1.0, value_parser = parse_share)]
    pub dirty_limit: f64,
    /// admit, metadata: threads of the fill
    #[arg(long, default_value_t = 8, value_parser = parse_threads)]
    pub fill_threads: usize,
    /// Folder for the sparse cache and backing files (a disk filesystem: O_DIRECT, not tmpfs)
    #[arg(long, default_value = "/var/tmp")]
    pub tmp: PathBuf,
    /// Replacement policy of the caches
    #[arg(long, default_value = ssdcache_engine::policy::DEFAULT_POLICY)]
    pub policy: String,
    /// hits: size of the in-memory cache (its backing: twice that, in memory too)
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pub hit_cache_size: u64,
    /// hits: cache line size
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    pub hit_line_size: u64,
    /// hits: the volume's sequential cutoff (default: none, stream detection off). With a
    /// cutoff every hit also takes the stream detector's lock of its 256 MiB region, as served
    /// volumes do by default (4MiB). The lines are filled in a shuffled order, which is no
    /// stream to bypass
    #[arg(long, value_parser = parse_size)]
    pub hit_cutoff: Option<u64>,
    /// hits: thread counts, comma-separated, each run for --seconds
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", value_parser = parse_threads)]
    pub threads: Vec<usize>,
    /// hits: seconds per thread count
    #[arg(long, default_value_t = 3.0, value_parser = parse_seconds)]
    pub seconds: f64,
    /// admit, metadata: RAM for the data checksums' metadata pages (as `serve
    /// --checksum-memory`; default: the engine's, 0.01% of the cache, at least 1 MiB)
    #[arg(long, value_parser = parse_size)]
    pub checksum_memory: Option<u64>,
    /// metadata: caches as SIZE:LINE_SIZE, comma-separated
    #[arg(long, value_delimiter = ',', value_parser = parse_meta_case,
          default_value = "64GiB:64KiB,16GiB:4KiB")]
    pub metadata: Vec<MetaCase>,
    /// Also write the results as JSON here
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// volumes: size of the shared in-memory cache (at least 64MiB); each partition holds a
    /// quarter of its lines
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pub volumes_cache_size: u64,
    /// volumes: cache line size
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    pub volumes_line_size: u64,
    /// volumes: the share of reads that go to the hot volume
    #[arg(long, default_value_t = 0.7, value_parser = parse_share)]
    pub volumes_hot_share: f64,
    /// volumes: the hot volume's working set, as a share of the shared cache's lines
    #[arg(long, default_value_t = 0.6, value_parser = parse_share)]
    pub volumes_hot_set: f64,
    /// volumes: every volume's admission (`always` or `N-hit`)
    #[arg(long, default_value_t = ssdcache_engine::admission::DEFAULT_ADMISSION)]
    pub volumes_admission: ssdcache_engine::admission::Admission,
    /// Seed of the hits measurement's random offsets and of the volumes measurement's requests
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// A byte count such as `4096`, `64KiB`, `256MiB`, `1GiB` or `1G` (powers of two).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let text = s.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let bad = || {
        format!("{s:?} is not a size: write a whole number with a unit, e.g. 64KiB, 256MiB, 4GiB")
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    match n.checked_mul(scale) {
        Some(0) => Err(format!("{s:?}: a size must be above zero")),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

fn parse_share(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!(
            "{s:?}: give a share above 0 and at most 1, e.g. 0.8"
        )),
    }
}

fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 600.0 => Ok(x),
        _ => Err(format!("{s:?}: give seconds above 0 and at most 600")),
    }
}

/// A thread count: 1 to 256 (a bound on the threads a run starts).
fn parse_threads(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=256).contains(&n) => Ok(n),
        _ => Err(format!("{s:?}: give a thread count from 1 to 256")),
    }
}

/// A count of timed requests: 1 to 10 million (bounds the run's time and its sample memory).
fn parse_count(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=10_000_000).contains(&n) => Ok(n),
        _ => Err(format!("{s:?}: give a count from 1 to 10000000")),
    }
}

fn parse_meta_case(s: &str) -> std::result::Result<MetaCase, String> {
    let (size, line) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: write SIZE:LINE_SIZE, e.g. 64GiB:64KiB"))?;
    Ok(MetaCase {
        cache_size: parse_size(size)?,
        line_size: parse_size(line)?,
    })
}

/// The scratch folder; removed with everything in it when dropped.
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn create(parent: &Path) -> Result<Scratch> {
        let dir = parent.join(format!("ssdcache-engine-bench.{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| {
            format!(
                "cannot create the scratch folder {}; choose another with --tmp",
                dir.display()
            )
        })?;
        Ok(Scratch { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("warning: cannot remove {}: {e}", self.dir.display());
        }
    }
}

/// Formats `cache_dev` as one volume in `mode` over `backing` and opens it (no cleaner). Fills
/// are sequential runs of writes: with a `sequential_cutoff` the stream detector would bypass
/// them, so callers filling in order pass 0.
pub fn open_cache(
    cache_dev: Arc<dyn BlockDevice>,
    backing: Arc<dyn BlockDevice>,
    line_size: u64,
    mode: CacheMode,
    policy: &str,
    sequential_cutoff: u64,
) -> Result<Cache> {
    let policy = policy_id(policy)?;
    format(
        &*cache_dev,
        line_size,
        NewVolume {
            name: "bench".into(),
            mode,
            backing: crate::identity(backing.size()),
            sequential_cutoff,
            policy,
            admission: Default::default(),
        },
    )
    .with_context(|| format!("cannot format {}", cache_dev.describe()))?;
    let sb = read_superblock(&*cache_dev)?;
    Ok(Cache::open(cache_dev, sb, vec![backing])?.0)
}

/// The id of the replacement policy named `policy`.
pub fn policy_id(policy: &str) -> Result<u32> {
    ssdcache_engine::policy::id_of(policy).with_context(|| {
        format!(
            "unknown policy {policy:?}; choose from: {}",
            ssdcache_engine::policy::names().join(", ")
        )
    })
}

/// The value of the volume counter `name` (see `VolumeCounters::NAMES`).
pub fn counter(vol: &Volume, name: &str) -> Result<u64> {
    let at = ssdcache_format::VolumeCounters::NAMES
        .iter()
        .position(|&n| n == name)
        .with_context(|| format!("this engine has no counter {name:?}"))?;
    Ok(vol.stats().counters.0[at])
}

/// Runs the measurements `a.only` names, prints their tables, writes the JSON.
pub fn run(a: &EngineArgs) -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let needs_files = a.only.contains(&Part::Admit) || a.only.contains(&Part::Metadata);
    let scratch = needs_files.then(|| Scratch::create(&a.tmp)).transpose()?;
    let mut admit = Vec::new();
    if a.only.contains(&Part::Admit) {
        for &size in &a.sizes {
            let row = cases::admit(a, size, scratch_of(&scratch)?)?;
            report::print_admit(std::slice::from_ref(&row), admit.is_empty());
            admit.push(row);
        }
    }
    let hits = if a.only.contains(&Part::Hits) {
        let h = cases::hits(a, cpus)?;
        report::print_hits(&h);
        Some(h)
    } else {
        None
    };
    let mut metadata = Vec::new();
    if a.only.contains(&Part::Metadata) {
        for &case in &a.metadata {
            let row = match admit.iter().find(|r| r.same_cache(case)) {
                Some(r) => r.metadata.clone().taken_from_admit(),
                None => cases::metadata(a, case, scratch_of(&scratch)?)?,
            };
            report::print_metadata(std::slice::from_ref(&row), metadata.is_empty());
            metadata.push(row);
        }
    }
    let volumes = if a.only.contains(&Part::Volumes) {
        let v = volumes::volumes(&volumes::Workload::of(a))?;
        report::print_volumes(&v);
        Some(v)
    } else {
        None
    };
    if let Some(path) = &a.json {
        report::write_json(
            path,
            a,
            cpus,
            &admit,
            hits.as_ref(),
            &metadata,
            volumes.as_ref(),
        )?;
    }
    Ok(())
}

fn scratch_of(s: &Option<Scratch>) -> Result<&Scratch> {
    s.as_ref().context("no scratch folder was created")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2tib"), Ok(2 << 40));
        for bad in ["", "0", "1X", "GiB", "1.5GiB", "99999999999999999999"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn metadata_cases_need_both_sizes() {
        assert_eq!(
            parse_meta_case("64GiB:64KiB"),
            Ok(MetaCase {
                cache_size: 64 << 30,
                line_size: 64 << 10
            })
        );
        assert!(parse_meta_case("64GiB").is_err());
        assert!(parse_meta_case("64GiB:").is_err());
    }

    #[test]
    fn shares_and_counts_are_bounded() {
        assert_eq!(parse_share("0.8"), Ok(0.8));
        assert!(parse_share("0").is_err() && parse_share("1.5").is_err());
        assert!(parse_threads("0").is_err() && parse_threads("257").is_err());
        assert!(parse_count("0").is_err() && parse_seconds("601").is_err());
    }
}
