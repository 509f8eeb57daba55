//! The optional TOML configuration of `serve`. Every key is optional; command-line flags win.
//!
//! ```toml
//! cache = "/dev/nvme0n1p2"          # cache device or file
//! socket = "/run/ssdcache/sdb.sock" # Unix socket for NBD clients (mode 0600)
//! listen = "127.0.0.1:10809"        # also serve NBD over TCP (no TLS yet: loopback only)
//! control = "/run/ssdcache/ctl.sock" # control socket for stats/info
//! threads = 32                       # worker threads per NBD connection
//! read_only = false                  # export every volume read-only
//! writeback_high = 50                # write-back: clean every dirty line above 50% dirty lines
//! writeback_low = 40                 # ... down to 40%
//! writeback_max_age = 30             # write back dirty data older than 30 s when possible
//!
//! [backing]                          # where a volume's backing device is now, if it moved
//! sdb = "/dev/disk/by-id/ata-WDC_WD40EFRX-1234"
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub cache: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub control: Option<PathBuf>,
    pub threads: Option<usize>,
    pub read_only: Option<bool>,
    pub writeback_high: Option<f64>,
    pub writeback_low: Option<f64>,
    pub writeback_max_age: Option<u64>,
    #[serde(default)]
    pub backing: BTreeMap<String, PathBuf>,
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
            [backing]
            sdb = "/dev/sdb"
        "#;
        let c: FileConfig = toml::from_str(text).expect("example parses");
        assert_eq!(c.backing.get("sdb"), Some(&PathBuf::from("/dev/sdb")));
        assert!(toml::from_str::<FileConfig>("cahce = \"/x\"").is_err());
    }
}
