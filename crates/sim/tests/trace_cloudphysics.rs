//! The four representations of the CloudPhysics trace in shared/traces: how their per-4KiB-block
//! reference sequences relate.
//!
//! - csv (`vscsi-csv`) and `.vscsi`: the same requests, operation included, and so the same
//!   block sequence; the csv's time is whole seconds, the binary's microseconds.
//! - `.oracleGeneral.bin`: `obj_id` is the csv's `lbn` (so offsets agree with `obj_id × 512`),
//!   but libCacheSim's converter gave every record of an object the size of its first record;
//!   13,671 of 113,872 records are smaller (or larger) than the request was, so its block
//!   sequence is the csv's with each request cut (or stretched) to the first size of its lbn,
//!   not the csv's own. It has no operations: everything is a read.
//! - `.txt` (`sector-list`): only the lbn of each request; read as one 512-byte sector per line
//!   it gives the first block of every csv request, not the blocks after the first.

mod common;

use std::collections::HashMap;

use common::{block_sequence, read_all, shared};
use ssdcache_sim::trace::{Format, Op, Request};

/// The requests of `file` in shared/traces/cloudphysics read as `format`.
fn cloudphysics(file: &str, format: Format) -> Vec<Request> {
    read_all(&shared(&format!("cloudphysics/{file}")), format).requests
}

fn csv() -> Vec<Request> {
    cloudphysics("cloudPhysicsIO.csv", Format::VscsiCsv)
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn vscsi_and_csv_are_the_same_requests() {
    let csv = csv();
    let vscsi = cloudphysics("cloudPhysicsIO.vscsi", Format::Vscsi);
    assert_eq!(vscsi.len(), csv.len());
    for (index, (binary, text)) in vscsi.iter().zip(&csv).enumerate() {
        assert_eq!(
            (binary.op, binary.offset, binary.len),
            (text.op, text.offset, text.len),
            "request {index}"
        );
        assert!(
            binary.time_ns.abs_diff(text.time_ns) < 1_000_000_000,
            "request {index}: times more than a second apart"
        );
    }
    assert_eq!(block_sequence(&vscsi), block_sequence(&csv));
    let writes = csv.iter().filter(|r| r.op == Op::Write).count();
    assert_eq!(
        writes, 66_898,
        "cut -d, -f3 cloudPhysicsIO.csv | sort | uniq -c"
    );
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn oracle_general_is_the_csv_with_each_object_keeping_its_first_size() {
    let csv = csv();
    let oracle = cloudphysics("cloudPhysicsIO.oracleGeneral.bin", Format::OracleGeneral);
    assert_eq!(oracle.len(), csv.len());
    let mut first_size: HashMap<u64, u64> = HashMap::new();
    let mut resized = 0;
    let mut csv_cut_to_first_size = Vec::with_capacity(csv.len());
    for (index, (object, request)) in oracle.iter().zip(&csv).enumerate() {
        assert_eq!(
            object.offset, request.offset,
            "record {index}: obj_id × 512 is the lbn's offset"
        );
        assert_eq!(object.op, Op::Read);
        let size = *first_size.entry(request.offset).or_insert(request.len);
        assert_eq!(
            object.len, size,
            "record {index}: size of the object's first record"
        );
        resized += usize::from(object.len != request.len);
        csv_cut_to_first_size.push(Request {
            len: size,
            ..*request
        });
    }
    assert_eq!(resized, 13_671);
    let oracle_blocks = block_sequence(&oracle);
    assert_ne!(oracle_blocks, block_sequence(&csv));
    assert_eq!(oracle_blocks, block_sequence(&csv_cut_to_first_size));
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn txt_is_the_first_sector_of_every_csv_request() {
    let csv = csv();
    let txt = cloudphysics("cloudPhysicsIO.txt", Format::SectorList);
    assert_eq!(txt.len(), csv.len());
    let first_blocks: Vec<u64> = csv.iter().map(|r| r.offset / 4096).collect();
    assert_eq!(block_sequence(&txt), first_blocks);
    let multi_block = csv
        .iter()
        .filter(|r| (r.offset + r.len - 1) / 4096 != r.offset / 4096)
        .count();
    assert!(
        multi_block > 0,
        "the csv has requests spanning blocks, which the txt cannot show"
    );
}
