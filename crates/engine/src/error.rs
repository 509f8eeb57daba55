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
    /// The volume's backing device could not be opened at start; the volume serves nothing
    /// until a restart finds it (its cached and dirty data are kept).
    #[error("volume {name} is offline: {reason}")]
    VolumeOffline { name: String, reason: String },
    /// A volume could not be added to the open cache; nothing was changed.
    #[error("cannot add volume '{name}': {why}")]
    AddRefused { name: String, why: String },
    #[error("{0}")]
    Format(String),
    /// Dirty data in the cache fails its checksum or cannot be read; the message names it.
    #[error("{0}")]
    DataDamaged(String),
    /// A check that guards user data failed (a slot about to be reused while the durable
    /// metadata may still name it, a journal commit that would overwrite live blocks...). The
    /// engine stops at once rather than write on.
    #[error("internal check failed: {0}")]
    Invariant(String),
    /// The engine stopped itself after a failed check; nothing more is written.
    #[error(
        "the cache stopped itself after an internal check failed ({0}); nothing more is \
         written to either device. Restart the daemon: the journal is replayed and the dirty \
         data it names is recovered. Please report this with the log"
    )]
    Halted(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;
