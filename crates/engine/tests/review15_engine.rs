//! review15: adversarial tests of the packed metadata of h-meta (SlotBitmaps, SlotIndex),
//! through the engine at every line size the format allows (4 KiB .. 1 MiB: 1 .. 256 sectors,
//! so 64 .. 1/4 slots per bitmap word). Random sector-granular writes, trims and reads over a
//! backing device twice the cache (so slots are evicted and reused under other keys), against
//! a byte model; then a flush, a power cut and a reopen from the journal, and the model again.

mod common;

use common::*;
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;

fn run_line_size(line: u64, seed: u64, ops: usize, rounds: usize) {
    // The format's minimum: 16 MiB and 64 lines (plus room for the metadata).
    let cache_size = (20 << 20).max(96 * line + (8 << 20));
    let backing_size = 2 * cache_size;
    let (mut cache_dev, mut backing, mut cache) =
        setup_crash(cache_size, backing_size, line, CacheMode::WriteBack);
    let mut model = vec![0u8; backing_size as usize];
    let mut rng = Rng(seed);
    let sectors = backing_size / SECTOR;
    for round in 0..rounds {
        for i in 0..ops {
            let vol = &cache.volumes()[0];
            let first = rng.next_u64() % sectors;
            let count = (1 + rng.next_u64() % 64).min(sectors - first);
            let (off, len) = (first * SECTOR, count * SECTOR);
            let at = off as usize..(off + len) as usize;
            match rng.next_u64() % 8 {
                0..=3 => {
                    let d = data(seed ^ ((round * ops + i) as u64) << 8, len as usize);
                    vol.write(off, &d, false).expect("write");
                    model[at].copy_from_slice(&d);
                }
                4 => {
                    vol.trim(off, len, false).expect("trim");
                    // A trim may drop the data or keep it: the model takes what a read says.
                    let got = read_vec(&cache, off, len).expect("read after trim");
                    model[at].copy_from_slice(&got);
                }
                5 => vol.flush().expect("flush"),
                _ => {
                    let got = read_vec(&cache, off, len).expect("read");
                    assert!(
                        got == model[at],
                        "line {line}: round {round} op {i}: read {off}+{len} differs from the model"
                    );
                }
            }
        }
        cache.volumes()[0].flush().expect("flush before the cut");
        let whole = read_vec(&cache, 0, backing_size).expect("read all");
        assert!(
            whole == model,
            "line {line}: round {round}: device differs before the cut"
        );
        // A power cut after the flush: everything flushed must come back, through the
        // journal's replay (slots move between keys there) and the checkpoint.
        (cache_dev, backing) = cut_keeping_cache_writes(&cache_dev, &backing);
        drop(cache);
        (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
        let whole = read_vec(&cache, 0, backing_size).expect("read all after reopen");
        for s in 0..sectors as usize {
            let r = s * SECTOR as usize..(s + 1) * SECTOR as usize;
            assert!(
                whole[r.clone()] == model[r],
                "line {line}: round {round}: sector {s} differs after a power cut and reopen"
            );
        }
    }
}

#[test]
fn every_line_size_keeps_data_across_eviction_and_a_power_cut() {
    for shift in 12..=20 {
        run_line_size(1 << shift, 0x5eed ^ shift, 1500, 3);
    }
}
