//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-*`: small,
//! valid examples (superblocks, checkpoint pages, journal blocks and line records the format
//! code encodes; a few records of every trace format, some compressed; NBD sessions of real
//! clients' shapes). Every seed is checked: the decoders accept it, the trace readers read
//! it without an error, and the target's own check passes on it.
//!
//! ```text
//! cd fuzz && cargo run --example seeds
//! ```

use std::fs;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};

use ssdcache_fuzz::*;
use ssdcache_sim::trace::{from_reader, Format, OpenOptions};

/// A target's name, its seeds, and its check.
type Target = (&'static str, Vec<Vec<u8>>, fn(&[u8]));

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let targets: [Target; 8] = [
        (
            "format_superblock",
            format_superblock::seeds(),
            format_superblock::check,
        ),
        (
            "format_meta_page",
            format_meta_page::seeds(),
            format_meta_page::check,
        ),
        (
            "format_journal_block",
            format_journal_block::seeds(),
            format_journal_block::check,
        ),
        (
            "format_line_record",
            format_line_record::seeds(),
            format_line_record::check,
        ),
        ("sim_trace", trace_seeds()?, sim_trace::check),
        (
            "nbd_handshake",
            nbd_handshake::seeds(),
            nbd_handshake::check,
        ),
        ("nbd_request", nbd_request::seeds(), nbd_request::check),
        ("nbd_server", nbd_server::seeds(), nbd_server::check),
    ];
    for (target, seeds, check) in targets {
        let dir = corpus.join(target);
        fs::create_dir_all(&dir)?;
        for (index, seed) in seeds.iter().enumerate() {
            check(seed);
            let path: PathBuf = dir.join(format!("seed-{index:02}"));
            fs::write(&path, seed)?;
        }
        println!("{target}: {} seeds in {}", seeds.len(), dir.display());
    }
    Ok(())
}

/// Each trace seed for its own format and for `auto`, plus compressed copies of some.
fn trace_seeds() -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error>> {
    let mut seeds = Vec::new();
    for (format, choices, content) in sim_trace::seeds() {
        assert_reads(format, choices, &content);
        seeds.push(input(format, choices, &content));
        if format != Format::Auto && format != Format::SectorList && format != Format::Lirs {
            seeds.push(input(Format::Auto, choices, &content));
        }
        match format {
            Format::Msr => seeds.push(input(
                format,
                0,
                &zstd::encode_all(Cursor::new(&content), 3)?,
            )),
            Format::Blkparse => {
                let mut gzip =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gzip.write_all(&content)?;
                seeds.push(input(Format::Auto, 0, &gzip.finish()?));
            }
            _ => {}
        }
    }
    Ok(seeds)
}

fn input(format: Format, choices: u8, content: &[u8]) -> Vec<u8> {
    let mut seed = vec![sim_trace::selector_of(format), choices];
    seed.extend_from_slice(content);
    seed
}

/// A seed must be a valid trace: it opens, and reads to its end without an error.
fn assert_reads(format: Format, choices: u8, content: &[u8]) {
    let reader = Box::new(Cursor::new(content.to_vec()));
    let name = sim_trace::name_of(choices);
    let trace = from_reader(name, reader, format, &OpenOptions::default())
        .unwrap_or_else(|error| panic!("{format} seed: {error}"));
    let mut requests = 0;
    for request in trace {
        if let Err(error) = request {
            panic!("{format} seed: {error}");
        }
        requests += 1;
    }
    assert!(requests > 0, "{format} seed has no request");
}
