//! The rows of the benchmark: redlease and the code it is compared with, behind one shape.

use std::time::Duration;

use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::scripts::Script;
use fred::types::{Expiration, SetOptions};
use redis::aio::MultiplexedConnection;

/// TTL of every lease in the benchmark.
pub const TTL: Duration = Duration::from_secs(30);

const COMPARE_AND_DELETE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lib {
    /// redlease, `guard.release().await`.
    Redlease,
    /// redlease, `drop(guard)`: the release runs in the background.
    RedleaseDrop,
    /// redlease, a fair (FIFO) lock, explicit release (W3 only).
    RedleaseFair,
    /// The floor: SET NX PX + a compare-and-delete script, sent by hand on fred.
    FredRaw,
    /// The floor on redis-rs' multiplexed connection.
    RedisRsRaw,
    /// The rslock crate (0.10), explicit release.
    Rslock,
    /// redlease with `ReplicaAck::replicas(1)`, explicit release (W7 only).
    RedleaseAcked,
    /// The floor with `WAIT 1` after the SET, on the key's primary (W7 only).
    FredRawAcked,
}

impl Lib {
    pub fn name(self) -> &'static str {
        match self {
            Lib::Redlease => "redlease (explicit release)",
            Lib::RedleaseDrop => "redlease (drop release)",
            Lib::RedleaseFair => "redlease fair (explicit release)",
            Lib::FredRaw => "raw floor: fred SET NX PX + script",
            Lib::RedisRsRaw => "raw floor: redis-rs SET NX PX + script",
            Lib::Rslock => "rslock 0.10",
            Lib::RedleaseAcked => "redlease, 1 replica acknowledges (explicit release)",
            Lib::FredRawAcked => "raw floor: fred SET NX PX + WAIT 1 + script",
        }
    }
}

/// One set of clients (one connection each) on the same nodes.
#[derive(Clone)]
pub struct Clients {
    pub redlease: redlease::LockManager,
    fred: fred::clients::Client,
    script: Script,
    redis_rs: MultiplexedConnection,
    rslock: rslock::LockManager,
}

impl Clients {
    /// Clients of the single node at `url`.
    pub async fn connect(url: &str) -> Clients {
        let (redlease, fred, script) = redlease_and_fred(url).await;
        let redis_rs = redis::Client::open(url)
            .expect("redis-rs url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis-rs connects");
        let rslock = rslock::LockManager::new(vec![url.to_string()]);
        Clients {
            redlease,
            fred,
            script,
            redis_rs,
            rslock,
        }
    }

    /// One acquire + release of `key`, not waiting (the key is expected to be free). With
    /// `wait`, redlease waits for the lock (`acquire()`, as an application re-taking the key
    /// its last cycle dropped does); the others' releases are awaited, so the key is free.
    pub async fn cycle(&self, lib: Lib, key: &str, wait: bool) {
        match lib {
            Lib::Redlease | Lib::RedleaseFair | Lib::RedleaseDrop => {
                redlease_cycle(&self.redlease, lib, key, wait).await;
            }
            Lib::FredRaw => fred_floor(&self.fred, &self.script, key, false).await,
            Lib::RedisRsRaw => {
                let token = token();
                let mut con = self.redis_rs.clone();
                let ok: Option<String> = redis::cmd("SET")
                    .arg(key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(TTL.as_millis() as u64)
                    .query_async(&mut con)
                    .await
                    .expect("SET NX");
                assert!(ok.is_some(), "free key");
                let _: i64 = redis::Script::new(COMPARE_AND_DELETE)
                    .key(key)
                    .arg(&token)
                    .invoke_async(&mut con)
                    .await
                    .expect("release");
            }
            Lib::Rslock => {
                let lock = self
                    .rslock
                    .lock(key.as_bytes(), TTL)
                    .await
                    .expect("rslock lock");
                self.rslock.unlock(&lock).await;
            }
            Lib::RedleaseAcked | Lib::FredRawAcked => {
                panic!("{} runs on a cluster with replicas (W7) only", lib.name())
            }
        }
    }

    /// Waits for `key`, then returns a holder to release with [`Held::release`].
    pub async fn acquire_waiting(&self, lib: Lib, key: &str) -> Held {
        match lib {
            Lib::Redlease | Lib::RedleaseDrop => Held::Redlease(
                self.redlease.lock(key).acquire().await.expect("acquire"),
                lib,
            ),
            Lib::RedleaseFair => Held::Redlease(
                self.redlease
                    .lock(key)
                    .fair()
                    .expect("Redis serves fair locks")
                    .acquire()
                    .await
                    .expect("acquire"),
                lib,
            ),
            Lib::Rslock => Held::Rslock(
                self.rslock
                    .acquire(key.as_bytes(), TTL)
                    .await
                    .expect("rslock acquire"),
            ),
            Lib::FredRaw | Lib::RedisRsRaw | Lib::FredRawAcked => {
                unreachable!("the raw floors do not wait")
            }
            Lib::RedleaseAcked => unreachable!("W7 only: it does not wait"),
        }
    }
}

pub enum Held {
    Redlease(redlease::LockGuard, Lib),
    Rslock(rslock::LockGuard),
}

impl Held {
    pub fn fencing_token(&self) -> Option<u64> {
        match self {
            Held::Redlease(g, _) => Some(g.fencing_token()),
            Held::Rslock(_) => None,
        }
    }

    pub async fn release(self) {
        match self {
            Held::Redlease(g, Lib::RedleaseDrop) => drop(g),
            Held::Redlease(g, _) => {
                g.release().await.expect("release");
            }
            Held::Rslock(g) => g.release().await,
        }
    }
}

fn token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The rows of W7 (W2 on a Redis Cluster): redlease, and the floor sent by hand on fred's
/// cluster client.
#[derive(Clone)]
pub struct ClusterClients {
    pub redlease: redlease::LockManager,
    /// With `ReplicaAck::replicas(1)`, if the cluster has replicas.
    acked: Option<redlease::LockManager>,
    fred: fred::clients::Client,
    script: Script,
}

impl ClusterClients {
    /// Clients of the cluster at `url` (`redis-cluster://`); with `replicas`, also a lock
    /// manager whose grants wait for one replica.
    pub async fn connect(url: &str, replicas: bool) -> ClusterClients {
        let (redlease, fred, script) = redlease_and_fred(url).await;
        let acked = if replicas {
            let options =
                redlease::RedisOptions::new().replica_ack(redlease::ReplicaAck::replicas(1));
            let backend = redlease::RedisBackend::connect_with(url, options)
                .await
                .expect("redlease connects");
            let opts = redlease::LockOptions::new().ttl(TTL);
            Some(redlease::LockManager::with_options(backend, opts).expect("options"))
        } else {
            None
        };
        ClusterClients {
            redlease,
            acked,
            fred,
            script,
        }
    }

    /// One acquire + release of `key` (free), by `lib`: redlease (explicit or drop
    /// release, or acknowledged) or the fred floor (or with `WAIT 1`).
    pub async fn cycle(&self, lib: Lib, key: &str) {
        match lib {
            Lib::Redlease | Lib::RedleaseDrop => {
                redlease_cycle(&self.redlease, lib, key, false).await;
            }
            Lib::RedleaseAcked => {
                let acked = self.acked.as_ref().expect("a cluster with replicas");
                redlease_cycle(acked, Lib::Redlease, key, false).await;
            }
            Lib::FredRawAcked => fred_floor(&self.fred, &self.script, key, true).await,
            _ => fred_floor(&self.fred, &self.script, key, false).await,
        }
    }
}

/// A lock manager on `url` (one server or a cluster), and the floor's fred client with its
/// compare-and-delete script loaded (on every primary of a cluster).
async fn redlease_and_fred(url: &str) -> (redlease::LockManager, fred::clients::Client, Script) {
    let backend = redlease::RedisBackend::connect(url)
        .await
        .expect("redlease connects");
    let opts = redlease::LockOptions::new().ttl(TTL);
    let redlease = redlease::LockManager::with_options(backend, opts).expect("options");
    let config = fred::types::config::Config::from_url(url).expect("url");
    let fred = fred::types::Builder::from_config(config)
        .build()
        .expect("fred client");
    fred.init().await.expect("fred connects");
    let script = Script::from_lua(COMPARE_AND_DELETE);
    script.load(&fred).await.expect("script loads");
    (redlease, fred, script)
}

/// One redlease cycle of `key` by `lib` (plain or fair; explicit or drop release); with
/// `wait`, the acquire waits for the lock, else the key is expected to be free.
async fn redlease_cycle(locks: &redlease::LockManager, lib: Lib, key: &str, wait: bool) {
    let lock = locks.lock(key);
    let lock = if lib == Lib::RedleaseFair {
        lock.fair().expect("Redis serves fair locks")
    } else {
        lock
    };
    let g = if wait {
        lock.acquire().await.expect("acquire")
    } else {
        let g = lock.try_acquire().await.expect("acquire");
        g.expect("free key")
    };
    if lib == Lib::RedleaseDrop {
        drop(g);
    } else {
        g.release().await.expect("release");
    }
}

/// The floor's cycle on fred (one server's client or a cluster client): `SET NX PX`, then the
/// compare-and-delete script.
async fn fred_floor(fred: &fred::clients::Client, script: &Script, key: &str, acked: bool) {
    let token = token();
    let ok: Option<String> = fred
        .set(
            key,
            token.as_str(),
            Some(Expiration::PX(TTL.as_millis() as i64)),
            Some(SetOptions::NX),
            false,
        )
        .await
        .expect("SET NX");
    assert!(ok.is_some(), "free key");
    if acked {
        // One replica has it: WAIT 1 on the key's primary (the connection that wrote),
        // blocking as fred's own `wait` is.
        let slot = fred::util::redis_keyslot(key.as_bytes());
        let wait = fred::types::CustomCommand::new_static(
            "WAIT",
            fred::types::ClusterHash::Custom(slot),
            true,
        );
        let n: i64 = fred.custom(wait, vec![1, 100]).await.expect("WAIT");
        assert!(n >= 1, "a replica acknowledged");
    }
    let _: i64 = script
        .evalsha(fred, key, token.as_str())
        .await
        .expect("release");
}
