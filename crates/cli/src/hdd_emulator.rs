//! `ssdcache hdd-emulator`: a file served over NBD at the speed of a hard drive (the model in
//! `ssdcache_devsim::hdd`), so benchmarks and demos have a slow disk to cache.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use ssdcache_device::BlockDevice;
use ssdcache_devsim::hdd::{HddDevice, HddParams};
use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};

use crate::devices::open_device;
use crate::size::{human, parse_size};

#[derive(Args, Clone)]
pub struct HddModelArgs {
    /// Spindle speed
    #[arg(long, default_value_t = 7200.0, value_name = "RPM")]
    pub rpm: f64,
    /// Seek time constant part (track-to-track settle), ms
    #[arg(long, default_value_t = 1.0, value_name = "MS")]
    pub seek_settle_ms: f64,
    /// Seek time per full stroke, linear part, ms
    #[arg(long, default_value_t = 2.5, value_name = "MS")]
    pub seek_linear_ms: f64,
    /// Seek time per full stroke, square-root part, ms
    #[arg(long, default_value_t = 12.5, value_name = "MS")]
    pub seek_sqrt_ms: f64,
    /// Transfer rate at the start (outer edge) of the disk, MB/s
    #[arg(long, default_value_t = 250.0, value_name = "MB/S")]
    pub outer_mb_s: f64,
    /// Transfer rate at the end (inner edge) of the disk, MB/s
    #[arg(long, default_value_t = 125.0, value_name = "MB/S")]
    pub inner_mb_s: f64,
    /// Per-command overhead, ms
    #[arg(long, default_value_t = 0.1, value_name = "MS")]
    pub overhead_ms: f64,
    /// Requests the drive reorders (NCQ); 1 = arrival order
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub queue_depth: usize,
    /// Volatile write cache size (0 = off; FLUSH drains it)
    #[arg(long, default_value = "0", value_parser = parse_size, value_name = "SIZE")]
    pub write_cache: u64,
    /// Modelled disk capacity: the file occupies its start [default: the file's size, so the
    /// file spans the whole stroke]
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub capacity: Option<u64>,
}

impl HddModelArgs {
    pub fn params(&self, file_size: u64) -> HddParams {
        HddParams {
            capacity: self.capacity.unwrap_or(file_size).max(file_size),
            rpm: self.rpm,
            seek_settle_ms: self.seek_settle_ms,
            seek_linear_ms: self.seek_linear_ms,
            seek_sqrt_ms: self.seek_sqrt_ms,
            outer_rate: self.outer_mb_s * 1e6,
            inner_rate: self.inner_mb_s * 1e6,
            command_overhead_ms: self.overhead_ms,
            queue_depth: self.queue_depth.max(1),
            write_cache: self.write_cache,
            ..HddParams::default()
        }
    }

    fn check(&self) -> Result<()> {
        let positive = [self.rpm, self.outer_mb_s, self.inner_mb_s];
        let non_negative = [
            self.seek_settle_ms,
            self.seek_linear_ms,
            self.seek_sqrt_ms,
            self.overhead_ms,
        ];
        if positive.iter().any(|v| !(v.is_finite() && *v > 0.0))
            || non_negative.iter().any(|v| !(v.is_finite() && *v >= 0.0))
        {
            anyhow::bail!(
                "HDD model parameters must be finite; rpm and rates above zero, times zero or more"
            );
        }
        Ok(())
    }
}

#[derive(Args)]
pub struct HddEmulatorArgs {
    /// File (or device) holding the emulated disk's data
    #[arg(long, value_name = "PATH")]
    file: PathBuf,
    /// Unix socket to serve NBD on (mode 0600); export name "hdd"
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    #[command(flatten)]
    model: HddModelArgs,
}

/// Serves any BlockDevice as an NBD export.
pub struct DeviceExport(pub Arc<dyn BlockDevice>);

fn io_errno(e: std::io::Error) -> Errno {
    tracing::warn!("I/O error: {e}");
    Errno::Io
}

impl Export for DeviceExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.0.read_at(buf, offset).map_err(io_errno)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        self.0.write_at(data, offset).map_err(io_errno)?;
        if fua {
            self.0.flush().map_err(io_errno)?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        self.0.flush().map_err(io_errno)
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), Errno> {
        self.0.discard(offset, length).map(|_| ()).map_err(io_errno)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        _fua: bool,
        _may_trim: bool,
    ) -> Result<(), Errno> {
        self.0.write_zeroes(offset, length).map_err(io_errno)
    }
    fn allocation(&self, offset: u64, length: u64) -> Result<Vec<ssdcache_nbd::Run>, Errno> {
        self.0.allocation(offset, length, 256).map_err(io_errno)
    }
    fn cache(&self, _offset: u64, _length: u64) -> Result<(), Errno> {
        Ok(())
    }
}

pub fn run(args: HddEmulatorArgs) -> Result<()> {
    args.model.check().map_err(crate::as_usage_error)?;
    let file = open_device(&args.file, "emulated disk file", true, true)?;
    let params = args.model.params(file.size());
    let disk: Arc<dyn BlockDevice> = Arc::new(HddDevice::new(file.clone(), params));
    let info = ExportInfo {
        name: "hdd".into(),
        description: format!(
            "HDD model ({} rpm) over {}",
            params.rpm,
            args.file.display()
        ),
        size: disk.size(),
        flags: transmission_flags(false),
        min_block: 4096,
        preferred_block: 65536,
        max_block: 32 << 20,
    };
    // Enough workers per connection that the model, not the server, holds the queue.
    // Every request of this export takes the slow lane: one fast worker reads them all.
    let config = ServerConfig {
        threads_per_connection: (params.queue_depth * 2).clamp(8, 128),
        fast_threads_per_connection: 1,
        ..ServerConfig::default()
    };
    let server = Arc::new(
        Server::new(
            vec![ServerExport {
                info,
                backend: Arc::new(DeviceExport(disk)),
            }],
            config,
        )
        .context("cannot start the NBD server")?,
    );
    let listener = crate::control::bind(&args.socket)?;
    tracing::info!(
        "HDD model serving {} ({}) on unix:{}: {} rpm, seek {}+{}x+{}sqrt(x) ms, {}-{} MB/s, queue {}, write cache {}",
        args.file.display(),
        human(file.size()),
        args.socket.display(),
        params.rpm,
        params.seek_settle_ms,
        params.seek_linear_ms,
        params.seek_sqrt_ms,
        params.outer_rate / 1e6,
        params.inner_rate / 1e6,
        params.queue_depth,
        human(params.write_cache)
    );
    crate::signals::watch_signals(server.clone())?;
    server.serve_unix(listener).context("NBD server failed")?;
    server.wait_idle();
    let _ = std::fs::remove_file(&args.socket);
    tracing::info!("stopped");
    Ok(())
}
