//! Purges across replicas: an admin `DELETE` of a record removes it from Redis and publishes its
//! name, and every replica drops its local cached copy on the message.
//!
//! The message is `<tenant>:<hex hash>`, the same name the record has in Redis: the raw key never
//! travels. Pub/sub is best effort (a replica that is disconnected at that moment misses it):
//! each time a replica subscribes again it drops every copy it read from Redis, which holds
//! them anyway, and keeps the records it completed itself (one may be the only trace of a
//! completion whose write is still being retried; those are bounded by the record's TTL). A
//! purge is an operator tool, not part of the exactly-once guarantee.
//!
//! Behind Sentinel the channel is on the primary the Sentinels name, looked up again for every
//! publish and every (re)subscription, so purges keep reaching every replica across a failover
//! (a listener still on a demoted primary also keeps hearing them: Redis replicates `PUBLISH`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::StreamExt;
use redis::sentinel::SentinelClient;
use redis::{RedisResult, TlsCertificates};

use super::redis::{sentinel_client, single_client, SetupError};
use super::{ForgetLocal, RecordKey};
use crate::config::{RedisConfig, RedisTopology};

/// How long a purge announcement may take to connect, and then to be answered; and how long
/// a listener's subscription, and each of its heartbeats, may take.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a listener sends a heartbeat on its subscribed connection (a `SUBSCRIBE` to its
/// channel again, which Redis confirms). A subscription only ever reads, so a
/// connection that died without a FIN or RST (a NAT or load balancer that dropped the idle
/// flow, a host gone from the network) would otherwise go unnoticed for as long as the kernel's
/// keepalive takes (two hours by default), every purge meanwhile missed and its copies still
/// replayed. A heartbeat unanswered within [`PUBLISH_TIMEOUT`] ends the session: the listener
/// subscribes again, and drops its copies as after any loss. The traffic also keeps an idle
/// flow from being dropped in the first place (load balancers drop idle flows after minutes).
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Publishes and receives purge messages on one channel.
#[derive(Clone)]
pub struct PurgeBus {
    /// The store's settings, which say where the channel is.
    config: Arc<RedisConfig>,
    /// Swapped when the `store.redis.tls` files change ([`PurgeBus::use_certificates`]).
    server: Arc<ArcSwap<Server>>,
    channel: String,
    /// Whether the listener is subscribed, and how often a subscription was lost.
    state: Arc<ChannelState>,
}

/// The listener's state, for the metrics and for logging each loss once.
#[derive(Default)]
struct ChannelState {
    subscribed: AtomicBool,
    /// Subscribing failed since the channel was last up (or since the start): logged once.
    failing: AtomicBool,
    losses: AtomicU64,
}

/// Where the channel lives. One per process, behind an `Arc`: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Server {
    /// The server, or any of a Cluster's seeds (Cluster pub/sub reaches every node): the one
    /// at `current`, moved on to the next whenever one cannot be reached, so a seed gone for
    /// good does not silence the channel while the cluster is healthy.
    Direct {
        clients: Vec<redis::Client>,
        current: AtomicUsize,
    },
    /// The primary a set of Sentinels names at the time.
    Sentinel(tokio::sync::Mutex<SentinelClient>),
}

impl Server {
    fn new(config: &RedisConfig, certs: Option<&TlsCertificates>) -> Result<Server, SetupError> {
        Ok(match config.topology {
            RedisTopology::Sentinel => Server::Sentinel(tokio::sync::Mutex::new(sentinel_client(
                &config.urls,
                certs,
            )?)),
            RedisTopology::Single | RedisTopology::Cluster => Server::Direct {
                clients: config
                    .urls
                    .iter()
                    .map(|url| single_client(url, certs))
                    .collect::<Result<_, _>>()?,
                current: AtomicUsize::new(0),
            },
        })
    }

    /// Moves a Cluster's channel on to its next seed: the current one could not be reached.
    fn next_seed(&self) {
        // `client` takes it modulo the seed count: one seed stays itself.
        if let Server::Direct { current, .. } = self {
            current.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many servers a publish may try: every seed once.
    fn seeds(&self) -> usize {
        match self {
            Server::Direct { clients, .. } => clients.len().max(1),
            Server::Sentinel(_) => 1,
        }
    }
}

impl PurgeBus {
    /// A bus next to the store `config` describes, with its TLS certificates; channel
    /// `<key_prefix>:purge`.
    pub fn new(config: &RedisConfig, certs: Option<&TlsCertificates>) -> Result<Self, SetupError> {
        Ok(PurgeBus {
            server: Arc::new(ArcSwap::from_pointee(Server::new(config, certs)?)),
            channel: format!("{}:purge", config.key_prefix),
            config: Arc::new(config.clone()),
            state: Arc::default(),
        })
    }

    /// Whether the listener is subscribed now: purges announced by other replicas reach this
    /// one's local copies only then.
    pub fn is_subscribed(&self) -> bool {
        self.state.subscribed.load(Ordering::Relaxed)
    }

    /// Subscriptions lost since the start (each one drops the local copies when it is back).
    pub fn losses(&self) -> u64 {
        self.state.losses.load(Ordering::Relaxed)
    }

    /// Connects with `certs` from now on (the `store.redis.tls` files changed). A subscription
    /// that is up stays on its connection until that drops.
    pub fn use_certificates(&self, certs: &TlsCertificates) -> Result<(), SetupError> {
        let server = Server::new(&self.config, Some(certs))?;
        self.server.store(Arc::new(server));
        Ok(())
    }

    /// A client for the server the channel is on now.
    async fn client(&self) -> RedisResult<redis::Client> {
        let server = self.server.load_full();
        match &*server {
            Server::Direct { clients, current } => {
                let at = current.load(Ordering::Relaxed) % clients.len().max(1);
                clients.get(at).cloned().ok_or_else(|| {
                    redis::RedisError::from((redis::ErrorKind::Client, "no Redis URL"))
                })
            }
            Server::Sentinel(sentinel) => sentinel.lock().await.async_get_client().await,
        }
    }

    /// Announces that `key` was purged. Returns how many replicas were listening (Redis counts
    /// the subscribers it delivered to; one that was reconnecting at that moment missed it).
    pub async fn publish(&self, key: &RecordKey) -> Result<u64, String> {
        let message = format!("{}:{}", key.tenant, hex::encode(key.hash));
        // An operator waits on it, and it may follow a delete whose answer was lost: it gets
        // longer than a store operation to land (redis-rs's default answer timeout is 500 ms).
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(PUBLISH_TIMEOUT))
            .set_response_timeout(Some(PUBLISH_TIMEOUT));
        let connect = || async {
            self.client()
                .await?
                .get_multiplexed_async_connection_with_config(&config)
                .await
        };
        // A Cluster's seeds in turn, from the one in use, until one takes the connection.
        let mut tries = self.server.load().seeds();
        let mut conn = loop {
            let reached = tokio::time::timeout(PUBLISH_TIMEOUT, connect())
                .await
                .map_err(|_| "purge channel: connect timed out".to_string())
                .and_then(|c| c.map_err(|e| format!("purge channel: {e}")));
            match reached {
                Ok(conn) => break conn,
                Err(e) => {
                    tries -= 1;
                    if tries == 0 {
                        return Err(e);
                    }
                    self.server.load().next_seed();
                }
            }
        };
        redis::cmd("PUBLISH")
            .arg(&self.channel)
            .arg(message)
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("purge channel: {e}"))
    }

    /// Listens until `shutdown` fires, reconnecting after errors, calling `on_purge` per message
    /// and `on_subscribed` each time the channel is subscribed (at start and after every loss):
    /// what was announced while it was not listening is missed, so the local copies it would
    /// have dropped must go.
    pub async fn listen(
        &self,
        on_purge: ForgetLocal,
        on_subscribed: Arc<dyn Fn() + Send + Sync>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut pause = Duration::from_millis(100);
        loop {
            tokio::select! {
                Err(e) = self.session(&on_purge, on_subscribed.as_ref(), &mut pause) => {
                    let state = &self.state;
                    if state.subscribed.swap(false, Ordering::Relaxed) {
                        state.losses.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %e, channel = %self.channel, "purge channel lost; subscribing again (purges other replicas announce meanwhile are missed: the local copies of records read from redis are dropped once it is back)");
                    } else if !state.failing.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, channel = %self.channel, "purge channel cannot be subscribed; purges other replicas announce do not reach this one's local copies until it is (trying again)");
                    }
                    // The next try goes to a Cluster's next seed: this one may be gone.
                    self.server.load().next_seed();
                }
                _ = shutdown.changed() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown.changed() => return,
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    /// One subscription, from connecting until it is lost (the reason); `pause`, the backoff
    /// before the next, starts afresh once subscribed.
    async fn session(
        &self,
        on_purge: &ForgetLocal,
        on_subscribed: &(dyn Fn() + Send + Sync),
        pause: &mut Duration,
    ) -> Result<Infallible, String> {
        let subscribe = async {
            let mut pubsub = self.client().await?.get_async_pubsub().await?;
            pubsub.subscribe(&self.channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        // Bounded: a seed that drops SYNs would hold a connect for minutes, and a Cluster's
        // other seeds would not be tried meanwhile.
        let pubsub = tokio::time::timeout(PUBLISH_TIMEOUT, subscribe)
            .await
            .map_err(|_| "subscribing timed out".to_string())?
            .map_err(|e| e.to_string())?;
        tracing::debug!(channel = %self.channel, "listening for purges");
        self.state.subscribed.store(true, Ordering::Relaxed);
        if self.state.failing.swap(false, Ordering::Relaxed) {
            tracing::info!(channel = %self.channel, "purge channel subscribed");
        }
        on_subscribed();
        *pause = Duration::from_millis(100);
        let (mut sink, mut messages) = pubsub.split();
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        loop {
            tokio::select! {
                msg = messages.next() => {
                    let msg = msg.ok_or_else(|| "the connection closed".to_string())?;
                    if let Some(key) = msg.get_payload::<String>().ok().as_deref().and_then(parse_message) {
                        on_purge(&key);
                    }
                }
                _ = heartbeat.tick() => {
                    // Messages arriving meanwhile wait in the connection's queue. The heartbeat
                    // subscribes again to the channel it listens on, which Redis confirms: a
                    // least-privilege ACL user that may SUBSCRIBE to it may do that, while a
                    // PING would need a right of its own (refused, it ended the session).
                    tokio::time::timeout(PUBLISH_TIMEOUT, sink.subscribe(&self.channel))
                        .await
                        .map_err(|_| "a heartbeat went unanswered".to_string())?
                        .map_err(|e| format!("heartbeat: {e}"))?;
                }
            }
        }
    }
}

/// Reads `<tenant>:<64 hex digits>`; the tenant may itself contain `:`.
pub fn parse_message(payload: &str) -> Option<RecordKey> {
    let (tenant, hex_hash) = payload.rsplit_once(':')?;
    let hash = super::parse_digest(hex_hash)?;
    if tenant.is_empty() {
        return None;
    }
    Some(RecordKey {
        tenant: tenant.to_owned(),
        hash,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_junk_is_ignored() {
        let key = RecordKey {
            tenant: "acme:eu".into(),
            hash: [0xab; 32],
        };
        let msg = format!("{}:{}", key.tenant, hex::encode(key.hash));
        assert_eq!(parse_message(&msg), Some(key));
        for junk in ["", "acme", "acme:zz", ":abab", "acme:abab"] {
            assert_eq!(parse_message(junk), None, "{junk}");
        }
    }
}
