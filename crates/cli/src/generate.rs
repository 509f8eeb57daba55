//! Manual pages and shell completions, generated from the CLI definition itself so they say
//! exactly what `--help` says (`scripts/install` installs both).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use clap_complete::Shell;

#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell to complete for
    #[arg(value_enum)]
    shell: Shell,
}

#[derive(Args)]
pub struct ManPagesArgs {
    /// Folder to write the pages into (made if missing): ssdcache.1 and ssdcache-COMMAND.1
    /// for each command, e.g. /usr/local/share/man/man1
    #[arg(long, value_name = "DIR")]
    dir: PathBuf,
}

/// Prints the completion script of `shell` on standard output.
pub fn completions(args: CompletionsArgs, mut cli: clap::Command) -> Result<()> {
    // Into memory first: clap_complete panics when its writer fails (a closed pipe), and a
    // failed write here must be an error, not a panic.
    let mut out = Vec::new();
    clap_complete::generate(args.shell, &mut cli, "ssdcache", &mut out);
    use std::io::Write;
    std::io::stdout()
        .write_all(&out)
        .context("cannot write the completion script to standard output")
}

/// Writes a page for `ssdcache` and one for each of its commands into `--dir`.
pub fn man_pages(args: ManPagesArgs, cli: clap::Command) -> Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("cannot make the folder {}", args.dir.display()))?;
    clap_mangen::generate_to(cli, &args.dir)
        .with_context(|| format!("cannot write the manual pages into {}", args.dir.display()))?;
    let mut pages: Vec<String> = std::fs::read_dir(&args.dir)
        .with_context(|| format!("cannot list {}", args.dir.display()))?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("ssdcache") && name.ends_with(".1"))
        .collect();
    pages.sort();
    println!(
        "wrote {} manual pages into {}: {}",
        pages.len(),
        args.dir.display(),
        pages.join(" ")
    );
    Ok(())
}
