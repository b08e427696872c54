//! Cache-stampede protection (`Cache`) against a real redis-server: the seed's scenario (a
//! cached query expires under a burst of requests) must reach the origin once, across
//! several managers with their own connections, as separate processes would have.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use redlease::{Cache, CacheOptions, Error, MemoryBackend, RedisBackend, RedisOptions};
use support::{wait_for_async, RedisServer};
use tokio::sync::watch;

/// Generous bound for things that must happen "soon": failing it means a hang, not slowness.
const SOON: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(SOON, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {SOON:?}"))
}

/// A cache with its own connection (one "process").
async fn cache(srv: &RedisServer, options: CacheOptions) -> Cache {
    let opts = RedisOptions::new().command_timeout(Duration::from_millis(500));
    let backend = RedisBackend::connect_with(&srv.url(), opts).await.unwrap();
    Cache::with_options(backend, options).unwrap()
}

async fn caches(srv: &RedisServer, n: usize, options: CacheOptions) -> Vec<Cache> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(cache(srv, options.clone()).await);
    }
    out
}

fn value_key(key: &str) -> String {
    format!("redlease:cache:{{{key}}}:value")
}

fn lease_key(key: &str) -> String {
    format!("redlease:cache:{{{key}}}")
}

fn stored(srv: &RedisServer, key: &str) -> Option<String> {
    srv.cmd(&["HGET", &value_key(key), "v"]).as_str()
}

/// Managers subscribed to a key's fill channel: how many are waiting on another's compute.
fn fill_waiters(srv: &RedisServer, key: &str) -> i64 {
    let channel = format!("redlease:cache:{{{key}}}:filled");
    let reply = srv.cmd(&["PUBSUB", "NUMSUB", &channel]);
    reply
        .as_array()
        .and_then(|a| a.get(1))
        .and_then(|n| n.as_int())
        .unwrap_or(0)
}

/// A fake origin that counts its calls and can be held shut by a gate.
#[derive(Clone)]
struct Origin {
    calls: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
    open: Arc<watch::Sender<bool>>,
}

impl Origin {
    fn new() -> Self {
        Self::gated(true)
    }

    fn gated(open: bool) -> Self {
        let (tx, rx) = watch::channel(open);
        Origin {
            calls: Arc::default(),
            gate: rx,
            open: Arc::new(tx),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn open(&self) {
        self.open.send_replace(true);
    }

    /// A loader returning `value` once the gate is open, after `work` (the query's own
    /// latency, not a synchronisation).
    fn load(
        &self,
        value: &'static str,
        work: Duration,
    ) -> impl FnOnce() -> futures::future::BoxFuture<'static, &'static str> + Send + 'static {
        let (calls, mut gate) = (self.calls.clone(), self.gate.clone());
        move || {
            Box::pin(async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let _ = gate.wait_for(|open| *open).await;
                tokio::time::sleep(work).await;
                value
            })
        }
    }
}

fn opts() -> CacheOptions {
    CacheOptions::new().wait_timeout(SOON)
}

const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_expired_key_under_a_burst_from_four_managers_calls_the_origin_once() {
    let srv = RedisServer::start();
    let caches = caches(&srv, 4, opts()).await;
    // Cached once, briefly, then expired: the seed's "cache expired under load".
    let warm = Origin::new();
    let first = caches[0]
        .get_with(
            "hot",
            Duration::from_millis(50),
            warm.load("old", Duration::ZERO),
        )
        .await
        .unwrap();
    assert_eq!(&first[..], b"old");
    assert!(
        wait_for_async(SOON, || srv.cmd(&["EXISTS", &value_key("hot")]).as_int()
            == Some(0))
        .await
    );

    let loads_before: u64 = caches.iter().map(|c| c.stats().loads).sum();
    let calls_before: u64 = caches.iter().map(|c| c.stats().calls).sum();
    // Held shut until every caller has joined and the three other managers wait on the
    // computing one's round: a burst that finished before the others arrived would prove
    // nothing about waiting across managers.
    let origin = Origin::gated(false);
    let mut tasks = Vec::new();
    for i in 0..160 {
        let cache = caches[i % 4].clone();
        let load = origin.load("fresh", Duration::from_millis(30));
        tasks.push(tokio::spawn(async move {
            cache.get_with("hot", TTL, load).await
        }));
    }
    let joined = || caches.iter().map(|c| c.stats().calls).sum::<u64>() - calls_before == 160;
    assert!(wait_for_async(SOON, joined).await);
    assert!(wait_for_async(SOON, || origin.calls() == 1).await);
    assert!(wait_for_async(SOON, || fill_waiters(&srv, "hot") == 3).await);
    origin.open();
    for t in tasks {
        let v = within("a caller's answer", t).await.unwrap().unwrap();
        assert_eq!(&v[..], b"fresh");
    }
    let loads: u64 = caches.iter().map(|c| c.stats().loads).sum::<u64>() - loads_before;
    let coalesced: u64 = caches.iter().map(|c| c.stats().coalesced).sum();
    println!("160 callers over 4 managers -> {} origin call(s); {coalesced} callers joined a flight in their process", origin.calls());
    assert_eq!(origin.calls(), 1, "the origin must be called exactly once");
    assert_eq!(loads, 1);
    assert_eq!(stored(&srv, "hot").as_deref(), Some("fresh"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_of_another_key_are_not_blocked_by_a_slow_compute() {
    let srv = RedisServer::start();
    let cache = cache(&srv, opts()).await;
    let slow = Origin::gated(false);
    let pending = tokio::spawn({
        let (cache, load) = (cache.clone(), slow.load("slow", Duration::ZERO));
        async move { cache.get_with("slow", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || slow.calls() == 1).await);

    let fast = Origin::new();
    let v = tokio::time::timeout(
        Duration::from_secs(2),
        cache.get_with("fast", TTL, fast.load("fast", Duration::ZERO)),
    )
    .await
    .expect("another key must not wait for the slow compute")
    .unwrap();
    assert_eq!(&v[..], b"fast");
    assert!(
        !pending.is_finished(),
        "the slow key is still being computed"
    );

    slow.open();
    let v = within("the slow key", pending).await.unwrap().unwrap();
    assert_eq!(&v[..], b"slow");
    assert_eq!((slow.calls(), fast.calls()), (1, 1));
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error("origin down: {0}")]
    Origin(String),
    #[error(transparent)]
    Cache(#[from] Error),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_error_reaches_every_waiter_in_every_manager_and_the_next_call_retries() {
    let srv = RedisServer::start();
    let caches = caches(&srv, 3, opts()).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (open, gate) = watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..120 {
        let cache = caches[i % 3].clone();
        let (calls, mut gate) = (calls.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            let r = cache
                .try_get_with("q", TTL, move || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    Err::<Bytes, _>(AppError::Origin("connection refused".into()))
                })
                .await;
            (i % 3, r)
        }));
    }
    // Every caller has joined, one origin call is under way, and the two other managers
    // wait on its round: then the origin fails.
    let joined = || caches.iter().map(|c| c.stats().calls).sum::<u64>() == 120;
    assert!(wait_for_async(SOON, joined).await);
    assert!(wait_for_async(SOON, || calls.load(Ordering::SeqCst) == 1).await);
    assert!(wait_for_async(SOON, || fill_waiters(&srv, "q") == 2).await);
    open.send_replace(true);

    let computing = loop {
        if let Some(i) = caches.iter().position(|c| c.stats().loads == 1) {
            break i;
        }
        tokio::task::yield_now().await;
    };
    let mut local: Vec<Arc<AppError>> = Vec::new();
    for t in tasks {
        let (manager, r) = within("a caller's answer", t).await.unwrap();
        let err = r.expect_err("a failed compute must not give a value");
        if manager == computing {
            assert!(matches!(&*err, AppError::Origin(m) if m == "connection refused"));
            local.push(err);
        } else {
            // Another process: the round's error text, not a second origin call.
            match &*err {
                AppError::Cache(Error::LoadFailed { message }) => {
                    assert_eq!(message, "origin down: connection refused")
                }
                other => panic!("expected the remote round's error, got {other:?}"),
            }
        }
    }
    assert_eq!(local.len(), 40);
    assert!(
        local.iter().all(|e| Arc::ptr_eq(e, &local[0])),
        "callers in the computing process share one Arc<E>"
    );
    println!(
        "120 callers over 3 managers, failing origin -> {} origin call(s)",
        calls.load(Ordering::SeqCst)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(srv.cmd(&["EXISTS", &value_key("q")]).as_int(), Some(0));

    // Not cached: the next call, in any manager, runs its loader.
    let v = caches[(computing + 1) % 3]
        .try_get_with("q", TTL, || async { Ok::<_, AppError>("rows") })
        .await
        .unwrap();
    assert_eq!(&v[..], b"rows");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_loader_fails_its_round_and_frees_the_key_at_once() {
    let srv = RedisServer::start();
    let cache = cache(&srv, opts()).await;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let cache = cache.clone();
        tasks.push(tokio::spawn(async move {
            cache
                .get_with("p", TTL, || async {
                    if true {
                        panic!("bug in the loader");
                    }
                    "never"
                })
                .await
        }));
    }
    for t in tasks {
        let err = within("a caller's answer", t).await.unwrap().unwrap_err();
        assert!(
            matches!(&err, Error::LoadFailed { message } if message.contains("bug in the loader")),
            "{err:?}"
        );
    }
    assert!(!support::held(&srv, &lease_key("p")));
    // Freed at once, not after the 10 s lease TTL.
    let began = Instant::now();
    let origin = Origin::new();
    let v = cache
        .get_with("p", TTL, origin.load("ok", Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(&v[..], b"ok");
    assert!(began.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_loader_is_cancelled_at_compute_timeout_and_the_next_call_computes() {
    let srv = RedisServer::start();
    let options = opts().compute_timeout(Duration::from_millis(200));
    let cache = cache(&srv, options).await;
    let hung = Origin::gated(false);
    let began = Instant::now();
    let err = cache
        .get_with("h", TTL, hung.load("never", Duration::ZERO))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(began.elapsed() >= Duration::from_millis(200));
    assert!(!support::held(&srv, &lease_key("h")));

    let origin = Origin::new();
    let v = within(
        "the next compute",
        cache.get_with("h", TTL, origin.load("ok", Duration::ZERO)),
    )
    .await
    .unwrap();
    assert_eq!(&v[..], b"ok");
    assert_eq!(origin.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_loader_process_frees_the_key_within_the_lease_ttl() {
    let srv = RedisServer::start();
    let options = opts().lease_ttl(Duration::from_millis(300));
    let url = srv.url();
    let hung = Origin::gated(false);
    // "Process" A: its own runtime and connection; its loader never finishes.
    let (crash, crashed) = std::sync::mpsc::channel::<()>();
    let a = std::thread::spawn({
        let (options, load) = (options.clone(), hung.load("from A", Duration::ZERO));
        move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let backend = RedisBackend::connect(&url).await.unwrap();
                let cache = Cache::with_options(backend, options).unwrap();
                tokio::spawn(async move { cache.get_with("c", TTL, load).await });
            });
            crashed.recv().unwrap();
            rt.shutdown_background(); // every task and connection of A is gone
        }
    });
    assert!(wait_for_async(SOON, || hung.calls() == 1).await);

    // B waits on A's round...
    let b = cache(&srv, options).await;
    let origin = Origin::new();
    let waiting = tokio::spawn({
        let (b, load) = (b.clone(), origin.load("from B", Duration::ZERO));
        async move { b.get_with("c", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || fill_waiters(&srv, "c") == 1).await);
    assert_eq!(origin.calls(), 0, "B must wait while A holds the lease");

    // ...A dies; its lease runs out and B takes the compute over.
    let died = Instant::now();
    crash.send(()).unwrap();
    a.join().unwrap();
    let v = within("the take-over", waiting).await.unwrap().unwrap();
    assert_eq!(&v[..], b"from B");
    assert_eq!((hung.calls(), origin.calls()), (1, 1));
    assert!(
        died.elapsed() < Duration::from_secs(3),
        "took over after {:?}",
        died.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_while_revalidate_serves_stale_at_once_and_refreshes_once() {
    let srv = RedisServer::start();
    let window = Duration::from_secs(20);
    let caches = caches(&srv, 2, opts().stale_while_revalidate(window)).await;
    let ttl = Duration::from_millis(200);
    let first = Origin::new();
    caches[0]
        .get_with("s", ttl, first.load("v1", Duration::ZERO))
        .await
        .unwrap();
    // Past the soft ttl: the server's PTTL is inside the stale window.
    let stale = || {
        srv.cmd(&["PTTL", &value_key("s")])
            .as_int()
            .is_some_and(|ms| ms > 0 && ms <= window.as_millis() as i64)
    };
    assert!(wait_for_async(SOON, stale).await);

    // The refresh's origin is held shut: every caller must get the stale value anyway.
    let refresh = Origin::gated(false);
    let mut tasks = Vec::new();
    for i in 0..100 {
        let cache = caches[i % 2].clone();
        let load = refresh.load("v2", Duration::ZERO);
        tasks.push(tokio::spawn(
            async move { cache.get_with("s", ttl, load).await },
        ));
    }
    for t in tasks {
        let v = tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .expect("a stale read must not wait for the refresh")
            .unwrap()
            .unwrap();
        assert_eq!(&v[..], b"v1");
    }
    assert!(wait_for_async(SOON, || refresh.calls() == 1).await);
    refresh.open();
    assert!(wait_for_async(SOON, || stored(&srv, "s").as_deref() == Some("v2")).await);
    let served: u64 = caches.iter().map(|c| c.stats().served_stale).sum();
    println!(
        "100 callers over 2 managers in the stale window -> all served stale ({served} flights), {} refresh origin call(s)",
        refresh.calls()
    );
    assert_eq!(refresh.calls(), 1, "one refresh for the whole window");
    assert_eq!(first.calls(), 1);

    let unused = Origin::new();
    let v = caches[1]
        .get_with("s", ttl, unused.load("v3", Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(&v[..], b"v2");
    assert_eq!(unused.calls(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfetch_refreshes_a_fresh_value_early_in_the_background() {
    let srv = RedisServer::start();
    // beta so large that any measured compute time wins the draw: deterministic.
    let eager = cache(&srv, opts().xfetch(1e9)).await;
    let origin = Origin::new();
    let v = eager
        .get_with("x", TTL, origin.load("v1", Duration::from_millis(5)))
        .await
        .unwrap();
    assert_eq!(&v[..], b"v1");
    let v = eager
        .get_with("x", TTL, origin.load("v2", Duration::from_millis(5)))
        .await
        .unwrap();
    assert_eq!(
        &v[..],
        b"v1",
        "the early refresh runs behind the current value"
    );
    assert!(wait_for_async(SOON, || stored(&srv, "x").as_deref() == Some("v2")).await);
    assert_eq!(origin.calls(), 2);
    // XFetch's delta is stored in µs: the 5 ms loader took between 5 ms and a few seconds.
    let delta_us: u64 = srv
        .cmd(&["HGET", &value_key("x"), "d"])
        .as_str()
        .and_then(|d| d.parse().ok())
        .unwrap();
    assert!(
        (5_000..5_000_000).contains(&delta_us),
        "delta {delta_us} µs"
    );
    assert_eq!(eager.stats().refreshes, 1);

    // Off, or with a tiny beta: a fresh value 30 s from expiry is never refreshed.
    for options in [opts(), opts().xfetch(1e-9)] {
        let calm = cache(&srv, options).await;
        let v = calm
            .get_with("x", TTL, origin.load("v3", Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(&v[..], b"v2");
        assert_eq!(calm.stats().served_stale, 0);
        assert_eq!(calm.stats().loads, 0);
    }
    assert_eq!(origin.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_times_out_alone_and_the_detached_loader_still_fills_the_cache() {
    let srv = RedisServer::start();
    let cache = cache(&srv, opts().wait_timeout(Duration::from_millis(100))).await;
    let origin = Origin::gated(false);
    let began = Instant::now();
    let err = cache
        .get_with("t", TTL, origin.load("late", Duration::ZERO))
        .await
        .unwrap_err();
    let waited = began.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(2));

    origin.open();
    assert!(wait_for_async(SOON, || stored(&srv, "t").as_deref() == Some("late")).await);
    let v = cache
        .get_with("t", TTL, origin.load("again", Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(&v[..], b"late");
    assert_eq!(origin.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_that_lost_its_lease_cannot_overwrite_the_newer_value() {
    let srv = RedisServer::start();
    let a = cache(&srv, opts()).await;
    let b = cache(&srv, opts()).await;
    let slow = Origin::gated(false);
    let old = tokio::spawn({
        let (a, load) = (a.clone(), slow.load("old", Duration::ZERO));
        async move { a.get_with("f", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || slow.calls() == 1).await);
    // A's lease is gone (as after a long pause); B computes and writes a newer value.
    assert_eq!(srv.cmd(&["DEL", &lease_key("f")]).as_int(), Some(1));
    let newer = Origin::new();
    let v = b
        .get_with("f", TTL, newer.load("new", Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(&v[..], b"new");

    slow.open();
    let v = within("A's late loader", old).await.unwrap().unwrap();
    assert_eq!(
        &v[..],
        b"new",
        "A was fenced out: its callers get the newer stored value, as everyone else does"
    );
    assert_eq!(
        stored(&srv, "f").as_deref(),
        Some("new"),
        "the fenced write refused A's late value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_backend_computes_once_across_caches_too() {
    let backend = MemoryBackend::new();
    let caches: Vec<Cache> = (0..3)
        .map(|_| Cache::with_options(backend.clone(), opts()).unwrap())
        .collect();
    let origin = Origin::gated(false);
    let mut tasks = Vec::new();
    for i in 0..90 {
        let cache = caches[i % 3].clone();
        let load = origin.load("m", Duration::from_millis(20));
        tasks.push(tokio::spawn(
            async move { cache.get_with("k", TTL, load).await },
        ));
    }
    // Every caller in, the other two caches waiting on the first one's round: then open.
    let joined = || caches.iter().map(|c| c.stats().calls).sum::<u64>() == 90;
    assert!(wait_for_async(SOON, joined).await);
    assert!(wait_for_async(SOON, || origin.calls() == 1).await);
    origin.open();
    for t in tasks {
        assert_eq!(&within("a caller", t).await.unwrap().unwrap()[..], b"m");
    }
    assert_eq!(origin.calls(), 1);
}

#[cfg(feature = "serde")]
#[tokio::test]
async fn typed_values_round_trip_through_redis() {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq, Clone)]
    struct Product {
        id: u32,
        name: String,
    }
    let srv = RedisServer::start();
    let a = cache(&srv, opts()).await;
    let b = cache(&srv, opts()).await;
    let p = Product {
        id: 7,
        name: "lamp".into(),
    };
    let expected = p.clone();
    let got: Product = a.get_typed_with("p7", TTL, || async { p }).await.unwrap();
    assert_eq!(got, expected);
    let got: Product = b
        .get_typed_with("p7", TTL, || async { unreachable!("cached") })
        .await
        .unwrap();
    assert_eq!(got, expected);
    // Bytes that are not a Product: an error, not a panic or garbage.
    let err = b
        .get_typed_with::<Vec<u64>, _, _>("p7", TTL, || async { vec![1] })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::LoadFailed { .. }), "{err:?}");
}

#[cfg(feature = "smol")]
#[test]
fn works_under_smol_without_a_tokio_runtime() {
    let srv = RedisServer::start();
    smol::block_on(async {
        let backend = RedisBackend::connect(&srv.url()).await.unwrap();
        let cache = Cache::with_options(backend, opts()).unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let (cache, calls) = (cache.clone(), calls.clone());
            tasks.push(smol::spawn(async move {
                cache
                    .get_with("smol", TTL, move || async move {
                        calls.fetch_add(1, Ordering::SeqCst);
                        smol::Timer::after(Duration::from_millis(20)).await;
                        "s"
                    })
                    .await
            }));
        }
        for t in tasks {
            assert_eq!(&t.await.unwrap()[..], b"s");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    });
}

/// A flight whose task was spawned on a runtime that shut down before polling it: the
/// flight must end with it, not stay in the map for every later caller to time out on.
#[test]
fn a_flight_dropped_before_its_first_poll_does_not_wedge_the_key() {
    let srv = RedisServer::start();
    // Connected outside both runtimes: the connection lives on the crate's own runtime and
    // survives the first runtime's shutdown.
    let backend = futures::executor::block_on(RedisBackend::connect(&srv.url())).unwrap();
    let cache = Cache::with_options(backend, opts().wait_timeout(Duration::from_secs(5))).unwrap();
    let first = Origin::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let call = cache.get_with("d", TTL, first.load("never", Duration::ZERO));
        let mut call = std::pin::pin!(call);
        // One poll spawns the flight's task; the current-thread runtime has not run it.
        assert!(futures::poll!(call.as_mut()).is_pending());
    });
    drop(rt); // the queued task is dropped unpolled
    assert_eq!(first.calls(), 0);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let began = Instant::now();
    let origin = Origin::new();
    let v = rt
        .block_on(cache.get_with("d", TTL, origin.load("ok", Duration::ZERO)))
        .expect("a new flight computes instead of joining the dropped one");
    assert_eq!(&v[..], b"ok");
    assert_eq!(origin.calls(), 1);
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "{:?}",
        began.elapsed()
    );
}

/// Only the tokio feature and no runtime in the caller: the loader runs in the caller's
/// own future (its thread), not on the crate's private runtime, whose one thread runs the
/// watchdog and pub/sub handlers of every lease in the process.
#[cfg(not(any(feature = "smol", feature = "async-std")))]
#[test]
fn off_runtime_the_loader_runs_on_the_callers_thread() {
    let srv = RedisServer::start();
    futures::executor::block_on(async {
        let backend = RedisBackend::connect(&srv.url()).await.unwrap();
        let cache = Cache::with_options(backend, opts()).unwrap();
        let me = std::thread::current().id();
        let ran_on = Arc::new(std::sync::Mutex::new(None));
        let v = cache
            .get_with("off", TTL, {
                let ran_on = ran_on.clone();
                move || async move {
                    *ran_on.lock().unwrap() = Some(std::thread::current().id());
                    // tokio timers work in the loader (a tokio context is entered).
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    "v"
                }
            })
            .await
            .unwrap();
        assert_eq!(&v[..], b"v");
        assert_eq!(*ran_on.lock().unwrap(), Some(me));
        // Cached: another off-runtime call reads it.
        let again = cache
            .get_with("off", TTL, || async { "unused" })
            .await
            .unwrap();
        assert_eq!(&again[..], b"v");
    });
}

/// A lease whose record has no fencing counter (written by hand, or by another tool): the
/// round number is then unknown, but a round is under way, and waiters must wait for it (on
/// the fill channel or the lease's TTL), not loop on reads and failed acquires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_round_is_unknown_makes_waiters_wait_not_spin() {
    let srv = RedisServer::start();
    let a = cache(&srv, opts()).await;
    let b = cache(&srv, opts()).await;
    let origin = Origin::gated(false);
    let computing = tokio::spawn({
        let (a, load) = (a.clone(), origin.load("v", Duration::ZERO));
        async move { a.get_with("e", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || origin.calls() == 1).await);
    assert_eq!(srv.cmd(&["HDEL", &lease_key("e"), "f"]).as_int(), Some(1));
    let waiting = tokio::spawn({
        let (b, load) = (b.clone(), origin.load("unused", Duration::ZERO));
        async move { b.get_with("e", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || fill_waiters(&srv, "e") == 1).await);
    // A measuring window, not a synchronisation: nothing is expected to happen in it.
    let before = srv.total_commands();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = srv.total_commands() - before;
    println!("a waiter on a lease whose round is unknown: {during} commands in 300 ms");
    assert!(during < 20, "the waiter spins: {during} commands in 300 ms");

    origin.open();
    let v = within("the waiter", waiting).await.unwrap().unwrap();
    assert_eq!(&v[..], b"v");
    let v = within("the loader", computing).await.unwrap().unwrap();
    assert_eq!(&v[..], b"v");
    assert_eq!(origin.calls(), 1);
}

/// A round that ends without a fill (here: A's lease vanished, so its fill is refused)
/// must wake the waiters of other processes at once; they would otherwise sleep on the
/// lease's TTL (10 s) before looking again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_that_ends_without_a_fill_wakes_waiters_in_other_managers() {
    let srv = RedisServer::start();
    let patient = opts().wait_timeout(Duration::from_secs(30));
    let a = cache(&srv, patient.clone()).await;
    let b = cache(&srv, patient).await;
    let slow = Origin::gated(false);
    let computing = tokio::spawn({
        let (a, load) = (a.clone(), slow.load("a", Duration::ZERO));
        async move { a.get_with("w", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || slow.calls() == 1).await);
    let other = Origin::new();
    let waiting = tokio::spawn({
        let (b, load) = (b.clone(), other.load("b", Duration::ZERO));
        async move { b.get_with("w", TTL, load).await }
    });
    assert!(wait_for_async(SOON, || fill_waiters(&srv, "w") == 1).await);
    // The lease goes without a message (as after an eviction); B sleeps on its TTL...
    assert_eq!(srv.cmd(&["DEL", &lease_key("w")]).as_int(), Some(1));
    let began = Instant::now();
    // ...until A's refused fill ends A's round, which tells B.
    slow.open();
    let v = within("the waiter", waiting).await.unwrap().unwrap();
    let woke = began.elapsed();
    println!("unfilled round -> waiter in another manager answered after {woke:?}");
    assert_eq!(&v[..], b"b", "B took the free lease and computed");
    assert!(woke < Duration::from_secs(3), "B slept {woke:?}");
    let v = within("the fenced-out loader", computing)
        .await
        .unwrap()
        .unwrap();
    assert!(&v[..] == b"a" || &v[..] == b"b", "{v:?}");
    assert_eq!((slow.calls(), other.calls()), (1, 1));
    assert_eq!(stored(&srv, "w").as_deref(), Some("b"));
}

/// With the origin down during the stale window, a failed refresh starts a cooldown: the
/// flights after it serve the stale value without calling the origin again until it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_down_in_the_stale_window_is_retried_once_per_cooldown_not_per_flight() {
    let srv = RedisServer::start();
    let window = Duration::from_secs(20);
    let caches = caches(&srv, 2, opts().stale_while_revalidate(window)).await;
    let ttl = Duration::from_millis(100);
    caches[0]
        .get_with("o", ttl, || async { "v1" })
        .await
        .unwrap();
    let stale = || {
        srv.cmd(&["PTTL", &value_key("o")])
            .as_int()
            .is_some_and(|ms| ms > 0 && ms <= window.as_millis() as i64)
    };
    assert!(wait_for_async(SOON, stale).await);

    let calls = Arc::new(AtomicUsize::new(0));
    let down = |calls: &Arc<AtomicUsize>| {
        let calls = calls.clone();
        move || async move {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<Bytes, _>(AppError::Origin("connection refused".into()))
        }
    };
    let cooldown_key = "redlease:cache:{o}:cooldown";
    let v = caches[0]
        .try_get_with("o", ttl, down(&calls))
        .await
        .unwrap();
    assert_eq!(&v[..], b"v1");
    assert!(
        wait_for_async(SOON, || srv.cmd(&["EXISTS", cooldown_key]).as_int()
            == Some(1))
        .await
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let began = Instant::now();
    for i in 0..60 {
        let v = caches[i % 2]
            .try_get_with("o", ttl, down(&calls))
            .await
            .unwrap();
        assert_eq!(&v[..], b"v1", "the stale value is served meanwhile");
    }
    let spent = began.elapsed();
    let n = calls.load(Ordering::SeqCst);
    println!(
        "60 flights in the stale window with the origin down, over {spent:?} -> {n} origin call(s)"
    );
    // One per cooldown (1 s) at most, however many flights.
    let allowed = 1 + spent.as_millis().div_ceil(1000) as usize;
    assert!(n <= allowed, "{n} origin calls in {spent:?}");

    // The cooldown ends: the next flight tries the origin again (it is back now).
    assert!(
        wait_for_async(SOON, || srv.cmd(&["EXISTS", cooldown_key]).as_int()
            == Some(0))
        .await
    );
    let before = calls.load(Ordering::SeqCst);
    let v = caches[1]
        .try_get_with("o", ttl, || async { Ok::<_, AppError>("v2") })
        .await
        .unwrap();
    assert_eq!(&v[..], b"v1", "still stale, refreshed behind it");
    assert!(wait_for_async(SOON, || stored(&srv, "o").as_deref() == Some("v2")).await);
    assert_eq!(calls.load(Ordering::SeqCst), before);
}

/// Redis restarts (empty) while a loader runs and other managers wait: every caller gets
/// a value or a clean error, within its wait_timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_mid_load_gives_every_caller_a_value_or_a_clean_error_in_time() {
    let mut srv = RedisServer::start();
    let wait = Duration::from_secs(5);
    let a = cache(&srv, opts().wait_timeout(wait)).await;
    let b = cache(&srv, opts().wait_timeout(wait)).await;
    let slow = Origin::gated(false);
    let computing = tokio::spawn({
        let (a, load) = (a.clone(), slow.load("a", Duration::ZERO));
        async move { (Instant::now(), a.get_with("r", TTL, load).await) }
    });
    assert!(wait_for_async(SOON, || slow.calls() == 1).await);
    let other = Origin::new();
    let mut waiters = Vec::new();
    for _ in 0..20 {
        let (b, load) = (b.clone(), other.load("b", Duration::ZERO));
        waiters.push(tokio::spawn(async move {
            (Instant::now(), b.get_with("r", TTL, load).await)
        }));
    }
    assert!(wait_for_async(SOON, || b.stats().calls == 20).await);
    assert!(wait_for_async(SOON, || fill_waiters(&srv, "r") == 1).await);

    srv.restart();
    slow.open();
    let (mut values, mut errors) = (0, 0);
    for t in waiters.into_iter().chain([computing]) {
        let (began, r) = within("a caller's answer", t).await.unwrap();
        let took = began.elapsed();
        assert!(
            took <= wait + Duration::from_secs(1),
            "answered after {took:?}"
        );
        match r {
            Ok(v) => {
                assert!(&v[..] == b"a" || &v[..] == b"b", "{v:?}");
                values += 1;
            }
            Err(e @ (Error::Backend { .. } | Error::Timeout { .. } | Error::LoadFailed { .. })) => {
                println!("clean error: {e}");
                errors += 1;
            }
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    println!(
        "Redis restarted mid-load: {values} values, {errors} errors; origin calls {} + {}",
        slow.calls(),
        other.calls()
    );
    assert_eq!(values + errors, 21);
    // And the cache works on the new server.
    let v = within(
        "a call after the restart",
        b.get_with("r2", TTL, || async { "after" }),
    )
    .await
    .unwrap();
    assert_eq!(&v[..], b"after");
}

/// Out-of-range options are refused when the cache is made, not turned into "no limit"
/// (a timeout too long to represent) or "off" (a stale window under a millisecond).
#[tokio::test]
async fn out_of_range_options_are_refused() {
    let srv = RedisServer::start();
    let backend = RedisBackend::connect(&srv.url()).await.unwrap();
    let bad = [
        opts().compute_timeout(Duration::MAX),
        opts().wait_timeout(Duration::MAX),
        opts().compute_timeout(CacheOptions::MAX_TIMEOUT + Duration::from_secs(1)),
        opts().stale_while_revalidate(Duration::from_micros(999)),
        opts().stale_while_revalidate(Duration::ZERO),
        opts().lease_ttl(Duration::from_millis(1)),
        opts().xfetch(f64::INFINITY),
    ];
    for o in bad {
        let made = Cache::with_options(backend.clone(), o.clone());
        assert!(
            matches!(made, Err(Error::InvalidConfig(_))),
            "{o:?} must be refused"
        );
    }
    let edges = opts()
        .compute_timeout(CacheOptions::MAX_TIMEOUT)
        .wait_timeout(CacheOptions::MAX_TIMEOUT)
        .stale_while_revalidate(CacheOptions::MIN_STALE_WINDOW);
    let cache = Cache::with_options(backend, edges).unwrap();
    let v = cache
        .get_with("edge", TTL, || async { "ok" })
        .await
        .unwrap();
    assert_eq!(&v[..], b"ok");
}
