//! The volumes measurement of `ssdcache-bench engine` (issue 12): four volumes, one hot and
//! three cold, on one shared cache against the same cache split into four fixed partitions
//! (one cache per disk, what users would build without volumes). Both setups get the same
//! request sequence; the engine's own counters give each volume's read hit ratio.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use ssdcache_device::{AlignedBuf, BlockDevice, SplitMix64};
use ssdcache_devsim::MemDevice;
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{format, read_superblock, write_superblock, Cache, NewVolume, Volume};
use ssdcache_format::{BackingIdentity, CacheMode, Layout, VolumeSlot};

use super::{counter, policy_id, EngineArgs};

/// The volumes of both setups.
pub const VOLUMES: usize = 4;
/// Every request reads this much, at a multiple of it.
const READ_LEN: u64 = 4096;
/// `ssdcache create`'s and `volume add`'s default sequential cutoff.
const CREATE_CUTOFF: u64 = 4 << 20;
/// Each volume's size, in shared caches: the cold volumes' data is 3 × this the cache.
const VOLUME_SIZE_IN_CACHES: u64 = 16;

/// The workload and the caches, derived from the arguments.
#[derive(Debug, Clone)]
pub struct Workload {
    pub cache_size: u64,
    pub line_size: u64,
    pub policy: String,
    pub admission: Admission,
    /// The share of requests that go to the hot volume.
    pub hot_share: f64,
    /// The hot volume's working set as a share of the shared cache's lines.
    pub hot_set: f64,
    /// Warm-up and measured requests per phase, in shared-cache lines.
    pub warmup_passes: u64,
    pub measured_passes: u64,
    pub seed: u64,
}

impl Workload {
    pub fn of(a: &EngineArgs) -> Workload {
        Workload {
            cache_size: a.volumes_cache_size,
            line_size: a.volumes_line_size,
            policy: a.policy.clone(),
            admission: a.volumes_admission,
            hot_share: a.volumes_hot_share,
            hot_set: a.volumes_hot_set,
            warmup_passes: 10,
            measured_passes: 20,
            seed: a.seed,
        }
    }

    fn volume_size(&self) -> u64 {
        VOLUME_SIZE_IN_CACHES * self.cache_size
    }
}

/// One volume's reads in the measured window of a phase.
#[derive(Debug, Clone, Serialize)]
pub struct VolumeHits {
    pub name: String,
    pub hot: bool,
    pub reads: u64,
    pub hits: u64,
    pub hit_ratio: f64,
    /// Lines the volume holds at the end of the phase (in the partitioned setup: of its own
    /// cache).
    pub lines_used: u64,
}

/// One setup in one phase.
#[derive(Debug, Clone, Serialize)]
pub struct SetupPhase {
    /// The hot volume's hit ratio during the warm-up (in the second phase: how fast the cache
    /// follows the new hot volume).
    pub warmup_hot_hit_ratio: f64,
    pub volumes: Vec<VolumeHits>,
    /// All reads of the measured window.
    pub overall_hit_ratio: f64,
}

impl SetupPhase {
    fn hot(&self) -> &VolumeHits {
        self.volumes
            .iter()
            .find(|v| v.hot)
            .unwrap_or(&self.volumes[0])
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct VolumesPhase {
    /// Index of the hot volume.
    pub hot: usize,
    pub shared: SetupPhase,
    pub partitioned: SetupPhase,
    /// The hot volume's hit ratio, shared over partitioned.
    pub hot_ratio: f64,
    /// The overall hit ratio, shared over partitioned.
    pub overall_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct VolumesResult {
    pub volumes: usize,
    pub mode: String,
    pub policy: String,
    pub admission: String,
    pub sequential_cutoff: u64,
    pub cache_size: u64,
    pub line_size: u64,
    /// Data lines of the shared cache, and of each partition (a quarter of the shared cache's,
    /// rounded up: each partition is a little over a quarter of the bytes, since each keeps its
    /// own superblocks, metadata and journal).
    pub shared_lines: u64,
    pub partition_lines: u64,
    /// Each partition's size in bytes.
    pub partition_size: u64,
    pub volume_size: u64,
    pub request_size: u64,
    pub hot_share: f64,
    pub hot_set_lines: u64,
    /// The hot set over the shared cache's lines, and over one partition's.
    pub hot_set_of_shared: f64,
    pub hot_set_of_partition: f64,
    pub warmup_requests: u64,
    pub measured_requests: u64,
    pub seed: u64,
    pub phases: Vec<VolumesPhase>,
    pub shared_secs: f64,
    pub partitioned_secs: f64,
}

/// Runs the measurement: both setups side by side (one thread each), the same requests.
pub fn volumes(w: &Workload) -> Result<VolumesResult> {
    let hot_share_ok = w.hot_share > 0.0 && w.hot_share < 1.0;
    let hot_set_ok = w.hot_set > 0.0 && w.hot_set <= 1.0;
    if !(hot_share_ok && hot_set_ok) {
        bail!("the hot share must be in (0, 1) and the hot set in (0, 1]");
    }
    let shared = Setup::shared(w).context("the shared cache")?;
    let shared_lines = shared.caches[0].layout().line_count;
    let part_size = partition_size(w.cache_size, w.line_size, shared_lines)?;
    let partitioned = Setup::partitioned(w, part_size).with_context(|| {
        format!(
            "a partition of {} MiB (a quarter of --volumes-cache-size's lines); a cache needs at \
             least 16 MiB",
            part_size >> 20
        )
    })?;
    let partition_lines = partitioned.caches[0].layout().line_count;
    let hot_set_lines = ((w.hot_set * shared_lines as f64).round() as u64).max(1);
    let warmup = w.warmup_passes * shared_lines;
    let measured = w.measured_passes * shared_lines;
    eprintln!(
        "volumes: {VOLUMES} volumes of {} MiB, shared cache {shared_lines} lines against \
         {VOLUMES} x {partition_lines}; hot set {hot_set_lines} lines, {:.0}% of requests; \
         {warmup} warm-up + {measured} measured requests per phase",
        w.volume_size() >> 20,
        w.hot_share * 100.0
    );
    let phases_hot = [0usize, 1];
    let run = |setup: &Setup| -> Result<(Vec<SetupPhase>, f64)> {
        let t0 = Instant::now();
        let mut rng = SplitMix64(w.seed);
        let mut out = Vec::new();
        for &hot in &phases_hot {
            let gen = Requests {
                hot,
                hot_set_lines,
                hot_share: w.hot_share,
                line_size: w.line_size,
                volume_size: w.volume_size(),
            };
            out.push(setup.phase(&gen, &mut rng, warmup, measured)?);
        }
        Ok((out, t0.elapsed().as_secs_f64()))
    };
    let (s, p) = std::thread::scope(|scope| {
        let s = scope.spawn(|| run(&shared));
        let p = run(&partitioned);
        (s.join().unwrap_or_else(|e| std::panic::resume_unwind(e)), p)
    });
    let ((shared_phases, shared_secs), (part_phases, partitioned_secs)) =
        (s.context("shared cache")?, p.context("partitioned caches")?);
    let phases = phases_hot
        .iter()
        .zip(shared_phases.into_iter().zip(part_phases))
        .map(|(&hot, (shared, partitioned))| VolumesPhase {
            hot,
            hot_ratio: shared.hot().hit_ratio / partitioned.hot().hit_ratio,
            overall_ratio: shared.overall_hit_ratio / partitioned.overall_hit_ratio,
            shared,
            partitioned,
        })
        .collect();
    Ok(VolumesResult {
        volumes: VOLUMES,
        mode: CacheMode::WriteThrough.to_string(),
        policy: w.policy.clone(),
        admission: w.admission.to_string(),
        sequential_cutoff: CREATE_CUTOFF,
        cache_size: w.cache_size,
        line_size: w.line_size,
        shared_lines,
        partition_lines,
        partition_size: part_size,
        volume_size: w.volume_size(),
        request_size: READ_LEN,
        hot_share: w.hot_share,
        hot_set_lines,
        hot_set_of_shared: hot_set_lines as f64 / shared_lines as f64,
        hot_set_of_partition: hot_set_lines as f64 / partition_lines as f64,
        warmup_requests: warmup,
        measured_requests: measured,
        seed: w.seed,
        phases,
        shared_secs,
        partitioned_secs,
    })
}

/// The size of each partition: the smallest (in steps of a line) with at least a quarter of
/// the shared cache's data lines. A quarter of the bytes would hold fewer: each small cache
/// keeps its own superblocks, metadata and journal (at 64 MiB: 4 x 160 lines against 928).
fn partition_size(cache_size: u64, line_size: u64, shared_lines: u64) -> Result<u64> {
    let want = shared_lines / VOLUMES as u64;
    let mut size = (cache_size / VOLUMES as u64).next_multiple_of(line_size);
    while size <= cache_size {
        match Layout::compute(size, line_size) {
            Ok(l) if l.line_count >= want => return Ok(size),
            _ => size += line_size,
        }
    }
    bail!(
        "no partition smaller than the whole cache holds {want} lines of {} KiB",
        line_size >> 10
    )
}

/// The request sequence of one phase: `hot_share` of the reads go to volume `hot`, uniformly
/// over the first `hot_set_lines` lines of it (a random 4 KiB block of a random line); the rest
/// to one of the other volumes, chosen uniformly, at a uniform 4 KiB block of the whole volume.
struct Requests {
    hot: usize,
    hot_set_lines: u64,
    hot_share: f64,
    line_size: u64,
    volume_size: u64,
}

impl Requests {
    /// The next request: (volume, offset). Draws the same numbers whatever the caches do.
    fn next(&self, rng: &mut SplitMix64) -> (usize, u64) {
        let blocks_per_line = self.line_size / READ_LEN;
        if rng.unit() < self.hot_share {
            let line = rng.below(self.hot_set_lines);
            let block = rng.below(blocks_per_line);
            (self.hot, line * self.line_size + block * READ_LEN)
        } else {
            let other = rng.below(VOLUMES as u64 - 1) as usize;
            let volume = if other >= self.hot { other + 1 } else { other };
            (volume, rng.below(self.volume_size / READ_LEN) * READ_LEN)
        }
    }
}

/// Either setup: volume i of the workload is `volumes[i]`.
struct Setup {
    caches: Vec<Cache>,
    volumes: Vec<Arc<Volume>>,
}

fn name(i: usize) -> String {
    format!("v{i}")
}

/// A distinct identity per volume (the engine is given the devices themselves).
fn identity(i: usize, size: u64) -> BackingIdentity {
    let mut id = crate::identity(size);
    id.stable_id = format!("bench-volume-{i}");
    id.path = format!("mem:{}", name(i));
    id
}

fn backing(i: usize, size: u64) -> Arc<dyn BlockDevice> {
    // Zeroed memory the kernel maps lazily: reads of it take no RAM.
    Arc::new(MemDevice::new(&format!("backing-{}", name(i)), size))
}

/// Formats an in-memory cache of `size` with the given volumes (as `create` and then `volume
/// add` would: write-through, the default cutoff, the same policy and admission) and opens it.
fn cache_of(w: &Workload, size: u64, volumes: &[usize]) -> Result<Cache> {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("cache", size));
    let first = volumes[0];
    format(
        &*dev,
        w.line_size,
        NewVolume {
            name: name(first),
            mode: CacheMode::WriteThrough,
            backing: identity(first, w.volume_size()),
            sequential_cutoff: CREATE_CUTOFF,
            policy: policy_id(&w.policy)?,
            admission: w.admission,
        },
    )?;
    let mut sb = read_superblock(&*dev)?;
    for (id, &i) in volumes.iter().enumerate().skip(1) {
        let mut uuid = sb.volumes[0].uuid;
        uuid[0] ^= id as u8;
        let slot = VolumeSlot {
            id: id as u16,
            uuid,
            name: name(i),
            backing: identity(i, w.volume_size()),
            ..sb.volumes[0].clone()
        };
        sb.volumes.push(slot);
    }
    if volumes.len() > 1 {
        sb.sequence += 1;
        write_superblock(&*dev, &sb)?;
    }
    let sb = read_superblock(&*dev)?;
    let backings = volumes
        .iter()
        .map(|&i| backing(i, w.volume_size()))
        .collect();
    Ok(Cache::open(dev, sb, backings)?.0)
}

impl Setup {
    fn shared(w: &Workload) -> Result<Setup> {
        let cache = cache_of(w, w.cache_size, &(0..VOLUMES).collect::<Vec<_>>())?;
        let volumes = cache.volumes().to_vec();
        Ok(Setup {
            caches: vec![cache],
            volumes,
        })
    }

    fn partitioned(w: &Workload, part_size: u64) -> Result<Setup> {
        let caches = (0..VOLUMES)
            .map(|i| cache_of(w, part_size, &[i]))
            .collect::<Result<Vec<_>>>()?;
        let volumes = caches.iter().map(|c| c.volumes()[0].clone()).collect();
        Ok(Setup { caches, volumes })
    }

    /// Per volume: (reads, read hits) so far, from the engine's counters.
    fn counts(&self) -> Result<Vec<(u64, u64)>> {
        self.volumes
            .iter()
            .map(|v| Ok((counter(v, "reads")?, counter(v, "read_hits")?)))
            .collect()
    }

    /// Issues `n` requests; checks that every volume counted the reads it was sent. Returns
    /// each volume's (reads, hits) of the window.
    fn window(&self, gen: &Requests, rng: &mut SplitMix64, n: u64) -> Result<Vec<(u64, u64)>> {
        let before = self.counts()?;
        let mut sent = [0u64; VOLUMES];
        let mut buf = AlignedBuf::zeroed(READ_LEN as usize);
        for _ in 0..n {
            let (v, offset) = gen.next(rng);
            self.volumes[v]
                .read(offset, &mut buf)
                .with_context(|| format!("read of volume {} at {offset} failed", name(v)))?;
            sent[v] += 1;
        }
        let after = self.counts()?;
        let mut out = Vec::new();
        for (i, ((r0, h0), (r1, h1))) in before.into_iter().zip(after).enumerate() {
            if r1 - r0 != sent[i] {
                bail!(
                    "volume {} counted {} reads of the {} sent",
                    name(i),
                    r1 - r0,
                    sent[i]
                );
            }
            out.push((r1 - r0, h1 - h0));
        }
        Ok(out)
    }

    fn phase(
        &self,
        gen: &Requests,
        rng: &mut SplitMix64,
        warmup: u64,
        measured: u64,
    ) -> Result<SetupPhase> {
        let warm = self.window(gen, rng, warmup)?;
        let counts = self.window(gen, rng, measured)?;
        for c in &self.caches {
            c.commit()?;
        }
        let volumes = counts
            .iter()
            .enumerate()
            .map(|(i, &(reads, hits))| VolumeHits {
                name: name(i),
                hot: i == gen.hot,
                reads,
                hits,
                hit_ratio: share(hits, reads),
                lines_used: self.volumes[i].stats().lines_used,
            })
            .collect();
        let (reads, hits) = counts
            .iter()
            .fold((0, 0), |(r, h), &(r1, h1)| (r + r1, h + h1));
        Ok(SetupPhase {
            warmup_hot_hit_ratio: share(warm[gen.hot].1, warm[gen.hot].0),
            volumes,
            overall_hit_ratio: share(hits, reads),
        })
    }
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_the_same_sequence_and_keep_to_their_volumes() {
        let gen = Requests {
            hot: 1,
            hot_set_lines: 10,
            hot_share: 0.7,
            line_size: 64 << 10,
            volume_size: 1 << 30,
        };
        let (mut a, mut b) = (SplitMix64(3), SplitMix64(3));
        let mut per = [0u64; VOLUMES];
        for _ in 0..10_000 {
            let (v, off) = gen.next(&mut a);
            assert_eq!((v, off), gen.next(&mut b));
            assert_eq!(off % READ_LEN, 0);
            if v == 1 {
                assert!(off < 10 * (64 << 10));
            } else {
                assert!(off < 1 << 30);
            }
            per[v] += 1;
        }
        assert!((6_700..7_300).contains(&per[1]), "{per:?}");
        assert!(per.iter().all(|&n| n > 800), "{per:?}");
    }

    /// A small run end to end: the shared cache holds the hot set, a partition cannot.
    #[test]
    fn the_shared_cache_keeps_the_hot_set() {
        let w = Workload {
            cache_size: 64 << 20,
            line_size: 64 << 10,
            policy: ssdcache_engine::policy::DEFAULT_POLICY.into(),
            admission: Admission::default(),
            hot_share: 0.7,
            hot_set: 0.6,
            warmup_passes: 4,
            measured_passes: 4,
            seed: 1,
        };
        let r = volumes(&w).unwrap();
        assert_eq!(r.phases.len(), 2);
        for p in &r.phases {
            assert!(p.shared.hot().hit_ratio > 0.9, "{p:?}");
            assert!(p.partitioned.hot().hit_ratio < 0.6, "{p:?}");
            assert!(p.hot_ratio > 1.5, "{p:?}");
        }
    }
}
