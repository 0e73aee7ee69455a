//! The stored-record decoder on arbitrary bytes (what a corrupted or foreign Redis value looks
//! like): never panic, and when it accepts the bytes they are the one canonical encoding of what
//! it returns, so re-encoding gives them back.
#![no_main]

use bytes::Bytes;
use idemgate::store::{codec, Completion};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let bytes = Bytes::copy_from_slice(data);
    if let Ok(completion) = codec::decode(&bytes) {
        assert_eq!(
            codec::encode(&completion),
            data,
            "decode accepted a non-canonical record"
        );
        if let Completion::Response(response) = &completion {
            assert!(response.size_bytes() >= response.body().len());
            assert_eq!(codec::encode_response(response), data);
        }
    }
});
