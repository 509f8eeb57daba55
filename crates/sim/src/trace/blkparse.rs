//! The default text output of `blkparse` (blktrace), e.g.
//!
//! ```text
//!   8,0    3        1     0.000000000   697  Q   R 223490 + 8 [kjournald]
//! ```
//!
//! Fields: `major,minor cpu sequence seconds.nanoseconds pid action rwbs`, then for requests
//! with data `sector + sectors [process]`. Sectors are 512 bytes; each `major,minor` device is a
//! volume. Only events of one action become requests: `Q` (queued, before the I/O scheduler
//! merges; the default), or `D` (issued to the driver) or `C` (completed) by
//! [`super::BlkparseAction`]; every other event line is passed over. The RWBS field's operation
//! letter (after a leading `F`, a pre-flush) gives the operation: `R` read, `W` write; `D`
//! (discard), `N` (no data), `E` (secure erase), a bare flush and a pre-flush without a sector
//! range (`Q FWS [jbd2]`) are skipped records. The
//! trailing letters (`F` FUA, `A` readahead, `S` sync, `M` metadata) are ignored. The summary
//! blkparse prints at the end (`CPU0 (8,0):`, `Total (8,0):`, ...) ends the trace.

use std::io::BufRead;
use std::sync::Arc;

use super::error::Snippet;
use super::input::{
    parse_scaled_decimal, parse_u64, split_whitespace, Clock, ErrorContext, Line, LineParser,
    Lines, TextReader, VolumeTable,
};
use super::{BlkparseAction, Op, Parser, Request, TraceError};

const SECTOR: u64 = 512;
const NANOSECOND_DIGITS: u32 = 9;
const EVENT_FIELDS: &str = "major,minor cpu sequence seconds.nanoseconds pid action rwbs";

pub(crate) fn reader(
    ctx: Arc<ErrorContext>,
    input: Box<dyn BufRead + Send>,
    action: BlkparseAction,
) -> Box<dyn Parser> {
    TextReader::boxed(
        Lines::new(ctx, input),
        BlkparseLines {
            action: action.letter(),
            volumes: VolumeTable::default(),
            clock: Clock::default(),
            skipped: 0,
            in_summary: false,
        },
    )
}

struct BlkparseLines {
    action: &'static [u8],
    volumes: VolumeTable,
    clock: Clock,
    skipped: u64,
    in_summary: bool,
}

fn is_device(field: &[u8]) -> bool {
    match field.iter().position(|&b| b == b',') {
        Some(comma) => {
            parse_u64(&field[..comma]).is_some() && parse_u64(&field[comma + 1..]).is_some()
        }
        None => false,
    }
}

/// The first line of blkparse's closing summary.
fn starts_summary(text: &[u8]) -> bool {
    let text = text.trim_ascii_start();
    let per_cpu = text
        .strip_prefix(b"CPU")
        .is_some_and(|rest| rest.first().is_some_and(u8::is_ascii_digit));
    per_cpu || text.starts_with(b"Total (")
}

enum RwbsOp {
    Data(Op),
    /// Discard, secure erase, flush or no data: a record, but no request.
    NoData,
}

fn rwbs_op(rwbs: &[u8]) -> Option<RwbsOp> {
    if rwbs.is_empty() || !rwbs.iter().all(u8::is_ascii_uppercase) {
        return None;
    }
    let op_letters = b"RWDNE";
    let op_letter = match rwbs {
        [b'F', next, ..] if op_letters.contains(next) => *next,
        [first, ..] => *first,
        [] => return None,
    };
    match op_letter {
        b'R' => Some(RwbsOp::Data(Op::Read)),
        b'W' => Some(RwbsOp::Data(Op::Write)),
        b'D' | b'N' | b'E' | b'F' => Some(RwbsOp::NoData),
        _ => None,
    }
}

impl LineParser for BlkparseLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let mut fields = split_whitespace(line.text);
        let device = fields.next().unwrap_or_default();
        if !is_device(device) {
            if starts_summary(line.text) {
                self.in_summary = true;
                return Ok(None);
            }
            return Err(line.error(format!(
                "expected a blkparse event line ({EVENT_FIELDS} ...), found `{}`",
                Snippet(line.text)
            )));
        }
        let mut event = [&b""[..]; 6];
        for (slot, name) in event
            .iter_mut()
            .zip(["cpu", "sequence", "time", "pid", "action", "rwbs"])
        {
            *slot = fields.next().ok_or_else(|| {
                line.error(format!(
                    "expected {EVENT_FIELDS}, found no {name} field in `{}`",
                    Snippet(line.text)
                ))
            })?;
        }
        let [cpu, sequence, time, pid, action, rwbs] = event;
        if action != self.action {
            return Ok(None);
        }
        for (field, name) in [(cpu, "cpu"), (sequence, "sequence number"), (pid, "pid")] {
            if parse_u64(field).is_none() {
                return Err(line.bad_field(name, field, "a decimal number"));
            }
        }
        let time = parse_scaled_decimal(time, NANOSECOND_DIGITS)
            .ok_or_else(|| line.bad_field("time", time, "seconds.nanoseconds"))?;
        let op = match rwbs_op(rwbs) {
            Some(RwbsOp::Data(op)) => op,
            Some(RwbsOp::NoData) => {
                self.skipped += 1;
                return Ok(None);
            }
            None => {
                return Err(line.bad_field(
                    "RWBS field",
                    rwbs,
                    "letters such as R, W, D, N, F, S, M, A with the operation R or W first (after an optional F)",
                ))
            }
        };
        let (sector, plus, count) = (fields.next(), fields.next(), fields.next());
        let (Some(sector), Some(b"+"), Some(count)) = (sector, plus, count) else {
            // An empty write with a pre-flush (`Q FWS [jbd2]`, `C FWS 0 [0]`) is a flush.
            if rwbs.starts_with(b"F") {
                self.skipped += 1;
                return Ok(None);
            }
            return Err(line.error(format!(
                "expected `sector + sectors` after the RWBS field of a read or write, found `{}`",
                Snippet(line.text)
            )));
        };
        let sector = parse_u64(sector)
            .ok_or_else(|| line.bad_field("sector", sector, "a decimal 512-byte sector number"))?;
        let count = parse_u64(count).ok_or_else(|| {
            line.bad_field("sector count", count, "a decimal count of 512-byte sectors")
        })?;
        let offset = line.to_bytes(sector, SECTOR, "sector")?;
        let len = line.to_bytes(count, SECTOR, "sector count")?;
        let volume = self.volumes.id(device, line)?;
        let time_ns = self.clock.since_first(time);
        line.request(time_ns, volume, op, offset, len)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }

    fn skipped(&self) -> u64 {
        self.skipped
    }

    fn at_end(&self) -> bool {
        self.in_summary
    }
}
