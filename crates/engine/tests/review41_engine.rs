//! Review 41: adversarial tests of the per-volume occupancy cap, online admission and
//! sequential cutoff changes (commit 067a815).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{data, Rng, MIB};
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::admission::Admission;
use ssdcache_engine::{Cache, CleanerConfig};

const LINE: u64 = 64 << 10;
const CACHE: u64 = 16 * MIB;
const SIZES: [u64; 2] = [32 * MIB, 24 * MIB];
const THREADS: u64 = 4;

fn open(cache_dev: &Arc<CrashDevice>, backings: &[Arc<CrashDevice>; 2]) -> Cache {
    common::open_crash(cache_dev, &[&backings[0], &backings[1]])
}

fn check_volume(cache: &Cache, v: usize, model: &[u8], what: &str) {
    let vol = &cache.volumes()[v];
    let mut buf = vec![0u8; MIB as usize];
    for (i, want) in model.chunks(MIB as usize).enumerate() {
        vol.read(i as u64 * MIB, &mut buf[..want.len()])
            .unwrap_or_else(|e| panic!("{what}: read of volume {v} MiB {i}: {e}"));
        if let Some(bad) = (0..want.len()).find(|&j| buf[j] != want[j]) {
            panic!(
                "{what}: volume {} differs at byte {}",
                vol.name(),
                i as u64 * MIB + bad as u64
            );
        }
    }
}

/// Threads each own a region of volume a (capped, the cap changing all the time) and of
/// volume b; random reads (checked against the model at once), writes, zero writes, TRIMs and
/// FLUSHes, the cleaner running, a tuner thread changing a's occupancy cap, admission and
/// sequential cutoff and persisting them. Then a power cut right after a FLUSH of both: every
/// byte of both volumes must be what was written.
fn stress(seed: u64, policy: Option<u32>) {
    if let Some(p) = policy {
        common::POLICY.with(|c| c.set(p));
    }
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = Arc::new(open(&cache_dev, &backings));
    cache.start_cleaner(CleanerConfig {
        max_age: std::time::Duration::from_millis(50),
        ..CleanerConfig::default()
    });
    let models: Arc<[Mutex<Vec<u8>>; 2]> = Arc::new([
        Mutex::new(vec![0u8; SIZES[0] as usize]),
        Mutex::new(vec![0u8; SIZES[1] as usize]),
    ]);
    let stop = Arc::new(AtomicBool::new(false));
    let tuner = {
        let (cache, stop) = (cache.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(seed ^ 0x55);
            let a = cache.volumes()[0].clone();
            let b = cache.volumes()[1].clone();
            while !stop.load(Ordering::Relaxed) {
                match rng.next_u64() % 8 {
                    0 => a.set_occupancy_cap(None),
                    1 => a.set_occupancy_cap(Some(0.001)),
                    2 => a.set_occupancy_cap(Some(0.02)),
                    3 => a.set_occupancy_cap(Some(0.2)),
                    4 => a.set_admission(if rng.next_u64().is_multiple_of(2) {
                        Admission::Always
                    } else {
                        Admission::NHit(2)
                    }),
                    5 => a.set_sequential_cutoff([0, 64 << 10, MIB][(rng.next_u64() % 3) as usize]),
                    6 => b.set_occupancy_cap(
                        [None, Some(0.05), Some(0.5)][(rng.next_u64() % 3) as usize],
                    ),
                    _ => cache.persist_config().expect("persist_config"),
                }
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (cache, models) = (cache.clone(), models.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(seed * 100 + t);
                for i in 0..1500u64 {
                    let v = usize::from(rng.next_u64().is_multiple_of(4)); // mostly volume a (0)
                    let vol = cache.volumes()[v].clone();
                    let region = SIZES[v] / THREADS;
                    let base = t * region;
                    let sectors = 1 + rng.next_u64() % 24;
                    let len = sectors * 4096;
                    let at = base + (rng.next_u64() % (region / 4096 - sectors)) * 4096;
                    let (s, e) = (at as usize, (at + len) as usize);
                    match rng.next_u64() % 10 {
                        0..=3 => {
                            let buf = data(seed << 40 | t << 32 | i, len as usize);
                            vol.write(at, &buf, rng.next_u64().is_multiple_of(16))
                                .expect("write");
                            models[v].lock().unwrap()[s..e].copy_from_slice(&buf);
                        }
                        4 => {
                            let buf = vec![0u8; len as usize];
                            vol.write(at, &buf, false).expect("write zeroes");
                            models[v].lock().unwrap()[s..e].copy_from_slice(&buf);
                        }
                        5 => {
                            vol.flush().expect("flush");
                        }
                        _ => {
                            let mut buf = vec![0u8; len as usize];
                            vol.read(at, &mut buf).expect("read");
                            let want = models[v].lock().unwrap()[s..e].to_vec();
                            if let Some(bad) = (0..buf.len()).find(|&j| buf[j] != want[j]) {
                                panic!(
                                    "seed {seed} thread {t} op {i}: volume {v} read at {} \
                                     differs at byte {} (stats {:?})",
                                    at,
                                    at + bad as u64,
                                    vol.stats()
                                );
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    stop.store(true, Ordering::Relaxed);
    tuner.join().expect("tuner");
    let a = cache.volumes()[0].clone();
    if let Some(cap) = a.occupancy_cap_lines() {
        // A lowered cap shrinks the volume only as it misses; no bound to check here.
        let _ = cap;
    }
    for v in cache.volumes().iter() {
        v.flush().expect("final flush");
    }
    let models: Vec<Vec<u8>> = models.iter().map(|m| m.lock().unwrap().clone()).collect();
    check_volume(&cache, 0, &models[0], "before the cut");
    check_volume(&cache, 1, &models[1], "before the cut");
    for v in cache.volumes().iter() {
        v.flush().expect("final flush");
    }
    let crashed_cache = Arc::new(cache_dev.crashed("cache", seed + 1));
    let crashed = [
        Arc::new(backings[0].crashed("backing-a", seed + 2)),
        Arc::new(backings[1].crashed("backing-b", seed + 3)),
    ];
    cache.stop_cleaner();
    drop(a);
    drop(cache);
    let cache = open(&crashed_cache, &crashed);
    check_volume(&cache, 0, &models[0], "after a power cut after FLUSH");
    check_volume(&cache, 1, &models[1], "after a power cut after FLUSH");
    cache.shutdown().expect("shutdown");
}

#[test]
fn stress_capped_volume_lru() {
    for seed in 1..4 {
        stress(seed, Some(0));
    }
}

#[test]
fn stress_capped_volume_all_policies() {
    for (i, _) in ssdcache_engine::policy::names().iter().enumerate() {
        stress(10 + i as u64, Some(i as u32));
    }
}

/// The engine's use of a `Residency` under an occupancy cap, at a larger scale than the
/// policy property test: two "volumes", volume 0 capped; a miss of volume 0 at its cap first
/// vacates one of its own clean slots found by a hand (as `MapState::own_victim`), then takes
/// a free slot or the policy's victim; lines become dirty, held and clean again; touches.
/// Every policy: no panic, the counts add up, no victim is dirty/held/untracked.
#[test]
fn residency_with_own_evictions_keeps_every_policy_consistent() {
    use ssdcache_engine::residency::{Residency, Standing, NO_KEY};
    const SLOTS: u32 = 2048;
    for name in ssdcache_engine::policy::names() {
        let mut r = Residency::new(
            SLOTS,
            ssdcache_engine::policy::by_name(name, SLOTS).expect("policy"),
        );
        let mut rng = Rng(7);
        let mut key_of = vec![NO_KEY; SLOTS as usize];
        let mut hand = 0u32;
        let mut used = [0u64; 2];
        let cap = 300u64;
        for op in 0..400_000u64 {
            let vol = rng.next_u64().is_multiple_of(3) as u64; // volume 1 a third of the time
            let key = vol << 48 | (rng.next_u64() % 6000);
            if let Some(slot) = r.slot_of(key) {
                match rng.next_u64() % 8 {
                    0 => r.set_standing(slot, Standing::Dirty),
                    1 => r.set_standing(slot, Standing::Held),
                    2 | 3 => r.set_standing(slot, Standing::Clean),
                    4 => {
                        // An invalidation.
                        assert_eq!(r.vacate(slot), key);
                        key_of[slot as usize] = NO_KEY;
                        used[vol as usize] -= 1;
                        r.give_free(slot);
                    }
                    _ => r.touch(slot),
                }
                continue;
            }
            if vol == 0 && used[0] >= cap {
                let mut found = None;
                for _ in 0..SLOTS.min(4096) {
                    let s = hand % SLOTS;
                    hand = (s + 1) % SLOTS;
                    let k = r.key_of(s);
                    if k != NO_KEY && k >> 48 == 0 && r.standing(s) == Some(Standing::Clean) {
                        found = Some(s);
                        break;
                    }
                }
                let Some(s) = found else { continue };
                assert_eq!(r.vacate(s), key_of[s as usize], "{name} op {op}");
                key_of[s as usize] = NO_KEY;
                used[0] -= 1;
                r.give_free(s);
            }
            let slot = match r.take_free() {
                Some(s) => s,
                None => {
                    let Some(v) = r.victim(key, &mut |_, _| true) else {
                        continue;
                    };
                    assert_eq!(r.standing(v), Some(Standing::Clean), "{name} op {op}");
                    let k = r.vacate(v);
                    assert_eq!(k, key_of[v as usize]);
                    used[(k >> 48) as usize] -= 1;
                    key_of[v as usize] = NO_KEY;
                    v
                }
            };
            assert!(r.occupy(slot, key), "{name} op {op}");
            key_of[slot as usize] = key;
            used[vol as usize] += 1;
            assert!(used[0] <= cap, "{name} op {op}");
            let clean = r.clean_count() as usize;
            let mapped = key_of.iter().filter(|&&k| k != NO_KEY).count();
            if op % 997 == 0 {
                let dirty = r.dirty_count() as usize;
                let held = r.held_slots().len();
                assert_eq!(clean + dirty + held, mapped, "{name} op {op}");
                assert_eq!(r.used(), mapped, "{name} op {op}");
                assert_eq!(r.free_slots() + mapped, SLOTS as usize, "{name} op {op}");
            }
        }
    }
}

/// A capped write-back volume whose cap is all dirty: a write to a line it holds clean goes
/// around and drops the clean copy; a write spanning a cached clean line and an uncached one
/// too; both read back right, before and after a power cut following a FLUSH.
#[test]
fn writes_around_a_full_cap_supersede_a_clean_copy() {
    let (cache_dev, backings) = common::two_volume_cache(CACHE, LINE, SIZES);
    let cache = open(&cache_dev, &backings);
    let a = cache.volumes()[0].clone();
    let mut model = vec![0u8; SIZES[0] as usize];
    // Line 100 cached clean (a read fill), then the cap: 4 lines, and 3 more lines dirty.
    let mut buf = vec![0u8; LINE as usize];
    a.read(100 * LINE, &mut buf).expect("read");
    a.set_occupancy_cap(Some(4.5 / cache.layout().line_count as f64));
    assert_eq!(a.occupancy_cap_lines(), Some(4));
    for line in 0..3u64 {
        let d = data(1000 + line, LINE as usize);
        a.write(line * LINE, &d, false).expect("write");
        model[(line * LINE) as usize..((line + 1) * LINE) as usize].copy_from_slice(&d);
    }
    // With a dirty cap of 3 lines too, a write to the clean line 100 goes around and
    // supersedes its clean copy.
    a.set_dirty_cap(Some(3.5 / cache.layout().line_count as f64));
    assert_eq!(a.dirty_room_lines(), Some(3));
    let d = data(1500, LINE as usize / 2);
    a.write(100 * LINE + 4096, &d, false)
        .expect("write around the clean copy");
    model[(100 * LINE + 4096) as usize..(100 * LINE + 4096) as usize + d.len()].copy_from_slice(&d);
    let got = common::read_volume(&cache, 0, 100 * LINE, LINE as usize);
    assert!(
        got == model[(100 * LINE) as usize..(101 * LINE) as usize],
        "line 100"
    );
    a.set_dirty_cap(None);
    // A fourth dirty line takes the place of one of its clean lines (line 100, read again).
    let d = data(2000, LINE as usize);
    a.write(10 * LINE, &d, false).expect("write");
    model[(10 * LINE) as usize..(11 * LINE) as usize].copy_from_slice(&d);
    assert_eq!(a.stats().lines_used, 4, "{:?}", a.stats());
    assert_eq!(a.stats().dirty_lines, 4, "{:?}", a.stats());
    // Now every line of a is dirty: a read of a new line is not cached, a write goes around.
    a.read(200 * LINE, &mut buf).expect("read");
    assert_eq!(a.stats().lines_used, 4);
    let d = data(3000, 2 * LINE as usize);
    a.write(10 * LINE + LINE / 2, &d, false)
        .expect("write across a dirty and a new line");
    model[(10 * LINE + LINE / 2) as usize..(12 * LINE + LINE / 2) as usize].copy_from_slice(&d);
    assert!(common::counter(&a, "bytes_written_around_full") > 0);
    let got = common::read_volume(&cache, 0, 0, 16 * LINE as usize);
    assert!(
        got == model[..16 * LINE as usize],
        "reads back before the cut"
    );
    a.flush().expect("flush");
    let crashed_cache = Arc::new(cache_dev.crashed("cache", 5));
    let crashed = [
        Arc::new(backings[0].crashed("backing-a", 6)),
        Arc::new(backings[1].crashed("backing-b", 7)),
    ];
    drop(a);
    drop(cache);
    let cache = open(&crashed_cache, &crashed);
    check_volume(&cache, 0, &model, "after a power cut after FLUSH");
}
