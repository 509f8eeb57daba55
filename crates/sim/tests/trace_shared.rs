//! Every shared trace is read completely, with the request count and the first and last
//! requests checked against the raw file (the raw lines are quoted), and told by `auto`.

mod common;

use common::{read_all, request, shared};
use ssdcache_sim::trace::{self, Format, Op, Request, TraceError};

struct Expected<'a> {
    file: &'a str,
    format: Format,
    count: usize,
    first: Request,
    last: Request,
    volumes: usize,
    skipped: u64,
}

fn check(expected: Expected<'_>) {
    let path = shared(expected.file);
    let read = read_all(&path, expected.format);
    assert_eq!(read.requests.len(), expected.count, "{}", expected.file);
    assert_eq!(read.requests[0], expected.first, "{}: first", expected.file);
    assert_eq!(
        *read.requests.last().unwrap(),
        expected.last,
        "{}: last",
        expected.file
    );
    assert_eq!(
        read.trace.volume_names().len(),
        expected.volumes,
        "{}: volumes",
        expected.file
    );
    assert_eq!(
        read.trace.skipped_records(),
        expected.skipped,
        "{}: skipped",
        expected.file
    );
    assert_eq!(read.trace.info().format, expected.format);
    assert_eq!(read.trace.info().sample_rate, 1.0);
    let detected = trace::open(&path, Format::Auto)
        .unwrap_or_else(|e| panic!("auto on {}: {e}", expected.file));
    assert_eq!(
        detected.info().format,
        expected.format,
        "auto on {}",
        expected.file
    );
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn arc_p3() {
    check(Expected {
        file: "arc/P3.lis.zst",
        format: Format::Arc,
        count: 238_578,
        first: request(0, 0, Op::Read, 230_027 * 512, 8 * 512), // 230027 8 0 0
        last: request(0, 0, Op::Read, 4_201_916 * 512, 8 * 512), // 4201916 8 50 238577
        volumes: 0,
        skipped: 0,
    });
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn arc_p6() {
    check(Expected {
        file: "arc/P6.lis.zst",
        format: Format::Arc,
        count: 519_711,
        first: request(0, 0, Op::Read, 110_765 * 512, 64 * 512), // 110765 64 0 0
        last: request(0, 0, Op::Read, 3_181_471 * 512, 8 * 512), // 3181471 8 252 519710
        volumes: 0,
        skipped: 0,
    });
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn msr_cambridge() {
    let path = shared("msr/msr-cambridge1-sample.csv");
    check(Expected {
        file: "msr/msr-cambridge1-sample.csv",
        format: Format::Msr,
        count: 1000,
        // 128166385295514663,hm,0,Write,9056014336,2048,2833
        first: request(0, 0, Op::Write, 9_056_014_336, 2048),
        // 128166386567849604,hm,0,Read,11946549248,4096,3499: (…604 - …663) × 100 ns
        last: request(
            (128_166_386_567_849_604 - 128_166_385_295_514_663) * 100,
            0,
            Op::Read,
            11_946_549_248,
            4096,
        ),
        volumes: 1,
        skipped: 0,
    });
    assert_eq!(read_all(&path, Format::Msr).trace.volume_names(), ["hm_0"]);
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn systor_additional() {
    check(Expected {
        file: "systor17/systor17-additional-sample.csv.gz",
        format: Format::Systor,
        count: 999,
        // 1455591804.310701000,0.006475000,R,0,203468398592,32768
        first: request(0, 0, Op::Read, 203_468_398_592, 32768),
        // 1455591805.634876000,0.006796000,R,0,280552051200,4096
        last: request(1_324_175_000, 0, Op::Read, 280_552_051_200, 4096),
        volumes: 1,
        skipped: 0,
    });
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn systor_traces() {
    let path = shared("systor17/systor17-traces-sample.csv.gz");
    check(Expected {
        file: "systor17/systor17-traces-sample.csv.gz",
        format: Format::Systor,
        count: 999,
        // 1456095145.133076000,0.000806000,R,0,899056122368,131072
        first: request(0, 0, Op::Read, 899_056_122_368, 131_072),
        // 1456095147.574052000,0.000245000,R,0,4238867714048,4096
        last: request(2_440_976_000, 0, Op::Read, 4_238_867_714_048, 4096),
        volumes: 1,
        skipped: 0,
    });
    let read = read_all(&path, Format::Systor);
    let writes = read.requests.iter().filter(|r| r.op == Op::Write).count();
    assert_eq!(writes, 173, "zcat … | cut -d, -f3 | sort | uniq -c");
    assert_eq!(read.trace.volume_names(), ["0"]);
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn snia_tencent() {
    let path = shared("tencent_cbs/cloud_storage-sample.bz2");
    check(Expected {
        file: "tencent_cbs/cloud_storage-sample.bz2",
        format: Format::SniaTencent,
        count: 50_000,
        // 1538323200,4247200,128,1,1058
        first: request(0, 0, Op::Write, 4_247_200 * 512, 128 * 512),
        // 1538323200,8526920,128,1,10799 (volume 10799 is the 1946th to appear)
        last: request(0, 1945, Op::Write, 8_526_920 * 512, 128 * 512),
        volumes: 2038,
        skipped: 0,
    });
    let read = read_all(&path, Format::SniaTencent);
    assert_eq!(&read.trace.volume_names()[..3], ["1058", "1063", "1069"]);
    assert_eq!(read.trace.volume_names()[1945], "10799");
    let reads = read.requests.iter().filter(|r| r.op == Op::Read).count();
    assert_eq!(reads, 24_521, "bzcat … | cut -d, -f4 | sort | uniq -c");
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn disksim_tpcc() {
    let path = shared("mqsim/tpcc-small.trace");
    check(Expected {
        file: "mqsim/tpcc-small.trace",
        format: Format::Disksim,
        count: 6999,
        first: request(0, 0, Op::Write, 264_719_034 * 512, 16 * 512), // 938513000 4 264719034 16 0
        // 1075002000 7 160057354 16 0 (device 7 is the 10th to appear)
        last: request(
            1_075_002_000 - 938_513_000,
            9,
            Op::Write,
            160_057_354 * 512,
            16 * 512,
        ),
        volumes: 16,
        skipped: 0,
    });
    let read = read_all(&path, Format::Disksim);
    assert_eq!(read.trace.volume_names()[9], "7");
    let writes = read.requests.iter().filter(|r| r.op == Op::Write).count();
    assert_eq!(writes, 2618, "awk '$5 == 0' | wc -l");
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn disksim_wsrch_without_a_final_newline() {
    check(Expected {
        file: "mqsim/wsrch-small.trace",
        format: Format::Disksim,
        count: 24_783,
        first: request(0, 0, Op::Read, 657_728 * 512, 16 * 512), // 11413000 0 657728 16 1
        last: request(
            60_066_625_000 - 11_413_000,
            1,
            Op::Read,
            34_371_424 * 512,
            64 * 512,
        ), // 60066625000 1 34371424 64 1
        volumes: 6,
        skipped: 0,
    });
}

/// (file, requests, first block, last block): `zcat f | grep -c '^[0-9]'` and the first and
/// last numeric lines.
const LIRS: [(&str, usize, u64, u64); 13] = [
    ("2_pools.trace.gz", 100_000, 2819, 65),
    ("backf.trace.gz", 9000, 10_000, 0),
    ("cpp.trace.gz", 9047, 0, 69),
    ("cs.trace.gz", 6781, 0, 1359),
    ("gli.trace.gz", 6015, 0, 2528),
    ("loop.trace.gz", 505_500, 0, 1010),
    ("multi1.trace.gz", 15_858, 0, 19),
    ("multi2.trace.gz", 26_311, 0, 45),
    ("multi3.trace.gz", 30_241, 0, 4016),
    ("ps.trace.gz", 10_448, 0, 3081),
    ("scan.trace.gz", 50_025, 0, 2000),
    ("sprite.trace.gz", 133_996, 0, 8),
    ("zigzag.trace.gz", 52_001, 0, 0),
];

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn lirs_all_files_with_breakpoints_blank_lines_and_crlf() {
    for (file, count, first, last) in LIRS {
        let file = format!("lirs/{file}");
        check(Expected {
            file: &file,
            format: Format::Lirs,
            count,
            first: request(0, 0, Op::Read, first * 4096, 4096),
            last: request(0, 0, Op::Read, last * 4096, 4096),
            volumes: 0,
            skipped: 0,
        });
    }
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn vscsi_cloudphysics() {
    check(Expected {
        file: "cloudphysics/cloudPhysicsIO.vscsi",
        format: Format::Vscsi,
        count: 113_872,
        // record 0: ts 5633898368802 µs, lbn 42932745, len 512, cmd 0x2a
        first: request(0, 0, Op::Write, 42_932_745 * 512, 512),
        // last record: ts 5641098458687, lbn 42936150, len 512, cmd 0x2a
        last: request(
            (5_641_098_458_687 - 5_633_898_368_802) * 1000,
            0,
            Op::Write,
            42_936_150 * 512,
            512,
        ),
        volumes: 0,
        skipped: 0,
    });
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn vscsi_csv_cloudphysics() {
    check(Expected {
        file: "cloudphysics/cloudPhysicsIO.csv",
        format: Format::VscsiCsv,
        count: 113_872,
        first: request(0, 0, Op::Write, 42_932_745 * 512, 512), // 1,5633898,2a,512,42932745
        last: request(7200 * 1_000_000_000, 0, Op::Write, 42_936_150 * 512, 512), // 1,5641098,2a,512,42936150
        volumes: 0,
        skipped: 0,
    });
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn oracle_general_cloudphysics() {
    check(Expected {
        file: "cloudphysics/cloudPhysicsIO.oracleGeneral.bin",
        format: Format::OracleGeneral,
        count: 113_872,
        first: request(0, 0, Op::Read, 42_932_745 * 512, 512), // ts 5633898, obj 42932745, size 512
        last: request(7200 * 1_000_000_000, 0, Op::Read, 42_936_150 * 512, 512),
        volumes: 0,
        skipped: 0,
    });
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn sector_list_cloudphysics_txt() {
    let path = shared("cloudphysics/cloudPhysicsIO.txt");
    let read = read_all(&path, Format::SectorList);
    assert_eq!(read.requests.len(), 113_872);
    assert_eq!(
        read.requests[0],
        request(0, 0, Op::Read, 42_932_745 * 512, 512)
    );
    assert_eq!(
        *read.requests.last().unwrap(),
        request(0, 0, Op::Read, 42_936_150 * 512, 512)
    );
}

#[test]
#[cfg_attr(not(ssdcache_traces), ignore = "needs SSDCACHE_TRACES")]
fn auto_refuses_to_guess_between_lirs_and_sector_list_and_says_what_to_pass() {
    let path = shared("cloudphysics/cloudPhysicsIO.txt");
    let error = trace::open(&path, Format::Auto).unwrap_err();
    assert!(matches!(error, TraceError::File { .. }), "{error}");
    let message = error.to_string();
    assert!(message.contains("cloudPhysicsIO.txt"), "{message}");
    assert!(
        message.contains("lirs") && message.contains("sector-list"),
        "{message}"
    );
    assert!(message.contains("--format"), "{message}");
}
