//! Several real `idemgate` processes sharing one Redis (single server or Cluster): replay
//! across instances, exactly-once execution under concurrent duplicates, and the proxy riding
//! out script cache loss, Redis restarts and a Redis that is down at start.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::redis::{RedisCluster, RedisServer};
use common::tcp;
use common::{Backend, Proxy, ProxyBuilder, Request};

/// Duplicates wait for their original (10 s at most) instead of a 409.
const WAIT: [&str; 2] = ["on_in_flight: wait", "wait_timeout: 10s"];

/// `count` proxies in front of `backend`, all on the Redis at `urls`.
async fn proxies(backend: &Backend, urls: &[String], count: usize, idem: &[&str]) -> Vec<Proxy> {
    let mut started = Vec::new();
    for n in 0..count {
        // A worker id of its own, as replicas sharing a Redis need.
        let mut builder = ProxyBuilder::new(backend)
            .worker_id(1 + n as u16)
            .redis(urls);
        for line in idem {
            builder = builder.idem(line);
        }
        started.push(builder.start().await);
    }
    started
}

#[tokio::test]
async fn replays_across_two_and_three_instances() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let instances = proxies(&backend, &[redis.url()], 3, &[]).await;

    // Two instances: miss on A, hit on B.
    let req = Request::post("/orders")
        .key("pair-1")
        .json(r#"{"sku":"A"}"#);
    let first = req.send(instances[0].addr).await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    let second = req.send(instances[1].addr).await;
    assert_eq!((second.status, second.result()), (201, Some("HIT")));
    assert_eq!(second.body, first.body);
    assert_eq!(backend.count(), 1);

    // Three instances: miss on A, hit on B and C, byte for byte.
    let req = Request::post("/orders/binary").key("trio-1").body("x");
    let first = req.send(instances[0].addr).await;
    assert_eq!((first.status, first.result()), (200, Some("MISS")));
    for proxy in &instances[1..] {
        let replay = req.send(proxy.addr).await;
        assert_eq!(replay.result(), Some("HIT"));
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.end_to_end_headers(), first.end_to_end_headers());
    }
    // A different body under the same key is a mismatch on every instance.
    let other = Request::post("/orders/binary").key("trio-1").body("y");
    for proxy in &instances {
        assert_eq!(other.send(proxy.addr).await.status, 422);
    }
    assert_eq!(backend.count(), 2);

    // Records hold the prefix, tenant and hex hash only: never the raw key or scope value.
    let keys = redis.keys();
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in &keys {
        assert!(key.starts_with("idemgate:{default:"), "{key}");
        assert!(!key.contains("trio") && !key.contains("pair"), "{key}");
        let fields: BTreeMap<String, Vec<u8>> = redis.cmd(&["HGETALL", key]);
        for value in fields.values() {
            let text = String::from_utf8_lossy(value);
            assert!(
                !text.contains("trio-1") && !text.contains("pair-1"),
                "{text}"
            );
        }
    }
}

/// A request without the tenant header is scoped under `idempotency.default_tenant`; one with
/// it, under its tenant. Each tenant's records are its own keys.
#[tokio::test]
async fn requests_without_a_tenant_are_scoped_under_the_configured_default_tenant() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[redis.url()])
        .global("default_tenant: shop-eu")
        .start()
        .await;
    let plain = Request::post("/orders").key("t-1").body("x");
    assert_eq!(plain.send(proxy.addr).await.result(), Some("MISS"));
    let keys = redis.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].starts_with("idemgate:{shop-eu:"), "{keys:?}");
    // The same key under a named tenant is another record; under the default one, a replay.
    let named = plain.clone().header("X-Tenant-ID", "shop-us");
    assert_eq!(named.send(proxy.addr).await.result(), Some("MISS"));
    let named_default = plain.clone().header("X-Tenant-ID", "shop-eu");
    assert_eq!(named_default.send(proxy.addr).await.result(), Some("HIT"));
    let mut keys = redis.keys();
    keys.sort();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys[0].starts_with("idemgate:{shop-eu:"), "{keys:?}");
    assert!(keys[1].starts_with("idemgate:{shop-us:"), "{keys:?}");
    assert_eq!(backend.count(), 2);
}

/// Sends `count` copies of one request at once, spread round-robin over `instances`.
async fn stampede(instances: &[Proxy], req: &Request, count: usize) -> Vec<common::Response> {
    let tasks: Vec<_> = (0..count)
        .map(|i| {
            let (req, addr) = (req.clone(), instances[i % instances.len()].addr);
            tokio::spawn(async move { req.send(addr).await })
        })
        .collect();
    let mut responses = Vec::new();
    for task in tasks {
        responses.push(task.await.expect("request task"));
    }
    responses
}

fn assert_executed_once(backend: &Backend, responses: &[common::Response]) {
    assert_eq!(backend.count(), 1, "the backend executed more than once");
    let results: Vec<_> = responses.iter().map(|r| (r.status, r.result())).collect();
    let misses = results
        .iter()
        .filter(|r| **r == (201, Some("MISS")))
        .count();
    let hits = results.iter().filter(|r| **r == (201, Some("HIT"))).count();
    assert_eq!(misses, 1, "{results:?}");
    assert_eq!(hits, responses.len() - 1, "{results:?}");
    assert!(responses.iter().all(|r| r.body == responses[0].body));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_over_three_instances_execute_once() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let instances = proxies(&backend, &[redis.url()], 3, &WAIT).await;
    let req = Request::post("/orders/slow/400")
        .key("stampede")
        .json(r#"{"sku":"B"}"#);
    let responses = stampede(&instances, &req, 50).await;
    assert_executed_once(&backend, &responses);
}

/// Duplicates waiting on an execution that runs on their own replica hear of its end there:
/// they ask Redis nothing while it runs, and are answered from the local copy once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_waiting_on_their_own_replica_do_not_poll_redis() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let instances = proxies(&backend, &[redis.url()], 1, &WAIT).await;
    let req = Request::post("/orders/slow/4000")
        .key("one-replica")
        .json(r#"{"sku":"D"}"#);
    let before = redis.command_calls("evalsha");
    // Once every duplicate has claimed (19 of them found the record in flight), and at most a
    // read or two of waiters whose claims' answers were taken before the original's, which
    // then heard of it, a second of the original's 4 s passes without a script. Polling the
    // store instead (even one poll for all of them) reads the record some 10 times a second,
    // at 5 ms doubling to 100 ms; each waiter polling, some 190.
    let midway = async {
        backend.until_count(1).await;
        let started = std::time::Instant::now();
        while redis.command_calls("evalsha") - before < 20 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the duplicates' claims did not all run"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let claimed = redis.command_calls("evalsha") - before;
        tokio::time::sleep(Duration::from_secs(1)).await;
        (claimed, redis.command_calls("evalsha") - before)
    };
    let (responses, (claimed, midway)) = tokio::join!(stampede(&instances, &req, 20), midway);
    assert!(
        claimed <= 23 && midway - claimed <= 3,
        "{claimed} scripts run once the 20 duplicates on one replica had claimed, {midway} a \
         second later"
    );
    let calls = redis.command_calls("evalsha") - before;
    assert_executed_once(&backend, &responses);
    // The completion; the waiters are answered from the local copy.
    assert_eq!(calls, midway + 1, "scripts run after the original ended");
    let m = instances[0].metrics().await;
    assert_eq!(
        common::metric(&m, "idemgate_waits_ended_here_total"),
        Some(19.0),
        "{m}"
    );
}

/// Duplicates waiting on one replica for an execution that runs on another share one poll of
/// the record: one of them reads it, with backoff, and the others take what it read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_waiting_on_another_replica_s_execution_share_one_poll() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let instances = proxies(&backend, &[redis.url()], 2, &WAIT).await;
    // Long enough that every duplicate waits on it, however slowly they come.
    let req = Request::post("/orders/slow/4000")
        .key("other-replica")
        .json(r#"{"sku":"E"}"#);
    let before = redis.command_calls("evalsha");
    let original = req.clone().spawn_send(instances[0].addr);
    backend.until_count(1).await;
    let mut responses = stampede(&instances[1..], &req, 20).await;
    responses.push(original.await.expect("original"));
    let calls = redis.command_calls("evalsha") - before;
    assert_executed_once(&backend, &responses);
    // 21 claims and the completion; one poll of some 45 reads over the 4 s (5 ms doubling to
    // 100 ms), plus a read each for a few waiters that came while a poll was ending. Each
    // waiter polling would read the record some 45 times: about 900 in all.
    assert!(
        calls <= 90,
        "{calls} scripts run for 20 duplicates waiting on one replica"
    );
    // All but the waiters that polled took another's read.
    let m = instances[1].metrics().await;
    let shared = common::metric(&m, "idemgate_waits_shared_total").expect("exported");
    assert!(shared >= 15.0, "{shared} of 20 waits shared a poll");
    assert_eq!(
        common::metric(&m, "idemgate_waits_ended_here_total"),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_replays_across_instances_and_executes_duplicates_once() {
    let cluster = RedisCluster::start(3);
    let backend = Backend::start().await;
    let instances = proxies(&backend, &cluster.urls(), 2, &WAIT).await;

    let req = Request::post("/orders/slow/400")
        .key("cluster-stampede")
        .json(r#"{"sku":"C"}"#);
    let responses = stampede(&instances, &req, 50).await;
    assert_executed_once(&backend, &responses);

    // Many keys: they spread over the primaries, and each replays on the other instance.
    for n in 0..12 {
        let req = Request::post("/orders")
            .key(&format!("spread-{n}"))
            .body("z");
        assert_eq!(req.send(instances[0].addr).await.result(), Some("MISS"));
        assert_eq!(req.send(instances[1].addr).await.result(), Some("HIT"));
    }
    let holders: std::collections::BTreeSet<u16> =
        cluster.keys().into_iter().map(|(port, _)| port).collect();
    assert!(holders.len() >= 2, "records all on {holders:?}");
}

/// How many `SCRIPT LOAD`s the server has run (Redis 7 counts subcommands apart; Redis 6
/// counts every `SCRIPT` call as one command, which still grows with the loads).
fn script_loads(redis: &RedisServer) -> u64 {
    let info: String = redis.cmd(&["INFO", "commandstats"]);
    info.lines()
        .find_map(|l| {
            l.strip_prefix("cmdstat_script|load:calls=")
                .or_else(|| l.strip_prefix("cmdstat_script:calls="))
        })
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn script_flush_and_redis_restart_never_reach_a_client() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[redis.url()])
        .start()
        .await;

    let req = Request::post("/orders").key("flush").body("a");
    assert_eq!(req.send(proxy.addr).await.result(), Some("MISS"));
    let _: () = redis.cmd(&["SCRIPT", "FLUSH"]);
    // A new key's claim and completion run the flushed scripts (a retry of "flush" would be
    // answered from the local cache, without Redis).
    let loads = script_loads(&redis);
    let fresh = Request::post("/orders").key("after-flush").body("c");
    let first = fresh.send(proxy.addr).await;
    assert_eq!(
        (first.status, first.result()),
        (201, Some("MISS")),
        "{}",
        first.text()
    );
    assert!(
        script_loads(&redis) > loads,
        "the proxy met NOSCRIPT and loaded its scripts again"
    );
    let replay = req.send(proxy.addr).await;
    assert_eq!((replay.status, replay.result()), (201, Some("HIT")));

    // A restart empties Redis (no persistence here) and kills every connection.
    redis.restart();
    let after = Request::post("/orders").key("after-restart").body("b");
    let first = after.send(proxy.addr).await;
    assert_eq!(
        (first.status, first.result()),
        (201, Some("MISS")),
        "{}",
        first.text()
    );
    assert_eq!(after.send(proxy.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 3);
}

#[tokio::test]
async fn proxy_starts_while_redis_is_down_and_serves_once_it_is_up() {
    let port = RedisServer::unused_port();
    let backend = Backend::start().await;
    // `start` waits for /healthz: the process must come up without Redis.
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[format!("redis://127.0.0.1:{port}")])
        .start()
        .await;
    let ready = Request::get("/readyz").send(proxy.admin).await;
    assert_eq!(ready.status, 503, "{}", ready.text());
    let req = Request::post("/orders").key("down").body("a");
    let refused = req.send(proxy.addr).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.result(), Some("UNAVAILABLE"));
    assert_eq!(backend.count(), 0, "reject must not forward unprotected");

    let _redis = RedisServer::start_on(port);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ready = Request::get("/readyz").send(proxy.admin).await;
        if ready.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {}", ready.text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(req.send(proxy.addr).await.result(), Some("MISS"));
    assert_eq!(req.send(proxy.addr).await.result(), Some("HIT"));
    proxy.log_containing("redis store not reachable yet").await;
}

#[tokio::test]
async fn a_record_another_replica_completed_is_copied_and_replayed_locally_no_longer_than_it_lives()
{
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let replica = |worker_id| {
        ProxyBuilder::new(&backend)
            .worker_id(worker_id)
            .redis(&[redis.url()])
            .idem("ttl: 8s")
            .idem("lock_ttl: 1s")
            .upstream("connect_timeout: 100ms")
            .upstream("write_timeout: 100ms")
            .upstream("read_timeout: 500ms")
            .start()
    };
    let (a, b) = (replica(1).await, replica(2).await);
    let req = Request::post("/orders")
        .key("copied-1")
        .json(r#"{"sku":"C"}"#);
    let first = req.send(a.addr).await;
    assert_eq!(first.result(), Some("MISS"));
    // Half the record's life later, B reads it from Redis once and keeps a copy.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let read = req.send(b.addr).await;
    assert_eq!((read.result(), &read.body), (Some("HIT"), &first.body));
    let before = redis.calls();
    for _ in 0..10 {
        let replay = req.send(b.addr).await;
        assert_eq!((replay.result(), &replay.body), (Some("HIT"), &first.body));
    }
    // A changed payload is judged against the copy too.
    let changed = Request::post("/orders")
        .key("copied-1")
        .json(r#"{"sku":"D"}"#);
    assert_eq!(changed.send(b.addr).await.status, 422);
    // Only the INFO command itself was added: B answered from its copy. (The harness gives
    // each proxy a fixed worker id, so no lease renewal comes in between.)
    assert_eq!(redis.calls(), before + 1, "B replayed without Redis");
    let m = b.metrics().await;
    assert_eq!(
        common::metric(&m, "idemgate_local_cache_copies_total"),
        Some(1.0)
    );
    assert!(
        common::metric(&m, "idemgate_local_cache_hits_total") >= Some(11.0),
        "{m}"
    );

    // The copy lives no longer than the record in Redis (what was left of its life when B read
    // it, not a whole route ttl from then): once Redis has dropped the record, B executes again.
    let deadline = Instant::now() + Duration::from_secs(12);
    while !redis.keys().is_empty() {
        assert!(Instant::now() < deadline, "the record never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = req.send(b.addr).await;
    assert_eq!(
        again.result(),
        Some("MISS"),
        "B replayed a copy past the record's life"
    );
    assert_eq!(backend.count(), 2);
}

/// The ESTABLISHED sockets process `pid` holds to `port`.
fn redis_sockets(pid: u32, port: u16) -> Vec<tcp::TcpSocket> {
    let inodes = tcp::inodes_of(pid);
    tcp::sockets()
        .into_iter()
        .filter(|s| s.remote_port == port && s.state == tcp::ESTABLISHED)
        .filter(|s| inodes.contains(&s.inode))
        .collect()
}

/// Every connection to Redis probes an idle peer (TCP keepalive): the purge channel only reads,
/// and a connection dropped without a reset (a NAT, a vanished host) would otherwise leave it
/// waiting for good, missing every purge from then on.
#[tokio::test]
async fn idle_redis_connections_are_kept_alive() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[redis.url()])
        .start()
        .await;
    let first = Request::post("/orders")
        .key("kept-alive")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(first.result(), Some("MISS"));
    // The store's connection and the purge channel's, both idle now.
    let deadline = Instant::now() + Duration::from_secs(10);
    let sockets = loop {
        let sockets = redis_sockets(proxy.pid(), redis.port);
        if sockets.len() >= 2 || Instant::now() > deadline {
            break sockets;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        sockets.len() >= 2,
        "store and purge connections: {sockets:?}"
    );
    // Timer 2 is the keepalive timer; an idle socket without keepalive has none (0).
    for socket in &sockets {
        assert_eq!(socket.timer, 2, "no keepalive timer: {sockets:?}");
    }
}

/// The worker id an execution id was issued under.
fn worker_of(execution_id: &str) -> u16 {
    idemgate::snowflake::decode(execution_id.parse().expect("a decimal execution id")).worker_id
}

/// The worker id of the latest execution the backend saw.
fn last_worker(backend: &Backend) -> u16 {
    let executions = backend.executions();
    let last = executions.last().expect("an execution");
    worker_of(last.execution_id.as_deref().expect("X-Idempotency-Id"))
}

/// `/admin/config`'s idempotency block.
async fn worker_id_settings(proxy: &Proxy) -> serde_json::Value {
    let config = Request::get("/admin/config").send(proxy.admin).await;
    let body: serde_json::Value = serde_json::from_slice(&config.body).expect("json");
    body["idempotency"].clone()
}

/// A proxy on `redis` that leases its worker id (3 s leases), with `pod` as its host name.
async fn leasing_proxy(backend: &Backend, redis: &[String], pod: &str) -> Proxy {
    ProxyBuilder::new(backend)
        .redis(redis)
        .no_worker_id()
        .global("worker_lease: 3s")
        .env("POD_NAME", pod)
        .start()
        .await
}

/// Waits until the proxy's lease is held and returns its worker id.
async fn leased_worker_id(proxy: &Proxy) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let settings = worker_id_settings(proxy).await;
        if settings["worker_id_leased"] == true {
            assert_eq!(settings["worker_id_source"], "lease");
            return settings["worker_id_in_use"].as_u64().expect("an id") as u16;
        }
        assert!(Instant::now() < deadline, "never leased: {settings}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn replicas_whose_host_names_hash_alike_lease_different_worker_ids_and_keep_them() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    // One pod name for both: the hashed ids are equal, as two real pod names' often are.
    let a = leasing_proxy(&backend, &[redis.url()], "orders-7d9f8b6c4-same").await;
    let id_a = leased_worker_id(&a).await;
    let b = leasing_proxy(&backend, &[redis.url()], "orders-7d9f8b6c4-same").await;
    let id_b = leased_worker_id(&b).await;
    assert_ne!(id_a, id_b);
    // The second tried the first's id, found it held and took the next one.
    assert_eq!(id_b, (id_a + 1) % 1024);

    // Execution ids go out under the leased ids.
    let first = Request::post("/orders")
        .key("lease-a")
        .body("x")
        .send(a.addr)
        .await;
    assert_eq!(first.result(), Some("MISS"));
    assert_eq!(last_worker(&backend), id_a);
    let second = Request::post("/orders")
        .key("lease-b")
        .body("x")
        .send(b.addr)
        .await;
    assert_eq!(second.result(), Some("MISS"));
    assert_eq!(last_worker(&backend), id_b);

    // The leases live in Redis for at most 3 s, hold the pod name, and are renewed: past
    // twice their length they are still there, still the same holders'.
    let key_a = format!("idemgate:worker:{id_a}");
    let key_b = format!("idemgate:worker:{id_b}");
    let holder_a: String = redis.cmd(&["HGET", &key_a, "h"]);
    let holder_b: String = redis.cmd(&["HGET", &key_b, "h"]);
    assert!(holder_a.ends_with(" orders-7d9f8b6c4-same"), "{holder_a}");
    assert_ne!(holder_a, holder_b, "each process holds its own");
    for key in [&key_a, &key_b] {
        let ttl: i64 = redis.cmd(&["PTTL", key]);
        assert!((1..=3000).contains(&ttl), "{key}: {ttl}");
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(redis.cmd::<String>(&["HGET", &key_a, "h"]), holder_a);
    assert_eq!(redis.cmd::<String>(&["HGET", &key_b, "h"]), holder_b);
    assert_eq!(leased_worker_id(&a).await, id_a);
    let metrics = a.metrics().await;
    assert!(
        metrics.contains(&format!("idemgate_worker_id {id_a}")),
        "{metrics}"
    );
    assert!(metrics.contains("idemgate_worker_id_leased 1"), "{metrics}");
    assert!(
        metrics.contains("idemgate_worker_lease_lost_total 0"),
        "{metrics}"
    );
    // Record keys and leases never mix: the record is the only other key.
    let mut keys = redis.keys();
    keys.retain(|k| !k.starts_with("idemgate:worker:"));
    assert_eq!(keys.len(), 2, "{keys:?}");
}

#[tokio::test]
async fn a_lease_another_process_took_moves_the_proxy_to_a_free_worker_id() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = leasing_proxy(&backend, &[redis.url()], "orders-taken").await;
    let id = leased_worker_id(&proxy).await;
    // As if this process had gone unrenewed past its lease and another had taken the id.
    let key = format!("idemgate:worker:{id}");
    let _: () = redis.cmd(&["HSET", &key, "h", "another process"]);

    proxy
        .log_containing("another process holds this worker id's lease")
        .await;
    let moved = leased_worker_id(&proxy).await;
    assert_ne!(moved, id);
    assert_eq!(
        redis.cmd::<String>(&["HGET", &key, "h"]),
        "another process",
        "a lease held by another is never taken over"
    );
    let ok = Request::post("/orders")
        .key("after-move")
        .body("x")
        .send(proxy.addr)
        .await;
    assert_eq!(ok.result(), Some("MISS"));
    assert_eq!(last_worker(&backend), moved);
    proxy
        .metrics_containing("idemgate_worker_lease_lost_total 1")
        .await;
}

#[tokio::test]
async fn a_proxy_started_while_redis_is_down_leases_its_worker_id_once_redis_is_up() {
    let port = RedisServer::unused_port();
    let backend = Backend::start().await;
    let url = format!("redis://127.0.0.1:{port}");
    let proxy = leasing_proxy(&backend, std::slice::from_ref(&url), "orders-early").await;
    proxy.log_containing("leasing a worker id failed").await;
    let settings = worker_id_settings(&proxy).await;
    assert_eq!(settings["worker_id_leased"], false, "{settings}");

    let redis = RedisServer::start_on(port);
    let id = leased_worker_id(&proxy).await;
    let holder: String = redis.cmd(&["HGET", &format!("idemgate:worker:{id}"), "h"]);
    assert!(holder.ends_with(" orders-early"), "{holder}");
    proxy.log_containing("worker id leased").await;
}

#[tokio::test]
async fn with_every_worker_id_leased_the_proxy_says_so_and_still_serves() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    // Held by others, and (ids 1000 and up) keys that are no lease: a string, and a hash with
    // no holder. None is ever taken over.
    let mut mset = vec!["MSET".to_string()];
    for id in 1000..1023 {
        mset.push(format!("idemgate:worker:{id}"));
        mset.push("someone".to_string());
    }
    let args: Vec<&str> = mset.iter().map(String::as_str).collect();
    let _: () = redis.cmd(&args);
    let _: () = redis.cmd(&["HSET", "idemgate:worker:1023", "other", "x"]);
    let fill =
        "for id = 0, 999 do redis.call('HSET', 'idemgate:worker:' .. id, 'h', 'someone') end";
    let _: () = redis.cmd(&["EVAL", fill, "0"]);

    let proxy = leasing_proxy(&backend, &[redis.url()], "orders-crowded").await;
    proxy
        .log_containing("all 1024 worker ids are leased by other processes")
        .await;
    let ready = Request::get("/readyz").send(proxy.admin).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    let ok = Request::post("/orders")
        .key("crowded")
        .body("x")
        .send(proxy.addr)
        .await;
    assert_eq!(ok.result(), Some("MISS"));
    proxy
        .metrics_containing("idemgate_worker_id_leased 0")
        .await;
    // Nothing was overwritten.
    assert_eq!(
        redis.cmd::<String>(&["HGET", "idemgate:worker:0", "h"]),
        "someone"
    );
    assert_eq!(
        redis.cmd::<String>(&["GET", "idemgate:worker:1000"]),
        "someone"
    );
    let other: Vec<String> = redis.cmd(&["HKEYS", "idemgate:worker:1023"]);
    assert_eq!(other, ["other"]);
}

/// A host name whose hashed worker id is `id`.
fn pod_name_hashing_to(id: u16) -> String {
    (0..)
        .map(|n| format!("orders-{n}"))
        .find(|name| idemgate::snowflake::worker_id_from_name(name) == id)
        .expect("some name hashes to every id")
}

#[tokio::test]
async fn a_worker_id_redis_refuses_is_passed_over_and_an_acl_refusal_is_no_lease_held_elsewhere() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    // The record rights, but lease keys only for ids of two digits or more.
    let user = [
        "ACL",
        "SETUSER",
        "narrow",
        "on",
        ">narrow-password",
        "~idemgate:{*",
        "~idemgate:worker:??*",
    ];
    let _: () = redis.cmd(&[&user[..], &common::redis::SCRIPT_RIGHTS[..]].concat());
    let url = format!("redis://narrow:narrow-password@127.0.0.1:{}", redis.port);
    // Its first choice, 9, is refused (and nothing answered before it: the search stops, one
    // deadline, as when Redis is down); the next search goes on from 10, which Redis grants.
    let proxy = leasing_proxy(
        &backend,
        std::slice::from_ref(&url),
        &pod_name_hashing_to(9),
    )
    .await;
    assert_eq!(leased_worker_id(&proxy).await, 10);
    proxy
        .metrics_containing("idemgate_worker_lease_failures_total 1")
        .await;

    // A refusal is reported with its cause, never taken for an id held by another process.
    let refused = leasing_proxy(
        &backend,
        std::slice::from_ref(&url),
        &pod_name_hashing_to(0),
    )
    .await;
    let log = refused.log_containing("leasing a worker id failed").await;
    assert!(log.contains("no permissions"), "{log}");
    assert!(!log.contains("are leased by other processes"), "{log}");
    assert_eq!(
        worker_id_settings(&refused).await["worker_id_leased"],
        false
    );
}

#[tokio::test]
async fn a_lease_that_cannot_be_renewed_stops_counting_as_leased_once_it_may_have_run_out() {
    let mut redis = RedisServer::start();
    let backend = Backend::start().await;
    let proxy = leasing_proxy(&backend, &[redis.url()], "orders-cut-off").await;
    let id = leased_worker_id(&proxy).await;
    redis.kill();
    // Renewals fail from now on; the 3 s lease runs out in Redis's eyes within 3 s.
    proxy
        .metrics_containing("idemgate_worker_id_leased 0")
        .await;
    let settings = worker_id_settings(&proxy).await;
    assert_eq!(
        settings["worker_id_in_use"], id,
        "the id is kept: {settings}"
    );
    redis.restart();
    // The first renewal that gets through takes the (now free) id again.
    assert_eq!(leased_worker_id(&proxy).await, id);
}

#[tokio::test]
async fn the_lease_is_renewed_while_requests_drain_after_sigterm() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let mut proxy = leasing_proxy(&backend, &[redis.url()], "orders-draining").await;
    let id = leased_worker_id(&proxy).await;
    let key = format!("idemgate:worker:{id}");
    let slow = Request::post("/orders/slow/6000")
        .key("drain-lease")
        .body("x")
        .spawn_send(proxy.addr);
    backend.until_count(1).await;
    proxy.signal("TERM");
    // Past the 3 s lease counted from any renewal before the SIGTERM: still held, renewed.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(proxy.exited().is_none(), "still draining");
    let holder: Option<String> = redis.cmd(&["HGET", &key, "h"]);
    assert!(
        holder.is_some_and(|h| h.ends_with(" orders-draining")),
        "the lease ran out while requests still drained"
    );
    let answered = slow.await.expect("request task");
    assert_eq!(answered.result(), Some("MISS"));
    assert_eq!(last_worker(&backend), id);
    let status = proxy.wait_exit(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn a_request_drained_at_sigterm_is_stored_for_the_other_replicas() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let mut instances = proxies(&backend, &[redis.url()], 2, &[]).await;
    let req = Request::post("/orders/gate/drained")
        .key("drained")
        .body("{}");
    let inflight = req.spawn_send(instances[0].addr);
    backend.until_count(1).await;
    let draining = instances[0].addr;
    instances[0].signal("TERM");
    // Draining: new connections are refused while the request in flight still runs (until
    // the test lets it answer).
    assert!(
        common::client::refused_while(draining, &inflight).await,
        "a new connection was still accepted when the drain ended"
    );
    backend.open("drained");
    let answered = inflight.await.unwrap();
    assert_eq!((answered.status, answered.result()), (201, Some("MISS")));
    let status = instances[0]
        .wait_exit(Duration::from_secs(10))
        .expect("exits once drained");
    assert!(status.success(), "{status:?}");
    // The record reached Redis before the exit: the other replica replays it.
    let replay = req.send(instances[1].addr).await;
    assert_eq!((replay.status, replay.result()), (201, Some("HIT")));
    assert_eq!(replay.body, answered.body);
    assert_eq!(backend.count(), 1);
}

/// An answer too large to keep is recorded on Redis as executed, not replayable: a retry on
/// another replica, and one on the replica that ran it, gets 409 `response-not-replayable`; a
/// changed body under the key gets 422; the key never runs twice.
#[tokio::test]
async fn a_response_too_large_to_keep_is_never_run_again_on_any_replica() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let instances = proxies(&backend, &[redis.url()], 2, &["max_response_bytes: 1KiB"]).await;
    let req = Request::post("/orders/large/5000")
        .key("too-large")
        .body("{}");
    let first = req.send(instances[0].addr).await;
    assert_eq!((first.status, first.result()), (200, Some("MISS")));
    assert_eq!(
        first.body.len(),
        5000,
        "streamed whole to the client that ran it"
    );
    for (i, instance) in [&instances[1], &instances[0]].into_iter().enumerate() {
        let again = req.send(instance.addr).await;
        assert_eq!(again.status, 409, "retry {i}: {}", again.text());
        assert_eq!(again.problem_type(), "response-not-replayable", "retry {i}");
    }
    let changed = Request::post("/orders/large/5000")
        .key("too-large")
        .body("{\"other\":1}")
        .send(instances[1].addr)
        .await;
    assert_eq!(changed.status, 422, "{}", changed.text());
    assert_eq!(backend.count(), 1);
}

/// A Redis that may evict records (a memory limit under a policy other than `noeviction`) is
/// warned of once connected, and `idemgate_store_redis_may_evict` is 1; on one that may not,
/// it is 0 and nothing is said.
#[tokio::test]
async fn a_redis_that_may_evict_records_is_warned_of() {
    let evicting =
        RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru"]);
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[evicting.url()])
        .start()
        .await;
    let log = proxy.log_containing("redis may evict records").await;
    assert!(
        log.contains("maxmemory-policy volatile-lru with maxmemory 67108864"),
        "{log}"
    );
    proxy
        .metrics_containing("idemgate_store_redis_may_evict 1")
        .await;

    let safe = RedisServer::start();
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[safe.url()])
        .start()
        .await;
    proxy
        .metrics_containing("idemgate_store_redis_may_evict 0")
        .await;
    let log = proxy.log_written().await;
    assert!(!log.contains("may evict"), "{log}");
}

/// A rolling restart, as a Deployment rollout does it, under steady keys and their retries:
/// three replicas that lease their worker ids are replaced one by one by new pods (new names),
/// each old one taken out of the rotation, then sent SIGTERM and drained. Every key runs once
/// and its retry, sent to the next replica in the rotation, replays it; no execution id appears
/// under two keys (the new pods lease ids of their own, or an old pod's once its lease ran out,
/// after its last id); every old pod exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_runs_every_key_once() {
    use std::sync::{Arc, Mutex};

    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let urls = [redis.url()];
    let mut old = Vec::new();
    for pod in ["orders-old-a", "orders-old-b", "orders-old-c"] {
        let proxy = leasing_proxy(&backend, &urls, pod).await;
        leased_worker_id(&proxy).await;
        old.push(proxy);
    }
    let rotation = Arc::new(Mutex::new(old.iter().map(|p| p.addr).collect::<Vec<_>>()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = tokio::spawn({
        let (rotation, stop) = (rotation.clone(), stop.clone());
        async move {
            let mut sent = Vec::new();
            let pick = |n: usize| {
                let addrs = rotation.lock().unwrap();
                addrs[n % addrs.len()]
            };
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let key = format!("rollout-{n}");
                let req = Request::post("/orders").key(&key).body("{}");
                let first = req.send(pick(n)).await;
                let retry = req.send(pick(n + 1)).await;
                sent.push((key, first, retry));
                n += 1;
            }
            sent
        }
    });

    let mut new = Vec::new();
    for (i, mut proxy) in old.into_iter().enumerate() {
        let replacement = leasing_proxy(&backend, &urls, &format!("orders-new-{i}")).await;
        leased_worker_id(&replacement).await;
        {
            let mut addrs = rotation.lock().unwrap();
            addrs.retain(|a| *a != proxy.addr);
            addrs.push(replacement.addr);
        }
        new.push(replacement);
        // Endpoints take a moment to leave every client; then the pod is told to stop.
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.signal("TERM");
        let status = tokio::task::spawn_blocking(move || proxy.wait_exit(Duration::from_secs(30)))
            .await
            .expect("wait")
            .expect("the old pod exits");
        assert!(status.success(), "{status:?}");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = load.await.expect("load");

    assert!(sent.len() >= 20, "only {} keys", sent.len());
    for (key, first, retry) in &sent {
        assert_eq!(
            (first.result(), retry.result()),
            (Some("MISS"), Some("HIT")),
            "{key}: {} / {}",
            first.text(),
            retry.text()
        );
        assert_eq!(retry.body, first.body, "{key}");
    }
    backend.assert_each_id_ran_once();
    assert_eq!(backend.count(), sent.len(), "each key ran once");
    eprintln!("{} keys and their retries through the rollout", sent.len());
}

/// A replica that dies while its request runs cannot record anything: its lock lapses, and the
/// retry that takes the key over on another replica runs it again, under the same
/// `X-Idempotency-Id`, whatever `on_outcome_unknown` says (the store cannot tell a dead
/// replica's lock from one whose request never went out). The takeover is logged and counted,
/// so an operator can check the backend.
#[tokio::test]
async fn a_key_whose_replica_died_mid_request_runs_again_and_is_reported() {
    let redis = RedisServer::start();
    for mode in ["settle", "lapse"] {
        let backend = Backend::start().await;
        let mut replicas = Vec::new();
        for worker_id in [1, 2] {
            let replica = ProxyBuilder::new(&backend)
                .worker_id(worker_id)
                .redis(&[redis.url()])
                .idem("lock_ttl: 1500ms")
                .idem(&format!("on_outcome_unknown: {mode}"))
                .upstream("connect_timeout: 100ms")
                .upstream("write_timeout: 100ms")
                .upstream("read_timeout: 1s")
                .start()
                .await;
            replicas.push(replica);
        }
        let survivor = replicas.pop().expect("two replicas");
        let doomed = replicas.pop().expect("two replicas");
        let key = format!("died-{mode}");
        let req = Request::post("/orders/gate/died").key(&key).body("{}");
        let first = req.spawn_send(doomed.addr);
        backend.until_count(1).await;
        // SIGKILL mid-request: nothing renews or settles the claim from now on.
        drop(doomed);
        let _ = first.await;
        backend.open("died");
        tokio::time::sleep(Duration::from_millis(1800)).await;

        let retry = req.send(survivor.addr).await;
        assert_eq!(
            (retry.status, retry.result()),
            (201, Some("MISS")),
            "{mode}: {}",
            retry.text()
        );
        let ids: Vec<_> = backend
            .executions()
            .into_iter()
            .map(|e| e.execution_id)
            .collect();
        assert_eq!(ids.len(), 2, "{mode}");
        assert_eq!(ids[0], ids[1], "{mode}: the same X-Idempotency-Id");
        survivor
            .log_containing("took over a key whose earlier execution's lock lapsed")
            .await;
        let m = survivor.metrics().await;
        assert_eq!(
            common::metric(&m, "idemgate_lapsed_takeovers_total{route=\"orders\"}"),
            Some(1.0),
            "{mode}: {m}"
        );
        // The replay is the second run's.
        let again = req.send(survivor.addr).await;
        assert_eq!(again.result(), Some("HIT"), "{mode}");
    }
}
