//! The `redis+sentinel://` / `rediss+sentinel://` URL parser and its percent-decoding: never panic; what it accepts is
//! well formed (hosts non-empty, ports non-zero, a master, a database >= 0); written back as a URL
//! it parses to the same thing; and percent-decoding accepts only `%` followed by two hex digits.
#![no_main]

use idemgate::config::{parse_sentinel_url, percent_decode, SentinelUrl};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    check_percent_decode(text);
    // The scheme is a fixed prefix: also try the input as the part after either.
    for url in [
        text.to_owned(),
        format!("redis+sentinel://{text}"),
        format!("rediss+sentinel://{text}"),
    ] {
        if let Ok(parsed) = parse_sentinel_url(&url) {
            check_parsed(&parsed);
            let again = parse_sentinel_url(&write(&parsed)).expect("a written URL parses");
            assert!(again == parsed, "{url:?} does not survive a round trip");
        }
    }
});

fn check_percent_decode(text: &str) {
    let Some(decoded) = percent_decode(text) else {
        return;
    };
    let bytes = text.as_bytes();
    for (i, _) in text.match_indices('%') {
        let hex = bytes.get(i + 1..i + 3);
        assert!(
            hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)),
            "{text:?}: % at {i} without two hex digits was accepted"
        );
    }
    assert_eq!(
        percent_decode(&encode(&decoded)).as_deref(),
        Some(decoded.as_str())
    );
}

fn check_parsed(url: &SentinelUrl) {
    assert!(!url.sentinels.is_empty());
    for (host, port) in &url.sentinels {
        assert!(!host.is_empty() && *port != 0);
    }
    assert!(!url.master.is_empty() && !url.master.contains('/'));
    assert!(url.db >= 0);
}

/// Percent-encodes everything but unreserved characters.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn write(url: &SentinelUrl) -> String {
    let mut out = String::from(if url.tls {
        "rediss+sentinel://"
    } else {
        "redis+sentinel://"
    });
    if url.username.is_some() || url.password.is_some() {
        out += &encode(url.username.as_deref().unwrap_or(""));
        if let Some(password) = &url.password {
            out.push(':');
            out += &encode(password);
        }
        out.push('@');
    }
    let hosts: Vec<String> = url
        .sentinels
        .iter()
        .map(|(host, port)| {
            if host.contains(':') || host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            }
        })
        .collect();
    out += &hosts.join(",");
    out.push('/');
    out += &url.master;
    out += &format!("/{}", url.db);
    out
}
