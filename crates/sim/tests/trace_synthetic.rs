//! Every format at the scale of a real trace, without the shared traces (a clone of the
//! repository alone runs this; `trace_shared.rs` and `trace_cloudphysics.rs` read the real
//! files when `SSDCACHE_TRACES` is set): the synthetic `phases` trace (its first 50,000
//! requests, 55% writes, 4 to 32 KiB) written in each format, compressed in turn with each
//! compression (and once plain), is read back whole with the operation, offset and length of
//! every request it can carry, on one volume, nothing skipped but fio's `add`; `auto` tells
//! each format (of the two whose files are one number per line, either). As with the
//! CloudPhysics files, the vscsi binary, its csv and the oracleGeneral records of the whole
//! trace give the same 4 KiB block sequence, and a sector list the first block of each
//! request.

mod common;

use common::codec::CODECS;
use common::synthetic::{self, encode, SectorRequest};
use common::{block_sequence, one_number_per_line, read_all, write_file};
use ssdcache_sim::trace::{self, Format, Op, Request};

/// What a file of `format` holding `requests` gives back: (operation, offset, length).
fn expected(format: Format, requests: &[SectorRequest]) -> Vec<(Op, u64, u64)> {
    let op = |r: &SectorRequest| match format {
        Format::Arc | Format::OracleGeneral | Format::SectorList | Format::Lirs => Op::Read,
        _ if r.write => Op::Write,
        _ => Op::Read,
    };
    match format {
        Format::SectorList => requests
            .iter()
            .map(|r| (Op::Read, r.offset(), 512))
            .collect(),
        Format::Lirs => requests
            .iter()
            .flat_map(|r| r.offset() / 4096..=(r.offset() + r.len() - 1) / 4096)
            .map(|block| (Op::Read, block * 4096, 4096))
            .collect(),
        _ => requests
            .iter()
            .map(|r| (op(r), r.offset(), r.len()))
            .collect(),
    }
}

fn carried(requests: &[Request]) -> Vec<(Op, u64, u64)> {
    requests.iter().map(|r| (r.op, r.offset, r.len)).collect()
}

#[test]
fn every_format_reads_the_whole_synthetic_trace_compressed_or_not() {
    let mut requests = synthetic::named("phases.csv").requests;
    // Two phases: compressing the whole trace in every format takes half a minute.
    requests.truncate(50_000);
    let dir = tempfile::tempdir().unwrap();
    for (index, format) in Format::ALL.into_iter().enumerate() {
        let plain = encode(format, &requests);
        // Each format once with one of the compressions, in turn, and the first one plain.
        let (name, bytes) = match index.checked_sub(1).map(|i| CODECS[i % CODECS.len()]) {
            None => (format!("{format}.trace"), plain),
            Some(codec) => (
                format!("{format}.trace.{}", codec.extension()),
                codec.compress(&plain),
            ),
        };
        let path = write_file(&dir, &name, &bytes);
        let read = read_all(&path, format);
        assert_eq!(
            carried(&read.requests),
            expected(format, &requests),
            "{name}"
        );
        assert!(
            read.requests.iter().all(|r| r.volume == 0),
            "{name}: one volume"
        );
        // fio's `add` line is a record that is no request.
        let skipped = u64::from(format == Format::FioIolog);
        assert_eq!(read.trace.skipped_records(), skipped, "{name}");
        assert_eq!(read.trace.info().format, format, "{name}");
        // Files of one number per line are either format: auto picks one or asks.
        match trace::open(&path, Format::Auto) {
            Ok(detected) if one_number_per_line(format) => {
                assert!(
                    one_number_per_line(detected.info().format),
                    "auto on {name}"
                )
            }
            Ok(detected) => assert_eq!(detected.info().format, format, "auto on {name}"),
            Err(e) => assert!(one_number_per_line(format), "auto on {name} failed: {e}"),
        }
    }
}

#[test]
fn vscsi_its_csv_and_oracle_general_give_the_same_blocks_and_a_sector_list_the_first_ones() {
    let requests = synthetic::named("phases.csv").requests;
    let dir = tempfile::tempdir().unwrap();
    let read = |format: Format, name: &str| {
        let path = write_file(&dir, name, &encode(format, &requests));
        read_all(&path, format).requests
    };
    let csv = read(Format::VscsiCsv, "phases.csv");
    let vscsi = read(Format::Vscsi, "phases.vscsi");
    let oracle = read(Format::OracleGeneral, "phases.oracleGeneral.bin");
    let sectors = read(Format::SectorList, "phases.txt");
    assert_eq!(csv.len(), requests.len());
    assert_eq!(carried(&vscsi), carried(&csv));
    let blocks = block_sequence(&csv);
    assert!(blocks.len() > csv.len(), "requests span several blocks");
    assert_eq!(block_sequence(&vscsi), blocks);
    assert_eq!(block_sequence(&oracle), blocks);
    let first_blocks: Vec<u64> = csv.iter().map(|r| r.offset / 4096).collect();
    assert_eq!(block_sequence(&sectors), first_blocks);
    let writes = csv.iter().filter(|r| r.op == Op::Write).count();
    assert_eq!(writes, requests.iter().filter(|r| r.write).count());
}
