//! The admin record API: inspect and purge a key, token required for purges, and a purge that
//! reaches every replica's local cache (on one server, and behind Sentinel across a failover).

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::faultproxy::{Fault, FaultProxy};
use common::redis::{RedisSentinel, RedisServer};
use common::{Backend, Proxy, ProxyBuilder, Request};

const TOKEN: &str = "admin-token-for-tests-0123456789";

/// `/metrics` is Prometheus' text format (0.0.4): its content type, a `# HELP` and `# TYPE`
/// for every family, every sample a family's (a histogram's `_bucket`, `_sum` and `_count`,
/// with a `+Inf` bucket), every value a number.
#[tokio::test]
async fn metrics_are_prometheus_text() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let req = Request::post("/orders").key("m-1").body("{}");
    assert_eq!(req.send(proxy.addr).await.result(), Some("MISS"));
    let m = Request::get("/metrics").send(proxy.admin).await;
    assert_eq!(m.status, 200);
    assert_eq!(m.header("content-type"), Some("text/plain; version=0.0.4"));
    let text = m.text();
    let mut types = std::collections::HashMap::new();
    let mut helped = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(
                types.insert(name.to_owned(), kind.to_owned()).is_none(),
                "twice: {line}"
            );
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split(' ').next().unwrap_or_default().to_owned());
        }
    }
    let mut samples = 0;
    let mut infinite_buckets = std::collections::HashSet::new();
    // In order: a family's # TYPE before its samples, and its samples together.
    let mut typed_so_far = std::collections::HashSet::new();
    let mut families_done = std::collections::HashSet::new();
    let mut current = String::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed_so_far.insert(rest.split(' ').next().unwrap_or_default().to_owned());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("series value");
        assert!(value.parse::<f64>().is_ok(), "not a number: {line}");
        let name = series.split('{').next().unwrap_or_default();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = name.strip_suffix(suffix)?;
                (types.get(base).map(String::as_str) == Some("histogram")).then_some(base)
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "no # TYPE for {line}");
        assert!(
            typed_so_far.contains(family),
            "# TYPE after the sample: {line}"
        );
        if family != current {
            assert!(
                families_done.insert(family.to_owned()),
                "{family}'s samples are not together: {line}"
            );
            current = family.to_owned();
        }
        assert!(helped.contains(family), "no # HELP for {line}");
        assert!(family.starts_with("idemgate_"), "{line}");
        if name.ends_with("_bucket") && series.contains("le=\"+Inf\"") {
            infinite_buckets.insert(family.to_owned());
        }
        samples += 1;
    }
    assert!(samples > 50, "{text}");
    for (name, kind) in &types {
        if kind == "histogram" && text.contains(&format!("{name}_count")) {
            assert!(infinite_buckets.contains(name), "{name} has no +Inf bucket");
        }
    }
}

#[tokio::test]
async fn inspect_and_purge_a_record() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let req = Request::post("/orders")
        .key("order/42")
        .header("Authorization", "Bearer alice")
        .body("{\"a\":1}");
    assert_eq!(req.send(proxy.addr).await.result(), Some("MISS"));

    let path = "/admin/records/default/order%2F42";
    let as_alice = |r: Request| r.header("X-Idemgate-Scope-Authorization", "Bearer alice");
    let view = as_alice(Request::get(path)).send(proxy.admin).await;
    assert_eq!(view.status, 200, "{}", view.text());
    let v: serde_json::Value = serde_json::from_slice(&view.body).unwrap();
    assert_eq!(v["state"], "completed");
    assert_eq!(v["status"], 201);
    assert_eq!(v["replayable"], true);
    // How much longer retries replay it: within the route's ttl (24 h by default).
    let left = v["expires_in_ms"].as_u64().expect("expires_in_ms");
    assert!(left > 0 && left <= 24 * 3600 * 1000, "{left}");
    assert!(v.get("body_base64").is_none(), "no body unless asked");
    assert!(v["created_at_unix_ms"].as_u64().unwrap() > 1_700_000_000_000);
    let exec = backend.executions()[0].execution_id.clone().unwrap();
    assert_eq!(v["execution_id"], exec);
    // The fingerprint (a hash of the body, among others: guesses at it could be tried
    // offline) only with the admin token, as is a match against it.
    assert!(v.get("fingerprint").is_none(), "{v}");
    let with_token = as_alice(Request::get(path))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    let trusted: serde_json::Value = serde_json::from_slice(&with_token.body).unwrap();
    let fp = trusted["fingerprint"].as_str().unwrap().to_string();
    let matched = as_alice(Request::get(&format!("{path}?fingerprint={fp}")))
        .send(proxy.admin)
        .await;
    assert_eq!(matched.status, 401, "{}", matched.text());
    // The same record by its id (the 64 hex digits dead-letter lines carry), no key needed.
    let id = v["record"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 64);
    let by_id = Request::get(&format!("/admin/record-ids/default/{id}"))
        .send(proxy.admin)
        .await;
    assert_eq!(by_id.status, 200, "{}", by_id.text());
    // The same view, but for the time left, read a moment later.
    let without_time = |mut v: serde_json::Value| {
        v.as_object_mut().unwrap().remove("expires_in_ms");
        v
    };
    assert_eq!(
        without_time(serde_json::from_slice(&by_id.body).unwrap()),
        without_time(v.clone())
    );
    // The stored body only with the admin token, by key as by id.
    let body_path = format!("{path}?body=true&fingerprint={fp}");
    let without_token = as_alice(Request::get(&body_path)).send(proxy.admin).await;
    assert_eq!(without_token.status, 401, "{}", without_token.text());
    let with_body = as_alice(Request::get(&body_path))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(with_body.status, 200, "{}", with_body.text());
    let v: serde_json::Value = serde_json::from_slice(&with_body.body).unwrap();
    assert!(v["body_base64"].as_str().is_some());
    assert_eq!(v["fingerprint_matches"], true);

    // Another principal's view of the same key is another record.
    let bob = Request::get(path).header("X-Idemgate-Scope-Authorization", "Bearer bob");
    assert_eq!(bob.send(proxy.admin).await.status, 404);

    // Purging needs the token; a purged key executes again.
    let purge = |del: Request| async {
        assert_eq!(del.clone().send(proxy.admin).await.status, 401);
        let ok = del
            .header("Authorization", format!("Bearer {TOKEN}"))
            .send(proxy.admin)
            .await;
        assert_eq!(ok.status, 200, "{}", ok.text());
        assert!(ok.text().contains("\"deleted\": true"));
        assert_eq!(
            req.send(proxy.addr).await.result(),
            Some("MISS"),
            "executes again"
        );
    };
    purge(as_alice(Request::new("DELETE", path))).await;
    assert_eq!(backend.count(), 2);
    // Purged by its id too.
    let by_id = format!("/admin/record-ids/default/{id}");
    purge(Request::new("DELETE", &by_id)).await;
    assert_eq!(backend.count(), 3);
    let again = Request::get(&by_id).send(proxy.admin).await;
    assert_eq!(again.status, 200, "the record of the new execution");
    // Malformed input is a clear 400.
    let bad = Request::get("/admin/records/bad%7Btenant/k")
        .send(proxy.admin)
        .await;
    assert_eq!(bad.status, 400);
}

#[tokio::test]
async fn a_purge_drops_the_local_copy_on_every_replica() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let (a, b) = two_replicas(&backend, &redis.url()).await;
    redis.until_purge_listeners(2).await;
    purge_reaches_the_other_replica(&a, &b, "purge-me").await;
    assert_eq!(backend.count(), 2);
}

/// A delete whose answer is lost (Redis takes it after the store operation gave up) may have
/// landed: it is announced all the same, so no replica goes on replaying a record that is gone.
#[tokio::test]
async fn a_purge_whose_answer_was_lost_still_drops_the_copies() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    // B, which purges, reaches Redis through a link that can be slowed.
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let (a, b) = two_replicas_at(&backend, &redis.url(), &link.redis_url()).await;
    redis.until_purge_listeners(2).await;
    let req = Request::post("/orders").key("lost-answer").body("{}");
    let first = req.send(a.addr).await;
    assert_eq!(first.result(), Some("MISS"));
    assert_eq!(
        req.send(a.addr).await.result(),
        Some("HIT"),
        "A's local copy"
    );

    // A first purge (of a key never used) has Redis load the purge script, so the slowed one
    // below is one call.
    let warm = Request::new("DELETE", "/admin/records/default/never-used")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(b.admin)
        .await;
    assert_eq!(warm.status, 200, "{}", warm.text());
    // Every byte between B and Redis takes 600 ms each way: B's delete gives up after its
    // response timeout (200 ms), Redis deletes the record at 600 ms, and the announcement
    // (which waits up to 2 s for its answer) is delivered.
    link.set(Fault::Delay(Duration::from_millis(600)));
    let del = Request::new("DELETE", "/admin/records/default/lost-answer")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(b.admin)
        .await;
    assert_eq!(del.status, 503, "{}", del.text());
    assert!(del.text().contains("may have landed"), "{}", del.text());
    assert!(
        del.text().contains("2 replicas listening"),
        "{}",
        del.text()
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while redis.cmd::<i64>(&["DBSIZE"]) != 0 {
        assert!(Instant::now() < deadline, "the delete never landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A drops its copy as its listener takes the announcement: from then on the key executes
    // again instead of replaying a record that is gone. (Until then it replays its copy.)
    let deadline = Instant::now() + Duration::from_secs(5);
    let again = loop {
        let r = req.send(a.addr).await;
        if r.result() == Some("MISS") {
            break r;
        }
        assert_eq!((r.result(), &r.body), (Some("HIT"), &first.body));
        assert!(
            Instant::now() < deadline,
            "A still replays the purged record\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(again.body, first.body);
    assert_eq!(backend.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_reaches_every_replica_behind_sentinel_across_a_failover() {
    let setup = RedisSentinel::start();
    let backend = Backend::start().await;
    let (a, b) = two_replicas(&backend, &setup.url()).await;
    // Both listeners subscribe on the primary the Sentinel names.
    setup.primary.until_purge_listeners(2).await;
    purge_reaches_the_other_replica(&a, &b, "sentinel-purge-1").await;

    setup.fail_over();
    // B now publishes on the new primary. The listeners stay subscribed on the demoted one (a
    // failover drops normal clients, not subscribers), which hears the purge once it replicates
    // from the new primary: Redis replicates PUBLISH. A listener whose server went away finds the
    // new primary through the Sentinel instead.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = setup.primary.cmd(&["INFO", "replication"]);
        if info.contains("role:slave") && info.contains("master_link_status:up") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "old primary never followed: {info}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    purge_reaches_the_other_replica(&a, &b, "sentinel-purge-2").await;
    assert_eq!(backend.count(), 4);
}

#[tokio::test]
async fn a_purge_missed_while_the_channel_was_down_leaves_no_copy_replaying() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    let (a, b) = two_replicas(&backend, &redis.url()).await;
    redis.until_purge_listeners(2).await;
    let req = Request::post("/orders").key("missed-purge").body("{}");
    let first = req.send(a.addr).await;
    assert_eq!(first.result(), Some("MISS"));
    let copied = req.send(b.addr).await;
    assert_eq!((copied.result(), &copied.body), (Some("HIT"), &first.body));

    // Both replicas' purge channels drop, and the record goes while nobody listens (as a purge
    // published at that moment would be missed).
    for replica in [&a, &b] {
        let m = replica.metrics().await;
        assert!(m.contains("idemgate_purge_channel_subscribed 1"), "{m}");
        assert!(m.contains("idemgate_purge_channel_losses_total 0"), "{m}");
    }
    let killed: i64 = redis.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert_eq!(killed, 2);
    let keys = redis.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let _: i64 = redis.cmd(&["DEL", &keys[0]]);
    redis.until_purge_listeners(2).await;
    // Listening again, B no longer trusts the copy it read before: it asks Redis, finds
    // nothing, and executes.
    let deadline = Instant::now() + Duration::from_secs(5);
    let second = loop {
        let r = req.send(b.addr).await;
        if r.result() == Some("MISS") {
            break r;
        }
        assert_eq!(r.body, first.body);
        assert!(
            Instant::now() < deadline,
            "B still replays its copy of a record gone from Redis"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(backend.count(), 2);
    b.log_containing("dropped the local copies").await;
    // Each loss is counted and logged (once), and the channel is up again.
    for replica in [&a, &b] {
        let m = replica
            .metrics_containing("idemgate_purge_channel_subscribed 1")
            .await;
        assert!(m.contains("idemgate_purge_channel_losses_total 1"), "{m}");
        let log = replica.log_containing("purge channel lost").await;
        assert_eq!(log.matches("purge channel lost").count(), 1, "{log}");
    }
    // A completed the record itself and Redis took it: listening again, A drops it as well,
    // and replays what Redis holds now (B's execution), not the answer that was purged.
    loop {
        let r = req.send(a.addr).await;
        if r.body != first.body {
            assert_eq!((r.result(), &r.body), (Some("HIT"), &second.body));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "A still replays its own completion of a record gone from Redis"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(backend.count(), 2);
    a.log_containing("dropped the local copies").await;
}

async fn two_replicas(backend: &Backend, url: &str) -> (Proxy, Proxy) {
    two_replicas_at(backend, url, url).await
}

/// [`two_replicas`] reaching Redis at `a_url` and `b_url` (one through a fault proxy, say).
async fn two_replicas_at(backend: &Backend, a_url: &str, b_url: &str) -> (Proxy, Proxy) {
    let a = ProxyBuilder::new(backend)
        .redis(&[a_url.to_owned()])
        .start()
        .await;
    let b = ProxyBuilder::new(backend)
        .redis(&[b_url.to_owned()])
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    (a, b)
}

/// A purge listener whose connection died silently (a load balancer dropped the idle flow: no
/// FIN, no RST, nothing delivered) notices at its next heartbeat, subscribes again, and hears
/// the purges that follow.
#[tokio::test]
async fn a_purge_listener_whose_connection_died_silently_subscribes_again() {
    let redis = RedisServer::start();
    let link = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let backend = Backend::start().await;
    let (a, b) = two_replicas_at(&backend, &link.redis_url(), &redis.url()).await;
    redis.until_purge_listeners(2).await;
    link.strand();
    // Redis still counts A's first subscription (its end of that flow is open): a third
    // listener is A on a new connection.
    redis.until_purge_listeners(3).await;
    purge_reaches_the_other_replica(&a, &b, "after-the-drop").await;
}

/// A executes `key` and keeps it in its local cache; B purges it; A must then execute it again
/// rather than replay its local copy, and B replays that new execution from Redis.
async fn purge_reaches_the_other_replica(a: &Proxy, b: &Proxy, key: &str) {
    let req = Request::post("/orders").key(key).body("{}");
    // Right after a failover the store may answer 503 until it follows the Sentinel.
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = loop {
        let r = req.send(a.addr).await;
        match r.result() {
            Some("MISS") => break r,
            other => assert!(Instant::now() < deadline, "first execution: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        req.send(a.addr).await.result(),
        Some("HIT"),
        "served from A's local cache"
    );
    // B reads the record from Redis and keeps a copy of it.
    let copies =
        || async { common::metric(&b.metrics().await, "idemgate_local_cache_copies_total") };
    let before = copies().await.expect("copies counted");
    let copied = req.send(b.addr).await;
    assert_eq!((copied.result(), &copied.body), (Some("HIT"), &first.body));
    assert_eq!(copies().await, Some(before + 1.0), "B copied the record");
    let path = format!("/admin/records/default/{key}");
    let del = loop {
        let del = Request::new("DELETE", &path)
            .header("Authorization", format!("Bearer {TOKEN}"))
            .send(b.admin)
            .await;
        if del.status == 200 || Instant::now() >= deadline {
            break del;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(del.status, 200, "{}", del.text());
    assert!(del.text().contains("replicas listening"), "{}", del.text());
    let deadline = Instant::now() + Duration::from_secs(5);
    let second = loop {
        let r = req.send(a.addr).await;
        if r.result() == Some("MISS") {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "A still replays the purged record {key}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(second.body, first.body, "a second execution");
    // B's copy went with the purge: it replays the second execution, not its copy of the first.
    let replay = req.send(b.addr).await;
    assert_eq!((replay.result(), &replay.body), (Some("HIT"), &second.body));
}

#[tokio::test]
async fn malformed_record_requests_are_refused_with_the_reason() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let cases = [
        ("/admin/records/default", 404, "use /admin/records/"),
        ("/admin/records/default/k%zz", 400, "percent-encoding"),
        // `%+1` is not an escape (the radix parser alone would read it as 0x01).
        ("/admin/records/default/k%+1", 400, "percent-encoding"),
        ("/admin/records/default/%22secret-key", 400, "malformed"),
        (
            "/admin/records/default/a%0Ab",
            400,
            "not a valid header value",
        ),
        ("/admin/records/default/a%20b", 400, "outside visible ASCII"),
        (
            "/admin/records/default/k?route=plain",
            404,
            "no such idempotent route",
        ),
        (
            "/admin/records/default/k?route=nope",
            404,
            "no such idempotent route",
        ),
        ("/admin/record-ids/default", 404, "use /admin/record-ids/"),
        ("/admin/record-ids/default/abcd", 400, "64 hex digits"),
        ("/admin/record-ids/default/secret-key", 400, "64 hex digits"),
        (
            &format!("/admin/record-ids/bad%7Btenant/{}", "ab".repeat(32)),
            400,
            "tenant",
        ),
        (
            &format!("/admin/record-ids/default/{}", "ab".repeat(32)),
            404,
            "no such record",
        ),
    ];
    for (path, status, reason) in cases {
        let r = Request::get(path).send(proxy.admin).await;
        assert_eq!(r.status, status, "{path}: {}", r.text());
        assert!(r.text().contains(reason), "{path}: {}", r.text());
        assert!(!r.text().contains("secret-key"), "{path} echoes the key");
    }
    // No token configured: every mutation is refused, whatever bearer is offered.
    let del = Request::new("DELETE", "/admin/records/default/k")
        .header("Authorization", "Bearer ")
        .send(proxy.admin)
        .await;
    assert_eq!(del.status, 401);
    // The memory store has no scripts to show.
    let scripts = Request::get("/admin/scripts").send(proxy.admin).await;
    assert_eq!(scripts.status, 404);
    assert!(scripts.text().contains("not redis"), "{}", scripts.text());
}

/// The admin API's errors are problem documents like every error the proxy makes, a method an
/// endpoint does not take is a 405 naming the ones it does, and query values are
/// percent-decoded.
#[tokio::test]
async fn admin_errors_are_problems_and_query_values_are_decoded() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let cases = [
        (
            "GET",
            "/admin/records/default/k?route=nope",
            404,
            "admin-not-found",
        ),
        (
            "GET",
            "/admin/records/default/k%zz",
            400,
            "admin-request-invalid",
        ),
        ("GET", "/no/such/endpoint", 404, "admin-not-found"),
        (
            "DELETE",
            "/admin/records/default/k",
            401,
            "admin-unauthorized",
        ),
        (
            "POST",
            "/admin/records/default/k",
            405,
            "admin-method-not-allowed",
        ),
        ("GET", "/admin/reload", 405, "admin-method-not-allowed"),
        ("DELETE", "/metrics", 405, "admin-method-not-allowed"),
    ];
    for (method, path, status, kind) in cases {
        let r = Request::new(method, path).send(proxy.admin).await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.text());
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{method} {path}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(doc["type"], format!("https://idemgate.dev/problems/{kind}"));
        assert_eq!(doc["status"], status);
        assert!(doc["detail"].is_string(), "{doc}");
        assert_eq!(
            doc["error"], doc["detail"],
            "the member clients read before"
        );
    }
    let r = Request::new("POST", "/admin/record-ids/default/k")
        .send(proxy.admin)
        .await;
    assert_eq!(r.header("allow"), Some("GET, HEAD, DELETE"));
    let r = Request::get("/admin/reload").send(proxy.admin).await;
    assert_eq!(r.header("allow"), Some("POST"));
    // `ord%65rs` is `orders`: the route is found, and the record is not.
    let r = Request::get("/admin/records/default/k?route=ord%65rs")
        .send(proxy.admin)
        .await;
    assert_eq!(r.status, 404);
    assert!(r.text().contains("no such record"), "{}", r.text());
}

#[tokio::test]
async fn the_admin_listener_holds_request_headers_to_request_header_timeout() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_header_timeout: 500ms")
        .start()
        .await;
    // A scraper's kept-alive connection serves request after request, however far apart.
    let mut s = tokio::net::TcpStream::connect(proxy.admin).await.unwrap();
    for _ in 0..2 {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let r = common::client::read_response(&mut s, false).await.unwrap();
        assert_eq!(r.status, 200);
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    // A header trickled a byte every 100 ms, each inside pingora's per-read timeout, is cut
    // off once the whole of it is late.
    let (got, elapsed, _) = common::client::trickle_header(
        proxy.admin,
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nX-Slow: ",
    )
    .await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 408 ") && text.contains("/problems/request-header-timeout"),
        "{text}"
    );
    assert!(elapsed >= Duration::from_millis(500));
    // Counted as the admin listener's, not the proxy's.
    let metrics = proxy
        .metrics_containing(
            r#"idemgate_request_headers_refused_total{listener="admin",reason="timeout"} 1"#,
        )
        .await;
    assert!(
        metrics.contains(
            r#"idemgate_request_headers_refused_total{listener="proxy",reason="timeout"} 0"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_record_in_flight_is_purged_only_on_purpose() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let running = Request::post("/orders/slow/1500")
        .key("purge-running")
        .body("{}")
        .spawn_send(proxy.addr);
    backend.until_count(1).await;
    let purge = |query: &str| {
        Request::new(
            "DELETE",
            &format!("/admin/records/default/purge-running{query}"),
        )
        .header("Authorization", format!("Bearer {TOKEN}"))
    };
    let refused = purge("").send(proxy.admin).await;
    assert_eq!(refused.status, 409, "{}", refused.text());
    assert_eq!(refused.problem_type(), "admin-record-in-flight");
    // Still held: a retry is a conflict, not a second execution.
    let retry = Request::post("/orders/slow/1500")
        .key("purge-running")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(retry.status, 409);
    let forced = purge("?force=true").send(proxy.admin).await;
    assert_eq!(forced.status, 200, "{}", forced.text());
    let answer: serde_json::Value = serde_json::from_slice(&forced.body).unwrap();
    assert_eq!(answer["deleted"], true);
    proxy
        .log_containing("record purged through the admin API")
        .await;
    assert_eq!(running.await.unwrap().status, 201);
    assert_eq!(backend.count(), 1);
}

/// Every `idemgate_…` name in `text`, histogram series (`_bucket`, `_count`, `_sum`) by their
/// family's name.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("idemgate_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        names.insert(family.to_owned());
    }
    names
}

/// The example alerting rules name only metrics idemgate defines (a renamed metric would leave
/// an alert that never fires), and each rule has an expression and a severity.
#[test]
fn the_example_alerts_name_only_metrics_idemgate_defines() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut source = String::new();
    let mut dirs = vec![root.join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                source.push_str(&std::fs::read_to_string(&path).expect("source"));
            }
        }
    }
    // Names as the code defines them: string literals.
    let defined: std::collections::BTreeSet<String> = metric_names(&source)
        .into_iter()
        .filter(|n| source.contains(&format!("\"{n}\"")))
        .collect();
    let text = std::fs::read_to_string(root.join("examples/prometheus/idemgate-alerts.yaml"))
        .expect("alerts file");
    let used = metric_names(&text);
    assert!(used.len() > 10, "{used:?}");
    let unknown: Vec<_> = used.difference(&defined).collect();
    assert!(unknown.is_empty(), "not defined by idemgate: {unknown:?}");

    let rules: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
    let rules = rules["groups"][0]["rules"]
        .as_sequence()
        .expect("groups[0].rules");
    for rule in rules {
        let name = rule["alert"].as_str().expect("alert name");
        assert!(rule["expr"].as_str().is_some(), "{name}: expr");
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("page" | "ticket")),
            "{name}: {severity:?}"
        );
        // Every rule says where its runbook is, and that page has that section.
        let url = rule["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no runbook_url"));
        let (page, anchor) = url.split_once('#').unwrap_or((url, ""));
        let doc = std::fs::read_to_string(root.join(page))
            .unwrap_or_else(|e| panic!("{name}: {page}: {e}"));
        if !anchor.is_empty() {
            let found = doc
                .lines()
                .filter_map(|l| l.strip_prefix('#'))
                .map(|h| heading_anchor(h.trim_start_matches('#')))
                .any(|a| a == anchor);
            assert!(found, "{name}: no section #{anchor} in {page}");
        }
    }
}

/// Every counter an alert rule takes `increase()` or `rate()` of is exported from the start by a
/// proxy on Redis that has served nothing yet, with each label value the rule selects (and a
/// route label for each route): Prometheus sees a first event only as a step from an earlier
/// sample, so a series born at its first event (at 1) would never fire the rule for it.
#[tokio::test]
async fn every_counter_the_alerts_watch_is_exported_before_its_first_event() {
    let redis = RedisServer::start();
    let backend = Backend::start().await;
    // No worker id in the config: it is leased from Redis, as in production.
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[redis.url()])
        .no_worker_id()
        .start()
        .await;
    let metrics = proxy
        .metrics_containing("idemgate_worker_lease_lost_total")
        .await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/prometheus/idemgate-alerts.yaml"))
        .expect("alerts file");
    let mut checked = 0;
    for function in ["increase(", "rate("] {
        for (at, _) in text.match_indices(function) {
            let rest = &text[at + function.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // The label values the selector needs: `l="v"` one, `l=~"a|b"` each of them.
            let mut needed = vec![String::new()];
            if let Some(selector) = rest[name.len()..].strip_prefix('{') {
                let selector = &selector[..selector.find('}').expect("closing brace")];
                for matcher in selector.split(',') {
                    if let Some((label, values)) = matcher.split_once("=~") {
                        needed = values
                            .trim_matches('"')
                            .split('|')
                            .map(|v| format!("{}=\"{v}\"", label.trim()))
                            .collect();
                    } else if let Some((label, value)) = matcher.split_once('=') {
                        if !label.ends_with('!') {
                            needed = vec![format!("{}={value}", label.trim())];
                        }
                    }
                }
            }
            for label in needed {
                let found = metrics.lines().any(|line| {
                    line.strip_prefix(name.as_str())
                        .is_some_and(|rest| rest.starts_with(['{', ' ']))
                        && line.contains(&label)
                        && (line.contains("route=\"orders\"") || !line.contains("route="))
                });
                assert!(
                    found,
                    "{name} with {label:?} is not exported yet:\n{metrics}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 15, "{checked}");
}

/// A Markdown heading's anchor as GitHub makes it: lower case, spaces to `-`, punctuation other
/// than `-` and `_` dropped.
fn heading_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}
