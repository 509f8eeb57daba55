//! `nbds://` backing exports (issue 13 item 5): `NbdDevice` over TLS to this project's NBD
//! server with `--tls require`-like settings, certificates made here with rcgen. Data goes
//! both ways and survives a server restart (the reconnection runs STARTTLS and the TLS
//! handshake again before the replay); a server certificate from a CA the URI does not trust,
//! a plaintext URI to a TLS-only server, an `nbds://` URI to a server without TLS and a
//! missing client certificate where the server asks for one are each refused with a reason.

use std::path::Path;
use std::time::Duration;

use ssdcache_device::BlockDevice;
use ssdcache_nbd::tls::{CA_CERT, CLIENT_CERT};
use ssdcache_nbd::TlsConfig;
use ssdcache_remote::{NbdDevice, NbdUri, RemoteConfig};

mod common;

use common::{make_pki, Store, BLOCK, SIZE};

fn quick() -> RemoteConfig {
    RemoteConfig {
        io_timeout: Duration::from_secs(5),
        retry_timeout: Duration::from_secs(10),
        ..RemoteConfig::default()
    }
}

fn tls_uri(store: &Store, certificates: &Path) -> NbdUri {
    NbdUri::parse(&format!(
        "nbds+unix:///disk?socket={}&tls-certificates={}&tls-hostname=localhost",
        store.socket.display(),
        certificates.display()
    ))
    .unwrap()
}

fn block(seed: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i / 5) as u8))
        .collect()
}

fn open_error(uri: NbdUri) -> String {
    match NbdDevice::open(uri, quick()) {
        Ok(_) => panic!("the export was opened"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn data_goes_both_ways_over_tls_and_across_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let mut store = Store::new(dir.path());
    store.tls = Some(TlsConfig::from_certificates_dir(&pki, false, true).unwrap());
    store.start();
    let dev = NbdDevice::open(tls_uri(&store, &pki), quick()).unwrap();
    let mut expected = vec![0u8; SIZE];
    // More than the pump's buffers in one go: 256 writes of 4 KiB and one of 1 MiB.
    for i in 0..=255u8 {
        let at = usize::from(i) * 4 * BLOCK;
        dev.write_at(&block(i), at as u64).unwrap();
        expected[at..at + BLOCK].copy_from_slice(&block(i));
    }
    let big: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    dev.write_at(&big, (SIZE - big.len()) as u64).unwrap();
    expected[SIZE - big.len()..].copy_from_slice(&big);
    let mut back = vec![0u8; SIZE];
    dev.read_at(&mut back, 0).unwrap();
    assert!(back == expected, "read back over TLS differs");
    // The server dies with 32 unflushed writes in its volatile cache and comes back: the
    // device reconnects over TLS and re-sends them before anything else.
    dev.flush().unwrap();
    for i in 0..32u8 {
        let at = usize::from(i) * 4 * BLOCK + BLOCK;
        dev.write_at(&block(i ^ 0x5a), at as u64).unwrap();
        expected[at..at + BLOCK].copy_from_slice(&block(i ^ 0x5a));
    }
    store.crash();
    std::thread::sleep(Duration::from_millis(200));
    store.start();
    dev.flush().unwrap();
    assert!(
        store.durable() == expected,
        "acknowledged writes lost across the restart"
    );
    assert_eq!(dev.status().reconnections, 1);
}

#[test]
fn a_server_certificate_from_a_ca_the_uri_does_not_trust_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, other) = (dir.path().join("pki"), dir.path().join("other"));
    make_pki(&pki);
    make_pki(&other);
    let mut store = Store::new(dir.path());
    store.tls = Some(TlsConfig::from_certificates_dir(&pki, false, true).unwrap());
    store.start();
    let e = open_error(tls_uri(&store, &other));
    assert!(
        e.contains("TLS handshake") && e.contains("certificate"),
        "{e}"
    );
    // A name the certificate does not carry is refused too.
    let wrong_name = NbdUri::parse(&format!(
        "nbds+unix:///disk?socket={}&tls-certificates={}&tls-hostname=nas.example",
        store.socket.display(),
        pki.display()
    ))
    .unwrap();
    let e = open_error(wrong_name);
    assert!(e.contains("certificate"), "{e}");
}

#[test]
fn plaintext_to_a_tls_only_server_and_tls_to_a_plain_server_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let mut store = Store::new(dir.path());
    store.tls = Some(TlsConfig::from_certificates_dir(&pki, false, true).unwrap());
    store.start();
    let e = open_error(store.uri());
    assert!(e.to_lowercase().contains("tls"), "{e}");
    store.crash();
    store.tls = None;
    store.start();
    let e = open_error(tls_uri(&store, &pki));
    assert!(e.contains("does not offer TLS"), "{e}");
}

#[test]
fn a_server_that_checks_clients_needs_the_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    make_pki(&pki);
    let mut store = Store::new(dir.path());
    store.tls = Some(TlsConfig::from_certificates_dir(&pki, true, true).unwrap());
    store.start();
    let dev = NbdDevice::open(tls_uri(&store, &pki), quick()).unwrap();
    dev.write_at(&block(7), 0).unwrap();
    dev.flush().unwrap();
    drop(dev);
    // Without a client certificate the server ends the session; with only half of one the
    // settings are refused before connecting.
    let no_client = dir.path().join("no-client");
    std::fs::create_dir_all(&no_client).unwrap();
    std::fs::copy(pki.join(CA_CERT), no_client.join(CA_CERT)).unwrap();
    let e = open_error(tls_uri(&store, &no_client));
    assert!(e.contains("TLS session") && e.contains("alert"), "{e}");
    std::fs::copy(pki.join(CLIENT_CERT), no_client.join(CLIENT_CERT)).unwrap();
    let e = open_error(tls_uri(&store, &no_client));
    assert!(e.contains("client-key.pem is missing"), "{e}");
}
