//! Test fixtures: an in-memory export and a minimal NBD client.

#![allow(dead_code)]

pub mod ring_backend;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

use ssdcache_nbd::proto::*;
use ssdcache_nbd::{Command, Errno, Export, ExportInfo, RequestHeader, ServerExport};

pub const BLOCK: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        len: usize,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u64,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    },
    Cache {
        offset: u64,
        length: u64,
    },
}

/// A `Vec<u8>` behind a mutex that records calls, checks buffer alignment,
/// and can hold reads at one offset until released.
pub struct MemExport {
    data: Mutex<Vec<u8>>,
    calls: Mutex<Vec<Call>>,
    misaligned_buffer_seen: AtomicBool,
    held_offset: Option<u64>,
    released: Mutex<bool>,
    release_signal: Condvar,
    held_read_started: Mutex<Option<mpsc::Sender<u64>>>,
}

impl MemExport {
    pub fn new(size: usize) -> Arc<MemExport> {
        Arc::new(Self::build(size, None, None))
    }

    /// Reads at `offset` block until [`MemExport::release`]; `started` hears
    /// about each such read as it begins.
    pub fn holding_reads_at(size: usize, offset: u64, started: mpsc::Sender<u64>) -> Arc<Self> {
        Arc::new(Self::build(size, Some(offset), Some(started)))
    }

    fn build(size: usize, held_offset: Option<u64>, started: Option<mpsc::Sender<u64>>) -> Self {
        MemExport {
            data: Mutex::new(vec![0; size]),
            calls: Mutex::new(Vec::new()),
            misaligned_buffer_seen: AtomicBool::new(false),
            held_offset,
            released: Mutex::new(false),
            release_signal: Condvar::new(),
            held_read_started: Mutex::new(started),
        }
    }

    pub fn release(&self) {
        *self.released.lock().unwrap() = true;
        self.release_signal.notify_all();
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    pub fn saw_misaligned_buffer(&self) -> bool {
        self.misaligned_buffer_seen.load(Ordering::SeqCst)
    }

    pub fn contents(&self, offset: usize, len: usize) -> Vec<u8> {
        self.data.lock().unwrap()[offset..offset + len].to_vec()
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }

    fn check_alignment(&self, ptr: *const u8) {
        if !(ptr as usize).is_multiple_of(BLOCK) {
            self.misaligned_buffer_seen.store(true, Ordering::SeqCst);
        }
    }

    /// Gives up after 10 s so a broken test fails instead of hanging.
    fn wait_if_held(&self, offset: u64) -> Result<(), Errno> {
        if self.held_offset != Some(offset) {
            return Ok(());
        }
        if let Some(started) = self.held_read_started.lock().unwrap().as_ref() {
            let _ = started.send(offset);
        }
        let released = self.released.lock().unwrap();
        let (released, _) = self
            .release_signal
            .wait_timeout_while(released, Duration::from_secs(10), |r| !*r)
            .unwrap();
        if *released {
            Ok(())
        } else {
            Err(Errno::Io)
        }
    }
}

impl Export for MemExport {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.check_alignment(buf.as_ptr());
        self.record(Call::Read {
            offset,
            len: buf.len(),
        });
        self.wait_if_held(offset)?;
        let start = offset as usize;
        buf.copy_from_slice(&self.data.lock().unwrap()[start..start + buf.len()]);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        self.check_alignment(data.as_ptr());
        self.record(Call::Write {
            offset,
            len: data.len(),
            fua,
        });
        let start = offset as usize;
        self.data.lock().unwrap()[start..start + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn flush(&self) -> Result<(), Errno> {
        self.record(Call::Flush);
        Ok(())
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno> {
        self.record(Call::Trim {
            offset,
            length,
            fua,
        });
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno> {
        self.record(Call::WriteZeroes {
            offset,
            length,
            fua,
            may_trim,
        });
        let (start, end) = (offset as usize, (offset + length) as usize);
        self.data.lock().unwrap()[start..end].fill(0);
        Ok(())
    }

    fn cache(&self, offset: u64, length: u64) -> Result<(), Errno> {
        self.record(Call::Cache { offset, length });
        // Lets tests check backend errors reach the client.
        if offset == 0 && length == 3 * BLOCK as u64 {
            return Err(Errno::Io);
        }
        Ok(())
    }
}

pub fn export_info(name: &str, size: u64, flags: u16) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: format!("{name} export"),
        size,
        flags,
        min_block: BLOCK as u32,
        preferred_block: BLOCK as u32,
        max_block: 32 << 20,
    }
}

pub fn served(info: ExportInfo, backend: Arc<MemExport>) -> ServerExport {
    ServerExport { info, backend }
}

pub fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = IHAVEOPT.to_be_bytes().to_vec();
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

pub fn go_bytes(name: &str) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    option_bytes(NBD_OPT_GO, &data)
}

/// What the client knows about one reply.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
    pub data: Vec<u8>,
}

/// A minimal blocking NBD client that tracks pending requests by cookie, so
/// it knows which replies carry read data.
pub struct Client<S: Read + Write> {
    pub stream: S,
    pub size: u64,
    pub flags: u16,
    pending: HashMap<u64, (Command, u32)>,
    next_cookie: u64,
}

impl<S: Read + Write> Client<S> {
    /// Performs the greeting, client flags and `NBD_OPT_GO` for `name`.
    pub fn go(mut stream: S, name: &str) -> Client<S> {
        read_greeting(&mut stream);
        stream
            .write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())
            .unwrap();
        stream.write_all(&go_bytes(name)).unwrap();
        let (size, flags) = read_go_replies(&mut stream);
        Client {
            stream,
            size,
            flags,
            pending: HashMap::new(),
            next_cookie: 1,
        }
    }

    /// A client on a socket that skipped the handshake.
    pub fn preconnected(stream: S, size: u64) -> Client<S> {
        Client {
            stream,
            size,
            flags: 0,
            pending: HashMap::new(),
            next_cookie: 1,
        }
    }

    /// Sends a request and returns its cookie.
    pub fn send(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        self.stream.write_all(&header.encode()).unwrap();
        self.stream.write_all(payload).unwrap();
        self.pending.insert(cookie, (command, length));
        cookie
    }

    pub fn recv(&mut self) -> Reply {
        let mut header = [0u8; 16];
        self.stream.read_exact(&mut header).expect("reply header");
        assert_eq!(&header[0..4], &NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
        let error = u32::from_be_bytes(header[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let (command, length) = self
            .pending
            .remove(&cookie)
            .expect("reply to a pending cookie");
        let mut data = Vec::new();
        if error == 0 && command == Command::Read {
            data = vec![0; length as usize];
            self.stream.read_exact(&mut data).expect("read data");
        }
        Reply {
            cookie,
            error,
            data,
        }
    }

    /// Sends one request and waits for its reply.
    pub fn call(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Reply {
        let cookie = self.send(command, flags, offset, length, payload);
        let reply = self.recv();
        assert_eq!(reply.cookie, cookie);
        reply
    }

    pub fn read(&mut self, offset: u64, length: u32) -> Result<Vec<u8>, u32> {
        let reply = self.call(Command::Read, 0, offset, length, &[]);
        if reply.error == 0 {
            Ok(reply.data)
        } else {
            Err(reply.error)
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.call(Command::Write, 0, offset, data.len() as u32, data)
            .error
    }

    /// True if the server has closed the connection.
    pub fn at_eof(&mut self) -> bool {
        let mut byte = [0u8; 1];
        matches!(self.stream.read(&mut byte), Ok(0) | Err(_))
    }
}

pub fn read_greeting(stream: &mut impl Read) {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[0..16], b"NBDMAGICIHAVEOPT");
}

/// Reads option replies up to the final ACK; returns size and flags.
pub fn read_go_replies(stream: &mut impl Read) -> (u64, u16) {
    let mut export = None;
    loop {
        let mut header = [0u8; 20];
        stream.read_exact(&mut header).expect("option reply");
        let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
        let mut payload = vec![0; len];
        stream.read_exact(&mut payload).unwrap();
        match reply_type {
            NBD_REP_ACK => return export.expect("NBD_INFO_EXPORT before ACK"),
            NBD_REP_INFO if payload[0..2] == NBD_INFO_EXPORT.to_be_bytes() => {
                let size = u64::from_be_bytes(payload[2..10].try_into().unwrap());
                let flags = u16::from_be_bytes(payload[10..12].try_into().unwrap());
                export = Some((size, flags));
            }
            NBD_REP_INFO => {}
            other => panic!("unexpected option reply {other:#x}: {payload:?}"),
        }
    }
}

pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

/// The thread serving one test connection.
pub type Serving = std::thread::JoinHandle<Result<(), ssdcache_nbd::ConnectionError>>;

/// Serves `backend` as the export "disk" of `size` bytes with `config` over a socket pair:
/// the server, a negotiated client whose reads give up after `limit`, and the serving thread.
pub fn serve_disk(
    backend: Arc<dyn Export>,
    size: u64,
    config: ssdcache_nbd::ServerConfig,
    limit: Duration,
) -> (
    ssdcache_nbd::Server,
    Client<std::os::unix::net::UnixStream>,
    Serving,
) {
    let export = ServerExport {
        info: export_info("disk", size, ssdcache_nbd::transmission_flags(false)),
        backend,
    };
    let server = ssdcache_nbd::Server::new(vec![export], config).unwrap();
    let (client, server_end) = std::os::unix::net::UnixStream::pair().unwrap();
    client.set_read_timeout(Some(limit)).unwrap();
    let serving = server.clone();
    let handle = std::thread::spawn(move || serving.serve_stream(server_end));
    (server, Client::go(client, "disk"), handle)
}
