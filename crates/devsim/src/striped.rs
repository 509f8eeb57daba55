//! A device in RAM split into chunks, each behind its own lock: reads of different chunks
//! share no lock word, so a benchmark of the engine's hits on several threads measures the
//! engine, not the device (`MemDevice` has one lock for all its bytes, and every read takes
//! it). A request spanning chunks is not atomic against a concurrent one, as on a real
//! device: for benchmarks, not for tests that compare exact contents under races.

use std::io;
use std::sync::RwLock;

use ssdcache_device::BlockDevice;

/// Bytes per chunk: one 64 KiB cache line, so hits on different lines of a 64 KiB-line
/// cache never take the same lock.
const CHUNK: usize = 64 * 1024;

pub struct StripedMemDevice {
    chunks: Vec<RwLock<Box<[u8]>>>,
    size: u64,
    name: String,
}

impl StripedMemDevice {
    /// A zeroed device of `size` bytes (the last chunk may be short).
    pub fn new(name: &str, size: u64) -> StripedMemDevice {
        let size_bytes = size as usize;
        let chunks = (0..size_bytes.div_ceil(CHUNK))
            .map(|i| {
                let len = CHUNK.min(size_bytes - i * CHUNK);
                RwLock::new(vec![0u8; len].into_boxed_slice())
            })
            .collect();
        StripedMemDevice {
            chunks,
            size,
            name: name.to_owned(),
        }
    }

    /// Calls `each(chunk, offset in the chunk, range of the request)` for every piece of
    /// `[offset, offset + len)` in order; an error when the range runs past the end.
    fn for_pieces(
        &self,
        offset: u64,
        len: usize,
        mut each: impl FnMut(usize, usize, std::ops::Range<usize>) -> io::Result<()>,
    ) -> io::Result<()> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.size)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{}: access past the end", self.name),
            ));
        }
        let mut done = 0;
        while done < len {
            let at = offset as usize + done;
            let piece = (CHUNK - at % CHUNK).min(len - done);
            each(at / CHUNK, at % CHUNK, done..done + piece)?;
            done += piece;
        }
        Ok(())
    }
}

fn poisoned() -> io::Error {
    io::Error::other("memory device lock poisoned")
}

impl BlockDevice for StripedMemDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.for_pieces(offset, buf.len(), |chunk, at, part| {
            let data = self.chunks[chunk].read().map_err(|_| poisoned())?;
            buf[part.clone()].copy_from_slice(&data[at..at + part.len()]);
            Ok(())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.for_pieces(offset, buf.len(), |chunk, at, part| {
            let mut data = self.chunks[chunk].write().map_err(|_| poisoned())?;
            data[at..at + part.len()].copy_from_slice(&buf[part]);
            Ok(())
        })
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.write_zeroes(offset, len)?;
        Ok(true)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidInput, "write_zeroes length too large")
        })?;
        self.for_pieces(offset, len, |chunk, at, part| {
            let mut data = self.chunks[chunk].write().map_err(|_| poisoned())?;
            data[at..at + part.len()].fill(0);
            Ok(())
        })
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    /// Writes, reads and zeroes across chunk edges give what one flat memory device gives.
    #[test]
    fn matches_a_flat_memory_device_across_chunk_edges() {
        let size = 3 * CHUNK as u64 + 12_288;
        let striped = StripedMemDevice::new("striped", size);
        let flat = MemDevice::new("flat", size);
        let mut seed = 7u64;
        for step in 0..300u64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let offset = (seed >> 20) % size;
            let len = ((seed >> 8) % 200_000).min(size - offset) as usize;
            let fill: Vec<u8> = (0..len).map(|i| (i as u64 + step) as u8).collect();
            match step % 3 {
                0 | 1 => {
                    striped.write_at(&fill, offset).unwrap();
                    flat.write_at(&fill, offset).unwrap();
                }
                _ => {
                    striped.write_zeroes(offset, len as u64).unwrap();
                    flat.write_zeroes(offset, len as u64).unwrap();
                }
            }
        }
        let mut got = vec![0u8; size as usize];
        striped.read_at(&mut got, 0).unwrap();
        assert!(got == flat.snapshot(), "contents differ");
        let mut one = [0u8; 1];
        assert!(striped.read_at(&mut one, size).is_err(), "past the end");
        assert!(striped.read_at(&mut [], size).is_ok(), "empty at the end");
    }
}
