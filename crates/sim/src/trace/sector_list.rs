//! One 512-byte sector number (LBN) per line, e.g. `42932745`: libCacheSim's `txt` traces of
//! block devices (cloudPhysicsIO.txt). Each line is one 512-byte read of that sector: the file
//! keeps neither the request sizes nor the operations nor the time of the trace it was made
//! from. One volume. Blank lines are skipped.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{parse_u64, ErrorContext, Line, LineParser, Lines, TextReader};
use super::{Op, Parser, Request, TraceError};

const SECTOR: u64 = 512;

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(
        Lines::new(ctx, input),
        NumberPerLine {
            unit: SECTOR,
            expected: "a decimal 512-byte sector number (one per line)",
            breakpoints: false,
        },
    )
}

/// A trace of one number per line, each a read of `unit` bytes at `number * unit`.
pub(crate) struct NumberPerLine {
    pub unit: u64,
    pub expected: &'static str,
    /// Skip lines that are just `*` (breakpoints of the LIRS simulator).
    pub breakpoints: bool,
}

impl LineParser for NumberPerLine {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let text = line.text.trim_ascii();
        if self.breakpoints && text == b"*" {
            return Ok(None);
        }
        let number = parse_u64(text).ok_or_else(|| line.bad_field("line", text, self.expected))?;
        let offset = line.to_bytes(number, self.unit, "block")?;
        line.request(0, 0, Op::Read, offset, self.unit)
    }
}
