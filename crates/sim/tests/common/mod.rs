//! Shared by the trace tests: where the shared traces are, and reading a whole trace.
#![allow(dead_code)]

pub mod codec;
pub mod samples;
pub mod shards;
pub mod shared_traces;
pub mod synthetic;

use std::path::{Path, PathBuf};

use ssdcache_sim::trace::{self, Format, Op, OpenOptions, Request, Trace, TraceError};

/// `relative` in the shared traces folder (see `shared_traces::shared_trace`).
pub fn shared(relative: &str) -> PathBuf {
    shared_traces::shared_trace(relative)
}

/// Writes `bytes` to a file `name` in `dir`.
pub fn write_file(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}

/// `auto` first, then every concrete format.
pub fn every_format() -> impl Iterator<Item = Format> {
    std::iter::once(Format::Auto).chain(Format::ALL)
}

/// Formats whose files are one number per line: `auto` cannot tell them apart, and each reads
/// the other's files without error.
pub fn one_number_per_line(format: Format) -> bool {
    matches!(format, Format::Lirs | Format::SectorList)
}

pub struct ReadAll {
    pub requests: Vec<Request>,
    pub trace: Trace,
}

pub fn read_all(path: &Path, format: Format) -> ReadAll {
    read_all_with(path, format, &OpenOptions::default())
}

pub fn read_all_with(path: &Path, format: Format, options: &OpenOptions) -> ReadAll {
    let mut trace = trace::open_with(path, format, options)
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
