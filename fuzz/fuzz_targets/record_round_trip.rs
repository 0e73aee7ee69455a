//! The stored-record codec on structured input: decode(encode(x)) == x for every completion,
//! whatever the header names, values and body hold.
#![no_main]

use std::sync::Arc;

use arbitrary::Arbitrary;
use bytes::Bytes;
use idemgate::store::{codec, Completion, StoredResponse};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    Response {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    },
    Unreplayable {
        status: u16,
    },
}

fuzz_target!(|input: Input| {
    let completion = match input {
        Input::Response {
            status,
            headers,
            body,
        } => Completion::Response(Arc::new(StoredResponse::new(status, headers, body))),
        Input::Unreplayable { status } => Completion::Unreplayable { status },
    };
    let encoded = codec::encode(&completion);
    let decoded = codec::decode(&Bytes::from(encoded.clone())).expect("an encoding decodes");
    assert_eq!(decoded, completion);
    assert_eq!(codec::encode(&decoded), encoded);
    // Any strict prefix is a truncated record, never another valid one.
    if let Some(cut) = encoded.len().checked_sub(1) {
        assert!(codec::decode(&Bytes::copy_from_slice(&encoded[..cut])).is_err());
    }
});
