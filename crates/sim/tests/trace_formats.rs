//! Formats without a shared trace (blkparse, fio iolog, ssdcache, vscsi version 2) and the
//! corners of the others, on small files written here.

mod common;

use common::samples::{oracle_general, sample, vscsi_v2, SAMPLE_REQUESTS};
use common::{every_format, one_number_per_line, read_all, read_all_with, request, write_file};
use ssdcache_sim::trace::{self, BlkparseAction, Format, Op, OpenOptions, Request};

fn read_bytes(name: &str, bytes: &[u8], format: Format) -> (Vec<Request>, Vec<String>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, name, bytes);
    let read = read_all(&path, format);
    (
        read.requests,
        read.trace.volume_names().to_vec(),
        read.trace.skipped_records(),
    )
}

const BLKPARSE: &str = "\
  8,0    3        1     0.000000000   697  Q   R 223490 + 8 [kjournald]
  8,0    3        2     0.000001779   697  G   R 223490 + 8 [kjournald]
  8,0    3        3     0.000003023   697  P   N [kjournald]
  8,0    3        4     0.000004365   697  I   R 223490 + 8 [kjournald]
  8,0    3        5     0.000005590   697  U   N [kjournald] 1
  8,0    3        6     0.000007145   697  D   R 223490 + 8 [kjournald]
  8,0    3        7     0.000324296     0  C   R 223490 + 8 [0]
  8,0    0        1     0.001000000  1234  Q  WS 1000 + 16 [jbd2/sda1-8]
  8,0    0        2     0.001100000  1234  Q FWFS 2000 + 8 [jbd2/sda1-8]
  8,0    0        3     0.001200000  1234  Q  FN [kworker/0:1]
  8,0    0        4     0.001300000  1234  Q   D 4096 + 2048 [fstrim]
  8,0    0        5     0.001400000  1234  Q FWS [jbd2/sda1-8]
  8,16   1        1     0.002000000   555  Q  RA 8 + 8 [dd]
  8,16   1        2     0.002100000   555  A   R 16 + 8 <- (8,17) 8
  8,0    0        6     0.003000000     0  m   N cfq1234 slice expired
  8,16   1        3     0.002500000   555  D   R 8 + 8 [dd]
  8,16   1        4     0.004000000     0  C   R 8 + 8 [0]
CPU0 (8,0):
 Reads Queued:           1,        4KiB\t Writes Queued:           2,       12KiB
 Read Dispatches:        1,        4KiB\t Write Dispatches:        0,        0KiB
Total (8,0):
 Reads Queued:           1,        4KiB\t Writes Queued:           2,       12KiB

Throughput (R/W): 0KiB/s / 0KiB/s
Events (8,0): 16 entries
Skips: 0 forward (0 -   0.0%)
";

#[test]
fn blkparse_queue_events_become_requests_and_the_summary_ends_the_trace() {
    let (requests, volumes, skipped) =
        read_bytes("sda.blkparse", BLKPARSE.as_bytes(), Format::Blkparse);
    assert_eq!(
        requests,
        vec![
            request(0, 0, Op::Read, 223_490 * 512, 8 * 512),
            request(1_000_000, 0, Op::Write, 1000 * 512, 16 * 512),
            request(1_100_000, 0, Op::Write, 2000 * 512, 8 * 512), // FWFS: pre-flush, write, FUA, sync
            request(2_000_000, 1, Op::Read, 8 * 512, 8 * 512),
        ]
    );
    assert_eq!(volumes, ["8,0", "8,16"]);
    assert_eq!(
        skipped, 3,
        "the bare flush FN, the discard D and the empty pre-flush write FWS"
    );
}

#[test]
fn blkparse_can_take_issue_or_completion_events_instead() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "sda.txt", BLKPARSE.as_bytes());
    let read_with = |action| {
        let options = OpenOptions {
            blkparse_action: action,
            ..OpenOptions::default()
        };
        read_all_with(&path, Format::Blkparse, &options).requests
    };
    let issued = read_with(BlkparseAction::Issue);
    assert_eq!(
        issued,
        vec![
            request(0, 0, Op::Read, 223_490 * 512, 4096),
            request(2_500_000 - 7_145, 1, Op::Read, 8 * 512, 4096)
        ]
    );
    let completed = read_with(BlkparseAction::Complete);
    assert_eq!(
        completed[1],
        request(4_000_000 - 324_296, 1, Op::Read, 8 * 512, 4096)
    );
    assert_eq!(
        trace::open(&path, Format::Auto).unwrap().info().format,
        Format::Blkparse
    );
}

#[test]
fn fio_iolog_v2_with_waits_in_milliseconds_since_the_start_trims_syncs_and_two_files() {
    let log = "\
fio version 2 iolog
/dev/sdb add
/dev/sdb open
/dev/sdb write 0 4096
/dev/sdb wait 500 0
/dev/sdb read 8192 512
/dev/sdb wait 200 0
/dev/sdb trim 0 1048576
/dev/sdb sync 0 0
/tmp/f add
/tmp/f open
/tmp/f read 4096 4096
/dev/sdb datasync 0 0
/tmp/f close
/dev/sdb close
";
    let (requests, volumes, skipped) = read_bytes("job.log", log.as_bytes(), Format::FioIolog);
    assert_eq!(
        requests,
        vec![
            request(0, 0, Op::Write, 0, 4096),
            // wait 500: until 500 ms after the start; the later wait 200 is already past
            request(500_000_000, 0, Op::Read, 8192, 512),
            request(500_000_000, 1, Op::Read, 4096, 4096),
        ]
    );
    assert_eq!(volumes, ["/dev/sdb", "/tmp/f"]);
    assert_eq!(skipped, 11);
}

#[test]
fn fio_iolog_v3_takes_its_timestamps_in_microseconds() {
    let (requests, volumes, skipped) =
        read_bytes("job.iolog", &sample(Format::FioIolog), Format::Auto);
    assert_eq!(
        requests,
        vec![
            request(0, 0, Op::Read, 0, 4096),
            request(15_000, 0, Op::Write, 8192, 4096),
            request(30_000, 0, Op::Read, 4096, 512),
        ]
    );
    assert_eq!(volumes, ["/dev/sdb"]);
    assert_eq!(skipped, 1);
}

#[test]
fn ssdcache_reads_its_header_settings_volumes_and_comments() {
    let text = "\
# ssdcache-trace v1
# sample_rate=0.01 sample_region=1048576 future_key=whatever
# time_us,volume,op,offset,length
1000,sdb,R,0,4096

1012,sdb,W,1048576,65536
# a comment after the first request: sample_rate=0.5 is not a setting here
1020,/dev/mapper/vg-home,R,8192,0
999,sdb,W,512,512
";
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "rec.trace", text.as_bytes());
    let mut trace = trace::open(&path, Format::Auto).unwrap();
    assert_eq!(trace.info().format, Format::Ssdcache);
    assert_eq!(trace.info().sample_rate, 0.01);
    assert_eq!(trace.info().sample_region, Some(1_048_576));
    let requests: Vec<Request> = trace.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(
        requests,
        vec![
            request(0, 0, Op::Read, 0, 4096),
            request(12_000, 0, Op::Write, 1_048_576, 65_536),
            request(20_000, 1, Op::Read, 8192, 0),
            request(0, 0, Op::Write, 512, 512), // before the first request: 0
        ]
    );
    assert_eq!(trace.volume_names(), ["sdb", "/dev/mapper/vg-home"]);
}

#[test]
fn ssdcache_without_settings_covers_everything_and_may_have_no_requests() {
    let (requests, _, _) = read_bytes("empty.trace", b"# ssdcache-trace v1\n", Format::Ssdcache);
    assert!(requests.is_empty());
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "t", &sample(Format::Ssdcache));
    let trace = trace::open(&path, Format::Ssdcache).unwrap();
    assert_eq!(trace.info().sample_rate, 0.25);
}

#[test]
fn vscsi_version_2_records() {
    let bytes = vscsi_v2(&[
        (0x28, 100, 4096, 5_000_000),
        (0x35, 0, 0, 5_000_010),
        (0x8a, 200, 512, 5_000_020),
    ]);
    let (requests, _, skipped) = read_bytes("x.vscsi", &bytes, Format::Auto);
    assert_eq!(
        requests,
        vec![
            request(0, 0, Op::Read, 100 * 512, 4096),
            request(20_000, 0, Op::Write, 200 * 512, 512)
        ]
    );
    assert_eq!(skipped, 1, "SYNCHRONIZE CACHE (0x35) is no read or write");
}

#[test]
fn oracle_general_id_unit_can_be_changed() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "x.oracleGeneral",
        &oracle_general(&[(1, 3, 4096, -1)]),
    );
    let options = OpenOptions {
        oracle_general_id_unit: 4096,
        ..OpenOptions::default()
    };
    let requests = read_all_with(&path, Format::OracleGeneral, &options).requests;
    assert_eq!(requests, vec![request(0, 0, Op::Read, 3 * 4096, 4096)]);
}

#[test]
fn disksim_times_with_a_decimal_point_are_milliseconds() {
    let text = "0.5 0 100 8 1\n2.75 1 200 8 0\n";
    let (requests, volumes, _) = read_bytes("x.disksim", text.as_bytes(), Format::Disksim);
    assert_eq!(
        requests,
        vec![
            request(0, 0, Op::Read, 100 * 512, 4096),
            request(2_250_000, 1, Op::Write, 200 * 512, 4096)
        ]
    );
    assert_eq!(volumes, ["0", "1"]);
}

#[test]
fn every_sample_reads_as_its_format_and_is_detected() {
    for format in Format::ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(&dir, "sample", &sample(format));
        let read = read_all(&path, format);
        assert_eq!(read.requests.len(), SAMPLE_REQUESTS, "{format}");
        if !one_number_per_line(format) {
            let detected =
                trace::open(&path, Format::Auto).unwrap_or_else(|e| panic!("{format}: {e}"));
            assert_eq!(detected.info().format, format);
        }
    }
}

#[test]
fn format_names_round_trip_and_unknown_names_list_the_formats() {
    for format in every_format() {
        assert_eq!(format.to_string().parse::<Format>().unwrap(), format);
    }
    let names: Vec<String> = Format::ALL.iter().map(ToString::to_string).collect();
    for required in [
        "msr",
        "arc",
        "blkparse",
        "oracle-general",
        "vscsi",
        "fio-iolog",
        "snia-tencent",
        "systor",
        "disksim",
        "lirs",
        "ssdcache",
    ] {
        assert!(names.iter().any(|name| name == required), "{required}");
    }
    let error = "parquet".parse::<Format>().unwrap_err().to_string();
    assert!(
        error.contains("parquet") && error.contains("oracle-general") && error.contains("auto"),
        "{error}"
    );
}
