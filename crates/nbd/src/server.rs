//! The threaded server: listeners, connection bookkeeping and shutdown.
//!
//! Per-connection work (handshake I/O and the transmission workers) lives in
//! [`crate::connection`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use tracing::{info, warn};

use crate::buffers::{buffer_size, BufferPool};
use crate::connection::{self, ConnectionError, Start};
use crate::handshake::ExportInfo;
use crate::proto::{Command, Errno};
use crate::tls::TlsConfig;
pub use ssdcache_device::Run;

/// The storage behind one export. The server calls it from many threads at
/// once. Buffers passed to `read` and `write` of 4096 bytes or more start on a 4096-byte boundary,
/// and offsets and lengths are multiples of the export's `min_block` and lie
/// inside the export (the server checks before calling); zero-length
/// requests never reach the backend.
pub trait Export: Send + Sync {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno>;
    /// With `fua`, reply only once the data is durable.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno>;
    /// Make every write already replied to durable.
    fn flush(&self) -> Result<(), Errno>;
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno>;
    /// `may_trim` is false when the client sent `NBD_CMD_FLAG_NO_HOLE`.
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno>;
    /// A prefetch hint.
    fn cache(&self, offset: u64, length: u64) -> Result<(), Errno>;

    /// How `[offset, offset + length)` is allocated (NBD_CMD_BLOCK_STATUS, `base:allocation`):
    /// consecutive runs from `offset`, at least one, covering at most `length` bytes (less is
    /// fine: the client asks again from where they end). A hole must read as zeroes. The
    /// default, for exports that cannot tell: all data.
    fn allocation(&self, offset: u64, length: u64) -> Result<Vec<Run>, Errno> {
        let _ = offset;
        Ok(vec![Run {
            len: length,
            hole: false,
        }])
    }

    /// Which workers should run a READ or WRITE of `length` bytes at `offset` (other
    /// commands always take the slow lane). Called once per request, right after it is read
    /// and before any of its work, so it must be cheap and must not block. It is a hint: a
    /// wrong answer costs latency (a fast worker waits for the slow device, or a request
    /// that could have been fast queues behind slow ones), never correctness. The default
    /// sends everything to the slow lane.
    fn lane(&self, command: Command, offset: u64, length: u64) -> Lane {
        let _ = (command, offset, length);
        Lane::Slow
    }

    /// Serves several READs that [`Export::lane`] sent to the fast lane, each result into its
    /// `result`. The connection gathers them from the requests already received (at most
    /// [`MAX_READ_BATCH`]), so an export that can submit many device reads at once (the
    /// cache: one io_uring_enter for a batch of hits) overrides this; the default reads one
    /// after another.
    /// Whether the connection should gather fast READs into batches for [`Export::read_many`].
    /// False when a batch is no cheaper than its reads (then each fast worker serves one READ
    /// at a time, and the reads of different workers overlap). The default, true, suits
    /// exports whose reads do not wait for a device.
    fn batches_reads(&self) -> bool {
        true
    }

    fn read_many(&self, reads: &mut [BatchedRead<'_>]) {
        for read in reads {
            read.result = self.read(read.offset, read.buf);
        }
    }

    /// READs that complete on another thread, for one connection (docs/design.md §6.1, "Hits
    /// without waiting"): the thread that reads requests starts those the export can serve
    /// from a fast device and goes back to reading; the connection's completion thread
    /// answers each as it ends. `None` (the default): every READ runs on a worker.
    fn ring_reads(&self) -> Option<Box<dyn RingReads + '_>> {
        None
    }
}

/// READs started on one thread and ended on another ([`Export::ring_reads`]).
pub trait RingReads: Send + Sync {
    /// Starts each read of `reads` the export can serve this way now, marking it `started`;
    /// the connection serves the others with [`Export::read`] or [`Export::read_many`].
    ///
    /// # Safety
    /// The buffer of every started read must stay valid, and unread and unwritten by anyone
    /// else, until [`RingReads::wait`] reported its tag, or forever once `wait` failed.
    unsafe fn start(&self, reads: &mut [RingStart]);
    /// Waits until at least one started read ended (or [`RingReads::wake`]) and appends each
    /// that ended as (tag, served). Not served: the connection serves the read again with
    /// [`Export::read`], on another thread than the one waiting here (the export's read may
    /// wait for what only `wait` lets go). One thread waits at a time. An error means started
    /// reads may never end: their buffers must be leaked.
    fn wait(&self, ended: &mut Vec<(u64, bool)>) -> io::Result<()>;
    /// Makes a thread in `wait` return.
    fn wake(&self);
}

/// One READ for [`RingReads::start`]: `len` bytes at `offset` into `buf` (4096-aligned).
#[derive(Debug, Clone, Copy)]
pub struct RingStart {
    pub tag: u64,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
    pub started: bool,
}

/// One READ of a batch ([`Export::read_many`]).
pub struct BatchedRead<'b> {
    pub offset: u64,
    pub buf: &'b mut [u8],
    /// What the read came to; set by `read_many`.
    pub result: Result<(), Errno>,
}

/// READs one fast worker serves together at most (docs/design.md §6.1): the requests it finds
/// already received after the one it waited for. Their replies leave in one writev of twice
/// as many slices, far below IOV_MAX (1024).
pub const MAX_READ_BATCH: usize = 32;

/// Where a request runs on its connection (docs/design.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Run by the worker that read it, at once: the request will probably not touch the slow
    /// (backing) device, e.g. a read whose data is all in the cache.
    Fast,
    /// Queued for the slow lane's workers, so its wait for the slow device never holds up
    /// the reading of further requests or a fast one.
    Slow,
}

/// One export: what the handshake advertises, and the backend serving it.
#[derive(Clone)]
pub struct ServerExport {
    pub info: ExportInfo,
    pub backend: Arc<dyn Export>,
}

/// TRIM, WRITE_ZEROES and CACHE requests longer than this (the protocol allows almost 4 GiB)
/// reach the backend in pieces of this size, so no single backend call holds a huge range
/// (its line locks, the backing device) for long, and a forced stop can end the request
/// between pieces. With FUA the pieces go without it and one flush follows the last, so the
/// whole range is durable when the reply says so.
pub const DATALESS_CHUNK_BYTES: u64 = 64 << 20;

/// Requests one connection may hold queued for its slow lane (read, not yet taken by a slow
/// worker). While the queue is full the connection reads no further request. Twice the Linux
/// kernel client's 128 tags, so a client whose every request in flight waits for the slow
/// device still leaves the reading of hits free. A queued request is a few dozen bytes
/// besides a write's payload, which the connection's request memory bounds.
pub const SLOW_LANE_QUEUE: usize = 256;

/// Replies one connection may have waiting for its sender thread (a client that sends many
/// requests before it reads a reply): 104 bytes each besides a READ's data, whose buffer
/// stays charged to the connection's request memory until it is sent, so 6.5 MiB when full
/// (given back once drained). A worker with a reply to queue past it waits for the sender;
/// the io_uring completion thread never waits and may go past it by its 128 reads.
pub const REPLY_QUEUE: usize = 65536;

/// Server tuning and limits. Every limit bounds something a client could otherwise make grow
/// without end; docs/design.md §6 has the arithmetic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Slow-lane worker threads per connection: requests that may wait for the slow (backing)
    /// device run on this many threads at most, i.e. the queue depth one connection gives that
    /// device. Started on demand, when a slow request finds none idle.
    pub threads_per_connection: usize,
    /// Fast-lane worker threads per connection (the connection's own thread is one): they
    /// take turns reading requests, run those [`Export::lane`] calls fast themselves and hand
    /// the others to the slow lane. This bounds the fast requests in parallel on one
    /// connection, i.e. the queue depth one connection gives the cache device.
    pub fast_threads_per_connection: usize,
    /// Largest READ/WRITE length accepted (also capped by each export's `max_block`).
    pub max_request: u32,
    /// Total time a client gets to finish the handshake.
    pub handshake_timeout: Duration,
    /// Connections open at once (handshaking or transmitting). Further clients are closed
    /// right after `accept`, before the greeting, and the refusal is logged. With
    /// `threads_per_connection` and `fast_threads_per_connection` this bounds the server's
    /// threads.
    pub max_connections: usize,
    /// Bytes all request buffers of the server may hold at once (in use, or kept for reuse).
    pub buffer_memory: usize,
    /// Bytes the requests in flight on one connection may hold at once. At least
    /// `max_request` (rounded up to whole pages) and at most `buffer_memory`.
    pub connection_buffer_memory: usize,
    /// How long a request waits for buffer memory held by other requests before it is
    /// answered `ENOMEM` (a write's payload is then read and dropped).
    pub buffer_wait: Duration,
    /// Once the first byte of a request arrived, the rest of its header and its write payload
    /// must arrive within this; a reply must be written within this (a client that stops
    /// reading replies is disconnected after it).
    pub io_timeout: Duration,
    /// A connection with no request in flight is closed after this long without a new
    /// request; `None`: never. Off by default because the Linux kernel client keeps one
    /// connection per device open for as long as the device is attached, sends nothing while
    /// the filesystem on it is idle (hours), and cannot reconnect by itself: closing it would
    /// fail the device. An idle connection holds no request buffers.
    pub idle_timeout: Option<Duration>,
    /// TLS (`NBD_OPT_STARTTLS`, [`crate::tls`]); `None`: plaintext only.
    pub tls: Option<TlsConfig>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            threads_per_connection: 8,
            fast_threads_per_connection: 32,
            max_request: 32 << 20,
            handshake_timeout: Duration::from_secs(30),
            max_connections: 128,
            buffer_memory: 512 << 20,
            connection_buffer_memory: 64 << 20,
            buffer_wait: Duration::from_secs(30),
            io_timeout: Duration::from_secs(30),
            idle_timeout: None,
            tls: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("export {name:?} is misconfigured: {reason}")]
    InvalidExport { name: String, reason: String },
    #[error("invalid server configuration: {0}")]
    InvalidConfig(String),
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
}

/// A connected, bidirectional byte stream the server can speak NBD over.
/// Implemented for [`UnixStream`] and [`TcpStream`].
pub trait NbdStream: Read + Write + AsRawFd + Send + Sync + Sized + 'static {
    /// Another handle to the same socket (used to read, write and shut down
    /// from different threads).
    fn try_clone_stream(&self) -> io::Result<Self>;
    fn shutdown_stream(&self, how: Shutdown) -> io::Result<()>;
    /// Sets the read timeout (`None` blocks forever).
    fn set_read_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Sets the write timeout (`None` blocks forever).
    fn set_write_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Who is on the other end, for logs.
    fn peer_label(&self) -> String;
}

impl NbdStream for UnixStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_stream(&self, how: Shutdown) -> io::Result<()> {
        self.shutdown(how)
    }
    fn set_read_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(timeout)
    }
    fn set_write_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_write_timeout(timeout)
    }
    fn peer_label(&self) -> String {
        match self
            .peer_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(|p| p.display().to_string()))
        {
            Some(path) => format!("unix:{path}"),
            None => format!("unix:fd{}", self.as_raw_fd()),
        }
    }
}

impl NbdStream for TcpStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_stream(&self, how: Shutdown) -> io::Result<()> {
        self.shutdown(how)
    }
    fn set_read_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(timeout)
    }
    fn set_write_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_write_timeout(timeout)
    }
    fn peer_label(&self) -> String {
        match self.peer_addr() {
            Ok(addr) => format!("tcp:{addr}"),
            Err(_) => format!("tcp:fd{}", self.as_raw_fd()),
        }
    }
}

/// Serves exports over NBD. Cheap to clone; clones share one server, so
/// `serve_unix`, `serve_tcp`, `shutdown` and `force_close` can run on different threads.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

/// The exports at one moment ([`Server::add_export`], [`Server::remove_export`] replace the
/// table whole). A connection negotiates on one table and enters transmission on the export
/// it chose there, if that export is still served ([`Registration::enter_export`]).
pub(crate) struct ExportTable {
    pub(crate) list: Vec<ServerExport>,
    /// What handshakes advertise: the `info` of each export, in the same order.
    pub(crate) infos: Arc<[ExportInfo]>,
}

pub(crate) struct Shared {
    /// Replaced whole when an export is added; connections read a snapshot.
    exports: Mutex<Arc<ExportTable>>,
    pub(crate) config: ServerConfig,
    pub(crate) buffers: BufferPool,
    shutting_down: AtomicBool,
    force_closed: AtomicBool,
    /// Requests inside an [`Export`] call right now.
    in_backend: AtomicUsize,
    /// Becomes readable (EOF) when shutdown starts; accept loops poll it so a
    /// blocked accept wakes up without signals or timeouts.
    wake_rx: UnixStream,
    wake_tx: UnixStream,
    connections: Mutex<Connections>,
    idle: Condvar,
}

impl Shared {
    /// The exports now (one added later is not in this snapshot).
    pub(crate) fn exports(&self) -> Arc<ExportTable> {
        Arc::clone(&lock(&self.exports))
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    pub(crate) fn is_force_closed(&self) -> bool {
        self.force_closed.load(Ordering::SeqCst)
    }

    /// Counts a request as inside the backend until the guard drops, or refuses it with
    /// `ESHUTDOWN` once `force_close` ran. Counting first and checking after (both SeqCst),
    /// against `force_close` setting the flag first and reading the count after, means that
    /// once `force_close` sees no request inside, none can enter any more: the backend is
    /// quiet for good even while connection threads still unwind.
    pub(crate) fn enter_backend(&self) -> Result<InBackend<'_>, Errno> {
        self.in_backend.fetch_add(1, Ordering::SeqCst);
        let inside = InBackend(&self.in_backend);
        if self.is_force_closed() {
            return Err(Errno::Shutdown);
        }
        Ok(inside)
    }
}

pub(crate) struct InBackend<'a>(&'a AtomicUsize);

impl Drop for InBackend<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl ExportTable {
    fn new(list: Vec<ServerExport>) -> ExportTable {
        let infos = list.iter().map(|e| e.info.clone()).collect();
        ExportTable { list, infos }
    }
}

/// Refuses an export whose geometry is invalid or whose name one of `existing` has.
fn check_new_export(existing: &[ServerExport], info: &ExportInfo) -> Result<(), ServerError> {
    validate_export(info)?;
    if existing.iter().any(|e| e.info.name == info.name) {
        return Err(invalid_export(info, "duplicate export name"));
    }
    Ok(())
}

/// Shuts one connection's socket down in the given direction(s).
type Stopper = Box<dyn Fn(Shutdown) + Send>;

#[derive(Default)]
struct Connections {
    next_id: u64,
    open: HashMap<u64, OpenConnection>,
}

struct OpenConnection {
    stop: Stopper,
    /// The export it serves, once in transmission.
    export: Option<String>,
}

/// An open connection's entry in the registry, removed on drop (even if the
/// connection thread panics) so `wait_idle` cannot hang on a dead connection.
pub(crate) struct Registration {
    shared: Arc<Shared>,
    id: u64,
}

impl Registration {
    /// Records that the connection serves `export` from now on. False if the export was
    /// removed since the connection's handshake read the table: the connection must end
    /// without a request (a removed volume takes none). Checked and recorded under the
    /// connections' lock, which [`Server::remove_export`] holds while it removes the export and
    /// closes the connections recorded as serving it, so no connection slips between the two.
    pub(crate) fn enter_export(&self, export: &ServerExport) -> bool {
        let mut connections = lock(&self.shared.connections);
        let served = self
            .shared
            .exports()
            .list
            .iter()
            .any(|e| Arc::ptr_eq(&e.backend, &export.backend));
        if served {
            if let Some(c) = connections.open.get_mut(&self.id) {
                c.export = Some(export.info.name.clone());
            }
        }
        served
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut connections = lock(&self.shared.connections);
        connections.open.remove(&self.id);
        // Every end, not only the last: `remove_export` waits for those of one export.
        self.shared.idle.notify_all();
    }
}

impl Server {
    /// Checks the configuration and every export's advertised geometry.
    pub fn new(exports: Vec<ServerExport>, config: ServerConfig) -> Result<Server, ServerError> {
        Self::check_config(&config)?;
        for (index, export) in exports.iter().enumerate() {
            check_new_export(&exports[..index], &export.info)?;
        }
        let (wake_rx, wake_tx) = UnixStream::pair().map_err(|source| ServerError::Io {
            context: "creating the shutdown wake-up socket pair",
            source,
        })?;
        Ok(Server {
            shared: Arc::new(Shared {
                exports: Mutex::new(Arc::new(ExportTable::new(exports))),
                buffers: BufferPool::new(config.buffer_memory),
                config,
                shutting_down: AtomicBool::new(false),
                force_closed: AtomicBool::new(false),
                in_backend: AtomicUsize::new(0),
                wake_rx,
                wake_tx,
                connections: Mutex::new(Connections::default()),
                idle: Condvar::new(),
            }),
        })
    }

    /// Adds an export while serving: handshakes that start from now on list it and may choose
    /// it; connections already open are not affected. Refuses an invalid geometry and a name
    /// already exported.
    pub fn add_export(&self, export: ServerExport) -> Result<(), ServerError> {
        let mut table = lock(&self.shared.exports);
        check_new_export(&table.list, &export.info)?;
        let mut list = table.list.clone();
        list.push(export);
        *table = Arc::new(ExportTable::new(list));
        Ok(())
    }

    /// Stops serving the export `name`: handshakes from now on do not list it, and every
    /// connection serving it is closed in both directions at once (requests already inside the
    /// backend finish; their replies are not sent). Returns true once none of its connections
    /// is left (their threads ended, so no request of theirs is inside the backend), false if
    /// some still are after `wait` (call again to wait more). Unknown names are not an error:
    /// a second call waits for the first one's connections.
    pub fn remove_export(&self, name: &str, wait: Duration) -> bool {
        let connections = lock(&self.shared.connections);
        {
            let mut table = lock(&self.shared.exports);
            if table.list.iter().any(|e| e.info.name == name) {
                let list = table
                    .list
                    .iter()
                    .filter(|e| e.info.name != name)
                    .cloned()
                    .collect();
                *table = Arc::new(ExportTable::new(list));
                info!(export = name, "NBD export removed");
            }
        }
        for c in connections.open.values() {
            if c.export.as_deref() == Some(name) {
                (c.stop)(Shutdown::Both);
            }
        }
        let serving =
            |c: &mut Connections| c.open.values().any(|o| o.export.as_deref() == Some(name));
        let waited = self
            .shared
            .idle
            .wait_timeout_while(connections, wait, serving);
        let (_guard, result) = waited.unwrap_or_else(PoisonError::into_inner);
        !result.timed_out()
    }

    /// The checks [`Server::new`] makes of a configuration, for callers that want to refuse a
    /// bad one before they open anything.
    pub fn check_config(config: &ServerConfig) -> Result<(), ServerError> {
        validate_config(config)
    }

    /// Accepts connections until [`Server::shutdown`], each on its own threads. Returns as
    /// soon as it stops accepting; [`Server::wait_idle`] waits for the connections. The
    /// listener is switched to non-blocking mode.
    pub fn serve_unix(&self, listener: UnixListener) -> Result<(), ServerError> {
        self.serve_listener(&listener)
    }

    /// Same as [`Server::serve_unix`] for TCP. Accepted sockets get
    /// `TCP_NODELAY`, since replies are small and latency-bound.
    pub fn serve_tcp(&self, listener: TcpListener) -> Result<(), ServerError> {
        self.serve_listener(&listener)
    }

    /// Serves one already-connected client on the calling thread (plus
    /// worker threads) until it disconnects or the server shuts down.
    /// `Ok` means a clean end: `NBD_CMD_DISC`, `NBD_OPT_ABORT`, EOF between
    /// requests, the idle timeout, or shutdown.
    pub fn serve_stream<S: NbdStream>(&self, stream: S) -> Result<(), ConnectionError> {
        let registration = self.register(&stream)?;
        connection::serve(&self.shared, stream, Start::Handshake, registration)
    }

    /// Like [`Server::serve_stream`] but skips the handshake and serves the export named
    /// `export` directly: for a socket pair whose other end was handed to the Linux kernel
    /// with `NBD_SET_SOCK` (the kernel never negotiates; size and flags are set by ioctl).
    pub fn serve_transmission<S: NbdStream>(
        &self,
        stream: S,
        export: &str,
    ) -> Result<(), ConnectionError> {
        let registration = self.register(&stream)?;
        let start = Start::Transmission {
            export: export.to_owned(),
        };
        connection::serve(&self.shared, stream, start, registration)
    }

    /// Starts a graceful shutdown and returns at once: accept loops stop, no
    /// connection reads another request, requests already read finish and
    /// are answered, then connections close. Idempotent.
    pub fn shutdown(&self) {
        if self.shared.shutting_down.swap(true, Ordering::SeqCst) {
            return;
        }
        info!("NBD server shutting down");
        if let Err(error) = self.shared.wake_tx.shutdown(Shutdown::Write) {
            warn!(%error, "cannot wake the accept loops");
        }
        for c in lock(&self.shared.connections).open.values() {
            (c.stop)(Shutdown::Read);
        }
    }

    /// Shuts down (as [`Server::shutdown`]) and closes every client socket in both directions
    /// at once: replies still owed are not sent, workers blocked on a socket or waiting for
    /// buffer memory return, requests not yet in the backend are refused (`ESHUTDOWN`), and
    /// split TRIM/WRITE_ZEROES/CACHE requests stop between pieces. Requests inside a backend
    /// call finish there (nothing can stop those); [`Server::requests_in_backend`] counts
    /// them.
    pub fn force_close(&self) {
        if self.shared.force_closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shutdown();
        info!("NBD server closing every connection now");
        for c in lock(&self.shared.connections).open.values() {
            (c.stop)(Shutdown::Both);
        }
        self.shared.buffers.wake_all();
    }

    /// Blocks until no connection is open.
    pub fn wait_idle(&self) {
        let connections = lock(&self.shared.connections);
        let still_open = |c: &mut Connections| !c.open.is_empty();
        let _idle = self.shared.idle.wait_while(connections, still_open);
    }

    /// Like [`Server::wait_idle`] with a time limit; true if idle was reached.
    pub fn wait_idle_timeout(&self, timeout: Duration) -> bool {
        let connections = lock(&self.shared.connections);
        let still_open = |c: &mut Connections| !c.open.is_empty();
        let waited = self
            .shared
            .idle
            .wait_timeout_while(connections, timeout, still_open);
        let (_guard, result) = waited.unwrap_or_else(PoisonError::into_inner);
        !result.timed_out()
    }

    /// Connections currently open (handshaking or transmitting).
    pub fn open_connections(&self) -> usize {
        lock(&self.shared.connections).open.len()
    }

    /// Requests inside a backend call right now (read, write, flush...). After
    /// [`Server::force_close`] no request enters a backend call any more, so once this is 0
    /// the backends are left alone for good.
    pub fn requests_in_backend(&self) -> usize {
        self.shared.in_backend.load(Ordering::SeqCst)
    }

    /// Bytes held by request buffers now (in use, or kept for reuse); never more than
    /// [`ServerConfig::buffer_memory`].
    pub fn buffer_memory_in_use(&self) -> usize {
        self.shared.buffers.charged()
    }

    /// Records a connection so shutdown can reach it, or refuses it when
    /// `max_connections` are open. A connection that registers after
    /// shutdown started is stopped straight away.
    fn register<S: NbdStream>(&self, stream: &S) -> Result<Registration, ConnectionError> {
        let control = stream
            .try_clone_stream()
            .map_err(|source| ConnectionError::io(stream.peer_label(), "cloning socket", source))?;
        let stop: Stopper = Box::new(move |how| {
            // Err only means the socket is already gone, which is the goal.
            let _ = control.shutdown_stream(how);
        });
        let mut connections = lock(&self.shared.connections);
        let limit = self.shared.config.max_connections;
        if connections.open.len() >= limit {
            return Err(ConnectionError::TooManyConnections {
                peer: stream.peer_label(),
                limit,
            });
        }
        let id = connections.next_id;
        connections.next_id += 1;
        if self.shared.is_force_closed() {
            stop(Shutdown::Both);
        } else if self.shared.is_shutting_down() {
            stop(Shutdown::Read);
        }
        connections
            .open
            .insert(id, OpenConnection { stop, export: None });
        Ok(Registration {
            shared: Arc::clone(&self.shared),
            id,
        })
    }

    fn serve_listener<L: Acceptor>(&self, listener: &L) -> Result<(), ServerError> {
        listener
            .set_nonblocking(true)
            .map_err(|source| ServerError::Io {
                context: "making the listener non-blocking",
                source,
            })?;
        info!(listener = L::KIND, "NBD server accepting connections");
        while self.wait_for_client(listener)? {
            match listener.accept_stream() {
                Ok(stream) => self.spawn_connection(stream),
                Err(error) if is_transient_accept_error(&error) => {}
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning; the
                    // condition usually clears when connections close.
                    warn!(%error, "accept failed");
                    thread::sleep(Duration::from_millis(100));
                }
            }
        }
        info!(listener = L::KIND, "NBD server stopped accepting");
        Ok(())
    }

    /// True when a client may be waiting, false once shutdown started.
    fn wait_for_client<L: Acceptor>(&self, listener: &L) -> Result<bool, ServerError> {
        if self.shared.is_shutting_down() {
            return Ok(false);
        }
        let readiness = poll_readable(listener.as_raw_fd(), self.shared.wake_rx.as_raw_fd());
        let readiness = readiness.map_err(|source| ServerError::Io {
            context: "waiting for connections",
            source,
        })?;
        Ok(readiness == Readiness::Listener && !self.shared.is_shutting_down())
    }

    fn spawn_connection<S: NbdStream>(&self, stream: S) {
        let peer = stream.peer_label();
        // Registered before the thread exists so shutdown/wait_idle never
        // miss a connection that is just starting.
        let registration = match self.register(&stream) {
            Ok(registration) => registration,
            // Dropping the stream closes it: the client sees EOF instead of a greeting.
            Err(error) => return warn!(%error, "refusing NBD connection"),
        };
        let shared = Arc::clone(&self.shared);
        let spawned = thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || connection::serve(&shared, stream, Start::Handshake, registration));
        if let Err(error) = spawned {
            warn!(%peer, %error, "cannot start a connection thread; dropping connection");
        }
    }
}

fn validate_config(config: &ServerConfig) -> Result<(), ServerError> {
    let invalid = |what: &str| Err(ServerError::InvalidConfig(what.into()));
    if config.threads_per_connection == 0 {
        return invalid("threads_per_connection must be at least 1");
    }
    if config.fast_threads_per_connection == 0 {
        return invalid("fast_threads_per_connection must be at least 1");
    }
    if config.max_request == 0 {
        return invalid("max_request must be positive");
    }
    if config.max_connections == 0 {
        return invalid("max_connections must be at least 1");
    }
    let largest_buffer = buffer_size(config.max_request as usize);
    if config.connection_buffer_memory < largest_buffer {
        return Err(ServerError::InvalidConfig(format!(
            "the request memory of a connection ({} bytes) must hold the largest request \
             ({largest_buffer} bytes)",
            config.connection_buffer_memory
        )));
    }
    if config.buffer_memory < config.connection_buffer_memory {
        return invalid(
            "the request memory of the server must be at least the request memory of a connection",
        );
    }
    let durations = [
        config.handshake_timeout,
        config.buffer_wait,
        config.io_timeout,
    ];
    if durations.iter().any(Duration::is_zero) || config.idle_timeout == Some(Duration::ZERO) {
        return invalid("timeouts must be positive");
    }
    Ok(())
}

/// Enforces the spec's rules on strings and block sizes, so a mistake in the
/// caller surfaces here rather than as confused clients.
fn validate_export(info: &ExportInfo) -> Result<(), ServerError> {
    const MAX_STRING: usize = 4096;
    if info.name.len() > MAX_STRING || info.description.len() > MAX_STRING {
        return Err(invalid_export(
            info,
            "name and description must be at most 4096 bytes",
        ));
    }
    if !info.min_block.is_power_of_two() || info.min_block > 65536 {
        return Err(invalid_export(
            info,
            "min_block must be a power of two up to 65536",
        ));
    }
    if !info.preferred_block.is_power_of_two() || info.preferred_block < info.min_block {
        return Err(invalid_export(
            info,
            "preferred_block must be a power of two >= min_block",
        ));
    }
    if info.max_block < info.min_block
        || (!info.max_block.is_multiple_of(info.min_block) && info.max_block != u32::MAX)
    {
        return Err(invalid_export(
            info,
            "max_block must be a multiple of min_block",
        ));
    }
    Ok(())
}

fn invalid_export(info: &ExportInfo, reason: &str) -> ServerError {
    ServerError::InvalidExport {
        name: info.name.clone(),
        reason: reason.into(),
    }
}

/// Locks ignoring poisoning: the protected data (registries, sockets) stays
/// consistent even if a backend panicked while a lock was held.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn is_transient_accept_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
    )
}

/// The listener types `serve_*` accept from.
trait Acceptor: AsRawFd {
    type Stream: NbdStream;
    const KIND: &'static str;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
    fn accept_stream(&self) -> io::Result<Self::Stream>;
}

impl Acceptor for UnixListener {
    type Stream = UnixStream;
    const KIND: &'static str = "unix";
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        UnixListener::set_nonblocking(self, nonblocking)
    }
    fn accept_stream(&self) -> io::Result<UnixStream> {
        let (stream, _) = self.accept()?;
        // Some platforms inherit O_NONBLOCK from the listener.
        stream.set_nonblocking(false)?;
        Ok(stream)
    }
}

impl Acceptor for TcpListener {
    type Stream = TcpStream;
    const KIND: &'static str = "tcp";
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        TcpListener::set_nonblocking(self, nonblocking)
    }
    fn accept_stream(&self) -> io::Result<TcpStream> {
        let (stream, _) = self.accept()?;
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Readiness {
    Listener,
    ShutdownStarted,
}

/// Blocks until the listener has a pending connection or the wake-up socket
/// reports shutdown.
fn poll_readable(listener: RawFd, wake: RawFd) -> io::Result<Readiness> {
    let mut fds = [
        libc::pollfd {
            fd: listener,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a live array of two initialised pollfd structs and
        // the count passed matches its length; poll only writes `revents`.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if rc >= 0 {
            break;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
    if fds[1].revents != 0 {
        return Ok(Readiness::ShutdownStarted);
    }
    if fds[0].revents & libc::POLLNVAL != 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    Ok(Readiness::Listener)
}
