//! Issue 11, item 3: no line lock is held across backing I/O where a hit could need the line.
//! A read that misses part of a line reads the disk without holding the line, so a hit on the
//! line's cached sectors goes on meanwhile; and what the miss puts in the cache afterwards is
//! never older than what the cache or the disk holds by then: a write of the line that began
//! on the disk while the miss read it (a write-through write, the cleaner's writeback) makes the
//! miss read again holding the line.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::{counter, data, gated_cache, on_disk, read_in_thread, MIB};
use ssdcache_device::BlockDevice;
use ssdcache_devsim::{GateDevice, MemDevice};
use ssdcache_engine::{Cache, CleanerConfig, Volume};
use ssdcache_format::CacheMode;

const SECTOR: usize = 4096;
const LINE: u64 = 64 * 1024;
const BACKING: u64 = 16 * MIB;
/// Long enough for a hit (or a write that needs no disk wait) on an idle machine many times
/// over; one that waits for the held disk read never returns before the test releases it.
const LIMIT: Duration = Duration::from_secs(3);

fn in_thread(what: impl FnOnce() + Send + 'static) -> std::sync::mpsc::Receiver<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        what();
        let _ = tx.send(());
    });
    rx
}

/// A cache whose line at 0 holds `old` on the disk and whose second sector was written
/// (`new`), so the line is cached in part.
struct PartlyCached {
    mem: Arc<MemDevice>,
    gate: Arc<GateDevice>,
    cache: Arc<Cache>,
    vol: Arc<Volume>,
    old: Vec<u8>,
    new: Vec<u8>,
}

fn partly_cached_line(mode: CacheMode) -> PartlyCached {
    let (mem, gate, cache) = gated_cache(mode, LINE, BACKING, 16 * MIB);
    let vol = cache.volumes()[0].clone();
    let old = data(1, LINE as usize);
    mem.write_at(&old, 0).expect("seed backing");
    let new = data(2, SECTOR);
    vol.write(SECTOR as u64, &new, false)
        .expect("write the second sector");
    PartlyCached {
        mem,
        gate,
        cache,
        vol,
        old,
        new,
    }
}

/// A miss on the first sector held at the disk; a hit on the cached second sector of the same
/// line returns meanwhile; the miss returns the disk's data once released.
fn hit_beside_a_held_read_miss(mode: CacheMode) {
    let PartlyCached {
        gate,
        vol,
        old,
        new,
        ..
    } = partly_cached_line(mode);
    gate.hold_next_read();
    let miss = read_in_thread(&vol, 0, SECTOR);
    assert!(
        gate.wait_until_held(Duration::from_secs(10)),
        "the miss reached the disk"
    );
    let hits_before = counter(&vol, "read_hits");
    let hit = read_in_thread(&vol, SECTOR as u64, SECTOR).recv_timeout(LIMIT);
    let hits_after = counter(&vol, "read_hits");
    gate.release();
    let missed = miss
        .recv_timeout(Duration::from_secs(10))
        .expect("the miss returns once released");

    let hit =
        hit.expect("a hit on another sector of the line waited for the read miss's disk read");
    assert_eq!(hit, new, "the hit returns the cached data");
    assert_eq!(hits_after, hits_before + 1, "it was a hit");
    assert_eq!(missed, old[..SECTOR], "the miss returns the disk's data");
    let mut line = vec![0u8; LINE as usize];
    vol.read(0, &mut line).expect("read the line");
    let mut expected = old.clone();
    expected[SECTOR..2 * SECTOR].copy_from_slice(&new);
    assert_eq!(line, expected, "the line reads as written");
}

#[test]
fn write_through_a_hit_on_the_same_line_does_not_wait_for_a_read_miss() {
    hit_beside_a_held_read_miss(CacheMode::WriteThrough);
}

#[test]
fn write_back_a_hit_on_the_same_line_does_not_wait_for_a_read_miss() {
    hit_beside_a_held_read_miss(CacheMode::WriteBack);
}

impl PartlyCached {
    /// Reads the first sector with its disk read held at the gate, runs `meanwhile` in another
    /// thread (which must finish while the read is held: it needs no disk read), releases the
    /// read and returns what it got.
    fn read_miss_held_during(&self, meanwhile: impl FnOnce() + Send + 'static) -> Vec<u8> {
        self.gate.hold_next_read();
        let miss = read_in_thread(&self.vol, 0, SECTOR);
        assert!(self.gate.wait_until_held(Duration::from_secs(10)));
        let writer = in_thread(meanwhile);
        let wrote_meanwhile = writer.recv_timeout(LIMIT);
        self.gate.release();
        let missed = miss.recv_timeout(Duration::from_secs(10)).expect("miss");
        writer_done(wrote_meanwhile, &writer);
        missed
    }

    /// Asserts the disk holds the line with the second sector's write and `third` in the third
    /// sector, and that a read of the whole line returns the same (`cache_says` if not).
    fn assert_line_has_both_writes(&self, third: &[u8], cache_says: &str) {
        let mut expected = self.old.clone();
        expected[SECTOR..2 * SECTOR].copy_from_slice(&self.new);
        expected[2 * SECTOR..3 * SECTOR].copy_from_slice(third);
        assert_eq!(
            on_disk(&self.mem, 0, LINE as usize),
            expected,
            "the disk has both writes"
        );
        let mut line = vec![0u8; LINE as usize];
        self.vol.read(0, &mut line).expect("read the line");
        assert_eq!(line, expected, "{cache_says}");
    }
}

/// Write-through: while a miss is held with the line's old disk data, a write of the line's
/// third sector lands on the disk and in the cache. The miss must not then fill the cache with
/// the old third sector it read.
#[test]
fn write_through_a_write_during_a_read_miss_is_not_undone_by_its_fill() {
    let line = partly_cached_line(CacheMode::WriteThrough);
    let third = data(3, SECTOR);
    let missed = line.read_miss_held_during({
        let (vol, third) = (line.vol.clone(), third.clone());
        move || vol.write(2 * SECTOR as u64, &third, false).expect("write")
    });
    assert_eq!(
        missed,
        line.old[..SECTOR],
        "the miss returns the disk's data"
    );
    line.assert_line_has_both_writes(&third, "the cache agrees with the disk");
    let mut sector = vec![0u8; SECTOR];
    line.vol.read(2 * SECTOR as u64, &mut sector).expect("read");
    assert_eq!(sector, third, "the third sector reads as written");
}

/// Write-back: while a miss is held with the line's old disk data, the second and third
/// sectors are dirty in the cache and the cleaner writes them back and records them clean. The
/// miss must not then fill the cache with the old sectors it read (they are no longer dirty,
/// so nothing lays the cache's copy over them): that would lose two acknowledged writes.
#[test]
fn write_back_a_writeback_during_a_read_miss_is_not_undone_by_its_fill() {
    let line = partly_cached_line(CacheMode::WriteBack);
    let third = data(3, SECTOR);
    let missed = line.read_miss_held_during({
        let (vol, cache, third) = (line.vol.clone(), line.cache.clone(), third.clone());
        move || {
            vol.write(2 * SECTOR as u64, &third, false).expect("write");
            cache
                .drain(&CleanerConfig::default(), &mut |_| true)
                .expect("drain");
        }
    });
    assert_eq!(
        missed,
        line.old[..SECTOR],
        "the miss returns the disk's data"
    );
    line.assert_line_has_both_writes(&third, "the cache serves both acknowledged writes");
}

/// Asserts the writer finished while the miss was held (it needs no disk read, so it must not
/// wait for one), after waiting for it to finish in any case.
fn writer_done(
    meanwhile: Result<(), std::sync::mpsc::RecvTimeoutError>,
    writer: &std::sync::mpsc::Receiver<()>,
) {
    if meanwhile.is_err() {
        let _ = writer.recv_timeout(Duration::from_secs(10));
        panic!("a write of the line waited for a read miss's disk read");
    }
}

/// Two misses on one line at once: the second does not read the disk again while the first
/// reads the line, it waits (without the line) for the first to cache it and is then a hit;
/// the line is read from the disk once.
#[test]
fn a_second_miss_on_a_line_being_read_waits_for_it_instead_of_reading_the_disk_again() {
    let PartlyCached { gate, vol, old, .. } = partly_cached_line(CacheMode::WriteThrough);
    let from_disk_before = counter(&vol, "bytes_from_backing");
    gate.hold_next_read();
    let first = read_in_thread(&vol, 0, SECTOR);
    assert!(gate.wait_until_held(Duration::from_secs(10)));
    let second = read_in_thread(&vol, 3 * SECTOR as u64, SECTOR);
    let early = second.recv_timeout(Duration::from_millis(300));
    gate.release();
    let first = first.recv_timeout(Duration::from_secs(10)).expect("first");
    let second = match early {
        Ok(data) => data,
        Err(_) => second
            .recv_timeout(Duration::from_secs(10))
            .expect("second"),
    };
    assert_eq!(first, old[..SECTOR]);
    assert_eq!(second, old[3 * SECTOR..4 * SECTOR]);
    assert_eq!(
        counter(&vol, "bytes_from_backing") - from_disk_before,
        LINE,
        "the line was read from the disk once"
    );
}
