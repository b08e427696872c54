//! Failover: locks on a primary watched by Redis Sentinel (`support::RedisSentinels`: one
//! primary, two replicas, three sentinels, all local processes started by the tests), reached
//! through a `redis-sentinel://` URL; replica acknowledgement ([`ReplicaAck`]) and the window
//! it closes; and a demoted primary that answers `READONLY` (a primary and one replica, no
//! sentinel, reached by `redis://`).
//!
//! Every wait is bounded, and a failover is forced (`SENTINEL FAILOVER`) rather than waited
//! for, so that each test runs in seconds.

mod support;

use std::time::{Duration, Instant};

use redlease::{
    Error, LockGuard, LockManager, LockOptions, RedisBackend, RedisOptions, ReplicaAck,
};
use support::{held, holder, int_field, wait_for_async, Checker, RedisSentinels, RedisServer};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Shorter than a failover takes here (the sentinels name the new primary about 1.2 s after
/// the kill, and the backend is connected to it about 0.5 s later), so that calls made while
/// one is under way fail: a waiting acquire with a limit waits them out (it ended at the
/// first failed call once, and lost its waiter in about one run of the first test in 30).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

fn redis_options(ack: ReplicaAck) -> RedisOptions {
    support::redis_options()
        .command_timeout(COMMAND_TIMEOUT)
        .connect_timeout(Duration::from_secs(1))
        .replica_ack(ack)
}

/// A backend with its own connections to `url` (a `redis-sentinel://` or `redis://` URL).
async fn backend(url: &str, ack: ReplicaAck) -> RedisBackend {
    RedisBackend::connect_with(url, redis_options(ack))
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// A manager with its own backend, leases of `ttl` kept by the watchdog (every ttl/3).
async fn manager(url: &str, ack: ReplicaAck, ttl: Duration) -> LockManager {
    LockManager::with_options(backend(url, ack).await, LockOptions::new().ttl(ttl))
        .expect("options")
}

/// The key of lock `name` (default prefix) on the servers.
fn key_of(locks: &LockManager, name: &str) -> String {
    locks.lock(name).key().as_str().to_owned()
}

/// Cuts the primary `p` off from its replicas: each replica is paused (SIGSTOP), then the
/// primary drops their links (`CLIENT KILL TYPE replica`), so that what it writes next reaches
/// none of them and, paused, they cannot reconnect to fetch it. (A pause alone does not do it
/// on loopback: the kernel keeps receiving the replication stream for the stopped process,
/// which applies it on resume even when the primary has died in between, so the write
/// survives the failover.)
fn cut_off_replicas(d: &RedisSentinels, p: usize) {
    let replicas: Vec<usize> = (0..d.nodes.len()).filter(|&i| i != p).collect();
    for &i in &replicas {
        d.nodes[i].pause();
    }
    let cut = d.nodes[p].cmd(&["CLIENT", "KILL", "TYPE", "replica"]);
    assert_eq!(cut.as_int(), Some(replicas.len() as i64), "{cut:?}");
    assert_eq!(
        d.nodes[p]
            .info_field("replication", "connected_slaves")
            .as_deref(),
        Some("0")
    );
}

/// Resumes every node but `p` (the replicas [`cut_off_replicas`] paused).
fn resume_replicas(d: &RedisSentinels, p: usize) {
    for (i, node) in d.nodes.iter().enumerate() {
        if i != p && node.is_running() {
            node.resume();
        }
    }
}

/// The server's version, `(major, minor)`, from `INFO server`.
fn redis_version(srv: &RedisServer) -> (u32, u32) {
    let v = srv
        .info_field("server", "redis_version")
        .expect("INFO server names the version");
    let mut parts = v
        .split('.')
        .map(|p| p.parse::<u32>().expect("a version number"));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Through Sentinel: three leases (3 s TTL, watchdog every second) held by one manager and
/// a waiter of another manager on the first of them survive the primary's death. Before the
/// kill every lease is on both replicas; the primary is killed right after a watchdog round
/// and a failover forced (the new primary is named about 1.2 s later). Then each lease's
/// expiry moves forward on the new primary (the watchdog reconnected through the sentinels
/// and its extensions reach it), no guard is lost, the other manager still finds every lock
/// held, the waiter gets its lock only once the holder releases it, new acquires work, and
/// each new grant's fencing token is above every earlier one of its lock. A checker per lock
/// sees no two holders at once.
///
/// It fails if the backend stays on the dead primary (no discovery at reconnect), if the
/// extensions do not reach the new primary within the TTL (the guards are lost), or if a
/// waiter gives up on the errors of the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_leases_and_a_waiter_survive_a_failover_and_later_grants_fence_above_them() {
    let mut d = RedisSentinels::start(2, 3);
    let url = d.url();
    let ttl = secs(3);
    let a = manager(&url, ReplicaAck::Off, ttl).await;
    let b = manager(&url, ReplicaAck::Off, ttl).await;
    let names = ["failover-0", "failover-1", "failover-2"];
    let keys: Vec<String> = names.iter().map(|n| key_of(&a, n)).collect();
    let checkers: Vec<Checker> = names.iter().map(|_| Checker::new()).collect();

    let mut guards = Vec::new();
    let mut sections = Vec::new();
    for (name, checker) in names.iter().zip(&checkers) {
        let g = support::take(&a, name).await;
        sections.push(checker.enter(g.fencing_token()));
        guards.push(g);
    }
    let earlier: Vec<u64> = guards.iter().map(LockGuard::fencing_token).collect();
    let waiter = {
        let lock = b.lock(names[0]);
        let checker = checkers[0].clone();
        tokio::spawn(async move {
            let g = lock.acquire_timeout(secs(30)).await?;
            let section = checker.enter(g.fencing_token());
            Ok::<_, Error>((g, section))
        })
    };
    let old = d.primary();
    assert!(
        wait_for_async(secs(10), || support::field(&d.nodes[old], &keys[0], "w")
            .is_some())
        .await,
        "the waiter registered"
    );
    // Everything is on both replicas before the kill.
    assert!(
        wait_for_async(secs(10), || (0..d.nodes.len())
            .filter(|&i| i != old)
            .all(|i| keys.iter().all(|k| held(&d.nodes[i], k))))
        .await,
        "the leases reached the replicas"
    );
    // The primary dies right after a watchdog round (each lease's expiry moves), so that
    // each lease has its whole TTL to reach the new primary: the time it takes does not
    // depend on where in the round the kill falls.
    let granted: Vec<i64> = keys
        .iter()
        .map(|k| int_field(&d.nodes[old], k, "e").expect("an expiry"))
        .collect();
    let mut before = granted.clone();
    assert!(
        wait_for_async(ttl, || {
            before = keys
                .iter()
                .map(|k| int_field(&d.nodes[old], k, "e").expect("an expiry"))
                .collect();
            before.iter().zip(&granted).all(|(now, then)| now > then)
        })
        .await,
        "no watchdog round before the kill"
    );

    d.nodes[old].kill();
    let killed = Instant::now();
    let new = d.failover();
    let promoted = killed.elapsed();

    // Each lease is extended on the new primary, in time.
    let extended = wait_for_async(ttl * 2, || {
        keys.iter()
            .zip(&before)
            .all(|(k, &e)| int_field(&d.nodes[new], k, "e").is_some_and(|now| now > e))
    })
    .await;
    assert!(
        extended,
        "the leases were not extended on the new primary (node {new}, promoted {promoted:?} \
         after the kill); lost: {:?}",
        guards.iter().map(LockGuard::is_lost).collect::<Vec<_>>()
    );
    let reached = killed.elapsed();
    for (g, name) in guards.iter().zip(names) {
        assert!(!g.is_lost(), "{name}: lost in the failover");
        assert!(g.valid_until() > Instant::now(), "{name}");
    }
    for (k, name) in keys.iter().zip(names) {
        assert!(
            held(&d.nodes[new], k),
            "{name}: not held on the new primary"
        );
        assert!(
            b.lock(name).try_acquire().await.expect("try").is_none(),
            "{name}: another manager got a held lock after the failover"
        );
    }
    if waiter.is_finished() {
        let ended = waiter.await.expect("task");
        panic!(
            "the waiter ended while the lock was held: {:?}",
            ended.map(|(g, _)| g.fencing_token())
        );
    }

    // The waiter gets the first lock once it is released; the others are taken anew.
    let mut guards = guards.into_iter();
    let mut sections = sections.into_iter();
    let first = guards.next().expect("a guard");
    sections.next().expect("a section").exit();
    first.release().await.expect("release on the new primary");
    let (next, section) = waiter
        .await
        .expect("task")
        .unwrap_or_else(|e| panic!("the waiter did not get the released lock: {e}"));
    assert!(next.fencing_token() > earlier[0]);
    section.exit();
    next.release().await.expect("release");
    for (i, (g, s)) in guards.zip(sections).enumerate().map(|(i, gs)| (i + 1, gs)) {
        s.exit();
        g.release().await.expect("release on the new primary");
        let again = support::take(&b, names[i]).await;
        let section = checkers[i].enter(again.fencing_token());
        assert!(
            again.fencing_token() > earlier[i],
            "{}: token {} after {}",
            names[i],
            again.fencing_token(),
            earlier[i]
        );
        section.exit();
        again.release().await.expect("release");
    }
    let fresh = support::take(&a, "failover-fresh").await;
    fresh.release().await.expect("release");
    for c in &checkers {
        c.assert_ok();
    }
    eprintln!(
        "failover: the sentinels agreed on the new primary {promoted:?} after the kill; the \
         leases were seen extended there {reached:?} after it"
    );
}

/// With replica acknowledgement (`replicas(1)`), a grant is reported only once a replica has
/// it (`replicas_acked() >= Some(1)`), so the primary killed right after it cannot take it
/// along: after the forced failover the new primary holds the lease, another client (a new
/// manager on the same sentinel URL) does not get the lock, and the holder's guard is not
/// lost (its acknowledged extensions reach the new primary and the replica moved under it).
/// (With both replicas healthy the write reaches them within a moment either way; the window
/// that acknowledgement closes, replicas that do not have the write, is in the next two
/// tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_grant_survives_the_primary_killed_right_after_it() {
    let mut d = RedisSentinels::start(2, 3);
    let url = d.url();
    let ttl = secs(10);
    let a = manager(&url, ReplicaAck::replicas(1), ttl).await;
    let key = key_of(&a, "acked");
    let guard = support::take(&a, "acked").await;
    assert!(
        guard.replicas_acked() >= Some(1),
        "{:?}",
        guard.replicas_acked()
    );
    let old = d.primary();
    d.nodes[old].kill();
    let new = d.failover();
    assert!(
        holder(&d.nodes[new], &key).is_some(),
        "the promoted replica has the acknowledged grant"
    );
    let b = manager(&url, ReplicaAck::Off, ttl).await;
    assert!(
        b.lock("acked").try_acquire().await.expect("try").is_none(),
        "a second client got an acknowledged lock after the failover"
    );
    // The holder's acknowledged extensions go on at the new primary.
    let e = int_field(&d.nodes[new], &key, "e").expect("an expiry");
    assert!(
        wait_for_async(ttl, || int_field(&d.nodes[new], &key, "e")
            .is_some_and(|now| now > e))
        .await,
        "the lease was not extended on the new primary; lost: {}",
        guard.is_lost()
    );
    assert!(!guard.is_lost());
    guard.release().await.expect("release on the new primary");
    let next = support::take(&b, "acked").await;
    next.release().await.expect("release");
}

/// The window replica acknowledgement closes, shown with it off (the default, documented in
/// `ReplicaAck` and the README's "Sentinel, replicas and failover"): the replicas are cut off
/// from the primary (paused, links dropped), a lock is granted on the primary alone, the
/// primary is killed, the replicas resumed and a failover forced. The promoted replica never
/// had the grant, so a second client gets the lock while the first still holds its guard,
/// well within the validity the first guard was promised: two holders at once. (The second's
/// fencing token is still the larger: a token is at least the server's clock in µs, and these
/// servers share one; so a resource that checks tokens refuses the first's later writes.)
/// The first holder is told at its next extension, which the new primary refuses.
///
/// This test asserts the overlap: it fails if the window closes (if the default ever waits
/// for replicas, say), which must then be documented instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_acknowledgement_a_grant_the_replicas_missed_is_lost_in_a_failover() {
    let mut d = RedisSentinels::start(2, 3);
    let url = d.url();
    let ttl = secs(10);
    let a = manager(&url, ReplicaAck::Off, ttl).await;
    let key = key_of(&a, "window");
    let old = d.primary();
    cut_off_replicas(&d, old);
    let first = support::take(&a, "window").await;
    assert_eq!(first.replicas_acked(), None);
    let promised = first.valid_until();
    assert!(held(&d.nodes[old], &key));
    d.nodes[old].kill();
    resume_replicas(&d, old);
    let new = d.failover();
    assert!(
        !held(&d.nodes[new], &key),
        "the promoted replica has the grant it was cut off from"
    );

    let b = manager(&url, ReplicaAck::Off, ttl).await;
    let second = support::take(&b, "window").await;
    let granted = Instant::now();
    assert!(
        granted < promised,
        "the second grant came {:?} after the first guard's validity",
        granted - promised
    );
    // Fencing still orders them: a resource that checks tokens refuses the first holder's
    // writes once it has seen the second's.
    assert!(
        second.fencing_token() > first.fencing_token(),
        "tokens {} then {}",
        first.fencing_token(),
        second.fencing_token()
    );
    // The first holder learns it at its next extension, long before its validity ends.
    tokio::time::timeout(ttl, first.lost())
        .await
        .expect("the first guard is told it lost the lease");
    assert!(first.is_lost());
    eprintln!(
        "window: two holders for {:?} (the second granted {:?} before the first's validity \
         ended)",
        granted.elapsed(),
        promised.saturating_duration_since(granted)
    );
    assert!(!second.is_lost());
    second.release().await.expect("release");
}

/// The same sequence with `replicas(1)`: the grant the cut-off replicas cannot acknowledge is
/// refused, `Error::NotAcknowledged { acked: 0, required: 1, .. }`, and given back (not held on
/// the primary), so nobody thinks it holds the lock when the failover comes; afterwards
/// another client gets the lock on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_acknowledgement_a_grant_the_replicas_cannot_have_is_refused_and_given_back() {
    let mut d = RedisSentinels::start(2, 3);
    let url = d.url();
    let ttl = secs(10);
    let a = manager(&url, ReplicaAck::replicas(1), ttl).await;
    let key = key_of(&a, "window");
    let old = d.primary();
    cut_off_replicas(&d, old);
    match a.lock("window").try_acquire().await {
        Err(Error::NotAcknowledged {
            acked: 0,
            required: 1,
            ..
        }) => {}
        Err(e) => panic!("expected NotAcknowledged {{ acked: 0, required: 1 }}, got {e:?}"),
        Ok(g) => panic!(
            "a grant no replica has was reported: {:?}",
            g.map(|g| g.replicas_acked())
        ),
    }
    assert!(
        !held(&d.nodes[old], &key),
        "the unacknowledged grant was left held on the primary"
    );
    d.nodes[old].kill();
    resume_replicas(&d, old);
    let new = d.failover();
    assert!(!held(&d.nodes[new], &key));
    let b = manager(&url, ReplicaAck::Off, ttl).await;
    let g = support::take(&b, "window").await;
    g.release().await.expect("release");
}

/// `replicas(1)` against a server with no replica: `try_acquire` fails with
/// `NotAcknowledged { acked: 0, required: 1, .. }` and leaves the lock free (a backend
/// without acknowledgement gets it next); a waiting acquire tries again until its time limit
/// and then ends with that error (as a Redlock short of its quorum does), nothing left
/// behind. Policies that cannot work are refused at connect with `InvalidConfig`: `aof` on a
/// server older than 7.2 (the message names 7.2), `replicas(0)`, and a timeout not below the
/// command timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledgement_without_a_replica_fails_and_impossible_policies_are_refused() {
    let srv = RedisServer::start();
    let url = srv.url();
    let acked = manager(&url, ReplicaAck::replicas(1), secs(10)).await;
    let key = key_of(&acked, "lonely");
    match acked.lock("lonely").try_acquire().await {
        Err(Error::NotAcknowledged {
            acked: 0,
            required: 1,
            why,
        }) => assert!(!why.is_empty()),
        other => panic!(
            "expected NotAcknowledged {{ acked: 0, required: 1 }}, got {:?}",
            other.map(|g| g.map(|g| g.replicas_acked()))
        ),
    }
    assert!(!held(&srv, &key), "the unacknowledged grant was left held");
    // A waiting acquire tries again until its limit, then says why it got nothing.
    let waits = srv.command_calls("wait");
    let began = Instant::now();
    match acked.lock("lonely").acquire_timeout(ms(500)).await {
        Err(Error::NotAcknowledged {
            acked: 0,
            required: 1,
            ..
        }) => {}
        other => panic!(
            "a waiting acquire should end NotAcknowledged at its limit, got {:?}",
            other.map(|g| g.replicas_acked())
        ),
    }
    let waited = began.elapsed();
    assert!(waited >= ms(450), "gave up after {waited:?} of its 500 ms");
    let tries = srv.command_calls("wait") - waits;
    assert!(
        tries >= 2,
        "{tries} WAIT(s) in {waited:?}: the acquire did not try again"
    );
    // The attempt in flight at the deadline (granted, its WAIT pending) is abandoned and
    // given back in the background: gone in a moment, not left to run out its 10 s TTL.
    assert!(
        wait_for_async(secs(1), || !held(&srv, &key)).await,
        "the waiting acquire left a grant held"
    );
    let plain = manager(&url, ReplicaAck::Off, secs(10)).await;
    let g = support::take(&plain, "lonely").await;
    assert_eq!(g.replicas_acked(), None);
    g.release().await.expect("release");

    let aof = RedisBackend::connect_with(&url, redis_options(ReplicaAck::aof(true, 0))).await;
    if redis_version(&srv) < (7, 2) {
        match aof {
            Err(Error::InvalidConfig(m)) => assert!(m.contains("7.2"), "{m}"),
            other => panic!("aof on Redis < 7.2 must be refused at connect: {other:?}"),
        }
    } else {
        // WAITAOF exists, but the local AOF it asks for is off here: the server refuses it,
        // which is said (a configuration error, not a lack of replicas), and the grant is
        // given back.
        let locks = LockManager::new(aof.expect("aof on Redis 7.2+"));
        match locks.lock("aof").try_acquire().await {
            Err(Error::InvalidConfig(m)) => assert!(m.contains("appendonly"), "{m}"),
            other => panic!(
                "aof(true, 0) without appendonly must be refused: {:?}",
                other.map(|g| g.map(|g| g.replicas_acked()))
            ),
        }
        assert!(
            !held(&srv, &key_of(&locks, "aof")),
            "the refused grant was left held"
        );
    }
    for (policy, what) in [
        (ReplicaAck::replicas(0), "replicas(0)"),
        (
            ReplicaAck::replicas(1).timeout(COMMAND_TIMEOUT),
            "timeout = command timeout",
        ),
        (
            ReplicaAck::replicas(1).timeout(COMMAND_TIMEOUT * 2),
            "timeout > command timeout",
        ),
    ] {
        match RedisBackend::connect_with(&url, redis_options(policy)).await {
            Err(Error::InvalidConfig(_)) => {}
            other => panic!("{what} must be refused with InvalidConfig: {other:?}"),
        }
    }
}

/// Waits until `WAITAOF` on `primary` counts `replicas` replicas whose AOF has a write (a
/// probe that leaves no key behind).
fn wait_aof_synced(primary: &RedisServer, replicas: i64) {
    let probe = || -> Option<i64> {
        let mut conn = primary.try_connect().ok()?;
        conn.cmd(&["SET", "support:aof-probe", "1"]).ok()?;
        conn.cmd(&["DEL", "support:aof-probe"]).ok()?;
        let counts = conn
            .cmd(&["WAITAOF", "0", &replicas.to_string(), "100"])
            .ok()?;
        counts.as_array()?.get(1)?.as_int()
    };
    assert!(
        support::wait_for(secs(20), || probe() == Some(replicas)),
        "the replicas' AOF did not count a write within 20 s"
    );
}

/// Lock `name`, free, once granted and acknowledged: a waiting acquire, which tries again
/// after a `NotAcknowledged` (an fsync slower than the policy's timeout on a loaded machine).
async fn granted(locks: &LockManager, name: &str) -> LockGuard {
    locks
        .lock(name)
        .acquire_timeout(secs(10))
        .await
        .unwrap_or_else(|e| panic!("{name}: no acknowledged grant within 10 s: {e}"))
}

/// `ReplicaAck::aof` for real: a primary and two replicas, each with `appendonly yes` and
/// `appendfsync always` (so that a write is on disk before the next event-loop turn, not
/// within a second). On a server with `WAITAOF` (Redis 7.2 and later, every Valkey):
///
/// - with every AOF on, `aof(true, 2)` grants, reports both replicas, and keeps the lease:
///   the watchdog's acknowledged extensions move its validity a whole TTL on (an extension
///   that is not acknowledged counts as failed and moves nothing), and an explicit `extend`
///   succeeds; `aof(false, 1)` grants too;
/// - with one replica's AOF turned off (`CONFIG SET appendonly no`), `aof(true, 2)` is refused
///   `NotAcknowledged { acked: 1, required: 2 }` and the grant given back, while `aof(true, 1)`
///   still grants; with both off, `aof(false, 1)` is refused `{ acked: 0, required: 1 }`, given
///   back, and a backend without acknowledgement takes the lock;
/// - with the primary's own AOF never synced (`appendfsync no`), `aof(true, 0)` is refused
///   `NotAcknowledged` and given back (it was reported granted: the missing local copy was
///   read as "0 replicas", which `replicas: 0` asks for).
///
/// On an older server (no `WAITAOF`) the policy is refused at connect with `InvalidConfig`
/// naming 7.2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aof_acknowledgement_counts_only_replicas_whose_aof_has_the_write() {
    let d = RedisSentinels::start_with(2, 0, &["--appendonly", "yes", "--appendfsync", "always"]);
    let primary = &d.nodes[0];
    let url = primary.url();
    // Under the command timeout (1 s); long enough for an fsync on a loaded machine.
    let aof = |local, replicas| ReplicaAck::aof(local, replicas).timeout(ms(500));
    if redis_version(primary) < (7, 2) {
        match RedisBackend::connect_with(&url, redis_options(aof(true, 1))).await {
            Err(Error::InvalidConfig(m)) => assert!(m.contains("7.2"), "{m}"),
            other => panic!("aof on Redis < 7.2 must be refused at connect: {other:?}"),
        }
        return;
    }
    let ttl = secs(2);

    // (a) Every AOF on: granted, acknowledged by both replicas, and kept.
    let both = manager(&url, aof(true, 2), ttl).await;
    let key = key_of(&both, "aof");
    // Each replica's AOF starts once it has synced (a rewrite of its own); until then it
    // counts nothing.
    wait_aof_synced(primary, 2);
    let guard = granted(&both, "aof").await;
    assert_eq!(guard.replicas_acked(), Some(2));
    let first = guard.valid_until();
    assert!(
        wait_for_async(ttl * 4, || guard.valid_until() >= first + ttl).await,
        "the watchdog's extensions were not acknowledged: valid until {:?} after the grant's \
         deadline, lost: {}",
        guard.valid_until().saturating_duration_since(first),
        guard.is_lost()
    );
    assert!(!guard.is_lost());
    guard.extend(ttl).await.expect("an acknowledged extension");
    let one = manager(&url, aof(false, 1), ttl).await;
    let replicas_only = granted(&one, "aof-replicas").await;
    assert!(
        replicas_only.replicas_acked() >= Some(1),
        "{:?}",
        replicas_only.replicas_acked()
    );
    replicas_only.release().await.expect("release");
    guard.release().await.expect("release");

    // (b) One replica's AOF off: two are refused and given back, one still grants.
    assert!(d.nodes[2]
        .cmd(&["CONFIG", "SET", "appendonly", "no"])
        .is_ok());
    match both.lock("aof").try_acquire().await {
        Err(Error::NotAcknowledged {
            acked: 1,
            required: 2,
            why,
        }) => assert!(!why.is_empty()),
        other => panic!(
            "expected NotAcknowledged {{ acked: 1, required: 2 }}, got {:?}",
            other.map(|g| g.map(|g| g.replicas_acked()))
        ),
    }
    assert!(
        !held(primary, &key),
        "the unacknowledged grant was left held"
    );
    let still = manager(&url, aof(true, 1), ttl).await;
    let g = granted(&still, "aof").await;
    assert_eq!(g.replicas_acked(), Some(1));
    g.release().await.expect("release");

    // Both off: nobody's AOF but the primary's has it.
    assert!(d.nodes[1]
        .cmd(&["CONFIG", "SET", "appendonly", "no"])
        .is_ok());
    match one.lock("aof").try_acquire().await {
        Err(Error::NotAcknowledged {
            acked: 0,
            required: 1,
            ..
        }) => {}
        other => panic!(
            "expected NotAcknowledged {{ acked: 0, required: 1 }}, got {:?}",
            other.map(|g| g.map(|g| g.replicas_acked()))
        ),
    }
    assert!(
        !held(primary, &key),
        "the unacknowledged grant was left held"
    );
    let plain = manager(&url, ReplicaAck::Off, ttl).await;
    let g = support::take(&plain, "aof").await;
    assert_eq!(g.replicas_acked(), None);
    g.release().await.expect("release");

    // (c) The primary's own AOF never synced (`appendfsync no`: WAITAOF counts it 0): a
    // policy that asks for it is refused though it asks for no replica, and given back.
    assert!(primary.cmd(&["CONFIG", "SET", "appendfsync", "no"]).is_ok());
    let local = manager(&url, aof(true, 0), ttl).await;
    match local.lock("aof").try_acquire().await {
        Err(Error::NotAcknowledged {
            acked: 0,
            required: 0,
            why,
        }) => assert!(why.contains("primary"), "{why}"),
        other => panic!(
            "a grant the primary's AOF does not have was reported: {:?}",
            other.map(|g| g.map(|g| g.replicas_acked()))
        ),
    }
    assert!(
        !held(primary, &key),
        "the unacknowledged grant was left held"
    );
}

/// Acknowledgement on, the only replica paused (SIGSTOP) while a lease (2 s TTL) is held: the
/// watchdog's extensions still reach the primary but are not acknowledged, so they count as
/// failed and the guard is lost at its deadline (the validity last confirmed), within about
/// its TTL of the pause; meanwhile a new grant is refused `NotAcknowledged` and given back.
/// Once the replica is resumed, acquires work again, acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_lease_is_lost_while_its_only_replica_is_paused() {
    let d = RedisSentinels::start(1, 0);
    let (primary, replica) = (&d.nodes[0], &d.nodes[1]);
    let ttl = secs(2);
    let a = manager(&primary.url(), ReplicaAck::replicas(1), ttl).await;
    let guard = support::take(&a, "kept").await;
    assert!(
        guard.replicas_acked() >= Some(1),
        "{:?}",
        guard.replicas_acked()
    );
    let lost = guard.lost();

    replica.pause();
    let paused = Instant::now();
    let other = key_of(&a, "meanwhile");
    match a.lock("meanwhile").try_acquire().await {
        Err(Error::NotAcknowledged {
            acked: 0,
            required: 1,
            ..
        }) => {}
        other => panic!(
            "a grant the paused replica cannot acknowledge: {:?}",
            other.map(|g| g.map(|g| g.replicas_acked()))
        ),
    }
    assert!(!held(primary, &other), "the refused grant was left held");
    assert!(!guard.is_lost(), "lost before its deadline");

    tokio::time::timeout(ttl + secs(2), lost)
        .await
        .expect("the lease is lost while its replica is paused");
    let lost_at = Instant::now();
    assert!(guard.is_lost());
    let deadline = guard.valid_until();
    assert!(
        lost_at + ms(250) >= deadline,
        "lost {:?} before its deadline",
        deadline - lost_at
    );
    assert!(
        lost_at <= deadline + secs(1),
        "lost {:?} after its deadline",
        lost_at - deadline
    );
    assert!(
        paused.elapsed() <= ttl + secs(1),
        "lost {:?} after the pause (ttl {ttl:?})",
        paused.elapsed()
    );

    replica.resume();
    let again = a
        .lock("kept")
        .acquire_timeout(ttl * 3)
        .await
        .expect("acquire once the replica is back");
    assert!(
        again.replicas_acked() >= Some(1),
        "{:?}",
        again.replicas_acked()
    );
    let meanwhile = support::take(&a, "meanwhile").await;
    assert!(meanwhile.replicas_acked() >= Some(1));
    meanwhile.release().await.expect("release");
    again.release().await.expect("release");
}

/// A primary demoted under a holder (a plain `redis://` backend to it; its replica promoted
/// with `REPLICAOF NO ONE`, then the primary made its replica, which keeps its client
/// connections): the watchdog's next extension is answered `READONLY`, which counts the lease
/// as lost at once. The guard's `lost()` resolves within a few watchdog rounds (200 ms), long
/// before its 20 s TTL would run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_answering_readonly_loses_the_lease_at_once() {
    let d = RedisSentinels::start(1, 0);
    let (primary, replica) = (&d.nodes[0], &d.nodes[1]);
    let ttl = secs(20);
    let options = LockOptions::new().ttl(ttl).watchdog_interval(ms(200));
    let locks = LockManager::with_options(backend(&primary.url(), ReplicaAck::Off).await, options)
        .expect("options");
    let key = key_of(&locks, "demoted");
    let guard = support::take(&locks, "demoted").await;
    let lost = guard.lost();
    assert!(
        wait_for_async(secs(5), || held(replica, &key)).await,
        "the lease reached the replica"
    );

    assert!(replica.cmd(&["REPLICAOF", "NO", "ONE"]).is_ok());
    let port = replica.port().to_string();
    assert!(primary.cmd(&["REPLICAOF", "127.0.0.1", &port]).is_ok());
    let demoted = Instant::now();
    assert_eq!(
        primary.info_field("replication", "role").as_deref(),
        Some("slave")
    );
    tokio::time::timeout(secs(5), lost)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "lost() did not resolve within 5 s of the demotion (ttl {ttl:?}); lost: {}",
                guard.is_lost()
            )
        });
    assert!(guard.is_lost());
    let after = demoted.elapsed();
    assert!(
        guard.valid_until() > Instant::now() + secs(10),
        "lost {after:?} after the demotion, but only because its validity ran out"
    );
    eprintln!("demoted primary: lost {after:?} after the demotion");
}

/// A waiting acquire with a limit waits out a server that cannot write for a moment: a
/// primary demoted for 500 ms (its scripts' writes answered `READONLY`, each entry on its
/// own), and one whose `min-replicas-to-write` cannot be met for 500 ms (`NOREPLICAS`). Such
/// an entry's error is one that may pass; it was taken for a refusal, and the wait ended at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_waits_out_readonly_and_noreplicas() {
    let d = RedisSentinels::start(1, 0);
    let (primary, replica) = (&d.nodes[0], &d.nodes[1]);
    let locks = manager(&primary.url(), ReplicaAck::Off, secs(5)).await;
    // Demoted without its clients being closed, for 500 ms.
    assert!(replica.cmd(&["REPLICAOF", "NO", "ONE"]).is_ok());
    let port = replica.port().to_string();
    assert!(primary.cmd(&["REPLICAOF", "127.0.0.1", &port]).is_ok());
    let p_port = primary.port();
    let undo = std::thread::spawn(move || {
        std::thread::sleep(ms(500));
        support::Conn::connect(p_port, secs(1))
            .and_then(|mut c| c.cmd(&["REPLICAOF", "NO", "ONE"]))
            .expect("promote back")
    });
    let got = locks.lock("readonly").acquire_timeout(secs(10)).await;
    undo.join().expect("undo");
    got.expect("the wait outlasted READONLY")
        .release()
        .await
        .expect("release");

    assert!(primary
        .cmd(&["CONFIG", "SET", "min-replicas-to-write", "5"])
        .is_ok());
    let undo = std::thread::spawn(move || {
        std::thread::sleep(ms(500));
        support::Conn::connect(p_port, secs(1))
            .and_then(|mut c| c.cmd(&["CONFIG", "SET", "min-replicas-to-write", "0"]))
            .expect("allow writes")
    });
    let got = locks.lock("noreplicas").acquire_timeout(secs(10)).await;
    undo.join().expect("undo");
    got.expect("the wait outlasted NOREPLICAS")
        .release()
        .await
        .expect("release");
}

/// With acknowledgement on, a `WAIT` whose connection is killed (the replica paused, so it
/// waits) is a failure that may pass: a waiting acquire with a limit goes on, and gets the
/// lock once the replica answers again. It ended the wait at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_waits_out_a_failed_acknowledgement() {
    let d = RedisSentinels::start(1, 0);
    let (primary, replica) = (&d.nodes[0], &d.nodes[1]);
    let options = support::redis_options()
        .command_timeout(secs(3))
        .replica_ack(ReplicaAck::replicas(1).timeout(ms(1500)));
    let backend = RedisBackend::connect_with(&primary.url(), options)
        .await
        .expect("connect");
    let locks = LockManager::new(backend);
    replica.pause();
    let p_port = primary.port();
    let killer = std::thread::spawn(move || {
        // While the first WAIT waits for the paused replica.
        std::thread::sleep(ms(400));
        support::Conn::connect(p_port, secs(1))
            .and_then(|mut c| c.cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]))
            .expect("kill")
    });
    let lock = locks.lock("wait-killed");
    let waiting = tokio::spawn(async move { lock.acquire_timeout(secs(20)).await });
    killer.join().expect("killer");
    // The acquire outlives the kill, then gets its grant acknowledged once the replica runs.
    std::thread::sleep(ms(1000));
    assert!(!waiting.is_finished(), "the wait ended at the failed WAIT");
    replica.resume();
    let g = waiting
        .await
        .expect("task")
        .expect("acknowledged after the replica resumed");
    assert!(g.replicas_acked() >= Some(1));
}

/// A holder label that reads like a server's error ("READONLY ...") is data: reading it back
/// (`inspect`) does not make the backend think the server was demoted and reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_that_reads_like_an_error_is_data() {
    let server = RedisServer::start();
    let locks = manager(&server.url(), ReplicaAck::Off, secs(5)).await;
    let connections = || server.info_field("stats", "total_connections_received");
    let g = locks
        .lock_with("label", |o| o.holder_label("READONLY mirror"))
        .expect("options")
        .try_acquire()
        .await
        .expect("acquire")
        .expect("free");
    let before = connections();
    let info = locks.lock("label").inspect().await.expect("inspect");
    assert_eq!(
        info.and_then(|i| i.holder_label).as_deref(),
        Some("READONLY mirror")
    );
    // A reconnect would be under way by the next command's answer.
    locks.lock("label").inspect().await.expect("inspect again");
    // (Each look opens one connection of the harness's own.)
    let after = connections();
    assert_eq!(
        after.and_then(|a| a.parse::<u64>().ok()),
        before.and_then(|b| b.parse::<u64>().ok()).map(|b| b + 1),
        "the label made the backend reconnect"
    );
    g.release().await.expect("release");
}
