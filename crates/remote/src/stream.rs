//! The socket to an NBD server: TCP or a Unix socket, behind one type.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{socket_with, sockopt, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use ssdcache_nbd::NbdStream;

use crate::uri::Endpoint;

pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// The plaintext end of a TLS session (`ssdcache_nbd::client::connect_tls`), with the
    /// label of the server it reaches.
    Tls {
        plain: UnixStream,
        peer: String,
    },
}

impl Stream {
    /// Connects within `timeout` (each address a name resolves to in turn, for TCP).
    pub(crate) fn connect(endpoint: &Endpoint, timeout: Duration) -> io::Result<Stream> {
        match endpoint {
            Endpoint::Unix { socket } => connect_unix(socket, timeout).map(Stream::Unix),
            Endpoint::Tcp { host, port } => {
                let mut last = None;
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, timeout) {
                        Ok(tcp) => {
                            // Requests are small and latency-bound; never wait to coalesce.
                            tcp.set_nodelay(true)?;
                            keep_alive(&tcp)?;
                            return Ok(Stream::Tcp(tcp));
                        }
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"))
                }))
            }
        }
    }
}

/// TCP keepalive probes after 10 s of silence, every 5 s, 3 unanswered ones ending the
/// connection: a peer that vanished (a host down, a cut link) is noticed within about 25 s
/// even when requests wait for it without a reply timer (writes in flight:
/// `Link::writes_in_flight`).
fn keep_alive(tcp: &TcpStream) -> io::Result<()> {
    sockopt::set_socket_keepalive(tcp, true)?;
    sockopt::set_tcp_keepidle(tcp, Duration::from_secs(10))?;
    sockopt::set_tcp_keepintvl(tcp, Duration::from_secs(5))?;
    sockopt::set_tcp_keepcnt(tcp, 3)?;
    Ok(())
}

/// `UnixStream::connect` with a time limit: a server that accepts nothing (hung, stopped) with
/// a full backlog makes a blocking connect wait for ever, while a non-blocking one says
/// `EAGAIN` at once and is tried again until `timeout`.
fn connect_unix(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddrUnix::new(path)?;
    let fd = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    loop {
        match rustix::net::connect(&fd, &addr) {
            Ok(()) | Err(Errno::ISCONN) => break,
            Err(Errno::AGAIN | Errno::INPROGRESS | Errno::ALREADY | Errno::INTR) => {
                if Instant::now() >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "{} accepted no connection within {} s (the server is hung or stopped)",
                            path.display(),
                            timeout.as_secs_f64()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.as_raw_fd(),
        }
    }
}

impl NbdStream for Stream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        match self {
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tls { plain, peer } => plain.try_clone().map(|plain| Stream::Tls {
                plain,
                peer: peer.clone(),
            }),
        }
    }
    fn shutdown_stream(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.shutdown(how),
        }
    }
    fn set_read_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(timeout),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.set_read_timeout(timeout),
        }
    }
    fn set_write_timeout_stream(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(timeout),
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => s.set_write_timeout(timeout),
        }
    }
    fn peer_label(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_label(),
            Stream::Unix(s) => s.peer_label(),
            Stream::Tls { peer, .. } => peer.clone(),
        }
    }
}
