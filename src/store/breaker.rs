//! A circuit breaker around a shared store: after N consecutive failures it answers at once
//! (so no request waits on a dead store), and half-opens to probe the real script path.
//!
//! ```text
//!   Closed --N consecutive failures--> Open --open_for elapsed--> HalfOpen
//!     ^                                  ^                           |
//!     +------------ probe succeeds ------+---- probe fails ----------+
//! ```
//!
//! While half-open, one caller probes with [`RecordStore::ping`] (which runs a script, not a
//! bare PING, so a flushed script cache is noticed) and everyone else still fails fast.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
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

/// Shared view of the breaker for metrics and readiness.
#[derive(Debug, Default)]
pub struct CircuitView {
    state: AtomicU8,
    consecutive_failures: AtomicU32,
    /// How many times the circuit opened.
    pub opened: std::sync::atomic::AtomicU64,
}

impl CircuitView {
    /// Current state.
    pub fn state(&self) -> CircuitState {
        match self.state.load(Ordering::Acquire) {
            1 => CircuitState::Open,
            2 => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }
}

/// A [`RecordStore`] that stops calling a failing store for a while.
pub struct Breaker<S> {
    inner: S,
    options: BreakerOptions,
    view: Arc<CircuitView>,
    opened_at: Mutex<Option<Instant>>,
    probing: tokio::sync::Mutex<()>,
}

fn is_outage(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_))
}

// === impl Breaker ===

impl<S: RecordStore> Breaker<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, options: BreakerOptions) -> Self {
        Breaker {
            inner,
            options,
            view: Arc::default(),
            opened_at: Mutex::new(None),
            probing: tokio::sync::Mutex::new(()),
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

    fn set_state(&self, s: CircuitState) {
        self.view.state.store(s as u8, Ordering::Release);
    }

    /// Lets a call through, or fails fast while open. Past `open_for`, one caller probes.
    /// Returns how many times the circuit had opened when the call was let through: its
    /// failure counts only if the circuit has not opened since (see [`Breaker::record`]).
    async fn admit(&self) -> Result<u64, StoreError> {
        let epoch = || self.view.opened.load(Ordering::Acquire);
        if self.view.state() == CircuitState::Closed {
            return Ok(epoch());
        }
        let ready_to_probe = || {
            self.opened_at
                .lock()
                .is_none_or(|t| t.elapsed() >= self.options.open_for)
        };
        if !ready_to_probe() {
            return Err(StoreError::Unavailable("circuit open".into()));
        }
        let Ok(_probe) = self.probing.try_lock() else {
            return Err(StoreError::Unavailable(
                "circuit half-open, probe in progress".into(),
            ));
        };
        if self.view.state() == CircuitState::Closed {
            return Ok(epoch());
        }
        // Looked at again under the probe's lock: a probe that failed between the look above
        // and this one opened the circuit anew, and another probe now would wait on the same
        // dead store instead of failing fast for open_for.
        if !ready_to_probe() {
            return Err(StoreError::Unavailable("circuit open".into()));
        }
        self.set_state(CircuitState::HalfOpen);
        match self.inner.ping().await {
            Err(e) if is_outage(&e) => {
                self.open();
                Err(e)
            }
            // The store answered, if not well (a script the probe runs that raises, a reply
            // this version cannot read): that is no outage, and holding the circuit open on it
            // would hand every request to the outage policy until the script is mended. The
            // call goes on, to meet the store on its own terms.
            answered => {
                self.view.consecutive_failures.store(0, Ordering::Release);
                self.set_state(CircuitState::Closed);
                match answered {
                    Ok(()) => tracing::info!("record store recovered; circuit closed"),
                    Err(e) => {
                        tracing::warn!(error = %e, "record store answers, if not well; circuit closed")
                    }
                }
                Ok(epoch())
            }
        }
    }

    /// Closes the circuit from outside a probe: the store answered a call sent while it was
    /// open (`why`).
    fn close(&self, why: &str) {
        self.view.consecutive_failures.store(0, Ordering::Release);
        let was = self
            .view
            .state
            .swap(CircuitState::Closed as u8, Ordering::AcqRel);
        if was != CircuitState::Closed as u8 {
            tracing::info!("record store recovered ({why}); circuit closed");
        }
    }

    fn open(&self) {
        {
            // The clock read under the lock (an assignment reads its value before its place):
            // the latest of racing failures stands, and the next probe never comes early.
            let mut opened_at = self.opened_at.lock();
            *opened_at = Some(Instant::now());
        }
        // A failed probe re-opens the same outage; only a closed circuit opening counts, once
        // however many failures reach the threshold together.
        let was = self
            .view
            .state
            .swap(CircuitState::Open as u8, Ordering::AcqRel);
        if was == CircuitState::Closed as u8 {
            self.view.opened.fetch_add(1, Ordering::AcqRel);
            tracing::warn!(open_for = ?self.options.open_for, "record store failing; circuit open");
        }
    }

    /// Counts the outcome of a call let through at `epoch` (see [`Breaker::admit`]). A call
    /// that fails after the circuit opened since it was let through is part of the outage
    /// already counted: it neither stretches the open period nor, after a probe has closed
    /// the circuit, counts toward opening it again. (A call's deadline can outlast
    /// `open_for`.)
    fn record<T>(&self, epoch: u64, result: Result<T, StoreError>) -> Result<T, StoreError> {
        match &result {
            Err(e) if is_outage(e) => {
                if self.view.opened.load(Ordering::Acquire) != epoch {
                    return result;
                }
                let n = self
                    .view
                    .consecutive_failures
                    .fetch_add(1, Ordering::AcqRel)
                    + 1;
                if n >= self.options.failure_threshold {
                    self.open();
                }
            }
            _ => {
                self.view.consecutive_failures.store(0, Ordering::Release);
            }
        }
        result
    }
}

#[async_trait]
impl<S: RecordStore> RecordStore for Breaker<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.claim(req).await)
    }

    /// Sent whatever the circuit's state (see [`RecordStore::renew`]): a running execution
    /// renews its lock once the store answers again, not once a probe has closed the circuit.
    /// One renewal per running execution every 250 ms at most while the store is down: the
    /// executions that were running when it went, since no new ones start. A renewal the store
    /// answers closes the circuit, as a probe would have.
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if self.view.state() == CircuitState::Closed {
            let epoch = self.view.opened.load(Ordering::Acquire);
            return self.record(epoch, self.inner.renew(req).await);
        }
        let answer = self.inner.renew(req).await;
        match &answer {
            // Part of the outage the circuit already stands for: it neither stretches the open
            // period nor counts toward opening it again.
            Err(e) if is_outage(e) => {}
            _ => self.close("a lock renewal reached it"),
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
        let epoch = self.admit().await?;
        self.record(
            epoch,
            self.inner.complete(key, owner, completion, ttl).await,
        )
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.release(key, owner).await)
    }

    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.wait_for_change(key, timeout).await)
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.get(key).await)
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.delete(key).await)
    }

    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.delete_settled(key).await)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let epoch = self.admit().await?;
        self.record(epoch, self.inner.ping().await)
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
        Breaker::new(
            FaultyStore::new(MemoryStore::new(1 << 20, 1)),
            BreakerOptions {
                failure_threshold: 3,
                open_for: Duration::from_millis(200),
            },
        )
    }

    fn key() -> RecordKey {
        RecordKey {
            tenant: "t".into(),
            hash: [1; 32],
        }
    }

    #[tokio::test]
    async fn opens_after_consecutive_failures_and_fails_fast() {
        // Open for far longer than the test takes, however slow the machine: no probe.
        let b = Breaker::new(
            FaultyStore::new(MemoryStore::new(1 << 20, 1)),
            BreakerOptions {
                failure_threshold: 3,
                open_for: Duration::from_secs(60),
            },
        );
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
    /// closes the circuit.
    #[tokio::test]
    async fn renewals_are_sent_while_the_circuit_is_open() {
        let b = Breaker::new(
            FaultyStore::new(MemoryStore::new(1 << 20, 1)),
            BreakerOptions {
                failure_threshold: 3,
                open_for: Duration::from_secs(60),
            },
        );
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
            Ok(ClaimOutcome::Acquired { execution_id: 7 })
        ));
        b.inner().set(Fault::Down);
        for _ in 0..3 {
            assert!(b.get(&key()).await.is_err());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        let opened_at = *b.opened_at.lock();

        let calls = b.inner().calls.load(Ordering::Relaxed);
        assert!(b.renew(&req).await.is_err());
        assert_eq!(b.inner().calls.load(Ordering::Relaxed), calls + 1, "sent");
        assert_eq!(b.view().state(), CircuitState::Open);
        assert_eq!(
            *b.opened_at.lock(),
            opened_at,
            "the open period is not stretched"
        );
        assert!(b.claim(&req).await.is_err(), "a claim still fails fast");
        assert_eq!(b.inner().calls.load(Ordering::Relaxed), calls + 1);

        b.inner().set(Fault::None);
        assert!(matches!(
            b.renew(&req).await,
            Ok(ClaimOutcome::Acquired { execution_id: 7 })
        ));
        assert_eq!(b.view().state(), CircuitState::Closed);
        assert!(b.get(&key()).await.is_ok(), "closed: calls go through");
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
    async fn failures_of_calls_let_through_before_the_circuit_opened_count_once() {
        let b = breaker();
        // Six calls let through while closed, failing together: one opening, not four, and
        // the open period is not moved by the late ones.
        let epoch = b.admit().await.expect("closed");
        for _ in 0..3 {
            let _ = b.record(epoch, outage());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        let opened_at = *b.opened_at.lock();
        tokio::time::sleep(Duration::from_millis(5)).await;
        for _ in 0..3 {
            let _ = b.record(epoch, outage());
        }
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 1);
        assert_eq!(
            *b.opened_at.lock(),
            opened_at,
            "the open period was stretched"
        );

        // Recovered: a probe closes the circuit. A failure of a call from before the opening
        // arriving now does not count toward opening it again.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let after = b.admit().await.expect("the probe closes the circuit");
        assert_eq!(b.view().state(), CircuitState::Closed);
        for _ in 0..3 {
            let _ = b.record(epoch, outage());
        }
        assert_eq!(b.view().state(), CircuitState::Closed);
        assert_eq!(b.view().consecutive_failures.load(Ordering::Relaxed), 0);
        // Failures of calls let through since do.
        for _ in 0..3 {
            let _ = b.record(after, outage());
        }
        assert_eq!(b.view().state(), CircuitState::Open);
        assert_eq!(b.view().opened.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
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
