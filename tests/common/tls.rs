//! TLS for tests: a private CA made at test time with the `openssl` CLI (server and client
//! certificates signed by it), and a `redis-server` that speaks only TLS, with ACL users.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis::{ClientTlsConfig, FromRedisValue, TlsCertificates, Value};

use super::redis::{free_redis_port, setinfo_rule, spawn_sentinel};

/// A private CA and certificates it signed, in a temporary directory: `ca.pem`, `server.pem` /
/// `server.key` (for `localhost` and `127.0.0.1`), `client.pem` / `client.key`.
pub struct Pki {
    dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    super::run_ok(Command::new("openssl").args(args).current_dir(dir));
}

impl Pki {
    /// Makes a new CA (P-256 keys, valid one day) and a server and a client certificate.
    pub fn generate(name: &str) -> Pki {
        let dir = tempfile::tempdir().expect("pki tempdir");
        let p = dir.path();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let subject = format!("/CN={name} test CA");
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "1",
            "-subj",
            &subject,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(p, &ca);
        std::fs::write(
            p.join("server.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n",
        )
        .expect("server.ext");
        std::fs::write(
            p.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        )
        .expect("client.ext");
        for (who, cn) in [("server", "localhost"), ("client", "idemgate")] {
            let key = format!("{who}.key");
            let csr = format!("{who}.csr");
            let pem = format!("{who}.pem");
            let ext = format!("{who}.ext");
            let subject = format!("/CN={cn}");
            let mut req = vec!["req", "-new"];
            req.extend(ec);
            req.extend(["-keyout", &key, "-out", &csr, "-subj", &subject]);
            openssl(p, &req);
            openssl(
                p,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "1",
                    "-extfile",
                    &ext,
                ],
            );
        }
        Pki { dir }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub fn ca(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// `store.redis.tls` lines for the test proxy's `store` block (indented under `redis:`).
    pub fn store_lines(&self, client_cert: bool) -> Vec<String> {
        let mut lines = vec![
            "  tls:".to_string(),
            format!("    ca_file: \"{}\"", self.ca().display()),
        ];
        if client_cert {
            lines.push(format!(
                "    cert_file: \"{}\"",
                self.path("client.pem").display()
            ));
            lines.push(format!(
                "    key_file: \"{}\"",
                self.path("client.key").display()
            ));
        }
        lines
    }

    /// The CA, and the client certificate, as redis-rs takes them.
    pub fn certificates(&self) -> TlsCertificates {
        let read = |f: &str| std::fs::read(self.path(f)).expect("read pki file");
        TlsCertificates {
            client_tls: Some(ClientTlsConfig {
                client_cert: read("client.pem"),
                client_key: read("client.key"),
            }),
            root_cert: Some(read("ca.pem")),
        }
    }
}

/// The ACL user idemgate runs as: exactly the least-privilege rules the README and
/// `config/idemgate.yaml` document.
pub const IDEMGATE_USER: &str = "idemgate";
pub const IDEMGATE_PASSWORD: &str = "s3cret-acl-password-for-tests";
pub const IDEMGATE_RULES: &str = "~idemgate:* resetchannels &idemgate:purge -@all \
     +evalsha +script|load +del +hmget +hset +hdel +pexpire +pttl +time +info +publish +subscribe";
pub const INSPECTOR_PASSWORD: &str = "inspector-password";

/// A `redis-server` that listens only on a TLS port (`--port 0`), signed by `pki`, with the
/// default user disabled, the `idemgate` ACL user, and an `inspector` user tests read with.
pub struct TlsRedis {
    pub port: u16,
    child: Option<Child>,
    certs: TlsCertificates,
    dir: tempfile::TempDir,
}

impl TlsRedis {
    /// `auth_clients`: `no`, `optional` or `yes` (`--tls-auth-clients`).
    pub fn start(pki: &Pki, auth_clients: &str) -> TlsRedis {
        TlsRedis::start_with(pki, auth_clients, "", &[])
    }

    /// A server with extra `--name value` arguments; `extra_rules` are added to the
    /// `idemgate` user's ACL rules.
    pub fn start_with(
        pki: &Pki,
        auth_clients: &str,
        extra_rules: &str,
        extra: &[&str],
    ) -> TlsRedis {
        let dir = tempfile::tempdir().expect("redis tempdir");
        let acl = dir.path().join("users.acl");
        std::fs::write(
            &acl,
            format!(
                "user default off\n\
                 user {IDEMGATE_USER} on >{IDEMGATE_PASSWORD} {IDEMGATE_RULES} {} \
                 {extra_rules}\n\
                 user inspector on >{INSPECTOR_PASSWORD} ~* &* +@all\n",
                setinfo_rule()
            ),
        )
        .expect("write users.acl");
        // The server reads its own copies of its certificate, key and CA, which `rotate`
        // replaces in place where a Redis before 7.0 cannot move to new paths.
        for (from, to) in [
            (pki.path("server.pem"), "server.pem"),
            (pki.path("server.key"), "server.key"),
            (pki.ca(), "ca.pem"),
        ] {
            std::fs::copy(from, dir.path().join(to)).expect("copy the server's TLS files");
        }
        let port = free_redis_port();
        let log = std::fs::File::create(dir.path().join("redis.log")).expect("redis log");
        let child = Command::new("redis-server")
            .args(["--port", "0"])
            .args(["--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(dir.path().join("server.pem"))
            .arg("--tls-key-file")
            .arg(dir.path().join("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(dir.path().join("ca.pem"))
            .args(["--tls-auth-clients", auth_clients])
            .arg("--aclfile")
            .arg(&acl)
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(extra)
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (is it installed?)");
        let server = TlsRedis {
            port,
            child: Some(child),
            certs: pki.certificates(),
            dir,
        };
        server.wait_ready();
        server
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Value::SimpleString(s)) = self.try_cmd(&["PING"]) {
                if s == "PONG" {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "TLS redis-server on {} did not start; log:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `rediss://<user>:<password>@localhost:<port>` for the `idemgate` user.
    pub fn url(&self) -> String {
        format!(
            "rediss://{IDEMGATE_USER}:{IDEMGATE_PASSWORD}@localhost:{}",
            self.port
        )
    }

    /// Runs one command as the `inspector` user, over TLS with the test CA.
    pub fn try_cmd(&self, args: &[&str]) -> redis::RedisResult<Value> {
        let url = format!(
            "rediss://inspector:{INSPECTOR_PASSWORD}@127.0.0.1:{}",
            self.port
        );
        let client = redis::Client::build_with_tls(url.as_str(), self.certs.clone())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn)
    }

    /// Moves the server to `to`'s certificate and CA (`CONFIG SET`, as an operator rotating
    /// certificates would) and drops the `idemgate` user's connections, on one connection made
    /// with the old CA; later commands of the test trust the new one.
    pub fn rotate(&mut self, to: &Pki) {
        let url = format!(
            "rediss://inspector:{INSPECTOR_PASSWORD}@127.0.0.1:{}",
            self.port
        );
        let client = redis::Client::build_with_tls(url.as_str(), self.certs.clone())
            .expect("client with the old CA");
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect with the old CA");
        let file = |f: &str| to.path(f).display().to_string();
        let moved: redis::RedisResult<()> = redis::cmd("CONFIG")
            .arg("SET")
            .arg("tls-cert-file")
            .arg(file("server.pem"))
            .arg("tls-key-file")
            .arg(file("server.key"))
            .arg("tls-ca-cert-file")
            .arg(to.ca().display().to_string())
            .query(&mut conn);
        if let Err(e) = moved {
            // Before 7.0 CONFIG SET takes one parameter, applied at once: a new certificate
            // beside the old key is refused. The new files replace the server's copies, and
            // setting a path again reads all three anew.
            assert!(
                super::redis::server_version().0 < 7,
                "CONFIG SET tls-*: {e}"
            );
            for (from, to) in [
                (to.path("server.pem"), "server.pem"),
                (to.path("server.key"), "server.key"),
                (to.ca(), "ca.pem"),
            ] {
                std::fs::copy(from, self.dir.path().join(to)).expect("replace a TLS file");
            }
            let own = self.dir.path().join("server.pem").display().to_string();
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("tls-cert-file")
                .arg(own)
                .query(&mut conn)
                .expect("CONFIG SET tls-cert-file");
        }
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("USER")
            .arg(IDEMGATE_USER)
            .query(&mut conn)
            .expect("CLIENT KILL USER");
        self.certs = to.certificates();
    }

    pub fn cmd<T: FromRedisValue>(&self, args: &[&str]) -> T {
        let reply = self
            .try_cmd(args)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"));
        redis::from_redis_value(reply).unwrap_or_else(|e| panic!("redis {args:?} reply: {e}"))
    }

    /// Every key name, by SCAN.
    pub fn scan_keys(&self) -> Vec<String> {
        let mut cursor = "0".to_string();
        let mut keys = Vec::new();
        loop {
            let (next, batch): (String, Vec<String>) =
                self.cmd(&["SCAN", &cursor, "COUNT", "1000"]);
            keys.extend(batch);
            if next == "0" {
                return keys;
            }
            cursor = next;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Redis Cluster of TLS-only primaries (`tls-cluster yes`: the bus is TLS too), created with
/// `redis-cli --tls --cluster create`. The `idemgate` user also gets `+cluster|slots` (the
/// Cluster client reads the topology with it), `+ping` (it checks node connections with it) and
/// `+eval` (a script run on a node a slot migration asks a key of, before it has the script).
pub struct TlsCluster {
    pub nodes: Vec<TlsRedis>,
}

impl TlsCluster {
    pub fn start(pki: &Pki, primaries: usize) -> TlsCluster {
        let nodes: Vec<TlsRedis> = (0..primaries)
            .map(|_| {
                TlsRedis::start_with(
                    pki,
                    "no",
                    "+cluster|slots +ping +eval",
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                        "--tls-cluster",
                        "yes",
                    ],
                )
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create
            .arg("--tls")
            .arg("--cacert")
            .arg(pki.ca())
            .args(["--user", "inspector", "--pass", INSPECTOR_PASSWORD])
            .args(["--cluster", "create"]);
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        super::run_ok(&mut create);
        let deadline = Instant::now() + Duration::from_secs(10);
        for node in &nodes {
            loop {
                let info: String = node.cmd(&["CLUSTER", "INFO"]);
                let slots: Vec<Value> = node.cmd(&["CLUSTER", "SLOTS"]);
                if info.contains("cluster_state:ok") && slots.len() == primaries {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "TLS cluster node {} not ok:\n{info}",
                    node.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        TlsCluster { nodes }
    }

    /// Seed URLs (`rediss://idemgate:...@localhost:<port>`), one per node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(TlsRedis::url).collect()
    }

    /// Every key name on every node.
    pub fn scan_keys(&self) -> Vec<String> {
        self.nodes.iter().flat_map(TlsRedis::scan_keys).collect()
    }
}

/// A TLS-only primary (the `idemgate` user also gets `+role`, which the Sentinel client runs
/// to confirm the primary) and one Sentinel on a TLS-only port that reaches the primary over
/// TLS (`tls-replication yes`) as the `inspector` user, monitoring it as `mymaster`.
pub struct TlsSentinel {
    pub primary: TlsRedis,
    pub sentinel_port: u16,
    sentinel: Option<Child>,
    certs: TlsCertificates,
    dir: tempfile::TempDir,
}

impl TlsSentinel {
    pub const MASTER: &'static str = "mymaster";

    pub fn start(pki: &Pki) -> TlsSentinel {
        let primary = TlsRedis::start_with(pki, "no", "+role", &[]);
        let dir = tempfile::tempdir().expect("sentinel tempdir");
        let sentinel_port = free_redis_port();
        let child = spawn_sentinel(
            dir.path(),
            &format!(
                "port 0\ntls-port {sentinel_port}\nbind 127.0.0.1\ndir {dir}\n\
                 tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca}\n\
                 tls-auth-clients no\ntls-replication yes\n\
                 sentinel monitor {m} 127.0.0.1 {p} 1\n\
                 sentinel auth-user {m} inspector\nsentinel auth-pass {m} {INSPECTOR_PASSWORD}\n\
                 sentinel down-after-milliseconds {m} 1000\n",
                dir = dir.path().display(),
                cert = pki.path("server.pem").display(),
                key = pki.path("server.key").display(),
                ca = pki.ca().display(),
                m = Self::MASTER,
                p = primary.port,
            ),
        );
        let setup = TlsSentinel {
            primary,
            sentinel_port,
            sentinel: Some(child),
            certs: pki.certificates(),
            dir,
        };
        setup.wait_for_master();
        setup
    }

    /// Waits until the Sentinel reports the primary up (it reached it over TLS).
    fn wait_for_master(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let master: redis::RedisResult<std::collections::HashMap<String, String>> =
                self.sentinel_cmd(&["SENTINEL", "MASTER", Self::MASTER]);
            let up = master
                .as_ref()
                .ok()
                .and_then(|m| m.get("flags"))
                .is_some_and(|f| f.split(',').any(|x| x == "master") && !f.contains("down"));
            let seen = master
                .as_ref()
                .ok()
                .and_then(|m| m.get("role-reported"))
                .is_some_and(|r| r == "master");
            if up && seen {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sentinel never saw the TLS primary ({master:?}); log:\n{}",
                std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `rediss+sentinel://idemgate:...@localhost:<sentinel port>/mymaster`.
    pub fn url(&self) -> String {
        format!(
            "rediss+sentinel://{IDEMGATE_USER}:{IDEMGATE_PASSWORD}@localhost:{}/{}",
            self.sentinel_port,
            Self::MASTER
        )
    }

    pub fn sentinel_cmd<T: FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let url = format!("rediss://127.0.0.1:{}", self.sentinel_port);
        let client = redis::Client::build_with_tls(url.as_str(), self.certs.clone())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn)
    }
}

impl Drop for TlsSentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.sentinel.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
