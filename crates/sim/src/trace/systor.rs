//! SYSTOR'17 VDI traces (SNIA IOTTA, Lee et al., SYSTOR'17), csv with the header line
//! `Timestamp,Response,IOType,LUN,Offset,Size`, e.g.
//! `1455591804.310701000,0.006475000,R,0,203468398592,32768`. The timestamp is in seconds with
//! a fraction (Unix time); IOType is `R` or `W`; offset and size are bytes; each LUN is a
//! volume. The response time is ignored and may be empty (it is in some of the files). The
//! header is optional; timestamps are not always sorted.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{
    parse_scaled_decimal, parse_u64, split_exact, trim, Clock, ErrorContext, Line, LineParser,
    Lines, TextReader, VolumeTable,
};
use super::{Op, Parser, Request, TraceError};

const HEADER: &[u8] = b"Timestamp,Response,IOType,LUN,Offset,Size";
const NANOSECOND_DIGITS: u32 = 9;

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(Lines::new(ctx, input), SystorLines::default())
}

#[derive(Default)]
struct SystorLines {
    volumes: VolumeTable,
    clock: Clock,
}

impl LineParser for SystorLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        if line.is_header(HEADER) {
            return Ok(None);
        }
        let [timestamp, response, io_type, lun, offset, size] =
            split_exact::<6>(line.text, b',').map_err(|found| {
                line.error(format!(
                    "expected 6 comma-separated fields (Timestamp,Response,IOType,LUN,Offset,Size) of a SYSTOR'17 trace, found {found}"
                ))
            })?;
        let timestamp = parse_scaled_decimal(trim(timestamp), NANOSECOND_DIGITS)
            .ok_or_else(|| line.bad_field("Timestamp", timestamp, "decimal seconds"))?;
        let response = trim(response);
        if !response.is_empty() && parse_scaled_decimal(response, NANOSECOND_DIGITS).is_none() {
            return Err(line.bad_field("Response", response, "decimal seconds or nothing"));
        }
        let op = match trim(io_type) {
            b"R" | b"r" => Op::Read,
            b"W" | b"w" => Op::Write,
            other => return Err(line.bad_field("IOType", other, "`R` or `W`")),
        };
        let lun = trim(lun);
        if parse_u64(lun).is_none() {
            return Err(line.bad_field("LUN", lun, "a decimal LUN number"));
        }
        let offset = parse_u64(trim(offset))
            .ok_or_else(|| line.bad_field("Offset", offset, "a decimal byte offset"))?;
        let size = parse_u64(trim(size))
            .ok_or_else(|| line.bad_field("Size", size, "a decimal byte count"))?;
        let volume = self.volumes.id(lun, line)?;
        let time_ns = self.clock.since_first(timestamp);
        line.request(time_ns, volume, op, offset, size)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }
}
