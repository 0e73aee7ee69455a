//! The Redis record store: each record is one hash driven by versioned Lua scripts (`lua/v1/`,
//! `lua/v2/`, or a directory; see [`crate::scripts`]), one round trip per phase, on a single
//! server, a Redis Cluster or a Sentinel-managed primary.
//!
//! Keys are `<prefix>:{<tenant>:<hex hash>}`: the braces are the Cluster hash tag, and as every
//! script touches exactly one key (passed in `KEYS`) no call can ever be CROSSSLOT. The raw
//! idempotency key never reaches Redis, only its scoped SHA-256. Record fields are listed in
//! `lua/v1/claim.lua`.
//!
//! Scripts are called with EVALSHA by the SHA of their [`redis::Script`]; a NOSCRIPT (restart,
//! failover, `SCRIPT FLUSH`) loads the script and sends the call again. On a cluster only the
//! primary that owns the key's slot is asked to load it: redis-rs's own recovery sends
//! `SCRIPT LOAD` to every node and fails unless all answer. Lock lapse is decided
//! by the Redis server's clock (`TIME` inside the scripts), so proxies with skewed clocks agree.
//! That clock is a wall clock: stepped back (NTP, a failover to a replica whose clock is behind)
//! a held lock would show more left than any lock is taken for, so a claim's answer caps it at
//! the claim's `lock_ttl` (it becomes the 409's `Retry-After`); stepped forward, a lock lapses
//! early by the step. Keep the Redis servers' clocks disciplined, as for any TTL.
//!
//! Failure handling: every operation is bounded by `connect_timeout + 2 × response_timeout`
//! and then fails as [`StoreError::Unavailable`]. An operation whose connection turns out to be
//! dead (Redis restarted, failed over) is sent once more on a fresh connection; one that went
//! silent (no answer to anything since a call that timed out went out) is dropped, so the next
//! call makes another (see [`Held`]). That re-send is
//! safe even when the first send did reach Redis: a claim by the same owner re-acquires, and
//! complete/release carry a write id the scripts remember (a complete's one per owner and
//! answer, the same for every send of it, the retry queue's too: see [`completion_id`]; a
//! release's random per call), so a repeated write answers "applied" instead of "not owner".
//!
//! Script versions and the canary ([`script_set`](super::script_set)): each record runs the
//! active version or, chosen by its hash, the canary. A canary call that Redis answers with an
//! error, or with a reply its caller cannot read, is sent once more, with the same arguments, on
//! the active version, so no client sees a broken canary; it is counted against the canary only
//! if that second send succeeds (a canary's bug may surface as any error reply, `WRONGTYPE`
//! from a command it misuses as well as a Lua error). That is safe for the
//! same reason as the re-send above, and more: Redis does not undo what a script wrote before
//! it failed, but both versions read and write one record layout, a claim repeated by the same
//! owner re-acquires with the record's execution id, and a complete/release repeated with the
//! same write id answers "applied" (once the state it was written with is there). A record or a
//! server state that fails both versions is not counted; failures with no answer (connection,
//! timeout) are neither sent again nor counted. When the canary's error rate over its window passes
//! `max_error_rate` (with at least `min_calls` calls), it is rolled back: every record uses the
//! active version until the canary's settings or text change.
//!
//! [`RedisStore::apply_scripts`] swaps in other versions live: new text is sent with SCRIPT
//! LOAD (to every primary of a cluster, the first answer deciding; one that missed it loads it on
//! its first NOSCRIPT) and its SHA checked before the swap; text Redis refuses
//! (a syntax error) keeps the running scripts.
//!
//! Connections are made on first use, not at construction, so the proxy starts while Redis is
//! down; [`RedisStore::connect`] warms them up (and loads the scripts) when called.
//!
//! TLS (`rediss://`, `rediss+sentinel://`) always verifies the server's certificate and name;
//! `store.redis.tls` replaces the trusted roots with a private CA and adds a client certificate,
//! for every connection of every topology (and the purge channel, via [`single_client`]).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, Slot,
    SlotAddr,
};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    ClientTlsConfig, Cmd, ConnectionAddr, ErrorKind, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, TlsCertificates, TlsMode, Value,
};
use tokio::time::Instant;

use super::eviction;
use super::restarts::{self, Restarts};
pub use super::script_set::{
    AvailableVersion, CanaryStatus, Scripts, ScriptsStatus, VersionStats, VersionStatus,
};
use super::script_set::{Canary, ScriptOp, ScriptSet, StatsRegistry, Version};
use super::{
    codec, ClaimOutcome, ClaimRequest, Completion, Deletion, Digest, OwnerToken, Record, RecordKey,
    RecordState, RecordStore, StoreError, WriteOutcome,
};
use crate::config::{
    parse_sentinel_url, redact_url, RedisConfig, RedisTlsConfig, RedisTopology, ScriptsConfig,
};
use crate::key;
use crate::scripts::{self, SourceError, Sources};
use crate::upstream::itoa;

/// Version name of [`Scripts::builtin`], the default active version.
pub const BUILTIN_SCRIPTS_VERSION: &str = "v1";

/// First pause of `wait_for_change`'s polling; it doubles up to [`POLL_MAX`].
const POLL_START: Duration = Duration::from_millis(5);
/// Longest pause between two polls of `wait_for_change`.
const POLL_MAX: Duration = Duration::from_millis(100);
/// Durations sent to the scripts are capped here: Lua numbers are doubles, and a century is
/// more than any record needs.
const MAX_TTL_MS: u128 = 100 * 365 * 24 * 3600 * 1000;

/// The least and the most a Redis Cluster call waits before a retry that follows a pause,
/// milliseconds: redis-rs draws it from the least up to 10 × 2^retry (20, then 40 for the
/// two retries a call gets), capped at the most.
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (10, 40);
/// Reconnect attempts the connection manager makes per connection; the operation deadline
/// bounds the waiting anyway, and the next operation starts a new round.
const RECONNECT_RETRIES: usize = 1;
/// Error codes and words that describe the server or the data, not the script, even when
/// they come back wrapped in a script error (`ERR Error running script ... -READONLY ...` on
/// older servers). Such failures hit every version alike.
const NOT_THE_SCRIPTS_FAULT: [&str; 11] = [
    "READONLY",
    "OOM",
    "WRONGTYPE",
    "LOADING",
    "BUSY",
    "NOPERM",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
    "MISCONF",
];

/// Why the Redis store could not be set up from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A URL the config validation let through was refused by the client library.
    #[error("store.redis.urls: {0}")]
    Invalid(String),
    /// A script version the config named could not be read (it vanished since validation).
    #[error("store.redis.scripts: {0}")]
    Scripts(#[from] SourceError),
    /// A `store.redis.tls` file could not be read or used (it changed since validation).
    #[error("store.redis.tls: {0}")]
    Tls(String),
}

/// Why [`RedisStore::apply_scripts`] kept the running scripts.
#[derive(Debug, thiserror::Error)]
pub enum ScriptsError {
    /// A version's text cannot be read.
    #[error("{0}")]
    Sources(#[from] SourceError),
    /// Redis refused a script (a syntax error), or loaded it under another SHA.
    #[error("{file}: Redis refused the script: {message}")]
    Refused {
        /// The file (or built-in name) of the script.
        file: String,
        /// Redis' answer.
        message: String,
    },
    /// Redis could not be asked; the change is tried again on the next attempt.
    #[error("redis unavailable while loading scripts: {0}")]
    Unavailable(String),
}

/// What [`RedisStore::apply_scripts`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptsApplied {
    /// The running scripts already match the settings and the text.
    Unchanged,
    /// The same settings and text were refused before (and reported then); nothing was tried.
    StillRefused,
    /// New scripts are in force.
    Applied {
        /// Files (or built-in names) newly loaded into Redis.
        loaded: Vec<String>,
    },
}

/// The [`RecordStore`] on Redis.
pub struct RedisStore {
    /// Swapped whole when the `store.redis.tls` files change ([`RedisStore::reload_tls`]).
    backend: ArcSwap<Backend>,
    /// What a new backend is built from.
    settings: RedisConfig,
    manager_config: ConnectionManagerConfig,
    /// The `store.redis.tls` files as the backend in force read them.
    tls_in_force: parking_lot::Mutex<Option<TlsCertificates>>,
    /// Why the last reading of changed files was refused, and whether that was reported: one
    /// bad rotation counts and logs once, and only when two readings in a row find it.
    tls_refused: parking_lot::Mutex<Option<(String, bool)>>,
    tls_reloads: AtomicU64,
    tls_reload_failures: AtomicU64,
    /// The versions in force; swapped whole.
    scripts: ArcSwap<ScriptSet>,
    /// Counters of every version that ran, by name; kept across swaps.
    version_stats: StatsRegistry,
    /// Serialises script changes (file watcher, config reload, warm-up).
    apply_lock: tokio::sync::Mutex<()>,
    /// What the last refused change was (settings and text, or the read error), so the same
    /// refusal is not tried, logged and counted again on every poll.
    refused: parking_lot::Mutex<Option<String>>,
    last_reload_error: parking_lot::Mutex<Option<String>>,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
    rollbacks: AtomicU64,
    prefix: String,
    /// Deadline of one whole operation, re-send and reconnect included.
    op_timeout: Duration,
    /// Where the readiness probe runs the get script: a key no record can have.
    ping_key: String,
    /// On a Cluster, a probe key for each part of the slot space ([`CLUSTER_PARTS`]), so the
    /// circuit breaker probes the part whose circuit is open; empty otherwise.
    part_ping_keys: Box<[String]>,
    /// What the readings of Redis's eviction setting found ([`RedisStore::check_eviction`]).
    eviction: parking_lot::Mutex<eviction::Finding>,
    /// The servers the last reading of their run ids found ([`RedisStore::check_restarts`]).
    servers: parking_lot::Mutex<Option<restarts::Servers>>,
    /// Claims whose answer never came, for [`RedisStore::release_unanswered_claims`].
    unanswered_tx: tokio::sync::mpsc::UnboundedSender<Unanswered>,
    unanswered_rx: parking_lot::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Unanswered>>>,
    /// Of those, how many are handed over and not settled yet (at most [`UNANSWERED_CAPACITY`]).
    unanswered_pending: AtomicUsize,
    unanswered_released: AtomicU64,
}

/// A claim whose answer never came (it timed out, or its connection was lost): it may still
/// reach Redis and take the key for nobody ([`RedisStore::release_unanswered_claims`]).
struct Unanswered {
    key: RecordKey,
    owner: OwnerToken,
    /// When the lock it may have taken lapses by itself at the latest: nothing to release after.
    until: tokio::time::Instant,
    /// The next try.
    due: tokio::time::Instant,
    tries: u32,
}

/// Unanswered claims waiting to be released, at most (a few claims time out before the circuit
/// opens, and an open circuit sends none). One past it is left to lapse by itself.
const UNANSWERED_CAPACITY: usize = 1024;

/// The pause before the next try to release an unanswered claim: half a second before the
/// first (a try while Redis is still stalled goes on the connection that went silent, and
/// costs it: a stall that short keeps its connection otherwise), then often for the next
/// seconds, when a stalled Redis usually comes back (and the 503's `Retry-After: 1` brings the
/// retry), then every 2 s until the lock would have lapsed: a claim that never arrives costs a
/// Redis that is slow but up about 22 calls over a 30 s lock.
fn unanswered_pause(tries: u32) -> Duration {
    match tries {
        0 => Duration::from_millis(500),
        1..10 => Duration::from_millis(250),
        _ => Duration::from_secs(2),
    }
}

/// Parts of a Cluster's slot space the circuit breaker keeps a circuit for: 64 ranges of 256
/// slots, so a primary that is down (a third of the slots in a three-primary Cluster) opens
/// the circuits of its own ranges (and of the one or two it shares with a neighbour), not the
/// whole store's.
pub const CLUSTER_PARTS: usize = 64;

/// Slots in a Redis Cluster.
const CLUSTER_SLOTS: u16 = 16384;

/// The Cluster slot of `key`, as Redis computes it: CRC16 (XMODEM) of its hash tag (what the
/// first `{` and the next `}` enclose, when that is not empty), or of the whole key.
pub fn cluster_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(key).iter().copied()) % CLUSTER_SLOTS
}

/// The Cluster slot of `key`'s record ([`record_key`]), without building the key: its hash tag
/// is `tenant:hash` in hex, since neither a key prefix nor a tenant may hold a brace.
fn record_slot(key: &RecordKey) -> u16 {
    let hex = key.hash.iter().flat_map(|&b| key::hex_pair(b));
    crc16(key.tenant.bytes().chain([b':']).chain(hex)) % CLUSTER_SLOTS
}

/// CRC16/XMODEM, the checksum Redis Cluster hashes keys with.
fn crc16(bytes: impl IntoIterator<Item = u8>) -> u16 {
    let mut crc: u16 = 0;
    for byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The part of the slot space `slot` falls in.
fn cluster_part(slot: u16) -> usize {
    usize::from(slot) / (usize::from(CLUSTER_SLOTS) / CLUSTER_PARTS)
}

/// A probe key under `prefix` in each part of the slot space, in order: keys no record can
/// have (a record's tag is `tenant:hash`, with a colon and 64 hex digits).
fn part_ping_keys(prefix: &str) -> Box<[String]> {
    let mut keys: Vec<Option<String>> = vec![None; CLUSTER_PARTS];
    let mut left = CLUSTER_PARTS;
    for n in 0u32.. {
        let key = format!("{prefix}:{{__idemgate_ping__{n}}}");
        let slot = &mut keys[cluster_part(cluster_slot(key.as_bytes()))];
        if slot.is_none() {
            *slot = Some(key);
            left -= 1;
            if left == 0 {
                break;
            }
        }
    }
    keys.into_iter().flatten().collect()
}

/// How connections are obtained, per topology. Each connects on first use and keeps itself
/// connected afterwards (the Sentinel one re-resolves the primary when it fails).
enum Backend {
    Single {
        client: redis::Client,
        config: ConnectionManagerConfig,
        conn: PerRuntime,
    },
    Cluster {
        client: ClusterClient,
        conn: PerRuntime,
    },
    Sentinel(Arc<SentinelBackend>),
}

/// TCP settings of every Redis connection. redis-rs leaves Nagle's algorithm on; with many small
/// pipelined commands on one connection that met delayed ACKs and stalled calls for ~40 ms
/// (seen as the keyed-miss benchmark's p99).
///
/// Keepalive probes after 10 s of silence (every 5 s, 3 unanswered end it) and a 20 s limit on
/// unacknowledged data: a connection that a NAT, a load balancer or a vanished host dropped
/// without a reset is found dead within about 25 s. The purge channel only ever reads, so
/// without them its connection could wait for good, and purges from other replicas would be
/// missed for as long as the process lives.
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::socket2::TcpKeepalive;
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
        .set_user_timeout(Duration::from_secs(20))
}

/// A client for one server (`redis://` or `rediss://`), with the `store.redis.tls` certificates
/// when given. Shared by the store and the purge channel, so both trust the same CA.
pub fn single_client(
    url: &str,
    certs: Option<&TlsCertificates>,
) -> Result<redis::Client, SetupError> {
    let refused = |err: RedisError| SetupError::Invalid(format!("{}: {err}", redact_url(url)));
    let info = redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(refused)?
        .set_tcp_settings(tcp_settings());
    match certs {
        Some(certs) => redis::Client::build_with_tls(info, certs.clone()).map_err(refused),
        None => redis::Client::open(info).map_err(refused),
    }
}

/// A Sentinel client for `redis+sentinel://` / `rediss+sentinel://` URLs: every URL's Sentinels,
/// the primary named by the first. It looks the primary up on each `async_get_client`, so a
/// caller that asks again after a failover reaches the new one. Shared by the store and the
/// purge channel.
pub fn sentinel_client(
    urls: &[String],
    certs: Option<&TlsCertificates>,
) -> Result<SentinelClient, SetupError> {
    let mut sentinels = Vec::new();
    let mut primary = None;
    for url in urls {
        let parsed = parse_sentinel_url(url).map_err(SetupError::Invalid)?;
        sentinels.extend(parsed.sentinels.iter().map(|(host, port)| {
            if parsed.tls {
                ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port: *port,
                    insecure: false,
                    tls_params: None,
                }
            } else {
                ConnectionAddr::Tcp(host.clone(), *port)
            }
        }));
        primary.get_or_insert(parsed);
    }
    let primary = primary.ok_or_else(|| SetupError::Invalid("no Sentinel URL".into()))?;
    let mut builder = SentinelClientBuilder::new(
        sentinels,
        primary.master.clone(),
        SentinelServerType::Master,
    )
    .map_err(|e| SetupError::Invalid(e.to_string()))?
    .set_client_to_redis_db(primary.db)
    .set_client_to_redis_tcp_settings(tcp_settings())
    .set_client_to_sentinel_tcp_settings(tcp_settings());
    if let Some(user) = &primary.username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = &primary.password {
        builder = builder.set_client_to_redis_password(password);
    }
    // rediss+sentinel://: the Sentinels and the primary they name are both reached over
    // verified TLS (the config refuses `tls` settings with a plain Sentinel URL).
    if primary.tls {
        builder = builder
            .set_client_to_redis_tls_mode(TlsMode::Secure)
            .set_client_to_sentinel_tls_mode(TlsMode::Secure);
        if let Some(certs) = certs {
            builder = builder
                .set_client_to_redis_certificates(certs.clone())
                .set_client_to_sentinel_certificates(certs.clone());
        }
    }
    builder
        .build()
        .map_err(|e| SetupError::Invalid(e.to_string()))
}

/// The connections of one topology, made lazily, trusting `certs` (for `rediss://`).
fn build_backend(
    config: &RedisConfig,
    manager_config: &ConnectionManagerConfig,
    op_timeout: Duration,
    certs: Option<&TlsCertificates>,
) -> Result<Backend, SetupError> {
    Ok(match config.topology {
        RedisTopology::Single => {
            let url = config.urls.first().map(String::as_str).unwrap_or_default();
            Backend::Single {
                client: single_client(url, certs)?,
                config: manager_config.clone(),
                conn: PerRuntime::default(),
            }
        }
        RedisTopology::Cluster => {
            let mut builder = ClusterClientBuilder::new(config.urls.iter().map(String::as_str))
                .connection_timeout(config.connect_timeout)
                .response_timeout(config.response_timeout)
                .overall_response_timeout(Some(op_timeout))
                .retries(2)
                // redis-rs waits at least 1.28 s before a retry that follows a pause (a
                // node that cannot be reached, CLUSTERDOWN, TRYAGAIN), longer than a whole
                // operation may take: every call for a dead primary's slots waited out its
                // deadline, and its part's circuit took three of them to open. A few tens of
                // milliseconds let a redirect or a refreshed slot map settle.
                .min_retry_wait(CLUSTER_RETRY_WAIT_MS.0)
                .max_retry_wait(CLUSTER_RETRY_WAIT_MS.1)
                .tcp_settings(tcp_settings());
            // The config let `tls` through only with rediss:// seeds, so this never turns
            // TLS on for plain URLs; the nodes the cluster announces get the same settings.
            if let Some(certs) = certs {
                builder = builder.certs(certs.clone());
            }
            let client = builder
                .build()
                .map_err(|e| SetupError::Invalid(e.to_string()))?;
            Backend::Cluster {
                client,
                conn: PerRuntime::default(),
            }
        }
        RedisTopology::Sentinel => Backend::Sentinel(Arc::new(SentinelBackend::new(
            &config.urls,
            manager_config.clone(),
            certs,
        )?)),
    })
}

/// Reads the `store.redis.tls` files. The config checked them at load; reading again here
/// reports a file that vanished since by its field. Errors name files, never their contents.
fn load_certificates(tls: &RedisTlsConfig) -> Result<TlsCertificates, SetupError> {
    let certs = read_tls_files(tls)?;
    check_certificates(tls, &certs)?;
    Ok(certs)
}

/// The `store.redis.tls` files as they are now, unchecked.
fn read_tls_files(tls: &RedisTlsConfig) -> Result<TlsCertificates, SetupError> {
    let read = |field: &str, path: &std::path::Path| {
        crate::config::read_bounded(path)
            .map_err(|e| SetupError::Tls(format!("{field}: cannot read {}: {e}", path.display())))
    };
    let root_cert = tls
        .ca_file
        .as_deref()
        .map(|path| read("ca_file", path))
        .transpose()?;
    let client_tls = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: read("cert_file", cert)?,
            client_key: read("key_file", key)?,
        }),
        _ => None,
    };
    Ok(TlsCertificates {
        client_tls,
        root_cert,
    })
}

/// The config loader's checks on files read again (one caught half-written, or replaced by
/// something else, is refused rather than leave the connections with no trusted root), then a
/// parse by redis-rs (a throwaway client), so a bad file fails here and not on every connection.
fn check_certificates(tls: &RedisTlsConfig, certs: &TlsCertificates) -> Result<(), SetupError> {
    let client = certs.client_tls.as_ref();
    tls.check_contents(
        certs.root_cert.as_deref(),
        client.map(|c| &c.client_cert[..]),
        client.map(|c| &c.client_key[..]),
    )
    .map_err(|(field, why)| SetupError::Tls(format!("{field}: {why}")))?;
    redis::Client::build_with_tls("rediss://localhost", certs.clone())
        .map_err(|e| SetupError::Tls(e.to_string()))?;
    Ok(())
}

/// Whether two readings of the `store.redis.tls` files found the same bytes.
fn same_certificates(a: &TlsCertificates, b: &TlsCertificates) -> bool {
    fn client(c: &TlsCertificates) -> Option<(&[u8], &[u8])> {
        c.client_tls
            .as_ref()
            .map(|t| (&t.client_cert[..], &t.client_key[..]))
    }
    a.root_cert == b.root_cert && client(a) == client(b)
}

/// One connection per tokio runtime. A multiplexed connection is driven by a task on the
/// runtime that created it, so a connection shared across pingora's runtimes (each service and,
/// without work stealing, each proxy thread has its own) made every call wake another thread:
/// measured at a fifth of a core on the keyed-miss benchmark. The runtimes are few and fixed.
#[derive(Default)]
struct PerRuntime {
    cells: parking_lot::Mutex<Vec<(Option<tokio::runtime::Id>, Arc<RuntimeSlot>)>>,
}

/// The connection of one runtime: made on first use, dropped when found dead
/// ([`Held::silent_since`]) so the next call makes another.
#[derive(Default)]
struct RuntimeSlot {
    held: parking_lot::Mutex<Option<Arc<Held>>>,
    /// Held while connecting: concurrent first calls share one attempt.
    connecting: tokio::sync::Mutex<()>,
}

/// A connection in use, and when it last answered anything.
///
/// A connection can die without a word: a NAT or load balancer drops the flow, or a proxy on
/// the way (a service mesh sidecar, say) keeps acknowledging what is sent and never answers.
/// redis-rs reconnects after an I/O error, but a response timeout is no I/O error to it, so
/// every later call would go out on the dead connection and time out in turn. A call that timed
/// out on a connection that answered nothing at all since that call went out, nor for a whole
/// operation's deadline (`connect_timeout + 2 × response_timeout`), drops it
/// ([`Backend::on_error`]): a server that is merely slow goes on answering other calls, and a
/// short stall (a fork for a snapshot, a slow command) ends before the deadline, so neither
/// costs every runtime a reconnect at once; of the many calls a dead one fails, only the first
/// drops it.
struct Held {
    conn: Conn,
    /// Nanoseconds from [`clock_base`] to the last answer (any reply, an error reply too).
    answered: AtomicU64,
}

impl Held {
    fn new(conn: Conn) -> Arc<Held> {
        Arc::new(Held {
            conn,
            answered: AtomicU64::new(since_base(Instant::now())),
        })
    }

    /// Notes that the server answered now.
    fn answered(&self) {
        self.answered
            .fetch_max(since_base(Instant::now()), Ordering::Relaxed);
    }

    /// Whether nothing came back on this connection since `sent`, nor for `quiet` up to now.
    fn silent_since(&self, sent: Instant, quiet: Duration) -> bool {
        let answered = self.answered.load(Ordering::Relaxed);
        let quiet = u64::try_from(quiet.as_nanos()).unwrap_or(u64::MAX);
        answered < since_base(sent) && since_base(Instant::now()).saturating_sub(answered) >= quiet
    }
}

/// What [`Held`] counts its answers from.
fn clock_base() -> Instant {
    static BASE: LazyLock<Instant> = LazyLock::new(Instant::now);
    *BASE
}

/// Nanoseconds from [`clock_base`] to `at` (0 before it).
fn since_base(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(clock_base()).as_nanos()).unwrap_or(u64::MAX)
}

impl PerRuntime {
    /// The slot of the calling runtime.
    fn current(&self) -> Arc<RuntimeSlot> {
        let id = tokio::runtime::Handle::try_current().ok().map(|h| h.id());
        let mut cells = self.cells.lock();
        if let Some((_, slot)) = cells.iter().find(|(i, _)| *i == id) {
            return slot.clone();
        }
        let slot = Arc::new(RuntimeSlot::default());
        cells.push((id, slot.clone()));
        slot
    }
}

impl RuntimeSlot {
    /// The connection, made with `connect` if there is none.
    async fn get<F, Fut>(&self, connect: F) -> RedisResult<Arc<Held>>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = RedisResult<Conn>>,
    {
        if let Some(held) = self.held.lock().clone() {
            return Ok(held);
        }
        let _one = self.connecting.lock().await;
        if let Some(held) = self.held.lock().clone() {
            return Ok(held);
        }
        let held = Held::new(connect().await?);
        *self.held.lock() = Some(held.clone());
        Ok(held)
    }

    /// Drops `held` if it is still this slot's connection.
    fn drop_if_current(&self, held: &Arc<Held>) -> bool {
        take_if_current(&self.held, held)
    }
}

/// Empties `slot` if it still holds `held` (not a connection made since); returns whether.
fn take_if_current(slot: &parking_lot::Mutex<Option<Arc<Held>>>, held: &Arc<Held>) -> bool {
    let mut current = slot.lock();
    let same = current.as_ref().is_some_and(|c| Arc::ptr_eq(c, held));
    if same {
        *current = None;
    }
    same
}

/// A primary found through Sentinel, kept until it fails, then looked up again.
struct SentinelBackend {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    config: ConnectionManagerConfig,
    current: parking_lot::Mutex<Option<Arc<Held>>>,
}

/// A connection handle for one call: cheap to clone, shared with other calls.
#[derive(Clone)]
enum Conn {
    Manager(ConnectionManager),
    Cluster(ClusterConnection),
}

/// What one operation sends.
enum Call<'a> {
    /// EVALSHA of a script on one key; on NOSCRIPT, its text is loaded and the call sent again.
    Script {
        evalsha: Cmd,
        text: &'a str,
        key: &'a str,
    },
    Command(&'a Cmd),
}

/// A failed call: the error for the caller, and whether the script itself is to blame.
struct Failure {
    error: StoreError,
    script_fault: bool,
    /// The server answered (an error reply, or a reply that could not be read), as opposed to
    /// no answer at all (connection lost, timed out): the same call may fare otherwise on
    /// another script version.
    answered: bool,
    /// The ACL user may not run the call (`NOPERM`).
    denied: bool,
}

// === impl RedisStore ===

impl RedisStore {
    /// A store for validated settings, running the script versions `config.scripts` names.
    /// Connects nothing: the first operation (or [`RedisStore::connect`]) does, so this
    /// succeeds while Redis is down.
    pub fn new(config: &RedisConfig) -> Result<Self, SetupError> {
        // redis-rs builds rustls without choosing a crypto provider; `rediss://` needs one.
        // An error only means another part of the process installed one first.
        let _ = rustls::crypto::ring::default_provider().install_default();

        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.response_timeout))
            .set_number_of_retries(RECONNECT_RETRIES)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(100));
        let op_timeout = config.connect_timeout + 2 * config.response_timeout;
        let certs = config.tls.as_ref().map(load_certificates).transpose()?;

        let backend = build_backend(config, &manager_config, op_timeout, certs.as_ref())?;
        let (active, canary) = find_sources(&config.scripts)?;
        let version_stats = StatsRegistry::default();
        let set = ScriptSet::new(&config.scripts, active, canary, None, &version_stats);
        let (unanswered_tx, unanswered_rx) = tokio::sync::mpsc::unbounded_channel();
        Ok(RedisStore {
            backend: ArcSwap::from_pointee(backend),
            settings: config.clone(),
            manager_config,
            tls_in_force: parking_lot::Mutex::new(certs),
            tls_refused: parking_lot::Mutex::new(None),
            tls_reloads: AtomicU64::new(0),
            tls_reload_failures: AtomicU64::new(0),
            scripts: ArcSwap::from_pointee(set),
            version_stats,
            apply_lock: tokio::sync::Mutex::new(()),
            refused: parking_lot::Mutex::new(None),
            last_reload_error: parking_lot::Mutex::new(None),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
            rollbacks: AtomicU64::new(0),
            ping_key: format!("{}:{{__idemgate_ping__}}", config.key_prefix),
            part_ping_keys: match config.topology {
                RedisTopology::Cluster => part_ping_keys(&config.key_prefix),
                _ => Box::default(),
            },
            prefix: config.key_prefix.clone(),
            op_timeout,
            eviction: parking_lot::Mutex::default(),
            servers: parking_lot::Mutex::default(),
            unanswered_tx,
            unanswered_rx: parking_lot::Mutex::new(Some(unanswered_rx)),
            unanswered_pending: AtomicUsize::new(0),
            unanswered_released: AtomicU64::new(0),
        })
    }

    /// Releases the claims whose answer never came, each until it is released or the lock it
    /// may have taken would have lapsed anyway. Runs for the life of the process (a second call
    /// returns at once).
    ///
    /// A claim that timed out here may still sit in a socket buffer, or in a Redis that stalled
    /// (a long command, a fork, a paused VM), and take the key once Redis runs it: for nobody,
    /// since its request was answered 503 and went on. Left alone, the retry the 503 asked for
    /// would get 409 `request-in-flight` until `lock_ttl`, then take over the lapsed lock as
    /// though an answer had been lost (counted in `idemgate_lapsed_takeovers_total`, which
    /// pages). The release goes by owner token, so it changes nothing unless that very claim
    /// holds the key: one that never arrives, or arrives once a retry holds the key or its
    /// record is complete, is left as it is. It is tried again and again, since the claim may
    /// reach Redis after an earlier try (which goes on another connection).
    pub async fn release_unanswered_claims(&self) {
        let Some(mut rx) = self.unanswered_rx.lock().take() else {
            return;
        };
        let mut waiting: Vec<Unanswered> = Vec::new();
        loop {
            let next = waiting.iter().map(|c| c.due).min();
            let due = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                claim = rx.recv() => match claim {
                    Some(claim) => waiting.push(claim),
                    None => return,
                },
                () = due => {
                    let now = tokio::time::Instant::now();
                    let (due, later): (Vec<_>, Vec<_>) =
                        waiting.drain(..).partition(|c| c.due <= now);
                    waiting = later;
                    let tries = due.into_iter().map(|c| async move {
                        let released = self.release(&c.key, c.owner).await;
                        (c, released)
                    });
                    for (mut claim, released) in futures_util::future::join_all(tries).await {
                        let now = tokio::time::Instant::now();
                        match released {
                            Ok(WriteOutcome::Applied) => {
                                self.unanswered_released.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(
                                    record = %key::hash_label(&claim.key.hash),
                                    "a claim whose answer never came reached redis after all; \
                                     released, so the retry its 503 asked for runs"
                                );
                            }
                            _ if now < claim.until => {
                                claim.tries += 1;
                                claim.due = now + unanswered_pause(claim.tries);
                                waiting.push(claim);
                                continue;
                            }
                            // Its lock, if it took one, has lapsed by now.
                            _ => {}
                        }
                        self.unanswered_pending.fetch_sub(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// Claims whose answer never came, found holding their key once Redis ran them, and
    /// released ([`RedisStore::release_unanswered_claims`]).
    pub fn unanswered_claims_released(&self) -> u64 {
        self.unanswered_released.load(Ordering::Relaxed)
    }

    /// Hands a claim whose answer never came to [`RedisStore::release_unanswered_claims`].
    fn note_unanswered(&self, req: &ClaimRequest) {
        let now = tokio::time::Instant::now();
        let claim = Unanswered {
            key: req.key.clone(),
            owner: req.owner,
            until: now + req.lock_ttl,
            due: now + unanswered_pause(0),
            tries: 0,
        };
        if self.unanswered_pending.fetch_add(1, Ordering::Relaxed) >= UNANSWERED_CAPACITY {
            self.unanswered_pending.fetch_sub(1, Ordering::Relaxed);
            crate::warn_throttled!(
                "too many unanswered claims waiting to be released; should this one reach \
                 redis, its key stays locked until lock_ttl"
            );
            return;
        }
        if self.unanswered_tx.send(claim).is_err() {
            // Its worker is gone (the process is stopping).
            self.unanswered_pending.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Reads whether Redis may evict records (see [`eviction`]): `INFO memory` on the server
    /// (the primary, behind Sentinel), or on every primary of a Cluster. Warns when some server
    /// may (once per change of what it finds), and says when none may any longer. Returns
    /// false once the ACL user may not run `INFO` (on a Cluster: on some primary): that is said
    /// once, and asking again would only fill `ACL LOG` (a grant made later takes a restart).
    /// A server that does not answer leaves the last reading as it was, and so does a Cluster
    /// reading that left out a primary owning slots, unless it found one that may evict.
    pub async fn check_eviction(&self) -> bool {
        let primaries = match self.slot_primaries().await {
            Ok(primaries) => primaries,
            Err(failure) => {
                tracing::debug!(error = %failure.error, "redis eviction setting not read");
                return true;
            }
        };
        let mut info = redis::cmd("INFO");
        info.arg("memory");
        let reading = match self.send("info", Call::Command(&info)).await {
            Ok(reply) => eviction::read(reply),
            Err(failure) if failure.denied => eviction::Reading::Denied(failure.error.to_string()),
            Err(failure) => {
                tracing::debug!(error = %failure.error, "redis eviction setting not read");
                return true;
            }
        };
        match reading {
            eviction::Reading::Settings(settings) => {
                let Some(found) = eviction::Finding::of(&settings, primaries) else {
                    tracing::debug!(
                        answered = settings.len(),
                        primaries,
                        "redis eviction setting not read on every primary; the last reading stands"
                    );
                    return true;
                };
                let mut last = self.eviction.lock();
                match (&*last, &found) {
                    (last, eviction::Finding::May(what)) if *last != found => tracing::warn!(
                        setting = %what,
                        "redis may evict records: every record has a ttl, so any \
                         maxmemory-policy but noeviction drops them under memory pressure, \
                         and a retry of a dropped key runs again; set maxmemory-policy \
                         noeviction"
                    ),
                    (eviction::Finding::May(_), eviction::Finding::Never) => tracing::info!(
                        "redis no longer evicts records (maxmemory-policy noeviction, or no maxmemory)"
                    ),
                    _ => {}
                }
                *last = found;
                true
            }
            eviction::Reading::Denied(why) => {
                *self.eviction.lock() = eviction::Finding::Unknown;
                tracing::info!(
                    error = %why,
                    "cannot tell whether redis may evict records: the ACL user may not run \
                     INFO (grant +info to be warned)"
                );
                false
            }
            eviction::Reading::Unreadable(why) => {
                tracing::debug!(error = %why, "redis eviction setting not read");
                true
            }
        }
    }

    /// Reads each server's run id (`INFO server`; every primary's, on a Cluster) and tells
    /// whether a server was restarted or replaced since the last reading (see [`restarts`]).
    /// A reading that fails, or leaves out a server, changes nothing; the first one finds no
    /// change.
    pub async fn check_restarts(&self) -> Restarts {
        let Ok(primaries) = self.slot_primaries().await else {
            return Restarts::Unknown;
        };
        let mut info = redis::cmd("INFO");
        info.arg("server");
        let reading = match self.send("info", Call::Command(&info)).await {
            Ok(reply) => restarts::read(reply),
            Err(failure) if failure.denied => restarts::Reading::Denied(failure.error.to_string()),
            Err(failure) => restarts::Reading::Unreadable(failure.error.to_string()),
        };
        let found = match reading {
            restarts::Reading::Servers(found)
                if primaries.is_some_and(|primaries| found.len() < primaries) =>
            {
                tracing::debug!("redis run ids not read on every primary");
                return Restarts::Unknown;
            }
            restarts::Reading::Servers(found) => found,
            restarts::Reading::Denied(why) => return Restarts::Denied(why),
            restarts::Reading::Unreadable(why) => {
                tracing::debug!(error = %why, "redis run ids not read");
                return Restarts::Unknown;
            }
        };
        let mut last = self.servers.lock();
        match last.replace(found.clone()) {
            Some(before) if before != found => Restarts::Changed { before, now: found },
            _ => Restarts::Same,
        }
    }

    /// On a Cluster, how many primaries own slots (`CLUSTER SLOTS`): how many servers a fan-out
    /// of `INFO` must cover to be the whole Cluster's, as it leaves out a primary the client
    /// holds no connection to (see [`eviction::slot_primaries`]). `None` elsewhere, or for a
    /// reply of another shape.
    async fn slot_primaries(&self) -> Result<Option<usize>, Failure> {
        if self.settings.topology != RedisTopology::Cluster {
            return Ok(None);
        }
        let mut slots = redis::cmd("CLUSTER");
        slots.arg("SLOTS");
        let reply = self.send("cluster slots", Call::Command(&slots)).await?;
        Ok(eviction::slot_primaries(&reply))
    }

    /// What the last [`RedisStore::check_eviction`] found: 1 some server may evict records, 0
    /// none may, -1 not known.
    pub fn may_evict(&self) -> i8 {
        self.eviction.lock().gauge()
    }

    /// Connects (if not yet connected) and loads the scripts in force, so the first requests
    /// pay no NOSCRIPT round trip. On a cluster the scripts go to every primary and the first
    /// answer decides, so a node that is down cannot hold the start up.
    ///
    /// Redis refusing a script is not a connection failure: it is logged and counted, a
    /// refused canary is disabled (every record uses the active version), and `Ok` is
    /// returned; a refused active version has nothing to fall back to, so its calls fail
    /// until the text is fixed (the script watcher applies the fix).
    pub async fn connect(&self) -> Result<(), StoreError> {
        let _serial = self.apply_lock.lock().await;
        let set = self.scripts.load_full();
        let backend = self.backend.load_full();
        match tokio::time::timeout(self.op_timeout, backend.conn()).await {
            Ok(Ok(_)) => {}
            Ok(Err(err)) => {
                backend.on_error(&err, None, self.op_timeout);
                return Err(store_error("connect", err));
            }
            Err(_) => return Err(self.timed_out("connect")),
        }
        let versions = std::iter::once((&set.active, None))
            .chain(set.canary.as_ref().map(|c| (&c.version, Some(c))));
        for (version, canary) in versions {
            match self.load(version).await {
                Ok(_) => {}
                Err(ScriptsError::Unavailable(message)) => {
                    return Err(StoreError::Unavailable(message))
                }
                Err(err) => {
                    version.load_failed.store(true, Ordering::Relaxed);
                    let what = match canary {
                        Some(canary) => {
                            canary.disable(format!("failed to load: {err}"));
                            "canary disabled; every record uses the active version"
                        }
                        None => "the active version's calls fail until its text is fixed",
                    };
                    *self.refused.lock() = Some(refusal_key(
                        &set.settings,
                        &set.active.sources,
                        set.canary.as_ref().map(|c| &c.version.sources),
                    ));
                    self.note_refused(&err, what);
                }
            }
        }
        Ok(())
    }

    /// Brings the scripts in line with `settings` and the current text of their versions (a
    /// directory may have been edited): reads the text, loads what is new into Redis and checks
    /// its SHA, then swaps the new set in. Calls already running finish on the old one.
    ///
    /// Refused text (unreadable, or a syntax error Redis reports) keeps the running scripts and
    /// is logged and counted once: the same settings and text are not tried again. When Redis
    /// cannot be reached nothing is remembered, so the next attempt tries again.
    pub async fn apply_scripts(
        &self,
        settings: &ScriptsConfig,
    ) -> Result<ScriptsApplied, ScriptsError> {
        self.apply_sources(settings, find_sources(settings)).await
    }

    /// [`RedisStore::apply_scripts`] with the texts already read: those of the active version
    /// and the canary `settings` name, or why they could not be read. The script reloader
    /// applies the very reading it saw settle, not a later one.
    pub async fn apply_sources(
        &self,
        settings: &ScriptsConfig,
        found: Result<(Sources, Option<Sources>), SourceError>,
    ) -> Result<ScriptsApplied, ScriptsError> {
        let _serial = self.apply_lock.lock().await;
        let current = self.scripts.load_full();
        let (active, canary) = match found {
            Ok(found) => found,
            Err(err) => {
                let key = format!("{settings:?}: {err}");
                if self.refused.lock().as_deref() == Some(key.as_str()) {
                    return Ok(ScriptsApplied::StillRefused);
                }
                *self.refused.lock() = Some(key);
                let err = ScriptsError::Sources(err);
                self.note_refused(&err, "the running scripts stay");
                return Err(err);
            }
        };
        if current.matches(settings, &active, canary.as_ref()) {
            *self.refused.lock() = None;
            return Ok(ScriptsApplied::Unchanged);
        }
        let key = refusal_key(settings, &active, canary.as_ref());
        if self.refused.lock().as_deref() == Some(key.as_str()) {
            return Ok(ScriptsApplied::StillRefused);
        }
        let set = ScriptSet::new(
            settings,
            active,
            canary,
            Some(&current),
            &self.version_stats,
        );
        let mut loaded = Vec::new();
        // A canary kept from the running set that is off already (rolled back, or refused
        // when it was loaded) serves nothing: it is not loaded again, and text Redis refused
        // then cannot hold back a change to the rest (a fix of the active version).
        let serving_canary = set
            .canary
            .as_ref()
            .filter(|c| !c.is_disabled())
            .map(|c| &c.version);
        let versions = std::iter::once(&set.active).chain(serving_canary);
        for version in versions {
            // Text already in force is loaded (or will be, by the warm-up or NOSCRIPT), unless
            // Redis refused it at start-up.
            let in_force = current.reusable(&version.sources);
            if in_force.is_some_and(|v| !v.load_failed.load(Ordering::Relaxed)) {
                continue;
            }
            match self.load(version).await {
                Ok(files) => loaded.extend(files),
                Err(err @ ScriptsError::Unavailable(_)) => return Err(err),
                Err(err) => {
                    *self.refused.lock() = Some(key);
                    self.note_refused(&err, "the running scripts stay");
                    return Err(err);
                }
            }
        }
        *self.refused.lock() = None;
        self.reloads.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            active = %set.active.sources.version,
            active_source = %set.active.sources.origin,
            canary = set.canary.as_ref().map(|c| c.version.sources.version.as_str()),
            canary_percent = set.canary.as_ref().map(|c| c.config.percent),
            loaded = ?loaded,
            "redis scripts applied"
        );
        self.scripts.store(Arc::new(set));
        Ok(ScriptsApplied::Applied { loaded })
    }

    /// The `store.redis.tls` files as the connections use them now (`None`: no `tls` block).
    pub fn tls_certificates(&self) -> Option<TlsCertificates> {
        self.tls_in_force.lock().clone()
    }

    /// Whether a `store.redis.tls` block names files to watch ([`RedisStore::reload_tls`]).
    pub fn watches_tls(&self) -> bool {
        self.settings.tls.is_some()
    }

    /// Reads the `store.redis.tls` files again and, when their contents changed, swaps in new
    /// connections that use them (a rotated CA, server or client certificate). Calls in flight
    /// finish on the connections they started on; the next calls connect with the new files.
    /// Returns the certificates now in force when it swapped, `None` when nothing changed (or
    /// no `tls` block is set). Files that cannot be read or parsed leave everything as it was;
    /// each distinct refusal is logged and counted once, when two readings in a row find it.
    pub fn reload_tls(&self) -> Option<TlsCertificates> {
        let outcome = self.try_reload_tls();
        let mut refused = self.tls_refused.lock();
        match outcome {
            Ok(swapped) => {
                *refused = None;
                if swapped.is_some() {
                    self.tls_reloads.fetch_add(1, Ordering::Relaxed);
                    tracing::info!("store.redis.tls files changed; new Redis connections use them");
                }
                swapped
            }
            Err(e) => {
                // Reported when the next reading still finds the same fault: a file caught
                // half-written, or a certificate whose new key is not written yet (files
                // replaced one at a time), is no fault once the writer is done.
                let message = e.to_string();
                match refused.as_mut() {
                    Some((seen, reported)) if *seen == message => {
                        if !*reported {
                            *reported = true;
                            self.tls_reload_failures.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(error = %message, "store.redis.tls files changed but cannot be used; Redis connections keep the previous ones");
                        }
                    }
                    _ => *refused = Some((message, false)),
                }
                None
            }
        }
    }

    /// Rotated `store.redis.tls` files now in use.
    pub fn tls_reloads(&self) -> u64 {
        self.tls_reloads.load(Ordering::Relaxed)
    }

    /// Changes of the `store.redis.tls` files refused (each distinct refusal once).
    pub fn tls_reload_failures(&self) -> u64 {
        self.tls_reload_failures.load(Ordering::Relaxed)
    }

    fn try_reload_tls(&self) -> Result<Option<TlsCertificates>, SetupError> {
        let Some(tls) = &self.settings.tls else {
            return Ok(None);
        };
        // Compared as read; checked and parsed only when they changed.
        let certs = read_tls_files(tls)?;
        let mut in_force = self.tls_in_force.lock();
        if in_force
            .as_ref()
            .is_some_and(|old| same_certificates(old, &certs))
        {
            return Ok(None);
        }
        check_certificates(tls, &certs)?;
        let backend = build_backend(
            &self.settings,
            &self.manager_config,
            self.op_timeout,
            Some(&certs),
        )?;
        self.backend.store(Arc::new(backend));
        *in_force = Some(certs.clone());
        Ok(Some(certs))
    }

    /// Version name of the active scripts.
    pub fn scripts_version(&self) -> String {
        self.scripts.load().active.sources.version.clone()
    }

    /// The settings the scripts in force were made from.
    pub fn scripts_settings(&self) -> ScriptsConfig {
        self.scripts.load().settings.clone()
    }

    /// Calls and script errors per version since start, by version name.
    pub fn version_counts(&self) -> Vec<(String, u64, u64)> {
        self.version_stats
            .lock()
            .iter()
            .map(|(name, s)| {
                let calls = s.calls.load(Ordering::Relaxed);
                (name.clone(), calls, s.errors.load(Ordering::Relaxed))
            })
            .collect()
    }

    /// The canary's share of record ids in force (0 with no canary or once rolled back).
    pub fn canary_percent(&self) -> u8 {
        self.scripts
            .load()
            .canary
            .as_ref()
            .map_or(0, |c| c.percent_in_force())
    }

    /// Times a canary was rolled back for its error rate.
    pub fn canary_rollbacks(&self) -> u64 {
        self.rollbacks.load(Ordering::Relaxed)
    }

    /// Script changes applied after start-up.
    pub fn script_reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Script changes refused (unreadable, or Redis would not load them).
    pub fn script_reload_failures(&self) -> u64 {
        self.reload_failures.load(Ordering::Relaxed)
    }

    /// Everything `GET /admin/scripts` shows. Reads the script directory (to list what could be
    /// named and hash its current text), so call it off the hot path.
    pub fn scripts_status(&self) -> ScriptsStatus {
        let set = self.scripts.load_full();
        let dir = set.settings.dir.as_deref();
        let mut versions: BTreeMap<String, AvailableVersion> = scripts::available(dir)
            .into_iter()
            .map(|name| {
                let entry = match Sources::find(dir, &name) {
                    Ok(sources) => {
                        let status = Version::new(sources, Arc::default()).status();
                        AvailableVersion {
                            source: Some(status.source),
                            scripts: Some(status.scripts),
                            ..AvailableVersion::default()
                        }
                    }
                    Err(err) => AvailableVersion {
                        error: Some(err.to_string()),
                        ..AvailableVersion::default()
                    },
                };
                (name, entry)
            })
            .collect();
        for (name, calls, errors) in self.version_counts() {
            let entry = versions.entry(name).or_default();
            entry.calls = calls;
            entry.errors = errors;
        }
        ScriptsStatus {
            dir: dir.map(|d| d.display().to_string()),
            active: set.active.status(),
            canary: set
                .canary
                .as_ref()
                .map(|c| c.status(Instant::now().into_std())),
            versions,
            canary_rollbacks: self.canary_rollbacks(),
            reloads: self.script_reloads(),
            reload_failures: self.script_reload_failures(),
            last_reload_error: self.last_reload_error.lock().clone(),
        }
    }

    /// The Redis key of a record: `<prefix>:{<tenant>:<hex hash>}`.
    pub fn record_key(&self, key: &RecordKey) -> String {
        record_key(&self.prefix, key)
    }

    /// SCRIPT LOAD of a version's four scripts, all four at once (every primary of a cluster,
    /// the first answer deciding), checking that Redis hashes each to the SHA we will call.
    /// Returns the files loaded.
    async fn load(&self, version: &Version) -> Result<Vec<String>, ScriptsError> {
        let backend = self.backend.load_full();
        let attempt = async {
            let held = backend
                .conn()
                .await
                .map_err(|e| ScriptsError::Unavailable(e.to_string()))?;
            let sent = Instant::now();
            let sends = version.sources.texts.iter().map(|text| {
                let mut conn = held.conn.clone();
                let cmd = script_load(text);
                async move {
                    match &mut conn {
                        Conn::Manager(manager) => cmd.query_async::<String>(manager).await,
                        // Every primary is sent it and the first to answer decides: that checks
                        // that Redis compiles the text and names it by the SHA we will call. A
                        // primary that missed it loads it on its first NOSCRIPT. redis-rs's own
                        // routing sends it to every node, replicas too, and fails unless all
                        // answer: one node down would stall every script change and warm-up.
                        // (A node that does not answer still holds each send for up to
                        // response_timeout, hence the four at once.)
                        Conn::Cluster(cluster) => cluster
                            .route_command(
                                cmd,
                                RoutingInfo::MultiNode((
                                    MultipleNodeRoutingInfo::AllMasters,
                                    Some(ResponsePolicy::OneSucceeded),
                                )),
                            )
                            .await
                            .and_then(|value| Ok(redis::from_redis_value::<String>(value)?)),
                    }
                }
            });
            let answers = futures_util::future::join_all(sends).await;
            if answers.iter().any(|a| a.is_ok() || is_script_fault_ref(a)) {
                held.answered();
            }
            let mut files = Vec::new();
            for (i, (loaded, script)) in answers.into_iter().zip(version.scripts.all()).enumerate()
            {
                let file = version.sources.describe(i);
                match loaded {
                    Ok(sha) if sha == script.get_hash() => files.push(file),
                    Ok(sha) => {
                        return Err(ScriptsError::Refused {
                            file,
                            message: format!("loaded as SHA {sha}, expected {}", script.get_hash()),
                        })
                    }
                    Err(err) if is_script_fault(&err) => {
                        return Err(ScriptsError::Refused {
                            file,
                            message: err.to_string(),
                        })
                    }
                    Err(err) => {
                        backend.on_error(&err, Some((&held, sent)), self.op_timeout);
                        return Err(ScriptsError::Unavailable(err.to_string()));
                    }
                }
            }
            Ok(files)
        };
        tokio::time::timeout(self.op_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(ScriptsError::Unavailable(format!(
                    "no answer within {}ms",
                    self.op_timeout.as_millis()
                )))
            })
    }

    fn note_refused(&self, err: &ScriptsError, consequence: &str) {
        self.reload_failures.fetch_add(1, Ordering::Relaxed);
        *self.last_reload_error.lock() = Some(err.to_string());
        tracing::error!(error = %err, "redis scripts refused; {consequence}");
    }

    /// Runs one script for `key` on the version the record takes: the canary when it takes the
    /// record, and then, if the canary failed by its own fault, once more on the active version
    /// with the same arguments (see the module doc for why that is safe).
    async fn run<T>(
        &self,
        op: ScriptOp,
        key: &RecordKey,
        args: &[&[u8]],
        parse: fn(Value) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.run_noting(op, key, args, parse, &mut Noted::default())
            .await
    }

    /// [`RedisStore::run`] for one caller's repeated calls (the polls of a wait), which `noted`
    /// follows: in a canary's error window they are one call, however often it polls (counted,
    /// its repeats would dilute the error rate: a claim failing on every key could hide behind
    /// the reads of its waiters, and a read failing on one state would weigh once per poll).
    async fn run_noting<T>(
        &self,
        op: ScriptOp,
        key: &RecordKey,
        args: &[&[u8]],
        parse: fn(Value) -> Result<T, StoreError>,
        noted: &mut Noted,
    ) -> Result<T, StoreError> {
        let set = self.scripts.load_full();
        let redis_key = self.record_key(key);
        if let Some(canary) = set.canary_for(key) {
            match self
                .run_version(&canary.version, op, &redis_key, args, parse)
                .await
            {
                Ok(answer) => {
                    if noted.first(canary, false) {
                        self.note_canary(canary, None);
                    }
                    return Ok(answer);
                }
                // The server answered with an error, or with a reply the canary's caller
                // cannot read: the same call goes to the active version, and the canary is to
                // blame only if that one succeeds. A record or a server state that fails both
                // is no fault of the canary's, and must not roll it back.
                Err(failure) if failure.answered => {
                    let active = self
                        .run_version(&set.active, op, &redis_key, args, parse)
                        .await;
                    if active.is_ok() && noted.first(canary, true) {
                        self.note_canary(canary, Some(&failure.error));
                    }
                    return active.map_err(|failure| failure.error);
                }
                Err(failure) => return Err(failure.error),
            }
        }
        self.run_version(&set.active, op, &redis_key, args, parse)
            .await
            .map_err(|failure| failure.error)
    }

    async fn run_version<T>(
        &self,
        version: &Version,
        op: ScriptOp,
        redis_key: &str,
        args: &[&[u8]],
        parse: fn(Value) -> Result<T, StoreError>,
    ) -> Result<T, Failure> {
        version.stats.calls.fetch_add(1, Ordering::Relaxed);
        let call = Call::script(version, op, redis_key, args);
        // A reply the parser cannot read is the script's fault too: both versions promise
        // the same reply shapes.
        let result = self.send(op.name(), call).await.and_then(|value| {
            parse(value).map_err(|error| Failure {
                error,
                script_fault: true,
                answered: true,
                denied: false,
            })
        });
        if matches!(&result, Err(f) if f.script_fault) {
            version.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Counts a canary call whose script ran, and rolls the canary back when its error rate
    /// crossed the threshold.
    fn note_canary(&self, canary: &Canary, error: Option<&StoreError>) {
        if let Some(error) = error {
            tracing::debug!(version = %canary.version.sources.version, %error, "canary script failed; sent again on the active version");
        }
        let Some((calls, errors)) = canary.record(Instant::now().into_std(), error.is_some())
        else {
            return;
        };
        self.rollbacks.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            version = %canary.version.sources.version,
            calls,
            errors,
            window_seconds = canary.config.window.as_secs_f64(),
            max_error_rate = canary.config.max_error_rate,
            last_error = error.map(|e| e.to_string()),
            "canary script version rolled back: its error rate crossed store.redis.scripts.canary.max_error_rate; every record uses the active version now"
        );
    }

    /// Sends one call, re-sending it once on a fresh connection if the first connection was
    /// dead, all within the operation deadline.
    async fn send(&self, op: &'static str, call: Call<'_>) -> Result<Value, Failure> {
        let backend = self.backend.load_full();
        // The connection the call last went out on, and when.
        let mut used = None;
        let attempt = async {
            let held = backend.conn().await?;
            used = Some((held.clone(), Instant::now()));
            match call.send_on(&held).await {
                Err(err) if worth_resending(&err) => {
                    tracing::debug!(op, error = %err, "redis connection lost; sending again");
                    backend.on_error(&err, used.as_ref().map(|(h, at)| (h, *at)), self.op_timeout);
                    if is_redirect(&err) {
                        // The Cluster client's own retries ran out while its slot map and
                        // connections were being repaired (a node restarted at the address a
                        // redirect names); a moment lets the repair finish.
                        tokio::time::sleep(Duration::from_millis(CLUSTER_RETRY_WAIT_MS.1)).await;
                    }
                    let held = backend.conn().await?;
                    used = Some((held.clone(), Instant::now()));
                    call.send_on(&held).await
                }
                other => other,
            }
        };
        let result = tokio::time::timeout(self.op_timeout, attempt).await;
        let used = used.as_ref().map(|(h, at)| (h, *at));
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => {
                backend.on_error(&err, used, self.op_timeout);
                let script_fault = is_script_fault(&err);
                let answered = matches!(err.kind(), ErrorKind::Server(_) | ErrorKind::Extension);
                let denied = err.kind() == ErrorKind::Server(ServerErrorKind::NoPerm);
                // A script that fails is no outage: Redis is up and would fail it the same way
                // on every retry, so the outage policy must not apply (`pass` would forward
                // every keyed request unprotected behind a broken `claim.lua`) and the circuit
                // must not open. It is refused like a reply this proxy cannot read.
                let error = if script_fault {
                    StoreError::Corrupt(format!("redis {op}: the script failed: {err}"))
                } else {
                    store_error(op, err)
                };
                Err(Failure {
                    script_fault,
                    answered,
                    denied,
                    error,
                })
            }
            Err(_) => {
                let timed_out =
                    RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
                backend.on_error(&timed_out, used, self.op_timeout);
                Err(Failure {
                    error: self.timed_out(op),
                    script_fault: false,
                    answered: false,
                    denied: false,
                })
            }
        }
    }

    fn timed_out(&self, op: &str) -> StoreError {
        StoreError::Unavailable(format!(
            "redis {op}: no answer within {}ms",
            self.op_timeout.as_millis()
        ))
    }

    async fn read(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.run(ScriptOp::Get, key, &[], parse_read).await
    }

    /// The key of worker id `id`'s lease: `<prefix>:worker:<id>`. Record keys all carry a hash
    /// tag (`{...}`) right after the prefix, so no record has this key.
    pub fn worker_lease_key(&self, id: u16) -> String {
        format!("{}:worker:{id}", self.prefix)
    }

    /// Takes the lease on worker id `id` for `holder`, or renews it if `holder` has it, for
    /// `lease` from now (`lua/worker_lease.lua`): `Some` with the server's clock in Unix
    /// milliseconds when `holder` holds it, `None` when another holder has it.
    pub async fn lease_worker_id(
        &self,
        id: u16,
        holder: &str,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        static SCRIPT: LazyLock<redis::Script> =
            LazyLock::new(|| redis::Script::new(WORKER_LEASE_SCRIPT));
        let key = self.worker_lease_key(id);
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg(SCRIPT.get_hash())
            .arg(1)
            .arg(&key)
            .arg(holder)
            .arg(millis(lease));
        let call = Call::Script {
            evalsha,
            text: WORKER_LEASE_SCRIPT,
            key: &key,
        };
        let reply = self.send("worker lease", call).await.map_err(|f| f.error)?;
        match reply {
            Value::Array(parts) => match parts.as_slice() {
                [Value::Int(1), Value::Int(now_ms)] if *now_ms >= 0 => Ok(Some(*now_ms as u64)),
                _ => Err(unexpected("worker lease", &Value::Array(parts))),
            },
            Value::Int(0) => Ok(None),
            other => Err(unexpected("worker lease", &other)),
        }
    }
}

/// What one caller's repeated calls have counted in a canary's error window: at most one success
/// and one failure per canary. A reload that brings a new canary (a fresh window) mid-wait
/// counts the wait there too.
#[derive(Default)]
struct Noted {
    canary: Option<Arc<Canary>>,
    success: bool,
    failure: bool,
}

impl Noted {
    /// Whether a success (or with `failed`, a failure) on `canary` is yet to be counted; it is
    /// counted from now on.
    fn first(&mut self, canary: &Arc<Canary>, failed: bool) -> bool {
        if !self.canary.as_ref().is_some_and(|c| Arc::ptr_eq(c, canary)) {
            *self = Noted {
                canary: Some(canary.clone()),
                ..Noted::default()
            };
        }
        let seen = if failed {
            &mut self.failure
        } else {
            &mut self.success
        };
        !std::mem::replace(seen, true)
    }
}

impl RedisStore {
    /// One claim, or one renewal: the same script, told by a sixth argument to take only a
    /// lock this owner holds (see `lua/v2/claim.lua`).
    async fn claim_or_renew(
        &self,
        req: &ClaimRequest,
        renewing: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        let owner = owner_arg(req.owner);
        let mut digits = [[0u8; 20]; 3];
        let [id, lock, life] = &mut digits;
        let args: [&[u8]; 6] = [
            &req.fingerprint[..],
            owner.as_bytes(),
            itoa(req.execution_id, id),
            itoa(millis(req.lock_ttl), lock),
            itoa(millis(req.ttl), life),
            b"renew",
        ];
        let args = if renewing { &args[..] } else { &args[..5] };
        let mut outcome = self
            .run(ScriptOp::Claim, &req.key, args, parse_claim)
            .await?;
        // Redis's clock stepped back makes a lock look longer than any is taken for (see the
        // module docs). A lock taken under another `lock_ttl` (a config rolling out) shows at
        // most this one's: a retry then comes early and is told again.
        if let ClaimOutcome::Existing(Record {
            state: RecordState::InFlight { lock_remaining },
            ..
        }) = &mut outcome
        {
            *lock_remaining = (*lock_remaining).min(req.lock_ttl);
        }
        Ok(outcome)
    }
}

#[async_trait]
impl RecordStore for RedisStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let claimed = self.claim_or_renew(req, false).await;
        if let Err(StoreError::Unavailable(_)) = &claimed {
            self.note_unanswered(req);
        }
        claimed
    }

    /// The claim script in its renewal mode, whose failure is not handed on to be released:
    /// the execution it renews the lock of is still running.
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_or_renew(req, true).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let payload = codec::encode(&completion);
        let write_id = completion_id(owner, &payload);
        let owner = owner_arg(owner);
        let mut digits = [0u8; 20];
        let args: [&[u8]; 4] = [
            owner.as_bytes(),
            &payload,
            itoa(millis(ttl), &mut digits),
            write_id.as_bytes(),
        ];
        self.run(ScriptOp::Complete, key, &args, |reply| {
            parse_write("complete", reply)
        })
        .await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        // A release goes once (never through the retry queue): an id of its own, the same
        // for the re-sends of this call.
        let write_id = release_id();
        let owner = owner_arg(owner);
        let args: [&[u8]; 2] = [owner.as_bytes(), write_id.as_bytes()];
        self.run(ScriptOp::Release, key, &args, |reply| {
            parse_write("release", reply)
        })
        .await
    }

    /// Polls with bounded exponential backoff: 5 ms doubling to 100 ms, never sleeping past
    /// the lock's lapse or the timeout. Chosen over pub/sub because it needs no subscriber
    /// connection per node (which Cluster and failover make fiddly), it holds no connection
    /// while it sleeps (waiters share the multiplexed connection, so many duplicates cannot
    /// exhaust a pool), and it costs a waiter at most ~10 reads a second. The price is up to
    /// 100 ms of extra latency for a waiter whose original runs long on another replica. The
    /// local cache in front ([`super::cached::CachedStore`]) runs one such poll for all the
    /// waiters of a key on a replica, and none while the original runs on the waiter's own.
    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        let started = Instant::now();
        let mut pause = POLL_START;
        let mut noted = Noted::default();
        loop {
            let record = self
                .run_noting(ScriptOp::Get, key, &[], parse_read, &mut noted)
                .await?;
            let lock_remaining = match &record {
                Some(Record {
                    state: RecordState::InFlight { lock_remaining },
                    ..
                }) if !lock_remaining.is_zero() => *lock_remaining,
                _ => return Ok(record),
            };
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Ok(record);
            }
            // One millisecond past the lapse, so the next read sees it lapsed on Redis' clock.
            let nap = pause
                .min(left)
                .min(lock_remaining + Duration::from_millis(1));
            tokio::time::sleep(nap).await;
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.read(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        // One key holds the whole record, so a plain DEL is atomic.
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.record_key(key));
        let reply = self
            .send("delete", Call::Command(&cmd))
            .await
            .map_err(|f| f.error)?;
        match reply {
            Value::Int(removed) => Ok(removed > 0),
            other => Err(unexpected("delete", &other)),
        }
    }

    /// `lua/purge.lua`: the state read and the delete in one script, so a claim landing
    /// meanwhile is never removed from under its execution.
    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PURGE_SCRIPT));
        let key = self.record_key(key);
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg(SCRIPT.get_hash()).arg(1).arg(&key);
        let call = Call::Script {
            evalsha,
            text: PURGE_SCRIPT,
            key: &key,
        };
        let reply = self.send("delete", call).await.map_err(|f| f.error)?;
        parse_deletion(reply)
    }

    /// Every send of a completion carries its [`completion_id`], which the scripts keep.
    fn refusals_are_final(&self) -> bool {
        true
    }

    /// Runs the get script (EVALSHA) on a key no record uses: a server that answers PING but
    /// cannot run scripts (ACL, broken script cache that cannot be reloaded) is not ready.
    async fn ping(&self) -> Result<(), StoreError> {
        self.ping_at(&self.ping_key).await
    }

    /// On a Cluster, the part of the slot space the key's record is in.
    fn part_of(&self, key: &RecordKey) -> usize {
        if self.part_ping_keys.is_empty() {
            return 0;
        }
        cluster_part(record_slot(key))
    }

    fn parts(&self) -> usize {
        self.part_ping_keys.len().max(1)
    }

    /// Probes the slot of `key`'s record, on a Cluster: a key no record has, tagged as the
    /// record is (`<record key>:__idemgate_ping__`, whose hash tag is the record's).
    async fn ping_near(&self, key: &RecordKey) -> Result<(), StoreError> {
        if self.part_ping_keys.is_empty() {
            return self.ping().await;
        }
        let near = format!("{}:__idemgate_ping__", self.record_key(key));
        self.ping_at(&near).await
    }

    /// Probes part `part` (a key of its slots, on a Cluster).
    async fn ping_part(&self, part: usize) -> Result<(), StoreError> {
        match self.part_ping_keys.get(part) {
            Some(key) => self.ping_at(key).await,
            None => self.ping().await,
        }
    }
}

impl RedisStore {
    /// The readiness probe on `ping_key`: the get script, and a write.
    async fn ping_at(&self, ping_key: &str) -> Result<(), StoreError> {
        // The active version, uncounted: probes are no record traffic.
        let set = self.scripts.load_full();
        let call = Call::script(&set.active, ScriptOp::Get, ping_key, &[]);
        let read = match self.send("ping", call).await {
            Ok(Value::Nil | Value::Boolean(false)) => Ok(()),
            Ok(reply) => Err(unexpected("ping", &reply)),
            // A store that did not answer needs no second call to say so.
            Err(f) if !f.script_fault => return Err(f.error),
            Err(f) => Err(f.error),
        };
        // And a write, which a replica refuses (READONLY) where it runs a read-only script: a
        // server that takes no writes (an address still aimed at a demoted primary) must not
        // close the circuit or answer ready. The key does not exist: nothing changes. Sent
        // even when the script failed, and its refusal comes first: a failing script is no
        // outage (the breaker closes on it), a server that takes no writes is.
        let mut write = redis::cmd("PEXPIRE");
        write.arg(ping_key).arg(1);
        self.send("ping", Call::Command(&write))
            .await
            .map_err(|f| f.error)?;
        read
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let topology = match **self.backend.load() {
            Backend::Single { .. } => "single",
            Backend::Cluster { .. } => "cluster",
            Backend::Sentinel(_) => "sentinel",
        };
        f.debug_struct("RedisStore")
            .field("topology", &topology)
            .field("prefix", &self.prefix)
            .field("scripts", &self.scripts_version())
            .field("op_timeout", &self.op_timeout)
            .finish()
    }
}

// === impl Backend ===

impl Backend {
    /// A connection, made now if there is none yet. Concurrent first calls share one attempt;
    /// a failed attempt leaves nothing behind, so the next call tries again.
    async fn conn(&self) -> RedisResult<Arc<Held>> {
        match self {
            Backend::Single {
                client,
                config,
                conn,
            } => {
                let connect = || async {
                    ConnectionManager::new_with_config(client.clone(), config.clone())
                        .await
                        .map(Conn::Manager)
                };
                conn.current().get(connect).await
            }
            Backend::Cluster { client, conn } => {
                let connect = || async { client.get_async_connection().await.map(Conn::Cluster) };
                conn.current().get(connect).await
            }
            Backend::Sentinel(sentinel) => SentinelBackend::conn(sentinel).await,
        }
    }

    /// Lets the backend react to a call that failed on `held` (sent at `sent`), or to a failure
    /// to connect at all (`None`). A connection that went silent is dropped (see [`Held`]), and
    /// so is a single server's that answered as a replica (READONLY: the URL's name or address
    /// has moved to a new primary since it connected); the Sentinel backend also forgets a
    /// primary that was demoted or whose connection broke, and looks it up again. Otherwise
    /// redis-rs reconnects by itself.
    fn on_error(&self, err: &RedisError, used: Option<(&Arc<Held>, Instant)>, quiet: Duration) {
        let silent = used.is_some_and(|(held, sent)| held.silent_since(sent, quiet));
        match self {
            Backend::Single { conn, .. } | Backend::Cluster { conn, .. } => {
                let Some((held, _)) = used else {
                    return;
                };
                if err.is_timeout() && silent {
                    if conn.current().drop_if_current(held) {
                        tracing::warn!(error = %err, "redis connection answered nothing since the call went out; reconnecting");
                    }
                } else if turned_away(err) && conn.current().drop_if_current(held) {
                    tracing::warn!(error = %err, "redis turned the connection away; connecting afresh");
                } else if matches!(self, Backend::Single { .. })
                    && is_read_only(err)
                    && conn.current().drop_if_current(held)
                {
                    // A failover that moved the URL's name or address to the new primary left
                    // this connection on the old one, now a replica. (A Cluster client follows
                    // the slots by itself.)
                    // Throttled: a URL that keeps leading to a replica meets this on every call
                    // the circuit lets through.
                    crate::warn_throttled!(error = %err, "redis answered as a replica; connecting afresh, to where the URL leads now");
                }
            }
            Backend::Sentinel(sentinel) => {
                let demoted = is_read_only(err)
                    || err.kind() == ErrorKind::Server(ServerErrorKind::MasterDown);
                // A slow primary that still answers other calls keeps its connection: a lookup
                // and a new connection per timeout would only slow it further.
                let dead = if err.is_timeout() {
                    silent
                } else {
                    err.is_io_error()
                };
                // Without a connection used (the lookup or the connect failed), there is none
                // to forget: one installed meanwhile by another caller stays.
                if let (Some((held, _)), true) = (used, demoted || dead || turned_away(err)) {
                    sentinel.forget(held);
                }
            }
        }
    }
}

// === impl SentinelBackend ===

impl SentinelBackend {
    fn new(
        urls: &[String],
        config: ConnectionManagerConfig,
        certs: Option<&TlsCertificates>,
    ) -> Result<Self, SetupError> {
        Ok(SentinelBackend {
            sentinel: tokio::sync::Mutex::new(sentinel_client(urls, certs)?),
            config,
            current: parking_lot::Mutex::new(None),
        })
    }

    async fn conn(this: &Arc<Self>) -> RedisResult<Arc<Held>> {
        if let Some(conn) = this.current.lock().clone() {
            return Ok(conn);
        }
        // The lookup runs in a task of its own: a caller whose deadline passes gives up
        // waiting, not the lookup, whose connection the next caller then finds. Cut off with
        // every caller, a lookup slower than one operation's deadline (a dead Sentinel listed
        // first costs redis-rs's own timeouts) would start again from nothing every time.
        let this = Arc::clone(this);
        let lookup = tokio::spawn(async move {
            // One lookup at a time; whoever waited behind it takes its result.
            let mut sentinel = this.sentinel.lock().await;
            if let Some(conn) = this.current.lock().clone() {
                return Ok(conn);
            }
            let client = sentinel.async_get_client().await?;
            let conn = ConnectionManager::new_with_config(client, this.config.clone()).await?;
            let held = Held::new(Conn::Manager(conn));
            *this.current.lock() = Some(held.clone());
            Ok(held)
        });
        lookup.await.unwrap_or_else(|e| {
            Err(RedisError::from(std::io::Error::other(format!(
                "sentinel lookup failed: {e}"
            ))))
        })
    }

    /// Forgets the primary's connection, if it is still `failed`, so the next call looks the
    /// primary up again. A call that failed on a connection already replaced leaves the new
    /// one alone.
    fn forget(&self, failed: &Arc<Held>) {
        take_if_current(&self.current, failed);
    }
}

// === impl Conn ===

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Manager(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Manager(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Manager(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
        }
    }
}

// === impl Call ===

impl<'a> Call<'a> {
    /// `EVALSHA <sha> 1 <key> <args...>` of `version`'s script for `op`.
    fn script(version: &'a Version, op: ScriptOp, key: &'a str, args: &[&[u8]]) -> Self {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg(version.scripts.script(op).get_hash())
            .arg(1)
            .arg(key);
        for arg in args {
            evalsha.arg(*arg);
        }
        Call::Script {
            evalsha,
            text: &version.sources.texts[Scripts::index(op)],
            key,
        }
    }

    /// Sends the call on `held`, noting there whether the server answered.
    async fn send_on(&self, held: &Held) -> RedisResult<Value> {
        let mut conn = held.conn.clone();
        let result = self.send(&mut conn).await;
        let answered = match &result {
            Ok(_) => true,
            Err(err) => !(err.is_timeout() || err.is_io_error() || err.is_connection_dropped()),
        };
        if answered {
            held.answered();
        }
        result
    }

    async fn send(&self, conn: &mut Conn) -> RedisResult<Value> {
        let (evalsha, text, key) = match self {
            Call::Script { evalsha, text, key } => (evalsha, text, key),
            Call::Command(cmd) => return cmd.query_async(conn).await,
        };
        match evalsha.query_async(conn).await {
            Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let load = script_load(text);
                match conn {
                    Conn::Manager(manager) => load.exec_async(manager).await?,
                    // redis-rs sends SCRIPT LOAD to every node of a cluster, replicas too, and
                    // fails unless all take it: one node reconnecting anywhere would leave this
                    // key's healthy shard unable to run its script. Only the primary that owns
                    // the key's slot runs it, so only that one is asked to load it.
                    Conn::Cluster(cluster) => {
                        let slot = Route::with_slot(Slot::for_key(key), SlotAddr::Master);
                        let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(slot));
                        cluster.route_command(load, to).await.map(drop)?;
                        // While the slot migrates, a key not yet moved is asked (`ASK`) of the
                        // importing node, which redis-rs's slot map does not name yet: the load
                        // above went to the old owner and the script is still unknown where
                        // the call lands. `EVAL` with the text follows the redirect like the
                        // call itself and leaves the script cached on whichever node ran it.
                        return match evalsha.query_async(conn).await {
                            Err(err)
                                if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
                            {
                                eval_of(evalsha, text).query_async(conn).await
                            }
                            other => other,
                        };
                    }
                }
                evalsha.query_async(conn).await
            }
            other => other,
        }
    }
}

/// `EVAL <text> ...` with the arguments of `evalsha` (`EVALSHA <sha> ...`).
fn eval_of(evalsha: &Cmd, text: &str) -> Cmd {
    let mut eval = redis::cmd("EVAL");
    eval.arg(text.as_bytes());
    for arg in evalsha.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = arg {
            eval.arg(bytes);
        }
    }
    eval
}

// === encoding of arguments and replies ===

/// The worker-id lease script: see `lua/worker_lease.lua` and [`crate::worker_lease`].
const WORKER_LEASE_SCRIPT: &str = include_str!("../../lua/worker_lease.lua");

/// The admin purge's script: see `lua/purge.lua`.
const PURGE_SCRIPT: &str = include_str!("../../lua/purge.lua");

/// `SCRIPT LOAD <text>`.
fn script_load(text: &str) -> Cmd {
    let mut cmd = redis::cmd("SCRIPT");
    cmd.arg("LOAD").arg(text.as_bytes());
    cmd
}

/// `<prefix>:{<tenant>:<hex hash>}`; the tenant is `[A-Za-z0-9._:-]`, so no brace can end
/// the hash tag early.
pub fn record_key(prefix: &str, key: &RecordKey) -> String {
    let mut out = String::with_capacity(prefix.len() + key.tenant.len() + 4 + 2 * key.hash.len());
    out.push_str(prefix);
    out.push_str(":{");
    out.push_str(&key.tenant);
    out.push(':');
    push_hex(&mut out, &key.hash);
    out.push('}');
    out
}

/// The owner token as 32 lower-case hex digits.
fn owner_arg(owner: OwnerToken) -> String {
    let mut out = String::with_capacity(32);
    push_hex(&mut out, &owner.0.to_be_bytes());
    out
}

/// The write id of `owner`'s completion of `payload` (its encoded answer), 16 hex digits: the
/// same for every send of it (a re-send on a fresh connection, the active version's after a
/// canary failed, the completion retrier's attempts), so a send that landed before is answered
/// "applied" whichever send asks, while another answer from the same owner is not. Hashed, so
/// a completed record, which keeps it, does not keep the owner token.
fn completion_id(owner: OwnerToken, payload: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"complete")
        .chain_update(owner.0.to_be_bytes())
        .chain_update(payload)
        .finalize();
    let mut out = String::with_capacity(16);
    push_hex(&mut out, &digest[..8]);
    out
}

/// A fresh id for one release call (the same for its re-sends): 16 hex digits. A release is
/// sent once, never through the retry queue, and only once by an owner.
fn release_id() -> String {
    let mut out = String::with_capacity(16);
    push_hex(&mut out, &rand::random::<u64>().to_be_bytes());
    out
}

/// Appends `bytes` as lower-case hex ([`key::hex_pair`]).
fn push_hex(out: &mut String, bytes: &[u8]) {
    for &b in bytes {
        out.extend(key::hex_pair(b).map(char::from));
    }
}

/// Whole milliseconds, at least 1 (PEXPIRE 0 would delete the record at once) and capped.
fn millis(duration: Duration) -> u64 {
    duration.as_millis().clamp(1, MAX_TTL_MS) as u64
}

/// Whether a failed call should go out once more on a fresh connection: the connection was
/// dead, or the server turned out to be a demoted primary (the Sentinel backend then looks the
/// new one up), or a Cluster redirect came back to the caller. None of these executed the
/// script, and the scripts tolerate a repeat anyway.
fn worth_resending(err: &RedisError) -> bool {
    err.is_connection_dropped()
        || err.is_connection_refusal()
        || is_read_only(err)
        || is_redirect(err)
}

/// A Cluster redirect (`MOVED`, `ASK`) or `TRYAGAIN` that reached the caller: the Cluster client
/// follows these itself, and hands one on only once its retries ran out, as when the node a
/// redirect names restarted and its old connection failed. The cluster may well be healthy:
/// sent once more, the call is no outage.
fn is_redirect(err: &RedisError) -> bool {
    matches!(
        err.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::TryAgain
        )
    )
}

/// Whether a SCRIPT LOAD was refused by the server (which then answered).
fn is_script_fault_ref(loaded: &RedisResult<String>) -> bool {
    loaded.as_ref().is_err_and(is_script_fault)
}

/// Whether Redis turned a connection away while it was being set up (redis-rs reads any error
/// reply to AUTH as a failed authentication: a password changed on the server, and changed
/// back; a server refusing clients). redis-rs then keeps that failed connection, and answers
/// every later call with the same error: it reconnects after I/O errors only. So the connection
/// is dropped and the next call makes a new one (a password that is really wrong fails the same
/// way each time; the circuit breaker spaces those attempts out).
fn turned_away(err: &RedisError) -> bool {
    err.kind() == ErrorKind::AuthenticationFailed
}

/// READONLY, as its own error kind or (older servers) inside a script error.
fn is_read_only(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || err.to_string().contains("READONLY")
}

/// Whether a failed call is the script's own fault: Redis ran (or compiled) it and answered
/// `ERR` — a Lua runtime error, an unknown command or wrong arguments called from the script,
/// a compile error when NOSCRIPT made the client load it. Not the script's fault: connection
/// loss, timeouts, and the codes in [`NOT_THE_SCRIPTS_FAULT`] (state of the server or of the
/// data), which any version would have met.
fn is_script_fault(err: &RedisError) -> bool {
    if err.kind() != ErrorKind::Server(ServerErrorKind::ResponseError) {
        return false;
    }
    !names_code(&err.to_string(), |word| {
        NOT_THE_SCRIPTS_FAULT.contains(&word)
    })
}

/// Whether an error's text holds a word (an error code such as `OOM`) that `code` accepts:
/// codes come first in a reply, or inside a script error's message.
fn names_code(text: &str, code: impl Fn(&str) -> bool) -> bool {
    text.split(|c: char| !c.is_ascii_alphanumeric()).any(code)
}

/// The sources of the active version and the canary `settings` name.
pub fn find_sources(settings: &ScriptsConfig) -> Result<(Sources, Option<Sources>), SourceError> {
    let dir = settings.dir.as_deref();
    let active = Sources::find(dir, &settings.version)?;
    let canary = settings
        .canary
        .as_ref()
        .map(|c| Sources::find(dir, &c.version))
        .transpose()?;
    Ok((active, canary))
}

/// Identifies a refused change: the settings and the SHAs of the text.
fn refusal_key(settings: &ScriptsConfig, active: &Sources, canary: Option<&Sources>) -> String {
    let shas = |sources: &Sources| format!("{:?}", Scripts::from(sources));
    format!(
        "{settings:?} {} {}",
        shas(active),
        canary.map(shas).unwrap_or_default()
    )
}

fn store_error(op: &str, err: RedisError) -> StoreError {
    // Only a key of the wrong type under our prefix is the data's fault, and only OOM says the
    // store is full; everything else (I/O, timeouts, READONLY, CLUSTERDOWN, LOADING, NOPERM,
    // ...) means Redis cannot serve.
    let text = err.to_string();
    let says = |code: &str| names_code(&text, |word| word == code);
    if says("WRONGTYPE") {
        StoreError::Corrupt(format!(
            "redis {op}: a record key holds another type: {err}"
        ))
    } else if says("OOM") {
        StoreError::OutOfMemory(format!("redis {op}: {err}"))
    } else {
        StoreError::Unavailable(format!("redis {op}: {err}"))
    }
}

/// The reply of `lua/purge.lua`.
fn parse_deletion(reply: Value) -> Result<Deletion, StoreError> {
    match reply {
        Value::Int(1) => Ok(Deletion::Deleted),
        Value::Int(0) => Ok(Deletion::Absent),
        Value::Array(ref items) => match items.as_slice() {
            [Value::Int(ms)] if *ms >= 0 => Ok(Deletion::Running {
                lock_remaining: Duration::from_millis(ms.unsigned_abs()),
            }),
            _ => Err(unexpected("delete", &reply)),
        },
        other => Err(unexpected("delete", &other)),
    }
}

fn unexpected(op: &str, value: &Value) -> StoreError {
    let kind = match value {
        Value::Nil => "nil",
        Value::Int(_) => "an integer",
        Value::BulkString(_) => "a string",
        Value::Array(_) => "an array",
        Value::SimpleString(_) | Value::Okay => "a status",
        _ => "an unexpected value",
    };
    StoreError::Corrupt(format!("redis {op}: the script answered {kind}"))
}

fn parse_read(reply: Value) -> Result<Option<Record>, StoreError> {
    match reply {
        // Lua `false` is nil in RESP2 and a boolean in RESP3 (`?protocol=resp3`).
        Value::Nil | Value::Boolean(false) => Ok(None),
        Value::Array(items) => parse_record(items).map(Some),
        other => Err(unexpected("get", &other)),
    }
}

fn parse_claim(reply: Value) -> Result<ClaimOutcome, StoreError> {
    let Value::Array(mut items) = reply else {
        return Err(unexpected("claim", &reply));
    };
    if items.is_empty() {
        return Err(StoreError::Corrupt("redis claim: empty reply".into()));
    }
    let rest = items.split_off(1);
    match items.pop() {
        Some(Value::Int(1)) => match rest.split_first() {
            Some((id, more)) => Ok(ClaimOutcome::Acquired {
                execution_id: execution_id(id)?,
                // Optional: a version that leaves it out never says so.
                lapsed: matches!(more.first(), Some(Value::BulkString(b)) if b == b"l"),
            }),
            None => Err(StoreError::Corrupt(
                "redis claim: acquired without an execution id".into(),
            )),
        },
        Some(Value::Int(0)) => parse_record(rest).map(ClaimOutcome::Existing),
        _ => Err(StoreError::Corrupt("redis claim: unknown reply tag".into())),
    }
}

/// `{fingerprint, execution_id, state, lock_ms, payload}` as `claim.lua` and `get.lua` send it,
/// optionally followed by `life_ms`: what is left of the record's life (`PTTL`), which the
/// built-in `claim.lua` and `get.lua` scripts add to a completed record so a replica may keep a
/// local copy of it. A version of the operator's that leaves it out still works; its completed records are
/// then not copied locally.
fn parse_record(mut items: Vec<Value>) -> Result<Record, StoreError> {
    let life_ms = match items.len() {
        6 => items.pop(),
        _ => None,
    };
    let [fingerprint, id, state, lock_ms, payload]: [Value; 5] =
        items.try_into().map_err(|items: Vec<Value>| {
            StoreError::Corrupt(format!(
                "record has {} fields instead of 5 or 6",
                items.len()
            ))
        })?;
    // `PTTL` answers -1 for a key without an expiry and -2 for one that is gone: no life to copy.
    let expires_in = match life_ms {
        None => None,
        Some(Value::Int(ms)) => u64::try_from(ms)
            .ok()
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis),
        Some(_) => return Err(StoreError::Corrupt("record life is not an integer".into())),
    };
    let fingerprint: Digest = match &fingerprint {
        Value::BulkString(bytes) => bytes
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Corrupt("record fingerprint is not 32 bytes".into()))?,
        _ => return Err(StoreError::Corrupt("record has no fingerprint".into())),
    };
    let execution_id = execution_id(&id)?;
    let state = match (&state, lock_ms, payload) {
        (Value::BulkString(s), Value::Int(ms), _) if s == b"i" => RecordState::InFlight {
            lock_remaining: Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        },
        (Value::BulkString(s), _, _) if s == b"r" => RecordState::Released,
        (Value::BulkString(s), _, Value::BulkString(payload)) if s == b"c" => {
            RecordState::Completed(codec::decode(&Bytes::from(payload))?)
        }
        _ => return Err(StoreError::Corrupt("record state is malformed".into())),
    };
    // Only a completed record is ever copied; any other state's life means nothing to the caller.
    let expires_in = expires_in.filter(|_| matches!(state, RecordState::Completed(_)));
    Ok(Record {
        fingerprint,
        execution_id,
        state,
        expires_in,
    })
}

fn execution_id(value: &Value) -> Result<u64, StoreError> {
    match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| StoreError::Corrupt("record execution id is not a u64".into())),
        _ => Err(StoreError::Corrupt("record has no execution id".into())),
    }
}

fn parse_write(op: &str, reply: Value) -> Result<WriteOutcome, StoreError> {
    match reply {
        Value::Int(1) => Ok(WriteOutcome::Applied),
        Value::Int(0) => Ok(WriteOutcome::NotOwner),
        other => Err(unexpected(op, &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(bytes: &[u8]) -> Value {
        Value::BulkString(bytes.to_vec())
    }

    /// The error a reply of `text` (RESP, one line) makes.
    fn reply_error(text: &str) -> RedisError {
        let reply = redis::parse_redis_value(format!("-{text}\r\n").as_bytes()).unwrap();
        reply.extract_error().unwrap_err()
    }

    /// A redirect the Cluster client gave up following (`Moved: 10860 127.0.0.1:27002` came
    /// back when the node it names had restarted) is sent once more, not taken for an outage;
    /// other server errors are answers.
    #[test]
    fn a_redirect_handed_back_by_the_cluster_client_is_sent_again() {
        for text in [
            "MOVED 10860 127.0.0.1:27002",
            "ASK 3999 10.0.0.2:6379",
            "TRYAGAIN x",
        ] {
            let err = reply_error(text);
            assert!(is_redirect(&err) && worth_resending(&err), "{text}: {err}");
        }
        for text in [
            "CLUSTERDOWN The cluster is down",
            "OOM no",
            "ERR x",
            "NOSCRIPT x",
        ] {
            let err = reply_error(text);
            assert!(!worth_resending(&err), "{text}: {err}");
        }
        assert!(worth_resending(&reply_error("READONLY You can't write")));
    }

    /// The slot Redis gives a key: CRC16 (XMODEM) of its hash tag, or of the whole key (the
    /// check value of the algorithm, and the examples of the Cluster specification).
    #[test]
    fn cluster_slots_are_computed_as_redis_computes_them() {
        assert_eq!(cluster_slot(b"123456789"), 0x31C3);
        assert_eq!(cluster_slot(b"foo"), 12182);
        assert_eq!(
            cluster_slot(b"{user1000}.following"),
            cluster_slot(b"user1000")
        );
        // An empty tag: the whole key is hashed.
        assert_ne!(cluster_slot(b"foo{}{bar}"), cluster_slot(b"bar"));
        assert_ne!(cluster_slot(b"foo{}{bar}"), cluster_slot(b""));
        assert_eq!(cluster_slot(b"foo{{bar}}zap"), cluster_slot(b"{bar"));
        assert_eq!(cluster_slot(b"foo{bar}{zap}"), cluster_slot(b"bar"));
        // A record's slot, computed without its key, is its key's.
        for n in 0..=255u8 {
            let key = RecordKey {
                tenant: format!("acme-{n}.eu:blue"),
                hash: [n.wrapping_mul(37); 32],
            };
            assert_eq!(
                record_slot(&key),
                cluster_slot(record_key("idemgate", &key).as_bytes())
            );
        }
    }

    /// Every part of the slot space has a probe key in it, and no record key can be one.
    #[test]
    fn each_part_of_a_cluster_has_a_probe_key_of_its_own() {
        let keys = part_ping_keys("idemgate");
        assert_eq!(keys.len(), CLUSTER_PARTS);
        for (part, key) in keys.iter().enumerate() {
            assert_eq!(cluster_part(cluster_slot(key.as_bytes())), part, "{key}");
            assert!(key.starts_with("idemgate:{__idemgate_ping__"), "{key}");
        }
        assert_eq!(cluster_part(0), 0);
        assert_eq!(cluster_part(16383), CLUSTER_PARTS - 1);
    }

    #[test]
    fn record_keys_carry_only_prefix_tenant_and_hex_hash() {
        let key = RecordKey {
            tenant: "acme.eu-1:blue".into(),
            hash: [0xAB; 32],
        };
        assert_eq!(
            record_key("idemgate", &key),
            format!("idemgate:{{acme.eu-1:blue:{}}}", "ab".repeat(32))
        );
    }

    #[test]
    fn hex_arguments_are_what_format_would_write() {
        let hash: [u8; 32] = std::array::from_fn(|i| (i * 37 + 5) as u8);
        let key = RecordKey {
            tenant: "t".into(),
            hash,
        };
        assert_eq!(
            record_key("p", &key),
            format!("p:{{t:{}}}", hex::encode(hash))
        );
        for v in [
            0u128,
            1,
            0xdead_beef,
            u128::MAX,
            0x0123_4567_89ab_cdef_0011_2233_4455_6677,
        ] {
            assert_eq!(owner_arg(OwnerToken(v)), format!("{v:032x}"));
        }
        let id = completion_id(OwnerToken(7), b"answer");
        assert_eq!(id.len(), 16);
        assert!(
            id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
            "{id}"
        );
        // One per owner and answer, the same every time it is asked.
        assert_eq!(id, completion_id(OwnerToken(7), b"answer"));
        assert_ne!(id, completion_id(OwnerToken(8), b"answer"));
        assert_ne!(id, completion_id(OwnerToken(7), b"another"));
        assert_ne!(release_id(), release_id());
    }

    #[test]
    fn arguments_are_bounded() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_TTL_MS as u64);
        assert_eq!(owner_arg(OwnerToken(1)).len(), 32);
        assert_eq!(release_id().len(), 16);
    }

    #[test]
    fn replies_parse() {
        let acquired = Value::Array(vec![Value::Int(1), bulk(b"42")]);
        assert_eq!(
            parse_claim(acquired).unwrap(),
            ClaimOutcome::Acquired {
                execution_id: 42,
                lapsed: false
            }
        );
        // A lapsed takeover says so in an optional third element; anything else there is not it.
        for (third, lapsed) in [(&b"l"[..], true), (b"x", false), (b"", false)] {
            let reply = Value::Array(vec![Value::Int(1), bulk(b"42"), bulk(third)]);
            assert_eq!(
                parse_claim(reply).unwrap(),
                ClaimOutcome::Acquired {
                    execution_id: 42,
                    lapsed
                }
            );
        }
        let payload = codec::encode(&Completion::Unreplayable { status: 201 });
        let existing = Value::Array(vec![
            Value::Int(0),
            bulk(&[9; 32]),
            bulk(b"7"),
            bulk(b"c"),
            Value::Int(0),
            Value::BulkString(payload),
        ]);
        assert_eq!(
            parse_claim(existing).unwrap(),
            ClaimOutcome::Existing(Record {
                fingerprint: [9; 32],
                execution_id: 7,
                state: RecordState::Completed(Completion::Unreplayable { status: 201 }),
                expires_in: None,
            })
        );
        // A completed record may come with what is left of its life; none when the key
        // has no expiry (-1) or is gone (-2), and none for a record that is not completed.
        let with_life = |state: &[u8], life: Value| {
            let payload = codec::encode(&Completion::Unreplayable { status: 201 });
            let reply = vec![
                bulk(&[9; 32]),
                bulk(b"7"),
                bulk(state),
                Value::Int(0),
                Value::BulkString(if state == b"c" { payload } else { vec![] }),
                life,
            ];
            parse_record(reply).map(|r| r.expires_in)
        };
        assert_eq!(
            with_life(b"c", Value::Int(1500)).unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(with_life(b"c", Value::Int(-1)).unwrap(), None);
        assert_eq!(with_life(b"c", Value::Int(-2)).unwrap(), None);
        assert_eq!(with_life(b"c", Value::Int(0)).unwrap(), None);
        assert_eq!(with_life(b"r", Value::Int(1500)).unwrap(), None);
        assert!(matches!(
            with_life(b"c", bulk(b"1500")),
            Err(StoreError::Corrupt(_))
        ));
        let in_flight = vec![
            bulk(&[1; 32]),
            bulk(b"8"),
            bulk(b"i"),
            Value::Int(250),
            bulk(b""),
        ];
        assert_eq!(
            parse_record(in_flight).unwrap().state,
            RecordState::InFlight {
                lock_remaining: Duration::from_millis(250)
            }
        );
        assert_eq!(
            parse_write("complete", Value::Int(1)).unwrap(),
            WriteOutcome::Applied
        );
        assert_eq!(
            parse_write("release", Value::Int(0)).unwrap(),
            WriteOutcome::NotOwner
        );
    }

    #[test]
    fn purge_replies_parse_and_odd_ones_are_corrupt() {
        assert_eq!(parse_deletion(Value::Int(1)).unwrap(), Deletion::Deleted);
        assert_eq!(parse_deletion(Value::Int(0)).unwrap(), Deletion::Absent);
        assert_eq!(
            parse_deletion(Value::Array(vec![Value::Int(1500)])).unwrap(),
            Deletion::Running {
                lock_remaining: Duration::from_millis(1500)
            }
        );
        // In flight with its lock lapsed: still spared.
        assert_eq!(
            parse_deletion(Value::Array(vec![Value::Int(0)])).unwrap(),
            Deletion::Running {
                lock_remaining: Duration::ZERO
            }
        );
        for odd in [
            Value::Int(2),
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(-5)]),
            Value::Array(vec![Value::Int(5), Value::Int(5)]),
            Value::Array(vec![bulk(b"5")]),
        ] {
            assert!(
                matches!(parse_deletion(odd.clone()), Err(StoreError::Corrupt(_))),
                "{odd:?}"
            );
        }
    }

    #[test]
    fn malformed_replies_are_corrupt_not_panics() {
        let cases = [
            Value::Nil,
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Int(1), bulk(b"-3")]),
            Value::Array(vec![Value::Int(2), bulk(b"1")]),
            Value::Array(vec![Value::Int(0), bulk(&[1; 32])]),
            Value::Array(vec![
                Value::Int(0),
                bulk(&[1; 31]),
                bulk(b"1"),
                bulk(b"r"),
                Value::Int(0),
                bulk(b""),
            ]),
            Value::Array(vec![
                Value::Int(0),
                bulk(&[1; 32]),
                bulk(b"1"),
                bulk(b"x"),
                Value::Int(0),
                bulk(b""),
            ]),
            Value::Array(vec![
                Value::Int(0),
                bulk(&[1; 32]),
                bulk(b"1"),
                bulk(b"c"),
                Value::Int(0),
                bulk(b"\x09garbage"),
            ]),
            Value::Array(vec![
                Value::Int(0),
                bulk(&[1; 32]),
                Value::Nil,
                bulk(b"i"),
                Value::Int(5),
                bulk(b""),
            ]),
            // One field too many, even for a reply that tells the record's life.
            Value::Array(vec![
                Value::Int(0),
                bulk(&[1; 32]),
                bulk(b"1"),
                bulk(b"r"),
                Value::Int(0),
                bulk(b""),
                Value::Int(1000),
                Value::Int(1000),
            ]),
        ];
        for reply in cases {
            let debug = format!("{reply:?}");
            assert!(
                matches!(parse_claim(reply), Err(StoreError::Corrupt(_))),
                "{debug}"
            );
        }
        assert!(matches!(
            parse_write("complete", Value::Okay),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn builtin_scripts_are_v1() {
        // Headers and contracts of every built-in version are checked in `crate::scripts`.
        let builtin = Scripts::builtin();
        assert_eq!(builtin.version, BUILTIN_SCRIPTS_VERSION);
        let v1 = Sources::builtin(BUILTIN_SCRIPTS_VERSION).unwrap();
        assert_eq!(
            builtin.claim.get_hash(),
            Scripts::from(&v1).claim.get_hash()
        );
    }

    #[test]
    fn only_errors_of_the_script_itself_count_against_it() {
        let server = |code: &str, detail: &str| {
            let text = format!("-{code} {detail}\r\n");
            match redis::parse_redis_value(text.as_bytes()) {
                Ok(Value::ServerError(e)) => RedisError::from(e),
                other => panic!("{other:?}"),
            }
        };
        for (code, detail) in [
            (
                "ERR",
                "user_script:1: attempt to perform arithmetic on a nil value script: abc",
            ),
            (
                "ERR",
                "Unknown Redis command called from script script: abc",
            ),
            (
                "ERR",
                "Error compiling script (new function): user_script:1: unexpected symbol",
            ),
            (
                "ERR",
                "Wrong number of args calling Redis command from script",
            ),
        ] {
            assert!(is_script_fault(&server(code, detail)), "{code} {detail}");
        }
        for (code, detail) in [
            ("READONLY", "You can't write against a read only replica."),
            (
                "WRONGTYPE",
                "Operation against a key holding the wrong kind of value",
            ),
            ("OOM", "command not allowed when used memory > 'maxmemory'."),
            ("NOSCRIPT", "No matching script."),
            ("BUSY", "Redis is busy running a script."),
            ("LOADING", "Redis is loading the dataset in memory"),
            ("NOREPLICAS", "Not enough good replicas to write."),
            (
                "MISCONF",
                "Redis is configured to save RDB snapshots, but it's currently unable to persist",
            ),
            ("MASTERDOWN", "Link with MASTER is down and replica-serve-stale-data is set"),
            ("CLUSTERDOWN", "The cluster is down"),
            ("TRYAGAIN", "Multiple keys request during rehashing of slot"),
            (
                "ERR",
                "Error running script (call to f_1): @user_script:8: -NOREPLICAS Not enough good replicas to write.",
            ),
            (
                "ERR",
                "Error running script (call to f_1): @user_script:8: -MISCONF Redis is configured to save RDB snapshots",
            ),
            (
                "NOPERM",
                "this user has no permissions to run the 'evalsha' command",
            ),
            (
                "ERR",
                "Error running script (call to f_1): @user_script:12: -READONLY You can't write",
            ),
            (
                "ERR",
                "Error running script: @user_script:3: -OOM command not allowed",
            ),
        ] {
            assert!(!is_script_fault(&server(code, detail)), "{code} {detail}");
        }
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!is_script_fault(&io));
    }
}
