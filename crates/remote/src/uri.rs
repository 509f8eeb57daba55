//! NBD URIs as the NBD project's `doc/uri.md` defines them (the form qemu, libnbd and nbdkit
//! accept): `nbd://HOST[:PORT][/EXPORT]` and `nbd+unix:///[EXPORT]?socket=PATH`, with `nbds`
//! for TLS. The export name is the path without its leading `/`, percent-decoded.

use std::fmt;
use std::path::PathBuf;

/// The port NBD servers listen on unless told otherwise (IANA-assigned).
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Tcp { host: String, port: u16 },
    Unix { socket: PathBuf },
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub endpoint: Endpoint,
    /// The export's name ("" is the server's default export).
    pub export: String,
    /// `nbds`: the connection must use TLS.
    pub tls: bool,
    /// `tls-certificates=DIR` (libnbd's parameter): the folder with `ca-cert.pem` and
    /// optionally `client-cert.pem` and `client-key.pem`. Required with `nbds`.
    pub tls_certificates: Option<PathBuf>,
    /// `tls-hostname=NAME` (the NBD URI spec's): the name the server's certificate must
    /// carry, when it is not the URI's host (always needed over a Unix socket).
    pub tls_hostname: Option<String>,
    /// The URI as given, for messages and the cache's record of the device.
    text: String,
}

/// How to start TLS with the server of an `nbds://` URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub certificates: PathBuf,
    /// The DNS name or IP address the server's certificate must carry.
    pub server_name: String,
}

/// Why a string is not a usable NBD URI.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{uri:?} is not a usable NBD URI: {why} (forms: nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH, nbds://HOST[:PORT]/EXPORT?tls-certificates=DIR)")]
pub struct UriError {
    pub uri: String,
    pub why: String,
}

const SCHEMES: [(&str, bool, bool); 6] = [
    // (scheme, tls, unix)
    ("nbd", false, false),
    ("nbd+tcp", false, false),
    ("nbd+unix", false, true),
    ("nbds", true, false),
    ("nbds+tcp", true, false),
    ("nbds+unix", true, true),
];

/// Whether `s` is written as an NBD URI (any of the schemes), as opposed to a path.
pub fn is_nbd_uri(s: &str) -> bool {
    s.split_once("://")
        .is_some_and(|(scheme, _)| SCHEMES.iter().any(|(name, ..)| *name == scheme))
}

impl NbdUri {
    pub fn parse(text: &str) -> Result<NbdUri, UriError> {
        let fail = |why: String| UriError {
            uri: text.to_owned(),
            why,
        };
        if text.contains('#') {
            return Err(fail(
                "a fragment (#...) has no meaning in an NBD URI; write a '#' of an export name \
                 or a path as %23"
                    .into(),
            ));
        }
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| fail("no scheme".into()))?;
        let &(_, tls, unix) = SCHEMES
            .iter()
            .find(|(name, ..)| *name == scheme)
            .ok_or_else(|| fail(format!("unknown scheme {scheme:?}")))?;
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        let (authority, path) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at + 1..]),
            None => (rest, ""),
        };
        let export = percent_decode(path).map_err(fail)?;
        let query = Query::parse(query, tls).map_err(fail)?;
        let endpoint = if unix {
            if !authority.is_empty() && authority != "localhost" {
                return Err(fail(format!(
                    "a Unix-socket URI names no host (found {authority:?})"
                )));
            }
            let socket = query.socket.ok_or_else(|| fail("no ?socket=PATH".into()))?;
            Endpoint::Unix {
                socket: PathBuf::from(socket),
            }
        } else {
            if query.socket.is_some() {
                return Err(fail("?socket= belongs to nbd+unix:// URIs".into()));
            }
            tcp_endpoint(authority).map_err(fail)?
        };
        if tls {
            if query.tls_certificates.is_none() {
                return Err(fail(
                    "an nbds:// URI needs ?tls-certificates=DIR: a folder holding ca-cert.pem \
                     (the CA that signed the server's certificate) and, for a server that \
                     checks its clients, client-cert.pem and client-key.pem"
                        .into(),
                ));
            }
            if matches!(endpoint, Endpoint::Unix { .. }) && query.tls_hostname.is_none() {
                return Err(fail(
                    "over a Unix socket, give &tls-hostname=NAME: the name the server's \
                     certificate carries, which ssdcache checks"
                        .into(),
                ));
            }
        }
        Ok(NbdUri {
            endpoint,
            export,
            tls,
            tls_certificates: query.tls_certificates.map(PathBuf::from),
            tls_hostname: query.tls_hostname,
            text: text.to_owned(),
        })
    }

    /// What TLS needs, for an `nbds://` URI.
    pub fn tls_settings(&self) -> Option<TlsSettings> {
        if !self.tls {
            return None;
        }
        let server_name = match (&self.tls_hostname, &self.endpoint) {
            (Some(name), _) => name.clone(),
            (None, Endpoint::Tcp { host, .. }) => host.clone(),
            (None, Endpoint::Unix { .. }) => String::new(),
        };
        Some(TlsSettings {
            certificates: self.tls_certificates.clone().unwrap_or_default(),
            server_name,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The same address written one way: the socket path resolved (links, `//`, `..`), the
    /// port explicit, the host in lower case. What is recorded, compared and locked, so one
    /// export spelt two ways is still one export (review 48).
    pub fn canonical(&self) -> NbdUri {
        let scheme = if self.tls { "nbds" } else { "nbd" };
        let export = percent_encode(&self.export);
        let (endpoint, text) = match &self.endpoint {
            Endpoint::Unix { socket } => {
                let socket = std::fs::canonicalize(socket).unwrap_or_else(|_| socket.clone());
                let text = format!(
                    "{scheme}+unix:///{export}?socket={}",
                    percent_encode(&socket.to_string_lossy())
                );
                (Endpoint::Unix { socket }, text)
            }
            Endpoint::Tcp { host, port } => {
                let host = host.to_ascii_lowercase();
                let shown = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                let text = format!("{scheme}://{shown}:{port}/{export}");
                (Endpoint::Tcp { host, port: *port }, text)
            }
        };
        // The certificates folder as given, links not followed (review 50): rotating
        // certificates by pointing a link at a new folder must keep working. The host name
        // in lower case, as DNS compares it.
        let certificates = self.tls_certificates.clone();
        let hostname = self.tls_hostname.as_ref().map(|h| h.to_ascii_lowercase());
        let mut text = text;
        let mut separator = if text.contains('?') { '&' } else { '?' };
        for (key, value) in [
            (
                "tls-certificates",
                certificates
                    .as_ref()
                    .map(|d| d.to_string_lossy().into_owned()),
            ),
            ("tls-hostname", hostname.clone()),
        ] {
            if let Some(value) = value {
                text.push_str(&format!("{separator}{key}={}", percent_encode(&value)));
                separator = '&';
            }
        }
        NbdUri {
            endpoint,
            export: self.export.clone(),
            tls: self.tls,
            tls_certificates: certificates,
            tls_hostname: hostname,
            text,
        }
    }

    /// Where the export is, whatever the connection's settings: the canonical URI without
    /// TLS parameters, its scheme `nbd` or `nbd+unix`. One export reached with TLS or without,
    /// or with another certificates folder, is one export (locks, `volume add`'s duplicates).
    pub fn address(&self) -> String {
        let plain = NbdUri {
            tls: false,
            tls_certificates: None,
            tls_hostname: None,
            ..self.clone()
        };
        plain.canonical().to_string()
    }
}

/// Escapes what a URI path or query value cannot hold as is (RFC 3986 unreserved characters
/// and `/` stay).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// `[USER@]HOST[:PORT]`, HOST possibly an `[IPv6]` literal.
fn tcp_endpoint(authority: &str) -> Result<Endpoint, String> {
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = if let Some(bracketed) = host_port.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| "an IPv6 address without its closing ']'".to_owned())?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("{after:?} after the IPv6 address"))?,
            ),
        };
        (host, port)
    } else {
        match host_port.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        }
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("port {p:?} is not 1 to 65535"))?,
    };
    Ok(Endpoint::Tcp {
        host: host.to_owned(),
        port,
    })
}

/// The query parameters ssdcache understands; any other is refused (a misspelt one must not
/// be ignored silently).
#[derive(Default)]
struct Query {
    socket: Option<String>,
    tls_certificates: Option<String>,
    tls_hostname: Option<String>,
}

impl Query {
    fn parse(query: Option<&str>, tls: bool) -> Result<Query, String> {
        let mut q = Query::default();
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("query parameter {pair:?} has no value"))?;
            let value = percent_decode(value)?;
            if value.is_empty() {
                return Err(format!("{key}= has an empty value"));
            }
            if key.starts_with("tls-") && !tls {
                return Err(format!("{key}= belongs to nbds:// URIs (TLS)"));
            }
            let slot = match key {
                "socket" => &mut q.socket,
                "tls-certificates" => &mut q.tls_certificates,
                "tls-hostname" => &mut q.tls_hostname,
                "tls-type" if value == "x509" => continue,
                "tls-type" => {
                    return Err(format!(
                        "tls-type={value} is not supported: only x509 (rustls offers no PSK or \
                         anonymous TLS)"
                    ))
                }
                "tls-verify-peer" if matches!(value.as_str(), "1" | "true") => continue,
                "tls-verify-peer" => {
                    return Err(
                        "tls-verify-peer=0: ssdcache always verifies the server's certificate \
                         (the cache writes its data to it)"
                            .into(),
                    )
                }
                _ => {
                    return Err(format!(
                        "unsupported query parameter {pair:?} (socket=, tls-certificates=, \
                         tls-hostname=, tls-type=x509, tls-verify-peer=1)"
                    ))
                }
            };
            if slot.replace(value).is_some() {
                return Err(format!("{key}= given twice"));
            }
        }
        Ok(q)
    }
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} does not decode to UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> Endpoint {
        Endpoint::Tcp {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn parses_the_forms_qemu_and_libnbd_accept() {
        let u = NbdUri::parse("nbd://example.com/disk0").unwrap();
        assert_eq!(
            (u.endpoint, u.export.as_str(), u.tls),
            (tcp("example.com", 10809), "disk0", false)
        );
        let u = NbdUri::parse("nbds://10.0.0.2:10810?tls-certificates=/etc/pki/nbd").unwrap();
        assert_eq!(
            (u.endpoint, u.export.as_str(), u.tls),
            (tcp("10.0.0.2", 10810), "", true)
        );
        let u = NbdUri::parse("nbd://[::1]:2000/a%20b").unwrap();
        assert_eq!((u.endpoint, u.export.as_str()), (tcp("::1", 2000), "a b"));
        let u = NbdUri::parse("nbd+unix:///vol?socket=/run/x%2By.sock").unwrap();
        let socket = PathBuf::from("/run/x+y.sock");
        assert_eq!(
            (u.endpoint, u.export.as_str()),
            (Endpoint::Unix { socket }, "vol")
        );
        assert!(is_nbd_uri("nbd+unix:///?socket=/s"));
        assert!(!is_nbd_uri("/dev/sdb"));
        assert!(!is_nbd_uri("http://x/"));
    }

    #[test]
    fn one_address_spelt_two_ways_is_one_canonical_uri() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("q.sock");
        std::fs::write(&real, b"").unwrap();
        let twice = format!("{}//q.sock", dir.path().display());
        let a = NbdUri::parse(&format!("nbd+unix:///x?socket={}", real.display())).unwrap();
        let b = NbdUri::parse(&format!("nbd+unix:///x?socket={twice}")).unwrap();
        assert_eq!(a.canonical().as_str(), b.canonical().as_str());
        let c = NbdUri::parse("nbd://Host/a%20b").unwrap().canonical();
        assert_eq!(c.as_str(), "nbd://host:10809/a%20b");
        assert_eq!(NbdUri::parse(c.as_str()).unwrap(), c);
        let v6 = NbdUri::parse("nbd://[::1]/e").unwrap().canonical();
        assert_eq!(v6.as_str(), "nbd://[::1]:10809/e");
        let tls = NbdUri::parse("nbds://H/e?tls-type=x509&tls-certificates=/no/such%20dir")
            .unwrap()
            .canonical();
        assert_eq!(
            tls.as_str(),
            "nbds://h:10809/e?tls-certificates=/no/such%20dir"
        );
        assert_eq!(NbdUri::parse(tls.as_str()).unwrap(), tls);
        let settings = tls.tls_settings().unwrap();
        assert_eq!(
            (settings.certificates, settings.server_name.as_str()),
            (PathBuf::from("/no/such dir"), "h")
        );
        let unix = NbdUri::parse("nbds+unix:///e?socket=/s&tls-certificates=/c&tls-hostname=srv")
            .unwrap()
            .canonical();
        assert_eq!(
            unix.as_str(),
            "nbds+unix:///e?socket=/s&tls-certificates=/c&tls-hostname=srv"
        );
        assert_eq!(unix.tls_settings().unwrap().server_name, "srv");
        let upper = NbdUri::parse("nbds://h/e?tls-certificates=/c&tls-hostname=SRV.example")
            .unwrap()
            .canonical();
        assert_eq!(upper.tls_settings().unwrap().server_name, "srv.example");
        // One export with or without TLS, with any certificates folder: one address.
        let plain = NbdUri::parse("nbd://H:10809/e").unwrap();
        assert_eq!(upper.address(), "nbd://h:10809/e");
        assert_eq!(plain.address(), upper.address());
        assert_eq!(unix.address(), "nbd+unix:///e?socket=/s");
    }

    #[test]
    fn the_certificates_folder_is_kept_as_given_links_and_all() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("pki-2026");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("pki");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let u = NbdUri::parse(&format!("nbds://h/e?tls-certificates={}", link.display()))
            .unwrap()
            .canonical();
        assert_eq!(u.tls_certificates.as_deref(), Some(link.as_path()));
    }

    #[test]
    fn refuses_what_it_cannot_use_and_says_why() {
        for (uri, why) in [
            ("nbd:///disk", "no host"),
            ("nbd://h:0/", "port"),
            ("nbd://h:99999/", "port"),
            ("nbd+unix:///disk", "socket"),
            ("nbd+unix://host/?socket=/s", "names no host"),
            ("nbd://h/?socket=/s", "belongs to"),
            ("nbd://h/?tls-certificates=/x", "belongs to nbds"),
            ("nbds://h/", "tls-certificates=DIR"),
            (
                "nbds://h/?tls-certificates=/x&tls-verify-peer=0",
                "always verifies",
            ),
            ("nbds://h/?tls-certificates=/x&tls-type=psk", "only x509"),
            (
                "nbds+unix:///e?socket=/s&tls-certificates=/x",
                "tls-hostname",
            ),
            ("nbds://h/?tls-certificates=/x&tls-certificates=/y", "twice"),
            ("nbds://h/?tls-certificates=/x&tls-hostname=", "empty value"),
            ("nbds://h/?tls-certificates=/x#frag", "fragment"),
            ("nbd://h/?frob=1", "unsupported query"),
            ("nbd://h/%zz", "percent"),
            ("nbd://[::1/", "IPv6"),
            ("ftp://h/", "scheme"),
        ] {
            let e = NbdUri::parse(uri).unwrap_err();
            assert!(e.to_string().contains(why), "{uri}: {e}");
        }
    }
}
