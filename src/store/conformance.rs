//! The conformance suite every [`RecordStore`] backend must pass, shared by their test files.
//!
//! Cases use real time with short durations, because a Redis server's clock cannot be paused;
//! the whole suite takes a few seconds. Every case uses fresh random keys, so cases may share
//! one server. This is test support: a failed expectation panics, as an assertion does.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Barrier;

use super::{
    ClaimOutcome, ClaimRequest, Completion, Deletion, Digest, OwnerToken, Record, RecordKey,
    RecordState, RecordStore, StoreError, StoredResponse, WriteOutcome,
};

/// Lock lifetime for cases that let a lock lapse.
const LOCK_TTL: Duration = Duration::from_millis(300);
/// Record lifetime for cases that do not wait for expiry.
const TTL: Duration = Duration::from_secs(2);
/// Record lifetime for the expiry case.
const SHORT_TTL: Duration = Duration::from_millis(600);
/// Lock lifetime for cases where a lapse would confuse the outcome.
const LONG_LOCK: Duration = Duration::from_secs(10);
/// Timeout for waits that the other side is expected to end early.
const WAIT_TIMEOUT: Duration = Duration::from_secs(4);
/// Concurrent claimers in the race case.
const RACERS: usize = 20;

/// Runs every conformance case against stores made by `make` (each case gets a fresh store).
pub async fn run_all<S, F, Fut>(make: F)
where
    S: RecordStore,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<S>>,
{
    case_first_claim_acquires(&make().await).await;
    case_second_claim_sees_in_flight(&make().await).await;
    case_different_fingerprint_is_visible(&make().await).await;
    case_completed_response_replays_byte_exact(&make().await).await;
    case_complete_by_non_owner_is_refused(&make().await).await;
    case_release_then_claim_keeps_execution_id(&make().await).await;
    case_release_by_non_owner_is_refused(&make().await).await;
    case_lapsed_lock_is_taken_over_and_fenced(&make().await).await;
    case_owner_reclaim_renews_the_lock(&make().await).await;
    case_unreplayable_completion_reads_back(&make().await).await;
    case_record_expires_after_ttl(&make().await).await;
    case_reclaim_extends_record_life(&make().await).await;
    case_wait_returns_at_once_when_not_in_flight(&make().await).await;
    case_wait_wakes_on_complete(&make().await).await;
    case_wait_wakes_on_release(&make().await).await;
    case_wait_returns_when_lock_lapses(&make().await).await;
    case_wait_times_out_while_in_flight(&make().await).await;
    case_concurrent_claims_have_one_winner(&make().await).await;
    case_concurrent_claims_of_a_released_record_have_one_winner(&make().await).await;
    case_concurrent_claims_of_a_lapsed_lock_have_one_winner(&make().await).await;
    case_lapsed_owner_cannot_renew_after_a_takeover(&make().await).await;
    case_a_renewal_takes_back_only_its_own_lock(&make().await).await;
    case_wait_returns_when_the_record_is_deleted(&make().await).await;
    case_wait_returns_when_the_record_expires(&make().await).await;
    case_complete_after_own_release_is_refused(&make().await).await;
    case_lapsed_owner_may_finish_until_someone_reclaims(&make().await).await;
    case_different_fingerprint_does_not_take_over_a_lapsed_lock(&make().await).await;
    case_delete_removes(&make().await).await;
    case_settled_delete_spares_a_running_claim(&make().await).await;
    case_settled_delete_never_takes_a_claim_made_meanwhile(&make().await).await;
    case_tenants_are_distinct(&make().await).await;
}

/// The first claim of a key acquires it with the request's own execution id.
pub async fn case_first_claim_acquires<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    assert_eq!(ok(store.get(&key).await), None, "fresh key must be absent");
    let req = request(&key, fingerprint(1));
    assert_eq!(
        ok(store.claim(&req).await),
        ClaimOutcome::Acquired {
            execution_id: req.execution_id,
            lapsed: false,
        }
    );
    let record = ok(store.get(&key).await).expect("claimed record must exist");
    assert_eq!(record.fingerprint, req.fingerprint);
    assert_eq!(record.execution_id, req.execution_id);
    assert_in_flight(&record, req.lock_ttl);
}

/// A second claim with the same fingerprint sees the first one in flight and changes nothing.
pub async fn case_second_claim_sees_in_flight<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let first = request(&key, fingerprint(1));
    ok(store.claim(&first).await);
    let second = request(&key, fingerprint(1));
    let record = existing(ok(store.claim(&second).await));
    assert_eq!(record.fingerprint, first.fingerprint);
    assert_eq!(record.execution_id, first.execution_id);
    assert_in_flight(&record, first.lock_ttl);
    // The first claimer still owns the record.
    assert_eq!(
        ok(store.release(&key, second.owner).await),
        WriteOutcome::NotOwner
    );
    assert_eq!(
        ok(store.release(&key, first.owner).await),
        WriteOutcome::Applied
    );
}

/// A claim with another fingerprint gets the stored fingerprint back, in every state, and never
/// takes the record over.
pub async fn case_different_fingerprint_is_visible<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let first = request(&key, fingerprint(1));
    ok(store.claim(&first).await);

    let other = request(&key, fingerprint(2));
    let record = existing(ok(store.claim(&other).await));
    assert_eq!(record.fingerprint, first.fingerprint);
    assert!(matches!(record.state, RecordState::InFlight { .. }));

    // Released: a different request still does not get to execute under this key.
    assert_eq!(
        ok(store.release(&key, first.owner).await),
        WriteOutcome::Applied
    );
    let other = request(&key, fingerprint(2));
    let record = existing(ok(store.claim(&other).await));
    assert_eq!(record.fingerprint, first.fingerprint);
    assert_eq!(record.execution_id, first.execution_id);
    assert_eq!(record.state, RecordState::Released);

    // The matching request may, and completes.
    let again = request(&key, fingerprint(1));
    ok(store.claim(&again).await);
    let completion = Completion::Response(Arc::new(simple_response(201, b"done")));
    ok(store
        .complete(&key, again.owner, completion.clone(), TTL)
        .await);
    let other = request(&key, fingerprint(2));
    let record = existing(ok(store.claim(&other).await));
    assert_eq!(record.fingerprint, first.fingerprint);
    assert_eq!(record.state, RecordState::Completed(completion));
}

/// A response completed by the owner comes back byte for byte: status, header order and
/// duplicates, binary values and body, and an empty body.
pub async fn case_completed_response_replays_byte_exact<S: RecordStore>(store: &Arc<S>) {
    let binary_body: Vec<u8> = [0x00, 0xFF, 0x00, b'\r', b'\n', 0xFE, 0x80, 0x00, 0xFF]
        .into_iter()
        .chain((0..=255u8).rev())
        .collect();
    let responses = [
        StoredResponse::new(
            201,
            vec![
                ("x-zeta", Bytes::from_static(b"last-alphabetically")),
                (
                    "content-type",
                    Bytes::from_static(b"application/octet-stream"),
                ),
                ("x-multi", Bytes::from_static(b"one")),
                ("x-alpha", Bytes::from_static(b"")),
                ("x-multi", Bytes::from_static(b"two")),
                ("x-bytes", Bytes::from_static(b"\x80\xFFopaque\t ")),
            ],
            Bytes::from(binary_body),
        ),
        StoredResponse::new(204, StoredResponse::NO_HEADERS, b""),
        StoredResponse::new(
            404,
            vec![("content-length", Bytes::from_static(b"0"))],
            Bytes::new(),
        ),
    ];
    for response in responses {
        let key = fresh_key();
        let req = request(&key, fingerprint(1));
        ok(store.claim(&req).await);
        let completion = Completion::Response(Arc::new(response.clone()));
        assert_eq!(
            ok(store.complete(&key, req.owner, completion, TTL).await),
            WriteOutcome::Applied
        );
        let record = existing(ok(store.claim(&request(&key, fingerprint(1))).await));
        assert_eq!(record.execution_id, req.execution_id);
        match record.state {
            RecordState::Completed(Completion::Response(stored)) => {
                assert_eq!(*stored, response, "replayed response differs");
            }
            other => panic!("expected a completed response, got {other:?}"),
        }
        // Completed records are immutable: the owner cannot write again.
        let second = Completion::Response(Arc::new(simple_response(500, b"again")));
        assert_eq!(
            ok(store.complete(&key, req.owner, second, TTL).await),
            WriteOutcome::NotOwner
        );
        assert_eq!(
            ok(store.release(&key, req.owner).await),
            WriteOutcome::NotOwner
        );
    }
}

/// Only the owner completes; anyone else (or any key nobody claimed) gets `NotOwner`.
pub async fn case_complete_by_non_owner_is_refused<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = request(&key, fingerprint(1));
    ok(store.claim(&req).await);
    let completion = Completion::Response(Arc::new(simple_response(200, b"intruder")));
    assert_eq!(
        ok(store
            .complete(&key, OwnerToken::random(), completion.clone(), TTL)
            .await),
        WriteOutcome::NotOwner
    );
    let record = ok(store.get(&key).await).expect("record must survive a refused write");
    assert!(matches!(record.state, RecordState::InFlight { .. }));

    let absent = fresh_key();
    assert_eq!(
        ok(store.complete(&absent, req.owner, completion, TTL).await),
        WriteOutcome::NotOwner
    );
    assert_eq!(
        ok(store.get(&absent).await),
        None,
        "a refused write must not create"
    );
}

/// A release by the owner lets the next claim execute again under the original execution id.
pub async fn case_release_then_claim_keeps_execution_id<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let first = request(&key, fingerprint(1));
    ok(store.claim(&first).await);
    assert_eq!(
        ok(store.release(&key, first.owner).await),
        WriteOutcome::Applied
    );
    let record = ok(store.get(&key).await).expect("released record must be kept");
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.execution_id, first.execution_id);
    assert_eq!(record.fingerprint, first.fingerprint);

    let retry = request(&key, fingerprint(1));
    assert_ne!(retry.execution_id, first.execution_id);
    assert_eq!(
        ok(store.claim(&retry).await),
        ClaimOutcome::Acquired {
            execution_id: first.execution_id,
            lapsed: false,
        }
    );
    // The retry now owns it; the first owner is fenced off.
    let completion = Completion::Response(Arc::new(simple_response(200, b"second try")));
    assert_eq!(
        ok(store
            .complete(&key, first.owner, completion.clone(), TTL)
            .await),
        WriteOutcome::NotOwner
    );
    assert_eq!(
        ok(store
            .complete(&key, retry.owner, completion.clone(), TTL)
            .await),
        WriteOutcome::Applied
    );
    let record = ok(store.get(&key).await).expect("completed record must exist");
    assert_eq!(record.execution_id, first.execution_id);
    assert_eq!(record.state, RecordState::Completed(completion));
}

/// Only the owner releases, and only once.
pub async fn case_release_by_non_owner_is_refused<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = request(&key, fingerprint(1));
    ok(store.claim(&req).await);
    assert_eq!(
        ok(store.release(&key, OwnerToken::random()).await),
        WriteOutcome::NotOwner
    );
    let record = ok(store.get(&key).await).expect("record must survive a refused release");
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    assert_eq!(
        ok(store.release(&key, req.owner).await),
        WriteOutcome::Applied
    );
    assert_eq!(
        ok(store.release(&key, req.owner).await),
        WriteOutcome::NotOwner
    );
    assert_eq!(
        ok(store.release(&fresh_key(), req.owner).await),
        WriteOutcome::NotOwner
    );
}

/// After the lock lapses a new claimer takes over under the same execution id, and the lapsed
/// owner can neither complete nor release over it.
pub async fn case_lapsed_lock_is_taken_over_and_fenced<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let first = lapsing(&key, fingerprint(1));
    ok(store.claim(&first).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;

    let second = request(&key, fingerprint(1));
    assert_eq!(
        ok(store.claim(&second).await),
        ClaimOutcome::Acquired {
            execution_id: first.execution_id,
            lapsed: true,
        }
    );
    let late = Completion::Response(Arc::new(simple_response(200, b"lapsed owner")));
    assert_eq!(
        ok(store.complete(&key, first.owner, late, TTL).await),
        WriteOutcome::NotOwner
    );
    assert_eq!(
        ok(store.release(&key, first.owner).await),
        WriteOutcome::NotOwner
    );
    let record = ok(store.get(&key).await).expect("record must exist");
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "lapsed owner overwrote the new claim: {record:?}"
    );

    completes_as_owner(store, &key, second.owner, first.execution_id, b"new owner").await;
}

/// A claim repeated by the lock's owner (same owner token and fingerprint) renews the lock:
/// it answers `Acquired` with the record's execution id, and nobody else can take the record
/// over until the renewed lock lapses. The proxy renews a lock this way while it still waits
/// for the backend's answer.
pub async fn case_owner_reclaim_renews_the_lock<S: RecordStore>(store: &Arc<S>) {
    // A lock of its own: renewed late in its first life, so the second look can come well
    // within the renewed one (400 ms of slack for a loaded machine) and still past the first.
    let lock = Duration::from_millis(600);
    let key = fresh_key();
    let first = ClaimRequest {
        lock_ttl: lock,
        ..request(&key, fingerprint(1))
    };
    ok(store.claim(&first).await);
    tokio::time::sleep(lock * 3 / 4).await;
    let renewal = ClaimRequest {
        execution_id: rand::random(),
        ..first.clone()
    };
    assert_eq!(
        ok(store.claim(&renewal).await),
        ClaimOutcome::Acquired {
            execution_id: first.execution_id,
            lapsed: false,
        }
    );
    // Past the first lock's end, within the renewed one.
    tokio::time::sleep(lock / 3).await;
    let other = ClaimRequest {
        lock_ttl: lock,
        ..request(&key, fingerprint(1))
    };
    match ok(store.claim(&other).await) {
        ClaimOutcome::Existing(Record {
            state: RecordState::InFlight { lock_remaining },
            ..
        }) => assert!(lock_remaining > Duration::ZERO),
        other => panic!("the renewed lock was taken over: {other:?}"),
    }
    completes_as_owner(store, &key, first.owner, first.execution_id, b"renewed").await;
}

/// `owner` completes the record with a 201 of `body`; it reads back completed, with
/// `execution_id`.
async fn completes_as_owner<S: RecordStore>(
    store: &Arc<S>,
    key: &RecordKey,
    owner: OwnerToken,
    execution_id: u64,
    body: &'static [u8],
) {
    let done = Completion::Response(Arc::new(simple_response(201, body)));
    assert_eq!(
        ok(store.complete(key, owner, done.clone(), TTL).await),
        WriteOutcome::Applied
    );
    let record = ok(store.get(key).await).expect("record must exist");
    assert_eq!(record.state, RecordState::Completed(done));
    assert_eq!(record.execution_id, execution_id);
}

/// An unreplayable completion reads back as such, and keeps the key spent.
pub async fn case_unreplayable_completion_reads_back<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = request(&key, fingerprint(1));
    ok(store.claim(&req).await);
    let completion = Completion::Unreplayable { status: 200 };
    assert_eq!(
        ok(store
            .complete(&key, req.owner, completion.clone(), TTL)
            .await),
        WriteOutcome::Applied
    );
    let record = existing(ok(store.claim(&request(&key, fingerprint(1))).await));
    assert_eq!(record.state, RecordState::Completed(completion));
    assert_eq!(record.execution_id, req.execution_id);
}

/// A record is gone once its ttl has passed: the next claim starts afresh with a new execution
/// id. The ttl given to `complete` governs a completed record, longer or shorter than the
/// claim's; an abandoned in-flight record goes after the claim's ttl.
pub async fn case_record_expires_after_ttl<S: RecordStore>(store: &Arc<S>) {
    // Claimed for long, completed for short: complete's ttl wins.
    let completed = fresh_key();
    let req = request(&completed, fingerprint(1));
    ok(store.claim(&req).await);
    let completion = Completion::Response(Arc::new(simple_response(200, b"short-lived")));
    ok(store
        .complete(&completed, req.owner, completion, SHORT_TTL)
        .await);
    // A claim that finds it completed tells what is left of its life (what a local copy may
    // keep it for): the completion's ttl or less, never the claim's longer one.
    let life = existing(ok(store.claim(&request(&completed, fingerprint(1))).await)).expires_in;
    assert!(
        life.is_some_and(|left| !left.is_zero() && left <= SHORT_TTL),
        "a completed record's life: {life:?}"
    );
    // A read tells it too.
    let read = ok(store.get(&completed).await).expect("completed record");
    assert!(
        read.expires_in
            .is_some_and(|left| !left.is_zero() && left <= SHORT_TTL),
        "a completed record's life, read: {:?}",
        read.expires_in
    );

    // Claimed for short, completed for long: the response outlives the claim's ttl.
    let extended = fresh_key();
    // A lock shorter than the ttl, so only the completion's ttl can keep it past SHORT_TTL.
    let kept = ClaimRequest {
        ttl: SHORT_TTL,
        ..lapsing(&extended, fingerprint(1))
    };
    ok(store.claim(&kept).await);
    let completion = Completion::Response(Arc::new(simple_response(200, b"long-lived")));
    ok(store
        .complete(&extended, kept.owner, completion.clone(), TTL)
        .await);

    let abandoned = fresh_key();
    let lost = ClaimRequest {
        ttl: SHORT_TTL,
        ..lapsing(&abandoned, fingerprint(1))
    };
    ok(store.claim(&lost).await);
    // A record in flight has no life to tell: it still changes. (Read by another fingerprint,
    // which never takes it over, even once its lock has lapsed on a slow machine.)
    let in_flight = existing(ok(store.claim(&request(&abandoned, fingerprint(2))).await));
    assert_eq!(in_flight.expires_in, None);

    tokio::time::sleep(SHORT_TTL + Duration::from_millis(300)).await;
    for (key, old) in [(&completed, &req), (&abandoned, &lost)] {
        assert_eq!(ok(store.get(key).await), None, "record outlived its ttl");
        let next = request(key, fingerprint(2));
        assert_eq!(
            ok(store.claim(&next).await),
            ClaimOutcome::Acquired {
                execution_id: next.execution_id,
                lapsed: false,
            }
        );
        assert_ne!(next.execution_id, old.execution_id);
    }
    let record = ok(store.get(&extended).await).expect("completion ttl must extend the record");
    assert_eq!(record.state, RecordState::Completed(completion));
}

/// A re-claim keeps the record alive for the new claim's ttl, so a record released near the
/// end of its life cannot vanish under its next owner.
pub async fn case_reclaim_extends_record_life<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    // A lock shorter than the ttl, so the claim's life is the ttl's.
    let short = |key: &RecordKey| ClaimRequest {
        ttl: SHORT_TTL,
        ..lapsing(key, fingerprint(1))
    };
    let first = short(&key);
    ok(store.claim(&first).await);
    ok(store.release(&key, first.owner).await);
    // Half its life: as much slack for the re-claim as for the look past the first expiry.
    tokio::time::sleep(SHORT_TTL / 2).await;

    let second = short(&key);
    assert_eq!(
        ok(store.claim(&second).await),
        ClaimOutcome::Acquired {
            execution_id: first.execution_id,
            lapsed: false,
        }
    );
    // Past the first claim's expiry (sleeps only overrun), within the second's.
    tokio::time::sleep(SHORT_TTL / 2).await;
    let record = ok(store.get(&key).await).expect("re-claimed record expired under its owner");
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    let completion = Completion::Unreplayable { status: 200 };
    assert_eq!(
        ok(store.complete(&key, second.owner, completion, TTL).await),
        WriteOutcome::Applied
    );
}

/// `wait_for_change` returns at once for an absent, completed or released record.
pub async fn case_wait_returns_at_once_when_not_in_flight<S: RecordStore>(store: &Arc<S>) {
    let started = Instant::now();
    assert_eq!(
        ok(store.wait_for_change(&fresh_key(), WAIT_TIMEOUT).await),
        None
    );

    let completed = fresh_key();
    let req = request(&completed, fingerprint(1));
    ok(store.claim(&req).await);
    let completion = Completion::Unreplayable { status: 202 };
    ok(store
        .complete(&completed, req.owner, completion.clone(), TTL)
        .await);
    let record = ok(store.wait_for_change(&completed, WAIT_TIMEOUT).await);
    assert_eq!(
        record.map(|r| r.state),
        Some(RecordState::Completed(completion))
    );

    let released = fresh_key();
    let req = request(&released, fingerprint(1));
    ok(store.claim(&req).await);
    ok(store.release(&released, req.owner).await);
    let record = ok(store.wait_for_change(&released, WAIT_TIMEOUT).await);
    assert_eq!(record.map(|r| r.state), Some(RecordState::Released));

    assert!(
        started.elapsed() < WAIT_TIMEOUT / 2,
        "waits on settled records took {:?}",
        started.elapsed()
    );
}

/// `wait_for_change` returns promptly when the owner completes from another task.
pub async fn case_wait_wakes_on_complete<S: RecordStore>(store: &Arc<S>) {
    let completion = Completion::Response(Arc::new(simple_response(201, b"finished")));
    let written = completion.clone();
    let (record, waited, settled) = wait_through(store, move |store, req| async move {
        store.complete(&req.key, req.owner, written, TTL).await
    })
    .await;
    assert_eq!(ok(settled), WriteOutcome::Applied);
    assert_eq!(
        record.map(|r| r.state),
        Some(RecordState::Completed(completion))
    );
    assert!(waited < WAIT_TIMEOUT / 2, "wait took {waited:?}");
}

/// Claims a fresh key with a long lock and waits for a change of it while `settle` acts on the
/// claim from another task 100 ms in. Returns what the wait read, how long it took, and what
/// `settle` returned.
async fn wait_through<S, F, Fut, T>(store: &Arc<S>, settle: F) -> (Option<Record>, Duration, T)
where
    S: RecordStore,
    F: FnOnce(Arc<S>, ClaimRequest) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let key = fresh_key();
    let req = ClaimRequest {
        lock_ttl: LONG_LOCK,
        ..request(&key, fingerprint(1))
    };
    ok(store.claim(&req).await);
    let settler = {
        let store = Arc::clone(store);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            settle(store, req).await
        })
    };
    let (record, waited) = timed_wait(store, &key, WAIT_TIMEOUT).await;
    (record, waited, joined(settler.await))
}

/// `wait_for_change` on `key`, and how long it took.
async fn timed_wait<S: RecordStore>(
    store: &Arc<S>,
    key: &RecordKey,
    timeout: Duration,
) -> (Option<Record>, Duration) {
    let started = Instant::now();
    let record = ok(store.wait_for_change(key, timeout).await);
    (record, started.elapsed())
}

/// `wait_for_change` returns promptly when the owner releases from another task.
pub async fn case_wait_wakes_on_release<S: RecordStore>(store: &Arc<S>) {
    let (record, waited, settled) = wait_through(store, |store, req| async move {
        store.release(&req.key, req.owner).await
    })
    .await;
    assert_eq!(ok(settled), WriteOutcome::Applied);
    assert_eq!(record.map(|r| r.state), Some(RecordState::Released));
    assert!(waited < WAIT_TIMEOUT / 2, "wait took {waited:?}");
}

/// `wait_for_change` returns when the holder's lock lapses, without waiting for its timeout.
pub async fn case_wait_returns_when_lock_lapses<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = lapsing(&key, fingerprint(1));
    // From before the claim: the lock runs from the store's answer, which may come late.
    let started = Instant::now();
    ok(store.claim(&req).await);
    let (record, _) = timed_wait(store, &key, WAIT_TIMEOUT).await;
    let waited = started.elapsed();
    let record = record.expect("lapsed record must still exist");
    assert_eq!(record.execution_id, req.execution_id);
    assert!(
        matches!(
            record.state,
            RecordState::InFlight { lock_remaining } if lock_remaining.is_zero()
        ) || record.state == RecordState::Released,
        "unexpected state {:?}",
        record.state
    );
    assert!(
        waited >= LOCK_TTL - Duration::from_millis(50),
        "returned before the lock lapsed: {waited:?}"
    );
    assert!(waited < WAIT_TIMEOUT / 2, "wait took {waited:?}");
}

/// `wait_for_change` gives up after its timeout and returns the record still in flight.
pub async fn case_wait_times_out_while_in_flight<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = ClaimRequest {
        lock_ttl: LONG_LOCK,
        ..request(&key, fingerprint(1))
    };
    ok(store.claim(&req).await);
    let timeout = Duration::from_millis(400);
    let (record, waited) = timed_wait(store, &key, timeout).await;
    let record = record.expect("in-flight record must be returned");
    assert_in_flight(&record, LONG_LOCK);
    assert!(
        waited >= timeout - Duration::from_millis(50),
        "returned before the timeout: {waited:?}"
    );
    assert!(
        waited < timeout + Duration::from_secs(2),
        "wait took {waited:?}"
    );
}

/// Of many concurrent claims of one key exactly one acquires; all others see its record.
pub async fn case_concurrent_claims_have_one_winner<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let race = race_to_claim(store, &key).await;
    assert_eq!(
        race.execution_id, race.winner.execution_id,
        "the winner of a fresh key must keep its own execution id"
    );
}

/// Of many concurrent claims of a released record exactly one acquires, under the record's
/// execution id; the others see it in flight and cannot write over it.
pub async fn case_concurrent_claims_of_a_released_record_have_one_winner<S: RecordStore>(
    store: &Arc<S>,
) {
    let key = fresh_key();
    let first = request(&key, fingerprint(1));
    ok(store.claim(&first).await);
    assert_eq!(
        ok(store.release(&key, first.owner).await),
        WriteOutcome::Applied
    );
    let race = race_to_claim(store, &key).await;
    assert_eq!(race.execution_id, first.execution_id);
    race.only_the_winner_completes(store, &key).await;
}

/// Of many concurrent claims of a record whose lock lapsed exactly one takes it over, under the
/// record's execution id; the others see it in flight and cannot write over it.
pub async fn case_concurrent_claims_of_a_lapsed_lock_have_one_winner<S: RecordStore>(
    store: &Arc<S>,
) {
    let key = fresh_key();
    let first = lapsing(&key, fingerprint(1));
    ok(store.claim(&first).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;
    let race = race_to_claim(store, &key).await;
    assert_eq!(race.execution_id, first.execution_id);
    race.only_the_winner_completes(store, &key).await;
    assert_eq!(
        ok(store.release(&key, first.owner).await),
        WriteOutcome::NotOwner,
        "the lapsed owner released a completed record"
    );
}

/// A lapsed owner renews (re-claims with its own token) only while nobody else took over: before
/// a takeover it acquires again, after one it gets the new owner's record and changes nothing.
/// The proxy renews its lock this way, so a renewal after a takeover must not steal it back.
pub async fn case_lapsed_owner_cannot_renew_after_a_takeover<S: RecordStore>(store: &Arc<S>) {
    // Two keys lapse in the same sleep: one renewed by its owner, one taken over first.
    let kept = fresh_key();
    let kept_owner = lapsing(&kept, fingerprint(1));
    ok(store.claim(&kept_owner).await);
    let taken = fresh_key();
    let old_owner = lapsing(&taken, fingerprint(1));
    ok(store.claim(&old_owner).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;

    let renewal = ClaimRequest {
        execution_id: rand::random(),
        ..kept_owner.clone()
    };
    assert_eq!(
        ok(store.renew(&renewal).await),
        ClaimOutcome::Acquired {
            execution_id: kept_owner.execution_id,
            lapsed: false,
        },
        "a lapsed owner nobody replaced may renew"
    );

    let new_owner = ClaimRequest {
        lock_ttl: LONG_LOCK,
        ..request(&taken, fingerprint(1))
    };
    assert_eq!(
        ok(store.claim(&new_owner).await),
        ClaimOutcome::Acquired {
            execution_id: old_owner.execution_id,
            lapsed: true,
        }
    );
    let late_renewal = ClaimRequest {
        execution_id: rand::random(),
        ..old_owner.clone()
    };
    let record = existing(ok(store.renew(&late_renewal).await));
    assert_eq!(record.execution_id, old_owner.execution_id);
    assert_in_flight(&record, LONG_LOCK);
    // A re-sent claim is fenced the same way.
    let record = existing(ok(store.claim(&late_renewal).await));
    assert_in_flight(&record, LONG_LOCK);
    // Still the new owner's: the old one cannot write, the new one can.
    assert_eq!(
        ok(store.release(&taken, old_owner.owner).await),
        WriteOutcome::NotOwner
    );
    completes_as_owner(
        store,
        &taken,
        new_owner.owner,
        old_owner.execution_id,
        b"new owner",
    )
    .await;
    completes_as_owner(
        store,
        &kept,
        kept_owner.owner,
        kept_owner.execution_id,
        b"renewed late",
    )
    .await;
}

/// A renewal takes only a lock its owner holds (or an absent record, as a claim would): one
/// that reaches the store after its owner released the key, or after the owner completed it,
/// or after another owner took the key over and let that lock lapse too, changes nothing. A
/// claim by the same owner would have taken the first and the last.
pub async fn case_a_renewal_takes_back_only_its_own_lock<S: RecordStore>(store: &Arc<S>) {
    // Released by its owner: the late renewal leaves it released, and the retry runs.
    let released = fresh_key();
    let owner = request(&released, fingerprint(1));
    ok(store.claim(&owner).await);
    assert_eq!(
        ok(store.release(&released, owner.owner).await),
        WriteOutcome::Applied
    );
    let record = existing(ok(store.renew(&owner).await));
    assert_eq!(
        record.state,
        RecordState::Released,
        "a late renewal locked the key again"
    );
    let retry = request(&released, fingerprint(1));
    assert_eq!(
        ok(store.claim(&retry).await),
        ClaimOutcome::Acquired {
            execution_id: owner.execution_id,
            lapsed: false,
        }
    );

    // Completed by its owner: unchanged.
    let completed = fresh_key();
    let owner = request(&completed, fingerprint(1));
    ok(store.claim(&owner).await);
    let answer = Completion::Response(Arc::new(simple_response(201, b"done")));
    ok(store
        .complete(&completed, owner.owner, answer.clone(), TTL)
        .await);
    let record = existing(ok(store.renew(&owner).await));
    assert_eq!(record.state, RecordState::Completed(answer));

    // Taken over, and that lock lapsed too: still not this owner's to take back.
    let taken = fresh_key();
    let first = lapsing(&taken, fingerprint(1));
    ok(store.claim(&first).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;
    let second = lapsing(&taken, fingerprint(1));
    assert!(matches!(
        ok(store.claim(&second).await),
        ClaimOutcome::Acquired { lapsed: true, .. }
    ));
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;
    let record = existing(ok(store.renew(&first).await));
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "{record:?}"
    );
    assert_eq!(
        ok(store.release(&taken, second.owner).await),
        WriteOutcome::Applied,
        "the renewal took the second owner's lapsed lock"
    );

    // Absent (a record gone while its execution runs): created, as a claim would.
    let absent = fresh_key();
    let owner = request(&absent, fingerprint(1));
    assert_eq!(
        ok(store.renew(&owner).await),
        ClaimOutcome::Acquired {
            execution_id: owner.execution_id,
            lapsed: false,
        }
    );
}

/// `wait_for_change` returns promptly, with nothing, when the record is deleted mid-wait.
pub async fn case_wait_returns_when_the_record_is_deleted<S: RecordStore>(store: &Arc<S>) {
    let (record, waited, deleted) =
        wait_through(
            store,
            |store, req| async move { store.delete(&req.key).await },
        )
        .await;
    assert!(ok(deleted), "the delete found no record");
    assert_eq!(record, None, "a deleted record was read back");
    assert!(waited < WAIT_TIMEOUT / 2, "wait took {waited:?}");
}

/// `wait_for_change` returns when an in-flight record expires mid-wait rather than at its
/// timeout. A record outlives its lock, so expiry can only meet a waiter when both end together
/// (ttl equal to the lock ttl); the wait then reads the record gone or its lock lapsed.
pub async fn case_wait_returns_when_the_record_expires<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = ClaimRequest {
        ttl: LOCK_TTL,
        ..lapsing(&key, fingerprint(1))
    };
    let started = Instant::now();
    ok(store.claim(&req).await);
    let (record, _) = timed_wait(store, &key, WAIT_TIMEOUT).await;
    let waited = started.elapsed();
    match record {
        None => {}
        Some(Record {
            state: RecordState::InFlight { lock_remaining },
            execution_id,
            ..
        }) if lock_remaining.is_zero() && execution_id == req.execution_id => {}
        other => panic!("expected the record gone or its lock lapsed, got {other:?}"),
    }
    assert!(
        waited >= LOCK_TTL - Duration::from_millis(50),
        "returned before the record expired: {waited:?}"
    );
    assert!(waited < WAIT_TIMEOUT / 2, "wait took {waited:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(ok(store.get(&key).await), None, "record outlived its ttl");
}

/// An owner that released its claim no longer holds it: its completion is refused and the
/// record stays released.
pub async fn case_complete_after_own_release_is_refused<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = request(&key, fingerprint(1));
    ok(store.claim(&req).await);
    assert_eq!(
        ok(store.release(&key, req.owner).await),
        WriteOutcome::Applied
    );
    let late = Completion::Response(Arc::new(simple_response(200, b"after release")));
    assert_eq!(
        ok(store.complete(&key, req.owner, late, TTL).await),
        WriteOutcome::NotOwner
    );
    let record = ok(store.get(&key).await).expect("released record must be kept");
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.execution_id, req.execution_id);
}

/// An owner whose lock lapsed still holds the claim until someone re-claims it (`NotOwner`
/// means "lock lapsed and another request claimed it, or the record expired"): it may complete,
/// or release.
pub async fn case_lapsed_owner_may_finish_until_someone_reclaims<S: RecordStore>(store: &Arc<S>) {
    let completed = fresh_key();
    let completer = lapsing(&completed, fingerprint(1));
    ok(store.claim(&completer).await);
    let released = fresh_key();
    let releaser = lapsing(&released, fingerprint(1));
    ok(store.claim(&releaser).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;

    completes_as_owner(
        store,
        &completed,
        completer.owner,
        completer.execution_id,
        b"lapsed but unreplaced",
    )
    .await;
    assert_eq!(
        ok(store.release(&released, releaser.owner).await),
        WriteOutcome::Applied
    );
    let record = ok(store.get(&released).await).expect("released record must be kept");
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.execution_id, releaser.execution_id);
}

/// A claim with another fingerprint does not take over a lapsed lock: it reads the record,
/// which keeps its fingerprint, and the lapsed owner can still complete.
pub async fn case_different_fingerprint_does_not_take_over_a_lapsed_lock<S: RecordStore>(
    store: &Arc<S>,
) {
    let key = fresh_key();
    let first = lapsing(&key, fingerprint(1));
    ok(store.claim(&first).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(150)).await;

    let other = request(&key, fingerprint(2));
    let record = existing(ok(store.claim(&other).await));
    assert_eq!(record.fingerprint, first.fingerprint);
    assert_eq!(record.execution_id, first.execution_id);
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "unexpected state {:?}",
        record.state
    );
    assert_eq!(
        ok(store.release(&key, other.owner).await),
        WriteOutcome::NotOwner,
        "the other request got the claim"
    );
    completes_as_owner(
        store,
        &key,
        first.owner,
        first.execution_id,
        b"not taken over",
    )
    .await;
}

/// Delete removes a record in any state; the key is then claimable afresh.
pub async fn case_delete_removes<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let req = request(&key, fingerprint(1));
    ok(store.claim(&req).await);
    assert!(ok(store.delete(&key).await));
    assert_eq!(ok(store.get(&key).await), None);
    assert!(!ok(store.delete(&key).await), "second delete finds nothing");
    let completion = Completion::Unreplayable { status: 200 };
    assert_eq!(
        ok(store
            .complete(&key, req.owner, completion.clone(), TTL)
            .await),
        WriteOutcome::NotOwner
    );

    let next = request(&key, fingerprint(2));
    assert_eq!(
        ok(store.claim(&next).await),
        ClaimOutcome::Acquired {
            execution_id: next.execution_id,
            lapsed: false,
        }
    );
    ok(store.complete(&key, next.owner, completion, TTL).await);
    assert!(ok(store.delete(&key).await), "completed records delete too");
    assert_eq!(ok(store.get(&key).await), None);
}

/// A settled delete (an admin purge without force) leaves a record in flight as it is, its lock
/// running or lapsed, and removes it in every other state.
pub async fn case_settled_delete_spares_a_running_claim<S: RecordStore>(store: &Arc<S>) {
    let key = fresh_key();
    let held = ClaimRequest {
        lock_ttl: LONG_LOCK,
        ..request(&key, fingerprint(1))
    };
    ok(store.claim(&held).await);
    match ok(store.delete_settled(&key).await) {
        Deletion::Running { lock_remaining } => assert!(
            lock_remaining > Duration::ZERO && lock_remaining <= LONG_LOCK,
            "lock_remaining {lock_remaining:?} outside (0, {LONG_LOCK:?}]"
        ),
        other => panic!("a running claim was not spared: {other:?}"),
    }
    assert_in_flight(&ok(store.get(&key).await).expect("spared"), LONG_LOCK);
    completes_as_owner(store, &key, held.owner, held.execution_id, b"spared").await;
    assert_eq!(ok(store.delete_settled(&key).await), Deletion::Deleted);
    assert_eq!(ok(store.get(&key).await), None);
    assert_eq!(ok(store.delete_settled(&key).await), Deletion::Absent);

    let released = request(&key, fingerprint(2));
    ok(store.claim(&released).await);
    ok(store.release(&key, released.owner).await);
    assert_eq!(ok(store.delete_settled(&key).await), Deletion::Deleted);

    let lapsed = lapsing(&key, fingerprint(3));
    ok(store.claim(&lapsed).await);
    tokio::time::sleep(LOCK_TTL + Duration::from_millis(200)).await;
    assert_eq!(
        ok(store.delete_settled(&key).await),
        Deletion::Running {
            lock_remaining: Duration::ZERO
        },
        "a lapsed claim's execution may still run, and a takeover keeps its id"
    );
    assert!(ok(store.get(&key).await).is_some(), "spared");
    assert!(ok(store.delete(&key).await), "a forced delete removes it");
}

/// Settled deletes racing claims of one key never remove a claim from under its holder: the
/// check and the delete are one step. (A read followed by a delete removes, now and then, a
/// claim made between the two, and its holder's release then finds the record gone.)
pub async fn case_settled_delete_never_takes_a_claim_made_meanwhile<S: RecordStore>(
    store: &Arc<S>,
) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    const ROUNDS: usize = 400;
    let key = fresh_key();
    let done = Arc::new(AtomicBool::new(false));
    // Deletes begun: after each release the claimer waits for one to begin, then claims at
    // once, so every round a delete runs into a claim made while it is under way.
    let begun = Arc::new(AtomicUsize::new(0));
    // Both in tasks of their own, so each yield hands the turn to the other on any runtime.
    let purger = tokio::spawn({
        let (store, key, done, begun) = (store.clone(), key.clone(), done.clone(), begun.clone());
        async move {
            let mut deleted = 0;
            while !done.load(Relaxed) {
                begun.fetch_add(1, Relaxed);
                if ok(store.delete_settled(&key).await) == Deletion::Deleted {
                    deleted += 1;
                }
                tokio::task::yield_now().await;
            }
            deleted
        }
    });
    let claimer = tokio::spawn({
        let (store, key, begun) = (store.clone(), key.clone(), begun.clone());
        async move {
            for round in 0..ROUNDS {
                let req = ClaimRequest {
                    lock_ttl: LONG_LOCK,
                    ..request(&key, fingerprint(1))
                };
                assert!(
                    matches!(ok(store.claim(&req).await), ClaimOutcome::Acquired { .. }),
                    "round {round}: a released or absent record is claimable"
                );
                tokio::task::yield_now().await;
                assert_eq!(
                    ok(store.release(&key, req.owner).await),
                    WriteOutcome::Applied,
                    "round {round}: a settled delete removed a running claim"
                );
                let before = begun.load(Relaxed);
                let waited = Instant::now();
                while begun.load(Relaxed) == before && waited.elapsed() < WAIT_TIMEOUT {
                    tokio::task::yield_now().await;
                }
            }
        }
    });
    let claimed = claimer.await;
    done.store(true, Relaxed);
    let deleted = joined(purger.await);
    joined(claimed);
    // The race is real only if the deletes ran among the claims, not all after them.
    assert!(
        deleted > 1,
        "{deleted} deletes landed between {ROUNDS} rounds"
    );
}

/// The same hash under two tenants names two records.
pub async fn case_tenants_are_distinct<S: RecordStore>(store: &Arc<S>) {
    let hash: Digest = rand::random();
    let acme = RecordKey {
        tenant: "acme".into(),
        hash,
    };
    let globex = RecordKey {
        tenant: "globex".into(),
        hash,
    };
    let acme_req = request(&acme, fingerprint(1));
    let globex_req = request(&globex, fingerprint(2));
    assert_eq!(
        ok(store.claim(&acme_req).await),
        ClaimOutcome::Acquired {
            execution_id: acme_req.execution_id,
            lapsed: false,
        }
    );
    assert_eq!(
        ok(store.claim(&globex_req).await),
        ClaimOutcome::Acquired {
            execution_id: globex_req.execution_id,
            lapsed: false,
        }
    );
    // One tenant's owner token means nothing under the other tenant.
    let completion = Completion::Unreplayable { status: 200 };
    assert_eq!(
        ok(store
            .complete(&globex, acme_req.owner, completion.clone(), TTL)
            .await),
        WriteOutcome::NotOwner
    );
    assert_eq!(
        ok(store
            .complete(&acme, acme_req.owner, completion.clone(), TTL)
            .await),
        WriteOutcome::Applied
    );
    let globex_record = ok(store.get(&globex).await).expect("globex record must exist");
    assert_eq!(globex_record.fingerprint, globex_req.fingerprint);
    assert!(matches!(globex_record.state, RecordState::InFlight { .. }));

    assert!(ok(store.delete(&acme).await));
    assert!(
        ok(store.get(&globex).await).is_some(),
        "delete crossed tenants"
    );
    let third = RecordKey {
        tenant: "initech".into(),
        hash,
    };
    assert_eq!(ok(store.get(&third).await), None);
}

// === helpers ===

/// The outcome of [`race_to_claim`]: the one claim that acquired, and those that did not.
struct Race {
    winner: ClaimRequest,
    /// The execution id the winner was given.
    execution_id: u64,
    losers: Vec<ClaimRequest>,
}

/// Sends [`RACERS`] claims of `key` (same fingerprint, each its own owner, long locks so the
/// winner's cannot lapse mid-race) at once, and checks that exactly one acquires and every
/// other reads the winner's record in flight.
async fn race_to_claim<S: RecordStore>(store: &Arc<S>, key: &RecordKey) -> Race {
    let start = Arc::new(Barrier::new(RACERS));
    let racers: Vec<_> = (0..RACERS)
        .map(|_| {
            let (store, start) = (Arc::clone(store), Arc::clone(&start));
            let req = ClaimRequest {
                lock_ttl: LONG_LOCK,
                ..request(key, fingerprint(1))
            };
            tokio::spawn(async move {
                start.wait().await;
                let outcome = store.claim(&req).await;
                (req, outcome)
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut losers = Vec::new();
    for racer in racers {
        let (req, outcome) = joined(racer.await);
        match ok(outcome) {
            ClaimOutcome::Acquired { execution_id, .. } => winners.push((req, execution_id)),
            ClaimOutcome::Existing(record) => losers.push((req, record)),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one claim must acquire: {:?}",
        winners.iter().map(|(_, id)| id).collect::<Vec<_>>()
    );
    let (winner, execution_id) = winners.swap_remove(0);
    for (_, record) in &losers {
        assert_eq!(record.execution_id, execution_id);
        assert_in_flight(record, LONG_LOCK);
    }
    Race {
        winner,
        execution_id,
        losers: losers.into_iter().map(|(req, _)| req).collect(),
    }
}

/// A key no other case (or earlier run against the same server) uses.
fn fresh_key() -> RecordKey {
    RecordKey {
        tenant: "conformance".into(),
        hash: rand::random(),
    }
}

fn fingerprint(n: u8) -> Digest {
    [n; 32]
}

/// A claim with a fresh owner and execution id, a lock no stall of a loaded machine outlasts
/// and the default record ttl.
fn request(key: &RecordKey, fingerprint: Digest) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint,
        owner: OwnerToken::random(),
        execution_id: rand::random(),
        lock_ttl: LONG_LOCK,
        ttl: TTL,
    }
}

/// [`request`] with a lock that lapses after [`LOCK_TTL`], for the cases that let it.
fn lapsing(key: &RecordKey, fingerprint: Digest) -> ClaimRequest {
    ClaimRequest {
        lock_ttl: LOCK_TTL,
        ..request(key, fingerprint)
    }
}

fn simple_response(status: u16, body: &'static [u8]) -> StoredResponse {
    StoredResponse::new(status, [("content-type", "text/plain")], body)
}

#[track_caller]
fn ok<T>(result: Result<T, StoreError>) -> T {
    match result {
        Ok(value) => value,
        Err(err) => panic!("store call failed: {err}"),
    }
}

#[track_caller]
fn joined<T>(result: Result<T, tokio::task::JoinError>) -> T {
    match result {
        Ok(value) => value,
        Err(err) => panic!("conformance task failed: {err}"),
    }
}

#[track_caller]
fn existing(outcome: ClaimOutcome) -> Record {
    match outcome {
        ClaimOutcome::Existing(record) => record,
        other => panic!("expected an existing record, got {other:?}"),
    }
}

#[track_caller]
fn assert_in_flight(record: &Record, lock_ttl: Duration) {
    match record.state {
        RecordState::InFlight { lock_remaining } => {
            assert!(
                lock_remaining > Duration::ZERO && lock_remaining <= lock_ttl,
                "lock_remaining {lock_remaining:?} outside (0, {lock_ttl:?}]"
            );
        }
        ref other => panic!("expected in flight, got {other:?}"),
    }
}

// === impl Race ===

impl Race {
    /// No loser can complete or release the record; the winner completes it.
    async fn only_the_winner_completes<S: RecordStore>(&self, store: &Arc<S>, key: &RecordKey) {
        let intruder = Completion::Response(Arc::new(simple_response(200, b"a loser")));
        for loser in &self.losers {
            assert_eq!(
                ok(store
                    .complete(key, loser.owner, intruder.clone(), TTL)
                    .await),
                WriteOutcome::NotOwner,
                "a losing claimer completed"
            );
            assert_eq!(
                ok(store.release(key, loser.owner).await),
                WriteOutcome::NotOwner,
                "a losing claimer released"
            );
        }
        completes_as_owner(store, key, self.winner.owner, self.execution_id, b"winner").await;
    }
}
