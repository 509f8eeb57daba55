//! An NBD export as a [`BlockDevice`]: the backing device of a volume reached over the
//! network (issue 13 item 5).
//!
//! # Connections
//!
//! One connection, or [`RemoteConfig::connections`] of them when the server advertises
//! `NBD_FLAG_CAN_MULTI_CONN` (then a FLUSH on any connection covers writes completed on all,
//! which is what makes spreading requests over several safe). Each connection has a sender,
//! used by the calling threads under a mutex (a request is written whole), and a receiver
//! thread (`nbd-backing-rx`) that hands each reply to the caller waiting for it. Requests are
//! pipelined: up to [`RemoteConfig::queue_depth`] per connection are in flight.
//!
//! # When the connection drops
//!
//! Every connection of the generation is closed and every caller whose request was in flight
//! is told so; a supervisor thread (`nbd-backing-sv`) reconnects with backoff (0.1 s doubling
//! to 5 s, forever), checks that the export is the same one (size, description, block size),
//! re-sends the replay log (`replay.rs`: the writes not yet covered by a successful FLUSH)
//! and only then lets requests through again. Callers re-issue what they had in flight, so
//! they see a delay, not an error, for up to [`RemoteConfig::retry_timeout`] of outage; past
//! that, requests fail at once (the engine counts backing errors, and write-back volumes keep
//! absorbing writes into the cache) until the export is back.
//!
//! One limit NBD itself sets: a request the old connection carried may still be executing on
//! the server when it is re-issued (NBD has no fencing). Re-issuing the same write is
//! harmless; the engine never has two overlapping writes of the backing device in flight.
//!
//! # Bounds
//!
//! Requests in flight: `queue_depth` per connection (callers wait for a slot). Each request
//! at most [`RemoteConfig::max_request`] bytes (larger reads and writes go in pieces). A
//! reply is waited for [`RemoteConfig::io_timeout`]; then the connection is declared dead.
//! Replay log: see `replay.rs`. Threads: one receiver per connection and one supervisor.

use std::io::{self, Write};
use std::net::Shutdown;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno as OsErrno;
use ssdcache_device::{unreached, write_zeroes_by_writing, BlockDevice};
use ssdcache_format::superblock::STABLE_ID_LEN;
use ssdcache_format::{BackingIdentity, BackingKind};
use ssdcache_nbd::client::{
    connect, connect_tls, ClientConfig, ClientError, ExportDetails, ReplyReceiver, Request,
    RequestSender,
};
use ssdcache_nbd::proto::{
    NBD_ESHUTDOWN, NBD_FLAG_CAN_MULTI_CONN, NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_FLUSH,
    NBD_FLAG_SEND_FUA, NBD_FLAG_SEND_TRIM, NBD_FLAG_SEND_WRITE_ZEROES,
};
use ssdcache_nbd::{ClientTls, Command, Errno, NbdStream};
use tracing::{info, warn};

use crate::replay::{Change, ReplayLog};
use crate::stream::Stream;
use crate::uri::{Endpoint, NbdUri};

/// First wait before reconnecting; it doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Largest TRIM or WRITE_ZEROES sent in one request (they carry no payload).
pub const DATALESS_PIECE: u64 = 1 << 30;
/// Re-sent writes in flight at once while replaying (overlapping ones wait for each other).
const REPLAY_BATCH: usize = 64;
/// The engine's alignment: the export's minimum block size must divide it.
const ENGINE_BLOCK: u64 = 4096;

/// Settings of a backing export's connections; every field bounds something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// Connections when the server advertises multi-conn (else 1).
    pub connections: usize,
    /// Requests in flight per connection.
    pub queue_depth: usize,
    /// Largest READ or WRITE sent (the server's maximum lowers it).
    pub max_request: u32,
    /// Bound of connecting and of the handshake.
    pub connect_timeout: Duration,
    /// How long a reply may take before its connection is declared dead and re-established
    /// (a FLUSH: [`RemoteConfig::flush_timeout`]); also each socket write.
    pub io_timeout: Duration,
    /// How long a reply may take while writes are in flight on its connection (which is not
    /// dropped for a late reply then: NBD cannot cancel a write). Past it the device halts:
    /// it drops the connection but never reconnects, so nothing it sent can land after newer
    /// data; the daemon must be restarted.
    pub stuck_limit: Duration,
    /// How long a FLUSH's reply may take (a store may write a lot back for it).
    pub flush_timeout: Duration,
    /// How long requests wait through an outage (reconnecting) before they fail.
    pub retry_timeout: Duration,
    /// Bytes of acknowledged, unflushed writes kept for replay before a flush is forced.
    pub replay_limit: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            connections: 4,
            queue_depth: 64,
            max_request: 4 << 20,
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            flush_timeout: Duration::from_secs(120),
            stuck_limit: Duration::from_secs(600),
            retry_timeout: Duration::from_secs(60),
            replay_limit: 64 << 20,
        }
    }
}

/// Why an export cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("cannot connect to {uri}: {source}")]
    Connect {
        uri: String,
        #[source]
        source: io::Error,
    },
    #[error("{uri}: {source}")]
    Handshake {
        uri: String,
        #[source]
        source: ClientError,
    },
    #[error("{uri}: {why}")]
    Unusable { uri: String, why: String },
}

impl RemoteError {
    /// The error without the URI, for a message that names the export already.
    pub fn reason(&self) -> String {
        match self {
            RemoteError::Connect { source, .. } => format!("cannot connect: {source}"),
            RemoteError::Handshake { source, .. } => source.to_string(),
            RemoteError::Unusable { why, .. } => why.clone(),
        }
    }
}

/// What the device's connections are doing, for `stats` and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteStatus {
    pub connected: bool,
    /// How long the export has been unreachable, while it is.
    pub down_for: Option<Duration>,
    /// Why the last connection ended or the last attempt failed ("" if none did).
    pub last_error: String,
    pub reconnections: u64,
    /// Writes kept for replay (not yet covered by a successful FLUSH) and their bytes.
    pub unflushed_writes: usize,
    pub unflushed_bytes: usize,
}

/// An NBD export used as a block device. Dropping it disconnects.
pub struct NbdDevice {
    shared: Arc<Shared>,
    supervisor: Option<JoinHandle<()>>,
    /// Host-wide locks held while the device is open ([`NbdDevice::lock_on_host`]).
    host_locks: Vec<std::fs::File>,
}

type Tag = Arc<Completion>;

struct Shared {
    uri: NbdUri,
    config: RemoteConfig,
    /// As the first connection found it; every later one must agree.
    export: ExportDetails,
    /// Who the first connection reached (`tcp:IP:PORT`, or the Unix socket's path).
    peer: String,
    /// The TLS session settings of an `nbds://` export, for every connection.
    tls: Option<ClientTls>,
    connections: usize,
    state: Mutex<State>,
    changed: Condvar,
    log: Mutex<ReplayLog>,
    next_link: AtomicUsize,
}

struct State {
    up: bool,
    stopping: bool,
    /// Why the device gave up on its export for good (`RemoteConfig::stuck_limit`).
    halted: Option<String>,
    /// Counts connection sets; a failure reported for an older one is ignored.
    generation: u64,
    links: Vec<Arc<Link>>,
    down_since: Option<Instant>,
    last_error: String,
    reconnections: u64,
}

/// One connection of a generation.
struct Link {
    generation: u64,
    /// `None` once the device is dropped.
    sender: Mutex<Option<RequestSender<Stream, Tag>>>,
    /// Another handle to the socket, to shut it down from any thread.
    socket: Stream,
    /// WRITE, WRITE_ZEROES and TRIM requests sent on it and not answered. While there are any, a
    /// late reply never makes the device drop the connection: the server could still carry
    /// them out after newer writes sent on the next connection (NBD cannot cancel a request).
    writes_in_flight: AtomicUsize,
}

/// Where the receiver leaves a reply for the caller waiting on it.
#[derive(Default)]
struct Completion {
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
}

enum Outcome {
    /// Answered with success (a READ's data).
    Done(Vec<u8>),
    /// Answered with an NBD error value.
    Refused(u32),
    /// The connection ended without an answer: re-issue it.
    Dropped,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its state consistent, so a panic elsewhere does not
    // make it unusable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Completion {
    fn complete(&self, outcome: Outcome) {
        *lock(&self.outcome) = Some(outcome);
        self.ready.notify_all();
    }

    fn wait(&self, timeout: Duration) -> Option<Outcome> {
        let guard = lock(&self.outcome);
        let (mut guard, _) = self
            .ready
            .wait_timeout_while(guard, timeout, |o| o.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        guard.take()
    }
}

type Halves = (
    RequestSender<Stream, Tag>,
    ReplyReceiver<Stream, Tag>,
    Stream,
);

/// Connects and negotiates the export.
fn dial(
    uri: &NbdUri,
    config: &RemoteConfig,
    tls: Option<&ClientTls>,
) -> Result<Halves, RemoteError> {
    let stream = Stream::connect(&uri.endpoint, config.connect_timeout).map_err(|source| {
        RemoteError::Connect {
            uri: uri.to_string(),
            source,
        }
    })?;
    let socket = stream
        .try_clone_stream()
        .map_err(|source| RemoteError::Connect {
            uri: uri.to_string(),
            source,
        })?;
    let client = ClientConfig {
        max_in_flight: config.queue_depth.max(1),
        max_request: config.max_request,
        handshake_timeout: config.connect_timeout,
        io_timeout: Some(config.io_timeout),
    };
    let handshake_failed = |source| RemoteError::Handshake {
        uri: uri.to_string(),
        source,
    };
    let (sender, receiver, plain) = match tls {
        None => {
            let (sender, receiver) =
                connect(stream, &uri.export, &client).map_err(handshake_failed)?;
            (sender, receiver, None)
        }
        Some(tls) => {
            let peer = stream.peer_label();
            let (sender, receiver) =
                connect_tls(stream, &uri.export, &client, tls).map_err(handshake_failed)?;
            let plain = sender
                .try_clone_stream()
                .map_err(|source| RemoteError::Connect {
                    uri: uri.to_string(),
                    source,
                })?;
            let tls_end = |plain| Stream::Tls {
                plain,
                peer: peer.clone(),
            };
            let sender = sender.map_stream(tls_end);
            let receiver = receiver.map_stream(tls_end);
            (sender, receiver, Some(Stream::Unix(plain)))
        }
    };
    // The receiver waits for replies without a socket timeout: a socket timeout runs from
    // when an idle wait began, not from when a request was sent. Each caller times its own
    // reply instead (`Shared::await_reply`) and shuts the socket when it is late.
    // Shutting `socket` (the TCP or Unix socket itself, under TLS too) ends the connection
    // at once; under TLS the pump then closes the plaintext end the halves use.
    plain
        .as_ref()
        .unwrap_or(&socket)
        .set_read_timeout_stream(None)
        .map_err(|source| RemoteError::Connect {
            uri: uri.to_string(),
            source,
        })?;
    Ok((sender, receiver, socket))
}

/// Why the export cannot back a volume, if it cannot.
fn unusable(export: &ExportDetails) -> Option<String> {
    if export.has_flag(NBD_FLAG_READ_ONLY) {
        return Some(
            "the server offers the export read-only; a backing device must be writable".into(),
        );
    }
    if !ENGINE_BLOCK.is_multiple_of(u64::from(export.min_block)) {
        return Some(format!(
            "the export's minimum block size is {} bytes; ssdcache reads and writes in 4096-byte \
             sectors, so it must divide 4096",
            export.min_block
        ));
    }
    if export.max_request < ENGINE_BLOCK as u32 {
        return Some(format!(
            "the export takes requests of at most {} bytes; ssdcache needs 4096",
            export.max_request
        ));
    }
    None
}

/// Why a reconnection found another export than the first connection, if it did.
fn other_export(first: &ExportDetails, now: &ExportDetails) -> Option<String> {
    if first.size != now.size {
        return Some(format!(
            "its size was {} bytes, is now {} bytes",
            first.size, now.size
        ));
    }
    if first.description != now.description {
        return Some(format!(
            "its description was {:?}, is now {:?}",
            first.description, now.description
        ));
    }
    // What the device decided from the first connection (FLUSH or not, FUA, multi-conn,
    // TRIM, WRITE_ZEROES, request sizes, the replay log's pieces) must still hold.
    if first.flags != now.flags {
        return Some(format!(
            "its transmission flags were {:#06x}, are now {:#06x}",
            first.flags, now.flags
        ));
    }
    if (first.min_block, first.max_request) != (now.min_block, now.max_request) {
        return Some(format!(
            "its block sizes were {} to {} bytes, are now {} to {}",
            first.min_block, first.max_request, now.min_block, now.max_request
        ));
    }
    None
}

/// The request pieces of `[offset, offset + len)`, each at most `max` bytes.
fn pieces(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |i| {
        let start = i * max;
        (offset + start, (len - start).min(max))
    })
}

fn nbd_error(uri: &NbdUri, code: u32) -> io::Error {
    let what = Errno::from_code(code).map_or_else(|| format!("error {code}"), |e| e.to_string());
    let kind = match Errno::from_code(code) {
        Some(known) => io::Error::from_raw_os_error(known.code() as i32).kind(),
        None => io::ErrorKind::Other,
    };
    io::Error::new(kind, format!("the NBD server at {uri} answered {what}"))
}

/// A short stable name for the export: its name and the server's description, as
/// `BackingIdentity::stable_id` records it; hashed when longer than the field.
pub fn export_stamp(export_name: &str, description: Option<&str>) -> String {
    let full = match description {
        Some(d) => format!("nbd:{export_name}#{d}"),
        None => format!("nbd:{export_name}"),
    };
    if full.len() <= STABLE_ID_LEN {
        return full;
    }
    format!("nbd-fnv64:{:016x}", fnv64(&full))
}

/// FNV-1a: stable across builds and platforms, which is all a stamp or a lock name needs.
fn fnv64(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl NbdDevice {
    /// Connects to the export at `uri` (as many connections as the server allows, up to
    /// `config.connections`) and starts the supervisor. Fails at once, without retrying,
    /// when the server cannot be reached or refuses: at open an operator is there to read it.
    pub fn open(uri: NbdUri, config: RemoteConfig) -> Result<NbdDevice, RemoteError> {
        let tls = uri
            .tls_settings()
            .map(|settings| {
                ClientTls::from_certificates_dir(&settings.certificates, &settings.server_name)
            })
            .transpose()
            .map_err(|e| RemoteError::Unusable {
                uri: uri.to_string(),
                why: e.to_string(),
            })?;
        let first = dial(&uri, &config, tls.as_ref())?;
        let export = first.0.export().clone();
        let peer = match (&uri.endpoint, &first.2) {
            (Endpoint::Tcp { .. }, socket) => socket.peer_label(),
            (Endpoint::Unix { socket }, _) => std::fs::canonicalize(socket)
                .unwrap_or_else(|_| socket.clone())
                .display()
                .to_string(),
        };
        if let Some(why) = unusable(&export) {
            return Err(RemoteError::Unusable {
                uri: uri.to_string(),
                why,
            });
        }
        let connections = if export.has_flag(NBD_FLAG_CAN_MULTI_CONN) {
            config.connections.max(1)
        } else {
            1
        };
        let shared = Arc::new(Shared {
            log: Mutex::new(ReplayLog::new(config.replay_limit)),
            uri,
            config,
            export,
            peer,
            tls,
            connections,
            state: Mutex::new(State {
                up: false,
                stopping: false,
                halted: None,
                generation: 1,
                links: Vec::new(),
                down_since: None,
                last_error: String::new(),
                reconnections: 0,
            }),
            changed: Condvar::new(),
            next_link: AtomicUsize::new(0),
        });
        let links = shared.start_links(1, first)?;
        {
            let mut state = lock(&shared.state);
            state.links = links;
            state.up = true;
        }
        let for_supervisor = Arc::clone(&shared);
        let supervisor = thread::Builder::new()
            .name("nbd-backing-sv".into())
            .spawn(move || for_supervisor.supervise())
            .map_err(|source| RemoteError::Connect {
                uri: shared.uri.to_string(),
                source,
            })?;
        Ok(NbdDevice {
            shared,
            supervisor: Some(supervisor),
            host_locks: Vec::new(),
        })
    }

    /// Locks the export for this process on this host (`flock` on files in `dir`, named after
    /// its URI and, when the server describes it, its identity), as local backing devices are
    /// locked: a second ssdcache on the host is refused it, since two caches writing back to
    /// one export would overwrite each other's data. Held until the device is dropped.
    /// Another host cannot be seen from here.
    pub fn lock_on_host(&mut self, dir: &Path) -> Result<(), RemoteError> {
        let ident = self.identity();
        // The address as connected (a TCP peer's IP and port: `localhost` and `127.0.0.1`
        // are one server) and as written, canonical (a Unix socket's resolved path).
        let mut keys = vec![
            format!("{}/{}", self.shared.peer, self.shared.uri.export),
            self.shared.uri.address(),
        ];
        if ident.stable_id.contains('#') || ident.stable_id.starts_with("nbd-fnv64:") {
            keys.push(ident.stable_id);
        }
        let fail = |why: String| RemoteError::Unusable {
            uri: self.shared.uri.to_string(),
            why,
        };
        std::fs::create_dir_all(dir).map_err(|e| {
            fail(format!(
                "cannot make the lock folder {}: {e}",
                dir.display()
            ))
        })?;
        for key in keys {
            let path = dir.join(format!("export-{:016x}.lock", fnv64(&key)));
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|e| fail(format!("cannot open the lock {}: {e}", path.display())))?;
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                Err(OsErrno::WOULDBLOCK) => {
                    return Err(fail(format!(
                        "another ssdcache process on this host is using this export (lock {}); \
                         two caches in front of one export would overwrite each other's data",
                        path.display()
                    )))
                }
                Err(e) => return Err(fail(format!("cannot lock {}: {e}", path.display()))),
            }
            // For whoever finds the file: which export it locks.
            let _ = file.set_len(0).and_then(|()| writeln!(file, "{key}"));
            self.host_locks.push(file);
        }
        Ok(())
    }

    /// What the cache records about this export to recognise it at every start.
    pub fn identity(&self) -> BackingIdentity {
        let export = &self.shared.export;
        BackingIdentity {
            kind: BackingKind::Nbd,
            size: export.size,
            path: self.shared.uri.to_string(),
            stable_id: export_stamp(&self.shared.uri.export, export.description.as_deref()),
            st_dev: 0,
            st_ino: 0,
            st_rdev: 0,
            btime_ns: 0,
        }
    }

    /// The export as the first connection found it.
    pub fn export(&self) -> &ExportDetails {
        &self.shared.export
    }

    /// Connections in use when the export is reachable.
    pub fn connections(&self) -> usize {
        self.shared.connections
    }

    pub fn status(&self) -> RemoteStatus {
        let (unflushed_writes, unflushed_bytes) = {
            let log = lock(&self.shared.log);
            (log.len(), log.bytes())
        };
        let state = lock(&self.shared.state);
        RemoteStatus {
            connected: state.up,
            down_for: state.down_since.map(|t| t.elapsed()),
            last_error: state.last_error.clone(),
            reconnections: state.reconnections,
            unflushed_writes,
            unflushed_bytes,
        }
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        let links = {
            let mut state = lock(&self.shared.state);
            state.stopping = true;
            std::mem::take(&mut state.links)
        };
        self.shared.changed.notify_all();
        for link in links {
            if let Some(sender) = lock(&link.sender).take() {
                // Polite: NBD_CMD_DISC lets the server finish and log a clean end.
                let _ = sender.disconnect();
            }
            let _ = link.socket.shutdown_stream(Shutdown::Both);
        }
        // Not joined: it may be inside a connection attempt (bounded by connect_timeout per
        // connection); it sees `stopping` when that ends, closes what it opened and exits.
        drop(self.supervisor.take());
        let log = lock(&self.shared.log);
        if log.len() > 0 {
            warn!(
                uri = %self.shared.uri,
                "closed with {} writes ({} bytes) not covered by a FLUSH",
                log.len(),
                log.bytes()
            );
        }
    }
}

impl Shared {
    /// Starts the receivers of a generation: `first` (already connected) and as many more
    /// as the device uses.
    fn start_links(
        self: &Arc<Self>,
        generation: u64,
        first: Halves,
    ) -> Result<Vec<Arc<Link>>, RemoteError> {
        let mut links = Vec::with_capacity(self.connections);
        let mut next = Some(first);
        while links.len() < self.connections {
            let halves = match next.take() {
                Some(h) => Ok(h),
                None => dial(&self.uri, &self.config, self.tls.as_ref()),
            };
            let started = halves.and_then(|halves| {
                if let Some(why) = other_export(&self.export, halves.0.export()) {
                    let _ = halves.2.shutdown_stream(Shutdown::Both);
                    return Err(RemoteError::Unusable {
                        uri: self.uri.to_string(),
                        why: format!("the server now offers another export: {why}"),
                    });
                }
                self.start_link(generation, halves)
            });
            match started {
                Ok(link) => links.push(link),
                Err(e) => {
                    close(&links);
                    return Err(e);
                }
            }
        }
        Ok(links)
    }

    fn start_link(
        self: &Arc<Self>,
        generation: u64,
        halves: Halves,
    ) -> Result<Arc<Link>, RemoteError> {
        let (sender, receiver, socket) = halves;
        let link = Arc::new(Link {
            generation,
            sender: Mutex::new(Some(sender)),
            socket,
            writes_in_flight: AtomicUsize::new(0),
        });
        let shared = Arc::clone(self);
        thread::Builder::new()
            .name("nbd-backing-rx".into())
            .spawn(move || shared.receive(generation, receiver))
            .map_err(|source| RemoteError::Connect {
                uri: self.uri.to_string(),
                source,
            })?;
        Ok(link)
    }

    /// A connection's receiver: hands each reply to its caller; when the connection ends,
    /// reports it and tells every caller still waiting.
    fn receive(&self, generation: u64, mut receiver: ReplyReceiver<Stream, Tag>) {
        let mut data = Vec::new();
        loop {
            match receiver.recv(&mut data) {
                Ok(reply) => {
                    let outcome = match reply.result {
                        Ok(()) => Outcome::Done(std::mem::take(&mut data)),
                        Err(code) => Outcome::Refused(code),
                    };
                    reply.tag.complete(outcome);
                }
                Err(e) => {
                    self.link_failed(generation, &e.to_string());
                    for tag in receiver.into_unanswered() {
                        tag.complete(Outcome::Dropped);
                    }
                    return;
                }
            }
        }
    }

    /// Takes the device down when a connection of the current generation failed: closes
    /// every connection of it (their receivers then hand back what was in flight) and wakes
    /// the supervisor.
    fn link_failed(&self, generation: u64, why: &str) {
        let mut state = lock(&self.state);
        if !state.up || state.stopping || state.generation != generation {
            return;
        }
        state.up = false;
        state.down_since = Some(Instant::now());
        state.last_error = why.to_owned();
        close(&std::mem::take(&mut state.links));
        drop(state);
        self.changed.notify_all();
        warn!(
            uri = %self.uri,
            "connection to the backing export lost ({why}); reconnecting, requests wait up to {} s",
            self.config.retry_timeout.as_secs()
        );
    }

    /// Gives up on the export for good: the connections are shut and never made again, so no
    /// write sent on them can be sent a second time and land after newer data.
    fn halt(&self, why: &str) {
        let mut state = lock(&self.state);
        state.halted = Some(why.to_owned());
        state.up = false;
        state.down_since.get_or_insert_with(Instant::now);
        state.last_error = why.to_owned();
        close(&std::mem::take(&mut state.links));
        drop(state);
        self.changed.notify_all();
        tracing::error!(
            uri = %self.uri,
            "{why}: the backing export is given up on until the daemon restarts (a write NBD \
             cannot cancel could otherwise land after newer data)"
        );
    }

    /// The supervisor: reconnects whenever the device is down, until it is dropped.
    fn supervise(self: Arc<Self>) {
        loop {
            {
                let mut state = lock(&self.state);
                while state.up && !state.stopping {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                if state.stopping || state.halted.is_some() {
                    return;
                }
            }
            self.reconnect();
        }
    }

    /// Tries to reconnect with backoff until it succeeds or the device is dropped.
    fn reconnect(self: &Arc<Self>) {
        let mut delay = FIRST_BACKOFF;
        let mut attempts = 0u64;
        loop {
            let generation = lock(&self.state).generation + 1;
            let attempt = dial(&self.uri, &self.config, self.tls.as_ref())
                .and_then(|first| self.start_links(generation, first))
                .and_then(|links| match self.replay(&links[0]) {
                    Ok(()) => Ok(links),
                    Err(why) => {
                        close(&links);
                        Err(RemoteError::Unusable {
                            uri: self.uri.to_string(),
                            why,
                        })
                    }
                });
            let mut state = lock(&self.state);
            if state.stopping || state.halted.is_some() {
                if let Ok(links) = attempt {
                    close(&links);
                }
                return;
            }
            attempts += 1;
            match attempt {
                Ok(links) => {
                    let down_for = state.down_since.take().map(|t| t.elapsed());
                    state.links = links;
                    state.generation = generation;
                    state.up = true;
                    state.reconnections += 1;
                    drop(state);
                    self.changed.notify_all();
                    info!(
                        uri = %self.uri,
                        "reconnected to the backing export after {:.1} s ({attempts} attempts)",
                        down_for.unwrap_or_default().as_secs_f64()
                    );
                    return;
                }
                Err(e) => {
                    if attempts == 1 || attempts.is_multiple_of(60) {
                        warn!(uri = %self.uri, "cannot reconnect yet: {e}");
                    }
                    state.last_error = e.to_string();
                    // Interruptible by a drop of the device.
                    let _ = self
                        .changed
                        .wait_timeout_while(state, delay, |s| !s.stopping && s.halted.is_none())
                        .unwrap_or_else(PoisonError::into_inner);
                    delay = (delay * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Re-sends every write kept in the replay log over `link`, in order; overlapping ones
    /// one after the other (NBD does not order requests in flight), the rest pipelined.
    fn replay(&self, link: &Link) -> Result<(), String> {
        let changes = lock(&self.log).to_replay();
        if changes.is_empty() {
            return Ok(());
        }
        info!(
            uri = %self.uri,
            "re-sending {} writes the server may have lost",
            changes.len()
        );
        let mut batch: Vec<(Tag, (u64, u64))> = Vec::new();
        for change in &changes {
            let (start, end) = change.range();
            if batch.len() >= REPLAY_BATCH || batch.iter().any(|(_, (s, e))| *s < end && start < *e)
            {
                self.finish_replay_batch(&mut batch)?;
            }
            for (offset, len, request) in self.requests_of(change) {
                let completion = Tag::default();
                let sent = match lock(&link.sender).as_mut() {
                    Some(sender) => sender.send(request, Arc::clone(&completion)),
                    None => return Err("the device is closing".into()),
                };
                sent.map_err(|e| format!("re-sending a write: {e}"))?;
                batch.push((completion, (offset, offset + len)));
            }
        }
        self.finish_replay_batch(&mut batch)
    }

    /// Waits for every re-sent write of the batch, as long as the connection lives (a write
    /// is never given up on while the server may still carry it out: `Link::writes_in_flight`)
    /// and at most `stuck_limit`, past which the device halts; a dead connection hands them
    /// back as dropped.
    fn finish_replay_batch(&self, batch: &mut Vec<(Tag, (u64, u64))>) -> Result<(), String> {
        for (completion, _) in batch.drain(..) {
            let mut waited = Duration::ZERO;
            let outcome = loop {
                if let Some(outcome) = completion.wait(self.config.io_timeout) {
                    break outcome;
                }
                if lock(&self.state).stopping {
                    return Err("the device is closing".into());
                }
                waited += self.config.io_timeout;
                if waited >= self.config.stuck_limit {
                    let why = format!("a re-sent write had no reply for {} s", waited.as_secs());
                    self.halt(&why);
                    return Err(why);
                }
                warn!(
                    uri = %self.uri,
                    "a re-sent write has waited {} s for its reply",
                    waited.as_secs()
                );
            };
            match outcome {
                Outcome::Done(_) => {}
                Outcome::Refused(code) => {
                    return Err(format!(
                        "re-sending a write: {}",
                        nbd_error(&self.uri, code)
                    ))
                }
                Outcome::Dropped => {
                    return Err("the connection ended while re-sending writes".into())
                }
            }
        }
        Ok(())
    }

    /// The requests that carry a kept change (a write larger than the request limit goes in
    /// pieces).
    fn requests_of<'c>(&self, change: &'c Change) -> Vec<(u64, u64, Request<'c>)> {
        match change {
            Change::Write { offset, data } => {
                let max = u64::from(self.export.max_request);
                pieces(*offset, data.len() as u64, max)
                    .map(|(at, len)| {
                        let from = (at - offset) as usize;
                        let slice = &data[from..from + len as usize];
                        (at, len, Request::write(at, slice))
                    })
                    .collect()
            }
            Change::Zeroes { offset, len } => pieces(*offset, *len, DATALESS_PIECE)
                .map(|(at, len)| (at, len, Request::write_zeroes(at, len as u32)))
                .collect(),
        }
    }

    /// A connection of the current generation, waiting through an outage for at most what
    /// is left of [`RemoteConfig::retry_timeout`] since it began.
    fn wait_up(&self) -> io::Result<Arc<Link>> {
        let mut state = lock(&self.state);
        loop {
            if state.stopping {
                let message = format!("{}: the device is closed", self.uri);
                return Err(io::Error::new(io::ErrorKind::NotConnected, message));
            }
            if let Some(why) = &state.halted {
                return Err(unreached(format!(
                    "halted: {why}; restart the daemon once the export answers again"
                )));
            }
            if state.up && !state.links.is_empty() {
                let i = self.next_link.fetch_add(1, Ordering::Relaxed) % state.links.len();
                return Ok(Arc::clone(&state.links[i]));
            }
            let since = *state.down_since.get_or_insert_with(Instant::now);
            let give_up = since + self.config.retry_timeout;
            let now = Instant::now();
            if now >= give_up {
                return Err(self.unreachable(&state.last_error, since));
            }
            state = self
                .changed
                .wait_timeout(state, give_up - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The error of a request that was never sent because the export has been unreachable
    /// too long ([`ssdcache_device::unreached`]: nothing of it landed).
    fn unreachable(&self, last_error: &str, since: Instant) -> io::Error {
        unreached(format!(
            "unreachable for {} s ({last_error}); still reconnecting",
            since.elapsed().as_secs()
        ))
    }

    /// Sends `request` and waits for its answer, re-issuing it after a reconnection; gives
    /// up after [`RemoteConfig::retry_timeout`] of outages.
    fn run(&self, request: Request<'_>) -> io::Result<Vec<u8>> {
        let mut first_drop: Option<Instant> = None;
        loop {
            if let Some(t) = first_drop {
                if t.elapsed() >= self.config.retry_timeout {
                    // Sent at least once: it may have landed, so not `unreached`.
                    let last = lock(&self.state).last_error.clone();
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        format!(
                            "no answer through {} s of reconnections ({last})",
                            t.elapsed().as_secs()
                        ),
                    ));
                }
            }
            let link = match self.wait_up() {
                Ok(link) => link,
                // Sent before: it may have landed, so not `unreached` (review 49).
                Err(e) if first_drop.is_some() => {
                    return Err(io::Error::new(io::ErrorKind::NotConnected, e.to_string()))
                }
                Err(e) => return Err(e),
            };
            let completion = Tag::default();
            // Whatever changes data: a late copy of any of them could land over newer data.
            let is_write = matches!(
                request.command,
                Command::Write | Command::WriteZeroes | Command::Trim
            );
            let sent = match lock(&link.sender).as_mut() {
                Some(sender) => {
                    if is_write {
                        link.writes_in_flight.fetch_add(1, Ordering::SeqCst);
                    }
                    sender.send(request, Arc::clone(&completion))
                }
                None => Err(ClientError::Closed { in_flight: 0 }),
            };
            if is_write && sent.is_err() {
                link.writes_in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            match sent {
                Ok(_) => {}
                Err(ClientError::InvalidRequest(message)) => {
                    return Err(io::Error::new(io::ErrorKind::InvalidInput, message))
                }
                Err(e) => {
                    self.link_failed(link.generation, &format!("sending a request: {e}"));
                    first_drop.get_or_insert_with(Instant::now);
                    continue;
                }
            }
            let timeout = if request.command == Command::Flush {
                self.config.flush_timeout
            } else {
                self.config.io_timeout
            };
            let outcome = self.await_reply(&link, &completion, timeout);
            if is_write {
                link.writes_in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            match outcome {
                Outcome::Done(data) => return Ok(data),
                Outcome::Refused(NBD_ESHUTDOWN) => {
                    self.link_failed(link.generation, "the server is shutting down (ESHUTDOWN)");
                }
                Outcome::Refused(code) => return Err(nbd_error(&self.uri, code)),
                Outcome::Dropped => {}
            }
            first_drop.get_or_insert_with(Instant::now);
        }
    }

    /// Waits `timeout` for the answer; then declares the connection dead (its receiver hands
    /// the request back as dropped once the socket is shut) and waits for that, at most
    /// `io_timeout` more before taking it as dropped anyway. Not while writes are in flight on
    /// the connection: the server could still carry them out after their callers sent them
    /// again and newer writes followed (review 48), so then it waits as long as the
    /// connection lives (a dead peer ends it: EOF, a reset, TCP keepalive), logging.
    fn await_reply(&self, link: &Link, completion: &Completion, timeout: Duration) -> Outcome {
        let mut waited = Duration::ZERO;
        loop {
            if let Some(outcome) = completion.wait(timeout) {
                return outcome;
            }
            waited += timeout;
            if link.writes_in_flight.load(Ordering::SeqCst) == 0 {
                break;
            }
            if waited >= self.config.stuck_limit {
                self.halt(&format!(
                    "no reply for {} s with writes in flight",
                    waited.as_secs()
                ));
                let _ = link.socket.shutdown_stream(Shutdown::Both);
                return completion
                    .wait(self.config.io_timeout)
                    .unwrap_or(Outcome::Dropped);
            }
            warn!(
                uri = %self.uri,
                "no reply for {} s with writes in flight; waiting (NBD cannot cancel a write)",
                waited.as_secs()
            );
        }
        let why = format!("no reply within {} s", waited.as_secs_f64());
        self.link_failed(link.generation, &why);
        let _ = link.socket.shutdown_stream(Shutdown::Both);
        completion
            .wait(self.config.io_timeout)
            .unwrap_or(Outcome::Dropped)
    }

    /// Sends a change that must survive a server restart: kept in the replay log from
    /// before it is sent until a FLUSH covers it.
    fn run_kept(&self, change: Change, request: Request<'_>) -> io::Result<()> {
        if lock(&self.log).over_limit() {
            self.flush()?;
        }
        let seq = lock(&self.log).record(change);
        let result = self.run(request);
        let mut log = lock(&self.log);
        match result {
            Ok(_) => log.acknowledged(seq),
            Err(_) => log.forget(seq),
        }
        result.map(drop)
    }

    fn flush(&self) -> io::Result<()> {
        let covered = lock(&self.log).acknowledged_now();
        if self.export.has_flag(NBD_FLAG_SEND_FLUSH) {
            self.run(Request::flush()).map_err(|e| {
                if e.kind() == io::ErrorKind::NotConnected {
                    // Whatever it would have covered is still in the replay log, sent again
                    // before anything else on the next connection: nothing is lost.
                    unreached(e.to_string())
                } else {
                    e
                }
            })?;
        }
        // A server without FLUSH writes through: what it acknowledged is durable.
        lock(&self.log).durable(&covered);
        Ok(())
    }
}

fn close(links: &[Arc<Link>]) {
    for link in links {
        let _ = link.socket.shutdown_stream(Shutdown::Both);
    }
}

impl BlockDevice for NbdDevice {
    fn size(&self) -> u64 {
        self.shared.export.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let max = u64::from(self.shared.export.max_request);
        for (at, len) in pieces(offset, buf.len() as u64, max) {
            let data = self.shared.run(Request::read(at, len as u32))?;
            let from = (at - offset) as usize;
            let to = &mut buf[from..from + len as usize];
            if data.len() != to.len() {
                return Err(io::Error::other(format!(
                    "{}: a READ of {len} bytes was answered with {} bytes",
                    self.shared.uri,
                    data.len()
                )));
            }
            to.copy_from_slice(&data);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let max = u64::from(self.shared.export.max_request);
        for (at, len) in pieces(offset, buf.len() as u64, max) {
            let from = (at - offset) as usize;
            let data = &buf[from..from + len as usize];
            let change = Change::Write {
                offset: at,
                data: data.to_vec(),
            };
            self.shared.run_kept(change, Request::write(at, data))?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.shared.flush()
    }

    fn write_fua(&self, buf: &[u8], offset: u64) -> Option<io::Result<()>> {
        if !self.shared.export.has_flag(NBD_FLAG_SEND_FUA) {
            return None;
        }
        let max = u64::from(self.shared.export.max_request);
        let result = pieces(offset, buf.len() as u64, max).try_for_each(|(at, len)| {
            let from = (at - offset) as usize;
            let data = &buf[from..from + len as usize];
            let change = Change::Write {
                offset: at,
                data: data.to_vec(),
            };
            // Kept like any write although it is durable once answered: an older write of
            // the range still kept would otherwise be replayed over it.
            self.shared.run_kept(change, Request::write(at, data).fua())
        });
        Some(result)
    }

    fn reachable(&self) -> Result<(), String> {
        let state = lock(&self.shared.state);
        if state.up {
            return Ok(());
        }
        let down_for = state.down_since.map_or(0, |t| t.elapsed().as_secs());
        Err(format!(
            "{} unreachable for {down_for} s ({})",
            self.shared.uri, state.last_error
        ))
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        if !self.shared.export.has_flag(NBD_FLAG_SEND_TRIM) {
            return Ok(false);
        }
        // A hint with no promised contents: not kept for replay.
        for (at, len) in pieces(offset, len, DATALESS_PIECE) {
            self.shared.run(Request::trim(at, len as u32))?;
        }
        Ok(true)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.shared.export.has_flag(NBD_FLAG_SEND_WRITE_ZEROES) {
            return write_zeroes_by_writing(self, offset, len);
        }
        for (at, len) in pieces(offset, len, DATALESS_PIECE) {
            let change = Change::Zeroes { offset: at, len };
            self.shared
                .run_kept(change, Request::write_zeroes(at, len as u32))?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.shared.uri.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_in_order() {
        let p: Vec<_> = pieces(4096, 10_000, 4096).collect();
        assert_eq!(p, [(4096, 4096), (8192, 4096), (12288, 1808)]);
        assert_eq!(pieces(0, 0, 4096).count(), 0);
    }

    #[test]
    fn stamps_fit_the_record_and_differ_by_description() {
        assert_eq!(export_stamp("vm1", None), "nbd:vm1");
        assert_eq!(export_stamp("vm1", Some("id-7")), "nbd:vm1#id-7");
        let long = "x".repeat(200);
        let a = export_stamp("vm1", Some(&long));
        assert!(a.len() <= STABLE_ID_LEN && a.starts_with("nbd-fnv64:"));
        assert_ne!(a, export_stamp("vm2", Some(&long)));
    }
}
