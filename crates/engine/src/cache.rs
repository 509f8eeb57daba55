//! A cache device with its volumes: open (load the checkpoint or start cold), serve through
//! [`Volume`]s, and shut down (write the checkpoint, mark clean).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use ssdcache_device::{AlignedBuf, BlockDevice};
use ssdcache_format::layout::SUPERBLOCK_COPY_SIZE;
use ssdcache_format::{
    BackingIdentity, CacheMode, CacheState, Layout, LineRecord, MetaPage, Superblock,
    VolumeCounters, VolumeSlot, FORMAT_VERSION, SECTOR_SIZE,
};

use crate::error::{EngineError, Result};
use crate::locks::LineLocks;
use crate::map::MapState;
use crate::policy;
use crate::volume::Volume;

/// Metadata pages are read and written this many at a time (1 MiB).
const META_BATCH_PAGES: usize = 256;

/// What the volumes of one cache device share.
pub(crate) struct CacheCore {
    pub dev: Arc<dyn BlockDevice>,
    pub layout: Layout,
    pub map: Mutex<MapState>,
    pub locks: LineLocks,
}

impl CacheCore {
    pub fn map(&self) -> MutexGuard<'_, MapState> {
        // The map is only changed in short non-panicking sections; a poisoned lock still holds
        // a consistent map.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn cache_err(&self, source: std::io::Error) -> EngineError {
        EngineError::CacheDevice {
            device: self.dev.describe(),
            source,
        }
    }
}

/// A new volume to record at create.
pub struct NewVolume {
    pub name: String,
    pub mode: CacheMode,
    pub backing: BackingIdentity,
    /// A sequential stream bypasses the cache after this many bytes; 0 = never.
    pub sequential_cutoff: u64,
}

/// How `open` found the cache.
#[derive(Debug, Clone)]
pub struct OpenReport {
    pub warm: bool,
    pub restored_lines: u64,
    pub restored_bytes: u64,
    /// Why the cache starts cold, when it does.
    pub cold_reason: Option<String>,
}

pub struct Cache {
    core: Arc<CacheCore>,
    sb: Mutex<Superblock>,
    volumes: Vec<Arc<Volume>>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn format_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Format(e.to_string())
}

/// Writes both superblock copies, each made durable before the next is touched, so a crash
/// leaves at least one valid copy (the old or the new).
pub fn write_superblock(dev: &dyn BlockDevice, sb: &Superblock) -> Result<()> {
    let bytes = sb.encode().map_err(format_err)?;
    let mut buf = AlignedBuf::zeroed(bytes.len());
    buf.copy_from_slice(&bytes);
    let io = |e| EngineError::CacheDevice {
        device: dev.describe(),
        source: e,
    };
    for copy in 0..2 {
        dev.write_at(&buf, copy * SUPERBLOCK_COPY_SIZE)
            .map_err(io)?;
        dev.flush().map_err(io)?;
    }
    Ok(())
}

/// Reads the newest valid superblock copy.
pub fn read_superblock(dev: &dyn BlockDevice) -> Result<Superblock> {
    let mut buf = AlignedBuf::zeroed(2 * SUPERBLOCK_COPY_SIZE as usize);
    dev.read_at(&mut buf, 0)
        .map_err(|e| EngineError::CacheDevice {
            device: dev.describe(),
            source: e,
        })?;
    let (a, b) = buf.split_at(SUPERBLOCK_COPY_SIZE as usize);
    let sb = Superblock::choose(a, b).map_err(|e| {
        EngineError::Format(format!(
            "{}: no valid ssdcache superblock in either copy ({e}); if this is the right device, \
             it is damaged: re-create the cache with `ssdcache create --force` (write-through and \
             write-around caches hold no data the backing device lacks)",
            dev.describe()
        ))
    })?;
    if sb.layout.cache_size > dev.size() {
        return Err(EngineError::Format(format!(
            "{} is {} bytes but its superblock describes a cache of {} bytes: the device was \
             truncated or is not the one that was formatted; restore it, or re-create the cache \
             with `ssdcache create --force`",
            dev.describe(),
            dev.size(),
            sb.layout.cache_size
        )));
    }
    Ok(sb)
}

/// Formats `dev` as a cache holding one volume. Writes only the two superblocks.
pub fn format(dev: &dyn BlockDevice, line_size: u64, volume: NewVolume) -> Result<Superblock> {
    let layout = Layout::compute(dev.size(), line_size).map_err(format_err)?;
    let sb = Superblock {
        version: FORMAT_VERSION,
        sequence: 1,
        cache_uuid: *uuid::Uuid::new_v4().as_bytes(),
        layout,
        state: CacheState::Clean,
        checkpoint_seq: 0,
        created_unix: now_unix(),
        updated_unix: now_unix(),
        unclean_starts: 0,
        volumes: vec![VolumeSlot {
            id: 0,
            uuid: *uuid::Uuid::new_v4().as_bytes(),
            name: volume.name,
            mode: volume.mode,
            read_only: false,
            backing: volume.backing,
            policy: 0,
            admission: 0,
            sequential_cutoff: volume.sequential_cutoff,
            counters: VolumeCounters::default(),
            dirty_lines: 0,
            dirty_bytes: 0,
        }],
    };
    write_superblock(dev, &sb)?;
    Ok(sb)
}

impl Cache {
    /// Opens a cache whose superblock is `sb`, with `backings[i]` the device of
    /// `sb.volumes[i]` (identity already checked by the caller). Loads the checkpoint after a
    /// clean stop; after an unclean one starts cold (see docs/design.md, "warm restart").
    /// Marks the cache running before returning.
    pub fn open(
        dev: Arc<dyn BlockDevice>,
        mut sb: Superblock,
        backings: Vec<Arc<dyn BlockDevice>>,
    ) -> Result<(Cache, OpenReport)> {
        if backings.len() != sb.volumes.len() {
            return Err(format_err("one backing device per volume is needed"));
        }
        let layout = sb.layout;
        let policy_id = sb.volumes.first().map_or(0, |v| v.policy);
        let new_map = || -> Result<MapState> {
            let policy = policy::by_id(policy_id, layout.line_count as u32)
                .ok_or_else(|| format_err(format!("unknown replacement policy id {policy_id}")))?;
            Ok(MapState::new(
                layout.line_count as u32,
                layout.sectors_per_line() as usize,
                policy,
            ))
        };
        let mut map = new_map()?;
        let report = match (sb.state, sb.checkpoint_seq) {
            (CacheState::Running, _) => {
                sb.unclean_starts += 1;
                cold("the daemon did not stop cleanly (crash or kill -9): cached data is discarded, the backing device holds all data")
            }
            (CacheState::Clean, 0) => cold("the cache is new"),
            (CacheState::Clean, seq) => match load_checkpoint(&*dev, &sb, seq, &mut map) {
                Ok(report) => report,
                Err(e) => {
                    tracing::warn!("checkpoint unreadable, starting cold: {e}");
                    map = new_map()?;
                    cold(&format!("the checkpoint could not be read ({e})"))
                }
            },
        };
        sb.state = CacheState::Running;
        sb.sequence += 1;
        sb.updated_unix = now_unix();
        write_superblock(&*dev, &sb)?;
        let core = Arc::new(CacheCore {
            dev,
            layout,
            map: Mutex::new(map),
            locks: LineLocks::new(),
        });
        let volumes = sb
            .volumes
            .iter()
            .zip(backings)
            .map(|(slot, backing)| Arc::new(Volume::new(slot, backing, core.clone())))
            .collect();
        Ok((
            Cache {
                core,
                sb: Mutex::new(sb),
                volumes,
            },
            report,
        ))
    }

    pub fn volumes(&self) -> &[Arc<Volume>] {
        &self.volumes
    }

    pub fn layout(&self) -> Layout {
        self.core.layout
    }

    fn sb(&self) -> MutexGuard<'_, Superblock> {
        self.sb.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The superblock with live counters folded in.
    pub fn superblock(&self) -> Superblock {
        let mut sb = self.sb().clone();
        for (slot, vol) in sb.volumes.iter_mut().zip(&self.volumes) {
            slot.counters = vol.counters();
        }
        sb
    }

    /// Writes the checkpoint of every line and marks the cache cleanly stopped. Call after the
    /// last request finished; requests after this are not in the checkpoint.
    pub fn shutdown(&self) -> Result<()> {
        let mut sb = self.sb();
        let seq = sb.sequence + 1;
        write_checkpoint(&self.core, seq)?;
        for (slot, vol) in sb.volumes.iter_mut().zip(&self.volumes) {
            slot.counters = vol.counters();
        }
        sb.state = CacheState::Clean;
        sb.checkpoint_seq = seq;
        sb.sequence = seq;
        sb.updated_unix = now_unix();
        write_superblock(&*self.core.dev, &sb)
    }
}

fn cold(reason: &str) -> OpenReport {
    OpenReport {
        warm: false,
        restored_lines: 0,
        restored_bytes: 0,
        cold_reason: Some(reason.to_owned()),
    }
}

/// Writes every slot's record in pages stamped with `seq`, then flushes the cache device. The
/// superblock that names `seq` is written only after this returns.
fn write_checkpoint(core: &CacheCore, seq: u64) -> Result<()> {
    let layout = core.layout;
    let per_page = MetaPage::records_per_page(layout.line_size) as usize;
    let map = core.map();
    let records: Vec<LineRecord> = map.records().collect();
    drop(map);
    let mut batch = AlignedBuf::zeroed(META_BATCH_PAGES * SECTOR_SIZE as usize);
    for (batch_no, chunk) in records.chunks(per_page * META_BATCH_PAGES).enumerate() {
        let pages = chunk.len().div_ceil(per_page);
        for (i, page_records) in chunk.chunks(per_page).enumerate() {
            let first_slot = ((batch_no * META_BATCH_PAGES + i) * per_page) as u64;
            let page = &mut batch[i * SECTOR_SIZE as usize..(i + 1) * SECTOR_SIZE as usize];
            MetaPage::encode(seq, first_slot, layout.line_size, page_records, page);
        }
        let offset = layout.meta_offset + (batch_no * META_BATCH_PAGES) as u64 * SECTOR_SIZE;
        let len = pages * SECTOR_SIZE as usize;
        core.dev
            .write_at(&batch[..len], offset)
            .map_err(|e| core.cache_err(e))?;
    }
    core.dev.flush().map_err(|e| core.cache_err(e))
}

/// Loads the checkpoint stamped `seq` into `map`, keeping only records of known volumes that
/// lie inside their volume.
fn load_checkpoint(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    seq: u64,
    map: &mut MapState,
) -> Result<OpenReport> {
    let layout = sb.layout;
    let per_page = MetaPage::records_per_page(layout.line_size);
    let pages = layout.meta_pages();
    let mut batch = AlignedBuf::zeroed(META_BATCH_PAGES * SECTOR_SIZE as usize);
    let mut page_no = 0u64;
    while page_no < pages {
        let n = (pages - page_no).min(META_BATCH_PAGES as u64) as usize;
        let buf = &mut batch[..n * SECTOR_SIZE as usize];
        dev.read_at(buf, layout.meta_offset + page_no * SECTOR_SIZE)
            .map_err(|e| EngineError::CacheDevice {
                device: dev.describe(),
                source: e,
            })?;
        for (i, page) in buf.chunks(SECTOR_SIZE as usize).enumerate() {
            let first = (page_no + i as u64) * per_page;
            let records = MetaPage::decode(page, seq, first, layout.line_size)
                .map_err(|e| format_err(format!("metadata page {}: {e}", page_no + i as u64)))?;
            for (j, rec) in records.iter().enumerate() {
                let slot = first + j as u64;
                if slot < layout.line_count && record_fits(sb, rec) {
                    map.restore(slot as u32, rec);
                }
            }
        }
        page_no += n as u64;
    }
    map.rebuild_free_list();
    let restored_lines = map.used_lines() as u64;
    let restored_bytes = sb
        .volumes
        .iter()
        .map(|v| map.occupancy(v.id).1 * SECTOR_SIZE)
        .sum();
    Ok(OpenReport {
        warm: restored_lines > 0,
        restored_lines,
        restored_bytes,
        cold_reason: None,
    })
}

fn record_fits(sb: &Superblock, rec: &LineRecord) -> bool {
    !rec.is_free()
        && sb.volumes.iter().any(|v| {
            v.id == rec.volume
                && rec
                    .backing_line
                    .checked_mul(sb.layout.line_size)
                    .is_some_and(|o| o < v.backing.size)
        })
}

/// Statistics of a cache that no daemon has open, from its superblock and checkpoint. After an
/// unclean stop the next start is cold, so occupancy reads as zero.
pub fn offline_stats(dev: &dyn BlockDevice, sb: &Superblock) -> Result<Vec<crate::VolumeStats>> {
    let layout = sb.layout;
    let policy =
        policy::by_id(0, layout.line_count as u32).ok_or_else(|| format_err("no LRU policy"))?;
    let mut map = MapState::new(
        layout.line_count as u32,
        layout.sectors_per_line() as usize,
        policy,
    );
    if sb.state == CacheState::Clean && sb.checkpoint_seq != 0 {
        load_checkpoint(dev, sb, sb.checkpoint_seq, &mut map)?;
    }
    Ok(sb
        .volumes
        .iter()
        .map(|v| {
            let (lines_used, sectors) = map.occupancy(v.id);
            crate::VolumeStats {
                name: v.name.clone(),
                mode: v.mode,
                size: v.backing.size,
                counters: v.counters,
                lines_used,
                bytes_cached: sectors * SECTOR_SIZE,
            }
        })
        .collect())
}
