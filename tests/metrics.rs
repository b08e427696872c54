//! Metrics (feature `metrics`): a debugging recorder, installed for this test binary alone,
//! sees the counts of acquisitions, contention, waits, holds, lost leases and watchdog
//! rounds that one scripted scenario must produce.

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use redlease::{Error, LockManager, LockOptions, MemoryBackend};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn counter(snap: &[(CompositeKey, DebugValue)], name: &str, label: Option<(&str, &str)>) -> u64 {
    snap.iter()
        .filter(|(k, _)| k.kind() == MetricKind::Counter && k.key().name() == name)
        .filter(|(k, _)| {
            label.is_none_or(|(l, v)| k.key().labels().any(|x| x.key() == l && x.value() == v))
        })
        .map(|(_, v)| match v {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

fn samples(snap: &[(CompositeKey, DebugValue)], name: &str) -> Vec<f64> {
    snap.iter()
        .filter(|(k, _)| k.kind() == MetricKind::Histogram && k.key().name() == name)
        .flat_map(|(_, v)| match v {
            DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).collect(),
            _ => Vec::new(),
        })
        .collect()
}

fn snapshot(s: &Snapshotter) -> Vec<(CompositeKey, DebugValue)> {
    s.snapshot()
        .into_vec()
        .into_iter()
        .map(|(k, _, _, v)| (k, v))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_contention_waits_holds_losses_and_rounds_are_recorded() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder in this binary");

    let backend = MemoryBackend::new();
    let opts = LockOptions::new().ttl(ms(150));
    let locks = LockManager::with_options(backend, opts).unwrap();
    let lock = locks.lock("metered");

    // 1 acquired; then 1 busy try (1 contention); then a timed-out wait (contention >= 1).
    let held = lock.acquire().await.unwrap();
    assert!(lock.try_acquire().await.unwrap().is_none());
    let timeout = lock.acquire_timeout(ms(80)).await.unwrap_err();
    assert!(matches!(timeout, Error::Timeout { .. }));
    // Held across several watchdog rounds (every 50 ms), then released: one hold sample.
    let rounds_before = locks.watchdog_stats().rounds;
    let began = std::time::Instant::now();
    while locks.watchdog_stats().rounds < rounds_before + 3 {
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "the watchdog stalled"
        );
        tokio::time::sleep(ms(20)).await;
    }
    held.release().await.unwrap();

    // A lease whose max_hold runs out is lost: one lost lease.
    let capped = locks.lock_with("capped", |o| o.max_hold(ms(200))).unwrap();
    let g = capped.acquire().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .unwrap();
    // The watchdog counts it when it drops the lease (at the deadline it just passed).
    let began = std::time::Instant::now();
    while locks.watchdog_stats().lost < 1 && began.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(ms(10)).await;
    }
    drop(g);

    let snap = snapshot(&snapshotter);
    let acquire = "redlease_acquire_total";
    assert_eq!(counter(&snap, acquire, Some(("outcome", "acquired"))), 2);
    assert_eq!(counter(&snap, acquire, Some(("outcome", "busy"))), 1);
    assert_eq!(counter(&snap, acquire, Some(("outcome", "timeout"))), 1);
    assert_eq!(counter(&snap, acquire, Some(("outcome", "error"))), 0);
    assert!(counter(&snap, "redlease_contention_total", None) >= 2);
    assert_eq!(samples(&snap, "redlease_acquire_wait_seconds").len(), 2);
    let holds = samples(&snap, "redlease_hold_seconds");
    assert_eq!(holds.len(), 2, "{holds:?}");
    assert!(holds.iter().any(|&s| s >= 0.1), "the long hold: {holds:?}");
    assert_eq!(counter(&snap, "redlease_lost_total", None), 1);
    let rounds = counter(&snap, "redlease_watchdog_rounds_total", None);
    assert_eq!(rounds, locks.watchdog_stats().rounds);
    assert!(rounds >= 3);
    assert_eq!(
        samples(&snap, "redlease_watchdog_round_seconds").len() as u64,
        rounds
    );
    assert_eq!(
        counter(
            &snap,
            "redlease_release_total",
            Some(("outcome", "released"))
        ),
        1
    );
}

// ---------------------------------------------------------------------------------------
// Reentrant holds go through the one engine and the one guard, and so through their
// metrics. Each scenario records to a recorder of its own, set on its thread only (the
// test above owns the global one): a current-thread runtime keeps every acquire and
// release on that thread, and with the watchdog off nothing runs on the crate's own
// runtime.
// ---------------------------------------------------------------------------------------

mod support;

use std::future::Future;
use std::sync::Arc;

use redlease::{Backend, Owner, RedisBackend};

/// Runs `scenario` on a current-thread runtime with a recorder of its own, and returns
/// what it recorded.
fn recorded<F: Future<Output = ()>>(
    scenario: impl FnOnce() -> F,
) -> Vec<(CompositeKey, DebugValue)> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || rt.block_on(scenario()));
    drop(rt);
    snapshot(&snapshotter)
}

/// Three holds of one reign (acquire, a nested try_acquire, a nested acquire_timeout), one
/// busy attempt by another owner, and three releases.
async fn three_reentrant_holds(backend: Arc<dyn Backend>) {
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(30))
        .watchdog(false);
    let locks = LockManager::with_options(backend, opts).unwrap();
    let lock = locks
        .lock("metered-reign")
        .reentrant(&Owner::random())
        .unwrap();
    let mut holds = vec![lock.acquire().await.unwrap()];
    holds.push(
        lock.try_acquire()
            .await
            .unwrap()
            .expect("a nested try_acquire"),
    );
    holds.push(lock.acquire_timeout(ms(500)).await.unwrap());
    let counts: Vec<_> = holds.iter().map(|g| g.hold_count()).collect();
    assert_eq!(counts, [Some(1), Some(2), Some(3)]);
    let theirs = locks
        .lock("metered-reign")
        .reentrant(&Owner::random())
        .unwrap();
    assert!(theirs.try_acquire().await.unwrap().is_none());
    for left in [2, 1, 0] {
        let g = holds.pop().expect("a hold");
        assert_eq!(g.release().await.unwrap(), left);
    }
}

fn assert_three_holds_counted(snap: &[(CompositeKey, DebugValue)]) {
    let acquire = "redlease_acquire_total";
    let release = "redlease_release_total";
    assert_eq!(counter(snap, acquire, Some(("outcome", "acquired"))), 3);
    assert_eq!(counter(snap, acquire, Some(("outcome", "busy"))), 1);
    assert_eq!(counter(snap, acquire, Some(("outcome", "error"))), 0);
    assert_eq!(counter(snap, release, Some(("outcome", "released"))), 3);
    assert_eq!(counter(snap, release, None), 3, "no other release outcome");
    assert_eq!(counter(snap, "redlease_contention_total", None), 1);
    assert_eq!(samples(snap, "redlease_acquire_wait_seconds").len(), 3);
    assert_eq!(samples(snap, "redlease_hold_seconds").len(), 3);
}

#[test]
fn reentrant_acquires_and_releases_are_counted_in_memory() {
    let snap = recorded(|| three_reentrant_holds(Arc::new(MemoryBackend::new())));
    assert_three_holds_counted(&snap);
}

#[test]
fn reentrant_acquires_and_releases_are_counted_on_redis() {
    let srv = support::RedisServer::start();
    let snap = recorded(|| async {
        let backend = RedisBackend::connect(&srv.url()).await.unwrap();
        three_reentrant_holds(Arc::new(backend)).await;
    });
    assert_three_holds_counted(&snap);
}
