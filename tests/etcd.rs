//! The etcd backend's own tests: faults (etcd killed and restarted, paused, its watch stream
//! cut, its data directory wiped), the record's guarantees that the conformance suite does
//! not reach (re-sent commands, abandon bars, TTL rounding), bad input, and a backend over an
//! application's own client. Each test starts its own one-member etcd.
#![cfg(feature = "etcd")]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use redlease::backend::{clock_drift, Acquire, Attempt, Backend, Claim, NodeTerms, Release};
use redlease::{
    Cache, CacheOptions, Error, EtcdBackend, EtcdOptions, LeaseKey, LockManager, LockOptions,
    RetryPolicy, Token,
};
use support::{wait_for_async, within, EtcdServer, Proxy, SOON};

fn opts() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Some(SOON))
}

/// A waiter whose fallback re-check is a minute away: only a wake-up hands it the lock in
/// time.
fn slow_fallback() -> RetryPolicy {
    RetryPolicy::notify().max_delay(Duration::from_secs(60))
}

async fn manager(srv: &EtcdServer, options: LockOptions) -> LockManager {
    LockManager::with_options(srv.backend().await, options).unwrap()
}

/// A plain claim on the lock a manager with the default options calls `name`.
fn claim(name: &str, ttl: Duration) -> Claim {
    Claim::new(
        LeaseKey::new(&LockOptions::new().key_prefix, name),
        Token::random(),
        ttl,
    )
}

async fn grant(b: &EtcdBackend, c: &Claim) -> u64 {
    match b.acquire(c, Attempt::Once, NodeTerms::new()).await.unwrap() {
        Acquire::Granted(g) => g.fencing_token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// Killed and restarted (same data dir) while a lock is held and a waiter waits: the lease
/// survives (etcd keeps it, with its full TTL again), the holder is not told it lost it, and
/// the waiter, whose watch stream died with the server, is still woken by the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_the_holder_and_wakes_the_waiter() {
    let mut srv = EtcdServer::start();
    let a = manager(&srv, opts()).await;
    let watching = srv.backend().await;
    let b = LockManager::with_options(watching.clone(), opts().retry(slow_fallback())).unwrap();
    let held = a.lock("k").acquire().await.unwrap();
    let fence = held.fencing_token();
    // A subscription (of its own lock: one release wakes one local subscriber) made before
    // the restart, listened to after it: its watch must have been re-created (the waiter
    // below also re-checks every second, which would hide a lost watch).
    let other = a.lock("j").acquire().await.unwrap();
    let sub = watching
        .subscribe(&claim("j", Duration::from_secs(5)))
        .await
        .unwrap();
    let disturbed = watching.disturbed();
    let waiting = b.lock("k");
    let key = waiting.key().clone();
    let waiter =
        tokio::spawn(async move { waiting.acquire_timeout(Duration::from_secs(30)).await });
    assert!(
        wait_for_async(SOON, || srv.waiters(&key) > 0).await,
        "the waiter subscribed and registered"
    );
    srv.restart();
    // The watchdog checks every lease after the reconnect: the lease is still there.
    let before = a.watchdog_stats().extended;
    within("an extension after the restart", async {
        while a.watchdog_stats().extended == before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(!held.is_lost(), "{:?}", a.watchdog_stats());
    assert!(!waiter.is_finished(), "the waiter took a held lock");
    within("disturbed() after the restart", disturbed).await;
    let woken = sub.listen();
    other.release().await.unwrap();
    within("the subscription's wake-up", woken).await;
    held.release().await.unwrap();
    let next = within("the waiter's hand-off", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(next.fencing_token() > fence);
    next.release().await.unwrap();
}

/// Down for longer than the lease's TTL: the holder is told `lost()`, not before its
/// deadline (the lease may hold until then), and after the restart the lock is taken again
/// with a larger fencing token once the old lease has run out on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_past_the_ttl_the_holder_is_told_lost() {
    let mut srv = EtcdServer::start();
    let a = manager(&srv, opts().ttl(Duration::from_secs(1))).await;
    let g = a.lock("k").acquire().await.unwrap();
    srv.kill();
    within("lost()", g.lost()).await;
    assert!(
        Instant::now() >= g.valid_until(),
        "lost() before the deadline"
    );
    srv.restart();
    let b = manager(&srv, opts()).await;
    let next = within("the next owner", b.lock("k").acquire())
        .await
        .unwrap();
    assert!(next.fencing_token() > g.fencing_token());
}

/// A paused (SIGSTOPped) etcd: calls fail within the call timeout rather than hang, the
/// holder is told `lost()` at its deadline, and once resumed the store serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_fails_calls_and_the_holder_is_told_lost() {
    let srv = EtcdServer::start();
    let a = manager(&srv, opts().ttl(Duration::from_secs(1))).await;
    let b = manager(&srv, opts()).await;
    let g = a.lock("k").acquire().await.unwrap();
    srv.pause();
    let began = Instant::now();
    let err = within("an answer while paused", b.lock("other").try_acquire())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(began.elapsed() < SOON);
    within("lost()", g.lost()).await;
    assert!(
        Instant::now() >= g.valid_until(),
        "lost() before the deadline"
    );
    srv.resume();
    let next = within("the next owner", b.lock("k").acquire())
        .await
        .unwrap();
    assert!(next.fencing_token() > g.fencing_token());
}

/// The watch stream cut under a waiter (the connection dropped, the server untouched): the
/// stream is opened again, `disturbed()` resolves, and the release still wakes the waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_watch_stream_is_reopened() {
    let srv = EtcdServer::start();
    let port: u16 = srv.url().rsplit(':').next().unwrap().parse().unwrap();
    let proxy = Proxy::start(port);
    let through = proxy.url().replace("redis://", "http://");
    let backend = EtcdBackend::connect_with(&through, EtcdServer::options())
        .await
        .unwrap();
    let disturbed = backend.disturbed();
    let sub = backend
        .subscribe(&claim("j", Duration::from_secs(5)))
        .await
        .unwrap();
    let a = manager(&srv, opts()).await;
    let b = LockManager::with_options(backend, opts().retry(slow_fallback())).unwrap();
    let held = a.lock("k").acquire().await.unwrap();
    let other = a.lock("j").acquire().await.unwrap();
    let waiting = b.lock("k");
    let key = waiting.key().clone();
    let waiter =
        tokio::spawn(async move { waiting.acquire_timeout(Duration::from_secs(30)).await });
    assert!(
        wait_for_async(SOON, || srv.waiters(&key) > 0).await,
        "the waiter subscribed and registered"
    );
    proxy.cut_clients();
    within("disturbed() after the cut", disturbed).await;
    // Listened to after the stream came back: only a re-created watch wakes it (the waiter
    // also re-checks every second, which would hide a lost watch).
    let woken = sub.listen();
    other.release().await.unwrap();
    within("the subscription's wake-up", woken).await;
    held.release().await.unwrap();
    within("the waiter's hand-off", waiter)
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A wiped data directory (etcd starts again at revision 1, with the same cluster id):
/// fencing tokens still never go backwards, for a backend that saw the old store and for
/// one that never did; and a holder whose lease went with the data is told `lost()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_store_never_mints_a_smaller_fence() {
    let mut srv = EtcdServer::start();
    let a = manager(&srv, opts()).await;
    let mut last = 0;
    for _ in 0..5 {
        let g = a.lock("f").acquire().await.unwrap();
        assert!(g.fencing_token() > last);
        last = g.fencing_token();
        g.release().await.unwrap();
    }
    let held = a.lock("held").acquire().await.unwrap();
    last = last.max(held.fencing_token());
    srv.wipe_and_restart();
    // A backend that never saw the old store takes the first lock of the new one.
    let fresh = manager(&srv, opts()).await;
    let g = within("a grant on the new store", fresh.lock("f").acquire())
        .await
        .unwrap();
    assert!(
        g.fencing_token() > last,
        "{} after {last}",
        g.fencing_token()
    );
    last = g.fencing_token();
    g.release().await.unwrap();
    // The old backend finds the new epoch.
    let g = within("a grant through the old backend", a.lock("f").acquire())
        .await
        .unwrap();
    assert!(
        g.fencing_token() > last,
        "{} after {last}",
        g.fencing_token()
    );
    g.release().await.unwrap();
    within("lost() of the wiped lease", held.lost()).await;
}

/// The same, when the backend that saw the old store is the first to use the new one: it
/// creates the new epoch above every fence it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_store_seen_first_by_an_old_backend() {
    let mut srv = EtcdServer::start();
    let b = srv.backend().await;
    let mut last = 0;
    for _ in 0..3 {
        let c = claim("f", Duration::from_secs(5));
        last = grant(&b, &c).await;
        b.release(&c, Release::Confirmed { lease: &c.token })
            .await
            .unwrap();
    }
    srv.wipe_and_restart();
    let c = claim("f", Duration::from_secs(5));
    let fence = within("a grant on the new store", async {
        loop {
            // The first calls after the restart may find the connection down.
            match b.acquire(&c, Attempt::Once, NodeTerms::new()).await {
                Ok(Acquire::Granted(g)) => break g.fencing_token,
                Ok(other) => panic!("{other:?}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    assert!(fence > last, "{fence} after {last}");
}

/// Re-sent commands are harmless: an acquire re-sent by its holder is granted again with the
/// same fence; a release re-sent after it went through answers `Some` again (the tombstone);
/// an acquire arriving after the release is not granted; another token's release answers
/// `None` and leaves the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_commands_answer_as_the_first() {
    let srv = EtcdServer::start();
    let b = srv.backend().await;
    let (c1, c2) = (
        claim("r", Duration::from_secs(5)),
        claim("r", Duration::from_secs(5)),
    );
    let fence = grant(&b, &c1).await;
    assert_eq!(
        grant(&b, &c1).await,
        fence,
        "a re-sent acquire keeps its fence"
    );
    let refused = b
        .acquire(&c2, Attempt::Once, NodeTerms::new())
        .await
        .unwrap();
    assert!(matches!(refused, Acquire::Held { .. }), "{refused:?}");
    let not_mine = Release::Confirmed { lease: &c2.token };
    assert_eq!(b.release(&c2, not_mine).await.unwrap(), None);
    let mine = Release::Confirmed { lease: &c1.token };
    assert_eq!(b.release(&c1, mine).await.unwrap(), Some(0));
    assert_eq!(
        b.release(&c1, mine).await.unwrap(),
        Some(0),
        "re-sent release"
    );
    // A late copy of the acquire, after the release: not granted again.
    let late = b
        .acquire(&c1, Attempt::Once, NodeTerms::new())
        .await
        .unwrap();
    assert!(matches!(late, Acquire::Held { .. }), "{late:?}");
    assert!(grant(&b, &c2).await > fence);
}

/// An abandoned claim is never granted afterwards (its late copy finds the bar), and an
/// abandon of a granted claim gives the lock back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_bars_a_late_acquire() {
    let srv = EtcdServer::start();
    let b = srv.backend().await;
    let late = claim("a", Duration::from_secs(5));
    assert_eq!(b.release(&late, Release::Abandon).await.unwrap(), None);
    let answer = b
        .acquire(&late, Attempt::Once, NodeTerms::new())
        .await
        .unwrap();
    assert!(matches!(answer, Acquire::Held { .. }), "{answer:?}");
    let granted = claim("a", Duration::from_secs(5));
    grant(&b, &granted).await;
    assert_eq!(
        b.release(&granted, Release::Abandon).await.unwrap(),
        Some(0)
    );
    let next = claim("a", Duration::from_secs(5));
    grant(&b, &next).await;
}

/// The connection dropped mid-grant: the acquire's transaction is held at a proxy while the
/// client's connection is cut, the caller (its outcome unknown) abandons the claim, and then
/// the held copy reaches etcd on the old connection. It must not take the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_of_an_abandoned_grant_takes_nothing() {
    let srv = EtcdServer::start();
    let port: u16 = srv.url().rsplit(':').next().unwrap().parse().unwrap();
    let proxy = Proxy::start(port);
    let through = proxy.url().replace("redis://", "http://");
    let b = EtcdBackend::connect_with(&through, EtcdServer::options())
        .await
        .unwrap();
    let c = claim("m", Duration::from_secs(5));
    let rule = proxy.hold_first(c.token.as_str().as_bytes());
    let sent = {
        let (b, c) = (b.clone(), c.clone());
        tokio::spawn(async move { b.acquire(&c, Attempt::Once, NodeTerms::new()).await })
    };
    assert!(
        proxy.wait_first_held(rule, SOON),
        "the acquire never reached the proxy"
    );
    proxy.cut_clients();
    let outcome = within("the cut acquire's answer", sent).await.unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
    // The caller does not know: it abandons (through a new connection).
    let direct = srv.backend().await;
    within("the abandon", async {
        while b.release(&c, Release::Abandon).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    proxy.pass_first(rule);
    assert!(proxy.wait_first_delivered(rule, SOON));
    // The late copy is at etcd, which answers it on the old connection (nobody reads it
    // now); when it applies it shows nowhere unless it took the lock, so the lock's key is
    // polled for a second (with neither the bar nor the revoke, the copy took the lock in
    // that second in 2 runs of 3; the others, it came too late to be seen).
    let mut raw = etcd_client::Client::connect(srv.endpoints(), None)
        .await
        .unwrap();
    let observed = Instant::now();
    while observed.elapsed() < Duration::from_secs(1) {
        let now = raw
            .get(format!("redlease/l/{}", c.key.as_str()), None)
            .await
            .unwrap();
        assert!(
            now.kvs()
                .iter()
                .all(|kv| kv.value() != c.token.as_str().as_bytes()),
            "the late copy of an abandoned acquire took the lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The next claim finds the lock free, not taken by the abandoned one.
    let other = claim("m", Duration::from_secs(5));
    let first = within("an answer for another claim", async {
        loop {
            match direct
                .acquire(&other, Attempt::Once, NodeTerms::new())
                .await
            {
                Ok(answer) => break answer,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    assert!(
        matches!(first, Acquire::Granted(_)),
        "the late copy took the lock: {first:?}"
    );
    let replay = direct
        .acquire(&c, Attempt::Once, NodeTerms::new())
        .await
        .unwrap();
    assert!(matches!(replay, Acquire::Held { .. }), "{replay:?}");
}

/// etcd's lease TTLs are whole seconds with a floor: the etcd lease is rounded up, the
/// grant promises the claim's own TTL less the drift margin, never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_is_the_claims_ttl_not_the_rounded_one() {
    let srv = EtcdServer::start();
    let b = srv.backend().await;
    let ttl = Duration::from_millis(1500);
    let c = claim("v", ttl);
    let Acquire::Granted(g) = b
        .acquire(&c, Attempt::Once, NodeTerms::new())
        .await
        .unwrap()
    else {
        panic!("free");
    };
    assert_eq!(g.validity, ttl - clock_drift(ttl));
    let info = b.inspect(&c.key).await.unwrap().unwrap();
    assert!(info.held);
    let left = info.remaining.unwrap();
    assert!(
        left >= Duration::from_secs(1) && left <= Duration::from_secs(2),
        "{left:?}"
    );
    let lease = c.lease(&g.lease);
    let ext = b.extend(&[lease], NodeTerms::new()).await.unwrap();
    assert_eq!(ext[0].validity(), Some(ttl - clock_drift(ttl)));
    // Longer than the etcd lease was granted with: the lock moves to a longer lease.
    let mut longer = lease;
    longer.ttl = Duration::from_secs(20);
    let ext = b.extend(&[longer], NodeTerms::new()).await.unwrap();
    assert!(ext[0].validity().is_some(), "{ext:?}");
    let left = b.inspect(&c.key).await.unwrap().unwrap().remaining.unwrap();
    assert!(left > Duration::from_secs(15), "{left:?}");
    assert_eq!(
        b.inspect(&c.key).await.unwrap().unwrap().fencing_token,
        Some(g.fencing_token),
        "moving to a new lease keeps the fence"
    );
}

/// An etcd store whose first grant answers after the grant's validity (this process, or the
/// way back, paused in between): what the engine gives back.
#[derive(Debug)]
struct LateFirstGrant {
    inner: EtcdBackend,
    /// The fencing token of the grant answered late, once there was one.
    late: std::sync::Mutex<Option<u64>>,
}

#[async_trait::async_trait]
impl support::Wrap for LateFirstGrant {
    fn inner(&self) -> &dyn Backend {
        &self.inner
    }

    async fn acquire(
        &self,
        claim: &Claim,
        attempt: Attempt,
        terms: NodeTerms,
    ) -> redlease::Result<Acquire> {
        let answer = self.inner.acquire(claim, attempt, terms).await?;
        if let Acquire::Granted(g) = &answer {
            let first = {
                let mut late = self.late.lock().unwrap();
                late.is_none()
                    .then(|| *late = Some(g.fencing_token))
                    .is_some()
            };
            if first {
                // The pause itself: the answer is to come back after the validity.
                tokio::time::sleep(g.validity + Duration::from_millis(100)).await;
            }
        }
        Ok(answer)
    }
}

/// A grant that came back after its validity is given back by the engine, and the next
/// attempt is granted while the lock is free. The give-back's tombstone bars its token on
/// etcd (so that a re-sent release is answered again), and the engine tried again with the
/// same token: refused for the tombstone's minutes, it waited out the caller's whole limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_given_back_late_is_granted_again() {
    let srv = EtcdServer::start();
    let store = Arc::new(support::Wrapped(LateFirstGrant {
        inner: srv.backend().await,
        late: std::sync::Mutex::new(None),
    }));
    let ttl = Duration::from_secs(1);
    let m = LockManager::with_options(store.clone(), LockOptions::new().ttl(ttl)).unwrap();
    let guard = m
        .lock("late-grant")
        .acquire_timeout(SOON)
        .await
        .expect("granted again after the give-back, the lock being free");
    let late = store
        .late
        .lock()
        .unwrap()
        .expect("a grant was answered late");
    assert!(
        guard.fencing_token() > late,
        "a new grant, after the one given back"
    );
    let other = manager(&srv, opts()).await;
    assert!(
        other
            .lock("late-grant")
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "the guard holds the lock"
    );
    guard.release().await.expect("release");
}

/// Malformed endpoints are refused with `InvalidConfig`; an endpoint nobody listens on fails
/// within the connect timeout, never hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_endpoints_fail_fast() {
    for bad in [
        "",
        " , ",
        "https://127.0.0.1:2379",
        "redis://127.0.0.1:1",
        "nonsense",
        "127.0.0.1:0",
        "h:p",
    ] {
        let err = EtcdBackend::connect(bad).await.unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{bad:?}: {err:?}");
    }
    let err = EtcdBackend::connect_with(
        "http://127.0.0.1:1",
        EtcdOptions::new().timeout(Duration::ZERO),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    let began = Instant::now();
    let opts = EtcdOptions::new()
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_millis(500));
    let err = within(
        "a refused connect",
        EtcdBackend::connect_with("127.0.0.1:1", opts),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(began.elapsed() < SOON);
}

/// An application's own client: its backend shares the locks of a backend that connected by
/// itself (fences, exclusion, wake-ups), under the same prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_an_applications_client() {
    let srv = EtcdServer::start();
    let client = etcd_client::Client::connect(srv.endpoints(), None)
        .await
        .unwrap();
    let theirs = LockManager::with_options(EtcdBackend::from_client(client), opts()).unwrap();
    let ours = manager(&srv, opts().retry(slow_fallback())).await;
    let g = theirs.lock("shared").acquire().await.unwrap();
    assert!(ours.lock("shared").try_acquire().await.unwrap().is_none());
    let waiting = ours.lock("shared");
    let key = waiting.key().clone();
    let waiter = tokio::spawn(async move { waiting.acquire().await });
    assert!(
        wait_for_async(SOON, || srv.waiters(&key) > 0).await,
        "the waiter subscribed and registered"
    );
    let fence = g.fencing_token();
    g.release().await.unwrap();
    let next = within("the hand-off", waiter).await.unwrap().unwrap();
    assert!(next.fencing_token() > fence);
    // Another prefix is another set of locks.
    let client = etcd_client::Client::connect(srv.endpoints(), None)
        .await
        .unwrap();
    let other = EtcdBackend::from_client_with(client, EtcdOptions::new().prefix("other/")).unwrap();
    let other = LockManager::with_options(Arc::new(other), opts()).unwrap();
    assert!(other.lock("shared").try_acquire().await.unwrap().is_some());
}

// ---------------------------------------------------------------------------------------
// The stampede cache on etcd.
// ---------------------------------------------------------------------------------------

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error("origin down: {0}")]
    Origin(String),
    #[error(transparent)]
    Cache(#[from] Error),
}

async fn caches(srv: &EtcdServer, n: usize) -> Vec<Cache> {
    let mut out = Vec::new();
    for _ in 0..n {
        let options = CacheOptions::new().wait_timeout(SOON);
        out.push(Cache::with_options(srv.backend().await, options).unwrap());
    }
    out
}

/// 30 callers over three caches (three backends, as three processes): one origin call, the
/// other caches' callers wait for its fill (woken by the watch), and a fourth cache reads
/// the stored value without calling its loader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_computes_once_across_backends() {
    let srv = EtcdServer::start();
    let caches = caches(&srv, 4).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (open, gate) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..30 {
        let cache = caches[i % 3].clone();
        let (calls, mut gate) = (calls.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            cache
                .get_with("hot", Duration::from_secs(30), move || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    "fresh"
                })
                .await
        }));
    }
    let joined = || caches.iter().map(|c| c.stats().calls).sum::<u64>() == 30;
    assert!(wait_for_async(SOON, joined).await);
    assert!(wait_for_async(SOON, || calls.load(Ordering::SeqCst) == 1).await);
    open.send_replace(true);
    for t in tasks {
        let v = within("a caller's answer", t).await.unwrap().unwrap();
        assert_eq!(&v[..], b"fresh");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one origin call");
    let v = caches[3]
        .get_with("hot", Duration::from_secs(30), || async { "unused" })
        .await
        .unwrap();
    assert_eq!(&v[..], b"fresh", "the stored value");
    assert_eq!(caches[3].stats().loads, 0);
}

/// An origin error reaches the callers in the other caches as the round's error (not a
/// second origin call), and nothing is cached: the next call loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_origin_error_reaches_the_other_backends() {
    let srv = EtcdServer::start();
    let caches = caches(&srv, 2).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (open, gate) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..10 {
        let cache = caches[i % 2].clone();
        let (calls, mut gate) = (calls.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            cache
                .try_get_with("q", Duration::from_secs(30), move || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    Err::<Bytes, _>(AppError::Origin("connection refused".into()))
                })
                .await
        }));
    }
    let joined = || caches.iter().map(|c| c.stats().calls).sum::<u64>() == 10;
    assert!(wait_for_async(SOON, joined).await);
    assert!(wait_for_async(SOON, || calls.load(Ordering::SeqCst) == 1).await);
    open.send_replace(true);
    let mut remote = 0;
    for t in tasks {
        let err = within("a caller's answer", t)
            .await
            .unwrap()
            .expect_err("a failed compute gives no value");
        match &*err {
            AppError::Origin(m) => assert_eq!(m, "connection refused"),
            AppError::Cache(Error::LoadFailed { message }) => {
                assert_eq!(message, "origin down: connection refused");
                remote += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(remote, 5, "the other cache's callers got the round's error");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let v = caches[1]
        .try_get_with("q", Duration::from_secs(30), || async {
            Ok::<_, AppError>("rows")
        })
        .await
        .unwrap();
    assert_eq!(&v[..], b"rows");
}

/// A loader whose compute lease went (deleted here, as after a long pause) cannot overwrite
/// the newer value another cache wrote: the fill is fenced by the lease's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_loader_that_lost_its_lease_cannot_overwrite() {
    let srv = EtcdServer::start();
    let caches = caches(&srv, 3).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (open, mut gate) = tokio::sync::watch::channel(false);
    let old = tokio::spawn({
        let (cache, calls) = (caches[0].clone(), calls.clone());
        async move {
            cache
                .get_with("f", Duration::from_secs(30), move || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    "old"
                })
                .await
        }
    });
    assert!(wait_for_async(SOON, || calls.load(Ordering::SeqCst) == 1).await);
    // The only lock there is: the compute lease of "f".
    let mut raw = etcd_client::Client::connect(srv.endpoints(), None)
        .await
        .unwrap();
    let gone = raw
        .delete(
            "redlease/l/",
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_eq!(gone.deleted(), 1);
    let v = caches[1]
        .get_with("f", Duration::from_secs(30), || async { "new" })
        .await
        .unwrap();
    assert_eq!(&v[..], b"new");
    open.send_replace(true);
    let v = within("the late loader", old).await.unwrap().unwrap();
    assert_eq!(
        &v[..],
        b"new",
        "the late loader's callers get the stored value"
    );
    let v = caches[2]
        .get_with("f", Duration::from_secs(30), || async { "unused" })
        .await
        .unwrap();
    assert_eq!(&v[..], b"new", "the fenced fill refused the late value");
}

/// What an uncontended cycle costs etcd, counted rather than timed (the calls etcd served,
/// by method, from its metrics): an acquire is a lease grant and a transaction, a release a
/// transaction and a lease revoke (sent in the background, after the answer). The time per
/// cycle is printed for the record, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_cycle_costs_four_calls() {
    let srv = EtcdServer::start();
    let locks = manager(&srv, opts().watchdog(false)).await;
    // Warm: the epoch is read once per backend.
    locks
        .lock("c")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let revoked = || srv.calls().get("LeaseRevoke").copied().unwrap_or(0);
    assert!(wait_for_async(SOON, || revoked() == 1).await);
    let settled = revoked();
    let before = srv.calls();
    let synced = srv.fsyncs();
    let cycles = 200;
    let began = Instant::now();
    let (mut acquiring, mut releasing) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..cycles {
        let at = Instant::now();
        let g = locks.lock("c").acquire().await.unwrap();
        let granted = Instant::now();
        g.release().await.unwrap();
        acquiring += granted - at;
        releasing += granted.elapsed();
    }
    let took = began.elapsed();
    // The revokes are sent after each release's answer: wait until all have come.
    assert!(wait_for_async(SOON, || revoked() == settled + cycles).await);
    let after = srv.calls();
    let per_cycle: std::collections::BTreeMap<&str, f64> = after
        .iter()
        .map(|(m, n)| {
            (
                m.as_str(),
                (n - before.get(m).copied().unwrap_or(0)) as f64 / cycles as f64,
            )
        })
        .filter(|(_, n)| *n > 0.0)
        .collect();
    let (fsyncs, fsync_secs) = srv.fsyncs();
    println!(
        "etcd, uncontended acquire + release: {per_cycle:?} per cycle; {:?} per cycle over \
         {cycles} cycles (acquire {:?}, release {:?}); etcd fsynced its log {:.1} times per \
         cycle, {:.2} ms each",
        took / cycles as u32,
        acquiring / cycles as u32,
        releasing / cycles as u32,
        (fsyncs - synced.0) as f64 / cycles as f64,
        (fsync_secs - synced.1) * 1000.0 / (fsyncs - synced.0).max(1) as f64
    );
    let expected: std::collections::BTreeMap<&str, f64> =
        [("LeaseGrant", 1.0), ("LeaseRevoke", 1.0), ("Txn", 2.0)].into();
    assert_eq!(per_cycle, expected);
}

/// Outside any tokio runtime (a plain thread, a futures executor): the client's calls run
/// in the crate's own tokio context, and locks, waits and the watchdog work as on tokio.
#[test]
fn works_without_a_tokio_runtime() {
    let srv = EtcdServer::start();
    futures::executor::block_on(async {
        let a = LockManager::with_options(srv.backend().await, opts()).unwrap();
        let b = LockManager::with_options(srv.backend().await, opts()).unwrap();
        let g = a.lock("plain-thread").acquire().await.unwrap();
        assert!(b
            .lock("plain-thread")
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        let fence = g.fencing_token();
        g.release().await.unwrap();
        let next = b.lock("plain-thread").acquire().await.unwrap();
        assert!(next.fencing_token() > fence);
        next.release().await.unwrap();
    });
}

/// A name too long for an etcd request fails alone, with an error and no hang; its
/// neighbours are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_too_long_for_etcd_fails_alone() {
    let srv = EtcdServer::start();
    let locks = manager(&srv, opts()).await;
    let g = locks.lock("before").acquire().await.unwrap();
    let huge = "x".repeat(2 << 20);
    let err = within("the huge name's answer", locks.lock(&huge).try_acquire())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    let after = locks.lock("after").try_acquire().await.unwrap();
    assert!(after.is_some());
    assert!(!g.is_lost());
    g.release().await.unwrap();
}
