//! The admin listener: liveness, readiness and Prometheus metrics, on loopback by default.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::OnUnavailable;
use crate::metrics::Metrics;
use crate::proxy::Generation;
use crate::store::RecordStore;

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
}

impl Admin {
    /// Creates the admin application over the proxy's shared state.
    pub fn new(
        current: Arc<ArcSwap<Generation>>,
        store: Arc<dyn RecordStore>,
        metrics: Arc<Metrics>,
        readiness: Arc<Readiness>,
    ) -> Self {
        Admin {
            current,
            store,
            metrics,
            readiness,
        }
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
        match (is_get, req.uri.path()) {
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
            (false, "/healthz" | "/readyz" | "/metrics") => text(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                b"method not allowed\n".to_vec(),
            ),
            _ => text(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
        }
    }
}
