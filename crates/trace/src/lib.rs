//! The writing side of ssdcache traces: what `ssdcache serve --record-trace` links to record
//! the clients' requests. The reading side (every trace format, decompression), the simulator
//! and the plots are in `ssdcache-sim`, which the daemon does not need; both share [`Op`].

pub mod record;

/// What a request does to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Op {
    Read,
    Write,
}
