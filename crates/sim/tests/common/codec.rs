//! The compressions trace files come in, to write test files with.

use std::io::Write;

use ssdcache_sim::trace::Compression;

#[derive(Clone, Copy, Debug)]
pub enum Codec {
    Zstd,
    Gzip,
    Bzip2,
    Xz,
}

pub const CODECS: [Codec; 4] = [Codec::Zstd, Codec::Gzip, Codec::Bzip2, Codec::Xz];

impl Codec {
    pub fn compress(self, data: &[u8]) -> Vec<u8> {
        match self {
            Codec::Zstd => zstd::encode_all(data, 3).unwrap(),
            Codec::Gzip => {
                let mut encoder =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                encoder.write_all(data).unwrap();
                encoder.finish().unwrap()
            }
            Codec::Bzip2 => {
                let mut encoder =
                    bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::default());
                encoder.write_all(data).unwrap();
                encoder.finish().unwrap()
            }
            Codec::Xz => {
                let mut encoder = liblzma::write::XzEncoder::new(Vec::new(), 6);
                encoder.write_all(data).unwrap();
                encoder.finish().unwrap()
            }
        }
    }

    pub fn compression(self) -> Compression {
        match self {
            Codec::Zstd => Compression::Zstd,
            Codec::Gzip => Compression::Gzip,
            Codec::Bzip2 => Compression::Bzip2,
            Codec::Xz => Compression::Xz,
        }
    }

    pub fn extension(self) -> &'static str {
        match self {
            Codec::Zstd => "zst",
            Codec::Gzip => "gz",
            Codec::Bzip2 => "bz2",
            Codec::Xz => "xz",
        }
    }
}
