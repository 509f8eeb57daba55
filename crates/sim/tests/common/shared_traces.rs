//! Where the shared traces are, and every shared trace the miss-ratio measurements cover with
//! the format it is read as (also used by `tests/parity`, `examples/mrc_accuracy.rs` and
//! `examples/parity_table.rs`, which include this file).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use ssdcache_sim::trace::Format;

/// The environment variable naming the shared traces folder (CI: `shared/traces` beside the
/// checkout, set by `.ci/run`). Unset, the tests that need it are ignored (see `build.rs`).
pub const TRACES_VAR: &str = "SSDCACHE_TRACES";

/// The folder `SSDCACHE_TRACES` names, a relative path taken from the workspace root (where
/// `scripts/test` runs); `None` when it is not set.
pub fn traces_dir() -> Option<PathBuf> {
    let dir = std::env::var_os(TRACES_VAR).filter(|dir| !dir.is_empty())?;
    Some(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(dir))
}

/// `relative` in the shared traces folder; panics, failing the test, when `SSDCACHE_TRACES`
/// is not set or the file is missing.
pub fn shared_trace(relative: &str) -> PathBuf {
    let Some(dir) = traces_dir() else {
        panic!(
            "{TRACES_VAR} is not set: this test reads the shared traces; \
             set it to their folder (CI: shared/traces beside the checkout)"
        )
    };
    let path = dir.join(relative);
    assert!(
        path.is_file(),
        "shared trace {} is missing ({TRACES_VAR}={})",
        path.display(),
        dir.display()
    );
    path
}

/// Paths relative to the shared traces directory. The CloudPhysics trace is read once, from
/// its csv (the vscsi file gives the same block sequence; docs/traces.md).
pub const SHARED_TRACES: &[(&str, Format)] = &[
    ("arc/P3.lis.zst", Format::Arc),
    ("arc/P6.lis.zst", Format::Arc),
    ("cloudphysics/cloudPhysicsIO.csv", Format::VscsiCsv),
    ("tencent_cbs/cloud_storage-sample.bz2", Format::SniaTencent),
    ("msr/msr-cambridge1-sample.csv", Format::Msr),
    ("systor17/systor17-traces-sample.csv.gz", Format::Systor),
    ("systor17/systor17-additional-sample.csv.gz", Format::Systor),
    ("mqsim/tpcc-small.trace", Format::Disksim),
    ("mqsim/wsrch-small.trace", Format::Disksim),
    ("lirs/2_pools.trace.gz", Format::Lirs),
    ("lirs/backf.trace.gz", Format::Lirs),
    ("lirs/cpp.trace.gz", Format::Lirs),
    ("lirs/cs.trace.gz", Format::Lirs),
    ("lirs/gli.trace.gz", Format::Lirs),
    ("lirs/loop.trace.gz", Format::Lirs),
    ("lirs/multi1.trace.gz", Format::Lirs),
    ("lirs/multi2.trace.gz", Format::Lirs),
    ("lirs/multi3.trace.gz", Format::Lirs),
    ("lirs/ps.trace.gz", Format::Lirs),
    ("lirs/scan.trace.gz", Format::Lirs),
    ("lirs/sprite.trace.gz", Format::Lirs),
    ("lirs/zigzag.trace.gz", Format::Lirs),
];
