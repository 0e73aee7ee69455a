//! Redis failing under a running proxy: the outage policies, the circuit breaker, completions
//! that reach Redis late (retry queue, kept while the claim's lock holds) or never (dead-letter
//! file), lock fencing, and the local fast path.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;

use common::faultproxy::{Fault, FaultProxy};
use common::redis::{script_dir, RedisCluster, RedisServer};
use common::{Backend, Proxy, ProxyBuilder, Request};

/// The admin token of the proxies that need one.
const ADMIN_TOKEN: &str = "admin-token-for-outage-tests-0123";

fn builder(backend: &Backend, redis: &RedisServer) -> ProxyBuilder {
    builder_to(backend, redis.url())
}

/// A proxy on the Redis at `url` (a fault proxy's, say), with short Redis timeouts.
fn builder_to(backend: &Backend, url: String) -> ProxyBuilder {
    on_redis(ProxyBuilder::new(backend), &[url], "200ms")
}

/// `builder` on the Redis at `urls`: connects given up after 200 ms, calls after
/// `response_timeout`.
fn on_redis(builder: ProxyBuilder, urls: &[String], response_timeout: &str) -> ProxyBuilder {
    builder
        .redis(urls)
        .store("  connect_timeout: 200ms")
        .store(&format!("  response_timeout: {response_timeout}"))
}

/// Backend timeouts for the lock renewal tests (a connect or a write given up at once, the
/// answer awaited `read_timeout`), under a lock of `lock_ttl`.
fn with_a_lock(builder: ProxyBuilder, read_timeout: &str, lock_ttl: &str) -> ProxyBuilder {
    builder
        .upstream("connect_timeout: 200ms")
        .upstream("write_timeout: 300ms")
        .upstream(&format!("read_timeout: {read_timeout}"))
        .idem(&format!("lock_ttl: {lock_ttl}"))
}

/// Backend timeouts that fit a 2 s lock, and the lock.
fn with_a_2s_lock(builder: ProxyBuilder) -> ProxyBuilder {
    builder
        .upstream("connect_timeout: 200ms")
        .upstream("write_timeout: 500ms")
        .upstream("read_timeout: 1s")
        .idem("lock_ttl: 2s")
}

/// The value of metric `name` (with its labels, if any) in `text`; panics when it is not
/// exported at all, so an assertion that it is 0 cannot pass for a metric renamed or gone.
fn metric(text: &str, name: &str) -> f64 {
    common::metric(text, name).unwrap_or_else(|| panic!("{name} is not exported:\n{text}"))
}

/// A Cluster primary that stops answering opens the circuits of its own slots only: keys on
/// the other primaries go on being served, and its own are refused at once once their part's
/// circuit opened. With one circuit for the whole store, the first of its keys to fail (one
/// failure opens it here) had every key refused for `open_for`. Readiness pings a part that
/// answers. The Cluster serves the slots it still covers (`cluster-require-full-coverage no`;
/// with it, Redis itself refuses every key once the node is marked failed).
#[tokio::test]
async fn a_cluster_primary_that_stops_answering_opens_the_circuits_of_its_slots_only() {
    let cluster = RedisCluster::start_with(3, &["--cluster-require-full-coverage", "no"]);
    let backend = Backend::start().await;
    let proxy = on_redis(ProxyBuilder::new(&backend), &cluster.urls(), "200ms")
        .store("circuit_breaker: {failure_threshold: 1, open_for: 60s}")
        .store("local_cache: {enabled: false}")
        .start()
        .await;
    let warm = order(&proxy, "before").await;
    assert_eq!(warm.result(), Some("MISS"), "{}", warm.text());
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_store_circuit_parts"), 64.0, "{m}");

    let stopped = cluster.nodes[0].pid().expect("pid");
    signal(stopped, "STOP");
    let mut served = 0;
    let mut refused = 0;
    for n in 0..30 {
        let r = order(&proxy, &format!("while-one-is-down-{n}")).await;
        match r.status {
            201 => served += 1,
            503 => refused += 1,
            other => panic!("{other}: {}", r.text()),
        }
    }
    let m = proxy.metrics().await;
    let ready = Request::get("/readyz").send(proxy.admin).await;
    signal(stopped, "CONT");
    // About a third of the keys are the stopped primary's.
    assert!(
        served >= 10 && refused >= 1,
        "{served} served, {refused} refused\n{m}\n{}",
        proxy.log()
    );
    let open = metric(&m, "idemgate_store_circuit_open_parts");
    assert!((1.0..=24.0).contains(&open), "{open} parts open\n{m}");
    assert_eq!(metric(&m, "idemgate_store_circuit_state"), 1.0, "{m}");
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert_eq!(backend.count(), 1 + served, "only the served keys ran");
}

/// Sends SIGSTOP or SIGCONT to a process.
fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}

/// What [`load_through_an_outage`] saw: each answer with when it was sent (from the start)
/// and how long it took, and how many executed.
struct Load {
    seen: Vec<(Duration, Duration, common::Response)>,
    misses: usize,
}

/// One keyed request after another on fresh keys for 6 s, with `outage(true)` 500 ms in and
/// `outage(false)` 1.5 s later. Every answer is a `MISS` or a 503 `store-unavailable` with
/// `Retry-After`, none takes 2 s, every execution ran under a claim, some ran before the
/// outage, service resumed within 3 s of its end (the circuit's 1 s open period, a probe and a
/// reconnect, with room for a loaded machine), and the circuit opened.
async fn load_through_an_outage(
    proxy: &Proxy,
    backend: &Backend,
    mut outage: impl FnMut(bool),
) -> Load {
    let addr = proxy.addr;
    let started = Instant::now();
    let load = tokio::spawn(async move {
        let mut seen = Vec::new();
        let mut n = 0u32;
        while started.elapsed() < Duration::from_millis(6000) {
            let req = Request::post("/orders")
                .key(&format!("load-{n}"))
                .body("{}");
            let sent = Instant::now();
            let r = req.send(addr).await;
            seen.push((sent - started, sent.elapsed(), r));
            n += 1;
            // Paced: a loop of instant 503s would take both cores from the proxy it times.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    outage(true);
    let began = started.elapsed();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    outage(false);
    let ended = started.elapsed();
    let seen = load.await.unwrap();

    let mut misses = 0;
    for (_, latency, r) in &seen {
        match (r.status, r.result()) {
            (201, Some("MISS")) => misses += 1,
            (503, Some("UNAVAILABLE")) => {
                assert_eq!(r.problem_type(), "store-unavailable");
                assert!(r.header("retry-after").is_some(), "503 with Retry-After");
            }
            other => panic!("unexpected answer {other:?}: {}", r.text()),
        }
        // A claim or completion waits one response timeout (200 ms) per try, never the outage.
        assert!(
            *latency < Duration::from_secs(2),
            "a request hung for {latency:?}"
        );
    }
    assert_eq!(
        backend.count(),
        misses,
        "every execution was protected by a claim"
    );
    assert!(seen.iter().any(|s| s.0 < began && s.2.status == 201));
    let resumed = seen
        .iter()
        .find(|s| s.0 > ended && s.2.status == 201)
        .map(|s| s.0 - ended)
        .expect("service resumed");
    assert!(
        resumed < Duration::from_secs(3),
        "resumed after {resumed:?}"
    );
    let m = proxy.metrics().await;
    assert!(
        metric(&m, "idemgate_store_circuit_opened_total") >= 1.0,
        "{m}"
    );
    Load { seen, misses }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_redis_mid_load_never_forwards_unprotected_and_service_resumes() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = builder(&backend, &redis).start().await;
    let load = load_through_an_outage(&proxy, &backend, |down| {
        if down {
            redis.kill();
        } else {
            redis.restart();
        }
    })
    .await;
    let refused = load.seen.iter().filter(|s| s.2.status == 503).count();
    assert!(refused > 0, "the outage was seen");
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_store_circuit_state"), 0.0);
}

#[tokio::test]
async fn pass_and_local_policies_forward_marked_degraded() {
    let port = RedisServer::unused_port();
    let backend = Backend::start().await;
    let down = RedisServer::start_on(port);
    drop(down);
    let url = format!("redis://127.0.0.1:{port}");
    let pass = ProxyBuilder::new(&backend)
        .redis(std::slice::from_ref(&url))
        .store("  connect_timeout: 100ms")
        .store("on_unavailable: pass")
        .start()
        .await;
    let req = Request::post("/orders").key("p").body("{}");
    let r = req.send(pass.addr).await;
    assert_eq!((r.status, r.result()), (201, Some("DEGRADED")));
    assert_eq!(req.send(pass.addr).await.result(), Some("DEGRADED"));
    assert_eq!(backend.count(), 2, "pass forwards without protection");
    assert!(
        backend
            .executions()
            .iter()
            .all(|e| e.execution_id.is_none()),
        "no claim, no execution id: the backend's unique index must not see a made-up one"
    );
    assert_eq!(Request::get("/readyz").send(pass.admin).await.status, 200);
    // A third failure opens the circuit (three in a row, by default), and the gauge says so.
    req.send(pass.addr).await;
    let m = pass.metrics().await;
    let state = metric(&m, "idemgate_store_circuit_state");
    assert!(state == 1.0 || state == 2.0, "open (or probing): {state}");

    let local = ProxyBuilder::new(&backend)
        .redis(&[url])
        .store("  connect_timeout: 100ms")
        .store("on_unavailable: local")
        .start()
        .await;
    let req = Request::post("/orders").key("l").body("{}");
    let r = req.send(local.addr).await;
    assert_eq!((r.status, r.result()), (201, Some("DEGRADED")));
    // The in-process fallback still deduplicates on this replica.
    let again = req.send(local.addr).await;
    assert_eq!(again.result(), Some("HIT"));
    assert_eq!(again.body, r.body);
    assert_eq!(backend.count(), 4, "pass ran three, the fallback one");
    // The fallback's usage is exported (the shared store's is Redis's own business).
    let m = local.metrics().await;
    assert_eq!(metric(&m, "idemgate_fallback_store_records"), 1.0, "{m}");
    assert!(metric(&m, "idemgate_fallback_store_bytes") > 0.0, "{m}");
    assert!(
        metric(&m, "idemgate_fallback_store_capacity_bytes") > 0.0,
        "{m}"
    );
    assert!(!m.contains("idemgate_store_records "), "{m}");
    // Built under every policy (a reload may switch to local), empty under the others.
    let m = pass.metrics().await;
    assert_eq!(
        common::metric(&m, "idemgate_fallback_store_records"),
        Some(0.0),
        "{m}"
    );
    // The policy lets it serve: ready, so the pod stays in the Service through the outage.
    assert_eq!(Request::get("/readyz").send(local.admin).await.status, 200);
}

/// A release the store refuses because the record is gone (flushed while the backend ran) fenced
/// nothing: `idemgate_store_fenced_writes_total` counts only locks another request took over.
#[tokio::test]
async fn a_release_refused_for_a_record_gone_is_not_counted_as_fenced() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = builder(&backend, &redis).start().await;
    let req = Request::post("/orders/slow/2000/status/503")
        .key("gone-before-release")
        .body("{}");
    let first = req.spawn_send(proxy.addr);
    backend.until_count(1).await;
    let _: String = redis.cmd(&["FLUSHALL"]);
    assert!(redis.keys().is_empty(), "flushed while the backend ran");
    assert!(!first.is_finished(), "answered before the flush");
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{}", first.text());
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_store_fenced_writes_total"), 0.0, "{m}");
    // Released or gone, the key runs again.
    let again = req.send(proxy.addr).await;
    assert_eq!((again.status, again.result()), (503, Some("MISS")));
    assert_eq!(backend.count(), 2);
}

/// Each keyed request fails its claim while Redis is down: the warning is written once a
/// second, not once a request (30 requests, 30 lines before), and says how many were left out.
#[tokio::test]
async fn an_outage_warns_once_a_second_not_once_a_request() {
    let port = RedisServer::unused_port();
    let backend = Backend::start().await;
    let url = format!("redis://127.0.0.1:{port}");
    let pass = ProxyBuilder::new(&backend)
        .redis(std::slice::from_ref(&url))
        .store("  connect_timeout: 100ms")
        .store("on_unavailable: pass")
        .start()
        .await;
    let started = Instant::now();
    for i in 0..30 {
        let r = order(&pass, &format!("k{i}")).await;
        assert_eq!(r.result(), Some("DEGRADED"), "{}", r.text());
    }
    let took = started.elapsed();
    let log = pass.log_written().await;
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("record store failed on claim"))
        .collect();
    let most = 1 + took.as_secs() as usize + 1;
    assert!(
        !lines.is_empty() && lines.len() <= most,
        "{} lines in {took:?}:\n{log}",
        lines.len()
    );
    assert!(lines[0].contains("suppressed=0"), "{}", lines[0]);
    // The purge channel cannot subscribe either: said once, and by a gauge.
    let log = pass
        .log_containing("purge channel cannot be subscribed")
        .await;
    assert_eq!(
        log.matches("purge channel cannot be subscribed").count(),
        1,
        "{log}"
    );
    let m = pass.metrics().await;
    assert_eq!(metric(&m, "idemgate_purge_channel_subscribed"), 0.0, "{m}");
    assert_eq!(
        metric(&m, "idemgate_store_errors_total{op=\"claim\"}"),
        30.0,
        "{m}"
    );
}

/// `on_unavailable: pass` forwards unprotected when the store cannot say whether a key is free,
/// never when it already said the key is held: a waiter whose claim fails after its wait must
/// not run the key beside the original.
#[tokio::test]
async fn a_waiter_that_saw_the_key_in_flight_never_runs_it_unprotected() {
    // A claim that fails from its third call on a key: the original's claim, the waiter's
    // (which finds it in flight), then the waiter's after its wait. It fails as a server that
    // cannot serve does (`LOADING`: an outage, for which `pass` would forward), not with a
    // script error (refused whatever the policy).
    let failing_claim = "if redis.call('INCR', KEYS[1] .. ':calls') >= 3 then \
         return redis.error_reply('LOADING Redis is loading the dataset in memory') end";
    let (retry, _) = a_waiter_on_another_replica("claim", failing_claim, "300ms").await;
    assert_eq!(retry.result(), Some("UNAVAILABLE"));
}

/// Script versions under a new directory: `version`, which is v1 with `prelude` run first in
/// its `script`.
fn v1_with(version: &str, script: &str, prelude: &str) -> tempfile::TempDir {
    let scripts = tempfile::tempdir().expect("scripts dir");
    script_dir(scripts.path(), version, "v1", |name, text| {
        match name == script {
            true => format!("{prelude}\n{text}"),
            false => text,
        }
    });
    scripts
}

/// The original of a key on one replica, a retry waiting for it (`on_in_flight: wait`,
/// `wait_timeout`) on another, both under `on_unavailable: pass` and v1 with `prelude` first
/// in `script`. The retry's replica is not running the key itself, so only what its store
/// said of the key stops it: the retry is refused with 503 `store-unavailable`, and the key
/// runs once. Returns the retry's answer and its replica.
async fn a_waiter_on_another_replica(
    script: &str,
    prelude: &str,
    wait_timeout: &str,
) -> (common::Response, Proxy) {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let scripts = v1_with("vw", script, prelude);
    let replica = |worker: u16| {
        ProxyBuilder::new(&backend)
            .worker_id(worker)
            .redis(&[redis.url()])
            .scripts(scripts.path(), "vw")
            .store("on_unavailable: pass")
            .waiting(wait_timeout)
            .start()
    };
    let (one, other) = (replica(1).await, replica(2).await);
    let order = || Request::post("/orders/slow/1500").key("held").body("{}");
    let original = order().spawn_send(one.addr);
    backend.until_count(1).await;
    let retry = order().send(other.addr).await;
    assert_eq!(retry.status, 503, "{}", retry.text());
    assert_eq!(
        retry.problem_type(),
        "store-unavailable",
        "{}",
        retry.text()
    );
    let first = original.await.expect("original");
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(backend.count(), 1, "the key ran once");
    (retry, other)
}

/// A claim that keeps finding the record released under its own fingerprint (another claimer
/// winning each race for it) gives up after a few rounds with 409 and `Retry-After: 1`: it
/// never forwards without a claim, and never loops for ever.
#[tokio::test]
async fn a_claim_that_keeps_losing_the_race_for_a_released_record_is_refused_not_forwarded() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    // A claim that always answers the record released, as it would be if another claimer
    // took and released it between every two claims of this one.
    let scripts = v1_with(
        "vr",
        "claim",
        "if string.find(KEYS[1], '{default:', 1, true) then \
         return {0, ARGV[1], ARGV[3], 'r', 0, ''} end",
    );
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[redis.url()])
        .scripts(scripts.path(), "vr")
        .store("on_unavailable: pass")
        .start()
        .await;
    let before = redis.command_calls("evalsha");
    let r = Request::post("/orders")
        .key("raced")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.result(), Some("CONFLICT"));
    assert_eq!(r.problem_type(), "request-in-flight", "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(backend.count(), 0, "forwarded without a claim");
    // Nine claims, each finding the record released again, before it gave up.
    assert_eq!(redis.command_calls("evalsha") - before, 9);
}

/// Nor a waiter whose wait fails: the store said the key is held before it failed, so under
/// `pass` the waiter is refused (503), not forwarded beside the original.
#[tokio::test]
async fn a_waiter_whose_wait_fails_never_runs_the_key_unprotected() {
    // A get script (the wait's read) that fails on every record key as a server that cannot
    // serve does; the readiness probe's key still reads.
    let failing_get = "if string.find(KEYS[1], '{default:', 1, true) then \
         return redis.error_reply('LOADING Redis is loading the dataset in memory') end";
    let (_, other) = a_waiter_on_another_replica("get", failing_get, "5s").await;
    other
        .log_containing("record store failed while waiting")
        .await;
}

/// The first write of a completion never reaches Redis (the connection is reset under it, and
/// new ones too, until after the answer went out): only the retry queue can store it.
#[tokio::test]
async fn a_completion_redis_refused_arrives_through_the_retry_queue() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let a = builder_to(&backend, link.redis_url()).start().await;
    let b = builder(&backend, &redis).start().await;
    let req = Request::post("/orders/slow/1500")
        .key("late")
        .body("{\"n\":1}");
    let addr = a.addr;
    let first = req.spawn_send(addr);
    // Redis is cut off after the claim, before the backend answers: the completion write fails.
    backend.until_count(1).await;
    link.set(Fault::Reset);
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let records = redis.keys().into_iter().filter(|k| k.contains('{'));
    let states: Vec<Option<String>> = records.map(|k| redis.cmd(&["HGET", &k, "s"])).collect();
    assert_eq!(
        states,
        [Some("i".to_owned())],
        "claimed, nothing stored before the link is back"
    );
    link.set(Fault::Pass);
    // Another instance (no local copy) sees the record once a retry has stored it.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = req.send(b.addr).await;
        if r.result() == Some("HIT") {
            assert_eq!(r.body, first.body);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never stored: {} {:?}\n{}",
            r.status,
            r.result(),
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(backend.count(), 1);
    // The queue drains without a dead letter.
    a.metrics_containing("idemgate_completion_retry_recovered_total 1")
        .await;
    // Recovered and pending are two atomics read separately: a scrape may fall between the
    // retry's two updates, so wait for the queue to drain rather than reading both at once.
    let m = a
        .metrics_containing("idemgate_completion_retry_pending 0")
        .await;
    assert_eq!(metric(&m, "idemgate_completion_retry_recovered_total"), 1.0);
    assert_eq!(metric(&m, "idemgate_dead_letters_total"), 0.0);
}

#[tokio::test]
async fn a_completion_that_never_reaches_redis_goes_to_the_dead_letter_file() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    // Dead-lettered once the attempts are spent and the claim's lock (2 s) may have lapsed.
    let proxy = builder(&backend, &redis)
        .store(&format!(
            "completion_retry: {{ attempts: 2, base_delay: 20ms, max_delay: 40ms, dead_letter_path: \"{}\" }}",
            dead.display()
        ))
        .upstream("connect_timeout: 200ms")
        .upstream("write_timeout: 200ms")
        .upstream("read_timeout: 1s")
        .idem("lock_ttl: 2s")
        .start()
        .await;
    let addr = proxy.addr;
    let first = Request::post("/orders/gate/lost")
        .key("lost")
        .body("{}")
        .spawn_send(addr);
    backend.until_count(1).await;
    let pid = redis.pid().unwrap();
    signal(pid, "STOP");
    backend.open("lost");
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dead.exists() || std::fs::read_to_string(&dead).unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "no dead letter:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    signal(pid, "CONT");
    let line: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&dead)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(line["tenant"], "default");
    assert_eq!(line["response"]["status"], 201);
    assert_eq!(line["record"].as_str().map(str::len), Some(64));
    let id = &backend.executions()[0].execution_id;
    assert_eq!(line["execution_id"].as_str(), id.as_deref());
    assert!(
        !std::fs::read_to_string(&dead).unwrap().contains("lost\""),
        "no raw key"
    );
    // Counted once written: the writer thread counts after the line is in the file.
    proxy
        .metrics_containing("idemgate_dead_letters_total 1")
        .await;
    // The log line carries the whole ids too: what is left when the file went with its pod.
    let logged = proxy
        .log_containing("completion written to the dead-letter file")
        .await;
    let logged = logged
        .lines()
        .find(|l| l.contains("completion written to the dead-letter file"))
        .unwrap_or_default();
    for part in [
        format!("record_id={}", line["record"].as_str().unwrap_or("?")),
        format!("execution_id={}", id.as_deref().unwrap_or("?")),
        "tenant=default".to_string(),
        "status=201".to_string(),
    ] {
        assert!(logged.contains(&part), "{part} in {logged}");
    }
}

/// `POST /orders/slow/1200` under `key`: the backend answers 1.2 s after it reads it.
fn slow_order(key: &str) -> Request {
    Request::post("/orders/slow/1200").key(key).body("{}")
}

/// Sends [`slow_order`] of `key` to `proxy` and, once the backend runs it, sends `change` with
/// its record's Redis key after the command's name (the record is the only key in `redis`).
/// Returns the request's answer to come, and the record's Redis key.
async fn changed_while_running(
    proxy: &Proxy,
    backend: &Backend,
    redis: &RedisServer,
    key: &str,
    change: &[&str],
) -> (tokio::task::JoinHandle<common::Response>, String) {
    let (request, addr) = (slow_order(key), proxy.addr);
    let running = tokio::spawn(async move { request.send(addr).await });
    backend.until_count(1).await;
    let keys = redis.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let mut command = vec![change[0], keys[0].as_str()];
    command.extend_from_slice(&change[1..]);
    let _: i64 = redis.cmd(&command);
    (running, keys[0].clone())
}

/// A record lost while its request runs (a restart without persistence, a failover before the
/// replica had it) lets a retry create it anew and run the key again, under another execution
/// id. The first request's answer is refused, and said to be that (not a lapsed lock taken
/// over, which keeps the id): the log, the dead letter's reason, and the fenced-writes count
/// that pages.
#[tokio::test]
async fn a_record_lost_mid_request_and_created_again_is_told_from_a_takeover() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    let a = builder(&backend, &redis)
        .store(&format!(
            "completion_retry: {{ dead_letter_path: \"{}\" }}",
            dead.display()
        ))
        .start()
        .await;
    let b = builder(&backend, &redis).start().await;
    let (slow, _) = changed_while_running(&a, &backend, &redis, "lost", &["DEL"]).await;
    let second = slow_order("lost").send(b.addr).await;
    assert_eq!((second.status, second.result()), (201, Some("MISS")));
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    let ex = backend.executions();
    assert_eq!(ex.len(), 2);
    assert_ne!(
        ex[0].execution_id, ex[1].execution_id,
        "a new record, a new id"
    );
    let m = a.metrics_containing("idemgate_dead_letters_total 1").await;
    assert_eq!(metric(&m, "idemgate_store_fenced_writes_total"), 1.0, "{m}");
    let text = std::fs::read_to_string(&dead).unwrap();
    let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(line["reason"], "record lost, created again");
    let log = a.log_containing("a retry created it again").await;
    assert!(!log.contains("lock lapsed and was taken over"), "{log}");
}

/// The same loss, with the retry sent to the replica that still runs the key: the store would
/// let it run again beside the running execution. The replica claims the record again for the
/// running execution and tells the retry to wait (409): one execution, stored and replayed.
#[tokio::test]
async fn a_record_lost_mid_request_is_claimed_again_by_the_replica_running_it() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let a = builder(&backend, &redis).start().await;
    let order = || slow_order("lost-here");
    let (slow, _) = changed_while_running(&a, &backend, &redis, "lost-here", &["DEL"]).await;
    let retry = order().send(a.addr).await;
    assert_eq!(
        (retry.status, retry.result()),
        (409, Some("CONFLICT")),
        "{}",
        retry.text()
    );
    let first = slow.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    let replay = order().send(a.addr).await;
    assert_eq!(replay.result(), Some("HIT"), "{}", replay.text());
    assert_eq!(replay.body, first.body);
    // Stored in Redis: another replica replays it too.
    let b = builder(&backend, &redis).start().await;
    let elsewhere = order().send(b.addr).await;
    assert_eq!(elsewhere.result(), Some("HIT"), "{}", elsewhere.text());
    assert_eq!(elsewhere.body, first.body);
    assert_eq!(backend.count(), 1, "ran beside itself");
    a.log_containing("claimed again for the running execution")
        .await;
}

#[tokio::test]
async fn a_lapsed_owner_cannot_overwrite_the_record_of_the_next_one() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    let a = builder(&backend, &redis)
        .store(&format!(
            "completion_retry: {{ dead_letter_path: \"{}\" }}",
            dead.display()
        ))
        .env("IDEMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .start()
        .await;
    let b = builder(&backend, &redis).start().await;
    // The first holder's lock lapses (as after a failover that lost it): expire it in Redis.
    let (slow, record_key) =
        changed_while_running(&a, &backend, &redis, "fence", &["HSET", "l", "0"]).await;
    let second = slow_order("fence").send(b.addr).await;
    assert_eq!((second.status, second.result()), (201, Some("MISS")));
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    // Both executions carried the same id; the record holds the second one's response.
    let ex = backend.executions();
    assert_eq!(ex.len(), 2);
    assert_eq!(ex[0].execution_id, ex[1].execution_id);
    let replay = slow_order("fence");
    let c = builder(&backend, &redis).start().await;
    let r = replay.send(c.addr).await;
    assert_eq!(r.result(), Some("HIT"));
    assert_eq!(
        r.body, second.body,
        "the lapsed owner did not overwrite the newer record"
    );
    // The fenced answer, which its client has, is kept where an operator can reconcile it
    // (counted once the dead-letter writer has written it).
    let m = a.metrics_containing("idemgate_dead_letters_total 1").await;
    assert_eq!(metric(&m, "idemgate_store_fenced_writes_total"), 1.0, "{m}");
    assert_eq!(metric(&m, "idemgate_dead_letters_total"), 1.0, "{m}");
    let text = std::fs::read_to_string(&dead).unwrap();
    let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(line["reason"], "lock taken over");
    assert_eq!(line["store"], "redis");
    assert_eq!(line["key_prefix"], "idemgate");
    assert_eq!(
        line["in_store"], "no",
        "the store refused the write: the newer execution holds the key"
    );
    let body = base64::Engine::decode(
        &base64::engine::general_purpose::STANDARD,
        line["response"]["body_base64"].as_str().unwrap(),
    )
    .unwrap();
    assert_eq!(body, first.body);
    // Reconciling the line: the record it names, found by its id, holds the other execution.
    let path = format!(
        "/admin/record-ids/{}/{}?body=true",
        line["tenant"].as_str().unwrap(),
        line["record"].as_str().unwrap()
    );
    let held = || async {
        let held = Request::get(&path)
            .header("Authorization", format!("Bearer {ADMIN_TOKEN}"))
            .send(a.admin)
            .await;
        assert_eq!(held.status, 200, "{}", held.text());
        let held: serde_json::Value = serde_json::from_slice(&held.body).unwrap();
        let body = base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            held["body_base64"].as_str().unwrap(),
        )
        .unwrap();
        (held, body)
    };
    let (record, held_body) = held().await;
    assert_eq!(record["execution_id"], line["execution_id"]);
    assert_eq!(held_body, second.body);
    assert_ne!(held_body, body);
    // The body by record id needs the admin token: the id is no secret.
    assert_eq!(Request::get(&path).send(a.admin).await.status, 401);

    // `--reconcile` says the same of the line, and changes nothing.
    let reconcile = |apply: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
        cmd.arg("--config")
            .arg(&a.config_path)
            .arg("--reconcile")
            .arg(&dead);
        if apply {
            cmd.arg("--apply");
        }
        let out = cmd.output().expect("run idemgate --reconcile");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, report) = reconcile(true);
    assert_eq!(code, Some(1), "{report}");
    assert!(report.contains("line 1: default/"), "{report}");
    assert!(report.contains("another outcome"), "{report}");
    assert_eq!(
        held().await.1,
        second.body,
        "--apply left the other outcome alone"
    );
    // Had Redis lost the record (a failover), the line would be all that is left of both
    // answers: reconciling shows it missing, and --apply writes it back.
    let _: i64 = redis.cmd(&["DEL", &record_key]);
    let (code, report) = reconcile(false);
    assert_eq!(code, Some(1), "{report}");
    assert!(
        report.contains("missing: a retry would execute again"),
        "{report}"
    );
    // Told without --apply too: the key ran twice, restored or not.
    assert!(report.contains("1 executed again"), "{report}");
    assert!(redis.keys().is_empty(), "nothing written without --apply");
    let (code, report) = reconcile(true);
    // Still flagged: the key ran twice, whatever the store holds now.
    assert_eq!(code, Some(1), "{report}");
    assert!(report.contains("restored"), "{report}");
    assert!(report.contains("1 executed again"), "{report}");
    assert!(
        report.contains("check the backend for a double execution"),
        "{report}"
    );
    // A retry now replays the dead-lettered answer (A holds no copy of its own: its write was
    // refused), under the same execution id, instead of executing a third time.
    let r = replay.send(a.addr).await;
    assert_eq!((r.result(), &r.body), (Some("HIT"), &first.body));
    assert_eq!(backend.count(), 2);
    let (restored, restored_body) = held().await;
    assert_eq!(restored_body, first.body);
    assert_eq!(restored["execution_id"], line["execution_id"]);
    assert_eq!(restored["state"], "completed");
    // Run again, the record reads the same as the line; but this line's own write was refused
    // (its key was taken over), so that alone proves nothing and it is still flagged.
    let (code, report) = reconcile(true);
    assert_eq!(code, Some(1), "{report}");
    assert!(report.contains("stored, unconfirmed"), "{report}");
    assert!(
        report.contains("unless an earlier --apply restored it"),
        "{report}"
    );
}

#[tokio::test]
async fn a_retry_this_replica_completed_needs_no_redis_round_trip() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy: Proxy = builder(&backend, &redis).start().await;
    let req = Request::post("/orders").key("hot").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(first.result(), Some("MISS"));
    let before = redis.calls();
    for _ in 0..20 {
        assert_eq!(req.send(proxy.addr).await.result(), Some("HIT"));
    }
    // Only the INFO command itself was added.
    assert_eq!(redis.calls(), before + 1, "hits were answered locally");
    // Even with Redis gone, this replica replays what it completed.
    redis.kill();
    let r = req.send(proxy.addr).await;
    assert_eq!(r.result(), Some("HIT"));
    assert_eq!(r.body, first.body);
    let m = proxy.metrics().await;
    assert!(metric(&m, "idemgate_local_cache_hits_total") >= 21.0, "{m}");
    assert!(metric(&m, "idemgate_bloom_fill_ratio") > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_retry_attempts_but_not_the_lock_still_stores_the_completion() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    // Two quick attempts (about 60 ms in all) against a 6 s lock.
    let build = || {
        builder_to(&backend, link.redis_url())
            .store(&format!(
                "completion_retry: {{ attempts: 2, base_delay: 20ms, max_delay: 40ms, dead_letter_path: \"{}\" }}",
                dead.display()
            ))
            .upstream("write_timeout: 1s")
            .upstream("read_timeout: 2s")
            .idem("lock_ttl: 6s")
    };
    let a = build().start().await;
    let b = build().start().await;
    let req = Request::post("/orders/gate/outage")
        .key("outage")
        .body("{}");
    let first = req.spawn_send(a.addr);
    // Claimed, the backend is working: now every Redis connection breaks until further notice.
    backend.until_count(1).await;
    link.set(Fault::Reset);
    backend.open("outage");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    tokio::time::sleep(Duration::from_secs(2)).await;
    link.set(Fault::Pass);
    // The completion lands while the lock holds: the other instance replays it, and never
    // executes the key again, also once the lock's time has passed.
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let r = req.send(b.addr).await;
        assert_ne!(r.result(), Some("MISS"), "executed again: {}", a.log());
        if r.result() == Some("HIT") {
            assert_eq!(r.body, first.body);
            break;
        }
        assert!(Instant::now() < deadline, "never stored:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(backend.count(), 1);
    let m = a
        .metrics_containing("idemgate_completion_retry_recovered_total 1")
        .await;
    assert_eq!(metric(&m, "idemgate_dead_letters_total"), 0.0, "{m}");
    // The file exists from the start (idemgate opens it at start to find a path it cannot
    // write before it matters), empty.
    assert_eq!(std::fs::read_to_string(&dead).unwrap(), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_completion_that_lost_its_key_is_dead_lettered_not_taken_from_the_local_cache() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    // Retries go on for several seconds after the 2 s lock has lapsed.
    let a = with_a_2s_lock(builder_to(&backend, link.redis_url()).store(&format!(
        "completion_retry: {{ attempts: 100, base_delay: 20ms, max_delay: 100ms, dead_letter_path: \"{}\" }}",
        dead.display()
    )))
    .start()
    .await;
    let b = with_a_2s_lock(builder(&backend, &redis).worker_id(2))
        .start()
        .await;
    let req = Request::post("/orders/gate/taken").key("taken").body("{}");
    let first = req.spawn_send(a.addr);
    // Claimed; A's completion cannot reach Redis, so it waits in A's retry queue (and A's local
    // cache keeps the answer meanwhile).
    backend.until_count(1).await;
    link.set(Fault::Reset);
    backend.open("taken");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    // Past the lock, B takes the key over and completes it.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let second = req.send(b.addr).await;
    assert_eq!(
        (second.status, second.result()),
        (201, Some("MISS")),
        "{}",
        b.log()
    );
    assert_ne!(second.body, first.body);
    link.set(Fault::Pass);
    // A's retry is fenced: the store holds B's answer, so A's goes to the dead-letter file.
    let m = a.metrics_containing("idemgate_dead_letters_total 1").await;
    assert_eq!(
        metric(&m, "idemgate_completion_retry_recovered_total"),
        0.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "idemgate_completion_retry_fenced_total"),
        1.0,
        "{m}"
    );
    let text = std::fs::read_to_string(&dead).unwrap();
    assert!(text.contains("lock taken over"), "{text}");
    // And A replays what the store holds, like every other replica.
    let r = req.send(a.addr).await;
    assert_eq!(r.result(), Some("HIT"));
    assert_eq!(r.body, second.body);
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn a_record_the_proxy_cannot_read_is_refused_whatever_the_outage_policy() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    for policy in ["pass", "local"] {
        let proxy = builder(&backend, &redis)
            .store(&format!("on_unavailable: {policy}"))
            .store("local_cache: { enabled: false }")
            .start()
            .await;
        let req = Request::post("/orders").key(policy).body("{}");
        let first = req.send(proxy.addr).await;
        assert_eq!(first.result(), Some("MISS"));
        let executed = backend.count();
        // A payload this version cannot decode (a newer encoding, or damage).
        let keys = redis.keys();
        for key in &keys {
            let _: i64 = redis.cmd(&["HSET", key, "p", "\u{9}junk"]);
        }
        let again = req.send(proxy.addr).await;
        assert_eq!(again.status, 503, "{policy}: {}", again.text());
        assert_eq!(again.problem_type(), "store-record-unreadable");
        assert_eq!(again.result(), Some("UNAVAILABLE"));
        assert_eq!(backend.count(), executed, "{policy}: never executed again");
        let _: String = redis.cmd(&["FLUSHALL"]);
    }
}

#[tokio::test]
async fn an_unprotected_execution_that_fails_is_marked_degraded() {
    let port = RedisServer::unused_port();
    let url = format!("redis://127.0.0.1:{port}");
    // Nothing listens at the backend either (a reserved port outside the ephemeral range: one
    // the kernel handed out could be handed to another test's listener meanwhile).
    let backend_addr = SocketAddr::from(([127, 0, 0, 1], common::proxy::free_port()));
    let proxy = ProxyBuilder::at(backend_addr)
        .redis(&[url])
        .store("  connect_timeout: 100ms")
        .store("on_unavailable: pass")
        .upstream("connect_timeout: 200ms")
        .start()
        .await;
    let r = order(&proxy, "d").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.result(), Some("DEGRADED"));
}

/// A backend still sending `102 Processing` when an outage outlasts the lock: renewals go on
/// past the lock's deadline, and the first that reaches Redis again takes the lapsed lock back
/// before a retry can claim it, so the retry is told to wait instead of running the key beside
/// the first execution. The retry goes to another replica, which Redis alone can tell that the
/// key is held (the replica running it would say so itself). The failed renewals open the
/// running replica's circuit, for far longer than the test: renewals are sent all the same
/// (held back until a probe, they left a retry elsewhere `open_for` to take the key over).
#[tokio::test]
async fn renewals_go_on_past_the_lock_so_a_retry_after_the_outage_does_not_run_the_key_again() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = still_processing_for(10).await;
    // The lock (4 s) is renewed from 3 s on; this replica is cut off from Redis from 1.5 s to
    // 6 s, so every renewal before the lock's deadline fails.
    let replica = |worker: u16, url: String| {
        let on = on_redis(
            ProxyBuilder::at(backend.addr).worker_id(worker),
            &[url],
            "200ms",
        );
        with_a_lock(on, "2s", "4s")
            .store("circuit_breaker: {failure_threshold: 3, open_for: 60s}")
            .start()
    };
    let proxy = replica(1, link.redis_url()).await;
    let other = replica(2, redis.url()).await;
    let req = Request::post("/orders").key("past-the-lock").body("{}");
    let first = req.spawn_send(proxy.addr);
    until_forwarded(&backend).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    link.set(Fault::Reset);
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert_eq!(
        metric(&proxy.metrics().await, "idemgate_lock_renewals_total"),
        0.0,
        "no renewal landed before the lock's deadline"
    );
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "idemgate_store_circuit_opened_total"),
        1.0,
        "{m}"
    );
    assert_eq!(metric(&m, "idemgate_store_circuit_state"), 1.0, "{m}");
    link.set(Fault::Pass);
    // The renewal that gets through first takes the lapsed lock back. (A retry that reached
    // Redis before it would claim the lapsed key: renewing past the deadline narrows that
    // race to the renewal pause, it does not close it.)
    proxy
        .metrics_containing("idemgate_lock_renewals_total 1")
        .await;
    let retry = req.send(other.addr).await;
    assert_eq!(
        (retry.status, retry.result()),
        (409, Some("CONFLICT")),
        "{}\n{}",
        retry.text(),
        proxy.log()
    );
    assert_eq!(retry.problem_type(), "request-in-flight");
    // The store answered the renewal: the probe was due at once, not after open_for.
    let ready = Request::get("/readyz").send(proxy.admin).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_store_circuit_state"), 0.0, "{m}");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(backend.count(), 1, "the key ran once");
}

/// The backend's answer that comes while a lock renewal is out is relayed at once. Renewals
/// are sent through an open circuit, so one to a Redis that does not answer waits out its
/// deadline, and the answer, held back behind it, waited as long. Here Redis holds every
/// write (`CLIENT PAUSE ... WRITE`): another request's claim times out and opens the circuit,
/// the renewal goes out at three quarters of the 8 s lock (6 s) and waits, and the answer comes
/// at 7 s: the client has it then, not when the renewal gives up (8.5 s at the earliest); its
/// completion, refused by the open circuit, goes to the retry queue.
#[tokio::test]
async fn an_answer_that_comes_while_a_renewal_is_out_does_not_wait_for_it() {
    let redis = RedisServer::start();
    let backend = still_processing_for(7).await;
    let on = on_redis(ProxyBuilder::at(backend.addr), &[redis.url()], "2500ms");
    let proxy = with_a_lock(on, "2s", "8s")
        .store("circuit_breaker: {failure_threshold: 1, open_for: 60s}")
        .start()
        .await;
    let req = Request::post("/orders").key("renewal-out").body("{}");
    let first = req.spawn_send(proxy.addr);
    until_forwarded(&backend).await;
    // When the backend read it, which its 7 s script counts from.
    let sent = backend.first_read_at().expect("read");
    let _: String = redis.cmd(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    let other = order(&proxy, "opens-the-circuit").await;
    assert_eq!(other.status, 503, "{}", other.text());
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "idemgate_store_circuit_opened_total"),
        1.0,
        "{m}"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(6),
        "the circuit opened late"
    );
    let first = first.await.unwrap();
    let took = sent.elapsed();
    let _: String = redis.cmd(&["CLIENT", "UNPAUSE"]);
    assert_eq!(
        (first.status, first.result()),
        (201, Some("MISS")),
        "{}",
        first.text()
    );
    assert!(
        (Duration::from_millis(6500)..Duration::from_millis(8000)).contains(&took),
        "answered {took:?} after it was sent; the backend's answer came at 7 s\n{}",
        proxy.log()
    );
}

/// The body's renewal (and the settle after it) go out beside the body: with Redis taking no
/// write (`CLIENT PAUSE ... WRITE`), the renewal at three quarters of the 8 s lock (6 s) waits
/// until it is given up (7 s) and the settle until its 2 s call deadline (9 s), while the
/// backend goes on sending a chunk every 700 ms. Each chunk reaches the client as the next one
/// comes (the last bytes wait for the settle); with the store calls in the body's way, the
/// chunks sent from 5.6 s on reached the client only at about 9 s.
#[tokio::test]
async fn a_body_streaming_while_its_renewal_is_out_is_not_held_up() {
    use common::rawbackend::{RawBackend, Step};
    use tokio::io::AsyncReadExt;
    let redis = RedisServer::start();
    let mut script = vec![Step::Send(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n<c0>\r\n".to_vec(),
    )];
    for i in 1..=10 {
        script.push(Step::Pause(Duration::from_millis(700)));
        script.push(Step::Send(format!("4\r\n<c{}>\r\n", i % 10).into_bytes()));
    }
    script.push(Step::Pause(Duration::from_millis(300)));
    script.push(Step::Send(b"0\r\n\r\n".to_vec()));
    let backend = RawBackend::start(script).await;
    let on = on_redis(ProxyBuilder::at(backend.addr), &[redis.url()], "2s");
    let proxy = with_a_lock(on, "2s", "8s").start().await;

    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let req = Request::post("/orders").key("body-renewal-out").body("{}");
    client.write_all(&req.to_bytes()).await.unwrap();
    until_forwarded(&backend).await;
    // When the backend read it, which its script counts from.
    let sent = backend.first_read_at().expect("read");
    let _: String = redis.cmd(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    // When each marker reached the client.
    let mut seen = Vec::new();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.ends_with(b"0\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), client.read(&mut buf))
            .await
            .expect("the response never ended")
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        while seen.len() < 10
            && got
                .windows(4)
                .any(|w| w == format!("<c{}>", seen.len()).as_bytes())
        {
            seen.push(sent.elapsed());
        }
    }
    let ended = sent.elapsed();
    let _: String = redis.cmd(&["CLIENT", "UNPAUSE"]);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    // The body left the backend by 7.3 s; its last bytes waited for the settle, which went out
    // at 7 s and gave up on the paused Redis at its 2 s call deadline.
    assert!(
        ended >= Duration::from_millis(8500),
        "the response ended {ended:?} after it was sent, before the settle was answered"
    );
    assert!(
        text.to_ascii_lowercase()
            .contains("x-idempotent-result: miss"),
        "{text}"
    );
    assert_eq!(seen.len(), 10, "{text}");
    // <c8> left the backend at 5.6 s and goes on as <c9> arrives, at 6.3 s.
    assert!(
        seen[8] < Duration::from_millis(7500),
        "the chunk sent at 5.6 s reached the client {:?} after the request was sent: {seen:?}\n{}",
        seen[8],
        proxy.log()
    );
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_settled_streaming_total"), 1.0, "{m}");
    // The renewal given up on counts as a failed claim call, as one the store refused would.
    assert_eq!(
        metric(&m, "idemgate_store_errors_total{op=\"claim\"}"),
        1.0,
        "{m}"
    );
    assert!(
        proxy
            .log()
            .contains("renewing the lock got no answer in time"),
        "{}",
        proxy.log()
    );
}

/// Redis full (`maxmemory` under `noeviction`) answers OOM: the store is full, not down, so the
/// request is refused 503 `store-full` and never forwarded, whatever the outage policy says
/// (under `pass` it went to the backend unprotected, and its retry ran again).
#[tokio::test]
async fn a_redis_out_of_memory_is_a_full_store_not_an_outage() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let backend = Backend::start().await;
    let proxy = builder_to(&backend, redis.url())
        .store("on_unavailable: pass")
        .start()
        .await;
    let warm = order(&proxy, "before").await;
    assert_eq!(warm.result(), Some("MISS"), "{}", warm.text());
    // Redis over its memory limit: every write that may grow it is refused (OOM).
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    assert!(
        redis.try_cmd(&["SET", "one-more", "x"]).is_err(),
        "Redis took a write over its limit"
    );
    for _ in 0..5 {
        let r = order(&proxy, "when-full").await;
        assert_eq!(r.status, 503, "{}\n{}", r.text(), proxy.log());
        assert_eq!(r.problem_type(), "store-full", "{}", r.text());
    }
    assert_eq!(backend.count(), 1, "nothing forwarded while Redis was full");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "idemgate_store_circuit_opened_total"),
        0.0,
        "a full store is no outage: the circuit stays closed\n{m}"
    );
}

/// A primary set to refuse writes without enough replicas (`min-replicas-to-write`, which the
/// README suggests to narrow what a failover can lose) that has lost its replica refuses the
/// scripts (NOREPLICAS; on Redis 6 wrapped in a script error, from the script's first write):
/// that is the store being unavailable, not a broken script. Under
/// `reject` nothing is forwarded, the circuit opens, and once the replica is back the circuit's
/// probe finds the primary taking writes again and keys are served.
#[tokio::test]
async fn a_primary_without_the_replicas_it_requires_is_an_outage() {
    let primary = RedisServer::start_with(&[
        "--min-replicas-to-write",
        "1",
        "--min-replicas-max-lag",
        "2",
    ]);
    let replica_of = primary.port.to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &replica_of]);
    let backend = Backend::start().await;
    let proxy = builder_to(&backend, primary.url()).start().await;
    let until_served = |key: &'static str| {
        let proxy = &proxy;
        async move {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let r = order(proxy, key).await;
                if r.result() == Some("MISS") {
                    return;
                }
                assert_eq!(
                    r.result(),
                    Some("UNAVAILABLE"),
                    "{}\n{}",
                    r.text(),
                    proxy.log()
                );
                assert!(Instant::now() < deadline, "never served\n{}", proxy.log());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    until_served("with-a-replica").await;
    drop(replica);
    // The primary notices within its lag bound, then refuses writes.
    let deadline = Instant::now() + Duration::from_secs(15);
    while primary.try_cmd(&["SET", "probe", "x"]).is_ok() {
        assert!(Instant::now() < deadline, "the primary kept taking writes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let executed = backend.count();
    for n in 0..5 {
        let r = order(&proxy, &format!("without-a-replica-{n}")).await;
        assert_eq!(
            (r.status, r.result(), r.problem_type().as_str()),
            (503, Some("UNAVAILABLE"), "store-unavailable"),
            "{}\n{}",
            r.text(),
            proxy.log()
        );
    }
    assert_eq!(backend.count(), executed, "nothing forwarded unprotected");
    let m = proxy.metrics().await;
    assert!(
        metric(&m, "idemgate_store_circuit_opened_total") >= 1.0,
        "NOREPLICAS is an outage: the circuit opens\n{m}"
    );
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &replica_of]);
    until_served("with-the-replica-back").await;
    drop(replica);
}

/// A Redis connection that dies without a word (a dropped flow; a proxy on the way that keeps
/// acknowledging and never answers) is replaced once a call on it times out with nothing
/// answered since it went out: keyed requests are served again within a few timeouts. (redis-rs
/// reconnects after I/O errors only, and kept sending every call on the dead connection.)
#[tokio::test]
async fn a_redis_connection_that_went_silent_is_replaced() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let proxy = builder_to(&backend, link.redis_url())
        .threads(1)
        .start()
        .await;
    let before = order(&proxy, "before").await;
    assert_eq!(before.result(), Some("MISS"), "{}", before.text());
    link.strand();
    until_redis_answers_within(&proxy, Duration::from_secs(5)).await;
    proxy
        .log_containing("redis connection answered nothing since the call went out")
        .await;
}

/// A stall shorter than an operation's deadline (a snapshot's fork, a slow command) costs the
/// calls it holds, not the connection: once Redis answers again, the same connection serves,
/// and no runtime reconnects.
#[tokio::test]
async fn a_short_redis_stall_keeps_the_connection() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    // Deadline of an operation, and the silence that drops a connection: 1 s to connect +
    // 2 x 200 ms to answer, well past the stall and a slow answer after it on a loaded machine.
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[link.redis_url()])
        .store("  connect_timeout: 1s")
        .store("  response_timeout: 200ms")
        .threads(1)
        .start()
        .await;
    let warm = order(&proxy, "before").await;
    assert_eq!(warm.result(), Some("MISS"), "{}", warm.text());
    // Redis's clients that ran the scripts of requests: the proxy worker's connection (the
    // warm-up's, the purge channel's and each listing's run other commands).
    let clients = || -> std::collections::BTreeSet<String> {
        let list: String = redis.cmd(&["CLIENT", "LIST"]);
        list.lines()
            .filter(|l| l.contains("cmd=evalsha"))
            .filter_map(|l| l.split(' ').next().map(str::to_owned))
            .collect()
    };
    let before = clients();
    assert!(!before.is_empty(), "the worker's connection ran no script");
    // Held 400 ms: the claim sent meanwhile times out (200 ms), answered by nothing, and the
    // stall ends before the release of that claim is first tried (500 ms after it failed).
    link.set(Fault::Hold);
    let held = order(&proxy, "during").await;
    assert_eq!(held.status, 503, "{}", held.text());
    tokio::time::sleep(Duration::from_millis(200)).await;
    link.set(Fault::Pass);
    until_redis_answers_within(&proxy, Duration::from_secs(5)).await;
    // The worker's connection still serves. (The claim that timed out is released afterwards
    // on a connection of its own: see
    // a_claim_that_reaches_redis_after_its_timeout_is_released_for_the_retry.)
    let after = clients();
    assert!(
        before.is_subset(&after),
        "a connection was made again after a short stall: {before:?} then {after:?}\n{}",
        proxy.log()
    );
}

/// A reconnect that Redis turns away without an I/O error (an AUTH it refuses: a password
/// changed on the server and changed back, say) left the connection failed for good: redis-rs
/// reconnects after I/O errors only, and answered every later call with that error. The
/// connection is dropped, and a later call connects afresh once Redis takes it again.
#[tokio::test]
async fn a_reconnect_redis_turned_away_is_tried_again() {
    let redis = RedisServer::start();
    let _: () = redis.cmd(&["CONFIG", "SET", "requirepass", "s3cret"]);
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let proxy = builder_to(&backend, format!("redis://:s3cret@{}", link.addr))
        .threads(1)
        .start()
        .await;
    let warm = order(&proxy, "before").await;
    assert_eq!(warm.result(), Some("MISS"), "{}", warm.text());
    let admin_client =
        redis::Client::open(format!("redis://:s3cret@127.0.0.1:{}", redis.port)).unwrap();
    let mut admin = admin_client.get_connection().unwrap();
    let password = |admin: &mut redis::Connection, to: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("requirepass")
            .arg(to)
            .query(admin)
            .unwrap();
    };
    // The proxy's connections break, and its reconnects are refused at AUTH.
    password(&mut admin, "another");
    link.set(Fault::Reset);
    tokio::time::sleep(Duration::from_millis(300)).await;
    link.set(Fault::Pass);
    for n in 0..5 {
        let r = order(&proxy, &format!("refused-{n}")).await;
        assert_eq!(r.status, 503, "{}", r.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    password(&mut admin, "s3cret");
    until_redis_answers_within(&proxy, Duration::from_secs(5)).await;
}

/// During an outage that outlasts the lock, a retry on the replica still running the key is a
/// conflict: each failed renewal proves the execution still runs there, so the replica counts
/// the key as its own until it ends, and the outage policy never runs it beside itself.
#[tokio::test]
async fn a_retry_on_the_replica_running_the_key_is_refused_through_an_outage_longer_than_the_lock()
{
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    // A backend still at work after the lock, and well after the retry (at 5 s).
    let backend = still_processing_for(8).await;
    let on = on_redis(ProxyBuilder::at(backend.addr), &[link.redis_url()], "200ms");
    let proxy = with_a_lock(on, "1500ms", "2500ms")
        .store("on_unavailable: local")
        .start()
        .await;
    let req = Request::post("/orders").key("outlasted").body("{}");
    let first = req.spawn_send(proxy.addr);
    until_forwarded(&backend).await;
    // Redis is cut off from 1 s on, before the first renewal (at three quarters of the lock);
    // the lock lapses at 2.5 s, and the retry comes 2.5 s after that.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    link.set(Fault::Reset);
    tokio::time::sleep(Duration::from_millis(4000)).await;
    let retry = req.send(proxy.addr).await;
    assert_eq!(
        (retry.status, retry.result()),
        (409, Some("CONFLICT")),
        "{}\n{}",
        retry.text(),
        proxy.log()
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(backend.count(), 1, "the key ran once");
}

#[tokio::test]
async fn a_lock_renewal_the_store_missed_is_tried_again_while_the_lock_holds() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    // The lock (8 s) is renewed at three quarters of its life (6 s); the backend answers at 7 s,
    // well inside the 7.4 s read_timeout.
    let proxy = with_a_lock(builder_to(&backend, link.redis_url()), "7400ms", "8s")
        .start()
        .await;
    let req = Request::post("/orders/slow/7000").key("renew").body("{}");
    let first = req.spawn_send(proxy.addr);
    // Redis is cut off from the claim (which the backend's count follows at once) over the
    // first renewal (6 s after it), and back as soon as that renewal has failed, before the
    // next try (a quarter of the 2 s left later) and the answer (7 s).
    backend.until_count(1).await;
    link.set(Fault::Reset);
    let deadline = Instant::now() + Duration::from_secs(7);
    while !proxy.log().contains("renewing the lock failed") {
        assert!(
            Instant::now() < deadline,
            "no renewal failed:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    link.set(Fault::Pass);
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    let again = req.send(proxy.addr).await;
    assert_eq!(
        again.result(),
        Some("HIT"),
        "{}\n{}",
        again.text(),
        proxy.log()
    );
    assert_eq!(again.body, first.body);
    // The renewal that met the cut-off failed; a later try, with Redis back and the lock still
    // holding, renewed it (one failure used to leave the lock to lapse).
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_lock_renewals_total"), 1.0, "{m}");
    assert!(
        proxy.log().contains("renewing the lock failed"),
        "{}",
        proxy.log()
    );
}

/// A proxy (with `shutdown` as its shutdown block, dead letters to `dead`) whose completion of
/// `key` waits in its retry queue: claimed while Redis was up, answered after Redis died, and
/// retried while its 60 s lock holds, so only the shutdown can dead-letter it.
async fn waiting_at_shutdown(
    backend: &Backend,
    redis: &mut RedisServer,
    dead: &std::path::Path,
    shutdown: &str,
    key: &str,
) -> Proxy {
    let proxy = builder(backend, redis)
        .store(&format!(
            "completion_retry: {{ attempts: 100, base_delay: 20ms, max_delay: 200ms, dead_letter_path: \"{}\" }}",
            dead.display()
        ))
        .idem("lock_ttl: 60s")
        .top(&format!("shutdown: {shutdown}"))
        .start()
        .await;
    executed_as_redis_dies(&proxy, backend, redis, key).await;
    proxy
        .metrics_containing("idemgate_completion_retry_pending 1")
        .await;
    proxy
}

/// Whether a thread of process `pid` waits in `open` of a FIFO no one writes.
fn blocked_on_a_fifo(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("wchan")).is_ok_and(|w| w == "wait_for_partner")
    })
}

/// A completion still waiting for Redis when shutdown.grace_period runs out is dead-lettered
/// then, by the drain, not once pingora has stopped its runtimes: that takes up to
/// graceful_shutdown_timeout more, and a SIGKILL meanwhile (a terminationGracePeriodSeconds
/// with no room for it) lost every such completion.
///
/// Something must keep a runtime from stopping, or the two moments are a few milliseconds
/// apart: the config file becomes a FIFO no one writes, so the config watcher's read of it
/// blocks its runtime's shutdown for the whole graceful_shutdown_timeout (60 s). Ten seconds
/// after the SIGTERM (grace period 2 s) is then far from both moments, whatever the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_waiting_when_the_grace_period_ends_is_dead_lettered_before_the_runtimes_stop()
{
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    let mut proxy = waiting_at_shutdown(
        &backend,
        &mut redis,
        &dead,
        "{grace_period: 2s, graceful_shutdown_timeout: 60s}",
        "drain",
    )
    .await;

    let fifo = dir.path().join("config.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    std::fs::rename(&fifo, &proxy.config_path).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !blocked_on_a_fifo(proxy.pid()) {
        assert!(Instant::now() < deadline, "the config read never blocked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    proxy.signal("TERM");
    let termed = Instant::now();
    let text = loop {
        let text = std::fs::read_to_string(&dead).unwrap_or_default();
        if !text.is_empty() {
            break text;
        }
        assert!(
            termed.elapsed() < Duration::from_secs(10),
            "no dead letter 10 s after SIGTERM:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let line: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
    assert_eq!(
        line["reason"], "shutdown.grace_period ran out before the store took it",
        "{text}"
    );
    assert_eq!(line["in_store"], "unknown");
    assert_eq!(line["response"]["status"], 201);
    // With nothing left in flight or waiting, the drain exits at once: no wait on the runtimes.
    let (status, proxy) =
        tokio::task::spawn_blocking(move || (proxy.wait_exit(Duration::from_secs(5)), proxy))
            .await
            .unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        proxy.log()
    );
    assert!(proxy
        .log()
        .contains("ran out with completions the store never took"));
}

/// A completion whose first write to Redis is still out when the grace period ends is
/// dead-lettered. pingora then drops every request's task, and the retrier, which learns of a
/// completion only from a failed write, never heard of this one: it vanished with the task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_first_write_is_out_when_the_process_stops_is_dead_lettered() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    // The write is never answered and never times out within the test.
    let mut proxy = on_redis(ProxyBuilder::new(&backend), &[link.redis_url()], "30s")
        .store(&format!(
            "completion_retry: {{ dead_letter_path: \"{}\" }}",
            dead.display()
        ))
        .idem("lock_ttl: 60s")
        .top("shutdown: {grace_period: 1s, graceful_shutdown_timeout: 1s}")
        .start()
        .await;
    let req = Request::post("/orders/gate/cut").key("cut").body("{}");
    let addr = proxy.addr;
    let first = tokio::spawn(async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(&req.to_bytes()).await.unwrap();
        common::client::read_response(&mut stream, false).await
    });
    // Claimed once the backend has it; it answers once Redis is partitioned away.
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.count() == 0 {
        assert!(
            Instant::now() < deadline,
            "never forwarded:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    link.set(Fault::Hold);
    backend.open("cut");
    tokio::time::sleep(Duration::from_millis(250)).await;
    proxy.signal("TERM");
    let (status, proxy) =
        tokio::task::spawn_blocking(move || (proxy.wait_exit(Duration::from_secs(10)), proxy))
            .await
            .unwrap();
    assert!(status.is_some(), "still running\n{}", proxy.log());
    // Cut off: the last bytes of an answer wait for its record to be stored.
    assert!(
        first.await.unwrap().is_err(),
        "answered before its record was stored"
    );
    let text = std::fs::read_to_string(&dead).unwrap_or_default();
    let line: serde_json::Value = serde_json::from_str(text.trim_end())
        .unwrap_or_else(|e| panic!("no dead letter ({e}): {text:?}\n{}", proxy.log()));
    assert_eq!(line["reason"], "process stopped with the store write out");
    assert_eq!(line["in_store"], "unknown");
    assert_eq!(line["response"]["status"], 201);
}

/// The last copy of a dead letter the file cannot take goes straight to stderr: not through
/// the log pipeline, whose filter may be off and whose batched writer may drop lines.
/// A keyed request claimed while Redis is up and answered (201 MISS) after it was killed: its
/// completion can only wait for the retrier.
async fn executed_as_redis_dies(
    proxy: &Proxy,
    backend: &Backend,
    redis: &mut RedisServer,
    key: &str,
) {
    let first = Request::post(&format!("/orders/gate/{key}"))
        .key(key)
        .body("{}")
        .spawn_send(proxy.addr);
    backend.until_count(backend.count() + 1).await;
    redis.kill();
    backend.open(key);
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
}

#[tokio::test]
async fn a_dead_letter_the_file_cannot_take_reaches_stderr_whatever_the_log_level() {
    dead_letter_on_stderr(false).await;
}

/// Under JSON logging the last copy is a JSON object like every other line, carrying the dead
/// letter whole: a collector that parses every line keeps it.
#[tokio::test]
async fn a_dead_letter_on_stderr_is_a_json_line_under_json_logging() {
    dead_letter_on_stderr(true).await;
}

async fn dead_letter_on_stderr(json: bool) {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("missing-dir").join("dead.jsonl");
    let proxy = with_a_2s_lock(builder(&backend, &redis))
        .store(&format!(
            "completion_retry: {{ attempts: 1, base_delay: 20ms, max_delay: 40ms, dead_letter_path: \"{}\" }}",
            dead.display()
        ))
        .env("IDEMGATE_LOG", "off")
        .env("IDEMGATE_LOG_FORMAT", if json { "json" } else { "text" })
        .start()
        .await;
    executed_as_redis_dies(&proxy, &backend, &mut redis, "unlogged").await;
    // Dead-lettered once the attempt has failed and the 2 s lock may have lapsed.
    let needle = "dead letter not written to ";
    let deadline = Instant::now() + Duration::from_secs(10);
    let stderr = loop {
        let stderr = proxy.log();
        if stderr.contains(needle) {
            break stderr;
        }
        assert!(Instant::now() < deadline, "not on stderr:\n{stderr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let text = stderr.lines().find(|l| l.contains(needle)).unwrap();
    let line: serde_json::Value = if json {
        let notice: serde_json::Value = serde_json::from_str(text).expect("a JSON line");
        assert_eq!(notice["level"], "ERROR");
        assert!(notice["message"]
            .as_str()
            .is_some_and(|m| m.starts_with(needle)));
        notice["dead_letter"].clone()
    } else {
        assert!(
            text.starts_with("idemgate: dead letter not written to "),
            "{text}"
        );
        serde_json::from_str(&text[text.find('{').unwrap()..]).unwrap()
    };
    let id = &backend.executions()[0].execution_id;
    assert_eq!(line["execution_id"].as_str(), id.as_deref());
    assert_eq!(line["response"]["status"], 201);
    assert_eq!(line["record"].as_str().map(str::len), Some(64));
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_dead_letter_write_failures_total"), 1.0);
}

#[tokio::test]
async fn the_proxy_is_not_ready_until_its_first_worker_id_lease_attempt_ends() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    link.set(Fault::Hold);
    let backend = Backend::start().await;
    // `pass`: readiness does not hang on the store's ping, only on the lease.
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[link.redis_url()])
        .store("  connect_timeout: 2s")
        .store("  response_timeout: 500ms")
        .store("on_unavailable: pass")
        .no_worker_id()
        .global("worker_lease: 3s")
        .env("POD_NAME", "orders-held")
        .start()
        .await;
    let pending = Request::get("/readyz").send(proxy.admin).await;
    assert_eq!(pending.status, 503, "{}", pending.text());
    assert_eq!(pending.text(), "worker id lease pending\n");

    // The attempt ends with Redis's deadline (3 s here); the proxy is then ready, unleased.
    proxy.log_containing("leasing a worker id failed").await;
    let ready = Request::get("/readyz").send(proxy.admin).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    proxy
        .metrics_containing("idemgate_worker_id_leased 0")
        .await;

    link.set(Fault::Pass);
    proxy.log_containing("worker id leased").await;
    proxy
        .metrics_containing("idemgate_worker_id_leased 1")
        .await;
}

/// A proxy under `on_unavailable: local` on the Redis at `port`, with short Redis timeouts and
/// a breaker that probes again after 200 ms.
async fn local_policy_proxy(backend: &Backend, port: u16) -> Proxy {
    ProxyBuilder::new(backend)
        .redis(&[format!("redis://127.0.0.1:{port}")])
        .store("  connect_timeout: 100ms")
        .store("  response_timeout: 200ms")
        .store("on_unavailable: local")
        .store("circuit_breaker: {failure_threshold: 1, open_for: 200ms}")
        .env("IDEMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .start()
        .await
}

/// Waits until a keyed request on a fresh key is answered from Redis again (`MISS`).
async fn until_redis_answers(proxy: &Proxy) {
    until_redis_answers_within(proxy, Duration::from_secs(10)).await
}

/// [`until_redis_answers`], failing after `within`.
async fn until_redis_answers_within(proxy: &Proxy, within: Duration) {
    let deadline = Instant::now() + within;
    for n in 0.. {
        let probe = order(proxy, &format!("probe-{n}")).await;
        if probe.result() == Some("MISS") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Redis never answered again: {} {}\n{}",
            probe.status,
            probe.text(),
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A keyed `POST /orders` of `{}` under `key`.
async fn order(proxy: &Proxy, key: &str) -> common::Response {
    Request::post("/orders")
        .key(key)
        .body("{}")
        .send(proxy.addr)
        .await
}

/// A backend that answers `102 Processing` every second for `seconds`, then 201.
async fn still_processing_for(seconds: usize) -> common::rawbackend::RawBackend {
    use common::rawbackend::{RawBackend, Step};
    let mut script = Vec::new();
    for _ in 0..seconds {
        script.push(Step::Send(b"HTTP/1.1 102 Processing\r\n\r\n".to_vec()));
        script.push(Step::Pause(Duration::from_secs(1)));
    }
    script.push(Step::Send(
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
    ));
    RawBackend::start(script).await
}

/// Waits until `backend` has taken a request (5 s at most).
async fn until_forwarded(backend: &common::rawbackend::RawBackend) {
    let started = Instant::now();
    while backend.count() < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never forwarded"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A `local`-policy proxy that ran `req` on the fallback while Redis was down, answering
/// `status` (`DEGRADED`), with Redis back and answering since; and that first answer.
async fn ran_on_the_fallback(
    req: &Request,
    status: u16,
) -> (RedisServer, Backend, Proxy, common::Response) {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = local_policy_proxy(&backend, redis.port).await;
    redis.kill();
    let first = req.send(proxy.addr).await;
    assert_eq!((first.status, first.result()), (status, Some("DEGRADED")));
    redis.restart();
    until_redis_answers(&proxy).await;
    (redis, backend, proxy, first)
}

#[tokio::test]
async fn a_key_run_on_the_local_fallback_is_replayed_not_run_again_once_redis_is_back() {
    let req = Request::post("/orders")
        .key("outage-order")
        .body("{\"sku\":1}");
    let (_redis, backend, proxy, first) = ran_on_the_fallback(&req, 201).await;
    let ran = backend.count();
    // Redis has no record of the key; the replica that ran it does.
    let again = req.send(proxy.addr).await;
    assert_eq!(
        (again.status, again.result()),
        (201, Some("HIT")),
        "{}",
        again.text()
    );
    assert_eq!(again.body, first.body);
    let changed = Request::post("/orders")
        .key("outage-order")
        .body("{\"sku\":2}");
    assert_eq!(changed.send(proxy.addr).await.status, 422);
    assert_eq!(backend.count(), ran, "the key did not run again");
    // The admin API shows the record the proxy answers from.
    let view = Request::get("/admin/records/default/outage-order")
        .send(proxy.admin)
        .await;
    assert_eq!(view.status, 200, "{}", view.text());
    let view: serde_json::Value = serde_json::from_slice(&view.body).unwrap();
    assert_eq!(
        (&view["state"], &view["held_by"]),
        (&"completed".into(), &"fallback".into()),
        "{view}"
    );

    // A purge drops the fallback's record too: the key may run afresh, on Redis.
    let del = Request::new("DELETE", "/admin/records/default/outage-order")
        .header("Authorization", format!("Bearer {ADMIN_TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(del.status, 200, "{}", del.text());
    let purged: serde_json::Value = serde_json::from_slice(&del.body).unwrap();
    assert_eq!(purged["deleted_from_fallback"], true, "{purged}");
    let fresh = req.send(proxy.addr).await;
    assert_eq!(fresh.result(), Some("MISS"), "{}", fresh.text());
}

/// A purge announced by another replica drops this one's copies, and what its fallback settled,
/// but not a claim its fallback still runs: a retry here would then find the key free in Redis
/// and run it beside that execution.
#[tokio::test]
async fn an_announced_purge_spares_a_key_running_on_this_replica_s_fallback() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let running = local_policy_proxy(&backend, redis.port).await;
    let other = local_policy_proxy(&backend, redis.port).await;
    redis.kill();
    let req = Request::post("/orders/slow/10000")
        .key("running-on-the-fallback")
        .body("{}");
    let first = req.spawn_send(running.addr);
    backend.until_count(1).await;
    redis.restart();
    // Both listen for purges again.
    redis.until_purge_listeners(2).await;
    until_redis_answers(&running).await;
    // A key completed on this replica, in Redis and in its local cache: its purge, announced
    // after the other, shows when the announcements have arrived (they come in order).
    let witness = Request::post("/orders").key("witness").body("{}");
    assert_eq!(witness.send(running.addr).await.result(), Some("MISS"));
    assert_eq!(witness.send(running.addr).await.result(), Some("HIT"));
    // Nothing of the running key in the other replica's stores: its purge deletes nothing, and
    // is announced.
    for key in ["running-on-the-fallback", "witness"] {
        let del = Request::new("DELETE", &format!("/admin/records/default/{key}"))
            .header("Authorization", format!("Bearer {ADMIN_TOKEN}"))
            .send(other.admin)
            .await;
        assert_eq!(del.status, 200, "{}", del.text());
        assert!(
            del.text().contains("2 replicas listening"),
            "{}",
            del.text()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while witness.send(running.addr).await.result() != Some("MISS") {
        assert!(Instant::now() < deadline, "the purges never arrived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retry = req.send(running.addr).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "request-in-flight");
    let first = first.await.expect("original");
    assert_eq!((first.status, first.result()), (201, Some("DEGRADED")));
    let ran = backend
        .executions()
        .iter()
        .filter(|e| e.path == "/orders/slow/10000")
        .count();
    assert_eq!(ran, 1, "the key ran once");
}

/// A key released on the fallback during an outage (a 5xx) runs again once Redis is back, as a
/// released key does: only for the same request (422 otherwise), and under the execution id
/// the backend already saw.
#[tokio::test]
async fn a_key_released_on_the_local_fallback_keeps_its_id_and_its_fingerprint_once_redis_is_back()
{
    let req = Request::post("/orders/status/503")
        .key("released-in-outage")
        .body("{\"sku\":1}");
    let (_redis, backend, proxy, _first) = ran_on_the_fallback(&req, 503).await;
    let changed = Request::post("/orders/status/503")
        .key("released-in-outage")
        .body("{\"sku\":2}");
    let refused = changed.send(proxy.addr).await;
    assert_eq!(
        (refused.status, refused.result()),
        (422, Some("MISMATCH")),
        "{}",
        refused.text()
    );
    let again = req.send(proxy.addr).await;
    assert_eq!(again.status, 503, "{}", again.text());
    let ids: Vec<_> = backend
        .executions()
        .into_iter()
        .filter(|e| e.path == "/orders/status/503")
        .map(|e| e.execution_id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(
        ids[0].is_some() && ids[0] == ids[1],
        "one id for the key: {ids:?}"
    );
}

#[tokio::test]
async fn a_retry_of_a_key_this_replica_is_running_is_not_run_beside_it_when_redis_fails() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = local_policy_proxy(&backend, redis.port).await;
    let slow = Request::post("/orders/slow/1500")
        .key("running-here")
        .body("{}")
        .spawn_send(proxy.addr);
    backend.until_count(1).await;
    assert_eq!(backend.count(), 1, "the original runs");
    redis.kill();
    // The store cannot answer, and `local` would run the retry on the fallback: but this
    // replica holds the key's claim itself.
    let retry = Request::post("/orders/slow/1500")
        .key("running-here")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "request-in-flight");
    assert!(retry.header("retry-after").is_some());
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(backend.count(), 1, "the key ran once");
}

/// A retry that arrives while the original's completion is being written to a Redis that has
/// stopped answering: its own claim fails after the write did, by when the original's claim is
/// let go and its answer kept here. It gets that answer (or a 409 while the claim is still
/// held), never a second run on the fallback.
#[tokio::test]
async fn a_retry_while_the_answer_is_being_written_to_a_hung_redis_is_not_run_again() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[format!("redis://127.0.0.1:{}", redis.port)])
        .store("  response_timeout: 1s")
        .store("on_unavailable: local")
        .store("circuit_breaker: {failure_threshold: 5, open_for: 200ms}")
        .start()
        .await;
    let req = Request::post("/orders/slow/300")
        .key("written-to-a-hung-redis")
        .body("{}");
    let original = req.spawn_send(proxy.addr);
    backend.until_count(1).await;
    // Redis stops answering before the backend does: the completion's write waits out the
    // response timeout, and the retry, sent while it is out, waits behind it.
    let pid = redis.pid().expect("redis pid");
    signal(pid, "STOP");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = req.send(proxy.addr).await;
    signal(pid, "CONT");
    let first = original.await.expect("original");
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert!(
        matches!(
            (retry.status, retry.result()),
            (201, Some("HIT")) | (409, Some("CONFLICT"))
        ),
        "{} {:?}: {}",
        retry.status,
        retry.result(),
        retry.text()
    );
    assert_eq!(backend.count(), 1, "the key ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_hangs_mid_load_opens_the_circuit_and_nothing_runs_unprotected() {
    let redis = RedisServer::start();
    let fault = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let proxy = builder_to(&backend, fault.redis_url()).start().await;
    // A partition: Redis neither answers nor refuses; only the timeouts notice.
    let load = load_through_an_outage(&proxy, &backend, |down| {
        fault.set(if down { Fault::Hold } else { Fault::Pass });
    })
    .await;
    assert!(
        load.seen.iter().filter(|s| s.2.status == 503).count() > 3,
        "the hang was seen"
    );
    let m = proxy.metrics().await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("idemgate_store_errors_total{")
                && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) > Some(0.0)),
        "store errors counted: {m}"
    );
    assert!(
        m.lines().any(|l| l
            .starts_with("idemgate_store_operation_duration_seconds_count{op=\"claim\"")
            && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())
                >= Some(load.misses as f64)),
        "claims timed: {m}"
    );
}

/// A stop whose dead letters the file never takes (another process holds its lock, as a hung
/// disk would) says how many were lost and exits 74, not 0: the supervisor must see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_that_loses_dead_letters_exits_74() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("dead.jsonl");
    let mut proxy = waiting_at_shutdown(
        &backend,
        &mut redis,
        &dead,
        "{grace_period: 1s, graceful_shutdown_timeout: 1s}",
        "unwritable",
    )
    .await;
    // The file exists (opened at start); this test holds its lock from now on.
    let held = std::fs::OpenOptions::new()
        .append(true)
        .open(&dead)
        .unwrap();
    held.lock().unwrap();
    proxy.signal("TERM");
    let (status, proxy) =
        tokio::task::spawn_blocking(move || (proxy.wait_exit(Duration::from_secs(20)), proxy))
            .await
            .unwrap();
    let log = proxy.log();
    assert_eq!(status.and_then(|s| s.code()), Some(74), "{status:?}\n{log}");
    assert!(log.contains("1 dead letters could not be written"), "{log}");
    drop(held);
}

/// However hard `/readyz` is polled (anyone who reaches the admin port can), the store sees a
/// ping at most every 250 ms: probes that come while one is out, or soon after, share its
/// answer, so they cannot load Redis or queue the proxy's own calls behind theirs.
#[tokio::test]
async fn readiness_probes_share_their_store_pings() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = builder(&backend, &redis).start().await;
    assert_eq!(Request::get("/readyz").send(proxy.admin).await.status, 200);
    let before = redis.calls();
    let probes: Vec<_> = (0..60)
        .map(|_| Request::get("/readyz").spawn_send(proxy.admin))
        .collect();
    for probe in probes {
        let answer = probe.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.text());
    }
    // A ping is two commands (the get script and a PEXPIRE); the INFO that read `before` comes
    // on top (the purge channel's heartbeats are not counted). Sixty pings would be 120.
    let commands = redis.calls() - before;
    assert!(commands <= 16, "{commands} Redis commands for 60 probes");
}

/// A Redis at its `maxclients` answers a new connection `ERR max number of clients reached`
/// and closes it. That is the server's state, not a fault of the script the call ran: the
/// request gets the outage policy (503 `store-unavailable` under `reject`), the circuit may
/// open, and service comes back once the server takes clients again.
#[tokio::test]
async fn a_redis_at_its_client_limit_is_an_outage_not_a_script_fault() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = builder(&backend, &redis).threads(1).start().await;
    let warm = order(&proxy, "before").await;
    assert_eq!(warm.result(), Some("MISS"), "{}", warm.text());
    // One connection holds the server's only slot, once every other is gone.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut holder = client.get_connection().unwrap();
    let query = |holder: &mut redis::Connection, args: &[&str]| {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query::<redis::Value>(holder).unwrap()
    };
    let limit: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxclients")
        .query(&mut holder)
        .unwrap();
    query(&mut holder, &["CONFIG", "SET", "maxclients", "1"]);
    query(
        &mut holder,
        &["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"],
    );
    query(&mut holder, &["CLIENT", "KILL", "TYPE", "pubsub"]);
    let mut seen = Vec::new();
    for n in 0..5 {
        let r = order(&proxy, &format!("full-{n}")).await;
        seen.push((r.status, r.result().map(str::to_owned), r.problem_type()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (status, result, problem) in &seen {
        assert_eq!(*status, 503, "{seen:?}\n{}", proxy.log());
        assert_eq!(
            result.as_deref(),
            Some("UNAVAILABLE"),
            "{seen:?}\n{}",
            proxy.log()
        );
        assert!(problem.ends_with("store-unavailable"), "{seen:?}");
    }
    assert_eq!(
        backend.count(),
        1,
        "nothing ran while Redis took no clients"
    );
    query(&mut holder, &["CONFIG", "SET", "maxclients", &limit[1]]);
    until_redis_answers_within(&proxy, Duration::from_secs(5)).await;
}

/// A purge without `force` spares a record in flight whose lock lapsed, as one whose lock runs:
/// its execution may still be running (its replica cut off from Redis renews it when it can),
/// and a retry takes the key over under the same `X-Idempotency-Id`, which the purge would lose.
#[tokio::test]
async fn a_purge_spares_a_claim_whose_lock_lapsed_unless_forced() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = builder(&backend, &redis)
        .env("IDEMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .start()
        .await;
    // Slow enough that the purges below come while it runs, however loaded the machine.
    let running = Request::post("/orders/slow/5000")
        .key("lapsed-purge")
        .body("{}")
        .spawn_send(proxy.addr);
    backend.until_count(1).await;
    let records: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|k| k.contains('{'))
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    // The lock lapses (as when its replica was cut off from Redis past it).
    let _: i64 = redis.cmd(&["HSET", &records[0], "l", "0"]);
    let purge = |query: &str| {
        Request::new(
            "DELETE",
            &format!("/admin/records/default/lapsed-purge{query}"),
        )
        .header("Authorization", format!("Bearer {ADMIN_TOKEN}"))
    };
    let refused = purge("").send(proxy.admin).await;
    assert_eq!(refused.status, 409, "{}", refused.text());
    assert_eq!(refused.problem_type(), "admin-record-in-flight");
    assert!(refused.text().contains("lock lapsed"), "{}", refused.text());
    assert_eq!(redis.cmd::<i64>(&["EXISTS", &records[0]]), 1, "spared");
    let forced = purge("?force=true").send(proxy.admin).await;
    assert_eq!(forced.status, 200, "{}", forced.text());
    assert_eq!(redis.cmd::<i64>(&["EXISTS", &records[0]]), 0, "removed");
    running.abort();
}

/// A claim that reaches Redis only after its timeout (a slow network here; a stalled Redis, a
/// long command or a paused VM in production) leaves its request answered 503
/// `store-unavailable` with `Retry-After: 1`, and takes the key for nobody once Redis runs it:
/// idemgate releases it, so the retry the 503 asked for runs, instead of getting 409 until
/// `lock_ttl` and then taking the lock over as though an answer had been lost (which pages).
#[tokio::test]
async fn a_claim_that_reaches_redis_after_its_timeout_is_released_for_the_retry() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let proxy = builder_to(&backend, link.redis_url()).start().await;
    // Every worker thread's connection made (the held claim must go out on one, not wait
    // for a connection's handshake).
    for n in 0..8 {
        let warm = order(&proxy, &format!("warm-{n}")).await;
        assert_eq!(warm.result(), Some("MISS"));
    }
    // The claim reaches Redis only once the partition heals, after it timed out.
    link.set(Fault::Hold);
    let stalled = order(&proxy, "stalled").await;
    assert_eq!(stalled.status, 503, "{}", stalled.text());
    assert_eq!(stalled.problem_type(), "store-unavailable");
    assert_eq!(stalled.header("retry-after"), Some("1"));
    assert_eq!(backend.count(), 8, "the stalled request was never sent");
    link.set(Fault::Pass);
    // Another request meanwhile: the connection that went silent is given up for a new one,
    // and the claim held on it reaches Redis.
    assert_eq!(order(&proxy, "other").await.result(), Some("MISS"));
    // The client waits as Retry-After says.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(redis.keys().len(), 10, "the late claim never reached redis");
    let deadline = Instant::now() + Duration::from_secs(5);
    let retry = loop {
        let retry = order(&proxy, "stalled").await;
        if retry.status == 201 || Instant::now() > deadline {
            break retry;
        }
        // 503 while the store is still out; 409 until the late claim is released.
        assert!(matches!(retry.status, 409 | 503), "{}", retry.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (retry.status, retry.result()),
        (201, Some("MISS")),
        "{}",
        retry.text()
    );
    assert_eq!(backend.count(), 10);
    let m = proxy.metrics().await;
    let takeovers = "idemgate_lapsed_takeovers_total{route=\"orders\"}";
    assert_eq!(common::metric(&m, takeovers), Some(0.0), "{m}");
    assert_eq!(
        common::metric(&m, "idemgate_store_unanswered_claims_released_total"),
        Some(1.0),
        "{m}"
    );
}
