//! Records a live workload as an ssdcache trace (`ssdcache serve --record-trace`), so a user can
//! feed their own requests to `simulate`, `mrc` and `advise`.
//!
//! The format (docs/design.md, "Trace file format"):
//!
//! ```text
//! # ssdcache-trace v1
//! # sample_rate=0.01 sample_region=1048576
//! # started=2025-01-31T12:00:00Z host=nas max_size=1073741824
//! # time_us,volume,op,offset,length
//! 0,sdb,R,0,4096
//! 12,sdb,W,1048576,65536
//! # end records=2 dropped=0 reason=shutdown
//! ```
//!
//! The hot path ([`VolumeRecorder::record`]) never touches the file: a sampled request is
//! formatted into an in-memory chunk under a short lock; full chunks go to a writer thread
//! through a bounded queue. When the queue is full (the disk holding the trace is slower than
//! the clients) the chunk is dropped and counted, so a client request never waits for the
//! trace. Every write(2) of the file holds whole lines, so after a `kill -9` the file is valid
//! up to its last newline; only a crash in the middle of a write can leave a final line
//! without its newline, which readers ignore.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::Op;

/// The first line of every ssdcache trace.
pub const MAGIC_LINE: &str = "# ssdcache-trace v1";
/// The column line that ends the header.
pub const COLUMNS_LINE: &str = "# time_us,volume,op,offset,length";
/// Smallest `max_bytes` accepted: the header, the closing comment and some records.
pub const MIN_MAX_BYTES: u64 = 4096;
/// Room kept free below `max_bytes` for the closing comment line.
const TRAILER_RESERVE: u64 = 160;

/// How to record. `Default` records everything, up to 1 GiB.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    /// Fraction of `sample_region`-byte regions recorded, 0 < rate <= 1.
    pub sample_rate: f64,
    /// Bytes per sampling region; a region is always or never recorded.
    pub sample_region: u64,
    /// The file never grows beyond this many bytes; recording stops when it would.
    pub max_bytes: u64,
    /// Replace an existing file instead of refusing it.
    pub overwrite: bool,
    /// An in-memory chunk of lines goes to the writer when it reaches this many bytes.
    pub chunk_bytes: usize,
    /// Chunks waiting for the writer; beyond this, chunks are dropped (and counted).
    pub queue_chunks: usize,
    /// A partly filled chunk is written after at most this long, so the file keeps up with
    /// a slow workload (and a `kill -9` loses at most this much).
    pub flush_interval: Duration,
}

impl Default for RecordConfig {
    fn default() -> Self {
        RecordConfig {
            sample_rate: 1.0,
            sample_region: 1 << 20,
            max_bytes: 1 << 30,
            overwrite: false,
            chunk_bytes: 64 << 10,
            queue_chunks: 64,
            flush_interval: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("trace file {0} already exists; choose another name or remove it")]
    Exists(PathBuf),
    #[error("cannot create trace file {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot write trace file {path}: {source}")]
    Write { path: String, source: io::Error },
    #[error("invalid recording setting: {0}")]
    Config(String),
    #[error("the trace writer thread could not be started: {0}")]
    Thread(io::Error),
}

/// Where recording stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecordState {
    Recording,
    /// Stopped because the next record would have passed `max_bytes`.
    SizeLimit,
    /// Stopped because the file could not be written.
    WriteError,
    /// Closed (shutdown): the file is complete.
    Finished,
}

impl RecordState {
    fn from_u8(v: u8) -> RecordState {
        match v {
            0 => RecordState::Recording,
            1 => RecordState::SizeLimit,
            2 => RecordState::WriteError,
            _ => RecordState::Finished,
        }
    }

    /// The word the closing comment uses for why recording ended.
    fn reason(self) -> &'static str {
        match self {
            RecordState::Recording | RecordState::Finished => "shutdown",
            RecordState::SizeLimit => "size-limit",
            RecordState::WriteError => "write-error",
        }
    }
}

impl std::fmt::Display for RecordState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RecordState::Recording => "recording",
            RecordState::SizeLimit => "stopped at the size limit",
            RecordState::WriteError => "stopped after a write error",
            RecordState::Finished => "finished",
        })
    }
}

/// A snapshot of a recorder's counters, for `stats`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordStatus {
    pub path: String,
    pub state: RecordState,
    /// Records on disk (handed to write(2) successfully).
    pub records_written: u64,
    /// Records sampled but lost because the writer fell behind or failed.
    pub records_dropped: u64,
    /// Bytes of the file, header included.
    pub bytes_written: u64,
    pub sample_rate: f64,
    pub sample_region: u64,
    pub max_bytes: u64,
    /// The write error that stopped recording, if one did.
    pub error: Option<String>,
}

/// Decides which regions are recorded: a hash of (volume, offset / region) against the rate,
/// so every request to a region is recorded or none is (spatial sampling, as in SHARDS).
#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    region: u64,
    /// A region is sampled when its 64-bit hash is below this (2^64 for rate 1).
    threshold: u128,
}

impl Sampler {
    pub fn new(rate: f64, region: u64) -> Result<Sampler, RecordError> {
        if !(rate > 0.0 && rate <= 1.0) {
            return Err(RecordError::Config(format!(
                "sample rate {rate} is not in (0, 1]"
            )));
        }
        if region == 0 {
            return Err(RecordError::Config("sample region must not be 0".into()));
        }
        let threshold = (rate * 2f64.powi(64)) as u128;
        if threshold == 0 {
            return Err(RecordError::Config(format!(
                "sample rate {rate} is too small to sample anything"
            )));
        }
        Ok(Sampler { region, threshold })
    }

    /// Whether a request starting at `offset` of the volume whose [`volume_hash`] is given is
    /// recorded.
    pub fn sampled(&self, volume_hash: u64, offset: u64) -> bool {
        u128::from(region_hash(volume_hash, offset / self.region)) < self.threshold
    }
}

/// FNV-1a of the volume name: the volume's part of the sampling hash.
pub fn volume_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn region_hash(volume_hash: u64, region: u64) -> u64 {
    mix64(volume_hash ^ mix64(region.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

/// The splitmix64 finalizer: every input bit affects every output bit.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The volume name as it appears in the trace: bytes that would break the comma-separated
/// line (',', '%', '#', whitespace, control and non-ASCII bytes) become `%XX`.
pub fn escape_volume(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_graphic() && !matches!(b, b',' | b'%' | b'#') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    if out.is_empty() {
        out.push_str("%00");
    }
    out
}

/// Whole lines on their way to the file.
struct Chunk {
    bytes: Vec<u8>,
    records: u64,
}

/// What the hot path shares, under one lock. Lines are appended in the order their time is
/// taken, so times never decrease through the file.
struct Pending {
    chunk: Vec<u8>,
    records_in_chunk: u64,
    /// Bytes counted against `max_bytes`: written, queued or in `chunk` (dropped chunks are
    /// taken off again).
    accepted_bytes: u64,
    /// `None` once the recorder is finished: nothing more is queued.
    to_writer: Option<SyncSender<Chunk>>,
    /// Emptied chunks coming back from the writer, to avoid an allocation per chunk.
    spare: Receiver<Vec<u8>>,
    drop_logged: bool,
}

struct Shared {
    label: String,
    sampler: Sampler,
    started: Instant,
    max_bytes: u64,
    chunk_bytes: usize,
    state: AtomicU8,
    pending: Mutex<Pending>,
    records_written: AtomicU64,
    records_dropped: AtomicU64,
    bytes_written: AtomicU64,
    error: Mutex<Option<String>>,
    sample_rate: f64,
}

impl Shared {
    fn state(&self) -> RecordState {
        RecordState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Moves from recording to `to`; false if recording had already stopped.
    fn stop(&self, to: RecordState) -> bool {
        self.state
            .compare_exchange(
                RecordState::Recording as u8,
                to as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // A panic while holding the lock leaves only byte buffers behind: keep recording.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn append(&self, volume: &[u8], op: Op, offset: u64, len: u64) {
        let mut p = self.lock();
        if self.state() != RecordState::Recording || p.to_writer.is_none() {
            return;
        }
        let time_us = self.started.elapsed().as_micros() as u64;
        let start = p.chunk.len();
        push_line(&mut p.chunk, time_us, volume, op, offset, len);
        let line_bytes = (p.chunk.len() - start) as u64;
        if p.accepted_bytes + line_bytes + TRAILER_RESERVE > self.max_bytes {
            p.chunk.truncate(start);
            // Nothing more comes: let the writer have the rest now rather than at a timeout.
            if !p.chunk.is_empty() {
                self.hand_over(&mut p);
            }
            drop(p);
            if self.stop(RecordState::SizeLimit) {
                tracing::warn!(
                    "trace {}: size limit of {} bytes reached; recording stopped, serving goes on",
                    self.label,
                    self.max_bytes
                );
            }
            return;
        }
        p.accepted_bytes += line_bytes;
        p.records_in_chunk += 1;
        if p.chunk.len() >= self.chunk_bytes {
            self.hand_over(&mut p);
        }
    }

    /// Queues the current chunk for the writer without waiting; drops it if the queue is full.
    fn hand_over(&self, p: &mut Pending) {
        let fresh = match p.spare.try_recv() {
            Ok(v) => v,
            Err(_) => Vec::with_capacity(self.chunk_bytes + 128),
        };
        let chunk = Chunk {
            bytes: std::mem::replace(&mut p.chunk, fresh),
            records: std::mem::take(&mut p.records_in_chunk),
        };
        let refused = match &p.to_writer {
            Some(tx) => match tx.try_send(chunk) {
                Ok(()) => return,
                Err(TrySendError::Full(c) | TrySendError::Disconnected(c)) => c,
            },
            None => chunk,
        };
        p.accepted_bytes -= refused.bytes.len() as u64;
        self.records_dropped
            .fetch_add(refused.records, Ordering::Relaxed);
        if !p.drop_logged {
            p.drop_logged = true;
            tracing::warn!(
                "trace {}: the trace writer falls behind; dropping records (counted in stats) \
                 rather than slowing clients",
                self.label
            );
        }
    }

    fn status(&self) -> RecordStatus {
        RecordStatus {
            path: self.label.clone(),
            state: self.state(),
            records_written: self.records_written.load(Ordering::Relaxed),
            records_dropped: self.records_dropped.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            sample_rate: self.sample_rate,
            sample_region: self.sampler.region,
            max_bytes: self.max_bytes,
            error: self.error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }
}

/// Appends `time_us,volume,op,offset,length\n` without the formatting machinery.
fn push_line(buf: &mut Vec<u8>, time_us: u64, volume: &[u8], op: Op, offset: u64, len: u64) {
    push_u64(buf, time_us);
    buf.push(b',');
    buf.extend_from_slice(volume);
    buf.extend_from_slice(match op {
        Op::Read => b",R,",
        Op::Write => b",W,",
    });
    push_u64(buf, offset);
    buf.push(b',');
    push_u64(buf, len);
    buf.push(b'\n');
}

fn push_u64(buf: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// Records sampled requests to a trace file. Cheap to share: hand each volume a
/// [`VolumeRecorder`]. Dropping it finishes the file as [`Recorder::finish`] does.
pub struct Recorder {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// One volume's handle on a [`Recorder`]: what the request path calls.
#[derive(Clone)]
pub struct VolumeRecorder {
    shared: Arc<Shared>,
    escaped_name: Arc<[u8]>,
    hash: u64,
}

impl VolumeRecorder {
    /// Records a request as the client sent it, if its first region is sampled and recording
    /// has not stopped. Never waits for the disk.
    pub fn record(&self, op: Op, offset: u64, len: u64) {
        if !self.shared.sampler.sampled(self.hash, offset) {
            return;
        }
        if self.shared.state() != RecordState::Recording {
            return;
        }
        self.shared.append(&self.escaped_name, op, offset, len);
    }
}

/// A file whose `flush` makes it durable, so the writer can end with one call.
struct DurableFile(File);

impl Write for DurableFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }
}

impl Recorder {
    /// Creates the trace file (refusing an existing one unless `config.overwrite`), writes the
    /// header and starts the writer thread.
    pub fn create(path: &Path, config: RecordConfig) -> Result<Recorder, RecordError> {
        validate(&config)?;
        let mut options = File::options();
        options.write(true);
        if config.overwrite {
            options.create(true).truncate(true);
        } else {
            options.create_new(true);
        }
        let file = options.open(path).map_err(|source| {
            if source.kind() == io::ErrorKind::AlreadyExists {
                RecordError::Exists(path.to_owned())
            } else {
                RecordError::Create {
                    path: path.to_owned(),
                    source,
                }
            }
        })?;
        Recorder::to_writer(
            Box::new(DurableFile(file)),
            path.display().to_string(),
            config,
        )
    }

    /// Records into any writer (`label` names it in messages and in the status). The header
    /// is written before this returns. `flush` is called once, at the end.
    pub fn to_writer(
        mut out: Box<dyn Write + Send>,
        label: String,
        config: RecordConfig,
    ) -> Result<Recorder, RecordError> {
        validate(&config)?;
        let sampler = Sampler::new(config.sample_rate, config.sample_region)?;
        let header = header(&config);
        out.write_all(header.as_bytes())
            .map_err(|source| RecordError::Write {
                path: label.clone(),
                source,
            })?;
        let (to_writer, from_hot_path) = mpsc::sync_channel(config.queue_chunks);
        let (spare_tx, spare_rx) = mpsc::sync_channel(config.queue_chunks + 1);
        let shared = Arc::new(Shared {
            label,
            sampler,
            started: Instant::now(),
            max_bytes: config.max_bytes,
            chunk_bytes: config.chunk_bytes,
            state: AtomicU8::new(RecordState::Recording as u8),
            pending: Mutex::new(Pending {
                chunk: Vec::with_capacity(config.chunk_bytes + 128),
                records_in_chunk: 0,
                accepted_bytes: header.len() as u64,
                to_writer: Some(to_writer),
                spare: spare_rx,
                drop_logged: false,
            }),
            records_written: AtomicU64::new(0),
            records_dropped: AtomicU64::new(0),
            bytes_written: AtomicU64::new(header.len() as u64),
            error: Mutex::new(None),
            sample_rate: config.sample_rate,
        });
        let writer = Writer {
            shared: shared.clone(),
            out,
            incoming: from_hot_path,
            spare: spare_tx,
            flush_interval: config.flush_interval,
        };
        let handle = std::thread::Builder::new()
            .name("trace-writer".into())
            .spawn(move || writer.run())
            .map_err(RecordError::Thread)?;
        Ok(Recorder {
            shared,
            writer: Mutex::new(Some(handle)),
        })
    }

    /// The handle the request path of volume `name` records through.
    pub fn volume(&self, name: &str) -> VolumeRecorder {
        VolumeRecorder {
            shared: self.shared.clone(),
            escaped_name: escape_volume(name).into_bytes().into(),
            hash: volume_hash(name),
        }
    }

    pub fn status(&self) -> RecordStatus {
        self.shared.status()
    }

    /// Stops recording, writes what is buffered and the closing comment, makes the file
    /// durable and waits for the writer. Later calls only report the status.
    pub fn finish(&self) -> RecordStatus {
        let (to_writer, last) = {
            let mut p = self.shared.lock();
            let last = Chunk {
                bytes: std::mem::take(&mut p.chunk),
                records: std::mem::take(&mut p.records_in_chunk),
            };
            (p.to_writer.take(), last)
        };
        if let Some(tx) = to_writer {
            // Waiting for room is fine here: no client request is in flight any more.
            let records = last.records;
            if !last.bytes.is_empty() && tx.send(last).is_err() {
                self.shared
                    .records_dropped
                    .fetch_add(records, Ordering::Relaxed);
            }
        }
        let handle = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            if handle.join().is_err() {
                self.shared.stop(RecordState::WriteError);
                tracing::error!("trace {}: the writer thread panicked", self.shared.label);
            }
        }
        self.shared.status()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.finish();
    }
}

fn validate(config: &RecordConfig) -> Result<(), RecordError> {
    Sampler::new(config.sample_rate, config.sample_region)?;
    if config.max_bytes < MIN_MAX_BYTES {
        return Err(RecordError::Config(format!(
            "maximum trace size {} bytes is below the minimum of {MIN_MAX_BYTES}",
            config.max_bytes
        )));
    }
    if config.chunk_bytes == 0 || config.queue_chunks == 0 {
        return Err(RecordError::Config(
            "chunk size and queue length must not be 0".into(),
        ));
    }
    Ok(())
}

fn header(config: &RecordConfig) -> String {
    let mut h = format!(
        "{MAGIC_LINE}\n# sample_rate={} sample_region={}\n# started={}",
        config.sample_rate,
        config.sample_region,
        rfc3339_utc(SystemTime::now())
    );
    if let Some(host) = hostname() {
        let _ = write!(h, " host={host}");
    }
    let _ = write!(
        h,
        " max_size={} writer=ssdcache-{}\n{COLUMNS_LINE}\n",
        config.max_bytes,
        env!("CARGO_PKG_VERSION")
    );
    h
}

fn hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim();
    (!name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic())).then(|| name.to_owned())
}

/// `2025-01-31T12:00:00Z` (whole seconds, UTC).
fn rfc3339_utc(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Howard Hinnant's days-to-civil: the Gregorian date of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The thread that owns the file.
struct Writer {
    shared: Arc<Shared>,
    out: Box<dyn Write + Send>,
    incoming: Receiver<Chunk>,
    spare: SyncSender<Vec<u8>>,
    flush_interval: Duration,
}

impl Writer {
    fn run(mut self) {
        loop {
            match self.incoming.recv_timeout(self.flush_interval) {
                Ok(chunk) => self.write(chunk),
                Err(RecvTimeoutError::Timeout) => {
                    for chunk in self.take_partial_chunk() {
                        self.write(chunk);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        self.close();
    }

    /// The partly filled chunk of a quiet period, behind whatever was queued meanwhile (taken
    /// under the lock, so the order in the file is the order of the records).
    fn take_partial_chunk(&self) -> Vec<Chunk> {
        let mut p = self.shared.lock();
        let mut out = Vec::new();
        while let Ok(chunk) = self.incoming.try_recv() {
            out.push(chunk);
        }
        if !p.chunk.is_empty() {
            let fresh = p.spare.try_recv().unwrap_or_default();
            out.push(Chunk {
                bytes: std::mem::replace(&mut p.chunk, fresh),
                records: std::mem::take(&mut p.records_in_chunk),
            });
        }
        out
    }

    fn write(&mut self, chunk: Chunk) {
        let Chunk { mut bytes, records } = chunk;
        if self.shared.state() == RecordState::WriteError {
            self.shared
                .records_dropped
                .fetch_add(records, Ordering::Relaxed);
        } else {
            debug_assert!(matches!(bytes.last(), None | Some(b'\n')));
            match self.out.write_all(&bytes) {
                Ok(()) => {
                    self.shared
                        .records_written
                        .fetch_add(records, Ordering::Relaxed);
                    self.shared
                        .bytes_written
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                }
                Err(e) => self.fail(&e, records),
            }
        }
        bytes.clear();
        let _ = self.spare.try_send(bytes);
    }

    fn fail(&self, e: &io::Error, records: u64) {
        self.shared
            .records_dropped
            .fetch_add(records, Ordering::Relaxed);
        *self.shared.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
        self.shared.stop(RecordState::WriteError);
        tracing::warn!(
            "trace {}: cannot write ({e}); recording stopped, serving goes on",
            self.shared.label
        );
    }

    fn close(&mut self) {
        let reason = self.shared.state().reason();
        self.shared.stop(RecordState::Finished);
        if self.shared.state() == RecordState::WriteError {
            return;
        }
        let trailer = format!(
            "# end records={} dropped={} reason={reason}\n",
            self.shared.records_written.load(Ordering::Relaxed),
            self.shared.records_dropped.load(Ordering::Relaxed),
        );
        debug_assert!(trailer.len() as u64 <= TRAILER_RESERVE);
        let result = self
            .out
            .write_all(trailer.as_bytes())
            .and_then(|()| self.out.flush());
        match result {
            Ok(()) => {
                self.shared
                    .bytes_written
                    .fetch_add(trailer.len() as u64, Ordering::Relaxed);
            }
            Err(e) => self.fail(&e, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// An in-memory trace file the test can read while the recorder writes it.
    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl SharedBuf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).expect("the trace is UTF-8")
        }
    }

    fn recorder(config: RecordConfig) -> (Recorder, SharedBuf) {
        let buf = SharedBuf::default();
        let r = Recorder::to_writer(Box::new(buf.clone()), "test".into(), config)
            .expect("recorder starts");
        (r, buf)
    }

    #[derive(Debug, PartialEq)]
    struct Line {
        time_us: u64,
        volume: String,
        op: char,
        offset: u64,
        len: u64,
    }

    /// The data lines, checking every line is whole and the header is as specified.
    fn parse(text: &str) -> Vec<Line> {
        assert!(
            text.starts_with("# ssdcache-trace v1\n"),
            "header: {text:.200}"
        );
        assert!(text.is_empty() || text.ends_with('\n'), "torn last line");
        let mut lines = Vec::new();
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 5, "not a whole record: {l:?}");
            let op = f[2].chars().next().expect("op");
            assert!(f[2] == "R" || f[2] == "W", "op in {l:?}");
            lines.push(Line {
                time_us: f[0].parse().expect("time"),
                volume: f[1].to_owned(),
                op,
                offset: f[3].parse().expect("offset"),
                len: f[4].parse().expect("length"),
            });
        }
        lines
    }

    #[test]
    fn writes_the_specified_header_records_and_trailer() {
        let (r, buf) = recorder(RecordConfig::default());
        let sdb = r.volume("sdb");
        sdb.record(Op::Read, 0, 4096);
        sdb.record(Op::Write, 1 << 20, 65536);
        r.volume("a,b c").record(Op::Read, 8192, 512);
        let status = r.finish();
        let text = buf.text();
        let mut header = text.lines();
        assert_eq!(header.next(), Some(MAGIC_LINE));
        assert_eq!(header.next(), Some("# sample_rate=1 sample_region=1048576"));
        let third = header.next().expect("metadata line");
        assert!(
            third.starts_with("# started=") && third.contains(" max_size=1073741824"),
            "{third}"
        );
        assert_eq!(header.next(), Some(COLUMNS_LINE));
        let lines = parse(&text);
        let shape: Vec<_> = lines
            .iter()
            .map(|l| (l.volume.as_str(), l.op, l.offset, l.len))
            .collect();
        assert_eq!(
            shape,
            [
                ("sdb", 'R', 0, 4096),
                ("sdb", 'W', 1 << 20, 65536),
                ("a%2Cb%20c", 'R', 8192, 512)
            ]
        );
        assert!(text.ends_with("# end records=3 dropped=0 reason=shutdown\n"));
        assert_eq!(status.state, RecordState::Finished);
        assert_eq!(status.records_written, 3);
        assert_eq!(status.records_dropped, 0);
        assert_eq!(status.bytes_written, text.len() as u64);
        // Finishing twice, or recording after finishing, changes nothing.
        sdb.record(Op::Read, 0, 4096);
        assert_eq!(r.finish().records_written, 3);
        assert_eq!(buf.text(), text);
    }

    #[test]
    fn sampling_keeps_whole_regions_at_about_the_rate() {
        const REGION: u64 = 1 << 20;
        const REGIONS: u64 = 20_000;
        let config = RecordConfig {
            sample_rate: 0.1,
            sample_region: REGION,
            ..RecordConfig::default()
        };
        let (r, buf) = recorder(config);
        let (a, b) = (r.volume("a"), r.volume("b"));
        for region in 0..REGIONS {
            for within in [0, 4096, REGION - 4096] {
                a.record(Op::Read, region * REGION + within, 4096);
                b.record(Op::Write, region * REGION + within, 4096);
            }
        }
        r.finish();
        let mut per_region: HashMap<(String, u64), usize> = HashMap::new();
        for l in parse(&buf.text()) {
            *per_region.entry((l.volume, l.offset / REGION)).or_default() += 1;
        }
        assert!(per_region.values().all(|&n| n == 3), "a region was split");
        for volume in ["a", "b"] {
            let kept = per_region.keys().filter(|(v, _)| v == volume).count();
            let rate = kept as f64 / REGIONS as f64;
            // 3 standard deviations of a binomial(20000, 0.1) share is 0.0064.
            assert!((rate - 0.1).abs() < 0.0065, "volume {volume}: rate {rate}");
        }
        let both = (0..REGIONS)
            .filter(|&g| {
                per_region.contains_key(&("a".into(), g))
                    && per_region.contains_key(&("b".into(), g))
            })
            .count() as f64;
        // Independent choices per volume: about 1% of regions are sampled in both.
        assert!((both / REGIONS as f64 - 0.01).abs() < 0.004, "both: {both}");
    }

    #[test]
    fn the_size_bound_holds_and_recording_stops_once() {
        let config = RecordConfig {
            max_bytes: 8192,
            chunk_bytes: 1000,
            ..RecordConfig::default()
        };
        let (r, buf) = recorder(config);
        let v = r.volume("vol0");
        for i in 0..10_000u64 {
            v.record(Op::Write, i * 4096, 4096);
        }
        assert_eq!(r.status().state, RecordState::SizeLimit);
        let status = r.finish();
        let text = buf.text();
        assert!(text.len() <= 8192, "trace of {} bytes", text.len());
        assert!(
            text.len() > 8192 - 200,
            "stopped early at {} bytes",
            text.len()
        );
        let lines = parse(&text);
        assert_eq!(lines.len() as u64, status.records_written);
        assert_eq!(status.records_dropped, 0);
        assert_eq!(status.state, RecordState::SizeLimit);
        assert_eq!(status.bytes_written, text.len() as u64);
        assert!(text.ends_with("reason=size-limit\n"), "{text:.100}");
        // The records kept are the first ones, in order.
        for (i, l) in lines.iter().enumerate() {
            assert_eq!(l.offset, i as u64 * 4096);
        }
    }

    #[test]
    fn concurrent_writers_produce_whole_lines_in_time_order() {
        const THREADS: u64 = 8;
        const PER_THREAD: u64 = 20_000;
        let config = RecordConfig {
            chunk_bytes: 512,
            queue_chunks: 1 << 16,
            ..RecordConfig::default()
        };
        let (r, buf) = recorder(config);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let v = r.volume(&format!("v{t}"));
                s.spawn(move || {
                    for i in 0..PER_THREAD {
                        v.record(Op::Read, i * 4096, 4096 + t);
                    }
                });
            }
        });
        let status = r.finish();
        let lines = parse(&buf.text());
        assert_eq!(
            status.records_written + status.records_dropped,
            THREADS * PER_THREAD
        );
        assert_eq!(lines.len() as u64, status.records_written);
        assert!(lines.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        for l in &lines {
            assert_eq!(format!("v{}", l.len - 4096), l.volume, "{l:?}");
        }
    }

    /// A writer that blocks until the test lets it go, like a disk that stalls.
    struct StalledWriter {
        gate: Receiver<()>,
        out: SharedBuf,
    }

    impl Write for StalledWriter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let _ = self.gate.recv();
            self.out.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stalled_writer_drops_records_instead_of_blocking_clients() {
        let (open_gate, gate) = mpsc::channel();
        // The header goes through the gate too.
        open_gate.send(()).unwrap();
        let out = SharedBuf::default();
        let config = RecordConfig {
            chunk_bytes: 256,
            queue_chunks: 2,
            ..RecordConfig::default()
        };
        let writer = StalledWriter {
            gate,
            out: out.clone(),
        };
        let r = Recorder::to_writer(Box::new(writer), "stalled".into(), config).unwrap();
        let v = r.volume("sdb");
        for i in 0..10_000u64 {
            v.record(Op::Read, i * 4096, 4096);
        }
        let dropped = r.status().records_dropped;
        assert!(dropped > 9_000, "only {dropped} dropped");
        // Let the writer go: everything still queued is written.
        drop(open_gate);
        let status = r.finish();
        let lines = parse(&out.text());
        assert_eq!(status.records_written, lines.len() as u64);
        assert_eq!(status.records_written + status.records_dropped, 10_000);
        assert!(out
            .text()
            .contains(&format!("dropped={}", status.records_dropped)));
    }

    struct FailingWriter {
        writes_left: usize,
    }

    impl Write for FailingWriter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.writes_left == 0 {
                return Err(io::Error::from_raw_os_error(28));
            }
            self.writes_left -= 1;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_write_error_stops_recording_and_is_reported() {
        let config = RecordConfig {
            chunk_bytes: 100,
            ..RecordConfig::default()
        };
        let r = Recorder::to_writer(
            Box::new(FailingWriter { writes_left: 2 }),
            "full-disk".into(),
            config,
        )
        .unwrap();
        let v = r.volume("sdb");
        for i in 0..1000u64 {
            v.record(Op::Write, i * 4096, 4096);
        }
        let status = r.finish();
        assert_eq!(status.state, RecordState::WriteError);
        assert!(
            status.error.as_deref().unwrap_or("").contains("space"),
            "{status:?}"
        );
        assert!(status.records_written > 0 && status.records_written < 1000);
    }

    #[test]
    fn a_quiet_period_writes_the_partial_chunk() {
        let config = RecordConfig {
            flush_interval: Duration::from_millis(20),
            ..RecordConfig::default()
        };
        let (r, buf) = recorder(config);
        r.volume("sdb").record(Op::Read, 0, 4096);
        let mut waited = 0;
        while parse(&buf.text()).is_empty() && waited < 200 {
            std::thread::sleep(Duration::from_millis(10));
            waited += 1;
        }
        assert_eq!(parse(&buf.text()).len(), 1, "not written within 2 s");
        assert_eq!(r.status().records_written, 1);
    }

    #[test]
    fn refuses_an_existing_file_unless_told_to_replace_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.csv");
        std::fs::write(&path, "precious").unwrap();
        let refused = Recorder::create(&path, RecordConfig::default());
        assert!(matches!(refused, Err(RecordError::Exists(_))));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
        let r = Recorder::create(
            &path,
            RecordConfig {
                overwrite: true,
                ..RecordConfig::default()
            },
        )
        .unwrap();
        r.volume("sdb").record(Op::Write, 4096, 8192);
        drop(r);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(parse(&text).len(), 1);
        let missing_dir = Recorder::create(&dir.path().join("no/such"), RecordConfig::default());
        assert!(matches!(missing_dir, Err(RecordError::Create { .. })));
    }

    #[test]
    fn rejects_settings_out_of_range() {
        for rate in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(Sampler::new(rate, 1 << 20).is_err(), "rate {rate}");
        }
        assert!(Sampler::new(0.5, 0).is_err());
        let tiny = RecordConfig {
            max_bytes: 100,
            ..RecordConfig::default()
        };
        assert!(matches!(
            Recorder::to_writer(Box::new(io::sink()), "x".into(), tiny),
            Err(RecordError::Config(_))
        ));
    }

    #[test]
    fn dates_and_names() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(
            rfc3339_utc(UNIX_EPOCH + Duration::from_secs(1_706_745_599)),
            "2024-01-31T23:59:59Z"
        );
        assert_eq!(escape_volume("sdb"), "sdb");
        assert_eq!(escape_volume("a%b#c\n"), "a%25b%23c%0A");
        assert_eq!(escape_volume("é"), "%C3%A9");
    }
}
