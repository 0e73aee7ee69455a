//! Wires the pingora server: proxy and admin services, background work, logging, and a SIGTERM
//! drain that exits as soon as in-flight requests (and their records) are done.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;
use tokio::signal::unix::{signal, SignalKind};

use crate::admin::{Admin, Readiness};
use crate::config::{Config, StoreBackend};
use crate::headguard::{Guarded, HeaderRefusals};
use crate::metrics::{Metrics, Pull};
use crate::proxy::{Gate, Generation, InFlightCounter};
use crate::reload::Reloader;
use crate::script_reload::ScriptReloader;
use crate::snowflake;
use crate::store::breaker::{Breaker, BreakerOptions};
use crate::store::cached::{CachedStore, LocalCacheOptions};
use crate::store::eviction;
use crate::store::purge::PurgeBus;
use crate::store::restarts::{self, Restarts};
use crate::store::retry::{CompletionRetrier, LetterStore, LocalHooks, RetryOptions};
use crate::store::{ForgetLocal, MemoryStore, RecordKey, RecordStore, RedisStore, StoreUsage};
use crate::worker_lease::{Lease, WorkerIdSource, WorkerIds};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config is valid YAML but cannot be run (an upstream does not resolve, ...).
    #[error("{0}")]
    Config(String),
    /// A listener's address cannot be bound (in use, not this host's, a privileged port).
    #[error("{field}: cannot listen on {addr}: {error}")]
    Listen {
        /// The config key naming the address.
        field: &'static str,
        /// The address.
        addr: String,
        /// Why the bind failed.
        error: std::io::Error,
    },
    /// The run ended with dead letters the dead-letter file never took (a disk that hung, or
    /// another process holding its lock): completions lost. Not a start error, but the exit
    /// must not say all went well.
    #[error("{lost} dead letters could not be written at exit; they are lost")]
    DeadLettersLost {
        /// How many.
        lost: usize,
    },
}

/// `IDEMGATE_WORKER_ID`, which lets each pod of one Deployment get its own id (e.g. from a
/// StatefulSet ordinal) without rendering a config per pod. A value that is set but not an id
/// is an error, not a fallback: the hashed host name could give two replicas the same id.
/// Empty counts as unset. `--check` asks too, so it refuses what a run would.
pub fn worker_id_from_env() -> Result<Option<u16>, String> {
    match std::env::var("IDEMGATE_WORKER_ID") {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => match v.trim().parse::<u16>() {
            Ok(id) if id <= snowflake::MAX_WORKER_ID => Ok(Some(id)),
            _ => Err(format!(
                "IDEMGATE_WORKER_ID: {v:?} is not a worker id (0-{})",
                snowflake::MAX_WORKER_ID
            )),
        },
    }
}

/// Binds `addr` and lets it go again, so an address that cannot be listened on stops the start
/// with a message naming its key. pingora binds its listeners only inside their services'
/// tasks, where a failure ends that task and nothing else: the process would run on with no
/// proxy listener (or no admin one) and report itself ready.
fn check_bindable(field: &'static str, addr: &str) -> Result<(), StartError> {
    std::net::TcpListener::bind(addr)
        .map(drop)
        .map_err(|error| StartError::Listen {
            field,
            addr: addr.to_string(),
            error,
        })
}

/// The record store as the proxy uses it, with the handles metrics and background work need.
struct StoreStack {
    store: Arc<dyn RecordStore>,
    /// The store beneath the local cache (the same as `store` when there is no cache): what the
    /// completion retrier writes to and checks.
    shared: Arc<dyn RecordStore>,
    /// The local fast path in front of Redis, when it is on.
    cache: Option<Arc<LocalCache>>,
    memory: Arc<MemoryStore>,
    fallback: Option<Arc<dyn RecordStore>>,
    redis: Option<Arc<RedisStore>>,
    /// Announces admin purges to every replica.
    purge: Option<PurgeBus>,
}

/// The local cache as the Redis store stack builds it.
type LocalCache = CachedStore<Arc<Breaker<Arc<RedisStore>>>>;

impl StoreStack {
    /// Drops every copy of a record this replica read from Redis (nothing without a local
    /// cache), saying `why` in the log: the purge channel was subscribed again, or a Redis
    /// server restarted or was replaced; then, Redis being back, drops the completions given
    /// up on that it holds after all.
    fn forget_copies(&self, why: &'static str) -> Arc<dyn Fn() + Send + Sync> {
        match &self.cache {
            Some(cache) => {
                let cache = cache.clone();
                Arc::new(move || {
                    let dropped = cache.forget_copies();
                    if dropped > 0 {
                        tracing::info!(dropped, "{why}");
                    }
                    // Called by the purge listener, on its runtime.
                    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                        return;
                    };
                    let cache = cache.clone();
                    // It logs what it finds.
                    runtime.spawn(async move { cache.check_given_up().await });
                })
            }
            None => Arc::new(|| {}),
        }
    }

    /// Drops this replica's local copy of a record (nothing without a local cache).
    fn forget_local(&self) -> ForgetLocal {
        let cache = self.cache.clone();
        // The fallback holds what this replica ran during an outage under `local`: a purged
        // key must not be replayed from it either.
        let fallback = self.fallback.is_some().then(|| self.memory.clone());
        Arc::new(move |key: &RecordKey| {
            if let Some(cache) = &cache {
                cache.forget(key);
            }
            // A claim the fallback holds stays (its lock running or lapsed): a retry here would
            // otherwise find the key free in Redis and run it beside that execution. (The
            // replica a forced purge was asked of removes its own; the announcement says
            // nothing of force, and another replica's running execution is no stuck record.)
            if let Some(memory) = &fallback {
                let _ = memory.remove_settled(key);
            }
        })
    }

    /// What the completion retrier tells the local cache (nothing without one): a completion
    /// that lost its key is dropped, one the retry stored becomes a copy that a missed purge
    /// can take ([`CachedStore::completion_stored`]), and one given up on without knowing
    /// whether the store took it is checked against the store later
    /// ([`CachedStore::completion_given_up`]).
    fn retry_hooks(&self) -> LocalHooks {
        match &self.cache {
            Some(cache) => cache.retry_hooks(),
            None => LocalHooks::none(),
        }
    }
}

/// The longest route `ttl`: how long a completed record can be replayed, so how long the local
/// cache's Bloom filter must remember a key.
fn longest_ttl(config: &Config) -> Duration {
    config
        .routes
        .iter()
        .filter_map(|r| r.idempotency.as_ref().map(|i| i.ttl))
        .max()
        .unwrap_or(Duration::from_secs(24 * 3600))
}

/// Builds the store: the embedded one, or Redis behind a circuit breaker and the local fast path.
fn build_store(config: &Config, metrics: &Metrics) -> Result<StoreStack, StartError> {
    let memory = Arc::new(MemoryStore::new(
        config.store.memory.capacity_bytes,
        config.store.memory.shards,
    ));
    let settings = match (config.store.backend, &config.store.redis) {
        (StoreBackend::Memory, _) => {
            return Ok(StoreStack {
                store: memory.clone(),
                shared: memory.clone(),
                cache: None,
                memory,
                fallback: None,
                redis: None,
                purge: None,
            })
        }
        (StoreBackend::Redis, Some(settings)) => settings,
        (StoreBackend::Redis, None) => {
            return Err(StartError::Config(
                "store.backend: redis needs a store.redis block".into(),
            ))
        }
    };
    // Redis is not contacted here: a proxy must start while Redis is down. The warm-up
    // service connects in the background; until then operations connect on demand and fail
    // as unavailable (the outage policy decides what the client gets).
    let redis = Arc::new(RedisStore::new(settings).map_err(|e| StartError::Config(e.to_string()))?);
    tracing::info!(redis = ?settings, scripts = %redis.scripts_version(), "record store: redis");
    register_script_metrics(metrics, &redis);

    let b = &config.store.circuit_breaker;
    let breaker = Arc::new(Breaker::new(
        redis.clone(),
        BreakerOptions {
            failure_threshold: b.failure_threshold,
            open_for: b.open_for,
        },
    ));
    metrics.pull_from(
        &breaker.view(),
        &[
            (
                "idemgate_store_circuit_state",
                "Store circuit: 0 closed, 1 open, 2 half-open (on a Cluster, the worst over its \
                 parts: 1 while any part's circuit is open)",
                Pull::Gauge,
                |v| v.state() as u8 as f64,
            ),
            (
                "idemgate_store_circuit_opened_total",
                "Times the store circuit opened (a circuit of a part of a Cluster counts alone)",
                Pull::Counter,
                |v| v.opened.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_store_circuit_open_parts",
                "Parts of the store whose circuit is open or half-open (a Cluster has 64, one \
                 per 256 slots; other topologies one)",
                Pull::Gauge,
                |v| v.open_parts() as f64,
            ),
            (
                "idemgate_store_circuit_parts",
                "Parts of the store with a circuit of their own",
                Pull::Gauge,
                |v| v.parts() as f64,
            ),
        ],
    );

    let c = &config.store.local_cache;
    let cache = if c.enabled {
        let options = LocalCacheOptions {
            capacity_bytes: c.capacity_bytes,
            expected_items: c.expected_items,
            false_positive_rate: c.false_positive_rate,
            window: longest_ttl(config),
        };
        let cached =
            Arc::new(CachedStore::new(breaker.clone(), options).map_err(StartError::Config)?);
        register_cache_metrics(metrics, &cached);
        Some(cached)
    } else {
        None
    };
    let store: Arc<dyn RecordStore> = match &cache {
        Some(cached) => cached.clone(),
        None => breaker.clone(),
    };
    // Built whatever the policy at start: `on_unavailable` applies live, and a switch to
    // `local` by reload needs somewhere to fall back to.
    let fallback = Some(memory.clone() as Arc<dyn RecordStore>);
    let bus = PurgeBus::new(settings, redis.tls_certificates().as_ref());
    let purge = match bus {
        Ok(bus) => Some(bus),
        Err(e) => {
            tracing::warn!(error = %e, "purges will not reach other replicas");
            None
        }
    };
    Ok(StoreStack {
        store,
        shared: breaker,
        cache,
        memory,
        fallback,
        redis: Some(redis),
        purge,
    })
}

/// Per-version script calls and errors, the canary's share in force, rollbacks and script
/// reloads, read from the Redis store at scrape time.
fn register_script_metrics(metrics: &Metrics, redis: &Arc<RedisStore>) {
    let per_version = |pick: fn(&(String, u64, u64)) -> u64| {
        let weak = Arc::downgrade(redis);
        move || {
            weak.upgrade().map_or_else(Vec::new, |store| {
                store
                    .version_counts()
                    .iter()
                    .map(|entry| (entry.0.clone(), pick(entry) as f64))
                    .collect()
            })
        }
    };
    metrics.pull_counters(
        "idemgate_script_calls_total",
        "Redis script calls by script version",
        "version",
        per_version(|entry| entry.1),
    );
    metrics.pull_counters(
        "idemgate_script_errors_total",
        "Redis script calls the script itself failed (Lua error, unexpected reply), by version",
        "version",
        per_version(|entry| entry.2),
    );
    metrics.pull_from(
        redis,
        &[
            ("idemgate_script_canary_percent", "Share of record ids the canary script version takes now (0: none or rolled back)", Pull::Gauge, |s| f64::from(s.canary_percent())),
            ("idemgate_script_canary_rollbacks_total", "Canary script versions rolled back for their error rate", Pull::Counter, |s| s.canary_rollbacks() as f64),
            ("idemgate_script_reloads_total", "Script changes (files or config) applied after start-up", Pull::Counter, |s| s.script_reloads() as f64),
            ("idemgate_script_reload_failures_total", "Script changes refused (unreadable, or Redis would not load them); the old scripts stay", Pull::Counter, |s| s.script_reload_failures() as f64),
            ("idemgate_redis_tls_reloads_total", "Changed store.redis.tls files taken into use without a restart", Pull::Counter, |s| s.tls_reloads() as f64),
            ("idemgate_redis_tls_reload_failures_total", "Changed store.redis.tls files refused (unreadable, or no PEM); the previous files stay", Pull::Counter, |s| s.tls_reload_failures() as f64),
            ("idemgate_store_unanswered_claims_released_total", "Claims whose answer never came (their request was answered 503) that reached Redis after all and were released, so the retry runs rather than meet 409 until lock_ttl", Pull::Counter, |s| s.unanswered_claims_released() as f64),
            ("idemgate_store_redis_may_evict", "1 while Redis may evict records (maxmemory with a maxmemory-policy other than noeviction, on some primary), 0 while it may not, -1 not known (not read yet, or INFO refused)", Pull::Gauge, |s| f64::from(s.may_evict())),
        ],
    );
}

fn register_cache_metrics<S: RecordStore>(metrics: &Metrics, cached: &Arc<CachedStore<S>>) {
    metrics.pull_from(
        &cached.stats(),
        &[
            (
                "idemgate_local_cache_hits_total",
                "Retries answered from the local cache without a store round trip",
                Pull::Counter,
                |s| s.hits.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_local_cache_copies_total",
                "Completed records read from the store (completed by another replica) and copied into the local cache",
                Pull::Counter,
                |s| s.copied.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_waits_ended_here_total",
                "Waits (on_in_flight: wait) answered when a claim of this replica ended, with no store read",
                Pull::Counter,
                |s| s.waits_ended_here.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_waits_shared_total",
                "Waits answered by another waiter's poll of the store on this replica",
                Pull::Counter,
                |s| s.waits_shared.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_bloom_negatives_total",
                "Claims the Bloom filter sent straight to the store",
                Pull::Counter,
                |s| s.bloom_negatives.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_bloom_false_positives_total",
                "Bloom positives the local cache could not answer",
                Pull::Counter,
                |s| s.bloom_false_positives.load(Ordering::Relaxed) as f64,
            ),
        ],
    );
    metrics.pull_from(
        cached,
        &[
            (
                "idemgate_bloom_fill_ratio",
                "Fraction of bits set in the current Bloom filter generation",
                Pull::Gauge,
                |c| c.bloom_fill_ratio(),
            ),
            (
                "idemgate_local_cache_bytes",
                "Bytes held by the local cache of completed records",
                Pull::Gauge,
                |c| c.cache_usage().1 as f64,
            ),
        ],
    );
}

/// Longest wait that goes on pingora's timer wheel; longer ones go on tokio's. pingora's
/// timers stay registered until they fire, one per 10 ms with a registration per worker thread,
/// even when the wait ended at once: a timeout of an hour (`read_timeout`, `lock_ttl`'s
/// renewal alarm) would keep up to 360,000 of them per thread under steady load. tokio's are
/// removed when the wait ends. pingora's default is 15 minutes.
const FAST_TIMER_LIMIT_SECS: u64 = 60;

/// pingora's server settings for `config`.
fn server_conf(config: &Config) -> ServerConf {
    ServerConf {
        threads: config.threads,
        work_stealing: config.work_stealing,
        grace_period_seconds: Some(config.shutdown.grace_period.as_secs()),
        graceful_shutdown_timeout_seconds: Some(
            config.shutdown.graceful_shutdown_timeout.as_secs(),
        ),
        fast_timeout_to_tokio_threshold_seconds: Some(FAST_TIMER_LIMIT_SECS),
        ..ServerConf::default()
    }
}

/// Runs the proxy until shutdown. Returns once pingora has stopped (SIGINT, SIGQUIT, or a
/// SIGTERM whose drain ran to the grace period); a SIGTERM drain that finishes early exits the
/// process with status 0 directly. `config_path` is watched for live edits.
pub fn run(config_path: PathBuf, config: Config, on_exit: fn()) -> Result<(), StartError> {
    let metrics = Arc::new(Metrics::new());
    let stack = build_store(&config, &metrics)?;
    let from_env = worker_id_from_env().map_err(StartError::Config)?;
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    let ids = Arc::new(match (config.idempotency.worker_id, from_env) {
        (Some(id), _) => WorkerIds::fixed(id, WorkerIdSource::Config),
        (None, Some(id)) => WorkerIds::fixed(id, WorkerIdSource::Environment),
        // Replicas share the Redis store, so their ids must not repeat each other's.
        (None, None) if stack.redis.is_some() => {
            WorkerIds::to_lease(snowflake::default_worker_id())
        }
        (None, None) => WorkerIds::fixed(snowflake::default_worker_id(), WorkerIdSource::HostName),
    });
    let worker_lease = config.idempotency.worker_lease;

    let grace_period = config.shutdown.grace_period;
    let mut conf = server_conf(&config);
    let pid = std::process::id();
    let tmp = std::env::temp_dir();
    conf.pid_file = tmp
        .join(format!("idemgate-{pid}.pid"))
        .display()
        .to_string();
    conf.upgrade_sock = tmp
        .join(format!("idemgate-{pid}.sock"))
        .display()
        .to_string();
    let listen = config.listen.to_string();
    let admin_listen = config.admin.listen.to_string();
    check_bindable("listen", &listen)?;
    check_bindable("admin.listen", &admin_listen)?;
    let r = &config.store.completion_retry;
    let retry_options = RetryOptions {
        attempts: r.attempts,
        base_delay: r.base_delay,
        max_delay: r.max_delay,
        queue_capacity: r.queue_capacity,
        queue_bytes: r.queue_bytes,
        dead_letter_path: r.dead_letter_path.clone(),
        store: match &config.store.redis {
            Some(redis) if config.store.backend == StoreBackend::Redis => LetterStore::Redis {
                key_prefix: redis.key_prefix.clone(),
            },
            _ => LetterStore::Memory,
        },
    };
    // Found out now, not when a completion the store never took has nowhere else to go.
    match crate::store::retry::open_dead_letter_file(&r.dead_letter_path) {
        Ok(file) => {
            if let Some(mode) = crate::store::retry::dead_letter_file_exposed(&file) {
                tracing::warn!(
                    path = %r.dead_letter_path.display(),
                    mode = %format_args!("{mode:o}"),
                    "the dead-letter file can be read by other users, and its lines hold whole \
                     responses: chmod 600 it"
                );
            }
        }
        Err(e) => tracing::error!(
            path = %r.dead_letter_path.display(),
            error = %e,
            "the dead-letter file cannot be opened: a completion the store never takes will \
             be only in the log (store.completion_retry.dead_letter_path)"
        ),
    }
    // Unlike idemgate_dead_letters_total, this survives a restart: the letters stay in the
    // file until it is renamed aside to be reconciled.
    let dead_letter_path = r.dead_letter_path.clone();
    metrics.pull_gauge(
        "idemgate_dead_letter_file_bytes",
        "Size of the dead-letter file under its configured path (0 when absent or empty, -1 when \
         it cannot be read): above 0 until it is renamed aside and reconciled, across restarts",
        move || dead_letter_file_bytes(&dead_letter_path),
    );

    let generation = Generation::new(config, &metrics).map_err(StartError::Config)?;
    let current = Arc::new(ArcSwap::from_pointee(generation));
    let in_flight = Arc::new(InFlightCounter::default());
    let readiness = Arc::new(Readiness::default());
    let reloader = Reloader::new(config_path, current.clone(), metrics.clone());
    if let Some(cache) = stack.cache.clone() {
        // A reload that raises a route's ttl must not leave the filter forgetting keys whose
        // records are still replayed.
        reloader.on_swap(move |config| cache.set_window(longest_ttl(config)));
    }
    let script_reloader = stack.redis.clone().map(ScriptReloader::new);
    if let Some(scripts) = &script_reloader {
        let scripts = scripts.clone();
        reloader.on_swap(move |config| {
            if let Some(redis) = &config.store.redis {
                scripts.config_changed(&redis.scripts);
            }
        });
    }

    // Only a store that knows its size (the embedded one) exports it.
    if stack.store.usage().is_some() {
        register_usage_metrics(
            &metrics,
            &stack.store,
            [
                ("idemgate_store_records", "Records held by the store"),
                ("idemgate_store_bytes", "Bytes held by the store"),
                (
                    "idemgate_store_capacity_bytes",
                    "Byte capacity of the store",
                ),
                (
                    "idemgate_store_answers_kept_as_status_total",
                    "Answers the full store had no room for, kept as their status alone \
                     (retries get 409 not-replayable)",
                ),
            ],
        );
    }
    // The embedded store `on_unavailable: local` runs keys on while Redis is down (built, and
    // empty, under the other policies too): filled by a long outage, it keeps answers as their
    // status alone, which only these say.
    if let Some(fallback) = &stack.fallback {
        register_usage_metrics(
            &metrics,
            fallback,
            [
                (
                    "idemgate_fallback_store_records",
                    "Records held by the embedded store on_unavailable: local runs keys on",
                ),
                (
                    "idemgate_fallback_store_bytes",
                    "Bytes held by the embedded store on_unavailable: local runs keys on",
                ),
                (
                    "idemgate_fallback_store_capacity_bytes",
                    "Byte capacity of the embedded store on_unavailable: local runs keys on \
                     (store.memory.capacity)",
                ),
                (
                    "idemgate_fallback_store_answers_kept_as_status_total",
                    "Answers the full fallback store had no room for, kept as their status \
                     alone (retries get 409 not-replayable)",
                ),
            ],
        );
    }
    let (retrier, retry_worker) =
        CompletionRetrier::new(stack.shared.clone(), stack.retry_hooks(), retry_options);
    register_store_metrics(&metrics, &retrier);
    register_worker_id_metrics(&metrics, &ids);
    if let Some(bus) = &stack.purge {
        register_purge_metrics(&metrics, &Arc::new(bus.clone()));
    }
    metrics.pull_from(
        &in_flight,
        &[(
            "idemgate_in_flight_requests",
            "Requests being handled right now",
            Pull::Gauge,
            |c| c.get() as f64,
        )],
    );

    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let gate = Gate::new(
        current.clone(),
        stack.store.clone(),
        stack.fallback.clone(),
        ids.clone(),
        metrics.clone(),
        in_flight.clone(),
        retrier.clone(),
    );
    // Every accepted connection is wrapped so its request headers must arrive within
    // request_header_timeout (pingora alone times only each read of a header).
    let refusals = |listener: &str| HeaderRefusals {
        timeout: metrics
            .headers_refused
            .with_label_values(&[listener, "timeout"]),
        too_large: metrics
            .headers_refused
            .with_label_values(&[listener, "too_large"]),
        malformed: metrics
            .headers_refused
            .with_label_values(&[listener, "malformed"]),
    };
    let (proxy_refusals, admin_refusals) = (refusals("proxy"), refusals("admin"));
    let guarded = Guarded::new(
        pingora::proxy::http_proxy(&server.configuration, gate),
        current.clone(),
        proxy_refusals,
    );
    let mut proxy = Service::new("idemgate".to_string(), guarded);
    proxy.add_tcp(&listen);

    let mut admin_app = Admin::new(
        current.clone(),
        stack.store.clone(),
        metrics,
        readiness.clone(),
        reloader.clone(),
        stack.purge.clone(),
    );
    if let Some(redis) = &stack.redis {
        admin_app = admin_app.with_scripts(redis.clone());
    }
    admin_app = admin_app.with_worker_ids(ids.clone());
    if let Some(fallback) = &stack.fallback {
        admin_app = admin_app.with_fallback(fallback.clone());
    }
    // The admin listener's connections are held to the same header and write limits: on a pod
    // IP for probes and scrapes, it is as open to a slow client as the proxy's.
    let mut admin = Service::new(
        "idemgate admin".to_string(),
        Guarded::new(admin_app, current.clone(), admin_refusals),
    );
    admin.add_tcp(&admin_listen);
    admin.threads = Some(1);

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(background_service(
        "store sweeper",
        Sweeper {
            store: stack.memory.clone(),
        },
    ));
    server.add_service(background_service(
        "completion retries",
        UntilExit::new(retry_worker),
    ));
    server.add_service(background_service(
        "config watcher",
        ConfigWatcher { reloader },
    ));
    if let Some(store) = stack.redis.as_ref().filter(|s| s.watches_tls()) {
        server.add_service(background_service(
            "redis tls watcher",
            TlsWatcher {
                store: store.clone(),
                bus: stack.purge.clone(),
            },
        ));
    }
    if let Some(bus) = stack.purge.clone() {
        let on_purge = stack.forget_local();
        let on_subscribed = stack.forget_copies(
            "purge channel subscribed again; dropped the local copies of records read from \
             redis, as purges may have been missed",
        );
        server.add_service(background_service(
            "purge listener",
            PurgeListener {
                bus,
                on_purge,
                on_subscribed,
            },
        ));
    }
    if let Some(store) = &stack.redis {
        if ids.source() == WorkerIdSource::Lease {
            server.add_service(background_service(
                "worker id lease",
                WorkerLeaseService(Lease::new(store.clone(), ids.clone(), worker_lease)),
            ));
        }
    }
    if let Some(cache) = stack.cache.clone() {
        server.add_service(background_service(
            "given-up completions",
            UntilExit::new(async move { cache.recheck_given_up_every(GIVEN_UP_RECHECK).await }),
        ));
    }
    if let Some(store) = stack.redis.clone() {
        let releases = store.clone();
        server.add_service(background_service(
            "unanswered redis claims",
            // Runs through the drain: a claim made then may time out too.
            UntilExit::new(async move { releases.release_unanswered_claims().await }),
        ));
        let on_restart = stack.forget_copies(
            "dropped the local copies of records read from redis, as the restarted or replaced \
             server may have lost them",
        );
        server.add_service(background_service(
            "redis warm-up",
            RedisWarmup { store, on_restart },
        ));
    }
    if let Some(reloader) = script_reloader {
        server.add_service(background_service(
            "script watcher",
            ScriptWatcher { reloader },
        ));
    }

    tracing::info!(
        %listen,
        admin = %admin_listen,
        // A leased id is known once leased: its own line says which.
        worker_id = (ids.source() != WorkerIdSource::Lease).then(|| ids.worker_id()),
        worker_id_source = ids.source().as_str(),
        version = env!("CARGO_PKG_VERSION"),
        "idemgate starting"
    );
    server.run(RunArgs {
        shutdown_signal: Box::new(Signals {
            in_flight,
            retrier: retrier.clone(),
            readiness,
            grace_period,
            on_exit,
        }),
    });
    if EXITING.swap(true, Ordering::SeqCst) {
        // The fast stop's watchdog is ending the process; it does what follows.
        loop {
            std::thread::park();
        }
    }
    finish_or_abort(&retrier, on_exit)
}

/// Set by whichever of `run`'s end and the fast stop's watchdog ends the process first.
static EXITING: AtomicBool = AtomicBool::new(false);

/// How long a fast stop (SIGINT) waits for pingora to stop its runtimes before the process
/// ends without them. pingora stops them in well under a second; but a listener whose runtime
/// is being shut down can find `accept` failing at once, every time, and log and retry in a
/// loop that never yields, so its runtime's thread never stops and the process hung, writing
/// the same error millions of times (seen in about one stop in ten on a busy machine).
const FAST_STOP_LIMIT: Duration = Duration::from_secs(1);

/// Ends the process [`FAST_STOP_LIMIT`] after a fast stop unless `run` has ended it first,
/// doing what `run`'s end does ([`finish`]).
fn watch_fast_stop(retrier: CompletionRetrier, on_exit: fn()) {
    std::thread::spawn(move || {
        std::thread::sleep(FAST_STOP_LIMIT);
        if EXITING.swap(true, Ordering::SeqCst) {
            return;
        }
        // Straight to stderr: the log's buffer may be full of the spinning listener's errors.
        let message = format!(
            "the runtimes did not stop within {}s of SIGINT; exiting without them",
            FAST_STOP_LIMIT.as_secs_f64()
        );
        eprint!(
            "{}",
            crate::accesslog::stderr_line("idemgate::server", &message, &[], "")
        );
        // `run` is parked for good once the flag is taken: the process ends here whatever
        // `finish` does, a panic included.
        let code = match finish_or_abort(&retrier, on_exit) {
            Ok(()) => 0,
            Err(_) => EXIT_DEAD_LETTERS_LOST,
        };
        std::process::exit(code);
    });
}

/// The exit status when the end of a stop itself failed (`EX_SOFTWARE`).
const EXIT_SOFTWARE: i32 = 70;

/// The process's exit status when dead letters could not be written at the end (`EX_IOERR`).
pub const EXIT_DEAD_LETTERS_LOST: i32 = 74;

/// [`finish`], a panic in it ending the process with [`EXIT_SOFTWARE`] (whichever of `run`'s
/// end and the fast stop's watchdog does it).
fn finish_or_abort(retrier: &CompletionRetrier, on_exit: fn()) -> Result<(), StartError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| finish(retrier, on_exit)))
        .unwrap_or_else(|_| std::process::exit(EXIT_SOFTWARE))
}

/// The end of a stop, once requests are no longer served: dead-letters what still waits for
/// the store, waits a bounded time for the dead-letter file to take it, and flushes the log.
fn finish(retrier: &CompletionRetrier, on_exit: fn()) -> Result<(), StartError> {
    // The drain ran out of time (or the stop was fast): what still waits for the store goes to
    // the dead-letter file rather than vanishing with the process.
    let left = retrier.dead_letter_pending("process stopped before the store took it");
    if left > 0 {
        tracing::error!(
            completions = left,
            "stopping with completions the store never took; dead-lettered"
        );
    }
    // Their lines are written by the dead-letter thread, which dies with the process. A disk
    // that hangs gets a bounded wait: past it the process would only wait to be killed.
    let ended = if retrier.flush_dead_letters_within(EXIT_DEAD_LETTER_WAIT) {
        Ok(())
    } else {
        let lost = retrier.pending();
        let message = format!(
            "{lost} dead letters could not be written within {}s at exit (the dead-letter file \
             does not take them: a hung disk, or another process holding its lock); they are lost",
            EXIT_DEAD_LETTER_WAIT.as_secs()
        );
        eprint!(
            "{}",
            crate::accesslog::stderr_line(
                "idemgate::dead_letters",
                &message,
                &[("lost", &lost.to_string())],
                ""
            )
        );
        Err(StartError::DeadLettersLost { lost })
    };
    on_exit();
    ended
}

/// How long the end of `run` waits for the dead-letter file to take what is queued for it.
/// With the default drain (20 s + 5 s) and the log flush (0.5 s) it fits Kubernetes' default
/// 30 s termination budget.
const EXIT_DEAD_LETTER_WAIT: Duration = Duration::from_secs(4);

/// How often the `store.redis.tls` files are read for a change (a rotated certificate).
const TLS_POLL: Duration = Duration::from_secs(2);

/// Reads the `store.redis.tls` files every [`TLS_POLL`]; when their contents change, the store
/// and the purge channel connect with them from then on. A Kubernetes Secret volume is updated
/// by swapping a symlink, and cert-manager renews a certificate before it expires, so polling
/// the contents sees every rotation without a restart.
struct TlsWatcher {
    store: Arc<RedisStore>,
    bus: Option<PurgeBus>,
}

#[async_trait]
impl BackgroundService for TlsWatcher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(TLS_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.poll(),
                _ = shutdown.changed() => return,
            }
        }
    }
}

impl TlsWatcher {
    fn poll(&self) {
        let (Some(certs), Some(bus)) = (self.store.reload_tls(), &self.bus) else {
            return;
        };
        if let Err(e) = bus.use_certificates(&certs) {
            tracing::error!(error = %e, "purge channel keeps the previous store.redis.tls files");
        }
    }
}

/// Drops this replica's cached copy of every record purged anywhere.
struct PurgeListener {
    bus: PurgeBus,
    on_purge: ForgetLocal,
    on_subscribed: Arc<dyn Fn() + Send + Sync>,
}

#[async_trait]
impl BackgroundService for PurgeListener {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.bus
            .listen(self.on_purge.clone(), self.on_subscribed.clone(), shutdown)
            .await;
    }
}

/// Watches the config file (and SIGHUP) and reloads on change.
struct ConfigWatcher {
    reloader: Arc<Reloader>,
}

#[async_trait]
impl BackgroundService for ConfigWatcher {
    async fn start(&self, shutdown: ShutdownWatch) {
        let reloader = self.reloader.clone();
        let hup_shutdown = shutdown.clone();
        tokio::spawn(async move {
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP");
                return;
            };
            let mut shutdown = hup_shutdown;
            loop {
                tokio::select! {
                    _ = hup.recv() => {
                        let r = reloader.clone();
                        let _ = tokio::task::spawn_blocking(move || r.reload("SIGHUP")).await;
                    }
                    _ = shutdown.changed() => return,
                }
            }
        });
        self.reloader
            .clone()
            .watch(Duration::from_secs(2), shutdown)
            .await;
    }
}

/// Applies edits of the Lua script files and script settings from config reloads.
struct ScriptWatcher {
    reloader: Arc<ScriptReloader>,
}

#[async_trait]
impl BackgroundService for ScriptWatcher {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.reloader
            .clone()
            .watch(Duration::from_secs(2), shutdown)
            .await;
    }
}

/// Drops expired records of the embedded store: a round (an eighth of its shards) a second.
struct Sweeper {
    store: Arc<MemoryStore>,
}

#[async_trait]
impl BackgroundService for Sweeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let sweeper = self.store.spawn_sweeper(Duration::from_secs(1));
        let _ = shutdown.changed().await;
        sweeper.abort();
    }
}

/// How often the completions given up on are checked against Redis, besides when it comes
/// back (see [`crate::store::cached::CachedStore::recheck_given_up_every`]). Each check reads
/// one record per such completion, and there are few (an outage's worth at most).
const GIVEN_UP_RECHECK: Duration = Duration::from_secs(30);

/// Runs a task for the life of the process, through the drain: shutdown does not stop it (the
/// completion retrier's worker, whose queue the drain waits for, and store upkeep that requests
/// still running then need).
struct UntilExit(Mutex<Option<Pin<Box<dyn Future<Output = ()> + Send>>>>);

impl UntilExit {
    fn new(task: impl Future<Output = ()> + Send + 'static) -> Self {
        UntilExit(Mutex::new(Some(Box::pin(task))))
    }
}

#[async_trait]
impl BackgroundService for UntilExit {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let worker = self.0.lock().ok().and_then(|mut w| w.take());
        if let Some(worker) = worker {
            worker.await;
        }
    }
}

/// Connects the Redis store and loads its scripts soon after start, retrying with backoff
/// until it succeeds once; after that the store keeps itself connected. Then reads whether
/// Redis may evict records, now and every [`eviction::CHECK_EVERY`], and whether a server
/// restarted or was replaced, every [`restarts::CHECK_EVERY`] (`on_restart` then), until the
/// ACL user turns out not to be allowed to ask.
struct RedisWarmup {
    store: Arc<RedisStore>,
    on_restart: Arc<dyn Fn() + Send + Sync>,
}

/// Keeps the worker id leased (see [`crate::worker_lease`]).
struct WorkerLeaseService(Lease);

#[async_trait]
impl BackgroundService for WorkerLeaseService {
    async fn start(&self, _shutdown: ShutdownWatch) {
        // Runs through the drain: requests still take execution ids then.
        self.0.run().await;
    }
}

#[async_trait]
impl BackgroundService for RedisWarmup {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut pause = Duration::from_millis(100);
        let mut failures = 0u32;
        loop {
            match self.store.connect().await {
                Ok(()) => {
                    tracing::info!("redis store connected; scripts loaded");
                    break;
                }
                Err(e) => {
                    failures += 1;
                    // The first failure says what is wrong; repeating it every second is noise.
                    if failures == 1 {
                        tracing::warn!(error = %e, "redis store not reachable yet; retrying in the background");
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown.changed() => return,
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
        let (mut ask_eviction, mut ask_restarts) = (true, true);
        let mut eviction_due = tokio::time::Instant::now();
        let mut watch = restarts::Watch::default();
        while ask_eviction || ask_restarts {
            if ask_eviction && tokio::time::Instant::now() >= eviction_due {
                ask_eviction = self.store.check_eviction().await;
                eviction_due = tokio::time::Instant::now() + eviction::CHECK_EVERY;
            }
            if ask_restarts {
                let found = self.store.check_restarts().await;
                match (watch.after(&found), found) {
                    (restarts::Step::DropCopies, Restarts::Changed { before, now }) => {
                        tracing::warn!(
                            %before,
                            %now,
                            "a redis server restarted, or another took its place: records \
                             written to it may be gone (without persistence, or a replica \
                             promoted before it had them), and their keys run again"
                        );
                        (self.on_restart)();
                    }
                    (restarts::Step::Stop, Restarts::Denied(why)) => {
                        tracing::debug!(error = %why, "redis run ids not read: no +info");
                        ask_restarts = false;
                    }
                    (restarts::Step::Stop, _) => {
                        tracing::warn!(
                            readings = restarts::CHANGES_IN_A_ROW,
                            "redis run ids changed at every reading (INFO answered by another \
                             server each time: a proxy in front of redis?); restarts are no \
                             longer followed, and local copies stay until their ttl or a \
                             resubscription of the purge channel"
                        );
                        ask_restarts = false;
                    }
                    _ => {}
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(restarts::CHECK_EVERY) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// An embedded store's usage, under `names` (name and help of: records, bytes, capacity in
/// bytes, answers kept as their status alone).
fn register_usage_metrics(
    metrics: &Metrics,
    store: &Arc<dyn RecordStore>,
    names: [(&'static str, &'static str); 4],
) {
    fn usage(s: &dyn RecordStore) -> StoreUsage {
        s.usage().unwrap_or_default()
    }
    let [records, bytes, capacity, kept] = names;
    metrics.pull_from(
        store,
        &[
            (records.0, records.1, Pull::Gauge, |s| {
                usage(s).records as f64
            }),
            (bytes.0, bytes.1, Pull::Gauge, |s| usage(s).bytes as f64),
            (capacity.0, capacity.1, Pull::Gauge, |s| {
                usage(s).capacity as f64
            }),
            (kept.0, kept.1, Pull::Counter, |s| {
                usage(s).answers_kept_as_status as f64
            }),
        ],
    );
}

fn register_purge_metrics(metrics: &Metrics, bus: &Arc<PurgeBus>) {
    metrics.pull_from(
        bus,
        &[
            (
                "idemgate_purge_channel_subscribed",
                "1 while the purge channel is subscribed (purges other replicas announce reach \
                 this one's local copies), 0 while it is not",
                Pull::Gauge,
                |bus| f64::from(u8::from(bus.is_subscribed())),
            ),
            (
                "idemgate_purge_channel_losses_total",
                "Purge channel subscriptions lost (each drops the local copies of records read \
                 from Redis once it is back)",
                Pull::Counter,
                |bus| bus.losses() as f64,
            ),
        ],
    );
}

fn register_worker_id_metrics(metrics: &Metrics, ids: &Arc<WorkerIds>) {
    metrics.pull_from(
        ids,
        &[(
            "idemgate_worker_id",
            "Snowflake worker id that execution ids are issued under",
            Pull::Gauge,
            |ids| f64::from(ids.worker_id()),
        )],
    );
    if ids.source() != WorkerIdSource::Lease {
        return;
    }
    metrics.pull_from(
        ids,
        &[
            (
                "idemgate_worker_id_leased",
                "1 while the worker id in use is leased from Redis, 0 while it is not",
                Pull::Gauge,
                |ids| f64::from(u8::from(ids.is_leased())),
            ),
            (
                "idemgate_worker_lease_lost_total",
                "Worker id leases found held by another process at renewal",
                Pull::Counter,
                |ids| ids.leases_lost() as f64,
            ),
            (
                "idemgate_worker_lease_failures_total",
                "Worker id lease calls Redis did not answer or refused",
                Pull::Counter,
                |ids| ids.lease_failures() as f64,
            ),
        ],
    );
}

/// The dead-letter file's size for `idemgate_dead_letter_file_bytes`, read at each scrape:
/// 0 when there is no file (renamed aside, or not written yet), -1 when it cannot be read.
fn dead_letter_file_bytes(path: &std::path::Path) -> f64 {
    match std::fs::metadata(path) {
        Ok(meta) => meta.len() as f64,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0.0,
        Err(_) => -1.0,
    }
}

fn register_store_metrics(metrics: &Metrics, retrier: &CompletionRetrier) {
    metrics.pull_from(
        &Arc::new(()),
        &[(
            "idemgate_log_lines_dropped_total",
            "Log lines dropped: 16 MiB behind a stalled stderr, or refused by a failing one",
            Pull::Counter,
            |_| crate::accesslog::dropped_lines() as f64,
        )],
    );
    metrics.pull_from(
        &retrier.stats(),
        &[
            (
                "idemgate_completion_retries_total",
                "Completions queued for a background retry after the store refused them",
                Pull::Counter,
                |s| s.queued.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_completion_retry_recovered_total",
                "Completions stored by a background retry",
                Pull::Counter,
                |s| s.recovered.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_dead_letters_total",
                "Completions dead-lettered (written to the dead-letter file, or only to stderr when it could not take them)",
                Pull::Counter,
                |s| s.dead_lettered.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_dead_letter_write_failures_total",
                "Dead letters the dead-letter file could not take: each is only in its line on stderr",
                Pull::Counter,
                |s| s.dead_letter_write_failures.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_completion_retry_fenced_total",
                "Retried completions refused because a newer execution holds the key (dead-lettered as lock taken over)",
                Pull::Counter,
                |s| s.fenced.load(Ordering::Relaxed) as f64,
            ),
            (
                "idemgate_completion_retry_pending",
                "Completions waiting to be stored",
                Pull::Gauge,
                |s| s.pending.load(Ordering::Relaxed) as f64,
            ),
        ],
    );
}

/// pingora's signal handling plus an early exit: after SIGTERM, pingora closes the listeners and
/// then sleeps the whole grace period; we exit as soon as nothing is in flight.
struct Signals {
    in_flight: Arc<InFlightCounter>,
    retrier: CompletionRetrier,
    readiness: Arc<Readiness>,
    grace_period: Duration,
    on_exit: fn(),
}

impl Signals {
    /// Starts the drain: unready at once, and an exit as soon as nothing is in flight.
    fn drain(&self) -> ShutdownSignal {
        self.readiness.start_draining();
        let in_flight = self.in_flight.clone();
        let retrier = self.retrier.clone();
        let (grace_period, on_exit) = (self.grace_period, self.on_exit);
        std::thread::spawn(move || exit_when_drained(&in_flight, &retrier, grace_period, on_exit));
        ShutdownSignal::GracefulTerminate
    }

    /// The fast stop (SIGINT): no drain, and an end within [`FAST_STOP_LIMIT`] whatever
    /// pingora's runtimes do.
    fn fast_stop(&self) -> ShutdownSignal {
        watch_fast_stop(self.retrier.clone(), self.on_exit);
        ShutdownSignal::FastShutdown
    }
}

/// The signals that stop the server: SIGTERM and SIGQUIT drain, SIGINT stops at once.
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGQUIT, libc::SIGINT];

/// The last stop signal (SIGTERM, SIGQUIT, SIGINT) caught while the process was starting.
static EARLY_STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn note_stop_signal(signal: libc::c_int) {
    // Async-signal-safe: one atomic store.
    EARLY_STOP_SIGNAL.store(signal, Ordering::SeqCst);
}

/// Catches SIGTERM, SIGQUIT and SIGINT from the first line of `main` until the server's signal
/// handling takes over, which it does only once the config is loaded, the store built and the
/// listeners started. Without it a stop signal in that window killed the process (requests
/// already accepted died without their dead letters) or, as a container's PID 1, which the
/// kernel spares signals it has no handler for, was dropped: the process started, served and
/// was killed at the end of the termination grace period. Caught here, it is acted on as
/// soon as the server listens for signals: a drain (SIGINT: the fast stop).
pub fn catch_stop_signals_while_starting() {
    for signal in STOP_SIGNALS {
        // SAFETY: installs a handler that only stores to an atomic (async-signal-safe); the
        // struct is zeroed, then its handler, mask and flags set, as sigaction(2) takes it.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = note_stop_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// Gives SIGTERM, SIGQUIT and SIGINT their default action again: for a command that is not the
/// server (`--reconcile`), which stops on them as any command does.
pub fn default_stop_signals() {
    for signal in STOP_SIGNALS {
        // SAFETY: restores the default disposition of a signal; no handler of ours runs.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
}

/// The stop signal caught while starting, if one was (and forgets it).
pub fn stop_signal_while_starting() -> Option<libc::c_int> {
    Some(EARLY_STOP_SIGNAL.swap(0, Ordering::SeqCst)).filter(|&s| s != 0)
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let (Ok(mut term), Ok(mut int), Ok(mut quit)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::quit()),
        ) else {
            tracing::error!("cannot install signal handlers; only SIGKILL stops this process");
            return std::future::pending().await;
        };
        // A stop signal that came while the process was starting, before these streams were
        // there to take it (caught by `catch_stop_signals_while_starting`), counts now.
        match stop_signal_while_starting() {
            Some(libc::SIGINT) => return self.fast_stop(),
            None => {}
            Some(early) => {
                tracing::info!(
                    signal = early,
                    "a stop signal came while starting: draining in-flight requests"
                );
                return self.drain();
            }
        }
        tokio::select! {
            _ = term.recv() => {
                tracing::info!("SIGTERM: draining in-flight requests");
                self.drain()
            }
            _ = int.recv() => self.fast_stop(),
            // pingora's graceful upgrade (handing the listeners to a new process) is not used:
            // SIGQUIT drains as SIGTERM does rather than wait out the grace period unready.
            _ = quit.recv() => {
                tracing::info!("SIGQUIT: draining in-flight requests (as for SIGTERM)");
                self.drain()
            }
        }
    }
}

/// Waits until no request is in flight and no completion waits for the store, for two
/// consecutive looks, then exits 0. When `grace_period` runs out first, says so once for the
/// requests still in flight (they are about to be cut off), and dead-letters the completions
/// still waiting for the store, then and at every look after.
fn exit_when_drained(
    in_flight: &InFlightCounter,
    retrier: &CompletionRetrier,
    grace_period: Duration,
    on_exit: fn(),
) {
    // A little before the end, while the log still has time to reach its file and the
    // dead-letter file time to take what waits.
    let signalled = std::time::Instant::now();
    let deadline = signalled + grace_period.saturating_sub(Duration::from_millis(250));
    let requests_at_signal = in_flight.get();
    let mut told = false;
    // Let the listeners close and requests already accepted reach the proxy first.
    std::thread::sleep(Duration::from_millis(200));
    let mut idle_looks = 0;
    loop {
        let past_deadline = std::time::Instant::now() >= deadline;
        if !told && past_deadline && in_flight.get() > 0 {
            told = true;
            tracing::error!(
                requests = in_flight.get(),
                "shutdown.grace_period is running out with requests in flight: they will be cut \
                 off, a keyed one's key stays locked until lock_ttl and a retry after that \
                 executes it again"
            );
        }
        if past_deadline {
            // Nothing waits for the retries any longer. Left to the end of `run`, they would be
            // written only once pingora has stopped its runtimes (up to
            // graceful_shutdown_timeout later), and a SIGKILL before that (a Kubernetes
            // terminationGracePeriodSeconds that leaves no room for it) would lose them all.
            // Again at every look: a completion of a request still in flight may come after.
            let left = retrier
                .dead_letter_pending("shutdown.grace_period ran out before the store took it");
            if left > 0 {
                tracing::error!(
                    completions = left,
                    "shutdown.grace_period ran out with completions the store never took; \
                     dead-lettered"
                );
            }
        }
        if in_flight.get() == 0 && retrier.pending() == 0 {
            idle_looks += 1;
            if idle_looks >= 2 {
                if EXITING.swap(true, Ordering::SeqCst) {
                    // `run`'s end is under way (pingora stopped first): it exits.
                    return;
                }
                let stats = retrier.stats();
                tracing::info!(
                    drained_in_ms = signalled.elapsed().as_millis() as u64,
                    requests_at_signal,
                    dead_letters = stats.dead_lettered.load(Ordering::Relaxed),
                    dead_letters_not_written =
                        stats.dead_letter_write_failures.load(Ordering::Relaxed),
                    "drained; exiting"
                );
                on_exit();
                std::process::exit(0);
            }
        } else {
            idle_looks = 0;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where `--config` points, resolved for messages.
pub fn describe(path: &std::path::Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_waits_go_on_timers_that_are_removed_when_the_wait_ends() {
        let config = Config::from_yaml_str(
            r#"
threads: 3
upstreams: {app: {addrs: ["127.0.0.1:8080"], read_timeout: 1h}}
shutdown: {grace_period: 25s, graceful_shutdown_timeout: 3s}
routes:
  - {name: orders, path_prefix: /orders, upstream: app, idempotency: {lock_ttl: 2h}}
"#,
        )
        .expect("valid config");
        let conf = server_conf(&config);
        assert_eq!(conf.fast_timeout_to_tokio_threshold_seconds, Some(60));
        assert_eq!(conf.threads, 3);
        assert_eq!(conf.grace_period_seconds, Some(25));
        assert_eq!(conf.graceful_shutdown_timeout_seconds, Some(3));
    }
}
