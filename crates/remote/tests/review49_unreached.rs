//! Review 49: a write that WAS sent (and landed on the server) is reported with the
//! `unreached` marker when the connection drops and the export stays unreachable for
//! `retry_timeout`: `run` sets `first_drop` after the drop, but `wait_up` gives up first
//! (its deadline is `down_since + retry_timeout`, and `down_since <= first_drop`) and returns
//! `unreachable(..)`, which carries the marker. The engine's `Backing` then does not count
//! the write, so no later commit flushes it although it landed.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;
use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

const SIZE: usize = 1 << 20;
const BLOCK: usize = 4096;

struct LandThenStall {
    data: Mutex<Vec<u8>>,
    landed: AtomicBool,
}

impl Export for LandThenStall {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let o = offset as usize;
        buf.copy_from_slice(&self.data.lock().unwrap()[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        let o = offset as usize;
        self.data.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        if data[0] == 0xA1 {
            self.landed.store(true, Ordering::SeqCst);
            // The reply is held back until the server is gone.
            thread::sleep(Duration::from_secs(2));
        }
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
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
fn review49_a_sent_write_that_landed_is_not_reported_unreached() {
    let dir = tempfile::tempdir().unwrap();
    let socket: PathBuf = dir.path().join("s.sock");
    let store = Arc::new(LandThenStall {
        data: Mutex::new(vec![0; SIZE]),
        landed: AtomicBool::new(false),
    });
    let info = ExportInfo {
        name: "disk".into(),
        description: "land".into(),
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
        connect_timeout: Duration::from_secs(1),
        retry_timeout: Duration::from_secs(3),
        ..RemoteConfig::default()
    };
    let dev = Arc::new(NbdDevice::open(uri, config).unwrap());
    let writer = {
        let dev = Arc::clone(&dev);
        thread::spawn(move || dev.write_at(&vec![0xA1; BLOCK], 0))
    };
    let start = Instant::now();
    while !store.landed.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the write never reached the server"
        );
        thread::sleep(Duration::from_millis(10));
    }
    // The server goes away (host down) with the write landed and unanswered.
    server.shutdown();
    server.force_close();
    let _ = std::fs::remove_file(&socket);
    let result = writer.join().unwrap();
    let _ = t.join();
    assert_eq!(
        store.data.lock().unwrap()[0],
        0xA1,
        "the write landed on the server"
    );
    let err = result.expect_err("the write cannot have been answered");
    eprintln!("write error: {err}");
    assert!(
        !ssdcache_device::is_unreached(&err),
        "a write that was sent (and landed) is reported as never having reached the device \
         ({err}): the engine does not count it, so no commit or FLUSH flushes it"
    );
}
