//! The rings (and staging buffers) batched reads use are bounded for the whole process, not
//! one per thread: the NBD server has up to 32 fast workers per connection, and a ring with a
//! 256 KiB staging buffer for each of them broke the daemon's memory bound under
//! `tests/e2e/t-load.sh` (770 MiB against 726 MiB at 64 connections). This runs in its own
//! process so the counters are this test's alone.

use std::io;
use std::sync::{Arc, Barrier};

use ssdcache_device::uring::{io_uring_reads, io_uring_rings_made, max_rings};
use ssdcache_device::{BlockDevice, DeviceRead, FileDevice, OpenOptions};

const BLOCKS: usize = 64;
const THREADS: usize = 200;
const ROUNDS: usize = 20;

#[test]
fn many_threads_batching_share_a_bounded_set_of_rings() -> io::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("dev");
    let data: Vec<u8> = (0..BLOCKS).flat_map(|i| [i as u8; 4096]).collect();
    std::fs::write(&path, data)?;
    let opts = OpenOptions {
        write: false,
        direct: true,
        lock: false,
    };
    let dev = Arc::new(FileDevice::open(&path, opts)?);
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let dev = Arc::clone(&dev);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                for round in 0..ROUNDS {
                    let mut bufs = vec![vec![0u8; 4096]; 8];
                    let offsets: Vec<u64> = (0..8)
                        .map(|k| ((t * 7 + round * 3 + k) % BLOCKS) as u64 * 4096)
                        .collect();
                    let mut reads: Vec<DeviceRead<'_>> = offsets
                        .iter()
                        .zip(bufs.iter_mut())
                        .map(|(&o, b)| DeviceRead::new(o, &mut b[..]))
                        .collect();
                    dev.read_many(&mut reads);
                    for read in &reads {
                        assert!(read.result.is_ok(), "read at {} failed", read.offset);
                        let block = (read.offset / 4096) as u8;
                        assert!(read.buf.iter().all(|&b| b == block), "wrong data");
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        assert!(thread.join().is_ok(), "a reading thread panicked");
    }
    // This test needs io_uring (the server's hits use it): fail, not skip, without it.
    assert!(io_uring_reads() > 0, "no read went through io_uring");
    let made = io_uring_rings_made();
    assert!(
        made <= max_rings() as u64,
        "{THREADS} threads made {made} rings; the process may make at most {}",
        max_rings()
    );
    Ok(())
}
