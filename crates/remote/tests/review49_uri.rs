//! Review 49: `NbdUri::canonical` round trips (parse(canonical) == canonical) and is idempotent.
use ssdcache_remote::NbdUri;

#[test]
fn review49_canonical_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("we ird%&?#=+.sock");
    std::fs::write(&odd, b"").unwrap();
    let enc = |s: &str| {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"/._-".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect::<String>()
    };
    let cases = vec![
        "nbd://Host/a%20b".to_string(),
        "nbd://host:10809/a%3Fb%23c%25d".to_string(),
        "nbd://[::1]/e".to_string(),
        "nbd://[FE80::1%25eth0]:99/x".to_string(),
        "nbd://user@Example.COM:1/%C3%A9x".to_string(),
        "nbd://h".to_string(),
        "nbd://h/".to_string(),
        "nbd+tcp://h/a/b//c".to_string(),
        format!("nbd+unix:///ex%20p?socket={}", enc(&odd.to_string_lossy())),
        format!(
            "nbd+unix:///?socket={}",
            enc(&format!(
                "{}/./x/../{}",
                dir.path().display(),
                odd.file_name().unwrap().to_string_lossy()
            ))
        ),
        "nbd+unix:///e?socket=/does/not/exist%20here".to_string(),
    ];
    let mut bad = Vec::new();
    for text in &cases {
        let u = NbdUri::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let c = u.canonical();
        match NbdUri::parse(c.as_str()) {
            Ok(back) => {
                if back != c || back.canonical().as_str() != c.as_str() || back.export != u.export {
                    bad.push(format!("{text} -> {} -> {:?}", c.as_str(), back));
                }
            }
            Err(e) => bad.push(format!("{text} -> {} does not parse: {e}", c.as_str())),
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}
