//! Runtime features: redlease under tokio, smol and async-std, under no runtime at all, and
//! with guards that outlive (or are dropped away from) the runtime they were acquired on.
//!
//! Every test runs against a real `redis-server` from the harness; the MemoryBackend runs
//! the same checks where noted. The rule under test (src/runtime.rs): inside a tokio runtime
//! tokio is used; otherwise smol if enabled, else async-std, else a private tokio runtime.
//!
//! Run per feature set:
//!
//! ```text
//! cargo test --test runtimes
//! cargo test --test runtimes --no-default-features --features smol
//! cargo test --test runtimes --no-default-features --features async-std
//! cargo test --test runtimes --all-features
//! ```

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{self, Either};
use redlease::backend::{Backend, Claim, Subscription};
use redlease::{
    Lock, LockGuard, LockManager, LockOptions, MemoryBackend, RedisBackend, RetryPolicy,
};
use support::{
    held, lease_ms, sleep_async, wait_for, wait_for_async, RedisServer, Resp, Wrap, Wrapped,
};

/// Bound for every wait on an event (a key disappearing, a waiter subscribing, ...).
const EVENTUALLY: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Whether a tokio runtime is entered on the calling thread.
fn in_tokio() -> bool {
    tokio::runtime::Handle::try_current().is_ok()
}

/// Subscribers of `channel` on the server (PUBSUB NUMSUB).
fn numsub(srv: &RedisServer, channel: &str) -> i64 {
    let reply = srv.cmd(&["PUBSUB", "NUMSUB", channel]);
    reply
        .as_array()
        .and_then(|a| a.get(1))
        .and_then(Resp::as_int)
        .unwrap_or_else(|| panic!("PUBSUB NUMSUB {channel} replied {reply:?}"))
}

fn key_of(locks: &LockManager, name: &str) -> String {
    locks.lock(name).key().as_str().to_owned()
}

/// Polls the async predicate `f` (every 2 ms, on a runtime-agnostic timer) until it holds
/// or `timeout` passes; returns whether it held.
async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        sleep_async(Duration::from_millis(2)).await;
    }
}

async fn connect(srv: &RedisServer) -> RedisBackend {
    RedisBackend::connect(&srv.url())
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", srv.url()))
}

/// A MemoryBackend that counts `subscribe` calls, so a test can wait until a waiter is
/// really blocked on a release instead of guessing with a sleep.
#[derive(Clone, Debug, Default)]
struct WatchedMemory {
    inner: MemoryBackend,
    subscribes: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Wrap for WatchedMemory {
    fn inner(&self) -> &dyn Backend {
        &self.inner
    }

    async fn subscribe(&self, claim: &Claim) -> redlease::Result<Subscription> {
        self.subscribes.fetch_add(1, Ordering::SeqCst);
        self.inner.subscribe(claim).await
    }
}

/// Where the leases live, and how a test observes them from outside the lock API.
enum Store<'a> {
    Redis(&'a RedisServer),
    Memory(Arc<AtomicUsize>),
}

impl Store<'_> {
    /// Whether lock `name` is held in the store. On Redis: its record holds a lease that has
    /// not run out (the record itself outlives the lease by an hour). In memory (not
    /// observable from outside): `other` cannot take it (if it can, it gives it back).
    async fn held(&self, other: &LockManager, name: &str) -> bool {
        match self {
            Store::Redis(srv) => held(srv, &key_of(other, name)),
            Store::Memory(_) => match other.lock(name).try_acquire().await {
                Ok(Some(g)) => {
                    g.release().await.expect("give back a probe acquisition");
                    false
                }
                Ok(None) => true,
                Err(e) => panic!("probe try_acquire failed: {e}"),
            },
        }
    }

    /// Waits until a waiter on `lock` has subscribed to its release channel, i.e. is
    /// blocked waiting for the release.
    async fn waiter_subscribed(&self, lock: &Lock) -> bool {
        match self {
            Store::Redis(srv) => {
                let channel = lock.key().derived("released");
                wait_for_async(EVENTUALLY, || numsub(srv, &channel) >= 1).await
            }
            Store::Memory(n) => wait_for_async(EVENTUALLY, || n.load(Ordering::SeqCst) >= 1).await,
        }
    }
}

/// What the waiter task reports: whether it ran inside a tokio runtime, and the fencing
/// token it got.
type Waited = (bool, redlease::Result<u64>);
type Task = futures::future::BoxFuture<'static, Waited>;

/// How the test's runtime runs a second task, and whether tasks there see a tokio runtime.
#[derive(Clone, Copy)]
struct Env {
    spawn: fn(Task) -> Task,
    tokio: bool,
}

#[cfg(feature = "smol")]
const SMOL: Env = Env {
    spawn: |t| Box::pin(smol::spawn(t)),
    tokio: false,
};

#[cfg(feature = "async-std")]
const ASYNC_STD: Env = Env {
    spawn: |t| Box::pin(async_std::task::spawn(t)),
    tokio: false,
};

const TOKIO: Env = Env {
    spawn: |t| Box::pin(async move { tokio::spawn(t).await.expect("waiter task panicked") }),
    tokio: true,
};

/// No executor to spawn on: the waiter runs concurrently in the caller's own `join`.
const INLINE: Env = Env {
    spawn: |t| t,
    tokio: false,
};

/// The smoke run on every runtime, against a real Redis server.
async fn redis_smoke(srv: &RedisServer, env: Env) {
    assert_eq!(
        in_tokio(),
        env.tokio,
        "tokio context on the caller's thread"
    );
    let a = LockManager::new(connect(srv).await);
    let b = LockManager::new(connect(srv).await);
    smoke(&Store::Redis(srv), &a, &b, env).await;
}

/// The same smoke on the MemoryBackend (two managers sharing one store).
async fn memory_smoke(env: Env) {
    assert_eq!(
        in_tokio(),
        env.tokio,
        "tokio context on the caller's thread"
    );
    let mem = Wrapped(WatchedMemory::default());
    let subscribes = mem.subscribes.clone();
    let a = LockManager::new(mem.clone());
    let b = LockManager::new(mem);
    smoke(&Store::Memory(subscribes), &a, &b, env).await;
}

/// acquire, contention, a waiter woken by release, the watchdog, `lost()` by its own timer,
/// release by drop. `a` and `b` are two managers on the same store.
async fn smoke(store: &Store<'_>, a: &LockManager, b: &LockManager, env: Env) {
    // Acquire.
    let name = "smoke";
    let g1 = a.lock(name).acquire().await.expect("acquire");
    let t1 = g1.fencing_token();
    assert!(!g1.is_lost());
    assert!(
        store.held(b, name).await,
        "acquired, yet not held in the store"
    );

    // Contention: a second manager gets None.
    let other = b.lock(name).try_acquire().await.expect("try_acquire");
    assert!(other.is_none(), "a second manager got a held lock");

    // A waiter on a second task, blocked in acquire_timeout, is woken by the release. Its
    // fallback re-check comes only after max_delay (10 s) or the holder's TTL (30 s), both
    // past its 5 s timeout: it can only get the lock in time through the release.
    let waiter_lock = b
        .lock_with(name, |o| {
            o.retry(RetryPolicy::notify().max_delay(Duration::from_secs(10)))
        })
        .expect("valid lock options");
    let probe = waiter_lock.clone();
    let waiter = (env.spawn)(Box::pin(async move {
        let ctx = in_tokio();
        let got = async {
            let g = waiter_lock.acquire_timeout(Duration::from_secs(5)).await?;
            let t = g.fencing_token();
            g.release().await?;
            Ok(t)
        };
        (ctx, got.await)
    }));
    let releaser = async {
        assert!(
            store.waiter_subscribed(&probe).await,
            "the waiter never blocked waiting for a release"
        );
        g1.release().await.expect("release");
    };
    let ((waiter_ctx, waited), ()) = futures::join!(waiter, releaser);
    let t2 = waited.expect("the waiter did not get the lock after the release");
    assert!(t2 > t1, "fencing tokens must increase: {t1} then {t2}");
    assert_eq!(
        waiter_ctx, env.tokio,
        "tokio context inside the waiter task"
    );
    assert!(
        !store.held(b, name).await,
        "both holders released, yet still held"
    );

    // The watchdog keeps a lease alive past three TTLs and five extensions, however long a
    // loaded machine takes to make them (bounded only against a hang), `b` finding it held
    // all along. A lease is lost, rightly, when its holder goes a TTL without an extension:
    // the TTL (1 s) is long enough that a starved machine does not stall that long.
    let wd = "watchdog";
    let ttl = Duration::from_secs(1);
    let g = a
        .lock_with(wd, |o| o.ttl(ttl))
        .expect("valid lock options")
        .acquire()
        .await
        .expect("acquire a watched lock");
    let first_deadline = g.valid_until();
    let began = Instant::now();
    let mut checks = 0;
    loop {
        assert!(store.held(b, wd).await, "the store lost a watched lease");
        assert!(!g.is_lost(), "the watchdog let the lease lapse");
        checks += 1;
        if began.elapsed() >= ttl * 3 && a.watchdog_stats().extended >= 5 {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "no five extensions in a minute: {:?}",
            a.watchdog_stats()
        );
        sleep_async(ttl / 4).await; // time passing is what is under test
    }
    assert!(checks >= 3, "checked {checks} times");
    assert!(!g.is_lost(), "the watchdog let the lease lapse");
    assert!(
        g.valid_until() > first_deadline,
        "the lease deadline did not move forward"
    );
    if let Store::Redis(srv) = store {
        assert!(lease_ms(srv, &key_of(a, wd)) > 0);
    }
    g.release()
        .await
        .expect("release after three TTLs under the watchdog: still ours");

    // Without the watchdog, lost() fires by its own timer on this runtime.
    let g = a
        .lock_with("expiring", |o| {
            o.ttl(Duration::from_millis(100)).watchdog(false)
        })
        .expect("valid lock options")
        .acquire()
        .await
        .expect("acquire 100 ms lock");
    match future::select(g.lost(), sleep_async(EVENTUALLY)).await {
        Either::Left(((), _)) => assert!(g.is_lost()),
        Either::Right(_) => panic!("lost() did not fire after the 100 ms lease ran out"),
    }
    drop(g);

    // Dropping a guard releases in the background.
    let dropped = "dropped";
    let g = a.lock(dropped).acquire().await.expect("acquire");
    assert!(store.held(b, dropped).await);
    drop(g);
    assert!(
        eventually(
            EVENTUALLY,
            move || async move { !store.held(b, dropped).await }
        )
        .await,
        "dropping the guard did not release the lease"
    );
    let again = b.lock(dropped).try_acquire().await.expect("try_acquire");
    again
        .expect("free after the drop release")
        .release()
        .await
        .expect("release");
}

// ---------------------------------------------------------------------------------------
// 1. smol
// ---------------------------------------------------------------------------------------

#[cfg(feature = "smol")]
#[test]
fn smol_block_on_redis_and_memory() {
    let srv = RedisServer::start();
    smol::block_on(async {
        assert!(tokio::runtime::Handle::try_current().is_err());
        redis_smoke(&srv, SMOL).await;
        memory_smoke(SMOL).await;
    });
}

// ---------------------------------------------------------------------------------------
// 2. async-std
// ---------------------------------------------------------------------------------------

#[cfg(feature = "async-std")]
#[test]
fn async_std_block_on_redis_and_memory() {
    let srv = RedisServer::start();
    async_std::task::block_on(async {
        assert!(tokio::runtime::Handle::try_current().is_err());
        redis_smoke(&srv, ASYNC_STD).await;
        memory_smoke(ASYNC_STD).await;
    });
}

// ---------------------------------------------------------------------------------------
// 3. tokio (inside a tokio runtime tokio is used, whatever features are on)
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_multi_thread_redis_and_memory() {
    let srv = RedisServer::start();
    redis_smoke(&srv, TOKIO).await;
    memory_smoke(TOKIO).await;
}

#[tokio::test(flavor = "current_thread")]
async fn tokio_current_thread_redis_and_memory() {
    let srv = RedisServer::start();
    redis_smoke(&srv, TOKIO).await;
    memory_smoke(TOKIO).await;
}

// ---------------------------------------------------------------------------------------
// 4. No runtime at all: a plain executor. With only `tokio` the private fallback runtime
//    runs fred, timers and background work; with smol/async-std their executors do.
// ---------------------------------------------------------------------------------------

#[test]
fn futures_block_on_without_any_runtime() {
    let srv = RedisServer::start();
    futures::executor::block_on(async {
        assert!(tokio::runtime::Handle::try_current().is_err());
        redis_smoke(&srv, INLINE).await;
        memory_smoke(INLINE).await;
    });
}

// ---------------------------------------------------------------------------------------
// 5. A guard dropped on a thread that runs no runtime is still released.
// ---------------------------------------------------------------------------------------

/// Acquires with `acquire_on` (some runtime's block_on), drops the guard on a plain
/// `std::thread`, and waits for the lease to be gone.
fn drop_on_plain_thread(
    srv: &RedisServer,
    acquire_on: impl FnOnce(String) -> (LockManager, LockGuard),
) {
    let (locks, guard) = acquire_on(srv.url());
    let key = key_of(&locks, "moved");
    assert!(held(srv, &key));
    let dropper = std::thread::spawn(move || {
        let no_runtime = tokio::runtime::Handle::try_current().is_err();
        drop(guard);
        no_runtime
    });
    let no_runtime = dropper
        .join()
        .expect("dropping the guard on a plain thread panicked");
    assert!(no_runtime, "the plain thread had a tokio runtime");
    srv.wait_until(EVENTUALLY, |s| !held(s, &key));
    drop(locks);
}

async fn acquire_moved(url: String) -> (LockManager, LockGuard) {
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let locks = LockManager::new(backend);
    let guard = locks.lock("moved").acquire().await.expect("acquire");
    (locks, guard)
}

#[test]
fn tokio_guard_dropped_on_a_plain_thread_is_released() {
    let srv = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    drop_on_plain_thread(&srv, |url| rt.block_on(acquire_moved(url)));
    // The runtime stays up until the release has been seen.
    drop(rt);
}

#[cfg(feature = "smol")]
#[test]
fn smol_guard_dropped_on_a_plain_thread_is_released() {
    let srv = RedisServer::start();
    drop_on_plain_thread(&srv, |url| smol::block_on(acquire_moved(url)));
}

#[cfg(feature = "async-std")]
#[test]
fn async_std_guard_dropped_on_a_plain_thread_is_released() {
    let srv = RedisServer::start();
    drop_on_plain_thread(&srv, |url| async_std::task::block_on(acquire_moved(url)));
}

// ---------------------------------------------------------------------------------------
// 6. A guard dropped after its tokio runtime has shut down: no panic, the TTL frees it.
// ---------------------------------------------------------------------------------------

#[test]
fn guard_dropped_after_its_runtime_shut_down_expires_by_ttl() {
    let srv = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let url = srv.url();
    let (locks, guard) = rt.block_on(async move {
        let backend = RedisBackend::connect(&url).await.expect("connect");
        let options = LockOptions::new().ttl(Duration::from_millis(300));
        let locks = LockManager::with_options(backend, options).expect("options");
        let guard = locks.lock("orphan").acquire().await.expect("acquire");
        (locks, guard)
    });
    let key = key_of(&locks, "orphan");
    assert!(held(&srv, &key));
    assert!(!guard.is_lost());

    rt.shutdown_timeout(EVENTUALLY);

    // The watchdog died with the runtime: the guard notices by its deadline...
    assert!(
        wait_for(EVENTUALLY, || guard.is_lost()),
        "the guard never noticed that its watchdog is gone"
    );
    // ...and dropping it (and the manager, and the backend) on this runtime-less thread
    // neither panics nor blocks.
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        drop(guard);
        drop(locks);
    }));
    assert!(
        dropped.is_ok(),
        "dropping after the runtime shut down panicked"
    );
    // Nobody could run the release: the lease runs out by its TTL.
    srv.wait_until(EVENTUALLY, |s| !held(s, &key));
}

// ---------------------------------------------------------------------------------------
// 7. Several runtime features at once, all runtimes in one process.
// ---------------------------------------------------------------------------------------

#[cfg(all(feature = "smol", feature = "async-std"))]
#[test]
fn smol_async_std_and_tokio_guards_in_one_process() {
    let srv = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let options = || LockOptions::new().ttl(Duration::from_millis(300));
    let acquire = |name: &'static str| {
        let url = srv.url();
        async move {
            let backend = RedisBackend::connect(&url).await.expect("connect");
            let locks = LockManager::with_options(backend, options()).expect("options");
            let guard = locks.lock(name).acquire().await.expect("acquire");
            (locks, guard)
        }
    };

    let (smol_locks, smol_guard) = smol::block_on(async {
        assert!(!in_tokio());
        acquire("on-smol").await
    });
    let (astd_locks, astd_guard) = async_std::task::block_on(async {
        assert!(!in_tokio());
        acquire("on-async-std").await
    });
    let (tokio_locks, tokio_guard) = rt.block_on(async {
        assert!(in_tokio());
        acquire("on-tokio").await
    });
    let names = ["on-smol", "on-async-std", "on-tokio"];
    let keys = names.map(|n| key_of(&smol_locks, n));

    // Each runtime sees the other runtimes' locks as held.
    let held_elsewhere = |locks: &LockManager| {
        let locks = locks.clone();
        async move {
            for n in names {
                let got = locks.lock(n).try_acquire().await.expect("try_acquire");
                assert!(got.is_none(), "{n} was free for another runtime");
            }
        }
    };
    smol::block_on(held_elsewhere(&tokio_locks));
    async_std::task::block_on(held_elsewhere(&smol_locks));
    rt.block_on(held_elsewhere(&astd_locks));

    // The three watchdogs keep their 300 ms leases alive for a second.
    std::thread::sleep(Duration::from_secs(1)); // the span under test, not a synchronisation
    for (g, n) in [&smol_guard, &astd_guard, &tokio_guard]
        .into_iter()
        .zip(names)
    {
        assert!(!g.is_lost(), "{n}: lost under its watchdog");
    }
    for k in &keys {
        assert!(held(&srv, k), "{k} expired under the watchdog");
    }
    for (n, locks) in names.iter().zip([&smol_locks, &astd_locks, &tokio_locks]) {
        assert!(
            locks.watchdog_stats().extended >= 3,
            "{n}: {:?}",
            locks.watchdog_stats()
        );
    }

    // Released from other runtimes than they were taken on (Ok: still ours after 1 s).
    async_std::task::block_on(smol_guard.release()).expect("release smol's guard on async-std");
    rt.block_on(astd_guard.release())
        .expect("release async-std's guard on tokio");
    smol::block_on(tokio_guard.release()).expect("release tokio's guard on smol");
    for k in &keys {
        assert!(!held(&srv, k), "{k} still held after its release");
    }

    // A guard taken under async-std's block_on (the rule picks smol's executor there, as
    // smol is on too) and dropped inside tokio's: released in the background (its TTL,
    // 30 s, is far beyond the wait).
    let (locks, guard) = async_std::task::block_on(async {
        let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
        let locks = LockManager::new(backend);
        let guard = locks.lock("crossed").acquire().await.expect("acquire");
        (locks, guard)
    });
    let crossed = key_of(&locks, "crossed");
    assert!(held(&srv, &crossed));
    rt.block_on(async move { drop(guard) });
    srv.wait_until(EVENTUALLY, |s| !held(s, &crossed));
    drop(locks);
    drop((smol_locks, astd_locks, tokio_locks));
    drop(rt);
}

// ---------------------------------------------------------------------------------------
// 8. A manager outlives the tokio runtime its watchdog task was started on.
// ---------------------------------------------------------------------------------------

/// The shared watchdog task is spawned on the runtime of the first lease it watches. When
/// that runtime shuts down, a lease taken later (on another runtime) must still be kept
/// alive: the watchdog has to be restarted, not believed to be running. (A `RedisBackend`
/// connected *inside* a tokio runtime dies with it: fred's tasks live there.)
#[test]
fn watchdog_restarts_after_its_runtime_shut_down() {
    let srv = RedisServer::start();
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime")
    };
    let options = LockOptions::new().ttl(Duration::from_millis(200));
    // Connected outside any tokio runtime, so fred runs on redlease's private runtime and
    // the connection itself survives the runtimes below.
    let backend = futures::executor::block_on(connect(&srv));
    let locks = LockManager::with_options(backend, options).expect("options");
    let first = runtime();
    let guard = first
        .block_on(locks.lock("first").acquire())
        .expect("acquire on the first runtime");
    first.shutdown_timeout(EVENTUALLY);
    drop(guard); // its release cannot run any more; the lease runs out by its TTL

    let second = runtime();
    second.block_on(async {
        let guard = locks
            .lock("second")
            .acquire()
            .await
            .expect("acquire on the second runtime");
        sleep_async(Duration::from_secs(1)).await; // the span under test
        assert!(
            !guard.is_lost(),
            "a 200 ms lease taken after the first runtime shut down was not kept alive: {:?}",
            locks.watchdog_stats()
        );
        guard.release().await.expect("release: still ours");
    });
}
