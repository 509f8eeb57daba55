//! Simulated power cuts in write-back mode with 2-4 threads per workload making requests at
//! once (writes and FUA writes racing FLUSHes, streams written around the cache, WRITE_ZEROES,
//! TRIM, writeback batches, commits, mode changes), run by shuttle's randomized scheduler with
//! every device call a scheduling point; the seed of a workload fixes its requests and its
//! interleaving, so a failure replays exactly (on the same code: a change to the engine changes
//! the interleavings a seed gives). Each thread owns its sectors (in runs of 8,
//! inside lines all threads share), which keeps the contract exact: a FLUSH covers every
//! write completed before it started. See crashsim/mod.rs.
//!
//! Needs the engine's `shuttle` feature:
//!   cargo test --release -p ssdcache-engine --features shuttle --test crash_concurrent -- --nocapture
//! CI runs 12,000 crash points; `SSDCACHE_CRASH_POINTS=N` scales it (one million for the long
//! run), and `SSDCACHE_CRASH_SEED=N` replays one workload.

mod crashsim;

#[test]
fn concurrent_write_back_survives_power_cuts_inside_operations() {
    crashsim::run_test(crashsim::Kind::Concurrent, 12_000);
}
