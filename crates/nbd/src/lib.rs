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
//!   (`EXPORT_NAME`, `ABORT`, `LIST`, `INFO`, `GO`; everything else is
//!   answered `NBD_REP_ERR_UNSUP`). Only simple replies are offered.
//! * [`Server`]: threads and sockets around the two.
//!
//! # Thread model
//!
//! Each connection gets `threads_per_connection` workers in the style of
//! nbdkit's "parallel" model: every worker loops { lock the reader, read one
//! request header and write payload into its own 4096-aligned reusable
//! buffer, unlock; validate; call the [`Export`]; lock the writer, send the
//! reply in one `writev`, unlock }. There are no queues or hand-offs between
//! threads and no allocation per request; many requests are in flight per
//! connection and replies leave in completion order (matched by cookie).
//! Malformed requests are answered with the spec's error when the stream can
//! stay in sync; a bad magic or a truncated request closes only that
//! connection. [`Server::shutdown`] stops accepting and reading, lets
//! requests already read finish and be answered, then closes connections.

pub mod client;
mod connection;
pub mod handshake;
pub mod proto;
mod server;

pub use connection::ConnectionError;
pub use handshake::{CloseReason, ExportInfo, Handshake, HandshakeOutcome};
pub use proto::{transmission_flags, Command, Errno, ProtocolError, RequestHeader};
pub use server::{Export, NbdStream, Server, ServerConfig, ServerError, ServerExport};
