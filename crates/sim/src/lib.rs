//! The trace-driven side of ssdcache: readers for public block-trace formats and for traces
//! `ssdcache serve --record-trace` writes, a simulator that drives the engine's own
//! replacement policies and admission code, miss-ratio curves (exact LRU and SHARDS sampling)
//! and the sizing advisor.

pub mod advise;
pub mod mrc;
pub mod plot;
pub mod simulate;
pub mod trace;
