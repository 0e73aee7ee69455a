//! A circuit breaker around a shared store: after N consecutive failures it answers at once
//! (so no request waits on a dead store), and half-opens to probe the real script path.
//!
//! ```text
//!   Closed --N consecutive failures--> Open --open_for elapsed--> HalfOpen
//!     ^                                  ^                           |
//!     +------------ probe succeeds ------+---- probe fails ----------+
//! ```
//!
//! While half-open, one caller probes with [`RecordStore::ping_part`] (which runs a script, not
//! a bare PING, so a flushed script cache is noticed) and everyone else still fails fast.
//!
//! A store whose keys live on parts that fail apart from each other (a Redis Cluster's slot
//! ranges: [`RecordStore::parts`]) gets one circuit per part: a primary that is down opens the
//! circuits of its keys only, and each is probed where its last failure was (that key's slot). With one circuit for the whole
//! store, the keys of the healthy primaries were refused (or, under `pass`, forwarded
//! unprotected) as long as the circuit stayed open, and a probe pinned to a part that was down
//! kept it open until that part came back.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::{
    ClaimOutcome, ClaimRequest, Completion, Deletion, OwnerToken, Record, RecordKey, RecordStore,
    StoreError, StoreUsage, WriteOutcome,
};

/// Breaker settings.
#[derive(Clone, Debug)]
pub struct BreakerOptions {
    /// Consecutive failures (errors or timeouts) that open the circuit.
    pub failure_threshold: u32,
    /// How long the circuit stays open before a probe.
    pub open_for: Duration,
}

impl Default for BreakerOptions {
    fn default() -> Self {
        BreakerOptions {
            failure_threshold: 3,
            open_for: Duration::from_secs(1),
        }
    }
}

/// Circuit state, as exported by the `idemgate_store_circuit_state` gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CircuitState {
    /// Calls go through.
    Closed = 0,
    /// Calls fail fast.
    Open = 1,
    /// One probe is deciding.
    HalfOpen = 2,
}

impl CircuitState {
    fn from_u8(state: u8) -> CircuitState {
        match state {
            1 => CircuitState::Open,
            2 => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }
}

/// The circuit of one part of the store.
#[derive(Default)]
struct Circuit {
    state: AtomicU8,
    consecutive_failures: AtomicU32,
    /// How many times this circuit opened: the epoch a call is let through under.
    opened: AtomicU64,
    opened_at: Mutex<Option<Instant>>,
    probing: tokio::sync::Mutex<()>,
    /// The key of the last call that failed on this part: its probe goes to that key's slot
    /// ([`RecordStore::ping_near`]), where the failure was, rather than to a fixed slot of the
    /// part (a part whose slots two Cluster primaries share would be probed on the one that
    /// answers, or kept open by the one that does not).
    failed_on: Mutex<Option<RecordKey>>,
}

impl Circuit {
    fn state(&self) -> CircuitState {
        CircuitState::from_u8(self.state.load(Ordering::Acquire))
    }

    fn set_state(&self, s: CircuitState) {
        self.state.store(s as u8, Ordering::Release);
    }
}

/// Shared view of the breaker for metrics and readiness.
pub struct CircuitView {
    /// One circuit per part of the store.
    circuits: Box<[Circuit]>,
    /// How many times a circuit opened, over every part.
    pub opened: AtomicU64,
    /// Where the next look for a part to ping begins ([`Breaker::ping`]).
    next_ping: AtomicUsize,
}

impl CircuitView {
    fn new(parts: usize) -> Self {
        CircuitView {
            circuits: (0..parts.max(1)).map(|_| Circuit::default()).collect(),
            opened: AtomicU64::new(0),
            next_ping: AtomicUsize::new(0),
        }
    }

    /// The state of the store's circuits taken together: open when one is (some keys are
    /// refused at once), else half-open when one is, else closed.
    pub fn state(&self) -> CircuitState {
        let states = || self.circuits.iter().map(Circuit::state);
        if states().any(|s| s == CircuitState::Open) {
            CircuitState::Open
        } else if states().any(|s| s == CircuitState::HalfOpen) {
            CircuitState::HalfOpen
        } else {
            CircuitState::Closed
        }
    }

    /// How many parts of the store have their circuit open (or half-open).
    pub fn open_parts(&self) -> usize {
        self.circuits
            .iter()
            .filter(|c| c.state() != CircuitState::Closed)
            .count()
    }

    /// How many parts the store has, each with its own circuit.
    pub fn parts(&self) -> usize {
        self.circuits.len()
    }
}

impl std::fmt::Debug for CircuitView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CircuitView")
            .field("state", &self.state())
            .field("open_parts", &self.open_parts())
            .field("opened", &self.opened.load(Ordering::Relaxed))
            .finish()
    }
}

/// A [`RecordStore`] that stops calling a failing store (or a failing part of it) for a while.
pub struct Breaker<S> {
    inner: S,
    options: BreakerOptions,
    view: Arc<CircuitView>,
}

/// Parts a ping of a store with several probes at once ([`Breaker::ping`]).
const PING_SPREAD: usize = 4;

fn is_outage(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_))
}

// === impl Breaker ===

impl<S: RecordStore> Breaker<S> {
    /// Wraps `inner`, with one circuit per part of it ([`RecordStore::parts`]).
    pub fn new(inner: S, options: BreakerOptions) -> Self {
        let view = Arc::new(CircuitView::new(inner.parts()));
        Breaker {
            inner,
            options,
            view,
        }
    }

    /// The state shared with metrics and readiness.
    pub fn view(&self) -> Arc<CircuitView> {
        self.view.clone()
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The part of the store `key` lives on.
    fn part_of(&self, key: &RecordKey) -> usize {
        let parts = self.view.circuits.len();
        if parts == 1 {
            0
        } else {
            self.inner.part_of(key) % parts
        }
    }

    /// Lets a call to part `part` through, or fails fast while its circuit is open. Past
    /// `open_for`, one caller probes. Returns how many times the circuit had opened when the
    /// call was let through: its failure counts only if the circuit has not opened since (see
    /// [`Breaker::record`]).
    async fn admit(&self, part: usize) -> Result<u64, StoreError> {
        let circuit = &self.view.circuits[part];
        let epoch = || circuit.opened.load(Ordering::Acquire);
        if circuit.state() == CircuitState::Closed {
            return Ok(epoch());
        }
        let ready_to_probe = || {
            circuit
                .opened_at
                .lock()
                .is_none_or(|t| t.elapsed() >= self.options.open_for)
        };
        if !ready_to_probe() {
            return Err(StoreError::Unavailable("circuit open".into()));
        }
        let Ok(_probe) = circuit.probing.try_lock() else {
            return Err(StoreError::Unavailable(
                "circuit half-open, probe in progress".into(),
            ));
        };
        if circuit.state() == CircuitState::Closed {
            return Ok(epoch());
        }
        // Looked at again under the probe's lock: a probe that failed between the look above
        // and this one opened the circuit anew, and another probe now would wait on the same
        // dead store instead of failing fast for open_for.
        if !ready_to_probe() {
            return Err(StoreError::Unavailable("circuit open".into()));
        }
        circuit.set_state(CircuitState::HalfOpen);
        let failed_on = circuit.failed_on.lock().clone();
        let probe = match &failed_on {
            Some(key) => self.inner.ping_near(key).await,
            None => self.inner.ping_part(part).await,
        };
        match probe {
            Err(e) if is_outage(&e) => {
                self.open(part);
                Err(e)
            }
            // The store answered, if not well (a script the probe runs that raises, a reply
            // this version cannot read): that is no outage, and holding the circuit open on it
            // would hand every request to the outage policy until the script is mended. The
            // call goes on, to meet the store on its own terms.
            answered => {
                circuit.consecutive_failures.store(0, Ordering::Release);
                circuit.set_state(CircuitState::Closed);
                match answered {
                    Ok(()) => tracing::info!(part, "record store recovered; circuit closed"),
                    Err(e) => {
                        tracing::warn!(part, error = %e, "record store answers, if not well; circuit closed")
                    }
                }
                Ok(epoch())
            }
        }
    }

    fn open(&self, part: usize) {
        let circuit = &self.view.circuits[part];
        {
            // The clock read under the lock (an assignment reads its value before its place):
            // the latest of racing failures stands, and the next probe never comes early.
            let mut opened_at = circuit.opened_at.lock();
            *opened_at = Some(Instant::now());
        }
        // A failed probe re-opens the same outage; only a closed circuit opening counts, once
        // however many failures reach the threshold together.
        let was = circuit
            .state
            .swap(CircuitState::Open as u8, Ordering::AcqRel);
        if was == CircuitState::Closed as u8 {
            circuit.opened.fetch_add(1, Ordering::AcqRel);
            self.view.opened.fetch_add(1, Ordering::AcqRel);
            tracing::warn!(part, parts = self.view.circuits.len(), open_for = ?self.options.open_for, "record store failing; circuit open");
        }
    }

    /// Counts the outcome of a call to part `part` let through at `epoch` (see
    /// [`Breaker::admit`]). A call that fails after the circuit opened since it was let
    /// through is part of the outage already counted: it neither stretches the open period
    /// nor, after a probe has closed the circuit, counts toward opening it again. (A call's
    /// deadline can outlast `open_for`.)
    fn record<T>(
        &self,
        part: usize,
        epoch: u64,
        key: Option<&RecordKey>,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let circuit = &self.view.circuits[part];
        match &result {
            Err(e) if is_outage(e) => {
                if circuit.opened.load(Ordering::Acquire) != epoch {
                    return result;
                }
                if let Some(key) = key {
                    *circuit.failed_on.lock() = Some(key.clone());
                }
                let n = circuit.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
                if n >= self.options.failure_threshold {
                    self.open(part);
                }
            }
            _ => {
                circuit.consecutive_failures.store(0, Ordering::Release);
            }
        }
        result
    }

    /// Runs `call` on the part `key` lives on, through its circuit.
    async fn through<T, F>(&self, key: &RecordKey, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        let part = self.part_of(key);
        let epoch = self.admit(part).await?;
        self.record(part, epoch, Some(key), call.await)
    }
}

#[async_trait]
impl<S: RecordStore> RecordStore for Breaker<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.through(&req.key, self.inner.claim(req)).await
    }

    /// Sent whatever the circuit's state (see [`RecordStore::renew`]): a running execution
    /// renews its lock once the store answers again, not once a probe has closed the circuit.
    /// While the store is down, the executions that were running when it went renew at their
    /// renewal pause (no new ones start). A renewal that fails is part of the outage the
    /// circuit stands for: it neither stretches the open period nor counts toward opening it
    /// again. One the store answers makes the probe due at once; the probe, not the renewal,
    /// closes the circuit: it checks that the store takes writes (a renewal that found the key
    /// taken over wrote nothing, and a demoted primary answers it), and goes one at a time.
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let part = self.part_of(&req.key);
        let circuit = &self.view.circuits[part];
        if circuit.state() == CircuitState::Closed {
            let epoch = circuit.opened.load(Ordering::Acquire);
            return self.record(part, epoch, Some(&req.key), self.inner.renew(req).await);
        }
        let answer = self.inner.renew(req).await;
        if !matches!(&answer, Err(e) if is_outage(e)) {
            *circuit.opened_at.lock() = None;
        }
        answer
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.through(key, self.inner.complete(key, owner, completion, ttl))
            .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.through(key, self.inner.release(key, owner)).await
    }

    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        self.through(key, self.inner.wait_for_change(key, timeout))
            .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.through(key, self.inner.get(key)).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.through(key, self.inner.delete(key)).await
    }

    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        self.through(key, self.inner.delete_settled(key)).await
    }

    /// Answers if the store does: with one part, its ping through its circuit. With several
    /// (a Cluster), pings of [`PING_SPREAD`] parts spread over the slot space, at once, each
    /// through its circuit (closed ones if any, the next ones each time), answering with the
    /// first that succeeds: a Cluster with a primary down still serves the other primaries'
    /// keys, so a replica is still ready (under `reject`); one ping to the primary that is down
    /// would have said otherwise. A ping that fails before another succeeds counts toward
    /// opening its part's circuit; those still out then are dropped, uncounted.
    async fn ping(&self) -> Result<(), StoreError> {
        let parts = self.view.circuits.len();
        let start = self.view.next_ping.fetch_add(1, Ordering::Relaxed);
        if parts == 1 {
            let epoch = self.admit(0).await?;
            return self.record(0, epoch, None, self.inner.ping_part(0).await);
        }
        let spread = PING_SPREAD.min(parts);
        let mut seen = vec![false; parts];
        let order: Vec<usize> = (0..parts)
            .map(|i| (start + i * parts / spread + i / spread) % parts)
            .chain((0..parts).map(|i| (start + i) % parts))
            .filter(|&p| !std::mem::replace(&mut seen[p], true))
            .collect();
        let closed = |p: &usize| self.view.circuits[*p].state() == CircuitState::Closed;
        let mut chosen: Vec<usize> = order.iter().copied().filter(closed).take(spread).collect();
        if chosen.is_empty() {
            // Every circuit open: parts spread over the store, each through its circuit (a
            // probe where one is due, a refusal at once where none is).
            chosen = order.into_iter().take(spread).collect();
        }
        // The first to answer decides; the others are dropped (uncounted), so a ping waits
        // for no part that is down once another has answered.
        let pings = chosen.into_iter().map(|part| {
            Box::pin(async move {
                let epoch = self.admit(part).await?;
                self.record(part, epoch, None, self.inner.ping_part(part).await)
            })
        });
        futures_util::future::select_ok(pings)
            .await
            .map(|((), _)| ())
    }

    fn usage(&self) -> Option<StoreUsage> {
        self.inner.usage()
    }

    fn refusals_are_final(&self) -> bool {
        self.inner.refusals_are_final()
    }

    fn own_claim(&self, key: &RecordKey) -> Option<Duration> {
        self.inner.own_claim(key)
    }

    fn local_copy(&self, key: &RecordKey) -> Option<Record> {
        self.inner.local_copy(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::faulty::{Fault, FaultyStore};
    use crate::store::MemoryStore;

    fn breaker() -> Breaker<FaultyStore<MemoryStore>> {
        breaker_over(1, 3, Duration::from_millis(200))
    }

    /// A breaker opening after `failure_threshold` failures for `open_for`, over a store of
    /// `parts` parts.
    fn breaker_over(
        parts: usize,
        failure_threshold: u32,
        open_for: Duration,
    ) -> Breaker<FaultyStore<MemoryStore>> {
        let mut store = FaultyStore::new(MemoryStore::new(1 << 20, 1));
        store.parts = parts;
        Breaker::new(
            store,
            BreakerOptions {
                failure_threshold,
                open_for,
            },
        )
    }

    fn key() -> RecordKey {
        RecordKey {
            tenant: "t".into(),
            hash: [1; 32],
        }
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_fails_fast() {
        // Open for far longer than the test takes, however slow the machine: no probe.
        let b = breaker_over(1, 3, Duration::from_secs(60));
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            assert!(b.get(&key()).await.is_err());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        let calls = b.inner().calls.load(Ordering::Relaxed);
        for _ in 0..100 {
            assert!(b.get(&key()).await.is_err());
        }
        assert_eq!(
            b.inner().calls.load(Ordering::Relaxed),
            calls,
            "open circuit never calls"
        );
    }

    /// A running execution's renewal is sent while the circuit is open: it takes its lapsed
    /// lock back as soon as the store answers, not after the next probe. One that fails is part
    /// of the outage (the circuit stays open, its period not stretched); one the store answers
    /// makes the probe due at once, and the probe closes the circuit.
    #[tokio::test(start_paused = true)]
    async fn renewals_are_sent_while_the_circuit_is_open() {
        let b = breaker_over(1, 3, Duration::from_secs(60));
        let req = ClaimRequest {
            key: key(),
            fingerprint: [2; 32],
            owner: OwnerToken::random(),
            execution_id: 7,
            lock_ttl: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        };
        assert!(matches!(
            b.claim(&req).await,
            Ok(ClaimOutcome::Acquired {
                execution_id: 7,
                ..
            })
        ));
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            assert!(b.get(&key()).await.is_err());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        let opened_at = *b.view.circuits[0].opened_at.lock();

        let calls = b.inner().calls.load(Ordering::Relaxed);
        assert!(b.renew(&req).await.is_err());
        assert_eq!(b.inner().calls.load(Ordering::Relaxed), calls + 1, "sent");
        assert_eq!(b.view().state(), CircuitState::Open);
        assert_eq!(
            *b.view.circuits[0].opened_at.lock(),
            opened_at,
            "the open period is not stretched"
        );
        assert!(b.claim(&req).await.is_err(), "a claim still fails fast");
        assert_eq!(b.inner().calls.load(Ordering::Relaxed), calls + 1);

        b.inner().set(Fault::None);
        assert!(matches!(
            b.renew(&req).await,
            Ok(ClaimOutcome::Acquired {
                execution_id: 7,
                ..
            })
        ));
        assert_eq!(b.view().state(), CircuitState::Open, "a probe closes it");
        assert!(b.get(&key()).await.is_ok(), "the probe was due at once");
        assert_eq!(b.view().state(), CircuitState::Closed);
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 1);
    }

    /// A store whose keys live on parts that fail apart (a Redis Cluster's primaries) has a
    /// circuit per part: a part that is down opens its own, is probed on its own, and the keys
    /// of the other parts go on being served (with one circuit, they were all refused).
    /// Readiness pings a part whose circuit is closed.
    #[tokio::test(start_paused = true)]
    async fn each_part_of_the_store_has_its_own_circuit() {
        let b = breaker_over(4, 1, Duration::from_millis(200));
        assert_eq!(b.view().parts(), 4);
        let on = |part: u8, n: u8| RecordKey {
            tenant: "t".into(),
            hash: {
                let mut h = [n; 32];
                h[0] = part;
                h
            },
        };
        let req = |key: RecordKey| ClaimRequest {
            key,
            fingerprint: [2; 32],
            owner: OwnerToken::random(),
            execution_id: 7,
            lock_ttl: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        };
        b.inner().set_part_down(Some(1));
        assert!(b.get(&on(1, 1)).await.is_err());
        assert_eq!(b.view().state(), CircuitState::Open);
        assert_eq!(b.view().open_parts(), 1);
        let calls = b.inner().calls.load(Ordering::Relaxed);
        assert!(b.claim(&req(on(1, 2))).await.is_err());
        assert_eq!(
            b.inner().calls.load(Ordering::Relaxed),
            calls,
            "the part's circuit fails fast"
        );
        for part in [0, 2, 3] {
            assert!(matches!(
                b.claim(&req(on(part, 3))).await,
                Ok(ClaimOutcome::Acquired { .. })
            ));
        }
        assert_eq!(b.view().open_parts(), 1, "the other parts stay closed");
        for _ in 0..8 {
            assert!(
                b.ping().await.is_ok(),
                "ready: a part whose circuit is closed answers"
            );
        }
        assert!(b.get(&on(1, 9)).await.is_err(), "its part is still refused");

        // Its probe, where its last failure was: still down, then back.
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(b.get(&on(1, 1)).await.is_err());
        assert_eq!(b.view().open_parts(), 1);
        assert_eq!(b.inner().near_pings.load(Ordering::Relaxed), 1);
        b.inner().set_part_down(None);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(b.get(&on(1, 1)).await.is_ok());
        assert_eq!(b.view().state(), CircuitState::Closed);
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 1);
    }

    /// A part whose keys keep failing opens its own circuit only, however many failures its
    /// keys meet: the others stay closed and keep serving.
    #[tokio::test(start_paused = true)]
    async fn one_part_failing_opens_no_other_part() {
        let b = breaker_over(64, 3, Duration::from_secs(60));
        let on = |part: u8| RecordKey {
            tenant: "t".into(),
            hash: [part; 32],
        };
        b.inner().set_part_down(Some(1));
        // Part 1 down: however many of its calls fail in a row, only its circuit opens.
        for _ in 0..50 {
            assert!(b.get(&on(1)).await.is_err());
        }
        assert_eq!(b.view().open_parts(), 1);
        for part in 2..64 {
            assert!(b.get(&on(part)).await.is_ok(), "part {part}");
        }
        // The whole store down: each part opens on its own failures.
        b.inner().set_part_down(None);
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            assert!(b.get(&on(10)).await.is_err());
        }
        assert_eq!(b.view().open_parts(), 2);
        let calls = b.inner().calls.load(Ordering::Relaxed);
        assert!(b.get(&on(11)).await.is_err());
        assert_eq!(
            b.inner().calls.load(Ordering::Relaxed),
            calls + 1,
            "a part still closed calls the store"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_probe_closes_on_recovery_and_reopens_on_failure() {
        let b = breaker();
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            let _ = b.get(&key()).await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Still down: the probe fails and the circuit opens again.
        assert!(b.get(&key()).await.is_err());
        assert_eq!(b.view().state(), CircuitState::Open);
        b.inner().set(Fault::None);
        assert!(b.get(&key()).await.is_err(), "still within open_for");
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(b.get(&key()).await.is_ok());
        assert_eq!(b.view().state(), CircuitState::Closed);
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_the_store_answers_badly_closes_the_circuit() {
        let b = breaker();
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            let _ = b.get(&key()).await;
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Back, but the probe's script raises: the store is there, so the call goes through.
        b.inner().set(Fault::PingCorrupt);
        assert!(b.get(&key()).await.is_ok());
        assert_eq!(b.view().state(), CircuitState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn one_probe_at_a_time_while_half_open() {
        let b = Arc::new(breaker());
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            let _ = b.get(&key()).await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        // The probe's ping hangs: everyone else must fail fast instead of piling onto the store.
        b.inner().set(Fault::Stall);
        let probe = tokio::spawn({
            let b = b.clone();
            async move { b.get(&key()).await }
        });
        for _ in 0..5000 {
            if b.view().state() == CircuitState::HalfOpen {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(
            b.view().state(),
            CircuitState::HalfOpen,
            "the probe never started"
        );
        let calls = b.inner().calls.load(Ordering::Relaxed);
        for _ in 0..10 {
            match b.get(&key()).await {
                Err(StoreError::Unavailable(m)) => assert!(m.contains("probe in progress"), "{m}"),
                other => panic!("expected a fast refusal, got {other:?}"),
            }
        }
        assert_eq!(b.inner().calls.load(Ordering::Relaxed), calls);
        b.inner().set(Fault::None);
        assert_eq!(probe.await.expect("probe task").expect("probe"), None);
        assert_eq!(b.view().state(), CircuitState::Closed);
    }

    fn outage() -> Result<(), StoreError> {
        Err(StoreError::Unavailable("injected".into()))
    }

    #[tokio::test(start_paused = true)]
    async fn failures_of_calls_let_through_before_the_circuit_opened_count_once() {
        let b = breaker();
        // Six calls let through while closed, failing together: one opening, not four, and
        // the open period is not moved by the late ones.
        let epoch = b.admit(0).await.expect("closed");
        for _ in 0..3 {
            let _ = b.record(0, epoch, None, outage());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        let opened_at = *b.view.circuits[0].opened_at.lock();
        tokio::time::sleep(Duration::from_millis(5)).await;
        for _ in 0..3 {
            let _ = b.record(0, epoch, None, outage());
        }
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 1);
        assert_eq!(
            *b.view.circuits[0].opened_at.lock(),
            opened_at,
            "the open period was stretched"
        );

        // Recovered: a probe closes the circuit. A failure of a call from before the opening
        // arriving now does not count toward opening it again.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let after = b.admit(0).await.expect("the probe closes the circuit");
        assert_eq!(b.view().state(), CircuitState::Closed);
        for _ in 0..3 {
            let _ = b.record(0, epoch, None, outage());
        }
        assert_eq!(b.view().state(), CircuitState::Closed);
        assert_eq!(
            b.view().circuits[0]
                .consecutive_failures
                .load(Ordering::Relaxed),
            0
        );
        // Failures of calls let through since do.
        for _ in 0..3 {
            let _ = b.record(0, after, None, outage());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_failure_count() {
        let b = breaker();
        for _ in 0..5 {
            b.inner().set(Fault::Down);
            let _ = b.get(&key()).await;
            let _ = b.get(&key()).await;
            b.inner().set(Fault::None);
            assert!(b.get(&key()).await.is_ok());
        }
        assert_eq!(b.view().state(), CircuitState::Closed);
    }
}
