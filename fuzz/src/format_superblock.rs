//! `Superblock::decode` (one 64 KiB superblock copy) and `Superblock::choose`: never panic; a
//! copy whose checksum is right is never refused for its checksum; what decode accepts
//! encodes again (or is refused as too long, see below) and decodes to the same value.
//!
//! Input: the first bytes of a copy; the rest of the 64 KiB is zeros. Each input is decoded
//! as given and with its checksum recomputed, so mutations reach the version, layout, state
//! and volume-slot checks behind it.
//!
//! Names are NUL-padded UTF-8 decoded lossily (a name is for display): an invalid byte becomes
//! U+FFFD, three bytes, so a decoded name can be longer than its field and `encode` then
//! refuses it with `TooLong`. That is the one refusal allowed here.

use ssdcache_format::superblock::{NAME_LEN, PATH_LEN, STABLE_ID_LEN};
use ssdcache_format::{
    BackingIdentity, BackingKind, CacheMode, CacheState, Layout, Superblock, SuperblockError,
    VolumeCounters, VolumeSlot,
};

use crate::{fix_crc, padded, trimmed};

const CRC_AT: usize = 12;

pub fn check(data: &[u8]) {
    let original = padded(data, Superblock::COPY_SIZE);
    let as_given = Superblock::decode(&original);
    let mut copy = original.clone();
    fix_crc(&mut copy, CRC_AT);
    let fixed = Superblock::decode(&copy);
    if fixed.is_ok() {
        // choose() decodes both again: only worth its time when one copy is valid.
        let chosen = Superblock::choose(&original, &copy);
        assert_eq!(chosen.ok().as_ref(), fixed.as_ref().ok());
    } else {
        assert!(
            as_given.is_err(),
            "a copy is valid only with its checksum right"
        );
    }

    let superblock = match fixed {
        Ok(superblock) => superblock,
        Err(SuperblockError::BadChecksum { stored, computed }) => {
            panic!("a copy with a recomputed checksum was refused: stored {stored:#x}, computed {computed:#x}")
        }
        Err(_) => return,
    };
    match superblock.encode() {
        Ok(again) => assert_eq!(
            Superblock::decode(&again).as_ref(),
            Ok(&superblock),
            "decode(encode(superblock)) changed the superblock"
        ),
        Err(SuperblockError::TooLong(name, _)) => {
            assert!(
                name.contains('\u{fffd}'),
                "only a lossily decoded name may be too long: {name:?}"
            )
        }
        Err(error) => panic!("a decoded superblock does not encode: {error}"),
    }
}

/// Valid copies: no volume, one volume, and the most volumes with the longest names; stored
/// without their trailing zeros.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    let layouts = [
        (64u64 << 20, 65536u64),
        (16 << 20, 4096),
        (1 << 40, 1 << 20),
    ];
    for (index, (cache_size, line_size)) in layouts.into_iter().enumerate() {
        let Ok(layout) = Layout::compute(cache_size, line_size) else {
            continue;
        };
        let mut superblock = Superblock {
            version: ssdcache_format::FORMAT_VERSION,
            sequence: 3 + index as u64,
            cache_uuid: [0x5a; 16],
            layout,
            state: if index == 1 {
                CacheState::Running
            } else {
                CacheState::Clean
            },
            checkpoint_seq: 2,
            created_unix: 1_700_000_000,
            updated_unix: 1_700_000_500,
            unclean_starts: index as u64,
            journal_generation: 0xfeed,
            journal_start_seq: 9,
            journal_start_block: 4,
            cache_bytes_written: (index as u64) << 30,
            ssd_tbw_bytes: if index == 2 { 600_000_000_000_000 } else { 0 },
            volumes: Vec::new(),
        };
        let volumes = [0, 1, ssdcache_format::superblock::MAX_VOLUMES][index];
        superblock.volumes = (0..volumes)
            .map(|id| volume(id as u16, index == 2))
            .collect();
        if let Ok(copy) = superblock.encode() {
            seeds.push(trimmed(copy));
        }
    }
    seeds
}

fn volume(id: u16, longest_names: bool) -> VolumeSlot {
    let text = |len: usize, short: &str| {
        if longest_names {
            "n".repeat(len)
        } else {
            short.to_owned()
        }
    };
    VolumeSlot {
        id,
        uuid: [id as u8; 16],
        name: text(NAME_LEN, "sdb"),
        mode: [
            CacheMode::WriteBack,
            CacheMode::WriteThrough,
            CacheMode::WriteAround,
            CacheMode::PassThrough,
        ][usize::from(id) % 4],
        read_only: id % 2 == 1,
        backing: BackingIdentity {
            kind: if id.is_multiple_of(2) {
                BackingKind::BlockDevice
            } else {
                BackingKind::File
            },
            size: 1 << 40,
            path: text(PATH_LEN, "/dev/sdb"),
            stable_id: text(STABLE_ID_LEN, "devnum:8:16"),
            st_dev: 5,
            st_ino: 400,
            st_rdev: 2064,
            btime_ns: 0,
        },
        policy: 1,
        admission: 2,
        sequential_cutoff: 4 << 20,
        counters: VolumeCounters([7; VolumeCounters::COUNT]),
        dirty_lines: 3,
        dirty_bytes: 3 << 16,
    }
}
