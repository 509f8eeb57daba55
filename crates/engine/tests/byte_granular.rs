//! Requests that are not whole 4 KiB sectors (issue 13, item 1): served exactly in every mode
//! by read-modify-write under the line lock, concurrent writes of different bytes of one
//! sector all land, and what a FLUSH made durable survives a power cut.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{data, Rng, MIB};
use ssdcache_devsim::CrashDevice;
use ssdcache_engine::{Cache, CleanerConfig, EngineError};
use ssdcache_format::CacheMode;

const MODES: [CacheMode; 4] = [
    CacheMode::WriteBack,
    CacheMode::WriteThrough,
    CacheMode::WriteAround,
    CacheMode::PassThrough,
];
const LINE: u64 = 64 << 10;
const BACKING: u64 = 32 * MIB;

fn read(cache: &Cache, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xA5u8; len];
    cache.volumes()[0]
        .read(offset, &mut buf)
        .unwrap_or_else(|e| panic!("read of {len} bytes at {offset}: {e}"));
    buf
}

/// Every kind of request at byte offsets and lengths, against a byte array.
#[test]
fn partial_sector_requests_match_a_byte_array_in_every_mode() {
    for mode in MODES {
        // Memory devices zero what is discarded, so the array can follow a TRIM.
        let (_c, backing, cache) = common::setup(16 * MIB, BACKING, LINE, mode);
        let vol = cache.volumes()[0].clone();
        let mut model = vec![0u8; BACKING as usize];
        let mut rng = Rng(7 + mode as u64);
        for round in 0..600u64 {
            // Mostly in the first 2 MiB, so partial sectors meet cached and dirty ones.
            let span = if round % 5 == 0 { BACKING } else { 2 * MIB };
            let offset = rng.next_u64() % (span - 70_000);
            let len = match rng.next_u64() % 4 {
                0 => 1 + rng.next_u64() % 16,
                1 => 512 * (1 + rng.next_u64() % 8),
                2 => 1 + rng.next_u64() % 9000,
                _ => 1 + rng.next_u64() % 70_000,
            } as usize;
            let at = offset as usize;
            match rng.next_u64() % 10 {
                0..=3 => {
                    let bytes = data(round, len);
                    let fua = rng.next_u64().is_multiple_of(4);
                    vol.write(offset, &bytes, fua).expect("write");
                    model[at..at + len].copy_from_slice(&bytes);
                }
                4..=6 => {
                    let got = read(&cache, offset, len);
                    assert!(
                        got == model[at..at + len],
                        "{mode:?}: read of {len} at {offset} (round {round}) differs"
                    );
                }
                7 => {
                    vol.write_zeroes(offset, len as u64, false).expect("zero");
                    model[at..at + len].fill(0);
                }
                8 => {
                    // Only whole sectors inside are discarded (the memory device zeroes them).
                    vol.trim(offset, len as u64, false).expect("trim");
                    let start = offset.next_multiple_of(4096) as usize;
                    let end = (at + len) / 4096 * 4096;
                    if end > start {
                        model[start..end].fill(0);
                    }
                }
                _ => {
                    vol.flush().expect("flush");
                    if mode == CacheMode::WriteBack {
                        cache
                            .clean_batch(&CleanerConfig::default(), 8, ssdcache_engine::Select::All)
                            .expect("clean");
                    }
                }
            }
        }
        assert!(
            read(&cache, 0, BACKING as usize) == model,
            "{mode:?}: final read differs"
        );
        vol.flush().expect("flush");
        cache
            .drain(&CleanerConfig::default(), &mut |_| true)
            .expect("drain");
        assert!(
            backing.snapshot() == model,
            "{mode:?}: backing differs after drain"
        );
    }
}

/// Threads write their own 512 bytes of the same sectors at once (a filesystem with 512-byte
/// or 1 KiB blocks writes neighbouring blocks so), with the cleaner running in write-back: a
/// read-modify-write that let another write land between its read and its write would bring
/// the other's old bytes back. Then a FLUSH and a power cut: every slot holds its last write.
#[test]
fn concurrent_writes_to_different_bytes_of_one_sector_all_land() {
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 150;
    // Sectors in a few lines, some sharing a line.
    let sectors: Vec<u64> = vec![0, 1, 5, 16, 17, 40, 300, 301];
    for mode in MODES {
        let (cache_dev, backing, cache) = common::setup_crash(16 * MIB, BACKING, LINE, mode);
        let cache = Arc::new(cache);
        if mode == CacheMode::WriteBack {
            cache.start_cleaner(CleanerConfig {
                max_age: Duration::from_millis(5),
                ..CleanerConfig::default()
            });
        }
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (cache, sectors) = (cache.clone(), sectors.clone());
                std::thread::spawn(move || {
                    let vol = cache.volumes()[0].clone();
                    let mut rng = Rng(t + 100);
                    for round in 0..ROUNDS {
                        let s = sectors[(rng.next_u64() % sectors.len() as u64) as usize];
                        let offset = s * 4096 + t * 512;
                        let fua = rng.next_u64().is_multiple_of(8);
                        vol.write(offset, &data(slot_tag(s, t, round), 512), fua)
                            .expect("write");
                        if rng.next_u64().is_multiple_of(4) {
                            // A read of a neighbour's bytes and ours, as a filesystem would.
                            let mut buf = vec![0u8; 1536];
                            vol.read(s * 4096 + (t % 6) * 512, &mut buf).expect("read");
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        cache.stop_cleaner();
        // What each thread wrote last into each sector.
        let mut want = vec![0u8; BACKING as usize];
        for t in 0..THREADS {
            let mut rng = Rng(t + 100);
            for round in 0..ROUNDS {
                let s = sectors[(rng.next_u64() % sectors.len() as u64) as usize];
                let at = (s * 4096 + t * 512) as usize;
                want[at..at + 512].copy_from_slice(&data(slot_tag(s, t, round), 512));
                rng.next_u64();
                rng.next_u64();
            }
        }
        check_sectors(&cache, &sectors, &want, mode, "after the writers");
        cache.volumes()[0].flush().expect("flush");
        drop(cache);
        // A power cut right after the FLUSH loses nothing.
        let cache_dev = Arc::new(cache_dev.crashed("cache", 1));
        let backing = Arc::new(backing.crashed("backing", 2));
        let (cache, _) = common::open_dyn(cache_dev, backing);
        check_sectors(&cache, &sectors, &want, mode, "after a power cut");
    }
}

fn slot_tag(sector: u64, thread: u64, round: u64) -> u64 {
    (sector << 32) | (thread << 16) | round
}

fn check_sectors(cache: &Cache, sectors: &[u64], want: &[u8], mode: CacheMode, when: &str) {
    for &s in sectors {
        let got = read(cache, s * 4096, 4096);
        let at = (s * 4096) as usize;
        for slot in 0..8 {
            let range = slot * 512..slot * 512 + 512;
            assert!(
                got[range.clone()] == want[at + range.start..at + range.end],
                "{mode:?} {when}: sector {s} bytes {range:?} lost a write"
            );
        }
    }
}

/// A device whose size is not a multiple of 4 KiB: its last bytes form no whole sector, which
/// the cache cannot hold; requests reaching them are refused, the rest are served.
#[test]
fn the_last_bytes_of_a_device_of_odd_size_are_refused() {
    let size = 4 * MIB + 1000;
    let cache_dev = Arc::new(CrashDevice::new("cache", 16 * MIB));
    let backing = Arc::new(CrashDevice::new("backing", size));
    common::format_dev(&*cache_dev, LINE, CacheMode::WriteBack, size, 0);
    let (cache, _) = common::open_dyn(cache_dev, backing);
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; 100];
    let err = vol
        .read(4 * MIB + 10, &mut buf)
        .expect_err("past the last sector");
    assert!(matches!(err, EngineError::OutOfRange { .. }), "{err}");
    vol.write(4 * MIB - 50, &[7u8; 50], false)
        .expect("the last whole sector is served");
    assert_eq!(read(&cache, 4 * MIB - 50, 50), vec![7u8; 50]);
}

/// A partial request longer than the pieces it is served in (`partial.rs`, `PIECE`, 1 MiB):
/// every byte lands and reads back exactly, in every mode, and a read counts as one hit or
/// miss however many pieces it took.
#[test]
fn long_partial_requests_are_served_whole_in_every_mode() {
    let count = |cache: &Cache, name: usize| cache.volumes()[0].stats().counters.0[name];
    let (reads, hits, misses) = (0, 2, 3);
    for mode in MODES {
        let (_c, _b, cache) = common::setup(16 * MIB, BACKING, LINE, mode);
        let vol = cache.volumes()[0].clone();
        let mut model = vec![0u8; BACKING as usize];
        for (round, (offset, len)) in [
            (700u64, 3 * MIB as usize + 1000),
            (MIB - 1, 2 * MIB as usize + 2),
            (5 * MIB + 4096, 2 * MIB as usize + 5),
        ]
        .into_iter()
        .enumerate()
        {
            let bytes = data(round as u64 + 40, len);
            vol.write(offset, &bytes, round == 1)
                .expect("long partial write");
            model[offset as usize..offset as usize + len].copy_from_slice(&bytes);
        }
        for (offset, len) in [(300u64, 4 * MIB as usize), (MIB + 1, 6 * MIB as usize)] {
            let before = [reads, hits, misses].map(|c| count(&cache, c));
            let got = read(&cache, offset, len);
            let after = [reads, hits, misses].map(|c| count(&cache, c));
            assert!(
                got == model[offset as usize..offset as usize + len],
                "{mode:?}: {len} bytes at {offset} differ from what was written"
            );
            assert_eq!(after[0] - before[0], 1, "{mode:?}: one read counted");
            assert_eq!(
                (after[1] - before[1]) + (after[2] - before[2]),
                1,
                "{mode:?}: one hit or miss counted for one read"
            );
        }
        cache
            .drain(&CleanerConfig::default(), &mut |_| true)
            .expect("drain");
        let got = read(&cache, 0, 8 * MIB as usize);
        assert!(got == model[..8 * MIB as usize], "{mode:?}: after drain");
    }
}
