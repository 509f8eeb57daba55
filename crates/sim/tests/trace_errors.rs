//! Wrong and corrupt input: every error names the file and the line (text) or byte offset
//! (binary), and never panics.

mod common;

use std::fmt;
use std::path::Path;

use common::samples::{oracle_general, sample, sample_lines, vscsi_v1};
use common::{every_format, first_error, one_number_per_line, write_file};
use ssdcache_sim::trace::{self, Format, TraceError};

const BINARY_FORMATS: [Format; 2] = [Format::Vscsi, Format::OracleGeneral];

fn text_formats() -> impl Iterator<Item = Format> {
    Format::ALL
        .into_iter()
        .filter(|format| !BINARY_FORMATS.contains(format))
}

/// Where in a file an error is: a line of a text trace, a byte offset of a binary one.
#[derive(Clone, Copy)]
enum At {
    Line(u64),
    Offset(u64),
}

impl At {
    fn position(self) -> u64 {
        match self {
            At::Line(number) | At::Offset(number) => number,
        }
    }
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            At::Line(line) => write!(f, "line {line}"),
            At::Offset(offset) => write!(f, "byte offset {offset}"),
        }
    }
}

#[track_caller]
fn assert_error_at(error: &TraceError, path: &Path, at: At, mentions: &[&str]) {
    let (found_path, found) = match (error, at) {
        (TraceError::Line { path, line, .. }, At::Line(_)) => (path, *line),
        (TraceError::Record { path, offset, .. }, At::Offset(_)) => (path, *offset),
        (other, _) => panic!("expected an error at {at}, got: {other}"),
    };
    assert_eq!(found_path, path, "{error}");
    assert_eq!(found, at.position(), "{error}");
    let message = error.to_string();
    assert!(
        message.starts_with(&format!("{} {at}: ", path.display())),
        "{message}"
    );
    for word in mentions {
        assert!(message.contains(word), "`{word}` not in: {message}");
    }
}

#[track_caller]
fn assert_line_error(error: &TraceError, path: &Path, line: u64, mentions: &[&str]) {
    assert_error_at(error, path, At::Line(line), mentions);
}

#[track_caller]
fn assert_record_error(error: &TraceError, path: &Path, offset: u64, mentions: &[&str]) {
    assert_error_at(error, path, At::Offset(offset), mentions);
}

#[test]
fn the_example_of_the_brief() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    for _ in 0..16 {
        text.push_str("128166385295514663,hm,0,Write,9056014336,2048,2833\n");
    }
    text.push_str("128166385295514663,hm,0\n");
    let path = write_file(&dir, "trace.csv", text.as_bytes());
    let error = first_error(&path, Format::Msr);
    assert_eq!(
        error.to_string(),
        format!(
            "{} line 17: expected 7 comma-separated fields (timestamp,host,disk,type,offset,size,response_time) of an MSR Cambridge trace, found 3",
            path.display()
        )
    );
}

#[test]
fn a_garbage_line_is_reported_at_its_line() {
    for format in text_formats() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = sample(format);
        bytes.extend_from_slice(b"?? garbage, here ??\n");
        let path = write_file(&dir, "t", &bytes);
        let error = first_error(&path, format);
        assert_line_error(&error, &path, sample_lines(format) as u64 + 1, &[]);
    }
}

#[test]
fn a_line_cut_in_half_is_reported_at_its_line() {
    // One number per line: a number cut short is still a number, which no reader can tell.
    for format in text_formats().filter(|&f| !one_number_per_line(f)) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = sample(format);
        let text = String::from_utf8(bytes.clone()).unwrap();
        let last = text.lines().last().unwrap();
        bytes.extend_from_slice(&last.as_bytes()[..last.len() / 2]);
        let path = write_file(&dir, "cut", &bytes);
        let error = first_error(&path, format);
        assert_line_error(&error, &path, sample_lines(format) as u64 + 1, &[]);
    }
}

#[test]
fn bad_numbers_and_operations_name_the_field_and_what_was_found() {
    let cases: [(Format, &str, &str, &[&str]); 13] = [
        (
            Format::Msr,
            "128166385295514663,hm,0,Write,90x6,2048,2833\n",
            "",
            &["offset", "`90x6`"],
        ),
        (
            Format::Msr,
            "128166385295514663,hm,0,Trim,9056,2048,2833\n",
            "",
            &["type", "`Trim`", "Read"],
        ),
        (Format::Arc, "230027 -8 0 0\n", "", &["block count", "`-8`"]),
        (
            Format::SniaTencent,
            "1538323200,4247200,128,2,1058\n",
            "",
            &["io_type", "`2`"],
        ),
        (
            Format::Systor,
            "1455591804.31,0.006,X,0,2034,32768\n",
            "",
            &["IOType", "`X`"],
        ),
        (
            Format::Disksim,
            "938513000 4 264719034 1.6 0\n",
            "",
            &["sector count", "`1.6`"],
        ),
        (Format::Lirs, "0x1f\n", "12\n", &["`0x1f`", "4 KiB block"]),
        (
            Format::VscsiCsv,
            "1,5633898,zz,512,42932745\n",
            "version,time,op,size,lbn\n",
            &["op", "`zz`"],
        ),
        (
            Format::Blkparse,
            "  8,0 3 1 0.0 697 Q X 223490 + 8 [k]\n",
            "",
            &["RWBS", "`X`"],
        ),
        (
            Format::Blkparse,
            "  8,0 3 1 0.0 697 Q WS [k]\n",
            "",
            &["sector + sectors"],
        ),
        (
            Format::FioIolog,
            "0 /dev/sdb discard 0 4096\n",
            "fio version 3 iolog\n",
            &["action", "`discard`"],
        ),
        (
            Format::Ssdcache,
            "0,sdb,T,0,4096\n",
            "# ssdcache-trace v1\n",
            &["op", "`T`"],
        ),
        (
            Format::Ssdcache,
            "0,sdb,R,0,99999999999999999999999\n",
            "# ssdcache-trace v1\n",
            &["length"],
        ),
    ];
    for (format, bad_line, header, mentions) in cases {
        let dir = tempfile::tempdir().unwrap();
        let text = format!("{header}{bad_line}");
        let path = write_file(&dir, "bad", text.as_bytes());
        let error = first_error(&path, format);
        assert_line_error(&error, &path, header.lines().count() as u64 + 1, mentions);
    }
}

#[test]
fn requests_beyond_the_limits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "huge", b"# ssdcache-trace v1\n0,sdb,R,0,4294967296\n");
    assert_line_error(&first_error(&path, Format::Ssdcache), &path, 2, &["limit"]);
    let path = write_file(&dir, "far", b"18446744073709551615 8 0 0\n");
    assert_line_error(&first_error(&path, Format::Arc), &path, 1, &["64 bits"]);
    let path = write_file(
        &dir,
        "far2",
        b"# ssdcache-trace v1\n0,sdb,R,144115188075855872,1\n",
    );
    assert_line_error(&first_error(&path, Format::Ssdcache), &path, 2, &["beyond"]);
}

#[test]
fn a_file_of_another_format_is_refused_at_its_first_line() {
    for given in text_formats() {
        for wrong in text_formats() {
            let same_shape = one_number_per_line(given) && one_number_per_line(wrong);
            if given == wrong || same_shape {
                continue;
            }
            let dir = tempfile::tempdir().unwrap();
            let path = write_file(&dir, "other", &sample(given));
            let error = first_error(&path, wrong);
            let TraceError::Line { line, .. } = &error else {
                panic!("{given} read as {wrong}: {error}");
            };
            assert!(*line <= 2, "{given} read as {wrong} fails late: {error}");
            assert!(error.to_string().contains("expected"), "{error}");
        }
        for binary in BINARY_FORMATS {
            let dir = tempfile::tempdir().unwrap();
            let path = write_file(&dir, "text", &sample(given));
            let error = first_error(&path, binary);
            assert!(
                matches!(error, TraceError::Record { .. }),
                "{given} read as {binary}: {error}"
            );
        }
    }
}

#[test]
fn binary_traces_read_as_text_are_refused_at_line_1() {
    for binary in BINARY_FORMATS {
        for text in text_formats() {
            let dir = tempfile::tempdir().unwrap();
            let path = write_file(&dir, "binary", &sample(binary));
            let error = first_error(&path, text);
            assert_line_error(&error, &path, 1, &[]);
        }
    }
}

#[test]
fn truncated_binary_records_name_the_offset_of_the_cut_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = sample(Format::Vscsi);
    bytes.truncate(bytes.len() - 5);
    let path = write_file(&dir, "cut.vscsi", &bytes);
    assert_record_error(
        &first_error(&path, Format::Vscsi),
        &path,
        64,
        &["truncated", "27 bytes into a 32-byte record"],
    );

    let mut bytes = sample(Format::OracleGeneral);
    bytes.truncate(bytes.len() - 1);
    let path = write_file(&dir, "cut.bin", &bytes);
    assert_record_error(
        &first_error(&path, Format::OracleGeneral),
        &path,
        48,
        &["truncated", "24-byte"],
    );
}

#[test]
fn a_vscsi_record_of_another_version_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = vscsi_v1(&[
        (0x28, 1, 512, 1),
        (0x28, 2, 512, 2),
        (0x28, 3, 512, 3),
        (0x28, 4, 512, 4),
    ]);
    bytes[3 * 32 + 15] = 0x07;
    let path = write_file(&dir, "bad.vscsi", &bytes);
    assert_record_error(
        &first_error(&path, Format::Vscsi),
        &path,
        96,
        &["version 1", "0x0700"],
    );
    let path = write_file(&dir, "garbage.vscsi", &[0xab; 100]);
    assert_record_error(
        &first_error(&path, Format::Vscsi),
        &path,
        0,
        &["not a vscsi trace"],
    );
}

#[test]
fn an_oracle_general_object_id_that_is_no_block_number_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = oracle_general(&[(1, 5, 512, -1), (1, 0x9e37_79b9_7f4a_7c15, 100, -1)]);
    let path = write_file(&dir, "kv.oracleGeneral.bin", &bytes);
    assert_record_error(
        &first_error(&path, Format::OracleGeneral),
        &path,
        24,
        &["obj_id 11400714819323198485"],
    );
}

#[test]
fn empty_files_are_refused_by_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "empty.csv", b"");
    for format in every_format() {
        let error = trace::open(&path, format).unwrap_err();
        assert!(matches!(error, TraceError::File { .. }), "{error}");
        assert!(error.to_string().contains("empty"), "{error}");
        assert!(
            error.to_string().starts_with(&path.display().to_string()),
            "{error}"
        );
    }
}

#[test]
fn a_missing_file_is_an_open_error_naming_it() {
    let error = trace::open(Path::new("/nonexistent/trace.csv"), Format::Msr).unwrap_err();
    assert!(matches!(error, TraceError::Open { .. }));
    assert!(
        error.to_string().contains("/nonexistent/trace.csv"),
        "{error}"
    );
}

#[test]
fn wrong_headers_of_header_formats() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "v2.trace", b"# ssdcache-trace v2\n0,sdb,R,0,4096\n");
    assert_line_error(
        &first_error(&path, Format::Ssdcache),
        &path,
        1,
        &["unsupported", "v2"],
    );
    let path = write_file(&dir, "v1.iolog", b"fio version 1 iolog\n");
    assert_line_error(
        &first_error(&path, Format::FioIolog),
        &path,
        1,
        &["fio version 3 iolog"],
    );
    let path = write_file(
        &dir,
        "rate.trace",
        b"# ssdcache-trace v1\n# sample_rate=2\n",
    );
    assert_line_error(
        &first_error(&path, Format::Ssdcache),
        &path,
        2,
        &["sample_rate", "`2`"],
    );
}

#[test]
fn a_line_without_end_is_refused_before_it_fills_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "long", &vec![b'1'; 200_000]);
    assert_line_error(
        &first_error(&path, Format::Lirs),
        &path,
        1,
        &["longer than"],
    );
}

#[test]
fn auto_detection_failures_list_the_formats_and_ask_for_format() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "notes.md", b"# Some notes\n\nNothing to see here.\n");
    let error = trace::open(&path, Format::Auto).unwrap_err().to_string();
    assert!(
        error.contains("notes.md") && error.contains("--format"),
        "{error}"
    );
    for format in Format::ALL {
        assert!(
            error.contains(format.name()),
            "{format} missing from: {error}"
        );
    }
    // The extension says which format's complaint to show.
    let path = write_file(&dir, "P9.lis", b"230027 8 0\n");
    let error = trace::open(&path, Format::Auto).unwrap_err().to_string();
    assert!(
        error.contains("Read as arc") && error.contains("line 1"),
        "{error}"
    );
}
