//! The HTTP/1.1 client idemgate forwards with.
//!
//! pingora's own upstream path writes a request's header and body in two writes, checks every
//! pooled connection with a `getpeername` call and moves each response through a duplex task
//! loop; on a small API request those costs are most of the proxy's time. This client does the
//! one thing idemgate needs, the way a request/response API backend is used:
//!
//! - the request head and body go out in one `writev`;
//! - the response head is parsed in place (`httparse`), its header values share the read buffer;
//! - the body is framed by RFC 9112 §6.3 (no body for HEAD, 1xx, 204 and 304; chunked when the
//!   last transfer coding is chunked, trailers consumed; `Content-Length`, with conflicting values
//!   refused; otherwise until the backend closes);
//! - keep-alive connections are pooled per worker thread and per address (each worker thread
//!   runs its own scheduler and I/O driver, so a connection stays with the thread that opened
//!   it), newest first, dropped after `idle_timeout` (or sooner, when the backend's
//!   `Keep-Alive: timeout` says so). A pooled connection is checked before use with one `poll`
//!   that does not wait: the backend closing it, or stray bytes, show as readable.
//!
//! Every read is bounded by the upstream's `read_timeout`, the connect by `connect_timeout`, and
//! the whole write of a request by `write_timeout` (a write cut short after part of the request
//! went out is an unknown outcome unless the backend answers; see [`send`]).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::fast_timeout::fast_timeout;
use pingora::prelude::Elapsed;
use pingora::protocols::l4::ext::{set_tcp_keepalive, TcpKeepalive};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest body a forwarded request may have to be read whole and sent by this client; larger
/// (or chunked) bodies of forwarded requests are streamed by pingora's proxy path.
pub const FORWARD_BODY_BYTES: usize = 64 * 1024;
/// Largest response head (status line and headers) accepted from a backend.
pub const MAX_RESPONSE_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields accepted in one response head (and so in a stored response).
const MAX_RESPONSE_HEADERS: usize = crate::store::response::MAX_HEADERS;
/// Longest chunk-size line, and most trailer bytes, accepted in a chunked body.
const MAX_CHUNK_LINE_BYTES: usize = 4096;
const MAX_TRAILER_BYTES: usize = 64 * 1024;
/// Idle connections kept per worker thread and backend address.
pub const MAX_IDLE_PER_ADDRESS: usize = 128;
/// Informational (1xx) responses accepted before the final one: enough for a backend that sends
/// `102 Processing` every second for a quarter of an hour, and a bound on one that loops.
const MAX_INFORMATIONAL: usize = 1024;
/// Size of each read from the backend.
const READ_BYTES: usize = 16 * 1024;

/// Hop-by-hop headers (RFC 9110 §7.6.1): never forwarded, never stored.
pub const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authenticate",
];

/// Request headers this client writes itself (framing) or answers itself (`Expect`).
///
/// `X-Idempotency-Id` is the proxy's alone: a client's own would reach the backend first and
/// let the client choose the id a backend's unique index is checked against.
const WRITTEN_HERE: &[&str] = &[
    "content-length",
    "expect",
    crate::proxy::EXECUTION_ID_HEADER,
];

/// Headers of a response that belong to its connection, not to the response.
pub const RESPONSE_HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// One address of an upstream and the budgets for talking to it.
#[derive(Debug, Clone)]
pub struct Backend {
    pub addr: SocketAddr,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Why an exchange with a backend failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Nothing was sent: the backend never saw the request.
    #[error("connecting to {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    /// Not one byte of the request could be written: the backend got nothing.
    #[error("writing the request: {0}")]
    Write(io::Error),
    /// The request went out; no complete answer came back.
    #[error("reading the response: {0}")]
    Read(io::Error),
    /// The backend closed the connection before the response was complete.
    #[error("the backend closed the connection {0}")]
    Closed(&'static str),
    /// The backend's answer is not HTTP/1.x as this client accepts it.
    #[error("malformed response: {0}")]
    Malformed(&'static str),
    /// The backend gave a final status (`status`, 200 or above), but the head that carried it
    /// cannot be relayed (`what`): the request was answered, so it ran, yet nothing of the
    /// answer can go on.
    #[error("malformed {status} response: {what}")]
    Invalid { status: u16, what: &'static str },
}

/// `fast_timeout`, except that no timer is armed when `fut` is ready at its first poll: a write
/// into a socket with room, or bytes that are already in the kernel's buffer. That is most I/O
/// on this path, and a timer costs a clock read and a registration each time.
pub async fn within<F: Future>(limit: Duration, fut: F) -> Result<F::Output, Elapsed> {
    bounded(fut, || limit).await
}

/// `fut`, or [`Elapsed`] if `deadline` comes first. Like [`within`], the clock is read and a
/// timer armed only when `fut` is not ready at its first poll.
pub async fn until<F: Future>(deadline: Instant, fut: F) -> Result<F::Output, Elapsed> {
    bounded(fut, || deadline.saturating_duration_since(Instant::now())).await
}

/// Polls `fut` once; only if it is pending is `limit` asked for and a timer armed.
pub async fn bounded<F: Future>(
    fut: F,
    limit: impl FnOnce() -> Duration,
) -> Result<F::Output, Elapsed> {
    let mut fut = pin!(fut);
    match poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        Poll::Ready(output) => Ok(output),
        Poll::Pending => fast_timeout(limit(), fut).await,
    }
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("{what} timed out"))
}

// === pool ===

struct Idle {
    stream: TcpStream,
    since: Instant,
    /// How long it may stay idle: `idle_timeout`, or less when the backend said it closes
    /// idle connections sooner.
    limit: Duration,
}

/// One worker thread's idle connections, by backend address.
#[derive(Default)]
struct Pool {
    by_addr: HashMap<SocketAddr, Pooled>,
    /// When every address was last swept (see [`Pool::sweep`]).
    swept: Option<Instant>,
}

/// The idle connections to one address, oldest first.
#[derive(Default)]
struct Pooled {
    idle: VecDeque<Idle>,
}

/// How often a worker thread's pool drops the connections past their idle time at every
/// address, not only the one it is using: an address no request goes to any more (a backend
/// that moved, a reload that dropped it) would otherwise keep its connections open for good.
const POOL_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

impl Pool {
    /// Drops connections idle for their address's `idle_timeout` by `now`, and addresses left
    /// with none.
    fn sweep(&mut self, now: Instant) {
        self.swept = Some(now);
        self.by_addr.retain(|_, pooled| {
            pooled
                .idle
                .retain(|c| now.saturating_duration_since(c.since) < c.limit);
            !pooled.idle.is_empty()
        });
    }
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// Why an answer of `status` is no answer at all, on this client and pingora's streaming path
/// alike: HTTP has no status above 599 (RFC 9110 §15), so such a code has no class to say
/// whether the request ran, and a `101 Switching Protocols` to a request that asked for no
/// upgrade would leave the client on a connection switched to nothing it asked for. Either way
/// the outcome is unknown.
pub fn unrelayable_status(status: u16, upgrade_asked: bool) -> Option<&'static str> {
    if status > 599 {
        Some("status code above 599")
    } else if status == 101 && !upgrade_asked {
        Some("101 Switching Protocols to a request without Upgrade")
    } else {
        None
    }
}

/// Pooled connections dropped because the backend had sent bytes nobody asked for on them.
static STRAY_BYTES_DROPS: AtomicU64 = AtomicU64::new(0);

/// Pooled connections found holding bytes nobody asked for, and dropped, since the start
/// (`idemgate_upstream_stray_bytes_total`).
pub fn stray_bytes_drops() -> u64 {
    STRAY_BYTES_DROPS.load(Ordering::Relaxed)
}

/// The newest idle connection to `backend` that is still open, if any. `now` is a recent
/// instant (when the request goes out): the pool reads no clock of its own.
fn take_idle(backend: &Backend, now: Instant) -> Option<TcpStream> {
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        let idle = &mut pool.by_addr.get_mut(&backend.addr)?.idle;
        while let Some(conn) = idle.pop_back() {
            if now.saturating_duration_since(conn.since) >= conn.limit.min(backend.idle_timeout) {
                continue;
            }
            if still_open(&conn.stream) {
                return Some(conn.stream);
            }
            if holds_stray_bytes(&conn.stream) {
                stray_bytes_found(backend.addr);
            }
        }
        None
    })
}

/// Whether a connection that polled readable holds bytes nobody asked for: not the end of the
/// stream a backend closing an idle connection leaves, nor the `408` some servers send before
/// they close one (both usual). Asked only of those.
fn holds_stray_bytes(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut head = [0u8; 12];
    // SAFETY: a buffer of our own, of the length given; MSG_PEEK leaves the bytes where they
    // are.
    let read = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            head.as_mut_ptr().cast(),
            head.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    let Ok(read) = usize::try_from(read) else {
        return false;
    };
    let idle_timeout_notice =
        head.starts_with(b"HTTP/1.1 408") || head.starts_with(b"HTTP/1.0 408");
    read > 0 && !idle_timeout_notice
}

/// A backend sent bytes after a complete answer (a body after a 204, 304 or an answer to
/// HEAD, or past its `Content-Length`): the connection was dropped before another request went
/// out on it. Bytes that come a moment later than this check would be read as the next
/// request's answer, so such a backend is a danger to every client: said and counted.
fn stray_bytes_found(addr: SocketAddr) {
    STRAY_BYTES_DROPS.fetch_add(1, Ordering::Relaxed);
    crate::warn_throttled!(
        backend = %addr,
        "a pooled backend connection held bytes sent after a complete answer; dropped. The \
         backend writes past its answers' framing, and such bytes arriving later would be read \
         as another request's answer: fix the backend, or set the upstream's idle_timeout to 0s"
    );
}

/// A pooled connection is usable when it has nothing to read: a backend that closed it (or
/// sent bytes nobody asked for) makes it readable (an end of stream reads too). Asked of the
/// socket itself (a `poll` that does not wait), not of tokio's readiness state: that learns of
/// a close or of stray bytes only when its driver next polls, which under load can come after
/// the connection was handed out again, and the next request, perhaps another tenant's, would
/// read those bytes as its answer, or go into a connection already closed (an unknown outcome
/// that keeps its key locked). One system call per reuse, and a light one: it reads the
/// socket's state without taking its lock (a `MSG_PEEK` receive cost about 3% of pass-through
/// throughput in an A/B on the bench rig, this about 1%).
fn still_open(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready == 0
}

/// Pools `stream`, idle since `since` (when its request started: earlier than the truth, so
/// a connection is dropped a little before `idle_timeout`, never after), for `idle_timeout`, or
/// for `advertised` (the backend's `Keep-Alive: timeout`) less a second when that is shorter:
/// a connection the backend is about to close must not take a request that then fails.
fn put_idle(backend: &Backend, stream: TcpStream, since: Instant, advertised: Option<Duration>) {
    let limit = advertised.map_or(backend.idle_timeout, |t| {
        t.saturating_sub(Duration::from_secs(1))
            .min(backend.idle_timeout)
    });
    if limit.is_zero() {
        return;
    }
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool
            .swept
            .is_none_or(|at| since.saturating_duration_since(at) >= POOL_SWEEP_INTERVAL)
        {
            pool.sweep(since);
        }
        let idle = &mut pool.by_addr.entry(backend.addr).or_default().idle;
        // Drop the ones past their idle time, and the oldest when full.
        idle.retain(|c| since.saturating_duration_since(c.since) < c.limit);
        if idle.len() >= MAX_IDLE_PER_ADDRESS {
            idle.pop_front();
        }
        idle.push_back(Idle {
            stream,
            since,
            limit,
        });
    });
}

/// TCP keepalive and `TCP_USER_TIMEOUT` of every backend connection (ours, and pingora's for the
/// requests it streams), for a backend on `write_timeout`.
///
/// A backend host that vanishes without a word (powered off, a NAT or load balancer on the way
/// dropping the flow) leaves its pooled connections looking open: reused, a request goes out
/// into nothing, waits `read_timeout` and ends as an unknown outcome that keeps the key locked,
/// though a fresh connection would have failed to connect and said the request never went.
/// Probes after 5 s idle (every 2 s, 3 unanswered) find such a connection dead within about
/// 11 s of idling, and `take_idle` then drops it on its pending error. Sent data left
/// unacknowledged 10 s (or `write_timeout`, if longer) ends the connection at once instead of
/// after `read_timeout`: a live host acknowledges within a round trip, whatever its load.
/// The kernel takes that bound as a C `int` of milliseconds (pingora converts with `as`), so it
/// is held to [`MAX_USER_TIMEOUT`]: a longer `write_timeout` would wrap to a negative value the
/// kernel refuses, and pingora fails every connect it makes with it.
#[cfg_attr(not(target_os = "linux"), allow(unused_variables))]
pub fn keepalive(write_timeout: Duration) -> TcpKeepalive {
    TcpKeepalive {
        idle: Duration::from_secs(5),
        interval: Duration::from_secs(2),
        count: 3,
        #[cfg(target_os = "linux")]
        user_timeout: write_timeout.clamp(Duration::from_secs(10), MAX_USER_TIMEOUT),
    }
}

/// The longest `TCP_USER_TIMEOUT` set: a day, well inside an `int` of milliseconds (24.8 days).
pub const MAX_USER_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

async fn connect(backend: &Backend) -> Result<TcpStream, UpstreamError> {
    let connected = fast_timeout(backend.connect_timeout, TcpStream::connect(backend.addr))
        .await
        .unwrap_or_else(|_| Err(timed_out("connect")));
    let stream = connected.map_err(|source| UpstreamError::Connect {
        addr: backend.addr,
        source,
    })?;
    stream
        .set_nodelay(true)
        .map_err(|source| UpstreamError::Connect {
            addr: backend.addr,
            source,
        })?;
    // Failing here leaves a connection as good as any before keepalive: not worth refusing.
    let _ = set_tcp_keepalive(&stream, &keepalive(backend.write_timeout));
    Ok(stream)
}

// === request ===

/// Writes the request line and headers of `req` for the backend: hop-by-hop headers, headers
/// named by `Connection`, `Expect` and the client's framing are left out, `Content-Length` is
/// written for `body_len`, then `extra` headers. Header names keep the client's spelling.
///
/// `scoping` are the headers that choose a request's record (key, tenant, scope): spelt with
/// `_` for `-` they are left out too, as CGI-style backends read them as the real ones, and
/// could be told another tenant than the one the record was chosen under.
pub fn request_head(
    req: &RequestHeader,
    body_len: Option<usize>,
    extra: &[(&str, &[u8])],
    scoping: &[http::HeaderName],
    buf: &mut Vec<u8>,
) {
    buf.extend_from_slice(req.method.as_str().as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(req.raw_path());
    buf.extend_from_slice(b" HTTP/1.1\r\n");
    let named = ConnectionNamed::of(req.headers.get_all(header::CONNECTION));
    let _ = req.map(|name, value| {
        let name = match name {
            pingora::http::HeaderNameVariant::Case(n) => n.as_slice(),
            pingora::http::HeaderNameVariant::Titled(n) => n.as_bytes(),
        };
        let skip = is_reserved(name) || named.names(name) || is_underscore_spoof(name, scoping);
        if !skip {
            buf.extend_from_slice(name);
            buf.extend_from_slice(b": ");
            buf.extend_from_slice(value.as_bytes());
            buf.extend_from_slice(b"\r\n");
        }
        Ok(())
    });
    if let Some(len) = body_len {
        buf.extend_from_slice(b"Content-Length: ");
        buf.extend_from_slice(itoa(len as u64, &mut [0u8; 20]));
        buf.extend_from_slice(b"\r\n");
    }
    for (name, value) in extra {
        buf.extend_from_slice(name.as_bytes());
        buf.extend_from_slice(b": ");
        buf.extend_from_slice(value);
        buf.extend_from_slice(b"\r\n");
    }
    buf.extend_from_slice(b"\r\n");
}

/// The authority of an absolute-form request target (`shop:8080` in `http://shop:8080/orders`).
pub fn target_authority(target: &[u8]) -> Option<&[u8]> {
    let start = target.windows(3).position(|w| w == b"://")? + 3;
    let rest = &target[start..];
    let end = rest
        .iter()
        .position(|&b| b == b'/' || b == b'?' || b == b'#')
        .unwrap_or(rest.len());
    Some(&rest[..end]).filter(|a| !a.is_empty())
}

/// Whether a request header is one the client may not pass to the backend: hop-by-hop, or
/// written here ([`HOP_BY_HOP`], [`WRITTEN_HERE`]), spelt with `_` for `-` too. Backends on
/// CGI-style stacks (`HTTP_X_IDEMPOTENCY_ID`, `CONTENT_LENGTH`) read `X_Idempotency_Id` as
/// `X-Idempotency-Id`, so a client could otherwise still choose the execution id, or send a
/// second framing header, under the other spelling.
pub fn is_reserved(name: &[u8]) -> bool {
    HOP_BY_HOP
        .iter()
        .chain(WRITTEN_HERE)
        .any(|h| spelt_as(name, h))
}

/// Whether `name` is `h`, ignoring case, with `_` for any `-`.
fn spelt_as(name: &[u8], h: &str) -> bool {
    name.len() == h.len()
        && name
            .iter()
            .zip(h.as_bytes())
            .all(|(&a, &b)| a.eq_ignore_ascii_case(&b) || (a == b'_' && b == b'-'))
}

/// Whether `name` spells, with `_` for some `-`, a header the client may not pass ([`is_reserved`])
/// or one of `scoping` (the headers that chose the record), without being that header itself:
/// what CGI-style backends would read as the real one.
pub fn is_underscore_spoof(name: &[u8], scoping: &[http::HeaderName]) -> bool {
    name.contains(&b'_')
        && (is_reserved(name)
            || scoping.iter().any(|h| {
                spelt_as(name, h.as_str()) && !name.eq_ignore_ascii_case(h.as_str().as_bytes())
            }))
}

/// Header names listed in `Connection` values (other than the usual `close` / `keep-alive`).
pub fn connection_tokens<'a>(values: http::header::GetAll<'a, HeaderValue>) -> Vec<&'a [u8]> {
    each_connection_token(values).collect()
}

/// [`connection_tokens`] one by one, without collecting them.
pub fn each_connection_token<'a>(
    values: http::header::GetAll<'a, HeaderValue>,
) -> impl Iterator<Item = &'a [u8]> {
    values
        .into_iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|t| t.trim_ascii())
        .filter(|t| {
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"close")
                && !t.eq_ignore_ascii_case(b"keep-alive")
        })
}

/// Tokens of a `Connection` compared one by one with each header; past this many,
/// [`ConnectionNamed`] looks names up in a sorted copy.
const FEW_TOKENS: usize = 8;

/// The header names a message's `Connection` lists ([`connection_tokens`]), for leaving those
/// headers out. Looked up once per header: one by one while they are few; past [`FEW_TOKENS`]
/// by binary search in a lower-cased, sorted, deduplicated copy, so a `Connection` of thousands
/// of tokens beside thousands of headers (both fit a 64 KiB head) costs a search per header
/// instead of millions of comparisons.
pub struct ConnectionNamed<'a> {
    tokens: Vec<&'a [u8]>,
    sorted: Vec<Vec<u8>>,
}

impl<'a> ConnectionNamed<'a> {
    pub fn of(values: http::header::GetAll<'a, HeaderValue>) -> Self {
        let tokens = connection_tokens(values);
        let mut sorted = Vec::new();
        if tokens.len() > FEW_TOKENS {
            sorted = tokens.iter().map(|t| t.to_ascii_lowercase()).collect();
            sorted.sort_unstable();
            sorted.dedup();
        }
        ConnectionNamed { tokens, sorted }
    }

    /// Whether `name` is listed (ASCII case-insensitive).
    pub fn names(&self, name: &[u8]) -> bool {
        if self.tokens.len() <= FEW_TOKENS {
            return self.tokens.iter().any(|t| t.eq_ignore_ascii_case(name));
        }
        self.sorted
            .binary_search_by(|t| {
                t.iter()
                    .copied()
                    .cmp(name.iter().map(u8::to_ascii_lowercase))
            })
            .is_ok()
    }
}

/// Decimal digits of `n`, written into `out`.
pub fn itoa(mut n: u64, out: &mut [u8; 20]) -> &[u8] {
    let mut i = out.len();
    loop {
        i -= 1;
        out[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &out[i..]
}

/// Sends `head` and `body` (one `writev`) on a pooled connection (when `pooled`), or a new one.
/// `started` is when the request started (a recent instant; the pool's idle times are measured
/// from it). A pooled connection the backend closed is left in the pool unused when its close
/// has arrived (it is readable); one whose close arrives later fails on its first write, before
/// any byte of the request went out (sent again once on a new connection), or, once the
/// request went out, on the read (the caller decides whether the request may go again).
/// A request sent again because a pooled connection closed under it after the write goes
/// without `pooled`: the next pooled connection may be just as stale.
///
/// A write that fails after some of the request went out is not an error here: the backend has
/// part of the request (it may have answered early, say a 413, or acted on the head alone), so
/// the exchange is returned to read whatever answer came back, and a missing answer is an
/// unknown outcome, never "not sent". [`UpstreamError::Write`] means nothing went out.
pub async fn send(
    backend: &Backend,
    head: &[u8],
    body: &[u8],
    started: Instant,
    pooled: bool,
) -> Result<Exchange, UpstreamError> {
    if let Some(mut stream) = pooled.then(|| take_idle(backend, started)).flatten() {
        match write_request(backend, &mut stream, head, body).await {
            Written {
                sent: 0,
                result: Err(e),
                ..
            } => {
                tracing::debug!(error = %e, "pooled backend connection was closed; reconnecting")
            }
            written => return Exchange::after_write(backend, stream, true, started, written),
        }
    }
    let mut stream = connect(backend).await?;
    let written = write_request(backend, &mut stream, head, body).await;
    Exchange::after_write(backend, stream, false, started, written)
}

/// Writes `head` and `body` within the backend's write timeout. Returns how many bytes went
/// out, of how many, and why it stopped short, if it did.
async fn write_request(
    backend: &Backend,
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
) -> Written {
    let total = head.len() + body.len();
    let mut sent = 0;
    let write = async {
        while sent < total {
            let n = if sent < head.len() {
                let slices = [io::IoSlice::new(&head[sent..]), io::IoSlice::new(body)];
                stream.write_vectored(&slices).await?
            } else {
                stream.write(&body[sent - head.len()..]).await?
            };
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            sent += n;
        }
        Ok(())
    };
    let written = within(backend.write_timeout, write)
        .await
        .unwrap_or_else(|_| Err(timed_out("write")));
    Written {
        sent,
        total,
        result: written,
    }
}

/// How a request write ended: `sent` of `total` bytes went out.
struct Written {
    sent: usize,
    total: usize,
    result: io::Result<()>,
}

// === response ===

/// How the response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body, or all of it has been read.
    Done,
    /// This many bytes are still to come.
    Length(u64),
    /// Chunked: the state of the decoder.
    Chunked(ChunkState),
    /// Until the backend closes the connection.
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data: bytes left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one; bytes seen so far.
    Trailers(usize),
}

/// A request on the wire and its response being read.
pub struct Exchange {
    stream: TcpStream,
    buf: BytesMut,
    framing: Framing,
    /// The connection may carry another request once the response is read whole.
    keep_alive: bool,
    /// How long the backend keeps it open idle, as its `Keep-Alive: timeout` said.
    advertised_idle: Option<Duration>,
    /// The connection came from the pool.
    reused: bool,
    /// Bytes of response received so far (head included).
    received: usize,
    /// The request did not go out whole: the connection can never carry another one.
    request_cut: bool,
    backend: Backend,
    started: Instant,
}

impl Exchange {
    fn new(
        backend: &Backend,
        stream: TcpStream,
        reused: bool,
        started: Instant,
        request_cut: bool,
    ) -> Self {
        Exchange {
            started,
            request_cut,
            stream,
            buf: BytesMut::new(),
            framing: Framing::Close,
            keep_alive: false,
            advertised_idle: None,
            reused,
            received: 0,
            backend: backend.clone(),
        }
    }

    /// The exchange of a request written (wholly or in part, see [`send`]) on `stream`, or
    /// [`UpstreamError::Write`] if not one byte of it went out.
    fn after_write(
        backend: &Backend,
        stream: TcpStream,
        reused: bool,
        started: Instant,
        written: Written,
    ) -> Result<Exchange, UpstreamError> {
        let Written {
            sent,
            total,
            result,
        } = written;
        match result {
            Ok(()) => Ok(Exchange::new(backend, stream, reused, started, false)),
            Err(e) if sent == 0 => Err(UpstreamError::Write(e)),
            Err(error) => {
                tracing::warn!(
                    backend = %backend.addr,
                    sent,
                    request_bytes = total,
                    %error,
                    "request cut off after part of it went out; reading what the backend answered"
                );
                Ok(Exchange::new(backend, stream, reused, started, true))
            }
        }
    }

    /// The request went out on a pooled connection.
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// No byte of the response has arrived.
    pub fn nothing_received(&self) -> bool {
        self.received == 0
    }

    /// Reads more of the response into the buffer. `Ok(false)` at end of stream.
    async fn fill(&mut self) -> Result<bool, UpstreamError> {
        self.buf.reserve(READ_BYTES);
        let read = within(
            self.backend.read_timeout,
            self.stream.read_buf(&mut self.buf),
        )
        .await
        .unwrap_or_else(|_| Err(timed_out("read")))
        .map_err(UpstreamError::Read)?;
        self.received += read;
        Ok(read > 0)
    }

    /// Reads the final response head, skipping informational (1xx) ones. `head_request`: the
    /// request was HEAD, so the response has no body whatever its headers say. A `101` is refused:
    /// this client never forwards `Upgrade`.
    /// Status and headers come back with hop-by-hop headers removed, and `Content-Length`
    /// removed when the body is chunked (the client gets one framing).
    pub async fn read_head(&mut self, head_request: bool) -> Result<ResponseHeader, UpstreamError> {
        for _ in 0..=MAX_INFORMATIONAL {
            // After a parse that found the head incomplete, the buffer up to here is known to
            // hold no end of head: it is parsed again only once new bytes may end it, so a
            // backend that sends its head a byte at a time costs a scan of each byte, not a
            // parse of the whole head per byte.
            let mut scanned: Option<usize> = None;
            let parsed = loop {
                if scanned.is_none_or(|from| head_may_end(&self.buf, from)) {
                    if let Some(parsed) = parse_head(&mut self.buf)? {
                        break parsed;
                    }
                }
                scanned = Some(self.buf.len());
                if self.buf.len() > MAX_RESPONSE_HEAD_BYTES {
                    // Past a final status line, the request is known to have run.
                    let mut no_fields = [];
                    let mut status_line = httparse::Response::new(&mut no_fields);
                    let _ = status_line.parse(&self.buf);
                    return Err(refusal(
                        final_status(&status_line),
                        "response head too large",
                    ));
                }
                if !self.fill().await? {
                    return Err(UpstreamError::Closed(if self.received == 0 {
                        "before the response"
                    } else {
                        "inside the response head"
                    }));
                }
            };
            let status = parsed.header.status.as_u16();
            if status < 200 {
                continue;
            }
            self.keep_alive = parsed.keep_alive && !self.request_cut;
            self.advertised_idle = parsed.advertised_idle;
            self.framing = if head_request || status == 204 || status == 304 {
                // A 204 that declares a body breaks its own rule (a HEAD's or a 304's length
                // is the body a GET would have had, and correct): one that sends the body
                // anyway, after this read, would hand it to the next request on a reused
                // connection as its "answer", so it is not reused.
                if status == 204 && parsed.declares_body {
                    self.keep_alive = false;
                }
                Framing::Done
            } else {
                parsed.framing
            };
            if self.framing == Framing::Close {
                self.keep_alive = false;
            }
            return Ok(parsed.header);
        }
        Err(UpstreamError::Malformed(
            "too many informational (1xx) responses",
        ))
    }

    /// Bytes of response body still to come, when the backend declared its length
    /// (`Content-Length`, already checked by [`Exchange::read_head`]); `None` for chunked or
    /// read-until-close bodies.
    pub fn body_left(&self) -> Option<u64> {
        match self.framing {
            Framing::Done => Some(0),
            Framing::Length(left) => Some(left),
            Framing::Chunked(_) | Framing::Close => None,
        }
    }

    /// The response body has been read to its end.
    pub fn done(&self) -> bool {
        self.framing == Framing::Done
    }

    /// The next piece of the response body, `None` at its end.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        loop {
            match self.framing {
                Framing::Done => return Ok(None),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(left) => {
                    if self.buf.is_empty() && !self.fill().await? {
                        return Err(UpstreamError::Closed("inside the response body"));
                    }
                    let take = (self.buf.len() as u64).min(left) as usize;
                    self.framing = Framing::Length(left - take as u64);
                    if self.framing == Framing::Length(0) {
                        self.framing = Framing::Done;
                    }
                    return Ok(Some(self.buf.split_to(take).freeze()));
                }
                Framing::Close => {
                    if self.buf.is_empty() && !self.fill().await? {
                        self.framing = Framing::Done;
                        return Ok(None);
                    }
                    return Ok(Some(self.buf.split().freeze()));
                }
                Framing::Chunked(state) => {
                    let (state, data) = decode_chunked(state, &mut self.buf)?;
                    self.framing = match state {
                        None => Framing::Done,
                        Some(s) => Framing::Chunked(s),
                    };
                    if let Some(data) = data {
                        return Ok(Some(data));
                    }
                    if self.framing == Framing::Done {
                        return Ok(None);
                    }
                    if !self.fill().await? {
                        return Err(UpstreamError::Closed("inside the chunked response body"));
                    }
                }
            }
        }
    }

    /// Puts the connection back in the pool when the response was read whole and the backend
    /// keeps it open; otherwise closes it.
    pub fn finish(self) {
        if self.done() && self.keep_alive && self.buf.is_empty() {
            put_idle(
                &self.backend,
                self.stream,
                self.started,
                self.advertised_idle,
            );
        }
    }
}

struct ParsedHead {
    header: ResponseHeader,
    framing: Framing,
    keep_alive: bool,
    /// `Keep-Alive: timeout=<seconds>`: how long the backend keeps an idle connection open.
    advertised_idle: Option<Duration>,
    /// A `Transfer-Encoding`, or a `Content-Length` above zero.
    declares_body: bool,
}

/// The final status (200 or above) of a response whose status line parsed whole, however its
/// fields fared. httparse sets the code as soon as it has read three digits, and the reason
/// only once the line has ended well: `HTTP/1.1 2000` has a code but no status.
fn final_status(resp: &httparse::Response<'_, '_>) -> Option<u16> {
    resp.reason
        .and(resp.code)
        .filter(|c| (200..=599).contains(c))
}

/// A head refused for `what`: [`UpstreamError::Invalid`] once a final status came (the request
/// ran), [`UpstreamError::Malformed`] before.
fn refusal(final_status: Option<u16>, what: &'static str) -> UpstreamError {
    match final_status {
        Some(status) => UpstreamError::Invalid { status, what },
        None => UpstreamError::Malformed(what),
    }
}

/// Parses a response head at the start of `buf` and removes it, or `None` if incomplete.
fn parse_head(buf: &mut BytesMut) -> Result<Option<ParsedHead>, UpstreamError> {
    let mut slots = [httparse::EMPTY_HEADER; 64];
    let mut many;
    let mut resp = httparse::Response::new(&mut slots);
    let mut status = resp.parse(buf);
    if matches!(status, Err(httparse::Error::TooManyHeaders)) {
        many = vec![httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
        resp = httparse::Response::new(&mut many);
        status = resp.parse(buf);
    }
    // A fault past a final status line is an answer that cannot be relayed, not a lost one:
    // the status says the request ran (see [`UpstreamError::Invalid`]).
    let final_status = final_status(&resp);
    let refuse = |what| refusal(final_status, what);
    let head_len = match status {
        // A head that came whole in one read is held to the same bound as one still coming.
        Ok(httparse::Status::Complete(n)) if n > MAX_RESPONSE_HEAD_BYTES => {
            return Err(refuse("response head too large"))
        }
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(refuse("too many response headers")),
        Err(_) => return Err(refuse("unparsable response head")),
    };
    let code = resp.code.unwrap_or(0);
    // This client never forwards `Upgrade`.
    if let Some(why) = unrelayable_status(code, false) {
        return Err(UpstreamError::Malformed(why));
    }
    let version = resp.version.unwrap_or(1);
    let reason = resp.reason.unwrap_or("");
    // Offsets into the head, so names and values can share one buffer once it is frozen.
    let base = buf.as_ptr() as usize;
    let fields: Vec<(usize, usize, usize, usize)> = resp
        .headers
        .iter()
        .map(|h| {
            let n = h.name.as_ptr() as usize - base;
            let v = h.value.as_ptr() as usize - base;
            (n, h.name.len(), v, h.value.len())
        })
        .collect();
    let canonical_reason = http::StatusCode::from_u16(code)
        .ok()
        .and_then(|s| s.canonical_reason())
        .is_some_and(|r| r == reason);
    let custom_reason = (!canonical_reason && !reason.is_empty()).then(|| reason.to_owned());

    let head = buf.split_to(head_len).freeze();
    let mut header = ResponseHeader::build(code, Some(fields.len()))
        .map_err(|_| UpstreamError::Malformed("invalid status code"))?;
    if let Some(reason) = custom_reason {
        // A reason phrase the backend chose is passed on, like the rest of its answer.
        let _ = header.set_reason_phrase(Some(&reason));
    }
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut transfer_encoding = false;
    // A `Transfer-Encoding` line that lists no coding (`Transfer-Encoding: `, `,`).
    let mut empty_coding_line = false;
    // `close` anywhere wins over `keep-alive` anywhere, in any order, on any line; an HTTP/1.0
    // answer is closed unless it asks to stay open.
    let (mut saw_close, mut saw_keep_alive) = (false, false);
    let mut connection_named: Vec<Bytes> = Vec::new();
    let mut advertised_idle: Option<Duration> = None;
    // Whether `Content-Length` came as one plain number: `5, 5`, two lines of it or `05` agree
    // with themselves but strict clients refuse them, so the client gets the one length instead.
    let (mut length_lines, mut length_plain) = (0, true);
    for &(n, nl, v, vl) in &fields {
        let name = &head[n..n + nl];
        let value = &head[v..v + vl];
        if name.eq_ignore_ascii_case(b"content-length") {
            length_lines += 1;
            length_plain &=
                !value.contains(&b',') && (value.len() == 1 || value.first() != Some(&b'0'));
            for part in value.split(|&b| b == b',') {
                let part = part.trim_ascii();
                let parsed = std::str::from_utf8(part)
                    .ok()
                    .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|s| s.parse::<u64>().ok())
                    .ok_or(refuse("invalid Content-Length"))?;
                if length.is_some_and(|l| l != parsed) {
                    return Err(refuse("conflicting Content-Length values"));
                }
                length = Some(parsed);
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // Only the last coding of the list the lines make together decides whether the
            // body is chunked. A line listing nothing (an empty value) changes nothing: on its
            // own it is no transfer coding, and `Content-Length` frames the body (read as one,
            // it would have the body end only at a close, and a complete answer wait out
            // `read_timeout`).
            match codings(value).last() {
                Some(last) => {
                    transfer_encoding = true;
                    chunked = last.eq_ignore_ascii_case(b"chunked");
                }
                None => empty_coding_line = true,
            }
        } else if name.eq_ignore_ascii_case(b"keep-alive") {
            // The shortest, if it says more than one.
            if let Some(t) = keep_alive_timeout(value) {
                advertised_idle = Some(advertised_idle.map_or(t, |a| a.min(t)));
            }
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in value.split(|&b| b == b',').map(|t| t.trim_ascii()) {
                if token.eq_ignore_ascii_case(b"close") {
                    saw_close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    saw_keep_alive = true;
                } else if !token.is_empty() {
                    connection_named.push(head.slice_ref(token));
                }
            }
        }
    }
    // The client gets one length, as parsed, in place of lines that are not one plain number.
    let relength = !transfer_encoding && (length_lines > 1 || !length_plain);
    for &(n, nl, v, vl) in &fields {
        let name = &head[n..n + nl];
        let hop = RESPONSE_HOP_BY_HOP
            .iter()
            .any(|h| name.eq_ignore_ascii_case(h.as_bytes()))
            || connection_named
                .iter()
                .any(|c| name.eq_ignore_ascii_case(c))
            || ((transfer_encoding || relength) && name.eq_ignore_ascii_case(b"content-length"));
        if hop {
            continue;
        }
        let raw = head.slice(v..v + vl);
        // The codings without empty list items (`chunked,` is `chunked`): the downstream writer
        // frames the body by this header's last item, and an empty one would send the decoded
        // body unchunked under a `Transfer-Encoding` that says otherwise. Rebuilt only when it
        // has one; a plain `chunked` is passed on as read.
        let raw = if name.eq_ignore_ascii_case(b"transfer-encoding")
            && raw.split(|&b| b == b',').any(|c| c.trim_ascii().is_empty())
        {
            let listed = codings(&raw).collect::<Vec<_>>();
            if listed.is_empty() {
                // A line that lists nothing is not passed on: the writer would read it as last.
                continue;
            }
            Bytes::from(listed.join(&b", "[..]))
        } else {
            raw
        };
        let value =
            HeaderValue::from_maybe_shared(raw).map_err(|_| refuse("invalid header value"))?;
        header
            .append_header(head.slice(n..n + nl), value)
            .map_err(|_| refuse("invalid header name"))?;
    }
    if let Some(len) = length.filter(|_| relength) {
        header
            .append_header(http::header::CONTENT_LENGTH, HeaderValue::from(len))
            .map_err(|_| refuse("invalid header name"))?;
    }
    let framing = if transfer_encoding {
        if chunked {
            Framing::Chunked(ChunkState::Size)
        } else {
            Framing::Close
        }
    } else {
        match length {
            Some(0) => Framing::Done,
            Some(n) => Framing::Length(n),
            None => Framing::Close,
        }
    };
    let close = saw_close || (version == 0 && !saw_keep_alive);
    // A body both chunked and length-framed was framed two ways, and an HTTP/1.0 answer has no
    // transfer codings (RFC 9112 §6.1): either way, do not trust the connection after it. Nor
    // after an empty `Transfer-Encoding` line, which another reader may frame otherwise.
    let keep_alive =
        !(close || empty_coding_line || transfer_encoding && (length.is_some() || version == 0));
    Ok(Some(ParsedHead {
        advertised_idle,
        declares_body: transfer_encoding || length.is_some_and(|l| l > 0),
        header,
        framing,
        keep_alive,
    }))
}

/// The `timeout` of a `Keep-Alive` value (`timeout=5, max=100`), in seconds: how long the
/// backend keeps an idle connection open. A value may be a token or a quoted string (RFC 9110
/// §5.6.6); the shortest, if it names more than one.
fn keep_alive_timeout(value: &[u8]) -> Option<Duration> {
    value
        .split(|&b| b == b',')
        .filter_map(|param| {
            let eq = param.iter().position(|&b| b == b'=')?;
            if !param[..eq].trim_ascii().eq_ignore_ascii_case(b"timeout") {
                return None;
            }
            let secs = param[eq + 1..].trim_ascii();
            let secs = secs
                .strip_prefix(b"\"")
                .and_then(|s| s.strip_suffix(b"\""))
                .unwrap_or(secs);
            std::str::from_utf8(secs).ok()?.parse().ok()
        })
        .min()
        .map(Duration::from_secs)
}

/// Whether the bytes of `buf` from `from` on (with the two before, so an end split across
/// reads is found) may end a response head: an empty line, `\n\r\n` or a bare `\n\n`.
fn head_may_end(buf: &[u8], from: usize) -> bool {
    let tail = &buf[from.saturating_sub(2).min(buf.len())..];
    tail.windows(2).enumerate().any(|(i, w)| {
        w[0] == b'\n' && (w[1] == b'\n' || (w[1] == b'\r' && tail.get(i + 2) == Some(&b'\n')))
    })
}

/// The codings a `Transfer-Encoding` value lists, without empty list items (RFC 9110 §5.6.1).
pub fn codings(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(|c| c.trim_ascii())
        .filter(|c| !c.is_empty())
}

/// A transfer coding a message's body still carries once one chunked framing is read: its
/// first coding other than chunked (`gzip, chunked` leaves gzip), else chunked when it is
/// listed more than once (`chunked, chunked`: chunked applied twice, which RFC 9112 §6.1
/// forbids, though readers that look only at the last coding take it, and one layer is left).
/// `None` for a body that is plain once its chunks are read (or that has no coding).
pub fn coding_left_after_chunked(headers: &http::HeaderMap) -> Option<&[u8]> {
    let mut chunked = 0;
    let all = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| codings(v.as_bytes()));
    for coding in all {
        if !coding.eq_ignore_ascii_case(b"chunked") {
            return Some(coding);
        }
        chunked += 1;
    }
    (chunked > 1).then_some(&b"chunked"[..])
}

/// Decodes as much of a chunked body as `buf` holds. Returns the next state (`None` when the
/// body, trailers included, is complete) and the data decoded, if any.
fn decode_chunked(
    mut state: ChunkState,
    buf: &mut BytesMut,
) -> Result<(Option<ChunkState>, Option<Bytes>), UpstreamError> {
    let mut out: Option<BytesMut> = None;
    let mut single: Option<Bytes> = None;
    let mut push = |data: Bytes| match (&mut out, single.take()) {
        (Some(o), _) => o.extend_from_slice(&data),
        (None, None) => single = Some(data),
        (None, Some(first)) => {
            let mut o = BytesMut::with_capacity(first.len() + data.len());
            o.extend_from_slice(&first);
            o.extend_from_slice(&data);
            out = Some(o);
        }
    };
    loop {
        match state {
            ChunkState::Size => {
                let Some(end) = buf.iter().position(|&b| b == b'\n') else {
                    if buf.len() > MAX_CHUNK_LINE_BYTES {
                        return Err(UpstreamError::Malformed("chunk size line too long"));
                    }
                    break;
                };
                if end > MAX_CHUNK_LINE_BYTES {
                    return Err(UpstreamError::Malformed("chunk size line too long"));
                }
                let line = buf.split_to(end + 1);
                let line = line
                    .strip_suffix(b"\r\n")
                    .ok_or(UpstreamError::Malformed("chunk size line without CRLF"))?;
                // chunk-size [ chunk-ext ]: extensions (after `;`) are ignored.
                let size = line.split(|&b| b == b';').next().unwrap_or(&[]);
                // Only spaces and tabs may stand before the line's end (RFC 9112 §7.1.1, BWS).
                let size = crate::key::trim_ows_end(size);
                if size.is_empty() || size.len() > 16 || !size.iter().all(u8::is_ascii_hexdigit) {
                    return Err(UpstreamError::Malformed("invalid chunk size"));
                }
                let size = size.iter().fold(0u64, |n, &d| {
                    (n << 4) | (d as char).to_digit(16).unwrap_or(0) as u64
                });
                state = if size == 0 {
                    ChunkState::Trailers(0)
                } else {
                    ChunkState::Data(size)
                };
            }
            ChunkState::Data(left) => {
                if buf.is_empty() {
                    break;
                }
                let take = (buf.len() as u64).min(left) as usize;
                push(buf.split_to(take).freeze());
                state = if take as u64 == left {
                    ChunkState::DataEnd
                } else {
                    ChunkState::Data(left - take as u64)
                };
            }
            ChunkState::DataEnd => {
                if buf.len() < 2 {
                    break;
                }
                if &buf[..2] != b"\r\n" {
                    return Err(UpstreamError::Malformed("chunk data without CRLF"));
                }
                buf.advance(2);
                state = ChunkState::Size;
            }
            ChunkState::Trailers(seen) => {
                let Some(end) = buf.iter().position(|&b| b == b'\n') else {
                    if seen + buf.len() > MAX_TRAILER_BYTES {
                        return Err(UpstreamError::Malformed("trailers too large"));
                    }
                    break;
                };
                if seen + end > MAX_TRAILER_BYTES {
                    return Err(UpstreamError::Malformed("trailers too large"));
                }
                let line = buf.split_to(end + 1);
                if line.as_ref() == b"\r\n" {
                    let data = out.map(BytesMut::freeze).or(single);
                    return Ok((None, data));
                }
                if !line.ends_with(b"\r\n") {
                    return Err(UpstreamError::Malformed("trailer line without CRLF"));
                }
                // Trailer fields are consumed, not forwarded or stored.
                state = ChunkState::Trailers(seen + end + 1);
            }
        }
    }
    Ok((Some(state), out.map(BytesMut::freeze).or(single)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes (or a close) the kernel holds are seen at once, before tokio's driver has polled
    /// the socket: its readiness state alone says the socket is idle.
    #[tokio::test(flavor = "current_thread")]
    async fn a_pooled_connection_with_bytes_or_a_close_waiting_is_not_reused() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let connect = || {
            let ours = std::net::TcpStream::connect(addr).unwrap();
            ours.set_nonblocking(true).unwrap();
            let theirs = listener.accept().unwrap().0;
            (TcpStream::from_std(ours).unwrap(), theirs)
        };
        let (idle, _peer) = connect();
        assert!(still_open(&idle), "nothing to read: usable");
        // A pause that does not turn tokio's driver (which would teach its readiness state):
        // loopback may hand delivery to a kernel thread on a loaded machine.
        let delivered = || std::thread::sleep(Duration::from_millis(20));
        let (stray, mut peer) = connect();
        peer.write_all(b"HTTP/1.1 200 OK\r\n").unwrap();
        delivered();
        assert!(!still_open(&stray), "stray bytes waiting");
        assert!(!still_open(&stray), "asking reads nothing away");
        let (closed, peer) = connect();
        drop(peer);
        delivered();
        assert!(!still_open(&closed), "closed by the backend");
    }

    /// One integer socket option of `stream`.
    #[cfg(target_os = "linux")]
    fn sockopt(stream: &TcpStream, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        use std::os::fd::AsRawFd;
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid fd and a buffer of the length given.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                level,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockopt {name}");
        value
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn backend_connections_probe_for_a_vanished_host() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend = Backend {
            addr: listener.local_addr().unwrap(),
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_secs(60),
        };
        let stream = connect(&backend).await.unwrap();
        assert_eq!(sockopt(&stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(sockopt(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 5);
        assert_eq!(sockopt(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 2);
        assert_eq!(sockopt(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
        assert_eq!(
            sockopt(&stream, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
            10_000
        );
    }

    #[tokio::test]
    async fn within_answers_ready_futures_and_bounds_pending_ones() {
        assert_eq!(
            within(Duration::from_millis(10), async { 7 }).await.ok(),
            Some(7)
        );
        let never = within(Duration::from_millis(20), std::future::pending::<()>());
        assert!(never.await.is_err(), "a pending future is bounded");
        let later = async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            8
        };
        assert_eq!(within(Duration::from_secs(5), later).await.ok(), Some(8));
    }

    fn parse(raw: &[u8]) -> Result<Option<ParsedHead>, UpstreamError> {
        let mut buf = BytesMut::from(raw);
        parse_head(&mut buf)
    }

    fn decode_all(raw: &[u8], piece: usize) -> Result<(Vec<u8>, bool), UpstreamError> {
        let mut state = ChunkState::Size;
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        for part in raw.chunks(piece.max(1)) {
            buf.extend_from_slice(part);
            let (next, data) = decode_chunked(state, &mut buf)?;
            if let Some(d) = data {
                body.extend_from_slice(&d);
            }
            match next {
                Some(s) => state = s,
                None => return Ok((body, true)),
            }
        }
        Ok((body, false))
    }

    #[test]
    fn a_head_is_parsed_with_its_framing_and_keeps_the_backends_spelling() {
        let p = parse(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nX-Custom-ID: 7\r\nContent-Length: 2\r\n\r\n{}")
            .unwrap()
            .unwrap();
        assert_eq!(p.header.status.as_u16(), 201);
        assert_eq!(p.framing, Framing::Length(2));
        assert!(p.keep_alive);
        let mut wire = Vec::new();
        p.header.header_to_h1_wire(&mut wire);
        let wire = String::from_utf8(wire).unwrap();
        assert!(wire.contains("X-Custom-ID: 7\r\n"), "{wire}");
        assert!(wire.contains("Content-Length: 2\r\n"), "{wire}");
    }

    #[test]
    fn the_end_of_a_head_is_found_across_reads() {
        let head = b"HTTP/1.1 200 OK\r\nA: b\r\n\r\n";
        // Every split point: the bytes before it were scanned, the rest arrived since.
        for split in 0..head.len() {
            assert!(head_may_end(head, split), "split at {split}");
        }
        assert!(!head_may_end(b"HTTP/1.1 200 OK\r\nA: b\r\n", 0));
        assert!(!head_may_end(b"HTTP/1.1 200 OK\r\nA: b\r\n\r", 0));
        assert!(head_may_end(b"HTTP/1.1 200 OK\nA: b\n\n", 10));
        assert!(!head_may_end(b"", 0));
        assert!(!head_may_end(b"\n", 5));
    }

    #[test]
    fn an_incomplete_head_asks_for_more() {
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Le").unwrap().is_none());
    }

    #[test]
    fn a_chunk_size_line_allows_only_blanks_before_its_end() {
        assert_eq!(
            decode_all(b"5 \t\r\nhello\r\n0\r\n\r\n", 64).unwrap().0,
            b"hello"
        );
        for line in [&b"5\r\r\n"[..], b"5\x0c\r\n", b"5\x0b\r\n"] {
            let mut raw = line.to_vec();
            raw.extend_from_slice(b"hello\r\n0\r\n\r\n");
            assert!(
                matches!(decode_all(&raw, 64), Err(UpstreamError::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn reserved_request_headers_are_known_in_either_spelling() {
        for name in [
            "X-Idempotency-Id",
            "x_idempotency_id",
            "Content_Length",
            "TRANSFER_ENCODING",
        ] {
            assert!(is_reserved(name.as_bytes()), "{name}");
        }
        for name in ["X-Request-Id", "x_request_id", "content-lengths", "content"] {
            assert!(!is_reserved(name.as_bytes()), "{name}");
        }
    }

    #[test]
    fn chunked_wins_over_content_length_and_the_connection_is_not_reused() {
        let p =
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(p.framing, Framing::Chunked(ChunkState::Size));
        assert!(!p.keep_alive);
        assert!(p.header.headers.get("content-length").is_none());
    }

    #[test]
    fn a_transfer_coding_other_than_chunked_last_is_read_to_close() {
        let p = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(p.framing, Framing::Close);
    }

    #[test]
    fn conflicting_lengths_are_refused_and_repeated_equal_ones_accepted() {
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"),
            Err(UpstreamError::Invalid { status: 200, .. })
        ));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n"),
            Err(UpstreamError::Invalid { status: 200, .. })
        ));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n"),
            Err(UpstreamError::Invalid { status: 200, .. })
        ));
        let p = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(p.framing, Framing::Length(5));
    }

    #[test]
    fn connection_close_http_1_0_and_no_length_end_keep_alive() {
        let close = parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!close.keep_alive);
        assert!(close.header.headers.get("connection").is_none());
        let old = parse(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!old.keep_alive);
        let old_kept =
            parse(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(old_kept.keep_alive);
        let open_ended = parse(b"HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!(open_ended.framing, Framing::Close);
    }

    #[test]
    fn close_wins_over_keep_alive_in_any_order_and_on_any_line() {
        for head in [
            &b"HTTP/1.0 200 OK\r\nConnection: close, keep-alive\r\nContent-Length: 2\r\n\r\n"[..],
            b"HTTP/1.0 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nConnection: close\r\nContent-Length: 2\r\n\r\n",
        ] {
            let p = parse(head).unwrap().unwrap();
            assert!(!p.keep_alive, "{}", String::from_utf8_lossy(head));
        }
    }

    #[test]
    fn the_codings_of_all_transfer_encoding_lines_make_one_list() {
        // An empty line lists nothing: `chunked` stays the last coding.
        let p =
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding:\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(p.framing, Framing::Chunked(ChunkState::Size));
        let te: Vec<_> = p
            .header
            .headers
            .get_all("transfer-encoding")
            .iter()
            .collect();
        assert_eq!(te, ["chunked"], "the empty line is not passed on");
        let p = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.framing, Framing::Chunked(ChunkState::Size));
        let p = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.framing, Framing::Close);
    }

    #[test]
    fn an_http_1_0_answer_with_a_transfer_coding_closes_its_connection() {
        let p = parse(
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert!(!p.keep_alive);
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_dropped() {
        let p = parse(b"HTTP/1.1 200 OK\r\nConnection: X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTrailer: X-T\r\nUpgrade: h2c\r\nX-Kept: 2\r\nContent-Length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        let names: Vec<&str> = p.header.headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-kept", "content-length"]);
    }

    #[test]
    fn a_custom_reason_phrase_is_kept() {
        let p = parse(b"HTTP/1.1 200 Fine Thanks\r\nContent-Length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(p.header.get_reason_phrase(), Some("Fine Thanks"));
        let p = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(p.header.get_reason_phrase(), Some("OK"));
    }

    #[test]
    fn garbage_and_too_many_headers_are_malformed() {
        assert!(matches!(
            parse(b"SSH-2.0-OpenSSH\r\n\r\n"),
            Err(UpstreamError::Malformed(_))
        ));
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..300 {
            many.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        // Past a final status line, a fault leaves the status known.
        assert!(matches!(
            parse(&many),
            Err(UpstreamError::Invalid { status: 200, .. })
        ));
        many.splice(9..12, *b"102");
        assert!(matches!(parse(&many), Err(UpstreamError::Malformed(_))));
        assert!(matches!(
            parse(b"HTTP/1.1 201 Created\r\nX-Bad\x01: v\r\n\r\n"),
            Err(UpstreamError::Invalid { status: 201, .. })
        ));
        // A status line that does not end well has no status, whatever digits it began with.
        for line in [&b"HTTP/1.1 2000\r\n\r\n"[..], b"HTTP/1.1 200OK\r\n\r\n"] {
            assert!(
                matches!(parse(line), Err(UpstreamError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
        let mut fine = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..100 {
            fine.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
        }
        fine.extend_from_slice(b"\r\n");
        assert_eq!(parse(&fine).unwrap().unwrap().header.headers.len(), 100);
    }

    #[test]
    fn chunked_bodies_decode_whatever_the_read_boundaries() {
        let raw = b"5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nX-Trailer: t\r\n\r\n";
        for piece in 1..raw.len() + 1 {
            let (body, complete) = decode_all(raw, piece).unwrap();
            assert_eq!(body, b"hello world!", "piece {piece}");
            assert!(complete, "piece {piece}");
        }
    }

    #[test]
    fn broken_chunked_bodies_are_malformed() {
        for raw in [
            &b"zz\r\nhello\r\n0\r\n\r\n"[..],
            b"5\r\nhelloXX0\r\n\r\n",
            b"\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"11111111111111111\r\n",
        ] {
            assert!(
                matches!(decode_all(raw, raw.len()), Err(UpstreamError::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
        let long = vec![b'1'; MAX_CHUNK_LINE_BYTES + 10];
        assert!(decode_all(&long, long.len()).is_err());
    }

    #[test]
    fn the_request_head_drops_hop_by_hop_and_framing_and_adds_length_and_extras() {
        let mut req = RequestHeader::build("POST", b"/orders?x=1", None).unwrap();
        req.append_header("Host", "shop").unwrap();
        req.append_header("Connection", "keep-alive, X-Secret")
            .unwrap();
        req.append_header("X-Secret", "s").unwrap();
        req.append_header("Transfer-Encoding", "chunked").unwrap();
        req.append_header("Expect", "100-continue").unwrap();
        req.append_header("Content-Length", "99").unwrap();
        req.append_header("X-Request-ID", "r1").unwrap();
        let mut buf = Vec::new();
        request_head(&req, Some(2), &[("x-idempotency-id", b"42")], &[], &mut buf);
        assert_eq!(
            String::from_utf8(buf).unwrap(),
            "POST /orders?x=1 HTTP/1.1\r\nHost: shop\r\nX-Request-ID: r1\r\nContent-Length: 2\r\nx-idempotency-id: 42\r\n\r\n"
        );
    }

    #[test]
    fn the_coding_left_once_the_chunks_are_read_is_named() {
        let left = |values: &[&'static str]| {
            let mut h = http::HeaderMap::new();
            for v in values {
                h.append("transfer-encoding", HeaderValue::from_static(v));
            }
            coding_left_after_chunked(&h).map(|c| String::from_utf8_lossy(c).into_owned())
        };
        assert_eq!(left(&[]), None);
        assert_eq!(left(&["chunked"]), None);
        assert_eq!(left(&["Chunked", ""]), None);
        assert_eq!(left(&["gzip, chunked"]).as_deref(), Some("gzip"));
        assert_eq!(left(&["chunked, gzip"]).as_deref(), Some("gzip"));
        assert_eq!(left(&["chunked, chunked"]).as_deref(), Some("chunked"));
        assert_eq!(left(&["chunked", "CHUNKED"]).as_deref(), Some("chunked"));
    }

    #[test]
    fn connection_named_headers_are_hop_by_hop() {
        let mut h = http::HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("x-a, X-B, close"));
        let names = connection_tokens(h.get_all("connection"));
        assert_eq!(names, [&b"x-a"[..], &b"X-B"[..]]);
        let named = ConnectionNamed::of(h.get_all("connection"));
        assert!(named.names(b"X-A") && named.names(b"x-b"));
        assert!(!named.names(b"close") && !named.names(b"x-c"));
        // Many tokens: looked up in the sorted copy, alike.
        let many: Vec<String> = (0..40).map(|i| format!("X-Tok-{i}")).collect();
        h.insert(
            "connection",
            HeaderValue::from_str(&many.join(", ")).unwrap(),
        );
        h.append("connection", HeaderValue::from_static("x-tok-3, Upgrade"));
        let named = ConnectionNamed::of(h.get_all("connection"));
        assert!(named.sorted.len() == 41, "{}", named.sorted.len());
        for token in &many {
            assert!(named.names(token.as_bytes()), "{token}");
            assert!(
                named.names(token.to_ascii_lowercase().as_bytes()),
                "{token}"
            );
        }
        assert!(named.names(b"upgrade"));
        assert!(!named.names(b"x-tok-40") && !named.names(b"x-tok-") && !named.names(b""));
    }

    #[test]
    fn an_absolute_form_target_names_its_authority() {
        assert_eq!(
            target_authority(b"http://shop:8080/orders?x"),
            Some(&b"shop:8080"[..])
        );
        assert_eq!(target_authority(b"https://shop"), Some(&b"shop"[..]));
        assert_eq!(target_authority(b"http://shop?x=1"), Some(&b"shop"[..]));
        assert_eq!(target_authority(b"/orders"), None);
        assert_eq!(target_authority(b"http:///orders"), None);
    }

    #[test]
    fn itoa_writes_decimal() {
        for n in [0u64, 7, 10, 1234567890, u64::MAX] {
            assert_eq!(itoa(n, &mut [0; 20]), n.to_string().as_bytes());
        }
    }
}
