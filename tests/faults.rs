//! Fault injection against real `redis-server` processes: a paused server (SIGSTOP), a
//! killed and restarted server (no persistence), killed client connections (CLIENT KILL),
//! keys tampered with behind a holder's back, expired holders racing the next owner (the
//! seeds' DEL and GETSET races), replayed commands and dropped `acquire()` futures.
//!
//! Every wait is bounded: a hang is a failure, never a stuck test run.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::{self, Either};
use redlease::backend::{
    Acquire, Attempt, Backend, Claim, ClaimKind, Grant, Lease, NodeTerms, Release,
};
use redlease::{
    Error, LeaseKey, LockGuard, LockManager, LockOptions, RedisBackend, RedisOptions, RetryPolicy,
    Token,
};
use support::{
    field, held, holder, int_field, lease_ms, server_ms, sleep_async, wait_for_async, Checker,
    Conn, RedisServer,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Short timeouts, so that faults surface within a fraction of a second.
fn redis_opts() -> RedisOptions {
    support::redis_options()
        .command_timeout(ms(200))
        .connect_timeout(ms(300))
}

/// A backend with its own connections to `srv`.
async fn backend(srv: &RedisServer) -> RedisBackend {
    RedisBackend::connect_with(&srv.url(), redis_opts())
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", srv.url()))
}

/// A manager with its own backend (own connections, own watchdog).
async fn manager(srv: &RedisServer, opts: LockOptions) -> LockManager {
    LockManager::with_options(backend(srv).await, opts).expect("valid options")
}

/// Whether `key` exists at all (a lock's record outlives its lease: see `held` for that).
fn exists(srv: &RedisServer, key: &str) -> bool {
    srv.cmd(&["EXISTS", key]).as_int() == Some(1)
}

/// PTTL of `key` in ms (-2 absent, -1 no expiry). For a lock's record, the record's own
/// expiry (an hour past the lease), not the lease's time left (see `lease_ms`).
fn pttl(srv: &RedisServer, key: &str) -> i64 {
    srv.cmd(&["PTTL", key])
        .as_int()
        .unwrap_or_else(|| panic!("PTTL {key} did not return an integer"))
}

/// An hour, in ms: how long a lock's record outlives its lease (or a tombstone).
const HOUR_MS: i64 = 3_600_000;

/// Until when (server ms) plain waiters asked for the release to be published: the record's
/// `w`, if any.
fn waiters_deadline(srv: &RedisServer, key: &LeaseKey) -> Option<i64> {
    int_field(srv, key.as_str(), "w")
}

/// Asserts that the lease at `key` runs out within `max_ms` of now (server clock): reads `e`
/// before the clock, so a legitimate extension by `max_ms` in between never trips it.
fn assert_lease_within(srv: &RedisServer, key: &str, max_ms: i64, what: &str) {
    let e = int_field(srv, key, "e").unwrap_or_else(|| panic!("{what}: no lease expiry"));
    let now = server_ms(srv);
    assert!(
        e > now && e - now <= max_ms,
        "{what}: the lease runs {} ms more (at most {max_ms} expected)",
        e - now
    );
}

/// Subscribers of `channel` on the server (PUBSUB NUMSUB).
fn numsub(srv: &RedisServer, channel: &str) -> i64 {
    let r = srv.cmd(&["PUBSUB", "NUMSUB", channel]);
    r.as_array()
        .and_then(|a| a.get(1))
        .and_then(|n| n.as_int())
        .unwrap_or_else(|| panic!("PUBSUB NUMSUB replied {r:?}"))
}

/// Retries `try_acquire` (bounded) until it succeeds, accepting backend errors meanwhile
/// (a reconnect in progress); `Ok(None)` is accepted too while `allow_held`.
async fn try_acquire_until_ok(
    lock: &redlease::Lock,
    within: Duration,
    allow_held: bool,
) -> LockGuard {
    let deadline = Instant::now() + within;
    let mut last = String::new();
    while Instant::now() < deadline {
        let attempt = tokio::time::timeout(secs(5), lock.try_acquire())
            .await
            .expect("try_acquire must never hang");
        match attempt {
            Ok(Some(g)) => return g,
            Ok(None) => {
                assert!(allow_held, "{}: nobody should hold the lock", lock.name());
                last = "held".into();
            }
            Err(e @ Error::Backend { .. }) => last = e.to_string(),
            Err(e) => panic!("{}: unexpected error {e}", lock.name()),
        }
        // Bounded polling of a reconnecting client, not synchronisation.
        tokio::time::sleep(ms(20)).await;
    }
    panic!(
        "{}: could not acquire within {within:?}; last outcome: {last}",
        lock.name()
    );
}

// ---------------------------------------------------------------------------------------
// 1. Holder paused past its TTL.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_server_makes_the_holder_lost_at_its_deadline_and_its_late_calls_never_touch_the_next_owner(
) {
    let srv = RedisServer::start();
    let ttl = ms(300);
    let interval = ttl / 3;
    let a = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let b = manager(&srv, LockOptions::new().ttl(secs(5))).await;
    let lock_a = a.lock("paused-holder");
    let key = lock_a.key().as_str().to_string();
    let stale = lock_a.acquire_timeout(secs(2)).await.expect("A acquires");
    // The watchdog is running for it.
    assert!(
        wait_for_async(secs(2), || a.watchdog_stats().extended >= 1).await,
        "the watchdog never extended A's lease: {:?}",
        a.watchdog_stats()
    );

    let lost = stale.lost();
    srv.pause();
    let paused_at = Instant::now();
    let deadline_after_pause = stale.valid_until();
    let waited = tokio::time::timeout(secs(3), lost).await;
    let lost_at = Instant::now();
    srv.resume();
    assert!(
        waited.is_ok(),
        "lost() did not resolve within 3 s of pausing the server (ttl {ttl:?})"
    );
    assert!(stale.is_lost());
    // Nothing refused the lease: it is lost by its deadline, not before, and promptly.
    let final_deadline = stale.valid_until();
    assert!(
        lost_at >= deadline_after_pause && lost_at >= final_deadline,
        "reported lost {:?} before its deadline",
        final_deadline.saturating_duration_since(lost_at)
    );
    assert!(
        lost_at - final_deadline <= interval + ms(150),
        "lost() resolved {:?} after the deadline (more than one watchdog tick {interval:?})",
        lost_at - final_deadline
    );
    assert!(
        lost_at - paused_at <= ttl + ms(200),
        "lost() took {:?} after the pause with ttl {ttl:?}",
        lost_at - paused_at
    );

    // After resume, the next owner (own connection) gets the lock once the lease ran out.
    let lock_b = b.lock("paused-holder");
    let owner = tokio::time::timeout(secs(5), lock_b.acquire_timeout(secs(4)))
        .await
        .expect("B's acquire must not hang")
        .expect("B acquires the lock after the paused holder's lease ran out");
    let owner_value = holder(&srv, &key).expect("B's lease is on the server");
    assert!(owner.fencing_token() > stale.fencing_token());

    // A's client reconnects (its socket looked dead while the server was stopped); make
    // sure it talks to the server again, so the calls below reach it.
    let probe = try_acquire_until_ok(&a.lock("paused-holder-probe"), secs(5), false).await;
    probe.release().await.expect("probe release");

    match stale.extend(secs(60)).await {
        Err(Error::NotHeld) => {}
        other => panic!("stale extend must be NotHeld, got {other:?}"),
    }
    match stale.release().await {
        Err(Error::NotHeld) => {}
        other => panic!("stale release must be NotHeld, got {other:?}"),
    }
    assert_eq!(
        holder(&srv, &key).as_deref(),
        Some(owner_value.as_str()),
        "the stale holder's calls touched the new owner's lease"
    );
    // B's watchdog extends by its 5 s TTL; the stale extend would have given 60 s.
    assert_lease_within(&srv, &key, 5000, "new owner's lease after the stale calls");
    assert!(!owner.is_lost());
    owner.release().await.expect("the new owner releases");
    assert!(!held(&srv, &key));
    assert_eq!(
        field(&srv, &key, "e").as_deref(),
        Some("0"),
        "released, not run out"
    );
}

// ---------------------------------------------------------------------------------------
// 2. The seeds' DEL race and GETSET race: an expired holder racing the next owner.
// ---------------------------------------------------------------------------------------

/// The seeds' SETNX-then-EXPIRE pitfall (a crash between the two leaves a lock that never
/// expires): every lease is created with its TTL in one script, and the lock's record carries
/// the lifetime the layout promises (an hour past the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_is_created_with_its_ttl_in_one_step() {
    let srv = RedisServer::start();
    let holder = manager(&srv, LockOptions::new().ttl(secs(7))).await;
    let waiter = manager(&srv, LockOptions::new()).await;
    let lock = holder.lock("ttl-at-once");
    let key = lock.key().clone();
    let calls_before = srv.info_field("commandstats", "cmdstat_evalsha");
    let guard = lock.acquire().await.expect("acquire");
    let calls_after = srv.info_field("commandstats", "cmdstat_evalsha");
    assert_ne!(calls_before, calls_after, "the acquire is a script call");
    let left = lease_ms(&srv, key.as_str());
    assert!(
        left > 0 && left <= 7000,
        "a fresh lease carries its TTL: {left} ms left"
    );
    assert_eq!(srv.cmd(&["SETNX", key.as_str(), "x"]).as_int(), Some(0));
    // The record outlives the lease by an hour (so a holder that crashes does not leave it
    // forever), an extension renews that once half of it is gone, and a release leaves it
    // (the clock floor keeps tokens increasing after it); the waiters flag is a deadline in
    // it, so it runs out on its own too.
    let k = key.as_str();
    let left = pttl(&srv, k);
    assert!(
        (3_600_000..=3_607_000).contains(&left),
        "the record outlives the 7 s lease by an hour: PTTL {left}"
    );
    let e = int_field(&srv, k, "e").expect("the lease's expiry");
    let x = int_field(&srv, k, "x").expect("the record's expiry");
    // (Exactly an hour at the grant; a watchdog extension since may have moved `e` on.)
    assert!(
        (HOUR_MS - 7000..=HOUR_MS).contains(&(x - e)),
        "the record's `x` is an hour past the lease: {} ms",
        x - e
    );
    // An extension past the record's half hour renews its hour, past the new lease.
    guard.extend(secs(31 * 60)).await.expect("extend");
    let left = pttl(&srv, k);
    assert!(
        (5_455_000..=5_460_000).contains(&left),
        "an extension renews the record's hour past the lease: PTTL {left}"
    );
    let x = int_field(&srv, k, "x").expect("the record's expiry");
    let now = server_ms(&srv);
    assert!(
        (x - now - left).abs() <= 1000,
        "`x` ({} ms ahead) is the record's expiry (PTTL {left})",
        x - now
    );
    let blocked = waiter.lock("ttl-at-once").acquire_timeout(ms(150)).await;
    assert!(matches!(blocked, Err(Error::Timeout { .. })), "{blocked:?}");
    let flag = waiters_deadline(&srv, &key).expect("a waiter registered");
    let left = flag - server_ms(&srv);
    assert!(
        left > 0 && left < 60_000,
        "the waiters flag runs out on its own: {left} ms left"
    );
    guard.release().await.expect("release");
    assert!(!held(&srv, k));
    assert_eq!(field(&srv, k, "e").as_deref(), Some("0"), "released");
    // The release keeps the record, with the expiry it had: still at least an hour.
    let left = pttl(&srv, k);
    assert!(
        left > 3_500_000 && left <= 5_460_000,
        "the record outlives the release: PTTL {left}"
    );
}

/// A waiter's flag is written into the lock's record; it must never leave a record that does
/// not expire. A plain waiter's flag goes into the held lock's record, which keeps its hour
/// past the lease. A record that is gone while fair waiters queue (evicted under a
/// `volatile-*` policy, deleted by hand) is made again by the next fair waiter's flag (`q`),
/// and gets its own hour then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_flags_never_leave_a_record_without_expiry() {
    let srv = RedisServer::start();
    let holder_m = manager(&srv, LockOptions::new().ttl(secs(7))).await;
    let waiter = manager(&srv, LockOptions::new()).await;
    let lock = holder_m.lock("gone");
    let key = lock.key().clone();
    let guard = lock.acquire().await.expect("acquire");
    let blocked = waiter.lock("gone").acquire_timeout(ms(150)).await;
    assert!(matches!(blocked, Err(Error::Timeout { .. })), "{blocked:?}");
    assert!(waiters_deadline(&srv, &key).is_some(), "the waiter's flag");
    let left = pttl(&srv, key.as_str());
    assert!(
        (3_590_000..=3_607_000).contains(&left),
        "the flagged record still expires an hour past the lease: PTTL {left}"
    );
    guard.release().await.expect("release");

    // Fair waiters queue behind a holder; then the record goes.
    let b = backend(&srv).await;
    let key = LeaseKey::new("faults:", "gone-fair");
    let fair = |t: &Token| Claim::new(key.clone(), t.clone(), secs(7)).kind(ClaimKind::Fair);
    let wait = Attempt::Waiting { recheck: secs(1) };
    let (h, first, second) = (Token::random(), Token::random(), Token::random());
    let granted = b
        .acquire(&fair(&h), Attempt::Once, NodeTerms::new())
        .await
        .expect("fair holder");
    assert!(matches!(granted, Acquire::Granted(..)), "{granted:?}");
    let queued = b
        .acquire(&fair(&first), wait, NodeTerms::new())
        .await
        .expect("first fair waiter");
    assert!(matches!(queued, Acquire::Held { .. }), "{queued:?}");
    assert_eq!(srv.cmd(&["DEL", key.as_str()]).as_int(), Some(1));
    // The next waiter finds the lock free but the queue headed by the first: it queues, and
    // its flag makes the record again.
    let queued = b
        .acquire(&fair(&second), wait, NodeTerms::new())
        .await
        .expect("second fair waiter");
    assert!(
        !matches!(queued, Acquire::Granted(..)),
        "granted past the queue's head: {queued:?}"
    );
    let q = int_field(&srv, key.as_str(), "q").expect("the fair waiter's flag");
    assert!(q > server_ms(&srv), "the queue flag runs: {q}");
    let left = pttl(&srv, key.as_str());
    assert!(
        (3_590_000..=3_610_000).contains(&left),
        "the record made again by a fair waiter expires an hour past its flag: PTTL {left}"
    );
    assert_eq!(
        int_field(&srv, key.as_str(), "x"),
        Some(q + HOUR_MS),
        "the remade record's `x` is its expiry, an hour past the flag"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_holders_release_and_extend_leave_the_next_owners_lease_alone() {
    let srv = RedisServer::start();
    let a = manager(&srv, LockOptions::new().ttl(ms(200)).watchdog(false)).await;
    let b = manager(&srv, LockOptions::new().ttl(secs(5)).watchdog(false)).await;
    let lock_a = a.lock("seed-del-race");
    let lock_b = b.lock("seed-del-race");
    let key = lock_a.key().as_str().to_string();

    let ga = lock_a
        .try_acquire()
        .await
        .expect("A's attempt")
        .expect("the lock is free");
    let a_value = holder(&srv, &key).expect("A's lease is on the server");
    // A stalls; its lease runs out on the server.
    assert!(
        wait_for_async(secs(3), || !held(&srv, &key)).await,
        "A's lease never expired"
    );
    assert!(
        ga.is_lost(),
        "A's local deadline passed before its lease ran out on the server"
    );
    let gb = lock_b
        .try_acquire()
        .await
        .expect("B's attempt")
        .expect("B acquires the expired lock");
    let b_value = holder(&srv, &key).expect("B's lease is on the server");
    assert_ne!(a_value, b_value);
    // No watchdog: B's lease expiry moves only if a stale call extends it.
    let e_before = int_field(&srv, &key, "e");

    // GETSET-race analogue: A's late extend does not extend B's lease.
    match ga.extend(secs(60)).await {
        Err(Error::NotHeld) => {}
        other => panic!("late extend must be NotHeld, got {other:?}"),
    }
    // DEL race: A's late release does not delete B's lease.
    match ga.release().await {
        Err(Error::NotHeld) => {}
        other => panic!("late release must be NotHeld, got {other:?}"),
    }
    assert_eq!(holder(&srv, &key).as_deref(), Some(b_value.as_str()));
    let e_after = int_field(&srv, &key, "e");
    assert_eq!(e_before, e_after, "B's lease expiry moved");
    assert!(!gb.is_lost());
    gb.release().await.expect("B releases");

    // The same race at the store level, where the stale commands really reach Redis (the
    // guard above may refuse locally once it knows it is lost).
    let raw = backend(&srv).await;
    let key = LeaseKey::new("faults:", "seed-getset-race");
    let (ta, tb) = (Token::random(), Token::random());
    let ca = Claim::new(key.clone(), ta.clone(), ms(100));
    let cb = Claim::new(key.clone(), tb.clone(), secs(5));
    assert!(matches!(
        raw.acquire(&ca, Attempt::Once, NodeTerms::new())
            .await
            .expect("acquire A"),
        Acquire::Granted(..)
    ));
    assert!(
        wait_for_async(secs(3), || !held(&srv, key.as_str())).await,
        "A's raw lease never expired"
    );
    assert!(matches!(
        raw.acquire(&cb, Attempt::Once, NodeTerms::new())
            .await
            .expect("acquire B"),
        Acquire::Granted(..)
    ));
    let e_before = int_field(&srv, key.as_str(), "e");
    let extended = raw
        .extend(
            &[Lease {
                key: &key,
                token: &ta,
                ttl: secs(60),
            }],
            NodeTerms::new(),
        )
        .await
        .expect("stale extend runs");
    assert!(
        matches!(extended.as_slice(), [redlease::backend::Extended::Gone]),
        "a stale token's extend must be refused: {extended:?}"
    );
    assert!(
        raw.release(&ca, Release::Confirmed { lease: &ca.token })
            .await
            .expect("stale release runs")
            .is_none(),
        "a stale token's release must report false"
    );
    assert_eq!(holder(&srv, key.as_str()).as_deref(), Some(tb.as_str()));
    let e_after = int_field(&srv, key.as_str(), "e");
    assert_eq!(e_before, e_after, "B's lease expiry moved");
    assert_eq!(
        raw.release(&cb, Release::Confirmed { lease: &cb.token })
            .await
            .expect("B's release"),
        Some(0)
    );
}

// ---------------------------------------------------------------------------------------
// 3. The watchdog keeps a lease alive for 10x its TTL.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_keeps_the_lease_alive_for_ten_ttls_without_a_gap() {
    let srv = RedisServer::start();
    let ttl = ms(200);
    let holder_m = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let rival = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let lock = holder_m.lock("long-hold");
    let key = lock.key().as_str().to_string();
    let guard = lock.acquire_timeout(secs(2)).await.expect("acquire");
    let value = holder(&srv, &key).expect("lease on the server");

    // Watch the lease from a separate thread on one raw connection, every ~2 ms: its time
    // left by the server's clock (as `lease_ms`, -2 when not held), read in one script so
    // that the record and the clock are seen at the same instant.
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (stop, port, key) = (stop.clone(), srv.port(), key.clone());
        tokio::task::spawn_blocking(move || {
            let mut conn = Conn::connect(port, secs(2)).expect("poller connects");
            let (mut samples, mut misses, mut max_pttl) = (0u64, Vec::new(), 0i64);
            let started = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                let p = conn
                    .cmd(&["EVAL", support::LEASE, "1", &key])
                    .expect("the lease's time left")
                    .as_array()
                    .and_then(|lease| lease.get(1)?.as_int())
                    .unwrap_or(-2);
                samples += 1;
                if p < 0 {
                    misses.push(started.elapsed());
                }
                max_pttl = max_pttl.max(p);
                std::thread::sleep(ms(2));
            }
            (samples, misses, max_pttl)
        })
    };

    let rival_lock = rival.lock("long-hold");
    let hold_started = Instant::now();
    let mut checks = 0;
    // Holding for ten TTLs is the thing under test: time must pass.
    while hold_started.elapsed() < ttl * 10 {
        tokio::time::sleep(ms(250)).await;
        let attempt = rival_lock.try_acquire().await.expect("rival's attempt");
        assert!(
            attempt.is_none(),
            "a rival acquired the lock after {:?} while it was held",
            hold_started.elapsed()
        );
        assert!(
            !guard.is_lost(),
            "guard lost after {:?}",
            hold_started.elapsed()
        );
        checks += 1;
    }
    stop.store(true, Ordering::SeqCst);
    let (samples, misses, max_pttl) = poller.await.expect("poller thread");
    assert!(checks >= 7);
    assert!(samples >= 100, "only {samples} samples of the lease");
    assert!(
        misses.is_empty(),
        "the lease lapsed during the hold at {:?} (of {samples} samples)",
        &misses[..misses.len().min(10)]
    );
    assert!(max_pttl <= 200, "{max_pttl} ms left: above the ttl");
    assert_eq!(holder(&srv, &key).as_deref(), Some(value.as_str()));
    let stats = holder_m.watchdog_stats();
    assert!(stats.extended >= 15, "too few extensions: {stats:?}");
    assert_eq!(stats.lost, 0, "{stats:?}");
    guard.release().await.expect("release after a long hold");
    assert!(!held(&srv, &key));
}

// ---------------------------------------------------------------------------------------
// 4. A refused extension marks the guard lost.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_extension_after_del_or_overwrite_marks_the_guard_lost_before_its_deadline() {
    let srv = RedisServer::start();
    let ttl = ms(500);
    let interval = ttl / 3;
    let m = manager(&srv, LockOptions::new().ttl(ttl)).await;

    // The record deleted; its lease taken over by another token; the key overwritten with a
    // value of another type.
    for case in ["DEL", "takeover", "overwrite"] {
        let lock = m.lock(&format!("tampered-{case}"));
        let key = lock.key().as_str().to_string();
        let guard = lock.acquire_timeout(secs(2)).await.expect("acquire");
        let lost = guard.lost();
        match case {
            "DEL" => assert_eq!(srv.cmd(&["DEL", &key]).as_int(), Some(1)),
            "takeover" => {
                let until = (server_ms(&srv) + 10_000).to_string();
                let r = srv.cmd(&["HSET", &key, "t", "intruder", "e", &until]);
                assert_eq!(r.as_int(), Some(0), "{r:?}");
            }
            _ => assert!(srv.cmd(&["SET", &key, "intruder", "PX", "10000"]).is_ok()),
        }
        let tampered_at = Instant::now();
        let deadline = guard.valid_until();
        tokio::time::timeout(secs(3), lost)
            .await
            .unwrap_or_else(|_| panic!("{case}: lost() did not resolve within 3 s"));
        let lost_at = Instant::now();
        assert!(guard.is_lost(), "{case}");
        // Refused at the next tick, not merely timed out at the deadline.
        assert!(
            lost_at < deadline,
            "{case}: lost only {:?} after the deadline; a refused extension should be seen at \
             the next watchdog tick ({interval:?})",
            lost_at - deadline
        );
        assert!(
            lost_at - tampered_at <= interval + ms(150),
            "{case}: lost {:?} after tampering; watchdog interval {interval:?}",
            lost_at - tampered_at
        );
        // The watchdog did not write the lease back, and the lost guard's calls leave the
        // intruder alone.
        match guard.extend(ttl).await {
            Err(Error::NotHeld) => {}
            other => panic!("{case}: extend of a lost guard must be NotHeld, got {other:?}"),
        }
        match guard.release().await {
            Err(Error::NotHeld) => {}
            other => panic!("{case}: release of a lost guard must be NotHeld, got {other:?}"),
        }
        match case {
            // Not even part of a record was written back.
            "DEL" => assert!(!exists(&srv, &key), "{case}: the record was written back"),
            "takeover" => assert_eq!(holder(&srv, &key).as_deref(), Some("intruder"), "{case}"),
            _ => assert_eq!(
                srv.cmd(&["GET", &key]).as_str().as_deref(),
                Some("intruder"),
                "{case}"
            ),
        }
    }
    assert_eq!(m.watchdog_stats().lost, 3, "{:?}", m.watchdog_stats());
}

// ---------------------------------------------------------------------------------------
// 5. Redis killed and restarted.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_server_fails_calls_promptly_and_the_same_backend_reconnects_after_restart() {
    let mut srv = RedisServer::start();
    let ttl = ms(500);
    let m = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let lock = m.lock("kill-restart");
    let key = lock.key().as_str().to_string();
    lock.try_acquire()
        .await
        .expect("attempt")
        .expect("free")
        .release()
        .await
        .expect("release");

    // A guard held when the server dies is lost by its deadline.
    let doomed = lock.acquire_timeout(secs(2)).await.expect("acquire");
    let lost = doomed.lost();
    srv.kill();
    let killed_at = Instant::now();
    tokio::time::timeout(secs(3), lost)
        .await
        .expect("a guard held on a dead server must be reported lost");
    assert!(doomed.is_lost());
    assert!(
        killed_at.elapsed() <= ttl + ms(300),
        "lost {:?} after the kill (ttl {ttl:?})",
        killed_at.elapsed()
    );

    for _ in 0..3 {
        let started = Instant::now();
        let r = tokio::time::timeout(secs(5), lock.try_acquire())
            .await
            .expect("try_acquire hung on a dead server");
        assert!(
            matches!(r, Err(Error::Backend { .. })),
            "try_acquire on a dead server: {r:?}"
        );
        assert!(started.elapsed() < secs(3), "took {:?}", started.elapsed());
    }
    let r = tokio::time::timeout(secs(5), lock.acquire_timeout(secs(2)))
        .await
        .expect("acquire hung on a dead server");
    assert!(
        matches!(r, Err(Error::Backend { .. } | Error::Timeout { .. })),
        "acquire on a dead server: {r:?}"
    );

    srv.restart();
    // A 2 s lease on the same manager (client and watchdog): right after a reconnect the
    // client reloads its scripts, and on a loaded machine a 500 ms lease's first extension
    // could miss its deadline behind them.
    let lock = m
        .lock_with("kill-restart", |o| o.ttl(secs(2)))
        .expect("options");
    let g = try_acquire_until_ok(&lock, secs(10), false).await;
    assert!(held(&srv, &key), "the lease is on the restarted server");
    assert!(g.fencing_token() > doomed.fencing_token());
    // The watchdog works on the reconnected client too.
    assert!(
        wait_for_async(secs(2), || m.watchdog_stats().extended >= 2).await,
        "{:?}",
        m.watchdog_stats()
    );
    assert!(!g.is_lost());
    g.release().await.expect("release after reconnect");
    assert!(!held(&srv, &key));
    match doomed.release().await {
        Err(Error::NotHeld) => {}
        other => panic!("release of the guard lost with the old server: {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// 6. Fencing tokens across a restart without persistence.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_strictly_increase_across_restarts_without_persistence() {
    let mut srv = RedisServer::start();
    let opts = LockOptions::new().ttl(secs(2));
    let m = manager(&srv, opts.clone()).await;
    let lock = m.lock("fence-restart");
    let key = lock.key().clone();

    let mut tokens = Vec::new();
    for _ in 0..3 {
        let g = lock.try_acquire().await.expect("attempt").expect("free");
        tokens.push(g.fencing_token());
        g.release().await.expect("release");
    }

    srv.restart();
    assert!(
        !exists(&srv, key.as_str()),
        "the restarted server must be empty (no record, no fencing counter)"
    );
    // Same backend, after its automatic reconnect.
    let g = try_acquire_until_ok(&lock, secs(10), false).await;
    tokens.push(g.fencing_token());
    g.release().await.expect("release");
    // A fresh backend.
    let fresh = manager(&srv, opts.clone()).await;
    let g = fresh
        .lock("fence-restart")
        .try_acquire()
        .await
        .expect("attempt")
        .expect("free");
    tokens.push(g.fencing_token());
    g.release().await.expect("release");

    // Once more, straight after a restart, on a brand-new connection.
    srv.restart();
    let fresh = manager(&srv, opts).await;
    let g = fresh
        .lock("fence-restart")
        .try_acquire()
        .await
        .expect("attempt")
        .expect("free");
    tokens.push(g.fencing_token());
    g.release().await.expect("release");

    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens not strictly increasing across restarts: {tokens:?}"
    );
}

/// A server restarted without persistence comes back empty: every lease on it is gone. The
/// reconnect is told to the watchdog, which checks every lease at once, so the holders of a
/// semaphore's permits are told right away, not at their next round (a minute's TTL: 20 s
/// away), while another client may already take the permits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_without_persistence_tells_holders_at_the_reconnect() {
    let mut srv = RedisServer::start();
    let m = manager(&srv, LockOptions::new().ttl(secs(60))).await;
    let pool = m.semaphore("restart-pool", 3).expect("semaphore");
    let mut permits = Vec::new();
    for _ in 0..3 {
        permits.push(pool.try_acquire().await.expect("attempt").expect("free"));
    }
    let plain = m
        .lock("restart-plain")
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let rounds = m.watchdog_stats().rounds;

    srv.restart();
    let all_lost = future::join_all(permits.iter().chain([&plain]).map(|g| g.lost()));
    tokio::time::timeout(secs(10), all_lost)
        .await
        .expect("holders of leases the restart wiped out are told at the reconnect");
    assert_eq!(m.watchdog_stats().lost, 4);
    assert!(
        m.watchdog_stats().rounds > rounds,
        "found by an extension call"
    );

    // A lease taken after the restart is kept (the check loses only what is gone).
    // A reconnect to the same server is checked the same way, and loses nothing.
    let g = try_acquire_until_ok(&m.lock("restart-after"), secs(10), false).await;
    let extended = m.watchdog_stats().extended;
    srv.kill_clients();
    let m2 = m.clone();
    assert!(
        wait_for_async(secs(10), move || m2.watchdog_stats().extended > extended).await,
        "{:?}",
        m.watchdog_stats()
    );
    assert!(!g.is_lost(), "a reconnect to the same server loses nothing");
}

/// With a restart quarantine, a server restarted empty grants nothing until every lease it
/// had granted has run out by its holder's reckoning. The first holder's watchdog is off, so
/// nothing tells it of the restart: without the quarantine, the second client is granted
/// the lock while the first guard is still valid. Leases longer than the quarantine are
/// refused, and a fresh server waits out its quarantine too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_quarantine_keeps_a_restarted_server_from_granting_a_held_lock() {
    let quarantine = secs(3);
    let mut srv = RedisServer::start();
    let opts = redis_opts()
        .connect_timeout(secs(2))
        .restart_quarantine(quarantine);
    let ttl = secs(2);
    let quarantined = || async {
        let b = RedisBackend::connect_with(&srv.url(), opts.clone())
            .await
            .expect("connect");
        LockManager::with_options(b, LockOptions::new().ttl(ttl).watchdog(false)).expect("options")
    };
    let (a, b) = (quarantined().await, quarantined().await);
    let year_and_a_day = secs(366 * 24 * 3600);
    let refused =
        RedisBackend::connect_with(&srv.url(), opts.clone().restart_quarantine(year_and_a_day))
            .await
            .expect_err("a quarantine longer than any TTL");
    assert!(matches!(refused, Error::InvalidConfig(_)), "{refused}");

    // A fresh server is in its quarantine: nothing yet, then the lock once it has passed.
    let fresh = a.lock("quarantined").try_acquire().await.expect("attempt");
    let first = match fresh {
        Some(g) => g,
        None => a
            .lock("quarantined")
            .acquire_timeout(secs(10))
            .await
            .expect("granted once the fresh server has been up for the quarantine"),
    };
    let too_long = a
        .lock_with("too-long", |o| o.ttl(secs(4)))
        .expect("options")
        .try_acquire()
        .await
        .expect_err("a lease longer than the quarantine");
    assert!(
        matches!(&too_long, Error::InvalidConfig(m) if m.contains("quarantine")),
        "{too_long}"
    );
    let extended = first
        .extend(secs(4))
        .await
        .expect_err("an extension past the quarantine");
    assert!(matches!(extended, Error::InvalidConfig(_)), "{extended}");

    // Every kind of claim: a fair lock, a semaphore's one permit, a read-write lock's write.
    let fair = a
        .lock("q-fair")
        .fair()
        .expect("fair")
        .acquire()
        .await
        .expect("fair");
    let sem = |m: &LockManager| m.lock("q-sem").semaphore(1).expect("semaphore");
    let permit = sem(&a).acquire().await.expect("permit");
    let rw = |m: &LockManager| m.lock("q-rw").rw().expect("read-write lock");
    let write = rw(&a).write().await.expect("write");

    srv.restart();
    // All at once, each timed as it is granted.
    let wait = secs(15);
    let timed = |f: futures::future::BoxFuture<'static, Result<LockGuard, Error>>| async move {
        let g = f.await;
        (g, Instant::now())
    };
    let (fair_b, sem_b, rw_b, plain_b) = (
        b.lock("q-fair").fair().expect("fair"),
        sem(&b),
        rw(&b),
        b.lock("quarantined"),
    );
    let (plain_new, fair_new, permit_new, read_new) = futures::join!(
        timed(Box::pin(async move { plain_b.acquire_timeout(wait).await })),
        timed(Box::pin(async move { fair_b.acquire_timeout(wait).await })),
        timed(Box::pin(async move { sem_b.acquire_timeout(wait).await })),
        timed(Box::pin(async move { rw_b.read_timeout(wait).await })),
    );
    let held = [
        ("plain", first, plain_new),
        ("fair", fair, fair_new),
        ("permit", permit, permit_new),
        ("read", write, read_new),
    ];
    for (kind, old, (new, at)) in held {
        let new = new.unwrap_or_else(|e| panic!("{kind}: not granted after the quarantine: {e}"));
        assert!(
            at >= old.valid_until(),
            "{kind}: granted {:?} before the first guard's validity ended",
            old.valid_until() - at
        );
        drop(new);
    }
}

// ---------------------------------------------------------------------------------------
// 7. Server paused (SIGSTOP): calls fail within the command timeout, then work again.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_server_fails_attempts_within_the_command_timeout_and_works_after_resume() {
    let srv = RedisServer::start();
    let m = manager(&srv, LockOptions::new().ttl(ms(300))).await;
    let lock = m.lock("paused-attempts");
    lock.try_acquire()
        .await
        .expect("attempt")
        .expect("free")
        .release()
        .await
        .expect("release");

    srv.pause();
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let started = Instant::now();
        let r = tokio::time::timeout(secs(5), lock.try_acquire()).await;
        let took = started.elapsed();
        let Ok(r) = r else {
            srv.resume();
            panic!("try_acquire hung on a paused server");
        };
        outcomes.push((r.map(|g| g.is_some()), took));
    }
    let started = Instant::now();
    let waiting = tokio::time::timeout(secs(5), lock.acquire_timeout(secs(3))).await;
    let waiting_took = started.elapsed();
    srv.resume();

    for (r, took) in &outcomes {
        assert!(
            matches!(r, Err(Error::Backend { .. })),
            "try_acquire on a paused server: {r:?}"
        );
        assert!(
            *took < secs(2),
            "try_acquire took {took:?} (command timeout 200 ms)"
        );
    }
    let waiting = waiting.expect("acquire hung on a paused server");
    assert!(
        matches!(waiting, Err(Error::Backend { .. } | Error::Timeout { .. })),
        "acquire on a paused server: {waiting:?}"
    );
    assert!(waiting_took < secs(4), "acquire took {waiting_took:?}");

    let g = try_acquire_until_ok(&lock, secs(10), true).await;
    assert!(!g.is_lost());
    g.release().await.expect("release after resume");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_that_failed_on_a_paused_server_leave_no_orphan_lease_after_resume() {
    let srv = RedisServer::start();
    // Long TTL: an orphan would block everyone for 10 s, far past the bound below.
    let m = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let lock = m.lock("paused-orphan");
    let key = lock.key().as_str().to_string();
    lock.try_acquire()
        .await
        .expect("attempt")
        .expect("free")
        .release()
        .await
        .expect("release");

    srv.pause();
    let r = tokio::time::timeout(secs(5), lock.try_acquire()).await;
    // A waiting acquire cut short by its caller, while the server is still stopped.
    let dropped = tokio::time::timeout(ms(50), lock.acquire()).await;
    // Stay stopped long enough for the client to give up on its connection (the silent
    // socket is dropped after twice the command timeout) and for the background clean-up
    // to fail: the server runs the stale attempts only after resume.
    tokio::time::sleep(ms(1000)).await;
    srv.resume();
    let r = r.expect("try_acquire hung on a paused server");
    assert!(matches!(r, Err(Error::Backend { .. })), "{r:?}");
    assert!(
        dropped.is_err(),
        "acquire on a paused server completed: {dropped:?}"
    );

    // The server now runs whatever reached it during the pause, and the client re-sends
    // what was in flight once it has reconnected. Wait until the same client works again
    // (so any re-sent command has been sent before this probe), then look for the orphan.
    let probe = try_acquire_until_ok(&m.lock("paused-orphan-probe"), secs(5), false).await;
    probe.release().await.expect("probe release");
    let cleaned = wait_for_async(secs(3), || !held(&srv, &key)).await;
    assert!(
        cleaned,
        "an orphan lease from an attempt that failed on the paused server is left: holder \
         {:?}, {} ms left (the lock is blocked for its whole TTL)",
        holder(&srv, &key),
        lease_ms(&srv, &key)
    );
    let other = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let g = try_acquire_until_ok(&other.lock("paused-orphan"), secs(3), true).await;
    g.release().await.expect("release");
}

// ---------------------------------------------------------------------------------------
// 8. Connections killed with CLIENT KILL.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connections_do_not_lose_a_watched_guard() {
    let srv = RedisServer::start();
    let ttl = ms(500);
    let m = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let lock = m.lock("client-kill-held");
    let key = lock.key().as_str().to_string();
    let guard = lock.acquire_timeout(secs(2)).await.expect("acquire");
    let value = holder(&srv, &key).expect("lease on the server");

    let started = Instant::now();
    let mut killed = 0;
    // Several TTLs of killing: time passing is what is under test.
    while started.elapsed() < ttl * 5 {
        killed += srv.kill_clients();
        if killed % 2 == 0 {
            srv.kill_pubsub_clients();
        }
        assert!(
            !guard.is_lost(),
            "guard lost {:?} into the connection kills: {:?}",
            started.elapsed(),
            m.watchdog_stats()
        );
        tokio::time::sleep(ms(150)).await;
    }
    assert!(killed >= 5, "only {killed} connections were killed");
    assert!(!guard.is_lost(), "{:?}", m.watchdog_stats());
    assert_eq!(holder(&srv, &key).as_deref(), Some(value.as_str()));
    let p = lease_ms(&srv, &key);
    assert!(p > 0, "{p} ms left");
    tokio::time::timeout(secs(3), guard.release())
        .await
        .expect("release hung after the kills")
        .expect("release after the kills");
    assert!(!held(&srv, &key));
}

/// A waiter blocked in `acquire()` whose connections (normal and pub/sub) were killed is
/// still woken by the release, through the re-subscribed channel, well before its
/// fallback re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_the_release_after_its_pubsub_connection_was_killed() {
    let srv = RedisServer::start();
    // Long leases, and a fallback re-check 96-120 s away: a waiter that gets the lock within
    // the test's bounds was woken by the release.
    let opts = LockOptions::new()
        .ttl(secs(300))
        .retry(RetryPolicy::notify().max_delay(secs(120)));
    let holder = manager(&srv, opts.clone()).await;
    let waiter_m = manager(&srv, opts).await;
    let lock = holder.lock("client-kill-waiter");
    let key = lock.key().clone();
    let channel = key.derived("released");

    let guard = lock
        .acquire_timeout(secs(2))
        .await
        .expect("holder acquires");
    let waiter_lock = waiter_m.lock("client-kill-waiter");
    let waiter = tokio::spawn(async move { waiter_lock.acquire_timeout(secs(60)).await });
    srv.wait_until(secs(3), |s| {
        numsub(s, &channel) >= 1 && waiters_deadline(s, &key).is_some_and(|w| w > server_ms(s))
    });

    assert!(srv.kill_pubsub_clients() >= 1);
    srv.kill_clients();
    // The subscriber reconnects and re-subscribes on its own.
    srv.wait_until(secs(10), |s| numsub(s, &channel) >= 1);
    tokio::time::timeout(secs(10), guard.release())
        .await
        .expect("release hung after the kills")
        .expect("holder releases");
    let g = tokio::time::timeout(secs(30), waiter)
        .await
        .expect("the waiter was not woken by pub/sub after the reconnect")
        .expect("waiter task")
        .expect("the waiter gets the lock");
    g.release().await.expect("waiter releases");
}

/// A holder on `srv` of lock `name` (its manager and guard), and a manager whose connections
/// to `srv` go through `proxy`, with long leases and a fallback re-check far past the tests'
/// bounds: a waiter gets the lock in time only after a wake-up.
async fn holder_and_proxied_waiter(
    srv: &RedisServer,
    proxy: &support::Proxy,
    name: &str,
) -> (LockManager, LockGuard, LockManager) {
    let opts = LockOptions::new()
        .ttl(secs(60))
        .retry(RetryPolicy::notify().max_delay(secs(120)));
    let holder = manager(srv, opts.clone()).await;
    let guard = holder
        .lock(name)
        .acquire_timeout(secs(2))
        .await
        .expect("holder acquires");
    let backend = RedisBackend::connect_with(&proxy.url(), redis_opts())
        .await
        .expect("connect through the proxy");
    let waiter = LockManager::with_options(backend, opts).expect("valid options");
    (holder, guard, waiter)
}

/// A waiter checks the lock again only once the server has its subscription: a release
/// published before that reaches nobody, and the check after it sees the lock free. (fred
/// answers a SUBSCRIBE before writing it; a proxy holds it back here, as a starved machine
/// can by chance.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_checks_again_once_the_server_has_its_subscription() {
    let srv = RedisServer::start();
    let proxy = support::Proxy::start(srv.port());
    let (_holder, guard, waiter_m) = holder_and_proxied_waiter(&srv, &proxy, "subscribed").await;
    // Script calls so far: the holder's acquire. Each attempt of the waiter adds one.
    let before = srv.script_calls();
    proxy.hold(b"SUBSCRIBE");
    let waiter_lock = waiter_m.lock("subscribed");
    let waiter = tokio::spawn(async move { waiter_lock.acquire_timeout(secs(100)).await });
    assert!(proxy.wait_held(secs(10)), "the waiter never subscribed");
    // Its first attempt, then another (at once, or after the unanswered subscription timed
    // out): both find the lock held. The release comes after them, while the server does
    // not have the subscription: its message reaches nobody.
    srv.wait_until(secs(10), |s| s.script_calls() >= before + 2);
    guard.release().await.expect("holder releases");
    proxy.pass();
    let g = tokio::time::timeout(secs(10), waiter)
        .await
        .expect("the waiter missed the release made before its subscription was in place")
        .expect("waiter task")
        .expect("the waiter gets the lock");
    assert!(!g.is_lost());
    g.release().await.expect("waiter releases");
}

/// A waiter whose subscriber reconnects checks the lock again once its channel is
/// subscribed again: a release published before that (its message reaches nobody) is seen
/// by that check, rather than by the fallback re-check minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_rechecks_once_its_channel_is_subscribed_again() {
    let srv = RedisServer::start();
    let proxy = support::Proxy::start(srv.port());
    let (holder, guard, waiter_m) = holder_and_proxied_waiter(&srv, &proxy, "resubscribed").await;
    let channel = holder.lock("resubscribed").key().derived("released");
    let before = srv.script_calls();
    let waiter_lock = waiter_m.lock("resubscribed");
    let waiter = tokio::spawn(async move { waiter_lock.acquire_timeout(secs(100)).await });
    // Subscribed, and its two attempts (arriving, then once subscribed) made: it waits.
    srv.wait_until(secs(10), |s| {
        numsub(s, &channel) >= 1 && s.script_calls() >= before + 2
    });

    proxy.hold(b"SUBSCRIBE");
    assert!(srv.kill_pubsub_clients() >= 1);
    assert!(
        proxy.wait_held(secs(10)),
        "the subscriber never subscribed again"
    );
    // The reconnect wakes the waiter (at once, or when a try at subscribing again times
    // out): it checks again and finds the lock held. The release comes after that check,
    // while the channel is not subscribed: its message reaches nobody.
    srv.wait_until(secs(10), |s| s.script_calls() >= before + 3);
    guard.release().await.expect("holder releases");
    proxy.pass();
    let g = tokio::time::timeout(secs(10), waiter)
        .await
        .expect("the waiter missed the release made while it re-subscribed")
        .expect("waiter task")
        .expect("the waiter gets the lock");
    assert!(!g.is_lost());
    g.release().await.expect("waiter releases");
}

/// The release comes right after the kills, before the subscriber is back: the reconnect
/// wake-up or the fallback re-check must still get the waiter the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_gets_the_lock_when_the_release_comes_while_its_connections_are_down() {
    let srv = RedisServer::start();
    let ttl = ms(500);
    let holder = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let waiter_m = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let lock = holder.lock("client-kill-waiter-2");
    let key = lock.key().clone();
    let channel = key.derived("released");

    let guard = lock
        .acquire_timeout(secs(2))
        .await
        .expect("holder acquires");
    let waiter_lock = waiter_m.lock("client-kill-waiter-2");
    let waiter = tokio::spawn(async move { waiter_lock.acquire_timeout(secs(5)).await });
    srv.wait_until(secs(3), |s| numsub(s, &channel) >= 1);

    // Hold a little under the kills: the guard must survive them.
    for _ in 0..3 {
        srv.kill_pubsub_clients();
        srv.kill_clients();
        tokio::time::sleep(ms(100)).await;
    }
    assert!(!guard.is_lost(), "{:?}", holder.watchdog_stats());
    srv.kill_pubsub_clients();
    let release = tokio::time::timeout(secs(3), guard.release())
        .await
        .expect("release hung after the kills");
    // The release may have to wait for the reconnect, but it must not fail the lease.
    release.expect("holder releases");
    let g = tokio::time::timeout(secs(7), waiter)
        .await
        .expect("the waiter hung")
        .expect("waiter task")
        .expect("the waiter gets the lock");
    assert!(!g.is_lost());
    g.release().await.expect("waiter releases");
}

/// A waiter blocked in `acquire()` with no wait limit, when the server dies under it:
/// it fails with a backend error or gets the lock after the restart, but never hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_without_a_wait_limit_never_hangs_when_the_server_dies_and_comes_back() {
    let mut srv = RedisServer::start();
    let ttl = ms(500);
    let holder = manager(&srv, LockOptions::new().ttl(ttl)).await;
    let waiter_m = manager(&srv, LockOptions::new().ttl(ttl).wait_timeout(None)).await;
    let lock = holder.lock("waiter-server-dies");
    let channel = lock.key().derived("released");
    let guard = lock
        .acquire_timeout(secs(2))
        .await
        .expect("holder acquires");
    let waiter_lock = waiter_m.lock("waiter-server-dies");
    let waiter = tokio::spawn(async move { waiter_lock.acquire().await });
    srv.wait_until(secs(3), |s| numsub(s, &channel) >= 1);

    srv.kill();
    // Down for a while (longer than the holder's TTL), then back, empty.
    tokio::time::sleep(ms(800)).await;
    srv.restart();
    let outcome = tokio::time::timeout(secs(6), waiter)
        .await
        .expect("a waiter hung across a server restart")
        .expect("waiter task");
    match outcome {
        Ok(g) => {
            assert!(!g.is_lost());
            g.release().await.expect("waiter releases");
        }
        Err(Error::Backend { .. }) => {}
        Err(e) => panic!("unexpected waiter error: {e}"),
    }
    assert!(guard.is_lost(), "the holder's lease died with the server");
}

// ---------------------------------------------------------------------------------------
// 9. Mutual exclusion with several managers while connections are killed.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_holds_across_managers_while_connections_are_killed() {
    const MANAGERS: usize = 4;
    const TASKS: usize = 4;
    const SECTIONS: usize = 200;
    let srv = Arc::new(RedisServer::start());
    let opts = LockOptions::new().ttl(ms(500));
    let checker = Checker::new();
    let entered = Arc::new(AtomicUsize::new(0));
    let acquire_errors = Arc::new(AtomicUsize::new(0));
    let release_errors = Arc::new(AtomicUsize::new(0));

    let mut tasks = Vec::new();
    for _ in 0..MANAGERS {
        let m = manager(&srv, opts.clone()).await;
        for _ in 0..TASKS {
            let lock = m.lock("contended");
            let (checker, entered) = (checker.clone(), entered.clone());
            let (acquire_errors, release_errors) = (acquire_errors.clone(), release_errors.clone());
            tasks.push(tokio::spawn(async move {
                let mut mine = 0usize;
                while entered.load(Ordering::SeqCst) < SECTIONS {
                    let guard = match lock.acquire_timeout(secs(10)).await {
                        Ok(g) => g,
                        Err(Error::Backend { .. }) => {
                            acquire_errors.fetch_add(1, Ordering::SeqCst);
                            continue;
                        }
                        Err(e) => panic!("acquire failed: {e}"),
                    };
                    let section = checker.enter(guard.fencing_token());
                    entered.fetch_add(1, Ordering::SeqCst);
                    mine += 1;
                    // The hold time is the thing being simulated.
                    tokio::time::sleep(ms(1)).await;
                    assert!(
                        !guard.is_lost(),
                        "lease lost inside a 1 ms critical section"
                    );
                    section.exit();
                    if guard.release().await.is_err() {
                        release_errors.fetch_add(1, Ordering::SeqCst);
                    }
                }
                mine
            }));
        }
    }

    let killer = {
        let srv = srv.clone();
        tokio::task::spawn_blocking(move || {
            let mut kills = 0i64;
            for i in 0..20 {
                std::thread::sleep(ms(50));
                kills += srv.kill_clients();
                if i % 3 == 0 {
                    kills += srv.kill_pubsub_clients();
                }
            }
            kills
        })
    };

    let all = tokio::time::timeout(secs(25), future::join_all(tasks))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "tasks did not finish: {} sections entered",
                entered.load(Ordering::SeqCst)
            )
        });
    let per_task: Vec<usize> = all.into_iter().map(|r| r.expect("task panicked")).collect();
    let kills = killer.await.expect("killer thread");
    checker.assert_ok();
    assert!(
        checker.sections() >= SECTIONS,
        "{} sections",
        checker.sections()
    );
    assert!(kills >= 20, "only {kills} connections killed");
    eprintln!(
        "mutual exclusion: {} sections, per task {per_task:?}, {kills} connections killed, \
         {} acquire errors retried, {} release errors",
        checker.sections(),
        acquire_errors.load(Ordering::SeqCst),
        release_errors.load(Ordering::SeqCst)
    );
}

// ---------------------------------------------------------------------------------------
// 10. Replayed commands are idempotent for the same token.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_acquire_release_and_extend_are_idempotent_for_the_same_token() {
    let srv = RedisServer::start();
    let b = backend(&srv).await;
    let key = LeaseKey::new("faults:", "replay");
    let ttl = secs(5);
    let t = Token::random();
    let ct = Claim::new(key.clone(), t.clone(), ttl);

    let first = b
        .acquire(&ct, Attempt::Once, NodeTerms::new())
        .await
        .expect("acquire");
    let replay = b
        .acquire(&ct, Attempt::Once, NodeTerms::new())
        .await
        .expect("replayed acquire");
    let (
        Acquire::Granted(Grant {
            fencing_token: f1, ..
        }),
        Acquire::Granted(Grant {
            fencing_token: f2, ..
        }),
    ) = (&first, &replay)
    else {
        panic!("a replayed acquire must report Granted: {first:?}, then {replay:?}");
    };
    assert_eq!(f1, f2, "a replay must not mint a new fencing token");
    assert_eq!(holder(&srv, key.as_str()).as_deref(), Some(t.as_str()));

    let other = Token::random();
    let co = Claim::new(key.clone(), other.clone(), ttl);
    assert!(matches!(
        b.acquire(&co, Attempt::Once, NodeTerms::new())
            .await
            .expect("rival"),
        Acquire::Held { .. }
    ));

    let lease = [Lease {
        key: &key,
        token: &t,
        ttl,
    }];
    assert!(b.extend(&lease, NodeTerms::new()).await.expect("extend")[0]
        .validity()
        .is_some());
    assert!(b
        .extend(&lease, NodeTerms::new())
        .await
        .expect("replayed extend")[0]
        .validity()
        .is_some());

    let release_t = Release::Confirmed { lease: &ct.token };
    assert_eq!(b.release(&ct, release_t).await.expect("release"), Some(0));
    assert_eq!(
        b.release(&ct, release_t).await.expect("replayed release"),
        Some(0),
        "a replayed release must still report the release"
    );
    assert!(!held(&srv, key.as_str()));
    assert_eq!(
        b.extend(&lease, NodeTerms::new())
            .await
            .expect("extend after release")[0]
            .validity(),
        None,
        "extend after release must be refused"
    );
    assert!(
        !held(&srv, key.as_str()),
        "extend after release brought the lease back"
    );
    assert_eq!(
        field(&srv, key.as_str(), "e").as_deref(),
        Some("0"),
        "extend after release touched the released lease"
    );
    assert!(
        b.release(&co, Release::Confirmed { lease: &co.token })
            .await
            .expect("rival release")
            .is_none(),
        "a token that never held the lease must not report a release"
    );

    // The next owner gets a strictly greater fencing token; the old token's replays do not
    // touch its lease.
    match b
        .acquire(&co, Attempt::Once, NodeTerms::new())
        .await
        .expect("next owner")
    {
        Acquire::Granted(Grant { fencing_token, .. }) => assert!(fencing_token > *f1),
        held => panic!("the released lock must be free: {held:?}"),
    }
    assert_eq!(
        b.extend(&lease, NodeTerms::new())
            .await
            .expect("stale extend")[0]
            .validity(),
        None
    );
    let _ = b.release(&ct, release_t).await.expect("stale release runs");
    assert_eq!(holder(&srv, key.as_str()).as_deref(), Some(other.as_str()));
    assert_eq!(
        b.release(&co, Release::Confirmed { lease: &co.token })
            .await
            .expect("release"),
        Some(0)
    );
}

/// fred re-sends a command that was in flight when its connection dropped, after the
/// reconnect, even if the server ran it already and the caller gave up on it: a dropped
/// `acquire()` then runs its clean-up first and the stale acquire second. The clean-up of an
/// attempt whose outcome is unknown is `abandon`, and the acquire script must never grant a
/// lease to an abandoned token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_acquire_arriving_after_it_was_abandoned_does_not_resurrect_the_lease() {
    let srv = RedisServer::start();
    let b = backend(&srv).await;
    let key = LeaseKey::new("faults:", "replay-after-release");
    let ttl = secs(10);
    let t = Token::random();
    let ct = Claim::new(key.clone(), t.clone(), ttl);
    assert!(matches!(
        b.acquire(&ct, Attempt::Once, NodeTerms::new())
            .await
            .expect("acquire"),
        Acquire::Granted(..)
    ));
    assert_eq!(
        b.release(&ct, Release::Abandon)
            .await
            .expect("abandon deletes the lease"),
        Some(0)
    );
    let barred = key.derived("abandoned");
    let ttl_left = pttl(&srv, &barred);
    assert!(
        ttl_left > 0 && ttl_left <= 300_000,
        "the tombstone expires: PTTL {ttl_left}"
    );
    let replay = b
        .acquire(&ct, Attempt::Once, NodeTerms::new())
        .await
        .expect("replayed acquire");
    let left = holder(&srv, key.as_str());
    assert!(
        !matches!(replay, Acquire::Granted(..)) && left.is_none(),
        "a replayed acquire after the abandon of the same token re-created the lease \
         (reply {replay:?}, holder now {left:?}, {} ms left): an orphan for a whole TTL",
        lease_ms(&srv, key.as_str())
    );
}

/// The same, in the other order the server may see the two connections' commands: the
/// clean-up release of an abandoned attempt runs before the attempt itself arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_acquire_arriving_after_its_clean_up_does_not_take_the_lease() {
    let srv = RedisServer::start();
    let b = backend(&srv).await;
    let key = LeaseKey::new("faults:", "acquire-after-cleanup");
    let ttl = secs(10);
    let t = Token::random();
    let ct = Claim::new(key.clone(), t.clone(), ttl);
    assert!(
        b.release(&ct, Release::Abandon)
            .await
            .expect("clean-up abandon")
            .is_none(),
        "nothing was held yet"
    );
    let late = b
        .acquire(&ct, Attempt::Once, NodeTerms::new())
        .await
        .expect("late acquire");
    let left = holder(&srv, key.as_str());
    assert!(
        !matches!(late, Acquire::Granted(..)) && left.is_none(),
        "an acquire arriving after its own clean-up release took the lease (reply {late:?}, \
         holder now {left:?}): an orphan for a whole TTL"
    );
    // The clean-up made the record (its `a` sends acquires to the tombstones): it expires,
    // an hour past the tombstone's five minutes (so not before the tombstone).
    let k = key.as_str();
    let a = int_field(&srv, k, "a").expect("the clean-up's `a`");
    let left = a - server_ms(&srv);
    assert!(
        (295_000..=300_000).contains(&left),
        "`a` runs for the tombstone's five minutes: {left} ms"
    );
    assert_eq!(
        int_field(&srv, k, "x"),
        Some(a + HOUR_MS),
        "the record's `x`"
    );
    let left = pttl(&srv, k);
    assert!(
        (3_895_000..=3_900_000).contains(&left),
        "record made by a clean-up: PTTL {left}"
    );
    // A record whose hour is half gone (as if written long ago: `x` and its expiry both near)
    // is kept an hour past the next tombstone.
    let soon = (server_ms(&srv) + 1000).to_string();
    assert_eq!(srv.cmd(&["HSET", k, "x", &soon]).as_int(), Some(0));
    assert_eq!(srv.cmd(&["PEXPIREAT", k, &soon]).as_int(), Some(1));
    let t2 = Token::random();
    let ct2 = Claim::new(key.clone(), t2.clone(), ttl);
    assert!(b
        .release(&ct2, Release::Abandon)
        .await
        .expect("second clean-up")
        .is_none());
    let left = pttl(&srv, k);
    assert!(
        (3_895_000..=3_900_000).contains(&left),
        "record kept an hour past the tombstone: PTTL {left}"
    );
    assert_eq!(
        int_field(&srv, k, "x"),
        int_field(&srv, k, "a").map(|a| a + HOUR_MS),
        "the record's `x` follows"
    );
    let late = b
        .acquire(&ct2, Attempt::Once, NodeTerms::new())
        .await
        .expect("late acquire");
    assert!(
        !matches!(late, Acquire::Granted(..)),
        "barred token granted: {late:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 11. Cancel safety: dropped acquire futures leave no orphan lease.
// ---------------------------------------------------------------------------------------

/// Ready at `at`; until then it wakes itself at once (a busy timer with microsecond
/// resolution, unlike tokio's millisecond wheel), so `fut` beside it is dropped precisely.
struct BusyUntil(Instant);

impl Future for BusyUntil {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.0 {
            Poll::Ready(())
        } else {
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

/// Runs `fut` until `after` has passed; `None` (and `fut` dropped) if it had not finished.
async fn drop_after<F: Future>(fut: F, after: Duration) -> Option<F::Output> {
    let deadline = Instant::now() + after;
    let fut = std::pin::pin!(fut);
    match future::select(fut, BusyUntil(deadline)).await {
        Either::Left((out, _)) => Some(out),
        Either::Right(_) => None,
    }
}

/// Polls `fut` until it has returned `Pending` `pendings + 1` times, then drops it; or
/// returns its output if it finishes first.
struct DropAfterPolls<F> {
    fut: Pin<Box<F>>,
    pendings: usize,
}

impl<F: Future> Future for DropAfterPolls<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.fut.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(Some(out)),
            Poll::Pending if self.pendings == 0 => Poll::Ready(None),
            Poll::Pending => {
                self.pendings -= 1;
                Poll::Pending
            }
        }
    }
}

fn drop_after_polls<F: Future>(fut: F, pendings: usize) -> DropAfterPolls<F> {
    DropAfterPolls {
        fut: Box::pin(fut),
        pendings,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquire_futures_leave_no_orphan_lease_on_a_free_lock() {
    let srv = RedisServer::start();
    // Long TTL: an orphan would stay visible for the whole test.
    let m = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let lock = m.lock("cancel-free");
    let key = lock.key().as_str().to_string();
    let (mut completed, mut dropped) = (0, 0);
    let mut check = |what: String, outcome: Option<redlease::Result<LockGuard>>| {
        match outcome {
            Some(Ok(g)) => {
                completed += 1;
                drop(g);
            }
            Some(Err(e)) => panic!("{what}: acquire of a free lock failed: {e}"),
            None => dropped += 1,
        }
        what
    };

    // Dropped after each successive poll.
    for pendings in 0..6 {
        for timed in [false, true] {
            let outcome = if timed {
                drop_after_polls(lock.acquire_timeout(secs(5)), pendings).await
            } else {
                drop_after_polls(lock.acquire(), pendings).await
            };
            let what = check(format!("dropped after {} polls", pendings + 1), outcome);
            assert!(
                wait_for_async(secs(3), || !held(&srv, &key)).await,
                "{what}: orphan lease left, {} ms left",
                lease_ms(&srv, &key)
            );
        }
    }
    // Dropped at points in time, 25 us apart.
    for step in 0..40u64 {
        let after = Duration::from_micros(step * 25);
        let outcome = if step % 2 == 0 {
            drop_after(lock.acquire(), after).await
        } else {
            drop_after(lock.acquire_timeout(secs(5)), after).await
        };
        let what = check(format!("dropped after {after:?}"), outcome);
        assert!(
            wait_for_async(secs(3), || !held(&srv, &key)).await,
            "{what}: orphan lease left, {} ms left",
            lease_ms(&srv, &key)
        );
    }
    // acquire_timeout's own timer cutting the attempt short.
    for step in 0..10u64 {
        match lock
            .acquire_timeout(Duration::from_micros(step * 200))
            .await
        {
            Ok(g) => drop(g),
            Err(Error::Timeout { .. }) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
        assert!(
            wait_for_async(secs(3), || !held(&srv, &key)).await,
            "acquire_timeout({:?}) left an orphan lease",
            Duration::from_micros(step * 200)
        );
    }
    eprintln!("cancel on a free lock: {completed} completed, {dropped} dropped");
    assert!(dropped >= 10, "only {dropped} futures were dropped mid-way");
    // Nothing reappears later (a delayed or replayed command).
    let other = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let g = other
        .lock("cancel-free")
        .try_acquire()
        .await
        .expect("attempt")
        .expect("no orphan lease blocks another manager");
    g.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquire_futures_leave_no_orphan_lease_when_the_holder_releases_during_the_wait() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().ttl(secs(10));
    let holder = manager(&srv, opts.clone()).await;
    let waiter_m = manager(&srv, opts).await;
    let lock = holder.lock("cancel-contended");
    let waiter_lock = waiter_m.lock("cancel-contended");
    let key = lock.key().as_str().to_string();
    let (mut completed, mut dropped) = (0, 0);

    for step in 0..24u64 {
        let guard = lock
            .acquire_timeout(secs(3))
            .await
            .expect("holder acquires");
        // The holder releases after `release_after`; the waiter is dropped around then.
        let release_after = ms(3);
        let drop_after_d = release_after + Duration::from_micros(step * 150) - ms(1);
        let releaser = tokio::spawn(async move {
            sleep_async(release_after).await;
            guard.release().await
        });
        let outcome = drop_after(waiter_lock.acquire(), drop_after_d).await;
        releaser
            .await
            .expect("releaser task")
            .expect("holder releases");
        match outcome {
            Some(Ok(g)) => {
                completed += 1;
                drop(g);
            }
            Some(Err(e)) => panic!("waiter failed: {e}"),
            None => dropped += 1,
        }
        let gone = wait_for_async(secs(3), || !held(&srv, &key)).await;
        assert!(
            gone,
            "step {step} (dropped after {drop_after_d:?}): orphan lease left, {} ms left",
            lease_ms(&srv, &key)
        );
    }
    eprintln!("cancel while contended: {completed} completed, {dropped} dropped");
    assert!(dropped > 0, "no waiter was dropped mid-way");
    let g = lock
        .try_acquire()
        .await
        .expect("attempt")
        .expect("no orphan lease blocks the lock");
    g.release().await.expect("release");
}

/// Waits cancelled at every point, including while their SUBSCRIBE is in flight, leave no
/// subscription behind: the count of local waiters goes back to zero and the channel is
/// unsubscribed (a leaked count would keep the channel subscribed with nobody waiting, and
/// after a reconnect no waiter would ever be woken on it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_leave_no_subscription_behind() {
    let srv = RedisServer::start();
    let holder = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let waiters = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let lock = holder.lock("sub-leak");
    let channel = lock.key().derived("released");
    let held = lock.acquire().await.expect("acquire");
    for i in 0..600u64 {
        let w = waiters.lock("sub-leak");
        // Cut anywhere from before the first attempt to well after the subscription.
        let cut = Duration::from_micros(i % 200 * 20);
        let _ = tokio::time::timeout(cut, w.acquire()).await;
    }
    let unsubscribed = wait_for_async(secs(5), || numsub(&srv, &channel) == 0).await;
    assert!(
        unsubscribed,
        "{} subscriptions left with no waiter",
        numsub(&srv, &channel)
    );
    // And waiting still works: a new waiter subscribes again and is woken by the release.
    let w = waiters.lock("sub-leak");
    let waiter = tokio::spawn(async move { w.acquire_timeout(secs(5)).await });
    let subscribed = wait_for_async(secs(5), || numsub(&srv, &channel) == 1).await;
    assert!(subscribed, "the new waiter subscribed");
    held.release().await.expect("release");
    let g = waiter
        .await
        .expect("waiter task")
        .expect("woken by the release");
    g.release().await.expect("release");
}

/// The fence is the larger of the counter + 1 and the server clock in µs: when the counter
/// is ahead (the server's clock stepped back, or tokens were minted faster than the clock
/// moved), tokens still go up by one each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_increasing_when_the_counter_is_ahead_of_the_clock() {
    let srv = RedisServer::start();
    let m = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    let lock = m.lock("clock-behind");
    let first = lock.acquire().await.expect("acquire");
    let t0 = first.fencing_token();
    first.release().await.expect("release");
    // As if the clock had been a year ahead when the last token was minted.
    let ahead = t0 + 365 * 24 * 3600 * 1_000_000;
    // The record's fencing counter `f` (overwritten, not added: the record is there).
    assert_eq!(
        srv.cmd(&["HSET", lock.key().as_str(), "f", &ahead.to_string()])
            .as_int(),
        Some(0)
    );
    for step in 1..=3 {
        let g = lock.acquire().await.expect("acquire");
        assert_eq!(g.fencing_token(), ahead + step);
        g.release().await.expect("release");
    }
}

/// A waiting acquire's first attempt yields to registered waiters, but a copy of it sent
/// again (after a reconnect) once it holds the lease must find its own lease, not report it
/// held by someone else (it would then stop guarding against an orphan).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_first_attempt_finds_its_own_lease_despite_waiters() {
    let srv = RedisServer::start();
    let b = backend(&srv).await;
    let key = LeaseKey::new("faults:", "resent-arriving");
    let (t, other) = (Token::random(), Token::random());
    let ct = Claim::new(key.clone(), t, secs(10));
    let co = Claim::new(key.clone(), other, secs(10));
    let arriving = Attempt::Arriving { recheck: secs(1) };
    let first = b
        .acquire(&ct, arriving, NodeTerms::new())
        .await
        .expect("acquire");
    let Acquire::Granted(Grant { fencing_token, .. }) = first else {
        panic!("free lock not granted: {first:?}");
    };
    let waiter = Attempt::Waiting { recheck: secs(1) };
    let queued = b
        .acquire(&co, waiter, NodeTerms::new())
        .await
        .expect("waiter");
    assert!(matches!(queued, Acquire::Held { .. }), "{queued:?}");
    let again = b
        .acquire(&ct, arriving, NodeTerms::new())
        .await
        .expect("re-sent");
    assert!(
        matches!(again, Acquire::Granted(Grant { fencing_token: f, .. }) if f == fencing_token),
        "the re-sent attempt did not find its own lease: {again:?}"
    );
}

/// A waiting acquire with a limit waits out a server that stops answering for a while (a
/// failover, a stall): its re-checks during the pause fail with the command timeout (200 ms),
/// and it goes on trying with back-off instead of ending with that error; once the server
/// answers again and the holder releases, the waiter gets the lock. (Before, the first failed
/// re-check ended the wait with `Error::Backend`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_with_a_limit_waits_out_a_server_that_stops_answering() {
    let srv = RedisServer::start();
    let holder = manager(&srv, LockOptions::new().ttl(secs(10))).await;
    // Re-checks every 100 ms: several fall in the pause.
    let patient = LockOptions::new()
        .ttl(secs(10))
        .retry(RetryPolicy::notify().min_delay(ms(50)).max_delay(ms(100)));
    let waiter_m = manager(&srv, patient).await;
    let held = holder
        .lock("outage-waiter")
        .try_acquire()
        .await
        .expect("acquire")
        .expect("free");
    let lock = waiter_m.lock("outage-waiter");
    let waiter = tokio::spawn(async move { lock.acquire_timeout(secs(20)).await });
    let key = held_key(&holder, "outage-waiter");
    srv.wait_until(secs(3), |s| field(s, &key, "w").is_some());
    srv.pause();
    // Long enough for re-checks to time out and for the client to drop the silent
    // connection (twice the command timeout): a stall, not a scheduling hiccup.
    tokio::time::sleep(ms(1500)).await;
    assert!(!waiter.is_finished(), "the waiter ended during the outage");
    srv.resume();
    tokio::time::timeout(secs(10), held.release())
        .await
        .expect("release hung")
        .expect("release after resume");
    let next = tokio::time::timeout(secs(15), waiter)
        .await
        .expect("the waiter finished")
        .expect("task")
        .expect("the waiter waited out the outage and got the lock");
    next.release().await.expect("release");
}

fn held_key(m: &LockManager, name: &str) -> String {
    m.lock(name).key().as_str().to_owned()
}

/// A burst of more pub/sub messages than fred buffers for the subscriber (one script call
/// publishes 50,000 on a lock channel that a waiter of this process listens to) must not end
/// the wake-ups: a later release still wakes its waiter by message, long before the fallback
/// re-check (96-120 s; the holders' leases run 300 s). fred's own `on_message` loop ends for
/// good at the first lag, after which every release woke nobody in the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_messages_does_not_end_the_wake_ups() {
    let srv = RedisServer::start();
    let opts = LockOptions::new()
        .ttl(secs(300))
        .retry(RetryPolicy::notify().max_delay(secs(120)));
    let locks = manager(&srv, opts).await;
    let holder_of_a = locks.lock("a").acquire().await.expect("a");
    let holder_of_b = locks.lock("b").acquire().await.expect("b");
    let spawn_waiter = |name: &'static str| {
        let lock = locks.lock(name);
        tokio::spawn(async move { lock.acquire_timeout(secs(30)).await })
    };
    let waiter_a = spawn_waiter("a");
    let waiter_b = spawn_waiter("b");
    // Both waiters registered (and so subscribed: a waiter registers after subscribing).
    let registered = wait_for_async(secs(10), || {
        field(&srv, "redlease:{a}", "w").is_some() && field(&srv, "redlease:{b}", "w").is_some()
    })
    .await;
    assert!(registered, "the waiters never registered");
    let burst = srv.cmd(&[
        "EVAL",
        "for i = 1, 50000 do redis.call('PUBLISH', KEYS[1], 'x') end return 1",
        "1",
        "redlease:{b}:released",
    ]);
    assert_eq!(burst.as_int(), Some(1), "{burst:?}");
    // The release's message reaches the subscriber after the whole burst (one connection
    // delivers in order), and must still wake its waiter.
    holder_of_a.release().await.expect("release a");
    // Within a bound far below the fallback re-check: woken by the release's message.
    let got = tokio::time::timeout(secs(30), waiter_a)
        .await
        .expect("the waiter was not woken by the release's message")
        .expect("task")
        .expect("waiter a got the lock");
    drop(got);
    drop(holder_of_b);
    let _ = tokio::time::timeout(secs(20), waiter_b).await;
}
