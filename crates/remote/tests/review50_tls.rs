//! Review 50: adversarial tests of nbds:// backing exports. The TLS handshake is bounded by the
//! connect timeout even against a server that trickles a byte per read timeout (it ran for
//! hours: rustls's `complete_io` loops inside), a server silent after STARTTLS or after the
//! handshake fails the open within its limit and says it was a time limit, and no client
//! pump thread outlives its connection (slow writes, a halt, reconnections).
//! The tests run one at a time: they count the process's pump threads.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ssdcache_nbd::proto::*;
use ssdcache_nbd::TlsConfig;
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn config() -> RemoteConfig {
    RemoteConfig {
        connect_timeout: Duration::from_secs(1),
        io_timeout: Duration::from_secs(2),
        retry_timeout: Duration::from_secs(5),
        ..RemoteConfig::default()
    }
}

fn uri(socket: &Path, pki: &Path) -> NbdUri {
    NbdUri::parse(&format!(
        "nbds+unix:///disk?socket={}&tls-certificates={}&tls-hostname=localhost",
        socket.display(),
        pki.display()
    ))
    .unwrap()
}

/// Greeting, client flags, STARTTLS acknowledged.
fn ack_starttls(s: &mut UnixStream) {
    let mut g = Vec::new();
    g.extend_from_slice(&NBDMAGIC.to_be_bytes());
    g.extend_from_slice(&IHAVEOPT.to_be_bytes());
    g.extend_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&g).unwrap();
    let mut flags = [0u8; 4];
    s.read_exact(&mut flags).unwrap();
    let mut opt = [0u8; 16];
    s.read_exact(&mut opt).unwrap();
    assert_eq!(
        u32::from_be_bytes(opt[8..12].try_into().unwrap()),
        NBD_OPT_STARTTLS
    );
    let mut r = Vec::new();
    r.extend_from_slice(&NBD_REP_MAGIC.to_be_bytes());
    r.extend_from_slice(&NBD_OPT_STARTTLS.to_be_bytes());
    r.extend_from_slice(&NBD_REP_ACK.to_be_bytes());
    r.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&r).unwrap();
}

/// Runs NbdDevice::open in a thread; how long it took (None: still running after `limit`).
fn time_open(uri: NbdUri, limit: Duration) -> Option<(Duration, String)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let r = NbdDevice::open(uri, config());
        let _ = tx.send((
            t.elapsed(),
            r.err().map(|e| e.to_string()).unwrap_or_default(),
        ));
    });
    rx.recv_timeout(limit).ok()
}

fn server(dir: &Path, each: impl Fn(UnixStream) + Send + Sync + 'static) -> PathBuf {
    let socket = dir.join("s");
    let listener = UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        let each = std::sync::Arc::new(each);
        for s in listener.incoming() {
            let each = std::sync::Arc::clone(&each);
            std::thread::spawn(move || each(s.unwrap()));
        }
    });
    socket
}

/// A server that acknowledges STARTTLS and then trickles a TLS record one byte at a time,
/// each byte well within the connect timeout: the handshake must still end at the
/// connect timeout (1 s), as the docs promise ("each attempt bounded by the 10 s connect
/// and handshake limit").
#[test]
fn a_trickling_tls_handshake_is_bounded_by_the_connect_timeout() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let socket = server(dir.path(), |mut s| {
        ack_starttls(&mut s);
        // A handshake record header announcing 16 KiB, then its body byte by byte.
        if s.write_all(&[0x16, 0x03, 0x03, 0x40, 0x00]).is_err() {
            return;
        }
        for _ in 0..0x4000 {
            std::thread::sleep(Duration::from_millis(300));
            if s.write_all(&[0]).is_err() {
                return;
            }
        }
    });
    match time_open(uri(&socket, &pki), Duration::from_secs(15)) {
        Some((took, e)) => {
            assert!(took < Duration::from_secs(3), "took {took:?}");
            assert!(e.contains("TLS handshake within"), "{e}");
        }
        None => {
            panic!("NbdDevice::open still in the TLS handshake 15 s later (connect_timeout 1 s)")
        }
    }
}

/// A server that acknowledges STARTTLS and then says nothing.
#[test]
fn a_silent_server_after_starttls() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let socket = server(dir.path(), |mut s| {
        ack_starttls(&mut s);
        std::thread::sleep(Duration::from_secs(30));
    });
    let (took, e) = time_open(uri(&socket, &pki), Duration::from_secs(15)).expect("hung");
    assert!(took < Duration::from_millis(1500), "took {took:?}");
    assert!(e.contains("within"), "{e}");
}

fn pump_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
        .filter(|c| c.trim() == "nbd-tls-client")
        .count()
}

/// A TLS server that completes the handshake, then never answers NBD_OPT_GO (and reads
/// nothing more).
#[test]
fn a_server_silent_after_the_tls_handshake() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let tls = TlsConfig::from_certificates_dir(&pki, false, true).unwrap();
    let cfg = tls.server.clone();
    let socket = server(dir.path(), move |mut s| {
        ack_starttls(&mut s);
        let mut conn = rustls::ServerConnection::new(cfg.clone()).unwrap();
        while conn.is_handshaking() {
            if conn.complete_io(&mut s).is_err() {
                return;
            }
        }
        let _ = conn.complete_io(&mut s);
        std::thread::sleep(Duration::from_secs(60));
    });
    let before = pump_threads();
    let (took, e) = time_open(uri(&socket, &pki), Duration::from_secs(15)).expect("hung");
    eprintln!("open failed after {took:?}: {e}");
    std::thread::sleep(Duration::from_millis(500));
    assert!(took < Duration::from_millis(1500), "took {took:?}: {e}");
    assert!(e.contains("time limit"), "{e}");
    assert_eq!(pump_threads(), before, "the failed open's pump lives on");
}

mod common;

use common::make_pki;

struct SlowWrites(Duration);

impl ssdcache_nbd::Export for SlowWrites {
    fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), ssdcache_nbd::Errno> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ssdcache_nbd::Errno> {
        std::thread::sleep(self.0);
        Ok(())
    }
    fn flush(&self) -> Result<(), ssdcache_nbd::Errno> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), ssdcache_nbd::Errno> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), ssdcache_nbd::Errno> {
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), ssdcache_nbd::Errno> {
        Ok(())
    }
}

fn slow_server(dir: &Path, pki: &Path, delay: Duration) -> (ssdcache_nbd::Server, PathBuf) {
    use ssdcache_nbd::{transmission_flags, ExportInfo, Server, ServerConfig, ServerExport};
    let socket = dir.join("slow.sock");
    let info = ExportInfo {
        name: "disk".into(),
        description: "slow".into(),
        size: 1 << 20,
        flags: transmission_flags(false),
        min_block: 4096,
        preferred_block: 4096,
        max_block: 1 << 20,
    };
    let config = ServerConfig {
        tls: Some(TlsConfig::from_certificates_dir(pki, false, true).unwrap()),
        ..ServerConfig::default()
    };
    let server = Server::new(
        vec![ServerExport {
            info,
            backend: std::sync::Arc::new(SlowWrites(delay)),
        }],
        config,
    )
    .unwrap();
    let listener = UnixListener::bind(&socket).unwrap();
    let serving = server.clone();
    std::thread::spawn(move || serving.serve_unix(listener));
    (server, socket)
}

/// A write answered after 3 s (io_timeout 0.5 s, stuck_limit 10 s): the client pump keeps
/// the session, the write succeeds on its first connection.
#[test]
fn a_slow_write_over_tls_keeps_its_connection() {
    let _serial = serial();
    use ssdcache_device::BlockDevice;
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let (server, socket) = slow_server(dir.path(), &pki, Duration::from_secs(3));
    let cfg = RemoteConfig {
        io_timeout: Duration::from_millis(500),
        stuck_limit: Duration::from_secs(10),
        retry_timeout: Duration::from_secs(5),
        ..RemoteConfig::default()
    };
    let dev = NbdDevice::open(uri(&socket, &pki), cfg).unwrap();
    let r = dev.write_at(&[7u8; 4096], 0);
    let status = dev.status();
    eprintln!("{r:?} {status:?}");
    assert!(r.is_ok() && status.reconnections == 0, "{r:?} {status:?}");
    drop(dev);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        pump_threads(),
        0,
        "pump threads left after the device was dropped"
    );
    server.shutdown();
    server.force_close();
}

/// Halting over TLS: a write never answered within stuck_limit; after the halt and the
/// device's drop no pump thread is left.
#[test]
fn halting_over_tls_leaves_no_pump() {
    let _serial = serial();
    use ssdcache_device::BlockDevice;
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let (server, socket) = slow_server(dir.path(), &pki, Duration::from_secs(6));
    let cfg = RemoteConfig {
        io_timeout: Duration::from_millis(500),
        stuck_limit: Duration::from_secs(2),
        retry_timeout: Duration::from_secs(5),
        ..RemoteConfig::default()
    };
    let dev = NbdDevice::open(uri(&socket, &pki), cfg).unwrap();
    let t = Instant::now();
    let e = dev.write_at(&[7u8; 4096], 0).expect_err("halts");
    eprintln!("after {:?}: {e}; pumps {}", t.elapsed(), pump_threads());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(pump_threads(), 0, "a pump outlived the halt");
    drop(dev);
    server.shutdown();
    server.force_close();
}

/// Thread count across many reconnections over TLS.
#[test]
fn reconnections_over_tls_leave_no_pumps() {
    let _serial = serial();
    use ssdcache_device::BlockDevice;
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let mut store = common::Store::new(dir.path());
    store.tls = Some(TlsConfig::from_certificates_dir(&pki, false, true).unwrap());
    store.start();
    let dev = NbdDevice::open(uri(&store.socket, &pki), config()).unwrap();
    for i in 0..10u8 {
        dev.write_at(&[i; 4096], 0).unwrap();
        store.crash();
        std::thread::sleep(Duration::from_millis(100));
        store.start();
        dev.flush().unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let n = pump_threads();
    eprintln!(
        "reconnections {} pumps {n} connections {}",
        dev.status().reconnections,
        dev.connections()
    );
    assert!(n <= dev.connections(), "{n} pump threads");
}

/// The plaintext handshake too: a greeting trickled a byte every 300 ms (each read well within
/// its timeout) ends at the connect timeout, not at 18 × the timeout.
#[test]
fn a_trickling_plaintext_handshake_is_bounded_by_the_connect_timeout() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let socket = server(dir.path(), |mut s| {
        let mut greeting = Vec::new();
        greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
        greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
        for byte in greeting {
            std::thread::sleep(Duration::from_millis(300));
            if s.write_all(&[byte]).is_err() {
                return;
            }
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let plain = NbdUri::parse(&format!("nbd+unix:///disk?socket={}", socket.display())).unwrap();
    let (took, e) = time_open(plain, Duration::from_secs(15)).expect("hung");
    assert!(took < Duration::from_millis(1500), "took {took:?}: {e}");
    assert!(e.contains("time limit"), "{e}");
}
