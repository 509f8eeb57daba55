//! NBD over TLS (issue 13, item 4) with a rustls client on a socket pair: STARTTLS, the
//! refusals of `TlsPolicy::Required`, pipelined data through the pump both ways, and a
//! client that vanishes mid-request.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, RootCertStore, StreamOwned};
use ssdcache_nbd::proto::*;
use ssdcache_nbd::tls::{CA_CERT, SERVER_CERT, SERVER_KEY};
use ssdcache_nbd::{transmission_flags, Command, Server, ServerConfig, TlsConfig};

const SIZE: usize = 16 << 20;

/// A CA and a server certificate for localhost in `dir`; the CA's certificate.
fn make_pki(dir: &Path) -> rustls::pki_types::CertificateDer<'static> {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let key = rcgen::KeyPair::generate().expect("server key");
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
    let cert = params
        .signed_by(&key, &ca, &ca_key)
        .expect("server certificate");
    std::fs::write(dir.join(SERVER_CERT), cert.pem()).expect("write");
    std::fs::write(dir.join(SERVER_KEY), key.serialize_pem()).expect("write");
    std::fs::write(dir.join(CA_CERT), ca.pem()).expect("write");
    ca.der().clone()
}

fn tls_server(dir: &Path, required: bool) -> Server {
    let tls = TlsConfig::from_certificates_dir(dir, false, required).expect("TLS config");
    let config = ServerConfig {
        tls: Some(tls),
        ..ServerConfig::default()
    };
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    Server::new(vec![served(info, MemExport::new(SIZE))], config).expect("server")
}

/// Sends one option and returns the type of its (single) reply.
fn option_reply_type(stream: &mut impl ReadWrite, option: u32, data: &[u8]) -> u32 {
    stream.write_all(&option_bytes(option, data)).unwrap();
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    let len = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
    let mut payload = vec![0; len];
    stream.read_exact(&mut payload).unwrap();
    u32::from_be_bytes(header[12..16].try_into().unwrap())
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// Greeting and flags, then STARTTLS and the TLS handshake with a client trusting `ca`.
fn start_tls(
    mut stream: UnixStream,
    ca: &rustls::pki_types::CertificateDer<'static>,
) -> StreamOwned<ClientConnection, UnixStream> {
    assert_eq!(
        option_reply_type(&mut stream, NBD_OPT_STARTTLS, &[]),
        NBD_REP_ACK
    );
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").unwrap();
    let session = ClientConnection::new(Arc::new(config), name).unwrap();
    StreamOwned::new(session, stream)
}

fn connect(server: &Server) -> (UnixStream, thread::JoinHandle<()>) {
    let (mut client, server_end) = UnixStream::pair().unwrap();
    let server = server.clone();
    let serving = thread::spawn(move || {
        let _ = server.serve_stream(server_end);
    });
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    read_greeting(&mut client);
    client
        .write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    (client, serving)
}

#[test]
fn required_tls_refuses_plaintext_then_serves_pipelined_data_through_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let server = tls_server(dir.path(), true);
    let (mut plain, serving) = connect(&server);
    let go = &go_bytes("disk")[16..];
    assert_eq!(
        option_reply_type(&mut plain, NBD_OPT_GO, go),
        NBD_REP_ERR_TLS_REQD
    );
    assert_eq!(
        option_reply_type(&mut plain, NBD_OPT_LIST, &[]),
        NBD_REP_ERR_TLS_REQD
    );
    let mut tls = start_tls(plain, &ca);
    tls.write_all(&go_bytes("disk")).unwrap();
    let (size, _) = read_go_replies(&mut tls);
    assert_eq!(size, SIZE as u64);
    let mut client = Client::preconnected(tls, size);
    // 32 writes of 256 KiB sent before any reply is read, then 32 reads: 16 MiB each way
    // through the pump, more than its buffers and the socket's.
    const PIECE: usize = 256 << 10;
    let cookies: Vec<u64> = (0..32)
        .map(|i| {
            let data = pattern(i as u8, PIECE);
            client.send(Command::Write, 0, (i * PIECE) as u64, PIECE as u32, &data)
        })
        .collect();
    for _ in &cookies {
        assert_eq!(client.recv().error, 0);
    }
    let reads: std::collections::HashMap<u64, usize> = (0..32)
        .map(|i| {
            (
                client.send(Command::Read, 0, (i * PIECE) as u64, PIECE as u32, &[]),
                i,
            )
        })
        .collect();
    for _ in 0..32 {
        let reply = client.recv();
        assert_eq!(reply.error, 0);
        let piece = reads[&reply.cookie];
        assert!(
            reply.data == pattern(piece as u8, PIECE),
            "piece {piece} read back"
        );
    }
    client.send(Command::Disconnect, 0, 0, 0, &[]);
    drop(client);
    serving.join().unwrap();
}

#[test]
fn a_tls_client_vanishing_mid_request_ends_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    let ca = make_pki(dir.path());
    let server = tls_server(dir.path(), false);
    let (plain, serving) = connect(&server);
    let mut tls = start_tls(plain, &ca);
    tls.write_all(&go_bytes("disk")).unwrap();
    read_go_replies(&mut tls);
    let header = RequestHeader {
        flags: 0,
        command: Command::Write,
        cookie: 1,
        offset: 0,
        length: 1 << 20,
    };
    tls.write_all(&header.encode()).unwrap();
    tls.write_all(&[7u8; 4096]).unwrap();
    tls.flush().unwrap();
    drop(tls);
    let started = Instant::now();
    while !serving.is_finished() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the connection outlived its client"
        );
        thread::sleep(Duration::from_millis(20));
    }
    serving.join().unwrap();
}
