//! Review 49: review 48's zombie write, as a TRIM. `run` counts only WRITE and WRITE_ZEROES
//! in `writes_in_flight`, so a TRIM with a late reply still makes the device drop the
//! connection and re-send it; the first copy, still running on the server, discards the range
//! after a newer write of it was acknowledged and flushed.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use ssdcache_device::BlockDevice;
use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

const SIZE: usize = 1 << 20;
const BLOCK: usize = 4096;

struct StallTrim {
    data: Mutex<Vec<u8>>,
    stalled: AtomicBool,
}

impl Export for StallTrim {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let o = offset as usize;
        buf.copy_from_slice(&self.data.lock().unwrap()[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        let o = offset as usize;
        self.data.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _: bool) -> Result<(), Errno> {
        if !self.stalled.swap(true, Ordering::SeqCst) {
            thread::sleep(Duration::from_secs(3));
        }
        // A hole punched: reads as zeroes.
        let o = offset as usize;
        self.data.lock().unwrap()[o..o + length as usize].fill(0);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, length: u64, _: bool, _: bool) -> Result<(), Errno> {
        let o = offset as usize;
        self.data.lock().unwrap()[o..o + length as usize].fill(0);
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
}

#[test]
fn review49_a_trim_given_up_on_discards_a_newer_acknowledged_and_flushed_write() {
    let dir = tempfile::tempdir().unwrap();
    let socket: PathBuf = dir.path().join("s.sock");
    let store = Arc::new(StallTrim {
        data: Mutex::new(vec![0x11; SIZE]),
        stalled: AtomicBool::new(false),
    });
    let info = ExportInfo {
        name: "disk".into(),
        description: "stall-trim".into(),
        size: SIZE as u64,
        flags: transmission_flags(false),
        min_block: BLOCK as u32,
        preferred_block: BLOCK as u32,
        max_block: 1 << 20,
    };
    let backend: Arc<dyn Export> = store.clone();
    let server = Server::new(
        vec![ServerExport { info, backend }],
        ServerConfig::default(),
    )
    .unwrap();
    let listener = UnixListener::bind(&socket).unwrap();
    let serving = server.clone();
    let t = thread::spawn(move || {
        let _ = serving.serve_unix(listener);
    });
    let uri = NbdUri::parse(&format!("nbd+unix:///disk?socket={}", socket.display())).unwrap();
    let config = RemoteConfig {
        io_timeout: Duration::from_secs(1),
        connect_timeout: Duration::from_secs(2),
        retry_timeout: Duration::from_secs(20),
        ..RemoteConfig::default()
    };
    let dev = NbdDevice::open(uri, config).unwrap();
    assert!(dev.discard(0, BLOCK as u64).expect("trim"));
    dev.flush().expect("flush");
    dev.write_at(&vec![0xB2; BLOCK], 0).expect("newer write");
    dev.flush().expect("flush");
    thread::sleep(Duration::from_secs(4));
    let on_store = store.data.lock().unwrap()[0];
    drop(dev);
    server.shutdown();
    server.force_close();
    let _ = t.join();
    assert_eq!(
        on_store, 0xB2,
        "the old TRIM of the dropped connection discarded the newer, flushed write"
    );
}
