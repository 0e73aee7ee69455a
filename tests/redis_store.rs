//! The Redis record store against real `redis-server` processes started by the tests: the
//! conformance suite on a single server, a 3-primary Redis Cluster and Sentinel; the stored
//! encoding; script cache loss, restarts and outages; what the keys look like.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::faultproxy::{Fault, FaultProxy};
use common::redis::{RedisCluster, RedisSentinel, RedisServer};
use idemgate::config::{RedisConfig, RedisTopology, ScriptsConfig};
use idemgate::store::redis::ScriptsApplied;
use idemgate::store::{
    codec, conformance, ClaimOutcome, ClaimRequest, Completion, OwnerToken, Record, RecordKey,
    RecordState, RecordStore, RedisStore, Scripts, StoreError, StoredResponse, WriteOutcome,
};
use redis::Value;

const PREFIX: &str = "idemtest";
const SECOND: Duration = Duration::from_secs(1);

fn settings(urls: Vec<String>, topology: RedisTopology) -> RedisConfig {
    RedisConfig {
        urls,
        topology,
        connect_timeout: Duration::from_millis(500),
        // Generous: the machine is shared with parallel builds and tests.
        response_timeout: SECOND,
        key_prefix: PREFIX.into(),
        scripts: ScriptsConfig::default(),
        tls: None,
    }
}

fn single(server: &RedisServer) -> Arc<RedisStore> {
    let config = settings(vec![server.url()], RedisTopology::Single);
    Arc::new(RedisStore::new(&config).expect("store"))
}

fn fresh_key() -> RecordKey {
    RecordKey {
        tenant: "acme".into(),
        hash: rand::random(),
    }
}

fn claim_request(key: &RecordKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: [3; 32],
        owner: OwnerToken::random(),
        execution_id: rand::random(),
        lock_ttl: 10 * SECOND,
        ttl: 60 * SECOND,
    }
}

fn response(body: &[u8]) -> Completion {
    Completion::Response(Arc::new(StoredResponse::new(
        201,
        vec![("content-type", Bytes::from_static(b"text/plain"))],
        Bytes::copy_from_slice(body),
    )))
}

/// Claims `key` and completes it with `body`; returns the claim.
async fn claim_and_complete(store: &RedisStore, key: &RecordKey, body: &[u8]) -> ClaimRequest {
    let req = claim_request(key);
    let outcome = store.claim(&req).await.expect("claim");
    assert!(
        matches!(outcome, ClaimOutcome::Acquired { .. }),
        "{outcome:?}"
    );
    let written = store
        .complete(key, req.owner, response(body), 60 * SECOND)
        .await
        .expect("complete");
    assert_eq!(written, WriteOutcome::Applied);
    req
}

/// The worker-id lease answers with Redis's clock when the caller holds it (ids then follow it:
/// `WorkerIds::follow_store_clock`), and with nothing when another holder has it.
#[tokio::test]
async fn a_worker_id_lease_answers_with_the_server_s_clock() {
    let server = RedisServer::start();
    let store = single(&server);
    store.connect().await.expect("connect");
    let lease = Duration::from_secs(30);
    let time: Vec<String> = server.cmd(&["TIME"]);
    let server_ms = time[0].parse::<u64>().expect("seconds") * 1000;
    let held = store
        .lease_worker_id(7, "token-a host-a", lease)
        .await
        .expect("lease call");
    let now_ms = held.expect("a free id is leased");
    assert!(
        now_ms.abs_diff(server_ms) < 5_000,
        "{now_ms} is not the server's clock ({server_ms})"
    );
    // Renewed by its holder: the clock again, never earlier.
    let renewed = store.lease_worker_id(7, "token-a host-a", lease).await;
    assert!(renewed.expect("renewal") >= Some(now_ms));
    // Held by another: no clock, nothing changed.
    let taken = store.lease_worker_id(7, "token-b host-b", lease).await;
    assert_eq!(taken.expect("lease call"), None);
    let holder: String = server.cmd(&["HGET", &store.worker_lease_key(7), "h"]);
    assert_eq!(holder, "token-a host-a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_single_server() {
    let server = RedisServer::start();
    let store = single(&server);
    store.connect().await.expect("connect");
    conformance::run_all(|| {
        let store = store.clone();
        async move { store }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_three_primary_cluster() {
    let cluster = RedisCluster::start(3);
    let config = settings(cluster.urls(), RedisTopology::Cluster);
    let store = Arc::new(RedisStore::new(&config).expect("store"));
    store.connect().await.expect("connect");
    conformance::run_all(|| {
        let store = store.clone();
        async move { store }
    })
    .await;

    // Records spread over the primaries, every call touched one slot (no CROSSSLOT), and each
    // record is one key whose hash tag is the whole `{tenant:hash}`.
    let keys: Vec<RecordKey> = (0..30).map(|_| fresh_key()).collect();
    for key in &keys {
        claim_and_complete(&store, key, b"spread").await;
        assert!(store.get(key).await.expect("get").is_some());
    }
    let stored = cluster.keys();
    let ports: std::collections::BTreeSet<u16> = stored
        .iter()
        .filter(|(_, k)| keys.iter().any(|key| *k == store.record_key(key)))
        .map(|(port, _)| *port)
        .collect();
    assert!(ports.len() >= 2, "records all landed on {ports:?}");
    for key in &keys {
        assert!(store.delete(key).await.expect("delete"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_sentinel_listed_first_does_not_keep_the_store_from_its_primary() {
    let setup = RedisSentinel::start();
    // A Sentinel that accepts connections and never answers, listed before the real one.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let urls = vec![
        format!("redis+sentinel://{silent_addr}/mymaster"),
        setup.url(),
    ];
    // Operations of 500 ms at most: less than one lookup takes past the silent Sentinel.
    let mut config = settings(urls, RedisTopology::Sentinel);
    config.connect_timeout = Duration::from_millis(300);
    config.response_timeout = Duration::from_millis(100);
    let store = RedisStore::new(&config).expect("store");
    let key = fresh_key();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.claim(&claim_request(&key)).await {
            Ok(outcome) => {
                assert!(matches!(outcome, ClaimOutcome::Acquired { .. }));
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "never reached the primary: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_through_sentinel_and_a_failover() {
    let setup = RedisSentinel::start();
    let config = settings(vec![setup.url()], RedisTopology::Sentinel);
    let store = Arc::new(RedisStore::new(&config).expect("store"));
    store.connect().await.expect("connect through sentinel");
    conformance::run_all(|| {
        let store = store.clone();
        async move { store }
    })
    .await;

    let key = fresh_key();
    claim_and_complete(&store, &key, b"before failover").await;
    let replicated: i64 = setup.primary.cmd(&["WAIT", "1", "2000"]);
    assert_eq!(replicated, 1, "replica did not acknowledge the write");

    setup.fail_over();
    // The Sentinel demotes the old primary (and drops its clients); the store follows.
    let deadline = Instant::now() + 10 * SECOND;
    let record = loop {
        match store.get(&key).await {
            Ok(record) => break record,
            Err(e) => {
                assert!(Instant::now() < deadline, "store never followed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(
        record.map(|r| r.state),
        Some(RecordState::Completed(response(b"before failover")))
    );
    // Writes land on the new primary.
    let after = fresh_key();
    claim_and_complete(&store, &after, b"after failover").await;
    let on_new_primary: i64 = setup.replica.cmd(&["EXISTS", &store.record_key(&after)]);
    assert_eq!(on_new_primary, 1);
}

#[tokio::test]
async fn stored_encoding_round_trips_binary_bodies_and_header_order() {
    let server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    let req = claim_request(&key);
    store.claim(&req).await.expect("claim");
    let body: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let stored = StoredResponse::new(
        207,
        vec![
            ("x-z", Bytes::from_static(b"1")),
            (
                "content-type",
                Bytes::from_static(b"application/octet-stream"),
            ),
            ("x-a", Bytes::from_static(b"\x00\xFF\r\n")),
            ("x-z", Bytes::from_static(b"2")),
        ],
        Bytes::from(body),
    );
    let completion = Completion::Response(Arc::new(stored));
    assert_eq!(
        store
            .complete(&key, req.owner, completion.clone(), 60 * SECOND)
            .await
            .expect("complete"),
        WriteOutcome::Applied
    );
    // What Redis holds is exactly the codec's bytes...
    let raw: Vec<u8> = server.cmd(&["HGET", &store.record_key(&key), "p"]);
    assert_eq!(raw, codec::encode(&completion));
    // ...and it reads back byte for byte.
    let record = store.get(&key).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Completed(completion));
    assert_eq!(record.execution_id, req.execution_id);
    // The record lives for the completion's ttl, by Redis' own expiry.
    let pttl: i64 = server.cmd(&["PTTL", &store.record_key(&key)]);
    assert!(pttl > 55_000 && pttl <= 60_000, "pttl {pttl}");
}

#[tokio::test]
async fn script_flush_between_claim_and_complete_is_recovered() {
    let server = RedisServer::start();
    let store = single(&server);
    store.connect().await.expect("connect");
    let key = fresh_key();
    let req = claim_request(&key);
    store.claim(&req).await.expect("claim");

    let _: () = server.cmd(&["SCRIPT", "FLUSH"]);
    let exists: Vec<i64> = server.cmd(&["SCRIPT", "EXISTS", &complete_sha()]);
    assert_eq!(exists, vec![0], "the flush did not empty the script cache");

    let written = store
        .complete(&key, req.owner, response(b"after flush"), 60 * SECOND)
        .await
        .expect("complete after SCRIPT FLUSH");
    assert_eq!(written, WriteOutcome::Applied);
    let exists: Vec<i64> = server.cmd(&["SCRIPT", "EXISTS", &complete_sha()]);
    assert_eq!(exists, vec![1], "the script was not loaded again");
    let _: () = server.cmd(&["SCRIPT", "FLUSH"]);
    store.ping().await.expect("ping after SCRIPT FLUSH");
    let record = store.get(&key).await.expect("get").expect("record");
    assert_eq!(
        record.state,
        RecordState::Completed(response(b"after flush"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_reloads_a_flushed_script_on_the_key_s_primary_while_another_node_is_down() {
    let cluster = RedisCluster::start(3);
    let config = settings(cluster.urls(), RedisTopology::Cluster);
    let store = Arc::new(RedisStore::new(&config).expect("store"));
    store.connect().await.expect("connect");
    let key = fresh_key();
    let req = claim_request(&key);
    store.claim(&req).await.expect("claim");
    let owner_port = cluster
        .keys()
        .into_iter()
        .find(|(_, k)| *k == store.record_key(&key))
        .map(|(port, _)| port)
        .expect("the record is on a node");
    let owner = cluster.nodes.iter().find(|n| n.port == owner_port).unwrap();
    let other = cluster.nodes.iter().find(|n| n.port != owner_port).unwrap();
    // The key's primary lost its scripts (a restart); another node does not answer at all.
    let _: () = owner.cmd(&["SCRIPT", "FLUSH"]);
    let signal = |sig: &str| {
        let pid = other.pid().expect("pid").to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status();
        assert!(ok.is_ok_and(|s| s.success()), "kill {sig}");
    };
    signal("-STOP");
    let written = store
        .complete(&key, req.owner, response(b"one shard"), 60 * SECOND)
        .await;
    // A script change goes live with that node still down: the text is checked on one primary
    // and the others load it when they first need it.
    let v2 = ScriptsConfig {
        version: "v2".into(),
        ..ScriptsConfig::default()
    };
    let applied = store.apply_scripts(&v2).await;
    signal("-CONT");
    assert_eq!(
        written.expect("complete on the key's own shard"),
        WriteOutcome::Applied
    );
    let exists: Vec<i64> = owner.cmd(&["SCRIPT", "EXISTS", &complete_sha()]);
    assert_eq!(exists, vec![1], "loaded again on the key's primary");
    assert!(
        matches!(applied, Ok(ScriptsApplied::Applied { .. })),
        "{applied:?}"
    );
    assert_eq!(store.scripts_version(), "v2");
}

/// While a slot migrates, a key not moved yet is asked of the importing node, which the store's
/// slot map does not name: a script unknown there must still run (not fail the claim until the
/// migration ends, and under `on_unavailable: pass` run the request unprotected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_in_a_migrating_slot_runs_on_the_importing_node_without_its_script() {
    let cluster = RedisCluster::start(3);
    let config = settings(cluster.urls(), RedisTopology::Cluster);
    let store = Arc::new(RedisStore::new(&config).expect("store"));
    store.connect().await.expect("connect");
    let key = fresh_key();
    let name = store.record_key(&key);
    // The slot's owner answers for the key; the others redirect (MOVED).
    let owner = cluster
        .nodes
        .iter()
        .find(|n| n.try_cmd(&["EXISTS", &name]).is_ok())
        .expect("the slot's owner");
    let target = cluster
        .nodes
        .iter()
        .find(|n| n.port != owner.port)
        .expect("another node");
    let slot: i64 = owner.cmd(&["CLUSTER", "KEYSLOT", &name]);
    let slot = slot.to_string();
    let id = |node: &RedisServer| -> String { node.cmd(&["CLUSTER", "MYID"]) };
    let _: String = target.cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &id(owner)]);
    let _: String = owner.cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &id(target)]);
    // The importing node never loaded the scripts (a node added for the migration).
    let _: String = target.cmd(&["SCRIPT", "FLUSH"]);

    let req = claim_request(&key);
    let claimed = store.claim(&req).await.expect("claim during the migration");
    assert!(
        matches!(claimed, ClaimOutcome::Acquired { .. }),
        "{claimed:?}"
    );
    // The new record went where the slot is going.
    let on_target: Vec<String> = target.keys();
    assert!(on_target.contains(&name), "{on_target:?}");
}

/// The SHA1 Redis names the built-in complete script by.
fn complete_sha() -> String {
    Scripts::builtin().complete.get_hash().to_owned()
}

#[tokio::test]
async fn restart_between_operations_reconnects() {
    let mut server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    claim_and_complete(&store, &key, b"before restart").await;

    server.restart();
    // The connection died with the old process: the very next operation reconnects (and
    // reloads its script into the empty cache) instead of failing.
    let next = fresh_key();
    let req = claim_request(&next);
    let outcome = store.claim(&req).await.expect("first claim after restart");
    assert_eq!(
        outcome,
        ClaimOutcome::Acquired {
            execution_id: req.execution_id,
            lapsed: false,
        }
    );
    // Twice, to be sure it was no accident of timing.
    server.restart();
    assert_eq!(store.get(&next).await.expect("get after restart"), None);
    store.ping().await.expect("ping after restart");
}

#[tokio::test]
async fn outage_fails_fast_and_a_store_made_while_down_connects_later() {
    let port = RedisServer::unused_port();
    let config = RedisConfig {
        response_timeout: Duration::from_millis(200),
        ..settings(
            vec![format!("redis://127.0.0.1:{port}")],
            RedisTopology::Single,
        )
    };
    // Built while nothing listens: no error, nothing connected.
    let store = RedisStore::new(&config).expect("store without redis");
    let key = fresh_key();
    let started = Instant::now();
    let err = store
        .claim(&claim_request(&key))
        .await
        .expect_err("no redis");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(matches!(
        store.ping().await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(
        started.elapsed() < config.connect_timeout + 2 * config.response_timeout,
        "failing took {:?}",
        started.elapsed()
    );

    let mut server = RedisServer::start_on(port);
    store.ping().await.expect("ping once redis is up");
    claim_and_complete(&store, &key, b"late").await;

    // Down again, mid-life: every call answers Unavailable within the operation deadline.
    server.kill();
    let started = Instant::now();
    for _ in 0..3 {
        let err = store.get(&key).await.expect_err("redis is down");
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    }
    assert!(
        started.elapsed() < 3 * (config.connect_timeout + 2 * config.response_timeout),
        "failing took {:?}",
        started.elapsed()
    );
    server.restart();
    let fresh = fresh_key();
    claim_and_complete(&store, &fresh, b"back").await;
}

#[tokio::test]
async fn record_keys_hold_only_prefix_tenant_and_hex_hash() {
    let server = RedisServer::start();
    let store = single(&server);
    let tenants = ["acme", "globex.eu-1", "t:1"];
    for tenant in tenants {
        let key = RecordKey {
            tenant: tenant.into(),
            hash: rand::random(),
        };
        claim_and_complete(&store, &key, b"x").await;
        let other = RecordKey {
            tenant: tenant.into(),
            hash: rand::random(),
        };
        let req = claim_request(&other);
        store.claim(&req).await.expect("claim");
        store.release(&other, req.owner).await.expect("release");
    }
    store.ping().await.expect("ping");
    let keys = server.keys();
    assert_eq!(keys.len(), 6, "one key per record, nothing else: {keys:?}");
    for key in keys {
        let inner = key
            .strip_prefix(&format!("{PREFIX}:{{"))
            .and_then(|rest| rest.strip_suffix('}'))
            .unwrap_or_else(|| panic!("unexpected key {key}"));
        let (tenant, hash) = inner.rsplit_once(':').expect("tenant:hash");
        assert!(tenants.contains(&tenant), "{key}");
        assert_eq!(hash.len(), 64, "{key}");
        assert!(
            hash.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{key}"
        );
    }
}

#[tokio::test]
async fn ping_runs_the_script_path_not_just_ping() {
    let server = RedisServer::start();
    // A user that may PING and read/write keys but not run scripts.
    let _: () = server.cmd(&[
        "ACL",
        "SETUSER",
        "noscripts",
        "on",
        ">pw",
        "~*",
        "+@all",
        "-@scripting",
    ]);
    let config = settings(
        vec![format!("redis://noscripts:pw@127.0.0.1:{}", server.port)],
        RedisTopology::Single,
    );
    let store = RedisStore::new(&config).expect("store");
    let err = store.ping().await.expect_err("scripts are denied");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().contains("evalsha"), "{err}");
    assert!(!err.to_string().contains(":pw@"), "{err}");

    let _: () = server.cmd(&["ACL", "SETUSER", "scripts", "on", ">pw", "~*", "+@all"]);
    let config = settings(
        vec![format!("redis://scripts:pw@127.0.0.1:{}", server.port)],
        RedisTopology::Single,
    );
    let store = RedisStore::new(&config).expect("store");
    store.ping().await.expect("user with scripts");
    claim_and_complete(&store, &fresh_key(), b"acl").await;

    // The least a single-server user needs, as documented in config/idemgate.yaml: the key
    // pattern, EVALSHA + SCRIPT LOAD, DEL, and what the scripts call.
    let keys = format!("~{PREFIX}:*");
    let user = [
        "ACL",
        "SETUSER",
        "least",
        "on",
        ">pw",
        &keys,
        "resetchannels",
    ];
    let _: () = server.cmd(&[&user[..], &common::redis::SCRIPT_RIGHTS[..]].concat());
    let config = settings(
        vec![format!("redis://least:pw@127.0.0.1:{}", server.port)],
        RedisTopology::Single,
    );
    let store = Arc::new(RedisStore::new(&config).expect("store"));
    store
        .connect()
        .await
        .expect("connect with least privileges");
    conformance::case_completed_response_replays_byte_exact(&store).await;
    conformance::case_release_then_claim_keeps_execution_id(&store).await;
    conformance::case_wait_returns_at_once_when_not_in_flight(&store).await;
    conformance::case_delete_removes(&store).await;
    // +info lets it read the eviction setting.
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 0);
}

/// Whether Redis may evict records is read from `INFO memory`: a memory limit under any
/// policy but `noeviction` may (every record has a ttl, so `volatile-*` takes them too), no
/// limit or `noeviction` may not, and a change made while idemgate runs is read at the next
/// check. On a Cluster every primary is asked. A user that may not run `INFO` leaves it
/// unknown, and the checks stop (each would leave a denial in `ACL LOG`).
#[tokio::test]
async fn whether_redis_may_evict_records_is_read_from_every_server() {
    let server =
        RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru"]);
    let store = single(&server);
    assert_eq!(store.may_evict(), -1, "not read yet");
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 1);
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 0);
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 1);
    // No limit: nothing is evicted, whatever the policy.
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 0);

    let mut cluster = RedisCluster::start(3);
    let config = settings(cluster.urls(), RedisTopology::Cluster);
    let store = RedisStore::new(&config).expect("store");
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 0);
    let _: () = cluster.nodes[2].cmd(&["CONFIG", "SET", "maxmemory", "64mb"]);
    let _: () = cluster.nodes[2].cmd(&["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"]);
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 1, "one primary of three may evict");
    let _: () = cluster.nodes[2].cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    assert!(store.check_eviction().await);
    assert_eq!(store.may_evict(), 0);
    // A primary dies. redis-rs leaves a primary it holds no connection to out of the fan-out:
    // a reading without it can tell that some primary may evict, not that none may.
    cluster.nodes[1].kill();
    let set = |policy: &str| {
        let _: () = cluster.nodes[0].cmd(&["CONFIG", "SET", "maxmemory", "64mb"]);
        let _: () = cluster.nodes[0].cmd(&["CONFIG", "SET", "maxmemory-policy", policy]);
    };
    set("allkeys-lru");
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.may_evict() != 1 {
        assert!(
            Instant::now() < deadline,
            "a partial reading hid an evicting primary"
        );
        assert!(store.check_eviction().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    set("noeviction");
    for _ in 0..10 {
        assert!(store.check_eviction().await);
        assert_eq!(
            store.may_evict(),
            1,
            "a reading without the dead primary said none may evict"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let rights: Vec<&str> = common::redis::SCRIPT_RIGHTS
        .iter()
        .copied()
        .filter(|r| *r != "+info")
        .collect();
    let _: () = server.cmd(
        &[
            &["ACL", "SETUSER", "noinfo", "on", ">pw", "~*"][..],
            &rights,
        ]
        .concat(),
    );
    let config = settings(
        vec![format!("redis://noinfo:pw@127.0.0.1:{}", server.port)],
        RedisTopology::Single,
    );
    let store = RedisStore::new(&config).expect("store");
    assert!(
        !store.check_eviction().await,
        "INFO is refused: stop asking"
    );
    assert_eq!(store.may_evict(), -1);
}

/// A replica runs read-only scripts: a probe that only read would call a server that refuses
/// every claim healthy (closing the circuit, answering ready).
#[tokio::test]
async fn ping_fails_on_a_server_that_takes_no_writes() {
    let primary = RedisServer::start();
    let replica = RedisServer::start();
    let _: String = replica.cmd(&["REPLICAOF", "127.0.0.1", &primary.port.to_string()]);
    let store = single(&replica);
    let err = store.ping().await.expect_err("a replica takes no writes");
    assert!(err.to_string().to_lowercase().contains("readonly"), "{err}");
    single(&primary).ping().await.expect("the primary does");

    // Nor when the active version's `get` raises: that alone is no outage (the breaker closes
    // on it), but a server that takes no writes is, and says so first.
    let dir = tempfile::tempdir().expect("scripts dir");
    let version = dir.path().join("raising");
    std::fs::create_dir(&version).expect("version dir");
    for name in ["claim", "complete", "release"] {
        let text = std::fs::read_to_string(format!("lua/v1/{name}.lua")).expect("v1 script");
        std::fs::write(version.join(format!("{name}.lua")), text).expect("script");
    }
    std::fs::write(version.join("get.lua"), "error('get fails')\n").expect("get.lua");
    let raising = |server: &RedisServer| {
        let mut config = settings(vec![server.url()], RedisTopology::Single);
        config.scripts = ScriptsConfig {
            dir: Some(dir.path().to_path_buf()),
            version: "raising".into(),
            canary: None,
        };
        RedisStore::new(&config).expect("store")
    };
    let err = raising(&replica)
        .ping()
        .await
        .expect_err("a replica takes no writes");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().to_lowercase().contains("readonly"), "{err}");
    let err = raising(&primary)
        .ping()
        .await
        .expect_err("the script raises");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
}

/// A hash under a record's name that holds no fingerprint is no record: a claim starts it
/// afresh, its stray fields gone.
#[tokio::test]
async fn a_hash_without_a_fingerprint_is_claimed_afresh() {
    let server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    let name = store.record_key(&key);
    let _: () = server.cmd(&["HSET", &name, "s", "c", "p", "stale", "w", "old"]);
    let claimed = store.claim(&claim_request(&key)).await;
    assert!(
        matches!(claimed, Ok(ClaimOutcome::Acquired { .. })),
        "{claimed:?}"
    );
    for stray in ["p", "w"] {
        let left: Option<String> = server.cmd(&["HGET", &name, stray]);
        assert_eq!(left, None, "{stray} left over");
    }
}

#[tokio::test]
async fn malformed_records_are_corrupt_not_panics() {
    let server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    let name = store.record_key(&key);

    // A payload the codec cannot read.
    let _: () = server.cmd(&[
        "HSET",
        &name,
        "f",
        &"a".repeat(32),
        "x",
        "12",
        "s",
        "c",
        "p",
        "\x07nonsense",
    ]);
    let err = store.get(&key).await.expect_err("bad payload");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
    let err = store
        .claim(&ClaimRequest {
            fingerprint: [b'a'; 32],
            ..claim_request(&key)
        })
        .await
        .expect_err("bad payload on claim");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");

    // A fingerprint of the wrong size.
    let _: () = server.cmd(&["HSET", &name, "f", "short", "s", "r"]);
    assert!(matches!(store.get(&key).await, Err(StoreError::Corrupt(_))));

    // A key of another type under the record's name.
    let _: () = server.cmd(&["DEL", &name]);
    let _: () = server.cmd(&["SET", &name, "a string"]);
    let err = store.get(&key).await.expect_err("wrong type");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
    assert!(store.delete(&key).await.expect("delete"));
}

/// The lock's deadline is Redis's wall clock. Stepped back an hour after a claim (the record's
/// deadline an hour further ahead is the same thing), a duplicate's claim still shows no more
/// lock left than it takes itself: that is its 409's `Retry-After`.
#[tokio::test]
async fn a_lock_redis_s_clock_makes_look_longer_than_any_is_capped_at_the_claim_s() {
    let server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    let first = claim_request(&key);
    store.claim(&first).await.expect("claim");
    let name = store.record_key(&key);
    let l: String = server.cmd(&["HGET", &name, "l"]);
    let an_hour_on = (l.parse::<u64>().expect("lock deadline") + 3_600_000).to_string();
    let _: () = server.cmd(&["HSET", &name, "l", &an_hour_on]);
    let duplicate = claim_request(&key);
    match store.claim(&duplicate).await.expect("claim") {
        ClaimOutcome::Existing(Record {
            state: RecordState::InFlight { lock_remaining },
            ..
        }) => assert!(
            lock_remaining <= duplicate.lock_ttl && lock_remaining > duplicate.lock_ttl / 2,
            "{lock_remaining:?}"
        ),
        other => panic!("expected the record in flight, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_store_instances_race_for_one_key() {
    let server = RedisServer::start();
    let stores = [single(&server), single(&server)];
    let key = fresh_key();
    let racers: Vec<_> = (0..40)
        .map(|i| {
            let store = stores[i % 2].clone();
            let req = claim_request(&key);
            tokio::spawn(async move { store.claim(&req).await })
        })
        .collect();
    let mut winners = 0;
    for racer in racers {
        if let ClaimOutcome::Acquired { .. } = racer.await.expect("join").expect("claim") {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
}

#[tokio::test]
async fn waiting_polls_with_backoff_not_hot() {
    let server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    store.claim(&claim_request(&key)).await.expect("claim");
    store.ping().await.expect("ping");
    let _: () = server.cmd(&["CONFIG", "RESETSTAT"]);

    let started = Instant::now();
    let record = store
        .wait_for_change(&key, SECOND)
        .await
        .expect("wait")
        .expect("record");
    assert!(started.elapsed() >= SECOND - Duration::from_millis(20));
    assert!(matches!(record.state, RecordState::InFlight { .. }));

    let stats: String = server.cmd(&["INFO", "commandstats"]);
    let calls: u64 = stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .expect("evalsha stats");
    // 5, 10, 20, 40, 80 ms, then every 100 ms: about 14 reads in a second.
    assert!(
        (5..=20).contains(&calls),
        "{calls} reads in one second of waiting"
    );
}

#[tokio::test]
async fn a_repeated_write_is_recognised_and_a_lapsed_owner_fenced() {
    let server = RedisServer::start();
    let store = single(&server);
    let key = fresh_key();
    let first = ClaimRequest {
        lock_ttl: Duration::from_millis(200),
        ..claim_request(&key)
    };
    store.claim(&first).await.expect("claim");
    // A claim re-sent by the same owner (its reply was lost) still holds the claim.
    assert_eq!(
        store.claim(&first).await.expect("claim again"),
        ClaimOutcome::Acquired {
            execution_id: first.execution_id,
            lapsed: false,
        }
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = claim_request(&key);
    assert_eq!(
        store.claim(&second).await.expect("take over"),
        ClaimOutcome::Acquired {
            execution_id: first.execution_id,
            lapsed: true,
        }
    );
    // The lapsed first owner finishes late: fenced off, the second owner's record stands.
    assert_eq!(
        store
            .complete(&key, first.owner, response(b"late"), 60 * SECOND)
            .await
            .expect("late complete"),
        WriteOutcome::NotOwner
    );
    let holder: Vec<u8> = server.cmd(&["HGET", &store.record_key(&key), "o"]);
    assert_eq!(holder, format!("{:032x}", second.owner.0).into_bytes());
    let value: Value = server.cmd(&["HGET", &store.record_key(&key), "p"]);
    assert_eq!(value, Value::Nil, "the lapsed owner wrote a payload");

    // A complete re-sent after a dropped connection carries the same write id: the script
    // answers "applied" again instead of "not owner". Another write id is a second write.
    let name = store.record_key(&key);
    let owner = format!("{:032x}", second.owner.0);
    let complete = include_str!("../lua/v1/complete.lua");
    let send = |write_id: &str| -> i64 {
        server.cmd(&[
            "EVAL",
            complete,
            "1",
            &name,
            &owner,
            "\x01\x01\x01\x2C",
            "60000",
            write_id,
        ])
    };
    assert_eq!(send("w-1"), 1);
    assert_eq!(send("w-1"), 1, "the re-send was not recognised");
    assert_eq!(send("w-2"), 0, "a completed record was written twice");
    let release = include_str!("../lua/v1/release.lua");
    let released: i64 = server.cmd(&["EVAL", release, "1", &name, &owner, "w-3"]);
    assert_eq!(released, 0);
    let record = store.get(&key).await.expect("get").expect("record");
    assert_eq!(
        record.state,
        RecordState::Completed(Completion::Unreplayable { status: 300 })
    );
}

#[tokio::test]
async fn resp3_connections_read_the_same_replies() {
    let server = RedisServer::start();
    let config = settings(
        vec![format!("{}?protocol=resp3", server.url())],
        RedisTopology::Single,
    );
    let store = Arc::new(RedisStore::new(&config).expect("store"));
    store.ping().await.expect("ping over RESP3");
    conformance::case_completed_response_replays_byte_exact(&store).await;
    conformance::case_release_then_claim_keeps_execution_id(&store).await;
    conformance::case_wait_returns_at_once_when_not_in_flight(&store).await;
    conformance::case_delete_removes(&store).await;
    // Includes the life a claim tells of a completed record (what a local copy may keep).
    conformance::case_record_expires_after_ttl(&store).await;
    // CLIENT LIST tells each connection's protocol from Redis 7.0 on; before, a connection
    // that asked for RESP3 shows as a HELLO.
    if common::redis::server_version().0 < 7 {
        assert!(
            server.command_calls("hello") > 0,
            "no client asked for RESP3"
        );
    } else {
        let clients: String = server.cmd(&["CLIENT", "LIST"]);
        assert!(
            clients.contains("resp=3"),
            "no client spoke RESP3:\n{clients}"
        );
    }
}

#[tokio::test]
async fn rediss_urls_speak_tls_and_verify_the_server() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/redis-tls");
    let tls_port = common::redis::free_redis_port();
    let server = RedisServer::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &format!("{fixtures}/cert.pem"),
        "--tls-key-file",
        &format!("{fixtures}/key.pem"),
        "--tls-ca-cert-file",
        &format!("{fixtures}/cert.pem"),
        "--tls-auth-clients",
        "no",
    ]);
    let config = settings(
        vec![format!("rediss://localhost:{tls_port}")],
        RedisTopology::Single,
    );
    // The handshake runs (a crypto provider is installed, nothing panics) and the self-signed
    // certificate is refused: only the built-in public roots are trusted.
    let store = RedisStore::new(&config).expect("store");
    let err = store
        .ping()
        .await
        .expect_err("self-signed certificate accepted");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    // The same server in plain text works, so the refusal was the certificate's.
    single(&server).ping().await.expect("plain-text ping");
}

/// A Redis Cluster's purge channel is not tied to its first seed: with that seed gone for good,
/// purges are still announced and heard through the next one (Cluster pub/sub reaches every
/// node), where before every publish failed and the listener retried the dead seed forever.
#[tokio::test]
async fn a_cluster_purge_channel_moves_past_a_seed_that_is_gone() {
    let gone = format!("redis://127.0.0.1:{}", RedisServer::unused_port());
    purges_are_heard_past_a_first_seed(gone).await;
}

/// Likewise past a seed that takes connections and never answers (a host that drops the
/// packets of a closed port, a stuck proxy): the subscription gives up on it in bounded time,
/// where before it waited for an answer that never came, and heard no purge meanwhile.
#[tokio::test]
async fn a_cluster_purge_channel_moves_past_a_seed_that_never_answers() {
    let nowhere = SocketAddr::from(([127, 0, 0, 1], RedisServer::unused_port()));
    let black_hole = FaultProxy::start(nowhere).await;
    black_hole.set(Fault::Hold);
    purges_are_heard_past_a_first_seed(black_hole.redis_url()).await;
}

/// A purge bus on a Cluster whose seeds are `first`, then a live server: it subscribes, and
/// hears what it publishes.
async fn purges_are_heard_past_a_first_seed(first: String) {
    use idemgate::store::purge::PurgeBus;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let live = RedisServer::start();
    let bus = PurgeBus::new(
        &settings(vec![first, live.url()], RedisTopology::Cluster),
        None,
    )
    .expect("bus");
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let subscribed = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let listener = tokio::spawn({
        let (bus, heard, subscribed) = (bus.clone(), heard.clone(), subscribed.clone());
        async move {
            bus.listen(
                Arc::new(move |key: &RecordKey| heard.lock().unwrap().push(key.clone())),
                Arc::new(move || {
                    subscribed.fetch_add(1, Ordering::Relaxed);
                }),
                stopped,
            )
            .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while subscribed.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < deadline,
            "never subscribed past the first seed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let key = fresh_key();
    assert_eq!(bus.publish(&key).await, Ok(1));
    while !heard.lock().unwrap().contains(&key) {
        assert!(Instant::now() < deadline, "the purge was not heard");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    listener.await.unwrap();
}

/// One round trip per phase: a claim, a completion and a release are one `EVALSHA` each, with
/// no read of its own before it and no transaction around it.
#[tokio::test]
async fn each_phase_is_one_script_call() {
    let server = RedisServer::start();
    let store = single(&server);
    // Scripts load on their first use (NOSCRIPT, SCRIPT LOAD, again): one round first.
    for _ in 0..2 {
        let key = fresh_key();
        let req = claim_request(&key);
        store.claim(&req).await.expect("claim");
        store.release(&key, req.owner).await.expect("release");
        store.claim(&claim_request(&key)).await.expect("claim");
    }
    let warm = fresh_key();
    let req = claim_request(&warm);
    store.claim(&req).await.expect("claim");
    let done = store.complete(&warm, req.owner, response(b"{}"), 60 * SECOND);
    done.await.expect("complete");
    let _: () = server.cmd(&["CONFIG", "RESETSTAT"]);
    let completed = fresh_key();
    let req = claim_request(&completed);
    store.claim(&req).await.expect("claim");
    let done = store.complete(&completed, req.owner, response(b"{}"), 60 * SECOND);
    assert_eq!(done.await.expect("complete"), WriteOutcome::Applied);
    let released = fresh_key();
    let req = claim_request(&released);
    store.claim(&req).await.expect("claim");
    let done = store.release(&released, req.owner);
    assert_eq!(done.await.expect("release"), WriteOutcome::Applied);

    let stats: String = server.cmd(&["INFO", "commandstats"]);
    let calls = |name: &str| -> u64 {
        stats
            .lines()
            .find_map(|line| line.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!(calls("evalsha"), 4, "{stats}");
    // Commands the scripts run count too (HMGET, HSET, ...); none of these is one of them.
    for other in [
        "eval", "get", "set", "hget", "hgetall", "exists", "multi", "exec", "watch",
    ] {
        assert_eq!(calls(other), 0, "{other}: {stats}");
    }
}
