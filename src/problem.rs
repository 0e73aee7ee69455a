//! Every answer the proxy makes by itself: its status, `X-Idempotent-Result` and RFC 9457 body.
//!
//! One place maps an error kind to its HTTP meaning; the proxy converts once, here. The `type`
//! URIs are stable and documented in the README so clients can tell a proxy-made 409/422 from the
//! backend's own.

use std::time::Duration;

use bytes::Bytes;

/// The `X-Idempotent-Result` value of a response on an idempotent route.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Executed now; the response is (being) stored.
    Miss,
    /// Replayed from the store; the backend was not contacted.
    Hit,
    /// 409: another request holds the key, or the stored result cannot be replayed.
    Conflict,
    /// 422: the key was used with a different request.
    Mismatch,
    /// 400 (or 413/408): the request was refused before any claim.
    Invalid,
    /// The route's key is optional and none was sent: forwarded without protection.
    Bypass,
    /// The store was unavailable and policy forwarded the request anyway.
    Degraded,
    /// 503: the store was unavailable (or full) and policy refused the request, or the proxy
    /// had no room for its body; nothing was claimed or forwarded.
    Unavailable,
}

impl Outcome {
    /// Header value and metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Miss => "MISS",
            Outcome::Hit => "HIT",
            Outcome::Conflict => "CONFLICT",
            Outcome::Mismatch => "MISMATCH",
            Outcome::Invalid => "INVALID",
            Outcome::Bypass => "BYPASS",
            Outcome::Degraded => "DEGRADED",
            Outcome::Unavailable => "UNAVAILABLE",
        }
    }
}

/// An error the proxy answers itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// `key: required` and no key header.
    KeyMissing,
    /// The key header is malformed (detail says how, never echoing the key).
    KeyInvalid(String),
    /// The tenant header is malformed.
    TenantInvalid(String),
    /// `scope_required` and none of the route's scope headers carries a value (the names, as
    /// configured, to send one of).
    ScopeMissing(String),
    /// The request body exceeds `max_request_bytes`.
    RequestTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// The request bodies held in memory hold `max_buffered_request_bytes`: this keyed
    /// request's would go past it. Refused before any claim, so nothing ran.
    RequestBuffersFull,
    /// The client stopped sending the body for longer than `request_body_timeout`.
    RequestTimeout,
    /// The client did not send a whole request header within `request_header_timeout`.
    RequestHeaderTimeout,
    /// The request line or a header field is not valid HTTP/1.1.
    RequestMalformed,
    /// A `CONNECT` request: idemgate does not tunnel.
    ConnectNotSupported,
    /// The request header is larger than `max_request_header_bytes`.
    RequestHeaderTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// The request body could not be read (client error or framing).
    RequestBodyUnreadable,
    /// A keyed request's body under a transfer coding other than `chunked` (`gzip, chunked`):
    /// idemgate reads the body whole and sends it with a length, so it could not pass the
    /// coding on, and the backend would take the coded bytes for the body.
    TransferCodingUnsupported,
    /// Another request with the same key is executing.
    InFlight {
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// The key was used before with a different request.
    FingerprintMismatch,
    /// The key's response was too large to store; it will not be executed again.
    NotReplayable,
    /// The record store is unreachable and policy is `reject`.
    StoreUnavailable,
    /// The record store is full of live records.
    StoreFull,
    /// The store holds a record for the key that this proxy cannot read (written by a newer
    /// version, or damaged): the request is refused, never executed again.
    StoreRecordUnreadable,
    /// No route and no default upstream.
    NoRoute,
    /// A standard method sent in another case (`post`): methods are case-sensitive, and a
    /// backend that folds case would execute it unprotected.
    MethodCase,
    /// The upstream already had `max_in_flight` requests out from this process: nothing was
    /// sent (a claim taken for it was released).
    UpstreamBusy {
        /// When a retry may be sent: 1 s, or when the key's lock lapses if the store did not
        /// take the release.
        retry_after: Duration,
    },
    /// The backend could not be reached; nothing was sent, the key was released.
    UpstreamConnect,
    /// The backend could not be reached and nothing was sent, but the key could not be
    /// released (the store did not answer): it stays locked until its lock lapses.
    UpstreamConnectKeyLocked {
        /// When the lock has lapsed at the latest.
        retry_after: Duration,
    },
    /// The request was sent but no complete answer came back: the key stays locked until its
    /// lock lapses, or (by `on_outcome_unknown: settle`) is recorded as executed.
    UpstreamOutcomeUnknown(OutcomeKept),
    /// A request forwarded without a claim (no key, or `on_unavailable: pass`) reached the
    /// backend (whole or in part) and no answer came back: it may have been executed, and no
    /// lock makes a retry safe.
    UpstreamAnswerLost,
    /// A keyed request's backend answered with a final status, in a head that is not HTTP
    /// idemgate can relay; its status decided what became of the key.
    UpstreamAnswerInvalid(AnswerSettled),
}

/// What became of the claim of a request whose answer could not be relayed
/// ([`Problem::UpstreamAnswerInvalid`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerSettled {
    /// A status the route stores: recorded as executed, not replayable.
    Recorded,
    /// A status the route does not store (5xx, 408, 429 by default): released.
    Released,
    /// A status the route does not store, but the store did not take the release: the key
    /// stays locked until its lock lapses.
    Locked {
        /// When the lock has lapsed at the latest.
        retry_after: Duration,
    },
}

/// What became of the claim of a request sent whose answer was lost
/// ([`Problem::UpstreamOutcomeUnknown`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutcomeKept {
    /// Locked until the lock lapses (`on_outcome_unknown: lapse`); a retry then runs it again.
    Locked {
        /// When the lock has lapsed at the latest (`Retry-After`; before then a retry gets
        /// 409 `request-in-flight`).
        retry_after: Duration,
    },
    /// Recorded as executed, not replayable (`settle`): retries get 409, never a second
    /// execution.
    Settled,
}

/// Base of every problem `type` URI.
pub const PROBLEM_BASE: &str = "https://idemgate.dev/problems/";

impl Problem {
    /// HTTP status of the answer.
    pub fn status(&self) -> u16 {
        match self {
            Problem::KeyMissing | Problem::KeyInvalid(_) | Problem::TenantInvalid(_) => 400,
            Problem::ScopeMissing(_) => 400,
            Problem::RequestBodyUnreadable => 400,
            Problem::TransferCodingUnsupported => 501,
            Problem::RequestTooLarge { .. } => 413,
            Problem::RequestTimeout | Problem::RequestHeaderTimeout => 408,
            Problem::RequestHeaderTooLarge { .. } => 431,
            Problem::RequestMalformed => 400,
            Problem::ConnectNotSupported => 405,
            Problem::InFlight { .. } | Problem::NotReplayable => 409,
            Problem::FingerprintMismatch => 422,
            Problem::StoreUnavailable | Problem::StoreFull | Problem::UpstreamBusy { .. } => 503,
            Problem::RequestBuffersFull => 503,
            Problem::StoreRecordUnreadable => 503,
            Problem::NoRoute => 404,
            Problem::MethodCase => 400,
            Problem::UpstreamConnect | Problem::UpstreamConnectKeyLocked { .. } => 502,
            Problem::UpstreamOutcomeUnknown(_) => 504,
            Problem::UpstreamAnswerLost | Problem::UpstreamAnswerInvalid(_) => 502,
        }
    }

    /// Last segment of the `type` URI; stable, documented.
    pub fn slug(&self) -> &'static str {
        match self {
            Problem::KeyMissing => "idempotency-key-missing",
            Problem::KeyInvalid(_) => "idempotency-key-invalid",
            Problem::TenantInvalid(_) => "tenant-invalid",
            Problem::ScopeMissing(_) => "scope-missing",
            Problem::RequestTooLarge { .. } => "request-too-large",
            Problem::RequestBuffersFull => "request-buffers-full",
            Problem::RequestTimeout => "request-timeout",
            Problem::RequestHeaderTimeout => "request-header-timeout",
            Problem::RequestHeaderTooLarge { .. } => "request-header-too-large",
            Problem::RequestMalformed => "request-malformed",
            Problem::ConnectNotSupported => "connect-not-supported",
            Problem::RequestBodyUnreadable => "request-body-unreadable",
            Problem::TransferCodingUnsupported => "transfer-coding-unsupported",
            Problem::InFlight { .. } => "request-in-flight",
            Problem::FingerprintMismatch => "fingerprint-mismatch",
            Problem::NotReplayable => "response-not-replayable",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::UpstreamBusy { .. } => "upstream-busy",
            Problem::StoreFull => "store-full",
            Problem::StoreRecordUnreadable => "store-record-unreadable",
            Problem::NoRoute => "no-route",
            Problem::MethodCase => "method-case",
            Problem::UpstreamConnect | Problem::UpstreamConnectKeyLocked { .. } => {
                "upstream-unreachable"
            }
            Problem::UpstreamOutcomeUnknown(_) => "upstream-outcome-unknown",
            Problem::UpstreamAnswerLost => "upstream-answer-lost",
            Problem::UpstreamAnswerInvalid(_) => "upstream-answer-invalid",
        }
    }

    /// Short human title.
    pub fn title(&self) -> &'static str {
        match self {
            Problem::KeyMissing => "Idempotency-Key header required",
            Problem::KeyInvalid(_) => "Idempotency-Key header is malformed",
            Problem::TenantInvalid(_) => "Tenant header is malformed",
            Problem::ScopeMissing(_) => "Principal header required",
            Problem::RequestTooLarge { .. } => "Request body too large",
            Problem::RequestBuffersFull => "Proxy busy: request buffers full",
            Problem::RequestTimeout => "Request body not received in time",
            Problem::RequestHeaderTimeout => "Request header not received in time",
            Problem::RequestHeaderTooLarge { .. } => "Request header too large",
            Problem::RequestMalformed => "Request is not valid HTTP/1.1",
            Problem::ConnectNotSupported => "CONNECT is not supported",
            Problem::RequestBodyUnreadable => "Request body could not be read",
            Problem::TransferCodingUnsupported => "Request transfer coding not supported",
            Problem::InFlight { .. } => "A request with this idempotency key is in progress",
            Problem::FingerprintMismatch => "Idempotency key reused with a different request",
            Problem::NotReplayable => "Stored response for this idempotency key is not replayable",
            Problem::StoreUnavailable => "Idempotency store unavailable",
            Problem::UpstreamBusy { .. } => "Backend busy",
            Problem::StoreFull => "Idempotency store full",
            Problem::StoreRecordUnreadable => "Stored record for this idempotency key unreadable",
            Problem::NoRoute => "No route for this request",
            Problem::MethodCase => "Request method in the wrong case",
            Problem::UpstreamConnect | Problem::UpstreamConnectKeyLocked { .. } => {
                "Backend unreachable"
            }
            Problem::UpstreamOutcomeUnknown(_) => "Backend outcome unknown",
            Problem::UpstreamAnswerLost => "Backend answer lost",
            Problem::UpstreamAnswerInvalid(_) => "Backend answer not valid HTTP",
        }
    }

    fn detail(&self) -> String {
        match self {
            Problem::KeyMissing => "This route requires an idempotency key header.".into(),
            Problem::KeyInvalid(why) | Problem::TenantInvalid(why) => why.clone(),
            Problem::ScopeMissing(names) => format!(
                "This route binds idempotency keys to the principal that sends them: send \
                 {names} with a value."
            ),
            Problem::RequestTooLarge { limit } => {
                format!("The request body exceeds the limit of {limit} bytes.")
            }
            Problem::RequestBuffersFull => "Too many request bodies are held in memory at once; \
                this one was not forwarded and its key not claimed. Retry later with the same key."
                .into(),
            Problem::RequestTimeout => "The client stopped sending the request body.".into(),
            Problem::RequestHeaderTooLarge { limit } => format!(
                "The request line and header fields exceed the limit of {limit} bytes; the \
                 connection is closed."
            ),
            Problem::RequestMalformed => "The request line or a header field could not be \
                parsed; the connection is closed."
                .into(),
            Problem::ConnectNotSupported => {
                "idemgate proxies requests, it does not open tunnels.".into()
            }
            Problem::RequestHeaderTimeout => {
                "The client did not send the whole request header in time; the connection is \
                 closed."
                    .into()
            }
            Problem::RequestBodyUnreadable => "The request body was malformed or cut off.".into(),
            Problem::TransferCodingUnsupported => "The request body uses a transfer coding other \
                than chunked, which idemgate cannot pass on; send it with Content-Length or \
                chunked alone. It was not forwarded."
                .into(),
            Problem::InFlight { .. } => {
                "The first request with this key has not finished; retry later to get its result."
                    .into()
            }
            Problem::FingerprintMismatch => "This key was first used with a different method, \
                path, body or fingerprinted headers; use a new key for a new request."
                .into(),
            Problem::NotReplayable => "The request was executed (or may have been: its answer \
                was lost), but its response was larger than the replay limit, still streaming \
                when its lock was about to lapse, not HTTP that could be relayed, or lost; it \
                will not be executed again."
                .into(),
            Problem::StoreUnavailable => {
                "The request was not forwarded because duplicates could not be detected.".into()
            }
            Problem::StoreFull => "The request was not forwarded because the store is full of \
                live records."
                .into(),
            Problem::StoreRecordUnreadable => "The store holds a record for this key that this \
                proxy cannot read; the request was not forwarded, so it cannot run twice. A \
                retry may reach a proxy that can read it."
                .into(),
            Problem::NoRoute => "No configured route matches this request.".into(),
            Problem::MethodCase => "HTTP methods are case-sensitive; send the standard method \
                in upper case."
                .into(),
            Problem::UpstreamBusy { .. } => {
                "The backend already has as many requests in flight from \
                this proxy as it may take; the request was not sent and may be retried with the \
                same key after Retry-After."
                    .into()
            }
            Problem::UpstreamConnect => "The backend could not be reached; the request was not \
                sent and may be retried with the same key."
                .into(),
            Problem::UpstreamConnectKeyLocked { .. } => "The backend could not be reached; the \
                request was not sent, but its key could not be released and stays locked until \
                its lock expires: retry with the same key after Retry-After."
                .into(),
            Problem::UpstreamOutcomeUnknown(OutcomeKept::Locked { .. }) => {
                "The request was sent but the \
                backend's answer was lost; retries with this key are refused until the lock \
                expires."
                    .into()
            }
            Problem::UpstreamOutcomeUnknown(OutcomeKept::Settled) => {
                "The request was sent but the \
                backend's answer was lost; it is recorded as executed (once the store takes the \
                write), so retries with this key get 409 and are not executed again."
                    .into()
            }
            Problem::UpstreamAnswerLost => "The request reached the backend but no answer came \
                back; it may have been executed, and no idempotency lock guards a retry."
                .into(),
            Problem::UpstreamAnswerInvalid(AnswerSettled::Recorded) => "The backend answered, \
                but not with HTTP that can be relayed. The request was executed: retries with \
                this key get 409 and are not executed again."
                .into(),
            Problem::UpstreamAnswerInvalid(AnswerSettled::Released) => "The backend answered \
                with a status this route does not store, but not with HTTP that can be relayed; \
                the key was released, so the request may be retried with the same key."
                .into(),
            Problem::UpstreamAnswerInvalid(AnswerSettled::Locked { .. }) => "The backend \
                answered with a status this route does not store, but not with HTTP that can be \
                relayed, and the key could not be released: retry with the same key after \
                Retry-After."
                .into(),
        }
    }

    /// The `X-Idempotent-Result` this answer carries on an idempotent route.
    pub fn outcome(&self) -> Outcome {
        match self {
            Problem::KeyMissing
            | Problem::KeyInvalid(_)
            | Problem::TenantInvalid(_)
            | Problem::ScopeMissing(_)
            | Problem::RequestTooLarge { .. }
            | Problem::RequestTimeout
            | Problem::RequestHeaderTimeout
            | Problem::RequestHeaderTooLarge { .. }
            | Problem::RequestMalformed
            | Problem::ConnectNotSupported
            | Problem::RequestBodyUnreadable
            | Problem::TransferCodingUnsupported => Outcome::Invalid,
            Problem::InFlight { .. } | Problem::NotReplayable => Outcome::Conflict,
            Problem::FingerprintMismatch => Outcome::Mismatch,
            Problem::StoreUnavailable
            | Problem::StoreFull
            | Problem::StoreRecordUnreadable
            | Problem::RequestBuffersFull
            | Problem::UpstreamBusy { .. } => Outcome::Unavailable,
            Problem::NoRoute | Problem::MethodCase => Outcome::Invalid,
            Problem::UpstreamConnect
            | Problem::UpstreamConnectKeyLocked { .. }
            | Problem::UpstreamOutcomeUnknown(_)
            | Problem::UpstreamAnswerLost
            | Problem::UpstreamAnswerInvalid(_) => Outcome::Miss,
        }
    }

    /// Seconds for `Retry-After`, where a retry can help.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self {
            Problem::InFlight { retry_after }
            | Problem::UpstreamOutcomeUnknown(OutcomeKept::Locked { retry_after })
            | Problem::UpstreamBusy { retry_after }
            | Problem::UpstreamConnectKeyLocked { retry_after }
            | Problem::UpstreamAnswerInvalid(AnswerSettled::Locked { retry_after }) => {
                Some(retry_after.as_secs_f64().ceil().max(1.0) as u64)
            }
            Problem::StoreUnavailable
            | Problem::StoreFull
            | Problem::StoreRecordUnreadable
            | Problem::RequestBuffersFull => Some(1),
            _ => None,
        }
    }

    /// The RFC 9457 body.
    pub fn body(&self) -> Bytes {
        let body = document(self.slug(), self.title(), self.status(), &self.detail());
        Bytes::from(body.to_string())
    }
}

/// An RFC 9457 problem document of kind `slug` (its `type` is under [`PROBLEM_BASE`]): what
/// the proxy's problems and the admin API's errors are made of.
pub fn document(slug: &str, title: &str, status: u16, detail: &str) -> serde_json::Value {
    serde_json::json!({
        "type": format!("{PROBLEM_BASE}{slug}"),
        "title": title,
        "status": status,
        "detail": detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every problem type `slug` names is in the README's table of problem types, where
    /// clients and operators look it up (SPEC: "a stable `type` URI per error kind, documented
    /// in the README"). Read from this file's `slug`, so a new kind cannot be left out.
    #[test]
    fn every_problem_type_is_documented_in_the_readme() {
        let source = include_str!("problem.rs");
        let readme = include_str!("../README.md");
        let table_start = readme.find("### Problem types").expect("README section");
        let table = &readme[table_start..];
        let table = &table[..table.find("\n## ").unwrap_or(table.len())];
        let body_start = source.find("pub fn slug(&self)").expect("slug()");
        let body = &source[body_start..];
        let body = &body[..body.find("\n    }\n").expect("end of slug()")];
        let slugs: Vec<&str> = body
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|s| !s.is_empty())
            .collect();
        assert!(slugs.len() >= 25, "{slugs:?}");
        for slug in slugs {
            assert!(
                table.contains(&format!("`{slug}`")),
                "{slug} is not in the README's table"
            );
        }
    }

    #[test]
    fn body_is_problem_json_with_stable_type() {
        let p = Problem::FingerprintMismatch;
        let v: serde_json::Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(
            v["type"],
            "https://idemgate.dev/problems/fingerprint-mismatch"
        );
        assert_eq!(v["status"], 422);
        assert_eq!(p.outcome(), Outcome::Mismatch);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let p = Problem::InFlight {
            retry_after: Duration::from_millis(1200),
        };
        assert_eq!(p.retry_after_secs(), Some(2));
        let p = Problem::InFlight {
            retry_after: Duration::from_millis(10),
        };
        assert_eq!(p.retry_after_secs(), Some(1));
        assert_eq!(Problem::FingerprintMismatch.retry_after_secs(), None);
    }

    #[test]
    fn proxy_made_conflicts_are_told_apart() {
        assert_ne!(
            Problem::NotReplayable.slug(),
            Problem::InFlight {
                retry_after: Duration::ZERO
            }
            .slug()
        );
        assert_eq!(Problem::NotReplayable.status(), 409);
    }

    #[test]
    fn a_lost_answer_is_never_called_not_sent() {
        // "Not sent" invites a retry; a request that reached the backend must not claim it.
        let json = |p: Problem| -> serde_json::Value {
            serde_json::from_slice(&p.body()).expect("problem body is JSON")
        };
        let unreachable = json(Problem::UpstreamConnect);
        let lost = json(Problem::UpstreamAnswerLost);
        assert_ne!(unreachable["type"], lost["type"]);
        assert!(unreachable["detail"].as_str().unwrap().contains("not sent"));
        let detail = lost["detail"].as_str().unwrap();
        assert!(!detail.contains("not sent"), "{detail}");
        assert!(detail.contains("may have been executed"), "{detail}");
        assert_eq!(Problem::UpstreamAnswerLost.status(), 502);
    }
}
