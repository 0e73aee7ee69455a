//! Backend answers a well-behaved HTTP library never sends, through the real proxy: each test
//! checks what the client gets, what a retry gets, and that nothing is stored as complete unless
//! a whole answer arrived.

mod common;

use std::time::{Duration, Instant};

use common::proxy::Edit;
use common::rawbackend::{RawBackend, Step};
use common::{Proxy, ProxyBuilder, Request, Response};
use tokio::io::AsyncWriteExt;

fn send(bytes: &[u8]) -> Step {
    Step::Send(bytes.to_vec())
}

async fn proxy(backend: &RawBackend) -> Proxy {
    proxy_reading(backend, "200ms", "500ms").await
}

/// [`proxy`] for backends that pause 400 ms between writes: reads wait 750 ms, so a pause
/// overrun by a loaded machine is not a lost answer (connect and write shrink to keep the
/// three under the 1 s lock).
async fn patient_proxy(backend: &RawBackend) -> Proxy {
    proxy_reading(backend, "100ms", "750ms").await
}

/// One worker thread (one upstream connection pool, so connection counts are exact), a 1 s
/// lock, `connect_write` for the connect and write timeouts, `read` for the read timeout.
async fn proxy_reading(backend: &RawBackend, connect_write: &str, read: &str) -> Proxy {
    ProxyBuilder::at(backend.addr)
        .threads(1)
        .idem("lock_ttl: 1s")
        .upstream(&format!("connect_timeout: {connect_write}"))
        .upstream(&format!("write_timeout: {connect_write}"))
        .upstream(&format!("read_timeout: {read}"))
        .start()
        .await
}

fn order(key: &str) -> Request {
    Request::post("/orders").key(key).json("{\"sku\":1}")
}

/// The first answer and a retry of it: returns both.
async fn twice(proxy: &Proxy, key: &str) -> (common::Response, common::Response) {
    let first = order(key).send(proxy.addr).await;
    let again = order(key).send(proxy.addr).await;
    (first, again)
}

#[tokio::test]
async fn an_answer_without_length_ends_at_close_and_is_replayed() {
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n\r\n{\"id\":7}"),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "no-length").await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(first.body, b"{\"id\":7}");
    assert_eq!((again.status, again.result()), (201, Some("HIT")));
    assert_eq!(again.body, b"{\"id\":7}");
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(backend.count(), 1);
}

/// A body the backend ends by closing reaches an HTTP/1.1 client chunked, on a connection that
/// stays open (the retry and a forwarded request come on it), whether it was executed under a
/// key or forwarded by idemgate's own client; an HTTP/1.0 client is told the connection closes
/// after it (`Connection: close`), not `keep-alive`.
#[tokio::test]
async fn an_answer_the_backend_ends_by_closing_keeps_the_client_s_connection() {
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n\r\n{\"id\":7}"),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let keyed = |version: &str, key: &str| {
        format!(
            "POST /orders HTTP/{version}\r\nHost: t\r\nIdempotency-Key: {key}\r\n\
             Connection: keep-alive\r\nContent-Length: 2\r\n\r\n{{}}"
        )
    };
    let requests = [
        (keyed("1.1", "closing"), "MISS", true),
        (keyed("1.1", "closing"), "HIT", false),
        (
            "GET /plain/a HTTP/1.1\r\nHost: t\r\n\r\n".to_owned(),
            "",
            true,
        ),
    ];
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    for (i, (request, result, chunked)) in requests.iter().enumerate() {
        s.write_all(request.as_bytes()).await.unwrap();
        let r = common::client::read_response(&mut s, false)
            .await
            .unwrap_or_else(|e| panic!("request {i} on the same connection: {e}"));
        assert_eq!(r.status, 201, "request {i}: {}", r.text());
        assert_eq!(r.result().unwrap_or_default(), *result, "request {i}");
        assert_eq!(r.body, b"{\"id\":7}", "request {i}");
        assert_eq!(r.chunked, *chunked, "request {i}: {:?}", r.headers);
        assert_ne!(r.header("connection"), Some("close"), "request {i}");
    }
    for request in [
        keyed("1.0", "closing-old"),
        "GET /plain/b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".to_owned(),
    ] {
        let r = raw_exchange(&proxy, request.as_bytes()).await;
        assert_eq!(r.status, 201, "{request}: {}", r.text());
        assert_eq!(r.header("connection"), Some("close"), "{request}");
        assert!(!r.chunked, "{request}");
        assert_eq!(r.body, b"{\"id\":7}", "{request}");
    }
    assert_eq!(backend.count(), 4, "two keys and two forwarded requests");
}

/// A forwarded answer (no key) cut off mid-body: while nothing of it has reached the client
/// (idemgate holds one piece back), the client gets 502 `upstream-answer-lost`; once some has,
/// its connection is closed short of the declared length, never left waiting or reused. (Two
/// pieces a loaded machine reads as one are the first case: either answer is right then.)
#[tokio::test]
async fn a_forwarded_answer_cut_off_mid_body_is_a_502_or_a_closed_connection() {
    use tokio::io::AsyncReadExt;
    let head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n";
    let early = RawBackend::start(vec![send(head), send(b"abc"), Step::Close]).await;
    let proxy = proxy(&early).await;
    let r = Request::get("/plain/a").send(proxy.addr).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.problem_type(), "upstream-answer-lost");

    let late = RawBackend::start(vec![
        send(head),
        send(b"abc"),
        Step::Pause(Duration::from_millis(50)),
        send(b"def"),
        Step::Pause(Duration::from_millis(50)),
        Step::Close,
    ])
    .await;
    let proxy = self::proxy(&late).await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"GET /plain/b HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .expect("the connection is closed, not left waiting")
        .ok();
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if head.starts_with("HTTP/1.1 502") {
        assert!(body.contains("/problems/upstream-answer-lost"), "{text}");
    } else {
        assert!(head.starts_with("HTTP/1.1 200"), "{text}");
        let head = head.to_ascii_lowercase();
        assert!(head.contains("content-length: 10"), "{text}");
        assert!(body.len() < 10 && "abcdef".starts_with(body), "{text}");
    }
}

#[tokio::test]
async fn a_head_sent_a_byte_at_a_time_is_read_and_replayed() {
    let head =
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n";
    let mut script = Vec::new();
    for b in head {
        script.push(send(&[*b]));
        script.push(Step::Pause(Duration::from_millis(1)));
    }
    script.push(send(b"{\"id\":7}"));
    let backend = RawBackend::start(script).await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "drip").await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(first.body, b"{\"id\":7}");
    assert_eq!((again.status, again.result()), (201, Some("HIT")));
    assert_eq!(again.body, b"{\"id\":7}");
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn chunked_wins_over_a_content_length_sent_with_it() {
    // RFC 9112 §6.3: Transfer-Encoding overrides Content-Length; the client must never see both.
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "cl-and-te").await;
    for r in [&first, &again] {
        assert_eq!(r.status, 201);
        assert_eq!(r.body, b"hello", "{:?}", r.result());
        let framings =
            r.headers_named("content-length").len() + r.headers_named("transfer-encoding").len();
        assert_eq!(framings, 1, "one framing header: {:?}", r.headers);
    }
    assert_eq!(first.result(), Some("MISS"));
    assert_eq!(again.result(), Some("HIT"));
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn a_chunked_coding_list_with_an_empty_item_reaches_the_client_framed_as_it_says() {
    // `chunked,`: the last coding that is not empty is chunked (RFC 9110 §5.6.1 ignores empty
    // list items), so the body is chunked; the client must get a message framed as its header
    // says, not the decoded body under `Transfer-Encoding: chunked,`.
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked, \r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "te-empty-item").await;
    for r in [&first, &again] {
        assert_eq!(r.status, 201);
        assert_eq!(r.body, b"hello", "{:?}", r.headers);
    }
    assert_eq!(first.header("transfer-encoding"), Some("chunked"));
    assert_eq!(again.result(), Some("HIT"));
}

/// A `Transfer-Encoding` line that lists no coding is no transfer coding: `Content-Length`
/// frames the body, so a complete answer is relayed and stored at once (read as a coding, the
/// body would end only at a close: the client waited out `read_timeout` for a 504, and the key
/// stayed locked). The line is not passed on, and the connection is not used again.
#[tokio::test]
async fn a_transfer_encoding_that_lists_nothing_leaves_the_length_to_frame_the_body() {
    for (line, key) in [
        (&b"Transfer-Encoding: "[..], "te-empty"),
        (b"Transfer-Encoding: ,", "te-comma"),
    ] {
        let mut answer = b"HTTP/1.1 201 Created\r\n".to_vec();
        answer.extend_from_slice(line);
        answer.extend_from_slice(b"\r\nContent-Length: 2\r\n\r\nok");
        // The backend keeps the connection open after it.
        let backend = RawBackend::start(vec![Step::Send(answer)]).await;
        let proxy = proxy(&backend).await;
        let (first, again) = twice(&proxy, key).await;
        for r in [&first, &again] {
            assert_eq!(
                (r.status, &r.body[..]),
                (201, &b"ok"[..]),
                "{key}: {}",
                r.text()
            );
            assert!(r.headers_named("transfer-encoding").is_empty(), "{r:?}");
        }
        assert_eq!(
            (first.result(), again.result()),
            (Some("MISS"), Some("HIT"))
        );
        order(&format!("{key}-2")).send(proxy.addr).await;
        assert_eq!(
            backend.connections(),
            2,
            "{key}: the connection was used again"
        );
    }
}

#[tokio::test]
async fn informational_answers_are_skipped_and_never_stored() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n\
          HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "early-hints").await;
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, b"ok".as_slice())
    );
    assert_eq!((again.status, again.result()), (201, Some("HIT")));
    assert_eq!(again.body, b"ok");
    assert_eq!(
        again.header("link"),
        None,
        "1xx headers are not part of the answer"
    );
    // The connection stayed in step: another key is executed and answered normally.
    let other = order("early-hints-2").send(proxy.addr).await;
    assert_eq!((other.status, other.result()), (201, Some("MISS")));
    assert_eq!(backend.count(), 2);
}

#[tokio::test]
async fn trailers_are_consumed_and_the_body_is_replayed_without_them() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n\
          5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "trailers").await;
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, b"hello".as_slice())
    );
    assert_eq!(
        (again.result(), again.body.as_slice()),
        (Some("HIT"), b"hello".as_slice())
    );
    assert_eq!(again.header("trailer"), None);
    assert_eq!(again.header("x-checksum"), None);
    let other = order("trailers-2").send(proxy.addr).await;
    assert_eq!(
        (other.status, other.body.as_slice()),
        (201, b"hello".as_slice())
    );
    assert_eq!(backend.count(), 2);
}

/// After an answer is lost the key stays locked (409) until `lock_ttl`, and is never stored
/// as complete: once the lock lapses a retry executes again.
async fn assert_locked_then_lapses(proxy: &Proxy, backend: &RawBackend, key: &str) {
    let retry = order(key).send(proxy.addr).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "request-in-flight");
    assert_eq!(backend.count(), 1);
    // Most of the way through the lock (1 s from the claim, made before the first retry),
    // still held: the claim is kept until lock_ttl, not some part of it.
    let sent = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let later = order(key).send(proxy.addr).await;
    if sent.elapsed() < Duration::from_millis(900) {
        assert_eq!(later.status, 409, "{}", later.text());
        assert_eq!(backend.count(), 1, "still locked most of the way through");
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    // The backend breaks this answer again; only the execution matters here.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&order(key).to_bytes()).await.unwrap();
    let _ = common::client::read_response(&mut s, false).await;
    assert_eq!(backend.count(), 2, "executed again once the lock lapsed");
}

#[tokio::test]
async fn a_close_before_any_answer_keeps_the_key_locked() {
    let backend = RawBackend::start(vec![Step::Close]).await;
    let proxy = proxy(&backend).await;
    let first = order("closed").send(proxy.addr).await;
    assert_eq!(first.status, 504);
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    assert_locked_then_lapses(&proxy, &backend, "closed").await;
}

#[tokio::test]
async fn a_close_inside_the_first_body_bytes_is_answered_504() {
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n0123456789"),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let first = order("cut-early").send(proxy.addr).await;
    assert_eq!(first.status, 504, "{}", first.text());
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    assert_locked_then_lapses(&proxy, &backend, "cut-early").await;
}

#[tokio::test]
async fn a_close_mid_body_cuts_the_client_off_and_stores_nothing() {
    let mut head = b"HTTP/1.1 201 Created\r\nContent-Length: 100000\r\n\r\n".to_vec();
    head.extend(vec![b'a'; 40_000]);
    let backend = RawBackend::start(vec![
        Step::Send(head),
        Step::Pause(Duration::from_millis(100)),
        Step::Send(vec![b'b'; 20_000]),
        Step::Pause(Duration::from_millis(100)),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&order("cut-late").to_bytes()).await.unwrap();
    let cut = common::client::read_response(&mut s, false).await;
    let err = cut.expect_err("the client must see the answer end early");
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    assert_locked_then_lapses(&proxy, &backend, "cut-late").await;
}

#[tokio::test]
async fn an_unrequested_switch_of_protocols_is_an_unknown_outcome() {
    // idemgate never forwards `Upgrade` on a keyed request, so a 101 is a broken backend.
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"),
        Step::Pause(Duration::from_millis(200)),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let first = order("switch").send(proxy.addr).await;
    assert_eq!(first.status, 504, "{}", first.text());
    assert_locked_then_lapses(&proxy, &backend, "switch").await;
}

// === idemgate's upstream client: connection reuse and the forwarding path ===

fn created(body: &str) -> Step {
    send(
        format!(
            "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
}

#[tokio::test]
async fn keep_alive_connections_are_reused_for_keyed_and_forwarded_requests() {
    let backend = RawBackend::start(vec![created("{}")]).await;
    let proxy = proxy(&backend).await;
    for i in 0..5 {
        let r = order(&format!("reuse-{i}")).send(proxy.addr).await;
        assert_eq!((r.status, r.result()), (201, Some("MISS")));
        let r = Request::post("/plain").json("{}").send(proxy.addr).await;
        assert_eq!((r.status, r.result()), (201, None));
    }
    assert_eq!(backend.count(), 10);
    assert_eq!(
        backend.connections(),
        1,
        "one keep-alive connection carried every request"
    );
}

/// A backend that writes after a complete answer (here a body after a 204, in a second write):
/// the pooled connection holding those bytes is dropped before another request goes out on it,
/// so the next request gets its own answer, and the drop is counted (an idle close is not).
#[tokio::test]
async fn a_pooled_connection_holding_bytes_after_an_answer_is_dropped_and_counted() {
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 204 No Content\r\n\r\n"),
        Step::Pause(Duration::from_millis(20)),
        send(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nFORGED"),
    ])
    .await;
    let proxy = proxy(&backend).await;
    assert_eq!(stray_bytes(&proxy).await, Some(0.0));
    let first = order("stray-1").send(proxy.addr).await;
    assert_eq!(first.status, 204, "{}", first.text());
    // The stray bytes are in by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = order("stray-2").send(proxy.addr).await;
    assert_eq!(
        (second.status, second.result()),
        (204, Some("MISS")),
        "another request's bytes were taken for this answer: {}",
        second.text()
    );
    assert_eq!(backend.connections(), 2);
    assert_eq!(stray_bytes(&proxy).await, Some(1.0));
    proxy
        .log_containing("held bytes sent after a complete answer")
        .await;
}

/// `idemgate_upstream_stray_bytes_total` on `proxy` now.
async fn stray_bytes(proxy: &Proxy) -> Option<f64> {
    common::metric(
        &proxy.metrics().await,
        "idemgate_upstream_stray_bytes_total",
    )
}

/// The backend answers, then (`ending`) ends the idle connection: `requests` keys sent 300 ms
/// apart each get their own answer on a connection of their own (sent on the ended one, the
/// answer would be lost: 504 and a locked key), and nothing counts as stray bytes.
async fn each_on_a_new_connection_after(
    ending: Vec<Step>,
    requests: usize,
    key: &str,
) -> RawBackend {
    let backend = RawBackend::start([vec![created("{}")], ending].concat()).await;
    let proxy = proxy(&backend).await;
    for i in 0..requests {
        let r = order(&format!("{key}-{i}")).send(proxy.addr).await;
        assert_eq!((r.status, r.result()), (201, Some("MISS")), "{}", r.text());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(backend.connections(), requests);
    assert_eq!(stray_bytes(&proxy).await, Some(0.0));
    backend
}

/// Some servers say `408` on an idle connection before closing it: not stray bytes (nothing is
/// counted), but the connection is not used again all the same.
#[tokio::test]
async fn a_408_on_an_idle_connection_is_no_stray_bytes() {
    let notice = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
    let ending = vec![Step::Pause(Duration::from_millis(50)), send(notice)];
    each_on_a_new_connection_after(ending, 2, "idle-408").await;
}

/// The backend closes the idle connection 100 ms after its answer (its keep-alive timeout).
#[tokio::test]
async fn a_pooled_connection_the_backend_closed_while_idle_is_not_used() {
    let ending = vec![Step::Pause(Duration::from_millis(100)), Step::Close];
    let backend = each_on_a_new_connection_after(ending, 3, "idle-closed").await;
    assert_eq!(backend.count(), 3);
}

/// Each connection answers its first request and ends on the second without answering (`end`:
/// closed or reset): the race of a backend's keep-alive timeout with a request already on the
/// wire. A safe request goes again on a new connection; a POST, which may have been executed,
/// is never sent twice, and the client is told.
async fn a_reused_connection_that_ends_unanswered(end: Step) {
    let backend = RawBackend::start_sequence(vec![vec![created("{}")], vec![end]]).await;
    let proxy = proxy(&backend).await;
    let first = Request::get("/plain/a").send(proxy.addr).await;
    assert_eq!(first.status, 201);
    let again = Request::get("/plain/b").send(proxy.addr).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert_eq!(backend.connections(), 2);
    let post = Request::post("/plain/c").json("{}").send(proxy.addr).await;
    assert_eq!(post.status, 502, "{}", post.text());
    assert_eq!(post.problem_type(), "upstream-answer-lost");
    assert_eq!(backend.count(), 4);
}

#[tokio::test]
async fn a_safe_forwarded_request_is_sent_again_when_a_reused_connection_closes_unanswered() {
    a_reused_connection_that_ends_unanswered(Step::Close).await;
}

#[tokio::test]
async fn a_safe_forwarded_request_is_sent_again_when_a_reused_connection_resets_unanswered() {
    a_reused_connection_that_ends_unanswered(Step::Reset).await;
}

#[tokio::test]
async fn an_answer_under_another_transfer_coding_is_executed_once_and_not_replayed() {
    // The body stays gzip-coded once the chunks are read: replayed with a length and no
    // Transfer-Encoding it would be bytes nobody could read as the answer.
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\n\x1f\x8b\x08\r\n0\r\n\r\n",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "gzip-coded").await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(first.header("transfer-encoding"), Some("gzip, chunked"));
    assert_eq!(first.body, b"\x1f\x8b\x08");
    assert_eq!(again.status, 409, "{}", again.text());
    assert_eq!(again.problem_type(), "response-not-replayable");
    assert_eq!(backend.count(), 1);
}

/// Chunked applied twice (which RFC 9112 forbids): reading one layer leaves the body still
/// chunk-coded, so as with `gzip, chunked` it is relayed with its codings and stored as
/// executed, not replayable (replayed by its length, the inner chunk lines were the body).
#[tokio::test]
async fn an_answer_chunked_twice_is_executed_once_and_not_replayed() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked, chunked\r\n\r\n\
          f\r\n5\r\nhello\r\n0\r\n\r\n\r\n0\r\n\r\n",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "chunked-twice").await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(first.header("transfer-encoding"), Some("chunked, chunked"));
    assert_eq!(first.body, b"5\r\nhello\r\n0\r\n\r\n");
    assert_eq!(again.status, 409, "{}", again.text());
    assert_eq!(again.problem_type(), "response-not-replayable");
    assert_eq!(backend.count(), 1);
    proxy
        .log_containing("under a transfer coding left once its chunks are read")
        .await;
}

/// An HTTP/1.0 client knows no transfer codings: an answer whose body stays coded once its
/// chunks are read (`gzip, chunked`), or is not chunked last at all (`chunked, gzip`), cannot
/// reach it as the bytes it means. It gets 502 `upstream-answer-invalid` on every path; under
/// a key the request is recorded as executed, not replayable.
#[tokio::test]
async fn an_answer_under_another_transfer_coding_is_refused_to_an_http_1_0_client() {
    for coding in ["gzip, chunked", "chunked, gzip"] {
        let answer = format!(
            "HTTP/1.1 201 Created\r\nTransfer-Encoding: {coding}\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        );
        let backend = RawBackend::start(vec![send(answer.as_bytes()), Step::Close]).await;
        let proxy = proxy(&backend).await;
        let large = format!(
            "POST /plain/b HTTP/1.0\r\nHost: t\r\nContent-Length: 70000\r\n\r\n{}",
            "x".repeat(70_000)
        );
        let requests: [&[u8]; 3] = [
            b"POST /orders HTTP/1.0\r\nHost: t\r\nIdempotency-Key: coded\r\nContent-Length: 2\r\n\r\n{}",
            b"GET /plain/a HTTP/1.0\r\nHost: t\r\n\r\n",
            large.as_bytes(),
        ];
        for request in requests {
            let r = raw_exchange(&proxy, request).await;
            let line = String::from_utf8_lossy(&request[..20]);
            assert_eq!(r.status, 502, "{coding}, {line}: {}", r.text());
            assert!(
                r.problem_type().starts_with("upstream-answer"),
                "{coding}, {line}: {}",
                r.text()
            );
        }
        assert_eq!(backend.count(), 3, "{coding}");
        // A HEAD's answer has no body to misread: relayed.
        let head = raw_exchange(&proxy, b"HEAD /plain/c HTTP/1.0\r\nHost: t\r\n\r\n").await;
        assert_eq!(head.status, 201, "{coding}, HEAD: {}", head.text());
        assert_eq!(backend.count(), 4, "{coding}");
        let again = Request::post("/orders")
            .key("coded")
            .body("{}")
            .send(proxy.addr)
            .await;
        assert_eq!(again.status, 409, "{coding}: {}", again.text());
        assert_eq!(again.problem_type(), "response-not-replayable", "{coding}");
        assert_eq!(backend.count(), 4, "{coding}: the key ran once");
    }
}

#[tokio::test]
async fn a_safe_request_sent_again_goes_on_a_new_connection_not_another_pooled_one() {
    // Two pooled connections, each closing on its second request unanswered.
    let answer_slowly = vec![Step::Pause(Duration::from_millis(300)), created("{}")];
    let backend = RawBackend::start_sequence(vec![answer_slowly, vec![Step::Close]]).await;
    let proxy = proxy(&backend).await;
    let (a, b) = (Request::get("/plain/a"), Request::get("/plain/b"));
    let (a, b) = tokio::join!(a.send(proxy.addr), b.send(proxy.addr));
    assert_eq!((a.status, b.status), (201, 201));
    assert_eq!(backend.connections(), 2);
    // The first pooled connection closes under the request; the second would too.
    let again = Request::get("/plain/c").send(proxy.addr).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert_eq!(
        backend.connections(),
        3,
        "sent again on a connection of its own"
    );
}

#[tokio::test]
async fn an_upgraded_connection_may_stay_quiet_longer_than_request_body_timeout() {
    // The client says nothing for three request_body_timeouts; the backend speaks after them.
    let (text, ended) =
        read_through_quiet_tunnel(|at| ProxyBuilder::at(at).top("request_body_timeout: 300ms"))
            .await;
    assert!(ended, "no answer");
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    assert!(text.ends_with("hello"), "the tunnel was cut: {text}");
}

/// What a client reads (within 5 s, or until the connection ends: `true`) through a tunnel
/// whose backend answers `101`, says nothing for 900 ms, then sends `hello`, via the proxy
/// `proxy` builds in front of it.
async fn read_through_quiet_tunnel(
    proxy: impl FnOnce(std::net::SocketAddr) -> ProxyBuilder,
) -> (String, bool) {
    use tokio::io::AsyncReadExt;
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"),
        Step::Pause(Duration::from_millis(900)),
        send(b"hello"),
    ])
    .await;
    let proxy = proxy(backend.addr).start().await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"GET /plain/ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"hello") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    (String::from_utf8_lossy(&got).into_owned(), read.is_ok())
}

/// A client that breaks off an upgraded connection (a reset) ends a tunnel, not a request with
/// an unreadable body: its answer was the `101`, and no problem is written into the tunnel or
/// logged in its place.
#[tokio::test]
async fn a_client_that_breaks_off_a_tunnel_leaves_its_101() {
    use tokio::io::AsyncReadExt;
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"),
        Step::Pause(Duration::from_secs(5)),
    ])
    .await;
    let proxy = ProxyBuilder::at(backend.addr).start().await;
    let s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut s = s;
    s.write_all(
        b"GET /plain/ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("the 101 comes")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 101"));
    s.set_zero_linger().unwrap();
    drop(s);
    let log = proxy.log_containing("path=\"/plain/ws\"").await;
    let line = log
        .lines()
        .find(|l| l.contains("path=\"/plain/ws\""))
        .unwrap_or_default();
    assert!(line.contains("status=101"), "{line}");
    assert!(!line.contains("INVALID"), "{line}");
    // No problem was written into the tunnel (pingora refuses its head, not its body).
    assert!(!log.contains("cannot send again"), "{log}");
}

/// A chunked upload takes pingora's streaming path; its answers are held to what idemgate's own
/// client relays: no header the backend's `Connection` names, no hop-by-hop header, no status
/// above 599, no `101` to a request that asked for no upgrade.
#[tokio::test]
async fn a_streamed_request_gets_the_answer_the_own_client_would_relay() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Secret\r\nX-Secret: s\r\n\
          Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTrailer: X-T\r\n\
          Upgrade: h2c\r\nTE: trailers\r\nX-Kept: k\r\nContent-Length: 2\r\n\r\nok",
    )])
    .await;
    let first = proxy(&backend).await;
    let streamed = Request::post("/plain/x").body("{}").chunked(1);
    let r = streamed.send(first.addr).await;
    assert_eq!((r.status, &r.body[..]), (200, &b"ok"[..]), "{}", r.text());
    assert_eq!(r.header("x-kept"), Some("k"));
    for gone in [
        "x-secret",
        "keep-alive",
        "proxy-connection",
        "trailer",
        "upgrade",
        "te",
    ] {
        assert!(
            r.headers_named(gone).is_empty(),
            "{gone} relayed: {:?}",
            r.headers
        );
    }

    for (answer, what) in [
        (
            &b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"[..],
            "101",
        ),
        (b"HTTP/1.1 600 Weird\r\nContent-Length: 2\r\n\r\nok", "600"),
    ] {
        let backend = RawBackend::start(vec![send(answer)]).await;
        let proxy = proxy(&backend).await;
        let r = Request::post("/plain/x")
            .body("{}")
            .chunked(1)
            .send(proxy.addr)
            .await;
        assert_eq!(r.status, 502, "{what}: {}", r.text());
        assert_eq!(r.problem_type(), "upstream-answer-lost", "{what}");
    }
}

/// pingora's error line for an answer it cannot parse quoted the bytes it read: a backend's
/// cookie or token, a customer's data, went to the log. The line says what failed without them.
#[tokio::test]
async fn an_unparsable_streamed_answer_is_logged_without_its_bytes() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nSet-Cookie: session=SECRET-TOKEN\r\nBad Name: x\r\n\r\n",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let r = Request::post("/plain/x")
        .body("{}")
        .chunked(1)
        .send(proxy.addr)
        .await;
    assert_eq!(r.status, 502, "{}", r.text());
    proxy
        .log_containing("an answer could not be parsed (its bytes are not logged)")
        .await;
    // The request's access line, written last, carries the error too.
    let log = proxy.log_containing("path=\"/plain/x\"").await;
    assert!(!log.contains("SECRET-TOKEN"), "{log}");
    assert!(
        log.contains("context: (the bytes read, not logged)"),
        "{log}"
    );
}

#[tokio::test]
async fn forwarded_requests_keep_header_spelling_and_drop_hop_by_hop_headers() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 200 Fine Thanks\r\nX-Backend-Trace: t1\r\nConnection: X-Hop\r\nX-Hop: secret\r\nContent-Length: 2\r\n\r\nok",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let r = Request::post("/plain/orders?x=1")
        .header("X-Request-ID", "r-1")
        .header("Connection", "X-Private")
        .header("X-Private", "p")
        .header("Keep-Alive", "timeout=5")
        .json("{\"a\":1}")
        .send(proxy.addr)
        .await;
    assert_eq!((r.status, r.body.as_slice()), (200, b"ok".as_slice()));
    assert_eq!(r.header("x-backend-trace"), Some("t1"));
    assert_eq!(
        r.header("x-hop"),
        None,
        "headers the backend's Connection names stay behind"
    );
    assert_eq!(r.header("x-idempotent-result"), None);
    // The backend's own reason phrase reaches the client.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&Request::get("/plain/x").to_bytes())
        .await
        .unwrap();
    let mut raw = vec![0u8; 64];
    let n = tokio::io::AsyncReadExt::read(&mut s, &mut raw)
        .await
        .unwrap();
    let status_line = String::from_utf8_lossy(&raw[..n])
        .lines()
        .next()
        .map(str::to_owned);
    assert_eq!(status_line.as_deref(), Some("HTTP/1.1 200 Fine Thanks"));
    let head = backend.heads()[0].clone();
    assert!(
        head.starts_with("POST /plain/orders?x=1 HTTP/1.1\r\n"),
        "{head}"
    );
    assert!(
        head.contains("\r\nX-Request-ID: r-1\r\n"),
        "client spelling kept: {head}"
    );
    assert!(head.contains("\r\nContent-Length: 7\r\n"), "{head}");
    for gone in ["x-private", "keep-alive", "connection"] {
        assert!(
            !head.to_ascii_lowercase().contains(&format!("\r\n{gone}:")),
            "{gone} forwarded: {head}"
        );
    }
}

/// Sends raw request bytes and reads the one answer.
async fn raw_exchange(proxy: &Proxy, request: &[u8]) -> common::Response {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(request).await.unwrap();
    common::client::read_response(&mut s, false).await.unwrap()
}

/// An HTTP/1.0 client knows no chunked coding: a chunked answer reaches it as the bare body,
/// ended by the close, on every path (keyed, idemgate's client, pingora's streaming path).
#[tokio::test]
async fn an_http_1_0_client_gets_a_chunked_answer_unchunked_and_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let chunked = send(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
    let backend = RawBackend::start(vec![chunked]).await;
    let proxy = proxy(&backend).await;
    let large = format!(
        "POST /plain/b HTTP/1.0\r\nHost: t\r\nContent-Length: 70000\r\n\r\n{}",
        "x".repeat(70_000)
    );
    let requests: [&[u8]; 4] = [
        // Asking to keep the connection: the unframed body can only end with it.
        b"POST /orders HTTP/1.0\r\nHost: t\r\nIdempotency-Key: old-client\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /orders HTTP/1.0\r\nHost: t\r\nIdempotency-Key: old-client\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /plain/a HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n",
        large.as_bytes(),
    ];
    for (i, request) in requests.iter().enumerate() {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
            .await
            .unwrap_or_else(|_| panic!("request {i}: the answer ends with the connection"))
            .unwrap();
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        assert!(head.starts_with("HTTP/1.1 201"), "request {i}: {text}");
        assert!(
            !head.to_ascii_lowercase().contains("transfer-encoding"),
            "request {i}: {text}"
        );
        // The first executes; the second, the same key, is a replay framed by its length.
        assert_eq!(body, "hello world", "request {i}: {text}");
    }
    assert_eq!(backend.count(), 3, "the keyed retry was replayed");
}

#[tokio::test]
async fn an_http_1_0_request_without_host_is_sent_on_with_the_upstreams_and_http_1_1_is_refused() {
    let backend = RawBackend::start(vec![created("{}")]).await;
    let proxy = proxy(&backend).await;
    let host = format!("\r\nHost: {}\r\n", backend.addr);
    // Forwarded by idemgate's own client, and keyed.
    for request in [
        &b"GET /plain/a HTTP/1.0\r\n\r\n"[..],
        b"POST /orders HTTP/1.0\r\nIdempotency-Key: no-host\r\nContent-Length: 2\r\n\r\n{}",
    ] {
        let r = raw_exchange(&proxy, request).await;
        assert_eq!(r.status, 201, "{}", r.text());
        let head = backend.heads().last().cloned().unwrap_or_default();
        assert!(head.contains(&host), "{head}");
    }
    // Streamed by pingora (a body it streams: chunked is HTTP/1.1 only, so a large one).
    let large = format!(
        "POST /plain/b HTTP/1.0\r\nContent-Length: 70000\r\n\r\n{}",
        "x".repeat(70_000)
    );
    let r = raw_exchange(&proxy, large.as_bytes()).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let head = backend.heads().last().cloned().unwrap_or_default();
    assert!(
        head.to_ascii_lowercase()
            .contains(&host.to_ascii_lowercase()),
        "{head}"
    );
    assert_eq!(backend.count(), 3);

    // An absolute-form target names its host: that one, not the upstream's.
    let r = raw_exchange(&proxy, b"GET http://shop.example/plain/d HTTP/1.0\r\n\r\n").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let head = backend.heads().last().cloned().unwrap_or_default();
    assert!(head.contains("\r\nHost: shop.example\r\n"), "{head}");
    assert_eq!(backend.count(), 4);

    // HTTP/1.1 requires Host: refused, never forwarded.
    let r = raw_exchange(&proxy, b"GET /plain/c HTTP/1.1\r\n\r\n").await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.problem_type(), "request-malformed");
    assert_eq!(backend.count(), 4);
}

#[tokio::test]
async fn head_requests_and_bodiless_statuses_end_without_a_body() {
    let backend = RawBackend::start_sequence(vec![
        vec![send(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")],
        vec![send(b"HTTP/1.1 204 No Content\r\n\r\n")],
        vec![send(
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
        )],
        vec![created("{}")],
    ])
    .await;
    let proxy = proxy(&backend).await;
    let head = Request::new("HEAD", "/plain/x").send(proxy.addr).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("5"));
    let none = Request::get("/plain/x").send(proxy.addr).await;
    assert_eq!((none.status, none.body.len()), (204, 0));
    let not_modified = Request::get("/plain/x").send(proxy.addr).await;
    assert_eq!((not_modified.status, not_modified.body.len()), (304, 0));
    // The connection stayed in step through all three.
    let next = Request::get("/plain/x").send(proxy.addr).await;
    assert_eq!((next.status, next.body.as_slice()), (201, b"{}".as_slice()));
    assert_eq!(backend.connections(), 1);
}

/// `Idempotent-Replayed` and `X-Idempotent-Result` are idemgate's to say on a keyed route: a
/// backend's own (a gateway's answer, another idemgate behind this one) does not reach the
/// client of a fresh execution, and a replay carries idemgate's one.
#[tokio::test]
async fn a_backend_s_idempotent_replayed_header_does_not_reach_a_fresh_execution() {
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nIdempotent-Replayed: true\r\nX-Idempotent-Result: HIT\r\n\
          Content-Length: 2\r\n\r\n{}",
    )])
    .await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "replayed-header").await;
    fn results(r: &common::Response) -> Vec<&[u8]> {
        r.headers_named("x-idempotent-result")
    }
    assert_eq!(results(&first), vec![&b"MISS"[..]], "{first:?}");
    assert_eq!(results(&again), vec![&b"HIT"[..]], "{again:?}");
    assert!(
        first.headers_named("idempotent-replayed").is_empty(),
        "{first:?}"
    );
    assert_eq!(again.result(), Some("HIT"));
    assert_eq!(
        again.headers_named("idempotent-replayed"),
        vec![&b"true"[..]]
    );
    // Nor a request forwarded without a key on such a route (`BYPASS`), over idemgate's own
    // client or, for a chunked body, pingora's proxy path.
    for req in [
        Request::post("/optional").json("{}"),
        Request::post("/optional").json("{}").chunked(1),
    ] {
        let bypass = req.send(proxy.addr).await;
        assert_eq!((bypass.status, bypass.result()), (201, Some("BYPASS")));
        assert_eq!(results(&bypass), vec![&b"BYPASS"[..]], "{bypass:?}");
        assert!(
            bypass.headers_named("idempotent-replayed").is_empty(),
            "{bypass:?}"
        );
    }
    // A route without idempotency passes the backend's answer on untouched.
    let plain = Request::post("/plain").json("{}").send(proxy.addr).await;
    assert_eq!(
        plain.headers_named("idempotent-replayed"),
        vec![&b"true"[..]]
    );
}

/// A `Content-Length` that agrees with itself but is not one plain number (`2, 2`, two lines,
/// `02`) reaches the client as the one length: strict clients refuse the others.
#[tokio::test]
async fn a_repeated_or_padded_content_length_reaches_the_client_as_one_length() {
    for head in [
        &b"HTTP/1.1 201 Created\r\nContent-Length: 2, 2\r\n\r\n{}"[..],
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 201 Created\r\nContent-Length: 02\r\n\r\n{}",
    ] {
        let backend = RawBackend::start(vec![send(head)]).await;
        let proxy = proxy(&backend).await;
        for r in [
            Request::get("/plain/x").send(proxy.addr).await,
            order("plain-length").send(proxy.addr).await,
        ] {
            assert_eq!((r.status, r.body.as_slice()), (201, &b"{}"[..]));
            assert_eq!(
                r.headers_named("content-length"),
                vec![&b"2"[..]],
                "{:?}",
                String::from_utf8_lossy(head)
            );
        }
    }
}

/// A 204 whose head declares a body (which a 204 must not have) ends without it, and its
/// connection is not reused: a backend that sends the body anyway, after the head, would hand
/// those bytes to the next request on the connection as its answer. (A HEAD's or a 304's length
/// is the one a GET would have had: their connections are reused, as above.) The client, and a
/// replay, get it without the framing it may not carry: a lenient client framing by it would
/// take the start of its next answer on the connection for this one's body.
#[tokio::test]
async fn a_204_that_declares_a_body_ends_without_it_and_is_not_reused() {
    for answer in [
        &b"HTTP/1.1 204 No Content\r\nContent-Length: 2\r\n\r\n"[..],
        b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n",
    ] {
        let backend = RawBackend::start(vec![send(answer)]).await;
        let proxy = proxy(&backend).await;
        let unframed = |r: &Response, what: &str| {
            assert_eq!((r.status, r.body.len()), (204, 0), "{what}: {}", r.text());
            for name in ["content-length", "transfer-encoding"] {
                assert!(r.headers_named(name).is_empty(), "{what}: {name} in {r:?}");
            }
        };
        for _ in 0..2 {
            unframed(
                &Request::get("/plain/x").send(proxy.addr).await,
                "forwarded",
            );
        }
        // A chunked upload takes pingora's streaming path, which frames the answer itself.
        let streamed = Request::post("/plain/x").body("{}").chunked(1);
        unframed(&streamed.send(proxy.addr).await, "streamed");
        let keyed = order("no-content");
        unframed(&keyed.send(proxy.addr).await, "executed");
        let again = keyed.send(proxy.addr).await;
        assert_eq!(again.result(), Some("HIT"));
        unframed(&again, "replayed");
        assert_eq!(
            backend.connections(),
            4,
            "{:?}",
            String::from_utf8_lossy(answer)
        );
    }
}

#[tokio::test]
async fn a_malformed_answer_to_a_forwarded_request_is_a_502() {
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let r = Request::get("/plain/x").send(proxy.addr).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.problem_type(), "upstream-answer-lost");
    // On a keyed request the answer's status says the request ran: it is recorded as executed,
    // not replayable, so a retry is refused instead of run again once a lock would have lapsed.
    let keyed = order("conflicting-length").send(proxy.addr).await;
    assert_eq!(
        (keyed.status, keyed.result()),
        (502, Some("MISS")),
        "{}",
        keyed.text()
    );
    assert_eq!(keyed.problem_type(), "upstream-answer-invalid");
    let executed = backend.count();
    let retry = order("conflicting-length").send(proxy.addr).await;
    assert_eq!(
        (retry.status, retry.result()),
        (409, Some("CONFLICT")),
        "{}",
        retry.text()
    );
    assert_eq!(retry.problem_type(), "response-not-replayable");
    assert_eq!(backend.count(), executed, "never executed twice");
}

/// Without a final status line (one that ends badly, whatever digits it began with) the answer
/// says nothing of what ran: an unknown outcome, the key kept locked. With one, a head too large
/// to relay is settled by its status like any other fault of the fields.
#[tokio::test]
async fn a_malformed_answer_is_settled_only_when_a_final_status_came() {
    // No final status: four digits, or a code above 599 (HTTP has no such class; relayed, it
    // would release the key as any status the route does not store).
    for (line, key) in [
        (&b"HTTP/1.1 2000"[..], "no-status"),
        (b"HTTP/1.1 600 X", "six-hundred"),
    ] {
        let mut answer = line.to_vec();
        answer.extend_from_slice(b"\r\nContent-Length: 2\r\n\r\n{}");
        let backend = RawBackend::start(vec![send(&answer)]).await;
        let no_status = proxy(&backend).await;
        let first = order(key).send(no_status.addr).await;
        assert_eq!(first.status, 504, "{}", first.text());
        assert_eq!(first.problem_type(), "upstream-outcome-unknown");
        let retry = order(key).send(no_status.addr).await;
        assert_eq!(
            retry.problem_type(),
            "request-in-flight",
            "{}",
            retry.text()
        );
        assert_eq!(backend.count(), 1, "never executed twice");
    }

    // A 201 with 70 KB of fields, its head not ended yet.
    let huge: Vec<u8> = (0..70).fold(b"HTTP/1.1 201 Created\r\n".to_vec(), |mut head, i| {
        head.extend_from_slice(format!("X-Field-{i}: {}\r\n", "v".repeat(1000)).as_bytes());
        head
    });
    let rest = b"Content-Length: 2\r\n\r\n{}";

    // Sent whole, in one write: refused as well, settled by its status.
    let backend = RawBackend::start(vec![Step::Send([&huge[..], rest].concat())]).await;
    let whole_proxy = proxy(&backend).await;
    settled_not_replayable(&whole_proxy, &backend, "whole-huge-head").await;

    // With no end yet, then the rest: past 64 KiB unfinished, it is refused. The rest comes
    // 1.5 s later (within a 3 s read timeout): a loaded machine has read the first part by then.
    let backend = RawBackend::start(vec![
        Step::Send(huge),
        Step::Pause(Duration::from_millis(1500)),
        send(rest),
        Step::Close,
    ])
    .await;
    let huge_proxy = ProxyBuilder::at(backend.addr)
        .upstream("read_timeout: 3s")
        .start()
        .await;
    settled_not_replayable(&huge_proxy, &backend, "huge-head").await;
}

/// `key` sent to `proxy` gets 502 `upstream-answer-invalid` (an answer that cannot be relayed,
/// whose status says the request ran), its retry 409 `response-not-replayable`, and the
/// backend ran it once.
async fn settled_not_replayable(proxy: &Proxy, backend: &RawBackend, key: &str) {
    let first = order(key).send(proxy.addr).await;
    assert_eq!(first.status, 502, "{}", first.text());
    assert_eq!(first.problem_type(), "upstream-answer-invalid");
    let retry = order(key).send(proxy.addr).await;
    assert_eq!(
        retry.problem_type(),
        "response-not-replayable",
        "{}",
        retry.text()
    );
    assert_eq!(backend.count(), 1, "never executed twice");
}

#[tokio::test]
async fn a_malformed_answer_with_a_status_that_releases_releases_the_key() {
    let backend = RawBackend::start(vec![
        send(b"HTTP/1.1 503 Service Unavailable\r\nX-Bad\x01: v\r\nContent-Length: 0\r\n\r\n"),
        Step::Close,
    ])
    .await;
    let proxy = proxy(&backend).await;
    let first = order("bad-503").send(proxy.addr).await;
    assert_eq!(
        (first.status, first.result()),
        (502, Some("MISS")),
        "{}",
        first.text()
    );
    assert_eq!(first.problem_type(), "upstream-answer-invalid");
    assert!(
        first.text().contains("the key was released"),
        "{}",
        first.text()
    );
    // Released by its status, as a well-formed 503 would be: the retry runs at once.
    let retry = order("bad-503").send(proxy.addr).await;
    assert_eq!(
        retry.problem_type(),
        "upstream-answer-invalid",
        "{}",
        retry.text()
    );
    assert_eq!(backend.count(), 2, "the retry executed again");
}

#[tokio::test]
async fn a_backend_that_sends_102_processing_while_it_works_is_waited_for_past_its_lock() {
    // Twenty heartbeats 100 ms apart: longer than the 1 s lock and each within read_timeout.
    let mut script = Vec::new();
    for _ in 0..20 {
        script.push(Step::Send(b"HTTP/1.1 102 Processing\r\n\r\n".to_vec()));
        script.push(Step::Pause(Duration::from_millis(100)));
    }
    script.push(created("{\"id\":1}"));
    let backend = RawBackend::start(script).await;
    let proxy = proxy(&backend).await;
    let (first, again) = twice(&proxy, "heartbeats").await;
    assert_eq!(
        (first.status, first.result()),
        (201, Some("MISS")),
        "{}",
        first.text()
    );
    assert_eq!((again.status, again.result()), (201, Some("HIT")));
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn an_endless_run_of_informational_answers_is_refused() {
    let mut flood = b"HTTP/1.1 102 Processing\r\n\r\n".repeat(1100);
    flood.extend_from_slice(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok");
    let backend = RawBackend::start(vec![Step::Send(flood), Step::Close]).await;
    let proxy = proxy(&backend).await;
    let keyed = order("flood").send(proxy.addr).await;
    assert_eq!(keyed.status, 504, "{}", keyed.text());
    let plain = Request::get("/plain/x").send(proxy.addr).await;
    assert_eq!(plain.status, 502, "{}", plain.text());
}

#[tokio::test]
async fn a_connection_idle_past_idle_timeout_is_not_reused() {
    let backend = RawBackend::start(vec![created("{}")]).await;
    let proxy = ProxyBuilder::at(backend.addr)
        .threads(1)
        .upstream("idle_timeout: 1s")
        .start()
        .await;
    let first = Request::get("/plain/a").send(proxy.addr).await;
    assert_eq!(first.status, 201);
    let soon = Request::get("/plain/b").send(proxy.addr).await;
    assert_eq!(soon.status, 201);
    assert_eq!(backend.connections(), 1, "reused within idle_timeout");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = Request::get("/plain/c").send(proxy.addr).await;
    assert_eq!(late.status, 201);
    assert_eq!(
        backend.connections(),
        2,
        "a new connection after idle_timeout"
    );
}

/// An 8 MiB keyed request: more than the backend's and the proxy's socket buffers hold, so it
/// only goes out whole if the backend reads it.
fn large_order(key: &str) -> Request {
    let mut body = b"{\"blob\":\"".to_vec();
    body.extend(vec![b'x'; 8 << 20]);
    body.extend_from_slice(b"\"}");
    Request::post("/orders").key(key).body(body)
}

async fn large_body_proxy(backend: std::net::SocketAddr) -> Proxy {
    ProxyBuilder::at(backend)
        .threads(1)
        .idem("lock_ttl: 2s")
        .idem("max_request_bytes: 16MiB")
        .upstream("connect_timeout: 200ms")
        .upstream("write_timeout: 300ms")
        .upstream("read_timeout: 500ms")
        .start()
        .await
}

/// A large keyed order to a backend that reads only its head and answers `script`: the answer
/// is relayed as a MISS, stored, and replayed as a HIT; the backend ran once. Returns the first
/// answer.
async fn early_answer_is_relayed_and_stored(script: Vec<Step>, key: &str) -> Response {
    let backend = RawBackend::start_head_only(script).await;
    let proxy = large_body_proxy(backend.addr).await;
    let first = large_order(key).send(proxy.addr).await;
    assert_eq!(
        (first.status, first.result()),
        (413, Some("MISS")),
        "{}",
        first.text()
    );
    let again = large_order(key).send(proxy.addr).await;
    assert_eq!(
        (again.status, again.result()),
        (413, Some("HIT")),
        "{}",
        again.text()
    );
    assert_eq!(again.body, first.body);
    assert_eq!(backend.count(), 1);
    first
}

#[tokio::test]
async fn an_answer_given_before_the_body_was_read_is_relayed_and_stored() {
    // A backend may answer without reading the body (a 413, or a handler that ignores it):
    // that answer is the outcome, not a failure to reach the backend.
    let first = early_answer_is_relayed_and_stored(
        vec![
            send(b"HTTP/1.1 413 Content Too Large\r\nContent-Type: application/json\r\nContent-Length: 15\r\nConnection: close\r\n\r\n{\"error\":\"big\"}"),
            Step::Pause(Duration::from_secs(3)),
        ],
        "early-answer",
    )
    .await;
    assert_eq!(first.body, b"{\"error\":\"big\"}");
}

#[tokio::test]
async fn a_request_cut_off_mid_body_keeps_the_key_locked() {
    // The backend has the head and part of the body, and says nothing: it may act on what it
    // has. The outcome is unknown, so the claim is kept, never released for a second execution.
    let backend = RawBackend::start_head_only(vec![Step::Pause(Duration::from_secs(3))]).await;
    let proxy = large_body_proxy(backend.addr).await;
    let first = large_order("cut-request").send(proxy.addr).await;
    assert_eq!(first.status, 504, "{}", first.text());
    assert_eq!(first.problem_type(), "upstream-outcome-unknown");
    let retry = large_order("cut-request").send(proxy.addr).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "request-in-flight");
    assert_eq!(backend.count(), 1);
    assert!(
        proxy.log().contains("request cut off"),
        "the cut is logged:\n{}",
        proxy.log()
    );
}

#[tokio::test]
async fn an_early_answer_followed_by_a_reset_is_still_relayed() {
    // Closing with the body unread makes the backend's kernel reset the connection; the
    // answer it wrote first is already in the proxy's receive buffer and still counts.
    early_answer_is_relayed_and_stored(
        vec![send(
            b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbig",
        )],
        "early-reset",
    )
    .await;
}

/// A request forwarded without a key over each forwarding path: idemgate's client (a small
/// body) and pingora's (a chunked body, streamed).
async fn forward_both_ways(proxy: &Proxy) -> [Response; 2] {
    let small = Request::post("/plain/x").json("{}").send(proxy.addr).await;
    let streamed = Request::post("/plain/x")
        .body(vec![b'a'; 3000])
        .chunked(1000)
        .send(proxy.addr)
        .await;
    [small, streamed]
}

#[tokio::test]
async fn a_forwarded_request_says_whether_it_reached_the_backend() {
    // Forwarded without a key, nothing protects a retry: the client must not be told "not
    // sent" about a request the backend received, on either forwarding path.
    let backend = RawBackend::start(vec![Step::Close]).await;
    let proxy = proxy(&backend).await;
    for r in forward_both_ways(&proxy).await {
        assert_eq!(r.status, 502, "{}", r.text());
        assert_eq!(r.problem_type(), "upstream-answer-lost");
    }
    assert!(backend.count() >= 2, "both reached the backend");

    // A backend nobody listens on: nothing was sent, on either path.
    // A reserved port outside the ephemeral range (one the kernel handed out could be handed to
    // another test's listener meanwhile).
    let dead_addr = std::net::SocketAddr::from(([127, 0, 0, 1], common::proxy::free_port()));
    let proxy = ProxyBuilder::at(dead_addr).threads(1).start().await;
    for r in forward_both_ways(&proxy).await {
        assert_eq!(r.problem_type(), "upstream-unreachable", "{}", r.text());
    }
}

#[tokio::test]
async fn a_response_still_streaming_as_the_lock_runs_out_is_never_executed_twice() {
    // The head comes at once, the body over 3.2 s: longer than the 1 s lock and the one
    // renewal the body gets (at 0.75 s, to about 1.75 s). Before the lock lapses the outcome is
    // stored as executed but not replayable, so a retry past the lock's end is refused instead
    // of executed again.
    let mut script = vec![send(b"HTTP/1.1 201 Created\r\nContent-Length: 80\r\n\r\n")];
    for _ in 0..8 {
        script.push(Step::Pause(Duration::from_millis(400)));
        script.push(send(b"0123456789"));
    }
    let backend = RawBackend::start(script).await;
    let proxy = patient_proxy(&backend).await;
    let addr = proxy.addr;
    let first = tokio::spawn(async move { order("slow-body").send(addr).await });
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let retry = order("slow-body").send(proxy.addr).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "response-not-replayable");
    assert_eq!(retry.result(), Some("CONFLICT"));
    let first = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(first.body, b"0123456789".repeat(8));
    let later = order("slow-body").send(proxy.addr).await;
    assert_eq!(later.problem_type(), "response-not-replayable");
    assert_eq!(backend.count(), 1, "executed once");
    proxy
        .metrics_containing("idemgate_settled_streaming_total 1")
        .await;
}

#[tokio::test]
async fn a_small_body_that_follows_its_head_across_the_lock_alarm_is_stored_replayable() {
    // An interim answer at 400 ms, the head at 600 ms, its 10-byte body at 1 s: the alarm of
    // the 1 s lock (750 ms) falls between head and body. The body phase renews the lock once
    // instead of settling, so the complete answer is stored and replayed.
    let backend = RawBackend::start(vec![
        Step::Pause(Duration::from_millis(400)),
        send(b"HTTP/1.1 102 Processing\r\n\r\n"),
        Step::Pause(Duration::from_millis(200)),
        send(b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\n"),
        Step::Pause(Duration::from_millis(400)),
        send(b"0123456789"),
    ])
    .await;
    let proxy = patient_proxy(&backend).await;
    let (first, again) = twice(&proxy, "head-before-alarm").await;
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    assert_eq!(first.body, b"0123456789");
    assert_eq!(
        (again.status, again.result()),
        (201, Some("HIT")),
        "{}",
        again.text()
    );
    assert_eq!(again.body, b"0123456789");
    assert_eq!(backend.count(), 1);
    let metrics = proxy
        .metrics_containing("idemgate_lock_renewals_total 1")
        .await;
    assert!(
        !metrics.contains("idemgate_settled_streaming_total 1"),
        "{metrics}"
    );
}

/// A record purged while its re-claimed execution runs is made again by the next lock renewal,
/// with the execution id the backend was sent (the first execution's), not the id minted for
/// the retry: after another release, the next retry still carries the id the backend saw.
#[tokio::test]
async fn a_renewal_that_remakes_a_purged_record_keeps_its_execution_id() {
    const TOKEN: &str = "admin-token-for-renewal-tests-0123";
    let unavailable = send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n");
    // Second request on the pooled connection: interim answers for 2.8 s (the 3 s lock is
    // renewed meanwhile, at three quarters of its life), then 503 again, which releases the
    // remade record.
    let mut slow = Vec::new();
    for _ in 0..7 {
        slow.push(Step::Pause(Duration::from_millis(400)));
        slow.push(send(b"HTTP/1.1 102 Processing\r\n\r\n"));
    }
    slow.push(unavailable.clone());
    let backend = RawBackend::start_sequence(vec![
        vec![unavailable.clone()],
        slow,
        vec![created("{\"id\":\"third\"}")],
    ])
    .await;
    let proxy = ProxyBuilder::at(backend.addr)
        .threads(1)
        .idem("lock_ttl: 3s")
        .upstream("connect_timeout: 200ms")
        .upstream("write_timeout: 200ms")
        .upstream("read_timeout: 1s")
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let first = order("purged-in-flight").send(proxy.addr).await;
    assert_eq!(first.status, 503, "{}", first.text());
    let addr = proxy.addr;
    let second = tokio::spawn(async move { order("purged-in-flight").send(addr).await });
    // Purged once the backend has the re-claimed request (its claim came first).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while backend.count() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the retry never reached the backend"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Purged on purpose while in flight (a plain purge of a live claim is refused).
    let del = Request::new(
        "DELETE",
        "/admin/records/default/purged-in-flight?force=true",
    )
    .header("Authorization", format!("Bearer {TOKEN}"))
    .send(proxy.admin)
    .await;
    assert_eq!(del.status, 200, "{}", del.text());
    let second = second.await.unwrap();
    assert_eq!(second.status, 503, "{}", second.text());
    let third = order("purged-in-flight").send(proxy.addr).await;
    assert_eq!(third.status, 201, "{}", third.text());

    let ids: Vec<String> = backend
        .heads()
        .iter()
        .filter_map(|head| {
            head.lines()
                .find_map(|l| l.strip_prefix("x-idempotency-id: "))
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(ids.len(), 3, "{:?}", backend.heads());
    assert!(
        ids.iter().all(|id| *id == ids[0]),
        "one execution id for the key throughout: {ids:?}"
    );
    let metrics = proxy.metrics().await;
    let renewals = common::metric(&metrics, "idemgate_lock_renewals_total").unwrap_or(0.0);
    assert!(renewals >= 1.0, "{metrics}");
}

#[tokio::test]
async fn a_backend_still_answering_keeps_its_lock_renewed() {
    // 102 Processing every 400 ms for 2 s, then the answer: each interim answer restarts the
    // read timeout, so the wait outlasts the 1 s lock. The proxy renews the lock while it
    // waits, and a retry past the first lock's end is told to wait (409), not executed again.
    let mut script = Vec::new();
    for _ in 0..4 {
        script.push(Step::Pause(Duration::from_millis(400)));
        script.push(send(b"HTTP/1.1 102 Processing\r\n\r\n"));
    }
    script.push(Step::Pause(Duration::from_millis(400)));
    script.push(created("{\"id\":\"slow\"}"));
    let backend = RawBackend::start(script).await;
    let proxy = patient_proxy(&backend).await;
    let addr = proxy.addr;
    let started = std::time::Instant::now();
    let first = tokio::spawn(async move {
        let r = order("still-answering").send(addr).await;
        (r, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let retry = order("still-answering").send(proxy.addr).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), "request-in-flight");
    let (first, took) = first.await.unwrap();
    assert_eq!((first.status, first.result()), (201, Some("MISS")));
    let later = order("still-answering").send(proxy.addr).await;
    assert_eq!((later.status, later.result()), (201, Some("HIT")));
    assert_eq!(later.body, b"{\"id\":\"slow\"}");
    assert_eq!(backend.count(), 1, "executed once");
    let metrics = proxy.metrics().await;
    let renewals: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_lock_renewals_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    // At 0.75 s and 1.5 s after the claim, before the answer at 2 s; one every 0.75 s for as
    // long as the answer took on a slow machine, never more.
    let most = (took.as_secs_f64() / 0.75) as u64 + 1;
    assert!(
        (2..=most).contains(&renewals),
        "renewals: {renewals} in {took:?}\n{metrics}"
    );
}

#[tokio::test]
async fn connections_pooled_to_a_backend_no_longer_used_are_closed_after_their_idle_time() {
    let ok = || vec![send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")];
    let old = RawBackend::start(ok()).await;
    let new = RawBackend::start(ok()).await;
    let mut proxy = ProxyBuilder::at(old.addr)
        .threads(1)
        .upstream("idle_timeout: 200ms")
        .start()
        .await;
    assert_eq!(Request::get("/plain").send(proxy.addr).await.status, 200);
    assert_eq!(
        (old.connections(), old.ended()),
        (1, 0),
        "one pooled connection"
    );

    // The backend moves (a reload; a host name resolving elsewhere is the same): nothing goes
    // to the old address again, yet its pooled connection must not stay open for good.
    let (from, to) = (old.addr.to_string(), new.addr.to_string());
    proxy.edit_config(Edit::Rename, |yaml| yaml.replace(&from, &to));
    let deadline = Instant::now() + Duration::from_secs(5);
    while new.count() == 0 {
        assert!(Instant::now() < deadline, "the reload never took effect");
        assert_eq!(Request::get("/plain").send(proxy.addr).await.status, 200);
    }
    // Requests sent before the reload took effect may have left a connection to the old
    // backend in the pool; from now on nothing uses it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while old.ended() < old.connections() {
        assert!(
            Instant::now() < deadline,
            "{} of the old backend's {} connections still open",
            old.connections() - old.ended(),
            old.connections()
        );
        assert_eq!(Request::get("/plain").send(proxy.addr).await.status, 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_pooled_connection_past_its_idle_time_is_not_reused_after_a_slow_upload() {
    use tokio::io::AsyncWriteExt;
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )])
    .await;
    let proxy = ProxyBuilder::at(backend.addr)
        .threads(1)
        .upstream("idle_timeout: 1s")
        .start()
        .await;
    assert_eq!(Request::get("/plain").send(proxy.addr).await.status, 200);
    assert_eq!(backend.connections(), 1);
    // A forwarded POST whose body takes 1.5 s to arrive: by the time it goes out, the pooled
    // connection has been idle longer than idle_timeout, so a new one is opened.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"POST /plain HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nhello")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.write_all(b"world").await.unwrap();
    let r = common::client::read_response(&mut s, false).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(backend.count(), 2);
    assert_eq!(
        backend.connections(),
        2,
        "the stale pooled connection was reused"
    );
}

/// An address of the upstream that cannot be connected to gives way to the next one: nothing
/// was sent, so a keyed POST goes on too, and no request fails for that address.
#[tokio::test]
async fn a_request_goes_on_to_the_next_address_when_one_cannot_be_connected_to() {
    let backend = common::Backend::start().await;
    let down = std::net::SocketAddr::from(([127, 0, 0, 1], common::proxy::free_port()));
    let proxy = ProxyBuilder::new(&backend).orders_first(down).start().await;
    for n in 0..4 {
        let keyed = Request::post("/orders")
            .key(&format!("next-{n}"))
            .body("{}")
            .send(proxy.addr)
            .await;
        assert_eq!(
            (keyed.status, keyed.result()),
            (201, Some("MISS")),
            "{}",
            keyed.text()
        );
        let plain = Request::post("/plain").json("{}").send(proxy.addr).await;
        assert_eq!(plain.status, 201, "{}", plain.text());
    }
    assert_eq!(backend.count(), 8);
}

/// An address whose connects hang (a listener whose accept queue is full drops new SYNs), held
/// open by the listener and the connections that fill it.
fn address_that_never_connects() -> (
    std::net::SocketAddr,
    tokio::net::TcpListener,
    Vec<std::net::TcpStream>,
) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    while queued.len() < 16 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(s) => queued.push(s),
            Err(_) => return (addr, listener, queued),
        }
    }
    panic!("the accept queue never filled");
}

/// A keyed request goes on to the next address only while its claim's lock outlasts a whole
/// further exchange: sent after the lock lapsed, it could run beside a retry that took the key.
/// A request without a key goes on regardless.
#[tokio::test]
async fn a_keyed_request_goes_on_to_the_next_address_only_within_its_lock() {
    let backend = common::Backend::start().await;
    let (hangs, _listener, _queued) = address_that_never_connects();
    // The lock (2.5 s) covers one exchange (1 s + 300 ms + 1 s), not a second after a 1 s
    // connect that timed out.
    let proxy = ProxyBuilder::new(&backend)
        .orders_first(hangs)
        .threads(1)
        .upstream("connect_timeout: 1s")
        .upstream("write_timeout: 300ms")
        .upstream("read_timeout: 1s")
        .idem("lock_ttl: 2500ms")
        .start()
        .await;
    // Round robin: the first request starts at the address that hangs, the second at the
    // backend, the third at the one that hangs again.
    let keyed = Request::post("/orders")
        .key("within-the-lock")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(keyed.status, 502, "{}", keyed.text());
    let plain = Request::post("/plain").json("{}").send(proxy.addr).await;
    assert_eq!(plain.status, 201, "{}", plain.text());
    let plain = Request::post("/plain").json("{}").send(proxy.addr).await;
    assert_eq!(plain.status, 201, "{}", plain.text());
    assert_eq!(backend.count(), 2, "the keyed request was never sent");
}

/// A `write_timeout` past what the kernel's `TCP_USER_TIMEOUT` holds (an `int` of milliseconds,
/// 24.8 days) is held to its cap: wrapped to a negative value, the kernel refused it and pingora
/// failed every connection it opened, so streamed requests (here a chunked body) got 502.
#[tokio::test]
async fn a_write_timeout_longer_than_the_kernel_holds_does_not_break_streamed_requests() {
    let backend = common::Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend).start().await;
    // Both keyed routes' locks must outlast such an upstream's exchange; set live.
    let locks = "      lock_ttl: 31d\n      ttl: 62d\n";
    proxy.edit_config(Edit::Rename, |y| {
        y.replacen("  other:\n", "    write_timeout: 30d\n  other:\n", 1)
            .replacen(
                "      key: required\n",
                &format!("      key: required\n{locks}"),
                1,
            )
            .replacen(
                "      key: optional\n",
                &format!("      key: optional\n{locks}"),
                1,
            )
    });
    proxy
        .metrics_containing("idemgate_config_reloads_total 1")
        .await;
    let streamed = Request::post("/plain")
        .json("{}")
        .chunked(1)
        .send(proxy.addr)
        .await;
    assert_eq!(streamed.status, 201, "{}", streamed.text());
    let keyed = Request::post("/orders")
        .key("long-write")
        .body("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(keyed.status, 201, "{}", keyed.text());
}

/// The next address is tried by the clock of then: after a connect that timed out, a pooled
/// connection there has been idle for that time too, and one past the idle time its backend
/// advertised is not reused (it may be closing).
#[tokio::test]
async fn the_next_address_judges_its_pooled_connections_by_the_clock_of_then() {
    let (hangs, _listener, _queued) = address_that_never_connects();
    let backend = RawBackend::start(vec![send(
        b"HTTP/1.1 201 Created\r\nKeep-Alive: timeout=2\r\nContent-Length: 2\r\n\r\n{}",
    )])
    .await;
    let proxy = ProxyBuilder::at(backend.addr)
        .orders_first(hangs)
        .threads(1)
        .upstream("connect_timeout: 2s")
        .start()
        .await;
    // Round robin from the address that hangs: the first request goes on to the backend after
    // two seconds, the second starts at the backend and reuses that connection.
    for _ in 0..2 {
        let r = Request::post("/plain").json("{}").send(proxy.addr).await;
        assert_eq!(r.status, 201, "{}", r.text());
    }
    assert_eq!(
        backend.connections(),
        1,
        "pooled when it was used, two seconds in"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The third starts at the address that hangs: by the time it goes on, the connection has
    // been idle 2.3 s, past the 1 s the backend's `timeout=2` leaves (with the request's start
    // as the clock, 0.3 s).
    let r = Request::post("/plain").json("{}").send(proxy.addr).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(backend.connections(), 2, "not reused past its idle limit");
}

/// A backend that says how long it keeps an idle connection (`Keep-Alive: timeout=N`, as
/// Node.js and Apache do) closes it then, perhaps just as a request goes into it: a keyed one
/// would end as an unknown outcome with its key locked. Such a connection is reused only while
/// it has been idle under N less a second, and with `timeout=1` not at all.
#[tokio::test]
async fn a_connection_is_not_reused_past_the_idle_time_the_backend_advertised() {
    let answer = |timeout: &str| {
        send(
            format!(
                "HTTP/1.1 201 Created\r\nKeep-Alive: timeout={timeout}, max=100\r\n\
                 Content-Length: 2\r\n\r\n{{}}"
            )
            .as_bytes(),
        )
    };
    // The value as a quoted string, which the header's grammar allows too.
    let backend = RawBackend::start(vec![answer("\"2\"")]).await;
    let patient = proxy(&backend).await;
    for key in ["ka-1", "ka-2"] {
        let r = order(key).send(patient.addr).await;
        assert_eq!(r.status, 201, "{}", r.text());
        assert!(r.headers_named("keep-alive").is_empty(), "hop-by-hop");
    }
    assert_eq!(backend.connections(), 1, "reused at once");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(order("ka-3").send(patient.addr).await.status, 201);
    assert_eq!(backend.connections(), 2, "idle past 2 s less a second");

    let brief = RawBackend::start(vec![answer("1")]).await;
    let brief_proxy = proxy(&brief).await;
    for key in ["kb-1", "kb-2"] {
        assert_eq!(order(key).send(brief_proxy.addr).await.status, 201);
    }
    assert_eq!(
        brief.connections(),
        2,
        "timeout=1 leaves no time to reuse it"
    );
}

/// `max_in_flight`: with the upstream's two places taken, a third request (keyed or not) gets
/// 503 `upstream-busy` without reaching the backend, and its key is released, so its retry runs
/// once a place is free; a replay of a stored key is answered whatever the backend's load. The
/// count carries over a reload, and a streamed body holds its place until its answer.
#[tokio::test]
async fn an_upstream_at_max_in_flight_refuses_what_would_be_sent_and_still_replays() {
    let backend = common::Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend)
        .upstream("max_in_flight: 2")
        .start()
        .await;
    let in_flight =
        |m: &str| common::metric(m, r#"idemgate_upstream_in_flight{upstream="orders"}"#);
    let done = Request::post("/orders/x")
        .key("done")
        .json("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(done.status, 201, "{}", done.text());
    // A client still sending its body holds no place: only a request going out does.
    let mut trickling = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    trickling
        .write_all(b"POST /plain/t HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nhalf-")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let a = Request::post("/orders/gate/a")
        .key("a")
        .json("{}")
        .spawn_send(proxy.addr);
    let b = Request::post("/plain/gate/b")
        .body("b")
        .spawn_send(proxy.addr);
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.count() < 3 {
        assert!(
            Instant::now() < deadline,
            "the two gated requests did not arrive"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let m = proxy.metrics().await;
    assert_eq!(in_flight(&m), Some(2.0), "{m}");
    drop(trickling);
    let view = Request::get("/admin/config").send(proxy.admin).await;
    let v: serde_json::Value = serde_json::from_slice(&view.body).unwrap();
    assert_eq!(v["upstreams"][0]["max_in_flight"], 2, "{v}");

    let refused = Request::post("/orders/y")
        .key("c")
        .json("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.problem_type(), "upstream-busy");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.result(), Some("UNAVAILABLE"));
    let plain = Request::post("/plain/z").body("z").send(proxy.addr).await;
    assert_eq!(plain.status, 503, "{}", plain.text());
    assert_eq!(plain.problem_type(), "upstream-busy");
    assert_eq!(backend.count(), 3, "a refused request reached the backend");
    let replay = Request::post("/orders/x")
        .key("done")
        .json("{}")
        .send(proxy.addr)
        .await;
    assert_eq!((replay.status, replay.result()), (201, Some("HIT")));

    // A reload (here of the limit itself) keeps counting the requests already out.
    proxy.edit_config(Edit::Rename, |y| {
        y.replacen("max_in_flight: 2", "max_in_flight: 3", 1)
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let c = loop {
        let c = Request::post("/plain/gate/c")
            .body("c")
            .spawn_send(proxy.addr);
        while !c.is_finished() && backend.count() < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if backend.count() == 4 {
            break c;
        }
        assert_eq!(c.await.unwrap().problem_type(), "upstream-busy");
        assert!(Instant::now() < deadline, "the new limit was not taken");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let fourth = Request::post("/plain/v").body("v").send(proxy.addr).await;
    assert_eq!(fourth.problem_type(), "upstream-busy", "{}", fourth.text());

    for gate in ["a", "b", "c"] {
        backend.open(gate);
    }
    assert_eq!(a.await.unwrap().status, 201);
    assert_eq!(b.await.unwrap().status, 201);
    assert_eq!(c.await.unwrap().status, 201);
    // Released when refused: the retry runs, once.
    let retried = Request::post("/orders/y")
        .key("c")
        .json("{}")
        .send(proxy.addr)
        .await;
    assert_eq!((retried.status, retried.result()), (201, Some("MISS")));
    // A streamed (chunked) body takes pingora's path, and gives its place back too.
    let streamed = Request::post("/plain/s")
        .body(vec![b's'; 1000])
        .chunked(100);
    assert_eq!(streamed.send(proxy.addr).await.status, 201);
    // Three refusals above, and any of `c`'s tries before the reload was taken.
    let m = proxy.metrics().await;
    let busy = common::metric(&m, r#"idemgate_upstream_busy_total{upstream="orders"}"#);
    assert!(busy.is_some_and(|n| n >= 3.0), "{m}");
    // Every place given back: a request on pingora's path gives its place back as it ends,
    // a moment after its client has the whole answer.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = proxy.metrics().await;
        if in_flight(&m) == Some(0.0) {
            break;
        }
        assert!(Instant::now() < deadline, "places still taken: {m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An upgraded connection whose backend says nothing for `read_timeout` is closed, as nginx's
/// `proxy_read_timeout` closes one: a route that carries WebSockets needs an upstream whose
/// `read_timeout` outlasts the backend's quiet spells (or a backend that pings). Documented in
/// docs/http.md; this test fails if that ever changes, so the docs can follow.
#[tokio::test]
async fn a_tunnel_whose_backend_is_quiet_for_read_timeout_is_closed() {
    let (text, _) =
        read_through_quiet_tunnel(|at| ProxyBuilder::at(at).upstream("read_timeout: 300ms")).await;
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    assert!(
        !text.ends_with("hello"),
        "the quiet tunnel was kept: {text}"
    );
}
