//! Send order: a release ends only a lease granted by an acquire sent before it, and an
//! acquire sent before the release that ended its token's lease is not granted again (see
//! "Send order" in `src/backend/redis/scripts/prelude.lua`).
//!
//! fred re-sends the commands in flight when a connection drops, and a copy written to the
//! old connection may still run later (it waited in the server's socket buffer, or in a
//! network that heals). When the engine gave a late grant back and tried again with the same
//! token, such a late copy of the give-back's release used to end the new lease while its
//! guard still counted it valid: two valid guards. These tests make that happen on real
//! servers, with the proxy holding the first copy back, and call the scripts in the stale
//! order directly for every kind of claim (the store's guard, whoever sends the stale
//! order). A claim given back now takes a fresh token for its next attempt, whatever its
//! kind (a released token may stay refused on a store, as a shared one does on Redis).

mod support;

use std::time::Duration;

use redlease::backend::{Acquire, Attempt, Backend, Claim, Lease, NodeTerms, Release};
use redlease::{LeaseKey, LockManager, LockOptions, RedisBackend, RedisOptions, Token};
use support::{held, holder, Proxy, RedisServer, Resp};

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// A script as the backend sends it to a server that is not a cluster node.
macro_rules! script {
    ($file:literal) => {
        concat!(
            include_str!("../src/backend/redis/scripts/prelude.lua"),
            include_str!(concat!("../src/backend/redis/scripts/", $file))
        )
    };
}

const ACQUIRE: &str = script!("acquire.lua");
const FAIR: &str = script!("fair_acquire.lua");
const SHARED: &str = script!("shared_acquire.lua");
const RELEASE: &str = script!("release.lua");
const REENTRANT_ACQUIRE: &str = script!("reentrant_acquire.lua");
const REENTRANT_RELEASE: &str = script!("reentrant_release.lua");

/// Runs `text` on one key with `args`.
fn eval(srv: &RedisServer, text: &str, key: &str, args: &[&str]) -> Resp {
    let mut cmd = vec!["EVAL", text, "1", key];
    cmd.extend_from_slice(args);
    let reply = srv.cmd(&cmd);
    assert!(!reply.is_error(), "script failed: {reply:?}");
    reply
}

/// The `i`th integer of an array reply.
fn int(reply: &Resp, i: usize) -> i64 {
    reply
        .as_array()
        .and_then(|a| a.get(i))
        .and_then(Resp::as_int)
        .unwrap_or_else(|| panic!("no integer at {i} in {reply:?}"))
}

/// A plain attempt of `token`, sent as number `n`: its `{code, value}` code (1 granted).
fn plain(srv: &RedisServer, key: &str, token: &str, n: &str) -> i64 {
    int(
        &eval(
            srv,
            ACQUIRE,
            key,
            &[token, "30000", "0", "0", "0", "0", "", n],
        ),
        0,
    )
}

/// A fair single attempt, as `plain`.
fn fair(srv: &RedisServer, key: &str, token: &str, n: &str) -> i64 {
    int(&eval(srv, FAIR, key, &[token, "30000", "0", "", n, "0"]), 0)
}

/// One of one permit, as `plain` (`token` starts with `s`).
fn permit(srv: &RedisServer, key: &str, token: &str, n: &str) -> i64 {
    int(
        &eval(
            srv,
            SHARED,
            key,
            &[token, "30000", "0", "0", "1", "", n, "0"],
        ),
        0,
    )
}

/// A release (no tombstone) of `token`, sent as number `n`: 1 released, 0 not ours.
fn release(srv: &RedisServer, key: &str, token: &str, n: &str) -> i64 {
    int(&eval(srv, RELEASE, key, &[token, "0", n]), 0)
}

fn live_hold(srv: &RedisServer, key: &str, token: &str) -> bool {
    let score = srv.cmd(&["ZSCORE", &format!("{key}:shared"), token]);
    score
        .as_str()
        .and_then(|s| s.parse::<f64>().ok())
        .is_some_and(|s| s > 0.0)
}

/// The stale order for a plain or fair claim, `take` being its acquire: a grant sent as 5, a
/// release sent as 3 (a late copy of a release made before that grant), then the release
/// sent as 7 and a late copy of an acquire sent as 6.
fn stale_order(take: fn(&RedisServer, &str, &str, &str) -> i64, key: &str) {
    let srv = RedisServer::start();
    let t = "t-holder";
    assert_eq!(take(&srv, key, t, "5"), 1, "free: granted");
    assert_eq!(
        release(&srv, key, t, "3"),
        0,
        "a release sent before the grant is not this lease's"
    );
    assert_eq!(
        holder(&srv, key).as_deref(),
        Some(t),
        "a release sent before the grant ended the lease"
    );
    assert_eq!(
        take(&srv, key, "t-rival", "1"),
        0,
        "a rival took the lease from its holder"
    );
    assert_eq!(
        take(&srv, key, t, "5"),
        1,
        "a re-sent acquire finds its own lease"
    );
    assert_eq!(
        release(&srv, key, t, "7"),
        1,
        "a release sent after the grant ends it"
    );
    assert!(!held(&srv, key));
    assert_eq!(
        release(&srv, key, t, "7"),
        1,
        "a re-sent release still answers released"
    );
    assert_eq!(
        take(&srv, key, t, "6"),
        0,
        "a late copy of an acquire sent before the release was granted again"
    );
    assert!(
        !held(&srv, key),
        "a late acquire blocks the lock for its TTL"
    );
    assert_eq!(
        take(&srv, key, t, "8"),
        1,
        "an acquire sent after the release is granted"
    );
}

#[test]
fn a_plain_lease_outlives_a_release_sent_before_its_grant() {
    stale_order(plain, "send-order:{plain}");
}

/// A release of a lease that ran out keeps its number too: the acquire copy sent before it
/// is not granted (its holder gave the claim up: nobody would hold that lease).
#[test]
fn a_late_acquire_after_the_release_of_a_lease_that_ran_out_is_refused() {
    let srv = RedisServer::start();
    let key = "send-order:{ran-out}";
    let t = "t-holder";
    assert_eq!(plain(&srv, key, t, "5"), 1, "free: granted");
    // The lease runs out (its expiry set in the past).
    srv.cmd(&["HSET", key, "e", "1"]);
    assert!(!held(&srv, key));
    assert_eq!(
        release(&srv, key, t, "7"),
        0,
        "a lease that ran out is not released"
    );
    assert_eq!(
        plain(&srv, key, t, "6"),
        0,
        "a late acquire copy sent before the release was granted"
    );
    assert!(!held(&srv, key));
    assert_eq!(
        plain(&srv, key, t, "8"),
        1,
        "an acquire sent after the release is granted"
    );
}

#[test]
fn a_fair_lease_outlives_a_release_sent_before_its_grant() {
    stale_order(fair, "send-order:{fair}");
}

#[test]
fn a_permit_outlives_a_release_sent_before_its_grant() {
    let srv = RedisServer::start();
    let key = "send-order:{permit}";
    let s = "s-holder";
    assert_eq!(permit(&srv, key, s, "5"), 1, "free: granted");
    assert_eq!(
        release(&srv, key, s, "3"),
        0,
        "a release sent before the grant is not this hold's"
    );
    assert!(
        live_hold(&srv, key, s),
        "a release sent before the grant ended the hold"
    );
    assert_eq!(
        permit(&srv, key, "s-rival", "1"),
        0,
        "a second permit of one was granted"
    );
    assert_eq!(
        permit(&srv, key, s, "5"),
        1,
        "a re-sent acquire finds its own hold"
    );
    assert_eq!(
        release(&srv, key, s, "7"),
        1,
        "a release sent after the grant ends it"
    );
    assert_eq!(
        release(&srv, key, s, "7"),
        1,
        "a re-sent release still answers released"
    );
    assert_eq!(
        permit(&srv, key, "s-rival", "2"),
        1,
        "the permit is free again"
    );
}

#[test]
fn a_reentrant_reign_outlives_a_release_sent_before_its_grant() {
    let srv = RedisServer::start();
    let key = "send-order:{reentrant}";
    let (owner, hold) = ("owner-1", "h-first");
    let take = |n: &str| {
        eval(
            &srv,
            REENTRANT_ACQUIRE,
            key,
            &[owner, hold, "30000", "0", "0", "0", "0", "", n],
        )
    };
    let give = |n: &str| {
        int(
            &eval(&srv, REENTRANT_RELEASE, key, &[owner, hold, hold, "0", n]),
            0,
        )
    };
    assert_eq!(int(&take("5"), 0), 1, "free: granted");
    assert_eq!(
        give("3"),
        0,
        "a release sent before the grant is not this hold's"
    );
    assert_eq!(
        holder(&srv, key).as_deref(),
        Some(hold),
        "a release sent before the grant ended the reign"
    );
    assert_eq!(
        plain(&srv, key, "t-rival", "1"),
        0,
        "a rival took the lock from the reign"
    );
    assert_eq!(
        give("7"),
        1,
        "a release sent after the grant ends the reign"
    );
    assert!(!held(&srv, key));
    assert_eq!(
        int(&take("6"), 0),
        0,
        "a late acquire copy started a reign again"
    );
    assert!(
        !held(&srv, key),
        "a late acquire blocks the lock for its TTL"
    );
    assert_eq!(
        int(&take("8"), 0),
        1,
        "an acquire sent after the release is granted"
    );
}

/// The SHA-1 the server knows `text` by (EVALSHA's first argument).
fn sha(srv: &RedisServer, text: &str) -> String {
    srv.cmd(&["SCRIPT", "LOAD", text])
        .as_str()
        .expect("SCRIPT LOAD answers the SHA")
}

/// The ids of the server's connections now.
fn client_ids(srv: &RedisServer) -> Vec<String> {
    let list = srv.cmd(&["CLIENT", "LIST"]).as_str().unwrap_or_default();
    list.lines()
        .filter_map(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("id="))
                .map(str::to_owned)
        })
        .collect()
}

/// Waits until none of the connections `ids` is left on the server: the commands each had
/// received have run (a connection is closed after what it read before the end).
fn wait_closed(srv: &RedisServer, ids: &[String]) {
    srv.wait_until(secs(20), |s| {
        let now = client_ids(s);
        ids.iter().all(|id| !now.contains(id))
    });
}

/// Long command timeouts: the held copy must not make fred give up on the re-sent one.
fn proxied_opts() -> RedisOptions {
    RedisOptions::new()
        .command_timeout(secs(5))
        .connect_timeout(secs(5))
}

fn granted(a: Acquire, what: &str) {
    assert!(matches!(a, Acquire::Granted(_)), "{what}: {a:?}");
}

/// The backend's view: a confirmed release is held on its connection, the connection drops,
/// fred re-sends the release on the new one (it runs), the same claim is granted again, and
/// then the first copy reaches the server. It must not end the new lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_delivered_late_after_a_reconnect_leaves_the_next_grant_of_its_token_alone() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.port());
    let release_sha = sha(&srv, RELEASE);
    let b = RedisBackend::connect_with(&proxy.url(), proxied_opts())
        .await
        .expect("connect");
    let key = LeaseKey::new("send-order:", "backend");
    let c0 = Claim::new(key.clone(), Token::random(), secs(30));
    granted(
        b.acquire(&c0, Attempt::Once, NodeTerms::new())
            .await
            .expect("acquire"),
        "free",
    );

    let rule = proxy.hold_first(release_sha.as_bytes());
    let giving = {
        let (b, c0) = (b.clone(), c0.clone());
        tokio::spawn(async move {
            b.release(&c0, Release::Confirmed { lease: &c0.token })
                .await
        })
    };
    assert!(
        proxy.wait_first_held(rule, secs(10)),
        "the release was never sent"
    );
    let old = client_ids(&srv);
    proxy.cut_clients();
    let released = giving
        .await
        .expect("release task")
        .expect("the re-sent release");
    assert_eq!(released, Some(0), "the re-sent release ended the lease");
    assert!(!held(&srv, key.as_str()));

    granted(
        b.acquire(&c0, Attempt::Once, NodeTerms::new())
            .await
            .expect("again"),
        "granted again",
    );
    proxy.pass_first(rule);
    assert!(
        proxy.wait_first_delivered(rule, secs(10)),
        "the held copy never reached the server"
    );
    wait_closed(&srv, &old);

    assert_eq!(
        holder(&srv, key.as_str()).as_deref(),
        Some(c0.token.as_str()),
        "the late copy of the release ended the lease granted after it"
    );
    let c1 = Claim::new(key.clone(), Token::random(), secs(30));
    let rival = b
        .acquire(&c1, Attempt::Once, NodeTerms::new())
        .await
        .expect("rival");
    assert!(
        matches!(rival, Acquire::Held { .. }),
        "a second holder got the lease: {rival:?}"
    );
    let lease = [Lease {
        key: &key,
        token: &c0.token,
        ttl: secs(30),
    }];
    let extended = b.extend(&lease, NodeTerms::new()).await.expect("extend");
    assert!(
        extended[0].validity().is_some(),
        "the holder's lease was lost: {extended:?}"
    );
}

/// The whole path: a grant read after its validity is given back by the engine, whose
/// release is held on its connection; the connection drops, the re-sent release runs, the
/// engine's next attempt is granted, and then the held copy runs. The guard must stay the
/// only holder, and its extensions must keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_grant_given_back_and_granted_again_keeps_its_guard_the_only_holder() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.port());
    let (acquire_sha, release_sha) = (sha(&srv, ACQUIRE), sha(&srv, RELEASE));
    let b = RedisBackend::connect_with(&proxy.url(), proxied_opts())
        .await
        .expect("connect");
    let ttl = secs(1);
    let m = LockManager::with_options(b, LockOptions::new().ttl(ttl)).expect("options");
    let lock = m.lock("given-back");

    let held_acquire = proxy.hold_first(acquire_sha.as_bytes());
    let acquiring = tokio::spawn(async move { lock.acquire_timeout(secs(60)).await });
    assert!(
        proxy.wait_first_held(held_acquire, secs(10)),
        "the acquire was never sent"
    );
    // The grant's answer must come back after the lease's validity (counted from the send):
    // this is the pause the engine gives a grant back for.
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let held_release = proxy.hold_first(release_sha.as_bytes());
    proxy.pass_first(held_acquire);
    assert!(
        proxy.wait_first_held(held_release, secs(10)),
        "the late grant was not given back"
    );
    let old = client_ids(&srv);
    proxy.cut_clients();
    let guard = acquiring
        .await
        .expect("acquire task")
        .expect("granted again after the give-back");

    proxy.pass_first(held_release);
    assert!(
        proxy.wait_first_delivered(held_release, secs(10)),
        "the held copy never reached the server"
    );
    wait_closed(&srv, &old);

    let other = LockManager::new(RedisBackend::connect(&srv.url()).await.expect("connect"));
    let rival = other.lock("given-back").try_acquire().await.expect("rival");
    assert!(
        rival.is_none(),
        "two valid guards: the late copy of the give-back's release ended the new lease"
    );
    assert!(!guard.is_lost(), "the guard was lost");
    guard
        .extend(ttl)
        .await
        .expect("the guard's extension still works");
    assert!(!guard.is_lost());
}

/// A permit whose grant came back after its validity is given back by the engine, and the
/// next attempt must be granted while another holder keeps the semaphore in use. A shared
/// hold's released token stays refused (so that its re-sent release is answered
/// "released"), so the next attempt goes with a fresh token: with the same one, it waited
/// until the other holder let go (tests/etcd.rs has the same for a plain lock on etcd).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_given_back_late_is_granted_again_beside_another_holder() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.port());
    let shared_sha = sha(&srv, SHARED);
    let b = RedisBackend::connect_with(&proxy.url(), proxied_opts())
        .await
        .expect("connect");
    let ttl = secs(1);
    let m = LockManager::with_options(b, LockOptions::new().ttl(ttl)).expect("options");
    // Another manager holds one of the two permits throughout (its watchdog extends it).
    let other = LockManager::new(RedisBackend::connect(&srv.url()).await.expect("connect"));
    let first = other
        .lock("given-back-permit")
        .semaphore(2)
        .expect("semaphore")
        .acquire()
        .await
        .expect("the first permit");
    let sem = m.lock("given-back-permit").semaphore(2).expect("semaphore");

    let held = proxy.hold_first(shared_sha.as_bytes());
    let acquiring = tokio::spawn(async move { sem.acquire_timeout(secs(10)).await });
    assert!(
        proxy.wait_first_held(held, secs(10)),
        "the acquire was never sent"
    );
    // The grant's answer must come back after the lease's validity (counted from the send).
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    proxy.pass_first(held);
    let guard = acquiring
        .await
        .expect("acquire task")
        .expect("a permit is free: granted again after the give-back");
    assert!(!guard.is_lost());
    assert!(!first.is_lost());
    let info = other
        .lock("given-back-permit")
        .semaphore(2)
        .expect("semaphore")
        .inspect()
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.shared_holds, Some(2), "{info:?}");
}
