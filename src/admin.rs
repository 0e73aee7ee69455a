//! The admin listener: liveness, readiness and Prometheus metrics, on loopback by default.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::{Config, OnUnavailable};
use crate::metrics::Metrics;
use crate::proxy::Generation;
use crate::reload::{ReloadOutcome, Reloader};
use crate::store::{RecordStore, RedisStore};

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
    /// The Redis store, for `GET /admin/scripts`; `None` with the memory store.
    scripts: Option<Arc<RedisStore>>,
}

impl Admin {
    /// Creates the admin application over the proxy's shared state.
    pub fn new(
        current: Arc<ArcSwap<Generation>>,
        store: Arc<dyn RecordStore>,
        metrics: Arc<Metrics>,
        readiness: Arc<Readiness>,
        reloader: Arc<Reloader>,
    ) -> Self {
        Admin {
            current,
            store,
            metrics,
            readiness,
            reloader,
            scripts: None,
        }
    }

    /// Serves `GET /admin/scripts` from this Redis store.
    pub fn with_scripts(mut self, store: Arc<RedisStore>) -> Self {
        self.scripts = Some(store);
        self
    }

    /// Script versions, SHAs, the canary and per-version counters.
    fn scripts(&self) -> Response<Vec<u8>> {
        match &self.scripts {
            Some(store) => json(
                StatusCode::OK,
                serde_json::to_value(store.scripts_status()).unwrap_or_default(),
            ),
            None => json(
                StatusCode::NOT_FOUND,
                serde_json::json!({ "error": "no scripts: store.backend is not redis" }),
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
        let given = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        constant_time_eq(given, expected.as_bytes())
    }

    async fn reload(&self) -> Response<Vec<u8>> {
        let reloader = self.reloader.clone();
        let result = tokio::task::spawn_blocking(move || reloader.reload("admin"))
            .await
            .unwrap_or_else(|e| Err(format!("reload task failed: {e}")));
        match result {
            Ok(ReloadOutcome::Applied { hash }) => json(
                StatusCode::OK,
                serde_json::json!({ "result": "applied", "hash": hash }),
            ),
            Ok(ReloadOutcome::Unchanged) => {
                json(StatusCode::OK, serde_json::json!({ "result": "unchanged" }))
            }
            Err(error) => json(
                StatusCode::UNPROCESSABLE_ENTITY,
                serde_json::json!({ "result": "refused", "error": error }),
            ),
        }
    }

    fn config(&self) -> Response<Vec<u8>> {
        let generation = self.current.load();
        let mut body = config_json(&generation.config);
        body["loaded_at_unix"] = self.reloader.loaded_at().into();
        body["path"] = self.reloader.path().display().to_string().into();
        json(StatusCode::OK, body)
    }

    async fn ready(&self) -> (StatusCode, String) {
        if self.readiness.is_draining() {
            return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
        }
        let policy = self.current.load().config.store.on_unavailable;
        match self.store.ping().await {
            Ok(()) => (StatusCode::OK, "ready\n".into()),
            Err(e) if policy != OnUnavailable::Reject => {
                (StatusCode::OK, format!("ready (store degraded: {e})\n"))
            }
            Err(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("store unavailable: {e}\n"),
            ),
        }
    }

    fn refresh_store_gauges(&self) {
        if let Some(u) = self.store.usage() {
            self.metrics.store_records.set(u.records as i64);
            self.metrics.store_bytes.set(u.bytes as i64);
            self.metrics.store_capacity_bytes.set(u.capacity as i64);
        }
    }
}

/// Compares two byte strings in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
                    "ttl": secs(i.ttl), "lock_ttl": secs(i.lock_ttl),
                    "on_in_flight": format!("{:?}", i.on_in_flight).to_lowercase(),
                    "wait_timeout": secs(i.wait_timeout),
                    "fingerprint": { "body": i.fingerprint_body,
                        "headers": i.fingerprint_headers.iter().map(|h| h.as_str()).collect::<Vec<_>>() },
                    "scope_headers": i.scope_headers.iter().map(|h| h.as_str()).collect::<Vec<_>>(),
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
        })
    });
    json!({
        "hash": c.source_hash,
        "listen": c.listen.to_string(),
        "threads": c.threads,
        "admin": { "listen": c.admin.listen.to_string(), "token": c.admin.token.as_ref().map(|_| "<redacted>") },
        "upstreams": upstreams,
        "default_upstream": c.default_upstream.and_then(|i| c.upstreams.get(i)).map(|u| u.name.as_str()),
        "idempotency": {
            "key_header": c.idempotency.key_header.as_str(),
            "tenant_header": c.idempotency.tenant_header.as_str(),
            "default_tenant": c.idempotency.default_tenant,
            "worker_id": c.idempotency.worker_id,
        },
        "store": {
            "backend": format!("{:?}", c.store.backend).to_lowercase(),
            "on_unavailable": format!("{:?}", c.store.on_unavailable).to_lowercase(),
            "memory": { "capacity_bytes": c.store.memory.capacity_bytes, "shards": c.store.memory.shards },
            "redis": redis,
        },
        "routes": routes,
    })
}

fn unauthorized() -> Response<Vec<u8>> {
    let mut resp = json(
        StatusCode::UNAUTHORIZED,
        serde_json::json!({ "error": "a valid bearer token is required (admin.token)" }),
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
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        let is_get = req.method == http::Method::GET || req.method == http::Method::HEAD;
        let is_post = req.method == http::Method::POST;
        let path = req.uri.path().to_owned();
        match (is_get, path.as_str()) {
            (true, "/admin/config") => self.config(),
            (true, "/admin/scripts") => self.scripts(),
            (false, "/admin/scripts") => text(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                b"method not allowed\n".to_vec(),
            ),
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
            (true, "/metrics") => {
                self.refresh_store_gauges();
                text(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    self.metrics.render(),
                )
            }
            (_, "/healthz" | "/readyz" | "/metrics" | "/admin/config" | "/admin/reload") => text(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                b"method not allowed\n".to_vec(),
            ),
            _ => text(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
        }
    }
}
