//! The optional TOML configuration of `serve`. Every key is optional; command-line flags win.
//!
//! ```toml
//! cache = "/dev/nvme0n1p2"          # cache device or file
//! socket = "/run/ssdcache/sdb.sock" # Unix socket for NBD clients (mode 0600)
//! listen = "127.0.0.1:10809"        # also serve NBD over TCP (no TLS yet: loopback only)
//! control = "/run/ssdcache/ctl.sock" # control socket for stats/info
//! metrics = "127.0.0.1:9871"       # Prometheus metrics at http://ADDR/metrics
//! ssd_tbw = 600                      # the cache device's endurance rating, TB written
//! threads = 32                       # slow-lane worker threads per NBD connection
//! read_only = false                  # export every volume read-only
//! writeback_high = 50                # write-back: clean every dirty line above 50% dirty lines
//! writeback_low = 40                 # ... down to 40%
//! writeback_max_age = 30             # write back dirty data older than 30 s when possible
//! dirty_limit = 80                   # write-back: at most 80% of the lines dirty
//! checksum_memory = "64MiB"          # RAM for data checksums ("all": every page, 0.1%)
//! policy = "lirs-lean"               # the cache's replacement policy (one per cache)
//! record_trace = "/var/tmp/sdb.trace" # record the clients' requests (see docs/operations.md)
//! record_sample = 0.01               # ... of 1% of the 1 MiB regions
//! record_max_size = "1GiB"           # ... stopping when the file reaches this size
//! record_trace_force = false         # replace an existing trace file
//! max_connections = 128              # NBD connections open at once
//! request_memory = "512MiB"          # all NBD request buffers together
//! connection_memory = "64MiB"        # the request buffers of one connection
//! io_timeout = 30                    # seconds for a started request to arrive, a reply to leave
//! idle_timeout = 0                   # close connections idle this long; 0 = never
//! shutdown_timeout = 30              # seconds SIGTERM waits for requests in flight
//! backing_wait = 30                  # seconds to wait for a missing backing device
//!
//! [backing]                          # where a volume's backing device is now, if it moved
//! sdb = "/dev/disk/by-id/ata-WDC_WD40EFRX-1234"
//!
//! [volume.sdb]                       # settings of volume sdb
//! admission = "2-hit"                # "always", or "N-hit": cache a line on its N-th miss
//! sequential_cutoff = "4MiB"         # streams bypass the cache after this much; 0 = never
//! dirty_limit = 25                   # percent of the cache's lines it may hold dirty
//! occupancy_limit = 40               # percent of the cache's lines it may hold at all
//! ```
//!
//! `policy`, `admission` and `sequential_cutoff` are written to the cache's superblock when
//! `serve` starts, so they stay in force after the key is removed from the file; the two
//! limits are not kept in the cache (a volume the file does not limit has no limit of its
//! own). A reload (SIGHUP, `systemctl reload`) applies all four per-volume keys at once. The
//! replacement policy orders the eviction of one pool of cache lines shared by every volume,
//! so it is one per cache: a `policy` key under `[volume.NAME]` is accepted only when the
//! cache has that one volume, and is the same setting as the top-level key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::size::parse_size;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub cache: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub control: Option<PathBuf>,
    pub metrics: Option<String>,
    pub tls: Option<crate::serve::TlsMode>,
    pub tls_certificates: Option<PathBuf>,
    pub tls_verify_peer: Option<bool>,
    pub ssd_tbw: Option<f64>,
    pub threads: Option<usize>,
    pub read_only: Option<bool>,
    pub writeback_high: Option<f64>,
    pub writeback_low: Option<f64>,
    pub writeback_max_age: Option<u64>,
    pub dirty_limit: Option<f64>,
    pub checksum_memory: Option<SizeValue>,
    pub record_trace: Option<PathBuf>,
    pub record_sample: Option<f64>,
    pub record_max_size: Option<SizeValue>,
    pub record_trace_force: Option<bool>,
    pub max_connections: Option<usize>,
    pub request_memory: Option<SizeValue>,
    pub connection_memory: Option<SizeValue>,
    pub io_timeout: Option<u64>,
    pub idle_timeout: Option<u64>,
    pub shutdown_timeout: Option<u64>,
    pub backing_wait: Option<u64>,
    #[serde(default)]
    pub backing: BTreeMap<String, PathBuf>,
    /// The cache's replacement policy.
    pub policy: Option<String>,
    /// Settings of each volume, by volume name.
    #[serde(default)]
    pub volume: BTreeMap<String, VolumeConfig>,
}

/// `[volume.NAME]`: the settings of one volume.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    pub admission: Option<String>,
    pub sequential_cutoff: Option<SizeValue>,
    /// Percent of the cache's lines this volume may hold dirty (`Volume::set_dirty_cap`);
    /// applied at each start, not kept in the superblock.
    pub dirty_limit: Option<f64>,
    /// Percent of the cache's lines this volume may hold, clean or dirty
    /// (`Volume::set_occupancy_cap`); like `dirty_limit`, not kept in the superblock.
    pub occupancy_limit: Option<f64>,
    /// Only for a cache of one volume (see the module comment).
    pub policy: Option<String>,
}

/// A size in the config file: a number of bytes or a string such as "1GiB".
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    /// `checksum_memory`: a size, or "all".
    pub fn checksum_memory(&self) -> Result<u64> {
        match self {
            SizeValue::Text(s) if s.eq_ignore_ascii_case("all") => Ok(u64::MAX),
            _ => self.bytes("checksum_memory"),
        }
    }

    pub fn bytes(&self, key: &str) -> Result<u64> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => {
                parse_size(s).map_err(|e| anyhow::anyhow!("config key {key}: {e}"))
            }
        }
    }
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| {
            format!(
                "config file {} is not valid (see docs/operations.md for the keys)",
                path.display()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_documented_example_and_rejects_typos() {
        let text = r#"
            cache = "/dev/nvme0n1p2"
            socket = "/run/ssdcache/sdb.sock"
            listen = "127.0.0.1:10809"
            threads = 8
            read_only = false
            record_trace = "/var/tmp/sdb.trace"
            record_sample = 0.01
            record_max_size = "1GiB"
            max_connections = 64
            request_memory = "1GiB"
            connection_memory = 67108864
            io_timeout = 10
            idle_timeout = 0
            shutdown_timeout = 5
            [backing]
            sdb = "/dev/sdb"
        "#;
        let c: FileConfig = toml::from_str(text).expect("example parses");
        assert_eq!(c.backing.get("sdb"), Some(&PathBuf::from("/dev/sdb")));
        assert_eq!(c.record_sample, Some(0.01));
        let max = c.record_max_size.expect("record_max_size parses");
        assert_eq!(max.bytes("record_max_size").unwrap(), 1 << 30);
        assert_eq!(c.max_connections, Some(64));
        let memory = c.request_memory.expect("request_memory parses");
        assert_eq!(memory.bytes("request_memory").unwrap(), 1 << 30);
        assert_eq!((c.io_timeout, c.shutdown_timeout), (Some(10), Some(5)));
        let n: FileConfig = toml::from_str("record_max_size = 65536").expect("a byte count");
        assert_eq!(n.record_max_size.unwrap().bytes("x").unwrap(), 65536);
        assert!(toml::from_str::<FileConfig>("cahce = \"/x\"").is_err());
        assert!(toml::from_str::<FileConfig>("[volume.sdb]\nadmision = \"2-hit\"").is_err());
    }
}
