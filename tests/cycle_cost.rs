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

/// `cycles` plain acquire + release cycles of free locks, one after another, on the key
/// `name(n)` for cycle `n`: the script calls and the commands inside them, per cycle.
async fn cycles(name: impl Fn(u64) -> String, cycles: u64) -> (f64, f64, BTreeMap<String, f64>) {
    let srv = RedisServer::start();
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(30)))
        .expect("options");
    let before = command_calls(&srv);
    for n in 0..cycles {
        let g = locks.lock(&name(n)).try_acquire().await;
        g.expect("acquire")
            .expect("free")
            .release()
            .await
            .expect("release");
    }
    let costs = per_cycle(&before, &command_calls(&srv), cycles);
    let scripts = costs.get("evalsha").copied().unwrap_or(0.0);
    let inside: f64 = costs
        .iter()
        .filter(|(name, _)| name.as_str() != "evalsha")
        .map(|(_, n)| n)
        .sum();
    (scripts, inside, costs)
}

/// A plain acquire + release of a free lock, one after another on rotating keys: two script
/// calls, and six commands inside them (TIME, HMGET and HSET of the lock's record to grant;
/// TIME, HMGET and HSET to release), plus EXISTS and PEXPIREAT when the record is new. A change
/// that adds a command to the common cycle fails here, with the count per command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_cycle_costs_two_script_calls_and_six_commands_inside() {
    const CYCLES: u64 = 200;
    let (scripts, inside, costs) = cycles(|n| format!("cost:{}", n % 16), CYCLES).await;
    assert!(
        (scripts - 2.0).abs() < 0.01,
        "{scripts} script calls per cycle: {costs:?}"
    );
    // The first cycle of each of the 16 keys makes its record and gives it its hour.
    let made = 2.0 * 16.0 / CYCLES as f64;
    assert!(
        inside <= 6.0 + made + 0.001,
        "{inside} commands inside the scripts per cycle: {costs:?}"
    );
    for name in ["time", "hmget", "hset"] {
        assert!(
            (costs.get(name).copied().unwrap_or(0.0) - 2.0).abs() < 0.01,
            "two {name} per cycle: {costs:?}"
        );
    }
}

/// A cycle on a lock never used before: the same, plus the new record's PEXPIREAT and the
/// EXISTS that makes sure no one else's hash is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cycle_on_a_new_lock_adds_only_the_records_check_and_expiry() {
    const CYCLES: u64 = 100;
    let (scripts, inside, costs) = cycles(|n| format!("new:{n}"), CYCLES).await;
    assert!(
        (scripts - 2.0).abs() < 0.01,
        "{scripts} script calls per cycle: {costs:?}"
    );
    assert!(
        inside <= 8.001,
        "{inside} commands inside the scripts per cycle: {costs:?}"
    );
    assert!(
        (costs.get("pexpireat").copied().unwrap_or(0.0) - 1.0).abs() < 0.01,
        "one PEXPIREAT per new record: {costs:?}"
    );
    assert!(
        (costs.get("exists").copied().unwrap_or(0.0) - 1.0).abs() < 0.01,
        "one EXISTS per new record: {costs:?}"
    );
}
