//! `RedisBackend`: leases on one Redis server (a Redis Cluster, a primary behind Sentinel),
//! through a client behind the seam in `transport` (fred, or redis-rs with its feature). All
//! client and Lua code of the crate lives under this module, by concern: `transport` (what
//! the backend needs of a client, and each client's code in a module of its own), `connect`
//! (URLs, options, the backend over a client's connections), `errors` (the server's errors,
//! read), `acks`
//! (replica acknowledgement), `keys` (the key layout, documented there), `ops` (acquire and
//! release, with group commit in `batch`), `extend`, `pubsub` (wake-ups), `fenced` (fenced
//! writes), `cache` (the stampede cache's values), `shards` (a Redis Cluster, one connection
//! per primary), and the scripts in `scripts/`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::backend::{
    Acquire, Attempt, Backend, Capabilities, Claim, ClaimKind, Extended, Lease, NodeTerms, Release,
    Subscription,
};
use crate::error::{Error, Result};
use crate::info::LockInfo;
use crate::token::LeaseKey;

/// On a cluster (`$self.shards`), runs `$call` on the backend of the primary that serves
/// `$key`, bound to `$node`, and returns its result from the enclosing function; again after
/// a redirection or a slot migration's `TRYAGAIN` (such a call ran nothing; see
/// `Shards::redirected`). Elsewhere, does nothing: the caller goes on to serve the call.
macro_rules! on_shard {
    ($self:ident, $key:expr, |$node:ident| $call:expr) => {
        if let Some(shards) = &$self.shards {
            let (mut moves, since) = (0, std::time::Instant::now());
            loop {
                let seen = shards.generation();
                let $node = shards.node($key).await?;
                // Boxed: the node's call is this same function (on a backend with no shards).
                let result = Box::pin($call).await;
                if !shards.redirected(&result, seen, &mut moves, since).await {
                    return result;
                }
            }
        }
    };
}

mod acks;
mod batch;
mod cache;
mod connect;
mod errors;
mod extend;
mod fenced;
mod keys;
mod ops;
mod options;
mod pubsub;
mod shards;
mod transport;

pub use acks::ReplicaAck;
pub use fenced::FencedWrite;
pub use options::RedisOptions;
#[cfg(feature = "tls")]
pub use transport::TlsOptions;
pub use transport::Transport;

use keys::{part, Part};
use ops::{Op, TOMBSTONE};
use transport::{Connection, Script, Value};

/// Leases on a Redis server (`redis://`, `rediss://` with the `tls` feature), a Redis
/// Cluster (`redis-cluster://`) or the primary that Sentinel names (`redis-sentinel://`),
/// through one multiplexed connection plus, once someone waits, one pub/sub connection (fred's
/// by default; redis-rs' with [`RedisOptions::transport`]);
/// on a cluster, those per primary, each lock's calls going to the primary that serves its
/// slot (so a primary that is down fails only the locks it serves). Serves every kind of
/// lock: plain, fair, reentrant, read-write and semaphores. Grants can wait for replicas: see
/// [`RedisOptions::replica_ack`].
///
/// Reconnects are automatic (unlimited, exponential back-off up to 1 s); every command has a
/// timeout, so no call hangs on a dead or paused server. The client runs in a tokio context:
/// the caller's tokio runtime, or a private one when the caller runs smol or async-std.
///
/// ```no_run
/// # async fn demo() -> redlease::Result<()> {
/// let backend = redlease::RedisBackend::connect("redis://127.0.0.1:6379").await?;
/// let locks = redlease::LockManager::new(backend);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    /// The connection (on a cluster, to the first primary that answered).
    inner: Arc<Inner>,
    /// On a cluster: every primary's backend, and the slot table that routes to them.
    shards: Option<Arc<shards::Shards>>,
    /// The restart quarantine (zero: off); see `RedisOptions::restart_quarantine`.
    quarantine: Duration,
}

struct Inner {
    /// The command connection, through the client's side of the seam.
    connection: Arc<dyn Connection>,
    scripts: Scripts,
    pubsub: Arc<pubsub::PubSub>,
    clustered: bool,
    ops: batch::Batcher<Op, ops::Outcome>,
    /// The server's eviction policy (read at every connection): new acquires are refused
    /// while it may evict leases, unless that is accepted.
    policy: Arc<connect::Policy>,
    /// Replica acknowledgement of grants and extensions (`None`: off).
    acks: Option<acks::Acks>,
    /// Remakes the connection when the server turns out to be a replica.
    demoted: connect::Demoted,
    /// Notified after each reconnect, and when the eviction policy turns to a refused one:
    /// see [`Backend::disturbed`].
    disturbance: Arc<event_listener::Event>,
}

struct Scripts {
    acquire: Script,
    extend: Script,
    release: Script,
    fence: Script,
    fair_acquire: Script,
    inspect: Script,
    reentrant_acquire: Script,
    reentrant_release: Script,
    reentrant_extend: Script,
    shared_acquire: Script,
    shared_extend: Script,
    fenced_set: Script,
    cache_read: Script,
    cache_fill: Script,
    cache_fail: Script,
    force_release: Script,
}

impl Scripts {
    /// The scripts; on a cluster node (`sharded`), with their wake-ups published to the
    /// lock's shard only (`SPUBLISH`, which its waiters `SSUBSCRIBE` to: a cluster sends a
    /// plain `PUBLISH` to every node, and its bus carries each release that many times).
    fn new(sharded: bool) -> Self {
        let lua = |text: &'static str| {
            if sharded {
                Script::new(text.replace("'PUBLISH'", "'SPUBLISH'"))
            } else {
                Script::new(text)
            }
        };
        // The scripts that read the lock record share `prelude.lua` (the record's helpers;
        // in a batch, one lease's failure is its own).
        macro_rules! leases {
            ($file:literal) => {
                lua(concat!(
                    include_str!("redis/scripts/prelude.lua"),
                    include_str!(concat!("redis/scripts/", $file))
                ))
            };
        }
        Scripts {
            acquire: leases!("acquire.lua"),
            extend: leases!("extend.lua"),
            release: leases!("release.lua"),
            fence: leases!("fence.lua"),
            fair_acquire: leases!("fair_acquire.lua"),
            inspect: leases!("inspect.lua"),
            reentrant_acquire: leases!("reentrant_acquire.lua"),
            reentrant_release: leases!("reentrant_release.lua"),
            reentrant_extend: leases!("reentrant_extend.lua"),
            shared_acquire: leases!("shared_acquire.lua"),
            shared_extend: leases!("shared_extend.lua"),
            fenced_set: lua(include_str!("redis/scripts/fenced_set.lua")),
            cache_read: leases!("cache_read.lua"),
            cache_fill: leases!("cache_fill.lua"),
            cache_fail: leases!("cache_fail.lua"),
            force_release: leases!("force_release.lua"),
        }
    }

    /// The scripts every connection loads (the cache's load on first use).
    fn all(&self) -> Arc<[Script]> {
        Arc::new([
            self.acquire.clone(),
            self.extend.clone(),
            self.release.clone(),
            self.fence.clone(),
            self.fair_acquire.clone(),
            self.inspect.clone(),
            self.reentrant_acquire.clone(),
            self.reentrant_release.clone(),
            self.reentrant_extend.clone(),
            self.shared_acquire.clone(),
            self.shared_extend.clone(),
        ])
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("server", &self.inner.connection.server())
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.connection.quit();
        self.pubsub.subscriber.quit();
    }
}

impl RedisBackend {
    /// Whether the command connection is up now (on a cluster, the connection to the first
    /// primary that answered at connect). `false` while it is being remade: a quorum's
    /// member is then skipped at once (see [`NodeTerms::fail_fast`]).
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// let backend = redlease::RedisBackend::connect("redis://127.0.0.1:6379").await?;
    /// assert!(backend.is_connected());
    /// # Ok(()) }
    /// ```
    pub fn is_connected(&self) -> bool {
        self.inner.connection.is_connected()
    }

    /// Whether waiters are woken by a message when a lock is released (`true`), or find a
    /// free lock only by their fallback re-check (`false`: a hand-off then takes up to the
    /// [`RetryPolicy`](crate::RetryPolicy)'s `max_delay` instead of a round trip).
    ///
    /// `false` when the check made as the pub/sub connection opens found that the ACL user
    /// may not SUBSCRIBE or PUBLISH to the lock channels (a warning is logged then too). The
    /// check runs at [`connect`](Self::connect) and [`from_client`](Self::from_client), and
    /// at a lazy backend's first wait (`true` until then). It uses a channel named as the
    /// lock channels are under the default key prefix, `redlease:{…}:released`; on a Redis
    /// Cluster it sees a refused PUBLISH only.
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// let backend = redlease::RedisBackend::connect("redis://app:pw@127.0.0.1:6379").await?;
    /// if !backend.wakes_by_message() {
    ///     eprintln!("waiters will poll: grant the user +subscribe +publish &redlease:*");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn wakes_by_message(&self) -> bool {
        self.inner.pubsub.by_message()
    }

    /// The keys of a lock script's call: the locks' `keys`, and on a cluster the keys beside
    /// each (see [`keys::BESIDE`]).
    fn declared(&self, mut keys: Vec<String>) -> Vec<String> {
        if self.inner.clustered {
            let beside: Vec<String> = keys
                .iter()
                .flat_map(|k| keys::BESIDE.iter().map(move |s| format!("{k}:{s}")))
                .collect();
            keys.extend(beside);
        }
        keys
    }

    /// The backend that serves `key`: on a cluster, its primary's; elsewhere this one.
    pub(super) async fn serving(&self, key: &str) -> Result<RedisBackend> {
        match &self.shards {
            Some(shards) => shards.node(key).await,
            None => Ok(self.clone()),
        }
    }

    /// Runs `script` (EVALSHA; on NOSCRIPT, SCRIPT LOAD and EVALSHA again). An error that
    /// says the server is a replica now (`READONLY`: a demoted primary) has the connection
    /// remade; the batched scripts' entries are looked at where they are read (`ops.rs`,
    /// `extend.rs`).
    async fn eval(&self, script: &Script, keys: Vec<String>, args: Vec<Value>) -> Result<Value> {
        let connection = &*self.inner.connection;
        let mut reply = connection.evalsha(script.sha(), &keys, &args).await;
        if reply.as_ref().is_err_and(|f| f.is("NOSCRIPT")) {
            // A server restarted (or flushed) since the connection loaded its scripts.
            reply = match connect::load(connection, script).await {
                Ok(()) => connection.evalsha(script.sha(), &keys, &args).await,
                Err(f) => Err(f),
            };
        }
        reply.map_err(|f| {
            self.said(&f.said);
            errors::store_error(f)
        })
    }

    /// Takes note of a server's error (a call's, or one entry's): a `READONLY` has the
    /// connection remade (see `connect::Demoted`).
    fn said(&self, error: &str) {
        if errors::readonly(error) {
            self.inner.demoted.reconnect(&*self.inner.connection);
        }
    }
}

impl RedisBackend {
    /// [`Backend::acquire`], numbered `sent` (on a cluster, the same number on whichever
    /// primary serves the key, also after a redirection).
    async fn acquire_sent(
        &self,
        claim: &Claim,
        attempt: Attempt,
        terms: NodeTerms,
        sent: u64,
    ) -> Result<Acquire> {
        keys::check_ttl(claim.ttl)?;
        claim.check_token()?;
        on_shard!(self, claim.key.as_str(), |node| node
            .acquire_sent(claim, attempt, terms, sent));
        self.inner.policy.check()?;
        self.check_connected(terms)?;
        // Boxed: most backends have acknowledgement off, and their calls' futures stay small.
        let mark = match self.inner.acks {
            Some(_) => Box::pin(self.ack_mark()).await,
            None => None,
        };
        let acquired = match &claim.kind {
            ClaimKind::Plain => {
                let op = Op::Acquire {
                    claim: claim.clone(),
                    attempt,
                    terms,
                    sent,
                };
                ops::acquired(claim, self.op(op).await?)?
            }
            // Fair claims are not served over Redlock: the minimum uptime is a single
            // server's restart quarantine.
            ClaimKind::Fair => {
                let op = Op::Fair {
                    claim: claim.clone(),
                    attempt,
                    min_uptime: terms.min_uptime,
                    sent,
                };
                ops::acquired(claim, self.op(op).await?)?
            }
            // Boxed: inline, its state would make every plain acquire's future larger (and
            // slower to move).
            ClaimKind::Reentrant(owner) => {
                Box::pin(self.reentrant_acquire(claim, owner, attempt, terms, sent)).await?
            }
            ClaimKind::Permit(0) => {
                return Err(Error::invalid("a semaphore needs at least one permit"))
            }
            // Not served over Redlock either: the minimum uptime is as for fair claims.
            ClaimKind::Read | ClaimKind::Permit(_) => {
                let permits = match claim.kind {
                    ClaimKind::Permit(n) => n,
                    _ => 0,
                };
                let op = Op::Shared {
                    claim: claim.clone(),
                    permits,
                    attempt,
                    min_uptime: terms.min_uptime,
                    sent,
                };
                ops::acquired(claim, self.op(op).await?)?
            }
        };
        match acquired {
            // Reported once the replicas have it (with acknowledgement on; boxed, as above).
            Acquire::Granted(grant) if mark.is_some() => {
                Box::pin(self.grant_acknowledged(claim, grant, mark)).await
            }
            other => Ok(other),
        }
    }

    /// [`Backend::release`], numbered `sent` (as for `acquire_sent`).
    async fn release_sent(
        &self,
        claim: &Claim,
        how: Release<'_>,
        sent: u64,
    ) -> Result<Option<u32>> {
        claim.check_token()?;
        on_shard!(self, claim.key.as_str(), |node| node
            .release_sent(claim, how, sent));
        let lease = match how {
            Release::Confirmed { lease } => Some(lease),
            Release::Abandon => None,
        };
        // Boxed, as in `acquire`. (Shared holds are released with the plain leases: the
        // script tells them by their token.)
        if let ClaimKind::Reentrant(owner) = &claim.kind {
            return Box::pin(self.reentrant_release(claim, owner, lease, sent)).await;
        }
        let op = Op::Release {
            key: claim.key.clone(),
            token: claim.token.clone(),
            tombstone: if lease.is_some() {
                Duration::ZERO
            } else {
                TOMBSTONE
            },
            sent,
        };
        let (released, _) = self.op(op).await?;
        Ok((released == 1).then_some(0))
    }
}

impl RedisBackend {
    /// This backend with a restart quarantine (see
    /// [`RedisOptions::restart_quarantine`](crate::RedisOptions::restart_quarantine)): for
    /// one made with [`from_client`](Self::from_client), which takes no options. Zero turns
    /// it off; one longer than the longest TTL (a year) is refused with
    /// [`Error::InvalidConfig`].
    ///
    /// ```no_run
    /// # async fn demo(client: fred::clients::Client) -> redlease::Result<()> {
    /// use std::time::Duration;
    /// let backend = redlease::RedisBackend::from_client(client)
    ///     .await?
    ///     .with_restart_quarantine(Duration::from_secs(30))?;
    /// # Ok(()) }
    /// ```
    pub fn with_restart_quarantine(mut self, d: Duration) -> Result<Self> {
        check_quarantine(d)?;
        self.quarantine = d;
        Ok(self)
    }

    /// `terms` for an acquire of a lease of `ttl`, with the restart quarantine (unless a
    /// quorum asks for its own uptime): the server grants nothing until it has been up that
    /// long. A lease longer than the quarantine could outlive it: refused.
    fn quarantined(&self, terms: NodeTerms, ttl: Duration) -> Result<NodeTerms> {
        if self.quarantine.is_zero() || !terms.min_uptime.is_zero() {
            return Ok(terms);
        }
        if ttl > self.quarantine {
            return Err(self.too_long(ttl));
        }
        Ok(terms.min_uptime(self.quarantine))
    }

    /// Whether some of `leases` are longer than the restart quarantine (a quorum's own
    /// terms aside).
    fn quarantine_refuses(&self, leases: &[Lease<'_>], terms: NodeTerms) -> bool {
        !self.quarantine.is_zero()
            && terms.min_uptime.is_zero()
            && leases.iter().any(|l| l.ttl > self.quarantine)
    }

    fn too_long(&self, ttl: Duration) -> Error {
        Error::invalid(format!(
            "a lease of {ttl:?} is longer than the server's restart quarantine ({:?}), which \
             must outlast every lease granted before a restart",
            self.quarantine
        ))
    }
}

/// What the connections to a server check, besides the server's version: the eviction
/// policy and replica acknowledgement. A backend made from an application's client checks
/// the policy strictly and asks for no acknowledgement.
#[derive(Clone, Copy, Default)]
pub(super) struct Checks {
    pub(super) allow_eviction: bool,
    pub(super) ack: ReplicaAck,
}

/// A restart quarantine no TTL can reach would hold every grant back for good: refused.
fn check_quarantine(d: Duration) -> Result<()> {
    if d > crate::options::MAX_TTL {
        return Err(Error::invalid(format!(
            "the restart quarantine must be at most the longest TTL ({:?}), got {d:?}",
            crate::options::MAX_TTL
        )));
    }
    Ok(())
}

#[async_trait]
impl Backend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        // Numbered as it is made, before anything is awaited (see `ops::next_sent`).
        let sent = ops::next_sent();
        let terms = self.quarantined(terms, claim.ttl)?;
        self.acquire_sent(claim, attempt, terms, sent).await
    }

    async fn extend(&self, leases: &[Lease<'_>], terms: NodeTerms) -> Result<Vec<Extended>> {
        if self.quarantine_refuses(leases, terms) {
            // Only the leases within the quarantine go to the server.
            let within: Vec<Lease<'_>> = leases
                .iter()
                .filter(|l| l.ttl <= self.quarantine)
                .cloned()
                .collect();
            let mut answers = Box::pin(self.extend(&within, terms)).await?.into_iter();
            return Ok(leases
                .iter()
                .map(|l| match l.ttl <= self.quarantine {
                    true => answers
                        .next()
                        .unwrap_or_else(|| Extended::Failed(Error::backend("no answer"))),
                    false => Extended::Failed(self.too_long(l.ttl)),
                })
                .collect());
        }
        if let Some(shards) = &self.shards {
            return Ok(shards.extend(leases, terms).await);
        }
        self.extend_leases(leases, terms).await
    }

    /// On a cluster, the primary serving `key` now: each primary's leases are extended in a
    /// call of their own.
    fn extend_group(&self, key: &LeaseKey) -> u64 {
        self.shards.as_ref().map_or(0, |s| s.group(key.as_str()))
    }

    /// After a reconnect (of any primary, on a cluster), and when the eviction policy turns
    /// to one that may evict leases (unless that is accepted).
    fn disturbed(&self) -> BoxFuture<'static, ()> {
        match &self.shards {
            Some(shards) => shards.disturbed(),
            None => Box::pin(self.inner.disturbance.listen()),
        }
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        // Numbered as it is made, before anything is awaited (see `ops::next_sent`).
        self.release_sent(claim, how, ops::next_sent()).await
    }

    /// Plain and reentrant claims: one SUBSCRIBE per key's release channel and process,
    /// shared by the local waiters, a message waking one of them. Fair claims: the key's
    /// hand-off channel, a message (the new head's token) waking only the waiter it names.
    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        if let Some(shards) = &self.shards {
            // Kept on the node that serves the key, across slot moves.
            return shards.subscribe(claim).await;
        }
        let (channel, target) = match claim.kind {
            ClaimKind::Fair => (
                part(&claim.key, Part::Handoff),
                Some(claim.token.as_str().to_owned()),
            ),
            _ => (part(&claim.key, Part::Released), None),
        };
        self.inner.pubsub.subscribe(channel, false, target).await
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        on_shard!(self, key.as_str(), |node| node.inspect(key));
        let keys = vec![key.as_str().to_owned()];
        let reply = self
            .eval(&self.inner.scripts.inspect, self.declared(keys), Vec::new())
            .await?
            .into_array();
        let [pttl, fence, label, queued, owners, shared, labels] = <[Value; 7]>::try_from(reply)
            .map_err(|r| Error::backend(format!("inspect script returned {} values", r.len())))?;
        let int = |v: &Value| v.as_i64().unwrap_or(-1);
        let text = |v: &Value| v.as_string().filter(|s| !s.is_empty());
        let pttl = int(&pttl);
        let mut info = LockInfo::new();
        info.held = pttl != -2;
        info.remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
        info.fencing_token = text(&fence).and_then(|f| f.parse().ok());
        info.holder_label = text(&label);
        info.queue_len = u64::try_from(int(&queued)).unwrap_or(0);
        info.reentrant_count = u64::try_from(int(&owners)).ok();
        info.shared_holds = u64::try_from(int(&shared)).ok();
        if let Value::Array(labels) = labels {
            info.shared_labels = labels.iter().filter_map(|l| l.as_string()).collect();
        }
        Ok((!info.is_blank()).then_some(info))
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        on_shard!(self, key.as_str(), |node| node.raise_fence(key, at_least));
        let keys = vec![key.as_str().to_owned()];
        let args = vec![Value::from(at_least.to_string())];
        self.eval(&self.inner.scripts.fence, keys, args)
            .await
            .map(drop)
    }
}
