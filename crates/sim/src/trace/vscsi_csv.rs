//! libCacheSim's csv dump of a VMware vscsi trace (cloudPhysicsIO.csv): the header line
//! `version,time,op,size,lbn`, then e.g. `1,5633898,2a,512,42932745`. `time` is in seconds
//! (the binary trace's microseconds divided by 10^6, as libCacheSim reads them), `op` the SCSI
//! opcode in hex (read: 08, 28, a8, 88; write: 0a, 2a, aa, 8a; other commands are skipped
//! records), `size` bytes and `lbn` the 512-byte logical block number. One volume. The
//! `version` field (the vscsi record version) must be 1 or 2 and is otherwise ignored; the
//! header is optional.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{
    parse_hex_u64, parse_scaled_decimal, parse_u64, split_exact, trim, Clock, ErrorContext, Line,
    LineParser, Lines, TextReader,
};
use super::vscsi::scsi_op;
use super::{Parser, Request, TraceError};

const HEADER: &[u8] = b"version,time,op,size,lbn";
const SECTOR: u64 = 512;
const NANOSECOND_DIGITS: u32 = 9;

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(Lines::new(ctx, input), VscsiCsvLines::default())
}

#[derive(Default)]
struct VscsiCsvLines {
    clock: Clock,
    skipped: u64,
}

impl LineParser for VscsiCsvLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        if line.is_header(HEADER) {
            return Ok(None);
        }
        let [version, time, opcode, size, lbn] = split_exact::<5>(line.text, b',')
            .map_err(|found| {
                line.error(format!(
                    "expected 5 comma-separated fields (version,time,op,size,lbn) of a vscsi csv trace, found {found}"
                ))
            })?;
        if !matches!(parse_u64(trim(version)), Some(1 | 2)) {
            return Err(line.bad_field("version", version, "the vscsi record version, 1 or 2"));
        }
        let time = parse_scaled_decimal(trim(time), NANOSECOND_DIGITS)
            .ok_or_else(|| line.bad_field("time", time, "decimal seconds"))?;
        let opcode = parse_hex_u64(trim(opcode)).ok_or_else(|| {
            line.bad_field("op", opcode, "a hexadecimal SCSI opcode such as 28 or 2a")
        })?;
        let size = parse_u64(trim(size))
            .ok_or_else(|| line.bad_field("size", size, "a decimal byte count"))?;
        let lbn = parse_u64(trim(lbn))
            .ok_or_else(|| line.bad_field("lbn", lbn, "a decimal 512-byte block number"))?;
        let Some(op) = scsi_op(opcode) else {
            self.skipped += 1;
            return Ok(None);
        };
        let time_ns = self.clock.since_first(time);
        let offset = line.to_bytes(lbn, SECTOR, "lbn")?;
        line.request(time_ns, 0, op, offset, size)
    }

    fn skipped(&self) -> u64 {
        self.skipped
    }
}
