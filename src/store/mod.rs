//! The record store seam: the one trait every backend (memory, Redis, test fakes) implements.
//!
//! A record is the idempotency state of one scoped key. Its life:
//!
//! ```text
//!   (absent) --claim--> InFlight{owner} --complete(owner)--> Completed | Unreplayable
//!                          |     ^
//!                  release(owner) | claim (lock lapsed or released)
//!                          v     |
//!                        Released
//! ```
//!
//! The execution id is minted at the first claim and kept for the life of the record, so every
//! execution of one key carries the same `X-Idempotency-Id`. Completion and release are
//! compare-and-set on the owner token: a claimer whose lock lapsed cannot overwrite a newer owner.

pub mod breaker;
pub mod cached;
pub mod codec;
pub mod conformance;
pub mod eviction;
pub mod faulty;
pub mod memory;
pub mod purge;
pub mod redis;
pub mod response;
pub mod restarts;
pub mod retry;
pub mod script_set;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

pub use self::memory::MemoryStore;
pub use self::redis::{RedisStore, Scripts};
pub use self::response::{ResponseBuilder, StoredResponse};

/// SHA-256 digest used for record ids and fingerprints.
pub type Digest = [u8; 32];

/// A digest written as 64 hex digits (either case), as record ids appear in Redis key names,
/// purge messages, dead-letter lines and the admin API; `None` for anything else.
pub fn parse_digest(hex_digits: &str) -> Option<Digest> {
    hex::decode(hex_digits).ok()?.try_into().ok()
}

/// Drops this replica's local copy of a record (its local cache entry), when it keeps one: on a
/// purge announced by any replica.
pub type ForgetLocal = Arc<dyn Fn(&RecordKey) + Send + Sync>;

/// Tells this replica's local cache what became of its completion of a record whose first
/// write failed, by the owner token of the claim it completes (not the execution id, which a
/// takeover of a lapsed lock keeps): the store took it, it was given up on, or it lost the key.
pub type StoredLocal = Arc<dyn Fn(&RecordKey, OwnerToken) + Send + Sync>;

/// Identifies one record: the tenant (kept readable for key naming and admin) and the scoped hash.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordKey {
    /// Validated tenant, `[A-Za-z0-9._:-]{1,128}`.
    pub tenant: String,
    /// SHA-256 over (tenant, scope values, key), length-prefixed.
    pub hash: Digest,
}

/// A random token naming the holder of an in-flight claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub u128);

impl OwnerToken {
    /// A fresh random token.
    pub fn random() -> Self {
        OwnerToken(rand::random())
    }
}

/// What a claimer asks the store for.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// The record to claim or read.
    pub key: RecordKey,
    /// Fingerprint of this request (method, path, body, chosen headers).
    pub fingerprint: Digest,
    /// The claimer's owner token.
    pub owner: OwnerToken,
    /// Execution id to use when the record is created; an existing record keeps its own.
    pub execution_id: u64,
    /// How long the in-flight claim lives before another request may take over.
    pub lock_ttl: Duration,
    /// How long the record (in any state) is kept once created or released.
    pub ttl: Duration,
}

/// How an execution ended, as written by `complete`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// The response is stored and will be replayed.
    Response(Arc<StoredResponse>),
    /// The response was larger than `max_response_bytes`: the key is spent but cannot be replayed.
    Unreplayable {
        /// Status the backend answered with, for diagnostics.
        status: u16,
    },
}

/// The word a store picks a record's shard by: the record hash's first eight bytes through
/// SipHash with the store's own random `keys`. Record hashes are SHA-256 of what clients send, so
/// a client grinding keys could fix any few bits of them and pile its records into one shard;
/// it cannot aim at keys it does not know.
pub(crate) fn keyed_shard_word(keys: &std::hash::RandomState, hash: &Digest) -> u64 {
    std::hash::BuildHasher::hash_one(keys, digest_word(hash, 0))
}

/// The `index`-th little-endian 64-bit word of a digest (`index` < 4).
pub(crate) fn digest_word(digest: &Digest, index: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&digest[index * 8..index * 8 + 8]);
    u64::from_le_bytes(word)
}

impl Completion {
    /// The status the backend answered with.
    pub fn status(&self) -> u16 {
        match self {
            Completion::Response(response) => response.status,
            Completion::Unreplayable { status } => *status,
        }
    }

    /// Bytes its stored response holds in memory (none for one not replayable).
    pub fn response_bytes(&self) -> usize {
        match self {
            Completion::Response(response) => response.size_bytes(),
            Completion::Unreplayable { .. } => 0,
        }
    }
}

/// The state of a record as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed and executing; the lock lapses after `lock_remaining`.
    InFlight {
        /// Time left on the holder's lock.
        lock_remaining: Duration,
    },
    /// The last execution was released (transient failure): the next claim executes again.
    Released,
    /// Finished; `Completion` says whether it can be replayed.
    Completed(Completion),
}

/// A record as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Fingerprint of the request that created the record.
    pub fingerprint: Digest,
    /// Execution id minted at the first claim.
    pub execution_id: u64,
    /// Current state.
    pub state: RecordState,
    /// How long the store keeps a completed record from the moment it was read, when the store
    /// says (the embedded store always; Redis from the built-in scripts' claim and get), so
    /// a replica may keep a local copy of a record another replica completed for no longer than
    /// the shared one lives. `None` for records in any other state.
    pub expires_in: Option<Duration>,
}

/// Answer to a claim: the caller now owns the record, or it already existed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller holds the claim and must execute, then `complete` or `release`.
    Acquired {
        /// The record's execution id (the request's own for a new record, the old one otherwise).
        execution_id: u64,
        /// The claim took over a record in flight under another owner whose lock had lapsed:
        /// that execution's outcome is unknown (its replica died, or lost the store for longer
        /// than the lock). False for a new record, a released one and the owner's own renewal;
        /// false too from a script version that does not say (the field is optional in the
        /// Lua contract).
        lapsed: bool,
    },
    /// Someone else created the record; nothing was changed.
    Existing(Record),
}

/// Answer to `complete` and `release`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The write took effect.
    Applied,
    /// The caller no longer owns the record (lock lapsed and another request claimed it, or the
    /// record expired); nothing was changed.
    NotOwner,
}

/// Answer to [`RecordStore::delete_settled`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// The record was removed.
    Deleted,
    /// There was no record (or only an expired one).
    Absent,
    /// The record is in flight: its execution may still be running, so it was left as it is.
    Running {
        /// Time left on the holder's lock (zero once it lapsed).
        lock_remaining: Duration,
    },
}

/// Failures of the store itself (not of the request).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot take a new record without dropping a live one.
    #[error("record store is full ({used} of {capacity} bytes in use)")]
    Full {
        /// Bytes in use.
        used: usize,
        /// Configured capacity.
        capacity: usize,
    },
    /// Redis refused a write for want of memory (`maxmemory` reached under the `noeviction`
    /// policy). Like [`StoreError::Full`] it is no outage: the store answered, so the outage
    /// policy does not apply (`pass` would forward every keyed request unprotected while Redis
    /// is full) and the circuit does not open.
    #[error("record store is out of memory: {0}")]
    OutOfMemory(String),
    /// The store could not be reached or answered in time.
    #[error("record store unavailable: {0}")]
    Unavailable(String),
    /// The store answered, but with something this version cannot use: a record it cannot
    /// read, or (Redis) an error raised by a script. No outage: retrying would meet it again.
    #[error("record store answered with what this proxy cannot use: {0}")]
    Corrupt(String),
}

/// The record store: atomic claim, fenced completion and release, and waiting for a change.
#[async_trait]
pub trait RecordStore: Send + Sync + 'static {
    /// Claims the record if absent, released, or its lock lapsed; otherwise reads it. A claim
    /// by the lock's own owner (same owner token and fingerprint) renews the lock: a re-send
    /// after a lost connection, or the proxy keeping the lock while it waits for an answer.
    /// One atomic step: two concurrent claims never both acquire.
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError>;

    /// Claims the record again as its owner, to keep the lock of an execution that is still
    /// running: [`RecordStore::claim`], except that it takes only a lock this owner holds
    /// (lapsed or not) or an absent record. A record it released, completed, or another owner
    /// holds is answered unchanged, lapsed lock or not: a renewal may reach the store after
    /// the release it raced, and must not lock the key again for nobody. A layer that stops
    /// calling a failing store (the circuit breaker) still sends renewals: past the lock's
    /// deadline, the first renewal to reach the store again takes the lapsed lock back, and
    /// held back by an open circuit it would leave a retry elsewhere up to `open_for` to take
    /// the key over beside the running execution.
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError>;

    /// How many parts the store's keys are spread over that can fail apart from each other (a
    /// Redis Cluster's slot ranges), so the circuit breaker keeps one circuit per part: one
    /// unless the store says otherwise.
    fn parts(&self) -> usize {
        1
    }

    /// The part `key` lives on (below [`RecordStore::parts`]).
    fn part_of(&self, _key: &RecordKey) -> usize {
        0
    }

    /// Probes part `part` as [`RecordStore::ping`] probes the whole store.
    async fn ping_part(&self, _part: usize) -> Result<(), StoreError> {
        self.ping().await
    }

    /// Probes where `key`'s record lives (its Cluster slot) as [`RecordStore::ping`] probes the
    /// whole store.
    async fn ping_near(&self, _key: &RecordKey) -> Result<(), StoreError> {
        self.ping().await
    }

    /// Stores the outcome if `owner` still holds the claim; the record then lives for `ttl`.
    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError>;

    /// Drops the claim if `owner` still holds it, keeping fingerprint and execution id so the
    /// next claim executes again under the same id.
    async fn release(&self, key: &RecordKey, owner: OwnerToken)
        -> Result<WriteOutcome, StoreError>;

    /// Waits until the record is no longer in flight (completed, released, lock lapsed or gone)
    /// or `timeout` passes, and returns what it then reads. Does not poll hot.
    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError>;

    /// Reads a record without changing it.
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError>;

    /// Removes a record whatever its state (admin purge with `?force=true`). Returns whether
    /// one existed.
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError>;

    /// Removes a record unless it is in flight, its lock running or lapsed (admin purge): a
    /// lapsed lock's execution may still be running on a replica cut off from the store, and
    /// a retry takes the key over under the same execution id, which a purge would lose.
    /// One atomic step: a claim landing at the same moment is either removed before it was
    /// made (and then runs on an absent record) or seen and spared, never taken from the
    /// execution that holds it, as a read followed by a delete could.
    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError>;

    /// Checks the store can serve requests (readiness). The embedded store always can.
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Bytes and records held, where the backend knows them (for metrics).
    fn usage(&self) -> Option<StoreUsage> {
        None
    }

    /// Whether a completion this store refused ("not the owner") can never be an earlier send
    /// of the same completion that landed: the embedded store answers every write at once, and
    /// Redis remembers a completion by an id every send of it carries (one per owner and
    /// answer) and answers the repeat "applied" itself. Then a record holding the same answer
    /// under the same execution id is another execution's (a takeover after the lock lapsed,
    /// answering alike), which the completion retrier must not count as its own. False for a
    /// store that cannot say.
    fn refusals_are_final(&self) -> bool {
        false
    }

    /// What is left of the lock of a claim on `key` that this process holds (claimed here and
    /// neither completed nor released yet), where the store keeps track without asking anyone
    /// (the local cache does); `None` when it holds none or cannot tell. Asked when the store
    /// fails: a key this replica is running must not run again beside it under the outage
    /// policy.
    fn own_claim(&self, _key: &RecordKey) -> Option<Duration> {
        None
    }

    /// A completed record of `key` this process keeps a copy of, where the store keeps one
    /// without asking anyone (the local cache does). Asked when the store fails, after
    /// [`RecordStore::own_claim`]: a completion here keeps its answer before it lets go of its
    /// claim, so a retry asked in that order sees one of the two, and is not run again beside
    /// an execution that just ended.
    fn local_copy(&self, _key: &RecordKey) -> Option<Record> {
        None
    }
}

/// The record `fallback` (the in-process store `on_unavailable: local` falls back to) holds
/// for `key`, if any: a key this replica ran there during an outage is answered from there while
/// its record lives. Looked up only while it holds anything, as it is empty but for outages.
pub async fn fallback_record(fallback: &dyn RecordStore, key: &RecordKey) -> Option<Record> {
    if fallback.usage().is_none_or(|u| u.records == 0) {
        return None;
    }
    fallback.get(key).await.ok().flatten()
}

/// Size of what a store holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Records held, all states.
    pub records: usize,
    /// Bytes accounted against the capacity.
    pub bytes: usize,
    /// Configured capacity in bytes.
    pub capacity: usize,
    /// Answers there was no room for, kept as their status alone (not replayable).
    pub answers_kept_as_status: u64,
}

/// A shared handle is a store too, so layers can wrap a store that is also used elsewhere (e.g.
/// the Redis store the warm-up task connects).
#[async_trait]
impl<S: RecordStore + ?Sized> RecordStore for Arc<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(req).await
    }
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        (**self).renew(req).await
    }
    fn parts(&self) -> usize {
        (**self).parts()
    }
    fn part_of(&self, key: &RecordKey) -> usize {
        (**self).part_of(key)
    }
    async fn ping_part(&self, part: usize) -> Result<(), StoreError> {
        (**self).ping_part(part).await
    }
    async fn ping_near(&self, key: &RecordKey) -> Result<(), StoreError> {
        (**self).ping_near(key).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        (**self).complete(key, owner, completion, ttl).await
    }
    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        (**self).release(key, owner).await
    }
    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        (**self).wait_for_change(key, timeout).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        (**self).get(key).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        (**self).delete(key).await
    }
    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        (**self).delete_settled(key).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        (**self).ping().await
    }
    fn usage(&self) -> Option<StoreUsage> {
        (**self).usage()
    }
    fn refusals_are_final(&self) -> bool {
        (**self).refusals_are_final()
    }
    fn local_copy(&self, key: &RecordKey) -> Option<Record> {
        (**self).local_copy(key)
    }
    fn own_claim(&self, key: &RecordKey) -> Option<Duration> {
        (**self).own_claim(key)
    }
}
