//! Interoperability with real clients (libnbd's `nbdcopy`/`nbdinfo`, QEMU's
//! `qemu-io`). A missing tool fails the test: scripts/install-deps installs them.

mod common;

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command as Process;
use std::sync::Arc;
use std::thread;

use common::*;
use ssdcache_nbd::{transmission_flags, Server, ServerConfig};

const SIZE: usize = 8 << 20;

fn tool_available(tool: &str) -> bool {
    let found = Process::new(tool).arg("--version").output().is_ok();
    assert!(found, "{tool} is not installed: run scripts/install-deps");
    found
}

/// Runs `body` against a server on a temporary Unix socket, then shuts the
/// server down and checks it stopped cleanly.
fn with_server(body: impl FnOnce(&str, &Path, &MemExport)) {
    let backend = MemExport::new(SIZE);
    let info = export_info("disk", SIZE as u64, transmission_flags(false));
    let exports = vec![served(info, Arc::clone(&backend))];
    let server = Server::new(exports, ServerConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let serving = server.clone();
    let serve = thread::spawn(move || serving.serve_unix(listener));
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    body(&uri, dir.path(), &backend);
    server.shutdown();
    assert!(serve.join().unwrap().is_ok());
    assert!(!backend.saw_misaligned_buffer());
}

fn run(tool: &str, args: &[&str]) -> String {
    let output = Process::new(tool).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let errors = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{tool} {args:?} failed: {text}{errors}"
    );
    text
}

#[test]
fn nbdcopy_round_trips_data_over_parallel_connections() {
    if !tool_available("nbdcopy") {
        return;
    }
    with_server(|uri, dir, backend| {
        let source = dir.join("source");
        let copy = dir.join("copy");
        let data: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&source, &data).unwrap();
        let (source, copy) = (source.to_str().unwrap(), copy.to_str().unwrap());
        run(
            "nbdcopy",
            &["--connections=4", "--requests=16", source, uri],
        );
        assert_eq!(backend.contents(0, SIZE), data);
        run("nbdcopy", &[uri, copy]);
        assert_eq!(std::fs::read(copy).unwrap(), data);
    });
}

#[test]
fn nbdinfo_sees_the_advertised_geometry() {
    if !tool_available("nbdinfo") {
        return;
    }
    with_server(|uri, _, _| {
        let info = run("nbdinfo", &[uri]);
        for expected in [
            "export-size: 8388608",
            "block_size_minimum: 4096",
            "can_multi_conn: true",
            "can_trim: true",
            "description: disk export",
        ] {
            assert!(info.contains(expected), "missing {expected:?} in:\n{info}");
        }
    });
}

#[test]
fn qemu_io_commands_work() {
    if !tool_available("qemu-io") {
        return;
    }
    with_server(|uri, _, backend| {
        let commands = [
            "write -P 7 0 1M",
            "read -P 7 0 1M",
            "write -z 64k 64k",
            "read -P 0 64k 64k",
            "discard 2M 1M",
            "flush",
            "read 4096 1000",
        ];
        let mut args = vec!["-f", "raw", uri];
        for command in &commands {
            args.extend(["-c", command]);
        }
        let output = run("qemu-io", &args);
        assert!(!output.contains("Pattern verification failed"), "{output}");
        assert_eq!(backend.contents(0, 4096), vec![7; 4096]);
        assert!(backend.calls().contains(&Call::Flush));
    });
}
