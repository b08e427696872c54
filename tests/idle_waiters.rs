//! Idle waiters cost the store next to nothing: the waiters of one lock in one process share
//! one fallback re-check, and the others are woken by the store's messages. A waiter that
//! leaves the re-checking to the others hands its turn on, so a crashed holder's lease is
//! still taken when it runs out.

mod support;

use std::time::{Duration, Instant};

use redlease::{LockManager, LockOptions, RedisBackend};
use support::{wait_for_async, RedisServer};

async fn manager(srv: &RedisServer, ttl: Duration) -> LockManager {
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    LockManager::with_options(backend, LockOptions::new().ttl(ttl)).expect("options")
}

/// Waits until the first waiter (spawned when the server had run `scripts` script calls) has
/// made its first attempt, subscribed, and made the attempt after it: it pauses, re-checking
/// for the others, from now on.
async fn first_waiter_pauses(srv: &RedisServer, scripts: u64) {
    assert!(
        wait_for_async(Duration::from_secs(5), || srv.command_calls("subscribe")
            >= 1
            && srv.script_calls() >= scripts + 2)
        .await,
        "the first waiter is waiting"
    );
}

/// 2,000 tasks wait on one held lock: over 3 s the server runs a few dozen commands (the
/// holder's extensions and one shared re-check a second), not one re-check per waiter and
/// second (about 6,000 attempts and 30,000 commands before). When the holder lets go, every
/// waiter gets the lock in turn, each woken by a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_idle_waiters_cost_one_recheck() {
    const WAITERS: usize = 2_000;
    let srv = RedisServer::start();
    let holder = manager(&srv, Duration::from_secs(30)).await;
    let waiters = manager(&srv, Duration::from_secs(30)).await;
    let held = holder.lock("idle").acquire().await.expect("acquire");
    let tasks: Vec<_> = (0..WAITERS)
        .map(|_| {
            let lock = waiters.lock("idle");
            tokio::spawn(async move {
                let g = lock.acquire_timeout(Duration::from_secs(60)).await?;
                g.release().await
            })
        })
        .collect();
    // The waiters' first attempts are over once a measured half second sees few commands
    // (before the change that never happened: each waiter re-checked every second).
    let settling = Instant::now();
    loop {
        let before = srv.total_commands();
        support::sleep_async(Duration::from_millis(500)).await;
        if srv.total_commands() - before < 50 {
            break;
        }
        assert!(
            settling.elapsed() < Duration::from_secs(30),
            "the waiters never stopped re-checking"
        );
    }
    let started = Instant::now();
    let before = srv.total_commands();
    // A window of idle waiting, measured: not a synchronisation.
    support::sleep_async(Duration::from_secs(3)).await;
    let commands = srv.total_commands() - before;
    let window = started.elapsed().as_secs_f64();
    let per_second = commands as f64 / window;
    assert!(
        per_second < 100.0,
        "{WAITERS} idle waiters cost {per_second:.0} commands/s ({commands} in {window:.1} s)"
    );
    held.release().await.expect("release");
    for t in tasks {
        assert_eq!(
            t.await.expect("task").expect("every waiter gets the lock"),
            0
        );
    }
}

/// The waiter that re-checks for the others gives up (its time limit passes) while the
/// holder has crashed (its lease is never released, only runs out): the remaining waiter
/// takes the turn over and gets the lock when the lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rechecker_that_leaves_hands_its_turn_on() {
    let srv = RedisServer::start();
    let holder = manager(&srv, Duration::from_millis(1500)).await;
    let waiters = manager(&srv, Duration::from_secs(30)).await;
    let lock = holder.lock("handover");
    let crashed = lock.acquire().await.expect("acquire");
    // First waiter: it re-checks for this process, and leaves after 300 ms.
    let scripts = srv.script_calls();
    let first = tokio::spawn({
        let lock = waiters.lock("handover");
        async move { lock.acquire_timeout(Duration::from_millis(300)).await }
    });
    first_waiter_pauses(&srv, scripts).await;
    let second = tokio::spawn({
        let lock = waiters.lock("handover");
        async move { lock.acquire_timeout(Duration::from_secs(10)).await }
    });
    // The holder crashes: its lease is no longer extended, and never released.
    crashed.forget();
    assert!(matches!(
        first.await.expect("task"),
        Err(redlease::Error::Timeout { .. })
    ));
    let got = second
        .await
        .expect("task")
        .expect("the second waiter gets the lock when the crashed lease runs out");
    assert!(!got.is_lost());
}

/// The handover is not lost when the waiter that receives it leaves before taking the turn:
/// the re-checker gives up; the waiter woken by its handover gets the lock (the crashed
/// holder's lease ran out) and then crashes too; the other waiter must still get the lock
/// when that lease runs out, though no release ever wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_received_by_a_waiter_that_leaves_is_passed_on() {
    let srv = RedisServer::start();
    let holder = manager(&srv, Duration::from_secs(10)).await;
    let waiters = manager(&srv, Duration::from_millis(800)).await;
    let crashed = holder.lock("passed-on").acquire().await.expect("acquire");
    let scripts = srv.script_calls();
    // The re-checker: told the lease has 10 s left, it pauses a whole re-check interval
    // (about a second), and gives up before that.
    let first = tokio::spawn({
        let lock = waiters.lock("passed-on");
        async move { lock.acquire_timeout(Duration::from_millis(400)).await }
    });
    first_waiter_pauses(&srv, scripts).await;
    // Two more waiters: each crashes holding the lock once it gets it, so only a re-check
    // (never a release) lets the other one in.
    let crash_holding = || {
        let lock = waiters.lock("passed-on");
        tokio::spawn(async move {
            let g = lock.acquire_timeout(Duration::from_secs(10)).await?;
            Ok::<_, redlease::Error>(g.forget())
        })
    };
    let (second, third) = (crash_holding(), crash_holding());
    // The holder crashes with 50 ms left: when the re-checker leaves, the lock is free, and
    // the waiter its handover wakes is granted at once.
    crashed
        .extend(Duration::from_millis(50))
        .await
        .expect("extend");
    crashed.forget();
    assert!(matches!(
        first.await.expect("task"),
        Err(redlease::Error::Timeout { .. })
    ));
    for (name, w) in [("second", second), ("third", third)] {
        w.await
            .expect("task")
            .unwrap_or_else(|e| panic!("the {name} waiter never got the lock: {e:?}"));
    }
}
