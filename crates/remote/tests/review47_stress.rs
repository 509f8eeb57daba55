//! Review 47 stress (the model store of tests/common): `NbdDevice` against this project's NBD server with an export that behaves like a store
//! with a volatile write cache (librbd's, say): a write is acknowledged into memory and
//! becomes durable only at FLUSH, and a restart of the server keeps only what was durable.
//! The server is restarted under the device while it works; every write the device
//! acknowledged and then flushed must be on the store.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self};
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;
use ssdcache_remote::{NbdDevice, RemoteConfig};

mod common;

use common::{Store, BLOCK};

const SLOTS: usize = 32;

fn content(index: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    for c in b.chunks_mut(8) {
        c.copy_from_slice(&index.to_le_bytes());
    }
    b
}

fn index_of(block: &[u8]) -> u64 {
    u64::from_le_bytes(block[..8].try_into().unwrap())
}

/// Cheap deterministic PRNG.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Writers (each owns SLOTS blocks) write increasing op indices (some ops are write_zeroes),
/// flush now and then, and publish for each slot the index of its last op that a returned
/// flush covers. The store crashes often, also right after coming back (during the replay).
/// At each crash every published index must be on the durable copy (or a later op); at the
/// end, after a final flush, the durable copy must hold exactly each slot's last op.
#[test]
fn review47_stress_crashes_during_replay_and_flush_lose_nothing_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    store.start();
    let config = RemoteConfig {
        io_timeout: Duration::from_secs(5),
        retry_timeout: Duration::from_secs(30),
        replay_limit: 64 << 10, // forced flushes often
        ..RemoteConfig::default()
    };
    let dev = Arc::new(NbdDevice::open(store.uri(), config).unwrap());
    assert!(dev.connections() > 1);
    const WRITERS: usize = 3;
    let published: Arc<Vec<AtomicU64>> =
        Arc::new((0..WRITERS * SLOTS).map(|_| AtomicU64::new(0)).collect());
    let max_zero: Arc<Vec<AtomicU64>> =
        Arc::new((0..WRITERS * SLOTS).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(120);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (dev, stop, published, max_zero) = (
                Arc::clone(&dev),
                Arc::clone(&stop),
                Arc::clone(&published),
                Arc::clone(&max_zero),
            );
            thread::spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ ((w as u64 + 1) * 7919);
                let mut last = vec![0u64; SLOTS]; // last op index per slot
                let mut last_zero = vec![false; SLOTS];
                let mut op = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    assert!(Instant::now() < deadline, "bounded");
                    let slot = (next(&mut rng) % SLOTS as u64) as usize;
                    let g = w * SLOTS + slot;
                    let at = (g * BLOCK) as u64;
                    op += 1;
                    let index = (w as u64) << 48 | op;
                    if next(&mut rng).is_multiple_of(8) {
                        // record before: a zero op may land before it returns
                        max_zero[g].fetch_max(index, Ordering::SeqCst);
                        dev.write_zeroes(at, BLOCK as u64).unwrap();
                        last_zero[slot] = true;
                    } else {
                        dev.write_at(&content(index), at).unwrap();
                        last_zero[slot] = false;
                    }
                    last[slot] = index;
                    if next(&mut rng).is_multiple_of(12) {
                        let covered = last.clone();
                        dev.flush().unwrap();
                        for (s, i) in covered.iter().enumerate() {
                            published[w * SLOTS + s].fetch_max(*i, Ordering::SeqCst);
                        }
                    }
                }
                (last, last_zero)
            })
        })
        .collect();
    let mut rng = 12345u64;
    let check = |durable: &[u8], when: &str| {
        for g in 0..WRITERS * SLOTS {
            let want = published[g].load(Ordering::SeqCst);
            let b = &durable[g * BLOCK..(g + 1) * BLOCK];
            let got = index_of(b);
            let ok = if b.iter().all(|x| *x == 0) {
                want == 0 || max_zero[g].load(Ordering::SeqCst) >= want
            } else {
                assert!(b == &content(got)[..], "{when}: slot {g} torn");
                got >= want
            };
            assert!(ok, "{when}: slot {g} durable holds op {got:#x}, but op {want:#x} was flushed before the crash");
        }
    };
    for round in 0..15 {
        thread::sleep(Duration::from_millis(50 + next(&mut rng) % 300));
        store.crash();
        let durable = store.durable();
        // `published` was read after the crash began: a flush answered after it began counts too,
        // which can only be durable if it really was.
        check(&durable, &format!("crash {round}"));
        thread::sleep(Duration::from_millis(next(&mut rng) % 250));
        store.start();
        if round % 3 == 1 {
            // crash again while the device is likely replaying
            thread::sleep(Duration::from_millis(next(&mut rng) % 40));
            store.crash();
            check(&store.durable(), &format!("crash {round}b"));
            thread::sleep(Duration::from_millis(100));
            store.start();
        }
    }
    thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::SeqCst);
    let lasts: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    dev.flush().unwrap();
    store.crash();
    let durable = store.durable();
    for (w, (last, zero)) in lasts.iter().enumerate() {
        for s in 0..SLOTS {
            let g = w * SLOTS + s;
            let b = &durable[g * BLOCK..(g + 1) * BLOCK];
            if zero[s] {
                assert!(
                    b.iter().all(|x| *x == 0),
                    "slot {g}: last op zeroes, durable holds op {:#x}",
                    index_of(b)
                );
            } else if last[s] == 0 {
                assert!(b.iter().all(|x| *x == 0));
            } else {
                assert!(
                    b == &content(last[s])[..],
                    "slot {g}: last op {:#x}, durable holds op {:#x}",
                    last[s],
                    index_of(b)
                );
            }
        }
    }
    eprintln!("status at the end: {:?}", dev.status());
}
