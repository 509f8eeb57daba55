//! The superblock: one 64 KiB copy holds the cache header (first 4 KiB) and a table of 32
//! volume slots of 1 KiB each. Two copies live at offsets 0 and 64 KiB; both are written on
//! every update (A, sync, B, sync) and a reader takes the valid copy with the highest sequence.

use crate::bytes::{crc_with_hole, get_str, get_u32, get_u64, put_str, put_u32, put_u64};
use crate::layout::{Layout, SUPERBLOCK_COPY_SIZE};
use crate::{FORMAT_VERSION, SECTOR_SIZE};

pub const MAGIC: &[u8; 8] = b"SSDCACHE";
pub const MAX_VOLUMES: usize = 32;
const SLOT_BASE: usize = 4096;
const SLOT_SIZE: usize = 1024;
pub const NAME_LEN: usize = 64;
pub const STABLE_ID_LEN: usize = 128;
pub const PATH_LEN: usize = 256;
const COPY: usize = SUPERBLOCK_COPY_SIZE as usize;
const VOLUME_READ_ONLY: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheMode {
    PassThrough,
    WriteThrough,
    WriteAround,
    WriteBack,
}

impl CacheMode {
    fn to_u32(self) -> u32 {
        match self {
            CacheMode::PassThrough => 0,
            CacheMode::WriteThrough => 1,
            CacheMode::WriteAround => 2,
            CacheMode::WriteBack => 3,
        }
    }
    fn from_u32(v: u32) -> Option<CacheMode> {
        Some(match v {
            0 => CacheMode::PassThrough,
            1 => CacheMode::WriteThrough,
            2 => CacheMode::WriteAround,
            3 => CacheMode::WriteBack,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::PassThrough => "pass-through",
            CacheMode::WriteThrough => "write-through",
            CacheMode::WriteAround => "write-around",
            CacheMode::WriteBack => "write-back",
        }
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the cache was shut down cleanly (its line checkpoint is current).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheState {
    /// Stopped cleanly: the checkpoint at `checkpoint_seq` describes the cache exactly.
    Clean,
    /// A daemon has it open, or died without a clean stop.
    Running,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingKind {
    File,
    BlockDevice,
    /// An NBD export reached over the network (`nbd://`, `nbd+unix://`): `path` holds its
    /// URI, `stable_id` its name and the server's description of it.
    Nbd,
}

impl BackingKind {
    /// The value at offset 96 of a volume slot.
    pub const fn to_u32(self) -> u32 {
        match self {
            BackingKind::File => 1,
            BackingKind::BlockDevice => 2,
            BackingKind::Nbd => 3,
        }
    }

    pub const fn from_u32(v: u32) -> Option<BackingKind> {
        match v {
            1 => Some(BackingKind::File),
            2 => Some(BackingKind::BlockDevice),
            3 => Some(BackingKind::Nbd),
            _ => None,
        }
    }
}

/// What identifies a backing device, so a cache is never assembled in front of another one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingIdentity {
    pub kind: BackingKind,
    pub size: u64,
    /// Path at create time (a hint to find it again, not proof of identity).
    pub path: String,
    /// Block device: a /dev/disk/by-id name or "devnum:MAJ:MIN". File: "file:DEV:INO".
    /// NBD export: "nbd:NAME" or, when the server describes the export, "nbd:NAME#DESCRIPTION".
    pub stable_id: String,
    pub st_dev: u64,
    pub st_ino: u64,
    pub st_rdev: u64,
    /// File birth time in nanoseconds since the epoch, 0 where the filesystem does not say.
    pub btime_ns: u64,
}

/// Statistics persisted at clean shutdown so `stats` works offline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VolumeCounters(pub [u64; VolumeCounters::COUNT]);

impl VolumeCounters {
    pub const COUNT: usize = 23;
    /// Counter slots on disk (536..728 of a volume slot); the unused ones are zero, room for
    /// counters to come without a format change.
    pub const DISK_SLOTS: usize = 24;
    pub const NAMES: [&'static str; Self::COUNT] = [
        "reads",
        "writes",
        "read_hits",
        "read_misses",
        "write_hits",
        "bytes_read",
        "bytes_written",
        "bytes_from_cache",
        "bytes_from_backing",
        "bytes_to_cache",
        "bytes_to_backing",
        "trims",
        "write_zeroes",
        "flushes",
        "cache_errors",
        "backing_errors",
        "bytes_bypassed",
        "bytes_cleaned",
        "bytes_written_around_full",
        "dirty_read_errors",
        "dirty_lines_lost",
        "bytes_not_admitted",
        "checksum_errors",
    ];
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSlot {
    /// Slot index in the table; line records name volumes by it.
    pub id: u16,
    pub uuid: [u8; 16],
    pub name: String,
    pub mode: CacheMode,
    pub read_only: bool,
    pub backing: BackingIdentity,
    pub policy: u32,
    /// Admission policy code: 0 = always, N (2..=16) = N-hit (`ssdcache_engine::admission`).
    pub admission: u32,
    pub sequential_cutoff: u64,
    pub counters: VolumeCounters,
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub sequence: u64,
    pub cache_uuid: [u8; 16],
    pub layout: Layout,
    pub state: CacheState,
    /// Sequence number stamped on every page of the current line checkpoint; 0 = none.
    pub checkpoint_seq: u64,
    pub created_unix: u64,
    pub updated_unix: u64,
    /// How many times the daemon started after an unclean stop.
    pub unclean_starts: u64,
    /// The journal generation a running daemon writes; blocks of other generations are stale.
    pub journal_generation: u64,
    /// Sequence number and block index of the first live journal block.
    pub journal_start_seq: u64,
    pub journal_start_block: u64,
    /// Bytes the daemon wrote to the cache device (data, journal, metadata, superblocks) up to
    /// this superblock's write, across restarts; 0 in caches made before it was kept.
    pub cache_bytes_written: u64,
    /// The cache device's endurance rating in bytes written (TBW), as `serve --ssd-tbw` last
    /// gave it; 0 = not given.
    pub ssd_tbw_bytes: u64,
    pub volumes: Vec<VolumeSlot>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SuperblockError {
    #[error("no ssdcache superblock (magic missing)")]
    NoMagic,
    #[error("superblock checksum mismatch (stored {stored:#x}, computed {computed:#x})")]
    BadChecksum { stored: u32, computed: u32 },
    #[error("superblock has format version {0}; this ssdcache reads version {FORMAT_VERSION}: upgrade ssdcache")]
    NewerVersion(u32),
    #[error(
        "the cache has format version {0}, made by a development build before line records carried \
         data checksums; this ssdcache reads version {FORMAT_VERSION}. Write its dirty data back \
         with the build that made it (`ssdcache flush`, then `ssdcache detach`), then re-create \
         the cache with `ssdcache create --force`"
    )]
    OlderVersion(u32),
    #[error("superblock field {field} has invalid value {value}")]
    BadField { field: &'static str, value: u64 },
    #[error("name {0:?} is too long for the format (at most {1} bytes)")]
    TooLong(String, usize),
    #[error("at most {MAX_VOLUMES} volumes fit in one cache")]
    TooManyVolumes,
}

impl Superblock {
    pub const COPY_SIZE: usize = COPY;

    /// Encodes one 64 KiB superblock copy.
    pub fn encode(&self) -> Result<Vec<u8>, SuperblockError> {
        let mut buf = vec![0u8; COPY];
        buf[0..8].copy_from_slice(MAGIC);
        put_u32(&mut buf, 8, self.version);
        put_u64(&mut buf, 16, self.sequence);
        buf[24..40].copy_from_slice(&self.cache_uuid);
        let l = &self.layout;
        put_u64(&mut buf, 40, l.cache_size);
        put_u32(&mut buf, 48, l.line_size as u32);
        put_u32(&mut buf, 52, SECTOR_SIZE as u32);
        put_u64(&mut buf, 56, l.meta_offset);
        put_u64(&mut buf, 64, l.meta_len);
        put_u64(&mut buf, 72, l.journal_offset);
        put_u64(&mut buf, 80, l.journal_len);
        put_u64(&mut buf, 88, l.data_offset);
        put_u64(&mut buf, 96, l.line_count);
        put_u32(
            &mut buf,
            104,
            matches!(self.state, CacheState::Running) as u32,
        );
        put_u32(&mut buf, 108, 0); // incompatible feature bits: none yet
        put_u64(&mut buf, 112, self.checkpoint_seq);
        put_u64(&mut buf, 120, self.created_unix);
        put_u64(&mut buf, 128, self.updated_unix);
        put_u32(&mut buf, 136, 0); // compatible feature bits: none yet
        put_u32(&mut buf, 140, MAX_VOLUMES as u32);
        put_u64(&mut buf, 160, self.unclean_starts);
        put_u64(&mut buf, 168, self.journal_generation);
        put_u64(&mut buf, 176, self.journal_start_seq);
        put_u64(&mut buf, 184, self.journal_start_block);
        put_u64(&mut buf, 192, self.cache_bytes_written);
        put_u64(&mut buf, 200, self.ssd_tbw_bytes);
        if self.volumes.len() > MAX_VOLUMES {
            return Err(SuperblockError::TooManyVolumes);
        }
        for v in &self.volumes {
            let at = SLOT_BASE + usize::from(v.id) * SLOT_SIZE;
            if usize::from(v.id) >= MAX_VOLUMES {
                return Err(SuperblockError::TooManyVolumes);
            }
            encode_slot(v, &mut buf[at..at + SLOT_SIZE])?;
        }
        let crc = crc_with_hole(&buf, 12);
        put_u32(&mut buf, 12, crc);
        Ok(buf)
    }

    /// Decodes one copy, checking magic, checksum, version and layout.
    pub fn decode(buf: &[u8]) -> Result<Superblock, SuperblockError> {
        if buf.len() < COPY || &buf[0..8] != MAGIC {
            return Err(SuperblockError::NoMagic);
        }
        let buf = &buf[..COPY];
        let stored = get_u32(buf, 12);
        let computed = crc_with_hole(buf, 12);
        if stored != computed {
            return Err(SuperblockError::BadChecksum { stored, computed });
        }
        let version = get_u32(buf, 8);
        if version > FORMAT_VERSION || get_u32(buf, 108) != 0 {
            return Err(SuperblockError::NewerVersion(version));
        }
        if version < FORMAT_VERSION {
            return Err(SuperblockError::OlderVersion(version));
        }
        let layout = Layout {
            cache_size: get_u64(buf, 40),
            line_size: u64::from(get_u32(buf, 48)),
            meta_offset: get_u64(buf, 56),
            meta_len: get_u64(buf, 64),
            journal_offset: get_u64(buf, 72),
            journal_len: get_u64(buf, 80),
            data_offset: get_u64(buf, 88),
            line_count: get_u64(buf, 96),
        };
        if !layout.is_consistent() || u64::from(get_u32(buf, 52)) != SECTOR_SIZE {
            return Err(SuperblockError::BadField {
                field: "layout",
                value: layout.line_size,
            });
        }
        let state = match get_u32(buf, 104) {
            0 => CacheState::Clean,
            1 => CacheState::Running,
            v => {
                return Err(SuperblockError::BadField {
                    field: "state",
                    value: u64::from(v),
                })
            }
        };
        let mut volumes = Vec::new();
        for id in 0..MAX_VOLUMES {
            let at = SLOT_BASE + id * SLOT_SIZE;
            if let Some(v) = decode_slot(id as u16, &buf[at..at + SLOT_SIZE])? {
                volumes.push(v);
            }
        }
        let mut cache_uuid = [0u8; 16];
        cache_uuid.copy_from_slice(&buf[24..40]);
        Ok(Superblock {
            version,
            sequence: get_u64(buf, 16),
            cache_uuid,
            layout,
            state,
            checkpoint_seq: get_u64(buf, 112),
            created_unix: get_u64(buf, 120),
            updated_unix: get_u64(buf, 128),
            unclean_starts: get_u64(buf, 160),
            journal_generation: get_u64(buf, 168),
            journal_start_seq: get_u64(buf, 176),
            journal_start_block: get_u64(buf, 184),
            cache_bytes_written: get_u64(buf, 192),
            ssd_tbw_bytes: get_u64(buf, 200),
            volumes,
        })
    }

    /// Picks the newest valid copy of two; the error of copy A is reported if neither is valid.
    pub fn choose(a: &[u8], b: &[u8]) -> Result<Superblock, SuperblockError> {
        match (Self::decode(a), Self::decode(b)) {
            (Ok(x), Ok(y)) => Ok(if y.sequence > x.sequence { y } else { x }),
            (Ok(x), Err(_)) | (Err(_), Ok(x)) => Ok(x),
            (Err(e), Err(_)) => Err(e),
        }
    }

    pub fn volume_by_name(&self, name: &str) -> Option<&VolumeSlot> {
        self.volumes.iter().find(|v| v.name == name)
    }
}

fn check_len(s: &str, max: usize) -> Result<(), SuperblockError> {
    if s.len() > max {
        return Err(SuperblockError::TooLong(s.to_owned(), max));
    }
    Ok(())
}

fn encode_slot(v: &VolumeSlot, s: &mut [u8]) -> Result<(), SuperblockError> {
    check_len(&v.name, NAME_LEN)?;
    check_len(&v.backing.stable_id, STABLE_ID_LEN)?;
    check_len(&v.backing.path, PATH_LEN)?;
    put_u32(s, 0, 1);
    put_u32(s, 4, v.mode.to_u32());
    s[8..24].copy_from_slice(&v.uuid);
    put_str(s, 24, NAME_LEN, &v.name);
    let b = &v.backing;
    put_u64(s, 88, b.size);
    put_u32(s, 96, b.kind.to_u32());
    put_u32(s, 100, if v.read_only { VOLUME_READ_ONLY } else { 0 });
    put_u64(s, 104, b.st_dev);
    put_u64(s, 112, b.st_ino);
    put_u64(s, 120, b.st_rdev);
    put_u64(s, 128, b.btime_ns);
    put_str(s, 136, STABLE_ID_LEN, &b.stable_id);
    put_str(s, 264, PATH_LEN, &b.path);
    put_u32(s, 520, v.policy);
    put_u32(s, 524, v.admission);
    put_u64(s, 528, v.sequential_cutoff);
    for (i, c) in v.counters.0.iter().enumerate() {
        put_u64(s, 536 + 8 * i, *c);
    }
    put_u64(s, 728, v.dirty_lines);
    put_u64(s, 736, v.dirty_bytes);
    Ok(())
}

fn decode_slot(id: u16, s: &[u8]) -> Result<Option<VolumeSlot>, SuperblockError> {
    match get_u32(s, 0) {
        0 => return Ok(None),
        1 => {}
        v => {
            return Err(SuperblockError::BadField {
                field: "volume in_use",
                value: u64::from(v),
            })
        }
    }
    let mode_raw = get_u32(s, 4);
    let mode = CacheMode::from_u32(mode_raw).ok_or(SuperblockError::BadField {
        field: "volume mode",
        value: u64::from(mode_raw),
    })?;
    let kind_raw = get_u32(s, 96);
    let kind = BackingKind::from_u32(kind_raw).ok_or(SuperblockError::BadField {
        field: "backing kind",
        value: u64::from(kind_raw),
    })?;
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&s[8..24]);
    let mut counters = VolumeCounters::default();
    for (i, c) in counters.0.iter_mut().enumerate() {
        *c = get_u64(s, 536 + 8 * i);
    }
    Ok(Some(VolumeSlot {
        id,
        uuid,
        name: get_str(s, 24, NAME_LEN),
        mode,
        read_only: get_u32(s, 100) & VOLUME_READ_ONLY != 0,
        backing: BackingIdentity {
            kind,
            size: get_u64(s, 88),
            path: get_str(s, 264, PATH_LEN),
            stable_id: get_str(s, 136, STABLE_ID_LEN),
            st_dev: get_u64(s, 104),
            st_ino: get_u64(s, 112),
            st_rdev: get_u64(s, 120),
            btime_ns: get_u64(s, 128),
        },
        policy: get_u32(s, 520),
        admission: get_u32(s, 524),
        sequential_cutoff: get_u64(s, 528),
        counters,
        dirty_lines: get_u64(s, 728),
        dirty_bytes: get_u64(s, 736),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn sample() -> Superblock {
        Superblock {
            version: FORMAT_VERSION,
            sequence: 7,
            cache_uuid: [9; 16],
            layout: Layout::compute(64 << 20, 65536).expect("layout"),
            state: CacheState::Clean,
            checkpoint_seq: 6,
            created_unix: 1_700_000_000,
            updated_unix: 1_700_000_100,
            unclean_starts: 1,
            journal_generation: 0x1234,
            journal_start_seq: 5,
            journal_start_block: 3,
            cache_bytes_written: 5 << 40,
            ssd_tbw_bytes: 600_000_000_000_000,
            volumes: vec![VolumeSlot {
                id: 3,
                uuid: [1; 16],
                name: "sdb".into(),
                mode: CacheMode::WriteAround,
                read_only: true,
                backing: BackingIdentity {
                    kind: BackingKind::File,
                    size: 1 << 30,
                    path: "/srv/disk.img".into(),
                    stable_id: "file:2049:1234".into(),
                    st_dev: 2049,
                    st_ino: 1234,
                    st_rdev: 0,
                    btime_ns: 42,
                },
                policy: 0,
                admission: 0,
                sequential_cutoff: 4 << 20,
                counters: VolumeCounters([5; VolumeCounters::COUNT]),
                dirty_lines: 0,
                dirty_bytes: 0,
            }],
        }
    }

    #[test]
    fn round_trip() {
        let sb = sample();
        let buf = sb.encode().expect("encode");
        assert_eq!(buf.len(), COPY);
        assert_eq!(Superblock::decode(&buf), Ok(sb));
    }

    #[test]
    fn golden_header_bytes() {
        let buf = sample().encode().expect("encode");
        assert_eq!(&buf[0..8], b"SSDCACHE");
        assert_eq!(&buf[8..12], &2u32.to_le_bytes());
        assert_eq!(&buf[16..24], &7u64.to_le_bytes());
        assert_eq!(&buf[48..52], &65536u32.to_le_bytes());
        let slot = 4096 + 3 * 1024;
        assert_eq!(&buf[slot..slot + 4], &1u32.to_le_bytes());
        assert_eq!(&buf[slot + 24..slot + 27], b"sdb");
    }

    /// The admission code sits at byte 524 of the slot and the counter added last
    /// (`bytes_not_admitted`, index 21) in a slot that older versions left zero.
    #[test]
    fn admission_and_new_counter_bytes() {
        let mut sb = sample();
        sb.volumes[0].admission = 2;
        sb.volumes[0].counters.0[21] = 0x77;
        let buf = sb.encode().expect("encode");
        let slot = 4096 + 3 * 1024;
        assert_eq!(&buf[slot + 524..slot + 528], &2u32.to_le_bytes());
        assert_eq!(
            &buf[slot + 536 + 8 * 21..slot + 536 + 8 * 22],
            &0x77u64.to_le_bytes()
        );
        assert_eq!(VolumeCounters::NAMES[21], "bytes_not_admitted");
        assert_eq!(Superblock::decode(&buf), Ok(sb));
    }

    #[test]
    fn newest_valid_copy_wins() {
        let mut a = sample();
        let mut b = sample();
        a.sequence = 10;
        b.sequence = 11;
        let (ea, mut eb) = (a.encode().expect("a"), b.encode().expect("b"));
        assert_eq!(Superblock::choose(&ea, &eb).map(|s| s.sequence), Ok(11));
        eb[5000] ^= 0xff; // torn write of copy B
        assert_eq!(Superblock::choose(&ea, &eb).map(|s| s.sequence), Ok(10));
        let zero = vec![0u8; COPY];
        assert_eq!(
            Superblock::choose(&zero, &zero),
            Err(SuperblockError::NoMagic)
        );
    }

    #[test]
    fn rejects_format_1_saying_what_to_do() {
        let mut sb = sample();
        sb.version = 1;
        let buf = sb.encode().expect("encode");
        let err = Superblock::decode(&buf).expect_err("format 1 refused");
        assert_eq!(err, SuperblockError::OlderVersion(1));
        assert!(err.to_string().contains("flush"), "{err}");
    }

    /// Found by the format_superblock fuzz target: a copy with a right checksum whose journal
    /// region ends beyond 2^64 made decode panic (debug) or accept it (release).
    #[test]
    fn rejects_a_layout_whose_region_end_overflows() {
        let mut sb = sample();
        sb.layout.journal_offset = u64::MAX - 4095;
        sb.layout.journal_len = 8192;
        sb.layout.data_offset = 2 << 20;
        let buf = sb.encode().expect("encode");
        assert!(matches!(
            Superblock::decode(&buf),
            Err(SuperblockError::BadField {
                field: "layout",
                ..
            })
        ));
    }

    #[test]
    fn rejects_newer_version() {
        let mut sb = sample();
        sb.version = FORMAT_VERSION + 1;
        let buf = sb.encode().expect("encode");
        assert_eq!(
            Superblock::decode(&buf),
            Err(SuperblockError::NewerVersion(FORMAT_VERSION + 1))
        );
    }

    proptest! {
        #[test]
        fn corrupted_copies_never_panic(flips in proptest::collection::vec((0usize..COPY, any::<u8>()), 1..8)) {
            let mut buf = sample().encode().expect("encode");
            for (at, x) in flips { buf[at] ^= x | 1; }
            // Any corruption must be caught by the checksum.
            prop_assert!(Superblock::decode(&buf).is_err());
        }
    }
}
