//! Live Lua scripts: keeps the Redis store's script versions in line with the config and with
//! the files in `store.redis.scripts.dir`.
//!
//! Two triggers, one action. The config reloader hands over the script settings of every
//! config it swaps in ([`ScriptReloader::config_changed`]); a watcher on the script directory
//! (recursive: versions are subdirectories) signals edits. Either way the store's
//! [`RedisStore::apply_scripts`] re-reads the text and swaps in what changed, and does nothing
//! when nothing did, so a content poll on a timer is a cheap fallback for whatever the watcher
//! misses (as for the config file: ConfigMap `..data` swaps, filesystems without inotify).
//! Like the config watcher, the directory watcher only signals, ignores access events and
//! debounces bursts.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use crate::config::ScriptsConfig;
use crate::store::redis::{ScriptsApplied, ScriptsError};
use crate::store::RedisStore;

/// Applies script settings and script file edits to the Redis store.
pub struct ScriptReloader {
    store: Arc<RedisStore>,
    /// The settings of the running config.
    settings: Mutex<ScriptsConfig>,
    /// Woken when the config brings new settings.
    wake: Notify,
}

// === impl ScriptReloader ===

impl ScriptReloader {
    /// A reloader for `store`, starting from the settings the store was built with.
    pub fn new(store: Arc<RedisStore>) -> Arc<Self> {
        Arc::new(ScriptReloader {
            settings: Mutex::new(store.scripts_settings()),
            store,
            wake: Notify::new(),
        })
    }

    /// Takes the script settings of a config that was just swapped in; applied at once by
    /// [`ScriptReloader::watch`]. Cheap and non-blocking, so the config reloader may call it
    /// from any thread.
    pub fn config_changed(&self, settings: &ScriptsConfig) {
        let mut current = self.settings.lock();
        if *current != *settings {
            *current = settings.clone();
            self.wake.notify_one();
        }
    }

    /// Applies the current settings and script text now.
    pub async fn apply(&self) -> Result<ScriptsApplied, ScriptsError> {
        let settings = self.settings.lock().clone();
        self.store.apply_scripts(&settings).await
    }

    /// Watches the script directory, the config's settings and a poll timer until `shutdown`.
    pub async fn watch(
        self: Arc<Self>,
        poll_every: Duration,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let mut watched: Option<PathBuf> = None;
        let mut watcher: Option<notify::RecommendedWatcher> = None;
        let mut unavailable = false;
        let mut poll = tokio::time::interval(poll_every);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Point the watcher at the configured directory (a reload may have changed it).
            let dir = self.settings.lock().dir.clone();
            if dir != watched {
                watcher = dir.as_deref().and_then(|d| match start_watcher(d, tx.clone()) {
                    Ok(w) => Some(w),
                    Err(e) => {
                        tracing::warn!(dir = %d.display(), error = %e, "cannot watch the script directory; polling only");
                        None
                    }
                });
                watched = dir;
            }
            let trigger = tokio::select! {
                Some(()) = rx.recv() => {
                    // Debounce: editors and ConfigMap updates come as bursts of events.
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    while rx.try_recv().is_ok() {}
                    "file change"
                }
                _ = self.wake.notified() => "config reload",
                _ = poll.tick() => "poll",
                _ = shutdown.changed() => break,
            };
            match self.apply().await {
                Ok(ScriptsApplied::Applied { .. }) => {
                    tracing::info!(trigger, "script change applied");
                    unavailable = false;
                }
                Ok(_) => unavailable = false,
                Err(ScriptsError::Unavailable(e)) => {
                    // Tried again on every poll; say so once per outage.
                    if !unavailable {
                        tracing::warn!(trigger, error = %e, "script change waits for redis");
                    }
                    unavailable = true;
                }
                // The store logged and counted the refusal.
                Err(_) => unavailable = false,
            }
        }
        drop(watcher);
    }
}

/// A recursive watch on `dir` that signals every change but reads (access events).
fn start_watcher(
    dir: &Path,
    tx: mpsc::UnboundedSender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        // Reading the scripts fires access events; reacting to them would loop forever.
        if matches!(event.kind, EventKind::Access(_) | EventKind::Other) {
            return;
        }
        let _ = tx.send(());
    })?;
    watcher.watch(dir, RecursiveMode::Recursive)?;
    Ok(watcher)
}
