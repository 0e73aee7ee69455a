//! Hostile and malformed input, table-driven: each case has its expected answer, the proxy
//! stays up, and nothing reaches the backend or the store unless the case says so.

mod common;

use std::time::Duration;

use common::{Backend, Proxy, ProxyBuilder, Request};

/// What a case expects: the status, and whether the backend may see it.
struct Case {
    name: &'static str,
    req: Request,
    status: u16,
    forwarded: bool,
}

fn post() -> Request {
    Request::post("/orders").body("{}")
}

fn cases() -> Vec<Case> {
    let long = "k".repeat(256);
    let c = |name, req, status, forwarded| Case {
        name,
        req,
        status,
        forwarded,
    };
    vec![
        c("no key", post(), 400, false),
        c("empty key", post().key(""), 400, false),
        c("blank key", post().key("   "), 400, false),
        c("256-char key", post().key(&long), 400, false),
        c(
            "256-char quoted key",
            post().key(&format!("\"{long}\"")),
            400,
            false,
        ),
        c("control char", post().key("a\x01b"), 400, false),
        c("tab inside", post().key("a\tb"), 400, false),
        c("DEL char", post().key("a\x7fb"), 400, false),
        c("non-ASCII", post().key("ключ"), 400, false),
        c(
            "latin-1 byte",
            post().header("Idempotency-Key", b"caf\xe9".as_slice()),
            400,
            false,
        ),
        c("unbalanced quote", post().key("\"abc"), 400, false),
        c("quote in bare token", post().key("ab\"c"), 400, false),
        c("junk after quote", post().key("\"abc\"def"), 400, false),
        c("bad sf escape", post().key("\"a\\nb\""), 400, false),
        c("lone backslash", post().key("\"a\\\""), 400, false),
        c("space in quotes", post().key("\"a b\""), 400, false),
        c("folded list", post().key("a, b"), 400, false),
        c("repeated, different", post().key("a").key("b"), 400, false),
        c(
            "tenant with colon ok",
            post().key("t1").header("X-Tenant-ID", "acme:eu"),
            201,
            true,
        ),
        c(
            "tenant with {",
            post().key("t2").header("X-Tenant-ID", "a{b"),
            400,
            false,
        ),
        c(
            "tenant with }",
            post().key("t3").header("X-Tenant-ID", "a}b"),
            400,
            false,
        ),
        c(
            "tenant with space",
            post().key("t4").header("X-Tenant-ID", "a b"),
            400,
            false,
        ),
        c(
            "tenant 10 KiB",
            post()
                .key("t5")
                .header("X-Tenant-ID", "x".repeat(10 * 1024)),
            400,
            false,
        ),
        c(
            "tenant empty",
            post().key("t6").header("X-Tenant-ID", ""),
            400,
            false,
        ),
        c(
            "tenant slash",
            post().key("t7").header("X-Tenant-ID", "a/b"),
            400,
            false,
        ),
        c(
            "body over limit with length",
            Request::post("/orders")
                .key("b1")
                .body(vec![b'x'; 70 * 1024]),
            413,
            false,
        ),
        c(
            "body over limit chunked",
            Request::post("/orders")
                .key("b2")
                .body(vec![b'x'; 70 * 1024])
                .chunked(4096),
            413,
            false,
        ),
        c(
            "declared length over limit",
            Request::post("/orders")
                .key("b3")
                .header("Content-Length", "999999999"),
            413,
            false,
        ),
        c("repeated, equal", post().key("same").key("same"), 201, true),
        c(
            "quoted and bare equal",
            post().key("qb").key("\"qb\""),
            201,
            true,
        ),
        c("255-char key", post().key(&"k".repeat(255)), 201, true),
        c(
            "lower-case post",
            Request::new("post", "/orders").key("m1").body("{}"),
            400,
            false,
        ),
        c(
            "mixed-case Post",
            Request::new("Post", "/orders").key("m2").body("{}"),
            400,
            false,
        ),
        c(
            "lower-case get, no route idempotency",
            Request::new("get", "/plain"),
            400,
            false,
        ),
    ]
}

async fn proxy(backend: &Backend) -> Proxy {
    ProxyBuilder::new(backend)
        .idem("max_request_bytes: 64KiB")
        .start()
        .await
}

#[tokio::test]
async fn every_bad_input_gets_its_answer_and_nothing_is_stored() {
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    let cases = cases();
    assert!(cases.len() >= 30);
    let mut forwarded = 0;
    for case in &cases {
        let resp = case.req.send(proxy.addr).await;
        assert_eq!(resp.status, case.status, "{}: {}", case.name, resp.text());
        // Refusals by idemgate are problem+json marked INVALID; a request the HTTP parser
        // itself rejects (e.g. a control byte in a header) never reaches a route.
        if case.status >= 400 {
            match resp.result() {
                Some(result) => {
                    assert_eq!(result, "INVALID", "{}", case.name);
                    assert_eq!(
                        resp.header("content-type"),
                        Some("application/problem+json"),
                        "{}",
                        case.name
                    );
                }
                None => assert_eq!(resp.status, 400, "{}: rejected by the parser", case.name),
            }
        }
        if case.forwarded {
            forwarded += 1;
        }
        assert_eq!(
            backend.count(),
            forwarded,
            "{}: the backend count",
            case.name
        );
        // The proxy is still up and serving after every case.
        let probe = Request::post("/plain").body("{}").send(proxy.addr).await;
        assert_eq!(probe.status, 201, "after {}", case.name);
        forwarded += 1;
    }
    // A method in the wrong case is refused before any route: counted as INVALID, unrouted.
    let method_case = cases.iter().filter(|c| c.name.contains("-case ")).count();
    assert_eq!(method_case, 3);
    proxy
        .metrics_containing(&format!(
            r#"idemgate_requests_total{{result="INVALID",route="-"}} {method_case}"#
        ))
        .await;
    // Nothing malformed was stored: only the accepted cases hold records.
    let m = proxy.metrics().await;
    let records: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_store_records "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert_eq!(records, cases.iter().filter(|c| c.forwarded).count() as f64);
}

#[tokio::test]
async fn a_body_that_never_ends_is_cut_off_by_the_read_timeout() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_body_timeout: 300ms")
        .start()
        .await;
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: slow\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let r = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(r.status, 408);
    assert_eq!(r.problem_type(), "request-timeout");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(backend.count(), 0);
}

#[tokio::test]
async fn query_order_and_absolute_form_are_fingerprinted_as_sent() {
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    let a = Request::post("/orders?a=1&b=2")
        .key("q")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(a.result(), Some("MISS"));
    // The same parameters in another order are another request: refused, never replayed.
    let b = Request::post("/orders?b=2&a=1")
        .key("q")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(b.status, 422);
    // An absolute-form target is routed like its path.
    let abs = Request::post("http://test/orders")
        .key("abs")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(abs.result(), Some("MISS"), "{}", abs.text());
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_the_outcome_is_still_stored() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const LEN: usize = 16 << 20;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("response_send_timeout: 300ms")
        .idem("max_response_bytes: 32MiB")
        .start()
        .await;
    let order = || {
        Request::post(&format!("/orders/large/{LEN}"))
            .key("stalled")
            .body("{}")
    };
    // A 16 MiB answer to a client that reads nothing, with a small receive buffer: far more
    // than the kernel buffers between them hold.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(proxy.addr).await.unwrap();
    stalled.write_all(&order().to_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The proxy gave up on this client: what it had sent is all there is, and the connection
    // is closed rather than waiting for the client to read on.
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut got))
        .await
        .expect("the proxy closed the stalled connection");
    assert!(got.len() < LEN, "cut off, got {} bytes", got.len());
    // The execution's outcome was stored all the same: a retry is replayed whole.
    let retry = order().send(proxy.addr).await;
    assert_eq!((retry.status, retry.result()), (200, Some("HIT")));
    assert_eq!(retry.body.len(), LEN);
    assert_eq!(backend.count(), 1);
}
