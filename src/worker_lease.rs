//! Snowflake worker ids leased from Redis, so replicas that share a store never issue
//! `X-Idempotency-Id`s under one worker id at the same time.
//!
//! Backends put execution ids under a unique index. Two replicas with one worker id issue the
//! same id whenever both take their first id in the same millisecond, and the backend then
//! refuses (or, deduplicating on the id, answers with another request's outcome) a legitimate
//! request. A worker id hashed from the pod name repeats by the birthday rule (one chance in two
//! among 38 replicas), and a Deployment gives its pods no ordinal to configure one from.
//!
//! So on the Redis store, with no `idempotency.worker_id` and no `IDEMGATE_WORKER_ID`, a process
//! leases its id (`lua/worker_lease.lua`): the key `<prefix>:worker:<id>` holds a random token of
//! the process and its host name for `idempotency.worker_lease` (30 s), and is renewed every
//! third of that. It tries the id its host name hashes to first, then the next ones in turn
//! (modulo 1024), so a pod keeps the id its name gives it unless another process holds that.
//!
//! A lease is renewed through the shutdown drain (requests still take ids then) and never
//! given back: it runs out. A process that stops, crashed or drained, last renewed less than a
//! third of a lease (plus a slow call) before, so a successor taking its id starts about two
//! thirds of a lease (20 s by default) after the last id issued under it at the least, which
//! covers clocks that differ between hosts (or step back across a restart) by less than that.
//! A clock further behind is covered too: each lease call answers with Redis's clock, and ids
//! are issued no earlier than it ([`WorkerIds::follow_store_clock`]; a Redis clock over
//! [`MAX_STORE_CLOCK_AHEAD`] ahead is not followed, and said once). What is left is a previous
//! holder whose clock ran over 20 s *ahead* of Redis's.
//!
//! What the lease cannot rule out, and what happens then:
//! - **Redis unreachable at the start:** ids go out under the hashed id, unleased, until a
//!   lease is taken; the first keyed requests wait up to [`FIRST_LEASE_WAIT`] for the first
//!   attempt, and `/readyz` answers 503 until it has ended.
//! - **Every id held by others:** the hashed id is used unleased; a warning says so and
//!   `idemgate_worker_id_leased` is 0.
//! - **Cut off from Redis (or paused) longer than the lease:** the process keeps its id (it has
//!   no other it could trust); `idemgate_worker_id_leased` turns 0 once the lease may have run
//!   out. A process started meanwhile may lease the same id; the first renewal that gets
//!   through finds it taken, and the process moves to a free id at once: from then on keyed
//!   requests wait for the search (usually a round trip or two; at most [`FIRST_LEASE_WAIT`]
//!   from the loss, one deadline for all) rather than take ids under the id it now knows
//!   another holds. A search that fails (Redis gone again) or finds no id free, or runs past
//!   the deadline, leaves ids going out under the old id, as in the cases above. A paused
//!   process issues ids on resuming before that renewal has answered.
//! - **A failover that loses the lease's write** (replication is asynchronous): another process
//!   may take the id; this one finds out at its next renewal, a third of a lease later at most,
//!   and moves.
//! - **An id whose key Redis cannot reach** (a Cluster shard down, a key the ACL does not
//!   grant) is passed over: the search goes on past it, in this search or the next.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;

use crate::snowflake::{self, Snowflake, MAX_WORKER_ID};
use crate::store::redis::RedisStore;
use crate::store::StoreError;

/// Longest a keyed request waits for the first lease attempt before taking an id anyway: the
/// attempt ends within one Redis operation's deadline per id it tries, so this is only reached
/// when Redis is slow or down at the start.
pub const FIRST_LEASE_WAIT: Duration = Duration::from_secs(2);

/// How far ahead of this host's clock Redis's may be for ids to follow it
/// ([`WorkerIds::follow_store_clock`]).
pub const MAX_STORE_CLOCK_AHEAD: Duration = Duration::from_secs(600);

/// Pause before trying again after Redis did not answer a lease call.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// A search for a free id ends at its first failed call when no call has been answered yet
/// (Redis may be down: one deadline, not one per id), and after this many failures in all.
/// Between the two a failing id is passed over, and the next search goes on from the id after
/// a failed one: on a Cluster with one shard down, the ids whose keys live on the others can
/// still be leased.
const MAX_SEARCH_FAILURES: u32 = 64;

/// Where the worker id in use came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerIdSource {
    /// `idempotency.worker_id`.
    Config,
    /// `IDEMGATE_WORKER_ID`.
    Environment,
    /// Hashed from the host name (the memory store: one process, nothing to share ids with).
    HostName,
    /// Leased from Redis (see the module docs).
    Lease,
}

impl WorkerIdSource {
    /// The name `/admin/config` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerIdSource::Config => "config",
            WorkerIdSource::Environment => "environment",
            WorkerIdSource::HostName => "host name",
            WorkerIdSource::Lease => "lease",
        }
    }
}

/// The execution-id generator of a process and the state of its worker id.
#[derive(Debug)]
pub struct WorkerIds {
    snowflake: Snowflake,
    source: WorkerIdSource,
    /// The id in use is leased until this point (milliseconds after `base`): the last
    /// successful call was sent a lease before it. Past it, Redis may have let the lease go;
    /// 0 when no lease is held (only ever set under [`WorkerIdSource::Lease`]).
    leased_until_ms: AtomicU64,
    base: Instant,
    /// The first lease attempt has ended (or there is none to make), or since a lease was
    /// lost, the search for another.
    settled: AtomicBool,
    /// Until when ids wait for the attempt or search under way (milliseconds after `base`):
    /// one deadline for every request, so a long search stalls each by what is left of it.
    settle_by_ms: AtomicU64,
    settled_notify: Notify,
    /// Leases found held by another process at renewal.
    lost: AtomicU64,
    /// Lease calls Redis did not answer (or answered with an error).
    failures: AtomicU64,
}

impl WorkerIds {
    /// Ids under a worker id that needs no lease.
    pub fn fixed(worker_id: u16, source: WorkerIdSource) -> Self {
        Self::with(worker_id, source, true)
    }

    /// Ids under `first_choice` until a [`Lease`] has taken one.
    pub fn to_lease(first_choice: u16) -> Self {
        Self::with(first_choice, WorkerIdSource::Lease, false)
    }

    fn with(worker_id: u16, source: WorkerIdSource, settled: bool) -> Self {
        WorkerIds {
            snowflake: Snowflake::new(worker_id),
            source,
            leased_until_ms: AtomicU64::new(0),
            base: Instant::now(),
            settled: AtomicBool::new(settled),
            settle_by_ms: AtomicU64::new(FIRST_LEASE_WAIT.as_millis() as u64),
            settled_notify: Notify::new(),
            lost: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    /// The next execution id. While the first lease attempt is out, or the search for another
    /// id after the lease was found lost, waits for it (at most [`FIRST_LEASE_WAIT`]), so an
    /// id is not issued under a worker id the lease then gives up.
    pub async fn next_id(&self) -> u64 {
        if !self.settled.load(Ordering::Acquire) {
            let notified = self.settled_notify.notified();
            tokio::pin!(notified);
            // Registered before the flag is read again, so a settle in between is not missed.
            notified.as_mut().enable();
            if !self.settled.load(Ordering::Acquire) {
                let by = self.settle_by_ms.load(Ordering::Acquire);
                let left = by.saturating_sub(self.millis(Instant::now()));
                let _ = tokio::time::timeout(Duration::from_millis(left), notified).await;
            }
        }
        self.snowflake.next_id()
    }

    /// The worker id in use.
    pub fn worker_id(&self) -> u16 {
        self.snowflake.worker_id()
    }

    pub fn source(&self) -> WorkerIdSource {
        self.source
    }

    /// Whether the id in use is leased right now: held, and renewed less than a lease ago
    /// (a process whose renewals fail stops counting as leased once Redis may have let the
    /// lease go).
    pub fn is_leased(&self) -> bool {
        self.millis(Instant::now()) < self.leased_until_ms.load(Ordering::Relaxed)
    }

    /// Records a lease held until `until` (or none held).
    fn hold(&self, until: Option<Instant>) {
        let until = until.map_or(0, |until| self.millis(until));
        self.leased_until_ms.store(until, Ordering::Relaxed);
    }

    fn millis(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether the first lease attempt has ended (always, without a lease).
    pub fn is_settled(&self) -> bool {
        self.settled.load(Ordering::Acquire)
    }

    /// Leases found held by another process at renewal.
    pub fn leases_lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    /// Lease calls that failed.
    pub fn lease_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    fn settle(&self) {
        if !self.settled.swap(true, Ordering::AcqRel) {
            self.settled_notify.notify_waiters();
        }
    }

    /// The lease was found held by another process: no lease is held, and ids wait for the
    /// search for another ([`WorkerIds::settle`] when it ends) instead of going out under an
    /// id a live process holds.
    /// Issues no more ids stamped before `store_ms`, the shared store's clock at a lease call
    /// (this host's reading `now_ms`): a host whose clock runs behind the store's (a VM
    /// restored from a snapshot, a node whose NTP has not caught up) would otherwise issue ids
    /// stamped before the last ones its worker id's previous holder issued, and repeat them.
    /// A store clock more than [`MAX_STORE_CLOCK_AHEAD`] ahead is not followed (ids far in
    /// the future would misdate every record): `Err` with how far ahead it is.
    fn follow_store_clock(&self, store_ms: u64, now_ms: u64) -> Result<(), u64> {
        let ahead = store_ms.saturating_sub(now_ms);
        if ahead > MAX_STORE_CLOCK_AHEAD.as_millis() as u64 {
            return Err(ahead);
        }
        self.snowflake.advance_to(store_ms);
        Ok(())
    }

    fn lose(&self) {
        self.lost.fetch_add(1, Ordering::Relaxed);
        self.hold(None);
        let by = self.millis(Instant::now()) + FIRST_LEASE_WAIT.as_millis() as u64;
        self.settle_by_ms.store(by, Ordering::Release);
        self.settled.store(false, Ordering::Release);
    }
}

/// Keeps a worker id leased for a [`WorkerIds`]; see the module docs.
pub struct Lease {
    store: Arc<RedisStore>,
    ids: Arc<WorkerIds>,
    /// What the lease key holds: a random token (this process) and the host name (for people).
    holder: String,
    lease: Duration,
    first_choice: u16,
    /// Whether a Redis clock too far ahead to follow was reported (once per process).
    clock_warned: AtomicBool,
}

impl Lease {
    /// A lease for `ids` on `store`, held for `lease` at a time, starting the search at the id
    /// `ids` was made with.
    pub fn new(store: Arc<RedisStore>, ids: Arc<WorkerIds>, lease: Duration) -> Self {
        let name = snowflake::host_name().unwrap_or_else(|| std::process::id().to_string());
        let holder = format!("{:032x} {name}", rand::random::<u128>());
        let first_choice = ids.worker_id();
        Lease {
            store,
            ids,
            holder,
            lease,
            first_choice,
            clock_warned: AtomicBool::new(false),
        }
    }

    /// Takes a lease and keeps it (or another, when it is lost) for as long as the process
    /// lives. Not stopped by shutdown: keyed requests still take ids while they drain, so the
    /// lease is renewed until the process exits (and then left to run out).
    pub async fn run(&self) {
        let renew_every = self.lease / 3;
        let count = MAX_WORKER_ID + 1;
        let mut held: Option<u16> = None;
        // Where the next search starts: the host name's id, unless the last search failed.
        let mut start = self.first_choice;
        // Each condition is logged when it starts, not on every retry.
        let mut failing = false;
        let mut none_free = false;
        loop {
            let pause = match held {
                Some(id) => match self.call(id).await {
                    Ok(true) => {
                        if std::mem::take(&mut failing) {
                            tracing::info!(worker_id = id, "worker id lease renewed again");
                        }
                        renew_every
                    }
                    Ok(false) => {
                        self.ids.lose();
                        held = None;
                        tracing::error!(
                            worker_id = id,
                            key = %self.store.worker_lease_key(id),
                            "another process holds this worker id's lease (this one went \
                             unrenewed for longer than idempotency.worker_lease); leasing \
                             another id now"
                        );
                        Duration::ZERO
                    }
                    Err(e) => {
                        self.failed(&mut failing, &e, "renewing the worker id lease failed");
                        RETRY_PAUSE.min(renew_every)
                    }
                },
                None => match self.acquire(start).await {
                    Ok(Some(id)) => {
                        self.ids.snowflake.set_worker_id(id);
                        held = Some(id);
                        start = self.first_choice;
                        failing = false;
                        none_free = false;
                        tracing::info!(
                            worker_id = id,
                            key = %self.store.worker_lease_key(id),
                            lease_seconds = self.lease.as_secs_f64(),
                            "worker id leased"
                        );
                        self.ids.settle();
                        renew_every
                    }
                    Ok(None) => {
                        if !std::mem::replace(&mut none_free, true) {
                            tracing::warn!(
                                worker_id = self.ids.worker_id(),
                                "all 1024 worker ids are leased by other processes: issuing \
                                 execution ids under this one unleased, so they may repeat \
                                 another replica's; trying again every {}s",
                                renew_every.as_secs_f64()
                            );
                        }
                        self.ids.settle();
                        renew_every
                    }
                    Err((e, failed_id)) => {
                        start = (failed_id + 1) % count;
                        self.failed(
                            &mut failing,
                            &e,
                            "leasing a worker id failed; execution ids go out under the \
                             unleased one until a lease is taken",
                        );
                        self.ids.settle();
                        RETRY_PAUSE.min(renew_every)
                    }
                },
            };
            tokio::time::sleep(pause).await;
        }
    }

    /// One lease call on `id`; when the lease is this process's, records it as held for a
    /// lease from when the call was sent, and issues no more ids stamped before Redis's clock
    /// ([`WorkerIds::follow_store_clock`]).
    async fn call(&self, id: u16) -> Result<bool, StoreError> {
        let sent = Instant::now();
        let held = self
            .store
            .lease_worker_id(id, &self.holder, self.lease)
            .await?;
        let Some(store_ms) = held else {
            return Ok(false);
        };
        self.ids.hold(Some(sent + self.lease));
        if let Err(ahead) = self
            .ids
            .follow_store_clock(store_ms, snowflake::unix_ms_now())
        {
            if !self.clock_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    ahead_ms = ahead,
                    "Redis's clock is far ahead of this host's; execution ids keep this host's \
                     clock (check NTP on both)"
                );
            }
        }
        Ok(true)
    }

    /// Leases the first free id from `start` on; `None` when every id is held (or could not
    /// be asked about). An id whose call fails is passed over once Redis has answered for
    /// another (see [`MAX_SEARCH_FAILURES`]); the error that ends a search comes with its id.
    async fn acquire(&self, start: u16) -> Result<Option<u16>, (StoreError, u16)> {
        let count = MAX_WORKER_ID + 1;
        let (mut answered, mut failures) = (false, 0u32);
        for step in 0..count {
            let id = (start + step) % count;
            match self.call(id).await {
                Ok(true) => return Ok(Some(id)),
                Ok(false) => answered = true,
                Err(e) => {
                    failures += 1;
                    if !answered || failures >= MAX_SEARCH_FAILURES {
                        // Counted by the caller, with the others it reports.
                        return Err((e, id));
                    }
                    self.ids.failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(None)
    }

    fn failed(&self, failing: &mut bool, error: &StoreError, what: &str) {
        self.ids.failures.fetch_add(1, Ordering::Relaxed);
        if !std::mem::replace(failing, true) {
            tracing::warn!(worker_id = self.ids.worker_id(), error = %error, "{what}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_fixed_id_is_settled_and_never_waits() {
        let ids = WorkerIds::fixed(7, WorkerIdSource::Config);
        assert!(ids.is_settled());
        let id = tokio::time::timeout(Duration::from_millis(100), ids.next_id())
            .await
            .expect("no wait");
        assert_eq!(snowflake::decode(id).worker_id, 7);
        assert!(!ids.is_leased());
    }

    /// An id asked for while `ids` is unsettled waits (`why` it must not go out), and takes
    /// `worker_id` once a lease of it settles them.
    async fn waits_and_takes_the_leased_id(ids: &Arc<WorkerIds>, worker_id: u16, why: &str) {
        let waiting = tokio::spawn({
            let ids = ids.clone();
            async move { ids.next_id().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "{why}");
        ids.snowflake.set_worker_id(worker_id);
        ids.settle();
        let id = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("woken by the settle")
            .expect("task");
        assert_eq!(snowflake::decode(id).worker_id, worker_id);
    }

    #[tokio::test]
    async fn ids_wait_for_the_first_attempt_and_take_the_id_it_leased() {
        let ids = Arc::new(WorkerIds::to_lease(5));
        assert!(!ids.is_settled());
        waits_and_takes_the_leased_id(&ids, 900, "an id went out before the attempt ended").await;
    }

    #[tokio::test]
    async fn ids_wait_for_the_search_after_a_lost_lease_and_take_the_new_id() {
        let ids = Arc::new(WorkerIds::to_lease(5));
        ids.hold(Some(Instant::now() + Duration::from_secs(30)));
        ids.settle();
        assert_eq!(snowflake::decode(ids.next_id().await).worker_id, 5);
        // Another process holds id 5 now: nothing more goes out under it.
        ids.lose();
        assert!(!ids.is_leased());
        assert_eq!(ids.leases_lost(), 1);
        waits_and_takes_the_leased_id(&ids, 6, "an id went out under the lost worker id").await;
    }

    /// The wait after a lost lease is one deadline for all: a search that runs long stalls a
    /// request that comes late in it only by what is left.
    #[tokio::test(start_paused = true)]
    async fn the_wait_for_the_search_after_a_lost_lease_is_one_deadline() {
        let ids = WorkerIds::to_lease(5);
        ids.settle();
        ids.lose();
        tokio::time::advance(Duration::from_millis(1500)).await;
        let started = tokio::time::Instant::now();
        let id = ids.next_id().await;
        assert_eq!(started.elapsed(), Duration::from_millis(500));
        assert_eq!(snowflake::decode(id).worker_id, 5);
    }

    /// Ids follow Redis's clock when this host's runs behind it (a restored VM would otherwise
    /// reissue its worker id's earlier ids), but not one absurdly far ahead.
    #[test]
    fn ids_follow_a_store_clock_ahead_of_this_host_s_within_bounds() {
        let ids = WorkerIds::fixed(9, WorkerIdSource::Lease);
        let now = snowflake::unix_ms_now();
        let store = now + 90_000;
        assert_eq!(ids.follow_store_clock(store, now), Ok(()));
        let id = ids.snowflake.next_id();
        assert!(
            snowflake::decode(id).unix_ms >= store,
            "an id stamped before the store's clock"
        );
        // A store clock behind this host's changes nothing.
        let before = ids.snowflake.next_id();
        assert_eq!(ids.follow_store_clock(now - 60_000, now), Ok(()));
        assert_eq!(ids.snowflake.next_id(), before + 1);
        // One over ten minutes ahead is not followed.
        let far = now + MAX_STORE_CLOCK_AHEAD.as_millis() as u64 + 90_000 + 1;
        assert!(ids.follow_store_clock(far, now).is_err());
        assert!(snowflake::decode(ids.snowflake.next_id()).unix_ms < far);
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_for_the_first_attempt_is_bounded() {
        let ids = WorkerIds::to_lease(5);
        let started = tokio::time::Instant::now();
        let id = ids.next_id().await;
        assert_eq!(started.elapsed(), FIRST_LEASE_WAIT);
        assert_eq!(snowflake::decode(id).worker_id, 5);
    }
}
