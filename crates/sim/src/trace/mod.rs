//! Block I/O trace readers. Every format becomes one stream of [`Request`]s in bytes, so the
//! simulator, `mrc` and `advise` never see a format's units.
//!
//! ## Common rules
//!
//! - **Compression**: zstd, gzip, bzip2 and xz are told by their magic bytes, not by the file name;
//!   concatenated streams (`cat a.gz b.gz`, pigz, pbzip2, `xz -T`) are read whole. A corrupt or
//!   truncated stream is an error naming the compression.
//! - **`--format auto`** reads the first 64 KiB of the decompressed content with every format's own
//!   reader (ssdcache and fio logs are told by their first line); the one format that reads it
//!   without error is chosen. When several fit equally (a file of one number per line is `lirs` or
//!   `sector-list`), the extension breaks the tie (`.lis` arc, `.vscsi`, `.bin`/`oracleGeneral`
//!   oracle-general, `.blkparse`, `.iolog`, `.trc`/`.lirs`/`.trace` lirs); otherwise the error lists
//!   the candidates and the formats and asks for `--format`.
//! - **Time** is nanoseconds since the trace's first request; a request stamped before the first one
//!   (merged per-CPU logs are not quite sorted) gets 0. Formats without time give 0.
//! - **Volumes** (disks, LUNs, devices, files) get ids 0, 1, ... in order of first appearance;
//!   `Trace::volume_names()` has their names. Formats with one volume leave the list empty.
//! - **Skipped records** are records that carry no read or write (discards, flushes, syncs, SCSI
//!   commands other than read/write, file open/close); `Trace::skipped_records()` counts them.
//! - **Blank lines** (empty or whitespace only) of text formats are skipped; `\r\n` line ends are
//!   accepted.
//! - **Limits**: a request longer than 4 GiB - 1, a request ending beyond 2^57 bytes (128 PiB), and a
//!   65 537th volume are errors (they are corrupt records, and they keep block keys unique).
//! - **Errors** name the file, the line (text) or the byte offset in the decompressed stream
//!   (binary), what was found and what was expected, e.g.
//!   `trace.csv line 17: expected 7 comma-separated fields (timestamp,host,disk,type,offset,size,response_time) of an MSR Cambridge trace, found 3`.
//!   An empty file, a cut record, a bad number, an unknown operation and a corrupt compressed stream
//!   are all errors.
//! - **Blocks**: `block_keys(request, line_size)` gives the keys of the `line_size`-byte blocks
//!   (a power of two ≥ 512) that `[offset, offset + len)` touches: blocks `offset / line` to
//!   `(offset + len - 1) / line`, none for `len = 0`. A key is `volume << 48 | block`: 16 bits of
//!   volume (hence at most 65 536 volumes) and 48 bits of block number (which the 2^57-byte limit
//!   guarantees for lines of 512 bytes and more).
//!
//! ## Formats
//!
//! | `--format` | content | units | becomes | ignored |
//! |---|---|---|---|---|
//! | `msr` | MSR Cambridge csv, no header: `timestamp,host,disk,type,offset,size,response_time` | timestamp: 100 ns ticks (Windows FILETIME); offset, size: bytes | `Read`/`Write` requests; volume per `host,disk`, named `host_disk` | response_time |
//! | `arc` | ARC `.lis`: `start nblocks ignored request_number`, whitespace-separated | 512-byte sectors | one read per line; one volume; no time | 3rd and 4th fields |
//! | `blkparse` | `blkparse` default output: `maj,min cpu seq sec.nsec pid action rwbs sector + n [proc]` | 512-byte sectors; seconds.nanoseconds | events of one action (`Q` queued by default; `D` issued or `C` completed by option); RWBS `R` read, `W` write (after an optional leading `F`, pre-flush); volume per `maj,min` | other actions, `D` discards, `N` no-data, flushes, pre-flushes without a sector range and secure erases (skipped); RWBS flags `F`(FUA) `A` `S` `M`; process name; the closing summary (`CPU0 (8,0):`, `Total ...`) ends the trace |
//! | `oracle-general` | libCacheSim oracleGeneral: 24-byte LE records `u32 timestamp, u64 obj_id, u32 obj_size, i64 next_access_vtime` | timestamp: seconds; `obj_id` × 512 bytes (the 512-byte block number; the unit is an option); obj_size: bytes | one read per record; one volume | next_access_vtime (1-based number of the object's next record; used only by `auto` to recognise the format) |
//! | `vscsi` | libCacheSim's vscsi binary: v1 32-byte records `u32 sn, u32 len, u32 nSG, u16 cmd, u16 ver, u64 lbn, u64 ts`, v2 40-byte `u16 cmd, u16 ver, u32 sn, u32 len, u32 nSG, u64 lbn, u64 ts, u64 rt`; version (`ver >> 8`) from the first two records, checked in every record | lbn: 512-byte blocks; len: bytes; ts: µs | SCSI read (0x08, 0x28, 0xa8, 0x88) and write (0x0a, 0x2a, 0xaa, 0x8a) commands; one volume | other SCSI commands (skipped); sn, nSG, rt |
//! | `vscsi-csv` | libCacheSim's csv of a vscsi trace (cloudPhysicsIO.csv): header `version,time,op,size,lbn` (optional), `op` the SCSI opcode in hex | time: seconds; size: bytes; lbn: 512-byte blocks | as `vscsi` | version (must be 1 or 2) |
//! | `sector-list` | one number per line (libCacheSim `txt` trace of a block device, cloudPhysicsIO.txt) | 512-byte sectors | one 512-byte read per line; one volume; no time | — (the file has no sizes, operations or times) |
//! | `fio-iolog` | fio `write_iolog` v2 (`fio version 2 iolog`; `file action [offset length]`) and v3 (`fio version 3 iolog`; `timestamp file action [offset length]`) | offset, length: bytes; v3 timestamp: µs; v2 `wait N` sets the time to N ms after the start (what fio's replay code does; its HOWTO says µs since the previous wait) | `read`, `write`; volume per file name (order of first read/write) | `trim`, `sync`, `datasync`, `sync_file_range`, `syncfs`, `wait`, `add`, `open`, `close` (skipped); any other action is an error |
//! | `snia-tencent` | Tencent CBS csv, no header: `timestamp,offset,size,io_type,volume_id` | timestamp: seconds; offset, size: 512-byte sectors; io_type 0 read, 1 write | requests; volume per volume_id | — |
//! | `systor` | SYSTOR'17 csv, header `Timestamp,Response,IOType,LUN,Offset,Size` (optional) | timestamp: seconds with fraction; offset, size: bytes; IOType `R`/`W` | requests; volume per LUN | Response (may be empty) |
//! | `disksim` | DiskSim ASCII as MQSim ships it: `time device start_sector sectors flags` | time: integer ns (MQSim) or, with a decimal point, ms (DiskSim); 512-byte sectors | flags bit 0: 1 read, 0 write; volume per device | other flag bits |
//! | `lirs` | LIRS paper traces: one block number per line | 4 KiB blocks | one 4 KiB read per line; one volume; no time | `*` breakpoint lines of the LIRS simulator |
//! | `ssdcache` | `ssdcache serve --record-trace`: line 1 `# ssdcache-trace v1`, `#` comments with `sample_rate=` / `sample_region=` settings in the header, then `time_us,volume,op,offset,length` (full specification in `crates/sim/src/trace/ssdcache.rs`) | time: µs; offset, length: bytes; op `R`/`W` | requests; volume per name; `sample_rate` and `sample_region` in `TraceInfo` so the simulator can scale cache sizes | comments, unknown settings |
//!
//! ## The shared traces
//!
//! | file | format | requests |
//! |---|---|---|
//! | arc/P3.lis.zst, arc/P6.lis.zst | arc (zstd) | 238 578, 519 711 |
//! | cloudphysics/cloudPhysicsIO.csv | vscsi-csv | 113 872 (66 898 writes) |
//! | cloudphysics/cloudPhysicsIO.vscsi | vscsi (version 1) | 113 872 |
//! | cloudphysics/cloudPhysicsIO.oracleGeneral.bin | oracle-general | 113 872 (all reads) |
//! | cloudphysics/cloudPhysicsIO.txt | sector-list (auto cannot tell it from lirs: pass `--format sector-list`) | 113 872 |
//! | tencent_cbs/cloud_storage-sample.bz2 | snia-tencent (bzip2) | 50 000, 2 038 volumes |
//! | msr/msr-cambridge1-sample.csv | msr | 1 000 |
//! | systor17/*.csv.gz | systor (gzip) | 999 each |
//! | mqsim/tpcc-small.trace, mqsim/wsrch-small.trace | disksim | 6 999 (16 devices), 24 783 (6 devices) |
//! | lirs/*.trace.gz | lirs (gzip) | 6 015 (gli) to 505 500 (loop) |
//!
//! The four CloudPhysics files are one trace, but their 4 KiB block reference sequences are not all
//! the same (`crates/sim/tests/trace_cloudphysics.rs` checks each statement):
//!
//! - **csv and vscsi** hold the same requests, operations included, and give the same sequence. The
//!   csv's `time` is whole seconds (the binary's microseconds ÷ 10^6, as libCacheSim's vscsi reader
//!   converts them), not microseconds as shared/traces/README.md says.
//! - **oracleGeneral**: `obj_id` is the csv's `lbn`, so `obj_id × 512` gives the same offsets; but
//!   libCacheSim's converter gives every record of an object the size of the object's first record,
//!   so 13 671 of the 113 872 requests are cut or stretched to that size, and its sequence equals the
//!   csv's only after the same change. It has no operations (all reads).
//! - **txt** keeps only each request's lbn: read as `sector-list` it gives the first block of every
//!   csv request and none of the blocks after the first.
//!
//! Speed (release build, one core's CPU time measured with `/usr/bin/time` on the shared 2-core
//! machine; `cargo run --release -p ssdcache-sim --example read_trace -- FILE`): 5 million
//! requests in 0.71 s (ssdcache text, 161 MB), 1.00 s (MSR csv, 256 MB), 0.14 s (oracleGeneral,
//! 120 MB); P6.lis.zst 519 711 requests in 0.10 s wall.
//!
//! (The same text is docs/traces.md.)

mod arc;
mod blkparse;
mod blocks;
mod detect;
mod disksim;
mod error;
mod fio_iolog;
mod input;
mod lirs;
mod msr;
mod oracle_general;
mod sector_list;
mod snia_tencent;
pub mod ssdcache;
mod systor;
mod vscsi;
mod vscsi_csv;

use std::fmt;
use std::fs::File;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

pub use blocks::{block_key, block_keys, BlockKeys, MAX_BLOCK, MIN_LINE_SIZE, VOLUME_SHIFT};
pub use error::{ParseFormatError, TraceError};
pub use input::Compression;

use input::{ErrorContext, Source};

/// What a request does to the device (shared with the recorder, `ssdcache-trace`).
pub use ssdcache_trace::Op;

/// One block request of a trace, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Time since the trace's first request, in nanoseconds (0 when the format has no time).
    /// A request stamped earlier than the first one (traces are not always sorted) gets 0.
    pub time_ns: u64,
    /// Which disk or volume of a multi-disk trace: ids count from 0 in order of first
    /// appearance, [`Trace::volume_names`] has their names (0 when the format has one).
    pub volume: u32,
    pub op: Op,
    pub offset: u64,
    pub len: u64,
}

/// Every reader refuses a request longer than this (4 GiB - 1, the largest a 32-bit length
/// field of the binary formats can say): a longer one is a corrupt record, and it would
/// otherwise turn into billions of block references.
pub const MAX_REQUEST_LEN: u64 = u32::MAX as u64;
/// Every reader refuses a request ending beyond this byte (128 PiB), so that a block number
/// of any line size of at least [`MIN_LINE_SIZE`] fits the 48 bits [`block_key`] gives it.
pub const MAX_TRACE_BYTES: u64 = 1 << 57;
/// The most distinct volumes one trace may have: [`block_key`] keeps 16 bits for the volume.
pub const MAX_VOLUMES: u32 = 1 << 16;

/// A trace format, as named by `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// Tell the format from the (decompressed) content, with the file name as a tie-breaker.
    Auto,
    Msr,
    Arc,
    Blkparse,
    OracleGeneral,
    Vscsi,
    /// libCacheSim's csv dump of a vscsi trace (`version,time,op,size,lbn`).
    VscsiCsv,
    /// One 512-byte sector number per line (libCacheSim's `txt` traces of block devices).
    SectorList,
    FioIolog,
    SniaTencent,
    Systor,
    Disksim,
    Lirs,
    Ssdcache,
}

impl Format {
    /// Every concrete format (all but [`Format::Auto`]), in the order `--help` lists them.
    pub const ALL: [Format; 13] = [
        Format::Msr,
        Format::Arc,
        Format::Blkparse,
        Format::OracleGeneral,
        Format::Vscsi,
        Format::VscsiCsv,
        Format::SectorList,
        Format::FioIolog,
        Format::SniaTencent,
        Format::Systor,
        Format::Disksim,
        Format::Lirs,
        Format::Ssdcache,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::Auto => "auto",
            Format::Msr => "msr",
            Format::Arc => "arc",
            Format::Blkparse => "blkparse",
            Format::OracleGeneral => "oracle-general",
            Format::Vscsi => "vscsi",
            Format::VscsiCsv => "vscsi-csv",
            Format::SectorList => "sector-list",
            Format::FioIolog => "fio-iolog",
            Format::SniaTencent => "snia-tencent",
            Format::Systor => "systor",
            Format::Disksim => "disksim",
            Format::Lirs => "lirs",
            Format::Ssdcache => "ssdcache",
        }
    }

    /// What the format is, in a few words, for messages.
    pub fn description(self) -> &'static str {
        match self {
            Format::Auto => "detected from the content",
            Format::Msr => "MSR Cambridge csv",
            Format::Arc => "ARC .lis (512-byte sectors)",
            Format::Blkparse => "blkparse default text output",
            Format::OracleGeneral => "libCacheSim oracleGeneral binary",
            Format::Vscsi => "VMware vscsi binary (libCacheSim)",
            Format::VscsiCsv => "vscsi csv (version,time,op,size,lbn)",
            Format::SectorList => "one 512-byte sector number per line",
            Format::FioIolog => "fio iolog v2/v3",
            Format::SniaTencent => "Tencent CBS csv (SNIA)",
            Format::Systor => "SYSTOR'17 csv (SNIA)",
            Format::Disksim => "DiskSim/MQSim ASCII",
            Format::Lirs => "LIRS: one 4 KiB block number per line",
            Format::Ssdcache => "ssdcache serve --record-trace",
        }
    }

    pub(crate) fn is_binary(self) -> bool {
        matches!(self, Format::OracleGeneral | Format::Vscsi)
    }

    /// `auto, msr, arc, ...` for error messages.
    pub fn names_list() -> String {
        let mut names = vec![Format::Auto.name()];
        names.extend(Format::ALL.iter().map(|format| format.name()));
        names.join(", ")
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = ParseFormatError;

    fn from_str(name: &str) -> Result<Format, ParseFormatError> {
        std::iter::once(Format::Auto)
            .chain(Format::ALL)
            .find(|format| format.name().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| ParseFormatError {
                found: name.to_owned(),
            })
    }
}

/// Which blkparse events become requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlkparseAction {
    /// `Q`: the request as the submitter queued it, before the I/O scheduler merged or split it
    /// (what a cache in front of the device is asked for).
    #[default]
    Queue,
    /// `D`: the request as issued to the driver, after merging.
    Issue,
    /// `C`: completions, as issued, after the device finished them.
    Complete,
}

impl BlkparseAction {
    pub(crate) fn letter(self) -> &'static [u8] {
        match self {
            BlkparseAction::Queue => b"Q",
            BlkparseAction::Issue => b"D",
            BlkparseAction::Complete => b"C",
        }
    }
}

/// Choices for formats that leave something open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenOptions {
    pub blkparse_action: BlkparseAction,
    /// Bytes one step of an oracleGeneral `obj_id` stands for: 512 by default, because
    /// libCacheSim's block traces (cloudPhysicsIO.oracleGeneral.bin) keep the 512-byte logical
    /// block number as the object id.
    pub oracle_general_id_unit: u64,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions {
            blkparse_action: BlkparseAction::Queue,
            oracle_general_id_unit: 512,
        }
    }
}

/// What is known about a trace once it is open.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceInfo {
    /// The format read (never [`Format::Auto`]).
    pub format: Format,
    pub compression: Compression,
    /// The fraction of the address space recorded, from an ssdcache trace's header (1 for every
    /// other format): a simulator scales cache sizes by it.
    pub sample_rate: f64,
    /// The size in bytes of the regions sampled by hash, when the trace says.
    pub sample_region: Option<u64>,
}

/// An open trace: an iterator of requests in trace order. After the first error it ends.
pub struct Trace {
    parser: Box<dyn Parser>,
    info: TraceInfo,
    path: PathBuf,
    failed: bool,
}

impl Trace {
    pub fn info(&self) -> &TraceInfo {
        &self.info
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names of the volumes seen so far, indexed by [`Request::volume`]; complete once the
    /// trace has been read to its end. Empty for formats without volumes.
    pub fn volume_names(&self) -> &[String] {
        self.parser.volume_names()
    }

    /// Records read so far that carry no read or write and so became no request: discards
    /// (trims), flushes and syncs, SCSI commands other than read and write, file open/close.
    pub fn skipped_records(&self) -> u64 {
        self.parser.skipped()
    }
}

impl Iterator for Trace {
    type Item = Result<Request, TraceError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.parser.next_request() {
            Ok(request) => request.map(Ok),
            Err(error) => {
                self.failed = true;
                Some(Err(error))
            }
        }
    }
}

impl fmt::Debug for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trace")
            .field("path", &self.path)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// Opens a trace file, compressed (zstd, gzip, bzip2, xz: told by magic bytes) or not.
pub fn open(path: &Path, format: Format) -> Result<Trace, TraceError> {
    open_with(path, format, &OpenOptions::default())
}

/// [`open`] with choices for the formats that leave some open.
pub fn open_with(path: &Path, format: Format, options: &OpenOptions) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Open {
        path: path.to_owned(),
        cause: source,
    })?;
    from_reader(path, Box::new(file), format, options)
}

/// Reads a trace from any byte stream (standard input, a test's buffer); `name` stands for the
/// file in messages and its extension is the hint of [`Format::Auto`].
pub fn from_reader(
    name: &Path,
    reader: Box<dyn Read + Send>,
    format: Format,
    options: &OpenOptions,
) -> Result<Trace, TraceError> {
    let source = Source::new(name.to_owned(), reader)?;
    if options.oracle_general_id_unit == 0 {
        return Err(source
            .ctx
            .file_error("the oracle-general id unit must be at least 1 byte"));
    }
    let format = match format {
        Format::Auto => detect::detect(&source, options)?,
        given => given,
    };
    let compression = source.ctx.compression;
    let prefix = source.prefix.clone();
    let (ctx, input) = source.into_reader();
    let parser = build_parser(format, ctx, input, &prefix, options)?;
    let sampling = parser.sampling();
    Ok(Trace {
        parser,
        info: TraceInfo {
            format,
            compression,
            sample_rate: sampling.rate,
            sample_region: sampling.region,
        },
        path: name.to_owned(),
        failed: false,
    })
}

/// The part of the address space a trace covers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Sampling {
    pub rate: f64,
    pub region: Option<u64>,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling {
            rate: 1.0,
            region: None,
        }
    }
}

/// One format's reader behind [`Trace`].
pub(crate) trait Parser: Send {
    /// The next request; `None` at the end of the trace.
    fn next_request(&mut self) -> Result<Option<Request>, TraceError>;

    fn volume_names(&self) -> &[String] {
        &[]
    }

    fn skipped(&self) -> u64 {
        0
    }

    fn sampling(&self) -> Sampling {
        Sampling::default()
    }
}

/// Builds `format`'s reader over the whole decompressed stream `input`, whose first bytes are
/// `prefix` too (for formats that look ahead, such as vscsi's version).
pub(crate) fn build_parser(
    format: Format,
    ctx: Arc<ErrorContext>,
    input: Box<dyn BufRead + Send>,
    prefix: &[u8],
    options: &OpenOptions,
) -> Result<Box<dyn Parser>, TraceError> {
    match format {
        Format::Auto => Err(ctx.file_error("internal: the format must be resolved before reading")),
        Format::Msr => Ok(msr::reader(ctx, input)),
        Format::Arc => Ok(arc::reader(ctx, input)),
        Format::Blkparse => Ok(blkparse::reader(ctx, input, options.blkparse_action)),
        Format::OracleGeneral => Ok(oracle_general::reader(
            ctx,
            input,
            options.oracle_general_id_unit,
        )),
        Format::Vscsi => vscsi::reader(ctx, input, prefix),
        Format::VscsiCsv => Ok(vscsi_csv::reader(ctx, input)),
        Format::SectorList => Ok(sector_list::reader(ctx, input)),
        Format::FioIolog => fio_iolog::reader(ctx, input),
        Format::SniaTencent => Ok(snia_tencent::reader(ctx, input)),
        Format::Systor => Ok(systor::reader(ctx, input)),
        Format::Disksim => Ok(disksim::reader(ctx, input)),
        Format::Lirs => Ok(lirs::reader(ctx, input)),
        Format::Ssdcache => ssdcache::reader(ctx, input),
    }
}
