//! The Lua script versions a [`RedisStore`](super::RedisStore) runs: the active version, an
//! optional canary taken by a share of the record ids, per-version counters, and the canary's
//! sliding error window that rolls it back automatically.
//!
//! A [`ScriptSet`] is immutable apart from its counters and the canary's rollback latch, and is
//! swapped whole, so one call never mixes versions. The canary is chosen per record id, from
//! the record hash, so every call for one key (claim, complete, release, reads) runs the same
//! version while the settings stay the same. Both versions read and write one record layout,
//! so a key that changes version (percent edited, canary rolled back) is still read correctly.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Script;
use serde::Serialize;

use super::RecordKey;
use crate::config::{CanaryConfig, ScriptsConfig};
use crate::scripts::{Sources, SCRIPT_NAMES};

/// Slots of the canary's error window; it slides a slot (a tenth of the window) at a time.
const WINDOW_SLOTS: usize = 10;

/// One version of the store's Lua scripts, ready to call (SHA1 computed).
pub struct Scripts {
    /// Version name, for logs and metrics (e.g. `v1`).
    pub version: String,
    /// `claim.lua`: claim or read, one atomic step.
    pub claim: Script,
    /// `complete.lua`: compare-and-set of the completion on the owner token.
    pub complete: Script,
    /// `release.lua`: compare-and-set of the release on the owner token.
    pub release: Script,
    /// `get.lua`: read with the lock's remaining time by the server clock; also the readiness
    /// probe's script path.
    pub get: Script,
}

/// Which of a version's four scripts a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScriptOp {
    Claim,
    Complete,
    Release,
    Get,
}

/// Calls and script errors of one version since the process started.
#[derive(Debug, Default)]
pub struct VersionStats {
    /// Calls sent with this version's scripts (readiness probes excluded).
    pub calls: AtomicU64,
    /// Calls the script itself failed (see `is_script_fault` in the Redis store).
    pub errors: AtomicU64,
}

/// Counters of every version that ran, by name; outlives the sets that share them.
pub(crate) type StatsRegistry = Mutex<BTreeMap<String, Arc<VersionStats>>>;

/// A version in a set: its text (to load it), its scripts (to call them) and its counters.
pub(crate) struct Version {
    pub sources: Sources,
    pub scripts: Scripts,
    pub stats: Arc<VersionStats>,
    /// Redis refused this text when it was loaded at start-up; a later set must not reuse
    /// it without loading it again.
    pub load_failed: AtomicBool,
}

/// The canary: its version, its settings, and whether it is still in force.
pub(crate) struct Canary {
    pub version: Arc<Version>,
    pub config: CanaryConfig,
    /// Read on every call; set once, by a rollback or a failed load.
    disabled: AtomicBool,
    /// Why it was disabled.
    reason: Mutex<Option<String>>,
    window: Mutex<ErrorWindow>,
}

/// The versions in force, and the settings they were made from.
pub(crate) struct ScriptSet {
    pub settings: ScriptsConfig,
    pub active: Arc<Version>,
    pub canary: Option<Arc<Canary>>,
}

/// Calls and errors over the last `window`, counted in [`WINDOW_SLOTS`] slots of a tenth of
/// it each: a fixed handful of counters however many calls it sees, exact to a tenth of the
/// window.
#[derive(Debug)]
pub(crate) struct ErrorWindow {
    origin: Instant,
    slot: Duration,
    slots: [Slot; WINDOW_SLOTS],
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    tick: u64,
    calls: u64,
    errors: u64,
}

/// `GET /admin/scripts`: what runs, what could run, and how it went.
#[derive(Debug, Clone, Serialize)]
pub struct ScriptsStatus {
    /// `store.redis.scripts.dir`, if set.
    pub dir: Option<String>,
    /// The active version as loaded (its SHAs are the ones EVALSHA uses).
    pub active: VersionStatus,
    /// The canary as loaded, if configured.
    pub canary: Option<CanaryStatus>,
    /// Every version that could be named (built in, or in `dir`), with the SHAs of its text
    /// as it is now (which differ from the loaded ones while an edit is refused), and the
    /// counters of every version that ran.
    pub versions: BTreeMap<String, AvailableVersion>,
    /// Times the canary was rolled back for its error rate.
    pub canary_rollbacks: u64,
    /// Script changes applied after start-up.
    pub reloads: u64,
    /// Script changes refused (unreadable, or Redis would not load them).
    pub reload_failures: u64,
    /// Why the last refused change was refused.
    pub last_reload_error: Option<String>,
}

/// A loaded version.
#[derive(Debug, Clone, Serialize)]
pub struct VersionStatus {
    /// Version name.
    pub version: String,
    /// `builtin` or the directory it was read from.
    pub source: String,
    /// SHA1 per script name.
    pub scripts: BTreeMap<&'static str, String>,
}

/// The canary as loaded, its settings and its window.
#[derive(Debug, Clone, Serialize)]
pub struct CanaryStatus {
    /// The loaded canary version.
    #[serde(flatten)]
    pub loaded: VersionStatus,
    /// Configured share of record ids.
    pub percent: u8,
    /// Share in force: 0 once rolled back.
    pub percent_in_force: u8,
    /// Tenants taking part; empty means all.
    pub tenants: Vec<String>,
    /// Rollback threshold.
    pub max_error_rate: f64,
    /// Calls needed in the window before the threshold applies.
    pub min_calls: u64,
    /// Window length in seconds.
    pub window_seconds: f64,
    /// Whether the canary was disabled (rolled back or failed to load).
    pub rolled_back: bool,
    /// Why.
    pub reason: Option<String>,
    /// Canary calls in the current window.
    pub window_calls: u64,
    /// Canary script errors in the current window.
    pub window_errors: u64,
}

/// A version that exists on disk or in the binary, and the counters of one that ran.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AvailableVersion {
    /// `builtin` or its directory; none when it is no longer found.
    pub source: Option<String>,
    /// SHA1 per script of its current text.
    pub scripts: Option<BTreeMap<&'static str, String>>,
    /// Why its text cannot be read, if so.
    pub error: Option<String>,
    /// Calls made with it since start.
    pub calls: u64,
    /// Script errors since start.
    pub errors: u64,
}

// === impl Scripts ===

impl Scripts {
    /// The built-in `v1` scripts.
    pub fn builtin() -> Self {
        Scripts::from(&Sources::builtin_v1())
    }

    /// Scripts from their source text.
    pub fn from_sources(
        version: &str,
        claim: &str,
        complete: &str,
        release: &str,
        get: &str,
    ) -> Self {
        Scripts {
            version: version.to_owned(),
            claim: Script::new(claim),
            complete: Script::new(complete),
            release: Script::new(release),
            get: Script::new(get),
        }
    }

    /// All four, in [`SCRIPT_NAMES`] order.
    pub fn all(&self) -> [&Script; 4] {
        [&self.claim, &self.complete, &self.release, &self.get]
    }

    /// The index of `op`'s script in [`Scripts::all`] and in a version's source texts.
    pub(crate) fn index(op: ScriptOp) -> usize {
        match op {
            ScriptOp::Claim => 0,
            ScriptOp::Complete => 1,
            ScriptOp::Release => 2,
            ScriptOp::Get => 3,
        }
    }

    pub(crate) fn script(&self, op: ScriptOp) -> &Script {
        match op {
            ScriptOp::Claim => &self.claim,
            ScriptOp::Complete => &self.complete,
            ScriptOp::Release => &self.release,
            ScriptOp::Get => &self.get,
        }
    }

    fn shas(&self) -> BTreeMap<&'static str, String> {
        SCRIPT_NAMES
            .iter()
            .zip(self.all())
            .map(|(name, script)| (*name, script.get_hash().to_owned()))
            .collect()
    }
}

impl From<&Sources> for Scripts {
    fn from(sources: &Sources) -> Self {
        let [claim, complete, release, get] = &sources.texts;
        Scripts::from_sources(&sources.version, claim, complete, release, get)
    }
}

impl std::fmt::Debug for Scripts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scripts")
            .field("version", &self.version)
            .field("claim", &self.claim.get_hash())
            .field("complete", &self.complete.get_hash())
            .field("release", &self.release.get_hash())
            .field("get", &self.get.get_hash())
            .finish()
    }
}

// === impl ScriptOp ===

impl ScriptOp {
    /// The operation name used in errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            ScriptOp::Claim => "claim",
            ScriptOp::Complete => "complete",
            ScriptOp::Release => "release",
            ScriptOp::Get => "get",
        }
    }
}

// === impl Version ===

impl Version {
    pub fn new(sources: Sources, stats: Arc<VersionStats>) -> Self {
        Version {
            scripts: Scripts::from(&sources),
            sources,
            stats,
            load_failed: AtomicBool::new(false),
        }
    }

    pub fn status(&self) -> VersionStatus {
        VersionStatus {
            version: self.sources.version.clone(),
            source: self.sources.origin.to_string(),
            scripts: self.scripts.shas(),
        }
    }
}

// === impl Canary ===

impl Canary {
    pub fn new(version: Arc<Version>, config: CanaryConfig, now: Instant) -> Self {
        let window = ErrorWindow::new(config.window, now);
        Canary {
            version,
            config,
            disabled: AtomicBool::new(false),
            reason: Mutex::new(None),
            window: Mutex::new(window),
        }
    }

    /// Whether the record goes to the canary: the canary is in force, the tenant takes part
    /// and the record hash falls in the percentage.
    pub fn takes(&self, key: &RecordKey) -> bool {
        !self.disabled.load(Ordering::Relaxed)
            && canary_selects(self.config.percent, &self.config.tenants, key)
    }

    /// Counts one canary call whose script ran (`error`: it failed by its own fault). Returns
    /// the window's calls and errors when this call crossed the threshold and disabled the
    /// canary; the caller reports the rollback.
    pub fn record(&self, now: Instant, error: bool) -> Option<(u64, u64)> {
        let (calls, errors) = self.window.lock().record(now, error);
        let over = calls >= self.config.min_calls
            && errors as f64 > self.config.max_error_rate * calls as f64;
        let reason = || {
            format!(
                "{errors} script errors in {calls} calls within {}s is more than max_error_rate {}",
                self.config.window.as_secs_f64(),
                self.config.max_error_rate
            )
        };
        (over && self.disable(reason())).then_some((calls, errors))
    }

    /// Sends every record to the active version from now on. True for the call that did it.
    pub fn disable(&self, reason: String) -> bool {
        let mut slot = self.reason.lock();
        if self.disabled.swap(true, Ordering::AcqRel) {
            return false;
        }
        *slot = Some(reason);
        true
    }

    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// The share of record ids the canary takes now.
    pub fn percent_in_force(&self) -> u8 {
        if self.is_disabled() {
            0
        } else {
            self.config.percent
        }
    }

    pub fn status(&self, now: Instant) -> CanaryStatus {
        let (window_calls, window_errors) = self.window.lock().totals(now);
        CanaryStatus {
            loaded: self.version.status(),
            percent: self.config.percent,
            percent_in_force: self.percent_in_force(),
            tenants: self.config.tenants.clone(),
            max_error_rate: self.config.max_error_rate,
            min_calls: self.config.min_calls,
            window_seconds: self.config.window.as_secs_f64(),
            rolled_back: self.is_disabled(),
            reason: self.reason.lock().clone(),
            window_calls,
            window_errors,
        }
    }
}

// === impl ScriptSet ===

impl ScriptSet {
    /// A set for `settings` made of these sources, reusing the versions (and the canary, with
    /// its window and rollback latch) of `current` where nothing changed. Counters come from
    /// `stats`, so a version keeps counting across sets.
    pub fn new(
        settings: &ScriptsConfig,
        active: Sources,
        canary: Option<Sources>,
        current: Option<&ScriptSet>,
        stats: &StatsRegistry,
    ) -> Self {
        let version = |sources: Sources| {
            current
                .and_then(|set| set.reusable(&sources))
                .unwrap_or_else(|| {
                    let stats = stats
                        .lock()
                        .entry(sources.version.clone())
                        .or_default()
                        .clone();
                    Arc::new(Version::new(sources, stats))
                })
        };
        let active = version(active);
        let canary = match (canary, &settings.canary) {
            (Some(sources), Some(config)) => {
                let version = version(sources);
                let kept = current
                    .and_then(|set| set.canary.as_ref())
                    .filter(|c| c.config == *config && Arc::ptr_eq(&c.version, &version));
                Some(match kept {
                    Some(canary) => canary.clone(),
                    None => Arc::new(Canary::new(version, config.clone(), Instant::now())),
                })
            }
            _ => None,
        };
        ScriptSet {
            settings: settings.clone(),
            active,
            canary,
        }
    }

    /// The canary, when it takes this record; else the record uses the active version.
    pub fn canary_for(&self, key: &RecordKey) -> Option<&Arc<Canary>> {
        self.canary.as_ref().filter(|canary| canary.takes(key))
    }

    /// Whether this set was made from these settings and exactly these texts.
    pub fn matches(
        &self,
        settings: &ScriptsConfig,
        active: &Sources,
        canary: Option<&Sources>,
    ) -> bool {
        self.settings == *settings
            && self.active.sources == *active
            && self.canary.as_ref().map(|c| &c.version.sources) == canary
    }

    /// The version already in this set with exactly these sources, if any.
    pub fn reusable(&self, sources: &Sources) -> Option<Arc<Version>> {
        std::iter::once(&self.active)
            .chain(self.canary.as_ref().map(|c| &c.version))
            .find(|v| v.sources == *sources)
            .cloned()
    }
}

// === impl ErrorWindow ===

impl ErrorWindow {
    pub fn new(window: Duration, now: Instant) -> Self {
        ErrorWindow {
            origin: now,
            slot: (window / WINDOW_SLOTS as u32).max(Duration::from_millis(1)),
            slots: [Slot::default(); WINDOW_SLOTS],
        }
    }

    fn tick(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(elapsed / self.slot.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Counts one call and returns the window's (calls, errors) including it.
    pub fn record(&mut self, now: Instant, error: bool) -> (u64, u64) {
        let tick = self.tick(now);
        let slot = &mut self.slots[(tick % WINDOW_SLOTS as u64) as usize];
        if slot.tick != tick {
            *slot = Slot {
                tick,
                ..Slot::default()
            };
        }
        slot.calls += 1;
        slot.errors += u64::from(error);
        self.totals(now)
    }

    /// (calls, errors) of the slots still inside the window.
    pub fn totals(&self, now: Instant) -> (u64, u64) {
        let tick = self.tick(now);
        self.slots
            .iter()
            .filter(|s| s.tick <= tick && tick - s.tick < WINDOW_SLOTS as u64)
            .fold((0, 0), |(c, e), s| (c + s.calls, e + s.errors))
    }
}

// === functions ===

/// Whether a record takes the canary: its tenant takes part (an empty list means every
/// tenant) and the first four bytes of its hash, as a number mod 100, fall below `percent`.
/// The hash is SHA-256, so the share is `percent` ± sampling noise (the mod bias of 2^32 is
/// below 1e-7), and the same record always gets the same answer.
pub(crate) fn canary_selects(percent: u8, tenants: &[String], key: &RecordKey) -> bool {
    if !tenants.is_empty() && tenants.binary_search(&key.tenant).is_err() {
        return false;
    }
    let [a, b, c, d, ..] = key.hash;
    u32::from_be_bytes([a, b, c, d]) % 100 < u32::from(percent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tenant: &str) -> RecordKey {
        RecordKey {
            tenant: tenant.into(),
            hash: rand::random(),
        }
    }

    fn canary(percent: u8, min_calls: u64, max_error_rate: f64, now: Instant) -> Canary {
        let sources = Sources::builtin("v2").unwrap();
        let version = Arc::new(Version::new(sources, Arc::default()));
        let config = CanaryConfig {
            version: "v2".into(),
            percent,
            tenants: vec![],
            max_error_rate,
            min_calls,
            window: Duration::from_secs(10),
        };
        Canary::new(version, config, now)
    }

    #[test]
    fn selection_is_deterministic_per_record() {
        for _ in 0..1000 {
            let key = key("acme");
            let first = canary_selects(37, &[], &key);
            for _ in 0..3 {
                assert_eq!(canary_selects(37, &[], &key.clone()), first);
            }
        }
    }

    #[test]
    fn selection_takes_about_percent_of_random_hashes() {
        for percent in [0u8, 1, 10, 50, 90, 100] {
            let taken = (0..10_000)
                .filter(|_| canary_selects(percent, &[], &key("t")))
                .count();
            let expected = usize::from(percent) * 100;
            // Binomial(10000, p): 4 standard deviations is at most 200.
            assert!(
                taken.abs_diff(expected) <= 200,
                "{percent}%: {taken} of 10000"
            );
            if percent == 0 || percent == 100 {
                assert_eq!(taken, expected, "{percent}% must be exact");
            }
        }
    }

    #[test]
    fn selection_respects_the_tenant_filter() {
        let tenants = vec!["acme".to_owned(), "blue".to_owned()];
        for _ in 0..500 {
            assert!(!canary_selects(100, &tenants, &key("other")));
            assert!(canary_selects(100, &tenants, &key("acme")));
            assert!(canary_selects(100, &tenants, &key("blue")));
            assert!(canary_selects(100, &[], &key("other")));
        }
        // Within a taking tenant, the percentage still applies.
        let taken = (0..10_000)
            .filter(|_| canary_selects(30, &tenants, &key("blue")))
            .count();
        assert!(taken.abs_diff(3000) <= 200, "{taken}");
    }

    #[test]
    fn window_counts_only_the_last_window() {
        let t0 = Instant::now();
        let mut window = ErrorWindow::new(Duration::from_secs(10), t0);
        assert_eq!(window.record(t0, true), (1, 1));
        assert_eq!(window.record(t0 + Duration::from_secs(5), false), (2, 1));
        // 10.5 s later the first slot has slid out; the 5 s one is still in.
        assert_eq!(
            window.record(t0 + Duration::from_millis(10_500), false),
            (2, 0)
        );
        assert_eq!(window.totals(t0 + Duration::from_secs(16)), (1, 0));
        assert_eq!(window.totals(t0 + Duration::from_secs(60)), (0, 0));
        // A slot reused after a lap starts from zero.
        assert_eq!(window.record(t0 + Duration::from_secs(100), true), (1, 1));
    }

    #[test]
    fn rollback_needs_min_calls_and_a_rate_above_the_threshold() {
        let t0 = Instant::now();
        let canary = canary(50, 10, 0.2, t0);
        // Errors below min_calls do not roll back, however many in proportion.
        for _ in 0..9 {
            assert_eq!(canary.record(t0, true), None);
        }
        assert!(!canary.is_disabled());
        // The tenth call, a success, still leaves 9/10 > 0.2: rolled back, reported once.
        assert_eq!(canary.record(t0, false), Some((10, 9)));
        assert!(canary.is_disabled());
        assert_eq!(canary.record(t0, true), None);
        assert_eq!(canary.percent_in_force(), 0);
        let status = canary.status(t0);
        assert!(status.rolled_back && status.reason.unwrap().contains("max_error_rate"));
        assert!(
            !canary.takes(&key("any")),
            "a rolled-back canary takes no record"
        );

        // Exactly at the threshold is not above it.
        let canary = canary_at(t0, 0.2);
        for i in 0..10 {
            assert_eq!(canary.record(t0, i < 2), None);
        }
        assert!(!canary.is_disabled());
        assert_eq!(canary.record(t0, true), Some((11, 3)));
    }

    fn canary_at(t0: Instant, rate: f64) -> Canary {
        canary(100, 10, rate, t0)
    }

    #[test]
    fn a_max_error_rate_of_one_never_rolls_back() {
        let t0 = Instant::now();
        let canary = canary(100, 1, 1.0, t0);
        for _ in 0..100 {
            assert_eq!(canary.record(t0, true), None);
        }
        assert_eq!(canary.percent_in_force(), 100);
    }
}
