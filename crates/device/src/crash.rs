//! A device in RAM with a volatile write cache, for crash tests.
//!
//! A real disk acknowledges a write once it sits in its cache; only a flush promises that the
//! write survives a power cut, and writes not yet flushed may land whole, not at all, or only
//! in part (some of their sectors), in any combination. [`CrashDevice`] keeps what a reader
//! sees apart from what a power cut would leave, so a test can cut the power at any point
//! ([`CrashDevice::crash`]), reopen the resulting image and check that recovery copes with
//! every outcome the hardware allows — reproducibly, from a seed.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{BlockDevice, SplitMix64, ALIGN};

/// A memory device whose writes become durable only at [`flush`](BlockDevice::flush), with
/// switches that make reads, writes or flushes fail.
///
/// Reads see every completed write (the "written" image); [`crash`](CrashDevice::crash)
/// returns what a power cut would leave: the "durable" image plus any choice of the writes made
/// since the last flush, each kept, dropped or torn at 4 KiB sector boundaries.
pub struct CrashDevice {
    name: String,
    size: u64,
    state: Mutex<State>,
    fail_reads: AtomicBool,
    fail_writes: AtomicBool,
    fail_flushes: AtomicBool,
    writes: AtomicU64,
    flushes: AtomicU64,
}

/// A device image in 4 KiB copy-on-write chunks: cloning it is cheap and only chunks written
/// afterwards are copied, so a test can take thousands of crash images of a device whose
/// bytes are mostly untouched.
#[derive(Clone)]
struct Image {
    chunks: Vec<Arc<Vec<u8>>>,
    len: usize,
}

const CHUNK: usize = 4 << 10;

impl Image {
    fn from_vec(bytes: Vec<u8>) -> Image {
        let zero = Arc::new(vec![0u8; CHUNK]);
        let chunks = bytes
            .chunks(CHUNK)
            .map(|c| {
                if c.len() == CHUNK && c.iter().all(|&b| b == 0) {
                    zero.clone()
                } else {
                    Arc::new(c.to_vec())
                }
            })
            .collect();
        Image {
            chunks,
            len: bytes.len(),
        }
    }

    fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len);
        for c in &self.chunks {
            out.extend_from_slice(c);
        }
        out
    }

    /// Visits `start..start+len` chunk by chunk as (chunk index, range in chunk, range in
    /// the caller's buffer).
    fn spans(
        start: usize,
        len: usize,
    ) -> impl Iterator<Item = (usize, Range<usize>, Range<usize>)> {
        let mut pos = start;
        let end = start + len;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let (c, at) = (pos / CHUNK, pos % CHUNK);
            let n = (CHUNK - at).min(end - pos);
            let item = (c, at..at + n, pos - start..pos - start + n);
            pos += n;
            Some(item)
        })
    }

    fn read(&self, start: usize, out: &mut [u8]) {
        for (c, inner, outer) in Self::spans(start, out.len()) {
            out[outer].copy_from_slice(&self.chunks[c][inner]);
        }
    }

    fn write(&mut self, start: usize, data: &[u8]) {
        for (c, inner, outer) in Self::spans(start, data.len()) {
            Arc::make_mut(&mut self.chunks[c])[inner].copy_from_slice(&data[outer]);
        }
    }

    fn zero(&mut self, start: usize, len: usize) {
        for (c, inner, _) in Self::spans(start, len) {
            Arc::make_mut(&mut self.chunks[c])[inner].fill(0);
        }
    }
}

struct State {
    /// What reads see: every completed write applied.
    written: Image,
    /// What survives a crash for certain: every write completed before the last flush.
    durable: Image,
    /// Writes completed since the last flush, oldest first; a crash may lose or tear them.
    pending: Vec<PendingWrite>,
    /// Reads overlapping this byte range fail, to break one area (say a cache's data) only.
    fail_reads_in: Option<Range<u64>>,
}

/// One unflushed write. Offset and length were checked against the device size when it was
/// accepted, so applying it to an image of that size cannot go out of bounds.
struct PendingWrite {
    offset: u64,
    payload: Payload,
}

/// The data of a pending write; zeroes are kept as a length so that zeroing a large range
/// does not hold a second copy of it in memory until the next flush.
enum Payload {
    Bytes(Vec<u8>),
    Zeroes(usize),
}

impl PendingWrite {
    fn len(&self) -> usize {
        match &self.payload {
            Payload::Bytes(b) => b.len(),
            Payload::Zeroes(n) => *n,
        }
    }

    /// Copies the bytes `part` (relative to the start of the write) into `image`.
    fn apply(&self, image: &mut Image, part: Range<usize>) {
        let start = self.offset as usize + part.start;
        match &self.payload {
            Payload::Bytes(b) => image.write(start, &b[part]),
            Payload::Zeroes(_) => image.zero(start, part.len()),
        }
    }

    /// The write split at absolute 4 KiB boundaries, as ranges relative to its start: the
    /// units a power cut can keep or lose independently. An unaligned write has partial
    /// sectors at its ends; each counts as one unit.
    fn sectors(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        let align = ALIGN as u64;
        let end = self.offset + self.len() as u64;
        let mut pos = self.offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let next = ((pos / align + 1) * align).min(end);
            let part = (pos - self.offset) as usize..(next - self.offset) as usize;
            pos = next;
            Some(part)
        })
    }
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl CrashDevice {
    /// A zero-filled device of `size` bytes, all of it durable.
    pub fn new(name: &str, size: u64) -> CrashDevice {
        Self::from_image(name, vec![0; size as usize])
    }

    /// A device holding `image`, all of it durable: typically the result of
    /// [`crash`](Self::crash), to reopen what a power cut left.
    pub fn from_image(name: &str, image: Vec<u8>) -> CrashDevice {
        Self::from_chunks(name, Image::from_vec(image))
    }

    fn from_chunks(name: &str, image: Image) -> CrashDevice {
        CrashDevice {
            name: name.to_owned(),
            size: image.len as u64,
            state: Mutex::new(State {
                written: image.clone(),
                durable: image,
                pending: Vec::new(),
                fail_reads_in: None,
            }),
            fail_reads: AtomicBool::new(false),
            fail_writes: AtomicBool::new(false),
            fail_flushes: AtomicBool::new(false),
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        }
    }

    /// Makes every read fail with EIO (true) or work again (false).
    pub fn fail_reads(&self, fail: bool) {
        self.fail_reads.store(fail, Ordering::SeqCst);
    }

    /// Makes every write and write_zeroes fail with EIO, changing nothing.
    pub fn fail_writes(&self, fail: bool) {
        self.fail_writes.store(fail, Ordering::SeqCst);
    }

    /// Makes every flush fail with EIO, leaving the pending writes pending.
    pub fn fail_flushes(&self, fail: bool) {
        self.fail_flushes.store(fail, Ordering::SeqCst);
    }

    /// Makes reads that overlap `range` (bytes) fail with EIO; `None` lifts it. Lets a test
    /// break one area of the device, such as a cache's data, and keep its metadata readable.
    pub fn fail_reads_in(&self, range: Option<Range<u64>>) {
        self.state().fail_reads_in = range;
    }

    /// The image after a power cut now: the durable image, then each write since the last
    /// flush, in order, either applied, skipped, or torn (a random subset of its 4 KiB sectors
    /// applied). The same seed and the same history give the same image. The device itself is
    /// not changed; open the result with [`from_image`](Self::from_image).
    pub fn crash(&self, rng_seed: u64) -> Vec<u8> {
        self.crash_image(rng_seed).to_vec()
    }

    /// Like [`crash`](Self::crash), as a new device holding the result (cheap: unchanged
    /// chunks are shared, not copied).
    pub fn crashed(&self, name: &str, rng_seed: u64) -> CrashDevice {
        Self::from_chunks(name, self.crash_image(rng_seed))
    }

    fn crash_image(&self, rng_seed: u64) -> Image {
        let state = self.state();
        let mut rng = SplitMix64(rng_seed);
        let mut image = state.durable.clone();
        for w in &state.pending {
            match rng.next_u64() % 3 {
                0 => w.apply(&mut image, 0..w.len()),
                1 => {}
                _ => {
                    for part in w.sectors() {
                        if rng.next_u64() & 1 == 1 {
                            w.apply(&mut image, part);
                        }
                    }
                }
            }
        }
        image
    }

    /// How many writes a crash could lose now (completed since the last flush).
    pub fn pending_writes(&self) -> usize {
        self.state().pending.len()
    }

    /// A copy of what is certain to survive a crash.
    pub fn durable_image(&self) -> Vec<u8> {
        self.state().durable.to_vec()
    }

    /// A copy of what reads see.
    pub fn written_image(&self) -> Vec<u8> {
        self.state().written.to_vec()
    }

    /// Successful flushes so far.
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::SeqCst)
    }

    /// Successful `write_at` and `write_zeroes` calls so far.
    pub fn write_count(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// The state, even when another thread panicked while holding the lock: every change to
    /// it is made after all checks, by steps that cannot panic, so it is never left half
    /// changed, and a test that panicked on one thread should not make the others' errors
    /// about a lock instead of about what they test.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `offset..offset + len` as indices into the images, or InvalidInput when it does not
    /// fit the device (callers' offsets are untrusted, so this must not panic or wrap).
    fn range(&self, offset: u64, len: u64) -> io::Result<Range<usize>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(offset as usize..end as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: {len} bytes at {offset} do not fit in {} bytes",
                    self.name, self.size
                ),
            )),
        }
    }

    /// Records a write that passed every check: reads see it now, a crash may lose it.
    fn push_write(&self, offset: u64, payload: Payload) {
        let mut state = self.state();
        let w = PendingWrite { offset, payload };
        if w.len() > 0 {
            let len = w.len();
            w.apply(&mut state.written, 0..len);
            state.pending.push(w);
        }
        self.writes.fetch_add(1, Ordering::SeqCst);
    }
}

impl BlockDevice for CrashDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(eio());
        }
        let r = self.range(offset, buf.len() as u64)?;
        let state = self.state();
        if let Some(bad) = &state.fail_reads_in {
            let end = offset + buf.len() as u64;
            if offset < bad.end && bad.start < end {
                return Err(eio());
            }
        }
        state.written.read(r.start, buf);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.fail_writes.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.range(offset, buf.len() as u64)?;
        self.push_write(offset, Payload::Bytes(buf.to_vec()));
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if self.fail_flushes.load(Ordering::SeqCst) {
            return Err(eio());
        }
        let mut state = self.state();
        let State {
            durable, pending, ..
        } = &mut *state;
        for w in pending.drain(..) {
            w.apply(durable, 0..w.len());
        }
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Checks the range and does nothing else: `Ok(false)` says the device cannot discard,
    /// which callers must accept anyway, and leaves the data for tests to see.
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.range(offset, len)?;
        Ok(false)
    }

    /// An ordinary write of zeroes, pending until a flush like any other.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.fail_writes.load(Ordering::SeqCst) {
            return Err(eio());
        }
        let r = self.range(offset, len)?;
        self.push_write(offset, Payload::Zeroes(r.len()));
        Ok(())
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const SECTOR: usize = ALIGN;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn is_send_and_sync() {
        assert_send_sync::<CrashDevice>();
    }

    #[test]
    fn reads_see_writes_but_only_flush_makes_them_durable() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[7; SECTOR], 4096)?;
        let mut buf = [0u8; SECTOR];
        dev.read_at(&mut buf, 4096)?;
        assert_eq!(buf, [7; SECTOR]);
        assert_eq!(dev.pending_writes(), 1);
        assert_eq!(dev.write_count(), 1);
        assert!(dev.durable_image().iter().all(|&b| b == 0));
        assert_eq!(dev.written_image()[4096..8192], [7; SECTOR]);

        dev.flush()?;
        assert_eq!(dev.pending_writes(), 0);
        assert_eq!(dev.flush_count(), 1);
        assert_eq!(dev.durable_image(), dev.written_image());
        Ok(())
    }

    #[test]
    fn unflushed_writes_can_be_lost_or_kept() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        let (mut lost, mut kept) = (false, false);
        for seed in 0..64 {
            let image = dev.crash(seed);
            lost |= image[..SECTOR].iter().all(|&b| b == 0);
            kept |= image[..SECTOR].iter().all(|&b| b == 1);
        }
        assert!(lost && kept, "lost {lost} kept {kept}");
        Ok(())
    }

    #[test]
    fn flushed_writes_survive_every_seed() -> io::Result<()> {
        let dev = CrashDevice::new("crash", 2 * MIB);
        dev.write_at(&[3; 8 * SECTOR], 0)?;
        dev.write_zeroes(MIB, 4 * SECTOR as u64)?;
        dev.flush()?;
        // Unflushed writes over and around the flushed ones must not matter to them except
        // where they overlap.
        dev.write_at(&[4; 8 * SECTOR], 16 * SECTOR as u64)?;
        dev.write_at(&[5; SECTOR], 0)?;
        for seed in 0..256 {
            let image = dev.crash(seed);
            assert!(
                image[SECTOR..8 * SECTOR].iter().all(|&b| b == 3),
                "seed {seed}"
            );
            assert!(
                image[..SECTOR].iter().all(|&b| b == 3) || image[..SECTOR].iter().all(|&b| b == 5),
                "seed {seed}"
            );
            assert!(image[MIB as usize..][..4 * SECTOR].iter().all(|&b| b == 0));
        }
        Ok(())
    }

    #[test]
    fn torn_writes_keep_whole_sectors_of_old_or_new_data() -> io::Result<()> {
        let dev = CrashDevice::from_image("crash", vec![0x55; MIB as usize]);
        let sectors = 16;
        dev.write_at(&vec![0xaa; sectors * SECTOR], 8 * SECTOR as u64)?;
        let mut torn = false;
        for seed in 0..256 {
            let image = dev.crash(seed);
            let area = &image[8 * SECTOR..][..sectors * SECTOR];
            let mut new = 0;
            for s in area.chunks(SECTOR) {
                let whole = s.iter().all(|&b| b == s[0]);
                assert!(whole && (s[0] == 0x55 || s[0] == 0xaa), "seed {seed}");
                new += usize::from(s[0] == 0xaa);
            }
            torn |= new > 0 && new < sectors;
            // Nothing outside the write changes.
            assert!(image[..8 * SECTOR].iter().all(|&b| b == 0x55));
            assert!(image[(8 + sectors) * SECTOR..].iter().all(|&b| b == 0x55));
        }
        assert!(torn, "no seed tore the write");
        Ok(())
    }

    #[test]
    fn unaligned_writes_tear_at_absolute_sector_boundaries() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        // 100 bytes before a boundary, one whole sector, 100 bytes after.
        let start = SECTOR - 100;
        let len = 100 + SECTOR + 100;
        dev.write_at(&vec![9; len], start as u64)?;
        for seed in 0..128 {
            let image = dev.crash(seed);
            for part in [
                start..SECTOR,
                SECTOR..2 * SECTOR,
                2 * SECTOR..2 * SECTOR + 100,
            ] {
                let s = &image[part];
                assert!(s.iter().all(|&b| b == s[0]), "seed {seed}");
            }
        }
        Ok(())
    }

    #[test]
    fn later_pending_writes_win_when_kept() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        dev.write_at(&[2; SECTOR], 0)?;
        let mut seen = [false; 3];
        for seed in 0..128 {
            let v = dev.crash(seed)[0];
            assert!(v <= 2);
            seen[v as usize] = true;
        }
        assert_eq!(seen, [true; 3]);
        Ok(())
    }

    #[test]
    fn the_same_seed_gives_the_same_image() -> io::Result<()> {
        let dev = CrashDevice::new("crash", 4 * MIB);
        for i in 0..32u64 {
            dev.write_at(&vec![i as u8 + 1; 4 * SECTOR], i * 3 * SECTOR as u64)?;
        }
        let images: Vec<Vec<u8>> = (0..8).map(|seed| dev.crash(seed)).collect();
        for (seed, image) in images.iter().enumerate() {
            assert!(dev.crash(seed as u64) == *image, "seed {seed}");
        }
        assert!(images.iter().any(|i| *i != images[0]));
        // Crashing changes nothing on the device.
        assert_eq!(dev.pending_writes(), 32);
        assert!(dev.durable_image().iter().all(|&b| b == 0));
        Ok(())
    }

    #[test]
    fn from_image_reopens_a_crash() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[8; SECTOR], 0)?;
        let image = dev.crash(1);
        let again = CrashDevice::from_image("again", image.clone());
        assert_eq!(again.size(), MIB);
        assert_eq!(again.durable_image(), image);
        assert_eq!(again.written_image(), image);
        assert_eq!(again.pending_writes(), 0);
        assert_eq!(again.describe(), "again");
        Ok(())
    }

    #[test]
    fn write_zeroes_is_a_pending_write_and_discard_a_no_op() -> io::Result<()> {
        let dev = CrashDevice::from_image("crash", vec![6; MIB as usize]);
        dev.write_zeroes(0, 2 * SECTOR as u64)?;
        assert_eq!(dev.pending_writes(), 1);
        assert!(dev.written_image()[..2 * SECTOR].iter().all(|&b| b == 0));
        assert!(dev.durable_image().iter().all(|&b| b == 6));
        assert!(!dev.discard(0, MIB)?);
        assert_eq!(dev.pending_writes(), 1);
        assert!(dev.written_image()[2 * SECTOR..].iter().all(|&b| b == 6));
        dev.flush()?;
        assert!(dev.durable_image()[..2 * SECTOR].iter().all(|&b| b == 0));
        Ok(())
    }

    #[test]
    fn faults_return_eio_and_change_nothing() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        let (written, durable) = (dev.written_image(), dev.durable_image());

        dev.fail_writes(true);
        let e = dev.write_at(&[2; SECTOR], 0).err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        let e = dev.write_zeroes(0, SECTOR as u64).err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        assert_eq!(dev.written_image(), written);
        assert_eq!((dev.pending_writes(), dev.write_count()), (1, 1));
        dev.fail_writes(false);

        dev.fail_flushes(true);
        let e = dev.flush().err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        assert_eq!(dev.durable_image(), durable);
        assert_eq!((dev.pending_writes(), dev.flush_count()), (1, 0));
        dev.fail_flushes(false);

        dev.fail_reads(true);
        let mut buf = [9u8; SECTOR];
        let e = dev.read_at(&mut buf, 0).err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        assert_eq!(buf, [9; SECTOR]);
        dev.fail_reads(false);
        dev.read_at(&mut buf, 0)?;
        assert_eq!(buf, [1; SECTOR]);

        dev.flush()?;
        assert_eq!(dev.durable_image(), written);
        Ok(())
    }

    #[test]
    fn reads_fail_only_where_they_overlap_the_bad_range() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        let bad = 4 * SECTOR as u64..8 * SECTOR as u64;
        dev.fail_reads_in(Some(bad.clone()));
        let mut buf = [9u8; SECTOR];
        for offset in [0, 3, 8, 9] {
            dev.read_at(&mut buf, offset * SECTOR as u64)?;
        }
        for offset in [bad.start, bad.end - 1, bad.start - 1] {
            let e = dev.read_at(&mut buf, offset).err();
            assert_eq!(
                e.and_then(|e| e.raw_os_error()),
                Some(libc::EIO),
                "{offset}"
            );
        }
        // A read covering the whole range fails too.
        let mut big = vec![0u8; 16 * SECTOR];
        assert!(dev.read_at(&mut big, 0).is_err());
        // Writes there still work.
        dev.write_at(&[1; SECTOR], bad.start)?;
        dev.fail_reads_in(None);
        dev.read_at(&mut buf, bad.start)?;
        assert_eq!(buf, [1; SECTOR]);
        Ok(())
    }

    #[test]
    fn out_of_range_is_invalid_input() {
        let dev = CrashDevice::new("crash", MIB);
        let mut buf = [0u8; SECTOR];
        let kind = |r: io::Result<()>| r.err().map(|e| e.kind());
        let invalid = Some(io::ErrorKind::InvalidInput);
        assert_eq!(kind(dev.read_at(&mut buf, MIB - 1)), invalid);
        assert_eq!(kind(dev.read_at(&mut buf, u64::MAX)), invalid);
        assert_eq!(kind(dev.write_at(&buf, MIB)), invalid);
        assert_eq!(kind(dev.write_at(&buf, u64::MAX - 10)), invalid);
        assert_eq!(kind(dev.write_zeroes(4096, u64::MAX)), invalid);
        assert_eq!(kind(dev.discard(0, MIB + 1).map(|_| ())), invalid);
        assert_eq!(dev.pending_writes(), 0);
        assert_eq!(dev.write_count(), 0);
        // Empty accesses at the very end are fine.
        assert!(dev.read_at(&mut [], MIB).is_ok());
        assert!(dev.write_at(&[], MIB).is_ok());
    }
}
