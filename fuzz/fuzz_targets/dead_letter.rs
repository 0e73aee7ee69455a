//! The dead-letter line reader of `idemgate --reconcile`: on arbitrary text it never panics, and
//! every line the proxy writes (any response, any key, any execution) reads back as written, with
//! header names as a backend's answer is stored (valid, lower case) and valid header values.
#![no_main]

use std::sync::Arc;
use std::time::Duration;

use arbitrary::Arbitrary;
use idemgate::store::retry::{dead_letter_line, InStore, PendingCompletion};
use idemgate::store::{Completion, OwnerToken, RecordKey, StoredResponse};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    /// Any text, as a torn or hand-edited file may hold.
    Text(String),
    /// A line the proxy writes.
    Written {
        hash: [u8; 32],
        fingerprint: [u8; 32],
        execution_id: u64,
        ttl_ms: u32,
        status: u16,
        headers: Vec<(u8, Vec<u8>)>,
        body: Vec<u8>,
        unreplayable: bool,
        refused: bool,
    },
}

/// Header names a backend's answer can carry (the stored form: lower case).
const NAMES: [&str; 4] = ["content-type", "x-request-id", "etag", "x-a_b.c~d"];

fuzz_target!(|input: Input| match input {
    Input::Text(text) => {
        let _ = idemgate::fuzzing::dead_letter(&text);
    }
    Input::Written {
        hash,
        fingerprint,
        execution_id,
        ttl_ms,
        status,
        headers,
        body,
        unreplayable,
        refused,
    } => {
        let status = 100 + status % 900;
        // Values as a backend's answer can carry them: no control bytes but tab.
        let headers: Vec<(&str, Vec<u8>)> = headers
            .into_iter()
            .map(|(n, v)| {
                let v = v
                    .into_iter()
                    .filter(|b| *b == b'\t' || (*b >= 0x20 && *b != 0x7f))
                    .collect();
                (NAMES[usize::from(n) % NAMES.len()], v)
            })
            .collect();
        let completion = if unreplayable {
            Completion::Unreplayable { status }
        } else {
            Completion::Response(Arc::new(StoredResponse::new(status, headers, body)))
        };
        let job = PendingCompletion {
            key: RecordKey {
                tenant: "acme:eu-1".into(),
                hash,
            },
            owner: OwnerToken(0),
            completion: completion.clone(),
            ttl: Duration::from_millis(u64::from(ttl_ms)),
            execution_id,
            fingerprint,
            lock_deadline: tokio::time::Instant::now(),
        };
        let in_store = if refused {
            InStore::No
        } else {
            InStore::Unknown
        };
        let line = dead_letter_line(&job, 1, "fuzz", in_store);
        let (key, id, fp, read, _) =
            idemgate::fuzzing::dead_letter(line.trim()).expect("a written line reads");
        assert_eq!(key, job.key);
        assert_eq!(id, execution_id);
        assert_eq!(fp, Some(fingerprint));
        assert_eq!(read, completion);
    }
});
