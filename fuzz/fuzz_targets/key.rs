//! The key header parser, the tenant check and the record-id / fingerprint hashing.
//!
//! Never panic, and agree with an independent reading of the spec:
//! - one header value parses exactly as a straightforward reference parser says (same key, same
//!   error);
//! - several values give the key they all decode to, or the first error, or ConflictingValues;
//! - an accepted key is 1..=255 visible ASCII characters and, written back as an sf-string (or
//!   bare when it can be), parses to the same key;
//! - a tenant is accepted exactly when it is 1..=128 bytes of `[A-Za-z0-9._:-]`;
//! - two (tenant, scope values, key) triples get the same record id exactly when they are equal,
//!   and the same for fingerprints: the length-prefixed encodings leave no ambiguous boundary.
#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use idemgate::key::{self, KeyError, TenantError, MAX_KEY_LEN, MAX_TENANT_LEN};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    key_values: Vec<&'a [u8]>,
    tenant: &'a [u8],
    a: Scoped<'a>,
    b: Scoped<'a>,
    fa: Request<'a>,
    fb: Request<'a>,
}

/// The inputs of a record id. Header lines that `http` refuses are dropped.
#[derive(Arbitrary, Debug)]
struct Scoped<'a> {
    tenant: &'a str,
    lines: Vec<(&'a [u8], &'a [u8])>,
    names: Vec<&'a [u8]>,
    key: &'a str,
}

/// The inputs of a fingerprint.
#[derive(Arbitrary, Debug)]
struct Request<'a> {
    method: &'a [u8],
    path: &'a [u8],
    lines: Vec<(&'a [u8], &'a [u8])>,
    names: Vec<&'a [u8]>,
    body: Option<&'a [u8]>,
}

fuzz_target!(|input: Input<'_>| {
    check_key(&input.key_values);
    check_tenant(input.tenant);
    check_record_ids(&input.a, &input.b);
    check_fingerprints(&input.fa, &input.fb);
});

// === key ===

fn check_key(raw_values: &[&[u8]]) {
    let values: Vec<HeaderValue> = raw_values
        .iter()
        .filter_map(|v| HeaderValue::from_bytes(v).ok())
        .collect();
    let got = key::parse_key(values.iter());

    // Several values: the first error wins, then any disagreement.
    let mut want: Result<Option<String>, KeyError> = Ok(None);
    for value in &values {
        match (reference(value.as_bytes()), &want) {
            (Err(e), _) => {
                want = Err(e);
                break;
            }
            (Ok(k), Ok(None)) => want = Ok(Some(k)),
            (Ok(k), Ok(Some(first))) if k == *first => {}
            (Ok(_), _) => {
                want = Err(KeyError::ConflictingValues);
                break;
            }
        }
    }
    assert_eq!(got, want, "values {values:?}");

    if let Ok(Some(k)) = got {
        assert!((1..=MAX_KEY_LEN).contains(&k.len()));
        assert!(k.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        let quoted = HeaderValue::from_str(&sf_string(&k)).expect("an sf-string is a header value");
        assert_eq!(key::parse_key([&quoted]), Ok(Some(k.clone())), "{quoted:?}");
        if !k.contains(['"', '\\', ',']) {
            let bare = HeaderValue::from_str(&k).expect("visible ASCII is a header value");
            assert_eq!(key::parse_key([&bare, &quoted]), Ok(Some(k.clone())));
        }
    }
}

/// One header value read the way the spec words it, written independently of the parser.
fn reference(raw: &[u8]) -> Result<String, KeyError> {
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = raw.iter().position(|b| !ows(b)).unwrap_or(raw.len());
    let end = raw.iter().rposition(|b| !ows(b)).map_or(start, |i| i + 1);
    let value = &raw[start..end];

    let decoded: Vec<u8> = if value.first() == Some(&b'"') {
        let mut out = Vec::new();
        let mut closed_at = None;
        let mut i = 1;
        while i < value.len() {
            match value[i] {
                b'\\' => match value.get(i + 1) {
                    Some(&c @ (b'"' | b'\\')) => {
                        out.push(c);
                        i += 2;
                    }
                    _ => return Err(KeyError::MalformedQuoting),
                },
                b'"' => {
                    closed_at = Some(i);
                    break;
                }
                c => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        let closed_at = closed_at.ok_or(KeyError::MalformedQuoting)?;
        let after: Vec<u8> = value[closed_at + 1..]
            .iter()
            .copied()
            .skip_while(|b| ows(b))
            .collect();
        match after.first() {
            None => {}
            Some(b',') => return Err(KeyError::ConflictingValues),
            Some(_) => return Err(KeyError::MalformedQuoting),
        }
        out
    } else {
        if value.contains(&b',') {
            return Err(KeyError::ConflictingValues);
        }
        if value.contains(&b'"') || value.contains(&b'\\') {
            return Err(KeyError::MalformedQuoting);
        }
        value.to_vec()
    };

    if decoded.is_empty() {
        return Err(KeyError::Empty);
    }
    if decoded.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: decoded.len() });
    }
    if !decoded.iter().all(|b| b.is_ascii_graphic()) {
        return Err(KeyError::InvalidCharacter);
    }
    String::from_utf8(decoded).map_err(|_| KeyError::InvalidCharacter)
}

fn sf_string(key: &str) -> String {
    let mut out = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

// === tenant ===

fn check_tenant(raw: &[u8]) {
    let want = if raw.is_empty() {
        Err(TenantError::Empty)
    } else if raw.len() > MAX_TENANT_LEN {
        Err(TenantError::TooLong { len: raw.len() })
    } else if raw
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:".contains(b))
    {
        Ok(std::str::from_utf8(raw).expect("ASCII"))
    } else {
        Err(TenantError::InvalidCharacter)
    };
    assert_eq!(key::validate_tenant(raw), want);
}

// === hashing ===

fn headers(lines: &[(&[u8], &[u8])]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in lines {
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        {
            map.append(name, value);
        }
    }
    map
}

fn names(raw: &[&[u8]]) -> Vec<HeaderName> {
    raw.iter()
        .filter_map(|n| HeaderName::from_bytes(n).ok())
        .collect()
}

/// What a hash must depend on: each listed name with all its values, in order.
fn scope_view(map: &HeaderMap, names: &[HeaderName]) -> Vec<(String, Vec<Vec<u8>>)> {
    names
        .iter()
        .map(|n| {
            let values = map
                .get_all(n)
                .iter()
                .map(|v| v.as_bytes().to_vec())
                .collect();
            (n.as_str().to_owned(), values)
        })
        .collect()
}

fn check_record_ids(a: &Scoped<'_>, b: &Scoped<'_>) {
    let (ma, na) = (headers(&a.lines), names(&a.names));
    let (mb, nb) = (headers(&b.lines), names(&b.names));
    let ha = key::record_hash(a.tenant, &ma, &na, a.key);
    let hb = key::record_hash(b.tenant, &mb, &nb, b.key);
    assert_eq!(
        ha,
        key::record_hash(a.tenant, &ma, &na, a.key),
        "not deterministic"
    );
    let same =
        a.tenant == b.tenant && a.key == b.key && scope_view(&ma, &na) == scope_view(&mb, &nb);
    assert_eq!(ha == hb, same, "record ids of {a:?} and {b:?}");

    let label = key::hash_label(&ha).to_string();
    let hex: String = ha[..8].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(label, hex);
}

fn check_fingerprints(a: &Request<'_>, b: &Request<'_>) {
    let (Ok(method_a), Ok(method_b)) = (Method::from_bytes(a.method), Method::from_bytes(b.method))
    else {
        return;
    };
    let (ma, na) = (headers(&a.lines), names(&a.names));
    let (mb, nb) = (headers(&b.lines), names(&b.names));
    let fa = key::fingerprint(&method_a, a.path, &ma, &na, &[], a.body);
    let fb = key::fingerprint(&method_b, b.path, &mb, &nb, &[], b.body);
    let same = method_a == method_b
        && a.path == b.path
        && a.body == b.body
        && scope_view(&ma, &na) == scope_view(&mb, &nb);
    assert_eq!(fa == fb, same, "fingerprints of {a:?} and {b:?}");
    // A record id and a fingerprint live in separate domains.
    assert_ne!(fa, key::record_hash("", &ma, &na, ""));
}
