//! The service manager's readiness protocol (systemd's `sd_notify`): `serve` says when the
//! cache is open and every export is served (`READY=1`), what it is doing (`STATUS=`), and
//! when it begins to stop (`STOPPING=1`). A unit of `Type=notify` (dist/systemd) is then
//! "started" only once clients can be served, so units ordered after it (an `nbd-client`
//! attach, a mount, an NFS server) never start before the cache is up.
//!
//! Started without `NOTIFY_SOCKET` (by hand, by a test), every call does nothing. A message
//! that cannot be sent is logged and otherwise ignored: the daemon's data path never depends
//! on the service manager.

use std::ffi::OsStr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Where to send notifications, if a service manager asked for them.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
}

impl Notifier {
    /// The service manager named by `NOTIFY_SOCKET` (a path, or `@name` for an abstract
    /// socket), or none.
    pub fn from_env() -> Notifier {
        let target = std::env::var_os("NOTIFY_SOCKET").and_then(|path| match connect(&path) {
            Ok(target) => Some(target),
            Err(e) => {
                tracing::warn!(
                    "NOTIFY_SOCKET={}: cannot use it ({e}); the service manager will not be told \
                     when the cache is ready",
                    path.to_string_lossy()
                );
                None
            }
        });
        Notifier { target }
    }

    /// Serving: the cache is open and every listener accepts clients.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={status}"));
    }

    /// What the daemon is doing, for `systemctl status`.
    pub fn status(&self, status: &str) {
        self.send(&format!("STATUS={status}"));
    }

    /// The stop has begun (requests finishing, then the cache map written).
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={status}"));
    }

    fn send(&self, message: &str) {
        let Some((socket, address)) = &self.target else {
            return;
        };
        if let Err(e) = socket.send_to_addr(message.as_bytes(), address) {
            tracing::warn!("cannot notify the service manager ({e}): {message:?}");
        }
    }
}

fn connect(path: &OsStr) -> std::io::Result<(UnixDatagram, SocketAddr)> {
    let bytes = path.as_bytes();
    let address = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(path)?,
    };
    Ok((UnixDatagram::unbound()?, address))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_reach_a_path_socket() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("notify");
        let manager = UnixDatagram::bind(&path)?;
        let notifier = Notifier {
            target: Some(connect(path.as_os_str())?),
        };
        notifier.ready("serving 'vol0'");
        let mut buf = [0u8; 256];
        let n = manager.recv(&mut buf)?;
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving 'vol0'");
        notifier.stopping("SIGTERM");
        let n = manager.recv(&mut buf)?;
        assert_eq!(&buf[..n], b"STOPPING=1\nSTATUS=SIGTERM");
        Ok(())
    }

    #[test]
    fn messages_reach_an_abstract_socket() -> std::io::Result<()> {
        let name = format!("ssdcache-notify-test-{}", std::process::id());
        let manager = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        let notifier = Notifier {
            target: Some(connect(OsStr::new(&format!("@{name}")))?),
        };
        notifier.status("replaying the journal");
        let mut buf = [0u8; 256];
        let n = manager.recv(&mut buf)?;
        assert_eq!(&buf[..n], b"STATUS=replaying the journal");
        Ok(())
    }
}
