//! Review 46: NBD over TLS (commit 1a83e94), the pump and the handshake.
//! Copy to crates/nbd/tests/ and run: cargo test -p ssdcache-nbd --test review46_tls
//! The tests serialize themselves (they count the process's `nbd-tls` threads).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConnection, RootCertStore, StreamOwned};
use ssdcache_nbd::proto::*;
use ssdcache_nbd::tls::{CA_CERT, SERVER_CERT, SERVER_KEY};
use ssdcache_nbd::{
    transmission_flags, Command, Handshake, RequestHeader, Server, ServerConfig, TlsConfig,
    TlsPolicy,
};

const SIZE: usize = 16 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn make_pki(dir: &Path) -> CertificateDer<'static> {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let key = rcgen::KeyPair::generate().expect("server key");
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
    let cert = params.signed_by(&key, &ca, &ca_key).expect("server cert");
    std::fs::write(dir.join(SERVER_CERT), cert.pem()).unwrap();
    std::fs::write(dir.join(SERVER_KEY), key.serialize_pem()).unwrap();
    std::fs::write(dir.join(CA_CERT), ca.pem()).unwrap();
    ca.der().clone()
}

fn tls_server(dir: &Path, backend: Arc<MemExport>, config: ServerConfig) -> Server {
    let tls = TlsConfig::from_certificates_dir(dir, false, false).expect("TLS config");
    let config = ServerConfig {
        tls: Some(tls),
        ..config
    };
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    Server::new(vec![served(info, backend)], config).expect("server")
}

fn option_reply_type(stream: &mut (impl Read + Write), option: u32, data: &[u8]) -> u32 {
    stream.write_all(&option_bytes(option, data)).unwrap();
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    let len = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
    let mut payload = vec![0; len];
    stream.read_exact(&mut payload).unwrap();
    u32::from_be_bytes(header[12..16].try_into().unwrap())
}

type Tls = StreamOwned<ClientConnection, UnixStream>;

fn client_config(ca: &CertificateDer<'static>) -> Arc<rustls::ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

fn start_tls(mut stream: UnixStream, ca: &CertificateDer<'static>) -> Tls {
    assert_eq!(
        option_reply_type(&mut stream, NBD_OPT_STARTTLS, &[]),
        NBD_REP_ACK
    );
    let name = ServerName::try_from("localhost").unwrap();
    let session = ClientConnection::new(client_config(ca), name).unwrap();
    StreamOwned::new(session, stream)
}

fn connect(server: &Server) -> (UnixStream, thread::JoinHandle<()>) {
    let (mut client, server_end) = UnixStream::pair().unwrap();
    let server = server.clone();
    let serving = thread::spawn(move || {
        let _ = server.serve_stream(server_end);
    });
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    read_greeting(&mut client);
    client
        .write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    (client, serving)
}

/// STARTTLS, TLS handshake, GO "disk".
fn tls_client(
    server: &Server,
    ca: &CertificateDer<'static>,
) -> (Client<Tls>, thread::JoinHandle<()>) {
    let (plain, serving) = connect(server);
    let mut tls = start_tls(plain, ca);
    tls.write_all(&go_bytes("disk")).unwrap();
    let (size, _) = read_go_replies(&mut tls);
    (Client::preconnected(tls, size), serving)
}

/// (tid, utime+stime in clock ticks) of every `nbd-tls` thread of this process.
fn pump_threads() -> Vec<(u32, u64)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] != "nbd-tls" {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        // After "(comm) ": state is field 3 of stat, utime 14, stime 15.
        let ticks = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        out.push((entry.file_name().to_str().unwrap().parse().unwrap(), ticks));
    }
    out
}

fn pump_ticks() -> u64 {
    pump_threads().iter().map(|(_, t)| t).sum()
}

/// Waits up to `limit` for no `nbd-tls` thread; the count left.
fn wait_no_pumps(limit: Duration) -> usize {
    let started = Instant::now();
    loop {
        let n = pump_threads().len();
        if n == 0 || started.elapsed() > limit {
            return n;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Reads one simple reply carrying `len` bytes of data (or none on error); Err(what was
/// received) if the stream ends first.
fn recv_read(stream: &mut impl Read, len: usize) -> Result<(u64, u32), String> {
    let mut header = [0u8; 16];
    stream
        .read_exact(&mut header)
        .map_err(|e| format!("reply header: {e}"))?;
    assert_eq!(&header[0..4], &NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    let error = u32::from_be_bytes(header[4..8].try_into().unwrap());
    let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
    if error == 0 {
        let mut data = vec![0; len];
        stream
            .read_exact(&mut data)
            .map_err(|e| format!("read data of cookie {cookie}: {e}"))?;
    }
    Ok((cookie, error))
}

/// `Server::shutdown` promises: "requests already read finish and are answered, then
/// connections close". Over TLS it shuts the *client's* socket for reading; the pump's
/// read_tls sees EOF without close_notify, rustls's reader says UnexpectedEof, the pump
/// returns Err and closes its plaintext end: the answer of the request in the backend is
/// lost. (Same test without TLS passes: see the next test.)
#[test]
fn graceful_shutdown_answers_a_request_in_the_backend_over_tls() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let (started_tx, started) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let server = tls_server(dir.path(), backend.clone(), ServerConfig::default());
    let (mut client, serving) = tls_client(&server, &ca);
    client.send(Command::Read, 0, 0, 4096, &[]);
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("read held");
    server.shutdown();
    thread::sleep(Duration::from_millis(300));
    backend.release();
    let reply = recv_read(&mut client.stream, 4096);
    assert_eq!(
        reply,
        Ok((1, 0)),
        "the read already in the backend when shutdown started must be answered"
    );
    serving.join().unwrap();
}

/// Control: the same without TLS (passes on 1a83e94).
#[test]
fn graceful_shutdown_answers_a_request_in_the_backend_plaintext() {
    let _g = serial();
    let (started_tx, started) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let (server, mut client, serving) = serve_disk(
        backend.clone(),
        SIZE as u64,
        ServerConfig::default(),
        Duration::from_secs(20),
    );
    client.send(Command::Read, 0, 0, 4096, &[]);
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("read held");
    server.shutdown();
    thread::sleep(Duration::from_millis(300));
    backend.release();
    assert_eq!(recv_read(&mut client.stream, 4096), Ok((1, 0)));
    let _ = serving.join();
}

/// The connection answers 16 pipelined 1 MiB reads and NBD_CMD_DISC, then closes its end of
/// the pair. The pump still holds up to a socket buffer of replies in the pair, plus
/// `to_session`; when `to_session` is not empty it does not poll the pair for POLLIN, so
/// `wait` sees POLLHUP without POLLIN and returns BrokenPipe: the tail of the replies is
/// never sent. The spec: on DISC the server MUST handle all outstanding requests.
#[test]
fn replies_written_before_disc_all_reach_a_slow_tls_reader() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let server = tls_server(dir.path(), MemExport::new(SIZE), ServerConfig::default());
    let (mut client, serving) = tls_client(&server, &ca);
    const PIECE: usize = 1 << 20;
    for i in 0..16u64 {
        client.send(Command::Read, 0, i * PIECE as u64, PIECE as u32, &[]);
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    client.stream.flush().unwrap();
    // A slow reader: 32 KiB every 2 ms (16 MiB in about 1 s).
    let mut got = 0usize;
    let mut buf = vec![0u8; 32 << 10];
    let started = Instant::now();
    let want = 16 * (16 + PIECE);
    while got < want && started.elapsed() < Duration::from_secs(30) {
        match client.stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break,
        }
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        got, want,
        "bytes of the 16 read replies received before the end"
    );
    serving.join().unwrap();
}

/// A client sends a read that waits in the backend, then close_notify, and closes its Unix
/// socket. The pump sets `net_closed`, stops polling the client's socket for input, but
/// poll(2) reports POLLHUP on it regardless of `events`: poll returns at once, nothing is
/// ready, and the pump spins at 100% CPU until the backend finishes (here 1.5 s).
#[test]
fn the_pump_does_not_spin_while_a_request_of_a_closed_client_is_in_the_backend() {
    let _g = serial();
    assert_eq!(wait_no_pumps(Duration::from_secs(5)), 0);
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let (started_tx, started) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let server = tls_server(dir.path(), backend.clone(), ServerConfig::default());
    let (mut client, serving) = tls_client(&server, &ca);
    client.send(Command::Read, 0, 0, 4096, &[]);
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("read held");
    client.stream.conn.send_close_notify();
    client.stream.flush().unwrap();
    drop(client);
    thread::sleep(Duration::from_millis(100));
    let before = pump_ticks();
    thread::sleep(Duration::from_millis(1500));
    let spent = pump_ticks().saturating_sub(before);
    backend.release();
    serving.join().unwrap();
    assert!(
        spent < 30,
        "the pump used {spent} ticks (1/100 s) of CPU in 1.5 s while waiting"
    );
}

/// Same spin without close_notify: the client pipelines writes the connection cannot take
/// (its one slow worker waits in the backend and the slow queue is full, so the connection
/// reads nothing more), the pump's `to_plain` reaches MAX_PENDING so it stops reading the
/// client, and the client is killed (its socket closed). POLLHUP on the client's socket
/// wakes poll every time, nothing is "ready": 100% CPU until the backend returns.
#[test]
fn the_pump_does_not_spin_when_a_backed_up_client_vanishes() {
    let _g = serial();
    assert_eq!(wait_no_pumps(Duration::from_secs(5)), 0);
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let (started_tx, started) = mpsc::channel();
    let backend = MemExport::holding_reads_at(SIZE, 0, started_tx);
    let config = ServerConfig {
        threads_per_connection: 1,
        ..ServerConfig::default()
    };
    let server = tls_server(dir.path(), backend.clone(), config);
    let (mut client, serving) = tls_client(&server, &ca);
    // Reads at offset 0 wait in the backend: enough to occupy every worker and fill the
    // slow queue.
    for _ in 0..600 {
        client.send(Command::Read, 0, 0, 4096, &[]);
    }
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("read held");
    client
        .stream
        .sock
        .set_write_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let piece = vec![5u8; 4096];
    for i in 0..2048u64 {
        let header = RequestHeader {
            flags: 0,
            command: Command::Write,
            cookie: 100 + i,
            offset: (1 << 20) + i * 4096,
            length: 4096,
        };
        if client.stream.write_all(&header.encode()).is_err()
            || client.stream.write_all(&piece).is_err()
        {
            break;
        }
    }
    drop(client);
    thread::sleep(Duration::from_millis(300));
    assert_eq!(pump_threads().len(), 1, "the pump is still there, waiting");
    let before = pump_ticks();
    thread::sleep(Duration::from_millis(1500));
    let spent = pump_ticks().saturating_sub(before);
    backend.release();
    serving.join().unwrap();
    assert!(
        spent < 30,
        "the pump used {spent} ticks (1/100 s) of CPU in 1.5 s while waiting"
    );
}

/// A client that stops reading while the server writes big replies: the pump must sleep
/// (not spin) and everything must end after the I/O timeout (2 s here).
#[test]
fn a_stalled_tls_reader_costs_no_cpu_and_its_connection_and_pump_end() {
    let _g = serial();
    assert_eq!(wait_no_pumps(Duration::from_secs(5)), 0);
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let config = ServerConfig {
        io_timeout: Duration::from_secs(2),
        ..ServerConfig::default()
    };
    let server = tls_server(dir.path(), MemExport::new(SIZE), config);
    let (mut client, serving) = tls_client(&server, &ca);
    for i in 0..16u64 {
        client.send(Command::Read, 0, i << 20, 1 << 20, &[]);
    }
    client.stream.flush().unwrap();
    thread::sleep(Duration::from_millis(300));
    let before = pump_ticks();
    thread::sleep(Duration::from_millis(1000));
    let spent = pump_ticks().saturating_sub(before);
    assert!(
        spent < 20,
        "pump CPU {spent} ticks in 1 s with a stalled client"
    );
    let started = Instant::now();
    while !serving.is_finished() && started.elapsed() < Duration::from_secs(15) {
        thread::sleep(Duration::from_millis(50));
    }
    assert!(serving.is_finished(), "connection outlived the I/O timeout");
    assert_eq!(wait_no_pumps(Duration::from_secs(5)), 0, "pump thread left");
    drop(client);
}

/// Many connections ending every way (DISC, vanishing mid-handshake, garbage instead of
/// TLS, ClientHello then silence up to the handshake timeout, force_close): no `nbd-tls`
/// thread and no descriptor left.
#[test]
fn no_pump_thread_or_descriptor_is_left_behind() {
    let _g = serial();
    assert_eq!(wait_no_pumps(Duration::from_secs(5)), 0);
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let config = ServerConfig {
        handshake_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    let server = tls_server(dir.path(), MemExport::new(SIZE), config);
    let fds_before = open_fds();
    let mut servings = Vec::new();
    for round in 0..10 {
        // Clean.
        let (mut client, serving) = tls_client(&server, &ca);
        assert_eq!(client.write(0, &[round as u8; 4096]), 0);
        client.send(Command::Disconnect, 0, 0, 0, &[]);
        client.stream.conn.send_close_notify();
        let _ = client.stream.flush();
        drop(client);
        servings.push(serving);
        // Garbage instead of a ClientHello.
        let (mut plain, serving) = connect(&server);
        assert_eq!(
            option_reply_type(&mut plain, NBD_OPT_STARTTLS, &[]),
            NBD_REP_ACK
        );
        plain.write_all(&[0x42u8; 1000]).unwrap();
        let mut sink = Vec::new();
        let _ = plain.read_to_end(&mut sink);
        servings.push(serving);
        // ClientHello, then silence until the handshake timeout.
        let (mut plain, serving) = connect(&server);
        assert_eq!(
            option_reply_type(&mut plain, NBD_OPT_STARTTLS, &[]),
            NBD_REP_ACK
        );
        let name = ServerName::try_from("localhost").unwrap();
        let mut session = ClientConnection::new(client_config(&ca), name).unwrap();
        session.write_tls(&mut plain).unwrap();
        servings.push(serving);
        // TLS up, then vanish before GO.
        let (plain2, serving) = connect(&server);
        let mut tls = start_tls(plain2, &ca);
        tls.write_all(&option_bytes(NBD_OPT_LIST, &[])).unwrap();
        drop(tls);
        drop(plain);
        servings.push(serving);
    }
    // Ones left open for force_close.
    let mut kept = Vec::new();
    for _ in 0..5 {
        let (client, serving) = tls_client(&server, &ca);
        kept.push(client);
        servings.push(serving);
    }
    server.force_close();
    assert!(
        server.wait_idle_timeout(Duration::from_secs(15)),
        "connections left"
    );
    for s in servings {
        s.join().unwrap();
    }
    drop(kept);
    assert_eq!(
        wait_no_pumps(Duration::from_secs(5)),
        0,
        "pump threads left"
    );
    thread::sleep(Duration::from_millis(200));
    let fds_after = open_fds();
    assert!(
        fds_after <= fds_before,
        "descriptors: {fds_before} before, {fds_after} after"
    );
}

/// Spec, TLS support: "The server MUST operate in NOTLS mode unless the server set flag
/// NBD_FLAG_FIXED_NEWSTYLE and the client replied with NBD_FLAG_C_FIXED_NEWSTYLE". A client
/// without FIXED_NEWSTYLE that sends STARTTLS is acknowledged.
#[test]
fn starttls_is_not_acknowledged_without_fixed_newstyle() {
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let mut machine = Handshake::with_tls(vec![info], TlsPolicy::Offered);
    let _greeting = machine.take_output();
    machine.feed(&0u32.to_be_bytes()); // no NBD_FLAG_C_FIXED_NEWSTYLE
    machine.feed(&option_bytes(NBD_OPT_STARTTLS, &[]));
    let out = machine.take_output();
    let reply_type = u32::from_be_bytes(out[12..16].try_into().unwrap());
    assert!(
        !machine.wants_tls() && reply_type != NBD_REP_ACK,
        "STARTTLS from a client without FIXED_NEWSTYLE got {reply_type:#x}"
    );
}

/// A MemExport whose writes take 2 ms: the connection takes less than a fast client sends.
struct SlowWrites(Arc<MemExport>);

impl ssdcache_nbd::Export for SlowWrites {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ssdcache_nbd::Errno> {
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ssdcache_nbd::Errno> {
        thread::sleep(Duration::from_millis(2));
        self.0.write(offset, data, fua)
    }
    fn flush(&self) -> Result<(), ssdcache_nbd::Errno> {
        self.0.flush()
    }
    fn trim(&self, o: u64, l: u64, f: bool) -> Result<(), ssdcache_nbd::Errno> {
        self.0.trim(o, l, f)
    }
    fn write_zeroes(&self, o: u64, l: u64, f: bool, t: bool) -> Result<(), ssdcache_nbd::Errno> {
        self.0.write_zeroes(o, l, f, t)
    }
    fn cache(&self, o: u64, l: u64) -> Result<(), ssdcache_nbd::Errno> {
        self.0.cache(o, l)
    }
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `Pending` frees what it sent only once *all* of it was sent (`bytes.clear()` in
/// `flush_to`); `read_net` appends while `len()` (the unsent part) is under MAX_PENDING.
/// While the connection is a little slower than the client, `to_plain` is never empty, so
/// its Vec keeps every byte that ever passed: memory grows with the bytes transferred
/// (128 MiB of writes here), not bounded by MAX_PENDING.
#[test]
fn the_pumps_buffer_stays_bounded_under_a_long_backlog() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let tls = TlsConfig::from_certificates_dir(dir.path(), false, false).unwrap();
    let config = ServerConfig {
        tls: Some(tls),
        threads_per_connection: 1,
        fast_threads_per_connection: 1,
        connection_buffer_memory: 4 << 20,
        buffer_memory: 4 << 20,
        max_request: 1 << 20,
        ..ServerConfig::default()
    };
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let backend: Arc<dyn ssdcache_nbd::Export> = Arc::new(SlowWrites(MemExport::new(SIZE)));
    let server = Server::new(vec![ssdcache_nbd::ServerExport { info, backend }], config).unwrap();
    let (client, serving) = tls_client(&server, &ca);
    let mut stream = client.stream;
    thread::sleep(Duration::from_millis(200));
    let base = rss_kib();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(base));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        thread::spawn(move || {
            let started = Instant::now();
            while !done.load(std::sync::atomic::Ordering::SeqCst)
                && started.elapsed() < Duration::from_secs(120)
            {
                peak.fetch_max(rss_kib(), std::sync::atomic::Ordering::SeqCst);
                thread::sleep(Duration::from_millis(20));
            }
        })
    };
    const PIECE: usize = 64 << 10;
    const COUNT: u64 = 2048; // 128 MiB
    let piece = vec![9u8; PIECE];
    let mut wire = Vec::with_capacity(PIECE + 28);
    for i in 0..COUNT {
        let header = RequestHeader {
            flags: 0,
            command: Command::Write,
            cookie: i + 1,
            offset: (i * PIECE as u64) % SIZE as u64,
            length: PIECE as u32,
        };
        wire.clear();
        wire.extend_from_slice(&header.encode());
        wire.extend_from_slice(&piece);
        stream.write_all(&wire).unwrap();
    }
    stream.flush().unwrap();
    for _ in 0..COUNT {
        let mut reply = [0u8; 16];
        stream.read_exact(&mut reply).unwrap();
        assert_eq!(&reply[4..8], &[0, 0, 0, 0]);
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    sampler.join().unwrap();
    let grown = peak.load(std::sync::atomic::Ordering::SeqCst) - base;
    let header = RequestHeader {
        flags: 0,
        command: Command::Disconnect,
        cookie: 0,
        offset: 0,
        length: 0,
    };
    stream.write_all(&header.encode()).unwrap();
    stream.conn.send_close_notify();
    let _ = stream.flush();
    drop(stream);
    serving.join().unwrap();
    assert!(
        grown < 40 << 10,
        "RSS grew by {} MiB while 128 MiB went through one TLS connection",
        grown >> 10
    );
}

/// Holds: STARTTLS and the ClientHello in one write, before the ACK was read; the driver
/// reads exactly the option, so the ClientHello reaches the pump.
#[test]
fn starttls_pipelined_with_the_client_hello_holds() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let server = tls_server(dir.path(), MemExport::new(SIZE), ServerConfig::default());
    let (mut plain, serving) = connect(&server);
    let name = ServerName::try_from("localhost").unwrap();
    let mut session = ClientConnection::new(client_config(&ca), name).unwrap();
    let mut wire = option_bytes(NBD_OPT_STARTTLS, &[]);
    session.write_tls(&mut wire).unwrap();
    plain.write_all(&wire).unwrap();
    let mut ack = [0u8; 20];
    plain.read_exact(&mut ack).unwrap();
    assert_eq!(
        u32::from_be_bytes(ack[12..16].try_into().unwrap()),
        NBD_REP_ACK
    );
    let mut tls = StreamOwned::new(session, plain);
    tls.write_all(&go_bytes("disk")).unwrap();
    let (size, _) = read_go_replies(&mut tls);
    let mut client = Client::preconnected(tls, size);
    assert_eq!(client.read(0, 4096).unwrap(), vec![0u8; 4096]);
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    drop(client);
    serving.join().unwrap();
}
