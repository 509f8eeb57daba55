//! Ring READs the completion thread hands to the slow lane while no thread can be started
//! (RLIMIT_NPROC as uid 65534: root ignores the limit, so the test drops to that uid for the
//! whole process; this file holds one test, its scenarios run in turn).
//!
//! Review 33: such a READ was "left queued" until some later slow request came: with none (a
//! read-only client whose reads are all fast hits) it was never answered. Now the completion
//! thread tries to start a worker at every reap and closes the connection when none could be
//! started for 2 s (it must not serve the read itself: review 31's deadlock): the client sees
//! an answer or a disconnect, never a hang.
//!
//! Review 34: when no slow worker can be started, a fast worker serves the slow queue itself
//! (review13 R13-4); that stand-in counts as a worker, so a 3 s FLUSH it serves is not cut off
//! by the 2 s limit (the kernel client would see an I/O error on it).

mod common;

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ring_backend::{Backend, SIZE};
use common::*;
use ssdcache_nbd::{Command, Export, ServerConfig};

fn set_nproc(soft: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) };
    lim.rlim_cur = soft.min(lim.rlim_max);
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NPROC, &lim) }, 0);
}

#[test]
fn ring_reads_for_the_slow_lane_when_no_thread_can_start() {
    if unsafe { libc::geteuid() } == 0 {
        // Root ignores RLIMIT_NPROC: become nobody (the whole process).
        assert_eq!(unsafe { libc::setgid(65534) }, 0);
        assert_eq!(unsafe { libc::setuid(65534) }, 0);
    }
    unserved_read_without_a_worker_never_hangs();
    a_connection_whose_slow_queue_is_being_served_is_not_closed();
}

/// Review 33: a ring READ left unserved with no slow worker: answered or disconnected.
fn unserved_read_without_a_worker_never_hangs() {
    let backend = Backend::unserving(Duration::ZERO);
    let config = ServerConfig {
        fast_threads_per_connection: 1,
        ..ServerConfig::default()
    };
    let (_server, mut client, _handle) = serve_disk(
        backend.clone() as Arc<dyn Export>,
        SIZE,
        config,
        Duration::from_secs(60),
    );
    // Transmission runs (completion and sender threads started): an odd block, no ring.
    assert!(client.read(BLOCK as u64, BLOCK as u32).unwrap() == pattern(1, BLOCK));
    // From now on no thread can be created.
    set_nproc(1);
    let probe = std::thread::Builder::new().spawn(|| ());
    assert!(probe.is_err(), "thread creation fails now");
    // An even block: the ring ends it unserved, the completion thread queues it for a slow
    // worker it cannot start.
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    client
        .stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let t = Instant::now();
    let mut first = [0u8; 1];
    let outcome = client.stream.read(&mut first);
    eprintln!("after {:?}: {outcome:?}", t.elapsed());
    set_nproc(u64::MAX);
    // A reply byte, or the end of the stream (the connection closed): either within 5 s.
    // A timeout (WouldBlock/TimedOut) is the hang.
    assert!(
        outcome.is_ok(),
        "the READ the ring left unserved sat in the slow queue with no worker and the \
         connection stayed open: {outcome:?} after {:?}",
        t.elapsed()
    );
}

/// Review 34: a FLUSH a stand-in fast worker serves for 3 s is not cut off at 2 s.
fn a_connection_whose_slow_queue_is_being_served_is_not_closed() {
    let backend = Backend::unserving(Duration::from_secs(3));
    let config = ServerConfig {
        fast_threads_per_connection: 2,
        ..ServerConfig::default()
    };
    let (_server, mut client, _handle) = serve_disk(
        backend.clone() as Arc<dyn Export>,
        SIZE,
        config,
        Duration::from_secs(60),
    );
    assert!(client.read(BLOCK as u64, BLOCK as u32).unwrap() == pattern(1, BLOCK));
    assert!(client.read(3 * BLOCK as u64, BLOCK as u32).unwrap() == pattern(3, BLOCK));
    set_nproc(1);
    assert!(
        std::thread::Builder::new().spawn(|| ()).is_err(),
        "thread creation fails now"
    );
    // A FLUSH: no slow worker can start, so the fast worker that read it serves it itself
    // (3 s, progressing). Then a READ the ring leaves unserved joins the slow queue, which
    // that fast worker serves next.
    client.send(Command::Flush, 0, 0, 0, &[]);
    std::thread::sleep(Duration::from_millis(200));
    client.send(Command::Read, 0, 0, BLOCK as u32, &[]);
    client
        .stream
        .set_read_timeout(Some(Duration::from_secs(8)))
        .unwrap();
    let t = Instant::now();
    let mut first = [0u8; 16];
    let outcome = client.stream.read(&mut first);
    let took = t.elapsed();
    set_nproc(u64::MAX);
    eprintln!("first reply after {took:?}: {outcome:?}");
    assert!(
        matches!(outcome, Ok(n) if n > 0),
        "the connection was closed after {took:?} while its FLUSH was being served: {outcome:?}"
    );
}
