//! Samples another process's memory from /proc/PID/status while the load runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{Context, Result};

/// How often VmRSS is sampled: often enough to catch a peak that lasts a fraction of a
/// second; VmHWM (the kernel's own peak) catches the rest.
const INTERVAL: Duration = Duration::from_millis(100);

/// What the samples showed, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryReport {
    pub first_rss: u64,
    pub peak_rss: u64,
    pub last_rss: u64,
    /// The kernel's high-water mark of the resident set, over the process's whole life.
    pub hwm: u64,
    pub samples: u64,
}

/// VmRSS and VmHWM of `pid`, in bytes.
pub fn read_status(pid: u32) -> Result<(u64, u64)> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    let field = |name: &str| -> Result<u64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("{path} has no {name}"))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("bad {name} line in {path}: {line:?}"))?;
        Ok(kib * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// A sampling thread; [`MemoryWatch::finish`] stops it and returns the report.
pub struct MemoryWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<MemoryReport>,
}

impl MemoryWatch {
    /// Fails if the process cannot be read at all; later failures (the process died) just
    /// end the sampling.
    pub fn start(pid: u32) -> Result<MemoryWatch> {
        let (rss, hwm) = read_status(pid)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut report = MemoryReport {
                first_rss: rss,
                peak_rss: rss,
                last_rss: rss,
                hwm,
                samples: 1,
            };
            while !stop_flag.load(Ordering::Relaxed) {
                thread::sleep(INTERVAL);
                let Ok((rss, hwm)) = read_status(pid) else {
                    break;
                };
                report.peak_rss = report.peak_rss.max(rss);
                report.last_rss = rss;
                report.hwm = report.hwm.max(hwm);
                report.samples += 1;
            }
            report
        });
        Ok(MemoryWatch { stop, thread })
    }

    pub fn finish(self) -> MemoryReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}
