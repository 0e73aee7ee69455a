//! The request flow of SPEC §1 as a pingora `ProxyHttp`: route, key, claim, replay or execute.
//!
//! Every request is answered in `request_filter`. A keyed request's body is read and
//! fingerprinted before the claim (pingora's retry buffer would replay at most 64 KiB), then it is
//! executed by [`Gate::execute`] over idemgate's own upstream client ([`crate::upstream`]), which
//! also lets the outcome be stored when the client has gone away. Forwarded requests (routes
//! without idempotency, an optional key absent) take the same client through [`Gate::forward`]
//! when their body is known and small; an `Upgrade`, `Expect: 100-continue`, `CONNECT`, a chunked
//! or larger body takes pingora's own proxy path, which streams both ways.

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::future::{select, Either};
use http::header::{self, HeaderName, HeaderValue};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::{Error, Result};

use crate::budget::{BodyBudget, BodyPermit};
use crate::config::{
    Config, KeyMode, OnInFlight, OnOutcomeUnknown, OnUnavailable, Route, RouteIdempotency,
    RouteMatch,
};
use crate::key;
use crate::metrics::{KeyOutcome, Metrics, Pull, RouteHandles, StoreOpHandles};
use crate::problem::{AnswerSettled, Outcome, OutcomeKept, Problem};
use crate::store::retry::{CompletionRetrier, PendingCompletion, Refusal};
use crate::store::{
    fallback_record, ClaimOutcome, ClaimRequest, Completion, OwnerToken, RecordKey, RecordState,
    RecordStore, ResponseBuilder, StoreError, StoredResponse, WriteOutcome,
};
use crate::upstream::{self, Backend, UpstreamError};
use crate::worker_lease::WorkerIds;

/// Header carrying the result of the idempotency check to the client.
pub const RESULT_HEADER: &str = "x-idempotent-result";
/// Header marking a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Header carrying the execution id to the backend.
pub const EXECUTION_ID_HEADER: &str = "x-idempotency-id";

/// How long, and how much of a request body, a refusal written before the body was read waits
/// for and drops before closing the connection (see [`linger`]).
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 16 << 20;
/// The first buffer a chunked request body (no declared length) is read into.
const MIN_BODY_BUFFER: usize = 16 << 10;
/// The most of a declared request body charged to the budget before any of it arrives.
const FIRST_BODY_BUFFER: usize = 64 << 10;

/// A config and the upstream pools built from it: swapped as one, so a request sees one version.
pub struct Generation {
    /// The validated config.
    pub config: Config,
    /// One pool per `config.upstreams` entry, same order.
    pub pools: Vec<UpstreamPool>,
    /// Metric children per route, same order, then one for requests matching no route.
    route_metrics: Vec<RouteHandles>,
    /// The headers that decide a request's record (the key and tenant headers, every route's
    /// scope headers): a `Connection` header naming one is refused ([`nominates_protected`]).
    scoping_headers: Vec<HeaderName>,
}

/// `result` label values, indexed by [`result_index`]; `REFUSED` is a request idemgate answered
/// itself without an idempotency result (no route, not valid HTTP, a body it could not read on a
/// route without idempotency): nothing was forwarded.
const RESULT_LABELS: [&str; 10] = [
    "FORWARD",
    "MISS",
    "HIT",
    "CONFLICT",
    "MISMATCH",
    "INVALID",
    "BYPASS",
    "DEGRADED",
    "UNAVAILABLE",
    "REFUSED",
];

/// `outcome`'s index in [`RESULT_LABELS`]; a request with none is `REFUSED` when idemgate
/// answered it itself (`refused`), `FORWARD` otherwise.
fn result_index(outcome: Option<Outcome>, refused: bool) -> usize {
    match outcome {
        None if refused => 9,
        None => 0,
        Some(Outcome::Miss) => 1,
        Some(Outcome::Hit) => 2,
        Some(Outcome::Conflict) => 3,
        Some(Outcome::Mismatch) => 4,
        Some(Outcome::Invalid) => 5,
        Some(Outcome::Bypass) => 6,
        Some(Outcome::Degraded) => 7,
        Some(Outcome::Unavailable) => 8,
    }
}

impl Generation {
    /// Builds the upstream pools and metric handles for `config`.
    pub fn new(config: Config, metrics: &Metrics) -> std::result::Result<Self, String> {
        Self::new_within(config, metrics, &[])
    }

    /// [`Generation::new`], refused when an upstream address, as resolved for it, reaches one
    /// of `listeners` (named): a reload keeps the running listeners whatever its file says, and
    /// the file's own check compared its upstreams with the file's.
    pub fn new_within(
        config: Config,
        metrics: &Metrics,
        listeners: &[(&str, std::net::SocketAddr)],
    ) -> std::result::Result<Self, String> {
        let pools = config
            .upstreams
            .iter()
            .map(|up| UpstreamPool::new(up, metrics))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for (upstream, pool) in config.upstreams.iter().zip(&pools) {
            let addrs: Vec<_> = pool.backends.iter().map(|b| b.addr).collect();
            if let Some((to, name, l)) = crate::config::reaches_any(&addrs, listeners) {
                return Err(format!(
                    "upstreams.{}.addrs: {to} is idemgate's own {name} ({l}): requests would \
                     loop back",
                    upstream.name
                ));
            }
        }
        let route_metrics = config
            .routes
            .iter()
            .map(|r| r.name.as_str())
            .chain(std::iter::once("-"))
            .map(|name| metrics.route_handles(name, &RESULT_LABELS))
            .collect();
        let mut scoping_headers = vec![
            config.idempotency.key_header.clone(),
            config.idempotency.tenant_header.clone(),
        ];
        for route in &config.routes {
            if let Some(idem) = &route.idempotency {
                scoping_headers.extend(idem.scope_headers.iter().cloned());
            }
        }
        scoping_headers.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        scoping_headers.dedup();
        Ok(Generation {
            config,
            pools,
            route_metrics,
            scoping_headers,
        })
    }

    fn route_metrics(&self, route: Option<usize>) -> &RouteHandles {
        let i = route.unwrap_or(self.config.routes.len());
        &self.route_metrics[i.min(self.route_metrics.len() - 1)]
    }

    /// Observes a backend round of `route` begun at `started`, answered or not: a backend that
    /// fails every request must show in its latency too.
    fn upstream_round(&self, route: Option<usize>, started: Instant) {
        self.route_metrics(route)
            .observe_upstream(started.elapsed().as_secs_f64());
    }

    /// The resolved addresses of every upstream, in config order, each upstream's sorted (a
    /// resolver that rotates its answers gives the same set in another order).
    pub fn addresses(&self) -> Vec<Vec<std::net::SocketAddr>> {
        self.pools
            .iter()
            .map(|pool| {
                let mut addrs: Vec<_> = pool.backends.iter().map(|b| b.addr).collect();
                addrs.sort_unstable();
                addrs
            })
            .collect()
    }
}

/// Round-robin over the resolved addresses of one upstream.
pub struct UpstreamPool {
    /// The addresses as pingora peers, for requests that take pingora's proxy path.
    peers: Vec<HttpPeer>,
    /// The same addresses for idemgate's own client, same order.
    backends: Vec<Backend>,
    /// The first address as configured (`orders:8080`): the `Host` [`add_host`] gives an
    /// HTTP/1.0 request that came without one.
    host: http::HeaderValue,
    next: AtomicUsize,
    /// Requests out to this upstream now: the metric's child, named by the upstream, so the
    /// count carries over from one config generation to the next.
    in_flight: prometheus::IntGauge,
    /// Requests refused for want of a slot.
    busy: prometheus::IntCounter,
    /// `max_in_flight`, as this generation's config says.
    max_in_flight: Option<usize>,
}

/// One request out to an upstream, counted in its `idemgate_upstream_in_flight` until dropped
/// (with the request's context, once its answer is relayed or it failed).
struct InFlightSlot(prometheus::IntGauge);

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl UpstreamPool {
    fn new(
        up: &crate::config::UpstreamConfig,
        metrics: &Metrics,
    ) -> std::result::Result<Self, String> {
        use std::net::ToSocketAddrs;
        let mut peers = Vec::new();
        let mut backends = Vec::new();
        for (j, addr) in up.addrs.iter().enumerate() {
            let resolved = addr.to_socket_addrs().map_err(|e| {
                format!(
                    "upstreams.{}.addrs[{j}]: cannot resolve {addr}: {e}",
                    up.name
                )
            })?;
            for sa in resolved {
                let mut peer = HttpPeer::new(sa, false, String::new());
                peer.options.connection_timeout = Some(up.connect_timeout);
                peer.options.read_timeout = Some(up.read_timeout);
                peer.options.write_timeout = Some(up.write_timeout);
                peer.options.idle_timeout = Some(up.idle_timeout);
                peer.options.tcp_keepalive = Some(upstream::keepalive(up.write_timeout));
                peers.push(peer);
                backends.push(Backend {
                    addr: sa,
                    connect_timeout: up.connect_timeout,
                    read_timeout: up.read_timeout,
                    write_timeout: up.write_timeout,
                    idle_timeout: up.idle_timeout,
                });
            }
        }
        if peers.is_empty() {
            return Err(format!("upstreams.{}.addrs: no address resolved", up.name));
        }
        let first = up.addrs.first().map_or("", String::as_str);
        let host = http::HeaderValue::from_str(first)
            .map_err(|_| format!("upstreams.{}.addrs[0]: {first:?} is no host name", up.name))?;
        Ok(UpstreamPool {
            peers,
            backends,
            host,
            next: AtomicUsize::new(0),
            in_flight: metrics.upstream_in_flight.with_label_values(&[&up.name]),
            busy: metrics.upstream_busy.with_label_values(&[&up.name]),
            max_in_flight: up.max_in_flight,
        })
    }

    /// A slot for one more request out to this upstream, or `None` (counted) when it already
    /// has `max_in_flight` out. Counted first and checked after, so racing requests can only
    /// be refused together, never let past the limit together. A lower limit set by a reload
    /// lets nothing new out until the requests already out fall under it.
    fn slot(&self) -> Option<InFlightSlot> {
        self.in_flight.inc();
        if self
            .max_in_flight
            .is_some_and(|max| self.in_flight.get() > max as i64)
        {
            self.in_flight.dec();
            self.busy.inc();
            return None;
        }
        Some(InFlightSlot(self.in_flight.clone()))
    }

    /// The index of the next address, round robin.
    fn pick(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.peers.len()
    }

    /// Sends a request to the next address, and to the one after it when it cannot be
    /// connected to (nothing was sent, so even a request that may change something goes on):
    /// each address once at most, while `may_go_on` allows another connect, write and read.
    /// An address that is down costs its `connect_timeout`, not the request, as with nginx's
    /// default `proxy_next_upstream error timeout`.
    async fn send(
        &self,
        head: &[u8],
        body: &[u8],
        started: Instant,
        pooled: bool,
        may_go_on: impl Fn() -> bool,
    ) -> std::result::Result<upstream::Exchange, UpstreamError> {
        // From one pick, on through the list: the shared counter moves with every other
        // request meanwhile, and could send this one back to the address that just failed.
        let n = self.backends.len();
        let first = self.pick();
        let mut i = 0;
        loop {
            let backend = &self.backends[(first + i) % n];
            // The clock again after a connect that failed (perhaps by timing out): the pool
            // judges its idle connections by it, and pools the one used by it.
            let now = if i == 0 { started } else { Instant::now() };
            match upstream::send(backend, head, body, now, pooled).await {
                Err(e @ UpstreamError::Connect { .. }) if i + 1 < n && may_go_on() => {
                    crate::warn_throttled!(error = %e, "backend unreachable; trying the next address");
                    i += 1;
                }
                sent => return sent,
            }
        }
    }
}

/// Counts requests being handled so shutdown can tell when the drain is done.
#[derive(Default)]
pub struct InFlightCounter(AtomicUsize);

impl InFlightCounter {
    /// Requests being handled right now.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

struct InFlightGuard {
    counter: Arc<InFlightCounter>,
}

impl InFlightGuard {
    fn new(counter: Arc<InFlightCounter>) -> Self {
        counter.0.fetch_add(1, Ordering::AcqRel);
        InFlightGuard { counter }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.counter.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Per-request state, created by pingora for every request.
pub struct RequestCtx {
    gen: Arc<Generation>,
    started: Instant,
    route: Option<usize>,
    upstream: Option<usize>,
    outcome: Option<Outcome>,
    /// Answered by idemgate itself with no idempotency result: counted as `REFUSED`.
    refused: bool,
    record_label: Option<key::HashLabel>,
    /// The record's execution id (`X-Idempotency-Id`), once this request claimed the key or
    /// read its record (a replay, a conflict), for the access line: an operator reconciling
    /// with the backend finds the request by it.
    execution_id: Option<u64>,
    /// Set once the request body was read to its end, by idemgate itself or on pingora's
    /// streaming path (a body cut off is never marked so, though pingora counts it as done): a
    /// client that leaves after that left a sound request.
    body_ended: bool,
    /// Its access line and metrics were written ([`ProxyHttp::logging`]).
    logged: bool,
    /// Its place among the requests out to its upstream, once it has one: held until the
    /// request ends.
    upstream_slot: Option<InFlightSlot>,
    _guard: InFlightGuard,
}

impl Drop for RequestCtx {
    /// A request pingora dropped without ending it (its task dropped when a drain's grace
    /// period runs out, or unwound by a panic) still gets its access line and its count, with
    /// what is known of it here: route, result so far, record label and time; no method or path
    /// (the session is gone), and no status (none was written whole).
    fn drop(&mut self) {
        if self.logged {
            return;
        }
        let why: &dyn std::fmt::Display = if std::thread::panicking() {
            &"the request's task panicked"
        } else {
            &"cut off: the process stopped before the request ended"
        };
        self.log_line("-", "-", 0, Some(why));
    }
}

impl RequestCtx {
    /// The request's access line and its metrics (the route's count and duration by result).
    fn log_line(
        &mut self,
        method: &str,
        path: &str,
        status: u16,
        error: Option<&dyn std::fmt::Display>,
    ) {
        self.logged = true;
        let index = result_index(self.outcome, self.refused);
        let elapsed = self.started.elapsed();
        self.gen
            .route_metrics(self.route)
            .observe(index, elapsed.as_secs_f64());
        crate::accesslog::log(&crate::accesslog::AccessLine {
            method,
            path,
            route: label(self),
            result: RESULT_LABELS[index],
            status,
            duration: elapsed,
            record: self.record_label,
            execution_id: self.execution_id,
            error,
        });
    }

    /// Counts what became of this request's key, forwarded under a claim.
    fn count_key_outcome(&self, outcome: KeyOutcome) {
        self.gen
            .route_metrics(self.route)
            .count_key_outcome(outcome);
    }

    /// The backend round begun at `started` is over, answered or not: observed in the route's
    /// upstream latency (a backend that fails every request must show there too), and the
    /// request's place among those out to the upstream is free, before the store write and the
    /// client's last reads.
    fn backend_done(&mut self, started: Instant) {
        self.gen.upstream_round(self.route, started);
        self.upstream_slot = None;
    }

    /// The `Link` to the API's idempotency docs that this request's problems carry, if any.
    fn docs(&self) -> Option<&http::HeaderValue> {
        self.gen.config.idempotency.docs_link.as_ref()
    }

    /// `problem` answers the request itself, before anything was forwarded (its body stalled,
    /// broke or was too large: an `INVALID` request; the proxy had no room for it:
    /// `UNAVAILABLE`), on an idempotent route a bypassing one included. The backend's failures
    /// keep the request's own result.
    fn refused_for_its_request(&mut self, problem: &Problem) {
        let own = problem.outcome();
        if self.outcome.is_some() && matches!(own, Outcome::Invalid | Outcome::Unavailable) {
            self.outcome = Some(own);
        }
    }
}

/// The proxy application: shared state for every request.
pub struct Gate {
    current: Arc<ArcSwap<Generation>>,
    store: Arc<dyn RecordStore>,
    fallback: Option<Arc<dyn RecordStore>>,
    ids: Arc<WorkerIds>,
    metrics: Arc<Metrics>,
    in_flight: Arc<InFlightCounter>,
    retrier: CompletionRetrier,
    store_ops: [StoreOpHandles; 4],
    /// The memory the request bodies idemgate reads whole hold, within
    /// `max_buffered_request_bytes`.
    bodies: Arc<BodyBudget>,
}

/// A request body read whole, with its share of `max_buffered_request_bytes`: given back when
/// the body is dropped (once sent to the backend, or when the request ends).
struct HeldBody<'a> {
    bytes: Bytes,
    _share: BodyPermit<'a>,
}

impl std::ops::Deref for HeldBody<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Store operations timed by `idemgate_store_operation_duration_seconds`.
#[derive(Clone, Copy)]
enum StoreOp {
    Claim = 0,
    Complete = 1,
    Release = 2,
    Wait = 3,
}

/// How a keyed request ended, for the log line and metrics.
struct Handled {
    outcome: Outcome,
}

/// Where the claim was made, so completion goes to the same store.
#[derive(Clone, Copy)]
struct Claim<'a> {
    store: &'a dyn RecordStore,
    /// The claim as sent: key, owner, fingerprint and TTLs. Sent again, it renews the lock.
    req: &'a ClaimRequest,
    /// The record's execution id (an earlier claim's, when the record was re-claimed).
    execution_id: u64,
    /// The claim was sent, plus `lock_ttl`: the store's lock lapses no earlier than this.
    lock_deadline: Instant,
    /// The store's answer came back, plus `lock_ttl`: the lock has lapsed by then (a renewal
    /// that failed may have landed, so it moves this on too). The completion retrier's bound.
    lapses_by: Instant,
}

impl Claim<'_> {
    /// Notes a renewal given up on at `at` (unanswered in its time, or no longer needed): it
    /// may still land and start a lock then, so the lock has lapsed only a `lock_ttl` later.
    fn renewal_may_land(&mut self, at: Instant) {
        self.lapses_by = self.lapses_by.max(at + self.req.lock_ttl);
    }

    /// When the lock is three quarters gone: the last moment to renew it, or to store an
    /// outcome, with a quarter of the lock left for the store's round trip.
    fn alarm(&self) -> Instant {
        self.lock_deadline - self.req.lock_ttl / 4
    }
}

// === impl Gate ===

impl Gate {
    /// Creates the application. `fallback` is the in-process store used when `on_unavailable:
    /// local` and the main store fails.
    pub fn new(
        current: Arc<ArcSwap<Generation>>,
        store: Arc<dyn RecordStore>,
        fallback: Option<Arc<dyn RecordStore>>,
        ids: Arc<WorkerIds>,
        metrics: Arc<Metrics>,
        in_flight: Arc<InFlightCounter>,
        retrier: CompletionRetrier,
    ) -> Self {
        let store_ops = ["claim", "complete", "release", "wait"].map(|op| metrics.store_op(op));
        metrics.pull_counter(
            "idemgate_upstream_stray_bytes_total",
            "Pooled backend connections dropped because the backend had sent bytes after a \
             complete answer (a backend writing past its answers' framing)",
            || crate::upstream::stray_bytes_drops() as f64,
        );
        let bodies = Arc::new(BodyBudget::default());
        metrics.pull_from(
            &bodies,
            &[
                (
                    "idemgate_request_body_buffered_bytes",
                    "Bytes of request bodies held in memory now (bounded by \
                     max_buffered_request_bytes)",
                    Pull::Gauge,
                    |b| b.held() as f64,
                ),
                (
                    "idemgate_request_bodies_refused_total",
                    "Keyed requests refused (503 request-buffers-full) because their bodies \
                     would have taken max_buffered_request_bytes past its limit",
                    Pull::Counter,
                    |b| b.refused() as f64,
                ),
            ],
        );
        Gate {
            bodies,
            current,
            store,
            fallback,
            ids,
            store_ops,
            metrics,
            in_flight,
            retrier,
        }
    }

    /// Runs the SPEC §1 flow for a request on an idempotent route. Returns `None` when the
    /// request should continue on pingora's proxy path (optional key absent).
    async fn handle_keyed(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        route: &Route,
        idem: &RouteIdempotency,
    ) -> Result<Option<Handled>> {
        let config = &ctx.gen.config;
        let req = session.req_header();

        // Step 2: the key. A bad header is never treated as "no key".
        let key = match key::parse_key(req.headers.get_all(&config.idempotency.key_header)) {
            Ok(Some(k)) if k.len() < idem.min_key_length => {
                let short = key::KeyError::TooShort {
                    len: k.len(),
                    min: idem.min_key_length,
                };
                return self
                    .refuse(session, ctx, Problem::KeyInvalid(short.to_string()))
                    .await;
            }
            Ok(Some(k)) => k,
            Ok(None) => match idem.key {
                KeyMode::Required => return self.refuse(session, ctx, Problem::KeyMissing).await,
                KeyMode::Optional => {
                    ctx.outcome = Some(Outcome::Bypass);
                    return Ok(None);
                }
            },
            Err(e) => {
                return self
                    .refuse(session, ctx, Problem::KeyInvalid(e.to_string()))
                    .await
            }
        };

        // Step 3: tenant and principal scope.
        let tenant = match key::parse_tenant(req.headers.get_all(&config.idempotency.tenant_header))
        {
            Ok(None) => config.idempotency.default_tenant.clone(),
            Ok(Some(t)) => t.to_owned(),
            Err(e) => {
                return self
                    .refuse(session, ctx, Problem::TenantInvalid(e.to_string()))
                    .await
            }
        };
        if idem.scope_required && !key::has_scope(&req.headers, &idem.scope_headers) {
            let names = idem.scope_headers.iter().map(HeaderName::as_str);
            let names = names.collect::<Vec<_>>().join(" or ");
            return self
                .refuse(session, ctx, Problem::ScopeMissing(names))
                .await;
        }
        let hash = key::record_hash(&tenant, &req.headers, &idem.scope_headers, &key);
        ctx.record_label = Some(key::hash_label(&hash));
        let record_key = RecordKey { tenant, hash };

        // Step 4: the whole body, then the fingerprint. A coding other than chunked would be
        // lost on the way: the body is sent on with a length and no coding.
        if transfer_coded(&req.headers) {
            return self
                .refuse(session, ctx, Problem::TransferCodingUnsupported)
                .await;
        }
        let body = match self
            .read_body(
                session,
                idem.max_request_bytes,
                config,
                self.bodies.permit(),
            )
            .await
        {
            Ok(b) => {
                ctx.body_ended = true;
                b
            }
            Err(p) => return self.refuse(session, ctx, p).await,
        };
        let req = session.req_header();
        // Headers `Connection` names are not forwarded: the fingerprint leaves them out too, so
        // hiding one from the backend is a changed request, not a replay of one that had it.
        let hidden = if idem.fingerprint_headers.is_empty() {
            Vec::new()
        } else {
            upstream::connection_tokens(req.headers.get_all(header::CONNECTION))
        };
        let fingerprint = key::fingerprint(
            &req.method,
            req.raw_path(),
            &req.headers,
            &idem.fingerprint_headers,
            &hidden,
            idem.fingerprint_body.then_some(&body[..]),
        );

        // Step 5: claim or read, waiting on an in-flight twin when the route says so.
        let mut claim_req = ClaimRequest {
            key: record_key,
            fingerprint,
            owner: OwnerToken::random(),
            execution_id: self.ids.next_id().await,
            lock_ttl: idem.lock_ttl,
            ttl: idem.ttl,
        };
        // Set at the first claim: only a request that meets an in-flight twin needs it.
        let mut deadline: Option<Instant> = None;
        let mut store: &dyn RecordStore = self.store.as_ref();
        let mut degraded = false;
        // Set once the store showed the key held by another request (in flight, or released
        // and raced for): from then on a store failure is never a reason to execute it
        // without protection, whatever `on_unavailable` says, since this proxy knows the key
        // is live.
        let mut seen_live = false;
        // A key this replica ran on the fallback during an outage (`local`) stays there while
        // its record lives: the store, back, has no record of it, and a claim there would run
        // it again. Looked up only while the fallback holds anything.
        if let Some(local) = &self.fallback {
            if let Some(record) = fallback_record(local.as_ref(), &claim_req.key).await {
                if !matches!(record.state, RecordState::Released) {
                    store = local.as_ref();
                    degraded = true;
                } else if record.fingerprint != claim_req.fingerprint {
                    // Released there (a 5xx during the outage): the store, back, knows
                    // nothing of it, but the key still runs only for the same request...
                    return self
                        .refuse(session, ctx, Problem::FingerprintMismatch)
                        .await;
                } else {
                    // ...and under the id the backend already saw.
                    claim_req.execution_id = record.execution_id;
                }
            }
        }
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let started = Instant::now();
            let deadline = *deadline.get_or_insert(started + idem.wait_timeout);
            let answer = store.claim(&claim_req).await;
            let answered = self.observe_store(StoreOp::Claim, started, answer.is_err());
            let existing = match answer {
                Ok(ClaimOutcome::Acquired {
                    execution_id,
                    lapsed,
                }) => {
                    // A re-claimed record keeps its earlier execution id, which the backend is
                    // sent. Renewals send this request again, and one that finds the record gone
                    // (purged, or lost in a failover) makes it afresh: with this id, not a new
                    // one, so a retry after a release still carries the id the backend saw.
                    claim_req.execution_id = execution_id;
                    ctx.execution_id = Some(execution_id);
                    let claim = Claim {
                        store,
                        req: &claim_req,
                        execution_id,
                        lock_deadline: started + idem.lock_ttl,
                        lapses_by: answered + idem.lock_ttl,
                    };
                    // Taken over from an execution whose lock lapsed: its replica died, or lost
                    // the store for longer than the lock, or never sent the request (a claim that
                    // timed out here but landed, a release the store did not take). The store
                    // cannot tell these apart, so the key runs again, under the same execution
                    // id, and an operator is told: if the first did run, the backend ran it
                    // twice unless it deduplicates by that id.
                    if lapsed {
                        ctx.gen.route_metrics(ctx.route).count_lapsed_takeover();
                        crate::warn_throttled!(
                            record = %key::hash_label(&claim_req.key.hash),
                            execution_id,
                            route = %route.name,
                            "took over a key whose earlier execution's lock lapsed, its outcome unknown; running it again under the same execution id"
                        );
                    }
                    let outcome = if degraded {
                        Outcome::Degraded
                    } else {
                        Outcome::Miss
                    };
                    return self
                        .execute(session, ctx, route, idem, body, Some(claim), outcome)
                        .await
                        .map(Some);
                }
                Ok(ClaimOutcome::Existing(record)) => record,
                Err(StoreError::Full { .. } | StoreError::OutOfMemory(_)) => {
                    return self.refuse(session, ctx, Problem::StoreFull).await
                }
                // The store answered, but not in a way this proxy can use: a record it cannot
                // read, or a script that fails. That is no outage, so the outage policy does not
                // apply — executing could run the key twice.
                Err(StoreError::Corrupt(e)) => {
                    crate::error_throttled!(error = %e, "record store answered with a record this proxy cannot read or a failing script; refused");
                    return self
                        .refuse(session, ctx, Problem::StoreRecordUnreadable)
                        .await;
                }
                Err(e) if seen_live => {
                    crate::warn_throttled!(error = %e, "record store failed on claim after the key was seen held by another request; not executing it unprotected");
                    return self.refuse(session, ctx, Problem::StoreUnavailable).await;
                }
                Err(e) => {
                    crate::warn_throttled!(error = %e, "record store failed on claim");
                    // A key this replica is running itself is in flight, whatever the policy
                    // lets through: a retry of it must not run beside it.
                    if let Some(retry_after) = self.store.own_claim(&claim_req.key) {
                        return self
                            .refuse(session, ctx, Problem::InFlight { retry_after })
                            .await;
                    }
                    // Nor must a retry of one that ended here since the cache was asked.
                    let Some(record) = self.store.local_copy(&claim_req.key) else {
                        match config.store.on_unavailable {
                            OnUnavailable::Reject => {
                                return self.refuse(session, ctx, Problem::StoreUnavailable).await
                            }
                            OnUnavailable::Pass => {
                                return self
                                    .execute(
                                        session,
                                        ctx,
                                        route,
                                        idem,
                                        body,
                                        None,
                                        Outcome::Degraded,
                                    )
                                    .await
                                    .map(Some);
                            }
                            OnUnavailable::Local => match (&self.fallback, degraded) {
                                (Some(local), false) => {
                                    store = local.as_ref();
                                    degraded = true;
                                    continue;
                                }
                                _ => {
                                    return self
                                        .refuse(session, ctx, Problem::StoreUnavailable)
                                        .await
                                }
                            },
                        }
                    };
                    record
                }
            };
            if existing.fingerprint != fingerprint {
                return self
                    .refuse(session, ctx, Problem::FingerprintMismatch)
                    .await;
            }
            ctx.execution_id = Some(existing.execution_id);
            match existing.state {
                RecordState::Completed(Completion::Response(stored)) => {
                    let Some(head) = replay_head(&stored, &idem.replay_exclude_headers) else {
                        tracing::error!("stored response cannot be written as HTTP");
                        return self
                            .refuse(session, ctx, Problem::StoreRecordUnreadable)
                            .await;
                    };
                    // Set before the writes: a client gone mid-replay still counts as a hit.
                    ctx.outcome = Some(Outcome::Hit);
                    self.replay(session, head, &stored).await?;
                    return Ok(Some(Handled {
                        outcome: Outcome::Hit,
                    }));
                }
                RecordState::Completed(Completion::Unreplayable { .. }) => {
                    return self.refuse(session, ctx, Problem::NotReplayable).await
                }
                RecordState::InFlight { lock_remaining } => {
                    seen_live = true;
                    let now = Instant::now();
                    if idem.on_in_flight == OnInFlight::Reject || now >= deadline {
                        let problem = Problem::InFlight {
                            retry_after: lock_remaining,
                        };
                        return self.refuse(session, ctx, problem).await;
                    }
                    let started = Instant::now();
                    // A waiter whose client leaves gives up its turn: its request was never
                    // sent, and running it once the original is released would execute it for
                    // nobody (a payment its client gave up on, perhaps telling its user so). Its
                    // whole body is read, so anything on the connection now is the client
                    // closing it, or bytes past its request, which end it too.
                    let waited = tokio::select! {
                        waited = store.wait_for_change(&claim_req.key, deadline - now) => waited,
                        _ = session.read_body_or_idle(true) => {
                            ctx.outcome = Some(Outcome::Conflict);
                            session.set_keepalive(None);
                            tracing::info!(
                                route = %route.name,
                                "client left while waiting for the first request with its key; \
                                 its request was never sent"
                            );
                            return Err(Error::explain(
                                pingora::ErrorType::ConnectionClosed,
                                "client left while waiting",
                            )
                            .into_down());
                        }
                    };
                    self.observe_store(StoreOp::Wait, started, waited.is_err());
                    if let Err(e) = waited {
                        crate::warn_throttled!(error = %e, "record store failed while waiting");
                        return self.refuse(session, ctx, Problem::StoreUnavailable).await;
                    }
                    // Claim again: the original completed (replay), released (execute) or is
                    // still running (wait more, or 409 at the deadline).
                }
                RecordState::Released => {
                    seen_live = true;
                    // A released record with our fingerprint is claimable, so this is a race
                    // with another claimer; a few more rounds settle it.
                    if attempts > 8 {
                        let problem = Problem::InFlight {
                            retry_after: Duration::from_secs(1),
                        };
                        return self.refuse(session, ctx, problem).await;
                    }
                }
            }
        }
    }

    /// Reads the whole request body, bounded by `limit` bytes and `timeout` between reads; the
    /// memory it takes is covered by `held` (grown as the body arrives, within
    /// `max_buffered_request_bytes`), which the body keeps until it is dropped.
    async fn read_body<'a>(
        &'a self,
        session: &mut Session,
        limit: usize,
        config: &Config,
        mut held: BodyPermit<'a>,
    ) -> std::result::Result<HeldBody<'a>, Problem> {
        // Each read waits request_body_timeout at most, and all of them together
        // request_body_total_timeout from the first that has to wait: a client trickling a
        // byte inside every pause is cut off. A body that came with its header reads no clock.
        let mut deadline = None;
        let req = session.req_header();
        let declared = declared_length(&req.headers);
        if declared.is_some_and(|n| n > limit) {
            return Err(Problem::RequestTooLarge { limit });
        }
        // An HTTP/1.0 client knows no interim answers (RFC 9110 §10.1.1): it sends its body
        // unasked.
        let expects_continue = req.version >= http::Version::HTTP_11
            && req
                .headers
                .get(header::EXPECT)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if session.is_body_done() {
            return Ok(HeldBody {
                bytes: Bytes::new(),
                _share: held,
            });
        }
        // A declared body that could not fit now is refused before it is invited (the client
        // has sent none of it, or need send no more). It is charged as it arrives, not ahead:
        // a connection that declares a megabyte and sends it a byte at a time must not hold a
        // megabyte of the budget it does not use.
        let budget = config.max_buffered_request_bytes;
        let first = declared.unwrap_or(0).min(FIRST_BODY_BUFFER);
        let room = declared.is_none_or(|n| held.has_room_for(n, budget));
        if !room || !held.cover(first, budget) {
            self.bodies.count_refusal();
            return Err(Problem::RequestBuffersFull);
        }
        if expects_continue {
            // The key and tenant were valid: invite the body now. pingora takes any answer
            // written before the body is read, the interim `100 Continue` too, for one that
            // leaves the body unread, and would close the connection after the final answer:
            // not for this one, whose body is read whole below.
            session.set_close_on_response_before_downstream_finish(false);
            let invited = session.write_continue_response().await;
            session.set_close_on_response_before_downstream_finish(true);
            invited.map_err(|_| Problem::RequestBodyUnreadable)?;
        }
        // Every read below is bounded here; pingora's own read timeout (60 s unless set) would
        // cut a longer request_body_timeout short with a read error, so it only backs this up.
        session.set_read_timeout(Some(config.request_body_timeout + Duration::from_secs(1)));
        // Sized by hand, so the budget covers what is allocated: it grows by doubling, never
        // past the declared length (or, chunked, `limit`).
        let most = declared.unwrap_or(limit);
        let mut buf = Vec::with_capacity(first);
        loop {
            let chunk = upstream::bounded(session.read_request_body(), || {
                let now = Instant::now();
                let end = *deadline.get_or_insert(now + config.request_body_total_timeout);
                config
                    .request_body_timeout
                    .min(end.saturating_duration_since(now))
            })
            .await;
            match chunk {
                Err(_) => return Err(Problem::RequestTimeout),
                Ok(Err(_)) => {
                    // pingora counts a body that failed to parse as done: whatever follows on
                    // the connection is no request of the client's to read next (a front
                    // proxy that framed the body otherwise would have it smuggled in).
                    session.set_keepalive(None);
                    return Err(Problem::RequestBodyUnreadable);
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(data))) => {
                    let need = buf.len() + data.len();
                    if need > limit {
                        return Err(Problem::RequestTooLarge { limit });
                    }
                    if need > buf.capacity() {
                        let grown = (buf.capacity() * 2)
                            .max(MIN_BODY_BUFFER)
                            .min(most)
                            .max(need);
                        if !held.cover(grown, budget) {
                            self.bodies.count_refusal();
                            return Err(Problem::RequestBuffersFull);
                        }
                        buf.reserve_exact(grown - buf.len());
                    }
                    buf.extend_from_slice(&data);
                }
            }
        }
        Ok(HeldBody {
            bytes: Bytes::from(buf),
            _share: held,
        })
    }

    /// Forwards a keyed request and stores (or releases) its outcome. The client going away
    /// does not stop it: the backend's answer is read to the end and stored regardless.
    #[allow(clippy::too_many_arguments)]
    async fn execute(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        route: &Route,
        idem: &RouteIdempotency,
        body: HeldBody<'_>,
        mut claim: Option<Claim<'_>>,
        outcome: Outcome,
    ) -> Result<Handled> {
        // Set now: a response cut off mid-body ends the request with an error, and its log line
        // and metrics still count the execution it was.
        ctx.outcome = Some(outcome);
        let pool = &ctx.gen.pools[route.upstream];
        // Only a request about to be sent takes a place: a replay, a 409 or a 422 never waits
        // on the backend's load. Refused, it was not sent, so its claim is released.
        let Some(slot) = pool.slot() else {
            // Not sent: the key is free again at once, or, when the store did not take the
            // release, once its lock lapses, which the answer's Retry-After then says.
            let locked = match &claim {
                Some(c) => self.release(c).await,
                None => None,
            };
            let busy = Problem::UpstreamBusy {
                retry_after: locked.unwrap_or(Duration::from_secs(1)),
            };
            let outcome = busy.outcome();
            ctx.outcome = Some(outcome);
            return self.refuse_executed(session, ctx, busy, outcome).await;
        };
        ctx.upstream_slot = Some(slot);

        let req = session.req_header();
        let had_body = !body.is_empty()
            || req.headers.contains_key(header::CONTENT_LENGTH)
            || req.headers.contains_key(header::TRANSFER_ENCODING);
        let mut digits = [0u8; 20];
        let id = claim
            .as_ref()
            .map(|c| upstream::itoa(c.execution_id, &mut digits));
        let extra: &[(&str, &[u8])] = match &id {
            Some(id) => &[(EXECUTION_ID_HEADER, id)],
            None => &[],
        };
        let mut head = Vec::with_capacity(512);
        let scoping = &ctx.gen.scoping_headers;
        upstream::request_head(
            req,
            had_body.then_some(body.len()),
            extra,
            scoping,
            &mut head,
        );
        let head_request = req.method == http::Method::HEAD;

        let started = Instant::now();
        // Another address only while the claim's lock outlasts a whole exchange with it, as
        // the config's rule for the first one: a request sent after its lock lapsed could run
        // beside a retry that took the key.
        let lock_deadline = claim.as_ref().map(|c| c.lock_deadline);
        let exchange = ctx.gen.config.upstreams[route.upstream].exchange_bound();
        let may_go_on =
            || lock_deadline.is_none_or(|deadline| Instant::now() + exchange < deadline);
        let mut exchange = match pool.send(&head, &body, started, true, may_go_on).await {
            Ok(x) => {
                // Sent whole: the body's memory, and its share of the budget, need not wait
                // for the answer (nor for a slow client to take it).
                drop(body);
                x
            }
            Err(e) => {
                ctx.backend_done(started);
                crate::warn_throttled!(error = %e, route = %route.name, "backend unreachable; releasing the claim");
                // Nothing was sent, so a retry may run the key: at once once it is released,
                // or once the lock lapses when the store did not take the release.
                let locked = match &claim {
                    Some(c) => {
                        ctx.count_key_outcome(KeyOutcome::Unreachable);
                        self.release(c).await
                    }
                    None => None,
                };
                let problem = match locked {
                    Some(retry_after) => Problem::UpstreamConnectKeyLocked { retry_after },
                    None => Problem::UpstreamConnect,
                };
                return self.refuse_executed(session, ctx, problem, outcome).await;
            }
        };

        // The request is on the wire: from here on the outcome is unknown until a complete
        // response arrives, and the claim is kept unless one does. Nothing can be stored
        // before the answer's head, so while the backend is still being waited for (1xx
        // answers each restart the read timeout) the lock is renewed at three quarters of its
        // life: no retry can take the key over while the original may still be answered.
        let head = match claim.as_mut() {
            None => exchange.read_head(head_request).await,
            Some(c) => {
                let mut head = pin!(exchange.read_head(head_request));
                let mut next = c.alarm();
                loop {
                    match upstream::until(next, head.as_mut()).await {
                        Ok(head) => break head,
                        Err(_) => match self.renew_while(c, head.as_mut()).await {
                            Err(answered) => break answered,
                            Ok(Renewal::Renewed) => next = c.alarm(),
                            // A store that failed once may answer the next try: keep trying,
                            // past the lock's deadline too. The backend may still be running,
                            // and a renewal that lands before anyone else claims the key takes
                            // the lapsed lock back (the stores treat the owner's claim as one),
                            // so a retry after the outage is told to wait instead of running
                            // the key beside it.
                            Ok(Renewal::Failed) => {
                                next = Instant::now() + renewal_pause(c.lock_deadline);
                            }
                            Ok(Renewal::TakenOver) => break head.await,
                        },
                    }
                }
            }
        };
        let response = match head.and_then(|r| relayable(r, session.req_header())) {
            Ok(r) => r,
            Err(e) => {
                ctx.backend_done(started);
                let problem = match (&e, claim.as_ref()) {
                    // An answer that cannot be relayed still says the request ran, and its
                    // status decides as any answer's would: recorded (as executed, not
                    // replayable: nothing of it can be replayed) or released. Kept until the
                    // lock lapsed, it would be executed again by a retry after that.
                    (&UpstreamError::Invalid { status, .. }, Some(c)) => {
                        let settled = self.settle_by_status(c, idem, status).await;
                        tracing::warn!(error = %e, route = %route.name, ?settled, "backend answer not relayable; the key settled by its status");
                        Problem::UpstreamAnswerInvalid(settled)
                    }
                    _ => {
                        let problem = self.outcome_lost(claim.as_ref(), idem).await;
                        let kept = what_became(claim.as_ref().map(|_| key_outcome(&problem)));
                        tracing::warn!(error = %e, route = %route.name, "backend answer lost; {kept}");
                        problem
                    }
                };
                if claim.is_some() {
                    ctx.count_key_outcome(key_outcome(&problem));
                }
                return self.refuse_executed(session, ctx, problem, outcome).await;
            }
        };
        let status = response.status.as_u16();
        let storable = claim.is_some() && idem.cache_statuses.contains(status);
        // The stored response is one buffer, headers then body, sized by the declared length
        // when there is one (up to 256 KiB taken before the body comes, the rest as it comes):
        // it ends as one buffer of its own length, what the store's capacity accounting charges.
        let declared = exchange
            .body_left()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n <= idem.max_response_bytes)
            .unwrap_or(0);
        // A body under a transfer coding other than chunked (`gzip, chunked`) is kept as coded,
        // and a replay, framed by its length, would have no header saying so: such an answer is
        // stored as executed but not replayable.
        let bodiless = head_request || has_no_body(status);
        let coded = storable && !bodiless && transfer_coded(&response.headers);
        if coded {
            // Said, since its retries get 409 for the record's ttl. `chunked` on two lines
            // counts as chunked twice, which is also what a backend sends that repeats the
            // header by mistake over a body chunked once: which it is cannot be told here.
            crate::warn_throttled!(
                route = %route.name,
                status,
                "backend answer under a transfer coding left once its chunks are read; stored \
                 as executed, not replayable"
            );
        }
        let mut captured = (storable && !coded)
            .then(|| stored_response(&response, &idem.replay_exclude_headers, declared, bodiless));

        let mut downstream = response;
        if let Err(e) = mark_outcome(&mut downstream, outcome) {
            // Cannot happen (a static name and value, and the head has room); were it to,
            // the answer still settles its claim below.
            tracing::error!(error = %e, "could not mark the response's outcome");
        }

        // The last bytes of the response (and the header, until a body chunk follows it) are held
        // back until the record is stored or released: a client that has the whole response and
        // retries at once always finds the outcome, never its own claim (409).
        let mut out = Downstream {
            header: Some(Box::new(downstream)),
            held: None,
            gone: false,
        };
        let mut too_large = false;
        // A response still streaming (a slow backend, a slow client) when the lock is three
        // quarters gone is settled first: stored as executed but not replayable, so a retry
        // after the lock would have lapsed gets 409, never a second execution. The body gets
        // one renewal first: a head that came just before the alarm (or after a renewal that
        // failed) would otherwise leave a small body no time at all, and a complete answer
        // would be stored as not replayable. One only, so a body dribbling in (or a client
        // taking it slowly) cannot hold the key past a lock and a half.
        //
        // The renewal and the settle are store calls, sent beside the body: chunks go on to
        // the client while a store that is slow (or down: renewals go through an open circuit)
        // keeps either out, and the last bytes wait for the settle as for any completion.
        let mut settled = false;
        let mut body_renewed = false;
        let mut store_call: Option<Pin<Box<dyn Future<Output = BodyStoreCall> + Send + '_>>> = None;
        let body_result: std::result::Result<(), UpstreamError> = loop {
            let step = async {
                let Some(chunk) = exchange.next_chunk().await? else {
                    return Ok(false);
                };
                if let Some(buf) = captured.as_mut() {
                    if buf.body_len() + chunk.len() > idem.max_response_bytes {
                        too_large = true;
                        captured = None;
                    } else {
                        buf.push_body(&chunk);
                    }
                }
                out.push(session, chunk).await;
                Ok(true)
            };
            let watched = storable && (!settled || store_call.is_some());
            let stepped = match claim.as_mut().filter(|_| watched) {
                None => step.await,
                Some(c) => {
                    let mut step = pin!(step);
                    loop {
                        let Some(call) = store_call.as_mut() else {
                            // The alarm is read before each chunk as well: `until` looks at the
                            // clock only when the step has to wait, and a body that never waits
                            // (a fast backend, a fast client) would stream past it.
                            let alarm = c.alarm();
                            let stepped = if Instant::now() < alarm {
                                upstream::until(alarm, step.as_mut()).await
                            } else {
                                Err(pingora::prelude::Elapsed)
                            };
                            match stepped {
                                Ok(stepped) => break stepped,
                                Err(_) if !body_renewed && Instant::now() < c.lock_deadline => {
                                    body_renewed = true;
                                    store_call = Some(Box::pin(body_renewal(c)));
                                }
                                Err(_) => {
                                    settled = true;
                                    store_call = Some(Box::pin(self.body_settle(*c, status)));
                                }
                            }
                            continue;
                        };
                        // The store call first: almost always waiting, it costs nothing to ask,
                        // and a body that never waits would otherwise keep it from being polled.
                        let answered = match select(call.as_mut(), step.as_mut()).await {
                            Either::Left((answered, _)) => answered,
                            Either::Right((stepped, _)) => break stepped,
                        };
                        store_call = None;
                        match answered {
                            // Stored: the rest of the body needs no more watching.
                            BodyStoreCall::Settled => break step.await,
                            BodyStoreCall::Renewal { started, answer } => {
                                let renewed = match answer {
                                    Ok(answer) => self.renewed(c, started, answer),
                                    Err(_) => {
                                        self.renewal_given_up(c, started);
                                        Renewal::Failed
                                    }
                                };
                                if !matches!(renewed, Renewal::Renewed) {
                                    settled = true;
                                    store_call = Some(Box::pin(self.body_settle(*c, status)));
                                }
                            }
                        }
                    }
                }
            };
            match stepped {
                Ok(true) => {}
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        ctx.backend_done(started);
        match store_call.take() {
            // The outcome is stored before the client has the last bytes.
            Some(call) if settled => {
                call.await;
            }
            Some(_) => {
                // A renewal still out, no longer needed.
                if let Some(c) = claim.as_mut() {
                    c.renewal_may_land(Instant::now());
                }
            }
            None => {}
        }

        if let Err(e) = body_result {
            let problem = match claim.as_ref() {
                Some(_) if settled => Problem::UpstreamOutcomeUnknown(OutcomeKept::Settled),
                // Under `settle` the status the backend gave decides, as for a head that cannot
                // be relayed: one the route stores is recorded as executed; one it does not (a
                // 503 cut off) says nothing ran, and releases the key rather than spending it.
                Some(c) if idem.on_outcome_unknown == OnOutcomeUnknown::Settle => {
                    match self.settle_by_status(c, idem, status).await {
                        AnswerSettled::Recorded => {
                            Problem::UpstreamOutcomeUnknown(OutcomeKept::Settled)
                        }
                        released => Problem::UpstreamAnswerInvalid(released),
                    }
                }
                c => self.outcome_lost(c, idem).await,
            };
            // Stored as not replayable while it streamed, before it was cut off.
            let became = claim.as_ref().map(|_| {
                if settled {
                    KeyOutcome::NotReplayable
                } else {
                    key_outcome(&problem)
                }
            });
            let kept = what_became(became);
            tracing::warn!(error = %e, route = %route.name, "backend answer cut off; {kept}");
            if let Some(became) = became {
                ctx.count_key_outcome(became);
            }
            if out.header.is_some() {
                // Nothing reached the client yet: it can still be told the truth.
                return self.refuse_executed(session, ctx, problem, outcome).await;
            }
            // The client saw a partial response; closing is the only honest signal left.
            session.set_keepalive(None);
            return Err(Error::explain(
                pingora::ErrorType::ConnectionClosed,
                "upstream response cut off",
            ));
        }
        exchange.finish();

        if let Some(claim) = claim.as_ref() {
            let key_outcome = if settled {
                KeyOutcome::NotReplayable
            } else if storable {
                let completion = match captured {
                    Some(body) if !too_large => Completion::Response(Arc::new(body.finish())),
                    _ => Completion::Unreplayable { status },
                };
                let kept = match completion {
                    Completion::Response(_) => KeyOutcome::Stored,
                    Completion::Unreplayable { .. } => KeyOutcome::NotReplayable,
                };
                self.complete(claim, completion).await;
                kept
            } else {
                self.release(claim).await;
                KeyOutcome::Released
            };
            ctx.count_key_outcome(key_outcome);
        }
        out.finish(session).await;
        if out.gone {
            // A write gave up partway (a chunk half out, say): the connection is not reused.
            session.set_keepalive(None);
            tracing::info!(route = %route.name, status, "client left before the response; outcome stored");
        }
        Ok(Handled { outcome })
    }

    /// Forwards a request that needs no idempotency bookkeeping over idemgate's own client, when
    /// it can: returns `Ok(false)` to leave the request to pingora's proxy path (an `Upgrade`,
    /// `Expect`, `CONNECT`, a chunked body or one over [`upstream::FORWARD_BODY_BYTES`]).
    async fn forward(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        upstream_index: usize,
    ) -> Result<bool> {
        let req = session.req_header();
        let headers = &req.headers;
        // A tunnel (an upgrade to WebSocket, say) carries a conversation, not a body: its reads
        // may rightly wait long, and only a body's are held to request_body_timeout.
        let tunnel = req.method == http::Method::CONNECT || headers.contains_key(header::UPGRADE);
        // A large or odd length is left to pingora to stream (or refuse).
        let raw_length = headers.get(header::CONTENT_LENGTH);
        let declared = declared_length(headers);
        let streamed = tunnel
            || headers.contains_key(header::EXPECT)
            || headers.contains_key(header::TRANSFER_ENCODING)
            || (raw_length.is_some() && declared.is_none_or(|n| n > upstream::FORWARD_BODY_BYTES));
        if streamed {
            // pingora re-frames a streamed body as chunked and would drop any other coding
            // (`gzip, chunked` would reach the backend as plain bytes that are still gzip):
            // refused, as nginx refuses a coding it does not know, and as keyed routes do.
            if !tunnel && transfer_coded(headers) {
                ctx.refused = true;
                write_problem(session, &Problem::TransferCodingUnsupported, None, None).await?;
                return Ok(true);
            }
            // pingora streams the body: each of its reads waits request_body_timeout at most,
            // as idemgate's own reads do, instead of pingora's 60 s.
            if !tunnel {
                session.set_read_timeout(Some(ctx.gen.config.request_body_timeout));
            }
            // pingora sends the head at once and the body as it comes: the request is out.
            return refused_busy(session, ctx, upstream_index).await;
        }
        let gen = ctx.gen.clone();
        let pool = &gen.pools[upstream_index];
        let config = &gen.config;

        // Held whole from the start (it is small); with no room for it now, it is left to
        // pingora to stream, as a larger one is, rather than refused.
        let mut held = self.bodies.permit();
        if !held.cover(declared.unwrap_or(0), config.max_buffered_request_bytes) {
            session.set_read_timeout(Some(config.request_body_timeout));
            return refused_busy(session, ctx, upstream_index).await;
        }
        let body = match self
            .read_body(session, upstream::FORWARD_BODY_BYTES, config, held)
            .await
        {
            Ok(body) => {
                ctx.body_ended = true;
                body
            }
            Err(problem) => {
                ctx.refused = true;
                ctx.refused_for_its_request(&problem);
                answer(session, ctx, &problem).await?;
                return Ok(true);
            }
        };
        // Only now, with the whole body in hand: a client trickling its body holds no place
        // the backend could use.
        if refused_busy(session, ctx, upstream_index).await? {
            return Ok(true);
        }
        let req = session.req_header();
        let mut head = Vec::with_capacity(512);
        upstream::request_head(req, declared, &[], &gen.scoping_headers, &mut head);
        let method = req.method.clone();
        let head_request = method == http::Method::HEAD;
        // A request that changes nothing may go again on a new connection if a pooled one was
        // closed under it before any answer; one that may change something never does.
        let safe = matches!(
            method,
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS | http::Method::TRACE
        );

        // Now, not the request's start: a body that trickled in for seconds would otherwise
        // make a pooled connection look younger than it is (idle_timeout is measured from
        // this), and the upstream round's time would include the client's upload.
        let started = Instant::now();
        let mut attempt = 0;
        let (mut exchange, response) = loop {
            attempt += 1;
            let sent = pool
                .send(&head, &body, started, attempt == 1, || true)
                .await;
            let mut exchange = match sent {
                Ok(x) => x,
                Err(e) => {
                    ctx.backend_done(started);
                    crate::warn_throttled!(error = %e, route = label(ctx), "backend unreachable");
                    answer(session, ctx, &Problem::UpstreamConnect).await?;
                    return Ok(true);
                }
            };
            match exchange
                .read_head(head_request)
                .await
                .and_then(|r| relayable(r, session.req_header()))
            {
                Ok(r) => break (exchange, r),
                Err(UpstreamError::Closed(_))
                    if safe && attempt == 1 && exchange.reused() && exchange.nothing_received() =>
                {
                    continue
                }
                Err(UpstreamError::Read(ref e))
                    if e.kind() == std::io::ErrorKind::ConnectionReset
                        && safe
                        && attempt == 1
                        && exchange.reused()
                        && exchange.nothing_received() =>
                {
                    continue
                }
                Err(e) => {
                    ctx.backend_done(started);
                    tracing::warn!(error = %e, route = label(ctx), "backend answer lost");
                    answer(session, ctx, &Problem::UpstreamAnswerLost).await?;
                    return Ok(true);
                }
            }
        };
        let mut downstream = response;
        if let Some(outcome) = ctx.outcome {
            mark_outcome(&mut downstream, outcome)?;
        }
        let mut out = Downstream {
            header: Some(Box::new(downstream)),
            held: None,
            gone: false,
        };
        loop {
            match exchange.next_chunk().await {
                Ok(Some(chunk)) => {
                    out.push(session, chunk).await;
                    if out.gone {
                        // Nobody to tell: the connection is dropped with the rest of the answer.
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    ctx.backend_done(started);
                    tracing::warn!(error = %e, route = label(ctx), "backend answer cut off");
                    if out.header.is_some() {
                        answer(session, ctx, &Problem::UpstreamAnswerLost).await?;
                        return Ok(true);
                    }
                    session.set_keepalive(None);
                    return Err(Error::explain(
                        pingora::ErrorType::ConnectionClosed,
                        "upstream response cut off",
                    ));
                }
            }
        }
        // The backend is done with it (the rest of the answer, if any, is on its way to the
        // client from idemgate's buffers).
        ctx.backend_done(started);
        let gone = out.gone;
        if !gone {
            exchange.finish();
            out.finish(session).await;
        }
        if out.gone {
            session.set_keepalive(None);
        }
        Ok(true)
    }

    async fn complete(&self, claim: &Claim<'_>, completion: Completion) {
        let (req, ttl) = (claim.req, claim.req.ttl);
        let on_fallback = self
            .fallback
            .as_deref()
            .is_some_and(|fallback| std::ptr::addr_eq(fallback, claim.store));
        let pending = || PendingCompletion {
            on_fallback,
            key: req.key.clone(),
            owner: req.owner,
            completion: completion.clone(),
            ttl,
            execution_id: claim.execution_id,
            fingerprint: req.fingerprint,
            lock_deadline: tokio::time::Instant::from_std(claim.lock_deadline),
            lapses_by: tokio::time::Instant::from_std(claim.lapses_by),
        };
        // Until the store answers, the completion is nowhere else: the retrier learns of it
        // only from a failed write. The guard dead-letters it if this future is dropped first.
        let mut out = WriteOut {
            retrier: &self.retrier,
            pending: &pending,
            answered: false,
        };
        let started = Instant::now();
        let written = claim
            .store
            .complete(&req.key, req.owner, completion.clone(), ttl)
            .await;
        out.answered = true;
        self.observe_store(StoreOp::Complete, started, written.is_err());
        let record = key::hash_label(&req.key.hash);
        match written {
            Ok(WriteOutcome::Applied) => {}
            Ok(WriteOutcome::NotOwner) => {
                // Refused: the record belongs to a newer execution now, or is gone (a failover
                // lost the claim while the backend ran). This one's answer, which its client
                // already has, goes where an operator can reconcile it; the record read says
                // which, and whether the local entry stays as the answer's only trace.
                match self.retrier.refused(pending(), claim.store).await {
                    Refusal::Landed => {}
                    Refusal::TakenOver => {
                        self.metrics.fenced_writes.inc();
                        tracing::warn!(%record, "lock lapsed and was taken over; response not stored");
                    }
                    Refusal::Recreated => {
                        self.metrics.fenced_writes.inc();
                        tracing::warn!(
                            %record,
                            execution_id = claim.execution_id,
                            "the record was lost while the backend ran (a failover, a restart without persistence, a purge) and a retry created it again, running the key again under another execution id; response not stored"
                        );
                    }
                    Refusal::Gone => {
                        tracing::warn!(%record, "the record was gone (a failover lost the claim?); response not stored, replayed here only");
                    }
                    Refusal::Unread => {
                        tracing::warn!(%record, "the store refused the response and its record could not be read; response not stored");
                    }
                }
            }
            Err(e) => {
                crate::warn_throttled!(%record, error = %e, "storing the response failed; retrying");
                self.retrier.submit(pending());
            }
        }
    }

    /// What becomes of a request that was sent and whose answer was lost before its status
    /// came, and the problem that tells its client. Without a claim (forwarded unprotected by
    /// `on_unavailable: pass`) nothing stops a retry. With one, the key stays locked until the
    /// lock lapses, after which a retry runs it again under the same execution id; or, under
    /// `on_outcome_unknown: settle`, it is recorded now as executed, not replayable, under the
    /// client's 504, and never runs again.
    async fn outcome_lost(&self, claim: Option<&Claim<'_>>, idem: &RouteIdempotency) -> Problem {
        match claim {
            None => Problem::UpstreamAnswerLost,
            Some(c) if idem.on_outcome_unknown == OnOutcomeUnknown::Settle => {
                self.complete(c, Completion::Unreplayable { status: 504 })
                    .await;
                Problem::UpstreamOutcomeUnknown(OutcomeKept::Settled)
            }
            // Kept until the lock lapses: the answer says when a retry can run.
            Some(c) => Problem::UpstreamOutcomeUnknown(OutcomeKept::Locked {
                retry_after: c.lapses_by.saturating_duration_since(Instant::now()),
            }),
        }
    }

    /// Settles a claim by the status of an answer that cannot be kept (not relayable, or cut
    /// off under `settle`): a status the route stores says the request ran, and is recorded as
    /// executed, not replayable; any other releases the key (or leaves it locked until its lock
    /// lapses, when the store does not take the release).
    async fn settle_by_status(
        &self,
        claim: &Claim<'_>,
        idem: &RouteIdempotency,
        status: u16,
    ) -> AnswerSettled {
        if idem.cache_statuses.contains(status) {
            self.complete(claim, Completion::Unreplayable { status })
                .await;
            return AnswerSettled::Recorded;
        }
        match self.release(claim).await {
            None => AnswerSettled::Released,
            Some(retry_after) => AnswerSettled::Locked { retry_after },
        }
    }

    /// Extends the claim's lock by claiming the record again as its owner, which the stores
    /// treat as a renewal.
    async fn renew(&self, claim: &mut Claim<'_>) -> Renewal {
        let started = Instant::now();
        let answer = claim.store.renew(claim.req).await;
        self.renewed(claim, started, answer)
    }

    /// Takes the store's answer to a renewal sent at `started` into `claim`.
    fn renewed(
        &self,
        claim: &mut Claim<'_>,
        started: Instant,
        answer: std::result::Result<ClaimOutcome, StoreError>,
    ) -> Renewal {
        let answered = self.observe_store(StoreOp::Claim, started, answer.is_err());
        let record = key::hash_label(&claim.req.key.hash);
        if !matches!(answer, Ok(ClaimOutcome::Existing(_))) {
            // Renewed, or failed where the renewal may still have landed.
            claim.lapses_by = answered + claim.req.lock_ttl;
        }
        match answer {
            Ok(ClaimOutcome::Acquired { .. }) => {
                claim.lock_deadline = started + claim.req.lock_ttl;
                self.metrics.lock_renewals.inc();
                tracing::info!(%record, "the backend is still answering; lock renewed");
                Renewal::Renewed
            }
            Ok(ClaimOutcome::Existing(_)) => {
                tracing::warn!(%record, "lock taken over while the backend's answer was awaited");
                Renewal::TakenOver
            }
            Err(e) => {
                crate::warn_throttled!(%record, error = %e, "renewing the lock failed");
                Renewal::Failed
            }
        }
    }

    /// Renews `claim`'s lock while the backend's answer (`head`) is still awaited, giving the
    /// renewal up for the answer if it comes first (`Err(answer)`): a store that is slow to
    /// answer, or down (renewals are sent through an open circuit), does not hold the answer
    /// up. A renewal given up on may still land and start a lock then.
    async fn renew_while<F: Future>(
        &self,
        claim: &mut Claim<'_>,
        head: Pin<&mut F>,
    ) -> std::result::Result<Renewal, F::Output> {
        let raced = {
            let renewal = pin!(self.renew(claim));
            match select(head, renewal).await {
                Either::Left((answer, _)) => Err(answer),
                Either::Right((renewal, _)) => Ok(renewal),
            }
        };
        if raced.is_err() {
            claim.renewal_may_land(Instant::now());
        }
        raced
    }

    /// Notes a renewal sent at `started` that the store did not answer in its time: a failed
    /// call (counted, and logged, as a renewal the store failed) that may still land and start
    /// a lock then.
    fn renewal_given_up(&self, claim: &mut Claim<'_>, started: Instant) {
        let answered = self.observe_store(StoreOp::Claim, started, true);
        claim.renewal_may_land(answered);
        tracing::warn!(
            record = %key::hash_label(&claim.req.key.hash),
            "renewing the lock got no answer in time; storing the response as not replayable"
        );
    }

    /// [`Gate::settle`] on a copy of the claim, for a call sent beside the body.
    async fn body_settle(&self, claim: Claim<'_>, status: u16) -> BodyStoreCall {
        self.settle(&claim, status).await;
        BodyStoreCall::Settled
    }

    /// Stores a response that is still streaming as executed but not replayable, before the
    /// claim's lock lapses.
    async fn settle(&self, claim: &Claim<'_>, status: u16) {
        tracing::warn!(
            record = %key::hash_label(&claim.req.key.hash),
            status,
            "response still streaming as the lock runs out; stored as executed, not replayable"
        );
        self.metrics.settled_streaming.inc();
        self.complete(claim, Completion::Unreplayable { status })
            .await;
    }

    /// Releases `claim`. Returns how long the key stays locked when the store did not take the
    /// release (until the lock lapses), `None` once it is released. (A claim another request
    /// took over is no longer this one's to release: `None`.)
    async fn release(&self, claim: &Claim<'_>) -> Option<Duration> {
        let started = Instant::now();
        let written = claim.store.release(&claim.req.key, claim.req.owner).await;
        self.observe_store(StoreOp::Release, started, written.is_err());
        match written {
            Ok(WriteOutcome::Applied) => None,
            Ok(WriteOutcome::NotOwner) => {
                // Refused: another request took the lock over (fenced), or the record is gone
                // (purged, evicted, lost in a failover), which fenced nothing: the record says.
                if matches!(claim.store.get(&claim.req.key).await, Ok(Some(_))) {
                    self.metrics.fenced_writes.inc();
                }
                None
            }
            Err(e) => {
                crate::warn_throttled!(record = %key::hash_label(&claim.req.key.hash), error = %e, "releasing the claim failed; it lapses at lock_ttl");
                Some(claim.lapses_by.saturating_duration_since(Instant::now()))
            }
        }
    }

    /// Counts a store operation that began at `started` and ended now; returns now (when the
    /// store's answer came).
    fn observe_store(&self, op: StoreOp, started: Instant, failed: bool) -> Instant {
        let answered = Instant::now();
        let h = &self.store_ops[op as usize];
        h.duration
            .observe(answered.saturating_duration_since(started).as_secs_f64());
        if failed {
            h.errors.inc();
        }
        answered
    }

    /// Writes a replay: `head` (from [`replay_head`]), then the stored body unless the request
    /// is a `HEAD`.
    async fn replay(
        &self,
        session: &mut Session,
        mut resp: ResponseHeader,
        stored: &StoredResponse,
    ) -> Result<()> {
        let head_only = session.req_header().method == http::Method::HEAD;
        // A response with no body by definition replays the Content-Length it was stored with
        // (a HEAD's is the length of what a GET would get; a 204 has none).
        if !(head_only || has_no_body(stored.status)) {
            resp.insert_header(header::CONTENT_LENGTH, stored.body().len())?;
        }
        frame_for_client(session, &mut resp);
        // `Date` (a replay is a new message) is pingora's: it sets its cached one on every
        // final response head it writes.
        resp.insert_header(RESULT_HEADER, Outcome::Hit.as_str())?;
        resp.insert_header(REPLAYED_HEADER, "true")?;
        session.write_response_header(Box::new(resp), false).await?;
        let body = if head_only {
            Bytes::new()
        } else {
            stored.body_bytes()
        };
        session.write_response_body(Some(body), true).await?;
        Ok(())
    }

    /// Answers with a proxy-made problem; the request is not forwarded.
    async fn refuse(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        problem: Problem,
    ) -> Result<Option<Handled>> {
        let outcome = problem.outcome();
        self.refuse_executed(session, ctx, problem, outcome)
            .await
            .map(Some)
    }

    /// Answers a problem of an execution (`MISS`, or `DEGRADED` when the store could not
    /// protect it), marked with that execution's outcome rather than the problem's own.
    async fn refuse_executed(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        problem: Problem,
        outcome: Outcome,
    ) -> Result<Handled> {
        // A client gone before the answer is out still had this outcome (its log line and
        // metrics say so); its connection is not used again. The answer is framed by its
        // length, so nothing written after the failure could make it look whole.
        if write_problem(session, &problem, Some(outcome), ctx.docs())
            .await
            .is_err()
        {
            session.set_keepalive(None);
        }
        Ok(Handled { outcome })
    }
}

/// A store call sent while a response's body streams (see [`Gate::execute`]).
enum BodyStoreCall {
    /// The lock's renewal, sent at `started`; `Err` when given up on (it may still land).
    Renewal {
        started: Instant,
        answer: std::result::Result<
            std::result::Result<ClaimOutcome, StoreError>,
            pingora::prelude::Elapsed,
        >,
    },
    /// The response was stored as executed but not replayable.
    Settled,
}

/// Renews `claim`'s lock while its body streams, giving up at half of what is left of the
/// lock: a renewal that fails slowly must still leave the settle its time. Sent from copies
/// of the claim's references, so the body goes on meanwhile.
fn body_renewal<'a>(claim: &Claim<'a>) -> impl Future<Output = BodyStoreCall> + Send + 'a {
    let (store, req) = (claim.store, claim.req);
    let now = Instant::now();
    let limit = now + claim.lock_deadline.saturating_duration_since(now) / 2;
    async move {
        let started = Instant::now();
        let answer = upstream::until(limit, store.renew(req)).await;
        BodyStoreCall::Renewal { started, answer }
    }
}

/// What became of an attempt to renew a claim's lock.
enum Renewal {
    /// The lock holds for another `lock_ttl`.
    Renewed,
    /// Another request holds the key now.
    TakenOver,
    /// The store did not answer; the lock holds until its deadline as before.
    Failed,
}

/// The pause before trying a failed renewal again: a quarter of what is left of the lock,
/// between 50 ms and 1 s, so a store back within the lock's life is tried in time; past the
/// lock's deadline, 250 ms, so a store back takes the lapsed lock back before a retry does.
fn renewal_pause(lock_deadline: Instant) -> Duration {
    let left = lock_deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Duration::from_millis(250);
    }
    (left / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Marks a backend's answer on a route with idempotency with its `outcome`. A backend's own
/// `Idempotent-Replayed` (a framework with idempotency keys of its own, a gateway behind) does
/// not go with it: on such a route that header is idemgate's to say, on its replays only.
fn mark_outcome(resp: &mut ResponseHeader, outcome: Outcome) -> Result<()> {
    resp.remove_header(REPLAYED_HEADER);
    resp.insert_header(RESULT_HEADER, outcome.as_str())?;
    Ok(())
}

/// Whether the request's `Connection` header names a header that must reach the backend:
/// `Host` (without it an HTTP/1.1 request is invalid) or a forwarding header a load balancer
/// set, which pingora refuses to drop. Stripped as hop-by-hop on one path and refused on the
/// other, such a request would fare differently by how its body is framed; it is refused on
/// every path, as not valid HTTP. So is one naming a header of `scoping` (the key, tenant and
/// scope headers): its record would be chosen by a value the backend never sees, and an
/// answer made without the principal stored under the principal's record.
fn nominates_protected(headers: &http::HeaderMap, scoping: &[HeaderName]) -> bool {
    const PROTECTED: [&[u8]; 4] = [
        b"host",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
    ];
    upstream::each_connection_token(headers.get_all(header::CONNECTION)).any(|token| {
        token.starts_with(b":")
            || PROTECTED.iter().any(|p| token.eq_ignore_ascii_case(p))
            || scoping
                .iter()
                .any(|h| token.eq_ignore_ascii_case(h.as_str().as_bytes()))
    })
}

/// What became of the key of a request refused after it was sent under a claim, for
/// `idemgate_key_outcomes_total` and its log line.
fn key_outcome(problem: &Problem) -> KeyOutcome {
    match problem {
        Problem::UpstreamAnswerInvalid(AnswerSettled::Recorded) => KeyOutcome::NotReplayable,
        Problem::UpstreamAnswerInvalid(_) => KeyOutcome::Released,
        Problem::UpstreamOutcomeUnknown(OutcomeKept::Settled) => KeyOutcome::Settled,
        _ => KeyOutcome::Unknown,
    }
}

/// What became of the key of a lost or cut-off answer (`None`: there was no claim), for its
/// log line.
fn what_became(outcome: Option<KeyOutcome>) -> &'static str {
    match outcome {
        None => "no claim guards a retry",
        Some(KeyOutcome::Unknown) => "claim kept until lock_ttl",
        Some(KeyOutcome::Settled) => {
            "recorded as executed, not replayable (on_outcome_unknown: settle)"
        }
        Some(KeyOutcome::NotReplayable) => "stored as executed, not replayable",
        Some(KeyOutcome::Released | KeyOutcome::Unreachable) => {
            "released: a status the route does not store (on_outcome_unknown: settle)"
        }
        Some(KeyOutcome::Stored) => "stored",
    }
}

/// The client side of an executed request: writes lag one chunk behind the backend.
struct Downstream {
    header: Option<Box<ResponseHeader>>,
    held: Option<Bytes>,
    gone: bool,
}

impl Downstream {
    /// Takes a new chunk, sending the one held before it (and the header, first time).
    async fn push(&mut self, session: &mut Session, chunk: Bytes) {
        if let Some(prev) = self.held.replace(chunk) {
            self.write(session, Some(prev), false).await;
        }
    }

    /// Sends what is held and ends the response.
    async fn finish(&mut self, session: &mut Session) {
        let last = self.held.take();
        self.write(session, last, true).await;
    }

    async fn write(&mut self, session: &mut Session, data: Option<Bytes>, end: bool) {
        if self.gone {
            return;
        }
        if let Some(mut header) = self.header.take() {
            frame_for_client(session, &mut header);
            if session.write_response_header(header, false).await.is_err() {
                self.gone = true;
                return;
            }
        }
        if data.is_some() || end {
            self.gone = session.write_response_body(data, end).await.is_err();
        }
    }
}

/// Fits a backend's response head to the client's HTTP version before it is written. An
/// HTTP/1.0 client knows no transfer codings (RFC 9112 §6.1): pingora would chunk the body
/// for it all the same, and the client would take the chunk sizes for body bytes. Without
/// `Transfer-Encoding` (a `Content-Length` never stands beside it) the body goes as it is,
/// ended by closing the connection. A body the backend ended by closing (no length, no
/// coding) goes chunked to an HTTP/1.1 client, which keeps its connection, as on pingora's
/// path; an HTTP/1.0 client is told the connection closes after it. Every answer written to
/// the client comes through here: idemgate's own client's, pingora's streaming path's and
/// replays.
fn frame_for_client(session: &mut Session, header: &mut ResponseHeader) {
    without_no_content_framing(header);
    // An answer with no body by definition needs no framing, nor a close to end it.
    let bodiless = bodiless(session.req_header(), header);
    let old_client = session.req_header().version == http::Version::HTTP_10;
    let coded = header.headers.contains_key(header::TRANSFER_ENCODING);
    if old_client && coded {
        header.remove_header(&header::TRANSFER_ENCODING);
        if !bodiless {
            session.set_keepalive(None);
        }
    } else if !(bodiless || coded || header.headers.contains_key(header::CONTENT_LENGTH)) {
        if old_client {
            session.set_keepalive(None);
        } else {
            // A fixed header name and value: cannot fail.
            let _ = header.insert_header(header::TRANSFER_ENCODING, "chunked");
        }
    }
}

/// Whether `error` (or an error it wraps) carries the raw bytes pingora read, as its parse
/// errors do in their context (`buf: ...`).
fn quotes_bytes(error: &Error) -> bool {
    chain(error).any(quoting)
}

fn quoting(e: &Error) -> bool {
    e.context
        .as_ref()
        .is_some_and(|c| c.as_str().contains("buf: "))
}

/// `error`, then each pingora error it wraps.
fn chain(error: &Error) -> impl Iterator<Item = &Error> {
    std::iter::successors(Some(error), |e| {
        e.cause.as_ref()?.downcast_ref::<Box<Error>>().map(|b| &**b)
    })
}

/// A pingora error as pingora writes it, but for the bytes its parse errors quote (`buf: ...`),
/// a client's or a backend's headers and body, which do not belong in the log.
struct Redacted<'a>(&'a Error);

impl std::fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut previous: Option<&Error> = None;
        for e in chain(self.0) {
            if previous.is_some() {
                f.write_str(" cause: ")?;
            }
            if previous.is_none_or(|p| p.esource != e.esource) {
                f.write_str(e.esource.as_str())?;
            }
            if previous.is_none_or(|p| p.etype != e.etype) {
                write!(f, " {}", e.etype.as_str())?;
            }
            match &e.context {
                Some(_) if quoting(e) => f.write_str(" context: (the bytes read, not logged)")?,
                Some(c) => write!(f, " context: {c}")?,
                None => {}
            }
            // A cause of another kind (an I/O error, a parser's) ends the chain.
            if let Some(cause) = e.cause.as_ref().filter(|c| !c.is::<Box<Error>>()) {
                write!(f, " cause: {cause}")?;
            }
            previous = Some(e);
        }
        Ok(())
    }
}

/// Removes the headers of an answer that belong to its connection (RFC 9110 §7.6.1): those
/// `Connection` names and the hop-by-hop ones (`Keep-Alive`, `Proxy-Connection`, `TE`,
/// `Trailer`, `Upgrade`), as idemgate's own client does; pingora writes `Connection` and the
/// framing itself, so those stay for it (a framing header `Connection` names too is left: it
/// frames the body pingora relays).
fn drop_connection_headers(head: &mut ResponseHeader) {
    let named: Vec<HeaderName> =
        upstream::each_connection_token(head.headers.get_all(header::CONNECTION))
            .filter_map(|t| HeaderName::from_bytes(t).ok())
            .filter(|n| {
                !matches!(
                    n.as_str(),
                    "connection" | "content-length" | "transfer-encoding"
                )
            })
            .collect();
    for name in named {
        head.remove_header(&name);
    }
    for name in upstream::RESPONSE_HOP_BY_HOP {
        if *name != "connection" {
            head.remove_header(*name);
        }
    }
}

/// `head`, unless it answers an HTTP/1.0 request (`req`) with a body that stays under a
/// transfer coding once its chunks are read (`Transfer-Encoding: gzip, chunked`): such a client
/// knows no transfer codings (RFC 9112 §6.1), and would take the coded bytes, sent bare, for
/// the answer. Refused with its status, as any answer that cannot be relayed: on a route that
/// stores the status the key is recorded as executed, not replayable.
fn relayable(head: ResponseHeader, req: &RequestHeader) -> Result<ResponseHeader, UpstreamError> {
    match coding_beyond_chunked(&head, req) {
        None => Ok(head),
        Some(_) => Err(UpstreamError::Invalid {
            status: head.status.as_u16(),
            what: "a transfer coding an HTTP/1.0 client cannot take",
        }),
    }
}

/// For an HTTP/1.0 request, the first transfer coding of `head` other than `chunked`, when the
/// answer has a body (not a HEAD's, a 1xx, a 204 or a 304).
fn coding_beyond_chunked(head: &ResponseHeader, req: &RequestHeader) -> Option<String> {
    if req.version != http::Version::HTTP_10 || bodiless(req, head) {
        return None;
    }
    upstream::coding_left_after_chunked(&head.headers)
        .map(|c| String::from_utf8_lossy(c).into_owned())
}

/// A 204 without the framing it may not carry (RFC 9110 §8.6, RFC 9112 §6.1): one that
/// declares a length or a coding, passed on or replayed, would have a lenient client framing by
/// it take the start of its next answer for this one's body.
fn without_no_content_framing(header: &mut ResponseHeader) {
    if header.status == http::StatusCode::NO_CONTENT {
        header.remove_header(&header::CONTENT_LENGTH);
        header.remove_header(&header::TRANSFER_ENCODING);
    }
}

/// A request's declared body length, read as pingora frames the body by it: every
/// `Content-Length` line, each a comma-separated list of digits, all agreeing (`5, 5` is 5).
/// `None` when there is none, or none that pingora would have let through.
fn declared_length(headers: &http::HeaderMap) -> Option<usize> {
    let mut declared = None;
    for line in headers.get_all(header::CONTENT_LENGTH) {
        for part in line.as_bytes().split(|&b| b == b',') {
            let digits = part.trim_ascii();
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let n: usize = std::str::from_utf8(digits).ok()?.parse().ok()?;
            if declared.is_some_and(|d| d != n) {
                return None;
            }
            declared = Some(n);
        }
    }
    declared
}

/// [`write_problem`] with the request's own outcome and docs link.
async fn answer(session: &mut Session, ctx: &RequestCtx, problem: &Problem) -> Result<()> {
    write_problem(session, problem, ctx.outcome, ctx.docs()).await
}

/// Takes a place among the requests out to `upstream` for a forwarded request about to go
/// out, held in `ctx`. With none free, answers 503 `upstream-busy` and returns `true` (the
/// request is answered), as [`Gate::forward`] returns.
async fn refused_busy(
    session: &mut Session,
    ctx: &mut RequestCtx,
    upstream: usize,
) -> Result<bool> {
    if let Some(slot) = ctx.gen.pools[upstream].slot() {
        ctx.upstream_slot = Some(slot);
        return Ok(false);
    }
    let busy = Problem::UpstreamBusy {
        retry_after: Duration::from_secs(1),
    };
    ctx.refused = true;
    ctx.refused_for_its_request(&busy);
    answer(session, ctx, &busy).await?;
    Ok(true)
}

/// Writes `problem` as problem+json, with `X-Idempotent-Result` when on an idempotent route.
async fn write_problem(
    session: &mut Session,
    problem: &Problem,
    outcome: Option<Outcome>,
    docs: Option<&http::HeaderValue>,
) -> Result<()> {
    let body = problem.body();
    let mut resp = ResponseHeader::build(problem.status(), Some(5))?;
    resp.insert_header(header::CONTENT_TYPE, "application/problem+json")?;
    // An answer about this attempt, not about the resource: no cache may hand it to another.
    resp.insert_header(header::CACHE_CONTROL, "no-store")?;
    resp.insert_header(header::CONTENT_LENGTH, body.len())?;
    if let Some(o) = outcome {
        resp.insert_header(RESULT_HEADER, o.as_str())?;
        // An idempotent route's answer: where the API documents its keys (the IETF draft's
        // alternative to a link in the body).
        if let Some(link) = docs {
            resp.insert_header(header::LINK, link.clone())?;
        }
    }
    if let Some(secs) = problem.retry_after_secs() {
        resp.insert_header(header::RETRY_AFTER, secs)?;
    }
    let unread = !session.is_body_done();
    if unread {
        // The body was not (fully) read: the connection cannot carry another request.
        session.set_keepalive(None);
    }
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await?;
    if unread && !matches!(problem, Problem::RequestTimeout) {
        linger(session).await;
    }
    Ok(())
}

/// Reads and drops what the client still sends of a request body that a refusal came before
/// (a 413 from the declared length, a bad key, no route), for [`LINGER_TIME`] and
/// [`LINGER_BYTES`] at most, so the close that follows finds nothing unread. Closed with bytes
/// unread, the connection is reset: a client still sending fails its upload (`EPIPE`,
/// `ECONNRESET`) before it reads the 413 or 400 that says why (what nginx's lingering close
/// avoids). A client slow to send (a 408) is not waited for, nor one that asked to be invited
/// (`Expect: 100-continue`) and has sent nothing: told no, it sends nothing more.
async fn linger(session: &mut Session) {
    // Waiting to be invited: nothing of the body came (an HTTP/1.0 client, which knows no
    // interim answers, sends it unasked).
    let req = session.req_header();
    let uninvited = req.version >= http::Version::HTTP_11
        && req
            .headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
        && session.body_bytes_read() == 0;
    if uninvited {
        return;
    }
    let deadline = Instant::now() + LINGER_TIME;
    let mut left = LINGER_BYTES;
    while !session.is_body_done() {
        match upstream::until(deadline, session.read_request_body()).await {
            Ok(Ok(Some(chunk))) if chunk.len() < left => left -= chunk.len(),
            _ => break,
        }
    }
}

/// Whether the request target is one routes can be matched against: origin-form (`/orders`),
/// absolute-form (`http://host/orders`), or `*` (`OPTIONS *`). pingora reads any other target
/// (`orders`, `x/../orders`) as the path `/` yet forwards its bytes as sent, so a backend that
/// resolves them could run an idempotent route's handler past its key check.
fn is_routable_target(req: &RequestHeader) -> bool {
    let raw = req.raw_path();
    if raw.first() == Some(&b'/') || raw == b"*" {
        return true;
    }
    // Absolute-form: `scheme://`, whose path pingora does read.
    let Some(colon) = raw.windows(3).position(|w| w == b"://") else {
        return false;
    };
    let scheme = &raw[..colon];
    scheme.first().is_some_and(u8::is_ascii_alphabetic)
        && scheme
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
}

/// `post`, `Get`, …: an extension method as far as HTTP goes (methods are case-sensitive), but one
/// a case-folding backend would run as the standard method, past every route that lists it.
fn is_standard_method_in_other_case(method: &http::Method) -> bool {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    let m = method.as_str();
    m.bytes().any(|b| b.is_ascii_lowercase()) && STANDARD.iter().any(|s| s.eq_ignore_ascii_case(m))
}

/// Starts the stored copy of a response, ready for its body (`body_hint` bytes expected). Only
/// end-to-end headers are kept, in the order received: no hop-by-hop headers (the
/// listed ones, those `Connection` names, and every `Proxy-*` header: they describe one hop or
/// one intermediary's handling of the original message, which a replay is not), no framing
/// (`Content-Length` is set at replay, except on a response that has no body by definition —
/// to a `HEAD`, or a 204 or 304 — whose own `Content-Length`, if any, is kept as sent), no
/// `Date` (a replay is a new message), and none of `replay_exclude_headers`.
fn stored_response(
    resp: &ResponseHeader,
    exclude: &[HeaderName],
    body_hint: usize,
    bodiless: bool,
) -> ResponseBuilder {
    let connection_named = upstream::ConnectionNamed::of(resp.headers.get_all(header::CONNECTION));
    let kept = || {
        resp.headers
            .iter()
            .filter(|(name, _)| {
                (is_replayable(name.as_str(), exclude)
                    || (bodiless && *name == header::CONTENT_LENGTH))
                    && !connection_named.names(name.as_str().as_bytes())
            })
            .map(|(name, value)| (name.as_str(), value.as_bytes()))
    };
    ResponseBuilder::new(resp.status.as_u16(), kept, body_hint)
}

/// Whether `Transfer-Encoding` lists a coding other than chunked, or chunked twice: a body
/// read from such a message (request or answer) still carries a coding.
fn transfer_coded(headers: &http::HeaderMap) -> bool {
    upstream::coding_left_after_chunked(headers).is_some()
}

/// Gives an HTTP/1.0 request that came without `Host` one (it goes on as HTTP/1.1, which
/// requires it, by idemgate's client and pingora's alike): its absolute-form target's host,
/// else the upstream's first configured address.
fn add_host(session: &mut Session, pool: &UpstreamPool) -> Result<()> {
    let req = session.req_header_mut();
    let host = upstream::target_authority(req.raw_path())
        .and_then(|authority| HeaderValue::from_bytes(authority).ok())
        .unwrap_or_else(|| pool.host.clone());
    req.insert_header(header::HOST, host)
}

/// The head of a replay of `stored`: its status and stored headers, byte for byte. Hop-by-hop
/// and framing headers were dropped when the record was stored; only the route's exclusions are
/// checked again, since they can change: the running config's hold even for records stored
/// under an older one (e.g. before `Set-Cookie` was excluded again). `None` when the record
/// cannot be written as HTTP (damaged in the store, or written by something else): the caller
/// refuses rather than answer with a broken message.
fn replay_head(stored: &StoredResponse, exclude: &[HeaderName]) -> Option<ResponseHeader> {
    let mut resp = ResponseHeader::build(stored.status, Some(stored.header_count() + 4)).ok()?;
    for (name, value) in stored.shared_headers() {
        if is_excluded(name, exclude) {
            continue;
        }
        let value = HeaderValue::from_maybe_shared(value).ok()?;
        // The stored spelling (lower case) goes out as it is; pingora checks the name.
        resp.append_header(name.to_owned(), value).ok()?;
    }
    Some(resp)
}

/// Whether `head`, answering `req`, has no body whatever its headers say: the answer to a HEAD,
/// a 1xx, a 204 or a 304.
fn bodiless(req: &RequestHeader, head: &ResponseHeader) -> bool {
    req.method == http::Method::HEAD
        || has_no_body(head.status.as_u16())
        || head.status.is_informational()
}

/// Whether a response with this status has no body whatever its headers say (RFC 9110 §6.4.1;
/// 1xx answers are never stored).
fn has_no_body(status: u16) -> bool {
    status == 204 || status == 304
}

/// Whether a response header (lower-case name) may be stored and replayed: not hop-by-hop (see
/// [`stored_response`]), not framing or `Date`, not excluded by the route.
fn is_replayable(name: &str, exclude: &[HeaderName]) -> bool {
    !upstream::HOP_BY_HOP.contains(&name)
        && !name.starts_with("proxy-")
        && name != "content-length"
        && name != "date"
        && !is_excluded(name, exclude)
}

/// Whether the route's `replay_exclude_headers` names this (lower-case) header.
fn is_excluded(name: &str, exclude: &[HeaderName]) -> bool {
    exclude.iter().any(|e| e.as_str() == name)
}

/// A pingora upstream error from which the backend can have received nothing: the connection
/// (or its TLS handshake) never came up.
fn is_connect_failure(etype: &pingora::ErrorType) -> bool {
    use pingora::ErrorType::*;
    matches!(
        etype,
        ConnectTimedout
            | ConnectRefused
            | ConnectNoRoute
            | TLSWantX509Lookup
            | TLSHandshakeFailure
            | TLSHandshakeTimedout
            | InvalidCert
            | HandshakeError
            | ConnectError
            | BindError
            | SocketError
            | ConnectProxyFailure
    )
}

fn label(ctx: &RequestCtx) -> &str {
    ctx.route
        .and_then(|i| ctx.gen.config.routes.get(i))
        .map_or("-", |r| r.name.as_str())
}

#[async_trait]
impl ProxyHttp for Gate {
    type CTX = RequestCtx;

    /// No downstream modules: pingora's default adds a response-compression module (disabled)
    /// whose context is built and whose filters run on every request.
    fn init_downstream_modules(&self, _modules: &mut pingora::modules::http::HttpModules) {}

    fn new_ctx(&self) -> Self::CTX {
        RequestCtx {
            gen: self.current.load_full(),
            started: Instant::now(),
            route: None,
            upstream: None,
            outcome: None,
            refused: false,
            record_label: None,
            execution_id: None,
            upstream_slot: None,
            body_ended: false,
            logged: false,
            _guard: InFlightGuard::new(self.in_flight.clone()),
        }
    }

    /// In this phase the route is matched and keyed requests are answered whole (replayed,
    /// refused or executed). Returns `Ok(true)` when the response has been written, `Ok(false)`
    /// to let pingora forward the request untouched.
    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        crate::headguard::request_started(session);
        let gen = ctx.gen.clone();
        // Every write to this client (answers of all kinds, replays, pingora's forwarding) gives
        // up once the client has taken nothing for this long; no timer unless a write waits.
        session.set_write_timeout(Some(gen.config.response_send_timeout));
        let req = session.req_header();
        if is_standard_method_in_other_case(&req.method) {
            let problem = Problem::MethodCase;
            ctx.outcome = Some(problem.outcome());
            answer(session, ctx, &problem).await?;
            return Ok(true);
        }
        // HTTP/1.1 requires Host (RFC 9112 §3.2: a server answers 400 without it).
        let has_host = req.headers.contains_key(header::HOST);
        if !is_routable_target(req)
            || (req.version == http::Version::HTTP_11 && !has_host)
            || nominates_protected(&req.headers, &gen.scoping_headers)
        {
            // No route is known, so no idempotency header; the connection closes, as the
            // problem's detail says for every request that is not valid HTTP.
            session.set_keepalive(None);
            ctx.refused = true;
            write_problem(session, &Problem::RequestMalformed, None, None).await?;
            return Ok(true);
        }
        // A request with a chunked body is its connection's last. idemgate's HTTP/1 parser
        // takes a bare LF inside a chunk extension as part of the extension; a front end that
        // ends the line there frames the body otherwise, and the bytes it sends after what it
        // takes for the body's end would be read here as a request of their own: a smuggled
        // one, with any tenant and principal it names. Bytes after the body, in the same read
        // or a later one, are never read as a request.
        if req.headers.contains_key(header::TRANSFER_ENCODING) {
            session.set_keepalive(None);
        }
        let req = session.req_header();
        match gen.config.match_route(&req.method, req.uri.path()) {
            RouteMatch::NoRoute => {
                ctx.refused = true;
                write_problem(session, &Problem::NoRoute, None, None).await?;
                Ok(true)
            }
            RouteMatch::Forward { route, upstream } => {
                ctx.route = route;
                ctx.upstream = Some(upstream);
                if req.headers.contains_key(&gen.config.idempotency.key_header) {
                    gen.route_metrics(route).count_unprotected_key();
                }
                if !has_host {
                    add_host(session, &gen.pools[upstream])?;
                }
                self.forward(session, ctx, upstream).await
            }
            RouteMatch::Idempotent(i) => {
                let route = &gen.config.routes[i];
                ctx.route = Some(i);
                ctx.upstream = Some(route.upstream);
                if !has_host {
                    add_host(session, &gen.pools[route.upstream])?;
                }
                let Some(idem) = route.idempotency.as_ref() else {
                    return self.forward(session, ctx, route.upstream).await;
                };
                match self.handle_keyed(session, ctx, route, idem).await? {
                    Some(handled) => {
                        ctx.outcome = Some(handled.outcome);
                        Ok(true)
                    }
                    None => self.forward(session, ctx, route.upstream).await,
                }
            }
        }
    }

    /// Removes a client's own `X-Idempotency-Id` from the requests pingora forwards (upgrades,
    /// streamed bodies): only the proxy sets that header, on claimed requests, which never
    /// take this path. A backend's unique index on it is the last line of defence.
    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        upstream_request.remove_header(EXECUTION_ID_HEADER);
        // pingora removes hop-by-hop headers and writes its own framing, but passes the same
        // names spelt with `_` for `-`, which CGI-style backends read as the real ones; so are
        // the headers that chose the record (a tenant the backend would read otherwise).
        let spoofed: Vec<HeaderName> = upstream_request
            .headers
            .keys()
            .filter(|n| {
                upstream::is_underscore_spoof(n.as_str().as_bytes(), &ctx.gen.scoping_headers)
            })
            .cloned()
            .collect();
        for name in spoofed {
            upstream_request.remove_header(&name);
        }
        Ok(())
    }

    /// Picks the next address of the matched route's upstream (round robin).
    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut Self::CTX,
    ) -> Result<Box<HttpPeer>> {
        let upstream = ctx.upstream.ok_or_else(|| {
            Error::explain(pingora::ErrorType::InternalError, "no upstream chosen")
        })?;
        let pool = &ctx.gen.pools[upstream];
        Ok(Box::new(pool.peers[pool.pick()].clone()))
    }

    /// Holds answers on pingora's streaming path to what idemgate's own client relays (see
    /// [`upstream::unrelayable_status`], [`drop_connection_headers`]); marks forwarded
    /// responses of idempotent routes (`BYPASS`).
    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        let status = upstream_response.status.as_u16();
        if let Some(fault) = upstream::unrelayable_status(status, session.is_upgrade_req()) {
            let mut e = Error::explain(pingora::ErrorType::InvalidHTTPHeader, fault);
            e.esource = pingora::ErrorSource::Upstream;
            return Err(e);
        }
        if upstream_response.status != http::StatusCode::SWITCHING_PROTOCOLS {
            drop_connection_headers(upstream_response);
        }
        if let Some(coding) = coding_beyond_chunked(upstream_response, session.req_header()) {
            let mut e = Error::explain(
                pingora::ErrorType::InvalidHTTPHeader,
                format!("an answer under the transfer coding {coding} for an HTTP/1.0 client"),
            );
            e.esource = pingora::ErrorSource::Upstream;
            return Err(e);
        }
        frame_for_client(session, upstream_response);
        if let Some(outcome) = ctx.outcome {
            mark_outcome(upstream_response, outcome)?;
        }
        Ok(())
    }

    /// Notes a request body pingora's streaming path read to its end.
    async fn request_body_filter(
        &self,
        _session: &mut Session,
        _body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        ctx.body_ended |= end_of_stream;
        Ok(())
    }

    /// pingora's error line for an answer it could not parse quotes the bytes it read
    /// (`buf: ...`): a backend's headers and body (a session cookie, a token, a customer's
    /// data) do not belong in the log. Such an error is said here without them; the rest as
    /// pingora says them.
    fn suppress_error_log(&self, session: &Session, ctx: &Self::CTX, error: &Error) -> bool {
        if !quotes_bytes(error) {
            return false;
        }
        tracing::error!(
            error = %Redacted(error),
            request = %self.request_summary(session, ctx),
            "failed to proxy: an answer could not be parsed (its bytes are not logged)"
        );
        true
    }

    /// How pingora's own error lines name the request: method, path and route, as the access
    /// line does. pingora's default adds the query and `Host`, which may carry what a client
    /// means to keep out of logs (a token in a query parameter).
    fn request_summary(&self, session: &Session, ctx: &Self::CTX) -> String {
        let req = session.req_header();
        format!(
            "{} {:?}, route {}",
            req.method.as_str(),
            req.uri.path(),
            label(ctx)
        )
    }

    /// Answers proxy failures on the forwarding path as problem+json.
    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Self::CTX,
    ) -> FailToProxy {
        // An interim answer relayed from the backend (`100 Continue`) is no answer: the final
        // one may still follow it. A `101` is final: the connection is a tunnel from then on,
        // and a problem written into it would reach the client as tunnel bytes.
        let written = session
            .response_written()
            .filter(|r| {
                !r.status.is_informational() || r.status == http::StatusCode::SWITCHING_PROTOCOLS
            })
            .map(|r| r.status.as_u16());
        let problem = match e.esource() {
            // Only a failure to connect proves that nothing was sent.
            pingora::ErrorSource::Upstream if is_connect_failure(&e.etype) => {
                Some(Problem::UpstreamConnect)
            }
            // No answer came within read_timeout while the client's body was still on its way
            // (pingora reads the answer while it streams the body, and restarts the wait with
            // each piece it forwards): the client paused mid-body for longer than read_timeout.
            // The backend holds an incomplete request, which it cannot have executed; the
            // client is the one that is late, as when request_body_timeout cuts it off. Not a
            // client that sent no body yet: one that waits for a `100 Continue` the backend
            // never sent is not at fault.
            pingora::ErrorSource::Upstream
                if e.etype == pingora::ErrorType::ReadTimedout
                    && written.is_none()
                    && !ctx.body_ended
                    && session.body_bytes_read() > 0 =>
            {
                Some(Problem::RequestTimeout)
            }
            pingora::ErrorSource::Upstream => Some(Problem::UpstreamAnswerLost),
            // The client left while the answer was on its way: nothing to say, and the
            // request keeps its outcome (it was forwarded).
            pingora::ErrorSource::Downstream if written.is_some() => None,
            // The client's body, streamed by pingora, stalled or broke: say so while no answer
            // has started (a client that is gone never reads it, which costs nothing). A client
            // that closed after its whole body went on left before the answer: its request was
            // not at fault.
            pingora::ErrorSource::Downstream => match e.etype {
                pingora::ErrorType::ReadTimedout => Some(Problem::RequestTimeout),
                // pingora's `is_body_done` is true for a body cut off too: only one read to its
                // end, or none at all, is whole.
                pingora::ErrorType::ConnectionClosed
                    if ctx.body_ended || session.is_body_empty() =>
                {
                    None
                }
                pingora::ErrorType::ReadError
                | pingora::ErrorType::InvalidHTTPHeader
                | pingora::ErrorType::ConnectionClosed => Some(Problem::RequestBodyUnreadable),
                // A body that breaks its own chunked framing (pingora's body reader names these).
                pingora::ErrorType::Custom(
                    "InvalidChunk" | "InvalidTrailerEnd" | "PrematureBodyEnd",
                ) => Some(Problem::RequestBodyUnreadable),
                _ => None,
            },
            _ => Some(Problem::UpstreamConnect),
        };
        let code = match (&problem, written) {
            (Some(p), None) => {
                ctx.refused_for_its_request(p);
                match answer(session, ctx, p).await {
                    Ok(()) => p.status(),
                    Err(_) => 0,
                }
            }
            (_, Some(status)) => status,
            (None, None) => 0,
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// One structured line and the metrics for every request.
    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Self::CTX) {
        crate::headguard::request_ended(session);
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let req = session.req_header();
        let redacted = e.map(Redacted);
        let error = redacted.as_ref().map(|e| e as &dyn std::fmt::Display);
        ctx.log_line(req.method.as_str(), req.uri.path(), status, error);
    }
}

/// A completion's first store write, out until the store answers. Dropped unanswered, the
/// request's task was dropped mid-write: pingora drops every request task when a shutdown's
/// grace period ends (and unwinding drops it after a panic). The write may or may not land;
/// either way the completion goes to the dead-letter file instead of vanishing with the task.
struct WriteOut<'a, F: Fn() -> PendingCompletion> {
    retrier: &'a CompletionRetrier,
    pending: &'a F,
    answered: bool,
}

impl<F: Fn() -> PendingCompletion> Drop for WriteOut<'_, F> {
    fn drop(&mut self) {
        if !self.answered {
            let reason = if std::thread::panicking() {
                "the store write panicked"
            } else {
                "process stopped with the store write out"
            };
            self.retrier.abandoned((self.pending)(), reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error chain reads as pingora writes it, but for the bytes a parse error quotes.
    #[test]
    fn errors_are_logged_as_pingora_writes_them_without_the_bytes_read() {
        let io = std::io::Error::other("reset");
        let plain = Error::because(pingora::ErrorType::ReadError, "while reading", io);
        let plain = Error::because(pingora::ErrorType::HTTPStatus(502), "proxying", plain);
        assert_eq!(Redacted(&plain).to_string(), plain.to_string());
        assert!(!quotes_bytes(&plain));

        let parse = Error::because(
            pingora::ErrorType::InvalidHTTPHeader,
            "buf: HTTP/1.1 201\\r\\nSet-Cookie: SECRET",
            httparse::Error::HeaderName,
        );
        let mut outer = Error::because(pingora::ErrorType::InvalidHTTPHeader, "upstream", parse);
        outer.esource = pingora::ErrorSource::Upstream;
        assert!(quotes_bytes(&outer));
        assert!(outer.to_string().contains("SECRET"));
        let redacted = Redacted(&outer).to_string();
        assert!(!redacted.contains("SECRET"), "{redacted}");
        assert_eq!(
            redacted,
            outer.to_string().replace(
                "buf: HTTP/1.1 201\\r\\nSet-Cookie: SECRET",
                "(the bytes read, not logged)"
            )
        );
    }

    #[test]
    fn a_stored_response_that_is_no_http_is_not_replayed() {
        let stored = |status: u16, value: &'static [u8]| {
            StoredResponse::new(
                status,
                vec![("x-a", Bytes::from_static(value))],
                Bytes::from_static(b"{}"),
            )
        };
        let head = replay_head(&stored(201, b"fine"), &[]).unwrap();
        assert_eq!(head.status.as_u16(), 201);
        assert_eq!(head.headers["x-a"], "fine");
        assert!(replay_head(&stored(201, b"split\r\nx-b: 1"), &[]).is_none());
        assert!(replay_head(&stored(1000, b"fine"), &[]).is_none());
        let bad_name = StoredResponse::new(201, vec![("x a", Bytes::new())], Bytes::new());
        assert!(replay_head(&bad_name, &[]).is_none());
    }

    #[test]
    fn a_204_stored_with_framing_replays_without_it() {
        let framed = |status: u16| {
            StoredResponse::new(
                status,
                vec![
                    ("content-length", Bytes::from_static(b"5")),
                    ("transfer-encoding", Bytes::from_static(b"chunked")),
                    ("x-a", Bytes::from_static(b"1")),
                ],
                Bytes::new(),
            )
        };
        // A replay's head goes through the client's framing as every answer does.
        let replayed = |status: u16| {
            let mut head = replay_head(&framed(status), &[]).unwrap();
            without_no_content_framing(&mut head);
            head
        };
        let head = replayed(204);
        assert!(!head.headers.contains_key("content-length"));
        assert!(!head.headers.contains_key("transfer-encoding"));
        assert_eq!(head.headers["x-a"], "1");
        // A 304's length is the representation's: kept.
        let head = replayed(304);
        assert_eq!(head.headers["content-length"], "5");
    }

    #[test]
    fn a_declared_length_is_read_as_pingora_frames_the_body() {
        let declared = |lines: &[&str]| {
            let mut headers = http::HeaderMap::new();
            for line in lines {
                headers.append(header::CONTENT_LENGTH, HeaderValue::from_str(line).unwrap());
            }
            declared_length(&headers)
        };
        assert_eq!(declared(&[]), None);
        assert_eq!(declared(&["5"]), Some(5));
        assert_eq!(declared(&[" 5 "]), Some(5));
        assert_eq!(declared(&["5, 5"]), Some(5));
        assert_eq!(declared(&["5", "5,5"]), Some(5));
        for odd in [
            &["5, 6"][..],
            &["5", "6"],
            &["+5"],
            &["5,"],
            &[""],
            &["0x5"],
            &["5 5"],
        ] {
            assert_eq!(declared(odd), None, "{odd:?}");
        }
        assert_eq!(declared(&["99999999999999999999999"]), None);
    }

    #[test]
    fn stored_response_drops_hop_by_hop_framing_date_and_excluded() {
        let mut resp = ResponseHeader::build(201, None).unwrap();
        resp.append_header("content-type", "application/json")
            .unwrap();
        resp.append_header("set-cookie", "s=1").unwrap();
        resp.append_header("connection", "keep-alive, x-hop")
            .unwrap();
        resp.append_header("x-hop", "1").unwrap();
        resp.append_header("transfer-encoding", "chunked").unwrap();
        resp.append_header("content-length", "10").unwrap();
        resp.append_header("date", "Sun, 29 Nov 2026 00:00:00 GMT")
            .unwrap();
        resp.append_header("x-order", "a").unwrap();
        resp.append_header("proxy-authentication-info", "n=1")
            .unwrap();
        resp.append_header("proxy-status", "gw; error=none")
            .unwrap();
        resp.append_header("x-order", "b").unwrap();
        let mut builder =
            stored_response(&resp, &[HeaderName::from_static("set-cookie")], 2, false);
        builder.push_body(b"ok");
        let kept = builder.finish();
        let headers: Vec<(&str, &[u8])> = kept.headers().collect();
        assert_eq!(
            headers,
            [
                ("content-type", &b"application/json"[..]),
                ("x-order", b"a"),
                ("x-order", b"b")
            ]
        );
        assert_eq!(kept.status, 201);
        assert_eq!(kept.body(), b"ok");
    }

    #[test]
    fn standard_methods_in_another_case_are_recognised() {
        let m = |s: &str| http::Method::from_bytes(s.as_bytes()).expect("method");
        for odd in ["post", "Post", "pOST", "get", "patch", "Delete"] {
            assert!(is_standard_method_in_other_case(&m(odd)), "{odd}");
        }
        for fine in ["POST", "GET", "PURGE", "purge", "posts", "MKCOL"] {
            assert!(!is_standard_method_in_other_case(&m(fine)), "{fine}");
        }
    }
}
