//! Block I/O trace readers. Every format becomes one stream of [`Request`]s in bytes, so the
//! simulator, `mrc` and `advise` never see a format's units.

/// What a request does to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Op {
    Read,
    Write,
}

/// One block request of a trace, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Time since the trace's first request, in nanoseconds (0 when the format has no time).
    pub time_ns: u64,
    /// Which disk or volume of a multi-disk trace (0 when the format has one).
    pub volume: u32,
    pub op: Op,
    pub offset: u64,
    pub len: u64,
}
