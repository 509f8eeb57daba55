//! NBD (Network Block Device) server side for ssdcache.
//!
//! # Why this crate exists
//!
//! No Rust crate implements the NBD *server* side well enough: the `nbd`
//! crate lacks `NBD_OPT_GO` (so no block-size negotiation, which O_DIRECT
//! backends need), and `tokio-nbd` panics on structured-reply negotiation.
//! The protocol subset a kernel client needs is small, so it is written here
//! against `doc/proto.md` of the NetworkBlockDevice/nbd repository.
//!
//! # Layout
//!
//! * [`proto`]: wire constants, request parsing, reply encoding and request
//!   validation. Pure functions.
//! * [`handshake`]: a sans-I/O fixed-newstyle handshake machine
//!   (`EXPORT_NAME`, `ABORT`, `LIST`, `INFO`, `GO`, `STRUCTURED_REPLY`,
//!   `LIST_META_CONTEXT` and `SET_META_CONTEXT` with the one context
//!   `base:allocation`; everything else is answered `NBD_REP_ERR_UNSUP`). With
//!   structured replies a READ is answered by one `OFFSET_DATA` chunk (or an
//!   error chunk) and `NBD_CMD_BLOCK_STATUS` by one `BLOCK_STATUS` chunk;
//!   other commands keep simple replies, as the spec allows.
//! * [`tls`]: `NBD_OPT_STARTTLS` through rustls: a pump thread per TLS connection
//!   between the client's socket and a socket pair the rest of the server uses.
//! * [`Server`]: threads and sockets around the two.
//!
//! # Thread model
//!
//! Each connection has two lanes of workers. Up to `fast_threads_per_connection` fast
//! workers take turns reading: lock the reader, read one request header (and a write's
//! payload, into a 4096-aligned buffer leased from the server's pool), unlock; validate; ask
//! the [`Export`] where the request runs ([`Export::lane`]). A fast request (one the export
//! expects to serve without its slow device, e.g. a cache hit) the worker runs itself and
//! answers, in the style of nbdkit's "parallel" model, with no hand-off. A slow one goes into
//! the connection's slow queue (at most [`SLOW_LANE_QUEUE`] requests), and the worker reads
//! on; up to `threads_per_connection` slow workers, started on demand, run the queue. So a
//! fast request never waits for a worker blocked on the slow device, and requests keep being
//! read while that device is busy. Replies leave in completion order (matched by cookie), one
//! whole reply per `writev` under the writer lock. Malformed requests are answered with the
//! spec's error when the stream can stay in sync; a bad magic or a truncated request closes
//! only that connection.
//!
//! # Limits
//!
//! [`ServerConfig`] bounds everything a client can make grow: connections,
//! request-buffer memory per connection and in total (a buffer pool that
//! keeps small buffers for reuse and frees large ones after their request),
//! the time a started request may take to arrive and a reply to be written,
//! an optional idle timeout; TRIM, WRITE_ZEROES and CACHE reach the backend
//! in pieces of [`DATALESS_CHUNK_BYTES`]. [`Server::shutdown`] stops
//! accepting and reading and lets requests already read finish and be
//! answered; [`Server::force_close`] then closes every client socket, so only
//! requests inside a backend call ([`Server::requests_in_backend`]) can keep
//! a connection open.

mod buffers;
pub mod client;
mod connection;
pub mod handshake;
mod outbox;
pub mod proto;
mod server;
pub mod tls;

pub use buffers::{KEEP_BYTES, KEEP_MAX_BUFFER};
pub use connection::ConnectionError;
pub use handshake::{CloseReason, ExportInfo, Handshake, HandshakeOutcome, TlsPolicy};
pub use proto::{transmission_flags, Command, Errno, ProtocolError, RequestHeader};
pub use server::{
    BatchedRead, Export, Lane, NbdStream, RingReads, RingStart, Run, Server, ServerConfig,
    ServerError, ServerExport, DATALESS_CHUNK_BYTES, MAX_READ_BATCH, SLOW_LANE_QUEUE,
};
pub use tls::{ClientTls, TlsConfig};
