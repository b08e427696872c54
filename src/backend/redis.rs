//! `RedisBackend`: leases on one Redis server (or a Redis Cluster), through fred.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use event_listener::{Event, IntoNotification};
use fred::clients::SubscriberClient;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::prelude::{Builder, Client, Config, ReconnectPolicy};
use fred::types::config::UnresponsiveConfig;
use fred::types::scripts::Script;
use fred::types::InfoKind;
use fred::types::{FromValue, Key, Value};

use crate::backend::{
    clock_drift, Acquire, Backend, FairAttempt, Lease, NodeTerms, NotSent, ReentrantAcquire,
    Subscription, Waiting,
};
use crate::error::{Error, Result};
use crate::inspect::LockInfo;
use crate::reentrant::Owner;
use crate::runtime::{self, in_tokio, Rt};
use crate::token::{LeaseKey, Part, Token};

mod batch;

use batch::Batcher;

/// One acquire attempt, as queued for a batched script call.
#[derive(Clone)]
struct AcquireReq {
    key: LeaseKey,
    token: Token,
    ttl: Duration,
    waiting: Waiting,
    terms: NodeTerms,
}

/// One fair acquire attempt, as queued.
#[derive(Clone)]
struct FairReq {
    key: LeaseKey,
    token: Token,
    ttl: Duration,
    attempt: FairAttempt,
}

/// One release (tombstone zero) or abandon (tombstone > 0), as queued.
#[derive(Clone)]
struct ReleaseReq {
    key: LeaseKey,
    token: Token,
    tombstone: Duration,
}

/// Acquires and releases share one queue, so that they reach the server in the order they
/// were made: a release (or a quorum's clean-up) that a caller made before its next attempt
/// with the same token can never run after that attempt and delete its grant.
#[derive(Clone)]
enum Op {
    Acquire(AcquireReq),
    Fair(FairReq),
    Release(ReleaseReq),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquire,
    Fair,
    Release,
}

impl Op {
    fn kind(&self) -> Kind {
        match self {
            Op::Acquire(_) => Kind::Acquire,
            Op::Fair(_) => Kind::Fair,
            Op::Release(_) => Kind::Release,
        }
    }

    fn key(&self) -> &LeaseKey {
        match self {
            Op::Acquire(r) => &r.key,
            Op::Fair(r) => &r.key,
            Op::Release(r) => &r.key,
        }
    }

    fn into_acquire(self) -> Option<AcquireReq> {
        match self {
            Op::Acquire(r) => Some(r),
            _ => None,
        }
    }

    fn into_fair(self) -> Option<FairReq> {
        match self {
            Op::Fair(r) => Some(r),
            _ => None,
        }
    }

    fn into_release(self) -> Option<ReleaseReq> {
        match self {
            Op::Release(r) => Some(r),
            _ => None,
        }
    }
}

enum Reply {
    Acquire(Acquire),
    Release(bool),
}

/// Leases extended by one script call; bigger batches are split and the calls pipelined.
const EXTEND_CHUNK: usize = 256;

/// How long an abandoned attempt's token stays barred. A late copy of an attempt arrives
/// after a reconnect (seconds); this leaves a wide margin at the cost of one sorted-set entry
/// per abandoned attempt.
const TOMBSTONE: Duration = Duration::from_secs(300);

/// Connection settings for [`RedisBackend::connect_with`].
///
/// ```
/// use std::time::Duration;
/// let opts = redlease::RedisOptions::new()
///     .command_timeout(Duration::from_millis(500))
///     .connect_timeout(Duration::from_secs(2));
/// # let _ = opts;
/// ```
#[derive(Clone, Debug)]
pub struct RedisOptions {
    command_timeout: Duration,
    connect_timeout: Duration,
    max_command_attempts: u32,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            command_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            max_command_attempts: 3,
        }
    }
}

impl RedisOptions {
    /// The defaults: command timeout 2 s, connect timeout 5 s, 3 attempts per command.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long one command may take before it fails with [`Error::Backend`] (a paused
    /// server, a stalled network). A silent connection is also dropped and re-opened after
    /// twice this. Defaults to 2 s.
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// How long to wait for a connection (also the first one, in `connect`). Defaults to 5 s.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// How many times a command is sent when the connection drops while it is in flight.
    /// Every script is idempotent for the same token, so a re-sent command is harmless.
    /// Defaults to 3.
    pub fn max_command_attempts(mut self, n: u32) -> Self {
        self.max_command_attempts = n;
        self
    }

    /// See [`connect_timeout`](Self::connect_timeout).
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// See [`command_timeout`](Self::command_timeout).
    pub fn get_command_timeout(&self) -> Duration {
        self.command_timeout
    }

    fn validate(&self) -> Result<()> {
        let hour = Duration::from_secs(3600);
        for (name, t) in [
            ("command", self.command_timeout),
            ("connect", self.connect_timeout),
        ] {
            if t.is_zero() || t > hour {
                return Err(Error::invalid(format!(
                    "Redis {name} timeout must be above zero and at most an hour, got {t:?}"
                )));
            }
        }
        if self.max_command_attempts == 0 {
            return Err(Error::invalid("max_command_attempts must be at least 1"));
        }
        Ok(())
    }
}

/// Leases on a Redis server (`redis://`, `rediss://` with the `tls` feature) or a Redis
/// Cluster (`redis-cluster://`), through one multiplexed fred connection plus, once someone
/// waits, one pub/sub connection.
///
/// Reconnects are automatic (unlimited, exponential back-off up to 1 s); every command has a
/// timeout, so no call hangs on a dead or paused server. fred runs in a tokio context: the
/// caller's tokio runtime, or a private one when the caller runs smol or async-std.
///
/// ```no_run
/// # async fn demo() -> redlease::Result<()> {
/// let backend = redlease::RedisBackend::connect("redis://127.0.0.1:6379").await?;
/// let locks = redlease::LockManager::new(backend);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    scripts: Scripts,
    pubsub: Arc<PubSub>,
    clustered: bool,
    ops: Batcher<Op, Reply>,
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
}

impl Scripts {
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
        ])
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("server", &self.inner.client.client_config().server)
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let client = self.client.clone();
        let subscriber = self.pubsub.client.clone();
        Rt::current().spawn(async move {
            let _ = in_tokio(client.quit()).await;
            let _ = in_tokio(subscriber.quit()).await;
        });
    }
}

/// Checks the URL before fred sees it: fred would take `rediss://` without a TLS feature as
/// plain TCP, and only log it.
fn parse_url(url: &str) -> Result<Config> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::invalid(
            "Redis URL must look like redis://host:port (no scheme found)",
        ));
    };
    match scheme {
        "redis" | "redis-cluster" | "valkey" | "valkey-cluster" => {}
        "rediss" | "rediss-cluster" | "valkeys" | "valkeys-cluster" => {
            if !cfg!(feature = "tls") {
                return Err(Error::invalid(format!(
                    "{scheme}:// needs redlease's `tls` feature; without it the connection \
                     would not be encrypted"
                )));
            }
        }
        other => {
            return Err(Error::invalid(format!(
            "unsupported Redis URL scheme {other:?}: use redis://, rediss:// or redis-cluster://"
        )))
        }
    }
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    if host.is_empty() || host.starts_with(':') {
        return Err(Error::invalid("Redis URL has no host"));
    }
    // fred's message names the part that failed; it does not echo credentials.
    Config::from_url(url).map_err(|e| Error::invalid(format!("malformed Redis URL: {e}")))
}

impl RedisBackend {
    /// Connects with default [`RedisOptions`]. Fails with [`Error::InvalidConfig`] for a bad
    /// URL or a server older than Redis 7.0, and [`Error::Backend`] when the server does not
    /// answer within the connect timeout.
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
    /// Fails only with [`Error::InvalidConfig`] for a bad URL or options.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{Backend, LeaseKey, NodeTerms, RedisBackend, RedisOptions, Token, Waiting};
    /// # futures::executor::block_on(async {
    /// // Nothing listens on port 1; the backend is made anyway...
    /// let node = RedisBackend::connect_lazy("redis://127.0.0.1:1", RedisOptions::new()).await?;
    /// // ...and a quorum member's call fails at once instead of waiting for it.
    /// let key = LeaseKey::new("doc:", "job");
    /// let fast = NodeTerms::new().fail_fast(true);
    /// let (token, ttl) = (Token::random(), Duration::from_secs(1));
    /// let attempt = node.try_acquire_node(&key, &token, ttl, Waiting::No, fast);
    /// assert!(attempt.await.is_err());
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub async fn connect_lazy(url: &str, options: RedisOptions) -> Result<Self> {
        Box::pin(Self::open(url, options, false)).await
    }

    async fn open(url: &str, options: RedisOptions, wait: bool) -> Result<Self> {
        options.validate()?;
        let mut config = parse_url(url)?;
        let clustered = config.server.is_clustered();
        // The subscriber connects on first use, and fails then if the server is away.
        let subscriber_config = config.clone();
        config.fail_fast = wait;
        let mut builder = Builder::from_config(config);
        builder
            .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
            .with_performance_config(|p| p.default_command_timeout = options.command_timeout)
            .with_connection_config(|c| {
                c.connection_timeout = options.connect_timeout;
                c.internal_command_timeout = options.connect_timeout;
                c.max_command_attempts = options.max_command_attempts;
                let silent = options.command_timeout.saturating_mul(2);
                c.unresponsive = UnresponsiveConfig {
                    max_timeout: Some(silent),
                    interval: (silent / 4).max(Duration::from_millis(5)),
                };
            });
        let client = builder.build().map_err(Error::backend)?;
        builder.set_config(subscriber_config);
        let subscriber = builder.build_subscriber_client().map_err(Error::backend)?;
        let scripts = Scripts {
            acquire: Script::from_lua(include_str!("redis/acquire.lua")),
            extend: Script::from_lua(include_str!("redis/extend.lua")),
            release: Script::from_lua(include_str!("redis/release.lua")),
            fence: Script::from_lua(include_str!("redis/fence.lua")),
            fair_acquire: Script::from_lua(include_str!("redis/fair_acquire.lua")),
            inspect: Script::from_lua(include_str!("redis/inspect.lua")),
            reentrant_acquire: Script::from_lua(include_str!("redis/reentrant_acquire.lua")),
            reentrant_release: Script::from_lua(include_str!("redis/reentrant_release.lua")),
            reentrant_extend: Script::from_lua(include_str!("redis/reentrant_extend.lua")),
        };
        // Every connection (the first, and each after a reconnect: a restarted server has
        // no scripts) loads the scripts, so that calls are one EVALSHA, not a NOSCRIPT round
        // trip plus a reload that later commands could overtake.
        let all = scripts.all();
        let reloader = client.clone();
        // The connection tasks and this listener run where `init` runs them: on the
        // caller's tokio runtime, or the crate's own one.
        in_tokio(async {
            drop(reloader.clone().on_reconnect(move |_| {
                let (client, all) = (reloader.clone(), all.clone());
                async move {
                    let loads = all.iter().map(|s| s.load(&client));
                    let _ = futures::future::join_all(loads).await;
                    Ok(())
                }
            }))
        })
        .await;
        if wait {
            in_tokio(client.init()).await.map_err(Error::backend)?;
            // A user whose ACL refuses INFO is not refused here: the version stays unknown.
            if let Ok(info) = in_tokio(client.info::<String>(Some(InfoKind::Server))).await {
                check_version(&info)?;
            }
            // Also here, so that they are there when `connect` returns. try_join_all keeps
            // the loads on the heap: fred's futures are large.
            let all = scripts.all();
            in_tokio(futures::future::try_join_all(
                all.iter().map(|s| s.load(&client)),
            ))
            .await
            .map_err(Error::backend)?;
        } else {
            let connecting = client.clone();
            in_tokio(async move { drop(connecting.connect()) }).await;
        }
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                client,
                scripts,
                pubsub: Arc::new(PubSub {
                    client: subscriber,
                    ops: futures::lock::Mutex::new(false),
                    channels: Arc::default(),
                }),
                clustered,
                ops: Batcher::default(),
            }),
        })
    }

    /// Resolves when connected (at once if connected already); `false` if the client gave
    /// up on the first connection.
    pub(crate) async fn ready(&self) -> bool {
        in_tokio(self.inner.client.wait_for_connect()).await.is_ok()
    }

    /// The fred client underneath, for commands of your own on the same connection.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    async fn eval<R: FromValue>(
        &self,
        script: &Script,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<R> {
        in_tokio(script.evalsha_with_reload(&self.inner.client, keys, args))
            .await
            .map_err(Error::backend)
    }

    fn lease_keys(key: &LeaseKey) -> Vec<Key> {
        vec![
            key.as_str().into(),
            key.part(Part::Fence).into(),
            key.part(Part::Abandoned).into(),
        ]
    }

    /// The keys of one release: the lease's, plus the fair queue's (a release hands a free
    /// lock to the queue's head).
    fn release_keys(key: &LeaseKey) -> [Key; 5] {
        [
            key.as_str().into(),
            key.part(Part::Fence).into(),
            key.part(Part::Abandoned).into(),
            key.part(Part::Queue).into(),
            key.part(Part::Timeouts).into(),
        ]
    }

    /// Sends fair attempts as one script call; one reply per attempt, in order.
    async fn fair_batch(self, reqs: Vec<FairReq>) -> Result<Vec<Acquire>> {
        let mut keys: Vec<Key> = Vec::with_capacity(reqs.len() * 5);
        let mut args: Vec<Value> = Vec::with_capacity(reqs.len() * 6);
        for r in &reqs {
            keys.extend([
                r.key.as_str().into(),
                r.key.part(Part::Fence).into(),
                r.key.part(Part::Abandoned).into(),
                r.key.part(Part::Queue).into(),
                r.key.part(Part::Timeouts).into(),
            ]);
            // At least 1 ms for a waiter: 0 means a single attempt.
            let expire = r.attempt.expire().map_or(0, |e| ms(e).max(1));
            args.extend([
                r.token.as_str().into(),
                ms(r.ttl).into(),
                expire.into(),
                r.key.part(Part::Handoff).into(),
                r.token.label().unwrap_or_default().into(),
                fence_ttl(r.ttl).into(),
            ]);
        }
        let reply: Vec<i64> = self
            .eval(&self.inner.scripts.fair_acquire, keys, args)
            .await?;
        Self::acquire_replies(&reqs, |r| r.ttl, reply)
    }

    /// Decodes the `{1, fence} | {0, ms}` pairs of the acquire scripts.
    fn acquire_replies<R>(
        reqs: &[R],
        ttl: impl Fn(&R) -> Duration,
        reply: Vec<i64>,
    ) -> Result<Vec<Acquire>> {
        if reply.len() != reqs.len() * 2 {
            return Err(Error::backend(format!(
                "acquire script returned {} values for {} attempts",
                reply.len(),
                reqs.len()
            )));
        }
        let remaining = |pttl: i64| u64::try_from(pttl).ok().map(Duration::from_millis);
        reqs.iter()
            .zip(reply.chunks(2))
            .map(|(r, pair)| match pair {
                [1, fence] => Ok(Acquire::Acquired {
                    fencing_token: u64::try_from(*fence).unwrap_or(0),
                    validity: ttl(r).saturating_sub(clock_drift(ttl(r))),
                }),
                [0, pttl] => Ok(Acquire::Held {
                    remaining: remaining(*pttl),
                }),
                [2, wait] => Ok(Acquire::Warming {
                    remaining: remaining(*wait).unwrap_or_default(),
                }),
                other => Err(Error::backend(format!(
                    "unexpected reply from the acquire script: {other:?}"
                ))),
            })
            .collect()
    }

    /// Sends acquire attempts as one script call; one reply per attempt, in order.
    async fn acquire_batch(self, reqs: Vec<AcquireReq>) -> Result<Vec<Acquire>> {
        let mut keys = Vec::with_capacity(reqs.len() * 3);
        let mut args: Vec<Value> = Vec::with_capacity(reqs.len() * 8);
        for r in &reqs {
            keys.extend(Self::lease_keys(&r.key));
            // The waiters flag outlives the waiter's next re-check, so a release in between
            // still publishes.
            let flag = r
                .waiting
                .recheck()
                .map_or(0, |w| ms(w).saturating_mul(2).saturating_add(100));
            let arriving = i64::from(matches!(r.waiting, Waiting::Arriving { .. }));
            args.extend([
                r.token.as_str().into(),
                ms(r.ttl).into(),
                flag.into(),
                arriving.into(),
                // Lua numbers are doubles: exact up to 2^53, far above any token.
                r.terms.get_fence_floor().to_string().into(),
                ms(r.terms.get_min_uptime()).into(),
                r.token.label().unwrap_or_default().into(),
                fence_ttl(r.ttl).into(),
            ]);
        }
        let reply: Vec<i64> = self.eval(&self.inner.scripts.acquire, keys, args).await?;
        Self::acquire_replies(&reqs, |r| r.ttl, reply)
    }

    /// Sends releases and abandons as one script call; one reply per request, in order.
    async fn release_batch(self, reqs: Vec<ReleaseReq>) -> Result<Vec<bool>> {
        let mut keys = Vec::with_capacity(reqs.len() * 5);
        let mut args: Vec<Value> = Vec::with_capacity(reqs.len() * 4);
        for r in &reqs {
            keys.extend(Self::release_keys(&r.key));
            args.extend([
                r.token.as_str().into(),
                r.key.part(Part::Released).into(),
                ms(r.tombstone).into(),
                r.key.part(Part::Handoff).into(),
            ]);
        }
        let reply: Vec<i64> = self.eval(&self.inner.scripts.release, keys, args).await?;
        if reply.len() != reqs.len() {
            return Err(Error::backend("release script returned the wrong count"));
        }
        Ok(reply.into_iter().map(|n| n == 1).collect())
    }

    /// Sends `req` through `batcher` (group commit), or alone on a cluster, where a script
    /// may touch one slot only.
    async fn group_commit<Req, Resp, F, Fut>(
        &self,
        batcher: &Batcher<Req, Resp>,
        req: Req,
        keep: bool,
        send: F,
    ) -> Result<Resp>
    where
        Req: Clone + Send + 'static,
        Resp: Send + 'static,
        F: Fn(RedisBackend, Vec<Req>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<Vec<Resp>>> + Send + 'static,
    {
        if self.inner.clustered {
            return batch::single(send(self.clone(), vec![req]).await?);
        }
        let this = self.clone();
        batcher
            .call(req, keep, move |reqs| send(this.clone(), reqs))
            .await
    }

    async fn release_one(
        &self,
        key: &LeaseKey,
        token: &Token,
        tombstone: Duration,
    ) -> Result<bool> {
        let req = ReleaseReq {
            key: key.clone(),
            token: token.clone(),
            tombstone,
        };
        match self.op(Op::Release(req)).await? {
            Reply::Release(released) => Ok(released),
            Reply::Acquire(_) => Err(Error::backend("a release was answered as an acquire")),
        }
    }

    /// Sends one acquire or release through the shared queue.
    async fn op(&self, op: Op) -> Result<Reply> {
        // A release is sent even if its caller stops waiting for the answer.
        let keep = matches!(op, Op::Release(_));
        self.group_commit(&self.inner.ops, op, keep, RedisBackend::ops_batch)
            .await
    }

    /// Sends queued operations as few script calls as their order allows: operations on
    /// different keys may be regrouped freely, those on one key run in the order they were
    /// made. Each operation joins the first phase of its kind that is not before its key's
    /// previous operation (the same phase if of the same kind: a script runs its entries in
    /// order); phases are sent back to back, in order, on the one connection. Distinct keys
    /// (the common case) make at most one phase per kind.
    async fn ops_batch(self, ops: Vec<Op>) -> Result<Vec<Reply>> {
        let count = ops.len();
        let phases = if count == 1 {
            // A lone call (the inline path): no grouping to do.
            ops.iter().map(|op| (op.kind(), vec![0])).collect()
        } else {
            phases(ops.iter().map(|op| (op.kind(), op.key().as_str())))
        };
        let mut slots: Vec<Option<Op>> = ops.into_iter().map(Some).collect();
        let calls = phases.into_iter().map(|(kind, idx)| {
            let taken: Vec<Op> = idx.iter().filter_map(|&i| slots[i].take()).collect();
            let this = self.clone();
            async move {
                let replies: Vec<Reply> = match kind {
                    Kind::Acquire => {
                        let reqs = taken.into_iter().filter_map(Op::into_acquire).collect();
                        let replies = this.acquire_batch(reqs).await?;
                        replies.into_iter().map(Reply::Acquire).collect()
                    }
                    Kind::Fair => {
                        let reqs = taken.into_iter().filter_map(Op::into_fair).collect();
                        let replies = this.fair_batch(reqs).await?;
                        replies.into_iter().map(Reply::Acquire).collect()
                    }
                    Kind::Release => {
                        let reqs = taken.into_iter().filter_map(Op::into_release).collect();
                        let replies = this.release_batch(reqs).await?;
                        replies.into_iter().map(Reply::Release).collect()
                    }
                };
                if replies.len() != idx.len() {
                    return Err(Error::backend("a batched call returned the wrong count"));
                }
                Ok::<_, Error>((idx, replies))
            }
        });
        // Polled in order, each call is handed to the connection on its first poll: the
        // phases go out back to back, and the server runs them in that order.
        let calls: Vec<_> = calls.collect();
        let mut out: Vec<Option<Reply>> = (0..count).map(|_| None).collect();
        for phase in futures::future::join_all(calls).await {
            let (idx, replies) = phase?;
            for (i, reply) in idx.into_iter().zip(replies) {
                out[i] = Some(reply);
            }
        }
        out.into_iter()
            .map(|r| r.ok_or_else(|| Error::backend("a batched operation got no reply")))
            .collect()
    }

    /// Fails at once when the connection is down and the caller asked to (a quorum member
    /// that does not answer now is better skipped than waited for).
    fn check_connected(&self, terms: NodeTerms) -> Result<()> {
        if terms.get_fail_fast() && !self.inner.client.is_connected() {
            return Err(Error::backend(NotSent(format!(
                "not connected to {} (reconnecting)",
                self.inner
                    .client
                    .client_config()
                    .server
                    .hosts()
                    .first()
                    .map(|h| format!("{}:{}", h.host, h.port))
                    .unwrap_or_default()
            ))));
        }
        Ok(())
    }

    /// Splits a batch into script calls of at most [`EXTEND_CHUNK`] leases, per hash slot on
    /// a cluster (a script may only touch one slot there).
    fn chunks(&self, leases: &[Lease<'_>]) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        if self.inner.clustered {
            let mut by_slot: HashMap<u16, Vec<usize>> = HashMap::new();
            for (i, l) in leases.iter().enumerate() {
                let slot = fred::util::redis_keyslot(l.key.as_str().as_bytes());
                by_slot.entry(slot).or_default().push(i);
            }
            for idx in by_slot.into_values() {
                groups.extend(idx.chunks(EXTEND_CHUNK).map(<[usize]>::to_vec));
            }
        } else {
            let all: Vec<usize> = (0..leases.len()).collect();
            groups.extend(all.chunks(EXTEND_CHUNK).map(<[usize]>::to_vec));
        }
        groups
    }
}

/// Groups operations `(kind, key)` into phases (see `RedisBackend::ops_batch`): indices per
/// phase, in order.
fn phases<'a>(ops: impl Iterator<Item = (Kind, &'a str)>) -> Vec<(Kind, Vec<usize>)> {
    let mut phases: Vec<(Kind, Vec<usize>)> = Vec::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (i, (kind, key)) in ops.enumerate() {
        let after = last.get(key).copied();
        let fits = |p: usize| phases[p].0 == kind && after.is_none_or(|a| p >= a);
        let phase = match (0..phases.len()).find(|&p| fits(p)) {
            Some(p) => p,
            None => {
                phases.push((kind, Vec::new()));
                phases.len() - 1
            }
        };
        phases[phase].1.push(i);
        last.insert(key, phase);
    }
    phases
}

/// The fence hash's TTL when a lease of `ttl` is granted: an hour past the lease.
fn fence_ttl(ttl: Duration) -> i64 {
    ms(ttl).saturating_add(3_600_000)
}

/// How often, at the latest, an extended lease's fence hash gets its hour renewed: well
/// inside the hour a grant or renewal gives it.
const FENCE_RENEWAL: Duration = Duration::from_secs(30 * 60);

/// Milliseconds on the process's monotonic clock, for [`fence_due`].
fn fence_clock() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    u64::try_from(
        EPOCH
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

/// Whether an extension of `ttl` made at `now` (ms, [`fence_clock`]) also renews the fence
/// hash of `key`. Time is cut into slots of `ttl`, and a lease renews in one slot of every
/// `k = FENCE_RENEWAL / ttl`, picked by its key. A lease kept alive is extended at least once
/// per slot (each extension comes before the last one runs out), so it renews at least once
/// per `k` slots, that is every `FENCE_RENEWAL`; at a 30 s TTL, one extension in 60 does.
fn fence_due(key: &str, ttl: Duration, now: u64) -> bool {
    use std::hash::{Hash, Hasher};
    let slot_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
    let k = (u64::try_from(FENCE_RENEWAL.as_millis()).unwrap_or(u64::MAX) / slot_ms).max(1);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (now / slot_ms) % k == h.finish() % k
}

/// Refuses a server older than Redis 7.0 (the scripts use `SET ... NX GET`), from its
/// `INFO server`; a server that does not say passes (the scripts then say what fails).
fn check_version(info: &str) -> Result<()> {
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

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl Backend for RedisBackend {
    async fn try_acquire(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
    ) -> Result<Acquire> {
        self.try_acquire_node(key, token, ttl, waiting, NodeTerms::new())
            .await
    }

    async fn try_acquire_node(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
        terms: NodeTerms,
    ) -> Result<Acquire> {
        self.check_connected(terms)?;
        let req = AcquireReq {
            key: key.clone(),
            token: token.clone(),
            ttl,
            waiting,
            terms,
        };
        match self.op(Op::Acquire(req)).await? {
            Reply::Acquire(outcome) => Ok(outcome),
            Reply::Release(_) => Err(Error::backend("an acquire was answered as a release")),
        }
    }

    async fn extend(&self, leases: &[Lease<'_>]) -> Result<Vec<Option<Duration>>> {
        self.extend_node(leases, NodeTerms::new()).await
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        let keys = vec![Key::from(key.part(Part::Fence))];
        let args = vec![Value::from(at_least.to_string())];
        self.eval::<i64>(&self.inner.scripts.fence, keys, args)
            .await
            .map(drop)
    }

    async fn extend_node(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> Result<Vec<Option<Duration>>> {
        self.check_connected(terms)?;
        if leases.iter().any(|l| l.token.is_hold()) {
            return self.extend_mixed(leases, terms).await;
        }
        let min_uptime = ms(terms.get_min_uptime());
        let now = fence_clock();
        let calls = self.chunks(leases).into_iter().map(|idx| async move {
            let mut keys: Vec<Key> = idx.iter().map(|&i| leases[i].key.as_str().into()).collect();
            let mut args: Vec<Value> = Vec::with_capacity(idx.len() * 3 + 2);
            args.push(min_uptime.into());
            args.push(i64::try_from(idx.len()).unwrap_or(i64::MAX).into());
            for &i in &idx {
                let lease = &leases[i];
                args.push(lease.token.as_str().into());
                args.push(ms(lease.ttl).into());
                // The fence hash's hour is renewed now and then, not at every extension.
                let renew = if fence_due(lease.key.as_str(), lease.ttl, now) {
                    keys.push(lease.key.part(Part::Fence).into());
                    i64::try_from(keys.len()).unwrap_or(0)
                } else {
                    0
                };
                args.push(renew.into());
            }
            let reply: Vec<i64> = self.eval(&self.inner.scripts.extend, keys, args).await?;
            if reply.len() != idx.len() {
                return Err(Error::backend("extend script returned the wrong count"));
            }
            Ok::<_, Error>((idx, reply))
        });
        let mut out = vec![None; leases.len()];
        for chunk in futures::future::join_all(calls).await {
            let (idx, reply) = chunk?;
            for (i, ok) in idx.into_iter().zip(reply) {
                let ttl = leases[i].ttl;
                out[i] = (ok == 1).then(|| ttl.saturating_sub(clock_drift(ttl)));
            }
        }
        Ok(out)
    }

    async fn release(&self, key: &LeaseKey, token: &Token) -> Result<bool> {
        self.release_one(key, token, Duration::ZERO).await
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        let keys: Vec<Key> = vec![
            key.as_str().into(),
            key.part(Part::Fence).into(),
            key.part(Part::Timeouts).into(),
            key.part(Part::Owners).into(),
        ];
        let reply: Vec<Value> = self
            .eval(&self.inner.scripts.inspect, keys, Vec::new())
            .await?;
        let [pttl, fence, label, queued, owners] = <[Value; 5]>::try_from(reply)
            .map_err(|r| Error::backend(format!("inspect script returned {} values", r.len())))?;
        let int = |v: &Value| v.as_i64().unwrap_or(-1);
        let text = |v: &Value| v.as_string().filter(|s| !s.is_empty());
        let pttl = int(&pttl);
        let mut info = LockInfo::new();
        info.held = pttl != -2;
        // -1: a lease without a TTL (set by hand): held, expiry unknown.
        info.remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
        info.fencing_token = text(&fence).and_then(|f| f.parse().ok());
        info.holder_label = text(&label);
        info.queue_len = u64::try_from(int(&queued)).unwrap_or(0);
        info.reentrant_count = u64::try_from(int(&owners)).ok();
        Ok((!info.is_blank()).then_some(info))
    }

    async fn abandon(&self, key: &LeaseKey, token: &Token) -> Result<bool> {
        self.release_one(key, token, TOMBSTONE).await
    }

    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        let channel = key.part(Part::Released);
        self.inner.pubsub.subscribe(channel, false, None).await
    }

    async fn fair_acquire(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        attempt: FairAttempt,
    ) -> Result<Acquire> {
        let req = FairReq {
            key: key.clone(),
            token: token.clone(),
            ttl,
            attempt,
        };
        match self.op(Op::Fair(req)).await? {
            Reply::Acquire(outcome) => Ok(outcome),
            Reply::Release(_) => Err(Error::backend("an acquire was answered as a release")),
        }
    }

    /// One SUBSCRIBE per key's hand-off channel and process, shared by the local waiters;
    /// a message (the new head's token) wakes only the waiter it names.
    async fn fair_subscribe(&self, key: &LeaseKey, token: &Token) -> Result<Subscription> {
        let channel = key.part(Part::Handoff);
        self.inner
            .pubsub
            .subscribe(channel, false, Some(token.as_str().to_owned()))
            .await
    }

    /// One `reentrant_acquire.lua` call (not group-committed: reentrant attempts are rare
    /// next to plain ones, and each is one EVALSHA).
    async fn reentrant_acquire(
        &self,
        key: &LeaseKey,
        owner: &Owner,
        hold: &Token,
        ttl: Duration,
        waiting: Waiting,
        terms: NodeTerms,
    ) -> Result<ReentrantAcquire> {
        check_hold(hold)?;
        self.check_connected(terms)?;
        let keys = vec![
            Key::from(key.as_str()),
            key.part(Part::Fence).into(),
            key.part(Part::Owners).into(),
            key.part(Part::Holds).into(),
            key.part(Part::Abandoned).into(),
        ];
        // As for plain attempts: the waiters flag outlives the next re-check.
        let flag = waiting
            .recheck()
            .map_or(0, |w| ms(w).saturating_mul(2).saturating_add(100));
        let arriving = i64::from(matches!(waiting, Waiting::Arriving { .. }));
        let args: Vec<Value> = vec![
            owner.as_str().into(),
            hold.as_str().into(),
            ms(ttl).into(),
            flag.into(),
            arriving.into(),
            terms.get_fence_floor().to_string().into(),
            ms(terms.get_min_uptime()).into(),
        ];
        let reply: Vec<Value> = self
            .eval(&self.inner.scripts.reentrant_acquire, keys, args)
            .await?;
        let int = |v: Option<&Value>| v.and_then(Value::as_i64);
        let remaining = |ms: i64| u64::try_from(ms).ok().map(Duration::from_millis);
        match (int(reply.first()), reply.len()) {
            (Some(1), 4) => {
                let lease = reply[2]
                    .as_string()
                    .filter(|t| t.starts_with('h'))
                    .ok_or_else(|| Error::backend("reentrant acquire returned no lease token"))?;
                Ok(ReentrantAcquire::Acquired {
                    lease: Token::from_store(&lease),
                    fencing_token: int(reply.get(1))
                        .and_then(|f| u64::try_from(f).ok())
                        .unwrap_or(0),
                    validity: ttl.saturating_sub(clock_drift(ttl)),
                    count: int(reply.get(3))
                        .and_then(|c| u32::try_from(c).ok())
                        .unwrap_or(0),
                })
            }
            (Some(0), 2) => Ok(ReentrantAcquire::Held {
                remaining: int(reply.get(1)).and_then(remaining),
            }),
            (Some(2), 2) => Ok(ReentrantAcquire::Warming {
                remaining: int(reply.get(1)).and_then(remaining).unwrap_or_default(),
            }),
            _ => Err(Error::backend(format!(
                "unexpected reply from the reentrant acquire script: {reply:?}"
            ))),
        }
    }

    async fn reentrant_release(
        &self,
        key: &LeaseKey,
        owner: &Owner,
        hold: &Token,
        lease: Option<&Token>,
    ) -> Result<Option<u32>> {
        check_hold(hold)?;
        let keys = vec![
            Key::from(key.as_str()),
            key.part(Part::Fence).into(),
            key.part(Part::Owners).into(),
            key.part(Part::Holds).into(),
            key.part(Part::Abandoned).into(),
            key.part(Part::Queue).into(),
            key.part(Part::Timeouts).into(),
        ];
        let tombstone = if lease.is_some() { 0 } else { ms(TOMBSTONE) };
        let args: Vec<Value> = vec![
            owner.as_str().into(),
            hold.as_str().into(),
            lease.map_or("", Token::as_str).into(),
            tombstone.into(),
            key.part(Part::Released).into(),
            key.part(Part::Handoff).into(),
        ];
        let reply: Vec<i64> = self
            .eval(&self.inner.scripts.reentrant_release, keys, args)
            .await?;
        match reply.as_slice() {
            [1, left] => Ok(Some(u32::try_from(*left).unwrap_or(0))),
            [0, _] => Ok(None),
            other => Err(Error::backend(format!(
                "unexpected reply from the reentrant release script: {other:?}"
            ))),
        }
    }
}

/// Reentrant holds must be [`Token::hold`]s: the lease token of a reign is its first hold,
/// and the extension of a lease is routed by it.
fn check_hold(hold: &Token) -> Result<()> {
    if hold.is_hold() {
        Ok(())
    } else {
        Err(Error::invalid(
            "a reentrant hold must be made by Token::hold (its lease is extended with the reign)",
        ))
    }
}

impl RedisBackend {
    /// `extend_node` for a batch holding reentrant leases (their tokens are holds): plain
    /// leases go through `extend.lua`, reentrant ones through `reentrant_extend.lua`, which
    /// keeps the reign's owners and holds hashes alive with the lease.
    async fn extend_mixed(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> Result<Vec<Option<Duration>>> {
        let (holds, plain): (Vec<usize>, Vec<usize>) =
            (0..leases.len()).partition(|&i| leases[i].token.is_hold());
        let plain_leases: Vec<Lease<'_>> = plain.iter().map(|&i| leases[i]).collect();
        let plain_call = async {
            if plain_leases.is_empty() {
                Ok(Vec::new())
            } else {
                self.extend_node(&plain_leases, terms).await
            }
        };
        let min_uptime = ms(terms.get_min_uptime());
        let reentrant: Vec<Lease<'_>> = holds.iter().map(|&i| leases[i]).collect();
        let calls = self.chunks(&reentrant).into_iter().map(|idx| {
            let reentrant = &reentrant;
            async move {
                let mut keys: Vec<Key> = Vec::with_capacity(idx.len() * 4);
                let mut args: Vec<Value> = Vec::with_capacity(idx.len() * 2 + 1);
                args.push(min_uptime.into());
                for &i in &idx {
                    let l = &reentrant[i];
                    keys.extend([
                        Key::from(l.key.as_str()),
                        l.key.part(Part::Fence).into(),
                        l.key.part(Part::Owners).into(),
                        l.key.part(Part::Holds).into(),
                    ]);
                    args.push(l.token.as_str().into());
                    args.push(ms(l.ttl).into());
                }
                let reply: Vec<i64> = self
                    .eval(&self.inner.scripts.reentrant_extend, keys, args)
                    .await?;
                if reply.len() != idx.len() {
                    return Err(Error::backend("extend script returned the wrong count"));
                }
                Ok::<_, Error>((idx, reply))
            }
        });
        // Both kinds at once: one round trip for the round, not one per kind.
        let (plain_out, chunks) = futures::join!(plain_call, futures::future::join_all(calls));
        let mut out = vec![None; leases.len()];
        for (&i, v) in plain.iter().zip(plain_out?) {
            out[i] = v;
        }
        for chunk in chunks {
            let (idx, reply) = chunk?;
            for (j, ok) in idx.into_iter().zip(reply) {
                let ttl = reentrant[j].ttl;
                out[holds[j]] = (ok == 1).then(|| ttl.saturating_sub(clock_drift(ttl)));
            }
        }
        Ok(out)
    }
}

impl RedisBackend {
    /// A subscription to `channel` that every message wakes in full (all local listeners),
    /// on the shared pub/sub connection: for the stampede cache's `:filled` channel.
    pub(crate) async fn subscribe_broadcast(&self, channel: String) -> Result<Subscription> {
        self.inner.pubsub.subscribe(channel, true, None).await
    }
}

/// Release wake-ups: one subscriber connection per backend, one SUBSCRIBE per channel with
/// local waiters, reference-counted.
struct PubSub {
    client: SubscriberClient,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so they reach the server in the order of the count
    /// changes; `true` once the connection is up.
    ops: futures::lock::Mutex<bool>,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
}

struct Channel {
    event: Arc<Event>,
    subscribers: usize,
    /// A message wakes every local listener (cache fills), not just one (releases).
    broadcast: bool,
    /// Fair waiters on a hand-off channel, by token: a message wakes only the one it names.
    targets: HashMap<String, Arc<Event>>,
}

fn lock_map(m: &Mutex<HashMap<String, Channel>>) -> MutexGuard<'_, HashMap<String, Channel>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PubSub {
    /// Connects the subscriber and installs its handlers on the crate's background runtime,
    /// so they keep running whichever runtime the waiters use.
    async fn start(&self) -> Result<()> {
        let client = self.client.clone();
        let channels = self.channels.clone();
        let started = runtime::background().run(async move {
            client.init().await?;
            let on_message = channels.clone();
            drop(client.on_message(move |msg| {
                // One release, one local waiter (the longest waiting): waking them all would
                // send every waiter's attempt to Redis for one lease.
                if let Some(c) = lock_map(&on_message).get(&*msg.channel) {
                    let target = msg.value.as_str().and_then(|t| c.targets.get(&*t).cloned());
                    match target {
                        // A hand-off: only the waiter it names acts on it.
                        Some(waiter) => waiter.notify(usize::MAX),
                        // A cache fill wakes every local listener; a release, one.
                        None if c.broadcast => c.event.notify(usize::MAX),
                        None => c.event.notify(1.additional()),
                    };
                }
                futures::future::ready(Ok(()))
            }));
            // Messages published while the connection was down are lost: wake every waiter
            // to re-check at once instead of at its fallback timer.
            drop(client.on_reconnect(move |_| {
                for c in lock_map(&channels).values() {
                    c.event.notify(usize::MAX);
                    for waiter in c.targets.values() {
                        waiter.notify(usize::MAX);
                    }
                }
                futures::future::ready(Ok(()))
            }));
            drop(client.manage_subscriptions());
            Ok::<_, fred::error::Error>(())
        });
        match started.await {
            Some(result) => result.map_err(Error::backend),
            None => Err(Error::backend("the background runtime is gone")),
        }
    }

    /// Subscribes to `channel`. `broadcast`: every message wakes every local listener (cache
    /// fills); otherwise one (releases). With a `target`, the subscription is woken only by
    /// messages that carry that token (fair hand-offs).
    async fn subscribe(
        self: &Arc<Self>,
        channel: String,
        broadcast: bool,
        target: Option<String>,
    ) -> Result<Subscription> {
        let mut started = self.ops.lock().await;
        if !*started {
            self.start().await?;
            *started = true;
        }
        let (event, first) = {
            let mut map = lock_map(&self.channels);
            let c = map.entry(channel.clone()).or_insert_with(|| Channel {
                event: Arc::new(Event::new()),
                subscribers: 0,
                broadcast,
                targets: HashMap::new(),
            });
            c.subscribers += 1;
            let event = match &target {
                Some(token) => {
                    let own = Arc::new(Event::new());
                    c.targets.insert(token.clone(), own.clone());
                    own
                }
                None => c.event.clone(),
            };
            (event, c.subscribers == 1)
        };
        // Made before the SUBSCRIBE is awaited: if this future is dropped or the command
        // fails, the guard still takes the count back down.
        let guard = Unsubscribe {
            pubsub: self.clone(),
            channel,
            target,
        };
        if first {
            in_tokio(self.client.subscribe(guard.channel.clone()))
                .await
                .map_err(Error::backend)?;
        }
        drop(started);
        Ok(Subscription::new(event).with_guard(guard))
    }
}

struct Unsubscribe {
    pubsub: Arc<PubSub>,
    channel: String,
    target: Option<String>,
}

impl Drop for Unsubscribe {
    fn drop(&mut self) {
        let last = {
            let mut map = lock_map(&self.pubsub.channels);
            let count = map.get_mut(&self.channel).map(|c| {
                if let Some(token) = &self.target {
                    c.targets.remove(token);
                }
                c.subscribers -= 1;
                c.subscribers
            });
            count == Some(0)
        };
        if !last {
            return;
        }
        let (pubsub, channel) = (self.pubsub.clone(), std::mem::take(&mut self.channel));
        // On the background runtime, in the SUBSCRIBE/UNSUBSCRIBE order: a waiter that came
        // back for this channel in the meantime keeps it subscribed.
        runtime::background().spawn(async move {
            let _order = pubsub.ops.lock().await;
            let idle = {
                let mut map = lock_map(&pubsub.channels);
                let idle = map.get(&channel).is_some_and(|c| c.subscribers == 0);
                if idle {
                    map.remove(&channel);
                }
                idle
            };
            if idle {
                let _ = pubsub.client.unsubscribe(channel).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{check_version, fence_due, phases, Kind, FENCE_RENEWAL};
    use std::time::Duration;

    #[test]
    fn a_lease_extended_within_each_ttl_renews_its_fence_hash_within_the_renewal_time() {
        for (ttl_ms, period_ms) in [
            (30_000, 10_000),
            (30_000, 29_999),
            (3_000, 1_000),
            (3_600_000, 1_200_000),
        ] {
            let ttl = Duration::from_millis(ttl_ms);
            for key in ["a", "orders:42", "redlease:{x}"] {
                let bound = FENCE_RENEWAL.as_millis() as u64 + ttl_ms;
                let (mut last, mut now, mut renewals) = (0u64, 12_345u64, 0);
                while now < 5 * 3_600_000 {
                    if fence_due(key, ttl, now) {
                        assert!(
                            now - last <= bound,
                            "{key} ttl {ttl_ms}: renewed after {} ms",
                            now - last
                        );
                        last = now;
                        renewals += 1;
                    }
                    now += period_ms;
                }
                assert!(
                    renewals >= 5,
                    "{key} ttl {ttl_ms}: {renewals} renewals in 5 h"
                );
                // Not at every extension when the TTL is short.
                let extensions = (5 * 3_600_000 - 12_345) / period_ms;
                assert!(ttl_ms >= FENCE_RENEWAL.as_millis() as u64 || renewals * 10 < extensions);
            }
        }
    }

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

    #[test]
    fn distinct_keys_make_one_phase_per_kind_and_one_key_keeps_its_order() {
        use Kind::{Acquire as A, Release as R};
        // Distinct keys, interleaved kinds: one acquire phase, one release phase.
        let ops = [(A, "a"), (R, "b"), (A, "c"), (R, "d"), (A, "e")];
        assert_eq!(
            phases(ops.into_iter()),
            vec![(A, vec![0, 2, 4]), (R, vec![1, 3])]
        );
        // One key released then acquired again: the acquire waits for a later phase.
        let ops = [(A, "a"), (R, "k"), (A, "k"), (R, "b")];
        assert_eq!(
            phases(ops.into_iter()),
            vec![(A, vec![0]), (R, vec![1, 3]), (A, vec![2])]
        );
        // The same kind twice on one key shares a phase (a script runs entries in order).
        let ops = [(R, "k"), (R, "k"), (A, "x")];
        assert_eq!(phases(ops.into_iter()), vec![(R, vec![0, 1]), (A, vec![2])]);
    }
}
