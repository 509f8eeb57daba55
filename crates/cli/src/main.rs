//! `ssdcache`: a user-space SSD cache for hard drives, served over NBD.

#[cfg(feature = "simulator")]
mod advise;
mod config;
mod control;
mod create;
mod devices;
mod generate;
mod hdd_emulator;
mod metrics;
#[cfg(feature = "simulator")]
mod mrc;
mod notify;
mod report;
mod serve;
mod signals;
#[cfg(feature = "simulator")]
mod simulate;
mod size;
mod tuning;
mod usage;
mod volume;
pub use usage::{as_usage_error, error_text, usage_error, UsageError};
mod watch;
mod wear;
mod writeback;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "ssdcache",
    version,
    about = "A user-space SSD cache for hard drives, served as a block device over NBD",
    long_about = "ssdcache puts a fast device (SSD, NVMe, RAM disk, or a file on one) in front of a slow \
one (a hard drive, a RAID, a file on one) and serves the pair as one block device over NBD. The \
backing device is never reformatted: it keeps its data at the same addresses. In write-through, \
write-around and pass-through it mounts without ssdcache at any time; in write-back the cache holds \
newer data until it is written back (`ssdcache flush`, `ssdcache detach`).\n\n\
Typical use:\n  ssdcache create --cache /dev/nvme0n1p2 --backing /dev/sdb --mode write-through\n  \
ssdcache serve --cache /dev/nvme0n1p2 --socket /run/ssdcache/sdb.sock\n  \
nbd-client -unix /run/ssdcache/sdb.sock /dev/nbd0     (or qemu, nbdfuse, nbdcopy...)\n  \
ssdcache stats --cache /dev/nvme0n1p2\n\nSee docs/operations.md and docs/design.md.",
    after_help = "Set RUST_LOG=debug for more log output.\n\n\
Exit status: 0 on success; 2 on bad usage: an unknown or missing flag, flags that conflict, a \
value that cannot be right (a malformed size, an unknown policy or volume name, a directory where \
a device or file is needed, the same device as cache and backing, a wrong setting in serve's \
config file); 1 on every other error: a path that cannot be opened, a device error, or a state \
that forbids the command (a cache holding dirty data, a device in use, a damaged superblock)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ModeArg {
    /// Writes go to the cache only and are acknowledged at SSD speed; the cleaner writes them
    /// back to the backing device later, sorted. A FLUSH or FUA makes them durable (journal
    /// commit); see docs/design.md for the durability contract.
    WriteBack,
    /// Reads fill the cache; writes go to the backing device and the cache, acknowledged after
    /// the backing write.
    WriteThrough,
    /// Reads fill the cache; writes go to the backing device only and drop cached copies.
    WriteAround,
    /// The cache is not used; every request goes to the backing device.
    PassThrough,
}

impl ModeArg {
    pub fn mode(self) -> ssdcache_format::CacheMode {
        use ssdcache_format::CacheMode;
        match self {
            ModeArg::WriteBack => CacheMode::WriteBack,
            ModeArg::WriteThrough => CacheMode::WriteThrough,
            ModeArg::WriteAround => CacheMode::WriteAround,
            ModeArg::PassThrough => CacheMode::PassThrough,
        }
    }
}

#[derive(Subcommand)]
// One command is parsed once per run: its size does not matter. (Without the simulator's
// commands, `serve`'s arguments are the one large variant left.)
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Format a cache device for a backing device (writes nothing to the backing device)
    #[command(
        long_about = "Formats PATH given by --cache as an ssdcache cache for the backing device \
given by --backing: two checksummed superblock copies recording the backing device's identity \
(size; for a block device its /dev/disk/by-id name, for a file its device, inode and creation \
time), a metadata area and a data area of cache lines. Only the cache is written; the backing \
device is opened read-only and never modified.\n\n\
Refuses, and says what to do, when: the cache is smaller than 16 MiB or holds fewer than 64 lines; \
the cache and the backing device are the same file or device; a path is a directory or a \
character device; either is in use by a running ssdcache; a size is not a multiple of 4096 bytes; \
a path cannot be opened.\n\n\
Over an existing cache: refused unless --force. A cache that holds dirty write-back data (data \
written by clients that is on no other device) is refused even with --force, naming the volumes \
and the amount; so is one that may hold some and cannot say how much (truncated, metadata \
unreadable, both superblock copies damaged; the last is refused even without --force). Write the \
data back first (`ssdcache flush`, or `ssdcache recover`), or destroy it knowingly with \
--discard-dirty-data."
    )]
    Create(create::CreateArgs),
    /// Add volumes to an existing cache (one SSD for many disks)
    #[command(
        subcommand,
        long_about = "Manages the volumes of a cache: each volume is a backing device with its own \
mode, admission and sequential cutoff, served as its own NBD export; the cache's lines are one \
pool ranked by one replacement policy, so whichever volume is hot gets the space.\n\n\
`volume add` fills a free volume slot of the superblock (32 in all) and writes nothing to the new \
backing device; `volume remove` writes the volume's dirty data back first, with progress. Both \
work while a daemon serves the cache (through its control socket: the export appears, or is \
withdrawn and drained, while the other volumes keep serving) and on a stopped cache (one that \
was not stopped cleanly must be started and stopped once first).\n\n\
Per-volume settings (admission, sequential cutoff, dirty and occupancy limits) live in serve's \
configuration file under [volume.NAME] and change while serving with a reload (SIGHUP); the \
mode changes with `ssdcache set-mode`."
    )]
    Volume(volume::VolumeCommand),
    /// Serve the volumes of a cache over NBD (foreground daemon)
    #[command(
        long_about = "Opens a cache and its backing devices, checks that each backing device is \
the one recorded at create, and serves each volume as an NBD export named after the volume (the \
empty export name reaches the first volume) on a Unix socket (mode 0600), and on TCP with --listen.\n\n\
Sockets, addresses and volume names are checked before the cache is opened: a refused start \
leaves the cache as it was (exit status 2 for bad usage, 1 for an error such as a socket in use).\n\n\
After a clean stop (SIGTERM or SIGINT: in-flight requests get up to --shutdown-timeout to finish, \
then every client socket is closed; a second signal does not wait; the cache map is written, the \
cache is marked clean) the next start is warm. If a request is stuck in a device that does not \
answer, the journal is committed instead of the map and serve exits 1; the next start replays it. \
After a crash or kill -9 the journal is replayed: \
dirty data (write-back) is recovered, clean cached data is dropped, and nothing stale is ever \
served. A volume whose cache holds dirty data is never served in front of a missing or different \
backing device.\n\n\
Write-back: a cleaner thread writes dirty data back in address order with large merged writes: \
every dirty line above --writeback-high (down to --writeback-low), and below it data older than \
--writeback-max-age; 32 writes in flight while the backing device is idle, a trickle (one write, \
then a 50 ms pause) while clients use it (a batch begun on an idle disk stops at the first \
client request that uses it). When no line can \
be freed (the cache is full of dirty data) a write goes to the backing device directly.\n\n\
Settings come from flags, from a TOML file given with --config, or both (flags win). See \
docs/operations.md for the file format. A control socket (--control) answers `ssdcache stats` \
and `ssdcache info` while the daemon runs.\n\n\
With --record-trace FILE the daemon also records the clients' requests (sampled with \
--record-sample, bounded by --record-max-size) as a trace that `ssdcache simulate`, `mrc` and \
`advise` read: measure what a bigger or smaller cache would do for your own workload."
    )]
    Serve(serve::ServeArgs),
    /// Show a cache's superblock and configuration
    Info(report::InfoArgs),
    /// Show cache statistics: live from the daemon, or offline from the devices
    #[command(
        long_about = "Prints reads, writes, read hits and misses, write hits, bytes served \
from the cache and from the backing device, and occupancy, per volume. When a daemon serves the \
cache the numbers are live (asked over its control socket); otherwise they are the counters saved \
at the last clean stop and the occupancy of the saved cache map."
    )]
    Stats(report::StatsArgs),
    /// Serve a file over NBD at the speed of a hard drive (a model, for benchmarks and demos)
    #[command(
        long_about = "Serves FILE as the NBD export \"hdd\" on a Unix socket, taking for every \
request the time a hard drive would: command overhead, a seek that grows with distance \
(settle + linear·x + sqrt·√x ms for a fraction x of the stroke), the rotational wait with the \
platter's angle tracked in real time, and a transfer rate falling from the outer to the inner \
edge. One actuator; up to --queue-depth waiting requests are reordered shortest-positioning-\
time-first; a request continuing the previous one streams. Defaults model a 7200 rpm drive: \
about 79 random 4 KiB reads per second at queue depth 1, 150-200 at 32, 250 MB/s sequential at \
the start. The data is really stored in FILE."
    )]
    HddEmulator(hdd_emulator::HddEmulatorArgs),
    /// Write all dirty data back to the backing devices now (write-back), with progress
    #[command(
        long_about = "Writes every dirty line of the cache back to its backing device, in address \
order with large merged writes, and flushes the backing device, showing bytes left, rate and ETA. \
With a running daemon (found through its control socket) the daemon's cleaner does the work at full \
speed while clients keep being served; without one, the cache is opened here (the backing devices \
are checked as `serve` checks them).\n\n\
Interrupt with Ctrl-C at any time: what was written back stays clean, and running `ssdcache flush` \
again resumes with what is left. New writes made during an online flush may leave new dirty data."
    )]
    Flush(writeback::FlushArgs),
    /// Flush, then leave the backing device a plain disk and the cache empty (daemon stopped)
    #[command(
        long_about = "Writes all dirty data back (as `ssdcache flush`, with progress; \
interruptible and resumable), then marks the cache empty. Afterwards each backing device holds all \
of its data and can be mounted or used without ssdcache; the cache device can be re-created or \
served again (it starts cold, so changes made to the backing device meanwhile are safe). Stop the \
daemon first (SIGTERM)."
    )]
    Detach(writeback::DetachArgs),
    /// Write the dirty data of a cache whose daemon is gone or will not start onto a device
    #[command(
        long_about = "Offline recovery: reads the cache's metadata (the journal is replayed after \
a crash), writes every dirty line onto the device given by --backing and flushes it, then reports \
what it wrote and marks the cache empty. --backing must be the volume's recorded backing device; \
a replacement that holds a copy of the old device is accepted with --force. Lines that cannot be \
read from the cache are reported and stay in the cache."
    )]
    Recover(writeback::RecoverArgs),
    /// Change a volume's caching mode (leaving write-back writes the dirty data back first)
    #[command(
        long_about = "Changes the mode of a volume, online through the daemon's control socket or \
offline. Leaving write-back first stops new dirty data (writes go through to the backing device), \
writes every dirty line back with progress, and only then switches; interrupted, the volume stays \
in write-back."
    )]
    SetMode(writeback::SetModeArgs),
    /// Replay a block trace against simulated caches: hit ratios, SSD writes, disk traffic
    #[command(
        long_about = "Replays a block I/O trace (a public trace, or one recorded by `ssdcache serve \
--record-trace`) against simulated caches, one for every combination of --policy, --cache-size and \
--admission, and prints for each: the hit ratio (of the cache lines the requests touch), the read \
and the write hit ratio, the bytes written to the cache device (what wears an SSD out), and the \
bytes read from and written to the backing device.\n\n\
The simulated caches run the engine's own replacement policies, admission (N-hit ghost table) and \
stream detector, not copies, so what the simulator says is what ssdcache would do, with the \
simplifications listed in docs/simulator.md (lines are cached whole; no timing). All caches are \
simulated in one pass over the trace, spread over --jobs threads; memory is about 50 bytes per \
cache line simulated.\n\n\
Sizes are bytes (1GiB) or shares of the trace's footprint (10% of the distinct lines it touches); \
the footprint takes a first pass over the trace. A trace recorded with --record-sample covers part \
of the address space: sizes and byte counts are scaled to the whole.\n\n\
Examples:\n  ssdcache simulate --trace web.trace.zst --policy lru,s3fifo --cache-size 1GiB,4GiB,16GiB\n  \
ssdcache simulate --trace sdb.trace --mode write-back --admission always,2-hit --csv > out.csv\n  \
ssdcache simulate --trace P6.lis.zst --plot p6.svg"
    )]
    #[cfg(feature = "simulator")]
    Simulate(simulate::SimulateArgs),
    /// Size an SSD cache for a workload: the size for a target hit ratio, SSD wear and cost
    #[command(
        long_about = "Reads a block I/O trace of your workload (recorded with `ssdcache serve \
--record-trace`, or any format `simulate` reads) and answers three questions:\n\n\
1. How big must the cache be to reach --target-hit-ratio? Caches of 1% to 100% of the trace's \
footprint are simulated with the engine's default policy (or --policy), then sizes between the two \
around the target, and the smallest that reaches it is reported. If none does, the best reachable \
hit ratio is: the rest are first references no cache can serve.\n\n\
2. How fast does that cache wear the SSD out? The bytes the simulated cache wrote to the cache \
device over the trace, scaled to a day by the trace's duration (its timestamps, or \
--trace-duration), against the SSD's TBW rating (--ssd-tbw; default 550 TBW per TB of cache).\n\n\
3. What does it cost? The hybrid (all the capacity in HDD plus the cache in SSD) against \
all-flash (all the capacity in SSD), in total and per TB, at --hdd-price-per-tb and \
--ssd-price-per-tb (defaults 15 and 60: rough street prices, pass yours).\n\n\
The answer is as good as the trace: it should cover a representative period (a day or a week), \
including the busy hours. A recorded trace sampled with --record-sample is scaled to the whole \
disk; see docs/simulator.md.\n\n\
Example:\n  ssdcache advise --trace /var/tmp/sdb.trace --target-hit-ratio 0.9 --capacity 8TB --ssd-tbw 600"
    )]
    #[cfg(feature = "simulator")]
    Advise(advise::AdviseArgs),
    /// The LRU miss-ratio curve of a trace over cache sizes: exact, or SHARDS with its error
    #[cfg(feature = "simulator")]
    #[command(long_about = mrc::LONG_ABOUT)]
    Mrc(mrc::MrcArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    #[command(
        long_about = "Prints the completion script for SHELL on standard output, generated from \
this program's own command-line definition. Install it where your shell looks, e.g.:\n  \
ssdcache completions bash > /usr/share/bash-completion/completions/ssdcache\n  \
ssdcache completions zsh > /usr/local/share/zsh/site-functions/_ssdcache\n  \
ssdcache completions fish > /usr/share/fish/vendor_completions.d/ssdcache.fish\n\n\
scripts/install does this for bash, zsh and fish."
    )]
    Completions(generate::CompletionsArgs),
    /// Write the manual pages (ssdcache.1 and ssdcache-COMMAND.1) into a folder
    #[command(
        long_about = "Writes the manual pages of ssdcache and of each of its commands, generated \
from the same definition as --help, into --dir (made if missing). scripts/install writes them \
into PREFIX/share/man/man1; then `man ssdcache-serve` works."
    )]
    ManPages(generate::ManPagesArgs),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let subcommand = matches.subcommand_name().unwrap_or_default().to_owned();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !matches!(cli.command, Command::Serve(_) | Command::HddEmulator(_)) {
        restore_default_sigpipe();
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let result = match cli.command {
        Command::Create(a) => create::run(a),
        Command::Volume(c) => volume::run(c),
        Command::Serve(a) => serve::run(a),
        Command::Info(a) => report::info(a),
        Command::Stats(a) => report::stats(a),
        Command::HddEmulator(a) => hdd_emulator::run(a),
        Command::Flush(a) => writeback::flush(a),
        Command::Detach(a) => writeback::detach(a),
        Command::Recover(a) => writeback::recover(a),
        Command::SetMode(a) => writeback::set_mode(a),
        #[cfg(feature = "simulator")]
        Command::Simulate(a) => simulate::run(a),
        #[cfg(feature = "simulator")]
        Command::Advise(a) => advise::run(a),
        #[cfg(feature = "simulator")]
        Command::Mrc(a) => mrc::run(a),
        Command::Completions(a) => generate::completions(a, Cli::command()),
        Command::ManPages(a) => generate::man_pages(a, Cli::command()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ssdcache: error: {}", error_text(&e));
            let status = usage::exit_status(&e);
            if status == 2 {
                eprintln!("For more information, try 'ssdcache {subcommand} --help'.");
            }
            ExitCode::from(status)
        }
    }
}

/// Where sockets go by default: /run/ssdcache for root, else the user's runtime directory.
pub fn runtime_dir() -> PathBuf {
    if unsafe_free_is_root() {
        return PathBuf::from("/run/ssdcache");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("ssdcache"),
        None => std::env::temp_dir().join("ssdcache"),
    }
}

fn unsafe_free_is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Lets `ssdcache stats | head` end quietly, as command-line tools do. Not for the daemon,
/// which must see EPIPE from a client that went away instead of dying.
fn restore_default_sigpipe() {
    // SAFETY: setting a signal disposition to SIG_DFL at start, before any other thread runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct WithSource(std::io::Error);

    impl std::fmt::Display for WithSource {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cache device /dev/null: {}", self.0)
        }
    }

    impl std::error::Error for WithSource {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_shown_by_its_wrapper_is_not_repeated() {
        let io = std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "failed to fill whole buffer",
        );
        let e = anyhow::Error::new(WithSource(io)).context("cannot read /dev/null");
        assert_eq!(
            error_text(&e),
            "cannot read /dev/null: cache device /dev/null: failed to fill whole buffer"
        );
    }

    #[test]
    fn usage_errors_are_found_in_the_chain() {
        let e = as_usage_error(anyhow::anyhow!("--threads 0 is out of range"));
        assert!(e.chain().any(|c| c.is::<UsageError>()));
        assert_eq!(error_text(&e), "--threads 0 is out of range");
    }
}
