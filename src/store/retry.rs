//! Completions the store failed to take are retried in the background (exponential backoff with
//! "equal" jitter, bounded queue), and after the last attempt written to a dead-letter file: nothing
//! the backend returned is silently dropped.
//!
//! The claim's lock is what keeps every other request from executing the key again, so it is
//! also the real deadline of a retry: a completion is never given up while its lock may still
//! hold (however many attempts that takes), and no backoff sleeps past the lock's deadline —
//! what is left is halved instead — so a store that is back before the lock lapses gets the
//! completion before another request can claim the key. (Attempts made while the circuit
//! breaker is open fail at once; a fixed attempt budget used to run out during a few seconds'
//! outage, and the key then executed again once its lock lapsed.) A completion still waiting when
//! a shutdown's grace period runs out, or when the process stops, is dead-lettered then
//! ([`CompletionRetrier::dead_letter_pending`]); so is one whose first write is still out when
//! its request's task is dropped, as pingora drops them all at the end of the grace period
//! ([`CompletionRetrier::abandoned`]).
//!
//! The dead-letter file is JSON lines, one record per line, body in base64, so an operator can
//! reconcile (or re-inject) what the store never received. A `NotOwner` answer during a retry
//! means the lock lapsed and another request took the key over: that response is dead-lettered
//! too, since the store now belongs to the newer execution, and this replica's local copy of it
//! is dropped so the replica replays what the store holds, like every other replica. A
//! completion a retry stores is reported to the local cache too: its entry there was kept as the
//! only trace of the answer, and is from then on a copy of a stored record, which a missed purge
//! must be able to take ([`LocalHooks`]). So is one dead-lettered without knowing whether the
//! store took it: no retry will say, so the cache finds out for itself.
//!
//! Dead-letter lines are written by a thread of their own, never by the caller: each write takes
//! an exclusive `flock` (another process may hold it: the other half of a rolling restart) and
//! an fsync, and during an outage every keyed completion may be dead-lettered, so on a request
//! thread each would wait that long. A line counts as pending until it is written, so shutdown
//! waits for it as for a retry. When the file cannot take a line, the whole line goes straight
//! to stderr instead: the batched log writer may drop lines (over its cap, or at exit), and
//! this is the completion's last copy.
//!
//! The retrier writes to and reads from the shared store itself, beneath the local cache: the
//! cache keeps the completion whose first write failed (it is the backend's real answer), so
//! asking the cache whether a write landed would always say yes.
//!
//! The queue is bounded by the completions waiting, whether queued or between attempts
//! (`queue_capacity`); one more goes straight to the dead-letter file, so an outage under load
//! cannot grow the proxy's memory without bound.

use std::collections::HashMap;
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::TrySendError;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use futures_util::FutureExt;
use parking_lot::Mutex;
use rand::Rng;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{
    Completion, Digest, OwnerToken, Record, RecordKey, RecordState, RecordStore, StoreError,
    StoredLocal, WriteOutcome,
};

/// Retry settings.
#[derive(Clone, Debug)]
pub struct RetryOptions {
    /// Attempts after the failed original write, at least; more while the claim's lock holds.
    pub attempts: u32,
    /// First backoff; doubles every attempt.
    pub base_delay: Duration,
    /// Backoff ceiling.
    pub max_delay: Duration,
    /// Completions waiting at most (queued or between attempts); beyond it they go straight to
    /// the dead-letter file.
    pub queue_capacity: usize,
    /// Bytes of stored responses waiting at most: a long outage of large responses would
    /// otherwise hold `queue_capacity` × `max_response_bytes`; beyond it they go straight to
    /// the dead-letter file too.
    pub queue_bytes: usize,
    /// Where dead letters are appended.
    pub dead_letter_path: PathBuf,
    /// Where the records live, written on every dead-letter line.
    pub store: LetterStore,
}

/// Where the records a dead letter names live, written on its line (`"store"`, and
/// `"key_prefix"` for Redis), so `idemgate --reconcile` judges each line against the keys it was
/// written for: a file shared by proxies with different prefixes, or a config whose prefix
/// changed since, would otherwise have its lines judged against records they never named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LetterStore {
    /// The embedded store: its records ended with the process that wrote the line.
    Memory,
    /// Redis, under `store.redis.key_prefix`.
    Redis {
        /// The key prefix.
        key_prefix: String,
    },
}

impl Default for RetryOptions {
    fn default() -> Self {
        RetryOptions {
            attempts: 8,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(5),
            queue_capacity: 10_000,
            queue_bytes: 256 << 20,
            dead_letter_path: PathBuf::from("idemgate-dead-letter.jsonl"),
            store: LetterStore::Memory,
        }
    }
}

/// One completion to write.
#[derive(Clone, Debug)]
pub struct PendingCompletion {
    /// The record.
    pub key: RecordKey,
    /// The claim's owner token.
    pub owner: OwnerToken,
    /// What to store.
    pub completion: Completion,
    /// Record TTL.
    pub ttl: Duration,
    /// Execution id, for the dead-letter line.
    pub execution_id: u64,
    /// Fingerprint of the request that claimed the record, for the dead-letter line: what a
    /// record restored from it (`idemgate --reconcile`) must carry so a changed retry still gets
    /// 422.
    pub fingerprint: Digest,
    /// When the claim's lock lapses at the earliest: the claim (or its last renewal) was sent,
    /// plus `lock_ttl` (the store starts the lock when it takes the claim, so its deadline is
    /// no earlier). Retries hurry to land before it, while the completion still surely wins.
    pub lock_deadline: Instant,
    /// The claim was made on the in-process fallback store (`on_unavailable: local`), not on
    /// the shared one: its dead-letter line says `"store": "memory"`.
    pub on_fallback: bool,
    /// When the claim's lock has lapsed for sure: the store's answer to the claim (or to its
    /// last renewal, or a renewal that failed but may have landed) came back, plus `lock_ttl`.
    /// Until then no other request can execute the key, so a store back in time still takes
    /// the completion: the retrier does not give up on it before.
    pub lapses_by: Instant,
}

/// Counters exported as metrics.
#[derive(Debug, Default)]
pub struct RetryStats {
    /// Completions queued for retry.
    pub queued: AtomicU64,
    /// Completions stored by a retry.
    pub recovered: AtomicU64,
    /// Completions dead-lettered: written to the dead-letter file, or to stderr when the file
    /// could not take them.
    pub dead_lettered: AtomicU64,
    /// Dead letters the file could not take (a full disk, a missing directory): each survives
    /// only as its line on stderr.
    pub dead_letter_write_failures: AtomicU64,
    /// Completions waiting right now: to be retried, or for their dead-letter line to be
    /// written.
    pub pending: AtomicUsize,
    /// Of those, the dead letters handed over and not written yet. They do not count against
    /// `queue_capacity`: a dead-letter file that hangs (a disk, another process's lock) must
    /// not turn every later failed write into a dead letter without one retry.
    pub letters: AtomicUsize,
    /// Retried completions the store refused because a newer execution holds the key (the
    /// lock lapsed and the key ran again): each is dead-lettered as `lock taken over`.
    pub fenced: AtomicU64,
}

impl RetryStats {
    /// A dead letter handed to the writer is out (to the file or to stderr): counted
    /// dead-lettered, and no longer waiting.
    fn letter_written(&self) {
        self.dead_lettered.fetch_add(1, Ordering::Relaxed);
        self.letters.fetch_sub(1, Ordering::AcqRel);
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the retrier tells the local cache in front of the store (nothing without one).
#[derive(Clone)]
pub struct LocalHooks {
    /// The completion of this record by this claim lost the key to a newer execution: its
    /// local entry goes, so this replica replays what the store holds. Only its own: the
    /// newer execution may be this replica's too, its entry the only trace of its answer.
    pub taken_over: StoredLocal,
    /// The store took the completion of this record by this claim: the local entry kept
    /// while the write was retried is now a copy of a stored record.
    pub stored: StoredLocal,
    /// The completion of this record by this claim was dead-lettered without knowing
    /// whether the store took it (the queue was full, or the last attempt failed): no retry
    /// will report it stored, so whether the local entry is a copy is for the cache to find out
    /// ([`crate::store::cached::CachedStore::completion_given_up`]).
    pub given_up: StoredLocal,
    /// The store refused this completion and its record is gone, or could not be read: nobody
    /// else holds the key, so the cache keeps the answer as given up on, whether or not it
    /// held it already, unless the key was purged there
    /// ([`crate::store::cached::CachedStore::keep_lost`]).
    pub lost: LostLocal,
}

/// See [`LocalHooks::lost`].
pub type LostLocal = Arc<dyn Fn(&PendingCompletion) + Send + Sync>;

impl LocalHooks {
    /// Hooks for a store with no local cache in front.
    pub fn none() -> Self {
        LocalHooks {
            taken_over: Arc::new(|_: &RecordKey, _: OwnerToken| {}),
            stored: Arc::new(|_: &RecordKey, _: OwnerToken| {}),
            given_up: Arc::new(|_: &RecordKey, _: OwnerToken| {}),
            lost: Arc::new(|_: &PendingCompletion| {}),
        }
    }
}

/// Handle to the background retrier.
#[derive(Clone)]
pub struct CompletionRetrier {
    tx: mpsc::Sender<(Job, u32)>,
    dead: Arc<DeadLetters>,
    local: LocalHooks,
    stats: Arc<RetryStats>,
    jobs: Arc<Jobs>,
    capacity: usize,
    capacity_bytes: usize,
}

/// A queued completion: its id in [`Jobs`].
type Job = u64;

/// Every completion not yet stored or dead-lettered, by job id. Whoever takes a job out settles
/// it (stores it, dead-letters it, or puts it back to retry), so a job is settled exactly once
/// even when the process stops while it waits.
#[derive(Default)]
struct Jobs {
    next: AtomicU64,
    waiting: Mutex<HashMap<Job, PendingCompletion>>,
    /// Bytes of the stored responses in `waiting`.
    bytes: AtomicUsize,
}

impl Jobs {
    fn add(&self, job: PendingCompletion) -> Job {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(job_bytes(&job), Ordering::AcqRel);
        self.waiting.lock().insert(id, job);
        id
    }

    fn get(&self, id: Job) -> Option<PendingCompletion> {
        self.waiting.lock().get(&id).cloned()
    }

    fn take(&self, id: Job) -> Option<PendingCompletion> {
        let job = self.waiting.lock().remove(&id)?;
        self.bytes.fetch_sub(job_bytes(&job), Ordering::AcqRel);
        Some(job)
    }

    /// Returns a taken job for another attempt, under the same id.
    fn put_back(&self, id: Job, job: PendingCompletion) {
        self.bytes.fetch_add(job_bytes(&job), Ordering::AcqRel);
        self.waiting.lock().insert(id, job);
    }

    /// Takes every waiting job out.
    fn drain(&self) -> Vec<PendingCompletion> {
        let jobs: Vec<PendingCompletion> = self.waiting.lock().drain().map(|(_, j)| j).collect();
        let bytes: usize = jobs.iter().map(job_bytes).sum();
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        jobs
    }
}

/// What a waiting completion holds in memory: its stored response (nothing for one stored as
/// not replayable).
fn job_bytes(job: &PendingCompletion) -> usize {
    job.completion.response_bytes()
}

/// Hands dead letters to the writer thread (or, when none could be started, writes them
/// itself).
struct DeadLetters {
    /// The writer thread's queue; `None` when the thread could not be started.
    queue: Option<std::sync::mpsc::SyncSender<Letter>>,
    /// The overflow thread's queue: lines the writer is too far behind for go whole to stderr
    /// from there, never from the caller (a request thread), since stderr may wait too (a
    /// reader that stalled, the log writer holding it for a batch). `None` when the thread
    /// could not be started: the caller writes them then.
    overflow: Option<std::sync::mpsc::Sender<Letter>>,
    /// What the overflow thread has waiting, weighed by [`overflow_weight`]: past
    /// [`OVERFLOW_BYTES`] the caller writes its line to stderr itself.
    spilling: Arc<AtomicUsize>,
    file: Arc<DeadLetterFile>,
}

/// What the writer thread is handed. Unboxed: dead letters are rare, and a flush rarer still.
#[allow(clippy::large_enum_variant)]
enum Letter {
    /// One line to write; pending until it is written.
    Line(LetterLine),
    /// Answered once every line handed over before it is written.
    Flush(std::sync::mpsc::Sender<()>),
}

/// A dead-lettered completion and why.
struct LetterLine {
    job: PendingCompletion,
    attempts: u32,
    reason: String,
    in_store: InStore,
    /// When it was dead-lettered (the line is formatted later, on the writer thread).
    at: SystemTime,
}

impl LetterLine {
    /// The JSON line written for it, naming `store`.
    fn text(&self, store: &LetterStore) -> String {
        dead_letter_line_at(
            store,
            &self.job,
            self.attempts,
            &self.reason,
            self.in_store,
            self.at,
        )
    }
}

/// The dead-letter file, and where a line goes when the file cannot take it.
struct DeadLetterFile {
    path: PathBuf,
    store: LetterStore,
    stats: Arc<RetryStats>,
    /// Takes a line the file could not (the whole text, newline included): stderr, written at
    /// once. A seam for the tests.
    last_resort: Box<dyn Fn(&str) + Send + Sync>,
}

/// Lines the writer thread may fall behind by. Past it, a line goes whole to stderr at once
/// rather than wait (see `DeadLetters::settle`): memory stays bounded, and the writer writes
/// what is queued in few appends and fsyncs, so only a disk (or another process holding the
/// lock) slower than that for a thousand lines sends lines there.
const LETTER_BACKLOG: usize = 1024;
/// Lines written in one append at most.
const LETTER_BATCH: usize = 256;
/// Why a line the writer is too far behind for went to stderr.
const OVERFLOW_WHY: &str = "the dead-letter writer is too far behind";
/// Most the overflow thread may have waiting for stderr (by [`overflow_weight`]). The jobs
/// that reach it need not have been in the retry queue (one dead-lettered because that queue
/// was full never was), so `queue_bytes` does not bound them: past this, the caller writes its
/// line itself and waits on stderr, which keeps memory bounded and loses nothing.
const OVERFLOW_BYTES: usize = 64 << 20;

/// What a line waiting for the overflow thread counts against [`OVERFLOW_BYTES`]: its
/// response, and a kilobyte for the rest of it, so many small lines count too.
fn overflow_weight(line: &LetterLine) -> usize {
    line.job.completion.response_bytes().saturating_add(1024)
}
/// Bytes of stored responses in one append at most (one line past it may start a batch): a
/// line holds its response in base64 and is copied a few times on its way to the file, so
/// 256 lines of 1 MiB responses would have taken about a gigabyte at once.
const LETTER_BATCH_BYTES: usize = 8 << 20;

// === impl CompletionRetrier ===

impl CompletionRetrier {
    /// Creates the retrier over `shared`, the store beneath any local cache, with `local`
    /// keeping that cache's entries true to what the retries find. The returned worker future
    /// must be spawned (it ends when every handle is dropped and the queue is empty).
    pub fn new(
        shared: Arc<dyn RecordStore>,
        local: LocalHooks,
        options: RetryOptions,
    ) -> (Self, impl std::future::Future<Output = ()> + Send) {
        let capacity = options.queue_capacity.max(1);
        let (tx, rx) = mpsc::channel(capacity);
        let stats = Arc::new(RetryStats::default());
        let file = DeadLetterFile {
            path: options.dead_letter_path.clone(),
            store: options.store.clone(),
            stats: stats.clone(),
            last_resort: Box::new(to_stderr),
        };
        let dead = Arc::new(DeadLetters::start(file));
        let jobs = Arc::new(Jobs::default());
        let handle = CompletionRetrier {
            tx: tx.clone(),
            dead: dead.clone(),
            local: local.clone(),
            stats: stats.clone(),
            jobs: jobs.clone(),
            capacity,
            capacity_bytes: options.queue_bytes,
        };
        let worker = run(shared, local, options, rx, tx, dead, stats, jobs);
        (handle, worker)
    }

    /// Counters.
    pub fn stats(&self) -> Arc<RetryStats> {
        self.stats.clone()
    }

    /// Completions not yet stored or dead-lettered.
    pub fn pending(&self) -> usize {
        self.stats.pending.load(Ordering::Acquire)
    }

    /// Queues a completion whose first write failed; dead-letters it at once when
    /// `queue_capacity` completions are waiting already.
    pub fn submit(&self, job: PendingCompletion) {
        let waiting = self.stats.pending.fetch_add(1, Ordering::AcqRel);
        let letters = self.stats.letters.load(Ordering::Acquire);
        if waiting.saturating_sub(letters) >= self.capacity {
            give_up(&self.dead, &self.local, job, 0, "retry queue full");
            return;
        }
        let bytes = self.jobs.bytes.load(Ordering::Acquire);
        if bytes.saturating_add(job_bytes(&job)) > self.capacity_bytes {
            give_up(
                &self.dead,
                &self.local,
                job,
                0,
                "retry queue full (queue_bytes)",
            );
            return;
        }
        let id = self.jobs.add(job);
        if self.tx.try_send((id, 0)).is_err() {
            if let Some(job) = self.jobs.take(id) {
                give_up(&self.dead, &self.local, job, 0, "retry queue full");
            }
            return;
        }
        // Only what is queued: a completion dead-lettered at once was never retried.
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// Settles a completion whose first write the store refused (`NotOwner`): the record is
    /// read to tell why. Another execution holds the key (`lock taken over`: the local entry
    /// goes, and this replica replays the store's), or the record is gone (`record gone`: a
    /// failover lost the claim while the backend ran; nobody else executed the key, and the
    /// local entry stays as the only trace of the answer), or it cannot be read (the entry
    /// stays). On a store that cannot say whether a refused write landed before
    /// ([`RecordStore::refusals_are_final`] false), a record that holds this very completion,
    /// under this execution id, is taken for it having landed after all.
    ///
    /// While the record is read the completion waits among the others, so a process that stops
    /// meanwhile (pingora drops the request's task at the end of the grace period) dead-letters
    /// it with them rather than losing it with this future.
    ///
    /// `store` is the one that refused: the shared store, or the fallback a claim made during
    /// an outage was written to (`on_unavailable: local`), whose record says why.
    pub async fn refused(&self, job: PendingCompletion, store: &dyn RecordStore) -> Refusal {
        self.stats.pending.fetch_add(1, Ordering::AcqRel);
        let key = job.key.clone();
        let id = self.jobs.add(job);
        let read = store.get(&key).await;
        let Some(job) = self.jobs.take(id) else {
            // Dead-lettered meanwhile: the process is stopping.
            return Refusal::Unread;
        };
        let final_refusal = store.refusals_are_final();
        let refusal = settle_refused(read, job, 1, &self.dead, &self.local, final_refusal);
        if refusal == Refusal::Landed {
            self.stats.pending.fetch_sub(1, Ordering::AcqRel);
        }
        refusal
    }

    /// Dead-letters a completion whose first write went out and was never answered: its task
    /// was dropped mid-write (pingora drops the request tasks when a shutdown's grace period
    /// ends) or panicked. The store may hold it after all, and the local cache is told so.
    pub fn abandoned(&self, job: PendingCompletion, reason: &str) {
        self.stats.pending.fetch_add(1, Ordering::AcqRel);
        give_up(&self.dead, &self.local, job, 1, reason);
    }

    /// Dead-letters every completion still waiting: the process is stopping and nothing will
    /// retry them (the shutdown drain waited as long as it could). Returns how many. Their
    /// lines are written by the writer thread: [`CompletionRetrier::flush_dead_letters`] waits
    /// for them, and they count as pending until then.
    ///
    /// Safe beside retry tasks still running: a job is taken out of `Jobs` under its lock
    /// by exactly one settler, so a task whose write comes back after this finds its job gone
    /// and leaves it (a write of it that lands is what `in_store: unknown` says may happen). A
    /// job a task holds between taking it and putting it back for another attempt is not seen
    /// here: it is back in a moment, and a later call takes it.
    pub fn dead_letter_pending(&self, reason: &str) -> usize {
        let waiting = self.jobs.drain();
        let count = waiting.len();
        // Each is here because a write failed without an answer (or one is out right now).
        for job in waiting {
            give_up(&self.dead, &self.local, job, 0, reason);
        }
        count
    }

    /// Blocks until every dead letter handed over so far is written (to the file or, failing
    /// that, to stderr). The process's end waits only so long
    /// ([`CompletionRetrier::flush_dead_letters_within`]); tests wait for it all.
    #[cfg(test)]
    pub fn flush_dead_letters(&self) {
        self.dead.flush();
    }

    /// [`CompletionRetrier::flush_dead_letters`], waiting at most `wait`: at exit, a disk that
    /// hangs (or another process holding the file's lock) must not keep the process alive
    /// until it is killed, which loses the lines as well and tells nobody. Returns whether
    /// everything was written.
    pub fn flush_dead_letters_within(&self, wait: Duration) -> bool {
        self.dead
            .flush_until(Some(std::time::Instant::now() + wait))
    }
}

/// Dead-letters `job`, counted as pending, whose write failed without an answer, and tells the
/// local cache first: nothing will report it stored now, and the store may hold it after all.
fn give_up(
    dead: &DeadLetters,
    local: &LocalHooks,
    job: PendingCompletion,
    attempts: u32,
    reason: &str,
) {
    (local.given_up)(&job.key, job.owner);
    dead.settle(job, attempts, reason, InStore::Unknown);
}

/// Why the store refused a completion (`NotOwner`), as the record read after it tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The record holds this very completion: an earlier send of it landed.
    Landed,
    /// Another execution holds the key (the lock lapsed and the key ran again).
    TakenOver,
    /// Another execution, under another execution id, holds the key: the record was lost (a
    /// failover or a restart without persistence) and a retry created it anew, running the key
    /// again (a takeover keeps the id).
    Recreated,
    /// The record is gone (a failover lost it, or it was evicted or purged).
    Gone,
    /// The record could not be read.
    Unread,
}

/// Settles `job`, counted as pending, whose write the store refused, by `read`, the record as
/// read after the refusal: dead-lettered unless it landed (the local entry is then told so,
/// and the caller takes it off the pending count). `final_refusal`: the store answers a write it
/// took before "applied", or answers every write at once ([`RecordStore::refusals_are_final`]),
/// so a refused one never landed.
fn settle_refused(
    read: Result<Option<Record>, StoreError>,
    job: PendingCompletion,
    attempts: u32,
    dead: &DeadLetters,
    local: &LocalHooks,
    final_refusal: bool,
) -> Refusal {
    match read {
        // Landed: the record holds exactly this completion, of this execution, and the store
        // would not have said so of a write it took. The same bytes under another execution
        // id are another execution's (a 204, a cached 4xx), and so are they under this id on
        // a store whose refusals are final (a takeover after the lock lapsed keeps the id):
        // the key ran twice, which is for the dead-letter file to say.
        Ok(Some(Record {
            state: RecordState::Completed(ref c),
            execution_id,
            ..
        })) if !final_refusal && *c == job.completion && execution_id == job.execution_id => {
            (local.stored)(&job.key, job.owner);
            Refusal::Landed
        }
        // A record of another execution id: this one's was lost while it ran (a takeover keeps
        // the id) and a retry created it anew, running the key again. As for a takeover, the
        // store keeps it, and this replica replays what the store holds.
        Ok(Some(Record { execution_id, .. })) if execution_id != job.execution_id => {
            (local.taken_over)(&job.key, job.owner);
            dead.settle(job, attempts, "record lost, created again", InStore::No);
            Refusal::Recreated
        }
        // Another execution holds the key now: the store keeps it, and this replica replays
        // what the store holds, like every other replica.
        Ok(Some(_)) => {
            (local.taken_over)(&job.key, job.owner);
            dead.settle(job, attempts, "lock taken over", InStore::No);
            Refusal::TakenOver
        }
        // No record at all: a failover lost it (asynchronous replication), or it was evicted
        // or purged. Nobody else executed the key, and this replica's entry is the only trace
        // of its answer: kept as given up, so a retry here replays it rather than execute
        // again (a purge still takes it).
        Ok(None) => {
            (local.lost)(&job);
            dead.settle(job, attempts, "record gone", InStore::No);
            Refusal::Gone
        }
        // Unread: whether an earlier write landed is not known, nor who holds the key: the
        // entry is kept as for any write given up on.
        Err(e) => {
            (local.lost)(&job);
            let reason = format!("lock taken over or record gone; record unread: {e}");
            dead.settle(job, attempts, &reason, InStore::Unknown);
            Refusal::Unread
        }
    }
}

/// The shortest pause between two attempts as a lock's deadline nears.
const MIN_PAUSE: Duration = Duration::from_millis(10);

/// The pause before retry `attempt` (0-based): exponential with "equal" jitter (between half
/// the exponential step and all of it), and never past
/// the lock's deadline while the lock holds — half of what is left, at least [`MIN_PAUSE`] — so
/// attempts come closer together as the deadline nears and one follows soon after the store
/// is back.
fn backoff(options: &RetryOptions, attempt: u32, lock_deadline: Instant) -> Duration {
    let exp = options.base_delay.saturating_mul(1u32 << attempt.min(20));
    let cap = exp.min(options.max_delay);
    // Jitter spreads retries of many replicas after a shared outage; drawn from the upper half
    // of the step, so the pauses still grow with the attempts.
    let ms = cap.as_millis().max(1) as u64;
    let pause = Duration::from_millis(rand::thread_rng().gen_range(ms / 2..=ms));
    let left = lock_deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        pause
    } else {
        pause.min((left / 2).max(MIN_PAUSE))
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    store: Arc<dyn RecordStore>,
    local: LocalHooks,
    options: RetryOptions,
    mut rx: mpsc::Receiver<(Job, u32)>,
    tx: mpsc::Sender<(Job, u32)>,
    dead: Arc<DeadLetters>,
    stats: Arc<RetryStats>,
    jobs: Arc<Jobs>,
) {
    // The worker holds a sender to requeue; it stops when it is the last one and nothing waits.
    let tx = tx.downgrade();
    let options = Arc::new(options);
    while let Some((id, attempt)) = rx.recv().await {
        let store = store.clone();
        let options = options.clone();
        let dead = dead.clone();
        let stats = stats.clone();
        let jobs = jobs.clone();
        let local = local.clone();
        let requeue = tx.upgrade();
        let (jobs_after, dead_after, local_after) = (jobs.clone(), dead.clone(), local.clone());
        let attempt_once = async move {
            let Some(job) = jobs.get(id) else {
                return;
            };
            tokio::time::sleep(backoff(&options, attempt, job.lock_deadline)).await;
            let result = store
                .complete(&job.key, job.owner, job.completion.clone(), job.ttl)
                .await;
            // A refused write may be an earlier one that timed out and landed after all: the
            // record is read while the job still waits, so a process that stops meanwhile
            // dead-letters it rather than losing it with this task.
            let written = match result {
                Ok(WriteOutcome::Applied) => Written::Applied,
                Ok(WriteOutcome::NotOwner) => Written::Refused(store.get(&job.key).await),
                Err(e) => Written::Failed(e),
            };
            // Settled by someone else meanwhile (dead-lettered at shutdown): nothing to do.
            let Some(job) = jobs.take(id) else {
                return;
            };
            match written {
                Written::Applied => {
                    // Before the pending count drops: whoever waits for the retries to settle
                    // finds the local cache told.
                    (local.stored)(&job.key, job.owner);
                    stats.recovered.fetch_add(1, Ordering::Relaxed);
                    stats.pending.fetch_sub(1, Ordering::AcqRel);
                    tracing::info!(attempt = attempt + 1, "stored a completion on retry");
                }
                Written::Refused(read) => {
                    let final_refusal = store.refusals_are_final();
                    match settle_refused(read, job, attempt + 1, &dead, &local, final_refusal) {
                        Refusal::Landed => {
                            stats.recovered.fetch_add(1, Ordering::Relaxed);
                            stats.pending.fetch_sub(1, Ordering::AcqRel);
                            tracing::info!("a timed-out completion had been stored after all");
                        }
                        Refusal::TakenOver | Refusal::Recreated => {
                            stats.fenced.fetch_add(1, Ordering::Relaxed);
                        }
                        Refusal::Gone | Refusal::Unread => {}
                    }
                }
                // Given up only once the attempts are spent and the lock has lapsed: until then
                // nobody else can execute the key, so a store back in time still wins.
                Written::Failed(e)
                    if attempt + 1 >= options.attempts && Instant::now() >= job.lapses_by =>
                {
                    let reason = format!("store failed: {e}");
                    give_up(&dead, &local, job, attempt + 1, &reason)
                }
                Written::Failed(_) => {
                    jobs.put_back(id, job);
                    let sent = match requeue {
                        Some(tx) => tx.try_send((id, attempt + 1)).is_ok(),
                        None => false,
                    };
                    if !sent {
                        if let Some(job) = jobs.take(id) {
                            give_up(&dead, &local, job, attempt + 1, "retry queue full");
                        }
                    }
                }
            }
        };
        // A panic in the attempt (a store's bug) would leave its job waiting with no task to
        // retry it until the process stops, holding the drain the whole grace period: the job
        // is dead-lettered at once instead.
        tokio::spawn(async move {
            if AssertUnwindSafe(attempt_once).catch_unwind().await.is_err() {
                if let Some(job) = jobs_after.take(id) {
                    tracing::error!("a completion retry panicked; the completion is dead-lettered");
                    give_up(
                        &dead_after,
                        &local_after,
                        job,
                        attempt + 1,
                        "retry task panicked",
                    );
                }
            }
        });
    }
}

/// How a retried write ended; a refused one carries the record read after it.
enum Written {
    Applied,
    Refused(Result<Option<Record>, StoreError>),
    Failed(StoreError),
}

// === impl DeadLetters ===

impl DeadLetters {
    /// Starts the writer thread over `file`; without one, callers write themselves.
    fn start(file: DeadLetterFile) -> Self {
        let file = Arc::new(file);
        let (tx, rx) = std::sync::mpsc::sync_channel(LETTER_BACKLOG);
        let writer = file.clone();
        let spawned = std::thread::Builder::new()
            .name("dead letters".into())
            .spawn(move || writer.run(rx));
        let queue = match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the dead-letter writer thread; dead letters are written by the threads that make them");
                None
            }
        };
        let (overflow_tx, overflow_rx) = std::sync::mpsc::channel();
        let spilling = Arc::new(AtomicUsize::new(0));
        let (spilled, waiting) = (file.clone(), spilling.clone());
        let spawned = std::thread::Builder::new()
            .name("dead letters to stderr".into())
            .spawn(move || spilled.run_overflow(overflow_rx, &waiting));
        let overflow = match spawned {
            Ok(_) => Some(overflow_tx),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the dead-letter overflow thread; its lines go to stderr from the threads that make them");
                None
            }
        };
        DeadLetters {
            queue,
            overflow,
            spilling,
            file,
        }
    }

    /// Dead-letters `job`, which is counted as pending: the count drops once its line is
    /// written, so shutdown (which waits on the count) waits for the write.
    fn settle(&self, job: PendingCompletion, attempts: u32, reason: &str, in_store: InStore) {
        self.file.stats.letters.fetch_add(1, Ordering::AcqRel);
        let line = LetterLine {
            job,
            attempts,
            reason: reason.to_string(),
            in_store,
            at: SystemTime::now(),
        };
        let Some(queue) = &self.queue else {
            // No writer thread (it could not start): written here rather than lost.
            return self.file.write(vec![line]);
        };
        // Never waits: the callers are request threads and retry tasks.
        match queue.try_send(Letter::Line(line)) {
            Ok(()) => {}
            // The writer is LETTER_BACKLOG lines behind (a disk that hangs): the line goes
            // whole to stderr rather than stall the caller or be lost, from the overflow
            // thread, so the caller does not wait on stderr either, up to OVERFLOW_BYTES
            // waiting there: past it the caller writes the line itself (a request thread
            // that waits rather than memory without bound, or a completion lost).
            Err(TrySendError::Full(Letter::Line(line))) => {
                let weight = overflow_weight(&line);
                let spilled = match &self.overflow {
                    Some(overflow) if self.room_to_spill(weight) => {
                        overflow.send(Letter::Line(line)).map_err(|e| {
                            self.spilling.fetch_sub(weight, Ordering::AcqRel);
                            e.0
                        })
                    }
                    _ => Err(Letter::Line(line)),
                };
                if let Err(Letter::Line(line)) = spilled {
                    let text = line.text(&self.file.store);
                    self.file.settle_on_stderr(&line, &text, OVERFLOW_WHY);
                }
            }
            // The writer is gone: written here rather than lost.
            Err(TrySendError::Disconnected(Letter::Line(line))) => self.file.write(vec![line]),
            // Only lines are sent here.
            Err(
                TrySendError::Full(Letter::Flush(_)) | TrySendError::Disconnected(Letter::Flush(_)),
            ) => {}
        }
    }

    /// Takes `weight` of [`OVERFLOW_BYTES`] for a line handed to the overflow thread, if it
    /// fits, or if nothing waits there (a line larger than the bound still goes alone: what
    /// waits is at most the bound or one line).
    fn room_to_spill(&self, weight: usize) -> bool {
        self.spilling
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                waiting
                    .checked_add(weight)
                    .filter(|&total| total <= OVERFLOW_BYTES || waiting == 0)
            })
            .is_ok()
    }

    /// Waits until every line handed over before this call is written (to the file, or from
    /// the overflow thread to stderr).
    #[cfg(test)]
    fn flush(&self) {
        self.flush_until(None);
    }

    /// [`DeadLetters::flush`], until `deadline` at most when there is one; returns whether it
    /// got through.
    fn flush_until(&self, deadline: Option<std::time::Instant>) -> bool {
        let in_time = || deadline.is_none_or(|d| std::time::Instant::now() < d);
        // `queue` hands the letter back when it is full.
        let wait = |queue: &dyn Fn(Letter) -> Option<Letter>| {
            let (done, written) = std::sync::mpsc::channel();
            let mut letter = Letter::Flush(done);
            // The writer's queue may be full behind a hung disk: no blocking send.
            loop {
                match queue(letter) {
                    None => break,
                    Some(back) if in_time() => {
                        letter = back;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Some(_) => return false,
                }
            }
            // An error other than a timeout means the thread is gone, and with it anything to
            // wait for.
            match deadline {
                None => {
                    let _ = written.recv();
                    true
                }
                Some(d) => !matches!(
                    written.recv_timeout(d.saturating_duration_since(std::time::Instant::now())),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                ),
            }
        };
        let to_writer = self.queue.as_ref().is_none_or(|queue| {
            wait(&|letter| match queue.try_send(letter) {
                Err(TrySendError::Full(letter)) => Some(letter),
                // Sent, or the thread is gone and with it anything to wait for.
                Ok(()) | Err(TrySendError::Disconnected(_)) => None,
            })
        });
        let to_stderr = self.overflow.as_ref().is_none_or(|overflow| {
            wait(&|letter| {
                let _ = overflow.send(letter);
                None
            })
        });
        to_writer && to_stderr
    }
}

/// `first` and what else waits on `queue`, up to [`LETTER_BATCH`] lines and
/// [`LETTER_BATCH_BYTES`] of responses: the lines of one append, and the flushes answered
/// after it.
fn next_batch(
    first: Letter,
    queue: &std::sync::mpsc::Receiver<Letter>,
) -> (Vec<LetterLine>, Vec<std::sync::mpsc::Sender<()>>) {
    let mut lines = Vec::new();
    let mut flushes = Vec::new();
    let mut bytes = 0usize;
    let mut next = Some(first);
    while let Some(letter) = next.take() {
        match letter {
            Letter::Line(line) => {
                bytes = bytes.saturating_add(line.job.completion.response_bytes());
                lines.push(line);
            }
            Letter::Flush(done) => flushes.push(done),
        }
        if lines.len() < LETTER_BATCH && bytes < LETTER_BATCH_BYTES {
            next = queue.try_recv().ok();
        }
    }
    (lines, flushes)
}

// === impl DeadLetterFile ===

impl DeadLetterFile {
    /// The writer thread: writes what is queued, as many lines at once as are waiting, until
    /// every sender is gone.
    fn run(&self, queue: std::sync::mpsc::Receiver<Letter>) {
        while let Ok(first) = queue.recv() {
            let (lines, flushes) = next_batch(first, &queue);
            if !lines.is_empty() {
                self.write(lines);
            }
            for done in flushes {
                let _ = done.send(());
            }
        }
    }

    /// Appends `letters` in one write (one lock, one fsync) and takes them off the pending
    /// count. What the file cannot take goes to [`DeadLetterFile::last_resort`], whole.
    fn write(&self, letters: Vec<LetterLine>) {
        let lines: Vec<String> = letters.iter().map(|l| l.text(&self.store)).collect();
        let text = lines.concat();
        let written = open_dead_letter_file(&self.path)
            .and_then(|f| append_line(&f, text.as_bytes(), |mut f, bytes| f.write_all(bytes)));
        for (letter, line) in letters.iter().zip(&lines) {
            let record = crate::key::hash_label(&letter.job.key.hash);
            match &written {
                // Whole ids, as the line in the file has them: where the file went with its
                // pod before anyone read it, this log line is what is left to reconcile from
                // (`GET /admin/record-ids/{tenant}/{record_id}`, the backend by execution id).
                Ok(()) => tracing::error!(
                    path = %self.path.display(),
                    %record,
                    tenant = %letter.job.key.tenant,
                    record_id = %hex::encode(letter.job.key.hash),
                    execution_id = letter.job.execution_id,
                    status = letter.job.completion.status(),
                    reason = %letter.reason,
                    "completion written to the dead-letter file"
                ),
                Err(e) => {
                    self.settle_on_stderr(letter, line, &e.to_string());
                    continue;
                }
            }
            self.stats.letter_written();
        }
    }

    /// The overflow thread: writes each line it is handed whole to stderr, until every sender
    /// is gone.
    /// `waiting` is what it has queued, by [`overflow_weight`]: each line's weight comes off
    /// once it is written.
    fn run_overflow(&self, queue: std::sync::mpsc::Receiver<Letter>, waiting: &AtomicUsize) {
        while let Ok(letter) = queue.recv() {
            match letter {
                Letter::Line(line) => {
                    self.settle_on_stderr(&line, &line.text(&self.store), OVERFLOW_WHY);
                    waiting.fetch_sub(overflow_weight(&line), Ordering::AcqRel);
                }
                Letter::Flush(done) => {
                    let _ = done.send(());
                }
            }
        }
    }

    /// Settles `letter` (its `line`) on stderr alone, without the file (`why` says why):
    /// writes it, counts it, and takes it off the pending count.
    fn settle_on_stderr(&self, letter: &LetterLine, line: &str, why: &str) {
        let record = crate::key::hash_label(&letter.job.key.hash);
        self.stats
            .dead_letter_write_failures
            .fetch_add(1, Ordering::Relaxed);
        // Straight out, before the count drops: this is the completion's last copy.
        // Under JSON logging a JSON object carrying the line (itself a JSON object), so a
        // collector that parses every line as JSON keeps this last copy too.
        let message = format!("dead letter not written to {} ({why})", self.path.display());
        (self.last_resort)(&crate::accesslog::stderr_line(
            "idemgate::dead_letters",
            &message,
            &[("dead_letter", line.trim_end())],
            &format!(": {}", line.trim_end()),
        ));
        tracing::error!(
            path = %self.path.display(),
            error = why,
            %record,
            "cannot write the dead-letter file; the whole line went to stderr"
        );
        self.stats.letter_written();
    }
}

/// The last resort for a dead letter: stderr, written before this returns. Not through the
/// batched log writer, which drops lines past its cap or when its buffer is full and gives up
/// flushing at exit; nor through the log filter, which may be off.
fn to_stderr(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(text.as_bytes());
    let _ = stderr.flush();
}

/// Appends dead-letter lines (`line`: one or more whole lines, ending in a newline) to `file`
/// and syncs them, so that every line the file holds is whole whatever fails: a write that
/// fails part way (a full disk) is cut back off, and a file that does not end in a newline all
/// the same (that cut failed too, or a copy was made mid-write) gets one first, so the new line
/// never glues onto a broken one and `--reconcile` reads it. `write` is the write itself (a
/// seam for the tests).
fn append_line(
    file: &std::fs::File,
    line: &[u8],
    write: impl FnOnce(&std::fs::File, &[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    // Other processes may append to the same file (the old and new process of a rolling
    // restart, replicas sharing a volume): the length read here must be the file's until this
    // line is in, or a cut back after a failure could take their line. Released on close.
    // (`File::lock` is `flock(2)` on Unix, as the other processes' locks are.)
    file.lock()?;
    let len = file.metadata()?.len();
    let mut last = [b'\n'];
    if len > 0 && file.read_exact_at(&mut last, len - 1).is_err() {
        // Unreadable (truncated meanwhile): no newline is added, the line is not lost for it.
        last = [b'\n'];
    }
    let mut whole = Vec::with_capacity(line.len() + 1);
    if last[0] != b'\n' {
        whole.push(b'\n');
    }
    whole.extend_from_slice(line);
    match write(file, &whole).and_then(|()| file.sync_data()) {
        Ok(()) => Ok(()),
        Err(e) => {
            // Best effort: when this fails too, the next line starts with a newline instead.
            let _ = file.set_len(len);
            Err(e)
        }
    }
}

/// Whether the store may hold a dead-lettered completion after all: what whoever reconciles the
/// dead-letter file must check before acting on a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InStore {
    /// The store refused the write (`lock taken over`): another request took the key after the
    /// lock lapsed, or the record was gone.
    No,
    /// No write was answered: one that timed out, or was out when the process stopped, may have
    /// landed after all. Read the record (`GET /admin/records/...?body=true`) before acting.
    Unknown,
}

impl InStore {
    fn as_str(self) -> &'static str {
        match self {
            InStore::No => "no",
            InStore::Unknown => "unknown",
        }
    }
}

/// Opens the dead-letter file to append, creating it readable and writable by this user only
/// (`0600`): its lines hold whole responses, which may carry personal or payment data. An
/// existing file keeps its mode (see [`dead_letter_file_exposed`]).
pub fn open_dead_letter_file(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

/// The mode of the dead-letter file when group or others may read it.
pub fn dead_letter_file_exposed(file: &std::fs::File) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = file.metadata().ok()?.permissions().mode() & 0o777;
    (mode & 0o044 != 0).then_some(mode)
}

/// One dead-letter JSON line (with trailing newline) for a record in `store`.
pub fn dead_letter_line(
    store: &LetterStore,
    job: &PendingCompletion,
    attempts: u32,
    reason: &str,
    in_store: InStore,
) -> String {
    dead_letter_line_at(store, job, attempts, reason, in_store, SystemTime::now())
}

/// One dead-letter JSON line for a completion dead-lettered `at`.
fn dead_letter_line_at(
    store: &LetterStore,
    job: &PendingCompletion,
    attempts: u32,
    reason: &str,
    in_store: InStore,
    at: SystemTime,
) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let at_ms = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let response = match &job.completion {
        Completion::Response(r) => serde_json::json!({
            "status": r.status,
            "headers": r.headers().map(|(n, v)| serde_json::json!([n, b64.encode(v)])).collect::<Vec<_>>(),
            "body_base64": b64.encode(r.body()),
        }),
        Completion::Unreplayable { status } => {
            serde_json::json!({ "status": status, "unreplayable": true })
        }
    };
    let store = if job.on_fallback {
        &LetterStore::Memory
    } else {
        store
    };
    let mut v = serde_json::json!({
        "at_unix_ms": at_ms as u64,
        "tenant": job.key.tenant,
        "record": hex::encode(job.key.hash),
        "execution_id": job.execution_id.to_string(),
        "fingerprint": hex::encode(job.fingerprint),
        "ttl_ms": job.ttl.as_millis() as u64,
        "attempts": attempts,
        "reason": reason,
        "in_store": in_store.as_str(),
        "response": response,
    });
    match store {
        LetterStore::Memory => v["store"] = "memory".into(),
        LetterStore::Redis { key_prefix } => {
            v["store"] = "redis".into();
            v["key_prefix"] = key_prefix.as_str().into();
        }
    }
    format!("{v}\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::faulty::{Fault, FaultyStore};
    use crate::store::{ClaimOutcome, ClaimRequest, MemoryStore, RecordState, StoredResponse};
    use bytes::Bytes;

    fn options(dir: &std::path::Path) -> RetryOptions {
        RetryOptions {
            attempts: 3,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(40),
            queue_capacity: 8,
            queue_bytes: 1 << 20,
            dead_letter_path: dir.join("dead.jsonl"),
            store: LetterStore::Redis {
                key_prefix: "orders".into(),
            },
        }
    }

    #[tokio::test]
    async fn the_pause_grows_with_the_attempts_up_to_max_delay_and_the_lock_pulls_it_in() {
        let options = RetryOptions {
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_secs(1),
            ..RetryOptions::default()
        };
        let far = Instant::now() + Duration::from_secs(3600);
        let ms = |attempt: u32, deadline: Instant| backoff(&options, attempt, deadline).as_millis();
        for _ in 0..50 {
            assert!((5..=10).contains(&ms(0, far)), "{}", ms(0, far));
            assert!((40..=80).contains(&ms(3, far)), "{}", ms(3, far));
            assert!((500..=1000).contains(&ms(10, far)), "{}", ms(10, far));
            // Past the lock's deadline nothing pulls the pause in.
            assert!((500..=1000).contains(&ms(10, Instant::now())));
            // 200 ms of lock left: at most half of it.
            let near = Instant::now() + Duration::from_millis(200);
            assert!(ms(10, near) <= 100, "{}", ms(10, near));
        }
        // Jittered: retries of many completions after one outage do not all land at once.
        let pauses: std::collections::HashSet<_> = (0..50).map(|_| ms(10, far)).collect();
        assert!(pauses.len() >= 10, "{pauses:?}");
    }

    async fn claimed(store: &dyn RecordStore, n: u8) -> PendingCompletion {
        let req = ClaimRequest {
            key: RecordKey {
                tenant: "acme".into(),
                hash: [n; 32],
            },
            fingerprint: [0; 32],
            owner: OwnerToken::random(),
            execution_id: 42,
            lock_ttl: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        };
        assert!(matches!(
            store.claim(&req).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
        PendingCompletion {
            on_fallback: false,
            key: req.key,
            owner: req.owner,
            completion: Completion::Response(Arc::new(StoredResponse::new(
                201,
                vec![("x", Bytes::from_static(b"1"))],
                Bytes::from_static(b"\x00\xffbody"),
            ))),
            ttl: req.ttl,
            execution_id: 42,
            fingerprint: req.fingerprint,
            // Lapsed already: only the attempt budget keeps it (tests that need a live lock
            // set their own).
            lock_deadline: Instant::now(),
            lapses_by: Instant::now(),
        }
    }

    fn no_local_copies() -> LocalHooks {
        LocalHooks::none()
    }

    /// What the retrier reported stored: (record, owner of the claim completed).
    type Noted = Arc<Mutex<Vec<(RecordKey, OwnerToken)>>>;

    /// Hooks that note what the retrier reports stored.
    fn noting_stored() -> (LocalHooks, Noted) {
        let noted = Arc::new(Mutex::new(Vec::new()));
        let hooks = LocalHooks {
            stored: {
                let noted = noted.clone();
                Arc::new(move |key: &RecordKey, owner: OwnerToken| {
                    noted.lock().push((key.clone(), owner))
                })
            },
            ..LocalHooks::none()
        };
        (hooks, noted)
    }

    async fn settle(r: &CompletionRetrier) {
        for _ in 0..200 {
            if r.pending() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("retries did not settle");
    }

    #[tokio::test]
    async fn a_failed_completion_is_stored_once_the_store_is_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let job = claimed(store.as_ref(), 1).await;
        store.set(Fault::CompleteFails);
        let (hooks, stored) = noting_stored();
        let (retrier, worker) = CompletionRetrier::new(store.clone(), hooks, options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job.clone());
        tokio::time::sleep(Duration::from_millis(15)).await;
        assert!(stored.lock().is_empty(), "reported stored while failing");
        store.set(Fault::None);
        settle(&retrier).await;
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 1);
        // The local cache hears of it: its entry is now a copy of a stored record.
        assert_eq!(*stored.lock(), vec![(job.key.clone(), job.owner)]);
        let record = store.get(&job.key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(job.completion));
        assert!(!dir.path().join("dead.jsonl").exists());
    }

    #[tokio::test]
    async fn after_the_last_attempt_the_completion_is_dead_lettered() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let job = claimed(store.as_ref(), 2).await;
        store.set(Fault::Down);
        let (hooks, stored) = noting_stored();
        let (retrier, worker) = CompletionRetrier::new(store.clone(), hooks, options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job);
        settle(&retrier).await;
        assert!(
            stored.lock().is_empty(),
            "a dead letter was reported stored"
        );
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["attempts"], 3);
        assert_eq!(line["tenant"], "acme");
        assert_eq!(line["execution_id"], "42");
        // Where the record lives, so --reconcile judges the line against the same keys.
        assert_eq!(line["store"], "redis");
        assert_eq!(line["key_prefix"], "orders");
        assert_eq!(line["response"]["status"], 201);
        let body = base64::engine::general_purpose::STANDARD
            .decode(line["response"]["body_base64"].as_str().unwrap())
            .unwrap();
        assert_eq!(body, b"\x00\xffbody");
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 1);
        // Whole responses: for this user's eyes only, whatever the umask.
        let file = std::fs::File::open(dir.path().join("dead.jsonl")).unwrap();
        assert_eq!(dead_letter_file_exposed(&file), None);
        use std::os::unix::fs::PermissionsExt;
        let mode = file.metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    /// Submits the completion of a claim on `store` under an owner token the store no longer
    /// knows (another request took the lock), with `fault` set: every write of it is refused.
    async fn submit_taken_over(
        store: &Arc<FaultyStore<MemoryStore>>,
        n: u8,
        fault: Fault,
        dir: &std::path::Path,
    ) -> CompletionRetrier {
        let mut job = claimed(store.as_ref(), n).await;
        job.owner = OwnerToken::random();
        store.set(fault);
        let (retrier, worker) =
            CompletionRetrier::new(store.clone(), no_local_copies(), options(dir));
        tokio::spawn(worker);
        retrier.submit(job);
        retrier
    }

    fn faulty() -> Arc<FaultyStore<MemoryStore>> {
        Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)))
    }

    #[tokio::test]
    async fn a_taken_over_lock_dead_letters_instead_of_overwriting() {
        let dir = tempfile::tempdir().unwrap();
        let retrier = submit_taken_over(&faulty(), 3, Fault::None, dir.path()).await;
        settle(&retrier).await;
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("lock taken over"));
        assert!(text.contains(r#""in_store":"no""#), "{text}");
    }

    #[tokio::test]
    async fn a_refused_write_whose_record_cannot_be_read_is_dead_lettered_as_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let retrier = submit_taken_over(&faulty(), 19, Fault::GetFails, dir.path()).await;
        settle(&retrier).await;
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("record unread"), "{text}");
        assert!(text.contains(r#""in_store":"unknown""#), "{text}");
    }

    #[tokio::test]
    async fn a_completion_whose_record_is_being_read_at_exit_is_dead_lettered() {
        let dir = tempfile::tempdir().unwrap();
        let store = faulty();
        // The read that follows the refused write hangs: the process stops meanwhile.
        let before = store.calls.load(Ordering::Relaxed);
        let retrier = submit_taken_over(&store, 20, Fault::GetStalls, dir.path()).await;
        // The claim, then the refused write and the read that hangs.
        let calls = || store.calls.load(Ordering::Relaxed);
        while calls() < before + 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            retrier.dead_letter_pending("process stopped before the store took it"),
            1,
            "the job still waits while its record is read"
        );
        retrier.flush_dead_letters();
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("process stopped"), "{text}");
        assert_eq!(retrier.pending(), 0);
    }

    #[tokio::test]
    async fn a_write_that_landed_late_counts_as_recovered() {
        let dir = tempfile::tempdir().unwrap();
        // A store that cannot say whether a refused write landed before (a timed-out write
        // there may land later).
        let mut store = FaultyStore::new(MemoryStore::new(1 << 20, 1));
        store.refusals_are_final = Some(false);
        let store = Arc::new(store);
        let job = claimed(store.as_ref(), 6).await;
        // The "timed out" write did reach the store.
        let first = store.complete(&job.key, job.owner, job.completion.clone(), job.ttl);
        assert_eq!(first.await.unwrap(), WriteOutcome::Applied);
        let (hooks, stored) = noting_stored();
        let (retrier, worker) = CompletionRetrier::new(store.clone(), hooks, options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job.clone());
        settle(&retrier).await;
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 1);
        assert!(!dir.path().join("dead.jsonl").exists());
        assert_eq!(*stored.lock(), vec![(job.key, job.owner)]);
    }

    /// A completion the store takes only after 1.5 s down, far longer than three attempts
    /// (about 70 ms), its lock lapsing `earliest` from now at the earliest and `latest` at the
    /// latest: still retried when the store comes back, then stored, never dead-lettered.
    async fn stored_after_an_outage(
        n: u8,
        earliest: Duration,
        latest: Duration,
    ) -> (PendingCompletion, Arc<FaultyStore<MemoryStore>>) {
        tokio::time::pause();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let mut job = claimed(store.as_ref(), n).await;
        job.lock_deadline = Instant::now() + earliest;
        job.lapses_by = Instant::now() + latest;
        store.set(Fault::Down);
        let (retrier, worker) =
            CompletionRetrier::new(store.clone(), no_local_copies(), options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job.clone());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(retrier.pending(), 1, "still retried, not dead-lettered");
        store.set(Fault::None);
        settle(&retrier).await;
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 1);
        assert!(!dir.path().join("dead.jsonl").exists());
        (job, store)
    }

    #[tokio::test]
    async fn a_completion_is_retried_while_its_lock_holds_however_many_attempts_that_takes() {
        let lock = Duration::from_secs(2);
        let (job, store) = stored_after_an_outage(7, lock, lock).await;
        assert!(
            Instant::now() < job.lock_deadline,
            "stored before the lock lapsed"
        );
        let record = store.get(&job.key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(job.completion));
    }

    /// The lock's earliest lapse is no reason to give up: the claim's answer (or a renewal's
    /// that failed but may have landed) can start the store's lock up to a round trip, or a
    /// lock, later. Until the latest lapse nobody else can execute the key.
    #[tokio::test]
    async fn a_completion_is_retried_until_its_lock_has_lapsed_for_sure() {
        // Sent long ago, answered late: the earliest lapse is past, the latest 2 s away.
        stored_after_an_outage(17, Duration::ZERO, Duration::from_secs(2)).await;
    }

    #[tokio::test]
    async fn no_backoff_sleeps_past_the_lock_deadline() {
        tokio::time::pause();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let mut job = claimed(store.as_ref(), 8).await;
        let start = Instant::now();
        let deadline = start + Duration::from_millis(3400);
        job.lock_deadline = deadline;
        let mut o = options(dir.path());
        o.attempts = 8;
        o.base_delay = Duration::from_secs(1);
        o.max_delay = Duration::from_secs(10);
        store.set(Fault::Down);
        let (retrier, worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        tokio::spawn(worker);
        retrier.submit(job);
        // Plain backoff tries at 0.5-1 s, 1.5-3 s, then not before 3.5 s: past the deadline.
        tokio::time::sleep_until(start + Duration::from_millis(3050)).await;
        store.set(Fault::None);
        while retrier.pending() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(
            Instant::now() < deadline,
            "stored {:?} after the deadline",
            Instant::now() - deadline
        );
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn what_still_waits_at_exit_is_dead_lettered_once() {
        tokio::time::pause();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let mut job = claimed(store.as_ref(), 9).await;
        job.lock_deadline = Instant::now() + Duration::from_secs(30);
        job.lapses_by = job.lock_deadline;
        store.set(Fault::Down);
        let (retrier, worker) =
            CompletionRetrier::new(store.clone(), no_local_copies(), options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(retrier.dead_letter_pending("stopping"), 1);
        retrier.flush_dead_letters();
        assert_eq!(retrier.pending(), 0);
        // The retry task that was asleep finds the job settled and leaves it alone.
        store.set(Fault::None);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 1);
        assert!(text.contains("stopping"));
        // Its write failed without an answer: the store may hold it after all.
        assert!(text.contains(r#""in_store":"unknown""#), "{text}");
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 1);
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn an_unwritable_dead_letter_file_still_accounts_the_completion() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let mut job = claimed(store.as_ref(), 7).await;
        job.completion = Completion::Unreplayable { status: 201 };
        store.set(Fault::Down);
        let mut o = options(dir.path());
        o.attempts = 1;
        o.dead_letter_path = dir.path().join("missing-dir").join("dead.jsonl");
        let (retrier, worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        tokio::spawn(worker);
        retrier.submit(job.clone());
        // Shutdown waits for `pending`: a dead-letter write that fails must not leave it stuck.
        settle(&retrier).await;
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 1);
        assert_eq!(
            retrier
                .stats()
                .dead_letter_write_failures
                .load(Ordering::Relaxed),
            1
        );
        assert!(!dir.path().join("missing-dir").exists());

        let line: serde_json::Value = serde_json::from_str(&dead_letter_line(
            &LetterStore::Memory,
            &job,
            1,
            "store failed",
            InStore::Unknown,
        ))
        .unwrap();
        assert_eq!(line["in_store"], "unknown");
        assert_eq!(line["store"], "memory");
        assert_eq!(line.get("key_prefix"), None);
        // A claim made on the in-process fallback is the embedded store's, whatever the
        // retrier's store is.
        let redis = LetterStore::Redis {
            key_prefix: "orders".into(),
        };
        let fallback = PendingCompletion {
            on_fallback: true,
            ..job.clone()
        };
        for (job, store) in [(&job, "redis"), (&fallback, "memory")] {
            let line: serde_json::Value = serde_json::from_str(&dead_letter_line(
                &redis,
                job,
                1,
                "store failed",
                InStore::Unknown,
            ))
            .unwrap();
            assert_eq!(line["store"], store);
        }
        assert_eq!(
            line["response"],
            serde_json::json!({ "status": 201, "unreplayable": true })
        );
        assert_eq!(line["record"], "07".repeat(32));
        assert_eq!(line["ttl_ms"], 60_000);
    }

    fn append_to(
        text: &str,
        line: &str,
        write: fn(&std::fs::File, &[u8]) -> std::io::Result<()>,
    ) -> (std::io::Result<()>, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        std::fs::write(&path, text).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .unwrap();
        let result = append_line(&file, line.as_bytes(), write);
        (result, std::fs::read_to_string(&path).unwrap())
    }

    #[test]
    fn a_dead_letter_write_that_fails_part_way_is_cut_back_off() {
        // A full disk takes part of the line, then fails.
        let (result, text) = append_to("{\"a\":1}\n", "{\"b\":2}\n", |mut f, bytes| {
            f.write_all(&bytes[..bytes.len() / 2])?;
            Err(std::io::Error::from_raw_os_error(28))
        });
        assert_eq!(result.unwrap_err().raw_os_error(), Some(28));
        assert_eq!(text, "{\"a\":1}\n");
    }

    #[test]
    fn a_dead_letter_line_never_glues_onto_a_broken_one() {
        let write: fn(&std::fs::File, &[u8]) -> std::io::Result<()> =
            |mut f, bytes| f.write_all(bytes);
        let (result, text) = append_to("{\"a\":1}\n{\"b\":", "{\"c\":3}\n", write);
        result.unwrap();
        assert_eq!(text, "{\"a\":1}\n{\"b\":\n{\"c\":3}\n");
        let (result, text) = append_to("", "{\"c\":3}\n", write);
        result.unwrap();
        assert_eq!(text, "{\"c\":3}\n");
    }

    #[tokio::test]
    async fn the_queue_bounds_the_completions_waiting_between_attempts_too() {
        tokio::time::pause();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let mut jobs = Vec::new();
        for n in 10..15 {
            let mut job = claimed(store.as_ref(), n).await;
            job.lock_deadline = Instant::now() + Duration::from_secs(60);
            job.lapses_by = job.lock_deadline;
            jobs.push(job);
        }
        store.set(Fault::Down);
        let mut o = options(dir.path());
        o.queue_capacity = 2;
        let (retrier, worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        tokio::spawn(worker);
        for job in jobs {
            retrier.submit(job);
            // Each is taken off the channel at once and waits out its backoff in a task.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        retrier.flush_dead_letters();
        assert_eq!(
            retrier.pending(),
            2,
            "two wait, however fast the channel drains"
        );
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 3);
        assert_eq!(retrier.stats().queued.load(Ordering::Relaxed), 2);
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert_eq!(text.matches("retry queue full").count(), 3);
    }

    #[tokio::test]
    /// A failover that lost the record (asynchronous replication) leaves nobody else executing
    /// the key: this replica's entry, the only trace of the answer, stays, so a retry here
    /// replays it rather than execute again. It was dropped, as when another execution holds
    /// the key.
    async fn a_write_lost_by_the_store_is_dead_lettered_and_this_replica_keeps_replaying_it() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let cached = cached_over(&shared);
        let job = claimed(cached.as_ref(), 16).await;
        // The first write fails; the cache keeps the backend's answer for this replica.
        shared.set(Fault::CompleteFails);
        let first = cached.complete(&job.key, job.owner, job.completion.clone(), job.ttl);
        assert!(first.await.is_err());
        assert!(cached.get(&job.key).await.unwrap().is_some());
        // The store loses the claim (a failover without persistence) before a retry gets in.
        shared.set(Fault::None);
        assert!(shared.delete(&job.key).await.unwrap());
        let (retrier, worker) =
            CompletionRetrier::new(shared.clone(), cached.retry_hooks(), options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job.clone());
        settle(&retrier).await;
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 0);
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 1);
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("\"reason\":\"record gone\""), "{text}");
        assert!(text.contains("\"in_store\":\"no\""), "{text}");
        // A retry here replays the answer; the store is not asked, and nothing executes.
        let calls = shared.calls.load(Ordering::Relaxed);
        let retry = ClaimRequest {
            key: job.key.clone(),
            fingerprint: job.fingerprint,
            owner: OwnerToken::random(),
            execution_id: 43,
            lock_ttl: Duration::from_secs(30),
            ttl: job.ttl,
        };
        let again = cached.claim(&retry).await.unwrap();
        assert!(matches!(again, ClaimOutcome::Existing(_)), "{again:?}");
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls);
    }

    /// `job`'s record lost, and the key run anew under `execution_id` by another request,
    /// which answered what `job` holds.
    async fn answered_again(store: &dyn RecordStore, job: &PendingCompletion, execution_id: u64) {
        assert!(store.delete(&job.key).await.unwrap());
        let other = ClaimRequest {
            key: job.key.clone(),
            fingerprint: job.fingerprint,
            owner: OwnerToken::random(),
            execution_id,
            lock_ttl: Duration::from_secs(30),
            ttl: job.ttl,
        };
        assert!(matches!(
            store.claim(&other).await.unwrap(),
            ClaimOutcome::Acquired { execution_id: id, .. } if id == execution_id
        ));
        let stored = store.complete(&job.key, other.owner, job.completion.clone(), job.ttl);
        assert_eq!(stored.await.unwrap(), WriteOutcome::Applied);
    }

    /// A refused write whose record holds the same bytes under another execution id did not
    /// land: another execution answered the same (a 204, say) after the record was lost, and
    /// the key ran twice. It is dead-lettered as such (`record lost, created again`: under
    /// another execution id, not a takeover), and not counted as recovered.
    #[tokio::test]
    async fn the_same_answer_from_another_execution_is_not_taken_for_this_one() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(MemoryStore::new(1 << 20, 1));
        let job = claimed(shared.as_ref(), 17).await;
        // The record is lost, and another request executes the key anew, answering the same.
        answered_again(shared.as_ref(), &job, 43).await;
        let (retrier, worker) =
            CompletionRetrier::new(shared.clone(), LocalHooks::none(), options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job.clone());
        settle(&retrier).await;
        assert_eq!(retrier.stats().recovered.load(Ordering::Relaxed), 0);
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(
            text.contains("\"reason\":\"record lost, created again\""),
            "{text}"
        );
        assert_eq!(retrier.stats().fenced.load(Ordering::Relaxed), 1);
    }

    /// On a store whose refusals are final (Redis, the embedded store), a refused write never
    /// landed: the same answer under the same execution id is another execution's, a takeover
    /// after the lock lapsed (which keeps the id) that answered alike. The key ran twice:
    /// dead-lettered as a lock taken over, not counted as this completion stored.
    #[tokio::test]
    async fn the_same_answer_under_the_same_id_is_a_takeover_where_a_refusal_is_final() {
        // Said so, said otherwise, and the embedded store's own answer (its writes are
        // answered at once: final).
        for said in [Some(true), Some(false), None] {
            let final_refusal = said.unwrap_or(true);
            let dir = tempfile::tempdir().unwrap();
            let mut store = FaultyStore::new(MemoryStore::new(1 << 20, 1));
            store.refusals_are_final = said;
            let shared = Arc::new(store);
            let job = claimed(shared.as_ref(), 18).await;
            // Taken over under the same id (as a lapsed lock is), and answered alike.
            answered_again(shared.as_ref(), &job, job.execution_id).await;
            let (retrier, worker) =
                CompletionRetrier::new(shared.clone(), LocalHooks::none(), options(dir.path()));
            tokio::spawn(worker);
            retrier.submit(job.clone());
            settle(&retrier).await;
            let (recovered, fenced) = (
                retrier.stats().recovered.load(Ordering::Relaxed),
                retrier.stats().fenced.load(Ordering::Relaxed),
            );
            if final_refusal {
                assert_eq!((recovered, fenced), (0, 1));
                let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
                assert!(text.contains("lock taken over"), "{text}");
            } else {
                // A store that cannot say whether a refused write landed: taken as landed.
                assert_eq!((recovered, fenced), (1, 0));
            }
        }
    }

    /// A write the fallback refused (a claim made there during an outage, `on_unavailable:
    /// local`) is judged by the fallback's record, not by the shared store's, which is down.
    #[tokio::test]
    async fn a_refusal_is_judged_by_the_store_that_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        shared.set(Fault::Down);
        let fallback = MemoryStore::new(1 << 20, 1);
        let (retrier, worker) =
            CompletionRetrier::new(shared.clone(), LocalHooks::none(), options(dir.path()));
        tokio::spawn(worker);
        let job = claimed(&fallback, 34).await;
        assert!(
            fallback.delete(&job.key).await.unwrap(),
            "purged there, say"
        );
        assert_eq!(retrier.refused(job, &fallback).await, Refusal::Gone);
        settle(&retrier).await;
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("record gone"), "{text}");
    }

    /// A refused first write whose record read is still out when its task is dropped (the end
    /// of a shutdown's grace period) is dead-lettered with the waiting completions, not lost
    /// with the task.
    #[tokio::test]
    async fn a_refused_first_write_whose_task_is_dropped_mid_read_is_dead_lettered() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let (retrier, worker) =
            CompletionRetrier::new(shared.clone(), LocalHooks::none(), options(dir.path()));
        tokio::spawn(worker);
        let job = claimed(shared.as_ref(), 33).await;
        shared.set(Fault::GetStalls);
        let read = tokio::time::timeout(
            Duration::from_millis(50),
            retrier.refused(job, shared.as_ref()),
        )
        .await;
        assert!(read.is_err(), "the read stalls; the task is dropped");
        assert_eq!(retrier.pending(), 1, "still waiting to be settled");
        assert_eq!(
            retrier.dead_letter_pending("process stopped before the store took it"),
            1
        );
        retrier.flush_dead_letters();
        assert_eq!(retrier.pending(), 0);
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(
            text.contains("process stopped before the store took it"),
            "{text}"
        );
        shared.set(Fault::None);
    }

    /// A first write the store refused is settled by the record read after it: gone (a failover
    /// lost the claim while the backend ran), the answer stays this replica's to replay; held
    /// by another execution, it gives way to the store's. It was always "lock taken over", and
    /// no trace was kept, so a retry here executed the key again after a lost claim.
    #[tokio::test]
    async fn a_refused_first_write_keeps_its_trace_when_the_record_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        let cached = cached_over(&shared);
        let (retrier, worker) =
            CompletionRetrier::new(shared.clone(), cached.retry_hooks(), options(dir.path()));
        tokio::spawn(worker);
        let retry_of = |job: &PendingCompletion| ClaimRequest {
            key: job.key.clone(),
            fingerprint: job.fingerprint,
            owner: OwnerToken::random(),
            execution_id: 99,
            lock_ttl: Duration::from_secs(30),
            ttl: job.ttl,
        };

        // Gone: the claim is lost before the answer comes.
        let gone = claimed(cached.as_ref(), 30).await;
        assert!(shared.delete(&gone.key).await.unwrap());
        let written = cached.complete(&gone.key, gone.owner, gone.completion.clone(), gone.ttl);
        assert_eq!(written.await.unwrap(), WriteOutcome::NotOwner);
        assert_eq!(
            retrier.refused(gone.clone(), shared.as_ref()).await,
            Refusal::Gone
        );
        let calls = shared.calls.load(Ordering::Relaxed);
        let again = cached.claim(&retry_of(&gone)).await.unwrap();
        assert!(matches!(again, ClaimOutcome::Existing(_)), "{again:?}");
        assert_eq!(shared.calls.load(Ordering::Relaxed), calls, "replayed here");

        // Lost, then created again by a retry (another execution id): the key ran twice.
        let taken = claimed(cached.as_ref(), 31).await;
        assert!(shared.delete(&taken.key).await.unwrap());
        assert!(matches!(
            shared.claim(&retry_of(&taken)).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
        let written = cached.complete(&taken.key, taken.owner, taken.completion.clone(), taken.ttl);
        assert_eq!(written.await.unwrap(), WriteOutcome::NotOwner);
        assert_eq!(
            retrier.refused(taken.clone(), shared.as_ref()).await,
            Refusal::Recreated
        );
        let again = cached.claim(&retry_of(&taken)).await.unwrap();
        assert!(
            matches!(
                again,
                ClaimOutcome::Existing(Record {
                    state: RecordState::InFlight { .. },
                    ..
                })
            ),
            "the store's record, not this replica's answer: {again:?}"
        );

        // Purged here: gone for good, and claimable afresh.
        let purged = claimed(cached.as_ref(), 32).await;
        assert!(cached.delete(&purged.key).await.unwrap());
        let written = cached.complete(
            &purged.key,
            purged.owner,
            purged.completion.clone(),
            purged.ttl,
        );
        assert_eq!(written.await.unwrap(), WriteOutcome::NotOwner);
        assert_eq!(
            retrier.refused(purged.clone(), shared.as_ref()).await,
            Refusal::Gone
        );
        let again = cached.claim(&retry_of(&purged)).await.unwrap();
        assert!(matches!(again, ClaimOutcome::Acquired { .. }), "{again:?}");

        retrier.flush_dead_letters();
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("\"reason\":\"record gone\""), "{text}");
        assert!(
            text.contains("\"reason\":\"record lost, created again\""),
            "{text}"
        );
        assert_eq!(retrier.pending(), 0);
    }

    /// Dead-letters `job` `letters` times, each counted as pending, from a thread of its own as
    /// request threads do; returns whether that thread got through every call within 10 s.
    fn settled_from_a_thread(
        dead: &Arc<DeadLetters>,
        stats: &Arc<RetryStats>,
        job: &PendingCompletion,
        letters: usize,
    ) -> bool {
        let caller = settling_from_a_thread(dead, stats, job, letters);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !caller.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let through = caller.is_finished();
        if through {
            caller.join().unwrap();
        }
        through
    }

    /// A request thread's way of dead-lettering: `letters` copies of `job`, each counted as
    /// pending first, settled one after another on a thread of its own.
    fn settling_from_a_thread(
        dead: &Arc<DeadLetters>,
        stats: &Arc<RetryStats>,
        job: &PendingCompletion,
        letters: usize,
    ) -> std::thread::JoinHandle<()> {
        let (dead, stats, job) = (dead.clone(), stats.clone(), job.clone());
        std::thread::spawn(move || {
            for _ in 0..letters {
                stats.pending.fetch_add(1, Ordering::AcqRel);
                dead.settle(job.clone(), 1, "store failed", InStore::Unknown);
            }
        })
    }

    /// A local cache in front of `shared`, as a replica's is.
    fn cached_over(
        shared: &Arc<FaultyStore<MemoryStore>>,
    ) -> Arc<crate::store::cached::CachedStore<Arc<FaultyStore<MemoryStore>>>> {
        let options = crate::store::cached::LocalCacheOptions {
            capacity_bytes: 1 << 20,
            expected_items: 1000,
            false_positive_rate: 0.01,
            window: Duration::from_secs(60),
        };
        Arc::new(crate::store::cached::CachedStore::new(shared.clone(), options).unwrap())
    }

    /// Opens `path` (creating it) and takes its exclusive `flock`, as another process appending
    /// to it would; the lock goes with the returned file.
    fn hold_lock_of(path: &std::path::Path) -> std::fs::File {
        use std::os::unix::io::AsRawFd;
        let held = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        // SAFETY: flock on a descriptor `held` keeps open.
        assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX) }, 0);
        held
    }

    #[tokio::test]
    async fn a_dead_letter_waits_for_the_file_lock_off_the_callers_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        // Another process (the other half of a rolling restart) holds the file's lock.
        let held = hold_lock_of(&path);
        let store = faulty();
        let (taken, full) = (
            claimed(store.as_ref(), 24).await,
            claimed(store.as_ref(), 25).await,
        );
        let mut o = options(dir.path());
        o.queue_capacity = 1;
        // No worker: the first submit fills the queue.
        let (retrier, _worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        retrier.submit(claimed(store.as_ref(), 26).await);
        // The two ways a request thread dead-letters without a store read: a completion whose
        // write was out when its task was dropped (`proxy::WriteOut`), and a submit to a full
        // queue.
        let (returned, done) = std::sync::mpsc::channel();
        let caller = std::thread::spawn({
            let retrier = retrier.clone();
            move || {
                retrier.abandoned(taken, "process stopped with the store write out");
                retrier.submit(full);
                let _ = returned.send(());
            }
        });
        assert!(
            done.recv_timeout(Duration::from_secs(5)).is_ok(),
            "the caller waited for the file lock"
        );
        // Not written yet, and pending until it is: shutdown waits for the lines.
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
        assert_eq!(retrier.pending(), 3);
        drop(held);
        retrier.flush_dead_letters();
        caller.join().unwrap();
        assert_eq!(retrier.pending(), 1, "only the queued one");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.contains("store write out") && text.contains("retry queue full"));
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 2);
    }

    /// Dead letters waiting for a file that cannot be written for now (another process's lock,
    /// a disk that hangs) do not fill the retry queue: a completion whose first write fails
    /// after them is still retried, and lands. (They counted against `queue_capacity`, and
    /// such a completion was dead-lettered at once, without one retry.)
    #[tokio::test]
    async fn dead_letters_waiting_for_the_file_leave_the_retry_queue_room() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        let held = hold_lock_of(&path);
        let store = faulty();
        let mut o = options(dir.path());
        o.queue_capacity = 2;
        let (retrier, worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        tokio::spawn(worker);
        for n in 30..32 {
            let job = claimed(store.as_ref(), n).await;
            retrier.abandoned(job, "process stopped with the store write out");
        }
        assert_eq!(retrier.pending(), 2, "two lines wait for the file");
        retrier.submit(claimed(store.as_ref(), 32).await);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while retrier.stats().recovered.load(Ordering::Relaxed) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the completion was not retried"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(held);
        retrier.flush_dead_letters();
        assert_eq!(retrier.pending(), 0);
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 2);
        assert_eq!(retrier.stats().letters.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_dead_letter_the_file_cannot_take_goes_whole_to_the_last_resort() {
        let dir = tempfile::tempdir().unwrap();
        let stats = Arc::new(RetryStats::default());
        let seen = Arc::new(Mutex::new(String::new()));
        let dead = DeadLetters::start(DeadLetterFile {
            path: dir.path().join("missing-dir").join("dead.jsonl"),
            store: LetterStore::Memory,
            stats: stats.clone(),
            last_resort: Box::new({
                let seen = seen.clone();
                move |text: &str| seen.lock().push_str(text)
            }),
        });
        let job = claimed(faulty().as_ref(), 27).await;
        stats.pending.fetch_add(1, Ordering::AcqRel);
        dead.settle(job.clone(), 2, "store failed", InStore::Unknown);
        dead.flush();
        let text = seen.lock().clone();
        assert!(
            text.starts_with("idemgate: dead letter not written to "),
            "{text}"
        );
        let line = &text[text.find('{').unwrap()..];
        let read: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(read["record"], "1b".repeat(32));
        assert_eq!(read["attempts"], 2);
        assert!(text.ends_with('\n'), "one whole line");
        assert_eq!(stats.dead_letter_write_failures.load(Ordering::Relaxed), 1);
        assert_eq!(stats.dead_lettered.load(Ordering::Relaxed), 1);
        assert_eq!(stats.pending.load(Ordering::Acquire), 0);
    }

    /// A writer far behind (a disk that hangs: here, another process holds the file's lock)
    /// never stalls the threads that make dead letters: past LETTER_BACKLOG lines waiting,
    /// each goes whole to the last resort at once.
    #[tokio::test]
    async fn a_dead_letter_writer_far_behind_sends_the_overflow_to_the_last_resort() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        let held = hold_lock_of(&path);
        let stats = Arc::new(RetryStats::default());
        let seen = Arc::new(Mutex::new(0usize));
        let dead = Arc::new(DeadLetters::start(DeadLetterFile {
            path: path.clone(),
            store: LetterStore::Memory,
            stats: stats.clone(),
            last_resort: Box::new({
                let seen = seen.clone();
                move |_: &str| *seen.lock() += 1
            }),
        }));
        let job = claimed(faulty().as_ref(), 28).await;
        let letters = LETTER_BACKLOG + LETTER_BATCH + 100;
        assert!(
            settled_from_a_thread(&dead, &stats, &job, letters),
            "the caller waited for the writer"
        );
        drop(held);
        dead.flush();
        let overflow = *seen.lock();
        assert!(overflow >= 100, "{overflow} lines went to the last resort");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.lines().count() + overflow,
            letters,
            "every line is somewhere"
        );
        assert_eq!(stats.pending.load(Ordering::Acquire), 0);
    }

    /// One append takes at most LETTER_BATCH_BYTES of responses, however many lines wait:
    /// 256 lines of 1 MiB responses took about a gigabyte at once.
    #[tokio::test]
    async fn a_dead_letter_batch_is_bounded_by_bytes() {
        let mut job = claimed(faulty().as_ref(), 29).await;
        let letter = |job: &PendingCompletion| {
            Letter::Line(LetterLine {
                job: job.clone(),
                attempts: 1,
                reason: "store failed".into(),
                in_store: InStore::Unknown,
                at: SystemTime::now(),
            })
        };
        job.completion = Completion::Response(Arc::new(StoredResponse::new(
            201,
            Vec::<(&str, Bytes)>::new(),
            Bytes::from(vec![7u8; 3 << 20]),
        )));
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..8 {
            tx.send(letter(&job)).unwrap();
        }
        let mut sizes = Vec::new();
        while let Ok(first) = rx.try_recv() {
            sizes.push(next_batch(first, &rx).0.len());
        }
        assert_eq!(
            sizes,
            [3, 3, 2],
            "8 MiB of 3 MiB responses: the third crosses it"
        );
        // Small lines still go many at once.
        job.completion = Completion::Unreplayable { status: 201 };
        for _ in 0..300 {
            tx.send(letter(&job)).unwrap();
        }
        let (small, _) = next_batch(rx.recv().unwrap(), &rx);
        assert_eq!(small.len(), LETTER_BATCH);
    }

    /// The overflow goes to stderr from a thread of its own: a stderr that waits (a reader that
    /// stalled, the log writer holding it for a batch) does not hold the caller, a request
    /// thread, which used to write there itself.
    #[tokio::test]
    async fn a_stalled_stderr_does_not_hold_the_caller_of_an_overflowing_dead_letter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        let held = hold_lock_of(&path);
        let stats = Arc::new(RetryStats::default());
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let seen = Arc::new(Mutex::new(0usize));
        let dead = Arc::new(DeadLetters::start(DeadLetterFile {
            path: path.clone(),
            store: LetterStore::Memory,
            stats: stats.clone(),
            last_resort: Box::new({
                let (gate, seen) = (gate.clone(), seen.clone());
                move |_: &str| {
                    let (open, cv) = &*gate;
                    let mut open = open.lock().unwrap();
                    while !*open {
                        open = cv.wait(open).unwrap();
                    }
                    *seen.lock() += 1;
                }
            }),
        }));
        let job = claimed(faulty().as_ref(), 32).await;
        let letters = LETTER_BACKLOG + LETTER_BATCH + 50;
        assert!(
            settled_from_a_thread(&dead, &stats, &job, letters),
            "the caller waited on stderr"
        );
        assert_eq!(*seen.lock(), 0, "the stalled stderr took nothing yet");
        // stderr and the file come back: every line is somewhere, none twice.
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        drop(held);
        dead.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count() + *seen.lock(), letters);
        assert_eq!(stats.pending.load(Ordering::Acquire), 0);
    }

    /// What waits for a stalled stderr is bounded: past OVERFLOW_BYTES of responses with the
    /// overflow thread, the caller writes its line itself (and waits) instead of queueing it.
    #[tokio::test]
    async fn the_overflow_waiting_for_a_stalled_stderr_is_bounded() {
        let stats = Arc::new(RetryStats::default());
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        // Lines the last resort was handed, and those from a thread other than the overflow's.
        let seen = Arc::new(Mutex::new((0usize, 0usize)));
        let (caller_wrote, caller_writes) = std::sync::mpsc::channel();
        let started = DeadLetters::start(DeadLetterFile {
            path: std::path::PathBuf::from("/nonexistent/dead.jsonl"),
            store: LetterStore::Memory,
            stats: stats.clone(),
            last_resort: Box::new({
                let (gate, seen) = (gate.clone(), seen.clone());
                let caller_wrote = std::sync::Mutex::new(caller_wrote);
                move |_: &str| {
                    let overflow_thread =
                        std::thread::current().name() == Some("dead letters to stderr");
                    if !overflow_thread {
                        let _ = caller_wrote.lock().unwrap().send(());
                    }
                    let (open, cv) = &*gate;
                    let mut open = open.lock().unwrap();
                    while !*open {
                        open = cv.wait(open).unwrap();
                    }
                    let mut seen = seen.lock();
                    seen.0 += 1;
                    seen.1 += usize::from(!overflow_thread);
                }
            }),
        });
        // A writer that is always too far behind (a queue nobody reads: a disk that hangs),
        // whatever the scheduling: every line goes the overflow's way.
        let (behind, _never_read) = std::sync::mpsc::sync_channel(0);
        let dead = Arc::new(DeadLetters {
            queue: Some(behind),
            ..started
        });
        // 2 MiB responses, 40 of them: 31 fit under the bound.
        let mut job = claimed(faulty().as_ref(), 34).await;
        job.completion = Completion::Response(Arc::new(StoredResponse::new(
            201,
            Vec::<(&str, Bytes)>::new(),
            Bytes::from(vec![7u8; 2 << 20]),
        )));
        let letters = 40;
        let caller = settling_from_a_thread(&dead, &stats, &job, letters);
        caller_writes
            .recv_timeout(Duration::from_secs(30))
            .expect("the caller went on queueing for the stalled stderr");
        let waiting = dead.spilling.load(Ordering::Acquire);
        assert!(waiting <= OVERFLOW_BYTES, "{waiting} bytes waiting");
        assert!(
            waiting > OVERFLOW_BYTES - overflow_weight_of(&job),
            "the bound, not less: {waiting}"
        );
        // stderr comes back: every line is written, once.
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        caller.join().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while seen.lock().0 < letters {
            assert!(std::time::Instant::now() < deadline, "{:?}", *seen.lock());
            std::thread::sleep(Duration::from_millis(10));
        }
        let (to_stderr, by_callers) = *seen.lock();
        assert_eq!(to_stderr, letters);
        assert!((1..=letters - 31).contains(&by_callers), "{by_callers}");
        assert_eq!(stats.pending.load(Ordering::Acquire), 0);
        assert_eq!(dead.spilling.load(Ordering::Acquire), 0);
    }

    /// A line larger than the bound goes to the overflow thread when nothing waits there,
    /// alone; the next waits for it.
    #[test]
    fn a_line_larger_than_the_overflow_bound_goes_alone() {
        let dead = DeadLetters::start(DeadLetterFile {
            path: std::path::PathBuf::from("/nonexistent/dead.jsonl"),
            store: LetterStore::Memory,
            stats: Arc::new(RetryStats::default()),
            last_resort: Box::new(|_: &str| {}),
        });
        assert!(dead.room_to_spill(OVERFLOW_BYTES + 1));
        assert!(!dead.room_to_spill(1), "the bound is taken");
        dead.spilling.store(0, Ordering::Release);
        assert!(dead.room_to_spill(OVERFLOW_BYTES));
        assert!(!dead.room_to_spill(1));
    }

    fn overflow_weight_of(job: &PendingCompletion) -> usize {
        job.completion.response_bytes() + 1024
    }

    /// The exit's flush gives up at its deadline on a file that does not take the lines (here
    /// another process holds its lock), instead of holding the process until it is killed.
    #[tokio::test]
    async fn the_exit_flush_gives_up_on_a_file_that_hangs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        let held = hold_lock_of(&path);
        let stats = Arc::new(RetryStats::default());
        let dead = DeadLetters::start(DeadLetterFile {
            path: path.clone(),
            store: LetterStore::Memory,
            stats: stats.clone(),
            last_resort: Box::new(|_: &str| {}),
        });
        let job = claimed(faulty().as_ref(), 33).await;
        stats.pending.fetch_add(1, Ordering::AcqRel);
        dead.settle(job, 1, "store failed", InStore::Unknown);
        let started = std::time::Instant::now();
        assert!(!dead.flush_until(Some(started + Duration::from_millis(200))));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            stats.pending.load(Ordering::Acquire),
            1,
            "still waiting, and said so"
        );
        // The lock goes: the line is written, and a flush then gets through.
        drop(held);
        assert!(dead.flush_until(Some(std::time::Instant::now() + Duration::from_secs(10))));
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
    }

    /// Past `queue_bytes` of stored responses waiting, the next completion is dead-lettered at
    /// once however few are waiting: an outage of large responses cannot hold
    /// `queue_capacity` × `max_response_bytes`. What leaves the queue gives its bytes back.
    #[tokio::test]
    async fn the_queue_is_bounded_by_the_bytes_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(16 << 20, 1)));
        let mut o = options(dir.path());
        o.queue_bytes = 1 << 20;
        // No worker: nothing drains the queue.
        let (retrier, _worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        let large = |mut job: PendingCompletion| {
            job.completion = Completion::Response(Arc::new(StoredResponse::new(
                201,
                Vec::<(&str, Bytes)>::new(),
                Bytes::from(vec![7u8; 600 << 10]),
            )));
            job
        };
        retrier.submit(large(claimed(store.as_ref(), 40).await));
        assert_eq!(
            retrier.jobs.waiting.lock().len(),
            1,
            "600 KiB fits the 1 MiB"
        );
        retrier.submit(large(claimed(store.as_ref(), 41).await));
        retrier.flush_dead_letters();
        assert_eq!(retrier.jobs.waiting.lock().len(), 1, "a second would not");
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("queue_bytes"), "{text}");
        // Small ones still fit beside it.
        retrier.submit(claimed(store.as_ref(), 42).await);
        assert_eq!(retrier.jobs.waiting.lock().len(), 2);
        // Leaving gives the bytes back.
        assert_eq!(retrier.dead_letter_pending("stopping"), 2);
        assert_eq!(retrier.jobs.bytes.load(Ordering::Acquire), 0);
        retrier.submit(large(claimed(store.as_ref(), 43).await));
        assert_eq!(retrier.jobs.waiting.lock().len(), 1);
    }

    /// A retry that panics (a bug in a store) dead-letters its completion at once rather than
    /// leave it waiting, with no task to retry it, until the process stops.
    #[tokio::test]
    async fn a_retry_that_panics_dead_letters_its_completion() {
        let dir = tempfile::tempdir().unwrap();
        let store = faulty();
        let job = claimed(store.as_ref(), 44).await;
        store.set(Fault::CompletePanics);
        let (retrier, worker) =
            CompletionRetrier::new(store.clone(), no_local_copies(), options(dir.path()));
        tokio::spawn(worker);
        retrier.submit(job);
        settle(&retrier).await;
        retrier.flush_dead_letters();
        let text = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
        assert!(text.contains("retry task panicked"), "{text}");
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_full_queue_dead_letters_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FaultyStore::new(MemoryStore::new(1 << 20, 1)));
        store.set(Fault::Down);
        let mut o = options(dir.path());
        o.queue_capacity = 1;
        // No worker: nothing drains the queue.
        let (retrier, _worker) = CompletionRetrier::new(store.clone(), no_local_copies(), o);
        store.set(Fault::None);
        let a = claimed(store.as_ref(), 4).await;
        let b = claimed(store.as_ref(), 5).await;
        retrier.submit(a);
        retrier.submit(b);
        retrier.flush_dead_letters();
        assert_eq!(retrier.stats().dead_lettered.load(Ordering::Relaxed), 1);
        assert_eq!(retrier.pending(), 1);
        assert_eq!(
            retrier.stats().queued.load(Ordering::Relaxed),
            1,
            "the one dead-lettered at once was never queued for a retry"
        );
    }
}
