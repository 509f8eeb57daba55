//! Hits through a ring (`Volume::ring_hits`, issue 11): started on one thread, ended on
//! another, read by the kernel straight into the caller's buffer. Every hit returns what a
//! one-at-a-time `read` would; what cannot be started (a miss, a busy line, an unaligned
//! buffer) is left to the caller; a damaged hit is served from the backing device.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::file_cache::*;
use common::*;
use ssdcache_device::{AlignedBuf, BlockDevice, FileDevice, OpenOptions};
use ssdcache_engine::{Cache, RingEnd, RingHit, RingHits, Volume};

/// Every loop of the concurrent test ends after this many rounds or this long.
const ROUNDS: usize = 300;
const TIME_LIMIT: Duration = Duration::from_secs(20);

fn ring(vol: &Volume) -> RingHits<'_> {
    vol.ring_hits()
        .expect("a file cache device with io_uring gives a ring")
}

/// Starts a read of each range into its own aligned buffer, waits until every started one
/// ended, and gives back (buffer, Some(served)) for those started, (buffer, None) for the
/// others.
fn ring_reads(hits: &RingHits<'_>, ranges: &[(u64, usize)]) -> Vec<(AlignedBuf, Option<bool>)> {
    let mut bufs: Vec<AlignedBuf> = ranges
        .iter()
        .map(|&(_, len)| AlignedBuf::zeroed(len))
        .collect();
    let mut starts: Vec<RingHit> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .enumerate()
        .map(|(tag, (&(offset, len), buf))| RingHit {
            tag: tag as u64,
            offset,
            buf: buf.as_mut_ptr(),
            len,
            started: false,
        })
        .collect();
    // SAFETY: the buffers live until every started read was reported (below).
    unsafe { hits.start(&mut starts) };
    let mut served: HashMap<u64, bool> = HashMap::new();
    let started = starts.iter().filter(|s| s.started).count();
    let mut ended: Vec<RingEnd> = Vec::new();
    let deadline = Instant::now() + TIME_LIMIT;
    while served.len() < started {
        assert!(Instant::now() < deadline, "ring reads never ended");
        hits.wait(&mut ended).expect("ring works");
        for end in ended.drain(..) {
            let (offset, len) = ranges[end.tag as usize];
            assert_eq!((end.offset, end.len), (offset, len), "reported as started");
            served.insert(end.tag, end.served);
        }
    }
    assert_eq!(hits.in_flight(), 0);
    bufs.into_iter()
        .zip(&starts)
        .map(|(buf, s)| (buf, served.remove(&s.tag)))
        .collect()
}

#[test]
fn ring_hits_read_what_the_device_holds_and_leave_the_rest() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    let vol = cache.volumes()[0].clone();
    for line in 0..8 {
        read_vec(&cache, line * LINE, LINE).expect("warm");
    }
    let hits = ring(&vol);
    let ranges = [
        (0, 4096),
        (LINE + 8192, 16384),
        (40 * LINE, 4096),             // a miss: not started
        (LINE + 8192, 4096),           // a line a hit before it holds: not started
        (8 * LINE - 4096, 8192),       // across two lines, one not cached: not started
        (2 * LINE, 2 * LINE as usize), // two whole cached lines: two device reads
    ];
    let before = counter(&vol, "read_hits");
    let done = ring_reads(&hits, &ranges);
    let started: Vec<bool> = done.iter().map(|(_, r)| r.is_some()).collect();
    assert_eq!(started, [true, true, false, false, false, true]);
    for ((buf, served), &(offset, _)) in done.iter().zip(&ranges) {
        if let Some(served) = served {
            assert!(served, "read at {offset} not served");
            assert_whole_sectors(offset, buf, 0);
        }
    }
    assert_eq!(
        counter(&vol, "read_hits") - before,
        3,
        "hits counted once each"
    );
}

/// A damaged hit is reported unserved, its lines released, so the caller's `Volume::read`
/// (the full path) catches the damage and serves the read from the backing device.
#[test]
fn a_damaged_ring_hit_is_left_unserved_for_the_full_read_path() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    let vol = cache.volumes()[0].clone();
    for line in 0..4 {
        read_vec(&cache, line * LINE, LINE).expect("warm");
    }
    damage_all_data(&dir, &cache);
    let hits = ring(&vol);
    let ranges: Vec<(u64, usize)> = (0..4).map(|line| (line * LINE + 4096, 8192)).collect();
    for ((mut buf, served), &(offset, _)) in ring_reads(&hits, &ranges).into_iter().zip(&ranges) {
        assert_eq!(served, Some(false), "read at {offset}: damaged data served");
        vol.read(offset, &mut buf).expect("the full path serves it");
        assert_whole_sectors(offset, &buf, 0);
    }
    assert!(
        counter(&vol, "checksum_errors") >= 4,
        "every damaged read caught"
    );
    assert_eq!(
        counter(&vol, "read_hits"),
        0,
        "no damaged read counted as a hit"
    );
}

/// Overwrites every line's data on the cache device behind the engine's back.
fn damage_all_data(dir: &tempfile::TempDir, cache: &Cache) {
    let layout = cache.layout();
    let damage = FileDevice::open(
        &dir.path().join("cache"),
        OpenOptions {
            write: true,
            direct: false,
            lock: false,
        },
    )
    .expect("second handle");
    let data = layout.line_count * layout.line_size;
    damage
        .write_at(&vec![0xa5; data as usize], layout.data_offset)
        .expect("damage");
    damage.flush().expect("flush");
}

/// Review 31: the thread in `wait` never waits for a line. A damaged hit on line 1 and a hit
/// on line 2 are in flight; a write across lines 1 and 2 waits for both. `wait` must end
/// both hits (served or not) without waiting for anything: it served the damaged one with
/// `Volume::read`, which waited for line 1 behind the write, which waited for line 2, which
/// only `wait` releases.
#[test]
fn waiting_for_ring_hits_never_waits_for_a_line() {
    let _serial = serial();
    // Leaked: if `wait` hangs, the test fails with its thread still holding all this.
    let dir: &'static tempfile::TempDir =
        Box::leak(Box::new(tempfile::tempdir().expect("tempdir")));
    let (_backing, cache) = file_cache(dir, 16 << 20, 64 << 20);
    let cache: &'static Cache = Box::leak(Box::new(cache));
    let vol = cache.volumes()[0].clone();
    for round in 0..50u64 {
        let line = 1 + round * 2 % 100;
        read_vec(cache, line * LINE, 2 * LINE).expect("warm");
        damage_all_data(dir, cache);
        let leaked: &'static Volume = Box::leak(Box::new(vol.clone()));
        let hits: &'static RingHits<'static> = Box::leak(Box::new(ring(leaked)));
        let bufs: &'static mut [AlignedBuf] = Box::leak(Box::new([
            AlignedBuf::zeroed(4096),
            AlignedBuf::zeroed(4096),
        ]));
        let ranges = [(line * LINE, 4096), ((line + 1) * LINE, 4096)];
        let mut starts: Vec<RingHit> = ranges
            .iter()
            .zip(bufs.iter_mut())
            .enumerate()
            .map(|(tag, (&(offset, len), buf))| RingHit {
                tag: tag as u64,
                offset,
                buf: buf.as_mut_ptr(),
                len,
                started: false,
            })
            .collect();
        // SAFETY: the buffers are leaked: they outlive every read.
        unsafe { hits.start(&mut starts) };
        let started = starts.iter().filter(|s| s.started).count();
        let writer = vol.clone();
        let write = std::thread::spawn(move || {
            let data: Vec<u8> = (0..2)
                .flat_map(|i| sector_data(line * 16 + 15 + i, 1))
                .collect();
            writer
                .write(line * LINE + 15 * 4096, &data, false)
                .expect("write across the two lines");
        });
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut all = Vec::new();
            while all.len() < started {
                hits.wait(&mut all).expect("ring works");
            }
            let _ = done.send(all.len());
        });
        assert_eq!(
            ended.recv_timeout(TIME_LIMIT),
            Ok(started),
            "round {round}: wait hung (waiting for a line behind the write)"
        );
        write.join().expect("writer");
        if cache.volumes()[0].state() != ssdcache_engine::VolumeState::Healthy {
            break; // the volume stops caching after enough damage: the point is made
        }
    }
}

#[test]
fn unaligned_buffers_are_left_to_the_caller() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    read_vec(&cache, 0, LINE).expect("warm");
    let vol = cache.volumes()[0].clone();
    let hits = ring(&vol);
    let mut buf = AlignedBuf::zeroed(2 * 4096);
    let mut start = [RingHit {
        tag: 1,
        offset: 0,
        // SAFETY: one byte into an 8 KiB buffer, 4 KiB long: inside it.
        buf: unsafe { buf.as_mut_ptr().add(1) },
        len: 4096,
        started: false,
    }];
    // SAFETY: nothing is started (asserted), so nothing writes into the buffer later.
    unsafe { hits.start(&mut start) };
    assert!(
        !start[0].started,
        "an unaligned buffer must not go to O_DIRECT"
    );
    assert_eq!(hits.in_flight(), 0, "its lines are released");
    // The line is free again: a write does not wait.
    cache.volumes()[0]
        .write(0, &sector_data(0, 1), false)
        .expect("write");
}

/// Ring hits on one thread, ended on another, while a writer rewrites sectors they read and
/// a reader of the whole volume evicts lines under them: every read is whole sectors of
/// one write, and the ring is empty at the end.
#[test]
fn writes_and_evictions_racing_ring_hits_never_give_wrong_data() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 256 << 20);
    let vol = cache.volumes()[0].clone();
    let start = Instant::now();
    let max_version = ROUNDS as u64;
    let hits = ring(&vol);
    let mut ring_served = 0;
    std::thread::scope(|scope| {
        let writer = vol.clone();
        scope.spawn(move || {
            for version in 1..=max_version {
                if start.elapsed() > TIME_LIMIT {
                    break;
                }
                for s in [1u64, 17, 40, 100] {
                    writer
                        .write(s * SECTOR as u64, &sector_data(s, version), false)
                        .expect("write");
                }
            }
        });
        let evictor = vol.clone();
        scope.spawn(move || {
            let mut rng = Rng(7);
            for _ in 0..ROUNDS * 4 {
                if start.elapsed() > TIME_LIMIT {
                    break;
                }
                let offset = rng.next_u64() % 4096 * LINE;
                evictor
                    .read(offset, &mut vec![0u8; LINE as usize])
                    .expect("evicting read");
            }
        });
        for round in 0..ROUNDS {
            if start.elapsed() > TIME_LIMIT {
                break;
            }
            let ranges: Vec<(u64, usize)> = (0..24)
                .map(|i| (((round as u64 + i * 5) % 12) * 4 * SECTOR as u64, 8192))
                .collect();
            for ((mut buf, served), &(offset, _)) in
                ring_reads(&hits, &ranges).into_iter().zip(&ranges)
            {
                if served == Some(true) {
                    ring_served += 1;
                } else {
                    // Left to the caller, as the NBD server does (and the line is cached).
                    vol.read(offset, &mut buf).expect("read");
                }
                assert_whole_sectors(offset, &buf, max_version);
            }
        }
    });
    assert!(ring_served > 0, "some reads went through the ring");
}

/// The thread that starts hits never waits for them: another ends them, each as its reads
/// complete, and every buffer holds its range's data.
#[test]
fn hits_started_on_one_thread_end_on_another() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_backing, cache) = file_cache(&dir, 16 << 20, 64 << 20);
    for line in 0..16 {
        read_vec(&cache, line * LINE, LINE).expect("warm");
    }
    let vol = cache.volumes()[0].clone();
    let hits = ring(&vol);
    let count = 400;
    let ranges: Vec<(u64, usize)> = (0..count as u64)
        .map(|i| ((i * 7 % 16) * LINE + (i % 16) * 4096, 4096))
        .collect();
    let mut bufs: Vec<AlignedBuf> = ranges
        .iter()
        .map(|&(_, len)| AlignedBuf::zeroed(len))
        .collect();
    let mut starts: Vec<RingHit> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .enumerate()
        .map(|(tag, (&(offset, len), buf))| RingHit {
            tag: tag as u64,
            offset,
            buf: buf.as_mut_ptr(),
            len,
            started: false,
        })
        .collect();
    let deadline = Instant::now() + TIME_LIMIT;
    let ended = std::thread::scope(|scope| {
        let hits = &hits;
        let waiter = scope.spawn(move || {
            let mut all = Vec::new();
            while all.len() < count && Instant::now() < deadline {
                hits.wait(&mut all).expect("ring works");
            }
            all
        });
        // In chunks, each started only once the ring has room (MAX_READS_IN_FLIGHT).
        for chunk in starts.chunks_mut(32) {
            let mut left: Vec<&mut RingHit> = chunk.iter_mut().collect();
            while !left.is_empty() {
                assert!(Instant::now() < deadline, "the ring never made room");
                let mut batch: Vec<RingHit> = left.iter().map(|h| **h).collect();
                // SAFETY: `bufs` outlives the scope, which ends after the waiter saw every tag.
                unsafe { hits.start(&mut batch) };
                for (hit, done) in left.iter_mut().zip(&batch) {
                    hit.started = done.started;
                }
                left.retain(|h| !h.started);
                std::thread::yield_now();
            }
        }
        waiter.join().expect("waiter")
    });
    assert_eq!(ended.len(), count, "every hit ended once");
    for end in ended {
        let (offset, _) = ranges[end.tag as usize];
        assert!(end.served, "read at {offset} not served");
        assert_whole_sectors(offset, &bufs[end.tag as usize], 0);
    }
    assert_eq!(hits.in_flight(), 0);
}
