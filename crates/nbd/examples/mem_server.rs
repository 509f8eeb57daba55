//! Serves a RAM-backed export, for trying the server with real clients:
//!
//! ```text
//! cargo run -p ssdcache-nbd --example mem_server -- /tmp/nbd.sock 64
//! nbdinfo 'nbd+unix:///mem?socket=/tmp/nbd.sock'
//! qemu-io -f raw 'nbd+unix:///mem?socket=/tmp/nbd.sock' -c 'write -P 7 0 1M' -c 'read -P 7 0 1M'
//! ```
//!
//! Arguments: socket path, size in MiB (default 64). Stops on stdin EOF.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};

use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};

struct RamDisk(Mutex<Vec<u8>>);

impl RamDisk {
    fn range(&self, offset: u64, length: usize) -> std::ops::Range<usize> {
        let start = offset as usize;
        start..start + length
    }
}

impl Export for RamDisk {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let data = self.0.lock().map_err(|_| Errno::Io)?;
        buf.copy_from_slice(&data[self.range(offset, buf.len())]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        let mut disk = self.0.lock().map_err(|_| Errno::Io)?;
        disk[self.range(offset, data.len())].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), Errno> {
        self.write_zeroes(offset, length, false, true)
    }
    fn write_zeroes(&self, offset: u64, length: u64, _: bool, _: bool) -> Result<(), Errno> {
        let mut disk = self.0.lock().map_err(|_| Errno::Io)?;
        disk[self.range(offset, length as usize)].fill(0);
        Ok(())
    }
    fn cache(&self, _offset: u64, _length: u64) -> Result<(), Errno> {
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: mem_server SOCKET [SIZE_MIB]")?;
    let size_mib: u64 = args.next().map_or(Ok(64), |s| s.parse())?;
    let size = size_mib << 20;
    let info = ExportInfo {
        name: "mem".into(),
        description: format!("{size_mib} MiB RAM disk"),
        size,
        flags: transmission_flags(false),
        min_block: 4096,
        preferred_block: 4096,
        max_block: 32 << 20,
    };
    let backend = Arc::new(RamDisk(Mutex::new(vec![0; usize::try_from(size)?])));
    let server = Server::new(
        vec![ServerExport { info, backend }],
        ServerConfig::default(),
    )?;
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    let stopper = server.clone();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        stopper.shutdown();
    });
    server.serve_unix(listener)?;
    Ok(())
}
