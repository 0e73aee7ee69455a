//! Backend answers a well-behaved HTTP library never sends, through the real proxy: each test
//! checks what the client gets, what a retry gets, and that nothing is stored as complete unless
//! a whole answer arrived.

mod common;

use std::time::Duration;

use common::rawbackend::{RawBackend, Step};
use common::{Proxy, ProxyBuilder, Request};
use tokio::io::AsyncWriteExt;

fn send(bytes: &[u8]) -> Step {
    Step::Send(bytes.to_vec())
}

async fn proxy(backend: &RawBackend) -> Proxy {
    ProxyBuilder::at(backend.addr)
        .idem("lock_ttl: 1s")
        .upstream("connect_timeout: 200ms")
        .upstream("read_timeout: 500ms")
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
    tokio::time::sleep(Duration::from_millis(1300)).await;
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
