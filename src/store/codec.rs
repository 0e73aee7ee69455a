//! The binary encoding of a [`Completion`] as the Redis store keeps it: compact, versioned, and
//! read by a decoder that never panics, whatever bytes it is handed.
//!
//! Layout of version 1 (all lengths are unsigned LEB128 varints, at most 10 bytes):
//!
//! ```text
//!   u8      version            = 1
//!   u8      kind               0 = response, 1 = unreplayable
//!   u16 BE  status
//!   -- response only --
//!   varint  header count
//!   per header: varint name length, name (UTF-8), varint value length, value (raw bytes)
//!   varint  body length, body
//! ```
//!
//! Varints must be in their shortest form, so decoding and re-encoding give back the input.
//! Every length is checked against the bytes that remain before anything is allocated, so a
//! forged length cannot make the decoder reserve gigabytes, and trailing bytes are an error: a
//! record that does not end where it says is not trusted. Header order and duplicates are kept.

use std::sync::Arc;

use bytes::Bytes;

use super::{response, Completion, ResponseBuilder, StoreError, StoredResponse};

/// The only encoding version this build writes and reads.
pub const VERSION: u8 = 1;

const KIND_RESPONSE: u8 = 0;
const KIND_UNREPLAYABLE: u8 = 1;

/// Encodes a completion for storage.
pub fn encode(completion: &Completion) -> Vec<u8> {
    match completion {
        Completion::Response(response) => encode_response(response),
        Completion::Unreplayable { status } => {
            let mut out = Vec::with_capacity(4);
            out.push(VERSION);
            out.push(KIND_UNREPLAYABLE);
            out.extend_from_slice(&status.to_be_bytes());
            out
        }
    }
}

/// Encodes a stored response (a replayable completion).
pub fn encode_response(response: &StoredResponse) -> Vec<u8> {
    let mut out = Vec::with_capacity(response.size_bytes());
    out.push(VERSION);
    out.push(KIND_RESPONSE);
    out.extend_from_slice(&response.status.to_be_bytes());
    put_varint(&mut out, response.header_count() as u64);
    for (name, value) in response.headers() {
        put_bytes(&mut out, name.as_bytes());
        put_bytes(&mut out, value);
    }
    put_bytes(&mut out, response.body());
    out
}

/// Decodes what [`encode`] wrote into a stored response of its own (one buffer, see
/// [`ResponseBuilder`]).
///
/// Returns [`StoreError::Corrupt`] with the reason for anything else: empty input, an unknown
/// version or kind, a truncated or overlong field, a header name that is not UTF-8, trailing
/// bytes.
pub fn decode(bytes: &Bytes) -> Result<Completion, StoreError> {
    let mut reader = Reader { bytes, pos: 0 };
    let version = reader.u8("version")?;
    if version != VERSION {
        return Err(corrupt(format!("unknown encoding version {version}")));
    }
    let kind = reader.u8("kind")?;
    let status = u16::from_be_bytes([reader.u8("status")?, reader.u8("status")?]);
    if !response::is_stored_status(status) {
        return Err(corrupt(format!("status {status} is never stored")));
    }
    let completion = match kind {
        KIND_UNREPLAYABLE => Completion::Unreplayable { status },
        KIND_RESPONSE => {
            let count = reader.varint("header count")?;
            // Each header takes at least two bytes (two zero lengths): a larger count is a lie,
            // and believing it would reserve memory for nothing.
            if count > (reader.remaining() / 2) as u64 {
                return Err(corrupt(format!("header count {count} exceeds the record")));
            }
            if count > response::MAX_HEADERS as u64 {
                return Err(corrupt(format!(
                    "{count} headers, more than a stored response has ({})",
                    response::MAX_HEADERS
                )));
            }
            // Two passes over the headers: the first checks them and sizes the stored
            // response's one buffer, the second copies them in.
            let headers_at = reader.pos;
            let mut header_bytes = 0usize;
            for _ in 0..count {
                let name = utf8(reader.field("header name")?)?;
                let value = reader.field("header value")?;
                header_bytes += ResponseBuilder::header_size(name, value);
            }
            let body = reader.field("body")?;
            let mut builder =
                ResponseBuilder::with_capacity(status, header_bytes.saturating_add(body.len()));
            let mut again = Reader {
                bytes,
                pos: headers_at,
            };
            for _ in 0..count {
                let name = utf8(again.field("header name")?)?;
                builder.push_header(name, again.field("header value")?);
            }
            builder.push_body(body);
            Completion::Response(Arc::new(builder.finish()))
        }
        other => return Err(corrupt(format!("unknown completion kind {other}"))),
    };
    if reader.remaining() != 0 {
        return Err(corrupt(format!(
            "{} trailing bytes after the record",
            reader.remaining()
        )));
    }
    Ok(completion)
}

fn utf8(name: &[u8]) -> Result<&str, StoreError> {
    std::str::from_utf8(name).map_err(|_| corrupt("header name is not UTF-8"))
}

fn corrupt(reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt(reason.into())
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7F) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A cursor over the encoded record; every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn u8(&mut self, what: &str) -> Result<u8, StoreError> {
        let byte = self
            .bytes
            .get(self.pos)
            .copied()
            .ok_or_else(|| corrupt(format!("truncated at {what}")))?;
        self.pos += 1;
        Ok(byte)
    }

    fn varint(&mut self, what: &str) -> Result<u64, StoreError> {
        let mut value: u64 = 0;
        for shift in (0..64).step_by(7) {
            let byte = self.u8(what)?;
            let bits = u64::from(byte & 0x7F);
            // The tenth byte may only carry the top bit of a u64.
            if shift == 63 && bits > 1 {
                return Err(corrupt(format!("{what} overflows 64 bits")));
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                // A zero final byte after the first adds nothing: only the shortest form is
                // accepted, so every value has exactly one encoding.
                if byte == 0 && shift > 0 {
                    return Err(corrupt(format!("{what} is an overlong varint")));
                }
                return Ok(value);
            }
        }
        Err(corrupt(format!("{what} overflows 64 bits")))
    }

    /// A length-prefixed field, as a slice of the shared buffer.
    fn field(&mut self, what: &str) -> Result<&'a [u8], StoreError> {
        let len = self.varint(what)?;
        if len > self.remaining() as u64 {
            return Err(corrupt(format!(
                "{what} of {len} bytes exceeds the {} bytes left",
                self.remaining()
            )));
        }
        // `len` fits in the remaining length, hence in usize, and `end` in the buffer.
        let end = self.pos + len as usize;
        let field = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(field)
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    fn sample() -> StoredResponse {
        StoredResponse::new(
            201,
            vec![
                ("x-zeta", Bytes::from_static(b"z")),
                ("content-type", Bytes::from_static(b"application/json")),
                ("x-multi", Bytes::from_static(b"one")),
                ("x-empty", Bytes::new()),
                ("x-multi", Bytes::from_static(b"two")),
                ("x-bin", Bytes::from_static(b"\x00\xFF\x80\r\n")),
            ],
            Bytes::from((0..=255u8).cycle().take(1000).collect::<Vec<_>>()),
        )
    }

    fn round_trip(completion: &Completion) -> Completion {
        decode(&Bytes::from(encode(completion))).expect("round trip")
    }

    #[test]
    fn responses_round_trip_byte_exact() {
        let cases = [
            sample(),
            StoredResponse::new(204, StoredResponse::NO_HEADERS, b""),
            StoredResponse::new(
                599,
                vec![("a".repeat(300), Bytes::from(vec![7u8; 70_000]))],
                Bytes::from(vec![0u8; 200_000]),
            ),
        ];
        for response in cases {
            let completion = Completion::Response(Arc::new(response));
            assert_eq!(round_trip(&completion), completion);
        }
    }

    #[test]
    fn unreplayable_round_trips_in_four_bytes() {
        for status in [200, 201, 451, 599] {
            let completion = Completion::Unreplayable { status };
            assert_eq!(encode(&completion).len(), 4);
            assert_eq!(round_trip(&completion), completion);
        }
    }

    #[test]
    fn encoding_is_compact() {
        let response = sample();
        let payload: usize = response
            .headers()
            .map(|(n, v)| n.len() + v.len())
            .sum::<usize>()
            + response.body().len();
        // Version, kind, status, a varint per length: a few bytes per header on top.
        let overhead = encode_response(&response).len() - payload;
        assert!(overhead <= 4 + 1 + 6 * 2 + 2, "overhead {overhead} bytes");
    }

    #[test]
    fn varints_round_trip_at_the_edges() {
        for value in [0, 1, 127, 128, 16_383, 16_384, u32::MAX as u64, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            let bytes = Bytes::from(out);
            let mut reader = Reader {
                bytes: &bytes,
                pos: 0,
            };
            assert_eq!(reader.varint("v").unwrap(), value);
            assert_eq!(reader.remaining(), 0);
        }
    }

    #[track_caller]
    fn assert_corrupt(bytes: &[u8], reason: &str) {
        match decode(&Bytes::copy_from_slice(bytes)) {
            Err(StoreError::Corrupt(got)) => {
                assert!(got.contains(reason), "reason {got:?} lacks {reason:?}")
            }
            other => panic!("expected Corrupt({reason}), got {other:?}"),
        }
    }

    #[test]
    fn every_truncation_is_corrupt() {
        for completion in [
            Completion::Response(Arc::new(sample())),
            Completion::Unreplayable { status: 200 },
        ] {
            let full = encode(&completion);
            for len in 0..full.len() {
                assert!(
                    matches!(
                        decode(&Bytes::copy_from_slice(&full[..len])),
                        Err(StoreError::Corrupt(_))
                    ),
                    "truncation to {len} bytes decoded"
                );
            }
        }
    }

    #[test]
    fn malformed_records_name_the_reason() {
        assert_corrupt(b"", "truncated at version");
        assert_corrupt(b"\x02\x00\x00\xC8", "unknown encoding version 2");
        assert_corrupt(b"\x01\x07\x00\xC8", "unknown completion kind 7");
        assert_corrupt(b"\x01\x01\x00\xC8\x00", "1 trailing bytes");
        // A header count far beyond what the record holds.
        assert_corrupt(b"\x01\x00\x00\xC8\xFF\xFF\xFF\xFF\x0F", "header count");
        // A body length beyond the end.
        assert_corrupt(b"\x01\x00\x00\xC8\x00\x05abc", "body of 5 bytes exceeds");
        // A varint longer than 64 bits.
        assert_corrupt(
            b"\x01\x00\x00\xC8\x00\xFF\xFF\xFF\xFF\xFF\xFF\xFF\xFF\xFF\x7F",
            "overflows 64 bits",
        );
        assert_corrupt(b"\x01\x00\x00\xC8\x01\x02\xC3\x28\x00\x00", "not UTF-8");
        assert_corrupt(b"\x01\x00\x00\xC8\x80\x00\x00", "overlong varint");
        // Statuses no record holds: an interim or upgrade answer, and past 599.
        for status in [0u16, 101, 199, 600, u16::MAX] {
            let [hi, lo] = status.to_be_bytes();
            assert_corrupt(&[1, 1, hi, lo], &format!("status {status} is never stored"));
            assert_corrupt(
                &[1, 0, hi, lo, 0, 0],
                &format!("status {status} is never stored"),
            );
        }
        // More headers than an answer idemgate relays may have (empty names and values).
        let mut many = b"\x01\x00\x00\xC8\x81\x02".to_vec();
        many.extend(std::iter::repeat_n(0u8, 2 * 257 + 1));
        assert_corrupt(&many, "257 headers, more than a stored response has (256)");
        let mut most = b"\x01\x00\x00\xC8\x80\x02".to_vec();
        most.extend(std::iter::repeat_n(0u8, 2 * 256 + 1));
        assert!(
            decode(&Bytes::from(most)).is_ok(),
            "256 headers are refused"
        );
    }

    #[test]
    fn fuzz_seed_records_decode() {
        // The decoder fuzzer starts from these: each must be a valid record.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/record_decode");
        for entry in std::fs::read_dir(&dir).expect("fuzz/seeds/record_decode") {
            let path = entry.expect("seed entry").path();
            let bytes = Bytes::from(std::fs::read(&path).expect("seed bytes"));
            let completion = decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(encode(&completion), bytes);
        }
    }

    #[test]
    fn random_and_mutated_input_never_panics() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x1de6a7e);
        let valid = encode(&Completion::Response(Arc::new(sample())));
        for round in 0..20_000 {
            let input: Vec<u8> = if round % 2 == 0 {
                let len = rng.gen_range(0..64);
                (0..len).map(|_| rng.gen()).collect()
            } else {
                let mut bytes = valid.clone();
                for _ in 0..rng.gen_range(1..4) {
                    let at = rng.gen_range(0..bytes.len());
                    bytes[at] = rng.gen();
                }
                bytes.truncate(rng.gen_range(0..=bytes.len()));
                bytes
            };
            // Decoding either succeeds or reports corruption; a success re-encodes to the input.
            if let Ok(completion) = decode(&Bytes::from(input.clone())) {
                assert_eq!(encode(&completion), input, "decode is not canonical");
            }
        }
    }
}
