//! Live config: watch the config file's directory, load with the same pure function as start-up,
//! and swap a validated [`Generation`] in; an invalid edit keeps the running config.
//!
//! The watcher only signals. It watches the *directory*, because a Kubernetes ConfigMap volume
//! swaps a `..data` symlink and inotify on the file itself sees nothing; it re-reads through the
//! visible path, debounces bursts, ignores access events (reading the file fires them) but a
//! writer's close, waits for that close before reading a file written in place, and a
//! content-hash poll on a timer catches whatever the watcher misses (e.g. `subPath`-free mounts
//! on filesystems without inotify), taking only a file untouched for [`CLOSE_WAIT`] (or, its time in the future, read the same that
//! long apart). In-flight requests keep the generation they started with.
//! An edit refused for something outside the file (a name that does not resolve yet, a script
//! version or TLS file not there yet) is tried again by the poll, so it goes live once that is
//! fixed; the same bytes failing the same way are logged and counted once.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use notify::{EventKind, RecursiveMode, Watcher};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::config::{read_bounded, Config, Route, ScriptsConfig};
use crate::metrics::{Metrics, Pull};
use crate::proxy::Generation;

/// How a reload attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new config is live.
    Applied {
        /// Hash of the new config text.
        hash: String,
        /// Settings that changed in the file but only take effect after a restart (their
        /// running values stay).
        restart_required: Vec<&'static str>,
    },
    /// The file changed only in settings read at start-up: nothing new is in force until a
    /// restart (the file is taken as read, so the change is not reported again).
    RestartRequired {
        /// Hash of the new config text.
        hash: String,
        /// The settings that changed.
        settings: Vec<&'static str>,
    },
    /// The file has not changed since the running config was loaded.
    Unchanged,
}

/// What a reload found in the file: the generation to swap in and what it changes.
struct Found {
    generation: Generation,
    restart_required: Vec<&'static str>,
    /// Whether anything in it takes effect (false: only restart-only settings changed).
    takes_effect: bool,
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
    /// How many settings read only at start-up differ between the file and what runs: a
    /// restart is pending while this is above 0. Every pod that restarts from then on (an
    /// eviction, a node drain) starts on the file's values, so replicas can drift apart.
    pub restart_pending: AtomicU64,
}

/// How soon the poll tries content that was refused again. A refusal can come from outside the
/// file (an upstream name that does not resolve yet, a script version directory or a TLS file
/// not there yet), so the same bytes may load later without anyone touching the file; trying
/// them at most this often keeps a file that is truly broken from being parsed (and its names
/// resolved) on every tick. With the 2 s poll that is every other tick.
const RETRY_REFUSED_EVERY: Duration = Duration::from_secs(3);

/// What the watcher saw happen to the config file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileEvent {
    /// The file was replaced, renamed, created or removed, or a `..data` swap happened.
    Changed,
    /// Bytes were written into the file in place: its writer may not be done.
    Written,
    /// A writer closed the file: what it wrote is all there.
    Closed,
}

/// How long the watcher waits, after the last write into a file written in place, for its
/// writer to close it before reading it all the same (a writer that keeps it open).
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// The longest the watcher waits on a file still being written into.
const WRITE_WAIT_MAX: Duration = Duration::from_secs(10);

/// The last file content that failed to load, and how.
struct Refused {
    /// Hex SHA-256 of the file's bytes.
    hash: String,
    /// Why it failed: the same bytes failing another way are reported again.
    error: String,
    /// When it was last tried.
    at: Instant,
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
    /// The last file content that failed to load: the poll tries it again now and then (see
    /// [`RETRY_REFUSED_EVERY`]) but reports it again only when it fails another way.
    refused: Mutex<Option<Refused>>,
    /// Bytes the poll found different from the running config's (their hash): the same bytes
    /// [`CLOSE_WAIT`] after it first saw them have settled, whatever the file's time says.
    polled: Mutex<Settle<String>>,
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
            refused: Mutex::new(None),
            polled: Mutex::new(Settle::new(CLOSE_WAIT)),
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
                (
                    "idemgate_config_restart_pending",
                    "Settings changed in the config file that take effect only after a restart \
                     (0: the process runs what the file says)",
                    Pull::Gauge,
                    |s| s.restart_pending.load(Ordering::Relaxed) as f64,
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
        let text_hash = read_bounded(&self.path)
            .ok()
            .map(|t| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&t)));
        // Found by the watcher, not asked for by someone (SIGHUP, the admin endpoint).
        let automatic = matches!(trigger, "file change" | "poll");
        let result = Config::load(&self.path)
            .map_err(|e| e.to_string())
            .and_then(|config| {
                let running = self.current.load();
                if config.source_hash == running.config.source_hash {
                    // Upstream host names are resolved when a generation is built: a forced
                    // reload of the same file looks them up again, and takes the result when
                    // it differs (a backend that moved to another address).
                    if automatic {
                        return Ok(None);
                    }
                    // Built from the running config, which is the file's with the running
                    // values of restart-only settings kept.
                    let generation = Generation::new(running.config.clone(), &self.metrics)?;
                    if generation.addresses() == running.addresses() {
                        return Ok(None);
                    }
                    tracing::info!(trigger, "config unchanged; upstream addresses resolved anew");
                    return Ok(Some(Found {
                        generation,
                        restart_required: Vec::new(),
                        takes_effect: true,
                    }));
                }
                // What is read only at start-up keeps its running value in the new generation,
                // so the running config (and `/admin/config`) says what is in force and the
                // next reload compares against that, warning again while the file differs.
                let mut config = config;
                let restart_only = keep_restart_only(&running.config, &mut config);
                // Likewise the store's settings, whose queue must still hold every route's
                // largest response (which must also fit one Redis argument).
                config.check_redis_record_limits().map_err(|e| e.to_string())?;
                // Only a file that changed nothing but restart-only settings takes no effect (an
                // edit of comments alone changes nothing at all, and goes live as before).
                let takes_effect = restart_only.is_empty() || {
                    let mut same = config.clone();
                    same.source_hash.clone_from(&running.config.source_hash);
                    same != running.config
                };
                // The listeners stay as they run: an upstream the file points at one of them (a
                // swap of ports, say) would loop requests back into the proxy. Checked on the
                // addresses as resolved for the generation, with no lookup of its own.
                let listeners = [
                    ("listen (running)", config.listen),
                    ("admin.listen (running)", config.admin.listen),
                ];
                let generation = Generation::new_within(config, &self.metrics, &listeners)?;
                // Only for a config that goes live: refused content is tried again by the poll,
                // and each try would repeat the warning.
                if !restart_only.is_empty() {
                    tracing::warn!(trigger, settings = ?restart_only, "these settings changed but only take effect after a restart; until then the running values stay");
                }
                // Against the running values, so a file edited back clears it.
                self.stats
                    .restart_pending
                    .store(restart_only.len() as u64, Ordering::Relaxed);
                warn_record_identity(&running.config, &generation.config);
                for warning in generation.config.warnings() {
                    tracing::warn!("{warning}");
                }
                Ok(Some(Found {
                    generation,
                    restart_required: restart_only,
                    takes_effect,
                }))
            });
        match result {
            Ok(None) => {
                self.stats.last_successful.store(1, Ordering::Relaxed);
                *self.refused.lock() = None;
                Ok(ReloadOutcome::Unchanged)
            }
            Ok(Some(found)) => {
                let hash = found.generation.config.source_hash.clone();
                let generation = Arc::new(found.generation);
                // Swapped in even when nothing takes effect: the file is then taken as read,
                // and the next look compares against it.
                self.current.store(generation.clone());
                for hook in self.on_swap.lock().iter() {
                    hook(&generation.config);
                }
                self.stats.last_successful.store(1, Ordering::Relaxed);
                *self.refused.lock() = None;
                if !found.takes_effect {
                    return Ok(ReloadOutcome::RestartRequired {
                        hash,
                        settings: found.restart_required,
                    });
                }
                self.stats
                    .last_success_unix
                    .store(now_unix(), Ordering::Relaxed);
                self.stats.reloads.fetch_add(1, Ordering::Relaxed);
                self.loaded_at.store(now_unix(), Ordering::Relaxed);
                tracing::info!(trigger, hash = %&hash[..12.min(hash.len())], "config reloaded");
                Ok(ReloadOutcome::Applied {
                    hash,
                    restart_required: found.restart_required,
                })
            }
            Err(e) => {
                // A watcher event or a poll retry of content already refused the same way is not
                // a new error: neither logged nor counted again. SIGHUP and the admin endpoint
                // are asked for by someone who wants the answer, so they always report it.
                let mut refused = self.refused.lock();
                let repeat = automatic
                    && refused.as_ref().is_some_and(|r| {
                        text_hash.as_deref() == Some(r.hash.as_str()) && r.error == e
                    });
                *refused = text_hash.map(|hash| Refused {
                    hash,
                    error: e.clone(),
                    at: Instant::now(),
                });
                drop(refused);
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
        let (tx, mut rx) = mpsc::unbounded_channel::<FileEvent>();
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
                Some(first) = rx.recv() => {
                    // Debounce: editors and ConfigMap updates come as bursts of events; wait
                    // for 150 ms without one. A file written in place is read only once its
                    // writer has closed it (or after CLOSE_WAIT): read in between, a file cut
                    // off mid-write can be valid YAML that says less (a route without its
                    // idempotency block), and it would go live.
                    // CLOSE_WAIT counts from the last write; a writer still writing is waited
                    // for up to WRITE_WAIT_MAX in all.
                    let started = tokio::time::Instant::now();
                    let mut until = started + CLOSE_WAIT;
                    let mut writing = first == FileEvent::Written;
                    loop {
                        tokio::time::sleep(Duration::from_millis(150)).await;
                        let mut more = false;
                        while let Ok(event) = rx.try_recv() {
                            more = true;
                            match event {
                                FileEvent::Written => {
                                    writing = true;
                                    until = (tokio::time::Instant::now() + CLOSE_WAIT)
                                        .min(started + WRITE_WAIT_MAX);
                                }
                                FileEvent::Closed => writing = false,
                                FileEvent::Changed => {}
                            }
                        }
                        if (!more && !writing) || tokio::time::Instant::now() >= until {
                            break;
                        }
                    }
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

    /// The poll fallback: reload when the bytes differ from the running config's. Bytes already
    /// refused are tried again once [`RETRY_REFUSED_EVERY`] has passed, since what refused them
    /// may have been outside the file (DNS, a script directory, TLS files) and be there now.
    fn reload_if_changed(&self) {
        let Ok(text) = read_bounded(&self.path) else {
            return;
        };
        // Same formula as `Config::source_hash`: hex SHA-256 of the file's bytes.
        let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&text));
        if hash == self.current.load().config.source_hash {
            self.polled.lock().forget();
            // A refused edit put back to the running bytes (the watcher missed it): the file
            // is fine again, and the failure gauge must not stay at 0 for good.
            if self.refused.lock().is_some() {
                let _ = self.reload("poll");
            }
            return;
        }
        let due = match &*self.refused.lock() {
            Some(refused) if refused.hash == hash => refused.at.elapsed() >= RETRY_REFUSED_EVERY,
            _ => true,
        };
        // A file written to within CLOSE_WAIT may be in the middle of being written in place:
        // the poll leaves it to the watcher (which waits for its writer to close it) or to a
        // later tick, and never catches half of it. Untouched for CLOSE_WAIT by its time, or
        // the same bytes CLOSE_WAIT after a poll first saw them: a time in the future (clock
        // skew on a network filesystem) says nothing, and the bytes decide.
        let steady = self.polled.lock().settled(hash.clone(), Instant::now());
        let settled = steady || untouched_for(&self.path, CLOSE_WAIT);
        if due && settled {
            // Whatever the outcome, later bytes are judged from a sighting of their own.
            self.polled.lock().forget();
            let _ = self.reload("poll");
        }
    }

    fn start_watcher(
        &self,
        tx: mpsc::UnboundedSender<FileEvent>,
    ) -> notify::Result<notify::RecommendedWatcher> {
        let file_name = self.path.file_name().map(|n| n.to_os_string());
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let Ok(event) = event else { return };
                if let Some(kind) = file_event(&event, file_name.as_deref()) {
                    let _ = tx.send(kind);
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

/// Whether the file at `path` was last written at least `gap` ago (a time in the future, as a
/// skewed network filesystem may give, says it was not).
pub(crate) fn untouched_for(path: &std::path::Path, gap: Duration) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .is_ok_and(|at| at.elapsed().is_ok_and(|age| age >= gap))
}

/// Tells a settled file (or set of files) from one still being written: two readings that
/// agree, the first at least `gap` before the second.
pub(crate) struct Settle<T> {
    gap: Duration,
    /// The last reading, and when it was first seen.
    last: Option<(T, Instant)>,
}

impl<T: PartialEq> Settle<T> {
    pub(crate) fn new(gap: Duration) -> Self {
        Settle { gap, last: None }
    }

    /// Takes a reading made at `now`: whether the one before it was the same and was first
    /// seen at least `gap` earlier.
    pub(crate) fn settled(&mut self, reading: T, now: Instant) -> bool {
        match &self.last {
            Some((last, since)) if *last == reading => now.duration_since(*since) >= self.gap,
            _ => {
                self.last = Some((reading, now));
                false
            }
        }
    }

    /// Forgets the last reading: the next is a first sighting.
    pub(crate) fn forget(&mut self) {
        self.last = None;
    }

    /// Makes the last reading's first sighting `by` earlier (tests).
    #[cfg(test)]
    fn rewind(&mut self, by: Duration) {
        if let Some((_, since)) = self.last.as_mut() {
            *since = since.checked_sub(by).expect("the clock is past `by`");
        }
    }
}

/// What a watcher event on the config's directory says of the config file `file_name`: `None`
/// for an event about another file, or one that reports a read. Reading the file (as every
/// reload does) fires access events, and reloading on them would loop forever.
fn file_event(event: &notify::Event, file_name: Option<&std::ffi::OsStr>) -> Option<FileEvent> {
    use notify::event::{AccessKind, AccessMode, ModifyKind};
    let names = || event.paths.iter().map(|p| p.file_name());
    let the_file = names().any(|n| n == file_name);
    let relevant =
        the_file || names().any(|n| n.is_some_and(|n| n.to_string_lossy().starts_with("..")));
    let kind = match event.kind {
        // A writer done with the file.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) if the_file => FileEvent::Closed,
        EventKind::Access(_) | EventKind::Other => return None,
        EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) if the_file => FileEvent::Written,
        _ => FileEvent::Changed,
    };
    relevant.then_some(kind)
}

/// Names the settings read only at start-up that `new` changes, and gives them back their
/// values in `running` (the store's live parts, script versions and the outage policy, stay
/// as `new` has them).
fn keep_restart_only(running: &Config, new: &mut Config) -> Vec<&'static str> {
    let changed = restart_only_changes(running, new);
    if changed.is_empty() {
        return changed;
    }
    new.listen = running.listen;
    new.admin.listen = running.admin.listen;
    new.threads = running.threads;
    new.work_stealing = running.work_stealing;
    new.shutdown = running.shutdown.clone();
    new.idempotency.worker_id = running.idempotency.worker_id;
    new.idempotency.worker_lease = running.idempotency.worker_lease;
    let scripts = new.store.redis.as_ref().map(|r| r.scripts.clone());
    let on_unavailable = new.store.on_unavailable;
    new.store = running.store.clone();
    if let (Some(redis), Some(scripts)) = (new.store.redis.as_mut(), scripts) {
        redis.scripts = scripts;
    }
    new.store.on_unavailable = on_unavailable;
    changed
}

/// Logs, when `new` changes what decides which record a request maps to, that requests
/// executed before the change are not found by their retries after it.
fn warn_record_identity(old: &Config, new: &Config) {
    let changed = record_identity_changes(old, new);
    if !changed.is_empty() {
        tracing::warn!(settings = ?changed, "these settings decide which record a request maps to: retries of requests executed before this change will not find their records (a changed key, tenant or scope executes them again, a changed fingerprint answers them 422, a request no idempotent route catches any more is forwarded unprotected)");
    }
}

/// The settings that differ between `old` and `new` and go into a request's record id or
/// fingerprint, route by route (routes matched by name).
fn record_identity_changes(old: &Config, new: &Config) -> Vec<String> {
    let mut changed = Vec::new();
    if old.idempotency.key_header != new.idempotency.key_header {
        changed.push("idempotency.key_header".to_string());
    }
    if old.idempotency.tenant_header != new.idempotency.tenant_header {
        changed.push("idempotency.tenant_header".to_string());
    }
    if old.idempotency.default_tenant != new.idempotency.default_tenant {
        changed.push("idempotency.default_tenant".to_string());
    }
    for route in &new.routes {
        let Some(now) = &route.idempotency else {
            continue;
        };
        let before = old
            .routes
            .iter()
            .find(|r| r.name == route.name)
            .and_then(|r| r.idempotency.as_ref());
        let Some(before) = before else {
            continue;
        };
        if before.scope_headers != now.scope_headers {
            changed.push(format!("routes[{}].idempotency.scope_headers", route.name));
        }
        if before.fingerprint_body != now.fingerprint_body
            || before.fingerprint_headers != now.fingerprint_headers
        {
            changed.push(format!("routes[{}].idempotency.fingerprint", route.name));
        }
    }
    // An idempotent route that no longer catches what it caught: its keyed requests now fall
    // to another route (or none) and are forwarded unprotected or under other settings.
    for before in old.routes.iter().filter(|r| r.idempotency.is_some()) {
        let now = new
            .routes
            .iter()
            .find(|r| r.name == before.name && r.idempotency.is_some());
        let Some(now) = now else {
            changed.push(format!(
                "routes[{}].idempotency (the route was removed, renamed or made plain)",
                before.name
            ));
            continue;
        };
        let narrowed = if before.methods.is_empty() {
            !now.methods.is_empty()
        } else {
            !now.methods.is_empty() && before.methods.iter().any(|m| !now.methods.contains(m))
        };
        if narrowed {
            changed.push(format!("routes[{}].methods", before.name));
        }
        if before.path_prefix != now.path_prefix {
            changed.push(format!("routes[{}].path_prefix", before.name));
        }
        // Routes ahead of it take the requests they match first: one added or moved ahead of
        // it (a plain carve-out such as `/orders/bulk`), or one ahead of it that changed what
        // it matches, takes some of its keyed requests, whose retries then run unprotected
        // or under other settings. Both configs are judged against what it caught before.
        let carved_before = carve_outs(old, before, before);
        let carved_now = carve_outs(new, now, before);
        if shapes(&carved_before) != shapes(&carved_now) {
            let names = |routes: &[&Route]| {
                let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
                names.join(", ")
            };
            changed.push(format!(
                "routes[{}] (routes ahead of it that take some of its requests changed: [{}], \
                 before [{}])",
                before.name,
                names(&carved_now),
                names(&carved_before)
            ));
        }
    }
    changed
}

/// Whether route `r`, ahead of `route`, takes some of the keyed requests `route` catches: a
/// path both match (one prefix under the other, or `r`'s the format-suffix spelling of
/// `route`'s) for a method both take other than GET, HEAD, OPTIONS and TRACE (which need no
/// key, as at config load).
fn takes_from(r: &Route, route: &Route) -> bool {
    let paths = crate::config::prefix_matches(&r.path_prefix, &route.path_prefix)
        || crate::config::prefix_matches(&route.path_prefix, &r.path_prefix)
        || crate::config::format_suffix_of(&route.path_prefix, &r.path_prefix);
    paths && !crate::config::hidden_unsafe_methods(&r.methods, &route.methods).is_empty()
}

/// The routes of `config` ahead of `ahead_of` that take some of the requests `caught` catches
/// (see [`takes_from`]).
fn carve_outs<'a>(config: &'a Config, ahead_of: &Route, caught: &Route) -> Vec<&'a Route> {
    config
        .routes
        .iter()
        .take_while(|r| r.name != ahead_of.name)
        .filter(|r| takes_from(r, caught))
        .collect()
}

/// What `routes` take, each by prefix, methods and whether it is idempotent: a set, whatever
/// the routes are named or in which order they come.
fn shapes<'a>(routes: &[&'a Route]) -> std::collections::BTreeSet<(&'a str, Vec<&'a str>, bool)> {
    routes
        .iter()
        .map(|r| {
            let mut methods: Vec<&str> = r.methods.iter().map(http::Method::as_str).collect();
            methods.sort_unstable();
            (r.path_prefix.as_str(), methods, r.idempotency.is_some())
        })
        .collect()
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
    if old.work_stealing != new.work_stealing {
        changed.push("work_stealing");
    }
    if old.shutdown != new.shutdown {
        changed.push("shutdown");
    }
    // Applied live: script versions and the canary (see `script_reload`), and the
    // on_unavailable policy, read per request (the in-process fallback store always exists).
    let read_at_start_up = |config: &Config| {
        let mut store = config.store.clone();
        if let Some(redis) = &mut store.redis {
            redis.scripts = ScriptsConfig::default();
        }
        store.on_unavailable = old.store.on_unavailable;
        store
    };
    if read_at_start_up(old) != read_at_start_up(new) {
        changed.push("store");
    }
    if old.idempotency.worker_id != new.idempotency.worker_id {
        changed.push("idempotency.worker_id");
    }
    if old.idempotency.worker_lease != new.idempotency.worker_lease {
        changed.push("idempotency.worker_lease");
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
listen: "127.0.0.1:6180"
threads: 2
work_stealing: false
admin: {listen: "127.0.0.1:6181"}
shutdown: {grace_period: 20s}
upstreams: {app: {addrs: ["127.0.0.1:8080"]}}
idempotency: {worker_id: 1}
store:
  backend: redis
  redis: {url: "redis://127.0.0.1:6379", scripts: {version: v1}}
  on_unavailable: reject
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
    fn a_reload_keeps_the_running_values_of_start_up_settings_and_applies_the_rest() {
        let old = Config::from_yaml_str(BASE).expect("base config");
        let edited = BASE
            .replace("threads: 2", "threads: 3")
            .replace("6379", "6380")
            .replace("version: v1", "version: v2")
            .replace("on_unavailable: reject", "on_unavailable: pass")
            .replace("ttl: 1h", "ttl: 2h");
        let mut new = Config::from_yaml_str(&edited).expect("edited config");
        let changed = keep_restart_only(&old, &mut new);
        assert_eq!(changed, ["threads", "store"]);
        // What runs stays what it was...
        assert_eq!(new.threads, 2);
        let redis = new.store.redis.as_ref().expect("redis");
        assert_eq!(redis.urls, ["redis://127.0.0.1:6379"]);
        // ...and what is live is the new file's.
        assert_eq!(redis.scripts.version, "v2");
        assert_eq!(new.store.on_unavailable, crate::config::OnUnavailable::Pass);
        let ttl = new.routes[0].idempotency.as_ref().map(|i| i.ttl);
        assert_eq!(ttl, Some(Duration::from_secs(7200)));
        // Compared with what runs, the same file changes the same start-up settings again.
        let again = Config::from_yaml_str(&edited).expect("edited config");
        assert_eq!(restart_only_changes(&new, &again), ["threads", "store"]);
        assert!(restart_only_changes(&new, &new.clone()).is_empty());
    }

    #[test]
    fn settings_that_decide_a_requests_record_are_named() {
        let old = Config::from_yaml_str(BASE).expect("base config");
        let identity = |edited: &str| {
            let new = Config::from_yaml_str(edited).expect("edited config");
            record_identity_changes(&old, &new)
        };
        assert!(identity(&BASE.replace("ttl: 1h", "ttl: 2h")).is_empty());
        assert_eq!(
            identity(&BASE.replace("{worker_id: 1}", "{worker_id: 1, key_header: X-Key}")),
            ["idempotency.key_header"]
        );
        assert_eq!(
            identity(&BASE.replace("{worker_id: 1}", "{worker_id: 1, default_tenant: t2}")),
            ["idempotency.default_tenant"]
        );
        assert_eq!(
            identity(&BASE.replace("{ttl: 1h}", "{ttl: 1h, scope_headers: [X-Org]}")),
            ["routes[orders].idempotency.scope_headers"]
        );
        assert_eq!(
            identity(&BASE.replace("{ttl: 1h}", "{ttl: 1h, fingerprint: {body: false}}")),
            ["routes[orders].idempotency.fingerprint"]
        );
        // A route new to the config has no records to lose; the one it replaces does.
        assert_eq!(
            identity(&BASE.replace("name: orders", "name: payments")),
            ["routes[orders].idempotency (the route was removed, renamed or made plain)"]
        );
        assert_eq!(
            identity(&BASE.replace(", idempotency: {ttl: 1h}", "")),
            ["routes[orders].idempotency (the route was removed, renamed or made plain)"]
        );
        assert_eq!(
            identity(&BASE.replace("path_prefix: /orders", "path_prefix: /orders/v2")),
            ["routes[orders].path_prefix"]
        );
        assert_eq!(
            identity(&BASE.replace("{name: orders,", "{name: orders, methods: [PUT],")),
            ["routes[orders].methods"]
        );
        // A route added ahead of it that takes some of its requests: a plain carve-out, or
        // moved there.
        let bulk = "  - {name: bulk, methods: [POST], path_prefix: /orders/bulk, upstream: app}\n";
        let carve_out = BASE.replace("routes:\n", &format!("routes:\n{bulk}"));
        assert_eq!(
            identity(&carve_out),
            ["routes[orders] (routes ahead of it that take some of its requests changed: [bulk], \
              before [])"]
        );
        let after = Config::from_yaml_str(&carve_out).expect("carve-out");
        let moved = Config::from_yaml_str(&format!("{BASE}{bulk}")).expect("bulk after orders");
        assert_eq!(
            record_identity_changes(&moved, &after),
            ["routes[orders] (routes ahead of it that take some of its requests changed: [bulk], \
              before [])"]
        );
        // One ahead of it that takes none of them (another prefix, or only GET of a POST
        // route), or one behind it, changes nothing.
        for elsewhere in [
            "  - {name: users, path_prefix: /users, upstream: app}\n",
            "  - {name: ordersx, path_prefix: /ordersx, upstream: app}\n",
        ] {
            assert!(
                identity(&BASE.replace("routes:\n", &format!("routes:\n{elsewhere}"))).is_empty()
            );
        }
        assert!(identity(&format!("{BASE}{bulk}")).is_empty());
        let post_only = BASE.replace("{name: orders,", "{name: orders, methods: [POST],");
        let reads = "  - {name: reads, methods: [GET], path_prefix: /orders, upstream: app}\n";
        let old_post = Config::from_yaml_str(&post_only).expect("POST only");
        let new_post =
            Config::from_yaml_str(&post_only.replace("routes:\n", &format!("routes:\n{reads}")))
                .expect("reads ahead");
        assert!(record_identity_changes(&old_post, &new_post).is_empty());
        // Nor one that takes only methods that need no key, of a route that takes them all.
        assert!(identity(&BASE.replace("routes:\n", &format!("routes:\n{reads}"))).is_empty());
        // Widening the route's methods under a GET route ahead of it loses nothing.
        let with_reads = post_only.replace("routes:\n", &format!("routes:\n{reads}"));
        let widened = with_reads.replace("{name: orders, methods: [POST],", "{name: orders,");
        assert!(record_identity_changes(
            &Config::from_yaml_str(&with_reads).unwrap(),
            &Config::from_yaml_str(&widened).unwrap()
        )
        .is_empty());
        // A carve-out renamed takes the same requests.
        let renamed = carve_out.replace("name: bulk", "name: bulk-orders");
        assert!(
            record_identity_changes(&after, &Config::from_yaml_str(&renamed).unwrap()).is_empty()
        );
        // A route ahead that takes the format-suffix spelling (`/orders.json`).
        let json = "  - {name: json, methods: [POST], path_prefix: /orders.json, upstream: app}\n";
        assert_eq!(
            identity(&BASE.replace("routes:\n", &format!("routes:\n{json}"))),
            ["routes[orders] (routes ahead of it that take some of its requests changed: [json], \
              before [])"]
        );

        let narrow = BASE.replace("{name: orders,", "{name: orders, methods: [POST],");
        let old = Config::from_yaml_str(&narrow).expect("POST only");
        let wider = Config::from_yaml_str(BASE).expect("every method");
        assert!(
            record_identity_changes(&old, &wider).is_empty(),
            "a route that takes more methods loses no records"
        );
    }

    #[test]
    fn settings_read_at_start_up_are_named() {
        let cases: [((&str, &str), &[&str]); 13] = [
            (("127.0.0.1:6180", "127.0.0.1:7180"), &["listen"]),
            (("127.0.0.1:6181", "127.0.0.1:7181"), &["admin.listen"]),
            (("threads: 2", "threads: 3"), &["threads"]),
            (
                ("work_stealing: false", "work_stealing: true"),
                &["work_stealing"],
            ),
            (("grace_period: 20s", "grace_period: 5s"), &["shutdown"]),
            (("worker_id: 1", "worker_id: 2"), &["idempotency.worker_id"]),
            (
                ("worker_id: 1", "worker_id: 1, worker_lease: 1m"),
                &["idempotency.worker_lease"],
            ),
            (("6379", "6380"), &["store"]),
            // Another store setting still needs a restart when on_unavailable changes with it.
            (
                (
                    "on_unavailable: reject",
                    "on_unavailable: pass\n  circuit_breaker: {failure_threshold: 5}",
                ),
                &["store"],
            ),
            // Applied live: scripts (by the script reloader), the on_unavailable policy, routes
            // and upstreams.
            (("version: v1", "version: v2"), &[]),
            (("on_unavailable: reject", "on_unavailable: pass"), &[]),
            (("on_unavailable: reject", "on_unavailable: local"), &[]),
            (("ttl: 1h", "ttl: 2h"), &[]),
        ];
        for (edit, want) in cases {
            assert_eq!(changes(edit), want, "{edit:?}");
        }
        let both = BASE
            .replace("threads: 2", "threads: 3")
            .replace("version: v1", "version: v2")
            .replace("on_unavailable: reject", "on_unavailable: local");
        let old = Config::from_yaml_str(BASE).expect("base config");
        let new = Config::from_yaml_str(&both).expect("edited config");
        assert_eq!(restart_only_changes(&old, &new), ["threads"]);
    }

    /// A config whose script version `version` must be found in `dir`.
    fn with_scripts(dir: &Path, version: &str) -> String {
        format!(
            "upstreams: {{app: {{addrs: [\"127.0.0.1:8080\"]}}}}\n\
             store:\n  backend: memory\n  redis: {{scripts: {{dir: \"{}\", version: {version}}}}}\n\
             routes:\n  - {{name: orders, path_prefix: /orders, upstream: app, idempotency: {{}}}}\n",
            dir.display()
        )
    }

    /// Writes `text` to `path` dated a while back, as a file the poll finds settled.
    fn write_settled(path: &Path, text: &str) {
        std::fs::write(path, text).expect("write config");
        let file = std::fs::File::options()
            .write(true)
            .open(path)
            .expect("open");
        let past = SystemTime::now() - CLOSE_WAIT * 2;
        file.set_modified(past).expect("set mtime");
    }

    /// Makes the poll's next look at refused content due, as if the backoff had passed.
    fn backoff_passed(reloader: &Reloader) {
        if let Some(refused) = reloader.refused.lock().as_mut() {
            refused.at = Instant::now()
                .checked_sub(RETRY_REFUSED_EVERY)
                .expect("the clock is past the backoff");
        }
    }

    #[test]
    fn reads_of_the_config_are_no_changes_and_writes_renames_and_swaps_are() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, ModifyKind, RemoveKind, RenameMode,
        };
        let written = EventKind::Modify(ModifyKind::Data(DataChange::Content));
        let cases = [
            // Reads.
            (
                EventKind::Access(AccessKind::Open(AccessMode::Any)),
                "idemgate.yaml",
                None,
            ),
            (EventKind::Access(AccessKind::Read), "idemgate.yaml", None),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Read)),
                "idemgate.yaml",
                None,
            ),
            (EventKind::Other, "idemgate.yaml", None),
            // A writer done, bytes written in place, the file replaced or removed.
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                "idemgate.yaml",
                Some(FileEvent::Closed),
            ),
            (written, "idemgate.yaml", Some(FileEvent::Written)),
            (
                EventKind::Create(CreateKind::File),
                "idemgate.yaml",
                Some(FileEvent::Changed),
            ),
            (
                EventKind::Remove(RemoveKind::File),
                "idemgate.yaml",
                Some(FileEvent::Changed),
            ),
            // A ConfigMap's `..data` swap, seen only on the hidden names.
            (
                EventKind::Modify(ModifyKind::Name(RenameMode::To)),
                "..data",
                Some(FileEvent::Changed),
            ),
            // Another file in the directory.
            (written, "other.yaml", None),
        ];
        for (kind, name, want) in cases {
            let event =
                notify::Event::new(kind).add_path(PathBuf::from("/etc/idemgate").join(name));
            let got = file_event(&event, Some(std::ffi::OsStr::new("idemgate.yaml")));
            assert_eq!(got, want, "{kind:?} on {name}");
        }
    }

    #[test]
    fn the_poll_leaves_a_file_written_just_now_for_later() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("idemgate.yaml");
        let text = |ttl: &str| {
            format!(
                "upstreams: {{app: {{addrs: [\"127.0.0.1:8080\"]}}}}\n\
                 routes:\n  - {{name: orders, path_prefix: /orders, upstream: app, idempotency: {{ttl: {ttl}}}}}\n"
            )
        };
        std::fs::write(&path, text("1h")).expect("write config");
        let metrics = Arc::new(Metrics::new());
        let config = Config::load(&path).expect("initial config");
        let generation = Generation::new(config, &metrics).expect("generation");
        let current = Arc::new(ArcSwap::from_pointee(generation));
        let reloader = Reloader::new(path.clone(), current.clone(), metrics);
        let ttl = || {
            current.load().config.routes[0]
                .idempotency
                .as_ref()
                .map(|i| i.ttl)
        };
        // Written just now: its writer may not be done, so the poll does not read it yet.
        std::fs::write(&path, text("2h")).expect("edit");
        reloader.reload_if_changed();
        assert_eq!(ttl(), Some(Duration::from_secs(3600)));
        // Untouched for a while: the poll takes it.
        write_settled(&path, &text("2h"));
        reloader.reload_if_changed();
        assert_eq!(ttl(), Some(Duration::from_secs(7200)));

        // Dated in the future (a network filesystem's clock ahead): that says nothing of the
        // writer, so the poll waits until it has seen the same bytes for CLOSE_WAIT.
        std::fs::write(&path, text("3h")).expect("edit");
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|file| file.set_modified(SystemTime::now() + Duration::from_secs(3600)))
            .expect("set mtime");
        reloader.reload_if_changed();
        assert_eq!(
            ttl(),
            Some(Duration::from_secs(7200)),
            "taken at first sight"
        );
        reloader.polled.lock().rewind(CLOSE_WAIT);
        reloader.reload_if_changed();
        assert_eq!(ttl(), Some(Duration::from_secs(3 * 3600)), "steady bytes");
    }

    #[test]
    fn refused_content_is_tried_again_and_reported_only_when_it_fails_another_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let scripts = dir.path().join("lua");
        std::fs::create_dir(&scripts).expect("scripts dir");
        let path = dir.path().join("idemgate.yaml");
        std::fs::write(&path, with_scripts(&scripts, "v1")).expect("write config");
        let metrics = Arc::new(Metrics::new());
        let config = Config::load(&path).expect("initial config");
        let generation = Generation::new(config, &metrics).expect("generation");
        let current = Arc::new(ArcSwap::from_pointee(generation));
        let reloader = Reloader::new(path.clone(), current.clone(), metrics);
        let stats = reloader.stats();
        let failures = || stats.failures.load(Ordering::Relaxed);
        let tried_at = || reloader.refused.lock().as_ref().map(|r| r.at);

        // v9 is neither built in nor in the directory (yet): refused, counted once.
        write_settled(&path, &with_scripts(&scripts, "v9"));
        reloader.reload_if_changed();
        assert_eq!(failures(), 1);
        assert_eq!(stats.last_successful.load(Ordering::Relaxed), 0);
        let first = tried_at().expect("refusal remembered");
        // Within the backoff the poll leaves the same bytes alone.
        reloader.reload_if_changed();
        assert_eq!(tried_at(), Some(first), "tried again within the backoff");

        // Past it they are tried again; failing another way (a half-written version) is news.
        let v9 = scripts.join("v9");
        std::fs::create_dir(&v9).expect("v9 dir");
        std::fs::write(v9.join("claim.lua"), "return 1").expect("claim.lua");
        backoff_passed(&reloader);
        reloader.reload_if_changed();
        assert_ne!(tried_at(), Some(first), "not tried again after the backoff");
        assert_eq!(failures(), 2);
        // The same failure again, from the poll or the watcher, is neither counted nor logged...
        backoff_passed(&reloader);
        reloader.reload_if_changed();
        assert!(reloader.reload("file change").is_err());
        assert_eq!(failures(), 2);
        // ...but asked for by hand it is reported.
        assert!(reloader.reload("admin").is_err());
        assert_eq!(failures(), 3);

        // The missing files appear; the untouched edit goes live on the next due poll.
        for name in crate::scripts::SCRIPT_NAMES {
            std::fs::write(v9.join(format!("{name}.lua")), "return 1").expect("script");
        }
        backoff_passed(&reloader);
        reloader.reload_if_changed();
        let live = current.load();
        let scripts_version = live
            .config
            .store
            .redis
            .as_ref()
            .map(|r| r.scripts.version.as_str());
        assert_eq!(scripts_version, Some("v9"));
        assert_eq!(stats.reloads.load(Ordering::Relaxed), 1);
        assert_eq!(stats.last_successful.load(Ordering::Relaxed), 1);
        assert_eq!(failures(), 3);
        assert!(tried_at().is_none(), "a success forgets the refusal");
    }

    /// What a reload keeps of the running config (listeners, the store) is checked against
    /// what it takes from the file: the file's own checks compared it with the file's values.
    #[test]
    fn an_edit_is_checked_against_the_settings_a_reload_keeps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("idemgate.yaml");
        let config = |listen: u16, app: u16, queue: &str, response: &str| {
            format!(
                "listen: \"127.0.0.1:{listen}\"\nupstreams: {{app: {{addrs: [\"127.0.0.1:{app}\"]}}}}\n\
                 store: {{backend: redis, completion_retry: {{queue_bytes: {queue}}}}}\n\
                 routes:\n  - {{name: orders, path_prefix: /, upstream: app, \
                 idempotency: {{max_response_bytes: {response}}}}}\n"
            )
        };
        write_settled(&path, &config(16180, 18080, "256MiB", "1MiB"));
        let metrics = Arc::new(Metrics::new());
        let running = Config::load(&path).expect("initial config");
        let generation = Generation::new(running, &metrics).expect("generation");
        let current = Arc::new(ArcSwap::from_pointee(generation));
        let reloader = Reloader::new(path.clone(), current.clone(), metrics);
        let upstream = || current.load().config.upstreams[0].addrs[0].clone();

        // Ports swapped: valid as a file, but `listen` stays 16180 until a restart, and the
        // upstream would be the proxy itself.
        write_settled(&path, &config(18080, 16180, "256MiB", "1MiB"));
        let refused = reloader.reload("admin").expect_err("loops back");
        assert!(
            refused.contains("upstreams.app.addrs") && refused.contains("listen (running)"),
            "{refused}"
        );
        assert_eq!(upstream(), "127.0.0.1:18080");

        // A larger queue (a restart) and responses that only it could hold: the running queue
        // stays, so the responses may not grow past it yet.
        write_settled(&path, &config(16180, 18080, "1GiB", "512MiB"));
        let refused = reloader
            .reload("admin")
            .expect_err("the running queue is too small");
        assert!(
            refused.contains("routes[0].idempotency.max_response_bytes"),
            "{refused}"
        );
        let live = current.load();
        let idem = live.config.routes[0].idempotency.as_ref().expect("keyed");
        assert_eq!(idem.max_response_bytes, 1 << 20);

        // Within the running queue it goes live (the queue's change waits for a restart).
        write_settled(&path, &config(16180, 18080, "1GiB", "128MiB"));
        reloader
            .reload("admin")
            .expect("valid against the running queue");
        let live = current.load();
        let idem = live.config.routes[0].idempotency.as_ref().expect("keyed");
        assert_eq!(idem.max_response_bytes, 128 << 20);
        assert_eq!(live.config.store.completion_retry.queue_bytes, 256 << 20);
    }

    #[test]
    fn a_refused_edit_put_back_to_the_running_bytes_clears_the_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("idemgate.yaml");
        let good = "upstreams: {app: {addrs: [\"127.0.0.1:8080\"]}}\nroutes: []\n";
        write_settled(&path, good);
        let metrics = Arc::new(Metrics::new());
        let config = Config::load(&path).expect("initial config");
        let generation = Generation::new(config, &metrics).expect("generation");
        let current = Arc::new(ArcSwap::from_pointee(generation));
        let reloader = Reloader::new(path.clone(), current, metrics);
        let stats = reloader.stats();
        write_settled(
            &path,
            "upstreams: {app: {addrs: [\"127.0.0.1:8080\"]}}\nroutes: 7\n",
        );
        reloader.reload_if_changed();
        assert_eq!(stats.last_successful.load(Ordering::Relaxed), 0);
        // Put back as it was, and only the poll sees it.
        write_settled(&path, good);
        reloader.reload_if_changed();
        assert_eq!(stats.last_successful.load(Ordering::Relaxed), 1);
        assert!(reloader.refused.lock().is_none());
    }
}
