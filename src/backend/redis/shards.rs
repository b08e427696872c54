//! A Redis Cluster served one shard at a time: a connection of its own per primary (a
//! [`RedisBackend`] each, with its own group commit, subscriber and reconnects), and the slot
//! table that routes each lock's key to its primary.
//!
//! fred's cluster client has one router for every shard: when a connection breaks it
//! re-syncs them all, and that sync fails as long as a dead primary still owns slots, so one
//! primary down stalled the commands to the healthy ones too (every lease was lost). Here a
//! dead primary fails only the calls for its own slots. The routing is the backend's own,
//! whichever client carries the commands: a client is only asked for one node's connections
//! (`transport::Connector`).
//!
//! The table comes from `CLUSTER SLOTS`, asked of any node that answers (the connected ones
//! first, then the seeds and the addresses in the table, on a connection of their own), at
//! connect and again whenever a call is redirected (`MOVED`: the call is then sent once more,
//! to the new owner; a redirected call ran nothing) or a node fails a call (a failover may
//! have moved its slots: the table is asked for in the background, and the next calls go
//! where it says then). A node's backend is kept once made: a waiter subscribed through it
//! keeps being woken there (a cluster delivers `PUBLISH` to every node, replicas included).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use event_listener::Event;

use super::transport::{self, Connector, Value};
use super::{Checks, RedisBackend};
use crate::backend::{Backend, Claim, Extended, Lease, NodeTerms, Subscription};
use crate::error::{Error, Result};
use crate::runtime::Rt;

/// At most one table refresh per this long after a failed call (a dead node fails every
/// call for it; one refresh tells where its slots went).
const REFRESH_EVERY: Duration = Duration::from_millis(100);

/// How many redirections (`MOVED`) a call follows at most.
const MAX_TRIES: usize = 40;

/// How long a call waits before it is sent again to a slot being migrated.
const MIGRATING_PAUSE: Duration = Duration::from_millis(25);

/// How long a call is sent again, every [`MIGRATING_PAUSE`], while its slot is migrated
/// (`TRYAGAIN`, or `ASK` once its keys have moved: `ASKING` is not sent, so a call waits for
/// the slot's migration to end, as the `MOVED` that follows says). A caller's own deadline
/// ends the wait sooner.
const MIGRATING_BUDGET: Duration = Duration::from_secs(10);

/// How often the table is asked for while waiters are subscribed: a slot moved by someone
/// else is seen within this long, and its waiters' subscriptions moved. Redis ends them on the
/// old owner as the slot leaves (fred drops that notice), so a release published on the new
/// owner before the move is seen here reaches its waiters only when they look again, after
/// the move: this bounds how late such a hand-off is (it was a second). The table is asked of
/// a node the waiters are subscribed on first, which knows at once that it gave a slot away.
/// At the same pace each node checks that it still has its waiters' shard channels (a slot
/// that left and came back between two looks ended them unseen; see `PubSub::verify`).
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// The primaries of a cluster and the slots each serves.
pub(super) struct Shards {
    /// Opens a node's connections with the cluster's settings (credentials, TLS, timeouts,
    /// reconnects).
    connector: Arc<dyn Connector>,
    /// What each node's backend checks (eviction policy, replica acknowledgement).
    checks: Checks,
    /// Slot ranges (first, last) and the address ("host:port") of the primary serving them,
    /// sorted by first slot.
    table: RwLock<Vec<(u16, u16, String)>>,
    /// A backend per node address, made at the first call for one of its slots.
    nodes: Mutex<HashMap<String, RedisBackend>>,
    /// The addresses the URL named, asked for the table when no connected node answers.
    seeds: Vec<String>,
    /// When the table was last asked for in the background after a failure.
    refreshed: Mutex<Option<Instant>>,
    /// Bumped by every new table: a caller that saw a redirection under an older table
    /// waits for one newer than it.
    generation: AtomicU64,
    /// One refresh at a time.
    refreshing: futures::lock::Mutex<()>,
    /// The waiters' subscriptions, each kept on the node that serves its key.
    routes: Mutex<Vec<Weak<Route>>>,
    /// One re-routing at a time.
    rerouting: futures::lock::Mutex<()>,
    /// Set while a subscription could not be moved to its slot's new owner: the next table
    /// tries again (otherwise a table that changed nothing moves nothing).
    unmoved: AtomicBool,
    /// A task asks for the table every [`WATCH_EVERY`] while subscriptions live.
    watching: AtomicBool,
}

/// A waiter's subscription on a cluster: on the node that serves its key, moved to the new
/// owner when the table says the key's slot has moved (Redis ends a shard channel's
/// subscriptions on a node that gives its slot away; a client may drop that notice).
struct Route {
    claim: Claim,
    /// The node it is subscribed on.
    addr: Mutex<String>,
    /// The node's subscription, swapped for the new owner's when the slot moves.
    current: Arc<Mutex<Subscription>>,
    /// Notified after a move: the waiter looks again (a release in between was published
    /// where it was not listening) and listens to the new node.
    moved: Arc<Event>,
}

impl Shards {
    /// A backend over the cluster whose seed nodes are `seeds`, routing each call to the
    /// primary that serves its key.
    pub(super) async fn backend(
        seeds: Vec<(String, u16)>,
        connector: Arc<dyn Connector>,
        checks: Checks,
    ) -> Result<RedisBackend> {
        let shards = Shards::connect(seeds, connector, checks).await?;
        let first = shards.first()?;
        Ok(RedisBackend {
            inner: first.inner,
            shards: Some(shards),
            quarantine: Duration::ZERO,
        })
    }

    /// Asks the seed nodes, in turn, for the slot table; the first that answers is kept as
    /// the first node's backend.
    async fn connect(
        seeds: Vec<(String, u16)>,
        connector: Arc<dyn Connector>,
        checks: Checks,
    ) -> Result<Arc<Shards>> {
        let shards = Arc::new(Shards {
            connector,
            checks,
            table: RwLock::new(Vec::new()),
            nodes: Mutex::new(HashMap::new()),
            seeds: seeds.iter().map(|(h, p)| format!("{h}:{p}")).collect(),
            refreshed: Mutex::new(None),
            generation: AtomicU64::new(0),
            refreshing: futures::lock::Mutex::new(()),
            routes: Mutex::new(Vec::new()),
            rerouting: futures::lock::Mutex::new(()),
            unmoved: AtomicBool::new(false),
            watching: AtomicBool::new(false),
        });
        let mut last = Error::invalid("a cluster URL names no node");
        for (host, port) in seeds {
            let addr = format!("{host}:{port}");
            match shards.open(&addr, true).await {
                Ok(node) => match slots(&node, &host).await {
                    Ok(table) => {
                        *write(&shards.table) = table;
                        lock(&shards.nodes).insert(addr, node);
                        return Ok(shards);
                    }
                    Err(e) => last = e,
                },
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The table's generation now: see [`redirected`](Self::redirected).
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The address of the primary serving `key`'s slot now, if the table names one.
    fn owner(&self, key: &str) -> std::result::Result<String, u16> {
        let slot = transport::slot(key.as_bytes());
        let table = read(&self.table);
        let at = table.partition_point(|(first, _, _)| *first <= slot);
        match at.checked_sub(1).map(|i| &table[i]) {
            Some((_, last, addr)) if slot <= *last => Ok(addr.clone()),
            _ => Err(slot),
        }
    }

    /// A number naming the primary that serves `key` now (`u64::MAX`: none does), for
    /// [`Backend::extend_group`](crate::backend::Backend::extend_group).
    pub(super) fn group(&self, key: &str) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault};
        type Fixed = BuildHasherDefault<std::collections::hash_map::DefaultHasher>;
        self.owner(key)
            .map_or(u64::MAX, |addr| Fixed::default().hash_one(addr))
    }

    /// The backend of the primary serving `key` now (connected in the background if new).
    pub(super) async fn node(self: &Arc<Self>, key: &str) -> Result<RedisBackend> {
        Ok(self.located(key).await?.1)
    }

    /// The address and the backend of the primary serving `key` now.
    async fn located(self: &Arc<Self>, key: &str) -> Result<(String, RedisBackend)> {
        let addr = match self.owner(key) {
            Ok(addr) => addr,
            Err(slot) => {
                self.refresh_soon();
                return Err(Error::backend(format!(
                    "no primary of the cluster serves slot {slot} (of {key})"
                )));
            }
        };
        if let Some(node) = lock(&self.nodes).get(&addr) {
            return Ok((addr, node.clone()));
        }
        let node = self.open(&addr, false).await?;
        let node = lock(&self.nodes)
            .entry(addr.clone())
            .or_insert(node)
            .clone();
        Ok((addr, node))
    }

    /// A subscription for `claim`'s wake-ups on the node that serves its key, kept there:
    /// moved when the key's slot moves (see [`Route`]). The table is asked for every
    /// [`WATCH_EVERY`] while subscriptions live, so a move made by someone else is seen.
    pub(super) async fn subscribe(self: &Arc<Self>, claim: &Claim) -> Result<Subscription> {
        let key = claim.key.as_str();
        let (mut moves, since) = (0, Instant::now());
        let (addr, sub) = loop {
            let seen = self.generation();
            let (addr, node) = self.located(key).await?;
            // SSUBSCRIBE is answered MOVED by a node that does not serve the slot.
            let result = node.subscribe(claim).await;
            if !self.redirected(&result, seen, &mut moves, since).await {
                break (addr, result?);
            }
        };
        let route = Arc::new(Route {
            claim: claim.clone(),
            addr: Mutex::new(addr.clone()),
            current: Arc::new(Mutex::new(sub)),
            moved: Arc::new(Event::new()),
        });
        lock(&self.routes).push(Arc::downgrade(&route));
        self.watch();
        // A table that changed since the SSUBSCRIBE may have been re-routed without it.
        if self.owner(key).ok().as_deref() != Some(addr.as_str()) {
            self.reroute_soon();
        }
        Ok(Subscription::routed(route.current.clone(), route.moved.clone()).with_guard(route))
    }

    /// Moves each live subscription whose key's slot the table now puts on another node.
    /// One that cannot be moved now (the new owner does not serve the slot yet, or does not
    /// answer) is tried again at the next table. (Its waiter is not woken meanwhile: its
    /// calls could not be served either.)
    async fn reroute(self: &Arc<Self>) {
        let _one = self.rerouting.lock().await;
        self.unmoved.store(false, Ordering::Release);
        let mut unmoved = false;
        for route in self.live_routes() {
            let key = route.claim.key.as_str();
            let Ok(owner) = self.owner(key) else {
                unmoved = true;
                continue;
            };
            if *lock(&route.addr) == owner {
                continue;
            }
            let subscribed = match self.located(key).await {
                Ok((addr, node)) => node.subscribe(&route.claim).await.map(|sub| (addr, sub)),
                Err(e) => Err(e),
            };
            let Ok((addr, sub)) = subscribed else {
                unmoved = true;
                continue;
            };
            let old = std::mem::replace(&mut *lock(&route.current), sub);
            let left = std::mem::replace(&mut *lock(&route.addr), addr);
            // The old node ended the subscription as the slot left it: it is forgotten there
            // without a SUNSUBSCRIBE (see `PubSub::ended`).
            if let Some(node) = lock(&self.nodes).get(&left) {
                node.inner.pubsub.ended(transport::slot(key.as_bytes()));
            }
            drop(old);
            route.moved.notify(usize::MAX);
        }
        if unmoved {
            self.unmoved.store(true, Ordering::Release);
        }
    }

    /// The live subscriptions (the others are forgotten).
    fn live_routes(&self) -> Vec<Arc<Route>> {
        let mut routes = lock(&self.routes);
        routes.retain(|r| r.strong_count() > 0);
        routes.iter().filter_map(Weak::upgrade).collect()
    }

    /// The node a live subscription is on, if one lives (the others are forgotten).
    fn routed_node(&self) -> Option<String> {
        let mut routes = lock(&self.routes);
        routes.retain(|r| r.strong_count() > 0);
        let route = routes.iter().find_map(Weak::upgrade)?;
        drop(routes);
        let addr = lock(&route.addr).clone();
        Some(addr)
    }

    fn reroute_soon(self: &Arc<Self>) {
        let this = self.clone();
        crate::runtime::background().spawn(async move { this.reroute().await });
    }

    /// Starts the task that asks for the table every [`WATCH_EVERY`] while subscriptions
    /// live (unless it runs). It holds the shards weakly: a dropped backend ends it.
    fn watch(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = Arc::downgrade(self);
        crate::runtime::background().spawn(async move {
            loop {
                crate::runtime::sleep(WATCH_EVERY).await;
                let Some(this) = this.upgrade() else { return };
                let mut first = this.routed_node();
                if first.is_none() {
                    this.watching.store(false, Ordering::Release);
                    // A subscription made meanwhile saw the task running: take it back on.
                    first = this.routed_node();
                    if first.is_none() || this.watching.swap(true, Ordering::AcqRel) {
                        return;
                    }
                }
                // Asked of a node a waiter is subscribed on first: it knows at once when it
                // gives a slot away (another node may learn it later, by gossip).
                this.refresh_asking(this.generation(), first.as_deref())
                    .await;
                // A slot that left a node and came back since the last look changed nothing
                // in the table, but ended its subscriptions there: each node checks its own,
                // in a task of its own (a node that does not answer holds up only itself).
                let nodes: Vec<(String, RedisBackend)> = lock(&this.nodes)
                    .iter()
                    .map(|(addr, node)| (addr.clone(), node.clone()))
                    .collect();
                for (addr, node) in nodes {
                    let pubsub = node.inner.pubsub.clone();
                    // Weakly too: a dropped backend is not kept by a check under way.
                    let table = Arc::downgrade(&this);
                    let serves = move |channel: &str| {
                        table
                            .upgrade()
                            .is_some_and(|t| t.owner(channel).is_ok_and(|a| a == addr))
                    };
                    crate::runtime::background().spawn(async move { pubsub.verify(serves).await });
                }
            }
        });
    }

    /// After a call on a node, made when the table's generation was `seen`, first sent at
    /// `since` and redirected `moves` times so far: whether it is to be sent again, none of it
    /// having run. `MOVED`: once a table newer than `seen` is there, [`MAX_TRIES`] times at
    /// most. `TRYAGAIN` or
    /// `ASK` (its slot is being migrated; the call declares every key it may touch, so Redis
    /// answers before running it): after [`MIGRATING_PAUSE`], by when the migration may be
    /// done (then `MOVED` follows), for [`MIGRATING_BUDGET`] at most. Any other error of the node's (not of one lease's own commands) may
    /// mean its slots moved: the table is asked for in the background, at most every
    /// [`REFRESH_EVERY`].
    pub(super) async fn redirected<T>(
        self: &Arc<Self>,
        result: &Result<T>,
        seen: u64,
        moves: &mut usize,
        since: Instant,
    ) -> bool {
        let Err(e) = result else {
            return false;
        };
        if crate::backend::refused(e) {
            return false;
        }
        let text = e.to_string();
        if text.contains("MOVED ") {
            *moves += 1;
            if *moves > MAX_TRIES {
                return false;
            }
            self.refresh(seen).await;
            return true;
        }
        if text.contains("TRYAGAIN") || text.contains("ASK ") {
            if since.elapsed() >= MIGRATING_BUDGET {
                return false;
            }
            crate::runtime::sleep(MIGRATING_PAUSE).await;
            return true;
        }
        self.refresh_soon();
        false
    }

    /// Asks for the table in the background, unless that was done less than
    /// [`REFRESH_EVERY`] ago.
    fn refresh_soon(self: &Arc<Self>) {
        {
            let mut last = lock(&self.refreshed);
            if last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let (this, seen) = (self.clone(), self.generation());
        Rt::current().spawn(async move { this.refresh(seen).await });
    }

    /// Asks for the slot table unless one newer than generation `seen` came meanwhile: the
    /// connected nodes first, then every other address known (the map's, the seeds, the
    /// table's) on a connection of its own, until one answers.
    async fn refresh(self: &Arc<Self>, seen: u64) {
        self.refresh_asking(seen, None).await;
    }

    /// [`refresh`](Self::refresh), asking the node at `first` before the other connected
    /// ones.
    async fn refresh_asking(self: &Arc<Self>, seen: u64, first: Option<&str>) {
        let _one = self.refreshing.lock().await;
        if self.generation() != seen {
            return;
        }
        let known: Vec<(String, RedisBackend)> = lock(&self.nodes)
            .iter()
            .map(|(a, n)| (a.clone(), n.clone()))
            .collect();
        let (mut connected, idle): (Vec<_>, Vec<_>) = known
            .into_iter()
            .partition(|(_, n)| n.inner.connection.is_connected());
        connected.sort_by_key(|(a, _)| Some(a.as_str()) != first);
        for (addr, node) in &connected {
            if self.adopt(addr, node).await {
                return;
            }
        }
        let mut others: Vec<String> = idle.into_iter().map(|(a, _)| a).collect();
        others.extend(self.seeds.iter().cloned());
        others.extend(read(&self.table).iter().map(|(_, _, a)| a.clone()));
        // Each address once (the same node may be in the map, among the seeds and in the
        // table), and none already asked above.
        let mut asked: std::collections::HashSet<String> =
            connected.iter().map(|(a, _)| a.clone()).collect();
        others.retain(|a| asked.insert(a.clone()));
        for addr in others {
            if let Ok(node) = self.open(&addr, true).await {
                if self.adopt(&addr, &node).await {
                    lock(&self.nodes).entry(addr).or_insert(node);
                    return;
                }
            }
        }
    }

    /// Asks `node` (at `addr`) for the table and keeps it if it answers; a table that moved
    /// slots moves the subscriptions on them.
    async fn adopt(self: &Arc<Self>, addr: &str, node: &RedisBackend) -> bool {
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        match slots(node, host).await {
            Ok(table) => {
                let changed = *read(&self.table) != table;
                *write(&self.table) = table;
                self.generation.fetch_add(1, Ordering::AcqRel);
                // Also when unchanged, if a subscription could not be moved at the last
                // change: it is tried again.
                if changed || self.unmoved.load(Ordering::Acquire) {
                    self.reroute_soon();
                }
                true
            }
            Err(_) => false,
        }
    }

    /// A backend connected to the one node at `addr`, with the cluster's settings. Its
    /// script calls stay within one slot, as the cluster requires.
    async fn open(&self, addr: &str, wait: bool) -> Result<RedisBackend> {
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| Error::backend(format!("a cluster node with no port: {addr:?}")))?;
        let node = self.connector.node(host, port, wait)?;
        Box::pin(RedisBackend::assemble(node, true, wait, self.checks)).await
    }

    /// Resolves when any primary's backend connected so far is disturbed (see
    /// `Backend::disturbed`).
    pub(super) fn disturbed(&self) -> futures::future::BoxFuture<'static, ()> {
        use crate::backend::Backend;
        let nodes: Vec<_> = lock(&self.nodes).values().map(|n| n.disturbed()).collect();
        if nodes.is_empty() {
            return Box::pin(futures::future::pending());
        }
        Box::pin(async move {
            futures::future::select_all(nodes).await;
        })
    }

    /// A backend of one of the primaries (the one `connect` asked first).
    pub(super) fn first(&self) -> Result<RedisBackend> {
        lock(&self.nodes)
            .values()
            .next()
            .cloned()
            .ok_or_else(|| Error::backend("no primary of the cluster is connected"))
    }

    /// Extends `leases` on the primaries that serve them, each primary's at once: a lease
    /// whose primary fails is `Failed` alone.
    pub(super) async fn extend(
        self: &Arc<Self>,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> Vec<Extended> {
        // A node that is not connected fails its leases at once, without waiting for its
        // command timeout. (The watchdog sends each primary's leases in a call of their own,
        // see `group`; a call with several primaries' waits for them all.)
        let terms = terms.fail_fast(true);
        let mut out: Vec<Option<Extended>> = (0..leases.len()).map(|_| None).collect();
        let mut by_node: HashMap<usize, (RedisBackend, Vec<usize>)> = HashMap::new();
        for (i, lease) in leases.iter().enumerate() {
            match self.node(lease.key.as_str()).await {
                Ok(node) => {
                    // The node's connection, by its address in memory.
                    let id = Arc::as_ptr(&node.inner) as usize;
                    by_node
                        .entry(id)
                        .or_insert_with(|| (node, Vec::new()))
                        .1
                        .push(i);
                }
                Err(e) => out[i] = Some(Extended::Failed(e)),
            }
        }
        let calls = by_node.into_values().map(|(node, idx)| async move {
            let subset: Vec<Lease<'_>> = idx
                .iter()
                .map(|&i| Lease {
                    key: leases[i].key,
                    token: leases[i].token,
                    ttl: leases[i].ttl,
                })
                .collect();
            let reply = node.extend_leases(&subset, terms).await;
            (idx, reply)
        });
        let mut refresh = false;
        for (idx, reply) in futures::future::join_all(calls).await {
            match reply {
                Ok(extended) => {
                    for (i, e) in idx.into_iter().zip(extended) {
                        if let Extended::Failed(err) = &e {
                            refresh |= !crate::backend::refused(err);
                        }
                        out[i] = Some(e);
                    }
                }
                Err(e) => {
                    refresh = true;
                    for i in idx {
                        out[i] = Some(Extended::Failed(crate::backend::for_each_caller(&e)));
                    }
                }
            }
        }
        if refresh {
            self.refresh_soon();
        }
        out.into_iter()
            .map(|e| e.unwrap_or_else(|| Extended::Failed(Error::backend("no reply"))))
            .collect()
    }
}

/// The slot table as `node` (reached at `host`) sees it: `CLUSTER SLOTS`, primaries only.
async fn slots(node: &RedisBackend, host: &str) -> Result<Vec<(u16, u16, String)>> {
    let reply = node
        .inner
        .connection
        .command("CLUSTER", vec!["SLOTS".into()])
        .await
        .map_err(super::errors::store_error)?;
    let Value::Array(ranges) = reply else {
        return Err(Error::backend("CLUSTER SLOTS returned no array"));
    };
    let mut table = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(parts) = range else { continue };
        let slot = |i: usize| {
            parts
                .get(i)
                .and_then(Value::as_i64)
                .and_then(|s| u16::try_from(s).ok())
        };
        let primary = match parts.get(2) {
            Some(Value::Array(node)) => node,
            _ => continue,
        };
        let ip = primary
            .first()
            .and_then(Value::as_string)
            .unwrap_or_default();
        let port = primary.get(1).and_then(Value::as_i64);
        if let (Some(first), Some(last), Some(port)) = (slot(0), slot(1), port) {
            // An empty address means "the node you asked".
            let ip = if ip.is_empty() { host.to_owned() } else { ip };
            table.push((first, last, format!("{ip}:{port}")));
        }
    }
    if table.is_empty() {
        return Err(Error::backend(
            "CLUSTER SLOTS names no primary: is this a cluster node?",
        ));
    }
    table.sort_by_key(|(first, _, _)| *first);
    Ok(table)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}
