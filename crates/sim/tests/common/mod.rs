//! Shared by the trace tests: where the shared traces are, and reading a whole trace.
#![allow(dead_code)]

pub mod samples;

use std::path::{Path, PathBuf};

use ssdcache_sim::trace::{self, Format, Op, Request, Trace, TraceError};

/// The shared traces sit beside the checkout; a missing file fails the test that needs it.
pub fn shared(relative: &str) -> PathBuf {
    let path = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces"
    ))
    .join(relative);
    assert!(path.is_file(), "shared trace {} is missing", path.display());
    path
}

pub struct ReadAll {
    pub requests: Vec<Request>,
    pub trace: Trace,
}

pub fn read_all(path: &Path, format: Format) -> ReadAll {
    let mut trace = trace::open(path, format)
        .unwrap_or_else(|e| panic!("opening {} as {format}: {e}", path.display()));
    let requests: Vec<Request> = trace
        .by_ref()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("reading {} as {format}: {e}", path.display()));
    ReadAll { requests, trace }
}

/// The first error reading `path` as `format`, opening included; panics if there is none.
pub fn first_error(path: &Path, format: Format) -> TraceError {
    match trace::open(path, format) {
        Err(e) => e,
        Ok(mut trace) => match trace.find_map(Result::err) {
            Some(e) => e,
            None => panic!("{} read as {format} without an error", path.display()),
        },
    }
}

pub fn request(time_ns: u64, volume: u32, op: Op, offset: u64, len: u64) -> Request {
    Request {
        time_ns,
        volume,
        op,
        offset,
        len,
    }
}

/// The 4 KiB block keys of `requests`, in order.
pub fn block_sequence(requests: &[Request]) -> Vec<u64> {
    requests
        .iter()
        .flat_map(|r| trace::block_keys(r, 4096))
        .collect()
}
