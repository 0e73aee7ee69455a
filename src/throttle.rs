//! Log lines that would otherwise come once per request while something is down.
//!
//! A store outage makes every keyed request fail its claim, a backend outage every request its
//! connect: one warning each, tens of thousands a second, when the process can least afford
//! them (they share the log writer's buffer with the access lines, which are dropped first once
//! it is full). Such a line goes through [`Throttle`]: the first at once, then at most one a
//! second per call site, each with `suppressed` = how many were left out since the one before.
//! Counters carry the totals (`idemgate_store_errors_total`, the per-result request counters).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Shortest time between two lines of one call site.
const INTERVAL_MS: u64 = 1000;

/// The throttle of one call site (a `static`, see [`warn_throttled!`](crate::warn_throttled)).
pub struct Throttle {
    /// Milliseconds after [`base`] before which no line is written (0: the first is).
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl Throttle {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Throttle {
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines left out since the last one)` when a line may be written now.
    pub fn admit(&self) -> Option<u64> {
        let base = *base();
        let now = u64::try_from(base.elapsed().as_millis()).unwrap_or(u64::MAX - INTERVAL_MS);
        self.admit_at(now + 1)
    }

    fn admit_at(&self, now_ms: u64) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Relaxed);
        let won = now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms + INTERVAL_MS,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if !won {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

fn base() -> &'static Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now)
}

/// `tracing::event!` at `$level`, written at most once a second from this call site, with a
/// `suppressed` field counting the lines left out since the last one (see the module docs).
#[macro_export]
macro_rules! event_throttled {
    ($level:expr, $($arg:tt)+) => {{
        static THROTTLE: $crate::throttle::Throttle = $crate::throttle::Throttle::new();
        if let Some(suppressed) = THROTTLE.admit() {
            tracing::event!($level, suppressed, $($arg)+);
        }
    }};
}

/// [`event_throttled!`] at `warn`.
#[macro_export]
macro_rules! warn_throttled {
    ($($arg:tt)+) => {
        $crate::event_throttled!(tracing::Level::WARN, $($arg)+)
    };
}

/// [`event_throttled!`] at `error`.
#[macro_export]
macro_rules! error_throttled {
    ($($arg:tt)+) => {
        $crate::event_throttled!(tracing::Level::ERROR, $($arg)+)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_goes_out_then_one_a_second_counting_the_rest() {
        let t = Throttle::new();
        assert_eq!(t.admit_at(1), Some(0));
        for ms in [2, 500, 1000] {
            assert_eq!(t.admit_at(ms), None, "at {ms} ms");
        }
        assert_eq!(t.admit_at(1001), Some(3));
        assert_eq!(t.admit_at(1500), None);
        // A quiet spell: the next line goes out at once, naming the one left out.
        assert_eq!(t.admit_at(60_000), Some(1));
        assert_eq!(t.admit_at(60_001), None);
    }

    #[test]
    fn call_sites_are_throttled_apart() {
        let (a, b) = (Throttle::new(), Throttle::new());
        assert_eq!(a.admit_at(5), Some(0));
        assert_eq!(b.admit_at(6), Some(0));
        assert_eq!(a.admit(), None);
    }
}
