//! The trace readers of `ssdcache-sim`: every format's parser and `--format auto` detection,
//! fed garbage. Opening and reading give requests or an error, never a panic; every request
//! stays inside the documented limits (length, end, volume id); after an error the trace ends;
//! every error names the file.
//!
//! Input: byte 0 picks the format (`auto` or one of the 13, by `b % 14`), byte 1 picks the
//! file name `auto` takes its hint from and the reader options; the rest is the file, which
//! may be compressed (the readers tell zstd, gzip, bzip2 and xz by their magic bytes).
//!
//! Memory is bounded by the readers themselves (lines longer than 64 KiB are refused, the
//! read buffer is fixed); libFuzzer's `-rss_limit_mb` turns any growth into a failure. A few
//! KiB of zstd or gzip can stand for gigabytes of blank lines, which the readers stream
//! through correctly but slowly: a compressed input that expands beyond
//! [`MAX_DECOMPRESSED`] is skipped (the first campaign spent most of its time in such
//! inputs), and reading stops after [`MAX_REQUESTS`].

use std::io::{self, Cursor, Read};
use std::path::Path;

use ssdcache_sim::trace::{
    block_keys, from_reader, BlkparseAction, Compression, Format, OpenOptions, Trace, TraceError,
    MAX_REQUEST_LEN, MAX_TRACE_BYTES, MAX_VOLUMES,
};

/// Requests read per input at most.
pub const MAX_REQUESTS: usize = 100_000;
/// Compressed inputs that expand beyond this are skipped: four times what `--format auto`
/// looks at, so the readers still run past the detection window.
pub const MAX_DECOMPRESSED: u64 = 256 << 10;

/// File names whose extensions `--format auto` takes as hints.
const NAMES: [&str; 12] = [
    "trace",
    "trace.lis",
    "trace.vscsi",
    "trace.bin",
    "trace.oracleGeneral.zst",
    "trace.blkparse",
    "trace.iolog",
    "trace.trc",
    "trace.lirs.gz",
    "trace.trace",
    "trace.csv.bz2",
    "trace.txt.xz",
];

/// `oracle-general` id units: the default, the smallest, and one large enough to overflow.
const ID_UNITS: [u64; 4] = [512, 1, 4096, 1 << 40];

const ACTIONS: [BlkparseAction; 3] = [
    BlkparseAction::Queue,
    BlkparseAction::Issue,
    BlkparseAction::Complete,
];

/// The format selected by the input's first byte.
pub fn format_of(selector: u8) -> Format {
    match usize::from(selector) % (Format::ALL.len() + 1) {
        0 => Format::Auto,
        index => Format::ALL[index - 1],
    }
}

/// The selector byte of `format`.
pub fn selector_of(format: Format) -> u8 {
    Format::ALL
        .iter()
        .position(|&f| f == format)
        .map_or(0, |index| index as u8 + 1)
}

/// The file name selected by the input's second byte.
pub fn name_of(choices: u8) -> &'static Path {
    Path::new(NAMES[usize::from(choices & 0x0f) % NAMES.len()])
}

pub fn check(data: &[u8]) {
    let [format, choices, content @ ..] = data else {
        return;
    };
    let format = format_of(*format);
    let name = name_of(*choices);
    let options = OpenOptions {
        blkparse_action: ACTIONS[usize::from(choices >> 4) % ACTIONS.len()],
        oracle_general_id_unit: ID_UNITS[usize::from(choices >> 6) % ID_UNITS.len()],
    };
    if expands_too_much(content) {
        return;
    }
    let reader = Box::new(Cursor::new(content.to_vec()));
    match from_reader(name, reader, format, &options) {
        Ok(trace) => read_all(trace, format, name),
        Err(error) => check_error(&error, name),
    }
}

/// True for a compressed input that decompresses to more than [`MAX_DECOMPRESSED`] bytes
/// (told by magic bytes and decoded with multi-stream decoders, as the readers do). A corrupt
/// stream is left to the readers.
fn expands_too_much(content: &[u8]) -> bool {
    let decoder: Box<dyn Read + '_> = match Compression::from_magic(content) {
        Compression::None => return false,
        Compression::Zstd => match zstd::stream::read::Decoder::new(content) {
            Ok(decoder) => Box::new(decoder),
            Err(_) => return false,
        },
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(content)),
        Compression::Bzip2 => Box::new(bzip2::read::MultiBzDecoder::new(content)),
        Compression::Xz => Box::new(liblzma::read::XzDecoder::new_multi_decoder(content)),
    };
    let limit = MAX_DECOMPRESSED + 1;
    let expanded = io::copy(&mut decoder.take(limit), &mut io::sink());
    expanded.is_ok_and(|bytes| bytes == limit)
}

fn read_all(mut trace: Trace, format: Format, name: &Path) {
    let read = trace.info().format;
    assert_ne!(read, Format::Auto, "auto must resolve to a format");
    if format != Format::Auto {
        assert_eq!(read, format);
    }
    let rate = trace.info().sample_rate;
    assert!(rate > 0.0 && rate <= 1.0, "sample rate {rate}");
    for _ in 0..MAX_REQUESTS {
        match trace.next() {
            None => return,
            Some(Ok(request)) => {
                assert!(request.len <= MAX_REQUEST_LEN, "{request:?}");
                let end = request.offset.checked_add(request.len);
                assert!(end.is_some_and(|end| end <= MAX_TRACE_BYTES), "{request:?}");
                assert!(request.volume < MAX_VOLUMES, "{request:?}");
                let names = trace.volume_names().len();
                assert!(
                    names == 0 || (request.volume as usize) < names,
                    "{request:?}, {names} names"
                );
                let blocks = block_keys(&request, 4096).len() as u64;
                assert!(blocks <= request.len.div_ceil(4096) + 1);
            }
            Some(Err(error)) => {
                check_error(&error, name);
                assert!(trace.next().is_none(), "a trace goes on after an error");
                return;
            }
        }
    }
}

fn check_error(error: &TraceError, name: &Path) {
    let message = error.to_string();
    let shown = name.display().to_string();
    assert!(
        message.starts_with(&shown),
        "the error does not name the file: {message}"
    );
}

/// A few valid records of every format (as their readers' tests and docs show them), some
/// compressed, each for its own reader and for `auto`.
pub fn seeds() -> Vec<(Format, u8, Vec<u8>)> {
    let text: [(Format, &str); 11] = [
        (Format::Msr, "128166372003061629,hm,0,Read,3216666624,65536,5329\n128166372016382155,hm,1,Write,6968832,4096,6706\n"),
        (Format::Arc, "2968 1 0 1\n2969 8 0 2\n2968 1 0 3\n"),
        (Format::Blkparse, "  8,0    3        1     0.000000000  697  Q   R 223490 + 8 [kworker/3:1]\n  8,0    3        2     0.000019786  697  Q  WS 223498 + 16 [jbd2]\n  8,0    3        3     0.000022000  697  D   R 223490 + 8 [kworker/3:1]\n"),
        (Format::VscsiCsv, "version,time,op,size,lbn\n1,0,28,4096,100\n1,1,2a,8192,108\n"),
        (Format::SectorList, "100\n108\n100\n"),
        (Format::FioIolog, "fio version 2 iolog\n/dev/sdb add\n/dev/sdb open\n/dev/sdb read 0 4096\n/dev/sdb write 8192 4096\n/dev/sdb wait 10 0\n/dev/sdb close\n"),
        (Format::SniaTencent, "1538323200,1024,8,0,1283\n1538323201,2048,16,1,1284\n"),
        (Format::Systor, "Timestamp,Response,IOType,LUN,Offset,Size\n1487070000.123,0.0005,R,1,4096,4096\n1487070000.200,,W,2,8192,8192\n"),
        (Format::Disksim, "0.000000 0 1024 8 1\n1.500000 1 2048 16 0\n"),
        (Format::Lirs, "5\n7\n5\n*\n9\n"),
        (Format::Ssdcache, "# ssdcache-trace v1\n# sample_rate=0.5 sample_region=1048576\n# time_us,volume,op,offset,length\n0,sdb,R,0,4096\n15,sdb,W,8192,4096\n"),
    ];
    let mut seeds: Vec<(Format, u8, Vec<u8>)> = Vec::new();
    for (format, content) in text {
        seeds.push((format, 0, content.as_bytes().to_vec()));
    }
    seeds.push((Format::OracleGeneral, 0, oracle_general()));
    seeds.push((Format::Vscsi, 0, vscsi_v1()));
    // `auto` with a name hint for the two a number-per-line file could be.
    seeds.push((Format::Auto, 1, b"2968 1 0 1\n2969 8 0 2\n".to_vec()));
    seeds.push((Format::Auto, 7, b"5\n7\n5\n".to_vec()));
    seeds
}

/// Three libCacheSim oracleGeneral records: object 100 twice, then object 7 once.
fn oracle_general() -> Vec<u8> {
    let records: [(u32, u64, u32, i64); 3] =
        [(1, 100, 4096, 3), (2, 7, 8192, -1), (3, 100, 4096, -1)];
    let mut out = Vec::new();
    for (time, id, size, next) in records {
        out.extend_from_slice(&time.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&next.to_le_bytes());
    }
    out
}

/// Two vscsi version-1 records: a READ(10) and a WRITE(10).
fn vscsi_v1() -> Vec<u8> {
    let mut out = Vec::new();
    for (sn, cmd, lbn, ts) in [(1u32, 0x28u16, 100u64, 10u64), (2, 0x2a, 108, 20)] {
        out.extend_from_slice(&sn.to_le_bytes());
        out.extend_from_slice(&4096u32.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&cmd.to_le_bytes());
        out.extend_from_slice(&0x0100u16.to_le_bytes());
        out.extend_from_slice(&lbn.to_le_bytes());
        out.extend_from_slice(&ts.to_le_bytes());
    }
    out
}
