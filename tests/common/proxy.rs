//! Starts the real `idemgate` binary on free ports in front of a backend.

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::backend::Backend;
use super::client::Request;

/// Ports this test process has handed out: never handed out twice, so two servers started at
/// once (or one on a port another test keeps free to start a server on later) cannot be given
/// the same port (a port found free and released is free for anyone).
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A loopback port in `low..high` that is free now, with `free_too` of it (another port a
/// server binds beside it) free too, and that this process has not handed out before.
pub fn reserve_port(low: u16, high: u16, free_too: impl Fn(u16) -> Option<u16>) -> u16 {
    let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..10_000 {
        let port = low + rand::random::<u16>() % (high - low);
        if !handed_out.contains(&port) && free(port) && free_too(port).is_none_or(free) {
            handed_out.insert(port);
            return port;
        }
    }
    panic!("no free port in {low}-{high}");
}

/// A free loopback port for a proxy to bind right after. It lies below the kernel's ephemeral
/// range (32768-60999 by default; Redis test servers take 20000 and up), so no outgoing
/// connection of a concurrent test can take it in between, as one did with ports the kernel
/// picked (`bind(0)` hands out ephemeral ones).
pub fn free_port() -> u16 {
    reserve_port(10_000, 20_000, |_| None)
}

/// Two free ports (see [`free_port`]), different from each other.
pub fn free_port_pair() -> (u16, u16) {
    (free_port(), free_port())
}

/// Builds the config of a test proxy: an `orders` route on `/orders` (idempotent, POST PUT
/// PATCH DELETE), an `optional` route on `/optional` (key optional), a `plain` route on `/plain`
/// (no idempotency), and two upstreams so unmatched paths have no default.
pub struct ProxyBuilder {
    backend: SocketAddr,
    idempotency: Vec<String>,
    global_idempotency: Vec<String>,
    upstream: Vec<String>,
    store_backend: &'static str,
    store: Vec<String>,
    top: Vec<String>,
    env: Vec<(String, String)>,
    configmap: bool,
    worker_id: Option<u16>,
    threads: usize,
    /// An address listed before the backend in the `orders` upstream.
    orders_first: Option<SocketAddr>,
}

impl ProxyBuilder {
    /// Lays the config out as a Kubernetes ConfigMap volume does (symlinks through `..data`).
    pub fn configmap(mut self) -> Self {
        self.configmap = true;
        self
    }

    pub fn new(backend: &Backend) -> Self {
        Self::at(backend.addr)
    }

    /// A proxy whose upstreams are at `backend` (a server the test runs itself).
    pub fn at(backend: SocketAddr) -> Self {
        ProxyBuilder {
            backend,
            idempotency: vec![],
            global_idempotency: vec![],
            upstream: vec![],
            store_backend: "memory",
            store: vec![],
            top: vec![],
            env: vec![],
            configmap: false,
            worker_id: Some(1),
            threads: 2,
            orders_first: None,
        }
    }
    /// Lists `addr` before the backend in the `orders` upstream (round robin starts there).
    #[allow(dead_code)]
    pub fn orders_first(mut self, addr: SocketAddr) -> Self {
        self.orders_first = Some(addr);
        self
    }
    /// The Snowflake worker id (default 1); give each of several instances its own.
    pub fn worker_id(mut self, id: u16) -> Self {
        self.worker_id = Some(id);
        self
    }
    /// No worker id in the config: the proxy picks one (on Redis, it leases one).
    #[allow(dead_code)]
    pub fn no_worker_id(mut self) -> Self {
        self.worker_id = None;
        self
    }
    /// A line (`key: value`) added to the `orders` route's idempotency block.
    pub fn idem(mut self, line: &str) -> Self {
        self.idempotency.push(line.to_string());
        self
    }
    /// The `orders` route waits for an in-flight original (`on_in_flight: wait`) up to
    /// `wait_timeout` (`"2s"`).
    pub fn waiting(self, wait_timeout: &str) -> Self {
        self.idem("on_in_flight: wait")
            .idem(&format!("wait_timeout: {wait_timeout}"))
    }
    /// A line (`key: value`) added to the top-level `idempotency` block.
    pub fn global(mut self, line: &str) -> Self {
        self.global_idempotency.push(line.to_string());
        self
    }
    /// A line added to the `orders` upstream.
    pub fn upstream(mut self, line: &str) -> Self {
        self.upstream.push(line.to_string());
        self
    }
    /// A line added to the `store` block.
    pub fn store(mut self, line: &str) -> Self {
        self.store.push(line.to_string());
        self
    }
    /// `store.redis.scripts`: the versions under `dir`, `version` active (after `redis`, or a
    /// `redis:` line of its own).
    pub fn scripts(self, dir: &std::path::Path, version: &str) -> Self {
        let line = format!(
            "  scripts: {{dir: \"{}\", version: {version}}}",
            dir.display()
        );
        self.store(&line)
    }
    /// An environment variable for the proxy process.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    /// Switches the store to Redis at `urls` (a cluster when there are several); further
    /// `store.redis` keys can follow as `.store("  key: value")` lines.
    pub fn redis(mut self, urls: &[String]) -> Self {
        self.store_backend = "redis";
        let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
        self.store.push("redis:".to_string());
        self.store.push(format!("  urls: [{}]", list.join(", ")));
        self
    }
    /// Worker threads (2 unless set). Each has its own upstream connection pool.
    #[allow(dead_code)]
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }
    /// A top-level line.
    pub fn top(mut self, line: &str) -> Self {
        self.top.push(line.to_string());
        self
    }

    fn yaml(&self, port: u16, admin: u16) -> String {
        let ind = |lines: &[String], n: usize| {
            lines
                .iter()
                .map(|l| format!("{}{l}\n", " ".repeat(n)))
                .collect::<String>()
        };
        format!(
            "listen: \"127.0.0.1:{port}\"\nthreads: {threads}\n{top}admin:\n  listen: \"127.0.0.1:{admin}\"\n\
             upstreams:\n  orders:\n    addrs: [{first}\"{backend}\"]\n{up}  other:\n    addrs: [\"{backend}\"]\n\
             idempotency:\n  {worker_id}\n{global}store:\n  backend: {store_backend}\n{store}\
             routes:\n  - name: orders\n    methods: [POST, PUT, PATCH, DELETE]\n    path_prefix: /orders\n    upstream: orders\n    idempotency:\n      key: required\n{idem}\
             \x20 - name: optional\n    methods: [POST]\n    path_prefix: /optional\n    upstream: orders\n    idempotency:\n      key: optional\n\
             \x20 - name: plain\n    path_prefix: /plain\n    upstream: orders\n",
            top = ind(&self.top, 0),
            backend = self.backend,
            first = self
                .orders_first
                .map(|a| format!("\"{a}\", "))
                .unwrap_or_default(),
            up = ind(&self.upstream, 4),
            store_backend = self.store_backend,
            // The block must not be empty: a filler line when no id is set.
            worker_id = match self.worker_id {
                Some(id) => format!("worker_id: {id}"),
                None => "default_tenant: default".to_string(),
            },
            threads = self.threads,
            store = ind(&self.store, 2),
            idem = ind(&self.idempotency, 6),
            global = ind(&self.global_idempotency, 2),
        )
    }

    /// Starts the proxy and waits until it answers. A port taken between being found free and
    /// being bound (another test's outgoing connection may get it) means new ports and a new try.
    pub async fn start(self) -> Proxy {
        for _ in 0..4 {
            if let Some(proxy) = self.try_start().await {
                return proxy;
            }
        }
        panic!("idemgate found its ports taken four times in a row");
    }

    /// One start on fresh ports: `None` when the proxy exited because one of them was taken.
    async fn try_start(&self) -> Option<Proxy> {
        let (port, admin_port) = free_port_pair();
        let dir = tempfile::tempdir().expect("tempdir");
        let config_dir = dir.path().join("config");
        std::fs::create_dir(&config_dir).expect("config dir");
        let config_path = config_dir.join("idemgate.yaml");
        let yaml = self.yaml(port, admin_port);
        if self.configmap {
            // The layout of a Kubernetes ConfigMap volume: the file is a symlink through `..data`.
            let version = config_dir.join("..2026_01_01_00_00_00.000000001");
            std::fs::create_dir(&version).expect("version dir");
            std::fs::write(version.join("idemgate.yaml"), &yaml).expect("write config");
            std::os::unix::fs::symlink(version.file_name().unwrap(), config_dir.join("..data"))
                .expect("..data link");
            std::os::unix::fs::symlink("..data/idemgate.yaml", &config_path).expect("file link");
        } else {
            std::fs::write(&config_path, &yaml).expect("write config");
        }
        let log_path = dir.path().join("idemgate.log");
        let mut proxy = Proxy {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
            child: None,
            log_path,
            config_path,
            yaml,
            updates: 0,
            env: self.env.clone(),
            _dir: dir,
        };
        proxy.child = Some(proxy.spawn());
        if proxy.wait_ready().await {
            Some(proxy)
        } else {
            None
        }
    }
}

/// A running proxy process; killed on drop.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    child: Option<Child>,
    pub log_path: PathBuf,
    pub config_path: PathBuf,
    /// The config text as last written.
    pub yaml: String,
    updates: u32,
    env: Vec<(String, String)>,
    _dir: tempfile::TempDir,
}

/// How a config edit reaches the file.
#[derive(Clone, Copy, Debug)]
pub enum Edit {
    /// Truncate and write the same file (an editor saving in place).
    InPlace,
    /// Write a temporary file and rename it over the config (atomic replace).
    Rename,
    /// Publish a new `..data` directory and swap the symlink (a ConfigMap update).
    ConfigMap,
}

impl Proxy {
    /// Starts the binary on this proxy's config; its log is appended to the same file.
    fn spawn(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .expect("log file");
        Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .arg("--config")
            .arg(&self.config_path)
            // Relative paths in the config (the dead-letter file) land in the test's own
            // directory, never in the source tree.
            .current_dir(self._dir.path())
            // Nothing of the caller's own environment reaches the proxy but what the test sets.
            .env_remove("IDEMGATE_ADMIN_TOKEN")
            .env_remove("IDEMGATE_REDIS_PASSWORD")
            .env_remove("IDEMGATE_WORKER_ID")
            .env_remove("IDEMGATE_LOG_FORMAT")
            .env("IDEMGATE_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn idemgate")
    }

    /// Starts the process again on the same ports and config (killing it first if it still
    /// runs) and waits until it answers.
    pub async fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.child = Some(self.spawn());
        assert!(
            self.wait_ready().await,
            "ports taken on restart:\n{}",
            self.log()
        );
    }

    /// The exit status, if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits until the proxy answers; false when it exited because a port was taken (the
    /// caller may try other ports), a panic on any other failure to start.
    async fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let proxy_up = tokio::net::TcpStream::connect(self.addr).await.is_ok();
            let admin_up = tokio::net::TcpStream::connect(self.admin).await.is_ok();
            if proxy_up && admin_up {
                let r = Request::get("/healthz").send(self.admin).await;
                if r.status == 200 {
                    return true;
                }
            }
            if self.exited().is_some() && self.log().contains("Address already in use") {
                return false;
            }
            if Instant::now() > deadline {
                panic!("idemgate did not start; log:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Rewrites the config with `edit` applied to its text, delivered the way `how` says.
    pub fn edit_config(&mut self, how: Edit, edit: impl FnOnce(&str) -> String) {
        let yaml = edit(&self.yaml);
        self.updates += 1;
        let dir = self.config_path.parent().unwrap().to_path_buf();
        match how {
            Edit::InPlace => std::fs::write(&self.config_path, &yaml).unwrap(),
            Edit::Rename => {
                let tmp = dir.join(format!(".idemgate.yaml.tmp{}", self.updates));
                std::fs::write(&tmp, &yaml).unwrap();
                std::fs::rename(&tmp, &self.config_path).unwrap();
            }
            Edit::ConfigMap => {
                let version = format!(
                    "..2026_01_01_00_00_{:02}.{:09}",
                    self.updates % 60,
                    self.updates
                );
                std::fs::create_dir(dir.join(&version)).unwrap();
                std::fs::write(dir.join(&version).join("idemgate.yaml"), &yaml).unwrap();
                let tmp_link = dir.join("..data_tmp");
                std::os::unix::fs::symlink(&version, &tmp_link).unwrap();
                std::fs::rename(&tmp_link, dir.join("..data")).unwrap();
            }
        }
        self.yaml = yaml;
    }

    /// Waits (up to 5 s) until the log contains `needle`; the proxy writes its log in batches
    /// every 50 ms, so a line is not there the instant its event happened.
    pub async fn log_containing(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let log = self.log();
            if log.contains(needle) {
                return log;
            }
            if Instant::now() > deadline {
                panic!("the log never contained {needle:?}:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The log once every line written before now is in it: a request for `/plain/log-marker`
    /// goes through, and its access line, written after all earlier lines, is waited for. For
    /// checks that something is absent from the log, which pass vacuously on a log not yet
    /// flushed.
    pub async fn log_written(&self) -> String {
        let marker = Request::get("/plain/log-marker").send(self.addr).await;
        assert_eq!(marker.status, 201, "{}", marker.text());
        self.log_containing("/plain/log-marker").await
    }

    /// What the proxy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends a signal (`TERM`, `KILL`, ...) to the proxy.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{name} failed");
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The admin `/metrics` text once it contains `needle` (metrics are recorded just after a
    /// response is written); panics after 5 s.
    pub async fn metrics_containing(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = self.metrics().await;
            if m.contains(needle) {
                return m;
            }
            if Instant::now() > deadline {
                panic!("metrics never contained {needle}:\n{m}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The admin `/metrics` text.
    pub async fn metrics(&self) -> String {
        Request::get("/metrics").send(self.admin).await.text()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let mut err = std::io::stderr();
            let _ = writeln!(err, "--- idemgate log ---\n{}", self.log());
        }
    }
}
