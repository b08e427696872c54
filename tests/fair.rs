//! Fair (FIFO) locks, on a real redis-server and in memory: arrival order across managers,
//! eviction of dead waiters, waiters that give up leaving at once, a crashed holder, the
//! hand-off waking only the head, and fair and plain acquirers sharing one name.
//!
//! Every wait is bounded, and waiters use a fallback re-check far longer than the test's
//! bounds wherever the point is that the wake-up, not the fallback, did the work.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use redlease::backend::{Acquire, Attempt, Claim, ClaimKind, NodeTerms, Release};
use redlease::{
    Backend, Error, LeaseKey, LockGuard, LockManager, LockOptions, MemoryBackend, RedisBackend,
    RedisOptions, RetryPolicy, Token,
};
use support::{plain_only, wait_for_async, Checker, RedisServer};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Generous bound for things that must happen "soon": failing it means a hang, not slowness.
const SOON: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(SOON, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {SOON:?}"))
}

/// Where the leases live; on Redis each manager has its own connections, as separate
/// processes would.
enum Store {
    Memory(MemoryBackend),
    Redis(RedisServer),
    #[cfg(feature = "etcd")]
    Etcd(support::EtcdServer),
    #[cfg(feature = "postgres")]
    Postgres(support::PgServer),
}

impl Store {
    fn memory() -> Self {
        Store::Memory(MemoryBackend::new())
    }

    fn redis() -> Self {
        Store::Redis(RedisServer::start())
    }

    #[cfg(feature = "etcd")]
    fn etcd() -> Self {
        Store::Etcd(support::EtcdServer::start())
    }

    #[cfg(feature = "postgres")]
    fn postgres() -> Self {
        Store::Postgres(support::PgServer::start())
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Store::Memory(m) => Arc::new(m.clone()),
            Store::Redis(srv) => {
                let opts = RedisOptions::new().command_timeout(ms(500));
                Arc::new(RedisBackend::connect_with(&srv.url(), opts).await.unwrap())
            }
            #[cfg(feature = "etcd")]
            Store::Etcd(srv) => Arc::new(srv.backend().await),
            #[cfg(feature = "postgres")]
            Store::Postgres(srv) => Arc::new(srv.backend().await),
        }
    }

    async fn manager(&self, options: LockOptions) -> LockManager {
        LockManager::with_options(self.backend().await, options).unwrap()
    }

    /// The length of `key`'s fair queue, where the store lets a test see it.
    fn queued(&self, key: &LeaseKey) -> Option<i64> {
        match self {
            Store::Memory(_) => None,
            Store::Redis(srv) => srv.cmd(&["LLEN", &key.derived("queue")]).as_int(),
            #[cfg(feature = "etcd")]
            Store::Etcd(srv) => Some(srv.queued(key)),
            #[cfg(feature = "postgres")]
            Store::Postgres(srv) => srv
                .psql(&format!(
                    "SELECT count(*) FROM redlease_queue WHERE key = decode('{}', 'hex')",
                    key.as_str()
                        .bytes()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                ))
                .parse()
                .ok(),
        }
    }

    /// Waits until `key`'s queue holds `n` waiters (on Redis; in memory an attempt is queued
    /// by the time its first poll returns, which [`spawn_waiter`] waits for).
    async fn wait_queued(&self, key: &LeaseKey, n: i64) {
        if self.queued(key).is_some() {
            let seen = wait_for_async(SOON, || self.queued(key) == Some(n)).await;
            assert!(seen, "queue length {:?}, expected {n}", self.queued(key));
        }
    }
}

/// Fair locks, 10 s TTL, and a fallback re-check of 30 s: a waiter served within the tests'
/// bounds was woken by the hand-off.
fn fair() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(10))
        .fair(true)
        .retry(RetryPolicy::notify().max_delay(Duration::from_secs(30)))
}

/// A fair claim on `key` by `token`, as a waiter's acquire makes it.
fn fair_claim(key: &LeaseKey, token: &Token, ttl: Duration) -> Claim {
    Claim::new(key.clone(), token.clone(), ttl).kind(ClaimKind::Fair)
}

/// A future that records that it has been polled once.
struct Polled<F> {
    inner: Pin<Box<F>>,
    polled: Arc<AtomicBool>,
}

impl<F: Future> Future for Polled<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let out = self.inner.as_mut().poll(cx);
        self.polled.store(true, Ordering::SeqCst);
        out
    }
}

/// Starts `fut` (an acquire) on its own task and returns once its first poll is done.
async fn start<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let polled = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn(Polled {
        inner: Box::pin(fut),
        polled: polled.clone(),
    });
    assert!(
        wait_for_async(SOON, || polled.load(Ordering::SeqCst)).await,
        "the waiter was never polled"
    );
    task
}

/// Starts a waiter on `lock` and returns once it stands `n`th in the queue.
async fn spawn_waiter(
    store: &Store,
    lock: redlease::Lock,
    n: i64,
) -> tokio::task::JoinHandle<redlease::Result<LockGuard>> {
    let key = lock.key().clone();
    let task = start(async move { lock.acquire().await }).await;
    store.wait_queued(&key, n).await;
    task
}

/// Waiters queued one after another, from three managers, are served in that order, each
/// woken by the previous holder's release.
async fn arrival_order_is_served_across_managers(store: Store) {
    let mut managers = Vec::new();
    for _ in 0..3 {
        managers.push(store.manager(fair()).await);
    }
    let holder = managers[0].lock("order").acquire().await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let lock = managers[(i + 1) % 3].lock("order");
        let waiter = spawn_waiter(&store, lock, i as i64 + 1).await;
        let served = served.clone();
        tasks.push(tokio::spawn(async move {
            let g = waiter.await.unwrap().unwrap();
            served.lock().unwrap().push((i, g.fencing_token()));
            g.release().await.unwrap();
        }));
    }
    // Nobody jumps the queue while the holder is still there.
    assert!(served.lock().unwrap().is_empty());
    let first = holder.fencing_token();
    holder.release().await.unwrap();
    for t in tasks {
        within("every waiter served", t).await.unwrap();
    }
    let served = served.lock().unwrap().clone();
    let order: Vec<usize> = served.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        order,
        (0..6).collect::<Vec<_>>(),
        "served out of arrival order"
    );
    let mut last = first;
    for (i, fence) in served {
        assert!(
            fence > last,
            "waiter {i}: fencing token {fence} after {last}"
        );
        last = fence;
    }
    assert_eq!(
        store
            .queued(&managers[0].lock("order").key().clone())
            .unwrap_or(0),
        0
    );
}

/// try_acquire on a fair lock fails while anyone is queued, even with the lock free; once
/// the queue is empty it succeeds.
async fn try_acquire_fails_while_someone_is_queued(store: Store) {
    let locks = store.manager(fair()).await;
    let lock = locks.lock("try");
    let backend = locks.backend().clone();
    // A waiter that is queued but has not taken the free lock yet (as between a release and
    // the head's attempt).
    let waiter = Token::random();
    // Kept in the queue for 2 × 9.95 s + 100 ms = 20 s without coming back.
    let queued = Attempt::Waiting { recheck: ms(9_950) };
    let ttl = Duration::from_secs(10);
    let waiter = fair_claim(lock.key(), &waiter, ttl);
    let holder = lock.try_acquire().await.unwrap().expect("free");
    let reply = backend
        .acquire(&waiter, queued, NodeTerms::new())
        .await
        .unwrap();
    assert!(matches!(reply, Acquire::Held { .. }), "{reply:?}");
    holder.release().await.unwrap();
    assert!(
        lock.try_acquire().await.unwrap().is_none(),
        "try_acquire took a free lock from under a queued waiter"
    );
    // The waiter leaves (it gave up): the lock is for anyone again.
    backend.release(&waiter, Release::Abandon).await.unwrap();
    let g = lock.try_acquire().await.unwrap();
    assert!(g.is_some(), "the queue is empty, the lock free");
}

/// A waiter whose acquire future is dropped, and one whose acquire times out, leave the
/// queue at once: the waiter behind them is served on the holder's release, long before
/// their deadlines (2 × 30 s + 100 ms here) could evict them.
async fn waiters_that_give_up_leave_the_queue_at_once(store: Store) {
    let a = store.manager(fair()).await;
    let b = store.manager(fair()).await;
    let holder = a.lock("leave").acquire().await.unwrap();
    let key = holder_key(&a, "leave");
    let dropped = spawn_waiter(&store, b.lock("leave"), 1).await;
    let timing_out = b.lock("leave");
    let timed_out = start(async move { timing_out.acquire_timeout(ms(300)).await }).await;
    store.wait_queued(&key, 2).await;
    let last = spawn_waiter(&store, a.lock("leave"), 3).await;
    dropped.abort();
    let err = within("the timeout", timed_out).await.unwrap().unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    store.wait_queued(&key, 1).await;
    let released = Instant::now();
    holder.release().await.unwrap();
    let g = within("the last waiter", last).await.unwrap().unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "served after {:?}: the waiters that gave up were still queued",
        released.elapsed()
    );
    g.release().await.unwrap();
    assert!(a.lock("leave").try_acquire().await.unwrap().is_some());
}

/// The head of the queue gives up while the lock is free (between a release and its own
/// attempt): the next waiter is woken at once, not after the fallback re-check.
async fn head_leaving_a_free_lock_wakes_the_next(store: Store) {
    let a = store.manager(fair()).await;
    let b = store.manager(fair()).await;
    let lock = a.lock("head-leaves");
    let key = lock.key().clone();
    let backend = a.backend().clone();
    let holder = lock.acquire().await.unwrap();
    // The head: a waiter that will not act on its hand-off (it is about to give up).
    let head = fair_claim(&key, &Token::random(), Duration::from_secs(10));
    // Kept in the queue for 2 × 9.95 s + 100 ms = 20 s without coming back.
    let queued = Attempt::Waiting { recheck: ms(9_950) };
    let reply = backend
        .acquire(&head, queued, NodeTerms::new())
        .await
        .unwrap();
    assert!(matches!(reply, Acquire::Held { .. }));
    let next = spawn_waiter(&store, b.lock("head-leaves"), 2).await;
    holder.release().await.unwrap();
    // Free, the head has not taken it: the next waiter must not be served yet.
    tokio::time::sleep(ms(100)).await; // time passing is what is under test
    assert!(!next.is_finished(), "a waiter was served ahead of the head");
    let left = Instant::now();
    backend.release(&head, Release::Abandon).await.unwrap();
    let g = within("the next waiter", next).await.unwrap().unwrap();
    assert!(
        left.elapsed() < Duration::from_secs(5),
        "{:?}",
        left.elapsed()
    );
    g.release().await.unwrap();
}

fn holder_key(locks: &LockManager, name: &str) -> LeaseKey {
    locks.lock(name).key().clone()
}

/// A waiter that stops coming back (its process froze or died: the acquire future is never
/// polled again, and never dropped) is evicted after its short deadline, and the waiter
/// behind it is served.
async fn crashed_waiter_is_evicted_and_the_next_is_served(store: Store) {
    let a = store.manager(fair()).await;
    // The crashing waiter re-checks every 100 ms, so the store drops it 300 ms after it was
    // last heard from.
    let crashing = store
        .manager(fair().retry(RetryPolicy::notify().max_delay(ms(100))))
        .await;
    let c = store
        .manager(fair().retry(RetryPolicy::notify().max_delay(ms(200))))
        .await;
    let holder = a.lock("crash").acquire().await.unwrap();
    let key = holder_key(&a, "crash");
    // Polled once (it joins the queue), then frozen forever.
    let lock = crashing.lock("crash");
    let mut frozen = Box::pin(async move { lock.acquire().await });
    let polled = futures::poll!(frozen.as_mut());
    assert!(polled.is_pending());
    store.wait_queued(&key, 1).await;
    std::mem::forget(frozen);
    let next = spawn_waiter(&store, c.lock("crash"), 2).await;
    let released = Instant::now();
    holder.release().await.unwrap();
    let g = within("the waiter behind the dead one", next)
        .await
        .unwrap()
        .unwrap();
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the dead waiter held the queue up for {took:?} (its deadline is 300 ms)"
    );
    g.release().await.unwrap();
    assert_eq!(
        store.queued(&key).unwrap_or(0),
        0,
        "the dead waiter is gone"
    );
}

/// A crashed holder (no release ever comes) frees the lock by its TTL, and the queue's head
/// is served next, then the one behind it.
async fn crashed_holder_frees_by_ttl_and_the_head_is_served_next(store: Store) {
    let a = store.manager(fair().ttl(ms(300))).await;
    let b = store.manager(fair()).await;
    let c = store.manager(fair()).await;
    let crashed = a.lock("dead-holder").acquire().await.unwrap();
    let expires = Instant::now() + ms(300);
    let fence = crashed.forget(); // as if the process died: no release, no watchdog
    let first = spawn_waiter(&store, b.lock("dead-holder"), 1).await;
    let second = spawn_waiter(&store, c.lock("dead-holder"), 2).await;
    let g = within("the head after the TTL", first)
        .await
        .unwrap()
        .unwrap();
    assert!(
        Instant::now() >= expires - ms(20),
        "served before the lease ran out"
    );
    assert!(
        Instant::now() < expires + Duration::from_secs(2),
        "the head waited long past the TTL"
    );
    assert!(g.fencing_token() > fence);
    assert!(!second.is_finished(), "the second waiter overtook the head");
    g.release().await.unwrap();
    let g2 = within("the second waiter", second).await.unwrap().unwrap();
    g2.release().await.unwrap();
}

/// 16 tasks over 4 managers on one key: never two holders, fencing tokens increase, and
/// FIFO keeps every task's count within a couple of the others'.
async fn sixteen_tasks_on_one_key_never_overlap(store: Store) {
    let checker = Checker::new();
    let counts: Arc<Vec<std::sync::atomic::AtomicU64>> =
        Arc::new((0..16).map(|_| Default::default()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let first_finish = Arc::new(Mutex::new(None::<Vec<u64>>));
    // Every task starts once all managers are connected, and queues behind a first holder:
    // the count starts once all 16 stand in the queue (a task the scheduler starts late
    // would otherwise join the queue rounds after the others, fairly, but behind).
    let go = Arc::new(tokio::sync::Barrier::new(17));
    let gate = store.manager(fair().ttl(Duration::from_secs(2))).await;
    let first = gate.lock("sixteen").acquire().await.unwrap();
    let mut tasks = Vec::new();
    for m in 0..4 {
        let locks = store.manager(fair().ttl(Duration::from_secs(2))).await;
        for t in 0..4 {
            let me = m * 4 + t;
            let (locks, checker, counts, stop, first_finish, go) = (
                locks.clone(),
                checker.clone(),
                counts.clone(),
                stop.clone(),
                first_finish.clone(),
                go.clone(),
            );
            tasks.push(tokio::spawn(async move {
                go.wait().await;
                while !stop.load(Ordering::SeqCst) {
                    let g = locks.lock("sixteen").acquire().await.unwrap();
                    let section = checker.enter(g.fencing_token());
                    tokio::task::yield_now().await;
                    let n = counts[me].fetch_add(1, Ordering::SeqCst) + 1;
                    section.exit();
                    g.release().await.unwrap();
                    if n >= 12 {
                        let mut f = first_finish.lock().unwrap();
                        if f.is_none() {
                            *f = Some(counts.iter().map(|c| c.load(Ordering::SeqCst)).collect());
                        }
                        stop.store(true, Ordering::SeqCst);
                    }
                }
            }));
        }
    }
    go.wait().await;
    let began = Instant::now();
    loop {
        let info = gate.lock("sixteen").inspect().await.unwrap();
        if info.is_some_and(|i| i.queue_len == 16) {
            break;
        }
        assert!(began.elapsed() < SOON, "the 16 tasks did not all queue");
        tokio::task::yield_now().await;
    }
    first.release().await.unwrap();
    for t in tasks {
        within("worker", t).await.unwrap();
    }
    checker.assert_ok();
    let snapshot = first_finish.lock().unwrap().clone().unwrap();
    let (max, min) = (
        *snapshot.iter().max().unwrap(),
        *snapshot.iter().min().unwrap(),
    );
    assert!(
        max - min <= 2,
        "unfair: counts at the first finish {snapshot:?}"
    );
}

/// Fair and plain acquirers of one name take the same lease: each excludes the other, and a
/// plain holder's release hands the lock to the fair queue's head.
async fn fair_and_plain_exclude_each_other(store: Store) {
    let plain_opts = LockOptions::new().ttl(Duration::from_secs(10));
    let fair_locks = store.manager(fair()).await;
    let plain_locks = store.manager(plain_opts.clone()).await;
    let f = fair_locks.lock("mixed");
    let p = plain_locks.lock("mixed");
    let held = f.acquire().await.unwrap();
    assert!(p.try_acquire().await.unwrap().is_none());
    held.release().await.unwrap();
    let held = p.acquire().await.unwrap();
    assert!(f.try_acquire().await.unwrap().is_none());
    // A fair waiter is woken by the plain holder's release (its fallback is 30 s).
    let waiter = spawn_waiter(&store, f.clone(), 1).await;
    held.release().await.unwrap();
    within("the fair waiter", waiter)
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();

    // Both kinds at once on one key.
    let checker = Checker::new();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let lock = if i % 2 == 0 { f.clone() } else { p.clone() };
        let checker = checker.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..6 {
                let g = lock.acquire().await.unwrap();
                let section = checker.enter(g.fencing_token());
                tokio::task::yield_now().await;
                section.exit();
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        within("worker", t).await.unwrap();
    }
    assert_eq!(checker.sections(), 48);
    checker.assert_ok();
}

macro_rules! both {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Store::memory()).await
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Store::redis()).await
                }
            )*
        }
        #[cfg(feature = "etcd")]
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Store::etcd()).await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Store::postgres()).await
                }
            )*
        }
    };
}

both!(
    arrival_order_is_served_across_managers,
    try_acquire_fails_while_someone_is_queued,
    waiters_that_give_up_leave_the_queue_at_once,
    head_leaving_a_free_lock_wakes_the_next,
    crashed_waiter_is_evicted_and_the_next_is_served,
    crashed_holder_frees_by_ttl_and_the_head_is_served_next,
    sixteen_tasks_on_one_key_never_overlap,
    fair_and_plain_exclude_each_other,
);

// ---------------------------------------------------------------------------------------
// Redis only: what the server sees.
// ---------------------------------------------------------------------------------------

/// A release wakes only the head: with 8 waiters queued, the hand-off costs the release and
/// the head's one attempt, and no other waiter sends anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_off_wakes_only_the_head() {
    let store = Store::redis();
    let Store::Redis(srv) = &store else {
        unreachable!()
    };
    let opts = fair().ttl(Duration::from_secs(60)); // no watchdog round during the test
    let holder_locks = store.manager(opts.clone()).await;
    let holder = holder_locks.lock("herd").acquire().await.unwrap();
    let key = holder.name().to_owned();
    let key = holder_locks.lock(&key).key().clone();
    let mut waiters = Vec::new();
    for i in 0..8 {
        let locks = store.manager(opts.clone()).await;
        waiters.push(spawn_waiter(&store, locks.lock("herd"), i + 1).await);
    }
    // Every waiter has subscribed and made its re-check: the script count settles.
    let mut last = srv.script_calls();
    let settled = wait_for_async(SOON, || {
        std::thread::sleep(ms(50)); // a quiet interval, read off the server
        let now = srv.script_calls();
        std::mem::replace(&mut last, now) == now
    })
    .await;
    assert!(settled, "waiters kept sending scripts");
    let before = srv.script_calls();
    holder.release().await.unwrap();
    let head = waiters.remove(0);
    let g = within("the head", head).await.unwrap().unwrap();
    // Give any herd time to show on the server.
    tokio::time::sleep(ms(200)).await;
    let calls = srv.script_calls() - before;
    assert_eq!(
        calls, 2,
        "a hand-off should be the release plus the head's attempt, saw {calls} script calls"
    );
    assert!(waiters.iter().all(|w| !w.is_finished()));
    assert_eq!(store.queued(&key), Some(7));
    g.release().await.unwrap();
    for w in waiters {
        within("the rest", w)
            .await
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}

/// A lost wake-up (the lease deleted behind everyone's back: no release, no message) is
/// covered by the bounded fallback re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_wake_up_is_covered_by_the_fallback() {
    let store = Store::redis();
    let Store::Redis(srv) = &store else {
        unreachable!()
    };
    let a = store.manager(fair()).await;
    let b = store
        .manager(fair().retry(RetryPolicy::notify().max_delay(ms(300))))
        .await;
    let holder = a.lock("lost-msg").acquire().await.unwrap();
    let key = holder_key(&a, "lost-msg");
    let waiter = spawn_waiter(&store, b.lock("lost-msg"), 1).await;
    let deleted = Instant::now();
    assert_eq!(srv.cmd(&["DEL", key.as_str()]).as_int(), Some(1));
    let g = within("the waiter", waiter).await.unwrap().unwrap();
    assert!(
        deleted.elapsed() < ms(300) + ms(500),
        "fallback took {:?}",
        deleted.elapsed()
    );
    assert!(g.fencing_token() > holder.fencing_token());
    holder.forget();
}

/// The queue's keys live under the lock's hash tag and vanish once their waiters are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_keys_share_the_hash_tag_and_expire() {
    let store = Store::redis();
    let Store::Redis(srv) = &store else {
        unreachable!()
    };
    let locks = store.manager(fair()).await;
    let lock = locks.lock("tag{x}");
    let backend = locks.backend().clone();
    let holder = lock.acquire().await.unwrap();
    let ghost = fair_claim(lock.key(), &Token::random(), Duration::from_secs(10));
    // Kept in the queue for 2 × 50 ms + 100 ms = 200 ms without coming back.
    let queued = Attempt::Waiting { recheck: ms(50) };
    backend
        .acquire(&ghost, queued, NodeTerms::new())
        .await
        .unwrap();
    let queue = lock.key().derived("queue");
    let timeouts = lock.key().derived("timeouts");
    assert_eq!(queue, "redlease:{tag%7Bx%7D}:queue");
    assert_eq!(srv.cmd(&["LLEN", &queue]).as_int(), Some(1));
    assert_eq!(srv.cmd(&["ZCARD", &timeouts]).as_int(), Some(1));
    let pttl = srv.cmd(&["PTTL", &queue]).as_int().unwrap();
    assert!(pttl > 0 && pttl <= 1200, "queue PTTL {pttl}");
    let gone = wait_for_async(SOON, || {
        srv.cmd(&["EXISTS", &queue, &timeouts]).as_int() == Some(0)
    })
    .await;
    assert!(gone, "the abandoned queue keys never expired");
    holder.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// A backend without fair locks.
// ---------------------------------------------------------------------------------------

// (`support::plain_only`.)

/// Refused when the lock is made, by every way of making a fair lock.
#[tokio::test]
async fn fair_over_an_unsupported_backend_is_unsupported() {
    let store = plain_only();
    let locks = LockManager::new(store.clone());
    for result in [
        locks.lock("x").fair().map(drop),
        locks.lock_with("x", |o| o.fair(true)).map(drop),
        LockManager::with_options(store.clone(), LockOptions::new().fair(true)).map(drop),
    ] {
        match result {
            Err(Error::Unsupported(msg)) => {
                assert!(msg.contains("fair (FIFO) locks are not supported"), "{msg}");
                assert!(msg.contains("PlainOnly"), "names the backend: {msg}");
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }
    // The plain lock on the same backend works, and nothing was left behind.
    let g = locks.lock("x").try_acquire().await.unwrap();
    assert!(g.is_some());
}

/// Refused when the lock is made, by every way of making a fair lock.
#[tokio::test]
async fn fair_over_redlock_is_unsupported_and_says_so() {
    let nodes: Vec<MemoryBackend> = (0..3).map(|_| MemoryBackend::new()).collect();
    let redlock = || redlease::Redlock::new(nodes.iter().cloned()).unwrap();
    let locks = LockManager::new(redlock());
    for result in [
        locks.lock("x").fair().map(drop),
        locks.lock_with("x", |o| o.fair(true)).map(drop),
        LockManager::with_options(redlock(), LockOptions::new().fair(true)).map(drop),
    ] {
        match result {
            Err(Error::Unsupported(msg)) => {
                assert!(msg.contains("fair (FIFO) locks are not supported"), "{msg}");
                assert!(msg.contains("Redlock"), "names the backend: {msg}");
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }
    // Nothing was queued or held: the plain lock is free.
    assert!(locks.lock("x").try_acquire().await.unwrap().is_some());
}
