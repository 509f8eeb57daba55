//! MSR Cambridge block traces (SNIA IOTTA), csv without a header:
//! `timestamp,host,disk,type,offset,size,response_time`, e.g.
//! `128166385295514663,hm,0,Write,9056014336,2048,2833`. The timestamp counts 100 ns ticks
//! (Windows FILETIME); type is `Read` or `Write`; offset and size are bytes. Each `host,disk`
//! pair is a volume, named `host_disk` (`hm_0`). The response time is ignored.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{
    parse_u64, position_in, split_exact, trim, Clock, ErrorContext, Line, LineParser, Lines,
    TextReader, VolumeTable,
};
use super::{Op, Parser, Request, TraceError};

const FIELDS: &str = "timestamp,host,disk,type,offset,size,response_time";
const TICK_NS: u64 = 100;

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(
        Lines::new(ctx, input),
        MsrLines {
            volumes: VolumeTable::with_display(host_disk_name),
            clock: Clock::default(),
        },
    )
}

struct MsrLines {
    volumes: VolumeTable,
    clock: Clock,
}

impl LineParser for MsrLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let [timestamp, host, disk, kind, offset, size, _response] =
            split_exact::<7>(line.text, b',').map_err(|found| {
                line.error(format!(
                    "expected 7 comma-separated fields ({FIELDS}) of an MSR Cambridge trace, found {found}"
                ))
            })?;
        let timestamp = parse_u64(trim(timestamp)).ok_or_else(|| {
            line.bad_field("timestamp", timestamp, "a decimal count of 100 ns ticks")
        })?;
        if parse_u64(trim(disk)).is_none() {
            return Err(line.bad_field("disk", disk, "a decimal disk number"));
        }
        let op = match trim(kind) {
            b"Read" | b"read" => Op::Read,
            b"Write" | b"write" => Op::Write,
            other => return Err(line.bad_field("type", other, "`Read` or `Write`")),
        };
        let offset = parse_u64(trim(offset))
            .ok_or_else(|| line.bad_field("offset", offset, "a decimal byte offset"))?;
        let size = parse_u64(trim(size))
            .ok_or_else(|| line.bad_field("size", size, "a decimal byte count"))?;
        // `host,disk` as it stands in the line is the key; the name shows it as `host_disk`.
        let name_start = position_in(line.text, host);
        let name_end = position_in(line.text, disk) + disk.len();
        let volume = self.volumes.id(&line.text[name_start..name_end], line)?;
        let time_ns = self.clock.since_first(timestamp).saturating_mul(TICK_NS);
        line.request(time_ns, volume, op, offset, size)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }
}

/// `hm,0` → `hm_0`, the name the MSR traces go by.
fn host_disk_name(key: &[u8]) -> String {
    String::from_utf8_lossy(key).replacen(',', "_", 1)
}
