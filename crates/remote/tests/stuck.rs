//! A server that keeps the connection open but never answers a write: the device never drops
//! such a connection for a late reply (the write could land after newer data sent on the next
//! one), and past `RemoteConfig::stuck_limit` it halts: the write fails, nothing is sent again,
//! and later requests fail at once saying why.

use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;
use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

struct StuckOnWrites;

impl Export for StuckOnWrites {
    fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), Errno> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), Errno> {
        thread::sleep(Duration::from_secs(8));
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
}

#[test]
fn a_write_never_answered_halts_the_device_instead_of_being_sent_again() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let info = ExportInfo {
        name: "disk".into(),
        description: "stuck".into(),
        size: 1 << 20,
        flags: transmission_flags(false),
        min_block: 4096,
        preferred_block: 4096,
        max_block: 1 << 20,
    };
    let server = Server::new(
        vec![ServerExport {
            info,
            backend: Arc::new(StuckOnWrites),
        }],
        ServerConfig::default(),
    )
    .unwrap();
    let listener = UnixListener::bind(&socket).unwrap();
    let serving = server.clone();
    let serve_thread = thread::spawn(move || serving.serve_unix(listener));
    let uri = NbdUri::parse(&format!("nbd+unix:///disk?socket={}", socket.display())).unwrap();
    let config = RemoteConfig {
        io_timeout: Duration::from_millis(500),
        stuck_limit: Duration::from_secs(2),
        retry_timeout: Duration::from_secs(5),
        ..RemoteConfig::default()
    };
    let dev = NbdDevice::open(uri, config).unwrap();
    let started = Instant::now();
    let e = dev.write_at(&[7u8; 4096], 0).expect_err("never answered");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    // Sent once: it may land, so it is not reported as never having reached the device.
    assert!(!ssdcache_device::is_unreached(&e), "{e}");
    let status = dev.status();
    assert!(!status.connected && status.reconnections == 0, "{status:?}");
    let again = Instant::now();
    let e = dev.read_at(&mut [0u8; 4096], 0).expect_err("halted");
    assert!(e.to_string().contains("halted"), "{e}");
    assert!(again.elapsed() < Duration::from_millis(500));
    drop(dev);
    server.shutdown();
    server.force_close();
    let _ = serve_thread.join();
}
