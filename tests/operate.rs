//! Operating locks: inspection ("who holds it?") before, during and after a hold, plain and
//! fair, on Redis, in memory and over Redlock; a maximum hold that ends a hold and fires
//! `lost()`; fenced writes that refuse a paused holder's late write.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redlease::backend::{Attempt, Claim, NodeTerms};
use redlease::{
    Backend, Error, FencedWrite, LockInfo, LockManager, LockOptions, MemoryBackend, RedisBackend,
    RedisOptions, Redlock, RedlockOptions,
};
use support::RedisServer;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Bound for things that must happen "soon": failing it means a hang, not slowness.
const SOON: Duration = Duration::from_secs(10);

async fn redis(srv: &RedisServer) -> RedisBackend {
    RedisBackend::connect(&srv.url()).await.unwrap()
}

fn labelled(ttl: Duration, label: &str) -> LockOptions {
    LockOptions::new().ttl(ttl).holder_label(label)
}

/// Inspection before, during and after one plain hold, on any backend.
async fn inspect_a_plain_hold(backend: Arc<dyn Backend>) {
    let locks =
        LockManager::with_options(backend, labelled(Duration::from_secs(5), "host-a:42")).unwrap();
    let lock = locks.lock("report");
    assert_eq!(lock.inspect().await.unwrap(), None, "never held: no trace");

    let guard = lock.acquire().await.unwrap();
    let during = lock.inspect().await.unwrap().expect("held");
    assert!(during.held);
    assert_eq!(during.holder_label.as_deref(), Some("host-a:42"));
    assert_eq!(during.fencing_token, Some(guard.fencing_token()));
    let left = during.remaining.expect("a held lease has a TTL");
    assert!(left > ms(4000) && left <= ms(5000), "ttl left {left:?}");
    assert_eq!(during.queue_len, 0);
    assert_eq!(during.reentrant_count, None);
    // The printed form shows the label and never the secret token.
    let shown = format!("{during} {during:?}");
    assert!(shown.contains("host-a:42"), "{shown}");

    let token = guard.fencing_token();
    guard.release().await.unwrap();
    let after = lock
        .inspect()
        .await
        .unwrap()
        .expect("the last token is remembered");
    assert!(!after.held);
    assert_eq!((after.remaining, after.holder_label), (None, None));
    assert_eq!(after.fencing_token, Some(token));

    // A holder without a label replaces the label; nothing stale shows.
    let plain = LockManager::with_options(locks.backend().clone(), LockOptions::new()).unwrap();
    let g2 = plain.lock("report").acquire().await.unwrap();
    let info = lock.inspect().await.unwrap().expect("held");
    assert!(info.held && info.holder_label.is_none(), "{info:?}");
    assert!(info.fencing_token > Some(token));
    g2.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_holder_ttl_and_token_in_memory() {
    inspect_a_plain_hold(Arc::new(MemoryBackend::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_holder_ttl_and_token_on_redis() {
    let srv = RedisServer::start();
    inspect_a_plain_hold(Arc::new(redis(&srv).await)).await;
    // The label is kept in the lock's record while held and goes with the release.
    let record = srv.cmd(&["HGETALL", "redlease:{report}"]);
    let fields = format!("{record:?}");
    assert!(!fields.contains("host-a"), "{fields}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_over_redlock_reports_what_a_majority_holds() {
    let nodes: Vec<MemoryBackend> = (0..3).map(|_| MemoryBackend::new()).collect();
    let redlock = Redlock::with_options(nodes.clone(), RedlockOptions::new()).unwrap();
    inspect_a_plain_hold(Arc::new(redlock)).await;

    // One node alone holding a lease (a stray grant) is not a majority: not held.
    let key = redlease::LeaseKey::new("redlease:", "stray");
    let token = redlease::Token::random().with_label(Some("stray".into()));
    let claim = Claim::new(key.clone(), token, Duration::from_secs(5));
    let (once, terms) = (Attempt::Once, NodeTerms::new());
    nodes[0].acquire(&claim, once, terms).await.unwrap();
    let redlock = Redlock::new(nodes.clone()).unwrap();
    let info = redlock
        .inspect(&key)
        .await
        .unwrap()
        .expect("a fence is known");
    assert!(!info.held && info.holder_label.is_none(), "{info:?}");
    // Two of three: held, with that label.
    nodes[1].acquire(&claim, once, terms).await.unwrap();
    let info = redlock.inspect(&key).await.unwrap().expect("held");
    assert!(info.held, "{info:?}");
    assert_eq!(info.holder_label.as_deref(), Some("stray"));
}

/// Fair waiters are counted while they queue, and leave the count when served.
async fn inspect_a_fair_queue(backend: Arc<dyn Backend>) {
    let opts = labelled(Duration::from_secs(5), "fair-holder").fair(true);
    let locks = LockManager::with_options(backend, opts).unwrap();
    let lock = locks.lock("printer");
    let holder = lock.acquire().await.unwrap();
    // Each waiter releases before it returns, so the lock is free once both are done (a
    // dropped guard would release in the background, after the check below).
    let waiter = |lock: redlease::Lock| async move {
        let g = lock.acquire().await?;
        let token = g.fencing_token();
        g.release().await.map(|_| token)
    };
    let w1 = tokio::spawn(waiter(lock.clone()));
    let w2 = tokio::spawn(waiter(lock.clone()));
    // Both waiters show up in the queue (an event on the store: polled with a bound).
    let began = Instant::now();
    let mut seen = LockInfo::new();
    while began.elapsed() < SOON {
        seen = lock.inspect().await.unwrap().expect("held");
        if seen.queue_len == 2 {
            break;
        }
        support::sleep_async(ms(5)).await;
    }
    assert_eq!(seen.queue_len, 2, "{seen:?}");
    assert!(seen.held);
    assert_eq!(seen.holder_label.as_deref(), Some("fair-holder"));
    holder.release().await.unwrap();
    tokio::time::timeout(SOON, w1)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    tokio::time::timeout(SOON, w2)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let after = lock.inspect().await.unwrap().expect("fence remembered");
    assert_eq!((after.held, after.queue_len), (false, 0), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_fair_waiters_in_memory() {
    inspect_a_fair_queue(Arc::new(MemoryBackend::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_fair_waiters_on_redis() {
    let srv = RedisServer::start();
    inspect_a_fair_queue(Arc::new(redis(&srv).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reports_a_reentrant_count_from_the_owners_hash() {
    // The reentrant layout: a hash {owner: count} beside the lease.
    let srv = RedisServer::start();
    let locks = LockManager::new(redis(&srv).await);
    let lock = locks.lock("nested");
    let _g = lock.acquire().await.unwrap();
    assert_eq!(lock.inspect().await.unwrap().unwrap().reentrant_count, None);
    srv.cmd(&["HSET", "redlease:{nested}:owners", "a", "2", "b", "1"]);
    assert_eq!(
        lock.inspect().await.unwrap().unwrap().reentrant_count,
        Some(3)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_refuses_an_empty_name() {
    let locks = LockManager::new(MemoryBackend::new());
    let err = locks.lock("").inspect().await.unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
}

#[test]
fn max_hold_is_checked_against_the_ttl_and_the_year() {
    let ttl = LockOptions::new().ttl(ms(500));
    assert!(ttl.clone().max_hold(ms(499)).validate().is_err());
    assert!(ttl.clone().max_hold(ms(500)).validate().is_ok());
    let msg = ttl
        .max_hold(redlease::MAX_TTL + ms(1))
        .validate()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("max_hold"), "{msg}");
    let long = "x".repeat(redlease::MAX_LABEL_LEN + 1);
    assert!(LockOptions::new().holder_label(long).validate().is_err());
}

/// A capped hold is extended up to the cap, then runs out: `lost()` fires near the cap,
/// and another contender gets the lock.
async fn max_hold_ends_the_hold(backend: Arc<dyn Backend>) {
    let ttl = ms(200);
    let cap = ms(700);
    let opts = LockOptions::new().ttl(ttl).max_hold(cap);
    let locks = LockManager::with_options(backend, opts).unwrap();
    let began = Instant::now();
    let guard = locks.lock("stuck").acquire().await.unwrap();
    tokio::time::timeout(SOON, guard.lost())
        .await
        .expect("lost() fired");
    let held = began.elapsed();
    assert!(guard.is_lost());
    // Extended past the first ttl (the watchdog worked), stopped by the cap (not later than
    // the cap plus a watchdog tick).
    assert!(
        held > ttl * 2,
        "lost after {held:?}: the watchdog never extended"
    );
    assert!(held <= cap + ms(150), "lost after {held:?}, cap {cap:?}");
    // The store agrees: someone else takes it within a tick of the cap.
    let next = locks
        .lock("stuck")
        .acquire_timeout(ms(500))
        .await
        .expect("the capped lease ran out");
    assert!(next.fencing_token() > guard.fencing_token());
    assert!(matches!(guard.release().await, Err(Error::NotHeld)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_ends_a_hold_and_fires_lost_in_memory() {
    max_hold_ends_the_hold(Arc::new(MemoryBackend::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_ends_a_hold_and_fires_lost_on_redis() {
    let srv = RedisServer::start();
    max_hold_ends_the_hold(Arc::new(redis(&srv).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_max_hold_the_watchdog_keeps_the_lease() {
    // The control for the test above: same ttl, no cap, held well past 700 ms.
    let locks =
        LockManager::with_options(MemoryBackend::new(), LockOptions::new().ttl(ms(200))).unwrap();
    let guard = locks.lock("kept").acquire().await.unwrap();
    let lost = tokio::time::timeout(ms(1200), guard.lost()).await;
    assert!(lost.is_err(), "an uncapped lease was lost");
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_write_refuses_a_paused_holders_late_write() {
    let srv = RedisServer::start();
    let redis_a = redis(&srv).await;
    let redis_b = redis(&srv).await;
    // A holder that will "pause": no watchdog, so its lease runs out while it is away.
    let a = LockManager::with_options(
        redis_a.clone(),
        LockOptions::new().ttl(ms(150)).watchdog(false),
    )
    .unwrap();
    let b = LockManager::with_options(
        redis_b.clone(),
        LockOptions::new().ttl(Duration::from_secs(5)),
    )
    .unwrap();
    let held_a = a.lock("report").acquire().await.unwrap();
    let token_a = held_a.fencing_token();
    let first = redis_a
        .fenced_set("report:data", "a-draft", token_a)
        .await
        .unwrap();
    assert_eq!(first, FencedWrite::Applied);
    // A is paused: its lease runs out and B takes over (B waits for the expiry).
    let held_b = b.lock("report").acquire_timeout(SOON).await.unwrap();
    let token_b = held_b.fencing_token();
    assert!(token_b > token_a);
    assert_eq!(
        redis_b
            .fenced_set("report:data", "b-final", token_b)
            .await
            .unwrap(),
        FencedWrite::Applied
    );
    // A wakes up and writes: refused, and B's value stands.
    assert!(held_a.is_lost());
    let late = redis_a
        .fenced_set("report:data", "a-late", token_a)
        .await
        .unwrap();
    assert_eq!(late, FencedWrite::Rejected { newest: token_b });
    let (value, token) = redis_b.fenced_get("report:data").await.unwrap().unwrap();
    assert_eq!((&value[..], token), (&b"b-final"[..], token_b));
    // The holder itself may write again with its own token.
    assert!(redis_b
        .fenced_set("report:data", "b-final-2", token_b)
        .await
        .unwrap()
        .is_applied());
    assert_eq!(redis_b.fenced_get("absent").await.unwrap(), None);
}

/// The label leaves the store with the release itself (not just with the next holder), and
/// the lock's record (with its fencing counter) outlives the lease by an hour; the release
/// leaves that hour alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_label_goes_with_the_release_on_redis() {
    let srv = RedisServer::start();
    let locks = LockManager::with_options(
        redis(&srv).await,
        labelled(Duration::from_secs(5), "host-b:7"),
    )
    .unwrap();
    let guard = locks.lock("label").acquire().await.unwrap();
    let record = "redlease:{label}";
    assert_eq!(
        srv.cmd(&["HGET", record, "h"]).as_str().as_deref(),
        Some("host-b:7")
    );
    let left = srv.cmd(&["PTTL", record]).as_int().unwrap();
    assert!(
        (3_600_000..=3_605_000).contains(&left),
        "an hour past the 5 s lease: PTTL {left}"
    );
    guard.release().await.unwrap();
    let label = srv.cmd(&["HGET", record, "h"]).as_str();
    assert!(
        label.as_deref().is_none_or(str::is_empty),
        "label gone: {label:?}"
    );
    assert!(
        srv.cmd(&["HGET", record, "f"]).as_str().is_some(),
        "fence kept"
    );
    let after = srv.cmd(&["PTTL", record]).as_int().unwrap();
    assert!(
        after > 3_500_000 && after <= left,
        "record PTTL {after} after the release, {left} before"
    );
}

/// Inspection of a real reentrant reign: the count of holds, and no label (a crashed
/// labelled plain holder's stale label is cleared when the reign starts).
async fn inspect_a_reentrant_reign(backend: Arc<dyn Backend>) {
    let stale = LockManager::with_options(
        backend.clone(),
        labelled(Duration::from_millis(200), "crashed").watchdog(false),
    )
    .unwrap();
    stale.lock("reign").acquire().await.unwrap().forget();
    let locks =
        LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(5))).unwrap();
    let owner = redlease::Owner::random();
    let lock = locks.lock("reign").reentrant(&owner).unwrap();
    let outer = lock.acquire().await.unwrap(); // waits out the stale 200 ms lease
    let inner = lock.acquire().await.unwrap();
    let info = locks.lock("reign").inspect().await.unwrap().expect("held");
    assert!(info.held, "{info:?}");
    assert_eq!(info.reentrant_count, Some(2), "{info:?}");
    assert_eq!(info.holder_label, None, "no stale label: {info:?}");
    inner.release().await.unwrap();
    outer.release().await.unwrap();
    let info = locks
        .lock("reign")
        .inspect()
        .await
        .unwrap()
        .expect("fence known");
    assert!(!info.held && info.reentrant_count.is_none(), "{info:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_reentrant_holds_in_memory() {
    inspect_a_reentrant_reign(Arc::new(MemoryBackend::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_reentrant_holds_on_redis() {
    let srv = RedisServer::start();
    inspect_a_reentrant_reign(Arc::new(redis(&srv).await)).await;
}

/// `held` (of `locks`, on `name`) is released and another process (`elsewhere`) takes the
/// lock with a larger fencing token; then a waiter of `locks`, once `numsub` (the server's
/// `PUBSUB NUMSUB` of the lock's release channel) counts it, is woken by that process's
/// release well before the 5 s lease would have run out.
async fn hand_over_and_back(
    locks: &LockManager,
    elsewhere: &LockManager,
    name: &str,
    held: redlease::LockGuard,
    numsub: impl Fn() -> support::Resp,
) {
    let fence = held.fencing_token();
    assert_eq!(held.release().await.unwrap(), 0);
    let theirs = elsewhere
        .lock(name)
        .try_acquire()
        .await
        .unwrap()
        .expect("released");
    assert!(theirs.fencing_token() > fence);
    let waiter = {
        let lock = locks.lock(name);
        tokio::spawn(async move { lock.acquire().await })
    };
    let waiting = support::wait_for_async(SOON, || {
        numsub()
            .as_array()
            .and_then(|a| a.get(1).and_then(|n| n.as_int()))
            == Some(1)
    })
    .await;
    assert!(waiting, "the waiter never subscribed");
    theirs.release().await.unwrap();
    // Woken, not a re-check at the lease's expiry.
    let mine = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("the waiter was woken by the release")
        .unwrap()
        .unwrap();
    mine.release().await.unwrap();
}

/// `RedisBackend::from_client`: locks over a fred client the application made (its own
/// reconnect policy and timeout) and connected itself. Locks exclude another process, a
/// waiter on the application's client is woken by a release (the subscriber connection is
/// made from the client's settings), and the application's own commands still go through the
/// same client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_client_serves_locks_beside_the_applications_own_commands() {
    use fred::prelude::{Builder, ClientLike, Config, KeysInterface, ReconnectPolicy};
    use redlease::RetryPolicy;

    let srv = RedisServer::start();
    let mut builder = Builder::from_config(Config::from_url(&srv.url()).unwrap());
    builder
        .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
        .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(2));
    let client = builder.build().unwrap();
    client.init().await.unwrap();
    let backend = RedisBackend::from_client(client.clone()).await.unwrap();
    assert_eq!(
        backend.client().expect("a fred backend").id(),
        client.id(),
        "the application's client"
    );
    // Waiters are woken by releases; the fallback re-check (30 s) is far past the bounds here.
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .retry(RetryPolicy::notify().max_delay(Duration::from_secs(30)));
    let locks = LockManager::with_options(backend, opts.clone()).unwrap();
    let elsewhere = LockManager::with_options(redis(&srv).await, opts).unwrap();

    let held = locks.lock("shared-client").acquire().await.unwrap();
    assert!(
        elsewhere
            .lock("shared-client")
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "another process is refused"
    );
    // The application's own commands, on the same client, while the lock is held.
    client
        .set::<(), _, _>("app:greeting", "hello", None, None, false)
        .await
        .unwrap();
    let read: Option<String> = client.get("app:greeting").await.unwrap();
    assert_eq!(read.as_deref(), Some("hello"));
    assert_eq!(
        srv.cmd(&["GET", "app:greeting"]).as_str().as_deref(),
        Some("hello")
    );
    hand_over_and_back(&locks, &elsewhere, "shared-client", held, || {
        srv.cmd(&["PUBSUB", "NUMSUB", "redlease:{shared-client}:released"])
    })
    .await;
    // The client is still the application's to use.
    let n: i64 = client.incr("app:counter").await.unwrap();
    assert_eq!(n, 1);
}

/// `RedisBackend::from_redis_client` (feature `redis-rs`): locks over the server, credentials
/// and database of a redis-rs client the application made, on connections of the backend's
/// own. Leases live in the client's database, another process is refused, a waiter is woken
/// by a release, and the application's client keeps working beside it.
#[cfg(feature = "redis-rs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_redis_client_serves_locks_in_the_client_s_database_with_its_credentials() {
    use redlease::RetryPolicy;

    let srv = RedisServer::start_with(&["--requirepass", "pw"]);
    let url = format!("redis://:pw@127.0.0.1:{}/3", srv.port());
    let client = redis::Client::open(url.as_str()).expect("a valid URL");
    let backend = RedisBackend::from_redis_client(&client, RedisOptions::new())
        .await
        .unwrap();
    assert!(backend.client().is_none(), "no fred client underneath");
    assert!(backend.is_connected());
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .retry(RetryPolicy::notify().max_delay(Duration::from_secs(30)));
    let locks = LockManager::with_options(backend, opts.clone()).unwrap();
    let elsewhere = LockManager::with_options(
        RedisBackend::connect(&url).await.expect("fred connects"),
        opts,
    )
    .unwrap();

    let held = locks.lock("redis-rs").acquire().await.unwrap();
    let key = locks.lock("redis-rs").key().as_str().to_owned();
    let mut conn = srv.connect();
    conn.cmd(&["AUTH", "pw"]).unwrap();
    conn.cmd(&["SELECT", "3"]).unwrap();
    assert_eq!(
        conn.cmd(&["EXISTS", &key]).unwrap().as_int(),
        Some(1),
        "the lease lives in the client's database"
    );
    assert!(
        elsewhere
            .lock("redis-rs")
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "another process is refused"
    );
    // The application's own client, beside the locks.
    let mut app = client
        .get_multiplexed_async_connection()
        .await
        .expect("the application's connection");
    let _: () = redis::cmd("SET")
        .arg("app:greeting")
        .arg("hello")
        .query_async(&mut app)
        .await
        .unwrap();
    hand_over_and_back(&locks, &elsewhere, "redis-rs", held, || {
        let mut conn = srv.connect();
        conn.cmd(&["AUTH", "pw"]).unwrap();
        conn.cmd(&["PUBSUB", "NUMSUB", "redlease:{redis-rs}:released"])
            .unwrap()
    })
    .await;
    let greeting: Option<String> = redis::cmd("GET")
        .arg("app:greeting")
        .query_async(&mut app)
        .await
        .unwrap();
    assert_eq!(greeting.as_deref(), Some("hello"));
}
