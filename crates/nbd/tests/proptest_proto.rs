//! Property tests: nothing a client sends can panic the protocol code.

use proptest::prelude::*;
use ssdcache_nbd::proto::*;
use ssdcache_nbd::{ExportInfo, Handshake, HandshakeOutcome, RequestHeader};

fn exports() -> Vec<ExportInfo> {
    vec![ExportInfo {
        name: "disk".into(),
        description: "test".into(),
        size: 1 << 30,
        flags: transmission_flags(false),
        min_block: 4096,
        preferred_block: 4096,
        max_block: 1 << 25,
    }]
}

/// Feeds `input` in the given chunk sizes and checks the machine's
/// invariants: it never consumes more than offered, and stops consuming once
/// it has an outcome.
fn run_handshake(input: &[u8], chunk_sizes: &[usize]) -> Handshake {
    let mut handshake = Handshake::new(exports());
    let mut rest = input;
    let mut sizes = chunk_sizes.iter().cycle();
    while !rest.is_empty() {
        let size = sizes.next().copied().unwrap_or(1).clamp(1, rest.len());
        let consumed = handshake.feed(&rest[..size]);
        assert!(consumed <= size);
        if handshake.outcome().is_some() {
            assert_eq!(handshake.feed(rest), 0);
            break;
        }
        assert_eq!(consumed, size, "consumes everything while negotiating");
        rest = &rest[size..];
        handshake.take_output();
    }
    handshake
}

/// A structurally plausible option: right magic, any option number, payload
/// that may or may not match what the option expects.
fn option_strategy() -> impl Strategy<Value = Vec<u8>> {
    let option = prop_oneof![0u32..16, any::<u32>()];
    let payload = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        ("[a-z]{0,6}", proptest::collection::vec(any::<u16>(), 0..5)).prop_map(|(name, infos)| {
            let mut data = (name.len() as u32).to_be_bytes().to_vec();
            data.extend_from_slice(name.as_bytes());
            data.extend_from_slice(&(infos.len() as u16).to_be_bytes());
            for info in infos {
                data.extend_from_slice(&info.to_be_bytes());
            }
            data
        }),
    ];
    (option, payload, any::<bool>(), any::<u32>()).prop_map(|(option, payload, lie, length)| {
        let mut out = IHAVEOPT.to_be_bytes().to_vec();
        out.extend_from_slice(&option.to_be_bytes());
        // Sometimes lie about the length to exercise the length bound.
        let declared = if lie { length } else { payload.len() as u32 };
        out.extend_from_slice(&declared.to_be_bytes());
        out.extend_from_slice(&payload);
        out
    })
}

proptest! {
    #[test]
    fn random_bytes_never_panic_the_handshake(
        input in proptest::collection::vec(any::<u8>(), 0..512),
        chunks in proptest::collection::vec(1usize..40, 1..8),
    ) {
        let handshake = run_handshake(&input, &chunks);
        if handshake.outcome().is_none() {
            prop_assert!(handshake.bytes_needed() > 0);
        }
    }

    #[test]
    fn random_option_sequences_never_panic_the_handshake(
        flags in prop_oneof![Just(1u32), Just(3u32), any::<u32>()],
        options in proptest::collection::vec(option_strategy(), 0..8),
        chunks in proptest::collection::vec(1usize..64, 1..8),
    ) {
        let mut input = flags.to_be_bytes().to_vec();
        for option in &options {
            input.extend_from_slice(option);
        }
        let handshake = run_handshake(&input, &chunks);
        if let Some(HandshakeOutcome::Transmission { export, .. }) = handshake.outcome() {
            prop_assert_eq!(*export, 0);
        }
    }

    #[test]
    fn random_headers_never_panic_parsing_or_validation(
        raw in proptest::array::uniform28(any::<u8>()),
        force_magic in any::<bool>(),
        max_payload in any::<u32>(),
        min_block in prop_oneof![Just(1u32), Just(512), Just(4096), Just(65536)],
        size in any::<u64>(),
    ) {
        let mut raw = raw;
        if force_magic {
            raw[0..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        }
        let mut info = exports().remove(0);
        info.min_block = min_block;
        info.size = size;
        match RequestHeader::parse(&raw) {
            Ok(header) => {
                prop_assert_eq!(header.encode(), raw);
                let _ = validate_request(&header, &info, max_payload, &Session::default());
            }
            Err(_) => prop_assert!(!force_magic),
        }
    }
}
