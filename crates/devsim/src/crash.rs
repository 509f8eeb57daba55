//! A device in RAM with a volatile write cache, for crash tests.
//!
//! A real disk acknowledges a write once it sits in its cache; only a flush promises that the
//! write survives a power cut, and writes not yet flushed may land whole, not at all, or only
//! in part (some of their sectors), in any combination. [`CrashDevice`] keeps what a reader
//! sees apart from what a power cut would leave, so a test can cut the power at any point
//! ([`CrashDevice::crash`]), reopen the resulting image and check that recovery copes with
//! every outcome the hardware allows — reproducibly, from a seed.
//!
//! Devices made by one [`CrashClock`] (a cache and its backing device) share a numbering of
//! their writes, flushes, discards and zeroings. A test names op numbers before it runs; when
//! the clock reaches one, the crash state of every device on the clock is captured at that
//! instant ([`CrashState`]), so a power cut can be taken inside an operation of the code under
//! test (a commit, a compaction, a superblock write), not only between its calls. The clock
//! can also make chosen ops fail, keep a log of every op, call a hook before each device call
//! (a test scheduler's yield point) and label each op with what the test was doing.

use std::collections::BTreeSet;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use ssdcache_device::{BlockDevice, SplitMix64, ALIGN};

/// A memory device whose writes become durable only at [`flush`](BlockDevice::flush), with
/// switches that make reads, writes or flushes fail.
///
/// Reads see every completed write (the "written" image); [`crash`](CrashDevice::crash)
/// returns what a power cut would leave: the "durable" image plus any choice of the writes made
/// since the last flush, each kept, dropped or torn at 4 KiB sector boundaries.
pub struct CrashDevice {
    name: String,
    size: u64,
    /// The state of every device on this device's clock (just this one for a device made
    /// without a clock), under one lock so a capture sees all of them at one instant.
    shared: Arc<Shared>,
    /// This device's index in `shared`.
    index: usize,
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

    /// A zero-filled image, every chunk shared (no copy of `len` bytes is made).
    fn zeroed(len: usize) -> Image {
        let zero = Arc::new(vec![0u8; CHUNK]);
        let mut chunks = vec![zero; len / CHUNK];
        if !len.is_multiple_of(CHUNK) {
            chunks.push(Arc::new(vec![0u8; len % CHUNK]));
        }
        Image { chunks, len }
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

/// One device's images.
struct State {
    /// What reads see: every completed write applied.
    written: Image,
    /// What survives a crash for certain: every write completed before the last flush.
    durable: Image,
    /// Writes completed since the last flush, oldest first; a crash may lose or tear them.
    pending: Vec<PendingWrite>,
    /// Reads overlapping this byte range fail, to break one area (say a cache's data) only.
    fail_reads_in: Option<Range<u64>>,
    /// Successful flushes to let through before one fails (once), if set.
    fail_flush_after: Option<u32>,
    /// False for a device without a volatile cache: every write is durable at once (no copy
    /// of it is kept), which makes rewriting large areas cheap where no crash is taken.
    volatile: bool,
}

impl State {
    /// What survives a crash for certain.
    fn durable(&self) -> &Image {
        if self.volatile {
            &self.durable
        } else {
            &self.written
        }
    }

    fn new(image: Image) -> State {
        State {
            written: image.clone(),
            durable: image,
            pending: Vec::new(),
            fail_reads_in: None,
            fail_flush_after: None,
            volatile: true,
        }
    }
}

/// One unflushed write. Offset and length were checked against the device size when it was
/// accepted, so applying it to an image of that size cannot go out of bounds.
#[derive(Clone)]
struct PendingWrite {
    offset: u64,
    payload: Payload,
}

/// The data of a pending write; zeroes are kept as a length so that zeroing a large range
/// does not hold a second copy of it in memory until the next flush. Shared, so a captured
/// crash state costs no copy of it.
#[derive(Clone)]
enum Payload {
    Bytes(Arc<[u8]>),
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

    /// The bytes `part` (relative to the start of the write) as a write of their own.
    fn part(&self, part: Range<usize>) -> PendingWrite {
        PendingWrite {
            offset: self.offset + part.start as u64,
            payload: match &self.payload {
                Payload::Bytes(b) => Payload::Bytes(b[part].into()),
                Payload::Zeroes(_) => Payload::Zeroes(part.len()),
            },
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

/// Which unflushed writes a materialized crash keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Each write kept, dropped or torn (a random subset of its 4 KiB sectors applied), chosen
    /// by this seed.
    Random(u64),
    /// None: only what was flushed.
    Nothing,
    /// All of them, whole.
    Everything,
}

/// The durable image and the unflushed writes of `state` as a power cut leaves them.
fn materialize(durable: &Image, pending: &[PendingWrite], keep: Keep) -> Image {
    let mut image = durable.clone();
    let mut rng = SplitMix64(match keep {
        Keep::Random(seed) => seed,
        _ => 0,
    });
    for w in pending {
        let choice = match keep {
            Keep::Random(_) => rng.next_u64() % 3,
            Keep::Everything => 0,
            Keep::Nothing => 1,
        };
        match choice {
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

/// A failed write may have landed in part (design.md §4.1: a failed write promises nothing):
/// each of its 4 KiB sectors lands, unflushed, or not, chosen from the op number so a run
/// replays. About half of the failed one-sector writes land whole; none of this is durable
/// before a flush.
fn land_in_part(state: &mut State, w: &PendingWrite, op: u64) {
    let mut rng = SplitMix64(op ^ 0x5eed_fa11_ed00_0000);
    for part in w.sectors() {
        if rng.next_u64() & 1 == 1 {
            let landed = w.part(part);
            let len = landed.len();
            landed.apply(&mut state.written, 0..len);
            if state.volatile {
                state.pending.push(landed);
            }
        }
    }
}

/// What a device call was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Write,
    WriteZeroes,
    Flush,
    Discard,
}

/// One numbered device call, as the clock's log keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpRecord {
    /// The op number (the first op of a clock is 1).
    pub op: u64,
    /// The device's index on its clock (the order the devices were made in).
    pub device: usize,
    pub kind: OpKind,
    /// Bytes; 0 for a flush.
    pub offset: u64,
    pub len: u64,
    /// True when the clock or a fail switch made it fail.
    pub failed: bool,
    /// What the test said it was doing (see [`CrashClock::set_labeler`]).
    pub label: u8,
}

/// What a power cut at one instant leaves of every device on a clock, before the choice of
/// which unflushed writes land: materialize a device with [`CrashState::device`].
pub struct CrashState {
    /// The op after which the power was cut (it took effect: a write is pending, a flush done).
    pub op: u64,
    devices: Vec<(Image, Vec<PendingWrite>)>,
}

impl CrashState {
    /// Device `index` of the clock as the power cut leaves it, `keep` choosing what happens
    /// to its unflushed writes. All of the new device is durable.
    pub fn device(&self, index: usize, name: &str, keep: Keep) -> Option<CrashDevice> {
        let (durable, pending) = self.devices.get(index)?;
        Some(CrashDevice::from_chunks(
            name,
            materialize(durable, pending, keep),
        ))
    }

    /// Like [`device`](Self::device), without a volatile cache: its writes are durable at
    /// once, so it cannot be crashed again, and rewriting large areas of it costs no copies.
    /// For checking what a cut left when no second cut is taken.
    pub fn stable_device(&self, index: usize, name: &str, keep: Keep) -> Option<CrashDevice> {
        let dev = self.device(index, name, keep)?;
        dev.with_state(|s| {
            s.volatile = false;
            // Not kept: what is written is durable (see `State::durable`).
            s.durable = Image {
                chunks: Vec::new(),
                len: s.written.len,
            };
        });
        Some(dev)
    }

    /// Unflushed writes of device `index` at the instant of the cut.
    pub fn pending_writes(&self, index: usize) -> usize {
        self.devices.get(index).map_or(0, |(_, p)| p.len())
    }
}

type Hook = Box<dyn Fn() + Send + Sync>;
type Labeler = Box<dyn Fn() -> u8 + Send + Sync>;

/// What the devices of one clock share.
struct Shared {
    inner: Mutex<Inner>,
    /// Called before every device call, outside any lock.
    before_op: OnceLock<Hook>,
    /// Labels each op in the log.
    labeler: OnceLock<Labeler>,
}

struct Inner {
    devices: Vec<State>,
    /// Ops numbered so far.
    ops: u64,
    /// Op numbers after which to capture a crash state.
    crash_at: BTreeSet<u64>,
    captured: Vec<CrashState>,
    /// Op numbers that fail with EIO (a failed write lands in part, see `land_in_part`).
    fail_at: BTreeSet<u64>,
    /// Every op so far, when logging is on (`None` = off).
    log: Option<Vec<OpRecord>>,
}

impl Shared {
    fn new(devices: Vec<State>) -> Arc<Shared> {
        Arc::new(Shared {
            inner: Mutex::new(Inner {
                devices,
                ops: 0,
                crash_at: BTreeSet::new(),
                captured: Vec::new(),
                fail_at: BTreeSet::new(),
                log: None,
            }),
            before_op: OnceLock::new(),
            labeler: OnceLock::new(),
        })
    }

    /// The state, even when another thread panicked while holding the lock: every change to
    /// it is made after all checks, by steps that cannot panic, so it is never left half
    /// changed, and a test that panicked on one thread should not make the others' errors
    /// about a lock instead of about what they test.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn before_op(&self) {
        if let Some(hook) = self.before_op.get() {
            hook();
        }
    }
}

/// Numbers the writes, flushes, discards and zeroings of the devices it makes, captures the
/// crash state of all of them after chosen ops, and fails chosen ops. Cheap to clone (shared).
#[derive(Clone)]
pub struct CrashClock {
    shared: Arc<Shared>,
}

impl Default for CrashClock {
    fn default() -> Self {
        Self::new()
    }
}

impl CrashClock {
    pub fn new() -> CrashClock {
        CrashClock {
            shared: Shared::new(Vec::new()),
        }
    }

    /// A zero-filled device of `size` bytes on this clock, all of it durable; its index is
    /// the number of devices made before it.
    pub fn device(&self, name: &str, size: u64) -> CrashDevice {
        let mut inner = self.shared.lock();
        inner.devices.push(State::new(Image::zeroed(size as usize)));
        let index = inner.devices.len() - 1;
        drop(inner);
        CrashDevice::on(name, size, self.shared.clone(), index)
    }

    /// Device `index` of `state` as a power cut left it (`keep` choosing what happens to its
    /// unflushed writes), as a new device on this clock: to cut the power again during the
    /// recovery from the first cut.
    pub fn restore(
        &self,
        state: &CrashState,
        index: usize,
        name: &str,
        keep: Keep,
    ) -> Option<CrashDevice> {
        let (durable, pending) = state.devices.get(index)?;
        let image = materialize(durable, pending, keep);
        let size = image.len as u64;
        let mut inner = self.shared.lock();
        inner.devices.push(State::new(image));
        let index = inner.devices.len() - 1;
        drop(inner);
        Some(CrashDevice::on(name, size, self.shared.clone(), index))
    }

    /// Captures the crash state of every device right after each of these ops.
    pub fn crash_at(&self, ops: impl IntoIterator<Item = u64>) {
        self.shared.lock().crash_at.extend(ops);
    }

    /// Makes each of these ops fail with EIO (one-shot: the op number); a failed write lands in
    /// part, see `fail_writes`.
    pub fn fail_at(&self, ops: impl IntoIterator<Item = u64>) {
        self.shared.lock().fail_at.extend(ops);
    }

    /// Ops numbered so far.
    pub fn ops(&self) -> u64 {
        self.shared.lock().ops
    }

    /// The crash states captured so far, in op order, leaving none behind.
    pub fn take_captured(&self) -> Vec<CrashState> {
        std::mem::take(&mut self.shared.lock().captured)
    }

    /// Starts keeping a log of every op (one small record each, until `take_log`).
    pub fn keep_log(&self) {
        let mut inner = self.shared.lock();
        if inner.log.is_none() {
            inner.log = Some(Vec::new());
        }
    }

    /// The ops logged so far, leaving the log empty (and on).
    pub fn take_log(&self) -> Vec<OpRecord> {
        self.shared
            .lock()
            .log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Calls `hook` before every device call (reads too), outside the clock's lock: a test
    /// scheduler's yield point, so another thread can run while an I/O is "in flight". Set once.
    pub fn set_before_op(&self, hook: impl Fn() + Send + Sync + 'static) -> bool {
        self.shared.before_op.set(Box::new(hook)).is_ok()
    }

    /// Labels each logged op with what `labeler` returns then (say, what the calling thread
    /// was doing). Set once.
    pub fn set_labeler(&self, labeler: impl Fn() -> u8 + Send + Sync + 'static) -> bool {
        self.shared.labeler.set(Box::new(labeler)).is_ok()
    }
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

/// What a numbered op does to its device once it is allowed to.
enum Change {
    Write(PendingWrite),
    Flush,
    Nothing,
}

impl CrashDevice {
    /// A zero-filled device of `size` bytes, all of it durable.
    pub fn new(name: &str, size: u64) -> CrashDevice {
        Self::from_chunks(name, Image::zeroed(size as usize))
    }

    /// A device holding `image`, all of it durable: typically the result of
    /// [`crash`](Self::crash), to reopen what a power cut left.
    pub fn from_image(name: &str, image: Vec<u8>) -> CrashDevice {
        Self::from_chunks(name, Image::from_vec(image))
    }

    fn from_chunks(name: &str, image: Image) -> CrashDevice {
        let size = image.len as u64;
        Self::on(name, size, Shared::new(vec![State::new(image)]), 0)
    }

    fn on(name: &str, size: u64, shared: Arc<Shared>, index: usize) -> CrashDevice {
        CrashDevice {
            name: name.to_owned(),
            size,
            shared,
            index,
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

    /// Makes every write and write_zeroes fail with EIO; each failed write lands in part (a
    /// subset of its 4 KiB sectors, unflushed, chosen from the op number), as a real device's
    /// failed write may.
    pub fn fail_writes(&self, fail: bool) {
        self.fail_writes.store(fail, Ordering::SeqCst);
    }

    /// Makes every flush fail with EIO, leaving the pending writes pending.
    pub fn fail_flushes(&self, fail: bool) {
        self.fail_flushes.store(fail, Ordering::SeqCst);
    }

    /// Lets `successes` more flushes through, then fails the next one (once) with EIO,
    /// leaving the pending writes pending: a flush failing in the middle of a sequence.
    pub fn fail_flush_after(&self, successes: u32) {
        self.with_state(|s| s.fail_flush_after = Some(successes));
    }

    /// Makes reads that overlap `range` (bytes) fail with EIO; `None` lifts it. Lets a test
    /// break one area of the device, such as a cache's data, and keep its metadata readable.
    pub fn fail_reads_in(&self, range: Option<Range<u64>>) {
        self.with_state(|s| s.fail_reads_in = range);
    }

    /// The image after a power cut now: the durable image, then each write since the last
    /// flush, in order, either applied, skipped, or torn (a random subset of its 4 KiB sectors
    /// applied). The same seed and the same history give the same image. The device itself is
    /// not changed; open the result with [`from_image`](Self::from_image).
    pub fn crash(&self, rng_seed: u64) -> Vec<u8> {
        self.crash_image(Keep::Random(rng_seed)).to_vec()
    }

    /// Like [`crash`](Self::crash), as a new device holding the result (cheap: unchanged
    /// chunks are shared, not copied).
    pub fn crashed(&self, name: &str, rng_seed: u64) -> CrashDevice {
        self.crashed_keeping(name, Keep::Random(rng_seed))
    }

    /// Like [`crashed`](Self::crashed), with the unflushed writes kept as `keep` says.
    pub fn crashed_keeping(&self, name: &str, keep: Keep) -> CrashDevice {
        Self::from_chunks(name, self.crash_image(keep))
    }

    fn crash_image(&self, keep: Keep) -> Image {
        self.with_state(|s| materialize(s.durable(), &s.pending, keep))
    }

    /// How many writes a crash could lose now (completed since the last flush).
    pub fn pending_writes(&self) -> usize {
        self.with_state(|s| s.pending.len())
    }

    /// A copy of what is certain to survive a crash.
    pub fn durable_image(&self) -> Vec<u8> {
        self.with_state(|s| s.durable().to_vec())
    }

    /// A copy of what reads see.
    pub fn written_image(&self) -> Vec<u8> {
        self.with_state(|s| s.written.to_vec())
    }

    /// Successful flushes so far.
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::SeqCst)
    }

    /// Successful `write_at` and `write_zeroes` calls so far.
    pub fn write_count(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.shared.lock().devices[self.index])
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

    /// Numbers an op that passed its checks and, unless the clock or a switch fails it,
    /// applies `change`; logs it and captures the crash states the clock asks for after it.
    /// All under the clock's lock: no other device of the clock changes meanwhile.
    fn numbered(&self, kind: OpKind, offset: u64, len: u64, change: Change) -> io::Result<()> {
        let label = self.shared.labeler.get().map_or(0, |l| l());
        let mut guard = self.shared.lock();
        let inner = &mut *guard;
        inner.ops += 1;
        let op = inner.ops;
        let state = &mut inner.devices[self.index];
        let switched_off = match change {
            Change::Write(_) => self.fail_writes.load(Ordering::SeqCst),
            Change::Flush => {
                let countdown = match state.fail_flush_after {
                    Some(0) => {
                        state.fail_flush_after = None;
                        true
                    }
                    Some(n) => {
                        state.fail_flush_after = Some(n - 1);
                        false
                    }
                    None => false,
                };
                countdown || self.fail_flushes.load(Ordering::SeqCst)
            }
            Change::Nothing => false,
        };
        let failed = inner.fail_at.remove(&op) || switched_off;
        if failed {
            if let Change::Write(w) = change {
                land_in_part(state, &w, op);
            }
        } else {
            match change {
                Change::Write(w) => {
                    if w.len() > 0 {
                        let len = w.len();
                        w.apply(&mut state.written, 0..len);
                        if state.volatile {
                            state.pending.push(w);
                        }
                    }
                    self.writes.fetch_add(1, Ordering::SeqCst);
                }
                Change::Flush => {
                    let State {
                        durable, pending, ..
                    } = state;
                    for w in pending.drain(..) {
                        w.apply(durable, 0..w.len());
                    }
                    self.flushes.fetch_add(1, Ordering::SeqCst);
                }
                Change::Nothing => {}
            }
        }
        if let Some(log) = &mut inner.log {
            log.push(OpRecord {
                op,
                device: self.index,
                kind,
                offset,
                len,
                failed,
                label,
            });
        }
        if inner.crash_at.remove(&op) {
            let devices = inner
                .devices
                .iter()
                .map(|d| (d.durable().clone(), d.pending.clone()))
                .collect();
            inner.captured.push(CrashState { op, devices });
        }
        if failed {
            Err(eio())
        } else {
            Ok(())
        }
    }
}

impl BlockDevice for CrashDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.shared.before_op();
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(eio());
        }
        let r = self.range(offset, buf.len() as u64)?;
        self.with_state(|state| {
            if let Some(bad) = &state.fail_reads_in {
                let end = offset + buf.len() as u64;
                if offset < bad.end && bad.start < end {
                    return Err(eio());
                }
            }
            state.written.read(r.start, buf);
            Ok(())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.shared.before_op();
        self.range(offset, buf.len() as u64)?;
        let w = PendingWrite {
            offset,
            payload: Payload::Bytes(buf.into()),
        };
        self.numbered(OpKind::Write, offset, buf.len() as u64, Change::Write(w))
    }

    fn flush(&self) -> io::Result<()> {
        self.shared.before_op();
        self.numbered(OpKind::Flush, 0, 0, Change::Flush)
    }

    /// Checks the range and does nothing else: `Ok(false)` says the device cannot discard,
    /// which callers must accept anyway, and leaves the data for tests to see.
    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.shared.before_op();
        self.range(offset, len)?;
        self.numbered(OpKind::Discard, offset, len, Change::Nothing)?;
        Ok(false)
    }

    /// An ordinary write of zeroes, pending until a flush like any other.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.shared.before_op();
        let r = self.range(offset, len)?;
        let w = PendingWrite {
            offset,
            payload: Payload::Zeroes(r.len()),
        };
        self.numbered(OpKind::WriteZeroes, offset, len, Change::Write(w))
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
    fn faults_return_eio_and_failed_writes_land_in_part() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        dev.flush()?;
        let durable = dev.durable_image();

        dev.fail_writes(true);
        let e = dev.write_at(&[2; 16 * SECTOR], 0).err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        let e = dev.write_zeroes(0, SECTOR as u64).err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        assert_eq!(dev.write_count(), 1, "failed writes are not counted");
        // Each sector of the failed writes landed or not (unflushed), never anything else.
        let written = dev.written_image();
        let sectors: Vec<&[u8]> = written[..16 * SECTOR].chunks(SECTOR).collect();
        assert!(sectors
            .iter()
            .all(|s| [1u8, 2, 0].iter().any(|&v| s.iter().all(|&b| b == v))));
        assert!(
            sectors[1..].iter().any(|s| s[0] == 2) && sectors[1..].iter().any(|s| s[0] == 0),
            "some sectors of a 16-sector failed write land, some do not"
        );
        assert_eq!(
            dev.durable_image(),
            durable,
            "nothing durable before a flush"
        );
        dev.fail_writes(false);
        dev.flush()?;
        let pending = dev.pending_writes();
        dev.write_at(&[1; SECTOR], 0)?;

        let (durable, flushes) = (dev.durable_image(), dev.flush_count());
        dev.fail_flushes(true);
        let e = dev.flush().err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        assert_eq!(dev.durable_image(), durable);
        assert_eq!(
            (dev.pending_writes(), dev.flush_count()),
            (pending + 1, flushes)
        );
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
        assert_eq!(dev.durable_image(), dev.written_image());
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

    #[test]
    fn a_clock_numbers_ops_across_its_devices_and_captures_both_at_one_instant() -> io::Result<()> {
        let clock = CrashClock::new();
        let a = clock.device("a", MIB);
        let b = clock.device("b", MIB);
        clock.keep_log();
        // Ops: 1 a.write, 2 b.write, 3 a.flush, 4 b.write_zeroes, 5 b.discard.
        clock.crash_at([2, 3, 5]);
        a.write_at(&[1; SECTOR], 0)?;
        b.write_at(&[2; SECTOR], 0)?;
        a.flush()?;
        b.write_zeroes(0, SECTOR as u64)?;
        assert!(!b.discard(0, SECTOR as u64)?);
        let mut buf = [9u8; SECTOR];
        b.read_at(&mut buf, 0)?; // reads are not numbered
        assert_eq!(clock.ops(), 5);
        let log = clock.take_log();
        let kinds: Vec<(u64, usize, OpKind)> =
            log.iter().map(|r| (r.op, r.device, r.kind)).collect();
        assert_eq!(
            kinds,
            [
                (1, 0, OpKind::Write),
                (2, 1, OpKind::Write),
                (3, 0, OpKind::Flush),
                (4, 1, OpKind::WriteZeroes),
                (5, 1, OpKind::Discard)
            ]
        );
        let captured = clock.take_captured();
        assert_eq!(captured.iter().map(|c| c.op).collect::<Vec<_>>(), [2, 3, 5]);
        let at2 = &captured[0];
        assert_eq!((at2.pending_writes(0), at2.pending_writes(1)), (1, 1));
        let first = |c: &CrashState, i: usize, keep: Keep| -> io::Result<u8> {
            let dev = c.device(i, "x", keep).expect("device");
            let mut buf = [0u8; 1];
            dev.read_at(&mut buf, 0)?;
            Ok(buf[0])
        };
        // At op 2 nothing is durable: a's write may be lost, b's too.
        assert_eq!(first(at2, 0, Keep::Nothing)?, 0);
        assert_eq!(first(at2, 0, Keep::Everything)?, 1);
        assert_eq!(first(at2, 1, Keep::Everything)?, 2);
        // After a's flush (op 3) a's write is durable whatever is kept; b's is not.
        assert_eq!(first(&captured[1], 0, Keep::Nothing)?, 1);
        assert_eq!(first(&captured[1], 1, Keep::Nothing)?, 0);
        // At op 5 b has two pending writes; keeping both ends in zeroes.
        assert_eq!(captured[2].pending_writes(1), 2);
        assert_eq!(first(&captured[2], 1, Keep::Everything)?, 0);
        assert!(captured[0].device(2, "none", Keep::Nothing).is_none());
        Ok(())
    }

    #[test]
    fn a_clock_fails_the_ops_it_is_told_to_and_labels_the_log() -> io::Result<()> {
        let clock = CrashClock::new();
        let dev = clock.device("d", MIB);
        clock.keep_log();
        let label = Arc::new(AtomicU64::new(7));
        let l = label.clone();
        assert!(clock.set_labeler(move || l.load(Ordering::SeqCst) as u8));
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        assert!(clock.set_before_op(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        clock.fail_at([2, 3]);
        dev.write_at(&[1; SECTOR], 0)?;
        label.store(9, Ordering::SeqCst);
        let e = dev.write_at(&[2; SECTOR], 0).err();
        assert_eq!(e.and_then(|e| e.raw_os_error()), Some(libc::EIO));
        assert!(dev.flush().is_err());
        dev.flush()?;
        let mut buf = [0u8; SECTOR];
        dev.read_at(&mut buf, 0)?;
        assert_eq!(buf, [1; SECTOR], "the failed write changed nothing");
        assert_eq!(calls.load(Ordering::SeqCst), 5, "4 ops and a read");
        let log = clock.take_log();
        let seen: Vec<(bool, u8)> = log.iter().map(|r| (r.failed, r.label)).collect();
        assert_eq!(seen, [(false, 7), (true, 9), (true, 9), (false, 9)]);
        assert_eq!((dev.write_count(), dev.flush_count()), (1, 1));
        Ok(())
    }

    #[test]
    fn fail_flush_after_fails_exactly_one_later_flush() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        dev.fail_flush_after(1);
        dev.flush()?;
        dev.write_at(&[2; SECTOR], 0)?;
        assert!(dev.flush().is_err());
        assert_eq!(dev.pending_writes(), 1);
        dev.flush()?;
        assert_eq!((dev.pending_writes(), dev.flush_count()), (0, 2));
        Ok(())
    }

    #[test]
    fn crashed_keeping_nothing_or_everything() -> io::Result<()> {
        let dev = CrashDevice::new("crash", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        dev.flush()?;
        dev.write_at(&[2; SECTOR], 0)?;
        dev.write_zeroes(SECTOR as u64, SECTOR as u64)?;
        assert_eq!(
            dev.crashed_keeping("n", Keep::Nothing).written_image(),
            dev.durable_image()
        );
        assert_eq!(
            dev.crashed_keeping("e", Keep::Everything).written_image(),
            dev.written_image()
        );
        Ok(())
    }

    #[test]
    fn a_stable_device_keeps_every_write() -> io::Result<()> {
        let clock = CrashClock::new();
        let dev = clock.device("d", MIB);
        dev.write_at(&[1; SECTOR], 0)?;
        clock.crash_at([2]);
        dev.write_at(&[2; SECTOR], SECTOR as u64)?;
        let state = clock.take_captured().pop().expect("captured");
        let stable = state.stable_device(0, "s", Keep::Nothing).expect("device");
        assert!(
            stable.written_image().iter().all(|&b| b == 0),
            "nothing kept"
        );
        stable.write_at(&[3; SECTOR], 0)?;
        assert_eq!(stable.pending_writes(), 0);
        assert_eq!(stable.durable_image(), stable.written_image());
        assert_eq!(stable.crash(7)[..SECTOR], [3; SECTOR]);
        Ok(())
    }
}
