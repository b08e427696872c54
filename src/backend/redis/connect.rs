//! Connecting: URLs, connection options, the backend assembled over a client's connections
//! (loading the scripts, the server version check, the eviction policy, reconnects); also
//! [`Redlock::connect`] over Redis servers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};

use super::batch::Batcher;
use super::pubsub::PubSub;
use super::transport::{self, Connection, Node, Said, Script, Target, Transport, Value};
use super::RedisOptions;
use super::{Checks, Inner, RedisBackend, Scripts};
use crate::backend::redlock::{Redlock, RedlockOptions};
use crate::error::{Error, Result};
use crate::runtime::{self, in_tokio};

/// Checks the URL before a client sees it: fred would take `rediss://` without a TLS feature
/// as plain TCP, and only log it. Returns whether the URL asks for TLS.
pub(super) fn uses_tls(url: &str) -> Result<bool> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::invalid(
            "Redis URL must look like redis://host:port (no scheme found)",
        ));
    };
    let tls = match scheme {
        "redis" | "redis-cluster" | "redis-sentinel" | "valkey" | "valkey-cluster"
        | "valkey-sentinel" => false,
        "rediss" | "rediss-cluster" | "rediss-sentinel" | "valkeys" | "valkeys-cluster"
        | "valkeys-sentinel" => {
            if !cfg!(feature = "tls") {
                return Err(Error::invalid(format!(
                    "{scheme}:// needs redlease's `tls` feature; without it the connection \
                     would not be encrypted"
                )));
            }
            true
        }
        other => {
            return Err(Error::invalid(format!(
            "unsupported Redis URL scheme {other:?}: use redis://, rediss://, redis-cluster:// or redis-sentinel://"
        )))
        }
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    if host.is_empty() || host.starts_with(':') {
        return Err(Error::invalid("Redis URL has no host"));
    }
    Ok(tls)
}

impl RedisBackend {
    /// Connects with default [`RedisOptions`]. Fails with [`Error::InvalidConfig`] for a bad
    /// URL, a server older than Redis 7.0 or one that may evict keys (see
    /// [`RedisOptions::allow_eviction`]), or a `rediss://` URL whose server does not speak
    /// TLS, and [`Error::Backend`] when the server does not answer within the connect timeout
    /// (or a TLS handshake fails: the message says why).
    ///
    /// It also opens the pub/sub connection, and checks that release messages reach it (see
    /// [`wakes_by_message`](Self::wakes_by_message)).
    ///
    /// A URL's `user:password@` authenticates with ACL `AUTH`; `/N` selects database N.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Connects with the given options.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self> {
        // Boxed, as is every large fred future here: debug builds copy futures through the
        // stack, and small stacks (async-std's `block_on` thread) overflow otherwise.
        Box::pin(Self::open(url, options, true)).await
    }

    /// Returns at once, without waiting for the server: the connection is made, and remade,
    /// in the background, and commands wait for it (up to the command timeout). For a
    /// [`Redlock`](crate::Redlock) node that may be down when the application starts.
    /// Fails only with [`Error::InvalidConfig`] for a bad URL or options. (A cluster URL
    /// waits for one of its nodes to say which primary serves which slots.)
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::backend::{Attempt, Backend, Claim, NodeTerms};
    /// use redlease::{LeaseKey, RedisBackend, RedisOptions, Token};
    /// # futures::executor::block_on(async {
    /// // Nothing listens on port 1; the backend is made anyway...
    /// let node = RedisBackend::connect_lazy("redis://127.0.0.1:1", RedisOptions::new()).await?;
    /// // ...and a quorum member's call fails at once instead of waiting for it.
    /// let claim = Claim::new(LeaseKey::new("doc:", "job"), Token::random(), Duration::from_secs(1));
    /// let fast = NodeTerms::new().fail_fast(true);
    /// assert!(node.acquire(&claim, Attempt::Once, fast).await.is_err());
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub async fn connect_lazy(url: &str, options: RedisOptions) -> Result<Self> {
        Box::pin(Self::open(url, options, false)).await
    }

    async fn open(url: &str, options: RedisOptions, wait: bool) -> Result<Self> {
        options.validate()?;
        let tls = uses_tls(url)?;
        #[cfg(feature = "tls")]
        if !tls && options.tls.is_set() {
            return Err(Error::invalid(
                "TLS options are set but the URL is not rediss://: the connection would not \
                 be encrypted",
            ));
        }
        let target = match options.transport {
            Transport::Fred => transport::fred::open(url, tls, &options, wait).await?,
            #[cfg(feature = "redis-rs")]
            Transport::RedisRs => transport::redis_rs::open(url, &options, wait).await?,
        };
        Self::with_options_over(target, &options, wait).await
    }

    /// The backend over what a client opened, with `options`' checks (eviction policy,
    /// replica acknowledgement) and restart quarantine.
    pub(super) async fn with_options_over(
        target: Target,
        options: &RedisOptions,
        wait: bool,
    ) -> Result<Self> {
        let checks = Checks {
            allow_eviction: options.allow_eviction,
            ack: options.replica_ack,
        };
        Self::of_target(target, checks, wait)
            .await?
            .with_restart_quarantine(options.restart_quarantine)
    }

    /// The backend over what a client opened: one server, or a cluster (one connection per
    /// primary, see `shards`: the seeds are asked for the slot table now, whether or not the
    /// call waits, as a cluster's routes must be known).
    pub(super) async fn of_target(target: Target, checks: Checks, wait: bool) -> Result<Self> {
        match target {
            Target::Single(node) => Box::pin(Self::assemble(node, false, wait, checks)).await,
            Target::Cluster { seeds, connector } => {
                Box::pin(super::shards::Shards::backend(seeds, connector, checks)).await
            }
        }
    }

    /// The backend over one server's connections (`clustered`: a cluster node, where a script
    /// call may touch one slot only): loads the scripts on every connection, and (with
    /// `wait`) connects now and checks the server.
    pub(super) async fn assemble(
        node: Node,
        clustered: bool,
        wait: bool,
        checks: Checks,
    ) -> Result<Self> {
        let Node {
            connection,
            subscriber,
        } = node;
        let policy = Arc::new(Policy::new(checks.allow_eviction));
        let ack = checks.ack;
        let scripts = Scripts::new(clustered);
        // Counted for the acknowledgements: a WAIT on a remade connection counts nothing.
        let reconnects = Arc::new(AtomicU64::new(0));
        let counted = reconnects.clone();
        // Every connection (the first, and each after a reconnect: a restarted server has
        // no scripts) loads the scripts, so that calls are one EVALSHA, not a NOSCRIPT round
        // trip plus a reload that later commands could overtake.
        // Each connection also reads the server's eviction policy (a server can be
        // reconfigured, or replaced, between two connections).
        let all = scripts.all();
        let reloader = connection.clone();
        let watched = policy.clone();
        // Told to the watchdog after each reconnect (see `Backend::disturbed`): the server
        // may have restarted empty, or be another one.
        let disturbance = Arc::new(event_listener::Event::new());
        let disturb = disturbance.clone();
        // Taken before the first connection, whose notice it sees too.
        let mut events = connection.reconnects();
        // The connection's tasks and this listener run where the client runs them: on the
        // caller's tokio runtime, or the crate's own one.
        in_tokio(async move {
            drop(tokio::spawn(async move {
                while events.next().await.is_some() {
                    counted.fetch_add(1, Ordering::AcqRel);
                    let loads = all.iter().map(|s| load(&*reloader, s));
                    let _ = futures::future::join_all(loads).await;
                    watched.read(&*reloader).await;
                    // After the scripts and the policy: the check that follows finds both.
                    disturb.notify(usize::MAX);
                }
            }));
        })
        .await;
        if wait {
            connection.connect().await?;
            // A user whose ACL refuses INFO is not refused here: the version stays unknown.
            if let Some(info) = info(&*connection, "server").await {
                check_version(&info)?;
                ack.check_server(&info)?;
            }
            if let Some(info) = info(&*connection, "memory").await {
                policy.observe(&info);
            }
            policy.check()?;
            // Also here, so that they are there when `connect` returns. try_join_all keeps
            // the loads on the heap: a client's futures may be large.
            let all = scripts.all();
            futures::future::try_join_all(all.iter().map(|s| load(&*connection, s)))
                .await
                .map_err(Error::backend)?;
        } else {
            connection.connect_lazily().await;
        }
        let pubsub = Arc::new(PubSub::new(subscriber, connection.clone(), clustered));
        if wait {
            // Now rather than at the first wait: a user whose ACL refuses the lock channels
            // is told at connect (a lazy backend checks at its first wait).
            Box::pin(pubsub.connect()).await;
        }
        let inner = Arc::new(Inner {
            connection,
            scripts,
            pubsub,
            clustered,
            ops: Batcher::default(),
            policy,
            acks: super::acks::Acks::new(ack, reconnects),
            demoted: Demoted::default(),
            disturbance,
        });
        if !inner.policy.allowed {
            let watched = Arc::downgrade(&inner);
            in_tokio(async move { drop(tokio::spawn(watch_policy(watched))) }).await;
        }
        Ok(RedisBackend {
            shards: None,
            inner,
            quarantine: Duration::ZERO,
        })
    }

    /// Resolves when connected (at once if connected already); `false` if the client gave
    /// up on the first connection.
    pub(super) async fn ready(&self) -> bool {
        self.inner.connection.ready().await
    }
}

/// `SCRIPT LOAD` of `script` on `connection`.
pub(super) async fn load(connection: &dyn Connection, script: &Script) -> Said<()> {
    let args = vec![Value::from("LOAD"), Value::from(script.text())];
    connection.command("SCRIPT", args).await.map(drop)
}

/// `INFO section`'s text; `None` if the server did not answer or refused it.
async fn info(connection: &dyn Connection, section: &'static str) -> Option<String> {
    let reply = connection.command("INFO", vec![section.into()]).await;
    reply.ok().and_then(|v| v.as_string())
}

/// After a `READONLY`: the connection is remade (at most once a second), so that a client
/// behind Sentinel asks the sentinels for the primary again. (A lease whose extension was
/// answered `READONLY` is lost: see `extend.rs`.)
#[derive(Default)]
pub(super) struct Demoted {
    last: Mutex<Option<Instant>>,
}

impl Demoted {
    pub(super) fn reconnect(&self, connection: &dyn Connection) {
        {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return;
            }
            *last = Some(Instant::now());
        }
        tracing::warn!(
            "the Redis server answered READONLY: it is a replica now; reconnecting to find the \
             primary"
        );
        connection.reconnect();
    }
}

/// How often a backend that refuses an evicting server reads the server's eviction policy
/// when nothing else does (the watchdog's extension calls read it too, see
/// [`Policy::read_in`]): a policy changed at run time is seen within this long.
pub(super) const POLICY_EVERY: Duration = Duration::from_secs(1);

/// A policy read this recently is not read again by an extension call.
const POLICY_FRESH: Duration = Duration::from_millis(100);

/// Reads the server's eviction policy every [`POLICY_EVERY`] while the backend lives; when
/// it turns evicting, the watchdog is told (`Backend::disturbed`), whose check of every lease
/// then finds them lost.
async fn watch_policy(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(POLICY_EVERY).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if inner.policy.read(&*inner.connection).await {
            inner.disturbance.notify(usize::MAX);
        }
    }
}

/// The server's eviction policy as last read, and whether an evicting one is accepted.
pub(super) struct Policy {
    allowed: bool,
    /// Set while the server's policy may evict keys and that is not accepted.
    refusing: AtomicBool,
    /// The policy last read.
    name: Mutex<String>,
    /// When it was last read.
    read_at: Mutex<Option<Instant>>,
}

impl Policy {
    fn new(allowed: bool) -> Self {
        Policy {
            allowed,
            refusing: AtomicBool::new(false),
            name: Mutex::new(String::new()),
            read_at: Mutex::new(None),
        }
    }

    /// Reads the policy (`INFO memory`) on `client`, within a second; `true` if it has just
    /// turned to one that is refused. A server that does not answer changes nothing.
    pub(super) async fn read(&self, connection: &dyn Connection) -> bool {
        let was = self.refusing();
        let info = tokio::time::timeout(POLICY_EVERY, info(connection, "memory")).await;
        if let Ok(Some(info)) = info {
            self.observe(&info);
        }
        !was && self.refusing()
    }

    /// For an extension call: reads the policy (in a tokio context) unless it was read in
    /// the last [`POLICY_FRESH`] or an evicting server is accepted, so that a policy changed
    /// at run time is seen by the next round; `true` while a refused policy holds.
    pub(super) async fn read_in(&self, connection: &dyn Connection) -> bool {
        if self.allowed {
            return false;
        }
        let stale = {
            let mut at = self.read_at.lock().unwrap_or_else(|p| p.into_inner());
            let stale = at.is_none_or(|t| t.elapsed() >= POLICY_FRESH);
            if stale {
                *at = Some(Instant::now());
            }
            stale
        };
        if stale {
            in_tokio(self.read(connection)).await;
        }
        self.refusing()
    }

    /// Whether the server's policy, as last read, may evict keys and that is not accepted.
    pub(super) fn refusing(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
    }

    /// Takes note of the policy in `info` (an `INFO memory` reply); a reply that does not
    /// say changes nothing (an ACL refusing INFO lets the server through unchecked).
    fn observe(&self, info: &str) {
        *self.read_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        let Some(policy) = info
            .lines()
            .find_map(|l| l.strip_prefix("maxmemory_policy:"))
            .map(str::trim)
        else {
            return;
        };
        let evicts = policy != "noeviction";
        if evicts && self.allowed {
            tracing::warn!(
                policy,
                "the Redis server may evict keys (maxmemory-policy {policy}): a lease evicted \
                 under memory pressure frees its lock while the holder still holds it"
            );
        }
        *self.name.lock().unwrap_or_else(|p| p.into_inner()) = policy.to_owned();
        self.refusing
            .store(evicts && !self.allowed, Ordering::Release);
    }

    /// Refuses while the server may evict keys and that is not accepted.
    pub(super) fn check(&self) -> Result<()> {
        if !self.refusing.load(Ordering::Acquire) {
            return Ok(());
        }
        let name = self.name.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Err(Error::invalid(format!(
            "the Redis server's maxmemory-policy is {name}: it may evict lease keys and free \
             locks behind their holders; set it to noeviction (CONFIG SET maxmemory-policy \
             noeviction, and in redis.conf), or accept the risk with \
             RedisOptions::allow_eviction(true)"
        )))
    }
}

/// Refuses a server older than Redis 7.0 (the scripts use `SET ... NX GET`), from its
/// `INFO server`; a server that does not say passes (the scripts then say what fails).
pub(super) fn check_version(info: &str) -> Result<()> {
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(str::trim);
    let major = version.and_then(|v| v.split('.').next()?.parse::<u32>().ok());
    match (version, major) {
        (Some(v), Some(m)) if m < 7 => Err(Error::invalid(format!(
            "redlease needs Redis 7.0 or later; the server runs Redis {v}"
        ))),
        _ => Ok(()),
    }
}

impl Redlock {
    /// Connects to one Redis server per URL (independent masters), with default options.
    /// Returns once a majority is connected; the others keep connecting in the background.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad URL or no URL; [`Error::QuorumNotReached`] if a
    /// majority does not connect within the connect timeout.
    pub async fn connect(urls: &[&str]) -> Result<Self> {
        Self::connect_with(urls, RedisOptions::default(), RedlockOptions::default()).await
    }

    /// [`connect`](Self::connect) with connection and Redlock options.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with(
        urls: &[&str],
        redis: RedisOptions,
        options: RedlockOptions,
    ) -> Result<Self> {
        options.validate()?;
        if urls.is_empty() {
            return Err(Error::invalid("a Redlock needs at least one node URL"));
        }
        for (i, url) in urls.iter().enumerate() {
            if urls[..i].contains(url) {
                return Err(Error::invalid(format!(
                    "Redlock node {url} is listed twice: one server would count as two nodes"
                )));
            }
        }
        let mut nodes = Vec::with_capacity(urls.len());
        for url in urls {
            nodes.push(RedisBackend::connect_lazy(url, redis.clone()).await?);
        }
        let required = urls.len() / 2 + 1;
        let deadline = Instant::now() + redis.connect_timeout;
        let mut connecting: FuturesUnordered<_> = nodes.iter().map(RedisBackend::ready).collect();
        let mut connected = 0;
        while connected < required {
            match runtime::until(Some(deadline), connecting.next()).await {
                Some(Some(true)) => connected += 1,
                Some(Some(false)) => {}
                Some(None) | None => {
                    return Err(Error::QuorumNotReached {
                        acquired: connected,
                        required,
                    })
                }
            }
        }
        drop(connecting);
        Self::with_options(nodes, options)
    }
}

#[cfg(test)]
mod tests {
    use super::check_version;

    #[test]
    fn servers_older_than_redis_7_are_refused_with_their_version() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        let Err(err) = check_version(&info("6.2.14")) else {
            panic!("Redis 6.2.14 accepted");
        };
        let err = err.to_string();
        assert!(
            err.contains("7.0 or later") && err.contains("6.2.14"),
            "{err}"
        );
        assert!(check_version(&info("7.0.15")).is_ok());
        assert!(check_version(&info("8.2.1")).is_ok());
        assert!(
            check_version("# Server\r\n").is_ok(),
            "no version: not refused"
        );
    }
}
