//! The engine's threads, locks, condition variables and atomics, in one place: std's, or with
//! the `shuttle` feature those of the shuttle crate, whose scheduler runs a test's threads one
//! at a time in a random order reproducible from a seed (`tests/crash_concurrent.rs`). Only
//! the concurrent crash test builds the engine with that feature; everything else uses std.

#[cfg(not(feature = "shuttle"))]
pub(crate) use std::{
    sync::{atomic, Condvar, Mutex, MutexGuard, RwLock},
    thread,
};

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::{
    sync::{atomic, Condvar, Mutex, MutexGuard, RwLock},
    thread,
};

/// The map's lock. Every hit takes it to read, and a reader count is one word every reader
/// writes: with one `RwLock` that cache line moves between the CPUs of all concurrent hits.
/// crossbeam's `ShardedLock` gives each thread one of eight cache-padded shards to read-lock
/// (a writer locks all eight, in order), so hits on different threads share no written line;
/// writers, which also run the policy and bookkeeping, pay eight uncontended lock operations.
/// Same semantics as `RwLock`, poisoning included. Shuttle has no sharded lock: its builds
/// keep the plain one (the interleavings it explores are the same).
#[cfg(not(feature = "shuttle"))]
pub(crate) use crossbeam_utils::sync::{
    ShardedLock as MapLock, ShardedLockReadGuard as MapReadGuard,
    ShardedLockWriteGuard as MapWriteGuard,
};
#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::{
    RwLock as MapLock, RwLockReadGuard as MapReadGuard, RwLockWriteGuard as MapWriteGuard,
};
