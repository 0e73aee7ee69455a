//! The Prometheus registry shared by the proxy and the admin listener.
//!
//! Labels carry route names, results and store operations only: never a key, tenant, scope value
//! or body, so cardinality is bounded by the config.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, Metric, MetricFamily, MetricType};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Latency buckets in seconds, from 100 µs to 2 min: each default timeout (a backend's
/// `read_timeout`, 10 s; the request body's and the answer's 60 s) is a bucket's bound, so the
/// requests they cut off are told apart from slow ones.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];

/// Every metric idemgate exports.
pub struct Metrics {
    registry: Registry,
    /// Requests by route and `X-Idempotent-Result` (`FORWARD` for routes without idempotency).
    pub requests: IntCounterVec,
    /// End-to-end request latency by route and result.
    pub request_duration: HistogramVec,
    /// Time from sending a request upstream to the end of its response, by route.
    pub upstream_duration: HistogramVec,
    /// Record store call latency by operation.
    pub store_duration: HistogramVec,
    /// Record store failures by operation.
    pub store_errors: IntCounterVec,
    /// Completions or releases refused because the caller's lock had been taken over.
    pub fenced_writes: IntCounter,
    /// Responses stored as not replayable because they were still streaming as their lock was
    /// about to lapse.
    pub settled_streaming: IntCounter,
    /// Locks renewed while a backend's answer was still awaited.
    pub lock_renewals: IntCounter,
    /// Connections closed because a request header came too slowly (`reason="timeout"`), was
    /// too large (`reason="too_large"`) or could not be parsed (`reason="malformed"`).
    pub headers_refused: IntCounterVec,
    /// Requests that carried the idempotency key header but were forwarded without idempotency.
    pub unprotected_keys: IntCounterVec,
    /// Keys forwarded under a claim, by what became of them.
    pub key_outcomes: IntCounterVec,
    /// Keys run again after taking over another execution's lapsed lock.
    pub lapsed_takeovers: IntCounterVec,
    /// Requests out to each upstream now (its `max_in_flight` caps it).
    pub upstream_in_flight: IntGaugeVec,
    /// Requests answered 503 `upstream-busy` because their upstream was at `max_in_flight`.
    pub upstream_busy: IntCounterVec,
}

/// What became of a key whose request was forwarded under a claim: the label values of
/// `idemgate_key_outcomes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOutcome {
    /// Answered with a status the route stores: kept for replay.
    Stored,
    /// Ran, and recorded as executed but not replayable (too large, not relayable, still
    /// streaming as its lock ran short): retries get 409.
    NotReplayable,
    /// Answered with a status the route does not store (5xx, 408, 429): released for a retry.
    Released,
    /// Nothing reached the backend: released.
    Unreachable,
    /// Sent, and no complete answer came back: the claim is kept until its lock lapses.
    Unknown,
    /// Sent, no complete answer, and recorded as executed (`on_outcome_unknown: settle`).
    Settled,
}

impl KeyOutcome {
    /// Every one, each at the index of its discriminant.
    const ALL: [KeyOutcome; 6] = [
        KeyOutcome::Stored,
        KeyOutcome::NotReplayable,
        KeyOutcome::Released,
        KeyOutcome::Unreachable,
        KeyOutcome::Unknown,
        KeyOutcome::Settled,
    ];

    fn label(self) -> &'static str {
        match self {
            KeyOutcome::Stored => "stored",
            KeyOutcome::NotReplayable => "not_replayable",
            KeyOutcome::Released => "released",
            KeyOutcome::Unreachable => "unreachable",
            KeyOutcome::Unknown => "unknown",
            KeyOutcome::Settled => "settled",
        }
    }
}

impl Metrics {
    /// Creates and registers every metric in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "idemgate_requests_total",
                "Requests by route and idempotency result",
            ),
            &["route", "result"],
        )
        .expect("static metric definition");
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "idemgate_request_duration_seconds",
                "End-to-end request latency by route and result",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "result"],
        )
        .expect("static metric definition");
        let upstream_duration = HistogramVec::new(
            HistogramOpts::new(
                "idemgate_upstream_duration_seconds",
                "Backend latency (request sent to answer read) of the requests idemgate forwards itself, by route (not those pingora streams)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route"],
        )
        .expect("static metric definition");
        let store_duration = HistogramVec::new(
            HistogramOpts::new(
                "idemgate_store_operation_duration_seconds",
                "Record store latency by operation",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["op"],
        )
        .expect("static metric definition");
        let store_errors = IntCounterVec::new(
            Opts::new(
                "idemgate_store_errors_total",
                "Record store failures by operation",
            ),
            &["op"],
        )
        .expect("static metric definition");
        let fenced_writes = IntCounter::new(
            "idemgate_store_fenced_writes_total",
            "Completions or releases refused because another request took over the lock",
        )
        .expect("static metric definition");
        let settled_streaming = IntCounter::new(
            "idemgate_settled_streaming_total",
            "Responses stored as executed but not replayable because they were still streaming \
             when the lock was about to lapse",
        )
        .expect("static metric definition");
        let lock_renewals = IntCounter::new(
            "idemgate_lock_renewals_total",
            "Locks renewed because the backend's answer was still awaited, or its body still \
             streaming, at three quarters of lock_ttl",
        )
        .expect("static metric definition");
        let headers_refused = IntCounterVec::new(
            Opts::new(
                "idemgate_request_headers_refused_total",
                "Connections closed because a request header took longer than \
                 request_header_timeout (timeout), exceeded max_request_header_bytes (too_large) \
                 or could not be parsed (malformed), by listener (proxy or admin)",
            ),
            &["listener", "reason"],
        )
        .expect("static metric definition");
        for listener in ["proxy", "admin"] {
            for reason in ["timeout", "too_large", "malformed"] {
                headers_refused.with_label_values(&[listener, reason]);
            }
        }
        let unprotected_keys = IntCounterVec::new(
            Opts::new(
                "idemgate_unprotected_keys_total",
                "Requests that carried the idempotency key header but were forwarded without \
                 idempotency (a route without an idempotency block, a method the route does not \
                 list, or default_upstream), by route",
            ),
            &["route"],
        )
        .expect("static metric definition");
        let key_outcomes = IntCounterVec::new(
            Opts::new(
                "idemgate_key_outcomes_total",
                "Keys forwarded under a claim, by route and what became of them: stored, \
                 not_replayable, released, unreachable, unknown (answer lost, claim kept until \
                 lock_ttl), settled (answer lost, recorded as executed)",
            ),
            &["route", "outcome"],
        )
        .expect("static metric definition");
        let lapsed_takeovers = IntCounterVec::new(
            Opts::new(
                "idemgate_lapsed_takeovers_total",
                "Keys run again after their claim took over another execution's lapsed lock (that \
                 replica died, lost the store for longer than the lock, or never sent the \
                 request): a double execution if the first ran and the backend does not \
                 deduplicate by X-Idempotency-Id, by route",
            ),
            &["route"],
        )
        .expect("static metric definition");
        let upstream_in_flight = IntGaugeVec::new(
            Opts::new(
                "idemgate_upstream_in_flight",
                "Requests this process has out to the upstream now, by upstream",
            ),
            &["upstream"],
        )
        .expect("static metric definition");
        let upstream_busy = IntCounterVec::new(
            Opts::new(
                "idemgate_upstream_busy_total",
                "Requests answered 503 upstream-busy, not forwarded, because their upstream had \
                 max_in_flight requests out, by upstream",
            ),
            &["upstream"],
        )
        .expect("static metric definition");
        let build_info = IntGauge::with_opts(
            Opts::new("idemgate_build_info", "Build information")
                .const_label("version", env!("CARGO_PKG_VERSION")),
        )
        .expect("static metric definition");
        build_info.set(1);

        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(request_duration.clone()),
            Box::new(upstream_duration.clone()),
            Box::new(store_duration.clone()),
            Box::new(store_errors.clone()),
            Box::new(fenced_writes.clone()),
            Box::new(settled_streaming.clone()),
            Box::new(lock_renewals.clone()),
            Box::new(headers_refused.clone()),
            Box::new(unprotected_keys.clone()),
            Box::new(key_outcomes.clone()),
            Box::new(lapsed_takeovers.clone()),
            Box::new(upstream_in_flight.clone()),
            Box::new(upstream_busy.clone()),
            Box::new(build_info),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            requests,
            request_duration,
            upstream_duration,
            store_duration,
            store_errors,
            fenced_writes,
            settled_streaming,
            lock_renewals,
            headers_refused,
            unprotected_keys,
            key_outcomes,
            lapsed_takeovers,
            upstream_in_flight,
            upstream_busy,
        }
    }

    /// Resolves the per-route children once (per config), so the request path does no label
    /// hashing: `results` are the `result` label values, indexed as the caller indexes them.
    pub fn route_handles(&self, route: &str, results: &'static [&'static str]) -> RouteHandles {
        for result in results {
            // Exported at 0 from now on; the request path resolves it again with its histogram.
            self.requests.with_label_values(&[route, result]);
        }
        RouteHandles {
            route: route.to_owned(),
            results,
            requests: self.requests.clone(),
            request_duration: self.request_duration.clone(),
            children: results.iter().map(|_| OnceLock::new()).collect(),
            upstream_vec: self.upstream_duration.clone(),
            upstream: OnceLock::new(),
            unprotected: self.unprotected_keys.with_label_values(&[route]),
            outcomes: KeyOutcome::ALL.map(|outcome| {
                self.key_outcomes
                    .with_label_values(&[route, outcome.label()])
            }),
            lapsed: self.lapsed_takeovers.with_label_values(&[route]),
        }
    }

    /// Resolves the children of one store operation.
    pub fn store_op(&self, op: &str) -> StoreOpHandles {
        StoreOpHandles {
            duration: self.store_duration.with_label_values(&[op]),
            errors: self.store_errors.with_label_values(&[op]),
        }
    }

    /// Registers several metrics read from one shared `owner` at every scrape: one
    /// `(name, help, kind, read)` per metric. The usual shape for a component's stats struct.
    pub fn pull_from<T: ?Sized + Send + Sync + 'static>(
        &self,
        owner: &Arc<T>,
        metrics: &[PulledMetric<T>],
    ) {
        for &(name, help, kind, read) in metrics {
            let owner = owner.clone();
            let value = move || read(&owner);
            match kind {
                Pull::Counter => self.pull_counter(name, help, value),
                Pull::Gauge => self.pull_gauge(name, help, value),
            }
        }
    }

    /// Registers a gauge read from `value` at every scrape (state owned elsewhere, e.g. the
    /// store layers' atomics, which must not depend on this module).
    pub fn pull_gauge(
        &self,
        name: &str,
        help: &str,
        value: impl Fn() -> f64 + Send + Sync + 'static,
    ) {
        let value = Box::new(move || vec![(String::new(), value())]);
        self.register_pulled(name, help, MetricType::GAUGE, None, value);
    }

    /// Registers a counter read from `value` (monotonic) at every scrape.
    pub fn pull_counter(
        &self,
        name: &str,
        help: &str,
        value: impl Fn() -> f64 + Send + Sync + 'static,
    ) {
        let value = Box::new(move || vec![(String::new(), value())]);
        self.register_pulled(name, help, MetricType::COUNTER, None, value);
    }

    /// Registers a family of counters with one label, read at every scrape: `values` gives each
    /// label value and its count (e.g. calls by script version, a set the config bounds).
    pub fn pull_counters(
        &self,
        name: &str,
        help: &str,
        label: &str,
        values: impl Fn() -> Vec<(String, f64)> + Send + Sync + 'static,
    ) {
        self.register_pulled(
            name,
            help,
            MetricType::COUNTER,
            Some(label),
            Box::new(values),
        );
    }

    fn register_pulled(
        &self,
        name: &str,
        help: &str,
        kind: MetricType,
        label: Option<&str>,
        value: PullFn,
    ) {
        match Pulled::new(name, help, kind, label, value) {
            Ok(p) => {
                if let Err(e) = self.registry.register(Box::new(p)) {
                    tracing::warn!(metric = name, error = %e, "metric not registered");
                }
            }
            Err(e) => tracing::warn!(metric = name, error = %e, "metric not registered"),
        }
    }

    /// Renders the registry in the Prometheus text exposition format.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 * 1024);
        // Encoding into a Vec cannot fail for well-formed metric families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// The Prometheus type of a pulled metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pull {
    /// Monotonic.
    Counter,
    /// Goes up and down.
    Gauge,
}

/// One metric of [`Metrics::pull_from`]: name, help, type, and how to read it from the owner.
pub type PulledMetric<T> = (&'static str, &'static str, Pull, fn(&T) -> f64);

/// Metric children of one route, resolved once, so the request path does no label hashing.
/// Every counter is exported from the start, at 0: an alert on `increase()` sees a first event
/// only as a step from an earlier sample, and a series born at 1 has none. Histograms are
/// created on first use, so only (route, result) pairs that happened export their buckets.
pub struct RouteHandles {
    route: String,
    results: &'static [&'static str],
    requests: IntCounterVec,
    request_duration: HistogramVec,
    children: Vec<OnceLock<(IntCounter, Histogram)>>,
    upstream_vec: HistogramVec,
    upstream: OnceLock<Histogram>,
    unprotected: IntCounter,
    outcomes: [IntCounter; KeyOutcome::ALL.len()],
    lapsed: IntCounter,
}

impl RouteHandles {
    /// Counts one request with result index `result` that took `seconds`.
    pub fn observe(&self, result: usize, seconds: f64) {
        let Some(cell) = self.children.get(result) else {
            return;
        };
        let (count, duration) = cell.get_or_init(|| {
            let labels = [self.route.as_str(), self.results[result]];
            (
                self.requests.with_label_values(&labels),
                self.request_duration.with_label_values(&labels),
            )
        });
        count.inc();
        duration.observe(seconds);
    }

    /// Records one backend round of this route.
    pub fn observe_upstream(&self, seconds: f64) {
        self.upstream
            .get_or_init(|| self.upstream_vec.with_label_values(&[self.route.as_str()]))
            .observe(seconds);
    }

    /// Counts a request of this route that carried the idempotency key header and was
    /// forwarded without idempotency: a client that believes it is protected and is not.
    pub fn count_unprotected_key(&self) {
        self.unprotected.inc();
    }

    /// Counts a key of this route run again after taking over another execution's lapsed lock.
    pub fn count_lapsed_takeover(&self) {
        self.lapsed.inc();
    }

    /// Counts what became of a key of this route forwarded under a claim.
    pub fn count_key_outcome(&self, outcome: KeyOutcome) {
        self.outcomes[outcome as usize].inc();
    }
}

/// Metric children of one store operation.
pub struct StoreOpHandles {
    /// Latency.
    pub duration: Histogram,
    /// Failures.
    pub errors: IntCounter,
}

/// Label values and their readings; the label value is ignored for an unlabelled metric.
type PullFn = Box<dyn Fn() -> Vec<(String, f64)> + Send + Sync>;

/// A metric (or a family with one label) whose values are read at scrape time.
struct Pulled {
    desc: Desc,
    kind: MetricType,
    label: Option<String>,
    value: PullFn,
}

impl Pulled {
    fn new(
        name: &str,
        help: &str,
        kind: MetricType,
        label: Option<&str>,
        value: PullFn,
    ) -> prometheus::Result<Self> {
        let desc = Desc::new(
            name.to_string(),
            help.to_string(),
            label.iter().map(|l| l.to_string()).collect(),
            HashMap::new(),
        )?;
        Ok(Pulled {
            desc,
            kind,
            label: label.map(str::to_owned),
            value,
        })
    }
}

impl Collector for Pulled {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let metrics: Vec<Metric> = (self.value)()
            .into_iter()
            .map(|(label_value, v)| {
                let mut m = if self.kind == MetricType::COUNTER {
                    let mut c = proto::Counter::default();
                    c.set_value(v);
                    let mut m = Metric::default();
                    m.set_counter(c);
                    m
                } else {
                    let mut g = proto::Gauge::default();
                    g.set_value(v);
                    Metric::from_gauge(g)
                };
                if let Some(name) = &self.label {
                    let mut pair = proto::LabelPair::default();
                    pair.set_name(name.clone());
                    pair.set_value(label_value);
                    m.set_label(vec![pair]);
                }
                m
            })
            .collect();
        if metrics.is_empty() {
            return Vec::new();
        }
        let mut family = MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(self.kind);
        family.set_metric(metrics);
        vec![family]
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_timeouts_are_bucket_bounds() {
        let config = crate::config::Config::from_yaml_str(
            "upstreams: {app: {addrs: [\"127.0.0.1:8080\"]}}\n\
             routes: [{name: orders, path_prefix: /orders, upstream: app}]\n",
        )
        .expect("valid config");
        let up = &config.upstreams[0];
        for timeout in [
            up.read_timeout,
            up.write_timeout,
            config.request_body_timeout,
            config.request_body_total_timeout,
            config.response_send_timeout,
        ] {
            assert!(
                LATENCY_BUCKETS.contains(&timeout.as_secs_f64()),
                "{timeout:?} is no bucket bound"
            );
        }
    }

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::new();
        m.requests.with_label_values(&["orders", "HIT"]).inc();
        m.request_duration
            .with_label_values(&["orders", "HIT"])
            .observe(0.002);
        let text = String::from_utf8(m.render()).unwrap();
        assert!(text.contains("idemgate_requests_total{result=\"HIT\",route=\"orders\"} 1"));
        assert!(text.contains("idemgate_request_duration_seconds_bucket"));
        assert!(text.contains("idemgate_build_info"));
    }

    #[test]
    fn pulled_metrics_are_read_at_scrape_time() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let m = Metrics::new();
        let hits = Arc::new(AtomicU64::new(0));
        let h = hits.clone();
        m.pull_counter("idemgate_test_hits_total", "hits", move || {
            h.load(Ordering::Relaxed) as f64
        });
        m.pull_gauge("idemgate_test_fill_ratio", "fill", || 0.25);
        hits.store(7, Ordering::Relaxed);
        let text = String::from_utf8(m.render()).unwrap();
        assert!(
            text.contains("# TYPE idemgate_test_hits_total counter"),
            "{text}"
        );
        assert!(text.contains("idemgate_test_hits_total 7"));
        assert!(text.contains("idemgate_test_fill_ratio 0.25"));
    }

    #[test]
    fn pulled_counter_families_carry_their_label() {
        let m = Metrics::new();
        m.pull_counters("idemgate_test_calls_total", "calls", "version", || {
            vec![("v1".into(), 3.0), ("v2".into(), 1.0)]
        });
        m.pull_counters("idemgate_test_empty_total", "none yet", "version", Vec::new);
        let text = String::from_utf8(m.render()).unwrap();
        assert!(
            text.contains("idemgate_test_calls_total{version=\"v1\"} 3"),
            "{text}"
        );
        assert!(text.contains("idemgate_test_calls_total{version=\"v2\"} 1"));
        assert!(!text.contains("idemgate_test_empty_total"));
    }
}
