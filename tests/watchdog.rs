//! One shared watchdog per manager extends every held lease in batches: the cost is a few
//! round trips per tick, not one per lease.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlease::backend::{Acquire, Attempt, Backend, Claim, Extended, Lease, NodeTerms};
use redlease::{LockManager, LockOptions, MemoryBackend, RedisBackend};
use support::{RedisServer, Wrap, Wrapped};

const LEASES: usize = 1000;

async fn hold_many(locks: &LockManager) -> Vec<redlease::LockGuard> {
    let mut guards = Vec::with_capacity(LEASES);
    for i in 0..LEASES {
        let g = locks.lock(&format!("job:{i}")).try_acquire().await.unwrap();
        guards.push(g.expect("distinct names are free"));
    }
    guards
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_leases_cost_a_few_round_trips_per_tick() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().ttl(Duration::from_millis(900)); // extended every 300 ms
    let locks =
        LockManager::with_options(RedisBackend::connect(&srv.url()).await.unwrap(), opts).unwrap();
    let guards = hold_many(&locks).await;

    let before = locks.watchdog_stats();
    let cmds_before = srv.script_calls();
    let began = Instant::now();
    // Several TTLs pass: that is the point of the test, not synchronisation.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let elapsed = began.elapsed();
    let after = locks.watchdog_stats();
    let cmds = srv.script_calls() - cmds_before;

    let rounds = after.rounds - before.rounds;
    let extended = after.extended - before.extended;
    eprintln!(
        "{LEASES} leases over {elapsed:?}: {rounds} watchdog rounds, {extended} extensions, \
         {cmds} script calls ({:.1}/s)",
        cmds as f64 / elapsed.as_secs_f64()
    );
    assert!(rounds >= 2, "the watchdog ran {rounds} rounds");
    assert!(
        extended >= 2 * LEASES as u64,
        "every lease extended each round: {extended}"
    );
    // Leases ride together: a call carries the leases due within a quarter of their interval
    // (acquired close together), and a script call extends up to 256 of them; so the cost
    // follows rounds, not leases: not one script call per extension.
    assert!(
        extended / rounds.max(1) >= 50 && extended / cmds.max(1) >= 50,
        "{extended} extensions in {rounds} calls, {cmds} script calls"
    );
    assert_eq!(after.leases, LEASES);
    assert!(guards.iter().all(|g| !g.is_lost()));
    // Every key is still there after 2+ TTLs.
    let key = locks.lock("job:0").key().as_str().to_owned();
    assert!(support::held(&srv, &key), "the lease ran out on the server");

    drop(guards);
    let locks2 = locks.clone();
    assert!(
        support::wait_for_async(Duration::from_secs(10), move || locks2
            .watchdog_stats()
            .leases
            == 0)
        .await,
        "dropped guards leave the watchdog"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_backend_batches_the_same_way() {
    let opts = LockOptions::new().ttl(Duration::from_millis(300));
    let locks = LockManager::with_options(MemoryBackend::new(), opts).unwrap();
    let guards = hold_many(&locks).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let s = locks.watchdog_stats();
    assert!(
        // A call carries up to 256 leases: not a call per lease.
        s.rounds >= 1 && s.extended / s.rounds >= 100,
        "{s:?}"
    );
    assert!(guards.iter().all(|g| !g.is_lost()));
}

/// The watchdog task stops when nothing is held and starts again on the next acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_restarts_after_going_idle() {
    let opts = LockOptions::new().ttl(Duration::from_millis(100));
    let locks = LockManager::with_options(MemoryBackend::new(), opts).unwrap();
    for _ in 0..3 {
        let g = locks.lock("idle").acquire().await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(!g.is_lost(), "extended across 2.5 TTLs");
        g.release().await.unwrap();
        let l = locks.clone();
        assert!(
            support::wait_for_async(Duration::from_secs(5), move || l.watchdog_stats().leases
                == 0)
            .await
        );
    }
}

/// A MemoryBackend whose next `extend` applies at once but holds its reply back until the
/// test lets it go: an extension confirmed after a later one. With `fail_extends`, every
/// extension applies and then reports a failure (its answer lost); with `grant_delay`, every
/// acquire's answer comes back that much later.
#[derive(Clone, Debug, Default)]
struct SlowReply {
    inner: MemoryBackend,
    hold_next: Arc<AtomicBool>,
    held: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
    fail_extends: Arc<AtomicBool>,
    grant_delay: Duration,
    /// The next extension panics (a bug in a store), ending the watchdog task mid-call.
    panic_next: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl Wrap for SlowReply {
    fn inner(&self) -> &dyn Backend {
        &self.inner
    }

    async fn acquire(
        &self,
        claim: &Claim,
        attempt: Attempt,
        terms: NodeTerms,
    ) -> redlease::Result<Acquire> {
        let outcome = self.inner.acquire(claim, attempt, terms).await;
        tokio::time::sleep(self.grant_delay).await;
        outcome
    }

    async fn extend(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> redlease::Result<Vec<redlease::backend::Extended>> {
        if self.panic_next.swap(false, Ordering::SeqCst) {
            panic!("a store's extension bug");
        }
        let reply = self.inner.extend(leases, terms).await;
        if self.fail_extends.load(Ordering::SeqCst) {
            return Ok(leases
                .iter()
                .map(|_| Extended::Failed(redlease::Error::backend("answer lost")))
                .collect());
        }
        if self.hold_next.swap(false, Ordering::SeqCst) {
            self.held.notify_one();
            self.release.notified().await;
        }
        reply
    }
}

/// The watchdog sends a 3 s extension, then the holder shortens the lease to 200 ms; the
/// watchdog's reply comes back last. The store keeps the 200 ms (it ran that one last), so
/// the guard's deadline must too: the older confirmation must not push it to 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_confirmation_never_moves_the_deadline_past_a_newer_one() {
    let backend = Wrapped(SlowReply::default());
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(3))
        .watchdog_interval(Duration::from_millis(50));
    let locks = LockManager::with_options(backend.clone(), opts).unwrap();
    let g = locks.lock("order").acquire().await.unwrap();
    backend.hold_next.store(true, Ordering::SeqCst);
    backend.held.notified().await; // the watchdog's 3 s extension ran; its reply is held
    g.extend(Duration::from_millis(200)).await.unwrap();
    let shortened = g.valid_until();
    backend.release.notify_one();
    // Let the held reply be processed: the next watchdog round shows it was.
    let rounds = locks.watchdog_stats().rounds;
    let l = locks.clone();
    assert!(
        support::wait_for_async(Duration::from_secs(5), move || l.watchdog_stats().rounds
            > rounds)
        .await
    );
    assert!(
        g.valid_until() <= shortened + Duration::from_millis(200),
        "deadline moved to {:?} after a 200 ms extension",
        g.valid_until() - Instant::now()
    );
}

/// `extend` to a shorter TTL whose answer is lost (it may have run): the guard's deadline
/// comes forward to where that extension would leave the lease, instead of keeping the
/// longer one the store may no longer honour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_shorter_extension_brings_the_deadline_forward() {
    let backend = Wrapped(SlowReply::default());
    let opts = LockOptions::new().ttl(Duration::from_secs(5));
    let locks = LockManager::with_options(backend.clone(), opts).unwrap();
    let g = locks.lock("shorter").acquire().await.unwrap();
    backend.fail_extends.store(true, Ordering::SeqCst);
    let sent = Instant::now();
    assert!(g.extend(Duration::from_millis(200)).await.is_err());
    assert!(
        g.valid_until() <= sent + Duration::from_millis(200),
        "the deadline stayed {:?} away after an unanswered 200 ms extension",
        g.valid_until().saturating_duration_since(sent)
    );
}

/// A grant whose answer comes back after the lease's validity (the store paused between the
/// grant and its reply) is never handed out as a guard that is lost from the start: it is
/// given back, `try_acquire` says it did not get the lock, and the lock is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_comes_back_too_late_is_given_back() {
    let backend = Wrapped(SlowReply {
        grant_delay: Duration::from_millis(150),
        ..SlowReply::default()
    });
    let opts = LockOptions::new().ttl(Duration::from_millis(100));
    let locks = LockManager::with_options(backend.clone(), opts).unwrap();
    let lock = locks.lock("late");
    assert!(lock.try_acquire().await.unwrap().is_none());
    match lock.acquire_timeout(Duration::from_millis(600)).await {
        Err(redlease::Error::Timeout { .. }) => {}
        other => panic!("every grant came back late: {other:?}"),
    }
    let info = backend.inner.inspect(lock.key()).await.unwrap();
    assert!(
        info.as_ref().is_none_or(|i| !i.held),
        "a late grant was left held: {info:?}"
    );
}

/// The watchdog serves every runtime a manager is used from: a current-thread runtime that
/// started it and then went idle must not stop it.
#[test]
fn watchdog_keeps_running_after_the_runtime_that_started_it_goes_idle() {
    let opts = LockOptions::new().ttl(Duration::from_millis(150));
    let locks = LockManager::with_options(MemoryBackend::new(), opts).unwrap();
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let g1 = first.block_on(locks.lock("first").acquire()).unwrap();
    // `first` is idle from here on: nothing polls its tasks.
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    other.block_on(async {
        let g2 = locks.lock("second").acquire().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await; // four TTLs pass
        assert!(!g2.is_lost(), "{:?}", locks.watchdog_stats());
        assert!(!g1.is_lost());
    });
    drop(first);
}

/// A watchdog task that dies with a call on its way (a store's extension panics) leaves no
/// lease behind it: a task is started again and extends that call's leases, and the lease
/// registered while the dead one unwound. (The leases of a call on its way are not sent
/// again until it is answered; a task that died once stranded them, and a registration made
/// while it unwound saw it running and started none: every lease was lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leases_of_a_watchdog_task_that_died_are_extended_by_the_next() {
    let store = Wrapped(SlowReply::default());
    store.panic_next.store(true, Ordering::SeqCst);
    // A TTL that a starved machine does not stall through (a lease is lost, rightly, when
    // its holder goes that long without an extension), and many ticks within it.
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .watchdog_interval(Duration::from_millis(100));
    let locks = LockManager::with_options(store.clone(), opts).expect("options");
    let a = locks.lock("a").try_acquire().await.unwrap().expect("free");
    let a_first = a.valid_until();
    assert!(
        support::wait_for_async(Duration::from_secs(10), || !store
            .panic_next
            .load(Ordering::SeqCst))
        .await,
        "the first extension ran (and panicked)"
    );
    // A new registration starts a new task.
    let b = locks.lock("b").try_acquire().await.unwrap().expect("free");
    let b_first = b.valid_until();
    // Each lease extended after the task died: the one its call carried, and the one
    // registered while it unwound.
    assert!(
        support::wait_for_async(Duration::from_secs(10), || a.valid_until() > a_first
            && b.valid_until() > b_first)
        .await,
        "a lease was stranded: {:?} (a extended: {}, b extended: {})",
        locks.watchdog_stats(),
        a.valid_until() > a_first,
        b.valid_until() > b_first,
    );
    assert!(!b.is_lost());
    assert!(
        !a.is_lost(),
        "the dead task's lease was stranded: {:?}",
        locks.watchdog_stats()
    );
}
