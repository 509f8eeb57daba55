//! Devices that stand in for real ones: in memory (one lock, or striped for benchmarks), crash-simulating and fault-injecting,
//! recording, gated, slow to write, and the hard-drive timing model. Tests, the crash
//! simulator and the benchmarks use them; of the daemon, only `serve --emulate-hdd` and
//! `hdd-emulator` do (the HDD model). The production device code (files and block devices, the [`BlockDevice`]
//! trait) lives in `ssdcache-device`, which knows nothing of this crate.
//!
//! [`BlockDevice`]: ssdcache_device::BlockDevice

mod crash;
mod gate;
pub mod hdd;
mod memory;
mod recording;
mod slow;
mod striped;

pub use crash::{CrashClock, CrashDevice, CrashState, Keep, OpKind, OpRecord};
pub use gate::{GateDevice, GATE_LIMIT};
pub use memory::MemDevice;
pub use recording::{Op, RecordingDevice, SharedOpLog};
pub use slow::SlowWriteDevice;
pub use striped::StripedMemDevice;
