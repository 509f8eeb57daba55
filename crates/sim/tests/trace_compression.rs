//! Compressed traces: zstd, gzip, bzip2 and xz are told by their magic bytes, not the name;
//! concatenated streams are read whole; corrupt and truncated streams are errors naming the file
//! and the compression.

mod common;

use common::codec::{Codec, CODECS};
use common::samples::sample;
use common::{first_error, one_number_per_line, read_all, write_file};
use ssdcache_sim::trace::{self, Format, Request, TraceError};

fn requests_of(path: &std::path::Path, format: Format) -> Vec<Request> {
    read_all(path, format).requests
}

#[test]
fn every_format_reads_the_same_compressed_whatever_the_name() {
    let dir = tempfile::tempdir().unwrap();
    for format in Format::ALL {
        let plain = sample(format);
        let expected = requests_of(&write_file(&dir, "plain", &plain), format);
        for codec in CODECS {
            let compressed = codec.compress(&plain);
            for name in [
                format!("trace.{}", codec.extension()),
                "trace.dat".to_owned(),
            ] {
                let path = write_file(&dir, &name, &compressed);
                let read = read_all(&path, format);
                assert_eq!(read.requests, expected, "{format} in {codec:?} as {name}");
                assert_eq!(read.trace.info().compression, codec.compression());
                if !one_number_per_line(format) {
                    let detected = trace::open(&path, Format::Auto).unwrap();
                    assert_eq!(
                        detected.info().format,
                        format,
                        "auto: {format} in {codec:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn concatenated_streams_are_read_whole() {
    let dir = tempfile::tempdir().unwrap();
    let part = sample(Format::Arc);
    for codec in CODECS {
        let mut bytes = codec.compress(&part);
        bytes.extend(codec.compress(&part));
        let path = write_file(&dir, "two.lis", &bytes);
        assert_eq!(requests_of(&path, Format::Arc).len(), 6, "{codec:?}");
    }
}

fn big_arc_trace() -> Vec<u8> {
    let mut text = String::new();
    for request in 0..20_000u64 {
        text.push_str(&format!(
            "{} {} 0 {request}\n",
            request * 7919 % 1_000_003,
            8 + request % 64
        ));
    }
    text.into_bytes()
}

#[test]
fn a_truncated_stream_is_a_read_error_naming_the_compression() {
    let dir = tempfile::tempdir().unwrap();
    let plain = big_arc_trace();
    for codec in CODECS {
        let compressed = codec.compress(&plain);
        let path = write_file(&dir, "cut", &compressed[..compressed.len() / 2]);
        let error = first_error(&path, Format::Arc);
        let message = error.to_string();
        assert!(
            matches!(error, TraceError::Read { .. }),
            "{codec:?}: {message}"
        );
        assert!(
            message.starts_with(&path.display().to_string()),
            "{message}"
        );
        assert!(
            message.contains(&format!(
                "corrupt or truncated {} stream ",
                codec.compression()
            )),
            "{codec:?}: {message}"
        );
    }
}

#[test]
fn a_corrupt_stream_is_an_error_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let plain = big_arc_trace();
    for codec in CODECS {
        let mut compressed = codec.compress(&plain);
        let middle = compressed.len() / 2;
        for byte in &mut compressed[middle..middle + 16] {
            *byte ^= 0x5a;
        }
        let path = write_file(&dir, "corrupt", &compressed);
        let error = first_error(&path, Format::Arc);
        // The checksum catches it at the end of a block, or garbage reaches the parser first.
        assert!(
            matches!(error, TraceError::Read { .. } | TraceError::Line { .. }),
            "{codec:?}: {error}"
        );
        assert!(
            error.to_string().starts_with(&path.display().to_string()),
            "{error}"
        );
    }
}

#[test]
fn garbage_after_a_magic_number_is_a_read_error() {
    let dir = tempfile::tempdir().unwrap();
    for (codec, magic) in [
        (Codec::Zstd, &[0x28, 0xb5, 0x2f, 0xfd][..]),
        (Codec::Gzip, &[0x1f, 0x8b][..]),
        (Codec::Bzip2, &b"BZh"[..]),
        (Codec::Xz, &[0xfd, b'7', b'z', b'X', b'Z', 0x00][..]),
    ] {
        let mut bytes = magic.to_vec();
        bytes.extend_from_slice(b"this is not compressed data at all, just text");
        let path = write_file(&dir, "fake", &bytes);
        let error = trace::open(&path, Format::Auto).unwrap_err();
        assert!(
            matches!(error, TraceError::Read { .. }),
            "{codec:?}: {error}"
        );
        assert!(
            error.to_string().contains(codec.compression().name()),
            "{error}"
        );
    }
}

#[test]
fn an_empty_compressed_stream_is_an_empty_trace_error() {
    let dir = tempfile::tempdir().unwrap();
    for codec in CODECS {
        let path = write_file(&dir, "empty", &codec.compress(b""));
        let error = trace::open(&path, Format::Msr).unwrap_err();
        assert!(
            matches!(error, TraceError::File { .. }),
            "{codec:?}: {error}"
        );
        assert!(
            error
                .to_string()
                .contains(&format!("empty {} stream", codec.compression())),
            "{error}"
        );
    }
}
