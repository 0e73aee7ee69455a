//! The local fast path in front of a shared store: a rotating Bloom filter and a bounded cache
//! of completed records — the ones this replica completed, and copies of ones it read completed
//! from the store — so a hot retry is answered without a round trip.
//!
//! Completed records never change, which is what makes this safe: a cached completion is the
//! same bytes the shared store holds until the record's TTL (the cache entry's own deadline) or a
//! purge. A copy of a record read from the store lives only as long as the store said the record
//! has left (`Record::expires_in`), counted from before the read was sent. Correctness never
//! depends on the Bloom filter:
//!
//! - **negative** (`false`): this replica cached no record with this id in the current or
//!   previous window, so the cache cannot hold it; go to the store without touching the cache.
//! - **positive** (`true`): this replica *probably* cached it (false positives at the
//!   configured rate); look in the cache, and go to the store when the cache has nothing.
//!
//! The filter rotates: two generations, each covering one window of `ttl`-bounded length, so it
//! tracks the records that can still be live instead of filling up forever.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bloomfilter::Bloom;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{
    ClaimOutcome, ClaimRequest, Completion, Deletion, Digest, OwnerToken, Record, RecordKey,
    RecordState, RecordStore, StoreError, StoreUsage, WriteOutcome,
};

/// Sizing of the local fast path.
#[derive(Clone, Debug)]
pub struct LocalCacheOptions {
    /// Byte budget of cached completed records.
    pub capacity_bytes: usize,
    /// Records expected per filter window (sizes the Bloom filter).
    pub expected_items: usize,
    /// Target false-positive rate of one filter generation.
    pub false_positive_rate: f64,
    /// How long one filter generation covers; set it to the longest route `ttl`.
    pub window: Duration,
}

impl Default for LocalCacheOptions {
    fn default() -> Self {
        LocalCacheOptions {
            capacity_bytes: 64 << 20,
            expected_items: 1_000_000,
            false_positive_rate: 0.01,
            window: Duration::from_secs(24 * 3600),
        }
    }
}

/// Counters of the fast path, exported as metrics.
#[derive(Debug, Default)]
pub struct LocalCacheStats {
    /// Claims answered from the local cache.
    pub hits: AtomicU64,
    /// Bloom positives the cache could not answer (false positives or evicted entries).
    pub bloom_false_positives: AtomicU64,
    /// Claims where the Bloom filter said "never cached here".
    pub bloom_negatives: AtomicU64,
    /// Completed records read from the store (completed by another replica, or by this one
    /// before it restarted) and kept as local copies.
    pub copied: AtomicU64,
    /// Waits (`on_in_flight: wait`) answered when a claim of this replica ended: no store read.
    pub waits_ended_here: AtomicU64,
    /// Waits answered by what another waiter's poll of the store read.
    pub waits_shared: AtomicU64,
}

struct Filters {
    current: Bloom<Digest>,
    previous: Bloom<Digest>,
    rotated_at: Instant,
    /// How long one generation covers: `options.window` at first, then what
    /// [`CachedStore::set_window`] says (a reload that changes the longest route `ttl`).
    window: Duration,
    /// A shorter window set by a reload, and from when it holds: entries cached under the
    /// longer one (their life up to it) must stay findable until they expire.
    shrink: Option<(Duration, Instant)>,
}

/// A completed record held locally (only completed records are: they never change).
struct CacheEntry {
    tenant: String,
    fingerprint: Digest,
    execution_id: u64,
    completion: Completion,
    expires_at: Instant,
    /// Whether a drop of every copy ([`CachedStore::forget_copies`]) takes it.
    held: Held,
    size: usize,
    /// When the entry was inserted, in its shard's count: tells its place in `order` from a
    /// stale place left by an earlier entry of the same record.
    seq: u64,
}

/// One shard of the cache: its own map, completion order and byte budget.
#[derive(Default)]
struct Cache {
    map: HashMap<Digest, CacheEntry>,
    /// Record hashes in insertion order, with the `seq` they were inserted under.
    order: VecDeque<(Digest, u64)>,
    bytes: usize,
    next_seq: u64,
    /// Purges of a record of this shard so far ([`CachedStore::forget`]).
    purges: u64,
    /// The last [`RECENT_PURGES`] purges: each record hash with the count its purge brought
    /// `purges` to. Tells a purge of this very record from one of another record of the shard.
    recent_purges: VecDeque<(Digest, u64)>,
    /// Times every copy was dropped so far ([`CachedStore::forget_copies`]).
    copy_resets: u64,
}

/// The entry of `key` kept for the completion of `owner`'s claim, whose write is retried or
/// was given up on (`Held::Unstored`, `Held::GivenUp`); another entry of the record (a later
/// execution's, even under the same execution id after a takeover, or a copy) is not that
/// completion's to settle.
fn own_entry<'a>(
    cache: &'a mut Cache,
    key: &RecordKey,
    owner: OwnerToken,
) -> Option<&'a mut CacheEntry> {
    let owner = Owner::of(owner);
    cache.map.get_mut(&key.hash).filter(|e| {
        e.tenant == key.tenant
            && matches!(e.held, Held::Unstored { owner: o, .. } | Held::GivenUp { owner: o }
                if o == owner)
    })
}

/// What a check of the completions given up on dropped ([`CachedStore::check_given_up`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GivenUpCheck {
    /// The store holds this very completion: its write landed after all.
    pub landed: usize,
    /// The store holds another execution's completion: the key ran again elsewhere.
    pub replaced: usize,
}

impl std::ops::AddAssign for GivenUpCheck {
    fn add_assign(&mut self, other: Self) {
        self.landed += other.landed;
        self.replaced += other.replaced;
    }
}

/// Purges a shard remembers by record ([`Cache::recent_purges`]).
const RECENT_PURGES: usize = 64;

impl Cache {
    /// Evicts completions whose write was given up (`Held::GivenUp`: dead-lettered, so their
    /// answers are on disk for `--reconcile`), oldest first, until the shard holds `limit`
    /// bytes at most. Returns how many went.
    /// The bytes the shard holds once what may go has gone: copies over `budget`, then
    /// completions given up on past [`OVERFULL_FACTOR`] times it. What is left is what the
    /// store never confirmed (see [`CachedStore::overfull`]).
    fn pinned_bytes(&mut self, budget: usize, now: Instant) -> usize {
        if self.bytes > budget {
            self.evict_to(budget, now);
        }
        let limit = budget.saturating_mul(OVERFULL_FACTOR);
        if self.bytes > limit {
            let gone = self.evict_given_up_to(limit);
            if gone > 0 {
                tracing::warn!(gone, "answers whose store write was given up (they are in the dead-letter file) evicted from the local cache past twice its budget");
            }
        }
        self.bytes
    }

    fn evict_given_up_to(&mut self, limit: usize) -> usize {
        let mut gone = 0;
        let mut places = std::mem::take(&mut self.order);
        places.retain(|&(hash, seq)| {
            if self.bytes <= limit {
                return true;
            }
            match self.map.entry(hash) {
                Entry::Occupied(e)
                    if e.get().seq == seq && matches!(e.get().held, Held::GivenUp { .. }) =>
                {
                    self.bytes -= e.remove().size;
                    gone += 1;
                    false
                }
                Entry::Occupied(e) if e.get().seq == seq => true,
                // A stale place: dropped with the rest.
                _ => false,
            }
        });
        self.order = places;
        gone
    }

    /// Evicts entries, oldest first, until the shard holds `budget` bytes at most, but for
    /// completions the store may not hold that still live (see [`CachedStore::remember`]).
    fn evict_to(&mut self, budget: usize, now: Instant) {
        let mut kept = Vec::new();
        while self.bytes > budget {
            let Some((oldest, seq)) = self.order.pop_front() else {
                break;
            };
            // A stale place (the entry was dropped, or cached again later) evicts nothing.
            if let Entry::Occupied(entry) = self.map.entry(oldest) {
                if entry.get().seq == seq {
                    let e = entry.get();
                    if e.held != Held::Copy && e.expires_at > now {
                        kept.push((oldest, seq));
                        continue;
                    }
                    self.bytes -= entry.remove().size;
                }
            }
        }
        // Still the oldest, in their order.
        for place in kept.into_iter().rev() {
            self.order.push_front(place);
        }
    }

    /// Gives back the room of a table that emptied (a hash table never shrinks as entries go):
    /// a shard that held many small answers and now holds a few large ones kept the slots of
    /// all the small ones, which no budget charges, and the heap outgrew `capacity` by up to
    /// about 80%. Once under a quarter full, as the embedded store does (see its
    /// `shrink_if_sparse`); the order queue likewise.
    fn shrink_if_sparse(&mut self) {
        super::memory::shrink_if_sparse(&mut self.map);
        super::memory::shrink_if_sparse(&mut self.order);
    }

    /// Whether `hash` may have been purged since the shard's count was `since`: yes if one of
    /// the purges since was of it, or if more purges came than the shard remembers.
    fn purged_since(&self, hash: &Digest, since: u64) -> bool {
        if self.purges == since {
            return false;
        }
        let remembered_from = self.recent_purges.front().map_or(u64::MAX, |(_, n)| *n);
        remembered_from > since + 1
            || self
                .recent_purges
                .iter()
                .any(|(h, n)| *n > since && h == hash)
    }
}

/// A shard's counts at the moment a read or write went out to the store. What comes back is
/// kept only if the shard still has them when it is inserted (checked under the shard's lock,
/// where the counts change): a purge of a record of the shard, or for a copy also a drop of
/// every copy, may have been meant for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    purges: u64,
    copy_resets: u64,
}

/// Where an entry comes from, with the [`Mark`] taken before its data left for the store.
#[derive(Clone, Copy, Debug)]
enum Origin {
    /// Completed here, and the store took the write: a copy of a stored record like any other.
    /// Not kept across a purge of its shard or a drop of every copy: the write may have landed
    /// before a purge that the drop stands for.
    Stored(Mark),
    /// Completed here by `owner`'s claim, and the store failed to take the write (it is
    /// retried in the background): not kept across a purge of its shard. A drop of every copy
    /// leaves it, since it is the only trace of the completion until the write lands.
    Unstored { mark: Mark, owner: OwnerToken },
    /// Read completed from the store: not kept across a purge of its shard or a drop of every
    /// copy.
    Copy(Mark),
}

/// Why an entry is held, which says whether a drop of every copy takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// The store has the record (read from it, or completed here and written to it): a purge
    /// of it may be missed while the purge channel is down, so
    /// [`CachedStore::forget_copies`] drops it.
    Copy,
    /// Completed here by `owner`'s claim, the write still being retried: kept by a drop of
    /// every copy, so a retry here replays it instead of executing again, until the retrier
    /// stores it ([`CachedStore::completion_stored`]). `copy_resets` is its shard's count from
    /// before the first write went out.
    Unstored { copy_resets: u64, owner: Owner },
    /// Completed here by `owner`'s claim, and dead-lettered without knowing whether the store
    /// took it ([`CachedStore::completion_given_up`]): kept as `Unstored` is, until the store
    /// is found to hold this very completion ([`CachedStore::check_given_up`]).
    GivenUp { owner: Owner },
}

/// The owner token of the claim an entry's completion ended, which tells the entry of one
/// execution from that of a takeover after its lock lapsed (same record, same execution id).
/// 32 of the token's random bits, so [`Held`] stays 16 bytes and every entry as large as it
/// was (the local cache's memory bound counts slots): two claims of one record, around one
/// takeover, share them once in 2^32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owner(u32);

impl Owner {
    fn of(token: OwnerToken) -> Self {
        Owner(token.0 as u32)
    }
}

/// What an entry costs beyond its response and tenant: its map slot (twice, for the slack a hash
/// table carries after it doubles) and its places in `order` (which may hold stale places and
/// spare capacity up to about four per entry). Charged so the byte budget bounds the memory the
/// cache really takes, not only the responses in it.
const ENTRY_OVERHEAD: usize = 2 * (std::mem::size_of::<(Digest, CacheEntry)>() + 1)
    + 4 * std::mem::size_of::<(Digest, u64)>();

/// Byte budget per cache shard the shard count aims at. One map holding a whole 64 MiB cache
/// (~200k records) stalled its worker thread for ~250 ms each time churn made it grow or
/// rehash — long enough for Redis calls in flight to time out and open the circuit breaker.
/// Shards of about 1 MiB keep each such step well under a millisecond.
const CACHE_SHARD_BYTES: usize = 1 << 20;
/// Most cache shards.
const MAX_CACHE_SHARDS: usize = 64;

/// What a claim this replica acquired will need at completion to build the cached record.
#[derive(Clone, Copy)]
struct Pending {
    fingerprint: Digest,
    execution_id: u64,
    deadline: Instant,
    /// The shard's purge count before the claim went out.
    purges: u64,
}

/// A [`RecordStore`] that answers repeated completed records from memory.
pub struct CachedStore<S> {
    inner: S,
    options: LocalCacheOptions,
    filters: Mutex<Filters>,
    /// Shards picked by the record hash; each has `capacity_bytes / shards.len()` bytes.
    cache: Box<[Mutex<Cache>]>,
    /// Keys of the hash that picks a shard, random per store.
    shard_keys: std::hash::RandomState,
    pending: Mutex<PendingClaims>,
    /// Waiters for the end of a claim of this replica's, woken when it completes or releases.
    local_ends: LocalEnds,
    /// Completions whose first write was not applied (refused, or failed and retried): record
    /// hash, owner, and the shard's purge count before their claim went out. What the retrier
    /// later finds gone is kept unless the key was purged since its claim
    /// ([`CachedStore::keep_lost`]). The oldest go first past [`MAX_UNSETTLED`].
    unsettled: Mutex<VecDeque<(Digest, u128, u64)>>,
    /// The last Bloom fill ratio counted, and when.
    fill: Mutex<Option<(Instant, f64)>>,
    stats: Arc<LocalCacheStats>,
    /// Set while [`CachedStore::check_given_up`] runs: one at a time, as the purge channel may
    /// be subscribed again sooner than a check of many entries against a slow store ends.
    checking_given_up: AtomicBool,
    /// Asked for while a check ran: the running one goes round once more.
    recheck_given_up: AtomicBool,
    /// Set when a completion is given up on; cleared by a check that finds none in the cache,
    /// so the periodic check does not scan a cache that holds none.
    may_hold_given_up: AtomicBool,
    /// Whether the cache held over [`OVERFULL_FACTOR`] times its capacity when last counted,
    /// and when that was (milliseconds since `born`); see [`CachedStore::overfull`].
    overfull: AtomicBool,
    overfull_counted_ms: AtomicU64,
    born: Instant,
}

/// A record a retry is answered from without a claim: completed, or in flight under a lock
/// with time left.
fn settled_or_held(record: &Record) -> bool {
    match record.state {
        RecordState::Completed(_) => true,
        RecordState::InFlight { lock_remaining } => !lock_remaining.is_zero(),
        RecordState::Released => false,
    }
}

/// A cache holding this many times its capacity refuses new claims (see
/// [`CachedStore::overfull`]).
const OVERFULL_FACTOR: usize = 2;

/// How often the bytes held are counted again for [`CachedStore::overfull`].
const OVERFULL_RECOUNT_MS: u64 = 100;

/// How long a counted Bloom fill ratio is reported before the filter is counted again.
const FILL_RECOUNT_EVERY: Duration = Duration::from_secs(1);

/// Pending claims kept at most (claims whose outcome never came back are pruned past their
/// lock): about 200 bytes each with their index, so some 25 MiB when full. Past it a new claim
/// is not kept, and [`RecordStore::own_claim`] cannot answer for it during an outage.
const MAX_PENDING: usize = 1 << 17;

/// This replica's claims not completed or released yet, by record hash (then owner: a hash
/// rarely has more than one), so [`RecordStore::own_claim`] is one lookup. Claims whose outcome
/// never came back (an unknown outcome keeps its lock) stay until pruned past their lock:
/// whenever the map has doubled since the last prune, so it holds about twice the live claims.
/// A prune that leaves it three quarters full is not run again for [`FULL_PRUNE_PAUSE`], so
/// claims meanwhile do not each walk the whole of it.
struct PendingClaims {
    by_hash: HashMap<Digest, Vec<(u128, Pending)>>,
    len: usize,
    /// The size at which the next prune runs.
    prune_at: usize,
    /// No prune before this (set when one left the map full).
    pause_until: Option<Instant>,
}

/// Size below which the pending claims are never pruned.
const PENDING_PRUNE_FLOOR: usize = 1024;

/// How long a prune that left the pending claims three quarters full holds off the next one.
const FULL_PRUNE_PAUSE: Duration = Duration::from_millis(100);

impl PendingClaims {
    fn new() -> Self {
        PendingClaims {
            by_hash: HashMap::new(),
            len: 0,
            prune_at: PENDING_PRUNE_FLOOR,
            pause_until: None,
        }
    }

    /// Records `owner`'s claim of `hash` (replacing its earlier one: a renewal).
    fn insert(&mut self, hash: Digest, owner: u128, pending: Pending, now: Instant) {
        if self.len >= self.prune_at.min(MAX_PENDING)
            && self.pause_until.is_none_or(|until| now >= until)
        {
            self.prune(now);
        }
        let claims = self.by_hash.entry(hash).or_default();
        if let Some(slot) = claims.iter_mut().find(|(o, _)| *o == owner) {
            slot.1 = pending;
        } else if self.len < MAX_PENDING {
            claims.push((owner, pending));
            self.len += 1;
        } else if claims.is_empty() {
            self.by_hash.remove(&hash);
        }
    }

    /// Drops the claims past their locks.
    fn prune(&mut self, now: Instant) {
        let mut len = 0;
        self.by_hash.retain(|_, claims| {
            claims.retain(|(_, p)| p.deadline > now);
            len += claims.len();
            !claims.is_empty()
        });
        self.len = len;
        self.prune_at = (len * 2).max(PENDING_PRUNE_FLOOR);
        // Mostly live claims: the next prune would free little, so it waits.
        self.pause_until = (len >= MAX_PENDING * 3 / 4).then(|| now + FULL_PRUNE_PAUSE);
    }

    fn get(&self, hash: &Digest, owner: u128) -> Option<Pending> {
        self.by_hash
            .get(hash)?
            .iter()
            .find(|(o, _)| *o == owner)
            .map(|&(_, p)| p)
    }

    fn get_mut(&mut self, hash: &Digest, owner: u128) -> Option<&mut Pending> {
        self.by_hash
            .get_mut(hash)?
            .iter_mut()
            .find(|(o, _)| *o == owner)
            .map(|(_, p)| p)
    }

    fn remove(&mut self, hash: &Digest, owner: u128) -> Option<Pending> {
        let claims = self.by_hash.get_mut(hash)?;
        let at = claims.iter().position(|(o, _)| *o == owner)?;
        let (_, pending) = claims.swap_remove(at);
        if claims.is_empty() {
            self.by_hash.remove(hash);
        }
        self.len -= 1;
        Some(pending)
    }

    /// What is left of the longest live claim of `hash`.
    fn longest_left(&self, hash: &Digest, now: Instant) -> Option<Duration> {
        self.by_hash
            .get(hash)?
            .iter()
            .filter(|(_, p)| p.deadline > now)
            .map(|(_, p)| p.deadline - now)
            .max()
    }

    /// The live claims of `hash`: each one's shard purge count before it went out, and what
    /// is left of it.
    fn live(&self, hash: &Digest, now: Instant) -> Vec<(u64, Duration)> {
        self.live_claims(hash, now)
            .map(|(_, p)| (p.purges, p.deadline - now))
            .collect()
    }

    /// The claims of `hash` whose lock has not lapsed by `now`, with their owners.
    fn live_claims(
        &self,
        hash: &Digest,
        now: Instant,
    ) -> impl Iterator<Item = (u128, Pending)> + '_ {
        self.by_hash
            .get(hash)
            .into_iter()
            .flatten()
            .filter(move |(_, p)| p.deadline > now)
            .copied()
    }
}

/// The waiters of [`RecordStore::wait_for_change`] by record hash, so the end of an execution
/// this replica runs (its completion or release) wakes them at once: a duplicate that arrives
/// while its original runs here waits without polling the store, and is answered from the
/// local copy as soon as the original's answer is remembered. A claim acquired here wakes them
/// too: a waiter that looked before its outcome came back stops polling. While the original
/// runs elsewhere, one waiter of a hash polls the store for all of them on this replica.
#[derive(Default)]
struct LocalEnds {
    /// Waiters registered, so an end with nobody waiting takes no lock.
    waiting: AtomicUsize,
    /// What the waiters of each hash share.
    by_hash: Mutex<HashMap<Digest, WaitSlot>>,
}

/// The waiters of one record hash on this replica.
struct WaitSlot {
    /// Wakes them: the end or acquisition of a claim here, a purge, the end of a poll.
    notify: Arc<Notify>,
    /// How many wait.
    waiters: usize,
    /// Whether one of them is polling the store for the others ([`LocalEnds::lead`]).
    polling: bool,
    /// Polls ended so far, and what the last one read when it read a change (a record no
    /// longer held, or none): what the others take instead of a read of their own.
    polls: u64,
    read: Option<(u64, Option<Record>)>,
}

/// One waiter's registration in [`LocalEnds`]; dropping it unregisters.
struct LocalEndWatch<'a> {
    ends: &'a LocalEnds,
    hash: Digest,
    notify: Arc<Notify>,
}

/// The poll of the waiter that leads the waiters of a hash; dropping it (the poll over, or
/// the waiter gone) lets another lead and wakes them.
struct PollLead<'a> {
    ends: &'a LocalEnds,
    hash: Digest,
}

impl LocalEnds {
    /// Registers a waiter for the end of a local claim of `hash`. A `notified()` future
    /// created from it before the claim is looked up hears an end that comes after the look.
    fn watch(&self, hash: Digest) -> LocalEndWatch<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let notify = {
            let mut by_hash = self.by_hash.lock();
            let slot = by_hash.entry(hash).or_insert_with(|| WaitSlot {
                notify: Arc::default(),
                waiters: 0,
                polling: false,
                polls: 0,
                read: None,
            });
            slot.waiters += 1;
            slot.notify.clone()
        };
        LocalEndWatch {
            ends: self,
            hash,
            notify,
        }
    }

    /// Wakes every waiter of `hash`. Called once the claim is no longer pending: a waiter that
    /// found it pending registered before the look, so the count read here includes it.
    fn announce(&self, hash: &Digest) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(slot) = self.by_hash.lock().get(hash) {
            slot.notify.notify_waiters();
        }
    }

    /// Wakes every waiter.
    fn announce_all(&self) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        for slot in self.by_hash.lock().values() {
            slot.notify.notify_waiters();
        }
    }

    /// The poll of `hash`'s store record, for the waiter that takes it: `Ok` when none is
    /// polling, `Err` with the count of polls ended so far when another is (the waiter then
    /// waits for it, and takes what it read: [`LocalEnds::read_since`]).
    fn lead(&self, hash: Digest) -> Result<PollLead<'_>, u64> {
        // The caller's watch keeps the slot there.
        if let Some(slot) = self.by_hash.lock().get_mut(&hash) {
            if slot.polling {
                return Err(slot.polls);
            }
            slot.polling = true;
        }
        Ok(PollLead { ends: self, hash })
    }

    /// What a poll of `hash` that ended after the first `polls` read, when it read a change.
    fn read_since(&self, hash: &Digest, polls: u64) -> Option<Option<Record>> {
        let by_hash = self.by_hash.lock();
        match &by_hash.get(hash)?.read {
            Some((ended, record)) if *ended > polls => Some(record.clone()),
            _ => None,
        }
    }
}

impl PollLead<'_> {
    /// Leaves what the poll read for the others, when it read a change (not a record still
    /// held: each waiter has its own deadline, and one whose wait goes on polls next).
    fn read(&self, record: &Option<Record>) {
        let changed = !matches!(
            record,
            Some(Record {
                state: RecordState::InFlight { lock_remaining },
                ..
            }) if !lock_remaining.is_zero()
        );
        if let Some(slot) = self.ends.by_hash.lock().get_mut(&self.hash) {
            slot.read = changed.then(|| (slot.polls + 1, record.clone()));
        }
    }
}

impl Drop for PollLead<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.ends.by_hash.lock().get_mut(&self.hash) {
            slot.polling = false;
            slot.polls += 1;
            slot.notify.notify_waiters();
        }
    }
}

/// Announces the end of a claim of `hash` when dropped ([`LocalEnds::announce`]).
struct AnnounceOnDrop<'a> {
    ends: &'a LocalEnds,
    hash: Digest,
}

impl Drop for AnnounceOnDrop<'_> {
    fn drop(&mut self) {
        self.ends.announce(&self.hash);
    }
}

impl Drop for LocalEndWatch<'_> {
    fn drop(&mut self) {
        let mut by_hash = self.ends.by_hash.lock();
        if let Entry::Occupied(mut slot) = by_hash.entry(self.hash) {
            slot.get_mut().waiters -= 1;
            if slot.get().waiters == 0 {
                slot.remove();
            }
        }
        // A stampede over many keys leaves no large empty table behind.
        super::memory::shrink_if_sparse(&mut *by_hash);
        drop(by_hash);
        self.ends.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Unsettled completions remembered at most; one forgotten falls back to the shard's recent
/// purges.
const MAX_UNSETTLED: usize = 4096;

// === impl CachedStore ===

impl<S: RecordStore> CachedStore<S> {
    /// Wraps `inner` with a fast path sized by `options`.
    pub fn new(inner: S, options: LocalCacheOptions) -> Result<Self, String> {
        let make = || {
            Bloom::new_for_fp_rate(options.expected_items.max(1), options.false_positive_rate)
                .map_err(|e| format!("bloom filter: {e}"))
        };
        let filters = Filters {
            current: make()?,
            previous: make()?,
            rotated_at: Instant::now(),
            window: options.window,
            shrink: None,
        };
        let shards = (options.capacity_bytes / CACHE_SHARD_BYTES).clamp(1, MAX_CACHE_SHARDS);
        Ok(CachedStore {
            inner,
            options,
            filters: Mutex::new(filters),
            cache: (0..shards).map(|_| Mutex::new(Cache::default())).collect(),
            shard_keys: std::hash::RandomState::new(),
            pending: Mutex::new(PendingClaims::new()),
            local_ends: LocalEnds::default(),
            unsettled: Mutex::new(VecDeque::new()),
            fill: Mutex::new(None),
            stats: Arc::default(),
            checking_given_up: AtomicBool::new(false),
            recheck_given_up: AtomicBool::new(false),
            may_hold_given_up: AtomicBool::new(false),
            overfull: AtomicBool::new(false),
            overfull_counted_ms: AtomicU64::new(0),
            born: Instant::now(),
        })
    }

    /// Whether the cache holds over [`OVERFULL_FACTOR`] times its capacity: only completions
    /// the store never confirmed stay past a shard's budget (every other entry is evicted as
    /// the next one comes in, or by the count), so that is at least the capacity in such answers, each kept
    /// whatever the budget as the only trace of its answer. A store that takes claims but
    /// keeps failing their completions (a script of the active version that raises on
    /// complete, a Redis at `maxmemory` that still fits the small claims) would otherwise pin
    /// one response per execution here for its whole `ttl`, past any bound. New claims are
    /// refused instead, as a full store (never forwarded, whatever the outage policy): nothing
    /// more runs whose answer could not be kept. Counted again at most every
    /// [`OVERFULL_RECOUNT_MS`], so a claim pays an atomic read and, now and then, a walk of the
    /// shard totals.
    fn overfull(&self, now: Instant) -> bool {
        let ms =
            u64::try_from(now.saturating_duration_since(self.born).as_millis()).unwrap_or(u64::MAX);
        let counted = self.overfull_counted_ms.load(Ordering::Relaxed);
        if ms.saturating_sub(counted) >= OVERFULL_RECOUNT_MS
            && self
                .overfull_counted_ms
                .compare_exchange(counted, ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            // A shard over its budget holds such answers, or copies they were until the retrier
            // stored them: those go now, so the count is of what is pinned.
            let budget = self.shard_budget();
            let held: usize = self
                .cache
                .iter()
                .map(|shard| shard.lock().pinned_bytes(budget, now))
                .sum();
            let full = held > self.options.capacity_bytes.saturating_mul(OVERFULL_FACTOR);
            if self.overfull.swap(full, Ordering::Relaxed) != full {
                if full {
                    tracing::error!(held, capacity = self.options.capacity_bytes, "the local cache holds twice its capacity in answers the store never confirmed; new claims are refused as a full store until they are stored or expire");
                } else {
                    tracing::info!(held, "the local cache has room again; claims are taken");
                }
            }
        }
        self.overfull.load(Ordering::Relaxed)
    }

    /// The cache shard holding `hash` (see [`super::keyed_shard_word`]): a client grinding
    /// keys could otherwise crowd one shard and flush its entries on purpose.
    fn shard(&self, hash: &Digest) -> &Mutex<Cache> {
        let mixed = super::keyed_shard_word(&self.shard_keys, hash);
        // Truncating is fine: only the remainder is kept.
        &self.cache[mixed as usize % self.cache.len()]
    }

    /// Bytes one cache shard may hold.
    fn shard_budget(&self) -> usize {
        self.options.capacity_bytes / self.cache.len()
    }

    /// Sets how long one filter generation covers (the longest route `ttl`), so a key this
    /// replica completed stays findable for its whole `ttl` after a reload that raised one.
    ///
    /// A shorter window takes over only once two of the longer ones have passed: an entry
    /// cached under the longer window (completed before the reload, or by a request that
    /// started before it) lives up to that long, and may be the only trace of a completion
    /// whose write to the shared store is still being retried; forgetting it early could let
    /// the key execute again.
    pub fn set_window(&self, window: Duration) {
        let mut filters = self.filters.lock();
        if window >= filters.window {
            filters.window = window;
            filters.shrink = None;
        } else if filters.shrink.is_none_or(|(pending, _)| pending != window) {
            // (The same shorter window set again, by a reload of something else, keeps its
            // time: it is the longer window's entries that are waited for.)
            let from = Instant::now() + filters.window * 2;
            filters.shrink = Some((window, from));
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Fast-path counters.
    pub fn stats(&self) -> Arc<LocalCacheStats> {
        self.stats.clone()
    }

    /// Fraction of bits set in the current filter generation (0.0 to 1.0), counted at most
    /// once a second: the count walks the whole filter (up to a gigabyte) under the lock every
    /// claim takes, and `/metrics` needs no token.
    pub fn bloom_fill_ratio(&self) -> f64 {
        let mut last = self.fill.lock();
        if let Some((at, ratio)) = *last {
            if at.elapsed() < FILL_RECOUNT_EVERY {
                return ratio;
            }
        }
        let ratio = {
            let filters = self.filters.lock();
            let bits = filters.current.as_slice();
            if bits.is_empty() {
                0.0
            } else {
                let set: u64 = bits.iter().map(|b| u64::from(b.count_ones())).sum();
                set as f64 / (bits.len() as f64 * 8.0)
            }
        };
        *last = Some((Instant::now(), ratio));
        ratio
    }

    /// Drops a record from the local cache (purge), and keeps a read or write of any record of
    /// its shard that is out now from putting it back (one of another key only costs a cache
    /// miss). The filter keeps its bit; a stale positive only costs a cache lookup.
    pub fn forget(&self, key: &RecordKey) {
        let mut cache = self.shard(&key.hash).lock();
        cache.purges += 1;
        let count = cache.purges;
        cache.recent_purges.push_back((key.hash, count));
        if cache.recent_purges.len() > RECENT_PURGES {
            cache.recent_purges.pop_front();
        }
        if let Some(e) = cache.map.remove(&key.hash) {
            cache.bytes -= e.size;
        }
        drop(cache);
        // A wait on a claim of this replica's hears of the purge and asks the store from then on.
        self.local_ends.announce(&key.hash);
    }

    /// Whether `hash` is among its shard's last [`RECENT_PURGES`] purges.
    fn recently_purged(&self, hash: &Digest) -> bool {
        let cache = self.shard(hash).lock();
        cache.recent_purges.iter().any(|(h, _)| h == hash)
    }

    /// The counts of `hash`'s shard now, to take before a read or write goes out.
    fn mark(&self, hash: &Digest) -> Mark {
        let cache = self.shard(hash).lock();
        Mark {
            purges: cache.purges,
            copy_resets: cache.copy_resets,
        }
    }

    fn bloom_says_maybe(&self, hash: &Digest) -> bool {
        let mut filters = self.filters.lock();
        let now = Instant::now();
        if let Some((window, from)) = filters.shrink {
            if now >= from {
                filters.window = window;
                filters.shrink = None;
            }
        }
        if now.duration_since(filters.rotated_at) >= filters.window {
            let fresh = Bloom::new_for_fp_rate(
                self.options.expected_items.max(1),
                self.options.false_positive_rate,
            );
            if let Ok(fresh) = fresh {
                filters.previous = std::mem::replace(&mut filters.current, fresh);
                filters.rotated_at = now;
            }
        }
        filters.current.check(hash) || filters.previous.check(hash)
    }

    /// A claim whose owner holds the key here already is a renewal, sent only while that
    /// execution still runs in this process. One the store failed still proves that much: the
    /// claim counts as held here for another lock from now, so during an outage longer than the
    /// lock a retry on this replica is refused as in flight ([`RecordStore::own_claim`]) rather
    /// than run beside it under the outage policy.
    fn still_running(&self, req: &ClaimRequest) {
        let mut pending = self.pending.lock();
        if let Some(p) = pending.get_mut(&req.key.hash, req.owner.0) {
            p.deadline = p.deadline.max(Instant::now() + req.lock_ttl);
        }
    }

    /// What is left of a claim of this replica's on `key`, for a wait that began at the shard
    /// counts `start`: none once a purge of the shard since (or a drop of every copy) has sent
    /// the wait to the store for good (`store_only`), as the record it waits on may be gone
    /// while the claim still runs here.
    fn own_claim_left(
        &self,
        key: &RecordKey,
        start: Mark,
        store_only: &mut bool,
    ) -> Option<Duration> {
        *store_only = *store_only || self.mark(&key.hash) != start;
        if *store_only {
            return None;
        }
        let claims = self.pending.lock().live(&key.hash, Instant::now());
        if claims.is_empty() {
            return None;
        }
        // A claim whose key was purged since it went out holds nothing to wait on here, though
        // its execution may still run: the purge came before this wait began (else the marks
        // above differ), so the store is asked from now on, as after a purge during the wait.
        let cache = self.shard(&key.hash).lock();
        let left = claims
            .iter()
            .filter(|(since, _)| !cache.purged_since(&key.hash, *since))
            .map(|&(_, left)| left)
            .max();
        *store_only = left.is_none();
        left
    }

    fn cached(&self, key: &RecordKey) -> Option<Record> {
        let mut cache = self.shard(&key.hash).lock();
        let now = Instant::now();
        let hit = cache
            .map
            .get(&key.hash)
            .map(|e| (e.tenant == key.tenant, e.expires_at <= now));
        match hit {
            Some((true, false)) => cache.map.get(&key.hash).map(|e| Record {
                fingerprint: e.fingerprint,
                execution_id: e.execution_id,
                state: RecordState::Completed(e.completion.clone()),
                expires_in: Some(e.expires_at - now),
            }),
            Some((_, true)) => {
                if let Some(e) = cache.map.remove(&key.hash) {
                    cache.bytes -= e.size;
                }
                None
            }
            _ => None,
        }
    }

    /// Keeps a local copy of a completed record until `expires_at`, unless its shard saw a purge
    /// (or, for a copy, a drop of every copy) since `origin`'s mark. A record in any other state
    /// is not kept: it may still change. Returns whether it was kept.
    fn remember(
        &self,
        key: &RecordKey,
        record: Record,
        expires_at: Instant,
        origin: Origin,
    ) -> bool {
        let RecordState::Completed(completion) = record.state else {
            return false;
        };
        let size = ENTRY_OVERHEAD + key.tenant.len() + completion.response_bytes();
        let budget = self.shard_budget();
        // An entry already expired (a copy whose life, counted from before a long wait, ran
        // out while waiting) would only take budget from live ones. A completion the store may
        // not hold is kept whatever its size (a shard's budget is 1/64 of the cache, 1 MiB by
        // default, less than the largest replayable response): it may be the only trace of its
        // answer, and copies make room for it.
        let unstored = matches!(origin, Origin::Unstored { .. });
        // One clock read for the whole insertion: it runs on every completion and copy.
        let now = Instant::now();
        if (size > budget && !unstored) || expires_at <= now {
            return false;
        }
        // Set before the entry is visible, so a claim that finds the entry's bit unset can only
        // be one that would not have found the entry either (a bit set for an entry then not
        // kept only costs a cache lookup).
        self.filters.lock().current.set(&key.hash);
        let mut cache = self.shard(&key.hash).lock();
        // Checked under the lock the counts change under, so a purge either came before (and
        // the entry is not kept) or comes after (and finds it).
        let (held, unchanged) = match origin {
            Origin::Unstored { mark, owner } => (
                Held::Unstored {
                    copy_resets: mark.copy_resets,
                    owner: Owner::of(owner),
                },
                // Only a purge of this record takes the trace: one of another record of the
                // shard meanwhile has nothing to do with it, and dropping the only trace of an
                // answer the store may lack would let a retry here execute it again.
                !cache.purged_since(&key.hash, mark.purges),
            ),
            Origin::Stored(mark) | Origin::Copy(mark) => (
                Held::Copy,
                cache.purges == mark.purges && cache.copy_resets == mark.copy_resets,
            ),
        };
        // A copy read from the store never replaces a live entry: one completed here says the
        // same and may be the only trace of a write still being retried.
        let live = |e: &CacheEntry| e.expires_at > now;
        let read = matches!(origin, Origin::Copy(_));
        if !unchanged || (read && cache.map.get(&key.hash).is_some_and(live)) {
            return false;
        }
        let seq = cache.next_seq;
        cache.next_seq += 1;
        let entry = CacheEntry {
            tenant: key.tenant.clone(),
            fingerprint: record.fingerprint,
            execution_id: record.execution_id,
            completion,
            expires_at,
            held,
            size,
            seq,
        };
        if let Some(old) = cache.map.insert(key.hash, entry) {
            cache.bytes -= old.size;
        }
        cache.order.push_back((key.hash, seq));
        cache.bytes += size;
        // Oldest first: entries are evicted in completion order, which approximates expiry order
        // (per shard; records spread evenly over the shards).
        // A completion the store may not hold (its write still retried, or given up on) is
        // never evicted while it lives: it is the only thing here that stops a retry from
        // executing again, and there are few (the retry queue bounds the first kind, an outage
        // the second). It counts against the budget, so copies make room for it. Once its ttl
        // has passed it goes like any other entry: a retry then executes again anyway, and
        // clients rarely retry a key they were answered for, so no lookup would remove it.
        cache.evict_to(budget, now);
        // Keep the order queue from growing without bound after removals.
        if cache.order.len() > cache.map.len() * 2 + 1024 {
            let Cache { map, order, .. } = &mut *cache;
            order.retain(|(h, seq)| map.get(h).is_some_and(|e| e.seq == *seq));
        }
        cache.shrink_if_sparse();
        true
    }

    /// Keeps a copy of `record`, read from the store by a call sent at `sent` with `mark` taken
    /// before it, when it is completed elsewhere (another replica, or this one before a restart)
    /// and the store told its life: for no longer than that life counted from `sent` (the
    /// store's copy lives at least as long), and not if a purge came while the call was out.
    fn keep_copy(&self, key: &RecordKey, record: &Record, sent: Instant, mark: Mark) {
        if let (RecordState::Completed(_), Some(life)) = (&record.state, record.expires_in) {
            if self.remember(key, record.clone(), sent + life, Origin::Copy(mark)) {
                self.stats.copied.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Drops every entry of a record the store has: copies read from it, and completions of
    /// this replica the store took. Keeps only the completions whose write is still being
    /// retried, or was given up on (each may be the only trace of its answer). Called whenever
    /// the purge channel is subscribed again: purges announced while it was not listening were
    /// missed, and these entries are what they would have dropped. Returns how many went.
    pub fn forget_copies(&self) -> usize {
        let mut dropped = 0;
        let now = Instant::now();
        for shard in self.cache.iter() {
            let mut cache = shard.lock();
            // A copy whose read is out now, or a completion whose write is out now and then
            // lands, is not kept when it comes back.
            cache.copy_resets += 1;
            let Cache { map, bytes, .. } = &mut *cache;
            map.retain(|_, e| {
                // An expired entry of any kind goes too: it answers nothing any longer.
                let gone = e.held == Held::Copy || e.expires_at <= now;
                if gone {
                    *bytes -= e.size;
                    dropped += 1;
                }
                !gone
            });
            cache.shrink_if_sparse();
        }
        // The purges missed may have been of a record waited on here.
        self.local_ends.announce_all();
        dropped
    }

    /// What the completion retrier tells this cache: a completion that lost its key is dropped
    /// ([`CachedStore::completion_taken_over`]), one a retry stored becomes a copy that a missed purge can
    /// take ([`CachedStore::completion_stored`]), one given up on without knowing whether the
    /// store took it stays until the store is found to hold it
    /// ([`CachedStore::completion_given_up`]), and one whose record is gone is kept as such
    /// ([`CachedStore::keep_lost`]).
    pub fn retry_hooks(self: &Arc<Self>) -> super::retry::LocalHooks {
        let (taken_over, stored, given_up, lost) =
            (self.clone(), self.clone(), self.clone(), self.clone());
        super::retry::LocalHooks {
            taken_over: Arc::new(move |key: &RecordKey, owner: OwnerToken| {
                taken_over.completion_taken_over(key, owner)
            }),
            stored: Arc::new(move |key: &RecordKey, owner: OwnerToken| {
                stored.completion_stored(key, owner)
            }),
            given_up: Arc::new(move |key: &RecordKey, owner: OwnerToken| {
                given_up.completion_given_up(key, owner)
            }),
            lost: Arc::new(move |job: &super::retry::PendingCompletion| lost.keep_lost(job)),
        }
    }

    /// Keeps `job`, a completion of this replica the store refused, as given up on: its record
    /// is gone (a failover lost the claim while the backend ran) or could not be read, so the
    /// entry is the answer's only trace, and a retry here replays it rather than execute again.
    /// Not when the key was purged here since its claim went out: a purged key is claimable
    /// afresh. (A purge before the claim has no bearing on it; for a completion no longer
    /// remembered, any purge of the key the shard remembers counts.)
    pub fn keep_lost(&self, job: &super::retry::PendingCompletion) {
        let claimed = {
            let mut unsettled = self.unsettled.lock();
            unsettled
                .iter()
                .position(|(hash, owner, _)| *hash == job.key.hash && *owner == job.owner.0)
                .and_then(|i| unsettled.remove(i))
                .map(|(_, _, purges)| purges)
        };
        let purged = match claimed {
            Some(since) => self
                .shard(&job.key.hash)
                .lock()
                .purged_since(&job.key.hash, since),
            None => self.recently_purged(&job.key.hash),
        };
        if purged {
            return;
        }
        let record = Record {
            fingerprint: job.fingerprint,
            execution_id: job.execution_id,
            state: RecordState::Completed(job.completion.clone()),
            expires_in: None,
        };
        let mark = self.mark(&job.key.hash);
        let expires_at = Instant::now() + job.ttl;
        let origin = Origin::Unstored {
            mark,
            owner: job.owner,
        };
        if self.remember(&job.key, record, expires_at, origin) {
            self.completion_given_up(&job.key, job.owner);
        }
    }

    /// The store took this replica's completion of `key` (by `owner`'s claim) on a retry,
    /// after its first write failed: the entry kept meanwhile is from now on a copy of a stored
    /// record, which [`CachedStore::forget_copies`] drops. It goes at once instead when every
    /// copy was dropped since the first write went out: the write may have landed before a
    /// purge that drop stood for (a retry here then reads the record from the store).
    pub fn completion_stored(&self, key: &RecordKey, owner: OwnerToken) {
        let mut cache = self.shard(&key.hash).lock();
        let resets = cache.copy_resets;
        let Some(entry) = own_entry(&mut cache, key, owner) else {
            return;
        };
        let Held::Unstored { copy_resets, .. } = entry.held else {
            return;
        };
        if copy_resets == resets {
            entry.held = Held::Copy;
        } else if let Some(e) = cache.map.remove(&key.hash) {
            cache.bytes -= e.size;
        }
    }

    /// The retrier dead-lettered this replica's completion of `key` (by `owner`'s claim)
    /// without knowing whether the store took it: nothing will report it stored now. The entry
    /// is neither dropped nor made a copy, as either would let a retry here execute the key
    /// again whenever the store does not hold the completion (the write never landed, and the
    /// lock has lapsed or soon will), while this replica knows the answer. It stays until the
    /// store is found to hold it ([`CachedStore::check_given_up`]), a purge reaches it, or its
    /// ttl ends.
    pub fn completion_given_up(&self, key: &RecordKey, owner: OwnerToken) {
        let mut cache = self.shard(&key.hash).lock();
        if let Some(entry) = own_entry(&mut cache, key, owner) {
            entry.held = Held::GivenUp {
                owner: Owner::of(owner),
            };
            self.may_hold_given_up.store(true, Ordering::Release);
        }
    }

    /// The store refused this replica's completion of `key` (by `owner`'s claim) because a
    /// newer execution holds the key (its lock lapsed and was taken over): the entry kept for
    /// it while its write was retried goes, so a retry here reads the store and replays the
    /// newer answer, as every other replica does. Only that entry: the newer execution may be
    /// this replica's too, its claim still running or its answer kept here while its own
    /// write is retried, the only trace of it. Nor is it a purge: the record stands, and this
    /// replica's claims on it still count as held.
    pub fn completion_taken_over(&self, key: &RecordKey, owner: OwnerToken) {
        let mut cache = self.shard(&key.hash).lock();
        if own_entry(&mut cache, key, owner).is_some() {
            if let Some(e) = cache.map.remove(&key.hash) {
                cache.bytes -= e.size;
            }
        }
    }

    /// Reads the record of every completion given up on ([`CachedStore::completion_given_up`])
    /// from the store, and drops the entry of each whose record the store holds completed: this
    /// very completion (its write landed), or another execution's (the key ran again
    /// elsewhere; the store's answer is what every other replica replays). A retry here then
    /// reads it from the store, where a purge takes it, as it would anywhere else. One the
    /// store does not hold completed (or that cannot be read) stays: it is the only trace of
    /// its answer. Returns what went, and says so in the log. Called when the purge channel is
    /// subscribed again, when Redis is back and purges may have been missed, and every so often
    /// ([`CachedStore::recheck_given_up_every`]).
    pub async fn check_given_up(&self) -> GivenUpCheck {
        let found = self.check_given_up_all().await;
        if found.landed > 0 {
            tracing::info!(
                landed = found.landed,
                "dead-lettered completions found in redis after all (their writes landed); their \
                 local entries now follow redis"
            );
        }
        if found.replaced > 0 {
            tracing::warn!(
                replaced = found.replaced,
                "dead-lettered completions whose keys ran again elsewhere (redis holds another \
                 execution's answer); their local entries now follow redis"
            );
        }
        found
    }

    /// Checks the completions given up on every `period` ([`CachedStore::check_given_up`]),
    /// for the life of the process. Besides when Redis comes back: the key of one whose record
    /// was lost may run again on another replica at any time after, and this replica would
    /// replay its own answer for the record's whole ttl while every other replays the new one.
    pub async fn recheck_given_up_every(&self, period: Duration) {
        loop {
            tokio::time::sleep(period).await;
            self.check_given_up().await;
        }
    }

    async fn check_given_up_all(&self) -> GivenUpCheck {
        // One at a time. One asked for meanwhile (the channel subscribed again: the store may
        // answer now what it failed to before) makes the running one go round once more.
        self.recheck_given_up.store(true, Ordering::Release);
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let mut dropped = GivenUpCheck::default();
        loop {
            if self.checking_given_up.swap(true, Ordering::AcqRel) {
                return dropped;
            }
            {
                let _done = Done(&self.checking_given_up);
                while self.recheck_given_up.swap(false, Ordering::AcqRel) {
                    dropped += self.check_given_up_once().await;
                }
            }
            // One asked for between the last round and the flag's clearing found a check
            // running and left it to it: taken up here.
            if !self.recheck_given_up.load(Ordering::Acquire) {
                return dropped;
            }
        }
    }

    async fn check_given_up_once(&self) -> GivenUpCheck {
        // Cleared before the scan: one given up on during it sets it again.
        if !self.may_hold_given_up.swap(false, Ordering::AcqRel) {
            return GivenUpCheck::default();
        }
        let now = Instant::now();
        let given_up: Vec<(RecordKey, Completion)> = self
            .cache
            .iter()
            .flat_map(|shard| {
                let cache = shard.lock();
                cache
                    .map
                    .iter()
                    // An expired one answers nothing any longer; eviction takes it.
                    .filter(|(_, e)| matches!(e.held, Held::GivenUp { .. }) && e.expires_at > now)
                    .map(|(hash, e)| {
                        let key = RecordKey {
                            tenant: e.tenant.clone(),
                            hash: *hash,
                        };
                        (key, e.completion.clone())
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        if !given_up.is_empty() {
            // Those the store does not hold stay; the next check finds out which.
            self.may_hold_given_up.store(true, Ordering::Release);
        }
        let mut dropped = GivenUpCheck::default();
        for (key, completion) in given_up {
            let landed = match self.inner.get(&key).await {
                Ok(Some(Record {
                    state: RecordState::Completed(stored),
                    ..
                })) => stored == completion,
                _ => continue,
            };
            let mut cache = self.shard(&key.hash).lock();
            // Still the entry that was read for (not purged meanwhile, nor cached anew).
            let same = cache.map.get(&key.hash).is_some_and(|e| {
                matches!(e.held, Held::GivenUp { .. })
                    && e.tenant == key.tenant
                    && e.completion == completion
            });
            if same {
                if let Some(e) = cache.map.remove(&key.hash) {
                    cache.bytes -= e.size;
                    if landed {
                        dropped.landed += 1;
                    } else {
                        dropped.replaced += 1;
                    }
                }
            }
        }
        dropped
    }

    /// Records held and bytes used by the local cache.
    pub fn cache_usage(&self) -> (usize, usize) {
        self.cache.iter().fold((0, 0), |(records, bytes), shard| {
            let shard = shard.lock();
            (records + shard.map.len(), bytes + shard.bytes)
        })
    }
}

impl<S: RecordStore> CachedStore<S> {
    /// A live claim of `req`'s key and request (its fingerprint) this replica holds under
    /// another owner, whose key was not purged since it went out: an execution of the same
    /// request running here now.
    fn running_here(&self, req: &ClaimRequest) -> Option<(u128, Pending)> {
        let key = &req.key;
        let running: Vec<(u128, Pending)> = self
            .pending
            .lock()
            .live_claims(&key.hash, Instant::now())
            .filter(|(owner, p)| *owner != req.owner.0 && p.fingerprint == req.fingerprint)
            .collect();
        let cache = self.shard(&key.hash).lock();
        running
            .into_iter()
            .find(|(_, p)| !cache.purged_since(&key.hash, p.purges))
    }

    /// The store created `req`'s record anew while this replica still runs the key under
    /// `owner`'s claim (`running`): it lost the record (a restart without persistence, a
    /// failover before the replica had the claim). Run, the retry would execute the key beside
    /// the execution running here. Instead its claim is given up and the record claimed again
    /// for the running execution, under its owner token and execution id, so that its answer
    /// is stored and replayed; the retry is answered as a duplicate of a running request. The
    /// release, the removal of the released record and the claim are three calls: a retry on
    /// another replica between them may still run the key, as it may on any other replica
    /// after such a loss.
    async fn give_back(&self, req: &ClaimRequest, owner: u128, running: Pending) -> ClaimOutcome {
        let original = ClaimRequest {
            key: req.key.clone(),
            fingerprint: running.fingerprint,
            owner: OwnerToken(owner),
            execution_id: running.execution_id,
            lock_ttl: req.lock_ttl,
            ttl: req.ttl,
        };
        let claimed_again = async {
            if self.inner.release(&req.key, req.owner).await.ok()? != WriteOutcome::Applied {
                return None;
            }
            self.inner.delete_settled(&req.key).await.ok()?;
            match self.inner.claim(&original).await.ok()? {
                ClaimOutcome::Acquired { execution_id, .. } => {
                    Some(execution_id == running.execution_id)
                }
                ClaimOutcome::Existing(_) => Some(false),
            }
        }
        .await
        .unwrap_or(false);
        let record = crate::key::hash_label(&req.key.hash);
        if claimed_again {
            tracing::warn!(
                %record,
                execution_id = running.execution_id,
                "the store had lost the record of a key this replica is running (a restart \
                 without persistence, a failover); claimed again for the running execution, \
                 and its retry told to wait rather than run it beside it"
            );
        } else {
            tracing::warn!(
                %record,
                execution_id = running.execution_id,
                "the store had lost the record of a key this replica is running; its retry is \
                 told to wait, but the record could not be claimed again for the running \
                 execution: a retry elsewhere may run the key"
            );
        }
        ClaimOutcome::Existing(Record {
            fingerprint: running.fingerprint,
            execution_id: running.execution_id,
            state: RecordState::InFlight {
                lock_remaining: running.deadline.saturating_duration_since(Instant::now()),
            },
            expires_in: None,
        })
    }

    /// [`RecordStore::claim`], or with `renewal` [`RecordStore::renew`], which goes to the
    /// store beneath as a renewal too.
    async fn claim_or_renew(
        &self,
        req: &ClaimRequest,
        renewal: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        if self.bloom_says_maybe(&req.key.hash) {
            if let Some(record) = self.cached(&req.key) {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(ClaimOutcome::Existing(record));
            }
            self.stats
                .bloom_false_positives
                .fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.bloom_negatives.fetch_add(1, Ordering::Relaxed);
        }
        let mark = self.mark(&req.key.hash);
        let sent = Instant::now();
        // A renewal (the owner claiming again) goes through: its execution is already running.
        let owner_claims_again = || {
            self.pending
                .lock()
                .get(&req.key.hash, req.owner.0)
                .is_some()
        };
        if !renewal && self.overfull(sent) && !owner_claims_again() {
            // Nothing new runs; a retry of a key the store holds is still answered (a replay,
            // or a 409 while it runs elsewhere).
            // Anything else (nothing, a released record, a lapsed lock, a store that fails)
            // is a claim to make, and none is made: a full store, which no outage policy
            // forwards.
            let full = || StoreError::Full {
                used: self.cache_usage().1,
                capacity: self.options.capacity_bytes,
            };
            return match self.inner.get(&req.key).await {
                Ok(Some(record)) if settled_or_held(&record) => {
                    self.keep_copy(&req.key, &record, sent, mark);
                    Ok(ClaimOutcome::Existing(record))
                }
                Ok(_) | Err(StoreError::Unavailable(_)) => Err(full()),
                Err(e) => Err(e),
            };
        }
        let sent_on = if renewal {
            self.inner.renew(req).await
        } else {
            self.inner.claim(req).await
        };
        let outcome = match sent_on {
            Ok(outcome) => outcome,
            Err(e) => {
                self.still_running(req);
                return Err(e);
            }
        };
        // Created anew (the request's own execution id: an absent record, not a released one)
        // while this replica runs the key: the store lost the record.
        if let ClaimOutcome::Acquired { execution_id, .. } = outcome {
            if !renewal && execution_id == req.execution_id {
                if let Some((owner, running)) = self.running_here(req) {
                    return Ok(self.give_back(req, owner, running).await);
                }
            }
        }
        if let ClaimOutcome::Existing(record) = &outcome {
            self.keep_copy(&req.key, record, sent, mark);
        }
        if let ClaimOutcome::Acquired { execution_id, .. } = outcome {
            let now = Instant::now();
            let entry = Pending {
                fingerprint: req.fingerprint,
                execution_id,
                deadline: now + req.lock_ttl,
                purges: mark.purges,
            };
            self.pending
                .lock()
                .insert(req.key.hash, req.owner.0, entry, now);
            // A wait that looked before this claim's outcome came back is polling the store.
            self.local_ends.announce(&req.key.hash);
        }
        Ok(outcome)
    }
}

#[async_trait]
impl<S: RecordStore> RecordStore for CachedStore<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_or_renew(req, false).await
    }

    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_or_renew(req, true).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        // The claim stays pending while the write is out and until its answer is remembered:
        // a retry here meanwhile, its claim refused by a store that fails, finds one of the two
        // (`own_claim`, then `local_copy`) and is not run beside this execution.
        let pending = self.pending.lock().get(&key.hash, owner.0);
        let mark = self.mark(&key.hash);
        // The store's record lives `ttl` from when it takes the write, no earlier than now: the
        // local copy, counted from before the write, never outlives it.
        let expires_at = Instant::now() + ttl;
        let written = self
            .inner
            .complete(key, owner, completion.clone(), ttl)
            .await;
        // Remember the outcome when it was stored, and also when the store failed: it is the
        // backend's real answer, so replaying it here is right while the write is retried (and
        // the only trace of it until the retrier lands it: see `completion_stored`).
        // Any failed write is retried (`Corrupt`: a reply this version cannot read, which an
        // operator's script version may give), so any keeps the trace.
        // A refused one is not kept here: the retrier reads the record once to tell why, and
        // keeps it here only when nobody else holds the key (`CachedStore::keep_lost`).
        let origin = match written {
            Ok(WriteOutcome::Applied) => Some(Origin::Stored(mark)),
            // Counted from the claim: a purge of the record while it ran (forced, or of a
            // lock that lapsed) made the key claimable afresh, and a trace kept here would
            // replay this answer for its ttl instead.
            Err(_) => Some(Origin::Unstored {
                mark: Mark {
                    purges: pending.map_or(mark.purges, |p| p.purges),
                    ..mark
                },
                owner,
            }),
            Ok(WriteOutcome::NotOwner) => None,
        };
        if !matches!(written, Ok(WriteOutcome::Applied)) {
            if let Some(p) = &pending {
                let mut unsettled = self.unsettled.lock();
                if unsettled.len() >= MAX_UNSETTLED {
                    unsettled.pop_front();
                }
                unsettled.push_back((key.hash, owner.0, p.purges));
            }
        }
        if let (Some(origin), Some(p)) = (origin, pending) {
            let record = Record {
                fingerprint: p.fingerprint,
                execution_id: p.execution_id,
                state: RecordState::Completed(completion),
                expires_in: None,
            };
            self.remember(key, record, expires_at, origin);
        }
        self.pending.lock().remove(&key.hash, owner.0);
        self.local_ends.announce(&key.hash);
        written
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.pending.lock().remove(&key.hash, owner.0);
        // Once the store has it (or failed to): a waiter woken sooner would read the record
        // still in flight and go back to polling. Also when this call is dropped on the way
        // (its request gone): its waiters no longer find the claim here, and must not sleep on
        // it until its lock would have lapsed.
        let _announce = AnnounceOnDrop {
            ends: &self.local_ends,
            hash: key.hash,
        };
        self.inner.release(key, owner).await
    }

    /// While a claim of this replica's own holds the key, the wait asks the store nothing: the
    /// claim's end (its completion or release here) or acquisition wakes it ([`LocalEnds`]),
    /// and only once the lock it took (renewed while it runs) has lapsed does it poll the
    /// store. A completion ended here is answered from the local copy. Polling the store, one
    /// waiter of a hash polls for all of them here ([`LocalEnds::lead`]). A purge of a record of
    /// the key's shard (or a drop of every copy) sends the wait to the store for good: the
    /// record it waits on may be gone while the claim still runs here.
    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        let watch = self.local_ends.watch(key.hash);
        let end = Instant::now() + timeout;
        let start = self.mark(&key.hash);
        let mut store_only = false;
        'wait: loop {
            // Made before the look at the pending claims, so it hears what happens after it.
            let heard = watch.notify.notified();
            tokio::pin!(heard);
            heard.as_mut().enable();
            let now = Instant::now();
            let held_here = self.own_claim_left(key, start, &mut store_only);
            if let Some(left) = held_here.filter(|_| now < end) {
                tokio::select! {
                    _ = &mut heard => {
                        if let Some(record) = self.cached(key) {
                            self.stats.waits_ended_here.fetch_add(1, Ordering::Relaxed);
                            return Ok(Some(record));
                        }
                    }
                    _ = tokio::time::sleep(left.min(end - now)) => {}
                }
                continue;
            }
            let mark = self.mark(&key.hash);
            let sent = Instant::now();
            let left = end.saturating_duration_since(sent);
            // A wait that ends on a completed record (another replica's execution, waited
            // for) keeps a copy, as a claim that finds one does: the next retry here needs no
            // round trip. Its life is counted from before the wait began, earlier than the read
            // that told it.
            let keep = |record: &Option<Record>| {
                if let Some(read) = record {
                    self.keep_copy(key, read, sent, mark);
                }
            };
            match self.local_ends.lead(key.hash) {
                // Polling the store, a claim of this replica's may still be heard of: one whose
                // outcome came back after the look above (its reply raced this wait's claim).
                Ok(lead) => {
                    let poll = self.inner.wait_for_change(key, left);
                    tokio::pin!(poll);
                    let record = loop {
                        tokio::select! {
                            biased;
                            record = &mut poll => break record?,
                            _ = &mut heard, if !store_only => {
                                // Armed again before the looks, so it hears what comes after.
                                heard.set(watch.notify.notified());
                                heard.as_mut().enable();
                                if let Some(record) = self.cached(key) {
                                    self.stats.waits_ended_here.fetch_add(1, Ordering::Relaxed);
                                    return Ok(Some(record));
                                }
                                if self.own_claim_left(key, start, &mut store_only).is_some() {
                                    continue 'wait;
                                }
                                // Anything else (another poll's end, a renewal, a claim whose
                                // outcome this replica could not keep, a purge: the poll reads
                                // what it left) leaves the poll be.
                            }
                        }
                    };
                    // Kept before the others are woken, so they find it.
                    keep(&record);
                    lead.read(&record);
                    return Ok(record);
                }
                // Another waiter here polls the store for the record: this one waits for that
                // poll to end and takes what it read (a completed record from the local copy
                // it kept), or polls next; on its own deadline it reads once itself.
                Err(polls) => tokio::select! {
                    _ = &mut heard => {
                        let shared = self.cached(key).map(Some).or_else(|| {
                            self.local_ends.read_since(&key.hash, polls)
                        });
                        if let Some(record) = shared {
                            self.stats.waits_shared.fetch_add(1, Ordering::Relaxed);
                            return Ok(record);
                        }
                        continue;
                    }
                    _ = tokio::time::sleep(left) => {
                        let record = self.inner.wait_for_change(key, Duration::ZERO).await?;
                        keep(&record);
                        return Ok(record);
                    }
                },
            }
        }
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        match self.cached(key) {
            Some(r) => Ok(Some(r)),
            None => self.inner.get(key).await,
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.forget(key);
        let deleted = self.inner.delete(key).await;
        // Again once the store has it gone: a claim sent after the first forget may have read
        // the record before it went, and kept a copy.
        self.forget(key);
        deleted
    }

    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        let deleted = self.inner.delete_settled(key).await;
        // Forgotten once the store has it gone (or may have: no answer), not before: a record
        // the store spares is in flight, and this replica may hold the only trace of its
        // answer (a completion whose write failed, kept while it is retried). A copy read
        // before the delete is dropped here, or refused by its purge mark if kept later.
        if !matches!(deleted, Ok(Deletion::Running { .. })) {
            self.forget(key);
        }
        deleted
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    fn usage(&self) -> Option<StoreUsage> {
        self.inner.usage()
    }

    fn refusals_are_final(&self) -> bool {
        self.inner.refusals_are_final()
    }

    fn local_copy(&self, key: &RecordKey) -> Option<Record> {
        self.cached(key)
    }

    /// From the claims this replica made and has not completed or released yet (a full
    /// pending map, [`MAX_PENDING`] live claims, may miss one).
    fn own_claim(&self, key: &RecordKey) -> Option<Duration> {
        let pending = self.pending.lock();
        // Read under the lock: a claim recorded meanwhile read the clock before it, so what is
        // left of it never comes out longer than its lock (a Retry-After past `lock_ttl`).
        let now = Instant::now();
        pending
            .longest_left(&key.hash, now)
            .or_else(|| self.inner.own_claim(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance;
    use crate::store::faulty::{Fault, FaultyStore};
    use crate::store::{MemoryStore, StoredResponse};
    use bytes::Bytes;

    fn options() -> LocalCacheOptions {
        LocalCacheOptions {
            capacity_bytes: 1 << 20,
            expected_items: 10_000,
            false_positive_rate: 0.01,
            window: Duration::from_secs(60),
        }
    }

    fn cached() -> Arc<CachedStore<FaultyStore<MemoryStore>>> {
        let inner = FaultyStore::new(MemoryStore::new(1 << 24, 4));
        Arc::new(CachedStore::new(inner, options()).unwrap())
    }

    fn claim(tenant: &str, n: u8) -> ClaimRequest {
        ClaimRequest {
            key: RecordKey {
                tenant: tenant.into(),
                hash: [n; 32],
            },
            fingerprint: [7; 32],
            owner: OwnerToken::random(),
            execution_id: u64::from(n),
            lock_ttl: Duration::from_secs(5),
            ttl: Duration::from_secs(60),
        }
    }

    /// Claims `req` on `store` and completes it with a 201 of `body`; both must succeed.
    async fn executed<S: RecordStore>(
        store: &CachedStore<S>,
        req: &ClaimRequest,
        body: &'static [u8],
    ) {
        store.claim(req).await.unwrap();
        store
            .complete(&req.key, req.owner, response(body), req.ttl)
            .await
            .unwrap();
    }

    /// The same request again, from another client connection (its own owner token).
    fn retry_of(req: &ClaimRequest) -> ClaimRequest {
        ClaimRequest {
            owner: OwnerToken::random(),
            ..req.clone()
        }
    }

    fn response(body: &'static [u8]) -> Completion {
        Completion::Response(Arc::new(StoredResponse::new(
            201,
            vec![("content-type", Bytes::from_static(b"application/json"))],
            Bytes::from_static(body),
        )))
    }

    /// Record `n` of tenant `t`: `n` in its hash's first bytes.
    fn numbered(n: u32) -> RecordKey {
        let mut hash = [0u8; 32];
        hash[..4].copy_from_slice(&n.to_le_bytes());
        RecordKey {
            tenant: "t".into(),
            hash,
        }
    }

    /// Keeps `completion`, stored, as execution `n`'s of record [`numbered`] `n` until `until`.
    fn keep_stored<S: RecordStore>(
        store: &CachedStore<S>,
        n: u32,
        completion: Completion,
        until: Instant,
    ) -> bool {
        let key = numbered(n);
        let record = Record {
            fingerprint: [7; 32],
            execution_id: u64::from(n),
            state: RecordState::Completed(completion),
            expires_in: None,
        };
        store.remember(&key, record, until, Origin::Stored(store.mark(&key.hash)))
    }

    /// Answers the store never confirmed are kept past the budget, but not past any bound: at
    /// twice the capacity new claims are refused as a full store (renewals of running ones, and
    /// retries of what the store holds, still go through), and taken again once the answers
    /// are stored, or given up on (dead-lettered: those are evicted past the bound).
    #[tokio::test]
    async fn answers_the_store_never_took_fill_the_cache_to_a_bound_then_claims_are_refused() {
        let store = cached();
        // A record the store holds, and this cache does not.
        let held = claim("t", 150);
        executed(&store, &held, b"held").await;
        store.forget(&held.key);
        store.inner().set(Fault::CompleteFails);
        let big: &'static [u8] = Box::leak(vec![b'x'; 100 << 10].into_boxed_slice());
        let running = claim("t", 200);
        store.claim(&running).await.unwrap();
        let mut unstored = Vec::new();
        // 25 answers of 100 KiB: 2.5 MiB against a 1 MiB cache. Claimed first: a count
        // between two of them could otherwise refuse the later claims.
        for n in 0..25u8 {
            let req = claim("t", n);
            store.claim(&req).await.unwrap();
            unstored.push(req);
        }
        for req in &unstored {
            let written = store
                .complete(&req.key, req.owner, response(big), req.ttl)
                .await;
            assert!(written.is_err());
        }
        tokio::time::sleep(Duration::from_millis(OVERFULL_RECOUNT_MS + 20)).await;
        let refused = store.claim(&claim("t", 100)).await;
        assert!(
            matches!(refused, Err(StoreError::Full { .. })),
            "{refused:?}"
        );
        assert!(
            store.claim(&running).await.is_ok(),
            "a renewal goes through"
        );
        let replayed = store.claim(&retry_of(&held)).await.unwrap();
        assert!(
            matches!(&replayed, ClaimOutcome::Existing(r) if matches!(r.state, RecordState::Completed(_))),
            "{replayed:?}"
        );
        // A store that fails then is still a full store, never an outage to forward through.
        store.inner().set(Fault::Down);
        let refused = store.claim(&claim("t", 101)).await;
        assert!(
            matches!(refused, Err(StoreError::Full { .. })),
            "{refused:?}"
        );
        store.inner().set(Fault::CompleteFails);
        // Each is still answered here, with its answer (the store holds only its claim).
        let retry = store.claim(&retry_of(&unstored[0])).await.unwrap();
        assert!(
            matches!(&retry, ClaimOutcome::Existing(r) if matches!(r.state, RecordState::Completed(_))),
            "{retry:?}"
        );
        // The retrier gives the first ones up (dead-lettered): the next count evicts them,
        // oldest first, down to the bound.
        for req in &unstored[..10] {
            store.completion_given_up(&req.key, req.owner);
        }
        tokio::time::sleep(Duration::from_millis(OVERFULL_RECOUNT_MS + 20)).await;
        assert!(store.claim(&claim("t", 102)).await.is_ok(), "taken again");
        assert!(
            store.cache_usage().1 <= 2 << 20,
            "{:?}",
            store.cache_usage()
        );
        // The newest were kept, the oldest given up on evicted.
        let retry = store.claim(&retry_of(&unstored[24])).await.unwrap();
        assert!(
            matches!(&retry, ClaimOutcome::Existing(r) if matches!(r.state, RecordState::Completed(_))),
            "{retry:?}"
        );
        assert!(
            store.cached(&unstored[0].key).is_none(),
            "the oldest given up on went"
        );
        // Stored at last: copies, which the next count evicts to the budget.
        store.inner().set(Fault::None);
        for req in &unstored {
            store.completion_stored(&req.key, req.owner);
        }
        tokio::time::sleep(Duration::from_millis(OVERFULL_RECOUNT_MS + 20)).await;
        assert!(store.claim(&claim("t", 103)).await.is_ok());
        assert!(
            store.cache_usage().1 <= 1 << 20,
            "{:?}",
            store.cache_usage()
        );
    }

    #[tokio::test]
    async fn a_large_cache_is_sharded_and_each_shard_keeps_its_share_of_the_budget() {
        let mut o = options();
        o.capacity_bytes = 8 << 20;
        let store = CachedStore::new(MemoryStore::new(1 << 30, 16), o).unwrap();
        assert_eq!(store.cache.len(), 8, "about 1 MiB per shard");
        // 20 000 completions of ~5 KiB: 100 MB offered to an 8 MiB cache.
        for n in 0..20_000u32 {
            let mut hash = [0u8; 32];
            hash[..4].copy_from_slice(&n.to_le_bytes());
            hash[4..8].copy_from_slice(&n.wrapping_mul(2_654_435_761).to_le_bytes());
            hash[0] = hash[4];
            let key = RecordKey {
                tenant: "t".into(),
                hash,
            };
            let record = Record {
                fingerprint: [7; 32],
                execution_id: u64::from(n),
                state: RecordState::Completed(response(&[1u8; 5000])),
                expires_in: None,
            };
            let mark = store.mark(&key.hash);
            store.remember(
                &key,
                record,
                Instant::now() + Duration::from_secs(60),
                Origin::Stored(mark),
            );
        }
        let (records, bytes) = store.cache_usage();
        assert!(bytes <= 8 << 20, "{bytes} bytes");
        assert!(bytes > 7 << 20, "the budget is used: {bytes} bytes");
        for shard in store.cache.iter() {
            let shard = shard.lock();
            assert!(
                shard.bytes <= 1 << 20 && shard.bytes > 900 << 10,
                "{}",
                shard.bytes
            );
        }
        assert!(records > 1400, "{records} records");
        // A small cache stays one shard, with its whole budget for one record.
        assert_eq!(
            CachedStore::new(MemoryStore::new(1 << 20, 1), options())
                .unwrap()
                .cache
                .len(),
            1
        );
    }

    /// Record hashes that share their first bytes (ground by a client) still spread over the
    /// shards, and two stores place them differently.
    #[test]
    fn clients_cannot_choose_the_cache_shard() {
        let mut o = options();
        o.capacity_bytes = 16 << 20;
        let a = CachedStore::new(MemoryStore::new(1 << 20, 1), o.clone()).unwrap();
        let b = CachedStore::new(MemoryStore::new(1 << 20, 1), o).unwrap();
        assert_eq!(a.cache.len(), 16);
        let index = |store: &CachedStore<MemoryStore>, hash: &Digest| {
            let shard = store.shard(hash) as *const Mutex<Cache>;
            store
                .cache
                .iter()
                .position(|s| std::ptr::eq(s, shard))
                .unwrap()
        };
        let hashes: Vec<Digest> = (0..256u32)
            .map(|n| {
                let mut hash = [0u8; 32];
                hash[4..8].copy_from_slice(&n.to_le_bytes());
                hash
            })
            .collect();
        let used: std::collections::HashSet<usize> = hashes.iter().map(|h| index(&a, h)).collect();
        assert!(used.len() >= 8, "{} shards used", used.len());
        assert!(
            hashes.iter().any(|h| index(&a, h) != index(&b, h)),
            "two stores place alike"
        );
    }

    #[test]
    fn an_entry_cached_again_is_not_evicted_by_the_place_of_its_dropped_predecessor() {
        let store = CachedStore::new(MemoryStore::new(1 << 20, 1), options()).unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        // A is cached, dropped (a purge) and cached again after B: A's first place is stale.
        let keep = |n: u32| keep_stored(&store, n, response(&[1u8; 1000]), until);
        keep(0);
        store.forget(&numbered(0));
        keep(1);
        keep(0);
        // Fill until the oldest live entry goes: that is B, not the fresh A.
        for n in 2.. {
            keep(n);
            let (a, b) = (store.cached(&numbered(0)), store.cached(&numbered(1)));
            assert!(
                a.is_some(),
                "the fresh A was evicted first (after {n} more)"
            );
            if b.is_none() {
                break;
            }
        }
    }

    /// A shard whose many small entries gave way to a few large ones gives their table back,
    /// and so does one whose copies were all dropped: the empty slots of a table that never
    /// shrinks are charged to no budget.
    #[test]
    fn a_shard_that_emptied_gives_its_table_back() {
        let store = CachedStore::new(MemoryStore::new(1 << 20, 1), options()).unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        let keep = |n: u32, completion: Completion| keep_stored(&store, n, completion, until);
        let shard = || store.shard(&numbered(0).hash).lock();
        assert_eq!(store.cache.len(), 1, "one shard");
        let mut n = 0;
        while shard().map.len() < 1000 {
            assert!(keep(n, response(b"{}")));
            n += 1;
        }
        let (full_slots, full_places) = {
            let s = shard();
            (s.map.capacity(), s.order.capacity())
        };
        for _ in 0..8 {
            assert!(keep(n, response(&[1u8; 200_000])));
            n += 1;
        }
        let (live, slots, places) = {
            let s = shard();
            (s.map.len(), s.map.capacity(), s.order.capacity())
        };
        assert!(live < 10, "{live} entries left");
        assert!(
            slots < full_slots / 4 && places < full_places / 4,
            "{slots} of {full_slots} slots, {places} of {full_places} places kept for {live} entries"
        );

        while shard().map.len() < 1000 {
            assert!(keep(n, response(b"{}")));
            n += 1;
        }
        let full_slots = shard().map.capacity();
        store.forget_copies();
        assert!(shard().map.capacity() < full_slots / 4);
    }

    #[tokio::test]
    async fn conformance_holds_with_the_cache_in_front() {
        conformance::run_all(|| async {
            Arc::new(CachedStore::new(MemoryStore::new(1 << 24, 4), options()).unwrap())
        })
        .await;
    }

    #[tokio::test]
    async fn a_completion_of_this_replica_is_answered_without_the_store() {
        let store = cached();
        let req = claim("t", 1);
        assert!(matches!(
            store.claim(&req).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
        store
            .complete(&req.key, req.owner, response(b"{}"), req.ttl)
            .await
            .unwrap();
        let calls = store.inner().calls.load(Ordering::Relaxed);
        // Even with the shared store down, the retry is answered locally.
        store.inner().set(Fault::Down);
        let again = retry_of(&req);
        match store.claim(&again).await.unwrap() {
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.fingerprint, [7; 32]);
                assert_eq!(r.execution_id, 1);
                assert_eq!(r.state, RecordState::Completed(response(b"{}")));
            }
            other => panic!("expected a local hit, got {other:?}"),
        }
        assert_eq!(
            store.inner().calls.load(Ordering::Relaxed),
            calls,
            "no store round trip"
        );
        assert_eq!(store.stats().hits.load(Ordering::Relaxed), 1);
        assert!(store.bloom_fill_ratio() > 0.0);
    }

    #[tokio::test]
    async fn the_bloom_fill_ratio_is_counted_at_most_once_a_second() {
        let store = cached();
        let before = store.bloom_fill_ratio();
        for n in 0..50 {
            let req = claim("t", n);
            store.claim(&req).await.unwrap();
            store
                .complete(&req.key, req.owner, response(b"{}"), req.ttl)
                .await
                .unwrap();
        }
        assert_eq!(
            store.bloom_fill_ratio(),
            before,
            "the count of a moment ago"
        );
        tokio::time::sleep(FILL_RECOUNT_EVERY).await;
        assert!(store.bloom_fill_ratio() > before);
    }

    #[tokio::test]
    async fn unknown_keys_and_other_tenants_go_to_the_store() {
        let store = cached();
        let req = claim("acme", 2);
        executed(&store, &req, b"a").await;
        let other_tenant = claim("globex", 2);
        let outcome = store.claim(&other_tenant).await.unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Acquired { .. }),
            "{outcome:?}"
        );
        let unknown = claim("acme", 3);
        assert!(matches!(
            store.claim(&unknown).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
        assert!(store.stats().bloom_negatives.load(Ordering::Relaxed) >= 1);
    }

    #[tokio::test]
    async fn a_completion_the_store_refused_is_still_replayed_here() {
        let store = cached();
        let req = claim("t", 4);
        store.claim(&req).await.unwrap();
        store.inner().set(Fault::CompleteFails);
        let written = store
            .complete(&req.key, req.owner, response(b"x"), req.ttl)
            .await;
        assert!(written.is_err());
        // The answer, not the store's record of the claim (still in flight there): a store
        // that fails too now leaves this replica's copy the only answer.
        store.inner().set(Fault::Down);
        let again = store.claim(&retry_of(&req)).await.unwrap();
        assert!(
            matches!(&again, ClaimOutcome::Existing(r) if matches!(r.state, RecordState::Completed(_))),
            "{again:?}"
        );
    }

    #[tokio::test]
    async fn released_and_fenced_completions_are_not_cached() {
        let store = cached();
        let req = claim("t", 5);
        store.claim(&req).await.unwrap();
        store.release(&req.key, req.owner).await.unwrap();
        let stranger = OwnerToken::random();
        let outcome = store
            .complete(&req.key, stranger, response(b"x"), req.ttl)
            .await
            .unwrap();
        assert_eq!(outcome, WriteOutcome::NotOwner);
        assert_eq!(store.cache_usage().0, 0);
    }

    #[tokio::test]
    async fn the_cache_stays_within_its_byte_budget_and_expires_entries() {
        tokio::time::pause();
        let mut o = options();
        o.capacity_bytes = 4096;
        let store = CachedStore::new(MemoryStore::new(1 << 24, 4), o).unwrap();
        for n in 0..50u8 {
            let req = claim("t", n);
            executed(&store, &req, &[0u8; 200]).await;
        }
        let (records, bytes) = store.cache_usage();
        assert!(
            bytes <= 4096 && records < 50 && records > 0,
            "{records} records, {bytes} bytes"
        );
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(
            store.cached(&claim("t", 49).key).is_none(),
            "expired with the record"
        );
    }

    #[tokio::test]
    async fn a_longer_window_set_later_keeps_keys_for_it() {
        tokio::time::pause();
        let store = cached();
        // A reload raised the longest ttl from the options' 60 s to an hour.
        store.set_window(Duration::from_secs(3600));
        let req = claim("t", 10);
        store.claim(&req).await.unwrap();
        store
            .complete(
                &req.key,
                req.owner,
                response(b"{}"),
                Duration::from_secs(3600),
            )
            .await
            .unwrap();
        // Retries across two of the old windows (each would have rotated the filter once):
        // still found locally.
        let calls = store.inner().calls.load(Ordering::Relaxed);
        for _ in 0..2 {
            tokio::time::advance(Duration::from_secs(70)).await;
            let again = claim("t", 10);
            assert!(matches!(
                store.claim(&again).await.unwrap(),
                ClaimOutcome::Existing(_)
            ));
        }
        let local = store.inner().calls.load(Ordering::Relaxed) == calls;
        assert!(local, "both retries answered locally");
    }

    #[tokio::test]
    async fn a_shorter_window_set_later_keeps_keys_cached_under_the_longer_one() {
        tokio::time::pause();
        let store = cached();
        store.set_window(Duration::from_secs(3600));
        let mut req = claim("t", 17);
        req.ttl = Duration::from_secs(3600);
        executed(&store, &req, b"{}").await;
        // A reload lowers every route's ttl to 60 s: the entry cached for an hour (maybe the
        // only trace of a completion the shared store has not taken) must stay findable.
        store.set_window(Duration::from_secs(60));
        let calls = store.inner().calls.load(Ordering::Relaxed);
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(610)).await;
            let again = claim("t", 17);
            assert!(matches!(
                store.claim(&again).await.unwrap(),
                ClaimOutcome::Existing(_)
            ));
        }
        assert_eq!(
            store.inner().calls.load(Ordering::Relaxed),
            calls,
            "answered locally for the entry's whole life"
        );
        // Two of the long windows later the short one holds: the filter rotates by it.
        tokio::time::advance(Duration::from_secs(2 * 3600)).await;
        let req = claim("t", 18);
        executed(&store, &req, b"{}").await;
        let negatives = store.stats().bloom_negatives.load(Ordering::Relaxed);
        for _ in 0..2 {
            tokio::time::advance(Duration::from_secs(61)).await;
            let again = claim("t", 18);
            store.claim(&again).await.unwrap();
        }
        assert_eq!(
            store.stats().bloom_negatives.load(Ordering::Relaxed),
            negatives + 1,
            "forgotten after two short windows"
        );
    }

    #[tokio::test]
    async fn the_bloom_filter_forgets_a_key_after_two_windows() {
        tokio::time::pause();
        let store = cached();
        let mut req = claim("t", 9);
        req.ttl = Duration::from_secs(3600);
        executed(&store, &req, b"{}").await;
        let retry = |store: Arc<CachedStore<FaultyStore<MemoryStore>>>| async move {
            let again = claim("t", 9);
            store.claim(&again).await.unwrap()
        };
        // One rotation later the key is in the previous generation: still a local hit.
        tokio::time::advance(Duration::from_secs(61)).await;
        let calls = store.inner().calls.load(Ordering::Relaxed);
        assert!(matches!(
            retry(store.clone()).await,
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(store.inner().calls.load(Ordering::Relaxed), calls);
        assert_eq!(store.stats().hits.load(Ordering::Relaxed), 1);
        // Two rotations: no generation holds it, so the shared store answers (and still knows it).
        tokio::time::advance(Duration::from_secs(61)).await;
        let negatives = store.stats().bloom_negatives.load(Ordering::Relaxed);
        match retry(store.clone()).await {
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.state, RecordState::Completed(response(b"{}")))
            }
            other => panic!("expected the stored record, got {other:?}"),
        }
        assert_eq!(store.inner().calls.load(Ordering::Relaxed), calls + 1);
        assert_eq!(
            store.stats().bloom_negatives.load(Ordering::Relaxed),
            negatives + 1
        );
        assert_eq!(store.stats().hits.load(Ordering::Relaxed), 1);
    }

    /// Claims `req` on `store`, then completes it while the store beneath stalls: returns the
    /// completion, still out (it goes on once the fault is switched).
    async fn completing_while_stalled(
        store: &Arc<CachedStore<FaultyStore<MemoryStore>>>,
        req: &ClaimRequest,
    ) -> tokio::task::JoinHandle<Result<WriteOutcome, StoreError>> {
        store.claim(req).await.unwrap();
        store.inner().set(Fault::Stall);
        let writing = tokio::spawn({
            let (store, req) = (store.clone(), req.clone());
            async move {
                store
                    .complete(&req.key, req.owner, response(b"x"), req.ttl)
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        writing
    }

    /// A retry on this replica while the completion's write is out, its own claim refused by a
    /// store that fails, must find the key held here (never run beside the execution that just
    /// answered), and once the write has failed, the answer.
    #[tokio::test]
    async fn a_completion_being_written_is_this_replica_s_until_its_answer_is_kept() {
        let store = cached();
        let req = claim("t", 11);
        let writing = completing_while_stalled(&store, &req).await;
        assert!(
            store.own_claim(&req.key).is_some(),
            "held here while its write is out"
        );
        assert!(store.local_copy(&req.key).is_none());
        store.inner().set(Fault::Down);
        assert!(writing.await.unwrap().is_err());
        assert!(
            store.own_claim(&req.key).is_none(),
            "let go once its answer is kept"
        );
        let copy = store.local_copy(&req.key).expect("the answer is kept");
        assert_eq!(copy.execution_id, req.execution_id);
        assert!(matches!(copy.state, RecordState::Completed(_)));
    }

    /// A purge of a record while its execution ran makes the key claimable afresh: the answer
    /// of that execution, its write failed, is not kept here to be replayed for its ttl.
    #[tokio::test]
    async fn a_purge_while_the_key_ran_keeps_no_trace_of_its_failed_write() {
        let store = cached();
        let req = claim("t", 12);
        store.claim(&req).await.unwrap();
        store.forget(&req.key);
        store.inner().set(Fault::CompleteFails);
        let written = store
            .complete(&req.key, req.owner, response(b"x"), req.ttl)
            .await;
        assert!(written.is_err());
        assert!(store.cached(&req.key).is_none(), "kept after the purge");
        // Another record's purge while its key ran leaves the trace, as before.
        let kept = claim("t", 13);
        store.inner().set(Fault::None);
        store.claim(&kept).await.unwrap();
        store.forget(&claim("t", 14).key);
        store.inner().set(Fault::CompleteFails);
        assert!(store
            .complete(&kept.key, kept.owner, response(b"x"), kept.ttl)
            .await
            .is_err());
        assert!(
            store.cached(&kept.key).is_some(),
            "the only trace of its answer"
        );
    }

    #[tokio::test]
    async fn a_purge_of_another_record_keeps_the_trace_of_a_write_that_failed() {
        let store = cached();
        let (req, other) = (claim("t", 7), claim("t", 8));
        assert_eq!(store.cache.len(), 1, "one shard: both records share it");
        let writing = completing_while_stalled(&store, &req).await;
        // Another record of the shard is purged while the write is out, and the write fails.
        store.forget(&other.key);
        store.inner().set(Fault::Down);
        assert!(writing.await.unwrap().is_err());
        let retry = store.claim(&retry_of(&req)).await.unwrap();
        assert!(matches!(retry, ClaimOutcome::Existing(_)), "{retry:?}");
        // A purge of this very record, or more purges than the shard remembers, still take it.
        let req = claim("t", 9);
        store.inner().set(Fault::None);
        let writing = completing_while_stalled(&store, &req).await;
        store.forget(&req.key);
        store.inner().set(Fault::Down);
        assert!(writing.await.unwrap().is_err());
        assert!(store.cached(&req.key).is_none(), "the purge was undone");
        // Exactly as many purges of other records as the shard remembers keep it (the hashes
        // of `claim` ignore the tenant: 100 and up collide with none of this test's)...
        let req = claim("t", 10);
        store.inner().set(Fault::None);
        let writing = completing_while_stalled(&store, &req).await;
        for n in 0..RECENT_PURGES {
            store.forget(&claim("u", 100 + n as u8).key);
        }
        store.inner().set(Fault::Down);
        assert!(writing.await.unwrap().is_err());
        assert!(
            store.cached(&req.key).is_some(),
            "a remembered purge was misread"
        );
        // ...one more, and which records they were is no longer known.
        let req = claim("t", 11);
        store.inner().set(Fault::None);
        let writing = completing_while_stalled(&store, &req).await;
        for n in 0..=RECENT_PURGES {
            store.forget(&claim("u", 100 + n as u8).key);
        }
        store.inner().set(Fault::Down);
        assert!(writing.await.unwrap().is_err());
        assert!(
            store.cached(&req.key).is_none(),
            "forgotten purges were ignored"
        );
    }

    #[tokio::test]
    async fn a_purge_while_the_write_is_out_is_not_undone_when_it_lands() {
        let store = cached();
        let req = claim("t", 7);
        let writing = completing_while_stalled(&store, &req).await;
        // The purge reaches this replica (its own admin call or another's announcement).
        store.forget(&req.key);
        store.inner().set(Fault::None);
        assert_eq!(writing.await.unwrap().unwrap(), WriteOutcome::Applied);
        assert!(store.cached(&req.key).is_none(), "the purge was undone");
    }

    type Shared = Arc<FaultyStore<MemoryStore>>;

    /// Two replicas' caches in front of one shared store.
    fn two_replicas() -> (Shared, CachedStore<Shared>, CachedStore<Shared>) {
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 24, 4)));
        let a = CachedStore::new(shared.clone(), options()).unwrap();
        let b = CachedStore::new(shared.clone(), options()).unwrap();
        (shared, a, b)
    }

    /// `req` claimed on `store`, which must acquire it.
    async fn acquired<S: RecordStore>(store: &CachedStore<S>, req: &ClaimRequest) {
        let outcome = store.claim(req).await.unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Acquired { .. }),
            "{outcome:?}"
        );
    }

    /// A wait on `key` through `store`, in a task of its own.
    fn spawn_wait<S: RecordStore + 'static>(
        store: &Arc<CachedStore<S>>,
        key: &RecordKey,
        timeout: Duration,
    ) -> tokio::task::JoinHandle<Result<Option<Record>, StoreError>> {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move { store.wait_for_change(&key, timeout).await })
    }

    /// A key purged here while this replica's own claim on it still runs, before a wait on it
    /// began: the wait asks the store (which has nothing) at once, rather than trusting the
    /// claim and sleeping until its lock lapses. (The randomized test below met this when a
    /// waiter's task first ran after the purge.)
    #[tokio::test]
    async fn a_wait_that_begins_after_a_purge_of_its_own_claim_asks_the_store() {
        let shared = Arc::new(MemoryStore::new(1 << 20, 4));
        let store = Arc::new(CachedStore::new(shared, options()).unwrap());
        let req = ClaimRequest {
            lock_ttl: Duration::from_secs(5),
            ..claim("t", 41)
        };
        acquired(&store, &req).await;
        assert!(store.delete(&req.key).await.unwrap());
        let started = Instant::now();
        let waited = tokio::time::timeout(
            Duration::from_secs(3),
            store.wait_for_change(&req.key, Duration::from_secs(10)),
        )
        .await
        .expect("the wait trusted the purged claim and slept toward its lapse");
        assert!(waited.unwrap().is_none());
        assert!(started.elapsed() < Duration::from_secs(1));
        // A claim that was not purged is still waited on here.
        let other = ClaimRequest {
            lock_ttl: Duration::from_secs(5),
            ..claim("t", 42)
        };
        acquired(&store, &other).await;
        let wait = spawn_wait(&store, &other.key, Duration::from_millis(300));
        let record = wait.await.unwrap().unwrap();
        assert!(
            matches!(record.map(|r| r.state), Some(RecordState::InFlight { .. })),
            "the wait ran out with the claim still in flight"
        );
    }

    /// The waits under many interleavings: two replicas over one store, rounds of a claim on
    /// either, waiters on both, and an end after a random pause — a completion, a release, a
    /// purge through either replica, or the lock left to lapse. Every waiter ends soon after
    /// the change it waits for (no lost wake-up leaves one asleep until its timeout) and reads
    /// what the change made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waits_end_soon_after_every_kind_of_change_on_either_replica() {
        use rand::Rng;
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 24, 4)));
        let replicas = [
            Arc::new(CachedStore::new(shared.clone(), options()).unwrap()),
            Arc::new(CachedStore::new(shared.clone(), options()).unwrap()),
        ];
        // Longer than any change takes to be heard: a missed wake-up shows as a waiter that
        // slept until the lapse.
        let lock = Duration::from_secs(2);
        let timeout = Duration::from_secs(5);
        for round in 0..40u32 {
            let (owner_at, end, pause_ms, waiters) = {
                let mut rng = rand::thread_rng();
                (
                    rng.gen_range(0..2usize),
                    rng.gen_range(0..5u8),
                    rng.gen_range(0..15u64),
                    rng.gen_range(1..6usize),
                )
            };
            let req = ClaimRequest {
                key: numbered(10_000 + round),
                lock_ttl: lock,
                ..claim("t", 0)
            };
            let owner = &replicas[owner_at];
            acquired(owner, &req).await;
            let started = Instant::now();
            let tasks: Vec<_> = (0..waiters)
                .map(|w| {
                    let (store, key) = (replicas[w % 2].clone(), req.key.clone());
                    tokio::spawn(async move {
                        let record = store.wait_for_change(&key, timeout).await.unwrap();
                        (record, Instant::now())
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            let changed = Instant::now();
            match end {
                0 => {
                    let done = response(b"done");
                    let written = owner.complete(&req.key, req.owner, done, req.ttl).await;
                    assert_eq!(written.unwrap(), WriteOutcome::Applied);
                }
                1 => {
                    let released = owner.release(&req.key, req.owner).await;
                    assert_eq!(released.unwrap(), WriteOutcome::Applied);
                }
                2 | 3 => {
                    let purger = &replicas[usize::from(end) - 2];
                    assert!(purger.delete(&req.key).await.unwrap());
                    // The other replica hears of it as a purge message.
                    replicas[3 - usize::from(end)].forget(&req.key);
                }
                _ => {}
            }
            // A change is heard within a few of the store's polls; a lapse soon after it. The
            // slack (for a loaded machine) is well short of the lock, which a missed wake-up
            // sleeps until.
            let due = match end {
                4 => started + lock,
                _ => changed,
            } + Duration::from_millis(800);
            for task in tasks {
                let (record, ended) = task.await.unwrap();
                assert!(
                    ended <= due,
                    "round {round}: end {end}, a waiter ended {:?} late",
                    ended - due
                );
                let state = record.as_ref().map(|r| &r.state);
                let fits = match end {
                    0 => matches!(state, Some(RecordState::Completed(_))),
                    1 => matches!(state, Some(RecordState::Released)),
                    2 | 3 => state.is_none(),
                    _ => {
                        matches!(
                            state,
                            Some(RecordState::InFlight { lock_remaining }) if lock_remaining.is_zero()
                        ) || matches!(state, Some(RecordState::Released))
                    }
                };
                assert!(fits, "round {round}: end {end}, read {record:?}");
            }
        }
    }

    /// A waiter on a claim of its own replica hears of its release even when the release call
    /// is dropped on its way to the store (its request gone): it asks the store from then on,
    /// instead of sleeping on a claim no longer here until the lock would have lapsed.
    #[tokio::test]
    async fn a_release_dropped_on_its_way_still_wakes_the_claim_s_waiters() {
        let store = cached();
        let req = ClaimRequest {
            lock_ttl: Duration::from_secs(30),
            ..claim("t", 41)
        };
        acquired(&store, &req).await;
        let waiter = spawn_wait(&store, &req.key, Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let calls = store.inner().calls.load(Ordering::Relaxed);
        store.inner().set(Fault::Stall);
        let releasing = tokio::spawn({
            let (store, key) = (store.clone(), req.key.clone());
            async move { store.release(&key, req.owner).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        releasing.abort();
        let _ = releasing.await;
        store.inner().set(Fault::None);
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The release, and the waiter's wait on the store.
        assert_eq!(store.inner().calls.load(Ordering::Relaxed), calls + 2);
        assert!(!waiter.is_finished(), "the record is still in flight");
        waiter.abort();
    }

    /// Waiters on one replica for another's execution share one wait on the store: one waits,
    /// the others take what it read — a release as much as a completion.
    #[tokio::test]
    async fn waiters_for_another_replica_s_execution_share_one_wait_on_the_store() {
        let (shared, a, b) = two_replicas();
        let b = Arc::new(b);
        for (n, settle_with_release) in [(30u8, true), (31, false)] {
            let req = ClaimRequest {
                lock_ttl: Duration::from_secs(30),
                ..claim("t", n)
            };
            acquired(&a, &req).await;
            let before = shared.calls.load(Ordering::Relaxed);
            let waiters: Vec<_> = (0..5)
                .map(|_| spawn_wait(&b, &req.key, Duration::from_secs(5)))
                .collect();
            tokio::time::sleep(Duration::from_millis(50)).await;
            if settle_with_release {
                a.release(&req.key, req.owner).await.unwrap();
            } else {
                a.complete(
                    &req.key,
                    req.owner,
                    response(b"done"),
                    Duration::from_secs(60),
                )
                .await
                .unwrap();
            }
            for waiter in waiters {
                let record = waiter.await.unwrap().unwrap().expect("a record");
                match settle_with_release {
                    true => assert_eq!(record.state, RecordState::Released),
                    false => assert!(matches!(record.state, RecordState::Completed(_))),
                }
            }
            // One wait of B's and A's settle.
            assert_eq!(
                shared.calls.load(Ordering::Relaxed),
                before + 2,
                "release: {settle_with_release}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_another_replica_completed_is_copied_for_what_is_left_of_its_life() {
        let (shared, a, b) = two_replicas();
        let req = claim("t", 8);
        a.claim(&req).await.unwrap();
        let life = Duration::from_millis(1000);
        a.complete(&req.key, req.owner, response(b"a's"), life)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let retry = |n: u8| ClaimRequest {
            owner: OwnerToken::random(),
            execution_id: u64::from(n),
            ..req.clone()
        };
        // B reads it from the shared store once, then answers from its copy, even with the
        // shared store down.
        assert!(matches!(
            b.claim(&retry(1)).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(b.stats().copied.load(Ordering::Relaxed), 1);
        shared.set(Fault::Down);
        let calls = shared.calls.load(Ordering::Relaxed);
        match b.claim(&retry(2)).await.unwrap() {
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.state, RecordState::Completed(response(b"a's")));
                assert_eq!(r.execution_id, 8);
                assert!(r
                    .expires_in
                    .is_some_and(|left| left <= Duration::from_millis(500)));
            }
            other => panic!("expected B's copy, got {other:?}"),
        }
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls, "no round trip");
        assert_eq!(b.stats().hits.load(Ordering::Relaxed), 1);
        // The copy goes when the shared record does, not a route ttl after B read it.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(b.cached(&req.key).is_none(), "the copy outlived the record");
    }

    #[tokio::test]
    async fn only_completed_records_are_copied_and_not_across_a_purge() {
        let (shared, a, b) = two_replicas();
        // In flight on A: B sees it, keeps nothing.
        let req = claim("t", 9);
        a.claim(&req).await.unwrap();
        let retry = retry_of(&req);
        assert!(matches!(
            b.claim(&retry).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(b.stats().copied.load(Ordering::Relaxed), 0);
        // Completed, then purged while B's read of it is out: B keeps no copy.
        a.complete(&req.key, req.owner, response(b"x"), req.ttl)
            .await
            .unwrap();
        shared.set(Fault::Stall);
        let b = Arc::new(b);
        let reading = tokio::spawn({
            let b = b.clone();
            async move { b.claim(&retry).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        b.forget(&req.key);
        shared.set(Fault::None);
        assert!(matches!(
            reading.await.unwrap().unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(b.stats().copied.load(Ordering::Relaxed), 0);
        assert!(
            b.cached(&req.key).is_none(),
            "a copy read across a purge was kept"
        );
    }

    /// Claims `req` on `store` and completes it with a 201 of `body` while the shared store
    /// refuses writes: the completion is kept locally, its write to be retried.
    async fn executed_unstored(
        store: &CachedStore<Shared>,
        shared: &Shared,
        req: &ClaimRequest,
        body: &'static [u8],
    ) {
        store.claim(req).await.unwrap();
        shared.set(Fault::CompleteFails);
        let written = store.complete(&req.key, req.owner, response(body), req.ttl);
        assert!(written.await.is_err());
        shared.set(Fault::None);
    }

    /// A cache of 4 KiB over a store whose faults a test switches.
    fn small_cache_over_faulty() -> (
        CachedStore<Arc<FaultyStore<MemoryStore>>>,
        Arc<FaultyStore<MemoryStore>>,
    ) {
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 24, 4)));
        let mut o = options();
        o.capacity_bytes = 4096;
        (CachedStore::new(shared.clone(), o).unwrap(), shared)
    }

    /// Copies make room past the budget; a completion the store does not hold yet is never
    /// evicted for it, so a retry here still replays it instead of executing again.
    #[tokio::test]
    async fn a_completion_whose_write_is_pending_is_never_evicted() {
        let (store, shared) = small_cache_over_faulty();
        let pending = claim("t", 200);
        executed_unstored(&store, &shared, &pending, &[1u8; 200]).await;
        for n in 0..50u8 {
            executed(&store, &claim("t", n), &[0u8; 200]).await;
        }
        let (records, bytes) = store.cache_usage();
        assert!(
            records < 50,
            "copies were evicted: {records} records, {bytes} bytes"
        );
        assert!(
            store.cached(&pending.key).is_some(),
            "the completion only this replica holds was evicted"
        );
        assert!(bytes <= 4096 + 1024, "{bytes} bytes");
    }

    /// A completion the store does not hold is kept however large: a shard's budget (1 MiB by
    /// default) is less than the largest replayable response, and an answer over it used to
    /// leave no trace, so a retry here executed the key again.
    #[tokio::test]
    async fn a_completion_whose_write_is_pending_is_kept_even_when_larger_than_its_shard() {
        let (store, shared) = small_cache_over_faulty();
        let pending = claim("t", 201);
        executed_unstored(&store, &shared, &pending, &[1u8; 8192]).await;
        assert!(
            store.cached(&pending.key).is_some(),
            "the only trace of a large answer was not kept"
        );
        // Copies still come and go around it.
        executed(&store, &claim("t", 1), &[0u8; 100]).await;
        assert!(store.cached(&pending.key).is_some());
        assert_eq!(store.cache_usage().0, 1, "the copy made room at once");
    }

    /// A completion the store may not hold is kept while it lives, not past its ttl: after it,
    /// a retry executes again anyway, and one kept for ever (clients rarely retry a key they
    /// were answered for, so no lookup removes it) took its shard's budget from the copies.
    #[tokio::test(start_paused = true)]
    async fn a_pending_completion_past_its_ttl_is_evicted_like_a_copy() {
        let (store, shared) = small_cache_over_faulty();
        let pending = claim("t", 200);
        executed_unstored(&store, &shared, &pending, &[1u8; 200]).await;
        // Its 60 s ttl passes.
        tokio::time::advance(Duration::from_secs(61)).await;
        for n in 0..50u8 {
            executed(&store, &claim("t", n), &[0u8; 200]).await;
        }
        let map_holds = store.cache[0].lock().map.contains_key(&pending.key.hash);
        assert!(!map_holds, "an expired completion stayed in the cache");
        let (_, bytes) = store.cache_usage();
        assert!(bytes <= 4096, "{bytes} bytes");
        // Dropping every copy drops an expired one of any kind too.
        let gone = claim("t", 202);
        executed_unstored(&store, &shared, &gone, b"x").await;
        tokio::time::advance(Duration::from_secs(61)).await;
        store.forget_copies();
        assert_eq!(store.cache_usage().0, 0);
    }

    /// Any failed write keeps the trace, not only an unreachable store: a reply the store
    /// gives that this version cannot read (`Corrupt`) is retried the same way.
    #[tokio::test]
    async fn a_completion_whose_write_came_back_unreadable_is_kept() {
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 24, 4)));
        let store = CachedStore::new(shared.clone(), options()).unwrap();
        let req = claim("t", 9);
        store.claim(&req).await.unwrap();
        shared.set(Fault::CompleteCorrupt);
        let written = store.complete(&req.key, req.owner, response(b"x"), req.ttl);
        assert!(matches!(written.await, Err(StoreError::Corrupt(_))));
        shared.set(Fault::Down);
        let retry = store.claim(&retry_of(&req)).await.unwrap();
        assert!(matches!(retry, ClaimOutcome::Existing(_)), "{retry:?}");
    }

    #[tokio::test]
    async fn forgetting_copies_keeps_only_completions_whose_write_is_pending() {
        let (shared, a, b) = two_replicas();
        let (stored, pending, theirs) = (claim("t", 10), claim("t", 11), claim("t", 12));
        executed(&b, &stored, b"x").await;
        executed_unstored(&b, &shared, &pending, b"x").await;
        executed(&a, &theirs, b"x").await;
        let retry = retry_of(&theirs);
        b.claim(&retry).await.unwrap();
        assert_eq!(
            b.cache_usage().0,
            3,
            "B's two completions and its copy of A's"
        );
        assert_eq!(b.forget_copies(), 2);
        assert_eq!(b.cache_usage().0, 1);
        assert!(
            b.cached(&pending.key).is_some(),
            "the only trace of a completion the store has not taken went"
        );
        assert!(
            b.cached(&stored.key).is_none(),
            "a completion the store took stayed"
        );
        assert!(b.cached(&theirs.key).is_none());
        // The bytes follow: only the pending completion's are left.
        let (_, bytes) = b.cache_usage();
        let one = ENTRY_OVERHEAD + 1 + response(b"x").response_bytes();
        assert_eq!(bytes, one);
        // The next read copies it again.
        let calls = shared.calls.load(Ordering::Relaxed);
        b.claim(&retry).await.unwrap();
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls + 1);
        assert_eq!(b.stats().copied.load(Ordering::Relaxed), 2);
    }

    fn pending_until(deadline: Instant) -> Pending {
        Pending {
            fingerprint: [0; 32],
            execution_id: 1,
            deadline,
            purges: 0,
        }
    }

    #[test]
    fn pending_claims_are_found_by_hash_and_owner() {
        let now = Instant::now();
        let mut claims = PendingClaims::new();
        let (h, other) = ([1u8; 32], [2u8; 32]);
        claims.insert(h, 10, pending_until(now + Duration::from_secs(3)), now);
        claims.insert(h, 11, pending_until(now + Duration::from_secs(5)), now);
        claims.insert(other, 10, pending_until(now + Duration::from_secs(9)), now);
        assert_eq!(claims.len, 3);
        assert_eq!(
            claims.longest_left(&h, now),
            Some(Duration::from_secs(5)),
            "the longest of the hash's claims, not another hash's"
        );
        // A renewal replaces its owner's claim.
        claims.insert(h, 10, pending_until(now + Duration::from_secs(7)), now);
        assert_eq!(claims.len, 3);
        assert_eq!(claims.longest_left(&h, now), Some(Duration::from_secs(7)));
        claims.get_mut(&h, 10).unwrap().deadline = now + Duration::from_secs(8);
        assert_eq!(claims.longest_left(&h, now), Some(Duration::from_secs(8)));
        assert!(claims.remove(&h, 10).is_some());
        assert!(claims.remove(&h, 10).is_none());
        assert_eq!(claims.longest_left(&h, now), Some(Duration::from_secs(5)));
        assert!(claims.remove(&h, 11).is_some());
        assert_eq!(claims.longest_left(&h, now), None);
        assert!(
            !claims.by_hash.contains_key(&h),
            "no empty lists left behind"
        );
        assert_eq!(claims.len, 1);
        // Past its deadline a claim no longer counts.
        assert_eq!(
            claims.longest_left(&other, now + Duration::from_secs(9)),
            None
        );
    }

    #[test]
    fn a_full_map_of_live_claims_is_not_walked_by_every_claim() {
        let now = Instant::now();
        let mut claims = PendingClaims::new();
        let live = pending_until(now + Duration::from_secs(60));
        for n in 0..MAX_PENDING as u32 {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&n.to_be_bytes());
            claims.insert(h, 1, live, now);
        }
        assert_eq!(claims.len, MAX_PENDING);
        // Full of live claims: the next is not kept, and the prune it ran holds off the next.
        claims.insert([0xff; 32], 1, live, now);
        assert_eq!(claims.len, MAX_PENDING);
        assert_eq!(claims.longest_left(&[0xff; 32], now), None);
        assert_eq!(claims.pause_until, Some(now + FULL_PRUNE_PAUSE));
        // Once they lapse, the next claim after the pause prunes them and is kept.
        let later = now + Duration::from_secs(61);
        claims.insert(
            [0xfe; 32],
            1,
            pending_until(later + Duration::from_secs(1)),
            later,
        );
        assert_eq!(claims.len, 1);
        assert!(claims.longest_left(&[0xfe; 32], later).is_some());
        assert_eq!(claims.pause_until, None);
    }

    #[tokio::test]
    async fn claims_whose_outcome_never_came_back_are_pruned_as_the_map_doubles() {
        let (_shared, a, _b) = two_replicas();
        // Claims that are never completed nor released (unknown outcomes), with short locks.
        let lapsing = |n: u16| ClaimRequest {
            key: RecordKey {
                tenant: "t".into(),
                hash: {
                    let mut h = [9u8; 32];
                    h[..2].copy_from_slice(&n.to_be_bytes());
                    h
                },
            },
            lock_ttl: Duration::from_millis(1),
            ..claim("t", 0)
        };
        for n in 0..3000 {
            a.claim(&lapsing(n)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let live = claim("t", 43);
        a.claim(&live).await.unwrap();
        let kept = a.pending.lock().len;
        assert!(
            kept < 2 * PENDING_PRUNE_FLOOR,
            "{kept} pending claims kept, most past their locks"
        );
        assert!(a.own_claim(&live.key).is_some(), "the live claim is kept");
    }

    /// `req`'s completion `body` as the retrier takes it, its lock lasting `lock` from now.
    fn job_of(
        req: &ClaimRequest,
        body: &'static [u8],
        lock: Duration,
    ) -> crate::store::retry::PendingCompletion {
        crate::store::retry::PendingCompletion {
            on_fallback: false,
            key: req.key.clone(),
            owner: req.owner,
            completion: response(body),
            ttl: req.ttl,
            execution_id: req.execution_id,
            fingerprint: req.fingerprint,
            lock_deadline: Instant::now() + lock,
            lapses_by: Instant::now() + lock,
        }
    }

    #[tokio::test]
    async fn a_lost_completion_is_kept_unless_its_key_was_purged_after_its_claim() {
        let (shared, a, _b) = two_replicas();
        // `req` claimed on A, `meanwhile` done to it while its backend runs, its completion
        // refused and kept as lost: what a retry on A then finds.
        let lose = async |req: &ClaimRequest, meanwhile: &dyn RecordStore| {
            assert!(matches!(
                a.claim(req).await.unwrap(),
                ClaimOutcome::Acquired { .. }
            ));
            meanwhile.delete(&req.key).await.unwrap();
            let written = a.complete(&req.key, req.owner, response(b"x"), req.ttl);
            assert_eq!(written.await.unwrap(), WriteOutcome::NotOwner);
            a.keep_lost(&job_of(req, b"x", req.lock_ttl));
            a.claim(&retry_of(req)).await.unwrap()
        };
        // Purged before its claim (an earlier use of the key): no bearing on this execution.
        // A failover then loses the claim while the backend runs.
        let before = claim("t", 41);
        a.delete(&before.key).await.unwrap();
        let replay = lose(&before, shared.as_ref()).await;
        assert!(
            matches!(replay, ClaimOutcome::Existing(_)),
            "the lost answer is replayed, not executed again: {replay:?}"
        );

        // Purged while it ran: the key is claimable afresh.
        let again = lose(&claim("t", 42), &a).await;
        assert!(matches!(again, ClaimOutcome::Acquired { .. }), "{again:?}");
    }

    #[tokio::test]
    async fn a_completion_the_retrier_stores_goes_with_the_copies_from_then_on() {
        use crate::store::retry::{CompletionRetrier, RetryOptions};
        let (shared, a, _b) = two_replicas();
        let a = Arc::new(a);
        let req = claim("t", 21);
        executed_unstored(&a, &shared, &req, b"x").await;
        // The retrier over the shared store, wired to A's cache as the server wires it.
        let dir = tempfile::tempdir().unwrap();
        let hooks = a.retry_hooks();
        let options = RetryOptions {
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(20),
            dead_letter_path: dir.path().join("dead.jsonl"),
            ..RetryOptions::default()
        };
        let (retrier, worker) = CompletionRetrier::new(shared.clone(), hooks, options);
        tokio::spawn(worker);
        retrier.submit(job_of(&req, b"x", req.lock_ttl));
        for _ in 0..200 {
            if retrier.pending() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 1);
        // Still answered here without a round trip...
        let calls = shared.calls.load(Ordering::Relaxed);
        assert!(matches!(
            a.claim(&retry_of(&req)).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls, "no round trip");
        // ...but a copy of a stored record now: a missed purge may have been for it.
        assert_eq!(a.forget_copies(), 1);
        assert!(a.cached(&req.key).is_none());
    }

    /// The body of a replayed 201, or a panic naming what came instead.
    fn replayed_body(outcome: Result<ClaimOutcome, StoreError>) -> Vec<u8> {
        match outcome {
            Ok(ClaimOutcome::Existing(Record {
                state: RecordState::Completed(Completion::Response(r)),
                ..
            })) => r.body().to_vec(),
            other => panic!("not a replay: {other:?}"),
        }
    }

    /// A completion refused because a newer execution took its key over (its lock lapsed)
    /// drops its own entry here and nothing else. When the newer execution is this replica's,
    /// its claim still counts as held here and, once its own write fails, its answer is kept
    /// and replayed with the store down. (Taken for a purge, the refusal dropped both, and a
    /// retry here with the store down again ran the key a third time under `pass`.)
    #[tokio::test]
    async fn a_taken_over_completion_drops_only_its_own_entry() {
        use crate::store::retry::{CompletionRetrier, Refusal, RetryOptions};
        let (shared, a, b) = two_replicas();
        let a = Arc::new(a);
        let dir = tempfile::tempdir().unwrap();
        let options = RetryOptions {
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(20),
            dead_letter_path: dir.path().join("dead.jsonl"),
            ..RetryOptions::default()
        };
        let (retrier, worker) = CompletionRetrier::new(shared.clone(), a.retry_hooks(), options);
        tokio::spawn(worker);
        let lapsing = |n: u8| ClaimRequest {
            lock_ttl: Duration::from_millis(1),
            ..claim("t", n)
        };

        // E1's lock lapses and E2, a retry, takes the key over on this same replica.
        let e1 = lapsing(27);
        a.claim(&e1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let e2 = retry_of(&claim("t", 27));
        let taken = a.claim(&e2).await.unwrap();
        assert!(matches!(taken, ClaimOutcome::Acquired { .. }), "{taken:?}");
        // E1's answer comes while E2 runs: refused, and settled as taken over.
        let written = a.complete(&e1.key, e1.owner, response(b"first"), e1.ttl);
        assert_eq!(written.await.unwrap(), WriteOutcome::NotOwner);
        let first = job_of(&e1, b"first", Duration::ZERO);
        assert_eq!(
            retrier.refused(first.clone(), a.as_ref()).await,
            Refusal::TakenOver
        );
        assert!(
            a.own_claim(&e2.key).is_some(),
            "E2's claim no longer counts as held here"
        );
        // E2's write fails: its answer is kept here, the only trace of it...
        shared.set(Fault::CompleteFails);
        let written = a.complete(&e2.key, e2.owner, response(b"second"), e2.ttl);
        assert!(written.await.is_err());
        shared.set(Fault::None);
        assert!(a.cached(&e2.key).is_some(), "E2's answer was not kept");
        // ...and stays through another refusal of E1's.
        assert_eq!(retrier.refused(first, a.as_ref()).await, Refusal::TakenOver);
        shared.set(Fault::Down);
        assert_eq!(replayed_body(a.claim(&retry_of(&e2)).await), b"second");
        shared.set(Fault::None);

        // The newer execution is another replica's: E1's own entry here goes, and this
        // replica replays what the store holds, as every other one does.
        let e1 = lapsing(28);
        executed_unstored(&a, &shared, &e1, b"first").await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        executed(&b, &retry_of(&e1), b"second").await;
        retrier.submit(job_of(&e1, b"first", Duration::ZERO));
        for _ in 0..200 {
            if retrier.pending() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(retrier.stats().fenced.load(Ordering::Relaxed), 1);
        assert_eq!(replayed_body(a.claim(&retry_of(&e1)).await), b"second");
    }

    #[tokio::test]
    async fn a_completion_given_up_on_stays_until_the_store_is_found_to_hold_it() {
        use crate::store::retry::{CompletionRetrier, RetryOptions};
        let (shared, a, _b) = two_replicas();
        let a = Arc::new(a);
        let (landed, lost) = (claim("t", 24), claim("t", 25));
        executed_unstored(&a, &shared, &landed, b"x").await;
        executed_unstored(&a, &shared, &lost, b"y").await;
        // The retrier, wired to A's cache as the server wires it, gets nowhere: one attempt
        // each, and their locks taken as lapsed, so both are dead-lettered.
        let dir = tempfile::tempdir().unwrap();
        let hooks = a.retry_hooks();
        let options = RetryOptions {
            attempts: 1,
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(5),
            dead_letter_path: dir.path().join("dead.jsonl"),
            ..RetryOptions::default()
        };
        shared.set(Fault::Down);
        let (retrier, worker) = CompletionRetrier::new(shared.clone(), hooks, options);
        tokio::spawn(worker);
        for (req, body) in [(&landed, b"x"), (&lost, b"y")] {
            retrier.submit(job_of(req, body, Duration::ZERO));
        }
        for _ in 0..200 {
            if retrier.pending() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 2);
        shared.set(Fault::None);
        // The first write of one had reached the store after all (it timed out here).
        let late = shared.complete(&landed.key, landed.owner, response(b"x"), landed.ttl);
        assert_eq!(late.await.unwrap(), WriteOutcome::Applied);
        // The purge channel is back: a drop of every copy leaves both, as either may be the
        // only trace of its answer...
        assert_eq!(a.forget_copies(), 0);
        assert!(a.cached(&landed.key).is_some() && a.cached(&lost.key).is_some());
        // ...until the store is found to hold it.
        assert_eq!(
            a.check_given_up().await,
            GivenUpCheck {
                landed: 1,
                replaced: 0
            }
        );
        assert!(
            a.cached(&landed.key).is_none(),
            "kept apart from the store that holds it"
        );
        let calls = shared.calls.load(Ordering::Relaxed);
        let replay = a.claim(&retry_of(&landed)).await.unwrap();
        assert!(matches!(replay, ClaimOutcome::Existing(_)), "{replay:?}");
        assert_eq!(
            shared.calls.load(Ordering::Relaxed),
            calls + 1,
            "from the store"
        );
        // The one the store lacks is still replayed here, never executed again.
        let replay = a.claim(&retry_of(&lost)).await.unwrap();
        assert!(matches!(replay, ClaimOutcome::Existing(_)), "{replay:?}");
        assert_eq!(
            shared.calls.load(Ordering::Relaxed),
            calls + 1,
            "from the cache"
        );
        assert_eq!(a.check_given_up().await, GivenUpCheck::default());
        assert!(a.cached(&lost.key).is_some());
    }

    /// One check of the given-up entries runs at a time: a second, while the first waits on a
    /// slow store, asks it nothing.
    #[tokio::test]
    async fn one_check_of_given_up_entries_runs_at_a_time() {
        let (shared, a, _b) = two_replicas();
        let a = Arc::new(a);
        let req = claim("t", 24);
        executed_unstored(&a, &shared, &req, b"x").await;
        a.completion_given_up(&req.key, req.owner);
        shared.set(Fault::GetStalls);
        let before = shared.calls.load(Ordering::Relaxed);
        let first = tokio::spawn({
            let a = a.clone();
            async move { a.check_given_up().await }
        });
        while shared.calls.load(Ordering::Relaxed) == before {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let second = tokio::time::timeout(Duration::from_secs(2), a.check_given_up()).await;
        assert_eq!(
            second.ok(),
            Some(GivenUpCheck::default()),
            "the second check waited for the store"
        );
        assert_eq!(
            shared.calls.load(Ordering::Relaxed),
            before + 1,
            "the second check asked the store nothing"
        );
        shared.set(Fault::None);
        assert_eq!(
            first.await.unwrap(),
            GivenUpCheck::default(),
            "the store lacks it: kept"
        );
        assert_eq!(
            shared.calls.load(Ordering::Relaxed),
            before + 2,
            "the check asked for meanwhile ran once the first was done"
        );
        // Done: the next check runs.
        let calls = shared.calls.load(Ordering::Relaxed);
        a.check_given_up().await;
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls + 1);
    }

    /// A given-up entry gives way to another execution's completion the store holds (the key
    /// ran again elsewhere once the record was lost): this replica then replays what every
    /// other one does, instead of its own answer for the whole ttl. It is checked though the
    /// checks before it found nothing given up (and skipped their scans from then on).
    #[tokio::test]
    async fn a_given_up_entry_gives_way_to_the_completion_the_store_holds() {
        let (shared, a, b) = two_replicas();
        assert_eq!(a.check_given_up().await, GivenUpCheck::default());
        assert_eq!(a.check_given_up().await, GivenUpCheck::default());
        let req = claim("t", 23);
        executed_unstored(&a, &shared, &req, b"mine").await;
        a.completion_given_up(&req.key, req.owner);
        // The record is lost, and B executes the key anew.
        assert!(shared.delete(&req.key).await.unwrap());
        executed(&b, &retry_of(&req), b"theirs").await;
        assert_eq!(
            a.check_given_up().await,
            GivenUpCheck {
                landed: 0,
                replaced: 1
            }
        );
        assert_eq!(replayed_body(a.claim(&retry_of(&req)).await), b"theirs");
    }

    /// Given-up entries are checked again every so often, not only when Redis comes back: a key
    /// whose record was lost may run again on another replica at any time after, with Redis up
    /// all along, and this replica then follows the store within a period rather than replay
    /// its own answer for the record's whole ttl (found by an operator probe: 24 h).
    #[tokio::test]
    async fn given_up_entries_are_checked_again_while_they_last() {
        let (shared, a, b) = two_replicas();
        let a = Arc::new(a);
        let req = claim("t", 29);
        executed_unstored(&a, &shared, &req, b"mine").await;
        a.completion_given_up(&req.key, req.owner);
        assert!(shared.delete(&req.key).await.unwrap());
        tokio::spawn({
            let a = a.clone();
            async move { a.recheck_given_up_every(Duration::from_millis(20)).await }
        });
        // Checked and kept while the store lacks it: the only trace of its answer.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(replayed_body(a.claim(&retry_of(&req)).await), b"mine");
        executed(&b, &retry_of(&req), b"theirs").await;
        let deadline = Instant::now() + Duration::from_secs(2);
        while replayed_body(a.claim(&retry_of(&req)).await) != b"theirs" {
            assert!(Instant::now() < deadline, "still replaying its own answer");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The store loses the record of a key this replica is running (a restart without
    /// persistence), and a retry reaches this replica: the store would have it run again
    /// beside the execution running here. Instead the record is claimed again for the running
    /// execution, whose answer is then stored and replayed, and the retry is told to wait.
    /// Released by its own request, or purged here, the key runs as before.
    #[tokio::test]
    async fn a_record_lost_while_its_key_runs_here_is_claimed_again_not_run_beside_it() {
        let (shared, a, b) = two_replicas();
        let fresh = |req: &ClaimRequest, id: u64| ClaimRequest {
            execution_id: id,
            ..retry_of(req)
        };
        let req = claim("t", 41);
        acquired(&a, &req).await;
        assert!(shared.delete(&req.key).await.unwrap());
        let outcome = a.claim(&fresh(&req, 900)).await.unwrap();
        let ClaimOutcome::Existing(Record {
            execution_id,
            state: RecordState::InFlight { lock_remaining },
            ..
        }) = outcome
        else {
            panic!("the retry ran beside the running execution: {outcome:?}");
        };
        assert_eq!(execution_id, req.execution_id);
        assert!(lock_remaining > Duration::ZERO);
        let record = shared.get(&req.key).await.unwrap().expect("claimed again");
        assert_eq!(record.execution_id, req.execution_id);
        assert!(matches!(record.state, RecordState::InFlight { .. }));
        // Another replica is told to wait too, and the running execution's answer is stored.
        assert!(matches!(
            b.claim(&fresh(&req, 901)).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        let stored = a.complete(&req.key, req.owner, response(b"first"), req.ttl);
        assert_eq!(stored.await.unwrap(), WriteOutcome::Applied);
        assert_eq!(replayed_body(b.claim(&fresh(&req, 902)).await), b"first");

        // Released by its own request: the retry runs.
        let released = claim("t", 42);
        acquired(&a, &released).await;
        assert_eq!(
            a.release(&released.key, released.owner).await.unwrap(),
            WriteOutcome::Applied
        );
        acquired(&a, &fresh(&released, 903)).await;

        // Purged here while it ran: the retry runs.
        let purged = claim("t", 43);
        acquired(&a, &purged).await;
        assert!(a.delete(&purged.key).await.unwrap());
        acquired(&a, &fresh(&purged, 904)).await;
    }

    #[tokio::test]
    async fn a_completion_stored_after_every_copy_was_dropped_is_read_again() {
        let (shared, a, _b) = two_replicas();
        let req = claim("t", 22);
        executed_unstored(&a, &shared, &req, b"x").await;
        // The purge channel comes back while the write is retried: the entry stays.
        assert_eq!(a.forget_copies(), 0);
        // Another execution's write of the record says nothing about this one.
        a.completion_stored(&req.key, OwnerToken(req.owner.0 + 1));
        assert!(a.cached(&req.key).is_some());
        assert_eq!(a.forget_copies(), 0);
        // The retry lands. It may have landed before a purge the drop stood for: the entry
        // goes at once, and the store answers.
        a.completion_stored(&req.key, req.owner);
        assert!(a.cached(&req.key).is_none(), "kept across a missed purge");
        let calls = shared.calls.load(Ordering::Relaxed);
        assert!(matches!(
            a.claim(&retry_of(&req)).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls + 1);
    }

    #[tokio::test]
    async fn a_completion_stored_while_every_copy_was_dropped_is_not_kept() {
        let store = cached();
        let req = claim("t", 23);
        let writing = completing_while_stalled(&store, &req).await;
        // The purge channel comes back while the write is out, and the write then lands: it may
        // have landed before a purge the drop stood for.
        store.forget_copies();
        store.inner().set(Fault::None);
        assert_eq!(writing.await.unwrap().unwrap(), WriteOutcome::Applied);
        assert!(
            store.cached(&req.key).is_none(),
            "kept across a missed purge"
        );
    }

    #[tokio::test]
    async fn a_purge_missed_while_unsubscribed_takes_a_completion_of_this_replica_too() {
        let (_shared, a, b) = two_replicas();
        let req = claim("t", 20);
        executed(&a, &req, b"first").await;
        // Purged through B (its admin API) while A's purge channel is down: A misses it.
        assert!(b.delete(&req.key).await.unwrap());
        // A listens again and drops what the missed purges may have been for: the store took
        // A's completion, so it is A's copy of a stored record like any other.
        assert_eq!(a.forget_copies(), 1);
        assert!(a.cached(&req.key).is_none(), "A kept the purged answer");
        // A retry on A executes again, as one on B would: no replay of the purged answer.
        let outcome = a.claim(&retry_of(&req)).await.unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Acquired { .. }),
            "{outcome:?}"
        );
    }

    #[tokio::test]
    async fn a_copy_read_while_this_replica_deletes_the_record_is_not_kept() {
        let (shared, a, b) = two_replicas();
        let req = claim("t", 12);
        executed(&a, &req, b"x").await;
        // B's delete is slow to reach the store; a claim B sends meanwhile still finds the
        // record there.
        shared.set(Fault::DeleteStalls);
        let b = Arc::new(b);
        let deleting = tokio::spawn({
            let (b, key) = (b.clone(), req.key.clone());
            async move { b.delete(&key).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let retry = retry_of(&req);
        assert!(matches!(
            b.claim(&retry).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        shared.set(Fault::None);
        assert!(deleting.await.unwrap().unwrap());
        assert!(
            b.cached(&req.key).is_none(),
            "B kept a copy of the record it deleted"
        );
        assert!(matches!(
            b.claim(&retry).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }

    #[tokio::test]
    async fn dropping_copies_spares_a_completion_whose_write_is_out() {
        let store = cached();
        let req = claim("t", 13);
        let writing = completing_while_stalled(&store, &req).await;
        // The purge channel comes back while the write is out, and the write then fails: the
        // completion is still this replica's to replay while it is retried.
        store.forget_copies();
        store.inner().set(Fault::CompleteFails);
        assert!(writing.await.unwrap().is_err());
        assert!(
            store.cached(&req.key).is_some(),
            "the completion was dropped with the copies"
        );
    }

    #[tokio::test]
    async fn a_wait_that_ends_on_another_replicas_completion_keeps_a_copy() {
        let (shared, a, b) = two_replicas();
        let req = claim("t", 14);
        a.claim(&req).await.unwrap();
        let b = Arc::new(b);
        let waiting = tokio::spawn({
            let (b, key) = (b.clone(), req.key.clone());
            async move { b.wait_for_change(&key, Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        a.complete(&req.key, req.owner, response(b"a's"), req.ttl)
            .await
            .unwrap();
        let record = waiting.await.unwrap().unwrap().expect("record");
        assert_eq!(record.state, RecordState::Completed(response(b"a's")));
        assert_eq!(b.stats().copied.load(Ordering::Relaxed), 1);
        // The next retry on B is answered from the copy.
        let calls = shared.calls.load(Ordering::Relaxed);
        assert!(matches!(
            b.claim(&retry_of(&req)).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls, "no round trip");
    }

    #[tokio::test]
    async fn a_wait_that_outlasts_the_records_life_keeps_no_copy() {
        let (_shared, a, b) = two_replicas();
        let req = claim("t", 16);
        a.claim(&req).await.unwrap();
        let b = Arc::new(b);
        let waiting = tokio::spawn({
            let (b, key) = (b.clone(), req.key.clone());
            async move { b.wait_for_change(&key, Duration::from_secs(5)).await }
        });
        // The wait began 150 ms before a completion that lives 60 ms: counted from the wait's
        // start, the copy's life is over before it could be kept.
        tokio::time::sleep(Duration::from_millis(150)).await;
        a.complete(
            &req.key,
            req.owner,
            response(b"a's"),
            Duration::from_millis(60),
        )
        .await
        .unwrap();
        let record = waiting.await.unwrap().unwrap().expect("record");
        assert_eq!(record.state, RecordState::Completed(response(b"a's")));
        assert_eq!(b.stats().copied.load(Ordering::Relaxed), 0);
        assert!(b.cached(&req.key).is_none());
    }

    #[tokio::test]
    async fn a_copy_never_replaces_a_completion_of_this_replica() {
        let store = cached();
        let req = claim("t", 15);
        store.claim(&req).await.unwrap();
        store.inner().set(Fault::CompleteFails);
        // The write failed: the local entry is the only trace of the answer.
        assert!(store
            .complete(&req.key, req.owner, response(b"mine"), req.ttl)
            .await
            .is_err());
        let read = Record {
            fingerprint: [7; 32],
            execution_id: 15,
            state: RecordState::Completed(response(b"mine")),
            expires_in: None,
        };
        let mark = store.mark(&req.key.hash);
        let later = Instant::now() + Duration::from_secs(60);
        assert!(!store.remember(&req.key, read, later, Origin::Copy(mark)));
        // Still this replica's own: dropping every copy keeps it.
        assert_eq!(store.forget_copies(), 0);
        assert!(store.cached(&req.key).is_some());
    }

    #[tokio::test]
    async fn delete_forgets_the_local_copy() {
        let store = cached();
        let req = claim("t", 6);
        executed(&store, &req, b"x").await;
        assert!(store.delete(&req.key).await.unwrap());
        let again = ClaimRequest {
            owner: OwnerToken::random(),
            ..req
        };
        assert!(matches!(
            store.claim(&again).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }

    /// A settled delete the store refuses (the record is in flight: its completion's write
    /// failed and is being retried) leaves this replica's trace of the answer, and a settled
    /// delete that goes through drops it.
    #[tokio::test]
    async fn a_refused_settled_delete_keeps_the_only_trace_of_an_answer() {
        let (shared, a, _b) = two_replicas();
        let req = claim("t", 25);
        executed_unstored(&a, &shared, &req, b"answer").await;
        shared.set(Fault::None);
        assert!(matches!(
            a.delete_settled(&req.key).await.unwrap(),
            Deletion::Running { .. }
        ));
        assert!(a.cached(&req.key).is_some(), "the trace is kept");
        let retry = a.claim(&retry_of(&req)).await.unwrap();
        assert!(matches!(retry, ClaimOutcome::Existing(_)), "{retry:?}");
        // Once it no longer runs (released), the delete goes through, the trace too.
        shared.release(&req.key, req.owner).await.unwrap();
        assert_eq!(a.delete_settled(&req.key).await.unwrap(), Deletion::Deleted);
        assert!(a.cached(&req.key).is_none());
    }
}
