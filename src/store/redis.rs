//! The Redis record store: each record is one hash driven by the Lua scripts in `lua/v1/`,
//! one round trip per phase, on a single server, a Redis Cluster or a Sentinel-managed primary.
//!
//! Keys are `<prefix>:{<tenant>:<hex hash>}`: the braces are the Cluster hash tag, and as every
//! script touches exactly one key (passed in `KEYS`) no call can ever be CROSSSLOT. The raw
//! idempotency key never reaches Redis, only its scoped SHA-256. Record fields are listed in
//! `lua/v1/claim.lua`.
//!
//! Scripts are called with EVALSHA through [`redis::Script`], which answers NOSCRIPT (restart,
//! failover, `SCRIPT FLUSH`) by loading the script and sending it again. Lock lapse is decided
//! by the Redis server's clock (`TIME` inside the scripts), so proxies with skewed clocks agree.
//!
//! Failure handling: every operation is bounded by `connect_timeout + 2 × response_timeout`
//! and then fails as [`StoreError::Unavailable`]. An operation whose connection turns out to be
//! dead (Redis restarted, failed over) is sent once more on a fresh connection. That re-send is
//! safe even when the first send did reach Redis: a claim by the same owner re-acquires, and
//! complete/release carry a random write id the scripts remember, so a repeated write answers
//! "applied" instead of "not owner".
//!
//! Connections are made on first use, not at construction, so the proxy starts while Redis is
//! down; [`RedisStore::connect`] warms them up (and loads the scripts) when called.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Cmd, ConnectionAddr, ErrorKind, RedisConnectionInfo, RedisError, RedisFuture, RedisResult,
    Script, ScriptInvocation, ServerErrorKind, Value,
};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::{
    codec, ClaimOutcome, ClaimRequest, Completion, Digest, OwnerToken, Record, RecordKey,
    RecordState, RecordStore, StoreError, WriteOutcome,
};
use crate::config::{parse_sentinel_url, redact_url, RedisConfig, RedisTopology};

/// Version name of the scripts compiled into this binary.
pub const BUILTIN_SCRIPTS_VERSION: &str = "v1";

/// First pause of `wait_for_change`'s polling; it doubles up to [`POLL_MAX`].
const POLL_START: Duration = Duration::from_millis(5);
/// Longest pause between two polls of `wait_for_change`.
const POLL_MAX: Duration = Duration::from_millis(100);
/// Durations sent to the scripts are capped here: Lua numbers are doubles, and a century is
/// more than any record needs.
const MAX_TTL_MS: u128 = 100 * 365 * 24 * 3600 * 1000;
/// Reconnect attempts the connection manager makes per connection; the operation deadline
/// bounds the waiting anyway, and the next operation starts a new round.
const RECONNECT_RETRIES: usize = 1;

/// Why the Redis store could not be set up from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A URL the config validation let through was refused by the client library.
    #[error("store.redis.urls: {0}")]
    Invalid(String),
}

/// One version of the store's Lua scripts. Swapped as a whole (see
/// [`RedisStore::set_scripts`]), so a call never mixes two versions.
pub struct Scripts {
    /// Version name, for logs and metrics (e.g. `v1`).
    pub version: String,
    /// `claim.lua`: claim or read, one atomic step.
    pub claim: Script,
    /// `complete.lua`: compare-and-set of the completion on the owner token.
    pub complete: Script,
    /// `release.lua`: compare-and-set of the release on the owner token.
    pub release: Script,
    /// `get.lua`: read with the lock's remaining time by the server clock; also the readiness
    /// probe's script path.
    pub get: Script,
}

/// The [`RecordStore`] on Redis.
pub struct RedisStore {
    backend: Backend,
    scripts: ArcSwap<Scripts>,
    prefix: String,
    /// Deadline of one whole operation, re-send and reconnect included.
    op_timeout: Duration,
    /// Where the readiness probe runs the get script: a key no record can have.
    ping_key: String,
}

/// How connections are obtained, per topology. Each connects on first use and keeps itself
/// connected afterwards (the Sentinel one re-resolves the primary when it fails).
enum Backend {
    Single {
        client: redis::Client,
        config: ConnectionManagerConfig,
        conn: OnceCell<ConnectionManager>,
    },
    Cluster {
        client: ClusterClient,
        conn: OnceCell<ClusterConnection>,
    },
    Sentinel(SentinelBackend),
}

/// A primary found through Sentinel, kept until it fails, then looked up again.
struct SentinelBackend {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    config: ConnectionManagerConfig,
    current: parking_lot::Mutex<Option<ConnectionManager>>,
}

/// A connection handle for one call: cheap to clone, shared with other calls.
#[derive(Clone)]
enum Conn {
    Manager(ConnectionManager),
    Cluster(ClusterConnection),
}

/// What one operation sends.
enum Call<'a> {
    Script(&'a ScriptInvocation<'a>),
    Command(&'a Cmd),
}

// === impl Scripts ===

impl Scripts {
    /// The scripts compiled into this binary from `lua/v1/`.
    pub fn builtin() -> Self {
        Scripts::from_sources(
            BUILTIN_SCRIPTS_VERSION,
            include_str!("../../lua/v1/claim.lua"),
            include_str!("../../lua/v1/complete.lua"),
            include_str!("../../lua/v1/release.lua"),
            include_str!("../../lua/v1/get.lua"),
        )
    }

    /// Scripts from their source text (for versions loaded at run time).
    pub fn from_sources(
        version: &str,
        claim: &str,
        complete: &str,
        release: &str,
        get: &str,
    ) -> Self {
        Scripts {
            version: version.to_owned(),
            claim: Script::new(claim),
            complete: Script::new(complete),
            release: Script::new(release),
            get: Script::new(get),
        }
    }

    fn all(&self) -> [&Script; 4] {
        [&self.claim, &self.complete, &self.release, &self.get]
    }
}

impl fmt::Debug for Scripts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scripts")
            .field("version", &self.version)
            .field("claim", &self.claim.get_hash())
            .field("complete", &self.complete.get_hash())
            .field("release", &self.release.get_hash())
            .field("get", &self.get.get_hash())
            .finish()
    }
}

// === impl RedisStore ===

impl RedisStore {
    /// A store for validated settings, with the built-in scripts. Connects nothing: the first
    /// operation (or [`RedisStore::connect`]) does, so this succeeds while Redis is down.
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
        let refused =
            |url: &str, err: RedisError| SetupError::Invalid(format!("{}: {err}", redact_url(url)));

        let backend = match config.topology {
            RedisTopology::Single => {
                let url = config.urls.first().map(String::as_str).unwrap_or_default();
                Backend::Single {
                    client: redis::Client::open(url).map_err(|e| refused(url, e))?,
                    config: manager_config,
                    conn: OnceCell::new(),
                }
            }
            RedisTopology::Cluster => {
                let client = ClusterClientBuilder::new(config.urls.iter().map(String::as_str))
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.response_timeout)
                    .overall_response_timeout(Some(op_timeout))
                    .retries(2)
                    .build()
                    .map_err(|e| SetupError::Invalid(e.to_string()))?;
                Backend::Cluster {
                    client,
                    conn: OnceCell::new(),
                }
            }
            RedisTopology::Sentinel => {
                Backend::Sentinel(SentinelBackend::new(&config.urls, manager_config)?)
            }
        };
        Ok(RedisStore {
            backend,
            scripts: ArcSwap::from_pointee(Scripts::builtin()),
            ping_key: format!("{}:{{__idemgate_ping__}}", config.key_prefix),
            prefix: config.key_prefix.clone(),
            op_timeout,
        })
    }

    /// Connects (if not yet connected) and loads every script, so the first requests pay no
    /// NOSCRIPT round trip. On a cluster the scripts go to every primary.
    pub async fn connect(&self) -> Result<(), StoreError> {
        let scripts = self.scripts.load_full();
        let attempt = async {
            let mut conn = self.backend.conn().await?;
            for script in scripts.all() {
                script.prepare_invoke().load_async(&mut conn).await?;
            }
            Ok::<_, RedisError>(())
        };
        match tokio::time::timeout(self.op_timeout, attempt).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => {
                self.backend.on_error(&err);
                Err(store_error("connect", err))
            }
            Err(_) => Err(self.timed_out("connect")),
        }
    }

    /// Swaps in another version of the scripts; calls already running finish on the old one.
    pub fn set_scripts(&self, scripts: Scripts) {
        self.scripts.store(Arc::new(scripts));
    }

    /// Version name of the scripts in use.
    pub fn scripts_version(&self) -> String {
        self.scripts.load().version.clone()
    }

    /// The Redis key of a record: `<prefix>:{<tenant>:<hex hash>}`.
    pub fn record_key(&self, key: &RecordKey) -> String {
        record_key(&self.prefix, key)
    }

    /// Sends one call, re-sending it once on a fresh connection if the first connection was
    /// dead, all within the operation deadline.
    async fn send(&self, op: &'static str, call: Call<'_>) -> Result<Value, StoreError> {
        let attempt = async {
            let mut conn = self.backend.conn().await?;
            match call.send(&mut conn).await {
                Err(err) if worth_resending(&err) => {
                    tracing::debug!(op, error = %err, "redis connection lost; sending again");
                    self.backend.on_error(&err);
                    let mut conn = self.backend.conn().await?;
                    call.send(&mut conn).await
                }
                other => other,
            }
        };
        match tokio::time::timeout(self.op_timeout, attempt).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => {
                self.backend.on_error(&err);
                Err(store_error(op, err))
            }
            Err(_) => Err(self.timed_out(op)),
        }
    }

    fn timed_out(&self, op: &str) -> StoreError {
        StoreError::Unavailable(format!(
            "redis {op}: no answer within {}ms",
            self.op_timeout.as_millis()
        ))
    }

    async fn read(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let scripts = self.scripts.load_full();
        let mut call = scripts.get.prepare_invoke();
        call.key(self.record_key(key));
        match self.send("get", Call::Script(&call)).await? {
            // Lua `false` is nil in RESP2 and a boolean in RESP3 (`?protocol=resp3`).
            Value::Nil | Value::Boolean(false) => Ok(None),
            Value::Array(items) => parse_record(items).map(Some),
            other => Err(unexpected("get", &other)),
        }
    }
}

#[async_trait]
impl RecordStore for RedisStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let scripts = self.scripts.load_full();
        let mut call = scripts.claim.prepare_invoke();
        call.key(self.record_key(&req.key))
            .arg(&req.fingerprint[..])
            .arg(owner_arg(req.owner))
            .arg(req.execution_id.to_string())
            .arg(millis(req.lock_ttl))
            .arg(millis(req.ttl));
        let reply = self.send("claim", Call::Script(&call)).await?;
        parse_claim(reply)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let scripts = self.scripts.load_full();
        let mut call = scripts.complete.prepare_invoke();
        call.key(self.record_key(key))
            .arg(owner_arg(owner))
            .arg(codec::encode(&completion))
            .arg(millis(ttl))
            .arg(write_id());
        let reply = self.send("complete", Call::Script(&call)).await?;
        parse_write("complete", reply)
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        let scripts = self.scripts.load_full();
        let mut call = scripts.release.prepare_invoke();
        call.key(self.record_key(key))
            .arg(owner_arg(owner))
            .arg(write_id());
        let reply = self.send("release", Call::Script(&call)).await?;
        parse_write("release", reply)
    }

    /// Polls with bounded exponential backoff: 5 ms doubling to 100 ms, never sleeping past
    /// the lock's lapse or the timeout. Chosen over pub/sub because it needs no subscriber
    /// connection per node (which Cluster and failover make fiddly), it holds no connection
    /// while it sleeps (waiters share the multiplexed connection, so many duplicates cannot
    /// exhaust a pool), and it costs a waiter at most ~10 reads a second. The price is up to
    /// 100 ms of extra latency for a waiter whose original runs long.
    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        let started = Instant::now();
        let mut pause = POLL_START;
        loop {
            let record = self.read(key).await?;
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
        match self.send("delete", Call::Command(&cmd)).await? {
            Value::Int(removed) => Ok(removed > 0),
            other => Err(unexpected("delete", &other)),
        }
    }

    /// Runs the get script (EVALSHA) on a key no record uses: a server that answers PING but
    /// cannot run scripts (ACL, broken script cache that cannot be reloaded) is not ready.
    async fn ping(&self) -> Result<(), StoreError> {
        let scripts = self.scripts.load_full();
        let mut call = scripts.get.prepare_invoke();
        call.key(&self.ping_key);
        match self.send("ping", Call::Script(&call)).await? {
            Value::Nil | Value::Boolean(false) => Ok(()),
            other => Err(unexpected("ping", &other)),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let topology = match self.backend {
            Backend::Single { .. } => "single",
            Backend::Cluster { .. } => "cluster",
            Backend::Sentinel(_) => "sentinel",
        };
        f.debug_struct("RedisStore")
            .field("topology", &topology)
            .field("prefix", &self.prefix)
            .field("scripts", &self.scripts.load().version)
            .field("op_timeout", &self.op_timeout)
            .finish()
    }
}

// === impl Backend ===

impl Backend {
    /// A connection, made now if there is none yet. Concurrent first calls share one attempt;
    /// a failed attempt leaves nothing behind, so the next call tries again.
    async fn conn(&self) -> RedisResult<Conn> {
        match self {
            Backend::Single {
                client,
                config,
                conn,
            } => {
                let manager = conn
                    .get_or_try_init(|| {
                        ConnectionManager::new_with_config(client.clone(), config.clone())
                    })
                    .await?;
                Ok(Conn::Manager(manager.clone()))
            }
            Backend::Cluster { client, conn } => {
                let cluster = conn
                    .get_or_try_init(|| client.get_async_connection())
                    .await?;
                Ok(Conn::Cluster(cluster.clone()))
            }
            Backend::Sentinel(sentinel) => sentinel.conn().await.map(Conn::Manager),
        }
    }

    /// Lets the backend react to a failed call: the Sentinel backend forgets a primary that
    /// stopped answering or was demoted. The others reconnect by themselves.
    fn on_error(&self, err: &RedisError) {
        if let Backend::Sentinel(sentinel) = self {
            let demoted =
                is_read_only(err) || err.kind() == ErrorKind::Server(ServerErrorKind::MasterDown);
            if demoted || err.is_io_error() || err.is_timeout() {
                sentinel.forget();
            }
        }
    }
}

// === impl SentinelBackend ===

impl SentinelBackend {
    fn new(urls: &[String], config: ConnectionManagerConfig) -> Result<Self, SetupError> {
        let mut sentinels = Vec::new();
        let mut primary = None;
        for url in urls {
            let parsed = parse_sentinel_url(url).map_err(SetupError::Invalid)?;
            sentinels.extend(
                parsed
                    .sentinels
                    .iter()
                    .map(|(host, port)| ConnectionAddr::Tcp(host.clone(), *port)),
            );
            primary.get_or_insert(parsed);
        }
        let primary = primary.ok_or_else(|| SetupError::Invalid("no Sentinel URL".into()))?;
        let mut redis_info = RedisConnectionInfo::default().set_db(primary.db);
        if let Some(user) = &primary.username {
            redis_info = redis_info.set_username(user);
        }
        if let Some(password) = &primary.password {
            redis_info = redis_info.set_password(password);
        }
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(redis_info);
        let client = SentinelClient::build(
            sentinels,
            primary.master.clone(),
            Some(node),
            SentinelServerType::Master,
        )
        .map_err(|e| SetupError::Invalid(e.to_string()))?;
        Ok(SentinelBackend {
            sentinel: tokio::sync::Mutex::new(client),
            config,
            current: parking_lot::Mutex::new(None),
        })
    }

    async fn conn(&self) -> RedisResult<ConnectionManager> {
        if let Some(conn) = self.current.lock().clone() {
            return Ok(conn);
        }
        // One lookup at a time; whoever waited behind it takes its result.
        let mut sentinel = self.sentinel.lock().await;
        if let Some(conn) = self.current.lock().clone() {
            return Ok(conn);
        }
        let client = sentinel.async_get_client().await?;
        let conn = ConnectionManager::new_with_config(client, self.config.clone()).await?;
        *self.current.lock() = Some(conn.clone());
        Ok(conn)
    }

    fn forget(&self) {
        self.current.lock().take();
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

impl Call<'_> {
    async fn send(&self, conn: &mut Conn) -> RedisResult<Value> {
        match self {
            // EVALSHA; on NOSCRIPT, SCRIPT LOAD and EVALSHA again.
            Call::Script(invocation) => invocation.invoke_async(conn).await,
            Call::Command(cmd) => cmd.query_async(conn).await,
        }
    }
}

// === encoding of arguments and replies ===

/// `<prefix>:{<tenant>:<hex hash>}`; the tenant is `[A-Za-z0-9._:-]`, so no brace can end
/// the hash tag early.
pub fn record_key(prefix: &str, key: &RecordKey) -> String {
    format!("{prefix}:{{{}:{}}}", key.tenant, hex::encode(key.hash))
}

fn owner_arg(owner: OwnerToken) -> String {
    format!("{:032x}", owner.0)
}

/// A fresh id for one complete/release call (the same for its re-send).
fn write_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Whole milliseconds, at least 1 (PEXPIRE 0 would delete the record at once) and capped.
fn millis(duration: Duration) -> u64 {
    duration.as_millis().clamp(1, MAX_TTL_MS) as u64
}

/// Whether a failed call should go out once more on a fresh connection: the connection was
/// dead, or the server turned out to be a demoted primary (the Sentinel backend then looks the
/// new one up). Neither case executed the script, and the scripts tolerate a repeat anyway.
fn worth_resending(err: &RedisError) -> bool {
    err.is_connection_dropped() || err.is_connection_refusal() || is_read_only(err)
}

/// READONLY, as its own error kind or (older servers) inside a script error.
fn is_read_only(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || err.to_string().contains("READONLY")
}

fn store_error(op: &str, err: RedisError) -> StoreError {
    // Only a key of the wrong type under our prefix is the data's fault; everything else
    // (I/O, timeouts, READONLY, CLUSTERDOWN, LOADING, NOPERM, ...) means Redis cannot serve.
    if err.to_string().contains("WRONGTYPE") {
        StoreError::Corrupt(format!(
            "redis {op}: a record key holds another type: {err}"
        ))
    } else {
        StoreError::Unavailable(format!("redis {op}: {err}"))
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

fn parse_claim(reply: Value) -> Result<ClaimOutcome, StoreError> {
    let Value::Array(mut items) = reply else {
        return Err(unexpected("claim", &reply));
    };
    if items.is_empty() {
        return Err(StoreError::Corrupt("redis claim: empty reply".into()));
    }
    let rest = items.split_off(1);
    match items.pop() {
        Some(Value::Int(1)) => match rest.into_iter().next() {
            Some(id) => Ok(ClaimOutcome::Acquired {
                execution_id: execution_id(&id)?,
            }),
            None => Err(StoreError::Corrupt(
                "redis claim: acquired without an execution id".into(),
            )),
        },
        Some(Value::Int(0)) => parse_record(rest).map(ClaimOutcome::Existing),
        _ => Err(StoreError::Corrupt("redis claim: unknown reply tag".into())),
    }
}

/// `{fingerprint, execution_id, state, lock_ms, payload}` as `claim.lua` and `get.lua` send it.
fn parse_record(items: Vec<Value>) -> Result<Record, StoreError> {
    let [fingerprint, id, state, lock_ms, payload]: [Value; 5] =
        items.try_into().map_err(|items: Vec<Value>| {
            StoreError::Corrupt(format!("record has {} fields instead of 5", items.len()))
        })?;
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
    Ok(Record {
        fingerprint,
        execution_id,
        state,
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
    fn arguments_are_bounded() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_TTL_MS as u64);
        assert_eq!(owner_arg(OwnerToken(1)).len(), 32);
        assert_eq!(write_id().len(), 16);
    }

    #[test]
    fn replies_parse() {
        let acquired = Value::Array(vec![Value::Int(1), bulk(b"42")]);
        assert_eq!(
            parse_claim(acquired).unwrap(),
            ClaimOutcome::Acquired { execution_id: 42 }
        );
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
            })
        );
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
    fn builtin_scripts_open_with_their_contract() {
        for source in [
            include_str!("../../lua/v1/claim.lua"),
            include_str!("../../lua/v1/complete.lua"),
            include_str!("../../lua/v1/release.lua"),
            include_str!("../../lua/v1/get.lua"),
        ] {
            let header: String = source
                .lines()
                .take_while(|line| line.starts_with("--") || line.is_empty())
                .collect::<Vec<_>>()
                .join("\n");
            for part in ["KEYS[1]", "Reply:", "Transition"] {
                assert!(header.contains(part), "header lacks {part}:\n{header}");
            }
        }
        assert_eq!(Scripts::builtin().version, BUILTIN_SCRIPTS_VERSION);
    }
}
