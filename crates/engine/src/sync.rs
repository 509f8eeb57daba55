//! The engine's threads, locks, condition variables and atomics, in one place: std's, or with
//! the `shuttle` feature those of the shuttle crate, whose scheduler runs a test's threads one
//! at a time in a random order reproducible from a seed (`tests/crash_concurrent.rs`). Only
//! the concurrent crash test builds the engine with that feature; everything else uses std.

#[cfg(not(feature = "shuttle"))]
pub(crate) use std::{
    sync::{atomic, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard},
    thread,
};

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::{
    sync::{atomic, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard},
    thread,
};
