//! ARC traces (Megiddo & Modha, FAST'03), `.lis` text: `start_block nblocks ignored request_number`
//! per line, whitespace-separated, e.g. `230027 8 0 0`. Blocks are 512-byte sectors; every
//! request is a read (the paper kept only reads); there is no time and one volume. The third
//! and fourth fields are ignored.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{
    parse_u64, split_whitespace_exact, ErrorContext, Line, LineParser, Lines, TextReader,
};
use super::{Op, Parser, Request, TraceError};

const SECTOR: u64 = 512;

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(Lines::new(ctx, input), ArcLines)
}

struct ArcLines;

impl LineParser for ArcLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let [start, count, _ignored, _request_number] = split_whitespace_exact::<4>(line.text)
            .map_err(|found| {
                line.error(format!(
                    "expected 4 whitespace-separated fields (start_block nblocks ignored request_number) of an ARC trace, found {found}"
                ))
            })?;
        let start = parse_u64(start).ok_or_else(|| {
            line.bad_field("start block", start, "a decimal 512-byte sector number")
        })?;
        let count = parse_u64(count).ok_or_else(|| {
            line.bad_field("block count", count, "a decimal count of 512-byte sectors")
        })?;
        let offset = line.to_bytes(start, SECTOR, "start block")?;
        let len = line.to_bytes(count, SECTOR, "block count")?;
        line.request(0, 0, Op::Read, offset, len)
    }
}
