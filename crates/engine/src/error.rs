use std::io;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("backing device {device}: {source}")]
    Backing { device: String, source: io::Error },
    #[error("cache device {device}: {source}")]
    CacheDevice { device: String, source: io::Error },
    #[error("request [{offset}, +{length}) is outside the volume ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("request [{offset}, +{length}) is not aligned to 4096 bytes")]
    Misaligned { offset: u64, length: u64 },
    #[error("volume {0} is read-only")]
    ReadOnly(String),
    #[error("{0}")]
    Format(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;
