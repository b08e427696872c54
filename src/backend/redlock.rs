//! `Redlock`: one lock over N independent stores, granted by a majority.
//!
//! Every operation goes to all nodes at once, each with its own timeout, and returns as soon
//! as its outcome is decided (a majority agreed, or a majority can no longer agree): one slow
//! or paused node costs nothing while the others answer, and at most the per-node timeout
//! when it is needed for the majority. Every call is handed to its node's connection before
//! any decision; a call still out when the outcome is decided is dropped, but what it sent
//! runs on the node all the same (a release is sent even if nobody waits for it).
//!
//! Every kind of claim the nodes serve runs through the same round: nodes grant under a
//! lease token (a reentrant hold's reign may differ from node to node), and a majority must
//! agree on one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures::future;

use crate::backend::{
    not_sent, refused, same_error, short_debug, Acquire, Attempt, Backend, Capabilities, Claim,
    Extended, Grant, Lease, NodeTerms, Release, Subscription,
};
use crate::error::{Error, Result};
use crate::info::LockInfo;
use crate::options::{MAX_RETRY_DELAY, MAX_TTL, MIN_TTL};
use crate::runtime;
use crate::token::{LeaseKey, Token};

/// Added to the client's clock for the fencing-token floor proposed to every node. A node
/// mints at least its own clock in microseconds; proposing a little more than that lets every
/// node of the quorum mint the same token, so that no write-back round is needed.
const FLOOR_LEAD: Duration = Duration::from_secs(1);

/// Settings of a [`Redlock`].
///
/// ```
/// use std::time::Duration;
/// let opts = redlease::RedlockOptions::new()
///     .node_timeout(Duration::from_millis(20))
///     .retries(5)
///     .max_lease(Duration::from_secs(60));
/// assert_eq!(opts.node_timeout, Duration::from_millis(20));
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RedlockOptions {
    /// How long one node may take to answer one call. Default 50 ms.
    pub node_timeout: Duration,
    /// The clock-drift margin, as a share of the TTL (plus 2 ms). Default 0.01.
    pub drift_factor: f64,
    /// How many more rounds an attempt makes when too few nodes answered. Default 3.
    pub retries: u32,
    /// The most a retry waits (at random). Default 200 ms.
    pub retry_delay: Duration,
    /// The longest TTL this client sets on these nodes. Default
    /// [`DEFAULT_MAX_LEASE`](Self::DEFAULT_MAX_LEASE) (60 s).
    pub max_lease: Duration,
    /// How long a restarted node counts toward no majority; `None`: the longer of
    /// `max_lease` and [`DEFAULT_MAX_LEASE`](Self::DEFAULT_MAX_LEASE).
    pub restart_quarantine: Option<Duration>,
    /// Whether a recently restarted node is kept out of every majority. Default `true`.
    pub restart_guard: bool,
}

impl Default for RedlockOptions {
    fn default() -> Self {
        RedlockOptions {
            node_timeout: Duration::from_millis(50),
            drift_factor: 0.01,
            retries: 3,
            retry_delay: Duration::from_millis(200),
            max_lease: Self::DEFAULT_MAX_LEASE,
            restart_quarantine: None,
            restart_guard: true,
        }
    }
}

impl RedlockOptions {
    /// The longest lease a client sets on a Redlock's nodes unless told otherwise, and the
    /// least time a restarted node sits out: every client using the defaults agrees on it,
    /// whatever TTLs they use, so none of them counts a restarted node while a lease another
    /// one took there may still live.
    pub const DEFAULT_MAX_LEASE: Duration = Duration::from_secs(60);

    /// The defaults: node timeout 50 ms, clock-drift factor 0.01, 3 retries after a random
    /// delay of up to 200 ms, leases of at most 60 s, restarted nodes out for 60 s.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long one node may take to answer one call. An acquire attempt waits at most this
    /// (or half the lease's validity, if that is less) for a node it needs; an unreachable node
    /// fails at once. Default 50 ms.
    pub fn node_timeout(mut self, d: Duration) -> Self {
        self.node_timeout = d;
        self
    }

    /// The clock-drift margin, as a share of the TTL (plus 2 ms), taken off every lease's
    /// validity. Default 0.01. Must be in `[0, 0.5)`.
    pub fn drift_factor(mut self, f: f64) -> Self {
        self.drift_factor = f;
        self
    }

    /// How many more rounds an attempt makes when too few nodes answered (not when another
    /// client holds the lock: that is waited for, or reported). Default 3.
    pub fn retries(mut self, n: u32) -> Self {
        self.retries = n;
        self
    }

    /// The most a retry waits, at random between zero and this, so that clients that split
    /// the nodes between them do not retry in step. Default 200 ms.
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }

    /// The longest TTL this client sets on these nodes; a lease with a longer TTL is refused
    /// with [`Error::InvalidConfig`]. Default [`DEFAULT_MAX_LEASE`](Self::DEFAULT_MAX_LEASE)
    /// (60 s). Raising it raises the [restart quarantine](Self::restart_quarantine) with it;
    /// raise it on every client of the deployment, since theirs must cover this client's
    /// leases.
    pub fn max_lease(mut self, d: Duration) -> Self {
        self.max_lease = d;
        self
    }

    /// How long a node that has restarted counts toward no majority (it may have restarted
    /// empty and forgotten leases that others still hold). It must cover the longest lease
    /// any client of the deployment takes, so it is a deployment-wide statement: set it only
    /// when no client's TTL is above it. Default: the longer of
    /// [`max_lease`](Self::max_lease) and [`DEFAULT_MAX_LEASE`](Self::DEFAULT_MAX_LEASE),
    /// so a client with short leases still waits out the default of the others. Must be at
    /// least `max_lease`. Uptime is read at one-second resolution and rounded down, against
    /// the node.
    pub fn restart_quarantine(mut self, d: Duration) -> Self {
        self.restart_quarantine = Some(d);
        self
    }

    /// The restart quarantine in force.
    pub(crate) fn quarantine(&self) -> Duration {
        self.restart_quarantine
            .unwrap_or(self.max_lease.max(Self::DEFAULT_MAX_LEASE))
    }

    /// Whether a node that has been up for less than the
    /// [restart quarantine](Self::restart_quarantine) is kept out of every majority. Default
    /// `true`. Turn it off only
    /// when no node can come back without the leases it had: every node persists each write
    /// before answering (`appendonly yes`, `appendfsync always`), or is never restarted
    /// sooner than one restart quarantine after it stopped.
    pub fn restart_guard(mut self, on: bool) -> Self {
        self.restart_guard = on;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.node_timeout < Duration::from_millis(1)
            || self.node_timeout > Duration::from_secs(60)
        {
            return Err(Error::invalid(format!(
                "Redlock node_timeout must be at least 1 ms and at most 60 s, got {:?}",
                self.node_timeout
            )));
        }
        if !(0.0..0.5).contains(&self.drift_factor) {
            return Err(Error::invalid(format!(
                "Redlock drift_factor must be in [0, 0.5), got {}",
                self.drift_factor
            )));
        }
        if self.retry_delay > MAX_RETRY_DELAY {
            return Err(Error::invalid(format!(
                "Redlock retry_delay must be at most {MAX_RETRY_DELAY:?}, got {:?}",
                self.retry_delay
            )));
        }
        if self.max_lease > MAX_TTL || self.max_lease < MIN_TTL {
            return Err(Error::invalid(format!(
                "Redlock max_lease must be in {MIN_TTL:?} ..= {MAX_TTL:?}, got {:?}",
                self.max_lease
            )));
        }
        if let Some(q) = self.restart_quarantine {
            if q < self.max_lease || q > MAX_TTL {
                return Err(Error::invalid(format!(
                    "Redlock restart_quarantine must be at least max_lease ({:?}: a restarted \
                     node must sit out this client's own leases) and at most {MAX_TTL:?}, \
                     got {q:?}",
                    self.max_lease
                )));
            }
        }
        Ok(())
    }
}

/// A lock over N independent stores (Redis masters with no replication between them, or any
/// [`Backend`]s that can be quorum nodes, see [`Capabilities::node`]), held when a majority
/// grants it: the Redlock algorithm. It is itself a [`Backend`], so [`LockManager`](crate::LockManager),
/// guards, the watchdog, drop release, fencing tokens and cancel safety work unchanged.
///
/// # What it does
///
/// - **Acquire** goes to every node at once, each with its own timeout
///   ([`node_timeout`](RedlockOptions::node_timeout)), and succeeds with a majority
///   (`N/2 + 1`) and a positive validity: `ttl − elapsed − drift`, which is also the guard's
///   deadline. Otherwise it releases on every node that may have granted (including those
///   that timed out) and, if too few nodes answered, retries after a random delay, then
///   fails with [`Error::QuorumNotReached`]. Contention is reported as usual (the manager
///   waits, or `try_acquire` returns `Ok(None)`).
/// - **Extension** (the watchdog's) counts only if a majority extends within the validity;
///   otherwise the guard is lost. **Release** goes to every node.
/// - **Fencing**: the token is the maximum minted by the granting majority, written back to
///   that majority (counter = max(counter, token)) before the guard is returned, so the next
///   holder's token is strictly greater (any two majorities share a node). Nodes are asked to
///   mint at least a common floor (the client's clock in µs plus one second), so they usually
///   agree and no write-back is sent.
/// - **Restarts**: a node up for less than the
///   [restart quarantine](RedlockOptions::restart_quarantine) (60 s by default, whatever
///   TTL a client uses) counts toward no majority, for any client. It checks its own uptime in the same script that
///   grants, so this does not depend on this client's history with the node. Fresh servers
///   (a new deployment) therefore grant nothing for one quarantine.
/// - An unreachable node fails at once instead of queueing commands until it comes back.
///
/// # What it does not promise
///
/// Redlock assumes bounded pauses, network delays and clock drift. A client paused (GC,
/// swap, a stopped VM) for longer than its validity still believes it holds the lock, and
/// a node's clock that jumps forward expires leases early. Pass [`LockGuard::fencing_token`]
/// with every write and have the store reject older tokens: that, not the lock, is what
/// keeps a paused holder from overwriting its successor's work.
///
/// [`LockGuard::fencing_token`]: crate::LockGuard::fencing_token
///
/// Fair locks are not supported over Redlock (a FIFO queue over independent nodes would need
/// its own quorum protocol): a fair lock over it is refused when it is made. Reentrant locks
/// are, when every node has them: each node counts the holds, and a majority must agree on
/// one reign.
///
/// ```
/// use std::time::Duration;
/// use redlease::{LockManager, MemoryBackend, Redlock};
/// # futures::executor::block_on(async {
/// let nodes = vec![MemoryBackend::new(), MemoryBackend::new(), MemoryBackend::new()];
/// let locks = LockManager::new(Redlock::new(nodes)?);
/// let guard = locks.lock("orders:42").acquire().await?;
/// assert!(locks.lock("orders:42").try_acquire().await?.is_none());
/// guard.release().await?;
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
pub struct Redlock {
    nodes: Vec<Arc<dyn Backend>>,
    options: RedlockOptions,
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field("nodes", &self.nodes)
            .field("options", &self.options)
            .finish()
    }
}

/// One node's answer, or `None` if it had not answered when the outcome was decided.
type Replies<T> = Vec<Option<Result<T>>>;

/// What one acquire round came to.
enum Round {
    Acquired(Grant),
    /// Another client holds it: no node granted, and a majority can no longer.
    Held(Option<Duration>),
    /// This client and another split the nodes between them: both release and retry.
    Split(Option<Duration>),
    /// So many nodes answered with an error that will not mend by trying again (an ACL, a
    /// key of the wrong type, a server that may evict keys) that no majority can grant: one
    /// of those errors.
    Refused(Error),
    /// Too few nodes answered or counted; `warming` when restarted nodes would make the
    /// majority once they count.
    Unavailable {
        granted: usize,
        warming: bool,
    },
}

/// The answers of one acquire round, counted. Nodes may grant under different lease tokens
/// (a reentrant hold: a node where the owner's reign had expired starts a new one): only
/// nodes that agree on one lease make a majority.
#[derive(Default)]
struct Votes {
    /// The most nodes granting under one lease token.
    agreeing: usize,
    granted: usize,
    held: usize,
    warming: usize,
    failed: usize,
    /// Failed with an error that trying again will not mend (see `backend::refused`).
    refused_for_good: usize,
}

impl Votes {
    fn of(replies: &Replies<Acquire>) -> Votes {
        let mut v = Votes::default();
        let mut leases: Vec<(&Token, usize)> = Vec::new();
        for reply in replies.iter().flatten() {
            match reply {
                Ok(Acquire::Granted(g)) => {
                    v.granted += 1;
                    match leases.iter_mut().find(|(t, _)| **t == g.lease) {
                        Some((_, n)) => *n += 1,
                        None => leases.push((&g.lease, 1)),
                    }
                }
                Ok(Acquire::Held { .. }) => v.held += 1,
                Ok(Acquire::Warming { .. }) => v.warming += 1,
                Err(e) => {
                    v.failed += 1;
                    v.refused_for_good += usize::from(refused(e));
                }
            }
        }
        v.agreeing = leases.iter().map(|(_, n)| *n).max().unwrap_or(0);
        v
    }

    /// Nodes that cannot grant in this round.
    fn refused(&self) -> usize {
        self.held + self.warming + self.failed
    }
}

impl Redlock {
    /// A Redlock over `nodes`, with default [`RedlockOptions`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if `nodes` is empty.
    pub fn new<B: Backend>(nodes: impl IntoIterator<Item = B>) -> Result<Self> {
        Self::with_options(nodes, RedlockOptions::default())
    }

    /// A Redlock over `nodes` with the given options.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{MemoryBackend, Redlock, RedlockOptions};
    /// let nodes = (0..5).map(|_| MemoryBackend::new());
    /// let redlock = Redlock::with_options(nodes, RedlockOptions::new().retries(1))?;
    /// assert_eq!((redlock.nodes(), redlock.quorum()), (5, 3));
    /// let bad = RedlockOptions::new().drift_factor(0.7);
    /// assert!(Redlock::with_options(vec![MemoryBackend::new()], bad).is_err());
    /// # Ok::<(), redlease::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if `nodes` is empty or an option is out of range;
    /// [`Error::Unsupported`] for a node that cannot be a quorum member (see
    /// [`Capabilities::node`]). Nodes of different kinds go in as `Arc<dyn Backend>`s.
    pub fn with_options<B: Backend>(
        nodes: impl IntoIterator<Item = B>,
        options: RedlockOptions,
    ) -> Result<Self> {
        options.validate()?;
        let nodes: Vec<Arc<dyn Backend>> = nodes
            .into_iter()
            .map(|b| Arc::new(b) as Arc<dyn Backend>)
            .collect();
        if nodes.is_empty() {
            return Err(Error::invalid("a Redlock needs at least one node"));
        }
        if let Some(node) = nodes.iter().find(|n| !n.capabilities().node) {
            return Err(Error::Unsupported(format!(
                "this backend cannot be a Redlock node (it does not honour NodeTerms): {}",
                short_debug(node)
            )));
        }
        Ok(Redlock { nodes, options })
    }

    /// How many nodes.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// How many nodes make a majority: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// The options in use.
    pub fn options(&self) -> &RedlockOptions {
        &self.options
    }

    /// The time a lease of `ttl` is guaranteed from the start of the call that set it.
    fn validity(&self, ttl: Duration) -> Duration {
        let drift = ttl.mul_f64(self.options.drift_factor) + Duration::from_millis(2);
        ttl.saturating_sub(drift)
    }

    /// The node terms for leases of at most `longest_ttl`; refuses a TTL above `max_lease`,
    /// which other clients rely on to know when a restarted node may count again.
    fn terms(&self, longest_ttl: Duration) -> Result<NodeTerms> {
        let max = self.options.max_lease;
        if longest_ttl > max {
            return Err(Error::invalid(format!(
                "lease TTL {longest_ttl:?} is above this Redlock's max_lease {max:?} \
                 (RedlockOptions::max_lease, default 60 s; raise it on every client): \
                 restarted nodes would count again while such a lease may still live"
            )));
        }
        let terms = NodeTerms::new().fail_fast(true);
        if !self.options.restart_guard {
            return Ok(terms);
        }
        Ok(terms.min_uptime(self.options.quarantine()))
    }

    /// Calls `call` on the nodes `which`, all at once, and gathers the answers until
    /// `decided` says the outcome is known, every node has answered, or `timeout` passes.
    ///
    /// Every call is polled at least once before any decision, so every command has been
    /// handed to its node's connection (a RedisBackend sends it, in order with the node's
    /// other commands, even if its caller stops waiting). Calls still out when the outcome is
    /// decided are dropped: what they sent still runs on the node.
    async fn fan_out<'a, T, F, Fut>(
        &'a self,
        which: impl IntoIterator<Item = usize>,
        timeout: Duration,
        call: F,
        decided: impl Fn(&Replies<T>) -> bool,
    ) -> Replies<T>
    where
        F: Fn(&'a dyn Backend) -> Fut,
        Fut: Future<Output = Result<T>> + 'a,
    {
        let deadline = Instant::now() + timeout;
        let mut calls: Vec<(usize, Pin<Box<Fut>>)> = which
            .into_iter()
            .map(|i| (i, Box::pin(call(&*self.nodes[i]))))
            .collect();
        let mut replies: Replies<T> = (0..self.nodes.len()).map(|_| None).collect();
        let gather = future::poll_fn(|cx| {
            calls.retain_mut(|(i, fut)| match fut.as_mut().poll(cx) {
                Poll::Ready(reply) => {
                    replies[*i] = Some(reply);
                    false
                }
                Poll::Pending => true,
            });
            if calls.is_empty() || decided(&replies) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        runtime::until(Some(deadline), gather).await;
        replies
    }

    /// One round of the algorithm. `call_start`: when the caller's attempt began, which the
    /// returned validity is counted from.
    async fn round(
        &self,
        claim: &Claim,
        attempt: Attempt,
        terms: NodeTerms,
        call_start: Instant,
    ) -> Round {
        let started = Instant::now();
        let (n, q) = (self.nodes.len(), self.quorum());
        let mut validity = self.validity(claim.ttl);
        let timeout = self.options.node_timeout.min(validity / 2);
        let terms = terms.fence_floor(fence_floor());
        let replies = self
            .fan_out(
                0..n,
                timeout,
                |node| node.acquire(claim, attempt, terms),
                |r| {
                    let v = Votes::of(r);
                    v.agreeing >= q || v.refused() > n - q
                },
            )
            .await;
        // Decided before the timeout: nodes that had not answered yet are not slow ones.
        let cut_short = started.elapsed() < timeout;
        let votes = Votes::of(&replies);

        // Granting nodes by lease token, the largest group first.
        let mut leases: Vec<(Token, Vec<(usize, &Grant)>)> = Vec::new();
        let mut held: Option<Duration> = None;
        // Nodes that may hold the claim now and are answering: released and waited for.
        let mut answering = Vec::new();
        // Nodes that may hold it and are slow or failing: released, not waited for.
        let mut unknown = Vec::new();
        for (i, reply) in replies.iter().enumerate() {
            match reply {
                Some(Ok(Acquire::Granted(g))) => {
                    validity = validity.min(g.validity);
                    match leases.iter_mut().find(|(t, _)| *t == g.lease) {
                        Some((_, nodes)) => nodes.push((i, g)),
                        None => leases.push((g.lease.clone(), vec![(i, g)])),
                    }
                }
                Some(Ok(Acquire::Held { remaining })) => held = soonest(held, *remaining),
                // Counted in `votes`.
                Some(Ok(Acquire::Warming { .. })) => {}
                // Failed before anything was sent: nothing to take back.
                Some(Err(e)) if not_sent(e) => {}
                // Not answered yet when the round was decided: it may grant any moment.
                None if cut_short => answering.push(i),
                // Failed or silent: it may have granted all the same.
                Some(Err(_)) | None => unknown.push(i),
            }
        }
        leases.sort_by_key(|(_, nodes)| std::cmp::Reverse(nodes.len()));

        let mut outcome = None;
        if let Some((lease, nodes)) = leases.first() {
            if nodes.len() >= q && started.elapsed() < validity {
                let fence = nodes
                    .iter()
                    .map(|(_, g)| g.fencing_token)
                    .max()
                    .unwrap_or(0);
                let granted: Vec<(usize, u64)> =
                    nodes.iter().map(|(i, g)| (*i, g.fencing_token)).collect();
                let confirmed = self
                    .write_back(&claim.key, fence, &granted, started + validity)
                    .await;
                if confirmed >= q && started.elapsed() < validity {
                    let validity = validity + started.saturating_duration_since(call_start);
                    let mut grant = Grant::new(fence, validity, lease.clone());
                    // The largest count: a node counts less only when it missed holds (it
                    // was down or slow then); a hold counted outside the majority's reign is
                    // taken back at once.
                    grant.hold_count = nodes.iter().filter_map(|(_, g)| g.hold_count).max();
                    outcome = Some(grant);
                }
            }
        }
        // Take the claim back where it must not stay: everywhere if the round failed, or on
        // the nodes that granted it under another lease if it succeeded. Sent before any next
        // round with this claim, so it runs before it on every node (a RedisBackend keeps one
        // queue). Waited for where the node answered (it is reachable), so that a failed
        // attempt has left nothing behind there when it returns.
        let keep = usize::from(outcome.is_some());
        let mut undo: Vec<usize> = leases
            .iter()
            .skip(keep)
            .flat_map(|(_, nodes)| nodes.iter().map(|(i, _)| *i))
            .collect();
        if outcome.is_none() {
            undo.extend(answering);
        }
        let waited = undo.clone();
        if outcome.is_none() {
            undo.extend(unknown);
        }
        if !undo.is_empty() {
            let own = Release::Confirmed {
                lease: &claim.token,
            };
            self.fan_out(
                undo,
                self.options.node_timeout,
                |node| node.release(claim, own),
                |r| waited.iter().all(|&i| r[i].is_some()),
            )
            .await;
        }
        if let Some(grant) = outcome {
            return Round::Acquired(grant);
        }
        if votes.refused_for_good > n - q {
            let first = replies.iter().flatten().find_map(|r| match r {
                Err(e) if refused(e) => Some(same_error(e)),
                _ => None,
            });
            if let Some(e) = first {
                return Round::Refused(e);
            }
        }
        if votes.held > 0 && votes.granted > 0 {
            Round::Split(held)
        } else if votes.held > 0 {
            Round::Held(held)
        } else {
            Round::Unavailable {
                granted: votes.agreeing,
                // Only worth waiting for if they would make the majority.
                warming: votes.warming > 0 && votes.granted + votes.warming >= q,
            }
        }
    }

    /// Plays rounds until one decides: a won round, or another holder, is the answer; a split
    /// vote, or too few nodes, is tried again after a random delay, up to `retries` times.
    /// Then a split is reported as contention (`held`), too few nodes as
    /// [`Error::QuorumNotReached`]. A waiting acquire that only restarted nodes keep from a
    /// majority gets that error at once (quick retries cannot mend it): the engine waits on
    /// it as on any missing majority, and reports it if its wait runs out.
    async fn rounds<Fut>(&self, attempt: Attempt, round: impl Fn() -> Fut) -> Result<Acquire>
    where
        Fut: Future<Output = Round>,
    {
        let held = |remaining| Acquire::Held { remaining };
        let mut best = 0;
        let mut split = None;
        for round_no in 0..=self.options.retries {
            if round_no > 0 {
                let delay = self
                    .options
                    .retry_delay
                    .mul_f64(rand::random_range(0.0..=1.0));
                runtime::sleep(delay).await;
            }
            match round().await {
                Round::Acquired(grant) => return Ok(Acquire::Granted(grant)),
                Round::Held(remaining) => return Ok(held(remaining)),
                Round::Refused(e) => return Err(e),
                // Both contenders took back their part: try again after a random delay, so
                // that one of them gets there first.
                Round::Split(remaining) => split = Some(remaining),
                Round::Unavailable {
                    granted,
                    warming: true,
                } if attempt.recheck().is_some() => {
                    return Err(Error::QuorumNotReached {
                        acquired: best.max(granted),
                        required: self.quorum(),
                    })
                }
                Round::Unavailable { granted, .. } => {
                    split = None;
                    best = best.max(granted);
                }
            }
        }
        match split {
            Some(remaining) => Ok(held(remaining)),
            None => Err(Error::QuorumNotReached {
                acquired: best,
                required: self.quorum(),
            }),
        }
    }

    /// Raises the fence counter to `fence` on the granting nodes that minted less; returns
    /// how many granting nodes now hold at least `fence`.
    async fn write_back(
        &self,
        key: &LeaseKey,
        fence: u64,
        granted: &[(usize, u64)],
        deadline: Instant,
    ) -> usize {
        let behind: Vec<usize> = granted
            .iter()
            .filter(|&&(_, f)| f < fence)
            .map(|&(i, _)| i)
            .collect();
        let level = granted.len() - behind.len();
        if behind.is_empty() {
            return level;
        }
        let timeout = deadline
            .saturating_duration_since(Instant::now())
            .min(self.options.node_timeout);
        let replies = self
            .fan_out(
                behind,
                timeout,
                |node| node.raise_fence(key, fence),
                |_| false,
            )
            .await;
        level + replies.iter().filter(|r| matches!(r, Some(Ok(())))).count()
    }

    /// Gives `claim` back on every node; the holds left are the largest among the nodes that
    /// answered. `None` when more nodes than a majority can spare did not hold it.
    async fn release_all(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        let (n, q) = (self.nodes.len(), self.quorum());
        let counted = |r: &Replies<Option<u32>>| {
            let yes = r.iter().filter(|x| matches!(x, Some(Ok(Some(_))))).count();
            let no = r.iter().filter(|x| matches!(x, Some(Ok(None)))).count();
            (yes, no)
        };
        let replies = self
            .fan_out(
                0..n,
                self.options.node_timeout,
                |node| node.release(claim, how),
                |r| {
                    let (yes, no) = counted(r);
                    // Decided; the releases still out run on their nodes all the same.
                    yes >= q || no > n - q
                },
            )
            .await;
        let (yes, no) = counted(&replies);
        if yes >= q {
            let left = replies.iter().filter_map(|x| match x {
                Some(Ok(Some(left))) => Some(*left),
                _ => None,
            });
            Ok(Some(left.max().unwrap_or(0)))
        } else if no > n - q {
            Ok(None)
        } else {
            Err(Error::QuorumNotReached {
                acquired: yes,
                required: q,
            })
        }
    }
}

/// The sooner of two times left (a holder's lease, a node's warm-up); unknown counts as
/// later than any known one.
fn soonest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The fencing-token floor proposed to the nodes: the client's clock in µs, plus a lead.
fn fence_floor() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from((d + FLOOR_LEAD).as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[async_trait]
impl Backend for Redlock {
    /// Reentrant when every node is; never fair; never shared (a majority of semaphores does
    /// not keep the count: see [`Capabilities::shared`]); not a node itself.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fair: false,
            reentrant: self.nodes.iter().all(|n| n.capabilities().reentrant),
            shared: false,
            node: false,
        }
    }

    /// `terms` is ignored: the Redlock's own (restart guard, fail-fast, a common fence
    /// floor) go to the nodes.
    async fn acquire(&self, claim: &Claim, attempt: Attempt, _terms: NodeTerms) -> Result<Acquire> {
        let call_start = Instant::now();
        // Refuses a fair claim: a FIFO queue over independent nodes would need its own
        // quorum protocol.
        self.capabilities().check(&claim.kind, self)?;
        let terms = self.terms(claim.ttl)?;
        self.rounds(attempt, || self.round(claim, attempt, terms, call_start))
            .await
    }

    async fn extend(&self, leases: &[Lease<'_>], _terms: NodeTerms) -> Result<Vec<Extended>> {
        let started = Instant::now();
        let (n, q) = (self.nodes.len(), self.quorum());
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let longest = leases.iter().map(|l| l.ttl).max().unwrap_or_default();
        let shortest = leases.iter().map(|l| l.ttl).min().unwrap_or_default();
        let terms = self.terms(longest)?;
        // A big batch takes a while to run; it is bounded by the watchdog's deadline too.
        let timeout = self.options.node_timeout.max(shortest / 10);
        let count = leases.len();
        let replies = self
            .fan_out(
                0..n,
                timeout,
                |node| node.extend(leases, terms),
                |r| (0..count).all(|i| tally(r, i).decided(n, q)),
            )
            .await;
        let elapsed = started.elapsed();
        Ok(leases
            .iter()
            .enumerate()
            .map(|(i, lease)| {
                let t = tally(&replies, i);
                let validity = self.validity(lease.ttl).min(t.validity);
                if t.extended >= q {
                    if elapsed < validity {
                        Extended::Held(validity)
                    } else {
                        // Confirmed too late.
                        Extended::Gone
                    }
                } else if t.refused > n - q {
                    Extended::Gone
                } else {
                    // Not confirmable now (too few nodes answered for this lease): tried
                    // again, and lost only at its deadline.
                    Extended::Failed(Error::QuorumNotReached {
                        acquired: t.extended,
                        required: q,
                    })
                }
            })
            .collect())
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        self.release_all(claim, how).await
    }

    /// Wakes on a release seen by any node. Returns once a majority (or every node) has
    /// answered, or after the node timeout: a release reaches every node, so one subscribed
    /// node is enough, and the waiter's fallback re-check covers the rest.
    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        let (n, q) = (self.nodes.len(), self.quorum());
        let replies = self
            .fan_out(
                0..n,
                self.options.node_timeout,
                |node| node.subscribe(claim),
                |r| r.iter().filter(|x| matches!(x, Some(Ok(_)))).count() >= q,
            )
            .await;
        Ok(Subscription::merge(
            replies.into_iter().flatten().filter_map(Result::ok),
        ))
    }

    /// Asks every node and reports what a majority agrees on: held if a majority holds a
    /// lease on the key, with the time until fewer than a majority still hold it; the
    /// highest fencing token any node answered (a grant writes the quorum's token back, so
    /// it is the last one granted); the label and reentrant count a majority reports.
    /// [`Error::QuorumNotReached`] if fewer than a majority answer within the node timeout.
    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        let (n, q) = (self.nodes.len(), self.quorum());
        let replies = self
            .fan_out(
                0..n,
                self.options.node_timeout,
                |node| node.inspect(key),
                |_| false,
            )
            .await;
        let answers: Vec<Option<LockInfo>> = replies
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .collect();
        if answers.len() < q {
            return Err(Error::QuorumNotReached {
                acquired: answers.len(),
                required: q,
            });
        }
        Ok(agree(&answers, q))
    }

    /// On every node; done when a majority raised it.
    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        let (n, q) = (self.nodes.len(), self.quorum());
        let done = |r: &Replies<()>| r.iter().filter(|x| matches!(x, Some(Ok(())))).count();
        let replies = self
            .fan_out(
                0..n,
                self.options.node_timeout,
                |node| node.raise_fence(key, at_least),
                |r| done(r) >= q,
            )
            .await;
        let raised = done(&replies);
        if raised >= q {
            Ok(())
        } else {
            Err(Error::QuorumNotReached {
                acquired: raised,
                required: q,
            })
        }
    }
}

/// What a majority (`q`) of the nodes' inspection answers agree on; see `Redlock::inspect`.
fn agree(answers: &[Option<LockInfo>], q: usize) -> Option<LockInfo> {
    let known: Vec<&LockInfo> = answers.iter().flatten().collect();
    let mut info = LockInfo::new();
    // The lease holds while a majority still has it: the q-th longest remaining time.
    let mut remaining: Vec<Duration> = known
        .iter()
        .filter(|i| i.held)
        .map(|i| i.remaining.unwrap_or(Duration::MAX))
        .collect();
    remaining.sort_unstable_by(|a, b| b.cmp(a));
    if remaining.len() >= q {
        info.held = true;
        info.remaining = Some(remaining[q - 1]).filter(|r| *r != Duration::MAX);
        info.holder_label = majority(known.iter().map(|i| i.holder_label.clone()), q).flatten();
        info.reentrant_count = majority(known.iter().map(|i| i.reentrant_count), q).flatten();
    }
    info.fencing_token = known.iter().filter_map(|i| i.fencing_token).max();
    info.queue_len = known.iter().map(|i| i.queue_len).max().unwrap_or(0);
    (!info.is_blank()).then_some(info)
}

/// The value at least `q` of `values` share, if any.
fn majority<T: PartialEq>(values: impl Iterator<Item = T>, q: usize) -> Option<T> {
    let mut counted: Vec<(T, usize)> = Vec::new();
    for v in values {
        match counted.iter_mut().find(|(seen, _)| *seen == v) {
            Some((_, n)) => *n += 1,
            None => counted.push((v, 1)),
        }
    }
    counted.into_iter().find(|(_, n)| *n >= q).map(|(v, _)| v)
}

/// One lease's extension answers across the nodes.
struct Tally {
    extended: usize,
    /// Nodes that answered that they do not hold it (or do not count).
    refused: usize,
    /// Nodes that failed to answer: they may hold it still.
    failed: usize,
    validity: Duration,
}

impl Tally {
    fn decided(&self, n: usize, q: usize) -> bool {
        self.extended >= q
            || self.refused > n - q
            || self.extended + self.refused + self.failed == n
    }
}

fn tally(replies: &Replies<Vec<Extended>>, lease: usize) -> Tally {
    let mut t = Tally {
        extended: 0,
        refused: 0,
        failed: 0,
        validity: Duration::MAX,
    };
    for reply in replies.iter().flatten() {
        match reply.as_ref().map(|v| v.get(lease)) {
            Ok(Some(Extended::Held(v))) => {
                t.extended += 1;
                t.validity = t.validity.min(*v);
            }
            Ok(Some(Extended::Gone)) => t.refused += 1,
            _ => t.failed += 1,
        }
    }
    t
}
