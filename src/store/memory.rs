//! The embedded record store: in-process, sharded, TTL-evicting, bounded by a byte capacity.
//!
//! Records live in a fixed set of shards, each a `parking_lot::Mutex<HashMap>`; the shard is
//! picked by a hash of the record hash keyed per store, so clients cannot choose it. Every
//! operation locks exactly one shard and never across an `.await`, and no code path holds two
//! shard locks at once, so there is no global lock on the hot path and no lock ordering to get
//! wrong. Expired records are treated as absent on every access and removed then; a
//! background sweeper ([`MemoryStore::sweep_round`], an eighth of the shards per round) and a
//! full sweep before refusing for lack of room collect the rest; a sweep also shrinks a table
//! its records have mostly left. When full the store refuses new claims rather than forget a
//! live record.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{
    digest_word, ClaimOutcome, ClaimRequest, Completion, Deletion, Digest, OwnerToken, Record,
    RecordKey, RecordState, RecordStore, StoreError, StoreUsage, WriteOutcome,
};

/// Bytes charged against the capacity for every record, whatever its state, so `capacity`
/// bounds the heap the records take (`tests/memory_bound.rs` measures it):
///
/// - the map slot (key and entry) plus its control byte, times 16/7: a hash table that has just
///   doubled holds 7/16 of its slots filled, the worst case between two doublings;
/// - the tenant string (`tenant_len` bytes), rounded up to the next 16 bytes, at least 16: the
///   allocator's size class for it.
///
/// A stored response is charged on top, by [`super::StoredResponse::size_bytes`].
pub const fn record_overhead(tenant_len: usize) -> usize {
    let tenant = if tenant_len == 0 {
        16
    } else {
        tenant_len.next_multiple_of(16)
    };
    SLOT_BYTES + tenant
}

/// The map slot part of [`record_overhead`].
const SLOT_BYTES: usize =
    (std::mem::size_of::<MapKey>() + std::mem::size_of::<Entry>() + 1) * 16 / 7;

/// Upper bound on the shard count; more shards than this only waste memory.
const MAX_SHARDS: usize = 1 << 16;

/// Minimum time from the end of one sweep a full store runs to make room to the start of the
/// next. While full, every refused claim would otherwise walk every shard; a flood of new keys
/// must not turn into a flood of full sweeps. Timed from the end, so a sweep of a large store
/// that takes longer than this still leaves the shards alone in between. The price: a record
/// that expired within this window may not be collected in time for a claim, which is then
/// refused as if the store were full of live records (503; the client may retry). A completion
/// does not pay it: it waits out the interval instead (see
/// [`MemoryStore::sweep_for_completion`]).
const ROOM_SWEEP_INTERVAL: Duration = Duration::from_millis(50);

/// New claims take at most all but this fraction of the capacity (1/16): the rest is for the
/// answers of claims already running. A full store refuses a new key with a 503, which the
/// client retries; an answer it has no room for is kept as its status alone, and every retry of
/// it gets 409 `not-replayable` for the record's whole `ttl`. Without the headroom, a store
/// kept full (a flood of new keys, or a `ttl` that holds more than the capacity) gave the room
/// each expiry freed to new claims first (a claim charges a few hundred bytes, an answer its
/// whole size), and running executions lost their answers.
const CLAIM_HEADROOM_DIVISOR: usize = 16;

/// A background round sweeps `1 / SWEEP_ROUNDS` of the shards, so each second's sweep costs an
/// eighth of the store's size rather than all of it (a full walk of ten million records is
/// ~10% of a core every second); every shard is still visited once every `SWEEP_ROUNDS` rounds.
/// Expired records are absent to every operation anyway; sweeping only returns their memory.
pub const SWEEP_ROUNDS: usize = 8;

/// Roughly thirty years: stands in for "never" when a deadline would overflow `Instant`.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// One shard's map. Its hasher is keyed with random keys per map (std's SipHash-1-3): record
/// hashes are SHA-256 of what clients send, so a client could grind keys whose unkeyed bits
/// collide in one table and make every lookup there walk a long probe sequence; it cannot
/// aim at a keyed hash it does not know. The extra cost is a few nanoseconds per lookup.
type Shard = Mutex<HashMap<MapKey, Entry, RandomState>>;

/// The in-process [`RecordStore`]: sharded maps of records with TTLs and a byte capacity.
pub struct MemoryStore {
    shards: Box<[Shard]>,
    /// `shards.len() - 1`; the shard count is a power of two.
    shard_mask: usize,
    /// Random keys for picking a record's shard; see [`MemoryStore::shard`].
    shard_keys: RandomState,
    capacity: usize,
    /// Bytes charged by live (and not yet collected expired) records; never exceeds `capacity`.
    used: AtomicUsize,
    /// Records held, including expired ones not yet collected.
    records: AtomicUsize,
    /// Answers there was no room for even in the headroom, kept as their status alone.
    answers_kept_as_status: AtomicU64,
    /// The last make-room sweep; see [`ROOM_SWEEP_INTERVAL`]. Locked for the whole of a sweep
    /// (and by a completion waiting out the interval before its own), so a claim that finds it
    /// locked knows one is running or about to. An async lock: a completion waits for it
    /// without blocking a worker thread.
    last_room_sweep: tokio::sync::Mutex<RoomSweep>,
    /// The first shard the next [`MemoryStore::sweep_round`] visits (modulo the shard count).
    sweep_cursor: AtomicUsize,
    /// What the entries' [`Moment`]s count from.
    base: Instant,
}

/// One record as the memory store keeps it.
struct Entry {
    fingerprint: Digest,
    execution_id: u64,
    state: EntryState,
    /// When the record stops existing, whatever its state.
    expires_at: Moment,
    /// Bytes this entry charged against the capacity, returned when it is removed.
    charged: usize,
    /// Wakes `wait_for_change` callers; created by the first waiter and dropped by the wake
    /// that settles the record (see [`Entry::wake`]), so only a record someone waits on while
    /// it is in flight holds one. It is not charged against the capacity.
    notify: Option<Arc<Notify>>,
}

/// Where a record is in its life; see the diagram in `store/mod.rs`.
enum EntryState {
    InFlight {
        /// The holder's [`OwnerToken`] as two words: a `u128` field would align the entry to
        /// 16 bytes and pad the slot.
        owner: [u64; 2],
        lock_until: Moment,
    },
    Released,
    Completed(Completion),
}

/// What the last make-room sweep left to go by.
#[derive(Default)]
struct RoomSweep {
    /// When it began, on the store's clock: every record expired by then has been collected.
    began: Option<Moment>,
    /// When it ended; the next one starts [`ROOM_SWEEP_INTERVAL`] later at the earliest.
    ended: Option<Instant>,
}

/// What one locked attempt at a write decided.
enum Attempt<T> {
    Done(T),
    /// The write needs more room than is free; the caller sweeps (holding no lock) and retries.
    NeedRoom,
}

// === impl MemoryStore ===

impl MemoryStore {
    /// Removes `key`'s record, whatever its state; whether there was a live one. What
    /// [`RecordStore::delete`] does, callable without a runtime (a purge announced by another
    /// replica drops this one's fallback record with it).
    pub fn remove(&self, key: &RecordKey) -> bool {
        let mut map = self.shard(key).lock();
        let now = self.now();
        self.expire_if_due(&mut map, key, now);
        match map.remove(key as &dyn KeyView) {
            Some(mut entry) => {
                self.forget(&mut entry);
                true
            }
            None => false,
        }
    }

    /// Removes the record under `key` unless it is in flight (its lock running or lapsed), in
    /// one step under its shard's lock (see [`RecordStore::delete_settled`]).
    pub fn remove_settled(&self, key: &RecordKey) -> Deletion {
        let mut map = self.shard(key).lock();
        let now = self.now();
        self.expire_if_due(&mut map, key, now);
        let view: &dyn KeyView = key;
        let Some(entry) = map.get(view) else {
            return Deletion::Absent;
        };
        if let EntryState::InFlight { lock_until, .. } = entry.state {
            return Deletion::Running {
                lock_remaining: now.until(lock_until),
            };
        }
        if let Some(mut entry) = map.remove(view) {
            self.forget(&mut entry);
        }
        Deletion::Deleted
    }

    /// A store holding at most `capacity_bytes` (see [`record_overhead`] and
    /// [`super::StoredResponse::size_bytes`] for what counts), split over `shards` shards rounded
    /// up to a power of two (at least 1).
    pub fn new(capacity_bytes: usize, shards: usize) -> Self {
        let count = shards.clamp(1, MAX_SHARDS).next_power_of_two();
        let shards = (0..count)
            .map(|_| Mutex::new(HashMap::default()))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        MemoryStore {
            shards,
            shard_mask: count - 1,
            shard_keys: RandomState::new(),
            capacity: capacity_bytes,
            used: AtomicUsize::new(0),
            records: AtomicUsize::new(0),
            answers_kept_as_status: AtomicU64::new(0),
            last_room_sweep: tokio::sync::Mutex::default(),
            sweep_cursor: AtomicUsize::new(0),
            base: Instant::now(),
        }
    }

    /// The current time as a [`Moment`]. A record operation reads it under its shard's lock:
    /// read before, a claim that waited for the lock could act on a record made by a later
    /// reading, and see its lock run past `lock_ttl` or a deadline not yet passed that had.
    fn now(&self) -> Moment {
        let since = Instant::now().saturating_duration_since(self.base);
        Moment(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// A [`Moment`] as an `Instant`, for timers; far in the future if it would overflow.
    fn instant(&self, moment: Moment) -> Instant {
        let after = Duration::from_nanos(moment.0);
        self.base
            .checked_add(after)
            .or_else(|| self.base.checked_add(FAR_FUTURE))
            .unwrap_or(self.base)
    }

    /// Removes every expired record from every shard and returns how many went.
    ///
    /// Locks one shard at a time, so it may run while requests are served.
    pub fn sweep_expired(&self) -> usize {
        let now = self.now();
        self.shards
            .iter()
            .map(|shard| self.sweep_shard(shard, now))
            .sum()
    }

    /// One background round: removes the expired records of the next `1 / SWEEP_ROUNDS` of the
    /// shards (at least one) and returns how many went. Consecutive rounds walk every shard in
    /// turn, so a record is collected within [`SWEEP_ROUNDS`] rounds of expiring.
    pub fn sweep_round(&self) -> usize {
        let count = self.shards.len();
        let per_round = count.div_ceil(SWEEP_ROUNDS);
        let first = self.sweep_cursor.fetch_add(per_round, Ordering::Relaxed);
        let now = self.now();
        (0..per_round)
            .map(|i| self.sweep_shard(&self.shards[first.wrapping_add(i) & self.shard_mask], now))
            .sum()
    }

    fn sweep_shard(&self, shard: &Shard, now: Moment) -> usize {
        let mut removed = 0;
        let mut map = shard.lock();
        map.retain(|_, entry| {
            if entry.expired(now) {
                self.forget(entry);
                removed += 1;
                false
            } else {
                true
            }
        });
        shrink_if_sparse(&mut *map);
        removed
    }

    /// Spawns a task that calls [`MemoryStore::sweep_round`] every `every` (the server's
    /// sweeper service runs it, and aborts it at shutdown).
    ///
    /// The task holds only a `Weak` reference, so it does not keep the store alive: it ends at
    /// the first tick after the last `Arc` is dropped. Must be called within a Tokio runtime.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> JoinHandle<()> {
        let store: Weak<Self> = Arc::downgrade(self);
        // `interval` panics on a zero period; a sweep per millisecond is already plenty.
        let every = every.max(Duration::from_millis(1));
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
            // After a stall one sweep catches up on everything; a burst of them would not help.
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(store) = store.upgrade() else {
                    break;
                };
                store.sweep_round();
            }
        })
    }

    /// Sweeps to make room for a claim that did not fit, unless a sweep is running or the last
    /// one ended within [`ROOM_SWEEP_INTERVAL`]. A claim that does not sweep goes on as if the
    /// sweep had found nothing: it retries once and is refused if there is still no room.
    fn sweep_for_room(&self) {
        self.sweep_for_room_with(|| {
            self.sweep_expired();
        });
    }

    /// [`MemoryStore::sweep_for_room`] with the sweep given (tests make it slow); returns whether
    /// it ran.
    fn sweep_for_room_with(&self, sweep: impl FnOnce()) -> bool {
        // `try_lock`: a claim that finds a sweep running must not queue behind it and then
        // sweep again. The guard is held across the sweep, which locks shards one at a time;
        // no path takes this lock while holding a shard lock, and `try_lock` never waits.
        let Ok(mut last) = self.last_room_sweep.try_lock() else {
            return false;
        };
        if last
            .ended
            .is_some_and(|end| Instant::now() < end + ROOM_SWEEP_INTERVAL)
        {
            return false;
        }
        self.run_room_sweep(&mut last, sweep);
        true
    }

    /// Makes room for a completion that found no room at `found_full`: once every record that
    /// had expired by then is collected, what it still does not fit in is live records.
    ///
    /// Unlike a refused claim (a 503 the client retries), a completion that gives up is kept
    /// as not replayable for the record's whole ttl, so it does not skip the sweep as a claim
    /// does: it waits for a running sweep and then, unless a sweep that began after
    /// `found_full` has run meanwhile, waits out [`ROOM_SWEEP_INTERVAL`] and sweeps itself.
    /// The wait (at most a running sweep, the interval and its own sweep) falls only on
    /// completions that do not fit a full store; the spacing between sweeps still holds.
    async fn sweep_for_completion(&self, found_full: Moment) {
        self.sweep_for_completion_with(found_full, || {
            self.sweep_expired();
        })
        .await;
    }

    /// [`MemoryStore::sweep_for_completion`] with the sweep given; returns whether it ran.
    async fn sweep_for_completion_with(&self, found_full: Moment, sweep: impl FnOnce()) -> bool {
        // Waiting completions queue here and the first one sweeps; those that found no room
        // before that sweep began then return without sweeping again.
        let mut last = self.last_room_sweep.lock().await;
        if last.began.is_some_and(|began| began >= found_full) {
            return false;
        }
        if let Some(end) = last.ended {
            // Holding the lock: claims meanwhile skip the sweep as the interval has them do.
            tokio::time::sleep_until(end + ROOM_SWEEP_INTERVAL).await;
        }
        self.run_room_sweep(&mut last, sweep);
        true
    }

    /// Runs a make-room sweep with its lock held and notes when it began and ended.
    fn run_room_sweep(&self, last: &mut RoomSweep, sweep: impl FnOnce()) {
        // Read before the sweep reads the clock itself, so `began` never claims more than it did.
        let began = self.now();
        sweep();
        *last = RoomSweep {
            began: Some(began),
            ended: Some(Instant::now()),
        };
    }

    fn shard(&self, key: &RecordKey) -> &Shard {
        &self.shards[self.shard_index(&key.hash)]
    }

    /// The shard for a record hash: the first digest word through SipHash with this store's
    /// random keys. Record hashes are SHA-256 of what clients send, so a client grinding a few
    /// thousand tries per key can fix any dozen bits of them; were those bits the index, it
    /// could pile its records into one shard, whose lock and table would then take all its
    /// traffic while the capacity is sized as if spread. It cannot aim at keys it does not
    /// know. The cost is one more short SipHash per operation (~15 ns; a multiply by a random
    /// odd constant is ~1 ns, but it is linear enough that placements, were they observed,
    /// would give its key away). The map inside hashes the second word with its own keys, so
    /// the two choices stay independent.
    fn shard_index(&self, hash: &Digest) -> usize {
        let mixed = super::keyed_shard_word(&self.shard_keys, hash);
        // Truncating is fine: only the low bits are kept.
        mixed as usize & self.shard_mask
    }

    /// Charges `bytes` if `used` stays within `limit` (at most `capacity`); never lets `used`
    /// exceed `capacity`.
    fn try_charge(&self, bytes: usize, limit: usize) -> bool {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .is_ok()
    }

    /// What new claims may fill the store to: all but its headroom (see
    /// [`CLAIM_HEADROOM_DIVISOR`]).
    fn claim_limit(&self) -> usize {
        self.capacity - self.capacity / CLAIM_HEADROOM_DIVISOR
    }

    /// Books out an entry that has just been removed from its map, and wakes its waiters so they
    /// re-read (and find it gone).
    fn forget(&self, entry: &mut Entry) {
        self.used.fetch_sub(entry.charged, Ordering::Relaxed);
        self.records.fetch_sub(1, Ordering::Relaxed);
        entry.wake();
    }

    /// Removes the record under `key` if it has expired, so callers see expired records as absent.
    fn expire_if_due<S: std::hash::BuildHasher>(
        &self,
        map: &mut HashMap<MapKey, Entry, S>,
        key: &RecordKey,
        now: Moment,
    ) {
        let view: &dyn KeyView = key;
        if map.get(view).is_some_and(|entry| entry.expired(now)) {
            self.collect(map, view);
        }
    }

    /// Removes the record under `view` (one found expired) and gives back what it was charged.
    fn collect<S: std::hash::BuildHasher>(
        &self,
        map: &mut HashMap<MapKey, Entry, S>,
        view: &dyn KeyView,
    ) {
        if let Some(mut entry) = map.remove(view) {
            self.forget(&mut entry);
        }
    }

    /// One locked claim attempt (or renewal: see [`RecordStore::renew`]): acts on an existing
    /// record, or inserts a new one if it fits.
    fn try_claim(&self, req: &ClaimRequest, renewing: bool) -> Attempt<ClaimOutcome> {
        let mut map = self.shard(&req.key).lock();
        let now = self.now();
        // One lookup for a live record; an absent one (a first execution) costs the lookup and
        // the insert, an expired one its removal too.
        let view: &dyn KeyView = &req.key;
        match map.get_mut(view) {
            Some(entry) if !entry.expired(now) => {
                return Attempt::Done(entry.claim_existing(req, now, renewing));
            }
            Some(_) => self.collect(&mut map, view),
            None => {}
        }
        let charge = record_overhead(req.key.tenant.len());
        if !self.try_charge(charge, self.claim_limit()) {
            return Attempt::NeedRoom;
        }
        map.insert(
            MapKey::from(&req.key),
            Entry::new_in_flight(req, now, charge),
        );
        self.records.fetch_add(1, Ordering::Relaxed);
        Attempt::Done(ClaimOutcome::Acquired {
            execution_id: req.execution_id,
            lapsed: false,
        })
    }

    /// One locked completion attempt; `extra` is what the completion adds to the entry's charge.
    fn try_complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: &Completion,
        extra: usize,
        ttl: Duration,
    ) -> Attempt<WriteOutcome> {
        let mut map = self.shard(key).lock();
        let now = self.now();
        let view: &dyn KeyView = key;
        let entry = match map.get_mut(view) {
            Some(entry) if !entry.expired(now) => entry,
            Some(_) => {
                self.collect(&mut map, view);
                return Attempt::Done(WriteOutcome::NotOwner);
            }
            None => return Attempt::Done(WriteOutcome::NotOwner),
        };
        // A lapsed lock does not matter here: until someone re-claims, the owner may still finish.
        if !entry.owned_by(owner) {
            return Attempt::Done(WriteOutcome::NotOwner);
        }
        if !self.try_charge(extra, self.capacity) {
            return Attempt::NeedRoom;
        }
        entry.charged += extra;
        entry.state = EntryState::Completed(completion.clone());
        entry.expires_at = now.after(ttl);
        entry.wake();
        Attempt::Done(WriteOutcome::Applied)
    }

    /// A claim, or a renewal (see [`RecordStore::renew`]), making room once if it does not fit.
    fn claim_or_renew(
        &self,
        req: &ClaimRequest,
        renewing: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        if let Attempt::Done(outcome) = self.try_claim(req, renewing) {
            return Ok(outcome);
        }
        // No lock is held here, so sweeping every shard cannot deadlock with this one. The
        // retry re-reads the record: someone may have created it meanwhile.
        self.sweep_for_room();
        match self.try_claim(req, renewing) {
            Attempt::Done(outcome) => Ok(outcome),
            Attempt::NeedRoom => Err(StoreError::Full {
                used: self.used.load(Ordering::Relaxed),
                capacity: self.capacity,
            }),
        }
    }
}

#[async_trait]
impl RecordStore for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_or_renew(req, false)
    }

    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_or_renew(req, true)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let extra = completion.response_bytes();
        if extra <= self.capacity {
            if let Attempt::Done(outcome) = self.try_complete(key, owner, &completion, extra, ttl) {
                return Ok(outcome);
            }
            let found_full = self.now();
            self.sweep_for_completion(found_full).await;
            if let Attempt::Done(outcome) = self.try_complete(key, owner, &completion, extra, ttl) {
                return Ok(outcome);
            }
        }
        // Still no room for the response once expired records are gone. Refusing the write
        // would leave the record in flight, so after its lock lapses a retry would execute the
        // request a second time; dropping the record would do the same at once. Keeping it as
        // Unreplayable costs no extra bytes and keeps the key spent: retries get a 409 instead
        // of a second execution.
        let status = completion.status();
        match self.try_complete(key, owner, &Completion::Unreplayable { status }, 0, ttl) {
            Attempt::Done(outcome) => {
                if outcome == WriteOutcome::Applied && extra > 0 {
                    self.answers_kept_as_status.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        record = %crate::key::hash_label(&key.hash),
                        status,
                        bytes = extra,
                        "the embedded store is full: the answer is kept as its status alone, and \
                         retries get 409 not-replayable (store.memory.capacity)"
                    );
                }
                Ok(outcome)
            }
            // Unreachable: charging zero bytes always fits. Answer as a full store all the same.
            Attempt::NeedRoom => Err(StoreError::Full {
                used: self.used.load(Ordering::Relaxed),
                capacity: self.capacity,
            }),
        }
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        let mut map = self.shard(key).lock();
        let now = self.now();
        self.expire_if_due(&mut map, key, now);
        match map.get_mut(key as &dyn KeyView) {
            Some(entry) if entry.owned_by(owner) => {
                // Fingerprint, execution id and expiry stay: the next claim re-executes under
                // the same id, and the record lives on until its original deadline.
                entry.state = EntryState::Released;
                entry.wake();
                Ok(WriteOutcome::Applied)
            }
            _ => Ok(WriteOutcome::NotOwner),
        }
    }

    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        let give_up_at = self.now().after(timeout);
        let mut timed_out = false;
        loop {
            let notify: Arc<Notify>;
            let wake_at: Moment;
            let notified = {
                let mut map = self.shard(key).lock();
                let now = self.now();
                self.expire_if_due(&mut map, key, now);
                let Some(entry) = map.get_mut(key as &dyn KeyView) else {
                    return Ok(None);
                };
                let lock_until = match entry.state {
                    EntryState::InFlight { lock_until, .. } if now < lock_until => lock_until,
                    _ => return Ok(Some(entry.record(now))),
                };
                if timed_out || now >= give_up_at {
                    return Ok(Some(entry.record(now)));
                }
                notify = Arc::clone(entry.notify.get_or_insert_with(|| Arc::new(Notify::new())));
                wake_at = lock_until.min(give_up_at);
                // Created under the shard lock: `notify_waiters` reaches a `Notified` from the
                // moment it exists, so a write between unlocking and polling is not lost. The
                // wake takes the handle out of the entry under this same lock, so a waiter
                // either registered before the wake, on the very `Notify` the wake notifies, or
                // locks after it and reads the settled record above (or a newer claim, for
                // which it makes a new handle).
                notify.notified()
            };
            let mut notified = pin!(notified);
            notified.as_mut().enable();
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(self.instant(wake_at)) => {
                    // The timer may fire a hair before `Instant::now()` agrees; decide by which
                    // deadline it was, not by re-reading the clock.
                    timed_out = wake_at >= give_up_at;
                }
            }
        }
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let mut map = self.shard(key).lock();
        let now = self.now();
        self.expire_if_due(&mut map, key, now);
        Ok(map.get(key as &dyn KeyView).map(|entry| entry.record(now)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        Ok(self.remove(key))
    }

    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        Ok(self.remove_settled(key))
    }

    /// Every write is answered at once, in this process: none lands later.
    fn refusals_are_final(&self) -> bool {
        true
    }

    fn usage(&self) -> Option<StoreUsage> {
        Some(StoreUsage {
            records: self.records.load(Ordering::Relaxed),
            bytes: self.used.load(Ordering::Relaxed),
            capacity: self.capacity,
            answers_kept_as_status: self.answers_kept_as_status.load(Ordering::Relaxed),
        })
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("capacity", &self.capacity)
            .field("used", &self.used.load(Ordering::Relaxed))
            .field("records", &self.records.load(Ordering::Relaxed))
            .finish()
    }
}

// === impl Entry ===

impl Entry {
    fn new_in_flight(req: &ClaimRequest, now: Moment, charged: usize) -> Self {
        Entry {
            fingerprint: req.fingerprint,
            execution_id: req.execution_id,
            state: EntryState::InFlight {
                owner: owner_words(req.owner),
                lock_until: now.after(req.lock_ttl),
            },
            // A record must outlive its lock, or it could vanish while its owner still executes.
            expires_at: now.after(req.ttl.max(req.lock_ttl)),
            charged,
            notify: None,
        }
    }

    fn expired(&self, now: Moment) -> bool {
        now >= self.expires_at
    }

    fn owned_by(&self, owner: OwnerToken) -> bool {
        matches!(self.state, EntryState::InFlight { owner: holder, .. } if holder == owner_words(owner))
    }

    /// Claim on a live record: take it over if it is free (released, its lock lapsed, or held
    /// by this very owner: a re-send) and the request is the same one, otherwise report it
    /// unchanged. A renewal takes only a lock this owner holds.
    fn claim_existing(&mut self, req: &ClaimRequest, now: Moment, renewing: bool) -> ClaimOutcome {
        let (free, lapsed) = match self.state {
            EntryState::Released => (!renewing, false),
            EntryState::InFlight { lock_until, owner } => {
                let own = owner == owner_words(req.owner);
                (own || (now >= lock_until && !renewing), !own)
            }
            EntryState::Completed(_) => (false, false),
        };
        // A different request under the same key must not take the record over: the caller
        // answers it 422 from the record it gets back.
        if !free || self.fingerprint != req.fingerprint {
            return ClaimOutcome::Existing(self.record(now));
        }
        self.state = EntryState::InFlight {
            owner: owner_words(req.owner),
            lock_until: now.after(req.lock_ttl),
        };
        // Never shorten a record's life, but make sure it outlives the new lock.
        self.expires_at = self.expires_at.max(now.after(req.ttl.max(req.lock_ttl)));
        ClaimOutcome::Acquired {
            execution_id: self.execution_id,
            lapsed,
        }
    }

    fn record(&self, now: Moment) -> Record {
        let state = match &self.state {
            EntryState::InFlight { lock_until, .. } => RecordState::InFlight {
                lock_remaining: now.until(*lock_until),
            },
            EntryState::Released => RecordState::Released,
            EntryState::Completed(completion) => RecordState::Completed(completion.clone()),
        };
        // A completed record says how long it is kept, as the Redis store's claim does: a local
        // cache in front (tests, and any store stack that puts one there) may copy it that long.
        let expires_in = matches!(state, RecordState::Completed(_))
            .then(|| now.until(self.expires_at))
            .filter(|left| !left.is_zero());
        Record {
            fingerprint: self.fingerprint,
            execution_id: self.execution_id,
            state,
            expires_in,
        }
    }

    /// Wakes every waiter and drops the record's handle. Called under the shard lock whenever
    /// the record stops being in flight (completed, released, removed), which ends every
    /// current wait; each waiter holds its own reference, so taking the handle strands none
    /// (see `wait_for_change`).
    fn wake(&mut self) {
        if let Some(notify) = self.notify.take() {
            notify.notify_waiters();
        }
    }
}

// === impl MapKey ===

/// The map key: tenant and hash, as the trait's `RecordKey` is. It is hashed by digest bytes
/// alone (already uniform) but compared on both parts, so equal hashes under different tenants
/// stay different records.
struct MapKey {
    hash: Digest,
    tenant: Box<str>,
}

/// Lets the maps be searched with a borrowed `RecordKey`, with no `String` clone per lookup.
trait KeyView {
    fn digest(&self) -> &Digest;
    fn tenant(&self) -> &str;
}

impl From<&RecordKey> for MapKey {
    fn from(key: &RecordKey) -> Self {
        MapKey {
            hash: key.hash,
            tenant: key.tenant.as_str().into(),
        }
    }
}

impl KeyView for MapKey {
    fn digest(&self) -> &Digest {
        &self.hash
    }
    fn tenant(&self) -> &str {
        &self.tenant
    }
}

impl KeyView for RecordKey {
    fn digest(&self) -> &Digest {
        &self.hash
    }
    fn tenant(&self) -> &str {
        &self.tenant
    }
}

impl<'a> Borrow<dyn KeyView + 'a> for MapKey {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        self
    }
}

impl Hash for dyn KeyView + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Word 0, through the store's keyed hash, chose the shard; word 1, through the shard's
        // keyed hasher, places the key within it.
        state.write_u64(digest_word(self.digest(), 1));
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.digest() == other.digest() && self.tenant() == other.tenant()
    }
}

impl Eq for dyn KeyView + '_ {}

// `Borrow` requires the owned key to hash and compare exactly as its borrowed view does.
impl Hash for MapKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        Hash::hash(self as &dyn KeyView, state);
    }
}

impl PartialEq for MapKey {
    fn eq(&self, other: &Self) -> bool {
        (self as &dyn KeyView) == (other as &dyn KeyView)
    }
}

impl Eq for MapKey {}

/// Gives back most of a table its records have left. A map never shrinks by itself, but a
/// record is charged for its slot only as a table that grows would hold it (at least 7/16 of
/// the slots filled, see [`record_overhead`]): after a burst of records has expired and been
/// collected, the empty table would stay allocated and uncharged, and the freed capacity could
/// fill with new records on top of it. Holding less than a quarter of what it has room for
/// (7/32 of its slots), the table is rebuilt to fit its records, which fills it above 7/16
/// again (tables of a few slots aside), so their charge covers it. Not sooner: a table
/// just below 7/16 would be rebuilt and then doubled back by the next inserts, one rehash of
/// the shard under its lock each, every sweep; between 7/32 and 7/16 full it may take up to
/// twice what its records are charged for slots. A rebuild moves every record once, about
/// what the insert that doubled the table did, and happens only after at least as many
/// records have gone. (The local cache gives its tables back by the same rule.)
pub(super) fn shrink_if_sparse(table: &mut impl Table) {
    if table.entries() < table.room() / 4 {
        table.shrink(table.entries());
    }
}

/// A collection that keeps the room its entries leave ([`shrink_if_sparse`]).
pub(super) trait Table {
    fn entries(&self) -> usize;
    fn room(&self) -> usize;
    fn shrink(&mut self, to: usize);
}

impl<K: Eq + std::hash::Hash, V, S: BuildHasher> Table for HashMap<K, V, S> {
    fn entries(&self) -> usize {
        self.len()
    }
    fn room(&self) -> usize {
        self.capacity()
    }
    fn shrink(&mut self, to: usize) {
        self.shrink_to(to);
    }
}

impl<T> Table for std::collections::VecDeque<T> {
    fn entries(&self) -> usize {
        self.len()
    }
    fn room(&self) -> usize {
        self.capacity()
    }
    fn shrink(&mut self, to: usize) {
        self.shrink_to(to);
    }
}

/// A point in time as nanoseconds after the store's `base` instant: 8 bytes where an `Instant`
/// takes 16. Each entry holds two, and the map slot (times the table's slack) is most of what a
/// record is charged: 160 bytes per slot with `Instant`s, 144 with these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Moment(u64);

impl Moment {
    /// `self + after`, saturating (a `u64` of nanoseconds spans 584 years).
    fn after(self, after: Duration) -> Moment {
        Moment(
            self.0
                .saturating_add(u64::try_from(after.as_nanos()).unwrap_or(u64::MAX)),
        )
    }

    /// Time from `self` to `later`, zero when `later` is not later.
    fn until(self, later: Moment) -> Duration {
        Duration::from_nanos(later.0.saturating_sub(self.0))
    }
}

/// An [`OwnerToken`] as two words (see `EntryState::InFlight`).
fn owner_words(owner: OwnerToken) -> [u64; 2] {
    [owner.0 as u64, (owner.0 >> 64) as u64]
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::store::{conformance, StoredResponse};

    const SECOND: Duration = Duration::from_secs(1);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_map_slot_stays_small() {
        // Key and entry live inline in the map, and the slot times the table's slack is most of
        // a record's charge: `Instant`s and a `u128` owner made it 160 bytes.
        let slot = std::mem::size_of::<(MapKey, Entry)>();
        assert!(slot <= 144, "a map slot takes {slot} bytes");
        assert_eq!(CHARGE, (slot + 1) * 16 / 7 + 16);
    }

    #[test]
    fn table_hashes_are_keyed_per_map() {
        // A digest's words alone must not decide where it lands: the same key hashes
        // differently in every map (each has its own random keys), so ground keys cannot be
        // aimed at one table slot.
        let store = MemoryStore::new(1 << 20, 4);
        let k = MapKey::from(&key(1));
        let hashes: std::collections::HashSet<u64> = store
            .shards
            .iter()
            .map(|shard| shard.lock().hasher().hash_one(&k))
            .collect();
        assert_eq!(hashes.len(), 4, "every shard map hashes with its own keys");
        let plain = digest_word(&key(1).hash, 1);
        assert!(!hashes.contains(&plain), "the digest word is not the hash");
    }

    /// The shard index each digest gets in `store`.
    fn placement(store: &MemoryStore, digests: &[Digest]) -> Vec<usize> {
        digests
            .iter()
            .map(|&hash| {
                let k = RecordKey {
                    tenant: "t".into(),
                    hash,
                };
                let shard = store.shard(&k);
                store
                    .shards
                    .iter()
                    .position(|s| std::ptr::eq(s, shard))
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn clients_cannot_choose_the_shard() {
        // What grinding buys: digests that agree on any bits a client picks, here the whole
        // low half of the first word. They must still spread, and differently in every store.
        let digests: Vec<Digest> = (0..256u32)
            .map(|n| {
                let mut hash = [0u8; 32];
                hash[4..8].copy_from_slice(&n.to_le_bytes());
                hash
            })
            .collect();
        let stores = [MemoryStore::new(1 << 20, 16), MemoryStore::new(1 << 20, 16)];
        let placements = stores.map(|store| placement(&store, &digests));
        for shards in &placements {
            let mut load = [0usize; 16];
            for &shard in shards {
                load[shard] += 1;
            }
            // 16 a shard on average: fewer than 8 shards used, or more than 64 records in one,
            // has a chance below 1e-20.
            let used = load.iter().filter(|&&n| n > 0).count();
            let most = load.iter().max().copied().unwrap_or(0);
            assert!(used >= 8 && most <= 64, "shard loads {load:?}");
        }
        assert_ne!(
            placements[0], placements[1],
            "two stores put the same digests in the same shards"
        );
    }

    /// What a record of [`key`] is charged before any response.
    const CHARGE: usize = record_overhead(1);

    /// The least capacity whose claims may fill `claims` records of [`key`], its headroom left.
    fn room_for(claims: usize) -> usize {
        let capacity = claims * CHARGE * CLAIM_HEADROOM_DIVISOR / (CLAIM_HEADROOM_DIVISOR - 1);
        (capacity..)
            .find(|c| c - c / CLAIM_HEADROOM_DIVISOR >= claims * CHARGE)
            .unwrap()
    }

    fn key(n: u8) -> RecordKey {
        let mut hash = [0u8; 32];
        // Vary the first word so keys spread over shards, and the last so they differ anyway.
        hash[0] = n;
        hash[31] = n;
        RecordKey {
            tenant: "t".into(),
            hash,
        }
    }

    fn claim_req(key: &RecordKey, ttl: Duration) -> ClaimRequest {
        ClaimRequest {
            key: key.clone(),
            fingerprint: [7; 32],
            owner: OwnerToken::random(),
            execution_id: rand::random(),
            lock_ttl: ttl.min(10 * SECOND),
            ttl,
        }
    }

    fn response(body_len: usize) -> Completion {
        Completion::Response(Arc::new(StoredResponse::new(
            201,
            vec![("content-type", Bytes::from_static(b"text/plain"))],
            Bytes::from(vec![b'x'; body_len]),
        )))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_suite() {
        conformance::run_all(|| async { Arc::new(MemoryStore::new(1 << 20, 4)) }).await;
    }

    /// Racing claims never see a lock longer than it was taken for: each reads the clock under
    /// the shard's lock, so a claim that waited for the lock never reads a record made by a
    /// later reading than its own.
    #[test]
    fn racing_claims_never_see_a_lock_longer_than_its_ttl() {
        let store = MemoryStore::new(1 << 24, 1);
        let lock_ttl = 10 * SECOND;
        let rounds = 20_000u32;
        let seen_longer = std::thread::scope(|scope| {
            let racers: Vec<_> = (0..4u8)
                .map(|_| {
                    let store = &store;
                    scope.spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .build()
                            .expect("runtime");
                        let mut longer = Vec::new();
                        for round in 0..rounds {
                            let mut hash = [0u8; 32];
                            // Words 0 and 1 pick the shard and the slot; vary both.
                            hash[..4].copy_from_slice(&round.to_le_bytes());
                            hash[8..12].copy_from_slice(&round.to_le_bytes());
                            let key = RecordKey {
                                tenant: "t".into(),
                                hash,
                            };
                            let outcome = rt.block_on(store.claim(&claim_req(&key, lock_ttl)));
                            if let Ok(ClaimOutcome::Existing(Record {
                                state: RecordState::InFlight { lock_remaining },
                                ..
                            })) = outcome
                            {
                                longer
                                    .extend((lock_remaining > lock_ttl).then_some(lock_remaining));
                            }
                        }
                        longer
                    })
                })
                .collect();
            racers
                .into_iter()
                .flat_map(|racer| racer.join().expect("racer"))
                .collect::<Vec<_>>()
        });
        assert!(
            seen_longer.is_empty(),
            "locks past lock_ttl: {seen_longer:?}"
        );
    }

    #[test]
    fn shard_count_is_a_power_of_two() {
        assert_eq!(MemoryStore::new(0, 0).shards.len(), 1);
        assert_eq!(MemoryStore::new(0, 1).shards.len(), 1);
        assert_eq!(MemoryStore::new(0, 3).shards.len(), 4);
        assert_eq!(MemoryStore::new(0, 16).shards.len(), 16);
    }

    #[tokio::test(start_paused = true)]
    async fn full_store_refuses_and_keeps_live_records() {
        let store = MemoryStore::new(room_for(3), 4);
        let keys: Vec<_> = (1..=3).map(key).collect();
        for k in &keys {
            let outcome = store.claim(&claim_req(k, 60 * SECOND)).await.unwrap();
            assert!(matches!(outcome, ClaimOutcome::Acquired { .. }));
        }
        let err = store.claim(&claim_req(&key(4), 60 * SECOND)).await;
        match err {
            Err(StoreError::Full { used, capacity }) => {
                assert_eq!(used, 3 * CHARGE);
                assert_eq!(capacity, room_for(3));
            }
            other => panic!("expected Full, got {other:?}"),
        }
        for k in &keys {
            assert!(store.get(k).await.unwrap().is_some(), "live record dropped");
        }
        // An existing record is still answered when the store is full.
        let again = store
            .claim(&claim_req(&keys[0], 60 * SECOND))
            .await
            .unwrap();
        assert!(matches!(again, ClaimOutcome::Existing(_)));
        let usage = store.usage().unwrap();
        assert_eq!(usage.records, 3);
        assert_eq!(usage.bytes, 3 * CHARGE);
    }

    #[tokio::test(start_paused = true)]
    async fn full_store_sweeps_expired_records_to_make_room() {
        let store = MemoryStore::new(room_for(3), 4);
        store.claim(&claim_req(&key(1), 5 * SECOND)).await.unwrap();
        store.claim(&claim_req(&key(2), 60 * SECOND)).await.unwrap();
        store.claim(&claim_req(&key(3), 60 * SECOND)).await.unwrap();
        tokio::time::advance(6 * SECOND).await;
        // Key 1 expired but nobody touched it: it still holds its bytes until swept.
        assert_eq!(store.usage().unwrap().records, 3);
        let outcome = store.claim(&claim_req(&key(4), 60 * SECOND)).await.unwrap();
        assert!(matches!(outcome, ClaimOutcome::Acquired { .. }));
        assert!(store.get(&key(1)).await.unwrap().is_none());
        for n in 2..=4 {
            assert!(store.get(&key(n)).await.unwrap().is_some());
        }
        // Full again, and nothing left to sweep.
        assert!(matches!(
            store.claim(&claim_req(&key(5), 60 * SECOND)).await,
            Err(StoreError::Full { .. })
        ));
        // Refusals do not stop later sweeps: once records expire, the room comes back.
        tokio::time::advance(61 * SECOND).await;
        let outcome = store.claim(&claim_req(&key(5), 60 * SECOND)).await.unwrap();
        assert!(matches!(outcome, ClaimOutcome::Acquired { .. }));
        assert_eq!(store.usage().unwrap().records, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn claim_and_complete_collect_an_expired_record_they_meet() {
        let store = MemoryStore::new(1 << 20, 2);
        let k = key(1);
        let first = claim_req(&k, 5 * SECOND);
        store.claim(&first).await.unwrap();
        tokio::time::advance(5 * SECOND).await;
        // The old owner's completion finds nothing live, and the expired record is gone.
        let done = store
            .complete(
                &k,
                first.owner,
                Completion::Unreplayable { status: 201 },
                SECOND,
            )
            .await
            .unwrap();
        assert_eq!(done, WriteOutcome::NotOwner);
        assert_eq!(store.usage().unwrap().records, 0);
        assert_eq!(store.usage().unwrap().bytes, 0);

        store.claim(&first).await.unwrap();
        tokio::time::advance(5 * SECOND).await;
        // A new claim replaces the expired record: one record, charged once.
        let mut second = claim_req(&k, 5 * SECOND);
        second.owner = OwnerToken(second.owner.0 + 1);
        second.execution_id = first.execution_id + 1;
        let outcome = store.claim(&second).await.unwrap();
        assert_eq!(
            outcome,
            ClaimOutcome::Acquired {
                execution_id: second.execution_id,
                lapsed: false,
            }
        );
        let usage = store.usage().unwrap();
        assert_eq!((usage.records, usage.bytes), (1, CHARGE));
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_absent_and_collected_on_access() {
        let store = MemoryStore::new(1 << 20, 2);
        let k = key(1);
        store.claim(&claim_req(&k, 5 * SECOND)).await.unwrap();
        tokio::time::advance(5 * SECOND).await;
        assert_eq!(store.get(&k).await.unwrap(), None);
        assert_eq!(
            store.usage().unwrap(),
            StoreUsage {
                records: 0,
                bytes: 0,
                capacity: 1 << 20,
                answers_kept_as_status: 0,
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn sweep_rounds_take_a_slice_of_the_shards_and_cover_them_all() {
        let store = MemoryStore::new(1 << 24, 16);
        for n in 1..=160 {
            store.claim(&claim_req(&key(n), SECOND)).await.unwrap();
        }
        store
            .claim(&claim_req(&key(200), 60 * SECOND))
            .await
            .unwrap();
        tokio::time::advance(2 * SECOND).await;
        let removed: Vec<usize> = (0..SWEEP_ROUNDS).map(|_| store.sweep_round()).collect();
        // Shards are picked with random keys: count the expired records the first round's
        // shards (the first eighth) hold, about 20 of the 160.
        let first_slice = (1..=160)
            .filter(|&n| store.shard_index(&key(n).hash) < 16 / SWEEP_ROUNDS)
            .count();
        assert!(
            removed[0] == first_slice && removed[0] > 0 && removed[0] < 160 / 2,
            "one round visits an eighth of the shards ({first_slice} expired there): {removed:?}"
        );
        assert_eq!(removed.iter().sum::<usize>(), 160, "{removed:?}");
        assert_eq!(store.sweep_round(), 0);
        assert_eq!(store.usage().unwrap().records, 1, "the live record stays");
    }

    #[tokio::test(start_paused = true)]
    async fn sweeper_removes_expired_and_stops_with_the_store() {
        let store = Arc::new(MemoryStore::new(1 << 20, 4));
        for n in 1..=5 {
            store.claim(&claim_req(&key(n), 5 * SECOND)).await.unwrap();
        }
        store.claim(&claim_req(&key(6), 60 * SECOND)).await.unwrap();
        let sweeper = store.spawn_sweeper(SECOND);
        // Paused time auto-advances while this sleeps, letting the sweeper tick: the records
        // expire at 5 s, and the 4 shards take a round each (one per tick) from then on.
        tokio::time::sleep(10 * SECOND).await;
        let usage = store.usage().unwrap();
        assert_eq!(usage.records, 1);
        assert_eq!(usage.bytes, CHARGE);
        drop(store);
        tokio::time::timeout(5 * SECOND, sweeper)
            .await
            .expect("sweeper outlived its store")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn response_larger_than_capacity_is_kept_unreplayable() {
        let store = MemoryStore::new(room_for(4), 1);
        let k = key(1);
        let req = claim_req(&k, 60 * SECOND);
        store.claim(&req).await.unwrap();
        let outcome = store
            .complete(&k, req.owner, response(10_000), 60 * SECOND)
            .await
            .unwrap();
        assert_eq!(outcome, WriteOutcome::Applied);
        let record = store.get(&k).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            RecordState::Completed(Completion::Unreplayable { status: 201 })
        );
        assert_eq!(store.usage().unwrap().bytes, CHARGE);
        assert_eq!(store.usage().unwrap().answers_kept_as_status, 1);
    }

    /// New claims stop short of the capacity: the rest is for the answers of the claims already
    /// running. Filled by claims alone (a flood of new keys), the store still keeps a running
    /// claim's answer whole, rather than as its status (which every retry would get as a 409
    /// for the record's whole ttl), and goes on refusing new keys (a 503 the client retries).
    #[tokio::test(start_paused = true)]
    async fn claims_leave_room_for_the_answers_of_running_claims() {
        let store = MemoryStore::new(64 << 10, 4);
        let first = claim_req(&key(0), 60 * SECOND);
        store.claim(&first).await.unwrap();
        let mut claimed = 1;
        for n in 1..=u16::MAX {
            let mut k = key(0);
            k.hash[..2].copy_from_slice(&n.to_be_bytes());
            match store.claim(&claim_req(&k, 60 * SECOND)).await {
                Ok(ClaimOutcome::Acquired { .. }) => claimed += 1,
                Err(StoreError::Full { .. }) => break,
                other => panic!("{other:?}"),
            }
        }
        let used = store.usage().unwrap().bytes;
        assert_eq!(used, claimed * CHARGE);
        assert!(
            used <= store.claim_limit() && used + CHARGE > store.claim_limit(),
            "claims filled {used} of {} bytes",
            64 << 10
        );

        let answer = response(2000);
        let done = store
            .complete(&first.key, first.owner, answer.clone(), 60 * SECOND)
            .await
            .unwrap();
        assert_eq!(done, WriteOutcome::Applied);
        let record = store.get(&first.key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(answer));
        assert_eq!(store.usage().unwrap().answers_kept_as_status, 0);
        assert!(matches!(
            store.claim(&claim_req(&key(200), 60 * SECOND)).await,
            Err(StoreError::Full { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn response_that_fits_after_a_sweep_is_stored() {
        let store = MemoryStore::new(room_for(4), 2);
        // Fill the store with short-lived records, then complete one long-lived record.
        for n in 2..=4 {
            store.claim(&claim_req(&key(n), 5 * SECOND)).await.unwrap();
        }
        let k = key(1);
        let req = claim_req(&k, 60 * SECOND);
        store.claim(&req).await.unwrap();
        tokio::time::advance(6 * SECOND).await;
        let completion = response(100);
        store
            .complete(&k, req.owner, completion.clone(), 60 * SECOND)
            .await
            .unwrap();
        let record = store.get(&k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(completion));
        assert_eq!(store.usage().unwrap().records, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_waits_out_the_room_sweep_interval_rather_than_lose_its_response() {
        let store = MemoryStore::new(room_for(4), 2);
        let k = key(1);
        let req = claim_req(&k, 60 * SECOND);
        store.claim(&req).await.unwrap();
        for n in 2..=4 {
            store.claim(&claim_req(&key(n), 5 * SECOND)).await.unwrap();
        }
        // Just before those expire, a refused claim sweeps and finds nothing to collect.
        tokio::time::advance(5 * SECOND - 10 * MS).await;
        assert!(matches!(
            store.claim(&claim_req(&key(5), 60 * SECOND)).await,
            Err(StoreError::Full { .. })
        ));
        // Now they have expired, uncollected, and the last sweep ended within the interval.
        tokio::time::advance(20 * MS).await;
        assert_eq!(store.usage().unwrap().records, 4);
        let completion = response(100);
        let started = Instant::now();
        let done = store
            .complete(&k, req.owner, completion.clone(), 60 * SECOND)
            .await
            .unwrap();
        assert_eq!(done, WriteOutcome::Applied);
        let record = store.get(&k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(completion));
        assert_eq!(store.usage().unwrap().records, 1);
        // It waited for the rest of the interval, no longer.
        assert_eq!(started.elapsed(), 30 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_waits_for_a_running_room_sweep_rather_than_lose_its_response() {
        let store = Arc::new(MemoryStore::new(room_for(4), 2));
        let k = key(1);
        let req = claim_req(&k, 60 * SECOND);
        store.claim(&req).await.unwrap();
        for n in 2..=4 {
            store.claim(&claim_req(&key(n), 5 * SECOND)).await.unwrap();
        }
        tokio::time::advance(6 * SECOND).await;
        // Stands for a make-room sweep that is running and, begun before the records expired,
        // collects none of them.
        let running = store.last_room_sweep.try_lock().unwrap();
        let completion = response(100);
        let completing = tokio::spawn({
            let (store, k, completion) = (Arc::clone(&store), k.clone(), completion.clone());
            async move {
                store
                    .complete(&k, req.owner, completion, 60 * SECOND)
                    .await
                    .unwrap()
            }
        });
        tokio::time::sleep(MS).await;
        assert!(
            !completing.is_finished(),
            "the completion did not wait for the running sweep"
        );
        drop(running);
        assert_eq!(completing.await.unwrap(), WriteOutcome::Applied);
        let record = store.get(&k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(completion));
        assert_eq!(store.usage().unwrap().records, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn completions_that_queue_behind_a_room_sweep_share_it() {
        let store = MemoryStore::new(1 << 20, 2);
        let swept = std::cell::Cell::new(0);
        let count = || swept.set(swept.get() + 1);
        let found_full = store.now();
        assert!(store.sweep_for_completion_with(found_full, count).await);
        // Found no room before that sweep began: it has collected what they were waiting for.
        assert!(!store.sweep_for_completion_with(found_full, count).await);
        // Found no room after it began: sweeps again, once the interval has passed.
        tokio::time::advance(MS).await;
        let started = Instant::now();
        assert!(store.sweep_for_completion_with(store.now(), count).await);
        assert_eq!(started.elapsed(), ROOM_SWEEP_INTERVAL - MS);
        assert_eq!(swept.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sweep_shrinks_a_table_its_records_have_left() {
        // One shard: one table takes every record.
        let store = MemoryStore::new(1 << 30, 1);
        let random_key = || RecordKey {
            tenant: "t".into(),
            hash: rand::random(),
        };
        let burst = 4096;
        for _ in 0..burst {
            store
                .claim(&claim_req(&random_key(), SECOND))
                .await
                .unwrap();
        }
        for _ in 0..20 {
            store
                .claim(&claim_req(&random_key(), 60 * SECOND))
                .await
                .unwrap();
        }
        assert!(store.shards[0].lock().capacity() > burst);
        tokio::time::advance(2 * SECOND).await;
        assert_eq!(store.sweep_expired(), burst);
        let map = store.shards[0].lock();
        assert_eq!(map.len(), 20);
        // The table's slots (a power of two, 8/7 of its capacity) take no more than its
        // records are charged for slots, as when it had grown to hold them.
        let slots = (map.capacity() * 8 / 7).next_power_of_two();
        let table = slots * (std::mem::size_of::<(MapKey, Entry)>() + 1);
        assert!(
            table <= map.len() * SLOT_BYTES,
            "{slots} slots ({table} bytes) left for {} records",
            map.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn delete_returns_bytes() {
        let store = MemoryStore::new(1 << 20, 2);
        let k = key(1);
        let req = claim_req(&k, 60 * SECOND);
        store.claim(&req).await.unwrap();
        store
            .complete(&k, req.owner, response(500), 60 * SECOND)
            .await
            .unwrap();
        assert!(store.usage().unwrap().bytes > CHARGE + 500);
        assert!(store.delete(&k).await.unwrap());
        assert_eq!(store.usage().unwrap().bytes, 0);
        assert_eq!(store.usage().unwrap().records, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn wait_for_change_sleeps_without_polling_until_timeout() {
        let store = MemoryStore::new(1 << 20, 2);
        let k = key(1);
        store.claim(&claim_req(&k, 60 * SECOND)).await.unwrap();
        let started = Instant::now();
        let record = store.wait_for_change(&k, 5 * SECOND).await.unwrap();
        assert_eq!(started.elapsed(), 5 * SECOND);
        assert!(matches!(
            record.map(|r| r.state),
            Some(RecordState::InFlight { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_for_change_wakes_on_delete() {
        let store = Arc::new(MemoryStore::new(1 << 20, 2));
        let k = key(1);
        store.claim(&claim_req(&k, 60 * SECOND)).await.unwrap();
        let deleter = {
            let (store, k) = (Arc::clone(&store), k.clone());
            tokio::spawn(async move {
                tokio::time::sleep(SECOND).await;
                store.delete(&k).await.unwrap()
            })
        };
        let started = Instant::now();
        assert_eq!(store.wait_for_change(&k, 30 * SECOND).await.unwrap(), None);
        assert_eq!(started.elapsed(), SECOND);
        assert!(deleter.await.unwrap());
    }

    #[test]
    fn room_sweeps_run_one_at_a_time_and_are_spaced_from_their_end() {
        let store = MemoryStore::new(0, 1);
        let mut nested = None;
        let mut about_to_end = None;
        let ran = store.sweep_for_room_with(|| {
            // Outlast the spacing: timed from this sweep's start, a second one would be let in.
            std::thread::sleep(ROOM_SWEEP_INTERVAL + Duration::from_millis(20));
            nested = Some(store.sweep_for_room_with(|| {}));
            about_to_end = Some(Instant::now());
        });
        assert!(ran);
        assert_eq!(nested, Some(false), "a second sweep started while one ran");
        let again = store.sweep_for_room_with(|| {});
        // Real time: the check only holds if this thread was not stalled for a whole interval
        // since the sweep ended.
        if about_to_end.is_some_and(|at| at.elapsed() < ROOM_SWEEP_INTERVAL) {
            assert!(
                !again,
                "a sweep started within the interval after the last one ended"
            );
        }
        std::thread::sleep(ROOM_SWEEP_INTERVAL + Duration::from_millis(10));
        assert!(
            store.sweep_for_room_with(|| {}),
            "no sweep once the interval had passed"
        );
    }

    /// The wake-up handle for `wait_for_change` the record under `key` holds, if any.
    fn wake_handle(store: &MemoryStore, key: &RecordKey) -> Option<Arc<Notify>> {
        store
            .shard(key)
            .lock()
            .get(key as &dyn KeyView)
            .and_then(|entry| entry.notify.clone())
    }

    /// Spawns `count` tasks waiting on `key` for up to a minute, and lets them all register.
    async fn spawn_waiters(
        store: &Arc<MemoryStore>,
        key: &RecordKey,
        count: usize,
    ) -> Vec<JoinHandle<Option<Record>>> {
        let waiters = (0..count)
            .map(|_| {
                let (store, key) = (Arc::clone(store), key.clone());
                tokio::spawn(async move { store.wait_for_change(&key, 60 * SECOND).await.unwrap() })
            })
            .collect();
        // Paused time: the runtime idles (every waiter parked on its handle) before the clock
        // moves on to this sleep's end.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let handle = wake_handle(store, key).expect("a waiter creates the handle");
        // The record's reference, one per waiter, and `handle` itself.
        assert_eq!(Arc::strong_count(&handle), count + 2);
        waiters
    }

    /// Every waiter returns at once (well before its minute) with `state`.
    async fn woken_with(waiters: Vec<JoinHandle<Option<Record>>>, state: &RecordState) {
        for waiter in waiters {
            let record = tokio::time::timeout(SECOND, waiter)
                .await
                .expect("a waiter was stranded")
                .unwrap();
            assert_eq!(record.map(|r| r.state).as_ref(), Some(state));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn settling_a_record_drops_its_wake_handle_and_wakes_every_waiter() {
        let store = Arc::new(MemoryStore::new(1 << 20, 2));
        let k = key(1);
        let first = claim_req(&k, 60 * SECOND);
        store.claim(&first).await.unwrap();
        let waiters = spawn_waiters(&store, &k, 3).await;
        assert_eq!(
            store.release(&k, first.owner).await.unwrap(),
            WriteOutcome::Applied
        );
        assert!(wake_handle(&store, &k).is_none(), "release kept the handle");
        woken_with(waiters, &RecordState::Released).await;

        // Re-claimed: a new waiter makes a new handle, and completion drops that one.
        let second = ClaimRequest {
            owner: OwnerToken(first.owner.0 ^ 1),
            ..first.clone()
        };
        store.claim(&second).await.unwrap();
        let waiters = spawn_waiters(&store, &k, 2).await;
        let done = response(10);
        assert_eq!(
            store
                .complete(&k, second.owner, done.clone(), 60 * SECOND)
                .await
                .unwrap(),
            WriteOutcome::Applied
        );
        assert!(
            wake_handle(&store, &k).is_none(),
            "completion kept the handle"
        );
        woken_with(waiters, &RecordState::Completed(done)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiters_racing_a_settle_are_never_stranded() {
        // Real threads: the waiter registers on one while the owner settles on the other, in
        // either order. Taking the handle in the wake must never leave a waiter on a handle
        // nobody will notify.
        let store = Arc::new(MemoryStore::new(1 << 24, 1));
        for n in 0..300 {
            let k = RecordKey {
                tenant: "t".into(),
                hash: rand::random(),
            };
            let req = claim_req(&k, 60 * SECOND);
            store.claim(&req).await.unwrap();
            let waiter = {
                let (store, k) = (Arc::clone(&store), k.clone());
                tokio::spawn(async move { store.wait_for_change(&k, 60 * SECOND).await.unwrap() })
            };
            if n % 3 == 0 {
                tokio::task::yield_now().await;
            }
            let settled = if n % 2 == 0 {
                store.release(&k, req.owner).await.unwrap()
            } else {
                let done = Completion::Unreplayable { status: 201 };
                store
                    .complete(&k, req.owner, done, 60 * SECOND)
                    .await
                    .unwrap()
            };
            assert_eq!(settled, WriteOutcome::Applied);
            let record = tokio::time::timeout(5 * SECOND, waiter)
                .await
                .unwrap_or_else(|_| panic!("waiter {n} was stranded"))
                .unwrap()
                .expect("the record is kept");
            assert!(!matches!(record.state, RecordState::InFlight { .. }));
            assert!(
                wake_handle(&store, &k).is_none(),
                "round {n} kept the handle"
            );
        }
    }
}
