//! libCacheSim's oracleGeneral binary traces: packed little-endian 24-byte records
//! `u32 timestamp, u64 obj_id, u32 obj_size, i64 next_access_vtime`.
//!
//! Each record is one read of `obj_size` bytes at `obj_id * unit`, where `unit`
//! ([`super::OpenOptions::oracle_general_id_unit`]) is 512 by default: libCacheSim's block
//! traces keep the 512-byte logical block number as the object id (cloudPhysicsIO's obj_id is
//! exactly the csv's `lbn`). The timestamp is in seconds. `next_access_vtime` (the 1-based
//! number of the object's next record, -1 for none) is ignored by the reader; the
//! format has no operation (every request is a read) and one volume. Object ids of key-value
//! traces are hashes; `obj_id * unit` beyond 128 PiB is refused as not a block trace.
//!
//! Per request the bytes touched are not always those of the trace it was converted from:
//! libCacheSim's converter gives every record of an object the size of the object's first
//! record (it removes size changes), so a later, larger request to the same `lbn` is cut to
//! that first size (13,671 of cloudPhysicsIO's 113,872 records).

use std::io::BufRead;
use std::sync::Arc;

use super::input::{checked_request, to_bytes, Clock, ErrorContext, Records};
use super::{Op, Parser, Request, TraceError};

pub(crate) const RECORD_BYTES: usize = 24;
const SECOND_NS: u64 = 1_000_000_000;

pub(crate) fn reader(
    ctx: Arc<ErrorContext>,
    input: Box<dyn BufRead + Send>,
    id_unit: u64,
) -> Box<dyn Parser> {
    Box::new(OracleGeneralReader {
        records: Records::new(ctx, input),
        id_unit,
        clock: Clock::default(),
    })
}

struct OracleGeneralReader {
    records: Records,
    id_unit: u64,
    clock: Clock,
}

/// The fields of one record that become the request.
pub(crate) struct OracleRecord {
    pub timestamp: u32,
    pub obj_id: u64,
    pub obj_size: u32,
    pub next_access_vtime: i64,
}

pub(crate) fn decode(record: &[u8; RECORD_BYTES]) -> OracleRecord {
    let mut timestamp = [0; 4];
    let mut obj_id = [0; 8];
    let mut obj_size = [0; 4];
    let mut next = [0; 8];
    timestamp.copy_from_slice(&record[0..4]);
    obj_id.copy_from_slice(&record[4..12]);
    obj_size.copy_from_slice(&record[12..16]);
    next.copy_from_slice(&record[16..24]);
    OracleRecord {
        timestamp: u32::from_le_bytes(timestamp),
        obj_id: u64::from_le_bytes(obj_id),
        obj_size: u32::from_le_bytes(obj_size),
        next_access_vtime: i64::from_le_bytes(next),
    }
}

impl Parser for OracleGeneralReader {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let mut record = [0u8; RECORD_BYTES];
        let Some(at) = self
            .records
            .next_record(&mut record, "oracleGeneral record")?
        else {
            return Ok(None);
        };
        let fields = decode(&record);
        let time_ns = self
            .clock
            .since_first(u64::from(fields.timestamp))
            .saturating_mul(SECOND_NS);
        let ctx = &self.records.ctx;
        let not_a_block = |message: String| {
            ctx.record_error(
                at,
                format!(
                    "{message}: obj_id {} is not a block number of a block trace",
                    fields.obj_id
                ),
            )
        };
        let offset = to_bytes(fields.obj_id, self.id_unit, "obj_id").map_err(not_a_block)?;
        checked_request(time_ns, 0, Op::Read, offset, u64::from(fields.obj_size))
            .map(Some)
            .map_err(not_a_block)
    }
}
