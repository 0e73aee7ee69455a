//! SPEC §1, row by row, against the real binary in front of a real counting backend.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{Backend, Proxy, ProxyBuilder, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn setup() -> (Backend, common::Proxy) {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    (backend, proxy)
}

#[tokio::test]
async fn first_request_executes_and_retry_replays_byte_exact() {
    let (backend, proxy) = setup().await;
    let req = Request::post("/orders")
        .key("order-1")
        .json(r#"{"sku":"A","qty":1}"#);
    let first = req.send(proxy.addr).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.result(), Some("MISS"));
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(backend.count(), 1);

    let second = req.send(proxy.addr).await;
    assert_eq!(second.status, 201);
    assert_eq!(second.result(), Some("HIT"));
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(second.body, first.body);
    // Same end-to-end headers, same order, repeated ones kept; Set-Cookie not replayed.
    let mut expected = first.end_to_end_headers();
    expected.retain(|(n, _)| n != "set-cookie");
    assert_eq!(second.end_to_end_headers(), expected);
    assert!(first.header("set-cookie").is_some());
    assert_eq!(
        second.headers_named("x-multi"),
        vec![&b"one"[..], &b"two"[..]]
    );
    assert!(
        second.header("date").is_some(),
        "a replay carries a fresh Date"
    );
    assert_eq!(backend.count(), 1, "a replay never reaches the backend");
}

#[tokio::test]
async fn a_retry_sent_the_moment_the_response_arrives_is_never_in_flight() {
    let (backend, proxy) = setup().await;
    for n in 0..100 {
        let path = [
            "/orders",
            "/orders/empty",
            "/orders/chunked",
            "/orders/status/500",
        ][n % 4];
        let req = Request::post(path).key(&format!("instant-{n}")).body("x");
        let first = req.send(proxy.addr).await;
        assert_eq!(first.result(), Some("MISS"), "{path}");
        // The record is written before the response's last byte leaves the proxy.
        let again = req.send(proxy.addr).await;
        let expected = if first.status == 500 { "MISS" } else { "HIT" };
        assert_eq!(again.result(), Some(expected), "{path}: {}", again.text());
    }
    assert_eq!(backend.count(), 100 + 25);
}

#[tokio::test]
async fn replays_binary_chunked_and_empty_bodies() {
    let (backend, proxy) = setup().await;
    for (path, key) in [
        ("/orders/binary", "bin"),
        ("/orders/chunked", "chunk"),
        ("/orders/empty", "empty"),
    ] {
        let req = Request::post(path).key(key).body("x");
        let first = req.send(proxy.addr).await;
        assert_eq!(first.status, 200, "{path}");
        assert_eq!(first.result(), Some("MISS"));
        let second = req.send(proxy.addr).await;
        assert_eq!(second.result(), Some("HIT"), "{path}");
        assert_eq!(second.body, first.body, "{path}");
        assert_eq!(
            second.header("content-type"),
            first.header("content-type"),
            "{path}"
        );
        assert_eq!(
            second.header("content-length"),
            Some(first.body.len().to_string().as_str())
        );
    }
    assert_eq!(backend.count(), 3);
    let chunked = Request::post("/orders/chunked")
        .key("chunk")
        .body("x")
        .send(proxy.addr)
        .await;
    assert_eq!(chunked.text(), "part-0;part-1;part-2;part-3;part-4;");
    let binary = Request::post("/orders/binary")
        .key("bin")
        .body("x")
        .send(proxy.addr)
        .await;
    assert_eq!(binary.body.len(), 4096);
    assert_eq!(&binary.body[..256], &(0..=255u8).collect::<Vec<_>>()[..]);
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key() {
    let (backend, proxy) = setup().await;
    let a = Request::post("/orders")
        .key("\"abc-1\"")
        .body("{}")
        .send(proxy.addr)
        .await;
    let b = Request::post("/orders")
        .key("abc-1")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!((a.result(), b.result()), (Some("MISS"), Some("HIT")));
    assert_eq!(backend.count(), 1);
}

/// `min_key_length`: a key shorter than the route asks for is refused with 400 (its length said,
/// never the key), never claimed or forwarded; one of that length runs, and the quoted form
/// counts its decoded characters.
#[tokio::test]
async fn a_key_shorter_than_min_key_length_is_400_and_never_forwarded() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("min_key_length: 8")
        .start()
        .await;
    for short in ["1234567", "\"1234567\""] {
        let r = Request::post("/orders")
            .key(short)
            .body("{}")
            .send(proxy.addr)
            .await;
        assert_eq!(
            (r.status, r.result()),
            (400, Some("INVALID")),
            "{}",
            r.text()
        );
        assert_eq!(r.problem_type(), "idempotency-key-invalid");
        assert!(
            r.text()
                .contains("7 characters long; this route needs at least 8"),
            "{}",
            r.text()
        );
        assert!(
            !r.text().contains("1234567"),
            "the key is echoed: {}",
            r.text()
        );
    }
    assert_eq!(backend.count(), 0);
    let ok = Request::post("/orders")
        .key("\"12345678\"")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(
        (ok.status, ok.result()),
        (201, Some("MISS")),
        "{}",
        ok.text()
    );
    // Another route keeps the default: any key of one character or more.
    let other = Request::post("/optional")
        .key("k")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(other.result(), Some("MISS"), "{}", other.text());
}

/// `idempotency.docs_url`: every problem idemgate makes on an idempotent route links the API's
/// idempotency docs (`Link: <…>; rel="describedby"`, as the IETF draft suggests for a missing
/// key); backend answers and replays are left as they were.
#[tokio::test]
async fn problems_of_idempotent_routes_link_the_docs_url() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .global("docs_url: \"https://api.example.com/docs/idempotency\"")
        .start()
        .await;
    let link = Some("<https://api.example.com/docs/idempotency>; rel=\"describedby\"");
    let missing = Request::post("/orders").body("{}").send(proxy.addr).await;
    assert_eq!(missing.problem_type(), "idempotency-key-missing");
    assert_eq!(missing.header("link"), link);
    let first = Request::post("/orders")
        .key("d1")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!((first.status, first.header("link")), (201, None));
    let changed = Request::post("/orders")
        .key("d1")
        .body("{\"x\":1}")
        .send(proxy.addr)
        .await;
    assert_eq!(changed.problem_type(), "fingerprint-mismatch");
    assert_eq!(changed.header("link"), link);
    let replay = Request::post("/orders")
        .key("d1")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(
        (replay.result(), replay.header("link")),
        (Some("HIT"), None)
    );
    let view = Request::get("/admin/config").send(proxy.admin).await;
    let v: serde_json::Value = serde_json::from_slice(&view.body).unwrap();
    assert_eq!(
        v["idempotency"]["docs_url"].as_str(),
        Some("https://api.example.com/docs/idempotency"),
        "{v}"
    );
    assert_eq!(v["routes"][0]["idempotency"]["min_key_length"], 1, "{v}");
    assert_eq!(
        v["routes"][0]["idempotency"]["on_outcome_unknown"], "lapse",
        "{v}"
    );
}

#[tokio::test]
async fn malformed_keys_and_tenants_are_400_and_never_forwarded() {
    let (backend, proxy) = setup().await;
    let long = "k".repeat(256);
    let cases: Vec<(&str, Request)> = vec![
        (
            "idempotency-key-missing",
            Request::post("/orders").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key(&long).body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("\"unterminated").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("\"a\"junk").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("has space").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("caf\u{e9}").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("a").key("b").body("{}"),
        ),
        (
            "idempotency-key-invalid",
            Request::post("/orders").key("a, b").body("{}"),
        ),
        (
            "tenant-invalid",
            Request::post("/orders")
                .key("t1")
                .header("X-Tenant-ID", "a{b}")
                .body("{}"),
        ),
        (
            "tenant-invalid",
            Request::post("/orders")
                .key("t1")
                .header("X-Tenant-ID", "x".repeat(129))
                .body("{}"),
        ),
    ];
    for (kind, req) in cases {
        let resp = req.send(proxy.addr).await;
        assert_eq!(resp.status, 400, "{kind}: {req:?}");
        assert_eq!(resp.result(), Some("INVALID"));
        assert_eq!(resp.problem_type(), kind, "{req:?}");
    }
    // The same key repeated with the same value is one key.
    let ok = Request::post("/orders")
        .key("same")
        .key("\"same\"")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(ok.result(), Some("MISS"));
    assert_eq!(
        backend.count(),
        1,
        "no malformed request reached the backend"
    );
    // 255 characters is the limit, inclusive.
    let max = Request::post("/orders")
        .key(&"k".repeat(255))
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(max.result(), Some("MISS"));
}

/// `Host` is not part of a record by default (one route, one backend): a gateway that serves
/// several hosts through one route, whose backend tells them apart, lists `Host` in
/// `fingerprint.headers`, and a key sent again to another host is then 422, never a replay of
/// the first host's answer.
#[tokio::test]
async fn a_route_that_fingerprints_host_refuses_a_key_sent_to_another_host() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let exchange = |proxy: std::net::SocketAddr, host: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
        let request = format!(
            "POST /orders HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: vhost-key\r\n\
             Content-Length: 2\r\n\r\n{{}}"
        );
        s.write_all(request.as_bytes()).await.unwrap();
        common::client::read_response(&mut s, false).await.unwrap()
    };
    let by_host = ProxyBuilder::new(&backend)
        .idem("fingerprint: { body: true, headers: [Host] }")
        .start()
        .await;
    let a = exchange(by_host.addr, "shop-a.example").await;
    assert_eq!(a.result(), Some("MISS"), "{}", a.text());
    let b = exchange(by_host.addr, "shop-b.example").await;
    assert_eq!(
        (b.status, b.result()),
        (422, Some("MISMATCH")),
        "{}",
        b.text()
    );
    let again = exchange(by_host.addr, "shop-a.example").await;
    assert_eq!(again.result(), Some("HIT"), "{}", again.text());
    assert_eq!(backend.count(), 1);
    // By default the host is not looked at: the second host's retry replays the first's.
    let default = ProxyBuilder::new(&backend).start().await;
    assert_eq!(
        exchange(default.addr, "shop-a.example").await.result(),
        Some("MISS")
    );
    assert_eq!(
        exchange(default.addr, "shop-b.example").await.result(),
        Some("HIT")
    );
}

#[tokio::test]
async fn changed_payload_path_or_query_is_422() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("fingerprint: { body: true, headers: [X-Currency] }")
        .start()
        .await;
    let base = || {
        Request::post("/orders")
            .key("k422")
            .header("X-Currency", "EUR")
            .json(r#"{"a":1}"#)
    };
    assert_eq!(base().send(proxy.addr).await.result(), Some("MISS"));
    let changes = [
        Request::post("/orders")
            .key("k422")
            .header("X-Currency", "EUR")
            .json(r#"{"a":2}"#),
        Request::post("/orders/other")
            .key("k422")
            .header("X-Currency", "EUR")
            .json(r#"{"a":1}"#),
        Request::post("/orders?x=1")
            .key("k422")
            .header("X-Currency", "EUR")
            .json(r#"{"a":1}"#),
        Request::new("PUT", "/orders")
            .key("k422")
            .header("X-Currency", "EUR")
            .json(r#"{"a":1}"#),
        Request::post("/orders")
            .key("k422")
            .header("X-Currency", "USD")
            .json(r#"{"a":1}"#),
        // The same header, named in `Connection`: the backend would not see it.
        Request::post("/orders")
            .key("k422")
            .header("X-Currency", "EUR")
            .header("Connection", "keep-alive, X-Currency")
            .json(r#"{"a":1}"#),
    ];
    for req in changes {
        let resp = req.send(proxy.addr).await;
        assert_eq!(resp.status, 422, "{req:?}");
        assert_eq!(resp.result(), Some("MISMATCH"));
        assert_eq!(resp.problem_type(), "fingerprint-mismatch");
        // About this attempt only: no cache may hand it to another request.
        assert_eq!(resp.header("cache-control"), Some("no-store"));
    }
    assert_eq!(base().send(proxy.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn tenants_and_principals_are_isolated() {
    let (backend, proxy) = setup().await;
    let req = |tenant: Option<&str>, auth: Option<&str>| {
        let mut r = Request::post("/orders").key("shared-key").body("{}");
        if let Some(t) = tenant {
            r = r.header("X-Tenant-ID", t);
        }
        if let Some(a) = auth {
            r = r.header("Authorization", a);
        }
        r
    };
    let combos = [
        (Some("acme"), Some("Bearer alice")),
        (Some("globex"), Some("Bearer alice")),
        (Some("acme"), Some("Bearer bob")),
        (None, Some("Bearer alice")),
        (Some("acme"), None),
    ];
    for (t, a) in combos {
        assert_eq!(
            req(t, a).send(proxy.addr).await.result(),
            Some("MISS"),
            "{t:?} {a:?}"
        );
    }
    for (t, a) in combos {
        assert_eq!(
            req(t, a).send(proxy.addr).await.result(),
            Some("HIT"),
            "{t:?} {a:?}"
        );
    }
    assert_eq!(backend.count(), combos.len());
}

/// Twenty concurrent sends of one keyed POST to `path`, under `on_in_flight: wait`.
async fn waiting_duplicates(path: &str) -> (Backend, Vec<common::Response>) {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).waiting("10s").start().await;
    let req = Request::post(path).key("dup").json(r#"{"pay":100}"#);
    let tasks: Vec<_> = (0..20).map(|_| req.spawn_send(proxy.addr)).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    drop(proxy);
    (backend, out)
}

#[tokio::test]
async fn twenty_concurrent_duplicates_execute_once_reject_mode() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("on_in_flight: reject")
        .start()
        .await;
    // Whichever of the twenty claims first runs until the others are answered.
    let req = Request::post("/orders/gate/dup")
        .key("dup")
        .json(r#"{"pay":100}"#);
    let tasks: Vec<_> = (0..20).map(|_| req.spawn_send(proxy.addr)).collect();
    let started = std::time::Instant::now();
    while tasks.iter().filter(|t| t.is_finished()).count() < 19 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the duplicates were not answered while the original ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    backend.open("dup");
    let mut responses = Vec::new();
    for t in tasks {
        responses.push(t.await.unwrap());
    }
    assert_eq!(backend.count(), 1);
    let miss = responses
        .iter()
        .filter(|r| r.result() == Some("MISS"))
        .count();
    let conflicts: Vec<_> = responses.iter().filter(|r| r.status == 409).collect();
    assert_eq!(miss, 1);
    // Every duplicate came while the original ran: reject mode answers each 409.
    assert_eq!(conflicts.len(), 19);
    for c in conflicts {
        assert_eq!(c.result(), Some("CONFLICT"));
        assert_eq!(c.problem_type(), "request-in-flight");
        assert!(c
            .header("retry-after")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|s| s >= 1));
    }
}

#[tokio::test]
async fn twenty_concurrent_duplicates_execute_once_wait_mode() {
    let (backend, responses) = waiting_duplicates("/orders/slow/400").await;
    assert_eq!(backend.count(), 1);
    assert!(
        responses.iter().all(|r| r.status == 201),
        "{:?}",
        responses.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert_eq!(
        responses
            .iter()
            .filter(|r| r.result() == Some("MISS"))
            .count(),
        1
    );
    assert_eq!(
        responses
            .iter()
            .filter(|r| r.result() == Some("HIT"))
            .count(),
        19
    );
    assert!(responses.windows(2).all(|w| w[0].body == w[1].body));
}

/// A waiter whose client leaves gives up its turn: once the original is released, its request
/// is not run for nobody (found by a black-box probe: it ran 10 s after its client had gone).
#[tokio::test]
async fn a_waiter_whose_client_left_never_runs() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).waiting("10s").start().await;
    // The original runs until the test lets it answer, then fails: its key is released.
    let req = Request::post("/orders/gate/left/status/503")
        .key("left")
        .body("{}");
    let first = req.spawn_send(proxy.addr);
    backend.until_count(1).await;
    let mut waiter = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    waiter.write_all(&req.to_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(waiter);
    proxy
        .log_containing("client left while waiting for the first request with its key")
        .await;
    // Counted as what it was, a duplicate of a request in flight, not as a bad request.
    let m = proxy
        .metrics_containing("idemgate_requests_total{result=\"CONFLICT\",route=\"orders\"} 1")
        .await;
    let invalid = "idemgate_requests_total{result=\"INVALID\",route=\"orders\"}";
    assert_eq!(common::metric(&m, invalid), Some(0.0), "{m}");
    backend.open("left");
    assert_eq!(first.await.unwrap().status, 503);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(backend.count(), 1, "the request of a client that left ran");
    // The key is free for the client's own retry.
    assert_eq!(req.send(proxy.addr).await.status, 503);
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn wait_mode_gives_409_when_the_original_outlasts_wait_timeout() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).waiting("200ms").start().await;
    // The original runs until the test lets it answer.
    let req = Request::post("/orders/gate/slow-wait")
        .key("slow-wait")
        .body("{}");
    let addr = proxy.addr;
    let first = req.spawn_send(addr);
    backend.until_count(1).await;
    let started = std::time::Instant::now();
    let second = req.send(addr).await;
    assert_eq!((second.status, second.result()), (409, Some("CONFLICT")));
    assert_eq!(second.problem_type(), "request-in-flight");
    assert!(second
        .header("retry-after")
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|s| s >= 1));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "waited past wait_timeout"
    );
    backend.open("slow-wait");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(req.send(addr).await.result(), Some("HIT"));
}

#[tokio::test]
async fn server_errors_release_the_key_and_the_retry_keeps_its_execution_id() {
    let (backend, proxy) = setup().await;
    let req = Request::post("/orders/flaky/2").key("flaky").body("{}");
    let r1 = req.send(proxy.addr).await;
    assert_eq!((r1.status, r1.result()), (503, Some("MISS")));
    let r2 = req.send(proxy.addr).await;
    assert_eq!(r2.status, 503);
    let r3 = req.send(proxy.addr).await;
    assert_eq!((r3.status, r3.result()), (201, Some("MISS")));
    let r4 = req.send(proxy.addr).await;
    assert_eq!((r4.status, r4.result()), (201, Some("HIT")));
    let ids: Vec<_> = backend
        .executions()
        .into_iter()
        .map(|e| e.execution_id)
        .collect();
    assert_eq!(ids.len(), 3);
    assert!(ids[0].is_some());
    assert!(
        ids.iter().all(|id| *id == ids[0]),
        "same X-Idempotency-Id on every execution: {ids:?}"
    );
    // What became of each execution's key, for an operator (the hit ran nothing).
    let m = proxy.metrics().await;
    for (outcome, n) in [
        ("released", Some(2.0)),
        ("stored", Some(1.0)),
        ("unknown", Some(0.0)),
    ] {
        assert_eq!(
            common::key_outcome(&m, "orders", outcome),
            n,
            "{outcome}: {m}"
        );
    }
}

#[tokio::test]
async fn transient_statuses_are_released_and_client_errors_stored() {
    let (backend, proxy) = setup().await;
    for code in [500u16, 502, 408, 429] {
        let req = Request::post(&format!("/orders/status/{code}"))
            .key(&format!("k{code}"))
            .body("{}");
        assert_eq!(req.send(proxy.addr).await.status, code);
        assert_eq!(
            req.send(proxy.addr).await.result(),
            Some("MISS"),
            "{code} is released"
        );
    }
    assert_eq!(backend.count(), 8);
    for code in [400u16, 404, 409, 422] {
        let req = Request::post(&format!("/orders/status/{code}"))
            .key(&format!("k{code}"))
            .body("{}");
        let first = req.send(proxy.addr).await;
        let second = req.send(proxy.addr).await;
        assert_eq!((first.status, second.status), (code, code));
        assert_eq!(second.result(), Some("HIT"), "{code} is stored");
        assert_eq!(second.body, first.body);
    }
    assert_eq!(backend.count(), 12);
}

#[tokio::test]
async fn execution_ids_are_snowflakes_distinct_per_key() {
    let (backend, proxy) = setup().await;
    for i in 0..5 {
        Request::post("/orders")
            .key(&format!("id-{i}"))
            .body("{}")
            .send(proxy.addr)
            .await;
    }
    let ids: Vec<u64> = backend
        .executions()
        .iter()
        .map(|e| e.execution_id.as_deref().unwrap().parse().unwrap())
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "time-ordered: {ids:?}");
    for id in ids {
        let parts = idemgate::snowflake::decode(id);
        assert_eq!(parts.worker_id, 1);
    }
}

#[tokio::test]
async fn a_client_cannot_choose_the_execution_id_the_backend_sees() {
    let (backend, proxy) = setup().await;
    // Each also tries the spelling with underscores, which CGI-style backends read as the same.
    let keyed = Request::post("/orders")
        .key("own-id")
        .header("X-Idempotency-Id", "1")
        .header("X_Idempotency_Id", "1")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(keyed.result(), Some("MISS"));
    // Unprotected paths: an optional key absent, a plain route, and pingora's streaming path
    // (a chunked body).
    Request::post("/optional")
        .header("x-idempotency-id", "2")
        .header("x_idempotency_id", "2")
        .body("{}")
        .send(proxy.addr)
        .await;
    Request::post("/plain")
        .header("X-IDEMPOTENCY-ID", "3")
        .header("X_IDEMPOTENCY-ID", "3")
        .body("{}")
        .send(proxy.addr)
        .await;
    Request::post("/plain")
        .header("X-Idempotency-Id", "4")
        .header("X_Idempotency_Id", "4")
        .body("{\"chunked\":true}")
        .chunked(4)
        .send(proxy.addr)
        .await;
    let ex = backend.executions();
    assert_eq!(ex.len(), 4);
    let ids = |e: &common::backend::Execution| -> Vec<Vec<u8>> {
        e.headers
            .iter()
            .filter(|(n, _)| n.replace('_', "-").eq_ignore_ascii_case("x-idempotency-id"))
            .map(|(_, v)| v.clone())
            .collect()
    };
    let own = ids(&ex[0]);
    assert_eq!(own.len(), 1, "exactly one id: {own:?}");
    let id: u64 = std::str::from_utf8(&own[0]).unwrap().parse().unwrap();
    assert_eq!(
        idemgate::snowflake::decode(id).worker_id,
        1,
        "the proxy's own"
    );
    for e in &ex[1..] {
        assert!(ids(e).is_empty(), "{} {:?}", e.path, ids(e));
    }
}

/// The headers that chose a request's record (tenant, scope, key) spelt with `_` for `-` are
/// not forwarded, on idemgate's own client or pingora's streaming path: a CGI-style backend
/// reads `X_Tenant_ID` as `X-Tenant-ID`, and would act for another tenant than the one the
/// record was chosen under (found by a black-box probe). The real headers still go.
#[tokio::test]
async fn the_record_choosing_headers_cannot_be_spoofed_with_underscores() {
    let (backend, proxy) = setup().await;
    let spoofing = |r: Request| {
        r.header("X-Tenant-ID", "shop-a")
            .header("X_Tenant_ID", "shop-b")
            .header("Authorization", "Bearer a")
            .header("authorization_", "x")
            .header("Idempotency_Key", "other")
            .body("{}")
    };
    let keyed = spoofing(Request::post("/orders").key("under"))
        .send(proxy.addr)
        .await;
    assert_eq!(keyed.result(), Some("MISS"));
    spoofing(Request::post("/plain")).send(proxy.addr).await;
    spoofing(Request::post("/plain"))
        .chunked(1)
        .send(proxy.addr)
        .await;
    let ex = backend.executions();
    assert_eq!(ex.len(), 3);
    for e in &ex {
        let names: Vec<&str> = e.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            !names.iter().any(|n| n.eq_ignore_ascii_case("x_tenant_id")
                || n.eq_ignore_ascii_case("idempotency_key")),
            "{} {names:?}",
            e.path
        );
        assert!(
            names.iter().any(|n| n.eq_ignore_ascii_case("x-tenant-id")),
            "{names:?}"
        );
        // Not a spelling of Authorization: it goes as it came.
        assert!(names
            .iter()
            .any(|n| n.eq_ignore_ascii_case("authorization_")));
    }
}

#[tokio::test]
async fn a_replayed_no_content_answer_has_no_content_length() {
    let (backend, proxy) = setup().await;
    let req = Request::new("DELETE", "/orders/status/204").key("gone");
    let first = req.send(proxy.addr).await;
    assert_eq!((first.status, first.result()), (204, Some("MISS")));
    let again = req.send(proxy.addr).await;
    assert_eq!((again.status, again.result()), (204, Some("HIT")));
    assert_eq!(first.header("content-length"), None);
    assert_eq!(again.header("content-length"), None, "RFC 9110 §8.6");
    assert_eq!(again.header("transfer-encoding"), None, "RFC 9112 §6.1");
    assert!(again.body.is_empty());
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn completed_record_expires_after_ttl() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("ttl: 1s")
        .idem("lock_ttl: 1s")
        .upstream("connect_timeout: 100ms")
        .upstream("write_timeout: 100ms")
        .upstream("read_timeout: 500ms")
        .start()
        .await;
    let req = Request::post("/orders").key("ttl").body("{}");
    assert_eq!(req.send(proxy.addr).await.result(), Some("MISS"));
    assert_eq!(req.send(proxy.addr).await.result(), Some("HIT"));
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(req.send(proxy.addr).await.result(), Some("MISS"));
    let ids: Vec<_> = backend
        .executions()
        .into_iter()
        .map(|e| e.execution_id)
        .collect();
    assert_ne!(
        ids[0], ids[1],
        "an expired record starts over with a new execution id"
    );
}

/// A proxy whose backend answers `/orders/slow/800` after its read timeout (400 ms), with a
/// 1.5 s lock, under `on_outcome_unknown: <policy>`.
async fn losing_answers(backend: &Backend, policy: &str) -> Proxy {
    ProxyBuilder::new(backend)
        .idem("lock_ttl: 1500ms")
        .idem(&format!("on_outcome_unknown: {policy}"))
        .upstream("connect_timeout: 100ms")
        .upstream("write_timeout: 100ms")
        .upstream("read_timeout: 400ms")
        .start()
        .await
}

#[tokio::test]
async fn lost_outcome_keeps_the_lock_until_lock_ttl() {
    let backend = Backend::start().await;
    let proxy = losing_answers(&backend, "lapse").await;
    // The backend answers after the proxy's read timeout: outcome unknown.
    let req = Request::post("/orders/slow/800").key("lost").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!((first.status, first.result()), (504, Some("MISS")));
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    // When the lock has lapsed at the latest (1.5 s from the claim, 0.4 s or more of it spent),
    // in whole seconds rounded up: the earliest a retry can run.
    let retry_after = first
        .header("retry-after")
        .and_then(|v| v.parse::<u64>().ok());
    assert!(
        matches!(retry_after, Some(1 | 2)),
        "{:?}",
        first.header("retry-after")
    );
    let second = req.send(proxy.addr).await;
    assert_eq!(
        (second.status, second.result()),
        (409, Some("CONFLICT")),
        "the claim is kept while the outcome is unknown"
    );
    assert_eq!(second.problem_type(), "request-in-flight");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let third = Request::post("/orders/slow/800")
        .key("lost")
        .body("{}")
        .send(proxy.addr)
        .await;
    // Executes again after the lock lapsed, under the same execution id.
    assert_eq!(third.status, 504);
    let m = proxy.metrics().await;
    assert_eq!(
        common::key_outcome(&m, "orders", "unknown"),
        Some(2.0),
        "{m}"
    );
    let ids: Vec<_> = backend
        .executions()
        .into_iter()
        .map(|e| e.execution_id)
        .collect();
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[0], ids[1]);
}

#[tokio::test]
async fn a_lost_outcome_settled_is_never_executed_again() {
    let backend = Backend::start().await;
    let proxy = losing_answers(&backend, "settle").await;
    // The backend answers after the proxy's read timeout: outcome unknown, recorded at once.
    let req = Request::post("/orders/slow/800").key("settled").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!((first.status, first.result()), (504, Some("MISS")));
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    assert!(
        first.text().contains("recorded as executed"),
        "{}",
        first.text()
    );
    // Final: no retry will ever run it, so no Retry-After.
    assert_eq!(first.header("retry-after"), None);
    // Refused as executed, before the lock would have lapsed and after: never run again.
    for wait in [0, 1600] {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let retry = req.send(proxy.addr).await;
        assert_eq!((retry.status, retry.result()), (409, Some("CONFLICT")));
        assert_eq!(retry.problem_type(), "response-not-replayable");
    }
    assert_eq!(backend.count(), 1);
    proxy.log_containing("on_outcome_unknown: settle").await;
    let m = proxy.metrics().await;
    let outcome = |o: &str| common::key_outcome(&m, "orders", o);
    assert_eq!(
        (outcome("settled"), outcome("unknown")),
        (Some(1.0), Some(0.0)),
        "{m}"
    );

    // An answer cut off mid-body is settled the same way, under the status the backend gave.
    let (addr, count) = cutting_backend(1, "201 Created").await;
    let proxy = ProxyBuilder::at(addr)
        .idem("on_outcome_unknown: settle")
        .start()
        .await;
    let req = Request::post("/orders").key("cut-settled").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(first.status, 504, "{}", first.text());
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    let retry = req.send(proxy.addr).await;
    assert_eq!(
        (retry.status, retry.problem_type().as_str()),
        (409, "response-not-replayable")
    );
    assert_eq!(count.load(Ordering::SeqCst), 1, "never executed twice");

    // A status the route does not store, cut off: it said nothing ran, so the key is released
    // (502, as for a head that cannot be relayed) and a retry runs it, not spent for its ttl.
    let (addr, count) = cutting_backend(1, "503 Service Unavailable").await;
    let proxy = ProxyBuilder::at(addr)
        .idem("on_outcome_unknown: settle")
        .start()
        .await;
    let req = Request::post("/orders").key("cut-503").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(first.status, 502, "{}", first.text());
    assert_eq!(first.problem_type(), "upstream-answer-invalid");
    let retry = req.send(proxy.addr).await;
    assert_eq!(retry.status, 502, "{}", retry.text());
    assert_eq!(count.load(Ordering::SeqCst), 2, "released, so run again");
}

/// A backend that answers `status`, announces a 100-byte body, sends `pieces` pieces of 10 bytes
/// 100 ms apart and closes the connection; it counts the requests it reads.
async fn cutting_backend(
    pieces: usize,
    status: &'static str,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                // Read the whole request first, so closing sends FIN, not a reset.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let complete = |buf: &[u8]| {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        return false;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    buf.len() >= end + 4 + len
                };
                while !complete(&buf) {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let head = format!("HTTP/1.1 {status}\r\ncontent-length: 100\r\n\r\n");
                let _ = stream.write_all(head.as_bytes()).await;
                for _ in 0..pieces {
                    let _ = stream.write_all(b"0123456789").await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }
    });
    (addr, count)
}

#[tokio::test]
async fn a_response_cut_off_mid_body_keeps_the_claim() {
    // One piece: the proxy still holds the header back, so the client learns the truth (504).
    let (addr, count) = cutting_backend(1, "201 Created").await;
    let proxy = ProxyBuilder::at(addr).start().await;
    let req = Request::post("/orders").key("cut-early").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(first.status, 504, "{}", first.text());
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    let retry = req.send(proxy.addr).await;
    assert_eq!((retry.status, retry.result()), (409, Some("CONFLICT")));
    assert_eq!(
        retry.problem_type(),
        "request-in-flight",
        "kept, not settled"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1, "never executed twice");
    proxy.log_containing("backend answer cut off").await;

    // Two pieces: the header and the first piece already went out; the client's connection is
    // closed short of the announced length, and the outcome stays unknown (409) all the same.
    let (addr, count) = cutting_backend(2, "201 Created").await;
    let proxy = ProxyBuilder::at(addr).start().await;
    let req = Request::post("/orders").key("cut-late").body("{}");
    let mut stream = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    stream.write_all(&req.to_bytes()).await.expect("send");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("the proxy closes the connection")
        .expect("read");
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    assert!(
        body.len() < 100,
        "a cut-off body must not look complete: {text}"
    );
    let retry = req.send(proxy.addr).await;
    assert_eq!((retry.status, retry.result()), (409, Some("CONFLICT")));
    assert_eq!(
        retry.problem_type(),
        "request-in-flight",
        "kept, not settled"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1, "never executed twice");
    proxy.log_containing("backend answer cut off").await;
    // The request that ended in an error was still an execution: counted as a MISS.
    let metrics = proxy
        .metrics_containing("idemgate_requests_total{result=\"CONFLICT\"")
        .await;
    assert!(
        metrics.contains("idemgate_requests_total{result=\"MISS\",route=\"orders\"} 1"),
        "{metrics}"
    );
    let forwarded = metrics.lines().filter(|l| l.contains("result=\"FORWARD\""));
    assert!(forwarded.clone().all(|l| l.ends_with(" 0")), "{metrics}");
}

#[tokio::test]
async fn unreachable_backend_releases_the_key() {
    let dead = common::proxy::free_port();
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    drop(proxy);
    // A proxy whose orders upstream points at a closed port.
    let mut b2 = backend.clone();
    b2.addr = std::net::SocketAddr::from(([127, 0, 0, 1], dead));
    let proxy = ProxyBuilder::new(&b2).start().await;
    let req = Request::post("/orders").key("down").body("{}");
    let r = req.send(proxy.addr).await;
    assert_eq!((r.status, r.result()), (502, Some("MISS")));
    assert_eq!(r.problem_type(), "upstream-unreachable");
    // Released: the retry is tried again (not 409).
    let again = req.send(proxy.addr).await;
    assert_eq!((again.status, again.result()), (502, Some("MISS")));
    let plain = Request::post("/plain").body("{}").send(proxy.addr).await;
    assert_eq!(plain.status, 502);
    // Failed rounds are in the backend's latency too, keyed or not: a backend that fails every
    // request must not look idle there.
    let m = proxy.metrics().await;
    for (route, rounds) in [("orders", 2.0), ("plain", 1.0)] {
        let name = format!("idemgate_upstream_duration_seconds_count{{route=\"{route}\"}}");
        assert_eq!(common::metric(&m, &name), Some(rounds), "{route}: {m}");
    }
    // Keys only: the plain route's request had no claim.
    assert_eq!(
        common::key_outcome(&m, "orders", "unreachable"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        common::key_outcome(&m, "plain", "unreachable"),
        Some(0.0),
        "{m}"
    );
}

#[tokio::test]
async fn responses_over_the_limit_are_streamed_and_never_executed_twice() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("max_response_bytes: 1KiB")
        .start()
        .await;
    let req = Request::post("/orders/large/5000").key("big").body("{}");
    let first = req.send(proxy.addr).await;
    assert_eq!(first.status, 200);
    assert_eq!(
        first.body.len(),
        5000,
        "the client still gets the whole response"
    );
    let second = req.send(proxy.addr).await;
    assert_eq!(second.status, 409);
    assert_eq!(second.result(), Some("CONFLICT"));
    assert_eq!(second.problem_type(), "response-not-replayable");
    assert_eq!(backend.count(), 1);
    let m = proxy.metrics().await;
    assert_eq!(
        common::key_outcome(&m, "orders", "not_replayable"),
        Some(1.0),
        "{m}"
    );
    // At the limit exactly, it is stored.
    let edge = Request::post("/orders/large/1024").key("edge").body("{}");
    edge.send(proxy.addr).await;
    assert_eq!(edge.send(proxy.addr).await.result(), Some("HIT"));
}

#[tokio::test]
async fn one_mebibyte_and_chunked_bodies_reach_the_backend_whole() {
    let (backend, proxy) = setup().await;
    let body: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    let req = Request::post("/orders/echo").key("1mib").body(body.clone());
    let first = req.send(proxy.addr).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body, body);
    assert_eq!(backend.executions()[0].body, body);
    assert_eq!(req.send(proxy.addr).await.result(), Some("HIT"));

    let chunked_body: Vec<u8> = (0..300 * 1024).map(|i| (i % 7) as u8).collect();
    let req = Request::post("/orders/echo")
        .key("chunked")
        .body(chunked_body.clone())
        .chunked(16 * 1024);
    let r = req.send(proxy.addr).await;
    assert_eq!(r.status, 200);
    assert_eq!(backend.executions()[1].body, chunked_body);
    // The same body sent with other chunk sizes is the same request.
    let again = Request::post("/orders/echo")
        .key("chunked")
        .body(chunked_body)
        .chunked(1000);
    assert_eq!(again.send(proxy.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn bodies_over_the_limit_are_413_and_never_forwarded() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("max_request_bytes: 64KiB")
        .start()
        .await;
    let big = vec![b'x'; 64 * 1024 + 1];
    let r = Request::post("/orders")
        .key("big1")
        .body(big.clone())
        .send(proxy.addr)
        .await;
    assert_eq!(r.status, 413);
    assert_eq!(r.problem_type(), "request-too-large");
    let r = Request::post("/orders")
        .key("big2")
        .body(big)
        .chunked(8192)
        .send(proxy.addr)
        .await;
    assert_eq!(r.status, 413);
    assert_eq!(r.result(), Some("INVALID"));
    assert_eq!(backend.count(), 0);
    let ok = Request::post("/orders")
        .key("fits")
        .body(vec![b'x'; 64 * 1024])
        .send(proxy.addr)
        .await;
    assert_eq!(ok.result(), Some("MISS"));
}

#[tokio::test]
async fn expect_continue_is_answered_and_not_forwarded() {
    let (backend, proxy) = setup().await;
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: cont\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = [0u8; 64];
    use tokio::io::AsyncReadExt;
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    s.write_all(b"{}").await.unwrap();
    let r = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(r.status, 201);
    let e = &backend.executions()[0];
    assert!(e.headers.iter().all(|(n, _)| n != "expect"));
    assert_eq!(e.body, b"{}");
    // The connection is kept, as for any request whose body was read whole (libcurl sends
    // `Expect` on larger bodies: a keyed route must not cost such clients a connection each).
    assert_eq!(r.header("connection"), Some("keep-alive"));
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: cont\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n{}",
    )
    .await
    .unwrap();
    let replay = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!((replay.status, replay.result()), (201, Some("HIT")));
    assert_eq!(replay.header("connection"), Some("keep-alive"));
}

#[tokio::test]
async fn client_disconnect_does_not_lose_the_outcome() {
    let (backend, proxy) = setup().await;
    use tokio::io::AsyncWriteExt;
    let req = Request::post("/orders/slow/500")
        .key("gone")
        .body("{\"a\":1}");
    {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(&req.to_bytes()).await.unwrap();
        backend.until_count(1).await;
        // Dropped: the client goes away while the backend is still working.
    }
    // Until the backend answers (500 ms) the retry is told the key is in flight; then the
    // outcome stored after the client left is replayed.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let retry = req.send(proxy.addr).await;
        if retry.result() != Some("CONFLICT") || std::time::Instant::now() > deadline {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        retry.result(),
        Some("HIT"),
        "the outcome was stored after the client left: {}",
        retry.text()
    );
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn routes_without_idempotency_forward_untouched() {
    let (backend, proxy) = setup().await;
    let plain = Request::post("/plain")
        .key("p")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(plain.status, 201);
    assert_eq!(plain.result(), None);
    let plain2 = Request::post("/plain")
        .key("p")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(plain2.result(), None);
    // A method the idempotent route does not list.
    let get = Request::get("/orders").key("g").send(proxy.addr).await;
    assert_eq!(get.status, 201);
    assert_eq!(get.result(), None);
    // Optional key absent: forwarded, marked BYPASS, not stored.
    let opt = Request::post("/optional").body("{}").send(proxy.addr).await;
    assert_eq!((opt.status, opt.result()), (201, Some("BYPASS")));
    let opt = Request::post("/optional").body("{}").send(proxy.addr).await;
    assert_eq!(opt.result(), Some("BYPASS"));
    // Optional key present: protected.
    let k = Request::post("/optional").key("o").body("{}");
    assert_eq!(k.send(proxy.addr).await.result(), Some("MISS"));
    assert_eq!(k.send(proxy.addr).await.result(), Some("HIT"));
    assert_eq!(backend.count(), 6);
    // No execution id on the plain route, the unlisted method or the bypass: only on the
    // protected execution (the last).
    let ids: Vec<_> = backend
        .executions()
        .iter()
        .map(|e| (e.method.clone(), e.path.clone(), e.execution_id.is_some()))
        .collect();
    assert!(
        ids[..5].iter().all(|(_, _, id)| !id),
        "idempotency headers where nothing is protected: {ids:?}"
    );
    assert_eq!(ids[2].0, "GET", "{ids:?}");
    assert!(ids[5].2, "{ids:?}");
    // No route and no default upstream.
    let none = Request::post("/nowhere").body("{}").send(proxy.addr).await;
    assert_eq!(none.status, 404);
    assert_eq!(none.problem_type(), "no-route");
    // Counted as refused, not as forwarded traffic (once logged: the count comes after the
    // answer, so it is waited for).
    let m = proxy
        .metrics_containing("idemgate_requests_total{result=\"REFUSED\",route=\"-\"} 1")
        .await;
    assert!(
        m.contains("idemgate_requests_total{result=\"FORWARD\",route=\"-\"} 0"),
        "{m}"
    );
    // A key sent where nothing protects it is counted by route: a client that believes it is
    // protected and is not (the plain route twice, the unlisted method once; the optional
    // route's bypass carried no key, and its keyed requests were protected).
    for (route, n) in [
        ("plain", Some(2.0)),
        ("orders", Some(1.0)),
        ("optional", Some(0.0)),
    ] {
        assert_eq!(
            common::metric(
                &m,
                &format!("idemgate_unprotected_keys_total{{route=\"{route}\"}}")
            ),
            n,
            "{m}"
        );
    }
    // The log writer's losses are exported (none here).
    assert_eq!(
        common::metric(&m, "idemgate_log_lines_dropped_total"),
        Some(0.0),
        "{m}"
    );
}

#[tokio::test]
async fn full_store_refuses_new_claims_with_503() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .store("memory: { capacity: 64KiB, shards: 1 }")
        .start()
        .await;
    let mut codes = Vec::new();
    for i in 0..1000 {
        let r = Request::post("/orders")
            .key(&format!("fill-{i}"))
            .body("{}")
            .send(proxy.addr)
            .await;
        codes.push(r.status);
        if r.status == 503 {
            assert_eq!(r.result(), Some("UNAVAILABLE"));
            assert_eq!(r.problem_type(), "store-full");
            assert!(r.header("retry-after").is_some());
            break;
        }
    }
    assert_eq!(codes.last(), Some(&503), "the store filled up");
    assert_eq!(
        backend.count(),
        codes.len() - 1,
        "the refused claim never reached the backend"
    );
    // Live records are never forgotten: the first key still replays.
    let first = Request::post("/orders")
        .key("fill-0")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(first.result(), Some("HIT"));
}

/// A slow keyed request, sent in the background.
fn slow_order(proxy: &Proxy, ms: u64, key: &str) -> tokio::task::JoinHandle<Response> {
    Request::post(&format!("/orders/slow/{ms}"))
        .key(key)
        .body("{}")
        .spawn_send(proxy.addr)
}

/// Waits (off the runtime) for `proxy` to exit, and gives it back for its log.
async fn exit_of(mut proxy: Proxy) -> (Option<std::process::ExitStatus>, Proxy) {
    tokio::task::spawn_blocking(move || (proxy.wait_exit(Duration::from_secs(15)), proxy))
        .await
        .unwrap()
}

/// `signal` drains: the request in flight finishes and is stored, then the process exits 0
/// without sitting out the grace period, and new connections are refused.
async fn drains_on(signal: &str) {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let addr = proxy.addr;
    // In flight until the test lets it answer.
    let inflight = Request::post("/orders/gate/drain")
        .key("drain")
        .body("{}")
        .spawn_send(addr);
    backend.until_count(1).await;
    proxy.signal(signal);
    let started = std::time::Instant::now();
    // Draining: new connections are refused while the request in flight still runs.
    assert!(
        common::client::refused_while(addr, &inflight).await,
        "a new connection was still accepted when the drain ended"
    );
    backend.open("drain");
    let resp = inflight.await.unwrap();
    assert_eq!((resp.status, resp.result()), (201, Some("MISS")));
    let (status, proxy) = exit_of(proxy).await;
    let status = status.expect("exited within the grace period");
    assert!(status.success(), "exit status {status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "did not wait out the whole grace period"
    );
    // One summary line: what the drain waited for and what the process leaves behind.
    let log = proxy.log();
    let summary = log
        .lines()
        .find(|l| l.contains("drained; exiting"))
        .unwrap_or_else(|| panic!("no summary line:\n{log}"));
    for field in [
        "requests_at_signal=1",
        "dead_letters=0",
        "dead_letters_not_written=0",
        "drained_in_ms=",
    ] {
        assert!(summary.contains(field), "{field} in {summary}");
    }
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests_and_exits_zero() {
    drains_on("TERM").await;
}

#[tokio::test]
async fn sigquit_drains_as_sigterm_does() {
    drains_on("QUIT").await;
}

/// SIGINT is the fast stop: no drain, the request in flight is cut off, and the process exits
/// 0 at once rather than when that request would have finished.
#[tokio::test]
async fn sigint_stops_at_once_without_a_drain() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let inflight = slow_order(&proxy, 8000, "interrupted");
    backend.until_count(1).await;
    proxy.signal("INT");
    let started = std::time::Instant::now();
    let (status, proxy) = exit_of(proxy).await;
    let status = status.unwrap_or_else(|| panic!("not exited; log:\n{}", proxy.log()));
    assert!(status.success(), "exit status {status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "waited for the request in flight: {:?}\n{}",
        started.elapsed(),
        proxy.log()
    );
    inflight.abort();
}

#[tokio::test]
async fn a_drain_that_runs_out_says_which_requests_it_cuts_off() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("shutdown: {grace_period: 1s, graceful_shutdown_timeout: 1s}")
        .start()
        .await;
    let inflight = slow_order(&proxy, 4000, "cut");
    backend.until_count(1).await;
    proxy.signal("TERM");
    let log = proxy
        .log_containing("shutdown.grace_period is running out with requests in flight")
        .await;
    let told = log
        .lines()
        .find(|l| l.contains("is running out"))
        .unwrap_or_default();
    assert!(
        told.contains("requests=1"),
        "the one request in flight: {told}"
    );
    let _ = inflight.await;
    let (status, proxy) = exit_of(proxy).await;
    assert!(status.is_some(), "exited once the grace period ran out");
    // The request cut off still has its access line, named by route and record.
    let log = proxy.log();
    let line = log
        .lines()
        .find(|l| l.contains("idemgate::access") && l.contains("cut off: the process stopped"))
        .unwrap_or_else(|| panic!("no access line for the request cut off:\n{log}"));
    assert!(
        line.contains("route=\"orders\"")
            && line.contains("result=\"MISS\"")
            && line.contains("record="),
        "{line}"
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "a SIGTERM stop exits 0 even when the drain ran out: {status:?}"
    );
}

#[tokio::test]
async fn admin_endpoints_and_metrics() {
    let (_backend, proxy) = setup().await;
    Request::post("/orders")
        .key("secret-key-value")
        .body("{}")
        .send(proxy.addr)
        .await;
    Request::post("/orders")
        .key("secret-key-value")
        .body("{}")
        .send(proxy.addr)
        .await;
    Request::post("/orders").body("{}").send(proxy.addr).await;
    assert_eq!(Request::get("/healthz").send(proxy.admin).await.status, 200);
    assert_eq!(Request::get("/readyz").send(proxy.admin).await.status, 200);
    // Metrics are recorded after the response is written: wait for the last one.
    let m = proxy
        .metrics_containing(r#"idemgate_requests_total{result="INVALID",route="orders"} 1"#)
        .await;
    assert!(
        m.contains(r#"idemgate_requests_total{result="MISS",route="orders"} 1"#),
        "{m}"
    );
    assert!(m.contains(r#"idemgate_requests_total{result="HIT",route="orders"} 1"#));
    assert!(m.contains(r#"idemgate_requests_total{result="INVALID",route="orders"} 1"#));
    assert!(m.contains("idemgate_request_duration_seconds_bucket"));
    assert!(m.contains("idemgate_store_records 1"));
    assert!(
        m.contains("idemgate_store_answers_kept_as_status_total 0"),
        "{m}"
    );
    assert!(!m.contains("secret-key-value"));
    let log = proxy.log_written().await;
    assert_eq!(log.matches("idemgate::access").count(), 4, "{log}");
    assert!(!log.contains("secret-key-value"), "raw keys never logged");
    assert_eq!(Request::get("/nope").send(proxy.admin).await.status, 404);
}

#[tokio::test]
async fn forwarding_headers_reach_the_backend_as_the_client_sent_them() {
    let (backend, proxy) = setup().await;
    let sent = [
        ("X-Forwarded-For", "203.0.113.7, 198.51.100.2"),
        ("X-Forwarded-Proto", "https"),
        ("Forwarded", "for=203.0.113.7;proto=https"),
    ];
    let with = |mut req: Request| {
        for (name, value) in sent {
            req = req.header(name, value);
        }
        req
    };
    // A keyed request (idemgate's own client), a small forwarded one (the same client) and a
    // chunked forwarded one (pingora's path).
    with(Request::post("/orders").key("fwd").body("{}"))
        .send(proxy.addr)
        .await;
    with(Request::post("/plain").body("{}"))
        .send(proxy.addr)
        .await;
    with(
        Request::post("/plain")
            .body("{\"chunked\":true}")
            .chunked(4),
    )
    .send(proxy.addr)
    .await;
    let executions = backend.executions();
    assert_eq!(executions.len(), 3);
    for e in &executions {
        let forwarding: Vec<(String, String)> = e
            .headers
            .iter()
            .filter(|(n, _)| n.to_ascii_lowercase().contains("forwarded"))
            .map(|(n, v)| {
                (
                    n.to_ascii_lowercase(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            })
            .collect();
        let expected: Vec<(String, String)> = sent
            .iter()
            .map(|(n, v)| (n.to_ascii_lowercase(), v.to_string()))
            .collect();
        assert_eq!(forwarding, expected, "{} {}", e.method, e.path);
    }
}

#[tokio::test]
async fn waiters_on_a_released_original_run_it_once_more_and_replay_that() {
    // The first execution answers 503 after 400 ms (released); the next one answers 201.
    let (backend, responses) = waiting_duplicates("/orders/flaky/1/slow/400").await;
    let ids: Vec<_> = backend
        .executions()
        .into_iter()
        .map(|e| e.execution_id)
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "the released key runs once more, not once per waiter"
    );
    assert!(ids[0].is_some() && ids[0] == ids[1], "{ids:?}");
    let count = |status: u16, result: &str| {
        responses
            .iter()
            .filter(|r| r.status == status && r.result() == Some(result))
            .count()
    };
    let summary: Vec<_> = responses.iter().map(|r| (r.status, r.result())).collect();
    assert_eq!(count(503, "MISS"), 1, "{summary:?}");
    assert_eq!(count(201, "MISS"), 1, "{summary:?}");
    // The waiters that came with the first execution replay the second; any that reached the
    // proxy only after the 503 went out would have been the one to run it.
    assert_eq!(count(201, "HIT"), 18, "{summary:?}");
    let executed = responses
        .iter()
        .find(|r| r.status == 201 && r.result() == Some("MISS"))
        .unwrap();
    assert!(responses
        .iter()
        .filter(|r| r.result() == Some("HIT"))
        .all(|r| r.body == executed.body));
}

#[tokio::test]
async fn a_changed_payload_is_422_while_in_flight_and_after_a_release() {
    let (backend, proxy) = setup().await;
    // In flight: the original runs for 800 ms; another body under its key is a mismatch, not
    // a conflict, and the original's fingerprint is the one that holds.
    let original = Request::post("/orders/slow/800")
        .key("k422-live")
        .json(r#"{"a":1}"#);
    let running = original.spawn_send(proxy.addr);
    backend.until_count(1).await;
    let changed = Request::post("/orders/slow/800")
        .key("k422-live")
        .json(r#"{"a":2}"#)
        .send(proxy.addr)
        .await;
    assert_eq!(
        (changed.status, changed.result()),
        (422, Some("MISMATCH")),
        "{}",
        changed.text()
    );
    assert_eq!(changed.problem_type(), "fingerprint-mismatch");
    let same = original.send(proxy.addr).await;
    assert_eq!((same.status, same.result()), (409, Some("CONFLICT")));
    assert_eq!(running.await.unwrap().result(), Some("MISS"));

    // Released: the record keeps its fingerprint, so only the original payload may run again.
    let flaky = Request::post("/orders/flaky/1")
        .key("k422-released")
        .json(r#"{"a":1}"#);
    let first = flaky.send(proxy.addr).await;
    assert_eq!((first.status, first.result()), (503, Some("MISS")));
    let changed = Request::post("/orders/flaky/1")
        .key("k422-released")
        .json(r#"{"a":2}"#)
        .send(proxy.addr)
        .await;
    assert_eq!((changed.status, changed.result()), (422, Some("MISMATCH")));
    assert_eq!(backend.count(), 2, "a mismatch is never forwarded");
    let retry = flaky.send(proxy.addr).await;
    assert_eq!((retry.status, retry.result()), (201, Some("MISS")));
    let ids: Vec<_> = backend
        .executions()
        .into_iter()
        .map(|e| e.execution_id)
        .collect();
    assert_eq!(ids.len(), 3);
    assert_eq!(
        ids[1], ids[2],
        "the retry runs under the released record's id"
    );
}

#[tokio::test]
async fn a_route_stores_the_statuses_its_cache_statuses_name() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem(r#"cache_statuses: ["2xx", "3xx", "4xx", "!409"]"#)
        .start()
        .await;
    // (path, stored): a 303 (Post/Redirect/Get) is stored once 3xx is named; an excluded 409 is
    // released; a 500 no class names is released.
    for (path, stored) in [
        ("/orders/status/303", true),
        ("/orders/status/404", true),
        ("/orders/status/409", false),
        ("/orders/status/500", false),
    ] {
        let before = backend.count();
        let req = Request::post(path).key(path).body("{}");
        let first = req.send(proxy.addr).await;
        assert_eq!(first.result(), Some("MISS"), "{path}");
        let second = req.send(proxy.addr).await;
        let (result, runs) = if stored { ("HIT", 1) } else { ("MISS", 2) };
        assert_eq!(second.result(), Some(result), "{path}");
        assert_eq!(second.status, first.status, "{path}");
        assert_eq!(backend.count() - before, runs, "{path}");
    }
}

#[tokio::test]
async fn a_configured_key_header_and_tenant_header_are_the_ones_read() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .global("key_header: X-Request-Key")
        .global("tenant_header: X-Org")
        .start()
        .await;
    let req = |org: &str| {
        Request::post("/orders")
            .header("X-Request-Key", "rk-1")
            .header("X-Org", org)
            .body("{}")
    };
    assert_eq!(req("acme").send(proxy.addr).await.result(), Some("MISS"));
    assert_eq!(req("acme").send(proxy.addr).await.result(), Some("HIT"));
    // The configured tenant header scopes the key.
    assert_eq!(req("globex").send(proxy.addr).await.result(), Some("MISS"));
    assert_eq!(backend.count(), 2);
    // The default header names mean nothing here: no key on a route that requires one, and an
    // optional route bypasses.
    let default_named = Request::post("/orders").key("rk-1").body("{}");
    let r = default_named.send(proxy.addr).await;
    assert_eq!((r.status, r.result()), (400, Some("INVALID")));
    assert_eq!(r.problem_type(), "idempotency-key-missing");
    let r = Request::post("/optional")
        .key("rk-1")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(r.result(), Some("BYPASS"));
    let r = Request::post("/optional")
        .header("X-Request-Key", "rk-2")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(r.result(), Some("MISS"));
    assert_eq!(backend.count(), 4);
}

#[tokio::test]
async fn without_the_body_in_the_fingerprint_another_body_replays_the_first() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .idem("fingerprint: { body: false, headers: [] }")
        .start()
        .await;
    let first = Request::post("/orders")
        .key("no-body-fp")
        .json(r#"{"a":1}"#)
        .send(proxy.addr)
        .await;
    assert_eq!(first.result(), Some("MISS"));
    let other = Request::post("/orders")
        .key("no-body-fp")
        .json(r#"{"a":2}"#)
        .send(proxy.addr)
        .await;
    assert_eq!(other.result(), Some("HIT"), "{}", other.text());
    assert_eq!(other.body, first.body);
    // The path still counts.
    let elsewhere = Request::post("/orders/other")
        .key("no-body-fp")
        .json(r#"{"a":1}"#)
        .send(proxy.addr)
        .await;
    assert_eq!(elsewhere.status, 422);
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn expect_continue_with_a_bad_key_is_refused_without_inviting_the_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (backend, proxy) = setup().await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: \"unbalanced\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 400 "), "{text}");
    assert!(!text.contains("100 Continue"), "{text}");
    assert!(text.contains("/problems/idempotency-key-invalid"), "{text}");
    assert_eq!(backend.count(), 0);
}

/// A length declared as agreeing copies (`2000000, 2000000`, or the same value on two lines:
/// pingora frames the body by it) is read as the one length it is: over the route's
/// `max_request_bytes` it is refused (413) before the body is invited, not once
/// `max_request_bytes` of it have been uploaded.
#[tokio::test]
async fn a_length_declared_twice_over_the_limit_is_refused_without_inviting_the_body() {
    use tokio::io::AsyncWriteExt;
    let (backend, proxy) = setup().await;
    for lengths in [
        "Content-Length: 2000000, 2000000",
        "Content-Length: 2000000\r\nContent-Length: 2000000",
    ] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: twice\r\n{lengths}\r\n\
             Expect: 100-continue\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let got = common::client::until_closed(&mut s).await;
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 413 "), "{lengths}: {text}");
        assert!(!text.contains("100 Continue"), "{lengths}: {text}");
    }
    assert_eq!(backend.count(), 0);
}

/// `on_in_flight: wait` replays only an answer it can replay: a waiter whose original ended
/// with its outcome unknown (the backend's answer lost: the claim stays until `lock_ttl`) or
/// with an answer too large to keep gets 409, and never runs the key itself.
#[tokio::test]
async fn a_waiter_never_runs_a_key_whose_original_ended_unknown_or_unreplayable() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .upstream("connect_timeout: 200ms")
        .upstream("write_timeout: 300ms")
        .upstream("read_timeout: 400ms")
        .idem("lock_ttl: 5s")
        .waiting("2s")
        .idem("max_response_bytes: 1KiB")
        .start()
        .await;
    let cases = [
        // The backend answers after read_timeout: 504, outcome unknown.
        ("/orders/slow/1500", "lost", 504, "request-in-flight"),
        // 5000 bytes against a 1 KiB limit: relayed, recorded as not replayable.
        (
            "/orders/slow/250/large/5000",
            "large",
            200,
            "response-not-replayable",
        ),
    ];
    for (n, (path, key, first_status, waiter_problem)) in cases.into_iter().enumerate() {
        let req = Request::post(path).key(key).body("{}");
        let first = req.spawn_send(proxy.addr);
        backend.until_count(n + 1).await;
        let waiter = req.send(proxy.addr).await;
        assert_eq!(first.await.unwrap().status, first_status, "{path}");
        assert_eq!(waiter.status, 409, "{path}: {}", waiter.text());
        assert_eq!(waiter.problem_type(), waiter_problem, "{path}");
        assert_eq!(backend.count(), n + 1, "{path}: the waiter ran nothing");
    }
}
