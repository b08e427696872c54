//! Multi-locks (`LockManager::lock_all`, `MultiLock::of`): several locks taken in one global
//! order, all or nothing, on a real redis-server (each manager on connections of its own, as
//! separate processes would be), in memory, and on a Redis Cluster.
//!
//! Every wait is bounded: a hang fails the test instead of stalling it.

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use redlease::{
    Error, LockGuard, LockManager, LockOptions, MemoryBackend, MultiGuard, MultiLock, RedisBackend,
    RedisOptions, RetryPolicy,
};
use support::{wait_for_async, within, Checker, RedisCluster, RedisServer, SOON};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The wait of each multi-lock acquire in the no-deadlock runs: it never fires unless the
/// callers deadlock (each critical section lasts a few yields).
const NEVER: Duration = Duration::from_secs(10);

async fn connect(srv: &RedisServer) -> RedisBackend {
    RedisBackend::connect_with(&srv.url(), RedisOptions::new().command_timeout(ms(500)))
        .await
        .expect("connect")
}

/// A manager on connections of its own (a process of its own).
async fn manager(srv: &RedisServer, options: LockOptions) -> LockManager {
    LockManager::with_options(connect(srv).await, options).expect("options")
}

/// Long leases: a lock found free was released, not run out.
fn opts() -> LockOptions {
    LockOptions::new().ttl(Duration::from_secs(10))
}

/// Whether the store says `name` is held now.
async fn is_held(locks: &LockManager, name: &str) -> bool {
    locks
        .lock(name)
        .inspect()
        .await
        .expect("inspect")
        .is_some_and(|i| i.held)
}

/// The last fencing token the store minted for `name` (`None`: never taken).
async fn last_fence(locks: &LockManager, name: &str) -> Option<u64> {
    locks
        .lock(name)
        .inspect()
        .await
        .expect("inspect")
        .and_then(|i| i.fencing_token)
}

/// Polls `cond` (an async look at the store) every 5 ms until it is true or `timeout` passes;
/// whether it became true.
async fn eventually<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(ms(5)).await;
    }
}

/// Takes `name` at once through a manager that is not the one under test (panics if held).
async fn take(locks: &LockManager, name: &str) -> LockGuard {
    support::take(locks, name).await
}

/// A tiny deterministic generator (xorshift64*), seeded per task, so a failing run can be
/// told apart by its printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A random subset of `names`, of two or more, in a random order.
    fn subset<'a>(&mut self, names: &[&'a str]) -> Vec<&'a str> {
        let mut all = names.to_vec();
        for i in (1..all.len()).rev() {
            all.swap(i, self.below(i + 1));
        }
        let len = 2 + self.below(all.len() - 1);
        all.truncate(len);
        all
    }
}

fn seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    nanos | 1
}

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

fn index(name: &str) -> usize {
    NAMES
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("unexpected lock {name}"))
}

/// What a run of callers did.
#[derive(Debug, Default)]
struct Figures {
    rounds: usize,
    completed: usize,
    timeouts: usize,
    longest_wait: Duration,
}

impl Figures {
    fn add(&mut self, other: Figures) {
        self.rounds += other.rounds;
        self.completed += other.completed;
        self.timeouts += other.timeouts;
        self.longest_wait = self.longest_wait.max(other.longest_wait);
    }
}

/// Holds `held` as a critical section of each of its locks (one checker per name), for a few
/// yields, then releases it all.
async fn critical_section(held: MultiGuard, checkers: &[Checker]) {
    let sections: Vec<_> = held
        .guards()
        .iter()
        .map(|g| checkers[index(g.name())].enter(g.fencing_token()))
        .collect();
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    drop(sections);
    held.release()
        .await
        .expect("release a multi-lock held throughout");
}

/// One caller's loop: `rounds` multi-lock acquires of the sets `pick` gives, each waiting at most
/// [`NEVER`].
async fn caller(
    locks: LockManager,
    rounds: usize,
    checkers: Arc<Vec<Checker>>,
    mut pick: impl FnMut() -> Vec<&'static str>,
) -> Figures {
    let mut figures = Figures::default();
    for _ in 0..rounds {
        let set = pick();
        let started = Instant::now();
        figures.rounds += 1;
        match locks.lock_all(&set).acquire_timeout(NEVER).await {
            Ok(held) => {
                figures.longest_wait = figures.longest_wait.max(started.elapsed());
                let got: Vec<&str> = held.guards().iter().map(|g| g.name()).collect();
                let mut want = set.clone();
                want.sort_unstable();
                assert_eq!(got, want, "the guards of {set:?}");
                critical_section(held, &checkers).await;
                figures.completed += 1;
            }
            Err(Error::Timeout { .. }) => figures.timeouts += 1,
            Err(e) => panic!("{set:?}: {e}"),
        }
    }
    figures
}

/// Callers on `managers` (round-robin) asking for overlapping sets in opposite and random
/// orders: a, b, c; c, b, a; and random subsets of a, b, c, d in random orders. Every round
/// must complete (a deadlock would show as timeouts) with no overlap on any name.
async fn opposite_and_random_orders(managers: &[LockManager], rounds: usize) -> Figures {
    let checkers: Arc<Vec<Checker>> = Arc::new(NAMES.iter().map(|_| Checker::new()).collect());
    let base = seed();
    println!("  seed {base:#x}");
    let mut tasks = Vec::new();
    for t in 0..4usize {
        let locks = managers[t % managers.len()].clone();
        let checkers = checkers.clone();
        let task_seed = base ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = Rng(task_seed | 1);
        tasks.push(tokio::spawn(async move {
            caller(locks, rounds, checkers, move || match t {
                0 => vec!["a", "b", "c"],
                1 => vec!["c", "b", "a"],
                _ => rng.subset(&NAMES),
            })
            .await
        }));
    }
    let mut figures = Figures::default();
    let mut fixed_orders = 0;
    for (t, task) in tasks.into_iter().enumerate() {
        let one = task.await.expect("caller task");
        if t < 2 {
            fixed_orders += one.completed;
        }
        figures.add(one);
    }
    for (name, checker) in NAMES.iter().zip(checkers.iter()) {
        println!(
            "  lock {name}: {} critical sections, {} overlaps",
            checker.sections(),
            checker.violations()
        );
        assert_eq!(checker.violations(), 0, "overlaps on {name}");
        assert_eq!(checker.inside(), 0, "{name}: a section never ended");
        if checker.sections() > 0 {
            checker.assert_ok();
        }
    }
    // a, b and c are in both fixed orders' sets, so each saw at least their holds.
    for name in ["a", "b", "c"] {
        assert!(
            checkers[index(name)].sections() >= fixed_orders,
            "{name}: {} sections",
            checkers[index(name)].sections()
        );
    }
    println!("  {figures:?}");
    figures
}

/// Two callers in one task, polled in turn (`join!`), asking for a, b, c and for c, b, a
/// through `take` and holding all for a few yields: the interleaving a deadlock needs.
/// Returns how many of the `rounds` × 2 acquires timed out.
async fn lockstep<F, Fut>(rounds: usize, take: F) -> usize
where
    F: Fn(usize, [&'static str; 3]) -> Fut,
    Fut: Future<Output = Result<Vec<LockGuard>, Error>>,
{
    let hold = |set: [&'static str; 3], who: usize| {
        let attempt = take(who, set);
        async move {
            match attempt.await {
                Ok(guards) => {
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    for g in guards {
                        g.release().await.expect("release");
                    }
                    0
                }
                Err(Error::Timeout { .. }) => 1,
                Err(e) => panic!("{set:?}: {e}"),
            }
        }
    };
    let mut timeouts = 0;
    for _ in 0..rounds {
        let (x, y) = tokio::join!(hold(["a", "b", "c"], 0), hold(["c", "b", "a"], 1));
        timeouts += x + y;
    }
    timeouts
}

/// The control: the locks taken one by one in the caller's own order, each waiting at most
/// `wait`, the ones taken given back on a timeout.
async fn one_by_one(
    locks: &LockManager,
    order: [&str; 3],
    wait: Duration,
) -> Result<Vec<LockGuard>, Error> {
    let mut held = Vec::new();
    for name in order {
        match locks.lock(name).acquire_timeout(wait).await {
            Ok(g) => {
                held.push(g);
                tokio::task::yield_now().await;
            }
            Err(e) => {
                for g in held {
                    g.release().await.expect("give back");
                }
                return Err(e);
            }
        }
    }
    Ok(held)
}

/// Runs the multi-lock in lockstep (no timeout allowed), then the one-by-one control in the
/// same lockstep (timeouts expected: it deadlocks), on the two managers given.
async fn lockstep_multi_vs_one_by_one(managers: [&LockManager; 2], rounds: usize) {
    let started = Instant::now();
    let multi = lockstep(rounds, |who, set| {
        let lock = managers[who].lock_all(set);
        async move {
            lock.acquire_timeout(NEVER)
                .await
                .map(MultiGuard::into_guards)
        }
    })
    .await;
    let multi_time = started.elapsed();
    let control_rounds = 10;
    let started = Instant::now();
    let control = lockstep(control_rounds, |who, set| {
        let locks = managers[who].clone();
        async move { one_by_one(&locks, set, ms(100)).await }
    })
    .await;
    println!(
        "  lockstep a,b,c vs c,b,a: multi-lock {multi} timeouts in {} acquires ({multi_time:?}); \
         one by one (100 ms waits) {control} timeouts in {} acquires ({:?})",
        2 * rounds,
        2 * control_rounds,
        started.elapsed()
    );
    assert_eq!(multi, 0, "the multi-lock deadlocked in lockstep");
    assert!(
        control > 0,
        "the control never deadlocked: the lockstep does not exercise opposite orders"
    );
}

// 1. No deadlock in opposite orders, on Redis.

/// Four callers on three managers (processes) loop over a, b, c / c, b, a / random subsets in
/// random orders, hundreds of rounds each: none of the 10 s waits fires and no two holders of
/// one name overlap. In lockstep (the two opposite callers polled in turn) the multi-lock
/// still never times out, while taking the same locks one by one in the callers' orders does
/// deadlock (and time out): the contrast is real.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_never_deadlock_on_redis() {
    let srv = RedisServer::start();
    let mut managers = Vec::new();
    for _ in 0..3 {
        managers.push(manager(&srv, opts()).await);
    }
    let started = Instant::now();
    let rounds = 200;
    println!("redis, 4 callers × {rounds} rounds:");
    let figures = opposite_and_random_orders(&managers, rounds).await;
    println!("  took {:?}", started.elapsed());
    assert_eq!(figures.timeouts, 0, "deadlock: {figures:?}");
    assert_eq!(figures.completed, 4 * rounds, "{figures:?}");
    lockstep_multi_vs_one_by_one([&managers[0], &managers[1]], 60).await;
}

// 9. The same in memory.

/// As on Redis, smaller, with managers on clones of one in-memory store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_never_deadlock_in_memory() {
    let store = MemoryBackend::new();
    let managers: Vec<LockManager> = (0..3)
        .map(|_| LockManager::with_options(store.clone(), opts()).expect("options"))
        .collect();
    let started = Instant::now();
    let rounds = 150;
    println!("memory, 4 callers × {rounds} rounds:");
    let figures = opposite_and_random_orders(&managers, rounds).await;
    println!("  took {:?}", started.elapsed());
    assert_eq!(figures.timeouts, 0, "deadlock: {figures:?}");
    assert_eq!(figures.completed, 4 * rounds, "{figures:?}");
    lockstep_multi_vs_one_by_one([&managers[0], &managers[1]], 50).await;
}

// 2. All or nothing.

/// "c" held by another process: a multi-lock of a, b, c, d times out, and a and b (taken
/// before it) are free the moment the error returns, long before their 10 s TTL; d was never
/// touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_gives_back_what_was_taken() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    let locks = manager(&srv, opts()).await;
    let held_c = take(&other, "c").await;
    let before_a = last_fence(&other, "a").await;

    let started = Instant::now();
    let err = within(
        "the timeout",
        locks
            .lock_all(["d", "c", "b", "a"])
            .acquire_timeout(ms(300)),
    )
    .await
    .expect_err("c is held");
    let waited = started.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(waited >= ms(290), "gave up after {waited:?}");
    assert!(waited < ms(3_000), "gave up after {waited:?}");
    // a was taken (its fencing counter moved) and is free again, at once.
    assert_ne!(last_fence(&other, "a").await, before_a, "a was never taken");
    for name in ["a", "b", "d"] {
        assert!(!is_held(&other, name).await, "{name} still held");
    }
    assert_eq!(last_fence(&other, "d").await, None, "d (after c) was taken");
    for name in ["a", "b", "d"] {
        let g = other.lock(name).try_acquire().await.expect("try");
        assert!(g.is_some(), "{name} is not free after the timeout");
    }
    held_c.release().await.expect("release c");
}

/// The limit of `acquire` is the smallest `wait_timeout` of the locks' options: a lock with
/// none (waiting forever on its own) is waited for no longer than its neighbour allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_is_bounded_by_the_smallest_wait_timeout() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    let locks = manager(&srv, opts()).await;
    let _held_a = take(&other, "a").await;
    let patient = locks.lock("a");
    let hasty = locks
        .lock_with("b", |o| o.wait_timeout(Some(ms(300))))
        .expect("options");
    let in_between = locks
        .lock_with("c", |o| o.wait_timeout(Some(ms(5_000))))
        .expect("options");
    assert_eq!(patient.options().wait_timeout, None);
    let started = Instant::now();
    let err = within(
        "the smallest wait_timeout",
        MultiLock::of([in_between, hasty, patient]).acquire(),
    )
    .await
    .expect_err("a is held");
    let waited = started.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        waited >= ms(290) && waited < ms(3_000),
        "waited {waited:?} for a wait_timeout of 300 ms"
    );
    for name in ["b", "c"] {
        assert!(!is_held(&other, name).await, "{name} held");
    }
}

// 3. try_acquire.

/// One lock of the set held elsewhere: `try_acquire` answers `None` at once, holding none
/// (those before it in the order were taken and given back); once it is free, all are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_holds_nothing_when_one_is_held() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    let locks = manager(&srv, opts()).await;
    let held_b = take(&other, "b").await;
    let multi = locks.lock_all(["c", "b", "a"]);
    let before_a = last_fence(&other, "a").await;
    let started = Instant::now();
    let got = within("try_acquire", multi.try_acquire())
        .await
        .expect("try_acquire");
    assert!(got.is_none(), "got {got:?} with b held");
    assert!(started.elapsed() < ms(2_000), "{:?}", started.elapsed());
    assert_ne!(last_fence(&other, "a").await, before_a, "a was never tried");
    for name in ["a", "c"] {
        assert!(!is_held(&other, name).await, "{name} held after Ok(None)");
    }
    held_b.release().await.expect("release b");
    let all = multi.try_acquire().await.expect("try").expect("all free");
    assert_eq!(all.guards().len(), 3);
    for name in ["a", "b", "c"] {
        assert!(is_held(&other, name).await, "{name} not held");
        assert!(other.lock(name).try_acquire().await.expect("try").is_none());
    }
    all.release().await.expect("release");
}

// 4. Cancel safety.

/// An acquire that holds a and waits for b (held elsewhere) is dropped: a is free again within
/// a few hundred ms (its TTL is 10 s), and when b is released later nothing takes it: the
/// dropped waiter left nothing behind (its fencing counter does not move).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_acquire_gives_back_what_it_took() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    // A short fallback re-check: a waiter left running would try b again within 50 ms.
    let locks = manager(&srv, opts().retry(RetryPolicy::notify().max_delay(ms(50)))).await;
    let held_b = take(&other, "b").await;
    let b_fence = held_b.fencing_token();
    let key_a = other.lock("a").key().as_str().to_owned();
    let key_b = other.lock("b").key().as_str().to_owned();

    let multi = locks.lock_all(["b", "a"]);
    let waiter = tokio::spawn(async move { multi.acquire().await });
    // It holds a and waits for b (registered for b's release message).
    assert!(
        wait_for_async(SOON, || support::held(&srv, &key_a)).await,
        "the acquire never took a"
    );
    assert!(
        wait_for_async(SOON, || support::field(&srv, &key_b, "w").is_some()).await,
        "the acquire never waited for b"
    );
    assert!(!waiter.is_finished());
    waiter.abort();
    let dropped = Instant::now();
    let outcome = within("the abort", waiter).await;
    assert!(
        outcome.as_ref().is_err_and(|e| e.is_cancelled()),
        "{outcome:?}"
    );
    assert!(
        wait_for_async(ms(500), || !support::held(&srv, &key_a)).await,
        "a still held {:?} after the acquire was dropped ({} ms left of its lease)",
        dropped.elapsed(),
        support::lease_ms(&srv, &key_a)
    );
    println!("a free {:?} after the drop", dropped.elapsed());
    assert!(
        other.lock("a").try_acquire().await.expect("try").is_some(),
        "a is not free"
    );

    held_b.release().await.expect("release b");
    // Nothing takes b: for 300 ms (six fallback re-checks of the dropped waiter) it stays free.
    assert!(
        !wait_for_async(ms(300), || support::held(&srv, &key_b)).await,
        "b was taken after its release: the dropped acquire was still waiting"
    );
    assert_eq!(
        last_fence(&other, "b").await,
        Some(b_fence),
        "b was granted again after the drop"
    );
    assert!(other.lock("b").try_acquire().await.expect("try").is_some());
}

/// The same, dropped by a timeout wrapper (`tokio::time::timeout`) instead of an abort, while
/// it waits for the third of three locks: the two taken are free promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_wrapper_drops_the_acquire_cleanly() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    let locks = manager(&srv, opts()).await;
    let held_c = take(&other, "c").await;
    let c_fence = held_c.fencing_token();
    let outer = tokio::time::timeout(ms(300), locks.lock_all(["a", "b", "c"]).acquire()).await;
    assert!(outer.is_err(), "the acquire returned {outer:?} with c held");
    let dropped = Instant::now();
    for name in ["a", "b"] {
        let key = other.lock(name).key().as_str().to_owned();
        assert!(
            wait_for_async(ms(500), || !support::held(&srv, &key)).await,
            "{name} still held {:?} after the drop",
            dropped.elapsed()
        );
    }
    held_c.release().await.expect("release c");
    let key_c = other.lock("c").key().as_str().to_owned();
    assert!(
        !wait_for_async(ms(300), || support::held(&srv, &key_c)).await,
        "c was taken after its release by the dropped acquire"
    );
    assert_eq!(last_fence(&other, "c").await, Some(c_fence));
}

// 5. The guard.

/// Guards in the global order whatever the order given; `get`; a fencing token per lock (the
/// store's last, growing from one hold to the next); drop releases all; `release` too, at once;
/// `into_guards` hands them out one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_names_orders_fences_and_releases_its_locks() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    let locks = manager(&srv, opts()).await;
    let given = ["m", "b", "x", "a"];
    let mut sorted = given.to_vec();
    sorted.sort_unstable();

    let multi = locks.lock_all(given);
    let order: Vec<&str> = multi.locks().iter().map(|l| l.name()).collect();
    assert_eq!(order, sorted, "the order of the locks");
    let held = multi.acquire_timeout(SOON).await.expect("acquire");
    let names: Vec<&str> = held.guards().iter().map(|g| g.name()).collect();
    assert_eq!(names, sorted, "the order of the guards");
    for name in given {
        let g = held.get(name).unwrap_or_else(|| panic!("get({name})"));
        assert_eq!(g.name(), name);
        assert!(!g.is_lost());
    }
    assert!(held.get("y").is_none());
    assert!(!held.is_lost());
    let first = held.fencing_tokens();
    assert_eq!(first.len(), 4);
    for (g, t) in held.guards().iter().zip(&first) {
        assert_eq!(g.fencing_token(), *t, "{}", g.name());
        assert_eq!(
            last_fence(&other, g.name()).await,
            Some(*t),
            "{}: the store's token",
            g.name()
        );
        assert!(other
            .lock(g.name())
            .try_acquire()
            .await
            .expect("try")
            .is_none());
    }

    // Dropped: all are released in the background.
    drop(held);
    for name in given {
        assert!(
            eventually(ms(2_000), || async { !is_held(&other, name).await }).await,
            "{name} still held after the drop"
        );
    }

    // Taken again (given in another order): larger tokens, each its lock's.
    let held = locks
        .lock_all(["a", "x", "b", "m"])
        .acquire_timeout(SOON)
        .await
        .expect("acquire again");
    let second = held.fencing_tokens();
    for ((g, t1), t2) in held.guards().iter().zip(&first).zip(&second) {
        assert!(t2 > t1, "{}: token {t2} after {t1}", g.name());
    }
    held.release().await.expect("release");
    for name in given {
        assert!(!is_held(&other, name).await, "{name} held after release()");
    }

    // One by one.
    let held = locks
        .lock_all(["b", "a"])
        .acquire_timeout(SOON)
        .await
        .expect("acquire");
    let mut guards = held.into_guards();
    assert_eq!(
        guards.iter().map(|g| g.name()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    let b = guards.pop().expect("b");
    b.release().await.expect("release b");
    assert!(!is_held(&other, "b").await);
    assert!(is_held(&other, "a").await, "a went with b");
    drop(guards);
    assert!(
        eventually(ms(2_000), || async { !is_held(&other, "a").await }).await,
        "a still held after its guard was dropped"
    );
}

// 6. lost().

/// One key of a held multi-lock deleted behind its back: its next extension finds it gone,
/// `lost()` resolves, `is_lost()` turns true (for that guard only), and `release()` reports
/// `NotHeld`, still releasing the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_is_reported_by_the_multi_guard() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    // 300 ms leases extended every 100 ms.
    let locks = manager(&srv, LockOptions::new().ttl(ms(300))).await;
    let held = locks
        .lock_all(["c", "b", "a"])
        .acquire_timeout(SOON)
        .await
        .expect("acquire");
    let lost = held.lost();
    futures::pin_mut!(lost);
    // Kept alive past several TTLs: not lost.
    let kept = tokio::time::timeout(ms(700), lost.as_mut()).await;
    assert!(kept.is_err(), "lost() resolved while all were held");
    assert!(!held.is_lost());
    for name in ["a", "b", "c"] {
        assert!(
            is_held(&other, name).await,
            "{name} expired under the watchdog"
        );
    }

    let key_b = locks.lock("b").key().as_str().to_owned();
    assert_eq!(srv.cmd(&["DEL", &key_b]).as_int(), Some(1));
    let deleted = Instant::now();
    within("lost()", lost).await;
    println!("lost() resolved {:?} after the DEL", deleted.elapsed());
    assert!(held.is_lost());
    assert!(held.get("b").expect("b").is_lost());
    assert!(!held.get("a").expect("a").is_lost());
    assert!(!held.get("c").expect("c").is_lost());
    let released = held.release().await;
    assert!(matches!(released, Err(Error::NotHeld)), "{released:?}");
    for name in ["a", "c"] {
        assert!(!is_held(&other, name).await, "{name} held after release()");
    }
}

// 7. Mixed kinds.

/// A read of a read-write lock, a semaphore's permit and a plain lock (with options of its
/// own, on another manager), held together: the read is still shared with other readers (a
/// writer is kept out), the semaphore's other permit can be had, the plain lock is exclusive.
/// Released, each is fully free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_kinds_hold_what_each_kind_holds() {
    let srv = RedisServer::start();
    let one = manager(&srv, opts()).await;
    let two = manager(&srv, opts().holder_label("two")).await;
    let other = manager(&srv, opts()).await;
    let config = one.rw("config").expect("rw");
    let pool = one.semaphore("pool", 2).expect("semaphore");
    let job = two.lock_with("job", |o| o.ttl(ms(5_000))).expect("job");
    let multi = MultiLock::of([job.clone(), pool.as_lock().clone(), config.reader().clone()]);
    let held = multi.acquire_timeout(SOON).await.expect("acquire");
    let names: Vec<&str> = held.guards().iter().map(|g| g.name()).collect();
    assert_eq!(names, ["config", "job", "pool"]);

    let others_config = other.rw("config").expect("rw");
    let others_pool = other.semaphore("pool", 2).expect("semaphore");
    let read = others_config.try_read().await.expect("try_read");
    assert!(read.is_some(), "the read is not shared");
    assert!(others_config
        .try_write()
        .await
        .expect("try_write")
        .is_none());
    let info = others_config
        .inspect()
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.shared_holds, Some(2), "{info:?}");
    let permit = others_pool.try_acquire().await.expect("try");
    assert!(permit.is_some(), "the second permit");
    assert!(others_pool.try_acquire().await.expect("try").is_none());
    assert!(other
        .lock("job")
        .try_acquire()
        .await
        .expect("try")
        .is_none());

    // Another process's multi-lock of the same kinds: the read and a permit could be had,
    // the job not; it holds nothing afterwards.
    drop(permit);
    assert!(
        eventually(ms(2_000), || async {
            others_pool
                .inspect()
                .await
                .expect("inspect")
                .and_then(|i| i.shared_holds)
                == Some(1)
        })
        .await
    );
    let theirs = MultiLock::of([
        other.lock("job"),
        others_pool.as_lock().clone(),
        others_config.reader().clone(),
    ]);
    assert!(theirs.try_acquire().await.expect("try").is_none());
    let info = others_config
        .inspect()
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.shared_holds, Some(2), "their read was not given back");
    let info = others_pool.inspect().await.expect("inspect").expect("held");
    assert_eq!(
        info.shared_holds,
        Some(1),
        "their permit was not given back"
    );

    drop(read);
    held.release().await.expect("release");
    let w = others_config.try_write().await.expect("try_write");
    assert!(w.is_some(), "config not free after the release");
    let j = other.lock("job").try_acquire().await.expect("try");
    assert!(j.is_some(), "job not free after the release");
    let p1 = others_pool.try_acquire().await.expect("try");
    let p2 = others_pool.try_acquire().await.expect("try");
    assert!(p1.is_some() && p2.is_some(), "pool permits not all back");
}

// 8. Bad input.

fn is_invalid<T: std::fmt::Debug>(r: &Result<T, Error>) -> bool {
    matches!(r, Err(Error::InvalidConfig(_)))
}

/// No locks, an empty name, a lock named twice (also with other options, or as the read and
/// the write of one read-write lock): `InvalidConfig` at once from every way in, holding
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sets_are_refused() {
    let srv = RedisServer::start();
    let locks = manager(&srv, opts()).await;
    let rw = locks.rw("rw").expect("rw");
    let cases: Vec<(&str, MultiLock)> = vec![
        ("no locks", locks.lock_all(Vec::<String>::new())),
        ("no locks (of)", MultiLock::of(Vec::new())),
        ("an empty name", locks.lock_all([""])),
        ("an empty name beside another", locks.lock_all(["", "a"])),
        ("a named twice", locks.lock_all(["a", "b", "a"])),
        (
            "a named twice with other options",
            MultiLock::of([
                locks.lock("a"),
                locks.lock_with("a", |o| o.ttl(ms(500))).expect("a"),
            ]),
        ),
        (
            "a read and the write of one lock",
            MultiLock::of([rw.reader().clone(), rw.writer().clone()]),
        ),
    ];
    for (what, multi) in cases {
        let r = within(what, multi.acquire()).await;
        assert!(is_invalid(&r), "{what}: acquire gave {r:?}");
        let r = within(what, multi.acquire_timeout(SOON)).await;
        assert!(is_invalid(&r), "{what}: acquire_timeout gave {r:?}");
        let r = within(what, multi.try_acquire()).await;
        assert!(is_invalid(&r), "{what}: try_acquire gave {r:?}");
        for name in ["a", "b", "rw"] {
            assert!(!is_held(&locks, name).await, "{what}: {name} left held");
        }
    }
}

/// An empty name is refused before any wait: with the set's other lock held elsewhere,
/// `acquire` must not wait for it (forever, without a limit) only to find the bad name after,
/// nor `try_acquire` answer "held" (`Ok(None)`) for a set that can never be taken; and with it
/// free, the set's other lock must not be taken (a fencing token minted) for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_name_is_refused_before_waiting_for_the_others() {
    let srv = RedisServer::start();
    let other = manager(&srv, opts()).await;
    let locks = manager(&srv, opts()).await;
    let mut problems = Vec::new();

    // With "a" held elsewhere.
    let held_a = take(&other, "a").await;
    let started = Instant::now();
    match tokio::time::timeout(ms(1_500), locks.lock_all(["a", ""]).acquire()).await {
        Ok(r) if is_invalid(&r) => {}
        Ok(r) => problems.push(format!("acquire gave {r:?}")),
        Err(_) => problems.push(format!(
            "acquire still waiting for \"a\" after {:?} instead of refusing the empty name",
            started.elapsed()
        )),
    }
    let tried = locks.lock_all(["a", ""]).try_acquire().await;
    if !is_invalid(&tried) {
        problems.push(format!("try_acquire gave {tried:?}"));
    }
    held_a.release().await.expect("release a");

    // With "a" free.
    let before = last_fence(&other, "a").await;
    let r = within("acquire", locks.lock_all(["a", ""]).acquire()).await;
    if !is_invalid(&r) {
        problems.push(format!("acquire (a free) gave {r:?}"));
    }
    let after = last_fence(&other, "a").await;
    if before != after {
        problems.push(format!(
            "\"a\" was taken for nothing (fencing token {before:?} -> {after:?})"
        ));
    }
    assert!(!is_held(&other, "a").await, "a left held");
    assert!(
        problems.is_empty(),
        "lock_all([\"a\", \"\"]):\n  {}",
        problems.join("\n  ")
    );
}

/// The same lock named twice where the check does not look: through two managers over one
/// backend (a clone of one connection; managers with different defaults), and through one
/// manager twice with another manager's lock of that name sorted between them. Each must be
/// refused, not left to wait for itself (for ever: no lock has a wait limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lock_named_twice_across_managers_is_refused() {
    let srv = RedisServer::start();
    let redis = connect(&srv).await;
    let short = LockManager::with_options(redis.clone(), opts()).expect("options");
    let long =
        LockManager::with_options(redis, opts().ttl(Duration::from_secs(20))).expect("options");
    let elsewhere = manager(&srv, opts()).await;
    let cases = [
        (
            "short's a, long's a (one backend)",
            MultiLock::of([short.lock("a"), long.lock("a")]),
        ),
        (
            "short's a, another connection's a, short's a again",
            MultiLock::of([short.lock("a"), elsewhere.lock("a"), short.lock("a")]),
        ),
    ];
    let mut problems = Vec::new();
    for (what, multi) in cases {
        let started = Instant::now();
        match tokio::time::timeout(ms(1_000), multi.acquire()).await {
            Ok(r) if is_invalid(&r) => {}
            Ok(r) => problems.push(format!("{what}: acquire gave {r:?}")),
            Err(_) => problems.push(format!(
                "{what}: acquire still waiting for itself after {:?} (it holds \"a\" and waits \
                 for \"a\")",
                started.elapsed()
            )),
        }
        assert!(
            eventually(ms(2_000), || async { !is_held(&elsewhere, "a").await }).await,
            "{what}: a left held"
        );
    }
    assert!(problems.is_empty(), "\n  {}", problems.join("\n  "));
}

/// The global order is fixed: the order is by key, so one set is taken in the same order by
/// every caller, whatever the stores hold. One key on two stores has no such order (two
/// callers could each hold one and wait for the other's), so it is refused at once; with
/// another key prefix on one store, the set is taken, always in the same order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_set_on_two_stores_is_taken_in_one_order_by_every_caller() {
    let first_store = MemoryBackend::new();
    let second_store = MemoryBackend::new();
    let one = LockManager::with_options(first_store, opts().ttl(Duration::from_secs(11)))
        .expect("options");
    let two = LockManager::with_options(second_store.clone(), opts().ttl(Duration::from_secs(12)))
        .expect("options");
    let which = |m: &MultiLock| -> Vec<u64> {
        m.locks()
            .iter()
            .map(|l| l.options().ttl.as_secs() - 10)
            .collect()
    };

    // One key on two stores: refused before anything is taken, however it is asked for.
    let same_key = MultiLock::of([one.lock("a"), two.lock("a")]);
    assert!(is_invalid(&within("acquire", same_key.acquire()).await));
    assert!(matches!(
        within("try_acquire", same_key.try_acquire()).await,
        Err(Error::InvalidConfig(_))
    ));
    assert!(!is_held(&one, "a").await && !is_held(&two, "a").await);

    // Another prefix on the second store: taken, in one order, whatever the stores hold.
    let two_b = LockManager::with_options(
        second_store,
        opts().ttl(Duration::from_secs(12)).key_prefix("b:"),
    )
    .expect("options");
    let mut orders = Vec::new();
    for round in 0..6 {
        let side = if round % 2 == 0 { &one } else { &two };
        let g = take(side, &format!("other-{round}")).await;
        let multi = if round % 2 == 0 {
            MultiLock::of([one.lock("a"), two_b.lock("a")])
        } else {
            MultiLock::of([two_b.lock("a"), one.lock("a")])
        };
        orders.push(which(&multi));
        let held = within("acquire", multi.acquire()).await.expect("acquire");
        held.release().await.expect("release");
        g.release().await.expect("release");
    }
    println!("orders of one set (1: the first store's a, 2: the second's b:a): {orders:?}");
    assert!(
        orders.windows(2).all(|w| w[0] == w[1]),
        "one set of locks was ordered differently by different callers: {orders:?}"
    );
}

// 10. Redis Cluster.

/// The locks of one multi-lock on three shards (one name per primary): taken together, each
/// excluded to another process, given back together; two callers in opposite orders both get
/// through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_lock_spread_over_the_shards_of_a_cluster() {
    let started = Instant::now();
    let cluster = RedisCluster::start(3, 0);
    println!("cluster up in {:?}", started.elapsed());
    let names = cluster.names_per_primary("redlease:", "multi");
    let connect = || async {
        let backend = RedisBackend::connect_with(
            &cluster.url(),
            RedisOptions::new().command_timeout(ms(500)),
        )
        .await
        .expect("connect to the cluster");
        LockManager::with_options(backend, opts()).expect("options")
    };
    let a = connect().await;
    let b = connect().await;
    let owners: Vec<usize> = names
        .iter()
        .map(|n| cluster.owner(a.lock(n).key().as_str(), 0))
        .collect();
    let mut distinct = owners.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "names on primaries {owners:?}");

    let held = a
        .lock_all(&names)
        .acquire_timeout(SOON)
        .await
        .expect("acquire");
    for n in &names {
        assert!(b.lock(n).try_acquire().await.expect("try").is_none(), "{n}");
    }
    assert!(b
        .lock_all(&names)
        .try_acquire()
        .await
        .expect("try")
        .is_none());
    held.release().await.expect("release");
    for n in &names {
        assert!(!is_held(&b, n).await, "{n} held after release()");
    }

    let mut reversed = names.clone();
    reversed.reverse();
    let checkers: Arc<Vec<Checker>> = Arc::new(names.iter().map(|_| Checker::new()).collect());
    let run = |locks: LockManager, set: Vec<String>| {
        let checkers = checkers.clone();
        let names = names.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                let held = locks
                    .lock_all(&set)
                    .acquire_timeout(NEVER)
                    .await
                    .expect("no deadlock");
                let sections: Vec<_> = held
                    .guards()
                    .iter()
                    .map(|g| {
                        let i = names.iter().position(|n| n == g.name()).expect("ours");
                        checkers[i].enter(g.fencing_token())
                    })
                    .collect();
                tokio::task::yield_now().await;
                drop(sections);
                held.release().await.expect("release");
            }
        })
    };
    let x = run(a.clone(), names.clone());
    let y = run(b.clone(), reversed);
    within("x", x).await.expect("x");
    within("y", y).await.expect("y");
    for c in checkers.iter() {
        assert_eq!(c.sections(), 100);
        c.assert_ok();
    }
    println!("cluster test took {:?}", started.elapsed());
}

/// `lost()` of a multi-guard is pending while all are held (checked without waiting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_is_pending_while_all_are_held_in_memory() {
    let locks = LockManager::with_options(MemoryBackend::new(), opts()).expect("options");
    let held = locks
        .lock_all(["a", "b"])
        .acquire_timeout(SOON)
        .await
        .expect("acquire");
    assert!(held.lost().now_or_never().is_none());
    let lost = held.lost();
    drop(held);
    // The guard gone, lost() resolves (as a single guard's does).
    within("lost() after the drop", lost).await;
}

/// A lock taken first and lost while the next one is waited for (the server paused past its
/// validity, so the watchdog could not extend it) is not handed out in the multi guard: every
/// lock is given back and taken again, and the guard returned holds none that is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_lost_while_the_next_is_waited_for_is_taken_again() {
    let srv = RedisServer::start();
    // b's holder keeps 1.2 s leases; the multi lock's a has 300 ms ones, so whenever b's
    // holder is told its lease is lost, a's lease (confirmed no later than the pause) ended
    // before.
    let other = manager(&srv, LockOptions::new().ttl(ms(1_200))).await;
    let locks = manager(&srv, opts()).await;
    let held_b = take(&other, "b").await;
    let a = locks.lock_with("a", |o| o.ttl(ms(300))).expect("options");
    let b = locks.lock("b");
    let waiting = tokio::spawn(async move { MultiLock::of([a, b]).acquire_timeout(SOON).await });
    // The multi lock took a and now waits for b.
    assert!(
        eventually(SOON, || async { is_held(&other, "a").await }).await,
        "a was never taken"
    );
    let a_before = last_fence(&other, "a").await.expect("a's fence");
    srv.pause();
    within("b's holder told its lease is lost", held_b.lost()).await;
    srv.resume();
    // b ran out on the server during the pause: the multi lock gets it.
    let held = within("the multi lock", waiting)
        .await
        .expect("task")
        .expect("acquired");
    assert!(
        !held.is_lost(),
        "the multi guard holds a lost lease: {:?}",
        held.guards()
            .iter()
            .map(|g| (g.name().to_string(), g.is_lost()))
            .collect::<Vec<_>>()
    );
    let a_token = held.guards()[0].fencing_token();
    assert!(
        a_token > a_before,
        "a was not taken again: {a_token} after {a_before}"
    );
    held.release().await.expect("release");
}
