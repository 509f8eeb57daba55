//! `--format auto`: the format is told from the first bytes of the decompressed content, by
//! reading them with every format's own reader; the file name's extension only breaks ties.

use std::io::{self, BufRead};
use std::path::Path;
use std::sync::Arc;

use super::input::{name_without_compression, ErrorContext, Source};
use super::oracle_general::{decode, RECORD_BYTES};
use super::{build_parser, Format, OpenOptions, TraceError};

/// Requests a reader must read from the first bytes without an error to be a candidate.
const TRIAL_REQUESTS: usize = 64;
/// A cut of the first bytes that ends on a record boundary of every binary format
/// (24, 32 and 40 bytes).
const BINARY_CUT: usize = 480;

pub(crate) fn detect(source: &Source, options: &OpenOptions) -> Result<Format, TraceError> {
    let prefix = &source.prefix;
    if prefix.starts_with(b"# ssdcache-trace") {
        return Ok(Format::Ssdcache);
    }
    if prefix.starts_with(b"fio version ") {
        return Ok(Format::FioIolog);
    }
    let binary = looks_binary(prefix);
    let sample = trial_bytes(prefix, source.prefix_is_all, binary);
    let candidates: Vec<Format> = Format::ALL
        .into_iter()
        .filter(|format| format.is_binary() == binary)
        .filter(|&format| trial(format, &source.ctx, sample, options).is_ok())
        .collect();
    let hints = extension_hints(&source.ctx.path);
    match candidates.as_slice() {
        [only] => Ok(*only),
        [] => Err(not_recognised(source, sample, binary, &hints, options)),
        several => {
            let hinted: Vec<Format> = several
                .iter()
                .copied()
                .filter(|format| hints.contains(format))
                .collect();
            match hinted.as_slice() {
                [only] => Ok(*only),
                _ => Err(ambiguous(&source.ctx, several)),
            }
        }
    }
}

/// Text traces are printable ASCII (or UTF-8) and whitespace; binary records have zeros and
/// control bytes.
fn looks_binary(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .any(|&b| b < 0x09 || (0x0e..0x20).contains(&b) || b == 0x7f)
}

/// The first bytes cut at the last complete line (text) or record (binary), unless they are
/// the whole stream.
fn trial_bytes(prefix: &[u8], prefix_is_all: bool, binary: bool) -> &[u8] {
    if prefix_is_all {
        return prefix;
    }
    if binary {
        return &prefix[..prefix.len() - prefix.len() % BINARY_CUT];
    }
    match prefix.iter().rposition(|&b| b == b'\n') {
        Some(newline) => &prefix[..=newline],
        None => prefix,
    }
}

/// Reads up to [`TRIAL_REQUESTS`] requests of `sample` as `format`: an error if any fails or
/// there are none.
fn trial(
    format: Format,
    ctx: &Arc<ErrorContext>,
    sample: &[u8],
    options: &OpenOptions,
) -> Result<(), TraceError> {
    let input: Box<dyn BufRead + Send> = Box::new(io::Cursor::new(sample.to_vec()));
    let mut parser = build_parser(format, Arc::clone(ctx), input, sample, options)?;
    let mut requests = 0;
    while requests < TRIAL_REQUESTS {
        match parser.next_request()? {
            Some(_) => requests += 1,
            None => break,
        }
    }
    if requests == 0 {
        return Err(ctx.file_error(format!(
            "no read or write request in the first {} bytes",
            sample.len()
        )));
    }
    if format == Format::OracleGeneral && !plausible_oracle_general(sample) {
        return Err(ctx.file_error(
            "the next_access_vtime fields of the first records do not point at later records of the same object",
        ));
    }
    Ok(())
}

/// Any 24 bytes decode as an oracleGeneral record; what tells the format is that each
/// `next_access_vtime` is -1 (never again) or the 1-based number of a later record of the same
/// object (libCacheSim's converter counts records from 1).
fn plausible_oracle_general(sample: &[u8]) -> bool {
    let records: Vec<_> = sample
        .chunks_exact(RECORD_BYTES)
        .take(TRIAL_REQUESTS * 4)
        .map(|chunk| {
            let mut record = [0u8; RECORD_BYTES];
            record.copy_from_slice(chunk);
            decode(&record)
        })
        .collect();
    let mut confirmed = 0;
    for (index, record) in records.iter().enumerate() {
        let next = record.next_access_vtime;
        if next == -1 || next == i64::MAX {
            confirmed += 1;
            continue;
        }
        let Some(next) = usize::try_from(next)
            .ok()
            .and_then(|number| number.checked_sub(1))
        else {
            return false;
        };
        if next <= index {
            return false;
        }
        if let Some(later) = records.get(next) {
            if later.obj_id != record.obj_id {
                return false;
            }
            confirmed += 1;
        }
    }
    confirmed > 0
}

/// Formats the file name suggests, to choose among formats the content fits equally.
fn extension_hints(path: &Path) -> Vec<Format> {
    let name = name_without_compression(path);
    let rules: [(&str, &[Format]); 9] = [
        (".lis", &[Format::Arc]),
        (".vscsi", &[Format::Vscsi]),
        (".bin", &[Format::OracleGeneral]),
        (".oraclegeneral", &[Format::OracleGeneral]),
        (".blkparse", &[Format::Blkparse]),
        (".iolog", &[Format::FioIolog]),
        (".trc", &[Format::Lirs]),
        (".lirs", &[Format::Lirs]),
        (".trace", &[Format::Lirs, Format::Disksim]),
    ];
    let mut hints: Vec<Format> = rules
        .iter()
        .filter(|(extension, _)| name.ends_with(extension))
        .flat_map(|(_, formats)| formats.iter().copied())
        .collect();
    if name.contains("oraclegeneral") {
        hints.push(Format::OracleGeneral);
    }
    hints
}

fn format_list(formats: &[Format]) -> String {
    formats
        .iter()
        .map(|format| format!("{format} ({})", format.description()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn ambiguous(ctx: &ErrorContext, candidates: &[Format]) -> TraceError {
    ctx.file_error(format!(
        "cannot tell the trace format: the content reads as any of {}; pass --format with the right one (formats: {})",
        format_list(candidates),
        Format::names_list()
    ))
}

fn not_recognised(
    source: &Source,
    sample: &[u8],
    binary: bool,
    hints: &[Format],
    options: &OpenOptions,
) -> TraceError {
    let kind = if binary { "binary" } else { "text" };
    let mut message = format!(
        "not a trace of a known format (the content is {kind}; formats: {}); pass --format FORMAT to read it as one",
        format_list(&Format::ALL)
    );
    // The format the name suggests says best what is wrong with the content.
    if let Some(&hinted) = hints.first() {
        if let Err(error) = trial(hinted, &source.ctx, sample, options) {
            message.push_str(&format!(
                ". Read as {hinted} (its name suggests so): {error}"
            ));
        }
    }
    source.ctx.file_error(message)
}
