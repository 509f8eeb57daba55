//! Everything the format readers share: decompression by magic bytes, buffered line and record
//! readers that keep the line number or byte offset for errors, allocation-free number parsing,
//! volume-name interning and request range checks.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::error::{Snippet, TraceError};
use super::{Op, Parser, Request, Sampling, MAX_REQUEST_LEN, MAX_TRACE_BYTES, MAX_VOLUMES};

/// Large reads keep the per-request cost of the readers low.
const BUFFER_BYTES: usize = 256 * 1024;
/// How much decompressed data `--format auto` looks at.
pub(crate) const SNIFF_BYTES: usize = 64 * 1024;
/// A longer "line" means the file is not a text trace (or is corrupt); stop before buffering it.
const MAX_LINE_BYTES: u64 = 64 * 1024;

/// How a trace file is compressed, told by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    None,
    Zstd,
    Gzip,
    Bzip2,
    Xz,
}

impl Compression {
    const ZSTD_MAGIC: &'static [u8] = &[0x28, 0xb5, 0x2f, 0xfd];
    const GZIP_MAGIC: &'static [u8] = &[0x1f, 0x8b];
    const BZIP2_MAGIC: &'static [u8] = b"BZh";
    const XZ_MAGIC: &'static [u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0x00];
    /// The longest magic above.
    pub(crate) const MAGIC_BYTES: usize = 6;

    pub fn from_magic(first_bytes: &[u8]) -> Compression {
        if first_bytes.starts_with(Self::ZSTD_MAGIC) {
            Compression::Zstd
        } else if first_bytes.starts_with(Self::GZIP_MAGIC) {
            Compression::Gzip
        } else if first_bytes.starts_with(Self::BZIP2_MAGIC) {
            Compression::Bzip2
        } else if first_bytes.starts_with(Self::XZ_MAGIC) {
            Compression::Xz
        } else {
            Compression::None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "uncompressed",
            Compression::Zstd => "zstd",
            Compression::Gzip => "gzip",
            Compression::Bzip2 => "bzip2",
            Compression::Xz => "xz",
        }
    }

    /// File-name extensions this compression conventionally adds (stripped before the
    /// extension is used as a format hint).
    pub(crate) fn extensions() -> &'static [&'static str] {
        &["zst", "zstd", "gz", "gzip", "bz2", "bzip2", "xz", "lzma"]
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What every error of one trace needs to say where it happened.
#[derive(Debug)]
pub(crate) struct ErrorContext {
    pub path: PathBuf,
    pub compression: Compression,
}

impl ErrorContext {
    pub fn read_error(&self, position: fmt::Arguments<'_>, source: io::Error) -> TraceError {
        let message = match self.compression {
            Compression::None => format!("read failed {position}"),
            compressed => format!("corrupt or truncated {compressed} stream {position}"),
        };
        TraceError::Read {
            path: self.path.clone(),
            message,
            cause: source,
        }
    }

    pub fn file_error(&self, message: impl Into<String>) -> TraceError {
        TraceError::File {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    pub fn line_error(&self, line: u64, message: impl Into<String>) -> TraceError {
        TraceError::Line {
            path: self.path.clone(),
            line,
            message: message.into(),
        }
    }

    pub fn record_error(&self, offset: u64, message: impl Into<String>) -> TraceError {
        TraceError::Record {
            path: self.path.clone(),
            offset,
            message: message.into(),
        }
    }
}

/// A decompressed trace stream whose first bytes have been read ahead (for `--format auto` and
/// for telling an empty file), then handed on in full.
pub(crate) struct Source {
    pub ctx: Arc<ErrorContext>,
    /// The first [`SNIFF_BYTES`] of the decompressed stream (fewer if it is shorter).
    pub prefix: Vec<u8>,
    /// True when `prefix` holds the whole stream.
    pub prefix_is_all: bool,
    /// The rest of the stream after `prefix`.
    rest: Box<dyn Read + Send>,
}

impl Source {
    pub fn new(path: PathBuf, mut raw: Box<dyn Read + Send>) -> Result<Source, TraceError> {
        let mut magic = Vec::with_capacity(Compression::MAGIC_BYTES);
        let read_magic = (&mut raw)
            .take(Compression::MAGIC_BYTES as u64)
            .read_to_end(&mut magic);
        if let Err(source) = read_magic {
            return Err(TraceError::Read {
                path,
                message: "read failed at the start of the file".to_owned(),
                cause: source,
            });
        }
        let compression = Compression::from_magic(&magic);
        let ctx = Arc::new(ErrorContext { path, compression });
        let whole = io::Cursor::new(magic).chain(raw);
        let mut decompressed = decompressor(compression, whole)
            .map_err(|e| ctx.read_error(format_args!("at the start of the file"), e))?;
        let mut prefix = Vec::with_capacity(SNIFF_BYTES);
        (&mut decompressed)
            .take(SNIFF_BYTES as u64)
            .read_to_end(&mut prefix)
            .map_err(|e| ctx.read_error(format_args!("in its first {SNIFF_BYTES} bytes"), e))?;
        if prefix.is_empty() {
            let what = match compression {
                Compression::None => "the file is empty".to_owned(),
                compressed => format!("the file is an empty {compressed} stream"),
            };
            return Err(ctx.file_error(format!("{what}; expected a trace")));
        }
        let prefix_is_all = prefix.len() < SNIFF_BYTES;
        Ok(Source {
            ctx,
            prefix,
            prefix_is_all,
            rest: decompressed,
        })
    }

    /// The whole decompressed stream, buffered.
    pub fn into_reader(self) -> (Arc<ErrorContext>, Box<dyn BufRead + Send>) {
        let whole = io::Cursor::new(self.prefix).chain(self.rest);
        (
            self.ctx,
            Box::new(io::BufReader::with_capacity(BUFFER_BYTES, whole)),
        )
    }
}

fn decompressor(
    compression: Compression,
    input: impl Read + Send + 'static,
) -> io::Result<Box<dyn Read + Send>> {
    // The multi-stream decoders, because `cat a.gz b.gz` and parallel compressors (pigz,
    // pbzip2, xz -T) write several streams into one file.
    Ok(match compression {
        Compression::None => Box::new(input),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(input)?),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(input)),
        Compression::Bzip2 => Box::new(bzip2::read::MultiBzDecoder::new(input)),
        Compression::Xz => Box::new(liblzma::read::XzDecoder::new_multi_decoder(input)),
    })
}

/// One line of a text trace, without its line terminator (`\n` or `\r\n`).
pub(crate) struct Line<'a> {
    pub text: &'a [u8],
    pub number: u64,
    ctx: &'a ErrorContext,
}

impl Line<'_> {
    pub fn error(&self, message: impl Into<String>) -> TraceError {
        self.ctx.line_error(self.number, message)
    }

    /// The error for a field that does not parse.
    pub fn bad_field(&self, field: &str, found: &[u8], expected: &str) -> TraceError {
        self.error(format!(
            "bad {field} `{}`: expected {expected}",
            Snippet(found)
        ))
    }

    /// True for line 1 when it is `header` (but for ASCII case and surrounding whitespace): the
    /// optional column header of a csv format.
    pub fn is_header(&self, header: &[u8]) -> bool {
        self.number == 1 && self.text.trim_ascii().eq_ignore_ascii_case(header)
    }

    /// [`to_bytes`], its complaint an error at this line.
    #[inline]
    pub fn to_bytes(&self, count: u64, unit: u64, what: &str) -> Result<u64, TraceError> {
        to_bytes(count, unit, what).map_err(|message| self.error(message))
    }

    /// The request this line carries after [`checked_request`]'s range checks, as
    /// [`LineParser::parse_line`] returns it; their complaint an error at this line.
    #[inline]
    pub fn request(
        &self,
        time_ns: u64,
        volume: u32,
        op: Op,
        offset: u64,
        len: u64,
    ) -> Result<Option<Request>, TraceError> {
        checked_request(time_ns, volume, op, offset, len)
            .map(Some)
            .map_err(|message| self.error(message))
    }
}

/// Reads a text trace line by line into one reused buffer.
pub(crate) struct Lines {
    input: Box<dyn BufRead + Send>,
    buffer: Vec<u8>,
    number: u64,
    /// The next call returns the current line again (a reader looked one line ahead).
    replay: bool,
    pub ctx: Arc<ErrorContext>,
}

impl Lines {
    pub fn new(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Lines {
        Lines {
            input,
            buffer: Vec::with_capacity(256),
            number: 0,
            replay: false,
            ctx,
        }
    }

    /// The next line, or `None` at the end of the stream.
    pub fn next_line(&mut self) -> Result<Option<Line<'_>>, TraceError> {
        if self.replay {
            self.replay = false;
        } else {
            self.buffer.clear();
            let read = (&mut self.input)
                .take(MAX_LINE_BYTES + 1)
                .read_until(b'\n', &mut self.buffer);
            let next = self.number + 1;
            match read {
                Ok(0) => return Ok(None),
                Ok(_) => self.number = next,
                Err(e) => return Err(self.ctx.read_error(format_args!("at line {next}"), e)),
            }
            if self.buffer.len() as u64 > MAX_LINE_BYTES {
                return Err(self.ctx.line_error(
                    self.number,
                    format!(
                        "line longer than {MAX_LINE_BYTES} bytes (starting `{}`): not a text trace",
                        Snippet(&self.buffer[..40])
                    ),
                ));
            }
        }
        let text = trim_line_end(&self.buffer);
        Ok(Some(Line {
            text,
            number: self.number,
            ctx: &self.ctx,
        }))
    }

    /// Makes the next [`Lines::next_line`] return the line it returned last.
    pub fn unread(&mut self) {
        assert!(self.number > 0, "unread before any line was read");
        self.replay = true;
    }
}

fn trim_line_end(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Reads a binary trace as fixed-size records, keeping the byte offset for errors.
pub(crate) struct Records {
    input: Box<dyn BufRead + Send>,
    offset: u64,
    pub ctx: Arc<ErrorContext>,
}

impl Records {
    pub fn new(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Records {
        Records {
            input,
            offset: 0,
            ctx,
        }
    }

    /// Fills `record` with the next record and returns its byte offset; `None` at a clean end
    /// of the stream, an error for a record cut short.
    pub fn next_record(
        &mut self,
        record: &mut [u8],
        what: &str,
    ) -> Result<Option<u64>, TraceError> {
        let at = self.offset;
        let mut filled = 0;
        while filled < record.len() {
            let available = match self.input.fill_buf() {
                Ok(available) => available,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(self
                        .ctx
                        .read_error(format_args!("at byte offset {}", at + filled as u64), e))
                }
            };
            if available.is_empty() {
                if filled == 0 {
                    return Ok(None);
                }
                return Err(self.ctx.record_error(
                    at,
                    format!(
                        "truncated {what}: the file ends {filled} bytes into a {}-byte record",
                        record.len()
                    ),
                ));
            }
            let take = available.len().min(record.len() - filled);
            record[filled..filled + take].copy_from_slice(&available[..take]);
            self.input.consume(take);
            filled += take;
        }
        self.offset += record.len() as u64;
        Ok(Some(at))
    }
}

/// Maps volume names to dense ids in order of first appearance.
#[derive(Default)]
pub(crate) struct VolumeTable {
    /// How a name as found in the trace is shown (lossy UTF-8 when `None`).
    display: Option<fn(&[u8]) -> String>,
    ids: HashMap<Box<[u8]>, u32>,
    /// The name bytes of each id, as found in the trace.
    keys: Vec<Box<[u8]>>,
    names: Vec<String>,
    /// Consecutive requests mostly go to the same volume: compare with it before hashing.
    last: Option<u32>,
}

impl VolumeTable {
    pub fn with_display(display: fn(&[u8]) -> String) -> VolumeTable {
        VolumeTable {
            display: Some(display),
            ..VolumeTable::default()
        }
    }

    pub fn id(&mut self, name: &[u8], line: &Line<'_>) -> Result<u32, TraceError> {
        self.id_checked(name, line, |_| Ok(()))
    }

    /// The id of `name`; a name not seen before must pass `validate` first (checked once per
    /// volume rather than once per request).
    pub fn id_checked(
        &mut self,
        name: &[u8],
        line: &Line<'_>,
        validate: impl FnOnce(&[u8]) -> Result<(), TraceError>,
    ) -> Result<u32, TraceError> {
        if let Some(last) = self.last {
            if *self.keys[last as usize] == *name {
                return Ok(last);
            }
        }
        let id = match self.ids.get(name) {
            Some(&id) => id,
            None => {
                validate(name)?;
                self.insert(name).map_err(|message| line.error(message))?
            }
        };
        self.last = Some(id);
        Ok(id)
    }

    fn insert(&mut self, name: &[u8]) -> Result<u32, String> {
        if self.keys.len() as u64 >= u64::from(MAX_VOLUMES) {
            return Err(format!(
                "volume `{}` would be volume number {}; at most {MAX_VOLUMES} volumes are supported",
                Snippet(name),
                self.keys.len() + 1
            ));
        }
        let id = self.keys.len() as u32;
        self.ids.insert(name.into(), id);
        self.keys.push(name.into());
        let shown = match self.display {
            Some(display) => display(name),
            None => String::from_utf8_lossy(name).into_owned(),
        };
        self.names.push(shown);
        Ok(id)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Turns a format's absolute timestamps into time since the trace's first request.
#[derive(Default)]
pub(crate) struct Clock {
    first: Option<u64>,
}

impl Clock {
    /// `raw` in the format's unit; the result in that unit too. Requests stamped before the
    /// first one (traces merged from several CPUs are not quite sorted) get 0.
    pub fn since_first(&mut self, raw: u64) -> u64 {
        let first = *self.first.get_or_insert(raw);
        raw.saturating_sub(first)
    }
}

/// Checks a request's byte range against the limits every consumer relies on
/// ([`MAX_REQUEST_LEN`], [`MAX_TRACE_BYTES`]); returns the complaint otherwise.
pub(crate) fn check_range(offset: u64, len: u64) -> Result<(), String> {
    if len > MAX_REQUEST_LEN {
        return Err(format!(
            "request length {len} bytes is over the {MAX_REQUEST_LEN}-byte limit of one request"
        ));
    }
    match offset.checked_add(len) {
        Some(end) if end <= MAX_TRACE_BYTES => Ok(()),
        _ => Err(format!(
            "request [{offset}, {offset} + {len}) ends beyond byte {MAX_TRACE_BYTES}, the largest device offset supported"
        )),
    }
}

/// `count` units of `unit` bytes, or the complaint if that overflows.
pub(crate) fn to_bytes(count: u64, unit: u64, what: &str) -> Result<u64, String> {
    count
        .checked_mul(unit)
        .ok_or_else(|| format!("{what} {count} × {unit} bytes does not fit in 64 bits"))
}

/// ASCII whitespace trimmed from both ends.
pub(crate) fn trim(field: &[u8]) -> &[u8] {
    field.trim_ascii()
}

/// A non-empty run of decimal digits.
pub(crate) fn parse_u64(field: &[u8]) -> Option<u64> {
    if field.is_empty() || field.len() > 20 {
        return None;
    }
    let mut value: u64 = 0;
    for &byte in field {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(u64::from(digit))?;
    }
    Some(value)
}

/// A non-empty run of hexadecimal digits, with or without a `0x` prefix.
pub(crate) fn parse_hex_u64(field: &[u8]) -> Option<u64> {
    let digits = field
        .strip_prefix(b"0x")
        .or_else(|| field.strip_prefix(b"0X"))
        .unwrap_or(field);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    let mut value: u64 = 0;
    for &byte in digits {
        let digit = (byte as char).to_digit(16)?;
        value = (value << 4) | u64::from(digit);
    }
    Some(value)
}

/// A non-negative decimal number such as `1455591804.310701000` in units of `10^-exponent`,
/// truncating further digits: `parse_scaled_decimal(b"1.5", 3) == Some(1500)`.
pub(crate) fn parse_scaled_decimal(field: &[u8], exponent: u32) -> Option<u64> {
    let (whole, fraction) = match field.iter().position(|&b| b == b'.') {
        Some(dot) => (&field[..dot], &field[dot + 1..]),
        None => (field, &b""[..]),
    };
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    let whole = if whole.is_empty() {
        0
    } else {
        parse_u64(whole)?
    };
    let mut scaled = whole.checked_mul(10u64.checked_pow(exponent)?)?;
    let mut place = 10u64.pow(exponent);
    for &byte in fraction {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        place /= 10;
        scaled = scaled.checked_add(u64::from(digit) * place)?;
    }
    Some(scaled)
}

/// Splits `line` at every `separator` into exactly `N` fields, or returns how many it has.
pub(crate) fn split_exact<const N: usize>(line: &[u8], separator: u8) -> Result<[&[u8]; N], usize> {
    exactly(line.split(|&b| b == separator))
}

/// Splits `line` at runs of ASCII whitespace into exactly `N` fields, or returns how many it has.
pub(crate) fn split_whitespace_exact<const N: usize>(line: &[u8]) -> Result<[&[u8]; N], usize> {
    exactly(split_whitespace(line))
}

/// The fields of `line` between runs of ASCII whitespace.
pub(crate) fn split_whitespace(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|b| b.is_ascii_whitespace())
        .filter(|field| !field.is_empty())
}

/// The first `N` of `fields` (the rest of the array empty when there are fewer) and how many
/// there are in all, counted without storing them.
#[inline]
pub(crate) fn first_fields<'a, const N: usize>(
    fields: impl Iterator<Item = &'a [u8]>,
) -> ([&'a [u8]; N], usize) {
    let mut first: [&[u8]; N] = [&[]; N];
    let mut count = 0;
    for field in fields {
        if count < N {
            first[count] = field;
        }
        count += 1;
    }
    (first, count)
}

#[inline]
fn exactly<'a, const N: usize>(
    fields: impl Iterator<Item = &'a [u8]>,
) -> Result<[&'a [u8]; N], usize> {
    match first_fields::<N>(fields) {
        (first, count) if count == N => Ok(first),
        (_, count) => Err(count),
    }
}

/// The path with compression extensions removed, lower-cased, for format hints.
pub(crate) fn name_without_compression(path: &Path) -> String {
    let mut name = path
        .file_name()
        .map(|name| name.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    while let Some((stem, extension)) = name.rsplit_once('.') {
        if !Compression::extensions().contains(&extension) {
            break;
        }
        name = stem.to_owned();
    }
    name
}

/// One text format's line parser, driven by [`TextReader`].
pub(crate) trait LineParser: Send {
    /// Parses one line that is not blank; `Ok(None)` for a line that carries no request.
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError>;

    fn volume_names(&self) -> &[String] {
        &[]
    }

    fn skipped(&self) -> u64 {
        0
    }

    /// True once the rest of the stream carries no requests (blkparse's summary).
    fn at_end(&self) -> bool {
        false
    }

    fn sampling(&self) -> Sampling {
        Sampling::default()
    }
}

/// A text trace: lines in, requests out; blank lines are skipped for every format.
pub(crate) struct TextReader<P> {
    lines: Lines,
    parser: P,
}

impl<P: LineParser + 'static> TextReader<P> {
    pub fn boxed(lines: Lines, parser: P) -> Box<dyn Parser> {
        Box::new(TextReader { lines, parser })
    }
}

impl<P: LineParser> Parser for TextReader<P> {
    #[inline]
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        while !self.parser.at_end() {
            let Some(line) = self.lines.next_line()? else {
                return Ok(None);
            };
            if line.text.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if let Some(request) = self.parser.parse_line(&line)? {
                return Ok(Some(request));
            }
        }
        Ok(None)
    }

    fn volume_names(&self) -> &[String] {
        self.parser.volume_names()
    }

    fn skipped(&self) -> u64 {
        self.parser.skipped()
    }

    fn sampling(&self) -> Sampling {
        self.parser.sampling()
    }
}

/// A request after the range checks every reader applies; the complaint otherwise.
pub(crate) fn checked_request(
    time_ns: u64,
    volume: u32,
    op: Op,
    offset: u64,
    len: u64,
) -> Result<Request, String> {
    check_range(offset, len)?;
    Ok(Request {
        time_ns,
        volume,
        op,
        offset,
        len,
    })
}

/// Where `field` (a sub-slice of `line`) starts in `line`.
pub(crate) fn position_in(line: &[u8], field: &[u8]) -> usize {
    let start = field.as_ptr() as usize - line.as_ptr() as usize;
    assert!(
        start + field.len() <= line.len(),
        "field is not part of the line"
    );
    start
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_numbers() {
        assert_eq!(parse_u64(b"0"), Some(0));
        assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_u64(b"18446744073709551616"), None);
        assert_eq!(
            parse_u64(b"00000000000000000000001"),
            None,
            "over 20 digits"
        );
        for bad in [&b""[..], b"-1", b"+1", b"1 ", b"1e3", b"0x10"] {
            assert_eq!(parse_u64(bad), None, "{}", Snippet(bad));
        }
    }

    #[test]
    fn hexadecimal_numbers() {
        assert_eq!(parse_hex_u64(b"2a"), Some(0x2a));
        assert_eq!(parse_hex_u64(b"0x2A"), Some(0x2a));
        assert_eq!(parse_hex_u64(b"ffffffffffffffff"), Some(u64::MAX));
        assert_eq!(parse_hex_u64(b"1ffffffffffffffff"), None);
        assert_eq!(parse_hex_u64(b"0x"), None);
        assert_eq!(parse_hex_u64(b"g"), None);
    }

    #[test]
    fn scaled_decimals() {
        assert_eq!(
            parse_scaled_decimal(b"1455591804.310701000", 9),
            Some(1_455_591_804_310_701_000)
        );
        assert_eq!(parse_scaled_decimal(b"1.5", 3), Some(1500));
        assert_eq!(parse_scaled_decimal(b"2.75", 6), Some(2_750_000));
        assert_eq!(parse_scaled_decimal(b".5", 3), Some(500));
        assert_eq!(parse_scaled_decimal(b"7", 9), Some(7_000_000_000));
        assert_eq!(
            parse_scaled_decimal(b"0.1234567891234", 9),
            Some(123_456_789),
            "extra digits truncated"
        );
        for bad in [
            &b""[..],
            b".",
            b"1.2.3",
            b"1.x",
            b"-1.0",
            b"99999999999999999999.0",
        ] {
            assert_eq!(parse_scaled_decimal(bad, 9), None, "{}", Snippet(bad));
        }
    }

    #[test]
    fn exact_splits_count_the_fields_they_found() {
        assert_eq!(
            split_exact::<3>(b"a,b,c", b','),
            Ok([&b"a"[..], b"b", b"c"])
        );
        assert_eq!(split_exact::<3>(b"a,b", b','), Err(2));
        assert_eq!(split_exact::<2>(b"a,b,c,d", b','), Err(4));
        assert_eq!(
            split_whitespace_exact::<2>(b"  1 \t 2  "),
            Ok([&b"1"[..], b"2"])
        );
        assert_eq!(split_whitespace_exact::<2>(b"   "), Err(0));
    }

    #[test]
    fn snippets_escape_and_cut_what_they_show() {
        assert_eq!(Snippet(b"a\tb\x00").to_string(), "a\\tb\\0");
        let long = Snippet(&[b'x'; 100]).to_string();
        assert!(long.ends_with('…') && long.chars().count() == 61, "{long}");
    }

    #[test]
    fn compression_magic_and_names() {
        assert_eq!(
            Compression::from_magic(&[0x28, 0xb5, 0x2f, 0xfd, 0]),
            Compression::Zstd
        );
        assert_eq!(Compression::from_magic(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(Compression::from_magic(b"BZh9"), Compression::Bzip2);
        assert_eq!(
            Compression::from_magic(&[0xfd, b'7', b'z', b'X', b'Z', 0]),
            Compression::Xz
        );
        assert_eq!(Compression::from_magic(b"1,2,3"), Compression::None);
        assert_eq!(
            name_without_compression(Path::new("/a/P3.LIS.zst")),
            "p3.lis"
        );
        assert_eq!(
            name_without_compression(Path::new("x.trace.gz.xz")),
            "x.trace"
        );
    }

    #[test]
    fn the_clock_counts_from_the_first_request_and_never_goes_negative() {
        let mut clock = Clock::default();
        assert_eq!(clock.since_first(100), 0);
        assert_eq!(clock.since_first(150), 50);
        assert_eq!(clock.since_first(90), 0);
    }
}
