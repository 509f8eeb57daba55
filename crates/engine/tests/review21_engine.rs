//! Review 21: adversarial tests of 07f840a (a stop ends the cleaner thread's batch under way:
//! the writes in flight finish, the rest stays dirty in place).
//!
//! Each test stops the cleaner part way through a batch on a slow backing device, then checks
//! real outcomes: what the backing device durably holds, what the cache records dirty, what
//! reads return after a clean restart (checkpoint) or after a power cut (journal replay), and
//! that a later writeback puts every line's data on the backing device.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{data, format_dev, open_dyn, wait_for};
use ssdcache_devsim::{CrashDevice, SlowWriteDevice};
use ssdcache_engine::{Cache, CleanerConfig};
use ssdcache_format::CacheMode;

const SECTOR: u64 = 4096;
const LINE: u64 = 64 << 10;
const CACHE_SIZE: u64 = 24 << 20;
const BACKING: u64 = 64 << 20;
const LINES: u64 = 120;

/// One sector in every other line: no two lines merge into one write.
fn sector_of(i: u64) -> u64 {
    2 * i * LINE + (i % 16) * SECTOR
}

fn tag(i: u64, generation: u64) -> u64 {
    1000 * generation + i + 1
}

struct Rig {
    cache_dev: Arc<CrashDevice>,
    backing: Arc<CrashDevice>,
    slow: Arc<SlowWriteDevice>,
    cache: Arc<Cache>,
}

/// `LINES` dirty lines (one sector each, generation `generation`) in a write-back cache over
/// a slow crash-simulating backing device; the writes committed to the journal.
fn rig(generation: u64) -> Rig {
    let cache_dev = Arc::new(CrashDevice::new("cache", CACHE_SIZE));
    let backing = Arc::new(CrashDevice::new("backing", BACKING));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, BACKING, 0);
    let slow = Arc::new(SlowWriteDevice::new(
        backing.clone(),
        Duration::from_millis(5),
    ));
    let (cache, _) = open_dyn(cache_dev.clone(), slow.clone());
    let cache = Arc::new(cache);
    let vol = cache.volumes()[0].clone();
    for i in 0..LINES {
        vol.write(
            sector_of(i),
            &data(tag(i, generation), SECTOR as usize),
            false,
        )
        .expect("write-back write");
    }
    cache.commit().expect("commit");
    Rig {
        cache_dev,
        backing,
        slow,
        cache,
    }
}

/// Full-depth cleaning of every line at once (the thread's idle pace, or a flush).
fn eager(depth: usize) -> CleanerConfig {
    CleanerConfig {
        high_watermark: 0.0,
        low_watermark: 0.0,
        max_in_flight: depth,
        busy_in_flight: 1,
        busy_pause: Duration::from_millis(1),
        idle_after: Duration::from_millis(20),
        ..CleanerConfig::default()
    }
}

/// Lines whose data (generation `generation`) is in `image` (a backing device's bytes).
fn lines_on(image: &[u8], generation: u64) -> Vec<bool> {
    (0..LINES)
        .map(|i| {
            let at = sector_of(i) as usize;
            image[at..at + SECTOR as usize] == data(tag(i, generation), SECTOR as usize)[..]
        })
        .collect()
}

/// Every line reads its data through the cache.
fn assert_reads(cache: &Cache, generation: u64, when: &str) {
    let vol = &cache.volumes()[0];
    for i in 0..LINES {
        let mut buf = vec![0u8; SECTOR as usize];
        vol.read(sector_of(i), &mut buf).expect("read");
        assert!(
            buf == data(tag(i, generation), SECTOR as usize),
            "{when}: line {i} reads other data"
        );
    }
}

/// After a restart: every line the backing device lacks must still be dirty (else it was
/// recorded clean without its data on the disk, and a later eviction loses it).
fn assert_missing_lines_dirty(cache: &Cache, durable: &[bool], when: &str) {
    let missing = durable.iter().filter(|d| !**d).count() as u64;
    assert!(
        cache.dirty_lines() >= missing,
        "{when}: {missing} lines are not on the backing device but only {} are dirty",
        cache.dirty_lines()
    );
}

/// Writes back everything left and checks the backing device holds every line.
fn drain_and_check(cache: &Cache, backing: &CrashDevice, generation: u64, when: &str) {
    cache
        .drain(&eager(4), &mut |_| true)
        .expect("drain after restart");
    assert_eq!(cache.dirty_lines(), 0, "{when}: dirty lines left");
    let on = lines_on(&backing.durable_image(), generation);
    let lost: Vec<usize> = (0..LINES as usize).filter(|&i| !on[i]).collect();
    assert!(
        lost.is_empty(),
        "{when}: lines {lost:?} are not on the backing device"
    );
}

fn reopen(cache_dev: Arc<CrashDevice>, backing: Arc<CrashDevice>) -> Cache {
    open_dyn(cache_dev, backing).0
}

/// A power cut: each device keeps only what it flushed, and the cache opens on what is left.
fn power_cut(r: Rig) -> (Cache, Arc<CrashDevice>) {
    let cache_dev = Arc::new(CrashDevice::from_image(
        "cache",
        r.cache_dev.durable_image(),
    ));
    let backing = Arc::new(CrashDevice::from_image(
        "backing",
        r.backing.durable_image(),
    ));
    drop(r);
    (reopen(cache_dev, backing.clone()), backing)
}

/// Starts the cleaner, waits for `writes` of its backing writes, then stops it; returns the
/// writes at the stop's start and after it.
fn stop_after(r: &Rig, cfg: CleanerConfig, writes: u64) -> (u64, u64) {
    std::thread::sleep(Duration::from_millis(60));
    r.cache.start_cleaner(cfg);
    wait_for("the cleaner's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= writes
    });
    let at_stop = r.slow.slow_writes();
    let began = Instant::now();
    r.cache.stop_cleaner();
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "the stop took {:?}",
        began.elapsed()
    );
    (at_stop, r.slow.slow_writes())
}

/// `ssdcache flush` (the cleaner thread's `Pace::Flush`, 4 in flight) stopped part way, then a
/// clean stop (checkpoint) and a power cut after it: every line reads its data, every line the
/// disk lacks is dirty, and the next run writes everything back.
#[test]
fn flush_stopped_then_clean_restart_keeps_every_line() {
    let r = rig(1);
    r.cache.request_drain(true);
    let (at_stop, after) = stop_after(&r, eager(4), 8);
    assert!(
        after <= at_stop + 4,
        "{} writes after the stop",
        after - at_stop
    );
    assert!(r.cache.dirty_lines() > 0, "the whole flush was written");
    assert!(r.cache.draining(), "the stop ended the flush request");
    assert_reads(&r.cache, 1, "after the stop");
    r.cache.shutdown().expect("checkpoint");
    let durable = lines_on(&r.backing.durable_image(), 1);
    let (cache, backing) = power_cut(r);
    assert_missing_lines_dirty(&cache, &durable, "clean restart");
    assert_reads(&cache, 1, "clean restart");
    drain_and_check(&cache, &backing, 1, "clean restart");
}

/// The same with the daemon's unclean stop: the cleaner stopped, the journal committed (no
/// checkpoint), then a power cut keeping only what each device flushed: journal replay.
#[test]
fn flush_stopped_then_journal_replay_keeps_every_line() {
    let r = rig(2);
    r.cache.request_drain(true);
    stop_after(&r, eager(4), 8);
    assert!(r.cache.dirty_lines() > 0, "the whole flush was written");
    r.cache.commit().expect("journal commit");
    let durable = lines_on(&r.backing.durable_image(), 2);
    let (cache, backing) = power_cut(r);
    assert_missing_lines_dirty(&cache, &durable, "journal replay");
    assert_reads(&cache, 2, "journal replay");
    drain_and_check(&cache, &backing, 2, "journal replay");
}

/// A stop while the cleaner's batch is cut short and the batch's flush of the backing device
/// fails: nothing of the batch is recorded clean, so after a power cut (the written lines not
/// durable on the disk) every line is still in the cache, dirty.
#[test]
fn stop_with_a_failing_backing_flush_records_nothing_clean() {
    let r = rig(3);
    r.slow.fail_flush(true);
    r.cache.request_drain(true);
    let (at_stop, _) = stop_after(&r, eager(2), 4);
    assert!(at_stop >= 4);
    assert_eq!(
        r.cache.dirty_lines(),
        LINES,
        "lines were recorded clean though the backing flush failed"
    );
    // The checkpoint is refused after a failed backing flush (by design: the daemon's stop
    // then leaves the journal for the next start); either way, a power cut follows.
    let checkpoint = r.cache.shutdown();
    assert!(
        checkpoint.is_err(),
        "a checkpoint after a failed backing flush"
    );
    r.cache.commit().ok();
    let (cache, backing) = power_cut(r);
    assert_eq!(cache.dirty_lines(), LINES, "after the restart");
    assert_reads(&cache, 3, "failing flush, clean restart");
    drain_and_check(&cache, &backing, 3, "failing flush, clean restart");
}

/// `Cache::drain` (`Pace::ToTheEnd`, the caller's thread) running while the daemon stops the
/// cleaner: the drain is not cut short, it returns Ok with nothing dirty and every line on
/// the disk.
#[test]
fn a_drain_in_another_thread_is_not_cut_short_by_the_stop() {
    let r = rig(4);
    r.cache.request_drain(true);
    std::thread::sleep(Duration::from_millis(60));
    r.cache.start_cleaner(eager(2));
    wait_for("the cleaner's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= 2
    });
    let cache = r.cache.clone();
    let drainer = std::thread::spawn(move || {
        let cfg = CleanerConfig {
            batch_lines: 16,
            ..eager(2)
        };
        cache.drain(&cfg, &mut |_| true)
    });
    std::thread::sleep(Duration::from_millis(30));
    r.cache.stop_cleaner();
    drainer.join().expect("drainer").expect("drain");
    assert_eq!(r.cache.dirty_lines(), 0, "the drain was cut short");
    let on = lines_on(&r.backing.durable_image(), 4);
    assert!(on.iter().all(|d| *d), "the drain left lines off the disk");
}

/// `set_mode` to write-through (a drain in the caller's thread) while the cleaner is stopped:
/// the mode change completes, nothing dirty is left.
#[test]
fn set_mode_during_the_stop_completes() {
    let r = rig(5);
    std::thread::sleep(Duration::from_millis(60));
    r.cache.start_cleaner(eager(2));
    wait_for("the cleaner's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= 2
    });
    let cache = r.cache.clone();
    let switcher = std::thread::spawn(move || {
        cache.set_mode(0, CacheMode::WriteThrough, &eager(2), &mut |_| true)
    });
    std::thread::sleep(Duration::from_millis(30));
    r.cache.stop_cleaner();
    switcher.join().expect("switcher").expect("set_mode");
    assert_eq!(r.cache.dirty_lines(), 0);
    assert_eq!(r.cache.volumes()[0].mode(), CacheMode::WriteThrough);
    let on = lines_on(&r.backing.durable_image(), 5);
    assert!(on.iter().all(|d| *d), "set_mode left lines off the disk");
}

/// The cleaner started again after a stop (stop flag reset) resumes the flush that the stop
/// cut short: the flush request is still on, and it ends once everything is written back.
#[test]
fn a_restarted_cleaner_finishes_the_cut_flush() {
    let r = rig(6);
    r.cache.request_drain(true);
    stop_after(&r, eager(4), 6);
    assert!(r.cache.dirty_lines() > 0);
    r.cache.start_cleaner(eager(4));
    wait_for("the flush finished", Duration::from_secs(20), || {
        r.cache.dirty_lines() == 0 && !r.cache.draining()
    });
    r.cache.stop_cleaner();
    let on = lines_on(&r.backing.durable_image(), 6);
    assert!(on.iter().all(|d| *d), "lines are not on the disk");
    // Stopped and started twice more: each stop is quick and nothing is left behind.
    for round in 0..2u64 {
        let vol = r.cache.volumes()[0].clone();
        for i in 0..LINES {
            vol.write(
                sector_of(i),
                &data(tag(i, 7 + round), SECTOR as usize),
                false,
            )
            .expect("write");
        }
        let before = r.slow.slow_writes();
        r.cache.request_drain(true);
        std::thread::sleep(Duration::from_millis(30));
        r.cache.start_cleaner(eager(4));
        wait_for("writes", Duration::from_secs(10), || {
            r.slow.slow_writes() >= before + 4
        });
        let t = Instant::now();
        r.cache.stop_cleaner();
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "stop took {:?}",
            t.elapsed()
        );
        assert_reads(&r.cache, 7 + round, "after a later stop");
        r.cache.start_cleaner(eager(4));
        wait_for("written back", Duration::from_secs(20), || {
            r.cache.dirty_lines() == 0
        });
        r.cache.stop_cleaner();
        let on = lines_on(&r.backing.durable_image(), 7 + round);
        assert!(on.iter().all(|d| *d), "round {round}: lines not on disk");
    }
}

/// The trickle pace (clients keep the disk busy; age-based selection) stopped part way: a
/// stop leaves the rest dirty, the address sweep resumes at them, and clients' overwrites
/// during the cut batch win over the cleaner's older data after a restart.
#[test]
fn trickle_stopped_with_overwrites_keeps_the_newest_data() {
    let r = rig(8);
    let cfg = CleanerConfig {
        high_watermark: 1.0,
        low_watermark: 1.0,
        max_age: Duration::from_secs(0),
        busy_batch_lines: 64,
        idle_after: Duration::from_secs(60),
        ..eager(1)
    };
    r.cache.start_cleaner(cfg.clone());
    wait_for("the trickle's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= 3
    });
    // Overwrite every line with a newer generation while the batch runs, then stop.
    let vol = r.cache.volumes()[0].clone();
    for i in 0..LINES {
        vol.write(sector_of(i), &data(tag(i, 9), SECTOR as usize), false)
            .expect("overwrite");
    }
    r.cache.stop_cleaner();
    assert_reads(&r.cache, 9, "after the stop");
    r.cache.shutdown().expect("checkpoint");
    let (cache, backing) = power_cut(r);
    assert_reads(&cache, 9, "clean restart");
    drain_and_check(&cache, &backing, 9, "clean restart");
}

/// A drain in another thread (the control socket's `set-mode` of a volume with no dirty data
/// of its own drains the whole cache, `Pace::ToTheEnd`) goes on through the daemon's stop:
/// the cleaner stopped and the checkpoint written while it runs, then its last batches and
/// commits land after the checkpoint. After a power cut, every line reads its data and every
/// line the disk lacks is dirty.
#[test]
fn a_drain_racing_the_checkpoint_leaves_a_consistent_cache() {
    let r = rig(10);
    std::thread::sleep(Duration::from_millis(60));
    r.cache.start_cleaner(eager(2));
    let cache = r.cache.clone();
    let drainer = std::thread::spawn(move || {
        let cfg = CleanerConfig {
            batch_lines: 8,
            ..eager(2)
        };
        cache.drain(&cfg, &mut |_| true)
    });
    wait_for("the drain's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= 10
    });
    r.cache.stop_cleaner();
    r.cache.shutdown().expect("checkpoint");
    let at_checkpoint = r.slow.slow_writes();
    let drained = drainer.join().expect("drainer");
    assert!(
        r.slow.slow_writes() > at_checkpoint,
        "the drain did not run past the checkpoint (the race was not exercised)"
    );
    eprintln!("drain after the checkpoint: {drained:?}");
    let durable = lines_on(&r.backing.durable_image(), 10);
    let (cache, backing) = power_cut(r);
    assert_missing_lines_dirty(&cache, &durable, "drain past the checkpoint");
    assert_reads(
        &cache,
        10,
        &format!("drain past the checkpoint ({drained:?})"),
    );
    drain_and_check(&cache, &backing, 10, "drain past the checkpoint");
}

/// The stop waits for the writes in flight (design.md §3), not for a pause: a stop right
/// after a batch failed (its backing flush returned an error) waits out the cleaner's 1 s
/// retry pause, which no stop interrupts.
#[test]
fn a_stop_after_a_failed_batch_does_not_wait_out_the_retry_pause() {
    let r = rig(11);
    r.slow.fail_flush(true);
    r.cache.request_drain(true);
    std::thread::sleep(Duration::from_millis(60));
    r.cache.start_cleaner(CleanerConfig {
        batch_lines: 4,
        ..eager(1)
    });
    wait_for("the first batch's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= 4
    });
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    r.cache.stop_cleaner();
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "the stop took {took:?} (the writes in flight take 5 ms)"
    );
}

/// A flush at 4 in flight, clients overwriting every line while it runs, stopped part way;
/// then a power cut keeping every cache write but only what the disk flushed (journal
/// replay, no checkpoint): the newest data reads back and is what reaches the disk.
#[test]
fn flush_stopped_amid_overwrites_then_power_cut_keeps_the_newest_data() {
    let r = rig(12);
    r.cache.request_drain(true);
    std::thread::sleep(Duration::from_millis(60));
    r.cache.start_cleaner(eager(4));
    wait_for("the flush's writes", Duration::from_secs(10), || {
        r.slow.slow_writes() >= 4
    });
    let vol = r.cache.volumes()[0].clone();
    for i in (0..LINES).rev() {
        vol.write(sector_of(i), &data(tag(i, 13), SECTOR as usize), false)
            .expect("overwrite");
    }
    r.cache.stop_cleaner();
    assert!(r.cache.dirty_lines() > 0, "the whole flush was written");
    vol.flush().expect("client flush");
    let (cache_dev, backing) = common::cut_keeping_cache_writes(&r.cache_dev, &r.backing);
    let durable = lines_on(&backing.durable_image(), 13);
    drop(vol);
    drop(r);
    let cache = reopen(cache_dev, backing.clone());
    assert_missing_lines_dirty(&cache, &durable, "overwrites, power cut");
    assert_reads(&cache, 13, "overwrites, power cut");
    drain_and_check(&cache, &backing, 13, "overwrites, power cut");
}
