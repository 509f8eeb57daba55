//! Review 47: a reconnection checks only size, description, min block and read-only of the
//! export (`other_export`); the device keeps using the transmission flags and max request size
//! the FIRST connection saw. A server restarted with other flags is accepted, with data loss
//! or a permanent outage as the result.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use ssdcache_device::BlockDevice;
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport,
};
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

const SIZE: usize = 4 << 20;
const BLOCK: usize = 4096;

/// `write_through`: every write is durable when answered (a server that offers no FLUSH).
struct Store {
    current: Mutex<Vec<u8>>,
    durable: Arc<Mutex<Vec<u8>>>,
    write_through: bool,
}

impl Store {
    fn flush_now(&self) {
        let c = self.current.lock().unwrap().clone();
        *self.durable.lock().unwrap() = c;
    }
}

impl Export for Store {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let o = offset as usize;
        buf.copy_from_slice(&self.current.lock().unwrap()[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        let o = offset as usize;
        self.current.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        if fua || self.write_through {
            self.flush_now();
        }
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        self.flush_now();
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, length: u64, _: bool, _: bool) -> Result<(), Errno> {
        let o = offset as usize;
        self.current.lock().unwrap()[o..o + length as usize].fill(0);
        if self.write_through {
            self.flush_now();
        }
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
}

struct Host {
    socket: PathBuf,
    durable: Arc<Mutex<Vec<u8>>>,
    running: Option<(Server, JoinHandle<()>)>,
}

impl Host {
    fn new(dir: &Path) -> Host {
        Host {
            socket: dir.join("s.sock"),
            durable: Arc::new(Mutex::new(vec![0; SIZE])),
            running: None,
        }
    }
    fn start(&mut self, flags: u16, max_block: u32, write_through: bool) {
        let backend = Arc::new(Store {
            current: Mutex::new(self.durable.lock().unwrap().clone()),
            durable: Arc::clone(&self.durable),
            write_through,
        });
        let info = ExportInfo {
            name: "disk".into(),
            description: "same".into(),
            size: SIZE as u64,
            flags,
            min_block: BLOCK as u32,
            preferred_block: BLOCK as u32,
            max_block,
        };
        let server = Server::new(
            vec![ServerExport { info, backend }],
            ServerConfig::default(),
        )
        .unwrap();
        let _ = std::fs::remove_file(&self.socket);
        let listener = UnixListener::bind(&self.socket).unwrap();
        let s2 = server.clone();
        let t = thread::spawn(move || {
            let _ = s2.serve_unix(listener);
        });
        self.running = Some((server, t));
    }
    fn crash(&mut self) {
        if let Some((server, t)) = self.running.take() {
            server.shutdown();
            server.force_close();
            t.join().unwrap();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
    fn uri(&self) -> NbdUri {
        NbdUri::parse(&format!(
            "nbd+unix:///disk?socket={}",
            self.socket.display()
        ))
        .unwrap()
    }
    fn durable(&self) -> Vec<u8> {
        self.durable.lock().unwrap().clone()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.crash();
    }
}

fn config() -> RemoteConfig {
    RemoteConfig {
        io_timeout: Duration::from_secs(3),
        retry_timeout: Duration::from_secs(2),
        ..RemoteConfig::default()
    }
}

fn block(seed: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| seed.wrapping_add((i / 7) as u8))
        .collect()
}

/// R47-4 (fixed): a server back with other transmission flags (FLUSH now offered, multi-conn
/// or WRITE_ZEROES withdrawn) or another maximum request size is not used: what the device
/// decided from the first connection (whether a flush is needed, how many connections, how the
/// replay log is sent) would no longer hold. Requests fail, naming why; a flush is never
/// reported done; nothing is written onto it.
#[test]
fn review47_a_server_back_with_other_flags_or_block_sizes_is_not_used() {
    let no_flush = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES;
    let all = transmission_flags(false);
    let cases = [
        // (first flags, then flags, then max_block, what the refusal names)
        (no_flush, all, 1 << 20, "flags"),
        (all, all & !NBD_FLAG_CAN_MULTI_CONN, 1 << 20, "flags"),
        (all, all & !NBD_FLAG_SEND_WRITE_ZEROES, 1 << 20, "flags"),
        (all, all, 64 << 10, "block sizes"),
    ];
    for (first, then, max_block, named) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut host = Host::new(dir.path());
        host.start(first, 1 << 20, first == no_flush);
        let dev = NbdDevice::open(host.uri(), config()).unwrap();
        dev.write_at(&block(1), 0).unwrap();
        dev.write_zeroes(65536, 65536).unwrap();
        host.crash();
        let before = host.durable();
        thread::sleep(Duration::from_millis(200));
        host.start(then, max_block, false);
        let mut buf = vec![0u8; BLOCK];
        let e = dev
            .read_at(&mut buf, 0)
            .expect_err("served by another export");
        let status = dev.status();
        assert!(
            !status.connected && status.last_error.contains(named),
            "{named}: {e} / {status:?}"
        );
        if first & NBD_FLAG_SEND_FLUSH != 0 {
            // (A server without FLUSH wrote through: what it answered is durable already.)
            assert!(dev.flush().is_err(), "{named}: a flush reported done");
        }
        assert!(
            host.durable() == before,
            "{named}: something was written onto it"
        );
    }
}
