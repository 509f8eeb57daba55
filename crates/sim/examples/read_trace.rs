//! Reads a trace to its end and prints what it holds and how fast it was read:
//! `cargo run --release -p ssdcache-sim --example read_trace -- FILE [FORMAT]`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ssdcache_sim::trace::{self, block_keys, Format, Op};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next().map(PathBuf::from) else {
        eprintln!("usage: read_trace FILE [FORMAT]");
        return ExitCode::FAILURE;
    };
    let format = match args.next().map(|name| name.parse::<Format>()) {
        None => Format::Auto,
        Some(Ok(format)) => format,
        Some(Err(error)) => {
            eprintln!("{error}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let mut trace = match trace::open(&path, format) {
        Ok(trace) => trace,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::FAILURE;
        }
    };
    let (mut requests, mut writes, mut bytes, mut blocks) = (0u64, 0u64, 0u64, 0u64);
    for request in trace.by_ref() {
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                eprintln!("{error}");
                return ExitCode::FAILURE;
            }
        };
        requests += 1;
        writes += u64::from(request.op == Op::Write);
        bytes += request.len;
        blocks += block_keys(&request, 4096).len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    let info = trace.info();
    println!(
        "{}: {} ({}), {requests} requests ({writes} writes), {bytes} bytes, {blocks} 4 KiB block references, {} volumes, {} skipped records, sample rate {}",
        path.display(),
        info.format,
        info.compression,
        trace.volume_names().len(),
        trace.skipped_records(),
        info.sample_rate
    );
    println!(
        "read in {seconds:.3} s: {:.2} M requests/s",
        requests as f64 / seconds / 1e6
    );
    ExitCode::SUCCESS
}
