//! Redis Cluster: the same locks on a local cluster of three primaries started by the tests
//! (`support::RedisCluster`). The conformance suite also runs there (tests/conformance.rs,
//! module `cluster`); these are the cases that depend on the keys being spread over shards.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redlease::{
    Cache, CacheOptions, LeaseKey, LockGuard, LockManager, LockOptions, Owner, RedisBackend,
    ReplicaAck, RetryPolicy,
};
use support::RedisCluster;
use tokio::sync::Notify;

/// A long fallback re-check: a waiter that gets the lock well before it was woken by the
/// release's message.
const NO_FALLBACK: Duration = Duration::from_secs(60);

async fn backend(cluster: &RedisCluster) -> RedisBackend {
    RedisBackend::connect_with(
        &cluster.url(),
        support::redis_options().command_timeout(Duration::from_millis(500)),
    )
    .await
    .expect("connect to the cluster")
}

async fn manager(cluster: &RedisCluster, options: LockOptions) -> LockManager {
    LockManager::with_options(backend(cluster).await, options).expect("options")
}

/// Releases `held` once `waiter` (another manager's waiting acquire of the same lock) has
/// registered for the release's message on `node`, the owner of `key`, and returns what the
/// waiter got: it is woken by that message (its fallback re-check is far away), with a
/// larger fencing token.
async fn hand_over(
    node: &support::RedisServer,
    key: &str,
    held: LockGuard,
    waiter: tokio::task::JoinHandle<redlease::Result<LockGuard>>,
) -> LockGuard {
    assert!(
        support::wait_for_async(Duration::from_secs(10), || support::field(node, key, "w")
            .is_some())
        .await,
        "{key}: the waiter registered"
    );
    let first = held.fencing_token();
    held.release().await.expect("release");
    let next = waiter
        .await
        .expect("task")
        .unwrap_or_else(|e| panic!("{key}: the waiter was not woken: {e}"));
    assert!(next.fencing_token() > first, "{key}");
    next
}

fn patient() -> LockOptions {
    LockOptions::new().ttl(Duration::from_secs(10)).retry(
        RetryPolicy::notify()
            .min_delay(NO_FALLBACK)
            .max_delay(NO_FALLBACK),
    )
}

/// One lock on each primary, held by one manager: another manager finds each held, a waiter
/// on each is woken by its release's message (the fallback re-check is a minute away), and
/// fencing tokens increase per lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_on_every_shard_exclude_and_wake_their_waiters() {
    let cluster = RedisCluster::start(3, 0);
    let names = cluster.names_per_primary("redlease:", "shard");
    let a = manager(&cluster, patient()).await;
    let b = manager(&cluster, patient()).await;
    for name in &names {
        let held = support::take(&a, name).await;
        assert!(
            b.lock(name).try_acquire().await.expect("try").is_none(),
            "{name}"
        );
        let waiter = {
            let lock = b.lock(name);
            tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(20)).await })
        };
        let key = a.lock(name).key().as_str().to_owned();
        let owner = &cluster.nodes[cluster.owner(&key, 0)];
        let next = hand_over(owner, &key, held, waiter).await;
        next.release().await.expect("release");
    }
}

/// Fair and reentrant locks, inspection and fenced writes work on every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_reentrant_inspect_and_fenced_writes_on_every_shard() {
    let cluster = RedisCluster::start(3, 0);
    let names = cluster.names_per_primary("redlease:", "kinds");
    let redis = backend(&cluster).await;
    let locks = LockManager::with_options(redis.clone(), patient().holder_label("worker-7"))
        .expect("options");
    let job = Owner::named("job");
    for name in &names {
        let fair = locks.lock(name).fair().expect("fair");
        let g = fair.acquire().await.expect("fair acquire");
        let waiter = {
            let fair = fair.clone();
            tokio::spawn(async move { fair.acquire_timeout(Duration::from_secs(20)).await })
        };
        // The waiter stands in the queue, and inspection shows it.
        let key = locks.lock(name).key().as_str().to_owned();
        let owner = &cluster.nodes[cluster.owner(&key, 0)];
        let timeouts = format!("{key}:timeouts");
        assert!(
            support::wait_for_async(Duration::from_secs(10), || owner
                .cmd(&["ZCARD", &timeouts])
                .as_int()
                == Some(1))
            .await,
            "{name}: the fair waiter queued"
        );
        let seen = locks
            .lock(name)
            .inspect()
            .await
            .expect("inspect")
            .expect("held");
        assert_eq!(seen.queue_len, 1, "{seen:?}");
        assert!(seen.held, "{seen:?}");
        assert_eq!(seen.holder_label.as_deref(), Some("worker-7"));
        g.release().await.expect("release");
        waiter
            .await
            .expect("task")
            .expect("the fair waiter gets the lock")
            .release()
            .await
            .expect("release");

        let reentrant = locks.lock(name).reentrant(&job).expect("reentrant");
        let outer = reentrant.acquire().await.expect("outer");
        let inner = reentrant.acquire().await.expect("inner");
        assert_eq!(inner.hold_count(), Some(2));
        assert_eq!(inner.fencing_token(), outer.fencing_token());
        assert_eq!(inner.release().await.expect("inner release"), 1);
        let token = outer.fencing_token();
        let data = format!("{name}:data");
        assert!(redis
            .fenced_set(&data, "v1", token)
            .await
            .expect("fenced write")
            .is_applied());
        assert!(!redis
            .fenced_set(&data, "v0", token - 1)
            .await
            .expect("fenced write")
            .is_applied());
        assert_eq!(outer.release().await.expect("outer release"), 0);
    }
}

/// How a primary stops serving in [`one_primary_down`].
#[derive(Clone, Copy, Debug, PartialEq)]
enum Down {
    /// Killed: its connections break, and its calls fail at once.
    Killed,
    /// Paused (SIGSTOP): its connections stay open, and its calls wait out the command
    /// timeout, here longer than the TTL.
    Paused,
}

/// One primary killed (no replica takes over; the other two keep serving their slots): the
/// leases on the other shards are kept, extended round after round, and locks there can
/// still be taken and released; the leases on the dead shard are reported lost, within their
/// TTL. (On fred's cluster client every lease was lost: its one router stalled every shard
/// while it could not reach the dead one.)
///
/// With the default command timeout (2 s) against a 3 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_primary_costs_only_the_leases_on_its_own_shard() {
    let cluster = RedisCluster::start(3, 0);
    let backend = RedisBackend::connect_with(&cluster.url(), support::redis_options())
        .await
        .expect("connect");
    one_primary_down(Down::Killed, cluster, backend).await;
}

/// The same with a backend made by `RedisBackend::from_client` over the application's own
/// fred cluster client (a reconnect policy and a 2 s command timeout, as the docs ask): the
/// locks go to one connection per primary made from the client's settings, not through the
/// client's one router, so a dead primary again costs only its own shard's leases. (Through
/// the client, every lease was lost within the TTL and every acquire on the healthy shards
/// timed out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_client_a_dead_primary_costs_only_the_leases_on_its_own_shard() {
    let cluster = RedisCluster::start(3, 0);
    let client = cluster_client(&cluster.url(), Duration::from_secs(2)).await;
    let backend = RedisBackend::from_client(client)
        .await
        .expect("from_client");
    one_primary_down(Down::Killed, cluster, backend).await;
}

/// The same with a backend made by `RedisBackend::from_redis_client` (feature `redis-rs`) over
/// an application's redis-rs client of one cluster node: the node says it is in a cluster,
/// and the backend opens a connection per primary from the client's settings, so a dead
/// primary again costs only its own shard's leases.
#[cfg(feature = "redis-rs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_redis_client_a_dead_primary_costs_only_the_leases_on_its_own_shard() {
    let cluster = RedisCluster::start(3, 0);
    let node = format!("redis://127.0.0.1:{}", cluster.nodes[0].port());
    let client = redis::Client::open(node.as_str()).expect("a node's URL");
    let backend = RedisBackend::from_redis_client(&client, support::redis_options())
        .await
        .expect("from_redis_client");
    assert!(backend.client().is_none(), "redis-rs carries it");
    one_primary_down(Down::Killed, cluster, backend).await;
}

/// A fred client of the cluster at `url`, made as an application would (unlimited reconnects,
/// a command timeout), and connected.
async fn cluster_client(url: &str, timeout: Duration) -> fred::prelude::Client {
    use fred::prelude::{Builder, ClientLike, Config, ReconnectPolicy};
    let mut builder = Builder::from_config(Config::from_url(url).expect("cluster URL"));
    builder
        .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
        .with_performance_config(|p| p.default_command_timeout = timeout);
    let client = builder.build().expect("client");
    client.init().await.expect("the client connects");
    client
}

/// The same with the primary paused, and a command timeout (10 s) longer than the TTL: its
/// calls hang. Each primary's leases are extended in a call of their own, applied as it is
/// answered, so the hung call delays and fails only the paused shard's leases. (When one call
/// carried every shard's leases, it was cut at the first lease's deadline and the leases on
/// the healthy shards were lost with the others.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_primary_costs_only_the_leases_on_its_own_shard() {
    let cluster = RedisCluster::start(3, 0);
    let options = support::redis_options().command_timeout(Duration::from_secs(10));
    let backend = RedisBackend::connect_with(&cluster.url(), options)
        .await
        .expect("connect");
    one_primary_down(Down::Paused, cluster, backend).await;
}

/// Primary 0 of `cluster` stops (`how`) while `backend` holds three leases on each primary.
async fn one_primary_down(how: Down, mut cluster: RedisCluster, backend: RedisBackend) {
    let ttl = Duration::from_secs(3);
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(ttl)).expect("options");
    // Three locks on each primary: names[k][i] is served by primary i.
    let names: Vec<Vec<String>> = ["dead-a", "dead-b", "dead-c"]
        .iter()
        .map(|stem| cluster.names_per_primary("redlease:", stem))
        .collect();
    let mut guards = Vec::new();
    for name in names.iter().flatten() {
        let lock = locks.lock(name);
        guards.push((
            cluster.owner(lock.key().as_str(), 1),
            lock.try_acquire().await.expect("acquire").expect("free"),
        ));
    }
    let dead = 0;
    let healthy = guards.iter().filter(|(owner, _)| *owner != dead).count() as u64;
    let fresh = cluster.names_per_primary("redlease:", "fresh");
    match how {
        Down::Killed => cluster.nodes[dead].kill(),
        Down::Paused => cluster.nodes[dead].pause(),
    }
    let extended = locks.watchdog_stats().extended;
    for (owner, guard) in &guards {
        if *owner == dead {
            tokio::time::timeout(ttl * 3, guard.lost())
                .await
                .expect("a lease on the dead shard is reported lost");
        }
    }
    // Extensions enough for every healthy lease over two TTLs after the stop (one per third
    // of the TTL): the watchdog kept extending them.
    assert!(
        support::wait_for_async(Duration::from_secs(20), || locks.watchdog_stats().extended
            >= extended + healthy * 6)
        .await,
        "the watchdog kept extending the healthy shards' leases: {:?}",
        locks.watchdog_stats()
    );
    for (owner, guard) in &guards {
        if *owner != dead {
            assert!(
                !guard.is_lost(),
                "a lease on a healthy shard (node {owner}) was lost"
            );
        }
    }
    for name in &fresh[1..] {
        let lock = locks.lock(name);
        let g = lock
            .try_acquire()
            .await
            .expect("an acquire on a healthy shard works")
            .expect("free");
        g.release().await.expect("and its release");
    }
    // A paused primary answers nothing either: its call waits out the command timeout.
    let on_dead =
        tokio::time::timeout(Duration::from_secs(1), locks.lock(&fresh[0]).try_acquire()).await;
    assert!(
        !matches!(on_dead, Ok(Ok(_))),
        "the {how:?} shard answers nothing: {on_dead:?}"
    );
}

/// Replica acknowledgement on a cluster: each grant is reported once its primary's replica
/// has it (`replicas_acked() == Some(1)`), and the watchdog's extensions are acknowledged too.
/// The primary is killed right after, its replica promoted: the lock is still held there, so
/// a second client does not get it (with acknowledgement off, a grant the replica had not yet
/// received would be lost with the primary: tests/sentinel.rs shows that window). The other
/// shards' leases, acknowledged by their own replicas, are kept; the failed-over shard has no
/// replica left, so its holder's extensions cannot be acknowledged and its lease is lost,
/// while the record it last extended keeps the lock from anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replica_acknowledgement_a_grant_outlives_its_primarys_failover() {
    let mut cluster = RedisCluster::start(3, 1);
    let names = cluster.names_per_primary("redlease:", "acked");
    let acked = support::redis_options()
        .command_timeout(Duration::from_millis(500))
        .replica_ack(ReplicaAck::replicas(1));
    let backend = RedisBackend::connect_with(&cluster.url(), acked)
        .await
        .expect("connect");
    let ttl = Duration::from_secs(3);
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(ttl)).expect("options");
    let mut guards = Vec::new();
    for name in &names {
        let g = support::take(&locks, name).await;
        assert_eq!(g.replicas_acked(), Some(1), "{name}: one replica has it");
        guards.push(g);
    }
    // A round of acknowledged extensions for every lease.
    let extended = locks.watchdog_stats().extended;
    assert!(
        support::wait_for_async(Duration::from_secs(10), || locks.watchdog_stats().extended
            >= extended + names.len() as u64)
        .await,
        "extensions are acknowledged: {:?}",
        locks.watchdog_stats()
    );
    let key = locks.lock(&names[0]).key().as_str().to_owned();
    let before = cluster.owner(&key, 1);
    cluster.nodes[before].kill();
    let survivors: Vec<usize> = (0..cluster.nodes.len()).filter(|&i| i != before).collect();
    cluster.wait_ok(&survivors);
    assert!(
        support::wait_for(Duration::from_secs(30), || cluster
            .owner(&key, survivors[0])
            != before),
        "the replica was promoted"
    );
    let promoted = cluster.owner(&key, survivors[0]);
    assert!(
        support::held(&cluster.nodes[promoted], &key),
        "the promoted replica holds the acknowledged grant"
    );
    // A second client, without acknowledgement: it never gets the lock while the first
    // client's lease lives (its first calls may still go to the dead node and fail).
    let other = LockManager::with_options(
        backend_of(&cluster, &survivors).await,
        LockOptions::new().ttl(ttl),
    )
    .expect("options");
    let mut answered = false;
    for _ in 0..100 {
        match other.lock(&names[0]).try_acquire().await {
            // Granted within the first holder's validity: two holders. (After it, on a slow
            // machine whose failover outlasted the TTL, the grant is the lease running out.)
            Ok(Some(g)) if std::time::Instant::now() < guards[0].valid_until() => panic!(
                "a second holder (token {}) while the first holds {}",
                g.fencing_token(),
                guards[0].fencing_token()
            ),
            Ok(Some(_)) => {
                answered = true;
                break;
            }
            Ok(None) => {
                answered = true;
                break;
            }
            Err(_) => support::sleep_async(Duration::from_millis(50)).await,
        }
    }
    assert!(answered, "the promoted replica answered");
    tokio::time::timeout(ttl * 3, guards[0].lost())
        .await
        .expect("the failed-over shard's lease cannot be acknowledged: it is lost");
    for g in &guards[1..] {
        assert!(
            !g.is_lost(),
            "a lease on a shard that kept its replica was lost"
        );
    }
}

/// A backend without acknowledgement over the nodes `which` of `cluster`.
async fn backend_of(cluster: &RedisCluster, which: &[usize]) -> RedisBackend {
    RedisBackend::connect_with(
        &cluster.url_of(which),
        support::redis_options().command_timeout(Duration::from_millis(500)),
    )
    .await
    .expect("connect to the cluster")
}

/// A primary killed, its replica promoted: the locks of that shard can be taken again on the
/// new primary (the slot table is asked for again after the dead node's calls fail), while
/// the other shards never stopped. The URL names only the primary that dies, and the backend
/// has used no other node before: the table is asked of nodes it learnt from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_follow_a_failover_to_the_promoted_replica() {
    let mut cluster = RedisCluster::start(3, 1);
    let names = cluster.names_per_primary("redlease:", "failover");
    let seed = cluster.owner(&format!("redlease:{{{}}}", names[0]), 0);
    let backend = RedisBackend::connect_with(
        &cluster.url_of(&[seed]),
        support::redis_options().command_timeout(Duration::from_millis(500)),
    )
    .await
    .expect("connect");
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(5)))
        .expect("options");
    let key = locks.lock(&names[0]).key().as_str().to_owned();
    let before = cluster.owner(&key, 1);
    support::take(&locks, &names[0])
        .await
        .release()
        .await
        .expect("release");
    cluster.nodes[before].kill();
    // Wait for the cluster to promote the replica of that shard.
    let survivors: Vec<usize> = (0..cluster.nodes.len()).filter(|&i| i != before).collect();
    cluster.wait_ok(&survivors);
    assert!(
        support::wait_for(Duration::from_secs(30), || {
            let owner = cluster.owner(&key, survivors[0]);
            owner != before
        }),
        "the replica was promoted"
    );
    // The lock on the failed-over shard is served again, on its new primary.
    let mut taken = None;
    for _ in 0..100 {
        match locks.lock(&names[0]).try_acquire().await {
            Ok(Some(g)) => {
                taken = Some(g);
                break;
            }
            Ok(None) => panic!("the lock was free"),
            // The first calls after the failover may still go to the dead node.
            Err(_) => support::sleep_async(Duration::from_millis(50)).await,
        }
    }
    let g = taken.expect("the lock is served by the promoted replica");
    assert!(support::held(
        &cluster.nodes[cluster.owner(&key, survivors[0])],
        &key
    ));
    g.release().await.expect("release");
    for name in &names[1..] {
        let g = support::take(&locks, name).await;
        g.release().await.expect("release");
    }
}

/// A waiter's shard-channel subscription is renewed when its connection is killed
/// (`CLIENT KILL TYPE pubsub` on the lock's primary): the waiter is then woken by the
/// release's message (its fallback re-check is a minute away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_subscriber_resubscribes_its_shard_channels() {
    let cluster = RedisCluster::start(3, 0);
    let name = cluster.names_per_primary("redlease:", "resub")[0].clone();
    let holder = manager(&cluster, LockOptions::new().ttl(Duration::from_secs(5))).await;
    let other = manager(&cluster, patient()).await;
    let key = holder.lock(&name).key().as_str().to_owned();
    let node = &cluster.nodes[cluster.owner(&key, 0)];
    let held = support::take(&holder, &name).await;
    let waiter = {
        let lock = other.lock(&name);
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(30)).await })
    };
    let channel = format!("{key}:released");
    assert!(
        support::wait_for_async(Duration::from_secs(10), || shard_subscribers(
            node, &channel
        ) > 0)
        .await,
        "the waiter subscribed"
    );
    assert!(node.kill_pubsub_clients() >= 1);
    assert!(
        support::wait_for_async(Duration::from_secs(10), || shard_subscribers(
            node, &channel
        ) > 0)
        .await,
        "the waiter's subscription was renewed after the kill"
    );
    let next = hand_over(node, &key, held, waiter).await;
    next.release().await.expect("release");
}

/// The subscribers of shard channel `channel` on `node`.
fn shard_subscribers(node: &support::RedisServer, channel: &str) -> i64 {
    node.cmd(&["PUBSUB", "SHARDNUMSUB", channel])
        .as_array()
        .and_then(|a| a.get(1).and_then(support::Resp::as_int))
        .unwrap_or(0)
}

/// The stampede cache on a cluster: a compute round that ends without a fill (its lease was
/// taken from it, so its fill is refused) wakes the waiters of other processes by a message
/// on the key's shard channel, not by their lease-long timer (10 s here). Its notice went by
/// plain PUBLISH once, which no shard-channel subscriber receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_round_that_ends_without_a_fill_wakes_other_processes() {
    let cluster = RedisCluster::start(3, 0);
    let url = cluster.url();
    let opts = support::redis_options();
    let copts = CacheOptions::new().lease_ttl(Duration::from_secs(10));
    let a = Cache::with_options(
        RedisBackend::connect_with(&url, opts.clone())
            .await
            .expect("a"),
        copts.clone(),
    )
    .expect("cache a");
    let b = Cache::with_options(
        RedisBackend::connect_with(&url, opts.clone())
            .await
            .expect("b"),
        copts,
    )
    .expect("cache b");
    let ctl = RedisBackend::connect_with(&url, opts).await.expect("ctl");
    let key = LeaseKey::new("redlease:cache:", "k");
    let node = &cluster.nodes[cluster.owner(key.as_str(), 0)];
    let (computing, proceed) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let first = {
        let (computing, proceed) = (computing.clone(), proceed.clone());
        tokio::spawn(async move {
            a.get_with("k", Duration::from_secs(60), || async move {
                computing.notify_one();
                proceed.notified().await;
                "a"
            })
            .await
        })
    };
    computing.notified().await;
    let second = tokio::spawn(async move {
        let got = b
            .get_with("k", Duration::from_secs(60), || async { "b" })
            .await;
        (got, Instant::now())
    });
    let channel = format!("{}:filled", key.as_str());
    assert!(
        support::wait_for_async(Duration::from_secs(10), || shard_subscribers(
            node, &channel
        ) > 0)
        .await,
        "the other process waits on the fill channel"
    );
    // The compute lease is taken from the first: its fill is refused, and its round ends
    // with a notice.
    assert!(ctl.force_release(&key).await.expect("force release"));
    proceed.notify_one();
    first
        .await
        .expect("task")
        .expect("the first gets its own value");
    let ended = Instant::now();
    let (got, at) = second.await.expect("task");
    got.expect("the other process gets a value");
    let late = at.saturating_duration_since(ended);
    assert!(
        late < Duration::from_secs(5),
        "the other process was woken {late:?} after the round ended (its timer: 10 s)"
    );
}

/// A held lock's slot is migrated to another primary (`CLUSTER SETSLOT` and `MIGRATE`, as a
/// resharding does) while its holder's watchdog keeps it and another client asks for it.
/// During the migration the other client's call is answered `TRYAGAIN` before it runs (it
/// declares the keys it may touch) and is sent again, for as long as the migration lasts
/// (1.5 s here); after it, calls follow the `MOVED` to the new owner. The holder keeps the lease throughout, the other client never gets it. A
/// waiter that subscribed to the lock's shard channel on the old owner before the move has
/// its subscription moved to the new owner (Redis ends it on the old one, and fred drops
/// that notice: the backend sees the slot move in its table), and is woken there by the
/// release's message, as is a waiter that comes after the move (the fallback re-check is a
/// minute away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_locks_slot_migrated_keeps_exclusion_and_wake_ups() {
    let cluster = RedisCluster::start(3, 0);
    let name = cluster.names_per_primary("redlease:", "moving")[0].clone();
    let holder = manager(&cluster, LockOptions::new().ttl(Duration::from_secs(3))).await;
    let other = manager(&cluster, patient()).await;
    let key = holder.lock(&name).key().as_str().to_owned();
    let src = cluster.owner(&key, 0);
    let dst = (src + 1) % 3;
    let id = |i: usize| {
        cluster.nodes[i]
            .cmd(&["CLUSTER", "MYID"])
            .as_str()
            .expect("MYID")
    };
    let (src_id, dst_id) = (id(src), id(dst));
    let slot = cluster.nodes[src]
        .cmd(&["CLUSTER", "KEYSLOT", &key])
        .as_int()
        .expect("KEYSLOT")
        .to_string();
    let held = support::take(&holder, &name).await;
    // A waiter subscribed on the old owner before the move.
    let early = {
        let lock = other.lock(&name);
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(30)).await })
    };
    let channel = format!("{key}:released");
    let subscribed = |node: &support::RedisServer| shard_subscribers(node, &channel) > 0;
    assert!(
        support::wait_for_async(Duration::from_secs(10), || subscribed(&cluster.nodes[src])).await,
        "the waiter subscribed to the lock's shard channel on its owner"
    );

    let ok = |r: support::Resp| assert!(r.is_ok(), "{r:?}");
    ok(cluster.nodes[dst].cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]));
    ok(cluster.nodes[src].cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]));
    let asking = {
        let lock = other.lock(&name);
        tokio::spawn(async move { lock.try_acquire().await })
    };
    let tryagain = |srv: &support::RedisServer| {
        srv.info_field("errorstats", "errorstat_TRYAGAIN")
            .is_some_and(|c| c != "count=0")
    };
    assert!(
        support::wait_for_async(Duration::from_secs(10), || tryagain(&cluster.nodes[src])).await,
        "a call on the migrating slot was answered TRYAGAIN"
    );
    // A slow migration: the call keeps being answered TRYAGAIN for longer than a second (it
    // gave up after one once), and waits.
    support::sleep_async(Duration::from_millis(1500)).await;
    assert!(!asking.is_finished(), "the call waits for the migration");
    let keys = cluster.nodes[src].cmd(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
    let keys: Vec<String> = keys
        .as_array()
        .expect("GETKEYSINSLOT")
        .iter()
        .filter_map(|k| k.as_str())
        .collect();
    assert!(keys.contains(&key), "{keys:?}");
    let port = cluster.nodes[dst].port().to_string();
    let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
    migrate.extend(keys.iter().map(String::as_str));
    ok(cluster.nodes[src].cmd(&migrate));
    for node in &cluster.nodes {
        ok(node.cmd(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]));
    }

    let answer = asking.await.expect("task");
    assert!(
        matches!(answer, Ok(None)),
        "the other client's call during the migration: {answer:?}"
    );
    assert!(
        support::held(&cluster.nodes[dst], &key),
        "the lease moved with its slot"
    );
    let rounds = holder.watchdog_stats().rounds;
    assert!(
        support::wait_for_async(Duration::from_secs(10), || holder.watchdog_stats().rounds
            >= rounds + 4)
        .await,
        "the watchdog kept going"
    );
    assert!(
        !held.is_lost(),
        "the holder kept its lease across the migration"
    );
    assert!(other
        .lock(&name)
        .try_acquire()
        .await
        .expect("try")
        .is_none());
    // The early waiter's subscription followed the slot (Redis ends it on the old owner).
    assert!(
        support::wait_for_async(Duration::from_secs(10), || subscribed(&cluster.nodes[dst])).await,
        "the waiter's subscription moved to the new owner"
    );
    let held = hand_over(&cluster.nodes[dst], &key, held, early).await;

    let waiter = {
        let lock = other.lock(&name);
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(20)).await })
    };
    // The waiter registers on the new owner and is woken there.
    let next = hand_over(&cluster.nodes[dst], &key, held, waiter).await;
    next.release().await.expect("release");
}

/// A lock's slot migrated right after a waiter of another process subscribed to its shard
/// channel, and released right after the migration: Redis ended the waiter's subscription on
/// the old owner as the slot left (fred drops that notice), and the release was published on
/// the new owner, where the waiter did not listen yet. Its process sees the move only in its
/// slot table, asked for while it has waiters; it then subscribes the waiter on the new owner
/// and has it look again. That comes within a fraction of a second, well before the waiter's
/// fallback re-check (a minute) or the holder's lease (10 s). (The table was asked for every
/// second, the first time a full second after the waiter subscribed: such a hand-off took that
/// second.) Three migrations in a row, each to another primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_right_after_a_slot_migration_reaches_the_waiter_soon() {
    /// Far below the fallback re-check and the lease, and below the second the table was
    /// asked for late (it is now asked for every 100 ms: 20–210 ms here on a loaded machine).
    const SOON_AFTER: Duration = Duration::from_millis(750);
    let cluster = RedisCluster::start(3, 0);
    let name = cluster.names_per_primary("redlease:", "hop")[0].clone();
    let holder = manager(&cluster, LockOptions::new().ttl(Duration::from_secs(10))).await;
    let other = manager(&cluster, patient()).await;
    let key = holder.lock(&name).key().as_str().to_owned();
    let channel = format!("{key}:released");
    for round in 0..3 {
        let held = support::take(&holder, &name).await;
        let from = cluster.owner(&key, 0);
        let to = (from + 1) % 3;
        let waiter = {
            let lock = other.lock(&name);
            tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(30)).await })
        };
        assert!(
            support::wait_for_async(Duration::from_secs(10), || shard_subscribers(
                &cluster.nodes[from],
                &channel
            ) > 0)
            .await,
            "round {round}: the waiter subscribed on the lock's owner"
        );
        cluster.move_slot(&key, to);
        let released = Instant::now();
        let first = held.fencing_token();
        held.release().await.expect("release");
        let next = waiter
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("round {round}: the waiter was not woken: {e}"));
        let late = released.elapsed();
        assert!(next.fencing_token() > first, "round {round}");
        assert!(
            late < SOON_AFTER,
            "round {round}: the waiter got the lock {late:?} after its release, on the slot's \
             new owner"
        );
        next.release().await.expect("release");
    }
}

/// A waiter's subscription moved to the new owner of its lock's slot is not unsubscribed on
/// the node that gave the slot away: Redis ended it there already, and would answer the
/// SUNSUBSCRIBE `MOVED`. fred takes SUNSUBSCRIBE to have no reply and hands such an error to
/// the next command on that subscriber connection as its reply: here the SSUBSCRIBE of a
/// waiter on another lock of that node, which then failed, or once the replies had shifted,
/// took the reply of the command before it. Both waiters are then woken by their release's
/// message (the fallback re-check is a minute away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_moved_off_a_node_is_not_unsubscribed_there() {
    let cluster = RedisCluster::start(3, 0);
    let moving = cluster.names_per_primary("redlease:", "moving")[0].clone();
    let staying = cluster.names_per_primary("redlease:", "staying")[0].clone();
    let holder = manager(&cluster, LockOptions::new().ttl(Duration::from_secs(10))).await;
    let other = manager(&cluster, patient()).await;
    let key = |name: &str| holder.lock(name).key().as_str().to_owned();
    let (moving_key, staying_key) = (key(&moving), key(&staying));
    let home = cluster.owner(&moving_key, 0);
    let to = (home + 1) % 3;
    let waiting = |name: &str| {
        let lock = other.lock(name);
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(30)).await })
    };
    let nodes = &cluster.nodes;
    let subscribed = |node: usize, key: &str| {
        let channel = format!("{key}:released");
        support::wait_for_async(Duration::from_secs(10), move || {
            shard_subscribers(&nodes[node], &channel) > 0
        })
    };
    let refused = || cluster.nodes[home].rejected_calls("sunsubscribe");

    let held = support::take(&holder, &moving).await;
    let early = waiting(&moving);
    assert!(subscribed(home, &moving_key).await, "the waiter subscribed");
    cluster.move_slot(&moving_key, to);
    assert!(
        subscribed(to, &moving_key).await,
        "the waiter's subscription moved to the new owner"
    );
    // Another waiter of the same process subscribes on the old node, after the move.
    let kept = support::take(&holder, &staying).await;
    let late = waiting(&staying);
    assert!(
        subscribed(home, &staying_key).await,
        "the other waiter subscribed"
    );
    assert_eq!(
        refused(),
        0,
        "the node that gave the slot away was sent a SUNSUBSCRIBE it answered MOVED"
    );
    let next = hand_over(&cluster.nodes[to], &moving_key, held, early).await;
    next.release().await.expect("release");
    let next = hand_over(&cluster.nodes[home], &staying_key, kept, late).await;
    next.release().await.expect("release");
}

/// A lock's slot moved to another primary and straight back, within the 100 ms between two
/// looks at the slot table: the table then shows no change, yet Redis ended the waiter's shard
/// subscription on its node as the slot left (fred drops that notice). The waiter's process
/// finds that out by comparing the shard channels it believes subscribed with the count the
/// node keeps for its subscriber connection, subscribes again and has the waiter look again;
/// the release then wakes it. The waiter's fallback re-check is a minute away and the holder's
/// lease 30 s, so a waiter that gets the lock within 10 s was woken (it waited out the whole
/// lease before: the hand-off took the lease's time left, 4.5 s with a 5 s lease).
///
/// Every other round, the slot stays away until a check has looked at it there (the node that
/// gave it away refused the waiter's SSUBSCRIBE, or the waiter moved to the slot's new owner).
/// A refused check once made the process stop checking while the counts stayed as they were:
/// the quick round after it then waited out the lease (3 runs in 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_away_and_back_between_two_table_checks_still_wakes_its_waiter() {
    const WOKEN_WITHIN: Duration = Duration::from_secs(10);
    let cluster = RedisCluster::start(3, 0);
    let name = cluster.names_per_primary("redlease:", "boomerang")[0].clone();
    let holder = manager(&cluster, LockOptions::new().ttl(Duration::from_secs(30))).await;
    let other = manager(&cluster, patient()).await;
    // A reentrant waiter: its fallback re-check is the policy's minute (a plain waiter
    // re-checks every second whatever its policy).
    let owner = Owner::random();
    let key = holder.lock(&name).key().as_str().to_owned();
    let channel = format!("{key}:released");
    for round in 0..4 {
        let held = support::take(&holder, &name).await;
        let home = cluster.owner(&key, 0);
        let waiter = {
            let lock = other.lock(&name).reentrant(&owner).expect("reentrant");
            tokio::spawn(async move { lock.acquire_timeout(WOKEN_WITHIN).await })
        };
        assert!(
            support::wait_for_async(Duration::from_secs(10), || shard_subscribers(
                &cluster.nodes[home],
                &channel
            ) > 0)
            .await,
            "round {round}: the waiter subscribed on the lock's owner"
        );
        let away = (home + 1) % 3;
        let refused = cluster.nodes[home].rejected_calls("ssubscribe");
        cluster.move_slot(&key, away);
        if round % 2 == 0 {
            assert!(
                support::wait_for_async(Duration::from_secs(10), || {
                    cluster.nodes[home].rejected_calls("ssubscribe") > refused
                        || shard_subscribers(&cluster.nodes[away], &channel) > 0
                })
                .await,
                "round {round}: no check looked at the slot while it was away"
            );
        }
        cluster.move_slot(&key, home);
        let first = held.fencing_token();
        held.release().await.expect("release");
        let next = waiter.await.expect("task").unwrap_or_else(|e| {
            panic!("round {round}: the waiter was not woken by the release: {e}")
        });
        assert!(next.fencing_token() > first, "round {round}");
        next.release().await.expect("release");
    }
}

/// Semaphores and read-write locks on every shard: a permit waiter in another manager is
/// woken by a release's shard message, readers held back by a write are all woken by its
/// release, and inspection counts the shared holds (the fallback re-check is a minute away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_and_read_write_locks_on_every_shard() {
    let cluster = RedisCluster::start(3, 0);
    let names = cluster.names_per_primary("redlease:", "shared");
    let rw_names = cluster.names_per_primary("redlease:", "rw");
    let a = manager(&cluster, patient()).await;
    let b = manager(&cluster, patient()).await;
    let within = Duration::from_secs(20);
    for (name, rw) in names.iter().zip(&rw_names) {
        // A semaphore of 2, full in one manager: the other's waiter gets the freed permit.
        let pool = a.semaphore(name, 2).expect("semaphore");
        let first = pool.acquire().await.expect("permit");
        let second = pool.acquire().await.expect("permit");
        let info = pool.inspect().await.expect("inspect").expect("held");
        assert_eq!(info.shared_holds, Some(2), "{name}");
        let other = b.semaphore(name, 2).expect("semaphore");
        assert!(other.try_acquire().await.expect("try").is_none(), "{name}");
        let waiter = tokio::spawn(async move { other.acquire_timeout(within).await });
        let key = pool.as_lock().key().as_str().to_owned();
        let owner = &cluster.nodes[cluster.owner(&key, 0)];
        assert!(
            support::wait_for_async(Duration::from_secs(10), || support::field(owner, &key, "s")
                .is_some())
            .await,
            "{name}: the permit waiter registered"
        );
        let released = Instant::now();
        first.release().await.expect("release");
        let third = waiter.await.expect("task").expect("the permit waiter");
        assert!(
            released.elapsed() < Duration::from_secs(5),
            "{name}: woken by message"
        );
        assert!(third.fencing_token() > second.fencing_token(), "{name}");
        drop((second, third));

        // A write held in one manager; three readers of the other all get in at its release.
        let write = a.rw(rw).expect("rw").write().await.expect("write");
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let lock = b.rw(rw).expect("rw");
                tokio::spawn(async move { lock.read_timeout(within).await })
            })
            .collect();
        let key = a.lock(rw).key().as_str().to_owned();
        let owner = &cluster.nodes[cluster.owner(&key, 0)];
        assert!(
            support::wait_for_async(Duration::from_secs(10), || support::field(owner, &key, "s")
                .is_some())
            .await,
            "{rw}: the readers registered"
        );
        let write_token = write.fencing_token();
        let released = Instant::now();
        write.release().await.expect("release");
        let mut reads = Vec::new();
        for r in readers {
            let read = r.await.expect("task").expect("a reader");
            assert!(read.fencing_token() > write_token, "{rw}");
            reads.push(read);
        }
        assert!(
            released.elapsed() < Duration::from_secs(5),
            "{rw}: woken by message"
        );
        let info = b.rw(rw).expect("rw").inspect().await.expect("inspect");
        assert_eq!(info.and_then(|i| i.shared_holds), Some(3), "{rw}");
    }
}
