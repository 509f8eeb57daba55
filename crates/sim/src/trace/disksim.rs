//! DiskSim ASCII traces, as MQSim ships them (mqsim/*.trace): five whitespace-separated fields
//! `arrival_time device start_sector sector_count flags`, e.g. `938513000 4 264719034 16 0`.
//! Sectors are 512 bytes. Bit 0 of `flags` is 1 for a read and 0 for a write (DiskSim's
//! definition; MQSim writes only 1 and 0); the other flag bits are ignored. Each device number
//! is a volume. The time is an integer in nanoseconds as MQSim writes it; a time with a
//! decimal point is DiskSim's own unit, milliseconds (`12.5` is 12.5 ms).

use std::io::BufRead;
use std::sync::Arc;

use super::input::{
    parse_scaled_decimal, parse_u64, split_whitespace_exact, Clock, ErrorContext, Line, LineParser,
    Lines, TextReader, VolumeTable,
};
use super::{Op, Parser, Request, TraceError};

const SECTOR: u64 = 512;
const FIELDS: &str = "arrival_time device start_sector sector_count flags";

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(Lines::new(ctx, input), DisksimLines::default())
}

#[derive(Default)]
struct DisksimLines {
    volumes: VolumeTable,
    clock: Clock,
}

/// Nanoseconds from an integer (ns, MQSim) or a decimal (ms, DiskSim).
fn parse_time_ns(field: &[u8]) -> Option<u64> {
    if field.contains(&b'.') {
        parse_scaled_decimal(field, 6)
    } else {
        parse_u64(field)
    }
}

impl LineParser for DisksimLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let [time, device, start, count, flags] = split_whitespace_exact::<5>(line.text)
            .map_err(|found| {
                line.error(format!(
                    "expected 5 whitespace-separated fields ({FIELDS}) of a DiskSim trace, found {found}"
                ))
            })?;
        let time = parse_time_ns(time).ok_or_else(|| {
            line.bad_field(
                "arrival time",
                time,
                "integer nanoseconds or decimal milliseconds",
            )
        })?;
        if parse_u64(device).is_none() {
            return Err(line.bad_field("device", device, "a decimal device number"));
        }
        let start = parse_u64(start).ok_or_else(|| {
            line.bad_field("start sector", start, "a decimal 512-byte sector number")
        })?;
        let count = parse_u64(count).ok_or_else(|| {
            line.bad_field("sector count", count, "a decimal count of 512-byte sectors")
        })?;
        let flags = parse_u64(flags).ok_or_else(|| {
            line.bad_field("flags", flags, "a decimal flag word (1 = read, 0 = write)")
        })?;
        let op = if flags & 1 == 1 { Op::Read } else { Op::Write };
        let offset = line.to_bytes(start, SECTOR, "start sector")?;
        let len = line.to_bytes(count, SECTOR, "sector count")?;
        let volume = self.volumes.id(device, line)?;
        let time_ns = self.clock.since_first(time);
        line.request(time_ns, volume, op, offset, len)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }
}
