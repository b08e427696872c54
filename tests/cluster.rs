//! Redis Cluster: the same locks on a local cluster of three primaries started by the tests
//! (`support::RedisCluster`). The conformance suite also runs there (tests/conformance.rs,
//! module `cluster`); these are the cases that depend on the keys being spread over shards.

mod support;

use std::time::Duration;

use redlease::{LockManager, LockOptions, Owner, RedisBackend, RedisOptions, RetryPolicy};
use support::RedisCluster;

/// A long fallback re-check: a waiter that gets the lock well before it was woken by the
/// release's message.
const NO_FALLBACK: Duration = Duration::from_secs(60);

async fn backend(cluster: &RedisCluster) -> RedisBackend {
    RedisBackend::connect_with(
        &cluster.url(),
        RedisOptions::new().command_timeout(Duration::from_millis(500)),
    )
    .await
    .expect("connect to the cluster")
}

async fn manager(cluster: &RedisCluster, options: LockOptions) -> LockManager {
    LockManager::with_options(backend(cluster).await, options).expect("options")
}

fn patient() -> LockOptions {
    LockOptions::new().ttl(Duration::from_secs(10)).retry(
        RetryPolicy::notify()
            .min_delay(NO_FALLBACK)
            .max_delay(NO_FALLBACK),
    )
}

/// One lock on each primary, held by one manager: another manager finds each held, a waiter
/// on each is woken by its release's message (the fallback re-check is a minute away), and
/// fencing tokens increase per lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_on_every_shard_exclude_and_wake_their_waiters() {
    let cluster = RedisCluster::start(3, 0);
    let names = cluster.names_per_primary("redlease:", "shard");
    let a = manager(&cluster, patient()).await;
    let b = manager(&cluster, patient()).await;
    for name in &names {
        let held = a
            .lock(name)
            .try_acquire()
            .await
            .expect("acquire")
            .expect("free");
        assert!(
            b.lock(name).try_acquire().await.expect("try").is_none(),
            "{name}"
        );
        let waiter = {
            let lock = b.lock(name);
            tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(20)).await })
        };
        // The waiter has registered for the release's message.
        let key = a.lock(name).key().as_str().to_owned();
        let owner = &cluster.nodes[cluster.owner(&key, 0)];
        assert!(
            support::wait_for_async(Duration::from_secs(10), || support::field(owner, &key, "w")
                .is_some())
            .await,
            "{name}: the waiter registered"
        );
        let first = held.fencing_token();
        held.release().await.expect("release");
        let next = waiter
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("{name}: the waiter was not woken: {e}"));
        assert!(next.fencing_token() > first, "{name}");
        next.release().await.expect("release");
    }
}

/// Fair and reentrant locks, inspection and fenced writes work on every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_reentrant_inspect_and_fenced_writes_on_every_shard() {
    let cluster = RedisCluster::start(3, 0);
    let names = cluster.names_per_primary("redlease:", "kinds");
    let redis = backend(&cluster).await;
    let locks = LockManager::with_options(redis.clone(), patient().holder_label("worker-7"))
        .expect("options");
    let job = Owner::named("job");
    for name in &names {
        let fair = locks.lock(name).fair().expect("fair");
        let g = fair.acquire().await.expect("fair acquire");
        let waiter = {
            let fair = fair.clone();
            tokio::spawn(async move { fair.acquire_timeout(Duration::from_secs(20)).await })
        };
        // The waiter stands in the queue, and inspection shows it.
        let key = locks.lock(name).key().as_str().to_owned();
        let owner = &cluster.nodes[cluster.owner(&key, 0)];
        let timeouts = format!("{key}:timeouts");
        assert!(
            support::wait_for_async(Duration::from_secs(10), || owner
                .cmd(&["ZCARD", &timeouts])
                .as_int()
                == Some(1))
            .await,
            "{name}: the fair waiter queued"
        );
        let seen = locks
            .lock(name)
            .inspect()
            .await
            .expect("inspect")
            .expect("held");
        assert_eq!(seen.queue_len, 1, "{seen:?}");
        assert!(seen.held, "{seen:?}");
        assert_eq!(seen.holder_label.as_deref(), Some("worker-7"));
        g.release().await.expect("release");
        waiter
            .await
            .expect("task")
            .expect("the fair waiter gets the lock")
            .release()
            .await
            .expect("release");

        let reentrant = locks.lock(name).reentrant(&job).expect("reentrant");
        let outer = reentrant.acquire().await.expect("outer");
        let inner = reentrant.acquire().await.expect("inner");
        assert_eq!(inner.hold_count(), Some(2));
        assert_eq!(inner.fencing_token(), outer.fencing_token());
        assert_eq!(inner.release().await.expect("inner release"), 1);
        let token = outer.fencing_token();
        let data = format!("{name}:data");
        assert!(redis
            .fenced_set(&data, "v1", token)
            .await
            .expect("fenced write")
            .is_applied());
        assert!(!redis
            .fenced_set(&data, "v0", token - 1)
            .await
            .expect("fenced write")
            .is_applied());
        assert_eq!(outer.release().await.expect("outer release"), 0);
    }
}
