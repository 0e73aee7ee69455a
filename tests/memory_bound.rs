//! The embedded store's `capacity` bounds the memory its records really take: every byte the
//! heap gives the store for a record (map slot with the table's slack, tenant, stored response)
//! is charged against the capacity. Measured with a counting allocator around the real store.
//! The same holds for the local cache of completed records in front of a shared store.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::store::cached::{CachedStore, LocalCacheOptions};
use idemgate::store::memory::MemoryStore;
use idemgate::store::{
    ClaimOutcome, ClaimRequest, Completion, Deletion, OwnerToken, Record, RecordKey, RecordState,
    RecordStore, StoreError, StoredResponse, WriteOutcome,
};
use sha2::Digest as _;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The count is the whole process's: the tests take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn request(n: u32) -> ClaimRequest {
    // Record hashes are SHA-256 digests in the proxy; the store relies on them being uniform.
    let hash: [u8; 32] = sha2::Sha256::digest(n.to_le_bytes()).into();
    ClaimRequest {
        key: RecordKey {
            tenant: "shop-eu".into(),
            hash,
        },
        fingerprint: [7; 32],
        owner: OwnerToken::random(),
        execution_id: u64::from(n),
        lock_ttl: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

/// A typical small API answer, built the way the proxy stores one.
fn response(body_len: usize) -> Completion {
    Completion::Response(Arc::new(StoredResponse::new(
        201,
        vec![
            (
                "content-type".to_owned(),
                Bytes::copy_from_slice(b"application/json"),
            ),
            (
                "x-request-id".to_owned(),
                Bytes::copy_from_slice(b"7f3a9c1e-5b2d-4e8f"),
            ),
        ],
        Bytes::copy_from_slice(&vec![b'x'; body_len]),
    )))
}

#[tokio::test(flavor = "current_thread")]
async fn the_capacity_bounds_the_heap_the_records_take() {
    let _turn = ONE_AT_A_TIME.lock().await;
    for (shards, body_len) in [(64, 33), (1, 33), (64, 0), (8, 2000)] {
        let store = MemoryStore::new(1 << 30, shards);
        let base = LIVE.load(Ordering::Relaxed);
        let mut worst = 0.0f64;
        for n in 0..60_000u32 {
            let req = request(n);
            store.claim(&req).await.unwrap();
            // Half the records stay in flight, half complete.
            if n % 2 == 0 {
                store
                    .complete(&req.key, req.owner, response(body_len), req.ttl)
                    .await
                    .unwrap();
                // Replayed once, as a retry would: the replay's slices of the stored buffer
                // make it shared, which takes heap of its own for as long as the record lives.
                if let Some(Record {
                    state: RecordState::Completed(Completion::Response(stored)),
                    ..
                }) = store.get(&req.key).await.unwrap()
                {
                    drop(stored.body_bytes());
                    stored.shared_headers().for_each(drop);
                }
            }
            if n % 997 == 0 || n == 59_999 {
                // Beyond the records: each shard's empty table (a few slots) and the shard array.
                let fixed = (shards * 1024) as f64;
                let real = (LIVE.load(Ordering::Relaxed) - base) as f64;
                let charged = store.usage().map_or(0, |u| u.bytes) as f64;
                if n >= 5_000 {
                    worst = worst.max(real / charged);
                }
                assert!(
                    real <= charged + fixed,
                    "{shards} shards, {body_len}-byte bodies, {n} records: heap {real} > charged {charged}"
                );
            }
        }
        println!("{shards} shards, {body_len}-byte bodies: heap / charged at most {worst:.2} from 5000 records on");
        drop(store);
    }
}

/// A shared store that keeps nothing: every claim acquires and every write applies, so all the
/// heap a cached store grows by is the cache's own.
struct Nothing;

#[async_trait::async_trait]
impl RecordStore for Nothing {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        Ok(ClaimOutcome::Acquired {
            execution_id: req.execution_id,
            lapsed: false,
        })
    }
    async fn renew(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim(req).await
    }
    async fn complete(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: Completion,
        _: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        Ok(WriteOutcome::Applied)
    }
    async fn release(&self, _: &RecordKey, _: OwnerToken) -> Result<WriteOutcome, StoreError> {
        Ok(WriteOutcome::Applied)
    }
    async fn wait_for_change(
        &self,
        _: &RecordKey,
        _: Duration,
    ) -> Result<Option<Record>, StoreError> {
        Ok(None)
    }
    async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StoreError> {
        Ok(None)
    }
    async fn delete(&self, _: &RecordKey) -> Result<bool, StoreError> {
        Ok(false)
    }
    async fn delete_settled(&self, _: &RecordKey) -> Result<Deletion, StoreError> {
        Ok(Deletion::Absent)
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_local_cache_capacity_bounds_the_heap_its_entries_take() {
    let _turn = ONE_AT_A_TIME.lock().await;
    for body_len in [0, 20, 2000] {
        let capacity = 4 << 20;
        let store = CachedStore::new(
            Nothing,
            LocalCacheOptions {
                capacity_bytes: capacity,
                expected_items: 1000,
                false_positive_rate: 0.01,
                window: Duration::from_secs(3600),
            },
        )
        .unwrap();
        // The Bloom filters and the shard array are allocated already.
        let base = LIVE.load(Ordering::Relaxed);
        for n in 0..100_000u32 {
            let req = request(n);
            store.claim(&req).await.unwrap();
            store
                .complete(&req.key, req.owner, response(body_len), req.ttl)
                .await
                .unwrap();
            if n % 997 == 0 {
                let real = LIVE.load(Ordering::Relaxed) - base;
                // Beyond the entries: each shard's empty table and queue.
                let fixed = 4 * 4096;
                assert!(
                    real <= (capacity + fixed) as isize,
                    "{body_len}-byte bodies, {n} completions: heap {real} > capacity {capacity}"
                );
            }
        }
        let (records, bytes) = store.cache_usage();
        assert!(
            records > 1000 && bytes <= capacity,
            "{records} records, {bytes} bytes"
        );
        drop(store);
    }
}
