//! Live config: watch the config file's directory, load with the same pure function as start-up,
//! and swap a validated [`Generation`] in; an invalid edit keeps the running config.
//!
//! The watcher only signals. It watches the *directory*, because a Kubernetes ConfigMap volume
//! swaps a `..data` symlink and inotify on the file itself sees nothing; it re-reads through the
//! visible path, debounces bursts, ignores access events (reading the file fires them), and a
//! content-hash poll on a timer catches whatever the watcher misses (e.g. `subPath`-free mounts on
//! filesystems without inotify). In-flight requests keep the generation they started with.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use notify::{EventKind, RecursiveMode, Watcher};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::config::{Config, ScriptsConfig};
use crate::metrics::{Metrics, Pull};
use crate::proxy::Generation;

/// How a reload attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new config is live.
    Applied {
        /// Hash of the new config text.
        hash: String,
    },
    /// The file has not changed since the running config was loaded.
    Unchanged,
}

/// Counters and timestamps of reloads, exported as metrics.
#[derive(Debug, Default)]
pub struct ReloadStats {
    /// 1 when the last attempt succeeded (or there was none), else 0.
    pub last_successful: AtomicU64,
    /// Unix seconds of the last successful load (start-up counts).
    pub last_success_unix: AtomicU64,
    /// Successful reloads after start-up.
    pub reloads: AtomicU64,
    /// Failed reload attempts.
    pub failures: AtomicU64,
}

/// Called with every config swapped in, after the swap (e.g. to hand script settings to the
/// Redis store). Runs on the reloading thread: it must not block.
type SwapHook = Box<dyn Fn(&Config) + Send + Sync>;

/// Loads, validates and swaps configs.
pub struct Reloader {
    path: PathBuf,
    current: Arc<ArcSwap<Generation>>,
    metrics: Arc<Metrics>,
    stats: Arc<ReloadStats>,
    /// Serialises reloads (watcher, poll, SIGHUP and the admin endpoint may race).
    lock: Mutex<()>,
    /// Unix seconds at which the running config was loaded.
    loaded_at: AtomicU64,
    /// Hash of the last file content that failed to load, so the poll does not repeat the error.
    failed_hash: Mutex<Option<String>>,
    /// Told about every swapped-in config.
    on_swap: Mutex<Vec<SwapHook>>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// === impl Reloader ===

impl Reloader {
    /// Creates the reloader for the config at `path`, whose current generation is `current`.
    pub fn new(
        path: PathBuf,
        current: Arc<ArcSwap<Generation>>,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let stats = Arc::new(ReloadStats::default());
        stats.last_successful.store(1, Ordering::Relaxed);
        stats.last_success_unix.store(now_unix(), Ordering::Relaxed);
        let reloader = Arc::new(Reloader {
            path,
            current,
            metrics: metrics.clone(),
            stats: stats.clone(),
            lock: Mutex::new(()),
            loaded_at: AtomicU64::new(now_unix()),
            failed_hash: Mutex::new(None),
            on_swap: Mutex::new(Vec::new()),
        });
        metrics.pull_from(
            &stats,
            &[
                (
                    "idemgate_config_last_reload_successful",
                    "1 when the last config reload succeeded, 0 when it failed",
                    Pull::Gauge,
                    |s| s.last_successful.load(Ordering::Relaxed) as f64,
                ),
                (
                    "idemgate_config_last_reload_success_timestamp_seconds",
                    "Unix time of the last successful config load",
                    Pull::Gauge,
                    |s| s.last_success_unix.load(Ordering::Relaxed) as f64,
                ),
                (
                    "idemgate_config_reloads_total",
                    "Config reloads applied",
                    Pull::Counter,
                    |s| s.reloads.load(Ordering::Relaxed) as f64,
                ),
                (
                    "idemgate_config_reload_failures_total",
                    "Config reloads refused (invalid edits)",
                    Pull::Counter,
                    |s| s.failures.load(Ordering::Relaxed) as f64,
                ),
            ],
        );
        reloader
    }

    /// Registers `hook` to be called with every config swapped in from now on.
    pub fn on_swap(&self, hook: impl Fn(&Config) + Send + Sync + 'static) {
        self.on_swap.lock().push(Box::new(hook));
    }

    /// Reload statistics.
    pub fn stats(&self) -> Arc<ReloadStats> {
        self.stats.clone()
    }

    /// Unix seconds at which the running config was loaded.
    pub fn loaded_at(&self) -> u64 {
        self.loaded_at.load(Ordering::Relaxed)
    }

    /// The watched file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Loads the file now; swaps it in when it is valid and differs from the running config.
    /// On error the running config stays, and the error says why (naming the field).
    pub fn reload(&self, trigger: &str) -> Result<ReloadOutcome, String> {
        let _serial = self.lock.lock();
        let text_hash = std::fs::read(&self.path)
            .ok()
            .map(|t| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&t)));
        let result = Config::load(&self.path)
            .map_err(|e| e.to_string())
            .and_then(|config| {
                let running = self.current.load();
                if config.source_hash == running.config.source_hash {
                    return Ok(None);
                }
                warn_restart_only(&running.config, &config);
                Generation::new(config, &self.metrics).map(Some)
            });
        match result {
            Ok(None) => {
                self.stats.last_successful.store(1, Ordering::Relaxed);
                *self.failed_hash.lock() = None;
                Ok(ReloadOutcome::Unchanged)
            }
            Ok(Some(generation)) => {
                let hash = generation.config.source_hash.clone();
                let generation = Arc::new(generation);
                self.current.store(generation.clone());
                for hook in self.on_swap.lock().iter() {
                    hook(&generation.config);
                }
                self.stats.last_successful.store(1, Ordering::Relaxed);
                self.stats
                    .last_success_unix
                    .store(now_unix(), Ordering::Relaxed);
                self.stats.reloads.fetch_add(1, Ordering::Relaxed);
                self.loaded_at.store(now_unix(), Ordering::Relaxed);
                *self.failed_hash.lock() = None;
                tracing::info!(trigger, hash = %&hash[..12.min(hash.len())], "config reloaded");
                Ok(ReloadOutcome::Applied { hash })
            }
            Err(e) => {
                // A watcher event for content already refused is not a new error.
                let mut failed = self.failed_hash.lock();
                let repeat =
                    trigger == "file change" && text_hash.is_some() && *failed == text_hash;
                *failed = text_hash;
                drop(failed);
                if repeat {
                    return Err(e);
                }
                self.stats.last_successful.store(0, Ordering::Relaxed);
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(trigger, path = %self.path.display(), error = %e, "config reload refused; the running config stays");
                Err(e)
            }
        }
    }

    /// Watches the config directory and polls its content until `shutdown` fires.
    pub async fn watch(
        self: Arc<Self>,
        poll_every: Duration,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let _watcher = match self.start_watcher(tx) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the config directory; polling only");
                None
            }
        };
        let mut poll = tokio::time::interval(poll_every);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some(()) = rx.recv() => {
                    // Debounce: editors and ConfigMap updates come as bursts of events.
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    while rx.try_recv().is_ok() {}
                    let this = self.clone();
                    let _ = tokio::task::spawn_blocking(move || this.reload("file change")).await;
                }
                _ = poll.tick() => {
                    let this = self.clone();
                    let _ = tokio::task::spawn_blocking(move || this.reload_if_changed()).await;
                }
                _ = shutdown.changed() => return,
            }
        }
    }

    /// The poll fallback: reload only when the bytes differ from the running config's.
    fn reload_if_changed(&self) {
        let Ok(text) = std::fs::read(&self.path) else {
            return;
        };
        // Same formula as `Config::source_hash`: hex SHA-256 of the file's bytes.
        let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&text));
        let known_bad = self.failed_hash.lock().as_deref() == Some(hash.as_str());
        if hash != self.current.load().config.source_hash && !known_bad {
            let _ = self.reload("poll");
        }
    }

    fn start_watcher(
        &self,
        tx: mpsc::UnboundedSender<()>,
    ) -> notify::Result<notify::RecommendedWatcher> {
        let file_name = self.path.file_name().map(|n| n.to_os_string());
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let Ok(event) = event else { return };
                // Reading the file fires access events; reloading on them would loop forever.
                if matches!(event.kind, EventKind::Access(_) | EventKind::Other) {
                    return;
                }
                let relevant = event.paths.iter().any(|p| {
                    let name = p.file_name();
                    name == file_name.as_deref()
                        || name.is_some_and(|n| n.to_string_lossy().starts_with(".."))
                });
                if relevant {
                    let _ = tx.send(());
                }
            })?;
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // Non-recursive on the directory: sees renames onto the file and `..data` swaps, and keeps
        // working across them because the directory itself never changes.
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        Ok(watcher)
    }
}

/// Logs settings that changed but only take effect after a restart.
fn warn_restart_only(old: &Config, new: &Config) {
    let changed = restart_only_changes(old, new);
    if !changed.is_empty() {
        tracing::warn!(settings = ?changed, "these settings changed but only take effect after a restart");
    }
}

/// The settings that differ between `old` and `new` and are read only at start-up.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    if old.listen != new.listen {
        changed.push("listen");
    }
    if old.admin.listen != new.admin.listen {
        changed.push("admin.listen");
    }
    if old.threads != new.threads {
        changed.push("threads");
    }
    if old.shutdown != new.shutdown {
        changed.push("shutdown");
    }
    // Script versions and the canary are applied live (see `script_reload`).
    let without_scripts = |config: &Config| {
        let mut store = config.store.clone();
        if let Some(redis) = &mut store.redis {
            redis.scripts = ScriptsConfig::default();
        }
        store
    };
    if without_scripts(old) != without_scripts(new) {
        changed.push("store");
    }
    if old.idempotency.worker_id != new.idempotency.worker_id {
        changed.push("idempotency.worker_id");
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
listen: "127.0.0.1:6180"
threads: 2
admin: {listen: "127.0.0.1:6181"}
shutdown: {grace_period: 20s}
upstreams: {app: {addrs: ["127.0.0.1:8080"]}}
idempotency: {worker_id: 1}
store:
  backend: redis
  redis: {url: "redis://127.0.0.1:6379", scripts: {version: v1}}
routes:
  - {name: orders, path_prefix: /orders, upstream: app, idempotency: {ttl: 1h}}
"#;

    fn changes(edit: (&str, &str)) -> Vec<&'static str> {
        let edited = BASE.replace(edit.0, edit.1);
        assert_ne!(edited, BASE, "{edit:?} changed nothing");
        let old = Config::from_yaml_str(BASE).expect("base config");
        let new = Config::from_yaml_str(&edited).expect("edited config");
        restart_only_changes(&old, &new)
    }

    #[test]
    fn settings_read_at_start_up_are_named() {
        let cases: [((&str, &str), &[&str]); 8] = [
            (("127.0.0.1:6180", "127.0.0.1:7180"), &["listen"]),
            (("127.0.0.1:6181", "127.0.0.1:7181"), &["admin.listen"]),
            (("threads: 2", "threads: 3"), &["threads"]),
            (("grace_period: 20s", "grace_period: 5s"), &["shutdown"]),
            (("worker_id: 1", "worker_id: 2"), &["idempotency.worker_id"]),
            (("6379", "6380"), &["store"]),
            // Applied live: scripts (by the script reloader), routes and upstreams.
            (("version: v1", "version: v2"), &[]),
            (("ttl: 1h", "ttl: 2h"), &[]),
        ];
        for (edit, want) in cases {
            assert_eq!(changes(edit), want, "{edit:?}");
        }
        let both = BASE
            .replace("threads: 2", "threads: 3")
            .replace("version: v1", "version: v2");
        let old = Config::from_yaml_str(BASE).expect("base config");
        let new = Config::from_yaml_str(&both).expect("edited config");
        assert_eq!(restart_only_changes(&old, &new), ["threads"]);
    }
}
