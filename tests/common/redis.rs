//! Real Redis for tests: single servers, Redis Clusters (primaries only, or with replicas) and a
//! Sentinel setup, each process started on free ports in its own temporary directory and killed by
//! pid, so tests can break Redis on purpose. Everything is killed on drop, panics included.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis::{FromRedisValue, Value};

/// Data ports are 20000 up to this, bus ports (Redis Cluster's, port + 10000) 30000 up to
/// this + 10000: both below the kernel's ephemeral range (32768-60999 by default), so no
/// outgoing connection of a concurrent test can take one between its probe and the bind.
const HIGHEST_PORT: u16 = 22_768;
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The command rights of the least-privilege ACL user on a single server, as documented in
/// `config/idemgate.yaml` (key patterns and channels come on top): EVALSHA + SCRIPT LOAD, DEL,
/// what the scripts call, and INFO (the eviction setting).
#[allow(dead_code)]
pub const SCRIPT_RIGHTS: [&str; 11] = [
    "-@all",
    "+evalsha",
    "+script|load",
    "+del",
    "+hmget",
    "+hset",
    "+hdel",
    "+pexpire",
    "+pttl",
    "+time",
    "+info",
];

/// The `redis-server` on the `PATH`: its version, as `(major, minor)`.
pub fn server_version() -> (u32, u32) {
    static VERSION: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    *VERSION.get_or_init(|| {
        let out = Command::new("redis-server")
            .arg("--version")
            .output()
            .expect("redis-server --version (is it installed?)");
        let text = String::from_utf8_lossy(&out.stdout);
        let version = text
            .split_whitespace()
            .find_map(|word| word.strip_prefix("v="))
            .unwrap_or_else(|| panic!("no version in {text:?}"));
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
    })
}

/// The ACL rule for the `CLIENT SETINFO` the Redis client sends on each new connection (its
/// answer is ignored): Redis 6 and 7.2+ log a denial of it for a user without the rule, 7.0
/// and 7.1 have no such subcommand and refuse the rule. As the README documents.
#[allow(dead_code)]
pub fn setinfo_rule() -> &'static str {
    match server_version() {
        (7, 0 | 1) => "",
        _ => "+client|setinfo",
    }
}

/// A loopback port that is free now (and, for cluster use, whose bus port is too), and that
/// this process has not handed out before (see [`super::proxy::reserve_port`]).
pub fn free_redis_port() -> u16 {
    super::proxy::reserve_port(20_000, HIGHEST_PORT, |port| Some(port + 10_000))
}

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    extra: Vec<String>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// A plain server on a free port, no persistence.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// A server with extra `--name value` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut server = RedisServer {
            port: free_redis_port(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
            dir: tempfile::tempdir().expect("redis tempdir"),
        };
        server.launch();
        server
    }

    /// A port no server listens on (for "Redis is down" tests); start one there later with
    /// [`RedisServer::start_on`].
    pub fn unused_port() -> u16 {
        free_redis_port()
    }

    /// A plain server on a given port.
    pub fn start_on(port: u16) -> RedisServer {
        let mut server = RedisServer {
            port,
            extra: vec![],
            child: None,
            dir: tempfile::tempdir().expect("redis tempdir"),
        };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).expect("redis log");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (is it installed?)");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(reply) = self.try_cmd(&["PING"]) {
                if matches!(reply, Value::SimpleString(ref s) if s == "PONG") {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "redis-server on {} did not start; log:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// This server's role (`master` or `slave`) and, for a replica, its primary's port.
    pub fn role(&self) -> (String, Option<u16>) {
        let role: Vec<Value> = self.cmd(&["ROLE"]);
        let text = |v: Option<&Value>| match v {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            other => panic!("ROLE of {}: {other:?}", self.port),
        };
        let name = text(role.first());
        let primary = (name == "slave").then(|| match role.get(2) {
            Some(Value::Int(port)) => u16::try_from(*port).expect("port"),
            other => panic!("ROLE of {}: {other:?}", self.port),
        });
        (name, primary)
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs the process (by pid) and waits for it; the port is free afterwards.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// Waits until `listeners` purge listeners are subscribed on this server.
    pub async fn until_purge_listeners(&self, listeners: i64) {
        // A listener notices a dead connection at its next heartbeat (5 s) once one goes
        // unanswered (2 s), then subscribes again: room for that on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let subs: Vec<Value> = self.cmd(&["PUBSUB", "NUMSUB", "idemgate:purge"]);
            if matches!(subs.get(1), Some(Value::Int(n)) if *n == listeners) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "listeners never subscribed: {subs:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs one command on this server and converts the reply.
    pub fn cmd<T: FromRedisValue>(&self, args: &[&str]) -> T {
        let reply = self
            .try_cmd(args)
            .unwrap_or_else(|e| panic!("redis {args:?} on {}: {e}", self.port));
        redis::from_redis_value(reply).unwrap_or_else(|e| panic!("redis {args:?} reply: {e}"))
    }

    /// Runs one command on this server on a fresh connection.
    pub fn try_cmd(&self, args: &[&str]) -> redis::RedisResult<Value> {
        let client = redis::Client::open(self.url())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn)
    }

    /// Commands this server has run since it started (or since `CONFIG RESETSTAT`), from
    /// `INFO commandstats`; the `INFO` that asks is not counted yet.
    /// The purge listeners' heartbeats (a `SUBSCRIBE` every 5 s each) are not counted: they
    /// come whatever requests do.
    pub fn calls(&self) -> u64 {
        let info: String = self.cmd(&["INFO", "commandstats"]);
        // Not the `CLIENT SETINFO` each new connection sends (this helper's own too), which
        // Redis 6 and 7.2+ count and 7.0 refuses uncounted.
        info.lines()
            .filter(|l| !l.starts_with("cmdstat_subscribe:"))
            .filter(|l| !l.starts_with("cmdstat_client"))
            .filter_map(|l| l.split("calls=").nth(1))
            .filter_map(|v| v.split(',').next()?.parse::<u64>().ok())
            .sum()
    }

    /// How many times this server has run `command` (lower case, as `INFO commandstats` names
    /// it: `evalsha`), counting the calls scripts make too for the commands they call.
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix[..]))
            .and_then(|v| v.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Every key on this server (`KEYS *`, fine for a test server).
    pub fn keys(&self) -> Vec<String> {
        self.cmd(&["KEYS", "*"])
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster created with `redis-cli --cluster create`: primaries only, or primaries
/// with replicas ([`RedisCluster::start_with_replicas`]).
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    replicas: usize,
}

impl RedisCluster {
    /// Starts `primaries` cluster-enabled servers and joins them; returns once every node
    /// reports `cluster_state:ok`.
    pub fn start(primaries: usize) -> RedisCluster {
        RedisCluster::start_with(primaries, &[])
    }

    /// [`RedisCluster::start`] with `extra` arguments for every node.
    pub fn start_with(primaries: usize, extra: &[&str]) -> RedisCluster {
        RedisCluster::start_with_replicas(primaries, 0, extra)
    }

    /// `primaries` primaries with `replicas` replicas each (which node is which is
    /// `redis-cli`'s choice: ask [`RedisCluster::role`]); returns once every node reports
    /// `cluster_state:ok`, every slot range lists its replicas and every replica is in sync.
    pub fn start_with_replicas(primaries: usize, replicas: usize, extra: &[&str]) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..primaries * (1 + replicas))
            .map(|_| {
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ];
                args.extend_from_slice(extra);
                RedisServer::start_with(&args)
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]);
        super::run_ok(&mut create);
        let cluster = RedisCluster { nodes, replicas };
        cluster.wait_ok();
        cluster
    }

    /// Waits until every node reports `cluster_state:ok` and slots owned by every primary, each
    /// range naming its replicas, and every replica's link to its primary is up.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + START_TIMEOUT * 2;
        let primaries = self.nodes.len() / (1 + self.replicas);
        for node in &self.nodes {
            loop {
                let info: String = node.cmd(&["CLUSTER", "INFO"]);
                let slots: Vec<Vec<Value>> = node.cmd(&["CLUSTER", "SLOTS"]);
                let replicated = slots.iter().all(|range| range.len() == 3 + self.replicas);
                // Ranges by their primary (a reshard splits one primary's slots into several).
                let owners: std::collections::BTreeSet<String> = slots
                    .iter()
                    .filter_map(|range| range.get(2))
                    .map(|primary| format!("{primary:?}"))
                    .collect();
                let linked = match node.role() {
                    (role, _) if role == "slave" => {
                        let repl: String = node.cmd(&["INFO", "replication"]);
                        repl.contains("master_link_status:up")
                    }
                    _ => true,
                };
                if info.contains("cluster_state:ok")
                    && owners.len() == primaries
                    && replicated
                    && linked
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster node {} not ok:\n{info}",
                    node.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The index of a primary and of its (first) replica.
    pub fn primary_and_replica(&self) -> (usize, usize) {
        let replica = (0..self.nodes.len())
            .find(|&i| self.nodes[i].role().0 == "slave")
            .expect("a replica");
        let primary_port = self.nodes[replica].role().1.expect("its primary");
        let primary = self
            .nodes
            .iter()
            .position(|n| n.port == primary_port)
            .expect("the primary is one of the nodes");
        (primary, replica)
    }

    /// Moves `slots` slots from the primary at `from` to the one at `to` (`redis-cli --cluster
    /// reshard`, which takes a node's lowest slots first), one slot and its records at a time.
    pub fn reshard(&self, from: usize, to: usize, slots: usize) {
        let id = |node: usize| -> String { self.nodes[node].cmd(&["CLUSTER", "MYID"]) };
        let mut reshard = Command::new("redis-cli");
        reshard
            .args([
                "--cluster",
                "reshard",
                &format!("127.0.0.1:{}", self.nodes[from].port),
            ])
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"]);
        super::run_ok(&mut reshard);
    }

    /// Seed URLs, one per node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Every key on every node, with the node's port.
    pub fn keys(&self) -> Vec<(u16, String)> {
        self.nodes
            .iter()
            .flat_map(|node| node.keys().into_iter().map(|k| (node.port, k)))
            .collect()
    }
}

/// Waits until `replica` has everything `primary` wrote (replication is asynchronous: what a
/// primary never passed on dies with it).
pub fn until_replicated(primary: &RedisServer, replica: &RedisServer) {
    let offset = |node: &RedisServer, field: &str| -> Option<u64> {
        let info: String = node.cmd(&["INFO", "replication"]);
        info.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().parse().ok())
    };
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let wrote = offset(primary, "master_repl_offset:");
        let has = offset(replica, "slave_repl_offset:");
        if wrote.is_some() && wrote == has {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replica never caught up: {has:?} of {wrote:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A primary, one replica and one Sentinel monitoring them as `mymaster` (quorum 1).
pub struct RedisSentinel {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinel_port: u16,
    sentinel: Option<Child>,
    dir: tempfile::TempDir,
}

/// Writes `conf` as `<dir>/sentinel.conf` and starts a Sentinel on it, logging to
/// `<dir>/sentinel.log`.
pub fn spawn_sentinel(dir: &Path, conf: &str) -> Child {
    let path = dir.join("sentinel.conf");
    std::fs::write(&path, conf).expect("write sentinel.conf");
    let log = std::fs::File::create(dir.join("sentinel.log")).expect("sentinel log");
    Command::new("redis-server")
        .arg(&path)
        .arg("--sentinel")
        .stdout(log)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server --sentinel")
}

impl RedisSentinel {
    pub const MASTER: &'static str = "mymaster";

    pub fn start() -> RedisSentinel {
        let primary = RedisServer::start();
        let replica_of = primary.port.to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &replica_of]);
        let dir = tempfile::tempdir().expect("sentinel tempdir");
        let sentinel_port = free_redis_port();
        let child = spawn_sentinel(
            dir.path(),
            &format!(
                "port {sentinel_port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {m} 127.0.0.1 {p} 1\n\
                 sentinel down-after-milliseconds {m} 1000\n\
                 sentinel failover-timeout {m} 5000\n",
                dir = dir.path().display(),
                m = Self::MASTER,
                p = primary.port,
            ),
        );
        let setup = RedisSentinel {
            primary,
            replica,
            sentinel_port,
            sentinel: Some(child),
            dir,
        };
        setup.wait_for_master(setup.primary.port);
        setup
    }

    /// `redis+sentinel://127.0.0.1:<sentinel port>/mymaster`.
    pub fn url(&self) -> String {
        format!(
            "redis+sentinel://127.0.0.1:{}/{}",
            self.sentinel_port,
            Self::MASTER
        )
    }

    pub fn sentinel_cmd<T: FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.sentinel_port))?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn)
    }

    /// Waits until the Sentinel's master entry (what clients look up, the failover finished)
    /// names `port` as the primary.
    pub fn wait_for_master(&self, port: u16) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let named = self.master_port();
            if named == Some(port) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sentinel never named port {port} as primary ({named:?}); log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The port of the primary the Sentinel's master entry names now, if it answers.
    pub fn master_port(&self) -> Option<u16> {
        let master: std::collections::HashMap<String, String> = self
            .sentinel_cmd(&["SENTINEL", "MASTER", Self::MASTER])
            .ok()?;
        master.get("port")?.parse().ok()
    }

    /// Forces a failover to the replica and waits until the Sentinel names it, it has taken
    /// the primary role, and the old primary has been turned into a replica. (Until then the
    /// old primary still takes writes: the split-brain window every Sentinel setup has.)
    /// Clients of the old primary stay connected, so they meet READONLY.
    pub fn fail_over(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        // The Sentinel must have discovered a healthy replica first (NOGOODSLAVE until then).
        loop {
            match self.sentinel_cmd::<String>(&["SENTINEL", "FAILOVER", Self::MASTER]) {
                Ok(_) => break,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "SENTINEL FAILOVER kept failing: {e}; log:\n{}",
                        self.log()
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        self.wait_for_master(self.replica.port);
        // The Sentinel turns the old primary into a replica when it next reads its INFO (up to
        // 10 s); do now what it will do then.
        let _: () = self
            .primary
            .cmd(&["REPLICAOF", "127.0.0.1", &self.replica.port.to_string()]);
        for (server, wanted) in [(&self.replica, "master"), (&self.primary, "slave")] {
            loop {
                if server.role().0 == wanted {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "port {} never became {wanted}; log:\n{}",
                    server.port,
                    self.log()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.sentinel.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The text of one of the repository's scripts (`lua/<version>/<name>.lua`).
#[allow(dead_code)]
pub fn repo_lua(version: &str, name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("lua")
        .join(version)
        .join(format!("{name}.lua"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A script directory holding `version` as a copy of the repository's `from` version, with
/// `edit` applied to each script's text (by script name).
#[allow(dead_code)]
pub fn script_dir(
    root: &Path,
    version: &str,
    from: &str,
    edit: impl Fn(&str, String) -> String,
) -> PathBuf {
    let dir = root.join(version);
    std::fs::create_dir_all(&dir).unwrap();
    for name in idemgate::scripts::SCRIPT_NAMES {
        let text = edit(name, repo_lua(from, name));
        std::fs::write(dir.join(format!("{name}.lua")), text).unwrap();
    }
    dir
}
