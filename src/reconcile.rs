//! `idemgate --config FILE --reconcile DEAD_LETTERS [--apply]`: what became of each dead-lettered
//! completion, and, with `--apply`, putting back the ones the store lacks.
//!
//! A dead letter is a response the backend returned that the store did not confirm (see
//! [`crate::store::retry`]). For each line, the record it names is read from the configured
//! store, and the line is reported as one of:
//!
//! - `stored`: the record holds exactly this response, under this execution id, and the line's
//!   write was not refused: a write that timed out landed after all. Nothing was lost.
//! - `stored, unconfirmed`: the record reads the same, but that does not prove this execution
//!   put it there: the line's write was refused (`"in_store": "no"`: the key was taken over, or
//!   the record was gone), or the response was too large to replay and is kept as its status
//!   alone. Another execution that answered the same cannot be ruled out (unless an earlier
//!   `--apply` restored it).
//! - `another outcome`: the record holds another response, or belongs to another execution id
//!   (re-created after it was lost), or, for a line whose write was refused, is the claim of the
//!   request that took the key over under the same id, lapsed with its outcome unknown. Both
//!   executions may have happened; that needs a person (refund, cancel).
//! - `executing`: a request holds the record's lock right now. Run again once it is done.
//! - `missing`: the record is absent, or released or in flight with its lock lapsed under this
//!   execution and fingerprint, so a retry would execute the key again (in flight, it may be
//!   the claim of a request that took the key over and lost its outcome too: said so). With
//!   `--apply` the
//!   response is written back — claimed with the line's fingerprint and execution id, then
//!   completed for what is left of its `ttl` counted from when the line was written — so retries
//!   replay it: `restored`.
//! - `expired`: that `ttl` has passed; a retry would be a new request by then, and nothing is
//!   restored.
//!
//! A line that cannot be read, or whose record cannot be read or restored (another request's
//! fingerprint holds the key: a retry gets 422), is reported with the reason and counted as
//! failed. Nothing is ever overwritten: `claim.lua` takes a record only when it is free, and a
//! record that changed between the read and the claim is reported and left alone (a claim that
//! took a record of another execution id releases it again at once).

use std::fmt;
use std::io::{self, BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;

use crate::store::retry::LetterStore;
use crate::store::{
    parse_digest, ClaimOutcome, ClaimRequest, Completion, Digest, OwnerToken, Record, RecordKey,
    RecordState, RecordStore, StoredResponse, WriteOutcome,
};

/// The longest line read: a dead letter of the largest response a route may store (1 GiB, in
/// base64) with its head and fields fits well within it.
const MAX_LINE_BYTES: usize = 1536 << 20;

/// How long the claim that restores a record holds its lock: the completion follows at once.
const RESTORE_LOCK: Duration = Duration::from_secs(10);

/// One dead-letter line, read.
#[derive(Debug)]
struct Letter {
    key: RecordKey,
    execution_id: u64,
    /// Absent in lines written before dead letters carried it: such a record cannot be restored.
    fingerprint: Option<Digest>,
    completion: Completion,
    /// When the record's `ttl` ends: the line's time plus its `ttl_ms`.
    expires_at_unix_ms: u64,
    /// The store refused the line's write (`"in_store": "no"`): whatever the record holds, this
    /// execution did not write it.
    refused: bool,
    /// The store refused the write because another request had taken the key over
    /// (`"reason": "lock taken over"`).
    taken_over: bool,
    /// Where its record lives; absent in lines written before dead letters carried it, which
    /// are judged against the config's store as they always were.
    store: Option<LetterStore>,
}

/// What became of one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The record holds exactly this response, under this execution id, and the line's write
    /// was not refused.
    Stored,
    /// The record reads the same, but that does not prove this execution wrote it (`why`).
    StoredUnconfirmed {
        /// Why the match proves nothing: the write was refused, or only a status is kept.
        why: &'static str,
    },
    /// The record holds another response, or belongs to another execution id.
    AnotherOutcome {
        /// What the record holds instead.
        what: String,
    },
    /// A request holds the record's lock now.
    Executing,
    /// The store lacks it; `--apply` was not given.
    Missing {
        /// The record is in flight under the line's execution id, its lock lapsed.
        over_lapsed: bool,
    },
    /// Written back (`--apply`).
    Restored {
        /// Over a claim under the line's execution id whose lock had lapsed.
        over_lapsed: bool,
    },
    /// Its `ttl` has passed.
    Expired,
    /// The line, or its record, could not be read or restored.
    Failed(String),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Stored => f.write_str("stored: the record holds this response; nothing lost"),
            Verdict::StoredUnconfirmed { why } => write!(
                f,
                "stored, unconfirmed: the record reads the same, but {why}; another execution \
                 that answered the same cannot be ruled out (unless an earlier --apply restored it)"
            ),
            Verdict::AnotherOutcome { what } => write!(
                f,
                "another outcome: {what}; both executions may have happened"
            ),
            Verdict::Executing => f.write_str(
                "executing: a request holds the record's lock now; run again once it is done",
            ),
            Verdict::Missing { over_lapsed } => {
                f.write_str(
                    "missing: a retry would execute again; --apply writes this response back",
                )?;
                lapsed_caveat(f, *over_lapsed)
            }
            Verdict::Restored { over_lapsed } => {
                f.write_str("restored: retries now replay this response")?;
                lapsed_caveat(f, *over_lapsed)
            }
            Verdict::Expired => f.write_str(
                "expired: its ttl has passed (the key may have been used again since); nothing \
                 to restore",
            ),
            Verdict::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// What a claim in flight under the line's execution id, its lock lapsed, cannot tell: whose it
/// is. Usually the line's own (its execution's lock lapsed while the completion was retried);
/// but a request that took the key over meanwhile keeps the id, and if its outcome was lost too
/// the backend ran the key twice, which no record shows.
fn lapsed_caveat(f: &mut fmt::Formatter<'_>, over_lapsed: bool) -> fmt::Result {
    if !over_lapsed {
        return Ok(());
    }
    f.write_str(
        " (the record was in flight under this execution id, its lock lapsed: this line's own \
         claim, or that of a request that took the key over and lost its outcome too; if the \
         log shows a lapsed takeover of this record (the first 16 hex digits of its hash), \
         check the backend for a double execution)",
    )
}

/// Counts of each verdict over a file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Lines whose response the store holds.
    pub stored: usize,
    /// Lines whose record reads the same without proving it is theirs.
    pub unconfirmed: usize,
    /// Lines whose record holds another execution's response.
    pub another_outcome: usize,
    /// Lines whose record is locked by a request now.
    pub executing: usize,
    /// Lines the store lacks, not restored.
    pub missing: usize,
    /// Lines written back.
    pub restored: usize,
    /// Lines past their ttl.
    pub expired: usize,
    /// Lines that could not be read or restored.
    pub failed: usize,
    /// Of the restored, missing and expired lines, those refused because another request took their
    /// key over (`"reason": "lock taken over"`): it executed the key again under the same
    /// execution id, so the backend ran it twice whatever the store holds now (a failover that
    /// lost the record, the ttl passing). They need someone, as an `another outcome` does.
    pub executed_again: usize,
}

impl Tally {
    fn count(&mut self, verdict: &Verdict) {
        let slot = match verdict {
            Verdict::Stored => &mut self.stored,
            Verdict::StoredUnconfirmed { .. } => &mut self.unconfirmed,
            Verdict::AnotherOutcome { .. } => &mut self.another_outcome,
            Verdict::Executing => &mut self.executing,
            Verdict::Missing { .. } => &mut self.missing,
            Verdict::Restored { .. } => &mut self.restored,
            Verdict::Expired => &mut self.expired,
            Verdict::Failed(_) => &mut self.failed,
        };
        *slot += 1;
    }

    /// Whether some line still needs someone (or another run).
    pub fn needs_action(&self) -> bool {
        self.unconfirmed
            + self.another_outcome
            + self.executing
            + self.missing
            + self.failed
            + self.executed_again
            > 0
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} stored, {} stored unconfirmed, {} restored, {} missing, {} another outcome, \
             {} executing, {} expired, {} failed; {} executed again",
            self.stored,
            self.unconfirmed,
            self.restored,
            self.missing,
            self.another_outcome,
            self.executing,
            self.expired,
            self.failed,
            self.executed_again
        )
    }
}

/// Opens the dead-letter file for [`reconcile`], to be read a line at a time (a file of many
/// large responses need not fit in memory), up to its length when opened. That length is read
/// under a shared `flock`: a proxy appending (each append takes the exclusive lock) finishes
/// its line first, so no line below it is read half-way and reported unreadable. Lines
/// appended later are left for the next run; an append never rewrites what came before it (a
/// failed one cuts the file back to where it began), so the lock need not be held while the
/// lines are judged, and proxies appending meanwhile do not wait on a long `--apply`. Anything
/// other than a file (a pipe: `--reconcile <(zcat dead.jsonl.gz)`) has no length, and is read
/// to its end. A lock held past [`LOCK_WAIT`] (a proxy whose disk hangs in the append's
/// `fsync`) is an error that says so, not a run that hangs without a word.
pub fn open_dead_letters(path: &std::path::Path) -> io::Result<impl io::BufRead> {
    open_dead_letters_within(path, LOCK_WAIT)
}

/// How long [`open_dead_letters`] waits for an append under way to finish.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);

fn open_dead_letters_within(
    path: &std::path::Path,
    wait: Duration,
) -> io::Result<impl io::BufRead> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Ok(io::BufReader::new(Exactly {
            inner: file.take(u64::MAX),
            sized: false,
        }));
    }
    // `flock(2)` on Unix, as a proxy's appends take it.
    let until = std::time::Instant::now() + wait;
    loop {
        match file.try_lock_shared() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "a proxy has held the file's lock for an append over {}s (a disk that \
                         hangs?); try again once it lets go",
                        wait.as_secs_f64()
                    ),
                ))
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
    }
    let len = file.metadata()?.len();
    file.unlock()?;
    Ok(io::BufReader::new(Exactly {
        inner: file.take(len),
        sized: true,
    }))
}

/// Reads `inner` to its limit (the file's length when opened, if `sized`; a pipe is read to its
/// end) and then ends; an end before that (the file cut short by hand while it is read) is an
/// error, not a quiet early end that would leave lines unjudged.
struct Exactly {
    inner: io::Take<std::fs::File>,
    sized: bool,
}

impl io::Read for Exactly {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let left = self.inner.limit();
        if n == 0 && self.sized && left > 0 && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the file was cut short while it was read ({left} bytes missing)"),
            ));
        }
        Ok(n)
    }
}

/// Reconciles every line of `dead_letters` against `store`, writing one line per dead letter
/// and a summary to `out`; with `apply`, restores the missing ones. Lines are read one at a
/// time, as bytes: a torn or hand-damaged line fails alone, not the whole file. Every line is
/// judged (and restored) even when `out` fails (`--apply | head` closes the pipe early): the
/// report stops, the work does not, and the first write error is returned at the end. A read
/// of the file that fails ends the run there, counted as a failed line.
pub async fn reconcile(
    store: &Arc<dyn RecordStore>,
    key_prefix: &str,
    dead_letters: &mut dyn io::BufRead,
    apply: bool,
    out: &mut dyn Write,
) -> io::Result<Tally> {
    reconcile_lines(store, key_prefix, dead_letters, apply, out, MAX_LINE_BYTES).await
}

/// [`reconcile`], reading lines of at most `max_line` bytes: a longer one is read past and
/// counted as failed.
async fn reconcile_lines(
    store: &Arc<dyn RecordStore>,
    key_prefix: &str,
    dead_letters: &mut dyn io::BufRead,
    apply: bool,
    out: &mut dyn Write,
    max_line: usize,
) -> io::Result<Tally> {
    let mut report: io::Result<()> = Ok(());
    let mut say = |text: std::fmt::Arguments<'_>| {
        if report.is_ok() {
            report = writeln!(out, "{text}");
        }
    };
    let mut tally = Tally::default();
    let mut line = Vec::new();
    for n in 0.. {
        line.clear();
        // One byte more than a line may have, to tell a longer one.
        let limit = u64::try_from(max_line).map_or(u64::MAX, |n| n.saturating_add(1));
        let mut bounded = io::Read::take(&mut *dead_letters, limit);
        match bounded.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) if line.len() > max_line && line.last() != Some(&b'\n') => {
                // Longer than any line idemgate writes: a damaged file. Read past, not kept.
                line = Vec::new();
                let verdict = match dead_letters.skip_until(b'\n') {
                    Ok(_) => Verdict::Failed(format!(
                        "longer than any dead letter ({max_line} bytes): not read"
                    )),
                    Err(e) => Verdict::Failed(format!("reading the file: {e}")),
                };
                tally.count(&verdict);
                say(format_args!("line {}: ?: {verdict}", n + 1));
                continue;
            }
            Ok(_) => {}
            Err(e) => {
                let verdict = Verdict::Failed(format!("reading the file: {e}"));
                tally.count(&verdict);
                say(format_args!("line {}: ?: {verdict}", n + 1));
                break;
            }
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches(['\n', '\r']);
        if text.trim().is_empty() {
            continue;
        }
        let (label, verdict, taken_over) = match parse(text) {
            Ok(letter) => (
                format!(
                    "{}/{} execution {}",
                    letter.key.tenant,
                    hex::encode(letter.key.hash),
                    letter.execution_id
                ),
                match elsewhere(&letter, key_prefix) {
                    Some(verdict) => verdict,
                    None => {
                        judge(
                            store.as_ref(),
                            &letter,
                            apply,
                            crate::snowflake::unix_ms_now(),
                        )
                        .await
                    }
                },
                letter.taken_over,
            ),
            Err(why) => (
                "?".to_string(),
                Verdict::Failed(format!("unreadable line: {why}")),
                false,
            ),
        };
        tally.count(&verdict);
        // The other verdicts of such a line say as much already (another outcome), or that
        // another execution cannot be ruled out (stored, unconfirmed).
        let again = taken_over
            && matches!(
                verdict,
                Verdict::Restored { .. } | Verdict::Expired | Verdict::Missing { .. }
            );
        if again {
            tally.executed_again += 1;
        }
        let again = match again {
            true => {
                "; but its key was taken over and executed again under this id after its \
                     lock lapsed (the line's write was refused for it): check the backend for \
                     a double execution"
            }
            false => "",
        };
        say(format_args!("line {}: {label}: {verdict}{again}", n + 1));
    }
    say(format_args!("{tally}"));
    report.map(|()| tally)
}

/// Why `letter` cannot be judged against this config's store (Redis under `key_prefix`): it
/// names a record elsewhere. Read as if it were this store's, its record would look missing
/// (and `--apply` would write it under keys no retry reads), or would be another's.
fn elsewhere(letter: &Letter, key_prefix: &str) -> Option<Verdict> {
    match &letter.store {
        None => None,
        Some(LetterStore::Redis { key_prefix: theirs }) if theirs == key_prefix => None,
        Some(LetterStore::Redis { key_prefix: theirs }) => Some(Verdict::Failed(format!(
            "written under store.redis.key_prefix {theirs:?}, and this config's is \
             {key_prefix:?}: run --reconcile with the config of the proxy that wrote it"
        ))),
        Some(LetterStore::Memory) => Some(Verdict::Failed(
            "written by a proxy on the embedded store: its record ended with that process, so \
             a retry now executes the key again; the line is the only copy of the response"
                .into(),
        )),
    }
}

/// What became of `letter`, restoring it when `apply` and the store lacks it.
async fn judge(store: &dyn RecordStore, letter: &Letter, apply: bool, now_ms: u64) -> Verdict {
    let record = match store.get(&letter.key).await {
        Ok(record) => record,
        Err(e) => return Verdict::Failed(format!("reading the record: {e}")),
    };
    let left = Duration::from_millis(letter.expires_at_unix_ms.saturating_sub(now_ms));
    // A record of another execution created once the line's ttl had passed is the key used
    // again, as a client may after the ttl: no trace of a double execution. Its execution id
    // tells when it was created (a Snowflake id is stamped with its first claim's time).
    let reused = record.as_ref().is_some_and(|r| {
        r.execution_id != letter.execution_id
            && crate::snowflake::decode(r.execution_id).unix_ms >= letter.expires_at_unix_ms
    });
    if reused {
        return Verdict::Expired;
    }
    let over_lapsed = record
        .as_ref()
        .is_some_and(|r| matches!(r.state, RecordState::InFlight { .. }));
    match held(record.as_ref(), letter) {
        Some(verdict) => verdict,
        None if left.is_zero() => Verdict::Expired,
        None if !apply => Verdict::Missing { over_lapsed },
        None => restore(store, letter, left, over_lapsed).await,
    }
}

/// The verdict a record read from the store gives, or `None` when the store lacks the response
/// and restoring it is this line's to do: the record is absent, or released or in flight with
/// its lock lapsed, under the line's execution id and fingerprint.
fn held(record: Option<&Record>, letter: &Letter) -> Option<Verdict> {
    let record = record?;
    if record.execution_id != letter.execution_id {
        return Some(Verdict::AnotherOutcome {
            what: format!(
                "the record was created again since (execution {}, {})",
                record.execution_id,
                state(&record.state)
            ),
        });
    }
    match &record.state {
        RecordState::Completed(c) if *c != letter.completion => Some(Verdict::AnotherOutcome {
            what: format!("the record holds another response ({})", c.status()),
        }),
        RecordState::Completed(Completion::Unreplayable { .. }) => {
            Some(Verdict::StoredUnconfirmed {
                why: "an unreplayable response is kept as its status alone",
            })
        }
        RecordState::Completed(_) if letter.refused => Some(Verdict::StoredUnconfirmed {
            why: "the store refused this line's write",
        }),
        RecordState::Completed(_) => Some(Verdict::Stored),
        RecordState::InFlight { lock_remaining } if !lock_remaining.is_zero() => {
            Some(Verdict::Executing)
        }
        // The store refused the line's write because another request held the key: a claim
        // under its execution id now is that request's, which took the key over after the lock
        // lapsed (a takeover keeps the id) and ran it again, its outcome unknown. Written back,
        // its execution would be hidden behind this one's answer. (A line refused because the
        // record was gone meets, if anything, the claim of an earlier `--apply` that could not
        // complete.)
        RecordState::InFlight { .. } if letter.taken_over => Some(Verdict::AnotherOutcome {
            what: "another request took the key over under this execution id after its lock \
                   lapsed, and its outcome is unknown (its lock lapsed too)"
                .into(),
        }),
        _ if letter
            .fingerprint
            .is_some_and(|fingerprint| fingerprint != record.fingerprint) =>
        {
            Some(Verdict::Failed(
                "cannot restore: the record carries another request's fingerprint (a retry gets \
                 422, not a second execution)"
                    .into(),
            ))
        }
        _ => None,
    }
}

fn state(state: &RecordState) -> String {
    match state {
        RecordState::Completed(c) => format!("completed, {}", c.status()),
        RecordState::InFlight { lock_remaining } if lock_remaining.is_zero() => {
            "in flight, its lock lapsed".into()
        }
        RecordState::InFlight { .. } => "in flight".into(),
        RecordState::Released => "released".into(),
    }
}

/// Claims the record with the line's fingerprint and execution id, then completes it with the
/// line's response for `left`. A record that changed since it was read is left alone;
/// `over_lapsed` says it was read in flight, its lock lapsed.
async fn restore(
    store: &dyn RecordStore,
    letter: &Letter,
    left: Duration,
    over_lapsed: bool,
) -> Verdict {
    let Some(fingerprint) = letter.fingerprint else {
        return Verdict::Failed(
            "cannot restore: the line has no fingerprint (written by an older idemgate)".into(),
        );
    };
    let owner = OwnerToken::random();
    let claim = ClaimRequest {
        key: letter.key.clone(),
        fingerprint,
        owner,
        execution_id: letter.execution_id,
        lock_ttl: RESTORE_LOCK,
        ttl: left,
    };
    match store.claim(&claim).await {
        Ok(ClaimOutcome::Acquired { execution_id, .. }) if execution_id == letter.execution_id => {}
        Ok(ClaimOutcome::Acquired { execution_id, .. }) => {
            // Re-created under another execution since it was read: not this line's record.
            // Give it back as it was found (free) rather than holding its lock.
            let released = match store.release(&letter.key, owner).await {
                Ok(_) => "",
                Err(_) => " (its claim could not be released: it lapses in 10 s)",
            };
            return Verdict::AnotherOutcome {
                what: format!(
                    "the record was created again since (execution {execution_id}){released}"
                ),
            };
        }
        Ok(ClaimOutcome::Existing(record)) => {
            return match held(Some(&record), letter) {
                Some(verdict) => verdict,
                None => {
                    Verdict::Failed("the record changed while being restored; left alone".into())
                }
            }
        }
        Err(e) => return Verdict::Failed(format!("claiming the record: {e}")),
    }
    match store
        .complete(&letter.key, owner, letter.completion.clone(), left)
        .await
    {
        Ok(WriteOutcome::Applied) => Verdict::Restored { over_lapsed },
        Ok(WriteOutcome::NotOwner) => {
            Verdict::Failed("the record was taken over while being restored; left alone".into())
        }
        Err(e) => Verdict::Failed(format!(
            "completing the record: {e} (it stays claimed for {}s, then a retry executes)",
            RESTORE_LOCK.as_secs()
        )),
    }
}

/// [`parse`], for [`crate::fuzzing::dead_letter`].
pub(crate) fn parse_for_fuzzing(text: &str) -> Result<crate::fuzzing::DeadLetter, String> {
    parse(text).map(|l| {
        (
            l.key,
            l.execution_id,
            l.fingerprint,
            l.completion,
            l.expires_at_unix_ms,
        )
    })
}

/// Reads one dead-letter line (see [`crate::store::retry::dead_letter_line`]).
fn parse(text: &str) -> Result<Letter, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let field = |name: &str| v.get(name).ok_or_else(|| format!("no \"{name}\""));
    let string = |name: &str| {
        field(name)?
            .as_str()
            .ok_or_else(|| format!("\"{name}\" is not a string"))
    };
    let number = |name: &str| {
        field(name)?
            .as_u64()
            .ok_or_else(|| format!("\"{name}\" is not a whole number"))
    };
    let digest = |name: &str| -> Result<Digest, String> {
        parse_digest(string(name)?).ok_or_else(|| format!("\"{name}\" is not 64 hex digits"))
    };
    let tenant = crate::key::validate_tenant(string("tenant")?.as_bytes())
        .map_err(|e| format!("\"tenant\": {e}"))?
        .to_owned();
    let key = RecordKey {
        tenant,
        hash: digest("record")?,
    };
    let execution_id = string("execution_id")?
        .parse()
        .map_err(|_| "\"execution_id\" is not a u64".to_string())?;
    let fingerprint = match v.get("fingerprint") {
        None => None,
        Some(_) => Some(digest("fingerprint")?),
    };
    let expires_at_unix_ms = number("at_unix_ms")?.saturating_add(number("ttl_ms")?);
    let completion = parse_response(field("response")?)?;
    // Lines from before `in_store` are "unknown" as far as anyone can tell.
    let refused = match v.get("in_store") {
        None => false,
        Some(_) => match string("in_store")? {
            "no" => true,
            "unknown" => false,
            other => {
                return Err(format!(
                    "\"in_store\" is {other:?}, not \"no\" or \"unknown\""
                ))
            }
        },
    };
    let store = match v.get("store") {
        None => None,
        Some(_) => match string("store")? {
            "memory" => Some(LetterStore::Memory),
            "redis" => Some(LetterStore::Redis {
                key_prefix: string("key_prefix")?.to_owned(),
            }),
            other => {
                return Err(format!(
                    "\"store\" is {other:?}, not \"redis\" or \"memory\""
                ))
            }
        },
    };
    let taken_over = refused && v.get("reason").and_then(|r| r.as_str()) == Some("lock taken over");
    Ok(Letter {
        key,
        execution_id,
        fingerprint,
        completion,
        expires_at_unix_ms,
        refused,
        taken_over,
        store,
    })
}

fn parse_response(v: &serde_json::Value) -> Result<Completion, String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let status = v
        .get("status")
        .and_then(serde_json::Value::as_u64)
        .and_then(|s| u16::try_from(s).ok())
        .filter(|&s| crate::store::response::is_stored_status(s))
        .ok_or("\"response.status\" is not a status a record holds (200-599)")?;
    if v.get("unreplayable") == Some(&serde_json::Value::Bool(true)) {
        return Ok(Completion::Unreplayable { status });
    }
    let mut headers = Vec::new();
    for pair in v
        .get("headers")
        .and_then(serde_json::Value::as_array)
        .ok_or("\"response.headers\" is not a list")?
    {
        let (Some(name), Some(value)) = (
            pair.get(0).and_then(serde_json::Value::as_str),
            pair.get(1).and_then(serde_json::Value::as_str),
        ) else {
            return Err("a response header is not [name, base64 value]".into());
        };
        let value = b64
            .decode(value)
            .map_err(|_| format!("header {name:?}: its value is not base64"))?;
        // As a backend's answer is stored: a valid name (written in lower case) and value.
        let name = http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header {name:?} is not a valid header name"))?;
        http::HeaderValue::from_bytes(&value)
            .map_err(|_| format!("header {name}: its value is not a valid header value"))?;
        headers.push((name.as_str().to_owned(), value));
        if headers.len() > crate::store::response::MAX_HEADERS {
            return Err(format!(
                "more than {} response headers",
                crate::store::response::MAX_HEADERS
            ));
        }
    }
    let body = v
        .get("body_base64")
        .and_then(serde_json::Value::as_str)
        .ok_or("no \"response.body_base64\"")
        .and_then(|body| {
            b64.decode(body)
                .map_err(|_| "\"response.body_base64\" is not base64")
        })?;
    Ok(Completion::Response(Arc::new(StoredResponse::new(
        status, headers, body,
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::retry::{dead_letter_line, InStore, PendingCompletion};
    use crate::store::MemoryStore;

    /// The key prefix the tests' lines are written under and judged against.
    const PREFIX: &str = "idemgate";

    /// Where the tests' lines say their records are: Redis under [`PREFIX`] (the store behind
    /// them is an embedded one, which reads the same).
    fn here() -> LetterStore {
        LetterStore::Redis {
            key_prefix: PREFIX.into(),
        }
    }

    fn response(body: &'static [u8]) -> Completion {
        Completion::Response(Arc::new(StoredResponse::new(
            201,
            vec![
                ("content-type", &b"application/json"[..]),
                ("x-bin", b"\xff\x80"),
            ],
            body,
        )))
    }

    fn letter(n: u8, completion: Completion) -> PendingCompletion {
        PendingCompletion {
            on_fallback: false,
            key: RecordKey {
                tenant: "acme".into(),
                hash: [n; 32],
            },
            owner: OwnerToken::random(),
            completion,
            ttl: Duration::from_secs(3600),
            execution_id: 1000 + u64::from(n),
            fingerprint: [n; 32],
            lock_deadline: tokio::time::Instant::now(),
            lapses_by: tokio::time::Instant::now(),
        }
    }

    fn store() -> Arc<dyn RecordStore> {
        Arc::new(MemoryStore::new(1 << 20, 1))
    }

    async fn run(store: &Arc<dyn RecordStore>, text: &str, apply: bool) -> (Tally, String) {
        let mut out = Vec::new();
        let tally = reconcile(store, PREFIX, &mut text.as_bytes(), apply, &mut out)
            .await
            .unwrap();
        (tally, String::from_utf8(out).unwrap())
    }

    /// Claims `job`'s record as its request did, and lets the lock lapse.
    async fn claim_lapsed(store: &Arc<dyn RecordStore>, job: &PendingCompletion) {
        claim_as(store, job, Duration::from_millis(20)).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }

    /// Claims `job`'s record as its request did, for `lock`.
    async fn claim_as(store: &Arc<dyn RecordStore>, job: &PendingCompletion, lock: Duration) {
        let req = ClaimRequest {
            key: job.key.clone(),
            fingerprint: job.fingerprint,
            owner: job.owner,
            execution_id: job.execution_id,
            lock_ttl: lock,
            ttl: job.ttl,
        };
        assert!(matches!(
            store.claim(&req).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }

    #[test]
    fn lines_read_back_what_was_written() {
        for completion in [
            response(b"{\"order\":1}"),
            Completion::Unreplayable { status: 200 },
        ] {
            let job = letter(1, completion.clone());
            let line = dead_letter_line(&here(), &job, 3, "store failed", InStore::Unknown);
            let read = parse(line.trim()).unwrap();
            assert_eq!(read.key, job.key);
            assert_eq!(read.execution_id, job.execution_id);
            assert_eq!(read.fingerprint, Some(job.fingerprint));
            assert_eq!(read.completion, completion);
            let now = crate::snowflake::unix_ms_now();
            assert!((now + 3_590_000..=now + 3_600_000).contains(&read.expires_at_unix_ms));
        }
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        let good: serde_json::Value = serde_json::from_str(
            dead_letter_line(
                &here(),
                &letter(2, response(b"x")),
                1,
                "r",
                InStore::Unknown,
            )
            .trim(),
        )
        .unwrap();
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            edit(&mut v);
            v.to_string()
        };
        let cases: Vec<(String, &str)> = vec![
            ("{".into(), "not JSON"),
            (with(&|v| v["tenant"] = "bad tenant".into()), "tenant"),
            (
                with(&|v| v["record"] = "abc".into()),
                "\"record\" is not 64 hex digits",
            ),
            (
                with(&|v| v["execution_id"] = 5.into()),
                "\"execution_id\" is not a string",
            ),
            (with(&|v| v["execution_id"] = "-1".into()), "not a u64"),
            (with(&|v| v["fingerprint"] = "zz".into()), "\"fingerprint\""),
            (with(&|v| v["ttl_ms"] = "1".into()), "\"ttl_ms\""),
            (
                with(&|v| v["response"]["status"] = 70000.into()),
                "not a status a record holds (200-599)",
            ),
            (
                with(&|v| v["response"]["status"] = 101.into()),
                "not a status a record holds (200-599)",
            ),
            (
                with(&|v| {
                    let many: Vec<_> = (0..257).map(|i| [format!("h{i}"), String::new()]).collect();
                    v["response"]["headers"] = serde_json::json!(many);
                }),
                "more than 256 response headers",
            ),
            (with(&|v| v["response"]["headers"] = 1.into()), "not a list"),
            (
                with(&|v| v["response"]["headers"] = serde_json::json!([["a"]])),
                "[name, base64 value]",
            ),
            (
                with(&|v| v["response"]["headers"] = serde_json::json!([["a", "!!"]])),
                "not base64",
            ),
            (
                with(&|v| v["response"]["body_base64"] = "!!".into()),
                "not base64",
            ),
            (
                with(&|v| v["response"]["headers"] = serde_json::json!([["a b", ""]])),
                "not a valid header name",
            ),
            (
                with(&|v| v["response"]["headers"] = serde_json::json!([["a", "AA=="]])),
                "not a valid header value",
            ),
            (
                with(&|v| v["in_store"] = "maybe".into()),
                "\"in_store\" is \"maybe\"",
            ),
            (
                with(&|v| v["store"] = "disk".into()),
                "\"store\" is \"disk\"",
            ),
            (
                with(&|v| {
                    v.as_object_mut().unwrap().remove("key_prefix");
                }),
                "no \"key_prefix\"",
            ),
            (
                with(&|v| {
                    v.as_object_mut().unwrap().remove("response");
                }),
                "no \"response\"",
            ),
        ];
        for (text, reason) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(reason), "{text}: {err}");
        }
    }

    /// Completes `job`'s record with `completion`, as `job`'s own request (or, with another
    /// completion, as the request that took the key over).
    async fn complete_as(
        store: &Arc<dyn RecordStore>,
        job: &PendingCompletion,
        completion: Completion,
    ) {
        claim_as(store, job, Duration::from_secs(30)).await;
        assert_eq!(
            store
                .complete(&job.key, job.owner, completion, job.ttl)
                .await
                .unwrap(),
            WriteOutcome::Applied
        );
    }

    #[tokio::test]
    async fn each_fate_of_a_dead_letter_is_told_and_only_missing_ones_are_restored() {
        let store = store();
        let lapse = || tokio::time::sleep(Duration::from_millis(40));
        // Stored after all: the write timed out but landed.
        let stored = letter(1, response(b"one"));
        complete_as(&store, &stored, stored.completion.clone()).await;
        // Taken over: the record holds another execution's answer.
        let taken = letter(2, response(b"two"));
        complete_as(&store, &taken, response(b"the other execution")).await;
        // The same bytes, but the line's write was refused: not proof it is this execution's.
        let refused = letter(3, response(b"three"));
        complete_as(&store, &refused, refused.completion.clone()).await;
        // An unreplayable answer is kept as its status alone: the same status proves nothing.
        let unreplayable = letter(4, Completion::Unreplayable { status: 201 });
        complete_as(&store, &unreplayable, unreplayable.completion.clone()).await;
        // Executing: a request holds the lock now.
        let executing = letter(5, response(b"five"));
        claim_as(&store, &executing, Duration::from_secs(30)).await;
        // Missing: absent, and in flight under this execution with a lapsed lock.
        let absent = letter(6, response(b"six"));
        let lapsed = letter(7, response(b"seven"));
        claim_as(&store, &lapsed, Duration::from_millis(20)).await;
        // Re-created under another execution id (lost, then claimed again, lock lapsed): not
        // this line's record to write.
        let recreated = letter(8, response(b"eight"));
        claim_as(
            &store,
            &PendingCompletion {
                execution_id: 1,
                ..recreated.clone()
            },
            Duration::from_millis(20),
        )
        .await;
        // Lapsed under another request's fingerprint: a retry gets 422; nothing to restore.
        let foreign = letter(9, response(b"nine"));
        claim_as(
            &store,
            &PendingCompletion {
                fingerprint: [0xee; 32],
                ..foreign.clone()
            },
            Duration::from_millis(20),
        )
        .await;
        lapse().await;
        // Expired: its ttl has passed.
        let mut expired = letter(10, response(b"ten"));
        expired.ttl = Duration::ZERO;
        let line = |job: &PendingCompletion| {
            let in_store = if job.key.hash[0] == 3 {
                InStore::No
            } else {
                InStore::Unknown
            };
            dead_letter_line(&here(), job, 1, "store failed", in_store)
        };
        let jobs = [
            &stored,
            &taken,
            &refused,
            &unreplayable,
            &executing,
            &absent,
            &lapsed,
            &recreated,
            &foreign,
            &expired,
        ];
        let mut text: String = jobs.iter().map(|job| line(job)).collect();
        text.push_str("\nnot a line\n");

        let (tally, out) = run(&store, &text, false).await;
        let expected = Tally {
            stored: 1,
            unconfirmed: 2,
            another_outcome: 2,
            executing: 1,
            missing: 2,
            expired: 1,
            failed: 2,
            restored: 0,
            executed_again: 0,
        };
        assert_eq!(tally, expected, "{out}");
        assert!(tally.needs_action());
        for (n, says) in [
            (1, "stored: the record holds this response"),
            (
                2,
                "another outcome: the record holds another response (201)",
            ),
            (
                3,
                "stored, unconfirmed: the record reads the same, but the store refused",
            ),
            (
                4,
                "stored, unconfirmed: the record reads the same, but an unreplayable",
            ),
            (5, "executing"),
            (6, "missing"),
            (7, "missing"),
            (
                8,
                "another outcome: the record was created again since (execution 1,",
            ),
            (
                9,
                "failed: cannot restore: the record carries another request's fingerprint",
            ),
            (10, "expired"),
            (12, "?: failed: unreadable line"),
        ] {
            let found = out
                .lines()
                .find(|l| l.starts_with(&format!("line {n}: ")))
                .unwrap_or_else(|| panic!("no line {n}:\n{out}"));
            assert!(found.contains(says), "line {n}: {found}");
        }
        // The lapsed claim may be a takeover's that lost its outcome too: said, on it alone.
        let caveat = "in flight under this execution id, its lock lapsed";
        let said = |out: &str, n: usize| {
            out.lines()
                .find(|l| l.starts_with(&format!("line {n}: ")))
                .is_some_and(|l| l.contains(caveat))
        };
        assert!(said(&out, 7) && !said(&out, 6), "{out}");
        // Nothing was written without --apply.
        assert_eq!(store.get(&absent.key).await.unwrap(), None);

        let (tally, out) = run(&store, &text, true).await;
        assert_eq!(
            tally,
            Tally {
                missing: 0,
                restored: 2,
                ..expected.clone()
            },
            "{out}"
        );
        assert!(said(&out, 7) && !said(&out, 6), "{out}");
        for job in [&absent, &lapsed] {
            let record = store.get(&job.key).await.unwrap().expect("restored");
            assert_eq!(record.state, RecordState::Completed(job.completion.clone()));
            assert_eq!(record.execution_id, job.execution_id);
            assert_eq!(record.fingerprint, job.fingerprint);
        }
        // The re-created and foreign records were left as they were.
        for (job, id) in [(&recreated, 1), (&foreign, foreign.execution_id)] {
            let record = store.get(&job.key).await.unwrap().expect("still there");
            assert_eq!(record.execution_id, id);
            assert!(
                matches!(record.state, RecordState::InFlight { .. }),
                "{record:?}"
            );
        }
        // Run again: what was restored now reads as stored.
        let (tally, _) = run(&store, &text, true).await;
        assert_eq!(
            tally,
            Tally {
                stored: 3,
                missing: 0,
                ..expected
            }
        );
    }

    /// A line names the store its record lives in. One written under another key prefix, or
    /// by a proxy on the embedded store, is not this config's record: read here it would look
    /// missing, and `--apply` would write it where no retry reads. Such lines fail, saying why,
    /// and nothing is written; a line from before lines named their store is judged as always.
    #[tokio::test]
    async fn a_line_written_for_another_store_is_not_judged_against_this_one() {
        let store = store();
        let job = letter(30, response(b"elsewhere"));
        let other_prefix = LetterStore::Redis {
            key_prefix: "payments".into(),
        };
        for (written_for, why) in [
            (
                &other_prefix,
                "key_prefix \"payments\", and this config's is \"idemgate\"",
            ),
            (&LetterStore::Memory, "embedded store"),
        ] {
            let text = dead_letter_line(written_for, &job, 1, "store failed", InStore::Unknown);
            let (tally, out) = run(&store, &text, true).await;
            assert_eq!(
                tally,
                Tally {
                    failed: 1,
                    ..Tally::default()
                },
                "{out}"
            );
            assert!(out.contains(why), "{out}");
            assert_eq!(store.get(&job.key).await.unwrap(), None, "{out}");
        }

        // A line with neither field (written before lines named their store).
        let mut old: serde_json::Value = serde_json::from_str(
            dead_letter_line(&other_prefix, &job, 1, "store failed", InStore::Unknown).trim(),
        )
        .unwrap();
        old.as_object_mut().unwrap().remove("store");
        old.as_object_mut().unwrap().remove("key_prefix");
        let (tally, out) = run(&store, &old.to_string(), true).await;
        assert_eq!(
            tally,
            Tally {
                restored: 1,
                ..Tally::default()
            },
            "{out}"
        );
    }

    /// A line whose write was refused because the key was taken over meets the takeover's
    /// claim under the same execution id, lapsed with its outcome unknown: both executions may
    /// have run, and writing this one's answer back would hide the other. A line refused
    /// because the record was gone, or whose write may have landed (`in_store: unknown`),
    /// meets no takeover: restored.
    #[tokio::test]
    async fn a_refused_line_meeting_the_takeover_s_claim_is_another_outcome() {
        let store = store();
        let job = letter(40, response(b"first"));
        claim_lapsed(&store, &job).await;
        let takeover = PendingCompletion {
            owner: OwnerToken::random(),
            ..job.clone()
        };
        claim_lapsed(&store, &takeover).await;

        let refused = dead_letter_line(&here(), &job, 1, "lock taken over", InStore::No);
        let (tally, out) = run(&store, &refused, true).await;
        assert_eq!(
            tally,
            Tally {
                another_outcome: 1,
                ..Tally::default()
            },
            "{out}"
        );
        assert!(out.contains("took the key over"), "{out}");
        let record = store.get(&job.key).await.unwrap().unwrap();
        assert!(
            matches!(record.state, RecordState::InFlight { .. }),
            "left alone: {record:?}"
        );
        // The record lost (a failover): written back, so retries replay rather than run the key
        // a third time, and still flagged: the key ran twice.
        assert!(store.delete(&job.key).await.unwrap());
        let (tally, out) = run(&store, &refused, true).await;
        assert_eq!(
            tally,
            Tally {
                restored: 1,
                executed_again: 1,
                ..Tally::default()
            },
            "{out}"
        );
        assert!(tally.needs_action());
        assert!(
            out.contains("check the backend for a double execution"),
            "{out}"
        );

        // Refused because the record was gone, or a write that may have landed: what lapsed
        // under the id is no takeover (an earlier `--apply`'s claim, or this execution's own).
        for (reason, in_store) in [
            ("record gone", InStore::No),
            ("store failed", InStore::Unknown),
        ] {
            let store = self::store();
            claim_lapsed(&store, &job).await;
            let line = dead_letter_line(&here(), &job, 1, reason, in_store);
            let (tally, out) = run(&store, &line, true).await;
            assert_eq!(
                tally,
                Tally {
                    restored: 1,
                    ..Tally::default()
                },
                "{reason}: {out}"
            );
        }
    }

    /// A key used again once the line's ttl had passed, as a client may, holds a new
    /// execution's record: the line expired, and there is no double execution to report.
    #[tokio::test]
    async fn a_key_used_again_after_the_lines_ttl_is_expired_not_another_outcome() {
        let store = store();
        let mut old = letter(20, response(b"old"));
        old.ttl = Duration::from_millis(1);
        let text = dead_letter_line(&here(), &old, 1, "store failed", InStore::Unknown);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let again = PendingCompletion {
            execution_id: crate::snowflake::Snowflake::new(1).next_id(),
            owner: OwnerToken::random(),
            // Lives on, so the verdict comes from the record read, not from its absence.
            ttl: Duration::from_secs(3600),
            ..old.clone()
        };
        complete_as(&store, &again, response(b"new")).await;
        let (tally, out) = run(&store, &text, false).await;
        assert_eq!(tally.expired, 1, "{out}");
        assert!(!tally.needs_action(), "{out}");
        // Created again within the line's ttl, it is another outcome still (the test above).
    }

    /// A report nobody reads any longer (`--apply | head -1` closes the pipe) does not stop the
    /// work: every missing line is still restored, and the write error comes back at the end.
    #[tokio::test]
    async fn a_closed_report_does_not_stop_the_restores() {
        struct Closed(usize);
        impl Write for Closed {
            fn write(&mut self, data: &[u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::from(io::ErrorKind::BrokenPipe));
                }
                self.0 -= 1;
                Ok(data.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let store = store();
        let (a, b) = (letter(40, response(b"a")), letter(41, response(b"b")));
        let text: String = [&a, &b]
            .iter()
            .map(|job| dead_letter_line(&here(), job, 1, "store failed", InStore::Unknown))
            .collect();
        let mut out = Closed(1);
        let result = reconcile(&store, PREFIX, &mut text.as_bytes(), true, &mut out).await;
        assert_eq!(
            result.map(|_| ()).unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
        for job in [&a, &b] {
            let record = store.get(&job.key).await.unwrap();
            assert!(
                matches!(
                    record,
                    Some(Record {
                        state: RecordState::Completed(_),
                        ..
                    })
                ),
                "not restored: {record:?}"
            );
        }
    }

    /// A file cut short while it is read (by hand: proxies only append) ends the run with an
    /// error for the lines it lost, not quietly.
    #[tokio::test]
    async fn a_file_cut_short_while_it_is_read_is_reported() {
        let store = store();
        let (a, b) = (letter(60, response(b"a")), letter(61, response(b"b")));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        let first = dead_letter_line(&here(), &a, 1, "store failed", InStore::Unknown);
        let second = dead_letter_line(&here(), &b, 1, "store failed", InStore::Unknown);
        std::fs::write(&path, format!("{first}{second}")).unwrap();
        let mut lines = open_dead_letters(&path).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(first.len() as u64)
            .unwrap();
        let mut out = Vec::new();
        let tally = reconcile(&store, PREFIX, &mut lines, false, &mut out)
            .await
            .unwrap();
        let out = String::from_utf8(out).unwrap();
        assert_eq!((tally.missing, tally.failed), (1, 1), "{out}");
        assert!(out.contains("cut short"), "{out}");
    }

    /// A line longer than any dead letter (a damaged file, one without newlines) is read past,
    /// never held whole, and counted as failed; the lines after it are read as usual.
    #[tokio::test]
    async fn a_line_longer_than_any_dead_letter_is_read_past() {
        let store = store();
        let job = letter(62, response(b"a"));
        let good = dead_letter_line(&here(), &job, 1, "store failed", InStore::Unknown);
        let text = format!("{}\n{good}{}", "x".repeat(10_000), "y".repeat(5000));
        let mut out = Vec::new();
        let tally = reconcile_lines(&store, PREFIX, &mut text.as_bytes(), false, &mut out, 4096)
            .await
            .unwrap();
        let out = String::from_utf8(out).unwrap();
        assert_eq!((tally.missing, tally.failed), (1, 2), "{out}");
        assert!(out.contains("line 1: ?: "), "{out}");
        assert!(
            out.contains("longer than any dead letter (4096 bytes)"),
            "{out}"
        );
        assert!(out.contains("line 3: ?: "), "{out}");
    }

    /// A pipe has no length: it is read to its end (`--reconcile <(zcat dead.jsonl.gz)`).
    #[test]
    fn a_pipe_is_read_to_its_end() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("letters");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a path we own, as a NUL-terminated string.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let writer = std::thread::spawn({
            let fifo = fifo.clone();
            move || std::fs::write(&fifo, "{\"first\":1}\n{\"second\":2}\n").unwrap()
        });
        let mut text = String::new();
        open_dead_letters(&fifo)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        writer.join().unwrap();
        assert_eq!(text, "{\"first\":1}\n{\"second\":2}\n");
    }

    /// A line of bytes that are not text (a torn write, a damaged disk) fails alone: the lines
    /// around it are judged and restored.
    #[tokio::test]
    async fn a_line_of_damaged_bytes_fails_alone() {
        let store = store();
        let (a, b) = (letter(50, response(b"a")), letter(51, response(b"b")));
        let mut file =
            dead_letter_line(&here(), &a, 1, "store failed", InStore::Unknown).into_bytes();
        file.extend_from_slice(b"\xff\xfe{\"key\":\x00\n");
        file.extend_from_slice(
            dead_letter_line(&here(), &b, 1, "store failed", InStore::Unknown).as_bytes(),
        );
        let mut out = Vec::new();
        let tally = reconcile(&store, PREFIX, &mut &file[..], true, &mut out)
            .await
            .unwrap();
        let out = String::from_utf8(out).unwrap();
        assert_eq!((tally.restored, tally.failed), (2, 1), "{out}");
        assert!(out.contains("line 2: ?: failed: unreadable line"), "{out}");
    }

    /// The file is read only once an append in progress (under the exclusive lock a proxy
    /// takes for it) is done: a half-written line is never read. Lines appended once it is
    /// open are left for the next run, and do not wait for this one.
    /// `path` opened to append under its exclusive `flock`, as a proxy's append holds it.
    fn appending(path: &std::path::Path) -> std::fs::File {
        let file = std::fs::OpenOptions::new().append(true).open(path).unwrap();
        file.lock().unwrap();
        file
    }

    #[test]
    fn the_file_is_read_between_appends() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        std::fs::write(&path, "{\"first\":1}\n").unwrap();
        let writer = appending(&path);
        (&writer).write_all(b"{\"second\":").unwrap();
        let reader = std::thread::spawn({
            let path = path.clone();
            move || open_dead_letters(&path).unwrap()
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(!reader.is_finished(), "opened during an append");
        (&writer).write_all(b"2}\n").unwrap();
        drop(writer);
        let mut lines = reader.join().unwrap();
        let later = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        assert!(later.try_lock().is_ok(), "an open reader holds no lock");
        (&later).write_all(b"{\"third\":3}\n").unwrap();
        let mut text = String::new();
        lines.read_to_string(&mut text).unwrap();
        assert_eq!(text, "{\"first\":1}\n{\"second\":2}\n");
    }

    /// A lock held past the wait (an append stuck in its `fsync`) ends the run with an error
    /// that says so, instead of a hang.
    #[test]
    fn a_lock_held_past_the_wait_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.jsonl");
        std::fs::write(&path, "{}\n").unwrap();
        let writer = appending(&path);
        let error = match open_dead_letters_within(&path, Duration::from_millis(100)) {
            Ok(_) => panic!("opened while an append held the lock"),
            Err(e) => e,
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(
            error.to_string().contains("held the file's lock"),
            "{error}"
        );
        drop(writer);
        assert!(open_dead_letters_within(&path, Duration::from_millis(100)).is_ok());
    }

    #[tokio::test]
    async fn a_record_created_again_between_the_read_and_the_claim_is_given_back() {
        let store = store();
        let job = letter(11, response(b"x"));
        let letter_read =
            parse(dead_letter_line(&here(), &job, 1, "r", InStore::Unknown).trim()).unwrap();
        // Read as absent; by the time of the claim another execution re-created and abandoned it.
        claim_as(
            &store,
            &PendingCompletion {
                execution_id: 5,
                ..job.clone()
            },
            Duration::from_millis(20),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        let verdict = restore(store.as_ref(), &letter_read, Duration::from_secs(60), false).await;
        assert!(
            matches!(&verdict, Verdict::AnotherOutcome { what } if what.contains("execution 5")),
            "{verdict}"
        );
        // Released again, under its own execution id, not completed with this line's answer.
        let record = store.get(&job.key).await.unwrap().unwrap();
        assert_eq!(
            (record.execution_id, record.state),
            (5, RecordState::Released)
        );
    }

    #[tokio::test]
    async fn a_line_without_a_fingerprint_is_reported_not_restored() {
        let store = store();
        let job = letter(7, response(b"x"));
        let mut v: serde_json::Value =
            serde_json::from_str(dead_letter_line(&here(), &job, 1, "r", InStore::Unknown).trim())
                .unwrap();
        v.as_object_mut().unwrap().remove("fingerprint");
        let (tally, out) = run(&store, &v.to_string(), true).await;
        assert_eq!(tally.failed, 1, "{out}");
        assert!(out.contains("no fingerprint"), "{out}");
        assert_eq!(store.get(&job.key).await.unwrap(), None);
    }
}
