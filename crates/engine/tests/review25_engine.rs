//! Review 25: db847ce (cache hits leave the stream detector a note in `HitRuns` instead of
//! taking its lock; a request the cache cannot serve whole counts the run of hits ending where
//! it starts), reverted in 916f3db for what these tests found. Every test here passes with the
//! detector seeing every hit (main) and failed on db847ce; they stay as the bar any lock-free
//! way of counting hits must clear (docs/design.md §3, "Hit path concurrency").
//!
//! R25-1 (false streams): a run of hits is looked up by walking back through up to 64 notes,
//! each note at the end of any earlier hit. Random hits over a cached area leave a note at the
//! end of every request-sized piece, so after ONE random pass of 64 KiB reads the walk from any
//! 64 KiB boundary finds 64 notes = 4 MiB = the cutoff: the next miss (or write) there is taken
//! for a stream past its cutoff and goes around the cache.
//!
//! R25-2 (streams lost): a run of hits longer than the cutoff is capped at the cutoff, so the
//! "request" the hits are counted as starts in the middle of the cached stretch, not where the
//! stream is; it is not an exact continuation, lands "near" the stream (slack 1 MiB + twice
//! its length = 9 MiB) and halves its evidence. Likewise when the walk goes back past the
//! stream's position through stale notes of earlier random hits. A backup over a file cached in
//! long stretches, or over a partly cached file that clients read, is then never recognised.
//!
//! R25-3 (byte granularity): notes count whole 512-byte units, so a run of hits of a request
//! size that is not a multiple of 512 (the simulator's byte-granular traces; the engine's
//! byte-granular requests to come) never starts exactly at the stream's `next`: every cached
//! stretch halves the stream.

mod common;

use std::sync::Arc;

use common::{counter, format_dev, open_dyn, Rng, MIB};
use ssdcache_devsim::MemDevice;
use ssdcache_engine::{Cache, Volume};

use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const CUTOFF: u64 = 4 * MIB;

thread_local! {
    static DEVS: std::cell::RefCell<Option<(Arc<MemDevice>, Arc<MemDevice>)>> =
        const { std::cell::RefCell::new(None) };
}

fn reopen() -> (Cache, Arc<Volume>) {
    let (cache_dev, backing) = DEVS.with(|d| d.borrow().clone().expect("devices"));
    let (cache, _) = open_dyn(cache_dev, backing);
    let vol = cache.volumes()[0].clone();
    (cache, vol)
}

/// A cache of `mode` over `backing_size` with the lines `cached` (line numbers) cached, read
/// one line at a time from the last to the first (no stream), then opened again so the stream
/// detector starts empty and nothing is noted (as if the warm-up were long forgotten).
fn warm(
    mode: CacheMode,
    backing_size: u64,
    cache_size: u64,
    cached: &[u64],
) -> (Cache, Arc<Volume>) {
    let backing = Arc::new(MemDevice::new("backing", backing_size));
    let cache_dev = Arc::new(MemDevice::new("cache", cache_size));
    format_dev(&*cache_dev, LINE, mode, backing_size, CUTOFF);
    DEVS.with(|d| *d.borrow_mut() = Some((cache_dev.clone(), backing.clone())));
    let (cache, _) = open_dyn(cache_dev, backing);
    let mut line = vec![0u8; LINE as usize];
    let mut sorted = cached.to_vec();
    sorted.sort_unstable();
    for &l in sorted.iter().rev() {
        cache.volumes()[0]
            .read(l * LINE, &mut line)
            .expect("warm-up read");
    }
    let cached_bytes = cache.volumes()[0].stats().bytes_cached;
    assert_eq!(
        cached_bytes,
        cached.len() as u64 * LINE,
        "the warm-up cached every line"
    );
    cache.shutdown().expect("clean stop");
    drop(cache);
    reopen()
}

/// Reads every line of `lines` once, 64 KiB each, in a random order (clients' random reads).
fn random_hits(vol: &Volume, lines: &[u64], seed: u64) {
    let mut rng = Rng(seed);
    let mut buf = vec![0u8; LINE as usize];
    let hits = counter(vol, "read_hits");
    for i in rng.shuffled(lines.len() as u64) {
        vol.read(lines[i as usize] * LINE, &mut buf)
            .expect("random read");
    }
    assert_eq!(
        counter(vol, "read_hits") - hits,
        lines.len() as u64,
        "every random read hit"
    );
}

fn scan(vol: &Volume, from: u64, to: u64, chunk: u64) {
    let mut buf = vec![0u8; chunk as usize];
    let mut at = from;
    while at < to {
        vol.read(at, &mut buf).expect("scan read");
        at += chunk;
    }
}

/// R25-1, reads. 80 MiB of a file is cached but for one line every 16 MiB; clients read it
/// at random, 64 KiB at a time, each cached line once. Then one 4 KiB read of each uncached
/// line: random misses, no stream. db847ce sends every one around the cache (and does not
/// cache it): the walk back from each finds 64 notes of at least 64 KiB = the cutoff. (The
/// misses are 16 MiB apart so that each is beyond the slack of the previous one's "stream";
/// closer together, every other one goes around.)
#[test]
fn r25_1_random_hits_over_a_hot_area_make_the_next_miss_a_stream() {
    let hole = |l: u64| l > 0 && (l * LINE).is_multiple_of(16 * MIB);
    let hot: Vec<u64> = (0..80 * MIB / LINE).filter(|&l| !hole(l)).collect();
    let (_cache, vol) = warm(CacheMode::WriteThrough, 128 * MIB, 128 * MIB, &hot);
    random_hits(&vol, &hot, 1);
    let mut block = vec![0u8; 4096];
    let mut around = Vec::new();
    for at in (1..5).map(|i| i * 16 * MIB) {
        let before = counter(&vol, "bytes_bypassed");
        vol.read(at, &mut block).expect("miss");
        if counter(&vol, "bytes_bypassed") > before {
            around.push(at / MIB);
        }
    }
    assert!(
        around.is_empty(),
        "random 4 KiB reads after random hits were taken for streams and went around the \
         cache (at MiB {around:?} of [16, 32, 48, 64])"
    );
}

/// R25-1, writes (write-back). The same hot 80 MiB (all cached) read at random once; then
/// the clients write 4 KiB at 8, 24, 40, 56 and 72 MiB (a database updating pages it read).
/// A write is a request the cache cannot serve whole, so `Streams::bypass` counts the 4 MiB
/// of notes behind it: each write goes around the write-back cache to the disk (synchronous
/// disk latency), where db847ce^ absorbed it. Closer together, every other one does.
#[test]
fn r25_1_writes_into_a_read_hot_area_go_around_the_write_back_cache() {
    let hot: Vec<u64> = (0..80 * MIB / LINE).collect();
    let (_cache, vol) = warm(CacheMode::WriteBack, 128 * MIB, 128 * MIB, &hot);
    random_hits(&vol, &hot, 2);
    let page = vec![0x5au8; 4096];
    let mut around = Vec::new();
    for at in (0..5).map(|i| 8 * MIB + i * 16 * MIB) {
        let before = counter(&vol, "bytes_bypassed");
        vol.write(at, &page, false).expect("write");
        if counter(&vol, "bytes_bypassed") > before {
            around.push(at / MIB);
        }
    }
    assert!(
        around.is_empty(),
        "random 4 KiB writes into cached, read-hot lines went around the write-back cache \
         (at MiB {around:?} of [8, 24, 40, 56, 72])"
    );
}

/// R25-2, capped runs. A file of 64 MiB cached in stretches of 7 MiB, each after 1 MiB that
/// is not cached; a backup reads it in 256 KiB. db847ce^ counts the hits: past the cutoff
/// after the first stretch, the backup goes around the cache for the other 7 uncached MiB.
/// db847ce caps each run of hits at 4 MiB, counts it as a request starting 3 MiB into the
/// stretch, 3 MiB from the stream: near it, not exactly on it, so it halves the stream's
/// evidence every stretch; the backup never reaches its cutoff and all 8 MiB are cached.
#[test]
fn r25_2_a_backup_over_a_file_cached_in_long_stretches_is_recognised() {
    let cached: Vec<u64> = (0..64 * MIB / LINE).filter(|l| l % 128 >= 16).collect();
    let (_cache, vol) = warm(CacheMode::WriteThrough, 64 * MIB, 128 * MIB, &cached);
    let to_cache = counter(&vol, "bytes_to_cache");
    scan(&vol, 0, 64 * MIB, 256 << 10);
    let admitted = (counter(&vol, "bytes_to_cache") - to_cache) / MIB;
    let bypassed = counter(&vol, "bytes_bypassed") / MIB;
    assert!(
        admitted <= 1 && bypassed >= 7,
        "the backup cached {admitted} MiB and went around the cache for {bypassed} MiB \
         (db847ce^: 1 and 7)"
    );
}

/// R25-2, a stream past its cutoff crossing a cached stretch of 6 MiB: it had moved 6 MiB
/// (run 6 MiB, going around), the capped run of hits lands 2 MiB ahead of it and halves it
/// to 3 MiB, so it caches 1 MiB more after the stretch.
#[test]
fn r25_2_a_stream_past_its_cutoff_does_not_cache_again_after_a_cached_stretch() {
    let cached: Vec<u64> = (6 * MIB / LINE..12 * MIB / LINE).collect();
    let (_cache, vol) = warm(CacheMode::WriteThrough, 64 * MIB, 64 * MIB, &cached);
    scan(&vol, 0, 12 * MIB, 256 << 10);
    let to_cache = counter(&vol, "bytes_to_cache");
    scan(&vol, 12 * MIB, 20 * MIB, 256 << 10);
    let after = (counter(&vol, "bytes_to_cache") - to_cache) / 1024;
    assert_eq!(
        after, 0,
        "the stream, past its cutoff before the cached stretch, cached {after} KiB after it"
    );
}

/// R25-2, stale notes. Every 1 MiB of a 32 MiB file: its first 64 KiB not cached, the rest
/// cached and read by clients at random (64 KiB). A backup then reads it in 256 KiB: each
/// MiB one partial miss, three hits. The walk back from each miss goes past the stream's
/// position through the clients' notes, so the counted run of hits starts before the stream:
/// near, not exact, halving it every MiB. db847ce^ (whose detector the clients' hits crowd):
/// 704 KiB cached, 5376 KiB around the cache; db847ce: every uncached line (2 MiB) cached,
/// nothing around the cache.
#[test]
fn r25_2_a_backup_over_a_partly_cached_file_that_clients_read_is_recognised() {
    let cached: Vec<u64> = (0..32 * MIB / LINE).filter(|l| l % 16 != 0).collect();
    let (_cache, vol) = warm(CacheMode::WriteThrough, 64 * MIB, 128 * MIB, &cached);
    random_hits(&vol, &cached, 3);
    let to_cache = counter(&vol, "bytes_to_cache");
    scan(&vol, 0, 32 * MIB, 256 << 10);
    let admitted = (counter(&vol, "bytes_to_cache") - to_cache) / 1024;
    let bypassed = counter(&vol, "bytes_bypassed") / 1024;
    assert!(
        admitted <= 1024 && bypassed >= 4096,
        "the backup cached {admitted} KiB and went around the cache for {bypassed} KiB \
         (db847ce^: 704 and 5376)"
    );
}

/// R25-2, a neighbour's stream. A nightly backup of 8 files of 6 MiB, 2 MiB apart, read in
/// 128 KiB (stream_rescans' nightly test, with the files closer together). Night 1 caches
/// the first 4 MiB of each file (its cutoff). Night 2, file k+1: 4 MiB of hits, then its first
/// miss counts the hits as one 4 MiB request, whose slack (1 MiB + twice 4 MiB) reaches file
/// k's stream 2 MiB before it: taken for a near continuation of file k, it halves file k's
/// stream (6 MiB to 3 MiB) and counts nothing itself, so file k+1 caches 2 more MiB. db847ce^:
/// [32, 0, 0] MiB cached per night; db847ce: [32, 16, 0] (every file whole after two nights).
#[test]
fn r25_2_a_nightly_backup_of_files_close_together_caches_nothing_more() {
    let (_cache, vol) = warm(CacheMode::WriteThrough, 128 * MIB, 128 * MIB, &[]);
    let mut per_night = Vec::new();
    for _night in 0..3 {
        let before = counter(&vol, "bytes_to_cache");
        for f in 0..8u64 {
            let start = f * 8 * MIB;
            scan(&vol, start, start + 6 * MIB, 128 << 10);
        }
        per_night.push((counter(&vol, "bytes_to_cache") - before) / MIB);
    }
    assert!(
        per_night[1..].iter().all(|&m| m == 0),
        "each night cached more of the backup: {per_night:?} MiB per night"
    );
}
