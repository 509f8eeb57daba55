//! The sans-I/O NBD handshake (`ssdcache_nbd::Handshake`) fed arbitrary client bytes: it never
//! panics; it consumes nothing past the end of the handshake and stops asking for bytes once
//! it has an outcome; feeding the bytes in pieces gives the same output, outcome and
//! consumption as feeding them at once; and its output is well-formed: the greeting, then
//! option replies (magic, the option asked, a length that matches the payload), and for
//! `NBD_OPT_EXPORT_NAME` the export's size and flags.
//!
//! Input: byte 0 sets the piece size (1 + b % 32; 0 means one piece), the rest is what the
//! client sends.

use ssdcache_nbd::proto::{
    IHAVEOPT, NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES, NBD_INFO_DESCRIPTION, NBD_INFO_NAME,
    NBD_OPT_ABORT, NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_LIST,
    NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT, NBD_OPT_STARTTLS,
    NBD_OPT_STRUCTURED_REPLY, NBD_REP_MAGIC,
};
use ssdcache_nbd::{transmission_flags, ExportInfo, Handshake, HandshakeOutcome};

/// Greeting: `NBDMAGIC`, `IHAVEOPT`, 16-bit handshake flags.
pub const GREETING_LEN: usize = 18;
/// Option reply header: magic, option, reply type, payload length.
const REPLY_HEADER_LEN: usize = 20;

/// The exports the fuzzed server offers (the first is the default, empty-name export).
pub fn exports() -> Vec<ExportInfo> {
    vec![
        ExportInfo {
            name: "disk".into(),
            description: "fuzzed export".into(),
            size: 256 << 10,
            flags: transmission_flags(false),
            min_block: 512,
            preferred_block: 4096,
            max_block: 64 << 10,
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size: 64 << 10,
            flags: transmission_flags(true),
            min_block: 4096,
            preferred_block: 4096,
            max_block: 64 << 10,
        },
    ]
}

/// What a handshake did with some input.
#[derive(Debug, PartialEq, Eq)]
pub struct Run {
    pub output: Vec<u8>,
    pub consumed: usize,
    pub outcome: Option<HandshakeOutcome>,
}

/// Feeds `input` to a new handshake in pieces of `piece` bytes (all at once for 0), as a
/// driver does: feeding stops once there is an outcome.
pub fn run(input: &[u8], piece: usize) -> Run {
    let mut machine = Handshake::new(exports());
    let mut output = machine.take_output();
    let mut consumed = 0;
    let piece = if piece == 0 {
        input.len().max(1)
    } else {
        piece
    };
    for chunk in input.chunks(piece) {
        if machine.outcome().is_some() {
            break;
        }
        assert!(machine.bytes_needed() > 0, "no outcome, yet no byte needed");
        let used = machine.feed(chunk);
        assert!(used <= chunk.len());
        assert!(
            used == chunk.len() || machine.outcome().is_some(),
            "bytes left unused before the end"
        );
        consumed += used;
        output.extend(machine.take_output());
    }
    if machine.outcome().is_some() {
        assert_eq!(machine.bytes_needed(), 0);
        assert_eq!(
            machine.feed(b"after the end"),
            0,
            "bytes consumed after the end"
        );
    }
    Run {
        output,
        consumed,
        outcome: machine.outcome().cloned(),
    }
}

pub fn check(data: &[u8]) {
    let Some((&piece, input)) = data.split_first() else {
        return;
    };
    let whole = run(input, 0);
    let pieces = run(input, 1 + usize::from(piece) % 32);
    if piece != 0 {
        assert_eq!(
            pieces, whole,
            "fed in pieces, the handshake went differently"
        );
    }
    check_output(&whole, input);
}

/// The output is the greeting, then option replies, then (after `EXPORT_NAME`) size and flags.
fn check_output(run: &Run, input: &[u8]) {
    let out = &run.output;
    assert!(out.len() >= GREETING_LEN);
    assert_eq!(&out[8..16], &IHAVEOPT.to_be_bytes());
    let mut at = GREETING_LEN;
    while out.len() - at >= REPLY_HEADER_LEN && out[at..at + 8] == NBD_REP_MAGIC.to_be_bytes() {
        let option = be_u32(&out[at + 8..]);
        let length = be_u32(&out[at + 16..]) as usize;
        assert_ne!(
            option, NBD_OPT_EXPORT_NAME,
            "an option reply to EXPORT_NAME, which has none"
        );
        at += REPLY_HEADER_LEN;
        assert!(out.len() - at >= length, "reply payload cut short");
        at += length;
    }
    let rest = out.len() - at;
    match &run.outcome {
        Some(HandshakeOutcome::Transmission {
            export,
            no_zeroes,
            session,
        }) => {
            assert!(*export < exports().len());
            assert!(
                !session.block_status || session.structured_replies,
                "block status without structured replies"
            );
            let export_name = rest > 0;
            if export_name {
                assert_eq!(
                    rest,
                    if *no_zeroes { 10 } else { 134 },
                    "EXPORT_NAME reply length"
                );
                assert_eq!(be_u64(&out[at..]), exports()[*export].size);
            }
        }
        _ => assert_eq!(rest, 0, "{rest} stray bytes after the option replies"),
    }
    assert!(run.consumed <= input.len());
    if run.outcome.is_none() {
        assert_eq!(run.consumed, input.len());
    }
}

fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn be_u64(bytes: &[u8]) -> u64 {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(out)
}

/// Client bytes of one option.
pub fn option(option: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = IHAVEOPT.to_be_bytes().to_vec();
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of `NBD_OPT_INFO`/`NBD_OPT_GO`: name, then the info types asked for.
pub fn info_payload(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut out = (name.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        out.extend_from_slice(&info.to_be_bytes());
    }
    out
}

/// The payload of `NBD_OPT_LIST_META_CONTEXT`/`NBD_OPT_SET_META_CONTEXT`: the export's
/// name, then the queries.
pub fn meta_payload(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut out = (name.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        out.extend_from_slice(&(query.len() as u32).to_be_bytes());
        out.extend_from_slice(query.as_bytes());
    }
    out
}

/// Client flags, then the options of a typical session.
pub fn sessions() -> Vec<Vec<u8>> {
    let flags = (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    let fixed_only = NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    let go = |name: &str| {
        option(
            NBD_OPT_GO,
            &info_payload(name, &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION]),
        )
    };
    [
        // qemu / nbdinfo style: list, info, go.
        vec![
            flags.clone(),
            option(NBD_OPT_LIST, &[]),
            option(NBD_OPT_INFO, &info_payload("disk", &[NBD_INFO_NAME])),
            go("disk"),
        ],
        // An unsupported option first, then go to the default export.
        vec![flags.clone(), option(NBD_OPT_STARTTLS, &[]), go("")],
        // libnbd / qemu with block status: structured replies, base:allocation, go.
        vec![
            flags.clone(),
            option(NBD_OPT_STRUCTURED_REPLY, &[]),
            option(NBD_OPT_LIST_META_CONTEXT, &meta_payload("", &[])),
            option(
                NBD_OPT_SET_META_CONTEXT,
                &meta_payload("", &["base:allocation"]),
            ),
            go(""),
        ],
        // Old clients: EXPORT_NAME, with and without the 124 zero bytes.
        vec![flags.clone(), option(NBD_OPT_EXPORT_NAME, b"ro")],
        vec![fixed_only, option(NBD_OPT_EXPORT_NAME, b"disk")],
        // Unknown export, then abort.
        vec![flags, go("nosuch"), option(NBD_OPT_ABORT, &[])],
    ]
    .into_iter()
    .map(|parts| parts.concat())
    .collect()
}

pub fn seeds() -> Vec<Vec<u8>> {
    sessions()
        .into_iter()
        .enumerate()
        .map(|(index, session)| {
            let mut seed = vec![index as u8 * 5];
            seed.extend(session);
            seed
        })
        .collect()
}
