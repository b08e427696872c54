//! What a lock cycle costs Redis, counted rather than timed: the commands the scripts run per
//! acquire + release (each `redis.call` from Lua costs far more than the command itself, so
//! their number is the lever on Redis' CPU per cycle; see bench/README.md).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use redlease::{LockManager, LockOptions, RedisBackend};
use support::RedisServer;

/// Calls per command from `INFO commandstats`.
fn command_calls(srv: &RedisServer) -> BTreeMap<String, u64> {
    let info = srv
        .cmd(&["INFO", "commandstats"])
        .as_str()
        .unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// Commands a connection sends on its own (the harness's INFO, the client's checks at
/// connect): not a cycle's.
const NOT_A_CYCLES: [&str; 6] = [
    "info",
    "subscribe",
    "unsubscribe",
    "publish",
    "ping",
    "client|setname",
];

/// The commands run between two snapshots, per cycle, leaving out [`NOT_A_CYCLES`].
fn per_cycle(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    cycles: u64,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter(|(name, _)| !NOT_A_CYCLES.contains(&name.as_str()))
        .filter_map(|(name, n)| {
            let d = n - before.get(name).copied().unwrap_or(0);
            (d > 0).then(|| (name.clone(), d as f64 / cycles as f64))
        })
        .collect()
}

/// A plain acquire + release of a free lock, one after another on rotating keys: two script
/// calls, and no more than ten commands inside them (TIME, HMGET, SET NX GET, HSET and
/// PEXPIRE to grant; GET, DEL, HMGET, HSET and PEXPIRE to release). A change that adds a
/// command to the common cycle fails here, with the count per command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_cycle_costs_two_script_calls_and_at_most_ten_commands_inside() {
    const CYCLES: u64 = 200;
    let srv = RedisServer::start();
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(30)))
        .expect("options");
    let before = command_calls(&srv);
    for n in 0..CYCLES {
        let g = locks.lock(&format!("cost:{}", n % 16)).try_acquire().await;
        g.expect("acquire")
            .expect("free")
            .release()
            .await
            .expect("release");
    }
    let costs = per_cycle(&before, &command_calls(&srv), CYCLES);
    let scripts = costs.get("evalsha").copied().unwrap_or(0.0);
    let inside: f64 = costs
        .iter()
        .filter(|(name, _)| name.as_str() != "evalsha")
        .map(|(_, n)| n)
        .sum();
    assert!(
        (scripts - 2.0).abs() < 0.01,
        "{scripts} script calls per cycle: {costs:?}"
    );
    assert!(
        inside <= 10.0,
        "{inside} commands inside the scripts per cycle: {costs:?}"
    );
}
