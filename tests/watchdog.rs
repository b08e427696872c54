//! One shared watchdog per manager extends every held lease in batches: the cost is a few
//! round trips per tick, not one per lease.

mod support;

use std::time::{Duration, Instant};

use redlease::{LockManager, LockOptions, MemoryBackend, RedisBackend};
use support::RedisServer;

const LEASES: usize = 1000;

/// Script calls the server has run (Redis counts the commands a script makes as commands
/// too, so `total_commands_processed` would not show the batching).
fn evalsha_calls(srv: &RedisServer) -> u64 {
    let stat = srv
        .info_field("commandstats", "cmdstat_evalsha")
        .unwrap_or_default();
    stat.split(',')
        .find_map(|kv| kv.strip_prefix("calls="))
        .map_or(0, |n| n.parse().unwrap())
}

async fn hold_many(locks: &LockManager) -> Vec<redlease::LockGuard> {
    let mut guards = Vec::with_capacity(LEASES);
    for i in 0..LEASES {
        let g = locks.lock(&format!("job:{i}")).try_acquire().await.unwrap();
        guards.push(g.expect("distinct names are free"));
    }
    guards
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_leases_cost_a_few_round_trips_per_tick() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().ttl(Duration::from_millis(900)); // extended every 300 ms
    let locks =
        LockManager::with_options(RedisBackend::connect(&srv.url()).await.unwrap(), opts).unwrap();
    let guards = hold_many(&locks).await;

    let before = locks.watchdog_stats();
    let cmds_before = evalsha_calls(&srv);
    let began = Instant::now();
    // Several TTLs pass: that is the point of the test, not synchronisation.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let elapsed = began.elapsed();
    let after = locks.watchdog_stats();
    let cmds = evalsha_calls(&srv) - cmds_before;

    let rounds = after.rounds - before.rounds;
    let extended = after.extended - before.extended;
    eprintln!(
        "{LEASES} leases over {elapsed:?}: {rounds} watchdog rounds, {extended} extensions, \
         {cmds} script calls ({:.1}/s)",
        cmds as f64 / elapsed.as_secs_f64()
    );
    assert!(rounds >= 2, "the watchdog ran {rounds} rounds");
    assert!(
        extended >= 2 * LEASES as u64,
        "every lease extended each round: {extended}"
    );
    // All leases ride in the same rounds...
    assert!(
        extended / rounds >= LEASES as u64 / 2,
        "{extended} extensions in {rounds} rounds"
    );
    // ...and one round is ceil(1000 / 256) = 4 pipelined script calls, not 1000 (one more
    // round may straddle the start of the window).
    assert!(
        cmds <= (rounds + 1) * 4,
        "{cmds} script calls for {rounds} rounds"
    );
    assert_eq!(after.leases, LEASES);
    assert!(guards.iter().all(|g| !g.is_lost()));
    // Every key is still there after 2+ TTLs.
    let key = locks.lock("job:0").key().as_str().to_owned();
    assert_eq!(srv.cmd(&["EXISTS", &key]).as_int(), Some(1));

    drop(guards);
    let locks2 = locks.clone();
    assert!(
        support::wait_for_async(Duration::from_secs(10), move || locks2
            .watchdog_stats()
            .leases
            == 0)
        .await,
        "dropped guards leave the watchdog"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_backend_batches_the_same_way() {
    let opts = LockOptions::new().ttl(Duration::from_millis(300));
    let locks = LockManager::with_options(MemoryBackend::new(), opts).unwrap();
    let guards = hold_many(&locks).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let s = locks.watchdog_stats();
    assert!(
        s.rounds >= 1 && s.extended / s.rounds >= LEASES as u64 / 2,
        "{s:?}"
    );
    assert!(guards.iter().all(|g| !g.is_lost()));
}

/// The watchdog task stops when nothing is held and starts again on the next acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_restarts_after_going_idle() {
    let opts = LockOptions::new().ttl(Duration::from_millis(100));
    let locks = LockManager::with_options(MemoryBackend::new(), opts).unwrap();
    for _ in 0..3 {
        let g = locks.lock("idle").acquire().await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(!g.is_lost(), "extended across 2.5 TTLs");
        g.release().await.unwrap();
        let l = locks.clone();
        assert!(
            support::wait_for_async(Duration::from_secs(5), move || l.watchdog_stats().leases
                == 0)
            .await
        );
    }
}
