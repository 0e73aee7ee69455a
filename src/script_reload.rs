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
//!
//! An edit of the files goes live only once two readings of them in a row agree, at least
//! [`SETTLE_GAP`] apart, and it is that reading which is applied: a copy of four files, or one
//! file written in place, caught halfway would otherwise put half a version in force (a new
//! `claim.lua` beside an old `complete.lua`, or a truncated file that still compiles) until the
//! next look. The second reading is the next trigger (another file event, or the poll) that
//! comes late enough. Two readings moments apart (a poll that fell due during an event's
//! debounce) would agree in the middle of any copy slower than that.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use crate::config::ScriptsConfig;
use crate::reload::Settle;
use crate::scripts::Sources;
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
        let mut files = Settle::new(SETTLE_GAP);
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
            // One copy of the settings for the reading and the apply (and no lock held while
            // the files are read: a config reload waits on it).
            let settings = self.settings.lock().clone();
            let reading = read_versions(&settings);
            let settled = files.settled(reading.clone(), std::time::Instant::now());
            // A config that names other versions is applied at once when their files are at
            // rest (built in, or none written for SETTLE_GAP): a version the config named
            // before its files were there (the config reload retried until they were) may be
            // caught while they are being copied. Anything else waits for a second, identical
            // reading, as file edits do.
            let at_once = trigger == "config reload" && at_rest(&reading, SETTLE_GAP);
            if !at_once && !settled {
                continue;
            }
            let found = match &reading[..] {
                [Some(active)] => Ok((active.clone(), None)),
                [Some(active), Some(canary)] => Ok((active.clone(), Some(canary.clone()))),
                // A version that cannot be read: the store reads it again to say why.
                _ => crate::store::redis::find_sources(&settings),
            };
            match self.store.apply_sources(&settings, found).await {
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

/// The script texts `settings` names (the active version's and the canary's) as the store
/// reads them ([`Sources::find`]); `None` for a version that cannot be read as it is.
type Reading = Vec<Option<Sources>>;

/// Least time between the two agreeing readings that put an edit of the script files in force:
/// a copy whose files come less than this apart is never caught halfway.
pub const SETTLE_GAP: Duration = Duration::from_secs(2);

/// Whether every version of `reading` was read whole and is built in, or its directory's
/// script files have not been written for `gap` (an unreadable version is not at rest).
fn at_rest(reading: &Reading, gap: Duration) -> bool {
    let quiet = |dir: &Path| {
        crate::scripts::SCRIPT_NAMES
            .iter()
            .all(|name| crate::reload::untouched_for(&dir.join(format!("{name}.lua")), gap))
    };
    reading.iter().all(|sources| match sources {
        Some(s) => match &s.origin {
            crate::scripts::Origin::Builtin => true,
            crate::scripts::Origin::Dir(dir) => quiet(dir),
        },
        None => false,
    })
}

fn read_versions(settings: &ScriptsConfig) -> Reading {
    let dir = settings.dir.as_deref();
    std::iter::once(&settings.version)
        .chain(settings.canary.as_ref().map(|c| &c.version))
        .map(|version| Sources::find(dir, version).ok())
        .collect()
}

/// Whether a watcher event may be a change to the scripts: anything but a read. Reading the
/// scripts (as every check does) fires access events; reacting to them would loop forever.
fn signals_a_change(kind: &EventKind) -> bool {
    !matches!(kind, EventKind::Access(_) | EventKind::Other)
}

/// A recursive watch on `dir` that signals every change but reads (access events).
fn start_watcher(
    dir: &Path,
    tx: mpsc::UnboundedSender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|event| signals_a_change(&event.kind)) {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(dir, RecursiveMode::Recursive)?;
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CanaryConfig;
    use crate::scripts::SCRIPT_NAMES;

    #[test]
    fn reads_of_the_scripts_signal_nothing_and_writes_do() {
        use notify::event::{AccessKind, AccessMode, CreateKind, DataChange, ModifyKind};
        for read in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Other,
        ] {
            assert!(!signals_a_change(&read), "{read:?}");
        }
        for change in [
            EventKind::Modify(ModifyKind::Data(DataChange::Content)),
            EventKind::Create(CreateKind::File),
        ] {
            assert!(signals_a_change(&change), "{change:?}");
        }
    }

    #[test]
    fn an_edit_counts_once_two_readings_agree_far_enough_apart() {
        let mut files = Settle::new(SETTLE_GAP);
        let old = vec![Sources::builtin("v1")];
        let mut half = old.clone();
        if let Some(s) = half[0].as_mut() {
            s.texts[0].truncate(10);
        }
        let new = vec![Sources::builtin("v2")];
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert!(
            !files.settled(old.clone(), at(0)),
            "nothing to compare the first reading with"
        );
        assert!(files.settled(old.clone(), at(2000)));
        assert!(files.settled(old, at(4000)), "steady: every look agrees");
        assert!(!files.settled(half.clone(), at(4100)), "caught halfway");
        // Seen again moments later (a poll during an event's debounce): still a copy under way.
        assert!(!files.settled(half.clone(), at(4200)));
        assert!(!files.settled(half, at(5900)));
        assert!(
            !files.settled(new.clone(), at(6000)),
            "changed since the last look"
        );
        assert!(
            !files.settled(new.clone(), at(7000)),
            "agrees, but too soon"
        );
        assert!(files.settled(new, at(8000)));
        assert!(!files.settled(vec![None], at(8100)), "a file gone");
    }

    /// A version the config names is applied at once only when its files are at rest: built in,
    /// or not written for the gap. One being copied (a file written moments ago) waits for two
    /// agreeing readings, as a file edit does: applied at once, a `complete.lua` caught
    /// half-copied was loaded and failed every completion until the next readings.
    #[test]
    fn a_version_the_config_names_is_applied_at_once_only_at_rest() {
        assert!(at_rest(&vec![Sources::builtin("v1")], SETTLE_GAP));
        assert!(!at_rest(&vec![Sources::builtin("v1"), None], SETTLE_GAP));
        let dir = tempfile::tempdir().unwrap();
        let version = dir.path().join("v3");
        std::fs::create_dir(&version).unwrap();
        for name in SCRIPT_NAMES {
            std::fs::write(version.join(format!("{name}.lua")), format!("-- {name}")).unwrap();
        }
        let settings = ScriptsConfig {
            dir: Some(dir.path().to_path_buf()),
            version: "v3".into(),
            canary: None,
        };
        let reading = read_versions(&settings);
        assert!(reading[0].is_some());
        assert!(!at_rest(&reading, SETTLE_GAP), "just written");
        let long_ago = std::time::SystemTime::now() - Duration::from_secs(60);
        for name in SCRIPT_NAMES {
            let file = std::fs::File::options()
                .write(true)
                .open(version.join(format!("{name}.lua")))
                .unwrap();
            file.set_modified(long_ago).unwrap();
        }
        assert!(at_rest(&reading, SETTLE_GAP), "written a minute ago");
        // One file written again now: not at rest.
        std::fs::write(version.join("complete.lua"), "-- complete, again").unwrap();
        assert!(!at_rest(&read_versions(&settings), SETTLE_GAP));
    }

    #[test]
    fn a_reading_covers_the_active_version_and_the_canary() {
        let dir = tempfile::tempdir().unwrap();
        for version in ["va", "vc"] {
            std::fs::create_dir(dir.path().join(version)).unwrap();
            for name in SCRIPT_NAMES {
                let text = format!("-- {version} {name}");
                std::fs::write(dir.path().join(version).join(format!("{name}.lua")), text).unwrap();
            }
        }
        let mut settings = ScriptsConfig {
            dir: Some(dir.path().to_path_buf()),
            version: "va".into(),
            canary: None,
        };
        let texts = |reading: &Reading, i: usize| reading[i].as_ref().map(|s| s.texts.clone());
        let active = read_versions(&settings);
        assert_eq!(active.len(), 1);
        assert_eq!(texts(&active, 0).unwrap()[0], "-- va claim");
        settings.canary = Some(CanaryConfig {
            version: "vc".into(),
            percent: 10,
            tenants: Vec::new(),
            max_error_rate: 0.05,
            min_calls: 20,
            window: Duration::from_secs(60),
        });
        let both = read_versions(&settings);
        assert_eq!(both.len(), 2);
        assert_eq!(texts(&both, 1).unwrap()[3], "-- vc get");
        std::fs::remove_file(dir.path().join("vc").join("get.lua")).unwrap();
        assert_eq!(texts(&read_versions(&settings), 1), None);
        // Without a directory: the built-in text, the same at every reading.
        let builtin = read_versions(&ScriptsConfig::default());
        assert!(builtin[0].is_some());
        assert_eq!(builtin, read_versions(&ScriptsConfig::default()));
    }
}
