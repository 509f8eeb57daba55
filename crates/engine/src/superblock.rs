//! Reading and writing the two superblock copies (docs/design.md §2.1).
//!
//! A reader takes the valid copy with the higher sequence and says which copy was damaged and
//! why. A writer leaves the copy a reader would choose untouched until the other copy is
//! written and flushed, so a crash or a torn write never leaves the device without a valid
//! copy of the newest durable state; a damaged copy is therefore rewritten by the next
//! superblock write (every open of a cache makes one).

use std::fmt;

use ssdcache_device::{AlignedBuf, BlockDevice};
use ssdcache_format::journal::JOURNAL_MAGIC;
use ssdcache_format::layout::{META_OFFSET, MIN_CACHE_SIZE, SUPERBLOCK_COPY_SIZE};
use ssdcache_format::lines::META_PAGE_MAGIC;
use ssdcache_format::{Layout, Superblock, SuperblockError, MAX_LINE_SIZE, MIN_LINE_SIZE};

use crate::error::{EngineError, Result};

const COPY_LEN: usize = SUPERBLOCK_COPY_SIZE as usize;

/// One of the two superblock copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuperblockCopy {
    /// At byte 0.
    A,
    /// At byte 65536.
    B,
}

impl SuperblockCopy {
    pub const BOTH: [SuperblockCopy; 2] = [SuperblockCopy::A, SuperblockCopy::B];

    pub fn offset(self) -> u64 {
        match self {
            SuperblockCopy::A => 0,
            SuperblockCopy::B => SUPERBLOCK_COPY_SIZE,
        }
    }

    fn other(self) -> SuperblockCopy {
        match self {
            SuperblockCopy::A => SuperblockCopy::B,
            SuperblockCopy::B => SuperblockCopy::A,
        }
    }
}

impl fmt::Display for SuperblockCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SuperblockCopy::A => f.write_str("copy A (byte 0)"),
            SuperblockCopy::B => f.write_str("copy B (byte 65536)"),
        }
    }
}

/// Why a superblock copy cannot be used.
#[derive(Debug, PartialEq, Eq)]
pub enum CopyProblem {
    /// The device ends before the copy does.
    Truncated { device_size: u64 },
    /// Magic, checksum, version or a field is wrong.
    Invalid(SuperblockError),
}

impl CopyProblem {
    /// True when the copy starts with the ssdcache magic (it was a superblock once).
    pub fn has_magic(&self) -> bool {
        !matches!(
            self,
            CopyProblem::Truncated { .. } | CopyProblem::Invalid(SuperblockError::NoMagic)
        )
    }
}

impl fmt::Display for CopyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CopyProblem::Truncated { device_size } => {
                write!(f, "truncated: the device ends at byte {device_size}")
            }
            CopyProblem::Invalid(SuperblockError::NoMagic) => f.write_str("no superblock magic"),
            CopyProblem::Invalid(SuperblockError::BadChecksum { .. }) => {
                f.write_str("checksum mismatch")
            }
            CopyProblem::Invalid(SuperblockError::NewerVersion(v)) => write!(
                f,
                "format version {v} or feature bits this ssdcache does not know (written by a \
                 newer ssdcache, or damaged)"
            ),
            CopyProblem::Invalid(e) => write!(f, "{e}"),
        }
    }
}

/// A copy that could not be used while the other one could.
#[derive(Debug, PartialEq, Eq)]
pub struct DamagedCopy {
    pub copy: SuperblockCopy,
    pub problem: CopyProblem,
}

impl DamagedCopy {
    /// One line for logs and `info`: which copy, why, and what happens to it.
    pub fn warning(&self) -> String {
        format!(
            "superblock {} is damaged ({}); the cache is read from {}, and the damaged copy is \
             rewritten from it at the next superblock write (when serve, flush, detach, recover \
             or set-mode opens the cache)",
            self.copy,
            self.problem,
            self.copy.other()
        )
    }
}

/// The superblock a reader uses, and the other copy's damage if it has any.
#[derive(Debug)]
pub struct SuperblockRead {
    pub superblock: Superblock,
    /// The copy read from.
    pub copy: SuperblockCopy,
    pub damaged: Option<DamagedCopy>,
}

/// What the two superblock copies of a device hold, before anything else is judged.
#[derive(Debug)]
pub enum Copies {
    Valid(SuperblockRead),
    Invalid { a: CopyProblem, b: CopyProblem },
}

/// Why a device cannot be used as a cache: shown to people, and told apart by `create`.
#[derive(Debug, PartialEq, Eq)]
pub enum NotUsable {
    /// Smaller than any cache.
    TooSmall { size: u64 },
    /// Neither copy carries the ssdcache magic, and no metadata is where a cache keeps it.
    NotACache { a: CopyProblem, b: CopyProblem },
    /// Neither copy is valid, but a copy carries the magic or `traces` (of metadata) were found.
    BothCopiesDamaged {
        a: CopyProblem,
        b: CopyProblem,
        traces: Vec<String>,
    },
    /// Smaller than the cache its superblock describes.
    Truncated { size: u64, recorded: u64 },
}

impl fmt::Display for NotUsable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotUsable::TooSmall { size } => write!(
                f,
                "is not an ssdcache cache (too small: {size} bytes; a cache is at least \
                 {MIN_CACHE_SIZE} bytes)"
            ),
            NotUsable::NotACache { a, b } if a == b => {
                write!(
                    f,
                    "is not an ssdcache cache ({a} in either superblock copy)"
                )
            }
            NotUsable::NotACache { a, b } => {
                write!(f, "is not an ssdcache cache (copy A: {a}; copy B: {b})")
            }
            NotUsable::BothCopiesDamaged { a, b, traces } => write!(
                f,
                "is an ssdcache cache whose two superblock copies are both damaged (copy A: \
                 {a}; copy B: {b}{}); it cannot be opened. Its dirty write-back data, if it held \
                 any, cannot be located; if the backing devices hold all data (write-through, \
                 write-around, or nothing dirty), re-create it with `ssdcache create \
                 --discard-dirty-data`",
                found_text(traces)
            ),
            NotUsable::Truncated { size, recorded } => write!(
                f,
                "is {size} bytes but its superblock describes a cache of {recorded} bytes: \
                 it was truncated or is not the device that was formatted; restore its \
                 size or contents (`ssdcache create` refuses to overwrite it while it may hold \
                 dirty data)"
            ),
        }
    }
}

/// "; found: ..." for a message, or nothing.
pub fn found_text(traces: &[String]) -> String {
    if traces.is_empty() {
        String::new()
    } else {
        format!("; found: {}", traces.join(", "))
    }
}

/// Reads and decodes both copies; only what the device holds is read, so a short device is
/// reported copy by copy instead of failing as a whole. An I/O error is an error.
pub fn read_copies(dev: &dyn BlockDevice) -> Result<Copies> {
    let size = dev.size();
    let readable = (size.min(2 * SUPERBLOCK_COPY_SIZE) / 4096 * 4096) as usize;
    let mut buf = AlignedBuf::zeroed(2 * COPY_LEN);
    if readable > 0 {
        dev.read_at(&mut buf[..readable], 0)
            .map_err(|e| EngineError::CacheDevice {
                device: dev.describe(),
                source: e,
            })?;
    }
    let decode = |copy: SuperblockCopy| {
        let at = copy.offset() as usize;
        if readable < at + COPY_LEN {
            return Err(CopyProblem::Truncated { device_size: size });
        }
        Superblock::decode(&buf[at..at + COPY_LEN]).map_err(CopyProblem::Invalid)
    };
    Ok(
        match (decode(SuperblockCopy::A), decode(SuperblockCopy::B)) {
            // On a tie (the steady state) copy B is the one kept, so writes go A then B.
            (Ok(a), Ok(b)) if a.sequence > b.sequence => valid(a, SuperblockCopy::A, None),
            (Ok(_), Ok(b)) => valid(b, SuperblockCopy::B, None),
            (Ok(a), Err(problem)) => valid(a, SuperblockCopy::A, Some(problem)),
            (Err(problem), Ok(b)) => valid(b, SuperblockCopy::B, Some(problem)),
            (Err(a), Err(b)) => Copies::Invalid { a, b },
        },
    )
}

fn valid(superblock: Superblock, copy: SuperblockCopy, other: Option<CopyProblem>) -> Copies {
    Copies::Valid(SuperblockRead {
        superblock,
        copy,
        damaged: other.map(|problem| DamagedCopy {
            copy: copy.other(),
            problem,
        }),
    })
}

/// Reads the superblock of a cache, refusing a device that is not one, is damaged in both
/// copies, or is smaller than the cache it describes. The caller reports `damaged`.
pub fn read_superblock_copies(dev: &dyn BlockDevice) -> Result<SuperblockRead> {
    let unusable = |why: NotUsable| EngineError::Format(format!("{} {why}", dev.describe()));
    if dev.size() < MIN_CACHE_SIZE {
        // A device this small was never formatted as a cache (create refuses it); one that
        // shrank to this is reported as truncated if its superblock says so.
        if let Copies::Valid(r) = read_copies(dev)? {
            return Err(unusable(NotUsable::Truncated {
                size: dev.size(),
                recorded: r.superblock.layout.cache_size,
            }));
        }
        return Err(unusable(NotUsable::TooSmall { size: dev.size() }));
    }
    match read_copies(dev)? {
        Copies::Invalid { a, b } => {
            // A copy with a valid checksum and another format version is no damage: say so.
            for problem in [&a, &b] {
                if let CopyProblem::Invalid(
                    e @ (SuperblockError::OlderVersion(_) | SuperblockError::NewerVersion(_)),
                ) = problem
                {
                    return Err(EngineError::Format(format!("{}: {e}", dev.describe())));
                }
            }
            let traces = traces_of_cache(dev);
            if a.has_magic() || b.has_magic() || !traces.is_empty() {
                Err(unusable(NotUsable::BothCopiesDamaged { a, b, traces }))
            } else {
                Err(unusable(NotUsable::NotACache { a, b }))
            }
        }
        Copies::Valid(r) if r.superblock.layout.cache_size > dev.size() => {
            Err(unusable(NotUsable::Truncated {
                size: dev.size(),
                recorded: r.superblock.layout.cache_size,
            }))
        }
        Copies::Valid(r) => Ok(r),
    }
}

/// Reads the newest valid superblock copy; a damaged other copy is logged as a warning (the
/// next superblock write rewrites it).
pub fn read_superblock(dev: &dyn BlockDevice) -> Result<Superblock> {
    let read = read_superblock_copies(dev)?;
    if let Some(damaged) = &read.damaged {
        tracing::warn!("cache {}: {}", dev.describe(), damaged.warning());
    }
    Ok(read.superblock)
}

/// Writes both superblock copies, each made durable before the next is touched. The copy a
/// reader would choose now (the valid one with the higher sequence; copy B on a tie, so the
/// steady order is A then B) is written last: while the first write is in flight the device
/// still holds a valid copy of the newest durable state, and a damaged copy is replaced
/// before the good one is touched.
pub fn write_superblock(dev: &dyn BlockDevice, sb: &Superblock) -> Result<()> {
    let bytes = sb
        .encode()
        .map_err(|e| EngineError::Format(e.to_string()))?;
    let mut buf = AlignedBuf::zeroed(bytes.len());
    buf.copy_from_slice(&bytes);
    let io = |e| EngineError::CacheDevice {
        device: dev.describe(),
        source: e,
    };
    let (first, repaired) = match read_copies(dev) {
        Ok(Copies::Valid(r)) => (r.copy.other(), r.damaged),
        // Nothing valid to keep (a new cache), or the copies cannot be read: the write below
        // reports a device that fails.
        Ok(Copies::Invalid { .. }) | Err(_) => (SuperblockCopy::A, None),
    };
    for copy in [first, first.other()] {
        dev.write_at(&buf, copy.offset()).map_err(io)?;
        dev.flush().map_err(io)?;
    }
    if let Some(damaged) = repaired {
        tracing::info!(
            "cache {}: superblock {} rewritten (it was damaged: {})",
            dev.describe(),
            damaged.copy,
            damaged.problem
        );
    }
    Ok(())
}

/// Metadata of an ssdcache cache found where a cache keeps it, for a device whose superblock
/// copies are both invalid: a checkpoint page where every layout puts the first one, or a
/// journal block where a layout of this device's size, for some line size, puts the first
/// one. Empty when there is none. (A copy that keeps the magic is the other sign:
/// `CopyProblem::has_magic`.)
pub fn traces_of_cache(dev: &dyn BlockDevice) -> Vec<String> {
    let mut found = Vec::new();
    if block_magic(dev, META_OFFSET) == Some(META_PAGE_MAGIC) {
        found.push(format!("a checkpoint page at byte {META_OFFSET}"));
    }
    let mut line_size = MIN_LINE_SIZE;
    let mut journal_offsets = Vec::new();
    while line_size <= MAX_LINE_SIZE {
        if let Ok(layout) = Layout::compute(dev.size(), line_size) {
            if !journal_offsets.contains(&layout.journal_offset) {
                journal_offsets.push(layout.journal_offset);
            }
        }
        line_size *= 2;
    }
    for offset in journal_offsets {
        if block_magic(dev, offset) == Some(JOURNAL_MAGIC) {
            found.push(format!("a journal block at byte {offset}"));
        }
    }
    found
}

/// The little-endian u32 at the start of the 4 KiB block at `offset`, if it can be read.
fn block_magic(dev: &dyn BlockDevice, offset: u64) -> Option<u32> {
    if offset + 4096 > dev.size() {
        return None;
    }
    let mut buf = AlignedBuf::zeroed(4096);
    dev.read_at(&mut buf, offset).ok()?;
    Some(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ssdcache_devsim::{MemDevice, Op, RecordingDevice};
    use ssdcache_format::{BackingIdentity, BackingKind, CacheMode};

    use super::*;
    use crate::admission::Admission;
    use crate::NewVolume;

    const MIB: u64 = 1 << 20;

    fn formatted(size: u64) -> Arc<MemDevice> {
        let dev = Arc::new(MemDevice::new("cache", size));
        let volume = NewVolume {
            name: "v".into(),
            mode: CacheMode::WriteBack,
            backing: BackingIdentity {
                kind: BackingKind::File,
                size: 8 * MIB,
                path: "mem".into(),
                stable_id: "mem".into(),
                st_dev: 0,
                st_ino: 0,
                st_rdev: 0,
                btime_ns: 0,
            },
            sequential_cutoff: 0,
            policy: 0,
            admission: Admission::Always,
        };
        crate::format(&*dev, 64 << 10, volume).expect("format");
        dev
    }

    /// Flips a byte inside a copy's header: its checksum no longer matches.
    fn damage(dev: &MemDevice, copy: SuperblockCopy) {
        let mut block = vec![0u8; 4096];
        dev.read_at(&mut block, copy.offset()).expect("read");
        block[40] ^= 0xff;
        dev.write_at(&block, copy.offset()).expect("write");
    }

    fn copy_writes(dev: &RecordingDevice<MemDevice>) -> Vec<u64> {
        dev.ops()
            .into_iter()
            .filter_map(|op| match op {
                Op::Write { offset, .. } => Some(offset),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_damaged_copy_is_named_and_rewritten_first() {
        for bad in SuperblockCopy::BOTH {
            let dev = formatted(16 * MIB);
            damage(&dev, bad);
            let read = read_superblock_copies(&*dev).expect("one good copy is enough");
            assert_eq!(read.copy, bad.other());
            let damaged = read.damaged.expect("the bad copy is reported");
            assert_eq!(damaged.copy, bad);
            assert!(
                matches!(
                    damaged.problem,
                    CopyProblem::Invalid(SuperblockError::BadChecksum { .. })
                ),
                "{:?}",
                damaged.problem
            );
            assert!(damaged.warning().contains("checksum mismatch"));

            let recorder = RecordingDevice::new(dev.clone());
            write_superblock(&recorder, &read.superblock).expect("write");
            assert_eq!(
                copy_writes(&recorder),
                vec![bad.offset(), bad.other().offset()],
                "the good copy is written only after the damaged one"
            );
            let again = read_superblock_copies(&*dev).expect("read");
            assert!(again.damaged.is_none(), "rewritten: {:?}", again.damaged);
        }
    }

    #[test]
    fn the_newest_copy_is_written_last() {
        let dev = formatted(16 * MIB);
        let mut sb = read_superblock(&*dev).expect("read");
        let recorder = RecordingDevice::new(dev.clone());
        write_superblock(&recorder, &sb).expect("write");
        assert_eq!(copy_writes(&recorder), vec![0, 65536], "steady order: A, B");

        // A crash between the copies: A is newer than B. B goes first now, so a torn write
        // can only cost the older state.
        sb.sequence += 1;
        let bytes = sb.encode().expect("encode");
        dev.write_at(&bytes, 0).expect("write A only");
        let read = read_superblock_copies(&*dev).expect("read");
        assert_eq!(
            (read.copy, read.superblock.sequence),
            (SuperblockCopy::A, sb.sequence)
        );
        recorder.clear();
        sb.sequence += 1;
        write_superblock(&recorder, &sb).expect("write");
        assert_eq!(copy_writes(&recorder), vec![65536, 0]);
    }

    #[test]
    fn devices_that_are_not_caches_are_told_apart() {
        let message = |dev: &dyn BlockDevice| {
            read_superblock_copies(dev)
                .expect_err("not usable")
                .to_string()
        };
        let zeros = MemDevice::new("zeros", 16 * MIB);
        let m = message(&zeros);
        assert!(
            m.contains("not an ssdcache cache (no superblock magic in either"),
            "{m}"
        );
        let small = MemDevice::new("small", 64 << 10);
        let m = message(&small);
        assert!(m.contains("too small: 65536 bytes"), "{m}");

        let both = formatted(16 * MIB);
        damage(&both, SuperblockCopy::A);
        damage(&both, SuperblockCopy::B);
        let m = message(&*both);
        assert!(m.contains("superblock copies are both damaged"), "{m}");
        assert!(m.contains("--discard-dirty-data"), "{m}");

        let big = formatted(32 * MIB);
        let shrunk = MemDevice::new("shrunk", 16 * MIB);
        shrunk
            .write_at(&big.snapshot()[..(16 * MIB) as usize], 0)
            .expect("copy");
        let m = message(&shrunk);
        assert!(m.contains("truncated"), "{m}");
        assert!(m.contains(&format!("{}", 32 * MIB)), "{m}");
    }

    #[test]
    fn traces_of_a_cache_are_found_without_its_superblocks() {
        let dev = formatted(16 * MIB);
        let read = read_superblock(&*dev).expect("read");
        let journal_offset = read.layout.journal_offset;
        dev.write_at(&vec![0u8; 2 * 65536], 0)
            .expect("wipe both copies");
        let m = read_superblock_copies(&*dev)
            .expect_err("no superblock")
            .to_string();
        assert!(m.contains("not an ssdcache cache"), "{m}");
        assert!(traces_of_cache(&*dev).is_empty());

        let mut block = vec![0u8; 4096];
        block[..4].copy_from_slice(&JOURNAL_MAGIC.to_le_bytes());
        dev.write_at(&block, journal_offset).expect("journal block");
        assert_eq!(
            traces_of_cache(&*dev),
            vec![format!("a journal block at byte {journal_offset}")]
        );
        let m = read_superblock_copies(&*dev)
            .expect_err("no superblock")
            .to_string();
        assert!(m.contains("superblock copies are both damaged"), "{m}");
        assert!(m.contains("a journal block at byte"), "{m}");
    }
}
