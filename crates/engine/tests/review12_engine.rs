//! review12: adversarial tests of the latest engine changes (issue 11, main at 2213d27).
//! Each test fails there; its comment names the mechanism. The tests use only the public
//! `Streams`/`StreamDetector` API and compare the sharded detector with the single detector
//! the volume kept before 57c7088 (the reference: the sharding was meant to change nothing
//! but the locking).

use ssdcache_engine::admission::{StreamDetector, Streams};

const MIB: u64 = 1 << 20;
/// `Streams`' region size (stream.rs `REGION_SHIFT` = 28).
const REGION: u64 = 256 * MIB;
const CUTOFF: u64 = 4 * MIB;

fn bits(v: &[bool]) -> String {
    v.iter().map(|&x| if x { '1' } else { '0' }).collect()
}

/// The answers of one detector for the whole volume (the engine before 57c7088) and of
/// `Streams` (the engine and the simulator now) to the same requests.
fn single_and_sharded(requests: &[(u64, u64)]) -> (Vec<bool>, Vec<bool>) {
    let mut single = StreamDetector::new(CUTOFF);
    let sharded = Streams::new(CUTOFF);
    let a = requests.iter().map(|&(o, l)| single.bypass(o, l)).collect();
    let b = requests
        .iter()
        .map(|&(o, l)| sharded.bypass(o, l))
        .collect();
    (a, b)
}

/// R12-1. Two sequential readers 3 MiB apart (two copies of neighbouring files, a reader and
/// its read-ahead) cross a 256 MiB region boundary. The leading stream's request just past
/// the boundary runs `take_continued` on the previous region's shard (stream.rs:169-176),
/// which takes any stream *near* the request when none continues it exactly — the trailing
/// stream, 3 MiB behind (slack = 1 MiB + 2 × len). The trailing stream is moved into the next
/// region's shard, its next request (still in the old region) finds nothing and starts a new
/// stream from zero: it is cached again for `cutoff` bytes. One detector never does this (an
/// exact continuation is preferred to a near one, and the leading stream continues itself
/// exactly). Every crossing of every 256 MiB boundary with a neighbour within the slack
/// costs `cutoff` bytes of cache pollution (SSD writes, evictions of reused data).
#[test]
fn r12_1_a_stream_crossing_a_region_is_not_stolen_by_a_neighbour_just_ahead() {
    let boundary = 5 * REGION;
    let mut requests = Vec::new();
    for i in 0..32 {
        requests.push((boundary - 13 * MIB + i * MIB, MIB)); // leading
        requests.push((boundary - 16 * MIB + i * MIB, MIB)); // trailing, 3 MiB behind
    }
    let (single, sharded) = single_and_sharded(&requests);
    // After `cutoff` bytes each, both streams bypass for good with one detector.
    assert!(single[8..].iter().all(|&b| b), "single: {}", bits(&single));
    let cached_again: Vec<u64> = requests
        .iter()
        .zip(&sharded)
        .skip(8)
        .filter(|(_, &b)| !b)
        .map(|(&(o, _), _)| o)
        .collect();
    assert!(
        cached_again.is_empty(),
        "requests of a stream past its cutoff were cached again after a neighbouring stream \
         crossed the region boundary at {boundary} ahead of it: offsets {cached_again:?}\n\
         single  {}\nsharded {}",
        bits(&single),
        bits(&sharded)
    );
}

/// R12-1b. The same theft by a lone random read: a 4 KiB read just past a region boundary
/// (metadata, another file) takes a stream still 1 MiB short of the boundary out of its shard;
/// the stream then restarts from zero and is cached for another `cutoff` bytes. One detector
/// halves the stream's evidence a few times (it has moved 63 MiB, far past the cutoff, so it
/// keeps bypassing).
#[test]
fn r12_1b_a_random_read_past_the_boundary_does_not_reset_a_stream() {
    let boundary = 3 * REGION;
    let mut requests = Vec::new();
    for i in 0..72u64 {
        if i == 63 {
            // The stream is at boundary - 1 MiB; a random read lands 4 KiB past the boundary.
            requests.push((boundary + 4096, 4096));
        }
        requests.push((boundary - 64 * MIB + i * MIB, MIB));
    }
    let (single, sharded) = single_and_sharded(&requests);
    let stream_only = |v: &[bool]| -> Vec<bool> {
        v.iter()
            .zip(&requests)
            .filter(|(_, &(_, l))| l == MIB)
            .map(|(&b, _)| b)
            .collect()
    };
    let (single, sharded) = (stream_only(&single), stream_only(&sharded));
    assert!(single[4..].iter().all(|&b| b), "single: {}", bits(&single));
    assert!(
        sharded[4..].iter().all(|&b| b),
        "a stream past its cutoff was cached again after a random read past the region \
         boundary took it from its shard\nsingle  {}\nsharded {}",
        bits(&single),
        bits(&sharded)
    );
}
