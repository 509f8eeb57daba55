//! Backing devices reached over the network. Today: an NBD export (`nbd://`, `nbd+unix://`)
//! as a [`ssdcache_device::BlockDevice`], on the client of crate `ssdcache-nbd`, with several
//! connections when the server allows, reconnection with backoff, and a replay log so writes a
//! restarted server lost before a FLUSH are sent again ([`NbdDevice`]).
//!
//! It stands apart from `ssdcache-device` (local files and disks) so the daemon's local path
//! links no network code it does not use, and so other network backings (iSCSI, a RAM tier's
//! peer) can sit beside it without touching the engine: the engine sees only `BlockDevice`.

mod device;
mod replay;
mod stream;
mod uri;

pub use device::{
    export_stamp, NbdDevice, RemoteConfig, RemoteError, RemoteStatus, DATALESS_PIECE,
    FIRST_BACKOFF, MAX_BACKOFF,
};
pub use uri::{is_nbd_uri, Endpoint, NbdUri, TlsSettings, UriError, DEFAULT_PORT};
