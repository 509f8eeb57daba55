//! Every shared trace the miss-ratio measurements cover, with the format it is read as (also
//! used by `examples/mrc_accuracy.rs`, which includes this file).

use ssdcache_sim::trace::Format;

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
