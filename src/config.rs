//! Configuration: the YAML file format and the validated, immutable [`Config`] built from it.
//!
//! Two layers, as in `river` and `vector`: private file structs mirror the YAML exactly
//! (`deny_unknown_fields`, defaults from serde default functions), then one validating
//! conversion turns them into the public [`Config`] the rest of the proxy reads. Loading is a
//! pure function of the text, so the file watcher can validate an edit before swapping it in.
//! Every validation error names the offending field by its path, e.g.
//! `routes[1].idempotency.ttl: invalid duration "3 parsecs" (whole numbers with a unit, e.g. 250ms, 1500ms, 30s, 5m, 24h)`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The validated, immutable proxy configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Address the proxy listens on.
    pub listen: SocketAddr,
    /// Proxy worker threads, 1..=256.
    pub threads: usize,
    /// Whether idle worker threads steal tasks from busy ones (one shared scheduler) or each
    /// thread runs its own connections (less cross-thread waking, better for many short
    /// requests).
    pub work_stealing: bool,
    /// Longest a request header may take to arrive, from its first byte to its last; then the
    /// connection is closed (with a 408 when the client takes it).
    pub request_header_timeout: Duration,
    /// Largest request header accepted, in bytes (request line and header fields); a larger
    /// one gets 431 and the connection is closed.
    pub max_request_header_bytes: usize,
    /// Longest pause allowed between two reads of a request body.
    pub request_body_timeout: Duration,
    /// Longest a request body idemgate reads whole may take, from its first read that has to
    /// wait: a client trickling a byte now and then, each inside `request_body_timeout`, is cut
    /// off by this. Bodies pingora streams (large uploads) are timed read by read only.
    pub request_body_total_timeout: Duration,
    /// Most bytes the request bodies idemgate reads whole (keyed requests', before their claim;
    /// small forwarded ones) may hold in memory at once, across every connection; a keyed body
    /// that would go past it is refused (503), a forwarded one streamed instead.
    pub max_buffered_request_bytes: usize,
    /// Longest a write of a response may wait for the client to take it (a client that stopped
    /// reading); then the client's connection is closed.
    pub response_send_timeout: Duration,
    /// Graceful shutdown budget.
    pub shutdown: ShutdownConfig,
    /// The admin listener (`/healthz`, `/readyz`, `/metrics`).
    pub admin: AdminConfig,
    /// Upstreams, sorted by name; routes refer to them by index.
    pub upstreams: Vec<UpstreamConfig>,
    /// Index into `upstreams` for requests that match no route.
    pub default_upstream: Option<usize>,
    /// Settings shared by every idempotent route.
    pub idempotency: GlobalIdempotency,
    /// The record store.
    pub store: StoreConfig,
    /// Routes in file order; the first match wins.
    pub routes: Vec<Route>,
    /// Hex SHA-256 of the YAML text this config was loaded from.
    pub source_hash: String,
}

/// How the proxy drains on `SIGTERM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownConfig {
    /// Time in-flight requests get to finish (and their records to be stored) after `SIGTERM`.
    pub grace_period: Duration,
    /// Time pingora gives its services to stop once the grace period is over.
    pub graceful_shutdown_timeout: Duration,
}

/// The admin listener.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// Address of the admin HTTP server.
    pub listen: SocketAddr,
    /// Bearer token required by mutating admin endpoints (`admin.token`, or the
    /// `IDEMGATE_ADMIN_TOKEN` environment variable, which wins unless empty). None: mutations
    /// are refused.
    pub token: Option<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// One named group of backend addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// Name used by routes and `default_upstream`.
    pub name: String,
    /// `host:port` strings, each checked to resolve at load time.
    pub addrs: Vec<String>,
    /// Budget for establishing a connection.
    pub connect_timeout: Duration,
    /// Budget for each read from the upstream.
    pub read_timeout: Duration,
    /// Budget for each write to the upstream.
    pub write_timeout: Duration,
    /// How long an idle keep-alive connection stays in the pool.
    pub idle_timeout: Duration,
    /// Most requests this process has out to the upstream at once (`None`: no limit); one
    /// more is answered 503 `upstream-busy` without being forwarded.
    pub max_in_flight: Option<usize>,
}

impl UpstreamConfig {
    /// Longest one exchange with this upstream may take: connecting, writing the whole request,
    /// then waiting for the answer. A claim's lock must outlast it.
    pub fn exchange_bound(&self) -> Duration {
        self.connect_timeout
            .saturating_add(self.write_timeout)
            .saturating_add(self.read_timeout)
    }
}

/// Idempotency settings shared by every route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalIdempotency {
    /// Header carrying the idempotency key (lower-case).
    pub key_header: HeaderName,
    /// Header carrying the tenant (lower-case).
    pub tenant_header: HeaderName,
    /// Tenant used when the tenant header is absent; satisfies `[A-Za-z0-9._:-]{1,128}`.
    pub default_tenant: String,
    /// Snowflake worker id, 0..=1023; `None` lets the proxy pick one (leased from Redis on
    /// the Redis store, see [`crate::worker_lease`]).
    pub worker_id: Option<u16>,
    /// How long a worker id leased from Redis stays held without renewal.
    pub worker_lease: Duration,
    /// `Link: <docs_url>; rel="describedby"`, from `docs_url`: sent with every proxy-made
    /// problem of an idempotent route, pointing clients at the API's own idempotency docs.
    pub docs_link: Option<http::HeaderValue>,
}

/// The record store and what to do when it is unavailable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Which backend holds the records.
    pub backend: StoreBackend,
    /// Settings of the embedded memory store (also the `local` fallback).
    pub memory: MemoryStoreConfig,
    /// Settings of the Redis store, when a `store.redis` block is present.
    pub redis: Option<RedisConfig>,
    /// Policy when the store is down or its circuit is open.
    pub on_unavailable: OnUnavailable,
    /// The local fast path in front of a shared store.
    pub local_cache: LocalCacheConfig,
    /// The circuit breaker around a shared store.
    pub circuit_breaker: BreakerConfig,
    /// Background retries of completions the store refused.
    pub completion_retry: RetryConfig,
}

/// The Bloom filter and cache of completed records in front of a shared store.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalCacheConfig {
    /// Whether the fast path is used (it only applies to `backend: redis`).
    pub enabled: bool,
    /// Byte budget of cached completed records.
    pub capacity_bytes: usize,
    /// Records expected per Bloom filter window.
    pub expected_items: usize,
    /// Target false-positive rate of the Bloom filter.
    pub false_positive_rate: f64,
}

impl Eq for LocalCacheConfig {}

/// When the store's circuit opens and how long it stays open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures or timeouts that open the circuit.
    pub failure_threshold: u32,
    /// How long the circuit stays open before probing.
    pub open_for: Duration,
}

/// Background retries of refused completions, and where dead letters go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// Attempts after the failed write, at least; more while the claim's lock holds.
    pub attempts: u32,
    /// First backoff, doubled every attempt (with jitter).
    pub base_delay: Duration,
    /// Backoff ceiling.
    pub max_delay: Duration,
    /// Completions waiting at most.
    pub queue_capacity: usize,
    /// Bytes of stored responses waiting at most.
    pub queue_bytes: usize,
    /// JSON-lines file for completions that could not be stored.
    pub dead_letter_path: std::path::PathBuf,
}

/// Which record store backend is in use.
// Deserialized directly from the file: the closed set is identical in both layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// The embedded, in-process store.
    Memory,
    /// Redis 6+ (single server, Sentinel or Cluster).
    Redis,
}

/// Settings of the embedded memory store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryStoreConfig {
    /// Byte capacity across all shards.
    pub capacity_bytes: usize,
    /// Number of independently locked shards, 1..=4096.
    pub shards: usize,
}

/// Settings of the Redis store.
// Debug is hand-written so a password in a URL never reaches a log line.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://`, `rediss://` or `redis+sentinel://` URLs, possibly with `user:pass@`; one for a
    /// single server, one or more seeds for a cluster, one or more for Sentinel. Never empty.
    pub urls: Vec<String>,
    /// How the URLs are used.
    pub topology: RedisTopology,
    /// Budget for opening one connection.
    pub connect_timeout: Duration,
    /// Budget for one command's answer.
    pub response_timeout: Duration,
    /// Prefix of every key the proxy writes.
    pub key_prefix: String,
    /// Which Lua script versions run (`store.redis.scripts`); applied live on reload.
    pub scripts: ScriptsConfig,
    /// Certificates for TLS connections (`store.redis.tls`); when set, every URL uses TLS.
    pub tls: Option<RedisTlsConfig>,
}

/// Certificates for the TLS connections of the Redis store (`store.redis.tls`). The files passed
/// [`RedisTlsConfig::check_contents`] when the config was loaded; the store reads and checks
/// them again when it starts and every 2 s after (a rotated certificate). Certificate
/// verification is never turned off: a private CA is trusted by naming it here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisTlsConfig {
    /// PEM file of the CA certificate(s) the server's certificate must chain to. It replaces
    /// the built-in Mozilla roots; `None` keeps them.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM) for mutual TLS. Set exactly when `key_file` is.
    pub cert_file: Option<PathBuf>,
    /// Private key (PEM) of `cert_file`. Set exactly when `cert_file` is.
    pub key_file: Option<PathBuf>,
}

/// Which Lua script versions the Redis store runs, and the canary (`store.redis.scripts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptsConfig {
    /// Directory of versions, `<dir>/<version>/{claim,complete,release,get}.lua`, watched for
    /// edits; relative to the working directory. `None`: the built-in versions only.
    pub dir: Option<PathBuf>,
    /// The version every record uses unless the canary takes it. Known to exist at load time.
    pub version: String,
    /// A second version tried on a share of the records.
    pub canary: Option<CanaryConfig>,
}

/// A canary script version: which records take it, and when it is rolled back.
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryConfig {
    /// The canary version; exists, and differs from the active one.
    pub version: String,
    /// Share of record ids, 0..=100, that use the canary (chosen by the record hash, so one key
    /// always uses one version).
    pub percent: u8,
    /// Only records of these tenants take part; empty means every tenant. Sorted, no repeats.
    pub tenants: Vec<String>,
    /// The canary is rolled back when its error rate over `window` exceeds this (0..=1)...
    pub max_error_rate: f64,
    /// ...once it made at least this many calls in the window.
    pub min_calls: u64,
    /// How far back calls and errors count.
    pub window: Duration,
}

impl Eq for CanaryConfig {}

impl Default for ScriptsConfig {
    fn default() -> Self {
        ScriptsConfig {
            dir: None,
            version: DEFAULT_SCRIPTS_VERSION.to_owned(),
            canary: None,
        }
    }
}

/// How the Redis store reaches its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisTopology {
    /// One server (or a proxy in front of many), `redis://` or `rediss://`.
    Single,
    /// Redis Cluster: `store.redis.cluster: true` or several URLs; the URLs are seed nodes.
    Cluster,
    /// A primary found through Sentinel: `redis+sentinel://` URLs (see [`SentinelUrl`]).
    Sentinel,
}

/// A parsed `redis+sentinel://[user[:pass]@]host[:port][,host[:port]...]/<master>[/<db>]` URL
/// (or `rediss+sentinel://`: the same over TLS).
///
/// The hosts are Sentinels (default port 26379); `master` is the name they monitor; user,
/// password and database apply to the primary they name. The Sentinels themselves are
/// reached without authentication; with `rediss+sentinel://` both the Sentinels and the
/// primary are reached over TLS.
// Debug is hand-written: the password stays out of logs.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    /// Sentinel addresses as (host, port); never empty.
    pub sentinels: Vec<(String, u16)>,
    /// The monitored master's name.
    pub master: String,
    /// Database index on the primary.
    pub db: i64,
    /// ACL user for the primary, percent-decoded.
    pub username: Option<String>,
    /// Password for the primary, percent-decoded.
    pub password: Option<String>,
    /// Whether the Sentinels and the primary are reached over TLS (`rediss+sentinel://`).
    pub tls: bool,
}

/// What to do with an idempotent request when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Answer 503 with `Retry-After`; the backend is not contacted.
    Reject,
    /// Fall back to the in-process store and Bloom filter (`DEGRADED`).
    Local,
    /// Forward without protection (`DEGRADED`).
    Pass,
}

/// One route: which requests it matches and where they go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Unique, non-empty name (used in logs and metrics).
    pub name: String,
    /// Upper-case methods this route applies to; empty means every method.
    pub methods: Vec<Method>,
    /// Path prefix, starting with `/`, matched on segment boundaries against the
    /// [`route_path`] form of the request path; itself in that form.
    pub path_prefix: String,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    /// Idempotency settings; `None` makes this a plain forwarding route.
    pub idempotency: Option<RouteIdempotency>,
}

impl Route {
    /// Whether the route applies to `method` (an empty list takes every method).
    fn methods_take(&self, method: &Method) -> bool {
        self.methods.is_empty() || self.methods.contains(method)
    }
}

/// Idempotency settings of one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteIdempotency {
    /// Whether a request without a key is refused or bypasses protection.
    pub key: KeyMode,
    /// Fewest characters a key may have (1..=255); a shorter one gets 400: a short key is
    /// one another client may pick too.
    pub min_key_length: usize,
    /// How long a completed response is replayed.
    pub ttl: Duration,
    /// How long an in-flight claim lives; longer than the upstream's connect + read timeouts.
    pub lock_ttl: Duration,
    /// What a retry does while the original is still executing.
    pub on_in_flight: OnInFlight,
    /// How long `on_in_flight: wait` waits for the original to finish.
    pub wait_timeout: Duration,
    /// What becomes of a key whose request was sent and whose answer was lost.
    pub on_outcome_unknown: OnOutcomeUnknown,
    /// Whether the request body is part of the fingerprint.
    pub fingerprint_body: bool,
    /// Headers whose values are part of the fingerprint (lower-case, sorted, unique).
    pub fingerprint_headers: Vec<HeaderName>,
    /// Headers that bind a key to its principal (lower-case, sorted, unique).
    pub scope_headers: Vec<HeaderName>,
    /// A keyed request must carry one of `scope_headers` with a value (else 400): without,
    /// it shares its key space with every other request of its tenant that has none.
    pub scope_required: bool,
    /// Which response statuses are stored for replay.
    pub cache_statuses: StatusSet,
    /// Response headers never stored for replay (lower-case, sorted, unique).
    pub replay_exclude_headers: Vec<HeaderName>,
    /// Largest request body accepted; larger ones get 413.
    pub max_request_bytes: usize,
    /// Largest response body stored; larger ones make the record unreplayable.
    pub max_response_bytes: usize,
}

/// Whether an idempotent route insists on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyMode {
    /// No key: 400.
    Required,
    /// No key: forward unprotected with `X-Idempotent-Result: BYPASS`.
    Optional,
}

/// What a retry does while the original request is still in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnInFlight {
    /// Answer 409 with `Retry-After` at once.
    Reject,
    /// Wait up to `wait_timeout` for the original and replay it.
    Wait,
}

/// What becomes of a key whose request reached the backend without a complete answer coming
/// back (a read timeout, a connection lost mid-answer): it may or may not have run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnOutcomeUnknown {
    /// The claim is kept until its lock lapses; a retry after that runs the key again under the
    /// same `X-Idempotency-Id`, which a backend with a unique index on it refuses.
    Lapse,
    /// Recorded at once as executed, not replayable: retries get 409 until the record's `ttl`
    /// ends and the key never runs again (at most once, for backends that cannot deduplicate).
    Settle,
}

/// The set of response statuses that are stored for replay (`cache_statuses`).
///
/// An exact code is cached; otherwise an exclusion (`!code`) is not; otherwise a listed class
/// (`2xx`..`5xx`) is cached, except 408 and 429, which are transient and only cached when listed
/// as exact codes. Lookups are a couple of bit tests: no allocation.
#[derive(Clone, PartialEq, Eq)]
pub struct StatusSet {
    /// Bit `n` set means the class `nxx` is listed (n in 2..=5).
    classes: u8,
    exact: StatusBits,
    excluded: StatusBits,
}

/// The outcome of [`Config::match_route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteMatch {
    /// The route at this index applies idempotency to the request.
    Idempotent(usize),
    /// Forward untouched to `upstream`; `route` is the route that matched, if any.
    Forward {
        /// Index of the matching route, `None` when `default_upstream` caught the request.
        route: Option<usize>,
        /// Index into [`Config::upstreams`].
        upstream: usize,
    },
    /// No route matches and there is no default upstream.
    NoRoute,
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {}: {source}", .path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not YAML of the expected shape. serde_yaml's message names the field path,
    /// the line and column, and for an unknown key its name and the keys allowed there.
    #[error("{0}")]
    Parse(String),
    /// A value has the right shape but is not acceptable.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the offending field, e.g. `routes[0].idempotency.ttl`.
        field: String,
        /// What is wrong and, where useful, what would be accepted.
        message: String,
    },
}

// === File layer ===
//
// These structs mirror the YAML one to one. Scalars whose syntax we own (durations, byte sizes,
// status entries) stay raw here so the validating conversion can report them by field path.

const DURATION_HINT: &str = "whole numbers with a unit, e.g. 250ms, 1500ms, 30s, 5m, 24h";

/// The longest duration any setting takes: a year and a day. A longer one is a slip (a `d` for
/// an `s`), and it would only ever be capped somewhere on the way.
const MAX_DURATION: Duration = Duration::from_secs(366 * 86_400);
const BYTES_HINT: &str = "use e.g. 1048576, 512KiB, 256MiB, 1GiB";
const STATUS_HINT: &str =
    "use a class (2xx, 3xx, 4xx, 5xx), an exact code (201) or a quoted exclusion (\"!429\")";
const REDIS_SCHEMES: [&str; 4] = [
    "redis://",
    "rediss://",
    "redis+sentinel://",
    "rediss+sentinel://",
];
const SENTINEL_SCHEME: &str = "redis+sentinel://";
const SENTINEL_TLS_SCHEME: &str = "rediss+sentinel://";
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
const DEFAULT_SCRIPTS_VERSION: &str = "v1";
const DEFAULT_SENTINEL_PORT: u16 = 26379;
const MAX_BODY_BYTES: u64 = 1 << 30;

/// Largest file the config names or is (the config itself, TLS files): what a config or a
/// certificate bundle is, many times over. A path pointing at something else (a log, a
/// device) is refused rather than read into memory whole.
const MAX_FILE_BYTES: u64 = 4 << 20;

/// Reads the file at `path` whole, if it has at most [`MAX_FILE_BYTES`].
pub fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    read_capped(path, MAX_FILE_BYTES)
}

/// Reads the file at `path` whole, if it has at most `cap` bytes: read through the cap, so a
/// file that grows (or a device that never ends) is refused, not read into memory whole.
pub fn read_capped(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(cap + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {cap} bytes, more than this file may be"),
        ));
    }
    Ok(bytes)
}

/// Largest `max_buffered_request_bytes`: 64 GiB.
const MAX_BUFFERED_BYTES: u64 = 1 << 36;

/// Bounds of `idempotency.worker_lease`: renewed every third, so 3 s means a Redis call a
/// second; a process cut off from Redis keeps its id for up to this long, so more than ten
/// minutes would keep ids unavailable that long after a crash.
const MIN_WORKER_LEASE: Duration = Duration::from_secs(3);
const MAX_WORKER_LEASE: Duration = Duration::from_secs(600);
/// Both generations of the local-cache Bloom filter together, at most.
const MAX_BLOOM_BYTES: u64 = 1 << 30;
const ADMIN_TOKEN_ENV: &str = "IDEMGATE_ADMIN_TOKEN";
/// When set and not empty, the password of every `store.redis` URL: it can then come from a
/// secret (a Kubernetes Secret) rather than the config file (a ConfigMap, which is none).
const REDIS_PASSWORD_ENV: &str = "IDEMGATE_REDIS_PASSWORD";
const MIN_ADMIN_TOKEN_LEN: usize = 16;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default = "default_listen")]
    listen: String,
    #[serde(default = "default_threads")]
    threads: i64,
    #[serde(default = "default_work_stealing")]
    work_stealing: bool,
    #[serde(default = "default_request_header_timeout")]
    request_header_timeout: Scalar,
    #[serde(default = "default_max_request_header_bytes")]
    max_request_header_bytes: Scalar,
    #[serde(default = "default_request_body_timeout")]
    request_body_timeout: Scalar,
    #[serde(default = "default_request_body_total_timeout")]
    request_body_total_timeout: Scalar,
    #[serde(default = "default_max_buffered_request_bytes")]
    max_buffered_request_bytes: Scalar,
    #[serde(default = "default_response_send_timeout")]
    response_send_timeout: Scalar,
    #[serde(default)]
    shutdown: FileShutdown,
    #[serde(default)]
    admin: FileAdmin,
    #[serde(deserialize_with = "unique_upstreams")]
    upstreams: BTreeMap<String, FileUpstream>,
    #[serde(default)]
    default_upstream: Option<String>,
    #[serde(default)]
    idempotency: FileIdempotency,
    #[serde(default)]
    store: FileStore,
    #[serde(deserialize_with = "routes_list")]
    routes: Vec<FileRoute>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileShutdown {
    grace_period: Scalar,
    graceful_shutdown_timeout: Scalar,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileAdmin {
    listen: String,
    token: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileUpstream {
    addrs: Vec<String>,
    #[serde(default = "default_connect_timeout")]
    connect_timeout: Scalar,
    #[serde(default = "default_read_timeout")]
    read_timeout: Scalar,
    #[serde(default = "default_write_timeout")]
    write_timeout: Scalar,
    #[serde(default = "default_idle_timeout")]
    idle_timeout: Scalar,
    max_in_flight: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileIdempotency {
    key_header: String,
    tenant_header: String,
    default_tenant: String,
    worker_id: Option<i64>,
    worker_lease: Scalar,
    docs_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileStore {
    backend: StoreBackend,
    memory: FileMemoryStore,
    redis: Option<FileRedis>,
    on_unavailable: OnUnavailable,
    local_cache: FileLocalCache,
    circuit_breaker: FileBreaker,
    completion_retry: FileRetry,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileLocalCache {
    enabled: bool,
    capacity: Scalar,
    expected_items: i64,
    false_positive_rate: f64,
}

impl Default for FileLocalCache {
    fn default() -> Self {
        FileLocalCache {
            enabled: true,
            capacity: Scalar::Text("64MiB".into()),
            expected_items: 1_000_000,
            false_positive_rate: 0.01,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileBreaker {
    failure_threshold: i64,
    open_for: Scalar,
}

impl Default for FileBreaker {
    fn default() -> Self {
        FileBreaker {
            failure_threshold: 3,
            open_for: Scalar::Text("1s".into()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileRetry {
    attempts: i64,
    base_delay: Scalar,
    max_delay: Scalar,
    queue_capacity: i64,
    queue_bytes: Scalar,
    dead_letter_path: String,
}

impl Default for FileRetry {
    fn default() -> Self {
        FileRetry {
            attempts: 8,
            base_delay: Scalar::Text("50ms".into()),
            max_delay: Scalar::Text("5s".into()),
            queue_capacity: 10_000,
            queue_bytes: Scalar::Text("256MiB".into()),
            dead_letter_path: "idemgate-dead-letter.jsonl".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileMemoryStore {
    capacity: Scalar,
    /// Unset: [`default_memory_shards`] of the capacity.
    shards: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileRedis {
    url: Option<String>,
    urls: Option<Vec<String>>,
    cluster: bool,
    connect_timeout: Scalar,
    response_timeout: Scalar,
    key_prefix: String,
    scripts: FileScripts,
    tls: Option<FileRedisTls>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileRedisTls {
    ca_file: Option<String>,
    cert_file: Option<String>,
    key_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileScripts {
    dir: Option<String>,
    version: String,
    canary: Option<FileCanary>,
}

// `version` and `percent` have no default: a canary block says what it tries and on how much.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileCanary {
    version: String,
    percent: i64,
    #[serde(default, deserialize_with = "tenants_list")]
    tenants: Vec<String>,
    #[serde(default = "default_max_error_rate")]
    max_error_rate: f64,
    #[serde(default = "default_min_calls")]
    min_calls: i64,
    #[serde(default = "default_canary_window")]
    window: Scalar,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRoute {
    name: String,
    #[serde(default, deserialize_with = "methods_list")]
    methods: Vec<String>,
    path_prefix: String,
    upstream: String,
    #[serde(default, deserialize_with = "present_block")]
    idempotency: Option<FileRouteIdempotency>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileRouteIdempotency {
    key: KeyMode,
    min_key_length: i64,
    ttl: Scalar,
    lock_ttl: Scalar,
    on_in_flight: OnInFlight,
    wait_timeout: Scalar,
    on_outcome_unknown: OnOutcomeUnknown,
    fingerprint: FileFingerprint,
    #[serde(deserialize_with = "scope_headers_list")]
    scope_headers: Vec<String>,
    scope_required: bool,
    #[serde(deserialize_with = "cache_statuses_list")]
    cache_statuses: Vec<Scalar>,
    #[serde(deserialize_with = "replay_exclude_headers_list")]
    replay_exclude_headers: Vec<String>,
    max_request_bytes: Scalar,
    max_response_bytes: Scalar,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileFingerprint {
    body: bool,
    #[serde(deserialize_with = "headers_list")]
    headers: Vec<String>,
}

/// A YAML scalar kept as written: durations, byte sizes and status entries are parsed later,
/// where the error can name the field.
#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    Text(String),
    Int(i128),
    Float(f64),
}

// === File defaults ===
//
// The single source of every default; the reference config documents the same values.

fn default_max_error_rate() -> f64 {
    0.05
}

fn default_min_calls() -> i64 {
    20
}

fn default_canary_window() -> Scalar {
    Scalar::text("60s")
}

fn default_listen() -> String {
    "0.0.0.0:6180".to_owned()
}

fn default_work_stealing() -> bool {
    false
}

fn default_threads() -> i64 {
    2
}

fn default_request_header_timeout() -> Scalar {
    Scalar::text("10s")
}

fn default_max_request_header_bytes() -> Scalar {
    Scalar::text("64KiB")
}

fn default_max_buffered_request_bytes() -> Scalar {
    Scalar::text("64MiB")
}

fn default_request_body_timeout() -> Scalar {
    Scalar::text("10s")
}

fn default_request_body_total_timeout() -> Scalar {
    Scalar::text("60s")
}

fn default_response_send_timeout() -> Scalar {
    Scalar::text("60s")
}

fn default_connect_timeout() -> Scalar {
    Scalar::text("2s")
}

// 2s + 5s + 10s = 17s: a keyed request on the default timeouts fits the default grace period,
// with time left to store its answer.
fn default_read_timeout() -> Scalar {
    Scalar::text("10s")
}

fn default_write_timeout() -> Scalar {
    Scalar::text("5s")
}

fn default_idle_timeout() -> Scalar {
    Scalar::text("60s")
}

impl Default for FileShutdown {
    fn default() -> Self {
        FileShutdown {
            // Leaves headroom under Kubernetes' default terminationGracePeriodSeconds (30).
            grace_period: Scalar::text("20s"),
            graceful_shutdown_timeout: Scalar::text("5s"),
        }
    }
}

impl Default for FileAdmin {
    fn default() -> Self {
        FileAdmin {
            listen: "127.0.0.1:6181".to_owned(),
            token: None,
        }
    }
}

impl Default for FileIdempotency {
    fn default() -> Self {
        FileIdempotency {
            key_header: "Idempotency-Key".to_owned(),
            tenant_header: "X-Tenant-ID".to_owned(),
            default_tenant: "default".to_owned(),
            worker_id: None,
            worker_lease: Scalar::text("30s"),
            docs_url: None,
        }
    }
}

impl Default for FileStore {
    fn default() -> Self {
        FileStore {
            backend: StoreBackend::Memory,
            memory: FileMemoryStore::default(),
            redis: None,
            on_unavailable: OnUnavailable::Reject,
            local_cache: FileLocalCache::default(),
            circuit_breaker: FileBreaker::default(),
            completion_retry: FileRetry::default(),
        }
    }
}

impl Default for FileMemoryStore {
    fn default() -> Self {
        FileMemoryStore {
            capacity: Scalar::text("256MiB"),
            shards: None,
        }
    }
}

impl Default for FileRedis {
    fn default() -> Self {
        FileRedis {
            url: None,
            urls: None,
            cluster: false,
            connect_timeout: Scalar::text("1s"),
            response_timeout: Scalar::text("200ms"),
            key_prefix: "idemgate".to_owned(),
            scripts: FileScripts::default(),
            tls: None,
        }
    }
}

impl Default for FileScripts {
    fn default() -> Self {
        FileScripts {
            dir: None,
            version: DEFAULT_SCRIPTS_VERSION.to_owned(),
            canary: None,
        }
    }
}

impl Default for FileRouteIdempotency {
    fn default() -> Self {
        FileRouteIdempotency {
            key: KeyMode::Required,
            min_key_length: 1,
            ttl: Scalar::text("24h"),
            lock_ttl: Scalar::text("30s"),
            on_in_flight: OnInFlight::Reject,
            wait_timeout: Scalar::text("5s"),
            on_outcome_unknown: OnOutcomeUnknown::Lapse,
            fingerprint: FileFingerprint::default(),
            scope_headers: vec!["Authorization".to_owned()],
            scope_required: false,
            cache_statuses: vec![Scalar::text("2xx"), Scalar::text("4xx")],
            replay_exclude_headers: vec!["Set-Cookie".to_owned()],
            max_request_bytes: Scalar::Int(1 << 20),
            max_response_bytes: Scalar::Int(1 << 20),
        }
    }
}

impl Default for FileFingerprint {
    fn default() -> Self {
        FileFingerprint {
            body: true,
            headers: Vec::new(),
        }
    }
}

/// Deserializes the upstream map, refusing a name given twice: a plain map would silently keep
/// the last block, so an edit could swap a backend without anyone noticing.
fn unique_upstreams<'de, D>(deserializer: D) -> Result<BTreeMap<String, FileUpstream>, D::Error>
where
    D: Deserializer<'de>,
{
    struct UpstreamsVisitor;

    impl<'de> Visitor<'de> for UpstreamsVisitor {
        type Value = BTreeMap<String, FileUpstream>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map of upstream name to upstream")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut upstreams = BTreeMap::new();
            while let Some(name) = map.next_key::<String>()? {
                if upstreams.contains_key(&name) {
                    return Err(de::Error::custom(format!(
                        "duplicate upstream name `{name}`"
                    )));
                }
                let upstream = map.next_value::<FileUpstream>()?;
                upstreams.insert(name, upstream);
            }
            Ok(upstreams)
        }
    }

    deserializer.deserialize_map(UpstreamsVisitor)
}

/// A block that is present is enabled, even when empty: `idempotency:` with every key commented
/// out is YAML null, and reading that as "no idempotency" would silently drop protection.
fn present_block<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Option::<T>::deserialize(deserializer).map(|block| Some(block.unwrap_or_default()))
}

/// A list that is present says what it lists: `scope_headers:` with every entry commented out
/// is YAML null, and reading that as `[]` would silently drop what the default gives
/// (principal scoping, `Set-Cookie` kept out of replays, the stored statuses, one method).
/// `[]` says what an empty list means for the field (`empty`: "none" for most, every method or
/// every tenant for the lists that narrow); a key left out takes the default.
fn explicit_list<'de, D, T>(deserializer: D, field: &str, empty: &str) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<Vec<T>>::deserialize(deserializer)?.ok_or_else(|| {
        de::Error::custom(format_args!(
            "{field}: an empty value: write [] for {empty}, or leave the key out for its default"
        ))
    })
}

/// [`explicit_list`] for one field, named in its error (serde's path stops at the block).
macro_rules! explicit_list_of {
    ($($fn_name:ident => $field:literal, $empty:literal);* $(;)?) => {$(
        fn $fn_name<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
        where
            D: Deserializer<'de>,
            T: Deserialize<'de>,
        {
            explicit_list(deserializer, $field, $empty)
        }
    )*};
}

explicit_list_of! {
    methods_list => "methods", "every method";
    scope_headers_list => "scope_headers", "none";
    cache_statuses_list => "cache_statuses", "none";
    replay_exclude_headers_list => "replay_exclude_headers", "none";
    headers_list => "headers", "none";
    tenants_list => "tenants", "every tenant (a canary is stopped by removing it)";
    routes_list => "routes", "none";
}

// === impl Scalar ===

impl Scalar {
    fn text(s: &str) -> Self {
        Scalar::Text(s.to_owned())
    }
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Text(s) => write!(f, "{s:?}"),
            Scalar::Int(n) => write!(f, "{n}"),
            Scalar::Float(x) => write!(f, "{x}"),
        }
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;

        impl Visitor<'_> for ScalarVisitor {
            type Value = Scalar;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a number")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::text(v))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Scalar, E> {
                Ok(Scalar::Text(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar::Int(v.into()))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Int(v.into()))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(v))
            }
        }

        deserializer.deserialize_any(ScalarVisitor)
    }
}

// === impl Config ===

impl Config {
    /// Reads and validates the config file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = read_bounded(path)
            .and_then(|bytes| {
                String::from_utf8(bytes)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            })
            .map_err(|source| ConfigError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Config::from_yaml_str(&text)
    }

    /// Parses and validates a config from YAML text. Pure but for two look-ups that make an edit
    /// fail early rather than at run time: upstream addresses must resolve, and script versions
    /// named in `store.redis.scripts` must exist.
    pub fn from_yaml_str(text: &str) -> Result<Config, ConfigError> {
        Config::from_yaml_str_with(text, Lookup::System)
    }

    /// [`Config::from_yaml_str`] with the upstream address check done the way `lookup` says.
    pub(crate) fn from_yaml_str_with(text: &str, lookup: Lookup) -> Result<Config, ConfigError> {
        let file: FileConfig = serde_yaml::from_str(text)
            .map_err(|e| ConfigError::Parse(without_quoted_values(&e.to_string())))?;
        let source_hash = hex::encode(Sha256::digest(text.as_bytes()));
        file.into_config(source_hash, lookup)
    }

    /// Checks that every route's largest stored response can go to a Redis store: as one
    /// script argument, which Redis takes up to its default `proto-max-bulk-len` (a larger one
    /// is a protocol error that closes the connection every store call of its thread shares,
    /// and the record stays in flight until its lock lapses and the key runs again), and into
    /// the completion retry queue, where one that could not wait would be dead-lettered at the
    /// first failed write, queue empty or not, and its key executed again once its lock
    /// lapsed. (The embedded store's writes do not fail, so nothing waits there.) Run on the
    /// file as loaded and again on a reload's config once the running `queue_bytes` (read only
    /// at start-up) is in it.
    pub fn check_redis_record_limits(&self) -> Result<(), ConfigError> {
        if self.store.backend != StoreBackend::Redis {
            return Ok(());
        }
        let queue_bytes = self.store.completion_retry.queue_bytes;
        for (i, route) in self.routes.iter().enumerate() {
            let Some(idem) = &route.idempotency else {
                continue;
            };
            let largest = largest_stored(idem);
            if largest > REDIS_MAX_ARGUMENT {
                return Err(invalid(
                    format!("routes[{i}].idempotency.max_response_bytes"),
                    format!(
                        "{} bytes and room for its head (128 KiB) is more than Redis takes in \
                         one argument by default (proto-max-bulk-len, 512 MiB): such a response \
                         could never be stored; at most {} bytes with store.backend: redis",
                        idem.max_response_bytes,
                        REDIS_MAX_ARGUMENT - STORED_HEAD_ALLOWANCE
                    ),
                ));
            }
            if largest > queue_bytes {
                return Err(invalid(
                    format!("routes[{i}].idempotency.max_response_bytes"),
                    format!(
                        "{} bytes and room for its head (128 KiB) is more than \
                         store.completion_retry.queue_bytes ({queue_bytes} bytes in force): a \
                         response Redis failed to take could not wait for a retry; raise \
                         queue_bytes (a restart) or lower this",
                        idem.max_response_bytes
                    ),
                ));
            }
        }
        Ok(())
    }

    /// What is valid but likely a mistake, one message per finding, naming the fields: an
    /// idempotent route that stores no status, or whose backend may take longer than
    /// `shutdown.grace_period` (its upstream's connect + write + read timeouts), so a request in
    /// flight at `SIGTERM` can be cut off before its outcome is stored.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        let keyed = self
            .routes
            .iter()
            .filter_map(|r| r.idempotency.as_ref().map(|idem| (r, idem)));
        for (route, idem) in keyed {
            if route.methods.is_empty() && idem.key == KeyMode::Required {
                warnings.push(format!(
                    "routes[{}].methods is not set, so the route needs a key on every method: \
                     GET, HEAD, TRACE and OPTIONS too, which get 400 without one (a browser's \
                     CORS preflight, an OPTIONS request, never carries it); list the methods \
                     that change state, e.g. [POST, PUT, PATCH, DELETE]",
                    route.name
                ));
            }
            if idem.scope_headers.is_empty() {
                warnings.push(format!(
                    "routes[{}].idempotency.scope_headers is []: keys are not bound to a \
                     principal, so any client of the tenant that knows (or guesses) a key gets \
                     its stored response; keep it only for unguessable keys, and consider \
                     min_key_length",
                    route.name
                ));
            }
            if idem.cache_statuses.is_empty() {
                warnings.push(format!(
                    "routes[{}].idempotency.cache_statuses stores no status: every response \
                     is released, so every retry executes again; the key only holds off \
                     concurrent duplicates",
                    route.name
                ));
            }
            // A record lives `ttl` from its first claim, and a release (a 5xx) does not
            // lengthen it: released near the end of its lock, it may expire before the retry.
            if idem.ttl < 2 * idem.lock_ttl {
                warnings.push(format!(
                    "routes[{}].idempotency.ttl ({}) is less than twice lock_ttl ({}): a record \
                     lives ttl from its first claim, so one released late in its lock (a 5xx) \
                     may expire before the retry, which then runs under a new X-Idempotency-Id \
                     and without 422 protection",
                    route.name,
                    fmt_duration(idem.ttl),
                    fmt_duration(idem.lock_ttl)
                ));
            }
            // The embedded store keeps a response larger than its whole capacity as executed,
            // not replayable: every retry of such a key gets 409 for the record's ttl.
            let largest = largest_stored(idem);
            let capacity = self.store.memory.capacity_bytes;
            if self.store.backend == StoreBackend::Memory && largest > capacity {
                warnings.push(format!(
                    "routes[{}].idempotency.max_response_bytes ({} bytes, with room for its head, \
                     128 KiB) is more than store.memory.capacity ({capacity} bytes): a response \
                     larger than the store is kept as executed but not replayable, so its \
                     retries get 409 instead of the response",
                    route.name, idem.max_response_bytes
                ));
            }
            // A store call answers within response_timeout of being sent or fails, and a
            // record's write shares its connection with every store call of its thread.
            if let (StoreBackend::Redis, Some(redis)) = (self.store.backend, &self.store.redis) {
                let carried = redis.response_timeout.as_secs_f64() * LINK_BYTES_PER_SECOND;
                if largest as f64 > carried {
                    warnings.push(format!(
                        "routes[{}].idempotency.max_response_bytes ({} bytes, with room for its \
                         head, 128 KiB) takes longer than store.redis.response_timeout ({}) to \
                         send at 1 Gbit/s: a response that large can time out its own write \
                         (retried, then dead-lettered) and the store calls of its worker thread \
                         queued behind it; raise response_timeout or lower max_response_bytes",
                        route.name,
                        idem.max_response_bytes,
                        fmt_duration(redis.response_timeout)
                    ));
                }
            }
            let Some(up) = self.upstreams.get(route.upstream) else {
                continue;
            };
            let budget = up.exchange_bound();
            if budget > self.shutdown.grace_period {
                warnings.push(format!(
                    "routes[{}]: its upstream {} may take {} (connect_timeout + write_timeout + \
                     read_timeout), longer than shutdown.grace_period ({}): a request still \
                     running at SIGTERM can be cut off before its outcome is stored, its key \
                     stays locked until lock_ttl, and a retry after that executes it again",
                    route.name,
                    up.name,
                    fmt_duration(budget),
                    fmt_duration(self.shutdown.grace_period)
                ));
            }
        }
        if let (StoreBackend::Redis, None, Some(redis)) = (
            self.store.backend,
            self.idempotency.worker_id,
            self.store.redis.as_ref(),
        ) {
            // A renewal goes out every third of the lease; one that takes Redis's whole
            // deadline and then fails leaves its retry (a second later) too little time.
            let deadline = redis.connect_timeout + 2 * redis.response_timeout;
            let slack = self.idempotency.worker_lease / 3;
            if deadline + Duration::from_secs(1) >= slack {
                warnings.push(format!(
                    "idempotency.worker_lease ({}) leaves a renewal {} between tries, no more than \
                     a Redis call may take plus the retry pause ({} = connect_timeout + 2 × \
                     response_timeout, + 1s): one slow renewal can let the lease lapse while \
                     this process still uses its worker id",
                    fmt_duration(self.idempotency.worker_lease),
                    fmt_duration(slack),
                    fmt_duration(deadline + Duration::from_secs(1)),
                ));
            }
        }
        warnings
    }

    /// Finds where a request goes. `path` is the request path without the query, as the client
    /// sent it: it is matched in its [`route_path`] form, so spellings a backend resolves to the
    /// same resource (`//orders`, `/x/../orders`, `/%6Frders`, `/orders;v=1`) match the same
    /// route, while the request itself is forwarded untouched.
    ///
    /// The first route whose prefix and methods match wins: [`RouteMatch::Idempotent`] if it has
    /// an idempotency block, else [`RouteMatch::Forward`]. An idempotent route also takes its
    /// format suffixes (`/orders.json`) for the methods it lists. Failing that, the first route
    /// whose prefix matches under any method forwards untouched; then `default_upstream`; then
    /// [`RouteMatch::NoRoute`]. Routing fails closed: when that finds no idempotent route, the
    /// path read with `%2F`/`%5C` decoded into separators is matched too, and an idempotent
    /// route found so wins, unless the route found first names an escaped separator in its own
    /// prefix (a carve-out the operator wrote for that very spelling). On the hot path (a path
    /// already in normal form) no allocation.
    pub fn match_route(&self, method: &Method, path: &str) -> RouteMatch {
        let found = self.match_path(method, &route_path(path));
        if matches!(found, RouteMatch::Idempotent(_)) {
            return found;
        }
        if let RouteMatch::Forward { route: Some(i), .. } = found {
            if escaped_separator(&self.routes[i].path_prefix).is_some() {
                return found;
            }
        }
        // Fail closed: a backend that decodes `%2F` (or `%5C`) into a separator before it
        // routes (WSGI servers, nginx's `$uri`) runs `/orders%2F1` as `/orders/1`; one that
        // resolves the target as a URL reference (Node's `new URL(req.url, base)`, Python's
        // `urlsplit`) reads `//x/orders` as host `x` and path `/orders`. Under those readings
        // too, a path an idempotent route covers needs its key.
        let decoded = separators_decoded(path);
        let readings = [
            decoded.as_deref(),
            network_path(path),
            decoded.as_deref().and_then(network_path),
        ];
        for reading in readings.into_iter().flatten() {
            let keyed = self.match_path(method, &route_path(reading));
            if matches!(keyed, RouteMatch::Idempotent(_)) {
                return keyed;
            }
        }
        found
    }

    /// [`Config::match_route`] for one reading of the path, in [`route_path`] form.
    fn match_path(&self, method: &Method, path: &str) -> RouteMatch {
        let mut prefix_only = None;
        for (i, route) in self.routes.iter().enumerate() {
            // Failing closed, an idempotent route also takes its format suffixes; nothing
            // else moves (a forwarding route's traffic keeps its upstream).
            let taken = prefix_matches(&route.path_prefix, path)
                || (route.idempotency.is_some()
                    && route.methods_take(method)
                    && format_suffix_of(&route.path_prefix, path));
            if !taken {
                continue;
            }
            if route.methods_take(method) {
                return match route.idempotency {
                    Some(_) => RouteMatch::Idempotent(i),
                    None => RouteMatch::Forward {
                        route: Some(i),
                        upstream: route.upstream,
                    },
                };
            }
            if prefix_only.is_none() {
                prefix_only = Some((i, route.upstream));
            }
        }
        match (prefix_only, self.default_upstream) {
            (Some((i, upstream)), _) => RouteMatch::Forward {
                route: Some(i),
                upstream,
            },
            (None, Some(upstream)) => RouteMatch::Forward {
                route: None,
                upstream,
            },
            (None, None) => RouteMatch::NoRoute,
        }
    }
}

/// The methods other than GET, HEAD, OPTIONS and TRACE that a route listing `later` takes and
/// an earlier one listing `earlier` takes first (an empty list: every method), for a message:
/// `POST`, `POST, PUT`, or `every method but GET, HEAD, OPTIONS and TRACE`. Empty when none.
pub(crate) fn hidden_unsafe_methods(earlier: &[Method], later: &[Method]) -> String {
    let safe = |m: &Method| {
        matches!(
            *m,
            Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
        )
    };
    match (earlier.is_empty(), later.is_empty()) {
        (true, true) => "every method but GET, HEAD, OPTIONS and TRACE".to_owned(),
        (true, false) => names(later.iter().filter(|m| !safe(m))),
        (false, true) => names(earlier.iter().filter(|m| !safe(m))),
        (false, false) => names(earlier.iter().filter(|m| !safe(m) && later.contains(m))),
    }
}

fn names<'a>(methods: impl Iterator<Item = &'a Method>) -> String {
    methods.map(Method::as_str).collect::<Vec<_>>().join(", ")
}

/// `/orders` matches `/orders` and `/orders/1` but not `/ordersx`; `/orders/` matches only below.
pub(crate) fn prefix_matches(prefix: &str, path: &str) -> bool {
    path.starts_with(prefix)
        && (prefix.ends_with('/')
            || path.len() == prefix.len()
            || path.as_bytes().get(prefix.len()) == Some(&b'/'))
}

/// Whether `path` is `prefix` with a format suffix on its last segment (`/orders.json`,
/// `/orders.`: a dot, then ASCII letters and digits only), a trailing slash after it or not.
/// Web frameworks route it to the handler of `/orders` (Rails, which drops a trailing slash
/// first; Django REST framework's format suffixes, `\.[a-z0-9]+/?`), so an idempotent `/orders`
/// must not let it past without a key.
pub(crate) fn format_suffix_of(prefix: &str, path: &str) -> bool {
    !prefix.ends_with('/')
        && path
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('.'))
            .map(|ext| ext.strip_suffix('/').unwrap_or(ext))
            .is_some_and(|ext| ext.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// The path of a request target that starts with two separators, read as a network-path
/// reference (`//authority/path`) the way WHATWG URL parsers (for which `\` is a `/` too) and
/// Python's `urlsplit` read it when resolving it against a base: what follows the authority
/// (`/` when nothing does). `None` for any other target; no allocation.
fn network_path(path: &str) -> Option<&str> {
    let bytes = path.as_bytes();
    let separator = |b: Option<&u8>| matches!(b, Some(b'/' | b'\\'));
    if !separator(bytes.first()) || !separator(bytes.get(1)) {
        return None;
    }
    // WHATWG skips any further separators before the authority.
    let authority = path.trim_start_matches(['/', '\\']);
    let rest = &authority[authority.find(['/', '\\']).unwrap_or(authority.len())..];
    Some(if rest.is_empty() { "/" } else { rest })
}

/// `path` with every `%2F` and `%5C` (either case) decoded into `/`, when it has any.
fn separators_decoded(path: &str) -> Option<String> {
    escaped_separator(path)?;
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    // Each escape is three ASCII bytes: the slices stay on character boundaries.
    while let Some(at) = escaped_separator(rest) {
        out.push_str(&rest[..at]);
        out.push('/');
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// Where the first `%2F` or `%5C` (either case) in `s` starts.
fn escaped_separator(s: &str) -> Option<usize> {
    s.match_indices('%').map(|(at, _)| at).find(|&at| {
        s.get(at + 1..at + 3)
            .is_some_and(|hex| hex.eq_ignore_ascii_case("2f") || hex.eq_ignore_ascii_case("5c"))
    })
}

// === Route paths ===
//
// Routes decide which requests need a key, so they must see a path the way the backend will.
// Backends normalise before they route: Kestrel and Tomcat remove dot-segments, nginx and Go
// merge slashes and percent-decode, Tomcat and Jetty drop `;params`. Were routes matched on the
// raw path, `POST /x/../orders` would miss an idempotent `/orders` route, be forwarded with no
// key check, and run the orders handler all the same: a retry would execute twice.

/// The form of a request path that routes are matched against (RFC 3986 §6.2.2, plus the
/// path-parameter rule of servlet containers):
///
/// - `%XX` escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`, hex in either case) are
///   decoded; every other escape stays encoded, with its hex in upper case. `%2F` in particular
///   stays `%2F`: a backend that decodes it into a `/` splits segments where the client did not.
/// - `;params` are dropped from every segment (`/orders;v=1` is `/orders`, `/..;/` is `/../`).
/// - `\\` counts as `/` (IIS and WHATWG URL parsers read it so), and runs of `/` become one.
/// - Dot-segments are removed (RFC 3986 §5.2.4), also where they were written `%2E`; `..`
///   never climbs above the root.
///
/// Case is kept: routes `/Orders` and `/orders` are distinct, and folding them would make
/// distinct routes collide. A backend that folds case itself needs its idempotent routes
/// listed in every case clients may send, or under a prefix that covers them.
///
/// Borrows `path` unchanged, without allocating, when it has no `%`, no `;`, no `\\`, no `//`
/// and no `/.`: the common case costs one scan. A path that does not start with `/` (or `\`) is returned as it
/// is (no prefix matches it).
pub fn route_path(path: &str) -> Cow<'_, str> {
    // A leading `\\` only comes from a reading (a network-path reference's path after a
    // backslash): a request target must start with `/`.
    if !path.starts_with(['/', '\\']) || !may_need_normalising(path) {
        return Cow::Borrowed(path);
    }
    Cow::Owned(normalise_path(path))
}

/// Whether `path` holds anything [`route_path`] could change.
fn may_need_normalising(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.iter().enumerate().any(|(i, &b)| match b {
        b'%' | b';' | b'\\' => true,
        b'/' => matches!(bytes.get(i + 1), Some(b'/' | b'.')),
        _ => false,
    })
}

/// [`route_path`] for a path starting with `/`, built segment by segment in one buffer.
fn normalise_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    // Whether the last segment named a directory (`/a/`, `/a/.`, `/a/..`): the result then
    // keeps its trailing slash, which decides whether a prefix such as `/pay/` matches.
    let mut ends_in_slash = false;
    for segment in path[1..].split(['/', '\\']) {
        // Parameters first: `..;x` is a dot-segment to Tomcat. `;` is not unreserved, so an
        // escaped `%3B` is never decoded into a separator.
        let segment = segment.split_once(';').map_or(segment, |(name, _)| name);
        let start = out.len();
        out.push('/');
        push_decoded(&mut out, segment);
        ends_in_slash = true;
        match &out[start + 1..] {
            // An empty segment is a repeated slash: merged.
            "" | "." => out.truncate(start),
            ".." => {
                out.truncate(start);
                let parent = out.rfind('/').unwrap_or(0);
                out.truncate(parent);
            }
            _ => ends_in_slash = false,
        }
    }
    if ends_in_slash || out.is_empty() {
        out.push('/');
    }
    out
}

/// Appends `segment` with escapes of unreserved characters decoded and the rest upper-cased.
/// A `%` not followed by two hex digits is kept as it is.
fn push_decoded(out: &mut String, segment: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let bytes = segment.as_bytes();
    let hex = |i: usize| {
        bytes
            .get(i)
            .and_then(|&b| char::from(b).to_digit(16))
            .map(|d| d as u8)
    };
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            i += 1;
            continue;
        }
        let (Some(high), Some(low)) = (hex(i + 1), hex(i + 2)) else {
            i += 1;
            continue;
        };
        // `i` is at an ASCII `%`, so it is a char boundary.
        out.push_str(&segment[copied..i]);
        let byte = high << 4 | low;
        if is_unreserved(byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(high)]));
            out.push(char::from(HEX[usize::from(low)]));
        }
        i += 3;
        copied = i;
    }
    out.push_str(&segment[copied..]);
}

// === Validating conversion ===

impl FileConfig {
    fn into_config(self, source_hash: String, lookup: Lookup) -> Result<Config, ConfigError> {
        let listen = socket_addr("listen", &self.listen)?;
        let threads = int_in_range("threads", self.threads, 1, 256)?;
        let request_header_timeout = positive_duration(
            "request_header_timeout".into(),
            &self.request_header_timeout,
        )?;
        let max_request_header_bytes = byte_size_in_range(
            "max_request_header_bytes".into(),
            &self.max_request_header_bytes,
            1 << 10,
            1 << 20,
        )?;
        let request_body_timeout =
            positive_duration("request_body_timeout".into(), &self.request_body_timeout)?;
        let request_body_total_timeout = positive_duration(
            "request_body_total_timeout".into(),
            &self.request_body_total_timeout,
        )?;
        let response_send_timeout =
            positive_duration("response_send_timeout".into(), &self.response_send_timeout)?;
        let max_buffered_request_bytes = byte_size_in_range(
            "max_buffered_request_bytes".into(),
            &self.max_buffered_request_bytes,
            1 << 10,
            MAX_BUFFERED_BYTES,
        )?;

        let shutdown = ShutdownConfig {
            // Zero would skip the drain: in-flight requests cut off at once.
            grace_period: whole_seconds(
                "shutdown.grace_period",
                &self.shutdown.grace_period,
                false,
            )?,
            // Zero is allowed: the grace period was the whole budget, stop the runtimes at
            // once (completions still waiting are dead-lettered after the server stops).
            graceful_shutdown_timeout: whole_seconds(
                "shutdown.graceful_shutdown_timeout",
                &self.shutdown.graceful_shutdown_timeout,
                true,
            )?,
        };

        let env_token = match std::env::var(ADMIN_TOKEN_ENV) {
            Ok(token) => Some(token),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(invalid(ADMIN_TOKEN_ENV, "is not valid UTF-8"));
            }
        };
        let admin = AdminConfig {
            listen: socket_addr("admin.listen", &self.admin.listen)?,
            token: admin_token(env_token, self.admin.token)?,
        };
        if listeners_overlap(listen, admin.listen) {
            return Err(invalid(
                "admin.listen",
                format!("{} overlaps the proxy listener {listen}", admin.listen),
            ));
        }

        if self.upstreams.is_empty() {
            return Err(invalid("upstreams", "at least one upstream is required"));
        }
        // BTreeMap iteration is sorted by name, which `upstream_index` relies on.
        let ours = [("listen", listen), ("admin.listen", admin.listen)];
        let upstreams = self
            .upstreams
            .into_iter()
            .map(|(name, upstream)| upstream.into_config(name, lookup, &ours))
            .collect::<Result<Vec<_>, _>>()?;

        let default_upstream =
            match &self.default_upstream {
                Some(name) => Some(upstream_index(&upstreams, name).ok_or_else(|| {
                    invalid("default_upstream", unknown_upstream(name, &upstreams))
                })?),
                None if upstreams.len() == 1 => Some(0),
                None => None,
            };

        let idempotency = self.idempotency.into_config()?;
        let redis_password = match std::env::var(REDIS_PASSWORD_ENV) {
            Ok(password) => redis_password(password)?,
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(invalid(REDIS_PASSWORD_ENV, "is not valid UTF-8"));
            }
        };
        let store = self.store.into_config(redis_password.as_deref())?;

        let mut routes: Vec<Route> = Vec::with_capacity(self.routes.len());
        for (i, file_route) in self.routes.into_iter().enumerate() {
            let route = file_route.into_config(&format!("routes[{i}]"), &upstreams)?;
            if let Some(k) = routes.iter().position(|r| r.name == route.name) {
                return Err(invalid(
                    format!("routes[{i}].name"),
                    format!("duplicate route name {:?} (also routes[{k}])", route.name),
                ));
            }
            // The first route that matches takes a request: an idempotent route below one that
            // takes every path it covers, for a method it lists, never sees that method, and
            // those requests go on unprotected (or under the other route's settings). An
            // earlier route that takes only safe methods (reads kept free of keys) is fine.
            if route.idempotency.is_some() {
                let shadow = routes.iter().enumerate().find_map(|(k, earlier)| {
                    if !prefix_matches(&earlier.path_prefix, &route.path_prefix) {
                        return None;
                    }
                    let hidden = hidden_unsafe_methods(&earlier.methods, &route.methods);
                    (!hidden.is_empty()).then_some((k, earlier, hidden))
                });
                if let Some((k, earlier, hidden)) = shadow {
                    return Err(invalid(
                        format!("routes[{i}].path_prefix"),
                        format!(
                            "never reached for {hidden}: routes[{k}] ({:?}, path_prefix {:?}) \
                             comes first and takes every such request under {:?}; put this \
                             route before it, or narrow that one's methods",
                            earlier.name, earlier.path_prefix, route.path_prefix
                        ),
                    ));
                }
            }
            // A body the budget can never hold would be refused on every try, as if the
            // proxy were busy: say so now.
            if let Some(idem) = &route.idempotency {
                if idem.max_request_bytes > max_buffered_request_bytes {
                    return Err(invalid(
                        format!("routes[{i}].idempotency.max_request_bytes"),
                        format!(
                            "{} bytes is more than max_buffered_request_bytes ({} bytes), \
                             which every keyed request's body is held within: raise \
                             max_buffered_request_bytes or lower this",
                            idem.max_request_bytes, max_buffered_request_bytes
                        ),
                    ));
                }
            }
            routes.push(route);
        }

        let config = Config {
            listen,
            threads,
            work_stealing: self.work_stealing,
            request_header_timeout,
            max_request_header_bytes,
            request_body_timeout,
            request_body_total_timeout,
            max_buffered_request_bytes,
            response_send_timeout,
            shutdown,
            admin,
            upstreams,
            default_upstream,
            idempotency,
            store,
            routes,
            source_hash,
        };
        config.check_redis_record_limits()?;
        Ok(config)
    }
}

impl FileUpstream {
    fn into_config(
        self,
        name: String,
        lookup: Lookup,
        ours: &[(&str, SocketAddr)],
    ) -> Result<UpstreamConfig, ConfigError> {
        if name.is_empty() {
            return Err(invalid("upstreams", "upstream names must not be empty"));
        }
        let base = format!("upstreams.{name}");
        if self.addrs.is_empty() {
            return Err(invalid(
                format!("{base}.addrs"),
                "at least one address (host:port) is required",
            ));
        }
        for (j, addr) in self.addrs.iter().enumerate() {
            resolves(format!("{base}.addrs[{j}]"), addr, lookup, ours)?;
        }
        Ok(UpstreamConfig {
            connect_timeout: positive_duration(
                format!("{base}.connect_timeout"),
                &self.connect_timeout,
            )?,
            read_timeout: positive_duration(format!("{base}.read_timeout"), &self.read_timeout)?,
            write_timeout: positive_duration(format!("{base}.write_timeout"), &self.write_timeout)?,
            // Zero is allowed: it means idle connections are not kept.
            idle_timeout: duration(format!("{base}.idle_timeout"), &self.idle_timeout)?,
            max_in_flight: self
                .max_in_flight
                .map(|n| int_in_range(&format!("{base}.max_in_flight"), n, 1, 1_000_000))
                .transpose()?,
            addrs: self.addrs,
            name,
        })
    }
}

impl FileIdempotency {
    fn into_config(self) -> Result<GlobalIdempotency, ConfigError> {
        let key_header = record_header("idempotency.key_header".into(), &self.key_header)?;
        let tenant_header = record_header("idempotency.tenant_header".into(), &self.tenant_header)?;
        if key_header == tenant_header {
            return Err(invalid(
                "idempotency.tenant_header",
                format!("must differ from key_header ({key_header})"),
            ));
        }
        if !is_valid_tenant(&self.default_tenant) {
            return Err(invalid(
                "idempotency.default_tenant",
                format!(
                    "invalid tenant {:?} (1-128 characters of A-Z a-z 0-9 . _ : -)",
                    self.default_tenant
                ),
            ));
        }
        let worker_id = self
            .worker_id
            .map(|id| int_in_range("idempotency.worker_id", id, 0, 1023))
            .transpose()?;
        let worker_lease = duration("idempotency.worker_lease".into(), &self.worker_lease)?;
        if !(MIN_WORKER_LEASE..=MAX_WORKER_LEASE).contains(&worker_lease) {
            return Err(invalid(
                "idempotency.worker_lease",
                format!(
                    "{} is out of range ({}s to {}s): it is renewed every third of itself, \
                     and a process cut off from Redis keeps its id this long",
                    self.worker_lease,
                    MIN_WORKER_LEASE.as_secs(),
                    MAX_WORKER_LEASE.as_secs()
                ),
            ));
        }
        let docs_link = self.docs_url.as_deref().map(docs_link).transpose()?;
        Ok(GlobalIdempotency {
            docs_link,
            key_header,
            tenant_header,
            default_tenant: self.default_tenant,
            worker_id,
            worker_lease,
        })
    }
}

/// The admin token in force: `IDEMGATE_ADMIN_TOKEN` when it is set and not empty, else
/// `admin.token` when that is not empty, else none. An empty variable counts as unset: a
/// manifest that declares it with no value must not silently disable the file's token. A token
/// shorter than 16 characters is refused, naming where it came from.
fn admin_token(env: Option<String>, file: Option<String>) -> Result<Option<String>, ConfigError> {
    let (token, source, overrides) = match env.filter(|t| !t.is_empty()) {
        Some(token) => (
            Some(token),
            ADMIN_TOKEN_ENV,
            " (this environment variable overrides admin.token)",
        ),
        None => (file.filter(|t| !t.is_empty()), "admin.token", ""),
    };
    if token
        .as_ref()
        .is_some_and(|t| t.len() < MIN_ADMIN_TOKEN_LEN)
    {
        return Err(invalid(
            source,
            format!("must be at least {MIN_ADMIN_TOKEN_LEN} characters{overrides}"),
        ));
    }
    // A client's `Authorization` value loses its surrounding whitespace on the way (HTTP trims
    // header values), so a token that has any (a Secret made from a file ending in a newline)
    // could never match, and every admin write would be refused with nothing saying why.
    if token
        .as_ref()
        .is_some_and(|t| !t.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(invalid(
            source,
            format!(
                "must be printable ASCII with no spaces (a trailing newline from the file or \
                 Secret it came from?){overrides}"
            ),
        ));
    }
    Ok(token)
}

/// Bytes of one generation of the local-cache Bloom filter, as the `bloomfilter` crate's
/// `new_for_fp_rate` sizes it. Its inputs must be in range already (at least one item, a rate
/// in ]0, 1[): the crate asserts both.
fn bloom_generation_bytes(expected_items: usize, false_positive_rate: f64) -> usize {
    bloomfilter::Bloom::<[u8]>::compute_bitmap_size(expected_items, false_positive_rate)
}

/// serde's message for a value of the wrong shape quotes the value (`invalid type: string
/// "redis://:password@host", expected a sequence`), and the message goes to stderr, the log
/// and the body of a refused `POST /admin/reload`: a URL with its password, or a token, where
/// a list or a map was meant. Every quoted string becomes "a string"; the field path, line and
/// column still say where it is.
fn without_quoted_values(message: &str) -> String {
    const QUOTED: &str = "string \"";
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find(QUOTED) {
        out.push_str(&rest[..at]);
        let value = &rest[at + QUOTED.len()..];
        // The value is written as `{:?}` writes it: `\"` and `\\` inside, `"` at the end.
        let mut escaped = false;
        let end = value.char_indices().find_map(|(i, c)| {
            let closes = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            closes.then_some(i)
        });
        match end {
            Some(end) => {
                out.push_str("a string");
                rest = &value[end + 1..];
            }
            // Unterminated (not serde's shape): nothing of it is kept.
            None => {
                out.push_str("a string");
                rest = "";
            }
        }
    }
    out.push_str(rest);
    // An enum's unknown value is quoted in backticks: `backend: "redis://:pw@host"`, a
    // template filled into the wrong key, would show its password the same way. A short word
    // (a misspelt `queue`, what enum values look like) is still shown; anything longer, or with
    // other characters, is not (an admin token has 16 characters at least).
    const VARIANT: &str = "unknown variant `";
    let mut redacted = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find(VARIANT) {
        redacted.push_str(&rest[..at]);
        let value = &rest[at + VARIANT.len()..];
        let (word, after) = value.split_once('`').unwrap_or((value, ""));
        let plain = word.len() < 16
            && word
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if plain {
            redacted.push_str(&format!("unknown variant `{word}`"));
        } else {
            redacted.push_str("unknown variant");
        }
        rest = after;
    }
    redacted.push_str(rest);
    redacted
}

/// Room a stored response needs besides its body: its head, which the backend client reads up
/// to 64 KiB (and one read past that, at most another 64 KiB, before it refuses it).
const STORED_HEAD_ALLOWANCE: usize = 2 * crate::upstream::MAX_RESPONSE_HEAD_BYTES;

/// The most bytes a stored response of `idem`'s route may take: its body and room for its head.
fn largest_stored(idem: &RouteIdempotency) -> usize {
    idem.max_response_bytes
        .saturating_add(STORED_HEAD_ALLOWANCE)
}

/// Redis's default `proto-max-bulk-len`: the largest argument (a stored response, whole) it
/// takes.
const REDIS_MAX_ARGUMENT: usize = 512 << 20;

/// The link a Redis store is assumed to have, for [`Config::warnings`]: 1 Gbit/s.
const LINK_BYTES_PER_SECOND: f64 = 125e6;

/// The shortest `store.completion_retry.base_delay`.
const MIN_RETRY_DELAY: Duration = Duration::from_millis(10);

/// The smallest `store.memory.capacity`: about a hundred small records.
const MIN_MEMORY_CAPACITY: u64 = 64 << 10;

/// Shards of an embedded store when `store.memory.shards` is unset: one per 4 MiB of capacity,
/// 64 to 4096. A shard's hash table doubles in one step while its lock is held, so the pause a
/// growing store puts on the requests of that shard scales with the shard's size; at ~4 MiB
/// (5–8k records) a doubling stays under a millisecond. 256 MiB gets 64 shards, 4 GiB 1024.
fn default_memory_shards(capacity_bytes: usize) -> usize {
    const BYTES_PER_SHARD: usize = 4 << 20;
    (capacity_bytes / BYTES_PER_SHARD).clamp(64, 4096)
}

impl FileStore {
    /// The store settings; `redis_password` (from [`REDIS_PASSWORD_ENV`]) replaces the password
    /// of every Redis URL.
    fn into_config(self, redis_password: Option<&str>) -> Result<StoreConfig, ConfigError> {
        // A few hundred bytes hold no record with its response: `capacity: 256` meant MiB,
        // and such a store would refuse every keyed request (503) while reporting ready.
        let capacity_bytes = byte_size_in_range(
            "store.memory.capacity".into(),
            &self.memory.capacity,
            MIN_MEMORY_CAPACITY,
            u64::MAX,
        )?;
        let memory = MemoryStoreConfig {
            capacity_bytes,
            shards: match self.memory.shards {
                Some(shards) => int_in_range("store.memory.shards", shards, 1, 4096)?,
                None => default_memory_shards(capacity_bytes),
            },
        };
        // `backend: redis` with no block means a local server with every default.
        let redis = match (self.redis, self.backend) {
            (Some(block), _) => Some(block.into_config(redis_password)?),
            (None, StoreBackend::Redis) => Some(FileRedis::default().into_config(redis_password)?),
            (None, StoreBackend::Memory) => None,
        };
        let c = &self.local_cache;
        let cache_bytes = byte_size("store.local_cache.capacity".into(), &c.capacity)?;
        // Below one in a million each lookup probes more than 20 bits (a cache miss each) under
        // the filter's lock, for no gain: a positive only costs a look in the local cache.
        if !(c.false_positive_rate >= 1e-6 && c.false_positive_rate < 0.5) {
            return Err(invalid(
                "store.local_cache.false_positive_rate",
                format!(
                    "{} is out of range (at least 0.000001, below 0.5)",
                    c.false_positive_rate
                ),
            ));
        }
        let local_cache = LocalCacheConfig {
            enabled: c.enabled,
            capacity_bytes: bytes_in_range(
                "store.local_cache.capacity".into(),
                cache_bytes,
                1024,
                u64::MAX,
            )?,
            expected_items: int_in_range(
                "store.local_cache.expected_items",
                c.expected_items,
                1,
                1_000_000_000,
            )?,
            false_positive_rate: c.false_positive_rate,
        };
        // The filter keeps two generations, allocated whole at start: a setting that asks for
        // gigabytes would abort the process rather than fail a check.
        let generation =
            bloom_generation_bytes(local_cache.expected_items, local_cache.false_positive_rate)
                as u64;
        if generation.saturating_mul(2) > MAX_BLOOM_BYTES {
            return Err(invalid(
                "store.local_cache.expected_items",
                format!(
                    "{} items at store.local_cache.false_positive_rate {:?} need a Bloom filter of \
                     {} per generation, {} for its two generations; at most {} in total: \
                     lower expected_items or raise false_positive_rate",
                    local_cache.expected_items,
                    local_cache.false_positive_rate,
                    fmt_approx_bytes(generation as f64),
                    fmt_approx_bytes(2.0 * generation as f64),
                    fmt_approx_bytes(MAX_BLOOM_BYTES as f64),
                ),
            ));
        }
        let b = &self.circuit_breaker;
        let circuit_breaker = BreakerConfig {
            failure_threshold: int_in_range(
                "store.circuit_breaker.failure_threshold",
                b.failure_threshold,
                1,
                1000,
            )?,
            open_for: bounded_duration(
                "store.circuit_breaker.open_for",
                &b.open_for,
                Duration::from_secs(600),
                "an open circuit refuses every keyed request that long, however short the blip",
            )?,
        };
        let r = &self.completion_retry;
        let base_delay =
            positive_duration("store.completion_retry.base_delay".into(), &r.base_delay)?;
        if base_delay < MIN_RETRY_DELAY {
            // Attempts fail at once while the circuit is open: pauses of a millisecond or
            // less would spin every waiting completion through the retrier, a core's worth.
            return Err(invalid(
                "store.completion_retry.base_delay",
                "must be at least 10ms: shorter pauses retry a store that is down in a busy loop",
            ));
        }
        let max_delay = positive_duration("store.completion_retry.max_delay".into(), &r.max_delay)?;
        if max_delay < base_delay {
            return Err(invalid(
                "store.completion_retry.max_delay",
                "must not be shorter than base_delay",
            ));
        }
        if r.dead_letter_path.trim().is_empty() {
            return Err(invalid(
                "store.completion_retry.dead_letter_path",
                "must not be empty",
            ));
        }
        let completion_retry = RetryConfig {
            attempts: int_in_range("store.completion_retry.attempts", r.attempts, 1, 100)?,
            base_delay,
            max_delay,
            queue_capacity: int_in_range(
                "store.completion_retry.queue_capacity",
                r.queue_capacity,
                1,
                10_000_000,
            )?,
            queue_bytes: byte_size_in_range(
                "store.completion_retry.queue_bytes".into(),
                &r.queue_bytes,
                1 << 20,
                1 << 40,
            )?,
            dead_letter_path: std::path::PathBuf::from(&r.dead_letter_path),
        };
        Ok(StoreConfig {
            backend: self.backend,
            memory,
            redis,
            on_unavailable: self.on_unavailable,
            local_cache,
            circuit_breaker,
            completion_retry,
        })
    }
}

impl FileRedis {
    fn into_config(self, password: Option<&str>) -> Result<RedisConfig, ConfigError> {
        let (field, urls) = match (self.url, self.urls) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "store.redis.urls",
                    "set either url or urls, not both",
                ))
            }
            (Some(url), None) => ("store.redis.url", vec![url]),
            (None, Some(urls)) if urls.is_empty() => {
                return Err(invalid("store.redis.urls", "must list at least one URL"))
            }
            (None, Some(urls)) => ("store.redis.urls", urls),
            (None, None) => ("store.redis.url", vec![DEFAULT_REDIS_URL.to_owned()]),
        };
        let several = urls.len() > 1;
        // What each URL is called in errors: `url`, or `urls[i]` when there are several.
        let fields: Vec<String> = (0..urls.len())
            .map(|i| {
                if several {
                    format!("{field}[{i}]")
                } else {
                    field.to_owned()
                }
            })
            .collect();
        let mut sentinels = 0;
        let mut plain = None;
        for (url, field) in urls.iter().zip(&fields) {
            let field = field.clone();
            if check_redis_url(url).map_err(|message| invalid(field.clone(), message))? {
                sentinels += 1;
            }
            if !uses_tls(url) {
                plain.get_or_insert(field);
            }
        }
        // One transport for every node: a seed list that mixes TLS and plain text would let
        // some connections go out unencrypted.
        if plain.is_some() && urls.iter().any(|url| uses_tls(url)) {
            return Err(invalid(
                "store.redis.urls",
                "mixes TLS (rediss://) and plain-text (redis://) URLs; use one for all",
            ));
        }
        let tls = match self.tls {
            None => None,
            Some(block) => {
                // The block asks for TLS: a plain URL beside it would silently go unencrypted.
                if let Some(field) = plain {
                    return Err(invalid(
                        "store.redis.tls",
                        format!(
                            "is set, but {field} is a plain-text URL; use rediss:// \
                             (or rediss+sentinel://) with store.redis.tls"
                        ),
                    ));
                }
                Some(block.into_config()?)
            }
        };
        let topology = if sentinels > 0 {
            if sentinels != urls.len() {
                return Err(invalid(
                    "store.redis.urls",
                    "redis+sentinel:// URLs cannot be mixed with redis:// or rediss:// ones",
                ));
            }
            if self.cluster {
                return Err(invalid(
                    "store.redis.cluster",
                    "Redis Cluster cannot be reached through redis+sentinel:// URLs",
                ));
            }
            // Each URL once, with whether it names a database rather than take the default.
            let parsed: Vec<(SentinelUrl, bool)> = urls
                .iter()
                .filter_map(|url| Some((parse_sentinel_url(url).ok()?, sentinel_url_names_db(url))))
                .collect();
            if parsed
                .windows(2)
                .any(|pair| pair[0].0.master != pair[1].0.master)
            {
                return Err(invalid(
                    "store.redis.urls",
                    "every redis+sentinel:// URL must name the same master",
                ));
            }
            // The primary is reached with the first URL's credentials and database. A later URL
            // that gives none of them takes the first's; one that gives others would have them
            // dropped without a word.
            if let Some((first, _)) = parsed.first() {
                let conflict = parsed.iter().position(|(p, names_db)| {
                    let credentials = p.username.is_some() || p.password.is_some();
                    (credentials
                        && (&p.username, &p.password) != (&first.username, &first.password))
                        || (*names_db && p.db != first.db)
                });
                if let Some(i) = conflict {
                    return Err(invalid(
                        format!("store.redis.urls[{i}]"),
                        "every redis+sentinel:// URL that gives a user, password or database must \
                         give the first URL's (the first URL's are the ones used)",
                    ));
                }
            }
            RedisTopology::Sentinel
        } else if self.cluster || several {
            check_cluster_seeds(&urls, &fields)?;
            RedisTopology::Cluster
        } else {
            RedisTopology::Single
        };
        // Braces would break the `{tenant:hash}` Redis Cluster hash tag that follows the prefix.
        if self.key_prefix.is_empty()
            || self
                .key_prefix
                .chars()
                .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                "store.redis.key_prefix",
                format!(
                    "invalid key prefix {:?} (non-empty, no braces or whitespace)",
                    self.key_prefix
                ),
            ));
        }
        // Checked as written (the Sentinel URLs' credentials among them); the password from the
        // environment goes in afterwards, replacing any the file gives, as the admin token's
        // variable wins over admin.token.
        let urls: Vec<String> = match password {
            Some(password) => urls
                .iter()
                .map(|url| with_password(url, password))
                .collect(),
            None => urls,
        };
        Ok(RedisConfig {
            urls,
            topology,
            connect_timeout: bounded_duration(
                "store.redis.connect_timeout",
                &self.connect_timeout,
                Duration::from_secs(60),
                "every keyed request may wait that long for a Redis that does not answer",
            )?,
            response_timeout: bounded_duration(
                "store.redis.response_timeout",
                &self.response_timeout,
                Duration::from_secs(60),
                "every keyed request may wait twice that long for a Redis that does not answer",
            )?,
            key_prefix: self.key_prefix,
            scripts: self.scripts.into_config()?,
            tls,
        })
    }
}

/// What a PEM file given in `store.redis.tls` must hold; see
/// [`RedisTlsConfig::check_contents`].
#[derive(Clone, Copy)]
enum Pem {
    /// One or more certificates (a CA bundle, a client certificate chain).
    Certificates,
    /// One private key (PKCS#8, PKCS#1 or SEC1).
    PrivateKey,
}

impl Pem {
    /// Whether `bytes` hold PEM of this kind.
    fn holds(self, bytes: &[u8]) -> bool {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        match self {
            Pem::Certificates => {
                let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(bytes).collect();
                certs.is_ok_and(|c| !c.is_empty())
            }
            Pem::PrivateKey => PrivateKeyDer::from_pem_slice(bytes).is_ok(),
        }
    }

    /// Whether `key` (PEM) is the private key of the first certificate in `cert` (PEM): an
    /// error saying why not, or `Ok` also when the key type cannot be compared. Redis would
    /// otherwise refuse every handshake made with the pair, with nothing in idemgate's logs to
    /// say which file is wrong.
    fn key_pair(cert: &[u8], key: &[u8]) -> Result<(), String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| Pem::Certificates.missing().to_owned())?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|_| Pem::PrivateKey.missing())?;
        let provider = rustls::crypto::ring::default_provider();
        match rustls::sign::CertifiedKey::from_der(chain, key, &provider) {
            Ok(_) => Ok(()),
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
                Err("is not the private key of the certificate in cert_file".to_owned())
            }
            Err(e) => Err(format!(
                "cannot be used with the certificate in cert_file: {e}"
            )),
        }
    }

    /// What a file without it holds, for messages.
    fn missing(self) -> &'static str {
        match self {
            Pem::Certificates => "no PEM certificate (-----BEGIN CERTIFICATE-----)",
            Pem::PrivateKey => "no PEM private key (PKCS#8, PKCS#1 or SEC1)",
        }
    }
}

impl FileRedisTls {
    fn into_config(self) -> Result<RedisTlsConfig, ConfigError> {
        let file = |field: &str, raw: Option<String>| {
            raw.map(|raw| readable_file(&format!("store.redis.tls.{field}"), &raw))
                .transpose()
        };
        let ca = file("ca_file", self.ca_file)?;
        let cert = file("cert_file", self.cert_file)?;
        let key = file("key_file", self.key_file)?;
        match (&cert, &key) {
            (Some(_), None) => {
                return Err(invalid(
                    "store.redis.tls.key_file",
                    "is required with cert_file (the client certificate's private key)",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "store.redis.tls.cert_file",
                    "is required with key_file (the client certificate)",
                ))
            }
            _ => {}
        }
        fn path(file: &Option<(PathBuf, Vec<u8>)>) -> Option<PathBuf> {
            file.as_ref().map(|(path, _)| path.clone())
        }
        fn bytes(file: &Option<(PathBuf, Vec<u8>)>) -> Option<&[u8]> {
            file.as_ref().map(|(_, bytes)| &bytes[..])
        }
        let config = RedisTlsConfig {
            ca_file: path(&ca),
            cert_file: path(&cert),
            key_file: path(&key),
        };
        config
            .check_contents(bytes(&ca), bytes(&cert), bytes(&key))
            .map_err(|(field, why)| invalid(format!("store.redis.tls.{field}"), why))?;
        Ok(config)
    }
}

impl RedisTlsConfig {
    /// Checks what the files hold, as read at one moment (`None` for a file not configured): PEM
    /// of the right kind in each, and a key that is the client certificate's. The error names
    /// the field (`ca_file`, `cert_file` or `key_file`) and the file, never its contents (a key
    /// file is a secret). Run at load, and by the store each time it reads the files again.
    pub fn check_contents(
        &self,
        ca: Option<&[u8]>,
        cert: Option<&[u8]>,
        key: Option<&[u8]>,
    ) -> Result<(), (&'static str, String)> {
        let files = [
            ("ca_file", &self.ca_file, ca, Pem::Certificates),
            ("cert_file", &self.cert_file, cert, Pem::Certificates),
            ("key_file", &self.key_file, key, Pem::PrivateKey),
        ];
        for (field, path, bytes, kind) in files {
            if let (Some(path), Some(bytes)) = (path, bytes) {
                if !kind.holds(bytes) {
                    return Err((
                        field,
                        format!("{} holds {}", path.display(), kind.missing()),
                    ));
                }
            }
        }
        if let (Some(cert_path), Some(key_path), Some(cert), Some(key)) =
            (&self.cert_file, &self.key_file, cert, key)
        {
            Pem::key_pair(cert, key).map_err(|why| {
                let (key_path, cert_path) = (key_path.display(), cert_path.display());
                ("key_file", format!("{key_path} {why} ({cert_path})"))
            })?;
        }
        Ok(())
    }
}

/// Reads the file `raw` names, for [`RedisTlsConfig::check_contents`]. Messages name the file,
/// never its contents.
fn readable_file(field: &str, raw: &str) -> Result<(PathBuf, Vec<u8>), ConfigError> {
    if raw.trim().is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    let path = PathBuf::from(raw);
    let bytes = read_bounded(&path)
        .map_err(|e| invalid(field, format!("cannot read {}: {e}", path.display())))?;
    Ok((path, bytes))
}

/// Whether a store URL is reached over TLS.
fn uses_tls(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with(SENTINEL_TLS_SCHEME)
}

/// Whether a store URL names Sentinels.
fn is_sentinel_url(url: &str) -> bool {
    url.starts_with(SENTINEL_SCHEME) || url.starts_with(SENTINEL_TLS_SCHEME)
}

impl FileScripts {
    /// Checks that every named version exists (on disk or built in) and can be read, so an edit
    /// naming a missing version is refused like any other invalid edit. Whether the text
    /// compiles only Redis can say; the store checks that when it loads the scripts.
    fn into_config(self) -> Result<ScriptsConfig, ConfigError> {
        let dir = match self.dir {
            None => None,
            Some(raw) if raw.trim().is_empty() => {
                return Err(invalid("store.redis.scripts.dir", "must not be empty"))
            }
            Some(raw) => {
                let dir = PathBuf::from(raw);
                if !dir.is_dir() {
                    return Err(invalid(
                        "store.redis.scripts.dir",
                        format!("{} is not a directory", dir.display()),
                    ));
                }
                Some(dir)
            }
        };
        let exists = |field: &str, version: &str| {
            crate::scripts::Sources::find(dir.as_deref(), version)
                .map(|_| ())
                .map_err(|e| invalid(field, e.to_string()))
        };
        exists("store.redis.scripts.version", &self.version)?;
        let canary = match self.canary {
            None => None,
            Some(c) => {
                exists("store.redis.scripts.canary.version", &c.version)?;
                if c.version == self.version {
                    return Err(invalid(
                        "store.redis.scripts.canary.version",
                        format!(
                            "{:?} is already the active version (store.redis.scripts.version)",
                            c.version
                        ),
                    ));
                }
                for (i, tenant) in c.tenants.iter().enumerate() {
                    if !is_valid_tenant(tenant) {
                        return Err(invalid(
                            format!("store.redis.scripts.canary.tenants[{i}]"),
                            format!("invalid tenant {tenant:?} (1-128 of [A-Za-z0-9._:-])"),
                        ));
                    }
                }
                if !(0.0..=1.0).contains(&c.max_error_rate) {
                    return Err(invalid(
                        "store.redis.scripts.canary.max_error_rate",
                        format!("{} is out of range (0..=1)", c.max_error_rate),
                    ));
                }
                let mut tenants = c.tenants;
                tenants.sort();
                tenants.dedup();
                Some(CanaryConfig {
                    version: c.version,
                    percent: int_in_range("store.redis.scripts.canary.percent", c.percent, 0, 100)?,
                    tenants,
                    max_error_rate: c.max_error_rate,
                    min_calls: int_in_range(
                        "store.redis.scripts.canary.min_calls",
                        c.min_calls,
                        1,
                        1_000_000,
                    )?,
                    window: positive_duration(
                        "store.redis.scripts.canary.window".into(),
                        &c.window,
                    )?,
                })
            }
        };
        Ok(ScriptsConfig {
            dir,
            version: self.version,
            canary,
        })
    }
}

/// Checks one store URL; `Ok(true)` for a Sentinel URL. Messages never echo the URL, which may
/// carry a password.
fn check_redis_url(url: &str) -> Result<bool, String> {
    // A URL carries no raw space, quote or control character; a password that has one is
    // written percent-encoded. Taken raw (the URL parser would encode it), it would also end
    // the URL early for the redaction of logs and /admin/config, which would show the rest of
    // the password. Nothing of the URL is echoed.
    if url
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '\\'))
    {
        return Err(
            "the URL holds a space, quote, backslash or control character: percent-encode it \
             (a password with a space: %20, a quote: %22 or %27, a backslash: %5C)"
                .to_owned(),
        );
    }
    let rest = REDIS_SCHEMES
        .iter()
        .find_map(|scheme| url.strip_prefix(scheme));
    match rest {
        Some(rest) if !rest.is_empty() && !rest.starts_with('/') => {}
        Some(_) => return Err("the URL has no host".into()),
        None => {
            // Only the scheme is echoed: the rest may carry a password.
            let scheme = url.split_once("://").map_or("", |(s, _)| s);
            return Err(format!(
                "unsupported scheme {scheme:?} (use redis://, rediss://, redis+sentinel:// or \
                 rediss+sentinel://)"
            ));
        }
    }
    if is_sentinel_url(url) {
        parse_sentinel_url(url)?;
        return Ok(true);
    }
    // redis-rs reads `rediss://...#insecure` as "accept any certificate". Verification is
    // never turned off here; a private CA is trusted with store.redis.tls.ca_file.
    if url.contains('#') {
        return Err(
            "URL fragments are not supported (#insecure would turn off certificate \
             verification; trust a private CA with store.redis.tls.ca_file instead)"
                .to_owned(),
        );
    }
    redis::IntoConnectionInfo::into_connection_info(url).map_err(|_| {
        "not a valid Redis URL (use redis[s]://[user[:password]@]host[:port][/db])".to_owned()
    })?;
    Ok(false)
}

/// The value of [`REDIS_PASSWORD_ENV`]: `None` when empty (a manifest that declares the variable
/// with no value uses the URLs as written). One that ends in a line break is refused: a Secret
/// made from a file usually carries the file's last newline, and Redis would refuse it as a
/// wrong password only once idemgate runs, after `--check` passed.
fn redis_password(value: String) -> Result<Option<String>, ConfigError> {
    if value.ends_with(['\n', '\r']) {
        return Err(invalid(
            REDIS_PASSWORD_ENV,
            "ends in a line break (a Secret made from a file keeps the file's last newline; \
             create it with --from-literal, or strip the newline)",
        ));
    }
    Ok(Some(value).filter(|v| !v.is_empty()))
}

/// `url` (a checked store URL) with `password`, percent-encoded, as its password, replacing
/// any it has and keeping its user. On a `redis+sentinel://` URL it is the primary's, as a
/// password written there is.
fn with_password(url: &str, password: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user, _, hosts) = split_userinfo(authority);
    format!(
        "{scheme}://{user}:{}@{hosts}{tail}",
        percent_encode(password)
    )
}

/// Whether a `redis+sentinel://` URL names a database (`/<master>/<db>`), rather than take
/// the default.
fn sentinel_url_names_db(url: &str) -> bool {
    let rest = url.split_once("://").map_or("", |(_, rest)| rest);
    let path = rest.split_once('/').map_or("", |(_, path)| path);
    path.split('/').filter(|s| !s.is_empty()).count() >= 2
}

/// The seeds of a Redis Cluster: one user, password and protocol across them (the cluster
/// client refuses to start otherwise, which `--check` would not have caught), and database 0,
/// the only one a Cluster has (any other fails every connection with `SELECT is not allowed in
/// cluster mode`, so every keyed request would be refused). Errors never echo the URL.
fn check_cluster_seeds(urls: &[String], fields: &[String]) -> Result<(), ConfigError> {
    let mut first = None;
    for (url, field) in urls.iter().zip(fields) {
        let field = || field.clone();
        let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) else {
            // Checked already by check_redis_url; nothing more to compare.
            continue;
        };
        let redis = info.redis_settings();
        if redis.db() != 0 {
            return Err(invalid(
                field(),
                "a Redis Cluster has only database 0; drop the /<db> from the URL",
            ));
        }
        let settings = (
            redis.username().map(str::to_owned),
            redis.password().map(str::to_owned),
            format!("{:?}", redis.protocol()),
        );
        match &first {
            None => first = Some(settings),
            Some(seen) if *seen != settings => {
                return Err(invalid(
                    field(),
                    "every Redis Cluster seed URL must give the same user, password and \
                     protocol",
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A URL authority's user, password and hosts as written (still percent-encoded):
/// `user:pass@hosts`, `user@hosts`, `:pass@hosts` or `hosts` (user `""`, no password).
fn split_userinfo(authority: &str) -> (&str, Option<&str>, &str) {
    let Some(at) = authority.rfind('@') else {
        return ("", None, authority);
    };
    let hosts = &authority[at + 1..];
    match authority[..at].split_once(':') {
        Some((user, pass)) => (user, Some(pass), hosts),
        None => (&authority[..at], None, hosts),
    }
}

/// Parses a `redis+sentinel://` URL (see [`SentinelUrl`]). Errors never echo the URL.
pub fn parse_sentinel_url(url: &str) -> Result<SentinelUrl, String> {
    const SHAPE: &str =
        "use redis[s]+sentinel://[user[:password]@]host[:port][,host[:port]...]/<master>[/<db>]";
    let (rest, tls) = match url.strip_prefix(SENTINEL_TLS_SCHEME) {
        Some(rest) => (rest, true),
        None => (
            url.strip_prefix(SENTINEL_SCHEME)
                .ok_or_else(|| format!("not a Sentinel URL ({SHAPE})"))?,
            false,
        ),
    };
    if rest.contains(['?', '#']) {
        return Err(format!("query and fragment are not supported ({SHAPE})"));
    }
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (user, pass, hosts) = split_userinfo(authority);
    let decode = |part: &str| {
        percent_decode(part)
            .ok_or_else(|| format!("bad percent-encoding in the credentials ({SHAPE})"))
    };
    let username = (!user.is_empty()).then(|| decode(user)).transpose()?;
    let password = pass.filter(|p| !p.is_empty()).map(decode).transpose()?;
    let mut sentinels = Vec::new();
    for host in hosts.split(',') {
        sentinels
            .push(sentinel_host(host).ok_or_else(|| format!("bad Sentinel address ({SHAPE})"))?);
    }
    let mut segments = path.split('/').filter(|s| !s.is_empty());
    let master = segments
        .next()
        .ok_or_else(|| format!("the master name is missing ({SHAPE})"))?
        .to_owned();
    let db = match segments.next() {
        None => 0,
        Some(db) => db
            .parse::<i64>()
            .ok()
            .filter(|db| *db >= 0)
            .ok_or_else(|| format!("the database must be a number ({SHAPE})"))?,
    };
    if segments.next().is_some() {
        return Err(format!("too many path segments ({SHAPE})"));
    }
    Ok(SentinelUrl {
        sentinels,
        master,
        db,
        username,
        password,
        tls,
    })
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn sentinel_host(raw: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(bracketed) = raw.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']')?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':')?)),
        }
    } else {
        match raw.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (raw, None),
        }
    };
    if host.is_empty() || host.contains(['/', '@', ' ']) {
        return None;
    }
    let port = match port {
        None => DEFAULT_SENTINEL_PORT,
        Some(port) => port.parse::<u16>().ok().filter(|p| *p != 0)?,
    };
    Some((host.to_owned(), port))
}

/// Whether `byte` is URL-unreserved (RFC 3986 §2.3: `A-Z a-z 0-9 - . _ ~`), the same escaped
/// or not.
fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

/// `text` with every byte but the URL-unreserved ones written `%xx`: what [`percent_decode`]
/// reads back.
fn percent_encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if is_unreserved(byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push('%');
            encoded.extend(crate::key::hex_pair(byte).map(char::from));
        }
    }
    encoded
}

/// Decodes `%XX` escapes; `None` for a malformed escape or a result that is not UTF-8.
pub fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = raw.get(i + 1..i + 3)?;
            // from_str_radix alone would also take a sign: `%+1` is not an escape.
            if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl FileRoute {
    fn into_config(self, base: &str, upstreams: &[UpstreamConfig]) -> Result<Route, ConfigError> {
        if self.name.trim().is_empty() {
            return Err(invalid(format!("{base}.name"), "must not be empty"));
        }
        // `orders` and `orders ` would be two routes that look the same in every metric and log.
        if self.name.trim() != self.name {
            return Err(invalid(
                format!("{base}.name"),
                "must not start or end with white space",
            ));
        }
        // The metrics' `route` label for requests no route matched.
        if self.name == "-" {
            return Err(invalid(
                format!("{base}.name"),
                "\"-\" is the route label of requests no route matched; pick another name",
            ));
        }

        let mut methods: Vec<Method> = Vec::with_capacity(self.methods.len());
        for (j, raw) in self.methods.iter().enumerate() {
            let method = Method::from_bytes(raw.to_ascii_uppercase().as_bytes()).map_err(|_| {
                invalid(
                    format!("{base}.methods[{j}]"),
                    format!("invalid HTTP method {raw:?}"),
                )
            })?;
            if !methods.contains(&method) {
                methods.push(method);
            }
        }

        if !self.path_prefix.starts_with('/') {
            return Err(invalid(
                format!("{base}.path_prefix"),
                format!("{:?} must start with \"/\"", self.path_prefix),
            ));
        }
        // The prefix is compared with the request path alone, so these could never match.
        if self
            .path_prefix
            .chars()
            .any(|c| c == '?' || c == '#' || c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                format!("{base}.path_prefix"),
                format!(
                    "{:?} must be a plain path (no query, fragment or whitespace)",
                    self.path_prefix
                ),
            ));
        }
        // Request paths are matched in their route_path form, so a prefix in any other
        // spelling could never match: say which spelling it should be.
        let normal = route_path(&self.path_prefix);
        if normal != self.path_prefix {
            return Err(invalid(
                format!("{base}.path_prefix"),
                format!(
                    "{:?} is not in the form request paths are matched in (no `//`, `.` or `..` \
                     segments, `;params` or escaped unreserved characters): write {normal:?}",
                    self.path_prefix
                ),
            ));
        }

        let upstream = upstream_index(upstreams, &self.upstream).ok_or_else(|| {
            invalid(
                format!("{base}.upstream"),
                unknown_upstream(&self.upstream, upstreams),
            )
        })?;

        let idempotency = match self.idempotency {
            Some(file) => {
                Some(file.into_config(&format!("{base}.idempotency"), upstreams.get(upstream))?)
            }
            None => None,
        };

        Ok(Route {
            name: self.name,
            methods,
            path_prefix: self.path_prefix,
            upstream,
            idempotency,
        })
    }
}

impl FileRouteIdempotency {
    fn into_config(
        self,
        base: &str,
        upstream: Option<&UpstreamConfig>,
    ) -> Result<RouteIdempotency, ConfigError> {
        let ttl = positive_duration(format!("{base}.ttl"), &self.ttl)?;
        let lock_ttl = positive_duration(format!("{base}.lock_ttl"), &self.lock_ttl)?;
        if lock_ttl > ttl {
            return Err(invalid(
                format!("{base}.lock_ttl"),
                format!(
                    "{} is longer than ttl ({}); a claim must not outlive its record",
                    fmt_duration(lock_ttl),
                    fmt_duration(ttl)
                ),
            ));
        }
        if let Some(upstream) = upstream {
            // Connecting, writing the whole request, then waiting for the answer: the claim
            // must outlast all three, or a retry re-claims while the backend still works.
            let execution = upstream.exchange_bound();
            if lock_ttl <= execution {
                return Err(invalid(
                    format!("{base}.lock_ttl"),
                    format!(
                        "{} must be longer than upstream {:?} connect_timeout + write_timeout + read_timeout ({}); \
                         otherwise a slow execution loses its lock and a retry could execute again",
                        fmt_duration(lock_ttl),
                        upstream.name,
                        fmt_duration(execution)
                    ),
                ));
            }
        }
        let wait_timeout = positive_duration(format!("{base}.wait_timeout"), &self.wait_timeout)?;

        let fingerprint_headers = header_list(
            &format!("{base}.fingerprint.headers"),
            &self.fingerprint.headers,
        )?;
        let scope_headers = names_list(
            &format!("{base}.scope_headers"),
            &self.scope_headers,
            record_header,
        )?;
        if self.scope_required && scope_headers.is_empty() {
            return Err(invalid(
                format!("{base}.scope_required"),
                "true needs a header to require: scope_headers is empty",
            ));
        }
        let replay_exclude_headers = header_list(
            &format!("{base}.replay_exclude_headers"),
            &self.replay_exclude_headers,
        )?;
        let cache_statuses =
            StatusSet::from_entries(&format!("{base}.cache_statuses"), &self.cache_statuses)?;

        let max_request_bytes = byte_size_in_range(
            format!("{base}.max_request_bytes"),
            &self.max_request_bytes,
            1,
            MAX_BODY_BYTES,
        )?;
        let max_response_bytes = byte_size_in_range(
            format!("{base}.max_response_bytes"),
            &self.max_response_bytes,
            1,
            MAX_BODY_BYTES,
        )?;

        Ok(RouteIdempotency {
            key: self.key,
            min_key_length: int_in_range(
                &format!("{base}.min_key_length"),
                self.min_key_length,
                1,
                crate::key::MAX_KEY_LEN as i64,
            )?,
            ttl,
            lock_ttl,
            on_in_flight: self.on_in_flight,
            wait_timeout,
            on_outcome_unknown: self.on_outcome_unknown,
            fingerprint_body: self.fingerprint.body,
            fingerprint_headers,
            scope_headers,
            scope_required: self.scope_required,
            cache_statuses,
            replay_exclude_headers,
            max_request_bytes,
            max_response_bytes,
        })
    }
}

// === Field validators ===

/// The `Link` header value for `idempotency.docs_url`: an absolute `http`/`https` URL, which
/// fits between `<` and `>` as written (no spaces, quotes, angle brackets or controls).
fn docs_link(url: &str) -> Result<http::HeaderValue, ConfigError> {
    let field = "idempotency.docs_url";
    let uri: http::Uri = url
        .parse()
        .map_err(|_| invalid(field, format!("{url:?} is not a URL")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(invalid(
            field,
            format!("{url:?} is not an absolute http:// or https:// URL"),
        ));
    }
    if url
        .bytes()
        .any(|b| matches!(b, b'<' | b'>' | b'"' | b'\\') || !b.is_ascii_graphic())
    {
        return Err(invalid(
            field,
            format!("{url:?} holds a character a Link header cannot carry; percent-encode it"),
        ));
    }
    http::HeaderValue::from_str(&format!("<{url}>; rel=\"describedby\""))
        .map_err(|_| invalid(field, format!("{url:?} cannot be sent in a header")))
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        // A message may repeat the value it refuses, and a Redis URL pasted into the wrong key
        // (`listen`, an upstream address) would otherwise put its password in the log.
        message: redact_url(&message.into()),
    }
}

fn socket_addr(field: &str, raw: &str) -> Result<SocketAddr, ConfigError> {
    raw.parse().map_err(|_| {
        invalid(
            field,
            format!("invalid socket address {raw:?} (use e.g. 0.0.0.0:6180 or [::]:6180)"),
        )
    })
}

/// Whether binding both addresses would collide (port 0 picks a free port, so never).
fn listeners_overlap(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

fn int_in_range<T: TryFrom<i64>>(
    field: &str,
    value: i64,
    min: i64,
    max: i64,
) -> Result<T, ConfigError> {
    if !(min..=max).contains(&value) {
        return Err(invalid(
            field,
            format!("{value} is out of range ({min}..={max})"),
        ));
    }
    T::try_from(value).map_err(|_| invalid(field, format!("{value} is out of range")))
}

/// Checks that an upstream address resolves, and that none of what it resolves to is port 0
/// or one of idemgate's own listeners (`ours`): forwarding there loops requests back into the
/// proxy, or hands the admin API to whoever may send through it.
fn resolves(
    field: String,
    addr: &str,
    lookup: Lookup,
    ours: &[(&str, SocketAddr)],
) -> Result<(), ConfigError> {
    let resolved: Vec<SocketAddr> = if lookup == Lookup::Offline {
        offline_address(addr).map_err(|message| invalid(field.clone(), message))?;
        if addr.rsplit_once(':').is_some_and(|(_, port)| port == "0") {
            return Err(invalid(field, "port 0 is no address to connect to"));
        }
        addr.parse().into_iter().collect()
    } else {
        match addr.to_socket_addrs() {
            Ok(resolved) => resolved.collect(),
            Err(e) => {
                return Err(invalid(
                    field,
                    format!("cannot resolve {addr:?} as host:port: {e}"),
                ))
            }
        }
    };
    if lookup == Lookup::System && resolved.is_empty() {
        return Err(invalid(field, format!("{addr:?} resolves to no address")));
    }
    for to in resolved {
        if to.port() == 0 {
            return Err(invalid(field, "port 0 is no address to connect to"));
        }
        if let Some((key, listener)) = ours.iter().find(|(_, l)| reaches_listener(to, *l)) {
            return Err(invalid(
                field,
                format!("{to} is idemgate's own {key} ({listener}): requests would loop back"),
            ));
        }
    }
    Ok(())
}

/// The first of `listeners` (named) that connecting to one of `addrs` would reach, with that
/// address: for a reload, whose upstreams are resolved already, against the listeners it
/// keeps running.
pub fn reaches_any<'a>(
    addrs: &[SocketAddr],
    listeners: &[(&'a str, SocketAddr)],
) -> Option<(SocketAddr, &'a str, SocketAddr)> {
    addrs.iter().find_map(|&to| {
        listeners
            .iter()
            .find(|(_, l)| reaches_listener(to, *l))
            .map(|&(name, l)| (to, name, l))
    })
}

/// Whether connecting to `to` reaches this host's listener `listener`: the same address, or a
/// loopback or wildcard one (which connects to this host) on a listener that takes it — a
/// wildcard listener takes its own family's (an IPv6 one both, as Linux binds it by default),
/// a loopback listener its family's wildcard.
fn reaches_listener(to: SocketAddr, listener: SocketAddr) -> bool {
    if to.port() != listener.port() {
        return false;
    }
    if to.ip() == listener.ip() {
        return true;
    }
    let this_host = to.ip().is_loopback() || to.ip().is_unspecified();
    if listener.ip().is_unspecified() {
        this_host && (listener.is_ipv6() || to.is_ipv4())
    } else if listener.ip().is_loopback() {
        to.ip().is_unspecified() && to.is_ipv4() == listener.is_ipv4()
    } else {
        false
    }
}

/// How upstream addresses are checked while a config is validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The system resolver: an address that does not resolve makes the config invalid.
    System,
    /// The `host:port` shape only, without asking any name service: for fuzzing, where a lookup
    /// per input would be slow and would send a query off the machine for every random name.
    Offline,
}

/// The checks `to_socket_addrs` makes before its lookup: a socket address, or `host:port` with a
/// port that fits in 16 bits.
fn offline_address(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    match addr.rsplit_once(':') {
        Some((_, port)) if port.parse::<u16>().is_ok() => Ok(()),
        Some(_) => Err(format!("invalid port in {addr:?}")),
        None => Err(format!("{addr:?} is not host:port")),
    }
}

fn duration(field: String, raw: &Scalar) -> Result<Duration, ConfigError> {
    parse_duration(raw).map_err(|message| invalid(field, message))
}

fn positive_duration(field: String, raw: &Scalar) -> Result<Duration, ConfigError> {
    let value = parse_duration(raw).map_err(|message| invalid(field.clone(), message))?;
    if value.is_zero() {
        return Err(invalid(field, "must be greater than zero"));
    }
    Ok(value)
}

/// A duration the server takes in whole seconds (pingora's `ServerConf`), so that a value it
/// would truncate (`500ms` to nothing, `1500ms` to `1s`) is refused rather than shortened.
fn whole_seconds(field: &str, raw: &Scalar, zero_allowed: bool) -> Result<Duration, ConfigError> {
    let value = duration(field.into(), raw)?;
    if value.subsec_nanos() != 0 {
        let floor = Duration::from_secs(value.as_secs());
        return Err(invalid(
            field,
            format!(
                "{raw} is not a whole number of seconds: the server counts this budget in \
                 seconds and would cut it to {} (use e.g. {}s)",
                fmt_duration(floor),
                value.as_secs() + 1
            ),
        ));
    }
    if value.is_zero() && !zero_allowed {
        return Err(invalid(field, "must be at least 1s"));
    }
    Ok(value)
}

fn byte_size(field: String, raw: &Scalar) -> Result<u64, ConfigError> {
    parse_byte_size(raw).map_err(|message| invalid(field, message))
}

/// A byte size (`64KiB`, `1048576`) within `min..=max`.
fn byte_size_in_range(
    field: String,
    raw: &Scalar,
    min: u64,
    max: u64,
) -> Result<usize, ConfigError> {
    let bytes = byte_size(field.clone(), raw)?;
    bytes_in_range(field, bytes, min, max)
}

fn bytes_in_range(field: String, value: u64, min: u64, max: u64) -> Result<usize, ConfigError> {
    if value < min || value > max {
        return Err(invalid(
            field,
            format!("{value} bytes is out of range ({min}..={max})"),
        ));
    }
    usize::try_from(value).map_err(|_| invalid(field, format!("{value} bytes is too large")))
}

fn header_name(field: String, raw: &str) -> Result<HeaderName, ConfigError> {
    // `from_bytes` lower-cases, which is how the proxy compares names.
    HeaderName::from_bytes(raw.as_bytes())
        .map_err(|_| invalid(field, format!("invalid header name {raw:?}")))
}

/// A header that names a request's record (the key, tenant or a scope header): one the request
/// carries for itself, not one HTTP or idemgate gives a meaning of its own (its framing, its
/// connection, `Host`, the execution id idemgate writes). `key_header: Content-Length` would
/// make every body's length its key.
fn record_header(field: String, raw: &str) -> Result<HeaderName, ConfigError> {
    let name = header_name(field.clone(), raw)?;
    if name == http::header::HOST || crate::upstream::is_reserved(name.as_str().as_bytes()) {
        return Err(invalid(
            field,
            format!(
                "{name} is a header of HTTP's or idemgate's own (framing, connection, Host, the \
                 execution id): name one the client sends for this"
            ),
        ));
    }
    Ok(name)
}

/// Header lists are sorted and deduplicated: scope and fingerprint headers feed hashes, and
/// reordering the list in an edit must not turn every stored key into a new one.
fn header_list(field: &str, raw: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    names_list(field, raw, header_name)
}

/// [`header_list`] with each name read by `name` (e.g. [`record_header`]).
fn names_list(
    field: &str,
    raw: &[String],
    name: fn(String, &str) -> Result<HeaderName, ConfigError>,
) -> Result<Vec<HeaderName>, ConfigError> {
    let mut names = raw
        .iter()
        .enumerate()
        .map(|(j, raw)| name(format!("{field}[{j}]"), raw))
        .collect::<Result<Vec<_>, _>>()?;
    names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    names.dedup();
    Ok(names)
}

fn upstream_index(upstreams: &[UpstreamConfig], name: &str) -> Option<usize> {
    upstreams
        .binary_search_by(|u| u.name.as_str().cmp(name))
        .ok()
}

fn unknown_upstream(name: &str, upstreams: &[UpstreamConfig]) -> String {
    let known: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
    format!("unknown upstream {name:?} (defined: {})", known.join(", "))
}

/// The tenant rule from the spec: 1-128 characters of `[A-Za-z0-9._:-]`.
fn is_valid_tenant(tenant: &str) -> bool {
    (1..=128).contains(&tenant.len())
        && tenant
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

// === Scalar syntaxes ===

/// Parses `250ms`, `30s`, `5m`, `24h`, `7d` and compounds such as `1h30m`. A bare number is
/// refused rather than guessed at: `ttl: 30` could mean seconds or milliseconds.
fn parse_duration(raw: &Scalar) -> Result<Duration, String> {
    let unit_required = || format!("invalid duration {raw}: a unit is required ({DURATION_HINT})");
    let text = match raw {
        Scalar::Text(s) => s.trim(),
        Scalar::Int(_) | Scalar::Float(_) => return Err(unit_required()),
    };
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(unit_required());
    }
    let value = parse_duration_text(text)
        .ok_or_else(|| format!("invalid duration {raw} ({DURATION_HINT})"))?;
    if value > MAX_DURATION {
        return Err(format!(
            "invalid duration {raw}: at most {}",
            fmt_duration(MAX_DURATION)
        ));
    }
    Ok(value)
}

/// [`positive_duration`] of `field`, refused past `max` with `why`.
fn bounded_duration(
    field: &str,
    raw: &Scalar,
    max: Duration,
    why: &str,
) -> Result<Duration, ConfigError> {
    let value = positive_duration(field.to_owned(), raw)?;
    if value > max {
        return Err(invalid(
            field.to_owned(),
            format!("must be at most {} ({why})", fmt_duration(max)),
        ));
    }
    Ok(value)
}

fn parse_duration_text(text: &str) -> Option<Duration> {
    if text.is_empty() {
        return None;
    }
    let mut rest = text;
    let mut total_ms: u64 = 0;
    while !rest.is_empty() {
        // Both runs are ASCII, so the byte counts are char boundaries.
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let value: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let letters = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit_ms: u64 = match &rest[..letters] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return None,
        };
        rest = &rest[letters..];
        total_ms = total_ms.checked_add(value.checked_mul(unit_ms)?)?;
    }
    Some(Duration::from_millis(total_ms))
}

/// Formats a duration in the config's own syntax, for error messages.
fn fmt_duration(d: Duration) -> String {
    const UNITS: [(&str, u128); 5] = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ];
    let mut ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    for (unit, size) in UNITS {
        if ms >= size {
            out.push_str(&format!("{}{unit}", ms / size));
            ms %= size;
        }
    }
    out
}

/// Formats a byte count for an error message: `512.0 MiB`, `3.4 GiB`.
fn fmt_approx_bytes(bytes: f64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= GIB {
        format!("{:.1} GiB", bytes / GIB)
    } else {
        format!("{:.1} MiB", bytes / MIB)
    }
}

/// Parses an integer byte count or a string such as `512KiB`, `256 MiB`, `1GB`.
fn parse_byte_size(raw: &Scalar) -> Result<u64, String> {
    let bad = || format!("invalid byte size {raw} ({BYTES_HINT})");
    let text = match raw {
        Scalar::Int(n) => return u64::try_from(*n).map_err(|_| bad()),
        Scalar::Float(_) => return Err(bad()),
        Scalar::Text(s) => s.trim(),
    };
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad());
    }
    let value: u64 = text[..digits].parse().map_err(|_| bad())?;
    let unit: u64 = match text[digits..].trim_start() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TB" => 1_000_000_000_000,
        "TiB" => 1 << 40,
        _ => return Err(bad()),
    };
    value.checked_mul(unit).ok_or_else(bad)
}

// === impl StatusSet ===

/// One bit per status code 0..640.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct StatusBits([u64; 10]);

impl StatusBits {
    fn get(&self, status: u16) -> bool {
        self.0
            .get(usize::from(status / 64))
            .is_some_and(|word| word & (1 << (status % 64)) != 0)
    }

    fn set(&mut self, status: u16) {
        if let Some(word) = self.0.get_mut(usize::from(status / 64)) {
            *word |= 1 << (status % 64);
        }
    }
}

enum StatusEntry {
    Class(u16),
    Exact(u16),
    Exclude(u16),
}

impl StatusSet {
    /// Whether a response with this status is stored for replay.
    pub fn contains(&self, status: u16) -> bool {
        if self.exact.get(status) {
            return true;
        }
        if self.excluded.get(status) {
            return false;
        }
        // Timeouts and rate limits say "try again", so a class alone never makes them final.
        if status == 408 || status == 429 {
            return false;
        }
        let class = status / 100;
        (2..=5).contains(&class) && self.classes & (1 << class) != 0
    }

    /// Whether no status at all is stored (an empty list, or exclusions only).
    pub fn is_empty(&self) -> bool {
        (200..600).all(|status| !self.contains(status))
    }

    fn from_entries(field: &str, entries: &[Scalar]) -> Result<StatusSet, ConfigError> {
        let mut set = StatusSet {
            classes: 0,
            exact: StatusBits::default(),
            excluded: StatusBits::default(),
        };
        for (j, raw) in entries.iter().enumerate() {
            let entry_field = || format!("{field}[{j}]");
            let (code, listed, other) =
                match parse_status_entry(raw).map_err(|message| invalid(entry_field(), message))? {
                    StatusEntry::Class(class) => {
                        set.classes |= 1 << class;
                        continue;
                    }
                    StatusEntry::Exact(code) => (code, &mut set.exact, &set.excluded),
                    StatusEntry::Exclude(code) => (code, &mut set.excluded, &set.exact),
                };
            if other.get(code) {
                return Err(invalid(
                    entry_field(),
                    format!("{code} is both listed and excluded"),
                ));
            }
            listed.set(code);
        }
        Ok(set)
    }
}

fn parse_status_entry(raw: &Scalar) -> Result<StatusEntry, String> {
    let bad = || format!("invalid status {raw} ({STATUS_HINT})");
    let text = match raw {
        Scalar::Int(n) => return status_code(*n).map(StatusEntry::Exact),
        Scalar::Float(_) => return Err(bad()),
        Scalar::Text(s) => s.trim(),
    };
    let code_of = |digits: &str| -> Result<u16, String> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let n: i128 = digits.parse().map_err(|_| bad())?;
        status_code(n)
    };
    if let Some(code) = text.strip_prefix('!') {
        return code_of(code.trim_start()).map(StatusEntry::Exclude);
    }
    let bytes = text.as_bytes();
    if bytes.len() == 3 && bytes[1..].eq_ignore_ascii_case(b"xx") {
        return match bytes[0] {
            b'1' => Err(informational()),
            b @ b'2'..=b'5' => Ok(StatusEntry::Class(u16::from(b - b'0'))),
            _ => Err(bad()),
        };
    }
    code_of(text).map(StatusEntry::Exact)
}

fn status_code(n: i128) -> Result<u16, String> {
    if !(100..=599).contains(&n) {
        return Err(format!("{n} is not an HTTP status code (100-599)"));
    }
    if n < 200 {
        return Err(informational());
    }
    u16::try_from(n).map_err(|_| format!("{n} is not an HTTP status code (100-599)"))
}

fn informational() -> String {
    "1xx responses are informational and never final, so they cannot be cached".to_owned()
}

impl Default for StatusSet {
    /// `["2xx", "4xx"]`, the file default.
    fn default() -> Self {
        StatusSet {
            classes: (1 << 2) | (1 << 4),
            exact: StatusBits::default(),
            excluded: StatusBits::default(),
        }
    }
}

impl fmt::Debug for StatusSet {
    /// Lists the entries in file syntax, e.g. `StatusSet["2xx", "4xx", "201", "!404"]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let classes = (2..=5u16)
            .filter(|class| self.classes & (1 << class) != 0)
            .map(|class| format!("{class}xx"));
        let exact = (100..=599u16)
            .filter(|&code| self.exact.get(code))
            .map(|code| code.to_string());
        let excluded = (100..=599u16)
            .filter(|&code| self.excluded.get(code))
            .map(|code| format!("!{code}"));
        f.write_str("StatusSet")?;
        f.debug_list()
            .entries(classes.chain(exact).chain(excluded))
            .finish()
    }
}

// === impl RedisConfig ===

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|url| redact_url(url)).collect();
        f.debug_struct("RedisConfig")
            .field("urls", &urls)
            .field("topology", &self.topology)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("key_prefix", &self.key_prefix)
            .field("scripts", &self.scripts)
            .field("tls", &self.tls)
            .finish()
    }
}

impl fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelUrl")
            .field("sentinels", &self.sentinels)
            .field("master", &self.master)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("tls", &self.tls)
            .finish()
    }
}

/// Replaces the `user:pass@` part of every URL in `text` (a URL alone, or a message that
/// repeats one) with `***@`, for logs and views. A URL's authority ends at the first `/`, quote
/// or space: a password with a raw `?` or `#` in it is hidden too.
pub fn redact_url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| matches!(c, '/' | '"' | '\'') || c.is_whitespace())
            .unwrap_or(after.len());
        match after[..authority_end].rfind('@') {
            Some(user_end) => {
                out.push_str("***");
                rest = &after[user_end..];
            }
            None => rest = after,
        }
    }
    out.push_str(rest);
    out
}

// === impl ConfigError ===

impl ConfigError {
    /// The path of the offending field, when the error is about one value.
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { field, .. } => Some(field),
            ConfigError::Io { .. } | ConfigError::Parse(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REFERENCE: &str = include_str!("../config/idemgate.yaml");

    const MINIMAL: &str = r#"
upstreams:
  orders:
    addrs: ["127.0.0.1:8080"]
routes:
  - name: orders
    path_prefix: /
    upstream: orders
    idempotency: {}
"#;

    fn load(text: &str) -> Config {
        match Config::from_yaml_str(text) {
            Ok(config) => config,
            Err(e) => panic!("config should load: {e}"),
        }
    }

    fn load_err(text: &str) -> ConfigError {
        match Config::from_yaml_str(text) {
            Ok(config) => panic!("config should be rejected: {config:?}"),
            Err(e) => e,
        }
    }

    /// The minimal config with `extra` appended under the route's idempotency block.
    fn with_route_idempotency(extra: &str) -> String {
        format!(
            "upstreams:\n  orders:\n    addrs: [\"127.0.0.1:8080\"]\nroutes:\n  - name: orders\n    path_prefix: /\n    upstream: orders\n    idempotency:\n{}",
            indent(extra, 6)
        )
    }

    fn indent(text: &str, by: usize) -> String {
        text.lines()
            .map(|line| format!("{}{line}\n", " ".repeat(by)))
            .collect()
    }

    /// Asserts the error is `Invalid` for `field` and returns its full message.
    fn assert_field(text: &str, field: &str) -> String {
        let err = load_err(text);
        assert_eq!(err.field(), Some(field), "wrong field in: {err}");
        err.to_string()
    }

    fn text(s: &str) -> Scalar {
        Scalar::text(s)
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn header(name: &'static str) -> HeaderName {
        HeaderName::from_static(name)
    }

    // === whole configs ===

    #[test]
    fn reference_config_loads() {
        let config = load(REFERENCE);
        assert_eq!(config.listen, "0.0.0.0:6180".parse().unwrap());
        assert_eq!(config.upstreams.len(), 2);
        assert_eq!(config.upstreams[0].name, "orders");
        assert_eq!(config.upstreams[1].name, "payments");
        assert_eq!(config.default_upstream, Some(0));
        assert_eq!(config.routes.len(), 3);
        assert_eq!(config.routes[0].upstream, 1);
        let payments = config.routes[0].idempotency.as_ref().unwrap();
        assert_eq!(payments.on_in_flight, OnInFlight::Wait);
        assert!(!payments.cache_statuses.contains(404));
        assert!(payments.cache_statuses.contains(409));
        assert!(config.routes[1].idempotency.is_none());
        assert_eq!(
            config.store.redis.as_ref().map(|r| r.key_prefix.as_str()),
            Some("idemgate")
        );
        // The explicit values written in the reference are the defaults.
        let orders = config.routes[2].idempotency.as_ref().unwrap();
        let minimal = load(MINIMAL);
        assert_eq!(orders, minimal.routes[0].idempotency.as_ref().unwrap());
        assert_eq!(config.idempotency, minimal.idempotency);
        assert_eq!(config.shutdown, minimal.shutdown);
        assert_eq!(config.admin, minimal.admin);
        assert_eq!(config.store.memory, minimal.store.memory);
        let redis_defaults = load(&format!("store: {{backend: redis}}\n{MINIMAL}"));
        assert_eq!(config.store.redis, redis_defaults.store.redis);
        assert_eq!(config.upstreams[0], minimal.upstreams[0]);
        assert_eq!(
            (
                config.threads,
                config.request_header_timeout,
                config.request_body_timeout,
                config.response_send_timeout
            ),
            (
                minimal.threads,
                minimal.request_header_timeout,
                minimal.request_body_timeout,
                minimal.response_send_timeout
            )
        );
    }

    #[test]
    fn reference_config_canary_example_loads_with_the_documented_defaults() {
        let start = REFERENCE.find("      # canary:").expect("canary example");
        let end = start + REFERENCE[start..].find("window: 60s\n").unwrap() + 12;
        let uncommented: String = REFERENCE[start..end]
            .lines()
            .map(|line| format!("      {}\n", line.strip_prefix("      # ").unwrap()))
            .collect();
        let config = load(&REFERENCE.replace(&REFERENCE[start..end], &uncommented));
        let canary = config.store.redis.unwrap().scripts.canary.expect("canary");
        let minimal = load(&format!(
            "store: {{redis: {{scripts: {{canary: {{version: v2, percent: 10}}}}}}}}\n{MINIMAL}"
        ));
        assert_eq!(Some(canary), minimal.store.redis.unwrap().scripts.canary);
    }

    #[test]
    fn reference_config_tls_example_loads() {
        let start = REFERENCE.find("    # tls:\n").expect("tls example");
        let end = start + REFERENCE[start..].find("client.key\n").unwrap() + 11;
        let uncommented: String = REFERENCE[start..end]
            .lines()
            .map(|line| format!("    {}\n", line.strip_prefix("    # ").unwrap()))
            .collect::<String>()
            .replace("/etc/idemgate/redis/ca.pem", FIXTURE_CERT)
            .replace("/etc/idemgate/redis/client.pem", FIXTURE_CERT)
            .replace("/etc/idemgate/redis/client.key", FIXTURE_KEY);
        let text = REFERENCE
            .replace(&REFERENCE[start..end], &uncommented)
            .replace(
                "url: redis://127.0.0.1:6379",
                "url: rediss://127.0.0.1:6379",
            );
        let tls = load(&text).store.redis.unwrap().tls.expect("tls");
        assert_eq!(tls.ca_file, Some(PathBuf::from(FIXTURE_CERT)));
        assert_eq!(tls.key_file, Some(PathBuf::from(FIXTURE_KEY)));
        // With its plain-text URL the reference would send TLS settings nowhere: refused.
        let plain = REFERENCE.replace(&REFERENCE[start..end], &uncommented);
        assert_eq!(load_err(&plain).field(), Some("store.redis.tls"));
    }

    #[test]
    fn reference_config_routes() {
        let config = load(REFERENCE);
        assert_eq!(
            config.match_route(&Method::POST, "/payments/1"),
            RouteMatch::Idempotent(0)
        );
        assert_eq!(
            config.match_route(&Method::POST, "/orders/search"),
            RouteMatch::Forward {
                route: Some(1),
                upstream: 0
            }
        );
        assert_eq!(
            config.match_route(&Method::POST, "/orders"),
            RouteMatch::Idempotent(2)
        );
        assert_eq!(
            config.match_route(&Method::GET, "/orders/1"),
            RouteMatch::Forward {
                route: Some(2),
                upstream: 0
            }
        );
    }

    #[test]
    fn minimal_config_gets_every_default() {
        let config = load(MINIMAL);
        assert_eq!(config.listen, "0.0.0.0:6180".parse().unwrap());
        assert_eq!(config.threads, 2);
        assert_eq!(config.request_header_timeout, secs(10));
        assert_eq!(config.max_request_header_bytes, 64 << 10);
        assert_eq!(config.request_body_timeout, secs(10));
        assert_eq!(config.request_body_total_timeout, secs(60));
        assert_eq!(config.max_buffered_request_bytes, 64 << 20);
        assert_eq!(config.response_send_timeout, secs(60));
        assert_eq!(
            config.shutdown,
            ShutdownConfig {
                grace_period: secs(20),
                graceful_shutdown_timeout: secs(5),
            }
        );
        assert_eq!(config.admin.listen, "127.0.0.1:6181".parse().unwrap());
        assert_eq!(
            config.upstreams,
            vec![UpstreamConfig {
                name: "orders".into(),
                addrs: vec!["127.0.0.1:8080".into()],
                connect_timeout: secs(2),
                read_timeout: secs(10),
                write_timeout: secs(5),
                idle_timeout: secs(60),
                max_in_flight: None,
            }]
        );
        assert_eq!(config.default_upstream, Some(0));
        assert_eq!(
            config.idempotency,
            GlobalIdempotency {
                key_header: header("idempotency-key"),
                tenant_header: header("x-tenant-id"),
                default_tenant: "default".into(),
                worker_id: None,
                worker_lease: secs(30),
                docs_link: None,
            }
        );
        assert_eq!(
            config.store,
            StoreConfig {
                backend: StoreBackend::Memory,
                memory: MemoryStoreConfig {
                    capacity_bytes: 256 << 20,
                    shards: 64,
                },
                redis: None,
                on_unavailable: OnUnavailable::Reject,
                local_cache: LocalCacheConfig {
                    enabled: true,
                    capacity_bytes: 64 << 20,
                    expected_items: 1_000_000,
                    false_positive_rate: 0.01,
                },
                circuit_breaker: BreakerConfig {
                    failure_threshold: 3,
                    open_for: Duration::from_secs(1),
                },
                completion_retry: RetryConfig {
                    attempts: 8,
                    base_delay: Duration::from_millis(50),
                    max_delay: Duration::from_secs(5),
                    queue_capacity: 10_000,
                    queue_bytes: 256 << 20,
                    dead_letter_path: "idemgate-dead-letter.jsonl".into(),
                },
            }
        );
        assert_eq!(
            config.routes,
            vec![Route {
                name: "orders".into(),
                methods: vec![],
                path_prefix: "/".into(),
                upstream: 0,
                idempotency: Some(RouteIdempotency {
                    key: KeyMode::Required,
                    min_key_length: 1,
                    ttl: secs(24 * 3600),
                    lock_ttl: secs(30),
                    on_in_flight: OnInFlight::Reject,
                    wait_timeout: secs(5),
                    on_outcome_unknown: OnOutcomeUnknown::Lapse,
                    fingerprint_body: true,
                    fingerprint_headers: vec![],
                    scope_headers: vec![header("authorization")],
                    scope_required: false,
                    cache_statuses: StatusSet::default(),
                    replay_exclude_headers: vec![header("set-cookie")],
                    max_request_bytes: 1 << 20,
                    max_response_bytes: 1 << 20,
                }),
            }]
        );
        assert_eq!(
            config.source_hash,
            hex::encode(Sha256::digest(MINIMAL.as_bytes()))
        );
        assert_eq!(config.source_hash.len(), 64);
    }

    #[test]
    fn route_without_idempotency_block_is_plain() {
        let config = load(
            "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes: [{name: r, path_prefix: /, upstream: a}]\n",
        );
        assert_eq!(config.routes[0].idempotency, None);
    }

    #[test]
    fn empty_idempotency_block_enables_defaults() {
        // `idempotency:` with nothing under it is YAML null; it must not disable protection.
        let config = load(&with_route_idempotency(""));
        assert_eq!(
            config.routes[0].idempotency,
            load(MINIMAL).routes[0].idempotency
        );
    }

    #[test]
    fn a_list_left_empty_is_refused_not_read_as_none() {
        // Every entry commented out: YAML null, not `[]`.
        for (field, yaml) in [
            (
                "idempotency: scope_headers",
                "scope_headers:\n#  - Authorization\n",
            ),
            ("idempotency: cache_statuses", "cache_statuses:\n"),
            (
                "idempotency: replay_exclude_headers",
                "replay_exclude_headers:\n",
            ),
            (
                "idempotency.fingerprint: headers",
                "fingerprint:\n  headers:\n",
            ),
        ] {
            let e = load_err(&with_route_idempotency(yaml)).to_string();
            assert!(
                e.contains(&format!("routes[0].{field}: an empty value")) && e.contains("write []"),
                "{field}: {e}"
            );
        }
        let e = load_err(
            "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n  - name: r\n    methods:\n    path_prefix: /\n    upstream: a\n",
        )
        .to_string();
        assert!(e.contains("routes[0]: methods: an empty value"), "{e}");
        // Where `[]` narrows nothing, the message says so rather than "none".
        assert!(e.contains("write [] for every method"), "{e}");
        let e = load_err(&format!(
            "store:\n  redis:\n    scripts: {{canary: {{version: v2, percent: 5, tenants: }}}}\n{MINIMAL}"
        ))
        .to_string();
        assert!(
            e.contains("tenants: an empty value: write [] for every tenant"),
            "{e}"
        );
        let e = load_err("upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n").to_string();
        assert!(e.contains("routes: an empty value"), "{e}");
        // `[]` still says "none".
        let config = load(&with_route_idempotency("scope_headers: []\n"));
        let idem = config.routes[0].idempotency.as_ref().expect("idempotent");
        assert!(idem.scope_headers.is_empty());
    }

    #[test]
    fn an_idempotent_route_an_earlier_route_hides_is_refused() {
        let config = |routes: &str| {
            format!("upstreams: {{a: {{addrs: [\"127.0.0.1:1\"]}}}}\nroutes:\n{routes}")
        };
        for routes in [
            // A catch-all first.
            "  - {name: all, path_prefix: /, upstream: a}\n  - {name: orders, methods: [POST], path_prefix: /orders, upstream: a, idempotency: {}}\n",
            // The same prefix and method.
            "  - {name: one, methods: [POST], path_prefix: /orders, upstream: a}\n  - {name: two, methods: [POST, PUT], path_prefix: /orders, upstream: a, idempotency: {}}\n",
            // A wider prefix taking POST, an idempotent route for every method below it.
            "  - {name: posts, methods: [POST], path_prefix: /, upstream: a}\n  - {name: orders, path_prefix: /orders/, upstream: a, idempotency: {}}\n",
        ] {
            let e = load_err(&config(routes)).to_string();
            assert!(
                e.contains("routes[1].path_prefix") && e.contains("never reached for ")
                    && e.contains("POST"),
                "{routes}: {e}"
            );
        }
        // A plain route carving an exception out of a wider idempotent one, other methods, a
        // narrower path, or `/orders` below `/orders/`: every one is reached.
        for routes in [
            "  - {name: search, methods: [POST], path_prefix: /orders/search, upstream: a}\n  - {name: orders, methods: [POST], path_prefix: /, upstream: a, idempotency: {}}\n",
            "  - {name: reads, methods: [GET], path_prefix: /, upstream: a}\n  - {name: orders, methods: [POST], path_prefix: /orders, upstream: a, idempotency: {}}\n",
            "  - {name: below, path_prefix: /orders/, upstream: a}\n  - {name: orders, path_prefix: /orders, upstream: a, idempotency: {}}\n",
            // Reads kept free of keys ahead of an idempotent route for every method.
            "  - {name: reads, methods: [GET, HEAD], path_prefix: /, upstream: a}\n  - {name: api, path_prefix: /api, upstream: a, idempotency: {}}\n",
        ] {
            load(&config(routes));
        }
    }

    #[test]
    fn an_upstream_that_is_idemgate_itself_or_port_0_is_refused() {
        let config = |addr: &str| {
            format!(
                "listen: \"0.0.0.0:6180\"\nadmin: {{listen: \"127.0.0.1:6181\"}}\n\
                 upstreams: {{a: {{addrs: [\"127.0.0.1:8080\", \"{addr}\"]}}}}\nroutes: []\n"
            )
        };
        for (addr, says) in [
            ("127.0.0.1:6180", "own listen"),
            ("0.0.0.0:6180", "own listen"),
            ("127.0.0.1:6181", "own admin.listen"),
            ("127.0.0.1:0", "port 0"),
        ] {
            let e = load_err(&config(addr)).to_string();
            assert!(
                e.contains("upstreams.a.addrs[1]") && e.contains(says),
                "{addr}: {e}"
            );
        }
        // Another host on the proxy's port, this host on another port, or IPv6 loopback on
        // the port of a listener that takes IPv4 only, is an upstream.
        load(&config("10.1.2.3:6180"));
        load(&config("127.0.0.1:6182"));
        load(&config("[::1]:6180"));
        // The wildcard address connects to this host, and to a loopback listener.
        let e = load_err(
            "listen: \"127.0.0.1:6190\"\nadmin: {listen: \"127.0.0.1:6191\"}\n\
             upstreams: {a: {addrs: [\"0.0.0.0:6190\"]}}\nroutes: []\n",
        )
        .to_string();
        assert!(e.contains("own listen"), "{e}");
    }

    #[test]
    fn empty_routes_list_is_allowed() {
        let config = load("upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes: []\n");
        assert!(config.routes.is_empty());
        assert_eq!(
            config.match_route(&Method::POST, "/x"),
            RouteMatch::Forward {
                route: None,
                upstream: 0
            }
        );
    }

    #[test]
    fn load_reads_a_file_and_reports_io_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idemgate.yaml");
        std::fs::write(&path, MINIMAL).unwrap();
        assert_eq!(Config::load(&path).unwrap(), load(MINIMAL));

        let missing = dir.path().join("missing.yaml");
        let err = Config::load(&missing).unwrap_err();
        assert!(matches!(err, ConfigError::Io { .. }), "{err:?}");
        assert_eq!(err.field(), None);
        assert!(err.to_string().contains("missing.yaml"), "{err}");

        // A path to something else (a log, a device) is refused, not read into memory whole.
        let huge = dir.path().join("huge.yaml");
        let mut text = MINIMAL.to_string();
        text.push_str(&"# padding\n".repeat((MAX_FILE_BYTES as usize) / 10));
        std::fs::write(&huge, &text).unwrap();
        let err = Config::load(&huge).unwrap_err();
        assert!(matches!(err, ConfigError::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("larger than"), "{err}");
        let zero = Config::load(Path::new("/dev/zero")).unwrap_err();
        assert!(zero.to_string().contains("larger than"), "{zero}");
    }

    #[test]
    fn source_hash_tracks_the_text() {
        let a = load(MINIMAL);
        let b = load(&format!("{MINIMAL}# a comment\n"));
        assert_ne!(a.source_hash, b.source_hash);
        assert_eq!(a.routes, b.routes);
    }

    // === parse errors ===

    #[test]
    fn unknown_field_is_rejected_by_name() {
        let err = load_err(&format!("{MINIMAL}lisen: \"0.0.0.0:1\"\n"));
        assert!(matches!(err, ConfigError::Parse(_)), "{err:?}");
        assert_eq!(err.field(), None);
        assert!(err.to_string().contains("lisen"), "{err}");

        let err = load_err(&with_route_idempotency("tll: 1h"));
        let message = err.to_string();
        assert!(message.contains("unknown field `tll`"), "{message}");
        assert!(message.contains("routes[0].idempotency"), "{message}");
    }

    /// A value of the wrong shape is not quoted back: a Redis URL where a list was meant would
    /// put its password on stderr, in the log and in a refused reload's answer.
    #[test]
    fn a_parse_error_names_the_field_but_not_the_value() {
        let err = load_err(&format!(
            "{MINIMAL}store: {{backend: redis, redis: {{urls: \"redis://:s3cr3t-pw@127.0.0.1:6379\"}}}}\n"
        ));
        let message = err.to_string();
        assert!(message.contains("store.redis.urls"), "{message}");
        assert!(message.contains("invalid type: a string"), "{message}");
        assert!(!message.contains("s3cr3t"), "{message}");
        let err = load_err(&format!("{MINIMAL}admin: \"0123456789abcdef-token\"\n"));
        assert!(!err.to_string().contains("0123456789abcdef"), "{err}");
        // Escaped quotes inside the value, and what follows it, are handled.
        assert_eq!(
            without_quoted_values(r#"x: invalid type: string "a\"b\\", expected y at line 1"#),
            "x: invalid type: a string, expected y at line 1"
        );
        assert_eq!(without_quoted_values("no value here"), "no value here");
        let err = load_err(&format!(
            "{MINIMAL}store: {{backend: \"redis://:s3cr3t-pw@host\"}}\n"
        ));
        let message = err.to_string();
        assert!(
            message.contains("store.backend: unknown variant, expected"),
            "{message}"
        );
        assert!(!message.contains("s3cr3t"), "{message}");
        assert_eq!(without_quoted_values(r#"string "open"#), "a string");
    }

    #[test]
    fn bad_yaml_reports_the_line() {
        let err = load_err("upstreams:\n  orders:\n    addrs: [\"127.0.0.1:8080\"\nroutes: []\n");
        assert!(matches!(err, ConfigError::Parse(_)), "{err:?}");
        assert!(err.to_string().contains("line"), "{err}");
    }

    #[test]
    fn missing_required_keys_are_parse_errors() {
        let err = load_err("routes: []\n");
        assert!(err.to_string().contains("upstreams"), "{err}");
        let err = load_err("upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\n");
        assert!(err.to_string().contains("routes"), "{err}");
        let err = load_err("");
        assert!(matches!(err, ConfigError::Parse(_)), "{err:?}");
    }

    #[test]
    fn duplicate_upstream_name_is_rejected() {
        let err = load_err(
            "upstreams:\n  a:\n    addrs: [\"127.0.0.1:1\"]\n  a:\n    addrs: [\"127.0.0.1:2\"]\nroutes: []\n",
        );
        assert!(err.to_string().contains("duplicate"), "{err}");
    }

    #[test]
    fn unknown_enum_value_is_rejected() {
        let err = load_err(&with_route_idempotency("on_in_flight: queue"));
        assert!(err.to_string().contains("queue"), "{err}");
        let err = load_err(&format!("{MINIMAL}store: {{on_unavailable: maybe}}\n"));
        assert!(err.to_string().contains("maybe"), "{err}");
    }

    // === validation rules, one field path each ===

    #[test]
    fn listen_must_be_a_socket_address() {
        let message = assert_field(&format!("listen: \"localhost\"\n{MINIMAL}"), "listen");
        assert!(
            message.starts_with("listen: invalid socket address"),
            "{message}"
        );
        assert_field(
            &format!("admin: {{listen: \"nope\"}}\n{MINIMAL}"),
            "admin.listen",
        );
    }

    #[test]
    fn admin_listener_must_not_collide() {
        assert_field(
            &format!("listen: \"0.0.0.0:7000\"\nadmin: {{listen: \"127.0.0.1:7000\"}}\n{MINIMAL}"),
            "admin.listen",
        );
        load(&format!(
            "listen: \"127.0.0.1:0\"\nadmin: {{listen: \"127.0.0.1:0\"}}\n{MINIMAL}"
        ));
    }

    #[test]
    fn threads_range() {
        assert_field(&format!("threads: 0\n{MINIMAL}"), "threads");
        assert_field(&format!("threads: 257\n{MINIMAL}"), "threads");
        assert_eq!(load(&format!("threads: 256\n{MINIMAL}")).threads, 256);
    }

    #[test]
    fn top_level_durations() {
        assert_field(
            &format!("request_body_timeout: 0s\n{MINIMAL}"),
            "request_body_timeout",
        );
        assert_field(
            &format!("request_body_total_timeout: 0s\n{MINIMAL}"),
            "request_body_total_timeout",
        );
        assert_field(
            &format!("response_send_timeout: 0s\n{MINIMAL}"),
            "response_send_timeout",
        );
        assert_field(
            &format!("request_header_timeout: 0s\n{MINIMAL}"),
            "request_header_timeout",
        );
        assert_field(
            &format!("request_header_timeout: soon\n{MINIMAL}"),
            "request_header_timeout",
        );
        assert_eq!(
            load(&format!("request_header_timeout: 1500ms\n{MINIMAL}")).request_header_timeout,
            Duration::from_millis(1500)
        );
        for bad in ["512", "2MiB", "lots", "-1"] {
            assert_field(
                &format!("max_request_header_bytes: {bad}\n{MINIMAL}"),
                "max_request_header_bytes",
            );
        }
        assert_eq!(
            load(&format!("max_request_header_bytes: 8KiB\n{MINIMAL}")).max_request_header_bytes,
            8192
        );
        assert_eq!(
            load(&format!("response_send_timeout: 250ms\n{MINIMAL}")).response_send_timeout,
            Duration::from_millis(250)
        );
        assert_field(
            &format!("shutdown: {{grace_period: soon}}\n{MINIMAL}"),
            "shutdown.grace_period",
        );
        assert_field(
            &format!("shutdown: {{graceful_shutdown_timeout: 5}}\n{MINIMAL}"),
            "shutdown.graceful_shutdown_timeout",
        );
        // No drain at all is refused (see shutdown_budgets_are_whole_seconds).
        assert_field(
            &format!("shutdown: {{grace_period: 0s}}\n{MINIMAL}"),
            "shutdown.grace_period",
        );
    }

    #[test]
    fn upstreams_must_not_be_empty() {
        assert_field("upstreams: {}\nroutes: []\n", "upstreams");
    }

    #[test]
    fn upstream_addrs_must_be_present_and_resolve() {
        let message = assert_field(
            "upstreams: {orders: {addrs: []}}\nroutes: []\n",
            "upstreams.orders.addrs",
        );
        assert!(message.contains("at least one"), "{message}");
        assert_field(
            "upstreams: {orders: {addrs: [\"127.0.0.1:1\", \"127.0.0.1\"]}}\nroutes: []\n",
            "upstreams.orders.addrs[1]",
        );
        assert_field(
            "upstreams: {orders: {addrs: [\"127.0.0.1:99999\"]}}\nroutes: []\n",
            "upstreams.orders.addrs[0]",
        );
        let config =
            load("upstreams: {orders: {addrs: [\"[::1]:80\", \"127.0.0.1:80\"]}}\nroutes: []\n");
        assert_eq!(config.upstreams[0].addrs, vec!["[::1]:80", "127.0.0.1:80"]);
    }

    #[test]
    fn offline_lookup_checks_the_address_shape_only() {
        let offline = |addrs: &str| {
            crate::fuzzing::config_from_yaml(&format!(
                "upstreams: {{orders: {{addrs: [{addrs}]}}}}\nroutes: []\n"
            ))
        };
        // What the system resolver refuses without a lookup, the offline check refuses too.
        for bad in [
            "\"127.0.0.1\"",
            "\"127.0.0.1:99999\"",
            "\"host\"",
            "\"host:\"",
            "\"h:p\"",
        ] {
            let err = offline(bad).expect_err(bad);
            assert_eq!(
                err.field(),
                Some("upstreams.orders.addrs[0]"),
                "{bad}: {err}"
            );
        }
        // A name is taken on trust: no query leaves the machine.
        let config = offline("\"backend.invalid:8080\", \"[::1]:80\", \"10.0.0.1:1\"")
            .expect("shape is enough offline");
        assert_eq!(config.upstreams[0].addrs[0], "backend.invalid:8080");
    }

    #[test]
    fn upstream_timeouts_must_be_positive() {
        for key in ["connect_timeout", "read_timeout", "write_timeout"] {
            assert_field(
                &format!(
                    "upstreams: {{orders: {{addrs: [\"127.0.0.1:1\"], {key}: 0s}}}}\nroutes: []\n"
                ),
                &format!("upstreams.orders.{key}"),
            );
        }
        let config =
            load("upstreams: {orders: {addrs: [\"127.0.0.1:1\"], idle_timeout: 0s}}\nroutes: []\n");
        assert_eq!(config.upstreams[0].idle_timeout, Duration::ZERO);
    }

    #[test]
    fn default_upstream_must_exist() {
        let two = "upstreams:\n  a: {addrs: [\"127.0.0.1:1\"]}\n  b: {addrs: [\"127.0.0.1:2\"]}\nroutes: []\n";
        let message = assert_field(&format!("default_upstream: c\n{two}"), "default_upstream");
        assert!(message.contains("defined: a, b"), "{message}");
        assert_eq!(
            load(&format!("default_upstream: b\n{two}")).default_upstream,
            Some(1)
        );
        // Two upstreams and no explicit default: unmatched requests have nowhere to go.
        assert_eq!(load(two).default_upstream, None);
    }

    #[test]
    fn upstreams_are_sorted_and_routes_point_at_them() {
        let config = load(
            "upstreams:\n  zeta: {addrs: [\"127.0.0.1:1\"]}\n  alpha: {addrs: [\"127.0.0.1:2\"]}\nroutes:\n  - {name: z, path_prefix: /z, upstream: zeta}\n  - {name: a, path_prefix: /a, upstream: alpha}\n",
        );
        let names: Vec<&str> = config.upstreams.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["alpha", "zeta"]);
        assert_eq!(config.routes[0].upstream, 1);
        assert_eq!(config.routes[1].upstream, 0);
    }

    #[test]
    fn global_idempotency_headers() {
        assert_field(
            &format!("idempotency: {{key_header: \"Idempotency Key\"}}\n{MINIMAL}"),
            "idempotency.key_header",
        );
        assert_field(
            &format!("idempotency: {{tenant_header: \"\"}}\n{MINIMAL}"),
            "idempotency.tenant_header",
        );
        assert_field(
            &format!("idempotency: {{tenant_header: idempotency-KEY}}\n{MINIMAL}"),
            "idempotency.tenant_header",
        );
        for (key, bad) in [
            ("key_header", "Content-Length"),
            ("key_header", "Host"),
            ("tenant_header", "Transfer-Encoding"),
            ("tenant_header", "X-Idempotency-Id"),
            ("key_header", "Connection"),
        ] {
            let message = assert_field(
                &format!("idempotency: {{{key}: {bad}}}\n{MINIMAL}"),
                &format!("idempotency.{key}"),
            );
            assert!(message.contains("of HTTP's or idemgate's own"), "{message}");
        }
        assert_field(
            &with_route_idempotency("scope_headers: [Authorization, Expect]"),
            "routes[0].idempotency.scope_headers[1]",
        );
        let config = load(&format!(
            "idempotency: {{key_header: X-Request-Key, tenant_header: X-Org}}\n{MINIMAL}"
        ));
        assert_eq!(config.idempotency.key_header, header("x-request-key"));
        assert_eq!(config.idempotency.tenant_header, header("x-org"));
    }

    #[test]
    fn default_tenant_follows_the_tenant_rule() {
        let long = "a".repeat(129);
        for bad in ["\"\"", "\"two words\"", "\"caf\u{e9}\"", long.as_str()] {
            assert_field(
                &format!("idempotency: {{default_tenant: {bad}}}\n{MINIMAL}"),
                "idempotency.default_tenant",
            );
        }
        let ok = "a".repeat(128);
        load(&format!("idempotency: {{default_tenant: {ok}}}\n{MINIMAL}"));
        let config = load(&format!(
            "idempotency: {{default_tenant: \"Org_1.eu:prod-2\"}}\n{MINIMAL}"
        ));
        assert_eq!(config.idempotency.default_tenant, "Org_1.eu:prod-2");
    }

    #[test]
    fn a_keyed_route_that_lists_no_methods_is_warned_of() {
        let warned = |text: &str| {
            load(text)
                .warnings()
                .iter()
                .any(|w| w.contains("routes[orders].methods is not set") && w.contains("OPTIONS"))
        };
        assert!(warned(&with_route_idempotency("ttl: 24h")));
        // Methods listed, or a key that may be left out: no warning.
        let listed = with_route_idempotency("ttl: 24h").replace(
            "    path_prefix: /\n",
            "    methods: [POST]\n    path_prefix: /\n",
        );
        assert!(listed.contains("methods: [POST]"), "{listed}");
        assert!(!warned(&listed));
        assert!(!warned(&with_route_idempotency("key: optional")));
    }

    #[test]
    fn min_key_length_is_within_the_key_length_limit() {
        let idem = |line: &str| {
            load(&with_route_idempotency(line)).routes[0]
                .idempotency
                .clone()
        };
        assert_eq!(
            idem("min_key_length: 20").map(|i| i.min_key_length),
            Some(20)
        );
        assert_eq!(idem("ttl: 24h").map(|i| i.min_key_length), Some(1));
        for bad in ["0", "256", "-3"] {
            assert_field(
                &with_route_idempotency(&format!("min_key_length: {bad}")),
                "routes[0].idempotency.min_key_length",
            );
        }
    }

    #[test]
    fn docs_url_becomes_a_describedby_link() {
        let with = |url: &str| format!("idempotency: {{docs_url: {url:?}}}\n{MINIMAL}");
        assert_eq!(
            load(&with("https://api.example.com/docs/idempotency#keys"))
                .idempotency
                .docs_link,
            Some(http::HeaderValue::from_static(
                "<https://api.example.com/docs/idempotency#keys>; rel=\"describedby\""
            ))
        );
        assert_eq!(load(MINIMAL).idempotency.docs_link, None);
        for bad in [
            "/docs/idempotency",
            "ftp://example.com/x",
            "https://example.com/a b",
            "https://example.com/a>b",
            "not a url",
            "",
        ] {
            assert_field(&with(bad), "idempotency.docs_url");
        }
    }

    #[test]
    fn max_in_flight_is_a_positive_count() {
        let with = |v: &str| {
            MINIMAL.replace(
                "addrs: [\"127.0.0.1:8080\"]",
                &format!("addrs: [\"127.0.0.1:8080\"]\n    max_in_flight: {v}"),
            )
        };
        assert_eq!(load(&with("64")).upstreams[0].max_in_flight, Some(64));
        assert_eq!(load(MINIMAL).upstreams[0].max_in_flight, None);
        for bad in ["0", "-1", "1000001"] {
            assert_field(&with(bad), "upstreams.orders.max_in_flight");
        }
        let err = load_err(&with("lots")).to_string();
        assert!(err.contains("upstreams.orders.max_in_flight"), "{err}");
    }

    /// The defaults agree with each other: a keyed route on the default upstream timeouts fits
    /// the default grace period, so a config that keeps them starts without a warning.
    #[test]
    fn the_default_timeouts_fit_the_default_grace_period() {
        let slow = |w: &String| w.contains("longer than shutdown.grace_period");
        let defaults = load(MINIMAL);
        assert!(
            !defaults.warnings().iter().any(slow),
            "{:?}",
            defaults.warnings()
        );
        let longer = load(&MINIMAL.replace(
            "addrs: [\"127.0.0.1:8080\"]",
            "addrs: [\"127.0.0.1:8080\"]\n    read_timeout: 14s", // 2 + 5 + 14 > 20
        ));
        assert!(
            longer.warnings().iter().any(slow),
            "{:?}",
            longer.warnings()
        );
    }

    #[test]
    fn a_keyed_route_without_scope_headers_is_warned_of() {
        let warned = |idem: &str| {
            load(&with_route_idempotency(idem))
                .warnings()
                .iter()
                .any(|w| w.contains("scope_headers is []: keys are not bound to a principal"))
        };
        assert!(warned("scope_headers: []"));
        assert!(!warned("scope_headers: [X-Account]"));
        assert!(!warned("ttl: 24h"));
    }

    #[test]
    fn a_ttl_under_twice_lock_ttl_is_warned_of() {
        let warned = |idem: &str| {
            load(&with_route_idempotency(idem))
                .warnings()
                .iter()
                .any(|w| w.contains("is less than twice lock_ttl"))
        };
        assert!(warned("ttl: 45s\nlock_ttl: 30s"));
        assert!(!warned("ttl: 60s\nlock_ttl: 30s"));
        assert!(!warned("ttl: 24h"));
    }

    #[test]
    fn a_worker_lease_too_short_for_the_redis_deadline_is_warned_of() {
        let warned = |text: &str| {
            load(&format!("{text}\n{MINIMAL}"))
                .warnings()
                .iter()
                .any(|w| w.starts_with("idempotency.worker_lease (3s)"))
        };
        // 1s between renewals, against 1.4s of Redis deadline plus a second's pause.
        assert!(warned(
            "idempotency: {worker_lease: 3s}\nstore: {backend: redis}"
        ));
        assert!(!warned(
            "idempotency: {worker_lease: 30s}\nstore: {backend: redis}"
        ));
        // Nothing is leased: a configured id, or the memory store.
        assert!(!warned(
            "idempotency: {worker_lease: 3s, worker_id: 4}\nstore: {backend: redis}"
        ));
        assert!(!warned("idempotency: {worker_lease: 3s}"));
    }

    #[test]
    fn worker_lease_range() {
        for bad in ["2s", "11m", "0s"] {
            assert_field(
                &format!("idempotency: {{worker_lease: {bad}}}\n{MINIMAL}"),
                "idempotency.worker_lease",
            );
        }
        assert_field(
            &format!("idempotency: {{worker_lease: soon}}\n{MINIMAL}"),
            "idempotency.worker_lease",
        );
        let config = load(&format!("idempotency: {{worker_lease: 3s}}\n{MINIMAL}"));
        assert_eq!(config.idempotency.worker_lease, Duration::from_secs(3));
        let config = load(&format!("idempotency: {{worker_lease: 10m}}\n{MINIMAL}"));
        assert_eq!(config.idempotency.worker_lease, Duration::from_secs(600));
    }

    #[test]
    fn worker_id_range() {
        assert_field(
            &format!("idempotency: {{worker_id: 1024}}\n{MINIMAL}"),
            "idempotency.worker_id",
        );
        assert_field(
            &format!("idempotency: {{worker_id: -1}}\n{MINIMAL}"),
            "idempotency.worker_id",
        );
        let config = load(&format!("idempotency: {{worker_id: 1023}}\n{MINIMAL}"));
        assert_eq!(config.idempotency.worker_id, Some(1023));
    }

    #[test]
    fn redis_backend_without_a_block_uses_the_defaults() {
        let config = load(&format!("store: {{backend: redis}}\n{MINIMAL}"));
        assert_eq!(config.store.backend, StoreBackend::Redis);
        let redis = config.store.redis.expect("default redis block");
        assert_eq!(redis.urls, vec!["redis://127.0.0.1:6379".to_owned()]);
        assert_eq!(redis.topology, RedisTopology::Single);
        assert_eq!(redis.connect_timeout, Duration::from_secs(1));
        assert_eq!(redis.response_timeout, Duration::from_millis(200));
        assert_eq!(redis.key_prefix, "idemgate");
        // The same defaults as an empty block.
        let empty = load(&format!(
            "store: {{backend: redis, redis: {{}}}}\n{MINIMAL}"
        ));
        assert_eq!(empty.store.redis, Some(redis));
        // A memory backend without a block has no Redis settings at all.
        assert_eq!(load(MINIMAL).store.redis, None);
    }

    #[test]
    fn redis_url_scheme_and_prefix() {
        let message = assert_field(
            &format!("store: {{redis: {{url: \"http://user:secret@host:6379\"}}}}\n{MINIMAL}"),
            "store.redis.url",
        );
        assert!(!message.contains("secret"), "{message}");
        for bad in [
            "redis://",
            "redis:///0",
            "redis://user:secret@host:notaport",
        ] {
            let message = assert_field(
                &format!("store: {{redis: {{url: \"{bad}\"}}}}\n{MINIMAL}"),
                "store.redis.url",
            );
            assert!(!message.contains("secret"), "{message}");
        }
        assert_field(
            &format!("store: {{redis: {{key_prefix: \"a{{b}}\"}}}}\n{MINIMAL}"),
            "store.redis.key_prefix",
        );
        for (url, topology) in [
            ("redis://127.0.0.1:6379", RedisTopology::Single),
            ("rediss://user:pass@cache:6380/0", RedisTopology::Single),
            ("redis://:pass@cache/3", RedisTopology::Single),
            (
                "redis+sentinel://sentinel:26379/mymaster",
                RedisTopology::Sentinel,
            ),
        ] {
            let config = load(&format!("store: {{redis: {{url: \"{url}\"}}}}\n{MINIMAL}"));
            let redis = config.store.redis.unwrap();
            assert_eq!(redis.urls, vec![url.to_owned()]);
            assert_eq!(redis.topology, topology, "{url}");
            assert_eq!(redis.key_prefix, "idemgate");
        }
    }

    /// What the cluster client or the Sentinel primary would refuse or drop at run time is
    /// refused at load (and so by `--check`), naming the seed, never echoing it.
    #[test]
    fn cluster_and_sentinel_urls_must_agree() {
        let cases = [
            // A Cluster has only database 0: any other fails every connection.
            (
                "{url: \"redis://127.0.0.1:7000/3\", cluster: true}",
                "store.redis.url",
            ),
            (
                "{urls: [\"redis://127.0.0.1:7000/0\", \"redis://127.0.0.1:7001/3\"]}",
                "store.redis.urls[1]",
            ),
            // The cluster client refuses seeds with different credentials.
            (
                "{urls: [\"redis://user:secret-1@127.0.0.1:7000\", \"redis://:secret-2@127.0.0.1:7001\"]}",
                "store.redis.urls[1]",
            ),
            (
                "{urls: [\"redis://127.0.0.1:7000\", \"redis://127.0.0.1:7001?protocol=resp3\"]}",
                "store.redis.urls[1]",
            ),
            // Behind Sentinel only the first URL's credentials and database are used.
            (
                "{urls: [\"redis+sentinel://:secret-1@s1/m/0\", \"redis+sentinel://:secret-2@s2/m/0\"]}",
                "store.redis.urls[1]",
            ),
            (
                "{urls: [\"redis+sentinel://s1/m/0\", \"redis+sentinel://s2/m/5\"]}",
                "store.redis.urls[1]",
            ),
            (
                "{urls: [\"redis+sentinel://s1/m\", \"redis+sentinel://:secret-2@s2/m\"]}",
                "store.redis.urls[1]",
            ),
        ];
        for (redis, field) in cases {
            let message = assert_field(
                &format!("store: {{backend: redis, redis: {redis}}}\n{MINIMAL}"),
                field,
            );
            assert!(!message.contains("secret"), "{message}");
        }
        // Seeds that agree load, with or without an explicit /0.
        let config = load(&format!(
            "store: {{redis: {{urls: [\"redis://u:p@10.0.0.1:7000/0\", \"redis://u:p@10.0.0.2:7000\"]}}}}\n{MINIMAL}"
        ));
        assert_eq!(config.store.redis.unwrap().topology, RedisTopology::Cluster);
        let config = load(&format!(
            "store: {{redis: {{urls: [\"redis+sentinel://:p@s1/m/2\", \"redis+sentinel://:p@s2/m/2\"]}}}}\n{MINIMAL}"
        ));
        assert_eq!(
            config.store.redis.unwrap().topology,
            RedisTopology::Sentinel
        );
        // A later Sentinel URL that gives neither takes the first's, as it always did.
        let config = load(&format!(
            "store: {{redis: {{urls: [\"redis+sentinel://:p@s1/m/2\", \"redis+sentinel://s2/m\"]}}}}\n{MINIMAL}"
        ));
        assert_eq!(
            config.store.redis.unwrap().topology,
            RedisTopology::Sentinel
        );
    }

    #[test]
    fn redis_urls_and_cluster() {
        let seeds = "[\"redis://10.0.0.1:7000\", \"redis://10.0.0.2:7000\"]";
        let config = load(&format!("store: {{redis: {{urls: {seeds}}}}}\n{MINIMAL}"));
        let redis = config.store.redis.unwrap();
        assert_eq!(redis.urls.len(), 2);
        assert_eq!(
            redis.topology,
            RedisTopology::Cluster,
            "several seeds mean a cluster"
        );

        let config = load(&format!(
            "store: {{redis: {{url: \"redis://10.0.0.1:7000\", cluster: true}}}}\n{MINIMAL}"
        ));
        assert_eq!(config.store.redis.unwrap().topology, RedisTopology::Cluster);

        let message = assert_field(
            &format!(
                "store: {{redis: {{url: \"redis://a:1\", urls: [\"redis://b:1\"]}}}}\n{MINIMAL}"
            ),
            "store.redis.urls",
        );
        assert!(message.contains("not both"), "{message}");
        assert_field(
            &format!("store: {{redis: {{urls: []}}}}\n{MINIMAL}"),
            "store.redis.urls",
        );
        assert_field(
            &format!("store: {{redis: {{urls: [\"redis://a:1\", \"http://b:1\"]}}}}\n{MINIMAL}"),
            "store.redis.urls[1]",
        );
        assert_field(
            &format!(
                "store: {{redis: {{url: \"redis+sentinel://s:26379/m\", cluster: true}}}}\n{MINIMAL}"
            ),
            "store.redis.cluster",
        );
        assert_field(
            &format!(
                "store: {{redis: {{urls: [\"redis+sentinel://s/m\", \"redis://b:1\"]}}}}\n{MINIMAL}"
            ),
            "store.redis.urls",
        );
        assert_field(
            &format!(
                "store: {{redis: {{urls: [\"redis+sentinel://s/m\", \"redis+sentinel://t/n\"]}}}}\n{MINIMAL}"
            ),
            "store.redis.urls",
        );
    }

    const FIXTURE_CERT: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/redis-tls/cert.pem"
    );
    const FIXTURE_KEY: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/redis-tls/key.pem"
    );

    /// A config whose Redis block has `url` and `tls: {tls}`.
    fn with_tls(url: &str, tls: &str) -> String {
        format!("store: {{redis: {{url: \"{url}\", tls: {tls}}}}}\n{MINIMAL}")
    }

    #[test]
    fn redis_tls_block_keeps_checked_paths() {
        let config = load(&with_tls(
            "rediss://cache:6380",
            &format!(
                "{{ca_file: \"{FIXTURE_CERT}\", cert_file: \"{FIXTURE_CERT}\", key_file: \"{FIXTURE_KEY}\"}}"
            ),
        ));
        let tls = config.store.redis.unwrap().tls.expect("tls block");
        assert_eq!(tls.ca_file, Some(PathBuf::from(FIXTURE_CERT)));
        assert_eq!(tls.cert_file, Some(PathBuf::from(FIXTURE_CERT)));
        assert_eq!(tls.key_file, Some(PathBuf::from(FIXTURE_KEY)));
        // An empty block: TLS with the built-in roots, and every URL must use it.
        let empty = load(&with_tls("rediss://cache:6380", "{}"));
        assert_eq!(
            empty.store.redis.unwrap().tls,
            Some(RedisTlsConfig {
                ca_file: None,
                cert_file: None,
                key_file: None
            })
        );
        // No block: no TLS settings (a rediss:// URL alone trusts the built-in roots).
        let none = load(&format!(
            "store: {{redis: {{url: \"rediss://cache\"}}}}\n{MINIMAL}"
        ));
        assert_eq!(none.store.redis.unwrap().tls, None);
    }

    #[test]
    fn redis_tls_files_are_checked_at_load_naming_the_field() {
        let ca = |path: &str| with_tls("rediss://cache", &format!("{{ca_file: \"{path}\"}}"));
        let missing = assert_field(&ca("/nonexistent/ca.pem"), "store.redis.tls.ca_file");
        assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
        assert_field(&ca(""), "store.redis.tls.ca_file");
        // A key where a certificate belongs, and the other way round.
        let wrong = assert_field(&ca(FIXTURE_KEY), "store.redis.tls.ca_file");
        assert!(wrong.contains("no PEM certificate"), "{wrong}");
        let key_as_cert = assert_field(
            &with_tls(
                "rediss://cache",
                &format!("{{cert_file: \"{FIXTURE_CERT}\", key_file: \"{FIXTURE_CERT}\"}}"),
            ),
            "store.redis.tls.key_file",
        );
        assert!(key_as_cert.contains("no PEM private key"), "{key_as_cert}");
        // The error names the file but never echoes a key file's contents.
        let key_text = std::fs::read_to_string(FIXTURE_KEY).unwrap();
        let body_line = key_text.lines().nth(1).unwrap();
        assert!(!wrong.contains(body_line), "{wrong}");
        // A client certificate and its key go together.
        assert_field(
            &with_tls(
                "rediss://cache",
                &format!("{{cert_file: \"{FIXTURE_CERT}\"}}"),
            ),
            "store.redis.tls.key_file",
        );
        assert_field(
            &with_tls(
                "rediss://cache",
                &format!("{{key_file: \"{FIXTURE_KEY}\"}}"),
            ),
            "store.redis.tls.cert_file",
        );
        // A key that is not the certificate's: refused at load, naming both files.
        let other_key = FIXTURE_KEY.replace("key.pem", "other-key.pem");
        let mismatch = assert_field(
            &with_tls(
                "rediss://cache",
                &format!("{{cert_file: \"{FIXTURE_CERT}\", key_file: \"{other_key}\"}}"),
            ),
            "store.redis.tls.key_file",
        );
        assert!(
            mismatch.contains("is not the private key of the certificate")
                && mismatch.contains("other-key.pem")
                && mismatch.contains("cert.pem"),
            "{mismatch}"
        );
        assert!(Pem::key_pair(
            &std::fs::read(FIXTURE_CERT).unwrap(),
            &std::fs::read(FIXTURE_KEY).unwrap()
        )
        .is_ok());
        // There is no switch to skip verification.
        let err = load_err(&with_tls("rediss://cache", "{insecure_skip_verify: true}"));
        assert!(err.to_string().contains("insecure_skip_verify"), "{err}");
    }

    #[test]
    fn redis_tls_is_all_or_nothing() {
        // A tls block beside a plain URL would send everything unencrypted.
        let msg = assert_field(&with_tls("redis://cache", "{}"), "store.redis.tls");
        assert!(msg.contains("store.redis.url"), "{msg}");
        assert_field(
            &format!(
                "store: {{redis: {{urls: [\"redis+sentinel://s/m\"], tls: {{}}}}}}\n{MINIMAL}"
            ),
            "store.redis.tls",
        );
        // Cluster seeds share one transport.
        assert_field(
            &format!("store: {{redis: {{urls: [\"rediss://a:1\", \"redis://b:1\"]}}}}\n{MINIMAL}"),
            "store.redis.urls",
        );
        // `#insecure` (redis-rs: accept any certificate) is refused.
        let msg = assert_field(
            &format!("store: {{redis: {{url: \"rediss://cache:6380/#insecure\"}}}}\n{MINIMAL}"),
            "store.redis.url",
        );
        assert!(msg.contains("ca_file"), "{msg}");
        // TLS through Sentinel.
        let config = load(&with_tls("rediss+sentinel://s1:26379/mymaster", "{}"));
        let redis = config.store.redis.unwrap();
        assert_eq!(redis.topology, RedisTopology::Sentinel);
        assert!(parse_sentinel_url(&redis.urls[0]).unwrap().tls);
        assert!(!parse_sentinel_url("redis+sentinel://s1/m").unwrap().tls);
        let seeds = "[\"rediss://a:1\", \"rediss://b:1\"]";
        let cluster = load(&format!(
            "store: {{redis: {{urls: {seeds}, tls: {{ca_file: \"{FIXTURE_CERT}\"}}}}}}\n{MINIMAL}"
        ));
        assert_eq!(
            cluster.store.redis.unwrap().topology,
            RedisTopology::Cluster
        );
    }

    #[test]
    fn redis_timeouts() {
        let config = load(&format!(
            "store: {{redis: {{connect_timeout: 250ms, response_timeout: 1s}}}}\n{MINIMAL}"
        ));
        let redis = config.store.redis.unwrap();
        assert_eq!(redis.connect_timeout, Duration::from_millis(250));
        assert_eq!(redis.response_timeout, Duration::from_secs(1));
        assert_field(
            &format!("store: {{redis: {{connect_timeout: 0s}}}}\n{MINIMAL}"),
            "store.redis.connect_timeout",
        );
        assert_field(
            &format!("store: {{redis: {{response_timeout: soon}}}}\n{MINIMAL}"),
            "store.redis.response_timeout",
        );
        let err = load_err(&format!("store: {{redis: {{database: 3}}}}\n{MINIMAL}"));
        assert!(err.to_string().contains("database"), "{err}");
    }

    #[test]
    fn sentinel_urls_parse() {
        let parsed =
            parse_sentinel_url("redis+sentinel://app:p%40ss@s1:26380,s2,[::1]:26381/orders/2")
                .unwrap();
        assert_eq!(
            parsed.sentinels,
            vec![
                ("s1".to_owned(), 26380),
                ("s2".to_owned(), 26379),
                ("::1".to_owned(), 26381)
            ]
        );
        assert_eq!(parsed.master, "orders");
        assert_eq!(parsed.db, 2);
        assert_eq!(parsed.username.as_deref(), Some("app"));
        assert_eq!(parsed.password.as_deref(), Some("p@ss"));
        assert!(!format!("{parsed:?}").contains("p@ss"));

        let plain = parse_sentinel_url("redis+sentinel://sentinel/mymaster").unwrap();
        assert_eq!(plain.db, 0);
        assert_eq!((plain.username, plain.password), (None, None));

        for bad in [
            "redis+sentinel://s1:26379",
            "redis+sentinel://s1:26379/",
            "redis+sentinel://s1:0/m",
            "redis+sentinel://s1:port/m",
            "redis+sentinel://s1,,s2/m",
            "redis+sentinel://s1/m/x",
            "redis+sentinel://s1/m/1/2",
            "redis+sentinel://s1/m?x=1",
            "redis+sentinel://u:%zz@s1/m",
            "redis://s1/m",
        ] {
            let err = parse_sentinel_url(bad).expect_err(bad);
            assert!(!err.contains("%zz"), "{err}");
        }
    }

    #[test]
    fn fuzz_seed_configs_stay_valid() {
        // The config fuzzer mutates these; a seed the schema no longer accepts would leave it
        // exploring parse errors only.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/config");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("fuzz/seeds/config") {
            let path = entry.expect("seed entry").path();
            let text = std::fs::read_to_string(&path).expect("seed text");
            if let Err(e) = crate::fuzzing::config_from_yaml(&text) {
                panic!("{}: {e}", path.display());
            }
            seen += 1;
        }
        assert!(seen >= 3, "only {seen} seeds");
    }

    /// The password from the environment goes into every kind of store URL, replacing the
    /// file's and keeping the user, and reads back byte for byte however odd it is.
    #[test]
    fn the_environment_s_redis_password_goes_into_every_url() {
        let odd = "p@ss:w/rd?#%20 é\"'";
        let cases = [
            ("redis://cache:6379", None, 0),
            ("redis://cache:6379/2", None, 2),
            ("rediss://idemgate@cache:6380", Some("idemgate"), 0),
            (
                "redis://idemgate:old%40pw@cache:6379/1",
                Some("idemgate"),
                1,
            ),
            ("redis://:old@cache", None, 0),
        ];
        for (url, user, db) in cases {
            let with = with_password(url, odd);
            assert!(!with.contains("old"), "{with}");
            check_redis_url(&with).unwrap_or_else(|e| panic!("{with}: {e}"));
            let info = redis::IntoConnectionInfo::into_connection_info(with.as_str())
                .unwrap_or_else(|e| panic!("{with}: {e}"));
            let settings = info.redis_settings();
            assert_eq!(settings.password(), Some(odd), "{with}");
            assert_eq!(settings.username(), user, "{with}");
            assert_eq!(settings.db(), db, "{with}");
            assert!(
                !redact_url(&with).contains("p%40ss"),
                "{}",
                redact_url(&with)
            );
        }
        for (url, user) in [
            ("redis+sentinel://s1:26379,s2:26379/mymaster/3", None),
            (
                "rediss+sentinel://idemgate:old@s1,s2/mymaster",
                Some("idemgate"),
            ),
        ] {
            let with = with_password(url, odd);
            let parsed = parse_sentinel_url(&with).unwrap_or_else(|e| panic!("{with}: {e}"));
            assert_eq!(parsed.password.as_deref(), Some(odd), "{with}");
            assert_eq!(parsed.username.as_deref(), user, "{with}");
            assert_eq!(parsed.sentinels.len(), 2);
            assert_eq!(parsed.master, "mymaster");
        }
        // Through the whole loader: every URL, a Cluster's seeds too.
        let yaml = format!(
            "{MINIMAL}store:\n  backend: redis\n  redis:\n    urls: [\"redis://a:7000\", \"redis://b:7000\"]\n"
        );
        let file: FileConfig = serde_yaml::from_str(&yaml).expect("yaml");
        let store = file.store.into_config(Some("s3cret")).expect("store");
        let redis = store.redis.expect("redis block");
        assert_eq!(
            redis.urls,
            ["redis://:s3cret@a:7000", "redis://:s3cret@b:7000"]
        );
        // Sentinel URLs are checked as written: a later URL that gives no credentials takes
        // the first's, with the password from the environment as without it.
        let yaml = format!(
            "{MINIMAL}store:\n  backend: redis\n  redis:\n    urls: \
             [\"redis+sentinel://idemgate@s1/m\", \"redis+sentinel://s2/m\"]\n"
        );
        let file: FileConfig = serde_yaml::from_str(&yaml).expect("yaml");
        let redis = file
            .store
            .into_config(Some("s3cret"))
            .expect("sentinel store");
        assert_eq!(
            redis.redis.expect("redis block").urls,
            [
                "redis+sentinel://idemgate:s3cret@s1/m",
                "redis+sentinel://:s3cret@s2/m"
            ]
        );
        // The variable's value: empty is unset; a trailing line break (a Secret made from a
        // file) is refused, naming the variable.
        assert_eq!(redis_password(String::new()).expect("empty"), None);
        assert_eq!(
            redis_password("pw".into()).expect("pw").as_deref(),
            Some("pw")
        );
        for bad in ["pw\n", "pw\r\n"] {
            let err = redis_password(bad.into()).expect_err(bad);
            assert_eq!(err.field(), Some(REDIS_PASSWORD_ENV), "{err}");
            assert!(err.to_string().contains("line break"), "{err}");
        }
    }

    #[test]
    fn percent_decode_takes_only_two_hex_digits() {
        assert_eq!(
            percent_decode("p%40ss%2F%e2%82%ac").as_deref(),
            Some("p@ss/\u{20ac}")
        );
        // Found by fuzzing: `%+0` decoded to a NUL byte, because the radix parser takes a sign.
        for bad in [
            "p%+0ss", "%-1", "%+", "%4", "%zz", "%4g", "%", "%\u{e9}0", "%c3",
        ] {
            assert_eq!(percent_decode(bad), None, "{bad:?}");
        }
        assert!(parse_sentinel_url("redis+sentinel://user:p%+0ss@s1/m").is_err());
    }

    #[test]
    fn redis_debug_hides_the_password() {
        let redis = RedisConfig {
            urls: vec!["rediss://user:secret@cache:6380/0".into()],
            topology: RedisTopology::Single,
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_millis(200),
            key_prefix: "p".into(),
            scripts: ScriptsConfig::default(),
            tls: None,
        };
        let debug = format!("{redis:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("rediss://***@cache:6380/0"), "{debug}");
    }

    #[test]
    fn memory_store_settings() {
        assert_field(
            &format!("store: {{memory: {{capacity: 0}}}}\n{MINIMAL}"),
            "store.memory.capacity",
        );
        // A number with no unit is bytes: 256 holds no record at all.
        assert_field(
            &format!("store: {{memory: {{capacity: 256}}}}\n{MINIMAL}"),
            "store.memory.capacity",
        );
        let config = load(&format!(
            "store: {{memory: {{capacity: 64KiB}}}}\n{MINIMAL}"
        ));
        assert_eq!(config.store.memory.capacity_bytes, 64 << 10);
        assert_field(
            &format!("store: {{memory: {{capacity: lots}}}}\n{MINIMAL}"),
            "store.memory.capacity",
        );
        assert_field(
            &format!("store: {{memory: {{shards: 0}}}}\n{MINIMAL}"),
            "store.memory.shards",
        );
        assert_field(
            &format!("store: {{memory: {{shards: 4097}}}}\n{MINIMAL}"),
            "store.memory.shards",
        );
        let config = load(&format!(
            "store: {{memory: {{capacity: 1GB, shards: 3}}, on_unavailable: local}}\n{MINIMAL}"
        ));
        assert_eq!(config.store.memory.capacity_bytes, 1_000_000_000);
        assert_eq!(config.store.memory.shards, 3);
        assert_eq!(config.store.on_unavailable, OnUnavailable::Local);
    }

    #[test]
    fn memory_shards_default_to_one_per_four_mib() {
        let shards = |capacity: &str| {
            load(&format!(
                "store: {{memory: {{capacity: {capacity}}}}}\n{MINIMAL}"
            ))
            .store
            .memory
            .shards
        };
        assert_eq!(shards("1MiB"), 64);
        assert_eq!(shards("256MiB"), 64);
        assert_eq!(shards("1GiB"), 256);
        assert_eq!(shards("4GiB"), 1024);
        assert_eq!(shards("64GiB"), 4096);
        assert_eq!(shards("100GiB"), 4096);
    }

    #[test]
    fn route_names_are_required_and_unique() {
        let base = "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n";
        assert_field(
            &format!("{base}  - {{name: \"\", path_prefix: /, upstream: a}}\n"),
            "routes[0].name",
        );
        assert_field(
            &format!("{base}  - {{name: \"-\", path_prefix: /, upstream: a}}\n"),
            "routes[0].name",
        );
        assert_field(
            &format!(
                "{base}  - {{name: r, path_prefix: /x, upstream: a}}\n  - {{name: \"r \", path_prefix: /y, upstream: a}}\n"
            ),
            "routes[1].name",
        );
        let message = assert_field(
            &format!(
                "{base}  - {{name: r, path_prefix: /x, upstream: a}}\n  - {{name: r, path_prefix: /y, upstream: a}}\n"
            ),
            "routes[1].name",
        );
        assert!(message.contains("routes[0]"), "{message}");
    }

    #[test]
    fn route_methods_are_normalized_and_checked() {
        let base = "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n";
        let config = load(&format!(
            "{base}  - {{name: r, path_prefix: /, upstream: a, methods: [post, Put, POST, purge]}}\n"
        ));
        assert_eq!(
            config.routes[0].methods,
            vec![
                Method::POST,
                Method::PUT,
                Method::from_bytes(b"PURGE").unwrap()
            ]
        );
        assert_field(
            &format!(
                "{base}  - {{name: r, path_prefix: /, upstream: a, methods: [POST, \"GE T\"]}}\n"
            ),
            "routes[0].methods[1]",
        );
        assert_field(
            &format!("{base}  - {{name: r, path_prefix: /, upstream: a, methods: [\"\"]}}\n"),
            "routes[0].methods[0]",
        );
    }

    #[test]
    fn route_path_prefix_must_be_a_path() {
        let base = "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n";
        for bad in ["orders", "\"\"", "\"/orders?x=1\"", "\"/a b\""] {
            assert_field(
                &format!("{base}  - {{name: r, path_prefix: {bad}, upstream: a}}\n"),
                "routes[0].path_prefix",
            );
        }
    }

    #[test]
    fn route_upstream_must_exist() {
        let message = assert_field(
            "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n  - {name: r, path_prefix: /, upstream: b}\n",
            "routes[0].upstream",
        );
        assert!(message.contains("\"b\""), "{message}");
    }

    #[test]
    fn ttl_must_be_a_positive_duration() {
        let message = assert_field(
            &with_route_idempotency("ttl: 3 parsecs"),
            "routes[0].idempotency.ttl",
        );
        assert_eq!(
            message,
            "routes[0].idempotency.ttl: invalid duration \"3 parsecs\" (whole numbers with a unit, e.g. 250ms, 1500ms, 30s, 5m, 24h)"
        );
        let message = assert_field(
            &with_route_idempotency("ttl: 0h"),
            "routes[0].idempotency.ttl",
        );
        assert!(message.contains("greater than zero"), "{message}");
        let message = assert_field(
            &with_route_idempotency("ttl: 86400"),
            "routes[0].idempotency.ttl",
        );
        assert!(message.contains("unit is required"), "{message}");
    }

    #[test]
    fn lock_ttl_must_not_exceed_ttl() {
        let message = assert_field(
            &with_route_idempotency("ttl: 1m\nlock_ttl: 2m"),
            "routes[0].idempotency.lock_ttl",
        );
        assert!(message.contains("longer than ttl"), "{message}");
        assert_field(
            &with_route_idempotency("lock_ttl: 0s"),
            "routes[0].idempotency.lock_ttl",
        );
    }

    #[test]
    fn lock_ttl_must_outlast_the_upstream_timeouts() {
        // Default connect 2s + write 5s + read 10s = 17s.
        let message = assert_field(
            &with_route_idempotency("lock_ttl: 17s"),
            "routes[0].idempotency.lock_ttl",
        );
        assert!(message.contains("17s"), "{message}");
        assert!(message.contains("write_timeout"), "{message}");
        assert!(message.contains("retry could execute again"), "{message}");
        let config = load(&with_route_idempotency("lock_ttl: 17s1ms"));
        assert_eq!(
            config.routes[0].idempotency.as_ref().unwrap().lock_ttl,
            Duration::from_millis(17_001)
        );
        // A slower upstream needs a longer lock, whether it is slow to answer or to read.
        for slow in ["read_timeout: 1m", "write_timeout: 1m"] {
            let slow = MINIMAL.replace(
                "addrs: [\"127.0.0.1:8080\"]",
                &format!("addrs: [\"127.0.0.1:8080\"]\n    {slow}"),
            );
            assert_field(&slow, "routes[0].idempotency.lock_ttl");
        }
    }

    #[test]
    fn wait_timeout_must_be_positive() {
        assert_field(
            &with_route_idempotency("wait_timeout: 0ms"),
            "routes[0].idempotency.wait_timeout",
        );
        let config = load(&with_route_idempotency(
            "on_in_flight: wait\nwait_timeout: 250ms",
        ));
        let idem = config.routes[0].idempotency.as_ref().unwrap();
        assert_eq!(idem.on_in_flight, OnInFlight::Wait);
        assert_eq!(idem.wait_timeout, Duration::from_millis(250));
    }

    #[test]
    fn on_outcome_unknown_is_lapse_or_settle() {
        let config = load(&with_route_idempotency("on_outcome_unknown: settle"));
        let idem = config.routes[0].idempotency.as_ref().unwrap();
        assert_eq!(idem.on_outcome_unknown, OnOutcomeUnknown::Settle);
        let err = load_err(&with_route_idempotency("on_outcome_unknown: replay"));
        let message = err.to_string();
        assert!(
            message.contains("replay") && message.contains("lapse") && message.contains("settle"),
            "{message}"
        );
    }

    #[test]
    fn header_lists_are_checked_lowercased_and_sorted() {
        assert_field(
            &with_route_idempotency("scope_headers: [Authorization, \"Bad Header\"]"),
            "routes[0].idempotency.scope_headers[1]",
        );
        assert_field(
            &with_route_idempotency("fingerprint: {headers: [\"x:y\"]}"),
            "routes[0].idempotency.fingerprint.headers[0]",
        );
        assert_field(
            &with_route_idempotency("replay_exclude_headers: [\"\"]"),
            "routes[0].idempotency.replay_exclude_headers[0]",
        );
        let config = load(&with_route_idempotency(
            "scope_headers: [X-Api-Key, Authorization, authorization]\nfingerprint: {body: false, headers: [Content-Type]}\nreplay_exclude_headers: [Set-Cookie, X-Trace]\nkey: optional",
        ));
        let idem = config.routes[0].idempotency.as_ref().unwrap();
        assert_eq!(
            idem.scope_headers,
            vec![header("authorization"), header("x-api-key")]
        );
        assert_eq!(idem.fingerprint_headers, vec![header("content-type")]);
        assert!(!idem.fingerprint_body);
        assert_eq!(
            idem.replay_exclude_headers,
            vec![header("set-cookie"), header("x-trace")]
        );
        assert_eq!(idem.key, KeyMode::Optional);
    }

    #[test]
    fn refusals_never_repeat_a_url_password() {
        for (line, field) in [
            ("listen: \"redis://app:S3cretPass@redis:6379/0\"", "listen"),
            (
                "admin:\n  listen: \"rediss://S3cretPass@10.0.0.1:6379\"",
                "admin.listen",
            ),
        ] {
            let message = assert_field(&format!("{line}\n{MINIMAL}"), field);
            assert!(!message.contains("S3cretPass"), "{message}");
            assert!(message.contains("***@"), "{message}");
        }
        assert_eq!(
            redact_url("\"http://u:p@h/x?a=b@c\" and https://h:1/@x and x://@y"),
            "\"http://***@h/x?a=b@c\" and https://h:1/@x and x://***@y"
        );
    }

    #[test]
    fn scope_required_needs_a_scope_header() {
        let message = assert_field(
            &with_route_idempotency("scope_headers: []\nscope_required: true"),
            "routes[0].idempotency.scope_required",
        );
        assert!(message.contains("scope_headers is empty"), "{message}");
        let config = load(&with_route_idempotency("scope_required: true"));
        assert!(
            config.routes[0]
                .idempotency
                .as_ref()
                .unwrap()
                .scope_required
        );
        assert!(
            !load(MINIMAL).routes[0]
                .idempotency
                .as_ref()
                .unwrap()
                .scope_required
        );
    }

    #[test]
    fn scope_headers_may_be_empty() {
        let config = load(&with_route_idempotency("scope_headers: []"));
        assert!(config.routes[0]
            .idempotency
            .as_ref()
            .unwrap()
            .scope_headers
            .is_empty());
    }

    #[test]
    fn cache_statuses_entries_are_checked() {
        let field = "routes[0].idempotency.cache_statuses[1]";
        for bad in [
            "\"2xy\"", "\"6xx\"", "\"1xx\"", "101", "\"600\"", "\"!abc\"", "2.5", "\"!2xx\"",
        ] {
            assert_field(
                &with_route_idempotency(&format!("cache_statuses: [\"2xx\", {bad}]")),
                field,
            );
        }
        let message = assert_field(
            &with_route_idempotency("cache_statuses: [\"2xx\", \"1xx\"]"),
            field,
        );
        assert!(message.contains("never final"), "{message}");
        let message = assert_field(
            &with_route_idempotency("cache_statuses: [429, \"!429\"]"),
            field,
        );
        assert!(message.contains("both listed and excluded"), "{message}");
    }

    #[test]
    fn cache_statuses_accept_classes_codes_and_exclusions() {
        let config = load(&with_route_idempotency(
            "cache_statuses: [\"2XX\", 409, \"429\", \"!201\", \"5xx\"]",
        ));
        let set = &config.routes[0]
            .idempotency
            .as_ref()
            .unwrap()
            .cache_statuses;
        assert!(set.contains(200));
        assert!(!set.contains(201));
        assert!(set.contains(409));
        assert!(set.contains(429));
        assert!(!set.contains(404));
        assert!(set.contains(500));
        assert_eq!(
            format!("{set:?}"),
            r#"StatusSet["2xx", "5xx", "409", "429", "!201"]"#
        );
        let empty = load(&with_route_idempotency("cache_statuses: []"));
        assert!(!empty.routes[0]
            .idempotency
            .as_ref()
            .unwrap()
            .cache_statuses
            .contains(200));
    }

    #[test]
    fn body_limits() {
        for key in ["max_request_bytes", "max_response_bytes"] {
            let field = format!("routes[0].idempotency.{key}");
            assert_field(&with_route_idempotency(&format!("{key}: 0")), &field);
            assert_field(&with_route_idempotency(&format!("{key}: 2GiB")), &field);
            assert_field(&with_route_idempotency(&format!("{key}: 1.5MiB")), &field);
        }
        let config = load(&format!(
            "max_buffered_request_bytes: 1GiB\n{}",
            with_route_idempotency("max_request_bytes: 1GiB\nmax_response_bytes: 64KiB")
        ));
        let idem = config.routes[0].idempotency.as_ref().unwrap();
        assert_eq!(idem.max_request_bytes, 1 << 30);
        assert_eq!(idem.max_response_bytes, 64 << 10);
        assert_eq!(config.max_buffered_request_bytes, 1 << 30);
    }

    #[test]
    fn every_keyed_body_fits_the_buffer_budget() {
        for bad in ["0", "1000", "65GiB", "lots"] {
            assert_field(
                &format!("max_buffered_request_bytes: {bad}\n{MINIMAL}"),
                "max_buffered_request_bytes",
            );
        }
        // A route whose largest body the budget could never hold: every such request would be
        // refused as if the proxy were busy.
        let message = assert_field(
            &format!(
                "max_buffered_request_bytes: 4MiB\n{}",
                with_route_idempotency("max_request_bytes: 5MiB")
            ),
            "routes[0].idempotency.max_request_bytes",
        );
        assert!(message.contains("max_buffered_request_bytes"), "{message}");
        assert_field(
            &with_route_idempotency("max_request_bytes: 65MiB"),
            "routes[0].idempotency.max_request_bytes",
        );
        let config = load(&format!(
            "max_buffered_request_bytes: 4MiB\n{}",
            with_route_idempotency("max_request_bytes: 4MiB")
        ));
        assert_eq!(config.max_buffered_request_bytes, 4 << 20);
    }

    #[test]
    fn every_stored_response_fits_the_retry_queue() {
        // On Redis, a response the queue could never hold would be dead-lettered at its first
        // failed write, however empty the queue.
        let redis = |store: &str, idem: &str| {
            format!(
                "store: {{backend: redis{store}}}\n{}",
                with_route_idempotency(idem)
            )
        };
        let message = assert_field(
            &redis("", "max_response_bytes: 256MiB"),
            "routes[0].idempotency.max_response_bytes",
        );
        assert!(message.contains("queue_bytes"), "{message}");
        let config = load(&redis(
            ", completion_retry: {queue_bytes: 512MiB}",
            "max_response_bytes: 256MiB",
        ));
        assert!(config.check_redis_record_limits().is_ok());
        // The smallest queue holds a response of up to 896 KiB, not the default 1 MiB.
        assert_field(
            &redis(", completion_retry: {queue_bytes: 1MiB}", "ttl: 24h"),
            "routes[0].idempotency.max_response_bytes",
        );
        load(&redis(
            ", completion_retry: {queue_bytes: 1MiB}",
            "max_response_bytes: 896KiB",
        ));
        // The embedded store's writes never wait in the queue.
        load(&with_route_idempotency("max_response_bytes: 1GiB"));
    }

    /// Redis takes one argument of at most 512 MiB by default: a route whose largest stored
    /// response is more is refused, and one whose write may outlast the response timeout at
    /// 1 Gbit/s is warned of.
    #[test]
    fn every_stored_response_fits_one_redis_argument() {
        let redis = |idem: &str| {
            format!(
                "store: {{backend: redis, completion_retry: {{queue_bytes: 2GiB}}}}\n{}",
                with_route_idempotency(idem)
            )
        };
        let message = assert_field(
            &redis("max_response_bytes: 1GiB"),
            "routes[0].idempotency.max_response_bytes",
        );
        assert!(message.contains("proto-max-bulk-len"), "{message}");
        assert_field(
            &redis(&format!(
                "max_response_bytes: {}",
                (512 << 20) - (128 << 10) + 1
            )),
            "routes[0].idempotency.max_response_bytes",
        );
        let largest = load(&redis(&format!(
            "max_response_bytes: {}",
            (512 << 20) - (128 << 10)
        )));
        assert!(largest.check_redis_record_limits().is_ok());
        let slow = |w: &String| w.contains("store.redis.response_timeout (200ms)");
        assert!(
            largest.warnings().iter().any(slow),
            "{:?}",
            largest.warnings()
        );
        // 200 ms carries 25 MB at 1 Gbit/s: the default 1 MiB is far from it.
        let small = load(&redis("ttl: 24h"));
        assert!(!small.warnings().iter().any(slow), "{:?}", small.warnings());
        let fast = load(&format!(
            "store: {{backend: redis, redis: {{response_timeout: 1s}}, completion_retry: \
             {{queue_bytes: 2GiB}}}}\n{}",
            with_route_idempotency("max_response_bytes: 100MiB")
        ));
        assert!(
            !fast
                .warnings()
                .iter()
                .any(|w| w.contains("response_timeout")),
            "{:?}",
            fast.warnings()
        );
    }

    #[test]
    fn a_memory_store_smaller_than_a_response_is_warned_of() {
        let small = load(&format!(
            "store: {{memory: {{capacity: 512KiB}}}}\n{MINIMAL}"
        ));
        let warnings = small.warnings();
        assert!(
            warnings.iter().any(
                |w| w.contains("routes[orders].idempotency.max_response_bytes")
                    && w.contains("store.memory.capacity")
            ),
            "{warnings:?}"
        );
        let roomy = load(&format!("store: {{memory: {{capacity: 2MiB}}}}\n{MINIMAL}"));
        assert!(
            !roomy
                .warnings()
                .iter()
                .any(|w| w.contains("store.memory.capacity")),
            "{:?}",
            roomy.warnings()
        );
    }

    #[test]
    fn errors_name_the_right_route_index() {
        let text = "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n  - {name: one, path_prefix: /one, upstream: a, idempotency: {}}\n  - {name: two, path_prefix: /two, upstream: a, idempotency: {ttl: 3 parsecs}}\n";
        assert_field(text, "routes[1].idempotency.ttl");
    }

    // === scalar syntaxes ===

    #[test]
    fn durations_parse() {
        let cases = [
            ("250ms", Duration::from_millis(250)),
            ("30s", secs(30)),
            ("5m", secs(300)),
            ("24h", secs(86_400)),
            ("7d", secs(7 * 86_400)),
            ("1h30m", secs(5_400)),
            ("1m30s500ms", Duration::from_millis(90_500)),
            (" 10s ", secs(10)),
            ("0s", Duration::ZERO),
        ];
        for (input, expected) in cases {
            assert_eq!(parse_duration(&text(input)), Ok(expected), "{input}");
        }
    }

    #[test]
    fn durations_reject_bad_input() {
        for input in [
            "",
            "s",
            "10",
            "10 s",
            "1.5s",
            "-5s",
            "3 parsecs",
            "10sec",
            "5M",
            "1h30",
            "99999999999999999999d",
        ] {
            let err = parse_duration(&text(input)).unwrap_err();
            assert!(err.contains(DURATION_HINT), "{input}: {err}");
        }
        let err = parse_duration(&Scalar::Int(30)).unwrap_err();
        assert_eq!(
            err,
            "invalid duration 30: a unit is required (whole numbers with a unit, e.g. 250ms, 1500ms, 30s, 5m, 24h)"
        );
        assert!(parse_duration(&Scalar::Float(1.5))
            .unwrap_err()
            .contains("unit is required"));
        assert!(parse_duration(&text("30"))
            .unwrap_err()
            .contains("unit is required"));
        assert!(parse_duration(&text("18446744073709551615d")).is_err());
        // A year and a day at most.
        assert_eq!(parse_duration(&text("366d")), Ok(secs(366 * 86_400)));
        assert_eq!(
            parse_duration(&text("367d")).unwrap_err(),
            "invalid duration \"367d\": at most 366d"
        );
    }

    /// The settings whose long values would stall every keyed request are bounded, with why.
    #[test]
    fn blocking_store_settings_are_bounded() {
        for (yaml, field, max) in [
            (
                "store: {circuit_breaker: {open_for: 11m}}",
                "store.circuit_breaker.open_for",
                "10m",
            ),
            (
                "store: {backend: redis, redis: {url: \"redis://h\", connect_timeout: 61s}}",
                "store.redis.connect_timeout",
                "1m",
            ),
            (
                "store: {backend: redis, redis: {url: \"redis://h\", response_timeout: 2m}}",
                "store.redis.response_timeout",
                "1m",
            ),
        ] {
            let err = load_err(&format!("{yaml}\n{MINIMAL}")).to_string();
            assert!(
                err.contains(field) && err.contains(&format!("must be at most {max}")),
                "{yaml}: {err}"
            );
        }
    }

    #[test]
    fn durations_format_back() {
        assert_eq!(fmt_duration(secs(5_400)), "1h30m");
        assert_eq!(fmt_duration(Duration::from_millis(22_001)), "22s1ms");
        assert_eq!(fmt_duration(secs(86_400)), "1d");
        assert_eq!(fmt_duration(Duration::ZERO), "0s");
    }

    #[test]
    fn byte_sizes_parse() {
        let cases = [
            (Scalar::Int(1_048_576), 1_048_576),
            (text("1048576"), 1_048_576),
            (text("512B"), 512),
            (text("512KiB"), 512 << 10),
            (text("256MiB"), 256 << 20),
            (text("256 MiB"), 256 << 20),
            (text("1GiB"), 1 << 30),
            (text("2KB"), 2_000),
            (text("3MB"), 3_000_000),
            (text("1GB"), 1_000_000_000),
            // The largest `queue_bytes`, as its reference writes it.
            (text("1TiB"), 1 << 40),
            (text("2TB"), 2_000_000_000_000),
        ];
        for (input, expected) in cases {
            assert_eq!(parse_byte_size(&input), Ok(expected), "{input}");
        }
    }

    #[test]
    fn byte_sizes_reject_bad_input() {
        for input in [
            text(""),
            text("MiB"),
            text("1.5MiB"),
            text("10 parsecs"),
            text("1mib"),
            text("-1"),
            text("99999999999GiB"),
            Scalar::Int(-1),
            Scalar::Float(1.0),
        ] {
            let err = parse_byte_size(&input).unwrap_err();
            assert!(err.contains(BYTES_HINT), "{input}: {err}");
        }
    }

    // === StatusSet ===

    fn status_set(entries: &[&str]) -> StatusSet {
        let entries: Vec<Scalar> = entries.iter().map(|e| text(e)).collect();
        StatusSet::from_entries("cache_statuses", &entries).unwrap()
    }

    #[test]
    fn default_status_set() {
        let set = status_set(&["2xx", "4xx"]);
        assert_eq!(set, StatusSet::default());
        for cached in [200, 201, 204, 404, 409, 422] {
            assert!(set.contains(cached), "{cached}");
        }
        for not_cached in [100, 302, 304, 408, 429, 500, 503, 0, 99, 600, 999, u16::MAX] {
            assert!(!set.contains(not_cached), "{not_cached}");
        }
    }

    #[test]
    fn transient_statuses_need_exact_entries() {
        let set = status_set(&["4xx", "429"]);
        assert!(set.contains(429));
        assert!(!set.contains(408));
        assert!(status_set(&["408"]).contains(408));
    }

    #[test]
    fn exact_beats_exclusion_beats_class() {
        let set = status_set(&["2xx", "!201", "5xx", "!503"]);
        assert!(set.contains(200));
        assert!(!set.contains(201));
        assert!(set.contains(500));
        assert!(!set.contains(503));
        let set = status_set(&["!204", "3xx", "302"]);
        assert!(!set.contains(204));
        assert!(set.contains(301));
        assert!(set.contains(302));
        assert!(status_set(&["201"]).contains(201));
        assert!(!status_set(&["201"]).contains(200));
    }

    // === match_route ===

    fn routing_config() -> Config {
        load(
            r#"
upstreams:
  a: {addrs: ["127.0.0.1:1"]}
  b: {addrs: ["127.0.0.1:2"]}
default_upstream: b
routes:
  - {name: orders, methods: [POST], path_prefix: /orders, upstream: a, idempotency: {}}
  - {name: orders-read, methods: [GET], path_prefix: /orders, upstream: b}
  - {name: pay, methods: [POST, PUT], path_prefix: /pay/, upstream: b, idempotency: {}}
  - {name: any, path_prefix: /any, upstream: a, idempotency: {}}
"#,
        )
    }

    #[test]
    fn prefix_matches_on_segment_boundaries() {
        let config = routing_config();
        assert_eq!(
            config.match_route(&Method::POST, "/orders"),
            RouteMatch::Idempotent(0)
        );
        assert_eq!(
            config.match_route(&Method::POST, "/orders/1"),
            RouteMatch::Idempotent(0)
        );
        assert_eq!(
            config.match_route(&Method::POST, "/ordersx"),
            RouteMatch::Forward {
                route: None,
                upstream: 1
            }
        );
        // A prefix ending in '/' matches only paths below it.
        assert_eq!(
            config.match_route(&Method::POST, "/pay/x"),
            RouteMatch::Idempotent(2)
        );
        assert_eq!(
            config.match_route(&Method::POST, "/pay/"),
            RouteMatch::Idempotent(2)
        );
        assert_eq!(
            config.match_route(&Method::POST, "/pay"),
            RouteMatch::Forward {
                route: None,
                upstream: 1
            }
        );
        assert!(prefix_matches("/", "/anything"));
        assert!(!prefix_matches("/orders", "/order"));
    }

    #[test]
    fn first_route_matching_method_wins() {
        let config = routing_config();
        assert_eq!(
            config.match_route(&Method::GET, "/orders/1"),
            RouteMatch::Forward {
                route: Some(1),
                upstream: 1
            }
        );
        assert_eq!(
            config.match_route(&Method::PUT, "/pay/1"),
            RouteMatch::Idempotent(2)
        );
        // An empty methods list takes every method, extension methods included.
        let purge = Method::from_bytes(b"PURGE").unwrap();
        assert_eq!(
            config.match_route(&purge, "/any"),
            RouteMatch::Idempotent(3)
        );
    }

    #[test]
    fn unlisted_method_forwards_to_the_first_prefix_match() {
        let config = routing_config();
        assert_eq!(
            config.match_route(&Method::DELETE, "/orders/1"),
            RouteMatch::Forward {
                route: Some(0),
                upstream: 0
            }
        );
        assert_eq!(
            config.match_route(&Method::GET, "/pay/1"),
            RouteMatch::Forward {
                route: Some(2),
                upstream: 1
            }
        );
    }

    #[test]
    fn unmatched_goes_to_default_upstream_or_nowhere() {
        let config = routing_config();
        assert_eq!(
            config.match_route(&Method::POST, "/elsewhere"),
            RouteMatch::Forward {
                route: None,
                upstream: 1
            }
        );
        let mut no_default = config.clone();
        no_default.default_upstream = None;
        assert_eq!(
            no_default.match_route(&Method::POST, "/elsewhere"),
            RouteMatch::NoRoute
        );
        assert_eq!(
            no_default.match_route(&Method::POST, ""),
            RouteMatch::NoRoute
        );
    }

    #[test]
    fn route_paths_are_normalised_like_backends_do() {
        for (raw, normal) in [
            // Merged slashes.
            ("//orders", "/orders"),
            ("/orders//1", "/orders/1"),
            ("///", "/"),
            ("/pay//", "/pay/"),
            // Dot-segments (RFC 3986 §5.2.4), never above the root.
            ("/x/../orders", "/orders"),
            ("/./orders", "/orders"),
            ("/orders/.", "/orders/"),
            ("/orders/1/..", "/orders/"),
            ("/a/b/../../orders/./1", "/orders/1"),
            ("/../../orders", "/orders"),
            ("/..", "/"),
            ("/.", "/"),
            ("/a//..", "/"),
            // Escaped unreserved characters, hex in either case.
            ("/%6Frders", "/orders"),
            ("/%6frders", "/orders"),
            ("/%4F%52%44%45%52%53", "/ORDERS"),
            ("/%7Euser/%2d%5F", "/~user/-_"),
            // ...including escaped dot-segments.
            ("/x/%2E%2E/orders", "/orders"),
            ("/x/%2e%2e/orders", "/orders"),
            ("/x/.%2E/orders", "/orders"),
            ("/%2E/orders", "/orders"),
            // Other escapes stay encoded, upper-cased; a broken escape stays as it is.
            ("/a%2fb", "/a%2Fb"),
            ("/orders%2F..%2Fx", "/orders%2F..%2Fx"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/100%", "/100%"),
            ("/%zz/%4", "/%zz/%4"),
            ("/%%6Frders", "/%orders"),
            ("/%3B/orders", "/%3B/orders"),
            // Path parameters dropped from every segment, before dot-segments are resolved.
            ("/orders;v=1", "/orders"),
            ("/orders;v=1/2;x", "/orders/2"),
            ("/x/..;/orders", "/orders"),
            ("/x/.;a=b/orders", "/x/orders"),
            ("/;jsessionid=1/orders", "/orders"),
            ("/orders;", "/orders"),
            // Non-ASCII text passes through.
            ("/caf\u{e9}//x", "/caf\u{e9}/x"),
        ] {
            assert_eq!(route_path(raw), normal, "{raw}");
            // Normalising twice changes nothing.
            assert_eq!(route_path(normal), normal, "{raw} -> {normal}");
        }
    }

    #[test]
    fn ordinary_route_paths_are_borrowed_not_copied() {
        for path in [
            "/",
            "/orders",
            "/orders/1",
            "/pay/",
            "/a.b/c..d",
            "/~x-y_z",
            "/Orders",
        ] {
            assert!(matches!(route_path(path), Cow::Borrowed(_)), "{path}");
        }
        // Not origin-form: nothing to normalise, and no prefix matches it.
        for path in ["", "*", "orders/../x"] {
            assert!(
                matches!(route_path(path), Cow::Borrowed(p) if p == path),
                "{path}"
            );
        }
        // Only a path that might change is copied.
        assert!(matches!(route_path("/.well-known/x"), Cow::Owned(p) if p == "/.well-known/x"));
    }

    #[test]
    fn a_carve_out_for_an_escaped_separator_keeps_its_spelling() {
        let config = load(
            r#"
upstreams:
  a: {addrs: ["127.0.0.1:1"]}
routes:
  - {name: literal, path_prefix: "/a%2Fb", upstream: a}
  - {name: keyed, methods: [POST], path_prefix: /a, upstream: a, idempotency: {}}
"#,
        );
        assert_eq!(
            config.match_route(&Method::POST, "/a%2Fb"),
            RouteMatch::Forward {
                route: Some(0),
                upstream: 0
            },
            "the operator's route for that spelling"
        );
        assert_eq!(
            config.match_route(&Method::POST, "/a%2Fc"),
            RouteMatch::Idempotent(1),
            "any other escaped separator still fails closed"
        );
    }

    #[test]
    fn bypass_spellings_match_the_idempotent_route() {
        let config = routing_config();
        for path in [
            "/x/../orders",
            "//orders",
            "/%6Frders",
            "/%6frders/1",
            "/orders;v=1",
            "/./orders",
            "/orders/./1",
            "/orders/1/%2e%2E/.",
            "/x/%2E%2E/orders",
            "/x/..;/orders",
            "/pay/../orders",
        ] {
            assert_eq!(
                config.match_route(&Method::POST, path),
                RouteMatch::Idempotent(0),
                "{path}"
            );
        }
        // `/pay/` matches only below it, in any spelling.
        assert_eq!(
            config.match_route(&Method::PUT, "/pay//1"),
            RouteMatch::Idempotent(2)
        );
        assert_eq!(
            config.match_route(&Method::PUT, "/pay/x/.."),
            RouteMatch::Idempotent(2)
        );
        let elsewhere = RouteMatch::Forward {
            route: None,
            upstream: 1,
        };
        for path in ["/pay;x", "/pay/..", "/orders/../elsewhere", "/ordersx;/"] {
            assert_eq!(config.match_route(&Method::PUT, path), elsewhere, "{path}");
        }
        // Case is not folded: distinct routes must not collide.
        assert_eq!(config.match_route(&Method::POST, "/Orders"), elsewhere);
        assert_eq!(config.match_route(&Method::POST, "/%4Frders"), elsewhere);
        // Fail closed: a backend may decode an escaped slash (or backslash) into a separator,
        // and route a format suffix to the resource it suffixes.
        for path in [
            "/orders%2F1",
            "/orders%2f",
            "/%2Forders",
            "/x%2F..%2Forders",
            "/orders%5C1",
            "/orders.json",
            "/orders.",
            "/%6Frders.xml",
            "/orders%2F1.json",
            // A format suffix with a trailing slash, however spelt.
            "/orders.json/",
            "/orders.json//",
            "/orders.json/.",
            "/orders.json/./",
            "/orders%2Ejson/",
            "/orders.json%2F",
            "/orders.json%2f",
            // A network-path reference: `x` the authority, `/orders` the path (WHATWG URL,
            // Python's urlsplit), with a backslash, a port, a suffix or an escaped slash too.
            "//x/orders",
            "//127.0.0.1:8080/orders",
            "//x//orders",
            "///x/orders",
            "/\\x/orders",
            "\\\\x/orders/1",
            "//x/orders.json",
            "//x%2Forders",
            // WHATWG reads a backslash as a slash in the path too.
            "//x\\orders",
            "/\\x\\orders",
            "//x\\orders.json",
        ] {
            assert_eq!(
                config.match_route(&Method::POST, path),
                RouteMatch::Idempotent(0),
                "{path}"
            );
        }
        // Neither reading reaches it: a suffix is the last segment's, and an escaped slash
        // that would climb out stays out; a network-path reference's authority is not a path.
        for path in [
            "/orders.json/x",
            "/orders.json/x/",
            "//x/other",
            "//x",
            "/orders.v2-x",
            "/ordersx%2F",
            "/orders%2F..%2Fx",
            "/%2Fpay",
        ] {
            assert_eq!(config.match_route(&Method::POST, path), elsewhere, "{path}");
        }
        // Only an idempotent route takes a format suffix, and only for a method it lists:
        // other traffic keeps its route and upstream.
        assert_eq!(config.match_route(&Method::GET, "/orders.csv"), elsewhere);
        assert_eq!(
            config.match_route(&Method::GET, "/orders/1.csv"),
            RouteMatch::Forward {
                route: Some(1),
                upstream: 1
            }
        );
        // An idempotent route matched as written wins over the decoded reading.
        assert_eq!(
            config.match_route(&Method::PUT, "/pay/%2Forders"),
            RouteMatch::Idempotent(2)
        );
    }

    #[test]
    fn path_prefixes_must_be_in_route_path_form() {
        let base = "upstreams: {a: {addrs: [\"127.0.0.1:1\"]}}\nroutes:\n";
        for (prefix, normal) in [
            ("//orders", "/orders"),
            ("/x/../orders", "/orders"),
            ("/orders/.", "/orders/"),
            ("/%6Frders", "/orders"),
            ("/orders;v=1", "/orders"),
            ("/caf%c3%a9", "/caf%C3%A9"),
        ] {
            let message = assert_field(
                &format!("{base}  - {{name: r, path_prefix: \"{prefix}\", upstream: a}}\n"),
                "routes[0].path_prefix",
            );
            assert!(message.contains(&format!("write {normal:?}")), "{message}");
        }
        for prefix in ["/", "/orders/", "/caf%C3%A9", "/.well-known/x", "/a%2Fb"] {
            load(&format!(
                "{base}  - {{name: r, path_prefix: \"{prefix}\", upstream: a}}\n"
            ));
        }
    }

    #[test]
    fn shutdown_budgets_are_whole_seconds() {
        let shutdown = |block: &str| format!("shutdown: {{{block}}}\n{MINIMAL}");
        for (block, field, needle) in [
            (
                "grace_period: 500ms",
                "shutdown.grace_period",
                "cut it to 0s",
            ),
            (
                "grace_period: 1500ms",
                "shutdown.grace_period",
                "cut it to 1s",
            ),
            ("grace_period: 0s", "shutdown.grace_period", "at least 1s"),
            (
                "graceful_shutdown_timeout: 500ms",
                "shutdown.graceful_shutdown_timeout",
                "cut it to 0s",
            ),
            (
                "graceful_shutdown_timeout: 2s250ms",
                "shutdown.graceful_shutdown_timeout",
                "cut it to 2s",
            ),
            (
                "grace_period: 20",
                "shutdown.grace_period",
                "unit is required",
            ),
        ] {
            let message = assert_field(&shutdown(block), field);
            assert!(message.contains(needle), "{block}: {message}");
        }
        let config = load(&shutdown("grace_period: 1m, graceful_shutdown_timeout: 0s"));
        assert_eq!(
            config.shutdown,
            ShutdownConfig {
                grace_period: Duration::from_secs(60),
                graceful_shutdown_timeout: Duration::ZERO,
            }
        );
        let config = load(&shutdown(
            "grace_period: 1000ms, graceful_shutdown_timeout: 1s",
        ));
        assert_eq!(config.shutdown.grace_period, Duration::from_secs(1));
    }

    #[test]
    fn bloom_filter_size_is_bounded() {
        let cache = |block: &str| format!("store: {{local_cache: {{{block}}}}}\n{MINIMAL}");
        for block in [
            "expected_items: 1000000000, false_positive_rate: 0.000001",
            "expected_items: 1000000000, false_positive_rate: 0.01",
            "expected_items: 500000000, false_positive_rate: 0.01",
        ] {
            let message = assert_field(&cache(block), "store.local_cache.expected_items");
            assert!(
                message.contains("store.local_cache.false_positive_rate")
                    && message.contains("per generation")
                    && message.contains("at most 1.0 GiB"),
                "{block}: {message}"
            );
        }
        let message = assert_field(
            &cache("expected_items: 1000000000, false_positive_rate: 0.000001"),
            "store.local_cache.expected_items",
        );
        assert!(
            message.contains("3.3 GiB per generation, 6.7 GiB"),
            "{message}"
        );
        // Up to the bound is fine, and a disabled cache is checked all the same (enabling it
        // later must not abort the process).
        for block in [
            "expected_items: 400000000, false_positive_rate: 0.01",
            "expected_items: 140000000, false_positive_rate: 0.000001",
        ] {
            load(&cache(block));
        }
        // Rarer than one in a million is refused for its probes, whatever the size.
        assert_field(
            &cache("expected_items: 1, false_positive_rate: 1e-300"),
            "store.local_cache.false_positive_rate",
        );
        assert_field(
            &cache("enabled: false, expected_items: 1000000000, false_positive_rate: 0.001"),
            "store.local_cache.expected_items",
        );
    }

    #[test]
    fn admin_token_from_env_or_file() {
        let long = || Some("0123456789abcdef".to_owned());
        let other = || Some("fedcba9876543210-env".to_owned());
        assert_eq!(admin_token(None, None).unwrap(), None);
        assert_eq!(admin_token(None, long()).unwrap(), long());
        assert_eq!(admin_token(other(), long()).unwrap(), other());
        assert_eq!(admin_token(other(), None).unwrap(), other());
        // An empty variable is unset: it does not disable the file's token.
        assert_eq!(admin_token(Some(String::new()), long()).unwrap(), long());
        assert_eq!(admin_token(Some(String::new()), None).unwrap(), None);
        assert_eq!(admin_token(None, Some(String::new())).unwrap(), None);
        // A short token is blamed on where it came from.
        let err = admin_token(Some("short".into()), long()).unwrap_err();
        assert_eq!(err.field(), Some("IDEMGATE_ADMIN_TOKEN"));
        assert!(err.to_string().contains("overrides admin.token"), "{err}");
        let err = admin_token(None, Some("short".into())).unwrap_err();
        assert_eq!(err.field(), Some("admin.token"));
        let err = admin_token(Some(String::new()), Some("short".into())).unwrap_err();
        assert_eq!(err.field(), Some("admin.token"));
        // A token no request could present (HTTP trims header values) is refused, not echoed.
        let err = admin_token(Some("0123456789abcdef-token\n".into()), None).unwrap_err();
        assert_eq!(err.field(), Some("IDEMGATE_ADMIN_TOKEN"));
        assert!(!err.to_string().contains("0123456789abcdef"), "{err}");
        for bad in [" 0123456789abcdef", "0123456789 abcdef", "0123456789abcdéf"] {
            let err = admin_token(None, Some(bad.into())).unwrap_err();
            assert_eq!(err.field(), Some("admin.token"), "{bad:?}");
        }
        // The file path still checks the file's token.
        assert_field(
            &format!("admin: {{token: short}}\n{MINIMAL}"),
            "admin.token",
        );
    }

    #[test]
    fn config_error_field_accessor() {
        let err = invalid("routes[0].upstream", "unknown upstream");
        assert_eq!(err.field(), Some("routes[0].upstream"));
        assert_eq!(err.to_string(), "routes[0].upstream: unknown upstream");
        assert_eq!(ConfigError::Parse("bad".into()).field(), None);
    }

    #[test]
    fn a_redis_url_with_a_raw_space_or_quote_is_refused_without_echoing_it() {
        for password in [
            "Kv7correct horse battery staple",
            "Qz9it's",
            "Wp3say\"cheese\"",
            "Bx4back\\slash",
            "Tn6tab\there",
        ] {
            for scheme in ["redis", "rediss", "redis+sentinel"] {
                let url = match scheme {
                    "redis+sentinel" => format!("{scheme}://u:{password}@s1:26379/mymaster"),
                    _ => format!("{scheme}://u:{password}@h:6379/0"),
                };
                let message = check_redis_url(&url).expect_err(&url);
                assert!(message.contains("percent-encode"), "{message}");
                let secret = &password[..3];
                assert!(!message.contains(secret), "{message}");
            }
        }
        // Percent-encoded, it loads, and what is shown of it hides the password.
        let url = "redis://u:correct%20horse@h:6379/0";
        assert_eq!(check_redis_url(url), Ok(false));
        assert_eq!(redact_url(url), "redis://***@h:6379/0");
    }

    #[test]
    fn redact_url_handles_odd_input() {
        assert_eq!(redact_url("redis://host:1"), "redis://host:1");
        assert_eq!(redact_url("redis://u:p@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redact_url("no scheme"), "no scheme");
        assert_eq!(redact_url("redis://h/p@x"), "redis://h/p@x");
    }

    #[test]
    fn store_layers_validate_and_name_the_field() {
        for (yaml, field) in [
            (
                "store: {local_cache: {false_positive_rate: 0.9}}",
                "store.local_cache.false_positive_rate",
            ),
            (
                "store: {local_cache: {false_positive_rate: 0.0000001}}",
                "store.local_cache.false_positive_rate",
            ),
            (
                "store: {local_cache: {capacity: 1B}}",
                "store.local_cache.capacity",
            ),
            (
                "store: {circuit_breaker: {failure_threshold: 0}}",
                "store.circuit_breaker.failure_threshold",
            ),
            (
                "store: {circuit_breaker: {open_for: 0s}}",
                "store.circuit_breaker.open_for",
            ),
            (
                "store: {completion_retry: {attempts: 0}}",
                "store.completion_retry.attempts",
            ),
            (
                "store: {completion_retry: {base_delay: 2s, max_delay: 1s}}",
                "store.completion_retry.max_delay",
            ),
            (
                "store: {completion_retry: {base_delay: 9ms, max_delay: 9ms}}",
                "store.completion_retry.base_delay",
            ),
            (
                "store: {completion_retry: {dead_letter_path: \"\"}}",
                "store.completion_retry.dead_letter_path",
            ),
            (
                "store: {completion_retry: {queue_bytes: 1KiB}}",
                "store.completion_retry.queue_bytes",
            ),
        ] {
            let err = load_err(&format!("{yaml}\n{MINIMAL}"));
            assert_eq!(err.field(), Some(field), "{yaml}: {err}");
        }
        let config = load(&format!(
            "store: {{circuit_breaker: {{failure_threshold: 5, open_for: 250ms}}, completion_retry: {{dead_letter_path: /var/lib/idemgate/dead.jsonl}}}}\n{MINIMAL}"
        ));
        assert_eq!(config.store.circuit_breaker.failure_threshold, 5);
        assert_eq!(
            config.store.circuit_breaker.open_for,
            Duration::from_millis(250)
        );
        assert_eq!(
            config.store.completion_retry.dead_letter_path,
            std::path::PathBuf::from("/var/lib/idemgate/dead.jsonl")
        );
    }

    #[test]
    fn redis_scripts_default_to_the_builtin_v1_without_canary() {
        let config = load(&format!("store: {{backend: redis}}\n{MINIMAL}"));
        let scripts = config.store.redis.unwrap().scripts;
        assert_eq!(scripts, ScriptsConfig::default());
        assert_eq!(scripts.version, "v1");
        assert_eq!(scripts.dir, None);
        assert_eq!(scripts.canary, None);
    }

    #[test]
    fn redis_scripts_canary_with_defaults_and_from_a_directory() {
        let root = tempfile::tempdir().unwrap();
        let v3 = root.path().join("v3");
        std::fs::create_dir(&v3).unwrap();
        for name in crate::scripts::SCRIPT_NAMES {
            std::fs::write(v3.join(format!("{name}.lua")), "return 1").unwrap();
        }
        let dir = root.path().display();
        let config = load(&format!(
            "store:\n  redis:\n    scripts:\n      dir: \"{dir}\"\n      version: v2\n      \
             canary: {{version: v3, percent: 10, tenants: [b, a, b]}}\n{MINIMAL}"
        ));
        let scripts = config.store.redis.unwrap().scripts;
        assert_eq!(scripts.dir.as_deref(), Some(root.path()));
        assert_eq!(scripts.version, "v2", "built in, not on disk: still found");
        assert_eq!(
            scripts.canary,
            Some(CanaryConfig {
                version: "v3".into(),
                percent: 10,
                tenants: vec!["a".into(), "b".into()],
                max_error_rate: 0.05,
                min_calls: 20,
                window: Duration::from_secs(60),
            })
        );
        let full = load(&format!(
            "store:\n  redis:\n    scripts:\n      canary: {{version: v2, percent: 100, \
             max_error_rate: 0.5, min_calls: 3, window: 5s}}\n{MINIMAL}"
        ));
        let canary = full.store.redis.unwrap().scripts.canary.unwrap();
        assert_eq!(
            (
                canary.percent,
                canary.max_error_rate,
                canary.min_calls,
                canary.window
            ),
            (100, 0.5, 3, Duration::from_secs(5))
        );
    }

    #[test]
    fn redis_scripts_errors_name_the_field() {
        let scripts = |block: &str| format!("store:\n  redis:\n    scripts: {block}\n{MINIMAL}");
        let message = assert_field(
            &scripts("{canary: {version: v9, percent: 10}}"),
            "store.redis.scripts.canary.version",
        );
        assert!(
            message.contains("v9") && message.contains("known: v1, v2"),
            "{message}"
        );
        assert_field(&scripts("{version: v7}"), "store.redis.scripts.version");
        assert_field(&scripts("{version: ../etc}"), "store.redis.scripts.version");
        assert_field(
            &scripts("{canary: {version: v1, percent: 10}}"),
            "store.redis.scripts.canary.version",
        );
        assert_field(
            &scripts("{canary: {version: v2, percent: 101}}"),
            "store.redis.scripts.canary.percent",
        );
        assert_field(
            &scripts("{canary: {version: v2, percent: -1}}"),
            "store.redis.scripts.canary.percent",
        );
        assert_field(
            &scripts("{canary: {version: v2, percent: 5, tenants: [\"a b\"]}}"),
            "store.redis.scripts.canary.tenants[0]",
        );
        assert_field(
            &scripts("{canary: {version: v2, percent: 5, max_error_rate: 1.5}}"),
            "store.redis.scripts.canary.max_error_rate",
        );
        assert_field(
            &scripts("{canary: {version: v2, percent: 5, min_calls: 0}}"),
            "store.redis.scripts.canary.min_calls",
        );
        assert_field(
            &scripts("{canary: {version: v2, percent: 5, window: 0s}}"),
            "store.redis.scripts.canary.window",
        );
        assert_field(&scripts("{dir: \"\"}"), "store.redis.scripts.dir");
        assert_field(
            &scripts("{dir: /nonexistent/idemgate/lua}"),
            "store.redis.scripts.dir",
        );
        // A version directory missing a script is refused, not half built in.
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("v2")).unwrap();
        let message = assert_field(
            &scripts(&format!(
                "{{dir: \"{}\", version: v2}}",
                root.path().display()
            )),
            "store.redis.scripts.version",
        );
        assert!(message.contains("claim.lua"), "{message}");
        // Missing required canary keys and unknown keys are parse errors naming the key.
        for (block, needle) in [
            ("{canary: {percent: 5}}", "version"),
            ("{canary: {version: v2}}", "percent"),
            (
                "{canary: {version: v2, percent: 5, percentage: 5}}",
                "percentage",
            ),
            ("{versions: v1}", "versions"),
        ] {
            let message = load_err(&scripts(block)).to_string();
            assert!(message.contains(needle), "{block}: {message}");
        }
    }
}
