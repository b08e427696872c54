//! Bad input gets `Error::InvalidConfig` naming what is wrong: never a panic, a hang or a
//! silent fallback. Also the URL features that must work: ACL auth, passwords, databases.

mod support;

use std::time::Duration;

use redlease::{
    Error, LockManager, LockOptions, MemoryBackend, RedisBackend, RedisOptions, RetryPolicy,
};
use support::RedisServer;

/// Connects, bounded by a generous limit: failing to return at all is the bug.
async fn connect_bounded(url: &str, opts: RedisOptions) -> redlease::Result<RedisBackend> {
    tokio::time::timeout(
        Duration::from_secs(10),
        RedisBackend::connect_with(url, opts),
    )
    .await
    .expect("connect must fail or succeed, not hang")
}

fn invalid_message(r: redlease::Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::InvalidConfig(msg)) => msg,
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn bad_options_are_named() {
    let cases: Vec<(LockOptions, &str)> = vec![
        (LockOptions::new().ttl(Duration::ZERO), "ttl"),
        (LockOptions::new().ttl(Duration::from_millis(3)), "ttl"),
        (
            LockOptions::new()
                .ttl(Duration::from_secs(1))
                .watchdog_interval(Duration::from_secs(1)),
            "watchdog interval",
        ),
        (
            LockOptions::new()
                .ttl(Duration::from_secs(1))
                .watchdog_interval(Duration::from_secs(5)),
            "watchdog interval",
        ),
        (
            LockOptions::new()
                .ttl(Duration::from_secs(1))
                .watchdog_interval(Duration::from_millis(600)),
            "half the ttl",
        ),
        (
            LockOptions::new().watchdog_interval(Duration::ZERO),
            "watchdog interval",
        ),
        (LockOptions::new().key_prefix("app:{x}:"), "key prefix"),
        (
            LockOptions::new().retry(RetryPolicy::polling().min_delay(Duration::from_secs(2))),
            "min_delay",
        ),
        (
            LockOptions::new().retry(RetryPolicy::notify().max_delay(Duration::ZERO)),
            "retry",
        ),
    ];
    for (opts, needle) in cases {
        let msg = invalid_message(opts.validate());
        assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
        let msg = invalid_message(LockManager::with_options(
            MemoryBackend::new(),
            opts.clone(),
        ));
        assert!(msg.contains(needle), "{msg:?}");
    }
}

/// An empty name from `lock` fails at acquire; `lock_with` checks the name and the options
/// when the lock is made.
#[tokio::test]
async fn bad_per_lock_options_and_names_are_refused() {
    let locks = LockManager::new(MemoryBackend::new());
    let msg = invalid_message(locks.lock("").acquire().await);
    assert!(msg.contains("name"), "{msg}");
    let msg = invalid_message(locks.lock("").try_acquire().await);
    assert!(msg.contains("name"), "{msg}");
    let msg = invalid_message(locks.lock_with("", |o| o));
    assert!(msg.contains("name"), "{msg}");
    let msg = invalid_message(locks.lock_with("x", |o| o.ttl(Duration::ZERO)));
    assert!(msg.contains("ttl"), "{msg}");
    // Nothing was left behind by the rejected calls.
    assert!(locks.lock("x").try_acquire().await.unwrap().is_some());
}

#[tokio::test]
async fn bad_urls_are_rejected_before_connecting() {
    for (url, needle) in [
        ("", "scheme"),
        ("127.0.0.1:6379", "scheme"),
        ("http://127.0.0.1:6379", "scheme"),
        ("redis://", "host"),
        ("redis://:6379", "host"),
        ("redis://127.0.0.1:notaport", "malformed"),
        ("redis://127.0.0.1:99999", "malformed"),
    ] {
        let msg = invalid_message(RedisBackend::connect(url).await);
        assert!(
            msg.contains(needle),
            "{url:?}: {msg:?} should mention {needle:?}"
        );
    }
    for opts in [
        RedisOptions::new().command_timeout(Duration::ZERO),
        RedisOptions::new().command_timeout(Duration::MAX),
        RedisOptions::new().connect_timeout(Duration::MAX),
    ] {
        let msg = invalid_message(RedisBackend::connect_with("redis://127.0.0.1", opts).await);
        assert!(msg.contains("timeout"), "{msg}");
    }
}

/// fred would quietly use plain TCP for `rediss://` without a TLS feature.
#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn rediss_without_the_tls_feature_is_refused() {
    let msg = invalid_message(RedisBackend::connect("rediss://127.0.0.1:6379").await);
    assert!(msg.contains("tls"), "{msg}");
}

/// With TLS compiled in, `rediss://` really speaks TLS: a plain-text server cannot complete
/// the handshake, so connecting fails (within the connect timeout) instead of falling back,
/// saying that the server did not speak TLS (tests/tls.rs has the rest).
#[cfg(feature = "tls")]
#[tokio::test]
async fn rediss_with_the_tls_feature_speaks_tls() {
    let srv = RedisServer::start();
    let url = format!("rediss://127.0.0.1:{}", srv.port());
    let opts = RedisOptions::new().connect_timeout(Duration::from_millis(500));
    let msg = invalid_message(connect_bounded(&url, opts).await);
    assert!(msg.contains("did not speak TLS"), "{msg}");
}

#[tokio::test]
async fn unreachable_server_fails_within_the_connect_timeout() {
    let srv = RedisServer::start();
    let url = srv.url();
    drop(srv); // nothing listens there now
    let opts = RedisOptions::new().connect_timeout(Duration::from_millis(300));
    let result = connect_bounded(&url, opts).await;
    assert!(matches!(result, Err(Error::Backend { .. })), "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_user_in_the_url_authenticates() {
    let srv = RedisServer::start_with(&["--user", "alice", "on", ">s3cret", "~*", "&*", "+@all"]);
    let url = format!("redis://alice:s3cret@127.0.0.1:{}", srv.port());
    let locks = LockManager::new(RedisBackend::connect(&url).await.unwrap());
    let g = locks.lock("acl").acquire().await.unwrap();
    g.release().await.unwrap();

    let wrong = format!("redis://alice:nope@127.0.0.1:{}", srv.port());
    let opts = RedisOptions::new().connect_timeout(Duration::from_secs(1));
    let result = connect_bounded(&wrong, opts).await;
    assert!(matches!(result, Err(Error::Backend { .. })), "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_and_database_in_the_url_are_used() {
    let srv = RedisServer::start_with(&["--requirepass", "pw"]);
    let url = format!("redis://:pw@127.0.0.1:{}/3", srv.port());
    let locks = LockManager::new(RedisBackend::connect(&url).await.unwrap());
    let g = locks.lock("db").acquire().await.unwrap();
    let key = locks.lock("db").key().as_str().to_owned();
    let mut conn = srv.connect();
    conn.cmd(&["SELECT", "3"]).unwrap();
    assert_eq!(
        conn.cmd(&["EXISTS", &key]).unwrap().as_int(),
        Some(1),
        "lease lives in db 3"
    );
    conn.cmd(&["SELECT", "0"]).unwrap();
    assert_eq!(
        conn.cmd(&["EXISTS", &key]).unwrap().as_int(),
        Some(0),
        "not in db 0"
    );
    g.release().await.unwrap();
}

/// Limits too large to represent mean "no limit", never a panic.
#[tokio::test]
async fn huge_durations_never_panic() {
    let locks = LockManager::new(MemoryBackend::new());
    let g = locks
        .lock("max")
        .acquire_timeout(Duration::MAX)
        .await
        .unwrap();
    let msg = invalid_message(g.extend(Duration::MAX).await);
    assert!(msg.contains("ttl"), "{msg}");
    g.extend(Duration::from_secs(60)).await.unwrap();
    g.release().await.unwrap();
    let forever = locks
        .lock_with("max", |o| o.wait_timeout(Some(Duration::MAX)))
        .unwrap();
    forever.acquire().await.unwrap().release().await.unwrap();
}

/// A lease TTL past the cap, sent to the Redis store directly (the lock API caps it
/// earlier): refused before anything is written, for an acquire and for an extension.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_lease_past_the_ttl_cap_is_refused_before_anything_is_written() {
    use redlease::backend::{Attempt, Backend, Claim, Extended, Lease, NodeTerms};
    let srv = RedisServer::start();
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    let key = redlease::LeaseKey::new("redlease:", "forever");
    let huge = Duration::from_secs(100 * 365 * 24 * 3600);
    let claim = Claim::new(key.clone(), redlease::Token::random(), huge);
    let msg = invalid_message(
        backend
            .acquire(&claim, Attempt::Once, NodeTerms::new())
            .await,
    );
    assert!(msg.contains("TTL"), "{msg}");
    assert_eq!(srv.cmd(&["EXISTS", key.as_str()]).as_int(), Some(0));
    let token = redlease::Token::random();
    let sane = Claim::new(key.clone(), token.clone(), Duration::from_secs(5));
    backend
        .acquire(&sane, Attempt::Once, NodeTerms::new())
        .await
        .expect("acquire");
    let lease = |ttl| Lease {
        key: &key,
        token: &token,
        ttl,
    };
    let leases = [lease(huge), lease(Duration::from_secs(5))];
    let out = backend
        .extend(&leases, NodeTerms::new())
        .await
        .expect("extend");
    assert!(
        matches!(&out[0], Extended::Failed(Error::InvalidConfig(m)) if m.contains("TTL")),
        "{out:?}"
    );
    assert!(matches!(out[1], Extended::Held(_)), "{out:?}");
    assert!(support::lease_ms(&srv, key.as_str()) <= 5_000);
}

/// A nanosecond watchdog interval made thousands of rounds a second, and a nanosecond
/// command timeout failed every command: below their minimums, intervals, delays and
/// timeouts are refused, naming the minimum; at the minimum they are accepted.
#[tokio::test]
async fn intervals_delays_and_timeouts_below_their_minimum_are_refused() {
    let tiny = Duration::from_nanos(1);
    let min = redlease::MIN_INTERVAL;
    let cases: Vec<LockOptions> = vec![
        LockOptions::new().watchdog_interval(tiny),
        LockOptions::new().watchdog_interval(min - tiny),
        LockOptions::new().retry(RetryPolicy::polling().min_delay(tiny)),
        LockOptions::new().retry(RetryPolicy::notify().max_delay(min - tiny)),
    ];
    for opts in cases {
        let msg = invalid_message(opts.validate());
        assert!(msg.contains("1ms"), "{msg:?} should name the minimum");
    }
    let ttl = LockOptions::new().ttl(redlease::MIN_TTL);
    assert!(ttl.clone().watchdog_interval(min).validate().is_ok());
    assert!(LockOptions::new()
        .retry(RetryPolicy::polling().min_delay(min).max_delay(min))
        .validate()
        .is_ok());

    // Redis timeouts: refused before anything is sent (nothing listens on port 1).
    for opts in [
        RedisOptions::new().command_timeout(tiny),
        RedisOptions::new().connect_timeout(RedisOptions::MIN_TIMEOUT - tiny),
    ] {
        let msg = invalid_message(connect_bounded("redis://127.0.0.1:1", opts).await);
        assert!(msg.contains("10ms"), "{msg:?} should name the minimum");
    }
    // At the minimum the options are accepted (a lazy backend checks them and nothing else).
    let at_min = RedisOptions::new()
        .command_timeout(RedisOptions::MIN_TIMEOUT)
        .connect_timeout(RedisOptions::MIN_TIMEOUT);
    RedisBackend::connect_lazy("redis://127.0.0.1:1", at_min)
        .await
        .expect("timeouts at the minimum are accepted");

    let msg = invalid_message(redlease::Redlock::with_options(
        vec![MemoryBackend::new()],
        redlease::RedlockOptions::new().node_timeout(Duration::from_micros(999)),
    ));
    assert!(msg.contains("node_timeout"), "{msg}");
}

/// Polls `f` (an attempt on the store) every 20 ms until it says yes, for at most 10 s: the
/// reconnect it waits for is not an event the test can await.
async fn until<F, Fut>(mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

fn policy_refusal(r: redlease::Result<impl std::fmt::Debug>, policy: &str) {
    let msg = invalid_message(r);
    assert!(
        msg.contains(policy) && msg.contains("noeviction") && msg.contains("allow_eviction"),
        "names the policy and the fix: {msg}"
    );
}

/// A server that may evict keys frees locks behind their holders' backs: refused at connect,
/// naming the policy and the fix, unless accepted explicitly (`volatile-*` too: every lease
/// has a TTL).
#[tokio::test]
async fn a_server_that_may_evict_keys_is_refused_at_connect_unless_accepted() {
    for policy in ["allkeys-lru", "allkeys-random", "volatile-lru"] {
        let srv = RedisServer::start_with(&["--maxmemory-policy", policy]);
        policy_refusal(
            connect_bounded(&srv.url(), RedisOptions::new()).await,
            policy,
        );
        let accepted = connect_bounded(&srv.url(), RedisOptions::new().allow_eviction(true))
            .await
            .expect("accepted explicitly");
        let locks = LockManager::new(accepted);
        let held = locks.lock("evictable").try_acquire().await.unwrap();
        assert!(held.is_some(), "{policy}: locks work once accepted");
    }
}

/// Every connection reads the policy again: after a reconnect finds an evicting policy, new
/// acquires are refused; once the server is fixed and a connection made again, they work.
#[tokio::test]
async fn a_reconnect_that_finds_an_evicting_policy_refuses_new_acquires() {
    let srv = RedisServer::start();
    let locks = LockManager::new(
        connect_bounded(&srv.url(), RedisOptions::new())
            .await
            .unwrap(),
    );
    let lock = locks.lock("policy");
    lock.try_acquire()
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();

    srv.cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-random"]);
    srv.kill_clients();
    let refused =
        until(|| async { matches!(lock.try_acquire().await, Err(Error::InvalidConfig(_))) }).await;
    assert!(refused, "an acquire after the reconnect must be refused");
    policy_refusal(lock.try_acquire().await, "allkeys-random");

    srv.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    srv.kill_clients();
    let works = until(|| async { matches!(lock.try_acquire().await, Ok(Some(_))) }).await;
    assert!(works, "acquires work again once the server is fixed");
    // A refused attempt sent nothing, so nothing was abandoned (no tombstone written).
    let tombstones = lock.key().derived("abandoned");
    assert_eq!(srv.cmd(&["EXISTS", &tombstones]).as_int(), Some(0));
}

/// A policy changed at run time, with no reconnect (`CONFIG SET` on the live server): the
/// holders are told (their leases may be evicted without a word, so none can be guaranteed)
/// and new acquires are refused, long before the next extension round would have looked
/// (the leases' TTL is a minute: their first round is 20 s away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_policy_set_at_run_time_tells_holders_and_refuses_acquires() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().ttl(Duration::from_secs(60));
    let backend = connect_bounded(&srv.url(), RedisOptions::new())
        .await
        .unwrap();
    let locks = LockManager::with_options(backend, opts).unwrap();
    let mut guards = Vec::new();
    for i in 0..20 {
        let g = locks.lock(&format!("evict:{i}")).try_acquire().await;
        guards.push(g.unwrap().expect("free"));
    }

    srv.cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let all_lost = futures::future::join_all(guards.iter().map(|g| g.lost()));
    tokio::time::timeout(Duration::from_secs(10), all_lost)
        .await
        .expect("every holder is told once the policy may evict its lease");
    policy_refusal(locks.lock("evict:new").try_acquire().await, "allkeys-lru");
    assert_eq!(locks.watchdog_stats().lost, 20);

    // Fixed on the live server: acquires work again without a reconnect.
    srv.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    let works =
        until(|| async { matches!(locks.lock("evict:new").try_acquire().await, Ok(Some(_))) })
            .await;
    assert!(works, "acquires work again once the policy is noeviction");
}

/// With eviction accepted, a policy changed at run time loses nobody's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_eviction_policy_set_at_run_time_loses_nothing() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().ttl(Duration::from_millis(600));
    let backend = connect_bounded(&srv.url(), RedisOptions::new().allow_eviction(true))
        .await
        .unwrap();
    let locks = LockManager::with_options(backend, opts).unwrap();
    let g = locks
        .lock("evict:ok")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    srv.cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let before = locks.watchdog_stats().extended;
    let extended = support::wait_for_async(Duration::from_secs(10), || {
        locks.watchdog_stats().extended >= before + 3
    })
    .await;
    assert!(extended, "{:?}", locks.watchdog_stats());
    assert!(!g.is_lost());
    assert!(locks
        .lock("evict:new")
        .try_acquire()
        .await
        .unwrap()
        .is_some());
}
