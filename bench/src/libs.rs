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
    /// redlease over the redis-rs transport (`Transport::RedisRs`), explicit release.
    RedleaseRedisRs,
    /// redlease over the redis-rs transport, `drop(guard)`.
    RedleaseRedisRsDrop,
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
    /// redlease on PostgreSQL (`PostgresBackend`), explicit release.
    RedleasePostgres,
    /// redlease on PostgreSQL, a fair lock, explicit release (W3 only).
    RedleasePostgresFair,
    /// redlease on etcd (`EtcdBackend`), explicit release.
    RedleaseEtcd,
    /// redlease on etcd, a fair lock, explicit release (W3 only).
    RedleaseEtcdFair,
}

/// The server a row's locks live on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    Redis,
    Postgres,
    Etcd,
}

impl Store {
    pub const ALL: [Store; 3] = [Store::Redis, Store::Postgres, Store::Etcd];

    /// As `--stores` spells it.
    pub fn arg(self) -> &'static str {
        match self {
            Store::Redis => "redis",
            Store::Postgres => "postgres",
            Store::Etcd => "etcd",
        }
    }
}

impl Lib {
    pub fn name(self) -> &'static str {
        match self {
            Lib::Redlease => "redlease (explicit release)",
            Lib::RedleaseDrop => "redlease (drop release)",
            Lib::RedleaseRedisRs => "redlease on redis-rs (explicit release)",
            Lib::RedleaseRedisRsDrop => "redlease on redis-rs (drop release)",
            Lib::RedleaseFair => "redlease fair (explicit release)",
            Lib::FredRaw => "raw floor: fred SET NX PX + script",
            Lib::RedisRsRaw => "raw floor: redis-rs SET NX PX + script",
            Lib::Rslock => "rslock 0.10",
            Lib::RedleaseAcked => "redlease, 1 replica acknowledges (explicit release)",
            Lib::FredRawAcked => "raw floor: fred SET NX PX + WAIT 1 + script",
            Lib::RedleasePostgres => "redlease on PostgreSQL (explicit release)",
            Lib::RedleasePostgresFair => "redlease fair on PostgreSQL (explicit release)",
            Lib::RedleaseEtcd => "redlease on etcd (explicit release)",
            Lib::RedleaseEtcdFair => "redlease fair on etcd (explicit release)",
        }
    }

    pub fn store(self) -> Store {
        match self {
            Lib::RedleasePostgres | Lib::RedleasePostgresFair => Store::Postgres,
            Lib::RedleaseEtcd | Lib::RedleaseEtcdFair => Store::Etcd,
            _ => Store::Redis,
        }
    }

    fn fair(self) -> bool {
        matches!(
            self,
            Lib::RedleaseFair | Lib::RedleasePostgresFair | Lib::RedleaseEtcdFair
        )
    }
}

/// Where the other stores' servers listen, for the rows on them (`None`: left out).
#[derive(Clone, Default)]
pub struct StoreUrls {
    pub postgres: Option<String>,
    pub etcd: Option<String>,
}

/// One set of clients (one connection each) on the same nodes.
#[derive(Clone)]
pub struct Clients {
    pub redlease: redlease::LockManager,
    /// The same, its commands carried by redis-rs instead of fred.
    redlease_redis_rs: redlease::LockManager,
    fred: fred::clients::Client,
    script: Script,
    redis_rs: MultiplexedConnection,
    rslock: rslock::LockManager,
    /// redlease on PostgreSQL and on etcd, with the backends' default options.
    postgres: Option<redlease::LockManager>,
    etcd: Option<redlease::LockManager>,
}

impl Clients {
    /// Clients of the single Redis node at `url`, and lock managers on the other stores.
    pub async fn connect(url: &str, stores: &StoreUrls) -> Clients {
        let (redlease, fred, script) = redlease_and_fred(url).await;
        let options = redlease::RedisOptions::new().transport(redlease::Transport::RedisRs);
        let backend = redlease::RedisBackend::connect_with(url, options)
            .await
            .expect("redlease connects over redis-rs");
        let opts = redlease::LockOptions::new().ttl(TTL);
        let redlease_redis_rs =
            redlease::LockManager::with_options(backend, opts).expect("options");
        let redis_rs = redis::Client::open(url)
            .expect("redis-rs url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis-rs connects");
        let rslock = rslock::LockManager::new(vec![url.to_string()]);
        let postgres = match &stores.postgres {
            Some(url) => {
                let backend = redlease::PostgresBackend::connect(url)
                    .await
                    .expect("redlease connects to PostgreSQL");
                Some(manager(backend))
            }
            None => None,
        };
        let etcd = match &stores.etcd {
            Some(url) => {
                let backend = redlease::EtcdBackend::connect(url)
                    .await
                    .expect("redlease connects to etcd");
                Some(manager(backend))
            }
            None => None,
        };
        Clients {
            redlease,
            redlease_redis_rs,
            fred,
            script,
            redis_rs,
            rslock,
            postgres,
            etcd,
        }
    }

    /// The lock manager of a row on PostgreSQL or etcd.
    fn store_manager(&self, lib: Lib) -> &redlease::LockManager {
        let manager = match lib.store() {
            Store::Postgres => self.postgres.as_ref(),
            Store::Etcd => self.etcd.as_ref(),
            Store::Redis => unreachable!("{} runs on Redis", lib.name()),
        };
        manager.unwrap_or_else(|| panic!("{}: its store was left out", lib.name()))
    }

    /// One acquire + release of `key`, not waiting (the key is expected to be free). With
    /// `wait`, redlease waits for the lock (`acquire()`, as an application re-taking the key
    /// its last cycle dropped does); the others' releases are awaited, so the key is free.
    pub async fn cycle(&self, lib: Lib, key: &str, wait: bool) {
        match lib {
            Lib::Redlease | Lib::RedleaseFair | Lib::RedleaseDrop => {
                redlease_cycle(&self.redlease, lib, key, wait).await;
            }
            Lib::RedleaseRedisRs | Lib::RedleaseRedisRsDrop => {
                redlease_cycle(&self.redlease_redis_rs, lib, key, wait).await;
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
            Lib::RedleasePostgres
            | Lib::RedleasePostgresFair
            | Lib::RedleaseEtcd
            | Lib::RedleaseEtcdFair => {
                redlease_cycle(self.store_manager(lib), lib, key, wait).await;
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
            Lib::RedleaseRedisRs | Lib::RedleaseRedisRsDrop => Held::Redlease(
                self.redlease_redis_rs
                    .lock(key)
                    .acquire()
                    .await
                    .expect("acquire"),
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
            Lib::RedleasePostgres | Lib::RedleaseEtcd => Held::Redlease(
                self.store_manager(lib)
                    .lock(key)
                    .acquire()
                    .await
                    .expect("acquire"),
                lib,
            ),
            Lib::RedleasePostgresFair | Lib::RedleaseEtcdFair => Held::Redlease(
                self.store_manager(lib)
                    .lock(key)
                    .fair()
                    .expect("the store serves fair locks")
                    .acquire()
                    .await
                    .expect("acquire"),
                lib,
            ),
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
            Held::Redlease(g, Lib::RedleaseDrop | Lib::RedleaseRedisRsDrop) => drop(g),
            Held::Redlease(g, _) => {
                g.release().await.expect("release");
            }
            Held::Rslock(g) => g.release().await,
        }
    }
}

/// A lock manager on `backend` with the benchmark's TTL.
fn manager(backend: impl redlease::backend::Backend) -> redlease::LockManager {
    redlease::LockManager::with_options(backend, redlease::LockOptions::new().ttl(TTL))
        .expect("options")
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

/// A lock manager of its own on `url` (one server), TTL [`TTL`]: W8 and W9 give each run a
/// new one, so that what one run leaves in a manager (its subscriber connection's state)
/// cannot change the next run's numbers.
pub async fn fresh_manager(url: &str) -> redlease::LockManager {
    let backend = redlease::RedisBackend::connect(url)
        .await
        .expect("redlease connects");
    redlease::LockManager::with_options(backend, redlease::LockOptions::new().ttl(TTL))
        .expect("options")
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
    let lock = if lib.fair() {
        lock.fair().expect("the store serves fair locks")
    } else {
        lock
    };
    let g = if wait {
        lock.acquire().await.expect("acquire")
    } else {
        let g = lock.try_acquire().await.expect("acquire");
        g.expect("free key")
    };
    if matches!(lib, Lib::RedleaseDrop | Lib::RedleaseRedisRsDrop) {
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

/// The hand-written floors of W8 and W9: a semaphore and a read-write lock on fred, the
/// simplest correct way by hand (the sorted-set pattern of Redisson's expirable semaphore and
/// madelson's DistributedLock): one script call per acquire and per release, leases by the
/// server's clock, waiters woken by a message on release (a connection of their own, one
/// subscription per name) with a fallback re-check every second. No fencing tokens, no
/// re-sent-command answers, no watchdog. The semaphore does not yield to waiters (a releaser
/// may take its permit straight back); the read-write lock's writer does yield to waiting
/// readers, without which it starves them (see bench/README.md, W9).
#[derive(Clone)]
pub struct SharedFloor {
    fred: fred::clients::Client,
    subscriber: fred::clients::Client,
    /// channel -> its waiters.
    channels: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Notify>>>,
    >,
    scripts: std::sync::Arc<[Script; 6]>,
}

/// Milliseconds since the epoch by the server's clock, in a floor script.
const FLOOR_NOW: &str =
    "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) ";

/// The floor semaphore's acquire. KEYS: the holds (token -> expiry); ARGV: token, ttl, permits.
const SEM_ACQUIRE: &str = "redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) \
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then \
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) return 1 end return 0";
/// Its release. KEYS: the holds, the channel; ARGV: token.
const SEM_RELEASE: &str = "if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then \
  redis.call('PUBLISH', KEYS[2], '1') return 1 end return 0";
/// The floor read-write lock's read. KEYS: the reads (token -> expiry), the write, the
/// writer-waits flag, the readers-wait flag; ARGV: token, ttl, flag ms. Refused while a
/// writer holds or waits (writer preference), raising the readers-wait flag.
const RW_READ: &str = "if redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 then \
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[3]) return 0 end \
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) \
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) return 1";
/// Its write: a first attempt yields (-1) while readers wait (so that a writer that has just
/// released does not take the lock back from the readers its release woke); granted when
/// no read runs; else it raises the writer-waits flag (new reads wait while it runs). KEYS
/// as a read; ARGV: token, ttl, flag ms, 1 for a first attempt.
const RW_WRITE: &str = "if ARGV[4] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then return -1 end \
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) \
if redis.call('ZCARD', KEYS[1]) == 0 and redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then \
  redis.call('DEL', KEYS[3]) return 1 end \
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3]) return 0";
/// A read's release: the last live read wakes the waiters. KEYS: the reads, the channel.
const RW_READ_RELEASE: &str = "if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end \
if redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%.0f', now), '+inf') == 0 then \
  redis.call('PUBLISH', KEYS[2], '*') end return 1";
/// The write's release (compare-and-delete, then wake the waiters). KEYS: the write, the
/// channel.
const RW_WRITE_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
  redis.call('DEL', KEYS[1]) redis.call('PUBLISH', KEYS[2], '*') return 1 end return 0";

/// The re-check of a floor waiter that no message woke (a holder that crashed never
/// publishes): redlease's default `max_delay`.
const FLOOR_RECHECK: Duration = Duration::from_secs(1);

/// How long the floor's waiting flags run, in ms: as long as a redlease waiter's (twice the
/// re-check plus 100 ms).
const FLOOR_FLAG: u128 = 2 * FLOOR_RECHECK.as_millis() + 100;

impl SharedFloor {
    /// Connects both connections and loads the scripts. The messages are read from fred's
    /// broadcast receiver rather than through `on_message`, whose task ends for good when
    /// the receiver lags (more than 32 messages unread): a lag wakes every waiter instead.
    pub async fn connect(url: &str) -> SharedFloor {
        use tokio::sync::broadcast::error::RecvError;
        let client = || {
            let config = fred::types::config::Config::from_url(url).expect("url");
            fred::types::Builder::from_config(config)
                .build()
                .expect("fred client")
        };
        let (fred, subscriber) = (client(), client());
        fred.init().await.expect("fred connects");
        subscriber.init().await.expect("fred subscriber connects");
        let with_now = |body: &str| Script::from_lua(format!("{FLOOR_NOW}{body}"));
        let scripts = [
            with_now(SEM_ACQUIRE),
            Script::from_lua(SEM_RELEASE),
            with_now(RW_READ),
            with_now(RW_WRITE),
            with_now(RW_READ_RELEASE),
            Script::from_lua(RW_WRITE_RELEASE),
        ];
        for s in &scripts {
            s.load(&fred).await.expect("floor script loads");
        }
        let channels: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<_, _>>> =
            Default::default();
        let on_message = channels.clone();
        let mut rx = fred::interfaces::EventInterface::message_rx(&subscriber);
        tokio::spawn(async move {
            loop {
                let msg = match rx.recv().await {
                    Ok(msg) => msg,
                    Err(RecvError::Lagged(_)) => {
                        let all: Vec<std::sync::Arc<tokio::sync::Notify>> =
                            on_message.lock().unwrap().values().cloned().collect();
                        for n in all {
                            n.notify_waiters();
                            n.notify_one();
                        }
                        continue;
                    }
                    Err(RecvError::Closed) => return,
                };
                let notify = on_message.lock().unwrap().get(&*msg.channel).cloned();
                // A semaphore's release wakes one waiter ('1'), a read-write lock's every
                // waiter ('*').
                if let Some(n) = notify {
                    let n: std::sync::Arc<tokio::sync::Notify> = n;
                    if msg.value.as_str().as_deref() == Some("*") {
                        n.notify_waiters();
                    } else {
                        n.notify_one();
                    }
                }
            }
        });
        SharedFloor {
            fred,
            subscriber,
            channels,
            scripts: std::sync::Arc::new(scripts),
        }
    }

    /// Subscribes to `name`'s releases; the waiters' handle.
    pub async fn watch(&self, name: &str) -> FloorLock {
        use fred::interfaces::PubsubInterface;
        let channel = format!("floor:{{{name}}}:released");
        let notify = std::sync::Arc::new(tokio::sync::Notify::new());
        self.channels
            .lock()
            .unwrap()
            .insert(channel.clone(), notify.clone());
        self.subscriber
            .subscribe(channel.as_str())
            .await
            .expect("SUBSCRIBE");
        FloorLock {
            floor: self.clone(),
            key: format!("floor:{{{name}}}"),
            channel,
            notify,
        }
    }
}

/// One name of the hand-written floors (a semaphore or a read-write lock).
#[derive(Clone)]
pub struct FloorLock {
    floor: SharedFloor,
    key: String,
    channel: String,
    notify: std::sync::Arc<tokio::sync::Notify>,
}

impl FloorLock {
    /// Tries `script` until it answers 1: listening for a release before each attempt (so a
    /// release between the attempt's answer and the wait is not missed), then waiting for it
    /// or the re-check. `args(first)` are the attempt's arguments; an answer of -1 (a first
    /// attempt that yielded to waiters) is tried again after two of its round trips and a
    /// millisecond, or at a release, as redlease does.
    async fn wait_for(&self, script: usize, keys: Vec<String>, args: impl Fn(bool) -> Vec<String>) {
        let mut first = true;
        loop {
            let woken = self.notify.notified();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            let sent = std::time::Instant::now();
            let got: i64 = self.floor.scripts[script]
                .evalsha(&self.floor.fred, keys.clone(), args(first))
                .await
                .expect("floor acquire");
            let pause = match got {
                1 => return,
                -1 => sent.elapsed() * 2 + Duration::from_millis(1),
                _ => FLOOR_RECHECK,
            };
            first = false;
            let _ = tokio::time::timeout(pause, woken).await;
        }
    }

    /// Waits for one of `permits` permits; returns its token.
    pub async fn acquire_permit(&self, permits: u32) -> String {
        let token = token();
        let keys = vec![format!("{}:permits", self.key)];
        let args = vec![
            token.clone(),
            TTL.as_millis().to_string(),
            permits.to_string(),
        ];
        self.wait_for(0, keys, |_| args.clone()).await;
        token
    }

    pub async fn release_permit(&self, token: &str) {
        let keys = vec![format!("{}:permits", self.key), self.channel.clone()];
        let _: i64 = self.floor.scripts[1]
            .evalsha(&self.floor.fred, keys, token)
            .await
            .expect("floor release");
    }

    fn rw_keys(&self) -> Vec<String> {
        ["reads", "write", "writer-waits", "readers-wait"]
            .iter()
            .map(|k| format!("{}:{k}", self.key))
            .collect()
    }

    /// Waits for a read; returns its token.
    pub async fn read(&self) -> String {
        let token = token();
        let args = vec![
            token.clone(),
            TTL.as_millis().to_string(),
            FLOOR_FLAG.to_string(),
        ];
        self.wait_for(2, self.rw_keys(), |_| args.clone()).await;
        token
    }

    /// Waits for the write; returns its token.
    pub async fn write(&self) -> String {
        let token = token();
        let args = |first: bool| {
            let first = if first { "1" } else { "0" };
            vec![
                token.clone(),
                TTL.as_millis().to_string(),
                FLOOR_FLAG.to_string(),
                first.to_owned(),
            ]
        };
        self.wait_for(3, self.rw_keys(), args).await;
        token
    }

    pub async fn release_read(&self, token: &str) {
        let keys = vec![format!("{}:reads", self.key), self.channel.clone()];
        let _: i64 = self.floor.scripts[4]
            .evalsha(&self.floor.fred, keys, token)
            .await
            .expect("floor read release");
    }

    pub async fn release_write(&self, token: &str) {
        let keys = vec![format!("{}:write", self.key), self.channel.clone()];
        let _: i64 = self.floor.scripts[5]
            .evalsha(&self.floor.fred, keys, token)
            .await
            .expect("floor write release");
    }

    /// Closes both connections (each run connects its own floor); the message loop ends
    /// with them.
    pub async fn close(self) {
        self.floor.channels.lock().unwrap().remove(&self.channel);
        let _ = self.floor.subscriber.quit().await;
        let _ = self.floor.fred.quit().await;
    }
}
