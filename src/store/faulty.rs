//! A fault-injecting store for tests: wraps a real store and fails or stalls on command.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::{
    ClaimOutcome, ClaimRequest, Completion, Deletion, OwnerToken, Record, RecordKey, RecordStore,
    StoreError, StoreUsage, WriteOutcome,
};

/// What the fake does to calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Calls go through.
    None = 0,
    /// Every call fails with `Unavailable`.
    Down = 1,
    /// Only `complete` fails.
    CompleteFails = 2,
    /// Calls wait until the fault is switched, then meet the new one.
    Stall = 3,
    /// Only `delete` waits until the fault is switched; the rest go through.
    DeleteStalls = 4,
    /// Only `get` fails.
    GetFails = 5,
    /// Only `get` waits until the fault is switched; the rest go through.
    GetStalls = 6,
    /// Only `complete` panics (a bug in a store, as far as its caller can tell).
    CompletePanics = 7,
    /// Only `complete` fails with `Corrupt` (a reply this version cannot read).
    CompleteCorrupt = 8,
    /// Only `ping` fails with `Corrupt` (the script it runs raises).
    PingCorrupt = 9,
}

/// A [`RecordStore`] that injects faults into an inner store.
pub struct FaultyStore<S> {
    inner: S,
    fault: AtomicU8,
    /// Calls that reached this store (failed or not).
    pub calls: AtomicU64,
    /// What [`RecordStore::refusals_are_final`] answers (the inner store's unless set).
    pub refusals_are_final: Option<bool>,
    /// Parts the keys are spread over ([`RecordStore::parts`]): a key's first hash byte, modulo.
    pub parts: usize,
    /// The part that is down ([`FaultyStore::set_part_down`]); `usize::MAX` for none.
    down_part: AtomicUsize,
    /// Probes sent where a key's record lives ([`RecordStore::ping_near`]).
    pub near_pings: AtomicU64,
}

impl<S: RecordStore> FaultyStore<S> {
    /// Wraps `inner`, healthy.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            fault: AtomicU8::new(0),
            calls: AtomicU64::new(0),
            refusals_are_final: None,
            parts: 1,
            down_part: AtomicUsize::new(usize::MAX),
            near_pings: AtomicU64::new(0),
        }
    }

    /// Takes part `part` down (every call on its keys, and its probe, fails with
    /// `Unavailable`), or none.
    pub fn set_part_down(&self, part: Option<usize>) {
        self.down_part
            .store(part.unwrap_or(usize::MAX), Ordering::Release);
    }

    fn part_down(&self, part: usize) -> Result<(), StoreError> {
        if self.down_part.load(Ordering::Acquire) == part {
            return Err(StoreError::Unavailable(format!(
                "injected: part {part} down"
            )));
        }
        Ok(())
    }

    fn key_down(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.part_down(self.part_of(key))
    }

    /// Switches the fault.
    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::Release);
    }

    async fn check(&self, op: &str) -> Result<(), StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        loop {
            match self.fault.load(Ordering::Acquire) {
                1 => return Err(StoreError::Unavailable(format!("injected: {op}"))),
                2 if op == "complete" => {
                    return Err(StoreError::Unavailable("injected: complete".into()))
                }
                3 => tokio::time::sleep(Duration::from_millis(5)).await,
                4 if op == "delete" => tokio::time::sleep(Duration::from_millis(5)).await,
                5 if op == "get" => return Err(StoreError::Unavailable("injected: get".into())),
                6 if op == "get" => tokio::time::sleep(Duration::from_millis(5)).await,
                7 if op == "complete" => panic!("injected: complete panics"),
                8 if op == "complete" => {
                    return Err(StoreError::Corrupt("injected: complete".into()))
                }
                9 if op == "ping" => return Err(StoreError::Corrupt("injected: ping".into())),
                _ => return Ok(()),
            }
        }
    }
}

#[async_trait]
impl<S: RecordStore> RecordStore for FaultyStore<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.check("claim").await?;
        self.key_down(&req.key)?;
        self.inner.claim(req).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.check("complete").await?;
        self.key_down(key)?;
        self.inner.complete(key, owner, completion, ttl).await
    }
    async fn release(
        &self,
        key: &RecordKey,
        owner: OwnerToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.check("release").await?;
        self.key_down(key)?;
        self.inner.release(key, owner).await
    }
    async fn wait_for_change(
        &self,
        key: &RecordKey,
        timeout: Duration,
    ) -> Result<Option<Record>, StoreError> {
        self.check("wait").await?;
        self.key_down(key)?;
        self.inner.wait_for_change(key, timeout).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.check("get").await?;
        self.key_down(key)?;
        self.inner.get(key).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.check("delete").await?;
        self.key_down(key)?;
        self.inner.delete(key).await
    }
    async fn delete_settled(&self, key: &RecordKey) -> Result<Deletion, StoreError> {
        self.check("delete").await?;
        self.key_down(key)?;
        self.inner.delete_settled(key).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.check("ping").await?;
        self.inner.ping().await
    }
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.check("claim").await?;
        self.key_down(&req.key)?;
        self.inner.renew(req).await
    }
    async fn ping_near(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.near_pings.fetch_add(1, Ordering::Relaxed);
        self.check("ping").await?;
        self.key_down(key)?;
        self.inner.ping().await
    }
    async fn ping_part(&self, part: usize) -> Result<(), StoreError> {
        self.check("ping").await?;
        self.part_down(part)?;
        self.inner.ping().await
    }
    fn parts(&self) -> usize {
        self.parts
    }
    fn part_of(&self, key: &RecordKey) -> usize {
        usize::from(key.hash[0]) % self.parts.max(1)
    }
    fn usage(&self) -> Option<StoreUsage> {
        self.inner.usage()
    }
    fn refusals_are_final(&self) -> bool {
        self.refusals_are_final
            .unwrap_or_else(|| self.inner.refusals_are_final())
    }
}
