//! Limits on a client connection: a deadline for the whole request header
//! (`request_header_timeout`), a size (`max_request_header_bytes`), and a deadline on every write
//! that waits for the client to read (`response_send_timeout`).
//!
//! pingora times each read of a request header on its own (60 s on a new connection, the
//! keep-alive timeout on a reused one), so a client that trickles a header a byte at a time,
//! each byte just inside that timeout, holds its connection and task for as long as it likes: the
//! slow-header attack. And it buffers a header of up to 1 MiB, so every connection can make the
//! proxy hold a megabyte. nginx bounds both (`client_header_timeout`,
//! `large_client_header_buffers`); this module does the same for idemgate.
//!
//! [`Guarded`] wraps the proxy's pingora application (and the admin listener's) and every
//! accepted connection in a [`HeadGuard`] stream. The guard knows where a connection is between
//! requests from two marks the application makes: [`request_started`] once pingora has parsed a
//! header (the first thing `request_filter`, or the admin app's answer, does) and
//! [`request_ended`] when the request is logged (the admin app: once its answer is made). Between the end of
//! one request and the start of the next, the first bytes read begin a header and start its
//! clock; the idle wait before them is the keep-alive timeout's business, not this one's. A header
//! still incomplete when the clock runs out gets a 408 `request-header-timeout`, one that has
//! grown past the size limit a 431 `request-header-too-large` (best effort: the client may not be
//! reading), and the connection is closed.
//!
//! pingora refuses some headers itself, before the proxy sees them: one it cannot parse (400) and
//! `CONNECT` (405), each with a bare answer of its own. A write while a header is being read can
//! only be that answer, so the guard writes the problem+json (`request-malformed`,
//! `connect-not-supported`) in its place: every answer the proxy makes is problem+json.
//!
//! The size is held at the reads themselves: no read of a header goes past the limit, counting
//! what was read for it so far, and a header still incomplete once the limit is read is refused.
//! A header within the limit is never refused (it is a prefix of what was read, so it completes
//! within the limit), and no connection holds more than the limit of a header's bytes.
//!
//! Writes are held to `response_send_timeout` here too. pingora times only the writes of a
//! response body: the head, the last chunk of a chunked body and the flush that ends every
//! response wait for the client with no deadline. A small response sits in the stream's write
//! buffer until that flush, so a keep-alive client that sends request after request and reads
//! nothing parks its task in a flush for good once the kernel buffers are full; and after a
//! body write timed out, pingora still writes the last chunk. So every write, flush and close
//! that has to wait arms a stall timer, timed from when it began waiting (not pushed back
//! when it is polled again), and disarmed by any progress: bytes taken, a flush done. When it
//! fires the write fails with `TimedOut` and pingora drops the connection. Bytes taken into the
//! stream's write buffer count as progress, and bytes the buffer passes on while a write still
//! waits do not, so a client reading less than a buffer's worth (1460 bytes) per
//! `response_send_timeout` is cut off too.
//!
//! Costs on the hot path: a header that arrives in one read (nearly all of them) takes one clock
//! reading and no timer; a timer is armed only when a header needs a second read that has to
//! wait, or a write has to wait for the client.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::http::ServerSession as Session;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::Stream;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use pingora::server::ShutdownWatch;
use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::problem::Problem;
use crate::proxy::Generation;

/// Between requests: the next bytes read begin a header.
const BETWEEN: u8 = 0;
/// Reading a header whose first bytes arrived at `HeadGuard::deadline - timeout`.
const HEADER: u8 = 1;
/// The header was parsed (or the guard gave up): reads are the request body's or a drain's.
const REQUEST: u8 = 2;
/// pingora refused the header itself; the guard writes its problem+json answer instead and
/// swallows pingora's.
const ANSWERED: u8 = 3;

/// A downstream connection whose request headers must each arrive within a deadline.
pub struct HeadGuard {
    inner: Stream,
    /// Where the connection is: [`BETWEEN`], [`HEADER`], [`REQUEST`] or [`ANSWERED`]. Atomic
    /// only because the proxy's marks reach the guard through a shared reference; one task
    /// drives a connection.
    phase: AtomicU8,
    limits: Limits,
    /// Bytes read for the current header so far (meaningful in [`HEADER`]).
    read: usize,
    /// When the current header's time is up (meaningful in [`HEADER`]).
    deadline: Instant,
    /// Armed only when a header's second read has to wait.
    alarm: Option<Pin<Box<Sleep>>>,
    /// Times a write that waits for the client.
    stall: Stall,
    /// The guard's own answer to a refused header, and how much of it is out.
    answer: Vec<u8>,
    answer_sent: usize,
    refused: HeaderRefusals,
}

/// The counters of refused headers, by reason.
#[derive(Clone)]
pub struct HeaderRefusals {
    /// Headers cut off by `request_header_timeout`.
    pub timeout: IntCounter,
    /// Headers refused by `max_request_header_bytes`.
    pub too_large: IntCounter,
    /// Headers pingora could not parse.
    pub malformed: IntCounter,
}

impl HeaderRefusals {
    /// The counter of a refusal, if it counts as one (`CONNECT` is a request refused by
    /// policy, not a bad header).
    fn of(&self, problem: &Problem) -> Option<&IntCounter> {
        match problem {
            Problem::RequestHeaderTimeout => Some(&self.timeout),
            Problem::RequestHeaderTooLarge { .. } => Some(&self.too_large),
            Problem::RequestMalformed => Some(&self.malformed),
            _ => None,
        }
    }
}

impl HeadGuard {
    fn new(inner: Stream, limits: Limits, refused: HeaderRefusals) -> Self {
        HeadGuard {
            inner,
            phase: AtomicU8::new(BETWEEN),
            limits,
            read: 0,
            deadline: Instant::now(),
            alarm: None,
            stall: Stall::default(),
            answer: Vec::new(),
            answer_sent: 0,
            refused,
        }
    }

    /// A write while a header is being read: pingora is refusing a header it could not take (a
    /// malformed one, 400; `CONNECT`, 405) with a bare answer of its own. Answers with the
    /// problem+json instead, from here on swallowing what pingora writes. Returns false for any
    /// other write, which goes out as it is.
    fn take_over(&mut self, first: &[u8]) -> bool {
        let problem = match status_of(first) {
            Some(400) => Problem::RequestMalformed,
            Some(405) => Problem::ConnectNotSupported,
            _ => return false,
        };
        self.answer_with(&problem, ANSWERED);
        true
    }

    /// Counts `problem` and makes its problem+json the guard's answer, moving to `phase`.
    fn answer_with(&mut self, problem: &Problem, phase: u8) {
        if let Some(counter) = self.refused.of(problem) {
            counter.inc();
        }
        self.phase.store(phase, Ordering::Relaxed);
        self.alarm = None;
        self.answer = raw_answer(problem);
        self.answer_sent = 0;
        tracing::debug!(
            problem = problem.slug(),
            "request header refused; connection closed"
        );
    }

    /// Reads into `buf` at most `most` bytes. pingora offers a header buffer that doubles as it
    /// fills, so one read could otherwise bring as much again as was read before it, and a
    /// header over the limit could arrive whole. Only a read that could cross the limit (near
    /// it, or under a small limit) goes through a shorter buffer, which is zeroed first.
    fn read_at_most(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        most: usize,
    ) -> Poll<io::Result<()>> {
        if buf.remaining() <= most {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let mut short = ReadBuf::new(buf.initialize_unfilled_to(most));
        let read = Pin::new(&mut self.inner).poll_read(cx, &mut short);
        let got = short.filled().len();
        buf.advance(got);
        read
    }

    /// Writes what is left of the guard's answer.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.answer_sent < self.answer.len() {
            let rest = &self.answer[self.answer_sent..];
            match Pin::new(&mut self.inner).poll_write(cx, rest) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => self.answer_sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Finishes writing the guard's answer, if it has one, then polls `then` on the stream.
    fn poll_answered(
        &mut self,
        cx: &mut Context<'_>,
        then: impl FnOnce(&mut Stream, &mut Context<'_>) -> Poll<io::Result<()>>,
    ) -> Poll<io::Result<()>> {
        if self.phase.load(Ordering::Relaxed) == ANSWERED {
            std::task::ready!(self.poll_answer(cx))?;
        }
        then(&mut self.inner, cx)
    }

    /// Whether a write is pingora's answer being replaced, after taking the answer over if this
    /// write starts it.
    fn answering(&mut self, first: &[u8]) -> bool {
        match self.phase.load(Ordering::Relaxed) {
            ANSWERED => true,
            HEADER => self.take_over(first),
            _ => false,
        }
    }

    /// Refuses the header: answers as far as the client's socket takes the answer at once,
    /// then fails the read, which makes pingora close the connection.
    fn refuse(&mut self, cx: &mut Context<'_>, problem: Problem) -> Poll<io::Result<()>> {
        self.answer_with(&problem, REQUEST);
        if let Poll::Ready(Ok(())) = self.poll_answer(cx) {
            let _ = Pin::new(&mut self.inner).poll_flush(cx);
        }
        let kind = match problem {
            Problem::RequestHeaderTimeout => io::ErrorKind::TimedOut,
            _ => io::ErrorKind::InvalidData,
        };
        Poll::Ready(Err(io::Error::new(kind, problem.title())))
    }
}

/// The status code of a serialized HTTP/1.x response head, from its status line.
fn status_of(head: &[u8]) -> Option<u16> {
    let line = head.strip_prefix(b"HTTP/1.")?.get(2..5)?;
    std::str::from_utf8(line).ok()?.parse().ok()
}

/// The whole HTTP/1.1 answer to a refused header: no request was parsed, so it is written below
/// pingora, and it closes the connection.
fn raw_answer(problem: &Problem) -> Vec<u8> {
    let status = problem.status();
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let body = problem.body();
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/problem+json\r\n\
         cache-control: no-store\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// The limits a connection's headers are held to, read from the live config at accept.
#[derive(Clone, Copy)]
struct Limits {
    /// `request_header_timeout`.
    timeout: Duration,
    /// `max_request_header_bytes`.
    bytes: usize,
    /// `response_send_timeout`: how long a write or a close may wait for the client to take
    /// what is left to send.
    send: Duration,
}

/// The timer of a write that waits for the client: started when the write first has to wait,
/// stopped by any progress. Its sleep is kept between stalls, so a response that stalls again
/// and again (one larger than the socket buffers, to a slow reader) allocates it once.
#[derive(Default)]
struct Stall {
    /// Allocated by the first stall, reset by each later one.
    alarm: Option<Pin<Box<Sleep>>>,
    /// Whether a write is waiting now: the alarm times it. It stays set after the alarm fired,
    /// or after its caller gave up on a waiting write (pingora's own body timeout): a later
    /// write that has to wait, with nothing taken since, fails at once.
    waiting: bool,
}

// === impl Stall ===

impl Stall {
    /// Passes on what a write (or flush, or close) `polled`; a write still waiting for the
    /// client `limit` after it began to wait fails with `TimedOut` instead.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        limit: Duration,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.waiting = false;
            return polled;
        }
        if !self.waiting {
            self.waiting = true;
            let deadline = Instant::now() + limit;
            match self.alarm.as_mut() {
                Some(alarm) => alarm.as_mut().reset(deadline),
                None => self.alarm = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        match self.alarm.as_mut().map(|alarm| alarm.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => {
                tracing::debug!(timeout = ?limit, "client took nothing of a response; connection dropped");
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took nothing within response_send_timeout",
                )))
            }
            _ => Poll::Pending,
        }
    }
}

/// The guard of the connection a session runs on, if it has one (HTTP/1 connections accepted
/// by [`Guarded`] do).
fn guard_of(session: &Session) -> Option<&HeadGuard> {
    let stream = session.stream()?;
    (**stream).as_any().downcast_ref::<HeadGuard>()
}

/// Marks the connection's header as received: its reads are no longer timed as a header's.
pub fn request_started(session: &Session) {
    if let Some(g) = guard_of(session) {
        g.phase.store(REQUEST, Ordering::Relaxed);
    }
}

/// Marks the connection's request as over: the next bytes read begin the next header. A request
/// whose body was not read to its end closes the connection instead (pingora would otherwise
/// drain the rest of the body, and those reads are no header's).
///
/// A kept-alive connection waits for its next request [`KEEPALIVE_SECS`] at most, as a new one
/// waits for its first. pingora sets the wait from each request it reads: without a
/// `Keep-Alive: timeout=` from the client an HTTP/1.1 connection would wait for ever, and with
/// one the client would choose; either way an idle client could hold its socket and task for
/// good.
pub fn request_ended(session: &mut Session) {
    let body_done = session.is_body_done();
    let Some(g) = guard_of(session) else {
        return;
    };
    if body_done {
        g.phase.store(BETWEEN, Ordering::Relaxed);
        if session
            .get_keepalive()
            .is_some_and(|secs| secs == 0 || secs > KEEPALIVE_SECS)
        {
            session.set_keepalive(Some(KEEPALIVE_SECS));
        }
    } else {
        session.set_keepalive(None);
    }
}

/// Longest wait for the next request on a kept-alive connection, in seconds: pingora's wait for
/// the first request on a new one.
pub const KEEPALIVE_SECS: u64 = 60;

impl AsyncRead for HeadGuard {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.phase.load(Ordering::Relaxed) {
            BETWEEN => {
                let before = buf.filled().len();
                let read = this.read_at_most(cx, buf, this.limits.bytes);
                let got = buf.filled().len() - before;
                if matches!(read, Poll::Ready(Ok(()))) && got > 0 {
                    this.phase.store(HEADER, Ordering::Relaxed);
                    this.deadline = Instant::now() + this.limits.timeout;
                    this.read = got;
                    this.alarm = None;
                }
                read
            }
            HEADER => {
                // The limit is read and pingora still wants more: the header is longer.
                if this.read >= this.limits.bytes {
                    let limit = this.limits.bytes;
                    return this.refuse(cx, Problem::RequestHeaderTooLarge { limit });
                }
                if Instant::now() >= this.deadline {
                    return this.refuse(cx, Problem::RequestHeaderTimeout);
                }
                let before = buf.filled().len();
                let read = this.read_at_most(cx, buf, this.limits.bytes - this.read);
                this.read += buf.filled().len() - before;
                if read.is_pending() {
                    let deadline = this.deadline;
                    let alarm = this
                        .alarm
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                    if alarm.as_mut().poll(cx).is_ready() {
                        return this.refuse(cx, Problem::RequestHeaderTimeout);
                    }
                }
                read
            }
            _ => Pin::new(&mut this.inner).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for HeadGuard {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = if this.answering(buf) {
            this.poll_answer(cx).map_ok(|()| buf.len())
        } else {
            Pin::new(&mut this.inner).poll_write(cx, buf)
        };
        this.stall.watch(cx, this.limits.send, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        let polled = if this.answering(first) {
            let len = bufs.iter().map(|b| b.len()).sum();
            this.poll_answer(cx).map_ok(|()| len)
        } else {
            Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
        };
        this.stall.watch(cx, this.limits.send, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = this.poll_answered(cx, |inner, cx| Pin::new(inner).poll_flush(cx));
        this.stall.watch(cx, this.limits.send, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = this.poll_answered(cx, |inner, cx| Pin::new(inner).poll_shutdown(cx));
        this.stall.watch(cx, this.limits.send, polled)
    }
}

#[async_trait]
impl Shutdown for HeadGuard {
    /// Closes the connection, giving the client `response_send_timeout` at most to take what is
    /// left to send (the guard's own answer, or the end of a response). pingora's close flushes
    /// with no deadline: a client that reads nothing would hold the connection and its task
    /// for good, the very thing the guard is there to stop. Past the deadline the connection is
    /// dropped with whatever was not sent.
    async fn shutdown(&mut self) {
        let _ = crate::upstream::within(self.limits.send, self.inner.shutdown()).await;
    }
}

impl UniqueID for HeadGuard {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeadGuard {
    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeadGuard {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeadGuard {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for HeadGuard {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

#[async_trait]
impl Peek for HeadGuard {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

impl std::fmt::Debug for HeadGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadGuard")
            .field("inner", &self.inner)
            .field("phase", &self.phase.load(Ordering::Relaxed))
            .finish()
    }
}

/// The proxy's pingora application with every accepted connection wrapped in a [`HeadGuard`]
/// held to the live config's `request_header_timeout` and `max_request_header_bytes` as they are
/// when the connection is accepted.
pub struct Guarded<A> {
    inner: Arc<A>,
    current: Arc<ArcSwap<Generation>>,
    refused: HeaderRefusals,
}

impl<A> Guarded<A> {
    /// Wraps `inner`; `refused` counts the headers refused.
    pub fn new(inner: A, current: Arc<ArcSwap<Generation>>, refused: HeaderRefusals) -> Self {
        Guarded {
            inner: Arc::new(inner),
            current,
            refused,
        }
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Guarded<A> {
    async fn process_new(
        self: &Arc<Self>,
        session: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let limits = {
            let gen = self.current.load();
            Limits {
                timeout: gen.config.request_header_timeout,
                bytes: gen.config.max_request_header_bytes,
                send: gen.config.response_send_timeout,
            }
        };
        let guarded: Stream = Box::new(HeadGuard::new(session, limits, self.refused.clone()));
        let reused = self.inner.process_new(guarded, shutdown).await?;
        // Handed back for another round: unwrap it, the next round wraps it afresh. Only the
        // guard went in, so only the guard can come back.
        reused
            .into_any()
            .downcast::<HeadGuard>()
            .ok()
            .map(|g| g.inner)
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await
    }
}
