//! Redis changing shape under a running proxy: a Cluster primary replaced by its replica (a
//! planned failover, as for an upgrade, and the primary's death), a Sentinel's primary dying,
//! and Cluster slots moving between primaries. Every record the proxy completed is replayed
//! afterwards, and no key runs twice at the backend.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::faultproxy::FaultProxy;
use common::redis::{until_replicated, RedisCluster, RedisSentinel, RedisServer};
use common::{Backend, Proxy, ProxyBuilder, Request, Response};

/// A proxy on the Redis at `urls` without the local cache, so every replay is read from Redis.
/// Settings of the `store.redis` block may follow (indented, as `  response_timeout: 1s`).
fn uncached(backend: &Backend, urls: &[String]) -> ProxyBuilder {
    ProxyBuilder::new(backend)
        .store("local_cache: {enabled: false}")
        .redis(urls)
}

async fn order(addr: SocketAddr, key: &str) -> Response {
    Request::post("/orders")
        .key(key)
        .body("{}")
        .send(addr)
        .await
}

/// Whether `r` is the 503 the outage policy (`reject`) answers with.
fn refused_by_policy(r: &Response) -> bool {
    r.status == 503 && r.result() == Some("UNAVAILABLE") && r.header("retry-after").is_some()
}

/// Sends one key after another until `stop`, each sent again at once when it ran (`MISS`);
/// returns every key with its answers.
async fn keys_and_retries(addr: SocketAddr, stop: Arc<AtomicBool>) -> Vec<(String, Vec<Response>)> {
    let mut sent = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        let key = format!("during-{n}");
        n += 1;
        let first = order(addr, &key).await;
        let mut answers = vec![first];
        if answers[0].result() == Some("MISS") {
            answers.push(order(addr, &key).await);
        }
        sent.push((key, answers));
    }
    sent
}

/// A planned failover (`CLUSTER FAILOVER` on a replica: its primary stops taking writes until
/// the replica has them all, then hands over its slots) while keys and their retries keep
/// coming: no client sees an error (redis-rs follows the slots to the new primary, and the
/// scripts the new primary lacks are loaded again), every retry replays, and no key runs twice.
/// The handover takes milliseconds; the calls it holds wait for it up to the response timeout,
/// 1 s here, so a starved test machine cannot turn a slow handover into errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_cluster_failover_is_invisible_to_clients() {
    let cluster = RedisCluster::start_with_replicas(3, 1, &[]);
    let backend = Backend::start().await;
    let proxy = uncached(&backend, &cluster.urls())
        .store("  response_timeout: 1s")
        .start()
        .await;
    let (primary, replica) = cluster.primary_and_replica();

    let before = executed_before(&proxy).await;
    assert!(
        !cluster.nodes[primary].keys().is_empty(),
        "no record on the primary that fails over"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(keys_and_retries(proxy.addr, stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _: String = cluster.nodes[replica].cmd(&["CLUSTER", "FAILOVER"]);
    let handed_over = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if cluster.nodes[replica].role().0 == "master"
                && cluster.nodes[primary].role().0 == "slave"
            {
                cluster.wait_ok();
                return cluster;
            }
            assert!(Instant::now() < deadline, "the failover never finished");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let cluster = handed_over.await.expect("failover");
    // Keys and retries go on past the handover.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let during = load.await.expect("load");

    // Every record, those written before the handover too, replays from the new primary.
    each_ran_and_replays(&proxy, &backend, &before, &during).await;
    assert!(
        !cluster.nodes[replica].keys().is_empty(),
        "the new primary holds no record"
    );
}

/// Slots moving between primaries (`redis-cli --cluster reshard`: each slot marked migrating
/// and importing, its records moved one by one, then handed over) while keys and their
/// retries keep coming: a claim for a record not moved yet runs where it is, one for a record
/// gone runs on the importing node (ASK), no client sees an error, every record replays from
/// wherever it landed, and no key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_resharding_under_load_loses_no_record() {
    let cluster = RedisCluster::start(3);
    let backend = Backend::start().await;
    let proxy = uncached(&backend, &cluster.urls()).start().await;
    let mut before = executed_before(&proxy).await;
    // redis-cli moves a node's slots lowest first: node 0 (slots 0-5460) gets a record in its
    // first 2000 slots, which are then moved (1000 at least).
    let lowest = |node: &RedisServer| {
        node.keys()
            .iter()
            .map(|key| node.cmd::<i64>(&["CLUSTER", "KEYSLOT", key]))
            .min()
            .unwrap_or(i64::MAX)
    };
    while lowest(&cluster.nodes[0]) >= 2000 {
        assert!(
            before.len() < 500,
            "no record landed in node 0's first 2000 slots"
        );
        let key = format!("before-{}", before.len());
        let r = order(proxy.addr, &key).await;
        assert_eq!(r.result(), Some("MISS"), "{} {}", r.status, r.text());
        before.push(key);
    }
    let held_before = cluster.nodes[0].keys();
    let moving = usize::try_from(lowest(&cluster.nodes[0]) + 1)
        .expect("a slot")
        .max(1000);

    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(keys_and_retries(proxy.addr, stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::task::block_in_place(|| cluster.reshard(0, 1, moving));
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let during = load.await.expect("load");

    each_ran_and_replays(&proxy, &backend, &before, &during).await;
    let moved: Vec<String> = cluster.nodes[1]
        .keys()
        .into_iter()
        .filter(|key| held_before.contains(key))
        .collect();
    assert!(!moved.is_empty(), "no record moved: {held_before:?}");
}

/// Checks what [`keys_and_retries`] saw: each key ran (`MISS`) and its retry replayed
/// (`HIT`), at least 5 of them. Then every key, `before` too, replays, and no key ran twice.
async fn each_ran_and_replays(
    proxy: &Proxy,
    backend: &Backend,
    before: &[String],
    during: &[(String, Vec<Response>)],
) {
    for (key, answers) in during {
        let results: Vec<_> = answers.iter().map(|r| (r.status, r.result())).collect();
        assert_eq!(
            results,
            [(201, Some("MISS")), (201, Some("HIT"))],
            "{key}: {}\n{}",
            answers[0].text(),
            proxy.log()
        );
    }
    assert!(during.len() >= 5, "only {} keys meanwhile", during.len());
    eprintln!("{} keys and their retries meanwhile", during.len());
    for key in before.iter().chain(during.iter().map(|(k, _)| k)) {
        let r = order(proxy.addr, key).await;
        assert_eq!(r.result(), Some("HIT"), "{key}: {} {}", r.status, r.text());
    }
    let executed = before.len() + during.len();
    assert_eq!(backend.assert_each_id_ran_once(), executed);
    assert_eq!(backend.count(), executed);
}

/// Keys `before-0` to `before-29`, each executed now.
async fn executed_before(proxy: &Proxy) -> Vec<String> {
    let before: Vec<String> = (0..30).map(|n| format!("before-{n}")).collect();
    for key in &before {
        let r = order(proxy.addr, key).await;
        assert_eq!(r.result(), Some("MISS"), "{} {}", r.status, r.text());
    }
    before
}

/// After a primary died at `killed`: passes over the keys `before` (executed before it died),
/// each followed by a fresh key, until `taken_over()` and a whole pass replays. A key that ran
/// before is replayed or refused by the outage policy (`reject`), never run again; a fresh key
/// runs or is refused, never runs unprotected; no answer waits past the store's deadline
/// (1.4 s) by much, and the refusals come fast: their median is under 300 ms (redis-rs paused
/// 1.28 s before a Cluster retry, so every call for the dead primary's slots waited out most of
/// the deadline). Then fresh keys run and replay everywhere, and no key ran twice.
async fn records_replay_once_the_replica_took_over(
    proxy: &Proxy,
    backend: &Backend,
    before: &[String],
    killed: Instant,
    taken_over: impl Fn() -> bool,
) {
    let mut refused = Vec::new();
    let mut fresh = 0;
    let mut fresh_executed = 0;
    let back = loop {
        let mut all_replayed = true;
        for n in 0..=before.len() {
            let key = before
                .get(n)
                .cloned()
                .unwrap_or_else(|| format!("fresh-{fresh}"));
            let sent = Instant::now();
            let r = order(proxy.addr, &key).await;
            let took = sent.elapsed();
            assert!(
                took < Duration::from_secs(3),
                "{key} took {took:?} ({} {})",
                r.status,
                r.result().unwrap_or_default()
            );
            match r.result() {
                _ if refused_by_policy(&r) => {
                    refused.push(took);
                    all_replayed &= n == before.len();
                }
                Some("HIT") if n < before.len() => {}
                Some("MISS") if n == before.len() => fresh_executed += 1,
                _ => panic!("{key}: {} {}\n{}", r.status, r.text(), proxy.log()),
            }
        }
        fresh += 1;
        if all_replayed && taken_over() {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the records never replayed again ({} refused)\n{}",
            refused.len(),
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !refused.is_empty(),
        "nothing was refused while the primary was dead"
    );
    refused.sort();
    let median = refused[refused.len() / 2];
    assert!(
        median < Duration::from_millis(300),
        "refusals waited: median {median:?} of {}",
        refused.len()
    );
    for n in 0..10 {
        let key = format!("after-{n}");
        let first = order(proxy.addr, &key).await;
        assert_eq!(first.result(), Some("MISS"), "{key}: {}", first.text());
        let again = order(proxy.addr, &key).await;
        assert_eq!(again.result(), Some("HIT"), "{key}: {}", again.text());
    }
    let executed = before.len() + fresh_executed + 10;
    assert_eq!(
        backend.assert_each_id_ran_once(),
        executed,
        "back after {back:?}"
    );
    assert_eq!(backend.count(), executed);
    eprintln!(
        "records replayed again {back:?} after the kill; {} refused meanwhile (median {median:?})",
        refused.len()
    );
}

/// A Cluster primary that dies is replaced by its replica once the cluster has marked it
/// failed (`cluster-node-timeout`, 2 s here) and elected the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_primary_s_records_replay_from_its_replica_once_it_takes_over() {
    let mut cluster = RedisCluster::start_with_replicas(3, 1, &[]);
    let backend = Backend::start().await;
    let proxy = uncached(&backend, &cluster.urls()).start().await;
    let (primary, replica) = cluster.primary_and_replica();
    let before = executed_before(&proxy).await;
    assert!(
        !cluster.nodes[primary].keys().is_empty(),
        "no record on the primary that dies"
    );
    until_replicated(&cluster.nodes[primary], &cluster.nodes[replica]);

    cluster.nodes[primary].kill();
    let killed = Instant::now();
    let taken_over = || cluster.nodes[replica].role().0 == "master";
    records_replay_once_the_replica_took_over(&proxy, &backend, &before, killed, taken_over).await;
}

/// A primary behind Sentinel that dies is replaced by its replica once the Sentinel has found
/// it down (`down-after-milliseconds`, 1 s here) and promoted the replica; the proxy looks the
/// primary up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sentinel_primary_s_records_replay_from_the_replica_it_promoted() {
    let mut sentinel = RedisSentinel::start();
    let backend = Backend::start().await;
    let proxy = uncached(&backend, &[sentinel.url()]).start().await;
    let before = executed_before(&proxy).await;
    until_replicated(&sentinel.primary, &sentinel.replica);

    sentinel.primary.kill();
    let killed = Instant::now();
    let taken_over = || sentinel.master_port() == Some(sentinel.replica.port);
    records_replay_once_the_replica_took_over(&proxy, &backend, &before, killed, taken_over).await;
}

/// A single-server URL whose address moves to the new primary at a failover (a DNS name or a
/// virtual IP re-pointed, as managed Redis offerings do), while the old primary lives on as a
/// replica: the connection already open still reaches the old one, which refuses every write
/// (READONLY). idemgate drops that connection and sends the call again on a new one, which
/// reaches the new primary, so clients see no error; kept, it would send every call to a
/// replica for as long as the connection lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_server_address_moved_to_the_new_primary_is_followed() {
    let old = RedisServer::start();
    let new = RedisServer::start_with(&["--replicaof", "127.0.0.1", &old.port.to_string()]);
    let address = FaultProxy::start(old.addr()).await;
    let backend = Backend::start().await;
    let proxy = uncached(&backend, &[address.redis_url()]).start().await;
    let before = executed_before(&proxy).await;
    until_replicated(&old, &new);

    // The failover: the replica takes over, the old primary follows it, the address moves.
    let _: () = new.cmd(&["REPLICAOF", "NO", "ONE"]);
    let _: () = old.cmd(&["REPLICAOF", "127.0.0.1", &new.port.to_string()]);
    address.retarget(new.addr());

    // A fresh key (a write), every earlier one (replays), a fresh key again.
    let keys = std::iter::once(("after-0".to_owned(), "MISS"))
        .chain(before.iter().map(|key| (key.clone(), "HIT")))
        .chain(std::iter::once(("after-1".to_owned(), "MISS")));
    for (key, wanted) in keys {
        let r = order(proxy.addr, &key).await;
        assert_eq!(
            (r.status, r.result()),
            (201, Some(wanted)),
            "{key}: {}\n{}",
            r.text(),
            proxy.log()
        );
    }
    assert_eq!(backend.assert_each_id_ran_once(), before.len() + 2);
    proxy
        .log_containing("redis answered as a replica; connecting afresh")
        .await;
}

/// A Cluster shard that restarts empty (no persistence) has lost its records. A replica whose
/// purge channel is on another node keeps its connection to that channel, so nothing told it
/// before: it went on replaying its local copies of the lost records for their whole ttl, while
/// every replica without a copy ran those keys again. It now reads the servers' run ids every
/// few seconds: once it sees the restart it drops its copies, and answers as Redis now does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_records_a_restarted_cluster_shard_lost_are_dropped() {
    let mut cluster = RedisCluster::start(3);
    let backend = Backend::start().await;
    // The local cache is on: its copies are what must go.
    let proxy = ProxyBuilder::new(&backend)
        .redis(&cluster.urls())
        .start()
        .await;
    let before = executed_before(&proxy).await;
    for key in &before {
        let r = order(proxy.addr, key).await;
        assert_eq!(r.result(), Some("HIT"), "{key}: {}", r.text());
    }
    // A node holding records, other than the first (the seed, where the purge channel is).
    let lost = (1..cluster.nodes.len())
        .find(|&n| !cluster.nodes[n].keys().is_empty())
        .expect("no records beyond the first node");
    cluster.nodes[lost].restart();
    cluster.wait_ok();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !proxy
        .log()
        .contains("the restarted or replaced server may have lost them")
    {
        assert!(
            Instant::now() < deadline,
            "the restart was never seen\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut ran_again = 0;
    for key in &before {
        let r = order(proxy.addr, key).await;
        match r.result() {
            Some("HIT") => {}
            Some("MISS") => {
                // Lost with the shard: run again, as on any replica, then replayed.
                ran_again += 1;
                let replay = order(proxy.addr, key).await;
                assert_eq!(replay.result(), Some("HIT"), "{key}: {}", replay.text());
                assert_eq!(replay.body, r.body, "{key}");
            }
            _ => panic!("{key}: {} {}", r.status, r.text()),
        }
    }
    assert!(
        ran_again > 0,
        "every lost record was replayed from a local copy"
    );
    assert_eq!(backend.count(), before.len() + ran_again);
}
