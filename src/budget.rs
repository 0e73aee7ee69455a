//! The memory the request bodies idemgate reads whole may hold at once
//! (`max_buffered_request_bytes`).
//!
//! A keyed request's body is read whole before its claim, up to its route's
//! `max_request_bytes`, and held until it is sent to the backend (or the request is answered
//! without it). Each body is bounded, but
//! their number is bounded only by the connections clients open: a few hundred slow uploads of
//! a megabyte would take a sidecar past its memory limit, and the kernel's OOM killer would take
//! every execution in flight with it (their outcomes unstored, their keys locked until
//! `lock_ttl`). The budget refuses the keyed body that would go past it instead (503 with
//! `Retry-After`, before any claim, so nothing ran), and gives its bytes back when the body is
//! dropped. Small bodies forwarded without a key are held within it too; one it has no room for
//! is streamed by pingora instead. Bytes are charged as they arrive, so a connection that
//! declares a large body and sends little takes little.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Bytes of request bodies held now, across every connection and worker thread.
#[derive(Debug, Default)]
pub struct BodyBudget {
    held: AtomicUsize,
    refused: AtomicU64,
}

impl BodyBudget {
    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Bodies refused for the budget so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts a body refused for the budget (a 503): a permit that could not grow may also
    /// have been met another way, so its caller says which.
    pub fn count_refusal(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// A permit holding nothing yet.
    pub fn permit(&self) -> BodyPermit<'_> {
        BodyPermit {
            budget: self,
            bytes: 0,
        }
    }

    /// Takes `more` bytes if the total stays within `limit`.
    fn take(&self, more: usize, limit: usize) -> bool {
        let mut held = self.held.load(Ordering::Relaxed);
        loop {
            let Some(total) = held.checked_add(more).filter(|&t| t <= limit) else {
                return false;
            };
            match self
                .held
                .compare_exchange_weak(held, total, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => held = now,
            }
        }
    }
}

/// One request's share of the budget, given back when dropped.
#[derive(Debug)]
pub struct BodyPermit<'a> {
    budget: &'a BodyBudget,
    bytes: usize,
}

impl BodyPermit<'_> {
    /// Makes the permit cover `total` bytes, if the budget's `limit` allows the growth. A
    /// permit that already covers `total` asks nothing of the budget. A refusal leaves the
    /// permit as it was.
    pub fn cover(&mut self, total: usize, limit: usize) -> bool {
        if total <= self.bytes {
            return true;
        }
        if !self.budget.take(total - self.bytes, limit) {
            return false;
        }
        self.bytes = total;
        true
    }

    /// Whether the permit could grow to `total` bytes now, without taking them: a look ahead
    /// (others may take the room meanwhile).
    pub fn has_room_for(&self, total: usize, limit: usize) -> bool {
        let more = total.saturating_sub(self.bytes);
        self.budget
            .held()
            .checked_add(more)
            .is_some_and(|t| t <= limit)
    }

    /// Bytes this permit holds.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for BodyPermit<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_share_the_limit_and_give_back_when_dropped() {
        let budget = BodyBudget::default();
        let mut a = budget.permit();
        let mut b = budget.permit();
        assert!(a.cover(600, 1000));
        assert!(!b.cover(500, 1000), "600 + 500 is past the limit");
        assert_eq!(b.bytes(), 0, "a refused permit holds nothing");
        assert!(b.cover(400, 1000));
        assert_eq!(budget.held(), 1000);
        assert!(!a.cover(601, 1000), "a permit grows within the limit only");
        assert_eq!(a.bytes(), 600);
        assert!(
            a.cover(600, 1000),
            "what a permit covers costs nothing more"
        );
        drop(a);
        assert_eq!(budget.held(), 400);
        assert!(b.cover(1000, 1000), "a's bytes were given back");
        assert!(b.has_room_for(1000, 1000), "b holds all but a's");
        assert!(!b.has_room_for(1001, 1000));
        drop(b);
        assert_eq!(budget.held(), 0);
        assert!(budget.permit().has_room_for(1000, 1000));
        assert_eq!(budget.refused(), 0, "refusals are counted by the caller");
        budget.count_refusal();
        assert_eq!(budget.refused(), 1);
    }

    #[test]
    fn a_lower_limit_refuses_growth_but_keeps_what_is_held() {
        // A reload may lower the limit below what requests hold now: they keep it, and no
        // permit grows until the total is under the new limit.
        let budget = BodyBudget::default();
        let mut a = budget.permit();
        assert!(a.cover(800, 1000));
        let mut b = budget.permit();
        assert!(!b.cover(1, 500));
        assert_eq!(budget.held(), 800);
        drop(a);
        assert!(b.cover(500, 500));
    }

    #[test]
    fn racing_threads_never_hold_more_than_the_limit() {
        let budget = BodyBudget::default();
        let peak = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for i in 0..20_000usize {
                        let mut p = budget.permit();
                        if p.cover(1 + i % 300, 1000) {
                            peak.fetch_max(budget.held(), Ordering::Relaxed);
                            if p.cover(1 + i % 300 + i % 7, 1000) {
                                peak.fetch_max(budget.held(), Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Relaxed) <= 1000);
        assert_eq!(budget.held(), 0);
    }
}
