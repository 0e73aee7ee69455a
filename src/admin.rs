//! The admin listener: liveness, readiness and Prometheus metrics, on loopback by default.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::{percent_decode, Config, OnUnavailable};
use crate::key;
use crate::metrics::Metrics;
use crate::proxy::Generation;
use crate::reload::{ReloadOutcome, Reloader};
use crate::store::purge::PurgeBus;
use crate::store::{
    fallback_record, Completion, Deletion, Record, RecordKey, RecordState, StoreError,
};
use crate::store::{RecordStore, RedisStore};
use crate::worker_lease::{WorkerIdSource, WorkerIds};

/// Longest `/readyz` waits on the store's ping when `store.on_unavailable` lets requests through
/// without the store (`pass`, `local`): well inside a Kubernetes probe's default 1 s timeout.
const PERMISSIVE_PING_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// How long a readiness ping's outcome answers later probes: however hard `/readyz` is
/// polled (anyone who reaches the admin port can), the store sees a ping at most this often,
/// and the proxy's requests, which share its connection and circuit breaker, never queue
/// behind them.
const PING_REUSE: std::time::Duration = std::time::Duration::from_millis(250);

/// Readiness latches shared with the server: flipped once, read on every probe.
#[derive(Default)]
pub struct Readiness {
    draining: AtomicBool,
}

impl Readiness {
    /// Marks the process as shutting down: `/readyz` answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// The admin HTTP application.
pub struct Admin {
    current: Arc<ArcSwap<Generation>>,
    store: Arc<dyn RecordStore>,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    reloader: Arc<Reloader>,
    purge: Option<PurgeBus>,
    /// The Redis store, for `GET /admin/scripts`; `None` with the memory store.
    scripts: Option<Arc<RedisStore>>,
    /// The worker id in use and where it came from, for `/admin/config` and `/readyz`.
    ids: Option<Arc<WorkerIds>>,
    /// The in-process store `on_unavailable: local` falls back to: a purge drops its record too.
    fallback: Option<Arc<dyn RecordStore>>,
    /// The store's readiness pings: one out at a time, each answer kept a while.
    pings: Arc<Pings>,
}

/// Readiness pings of the store, one at a time (its `turn` is held while one is out), each
/// answer serving every probe for [`PING_REUSE`]: however hard `/readyz` is polled, the store
/// sees a few pings a second at most.
struct Pings {
    store: Arc<dyn RecordStore>,
    /// When the last ping answered, and what.
    last: parking_lot::Mutex<Option<(tokio::time::Instant, Result<(), String>)>>,
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl Pings {
    /// The last ping's answer, if it came within [`PING_REUSE`].
    fn recent(&self) -> Option<Result<(), String>> {
        let last = self.last.lock();
        let (at, answer) = last.as_ref()?;
        (at.elapsed() < PING_REUSE).then(|| answer.clone())
    }

    /// Pings the store (the caller holds the turn) and keeps the answer.
    async fn ping(&self) -> Result<(), String> {
        let answer = self.store.ping().await.map_err(|e| e.to_string());
        *self.last.lock() = Some((tokio::time::Instant::now(), answer.clone()));
        answer
    }

    /// A recent answer, or a ping's: one that is out is waited for rather than sent again.
    async fn shared(&self) -> Result<(), String> {
        if let Some(answer) = self.recent() {
            return answer;
        }
        let _turn = self.turn.lock().await;
        match self.recent() {
            Some(answer) => answer,
            None => self.ping().await,
        }
    }
}

/// `/readyz` under a permissive policy: ready whatever the store answered.
fn ready_anyway(answer: Result<(), String>) -> (StatusCode, String) {
    match answer {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(e) => (StatusCode::OK, format!("ready (store degraded: {e})\n")),
    }
}

impl Admin {
    /// Creates the admin application over the proxy's shared state.
    pub fn new(
        current: Arc<ArcSwap<Generation>>,
        store: Arc<dyn RecordStore>,
        metrics: Arc<Metrics>,
        readiness: Arc<Readiness>,
        reloader: Arc<Reloader>,
        purge: Option<PurgeBus>,
    ) -> Self {
        let pings = Arc::new(Pings {
            store: store.clone(),
            last: parking_lot::Mutex::new(None),
            turn: Arc::default(),
        });
        Admin {
            pings,
            current,
            store,
            metrics,
            readiness,
            reloader,
            purge,
            scripts: None,
            ids: None,
            fallback: None,
        }
    }

    /// `GET|DELETE /admin/records/{tenant}/{key}`: the record of a key as a client of `route`
    /// (default: the first idempotent route) would reach it. The principal's scope values are
    /// given as `X-Idemgate-Scope-<Header>` request headers, since `Authorization` carries the
    /// admin token here.
    async fn record(&self, session: &ServerSession, delete: bool) -> Response<Vec<u8>> {
        let req = session.req_header();
        let generation = self.current.load();
        let config = &generation.config;
        let (tenant, raw_key) =
            match tenant_and_name(req.uri.path(), "/admin/records/", "{tenant}/{key}") {
                Ok(parts) => parts,
                Err(refused) => return refused,
            };
        let key = match http::HeaderValue::from_str(&raw_key)
            .ok()
            .map(|v| key::parse_key(std::iter::once(&v)))
        {
            Some(Ok(Some(k))) => k,
            Some(Err(e)) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "the key is not a valid header value",
                )
            }
        };
        let query = Query(req.uri.query().unwrap_or(""));
        // Stored bodies are shown only with the admin token, as by record id: the tenant here
        // is whatever the caller writes in the path, where through the proxy it comes from the
        // layer that authenticated the client, so a key (with `scope_headers: []`, nothing
        // more) would let anyone who reaches the admin port read another tenant's responses.
        let trusted = self.authorized(session);
        if !trusted && asks_for_secrets(&query) {
            return unauthorized();
        }
        let route = match query.get("route") {
            Some(name) => config.routes.iter().find(|r| r.name == *name),
            None => config.routes.iter().find(|r| r.idempotency.is_some()),
        };
        let Some(idem) = route.and_then(|r| r.idempotency.as_ref()) else {
            return error(StatusCode::NOT_FOUND, "no such idempotent route");
        };
        // The scope values as the client sent them, under their real names.
        let mut scope = http::HeaderMap::new();
        for name in &idem.scope_headers {
            let given = format!("x-idemgate-scope-{}", name.as_str());
            for v in req.headers.get_all(given.as_str()) {
                scope.append(name.clone(), v.clone());
            }
        }
        let hash = key::record_hash(&tenant, &scope, &idem.scope_headers, &key);
        self.record_at(RecordKey { tenant, hash }, &query, delete, trusted)
            .await
    }

    /// `GET|DELETE /admin/record-ids/{tenant}/{record}`: a record by its id, the 64 hex digits of
    /// its hash as dead-letter lines and the store's key names show it (the raw key is never
    /// kept, so reconciling a dead letter starts from this).
    async fn record_by_id(&self, session: &ServerSession, delete: bool) -> Response<Vec<u8>> {
        let req = session.req_header();
        // A record id is no secret (Redis key names and dead-letter lines show it), so unlike
        // the raw key and its principal's scope values it proves nothing: the stored body is
        // shown only with the admin token.
        let query = Query(req.uri.query().unwrap_or(""));
        let trusted = self.authorized(session);
        if !trusted && asks_for_secrets(&query) {
            return unauthorized();
        }
        let (tenant, id) =
            match tenant_and_name(req.uri.path(), "/admin/record-ids/", "{tenant}/{record}") {
                Ok(parts) => parts,
                Err(refused) => return refused,
            };
        let Some(hash) = crate::store::parse_digest(&id) else {
            return error(
                StatusCode::BAD_REQUEST,
                "the record id is not 64 hex digits",
            );
        };
        self.record_at(RecordKey { tenant, hash }, &query, delete, trusted)
            .await
    }

    /// Reads (or with `delete`, purges) one record.
    async fn record_at(
        &self,
        record_key: RecordKey,
        query: &Query<'_>,
        delete: bool,
        trusted: bool,
    ) -> Response<Vec<u8>> {
        if delete {
            // A record in flight belongs to an execution that may still be running: purged, a
            // retry runs the key again beside it, under a new X-Idempotency-Id the backend's
            // unique index cannot match. Only on purpose (`?force=true`). The check and the
            // delete are one step in the store: a claim landing between a read and a delete
            // would be removed from under its execution.
            let force = query.get("force").as_deref() == Some("true");
            let running = |lock_remaining: std::time::Duration, on_fallback: bool| {
                let message = if lock_remaining.is_zero() && on_fallback {
                    "the record is in flight on this replica's fallback and its lock lapsed: its \
                     execution may still be running here, and a retry takes the key over under \
                     the same X-Idempotency-Id, which a purge would lose; purge with \
                     ?force=true to drop it all the same"
                        .to_owned()
                } else if lock_remaining.is_zero() {
                    "the record is in flight and its lock lapsed: its execution may still be \
                     running (on a replica cut off from the store), and a retry already takes \
                     the key over under the same X-Idempotency-Id, which a purge would lose (a \
                     retry after it runs the key under a new one); purge with ?force=true to \
                     drop it all the same"
                        .to_owned()
                } else {
                    format!(
                        "the record is in flight ({} ms of its lock left): its execution may \
                         still be running, and a retry after a purge runs the key again under a \
                         new X-Idempotency-Id; wait for it to end, or purge with ?force=true",
                        lock_remaining.as_millis()
                    )
                };
                error(StatusCode::CONFLICT, &message)
            };
            // What this replica ran on its fallback during an outage goes too: a purged key
            // is never replayed from there (nor, by the announcement, from another replica's).
            // A key running there is refused before anything is deleted anywhere; the store's
            // refusal comes before the fallback is touched.
            if let (false, Some(fallback)) = (force, &self.fallback) {
                if let Ok(Some(Record {
                    state: RecordState::InFlight { lock_remaining },
                    ..
                })) = fallback.get(&record_key).await
                {
                    return running(lock_remaining, true);
                }
            }
            let deleted = match purge_from(self.store.as_ref(), &record_key, force).await {
                Ok(Deletion::Running { lock_remaining }) => return running(lock_remaining, false),
                Ok(deletion) => Ok(deletion == Deletion::Deleted),
                Err(e) => Err(e),
            };
            // A fallback claim made since the look above is spared (and reported not deleted).
            let local = match &self.fallback {
                Some(fallback) => matches!(
                    purge_from(fallback.as_ref(), &record_key, force).await,
                    Ok(Deletion::Deleted)
                ),
                None => false,
            };
            // Announced whether or not the store answered: a delete whose answer was lost may
            // have landed, and then the other replicas' copies would replay a record that is
            // gone. Dropping a copy of a record that is still there only costs a round trip.
            // A delete still queued on the server may land after the announcement, and a
            // replica could copy the record in between: the 503 asks for the purge again.
            let announced = match &self.purge {
                Some(bus) => match bus.publish(&record_key).await {
                    // Pub/sub is best effort: a replica reconnecting right now misses it, so
                    // the answer says how many were listening, not "all".
                    Ok(n) => format!("{n} replicas listening"),
                    Err(e) => format!("this replica only ({e})"),
                },
                None => "this replica".to_string(),
            };
            tracing::info!(
                tenant = %record_key.tenant,
                record = %crate::key::hash_label(&record_key.hash),
                deleted = ?deleted.as_ref().ok(),
                deleted_from_fallback = local,
                "record purged through the admin API"
            );
            return match deleted {
                Ok(existed) => json(
                    StatusCode::OK,
                    serde_json::json!({
                        "deleted": existed,
                        "deleted_from_fallback": local,
                        "local_copies_dropped_on": announced,
                    }),
                ),
                Err(e) => error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!(
                        "{e}; the delete may have landed: send it again (local copies dropped on {announced})"
                    ),
                ),
            };
        }
        let show = |record: &Record| {
            record_json(
                &record_key,
                record,
                query.get("body").as_deref() == Some("true"),
                query.get("fingerprint").as_deref(),
                trusted,
            )
        };
        // A key this replica ran on the fallback during an outage (`on_unavailable: local`) is
        // answered from there while its record lives, Redis back or not: show that record, as
        // the proxy would replay it (a released one gives way to the store's, as it does there).
        if let Some(local) = &self.fallback {
            let held = fallback_record(local.as_ref(), &record_key).await;
            if let Some(record) = held.filter(|r| !matches!(r.state, RecordState::Released)) {
                let mut v = show(&record);
                v["held_by"] = "fallback".into();
                return json(StatusCode::OK, v);
            }
        }
        match self.store.get(&record_key).await {
            Ok(Some(record)) => json(StatusCode::OK, show(&record)),
            Ok(None) => error(StatusCode::NOT_FOUND, "no such record"),
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        }
    }

    /// Serves `GET /admin/scripts` from this Redis store.
    pub fn with_scripts(mut self, store: Arc<RedisStore>) -> Self {
        self.scripts = Some(store);
        self
    }

    /// Purges reach `fallback` too (the store `on_unavailable: local` falls back to).
    pub fn with_fallback(mut self, fallback: Arc<dyn RecordStore>) -> Self {
        self.fallback = Some(fallback);
        self
    }

    /// Shows the worker id in use; `/readyz` waits for its first lease attempt.
    pub fn with_worker_ids(mut self, ids: Arc<WorkerIds>) -> Self {
        self.ids = Some(ids);
        self
    }

    /// Script versions, SHAs, the canary and per-version counters.
    fn scripts(&self) -> Response<Vec<u8>> {
        match &self.scripts {
            Some(store) => json(
                StatusCode::OK,
                serde_json::to_value(store.scripts_status()).unwrap_or_default(),
            ),
            None => error(
                StatusCode::NOT_FOUND,
                "no scripts: store.backend is not redis",
            ),
        }
    }

    /// Whether the request carries the configured bearer token (compared in constant time).
    /// With no token configured, every mutation is refused.
    fn authorized(&self, session: &ServerSession) -> bool {
        let config = self.current.load();
        let Some(expected) = config.config.admin.token.as_deref() else {
            return false;
        };
        let mut given = session
            .req_header()
            .headers
            .get_all(http::header::AUTHORIZATION)
            .iter();
        // Exactly one Authorization header: with two, which one is meant is a guess.
        match (given.next(), given.next()) {
            (Some(value), None) => bearer_token(value.as_bytes())
                .is_some_and(|token| constant_time_eq(token, expected.as_bytes())),
            _ => false,
        }
    }

    async fn reload(&self) -> Response<Vec<u8>> {
        let reloader = self.reloader.clone();
        let result = tokio::task::spawn_blocking(move || reloader.reload("admin"))
            .await
            .unwrap_or_else(|e| Err(format!("reload task failed: {e}")));
        match result {
            Ok(ReloadOutcome::Applied {
                hash,
                restart_required,
            }) => json(
                StatusCode::OK,
                serde_json::json!({
                    "result": "applied",
                    "hash": hash,
                    "restart_required": restart_required,
                }),
            ),
            Ok(ReloadOutcome::RestartRequired { hash, settings }) => json(
                StatusCode::OK,
                serde_json::json!({
                    "result": "restart_required",
                    "hash": hash,
                    "restart_required": settings,
                }),
            ),
            Ok(ReloadOutcome::Unchanged) => {
                json(StatusCode::OK, serde_json::json!({ "result": "unchanged" }))
            }
            Err(message) => {
                let mut extra = serde_json::Map::new();
                extra.insert("result".into(), "refused".into());
                problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "admin-reload-refused",
                    &message,
                    extra,
                )
            }
        }
    }

    fn config(&self, session: &ServerSession) -> Response<Vec<u8>> {
        let generation = self.current.load();
        let mut body = config_json(&generation.config);
        // The hash is of the file as written, secrets included: a plain SHA-256 anyone could
        // test guesses at a password against, given the rest of the file (much of which this
        // view shows). With the token, as `POST /admin/reload` shows it.
        if !self.authorized(session) {
            if let Some(fields) = body.as_object_mut() {
                fields.remove("hash");
            }
        }
        body["loaded_at_unix"] = self.reloader.loaded_at().into();
        if let Some(ids) = &self.ids {
            body["idempotency"]["worker_id_in_use"] = ids.worker_id().into();
            body["idempotency"]["worker_id_source"] = ids.source().as_str().into();
            if ids.source() == WorkerIdSource::Lease {
                body["idempotency"]["worker_id_leased"] = ids.is_leased().into();
            }
        }
        body["path"] = self.reloader.path().display().to_string().into();
        json(StatusCode::OK, body)
    }

    /// `GET /readyz`. Under `on_unavailable: reject` the answer waits for the store's ping,
    /// since a replica that cannot reach its store refuses every idempotent request. Under
    /// `pass` or `local` it is ready whatever the ping says, so it waits at most
    /// [`PERMISSIVE_PING_WAIT`]: a blackholed Redis takes connect_timeout + 2 × response_timeout
    /// to fail, longer than a Kubernetes probe's 1 s default, and every replica would go unready
    /// in exactly the outage the policy is there to ride out. Either way a ping that answered
    /// within [`PING_REUSE`] answers for it.
    async fn ready(&self) -> (StatusCode, String) {
        if self.readiness.is_draining() {
            return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
        }
        // Execution ids issued now could be under an id the lease is about to give up.
        if self.ids.as_ref().is_some_and(|ids| !ids.is_settled()) {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "worker id lease pending\n".into(),
            );
        }
        let policy = self.current.load().config.store.on_unavailable;
        if policy == OnUnavailable::Reject {
            return match self.pings.shared().await {
                Ok(()) => (StatusCode::OK, "ready\n".into()),
                Err(e) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("store unavailable: {e}\n"),
                ),
            };
        }
        if let Some(answer) = self.pings.recent() {
            return ready_anyway(answer);
        }
        // One out already: not waited for here, nor sent again.
        let Ok(turn) = self.pings.turn.clone().try_lock_owned() else {
            return (
                StatusCode::OK,
                "ready (store degraded: an earlier ping has not answered)\n".into(),
            );
        };
        // Spawned rather than dropped at the deadline: the ping runs to its end, so the circuit
        // breaker still counts its outcome as it always has.
        let pings = self.pings.clone();
        let ping = tokio::spawn(async move {
            let _turn = turn;
            pings.ping().await
        });
        match tokio::time::timeout(PERMISSIVE_PING_WAIT, ping).await {
            Ok(Ok(answer)) => ready_anyway(answer),
            Ok(Err(e)) => (
                StatusCode::OK,
                format!("ready (store degraded: ping failed: {e})\n"),
            ),
            Err(_) => (
                StatusCode::OK,
                format!(
                    "ready (store degraded: no answer within {}ms)\n",
                    PERMISSIVE_PING_WAIT.as_millis()
                ),
            ),
        }
    }
}

/// The tenant (validated) and the name after it in `<prefix>{tenant}/{name}`, both
/// percent-decoded; a refusal naming the `shape` expected otherwise.
#[allow(clippy::result_large_err)]
fn tenant_and_name(
    path: &str,
    prefix: &str,
    shape: &str,
) -> Result<(String, String), Response<Vec<u8>>> {
    let Some((tenant, name)) = path
        .strip_prefix(prefix)
        .and_then(|rest| rest.split_once('/'))
    else {
        return Err(error(
            StatusCode::NOT_FOUND,
            &format!("use {prefix}{shape}"),
        ));
    };
    let (Some(tenant), Some(name)) = (percent_decode(tenant), percent_decode(name)) else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "malformed percent-encoding in the path",
        ));
    };
    match key::validate_tenant(tenant.as_bytes()) {
        Ok(t) => Ok((t.to_owned(), name)),
        Err(e) => Err(error(StatusCode::BAD_REQUEST, &e.to_string())),
    }
}

/// An error the admin API makes: `application/problem+json` (RFC 9457), as every error the
/// proxy makes itself, with a `type` per kind and the message as `detail`; `error` carries the
/// message too, the member admin errors had before they were problems.
/// An admin purge on one store: whatever the record's state with `force`, else only a record
/// whose execution cannot still be running.
async fn purge_from(
    store: &dyn RecordStore,
    key: &RecordKey,
    force: bool,
) -> Result<Deletion, StoreError> {
    if !force {
        return store.delete_settled(key).await;
    }
    Ok(match store.delete(key).await? {
        true => Deletion::Deleted,
        false => Deletion::Absent,
    })
}

/// Whether an admin request on a loopback listener names it as only a local client can: by an
/// IP address or `localhost` (any port), or not at all (HTTP/1.0 without `Host`). A name that
/// resolves to 127.0.0.1 only at the attacker's say-so (DNS rebinding) would let a web page in
/// a browser on this host read the endpoints that need no token, as same-origin.
fn loopback_host(req: &pingora::http::RequestHeader) -> bool {
    let Some(host) = req.headers.get(http::header::HOST) else {
        return req.version == http::Version::HTTP_10;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`.
        Some(rest) => match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || port.strip_prefix(':').is_some_and(is_port) => {
                return v6.parse::<std::net::Ipv6Addr>().is_ok();
            }
            _ => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        },
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::Ipv4Addr>().is_ok()
}

/// A Host header's port: one to five digits.
fn is_port(text: &str) -> bool {
    !text.is_empty() && text.len() <= 5 && text.bytes().all(|b| b.is_ascii_digit())
}

fn error(status: StatusCode, message: &str) -> Response<Vec<u8>> {
    let kind = match status {
        StatusCode::MISDIRECTED_REQUEST => "admin-host-not-local",
        StatusCode::BAD_REQUEST => "admin-request-invalid",
        StatusCode::UNAUTHORIZED => "admin-unauthorized",
        StatusCode::NOT_FOUND => "admin-not-found",
        StatusCode::CONFLICT => "admin-record-in-flight",
        StatusCode::METHOD_NOT_ALLOWED => "admin-method-not-allowed",
        StatusCode::UNPROCESSABLE_ENTITY => "admin-reload-refused",
        StatusCode::SERVICE_UNAVAILABLE => "admin-store-unavailable",
        _ => "admin-error",
    };
    problem(status, kind, message, serde_json::Map::new())
}

/// A problem document of `kind` ([`crate::problem::document`]) with `extra` members.
fn problem(
    status: StatusCode,
    kind: &str,
    detail: &str,
    extra: serde_json::Map<String, serde_json::Value>,
) -> Response<Vec<u8>> {
    let title = status.canonical_reason().unwrap_or("Error");
    let mut value = crate::problem::document(kind, title, status.as_u16(), detail);
    if let Some(members) = value.as_object_mut() {
        members.insert("error".into(), detail.into());
        members.extend(extra);
    }
    let mut body = serde_json::to_vec_pretty(&value).unwrap_or_default();
    body.push(b'\n');
    text(status, "application/problem+json", body)
}

/// 405 for `path`, naming the methods it takes.
fn method_not_allowed(allow: &'static str) -> Response<Vec<u8>> {
    let mut resp = error(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("this endpoint takes {allow} only"),
    );
    resp.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    resp
}

/// The query string of an admin request.
struct Query<'a>(&'a str);

impl<'a> Query<'a> {
    /// The value of `name`, percent-decoded (`?route=orders%20v2` names the route `orders v2`);
    /// one whose encoding is malformed is taken as written, so it matches nothing.
    fn get(&self, name: &str) -> Option<std::borrow::Cow<'a, str>> {
        let raw = self
            .0
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)?;
        Some(match percent_decode(raw) {
            Some(decoded) if decoded != raw => std::borrow::Cow::Owned(decoded),
            _ => std::borrow::Cow::Borrowed(raw),
        })
    }
}

/// Whether an admin record read asks for what only the token shows: the stored body
/// (`?body=true`), or a match against the fingerprint (`?fingerprint=`).
fn asks_for_secrets(query: &Query<'_>) -> bool {
    query.get("body").as_deref() == Some("true") || query.get("fingerprint").is_some()
}

/// A record as the admin API shows it: state, timestamps; with the admin token (`trusted`)
/// the fingerprint too, and the body on request. The fingerprint is an unsalted SHA-256 over
/// the request, body included: shown to anyone, it would let them try guesses at a body (an
/// amount, an account) offline until one matches.
fn record_json(
    key: &RecordKey,
    record: &Record,
    with_body: bool,
    fingerprint: Option<&str>,
    trusted: bool,
) -> serde_json::Value {
    use base64::Engine;
    let created = crate::snowflake::decode(record.execution_id).unix_ms;
    let mut v = serde_json::json!({
        "tenant": key.tenant,
        "record": hex::encode(key.hash),
        "execution_id": record.execution_id.to_string(),
        "created_at_unix_ms": created,
    });
    if trusted {
        v["fingerprint"] = hex::encode(record.fingerprint).into();
    }
    if let Some(left) = record.expires_in {
        v["expires_in_ms"] = (left.as_millis() as u64).into();
    }
    if let Some(given) = fingerprint {
        v["fingerprint_matches"] = given
            .eq_ignore_ascii_case(&hex::encode(record.fingerprint))
            .into();
    }
    match &record.state {
        RecordState::InFlight { lock_remaining } => {
            v["state"] = "in_flight".into();
            v["lock_remaining_ms"] = (lock_remaining.as_millis() as u64).into();
        }
        RecordState::Released => v["state"] = "released".into(),
        RecordState::Completed(Completion::Unreplayable { status }) => {
            v["state"] = "completed".into();
            v["replayable"] = false.into();
            v["status"] = (*status).into();
        }
        RecordState::Completed(Completion::Response(r)) => {
            v["state"] = "completed".into();
            v["replayable"] = true.into();
            v["status"] = r.status.into();
            v["body_bytes"] = r.body().len().into();
            if with_body {
                let b64 = base64::engine::general_purpose::STANDARD;
                v["headers"] = r
                    .headers()
                    .map(|(n, val)| serde_json::json!([n, String::from_utf8_lossy(val)]))
                    .collect::<Vec<_>>()
                    .into();
                v["body_base64"] = b64.encode(r.body()).into();
            }
        }
    }
    v
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is case-insensitive
/// (RFC 9110 §11.1); the token is taken as sent.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    (scheme.eq_ignore_ascii_case(b"bearer ") && !token.is_empty()).then_some(token)
}

/// Whether `given` equals `expected`, in time that tells an attacker nothing about `expected`.
///
/// Both sides are hashed (SHA-256) and all 32 bytes of the digests are compared without an
/// early exit, so the time depends neither on where the first difference is nor on the
/// expected token's length (a plain byte comparison returns at once on a length mismatch,
/// which lets a caller find the token's length). `black_box` keeps the compiler from turning
/// the fold back into a short-circuiting comparison.
fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (given, expected) = (Sha256::digest(given), Sha256::digest(expected));
    let diff = given
        .iter()
        .zip(expected.iter())
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(diff) == 0
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<Vec<u8>> {
    let mut body = serde_json::to_vec_pretty(&value).unwrap_or_default();
    body.push(b'\n');
    text(status, "application/json", body)
}

fn secs(d: std::time::Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// The running config as JSON, secrets redacted (Redis credentials, the admin token).
fn config_json(c: &Config) -> serde_json::Value {
    use serde_json::json;
    let upstreams: Vec<_> = c
        .upstreams
        .iter()
        .map(|u| {
            json!({
                "name": u.name, "addrs": u.addrs,
                "connect_timeout": secs(u.connect_timeout), "read_timeout": secs(u.read_timeout),
                "write_timeout": secs(u.write_timeout), "idle_timeout": secs(u.idle_timeout),
                "max_in_flight": u.max_in_flight,
            })
        })
        .collect();
    let routes: Vec<_> = c
        .routes
        .iter()
        .map(|r| {
            let idem = r.idempotency.as_ref().map(|i| {
                json!({
                    "key": format!("{:?}", i.key).to_lowercase(),
                    "min_key_length": i.min_key_length,
                    "ttl": secs(i.ttl), "lock_ttl": secs(i.lock_ttl),
                    "on_in_flight": format!("{:?}", i.on_in_flight).to_lowercase(),
                    "wait_timeout": secs(i.wait_timeout),
                    "on_outcome_unknown": format!("{:?}", i.on_outcome_unknown).to_lowercase(),
                    "fingerprint": { "body": i.fingerprint_body,
                        "headers": i.fingerprint_headers.iter().map(|h| h.as_str()).collect::<Vec<_>>() },
                    "scope_headers": i.scope_headers.iter().map(|h| h.as_str()).collect::<Vec<_>>(),
                    "scope_required": i.scope_required,
                    "cache_statuses": format!("{:?}", i.cache_statuses),
                    "replay_exclude_headers": i.replay_exclude_headers.iter().map(|h| h.as_str()).collect::<Vec<_>>(),
                    "max_request_bytes": i.max_request_bytes,
                    "max_response_bytes": i.max_response_bytes,
                })
            });
            json!({
                "name": r.name,
                "methods": r.methods.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                "path_prefix": r.path_prefix,
                "upstream": c.upstreams.get(r.upstream).map(|u| u.name.as_str()),
                "idempotency": idem,
            })
        })
        .collect();
    let redis = c.store.redis.as_ref().map(|r| {
        json!({
            "urls": r.urls.iter().map(|u| crate::config::redact_url(u)).collect::<Vec<_>>(),
            "topology": format!("{:?}", r.topology).to_lowercase(),
            "connect_timeout": secs(r.connect_timeout),
            "response_timeout": secs(r.response_timeout),
            "key_prefix": r.key_prefix,
            "scripts": {
                "dir": r.scripts.dir.as_ref().map(|p| p.display().to_string()),
                "version": r.scripts.version,
                "canary": r.scripts.canary.as_ref().map(|k| json!({
                    "version": k.version, "percent": k.percent, "tenants": k.tenants,
                    "max_error_rate": k.max_error_rate, "min_calls": k.min_calls,
                    "window": secs(k.window),
                })),
            },
            // Paths only: the files' contents (a private key) never leave the process.
            "tls": r.tls.as_ref().map(|t| json!({
                "ca_file": t.ca_file.as_ref().map(|p| p.display().to_string()),
                "cert_file": t.cert_file.as_ref().map(|p| p.display().to_string()),
                "key_file": t.key_file.as_ref().map(|p| p.display().to_string()),
            })),
        })
    });
    json!({
        "hash": c.source_hash,
        "listen": c.listen.to_string(),
        "threads": c.threads,
        "work_stealing": c.work_stealing,
        "request_header_timeout": secs(c.request_header_timeout),
        "max_request_header_bytes": c.max_request_header_bytes,
        "request_body_timeout": secs(c.request_body_timeout),
        "request_body_total_timeout": secs(c.request_body_total_timeout),
        "max_buffered_request_bytes": c.max_buffered_request_bytes,
        "response_send_timeout": secs(c.response_send_timeout),
        "shutdown": {
            "grace_period": secs(c.shutdown.grace_period),
            "graceful_shutdown_timeout": secs(c.shutdown.graceful_shutdown_timeout),
        },
        "admin": { "listen": c.admin.listen.to_string(), "token": c.admin.token.as_ref().map(|_| "<redacted>") },
        "upstreams": upstreams,
        "default_upstream": c.default_upstream.and_then(|i| c.upstreams.get(i)).map(|u| u.name.as_str()),
        "idempotency": {
            "key_header": c.idempotency.key_header.as_str(),
            "tenant_header": c.idempotency.tenant_header.as_str(),
            "default_tenant": c.idempotency.default_tenant,
            "worker_id": c.idempotency.worker_id,
            "worker_lease": secs(c.idempotency.worker_lease),
            // The config key's value: the URL inside `<...>` of the Link header made from it.
            "docs_url": c.idempotency.docs_link.as_ref()
                .and_then(|l| l.to_str().ok()?.strip_prefix('<')?.split_once('>'))
                .map(|(url, _)| url),
        },
        "store": {
            "backend": format!("{:?}", c.store.backend).to_lowercase(),
            "on_unavailable": format!("{:?}", c.store.on_unavailable).to_lowercase(),
            "memory": { "capacity_bytes": c.store.memory.capacity_bytes, "shards": c.store.memory.shards },
            "redis": redis,
            "local_cache": {
                "enabled": c.store.local_cache.enabled,
                "capacity_bytes": c.store.local_cache.capacity_bytes,
                "expected_items": c.store.local_cache.expected_items,
                "false_positive_rate": c.store.local_cache.false_positive_rate,
            },
            "circuit_breaker": {
                "failure_threshold": c.store.circuit_breaker.failure_threshold,
                "open_for": secs(c.store.circuit_breaker.open_for),
            },
            "completion_retry": {
                "attempts": c.store.completion_retry.attempts,
                "base_delay": secs(c.store.completion_retry.base_delay),
                "max_delay": secs(c.store.completion_retry.max_delay),
                "queue_capacity": c.store.completion_retry.queue_capacity,
                "queue_bytes": c.store.completion_retry.queue_bytes,
                "dead_letter_path": c.store.completion_retry.dead_letter_path.display().to_string(),
            },
        },
        "routes": routes,
    })
}

fn unauthorized() -> Response<Vec<u8>> {
    let mut resp = error(
        StatusCode::UNAUTHORIZED,
        "a valid bearer token is required (admin.token)",
    );
    resp.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    resp
}

fn text(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, content_type)
        .header(http::header::CONTENT_LENGTH, body.len())
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

#[async_trait]
impl ServeHttp for Admin {
    /// Marks the request's start and end for the connection's header guard (see
    /// [`crate::headguard`]), as the proxy does, around the answer.
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        crate::headguard::request_started(session);
        let answer = self.respond(session).await;
        crate::headguard::request_ended(session);
        answer
    }
}

impl Admin {
    async fn respond(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        if self.current.load().config.admin.listen.ip().is_loopback() && !loopback_host(req) {
            return error(
                StatusCode::MISDIRECTED_REQUEST,
                "the admin listener is on loopback and answers only to Host localhost or an IP \
                 address",
            );
        }
        let is_get = req.method == http::Method::GET || req.method == http::Method::HEAD;
        let is_post = req.method == http::Method::POST;
        let path = req.uri.path().to_owned();
        match (is_get, path.as_str()) {
            (true, "/admin/config") => self.config(session),
            (true, p) if p.starts_with("/admin/records/") => self.record(session, false).await,
            (false, p)
                if p.starts_with("/admin/records/") && req.method == http::Method::DELETE =>
            {
                if !self.authorized(session) {
                    return unauthorized();
                }
                self.record(session, true).await
            }
            (true, p) if p.starts_with("/admin/record-ids/") => {
                self.record_by_id(session, false).await
            }
            (false, p)
                if p.starts_with("/admin/record-ids/") && req.method == http::Method::DELETE =>
            {
                if !self.authorized(session) {
                    return unauthorized();
                }
                self.record_by_id(session, true).await
            }
            (true, "/admin/scripts") => self.scripts(),
            (false, p)
                if p.starts_with("/admin/records/") || p.starts_with("/admin/record-ids/") =>
            {
                method_not_allowed("GET, HEAD, DELETE")
            }
            (false, "/admin/reload") if is_post => {
                if !self.authorized(session) {
                    return unauthorized();
                }
                self.reload().await
            }
            (true, "/healthz") => text(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            (true, "/readyz") => {
                let (status, body) = self.ready().await;
                text(status, "text/plain", body.into_bytes())
            }
            (true, "/metrics") => text(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            (_, "/admin/reload") => method_not_allowed("POST"),
            (_, "/healthz" | "/readyz" | "/metrics" | "/admin/config" | "/admin/scripts") => {
                method_not_allowed("GET, HEAD")
            }
            _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_loopback_admin_answers_only_to_a_local_host_name() {
        let with_host = |version: http::Version, host: Option<&str>| {
            let mut req = pingora::http::RequestHeader::build("GET", b"/metrics", None).unwrap();
            req.set_version(version);
            if let Some(host) = host {
                req.insert_header("Host", host).unwrap();
            }
            super::loopback_host(&req)
        };
        let v11 = http::Version::HTTP_11;
        for host in [
            "localhost",
            "LOCALHOST:6181",
            "127.0.0.1",
            "127.0.0.1:6181",
            "10.1.2.3:80",
            "[::1]",
            "[::1]:6181",
        ] {
            assert!(with_host(v11, Some(host)), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:6181",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "[::1",
            "[evil]:1",
            "127.0.0.1:x",
            "",
        ] {
            assert!(!with_host(v11, Some(host)), "{host}");
        }
        // No Host at all: an HTTP/1.0 client (no browser sends one without).
        assert!(with_host(http::Version::HTTP_10, None));
        assert!(!with_host(v11, None));
    }

    use bytes::Bytes;

    use super::*;
    use crate::store::StoredResponse;

    const TOKEN: &[u8] = b"admin-token-0123456789abcdef";

    #[test]
    fn constant_time_eq_needs_every_byte_to_match() {
        assert!(constant_time_eq(TOKEN, TOKEN));
        // A difference in any single byte, first, middle or last, is caught: every byte counts.
        for i in 0..TOKEN.len() {
            let mut other = TOKEN.to_vec();
            other[i] ^= 0x01;
            assert!(!constant_time_eq(&other, TOKEN), "byte {i} ignored");
        }
        // Prefixes, extensions and the empty string are other tokens.
        for n in 0..TOKEN.len() {
            assert!(!constant_time_eq(&TOKEN[..n], TOKEN), "prefix of {n} bytes");
        }
        let mut longer = TOKEN.to_vec();
        longer.push(b'x');
        assert!(!constant_time_eq(&longer, TOKEN));
        assert!(!constant_time_eq(b"", TOKEN));
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"secret-token", b"secret-token"));
        assert!(!constant_time_eq(b"secret-token", b"secret-tokeN"));
        assert!(!constant_time_eq(b"secret-token", b"secret-toke"));
    }

    #[test]
    fn bearer_tokens_are_read_with_a_case_insensitive_scheme() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"BEARER abc"), Some(&b"abc"[..]));
        for bad in [
            &b"Bearer "[..],
            b"Bearer",
            b"Basic abc",
            b"Bearerabc",
            b"abc",
            b"",
        ] {
            assert_eq!(
                bearer_token(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // The token is not trimmed or folded: a padded token is another token.
        assert_eq!(bearer_token(b"Bearer  abc"), Some(&b" abc"[..]));
    }

    #[test]
    fn config_json_never_shows_secrets() {
        let config = Config::from_yaml_str(
            r#"
admin: {token: "admin-token-0123456789-secret"}
upstreams: {app: {addrs: ["127.0.0.1:8080"]}}
store:
  backend: redis
  redis: {urls: ["redis://user:hunter2-pw@127.0.0.1:7000", "redis://user:hunter2-pw@127.0.0.1:7001/0"]}
routes:
  - {name: orders, path_prefix: /orders, upstream: app, idempotency: {scope_headers: [Authorization]}}
"#,
        )
        .expect("valid config");
        let text = config_json(&config).to_string();
        for secret in [
            "admin-token-0123456789-secret",
            "hunter2-pw",
            "other-pw",
            "user:",
        ] {
            assert!(!text.contains(secret), "{secret} leaked: {text}");
        }
        let v = config_json(&config);
        assert_eq!(v["admin"]["token"], "<redacted>");
        assert_eq!(
            v["store"]["redis"]["urls"],
            serde_json::json!(["redis://***@127.0.0.1:7000", "redis://***@127.0.0.1:7001/0"])
        );
        assert_eq!(v["store"]["redis"]["topology"], "cluster");
        assert_eq!(
            v["routes"][0]["idempotency"]["scope_headers"][0],
            "authorization"
        );
        assert_eq!(v["routes"][0]["upstream"], "app");
        // Every setting in force shows, restart-only ones included (a reload keeps their
        // running values, and this is where an operator sees them).
        for path in [
            "/work_stealing",
            "/request_header_timeout",
            "/max_request_header_bytes",
            "/request_body_timeout",
            "/request_body_total_timeout",
            "/max_buffered_request_bytes",
            "/response_send_timeout",
            "/shutdown/grace_period",
            "/shutdown/graceful_shutdown_timeout",
            "/store/local_cache/capacity_bytes",
            "/store/circuit_breaker/failure_threshold",
            "/store/completion_retry/queue_bytes",
            "/store/completion_retry/dead_letter_path",
            "/store/redis/scripts/version",
        ] {
            assert!(v.pointer(path).is_some_and(|x| !x.is_null()), "{path}: {v}");
        }
        assert_eq!(v["shutdown"]["grace_period"], "20000ms");
    }

    fn record(state: RecordState) -> Record {
        Record {
            fingerprint: [0xab; 32],
            execution_id: 7 << 22,
            state,
            expires_in: None,
        }
    }

    #[test]
    fn record_json_describes_every_state() {
        let key = RecordKey {
            tenant: "acme".into(),
            hash: [1; 32],
        };
        let v = record_json(
            &key,
            &record(RecordState::InFlight {
                lock_remaining: Duration::from_millis(1500),
            }),
            false,
            None,
            false,
        );
        assert_eq!(v["state"], "in_flight");
        assert!(v.get("fingerprint").is_none(), "only with the token");
        assert_eq!(v["lock_remaining_ms"], 1500);
        assert_eq!(v["execution_id"], (7u64 << 22).to_string());
        assert_eq!(v["record"], "01".repeat(32));
        assert!(v.get("fingerprint_matches").is_none());

        let v = record_json(&key, &record(RecordState::Released), false, None, true);
        assert_eq!(v["fingerprint"], "ab".repeat(32));
        assert_eq!(v["state"], "released");
        assert!(v.get("status").is_none());

        let unreplayable = RecordState::Completed(Completion::Unreplayable { status: 201 });
        let v = record_json(
            &key,
            &record(unreplayable),
            true,
            Some(&"AB".repeat(32)),
            true,
        );
        assert_eq!(v["state"], "completed");
        assert_eq!(v["replayable"], false);
        assert_eq!(v["status"], 201);
        assert!(v.get("body_base64").is_none(), "nothing to show");
        assert_eq!(v["fingerprint_matches"], true, "hex compared without case");

        let response = RecordState::Completed(Completion::Response(Arc::new(StoredResponse::new(
            200,
            vec![("x-a", Bytes::from_static(b"1"))],
            Bytes::from_static(b"\x00\xff"),
        ))));
        let v = record_json(&key, &record(response.clone()), false, Some("00"), true);
        assert_eq!(v["body_bytes"], 2);
        assert!(v.get("body_base64").is_none(), "no body unless asked");
        assert_eq!(v["fingerprint_matches"], false);
        let v = record_json(&key, &record(response), true, None, true);
        assert_eq!(v["body_base64"], "AP8=");
        assert_eq!(v["headers"], serde_json::json!([["x-a", "1"]]));
    }
}
