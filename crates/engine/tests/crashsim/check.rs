//! The checks at each crash point: reopen what the power cut left (journal replay), read every
//! sector the workload touched (and a few it never did) and hold each against the contract;
//! then write everything back, restart, and read the same again (no flip-flop); for one of the
//! ways each cut is materialized, cut the power a second time during that writeback and read
//! the same once more.

use std::collections::BTreeMap;
use std::sync::Arc;

use ssdcache_device::{BlockDevice, SplitMix64 as Rng};
use ssdcache_devsim::{CrashClock, CrashDevice, CrashState, Keep};
use ssdcache_engine::{Cache, CleanerConfig};

use super::contract::Contract;
use super::coverage::{classify, Classified, Stats, BACKING_DEV, CACHE_DEV};
use super::workload::{try_open, Run};
use super::{tag_of, SECTOR};

/// Ways each captured instant is materialized: 0 keeps no unflushed write (the cut that
/// tests flush ordering hardest), the others keep, drop or tear each write by a seed.
pub const WAYS_PER_INSTANT: u64 = 2;

/// The tag each sector reads as (`u64::MAX` for data that is no tagged sector: garbage).
/// A failed read names its sector.
fn read_volume(cache: &Cache, sectors: &[u64]) -> Result<BTreeMap<u64, u64>, (u64, String)> {
    let vol = &cache.volumes()[0];
    let mut out = BTreeMap::new();
    let mut buf = vec![0u8; SECTOR as usize];
    for &s in sectors {
        vol.read(s * SECTOR, &mut buf)
            .map_err(|e| (s, e.to_string()))?;
        out.insert(s, tag_of(&buf).unwrap_or(u64::MAX));
    }
    Ok(out)
}

/// Reads the backing device directly: what a cache with no dirty line serves after a crash.
fn read_backing(dev: &CrashDevice, sectors: &[u64]) -> BTreeMap<u64, u64> {
    let mut buf = vec![0u8; SECTOR as usize];
    sectors
        .iter()
        .map(|&s| {
            let tag = match dev.read_at(&mut buf, s * SECTOR) {
                Ok(()) => tag_of(&buf).unwrap_or(u64::MAX),
                Err(_) => u64::MAX - 1,
            };
            (s, tag)
        })
        .collect()
}

/// Checks every captured instant of a finished run.
pub fn check_run(run: &Run, captured: Vec<CrashState>, stats: &Stats) {
    let log = run.clock.take_log();
    let log = &log[..];
    let classified = classify(log, &run.layout);
    stats.add(&stats.ops, log.len() as u64);
    stats.add(&stats.compactions, classified.compactions);
    stats.add(&stats.journal_writes, classified.journal_writes);
    stats.add(
        &stats.injected_errors,
        log.iter().filter(|r| r.failed).count() as u64,
    );
    let events = run.events();
    let mut sectors: Vec<u64> = {
        let mut all = Contract::default();
        for (_, e) in &events {
            all.apply(e);
        }
        all.sectors().collect()
    };
    sectors.extend(&run.untouched);
    sectors.sort_unstable();
    sectors.dedup();
    let mut contract = Contract::default();
    let mut applied = 0;
    for state in &captured {
        while applied < events.len() && events[applied].0 < state.op {
            contract.apply(&events[applied].1);
            applied += 1;
        }
        stats.add(&stats.captures, 1);
        let mask = classified.mask(state.op);
        stats.place(mask);
        for way in 0..WAYS_PER_INSTANT {
            check_point(
                run,
                state,
                &contract,
                way,
                &sectors,
                &classified,
                log,
                stats,
            );
        }
    }
}

fn keep(seed: u64, op: u64, way: u64, device: u64) -> Keep {
    if way == 0 {
        Keep::Nothing
    } else {
        Keep::Random(Rng(seed ^ op << 20 ^ way << 8 ^ device).next_u64())
    }
}

#[allow(clippy::too_many_arguments)]
fn check_point(
    run: &Run,
    state: &CrashState,
    contract: &Contract,
    way: u64,
    sectors: &[u64],
    classified: &Classified,
    log: &[ssdcache_devsim::OpRecord],
    stats: &Stats,
) {
    let seed = run.plan.seed;
    let at = || {
        format!(
            "seed {seed}, power cut after op {} ({}), materialized way {way}",
            state.op,
            super::coverage::describe(classified.mask(state.op))
        )
    };
    // A second power cut somewhere in the writeback of what was recovered, for one way.
    let second_cut = way == 1;
    let clock = CrashClock::new();
    let restore = |index, name| {
        let keep = keep(seed, state.op, way, index as u64);
        let dev = if second_cut {
            clock.restore(state, index, name, keep)
        } else {
            state.stable_device(index, name, keep)
        };
        Arc::new(dev.expect("device in the crash state"))
    };
    let cache_dev = restore(CACHE_DEV, "cache");
    let backing = restore(BACKING_DEV, "backing");
    let cache = try_open(&cache_dev, &backing, &run.plan)
        .unwrap_or_else(|e| panic!("{}: the cache does not open: {e}", at()));
    stats.add(&stats.dirty_lines_recovered, cache.dirty_lines());
    let first = read_volume(&cache, sectors).unwrap_or_else(|(sector, e)| {
        panic!(
            "{}: the read of sector {sector} after recovery failed: {e}; the contract allows {}\n{}",
            at(),
            contract.describe(sector),
            run.trace(log, sector, state.op)
        )
    });
    for (&sector, &tag) in &first {
        assert!(
            contract.allows_after_crash(sector, tag),
            "{}: sector {sector} reads {tag:#x}; the contract allows {}\n{}",
            at(),
            contract.describe(sector),
            run.trace(log, sector, state.op)
        );
    }
    if second_cut {
        let mut rng = Rng(seed ^ state.op);
        clock.crash_at([clock.ops() + 1 + rng.below(24)]);
    }
    cache
        .drain(&CleanerConfig::default(), &mut |_| true)
        .unwrap_or_else(|e| panic!("{}: writeback after recovery failed: {e}", at()));
    drop(cache);
    let cache = try_open(&cache_dev, &backing, &run.plan)
        .unwrap_or_else(|e| panic!("{}: no restart after the writeback: {e}", at()));
    let after = if cache.dirty_lines() == 0 {
        read_backing(&backing, sectors)
    } else {
        read_volume(&cache, sectors).unwrap_or_else(|(sector, e)| {
            panic!(
                "{}: the read of sector {sector} after writeback failed: {e}",
                at()
            )
        })
    };
    drop(cache);
    assert_flip_free(
        &first,
        &after,
        "writeback and a restart",
        &at,
        run,
        log,
        state.op,
    );
    if let Some(cut) = clock.take_captured().pop() {
        let c = Arc::new(
            cut.device(CACHE_DEV, "cache", keep(seed, cut.op, 1, 10))
                .expect("cache"),
        );
        let b = Arc::new(
            cut.device(BACKING_DEV, "backing", keep(seed, cut.op, 1, 11))
                .expect("backing"),
        );
        let cache = try_open(&c, &b, &run.plan)
            .unwrap_or_else(|e| panic!("{}: no restart after a cut during writeback: {e}", at()));
        let again = read_volume(&cache, sectors).unwrap_or_else(|(sector, e)| {
            panic!(
                "{}: the read of sector {sector} after the second cut failed: {e}",
                at()
            )
        });
        assert_flip_free(
            &first,
            &again,
            "a second power cut during the writeback",
            &at,
            run,
            log,
            state.op,
        );
        stats.add(&stats.second_crashes, 1);
    }
    stats.add(&stats.points, 1);
}

#[allow(clippy::too_many_arguments)]
fn assert_flip_free(
    first: &BTreeMap<u64, u64>,
    then: &BTreeMap<u64, u64>,
    across: &str,
    at: &dyn Fn() -> String,
    run: &Run,
    log: &[ssdcache_devsim::OpRecord],
    op: u64,
) {
    for (&sector, &tag) in first {
        let later = then.get(&sector).copied().unwrap_or(u64::MAX);
        assert!(
            tag == later,
            "{}: sector {sector} read {tag:#x} after recovery but {later:#x} after {across} \
             (flip-flop)\n{}",
            at(),
            run.trace(log, sector, op)
        );
    }
}
