//! Runs a workload over N NBD connections, each with a sending and a receiving thread (one
//! thread doing both could deadlock: the server stops reading while its replies are unread).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ssdcache_device::SplitMix64;
use ssdcache_nbd::client::{
    connect, ClientConfig, ClientError, Connection, ExportDetails, ReplyReceiver, Request,
    RequestSender,
};
use ssdcache_nbd::Command;

/// One request a workload wants sent (a WRITE's payload is in the sender's buffer).
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub command: Command,
    pub fua: bool,
    pub offset: u64,
    pub length: u32,
}

/// What the connections run.
pub trait Workload: Sync {
    type Tag: Send;
    /// The next request of connection `conn` (a WRITE's data goes into `payload`); `None`
    /// ends the connection's sending.
    fn next(
        &self,
        conn: usize,
        rng: &mut SplitMix64,
        payload: &mut Vec<u8>,
    ) -> Option<(Spec, Self::Tag)>;
    /// A reply arrived (`data` holds a successful READ's data).
    fn done(&self, conn: usize, result: Result<(), u32>, tag: Self::Tag, data: &[u8]);
    /// Something ended a connection early: stop sending everywhere.
    fn stop(&self);
}

/// How one connection ended.
pub enum Ending {
    Clean,
    /// EOF, reset or broken pipe: the server went away.
    ServerGone(String),
    Failed(String),
}

/// Connection settings.
pub struct Plan<'a> {
    pub socket: &'a Path,
    pub export: &'a str,
    pub connections: usize,
    pub depth: usize,
    pub max_request: u32,
    pub io_timeout: Duration,
    pub seed: u64,
}

type Halves<T> = Connection<UnixStream, T>;

/// Opens every connection (the handshakes, in turn) before any request is sent.
pub fn open<T>(plan: &Plan<'_>) -> Result<(Vec<Halves<T>>, ExportDetails)> {
    let config = ClientConfig {
        max_in_flight: plan.depth,
        max_request: plan.max_request,
        handshake_timeout: plan.io_timeout,
        io_timeout: Some(plan.io_timeout),
    };
    let mut halves = Vec::with_capacity(plan.connections);
    for index in 0..plan.connections {
        let stream = UnixStream::connect(plan.socket).with_context(|| {
            format!(
                "connection {index}: cannot connect to {}",
                plan.socket.display()
            )
        })?;
        let pair = connect(stream, plan.export, &config)
            .with_context(|| format!("connection {index}: NBD handshake failed"))?;
        halves.push(pair);
    }
    let export = halves[0].0.export().clone();
    Ok((halves, export))
}

/// Runs `workload` on every connection until each has sent its last request and had every
/// reply; `tick` is called about every `tick_every` meanwhile (progress lines).
pub fn run<W: Workload>(
    plan: &Plan<'_>,
    halves: Vec<Halves<W::Tag>>,
    workload: &W,
    tick_every: Duration,
    mut tick: impl FnMut(),
) -> Vec<Ending> {
    let running = AtomicUsize::new(halves.len());
    let endings = thread::scope(|scope| {
        let handles: Vec<_> = halves
            .into_iter()
            .enumerate()
            .map(|(conn, (sender, receiver))| {
                let running = &running;
                let seed = plan.seed ^ (conn as u64).wrapping_mul(0x2545_F491_4F6C_DD1D);
                scope.spawn(move || {
                    let ending = drive(conn, seed, sender, receiver, workload);
                    running.fetch_sub(1, Ordering::SeqCst);
                    ending
                })
            })
            .collect();
        let mut last_tick = Instant::now();
        while running.load(Ordering::SeqCst) > 0 {
            thread::sleep(Duration::from_millis(50));
            if last_tick.elapsed() >= tick_every {
                tick();
                last_tick = Instant::now();
            }
        }
        let panicked = || Ending::Failed("a connection thread panicked".into());
        let endings: Vec<Ending> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| panicked()))
            .collect();
        endings
    });
    endings
}

/// One connection: sends on its own thread, receives on this one.
fn drive<W: Workload>(
    conn: usize,
    seed: u64,
    sender: RequestSender<UnixStream, W::Tag>,
    mut receiver: ReplyReceiver<UnixStream, W::Tag>,
    workload: &W,
) -> Ending {
    let sending_done = AtomicBool::new(false);
    thread::scope(|scope| {
        let sending = scope.spawn(|| {
            let result = send_all(conn, seed, sender, workload, &sending_done);
            if result.is_err() {
                workload.stop();
            }
            result
        });
        let mut data = Vec::new();
        let received = loop {
            match receiver.recv(&mut data) {
                Ok(reply) => workload.done(conn, reply.result, reply.tag, &data),
                Err(ClientError::Closed { in_flight: 0 })
                    if sending_done.load(Ordering::SeqCst) =>
                {
                    break Ok(());
                }
                Err(error) => break Err(error),
            }
        };
        if received.is_err() {
            workload.stop();
        }
        let sent = sending
            .join()
            .unwrap_or_else(|_| Err(ClientError::Protocol("the sending thread panicked".into())));
        ending(conn, received.and(sent))
    })
}

fn send_all<W: Workload>(
    conn: usize,
    seed: u64,
    mut sender: RequestSender<UnixStream, W::Tag>,
    workload: &W,
    sending_done: &AtomicBool,
) -> Result<(), ClientError> {
    let mut rng = SplitMix64(seed);
    let mut payload = Vec::new();
    loop {
        sender.wait_for_slot()?;
        let Some((spec, tag)) = workload.next(conn, &mut rng, &mut payload) else {
            break;
        };
        let request = match spec.command {
            Command::Read => Request::read(spec.offset, spec.length),
            Command::Write => Request::write(spec.offset, &payload),
            Command::Trim => Request::trim(spec.offset, spec.length),
            Command::WriteZeroes => Request::write_zeroes(spec.offset, spec.length),
            _ => Request::flush(),
        };
        let request = if spec.fua { request.fua() } else { request };
        sender.send(request, tag)?;
    }
    sender.wait_until_idle()?;
    sending_done.store(true, Ordering::SeqCst);
    sender.disconnect()
}

fn ending(conn: usize, result: Result<(), ClientError>) -> Ending {
    match result {
        Ok(()) => Ending::Clean,
        Err(error) if error.is_disconnect() => {
            Ending::ServerGone(format!("connection {conn}: {error}"))
        }
        Err(error) => Ending::Failed(format!("connection {conn}: {error}")),
    }
}
