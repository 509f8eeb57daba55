//! Block I/O trace readers. Every format becomes one stream of [`Request`]s in bytes, so the
//! simulator, `mrc` and `advise` never see a format's units.
//!
//! FORMAT_DOCS_PLACEHOLDER

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

/// What a request does to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Op {
    Read,
    Write,
}

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
        source,
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
