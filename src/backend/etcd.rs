//! `EtcdBackend`: leases on etcd v3 (feature `etcd`, through the `etcd-client` crate).
//!
//! See [`EtcdBackend`] for the record, the fencing tokens and what the store serves.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use event_listener::Event;
use futures::channel::{mpsc, oneshot};
use futures::future::BoxFuture;

use crate::backend::{
    clock_drift, Acquire, Attempt, Backend, Capabilities, Claim, ClaimKind, Extended, Grant, Lease,
    NodeTerms, Refused, Release, Subscription, Unavailable,
};
use crate::error::{Error, Result};
use crate::info::LockInfo;
use crate::runtime::{self, in_tokio};
use crate::token::{LeaseKey, Token};

mod cache;
mod reentrant;
mod watch;

/// How long tombstones and abandon bars live (the backend-wide lease's TTL), at least half
/// of it: a new one is granted when the current one is half spent.
const TOMB_TTL: i64 = 300;

/// How often the connection is pinged (HTTP/2), for [`EtcdBackend::connect`]'s own client.
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// Leases per extend transaction: two reads each, under etcd's 128 operations.
const EXTEND_CHUNK: usize = 64;

/// How long the leases of an attempt are remembered for a give-back that may never come
/// (a waiter that gave up without one): they run out on the server by then anyway.
const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// Settings of an [`EtcdBackend`].
///
/// ```
/// use std::time::Duration;
/// let opts = redlease::EtcdOptions::new()
///     .prefix("myapp/locks/")
///     .timeout(Duration::from_secs(1))
///     .connect_timeout(Duration::from_secs(3))
///     .heartbeat(Duration::from_millis(500));
/// assert_eq!(opts.prefix_str(), "myapp/locks/");
/// ```
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    heartbeat: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            prefix: "redlease/".into(),
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            heartbeat: Duration::from_secs(1),
        }
    }
}

impl EtcdOptions {
    /// The defaults: prefix `redlease/`, 2 s per call, 2 s to connect, a watch heartbeat
    /// every second.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the backend's keys live in etcd's key space (default `redlease/`). Backends
    /// that share locks must use the same prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The prefix set.
    pub fn prefix_str(&self) -> &str {
        &self.prefix
    }

    /// Bound on every call to etcd (default 2 s): a call that takes longer fails as
    /// unavailable (its outcome unknown).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Bound on opening a connection (default 2 s), for [`EtcdBackend::connect_with`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How often a silent watch stream is asked for progress (default 1 s); unanswered for
    /// this plus the [`timeout`](Self::timeout), it is opened again.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    fn check(&self) -> Result<()> {
        if self.timeout.is_zero() || self.connect_timeout.is_zero() || self.heartbeat.is_zero() {
            return Err(Error::invalid(
                "etcd: timeouts and the heartbeat must be above zero",
            ));
        }
        Ok(())
    }
}

/// Leases on etcd v3: an etcd lease per claim, compare-and-delete releases in one
/// transaction, a watch per waited-for key, fencing tokens from an epoch and the key's
/// create revision.
///
/// Clones share the client and the watch stream.
///
/// # The record
///
/// Every key lives under the backend's prefix `P` ([`EtcdOptions::prefix`], `redlease/` by
/// default); `K` is the lock's [`LeaseKey`], `T` a claim's token:
///
/// - `P l/K`: the lock, its value the holder's token, attached to the **claim's own etcd
///   lease** (granted for the attempt, revoked when the attempt is refused or given back).
/// - `P i/K`: the holder's label (for [`inspect`](Backend::inspect)), on the same lease.
/// - `P w/len:K/T`: a registered waiter ([`Attempt::Waiting`]), on that attempt's lease; an
///   [`Attempt::Arriving`] attempt yields while any exist.
/// - `P q/len:K/T`: a fair claim's place in the queue; the queue's order is the keys'
///   create revisions (etcd's revision order is a FIFO).
/// - `P t/T`: a tombstone, written by a release in the same transaction as the delete, so a
///   re-sent release answers `Some` again; `P b/T`: the bar an [`Release::Abandon`] leaves.
///   A plain or fair grant checks both: a late copy of an acquire (sent before the release
///   or the abandon, delayed on a connection that broke) takes nothing. Both on a
///   backend-wide lease of 5 minutes. The attempt's own etcd leases are revoked too, so such
///   a copy also fails on its lease.
///
/// # Send order
///
/// `etcd-client` sends each call once and never re-sends it; a call cut off mid-flight may
/// still be applied later (the old connection's request reaching etcd late). No operation
/// numbers are kept: the tombstone, the bar and the revoked leases above refuse such a late
/// acquire, and a late release compares the token, which no later grant reuses (every
/// acquire makes a new token).
/// - `P epoch`: the fencing epoch (below). Never on a lease.
///
/// One acquire is a lease grant and one transaction (compare the lock's create revision to
/// 0 and the bar's, then put the lock and read it back; else read the holder). A release is
/// one transaction (compare the value, delete, write the tombstone) and a background revoke.
/// An extend is one transaction reading the keys (64 leases per transaction: etcd caps a
/// transaction at 128 operations) and one keep-alive per lease, concurrently.
///
/// # Lease TTLs
///
/// etcd's lease TTLs are whole seconds, with a floor (1.5 times the election timeout; 1 s
/// with `--election-timeout 100`, 2 s with the defaults). A claim's TTL is rounded **up**
/// for its etcd lease, and its [`Grant::validity`] / [`Extended::Held`] is the claim's own
/// TTL less [`clock_drift`]: the store holds the lock at least as long as promised, a
/// crashed holder's lock at most one rounding longer. An extend asking for more than the
/// etcd lease was granted with moves the lock to a new lease in one transaction (a
/// keep-alive renews to the granted TTL only). After a restart etcd gives every lease its
/// full TTL again (safe: longer, never shorter).
///
/// # Fencing tokens
///
/// fence = `epoch + create_revision(P l/K)`. Within one etcd cluster a key's create
/// revision strictly increases from one creation to the next (the store's revision never
/// goes backwards, a restart included), and a re-sent acquire reads back the same create
/// revision, hence the same fence. A **wiped data directory** restarts revisions at 1 with
/// no visible sign (the same cluster id), so the revision alone would go backwards: the
/// epoch covers that. `P epoch` is created once, in microseconds of the wall clock, and
/// every acquire compares it (a transaction whose epoch differs from the one this process
/// uses is not applied; the process reads the new one and tries again). When it is missing
/// (a wiped store), the first process to notice creates it again with
/// `max(now in µs, old epoch + highest revision it saw + 1)`. The new epoch exceeds every
/// fence of the old store as long as that store made fewer than one write per microsecond
/// on average since its epoch was set (etcd makes thousands per second at most), and as
/// long as the wall clock does not step back by more than the wiped store's revisions
/// (the same clock assumption the Redis backend's `max(counter + 1, clock µs)` makes). The
/// alternative, a counter key per lock raised to `max(counter + 1, clock µs)`, needs a read
/// before every grant (etcd transactions cannot compute), so two round trips and a retry
/// under contention; the epoch costs one comparison.
///
/// # Wake-ups and reconnects
///
/// One watch stream per backend, one watch per subscribed lock key ([`subscribe`] returns
/// once etcd confirmed the watch); a delete (a release, or the lease running out) wakes one
/// local waiter. `etcd-client` reconnects calls by itself but not streams: when the watch
/// stream breaks, or goes silent (a progress request unanswered for the timeout: a paused
/// server), it is opened again, every watch re-created from the last revision seen + 1 (from
/// now if the store's revision went backwards), every waiter woken and
/// [`disturbed`](Backend::disturbed) resolved, so the watchdog checks every lease at once.
///
/// # What it serves
///
/// - Plain claims.
/// - Fair claims: a place `P q/len:K/T` per waiter, on a lease of the waiter's
///   `keep_waiter`; the head is the place with the lowest create revision, and a grant
///   compares that every place of the queue was created at or after the claim's own (a
///   range compare on create revisions). A release wakes this process's waiter nearest the
///   head.
/// - Reentrant claims: a reign is the lock key, `P o/K` (the owner) and a key per hold
///   `P h/len:K/H`, all on the reign's lease; the count is the number of hold keys, read in
///   the transaction that adds or removes one. The last hold's release ends the reign in a
///   second transaction that applies only while no hold key is left. A re-entry, or an
///   extension asking more than the reign's etcd lease was granted with, is promised only
///   what that lease holds (the holds would have to move to a longer lease with it).
/// - The stampede [`Cache`](crate::Cache)'s values (`cache.rs`): a fill or a failure is
///   written in one transaction that holds only while the lock key holds the writer's
///   token; a put of a notification key wakes the waiters through the watch stream.
///
/// Not shared claims (read-write locks, semaphores): a grant must count the holds, and
/// etcd's compares cannot (a range compare holds when every key of the range matches, and
/// is false on an empty one; nested transactions' compares are evaluated before any write).
/// It would take a read, then a transaction guarded by the range's revisions, retried under
/// contention, and writer preference on top: not done. Not a [`Redlock`](crate::Redlock)
/// node (etcd is a quorum already): [`raise_fence`](Backend::raise_fence) answers
/// [`Error::Unsupported`].
///
/// [`subscribe`]: Backend::subscribe
///
/// # Example
///
/// ```no_run
/// use redlease::{EtcdBackend, LockManager};
/// # async fn run() -> redlease::Result<()> {
/// let backend = EtcdBackend::connect("http://127.0.0.1:2379").await?;
/// let locks = LockManager::new(backend);
/// let guard = locks.lock("report").acquire().await?;
/// println!("fencing token {}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    opts: EtcdOptions,
    /// The epoch this process uses, once read.
    epoch: Mutex<Option<u64>>,
    /// The highest store revision seen in any answer.
    max_rev: Arc<AtomicI64>,
    /// The etcd leases granted for each token's attempts and not yet given back.
    leases: Mutex<Leases>,
    /// The backend-wide lease of tombstones and bars, and when it was granted.
    tomb: futures::lock::Mutex<Option<(i64, Instant)>>,
    watch: mpsc::UnboundedSender<watch::Cmd>,
    disturbance: Arc<Event>,
    /// This process's fair waiters, by lock key.
    fair: Arc<Mutex<FairWaiters>>,
}

/// The fair waiters of this process: a release wakes, per key, the one nearest the head of
/// the queue (the head, if it is here), not all of them.
#[derive(Default)]
struct FairWaiters {
    /// Each waiting subscription's token and wake-up, by lock key.
    by_key: HashMap<Vec<u8>, Vec<(Token, std::sync::Weak<Event>)>>,
    /// Each queued token's place (its key's create revision).
    places: HashMap<Token, i64>,
    /// Each queued token's place and the lease it is on, renewed by its next attempts.
    /// (create revision, lease, when the lease was granted or last renewed).
    standing: HashMap<Token, (i64, i64, Instant)>,
}

impl FairWaiters {
    /// Wakes the waiter of `key` nearest the head (and those whose place is not known yet),
    /// or every one.
    fn wake(&mut self, key: &[u8], all: bool) {
        let Some(list) = self.by_key.get_mut(key) else {
            return;
        };
        list.retain(|(_, e)| e.strong_count() > 0);
        let places = &self.places;
        let nearest = list
            .iter()
            .filter_map(|(t, _)| places.get(t))
            .min()
            .copied();
        for (t, e) in list.iter() {
            let place = places.get(t).copied();
            if all || place.is_none() || place == nearest {
                if let Some(e) = e.upgrade() {
                    e.notify(usize::MAX);
                }
            }
        }
    }
}

#[derive(Default)]
struct Leases {
    by_token: HashMap<Token, (Vec<i64>, Instant)>,
    /// The TTL each of those leases was granted with (keep-alives renew to it).
    granted: HashMap<i64, i64>,
    ops: u64,
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("prefix", &self.inner.opts.prefix)
            .finish_non_exhaustive()
    }
}

/// Endpoints from a URL list: `http://h:p`, `h:p`, comma-separated; `etcd://` is taken as
/// `http://`. TLS is not built in: `https://` is refused.
fn endpoints(url: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for part in url.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let rest = if let Some(r) = part.strip_prefix("http://") {
            r
        } else if let Some(r) = part.strip_prefix("etcd://") {
            r
        } else if part.starts_with("https://") {
            return Err(Error::invalid(format!(
                "etcd: {part:?}: TLS is not supported by this backend; connect a client of \
                 your own with TLS and use EtcdBackend::from_client"
            )));
        } else if part.contains("://") {
            return Err(Error::invalid(format!(
                "etcd: {part:?}: expected http://host:port or host:port"
            )));
        } else {
            part
        };
        let rest = rest.trim_end_matches('/');
        let ok = rest
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok || rest.contains('/') || rest.contains('@') {
            return Err(Error::invalid(format!(
                "etcd: {part:?}: expected http://host:port or host:port"
            )));
        }
        out.push(format!("http://{rest}"));
    }
    if out.is_empty() {
        return Err(Error::invalid("etcd: no endpoint given"));
    }
    Ok(out)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A claim's TTL as an etcd lease TTL: whole seconds, rounded up, at least 1.
fn lease_secs(ttl: Duration) -> i64 {
    let secs = ttl
        .as_secs()
        .saturating_add(u64::from(ttl.subsec_nanos() > 0));
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

/// What etcd-client's error means to the engine.
fn failure(what: &str, e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) => {
            // tonic codes: 1 cancelled, 2 unknown, 4 deadline exceeded, 8 resource
            // exhausted, 10 aborted, 14 unavailable.
            let code: i32 = s.code().into();
            let text = format!("etcd: {what}: {}", s.message());
            if matches!(code, 1 | 2 | 4 | 8 | 10 | 14) {
                Error::backend(Unavailable(text))
            } else {
                Error::backend(Refused(text))
            }
        }
        E::TransportError(_) | E::IoError(_) | E::WatchError(_) => {
            Error::backend(Unavailable(format!("etcd: {what}: {e}")))
        }
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            Error::invalid(format!("etcd: {what}: {e}"))
        }
        other => Error::backend(format!("etcd: {what}: {other}")),
    }
}

/// Whether `e` says a lease is gone ("requested lease not found").
fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("lease not found"),
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
    }
}

fn first_kv(resp: &TxnOpResponse) -> Option<&KeyValue> {
    match resp {
        TxnOpResponse::Get(g) => g.kvs().first(),
        _ => None,
    }
}

fn nested(resp: &TxnOpResponse) -> Option<&TxnResponse> {
    match resp {
        TxnOpResponse::Txn(t) => Some(t),
        _ => None,
    }
}

/// A transaction that reads the lock when any key of `range` exists, else runs `grant`.
fn yield_layer(range: Vec<u8>, lock: Vec<u8>, grant: Txn) -> Txn {
    Txn::new()
        .when([Compare::create_revision(range, CompareOp::Greater, 0).with_prefix()])
        .and_then([TxnOp::get(lock, None)])
        .or_else([TxnOp::txn(grant)])
}

/// Reads an applied acquire transaction (its epoch held): whether it granted, and the lock
/// as read (after the grant, or as found).
fn read_acquire(resp: &TxnResponse, layer: bool) -> Result<(bool, Option<KeyValue>)> {
    let ops = resp.op_responses();
    let mut t = ops
        .first()
        .and_then(nested)
        .cloned()
        .ok_or_else(|| malformed("acquire"))?;
    if layer {
        let ops = t.op_responses();
        if t.succeeded() {
            return Ok((false, ops.first().and_then(first_kv).cloned()));
        }
        let inner = ops
            .first()
            .and_then(nested)
            .cloned()
            .ok_or_else(|| malformed("acquire"))?;
        t = inner;
    }
    let ops = t.op_responses();
    Ok(if t.succeeded() {
        (true, ops.last().and_then(first_kv).cloned())
    } else {
        (false, ops.first().and_then(first_kv).cloned())
    })
}

fn malformed(what: &str) -> Error {
    Error::backend(format!("etcd: {what}: unexpected transaction answer"))
}

impl EtcdBackend {
    /// Connects to etcd at `endpoints`: `http://host:port` or `host:port`, several
    /// separated by commas. Fails with [`Error::InvalidConfig`] on a malformed endpoint, and
    /// with a backend error if no endpoint answers within the connect timeout.
    ///
    /// ```no_run
    /// # async fn run() -> redlease::Result<()> {
    /// let b = redlease::EtcdBackend::connect("127.0.0.1:2379,127.0.0.1:22379").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(endpoints: &str) -> Result<Self> {
        Self::connect_with(endpoints, EtcdOptions::new()).await
    }

    /// [`connect`](Self::connect) with options.
    ///
    /// ```no_run
    /// # async fn run() -> redlease::Result<()> {
    /// use redlease::{EtcdBackend, EtcdOptions};
    /// let b = EtcdBackend::connect_with("http://127.0.0.1:2379", EtcdOptions::new().prefix("app/")).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(url: &str, options: EtcdOptions) -> Result<Self> {
        options.check()?;
        let eps = endpoints(url)?;
        // HTTP/2 pings find a connection that died silently; not more often than etcd allows
        // (`--grpc-keepalive-min-time`, 5 s by default), and only while a stream is open (the
        // watch stream always is): gRPC servers answer pings that break their policy with
        // GOAWAY "too many pings" (grpc-go's documented enforcement; not observed here).
        let copts = ConnectOptions::new()
            .with_timeout(options.timeout)
            .with_connect_timeout(options.connect_timeout)
            .with_keep_alive(KEEP_ALIVE, options.timeout);
        let bound = options.connect_timeout + options.timeout;
        let connected = in_tokio(async move {
            tokio::time::timeout(bound, Client::connect(eps, Some(copts))).await
        })
        .await;
        let client = match connected {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(failure("connect", e)),
            Err(_) => {
                return Err(Error::backend(Unavailable(format!(
                    "etcd: connect to {url}: no answer within {bound:?}"
                ))))
            }
        };
        let backend = Self::from_client_with(client, options)?;
        // The first call proves the endpoints answer (the client connects lazily).
        backend.epoch().await?;
        Ok(backend)
    }

    /// A backend over an application's own client (its TLS, auth and endpoints), with
    /// default options. No call is made until the first lock operation.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = etcd_client::Client::connect(["127.0.0.1:2379"], None).await?;
    /// let locks = redlease::LockManager::new(redlease::EtcdBackend::from_client(client));
    /// # Ok(()) }
    /// ```
    pub fn from_client(client: Client) -> Self {
        let inner = Self::inner(client, EtcdOptions::new());
        EtcdBackend { inner }
    }

    /// [`from_client`](Self::from_client) with options ([`EtcdOptions::connect_timeout`] is
    /// not used: the client is connected already).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = etcd_client::Client::connect(["127.0.0.1:2379"], None).await?;
    /// let opts = redlease::EtcdOptions::new().prefix("app/");
    /// let backend = redlease::EtcdBackend::from_client_with(client, opts)?;
    /// # Ok(()) }
    /// ```
    pub fn from_client_with(client: Client, options: EtcdOptions) -> Result<Self> {
        options.check()?;
        Ok(EtcdBackend {
            inner: Self::inner(client, options),
        })
    }

    fn inner(client: Client, opts: EtcdOptions) -> Arc<Inner> {
        let (tx, rx) = mpsc::unbounded();
        let disturbance = Arc::new(Event::new());
        let max_rev = Arc::new(AtomicI64::new(0));
        let settings = watch::Settings {
            client: client.clone(),
            sentinel: format!("{}epoch", opts.prefix).into_bytes(),
            timeout: opts.timeout,
            heartbeat: opts.heartbeat,
            disturbance: disturbance.clone(),
            max_rev: max_rev.clone(),
        };
        runtime::background().spawn(in_tokio(watch::run(settings, rx)));
        Arc::new(Inner {
            client,
            opts,
            epoch: Mutex::new(None),
            max_rev,
            leases: Mutex::new(Leases::default()),
            tomb: futures::lock::Mutex::new(None),
            watch: tx,
            disturbance,
            fair: Arc::new(Mutex::new(FairWaiters::default())),
        })
    }

    // ---- keys ----

    fn key(&self, kind: &str, rest: &str) -> Vec<u8> {
        format!("{}{kind}/{rest}", self.inner.opts.prefix).into_bytes()
    }

    fn lock_key(&self, k: &LeaseKey) -> Vec<u8> {
        self.key("l", k.as_str())
    }

    fn label_key(&self, k: &LeaseKey) -> Vec<u8> {
        self.key("i", k.as_str())
    }

    /// `kind/len:K/`: no key's range holds another key's (the length comes first).
    fn range_prefix(&self, kind: &str, k: &LeaseKey) -> Vec<u8> {
        let k = k.as_str();
        self.key(kind, &format!("{}:{k}/", k.len()))
    }

    fn in_range(&self, kind: &str, k: &LeaseKey, t: &Token) -> Vec<u8> {
        let mut key = self.range_prefix(kind, k);
        key.extend_from_slice(t.as_str().as_bytes());
        key
    }

    fn tomb_key(&self, t: &Token) -> Vec<u8> {
        self.key("t", t.as_str())
    }

    fn bar_key(&self, t: &Token) -> Vec<u8> {
        self.key("b", t.as_str())
    }

    fn epoch_key(&self) -> Vec<u8> {
        format!("{}epoch", self.inner.opts.prefix).into_bytes()
    }

    // ---- calls ----

    fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// Runs one etcd call in a tokio context, bounded by the call timeout.
    async fn call<T, F>(&self, what: &str, fut: F) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let timeout = self.inner.opts.timeout;
        match in_tokio(async move { tokio::time::timeout(timeout, fut).await }).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(failure(what, e)),
            Err(_) => Err(Error::backend(Unavailable(format!(
                "etcd: {what}: no answer within {timeout:?}"
            )))),
        }
    }

    async fn txn(&self, what: &str, txn: Txn) -> Result<TxnResponse> {
        let mut c = self.client();
        let resp = self.call(what, c.txn(txn)).await?;
        self.saw(resp.header().map(|h| h.revision()));
        Ok(resp)
    }

    fn saw(&self, rev: Option<i64>) {
        if let Some(rev) = rev {
            self.inner.max_rev.fetch_max(rev, Ordering::Relaxed);
        }
    }

    fn fair(&self) -> MutexGuard<'_, FairWaiters> {
        self.inner.fair.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn leases(&self) -> MutexGuard<'_, Leases> {
        // Each update is one insert or remove: a poisoned lock is still consistent.
        self.inner.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Grants an etcd lease for an attempt of `token`, remembered until given back.
    async fn grant_for(&self, token: &Token, ttl: Duration) -> Result<i64> {
        let mut c = self.client();
        let resp = self
            .call("lease grant", c.lease_grant(lease_secs(ttl), None))
            .await?;
        let id = resp.id();
        let now = Instant::now();
        let mut l = self.leases();
        l.ops += 1;
        if l.ops % 1024 == 0 {
            l.by_token
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < FORGET_AFTER);
            let Leases {
                by_token, granted, ..
            } = &mut *l;
            granted.retain(|id, _| by_token.values().any(|(ids, _)| ids.contains(id)));
        }
        l.granted.insert(id, resp.ttl());
        let entry = l
            .by_token
            .entry(token.clone())
            .or_insert_with(|| (Vec::new(), now));
        entry.0.push(id);
        entry.1 = now;
        Ok(id)
    }

    /// Revokes leases in the background (their keys go with them); a revoke that fails
    /// leaves the lease to run out.
    fn revoke_later(&self, ids: Vec<i64>) {
        if ids.is_empty() {
            return;
        }
        let this = self.clone();
        runtime::background().spawn(in_tokio(async move {
            for id in ids {
                let mut c = this.client();
                let _ = this.call("lease revoke", c.lease_revoke(id)).await;
            }
        }));
    }

    /// Forgets `id` among `token`'s leases (it is the grant's now) and returns the others.
    fn keep_only(&self, token: &Token, keep: Option<i64>) -> Vec<i64> {
        let mut l = self.leases();
        let Some((ids, _)) = l.by_token.get_mut(token) else {
            return Vec::new();
        };
        let others: Vec<i64> = ids.iter().copied().filter(|i| Some(*i) != keep).collect();
        ids.retain(|i| Some(*i) == keep);
        if ids.is_empty() {
            l.by_token.remove(token);
        }
        for id in &others {
            l.granted.remove(id);
        }
        others
    }

    /// The fencing epoch: read once, and again after an acquire found another one.
    async fn epoch(&self) -> Result<u64> {
        if let Some(e) = *self.inner.epoch.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(e);
        }
        self.refresh_epoch(None).await
    }

    /// Reads the epoch, creating it if missing (a new store, or a wiped one): at least the
    /// clock in µs, and above every fence this process saw from the old one.
    async fn refresh_epoch(&self, old: Option<u64>) -> Result<u64> {
        let key = self.epoch_key();
        let seen = u64::try_from(self.inner.max_rev.load(Ordering::Relaxed)).unwrap_or(0);
        let floor = old.map_or(0, |o| o.saturating_add(seen).saturating_add(1));
        let fresh = now_us().max(floor);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), fresh.to_string(), None)])
            .or_else([TxnOp::get(key, None)]);
        let resp = self.txn("epoch", txn).await?;
        let epoch = if resp.succeeded() {
            fresh
        } else {
            resp.op_responses()
                .first()
                .and_then(first_kv)
                .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse::<u64>().ok())
                .ok_or_else(|| {
                    Error::backend(Refused(
                        "etcd: the epoch key holds no number (another program's key under \
                         this prefix?)"
                            .into(),
                    ))
                })?
        };
        *self.inner.epoch.lock().unwrap_or_else(|p| p.into_inner()) = Some(epoch);
        Ok(epoch)
    }

    /// The backend-wide lease of tombstones and bars; `fresh` forces a new one (the last
    /// one was not found).
    async fn tomb_lease(&self, fresh: bool) -> Result<i64> {
        let mut tomb = self.inner.tomb.lock().await;
        if let Some((id, at)) = *tomb {
            let half = Duration::from_secs(TOMB_TTL as u64 / 2);
            if !fresh && at.elapsed() < half {
                return Ok(id);
            }
        }
        let mut c = self.client();
        let resp = self
            .call("lease grant", c.lease_grant(TOMB_TTL, None))
            .await?;
        *tomb = Some((resp.id(), Instant::now()));
        Ok(resp.id())
    }

    /// Keeps lease `id` alive once; its granted TTL in seconds, or `None` when it is gone.
    async fn keep_alive(&self, id: i64) -> Result<Option<i64>> {
        let mut c = self.client();
        let timeout = self.inner.opts.timeout;
        let ka = in_tokio(async move {
            tokio::time::timeout(timeout, async move {
                // Opening the stream sends one keep-alive and reads its answer; the stream
                // is dropped after (one stream per lease: etcd-client's keeper is per id).
                c.lease_keep_alive(id).await.map(|(_, _)| ())
            })
            .await
        })
        .await;
        match ka {
            Ok(Ok(())) => {}
            Ok(Err(e)) if lease_not_found(&e) => return Ok(None),
            Ok(Err(e)) => return Err(failure("keep-alive", e)),
            Err(_) => {
                return Err(Error::backend(Unavailable(format!(
                    "etcd: keep-alive: no answer within {timeout:?}"
                ))))
            }
        }
        if let Some(granted) = self.leases().granted.get(&id).copied() {
            return Ok(Some(granted));
        }
        // A lease this backend did not grant (another process's backend granted it): ask.
        let mut c = self.client();
        let ttl = self
            .call("lease ttl", c.lease_time_to_live(id, None))
            .await?;
        // Whole seconds left, rounded down (0 for a lease just renewed to 1 s); -1 when gone.
        Ok((ttl.ttl() >= 0).then_some(ttl.granted_ttl()))
    }

    // ---- acquire ----

    /// The acquire transaction of a plain claim, under the epoch check; and whether it has
    /// the arriving attempt's layer (yield to registered waiters).
    fn acquire_txn(&self, claim: &Claim, attempt: Attempt, lease: i64, epoch: u64) -> (Txn, bool) {
        let (key, token) = (&claim.key, &claim.token);
        let lock = self.lock_key(key);
        let with_lease = || Some(PutOptions::new().with_lease(lease));
        let waiter = self.in_range("w", key, token);
        // Free, and the claim neither abandoned (its bar) nor released already (its
        // tombstone: this is a late copy of an acquire sent before the release).
        let when = [
            Compare::create_revision(lock.clone(), CompareOp::Equal, 0),
            Compare::create_revision(self.bar_key(token), CompareOp::Equal, 0),
            Compare::create_revision(self.tomb_key(token), CompareOp::Equal, 0),
        ];
        let mut then = vec![TxnOp::put(lock.clone(), token.as_str(), with_lease())];
        if let Some(label) = token.label() {
            then.push(TxnOp::put(self.label_key(key), label, with_lease()));
        }
        then.push(TxnOp::delete(waiter.clone(), None));
        then.push(TxnOp::get(lock.clone(), None));
        let mut els = vec![TxnOp::get(lock.clone(), None)];
        if matches!(attempt, Attempt::Waiting { .. }) {
            // Registered unless abandoned (a late attempt of an abandoned claim).
            els.push(TxnOp::txn(
                Txn::new()
                    .when([Compare::create_revision(
                        self.bar_key(token),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([TxnOp::put(waiter, "", with_lease())]),
            ));
        }
        let grant = Txn::new().when(when).and_then(then).or_else(els);
        let arriving = matches!(attempt, Attempt::Arriving { .. });
        let inner = if arriving {
            // Yield to registered waiters: any waiter key (a range compare holds on a
            // non-empty range whose keys all match, and is false on an empty one).
            yield_layer(self.range_prefix("w", key), lock, grant)
        } else {
            grant
        };
        (self.under_epoch(inner, epoch), arriving)
    }

    /// `inner`, applied only while the store's epoch is `epoch`.
    fn under_epoch(&self, inner: Txn, epoch: u64) -> Txn {
        Txn::new()
            .when([Compare::value(
                self.epoch_key(),
                CompareOp::Equal,
                epoch.to_string(),
            )])
            .and_then([TxnOp::txn(inner)])
            .or_else([TxnOp::get(self.epoch_key(), None)])
    }

    async fn acquire_plain(&self, claim: &Claim, attempt: Attempt) -> Result<Acquire> {
        let lease = self.grant_for(&claim.token, claim.ttl).await?;
        let (granted, kv, epoch) = self
            .grant_txn(|epoch| self.acquire_txn(claim, attempt, lease, epoch))
            .await?;
        // A waiting attempt keeps the lease its waiter key is on.
        let kept = matches!(attempt, Attempt::Waiting { .. }).then_some(lease);
        self.conclude(claim, attempt, (granted, kv), epoch, kept)
            .await
    }

    /// Sends an acquire transaction (made for the epoch given) and reads its answer: again
    /// under the store's new epoch if it changed. The grant, the lock as read, the epoch.
    async fn grant_txn(
        &self,
        txn: impl Fn(u64) -> (Txn, bool),
    ) -> Result<(bool, Option<KeyValue>, u64)> {
        let mut epoch = self.epoch().await?;
        let mut tried_epoch = false;
        loop {
            let (t, layer) = txn(epoch);
            let resp = self.txn("acquire", t).await?;
            if !resp.succeeded() {
                // Another epoch: a wiped store, re-created (by us now if nobody did).
                if tried_epoch {
                    return Err(Error::backend(Unavailable(
                        "etcd: the fencing epoch keeps changing".into(),
                    )));
                }
                tried_epoch = true;
                epoch = self.refresh_epoch(Some(epoch)).await?;
                continue;
            }
            let (granted, kv) = read_acquire(&resp, layer)?;
            return Ok((granted, kv, epoch));
        }
    }

    /// The answer to a plain or fair attempt, from the lock as its transaction read it.
    /// `kept`: the lease a refused attempt keeps (its waiter key's or queue place's).
    async fn conclude(
        &self,
        claim: &Claim,
        attempt: Attempt,
        (granted, kv): (bool, Option<KeyValue>),
        epoch: u64,
        kept: Option<i64>,
    ) -> Result<Acquire> {
        let token = &claim.token;
        if let Some(kv) = kv
            .as_ref()
            .filter(|kv| kv.value() == token.as_str().as_bytes())
        {
            let fence = epoch.saturating_add(u64::try_from(kv.create_revision()).unwrap_or(0));
            let held_on = kv.lease();
            if !granted {
                // A re-sent attempt found its own grant: its lease is kept alive again
                // before the validity is promised.
                if self.keep_alive(held_on).await?.is_none() {
                    return Ok(Acquire::Held { remaining: None });
                }
            }
            let others = self.keep_only(token, Some(held_on));
            self.revoke_later(others);
            if claim.kind == ClaimKind::Fair {
                let mut fair = self.fair();
                fair.places.remove(token);
                fair.standing.remove(token);
            }
            let validity = claim.ttl.saturating_sub(clock_drift(claim.ttl));
            return Ok(Acquire::Granted(Grant::new(fence, validity, token.clone())));
        }
        // Refused: the attempt's other leases go.
        let others = self.keep_only(token, kept);
        self.revoke_later(others);
        // Held: re-check at the fallback interval at the latest (a release, or the lease
        // running out, wakes the waiter before that). Free, yet refused (`None`): registered
        // waiters go first, or the fair queue's head.
        let remaining = kv.map(|_| attempt.recheck().unwrap_or(Duration::ZERO));
        Ok(Acquire::Held { remaining })
    }

    /// A fair claim's attempt. A waiting one stands in the queue first: its place is put
    /// once, on a lease of the waiter's `keep_waiter` that each later attempt renews (a
    /// renewal is no write on etcd, unlike a grant or a put), so a crashed waiter leaves
    /// the queue when it runs out. Then a read: only an attempt that finds the lock free
    /// and itself at the head (or, not queued, nobody queued) is granted a lease and sends
    /// the grant transaction, which checks it all again.
    async fn acquire_fair(&self, claim: &Claim, attempt: Attempt) -> Result<Acquire> {
        let (key, token) = (&claim.key, &claim.token);
        let lock = self.lock_key(key);
        let place = self.in_range("q", key, token);
        let mut standing = None;
        let mut holder = None;
        for _ in 0..2 {
            if let Some(keep) = attempt.keep_waiter() {
                match self.stand_in_queue(claim, keep).await? {
                    Some(s) => standing = Some(s),
                    // Abandoned: a late attempt of a claim given up.
                    None => return Ok(Acquire::Held { remaining: None }),
                }
            }
            let head_first = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1);
            let look = Txn::new().and_then([
                TxnOp::get(lock.clone(), None),
                TxnOp::get(self.range_prefix("q", key), Some(head_first)),
                TxnOp::get(place.clone(), None),
            ]);
            let resp = self.txn("fair look", look).await?;
            let ops = resp.op_responses();
            holder = ops.first().and_then(first_kv).cloned();
            let head = ops.get(1).and_then(first_kv).map(|kv| kv.key().to_vec());
            let placed = ops.get(2).and_then(first_kv).is_some();
            if standing.is_some() && !placed {
                // The place went (it ran out between attempts): stand in the queue again.
                self.fair().standing.remove(token);
                continue;
            }
            let ours = holder
                .as_ref()
                .is_some_and(|kv| kv.value() == token.as_str().as_bytes());
            let at_head = match &head {
                Some(h) => *h == place,
                None => standing.is_none(),
            };
            if ours || (holder.is_none() && at_head) {
                break;
            }
            let kept = standing.map(|(_, lease)| lease);
            let others = self.keep_only(token, kept);
            self.revoke_later(others);
            // Held, or free with another waiter at the head (woken by the release): back at
            // the re-check, or at the next wake-up.
            let remaining = holder
                .as_ref()
                .map(|_| attempt.recheck().unwrap_or(Duration::ZERO));
            return Ok(Acquire::Held { remaining });
        }
        let _ = holder;
        let lease = self.grant_for(token, claim.ttl).await?;
        let mine = standing.map(|(rev, _)| rev);
        let answer = self
            .grant_txn(|epoch| self.fair_txn(claim, mine, lease, epoch))
            .await?;
        let (granted, kv, epoch) = answer;
        self.conclude(
            claim,
            attempt,
            (granted, kv),
            epoch,
            standing.map(|(_, lease)| lease),
        )
        .await
    }

    /// Puts `claim`'s place in its key's queue, or renews the lease of the place it has:
    /// the place's create revision and lease; `None` for an abandoned claim.
    async fn stand_in_queue(&self, claim: &Claim, keep: Duration) -> Result<Option<(i64, i64)>> {
        let token = &claim.token;
        let known = self.fair().standing.get(token).copied();
        if let Some((rev, lease, renewed)) = known {
            // Renewed lately (an attempt woken by a release comes soon after the last):
            // still there for half its time at least.
            if renewed.elapsed() < keep / 2 {
                return Ok(Some((rev, lease)));
            }
            let at = Instant::now();
            if self.keep_alive(lease).await?.is_some() {
                if let Some(entry) = self.fair().standing.get_mut(token) {
                    entry.2 = at;
                }
                return Ok(Some((rev, lease)));
            }
        }
        let at = Instant::now();
        let lease = self.grant_for(token, keep).await?;
        let place = self.in_range("q", &claim.key, token);
        // A put keeps the key's create revision (its place) if it is there. Not for an
        // abandoned claim (a late attempt of one).
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.bar_key(token),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(place.clone(), "", Some(PutOptions::new().with_lease(lease))),
                TxnOp::get(place, None),
            ]);
        let resp = self.txn("fair enqueue", txn).await?;
        let ops = resp.op_responses();
        let Some(rev) = ops.get(1).and_then(first_kv).map(KeyValue::create_revision) else {
            self.revoke_later(self.keep_only(token, None));
            return Ok(None);
        };
        let mut fair = self.fair();
        fair.standing.insert(token.clone(), (rev, lease, at));
        fair.places.insert(token.clone(), rev);
        Ok(Some((rev, lease)))
    }

    /// The grant transaction of a fair claim (under the epoch check): the lock free, the
    /// claim not abandoned, and the claim at the head of the queue (`mine`: its place's
    /// create revision), or, not queued, nobody queued.
    fn fair_txn(&self, claim: &Claim, mine: Option<i64>, lease: i64, epoch: u64) -> (Txn, bool) {
        let (key, token) = (&claim.key, &claim.token);
        let place = self.in_range("q", key, token);
        let queue = self.range_prefix("q", key);
        let lock = self.lock_key(key);
        let mut when = vec![
            Compare::create_revision(lock.clone(), CompareOp::Equal, 0),
            Compare::create_revision(self.bar_key(token), CompareOp::Equal, 0),
            Compare::create_revision(self.tomb_key(token), CompareOp::Equal, 0),
        ];
        if let Some(rev) = mine {
            // At the head: every entry of the queue (this one included) came at or after it.
            when.push(
                Compare::create_revision(queue.clone(), CompareOp::Greater, rev - 1).with_prefix(),
            );
        }
        let on = || Some(PutOptions::new().with_lease(lease));
        let mut then = vec![TxnOp::put(lock.clone(), token.as_str(), on())];
        if let Some(label) = token.label() {
            then.push(TxnOp::put(self.label_key(key), label, on()));
        }
        then.push(TxnOp::delete(place, None));
        then.push(TxnOp::get(lock.clone(), None));
        let grant = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(lock.clone(), None)]);
        let layer = mine.is_none();
        let inner = if layer {
            // Not queued (a single attempt): only while nobody is.
            yield_layer(queue, lock, grant)
        } else {
            grant
        };
        (self.under_epoch(inner, epoch), layer)
    }

    // ---- release ----

    async fn release_plain(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        let (key, token) = (&claim.key, &claim.token);
        let lock = self.lock_key(key);
        let abandon = how == Release::Abandon;
        let mut fresh = false;
        loop {
            let tomb = self.tomb_lease(fresh).await?;
            let on_tomb = || Some(PutOptions::new().with_lease(tomb));
            let mut then = vec![
                TxnOp::get(lock.clone(), None),
                TxnOp::delete(lock.clone(), None),
                TxnOp::delete(self.label_key(key), None),
            ];
            let mut els = Vec::new();
            if abandon {
                for ops in [&mut then, &mut els] {
                    ops.push(TxnOp::put(self.bar_key(token), "", on_tomb()));
                    ops.push(TxnOp::delete(self.in_range("w", key, token), None));
                    ops.push(TxnOp::delete(self.in_range("q", key, token), None));
                }
            } else {
                then.push(TxnOp::put(self.tomb_key(token), "", on_tomb()));
                els.push(TxnOp::get(self.tomb_key(token), None));
            }
            let txn = Txn::new()
                .when([Compare::value(
                    lock.clone(),
                    CompareOp::Equal,
                    token.as_str(),
                )])
                .and_then(then)
                .or_else(els);
            let mut c = self.client();
            let timeout = self.inner.opts.timeout;
            let sent =
                in_tokio(async move { tokio::time::timeout(timeout, c.txn(txn)).await }).await;
            let resp = match sent {
                Ok(Ok(r)) => r,
                Ok(Err(e)) if lease_not_found(&e) && !fresh => {
                    fresh = true;
                    continue;
                }
                Ok(Err(e)) => return Err(failure("release", e)),
                Err(_) => {
                    return Err(Error::backend(Unavailable(format!(
                        "etcd: release: no answer within {timeout:?}"
                    ))))
                }
            };
            self.saw(resp.header().map(|h| h.revision()));
            // Every lease of the token goes: a late copy of one of its acquires then fails
            // (its lease is not found) rather than taking the lock again.
            let mut ids = self.keep_only(token, None);
            if resp.succeeded() {
                let ops = resp.op_responses();
                if let Some(kv) = ops.first().and_then(first_kv) {
                    if !ids.contains(&kv.lease()) {
                        ids.push(kv.lease()); // granted through another backend
                    }
                }
                self.revoke_later(ids);
                return Ok(Some(0));
            }
            self.revoke_later(ids);
            if abandon {
                let mut fair = self.fair();
                fair.places.remove(token);
                fair.standing.remove(token);
                return Ok(None);
            }
            let ops = resp.op_responses();
            return Ok(ops.first().and_then(first_kv).map(|_| 0));
        }
    }

    // ---- extend ----

    async fn extend_chunk(&self, leases: &[Lease<'_>]) -> Result<Vec<Extended>> {
        let mut ops = Vec::with_capacity(leases.len() * 2);
        for l in leases {
            ops.push(TxnOp::get(self.lock_key(l.key), None));
            ops.push(TxnOp::get(self.label_key(l.key), None));
        }
        let resp = self.txn("extend", Txn::new().and_then(ops)).await?;
        let answers = resp.op_responses();
        let checks = leases.iter().enumerate().map(|(i, l)| {
            let kv = answers.get(2 * i).and_then(first_kv).cloned();
            let label = answers
                .get(2 * i + 1)
                .and_then(first_kv)
                .map(|kv| kv.value().to_vec());
            async move {
                let Some(kv) = kv.filter(|kv| kv.value() == l.token.as_str().as_bytes()) else {
                    return Extended::Gone;
                };
                match self.extend_one(l, kv.lease(), label).await {
                    Ok(e) => e,
                    Err(e) => Extended::Failed(e),
                }
            }
        });
        Ok(futures::future::join_all(checks).await)
    }

    /// Keeps the lease of one held lock alive (or moves the lock to a longer lease).
    async fn extend_one(&self, l: &Lease<'_>, id: i64, label: Option<Vec<u8>>) -> Result<Extended> {
        let want = lease_secs(l.ttl);
        let Some(granted) = self.keep_alive(id).await? else {
            return Ok(Extended::Gone);
        };
        let validity = l.ttl.saturating_sub(clock_drift(l.ttl));
        if granted >= want {
            return Ok(Extended::Held(validity));
        }
        if l.token.is_hold() {
            // A reign's holds and owner are on its lease too: it keeps its lease, and is
            // promised only what the lease was granted with.
            let ttl = Duration::from_secs(u64::try_from(granted).unwrap_or(0));
            return Ok(Extended::Held(ttl.saturating_sub(clock_drift(ttl))));
        }
        // Longer than the lease was granted with: the lock moves to a new lease, in one
        // transaction that holds only while the key is still this token's on the old one.
        let mut c = self.client();
        let fresh = self.call("lease grant", c.lease_grant(want, None)).await?;
        let (fresh, fresh_ttl) = (fresh.id(), fresh.ttl());
        let lock = self.lock_key(l.key);
        let on = || Some(PutOptions::new().with_lease(fresh));
        let mut then = vec![TxnOp::put(lock.clone(), l.token.as_str(), on())];
        if let Some(label) = label {
            then.push(TxnOp::put(self.label_key(l.key), label, on()));
        }
        let txn = Txn::new()
            .when([
                Compare::value(lock.clone(), CompareOp::Equal, l.token.as_str()),
                Compare::lease(lock, CompareOp::Equal, id),
            ])
            .and_then(then);
        let resp = self.txn("extend", txn).await;
        match resp {
            Ok(r) if r.succeeded() => {
                let mut ls = self.leases();
                if let Some((ids, _)) = ls.by_token.get_mut(l.token) {
                    ids.retain(|i| *i != id);
                    ids.push(fresh);
                }
                ls.granted.remove(&id);
                ls.granted.insert(fresh, fresh_ttl);
                drop(ls);
                self.revoke_later(vec![id]);
                Ok(Extended::Held(validity))
            }
            Ok(_) => {
                self.revoke_later(vec![fresh]);
                Ok(Extended::Gone)
            }
            Err(e) => Err(e),
        }
    }

    /// A wake-up from the watch of `key` (of every key under it, with `prefix`), once
    /// etcd has created the watch. `hook`: what a delete does instead of waking one local
    /// subscriber.
    async fn subscribe_key(
        &self,
        key: Vec<u8>,
        prefix: bool,
        hook: Option<watch::Hook>,
    ) -> Result<Subscription> {
        self.watch_key(key, prefix, hook, false).await
    }

    /// A wake-up from every event of `key`, a put too, waking every local subscriber (the
    /// cache's fill notifications).
    async fn subscribe_key_every(&self, key: Vec<u8>) -> Result<Subscription> {
        self.watch_key(key, false, None, true).await
    }

    async fn watch_key(
        &self,
        key: Vec<u8>,
        prefix: bool,
        hook: Option<watch::Hook>,
        every: bool,
    ) -> Result<Subscription> {
        let (reply, answer) = oneshot::channel();
        let gone = || Error::backend(Unavailable("etcd: the watch task has stopped".into()));
        let cmd = watch::Cmd::Watch {
            key: key.clone(),
            prefix,
            hook,
            every,
            reply,
        };
        self.inner.watch.unbounded_send(cmd).map_err(|_| gone())?;
        let timeout = self.inner.opts.timeout;
        // On an error or a timeout, no subscriber is counted (the watch task drops one whose
        // answer finds nobody listening).
        let event = match runtime::until(Some(Instant::now() + timeout), answer).await {
            Some(Ok(Ok(event))) => event,
            Some(Ok(Err(e))) => return Err(e),
            Some(Err(_)) => return Err(gone()),
            None => {
                return Err(Error::backend(Unavailable(format!(
                    "etcd: watch not created within {timeout:?}"
                ))))
            }
        };
        let guard = Unwatch {
            key,
            cmds: self.inner.watch.clone(),
        };
        Ok(Subscription::new(event).with_guard(guard))
    }
}

/// Takes a fair waiter's subscription out of [`FairWaiters`].
struct FairGuard {
    fair: Arc<Mutex<FairWaiters>>,
    key: Vec<u8>,
    token: Token,
}

impl Drop for FairGuard {
    fn drop(&mut self) {
        let mut fair = self.fair.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = fair.by_key.get_mut(&self.key) {
            list.retain(|(t, e)| *t != self.token && e.strong_count() > 0);
            if list.is_empty() {
                fair.by_key.remove(&self.key);
            }
        }
        fair.places.remove(&self.token);
        fair.standing.remove(&self.token);
    }
}

/// Drops one subscriber of a key from the watch stream.
struct Unwatch {
    key: Vec<u8>,
    cmds: mpsc::UnboundedSender<watch::Cmd>,
}

impl Drop for Unwatch {
    fn drop(&mut self) {
        let _ = self.cmds.unbounded_send(watch::Cmd::Unwatch {
            key: std::mem::take(&mut self.key),
        });
    }
}

#[async_trait]
impl Backend for EtcdBackend {
    /// Plain, fair and reentrant claims; see [`EtcdBackend`] for why not shared ones.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fair: true,
            reentrant: true,
            ..Capabilities::PLAIN
        }
    }

    /// The attempt runs as a task of its own on the caller's runtime, to its end even if the
    /// caller's future is dropped or never polled again (as a Redis command runs once sent): a waiter
    /// polled once stands in the queue, and an attempt cut short is given back by the
    /// caller's abandon, whose bar refuses whatever of it comes later.
    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        claim.check_token()?;
        // A TTL past a year is refused, not rounded into an etcd lease it cannot be.
        crate::options::check_ttl(claim.ttl)?;
        let _ = terms; // not a Redlock node: no floor, no uptime condition
        self.capabilities().check(&claim.kind, self)?;
        let (this, claim) = (self.clone(), claim.clone());
        runtime::Rt::current()
            .run(async move {
                match &claim.kind {
                    ClaimKind::Reentrant(owner) => {
                        this.acquire_reentrant(&claim, owner, attempt).await
                    }
                    ClaimKind::Fair => this.acquire_fair(&claim, attempt).await,
                    _ => this.acquire_plain(&claim, attempt).await,
                }
            })
            .await
            .unwrap_or_else(|| {
                Err(Error::backend(Unavailable(
                    "etcd: the runtime shut down during the attempt".into(),
                )))
            })
    }

    async fn extend(&self, leases: &[Lease<'_>], _terms: NodeTerms) -> Result<Vec<Extended>> {
        let chunks = leases.chunks(EXTEND_CHUNK).map(|c| async move {
            match self.extend_chunk(c).await {
                // Refused as a whole (a request over etcd's size limit, say): each lease on
                // its own, so that one bad key does not fail its neighbours.
                Err(e) if c.len() > 1 && crate::backend::refused(&e) => {
                    let each = c.iter().map(|l| async move {
                        match self.extend_chunk(std::slice::from_ref(l)).await {
                            Ok(mut v) => v.pop().unwrap_or_else(|| {
                                Extended::Failed(Error::backend("etcd: extend: no answer"))
                            }),
                            Err(e) => Extended::Failed(e),
                        }
                    });
                    Ok(futures::future::join_all(each).await)
                }
                answer => answer,
            }
        });
        let answers = futures::future::join_all(chunks).await;
        let mut out = Vec::with_capacity(leases.len());
        let mut first_err = None;
        for (chunk, answer) in leases.chunks(EXTEND_CHUNK).zip(answers) {
            match answer {
                Ok(v) => out.extend(v),
                Err(e) => {
                    for _ in chunk {
                        out.push(Extended::Failed(crate::backend::for_each_caller(&e)));
                    }
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            // No lease reached at all.
            Some(e) if out.iter().all(|x| matches!(x, Extended::Failed(_))) => Err(e),
            _ => Ok(out),
        }
    }

    fn disturbed(&self) -> BoxFuture<'static, ()> {
        Box::pin(self.inner.disturbance.listen())
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        self.capabilities().check(&claim.kind, self)?;
        if matches!(claim.kind, ClaimKind::Reentrant(_)) {
            return match self.release_reentrant(claim, how).await {
                // The tombstone lease went (a wiped store): once more with a new one.
                Err(e) if e.to_string().contains("lease not found") => {
                    self.tomb_lease(true).await?;
                    self.release_reentrant(claim, how).await
                }
                answer => answer,
            };
        }
        self.release_plain(claim, how).await
    }

    /// Releases of the claim's key (a delete: a release, or the lease running out) wake one
    /// waiter of this process; a fair waiter is woken by the same deletes and looks whether
    /// it is at the head.
    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        let lock = self.lock_key(&claim.key);
        if claim.kind != ClaimKind::Fair {
            return self.subscribe_key(lock, false, None).await;
        }
        // A fair waiter: a delete of the lock or of a queue place (a head that gave up or
        // ran out) wakes this process's waiter nearest the head, which looks whether it is.
        let event = Arc::new(Event::new());
        self.fair()
            .by_key
            .entry(lock.clone())
            .or_default()
            .push((claim.token.clone(), Arc::downgrade(&event)));
        let guard = FairGuard {
            fair: self.inner.fair.clone(),
            key: lock.clone(),
            token: claim.token.clone(),
        };
        let hook = |fair: Arc<Mutex<FairWaiters>>, key: Vec<u8>| -> watch::Hook {
            Arc::new(move |all| {
                fair.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .wake(&key, all)
            })
        };
        let on_lock = self
            .subscribe_key(
                lock.clone(),
                false,
                Some(hook(self.inner.fair.clone(), lock.clone())),
            )
            .await?;
        let on_queue = self
            .subscribe_key(
                self.range_prefix("q", &claim.key),
                true,
                Some(hook(self.inner.fair.clone(), lock)),
            )
            .await?;
        Ok(Subscription::new(event)
            .with_guard(guard)
            .with_guard(on_lock)
            .with_guard(on_queue))
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        let epoch = self.epoch().await?;
        let txn = Txn::new().and_then([
            TxnOp::get(self.lock_key(key), None),
            TxnOp::get(self.label_key(key), None),
            TxnOp::get(
                self.range_prefix("q", key),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
            self.hold_count_op(key),
        ]);
        let resp = self.txn("inspect", txn).await?;
        let ops = resp.op_responses();
        let mut info = LockInfo::new();
        if let Some(kv) = ops.first().and_then(first_kv) {
            info.held = true;
            info.fencing_token =
                Some(epoch.saturating_add(u64::try_from(kv.create_revision()).unwrap_or(0)));
            let mut c = self.client();
            let ttl = self
                .call("lease ttl", c.lease_time_to_live(kv.lease(), None))
                .await?;
            info.remaining = u64::try_from(ttl.ttl()).ok().map(Duration::from_secs);
            info.holder_label = ops
                .get(1)
                .and_then(first_kv)
                .and_then(|kv| std::str::from_utf8(kv.value()).ok())
                .map(str::to_owned);
        }
        if let Some(TxnOpResponse::Get(g)) = ops.get(2) {
            info.queue_len = u64::try_from(g.count()).unwrap_or(0);
        }
        if let Some(TxnOpResponse::Get(g)) = ops.get(3) {
            let holds = u64::try_from(g.count()).unwrap_or(0);
            info.reentrant_count = (info.held && holds > 0).then_some(holds);
        }
        Ok((!info.is_blank()).then_some(info))
    }

    /// Not a [`Redlock`](crate::Redlock) node: [`Error::Unsupported`].
    async fn raise_fence(&self, key: &LeaseKey, _at_least: u64) -> Result<()> {
        Err(Error::Unsupported(format!(
            "etcd is a quorum store of its own, not a Redlock node (raise_fence on {key})"
        )))
    }
}
