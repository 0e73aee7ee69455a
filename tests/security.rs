//! The security properties of issue #5, each proved against the real binary:
//!
//! - a stored response is replayed only to the same tenant and principal, for every scope
//!   configuration (and, with `scope_headers: []`, to any principal of the tenant, as the README
//!   warns);
//! - raw keys, scope values and bodies never reach logs (text and JSON), metrics or Redis key
//!   names;
//! - admin mutations need the exact bearer token; the admin listener is loopback by default;
//! - Redis with an ACL user and TLS against a private CA (and mutual TLS) works, and a wrong CA
//!   or client certificate is refused without ever forwarding;
//! - stored responses never carry hop-by-hop headers, nor `Set-Cookie` unless configured.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::Edit;
use common::redis::RedisServer;
use common::tls::{Pki, TlsCluster, TlsRedis, TlsSentinel};
use common::{Backend, Proxy, ProxyBuilder, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "admin-token-for-security-tests-42";

/// Polls `/readyz` until it answers `status` (the Redis warm-up runs in the background).
async fn readyz_becomes(proxy: &Proxy, status: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = Request::get("/readyz").send(proxy.admin).await;
        if r.status == status {
            return r.text();
        }
        assert!(
            Instant::now() < deadline,
            "/readyz stayed {} ({}), wanted {status}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// === Redis: ACL user, TLS with a private CA, mutual TLS ===

/// A proxy on the TLS Redis `redis`, trusting `pki`'s CA (with its client certificate when
/// `client_cert`).
async fn tls_proxy(backend: &Backend, redis: &TlsRedis, pki: &Pki, client_cert: bool) -> Proxy {
    tls_builder(backend, redis, pki, client_cert).start().await
}

fn tls_builder(backend: &Backend, redis: &TlsRedis, pki: &Pki, client_cert: bool) -> ProxyBuilder {
    let mut builder = ProxyBuilder::new(backend)
        .redis(&[redis.url()])
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN);
    for line in pki.store_lines(client_cert) {
        builder = builder.store(&line);
    }
    builder
}

/// Leases its worker id (no `worker_id` in the config), under a host name every such proxy
/// shares, so the second one finds the first one's id held.
fn leasing(builder: ProxyBuilder) -> ProxyBuilder {
    builder.no_worker_id().env("POD_NAME", "orders-acl")
}

/// Splits keys into records and worker-id leases; asserts the leases are `count` distinct ids.
fn records_and_leases(keys: Vec<String>, count: usize) -> Vec<String> {
    let (leases, records): (Vec<String>, Vec<String>) = keys
        .into_iter()
        .partition(|k| k.starts_with("idemgate:worker:"));
    assert_eq!(leases.len(), count, "{leases:?}");
    records
}

#[tokio::test]
async fn redis_over_tls_with_a_private_ca_and_an_acl_user_replays_across_instances() {
    let pki = Pki::generate("idemgate");
    let redis = TlsRedis::start(&pki, "no");
    let backend = Backend::start().await;
    // Both lease their worker ids, as the ACL user too.
    let a = leasing(tls_builder(&backend, &redis, &pki, false))
        .start()
        .await;
    readyz_becomes(&a, 200).await;
    let b = leasing(tls_builder(&backend, &redis, &pki, false))
        .start()
        .await;
    readyz_becomes(&b, 200).await;
    for proxy in [&a, &b] {
        // The eviction setting was read (INFO allowed), so ACL LOG covers that call too.
        proxy
            .metrics_containing("idemgate_store_redis_may_evict 0")
            .await;
    }

    let req = Request::post("/orders")
        .key("tls-order-1")
        .header("Authorization", "Bearer alice")
        .json(r#"{"sku":"A"}"#);
    let first = req.send(a.addr).await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    // B never saw this key: its answer comes from Redis, over TLS, as the ACL user.
    let second = req.send(b.addr).await;
    assert_eq!((second.status, second.result()), (201, Some("HIT")));
    assert_eq!(second.body, first.body);
    assert_eq!(backend.count(), 1);

    // Every key the proxies wrote is a record under the prefix the ACL user is limited to.
    let keys = records_and_leases(redis.scan_keys(), 2);
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].starts_with("idemgate:{default:"), "{keys:?}");
    // Both proxies are connected as the ACL user, over TLS (the server has no plain port).
    let clients: String = redis.cmd(&["CLIENT", "LIST"]);
    assert!(
        clients
            .lines()
            .filter(|l| l.contains("user=idemgate"))
            .count()
            >= 2,
        "{clients}"
    );

    // A purge through B reaches A's local copy over the TLS pub/sub connection (PUBLISH and
    // SUBSCRIBE on the one channel the ACL grants).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let subs: Vec<redis::Value> = redis.cmd(&["PUBSUB", "NUMSUB", "idemgate:purge"]);
        if matches!(subs.get(1), Some(redis::Value::Int(2))) {
            break;
        }
        assert!(Instant::now() < deadline, "purge listeners: {subs:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let subscribed = Instant::now();
    let del = Request::new("DELETE", "/admin/records/default/tls-order-1")
        .header("X-Idemgate-Scope-Authorization", "Bearer alice")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(b.admin)
        .await;
    assert_eq!(del.status, 200, "{}", del.text());
    assert!(
        del.text().contains("2 replicas listening"),
        "{}",
        del.text()
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while req.send(a.addr).await.result() != Some("MISS") {
        assert!(
            Instant::now() < deadline,
            "A kept replaying a purged record"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The least-privilege rules were enough: Redis denied nothing the proxies sent, the purge
    // listeners' heartbeats (every 5 s) included.
    tokio::time::sleep_until((subscribed + Duration::from_secs(6)).into()).await;
    let denied: Vec<redis::Value> = redis.cmd(&["ACL", "LOG"]);
    assert!(denied.is_empty(), "ACL denials: {denied:?}");
    // The password in the URL never reaches the log.
    for proxy in [&a, &b] {
        assert!(!proxy.log().contains(common::tls::IDEMGATE_PASSWORD));
    }
}

/// A proxy on the store at `urls` (TLS with `pki`'s CA), the request MISS on it then HIT on a
/// second proxy, the backend reached once; returns the proxies.
async fn miss_then_hit_on_two_proxies(urls: &[String], pki: &Pki, key: &str) -> Vec<Proxy> {
    let backend = Backend::start().await;
    let mut proxies = Vec::new();
    for _ in 0..2 {
        let mut builder = leasing(ProxyBuilder::new(&backend).redis(urls));
        for line in pki.store_lines(false) {
            builder = builder.store(&line);
        }
        let proxy = builder.start().await;
        readyz_becomes(&proxy, 200).await;
        // The eviction setting was read (INFO allowed), so ACL LOG covers that call too.
        proxy
            .metrics_containing("idemgate_store_redis_may_evict 0")
            .await;
        proxies.push(proxy);
    }
    let req = Request::post("/orders").key(key).body("{}");
    let first = req.send(proxies[0].addr).await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    let second = req.send(proxies[1].addr).await;
    assert_eq!((second.status, second.result()), (201, Some("HIT")));
    assert_eq!(second.body, first.body);
    assert_eq!(backend.count(), 1);
    proxies
}

#[tokio::test]
async fn redis_cluster_over_tls_with_a_private_ca() {
    let pki = Pki::generate("idemgate");
    let cluster = TlsCluster::start(&pki, 3);
    let _proxies = miss_then_hit_on_two_proxies(&cluster.urls(), &pki, "tls-cluster-1").await;
    let keys = records_and_leases(cluster.scan_keys(), 2);
    assert_eq!(keys.len(), 1, "{keys:?}");
    for node in &cluster.nodes {
        let denied: Vec<redis::Value> = node.cmd(&["ACL", "LOG"]);
        assert!(
            denied.is_empty(),
            "ACL denials on {}: {denied:?}",
            node.port
        );
    }
}

#[tokio::test]
async fn sentinel_over_tls_with_a_private_ca() {
    let pki = Pki::generate("idemgate");
    let setup = TlsSentinel::start(&pki);
    let _proxies = miss_then_hit_on_two_proxies(&[setup.url()], &pki, "tls-sentinel-1").await;
    assert_eq!(records_and_leases(setup.primary.scan_keys(), 2).len(), 1);
    let denied: Vec<redis::Value> = setup.primary.cmd(&["ACL", "LOG"]);
    assert!(denied.is_empty(), "ACL denials: {denied:?}");
}

#[tokio::test]
async fn a_rotated_ca_and_server_certificate_are_used_without_a_restart() {
    let old = Pki::generate("idemgate");
    let new = Pki::generate("idemgate");
    let mut redis = TlsRedis::start(&old, "no");
    let backend = Backend::start().await;
    // The proxy reads its CA from a file the test replaces, as a Secret volume update does.
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    std::fs::copy(old.ca(), &ca).expect("copy CA");
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[redis.url()])
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .store("  tls:")
        .store(&format!("    ca_file: \"{}\"", ca.display()))
        .start()
        .await;
    readyz_becomes(&proxy, 200).await;
    let before = Request::post("/orders").key("rotation-1").body("{}");
    assert_eq!(before.send(proxy.addr).await.result(), Some("MISS"));

    // Redis moves to a certificate from another CA and drops idemgate's connections: until
    // the proxy trusts the new CA it cannot reconnect.
    redis.rotate(&new);
    readyz_becomes(&proxy, 503).await;
    // A half-written or wrong file is refused (logged once), and the old one stays in force.
    std::fs::write(&ca, "not a certificate").expect("write a bad CA file");
    let refused = "store.redis.tls files changed but cannot be used";
    let deadline = Instant::now() + Duration::from_secs(10);
    while !proxy.log().contains(refused) {
        assert!(Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Two more polls (every 2 s) of the same bad file at least.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(proxy.log().matches(refused).count(), 1, "logged once");
    let tmp = dir.path().join("ca.pem.new");
    std::fs::copy(new.ca(), &tmp).expect("copy new CA");
    std::fs::rename(&tmp, &ca).expect("swap the CA file");
    readyz_becomes(&proxy, 200).await;

    let after = Request::post("/orders").key("rotation-2").body("{}");
    assert_eq!(after.send(proxy.addr).await.result(), Some("MISS"));
    assert_eq!(after.send(proxy.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 2);
    assert_eq!(redis.scan_keys().len(), 2, "both records are in Redis");
    assert!(
        proxy.log().contains("store.redis.tls files changed"),
        "{}",
        proxy.log()
    );
    // The purge channel moved to the new files too: the purge is announced to every replica.
    let purge = Request::new("DELETE", "/admin/records/default/rotation-2")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(purge.status, 200, "{}", purge.text());
    assert!(
        purge.text().contains("replicas listening"),
        "{}",
        purge.text()
    );
    let metrics = Request::get("/metrics").send(proxy.admin).await.text();
    assert!(
        metrics.contains("idemgate_redis_tls_reloads_total 1\n")
            && metrics.contains("idemgate_redis_tls_reload_failures_total 1\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn mutual_tls_needs_the_client_certificate() {
    let pki = Pki::generate("idemgate");
    let redis = TlsRedis::start(&pki, "yes");
    let backend = Backend::start().await;
    let with_cert = tls_proxy(&backend, &redis, &pki, true).await;
    readyz_becomes(&with_cert, 200).await;
    let req = Request::post("/orders").key("mtls-1").body("{}");
    assert_eq!(req.send(with_cert.addr).await.result(), Some("MISS"));
    assert_eq!(req.send(with_cert.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 1);

    // Without a client certificate the server ends every handshake: not ready, and under
    // `on_unavailable: reject` (the default) nothing is forwarded unprotected.
    let without = tls_proxy(&backend, &redis, &pki, false).await;
    readyz_becomes(&without, 503).await;
    let other = Request::post("/orders").key("mtls-2").body("{}");
    let refused = other.send(without.addr).await;
    assert_eq!(
        (refused.status, refused.result()),
        (503, Some("UNAVAILABLE"))
    );
    assert_eq!(backend.count(), 1, "forwarded without a store");
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused_and_nothing_is_forwarded() {
    let pki = Pki::generate("idemgate");
    let impostor = Pki::generate("impostor");
    let redis = TlsRedis::start(&pki, "no");
    let backend = Backend::start().await;
    // The proxy trusts only the other CA (which replaces the built-in roots).
    let proxy = tls_proxy(&backend, &redis, &impostor, false).await;
    let why = readyz_becomes(&proxy, 503).await;
    assert!(why.to_lowercase().contains("certificate"), "{why}");
    let log = proxy.log_containing("redis store not reachable yet").await;
    assert!(log.to_lowercase().contains("certificate"), "{log}");
    for n in 0..3 {
        let r = Request::post("/orders")
            .key(&format!("wrong-ca-{n}"))
            .body("{}")
            .send(proxy.addr)
            .await;
        assert_eq!((r.status, r.result()), (503, Some("UNAVAILABLE")));
    }
    assert_eq!(backend.count(), 0, "forwarded without a verified store");
    assert!(redis.scan_keys().is_empty());

    // The right CA but a wrong ACL password: refused too, and the password is not logged.
    let wrong_password = redis
        .url()
        .replace(common::tls::IDEMGATE_PASSWORD, "not-it-9f8e");
    let mut builder = ProxyBuilder::new(&backend).redis(&[wrong_password]);
    for line in pki.store_lines(false) {
        builder = builder.store(&line);
    }
    let proxy = builder.start().await;
    let why = readyz_becomes(&proxy, 503).await;
    assert!(!why.contains("not-it-9f8e"), "{why}");
    let r = Request::post("/orders").key("wrong-pw").body("{}");
    assert_eq!(r.send(proxy.addr).await.status, 503);
    assert_eq!(backend.count(), 0);
    // The lines that could carry it are written: the warm-up's, naming the refusal, and the
    // claim's; a later marker line says every line before it is in the log.
    let log = proxy.log_containing("redis store not reachable yet").await;
    let warmup = log
        .lines()
        .find(|l| l.contains("redis store not reachable yet"))
        .unwrap_or_default();
    let lower = warmup.to_lowercase();
    assert!(
        lower.contains("wrongpass") || lower.contains("password") || lower.contains("auth"),
        "the warm-up line does not name the refusal: {warmup}"
    );
    let log = proxy.log_written().await;
    assert!(log.contains("record store failed on claim"), "{log}");
    assert!(!log.contains("not-it-9f8e"), "{log}");
}

#[test]
fn a_missing_tls_file_is_a_config_error_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idemgate.yaml");
    std::fs::write(
        &config,
        "upstreams: {orders: {addrs: [\"127.0.0.1:8080\"]}}\nroutes: []\n\
         store:\n  backend: redis\n  redis:\n    url: rediss://cache:6380\n    tls:\n      \
         ca_file: /nonexistent/redis-ca.pem\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("--config")
        .arg(&config)
        .arg("--check")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("store.redis.tls.ca_file") && err.contains("/nonexistent/redis-ca.pem"),
        "{err}"
    );
}

// === Scope: a replay crosses neither tenant nor principal ===

/// One request shape: key, tenant header, and headers (name, value) in sending order.
fn scoped(key: &str, headers: &[(&str, &str)]) -> Request {
    let mut r = Request::post("/orders").key(key).json(r#"{"sku":"A"}"#);
    for (name, value) in headers {
        r = r.header(name, value);
    }
    r
}

/// Sends every request in `distinct` once (each must execute: a MISS, never another's
/// replay), then again (each must HIT its own record with its own body), and checks the backend
/// ran exactly `distinct.len()` times.
async fn assert_isolated(proxy: &Proxy, backend: &Backend, distinct: &[Request], what: &str) {
    let before = backend.count();
    let mut bodies = Vec::new();
    for (i, req) in distinct.iter().enumerate() {
        let r = req.send(proxy.addr).await;
        assert_eq!(
            (r.status, r.result()),
            (201, Some("MISS")),
            "{what}: request {i} was answered from another scope's record"
        );
        bodies.push(r.body);
    }
    for (i, req) in distinct.iter().enumerate() {
        let r = req.send(proxy.addr).await;
        assert_eq!(r.result(), Some("HIT"), "{what}: request {i} retry");
        assert_eq!(r.body, bodies[i], "{what}: request {i} got another body");
    }
    assert_eq!(backend.count() - before, distinct.len(), "{what}");
}

/// Sends `first`, then each of `same` must replay it (the same scope, written differently).
async fn assert_same_scope(proxy: &Proxy, first: &Request, same: &[Request], what: &str) {
    let original = first.send(proxy.addr).await;
    assert_eq!(original.result(), Some("MISS"), "{what}");
    for (i, req) in same.iter().enumerate() {
        let r = req.send(proxy.addr).await;
        assert_eq!(r.result(), Some("HIT"), "{what}: variant {i}");
        assert_eq!(r.body, original.body, "{what}: variant {i}");
    }
}

#[tokio::test]
async fn default_scope_isolates_tenants_and_authorization_values() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let k = "scope-default";
    assert_isolated(
        &proxy,
        &backend,
        &[
            scoped(
                k,
                &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer alice")],
            ),
            scoped(
                k,
                &[("X-Tenant-ID", "globex"), ("Authorization", "Bearer alice")],
            ),
            scoped(
                k,
                &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer bob")],
            ),
            // Values are compared exactly: case and extra characters make another principal.
            scoped(
                k,
                &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer Alice")],
            ),
            scoped(
                k,
                &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer alicex")],
            ),
            // No tenant header: the default tenant, its own scope.
            scoped(k, &[("Authorization", "Bearer alice")]),
            // A missing principal header is a scope of its own (every anonymous caller of a
            // tenant shares it), distinct from an empty value.
            scoped(k, &[("X-Tenant-ID", "acme")]),
            scoped(k, &[("X-Tenant-ID", "acme"), ("Authorization", "")]),
            // Two values are not one of them.
            scoped(
                k,
                &[
                    ("X-Tenant-ID", "acme"),
                    ("Authorization", "Bearer alice"),
                    ("Authorization", "Bearer bob"),
                ],
            ),
            // Tenants compare exactly too: `Default` is not the default tenant `default`.
            scoped(
                k,
                &[
                    ("X-Tenant-ID", "Default"),
                    ("Authorization", "Bearer alice"),
                ],
            ),
        ],
        "default scope",
    )
    .await;
    // Header names are case-insensitive: the same principal in any spelling.
    assert_same_scope(
        &proxy,
        &scoped(
            "scope-case",
            &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer carol")],
        ),
        &[
            scoped(
                "scope-case",
                &[("x-tenant-id", "acme"), ("authorization", "Bearer carol")],
            ),
            scoped(
                "scope-case",
                &[("X-TENANT-ID", "acme"), ("AUTHORIZATION", "Bearer carol")],
            ),
        ],
        "header name case",
    )
    .await;
}

#[tokio::test]
async fn a_repeated_tenant_header_with_two_values_is_refused() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let victim = scoped(
        "repeat-1",
        &[("X-Tenant-ID", "victim"), ("Authorization", "a")],
    );
    assert_eq!(victim.send(proxy.addr).await.result(), Some("MISS"));
    // A client-sent tenant followed by the one a gateway appended: which one is meant is
    // ambiguous, so neither is guessed (the first one would reach the victim's record).
    for order in [["victim", "attacker"], ["attacker", "victim"]] {
        let r = scoped(
            "repeat-1",
            &[
                ("X-Tenant-ID", order[0]),
                ("X-Tenant-ID", order[1]),
                ("Authorization", "a"),
            ],
        )
        .send(proxy.addr)
        .await;
        assert_eq!((r.status, r.result()), (400, Some("INVALID")), "{order:?}");
        assert_eq!(r.problem_type(), "tenant-invalid");
    }
    // The same value twice is still one tenant.
    let twice = scoped(
        "repeat-1",
        &[
            ("X-Tenant-ID", "victim"),
            ("X-Tenant-ID", "victim"),
            ("Authorization", "a"),
        ],
    );
    assert_eq!(twice.send(proxy.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn principal_headers_only_and_several_principal_headers() {
    let backend = Backend::start().await;
    // Principal headers only, listed in odd case; the tenant header is never sent.
    let only = ProxyBuilder::new(&backend)
        .idem("scope_headers: [x-USER-id]")
        .start()
        .await;
    let k = "scope-user";
    assert_isolated(
        &only,
        &backend,
        &[
            scoped(k, &[("X-User-ID", "u-1")]),
            scoped(k, &[("X-User-ID", "u-2")]),
            scoped(k, &[("X-User-ID", "U-1")]),
            scoped(k, &[]),
            scoped(k, &[("X-User-ID", "u-1"), ("X-Tenant-ID", "acme")]),
        ],
        "principal header only",
    )
    .await;
    // Authorization is no longer part of the scope here: only X-User-ID is.
    assert_same_scope(
        &only,
        &scoped(
            "scope-user-2",
            &[("X-User-ID", "u-9"), ("Authorization", "a")],
        ),
        &[
            scoped(
                "scope-user-2",
                &[("x-user-id", "u-9"), ("Authorization", "b")],
            ),
            scoped("scope-user-2", &[("X-USER-ID", "u-9")]),
        ],
        "principal header only, name case",
    )
    .await;

    // A custom tenant header and three principal headers: changing any one is another scope.
    let several = ProxyBuilder::new(&backend)
        .global("tenant_header: X-Org")
        .idem("scope_headers: [X-User-ID, Authorization, X-Session]")
        .start()
        .await;
    let base = [
        ("X-Org", "acme"),
        ("Authorization", "Bearer alice"),
        ("X-User-ID", "u-1"),
        ("X-Session", "s-1"),
    ];
    let with = |i: usize, value: &str| {
        let mut h = base.to_vec();
        h[i].1 = value;
        scoped("scope-several", &h)
    };
    let mut without_session = base.to_vec();
    without_session.pop();
    assert_isolated(
        &several,
        &backend,
        &[
            scoped("scope-several", &base),
            with(0, "globex"),
            with(1, "Bearer bob"),
            with(2, "u-2"),
            with(3, "s-2"),
            scoped("scope-several", &without_session),
        ],
        "tenant + several principal headers",
    )
    .await;
    // Header order and name case do not matter. X-Tenant-ID is not the tenant header here:
    // it is neither tenant nor principal, so it changes nothing.
    let mut reordered = base.to_vec();
    reordered.reverse();
    let lower: Vec<(String, &str)> = base
        .iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), *v))
        .collect();
    let lower: Vec<(&str, &str)> = lower.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    let mut other_tenant_id = base.to_vec();
    other_tenant_id.push(("X-Tenant-ID", "globex"));
    assert_same_scope(
        &several,
        &scoped("scope-several-2", &base),
        &[
            scoped("scope-several-2", &reordered),
            scoped("scope-several-2", &lower),
            scoped("scope-several-2", &other_tenant_id),
        ],
        "several principal headers, order and case",
    )
    .await;
}

#[tokio::test]
async fn with_no_scope_headers_tenants_stay_isolated_but_principals_share_records() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("scope_headers: []")
        .start()
        .await;
    // Tenants are still separate...
    assert_isolated(
        &proxy,
        &backend,
        &[
            scoped("scope-none", &[("X-Tenant-ID", "acme")]),
            scoped("scope-none", &[("X-Tenant-ID", "globex")]),
            scoped("scope-none", &[]),
        ],
        "no scope headers, tenants",
    )
    .await;
    // ...but within a tenant, anyone who knows the key gets the response: exactly what the
    // README's Security section warns about.
    assert_same_scope(
        &proxy,
        &scoped(
            "scope-none-2",
            &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer alice")],
        ),
        &[
            scoped(
                "scope-none-2",
                &[("X-Tenant-ID", "acme"), ("Authorization", "Bearer mallory")],
            ),
            scoped("scope-none-2", &[("X-Tenant-ID", "acme")]),
        ],
        "no scope headers, principals",
    )
    .await;
    let readme = include_str!("../README.md");
    let security = &readme[readme.find("## Security").expect("a Security section")..];
    assert!(
        security.contains("scope_headers: []") && security.contains("any client that knows a key"),
        "the README must warn about scope_headers: []"
    );
}

/// `scope_required: true`: a keyed request that names no principal (no scope header, or only
/// blank ones) is refused rather than put in the scope every such request of its tenant shares,
/// where one client's response would be replayed to another that picked the same key.
#[tokio::test]
async fn a_route_that_requires_a_principal_refuses_requests_without_one() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("scope_headers: [Authorization, X-User-Id]")
        .idem("scope_required: true")
        .start()
        .await;
    for (what, headers) in [
        ("no scope header", &[][..]),
        ("a blank Authorization", &[("Authorization", " ")][..]),
        ("an empty X-User-Id", &[("X-User-Id", "")][..]),
    ] {
        let resp = scoped("anonymous", headers).send(proxy.addr).await;
        assert_eq!(resp.status, 400, "{what}: {}", resp.text());
        assert_eq!(resp.problem_type(), "scope-missing", "{what}");
        assert_eq!(resp.result(), Some("INVALID"), "{what}");
        assert!(
            resp.text().contains("authorization or x-user-id"),
            "{what}: {}",
            resp.text()
        );
    }
    assert_eq!(backend.count(), 0);
    // Either header names a principal, and principals stay apart.
    assert_isolated(
        &proxy,
        &backend,
        &[
            scoped("named", &[("Authorization", "Bearer alice")]),
            scoped("named", &[("X-User-Id", "u-42")]),
        ],
        "scope required",
    )
    .await;
    // With the key made optional, a request without one is not keyed: nothing to scope.
    let mut proxy = proxy;
    proxy.edit_config(Edit::Rename, |y| {
        y.replacen("      key: required\n", "      key: optional\n", 1)
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::no_key_result(&proxy).await.as_deref() != Some("BYPASS") {
        assert!(Instant::now() < deadline, "the edit was never applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// === No raw key, scope value or body in logs, metrics or Redis key names ===

const SECRET_KEY: &str = "idem-KEY-q7Zx9w";
const SECRET_TENANT: &str = "tenant-TNT-p4Lm2v";
const SECRET_AUTH: &str = "Bearer tok-AUTH-h8Rk3c";
const SECRET_USER: &str = "user-USR-b5Nt6y";
const SECRET_BODY: &str = "body-BDY-f2Gs8u";

/// Every request path that touches the key, scope values and body: MISS, HIT, 422, a released
/// 5xx, malformed key and tenant, and the admin record API (whose path holds the raw key).
async fn exercise_secret_paths(proxy: &Proxy) {
    let req = |key: &str, path: &str, body: &str| {
        Request::post(path)
            .key(key)
            .header("X-Tenant-ID", SECRET_TENANT)
            .header("Authorization", SECRET_AUTH)
            .header("X-User-ID", SECRET_USER)
            .json(&format!(r#"{{"note":"{body}"}}"#))
    };
    let first = req(SECRET_KEY, "/orders", SECRET_BODY)
        .send(proxy.addr)
        .await;
    assert_eq!(first.result(), Some("MISS"));
    assert_eq!(
        req(SECRET_KEY, "/orders", SECRET_BODY)
            .send(proxy.addr)
            .await
            .result(),
        Some("HIT")
    );
    let other_body = format!("{SECRET_BODY}-changed");
    assert_eq!(
        req(SECRET_KEY, "/orders", &other_body)
            .send(proxy.addr)
            .await
            .status,
        422
    );
    let failing = format!("{SECRET_KEY}-5xx");
    assert_eq!(
        req(&failing, "/orders/status/503", SECRET_BODY)
            .send(proxy.addr)
            .await
            .status,
        503
    );
    let long_key = format!("{SECRET_KEY}{}", "x".repeat(300));
    assert_eq!(
        req(&long_key, "/orders", SECRET_BODY)
            .send(proxy.addr)
            .await
            .status,
        400
    );
    let bad_key = format!("\"{SECRET_KEY}");
    assert_eq!(
        req(&bad_key, "/orders", SECRET_BODY)
            .send(proxy.addr)
            .await
            .status,
        400
    );
    let bad_tenant = Request::post("/orders")
        .key(SECRET_KEY)
        .header("X-Tenant-ID", format!("{SECRET_TENANT} x"))
        .body(SECRET_BODY);
    assert_eq!(bad_tenant.send(proxy.addr).await.status, 400);
    // Chunked bodies go over pingora's own proxy path, whose debug output holds every header it
    // sends upstream: a route without idempotency (the key is only passed along) and a
    // keyless request on an optional route (BYPASS).
    for path in ["/plain", "/optional"] {
        let mut streamed = req(SECRET_KEY, path, SECRET_BODY).chunked(8);
        if path == "/optional" {
            streamed = Request::post(path)
                .header("X-Tenant-ID", SECRET_TENANT)
                .header("Authorization", SECRET_AUTH)
                .header("X-User-ID", SECRET_USER)
                .json(&format!(r#"{{"note":"{SECRET_BODY}"}}"#))
                .chunked(8);
        }
        assert_eq!(streamed.send(proxy.addr).await.status, 201, "{path}");
    }

    let path = format!("/admin/records/{SECRET_TENANT}/{SECRET_KEY}");
    let as_principal = |r: Request| {
        r.header("X-Idemgate-Scope-Authorization", SECRET_AUTH)
            .header("X-Idemgate-Scope-X-User-ID", SECRET_USER)
    };
    let view = as_principal(Request::get(&format!("{path}?body=true")))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(view.status, 200, "{}", view.text());
    let del = as_principal(Request::new("DELETE", &path))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(del.status, 200, "{}", del.text());
    assert_eq!(
        req(SECRET_KEY, "/orders", SECRET_BODY)
            .send(proxy.addr)
            .await
            .result(),
        Some("MISS"),
        "purged"
    );
}

fn assert_absent(haystack: &str, needles: &[&str], place: &str) {
    for needle in needles {
        assert!(
            !haystack.contains(needle),
            "{needle:?} appears in {place}:\n{haystack}"
        );
    }
}

#[tokio::test]
async fn raw_keys_scope_values_and_bodies_stay_out_of_logs_metrics_and_redis_key_names() {
    for format in ["text", "json"] {
        let redis = RedisServer::start();
        let backend = Backend::start().await;
        let proxy = ProxyBuilder::new(&backend)
            .redis(&[redis.url()])
            .idem("scope_headers: [Authorization, X-User-ID]")
            .env("IDEMGATE_LOG_FORMAT", format)
            // Trace, not just the default info: nothing at any level may log them (the
            // crates that dump raw requests at trace are capped at debug).
            .env("IDEMGATE_LOG", "trace")
            .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
            .start()
            .await;
        // What the purge channel carries, heard as another replica hears it.
        let heard = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
        let listener = {
            let mut pubsub = redis::Client::open(redis.url())
                .unwrap()
                .get_async_pubsub()
                .await
                .unwrap();
            pubsub.subscribe("idemgate:purge").await.unwrap();
            let heard = heard.clone();
            tokio::spawn(async move {
                use futures_util::StreamExt;
                let mut messages = pubsub.into_on_message();
                while let Some(msg) = messages.next().await {
                    let payload: String = msg.get_payload().unwrap_or_default();
                    heard.lock().push(payload);
                }
            })
        };
        exercise_secret_paths(&proxy).await;
        // The backend did see them: the markers are real, not lost on the way.
        let seen = backend.executions();
        assert!(seen.iter().any(|e| e
            .body
            .windows(SECRET_BODY.len())
            .any(|w| w == SECRET_BODY.as_bytes())));

        // Logs: wait for all ten access lines (logs are written in batches).
        let deadline = Instant::now() + Duration::from_secs(5);
        while proxy.log().matches("idemgate::access").count() < 10 {
            assert!(
                Instant::now() < deadline,
                "access lines missing:\n{}",
                proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log = proxy.log();
        if format == "json" {
            for line in log.lines().filter(|l| l.contains("idemgate::access")) {
                serde_json::from_str::<serde_json::Value>(line).expect("one JSON object a line");
            }
        }
        let key_and_scope = [SECRET_KEY, "AUTH-h8Rk3c", "USR-b5Nt6y"];
        assert_absent(&log, &key_and_scope, &format!("the {format} log"));
        assert_absent(&log, &["BDY-f2Gs8u"], &format!("the {format} log"));

        // Metrics: the whole exposition, names, labels and values.
        let metrics = proxy.metrics().await;
        assert_absent(&metrics, &key_and_scope, "/metrics");
        assert_absent(&metrics, &["BDY-f2Gs8u", "TNT-p4Lm2v"], "/metrics");

        // Redis: key names hold the prefix, the tenant (the hash tag, by design) and a hash.
        let keys = redis.keys();
        assert!(!keys.is_empty());
        for key in &keys {
            assert_absent(key, &key_and_scope, "a Redis key name");
            assert_absent(key, &["BDY-f2Gs8u"], "a Redis key name");
            let fields: BTreeMap<String, Vec<u8>> = redis.cmd(&["HGETALL", key]);
            for (field, value) in &fields {
                // The stored response is a value, and may hold anything the backend sent;
                // the key and scope values are never stored.
                let text = String::from_utf8_lossy(value);
                assert_absent(&text, &key_and_scope, &format!("Redis {key} field {field}"));
            }
        }
        // The purge message names the record by tenant and hash (nothing else is published).
        let channels: Vec<String> = redis.cmd(&["PUBSUB", "CHANNELS"]);
        for channel in &channels {
            assert_absent(channel, &key_and_scope, "a pub/sub channel");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while heard.lock().is_empty() {
            assert!(Instant::now() < deadline, "the purge was never announced");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        listener.abort();
        for payload in heard.lock().iter() {
            let (tenant, hash) = payload.rsplit_once(':').expect("tenant:hash");
            assert_eq!(tenant, SECRET_TENANT, "{payload}");
            assert!(
                hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                "{payload}"
            );
            assert_absent(payload, &key_and_scope, "a purge message");
        }
    }
}

// === Admin: loopback by default, exact bearer token for mutations ===

/// A loopback admin listener answers only requests that name it by `localhost` or an address:
/// a web page whose name the attacker's DNS points at 127.0.0.1 (DNS rebinding) would otherwise
/// read `/metrics`, `/admin/config` and record states from a browser on this host, as
/// same-origin. Refused with 421 before anything is read.
#[tokio::test]
async fn a_loopback_admin_listener_refuses_a_foreign_host_name() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let ask = |host: String| async move {
        let mut s = tokio::net::TcpStream::connect(proxy.admin).await.unwrap();
        let request = format!("GET /admin/config HTTP/1.1\r\nHost: {host}\r\n\r\n");
        s.write_all(request.as_bytes()).await.unwrap();
        common::client::read_response(&mut s, false).await.unwrap()
    };
    let port = proxy.admin.port();
    for host in [
        "rebind.evil.example".to_owned(),
        format!("rebind.evil.example:{port}"),
    ] {
        let r = ask(host.clone()).await;
        assert_eq!(r.status, 421, "{host}: {}", r.text());
        assert!(r.text().contains("admin-host-not-local"), "{}", r.text());
        assert!(!r.text().contains("routes"), "no config in the refusal");
    }
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        assert_eq!(ask(host.clone()).await.status, 200, "{host}");
    }
}

#[test]
fn the_admin_listener_is_loopback_unless_configured_otherwise() {
    let minimal = "upstreams: {orders: {addrs: [\"127.0.0.1:8080\"]}}\nroutes: []\n";
    let config = idemgate::config::Config::from_yaml_str(minimal).expect("minimal config");
    assert!(
        config.admin.listen.ip().is_loopback(),
        "{}",
        config.admin.listen
    );
    assert_eq!(config.admin.token, None, "no token unless configured");
    let reference = include_str!("../config/idemgate.yaml");
    let config = idemgate::config::Config::from_yaml_str(reference).expect("reference config");
    assert!(
        config.admin.listen.ip().is_loopback(),
        "{}",
        config.admin.listen
    );
}

#[tokio::test]
async fn admin_mutations_need_the_exact_bearer_token() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let record = "/admin/records/default/admin-key";
    let make = |n: usize| {
        Request::post("/orders")
            .key("admin-key")
            .body(format!("{n}"))
    };
    assert_eq!(make(0).send(proxy.addr).await.result(), Some("MISS"));

    let mutations = || {
        [
            Request::new("POST", "/admin/reload"),
            Request::new("DELETE", record),
        ]
    };
    let shorter = &TOKEN[..TOKEN.len() - 1];
    let wrong: Vec<(&str, Vec<String>)> = vec![
        ("no Authorization", vec![]),
        ("empty", vec![String::new()]),
        ("scheme only", vec!["Bearer".into()]),
        ("scheme and space", vec!["Bearer ".into()]),
        ("token without scheme", vec![TOKEN.into()]),
        ("another scheme", vec![format!("Basic {TOKEN}")]),
        (
            "wrong token",
            vec!["Bearer admin-token-for-security-tests-43".into()],
        ),
        ("a prefix of the token", vec![format!("Bearer {shorter}")]),
        (
            "the first byte only",
            vec![format!("Bearer {}", &TOKEN[..1])],
        ),
        ("the token and more", vec![format!("Bearer {TOKEN}x")]),
        ("padded inside", vec![format!("Bearer  {TOKEN}")]),
        (
            "other case",
            vec![format!("Bearer {}", TOKEN.to_uppercase())],
        ),
        (
            "the token beside another",
            vec![format!("Bearer {TOKEN}"), "Bearer nope".into()],
        ),
    ];
    for (what, values) in &wrong {
        for req in mutations() {
            let mut req = req;
            for v in values {
                req = req.header("Authorization", v);
            }
            let r = req.send(proxy.admin).await;
            assert_eq!(r.status, 401, "{what}: {} {}", req.method, req.path);
            assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{what}");
        }
    }
    // None of them purged the record.
    assert_eq!(make(0).send(proxy.addr).await.result(), Some("HIT"));

    // The exact token works, with the scheme in any case.
    for scheme in ["Bearer", "bearer"] {
        let r = Request::new("POST", "/admin/reload")
            .header("Authorization", format!("{scheme} {TOKEN}"))
            .send(proxy.admin)
            .await;
        assert_eq!(r.status, 200, "{scheme}: {}", r.text());
    }
    let del = Request::new("DELETE", record)
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(del.status, 200, "{}", del.text());
    assert_eq!(make(0).send(proxy.addr).await.result(), Some("MISS"));
    // The running config never shows the token.
    let config = Request::get("/admin/config").send(proxy.admin).await;
    assert_eq!(config.status, 200);
    assert!(!config.text().contains(TOKEN));
    assert!(config.text().contains("<redacted>"));

    // Without a configured token every mutation is refused, whatever is sent.
    let open = ProxyBuilder::new(&backend).start().await;
    for req in mutations() {
        let r = req
            .header("Authorization", format!("Bearer {TOKEN}"))
            .send(open.admin)
            .await;
        assert_eq!(r.status, 401);
    }
}

// === Stored headers: no hop-by-hop headers; Set-Cookie only when configured ===

/// The backend response of [`raw_backend`]: every kind of hop-by-hop header next to two
/// end-to-end ones, and a chunked body.
const HOP_BY_HOP_RESPONSE: &str = "HTTP/1.1 201 Created\r\n\
    Content-Type: application/json\r\n\
    Connection: close, X-Hop-Named\r\n\
    X-Hop-Named: named-in-connection\r\n\
    Keep-Alive: timeout=5, max=100\r\n\
    Proxy-Connection: keep-alive\r\n\
    Proxy-Authenticate: Basic realm=\"backend-proxy\"\r\n\
    Proxy-Authentication-Info: nextnonce=\"n0nce\"\r\n\
    Proxy-Status: backend-gw; error=none\r\n\
    TE: trailers\r\n\
    Trailer: X-Checksum\r\n\
    Upgrade: h2c\r\n\
    Set-Cookie: session=cookie-value\r\n\
    X-End-To-End: kept\r\n\
    Transfer-Encoding: chunked\r\n\
    \r\n\
    5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";

/// A backend that reads one request per connection, answers it with `response` byte for byte,
/// and closes; counts requests.
async fn raw_backend(response: &'static str) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let counter = count.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The head, then as many body bytes as Content-Length says.
                let head_end = loop {
                    let Ok(n) = stream.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    let Ok(n) = stream.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                counter.fetch_add(1, Ordering::SeqCst);
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (addr, count)
}

/// Header names that must never be stored or replayed from [`HOP_BY_HOP_RESPONSE`].
const NEVER_REPLAYED: [&str; 11] = [
    "x-hop-named",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authentication-info",
    "proxy-status",
    "te",
    "trailer",
    "upgrade",
    "transfer-encoding",
    "set-cookie",
];

#[tokio::test]
async fn hop_by_hop_headers_are_never_stored_or_replayed() {
    let (addr, executed) = raw_backend(HOP_BY_HOP_RESPONSE).await;
    let proxy = ProxyBuilder::at(addr)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let req = Request::post("/orders").key("hop-1").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(
        (first.status, first.result()),
        (201, Some("MISS")),
        "{first:?}"
    );
    assert_eq!(first.body, b"hello world");
    // The live answer keeps end-to-end headers (Set-Cookie included: it is the original
    // client's cookie) but never the headers Connection names.
    assert_eq!(first.header("x-end-to-end"), Some("kept"));
    assert_eq!(first.header("set-cookie"), Some("session=cookie-value"));
    assert_eq!(first.header("x-hop-named"), None);

    // What was stored: only the end-to-end headers.
    let stored = Request::get("/admin/records/default/hop-1?body=true")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(stored.status, 200, "{}", stored.text());
    let v: serde_json::Value = serde_json::from_slice(&stored.body).unwrap();
    let names: Vec<&str> = v["headers"]
        .as_array()
        .expect("stored headers")
        .iter()
        .filter_map(|pair| pair[0].as_str())
        .collect();
    assert_eq!(names, ["content-type", "x-end-to-end"], "{v}");

    // What a replay carries.
    let replay = req.send(proxy.addr).await;
    assert_eq!((replay.status, replay.result()), (201, Some("HIT")));
    assert_eq!(replay.body, b"hello world");
    assert_eq!(replay.header("x-end-to-end"), Some("kept"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    for name in NEVER_REPLAYED {
        assert_eq!(replay.header(name), None, "{name} replayed: {replay:?}");
    }
    // A Connection header of the replay's own (if any) is the proxy's, not the backend's.
    if let Some(connection) = replay.header("connection") {
        assert!(
            !connection.to_ascii_lowercase().contains("x-hop-named"),
            "{connection}"
        );
    }
    assert_eq!(executed.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn set_cookie_is_replayed_only_when_configured() {
    let backend = Backend::start().await;
    // Default: `replay_exclude_headers: [Set-Cookie]`.
    let default = ProxyBuilder::new(&backend).start().await;
    let req = Request::post("/orders").key("cookie-1").body("{}");
    let first = req.send(default.addr).await;
    assert_eq!(first.header("set-cookie"), Some("session=abc"));
    let replay = req.send(default.addr).await;
    assert_eq!(replay.result(), Some("HIT"));
    assert_eq!(
        replay.header("set-cookie"),
        None,
        "cookie replayed by default"
    );

    // Configured: the list no longer names Set-Cookie (it names another header instead).
    let replaying = ProxyBuilder::new(&backend)
        .idem("replay_exclude_headers: [X-Backend]")
        .start()
        .await;
    let first = req.send(replaying.addr).await;
    assert_eq!(first.result(), Some("MISS"));
    let replay = req.send(replaying.addr).await;
    assert_eq!(replay.result(), Some("HIT"));
    assert_eq!(replay.header("set-cookie"), Some("session=abc"));
    assert_eq!(
        replay.header("x-backend"),
        None,
        "an excluded header was replayed"
    );
    assert_eq!(first.header("x-backend"), Some("orders"));

    // And the empty list replays every end-to-end header the backend sent.
    let mut everything = ProxyBuilder::new(&backend)
        .idem("replay_exclude_headers: []")
        .start()
        .await;
    req.send(everything.addr).await;
    let replay = req.send(everything.addr).await;
    assert_eq!(replay.result(), Some("HIT"));
    assert_eq!(replay.header("set-cookie"), Some("session=abc"));
    assert_eq!(replay.header("x-backend"), Some("orders"));

    // Excluding Set-Cookie again (a live reload) holds for records stored before it, too.
    everything.edit_config(Edit::Rename, |yaml| {
        yaml.replacen(
            "replay_exclude_headers: []",
            "replay_exclude_headers: [Set-Cookie]",
            1,
        )
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let replay = req.send(everything.addr).await;
        assert_eq!(replay.result(), Some("HIT"));
        if replay.header("set-cookie").is_none() {
            assert_eq!(replay.header("x-backend"), Some("orders"));
            break;
        }
        assert!(Instant::now() < deadline, "the reload never applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The cap on the crates that dump raw requests only ever lowers their level: at the default
/// `info`, none of their debug lines appear (a cap that raised them would log every request).
#[tokio::test]
async fn the_log_cap_never_raises_a_level() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    for path in ["/orders", "/plain"] {
        let r = Request::post(path)
            .key("cap-1")
            .body("{}")
            .send(proxy.addr)
            .await;
        assert_eq!(r.status, 201);
    }
    let log = proxy.log_containing("path=\"/plain\"").await;
    assert!(log.contains("path=\"/orders\""), "{log}");
    // And lowers nothing at or above it: pingora's own info lines (through the `log` crate's
    // bridge) are there.
    assert!(
        log.contains("pingora_core::server::bootstrap_services: Bootstrap starting"),
        "{log}"
    );
    for line in log.lines() {
        assert!(
            !line.contains("DEBUG") && !line.contains("TRACE"),
            "a line below info at IDEMGATE_LOG=info: {line}"
        );
    }
}

/// A client certificate and its key replaced one file at a time (not the atomic swap of a
/// Kubernetes Secret volume): the reading that finds the new certificate beside the old key
/// refuses the pair without reporting it, and the next, with both new files, takes them.
/// A mismatch that stays is reported once.
#[tokio::test]
async fn a_client_certificate_and_key_replaced_one_at_a_time_are_taken_together() {
    use idemgate::config::{RedisConfig, RedisTlsConfig, RedisTopology, ScriptsConfig};
    use idemgate::store::{RecordStore, RedisStore};

    let old = Pki::generate("old");
    let new = Pki::generate("new");
    let mut redis = TlsRedis::start(&old, "yes");
    let dir = tempfile::tempdir().expect("tls dir");
    let (ca, cert, key) = (
        dir.path().join("ca.pem"),
        dir.path().join("client.pem"),
        dir.path().join("client.key"),
    );
    // Files swapped in by rename, each one whole: only their order is in question here.
    let put = |from: PathBuf, to: &PathBuf| {
        let tmp = to.with_extension("tmp");
        std::fs::copy(from, &tmp).expect("copy");
        std::fs::rename(&tmp, to).expect("swap");
    };
    put(old.ca(), &ca);
    put(old.path("client.pem"), &cert);
    put(old.path("client.key"), &key);
    let config = RedisConfig {
        urls: vec![redis.url()],
        topology: RedisTopology::Single,
        connect_timeout: Duration::from_millis(500),
        response_timeout: Duration::from_secs(1),
        key_prefix: "idemgate".into(),
        scripts: ScriptsConfig::default(),
        tls: Some(RedisTlsConfig {
            ca_file: Some(ca.clone()),
            cert_file: Some(cert.clone()),
            key_file: Some(key.clone()),
        }),
    };
    let store = RedisStore::new(&config).expect("store");
    store.ping().await.expect("mutual TLS with the old files");

    redis.rotate(&new);
    assert!(store.ping().await.is_err(), "the old files no longer do");
    put(new.ca(), &ca);
    put(new.path("client.pem"), &cert);
    // The new certificate beside the old key: refused, not (yet) reported.
    assert!(store.reload_tls().is_none());
    assert_eq!(store.tls_reload_failures(), 0);
    assert_eq!(store.tls_reloads(), 0);
    put(new.path("client.key"), &key);
    assert!(store.reload_tls().is_some(), "the whole new pair is taken");
    assert_eq!((store.tls_reloads(), store.tls_reload_failures()), (1, 0));
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = store.ping().await {
        assert!(
            Instant::now() < deadline,
            "no mutual TLS with the new files: {e}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A key that stays wrong is reported, once, by the second reading that finds it.
    put(old.path("client.key"), &key);
    assert!(store.reload_tls().is_none());
    assert_eq!(store.tls_reload_failures(), 0);
    assert!(store.reload_tls().is_none());
    assert!(store.reload_tls().is_none());
    assert_eq!(store.tls_reload_failures(), 1);
    // Nothing was swapped: the connections still use the matching pair.
    store.ping().await.expect("the pair in force still works");
    assert_eq!(store.tls_reloads(), 1);
}

#[tokio::test]
async fn an_admin_request_that_cannot_be_parsed_or_answered_leaves_no_secret_in_the_log() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .idem("max_response_bytes: 32MiB")
        .start()
        .await;
    // A request the admin listener's HTTP parser refuses (a control byte in a header), carrying
    // the admin token, a raw key in its path and a principal's credentials.
    let mut s = tokio::net::TcpStream::connect(proxy.admin).await.unwrap();
    let malformed = format!(
        "GET /admin/records/default/unparsed-secret-key HTTP/1.1\r\nHost: localhost\r\n\
         Authorization: Bearer {TOKEN}\r\nX-Idemgate-Scope-Authorization: Bearer principal-secret\r\n\
         X-Note: a\x01b\r\n\r\n"
    );
    s.write_all(malformed.as_bytes()).await.unwrap();
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await;

    // A record read whose client goes away mid-answer: the write of its body (more than the
    // kernel buffers between the two take) fails.
    let big = Request::post("/orders/large/24000000")
        .key("unwritten-secret-key")
        .body("{}");
    assert_eq!(big.send(proxy.addr).await.result(), Some("MISS"));
    let mut s = tokio::net::TcpStream::connect(proxy.admin).await.unwrap();
    let read = format!(
        "GET /admin/records/default/unwritten-secret-key?body=true HTTP/1.1\r\nHost: localhost\r\n\
         Authorization: Bearer {TOKEN}\r\n\r\n"
    );
    s.write_all(read.as_bytes()).await.unwrap();
    let mut first = [0u8; 64];
    let _ = s.read(&mut first).await.unwrap();
    s.set_zero_linger().unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let log = proxy.log_written().await;
    for secret in [
        TOKEN,
        "unparsed-secret-key",
        "principal-secret",
        "unwritten-secret-key",
    ] {
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
}

/// A request the proxy listener's HTTP parser refuses is logged by pingora with its first 2 KiB
/// of raw bytes, at debug: even with `IDEMGATE_LOG=debug`, that line stays out of the log (the
/// cap on pingora's targets), so a key, a bearer token or a tenant header never lands there.
#[tokio::test]
async fn a_request_the_proxy_cannot_parse_leaves_no_secret_in_the_log() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .env("IDEMGATE_LOG", "debug")
        .start()
        .await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: a\r\nIdempotency-Key: \"parse-secret-key\"\r\n\
          Authorization: Bearer bearer-secret\r\nX-Tenant: tenant-secret\r\n\
          X-Note: a\x01b\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(backend.count(), 0);
    let log = proxy.log_written().await;
    assert!(log.contains("DEBUG"), "not at debug:\n{log}");
    for secret in ["parse-secret-key", "bearer-secret", "tenant-secret"] {
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
}

/// pingora's own error lines (a request whose streamed body breaks, say) name the request by
/// method, path and route, as the access line does: not by its query string or `Host`, which
/// may carry a token.
#[tokio::test]
async fn pingora_s_error_lines_leave_the_query_and_host_out() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /plain/x?token=QRY-s3cr3tQ HTTP/1.1\r\nHost: HST-h0stH\r\n\
          Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    )
    .await
    .unwrap();
    let answer = common::client::until_closed(&mut s).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let log = proxy.log_containing("Fail to").await;
    let line = log
        .lines()
        .find(|l| l.contains("Fail to"))
        .unwrap_or_default();
    assert!(line.contains("POST \"/plain/x\", route plain"), "{line}");
    assert_absent(&proxy.log(), &["QRY-s3cr3tQ", "HST-h0stH"], "the log");
}

/// The Redis password can come from the environment (`IDEMGATE_REDIS_PASSWORD`, filled from a
/// Kubernetes Secret) rather than the config file (a ConfigMap, which is no secret). It
/// replaces the password a URL gives (here a wrong one), keeps the URL's user, and shows
/// neither in `/admin/config` nor in the log.
#[tokio::test]
async fn the_redis_password_can_come_from_the_environment() {
    let redis = RedisServer::start();
    let secret = "env-only p@ss/word";
    let _: () = redis.cmd(&[
        "ACL",
        "SETUSER",
        "idemgate",
        "on",
        &format!(">{secret}"),
        "~*",
        "&*",
        "+@all",
    ]);
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .redis(&[format!(
            "redis://idemgate:written-in-the-file@127.0.0.1:{}",
            redis.port
        )])
        .env("IDEMGATE_REDIS_PASSWORD", secret)
        .start()
        .await;
    let req = Request::post("/orders").key("env-password").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(
        first.result(),
        Some("MISS"),
        "{}\n{}",
        first.text(),
        proxy.log()
    );
    assert_eq!(req.send(proxy.addr).await.result(), Some("HIT"));
    let clients: String = redis.cmd(&["CLIENT", "LIST"]);
    assert!(clients.contains("user=idemgate"), "{clients}");

    let view = Request::get("/admin/config").send(proxy.admin).await.text();
    let log = proxy.log_written().await;
    for shown in [&view, &log] {
        for form in [secret, "env-only%20p%40ss%2Fword", "written-in-the-file"] {
            assert!(!shown.contains(form), "{form} shown:\n{shown}");
        }
    }
    assert!(view.contains("127.0.0.1"), "{view}");
}
