//! The PostgreSQL store's own tests, on a PostgreSQL 15 server each test starts: faults (a
//! killed and restarted server while a lock is held and while a waiter waits, a paused server,
//! the listener's connection terminated, a connection dropped mid-grant, fences across a
//! restart and a wiped database), the schema made on first use by two backends at once, bad
//! input, and a backend over an application's pool.
//!
//! Every wait is bounded: a hang is a failure, never a stuck test run.

mod support;

use std::sync::Arc;
use std::time::Duration;

use redlease::backend::{clock_drift, Acquire, Attempt, Backend, Claim, NodeTerms, Release};
use redlease::{
    Error, LeaseKey, LockManager, LockOptions, PostgresBackend, PostgresOptions, Token,
};
use support::{wait_for_async, within, PgServer, SOON};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Short timeouts, so that faults surface within a fraction of a second.
fn fast() -> PostgresOptions {
    PostgresOptions::new()
        .command_timeout(ms(300))
        .connect_timeout(ms(500))
}

async fn manager(srv: &PgServer, opts: LockOptions) -> LockManager {
    LockManager::with_options(srv.backend_with(fast()).await, opts).expect("valid options")
}

fn claim(name: &str, ttl: Duration) -> Claim {
    Claim::new(LeaseKey::new("t:", name), Token::random(), ttl)
}

async fn granted(b: &PostgresBackend, c: &Claim) -> u64 {
    match b.acquire(c, Attempt::Once, NodeTerms::new()).await {
        Ok(Acquire::Granted(g)) => g.fencing_token,
        other => panic!("{:?}: expected a grant, got {other:?}", c.key),
    }
}

async fn held(b: &PostgresBackend, name: &str) -> bool {
    b.inspect(&LeaseKey::new("t:", name))
        .await
        .expect("inspect")
        .is_some_and(|i| i.held)
}

/// The pids of the server processes running `LISTEN` (the backends' listeners).
fn listeners(srv: &PgServer) -> Vec<String> {
    let out = srv.psql(
        "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()",
    );
    out.lines()
        .map(str::to_owned)
        .filter(|l| !l.is_empty())
        .collect()
}

/// Retries `try_acquire` until it is granted, through errors of a reconnecting client.
async fn take_soon(lock: &redlease::Lock) -> redlease::LockGuard {
    within("take the lock", async {
        loop {
            if let Ok(Some(g)) = lock.try_acquire().await {
                return g;
            }
            // Bounded polling of a reconnecting client, not synchronisation.
            tokio::time::sleep(ms(20)).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_survives_a_server_restart_and_a_waiter_is_still_woken() {
    let srv = PgServer::start();
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .wait_timeout(Some(Duration::from_secs(20)));
    let a = manager(&srv, opts.clone()).await;
    let b = manager(&srv, opts).await;
    let guard = a.lock("r").acquire().await.unwrap();
    let fence = guard.fencing_token();
    let waiter = tokio::spawn({
        let lock = b.lock("r");
        async move { lock.acquire().await }
    });
    // The waiter is registered (the row says so) before the server goes.
    within("the waiter registers", async {
        while srv.psql("SELECT count(*) FROM redlease_lock WHERE waiters_until > clock_timestamp()")
            != "1"
        {
            tokio::time::sleep(ms(10)).await;
        }
    })
    .await;
    srv.restart();
    // Durable: the lease is there after the restart, and the holder keeps it.
    let other = manager(&srv, LockOptions::new()).await;
    assert!(other.lock("r").try_acquire().await.unwrap().is_none());
    guard.extend(Duration::from_secs(5)).await.unwrap();
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
    let next = within("the waiter's grant", waiter).await.unwrap().unwrap();
    assert!(next.fencing_token() > fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_past_the_ttl_makes_the_holder_lost_and_fences_go_on_rising() {
    let srv = PgServer::start();
    let opts = LockOptions::new().ttl(ms(600));
    let a = manager(&srv, opts.clone()).await;
    let guard = a.lock("d").acquire().await.unwrap();
    let fence = guard.fencing_token();
    srv.kill();
    within("lost() after the TTL", guard.lost()).await;
    srv.restart();
    let b = manager(&srv, opts).await;
    let next = take_soon(&b.lock("d")).await;
    assert!(
        next.fencing_token() > fence,
        "{} after {fence}",
        next.fencing_token()
    );
    // The old holder's late release does not touch the new owner.
    assert!(guard.release().await.is_err());
    assert!(b.lock("d").try_acquire().await.unwrap().is_none());
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_makes_the_holder_lost_and_nothing_hangs() {
    let srv = PgServer::start();
    let opts = LockOptions::new().ttl(ms(600));
    let a = manager(&srv, opts.clone()).await;
    let guard = a.lock("p").acquire().await.unwrap();
    srv.pause();
    within("lost() while paused", guard.lost()).await;
    // Calls fail within the command timeout, never hang.
    let err = within("try_acquire on a paused server", a.lock("q").try_acquire())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    // A server that accepts the socket and never answers: a connect fails in time too.
    let err = within(
        "connect to a paused server",
        PostgresBackend::connect_with(&srv.url(), fast()),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    srv.resume();
    let b = manager(&srv, opts).await;
    let next = take_soon(&b.lock("p")).await;
    assert!(next.fencing_token() > guard.fencing_token());
    assert!(guard.release().await.is_err());
    assert!(b.lock("p").try_acquire().await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_after_its_listener_connection_is_terminated() {
    let srv = PgServer::start();
    let a = srv.backend_with(fast()).await;
    let b = srv.backend_with(fast()).await;
    let holder = claim("l", Duration::from_secs(10));
    let waiter = claim("l", Duration::from_secs(10));
    granted(&a, &holder).await;
    let wait = Attempt::Waiting {
        recheck: Duration::from_secs(10),
    };
    assert!(matches!(
        b.acquire(&waiter, wait, NodeTerms::new()).await.unwrap(),
        Acquire::Held { .. }
    ));
    let sub = b.subscribe(&waiter).await.unwrap();
    let woken = sub.listen();
    // Each backend's listener connects in the background: both are up before they are cut.
    assert!(
        wait_for_async(SOON, || listeners(&srv).len() == 2).await,
        "one listener per backend: {:?}",
        listeners(&srv)
    );
    let before = listeners(&srv);
    for pid in &before {
        srv.psql(&format!("SELECT pg_terminate_backend({pid})"));
    }
    // Released while the listeners are (or may be) down: the notification may be lost, and
    // the waiter is woken by its listener's reconnect then.
    a.release(
        &holder,
        Release::Confirmed {
            lease: &holder.token,
        },
    )
    .await
    .unwrap();
    within("the waiter's wake-up", woken).await;
    assert!(matches!(
        b.acquire(&waiter, wait, NodeTerms::new()).await.unwrap(),
        Acquire::Granted(_)
    ));
    // Listening again, and a later release is heard as before.
    within("the listeners come back", async {
        while listeners(&srv).len() < 2 {
            tokio::time::sleep(ms(10)).await;
        }
    })
    .await;
    let third = claim("l", Duration::from_secs(10));
    assert!(matches!(
        a.acquire(&third, wait, NodeTerms::new()).await.unwrap(),
        Acquire::Held { .. }
    ));
    let sub = a.subscribe(&third).await.unwrap();
    let woken = sub.listen();
    b.release(
        &waiter,
        Release::Confirmed {
            lease: &waiter.token,
        },
    )
    .await
    .unwrap();
    within("the third's wake-up", woken).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disturbed_resolves_when_the_listener_reconnects() {
    let srv = PgServer::start();
    let b = srv.backend_with(fast()).await;
    // Subscribed once: the listener is up.
    b.subscribe(&claim("x", Duration::from_secs(1)))
        .await
        .unwrap();
    let disturbed = b.disturbed();
    for pid in listeners(&srv) {
        srv.psql(&format!("SELECT pg_terminate_backend({pid})"));
    }
    within("disturbed()", disturbed).await;
}

/// A grant still running on the server when its client's connection dropped commits later
/// (the server notices a closed socket only when it next writes): the abandon that follows
/// must leave no lease to the dead claim, whichever of the two gets the row first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_connection_dropped_leaves_no_lease_once_abandoned() {
    let srv = PgServer::start();
    let b = srv
        .backend_with(PostgresOptions::new().command_timeout(Duration::from_secs(5)))
        .await;
    let first = claim("m", Duration::from_secs(10));
    let first_fence = granted(&b, &first).await;
    b.release(
        &first,
        Release::Confirmed {
            lease: &first.token,
        },
    )
    .await
    .unwrap();
    // Another session holds the name's row, so that the grant below waits for it.
    let (blocker, conn) = tokio_postgres::connect(&srv.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    blocker
        .batch_execute(
            "BEGIN; SELECT * FROM redlease_lock WHERE key = convert_to('t:{m}', 'UTF8') FOR UPDATE",
        )
        .await
        .unwrap();
    // The dying client: sends the grant, then its connection goes.
    let late = Token::random();
    let (dying, conn) = tokio_postgres::connect(&srv.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let driver = tokio::spawn(conn);
    let sent = {
        let late = late.as_str().to_owned();
        tokio::spawn(async move {
            let _ = dying
                .query(
                    "SELECT * FROM redlease_acquire(convert_to('t:{m}', 'UTF8'), $1, 'p', NULL, \
                     0, 10000, 0, false, 0, NULL, 1)",
                    &[&late],
                )
                .await;
        })
    };
    within("the late grant waits for the row", async {
        while srv.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            != "1"
        {
            tokio::time::sleep(ms(10)).await;
        }
    })
    .await;
    sent.abort();
    driver.abort();
    // The engine gives the attempt up: an abandon, which also waits for the row.
    let abandoned = Claim::new(LeaseKey::new("t:", "m"), late, Duration::from_secs(10));
    let abandon = {
        let b = b.clone();
        let c = abandoned.clone();
        tokio::spawn(async move { b.release(&c, Release::Abandon).await })
    };
    blocker.batch_execute("COMMIT").await.unwrap();
    within("the abandon", abandon).await.unwrap().unwrap();
    // Whichever of the two had the row first, the late copy has run once nothing waits.
    within("the late copy ends", async {
        while srv.psql(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%redlease_acquire%' \
             AND state = 'active' AND pid <> pg_backend_pid()",
        ) != "0"
        {
            tokio::time::sleep(ms(10)).await;
        }
    })
    .await;
    assert!(!held(&b, "m").await, "a lease leaked to the dropped claim");
    // Granted then ended by the abandon (the fence rose), or refused as barred.
    let info = b.inspect(&LeaseKey::new("t:", "m")).await.unwrap().unwrap();
    assert!(info.fencing_token.unwrap() >= first_fence, "{info:?}");
    // The late copy, run again now, is refused too.
    assert!(matches!(
        b.acquire(&abandoned, Attempt::Once, NodeTerms::new())
            .await
            .unwrap(),
        Acquire::Held { .. }
    ));
    assert!(!held(&b, "m").await);
}

/// Send order: a late copy of an acquire sent before its token's release is not granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_of_an_acquire_sent_before_its_release_is_not_granted() {
    let srv = PgServer::start();
    let b = srv.backend().await;
    let c = claim("s", Duration::from_secs(10));
    granted(&b, &c).await;
    b.release(&c, Release::Confirmed { lease: &c.token })
        .await
        .unwrap();
    // The copy carries the first send number there is: sent before the release.
    let late = srv.psql(&format!(
        "SELECT code FROM redlease_acquire(convert_to('t:{{s}}', 'UTF8'), '{}', 'p', NULL, 0, \
         10000, 0, false, 0, NULL, 0)",
        c.token.as_str()
    ));
    assert_eq!(late, "0");
    assert!(!held(&b, "s").await);
    // A re-sent release of the confirmed claim still answers "ours".
    assert_eq!(
        b.release(&c, Release::Confirmed { lease: &c.token })
            .await
            .unwrap(),
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_never_go_backwards_across_a_restart_or_a_wiped_database() {
    let srv = PgServer::start();
    let b = srv.backend().await;
    let first = granted(&b, &claim("f", Duration::from_secs(10))).await;
    srv.restart();
    let b = srv.backend().await;
    let second = within("a grant after the restart", async {
        loop {
            if let Ok(Acquire::Granted(g)) = b
                .acquire(
                    &claim("f2", Duration::from_secs(10)),
                    Attempt::Once,
                    NodeTerms::new(),
                )
                .await
            {
                return g.fencing_token;
            }
            tokio::time::sleep(ms(20)).await;
        }
    })
    .await;
    assert!(second > first, "{second} after {first}");
    // Everything gone (a database restored or made again): the server clock still rises.
    // The backend in use makes the schema again (its first call after the wipe fails).
    srv.psql("DROP TABLE redlease_lock, redlease_barred, redlease_meta CASCADE");
    let third = within("a grant after the wipe", async {
        loop {
            if let Ok(Acquire::Granted(g)) = b
                .acquire(
                    &claim("f", Duration::from_secs(10)),
                    Attempt::Once,
                    NodeTerms::new(),
                )
                .await
            {
                return g.fencing_token;
            }
            tokio::time::sleep(ms(20)).await;
        }
    })
    .await;
    assert!(third > second, "{third} after {second}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_backends_create_the_schema_at_once() {
    let srv = PgServer::start();
    let opts = || PostgresOptions::new().schema("locks").table_prefix("x_");
    let url = srv.url();
    let (a, b) = futures::join!(
        PostgresBackend::connect_with(&url, opts()),
        PostgresBackend::connect_with(&url, opts())
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let c = claim("s", Duration::from_secs(10));
    granted(&a, &c).await;
    assert!(matches!(
        b.acquire(
            &claim("s", Duration::from_secs(10)),
            Attempt::Once,
            NodeTerms::new()
        )
        .await
        .unwrap(),
        Acquire::Held { .. }
    ));
    assert_eq!(srv.psql("SELECT version FROM locks.x_meta"), "1");
    assert_eq!(srv.psql("SELECT count(*) FROM locks.x_lock"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_and_an_unreachable_server_is_an_error() {
    for url in [
        "redis://127.0.0.1/",
        "postgres://127.0.0.1:notaport/db",
        "nonsense",
    ] {
        let err = PostgresBackend::connect(url).await.unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{url}: {err:?}");
    }
    for opts in [
        PostgresOptions::new().schema("Bad-Name"),
        PostgresOptions::new().table_prefix(""),
        PostgresOptions::new().table_prefix("x\"; DROP TABLE y; --"),
        PostgresOptions::new().command_timeout(Duration::ZERO),
    ] {
        let err = PostgresBackend::connect_with("postgres://postgres@127.0.0.1/postgres", opts)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    }
    // TLS demanded of a backend whose connections are plain: named, not an unreachable server.
    let err = PostgresBackend::connect("postgres://postgres@127.0.0.1/postgres?sslmode=require")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported(m) if m.contains("sslmode")),
        "{err:?}"
    );
    // Nothing listens on a port of a server that was stopped.
    let srv = PgServer::start();
    let url = srv.url();
    srv.kill();
    let err = within(
        "connect to a dead server",
        PostgresBackend::connect_with(&url, fast()),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    // A TTL past the cap is refused before anything is sent.
    let srv = PgServer::start();
    let b = srv.backend().await;
    let long = claim("t", Duration::from_secs(400 * 24 * 3600));
    let err = b
        .acquire(&long, Attempt::Once, NodeTerms::new())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_over_an_application_pool() {
    let srv = PgServer::start();
    let config: tokio_postgres::Config = srv.url().parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config.clone(), tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(4)
        .build()
        .unwrap();
    let store = PostgresBackend::from_pool(pool, config, PostgresOptions::new())
        .await
        .unwrap();
    let a = LockManager::new(Arc::new(store.clone()));
    let b = LockManager::new(Arc::new(store));
    let guard = a.lock("pool").acquire().await.unwrap();
    let waiter = tokio::spawn({
        let lock = b.lock("pool");
        async move { lock.acquire().await }
    });
    guard.release().await.unwrap();
    let next = within("the waiter's grant", waiter).await.unwrap().unwrap();
    assert!(next.fencing_token() > 0);
    let fence = next.fencing_token();
    next.release().await.unwrap();
    // The tables dropped under the pool (a database restored or made again): a call fails,
    // and a later one makes the schema again (it was made once for the pool's life before).
    srv.psql("DROP TABLE redlease_lock, redlease_barred, redlease_meta CASCADE");
    let again = within("a grant after the wipe", async {
        loop {
            if let Ok(Some(g)) = a.lock("pool").try_acquire().await {
                return g;
            }
            tokio::time::sleep(ms(20)).await;
        }
    })
    .await;
    assert!(again.fencing_token() > fence, "fences rise after the wipe");
}

/// A name too long for a notification's payload (10 KB): its release still wakes the waiter
/// (every local waiter is woken then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_a_very_long_name_wakes_its_waiter() {
    let srv = PgServer::start();
    let a = srv.backend().await;
    let b = srv.backend().await;
    let name = "n".repeat(10 * 1024);
    let holder = claim(&name, Duration::from_secs(10));
    let waiter = claim(&name, Duration::from_secs(10));
    granted(&a, &holder).await;
    let wait = Attempt::Waiting {
        recheck: Duration::from_secs(10),
    };
    assert!(matches!(
        b.acquire(&waiter, wait, NodeTerms::new()).await.unwrap(),
        Acquire::Held { .. }
    ));
    let sub = b.subscribe(&waiter).await.unwrap();
    let woken = sub.listen();
    a.release(
        &holder,
        Release::Confirmed {
            lease: &holder.token,
        },
    )
    .await
    .unwrap();
    within("the waiter's wake-up", woken).await;
    assert!(matches!(
        b.acquire(&waiter, wait, NodeTerms::new()).await.unwrap(),
        Acquire::Granted(_)
    ));
}

/// A grant and an extension promise the TTL less the drift margin, as on every store: the
/// server ends the lease on its own clock, the holder counts from the call's start on its
/// own. (The full TTL was promised: a server clock running 1 % fast ended a 60 s lease
/// 0.6 s before its holder's deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_is_the_ttl_less_the_drift_margin() {
    let srv = PgServer::start();
    let b = srv.backend().await;
    let ttl = Duration::from_secs(60);
    let c = claim("validity", ttl);
    let Acquire::Granted(g) = b
        .acquire(&c, Attempt::Once, NodeTerms::new())
        .await
        .expect("acquire")
    else {
        panic!("the name is free");
    };
    assert_eq!(g.validity, ttl - clock_drift(ttl));
    let ext = b
        .extend(&[c.lease(&g.lease)], NodeTerms::new())
        .await
        .expect("extend");
    assert_eq!(ext[0].validity(), Some(ttl - clock_drift(ttl)));
}

/// `raise_fence` raises the counter (never lowers it): the next grant mints above it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raise_fence_raises_the_next_token_and_never_lowers_it() {
    let srv = PgServer::start();
    let b = srv.backend().await;
    let key = LeaseKey::new("t:", "r");
    let far = 1u64 << 60;
    b.raise_fence(&key, far).await.unwrap();
    b.raise_fence(&key, 5).await.unwrap();
    let c = claim("r", Duration::from_secs(10));
    assert_eq!(granted(&b, &c).await, far + 1);
    assert!(
        !b.capabilities().node,
        "one logical store: not a Redlock node"
    );
}

/// Outside any runtime (a plain executor): the client's tasks run on the crate's own runtime,
/// and a waiter is woken by a release as on tokio.
#[test]
fn works_outside_a_tokio_runtime() {
    let srv = PgServer::start();
    let url = srv.url();
    futures::executor::block_on(async {
        let a = LockManager::new(PostgresBackend::connect(&url).await.unwrap());
        let b = LockManager::new(PostgresBackend::connect(&url).await.unwrap());
        let held = a.lock("off").acquire().await.unwrap();
        assert!(b.lock("off").try_acquire().await.unwrap().is_none());
        let waiter = b.lock("off");
        let waiting = async move { waiter.acquire_timeout(Duration::from_secs(10)).await };
        let release = async move { held.release().await };
        let (got, released) = futures::join!(waiting, release);
        released.unwrap();
        got.unwrap().release().await.unwrap();
    });
}

/// On smol: the same.
#[cfg(feature = "smol")]
#[test]
fn works_on_smol() {
    let srv = PgServer::start();
    let url = srv.url();
    smol::block_on(async {
        let a = LockManager::new(PostgresBackend::connect(&url).await.unwrap());
        let b = LockManager::new(PostgresBackend::connect(&url).await.unwrap());
        let held = a.lock("smol").acquire().await.unwrap();
        let waiter = smol::spawn({
            let lock = b.lock("smol");
            async move { lock.acquire_timeout(Duration::from_secs(10)).await }
        });
        held.release().await.unwrap();
        waiter.await.unwrap().release().await.unwrap();
    });
}

// ---------------------------------------------------------------------------------------
// The stampede cache on PostgreSQL.
// ---------------------------------------------------------------------------------------

mod cache {
    use super::*;
    use redlease::{Cache, CacheOptions};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::watch;

    const TTL: Duration = Duration::from_secs(30);

    /// `n` caches, each over a backend of its own (as separate processes), and those
    /// backends.
    async fn caches_over(srv: &PgServer, n: usize) -> (Vec<Cache>, Vec<PostgresBackend>) {
        let (mut caches, mut backends) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let opts = CacheOptions::new().wait_timeout(support::SOON);
            let backend = srv.backend().await;
            caches.push(Cache::with_options(backend.clone(), opts).unwrap());
            backends.push(backend);
        }
        (caches, backends)
    }

    async fn caches(srv: &PgServer, n: usize) -> Vec<Cache> {
        caches_over(srv, n).await.0
    }

    /// The value stored for `key`, read from the table.
    fn stored(srv: &PgServer, key: &str) -> String {
        let hex: String = LeaseKey::new("redlease:cache:", key)
            .as_str()
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect();
        srv.psql(&format!(
            "SELECT convert_from(payload, 'UTF8') FROM redlease_value \
             WHERE key = decode('{hex}', 'hex')"
        ))
    }

    #[derive(Debug, thiserror::Error)]
    enum AppError {
        #[error("origin down: {0}")]
        Origin(String),
        #[error(transparent)]
        Cache(#[from] Error),
    }

    /// Callers in three caches (three processes) while one computes: the origin is called
    /// once, every caller gets its value, and a later call reads it from the table.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_in_three_processes_call_the_origin_once() {
        let srv = PgServer::start();
        let caches = caches(&srv, 3).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let (open, gate) = watch::channel(false);
        let load = |calls: Arc<AtomicUsize>, mut gate: watch::Receiver<bool>| {
            move || async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let _ = gate.wait_for(|o| *o).await;
                "fresh"
            }
        };
        let first = tokio::spawn({
            let (c, l) = (caches[0].clone(), load(calls.clone(), gate.clone()));
            async move { c.get_with("hot", TTL, l).await }
        });
        within("the first loader starts", async {
            while calls.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(ms(5)).await;
            }
        })
        .await;
        // The lease is held while the origin is shut: the others wait on its round.
        let mut others = Vec::new();
        for i in 0..20 {
            let (c, l) = (caches[1 + i % 2].clone(), load(calls.clone(), gate.clone()));
            others.push(tokio::spawn(async move { c.get_with("hot", TTL, l).await }));
        }
        within("the callers join", async {
            while caches[1].stats().calls + caches[2].stats().calls < 20 {
                tokio::time::sleep(ms(5)).await;
            }
        })
        .await;
        open.send_replace(true);
        assert_eq!(
            &within("the first", first).await.unwrap().unwrap()[..],
            b"fresh"
        );
        for t in others {
            assert_eq!(&within("a waiter", t).await.unwrap().unwrap()[..], b"fresh");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one origin call");
        assert_eq!(caches[1].stats().loads + caches[2].stats().loads, 0);
        assert_eq!(stored(&srv, "hot"), "fresh");
        let again = caches[2]
            .get_with("hot", TTL, || async { "unused" })
            .await
            .unwrap();
        assert_eq!(&again[..], b"fresh");
    }

    /// A failed round reaches the callers waiting on it in another process as its message,
    /// and the next call computes again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_origin_error_reaches_the_other_process_and_the_next_call_retries() {
        let srv = PgServer::start();
        let (caches, backends) = caches_over(&srv, 2).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let (open, gate) = watch::channel(false);
        let failing = |calls: Arc<AtomicUsize>, mut gate: watch::Receiver<bool>| {
            move || async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let _ = gate.wait_for(|o| *o).await;
                Err::<&'static str, _>(AppError::Origin("connection refused".into()))
            }
        };
        let first = tokio::spawn({
            let (c, l) = (caches[0].clone(), failing(calls.clone(), gate.clone()));
            async move { c.try_get_with("q", TTL, l).await }
        });
        within("the loader starts", async {
            while calls.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(ms(5)).await;
            }
        })
        .await;
        let other = tokio::spawn({
            let (c, l) = (caches[1].clone(), failing(calls.clone(), gate.clone()));
            async move { c.try_get_with("q", TTL, l).await }
        });
        // The other caller has read the held lease and waits for the round's end.
        within("the other caller waits on the round", async {
            while backends[1].subscribed_keys() == 0 {
                tokio::time::sleep(ms(5)).await;
            }
        })
        .await;
        open.send_replace(true);
        let err = within("the first", first).await.unwrap().unwrap_err();
        assert!(matches!(&*err, AppError::Origin(_)), "{err:?}");
        let err = within("the other", other).await.unwrap().unwrap_err();
        match &*err {
            AppError::Cache(Error::LoadFailed { message }) => {
                assert_eq!(message, "origin down: connection refused")
            }
            other => panic!("expected the remote round's error, got {other:?}"),
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let v = caches[1]
            .try_get_with("q", TTL, || async { Ok::<_, AppError>("rows") })
            .await
            .unwrap();
        assert_eq!(&v[..], b"rows");
    }

    /// A loader whose lease was lost cannot overwrite the value a later round wrote.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_loader_that_lost_its_lease_cannot_overwrite_the_newer_value() {
        let srv = PgServer::start();
        let caches = caches(&srv, 2).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let (open, mut gate) = watch::channel(false);
        let old = tokio::spawn({
            let (c, calls) = (caches[0].clone(), calls.clone());
            async move {
                c.get_with("f", TTL, move || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|o| *o).await;
                    "old"
                })
                .await
            }
        });
        within("the slow loader starts", async {
            while calls.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(ms(5)).await;
            }
        })
        .await;
        // Its lease is gone (as after a long pause); another process writes a newer value.
        srv.psql("UPDATE redlease_lock SET token = NULL, expires_at = NULL");
        let v = caches[1]
            .get_with("f", TTL, || async { "new" })
            .await
            .unwrap();
        assert_eq!(&v[..], b"new");
        open.send_replace(true);
        let v = within("the late loader", old).await.unwrap().unwrap();
        assert_eq!(
            &v[..],
            b"new",
            "fenced out: its callers get the stored value"
        );
        assert_eq!(stored(&srv, "f"), "new");
    }
}
