//! Tencent Cloud Block Storage traces (SNIA IOTTA, Zhang et al., ATC'20), csv without a header:
//! `timestamp,offset,size,io_type,volume_id`, e.g. `1538323200,4247200,128,1,1058`. The
//! timestamp is in seconds (Unix time); offset and size count 512-byte sectors; io_type is `0`
//! for a read and `1` for a write; each volume id is a volume.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{
    parse_u64, split_exact, trim, Clock, ErrorContext, Line, LineParser, Lines, TextReader,
    VolumeTable,
};
use super::{Op, Parser, Request, TraceError};

const SECTOR: u64 = 512;
const SECOND_NS: u64 = 1_000_000_000;
const FIELDS: &str = "timestamp,offset,size,io_type,volume_id";

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(Lines::new(ctx, input), TencentLines::default())
}

#[derive(Default)]
struct TencentLines {
    volumes: VolumeTable,
    clock: Clock,
}

impl LineParser for TencentLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let [timestamp, offset, size, io_type, volume] = split_exact::<5>(line.text, b',')
            .map_err(|found| {
                line.error(format!(
                    "expected 5 comma-separated fields ({FIELDS}) of a Tencent CBS trace, found {found}"
                ))
            })?;
        let timestamp = parse_u64(trim(timestamp))
            .ok_or_else(|| line.bad_field("timestamp", timestamp, "decimal seconds"))?;
        let offset = parse_u64(trim(offset))
            .ok_or_else(|| line.bad_field("offset", offset, "a decimal 512-byte sector number"))?;
        let size = parse_u64(trim(size))
            .ok_or_else(|| line.bad_field("size", size, "a decimal count of 512-byte sectors"))?;
        let op = match trim(io_type) {
            b"0" => Op::Read,
            b"1" => Op::Write,
            other => return Err(line.bad_field("io_type", other, "0 (read) or 1 (write)")),
        };
        let volume = trim(volume);
        if parse_u64(volume).is_none() {
            return Err(line.bad_field("volume_id", volume, "a decimal volume id"));
        }
        let volume = self.volumes.id(volume, line)?;
        let offset = line.to_bytes(offset, SECTOR, "offset")?;
        let len = line.to_bytes(size, SECTOR, "size")?;
        let time_ns = self.clock.since_first(timestamp).saturating_mul(SECOND_NS);
        line.request(time_ns, volume, op, offset, len)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }
}
