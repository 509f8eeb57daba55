//! Simulated power cuts in write-back mode, one thread per workload (see crashsim/mod.rs for
//! the simulator; crash_concurrent.rs runs the concurrent workloads). Each seed picks a
//! replacement policy and a line size (every pair within 24 seeds: 8 policies, 3 sizes), a
//! journal small enough that compactions run every few commits, injected write and flush
//! errors on both devices for two thirds of the workloads, and the device ops after which the
//! power is cut. The workload mixes writes (some FUA), streams past a small sequential
//! cutoff, WRITE_ZEROES, TRIM, FLUSH, live reads, writeback batches, commits, mode changes
//! and clean restarts.
//!
//! CI runs 16,000 crash points here (and 12,000 in crash_concurrent.rs). The long
//! run, one million:
//!   SSDCACHE_CRASH_POINTS=1000000 cargo test --release -p ssdcache-engine --test crash -- --nocapture
//! A failure prints its seed; `SSDCACHE_CRASH_SEED=N` replays that workload alone.

mod crashsim;

#[test]
fn write_back_survives_power_cuts_inside_operations() {
    crashsim::run_test(crashsim::Kind::Sequential, 16_000);
}

/// Seeds past the default run that once caught a defect: 179 fails when fills overwrite the
/// sectors a durable record may still call dirty (review 3, R3-4); 2791 when a failed fresh
/// generation loses the change list's clean slots, and a FLUSH after a mode change then skips
/// the commit while the journal still names superseded dirty data (the million-point run).
#[test]
fn seeds_that_caught_defects() {
    crashsim::run_seeds(crashsim::Kind::Sequential, &[179, 2791]);
}
