//! Idempotency-key and tenant parsing, record ids and request fingerprints (SPEC §1 steps 2–4).
//!
//! Everything here runs on the request hot path, so parsing works on borrowed header bytes and
//! hashing feeds SHA-256 incrementally: the only allocation is the returned key `String`.
//!
//! Hash inputs are encoded so that different inputs can never produce the same byte stream: every
//! variable-length part is prefixed by its length (u64 big-endian), every list by its count, and
//! each hash starts with its own domain tag so a record id can never equal a fingerprint.

use sha2::{Digest as _, Sha256};

use crate::store::Digest;

/// Longest accepted idempotency key, in characters (bytes: a valid key is ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// Longest accepted tenant value, in characters (bytes: a valid tenant is ASCII).
pub const MAX_TENANT_LEN: usize = 128;

/// Why an idempotency key header was rejected (each maps to a 400 answer; Display is a human
/// sentence, never containing the raw key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key is empty, or only whitespace.
    #[error("the idempotency key is empty")]
    Empty,
    /// The decoded key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {len} characters long; at most 255 are allowed")]
    TooLong {
        /// Length of the decoded key.
        len: usize,
    },
    /// The key is shorter than the route's `min_key_length` (a route's rule, checked by the
    /// proxy after [`parse_key`]).
    #[error("the idempotency key is {len} characters long; this route needs at least {min}")]
    TooShort {
        /// Length of the decoded key.
        len: usize,
        /// The route's minimum.
        min: usize,
    },
    /// The key holds a character outside visible ASCII (space, control, DEL or non-ASCII).
    #[error("the idempotency key contains a character outside visible ASCII")]
    InvalidCharacter,
    /// A quoted key is not a well-formed structured-field string, or a bare key holds `"` or `\`.
    #[error(
        "the idempotency key is malformed: quote it as a structured-field string or send it bare"
    )]
    MalformedQuoting,
    /// The header was sent several times with different keys, or as a comma-separated list.
    #[error("the idempotency key header carries more than one distinct key")]
    ConflictingValues,
}

/// Why a tenant header value was rejected (maps to a 400 answer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// The tenant value is empty.
    #[error("the tenant is empty")]
    Empty,
    /// The tenant value is longer than [`MAX_TENANT_LEN`].
    #[error("the tenant is {len} characters long; at most 128 are allowed")]
    TooLong {
        /// Length of the tenant value in bytes.
        len: usize,
    },
    /// The tenant holds a character outside `[A-Za-z0-9._:-]`.
    #[error("the tenant may only contain letters, digits, '.', '_', ':' and '-'")]
    InvalidCharacter,
    /// The tenant header was sent several times with different values.
    #[error("the tenant header carries more than one distinct tenant")]
    ConflictingValues,
}

/// Parses every value of the key header. `Ok(None)` = header absent.
///
/// Each value is either an RFC 9651 sf-string (`"abc"`, escapes `\"` and `\\`) or a bare token
/// (`abc`); both give the key `abc`. Repeating the header is fine when every occurrence decodes
/// to the same key. A bad value is always an error, never "no key": a client that meant to send a
/// key must not silently lose its protection.
///
/// ```
/// use http::HeaderValue;
/// use idemgate::key::{parse_key, KeyError};
///
/// let quoted = HeaderValue::from_static("\"order-7f3a\"");
/// let bare = HeaderValue::from_static("order-7f3a");
/// assert_eq!(parse_key([&quoted, &bare]), Ok(Some("order-7f3a".to_string())));
/// assert_eq!(parse_key(std::iter::empty()), Ok(None));
/// let list = HeaderValue::from_static("a, b");
/// assert_eq!(parse_key([&list]), Err(KeyError::ConflictingValues));
/// ```
pub fn parse_key<'a>(
    values: impl IntoIterator<Item = &'a http::HeaderValue>,
) -> Result<Option<String>, KeyError> {
    let mut first: Option<&'a [u8]> = None;
    for value in values {
        let inner = parse_value(value.as_bytes())?;
        match first {
            None => first = Some(inner),
            // Compare decoded forms so `"abc"` and `abc` count as the same key, without
            // allocating a second string.
            Some(seen) if Unescape(seen).eq(Unescape(inner)) => {}
            Some(_) => return Err(KeyError::ConflictingValues),
        }
    }
    Ok(first.map(|inner| {
        let mut key = String::with_capacity(inner.len());
        // parse_value accepted only visible ASCII, so every byte is a char of its own.
        key.extend(Unescape(inner).map(char::from));
        key
    }))
}

/// Reads every value of the tenant header. `Ok(None)` = header absent (the default tenant
/// applies).
///
/// Repeating the header with one value is that value; different values are refused rather than
/// one picked: a gateway that appends the authenticated tenant after a client-sent one would
/// otherwise let the client choose whose records it reaches.
pub fn parse_tenant<'a>(
    values: impl IntoIterator<Item = &'a http::HeaderValue>,
) -> Result<Option<&'a str>, TenantError> {
    let mut tenant: Option<&'a str> = None;
    for value in values {
        let this = validate_tenant(value.as_bytes())?;
        match tenant {
            None => tenant = Some(this),
            Some(seen) if seen == this => {}
            Some(_) => return Err(TenantError::ConflictingValues),
        }
    }
    Ok(tenant)
}

/// Validates a tenant value: 1..=128 bytes of `[A-Za-z0-9._:-]`.
///
/// The tenant becomes part of store key names, so the alphabet is kept to characters that are
/// safe in Redis keys, logs and metrics labels.
pub fn validate_tenant(value: &[u8]) -> Result<&str, TenantError> {
    if value.is_empty() {
        return Err(TenantError::Empty);
    }
    if value.len() > MAX_TENANT_LEN {
        return Err(TenantError::TooLong { len: value.len() });
    }
    if !value
        .iter()
        .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
    {
        return Err(TenantError::InvalidCharacter);
    }
    // Cannot fail after the ASCII check above; mapping the error keeps this panic-free anyway.
    std::str::from_utf8(value).map_err(|_| TenantError::InvalidCharacter)
}

/// Record id: SHA-256 over the tenant, each scope header (name and all its values, absent
/// distinguished from empty) and the key; every part length-prefixed and every list counted, so
/// no two different (tenant, scope, key) triples collide.
///
/// Scope headers (by default `Authorization`) bind a key to its principal: the same key sent by
/// another principal is another record. Values are hashed in the order they were received.
pub fn record_hash(
    tenant: &str,
    headers: &http::HeaderMap,
    scope_names: &[http::HeaderName],
    key: &str,
) -> Digest {
    let mut h = Sha256::new();
    put_part(&mut h, b"idemgate/record/v1");
    put_part(&mut h, tenant.as_bytes());
    put_headers(&mut h, headers, scope_names);
    put_part(&mut h, key.as_bytes());
    h.finalize().into()
}

/// Whether the request names a principal: one of `scope_names` is present with a value that is
/// not blank (an empty `Authorization:` identifies no one).
pub fn has_scope(headers: &http::HeaderMap, scope_names: &[http::HeaderName]) -> bool {
    scope_names.iter().any(|name| {
        headers
            .get_all(name)
            .iter()
            .any(|v| v.as_bytes().iter().any(|b| !b.is_ascii_whitespace()))
    })
}

/// Fingerprint: SHA-256 over method, path-and-query (raw bytes as received), the values of
/// `fingerprint_headers` (each name and all its values, absent distinguished from empty), and
/// the body when `Some`; length-prefixed parts. A header the request's `Connection` header
/// names (`hidden`) is not forwarded, so it counts as absent: the fingerprint is of the
/// request the backend sees.
///
/// `body: None` (body not fingerprinted) and `Some(b"")` (an empty body) hash differently, so
/// changing `fingerprint.body` in the config never makes an old record look like a match.
pub fn fingerprint(
    method: &http::Method,
    path_and_query: &[u8],
    headers: &http::HeaderMap,
    fingerprint_headers: &[http::HeaderName],
    hidden: &[&[u8]],
    body: Option<&[u8]>,
) -> Digest {
    let mut h = Sha256::new();
    put_part(&mut h, b"idemgate/fingerprint/v1");
    put_part(&mut h, method.as_str().as_bytes());
    put_part(&mut h, path_and_query);
    put_headers_except(&mut h, headers, fingerprint_headers, hidden);
    match body {
        None => h.update([0u8]),
        Some(body) => {
            h.update([1u8]);
            put_part(&mut h, body);
        }
    }
    h.finalize().into()
}

/// Short, non-reversible label of a record hash for logs (first 8 bytes, hex). Formats only when
/// a log line is written, so the request path does not allocate for it.
pub fn hash_label(hash: &Digest) -> HashLabel {
    let mut head = [0u8; 8];
    head.copy_from_slice(&hash[..8]);
    HashLabel(head)
}

/// The log label of a record hash; see [`hash_label`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashLabel([u8; 8]);

impl HashLabel {
    /// The label as 16 lower-case hex digits.
    pub fn hex(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (pair, &b) in out.chunks_exact_mut(2).zip(&self.0) {
            pair.copy_from_slice(&hex_pair(b));
        }
        out
    }
}

/// The two lower-case hex digits of `byte`. Record ids are written in hex on every Redis call
/// and every access line; a table lookup, where `format!` and `hex::encode` (a `char` iterator
/// collected into a `String`) cost about a microsecond per keyed request between them.
pub fn hex_pair(byte: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [
        DIGITS[usize::from(byte >> 4)],
        DIGITS[usize::from(byte & 0xf)],
    ]
}

impl std::fmt::Display for HashLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex = self.hex();
        f.write_str(std::str::from_utf8(&hex).map_err(|_| std::fmt::Error)?)
    }
}

// === parsing ===

/// Parses one header value and returns the validated key as it sits in the header: the inside
/// of the quotes (escapes still in place) or the bare token. Decode it with [`Unescape`].
fn parse_value(raw: &[u8]) -> Result<&[u8], KeyError> {
    let value = trim_ows(raw);
    let inner = match value.split_first() {
        Some((b'"', rest)) => quoted_inner(rest)?,
        _ => {
            // A comma is what an intermediary leaves when it folds two header lines into one;
            // a key is never guessed from a list.
            if value.contains(&b',') {
                return Err(KeyError::ConflictingValues);
            }
            if value.iter().any(|&b| b == b'"' || b == b'\\') {
                return Err(KeyError::MalformedQuoting);
            }
            value
        }
    };

    let mut len = 0usize;
    let mut visible = true;
    for b in Unescape(inner) {
        len += 1;
        visible &= matches!(b, 0x21..=0x7E);
    }
    if len == 0 {
        return Err(KeyError::Empty);
    }
    if len > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len });
    }
    if !visible {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(inner)
}

/// Checks the structure of an sf-string whose opening quote is already consumed and returns the
/// bytes between the quotes. Which characters may appear is left to the key check in
/// [`parse_value`], so a space or control character inside quotes is `InvalidCharacter`.
fn quoted_inner(rest: &[u8]) -> Result<&[u8], KeyError> {
    let mut i = 0;
    while let Some(&b) = rest.get(i) {
        match b {
            b'"' => {
                let after = &rest[i + 1..];
                if after.is_empty() {
                    return Ok(&rest[..i]);
                }
                // `"a", "b"` is a folded list of keys, not a typo inside one key.
                if trim_ows(after).first() == Some(&b',') {
                    return Err(KeyError::ConflictingValues);
                }
                return Err(KeyError::MalformedQuoting);
            }
            b'\\' => match rest.get(i + 1) {
                Some(b'"' | b'\\') => i += 2,
                _ => return Err(KeyError::MalformedQuoting),
            },
            _ => i += 1,
        }
    }
    Err(KeyError::MalformedQuoting)
}

/// Strips leading and trailing optional whitespace (space and horizontal tab, RFC 9110 OWS).
fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let Some((b' ' | b'\t', rest)) = v.split_first() {
        v = rest;
    }
    trim_ows_end(v)
}

/// `v` without the spaces and tabs (optional whitespace, RFC 9110 §5.6.3) at its end.
pub(crate) fn trim_ows_end(mut v: &[u8]) -> &[u8] {
    while let Some((b' ' | b'\t', rest)) = v.split_last() {
        v = rest;
    }
    v
}

/// Decodes the `\"` and `\\` escapes of an sf-string body, byte by byte. Bare tokens hold no
/// backslash, so it is the identity on them.
struct Unescape<'a>(&'a [u8]);

impl Iterator for Unescape<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        if b == b'\\' {
            if let Some((&escaped, rest)) = rest.split_first() {
                self.0 = rest;
                return Some(escaped);
            }
        }
        self.0 = rest;
        Some(b)
    }
}

// === hashing ===

fn put_len(h: &mut Sha256, len: usize) {
    // usize is at most 64 bits on every supported target, so the cast is lossless.
    h.update((len as u64).to_be_bytes());
}

fn put_part(h: &mut Sha256, bytes: &[u8]) {
    put_len(h, bytes.len());
    h.update(bytes);
}

/// Hashes the configured headers: the count of names, then per name the name, the count of its
/// values (0 = absent, so absent differs from one empty value) and each value in received order.
fn put_headers(h: &mut Sha256, headers: &http::HeaderMap, names: &[http::HeaderName]) {
    put_headers_except(h, headers, names, &[]);
}

/// [`put_headers`], with the headers named in `hidden` counted as absent.
fn put_headers_except(
    h: &mut Sha256,
    headers: &http::HeaderMap,
    names: &[http::HeaderName],
    hidden: &[&[u8]],
) {
    put_len(h, names.len());
    for name in names {
        put_part(h, name.as_str().as_bytes());
        if hidden
            .iter()
            .any(|hidden| hidden.eq_ignore_ascii_case(name.as_str().as_bytes()))
        {
            put_len(h, 0);
            continue;
        }
        let values = headers.get_all(name);
        put_len(h, values.iter().count());
        for value in values {
            put_part(h, value.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Record ids and fingerprints are what the shared store's records are found and matched
    /// by: a change of either orphans every live record in a rolling upgrade (retries run
    /// again under a new execution id) or turns their retries into 422s. Pinned to digests
    /// worked out apart from this code (Python's `hashlib` over the documented encoding:
    /// 8-byte big-endian lengths and counts, a tag first).
    #[test]
    fn record_ids_and_fingerprints_are_pinned() {
        let auth = http::HeaderName::from_static("authorization");
        let mut headers = http::HeaderMap::new();
        headers.insert("authorization", http::HeaderValue::from_static("Bearer t"));
        headers.insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        let hex = |d: Digest| hex::encode(d);
        assert_eq!(
            hex(record_hash(
                "acme",
                &headers,
                std::slice::from_ref(&auth),
                "order-1"
            )),
            "206106e3f7d108858048cc26717d5aba196df47cd07e8ad4e9303c164ce2ac06"
        );
        assert_eq!(
            hex(record_hash(
                "acme",
                &http::HeaderMap::new(),
                &[auth],
                "order-1"
            )),
            "f2b2ae65d70f898539c7d9d05d303679a85bfbd7219de63713cbc416f95d39ca"
        );
        let content_type = http::HeaderName::from_static("content-type");
        assert_eq!(
            hex(fingerprint(
                &http::Method::POST,
                b"/orders?x=1",
                &headers,
                &[content_type],
                &[],
                Some(br#"{"sku":"A"}"#),
            )),
            "95912a2bd88f2457ce19e270da6eac70946f90d5e21047f3bc2bb297de409b01"
        );
        assert_eq!(
            hex(fingerprint(
                &http::Method::POST,
                b"/orders?x=1",
                &headers,
                &[],
                &[],
                None
            )),
            "30379bf11ccd23a27369766a24ea872dabc41e898e43eae34459d9814840d876"
        );
    }

    #[test]
    fn a_principal_is_a_scope_header_with_a_value() {
        let names = [
            http::HeaderName::from_static("authorization"),
            http::HeaderName::from_static("x-user-id"),
        ];
        let mut headers = http::HeaderMap::new();
        assert!(!has_scope(&headers, &names));
        headers.insert("authorization", http::HeaderValue::from_static(""));
        headers.insert("x-other", http::HeaderValue::from_static("u-1"));
        assert!(!has_scope(&headers, &names), "blank, or not a scope header");
        headers.append("authorization", http::HeaderValue::from_static("Bearer a"));
        assert!(has_scope(&headers, &names), "one of its values is one");
        let mut user = http::HeaderMap::new();
        user.insert("X-User-Id", http::HeaderValue::from_static("u-1"));
        assert!(has_scope(&user, &names));
        assert!(!has_scope(&user, &[]));
    }
    use http::{HeaderMap, HeaderName, HeaderValue, Method};

    fn hv(bytes: &[u8]) -> HeaderValue {
        HeaderValue::from_bytes(bytes).expect("test header value")
    }

    type Parsed = Result<Option<String>, KeyError>;

    fn parse(values: &[&[u8]]) -> Parsed {
        let values: Vec<HeaderValue> = values.iter().map(|v| hv(v)).collect();
        parse_key(values.iter())
    }

    #[test]
    fn parse_key_single_values() {
        let long255 = "k".repeat(255);
        let long256 = "k".repeat(256);
        let quoted255 = format!("\"{long255}\"");
        let quoted256 = format!("\"{long256}\"");
        let ok = |k: &str| Ok(Some(k.to_owned()));
        let cases: Vec<(&[u8], Parsed)> = vec![
            (b"abc", ok("abc")),
            (b"\"abc\"", ok("abc")),
            (b"  abc\t", ok("abc")),
            (b" \t\"abc\" ", ok("abc")),
            (b"\"a\\\"b\"", ok("a\"b")),
            (b"\"a\\\\b\"", ok("a\\b")),
            (b"\"a,b\"", ok("a,b")),
            (b"4f0c-9b1e:_~!#$%&'*+.^`|", ok("4f0c-9b1e:_~!#$%&'*+.^`|")),
            // Malformed quoting.
            (b"\"abc", Err(KeyError::MalformedQuoting)),
            (b"\"abc\"x", Err(KeyError::MalformedQuoting)),
            (b"\"abc\" x", Err(KeyError::MalformedQuoting)),
            (b"\"abc\"\"", Err(KeyError::MalformedQuoting)),
            (b"\"a\\nb\"", Err(KeyError::MalformedQuoting)),
            (b"\"abc\\\"", Err(KeyError::MalformedQuoting)),
            (b"\"abc\\", Err(KeyError::MalformedQuoting)),
            (b"\"", Err(KeyError::MalformedQuoting)),
            (b"a\"b", Err(KeyError::MalformedQuoting)),
            (b"ab\"", Err(KeyError::MalformedQuoting)),
            (b"a\\b", Err(KeyError::MalformedQuoting)),
            // Empty.
            (b"", Err(KeyError::Empty)),
            (b"\"\"", Err(KeyError::Empty)),
            (b"   ", Err(KeyError::Empty)),
            (b" \t ", Err(KeyError::Empty)),
            (b" \"\" ", Err(KeyError::Empty)),
            // Length.
            (long255.as_bytes(), ok(&long255)),
            (long256.as_bytes(), Err(KeyError::TooLong { len: 256 })),
            (quoted255.as_bytes(), ok(&long255)),
            (quoted256.as_bytes(), Err(KeyError::TooLong { len: 256 })),
            // Characters.
            (b"a\tb", Err(KeyError::InvalidCharacter)),
            (b"\"a\tb\"", Err(KeyError::InvalidCharacter)),
            (b"a b", Err(KeyError::InvalidCharacter)),
            (b"\"a b\"", Err(KeyError::InvalidCharacter)),
            (b"\" abc\"", Err(KeyError::InvalidCharacter)),
            (b"ab\x80c", Err(KeyError::InvalidCharacter)),
            (b"\"ab\xffc\"", Err(KeyError::InvalidCharacter)),
            ("cl\u{e9}".as_bytes(), Err(KeyError::InvalidCharacter)),
            // Folded lists.
            (b"a,b", Err(KeyError::ConflictingValues)),
            (b"abc, abc", Err(KeyError::ConflictingValues)),
            (b",", Err(KeyError::ConflictingValues)),
            (b"\"a\", \"b\"", Err(KeyError::ConflictingValues)),
            (b"\"a\",\"a\"", Err(KeyError::ConflictingValues)),
        ];
        for (raw, want) in cases {
            assert_eq!(
                parse(&[raw]),
                want,
                "value {:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn parse_value_rejects_bytes_header_value_cannot_hold() {
        // HeaderValue::from_bytes refuses these, but unchecked constructors and other HTTP
        // stacks may not: the byte-level parser must still answer InvalidCharacter, not panic.
        for raw in [&b"a\x7fb"[..], b"a\x01b", b"\"a\x00b\"", b"a\r\nb", b"\x7f"] {
            assert_eq!(parse_value(raw), Err(KeyError::InvalidCharacter), "{raw:?}");
        }
    }

    #[test]
    fn parse_key_never_panics_on_any_short_byte_string() {
        let alphabet = [b'a', b'"', b'\\', b' ', b'\t', b',', 0x00, 0x7f, 0x80, 0xff];
        for a in alphabet {
            for b in alphabet {
                for c in alphabet {
                    let _ = parse_value(&[a, b, c]);
                    let _ = parse_value(&[a, b]);
                }
            }
        }
    }

    #[test]
    fn parse_key_repeated_values() {
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(parse(&[b"abc", b"abc"]), Ok(Some("abc".into())));
        assert_eq!(parse(&[b"\"abc\"", b"abc"]), Ok(Some("abc".into())));
        assert_eq!(parse(&[b"abc", b" \"abc\" "]), Ok(Some("abc".into())));
        assert_eq!(
            parse(&[b"\"a\\\"b\"", b"\"a\\\"b\""]),
            Ok(Some("a\"b".into()))
        );
        assert_eq!(parse(&[b"abc", b"abd"]), Err(KeyError::ConflictingValues));
        assert_eq!(parse(&[b"abc", b"abcd"]), Err(KeyError::ConflictingValues));
        assert_eq!(
            parse(&[b"abc", b"abc", b"x"]),
            Err(KeyError::ConflictingValues)
        );
        // A bad occurrence spoils the header even when another one is fine.
        assert_eq!(parse(&[b"abc", b""]), Err(KeyError::Empty));
        assert_eq!(parse(&[b"abc", b"\"abc"]), Err(KeyError::MalformedQuoting));
    }

    #[test]
    fn parse_key_reads_every_header_line() {
        let mut headers = HeaderMap::new();
        headers.append("idempotency-key", hv(b"one"));
        headers.append("idempotency-key", hv(b"two"));
        assert_eq!(
            parse_key(headers.get_all("idempotency-key")),
            Err(KeyError::ConflictingValues)
        );
        assert_eq!(parse_key(headers.get_all("other")), Ok(None));
    }

    #[test]
    fn key_errors_never_echo_the_key() {
        let err = parse(&[b"\"secret-key-123"]).expect_err("malformed");
        assert!(!err.to_string().contains("secret"));
        let long = "secret".repeat(50);
        let err = parse(&[long.as_bytes()]).expect_err("too long");
        assert!(!err.to_string().contains("secret"));
    }

    #[test]
    fn tenants() {
        let t128 = "t".repeat(128);
        let t129 = "t".repeat(129);
        assert_eq!(validate_tenant(b"acme"), Ok("acme"));
        assert_eq!(
            validate_tenant(b"Acme-01.eu_west:2"),
            Ok("Acme-01.eu_west:2")
        );
        assert_eq!(validate_tenant(t128.as_bytes()), Ok(t128.as_str()));
        assert_eq!(validate_tenant(b""), Err(TenantError::Empty));
        assert_eq!(
            validate_tenant(t129.as_bytes()),
            Err(TenantError::TooLong { len: 129 })
        );
        for bad in [
            &b"a{b"[..],
            b"a}b",
            b"{acme}",
            b"acme\n",
            b"ac me",
            b" acme",
            b"a/b",
            b"a*",
            b"caf\xc3\xa9",
            b"\xff",
        ] {
            assert_eq!(
                validate_tenant(bad),
                Err(TenantError::InvalidCharacter),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_repeated_tenant_header_must_agree() {
        let values = |vs: &[&[u8]]| vs.iter().map(|v| hv(v)).collect::<Vec<_>>();
        assert_eq!(parse_tenant(values(&[]).iter()), Ok(None));
        assert_eq!(parse_tenant(values(&[b"acme"]).iter()), Ok(Some("acme")));
        assert_eq!(
            parse_tenant(values(&[b"acme", b"acme"]).iter()),
            Ok(Some("acme"))
        );
        for pair in [[&b"acme"[..], b"globex"], [b"globex", b"acme"]] {
            assert_eq!(
                parse_tenant(values(&pair).iter()),
                Err(TenantError::ConflictingValues)
            );
        }
        // A bad value anywhere is reported as such.
        assert_eq!(
            parse_tenant(values(&[b"acme", b"a b"]).iter()),
            Err(TenantError::InvalidCharacter)
        );
        let err = parse_tenant(values(&[b"secret-a", b"secret-b"]).iter()).unwrap_err();
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    fn auth() -> Vec<HeaderName> {
        vec![http::header::AUTHORIZATION]
    }

    fn with(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).expect("test header name"),
                hv(value.as_bytes()),
            );
        }
        headers
    }

    #[test]
    fn record_hash_separates_parts() {
        let none = HeaderMap::new();
        let scope = auth();
        let base = record_hash("t", &with(&[("authorization", "Bearer a")]), &scope, "k");

        // Same inputs, same id.
        assert_eq!(
            base,
            record_hash("t", &with(&[("authorization", "Bearer a")]), &scope, "k")
        );
        // Tenant/key boundary.
        assert_ne!(
            record_hash("ab", &none, &[], "c"),
            record_hash("a", &none, &[], "bc")
        );
        // Tenant/scope and scope/key boundaries.
        assert_ne!(
            record_hash("t", &with(&[("authorization", "xk")]), &scope, "k"),
            record_hash("tx", &with(&[("authorization", "")]), &scope, "k")
        );
        assert_ne!(
            record_hash("t", &with(&[("authorization", "ab")]), &scope, "c"),
            record_hash("t", &with(&[("authorization", "a")]), &scope, "bc")
        );
        // Another principal, another record.
        assert_ne!(
            base,
            record_hash("t", &with(&[("authorization", "Bearer b")]), &scope, "k")
        );
        // Absent differs from empty.
        assert_ne!(
            record_hash("t", &none, &scope, "k"),
            record_hash("t", &with(&[("authorization", "")]), &scope, "k")
        );
        // A scope configured but absent differs from no scope configured.
        assert_ne!(
            record_hash("t", &none, &scope, "k"),
            record_hash("t", &none, &[], "k")
        );
        // Values are ordered and counted.
        let ab = with(&[("authorization", "a"), ("authorization", "b")]);
        let ba = with(&[("authorization", "b"), ("authorization", "a")]);
        assert_ne!(
            record_hash("t", &ab, &scope, "k"),
            record_hash("t", &ba, &scope, "k")
        );
        assert_ne!(
            record_hash("t", &ab, &scope, "k"),
            record_hash("t", &with(&[("authorization", "a")]), &scope, "k")
        );
        // Headers outside the scope list do not matter.
        assert_eq!(
            base,
            record_hash(
                "t",
                &with(&[("authorization", "Bearer a"), ("x-other", "1")]),
                &scope,
                "k"
            )
        );
    }

    #[test]
    fn fingerprint_covers_every_part() {
        let names = vec![HeaderName::from_static("content-type")];
        let json = with(&[("content-type", "application/json")]);
        let fp = |method: &Method, pq: &str, headers: &HeaderMap, body: Option<&[u8]>| {
            fingerprint(method, pq.as_bytes(), headers, &names, &[], body)
        };
        let base = fp(&Method::POST, "/orders?x=1", &json, Some(b"{}"));

        assert_eq!(base, fp(&Method::POST, "/orders?x=1", &json, Some(b"{}")));
        let variants = [
            fp(&Method::PUT, "/orders?x=1", &json, Some(b"{}")),
            fp(&Method::POST, "/order?x=1", &json, Some(b"{}")),
            fp(&Method::POST, "/orders?x=2", &json, Some(b"{}")),
            fp(&Method::POST, "/orders", &json, Some(b"{}")),
            fp(&Method::POST, "/orders?x=1", &json, Some(b"{ }")),
            fp(&Method::POST, "/orders?x=1", &json, None),
            fp(&Method::POST, "/orders?x=1", &HeaderMap::new(), Some(b"{}")),
            fp(
                &Method::POST,
                "/orders?x=1",
                &with(&[("content-type", "text/plain")]),
                Some(b"{}"),
            ),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(&base, v, "variant {i}");
        }

        // No body fingerprinted vs an empty body.
        assert_ne!(
            fp(&Method::POST, "/", &json, None),
            fp(&Method::POST, "/", &json, Some(b""))
        );
        // Path/body boundary.
        assert_ne!(
            fp(&Method::POST, "/ab", &HeaderMap::new(), Some(b"c")),
            fp(&Method::POST, "/a", &HeaderMap::new(), Some(b"bc"))
        );
        // Unlisted headers do not matter.
        let mut extra = json.clone();
        extra.insert("x-request-id", hv(b"r1"));
        assert_eq!(base, fp(&Method::POST, "/orders?x=1", &extra, Some(b"{}")));
    }

    #[test]
    fn record_ids_and_fingerprints_live_in_separate_domains() {
        let none = HeaderMap::new();
        assert_ne!(
            record_hash("", &none, &[], ""),
            fingerprint(&Method::GET, b"", &none, &[], &[], None)
        );
    }

    #[test]
    fn hash_label_is_short_prefix() {
        let mut hash = [0u8; 32];
        hash[0] = 0xab;
        hash[7] = 0x01;
        hash[8] = 0xff;
        assert_eq!(hash_label(&hash).to_string(), "ab00000000000001");
    }
}
