//! NBD over TLS (`NBD_OPT_STARTTLS`, issue 13 item 4), with rustls.
//!
//! Once the handshake acknowledged `NBD_OPT_STARTTLS`, the client's socket goes to a *pump*
//! thread (`nbd-tls`, one per TLS connection, so at most `max_connections` of them) that runs
//! the TLS session and moves plaintext to and from one end of a Unix socket pair; the rest of
//! the handshake and the whole transmission phase run over the other end exactly as over a
//! plain socket, with their timeouts, buffers and threads unchanged. So TLS adds one thread,
//! two copies and the encryption to each byte; nothing in the protocol code knows about it.
//!
//! Bounds: the pump reads at most [`PLAIN_CHUNK`] bytes from either side before it has
//! passed them on, and holds at most [`MAX_PENDING`] decrypted bytes the plain side has not
//! taken yet (rustls holds at most its default buffer limit of unsent records); when a side
//! does not take what the pump has for it, the pump stops reading the other side, so the
//! client or the connection's own write timeout sees the back-pressure. The pump ends when
//! either side is closed or fails; closing its end of the pair then ends the connection.

use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConnection, Connection, ServerConnection};
use tracing::{debug, warn};

use crate::server::NbdStream;

/// Largest read from either side in one go.
pub const PLAIN_CHUNK: usize = 64 << 10;
/// Most decrypted bytes waiting for the plain side before the pump stops reading the client.
pub const MAX_PENDING: usize = 256 << 10;

/// TLS for a server's connections.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// Certificates, key and client verification (`rustls::ServerConfig`).
    pub server: Arc<rustls::ServerConfig>,
    /// Refuse every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` before TLS
    /// (`NBD_REP_ERR_TLS_REQD`): no export is reachable in plaintext.
    pub required: bool,
}

/// Equal when they share one rustls configuration (it has no equality of its own).
impl PartialEq for TlsConfig {
    fn eq(&self, other: &TlsConfig) -> bool {
        Arc::ptr_eq(&self.server, &other.server) && self.required == other.required
    }
}

impl Eq for TlsConfig {}

/// Starts the TLS session on `net` (the handshake acknowledged STARTTLS) and returns the
/// plaintext end: the NBD handshake goes on over it.
pub(crate) fn start<S: NbdStream>(
    net: S,
    config: &Arc<rustls::ServerConfig>,
    stall_limit: Duration,
    peer: &str,
) -> io::Result<UnixStream> {
    let session = ServerConnection::new(Arc::clone(config)).map_err(io::Error::other)?;
    let (plain, inner) = UnixStream::pair()?;
    let peer = peer.to_owned();
    thread::Builder::new()
        .name("nbd-tls".into())
        .spawn(move || {
            match Pump::new(net, session.into(), inner, stall_limit).and_then(Pump::run) {
                // A refused certificate, a bad record: what an operator needs to see.
                Err(error) if error.kind() == ErrorKind::InvalidData => {
                    warn!(%peer, %error, "TLS session failed");
                }
                Err(error) => debug!(%peer, %error, "TLS session ended"),
                Ok(()) => {}
            }
        })?;
    Ok(plain)
}

/// TLS for a client's connection to an NBD server (ssdcache's own client, reaching a backing
/// export over `nbds://`): the CAs that may sign the server's certificate, the name that
/// certificate must carry, and, for a server that verifies its clients, a client certificate.
#[derive(Debug, Clone)]
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: ServerName<'static>,
}

/// Starts TLS as a client on `net` (the server acknowledged STARTTLS): runs the TLS handshake
/// here, within `timeout`, so that a refused certificate is this call's error, then hands the
/// session to a pump thread and returns the plaintext end. That pump ends a session only
/// when a side closes or fails, never for a slow side: the caller's own timers bound its
/// requests, and a request it still waits for must not lose its connection under it.
/// Why a client's TLS session ended, once it has (set by its pump thread).
pub(crate) type SessionEnd = Arc<std::sync::Mutex<Option<String>>>;

pub(crate) fn start_client<S: NbdStream>(
    mut net: S,
    tls: &ClientTls,
    timeout: Duration,
) -> io::Result<(UnixStream, SessionEnd)> {
    let mut session = ClientConnection::new(Arc::clone(&tls.config), tls.server_name.clone())
        .map_err(io::Error::other)?;
    client_handshake(&mut net, &mut session, timeout)?;
    net.set_read_timeout_stream(None)?;
    net.set_write_timeout_stream(None)?;
    let (plain, inner) = UnixStream::pair()?;
    let peer = net.peer_label();
    let ended = SessionEnd::default();
    let reason = Arc::clone(&ended);
    thread::Builder::new()
        .name("nbd-tls-client".into())
        .spawn(move || {
            let outcome = Pump::new(net, session.into(), inner, Duration::MAX).and_then(Pump::run);
            let why = match &outcome {
                Err(error) if error.kind() == ErrorKind::InvalidData => {
                    warn!(%peer, %error, "TLS session to the server failed");
                    error.to_string()
                }
                Err(error) => {
                    debug!(%peer, %error, "TLS session to the server ended");
                    error.to_string()
                }
                Ok(()) => "the session was closed".to_owned(),
            };
            *reason
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
        })?;
    Ok((plain, ended))
}

/// Runs a client's TLS handshake on the blocking `net` within `timeout`, one record read or
/// write at a time with the deadline checked before each (review 50: rustls's `complete_io`
/// loops inside, and a server trickling a byte per read timeout kept it going for hours).
fn client_handshake<S: NbdStream>(
    net: &mut S,
    session: &mut ClientConnection,
    timeout: Duration,
) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    let timed_out = || {
        io::Error::new(
            ErrorKind::TimedOut,
            format!("the server did not complete the TLS handshake within {timeout:?}"),
        )
    };
    while session.is_handshaking() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let reading = !session.wants_write();
        let step = if reading {
            net.set_read_timeout_stream(Some(left))?;
            session.read_tls(net)
        } else {
            net.set_write_timeout_stream(Some(left))?;
            session.write_tls(net)
        };
        match step {
            Ok(0) if reading => {
                return Err(io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the server closed the connection during the TLS handshake",
                ))
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(timed_out())
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if let Err(error) = session.process_new_packets() {
            // Send the alert rustls queued (a refused certificate), then end.
            let _ = session.write_tls(net);
            return Err(io::Error::new(ErrorKind::InvalidData, error));
        }
    }
    Ok(())
}

/// Bytes read from one side, not yet written to the other.
#[derive(Default)]
struct Pending {
    bytes: Vec<u8>,
    sent: usize,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.sent == self.bytes.len()
    }

    fn len(&self) -> usize {
        self.bytes.len() - self.sent
    }

    /// Writes what it can to `to` without blocking (a write of 0 bytes: no room now, as
    /// rustls's writer says when its buffer limit is reached).
    fn flush_to(&mut self, to: &mut impl Write) -> io::Result<()> {
        while !self.is_empty() {
            match to.write(&self.bytes[self.sent..]) {
                Ok(0) => break,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.compact();
        Ok(())
    }

    /// Drops what was sent, so the buffer holds only what waits (review 46: a side a little
    /// slower than the other never emptied it, and it kept every byte that passed).
    fn compact(&mut self) {
        self.bytes.drain(..self.sent);
        self.sent = 0;
    }
}

struct Pump<S> {
    net: S,
    session: Connection,
    plain: UnixStream,
    /// Decrypted, for the plain side.
    to_plain: Pending,
    /// From the plain side, not yet taken by rustls (its buffer limit).
    to_session: Pending,
    net_closed: bool,
    plain_closed: bool,
    chunk: Vec<u8>,
    /// How long a side may take nothing the pump holds for it before the session ends.
    stall_limit: Duration,
}

impl<S: NbdStream> Pump<S> {
    fn new(
        net: S,
        session: Connection,
        plain: UnixStream,
        stall_limit: Duration,
    ) -> io::Result<Pump<S>> {
        set_nonblocking(net.as_raw_fd())?;
        plain.set_nonblocking(true)?;
        Ok(Pump {
            net,
            session,
            plain,
            to_plain: Pending::default(),
            to_session: Pending::default(),
            net_closed: false,
            plain_closed: false,
            chunk: vec![0; PLAIN_CHUNK],
            stall_limit,
        })
    }

    fn run(mut self) -> io::Result<()> {
        // Plaintext that arrived with the handshake's last records (a client's handshake runs
        // before the pump starts) waits in the session, not on the socket.
        self.take_plaintext()?;
        loop {
            self.flush()?;
            if self.finished() {
                return Ok(());
            }
            let (net_ready, plain_ready) = self.wait()?;
            if net_ready {
                self.read_net()?;
            }
            if plain_ready {
                self.read_plain()?;
            }
        }
    }

    /// Passes on everything either side can take now.
    fn flush(&mut self) -> io::Result<()> {
        while self.session.wants_write() {
            match self.session.write_tls(&mut self.net) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.to_plain.flush_to(&mut self.plain)?;
        if self.net_closed && self.to_plain.is_empty() {
            // The client is gone and everything it sent was delivered: the connection reads
            // EOF and ends.
            let _ = self.plain.shutdown(std::net::Shutdown::Write);
        }
        if !self.to_session.is_empty() {
            self.to_session.flush_to(&mut self.session.writer())?;
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        let net_done = self.net_closed && self.to_plain.is_empty();
        let plain_done = self.plain_closed && !self.session.wants_write();
        net_done && self.plain_closed || plain_done
    }

    /// Waits until a side has something for the pump or room for what it holds; which sides
    /// to read. A side the pump neither reads nor writes now is left out: poll reports a
    /// hang-up whatever it is asked, so a closed side would wake it at once, again and again
    /// (review 46). A hang-up is never an end by itself: the read that follows returns the
    /// rest of what the side sent, then its end.
    fn wait(&self) -> io::Result<(bool, bool)> {
        let read_net = !self.net_closed && self.to_plain.len() < MAX_PENDING;
        let read_plain = !self.plain_closed && self.to_session.is_empty();
        let write_plain = !self.to_plain.is_empty();
        let mut fds = [
            poll_fd(self.net.as_raw_fd(), read_net, self.session.wants_write()),
            poll_fd(self.plain.as_raw_fd(), read_plain, write_plain),
        ];
        if fds.iter().all(|fd| fd.fd < 0) {
            return Err(io::Error::other("neither side can take or give anything"));
        }
        let timeout = libc::c_int::try_from(self.stall_limit.as_millis()).unwrap_or(i32::MAX);
        let ready = loop {
            // SAFETY: `fds` is a valid array of two pollfd structs for the whole call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if rc >= 0 {
                break rc;
            }
            let error = io::Error::last_os_error();
            if error.kind() != ErrorKind::Interrupted {
                return Err(error);
            }
        };
        let holding = write_plain || !self.to_session.is_empty() || self.session.wants_write();
        if ready == 0 && holding {
            return Err(io::Error::new(
                ErrorKind::TimedOut,
                format!("a side took nothing for {:?}", self.stall_limit),
            ));
        }
        let readable = libc::POLLIN | libc::POLLHUP | libc::POLLERR;
        let net_ready = read_net && fds[0].revents & readable != 0;
        let plain_ready = read_plain && fds[1].revents & readable != 0;
        Ok((net_ready, plain_ready))
    }

    /// Reads TLS records from the client and decrypts them.
    fn read_net(&mut self) -> io::Result<()> {
        match self.session.read_tls(&mut self.net) {
            Ok(0) => self.net_closed = true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
        if let Err(error) = self.session.process_new_packets() {
            // Send the alert rustls queued (a bad certificate, a bad record), then end.
            let _ = self.session.write_tls(&mut self.net);
            return Err(io::Error::new(ErrorKind::InvalidData, error));
        }
        self.take_plaintext()
    }

    /// Moves what the session decrypted to the plain side's queue.
    fn take_plaintext(&mut self) -> io::Result<()> {
        loop {
            match self.session.reader().read(&mut self.chunk) {
                // A close_notify, or the socket's end without one (a client that half-closes,
                // a server shutdown that stopped reading the socket): either way the client
                // sends no more, and the replies owed still go out (review 46).
                Ok(0) => {
                    self.net_closed = true;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                    self.net_closed = true;
                    return Ok(());
                }
                Ok(n) => self.to_plain.bytes.extend_from_slice(&self.chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads plaintext the connection wrote and hands it to rustls.
    fn read_plain(&mut self) -> io::Result<()> {
        match self.plain.read(&mut self.chunk) {
            Ok(0) => {
                self.plain_closed = true;
                self.session.send_close_notify();
            }
            Ok(n) => {
                self.to_session.bytes.extend_from_slice(&self.chunk[..n]);
                self.to_session.flush_to(&mut self.session.writer())?;
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
        Ok(())
    }
}

/// A poll entry for `fd`, or one poll ignores (fd -1) when neither is wanted.
fn poll_fd(fd: RawFd, read: bool, write: bool) -> libc::pollfd {
    let fd = if read || write { fd } else { -1 };
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the pump owns (through its stream) for its whole life.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Why the TLS configuration cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("cannot read {path}: {reason} (a PEM file; see docs/operations.md, \"TLS\")")]
    File { path: PathBuf, reason: String },
    #[error("{path} holds no certificate (a PEM file starting with -----BEGIN CERTIFICATE-----)")]
    NoCertificate { path: PathBuf },
    #[error("the TLS configuration is not usable: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("{name:?} cannot name a TLS server (a DNS name or an IP address): {reason}")]
    ServerName { name: String, reason: String },
    #[error("the client verifier cannot use {path}: {reason}")]
    Verifier { path: PathBuf, reason: String },
}

/// The files of a certificates directory, named as nbdkit and qemu name them.
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CA_CERT: &str = "ca-cert.pem";
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

impl TlsConfig {
    /// TLS with x509 certificates from `dir`: `server-cert.pem` (the server's certificate,
    /// then its chain) and `server-key.pem`; with `verify_peer`, clients must present a
    /// certificate signed by a CA of `ca-cert.pem`.
    pub fn from_certificates_dir(
        dir: &Path,
        verify_peer: bool,
        required: bool,
    ) -> Result<TlsConfig, TlsSetupError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = certificates(&dir.join(SERVER_CERT))?;
        let key = private_key(&dir.join(SERVER_KEY))?;
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()?;
        let builder = if verify_peer {
            let ca_path = dir.join(CA_CERT);
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates(&ca_path)? {
                roots.add(cert)?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| TlsSetupError::Verifier {
                        path: ca_path,
                        reason: e.to_string(),
                    })?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let server = builder.with_single_cert(certs, key)?;
        Ok(TlsConfig {
            server: Arc::new(server),
            required,
        })
    }
}

impl ClientTls {
    /// x509 from `dir`, named as qemu's `tls-creds-x509` (endpoint=client) and libnbd's
    /// `tls-certificates` name them: `ca-cert.pem`, the CAs trusted to sign the server's
    /// certificate, and, when present, `client-cert.pem` with `client-key.pem` for a server
    /// that verifies its clients. `server_name` is the DNS name or IP address the server's
    /// certificate must carry.
    pub fn from_certificates_dir(
        dir: &Path,
        server_name: &str,
    ) -> Result<ClientTls, TlsSetupError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(&dir.join(CA_CERT))? {
            roots.add(cert)?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
        let (cert_path, key_path) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
        let config = match (cert_path.exists(), key_path.exists()) {
            (false, false) => builder.with_no_client_auth(),
            (true, true) => {
                builder.with_client_auth_cert(certificates(&cert_path)?, private_key(&key_path)?)?
            }
            (has_cert, _) => {
                let (path, missing) = if has_cert {
                    (cert_path, CLIENT_KEY)
                } else {
                    (key_path, CLIENT_CERT)
                };
                return Err(TlsSetupError::File {
                    path,
                    reason: format!(
                        "{missing} is missing beside it (a client certificate needs both)"
                    ),
                });
            }
        };
        let server_name = ServerName::try_from(server_name.to_owned()).map_err(|e| {
            TlsSetupError::ServerName {
                name: server_name.to_owned(),
                reason: e.to_string(),
            }
        })?;
        Ok(ClientTls {
            config: Arc::new(config),
            server_name,
        })
    }
}

/// The unencrypted private key of a PEM file.
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsSetupError::File {
        reason: match e {
            rustls::pki_types::pem::Error::NoItemsFound => "no unencrypted private key in it \
                (PKCS#8, PKCS#1 or SEC1 PEM; an encrypted key is not supported)"
                .to_owned(),
            e => e.to_string(),
        },
        path: path.to_owned(),
    })
}

/// Every certificate of a PEM file; at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let failed = |e: rustls::pki_types::pem::Error| TlsSetupError::File {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(failed)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(failed)?;
    if certs.is_empty() {
        return Err(TlsSetupError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}
