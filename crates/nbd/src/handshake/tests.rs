use super::*;

fn exports() -> Vec<ExportInfo> {
    vec![
        ExportInfo {
            name: "cache".into(),
            description: "ssd cache".into(),
            size: 1 << 30,
            flags: transmission_flags(false),
            min_block: 4096,
            preferred_block: 65536,
            max_block: 1 << 25,
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size: 8192,
            flags: transmission_flags(true),
            min_block: 512,
            preferred_block: 4096,
            max_block: 1 << 20,
        },
    ]
}

fn client_flags(flags: u32) -> Vec<u8> {
    flags.to_be_bytes().to_vec()
}

fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = IHAVEOPT.to_be_bytes().to_vec();
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut out = (name.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        out.extend_from_slice(&info.to_be_bytes());
    }
    out
}

#[derive(Debug, PartialEq, Eq)]
struct Reply {
    option: u32,
    reply_type: u32,
    payload: Vec<u8>,
}

/// Splits server output into option replies, asserting the framing is exact.
fn parse_replies(mut bytes: &[u8]) -> Vec<Reply> {
    let mut replies = Vec::new();
    while !bytes.is_empty() {
        assert!(bytes.len() >= 20, "truncated reply header");
        assert_eq!(read_u64(bytes, 0), Some(NBD_REP_MAGIC));
        let option = read_u32(bytes, 8).unwrap();
        let reply_type = read_u32(bytes, 12).unwrap();
        let len = read_u32(bytes, 16).unwrap() as usize;
        let payload = bytes[20..20 + len].to_vec();
        replies.push(Reply {
            option,
            reply_type,
            payload,
        });
        bytes = &bytes[20 + len..];
    }
    replies
}

/// A handshake past the greeting and the client flags.
fn started(flags: u32) -> Handshake {
    let mut handshake = Handshake::new(exports());
    let greeting = handshake.take_output();
    assert_eq!(greeting.len(), 18);
    handshake.feed(&client_flags(flags));
    assert_eq!(handshake.outcome(), None);
    handshake
}

fn send(handshake: &mut Handshake, bytes: &[u8]) -> Vec<Reply> {
    let consumed = handshake.feed(bytes);
    assert_eq!(consumed, bytes.len());
    parse_replies(&handshake.take_output())
}

fn info_payload(info: u16, rest: &[u8]) -> Vec<u8> {
    let mut out = info.to_be_bytes().to_vec();
    out.extend_from_slice(rest);
    out
}

fn export_info_payload(size: u64, flags: u16) -> Vec<u8> {
    let mut rest = size.to_be_bytes().to_vec();
    rest.extend_from_slice(&flags.to_be_bytes());
    info_payload(NBD_INFO_EXPORT, &rest)
}

fn block_size_payload(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut rest = Vec::new();
    for value in [min, preferred, max] {
        rest.extend_from_slice(&value.to_be_bytes());
    }
    info_payload(NBD_INFO_BLOCK_SIZE, &rest)
}

fn reply(option: u32, reply_type: u32, payload: Vec<u8>) -> Reply {
    Reply {
        option,
        reply_type,
        payload,
    }
}

#[test]
fn greeting_is_fixed_newstyle_with_no_zeroes() {
    let mut handshake = Handshake::new(exports());
    let greeting = handshake.take_output();
    assert_eq!(&greeting[0..8], b"NBDMAGIC");
    assert_eq!(&greeting[8..16], b"IHAVEOPT");
    assert_eq!(&greeting[16..18], &[0, 3]);
    assert_eq!(handshake.bytes_needed(), 4);
}

#[test]
fn go_flow_enters_transmission() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES);
    let go = option(NBD_OPT_GO, &info_data("cache", &[NBD_INFO_BLOCK_SIZE]));
    let replies = send(&mut handshake, &go);
    let flags = transmission_flags(false);
    assert_eq!(
        replies,
        vec![
            reply(
                NBD_OPT_GO,
                NBD_REP_INFO,
                export_info_payload(1 << 30, flags)
            ),
            reply(
                NBD_OPT_GO,
                NBD_REP_INFO,
                block_size_payload(4096, 65536, 1 << 25)
            ),
            reply(NBD_OPT_GO, NBD_REP_ACK, vec![]),
        ]
    );
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: true,
            session: Session::default(),
        })
    );
    assert_eq!(handshake.bytes_needed(), 0);
}

#[test]
fn info_then_go_reports_name_and_description() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let info = option(
        NBD_OPT_INFO,
        &info_data("cache", &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION, 0x7777]),
    );
    let replies = send(&mut handshake, &info);
    assert_eq!(
        replies,
        vec![
            reply(
                NBD_OPT_INFO,
                NBD_REP_INFO,
                export_info_payload(1 << 30, transmission_flags(false))
            ),
            reply(
                NBD_OPT_INFO,
                NBD_REP_INFO,
                info_payload(NBD_INFO_NAME, b"cache")
            ),
            reply(
                NBD_OPT_INFO,
                NBD_REP_INFO,
                info_payload(NBD_INFO_DESCRIPTION, b"ssd cache")
            ),
            reply(
                NBD_OPT_INFO,
                NBD_REP_INFO,
                block_size_payload(4096, 65536, 1 << 25)
            ),
            reply(NBD_OPT_INFO, NBD_REP_ACK, vec![]),
        ]
    );
    assert_eq!(handshake.outcome(), None, "INFO keeps negotiating");

    let replies = send(&mut handshake, &option(NBD_OPT_GO, &info_data("ro", &[])));
    assert_eq!(replies.len(), 3);
    assert_eq!(
        replies[0].payload,
        export_info_payload(8192, transmission_flags(true))
    );
    assert_eq!(replies[1].payload, block_size_payload(512, 4096, 1 << 20));
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 1,
            no_zeroes: false,
            session: Session::default(),
        })
    );
}

#[test]
fn list_names_every_export() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let replies = send(&mut handshake, &option(NBD_OPT_LIST, &[]));
    let mut first = 5u32.to_be_bytes().to_vec();
    first.extend_from_slice(b"cachessd cache");
    let mut second = 2u32.to_be_bytes().to_vec();
    second.extend_from_slice(b"ro");
    assert_eq!(
        replies,
        vec![
            reply(NBD_OPT_LIST, NBD_REP_SERVER, first),
            reply(NBD_OPT_LIST, NBD_REP_SERVER, second),
            reply(NBD_OPT_LIST, NBD_REP_ACK, vec![]),
        ]
    );
    assert_eq!(handshake.outcome(), None);
}

#[test]
fn list_with_data_is_invalid_but_recoverable() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let replies = send(&mut handshake, &option(NBD_OPT_LIST, b"x"));
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
    assert_eq!(handshake.outcome(), None);
}

#[test]
fn export_name_sends_padding_without_no_zeroes() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    handshake.feed(&option(NBD_OPT_EXPORT_NAME, b"ro"));
    let output = handshake.take_output();
    assert_eq!(output.len(), 8 + 2 + 124);
    assert_eq!(&output[0..8], &8192u64.to_be_bytes());
    assert_eq!(&output[8..10], &transmission_flags(true).to_be_bytes());
    assert!(output[10..].iter().all(|&b| b == 0));
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 1,
            no_zeroes: false,
            session: Session::default(),
        })
    );
}

#[test]
fn export_name_omits_padding_with_no_zeroes() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES);
    handshake.feed(&option(NBD_OPT_EXPORT_NAME, b""));
    let output = handshake.take_output();
    assert_eq!(output.len(), 10, "size and flags only");
    assert_eq!(&output[0..8], &(1u64 << 30).to_be_bytes());
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: true,
            session: Session::default(),
        })
    );
}

#[test]
fn export_name_unknown_closes() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    handshake.feed(&option(NBD_OPT_EXPORT_NAME, b"nope"));
    assert!(handshake.take_output().is_empty());
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Closed(CloseReason::Protocol(_)))
    ));
}

#[test]
fn go_unknown_export_errors_then_continues() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let replies = send(&mut handshake, &option(NBD_OPT_GO, &info_data("nope", &[])));
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&replies[0].payload).contains("nope"));
    assert_eq!(handshake.outcome(), None);

    let replies = send(&mut handshake, &option(NBD_OPT_GO, &info_data("", &[])));
    assert_eq!(replies.last().map(|r| r.reply_type), Some(NBD_REP_ACK));
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: false,
            session: Session::default(),
        })
    );
}

#[test]
fn malformed_go_is_invalid_then_continues() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let mut data = info_data("cache", &[NBD_INFO_NAME]);
    data.push(0); // one byte more than the counts say
    for bad in [data, vec![0, 0, 0, 9, b'a'], vec![]] {
        let replies = send(&mut handshake, &option(NBD_OPT_GO, &bad));
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
        assert_eq!(handshake.outcome(), None);
    }
}

#[test]
fn unsupported_options_error_then_continue() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    for opt in [NBD_OPT_STARTTLS, NBD_OPT_EXTENDED_HEADERS, 0xdead_beef] {
        let replies = send(&mut handshake, &option(opt, b"some data"));
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].option, opt);
        assert_eq!(replies[0].reply_type, NBD_REP_ERR_UNSUP);
        assert_eq!(handshake.outcome(), None);
    }
}

#[test]
fn abort_acks_and_closes() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let replies = send(&mut handshake, &option(NBD_OPT_ABORT, &[]));
    assert_eq!(replies, vec![reply(NBD_OPT_ABORT, NBD_REP_ACK, vec![])]);
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Closed(CloseReason::ClientAbort))
    );
}

#[test]
fn garbage_option_magic_closes() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    handshake.feed(b"GARBAGE!\0\0\0\x07\0\0\0\0");
    assert!(handshake.take_output().is_empty());
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Closed(CloseReason::Protocol(msg))) if msg.contains("magic")
    ));
}

#[test]
fn unknown_client_flags_close() {
    let mut handshake = Handshake::new(exports());
    handshake.take_output();
    handshake.feed(&client_flags(NBD_FLAG_C_FIXED_NEWSTYLE | 1 << 5));
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Closed(CloseReason::Protocol(_)))
    ));
}

#[test]
fn oversized_option_closes_before_buffering() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let mut header = IHAVEOPT.to_be_bytes().to_vec();
    header.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
    header.extend_from_slice(&(MAX_OPTION_LEN + 1).to_be_bytes());
    handshake.feed(&header);
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Closed(CloseReason::Protocol(_)))
    ));
    assert_eq!(handshake.bytes_needed(), 0);
}

#[test]
fn truncated_input_waits_for_more() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let go = option(NBD_OPT_GO, &info_data("cache", &[]));
    let split = go.len() - 3;
    assert_eq!(handshake.feed(&go[..split]), split);
    assert_eq!(handshake.outcome(), None);
    assert!(handshake.take_output().is_empty());
    assert_eq!(handshake.bytes_needed(), 3);
    handshake.feed(&go[split..]);
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Transmission { export: 0, .. })
    ));
}

#[test]
fn byte_at_a_time_matches_one_shot() {
    let mut script = client_flags(NBD_FLAG_C_FIXED_NEWSTYLE);
    script.extend(option(NBD_OPT_LIST, &[]));
    script.extend(option(NBD_OPT_STRUCTURED_REPLY, &[]));
    script.extend(option(NBD_OPT_GO, &info_data("ro", &[NBD_INFO_NAME])));

    let mut one_shot = Handshake::new(exports());
    one_shot.feed(&script);
    let mut trickled = Handshake::new(exports());
    for byte in &script {
        trickled.feed(std::slice::from_ref(byte));
    }
    assert_eq!(one_shot.take_output(), trickled.take_output());
    assert_eq!(one_shot.outcome(), trickled.outcome());
    assert!(one_shot.outcome().is_some());
}

#[test]
fn bytes_after_go_are_left_for_transmission() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let mut input = option(NBD_OPT_GO, &info_data("cache", &[]));
    let go_len = input.len();
    input.extend_from_slice(&[0x25, 0x60, 0x95, 0x13]);
    assert_eq!(handshake.feed(&input), go_len);
    assert_eq!(
        handshake.feed(&input[go_len..]),
        0,
        "done: consumes nothing"
    );
}

#[test]
fn no_exports_means_empty_name_is_unknown() {
    let mut handshake = Handshake::new(Vec::<ExportInfo>::new());
    handshake.take_output();
    handshake.feed(&client_flags(NBD_FLAG_C_FIXED_NEWSTYLE));
    let replies = send(&mut handshake, &option(NBD_OPT_GO, &info_data("", &[])));
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_UNKNOWN);
    let replies = send(&mut handshake, &option(NBD_OPT_LIST, &[]));
    assert_eq!(replies, vec![reply(NBD_OPT_LIST, NBD_REP_ACK, vec![])]);
}

fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut out = (name.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        out.extend_from_slice(&(query.len() as u32).to_be_bytes());
        out.extend_from_slice(query.as_bytes());
    }
    out
}

fn context_payload(id: u32) -> Vec<u8> {
    let mut out = id.to_be_bytes().to_vec();
    out.extend_from_slice(BASE_ALLOCATION.as_bytes());
    out
}

#[test]
fn meta_contexts_need_structured_replies_first() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let set = option(
        NBD_OPT_SET_META_CONTEXT,
        &meta_data("cache", &[BASE_ALLOCATION]),
    );
    let replies = send(&mut handshake, &set);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
    let replies = send(&mut handshake, &option(NBD_OPT_STRUCTURED_REPLY, b"x"));
    assert_eq!(
        replies[0].reply_type, NBD_REP_ERR_INVALID,
        "the option takes no data"
    );
    send(
        &mut handshake,
        &option(NBD_OPT_GO, &info_data("cache", &[])),
    );
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: false,
            session: Session::default(),
        })
    );
}

#[test]
fn structured_replies_and_base_allocation_are_negotiated() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let replies = send(&mut handshake, &option(NBD_OPT_STRUCTURED_REPLY, &[]));
    assert_eq!(
        replies,
        vec![reply(NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK, vec![])]
    );
    // LIST: no query lists everything, "base:" is the namespace's wildcard, other
    // namespaces are ignored.
    for queries in [
        &[][..],
        &["base:"][..],
        &["qemu:dirty-bitmap:x", BASE_ALLOCATION][..],
    ] {
        let list = option(NBD_OPT_LIST_META_CONTEXT, &meta_data("cache", queries));
        assert_eq!(
            send(&mut handshake, &list),
            vec![
                reply(
                    NBD_OPT_LIST_META_CONTEXT,
                    NBD_REP_META_CONTEXT,
                    context_payload(0)
                ),
                reply(NBD_OPT_LIST_META_CONTEXT, NBD_REP_ACK, vec![]),
            ],
            "{queries:?}"
        );
    }
    let list = option(NBD_OPT_LIST_META_CONTEXT, &meta_data("cache", &["other:x"]));
    assert_eq!(
        send(&mut handshake, &list),
        vec![reply(NBD_OPT_LIST_META_CONTEXT, NBD_REP_ACK, vec![])]
    );
    let unknown = option(
        NBD_OPT_SET_META_CONTEXT,
        &meta_data("nope", &[BASE_ALLOCATION]),
    );
    assert_eq!(
        send(&mut handshake, &unknown)[0].reply_type,
        NBD_REP_ERR_UNKNOWN
    );
    let mut malformed = meta_data("cache", &[BASE_ALLOCATION]);
    malformed.push(0);
    let malformed = option(NBD_OPT_SET_META_CONTEXT, &malformed);
    assert_eq!(
        send(&mut handshake, &malformed)[0].reply_type,
        NBD_REP_ERR_INVALID
    );
    let set = option(
        NBD_OPT_SET_META_CONTEXT,
        &meta_data("cache", &[BASE_ALLOCATION]),
    );
    assert_eq!(
        send(&mut handshake, &set),
        vec![
            reply(
                NBD_OPT_SET_META_CONTEXT,
                NBD_REP_META_CONTEXT,
                context_payload(BASE_ALLOCATION_ID)
            ),
            reply(NBD_OPT_SET_META_CONTEXT, NBD_REP_ACK, vec![]),
        ]
    );
    send(
        &mut handshake,
        &option(NBD_OPT_GO, &info_data("cache", &[])),
    );
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: false,
            session: Session {
                structured_replies: true,
                block_status: true
            },
        })
    );
}

#[test]
fn block_status_is_for_the_export_it_was_selected_for() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    send(&mut handshake, &option(NBD_OPT_STRUCTURED_REPLY, &[]));
    let set = option(
        NBD_OPT_SET_META_CONTEXT,
        &meta_data("cache", &[BASE_ALLOCATION]),
    );
    send(&mut handshake, &set);
    send(&mut handshake, &option(NBD_OPT_GO, &info_data("ro", &[])));
    let expected = Session {
        structured_replies: true,
        block_status: false,
    };
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 1,
            no_zeroes: false,
            session: expected,
        })
    );
    // A later SET that selects nothing (or fails) clears the selection.
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    send(&mut handshake, &option(NBD_OPT_STRUCTURED_REPLY, &[]));
    send(&mut handshake, &set);
    let none = option(NBD_OPT_SET_META_CONTEXT, &meta_data("cache", &[]));
    assert_eq!(
        send(&mut handshake, &none),
        vec![reply(NBD_OPT_SET_META_CONTEXT, NBD_REP_ACK, vec![])]
    );
    send(
        &mut handshake,
        &option(NBD_OPT_GO, &info_data("cache", &[])),
    );
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: false,
            session: expected,
        })
    );
}

#[test]
fn starttls_is_unsupported_without_tls() {
    let mut handshake = started(NBD_FLAG_C_FIXED_NEWSTYLE);
    let replies = send(&mut handshake, &option(NBD_OPT_STARTTLS, &[]));
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_UNSUP);
    assert!(!handshake.wants_tls());
}

/// A handshake with TLS `policy`, past the greeting and the client flags.
fn started_with_tls(policy: TlsPolicy) -> Handshake {
    let mut handshake = Handshake::with_tls(exports(), policy);
    handshake.take_output();
    handshake.feed(&client_flags(NBD_FLAG_C_FIXED_NEWSTYLE));
    handshake
}

#[test]
fn starttls_stops_feeding_until_tls_runs_and_forgets_what_came_before() {
    let mut handshake = started_with_tls(TlsPolicy::Offered);
    send(&mut handshake, &option(NBD_OPT_STRUCTURED_REPLY, &[]));
    // STARTTLS with a ClientHello right behind it: the hello is not consumed.
    let mut bytes = option(NBD_OPT_STARTTLS, &[]);
    let starttls_len = bytes.len();
    bytes.extend_from_slice(&[0x16, 0x03, 0x01, 0x00, 0x05]);
    let consumed = handshake.feed(&bytes);
    assert_eq!(consumed, starttls_len, "nothing after STARTTLS is taken");
    assert_eq!(
        parse_replies(&handshake.take_output()),
        vec![reply(NBD_OPT_STARTTLS, NBD_REP_ACK, vec![])]
    );
    assert!(handshake.wants_tls());
    assert_eq!(handshake.bytes_needed(), 0);
    assert_eq!(handshake.feed(&option(NBD_OPT_LIST, &[])), 0);
    handshake.tls_started();
    assert!(!handshake.wants_tls());
    // A second STARTTLS is invalid; the structured replies negotiated before are forgotten.
    let replies = send(&mut handshake, &option(NBD_OPT_STARTTLS, &[]));
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
    send(
        &mut handshake,
        &option(NBD_OPT_GO, &info_data("cache", &[])),
    );
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Transmission {
            export: 0,
            no_zeroes: false,
            session: Session::default(),
        })
    );
}

#[test]
fn required_tls_refuses_everything_but_starttls_and_abort() {
    let mut handshake = started_with_tls(TlsPolicy::Required);
    for opt in [
        NBD_OPT_LIST,
        NBD_OPT_INFO,
        NBD_OPT_GO,
        NBD_OPT_STRUCTURED_REPLY,
        0xdead,
    ] {
        let replies = send(&mut handshake, &option(opt, &info_data("cache", &[])));
        assert_eq!(replies.len(), 1, "{opt}");
        assert_eq!(replies[0].reply_type, NBD_REP_ERR_TLS_REQD, "{opt}");
        assert_eq!(handshake.outcome(), None);
    }
    let replies = send(&mut handshake, &option(NBD_OPT_STARTTLS, b"junk"));
    assert_eq!(
        replies[0].reply_type, NBD_REP_ERR_INVALID,
        "STARTTLS takes no data"
    );
    send(&mut handshake, &option(NBD_OPT_STARTTLS, &[]));
    assert!(handshake.wants_tls());
    handshake.tls_started();
    send(&mut handshake, &option(NBD_OPT_GO, &info_data("ro", &[])));
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Transmission { export: 1, .. })
    ));

    // EXPORT_NAME cannot be refused with a reply: the connection is closed.
    let mut handshake = started_with_tls(TlsPolicy::Required);
    send(&mut handshake, &option(NBD_OPT_EXPORT_NAME, b"cache"));
    assert!(matches!(
        handshake.outcome(),
        Some(HandshakeOutcome::Closed(CloseReason::Protocol(_)))
    ));
    let mut handshake = started_with_tls(TlsPolicy::Required);
    send(&mut handshake, &option(NBD_OPT_ABORT, &[]));
    assert_eq!(
        handshake.outcome(),
        Some(&HandshakeOutcome::Closed(CloseReason::ClientAbort))
    );
}
