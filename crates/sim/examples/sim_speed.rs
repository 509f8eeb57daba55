//! The simulator's own loop, without the trace reader: reads a trace into memory, then times
//! `simulate::run` (one thread, one cache) per policy and prints block references per CPU
//! second of the process. bench/sim-speed measures the whole `ssdcache simulate` instead.
//!
//! `cargo run --release -p ssdcache-sim --example sim_speed -- TRACE FORMAT CACHE_BLOCKS [POLICY,...] [REPEATS]`
//!
//! e.g. `... -- ../shared/traces/arc/P6.lis.zst arc 10190 lru,s3fifo 5`. CPU time comes from
//! /proc/self/stat (10 ms ticks), so each policy runs REPEATS times (default 5) in a row.

use std::path::Path;
use std::process::ExitCode;

use ssdcache_engine::admission::Admission;
use ssdcache_sim::simulate::{self, Mode, SimConfig};
use ssdcache_sim::trace::{self, Request};

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> Result<f64, String> {
    let stat = std::fs::read_to_string("/proc/self/stat").map_err(|e| e.to_string())?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or("bad /proc/self/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks = |i: usize| -> Result<f64, String> {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| format!("/proc/self/stat field {}", i + 3))
    };
    // USER_HZ is 100 on Linux.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, format, blocks, rest @ ..] = &args[..] else {
        return Err("usage: sim_speed TRACE FORMAT CACHE_BLOCKS [POLICY,...] [REPEATS]".into());
    };
    let format: trace::Format = format.parse().map_err(|e| format!("{e}"))?;
    let blocks: u64 = blocks
        .parse()
        .map_err(|_| format!("{blocks}: not a number"))?;
    let policies = rest.first().map_or("lru,s3fifo", String::as_str);
    let repeats: u32 = match rest.get(1) {
        Some(r) => r.parse().map_err(|_| format!("{r}: not a number"))?,
        None => 5,
    };
    let requests: Vec<Request> = trace::open(Path::new(path), format)
        .map_err(|e| e.to_string())?
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    for policy in policies.split(',') {
        let config = SimConfig {
            policy: policy.to_owned(),
            cache_lines: blocks,
            line_size: 4096,
            admission: Admission::Always,
            sequential_cutoff: 0,
            mode: Mode::WriteThrough,
            writeback: Default::default(),
        };
        let start = cpu_seconds()?;
        let mut references = 0;
        let mut miss_ratio = 0.0;
        for _ in 0..repeats {
            let results = simulate::run(
                requests.iter().map(|r| Ok::<_, ()>(*r)),
                std::slice::from_ref(&config),
                1,
            )
            .map_err(|e| e.to_string())?
            .map_err(|()| "no trace error expected".to_owned())?;
            let c = &results[0].counters;
            references += c.read_refs + c.write_refs;
            miss_ratio = 1.0 - c.hit_ratio();
        }
        let cpu = cpu_seconds()? - start;
        println!(
            "{policy}: {references} references in {cpu:.2} CPU s: {:.2} M/CPU s (miss ratio {miss_ratio:.4})",
            references as f64 / cpu / 1e6
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sim_speed: {e}");
            ExitCode::FAILURE
        }
    }
}
