//! Review 47: hangs and spurious reconnections of `NbdDevice`, against a raw, scriptable NBD
//! server (std only) whose misbehaviour can be chosen per connection.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ssdcache_device::BlockDevice;
use ssdcache_nbd::proto::*;
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

const SIZE: u64 = 1 << 20;

/// What a connection does when it receives a READ.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum OnRead {
    /// Answers at once.
    Normal,
    /// Sends the reply header and half of the data, then closes the connection.
    HalfDataThenClose,
    /// Sends the reply header and half of the data, then stalls (keeps the socket open).
    HalfDataThenStall,
    /// Answers after this many milliseconds.
    Delay(u64),
}

struct RawServer {
    socket: PathBuf,
    /// What the n-th connection (0-based) does on READ; later ones use the last entry.
    script: Arc<Mutex<Vec<OnRead>>>,
    connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    flags: u16,
}

fn read_exact(s: &mut UnixStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn option_reply(s: &mut UnixStream, option: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::new();
    out.extend_from_slice(&NBD_REP_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    s.write_all(&out)
}

fn serve_one(
    mut s: UnixStream,
    mode: OnRead,
    flags: u16,
    stop: Arc<AtomicBool>,
) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut greeting = Vec::new();
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let _client_flags = read_exact(&mut s, 4)?;
    loop {
        let h = read_exact(&mut s, 16)?;
        let option = be32(&h[8..]);
        let len = be32(&h[12..]) as usize;
        let _data = read_exact(&mut s, len)?;
        if option == NBD_OPT_GO {
            let mut info = Vec::new();
            info.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
            info.extend_from_slice(&SIZE.to_be_bytes());
            info.extend_from_slice(&flags.to_be_bytes());
            option_reply(&mut s, option, NBD_REP_INFO, &info)?;
            option_reply(&mut s, option, NBD_REP_ACK, &[])?;
            break;
        }
        option_reply(&mut s, option, NBD_REP_ERR_UNSUP, &[])?;
    }
    let mut store = vec![0u8; SIZE as usize];
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
            return Ok(());
        }
        let mut h = [0u8; 28];
        match s.read_exact(&mut h[..1]) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.read_exact(&mut h[1..])?;
        s.set_read_timeout(Some(Duration::from_millis(100)))?;
        let command = u16::from_be_bytes([h[6], h[7]]);
        let cookie = be64(&h[8..]);
        let offset = be64(&h[16..]) as usize;
        let length = be32(&h[24..]) as usize;
        let mut reply = Vec::new();
        reply.extend_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
        reply.extend_from_slice(&0u32.to_be_bytes());
        reply.extend_from_slice(&cookie.to_be_bytes());
        match command {
            NBD_CMD_READ => {
                let data = &store[offset..offset + length];
                match mode {
                    OnRead::Normal => {}
                    OnRead::Delay(ms) => thread::sleep(Duration::from_millis(ms)),
                    OnRead::HalfDataThenClose => {
                        reply.extend_from_slice(&data[..length / 2]);
                        s.write_all(&reply)?;
                        let _ = s.shutdown(std::net::Shutdown::Both);
                        return Ok(());
                    }
                    OnRead::HalfDataThenStall => {
                        reply.extend_from_slice(&data[..length / 2]);
                        s.write_all(&reply)?;
                        while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                            thread::sleep(Duration::from_millis(50));
                        }
                        return Ok(());
                    }
                }
                reply.extend_from_slice(data);
            }
            NBD_CMD_WRITE => {
                let data = read_exact(&mut s, length)?;
                store[offset..offset + length].copy_from_slice(&data);
            }
            NBD_CMD_DISC => return Ok(()),
            _ => {}
        }
        s.write_all(&reply)?;
    }
}

impl RawServer {
    fn start(dir: &std::path::Path, script: Vec<OnRead>, flags: u16) -> RawServer {
        let socket = dir.join("raw.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        listener.set_nonblocking(true).unwrap();
        let script = Arc::new(Mutex::new(script));
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (sc, cn, st) = (
            Arc::clone(&script),
            Arc::clone(&connections),
            Arc::clone(&stop),
        );
        thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(180);
            while !st.load(Ordering::SeqCst) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(false).unwrap();
                        let n = cn.fetch_add(1, Ordering::SeqCst);
                        let mode = {
                            let script = sc.lock().unwrap();
                            script[n.min(script.len() - 1)]
                        };
                        let st2 = Arc::clone(&st);
                        thread::spawn(move || {
                            let _ = serve_one(s, mode, flags, st2);
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        RawServer {
            socket,
            script,
            connections,
            stop,
            flags,
        }
    }

    fn uri(&self) -> NbdUri {
        NbdUri::parse(&format!("nbd+unix:///x?socket={}", self.socket.display())).unwrap()
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

const FLAGS: u16 = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH;

fn config() -> RemoteConfig {
    RemoteConfig {
        connections: 1,
        io_timeout: Duration::from_secs(1),
        retry_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_secs(1),
        ..RemoteConfig::default()
    }
}

/// Runs `f` on a thread; `None` if it did not return within `limit` (the thread is leaked).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// R47-1: the receiver takes a READ's request out of the in-flight map before it reads the
/// data; when the data never arrives whole (the server dies, or stalls past io_timeout, in the
/// middle of a READ reply), the tag is dropped, `into_unanswered` does not return it, and the
/// caller's `await_reply` loops forever (every io_timeout: link_failed of an old generation,
/// ignored; shutdown of a dead socket) even after the device reconnected. retry_timeout does
/// not bound it.
#[test]
fn review47_read_reply_cut_in_its_data_does_not_hang_the_reader() {
    let dir = tempfile::tempdir().unwrap();
    let server = RawServer::start(
        dir.path(),
        vec![OnRead::HalfDataThenClose, OnRead::Normal],
        FLAGS,
    );
    let dev = Arc::new(NbdDevice::open(server.uri(), config()).unwrap());
    let d = Arc::clone(&dev);
    let result = within(Duration::from_secs(15), move || {
        let mut buf = vec![0u8; 8192];
        d.read_at(&mut buf, 0)
    });
    assert!(
        result.is_some(),
        "read_at still waiting 15 s after the server cut its READ reply (io_timeout 1 s, \
         retry_timeout 3 s); device status: {:?}; connections made: {}",
        dev.status(),
        server.connections.load(Ordering::SeqCst)
    );
    std::mem::forget(dev); // if the reader is stuck, dropping would not hang, but be safe
}

/// R47-1 (variant): the server stalls in the middle of a READ reply's data (a network stall
/// past io_timeout): read_exact times out, same loss of the tag, same endless wait.
#[test]
fn review47_read_reply_stalled_in_its_data_does_not_hang_the_reader() {
    let dir = tempfile::tempdir().unwrap();
    let server = RawServer::start(
        dir.path(),
        vec![OnRead::HalfDataThenStall, OnRead::Normal],
        FLAGS,
    );
    let dev = Arc::new(NbdDevice::open(server.uri(), config()).unwrap());
    let d = Arc::clone(&dev);
    let result = within(Duration::from_secs(15), move || {
        let mut buf = vec![0u8; 8192];
        d.read_at(&mut buf, 0)
    });
    assert!(
        result.is_some(),
        "read_at still waiting 15 s after the server stalled in its READ reply; status {:?}",
        dev.status()
    );
    std::mem::forget(dev);
}

/// R47-2: the receiver's socket read timeout (io_timeout) keeps running while the connection
/// is idle; a request sent late in that period and answered within io_timeout still makes the
/// read time out with the request in flight ("reading a reply header: timed out"), and the
/// connection is declared dead: a reconnection (and replay of the whole unflushed log) for a
/// reply that came well within io_timeout.
#[test]
fn review47_a_reply_within_io_timeout_after_an_idle_spell_is_not_a_dead_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = RawServer::start(dir.path(), vec![OnRead::Delay(500)], FLAGS);
    let dev = NbdDevice::open(server.uri(), config()).unwrap();
    let started = Instant::now();
    let mut buf = vec![0u8; 4096];
    for _ in 0..3 {
        // Idle ~0.7 s into the receiver's 1 s read timeout, then a read answered in 0.5 s.
        thread::sleep(Duration::from_millis(700));
        dev.read_at(&mut buf, 0).unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(30));
    let status = dev.status();
    assert_eq!(
        status.reconnections, 0,
        "replies came in 0.5 s with io_timeout 1 s, yet the device reconnected: {status:?}"
    );
    drop(server.script.lock().unwrap());
    let _ = server.flags;
}

/// R47-3: Unix-socket connects have no timeout (`UnixStream::connect`). A server that does not
/// accept (hung, stopped) with a full listen backlog makes `connect` block forever: `open`
/// (create/serve) hangs instead of failing after connect_timeout, and so does the supervisor's
/// reconnect (then Drop, which joins it).
#[test]
fn review47_open_of_a_unix_socket_that_never_accepts_is_bounded_by_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("stuck.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    // A listener whose backlog is already full: nothing accepts.
    rustix::net::listen(&listener, 0).unwrap();
    let _filler = UnixStream::connect(&socket).unwrap();
    let uri = NbdUri::parse(&format!("nbd+unix:///x?socket={}", socket.display())).unwrap();
    let outcome = within(Duration::from_secs(10), move || {
        NbdDevice::open(uri, config())
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(
        outcome.is_some(),
        "NbdDevice::open still connecting 10 s later (connect_timeout 1 s)"
    );
    drop(listener);
}
