//! Dropping a guard and taking the same lock again at once: the acquire is ordered after the
//! release still in flight in this process (no attempt wasted on the lease being released, no
//! subscription, no wake-up), and the releaser still lets waiters elsewhere have their turn.

mod support;

use std::time::Duration;

use redlease::{LockManager, LockOptions, MemoryBackend, RedisBackend};
use support::RedisServer;

async fn manager(srv: &RedisServer) -> LockManager {
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(30)))
        .expect("options")
}

/// `drop(guard); lock.acquire()` 200 times on one key: every cycle costs exactly one acquire
/// and one release script call, and nothing subscribes. (Before, the acquire raced its own
/// release: it found the lease still held, subscribed, and waited for the release's message
/// or the fallback re-check.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_after_a_dropped_guard_waits_for_its_release() {
    let srv = RedisServer::start();
    let locks = manager(&srv).await;
    let lock = locks.lock("again");
    let (scripts, subscribes) = (srv.script_calls(), srv.command_calls("subscribe"));
    for _ in 0..200 {
        let guard = lock.acquire().await.expect("acquire");
        drop(guard);
    }
    // An explicit release at the end: every call before it has been answered.
    lock.acquire()
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
    assert_eq!(
        srv.command_calls("subscribe") - subscribes,
        0,
        "an acquire waited for a wake-up"
    );
    assert_eq!(
        srv.script_calls() - scripts,
        2 * 201,
        "attempts were wasted on a lease still being released"
    );
}

/// 200 times `drop(guard); lock.try_acquire()`: the lock is free each time.
async fn try_acquire_after_drop(locks: &LockManager) {
    let lock = locks.lock("again-once");
    for i in 0..200 {
        let guard = lock.try_acquire().await.expect("try_acquire");
        assert!(
            guard.is_some(),
            "cycle {i}: the lock was still held by our own release"
        );
        drop(guard);
    }
}

/// `drop(guard); lock.try_acquire()` finds the lock free: its own release went first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_acquire_after_a_dropped_guard_finds_the_lock_free() {
    let srv = RedisServer::start();
    try_acquire_after_drop(&manager(&srv).await).await;
}

/// The same on the in-process store.
#[tokio::test]
async fn a_try_acquire_after_a_dropped_guard_finds_the_lock_free_in_memory() {
    try_acquire_after_drop(&LockManager::new(MemoryBackend::new())).await;
}

/// A holder looping `acquire(); drop()` does not keep the lock from a waiter in another
/// process: the waiter is woken by a release, and the holder's next acquire yields to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_drops_and_acquires_again_yields_to_a_waiter() {
    let srv = RedisServer::start();
    let (holder, other) = (manager(&srv).await, manager(&srv).await);
    let lock = holder.lock("again-shared");
    let first = lock.acquire().await.expect("acquire");
    let waiting = tokio::spawn({
        let lock = other.lock("again-shared");
        async move { lock.acquire_timeout(Duration::from_secs(10)).await }
    });
    // The waiter has registered (asked for a message on release).
    let key = lock.key().as_str().to_owned();
    assert!(
        support::wait_for_async(Duration::from_secs(5), || support::field(&srv, &key, "w")
            .is_some())
        .await,
        "the waiter registered"
    );
    drop(first);
    let mut cycles = 0;
    while !waiting.is_finished() && cycles < 100 {
        // The waiter may hold it now: then this acquire waits for the waiter's release.
        let ours = tokio::time::timeout(Duration::from_millis(500), lock.acquire()).await;
        if let Ok(g) = ours {
            drop(g.expect("acquire"));
        }
        cycles += 1;
    }
    let got = waiting
        .await
        .expect("task")
        .expect("the waiter got the lock");
    assert!(
        cycles < 20,
        "the waiter got the lock only after {cycles} of the holder's cycles"
    );
    drop(got);
}

/// The wait for a release in flight is only an ordering: a release that cannot run (its
/// runtime is not being polled) holds the next attempt up for a moment, not for ever.
#[test]
fn a_release_that_cannot_run_does_not_hold_the_next_attempt_forever() {
    let locks = LockManager::new(MemoryBackend::new());
    let idle = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let guard = idle
        .block_on(locks.lock("stuck").acquire())
        .expect("acquire");
    // The release is spawned on `idle`, which nothing polls from here on.
    drop(guard);
    let other = tokio::runtime::Runtime::new().expect("runtime");
    other.block_on(async {
        let lock = locks.lock("stuck");
        let attempt = tokio::time::timeout(Duration::from_secs(5), lock.try_acquire()).await;
        let outcome = attempt.expect("try_acquire waited for a release that cannot run");
        assert!(
            outcome.expect("try_acquire").is_none(),
            "the lease is still there"
        );
    });
    drop(idle);
}
