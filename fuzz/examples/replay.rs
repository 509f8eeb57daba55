//! Runs a target's check on input files without libFuzzer or cargo-fuzz: for replaying a
//! corpus or a crash with an ordinary build (and a debugger).
//!
//! ```text
//! cd fuzz && cargo run --example replay -- nbd_server corpus/nbd_server fuzz/artifacts/nbd_server/crash-...
//! ```
//!
//! Arguments: the target, then files or directories of inputs. A failed check panics and
//! names the input; exit status 2 for bad usage.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ssdcache_fuzz::*;

fn check_of(target: &str) -> Option<fn(&[u8])> {
    Some(match target {
        "format_superblock" => format_superblock::check,
        "format_meta_page" => format_meta_page::check,
        "format_journal_block" => format_journal_block::check,
        "format_line_record" => format_line_record::check,
        "sim_trace" => sim_trace::check,
        "nbd_handshake" => nbd_handshake::check,
        "nbd_request" => nbd_request::check,
        "nbd_server" => nbd_server::check,
        _ => return None,
    })
}

fn inputs(paths: &[String]) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths.iter().map(Path::new) {
        if path.is_dir() {
            for entry in fs::read_dir(path)? {
                files.push(entry?.path());
            }
        } else {
            files.push(path.to_owned());
        }
    }
    files.sort();
    Ok(files)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((target, paths)) = args.split_first() else {
        eprintln!("usage: replay TARGET FILE_OR_DIR...");
        return ExitCode::from(2);
    };
    let Some(check) = check_of(target) else {
        eprintln!("replay: unknown target {target:?}; see scripts/fuzz list");
        return ExitCode::from(2);
    };
    let files = match inputs(paths) {
        Ok(files) => files,
        Err(error) => {
            eprintln!("replay: cannot list the inputs: {error}");
            return ExitCode::from(1);
        }
    };
    for file in &files {
        let data = match fs::read(file) {
            Ok(data) => data,
            Err(error) => {
                eprintln!("replay: cannot read {}: {error}", file.display());
                return ExitCode::from(1);
            }
        };
        eprintln!("replay: {}", file.display());
        check(&data);
    }
    println!("{target}: {} inputs passed", files.len());
    ExitCode::SUCCESS
}
