//! Reentrant locks, on a real redis-server, in memory, and (where cheap) as Redlock over three
//! redis-servers: nesting, exclusion between owners and with plain locks, release in any
//! order, counts that never go below zero or count twice (replayed commands, stale guards,
//! dropped acquire futures), many tasks of two owners, one owner across two managers, and
//! the Redis layout (`<key>:owners` {owner: count}, expiring with the lease).
//!
//! Every wait is bounded; where a wake-up is the point, the fallback re-check is far longer
//! than the test's bound.

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redlease::backend::{Acquire, Attempt, Claim, ClaimKind, Grant, NodeTerms, Release};
use redlease::{
    Backend, Error, LeaseKey, LockGuard, LockManager, LockOptions, MemoryBackend, Owner,
    RedisBackend, RedisOptions, Redlock, RedlockOptions, RetryPolicy, Token,
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

/// Where the leases live. On Redis each manager has its own connection, as separate
/// processes would.
enum Store {
    Memory(MemoryBackend),
    Redis(RedisServer),
    RedlockRedis(Vec<RedisServer>),
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

    fn redlock() -> Self {
        Store::RedlockRedis((0..3).map(|_| RedisServer::start()).collect())
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        let redis_opts = || RedisOptions::new().command_timeout(ms(500));
        match self {
            Store::Memory(m) => Arc::new(m.clone()),
            #[cfg(feature = "postgres")]
            Store::Postgres(srv) => Arc::new(srv.backend().await),
            Store::Redis(srv) => Arc::new(
                RedisBackend::connect_with(&srv.url(), redis_opts())
                    .await
                    .unwrap(),
            ),
            Store::RedlockRedis(servers) => {
                let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                // Fresh servers: the restart guard (tests/redlock.rs) would keep them out of
                // every majority for a TTL.
                let options = RedlockOptions::new()
                    .restart_guard(false)
                    .node_timeout(ms(500));
                Arc::new(
                    Redlock::connect_with(&urls, redis_opts(), options)
                        .await
                        .unwrap(),
                )
            }
            #[cfg(feature = "etcd")]
            Store::Etcd(srv) => Arc::new(srv.backend().await),
        }
    }

    async fn manager(&self, options: LockOptions) -> LockManager {
        LockManager::with_options(self.backend().await, options).unwrap()
    }

    /// The servers whose raw state a test can read (none in memory).
    fn servers(&self) -> Vec<&RedisServer> {
        match self {
            Store::Memory(_) => Vec::new(),
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => Vec::new(),
            Store::Redis(srv) => vec![srv],
            Store::RedlockRedis(servers) => servers.iter().collect(),
            #[cfg(feature = "etcd")]
            Store::Etcd(_) => Vec::new(),
        }
    }

    /// The sum of `<key>:owners`'s values on every server (what an inspection reports as
    /// the reentrant count), or nothing in memory.
    fn counts(&self, key: &LeaseKey) -> Vec<i64> {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(srv) = self {
            return vec![srv.holds(key)];
        }
        #[cfg(feature = "postgres")]
        if let Store::Postgres(srv) = self {
            // The live reign's holds.
            let hex: String = key.as_str().bytes().map(|b| format!("{b:02x}")).collect();
            let n = srv.psql(&format!(
                "SELECT count(*) FROM redlease_lock l JOIN redlease_hold h ON h.key = l.key \
                 WHERE l.key = decode('{hex}', 'hex') AND l.owner IS NOT NULL \
                 AND l.expires_at > clock_timestamp()"
            ));
            return vec![n.parse().unwrap_or(0)];
        }
        self.servers()
            .iter()
            .map(|srv| owners_sum(srv, key))
            .collect()
    }

    /// Waits until the servers count `n` holds of `key`: the one server, or a majority of a
    /// Redlock's with none above `n` (a Redlock answers once a majority has; a node whose
    /// connection was not up yet was skipped and counts less).
    async fn expect_count(&self, key: &LeaseKey, n: i64) {
        let ok = |counts: &[i64]| {
            let agreeing = counts.iter().filter(|&&c| c == n).count();
            // Nothing to read in memory.
            counts.is_empty() || (agreeing > counts.len() / 2 && counts.iter().all(|&c| c <= n))
        };
        let seen = wait_for_async(SOON, || ok(&self.counts(key))).await;
        assert!(seen, "counts {:?}, expected {n}", self.counts(key));
    }

    /// Waits until `owner` has `n` holds of `key` counted: on every server, read from
    /// `<key>:owners`; in memory, by adding a probe hold through `backend` and taking it out.
    async fn wait_count(&self, backend: &Arc<dyn Backend>, key: &LeaseKey, owner: &Owner, n: i64) {
        if !matches!(self, Store::Memory(_)) {
            return self.expect_count(key, n).await;
        }
        let deadline = std::time::Instant::now() + SOON;
        loop {
            let ttl = Duration::from_secs(10);
            let probe = Claim::new(key.clone(), Token::hold(), ttl)
                .kind(ClaimKind::Reentrant(owner.clone()));
            let answer = backend
                .acquire(&probe, Attempt::Once, NodeTerms::new())
                .await
                .unwrap();
            let seen = match answer {
                Acquire::Granted(Grant {
                    hold_count, lease, ..
                }) => {
                    backend
                        .release(&probe, Release::Confirmed { lease: &lease })
                        .await
                        .unwrap();
                    let count = hold_count.expect("a reentrant grant carries its hold count");
                    i64::from(count) - 1
                }
                _ => -1,
            };
            if seen == n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "count {seen}, expected {n}"
            );
            support::sleep_async(ms(2)).await;
        }
    }

    /// On etcd, whether `key`'s reign is gone from the store (its holds go with its lease,
    /// which etcd keeps for whole seconds: a 200 ms TTL lasts about a second there).
    fn etcd_expired(&self, key: &LeaseKey) -> bool {
        #[cfg(feature = "etcd")]
        if let Store::Etcd(srv) = self {
            return srv.holds(key) == 0;
        }
        let _ = key;
        true
    }

    /// Waits until `guard`'s lease has expired in the store (it is not extended).
    async fn wait_expired(&self, guard: &LockGuard, key: &LeaseKey) {
        let until = guard.valid_until() + ms(20);
        let expired = wait_for_async(SOON, || {
            std::time::Instant::now() > until
                && self
                    .servers()
                    .iter()
                    .all(|srv| !support::held(srv, key.as_str()))
                && self.etcd_expired(key)
        })
        .await;
        assert!(expired, "the lease never expired");
    }
}

fn owners_sum(srv: &RedisServer, key: &LeaseKey) -> i64 {
    let reply = srv.cmd(&["HVALS", &key.derived("owners")]);
    reply
        .as_array()
        .unwrap_or_default()
        .iter()
        .map(|v| v.as_str().and_then(|s| s.parse::<i64>().ok()).unwrap_or(0))
        .sum()
}

/// 10 s TTL, and a fallback re-check of 30 s: a waiter served within the tests' bounds was
/// woken by the release. `acquire()` waits at most a minute: a wait with a limit rides out a
/// command that times out on a starved machine, where an unlimited one reports it at once.
fn opts() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(10))
        .retry(RetryPolicy::notify().max_delay(Duration::from_secs(30)))
        .wait_timeout(Some(Duration::from_secs(60)))
}

async fn nested_acquire_by_one_owner_does_not_deadlock(store: Store) {
    let locks = store.manager(opts()).await;
    let me = Owner::random();
    let lock = locks.lock("nested").reentrant(&me).unwrap();
    let outer = within("the outer acquire", lock.acquire()).await.unwrap();
    let middle = within("a nested acquire", lock.acquire()).await.unwrap();
    let inner = lock
        .try_acquire()
        .await
        .unwrap()
        .expect("a nested try_acquire");
    let timed = within("a nested acquire_timeout", lock.acquire_timeout(ms(500)))
        .await
        .unwrap();
    assert_eq!(
        [
            outer.hold_count(),
            middle.hold_count(),
            inner.hold_count(),
            timed.hold_count()
        ],
        [Some(1), Some(2), Some(3), Some(4)]
    );
    // One reign, one fencing token.
    for g in [&middle, &inner, &timed] {
        assert_eq!(g.fencing_token(), outer.fencing_token());
        assert_eq!(g.owner(), Some(&me));
        assert!(!g.is_lost());
    }
    let key = locks.lock("nested").key().clone();
    store.expect_count(&key, 4).await;
    // One watchdog registration for the four guards of the reign.
    assert_eq!(locks.watchdog_stats().leases, 1);
    for (g, left) in [(timed, 3), (inner, 2), (middle, 1), (outer, 0)] {
        assert_eq!(g.release().await.unwrap(), left);
    }
    assert!(locks.lock("nested").try_acquire().await.unwrap().is_some());
}

async fn another_owner_waits_for_the_outermost_guard(store: Store) {
    let a_locks = store.manager(opts()).await;
    let b_locks = store.manager(opts()).await;
    let (a, b) = (Owner::random(), Owner::random());
    let a_lock = a_locks.lock("outer").reentrant(&a).unwrap();
    let b_lock = b_locks.lock("outer").reentrant(&b).unwrap();
    let outer = a_lock.acquire().await.unwrap();
    let inner = a_lock.acquire().await.unwrap();
    assert!(b_lock.try_acquire().await.unwrap().is_none());
    let waiter = {
        let b_lock = b_lock.clone();
        tokio::spawn(async move { b_lock.acquire().await })
    };
    // The outer guard goes first: the inner one still holds the lock.
    assert_eq!(outer.release().await.unwrap(), 1);
    assert!(b_lock.try_acquire().await.unwrap().is_none());
    assert!(
        !waiter.is_finished(),
        "the other owner got in while a hold was left"
    );
    let fence = inner.fencing_token();
    assert_eq!(inner.release().await.unwrap(), 0);
    let theirs = within("the other owner's waiting acquire", waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(theirs.hold_count(), Some(1));
    assert!(
        theirs.fencing_token() > fence,
        "a new reign, a larger token"
    );
    assert!(a_lock.try_acquire().await.unwrap().is_none());
    theirs.release().await.unwrap();
}

async fn release_order_may_differ_from_acquire_order(store: Store) {
    let locks = store.manager(opts()).await;
    let key = locks.lock("order").key().clone();
    let lock = locks.lock("order").reentrant(&Owner::random()).unwrap();
    let g1 = lock.acquire().await.unwrap();
    let g2 = lock.acquire().await.unwrap();
    let g3 = lock.acquire().await.unwrap();
    assert_eq!(g2.release().await.unwrap(), 2);
    assert!(locks.lock("order").try_acquire().await.unwrap().is_none());
    assert_eq!(g1.release().await.unwrap(), 1);
    assert!(locks.lock("order").try_acquire().await.unwrap().is_none());
    store.expect_count(&key, 1).await;
    assert_eq!(g3.release().await.unwrap(), 0);
    // A Redlock answers once a majority has: the other nodes' releases may still be on
    // their way (a loaded machine), and each is waited for.
    for srv in store.servers() {
        let counts = || srv.cmd(&["EXISTS", &key.derived("owners"), &key.derived("holds")]);
        let gone = wait_for_async(SOON, || counts().as_int() == Some(0)).await;
        assert!(
            gone,
            "the reign's counts are deleted at zero: {:?}",
            counts()
        );
        let ended = wait_for_async(SOON, || !support::held(srv, key.as_str())).await;
        assert!(ended, "the lease ended at zero");
    }
    assert!(locks.lock("order").try_acquire().await.unwrap().is_some());
}

/// Replays at the backend, as a client re-sending commands after a reconnect would make
/// them: each hold counts once and leaves once; nothing goes below zero; a hold that was
/// abandoned is never counted, even by a late copy of its attempt.
async fn replayed_acquire_and_release_are_idempotent(store: Store) {
    let backend = store.backend().await;
    let key = LeaseKey::new("redlease:", "replay");
    let me = Owner::named("job-1234");
    let (ttl, once, terms) = (Duration::from_secs(10), Attempt::Once, NodeTerms::new());
    let (h1, h2) = (Token::hold(), Token::hold());
    // One hold of `me`, by `hold`.
    let claim =
        |hold: Token| Claim::new(key.clone(), hold, ttl).kind(ClaimKind::Reentrant(me.clone()));
    let acquire = |hold: Token| {
        let (backend, claim) = (backend.clone(), claim(hold));
        async move { backend.acquire(&claim, once, terms).await.unwrap() }
    };
    let counted = |r: &Acquire| match r {
        Acquire::Granted(Grant {
            hold_count, lease, ..
        }) => Some((*hold_count, lease.clone())),
        _ => None,
    };
    let first = acquire(h1.clone()).await;
    let (count, lease) = counted(&first).expect("granted");
    assert_eq!(
        (count, &lease),
        (Some(1), &h1),
        "the first hold is the lease token"
    );
    assert_eq!(
        counted(&acquire(h1.clone()).await),
        Some((Some(1), h1.clone()))
    );
    assert_eq!(
        counted(&acquire(h2.clone()).await),
        Some((Some(2), h1.clone()))
    );
    assert_eq!(
        counted(&acquire(h2.clone()).await),
        Some((Some(2), h1.clone()))
    );
    assert_eq!(
        counted(&acquire(h1.clone()).await),
        Some((Some(2), h1.clone()))
    );
    store.expect_count(&key, 2).await;
    let release = |hold: Token| {
        let (backend, claim, lease) = (backend.clone(), claim(hold), lease.clone());
        async move {
            backend
                .release(&claim, Release::Confirmed { lease: &lease })
                .await
        }
    };
    assert_eq!(release(h2.clone()).await.unwrap(), Some(1));
    assert_eq!(
        release(h2.clone()).await.unwrap(),
        Some(1),
        "a replayed release"
    );
    store.expect_count(&key, 1).await;
    assert_eq!(release(h1.clone()).await.unwrap(), Some(0));
    assert_eq!(
        release(h1.clone()).await.unwrap(),
        Some(0),
        "a replayed final release"
    );
    assert_eq!(release(h2.clone()).await.unwrap(), None, "never below zero");
    assert_eq!(release(Token::hold()).await.unwrap(), None, "never counted");
    // A new reign starts at one.
    let h3 = Token::hold();
    assert_eq!(
        counted(&acquire(h3.clone()).await),
        Some((Some(1), h3.clone()))
    );

    // Abandoned after it was counted: taken out, and a late copy is not counted again.
    let h4 = Token::hold();
    assert_eq!(
        counted(&acquire(h4.clone()).await).map(|c| c.0),
        Some(Some(2))
    );
    let left = backend
        .release(&claim(h4.clone()), Release::Abandon)
        .await
        .unwrap();
    assert_eq!(left, Some(1));
    assert!(counted(&acquire(h4.clone()).await).is_none(), "a late copy");
    store.expect_count(&key, 1).await;
    let left = backend
        .release(&claim(h3.clone()), Release::Confirmed { lease: &h3 })
        .await;
    assert_eq!(left.unwrap(), Some(0));
    // Abandoned before it arrived, on a free lock: the late copy starts no reign.
    let h5 = Token::hold();
    assert_eq!(
        backend
            .release(&claim(h5.clone()), Release::Abandon)
            .await
            .unwrap(),
        None
    );
    assert!(counted(&acquire(h5.clone()).await).is_none());

    // A reign whose first hold (its lease token) leaves first: the replayed release of the
    // nested hold that ended it still answers "released" (while no other reign holds).
    let (h6, h7) = (Token::hold(), Token::hold());
    assert_eq!(
        counted(&acquire(h6.clone()).await),
        Some((Some(1), h6.clone()))
    );
    assert_eq!(
        counted(&acquire(h7.clone()).await),
        Some((Some(2), h6.clone()))
    );
    let release_in = |hold: Token| {
        let (backend, claim, lease) = (backend.clone(), claim(hold), h6.clone());
        async move {
            backend
                .release(&claim, Release::Confirmed { lease: &lease })
                .await
        }
    };
    assert_eq!(release_in(h6.clone()).await.unwrap(), Some(1));
    assert_eq!(release_in(h7.clone()).await.unwrap(), Some(0));
    assert_eq!(
        release_in(h7.clone()).await.unwrap(),
        Some(0),
        "a replayed release of the nested hold that ended the reign"
    );

    let plain = backend
        .acquire(&Claim::new(key.clone(), Token::random(), ttl), once, terms)
        .await;
    assert!(
        matches!(plain.unwrap(), Acquire::Granted(_)),
        "the lock is free"
    );
}

/// A guard whose lease expired (no watchdog) and was taken by another owner, or by a new
/// reign of its own owner, cannot decrement that reign's count.
async fn stale_guard_cannot_decrement_the_new_reign(store: Store) {
    let short = opts().ttl(ms(200)).watchdog(false);
    let a_locks = store.manager(short.clone()).await;
    let b_locks = store
        .manager(short.clone().ttl(Duration::from_secs(10)))
        .await;
    let (a, b) = (Owner::random(), Owner::random());
    let key = a_locks.lock("stale").key().clone();
    let stale = a_locks
        .lock("stale")
        .reentrant(&a)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let b_lock = b_locks.lock("stale").reentrant(&b).unwrap();
    // Another owner gets in once the lease has expired (it is never extended).
    let b1 = within("the other owner", b_lock.acquire()).await.unwrap();
    let b2 = b_lock.acquire().await.unwrap();
    assert!(stale.is_lost(), "its deadline has passed");
    assert!(matches!(stale.release().await, Err(Error::NotHeld)));
    store.expect_count(&key, 2).await;
    assert_eq!(b1.release().await.unwrap(), 1);
    assert_eq!(b2.release().await.unwrap(), 0);

    // The same owner's new reign: the old guard's hold is not counted in it.
    let old = a_locks
        .lock("stale")
        .reentrant(&a)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    store.wait_expired(&old, &key).await;
    let a_again = b_locks.lock("stale").reentrant(&a).unwrap();
    let new = within("a new reign of the same owner", a_again.acquire())
        .await
        .unwrap();
    assert_eq!(new.hold_count(), Some(1), "a new reign starts at one");
    assert!(new.fencing_token() > old.fencing_token());
    assert!(matches!(old.release().await, Err(Error::NotHeld)));
    assert_eq!(new.release().await.unwrap(), 0);
}

async fn plain_and_reentrant_exclude_each_other(store: Store) {
    let locks = store.manager(opts()).await;
    let plain = locks.lock("mixed");
    let me = Owner::random();
    let mine = locks.lock("mixed").reentrant(&me).unwrap();
    let held = mine.acquire().await.unwrap();
    assert!(plain.try_acquire().await.unwrap().is_none());
    // A plain waiter is woken by the reentrant owner's last release (fallback: 30 s).
    let plain_waiter = {
        let plain = plain.clone();
        tokio::spawn(async move { plain.acquire().await })
    };
    let inner = mine.acquire().await.unwrap();
    held.release().await.unwrap();
    assert!(plain.try_acquire().await.unwrap().is_none());
    inner.release().await.unwrap();
    let plain_held = within("the plain waiter", plain_waiter)
        .await
        .unwrap()
        .unwrap();
    // The other way round: neither this owner nor another gets a plain holder's lock.
    assert!(mine.try_acquire().await.unwrap().is_none());
    let theirs = locks.lock("mixed").reentrant(&Owner::random()).unwrap();
    assert!(theirs.try_acquire().await.unwrap().is_none());
    let waiter = {
        let mine = mine.clone();
        tokio::spawn(async move { mine.acquire().await })
    };
    let fence = plain_held.fencing_token();
    plain_held.release().await.unwrap();
    let g = within("the reentrant waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(g.fencing_token() > fence);
    assert_eq!(g.release().await.unwrap(), 0);
}

/// Acquire futures dropped at any point, while the owner holds the lock (re-entries) or
/// while another owner holds it (waiters): once the background clean-up has run, the count
/// is what the live guards make, and the last release frees the lock (a hold left behind
/// would keep it held for the 30 s TTL, past the test's bound).
async fn dropped_acquire_futures_leave_the_count_right(store: Store) {
    let locks = store.manager(opts().ttl(Duration::from_secs(30))).await;
    let other_locks = store.manager(opts().ttl(Duration::from_secs(30))).await;
    let key = locks.lock("cancel").key().clone();
    let (me, other) = (Owner::random(), Owner::random());
    let lock = locks.lock("cancel").reentrant(&me).unwrap();
    let theirs = other_locks.lock("cancel").reentrant(&other).unwrap();
    let held = lock.acquire().await.unwrap();
    for i in 0..20 {
        // Polled once (the attempt is sent), then dropped; or cut off by a timeout.
        if i % 2 == 0 {
            let mut fut = Box::pin(lock.acquire());
            let _ = futures::poll!(fut.as_mut());
        } else {
            let _ = tokio::time::timeout(Duration::from_micros(i * 50), lock.acquire()).await;
        }
        // The other owner's waits, given up too.
        let _ = tokio::time::timeout(ms(5), theirs.acquire()).await;
    }
    store.wait_count(locks.backend(), &key, &me, 1).await;
    assert_eq!(
        held.release().await.unwrap(),
        0,
        "only the live guard was left"
    );
    let g = within("the other owner", theirs.acquire()).await.unwrap();
    assert_eq!(g.hold_count(), Some(1));
    g.release().await.unwrap();
}

/// 16 tasks of one owner and 16 of another, over two managers each (as four processes):
/// never both owners at once.
///
/// A section of the checker is one owner's continuous hold as that owner sees it: entered
/// when its first local guard appears, exited before the release that takes its last one
/// (run under the owner's local mutex, so that the count does not change meanwhile). A hold
/// counted while that release was on its way keeps the reign going, so a reign may span
/// several sections: the checker's token is the fencing token times 1000 plus the section's
/// number within the reign, which keeps the checker's "strictly increasing" meaningful.
async fn sixteen_tasks_of_two_owners_never_overlap(store: Store) {
    #[derive(Default)]
    struct Local {
        count: u32,
        section: Option<support::Section>,
        fence: u64,
        sections: u64,
    }
    let checker = Checker::new();
    let owners = [Owner::named("job-a"), Owner::named("job-b")];
    let go = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for owner in &owners {
        let local = Arc::new(tokio::sync::Mutex::new(Local::default()));
        for m in 0..2 {
            let locks = store.manager(opts().ttl(Duration::from_secs(5))).await;
            for _ in 0..8 {
                let lock = locks.lock("sixteen").reentrant(owner).unwrap();
                let (checker, local, go) = (checker.clone(), local.clone(), go.clone());
                tasks.push(tokio::spawn(async move {
                    go.wait().await;
                    for round in 0..4 {
                        let g = lock.acquire().await.unwrap();
                        // Sometimes nest once more.
                        let nested = if round % 2 == m {
                            Some(lock.acquire().await.unwrap())
                        } else {
                            None
                        };
                        {
                            let mut l = local.lock().await;
                            if l.count == 0 {
                                if l.fence != g.fencing_token() {
                                    l.fence = g.fencing_token();
                                    l.sections = 0;
                                }
                                let token = l.fence * 1000 + l.sections;
                                l.sections += 1;
                                l.section = Some(checker.enter(token));
                            }
                            l.count += 1;
                        }
                        tokio::task::yield_now().await;
                        if let Some(n) = nested {
                            n.release().await.unwrap();
                        }
                        let mut l = local.lock().await;
                        l.count -= 1;
                        if l.count == 0 {
                            if let Some(section) = l.section.take() {
                                section.exit();
                            }
                        }
                        g.release().await.unwrap();
                    }
                }));
            }
        }
    }
    for t in tasks {
        within("worker", t).await.unwrap();
    }
    assert_eq!(checker.violations(), 0);
    checker.assert_ok();
    assert!(checker.sections() >= 2, "both owners got in");
}

/// Two managers (separate connections, as two processes) acting for one named owner hold
/// the lock at once; the lease lives, kept by the watchdog, until both have released.
async fn one_named_owner_across_two_managers(store: Store) {
    let short = opts().ttl(ms(300));
    let m1 = store.manager(short.clone()).await;
    let m2 = store.manager(short.clone()).await;
    let others = store.manager(short).await;
    let job = Owner::named("job-1234");
    let g1 = m1
        .lock("shared")
        .reentrant(&job)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let second = m2.lock("shared").reentrant(&job).unwrap();
    let g2 = within("the second process", second.acquire())
        .await
        .unwrap();
    assert_eq!(g2.hold_count(), Some(2));
    assert_eq!(g1.fencing_token(), g2.fencing_token());
    let other = others.lock("shared").reentrant(&Owner::random()).unwrap();
    assert!(other.try_acquire().await.unwrap().is_none());
    assert_eq!(g1.release().await.unwrap(), 1);
    // Held for several TTLs more by the second manager's watchdog alone.
    let before = m2.watchdog_stats().extended;
    let kept = wait_for_async(SOON, || m2.watchdog_stats().extended >= before + 4).await;
    assert!(kept, "the watchdog did not extend");
    assert!(!g2.is_lost());
    assert!(other.try_acquire().await.unwrap().is_none());
    assert!(others.lock("shared").try_acquire().await.unwrap().is_none());
    assert_eq!(g2.release().await.unwrap(), 0);
    let g = within("the other owner", other.acquire()).await.unwrap();
    g.release().await.unwrap();
}

/// Refused when the lock is made (`reentrant()` / `fair()`), whichever comes first.
async fn fair_and_reentrant_is_invalid_config(store: Store) {
    let locks = store.manager(opts()).await;
    let fifo = locks.lock("fifo").fair().unwrap();
    match fifo.reentrant(&Owner::random()) {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("fair and reentrant"), "{msg}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    let held_by_me = locks.lock("fifo").reentrant(&Owner::random()).unwrap();
    match held_by_me.fair() {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("fair and reentrant"), "{msg}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    let nameless = locks.lock("fifo").reentrant(&Owner::named(""));
    assert!(matches!(nameless, Err(Error::InvalidConfig(_))));
    assert!(locks.lock("fifo").try_acquire().await.unwrap().is_some());
}

macro_rules! stores {
    ($store:ident: $($case:ident),* $(,)?) => {
        mod $store {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Store::$store()).await
                }
            )*
        }
    };
}

stores!(memory:
    nested_acquire_by_one_owner_does_not_deadlock,
    another_owner_waits_for_the_outermost_guard,
    release_order_may_differ_from_acquire_order,
    replayed_acquire_and_release_are_idempotent,
    stale_guard_cannot_decrement_the_new_reign,
    plain_and_reentrant_exclude_each_other,
    dropped_acquire_futures_leave_the_count_right,
    sixteen_tasks_of_two_owners_never_overlap,
    one_named_owner_across_two_managers,
    fair_and_reentrant_is_invalid_config,
);

stores!(redis:
    nested_acquire_by_one_owner_does_not_deadlock,
    another_owner_waits_for_the_outermost_guard,
    release_order_may_differ_from_acquire_order,
    replayed_acquire_and_release_are_idempotent,
    stale_guard_cannot_decrement_the_new_reign,
    plain_and_reentrant_exclude_each_other,
    dropped_acquire_futures_leave_the_count_right,
    sixteen_tasks_of_two_owners_never_overlap,
    one_named_owner_across_two_managers,
    fair_and_reentrant_is_invalid_config,
);

#[cfg(feature = "etcd")]
stores!(etcd:
    nested_acquire_by_one_owner_does_not_deadlock,
    another_owner_waits_for_the_outermost_guard,
    release_order_may_differ_from_acquire_order,
    replayed_acquire_and_release_are_idempotent,
    stale_guard_cannot_decrement_the_new_reign,
    plain_and_reentrant_exclude_each_other,
    dropped_acquire_futures_leave_the_count_right,
    sixteen_tasks_of_two_owners_never_overlap,
    one_named_owner_across_two_managers,
    fair_and_reentrant_is_invalid_config,
);

#[cfg(feature = "postgres")]
stores!(postgres:
    nested_acquire_by_one_owner_does_not_deadlock,
    another_owner_waits_for_the_outermost_guard,
    release_order_may_differ_from_acquire_order,
    replayed_acquire_and_release_are_idempotent,
    stale_guard_cannot_decrement_the_new_reign,
    plain_and_reentrant_exclude_each_other,
    dropped_acquire_futures_leave_the_count_right,
    sixteen_tasks_of_two_owners_never_overlap,
    one_named_owner_across_two_managers,
    fair_and_reentrant_is_invalid_config,
);

stores!(redlock:
    nested_acquire_by_one_owner_does_not_deadlock,
    another_owner_waits_for_the_outermost_guard,
    release_order_may_differ_from_acquire_order,
    replayed_acquire_and_release_are_idempotent,
    plain_and_reentrant_exclude_each_other,
    dropped_acquire_futures_leave_the_count_right,
    one_named_owner_across_two_managers,
);

// ---------------------------------------------------------------------------------------
// Redis only: what the server sees.
// ---------------------------------------------------------------------------------------

/// The reign's keys share the lock's hash tag, carry one TTL, and the watchdog keeps all of
/// them alive (not only the lease key) for many TTLs; `<key>:owners` is {owner: count}.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_layout_is_one_hash_tag_and_the_watchdog_keeps_it_whole() {
    let srv = RedisServer::start();
    let store = Store::Redis(srv);
    let locks = store.manager(opts().ttl(ms(300))).await;
    let job = Owner::named("job-7");
    let lock = locks.lock("layout").reentrant(&job).unwrap();
    let key = locks.lock("layout").key().clone();
    let g1 = lock.acquire().await.unwrap();
    let g2 = lock.acquire().await.unwrap();
    let srv = &store.servers()[0];
    let owners = key.derived("owners");
    let holds = key.derived("holds");
    assert_eq!(owners, "redlease:{layout}:owners");
    assert_eq!(srv.cmd(&["HGET", &owners, "job-7"]).as_int(), Some(2));
    assert_eq!(srv.cmd(&["HLEN", &owners]).as_int(), Some(1));
    // Two holds plus owner, token and fence.
    assert_eq!(srv.cmd(&["HLEN", &holds]).as_int(), Some(5));
    let before = locks.watchdog_stats().extended;
    let kept = wait_for_async(SOON, || locks.watchdog_stats().extended >= before + 6).await;
    assert!(kept, "the watchdog did not extend");
    let left = support::lease_ms(srv, key.as_str());
    assert!(left > 0 && left <= 300, "the lease's time left {left}");
    for k in [&owners, &holds] {
        let pttl = srv.cmd(&["PTTL", k]).as_int().unwrap();
        assert!(pttl > 0 && pttl <= 300, "{k} PTTL {pttl}");
    }
    assert_eq!(owners_sum(srv, &key), 2);
    assert!(!g1.is_lost() && !g2.is_lost());
    g1.release().await.unwrap();
    g2.release().await.unwrap();
    let gone = srv.cmd(&["EXISTS", &owners, &holds]);
    assert_eq!(gone.as_int(), Some(0));
    assert!(!support::held(srv, key.as_str()));
}

/// A lost lease (deleted under the holder, as a failover could) marks every guard of the
/// reign lost, through its one watchdog registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_marks_every_guard_of_the_reign_lost() {
    let store = Store::redis();
    let locks = store.manager(opts().ttl(ms(300))).await;
    let lock = locks.lock("lost").reentrant(&Owner::random()).unwrap();
    let key = locks.lock("lost").key().clone();
    let g1 = lock.acquire().await.unwrap();
    let g2 = lock.acquire().await.unwrap();
    let (l1, l2) = (g1.lost(), g2.lost());
    store.servers()[0].cmd(&["DEL", key.as_str()]);
    within("the first guard's lost signal", l1).await;
    within("the second guard's lost signal", l2).await;
    assert!(g1.is_lost() && g2.is_lost());
    assert!(matches!(g1.release().await, Err(Error::NotHeld)));
    assert!(matches!(g2.release().await, Err(Error::NotHeld)));
}

// ---------------------------------------------------------------------------------------
// A backend without reentrant locks.
// ---------------------------------------------------------------------------------------

// (`support::plain_only`.)

/// Refused when the lock is made, whatever the handle came from and whoever the owner.
#[tokio::test]
async fn reentrant_over_an_unsupported_backend_is_unsupported() {
    let locks = LockManager::new(plain_only());
    let tuned = locks.lock_with("x", |o| o.ttl(ms(500))).unwrap();
    for result in [
        locks.lock("x").reentrant(&Owner::random()),
        locks.lock("x").reentrant(&Owner::named("job-1234")),
        tuned.reentrant(&Owner::random()),
    ] {
        match result {
            Err(Error::Unsupported(msg)) => {
                assert!(msg.contains("reentrant locks are not supported"), "{msg}");
                assert!(msg.contains("PlainOnly"), "names the backend: {msg}");
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }
    assert!(locks.lock("x").try_acquire().await.unwrap().is_some());
}

// ---------------------------------------------------------------------------------------
// Guard features that one engine and one guard now give reentrant holds too: the holder
// label, a maximum hold, a manual extend, and forget.
// ---------------------------------------------------------------------------------------

/// The reign's label (the options' `holder_label`) is what an inspection shows while any
/// hold of the reign lives, and it goes with the last release.
async fn holder_label_shows_while_the_reign_holds(store: Store) {
    let locks = store.manager(opts().holder_label("worker-7:42")).await;
    let lock = locks.lock("labelled").reentrant(&Owner::random()).unwrap();
    let outer = lock.acquire().await.unwrap();
    let inner = lock.acquire().await.unwrap();
    let during = lock.inspect().await.unwrap().expect("held");
    assert!(during.held, "{during:?}");
    assert_eq!(
        during.holder_label.as_deref(),
        Some("worker-7:42"),
        "{during:?}"
    );
    assert_eq!(during.reentrant_count, Some(2), "{during:?}");
    // One hold left: still the reign's label.
    assert_eq!(inner.release().await.unwrap(), 1);
    let still = lock.inspect().await.unwrap().expect("held");
    assert_eq!(
        still.holder_label.as_deref(),
        Some("worker-7:42"),
        "{still:?}"
    );
    assert_eq!(outer.release().await.unwrap(), 0);
    let after = lock
        .inspect()
        .await
        .unwrap()
        .expect("the fence is remembered");
    assert!(!after.held, "{after:?}");
    assert_eq!(
        after.holder_label, None,
        "the label went with the reign: {after:?}"
    );
    let key = lock.key().clone();
    for srv in store.servers() {
        let label = support::field(srv, key.as_str(), "h");
        assert!(label.as_deref().is_none_or(str::is_empty), "{label:?}");
    }
}

/// A reign capped by `max_hold` is extended by the watchdog past its first ttl, then runs
/// out at the cap: every guard of the reign turns lost then, and another owner gets in.
async fn max_hold_ends_a_reign(store: Store) {
    let (ttl, cap) = (ms(300), ms(700));
    let locks = store.manager(opts().ttl(ttl).max_hold(cap)).await;
    let others = store.manager(opts()).await;
    let lock = locks.lock("capped").reentrant(&Owner::random()).unwrap();
    let began = std::time::Instant::now();
    let outer = lock.acquire().await.unwrap();
    let inner = lock.acquire().await.unwrap();
    assert_eq!(inner.hold_count(), Some(2));
    let (outer_lost, inner_lost) = (outer.lost(), inner.lost());
    within("the outer guard's lost signal", outer_lost).await;
    let outer_at = began.elapsed();
    within("the inner guard's lost signal", inner_lost).await;
    let inner_at = began.elapsed();
    assert!(outer.is_lost() && inner.is_lost());
    for at in [outer_at, inner_at] {
        // Not at the first ttl (the watchdog extended the reign), and not past the cap by
        // more than a watchdog tick.
        assert!(
            at >= cap - ms(100) && at <= cap + ms(150),
            "lost after {at:?}; ttl {ttl:?}, cap {cap:?}"
        );
    }
    // The store agrees: the reign ran out at the cap, and another owner takes the lock.
    let theirs = others.lock("capped").reentrant(&Owner::random()).unwrap();
    let next = theirs
        .acquire_timeout(ms(500))
        .await
        .expect("the capped reign ran out");
    assert!(next.fencing_token() > outer.fencing_token());
    assert!(matches!(inner.release().await, Err(Error::NotHeld)));
    assert!(matches!(outer.release().await, Err(Error::NotHeld)));
    assert_eq!(next.release().await.unwrap(), 0);
}

/// With the watchdog off, one hold's `extend` extends the reign's lease: the other guard of
/// the reign is valid longer too, and the store keeps the reign past the first ttl.
async fn extend_on_a_hold_extends_the_reign(store: Store) {
    let ttl = ms(300);
    let locks = store.manager(opts().ttl(ttl).watchdog(false)).await;
    let others = store.manager(opts()).await;
    let lock = locks.lock("extended").reentrant(&Owner::random()).unwrap();
    let key = lock.key().clone();
    let outer = lock.acquire().await.unwrap();
    let inner = lock.acquire().await.unwrap();
    let first = outer.valid_until();
    assert!(first <= std::time::Instant::now() + ttl);
    inner.extend(Duration::from_secs(5)).await.unwrap();
    // The outer guard shares the reign's lease: its validity moved as well.
    assert!(
        outer.valid_until() >= first + Duration::from_secs(4),
        "the outer guard's validity did not move: {:?} after the first",
        outer.valid_until().saturating_duration_since(first)
    );
    // Past the first ttl (time passing is the point here: there is no event to await).
    tokio::time::sleep_until((first + ttl).into()).await;
    assert!(!outer.is_lost() && !inner.is_lost());
    let info = lock.inspect().await.unwrap().expect("held");
    assert!(info.held, "{info:?}");
    assert_eq!(info.reentrant_count, Some(2), "{info:?}");
    let left = info.remaining.expect("a held lease has a TTL");
    assert!(left > Duration::from_secs(3), "ttl left {left:?}");
    // The reign's three keys were extended together.
    for srv in store.servers() {
        let left = support::lease_ms(srv, key.as_str());
        assert!(left > 3000, "the lease's time left {left}");
        for k in [&key.derived("owners"), &key.derived("holds")] {
            let pttl = srv.cmd(&["PTTL", k]).as_int().unwrap();
            assert!(pttl > 3000, "{k} PTTL {pttl}");
        }
    }
    let theirs = others.lock("extended").reentrant(&Owner::random()).unwrap();
    assert!(theirs.try_acquire().await.unwrap().is_none());
    assert_eq!(inner.release().await.unwrap(), 1);
    assert_eq!(outer.release().await.unwrap(), 0);
    assert!(theirs.try_acquire().await.unwrap().is_some());
}

/// A forgotten hold is not released: it stays counted in the reign, which keeps the lock
/// until the ttl runs out (the watchdog is off).
async fn a_forgotten_hold_stays_counted_until_the_ttl(store: Store) {
    let locks = store.manager(opts().ttl(ms(400)).watchdog(false)).await;
    let others = store.manager(opts()).await;
    let lock = locks.lock("forgotten").reentrant(&Owner::random()).unwrap();
    let outer = lock.acquire().await.unwrap();
    let inner = lock.acquire().await.unwrap();
    let expiry = outer.valid_until();
    let fence = inner.forget();
    assert_eq!(fence, outer.fencing_token());
    let info = lock.inspect().await.unwrap().expect("held");
    assert_eq!(info.reentrant_count, Some(2), "{info:?}");
    assert_eq!(
        outer.release().await.unwrap(),
        1,
        "the forgotten hold is still counted"
    );
    let info = lock.inspect().await.unwrap().expect("held");
    assert!(info.held, "{info:?}");
    assert_eq!(info.reentrant_count, Some(1), "{info:?}");
    let theirs = others
        .lock("forgotten")
        .reentrant(&Owner::random())
        .unwrap();
    assert!(theirs.try_acquire().await.unwrap().is_none());
    let next = within("the other owner, after the ttl", theirs.acquire())
        .await
        .unwrap();
    assert!(
        std::time::Instant::now() >= expiry,
        "the other owner got in before the forgotten hold's ttl ran out"
    );
    assert!(next.fencing_token() > fence);
    assert_eq!(next.hold_count(), Some(1));
    assert_eq!(next.release().await.unwrap(), 0);
}

macro_rules! guard_features {
    ($($case:ident => $memory:ident, $redis:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $memory() {
                $case(Store::memory()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $redis() {
                $case(Store::redis()).await
            }
        )*
    };
}

guard_features! {
    holder_label_shows_while_the_reign_holds =>
        reentrant_holder_label_shows_while_held_in_memory,
        reentrant_holder_label_shows_while_held_on_redis;
    max_hold_ends_a_reign =>
        max_hold_ends_a_reign_and_fires_lost_on_every_guard_in_memory,
        max_hold_ends_a_reign_and_fires_lost_on_every_guard_on_redis;
    extend_on_a_hold_extends_the_reign =>
        extend_on_a_reentrant_hold_extends_the_reign_in_memory,
        extend_on_a_reentrant_hold_extends_the_reign_on_redis;
    a_forgotten_hold_stays_counted_until_the_ttl =>
        forget_on_a_reentrant_hold_leaves_it_counted_in_memory,
        forget_on_a_reentrant_hold_leaves_it_counted_on_redis;
}

/// `max_hold` covers a manual `extend` of a reign too (as `LockOptions::max_hold` says: "the
/// watchdog's next round brings a longer expiry back to the cap"): the guard is lost at the
/// cap, and the store frees the lock then, not when the long extension would have run out.
async fn max_hold_caps_a_manual_extend_of_a_reign(store: Store) {
    let (ttl, cap) = (ms(300), ms(700));
    let locks = store.manager(opts().ttl(ttl).max_hold(cap)).await;
    let others = store.manager(opts()).await;
    let lock = locks
        .lock("capped-ext")
        .reentrant(&Owner::random())
        .unwrap();
    let began = std::time::Instant::now();
    let g = lock.acquire().await.unwrap();
    g.extend(Duration::from_secs(10)).await.unwrap();
    within("the lost signal", g.lost()).await;
    let lost_at = began.elapsed();
    assert!(
        lost_at <= cap + ms(150),
        "lost after {lost_at:?}, cap {cap:?}"
    );
    // Within a tick or two of the cap, not 10 s later.
    let theirs = others
        .lock("capped-ext")
        .reentrant(&Owner::random())
        .unwrap();
    let next = theirs.acquire_timeout(ms(500)).await;
    let info = lock.inspect().await.unwrap();
    let next = next.unwrap_or_else(|e| {
        panic!(
            "the reign outlived its max_hold ({e}): lost after {lost_at:?}, cap {cap:?}; \
             the store still has {info:?}"
        )
    });
    assert!(next.fencing_token() > g.fencing_token());
    assert_eq!(next.release().await.unwrap(), 0);
}

guard_features! {
    max_hold_caps_a_manual_extend_of_a_reign =>
        max_hold_caps_a_manual_extend_of_a_reign_in_memory,
        max_hold_caps_a_manual_extend_of_a_reign_on_redis;
}
