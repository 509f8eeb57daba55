//! The trace format `ssdcache serve --record-trace` writes, so users can feed their own workload
//! to `simulate`, `mrc` and `advise`.
//!
//! # The ssdcache trace format, version 1
//!
//! ```text
//! # ssdcache-trace v1
//! # sample_rate=0.01 sample_region=1048576
//! # time_us,volume,op,offset,length
//! 0,sdb,R,0,4096
//! 12,sdb,W,1048576,65536
//! ```
//!
//! A text file in UTF-8, lines ending in `\n` (a reader also accepts `\r\n`), possibly
//! compressed as a whole with zstd, gzip, bzip2 or xz.
//!
//! 1. **Line 1** is exactly `# ssdcache-trace v1` ([`FIRST_LINE`]). Readers refuse any other
//!    first line; a format change that old readers must not misread changes the number.
//! 2. **Comments** are lines whose first byte is `#`. The comments before the first request
//!    line are the *header*: in them, whitespace-separated words of the form `key=value` are
//!    settings, all other words are ignored, unknown keys are ignored (a later writer may add
//!    some), and a key given twice keeps its last value. Comments after the first request line
//!    are ignored entirely. The settings:
//!    - `sample_rate=R` ([`KEY_SAMPLE_RATE`]): the fraction of the address space the recording
//!      kept, a decimal number with 0 < R ≤ 1 (`0.01`). Absent: 1 (everything recorded).
//!    - `sample_region=B` ([`KEY_SAMPLE_REGION`]): the size in bytes of the regions sampled, a
//!      decimal integer ≥ 1. The recorder keeps all requests of a region of `B` bytes, chosen by
//!      a hash of (volume, offset / B) falling under `R`, and none of the others (which hash is
//!      the recorder's choice); a request is attributed to the region of its offset. Absent:
//!      not said.
//!
//!    The writer also writes the legend `# time_us,volume,op,offset,length` ([`LEGEND_LINE`]).
//! 3. **Blank lines** (empty or only spaces and tabs) are ignored.
//! 4. **Every other line is one request**: exactly five fields separated by `,`, without spaces
//!    around them: `time_us,volume,op,offset,length`.
//!    - `time_us`: microseconds since the recording started, a decimal integer (< 2^64).
//!      Lines need not be sorted by time (requests of several threads interleave).
//!    - `volume`: the name of the volume (the backing device's name in the cache's
//!      configuration), 1 to 255 bytes of UTF-8 without `,` and without control characters,
//!      taken byte for byte (no trimming).
//!    - `op`: `R` (read) or `W` (write).
//!    - `offset`, `length`: bytes, decimal integers. `length` may be 0 (the request touches no
//!      block); `length` ≤ 2^32 - 1 ([`super::MAX_REQUEST_LEN`]) and `offset + length` ≤ 2^57
//!      ([`super::MAX_TRACE_BYTES`]).
//!
//!    Decimal integers are ASCII digits only (no sign, no spaces, leading zeros allowed).
//!
//! Reading: volumes get ids 0, 1, ... in order of their first request line
//! ([`super::Trace::volume_names`] has the names); a request's `time_ns` is its `time_us`
//! minus the first request line's, × 1000 (0 if negative); `sample_rate` and `sample_region`
//! are in [`super::TraceInfo`].

use std::io::BufRead;
use std::sync::Arc;

use super::error::Snippet;
use super::input::{
    parse_u64, split_exact, split_whitespace, Clock, ErrorContext, Line, LineParser, Lines,
    TextReader, VolumeTable,
};
use super::{Op, Parser, Request, Sampling, TraceError};

/// The first line of every ssdcache trace of version 1.
pub const FIRST_LINE: &str = "# ssdcache-trace v1";
/// The column legend the writer puts in the header.
pub const LEGEND_LINE: &str = "# time_us,volume,op,offset,length";
pub const KEY_SAMPLE_RATE: &str = "sample_rate";
pub const KEY_SAMPLE_REGION: &str = "sample_region";
/// The longest volume name, in bytes.
pub const MAX_VOLUME_NAME_BYTES: usize = 255;

const MICROSECOND_NS: u64 = 1_000;
const FIRST_LINE_PREFIX: &[u8] = b"# ssdcache-trace v";

pub(crate) fn reader(
    ctx: Arc<ErrorContext>,
    input: Box<dyn BufRead + Send>,
) -> Result<Box<dyn Parser>, TraceError> {
    let mut lines = Lines::new(Arc::clone(&ctx), input);
    match lines.next_line()? {
        Some(line) if line.text == FIRST_LINE.as_bytes() => {}
        Some(line) if line.text.starts_with(FIRST_LINE_PREFIX) => {
            return Err(line.error(format!(
                "unsupported ssdcache trace version `{}`: this reader reads `{FIRST_LINE}`",
                Snippet(line.text)
            )))
        }
        Some(line) => {
            return Err(line.error(format!(
                "expected `{FIRST_LINE}` as the first line of an ssdcache trace, found `{}`",
                Snippet(line.text)
            )))
        }
        None => return Err(ctx.file_error(format!("no `{FIRST_LINE}` line"))),
    }
    let sampling = read_header(&mut lines)?;
    Ok(TextReader::boxed(
        lines,
        SsdcacheLines {
            sampling,
            volumes: VolumeTable::default(),
            clock: Clock::default(),
        },
    ))
}

/// Reads the header comments up to the first request line, which is left to be read again.
fn read_header(lines: &mut Lines) -> Result<Sampling, TraceError> {
    let mut sampling = Sampling::default();
    loop {
        let Some(line) = lines.next_line()? else {
            return Ok(sampling);
        };
        if line.text.first() == Some(&b'#') {
            read_settings(&line, &mut sampling)?;
        } else if !line.text.iter().all(u8::is_ascii_whitespace) {
            lines.unread();
            return Ok(sampling);
        }
    }
}

fn read_settings(line: &Line<'_>, sampling: &mut Sampling) -> Result<(), TraceError> {
    for word in split_whitespace(&line.text[1..]) {
        let Some(equals) = word.iter().position(|&b| b == b'=') else {
            continue;
        };
        let (key, value) = (&word[..equals], &word[equals + 1..]);
        if key == KEY_SAMPLE_RATE.as_bytes() {
            sampling.rate = std::str::from_utf8(value)
                .ok()
                .and_then(|text| text.parse::<f64>().ok())
                .filter(|rate| *rate > 0.0 && *rate <= 1.0)
                .ok_or_else(|| {
                    line.bad_field(KEY_SAMPLE_RATE, value, "a decimal number in (0, 1]")
                })?;
        } else if key == KEY_SAMPLE_REGION.as_bytes() {
            let region = parse_u64(value).filter(|&bytes| bytes > 0).ok_or_else(|| {
                line.bad_field(KEY_SAMPLE_REGION, value, "a positive decimal byte count")
            })?;
            sampling.region = Some(region);
        }
    }
    Ok(())
}

struct SsdcacheLines {
    sampling: Sampling,
    volumes: VolumeTable,
    clock: Clock,
}

fn valid_volume_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= MAX_VOLUME_NAME_BYTES
        && std::str::from_utf8(name).is_ok_and(|text| !text.chars().any(char::is_control))
}

impl LineParser for SsdcacheLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        if line.text.first() == Some(&b'#') {
            return Ok(None);
        }
        let [time_us, volume, op, offset, length] = split_exact::<5>(line.text, b',')
            .map_err(|found| {
                line.error(format!(
                    "expected 5 comma-separated fields (time_us,volume,op,offset,length) of an ssdcache trace, found {found}"
                ))
            })?;
        let time_us = parse_u64(time_us)
            .ok_or_else(|| line.bad_field("time_us", time_us, "decimal microseconds"))?;
        let op = match op {
            b"R" => Op::Read,
            b"W" => Op::Write,
            other => return Err(line.bad_field("op", other, "`R` or `W`")),
        };
        let offset = parse_u64(offset)
            .ok_or_else(|| line.bad_field("offset", offset, "a decimal byte offset"))?;
        let length = parse_u64(length)
            .ok_or_else(|| line.bad_field("length", length, "a decimal byte count"))?;
        let volume = self.volumes.id_checked(volume, line, |name| {
            if valid_volume_name(name) {
                Ok(())
            } else {
                Err(line.bad_field(
                    "volume",
                    name,
                    "a name of 1 to 255 bytes of UTF-8 without control characters",
                ))
            }
        })?;
        let time_ns = self
            .clock
            .since_first(time_us)
            .saturating_mul(MICROSECOND_NS);
        line.request(time_ns, volume, op, offset, length)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }

    fn sampling(&self) -> Sampling {
        self.sampling
    }
}
