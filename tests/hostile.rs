//! Hostile and malformed input, table-driven: each case has its expected answer, the proxy
//! stays up, and nothing reaches the backend or the store unless the case says so.

mod common;

use std::time::Duration;

use common::client::until_closed;
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

/// A body refused by its declared length (413) while the client is still sending it: the
/// proxy reads and drops the rest before it closes, so the client reads its 413 and then the
/// end of the connection, not a reset that can overtake the answer.
#[tokio::test]
async fn a_refused_upload_still_being_sent_is_answered_and_closed_not_reset() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let body_len = 8 << 20;
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: big\r\n\
         Content-Length: {body_len}\r\n\r\n"
    );
    // The whole upload first, as a client that reads its answer only once it has sent its
    // request does: a reset while it sends fails its writes and throws away the answer.
    let sent: std::io::Result<()> = async {
        stream.write_all(head.as_bytes()).await?;
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..body_len / chunk.len() {
            stream.write_all(&chunk).await?;
        }
        Ok(())
    }
    .await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got))
        .await
        .expect("the proxy closed the connection");
    let text = String::from_utf8_lossy(&got);
    assert!(
        sent.is_ok(),
        "the upload was cut off: {sent:?}; then read {read:?}: {text}"
    );
    assert!(read.is_ok(), "the connection was reset: {read:?}: {text}");
    assert!(text.starts_with("HTTP/1.1 413 "), "{text}");
    assert!(text.contains("/problems/request-too-large\""), "{text}");
    assert_eq!(backend.count(), 0);
}

#[tokio::test]
async fn every_bad_input_gets_its_answer_and_nothing_is_stored() {
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    let cases = cases();
    assert!(cases.len() >= 30);
    let mut forwarded = 0;
    let mut parser_refusals = 0;
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
                // pingora's parser refused it; the answer is still problem+json.
                None => {
                    assert_eq!(resp.status, 400, "{}: rejected by the parser", case.name);
                    assert_eq!(resp.problem_type(), "request-malformed", "{}", case.name);
                    parser_refusals += 1;
                }
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
    assert!(parser_refusals > 0, "some case reaches pingora's parser");
    proxy
        .metrics_containing(&refused("malformed", parser_refusals))
        .await;
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

    // A streamed body on a route without idempotency (pingora forwards it as it comes) is held
    // to the same pause, and told so, not left to pingora's 60 s and a bare close.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /plain HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let r = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.problem_type(), "request-timeout");
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// A streamed body that stalls for longer than the upstream's read_timeout (but less than
/// request_body_timeout) is the client's delay, not a lost answer: the backend only ever held an
/// incomplete request. 408, not 502 "it may have been executed".
#[tokio::test]
async fn a_streamed_body_that_outlasts_the_upstream_read_timeout_is_the_clients_408() {
    use common::client::send_raw;
    use common::rawbackend::{RawBackend, Step};
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_body_timeout: 10s")
        .upstream("read_timeout: 300ms")
        .start()
        .await;
    let started = std::time::Instant::now();
    let r = send_raw(
        proxy.addr,
        b"POST /plain HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await;
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.problem_type(), "request-timeout");
    assert!(started.elapsed() < Duration::from_secs(5));
    // The backend never got a whole request (this test backend logs a broken body as empty).
    let seen = backend.executions();
    assert!(
        seen.iter().all(|e| e.body.is_empty()),
        "a whole body reached the backend"
    );

    // A whole body whose answer is late is the backend's: 502, it may have run.
    let r = send_raw(
        proxy.addr,
        b"POST /plain/slow/1000 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.problem_type(), "upstream-answer-lost");

    // Nor is a client that sent no body yet, waiting for a `100 Continue` the backend never
    // sends: it did nothing wrong.
    let silent = RawBackend::start_head_only(vec![Step::Pause(Duration::from_secs(30))]).await;
    let waiting = ProxyBuilder::at(silent.addr)
        .top("request_body_timeout: 10s")
        .upstream("read_timeout: 300ms")
        .start()
        .await;
    let r = send_raw(
        waiting.addr,
        b"POST /plain HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.problem_type(), "upstream-answer-lost");
}

/// A body trickled a byte at a time, each inside request_body_timeout, is cut off by
/// request_body_total_timeout: on a keyed route and on a plain route (idemgate's own client
/// reads both whole; a body pingora streams, a large upload, is timed read by read only).
#[tokio::test]
async fn a_body_trickled_inside_every_pause_is_cut_off_by_the_total_timeout() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_body_timeout: 1s")
        .top("request_body_total_timeout: 2s")
        .start()
        .await;
    for head in [
        "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: trickle\r\nContent-Length: 100\r\n\r\n",
        "POST /plain HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n",
    ] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let started = std::time::Instant::now();
        // A byte every 250 ms: never a pause near request_body_timeout. Written from a thread
        // of its own over a second handle, so the answer is read while the trickle goes on.
        let std = s.into_std().unwrap();
        let mut writer = std.try_clone().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let trickle = std::thread::spawn(move || {
            use std::io::Write;
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                match writer.write(b"x") {
                    Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return,
                    _ => std::thread::sleep(Duration::from_millis(250)),
                }
            }
        });
        let mut s = tokio::net::TcpStream::from_std(std).unwrap();
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            common::client::read_response(&mut s, false),
        )
        .await
        .unwrap_or_else(|_| panic!("{head}: never cut off"))
        .unwrap();
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        trickle.join().unwrap();
        assert_eq!(r.status, 408, "{head}: {}", r.text());
        assert_eq!(r.problem_type(), "request-timeout");
        assert!(
            took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
            "{head}: cut off after {took:?}"
        );
        assert_eq!(backend.count(), 0, "{head}: not forwarded");
    }
}

#[tokio::test]
async fn an_http_1_0_client_is_not_sent_100_continue() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.0\r\nHost: t\r\nIdempotency-Key: old\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    let raw = until_closed(&mut s).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 201 "), "{text}");
    assert!(!text.contains("100 Continue"), "{text}");
    assert_eq!(backend.count(), 1);
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
    let abs = Request::post("http://localhost/orders")
        .key("abs")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(abs.result(), Some("MISS"), "{}", abs.text());
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_the_outcome_is_still_stored() {
    use tokio::io::AsyncWriteExt;
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
    let got = until_closed(&mut stalled).await;
    assert!(got.len() < LEN, "cut off, got {} bytes", got.len());
    // The execution's outcome was stored all the same: a retry is replayed whole.
    let retry = order().send(proxy.addr).await;
    assert_eq!((retry.status, retry.result()), (200, Some("HIT")));
    assert_eq!(retry.body.len(), LEN);
    assert_eq!(backend.count(), 1);
}

/// `raw` is one whole problem+json answer with `status` and problem type `slug`: the answers to
/// refused headers are written below pingora.
fn assert_raw_problem(raw: &[u8], status: u16, slug: &str) {
    let text = String::from_utf8_lossy(raw);
    assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
    assert!(
        text.contains("content-type: application/problem+json"),
        "{text}"
    );
    assert!(text.contains("cache-control: no-store\r\n"), "{text}");
    assert!(text.contains(&format!("/problems/{slug}\"")), "{text}");
    // Exactly one answer: nothing of pingora's own went out beside it.
    assert_eq!(text.matches("HTTP/1.1 4").count(), 1, "{text}");
}

/// The proxy listener's refusal counter line for `reason` at `n`.
fn refused(reason: &str, n: u32) -> String {
    format!(r#"idemgate_request_headers_refused_total{{listener="proxy",reason="{reason}"}} {n}"#)
}

#[tokio::test]
async fn a_request_header_trickled_past_request_header_timeout_is_cut_off() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_header_timeout: 500ms")
        .start()
        .await;
    // Each byte comes well inside pingora's per-read timeout; only the whole header is late.
    let (got, elapsed, sent) =
        common::client::trickle_header(proxy.addr, b"POST /orders HTTP/1.1\r\nHost: t\r\nX-Slow: ")
            .await;
    assert_raw_problem(&got, 408, "request-header-timeout");
    assert!(elapsed >= Duration::from_millis(500), "{elapsed:?}");
    assert!(
        sent < 40,
        "cut off after {sent} trickled bytes, {elapsed:?}"
    );
    assert_eq!(backend.count(), 0);
    proxy.metrics_containing(&refused("timeout", 1)).await;
    // The same on a reused connection: its next header is timed from its own first byte.
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&Request::post("/plain").body("{}").to_bytes())
        .await
        .unwrap();
    let first = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(first.status, 201);
    // Before the write: the proxy's clock starts once it reads the first byte.
    let started = std::time::Instant::now();
    s.write_all(b"POST /plain HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        .await
        .unwrap();
    let rest = until_closed(&mut s).await;
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert_raw_problem(&rest, 408, "request-header-timeout");
    proxy.metrics_containing(&refused("timeout", 2)).await;
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn request_header_timeout_spares_idle_connections_split_headers_and_slow_bodies() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_header_timeout: 1s")
        .start()
        .await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let send = async |s: &mut tokio::net::TcpStream, pieces: &[&[u8]]| {
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            s.write_all(piece).await.unwrap();
        }
        let r = common::client::read_response(s, false).await.unwrap();
        assert_eq!(r.status, 201, "{}", r.text());
        r
    };
    // Idle between requests for longer than the header timeout: the idle wait is not the
    // header's.
    send(&mut s, &[&Request::post("/plain").body("{}").to_bytes()]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    send(&mut s, &[&Request::post("/plain").body("{}").to_bytes()]).await;
    // A header in two pieces, 250 ms apart: inside the whole-header limit, with room to spare
    // for a loaded machine.
    send(
        &mut s,
        &[
            b"POST /orders HTTP/1.1\r\nHost: t\r\n",
            b"Idempotency-Key: split\r\nContent-Length: 2\r\n\r\n{}",
        ],
    )
    .await;
    // A body sent over a second, four pieces 250 ms apart: only the header is timed.
    let slow = send(
        &mut s,
        &[
            b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: slow-body\r\nContent-Length: 7\r\n\r\n{\"",
            b"a\"",
            b":",
            b"1}",
        ],
    )
    .await;
    assert_eq!(slow.result(), Some("MISS"));
    // And the connection still serves the next request.
    send(&mut s, &[&Request::post("/plain").body("{}").to_bytes()]).await;
    assert_eq!(backend.count(), 5);
    let m = proxy.metrics().await;
    assert!(m.contains(&refused("timeout", 0)), "{m}");
}

#[tokio::test]
async fn a_request_header_over_max_request_header_bytes_is_refused_with_431() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("max_request_header_bytes: 4KiB")
        .start()
        .await;
    let head = |pad: usize| {
        format!(
            "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k{pad}\r\nX-Pad: {}\r\nContent-Length: 2\r\n\r\n{{}}",
            "p".repeat(pad)
        )
        .into_bytes()
    };
    // Just under the limit, in 512-byte pieces so it takes many reads: served.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let under = head(3800);
    assert!(under.len() < 4096);
    for piece in under.chunks(512) {
        s.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    // Four times over it, at once: 431 and the connection closed, nothing forwarded.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let _ = s.write_all(&head(16 << 10)).await;
    assert_raw_problem(&until_closed(&mut s).await, 431, "request-header-too-large");
    assert_eq!(backend.count(), 1);
    proxy.metrics_containing(&refused("too_large", 1)).await;
    // Under twice the limit, at once: pingora's header buffer doubles (4 KiB, then 8 KiB), so
    // one read could bring the whole header; no read goes past the limit, so it cannot. Under a
    // 5 KiB limit, which no buffer size meets, the first read stops short of the limit and only
    // the cap on the second keeps the header from arriving whole.
    let five = ProxyBuilder::new(&backend)
        .top("max_request_header_bytes: 5KiB")
        .start()
        .await;
    for (proxy, pad) in [(&proxy, 4200), (&proxy, 7000), (&five, 5300), (&five, 7000)] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let over = head(pad);
        assert!(over.len() > 4096 && over.len() < 8192);
        s.write_all(&over).await.unwrap();
        let r = common::client::read_response(&mut s, false).await.unwrap();
        assert_eq!(r.status, 431, "{pad}: {}", r.text());
        assert_eq!(r.problem_type(), "request-header-too-large");
        assert_eq!(r.header("connection"), Some("close"));
    }
    assert_eq!(backend.count(), 1, "none was forwarded");
    proxy.metrics_containing(&refused("too_large", 3)).await;
    five.metrics_containing(&refused("too_large", 2)).await;
}

#[tokio::test]
async fn connect_and_unparseable_requests_get_problem_json() {
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    // Sends raw bytes and reads until the proxy closes the connection.
    let exchange = async |raw: &[u8]| {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(raw).await.unwrap();
        until_closed(&mut s).await
    };
    let connect =
        exchange(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n").await;
    assert!(connect.starts_with(b"HTTP/1.1 405 Method Not Allowed\r\n"));
    assert_raw_problem(&connect, 405, "connect-not-supported");
    for raw in [
        &b"POST /orders HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n"[..],
        b"GARBAGE\r\n\r\n",
        b"POST /orders HTTP/9.9\r\nHost: t\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n",
    ] {
        let answer = exchange(raw).await;
        assert!(answer.starts_with(b"HTTP/1.1 400 Bad Request\r\n"));
        // One answer only: pingora's own bare 400 was swallowed.
        assert_raw_problem(&answer, 400, "request-malformed");
    }
    assert_eq!(backend.count(), 0);
    proxy.metrics_containing(&refused("malformed", 4)).await;
}

/// A keyed request whose body comes under a transfer coding other than chunked is refused (501)
/// before its body is read: idemgate sends a keyed body on with a length and no coding, so the
/// backend would take the coded bytes for the body. Chunked alone goes through.
#[tokio::test]
async fn a_keyed_body_under_a_coding_other_than_chunked_is_refused_not_decoded_wrong() {
    use common::client::send_raw;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    for coding in [
        "gzip, chunked",
        "gzip,chunked",
        "deflate, chunked",
        // Chunked twice: one layer would be left in what the backend takes for the body.
        "chunked, chunked",
    ] {
        let request = format!(
            "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: coded\r\n\
             Transfer-Encoding: {coding}\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        );
        let r = send_raw(proxy.addr, request.as_bytes()).await;
        assert_eq!(r.status, 501, "{coding}: {}", r.text());
        assert_eq!(r.problem_type(), "transfer-coding-unsupported");
        assert_eq!(r.result(), Some("INVALID"));
    }
    assert_eq!(backend.count(), 0, "never forwarded");

    let r = send_raw(
        proxy.addr,
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: plain-chunked\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(r.result(), Some("MISS"), "{}", r.text());
    assert_eq!(backend.count(), 1);
    assert_eq!(backend.executions()[0].body, b"hello");

    // Forwarded without a claim, the body is streamed and re-framed as chunked, which would
    // drop the other coding: refused the same way (no idempotency header: no keyed route).
    for coding in ["gzip, chunked", "chunked, chunked"] {
        let request = format!(
            "POST /plain HTTP/1.1\r\nHost: t\r\n\
             Transfer-Encoding: {coding}\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        );
        let r = send_raw(proxy.addr, request.as_bytes()).await;
        assert_eq!(r.status, 501, "{coding}: {}", r.text());
        assert_eq!(r.problem_type(), "transfer-coding-unsupported");
        assert_eq!(r.result(), None);
    }
    assert_eq!(backend.count(), 1, "never forwarded");
}

/// A `Connection` header that names `Host` or a forwarding header is refused on every path
/// alike (400 `request-malformed`), keyed or not, whatever frames the body: pingora refuses to
/// forward it, and idemgate's own client would strip `Host` and send invalid HTTP/1.1. So is
/// one naming the key, tenant or a scope header (found by a black-box probe: the record was
/// chosen by a principal the backend never saw).
#[tokio::test]
async fn a_connection_header_naming_host_or_a_forwarding_header_is_refused() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    for (path, key, nominated, body) in [
        (
            "/orders",
            "Idempotency-Key: n1\r\n",
            "Host",
            "Content-Length: 2\r\n\r\n{}",
        ),
        ("/plain", "", "Host", "Content-Length: 2\r\n\r\n{}"),
        (
            "/plain",
            "",
            "x-forwarded-for",
            "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        ),
        (
            "/orders",
            "Idempotency-Key: n2\r\n",
            "X-Forwarded-Proto",
            "Content-Length: 0\r\n\r\n",
        ),
        // The headers that decide the record: its scope, tenant and key. Stripped, the record
        // would be chosen by values the backend never saw.
        (
            "/orders",
            "Idempotency-Key: n3\r\nAuthorization: Bearer a\r\n",
            "authorization",
            "Content-Length: 2\r\n\r\n{}",
        ),
        (
            "/orders",
            "Idempotency-Key: n4\r\nX-Tenant-ID: t9\r\n",
            "X-Tenant-ID",
            "Content-Length: 2\r\n\r\n{}",
        ),
        (
            "/orders",
            "Idempotency-Key: n5\r\n",
            "Idempotency-Key",
            "Content-Length: 2\r\n\r\n{}",
        ),
    ] {
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\n{key}Connection: keep-alive, {nominated}\r\n{body}"
        );
        let r = common::client::send_raw(proxy.addr, request.as_bytes()).await;
        assert_eq!(r.status, 400, "{path} {nominated}: {}", r.text());
        assert_eq!(r.problem_type(), "request-malformed", "{path} {nominated}");
    }
    assert_eq!(backend.count(), 0, "never forwarded");
    // Other nominations are hop-by-hop headers, dropped on the way.
    let r = Request::post("/plain")
        .header("Connection", "keep-alive, X-Hop")
        .header("X-Hop", "1")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
}

#[tokio::test]
async fn a_bad_key_on_an_optional_route_is_400_never_a_bypass() {
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    let long = "k".repeat(256);
    let optional = || Request::post("/optional").body("{}");
    let bad = [
        ("empty", optional().key("")),
        ("blank", optional().key("   ")),
        ("256 characters", optional().key(&long)),
        ("non-ASCII", optional().key("ключ")),
        (
            "latin-1 byte",
            optional().header("Idempotency-Key", b"caf\xe9".as_slice()),
        ),
        ("unbalanced quote", optional().key("\"abc")),
        ("bad sf escape", optional().key("\"a\\nb\"")),
        ("folded list", optional().key("a, b")),
        ("repeated, different", optional().key("a").key("b")),
    ];
    for (name, req) in bad {
        let resp = req.send(proxy.addr).await;
        assert_eq!(
            (resp.status, resp.result()),
            (400, Some("INVALID")),
            "{name}: {}",
            resp.text()
        );
        assert_eq!(resp.problem_type(), "idempotency-key-invalid", "{name}");
    }
    assert_eq!(backend.count(), 0, "no bad key was forwarded");
    // The route does take requests: without a key they bypass, with a good one they are keyed.
    let bypass = optional().send(proxy.addr).await;
    assert_eq!(bypass.result(), Some("BYPASS"));
    let keyed = optional().key("good").send(proxy.addr).await;
    assert_eq!(keyed.result(), Some("MISS"));
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn a_kept_alive_connection_is_closed_after_sixty_idle_seconds_whatever_the_client_asks() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = Backend::start().await;
    let proxy = proxy(&backend).await;
    // (name, extra request header): pingora's own wait after a request would be for ever
    // without a Keep-Alive timeout, and the client's choice with one.
    let cases = [
        ("no Keep-Alive header", ""),
        ("Keep-Alive: timeout=3600", "Keep-Alive: timeout=3600\r\n"),
        ("Connection: keep-alive", "Connection: keep-alive\r\n"),
    ];
    let tasks: Vec<_> = cases
        .into_iter()
        .map(|(name, extra)| {
            let addr = proxy.addr;
            tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                let req = format!("GET /plain/idle HTTP/1.1\r\nHost: t\r\n{extra}\r\n");
                s.write_all(req.as_bytes()).await.unwrap();
                let resp = common::client::read_response(&mut s, false).await.unwrap();
                assert_eq!(resp.status, 201, "{name}");
                let idle = std::time::Instant::now();
                let mut buf = [0u8; 64];
                let read = tokio::time::timeout(Duration::from_secs(90), s.read(&mut buf)).await;
                let waited = idle.elapsed();
                assert!(
                    matches!(read, Ok(Ok(0)) | Ok(Err(_))),
                    "{name}: still open after {waited:?}"
                );
                assert!(
                    waited >= Duration::from_secs(58),
                    "{name}: closed after {waited:?}"
                );
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// A backend that answers every request head with `100 Continue` and then reads on, answering
/// nothing more: the body it waits for is the client's to send.
async fn continuing_backend() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await;
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_streamed_body_that_stalls_after_the_backends_100_continue_still_gets_its_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = continuing_backend().await;
    let proxy = ProxyBuilder::at(backend)
        .top("request_body_timeout: 300ms")
        .start()
        .await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /plain HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n",
    )
    .await
    .unwrap();
    // The backend's interim answer, relayed; then half the body, and a stall.
    let mut interim = Vec::new();
    let mut byte = [0u8; 1];
    while !interim.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).await.unwrap(), 1, "closed before the 100");
        interim.push(byte[0]);
    }
    assert!(interim.starts_with(b"HTTP/1.1 100"), "{interim:?}");
    s.write_all(b"hello").await.unwrap();
    let r = common::client::read_response(&mut s, false)
        .await
        .expect("a final answer after the 100, not a bare close");
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.problem_type(), "request-timeout");
}

#[tokio::test]
async fn a_request_body_timeout_longer_than_a_minute_is_the_one_that_cuts_a_stalled_body_off() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_body_timeout: 63s")
        .top("request_body_total_timeout: 5m")
        .start()
        .await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: stall\r\nContent-Length: 10\r\n\r\nhello",
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::io::AsyncReadExt::read_to_end(&mut s, &mut raw),
    )
    .await
    .expect("the proxy answered and closed the connection");
    let waited = started.elapsed();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.starts_with("HTTP/1.1 408 ") && text.contains("/problems/request-timeout\""),
        "after {waited:?}: {text}"
    );
    assert!(
        waited >= Duration::from_secs(62),
        "cut off after {waited:?}"
    );
    assert_eq!(backend.count(), 0);
}

#[tokio::test]
async fn a_request_without_a_key_refused_for_its_body_is_invalid_not_a_bypass() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("request_body_timeout: 300ms")
        .start()
        .await;
    // A body idemgate reads itself, and one pingora streams: both stall.
    for head in [
        &b"POST /optional HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nhello"[..],
        b"POST /optional HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    ] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(head).await.unwrap();
        let r = common::client::read_response(&mut s, false).await.unwrap();
        assert_eq!(
            (r.status, r.result()),
            (408, Some("INVALID")),
            "{}",
            r.text()
        );
        assert_eq!(r.problem_type(), "request-timeout");
    }
    proxy
        .metrics_containing(r#"idemgate_requests_total{result="INVALID",route="optional"} 2"#)
        .await;
}

/// A proxy whose request bodies may hold 1 MiB at once, keyed ones up to `max_request`.
async fn budget_proxy(backend: &Backend, max_request: &str) -> Proxy {
    ProxyBuilder::new(backend)
        .top("max_buffered_request_bytes: 1MiB")
        .idem(&format!("max_request_bytes: {max_request}"))
        .start()
        .await
}

/// A keyed upload of `size` bytes with all but `unsent` of its body sent, once the proxy holds
/// it (the budget's gauge shows `size`, its declared length, which it grew to).
async fn slow_upload(proxy: &Proxy, size: usize, unsent: usize) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut slow = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: slow\r\nContent-Length: {size}\r\n\r\n"
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&vec![b'x'; size - unsent]).await.unwrap();
    proxy
        .metrics_containing(&format!("idemgate_request_body_buffered_bytes {size}"))
        .await;
    slow
}

/// The bodies keyed requests hold at once stay within `max_buffered_request_bytes`: with a
/// slow upload holding most of it, a body that would go past it is refused (503, before any
/// claim, whether its length is declared or it comes chunked), a small one still goes through,
/// and once the upload is sent on its bytes are given back and the refused key runs when
/// retried.
#[tokio::test]
async fn request_bodies_held_at_once_stay_within_their_budget() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = Backend::start().await;
    let proxy = budget_proxy(&backend, "600KiB").await;
    let size = 600 << 10;
    // Charged as it arrives, up to its declared length.
    let mut slow = slow_upload(&proxy, size, 1000).await;

    let refused = |resp: &common::client::Response, what: &str| {
        assert_eq!(resp.status, 503, "{what}: {}", resp.text());
        assert_eq!(resp.problem_type(), "request-buffers-full", "{what}");
        assert_eq!(resp.result(), Some("UNAVAILABLE"), "{what}");
        assert_eq!(resp.header("retry-after"), Some("1"), "{what}");
    };
    let declared = Request::post("/orders")
        .key("second")
        .body(vec![b'y'; size]);
    refused(&declared.send(proxy.addr).await, "declared length");
    let chunked = Request::post("/orders")
        .key("third")
        .body(vec![b'z'; size])
        .chunked(64 << 10);
    refused(&chunked.send(proxy.addr).await, "chunked");
    // Asked to invite a body that cannot fit, the proxy refuses it before inviting it.
    let mut invited = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: fourth\r\nExpect: 100-continue\r\n\
         Content-Length: {size}\r\n\r\n"
    );
    invited.write_all(head.as_bytes()).await.unwrap();
    let mut first = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), invited.read_exact(&mut first))
        .await
        .expect("an answer without the body")
        .unwrap();
    assert_eq!(
        &first,
        b"HTTP/1.1 503",
        "{}",
        String::from_utf8_lossy(&first)
    );

    let small = Request::post("/orders").key("small").json("{}");
    assert_eq!(small.send(proxy.addr).await.status, 201);
    assert_eq!(backend.count(), 1, "no refused request reached the backend");

    slow.write_all(&vec![b'x'; 1000]).await.unwrap();
    let resp = common::client::read_response(&mut slow, false)
        .await
        .unwrap();
    assert_eq!(resp.status, 201, "{}", resp.text());
    proxy
        .metrics_containing("idemgate_request_body_buffered_bytes 0\n")
        .await;
    let again = declared.send(proxy.addr).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert_eq!(again.result(), Some("MISS"));
    assert_eq!(backend.count(), 3);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("idemgate_request_bodies_refused_total 3"),
        "{metrics}"
    );
}

/// A declared length is charged as the body arrives: connections that declare large bodies
/// and send next to nothing (slow, or idle) cannot take the budget from requests that send
/// theirs.
#[tokio::test]
async fn a_declared_length_alone_does_not_take_the_budget() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = budget_proxy(&backend, "600KiB").await;
    let mut idle = Vec::new();
    for n in 0..4 {
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: idle-{n}\r\n\
             Content-Length: {}\r\n\r\nx",
            600 << 10
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        idle.push(stream);
    }
    proxy
        .metrics_containing(&format!(
            "idemgate_request_body_buffered_bytes {}",
            4 * (64 << 10)
        ))
        .await;
    let resp = Request::post("/orders")
        .key("sent")
        .body(vec![b'y'; 600 << 10])
        .send(proxy.addr)
        .await;
    assert_eq!(resp.status, 201, "{}", resp.text());
    drop(idle);
}

/// A body forwarded without a key, which idemgate reads whole too (up to 64 KiB), is held
/// within the same budget; with no room for it, it is streamed to the backend instead (as a
/// larger one is), never refused.
#[tokio::test]
async fn bodies_forwarded_without_a_key_are_streamed_when_the_budget_is_full() {
    let backend = Backend::start().await;
    let proxy = budget_proxy(&backend, "1MiB").await;
    let slow = slow_upload(&proxy, (1 << 20) - (32 << 10), 10).await;
    let plain = Request::post("/plain").body(vec![b'p'; 40 << 10]);
    let resp = plain.send(proxy.addr).await;
    assert_eq!(resp.status, 201, "{}", resp.text());
    assert_eq!(
        resp.text(),
        format!("{{\"order\":1,\"bytes\":{}}}", 40 << 10)
    );
    assert_eq!(backend.count(), 1);
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("idemgate_request_bodies_refused_total 0"),
        "{metrics}"
    );
    drop(slow);
}

/// A client that closes its side once its whole body went (pingora's streaming path: a chunked
/// body, no key on a route where the key is optional) left before the answer. Its request was
/// forwarded whole, so it keeps its outcome (`BYPASS`), and is neither answered nor counted as
/// a request whose body could not be read.
#[tokio::test]
async fn a_client_that_closes_after_its_streamed_body_keeps_its_outcome() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /optional/slow/2000 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n\
          2\r\n{}\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    backend.until_count(1).await;
    s.shutdown().await.unwrap();
    let answer = until_closed(&mut s).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.contains("request-body-unreadable"), "{answer}");
    let log = proxy.log_containing("result=\"BYPASS\"").await;
    assert!(!log.contains("result=\"INVALID\""), "{log}");
    let metrics = proxy.metrics().await;
    let invalid = metrics.lines().filter(|l| l.contains("result=\"INVALID\""));
    assert!(invalid.clone().all(|l| l.ends_with(" 0")), "{metrics}");
}

/// A streamed body the client cuts off (a chunked body without its last chunk, then a close)
/// is still a 400 `request-body-unreadable`, counted `INVALID`: pingora counts a body that
/// ended early as done, but only one read to its end is whole.
#[tokio::test]
async fn a_streamed_body_cut_off_by_the_client_is_a_400() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /optional/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
    )
    .await
    .unwrap();
    s.shutdown().await.unwrap();
    let answer = until_closed(&mut s).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("request-body-unreadable"), "{answer}");
    proxy.log_containing("result=\"INVALID\"").await;
}

/// A request with a chunked body is the last of its connection. idemgate's HTTP/1 parser takes
/// a bare LF inside a chunk extension as part of the extension; a front end that ends the line
/// there frames the body otherwise, so what it sends after the body (here a keyed POST naming
/// another tenant and principal, while the first request runs) is no request of the client's,
/// and is never read as one, whichever path the first request took (found by a black-box
/// probe: both ran, and the front end got two answers for one request).
#[tokio::test]
async fn nothing_after_a_chunked_body_is_read_as_a_request() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let hidden = b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: smuggled\r\n\
                   X-Tenant-ID: victim\r\nAuthorization: Bearer victim\r\n\
                   Content-Length: 2\r\n\r\nSS";
    // Keyed (idemgate's own client: the hidden request comes while the first one runs) and
    // pass-through (pingora's streamed path: it comes after the answer).
    for (n, (path, before_answer)) in [("/orders/slow/300", true), ("/plain", false)]
        .into_iter()
        .enumerate()
    {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let outer = format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nIdempotency-Key: outer-{n}\r\n\
             Transfer-Encoding: chunked\r\n\r\n9;a\nPPPPP\r\nQQ\r\n100\r\n\r\n0\r\n\r\n"
        );
        s.write_all(outer.as_bytes()).await.unwrap();
        if before_answer {
            backend.until_count(n + 1).await;
            s.write_all(hidden).await.unwrap();
        }
        let first = common::client::read_response(&mut s, false).await.unwrap();
        assert!(first.status < 300, "{path}: {}", first.text());
        assert_eq!(first.header("connection"), Some("close"), "{path}");
        if !before_answer {
            let _ = s.write_all(hidden).await;
        }
        let rest = until_closed(&mut s).await;
        let rest = String::from_utf8_lossy(&rest);
        assert!(!rest.contains("HTTP/1.1"), "{path}: {rest}");
        assert_eq!(backend.count(), n + 1, "{path}: the hidden request ran");
    }
    // A chunked request is served as before, on a connection of its own.
    let chunked = Request::post("/orders")
        .key("plain-chunked")
        .body("{}")
        .chunked(1);
    assert_eq!(chunked.send(proxy.addr).await.result(), Some("MISS"));
}

/// A keyed request whose chunked body breaks its framing gets its 400 and the connection
/// closes: pingora counts such a body as read, but what follows it on the connection is no
/// request of the client's (a front proxy that framed the body otherwise would have it
/// smuggled in as one).
#[tokio::test]
async fn what_follows_a_body_that_breaks_its_framing_is_not_read_as_a_request() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: framed\r\n\
          Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    )
    .await
    .unwrap();
    let first = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(first.status, 400, "{}", first.text());
    assert_eq!(first.problem_type(), "request-body-unreadable");
    let _ = s
        .write_all(b"GET /plain/smuggled HTTP/1.1\r\nHost: t\r\n\r\n")
        .await;
    let rest = until_closed(&mut s).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(!rest.contains("HTTP/1.1"), "{rest}");
    assert_eq!(backend.count(), 0, "nothing forwarded");
}
