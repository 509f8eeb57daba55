//! The model store the reconnection tests share: this project's NBD server with an export
//! that behaves like a store with a volatile write cache (librbd's, say): a write is
//! acknowledged into memory and becomes durable only at FLUSH, and a crash of the server keeps
//! only what was durable.

#![allow(dead_code)]

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};

use ssdcache_nbd::{
    transmission_flags, Errno, Export, ExportInfo, Server, ServerConfig, ServerExport, TlsConfig,
};
use ssdcache_remote::NbdUri;

pub const SIZE: usize = 4 << 20;
pub const BLOCK: usize = 4096;

/// Contents as the client sees them (`current`) and as they would survive a crash of the
/// server (`durable`, shared with the next incarnation).
pub struct VolatileStore {
    current: Mutex<Vec<u8>>,
    durable: Arc<Mutex<Vec<u8>>>,
}

impl VolatileStore {
    fn flush_now(&self) {
        let current = self.current.lock().unwrap().clone();
        *self.durable.lock().unwrap() = current;
    }
}

impl Export for VolatileStore {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let o = offset as usize;
        buf.copy_from_slice(&self.current.lock().unwrap()[o..o + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        let o = offset as usize;
        self.current.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        if fua {
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
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
}

/// One incarnation of the server on a Unix socket.
struct Incarnation {
    server: Server,
    thread: JoinHandle<()>,
}

pub struct Store {
    pub socket: PathBuf,
    pub durable: Arc<Mutex<Vec<u8>>>,
    running: Option<Incarnation>,
    pub size: u64,
    pub description: String,
    /// Serve only over TLS with this configuration (`NBD_OPT_STARTTLS` required).
    pub tls: Option<TlsConfig>,
}

impl Store {
    pub fn new(dir: &Path) -> Store {
        Store {
            socket: dir.join("store.sock"),
            durable: Arc::new(Mutex::new(vec![0; SIZE])),
            running: None,
            size: SIZE as u64,
            description: "store-1".into(),
            tls: None,
        }
    }

    pub fn start(&mut self) {
        let backend = Arc::new(VolatileStore {
            current: Mutex::new(self.durable.lock().unwrap().clone()),
            durable: Arc::clone(&self.durable),
        });
        let flags = transmission_flags(false);
        let info = ExportInfo {
            name: "disk".into(),
            description: self.description.clone(),
            size: self.size,
            flags,
            min_block: BLOCK as u32,
            preferred_block: BLOCK as u32,
            max_block: 1 << 20,
        };
        let served = ServerExport { info, backend };
        let config = ServerConfig {
            tls: self.tls.clone(),
            ..ServerConfig::default()
        };
        let server = Server::new(vec![served], config).unwrap();
        let _ = std::fs::remove_file(&self.socket);
        let listener = UnixListener::bind(&self.socket).unwrap();
        let serving = server.clone();
        let thread = thread::spawn(move || {
            let _ = serving.serve_unix(listener);
        });
        self.running = Some(Incarnation { server, thread });
    }

    /// Kills the server as a crash would: connections cut, unflushed writes gone.
    pub fn crash(&mut self) {
        if let Some(run) = self.running.take() {
            run.server.shutdown();
            run.server.force_close();
            run.thread.join().unwrap();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    pub fn uri(&self) -> NbdUri {
        NbdUri::parse(&format!(
            "nbd+unix:///disk?socket={}",
            self.socket.display()
        ))
        .unwrap()
    }

    pub fn durable(&self) -> Vec<u8> {
        self.durable.lock().unwrap().clone()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.crash();
    }
}

/// A CA, a server certificate for localhost signed by it, and a client certificate, in `dir`
/// (the file names qemu's tls-creds-x509 and ssdcache's TLS settings read).
pub fn make_pki(dir: &Path) {
    use ssdcache_nbd::tls::{CA_CERT, CLIENT_CERT, CLIENT_KEY, SERVER_CERT, SERVER_KEY};
    std::fs::create_dir_all(dir).unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join(CA_CERT), ca.pem()).unwrap();
    for (cert_file, key_file) in [(SERVER_CERT, SERVER_KEY), (CLIENT_CERT, CLIENT_KEY)] {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.join(cert_file), cert.pem()).unwrap();
        std::fs::write(dir.join(key_file), key.serialize_pem()).unwrap();
    }
}
