//! The watchdog at scale: a short lease among many long ones. A file of its own, so that its
//! thousands of leases do not share the process (and the crate's one background thread)
//! with the short-TTL watchdog tests.

mod support;

use std::time::Duration;

use redlease::backend::{Backend, Lease, NodeTerms};
use redlease::{LockManager, LockOptions, RedisBackend};
use support::{RedisServer, Wrap, Wrapped};

/// A Redis store whose extensions cost a fixed time per lease on top of the server's own
/// (a busy server's cost, the same on a loaded test machine as on a quiet one).
#[derive(Debug)]
struct PerLeaseCost {
    inner: RedisBackend,
    per_lease: Duration,
}

#[async_trait::async_trait]
impl Wrap for PerLeaseCost {
    fn inner(&self) -> &dyn Backend {
        &self.inner
    }

    async fn extend(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> redlease::Result<Vec<redlease::backend::Extended>> {
        let cost = self.per_lease * u32::try_from(leases.len()).unwrap_or(u32::MAX);
        tokio::time::sleep(cost).await;
        self.inner.extend(leases, terms).await
    }
}

/// A short lease does not wait behind a round of long ones: due leases go out in deadline
/// order, a few calls of 256 at a time, so a 300 ms lease held beside 5,000 3 s leases is
/// extended before them every time they fall due together, though the store takes 80 µs a
/// lease (one call of all of them, 400 ms, cut at the short lease's deadline, lost it in
/// their first round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_is_not_lost_behind_a_round_of_long_ones() {
    const BULK: usize = 5_000;
    let srv = RedisServer::start();
    let backend = Wrapped(PerLeaseCost {
        inner: RedisBackend::connect(&srv.url()).await.unwrap(),
        per_lease: Duration::from_micros(80),
    });
    let opts = LockOptions::new().ttl(Duration::from_secs(3));
    let locks = LockManager::with_options(backend, opts).unwrap();
    let mut bulk = Vec::with_capacity(BULK);
    for chunk in (0..BULK).collect::<Vec<_>>().chunks(1000) {
        let batch = futures::future::join_all(chunk.iter().map(|i| {
            let lock = locks.lock(&format!("bulk:{i}"));
            async move { lock.try_acquire().await.unwrap().expect("free") }
        }))
        .await;
        bulk.extend(batch);
    }
    let short = locks
        .lock_with("short", |o| o.ttl(Duration::from_millis(300)))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    // Three rounds of the bulk (each 1 s apart), the short lease extended every 100 ms.
    let extended = locks.watchdog_stats().extended;
    let l2 = locks.clone();
    assert!(
        support::wait_for_async(Duration::from_secs(60), move || l2
            .watchdog_stats()
            .extended
            >= extended + 3 * BULK as u64)
        .await,
        "{:?}",
        locks.watchdog_stats()
    );
    assert!(!short.is_lost(), "{:?}", locks.watchdog_stats());
    assert_eq!(locks.watchdog_stats().lost, 0);
    assert!(bulk.iter().all(|g| !g.is_lost()));
    short.release().await.unwrap();
}
