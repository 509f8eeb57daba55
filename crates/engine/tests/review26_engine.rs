//! Review 26: 459cd3e (data checksums out of RAM: `checksums.rs`, `CacheCore::read_map_paged`
//! / `write_map_paged` / `page_in`, pages written while running). Each `a_*` test here failed
//! on 459cd3e and passes with the fixes (docs/design.md §3 "Checksums out of RAM", §4.8); the
//! `held_*` ones passed already.
//!
//! R26-1 (a lost page revives damaged data): `MapState::install_checksums` marks every dirty
//! sector of a lost page's slots `unverified`, damaged ones included; `accept_newer_data` then
//! accepts any non-zero data for them and clears the damage: garbage the engine had already
//! refused is served and written back to the backing device. One transient read error on a
//! metadata page is enough.
//!
//! R26-2 (a lost page fails the volume): a lost page's clean sectors keep `valid` with
//! checksum 0; each read of one is a "checksum error" and a cache error: a write-back volume
//! is failed at the first, a write-through one goes pass-through after 8.
//!
//! R26-3 (failing page writes are retried without end): a page write that fails leaves its
//! frame modified and due; `write_due_checksum_pages` takes it again in each of its 4 rounds,
//! and every request over the budget calls it (the committer, when one runs, the same on each
//! wake): with the metadata region refusing writes, 2,000 writes of 4 KiB made 186,496 failing
//! page writes (93 per write, up to 4 x 64 = 256, each logged at warn).
//!
//! R26-4 (one closing stamp): `ChecksumPages` keeps a single `closing_stamp`; pages a failed
//! clean stop wrote are read with it. A second failed stop with another sequence number that
//! fails before its last batch replaces it: the first stop's pages of the later batches, intact
//! on the device, read as lost (R26-2's effects follow).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::*;
use ssdcache_device::BlockDevice;
use ssdcache_devsim::MemDevice;
use ssdcache_engine::checksums::checksum_frame_bytes;
use ssdcache_engine::{Cache, VolumeState};
use ssdcache_format::CacheMode;

const LINE: u64 = 64 << 10;
const SECTOR: usize = 4096;

fn one_frame(cache: &Cache) {
    cache
        .set_checksum_memory(checksum_frame_bytes(LINE))
        .expect("checksum memory");
}

fn meta_range(cache: &Cache) -> std::ops::Range<u64> {
    let l = cache.layout();
    l.meta_offset..l.meta_offset + l.meta_len
}

/// R26-1.
#[test]
fn a_lost_checksum_page_does_not_revive_damaged_dirty_data() {
    let began = Instant::now();
    let (cache_dev, backing, cache) = setup_crash(32 << 20, 64 << 20, LINE, CacheMode::WriteBack);
    one_frame(&cache);
    let vol = cache.volumes()[0].clone();
    let line0 = data(1, LINE as usize);
    vol.write(0, &line0, false).expect("write line 0");
    // Lines on the next pages: line 0's page is written and dropped (one frame).
    for i in 1..120u64 {
        vol.write(i * LINE, &data(100 + i, SECTOR), false)
            .expect("write");
    }
    vol.flush().expect("flush");
    let slot = failing::slot_holding(&cache_dev, &line0);
    let garbage = failing::damage_sector(&cache_dev, slot, 2);
    // The damage is found: the read fails, the sector is marked damaged.
    assert!(
        read_vec(&cache, 0, LINE).is_err(),
        "a damaged dirty sector fails the read"
    );
    assert!(!cache.damaged_ranges().is_empty(), "sector 2 is damaged");
    // Line 0's page leaves RAM again (it was not changed).
    for i in [50u64, 100, 60, 110] {
        read_vec(&cache, i * LINE, SECTOR as u64).expect("read");
    }
    // One transient read error on the metadata region while line 0 is read.
    cache_dev.fail_reads_in(Some(meta_range(&cache)));
    let again = read_vec(&cache, 0, LINE);
    cache_dev.fail_reads_in(None);
    let served_garbage = matches!(&again, Ok(buf) if failing::sector_of(buf, 2) == &garbage[..]);
    let damaged_after = cache.damaged_ranges();
    // What the cleaner does with it.
    let drained = cache.drain(&Default::default(), &mut |_| true);
    let disk = on_disk_crash(&backing, 2 * SECTOR as u64, SECTOR);
    let garbage_on_disk = disk == garbage;
    assert!(began.elapsed().as_secs() < 60);
    assert!(
        !served_garbage && !damaged_after.is_empty() && !garbage_on_disk,
        "after a lost checksum page the damaged sector was served: {served_garbage}, still \
         marked damaged: {} ({damaged_after:?}), drain: {:?}, garbage written to the backing \
         device: {garbage_on_disk}",
        !damaged_after.is_empty(),
        drained.map_err(|e| e.to_string())
    );
}

fn on_disk_crash(dev: &ssdcache_devsim::CrashDevice, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    dev.read_at(&mut buf, offset).expect("backing read");
    buf
}

/// Fills lines `0..lines` as clean (read misses), one frame of checksums: the first lines'
/// page goes to the device. Returns the cache devices and the cache.
fn clean_lines(
    mode: CacheMode,
    lines: u64,
) -> (
    Arc<ssdcache_devsim::CrashDevice>,
    Arc<ssdcache_devsim::CrashDevice>,
    Cache,
) {
    let (cache_dev, backing, cache) = setup_crash(32 << 20, 64 << 20, LINE, mode);
    for i in 0..lines {
        backing
            .write_at(&data(7000 + i, LINE as usize), i * LINE)
            .expect("backing");
    }
    backing.flush().expect("flush");
    one_frame(&cache);
    for i in 0..lines {
        let got = read_vec(&cache, i * LINE, LINE).expect("fill");
        assert!(got == data(7000 + i, LINE as usize));
    }
    (cache_dev, backing, cache)
}

fn read_first_lines_with_meta_unreadable(cache_dev: &ssdcache_devsim::CrashDevice, cache: &Cache) {
    cache_dev.fail_reads_in(Some(meta_range(cache)));
    for i in 0..20u64 {
        let got = read_vec(cache, i * LINE, LINE).expect("read");
        assert!(got == data(7000 + i, LINE as usize), "line {i}: right data");
    }
    cache_dev.fail_reads_in(None);
}

/// R26-2, write-back: one lost page fails the volume.
#[test]
fn a_lost_checksum_page_does_not_fail_a_write_back_volume() {
    let (cache_dev, _backing, cache) = clean_lines(CacheMode::WriteBack, 90);
    let vol = cache.volumes()[0].clone();
    read_first_lines_with_meta_unreadable(&cache_dev, &cache);
    assert!(
        vol.state() == VolumeState::Healthy && counter(&vol, "checksum_errors") == 0,
        "one unreadable metadata page (clean lines only, data intact): volume {:?}, {} \
         checksum errors, {} cache errors",
        vol.state(),
        counter(&vol, "checksum_errors"),
        counter(&vol, "cache_errors"),
    );
}

/// R26-2, write-through: 8 reads of a lost page's clean lines turn the cache off.
#[test]
fn a_lost_checksum_page_does_not_turn_a_write_through_volume_to_pass_through() {
    let (cache_dev, _backing, cache) = clean_lines(CacheMode::WriteThrough, 90);
    let vol = cache.volumes()[0].clone();
    read_first_lines_with_meta_unreadable(&cache_dev, &cache);
    assert!(
        vol.state() == VolumeState::Healthy && vol.mode() == CacheMode::WriteThrough,
        "one unreadable metadata page (clean lines only, data intact): volume {:?} in mode \
         {}, {} checksum errors, {} cache errors",
        vol.state(),
        vol.mode(),
        counter(&vol, "checksum_errors"),
        counter(&vol, "cache_errors"),
    );
}

/// A memory device whose writes into `failing` fail (EIO), counting them.
struct MetaWritesFail {
    inner: MemDevice,
    failing: std::sync::Mutex<Option<std::ops::Range<u64>>>,
    failed_writes: AtomicU64,
}

impl BlockDevice for MetaWritesFail {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if let Some(r) = self.failing.lock().unwrap().clone() {
            if offset < r.end && offset + buf.len() as u64 > r.start {
                self.failed_writes.fetch_add(1, Ordering::SeqCst);
                return Err(std::io::Error::from_raw_os_error(5));
            }
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn describe(&self) -> String {
        "meta-writes-fail".into()
    }
}

/// R26-3.
#[test]
fn a_failing_metadata_page_write_is_not_retried_hundreds_of_times_per_request() {
    let dev = Arc::new(MetaWritesFail {
        inner: MemDevice::new("cache", 256 << 20),
        failing: std::sync::Mutex::new(None),
        failed_writes: AtomicU64::new(0),
    });
    let backing = Arc::new(MemDevice::new("backing", 512 << 20));
    format_dev(&*dev, LINE, CacheMode::WriteBack, 512 << 20, 0);
    let (cache, _) = open_dyn(dev.clone(), backing.clone());
    one_frame(&cache);
    let meta = meta_range(&cache);
    *dev.failing.lock().unwrap() = Some(meta);
    let vol = cache.volumes()[0].clone();
    let writes = 2000u64;
    let began = Instant::now();
    for i in 0..writes {
        vol.write(i * LINE, &data(i + 1, SECTOR), false)
            .expect("write");
    }
    let took = began.elapsed();
    *dev.failing.lock().unwrap() = None;
    let failed = dev.failed_writes.load(Ordering::SeqCst);
    let usage = cache.checksum_usage();
    assert!(
        failed <= 2 * writes,
        "{writes} writes of 4 KiB made {failed} failing metadata page writes ({} per write, \
         each logged; {took:?}); frames now {usage:?}",
        failed / writes
    );
}

/// R26-4: the pages a first failed clean stop wrote keep that checkpoint's stamp, but
/// `ChecksumPages` remembers one `closing_stamp`: a second failed stop with another sequence
/// number (a superblock write came between) that fails before its last batch makes every page
/// of the first one's later batches read as lost, though the device holds them intact.
#[test]
fn a_second_failed_clean_stop_does_not_lose_the_pages_the_first_wrote() {
    const SMALL: u64 = 4096;
    let began = Instant::now();
    let cache_dev = Arc::new(ssdcache_devsim::CrashDevice::new("cache", 160 << 20));
    let backing = Arc::new(ssdcache_devsim::CrashDevice::new("backing", 128 << 20));
    format_dev(&*cache_dev, SMALL, CacheMode::WriteThrough, 128 << 20, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    cache
        .set_checksum_memory(checksum_frame_bytes(SMALL))
        .expect("one frame");
    let per_page = 113u64; // records of a 4 KiB-line metadata page
    let lines = cache.layout().line_count.min(262 * per_page);
    assert!(
        lines > 257 * per_page,
        "more than one checkpoint batch (256 pages)"
    );
    for at in (0..lines * SMALL).step_by(1 << 20) {
        let len = (1u64 << 20).min(lines * SMALL - at);
        backing
            .write_at(&data(at, len as usize), at)
            .expect("backing");
    }
    backing.flush().expect("flush");
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; 1 << 20];
    for at in (0..lines * SMALL).step_by(1 << 20) {
        let len = (1u64 << 20).min(lines * SMALL - at) as usize;
        vol.read(at, &mut buf[..len]).expect("fill");
    }
    // First clean stop: every page written (stamp S1), the final flush fails.
    cache_dev.fail_flushes(true);
    assert!(cache.shutdown().is_err(), "the first stop fails");
    cache_dev.fail_flushes(false);
    // A superblock write: the next checkpoint takes another sequence number.
    cache.persist_config().expect("persist config");
    // Second clean stop (stamp S2) fails at its first batch.
    cache_dev.fail_writes(true);
    assert!(cache.shutdown().is_err(), "the second stop fails");
    cache_dev.fail_writes(false);
    // Pages 256.. hold S1 intact; their lines read back without losing a page.
    let before = cache.checksum_usage().pages_lost;
    for page in 257..261u64 {
        let line = page * per_page + 5;
        let got = read_vec(&cache, line * SMALL, SMALL).expect("read");
        assert!(
            got == data((line * SMALL) & !((1 << 20) - 1), 1 << 20)
                [(line * SMALL % (1 << 20)) as usize..][..SMALL as usize]
        );
    }
    let lost = cache.checksum_usage().pages_lost - before;
    assert!(began.elapsed().as_secs() < 120);
    assert!(
        lost == 0 && counter(&vol, "checksum_errors") == 0,
        "pages the first stop wrote intact read as lost: {lost} lost, {} checksum errors, \
         volume {:?}",
        counter(&vol, "checksum_errors"),
        vol.state()
    );
}

/// Held on 459cd3e: four threads of large writes and reads (up to 2 MiB, 32 lines) over their
/// own ranges with one frame of checksums, cleaner and committer running, the budget changed
/// meanwhile; then a clean restart, a check of everything and a drain.
#[test]
fn held_threads_of_large_requests_with_one_frame() {
    let began = Instant::now();
    let cache_dev = Arc::new(MemDevice::new("cache", 64 << 20));
    let backing = Arc::new(MemDevice::new("backing", 128 << 20));
    format_dev(&*cache_dev, LINE, CacheMode::WriteBack, 128 << 20, 0);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    let cache = Arc::new(cache);
    one_frame(&cache);
    let cfg = ssdcache_engine::CleanerConfig {
        max_age: std::time::Duration::from_millis(50),
        ..Default::default()
    };
    cache.start_cleaner(cfg);
    const THREADS: u64 = 4;
    const SPAN: u64 = 32 << 20;
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let cache = cache.clone();
            std::thread::spawn(move || {
                let vol = cache.volumes()[0].clone();
                let base = t * SPAN;
                let mut model = vec![0u8; SPAN as usize];
                let mut rng = Rng(t + 11);
                for op in 0..150u64 {
                    let len = (1 + rng.below(512)) * 4096;
                    let at = rng.below((SPAN - len) / 4096) * 4096;
                    if rng.below(3) > 0 {
                        let d = data(t << 32 | op, len as usize);
                        vol.write(base + at, &d, rng.below(8) == 0).expect("write");
                        model[at as usize..(at + len) as usize].copy_from_slice(&d);
                    } else {
                        let mut buf = vec![0u8; len as usize];
                        vol.read(base + at, &mut buf).expect("read");
                        assert!(
                            buf == model[at as usize..(at + len) as usize],
                            "thread {t} op {op}: read [{at}, +{len}) differs"
                        );
                    }
                    if op % 40 == 39 {
                        vol.flush().expect("flush");
                        let frames = 1 + rng.below(3);
                        cache
                            .set_checksum_memory(frames * checksum_frame_bytes(LINE))
                            .expect("budget");
                    }
                }
                vol.flush().expect("flush");
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    cache.stop_cleaner();
    let usage = cache.checksum_usage();
    assert!(usage.resident_frames <= 64 + 3 + 3, "{usage:?}");
    assert!(cache.halted().is_none());
    cache.shutdown().expect("clean stop");
    drop(cache);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    one_frame(&cache);
    let vol = cache.volumes()[0].clone();
    let mut buf = vec![0u8; SPAN as usize];
    for (t, model) in models.iter().enumerate() {
        vol.read(t as u64 * SPAN, &mut buf)
            .expect("read after restart");
        assert!(buf == *model, "thread {t}'s range after a clean restart");
    }
    cache
        .drain(&Default::default(), &mut |_| true)
        .expect("drain");
    for (t, model) in models.iter().enumerate() {
        assert!(
            on_disk(&backing, t as u64 * SPAN, SPAN as usize) == *model,
            "thread {t}'s range on the backing device after the drain"
        );
    }
    assert!(began.elapsed().as_secs() < 120);
}

/// Held on 459cd3e: after a clean stop, a run overwrites checkpoint pages with its own page
/// writes (one frame), then the power is cut (its unflushed writes kept, lost or torn): the
/// recovery replays the journal and reads every dirty line right; then a clean stop with the
/// metadata region overwritten by garbage while running, and a restart.
#[test]
fn held_checkpoint_pages_overwritten_by_a_run_then_a_crash_then_garbage_pages() {
    let began = Instant::now();
    let (cache_dev, backing, cache) = setup_crash(32 << 20, 64 << 20, LINE, CacheMode::WriteBack);
    one_frame(&cache);
    let vol = cache.volumes()[0].clone();
    let mut model = vec![0u8; 64 << 20];
    fn write(model: &mut [u8], vol: &ssdcache_engine::Volume, tag: u64, at: u64, len: usize) {
        let d = data(tag, len);
        vol.write(at, &d, false).expect("write");
        model[at as usize..at as usize + len].copy_from_slice(&d);
    }
    for i in 0..200u64 {
        write(&mut model, &vol, i + 1, i * 2 * LINE + (i % 3) * 8192, 8192);
    }
    vol.flush().expect("flush");
    cache.shutdown().expect("clean stop");
    drop((vol, cache));
    for seed in 0..4u64 {
        let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
        one_frame(&cache);
        let vol = cache.volumes()[0].clone();
        for i in 0..120u64 {
            write(
                &mut model,
                &vol,
                1000 * (seed + 1) + i,
                (i * 7 % 400) * LINE + 4096,
                4096,
            );
            let mut buf = vec![0u8; 4096];
            vol.read((i * 13 % 400) * LINE, &mut buf).expect("read");
        }
        vol.flush().expect("flush");
        assert!(cache.checksum_usage().pages_written > 0);
        drop((vol, cache));
        let cut = Arc::new(cache_dev.crashed("cache", seed));
        let (cache, report) = open_dyn(cut.clone(), backing.clone());
        assert!(report.recovery.is_some());
        one_frame(&cache);
        for line in 0..(64u64 << 20) / LINE {
            let at = (line * LINE) as usize;
            let got = read_vec(&cache, line * LINE, LINE).expect("read after the cut");
            assert!(
                got == model[at..at + LINE as usize],
                "seed {seed} line {line}"
            );
        }
        cache.shutdown().expect("clean stop");
        drop(cache);
        // Carry on from the recovered image.
        let image = cut.written_image();
        cache_dev.write_at(&image, 0).expect("copy");
        cache_dev.flush().expect("flush");
    }
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    one_frame(&cache);
    let l = cache.layout();
    cache_dev
        .write_at(&data(0xdead, l.meta_len as usize), l.meta_offset)
        .expect("garbage");
    cache.shutdown().expect("clean stop with every page lost");
    drop(cache);
    let (cache, _) = open_dyn(cache_dev.clone(), backing.clone());
    for line in 0..(64u64 << 20) / LINE {
        let at = (line * LINE) as usize;
        let got = read_vec(&cache, line * LINE, LINE).expect("read after garbage");
        assert!(
            got == model[at..at + LINE as usize],
            "line {line} after garbage"
        );
    }
    cache
        .drain(&Default::default(), &mut |_| true)
        .expect("drain");
    let mut disk = vec![0u8; 64 << 20];
    backing.read_at(&mut disk, 0).expect("backing");
    assert!(disk == model, "the backing device after the drain");
    assert!(began.elapsed().as_secs() < 120);
}
