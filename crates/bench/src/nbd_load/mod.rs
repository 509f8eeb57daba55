//! `ssdcache-bench nbd-load` and `nbd-verify`: a verifying NBD load generator.
//!
//! N connections × queue depth D send a random mix of READ, WRITE (some with FUA), TRIM,
//! WRITE_ZEROES and FLUSH of 4 KiB to 1 MiB, for a bounded time and request count. Every
//! block written carries a pattern naming (block, version), and a model (model.rs) tracks
//! what every block may read as; every READ is checked against it. At the end the whole
//! export can be read back twice (`--verify`). The model can be saved and checked again
//! after a restart or a `kill -9` of the server (`--model-out`, `nbd-verify`).

mod connections;
mod memory;
mod model;
mod pattern;
mod stats;
mod workloads;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use ssdcache_device::SplitMix64;
use ssdcache_nbd::proto::{NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_TRIM, NBD_FLAG_SEND_WRITE_ZEROES};

use connections::{Ending, Plan};
use memory::{MemoryReport, MemoryWatch};
use model::{Model, Snapshot};
use pattern::BLOCK;
use workloads::{Findings, LoadPlan, LoadWorkload, Mix, ReadBack};

/// Where the server is and how the connections behave.
#[derive(Args, Debug)]
pub struct ConnectArgs {
    /// The server's Unix socket
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Export name (empty: the server's default export)
    #[arg(long, default_value = "")]
    export: String,
    /// Seconds without any reply on a connection with requests in flight (or any handshake
    /// step) before the run fails
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    io_timeout: u64,
}

#[derive(Args, Debug)]
pub struct LoadArgs {
    #[command(flatten)]
    connect: ConnectArgs,
    /// Connections, each with its own sending and receiving thread
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1024))]
    connections: u16,
    /// Requests in flight per connection
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024))]
    depth: u16,
    /// How long to send requests (the requests in flight then finish)
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    seconds: u64,
    /// Stop sending after this many requests, whichever bound comes first
    #[arg(long, default_value_t = 100_000_000, value_name = "N")]
    max_requests: u64,
    /// Smallest request (a multiple of 4KiB)
    #[arg(long, default_value = "4KiB", value_parser = parse_size, value_name = "SIZE")]
    min_size: u64,
    /// Largest READ, WRITE, TRIM or WRITE_ZEROES
    #[arg(long, default_value = "1MiB", value_parser = parse_size, value_name = "SIZE")]
    max_size: u64,
    /// Relative weights of the operations
    #[arg(long, default_value = "read=45,write=35,trim=8,zeroes=8,flush=4", value_parser = parse_mix)]
    mix: Mix,
    /// Percentage of WRITE and WRITE_ZEROES sent with FUA
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=100))]
    fua_percent: u64,
    /// Seed of every random choice [default: from the clock; printed]
    #[arg(long)]
    seed: Option<u64>,
    /// Start from this model (written by an earlier nbd-load or nbd-verify) instead of an
    /// export that reads as zeroes
    #[arg(long, value_name = "FILE")]
    model_in: Option<PathBuf>,
    /// Save the model at the end (after --verify: narrowed to what it read)
    #[arg(long, value_name = "FILE")]
    model_out: Option<PathBuf>,
    /// The server is killed during the run: losing it ends the run without error, and
    /// --model-out holds what may be read after its restart (from the last completed FLUSH on)
    #[arg(long)]
    expect_kill: bool,
    /// After the load, read the whole export back twice and check every block
    #[arg(long)]
    verify: bool,
    /// Connections (depth 8) of the read-back
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    verify_connections: u16,
    /// Sample this process's memory (/proc/PID/status) during the run
    #[arg(long, value_name = "PID")]
    server_pid: Option<u32>,
    /// Fail if the server's resident memory (VmRSS samples and VmHWM) passes this
    #[arg(long, value_parser = parse_size, value_name = "SIZE", requires = "server_pid")]
    server_memory_limit: Option<u64>,
    /// Seconds between progress lines (stderr)
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    progress: u64,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    #[command(flatten)]
    connect: ConnectArgs,
    /// The model to check against (from nbd-load --model-out or an earlier nbd-verify)
    #[arg(long, value_name = "FILE")]
    model_in: PathBuf,
    /// Save the model narrowed to what was read (a later check must read the same)
    #[arg(long, value_name = "FILE")]
    model_out: Option<PathBuf>,
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    connections: u16,
}

/// Depth of every read-back connection.
const READ_BACK_DEPTH: usize = 8;
/// Chunk of the read-back: 1 MiB, or the export's request limit if smaller.
const READ_BACK_CHUNK: u64 = 1 << 20;

fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size (examples: 4096, 4KiB, 1MiB, 2GiB)"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" | "k" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        other => return Err(format!("unknown size unit {other:?} (use KiB, MiB or GiB)")),
    };
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text} is too large"))
}

fn parse_mix(text: &str) -> Result<Mix, String> {
    let mut mix = Mix {
        read: 0,
        write: 0,
        trim: 0,
        zeroes: 0,
        flush: 0,
    };
    for part in text.split(',') {
        let (name, weight) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not NAME=WEIGHT"))?;
        let weight: u32 = weight
            .parse()
            .map_err(|_| format!("weight {weight:?} of {name} is not a number"))?;
        let slot = match name.trim() {
            "read" => &mut mix.read,
            "write" => &mut mix.write,
            "trim" => &mut mix.trim,
            "zeroes" => &mut mix.zeroes,
            "flush" => &mut mix.flush,
            other => {
                return Err(format!(
                    "unknown operation {other:?} (read, write, trim, zeroes, flush)"
                ))
            }
        };
        *slot = weight;
    }
    if mix.read + mix.write + mix.trim + mix.zeroes + mix.flush == 0 {
        return Err("every weight is 0".into());
    }
    Ok(mix)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

pub fn load(args: &LoadArgs) -> Result<()> {
    let seed = args.seed.unwrap_or_else(clock_seed);
    let plan = Plan {
        socket: &args.connect.socket,
        export: &args.connect.export,
        connections: usize::from(args.connections),
        depth: usize::from(args.depth),
        max_request: u32::try_from(args.max_size).unwrap_or(u32::MAX),
        io_timeout: Duration::from_secs(args.connect.io_timeout.max(1)),
        seed,
    };
    let watch = args.server_pid.map(MemoryWatch::start).transpose()?;
    let (halves, export) = connections::open(&plan)?;
    let load_plan = check_load_plan(args, &export)?;
    let snapshot = starting_snapshot(args.model_in.as_deref(), export.size, seed)?;
    println!(
        "nbd-load: seed {seed}, {} connections × depth {}, {} s or {} requests, export {} MiB, \
         requests {}–{} KiB, mix {:?}, FUA {}%",
        args.connections,
        args.depth,
        args.seconds,
        args.max_requests,
        export.size >> 20,
        args.min_size >> 10,
        args.max_size >> 10,
        args.mix,
        args.fua_percent
    );
    let model = Model::new(snapshot, args.expect_kill);
    let workload = LoadWorkload::new(model, load_plan, plan.connections);
    let started = Instant::now();
    let progress = |workload: &LoadWorkload| {
        let secs = started.elapsed().as_secs_f64();
        let done = workload.completed.load(Ordering::Relaxed);
        eprintln!(
            "  {secs:6.1} s: {done} requests ({:.0}/s), verify errors {}, failed requests {}",
            done as f64 / secs.max(1e-9),
            workload.findings.verify_error_count(),
            workload.findings.request_error_count()
        );
    };
    let tick = Duration::from_secs(args.progress.max(1));
    let endings = connections::run(&plan, halves, &workload, tick, || progress(&workload));
    let elapsed = started.elapsed().as_secs_f64();
    let memory = watch.map(MemoryWatch::finish);
    let stats = workload.merged_stats();
    println!(
        "load: {} requests in {elapsed:.1} s: {:.0} requests/s, {:.1} MiB/s of data",
        stats.requests(),
        stats.requests() as f64 / elapsed.max(1e-9),
        mib(stats.data_bytes()) / elapsed.max(1e-9)
    );
    print!("{}", stats.report(elapsed));
    let outcome = Outcome::of(&endings);
    let (model, findings) = workload.into_parts();
    finish_load(args, &plan, &outcome, findings, model, memory, &export)
}

/// How the connections ended, together.
struct Outcome {
    server_gone: Option<String>,
    failures: Vec<String>,
}

impl Outcome {
    fn of(endings: &[Ending]) -> Outcome {
        let mut outcome = Outcome {
            server_gone: None,
            failures: Vec::new(),
        };
        for ending in endings {
            match ending {
                Ending::Clean => {}
                Ending::ServerGone(why) => {
                    outcome.server_gone.get_or_insert_with(|| why.clone());
                }
                Ending::Failed(why) => outcome.failures.push(why.clone()),
            }
        }
        outcome
    }
}

fn finish_load(
    args: &LoadArgs,
    plan: &Plan<'_>,
    outcome: &Outcome,
    findings: Findings,
    model: Model,
    memory: Option<MemoryReport>,
    export: &ssdcache_nbd::client::ExportDetails,
) -> Result<()> {
    let mut problems = Vec::new();
    if let Some(why) = &outcome.server_gone {
        if args.expect_kill {
            println!("server went away (expected): {why}");
        } else {
            problems.push(format!("the server went away: {why}"));
        }
    }
    // With a kill expected (before or after this run ends), only the durable state counts.
    let snapshot = if args.expect_kill {
        model.snapshot_after_crash()
    } else {
        model.snapshot_now()
    };
    if let Some(path) = &args.model_out {
        snapshot.save(path)?;
        println!("model saved to {}", path.display());
    }
    if args.verify && outcome.server_gone.is_none() && outcome.failures.is_empty() {
        let chunk =
            (READ_BACK_CHUNK / BLOCK as u64).min(u64::from(export.max_request) / BLOCK as u64);
        let verify_plan = Plan {
            connections: usize::from(args.verify_connections),
            depth: READ_BACK_DEPTH,
            ..*plan
        };
        let narrowed = read_back(&verify_plan, &snapshot, chunk.max(1), &findings)?;
        if let Some(path) = &args.model_out {
            narrowed.save(path)?;
            println!(
                "model narrowed to what the read-back saw, saved to {}",
                path.display()
            );
        }
    }
    if let Some(memory) = memory {
        problems.extend(report_memory(&memory, args.server_memory_limit));
    }
    problems.extend(outcome.failures.iter().cloned());
    conclude(&findings, problems)
}

/// Prints the findings and a result line; an error if anything failed.
fn conclude(findings: &Findings, mut problems: Vec<String>) -> Result<()> {
    for message in findings.messages() {
        println!("{message}");
    }
    let verify_errors = findings.verify_error_count();
    let request_errors = findings.request_error_count();
    if verify_errors > 0 {
        problems.push(format!("{verify_errors} verify errors"));
    }
    if request_errors > 0 {
        problems.push(format!("{request_errors} requests failed"));
    }
    let verdict = if problems.is_empty() { "ok" } else { "FAILED" };
    println!("result: {verdict} verify_errors={verify_errors} request_errors={request_errors}");
    if problems.is_empty() {
        return Ok(());
    }
    bail!("{}", problems.join("; "))
}

fn report_memory(memory: &MemoryReport, limit: Option<u64>) -> Option<String> {
    let peak = memory.peak_rss.max(memory.hwm);
    println!(
        "server memory: VmRSS {:.1} MiB at the start, {:.1} MiB peak, {:.1} MiB at the end; \
         VmHWM {:.1} MiB ({} samples){}",
        mib(memory.first_rss),
        mib(memory.peak_rss),
        mib(memory.last_rss),
        mib(memory.hwm),
        memory.samples,
        limit.map_or(String::new(), |l| format!("; limit {:.1} MiB", mib(l)))
    );
    let limit = limit?;
    (peak > limit).then(|| {
        format!(
            "the server's resident memory reached {:.1} MiB, over the limit of {:.1} MiB",
            mib(peak),
            mib(limit)
        )
    })
}

fn check_load_plan(
    args: &LoadArgs,
    export: &ssdcache_nbd::client::ExportDetails,
) -> Result<LoadPlan> {
    let block = BLOCK as u64;
    if export.size < block || !export.size.is_multiple_of(block) {
        bail!(
            "the export is {} bytes; the load needs a multiple of 4KiB",
            export.size
        );
    }
    if export.min_block as u64 > block {
        bail!(
            "the export needs {}-byte alignment; the load uses 4KiB blocks",
            export.min_block
        );
    }
    if export.flags & NBD_FLAG_READ_ONLY != 0 {
        bail!("the export is read-only; the load writes");
    }
    if args.mix.trim > 0 && export.flags & NBD_FLAG_SEND_TRIM == 0 {
        bail!("the export does not offer TRIM: give --mix with trim=0");
    }
    if args.mix.zeroes > 0 && export.flags & NBD_FLAG_SEND_WRITE_ZEROES == 0 {
        bail!("the export does not offer WRITE_ZEROES: give --mix with zeroes=0");
    }
    let sizes_ok = args.min_size >= block
        && args.min_size <= args.max_size
        && args.min_size.is_multiple_of(block)
        && args.max_size.is_multiple_of(block);
    if !sizes_ok {
        bail!("--min-size and --max-size must be multiples of 4KiB with min <= max");
    }
    if args.max_size > u64::from(export.max_request) {
        bail!(
            "--max-size {} is over the server's request limit {}",
            args.max_size,
            export.max_request
        );
    }
    Ok(LoadPlan {
        mix: args.mix,
        fua_percent: args.fua_percent,
        min_blocks: args.min_size / block,
        max_blocks: (args.max_size / block).min(export.size / block),
        deadline: Instant::now() + Duration::from_secs(args.seconds),
        max_requests: args.max_requests,
    })
}

fn starting_snapshot(model_in: Option<&Path>, export_size: u64, seed: u64) -> Result<Snapshot> {
    let blocks = export_size / BLOCK as u64;
    let Some(path) = model_in else {
        return Ok(Snapshot::zeroed(blocks, SplitMix64(seed).next_u64()));
    };
    let snapshot = Snapshot::load(path)?;
    if snapshot.blocks.len() as u64 != blocks {
        bail!(
            "model {} has {} blocks but the export has {blocks}",
            path.display(),
            snapshot.blocks.len()
        );
    }
    Ok(snapshot)
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// Two passes over the whole export; returns the snapshot narrowed to what was read.
fn read_back(
    plan: &Plan<'_>,
    snapshot: &Snapshot,
    chunk_blocks: u64,
    findings: &Findings,
) -> Result<Snapshot> {
    let mut workload = ReadBack::new(snapshot, chunk_blocks, findings);
    for pass in 1..=2 {
        if pass == 2 {
            workload.start_second_pass();
        }
        let started = Instant::now();
        let (halves, export) = connections::open::<u64>(plan)?;
        if export.size / BLOCK as u64 != snapshot.blocks.len() as u64 {
            bail!("the export changed size to {} bytes", export.size);
        }
        let endings = connections::run(plan, halves, &workload, Duration::from_secs(3600), || {});
        let outcome = Outcome::of(&endings);
        if let Some(why) = outcome.server_gone.or(outcome.failures.into_iter().next()) {
            bail!("read-back pass {pass} failed: {why}");
        }
        let secs = started.elapsed().as_secs_f64();
        let bytes = workload.bytes.swap(0, Ordering::Relaxed);
        println!(
            "read-back pass {pass}: {:.0} MiB in {secs:.1} s ({:.0} MiB/s)",
            mib(bytes),
            mib(bytes) / secs.max(1e-9)
        );
    }
    let (zero, data) = workload.counts();
    println!(
        "read-back: {} blocks checked twice: {data} hold data, {zero} read as zeroes",
        snapshot.blocks.len()
    );
    Ok(workload.narrowed())
}

pub fn verify(args: &VerifyArgs) -> Result<()> {
    let snapshot = Snapshot::load(&args.model_in)?;
    let plan = Plan {
        socket: &args.connect.socket,
        export: &args.connect.export,
        connections: usize::from(args.connections),
        depth: READ_BACK_DEPTH,
        max_request: READ_BACK_CHUNK as u32,
        io_timeout: Duration::from_secs(args.connect.io_timeout.max(1)),
        seed: 0,
    };
    let findings = Findings::default();
    let narrowed = read_back(&plan, &snapshot, READ_BACK_CHUNK / BLOCK as u64, &findings)?;
    if let Some(path) = &args.model_out {
        narrowed.save(path)?;
        println!(
            "model narrowed to what was read, saved to {}",
            path.display()
        );
    }
    conclude(&findings, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_mixes_parse_with_clear_errors() {
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("8192"), Ok(8192));
        assert!(parse_size("4XB").unwrap_err().contains("unit"));
        let mix = parse_mix("read=1,flush=2").unwrap();
        assert_eq!((mix.read, mix.write, mix.flush), (1, 0, 2));
        assert!(parse_mix("reads=1")
            .unwrap_err()
            .contains("unknown operation"));
        assert!(parse_mix("read=0").is_err());
    }
}
