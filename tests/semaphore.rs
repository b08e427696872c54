//! Semaphores (`LockManager::semaphore`, `Lock::semaphore`), on a real redis-server and in
//! memory: at most N holders under contention, killed connections and crashed holders (a
//! shared checker); a crashed holder's permit back within its TTL while live ones are
//! extended; waiters woken by a release, not by their fallback re-check; `inspect`'s counts
//! and labels; handles with different counts on one name; exclusion with plain, reentrant
//! and read-write locks; a fencing token per permit; dropped waiters leaving nothing behind;
//! what is refused (Redlock, zero permits); a key of the wrong type at the semaphore's name
//! or beside it; a permit not extended is lost; a release wakes, in one process, the waiter
//! that can use the permit even when a waiter with a lower count waits there too.
//!
//! Every wait is bounded. Where a wake-up is the point, the fallback re-check is far longer
//! than the test's bound. Run with `--nocapture` to see the checker's figures.

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlease::{
    Backend, Error, LeaseKey, LockGuard, LockManager, LockOptions, Owner, RedisBackend, Redlock,
    RedlockOptions, RetryPolicy, Semaphore,
};
use support::{wait_for_async, within, RedisServer, SharedChecker, Store, SOON};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Long TTL (a permit never runs out within a test unless forgotten) and a fallback re-check
/// of 10 s: a waiter served within a second was woken by a release.
fn long() -> LockOptions {
    LockOptions::new()
        .ttl(secs(30))
        .retry(RetryPolicy::notify().max_delay(secs(10)))
}

/// Live permits of `pool` as the store reports them (0 when nothing is held in a shared mode).
async fn live(pool: &Semaphore) -> u64 {
    pool.inspect()
        .await
        .expect("inspect")
        .and_then(|info| info.shared_holds)
        .unwrap_or(0)
}

/// Waits (polling `inspect`) until the store reports `n` live permits of `pool`.
async fn wait_live(pool: &Semaphore, n: u64) {
    let deadline = Instant::now() + SOON;
    loop {
        let seen = live(pool).await;
        if seen == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {seen} live permits after {SOON:?}, expected {n}",
            pool.name()
        );
        tokio::time::sleep(ms(5)).await;
    }
}

/// A permit of `pool`, taken at once: the test knows one is free (panics otherwise).
async fn take(pool: &Semaphore) -> LockGuard {
    pool.try_acquire()
        .await
        .unwrap_or_else(|e| panic!("{}: try_acquire failed: {e}", pool.name()))
        .unwrap_or_else(|| {
            panic!(
                "{}: no permit free (n = {}) where one was expected",
                pool.name(),
                pool.permits()
            )
        })
}

/// Whether `pool` has no permit free for its own count now.
async fn full(pool: &Semaphore) -> bool {
    match pool.try_acquire().await.expect("try_acquire") {
        None => true,
        Some(g) => {
            g.release().await.expect("release of a probe permit");
            false
        }
    }
}

// ---------------------------------------------------------------------------------------
// 1 and 10. The shared checker: many tasks, several managers, killed connections, crashes.
// ---------------------------------------------------------------------------------------

struct CheckerRun {
    managers: usize,
    tasks_per_manager: usize,
    permits: u32,
    sections: usize,
    ttl: Duration,
    /// Every this many sections, the holder "crashes": forgets its permit after leaving its
    /// section (the permit stays taken until its TTL runs out).
    crash_every: usize,
    /// Kill every client connection when this share of the sections has been claimed.
    kills_at: &'static [f64],
}

#[derive(Default)]
struct Counts {
    acquire_errors: AtomicU64,
    timeouts: AtomicU64,
    release_errors: AtomicU64,
    crashes: AtomicU64,
    drops: AtomicU64,
    lost_inside: AtomicU64,
}

async fn checker_run(store: &Store, run: CheckerRun, what: &str) {
    let n = run.permits as usize;
    let checker = SharedChecker::new(n);
    let next = Arc::new(AtomicUsize::new(0));
    let counts = Arc::new(Counts::default());
    let opts = LockOptions::new().ttl(run.ttl);
    let started = Instant::now();
    let mut pools = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..run.managers {
        let locks = store.manager(opts.clone()).await;
        let pool = locks.semaphore("checked", run.permits).unwrap();
        pools.push(pool.clone());
        for _ in 0..run.tasks_per_manager {
            let (pool, checker, next, counts) =
                (pool.clone(), checker.clone(), next.clone(), counts.clone());
            let (sections, crash_every) = (run.sections, run.crash_every);
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= sections {
                        break;
                    }
                    let guard = loop {
                        match pool.acquire_timeout(secs(10)).await {
                            Ok(g) => break g,
                            Err(Error::Backend { .. }) => {
                                counts.acquire_errors.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(Error::Timeout { .. }) => {
                                counts.timeouts.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(e) => panic!("acquire failed: {e}"),
                        }
                    };
                    let section = checker.enter_shared(guard.fencing_token());
                    // Short work: a yield, or 4 or 8 ms (long beside a grant's round trip,
                    // so that the permits are all taken at once now and then: the peak
                    // must reach N).
                    match i % 3 {
                        0 => tokio::task::yield_now().await,
                        k => tokio::time::sleep(ms(4 * k as u64)).await,
                    }
                    if guard.is_lost() {
                        counts.lost_inside.fetch_add(1, Ordering::SeqCst);
                    }
                    section.exit();
                    if i % crash_every == crash_every - 1 {
                        // A crash: the permit stays taken until its TTL runs out.
                        guard.forget();
                        counts.crashes.fetch_add(1, Ordering::SeqCst);
                    } else if i % 5 == 0 {
                        // Given back in the background.
                        drop(guard);
                        counts.drops.fetch_add(1, Ordering::SeqCst);
                    } else if guard.release().await.is_err() {
                        counts.release_errors.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }));
        }
    }

    let chaos = store.server().map(|srv| {
        let (srv, next) = (srv.clone(), next.clone());
        let (sections, kills_at) = (run.sections, run.kills_at);
        tokio::task::spawn_blocking(move || {
            let mut kills = Vec::new();
            for (k, share) in kills_at.iter().enumerate() {
                let at = (sections as f64 * share) as usize;
                let reached = support::wait_for(secs(30), || next.load(Ordering::SeqCst) >= at);
                assert!(reached, "the run never reached section {at}");
                let mut killed = srv.kill_clients();
                if k % 2 == 0 {
                    killed += srv.kill_pubsub_clients();
                }
                kills.push(killed);
            }
            kills
        })
    });

    let joined = tokio::time::timeout(secs(40), futures::future::join_all(tasks))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{what}: tasks did not finish: {} sections claimed, {}",
                next.load(Ordering::SeqCst),
                checker.report()
            )
        });
    for r in joined {
        r.expect("a checker task panicked");
    }
    let elapsed = started.elapsed();
    let kills = match chaos {
        Some(c) => c.await.expect("the chaos thread"),
        None => Vec::new(),
    };
    let c = |a: &AtomicU64| a.load(Ordering::SeqCst);
    println!(
        "{what}: {} sections by {} tasks on {} managers, N = {}, peak {}, {} violations, \
         elapsed {elapsed:?}; {} crashed, {} dropped, connections killed {kills:?}, {} \
         acquire errors retried, {} acquire timeouts, {} release errors, {} lost inside",
        checker.sections(),
        run.managers * run.tasks_per_manager,
        run.managers,
        run.permits,
        checker.peak(),
        checker.violations(),
        c(&counts.crashes),
        c(&counts.drops),
        c(&counts.acquire_errors),
        c(&counts.timeouts),
        c(&counts.release_errors),
        c(&counts.lost_inside),
    );
    assert_eq!(checker.violations(), 0, "{what}: {}", checker.report());
    assert!(checker.peak() <= n, "{what}: {}", checker.report());
    assert_eq!(
        checker.peak(),
        n,
        "{what}: the semaphore was never full: the run proves little ({})",
        checker.report()
    );
    assert_eq!(
        checker.sections(),
        run.sections as u64,
        "{what}: {}",
        checker.report()
    );
    assert!(
        c(&counts.crashes) >= (run.sections / run.crash_every) as u64,
        "{what}: too few crashes"
    );
    assert_eq!(
        c(&counts.lost_inside),
        0,
        "{what}: permits were lost inside sections of a few ms (TTL {:?})",
        run.ttl
    );
    assert_eq!(
        kills.len(),
        run.kills_at.len() * usize::from(store.server().is_some())
    );
    assert!(
        kills.iter().all(|&k| k >= 1),
        "{what}: a kill found no connection: {kills:?}"
    );
    // Every permit comes back: the crashed ones within their TTL, none leaked by a killed
    // connection, a dropped guard or an abandoned attempt.
    let pool = &pools[0];
    let deadline = Instant::now() + run.ttl + secs(3);
    loop {
        let seen = live(pool).await;
        if seen == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {seen} permits still taken {:?} after the run",
            run.ttl + secs(3)
        );
        tokio::time::sleep(ms(10)).await;
    }
    let mut all = Vec::new();
    for _ in 0..run.permits {
        all.push(take(pool).await);
    }
    assert!(full(pool).await, "{what}: a permit beyond N after the run");
    for g in all {
        g.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_at_most_n_holders_on_redis_with_killed_connections_and_crashes() {
    let store = Store::redis();
    let run = CheckerRun {
        managers: 4,
        tasks_per_manager: 16,
        permits: 8,
        sections: 3000,
        ttl: ms(1000),
        crash_every: 500,
        kills_at: &[0.1, 0.25, 0.4, 0.55, 0.7],
    };
    checker_run(&store, run, "redis checker").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_at_most_n_holders_in_memory_with_crashes() {
    let store = Store::memory();
    let run = CheckerRun {
        managers: 2,
        tasks_per_manager: 16,
        permits: 4,
        sections: 1000,
        ttl: ms(1000),
        crash_every: 150,
        kills_at: &[],
    };
    checker_run(&store, run, "memory checker").await;
}

// ---------------------------------------------------------------------------------------
// 2 and 10. A crashed holder's permit comes back within its TTL; live ones are extended.
// ---------------------------------------------------------------------------------------

async fn crashed_permits_come_back_within_their_ttl(store: Store) {
    const N: u32 = 3;
    let ttl = ms(1000);
    let opts = LockOptions::new().ttl(ttl);
    let crashing = store.manager(opts.clone()).await;
    let pool = crashing.semaphore("crash", N).unwrap();
    let first_sent = Instant::now();
    let mut guards = Vec::new();
    for _ in 0..N {
        guards.push(take(&pool).await);
    }
    for g in guards {
        g.forget();
    }
    let crashed_at = Instant::now();

    // Another process: the forgotten permits are still taken.
    let other = store.manager(opts).await;
    let wpool = other.semaphore("crash", N).unwrap();
    assert!(full(&wpool).await, "a forgotten permit was given back");
    assert_eq!(live(&wpool).await, u64::from(N));

    // N waiters in that process: each gets one as the crashed permits run out.
    let mut waiters = Vec::new();
    for _ in 0..N {
        let wpool = wpool.clone();
        waiters.push(tokio::spawn(async move {
            let r = wpool.acquire_timeout(ttl * 5).await;
            (r, Instant::now())
        }));
    }
    let mut got = Vec::new();
    for w in waiters {
        let (r, at) = within("a waiter", w).await.expect("waiter task");
        let g = r.expect("a waiter gets a crashed holder's permit");
        let early = first_sent + ttl - ms(100);
        assert!(
            at >= early,
            "a permit was granted {:?} after the crashed ones were taken, before their TTL \
             ({ttl:?}) ran out",
            at - first_sent
        );
        let late = crashed_at + ttl + ms(1500);
        assert!(
            at <= late,
            "a crashed permit came back only {:?} after the crash (TTL {ttl:?})",
            at - crashed_at
        );
        got.push(g);
    }
    // All N are taken again, by live holders.
    assert!(full(&wpool).await);
    assert_eq!(live(&wpool).await, u64::from(N));
    for g in got {
        assert!(!g.is_lost());
        g.release().await.expect("release");
    }
    assert_eq!(live(&wpool).await, 0);
}

async fn live_permits_are_extended_past_several_ttls_beside_crashed_ones(store: Store) {
    const N: u32 = 4;
    let ttl = ms(1000);
    let opts = LockOptions::new().ttl(ttl);
    let holding = store.manager(opts.clone()).await;
    let crashing = store.manager(opts.clone()).await;
    let waiting = store.manager(opts).await;
    let hpool = holding.semaphore("extended", N).unwrap();
    let cpool = crashing.semaphore("extended", N).unwrap();
    let wpool = waiting.semaphore("extended", N).unwrap();

    let taken_at = Instant::now();
    let kept = vec![take(&hpool).await, take(&hpool).await];
    take(&cpool).await.forget();
    take(&cpool).await.forget();
    assert!(full(&wpool).await);

    // A waiter gets a crashed permit when it runs out; the live ones stay.
    let waiter = within("the waiter", wpool.acquire_timeout(ttl * 5))
        .await
        .expect("the waiter gets a crashed permit");
    assert!(
        taken_at.elapsed() >= ttl - ms(100),
        "a permit was granted {:?} in, before the crashed ones' TTL ({ttl:?})",
        taken_at.elapsed()
    );
    // Several TTLs pass: time passing is what is under test.
    let until = taken_at + ttl * 3 + ms(200);
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    for g in kept.iter().chain([&waiter]) {
        assert!(
            !g.is_lost(),
            "a live permit was lost after {:?} (TTL {ttl:?})",
            taken_at.elapsed()
        );
    }
    // The two kept permits and the waiter's are live; both crashed ones are gone.
    assert_eq!(live(&wpool).await, 3);
    let fourth = take(&wpool).await;
    assert!(full(&wpool).await, "more than {N} permits");
    for g in kept.into_iter().chain([waiter, fourth]) {
        g.release()
            .await
            .expect("a live permit is still ours to release");
    }
    assert_eq!(live(&wpool).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_permits_come_back_within_their_ttl_on_redis() {
    crashed_permits_come_back_within_their_ttl(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_permits_come_back_within_their_ttl_in_memory() {
    crashed_permits_come_back_within_their_ttl(Store::memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_permits_are_extended_past_several_ttls_beside_crashed_ones_on_redis() {
    live_permits_are_extended_past_several_ttls_beside_crashed_ones(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_permits_are_extended_past_several_ttls_beside_crashed_ones_in_memory() {
    live_permits_are_extended_past_several_ttls_beside_crashed_ones(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 3. Waiters are woken by a release, not by their fallback re-check.
// ---------------------------------------------------------------------------------------

/// Subscribers of `channel` on the server.
fn numsub(srv: &RedisServer, channel: &str) -> i64 {
    let r = srv.cmd(&["PUBSUB", "NUMSUB", channel]);
    r.as_array()
        .and_then(|a| a.get(1))
        .and_then(|n| n.as_int())
        .unwrap_or_else(|| panic!("PUBSUB NUMSUB replied {r:?}"))
}

/// Whether `subscribers` waiters of `key` are subscribed to its releases and the record says
/// shared waiters want a message (its `s` flag is live).
fn waiting(srv: &RedisServer, key: &LeaseKey, subscribers: i64) -> bool {
    let flag = support::int_field(srv, key.as_str(), "s");
    numsub(srv, &key.derived("released")) >= subscribers
        && flag.is_some_and(|s| s > support::server_ms(srv))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_by_a_release_not_by_polling() {
    const N: u32 = 2;
    let store = Store::redis();
    let srv = store.server().unwrap().clone();
    let holding = store.manager(long()).await;
    let pool = holding.semaphore("woken", N).unwrap();
    let key = pool.as_lock().key().clone();
    let a = take(&pool).await;
    let b = take(&pool).await;

    // Three waiters, each in a process of its own.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut managers = Vec::new();
    for w in 0..3 {
        let locks = store.manager(long()).await;
        let wpool = locks.semaphore("woken", N).unwrap();
        managers.push(locks);
        let tx = tx.clone();
        tokio::spawn(async move {
            let r = wpool.acquire_timeout(secs(25)).await;
            let _ = tx.send((w, r, Instant::now()));
        });
    }
    drop(tx);
    let registered = wait_for_async(SOON, || waiting(&srv, &key, 3)).await;
    assert!(registered, "the waiters never registered");
    assert!(
        rx.try_recv().is_err(),
        "a waiter got a permit while all were taken"
    );

    let mut served = Vec::new();
    let mut releases = vec![a, b].into_iter();
    for round in 0..3 {
        // Rounds 0 and 1 give back the holder's permits; round 2 a waiter's, from another
        // process.
        let guard = match releases.next() {
            Some(g) => g,
            None => served.remove(0),
        };
        let released_at = Instant::now();
        guard.release().await.expect("release");
        let (w, r, at) = within("a woken waiter", rx.recv())
            .await
            .expect("a waiter's channel");
        let g: LockGuard = r.unwrap_or_else(|e| panic!("waiter {w} failed: {e}"));
        let gap = at.saturating_duration_since(released_at);
        assert!(
            gap < ms(1000),
            "round {round}: waiter {w} got the permit {gap:?} after the release, with a 10 s \
             fallback re-check: not woken by the release"
        );
        // One permit freed, one granted: never more than N.
        assert_eq!(live(&pool).await, u64::from(N), "round {round}");
        served.push(g);
    }
    for g in served {
        g.release().await.expect("release");
    }
}

// ---------------------------------------------------------------------------------------
// 4. inspect: counts and labels.
// ---------------------------------------------------------------------------------------

async fn inspect_counts_permits_and_names_their_holders(store: Store) {
    const N: u32 = 5;
    let alpha = store.manager(long().holder_label("alpha")).await;
    let beta = store.manager(long().holder_label("beta")).await;
    let anonymous = store.manager(long()).await;
    let apool = alpha.semaphore("inspected", N).unwrap();
    let bpool = beta.semaphore("inspected", N).unwrap();
    let npool = anonymous.semaphore("inspected", N).unwrap();
    assert_eq!(apool.name(), "inspected");
    assert_eq!(apool.permits(), N);
    assert!(
        npool.inspect().await.unwrap().is_none(),
        "a semaphore never used left a trace"
    );

    let a1 = take(&apool).await;
    let a2 = take(&apool).await;
    let b1 = take(&bpool).await;
    let n1 = take(&npool).await;
    let last = [&a1, &a2, &b1, &n1]
        .iter()
        .map(|g| g.fencing_token())
        .max()
        .unwrap();

    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let info = npool.inspect().await.unwrap().expect("held");
    assert!(info.held, "{info:?}");
    assert_eq!(info.shared_holds, Some(4), "{info:?}");
    assert_eq!(
        sorted(info.shared_labels.clone()),
        ["alpha", "alpha", "beta"],
        "{info:?}"
    );
    assert_eq!(info.holder_label, None, "{info:?}");
    assert_eq!(info.fencing_token, Some(last), "{info:?}");
    assert!(info.remaining.is_some_and(|r| r > secs(20)), "{info:?}");
    assert_eq!(info.reentrant_count, None, "{info:?}");
    println!("{info}");

    a1.release().await.expect("release");
    let info = bpool.inspect().await.unwrap().expect("held");
    assert_eq!(info.shared_holds, Some(3), "{info:?}");
    assert_eq!(
        sorted(info.shared_labels.clone()),
        ["alpha", "beta"],
        "{info:?}"
    );

    n1.release().await.expect("release");
    b1.release().await.expect("release");
    let info = apool.inspect().await.unwrap().expect("held");
    assert_eq!(info.shared_holds, Some(1), "{info:?}");
    assert_eq!(info.shared_labels, ["alpha"], "{info:?}");

    a2.release().await.expect("release");
    let info = apool
        .inspect()
        .await
        .unwrap()
        .expect("the last fencing token is remembered after the release");
    assert!(!info.held, "{info:?}");
    assert_eq!(info.shared_holds, None, "{info:?}");
    assert!(info.shared_labels.is_empty(), "{info:?}");
    assert_eq!(info.remaining, None, "{info:?}");
    assert_eq!(info.fencing_token, Some(last), "{info:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_permits_and_names_their_holders_on_redis() {
    inspect_counts_permits_and_names_their_holders(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_permits_and_names_their_holders_in_memory() {
    inspect_counts_permits_and_names_their_holders(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 5. Changing the permit count: each acquirer's own count decides.
// ---------------------------------------------------------------------------------------

async fn each_acquirer_counts_with_its_own_permits(store: Store) {
    let locks = store.manager(long()).await;
    let other = store.manager(long()).await;
    let four = locks.semaphore("resized", 4).unwrap();
    let two = other.semaphore("resized", 2).unwrap();
    let six = other
        .lock_with("resized", |o| o.ttl(secs(30)))
        .unwrap()
        .semaphore(6)
        .unwrap();
    assert_eq!((four.permits(), two.permits(), six.permits()), (4, 2, 6));

    let mut fours = Vec::new();
    for _ in 0..4 {
        fours.push(take(&four).await);
    }
    assert_eq!(live(&four).await, 4);
    // Lowering the count takes nothing away, and lets nobody in.
    assert!(full(&two).await, "n = 2 got a permit while 4 were held");
    assert!(full(&four).await, "n = 4 got a fifth permit");
    // Raising it lets the new count in at once, up to its own count.
    let mut sixes = vec![take(&six).await];
    assert_eq!(live(&four).await, 5);
    assert!(full(&four).await, "n = 4 got a permit while 5 were held");
    assert!(full(&two).await, "n = 2 got a permit while 5 were held");
    sixes.push(take(&six).await);
    assert_eq!(live(&four).await, 6);
    assert!(full(&six).await, "n = 6 got a seventh permit");

    // Back down: 4 held, then 3; n = 4 gets one again only below 4.
    for g in sixes {
        g.release().await.expect("release");
    }
    assert_eq!(live(&four).await, 4);
    assert!(full(&four).await, "n = 4 got a fifth permit");
    fours.pop().unwrap().release().await.expect("release");
    assert_eq!(live(&four).await, 3);
    fours.push(take(&four).await);
    assert_eq!(live(&four).await, 4);

    // n = 2 waits until fewer than 2 remain: a waiter is not served at 3 or 2 held, and is
    // at 1.
    fours.pop().unwrap().release().await.expect("release");
    let waiter = {
        let two = two.clone();
        tokio::spawn(async move { two.acquire_timeout(SOON).await })
    };
    assert!(full(&two).await, "n = 2 got a permit while 3 were held");
    fours.pop().unwrap().release().await.expect("release");
    assert_eq!(live(&four).await, 2);
    assert!(full(&two).await, "n = 2 got a permit while 2 were held");
    // The release above woke the waiter (a permit holder's release publishes): give it the
    // time to look, and see that it did not take a permit.
    let served = wait_for_async(ms(300), || waiter.is_finished()).await;
    assert!(
        !served,
        "an n = 2 waiter was served while 2 permits were held"
    );
    assert_eq!(live(&four).await, 2);
    fours.pop().unwrap().release().await.expect("release");
    let g = within("the n = 2 waiter", waiter)
        .await
        .expect("waiter task")
        .expect("the n = 2 waiter gets a permit once 1 is held");
    assert_eq!(live(&four).await, 2);
    assert!(full(&two).await, "n = 2 got a third permit");
    // n = 4 still has room for two more.
    let more = vec![take(&four).await, take(&four).await];
    assert!(full(&four).await);
    for g in fours.into_iter().chain(more).chain([g]) {
        g.release().await.expect("release");
    }
    assert_eq!(live(&four).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_acquirer_counts_with_its_own_permits_on_redis() {
    each_acquirer_counts_with_its_own_permits(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_acquirer_counts_with_its_own_permits_in_memory() {
    each_acquirer_counts_with_its_own_permits(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 6. Exclusion with a plain lock, a reentrant lock and a read-write lock on the same name.
// ---------------------------------------------------------------------------------------

async fn semaphores_exclude_other_kinds_of_lock(store: Store) {
    let locks = store.manager(long()).await;
    let other = store.manager(long()).await;
    let pool = locks.semaphore("mixed", 3).unwrap();
    let plain = other.lock("mixed");
    let me = Owner::random();
    let reentrant = other.lock("mixed").reentrant(&me).unwrap();
    let rw = other.rw("mixed").unwrap();

    // A permit held: no plain, reentrant, read or write claim gets in.
    let p = take(&pool).await;
    assert!(
        plain.try_acquire().await.unwrap().is_none(),
        "plain beside a permit"
    );
    assert!(
        reentrant.try_acquire().await.unwrap().is_none(),
        "reentrant beside a permit"
    );
    assert!(
        rw.try_read().await.unwrap().is_none(),
        "a read beside a permit"
    );
    assert!(
        rw.try_write().await.unwrap().is_none(),
        "a write beside a permit"
    );
    // A plain waiter is woken when the last permit is given back.
    let q = take(&pool).await;
    let waiter = {
        let plain = plain.clone();
        tokio::spawn(async move { plain.acquire_timeout(SOON).await })
    };
    p.release().await.expect("release");
    assert!(
        plain.try_acquire().await.unwrap().is_none(),
        "plain while a permit is still held"
    );
    q.release().await.expect("release");
    let g = within("the plain waiter", waiter)
        .await
        .expect("waiter task")
        .expect("the plain waiter gets the lock once no permit is held");

    // The plain lock held: no permit.
    assert!(full(&pool).await, "a permit beside a plain lock");
    g.release().await.expect("release");

    // A reentrant hold: no permit.
    let r = take_lock(&reentrant).await;
    assert!(full(&pool).await, "a permit beside a reentrant hold");
    r.release().await.expect("release");

    // A read held: no permit (reads and permits are different shared modes), and the
    // other way round.
    let read = rw.try_read().await.unwrap().expect("a free read");
    assert!(full(&pool).await, "a permit beside a read");
    let read2 = rw.try_read().await.unwrap().expect("reads share");
    let info = rw.inspect().await.unwrap().expect("held");
    assert_eq!(info.shared_holds, Some(2), "{info:?}");
    read.release().await.expect("release");
    read2.release().await.expect("release");
    let p = take(&pool).await;
    assert!(
        rw.try_read().await.unwrap().is_none(),
        "a read beside a permit"
    );
    // The write, held: no permit.
    p.release().await.expect("release");
    let w = rw.try_write().await.unwrap().expect("a free write");
    assert!(full(&pool).await, "a permit beside a write");
    w.release().await.expect("release");

    // All free: the full count again.
    let all = vec![take(&pool).await, take(&pool).await, take(&pool).await];
    assert!(full(&pool).await);
    for g in all {
        g.release().await.expect("release");
    }
}

async fn take_lock(lock: &redlease::Lock) -> LockGuard {
    lock.try_acquire()
        .await
        .expect("try_acquire")
        .expect("the lock is free")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_exclude_other_kinds_of_lock_on_redis() {
    semaphores_exclude_other_kinds_of_lock(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_exclude_other_kinds_of_lock_in_memory() {
    semaphores_exclude_other_kinds_of_lock(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 7. A fencing token per permit, strictly increasing across grants.
// ---------------------------------------------------------------------------------------

async fn each_permit_has_a_greater_fencing_token(store: Store) {
    let one = store.manager(long()).await;
    let two = store.manager(long()).await;
    let pools = [
        one.semaphore("fenced", 3).unwrap(),
        two.semaphore("fenced", 3).unwrap(),
        two.semaphore("fenced", 5).unwrap(),
    ];
    // In sequence: grants from both managers and both counts, some held over the next.
    let mut tokens = Vec::new();
    let mut held: Vec<LockGuard> = Vec::new();
    for i in 0..30 {
        let g = take(&pools[i % 3]).await;
        tokens.push(g.fencing_token());
        held.push(g);
        if held.len() == 3 || i % 4 == 3 {
            held.remove(i % held.len())
                .release()
                .await
                .expect("release");
        }
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens not strictly increasing: {tokens:?}"
    );
    let top = *tokens.last().unwrap();
    for g in held {
        g.release().await.expect("release");
    }
    // A plain lock on the name afterwards: greater than every permit's.
    let plain = take_lock(&one.lock("fenced")).await;
    assert!(plain.fencing_token() > top);
    plain.release().await.expect("release");

    // Concurrently: every grant its own token, and each task's grants increasing.
    let mut tasks = Vec::new();
    for t in 0..8 {
        let pool = pools[t % 3].clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for _ in 0..10 {
                let g = pool.acquire_timeout(SOON).await.expect("acquire");
                mine.push(g.fencing_token());
                tokio::task::yield_now().await;
                g.release().await.expect("release");
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        let mine = within("a task's grants", t).await.expect("task");
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "one task's tokens not increasing: {mine:?}"
        );
        assert!(
            mine[0] > top,
            "a later grant's token below an earlier one's"
        );
        all.extend(mine);
    }
    let count = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), count, "two permits shared a fencing token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_permit_has_a_greater_fencing_token_on_redis() {
    each_permit_has_a_greater_fencing_token(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_permit_has_a_greater_fencing_token_in_memory() {
    each_permit_has_a_greater_fencing_token(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 8. A waiter that gives up leaves no permit behind.
// ---------------------------------------------------------------------------------------

async fn dropped_waiters_leave_no_permit_behind(store: Store) {
    const N: u32 = 2;
    // A permit left behind would live 30 s: far past every bound below.
    let holding = store.manager(long()).await;
    let waiting = store.manager(long()).await;
    let pool = holding.semaphore("dropped", N).unwrap();
    let wpool = waiting.semaphore("dropped", N).unwrap();
    let b = take(&pool).await;
    let a = take(&pool).await;

    // A waiter whose future is dropped by a timeout, and one dropped by a select.
    let r = tokio::time::timeout(ms(200), wpool.acquire()).await;
    assert!(r.is_err(), "the waiter got a permit while all were taken");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let stopper = tokio::spawn(async move {
        tokio::time::sleep(ms(100)).await;
        let _ = tx.send(());
    });
    tokio::select! {
        r = wpool.acquire() => panic!("the waiter was served while all were taken: {r:?}"),
        _ = rx => {}
    }
    stopper.await.unwrap();
    assert_eq!(live(&pool).await, 2);

    // Racing a release: the waiter gives up at about the moment a permit frees, so its
    // attempt may be in flight when it is dropped. Whatever it got is given back.
    let mut a = Some(a);
    let mut served = 0;
    for i in 0..20u64 {
        let releasing = a.take().unwrap();
        let (r, _) = tokio::join!(
            tokio::time::timeout(ms(5 + i % 4), wpool.acquire()),
            async {
                tokio::time::sleep(ms(5)).await;
                releasing.release().await.expect("release");
            }
        );
        if let Ok(g) = r {
            served += 1;
            g.expect("acquire").release().await.expect("release");
        }
        // Only `b` stays: an abandoned attempt's permit, if any was granted, is given back.
        wait_live(&pool, 1).await;
        // Taken through the waiter's manager, which sends it after the abandoned attempt's
        // clean-up: an attempt still on its way when the live count was read (a loaded
        // machine) could otherwise take the permit between the two.
        a = Some(take(&wpool).await);
    }
    println!("dropped waiters: {served} of 20 racing waiters were served");

    // All given back: the full count, and not one more.
    a.unwrap().release().await.expect("release");
    b.release().await.expect("release");
    wait_live(&pool, 0).await;
    let all = vec![take(&wpool).await, take(&wpool).await];
    assert!(full(&wpool).await, "a third permit");
    for g in all {
        g.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiters_leave_no_permit_behind_on_redis() {
    dropped_waiters_leave_no_permit_behind(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiters_leave_no_permit_behind_in_memory() {
    dropped_waiters_leave_no_permit_behind(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 9. What is refused: semaphores over Redlock, zero permits, fair semaphores.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_semaphores_when_they_are_made() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let mut nodes = Vec::new();
    for srv in &servers {
        nodes.push(RedisBackend::connect(&srv.url()).await.expect("connect"));
    }
    let redlock = Redlock::new(nodes.clone()).expect("a Redlock of three nodes");
    let locks = LockManager::with_options(redlock, LockOptions::new().ttl(secs(5))).unwrap();

    let unsupported = |r: redlease::Result<Semaphore>, how: &str| match r {
        Err(Error::Unsupported(msg)) => assert!(
            msg.to_lowercase().contains("semaphore"),
            "{how}: the message does not name semaphores: {msg}"
        ),
        other => panic!("{how}: expected Error::Unsupported, got {other:?}"),
    };
    unsupported(locks.semaphore("pool", 3), "locks.semaphore");
    unsupported(locks.lock("pool").semaphore(3), "lock.semaphore");
    unsupported(
        locks
            .lock_with("pool", |o| o.ttl(secs(2)))
            .unwrap()
            .semaphore(1),
        "lock_with(..).semaphore",
    );
    // Zero permits is a configuration error, whatever the store.
    assert!(
        matches!(locks.semaphore("pool", 0), Err(Error::InvalidConfig(_))),
        "zero permits over Redlock"
    );
    // A plain lock of the same name works over a Redlock of the same nodes (the restart
    // guard off: these servers have been up for under a second).
    let redlock = Redlock::with_options(nodes, RedlockOptions::new().restart_guard(false))
        .expect("a Redlock of three nodes");
    let locks = LockManager::with_options(redlock, LockOptions::new().ttl(secs(5))).unwrap();
    unsupported(locks.semaphore("pool", 3), "semaphore, restart guard off");
    let g = within(
        "a plain lock over the Redlock",
        locks.lock("pool").acquire(),
    )
    .await
    .expect("plain lock over Redlock");
    g.release().await.expect("release");
}

async fn zero_permits_and_fair_semaphores_are_refused(store: Store) {
    let locks = store.manager(long()).await;
    for r in [
        locks.semaphore("zero", 0),
        locks.lock("zero").semaphore(0),
        locks.lock_with("zero", |o| o).unwrap().semaphore(0),
    ] {
        match r {
            Err(Error::InvalidConfig(msg)) => {
                assert!(
                    msg.contains("permit"),
                    "the message does not say why: {msg}"
                )
            }
            other => panic!("zero permits: expected InvalidConfig, got {other:?}"),
        }
    }
    assert!(matches!(
        locks.semaphore("", 2),
        Err(Error::InvalidConfig(_))
    ));
    let fair = locks.lock("zero").fair().unwrap();
    assert!(matches!(fair.semaphore(2), Err(Error::InvalidConfig(_))));
    let me = Owner::random();
    let reentrant = locks.lock("zero").reentrant(&me).unwrap();
    assert!(matches!(
        reentrant.semaphore(2),
        Err(Error::InvalidConfig(_))
    ));
    // One permit is a valid semaphore: a lock by another name.
    let one = locks.semaphore("zero", 1).unwrap();
    let g = take(&one).await;
    assert!(full(&one).await);
    g.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_permits_and_fair_semaphores_are_refused_on_redis() {
    zero_permits_and_fair_semaphores_are_refused(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_permits_and_fair_semaphores_are_refused_in_memory() {
    zero_permits_and_fair_semaphores_are_refused(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 11. A key of the wrong type at the semaphore's name.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_the_wrong_type_fails_its_semaphore_only() {
    let store = Store::redis();
    let srv = store.server().unwrap().clone();
    let locks = store.manager(LockOptions::new().ttl(ms(1000))).await;
    let good = locks.semaphore("good", 2).unwrap();
    let bad = locks.semaphore("bad", 2).unwrap();
    let kept = take(&good).await;
    assert!(srv
        .cmd(&["SET", bad.as_lock().key().as_str(), "someone else's"])
        .is_ok());

    let clear = |what: &str, e: &Error| {
        let text = e.to_string();
        assert!(
            matches!(e, Error::Backend { .. }),
            "{what}: expected a backend error, got {e:?}"
        );
        assert!(
            text.contains("WRONGTYPE") || text.to_lowercase().contains("not a lock"),
            "{what}: the error does not say the key is of the wrong type: {text}"
        );
    };
    let e = within("try_acquire on the bad key", bad.try_acquire())
        .await
        .expect_err("try_acquire on a string key");
    clear("try_acquire", &e);
    let e = within("acquire on the bad key", bad.acquire())
        .await
        .expect_err("acquire on a string key");
    clear("acquire", &e);
    let e = within(
        "acquire_timeout on the bad key",
        bad.acquire_timeout(secs(3)),
    )
    .await
    .expect_err("acquire_timeout on a string key");
    clear("acquire_timeout", &e);
    // Nothing written over the other client's value.
    assert_eq!(
        srv.cmd(&["GET", bad.as_lock().key().as_str()]).as_str(),
        Some("someone else's".to_owned())
    );

    // The other name works on, through the same manager and connection; its held permit is
    // extended past several TTLs.
    let second = take(&good).await;
    assert!(full(&good).await);
    second.release().await.expect("release");
    // Time passing (2.5 TTLs) is what is under test.
    tokio::time::sleep(ms(2500)).await;
    assert!(!kept.is_lost(), "the good name's permit was lost");
    assert_eq!(live(&good).await, 1);
    kept.release().await.expect("release");
}

/// A reply as text, for assertion messages.
fn show(r: &support::Resp) -> String {
    match r.as_array() {
        Some(items) => format!("[{}]", items.iter().map(show).collect::<Vec<_>>().join(" ")),
        None => r.as_str().unwrap_or_else(|| format!("{r:?}")),
    }
}

/// A string at `<key>:shared` or `<key>:sharers` (the permits' set and their fences and
/// labels, beside the record): the acquire fails with the server's error, and leaves no
/// permit behind, so the name is free again as soon as the bad key is gone (not one TTL
/// later) and never held by nobody's permit meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_the_wrong_type_beside_the_semaphore_leaves_no_permit_behind() {
    let store = Store::redis();
    let srv = store.server().unwrap().clone();
    // A permit left behind would live 30 s: far past the bounds below.
    let locks = store.manager(long()).await;
    for part in ["shared", "sharers"] {
        let name = format!("beside-{part}");
        let pool = locks.semaphore(&name, 2).unwrap();
        let key = pool.as_lock().key().clone();
        let beside = key.derived(part);
        assert!(srv.cmd(&["SET", &beside, "someone else's"]).is_ok());
        let e = within("try_acquire beside a bad key", pool.try_acquire())
            .await
            .expect_err("try_acquire with a string beside the record");
        assert!(
            matches!(e, Error::Backend { .. }) && e.to_string().contains("WRONGTYPE"),
            "{part}: {e:?}"
        );
        // Whatever the failed attempt wrote is undone (its claim is abandoned in the
        // background): the record is not held, so a plain lock of the name gets in.
        let plain = locks.lock(&name);
        let deadline = Instant::now() + secs(3);
        let g = loop {
            if let Some(g) = plain.try_acquire().await.expect("plain try_acquire") {
                break g;
            }
            assert!(
                Instant::now() < deadline,
                "{part}: a string at {beside} made a failed acquire leave the name held for \
                 its whole TTL (by a permit nobody holds): record {}, permits {}",
                show(&srv.cmd(&["HGETALL", key.as_str()])),
                show(&srv.cmd(&["ZRANGE", &key.derived("shared"), "0", "-1", "WITHSCORES"])),
            );
            tokio::time::sleep(ms(20)).await;
        };
        g.release().await.expect("release");
        // The bad key gone, the semaphore works at once with its full count.
        srv.cmd(&["DEL", &beside]);
        let all = vec![take(&pool).await, take(&pool).await];
        assert!(full(&pool).await, "{part}: a third permit");
        for g in all {
            g.release().await.expect("release");
        }
    }
}

// ---------------------------------------------------------------------------------------
// More: a permit not extended is lost; a release wakes a waiter that can use the permit.
// ---------------------------------------------------------------------------------------

async fn a_permit_not_extended_is_lost_and_its_release_says_so(store: Store) {
    let ttl = ms(300);
    let locks = store
        .manager(LockOptions::new().ttl(ttl).watchdog(false))
        .await;
    let others = store.manager(long()).await;
    let pool = locks.semaphore("unwatched", 2).unwrap();
    let opool = others.semaphore("unwatched", 2).unwrap();
    let kept = take(&opool).await;
    let g = take(&pool).await;
    let started = Instant::now();
    within("the lost signal", g.lost()).await;
    assert!(g.is_lost());
    assert!(
        started.elapsed() < ttl + ms(200),
        "lost only after {:?} (TTL {ttl:?})",
        started.elapsed()
    );
    // Its permit runs out on the store (a moment after the client's conservative deadline);
    // the other, extended by its watchdog, stays.
    wait_live(&opool, 1).await;
    assert!(matches!(g.release().await, Err(Error::NotHeld)));
    assert!(!kept.is_lost());
    let again = take(&opool).await;
    assert!(full(&opool).await);
    for g in [kept, again] {
        assert_eq!(g.release().await.expect("release"), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_not_extended_is_lost_and_its_release_says_so_on_redis() {
    a_permit_not_extended_is_lost_and_its_release_says_so(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_not_extended_is_lost_and_its_release_says_so_in_memory() {
    a_permit_not_extended_is_lost_and_its_release_says_so(Store::memory()).await;
}

/// Starts `acquire` on a task of its own and returns once it waits: on Redis once it has
/// made its two attempts (the arriving one and, subscribed, the waiting one); in memory once
/// its first poll is done (memory attempts and subscriptions are made within it). Then a
/// moment for the attempt's answer to turn into the pause (nothing to observe there).
async fn park<F>(store: &Store, acquire: F) -> tokio::task::JoinHandle<(F::Output, Instant)>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let calls = store.server().map(|srv| srv.script_calls());
    let polled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = polled.clone();
    let task = tokio::spawn(async move {
        let mut acquire = std::pin::pin!(acquire);
        let first = futures::poll!(acquire.as_mut());
        flag.store(true, Ordering::SeqCst);
        let out = match first {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => acquire.await,
        };
        (out, Instant::now())
    });
    assert!(wait_for_async(SOON, || polled.load(Ordering::SeqCst)).await);
    if let (Some(srv), Some(calls)) = (store.server(), calls) {
        let attempted = wait_for_async(SOON, || srv.script_calls() >= calls + 2).await;
        assert!(attempted, "the waiter never made its attempts");
    }
    tokio::time::sleep(ms(50)).await;
    task
}

/// Two waiters in one process, one with a lower count than the holders (it waits for
/// fewer than 2 permits held) and one with theirs (4). One of 4 permits is given back: the
/// waiter with count 4 may take it, the other may not. It must get it within its fallback
/// re-check (1 s) at the latest, whatever the other waiter does.
async fn a_release_wakes_a_local_waiter_that_can_use_the_permit(store: Store) {
    let retry = RetryPolicy::notify().max_delay(secs(1));
    let holding = store.manager(long()).await;
    let waiting = store.manager(long().retry(retry)).await;
    let hpool = holding.semaphore("counts", 4).unwrap();
    let two = waiting.semaphore("counts", 2).unwrap();
    let four = waiting.semaphore("counts", 4).unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(take(&hpool).await);
    }
    // The lower count waits first, with no time limit; then the holders' count.
    let low = {
        let two = two.clone();
        park(&store, async move { two.acquire().await }).await
    };
    let high = {
        let four = four.clone();
        park(&store, async move { four.acquire_timeout(secs(4)).await }).await
    };
    assert!(!low.is_finished() && !high.is_finished());

    let released_at = Instant::now();
    held.pop().unwrap().release().await.expect("release");
    let (r, at) = within("the count-4 waiter", high)
        .await
        .expect("waiter task");
    let outcome = r.map(|g| (g, at.saturating_duration_since(released_at)));
    let still_waiting = !low.is_finished();
    low.abort();
    let (g, gap) = outcome.unwrap_or_else(|e| {
        panic!(
            "a count-4 waiter was not served with 3 of 4 permits held, while a count-2 waiter \
             of the same process waited (which took the release's wake-up and the re-checks): \
             {e}"
        )
    });
    assert!(
        still_waiting,
        "the count-2 waiter was served with 3 permits held"
    );
    assert!(
        gap < ms(2000),
        "the count-4 waiter got the permit {gap:?} after the release (fallback re-check 1 s)"
    );
    assert_eq!(live(&hpool).await, 4);
    g.release().await.expect("release");
    for g in held {
        g.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_local_waiter_that_can_use_the_permit_on_redis() {
    a_release_wakes_a_local_waiter_that_can_use_the_permit(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_local_waiter_that_can_use_the_permit_in_memory() {
    a_release_wakes_a_local_waiter_that_can_use_the_permit(Store::memory()).await;
}

/// The same counts in two processes: each process is woken by the release, and the waiter
/// with count 4 is served at once (a control for the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_that_can_use_the_permit_in_another_process() {
    let store = Store::redis();
    let holding = store.manager(long()).await;
    let low_m = store.manager(long()).await;
    let high_m = store.manager(long()).await;
    let hpool = holding.semaphore("counts", 4).unwrap();
    let two = low_m.semaphore("counts", 2).unwrap();
    let four = high_m.semaphore("counts", 4).unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(take(&hpool).await);
    }
    let low = park(&store, async move { two.acquire().await }).await;
    let high = park(&store, async move { four.acquire_timeout(secs(5)).await }).await;
    let released_at = Instant::now();
    held.pop().unwrap().release().await.expect("release");
    let (r, at) = within("the count-4 waiter", high)
        .await
        .expect("waiter task");
    let g = r.expect("the count-4 waiter is served with 3 of 4 permits held");
    let gap = at.saturating_duration_since(released_at);
    assert!(
        gap < ms(1000),
        "served {gap:?} after the release (fallback re-check 10 s): not woken by it"
    );
    assert!(!low.is_finished(), "the count-2 waiter was served");
    low.abort();
    assert_eq!(live(&hpool).await, 4);
    g.release().await.expect("release");
    for g in held {
        g.release().await.expect("release");
    }
}

/// A busy name keeps a bounded set: released permits stay beside the lock (so that a release
/// re-sent after a reconnect is still answered "released"), but only the last 1,000 of
/// them. A replayed release of a recent permit is answered as the first was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_permits_kept_for_replays_are_bounded() {
    use redlease::backend::{Acquire, Attempt, Claim, ClaimKind, NodeTerms, Release};
    use redlease::Token;
    let srv = RedisServer::start();
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    let key = LeaseKey::new("redlease:", "busy");
    let mut last = None;
    for _ in 0..1_500 {
        let claim = Claim::new(key.clone(), Token::shared(), secs(10)).kind(ClaimKind::Permit(4));
        let granted = backend
            .acquire(&claim, Attempt::Once, NodeTerms::new())
            .await
            .expect("acquire");
        let Acquire::Granted(grant) = granted else {
            panic!("a free permit was refused: {granted:?}");
        };
        let lease = grant.lease.clone();
        let released = backend
            .release(&claim, Release::Confirmed { lease: &lease })
            .await
            .expect("release");
        assert_eq!(released, Some(0));
        last = Some((claim, lease));
    }
    let kept = srv.cmd(&["ZCARD", "redlease:{busy}:shared"]).as_int();
    assert_eq!(kept, Some(1_000), "released permits kept beside the lock");
    // The last release, re-sent: still "released".
    let (claim, lease) = last.expect("a permit");
    let replayed = backend
        .release(&claim, Release::Confirmed { lease: &lease })
        .await
        .expect("replayed release");
    assert_eq!(replayed, Some(0), "a replayed release of a recent permit");
    // Nothing beside the lock lives for ever: with no hold left, the set goes within a
    // minute, the hash with the record.
    let ttl = |k: &str| srv.cmd(&["PTTL", k]).as_int().unwrap_or(-3);
    let set = ttl("redlease:{busy}:shared");
    assert!(set > 0 && set <= 60_000, "the set's PTTL: {set}");
    let record = ttl("redlease:{busy}");
    let hash = ttl("redlease:{busy}:sharers");
    assert!(
        hash == -2 || (hash > 0 && hash <= record),
        "the hash's PTTL {hash}, the record's {record}"
    );
}

/// The set of live permits outlives them however the record's own hour was renewed: when
/// less than half an hour is left past a hold (here made so by hand: the set's expiry and
/// the record's `z` 5 s ahead, as after half an hour of short extensions while something
/// else renewed the record), the next extension gives the set and the hash an hour again.
/// Before, the set followed the record's `x` only, and could expire under a live permit,
/// letting a second one in past the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_set_of_permits_outlives_its_live_permits() {
    let store = Store::redis();
    let srv = store.server().unwrap().clone();
    let locks = store
        .manager(LockOptions::new().ttl(secs(20)).watchdog(false))
        .await;
    let pool = locks.semaphore("long", 1).expect("semaphore");
    let permit = take(&pool).await;
    let (set, hash) = ("redlease:{long}:shared", "redlease:{long}:sharers");
    let soon = support::server_ms(&srv) + 5_000;
    srv.cmd(&["PEXPIREAT", set, &soon.to_string()]);
    srv.cmd(&["PEXPIREAT", hash, &soon.to_string()]);
    srv.cmd(&["HSET", "redlease:{long}", "z", &soon.to_string()]);
    permit.extend(secs(20)).await.expect("extend");
    for key in [set, hash] {
        let left = srv.cmd(&["PTTL", key]).as_int().unwrap_or(-3);
        assert!(
            left > 30 * 60_000,
            "{key} lives {left} ms more, under a permit held for 20 s"
        );
    }
    assert!(pool.try_acquire().await.unwrap().is_none(), "the count");
}

/// A late copy of a permit's attempt, arriving after that permit's release (a command the
/// client re-sent after a reconnect), is not granted again while the name is held by permits:
/// the release is remembered, and nobody would hold the permit it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_of_a_released_permits_attempt_is_not_granted() {
    use redlease::backend::{Acquire, Attempt, Claim, ClaimKind, NodeTerms, Release};
    use redlease::Token;
    let store = Store::redis();
    let backend = store.backend().await;
    let key = LeaseKey::new("redlease:", "late");
    let claim = |token: Token| Claim::new(key.clone(), token, secs(10)).kind(ClaimKind::Permit(4));
    let (other, late) = (claim(Token::shared()), claim(Token::shared()));
    let once = |c: Claim| {
        let backend = backend.clone();
        async move { backend.acquire(&c, Attempt::Once, NodeTerms::new()).await }
    };
    assert!(matches!(once(other.clone()).await, Ok(Acquire::Granted(_))));
    let Ok(Acquire::Granted(grant)) = once(late.clone()).await else {
        panic!("a free permit was refused");
    };
    let released = backend
        .release(
            &late,
            Release::Confirmed {
                lease: &grant.lease,
            },
        )
        .await
        .expect("release");
    assert_eq!(released, Some(0));
    let copy = once(late.clone()).await.expect("the late copy's answer");
    assert!(
        matches!(copy, Acquire::Held { .. }),
        "a late copy of a released attempt: {copy:?}"
    );
    let pool = store
        .manager(LockOptions::new())
        .await
        .semaphore("late", 4)
        .expect("semaphore");
    assert_eq!(live(&pool).await, 1, "only the other permit is held");
}

/// The cases above that take a store, on PostgreSQL.
#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    /// The checker, smaller than in memory: at most 4 permit holders among 2 × 8 tasks,
    /// holders crashing now and then.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checker_at_most_n_holders_with_crashes() {
        let store = Store::postgres();
        let run = CheckerRun {
            managers: 2,
            tasks_per_manager: 8,
            permits: 4,
            sections: 400,
            ttl: ms(1000),
            crash_every: 50,
            kills_at: &[],
        };
        checker_run(&store, run, "postgres checker").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn crashed_permits_come_back_within_their_ttl() {
        super::crashed_permits_come_back_within_their_ttl(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_permits_are_extended_past_several_ttls_beside_crashed_ones() {
        super::live_permits_are_extended_past_several_ttls_beside_crashed_ones(Store::postgres())
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inspect_counts_permits_and_names_their_holders() {
        super::inspect_counts_permits_and_names_their_holders(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_acquirer_counts_with_its_own_permits() {
        super::each_acquirer_counts_with_its_own_permits(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphores_exclude_other_kinds_of_lock() {
        super::semaphores_exclude_other_kinds_of_lock(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_permit_has_a_greater_fencing_token() {
        super::each_permit_has_a_greater_fencing_token(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_waiters_leave_no_permit_behind() {
        super::dropped_waiters_leave_no_permit_behind(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zero_permits_and_fair_semaphores_are_refused() {
        super::zero_permits_and_fair_semaphores_are_refused(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_permit_not_extended_is_lost_and_its_release_says_so() {
        super::a_permit_not_extended_is_lost_and_its_release_says_so(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_release_wakes_a_local_waiter_that_can_use_the_permit() {
        super::a_release_wakes_a_local_waiter_that_can_use_the_permit(Store::postgres()).await;
    }
}
