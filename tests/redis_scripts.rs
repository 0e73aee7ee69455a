//! Lua script versions on real Redis: the conformance suite on v2 and on a half-and-half
//! canary; a broken canary retried on the active version and rolled back; live script edits
//! (new SHA in force, a syntax error keeps the old one); and through the real binary: both
//! versions serving with one version per key, a broken canary no client notices, file edits
//! and config edits taking effect without a restart.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::Edit;
use common::redis::{repo_lua, script_dir, RedisServer};
use common::{Backend, Proxy, ProxyBuilder, Request};
use idemgate::config::{CanaryConfig, RedisConfig, RedisTopology, ScriptsConfig};
use idemgate::store::redis::{ScriptsApplied, ScriptsError};
use idemgate::store::{
    conformance, ClaimOutcome, ClaimRequest, Completion, OwnerToken, RecordKey, RecordState,
    RecordStore, RedisStore, StoreError, StoredResponse, WriteOutcome,
};

const SECOND: Duration = Duration::from_secs(1);
/// The line of the built-in v2 scripts that names the version they stamp on records.
const V2_STAMP: &str = "local VERSION = 'v2'";

/// `script`'s text with `line` put before the first `anchor` (asserted to be there); other
/// scripts as they are.
fn insert_before(script: &str, anchor: &str, line: &str, name: &str, text: String) -> String {
    if name != script {
        return text;
    }
    let edited = text.replacen(anchor, &format!("{line}\n{anchor}"), 1);
    assert_ne!(edited, text, "the {script} script changed shape");
    edited
}

/// v2's claim that fails after it has written the claim (Redis keeps those writes): the
/// active version's retry must cope with a half-done canary call.
fn claim_failing_after_its_writes(name: &str, text: String) -> String {
    let anchor = "  return {1, execution_id}";
    insert_before("claim", anchor, "  redis.call('NOPE')", name, text)
}

fn settings(server: &RedisServer, scripts: ScriptsConfig) -> RedisConfig {
    RedisConfig {
        urls: vec![server.url()],
        topology: RedisTopology::Single,
        connect_timeout: Duration::from_millis(500),
        response_timeout: SECOND,
        key_prefix: "scripttest".into(),
        scripts,
        tls: None,
    }
}

fn canary(version: &str, percent: u8, min_calls: u64, max_error_rate: f64) -> CanaryConfig {
    CanaryConfig {
        version: version.into(),
        percent,
        tenants: vec![],
        max_error_rate,
        min_calls,
        window: Duration::from_secs(60),
    }
}

fn scripts(dir: Option<&Path>, version: &str, canary: Option<CanaryConfig>) -> ScriptsConfig {
    ScriptsConfig {
        dir: dir.map(Path::to_path_buf),
        version: version.into(),
        canary,
    }
}

async fn store(server: &RedisServer, scripts: ScriptsConfig) -> Arc<RedisStore> {
    let store = Arc::new(RedisStore::new(&settings(server, scripts)).expect("store"));
    store.connect().await.expect("connect");
    store
}

/// The canary's error window: (calls, errors).
fn window(store: &RedisStore) -> (u64, u64) {
    let canary = store.scripts_status().canary.expect("canary status");
    (canary.window_calls, canary.window_errors)
}

fn counts(store: &RedisStore, version: &str) -> (u64, u64) {
    store
        .version_counts()
        .into_iter()
        .find(|(name, _, _)| name == version)
        .map_or((0, 0), |(_, calls, errors)| (calls, errors))
}

/// A key no other call of the test uses.
fn fresh_key() -> RecordKey {
    RecordKey {
        tenant: "acme".into(),
        hash: rand::random(),
    }
}

fn claim_request(key: &RecordKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: [5; 32],
        owner: OwnerToken::random(),
        execution_id: rand::random::<u64>() >> 1,
        lock_ttl: 10 * SECOND,
        ttl: 60 * SECOND,
    }
}

fn response() -> Completion {
    Completion::Response(Arc::new(StoredResponse::new(
        201,
        StoredResponse::NO_HEADERS,
        b"done",
    )))
}

fn hget(server: &RedisServer, key: &str, field: &str) -> Option<String> {
    server.cmd(&["HGET", key, field])
}

// === store level ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_v2_and_on_a_half_canary() {
    let server = RedisServer::start();
    let v2 = store(&server, scripts(None, "v2", None)).await;
    conformance::run_all(|| {
        let store = v2.clone();
        async move { store }
    })
    .await;
    assert_eq!(v2.scripts_version(), "v2");
    let (calls, errors) = counts(&v2, "v2");
    assert!(
        calls > 0 && errors == 0,
        "v2: {calls} calls, {errors} errors"
    );

    // Half the records on v1, half on v2, records of both read by both: still conformant.
    let mixed = store(
        &server,
        scripts(None, "v1", Some(canary("v2", 50, 20, 0.05))),
    )
    .await;
    conformance::run_all(|| {
        let store = mixed.clone();
        async move { store }
    })
    .await;
    let (v1_calls, v1_errors) = counts(&mixed, "v1");
    let (v2_calls, v2_errors) = counts(&mixed, "v2");
    assert!(v1_calls > 20 && v2_calls > 20, "{v1_calls} / {v2_calls}");
    assert_eq!((v1_errors, v2_errors), (0, 0));
    assert_eq!(mixed.canary_percent(), 50);
    assert_eq!(mixed.canary_rollbacks(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_canary_call_is_answered_by_the_active_version_then_rolled_back() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    // A claim that fails after writing, and a completion that fails before writing.
    script_dir(root.path(), "vbad", "v2", |name, text| {
        let text = claim_failing_after_its_writes(name, text);
        let anchor = "local key = KEYS[1]";
        insert_before("complete", anchor, "redis.call('NOPE')", name, text)
    });
    // Every record on the canary, and no rollback yet.
    let first = scripts(
        Some(root.path()),
        "v1",
        Some(canary("vbad", 100, 1000, 0.05)),
    );
    let store = store(&server, first).await;
    for _ in 0..10 {
        let key = fresh_key();
        let req = claim_request(&key);
        assert_eq!(
            store.claim(&req).await.expect("claim"),
            ClaimOutcome::Acquired {
                execution_id: req.execution_id,
                lapsed: false,
            },
            "the retried claim keeps what the canary wrote"
        );
        assert_eq!(
            store
                .complete(&key, req.owner, response(), 60 * SECOND)
                .await
                .expect("complete"),
            WriteOutcome::Applied
        );
        let record = store.get(&key).await.expect("get").expect("record");
        assert_eq!(record.execution_id, req.execution_id);
        assert!(matches!(record.state, RecordState::Completed(_)));
        // The canary stamped the claim before failing; the active version completed it.
        let redis_key = store.record_key(&key);
        assert_eq!(hget(&server, &redis_key, "v").as_deref(), Some("v2"));
        assert_eq!(hget(&server, &redis_key, "s").as_deref(), Some("c"));
    }
    // Claims and completions failed on the canary and ran again on v1; reads did not fail.
    assert_eq!(counts(&store, "vbad"), (30, 20));
    assert_eq!(counts(&store, "v1"), (20, 0));
    assert_eq!(store.canary_rollbacks(), 0, "min_calls not reached");

    // The same canary with a threshold it crosses: rolled back after min_calls.
    let strict = scripts(Some(root.path()), "v1", Some(canary("vbad", 100, 4, 0.25)));
    assert!(matches!(
        store.apply_scripts(&strict).await,
        Ok(ScriptsApplied::Applied { .. })
    ));
    for _ in 0..10 {
        let key = fresh_key();
        let outcome = store.claim(&claim_request(&key)).await.expect("claim");
        assert!(matches!(outcome, ClaimOutcome::Acquired { .. }));
    }
    assert_eq!(store.canary_rollbacks(), 1);
    assert_eq!(store.canary_percent(), 0);
    let (bad_calls, _) = counts(&store, "vbad");
    assert_eq!(bad_calls, 34, "four canary calls, then none");
    let status = store.scripts_status();
    let canary = status.canary.expect("canary status");
    assert!(canary.rolled_back, "{canary:?}");
    assert_eq!((canary.window_calls, canary.window_errors), (4, 4));
    // An unrelated re-apply of the same settings does not re-arm it.
    assert_eq!(
        store.apply_scripts(&strict).await.unwrap(),
        ScriptsApplied::Unchanged
    );
    assert_eq!(store.canary_percent(), 0);
}

#[tokio::test]
async fn the_polls_of_a_wait_count_once_in_the_canary_window() {
    let server = RedisServer::start();
    // Every record on the canary; no rollback in this test.
    let store = store(
        &server,
        scripts(None, "v1", Some(canary("v2", 100, 1000, 0.05))),
    )
    .await;
    let key = fresh_key();
    store.claim(&claim_request(&key)).await.expect("claim");
    assert_eq!(window(&store), (1, 0));
    let (calls_before, _) = counts(&store, "v2");
    // A duplicate waits on the record in flight: it reads it again and again.
    let record = store
        .wait_for_change(&key, Duration::from_millis(400))
        .await
        .expect("wait")
        .expect("record");
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    let (calls_after, _) = counts(&store, "v2");
    // Four reads in the first 75 ms on an idle machine; more than one shows the polling.
    assert!(
        calls_after - calls_before >= 2,
        "the wait polled: {calls_after}"
    );
    // One waiter is one call in the window, however often it polled: its repeats must not
    // dilute the error rate of the claims and completions the canary is judged by.
    assert_eq!(window(&store), (2, 0));
}

#[tokio::test]
async fn a_wait_counts_in_the_window_of_a_canary_reloaded_under_it() {
    let server = RedisServer::start();
    let store = store(
        &server,
        scripts(None, "v1", Some(canary("v2", 100, 1000, 0.05))),
    )
    .await;
    let key = fresh_key();
    store.claim(&claim_request(&key)).await.expect("claim");
    let waiting = tokio::spawn({
        let (store, key) = (store.clone(), key.clone());
        async move {
            store
                .wait_for_change(&key, Duration::from_millis(600))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Other canary settings: a new canary, with a new (empty) window.
    let reloaded = scripts(None, "v1", Some(canary("v2", 100, 999, 0.05)));
    store.apply_scripts(&reloaded).await.expect("reload");
    assert_eq!(window(&store), (0, 0));
    let record = waiting.await.unwrap().expect("wait").expect("record");
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    // The polls after the reload are the new canary's: the wait is one call in its window.
    assert_eq!(window(&store), (1, 0));
}

#[tokio::test]
async fn a_wait_whose_polls_all_fail_on_the_canary_counts_one_error() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    // A read that fails on every record in flight, and only there.
    script_dir(root.path(), "vbusy", "v2", |name, text| {
        // v2 asks the clock only for records in flight.
        let line = "if s == 'i' then return redis.error_reply('ERR canary fault') end";
        insert_before("get", "local time = redis.call('TIME')", line, name, text)
    });
    let store = store(
        &server,
        scripts(
            Some(root.path()),
            "v1",
            Some(canary("vbusy", 100, 1000, 0.05)),
        ),
    )
    .await;
    let key = fresh_key();
    store.claim(&claim_request(&key)).await.expect("claim");
    let (calls_before, _) = counts(&store, "vbusy");
    let record = store
        .wait_for_change(&key, Duration::from_millis(400))
        .await
        .expect("every poll answered by the active version")
        .expect("record");
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    let (calls_after, errors) = counts(&store, "vbusy");
    assert!(calls_after - calls_before >= 2, "the wait polled");
    assert_eq!(errors, calls_after - calls_before, "every poll failed");
    // The claim, and the wait as one failing call: not one error per poll.
    assert_eq!(window(&store), (2, 1));
}

#[tokio::test]
async fn a_canary_failing_with_any_server_error_is_answered_by_the_active_version() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    // A read that calls a string command on the record's hash: WRONGTYPE, not ERR.
    script_dir(root.path(), "vwt", "v2", |name, text| {
        let anchor = "local f, x, s, l, p = unpack(";
        insert_before("get", anchor, "redis.call('GET', KEYS[1])", name, text)
    });
    let store = store(
        &server,
        scripts(Some(root.path()), "v1", Some(canary("vwt", 100, 4, 0.25))),
    )
    .await;
    let key = fresh_key();
    let req = claim_request(&key);
    store.claim(&req).await.expect("claim");
    let done = store.complete(&key, req.owner, response(), 60 * SECOND);
    assert_eq!(done.await.expect("complete"), WriteOutcome::Applied);
    for _ in 0..10 {
        let record = store
            .get(&key)
            .await
            .expect("no client sees the canary's error");
        assert!(matches!(
            record.map(|r| r.state),
            Some(RecordState::Completed(_))
        ));
    }
    assert_eq!(store.canary_rollbacks(), 1, "the canary alone failed");
}

#[tokio::test]
async fn a_record_no_version_can_read_does_not_roll_a_canary_back() {
    let server = RedisServer::start();
    let store = store(
        &server,
        scripts(None, "v1", Some(canary("v2", 100, 5, 0.05))),
    )
    .await;
    let key = fresh_key();
    let redis_key = store.record_key(&key);
    // Completed, with a payload in an encoding this build does not know.
    let fingerprint = String::from_utf8_lossy(&[5; 32]).into_owned();
    let _: i64 = server.cmd(&[
        "HSET",
        &redis_key,
        "f",
        &fingerprint,
        "x",
        "7",
        "s",
        "c",
        "p",
        "\u{2}future",
    ]);
    for _ in 0..8 {
        let read = store.get(&key).await;
        assert!(matches!(read, Err(StoreError::Corrupt(_))), "{read:?}");
    }
    assert_eq!(
        store.canary_rollbacks(),
        0,
        "both versions failed: the data's fault"
    );
    assert_eq!(store.canary_percent(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_text_runs_under_its_new_sha_and_refused_text_keeps_the_old() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    let dir = script_dir(root.path(), "v2", "v2", |_, text| text);
    let settings = scripts(Some(root.path()), "v2", None);
    let store = store(&server, settings.clone()).await;
    let original = store.scripts_status().active.scripts["claim"].clone();
    assert_eq!(
        store.apply_scripts(&settings).await.unwrap(),
        ScriptsApplied::Unchanged
    );

    // An edit: loaded, its SHA is the one in force, and it is what runs.
    let edited = repo_lua("v2", "claim").replace(V2_STAMP, "local VERSION = 'v2-edited'");
    std::fs::write(dir.join("claim.lua"), &edited).unwrap();
    let applied = store.apply_scripts(&settings).await.expect("apply");
    assert!(
        matches!(&applied, ScriptsApplied::Applied { loaded } if loaded.len() == 4),
        "{applied:?}"
    );
    let sha: String = server.cmd(&["SCRIPT", "LOAD", &edited]);
    assert_ne!(sha, original);
    assert_eq!(store.scripts_status().active.scripts["claim"], sha);
    let key = RecordKey {
        tenant: "t".into(),
        hash: rand::random(),
    };
    store.claim(&claim_request(&key)).await.expect("claim");
    assert_eq!(
        hget(&server, &store.record_key(&key), "v").as_deref(),
        Some("v2-edited")
    );

    // A syntax error: refused once, counted once, the edited SHA stays and still runs.
    std::fs::write(dir.join("claim.lua"), "return {").unwrap();
    let err = store.apply_scripts(&settings).await.expect_err("refused");
    assert!(
        matches!(&err, ScriptsError::Refused { file, .. } if file.ends_with("v2/claim.lua")),
        "{err}"
    );
    assert!(err.to_string().contains("Error compiling script"), "{err}");
    assert_eq!(
        store.apply_scripts(&settings).await.unwrap(),
        ScriptsApplied::StillRefused
    );
    let status = store.scripts_status();
    assert_eq!(status.active.scripts["claim"], sha);
    assert_eq!(status.reload_failures, 1);
    assert!(status.last_reload_error.unwrap().contains("claim.lua"));
    // The directory listing shows the text on disk, which differs from what runs.
    assert_ne!(
        status.versions["v2"].scripts.as_ref().unwrap()["claim"],
        sha
    );
    let other = RecordKey {
        tenant: "t".into(),
        hash: rand::random(),
    };
    store.claim(&claim_request(&other)).await.expect("claim");
    assert_eq!(
        hget(&server, &store.record_key(&other), "v").as_deref(),
        Some("v2-edited")
    );

    // A missing file is refused the same way.
    std::fs::remove_file(dir.join("get.lua")).unwrap();
    let err = store
        .apply_scripts(&settings)
        .await
        .expect_err("unreadable");
    assert!(matches!(err, ScriptsError::Sources(_)), "{err}");
    assert_eq!(store.script_reload_failures(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_redis_refuses_at_start_up_is_disabled_until_its_text_is_fixed() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    let dir = script_dir(root.path(), "v3", "v2", |name, text| {
        if name == "get" {
            "return {".to_owned()
        } else {
            text
        }
    });
    let settings = scripts(Some(root.path()), "v1", Some(canary("v3", 100, 20, 0.05)));
    let store = store(&server, settings.clone()).await;
    let status = store.scripts_status();
    let canary_status = status.canary.expect("canary");
    assert!(canary_status.rolled_back);
    assert!(
        canary_status.reason.unwrap().contains("failed to load"),
        "{:?}",
        status.last_reload_error
    );
    assert_eq!((status.reload_failures, store.canary_percent()), (1, 0));
    // Records use the active version meanwhile.
    let key = RecordKey {
        tenant: "t".into(),
        hash: rand::random(),
    };
    store.claim(&claim_request(&key)).await.expect("claim");
    assert_eq!(counts(&store, "v3").0, 0);
    assert_eq!(
        store.apply_scripts(&settings).await.unwrap(),
        ScriptsApplied::Unchanged
    );

    // A change to the active version goes live beside it: the canary, off, is not loaded
    // again, and its refused text does not hold the change back.
    let other_active = scripts(Some(root.path()), "v2", Some(canary("v3", 100, 20, 0.05)));
    assert!(
        matches!(
            store.apply_scripts(&other_active).await,
            Ok(ScriptsApplied::Applied { .. })
        ),
        "{:?}",
        store.scripts_status().last_reload_error
    );
    assert_eq!(store.scripts_version(), "v2");
    assert_eq!(store.canary_percent(), 0);

    // Other settings do not smuggle the refused text in without loading it.
    let half = scripts(Some(root.path()), "v1", Some(canary("v3", 50, 20, 0.05)));
    assert!(matches!(
        store.apply_scripts(&half).await,
        Err(ScriptsError::Refused { .. })
    ));
    assert_eq!(store.canary_percent(), 0);

    // Fixed text is loaded and the canary is in force.
    std::fs::write(dir.join("get.lua"), repo_lua("v2", "get")).unwrap();
    assert!(matches!(
        store.apply_scripts(&half).await,
        Ok(ScriptsApplied::Applied { .. })
    ));
    assert_eq!(store.canary_percent(), 50);
    assert!(!store.scripts_status().canary.unwrap().rolled_back);
}

// === numbers the scripts give Redis ===

const HOUR: Duration = Duration::from_secs(3600);

/// Put before a script's text: every `redis.call`/`redis.pcall` in it then fails on an
/// argument that is a Lua number.
///
/// Redis 7.2.0-7.2.4 turn a Lua number argument into text with fpconv_dtoa, which writes
/// 900000000 as "9e+08" (redis/redis#13113), so PEXPIRE fails after the script has written.
/// The Redis these tests run (7.0) writes it as "900000000", so the bug itself never shows
/// here; and a grep over the script sources would miss a number that reaches a call through a
/// variable. This makes the scripts' own rule (every argument a string) checkable at run time
/// on any Redis: a `local redis` shadows the global for the rest of the chunk, and wraps its
/// `call`/`pcall` with a check of every argument's Lua type. It is stricter than the bug (any
/// number fails, not only those with eight trailing zeros), so it does not depend on which
/// values a test happens to pick.
const STRICT_PROLOGUE: &str = "\
local redis = (function(real)
  local function strict(call)
    return function(...)
      for i = 1, select('#', ...) do
        if type((select(i, ...))) == 'number' then
          error('argument ' .. i .. ' of ' .. tostring((...)) .. ' is a Lua number', 2)
        end
      end
      return call(...)
    end
  end
  return setmetatable({call = strict(real.call), pcall = strict(real.pcall)}, {__index = real})
end)(redis)
";

fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.cmd(&["PTTL", key])
}

/// The server's clock in milliseconds (what the scripts judge locks by).
fn server_now_ms(server: &RedisServer) -> i64 {
    let time: Vec<String> = server.cmd(&["TIME"]);
    time[0].parse::<i64>().unwrap() * 1000 + time[1].parse::<i64>().unwrap() / 1000
}

/// Asserts that `key` lives `ms` from about now (a little less: time passed since it was set).
fn assert_lives(server: &RedisServer, key: &str, ms: u64, what: &str) {
    let left = pttl(server, key);
    let ms = ms as i64;
    assert!(
        left <= ms && left > ms - 10_000,
        "{what}: PTTL {left}, expected about {ms}"
    );
}

/// Asserts that the record's lock deadline (field `l`) is a plain decimal about `lock` from now.
fn assert_lock_deadline(server: &RedisServer, key: &str, lock: Duration, what: &str) {
    let l = hget(server, key, "l").expect("lock deadline");
    assert!(
        !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()),
        "{what}: lock deadline {l:?} is not a decimal integer"
    );
    let ahead = l.parse::<i64>().unwrap() - server_now_ms(server);
    let lock = lock.as_millis() as i64;
    assert!(
        ahead <= lock && ahead > lock - 10_000,
        "{what}: lock deadline {ahead} ms ahead, expected about {lock}"
    );
}

/// Claims, renews, completes and releases records whose ttls in milliseconds end in eight or
/// more zeros (250h, 1000h, 125d, 100000s), checking each record's life, state and lock
/// deadline in Redis after every step.
async fn trailing_zero_ttls_round_trip(server: &RedisServer, store: &RedisStore, version: &str) {
    // Claimed (lock 100000s, ttl 250h), renewed by its owner, completed to live 1000h.
    let key = fresh_key();
    let name = store.record_key(&key);
    let req = ClaimRequest {
        lock_ttl: Duration::from_secs(100_000),
        ttl: 250 * HOUR,
        ..claim_request(&key)
    };
    for step in ["claim", "renewal"] {
        let what = format!("{version} {step}");
        assert_claimed(server, store, &req, req.execution_id, 900_000_000, &what).await;
    }
    let done = store
        .complete(&key, req.owner, response(), 1000 * HOUR)
        .await;
    assert_eq!(done.expect("complete"), WriteOutcome::Applied, "{version}");
    assert_eq!(hget(server, &name, "s").as_deref(), Some("c"), "{version}");
    assert_lives(server, &name, 3_600_000_000, &format!("{version} complete"));
    let record = store.get(&key).await.expect("get").expect("record");
    assert!(matches!(record.state, RecordState::Completed(_)));
    let life = record.expires_in.expect("a completed record's life");
    assert!(
        life > 1000 * HOUR - 10 * SECOND && life <= 1000 * HOUR,
        "{life:?}"
    );

    // A lock longer than the record's ttl (1000h against 100000s): the record lives as long as
    // the lock. Released, then claimed again for 125d: the record's life grows to the lock's.
    let key = fresh_key();
    let name = store.record_key(&key);
    let req = ClaimRequest {
        lock_ttl: 1000 * HOUR,
        ttl: Duration::from_secs(100_000),
        ..claim_request(&key)
    };
    let what = format!("{version} long lock");
    store
        .claim(&req)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_lives(server, &name, 3_600_000_000, &what);
    assert_lock_deadline(server, &name, req.lock_ttl, &what);
    let released = store.release(&key, req.owner).await.expect("release");
    assert_eq!(released, WriteOutcome::Applied, "{version}");
    assert_eq!(hget(server, &name, "s").as_deref(), Some("r"), "{version}");
    assert_lives(server, &name, 3_600_000_000, &format!("{version} release"));
    let again = ClaimRequest {
        owner: OwnerToken::random(),
        execution_id: req.execution_id + 1,
        lock_ttl: 125 * 24 * HOUR,
        ttl: 250 * HOUR,
        ..req.clone()
    };
    let what = format!("{version} re-claim");
    assert_claimed(
        server,
        store,
        &again,
        req.execution_id,
        10_800_000_000,
        &what,
    )
    .await;
}

/// Claims `req` and checks it was acquired with `execution_id`, the record in flight, living
/// `life_ms` and locked for `req.lock_ttl`.
async fn assert_claimed(
    server: &RedisServer,
    store: &RedisStore,
    req: &ClaimRequest,
    execution_id: u64,
    life_ms: u64,
    what: &str,
) {
    let name = store.record_key(&req.key);
    let outcome = store
        .claim(req)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        matches!(outcome, ClaimOutcome::Acquired { execution_id: got, .. } if got == execution_id),
        "{what}: {outcome:?}"
    );
    assert_eq!(hget(server, &name, "s").as_deref(), Some("i"), "{what}");
    assert_lives(server, &name, life_ms, what);
    assert_lock_deadline(server, &name, req.lock_ttl, what);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttls_ending_in_many_zeros_claim_complete_and_release_on_both_versions() {
    let server = RedisServer::start();
    for version in ["v1", "v2"] {
        let store = store(&server, scripts(None, version, None)).await;
        trailing_zero_ttls_round_trip(&server, &store, version).await;
        assert_eq!(counts(&store, version).1, 0, "{version} script errors");
    }
}

/// Fails on any Redis (7.0 here too) if a script gives `redis.call` a Lua number anywhere the
/// conformance suite or the trailing-zero round trip drives it: each built-in version runs
/// with [`STRICT_PROLOGUE`] in front of every script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_script_gives_redis_a_lua_number() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    let strict = |_: &str, text: String| format!("{STRICT_PROLOGUE}{text}");
    for version in ["v1", "v2"] {
        let name = format!("{version}-strict");
        script_dir(root.path(), &name, version, strict);
        let store = store(&server, scripts(Some(root.path()), &name, None)).await;
        trailing_zero_ttls_round_trip(&server, &store, &name).await;
        conformance::run_all(|| {
            let store = store.clone();
            async move { store }
        })
        .await;
        assert_eq!(counts(&store, &name).1, 0, "{name} script errors");
    }

    // The check itself: a claim that hands the record's life to PEXPIRE as a number, as the
    // scripts did before, fails under it on this Redis, with a life of 60 s as with 250h.
    script_dir(root.path(), "v2-number", "v2", |name, text| {
        let text = strict(name, text);
        if name != "claim" {
            return text;
        }
        let edited = text.replace(
            "redis.call('PEXPIRE', key, life)",
            "redis.call('PEXPIRE', key, life_ms)",
        );
        assert_ne!(edited, text, "the claim script changed shape");
        edited
    });
    let store = store(&server, scripts(Some(root.path()), "v2-number", None)).await;
    let err = store
        .claim(&claim_request(&fresh_key()))
        .await
        .expect_err("a Lua number reached PEXPIRE unnoticed");
    assert!(
        err.to_string()
            .contains("argument 3 of PEXPIRE is a Lua number"),
        "{err}"
    );
}

// === through the proxy ===

/// A proxy on `redis` with `scripts` as its `store.redis.scripts` block (flow style) and no
/// local cache, so every request reaches a script.
async fn proxy(backend: &Backend, redis: &RedisServer, scripts_block: &str) -> Proxy {
    ProxyBuilder::new(backend)
        .redis(&[redis.url()])
        .store(&format!("  scripts: {scripts_block}"))
        .store("local_cache: {enabled: false}")
        .start()
        .await
}

/// Runs a keyed request on a fresh `key` and returns the version stamp (`v`) of the one record
/// it created: which script version wrote it.
async fn stamp_of(proxy: &Proxy, redis: &RedisServer, key: &str) -> Option<String> {
    let before = redis.keys();
    let response = Request::post("/orders").key(key).send(proxy.addr).await;
    assert_eq!(response.status, 201, "{}", response.text());
    let new: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|k| !before.contains(k))
        .collect();
    assert_eq!(new.len(), 1);
    hget(redis, &new[0], "v")
}

async fn admin_scripts(proxy: &Proxy) -> serde_json::Value {
    let response = Request::get("/admin/scripts").send(proxy.admin).await;
    assert_eq!(response.status, 200, "{}", response.text());
    serde_json::from_slice(&response.body).expect("json")
}

/// Waits until `check` holds for `/admin/scripts`; panics after 15 s (a script edit settles in
/// about 4 s at worst on an idle machine: two readings 2 s apart, the second at the next poll).
async fn admin_scripts_until(
    proxy: &Proxy,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let status = admin_scripts(proxy).await;
        if check(&status) {
            return status;
        }
        if Instant::now() > deadline {
            panic!("/admin/scripts never showed {what}:\n{status:#}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the canary takes a record, from the hex hash in its Redis key (the same rule as
/// the store: first four hash bytes, big-endian, mod 100, below the percentage).
fn takes_canary(redis_key: &str, percent: u32) -> bool {
    let hex = redis_key.rsplit(':').next().unwrap().trim_end_matches('}');
    u32::from_str_radix(&hex[..8], 16).unwrap() % 100 < percent
}

fn version_calls(status: &serde_json::Value, version: &str) -> u64 {
    status["versions"][version]["calls"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_canary_serves_both_versions_and_each_key_keeps_its_version() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = proxy(&backend, &redis, "{canary: {version: v2, percent: 50}}").await;
    const KEYS: usize = 40;
    for round in 0..2 {
        for i in 0..KEYS {
            let response = Request::post("/orders")
                .key(&format!("half-{i}"))
                .json(r#"{"n":1}"#)
                .send(proxy.addr)
                .await;
            let expected = if round == 0 { "MISS" } else { "HIT" };
            assert_eq!((response.status, response.result()), (201, Some(expected)));
        }
    }
    assert_eq!(backend.count(), KEYS);

    // Every record carries the version its hash picks: v2 stamps the records it writes.
    let keys = redis.keys();
    assert_eq!(keys.len(), KEYS);
    let on_canary = keys.iter().filter(|k| takes_canary(k, 50)).count();
    assert!(on_canary > 0 && on_canary < KEYS, "{on_canary} of {KEYS}");
    for key in &keys {
        let stamp = hget(&redis, key, "v");
        assert_eq!(stamp.is_some(), takes_canary(key, 50), "{key}: {stamp:?}");
    }
    // And every call for a key ran its version: claim, complete, and the replay's claim.
    let status = admin_scripts(&proxy).await;
    assert_eq!(
        version_calls(&status, "v2"),
        3 * on_canary as u64,
        "{status:#}"
    );
    assert_eq!(version_calls(&status, "v1"), 3 * (KEYS - on_canary) as u64);
    assert_eq!(status["canary"]["percent_in_force"], 50);
    assert_eq!(status["active"]["version"], "v1");
    assert_eq!(status["active"]["source"], "builtin");
    let metrics = proxy.metrics().await;
    for needle in [
        format!(
            "idemgate_script_calls_total{{version=\"v2\"}} {}",
            3 * on_canary
        ),
        format!(
            "idemgate_script_calls_total{{version=\"v1\"}} {}",
            3 * (KEYS - on_canary)
        ),
        "idemgate_script_errors_total{version=\"v2\"} 0".to_owned(),
        "idemgate_script_canary_percent 50".to_owned(),
        "idemgate_script_canary_rollbacks_total 0".to_owned(),
    ] {
        assert!(metrics.contains(&needle), "{needle}\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_canary_is_rolled_back_and_no_client_sees_an_error() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let root = tempfile::tempdir().unwrap();
    script_dir(root.path(), "v2", "v2", claim_failing_after_its_writes);
    let block = format!(
        "{{dir: \"{}\", canary: {{version: v2, percent: 50, min_calls: 5, max_error_rate: 0.2}}}}",
        root.path().display()
    );
    let proxy = proxy(&backend, &redis, &block).await;
    let status = admin_scripts(&proxy).await;
    assert_eq!(
        status["canary"]["source"],
        root.path().join("v2").display().to_string()
    );

    // 40 keys, 8 at a time: every one answered 2xx and executed once.
    const KEYS: usize = 40;
    for batch in 0..KEYS / 8 {
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let req = Request::post("/orders")
                    .key(&format!("broken-{}", batch * 8 + i))
                    .json(r#"{"n":2}"#);
                let addr = proxy.addr;
                tokio::spawn(async move { req.send(addr).await })
            })
            .collect();
        for task in tasks {
            let response = task.await.unwrap();
            assert_eq!(
                (response.status, response.result()),
                (201, Some("MISS")),
                "{}",
                response.text()
            );
        }
    }
    let mut ids: Vec<_> = backend
        .executions()
        .into_iter()
        .map(|e| e.execution_id.expect("execution id"))
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(
        (backend.count(), ids.len()),
        (KEYS, KEYS),
        "each key executed once"
    );
    for i in 0..KEYS {
        let replay = Request::post("/orders")
            .key(&format!("broken-{i}"))
            .json(r#"{"n":2}"#)
            .send(proxy.addr)
            .await;
        assert_eq!((replay.status, replay.result()), (201, Some("HIT")));
    }
    assert_eq!(backend.count(), KEYS);

    let status = admin_scripts(&proxy).await;
    assert_eq!(status["canary"]["rolled_back"], true, "{status:#}");
    assert_eq!(status["canary"]["percent_in_force"], 0);
    assert_eq!(status["canary_rollbacks"], 1);
    assert!(status["versions"]["v2"]["errors"].as_u64().unwrap() >= 5);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("idemgate_script_canary_rollbacks_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("idemgate_script_canary_percent 0"),
        "{metrics}"
    );
    let log = proxy.log();
    assert_eq!(
        log.matches("canary script version rolled back").count(),
        1,
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_file_edits_apply_without_restart_and_a_syntax_error_keeps_the_old_sha() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let root = tempfile::tempdir().unwrap();
    let dir = script_dir(root.path(), "v2", "v2", |_, text| text);
    let block = format!("{{dir: \"{}\", version: v2}}", root.path().display());
    let proxy = proxy(&backend, &redis, &block).await;
    let original: String = redis.cmd(&["SCRIPT", "LOAD", &repo_lua("v2", "claim")]);
    let status = admin_scripts(&proxy).await;
    assert_eq!(status["active"]["scripts"]["claim"], original.as_str());

    assert_eq!(
        stamp_of(&proxy, &redis, "edit-1").await.as_deref(),
        Some("v2")
    );

    // Edit in place (complete.lua too, as it stamps the record last): the new SHA is in
    // force within seconds, and it is what runs.
    let live = |name| repo_lua("v2", name).replace(V2_STAMP, "local VERSION = 'v2-live'");
    std::fs::write(dir.join("complete.lua"), live("complete")).unwrap();
    let edited = live("claim");
    std::fs::write(dir.join("claim.lua"), &edited).unwrap();
    let sha: String = redis.cmd(&["SCRIPT", "LOAD", &edited]);
    admin_scripts_until(&proxy, "the edited SHA", |s| {
        s["active"]["scripts"]["claim"] == sha.as_str()
    })
    .await;
    assert_eq!(
        stamp_of(&proxy, &redis, "edit-2").await.as_deref(),
        Some("v2-live")
    );

    // A syntax error: refused and counted; the edited SHA stays in force and keeps serving.
    std::fs::write(dir.join("claim.lua"), "return {").unwrap();
    proxy
        .metrics_containing("idemgate_script_reload_failures_total 1")
        .await;
    let status = admin_scripts(&proxy).await;
    assert_eq!(status["active"]["scripts"]["claim"], sha.as_str());
    assert!(
        status["last_reload_error"]
            .as_str()
            .unwrap()
            .contains("Error compiling script"),
        "{status:#}"
    );
    assert_eq!(
        stamp_of(&proxy, &redis, "edit-3").await.as_deref(),
        Some("v2-live")
    );
    proxy.log_containing("redis scripts refused").await;
    // Polls do not repeat the refusal.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(proxy
        .metrics()
        .await
        .contains("idemgate_script_reload_failures_total 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_edits_switch_versions_live_and_an_unknown_version_is_refused() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let mut proxy = proxy(&backend, &redis, "{version: v1}").await;
    assert!(admin_scripts(&proxy).await["canary"].is_null());

    // Every record to a v2 canary, by a config edit.
    proxy.edit_config(Edit::Rename, |yaml| {
        yaml.replace(
            "scripts: {version: v1}",
            "scripts: {version: v1, canary: {version: v2, percent: 100}}",
        )
    });
    admin_scripts_until(&proxy, "the v2 canary", |s| {
        s["canary"]["percent_in_force"] == 100
    })
    .await;
    let response = Request::post("/orders").key("cfg-1").send(proxy.addr).await;
    assert_eq!(response.status, 201);
    let keys = redis.keys();
    assert_eq!(hget(&redis, &keys[0], "v").as_deref(), Some("v2"));
    assert!(
        !proxy.log().contains("only take effect after a restart"),
        "scripts are applied live"
    );

    // A version that exists nowhere: the config edit is refused, the canary stays.
    proxy.edit_config(Edit::Rename, |yaml| {
        yaml.replace("version: v2", "version: v9")
    });
    proxy
        .metrics_containing("idemgate_config_reload_failures_total 1")
        .await;
    proxy
        .log_containing("store.redis.scripts.canary.version")
        .await;
    let status = admin_scripts(&proxy).await;
    assert_eq!(status["canary"]["version"], "v2");
    assert_eq!(status["canary"]["percent_in_force"], 100);
}

/// A version the config names while its files are still being copied (the config's reload was
/// refused and retried until the directory appeared, as the README suggests for a new version)
/// is put in force only once they are at rest, as a file edit is: caught half-copied, a
/// `complete.lua` that loads and answers nothing useful failed every completion until the next
/// readings.
#[tokio::test]
async fn a_version_the_config_names_while_its_files_are_copied_waits_for_them() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let root = tempfile::tempdir().unwrap();
    let block = format!("{{dir: \"{}\", version: v1}}", root.path().display());
    let mut proxy = proxy(&backend, &redis, &block).await;
    // v3 (v2's text) on its way in: complete.lua not there yet, in its place a script Redis
    // loads that stores nothing.
    let copying = |n: u32| format!("return 0 -- still copying ({n})");
    let dir = script_dir(root.path(), "v3", "v2", |name, text| {
        if name == "complete" {
            copying(0)
        } else {
            text
        }
    });
    proxy.edit_config(Edit::Rename, |yaml| {
        yaml.replace("version: v1}", "version: v3}")
    });
    proxy
        .metrics_containing("idemgate_config_reloads_total 1")
        .await;
    // The copy goes on for 3 s, its file changing all the while: nothing of v3 is in force.
    for n in 1..=10 {
        std::fs::write(dir.join("complete.lua"), copying(n)).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let status = admin_scripts(&proxy).await;
        assert_eq!(
            status["active"]["version"], "v1",
            "put in force while its files were copied ({n}):\n{status:#}"
        );
    }
    std::fs::write(dir.join("complete.lua"), repo_lua("v2", "complete")).unwrap();
    admin_scripts_until(&proxy, "v3 in force", |s| s["active"]["version"] == "v3").await;
    assert_eq!(
        stamp_of(&proxy, &redis, "after-the-copy").await.as_deref(),
        Some("v2")
    );
}

#[tokio::test]
async fn a_script_that_fails_is_refused_not_taken_for_an_outage_the_policy_forwards_through() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let root = tempfile::tempdir().unwrap();
    // v3: v1 whose claim compiles (SCRIPT LOAD takes it) and fails on every call.
    script_dir(root.path(), "v3", "v1", |name, text| {
        insert_before(
            "claim",
            "local key = KEYS[1]",
            "redis.call('NOPE')",
            name,
            text,
        )
    });
    for policy in ["pass", "local"] {
        let proxy = ProxyBuilder::new(&backend)
            .redis(&[redis.url()])
            .scripts(root.path(), "v3")
            .store(&format!("on_unavailable: {policy}"))
            .start()
            .await;
        let req = Request::post("/orders")
            .key(&format!("broken-{policy}"))
            .body("{}");
        for _ in 0..5 {
            let r = req.send(proxy.addr).await;
            assert_eq!(
                (r.status, r.result()),
                (503, Some("UNAVAILABLE")),
                "{policy}: {}",
                r.text()
            );
            assert_eq!(r.problem_type(), "store-record-unreadable", "{policy}");
        }
        assert_eq!(backend.count(), 0, "{policy}: nothing ran unprotected");
        let m = proxy.metrics().await;
        assert_eq!(
            common::metric(&m, "idemgate_store_circuit_opened_total"),
            Some(0.0),
            "{policy}: a failing script is no outage: {m}"
        );
        proxy.log_containing("the script failed").await;
    }
}

#[tokio::test]
async fn a_canary_completion_that_fails_after_its_write_is_finished_by_the_active_version() {
    let server = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    // A completion that fails after storing the payload, before dropping the claim's fields
    // and setting the record's life.
    script_dir(root.path(), "vhalf", "v2", |name, text| {
        let anchor = "redis.call('HDEL', key, 'o', 'l')\nredis.call('PEXPIRE'";
        insert_before("complete", anchor, "redis.call('NOPE')", name, text)
    });
    for active in ["v1", "v2"] {
        let store = store(
            &server,
            scripts(
                Some(root.path()),
                active,
                Some(canary("vhalf", 100, 1000, 0.05)),
            ),
        )
        .await;
        let key = fresh_key();
        let req = claim_request(&key);
        assert!(matches!(
            store.claim(&req).await.expect("claim"),
            ClaimOutcome::Acquired { .. }
        ));
        // Claimed to live 60 s; completed to live 5 s.
        assert_eq!(
            store
                .complete(&key, req.owner, response(), 5 * SECOND)
                .await
                .expect("complete"),
            WriteOutcome::Applied
        );
        let redis_key = store.record_key(&key);
        assert_eq!(
            hget(&server, &redis_key, "s").as_deref(),
            Some("c"),
            "{active}"
        );
        assert_eq!(
            hget(&server, &redis_key, "o"),
            None,
            "{active}: owner dropped"
        );
        assert_eq!(
            hget(&server, &redis_key, "l"),
            None,
            "{active}: lock dropped"
        );
        let left = pttl(&server, &redis_key);
        assert!(
            (1..=5000).contains(&left),
            "{active}: the record lives its completion ttl, not its claim's: {left} ms"
        );
        assert_eq!(counts(&store, "vhalf"), (2, 1), "{active}");
    }
}

/// A backend that cannot be reached was sent nothing, so the key is released and a retry may
/// run it at once. When the store does not take the release (here a release script that fails),
/// the answer says the key stays locked, and until when: a retry meanwhile gets 409, not a
/// run.
#[tokio::test]
async fn an_unreachable_backend_says_whether_the_key_was_released() {
    let redis = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    script_dir(root.path(), "vnorel", "v1", |name, text| {
        if name == "release" {
            "return redis.error_reply('release refused')\n".to_string()
        } else {
            text
        }
    });
    let closed = std::net::SocketAddr::from(([127, 0, 0, 1], RedisServer::unused_port()));
    let start = |version: &str| {
        ProxyBuilder::at(closed)
            .redis(&[redis.url()])
            .scripts(root.path(), version)
            .store("local_cache: {enabled: false}")
            .upstream("connect_timeout: 1s")
            .upstream("write_timeout: 1s")
            .upstream("read_timeout: 2s")
            .idem("lock_ttl: 5s")
            .start()
    };
    let order = |key: &str| Request::post("/orders").key(key).json(r#"{"sku":"A"}"#);

    let released = start("v1").await;
    for attempt in ["first", "retry"] {
        let resp = order("k1").send(released.addr).await;
        assert_eq!(resp.status, 502, "{attempt}: {}", resp.text());
        assert_eq!(resp.problem_type(), "upstream-unreachable", "{attempt}");
        assert_eq!(resp.header("retry-after"), None, "{attempt}");
        assert!(resp.text().contains("may be retried"), "{}", resp.text());
    }

    let locked = start("vnorel").await;
    let resp = order("k2").send(locked.addr).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.problem_type(), "upstream-unreachable");
    assert_eq!(resp.result(), Some("MISS"));
    assert!(resp.text().contains("stays locked"), "{}", resp.text());
    let secs: u64 = resp
        .header("retry-after")
        .expect("a Retry-After")
        .parse()
        .unwrap();
    assert!((1..=5).contains(&secs), "Retry-After {secs}");
    let retry = order("k2").send(locked.addr).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "request-in-flight");
}

/// A write id proves a write only beside the state it was written with. A record still in
/// flight under the caller that carries the caller's write id (a version that wrote the id
/// alone and then failed) is completed or released now, not answered "applied" and left in
/// flight with no owner for the next claim to run again; under another owner it is refused.
#[tokio::test]
async fn a_write_id_proves_a_write_only_beside_its_state() {
    let server = RedisServer::start();
    let far: String = (server_now_ms(&server) + 60_000).to_string();
    for version in ["v1", "v2"] {
        let complete = repo_lua(version, "complete");
        let release = repo_lua(version, "release");
        let key = format!("idemgate:{{t:{version}}}");
        let seed = |state: &str, owner: &str| {
            let _: i64 = server.cmd(&["DEL", &key]);
            let _: i64 = server.cmd(&[
                "HSET", &key, "f", "fp", "x", "7", "s", state, "o", owner, "l", &far, "w", "W1",
            ]);
            let _: i64 = server.cmd(&["PEXPIRE", &key, "60000"]);
        };
        let run = |script: &str, args: &[&str]| -> i64 {
            let mut cmd = vec!["EVAL", script, "1", &key];
            cmd.extend_from_slice(args);
            server.cmd(&cmd)
        };
        let field = |name: &str| hget(&server, &key, name);

        // Complete: in flight under the caller, its id already there: completed now.
        seed("i", "A");
        assert_eq!(
            run(&complete, &["A", "payload", "86400000", "W1"]),
            1,
            "{version}"
        );
        assert_eq!(field("s").as_deref(), Some("c"), "{version}");
        assert_eq!(field("p").as_deref(), Some("payload"), "{version}");
        assert_eq!(field("o"), None, "{version}");
        // Under another owner: refused, nothing changed.
        seed("i", "B");
        assert_eq!(
            run(&complete, &["A", "payload", "86400000", "W1"]),
            0,
            "{version}"
        );
        assert_eq!(
            (field("s").as_deref(), field("o").as_deref(), field("p")),
            (Some("i"), Some("B"), None),
            "{version}"
        );
        // Completed under this id, the owner's fields still there (a send that failed after
        // its HSET): applied, and finished.
        seed("c", "A");
        assert_eq!(
            run(&complete, &["A", "payload", "86400000", "W1"]),
            1,
            "{version}"
        );
        assert_eq!(field("o"), None, "{version}");
        assert!(
            pttl(&server, &key) > 60_000,
            "{version}: the completion's life"
        );

        // Release: in flight under the caller with its id: released now.
        seed("i", "A");
        assert_eq!(run(&release, &["A", "W1"]), 1, "{version}");
        assert_eq!(field("s").as_deref(), Some("r"), "{version}");
        assert_eq!(field("o"), None, "{version}");
        // Released before under this id, claimed since by another: applied, unchanged.
        seed("i", "B");
        assert_eq!(run(&release, &["A", "W1"]), 1, "{version}");
        assert_eq!(field("o").as_deref(), Some("B"), "{version}");
    }
}

/// The purge spares a record in flight, its lock running or lapsed, and removes a hash under a
/// record's name that is no record (no fingerprint), as a claim would take it for absent.
#[tokio::test]
async fn a_purge_spares_claims_lapsed_or_not_and_removes_what_is_no_record() {
    let server = RedisServer::start();
    let purge =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("lua/purge.lua"))
            .unwrap();
    let key = "idemgate:{t:purge}";
    let now = server_now_ms(&server);
    for (lock, spared) in [(now + 60_000, 30_000), (now - 1_000, 0)] {
        let _: i64 = server.cmd(&["DEL", key]);
        let lock = lock.to_string();
        let _: i64 = server.cmd(&[
            "HSET", key, "f", "fp", "x", "7", "s", "i", "o", "A", "l", &lock,
        ]);
        let reply: Vec<i64> = server.cmd(&["EVAL", &purge, "1", key]);
        assert!(reply.len() == 1 && reply[0] >= spared, "{reply:?}");
        if spared == 0 {
            assert_eq!(reply, [0], "a lapsed lock has none left");
        }
        assert_eq!(server.cmd::<i64>(&["EXISTS", key]), 1, "spared");
    }
    let _: i64 = server.cmd(&["DEL", key]);
    let _: i64 = server.cmd(&["HSET", key, "x", "7", "s", "i"]);
    assert_eq!(server.cmd::<i64>(&["EVAL", &purge, "1", key]), 1);
    assert_eq!(server.cmd::<i64>(&["EXISTS", key]), 0, "no record: removed");
}

/// A script directory mounted from a ConfigMap (each version a `..data/<version>/` directory
/// behind symlinks, updated by swapping `..data` in one rename) is reloaded like the config
/// file: the new text is in force within seconds, and it is what runs.
#[tokio::test]
async fn a_script_directory_updated_as_a_configmap_is_reloaded() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let root = tempfile::tempdir().unwrap();
    let publish = |stamp: &str, generation: &str| {
        let stamp = format!("local VERSION = '{stamp}'");
        let data = root.path().join(generation);
        script_dir(&data, "v2", "v2", |_, text| text.replace(V2_STAMP, &stamp));
        let tmp = root.path().join("..data_tmp");
        std::os::unix::fs::symlink(generation, &tmp).unwrap();
        std::fs::rename(&tmp, root.path().join("..data")).unwrap();
    };
    publish("v2", "..2026_12_01_a");
    std::os::unix::fs::symlink("..data/v2", root.path().join("v2")).unwrap();
    let block = format!("{{dir: \"{}\", version: v2}}", root.path().display());
    let proxy = proxy(&backend, &redis, &block).await;
    assert_eq!(
        stamp_of(&proxy, &redis, "cm-1").await.as_deref(),
        Some("v2")
    );

    publish("v2-cm", "..2026_12_01_b");
    // The kubelet then removes the old generation.
    std::fs::remove_dir_all(root.path().join("..2026_12_01_a")).unwrap();
    let claim = repo_lua("v2", "claim").replace(V2_STAMP, "local VERSION = 'v2-cm'");
    let sha: String = redis.cmd(&["SCRIPT", "LOAD", &claim]);
    admin_scripts_until(&proxy, "the swapped-in SHA", |s| {
        s["active"]["scripts"]["claim"] == sha.as_str()
    })
    .await;
    assert_eq!(
        stamp_of(&proxy, &redis, "cm-2").await.as_deref(),
        Some("v2-cm")
    );
}
