//! Review 48: a write that the device gave up on (its reply was late, the connection was
//! declared dead) may still be executing on the server — NBD has no fencing. The device
//! re-sends it on a new connection, the caller is told "written", the engine then sends a
//! NEWER write of the same range, which is acknowledged and flushed... and then the old
//! request, still running on the server for the dead connection, lands on top of it.
//! docs/design.md §5.5 "Limits" claims "Sending the same write twice is harmless, and the
//! engine starts no overlapping write until the first was answered": the first *copy* was
//! never answered; the second was, and that is what the engine waits for.
//!
//! The server here is this project's NBD server with an export whose first write of one
//! block takes 3 s (a store stalled: Ceph slow ops, a GC pause, a congested link), as
//! qemu-nbd -e N / nbdkit threads keep running a request after its connection was shut.

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

struct StallOnce {
    data: Mutex<Vec<u8>>,
    stalled: AtomicBool,
}

impl Export for StallOnce {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let o = offset as usize;
        buf.copy_from_slice(&self.data.lock().unwrap()[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        if data[0] == 0xA1 && !self.stalled.swap(true, Ordering::SeqCst) {
            // The store stalls on this one request, then completes it.
            thread::sleep(Duration::from_secs(3));
        }
        let o = offset as usize;
        self.data.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
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
fn review48_a_write_given_up_on_lands_after_a_newer_acknowledged_and_flushed_write() {
    let dir = tempfile::tempdir().unwrap();
    let socket: PathBuf = dir.path().join("s.sock");
    let store = Arc::new(StallOnce {
        data: Mutex::new(vec![0; SIZE]),
        stalled: AtomicBool::new(false),
    });
    let info = ExportInfo {
        name: "disk".into(),
        description: "stall-1".into(),
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

    // Older data: its first copy stalls on the server; the device times the reply out,
    // reconnects, re-sends, and tells the caller it is written.
    dev.write_at(&vec![0xA1; BLOCK], 0).expect("older write");
    dev.flush().expect("flush");
    // The engine now writes newer data of the range (no overlapping write is in flight as far
    // as it can know) and flushes: it would now mark the line clean.
    dev.write_at(&vec![0xB2; BLOCK], 0).expect("newer write");
    dev.flush().expect("flush");
    let mut back = vec![0u8; BLOCK];
    dev.read_at(&mut back, 0).unwrap();
    assert_eq!(back[0], 0xB2, "newer data read back right after its flush");

    // The stalled request of the dead connection completes on the server.
    thread::sleep(Duration::from_secs(4));
    let on_store = store.data.lock().unwrap()[0];
    drop(dev);
    server.shutdown();
    server.force_close();
    let _ = t.join();
    assert_eq!(
        on_store, 0xB2,
        "the store holds the OLDER data after the newer write was acknowledged and flushed \
         (a zombie write of the timed-out connection landed on top): the cache would have \
         marked 0xB2 clean and dropped it"
    );
}
