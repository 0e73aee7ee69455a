//! Time-ordered 64-bit execution ids (`X-Idempotency-Id`), Snowflake layout, lock-free.
//!
//! Layout, most significant bit first:
//!
//! ```text
//!   0 | 41 bits: ms since 2024-01-01T00:00:00Z | 10 bits: worker id | 12 bits: sequence
//! ```
//!
//! Backends put these ids under a unique index as the last line of defence, so a repeated id
//! would reject a legitimate request. One generator therefore never repeats an id, whatever the
//! wall clock does: it keeps a logical clock that only moves forward (see [`Snowflake::next_id_at`]).
//! Uniqueness across processes rests on distinct worker ids.

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The custom epoch, 2024-01-01T00:00:00Z, in Unix milliseconds.
pub const EPOCH_UNIX_MS: u64 = 1_704_067_200_000;

/// Largest worker id (10 bits).
pub const MAX_WORKER_ID: u16 = (1 << WORKER_BITS) - 1;

const WORKER_BITS: u32 = 10;
const SEQUENCE_BITS: u32 = 12;
const TIME_BITS: u32 = 41;
const SEQUENCE_MASK: u64 = (1 << SEQUENCE_BITS) - 1;
const WORKER_MASK: u64 = (1 << WORKER_BITS) - 1;
/// Last millisecond the 41-bit field can hold (mid-2093).
const MAX_MS: u64 = (1 << TIME_BITS) - 1;

/// A Snowflake id generator for one worker. Share it (`Arc`) across threads: it is lock-free.
///
/// The worker id may change while ids are issued ([`Snowflake::set_worker_id`]: a leased id
/// given up for another); ids stay unique as long as no two generators use one worker id at once.
#[derive(Debug)]
pub struct Snowflake {
    worker_id: AtomicU16,
    /// `last_ms << 12 | sequence` of the last id issued, `last_ms` counted from the custom epoch.
    /// Packing both into one word makes "advance the clock or bump the sequence" a single CAS,
    /// and makes the whole state a counter that only ever grows.
    state: AtomicU64,
}

/// The fields of an id, as returned by [`decode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnowflakeParts {
    /// Logical issue time in Unix milliseconds (may run slightly ahead of the wall clock after a
    /// burst or a clock step backwards).
    pub unix_ms: u64,
    /// Worker id, `0..=1023`.
    pub worker_id: u16,
    /// Sequence within the millisecond, `0..=4095`.
    pub sequence: u16,
}

// === impl Snowflake ===

impl Snowflake {
    /// A generator for `worker_id`. Only the low 10 bits are used (`worker_id & 1023`); config
    /// validation rejects larger values, so masking here only keeps this constructor total.
    pub fn new(worker_id: u16) -> Self {
        Snowflake {
            worker_id: AtomicU16::new(worker_id & MAX_WORKER_ID),
            state: AtomicU64::new(0),
        }
    }

    /// Issues the ids that follow under `worker_id` (low 10 bits). The logical clock carries
    /// on, so every id this generator issued stays distinct across the change (and ordered by
    /// time, though not within one millisecond when the new worker id is the smaller).
    pub fn set_worker_id(&self, worker_id: u16) {
        self.worker_id
            .store(worker_id & MAX_WORKER_ID, Ordering::Relaxed);
    }

    /// Issues no id stamped before `unix_ms` from now on (ids already issued are untouched):
    /// the logical clock moves up to it if behind. A clock that runs behind another trusted
    /// one (the shared store's) then cannot issue ids another generator issued under the same
    /// worker id before it.
    pub fn advance_to(&self, unix_ms: u64) {
        let floor = unix_ms.saturating_sub(EPOCH_UNIX_MS).min(MAX_MS) << SEQUENCE_BITS;
        self.state.fetch_max(floor, Ordering::Relaxed);
    }

    /// The next id, stamped with the current wall-clock time.
    pub fn next_id(&self) -> u64 {
        self.next_id_at(unix_ms_now())
    }

    /// The next id as if the wall clock read `now_unix_ms`: [`Snowflake::next_id`] with an
    /// injected clock, for tests.
    ///
    /// If `now` is past the last issued millisecond, the id takes `now` with sequence 0.
    /// Otherwise (same millisecond, or the clock stepped back) it continues from the last id
    /// with sequence + 1; when the sequence passes 4095 the logical millisecond advances by one,
    /// borrowing from the future instead of spinning until the clock catches up. Ids from one
    /// generator are therefore strictly increasing and never wait.
    pub fn next_id_at(&self, now_unix_ms: u64) -> u64 {
        let now = now_unix_ms.saturating_sub(EPOCH_UNIX_MS).min(MAX_MS) << SEQUENCE_BITS;
        // Since the state is `ms << 12 | seq`, "same ms: seq + 1, overflow: next ms, seq 0" is
        // just `state + 1`, and "clock moved on" is `now << 12`: the next state is the larger.
        let step = |state: u64| state.saturating_add(1).max(now);
        let next = match self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| Some(step(s)))
        {
            Ok(prev) | Err(prev) => step(prev),
        };
        let ms = next >> SEQUENCE_BITS;
        // After 2093 the time field would spill into the sign bit; mask so ids stay positive.
        ((ms & MAX_MS) << (WORKER_BITS + SEQUENCE_BITS))
            | (u64::from(self.worker_id.load(Ordering::Relaxed)) << SEQUENCE_BITS)
            | (next & SEQUENCE_MASK)
    }

    /// This generator's worker id (`0..=1023`).
    pub fn worker_id(&self) -> u16 {
        self.worker_id.load(Ordering::Relaxed)
    }
}

/// This host's wall clock in Unix milliseconds (0 before 1970: a clock that far off is
/// nonsense, and the logical clock absorbs it).
pub fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Splits an id into its issue time, worker id and sequence.
pub fn decode(id: u64) -> SnowflakeParts {
    SnowflakeParts {
        unix_ms: ((id >> (WORKER_BITS + SEQUENCE_BITS)) & MAX_MS) + EPOCH_UNIX_MS,
        // Both masks are below 2^16, so the narrowing casts keep every bit.
        worker_id: ((id >> SEQUENCE_BITS) & WORKER_MASK) as u16,
        sequence: (id & SEQUENCE_MASK) as u16,
    }
}

/// A worker id derived from the pod or host name hashed to 10 bits, used when config sets none.
///
/// Looks at `POD_NAME`, then `HOSTNAME`, then the kernel host name. With only 1024 values,
/// hashed ids collide by the birthday rule (about 1 in 2 for 38 replicas): deployments with many
/// replicas should set `worker_id` explicitly (a StatefulSet ordinal, for instance).
pub fn default_worker_id() -> u16 {
    match host_name() {
        Some(name) => worker_id_from_name(&name),
        // No name anywhere: the process id at least differs between processes on one host.
        None => worker_id_from_name(&std::process::id().to_string()),
    }
}

/// The pod or host name: `POD_NAME`, then `HOSTNAME`, then the kernel host name; `None` when
/// none is set.
pub fn host_name() -> Option<String> {
    ["POD_NAME", "HOSTNAME"]
        .iter()
        .filter_map(|var| std::env::var(var).ok())
        .chain(
            ["/proc/sys/kernel/hostname", "/etc/hostname"]
                .iter()
                .filter_map(|path| std::fs::read_to_string(path).ok()),
        )
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
}

/// FNV-1a over the name, folded to 10 bits. Stable across builds and platforms, unlike std's
/// `DefaultHasher`, so a pod keeps its worker id across upgrades.
pub fn worker_id_from_name(name: &str) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in name.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 32;
    h ^= h >> 16;
    // Masked to 10 bits, so the narrowing cast keeps every bit.
    (h & WORKER_MASK) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// 2025-06-01T00:00:00Z.
    const T: u64 = 1_748_736_000_000;

    #[test]
    fn ids_strictly_increase_on_the_real_clock() {
        let gen = Snowflake::new(7);
        let mut last = gen.next_id();
        for _ in 0..100_000 {
            let id = gen.next_id();
            assert!(id > last, "{id} after {last}");
            last = id;
        }
    }

    #[test]
    fn decode_round_trips() {
        let gen = Snowflake::new(513);
        let id = gen.next_id_at(T);
        assert!(id < 1 << 63, "sign bit stays clear");
        assert_eq!(
            decode(id),
            SnowflakeParts {
                unix_ms: T,
                worker_id: 513,
                sequence: 0
            }
        );
        assert_eq!(
            decode(gen.next_id_at(T)),
            SnowflakeParts {
                unix_ms: T,
                worker_id: 513,
                sequence: 1
            }
        );
        assert_eq!(decode(gen.next_id_at(T + 10)).unix_ms, T + 10);

        let now = Snowflake::new(1).next_id();
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_millis() as u64;
        assert!(decode(now).unix_ms.abs_diff(wall) < 10_000);
    }

    #[test]
    fn clock_stepping_back_keeps_ids_increasing() {
        let gen = Snowflake::new(3);
        let mut seen = HashSet::new();
        let mut last = 0;
        let mut clock = T;
        for i in 0..20_000u64 {
            if i == 10_000 {
                clock -= 5_000;
            } else if i % 7 == 0 {
                clock += 1;
            }
            let id = gen.next_id_at(clock);
            assert!(id > last, "call {i}: {id} after {last}");
            assert!(seen.insert(id));
            last = id;
        }
        // While the wall clock is behind, ids carry the logical clock, not the stepped-back one.
        assert!(decode(last).unix_ms >= T);
    }

    #[test]
    fn sequence_overflow_borrows_the_next_millisecond() {
        let gen = Snowflake::new(9);
        let ids: Vec<u64> = (0..10_000).map(|_| gen.next_id_at(T)).collect();
        let unique: HashSet<u64> = ids.iter().copied().collect();
        assert_eq!(unique.len(), ids.len());
        assert!(ids.windows(2).all(|w| w[0] < w[1]));

        assert_eq!(decode(ids[4095]).unix_ms, T);
        assert_eq!(decode(ids[4095]).sequence, 4095);
        assert_eq!(decode(ids[4096]).unix_ms, T + 1);
        assert_eq!(decode(ids[4096]).sequence, 0);
        assert_eq!(decode(ids[9_999]).unix_ms, T + 2);

        // The wall clock reaching a borrowed millisecond does not reuse its ids.
        let next = gen.next_id_at(T + 2);
        assert!(next > ids[9_999]);
        // Once the wall clock passes the logical one, ids follow it again.
        assert_eq!(
            decode(gen.next_id_at(T + 3)),
            SnowflakeParts {
                unix_ms: T + 3,
                worker_id: 9,
                sequence: 0
            }
        );
    }

    #[test]
    fn concurrent_ids_are_unique() {
        let gen = Snowflake::new(42);
        let (a, b) = std::thread::scope(|s| {
            let one = s.spawn(|| (0..50_000).map(|_| gen.next_id()).collect::<Vec<_>>());
            let two = s.spawn(|| (0..50_000).map(|_| gen.next_id()).collect::<Vec<_>>());
            (
                one.join().expect("thread one"),
                two.join().expect("thread two"),
            )
        });
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        let all: HashSet<u64> = a.iter().chain(&b).copied().collect();
        assert_eq!(all.len(), 100_000);
    }

    #[test]
    fn worker_id_is_in_the_id() {
        for worker in [0u16, 1, 512, 1023] {
            let gen = Snowflake::new(worker);
            assert_eq!(gen.worker_id(), worker);
            assert_eq!(decode(gen.next_id_at(T)).worker_id, worker);
        }
        // Out-of-range ids are masked to 10 bits and never leak into the time field.
        let gen = Snowflake::new(1024 + 5);
        assert_eq!(gen.worker_id(), 5);
        assert_eq!(decode(gen.next_id_at(T)).unix_ms, T);
        // Same instant, different workers: different ids.
        assert_ne!(
            Snowflake::new(1).next_id_at(T),
            Snowflake::new(2).next_id_at(T)
        );
    }

    #[test]
    fn a_new_worker_id_takes_effect_and_ids_keep_increasing() {
        let gen = Snowflake::new(3);
        let before = gen.next_id_at(T);
        gen.set_worker_id(700);
        let after = gen.next_id_at(T);
        assert_eq!(decode(after).worker_id, 700);
        assert_eq!(gen.worker_id(), 700);
        assert!(after > before, "{after} after {before}");
        gen.set_worker_id(1024 + 2);
        let smaller = gen.next_id_at(T);
        assert_eq!(decode(smaller).worker_id, 2, "masked to 10 bits");
        assert!(smaller != before && smaller != after);
        assert_eq!(decode(smaller).sequence, 2, "the logical clock carried on");
    }

    #[test]
    fn clock_before_the_epoch_still_yields_ids() {
        let gen = Snowflake::new(1);
        let a = gen.next_id_at(0);
        let b = gen.next_id_at(0);
        assert!(b > a);
        assert_eq!(decode(a).unix_ms, EPOCH_UNIX_MS);
    }

    #[test]
    fn default_worker_id_is_ten_bits_and_stable() {
        assert!(default_worker_id() <= MAX_WORKER_ID);
        assert_eq!(default_worker_id(), default_worker_id());
        assert_eq!(
            worker_id_from_name("idemgate-7d9f8b-x2kq4"),
            worker_id_from_name("idemgate-7d9f8b-x2kq4")
        );
        let spread: HashSet<u16> = (0..100)
            .map(|i| worker_id_from_name(&format!("idemgate-{i}")))
            .collect();
        assert!(spread.len() > 80, "{} distinct of 100", spread.len());
    }
}
