//! Clients that stop reading: idemgate gives their connections up within
//! `response_send_timeout`, however the response is framed and wherever the write waits.
//!
//! Whether the proxy still holds a connection is read from the kernel (`/proc/net/tcp`): the
//! proxy's end of it is ESTABLISHED while the proxy holds it, and any other state (closing with
//! unsent data, reset, gone) once it has let go. The client keeps its end open and reads nothing
//! throughout, so only the proxy can have moved it.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::rawbackend::{RawBackend, Step};
use common::tcp::{self, ESTABLISHED};
use common::{Backend, ProxyBuilder, Request};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The `response_send_timeout` of every proxy here.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Room on top of [`SEND_TIMEOUT`] for a shared, noisy machine: a response may wait twice (a
/// body write pingora times out, then its last chunk), and the proxy then has to get scheduled.
const SLACK: Duration = Duration::from_secs(5);

/// A chunked response body far larger than the kernel buffers between proxy and client.
const BODY: usize = 4 << 20;

/// The kernel's state of the proxy's end of the connection from `client`, `None` once the
/// socket is gone.
fn proxy_side_state(proxy: SocketAddr, client: SocketAddr) -> Option<u8> {
    tcp::socket(proxy.port(), client.port()).map(|s| s.state)
}

/// Bytes the proxy's end of the connection from `client` holds unsent (its send queue).
fn proxy_side_unsent(proxy: SocketAddr, client: SocketAddr) -> u64 {
    tcp::socket(proxy.port(), client.port()).map_or(0, |s| s.tx_queue)
}

/// Waits until the proxy has let go of the connection from `client`, failing if it still holds
/// it `within` after `since`.
async fn given_up(proxy: SocketAddr, client: SocketAddr, since: Instant, within: Duration) {
    loop {
        let state = proxy_side_state(proxy, client);
        if state != Some(ESTABLISHED) {
            return;
        }
        assert!(
            since.elapsed() < within,
            "the proxy still holds the connection from {client} after {:?}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A connection to `proxy` whose receive buffer is as small as the kernel allows, so the
/// response backs up into the proxy's socket at once.
async fn non_reader(proxy: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("receive buffer");
    let stream = socket.connect(proxy).await.expect("connect to proxy");
    // The proxy's end is in the kernel's table from the start: `given_up` reading no row as
    // "let go" is then a real change, not a lookup that never matched.
    let local = stream.local_addr().expect("client addr");
    assert_eq!(
        proxy_side_state(proxy, local),
        Some(ESTABLISHED),
        "the proxy's end of {local} is not in /proc/net/tcp"
    );
    stream
}

/// A backend answering every request with [`BODY`] bytes, chunked.
async fn chunked_backend() -> RawBackend {
    let mut script = vec![Step::Send(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec(),
    )];
    const CHUNK: usize = 256 << 10;
    let chunk: Vec<u8> = (0..CHUNK).map(|i| b'a' + (i % 26) as u8).collect();
    for _ in 0..BODY / CHUNK {
        let mut frame = format!("{CHUNK:x}\r\n").into_bytes();
        frame.extend_from_slice(&chunk);
        frame.extend_from_slice(b"\r\n");
        script.push(Step::Send(frame));
    }
    script.push(Step::Send(b"0\r\n\r\n".to_vec()));
    RawBackend::start(script).await
}

/// Sends `req` on a connection that never reads its answer and waits until the proxy lets go.
async fn send_to_non_reader(proxy: SocketAddr, req: &Request) {
    let mut client = non_reader(proxy).await;
    let local = client.local_addr().expect("client addr");
    client.write_all(&req.to_bytes()).await.expect("write");
    given_up(proxy, local, Instant::now(), SEND_TIMEOUT + SLACK).await;
    drop(client);
}

#[tokio::test]
async fn a_large_chunked_answer_to_a_client_that_never_reads_is_given_up_on_a_plain_route() {
    let backend = chunked_backend().await;
    let proxy = ProxyBuilder::at(backend.addr)
        .top("response_send_timeout: 1s")
        .start()
        .await;
    // pingora times the body writes, but then still writes the last chunk and flushes with no
    // deadline of its own.
    send_to_non_reader(proxy.addr, &Request::get("/plain/large")).await;
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn a_large_chunked_answer_to_a_client_that_never_reads_is_given_up_and_stored_on_a_keyed_route(
) {
    let backend = chunked_backend().await;
    let proxy = ProxyBuilder::at(backend.addr)
        .top("response_send_timeout: 1s")
        .idem("max_response_bytes: 32MiB")
        .start()
        .await;
    let order = || Request::post("/orders").key("stalled-chunked").body("{}");
    send_to_non_reader(proxy.addr, &order()).await;
    // The outcome was stored before the client was given up: a retry is replayed whole.
    let retry = order().send(proxy.addr).await;
    assert_eq!((retry.status, retry.result()), (200, Some("HIT")));
    assert_eq!(retry.body.len(), BODY);
    assert_eq!(backend.count(), 1);
}

#[tokio::test]
async fn a_keep_alive_client_that_sends_small_requests_and_never_reads_is_given_up() {
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend)
        .top("response_send_timeout: 1s")
        .start()
        .await;
    let mut client = non_reader(proxy.addr).await;
    let local = client.local_addr().expect("client addr");
    // An answer that still fits the stream's write buffer (1460 bytes) whole, so the flush
    // that ends it is the only write that reaches the socket; as large as that allows, so the
    // kernel buffers (megabytes, once loopback autotuning has grown them) fill in fewer requests.
    let request = Request::get("/plain/large/1000").to_bytes();
    // One request at a time, each once the one before it reached the backend (so none is
    // pipelined): the answers pile up in the kernel buffers until the proxy's flush of one has
    // to wait. Then the backend sees no more, and the proxy's socket holds unsent bytes or is
    // already given up (a proxy that is only slow, on a loaded machine, has neither: it is
    // waited for).
    let mut stalled_at = None;
    for sent in 1..=20_000 {
        client.write_all(&request).await.expect("write request");
        let wait = Instant::now();
        while backend.count() < sent {
            let stalled = || {
                proxy_side_unsent(proxy.addr, local) > 0
                    || proxy_side_state(proxy.addr, local) != Some(ESTABLISHED)
            };
            if wait.elapsed() > Duration::from_millis(1500) && stalled() {
                stalled_at = Some(wait);
                break;
            }
            assert!(
                wait.elapsed() < Duration::from_secs(30),
                "request {sent} never reached the backend, and the proxy neither has anything unsent nor gave up"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if stalled_at.is_some() {
            break;
        }
    }
    let stalled_at = stalled_at.expect("the proxy's writes never had to wait");
    assert!(
        backend.count() > 10,
        "only {} answers went out before the proxy stopped taking requests",
        backend.count()
    );
    given_up(proxy.addr, local, stalled_at, SEND_TIMEOUT + SLACK).await;
    drop(client);
}
