//! VMware vscsi traces (the CloudPhysics traces of the SHARDS paper), the binary format
//! libCacheSim reads (`traceReader/customizedReader/vscsi.h`): packed little-endian records of
//! one of two versions, the same for the whole file.
//!
//! ```text
//! version 1, 32 bytes: u32 sn, u32 len, u32 nSG, u16 cmd, u16 ver, u64 lbn, u64 ts
//! version 2, 40 bytes: u16 cmd, u16 ver, u32 sn, u32 len, u32 nSG, u64 lbn, u64 ts, u64 rt
//! ```
//!
//! `ver >> 8` is the version (1 or 2) in every record; like libCacheSim the version is taken
//! from the first two records, trying 2 first, and here every later record must carry it too.
//! `cmd` is the SCSI opcode (read: 0x08, 0x28, 0xa8, 0x88; write: 0x0a, 0x2a, 0xaa, 0x8a; any
//! other command is a skipped record), `len` bytes, `lbn` the 512-byte logical block number,
//! `ts` microseconds. `sn` (sequence number), `nSG` (scatter-gather segments) and `rt`
//! (response time) are ignored. One volume.

use std::io::BufRead;
use std::sync::Arc;

use super::input::{checked_request, to_bytes, Clock, ErrorContext, Records};
use super::{Op, Parser, Request, TraceError};

const SECTOR: u64 = 512;
const MICROSECOND_NS: u64 = 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

impl Version {
    fn record_bytes(self) -> usize {
        match self {
            Version::V1 => 32,
            Version::V2 => 40,
        }
    }

    /// Where the `ver` field sits in a record of this version.
    fn version_field(self) -> usize {
        match self {
            Version::V1 => 14,
            Version::V2 => 2,
        }
    }

    fn number(self) -> u16 {
        match self {
            Version::V1 => 1,
            Version::V2 => 2,
        }
    }

    /// True when the record at `index` in `bytes` exists and carries this version (a missing
    /// second record does not count against it).
    fn marks_record(self, bytes: &[u8], index: usize) -> bool {
        let at = index * self.record_bytes() + self.version_field();
        match bytes.get(at..at + 2) {
            Some(field) => u16::from_le_bytes([field[0], field[1]]) >> 8 == self.number(),
            None => index > 0 && bytes.len() < (index + 1) * self.record_bytes(),
        }
    }

    /// libCacheSim's test: the first two records carry version 2, else version 1.
    fn detect(first_bytes: &[u8]) -> Option<Version> {
        [Version::V2, Version::V1].into_iter().find(|version| {
            version.marks_record(first_bytes, 0) && version.marks_record(first_bytes, 1)
        })
    }
}

/// The operation of a SCSI opcode, `None` for commands that are neither a read nor a write.
pub(crate) fn scsi_op(opcode: u64) -> Option<Op> {
    match opcode {
        0x08 | 0x28 | 0xa8 | 0x88 => Some(Op::Read),
        0x0a | 0x2a | 0xaa | 0x8a => Some(Op::Write),
        _ => None,
    }
}

pub(crate) fn reader(
    ctx: Arc<ErrorContext>,
    input: Box<dyn BufRead + Send>,
    first_bytes: &[u8],
) -> Result<Box<dyn Parser>, TraceError> {
    let version = Version::detect(first_bytes).ok_or_else(|| {
        ctx.record_error(
            0,
            format!(
                "not a vscsi trace: the first records carry neither version 1 (byte 15 = 0x01) nor version 2 (byte 3 = 0x02), found bytes 3 = {:#04x}, 15 = {:#04x}",
                first_bytes.get(3).copied().unwrap_or(0),
                first_bytes.get(15).copied().unwrap_or(0)
            ),
        )
    })?;
    Ok(Box::new(VscsiReader {
        records: Records::new(ctx, input),
        version,
        clock: Clock::default(),
        skipped: 0,
    }))
}

struct VscsiReader {
    records: Records,
    version: Version,
    clock: Clock,
    skipped: u64,
}

struct Fields {
    cmd: u16,
    version: u16,
    len: u32,
    lbn: u64,
    ts: u64,
}

fn u16_at(record: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([record[at], record[at + 1]])
}

fn u32_at(record: &[u8], at: usize) -> u32 {
    let mut bytes = [0; 4];
    bytes.copy_from_slice(&record[at..at + 4]);
    u32::from_le_bytes(bytes)
}

fn u64_at(record: &[u8], at: usize) -> u64 {
    let mut bytes = [0; 8];
    bytes.copy_from_slice(&record[at..at + 8]);
    u64::from_le_bytes(bytes)
}

impl Version {
    fn fields(self, record: &[u8]) -> Fields {
        match self {
            Version::V1 => Fields {
                len: u32_at(record, 4),
                cmd: u16_at(record, 12),
                version: u16_at(record, 14),
                lbn: u64_at(record, 16),
                ts: u64_at(record, 24),
            },
            Version::V2 => Fields {
                cmd: u16_at(record, 0),
                version: u16_at(record, 2),
                len: u32_at(record, 8),
                lbn: u64_at(record, 16),
                ts: u64_at(record, 24),
            },
        }
    }
}

impl Parser for VscsiReader {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let mut record = [0u8; 40];
        let record = &mut record[..self.version.record_bytes()];
        loop {
            let Some(at) = self.records.next_record(record, "vscsi record")? else {
                return Ok(None);
            };
            let fields = self.version.fields(record);
            if fields.version >> 8 != self.version.number() {
                return Err(self.records.ctx.record_error(
                    at,
                    format!(
                        "expected a vscsi version {} record (ver field {:#06x}), found ver field {:#06x}: corrupt, or records of another size",
                        self.version.number(),
                        self.version.number() << 8,
                        fields.version
                    ),
                ));
            }
            let Some(op) = scsi_op(u64::from(fields.cmd)) else {
                self.skipped += 1;
                continue;
            };
            let time_ns = self
                .clock
                .since_first(fields.ts)
                .saturating_mul(MICROSECOND_NS);
            let offset = to_bytes(fields.lbn, SECTOR, "lbn")
                .map_err(|m| self.records.ctx.record_error(at, m))?;
            return checked_request(time_ns, 0, op, offset, u64::from(fields.len))
                .map(Some)
                .map_err(|message| self.records.ctx.record_error(at, message));
        }
    }

    fn skipped(&self) -> u64 {
        self.skipped
    }
}
