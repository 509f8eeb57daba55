//! The table of docs/libcachesim-parity.md: our miss ratios against libCacheSim's `cachesim`
//! (`bench/libcachesim/reference.csv`) on every shared trace, at every size of the reference,
//! for LRU, FIFO, CLOCK, ARC and S3-FIFO, with our S3-FIFO 1-bit and LIRS for information.
//!
//! `SSDCACHE_TRACES=DIR cargo run --release -p ssdcache-sim --example parity_table [-- --jobs N] [-- --update FILE]`
//! (DIR: the shared traces folder; a relative path is taken from the workspace root)
//!
//! Prints the Markdown; with `--update FILE` it replaces what lies between the lines
//! `<!-- parity-table:begin -->` and `<!-- parity-table:end -->` of FILE instead.

#[path = "../tests/parity/mod.rs"]
mod parity;
#[path = "../tests/common/shared_traces.rs"]
mod shared_traces;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use parity::{by_trace, printed, read_reference, simulate_trace, Reference, REFERENCE_CSV};

const COMPARED: [&str; 5] = ["lru", "fifo", "clock", "arc", "s3fifo"];
const OURS_ONLY: [&str; 2] = ["s3fifo-1bit", "lirs"];
/// The percentages of the footprint bench/libcachesim/reference sizes caches at.
const PERCENTS: [u64; 6] = [1, 2, 5, 10, 20, 50];
const BEGIN: &str = "<!-- parity-table:begin -->";
const END: &str = "<!-- parity-table:end -->";

struct Args {
    jobs: usize,
    update: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        jobs: 2,
        update: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--jobs" => {
                let v = value()?;
                args.jobs = v.parse().map_err(|_| format!("--jobs {v}: not a number"))?;
            }
            "--update" => args.update = Some(PathBuf::from(value()?)),
            _ => {
                return Err(format!(
                    "unknown argument {arg:?}; see the example's header"
                ))
            }
        }
    }
    Ok(args)
}

/// Our miss ratio for each (policy, size) of one trace.
type Ours = BTreeMap<(String, u64), f64>;

/// Per policy: the worst difference (|diff|, trace, size) and the rows compared.
type Worst = BTreeMap<&'static str, (f64, String, u64, u32)>;

fn percent_label(unique: u64, blocks: u64) -> String {
    PERCENTS
        .iter()
        .find(|&&pct| (unique * pct / 100).max(1) == blocks)
        .map_or_else(|| "?".to_owned(), |pct| format!("{pct}%"))
}

/// cachesim's S3-FIFO caches nothing below 20 objects: no reference there.
fn is_reference(policy: &str, blocks: u64) -> bool {
    !(policy == "s3fifo" && blocks < 20)
}

fn trace_table(trace: &str, rows: &[&Reference], ours: &Ours, worst: &mut Worst) -> String {
    let mut out = String::new();
    let (unique, requests) = (rows[0].unique_blocks, rows[0].requests);
    let _ = writeln!(
        out,
        "### {trace}\n\n{unique} unique blocks, {requests} block references.\n"
    );
    let _ = writeln!(
        out,
        "| cache (blocks) | LRU | FIFO | CLOCK | ARC | S3-FIFO | S3-FIFO 1-bit | LIRS |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---:|---:|");
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.cache_blocks).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for blocks in sizes {
        let mut line = format!("| {blocks} ({}) |", percent_label(unique, blocks));
        for policy in COMPARED {
            let theirs = rows
                .iter()
                .find(|r| r.policy == policy && r.cache_blocks == blocks);
            let mine = ours.get(&(policy.to_owned(), blocks));
            let cell = match (mine, theirs) {
                (Some(&m), Some(t)) if is_reference(policy, blocks) => {
                    let diff = (printed(m) - t.miss_ratio).abs();
                    let w = worst.entry(policy).or_insert((0.0, String::new(), 0, 0));
                    w.3 += 1;
                    if diff > w.0 + 1e-9 {
                        (w.0, w.1, w.2) = (diff, trace.to_owned(), blocks);
                    }
                    format!(" {m:.4} / {:.4} |", t.miss_ratio)
                }
                (Some(&m), Some(t)) => format!(" {m:.4} / ({:.4}) |", t.miss_ratio),
                (Some(&m), None) => format!(" {m:.4} / – |"),
                (None, _) => " – |".to_owned(),
            };
            line.push_str(&cell);
        }
        for policy in OURS_ONLY {
            match ours.get(&(policy.to_owned(), blocks)) {
                Some(m) => {
                    let _ = write!(line, " {m:.4} |");
                }
                None => line.push_str(" – |"),
            }
        }
        let _ = writeln!(out, "{line}");
    }
    out
}

fn summary(worst: &Worst) -> String {
    let mut out = String::from(
        "| policy | rows compared | max \\|ours − cachesim\\| | where |\n|---|---:|---:|---|\n",
    );
    for policy in COMPARED {
        let (diff, trace, blocks, rows) =
            worst
                .get(policy)
                .cloned()
                .unwrap_or((0.0, "–".to_owned(), 0, 0));
        let place = if diff > 0.000_05 {
            format!("{trace}, {blocks} blocks")
        } else {
            "every row equal to 4 decimals".to_owned()
        };
        let _ = writeln!(out, "| {policy} | {rows} | {diff:.4} | {place} |");
    }
    out
}

fn build_tables(jobs: usize) -> Result<String, String> {
    let reference = read_reference(Path::new(REFERENCE_CSV))?;
    let mut worst = Worst::new();
    let mut tables = String::new();
    for (trace, rows) in by_trace(&reference) {
        let mut sizes: Vec<u64> = rows.iter().map(|r| r.cache_blocks).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let caches: Vec<(String, u64)> = COMPARED
            .iter()
            .chain(&OURS_ONLY)
            .flat_map(|p| sizes.iter().map(|&n| ((*p).to_owned(), n)))
            .collect();
        eprintln!("{trace}: {} caches", caches.len());
        let ours: Ours = simulate_trace(trace, &caches, jobs)?
            .into_iter()
            .map(|o| ((o.policy, o.cache_blocks), o.miss_ratio))
            .collect();
        tables.push_str(&trace_table(trace, &rows, &ours, &mut worst));
        tables.push('\n');
    }
    Ok(format!("{BEGIN}\n\n{}\n{tables}{END}\n", summary(&worst)))
}

fn update(file: &Path, tables: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let (Some(start), Some(end)) = (text.find(BEGIN), text.find(END)) else {
        return Err(format!(
            "{}: no {BEGIN} ... {END} lines to replace",
            file.display()
        ));
    };
    if end < start {
        return Err(format!("{}: {END} comes before {BEGIN}", file.display()));
    }
    let after = text[end + END.len()..].trim_start_matches('\n');
    let new = format!("{}{tables}{after}", &text[..start]);
    std::fs::write(file, new).map_err(|e| format!("{}: {e}", file.display()))
}

fn main() -> ExitCode {
    let result = parse_args().and_then(|args| {
        let tables = build_tables(args.jobs)?;
        match args.update {
            Some(file) => update(&file, &tables),
            None => {
                print!("{tables}");
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("parity_table: {e}");
            ExitCode::FAILURE
        }
    }
}
