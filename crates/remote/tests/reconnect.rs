//! `NbdDevice` against this project's NBD server with an export that behaves like a store
//! with a volatile write cache (librbd's, say): a write is acknowledged into memory and
//! becomes durable only at FLUSH, and a restart of the server keeps only what was durable.
//! The server is restarted under the device while it works; every write the device
//! acknowledged and then flushed must be on the store.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self};
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

mod common;

use common::{Store, BLOCK, SIZE};

fn quick() -> RemoteConfig {
    RemoteConfig {
        io_timeout: Duration::from_secs(5),
        retry_timeout: Duration::from_secs(10),
        ..RemoteConfig::default()
    }
}

fn block(seed: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| seed.wrapping_add((i / 7) as u8))
        .collect()
}

#[test]
fn writes_acknowledged_before_a_server_crash_reach_the_store_at_the_next_flush() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    store.start();
    let dev = NbdDevice::open(store.uri(), quick()).unwrap();
    let mut expected = vec![0u8; SIZE];
    for i in 0..16u8 {
        let at = usize::from(i) * 3 * BLOCK;
        dev.write_at(&block(i), at as u64).unwrap();
        expected[at..at + BLOCK].copy_from_slice(&block(i));
    }
    assert_eq!(dev.status().unflushed_writes, 16);
    // The server crashes with all 16 writes only in its volatile cache, and comes back.
    store.crash();
    assert!(store.durable() == vec![0u8; SIZE], "the model lost them");
    thread::sleep(Duration::from_millis(300));
    store.start();
    // A read waits through the outage; the replay ran before it, so it sees the data.
    let mut back = vec![0u8; BLOCK];
    dev.read_at(&mut back, 5 * 3 * BLOCK as u64).unwrap();
    assert!(back == block(5));
    dev.flush().unwrap();
    assert!(store.durable() == expected, "acknowledged writes lost");
    assert_eq!(dev.status().unflushed_writes, 0);
    assert_eq!(dev.status().reconnections, 1);
}

#[test]
fn requests_in_flight_across_a_restart_see_a_delay_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    store.start();
    let dev = Arc::new(NbdDevice::open(store.uri(), quick()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(60);
    let writers: Vec<_> = (0..4u8)
        .map(|w| {
            let (dev, stop) = (Arc::clone(&dev), Arc::clone(&stop));
            thread::spawn(move || {
                // Each writer owns 64 blocks and remembers what it last wrote to each.
                let mut last = [None::<u8>; 64];
                for round in 0..1_000_000u32 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    assert!(Instant::now() < deadline, "bounded in time");
                    let slot = (round % 64) as usize;
                    let at = (u64::from(w) * 64 + slot as u64) * BLOCK as u64;
                    let seed = w ^ round as u8;
                    dev.write_at(&block(seed), at).unwrap();
                    last[slot] = Some(seed);
                    if round % 16 == 15 {
                        dev.flush().unwrap();
                    }
                }
                last
            })
        })
        .collect();
    let mut restart = |crash: u64| {
        store.crash();
        thread::sleep(Duration::from_millis(150));
        store.start();
        while dev.status().reconnections < crash {
            assert!(Instant::now() < deadline, "never reconnected");
            thread::sleep(Duration::from_millis(20));
        }
    };
    for crash in 1..=2 {
        thread::sleep(Duration::from_millis(100));
        restart(crash);
    }
    thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::SeqCst);
    let lasts: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    // The writes since each writer's last flush exist only in the server's volatile cache.
    assert!(dev.status().unflushed_writes > 0);
    restart(3);
    dev.flush().unwrap();
    assert_eq!(dev.status().reconnections, 3);
    let durable = store.durable();
    for (w, last) in lasts.iter().enumerate() {
        for (slot, seed) in last.iter().enumerate() {
            let at = (w * 64 + slot) * BLOCK;
            let want = seed.map_or(vec![0; BLOCK], block);
            assert!(
                durable[at..at + BLOCK] == want[..],
                "writer {w} slot {slot} lost"
            );
        }
    }
}

#[test]
fn an_export_that_stays_away_fails_requests_after_the_retry_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    store.start();
    let config = RemoteConfig {
        retry_timeout: Duration::from_millis(700),
        ..quick()
    };
    let dev = NbdDevice::open(store.uri(), config).unwrap();
    store.crash();
    let started = Instant::now();
    let mut buf = vec![0u8; BLOCK];
    let e = dev.read_at(&mut buf, 0).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(e.to_string().contains("unreachable"), "{e}");
    assert!(!dev.status().connected);
    // Later requests fail at once while it is away...
    let again = Instant::now();
    assert!(dev.read_at(&mut buf, 0).is_err());
    assert!(again.elapsed() < Duration::from_millis(300));
    // ...and succeed once it is back.
    store.start();
    let until = Instant::now() + Duration::from_secs(20);
    while dev.read_at(&mut buf, 0).is_err() {
        assert!(Instant::now() < until, "never reconnected");
        thread::sleep(Duration::from_millis(100));
    }
    assert!(dev.status().connected);
}

#[test]
fn another_export_at_the_address_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    store.start();
    let config = RemoteConfig {
        retry_timeout: Duration::from_millis(1500),
        ..quick()
    };
    let dev = NbdDevice::open(store.uri(), config).unwrap();
    assert_eq!(dev.identity().stable_id, "nbd:disk#store-1");
    dev.write_at(&block(9), 0).unwrap();
    store.crash();
    store.description = "store-2".into();
    store.start();
    let mut buf = vec![0u8; BLOCK];
    let e = dev.read_at(&mut buf, 0).unwrap_err();
    assert!(
        dev.status().last_error.contains("another export"),
        "{e} / {:?}",
        dev.status()
    );
    // Nothing was replayed onto the other export.
    assert!(store.durable() == vec![0u8; SIZE]);
}

#[test]
fn opening_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(dir.path());
    let e = NbdDevice::open(store.uri(), quick()).err().unwrap();
    assert!(e.to_string().contains("cannot connect"), "{e}");
    let tls = NbdUri::parse("nbds://127.0.0.1:1/disk?tls-certificates=/no/such/folder").unwrap();
    let e = NbdDevice::open(tls, quick()).err().unwrap();
    assert!(e.to_string().contains("/no/such/folder/ca-cert.pem"), "{e}");
}

#[test]
fn big_requests_go_in_pieces_and_zeroes_and_trims_are_passed_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    store.start();
    let dev = NbdDevice::open(store.uri(), quick()).unwrap();
    assert_eq!(dev.size(), SIZE as u64);
    // 3 MiB over a server maximum of 1 MiB.
    let big: Vec<u8> = (0..3 << 20).map(|i: usize| (i % 251) as u8).collect();
    dev.write_at(&big, 4096).unwrap();
    let mut back = vec![0u8; big.len()];
    dev.read_at(&mut back, 4096).unwrap();
    assert!(back == big);
    dev.write_zeroes(8192, 8192).unwrap();
    assert!(dev.discard(1 << 20, 4096).unwrap());
    dev.flush().unwrap();
    let durable = store.durable();
    assert!(durable[4096..8192] == big[..4096]);
    assert!(durable[8192..16384].iter().all(|b| *b == 0));
    assert!(durable[16384..20480] == big[12288..16384]);
    // Multi-conn is advertised by this server: the device uses several connections.
    assert!(dev.connections() > 1);
}
