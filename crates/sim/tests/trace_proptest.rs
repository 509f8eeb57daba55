//! Properties: the ssdcache format round-trips any requests; no bytes make any reader panic;
//! block keys cover exactly the bytes of a request.

mod common;

use std::io::Cursor;
use std::path::Path;

use common::every_format;
use common::samples::sample;
use proptest::prelude::*;
use ssdcache_sim::trace::{
    self, block_keys, Format, Op, OpenOptions, Request, MAX_REQUEST_LEN, MAX_TRACE_BYTES,
};

/// The writer's side of the format, as small as a test can have it.
fn write_ssdcache(requests: &[(u64, String, Op, u64, u64)], sample_rate: Option<f64>) -> Vec<u8> {
    let mut text = String::from("# ssdcache-trace v1\n");
    if let Some(rate) = sample_rate {
        text.push_str(&format!("# sample_rate={rate} sample_region=1048576\n"));
    }
    text.push_str("# time_us,volume,op,offset,length\n");
    for (time_us, volume, op, offset, len) in requests {
        let op = match op {
            Op::Read => 'R',
            Op::Write => 'W',
        };
        text.push_str(&format!("{time_us},{volume},{op},{offset},{len}\n"));
    }
    text.into_bytes()
}

/// Opens `bytes` as a trace called `name`.
fn open_bytes(
    name: &str,
    bytes: Vec<u8>,
    format: Format,
) -> Result<trace::Trace, trace::TraceError> {
    trace::from_reader(
        Path::new(name),
        Box::new(Cursor::new(bytes)),
        format,
        &OpenOptions::default(),
    )
}

fn read_from_bytes(
    bytes: Vec<u8>,
    format: Format,
) -> Result<(Vec<Request>, trace::Trace), trace::TraceError> {
    let mut trace = open_bytes("mem", bytes, format)?;
    let requests = trace.by_ref().collect::<Result<Vec<_>, _>>()?;
    Ok((requests, trace))
}

fn volume_name() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z]{1,8}", "/dev/[a-z0-9/_-]{1,20}", "[^,\\p{Cc}]{1,12}",]
}

fn ssdcache_request(names: Vec<String>) -> impl Strategy<Value = (u64, String, Op, u64, u64)> {
    (
        0u64..u64::MAX / 1000,
        proptest::sample::select(names),
        prop_oneof![Just(Op::Read), Just(Op::Write)],
        0..=MAX_TRACE_BYTES,
        0..=MAX_REQUEST_LEN,
    )
        .prop_map(|(time, name, op, offset, len)| {
            (time, name, op, offset.min(MAX_TRACE_BYTES - len), len)
        })
}

proptest! {
    #[test]
    fn ssdcache_round_trips_any_requests(
        (requests, rate) in proptest::collection::vec(volume_name(), 1..5)
            .prop_flat_map(|names| proptest::collection::vec(ssdcache_request(names), 0..50))
            .prop_flat_map(|requests| (Just(requests), proptest::option::of(0.0001f64..=1.0)))
    ) {
        let bytes = write_ssdcache(&requests, rate);
        let (read, trace) = read_from_bytes(bytes, Format::Auto).unwrap();
        prop_assert_eq!(trace.info().format, Format::Ssdcache);
        prop_assert_eq!(trace.info().sample_rate, rate.unwrap_or(1.0));
        let mut names: Vec<String> = Vec::new();
        for name in requests.iter().map(|r| &r.1) {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        prop_assert_eq!(trace.volume_names(), names.as_slice());
        prop_assert_eq!(read.len(), requests.len());
        let first_time = requests.first().map_or(0, |r| r.0);
        for (got, (time_us, name, op, offset, len)) in read.iter().zip(&requests) {
            let volume = names.iter().position(|n| n == name).unwrap() as u32;
            let time_ns = time_us.saturating_sub(first_time) * 1000;
            prop_assert_eq!(*got, Request { time_ns, volume, op: *op, offset: *offset, len: *len });
        }
    }

    #[test]
    fn block_keys_cover_exactly_the_bytes_of_a_request(
        volume in 0u32..65536,
        offset in 0u64..(1 << 40),
        len in 0u64..(1 << 20),
        line_shift in 9u32..22,
    ) {
        let line = 1u64 << line_shift;
        let request = Request { time_ns: 0, volume, op: Op::Read, offset, len };
        let keys: Vec<u64> = block_keys(&request, line).collect();
        if len == 0 {
            prop_assert!(keys.is_empty());
        } else {
            prop_assert_eq!(keys.len() as u64, (offset + len - 1) / line - offset / line + 1);
            prop_assert_eq!(keys[0], (u64::from(volume) << 48) | (offset / line));
            for pair in keys.windows(2) {
                prop_assert_eq!(pair[1], pair[0] + 1);
            }
            prop_assert_eq!(*keys.last().unwrap() & ((1 << 48) - 1), (offset + len - 1) / line);
        }
    }
}

/// Reads `bytes` as `format` to the end or the first error; a panic fails the test.
fn read_without_panic(bytes: &[u8], format: Format) {
    let Ok(trace) = open_bytes("fuzz", bytes.to_vec(), format) else {
        return;
    };
    // Every request takes at least one byte of the input.
    for item in trace.take(bytes.len() + 1) {
        if let Err(error) = item {
            assert!(error.to_string().starts_with("fuzz"), "{error}");
            break;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_a_reader(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        for format in every_format() {
            read_without_panic(&bytes, format);
        }
    }

    #[test]
    fn arbitrary_text_never_panics_a_reader(text in "[0-9a-zA-Z,.+ #=\\[\\]\\n\\r\\t-]{0,400}") {
        for format in every_format() {
            read_without_panic(text.as_bytes(), format);
        }
    }

    #[test]
    fn damaged_samples_never_panic_a_reader(
        format_index in 0..Format::ALL.len(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..6),
        keep in any::<prop::sample::Index>(),
    ) {
        let mut bytes = sample(Format::ALL[format_index]);
        for (at, byte, kind) in edits {
            let at = at.index(bytes.len());
            match kind {
                0 => bytes[at] = byte,
                1 => bytes.insert(at, byte),
                _ => { bytes.remove(at); }
            }
            if bytes.is_empty() {
                break;
            }
        }
        let keep = keep.index(bytes.len() + 1);
        bytes.truncate(keep);
        for format in every_format() {
            read_without_panic(&bytes, format);
        }
    }

    #[test]
    fn compressed_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), magic in 0..4usize) {
        let magics: [&[u8]; 4] = [&[0x28, 0xb5, 0x2f, 0xfd], &[0x1f, 0x8b], b"BZh", &[0xfd, b'7', b'z', b'X', b'Z', 0]];
        let mut data = magics[magic].to_vec();
        data.extend_from_slice(&bytes);
        read_without_panic(&data, Format::Auto);
        read_without_panic(&data, Format::Msr);
    }
}
