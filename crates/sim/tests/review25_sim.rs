//! Review 25 (db847ce, reverted in 916f3db): the simulator keeps a `Streams` per volume of
//! every simulated cache, and db847ce gave each a table of 32768 notes (256 KiB), touched at
//! random places. Multi-volume traces (the Tencent CBS sample: 2 038 volumes) then cost up to
//! 256 KiB per volume per simulated configuration, where the rest of the simulator's state is
//! about 50 bytes per cache line. Passes on main (RSS +60 MiB here), failed on db847ce: the
//! bar for any per-volume detector state.

use ssdcache_engine::admission::Admission;
use ssdcache_sim::simulate::{Mode, SimConfig, Simulation, WritebackModel};
use ssdcache_sim::trace::{Op, Request};

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .expect("VmRSS")
}

/// 2 038 volumes, 32 blocks of 4 KiB each read twice (the second read a hit), in one
/// simulated cache with the default cutoff.
#[test]
fn r25_4_a_trace_of_many_volumes_does_not_cost_256_kib_of_stream_notes_per_volume() {
    let config = SimConfig {
        policy: "lru".into(),
        cache_lines: 1 << 20,
        line_size: 4096,
        admission: Admission::Always,
        sequential_cutoff: 4 << 20,
        mode: Mode::WriteThrough,
        writeback: WritebackModel::default(),
    };
    let before = rss_kib();
    let mut sim = Simulation::new(config).expect("simulation");
    let mut x = 1u64;
    for volume in 0..2038u32 {
        for _ in 0..32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let offset = (x >> 20) % (1 << 18) * 4096;
            for _ in 0..2 {
                sim.request(&Request {
                    time_ns: 0,
                    volume,
                    op: Op::Read,
                    offset,
                    len: 4096,
                });
            }
        }
    }
    let grown = (rss_kib() - before) / 1024;
    println!("2 038 volumes: RSS grew by {grown} MiB");
    let result = sim.finish();
    assert!(
        result.counters.read_hits >= 2038 * 32,
        "the second reads hit"
    );
    assert!(
        grown < 128,
        "one simulated cache of a 2 038-volume trace grew by {grown} MiB (db847ce^: 60 MiB)"
    );
}
