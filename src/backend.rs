//! The store behind the locks: the [`Backend`] trait and its implementations.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use event_listener::{Event, EventListener};

use crate::error::{Error, Result};
use crate::inspect::LockInfo;
use crate::reentrant::Owner;
use crate::token::{LeaseKey, Token};

pub(crate) mod memory;
pub(crate) mod redis;
pub(crate) mod redlock;

/// The outcome of one acquire attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The lease is ours (newly, or already ours: a replayed attempt with the same token).
    Acquired {
        /// Strictly greater than every token handed out before for this key.
        fencing_token: u64,
        /// How long the lease is guaranteed, counted from the moment the call started: the
        /// TTL less the clock-drift margin. (A quorum backend's winning round may start
        /// later than the call, after failed rounds; its validity runs from that round's
        /// start, and is given here counted from the call's.)
        validity: Duration,
    },
    /// Someone else holds it (or, for an [`Arriving`](Waiting::Arriving) attempt, others
    /// are waiting for it: it may be free for a moment, about to be taken by one of them).
    Held {
        /// The holder's remaining TTL, if the store knows it.
        remaining: Option<Duration>,
    },
    /// A quorum member that has been up for less than the
    /// [`min_uptime`](NodeTerms::min_uptime) it was asked for: it may have restarted empty and
    /// forgotten leases that others hold, so it grants nothing and counts toward no quorum.
    /// Only [`Backend::try_acquire_node`] answers this.
    Warming {
        /// How long until it has been up long enough.
        remaining: Duration,
    },
}

/// What a quorum backend ([`Redlock`](crate::Redlock)) asks of each of its nodes besides the
/// lease itself, for [`Backend::try_acquire_node`] and [`Backend::extend_node`].
///
/// ```
/// use std::time::Duration;
/// let terms = redlease::NodeTerms::new()
///     .fence_floor(1_700_000_000_000_000)
///     .min_uptime(Duration::from_secs(30));
/// assert_eq!(terms.get_min_uptime(), Duration::from_secs(30));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeTerms {
    fence_floor: u64,
    min_uptime: Duration,
    fail_fast: bool,
}

impl NodeTerms {
    /// No floor, no uptime condition, no fail-fast: what a single store is asked.
    pub const fn new() -> Self {
        NodeTerms {
            fence_floor: 0,
            min_uptime: Duration::ZERO,
            fail_fast: false,
        }
    }

    /// A new grant mints a fencing token of at least `floor`. Nodes given the same floor
    /// mint the same token when their counters are below it, so the quorum agrees on the
    /// token without a write-back.
    pub const fn fence_floor(mut self, floor: u64) -> Self {
        self.fence_floor = floor;
        self
    }

    /// The node grants and extends nothing (answers [`Acquire::Warming`], or `None` per
    /// lease) until it has been up for `d`, by its own uptime, checked in the same atomic
    /// step as the grant.
    pub const fn min_uptime(mut self, d: Duration) -> Self {
        self.min_uptime = d;
        self
    }

    /// Fail at once, rather than queue the command, while the node's connection is down.
    pub const fn fail_fast(mut self, yes: bool) -> Self {
        self.fail_fast = yes;
        self
    }

    /// See [`fence_floor`](Self::fence_floor).
    pub const fn get_fence_floor(&self) -> u64 {
        self.fence_floor
    }

    /// See [`min_uptime`](Self::min_uptime).
    pub const fn get_min_uptime(&self) -> Duration {
        self.min_uptime
    }

    /// See [`fail_fast`](Self::fail_fast).
    pub const fn get_fail_fast(&self) -> bool {
        self.fail_fast
    }
}

/// A call that failed before anything reached the store (a quorum member's connection was
/// down and the caller asked to fail fast): it cannot have taken effect.
#[derive(Debug)]
pub(crate) struct NotSent(pub(crate) String);

impl fmt::Display for NotSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotSent {}

/// Whether `e` is a [`NotSent`] failure.
pub(crate) fn not_sent(e: &crate::Error) -> bool {
    matches!(e, crate::Error::Backend { source } if source.downcast_ref::<NotSent>().is_some())
}

/// The error of the [`Backend`] methods a store does not implement.
fn unsupported(backend: &dyn fmt::Debug, what: &str) -> crate::Error {
    crate::Error::InvalidConfig(format!(
        "this backend cannot {what} (it does not implement that Backend method): {backend:?}"
    ))
}

/// What an acquire attempt is part of, for [`Backend::try_acquire`].
///
/// Waiters register with the store (on Redis a deadline in the lock's fence hash, so the
/// release knows to publish). A waiting acquire's first attempt yields to waiters already
/// registered: it does not take the lock out from under them. Its later attempts compete as
/// a waiter. This keeps a holder that releases and re-acquires at once from taking the lock
/// back before the waiter that was woken can ask for it, and a flag left by a waiter that has
/// gone costs a newcomer one round trip, never a wait.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Waiting {
    /// A single attempt ([`Lock::try_acquire`](crate::Lock::try_acquire)): take the lock if it
    /// is free.
    #[default]
    No,
    /// A waiting acquire's first attempt: take the lock only if it is free and nobody is
    /// registered as waiting; do not register.
    Arriving {
        /// How long until the caller checks again at the latest.
        recheck: Duration,
    },
    /// A registered waiter: take the lock if it is free; otherwise stay registered for
    /// `recheck`.
    Waiting {
        /// How long until the caller checks again at the latest.
        recheck: Duration,
    },
}

impl Waiting {
    /// The re-check interval, for attempts that wait.
    pub fn recheck(self) -> Option<Duration> {
        match self {
            Waiting::No => None,
            Waiting::Arriving { recheck } | Waiting::Waiting { recheck } => Some(recheck),
        }
    }
}

/// One held lease, as the watchdog hands it to [`Backend::extend`].
#[derive(Clone, Copy, Debug)]
pub struct Lease<'a> {
    /// Where it lives.
    pub key: &'a LeaseKey,
    /// Who owns it.
    pub token: &'a Token,
    /// The TTL to set.
    pub ttl: Duration,
}

/// A store that can hold leases. Implemented by [`RedisBackend`](crate::RedisBackend) and
/// [`MemoryBackend`](crate::MemoryBackend); the lock, guard and watchdog layers talk to the
/// store only through it.
///
/// # Contract
///
/// Every operation is atomic on the store and **idempotent for the same token**: a client
/// may re-send a command after a reconnect even though the store already ran it.
///
/// - `try_acquire` grants the lease if the key is free or already holds `token`, and mints a
///   fencing token greater than any before it for that key; otherwise it reports `Held`. It
///   never grants a token that was [`abandon`](Backend::abandon)ed, and an
///   [`Arriving`](Waiting::Arriving) attempt yields to registered waiters.
/// - `extend` sets each lease's TTL only where the key still holds that lease's token.
/// - `release` deletes the key only if it holds `token` (compare-and-delete), and wakes the
///   key's subscribers.
/// - `abandon` is `release` for an attempt whose outcome the caller never learnt (a timeout,
///   a dropped future): the store may still run a late copy of that attempt (a client re-sends
///   in-flight commands after a reconnect), so besides deleting, it must make sure such a
///   copy can no longer take the lease. Redis keeps a tombstone of the token for 5 minutes.
/// - `subscribe` returns once a release of the key will wake the subscription.
/// - Fair (FIFO) locks, optional: [`fair_acquire`](Backend::fair_acquire) and
///   [`fair_subscribe`](Backend::fair_subscribe). A backend that has them also makes
///   `release` wake the head of the key's queue and `abandon` take the token out of the
///   queue. The defaults refuse with [`Error::InvalidConfig`].
/// - Reentrant locks, optional: [`reentrant_acquire`](Backend::reentrant_acquire) and
///   [`reentrant_release`](Backend::reentrant_release). A backend that has them also makes
///   `extend`, given a reign's lease token (a [`Token::hold`]), keep the whole reign alive.
///   The defaults refuse with [`Error::InvalidConfig`].
///
/// ```
/// use redlease::{Backend, MemoryBackend, LeaseKey, Token, Acquire};
/// use std::time::Duration;
/// # futures::executor::block_on(async {
/// let b = MemoryBackend::new();
/// let key = LeaseKey::new("t:", "job");
/// let (t1, t2) = (Token::random(), Token::random());
/// let ttl = Duration::from_secs(5);
/// let once = redlease::Waiting::No;
/// assert!(matches!(b.try_acquire(&key, &t1, ttl, once).await?, Acquire::Acquired { .. }));
/// assert!(matches!(b.try_acquire(&key, &t2, ttl, once).await?, Acquire::Held { .. }));
/// assert!(!b.release(&key, &t2).await?);   // not t2's lease: untouched
/// assert!(b.release(&key, &t1).await?);
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// One atomic attempt; `waiting` says whether the caller waits (see [`Waiting`]).
    async fn try_acquire(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
    ) -> Result<Acquire>;

    /// Extends many leases in as few round trips as the store allows. Returns, per lease in
    /// order, `Some(validity)` (counted from the call's start) or `None` if the key no longer
    /// holds that token.
    async fn extend(&self, leases: &[Lease<'_>]) -> Result<Vec<Option<Duration>>>;

    /// Compare-and-delete. `true` if the lease was ours and is gone now (also when a replayed
    /// release finds it already released by the same token).
    async fn release(&self, key: &LeaseKey, token: &Token) -> Result<bool>;

    /// Releases an attempt whose outcome is unknown, and bars `token` from ever being granted
    /// later (see the contract above). `true` if a lease was deleted. On a backend with fair
    /// locks it also takes `token` out of the key's queue (a waiter that gave up), waking
    /// the next waiter if `token` was at the head of a free lock's queue.
    async fn abandon(&self, key: &LeaseKey, token: &Token) -> Result<bool>;

    /// A wake-up source for releases of `key`.
    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription>;

    /// `try_acquire` as one node of a quorum (see [`NodeTerms`]): a new grant's fencing
    /// token is at least the terms' floor, and a node up for less than their `min_uptime`
    /// answers [`Acquire::Warming`]. Stores that can be Redlock nodes implement it; the
    /// default refuses with [`Error::InvalidConfig`](crate::Error::InvalidConfig).
    async fn try_acquire_node(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
        terms: NodeTerms,
    ) -> Result<Acquire> {
        let _ = (key, token, ttl, waiting, terms);
        Err(unsupported(&self, "be a Redlock node (try_acquire_node)"))
    }

    /// `extend` as one node of a quorum: a node up for less than the terms' `min_uptime`
    /// extends nothing (`None` for every lease). The default refuses, as
    /// [`try_acquire_node`](Self::try_acquire_node).
    async fn extend_node(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> Result<Vec<Option<Duration>>> {
        let _ = (leases, terms);
        Err(unsupported(&self, "be a Redlock node (extend_node)"))
    }

    /// Raises `key`'s fence counter to at least `at_least` (never lowers it), so the next
    /// grant on this store mints a larger token. Redlock writes the quorum's token back
    /// with it. The default refuses, as [`try_acquire_node`](Self::try_acquire_node).
    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        let _ = (key, at_least);
        Err(unsupported(&self, "be a Redlock node (raise_fence)"))
    }

    /// What the store knows about `key` (see [`LockInfo`]), read in one atomic step; `None`
    /// when it has no trace of the lock (not held, no fencing token remembered, nobody
    /// queued). Never returns the holder's token. The default refuses with
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig).
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{Backend, LeaseKey, MemoryBackend, Token, Waiting};
    /// # futures::executor::block_on(async {
    /// let b = MemoryBackend::new();
    /// let key = LeaseKey::new("t:", "job");
    /// assert!(b.inspect(&key).await?.is_none());
    /// let token = Token::random().with_label(Some("me".into()));
    /// b.try_acquire(&key, &token, Duration::from_secs(5), Waiting::No).await?;
    /// let info = b.inspect(&key).await?.expect("held");
    /// assert!(info.held);
    /// assert_eq!(info.holder_label.as_deref(), Some("me"));
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        let _ = key;
        Err(unsupported(&self, "inspect a lock (inspect)"))
    }

    /// One atomic attempt on the fair (FIFO) queue of `key`; see [`FairAttempt`].
    ///
    /// The lease is the same as [`try_acquire`](Backend::try_acquire)'s (fair and plain
    /// acquirers of one key exclude each other), granted only when the key is free and
    /// either nobody is queued or `token` is at the head of the queue. Waiters whose
    /// deadline passed are evicted first, by the store's clock. `Held::remaining` says how
    /// long until a re-check is worth it: the holder's TTL, or, when the key is free and
    /// another waiter is at the head, how long that waiter has left to take it.
    /// Idempotent for the same token, like every operation.
    ///
    /// The default refuses: fair locks are not supported by this backend.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{Acquire, Backend, FairAttempt, LeaseKey, MemoryBackend, Token};
    /// # futures::executor::block_on(async {
    /// let b = MemoryBackend::new();
    /// let key = LeaseKey::new("t:", "fifo");
    /// let (holder, first, second) = (Token::random(), Token::random(), Token::random());
    /// let ttl = Duration::from_secs(5);
    /// let queued = FairAttempt::Queued { expire: Duration::from_secs(2) };
    /// assert!(matches!(b.fair_acquire(&key, &holder, ttl, FairAttempt::Once).await?, Acquire::Acquired { .. }));
    /// assert!(matches!(b.fair_acquire(&key, &first, ttl, queued).await?, Acquire::Held { .. }));
    /// assert!(matches!(b.fair_acquire(&key, &second, ttl, queued).await?, Acquire::Held { .. }));
    /// b.release(&key, &holder).await?;
    /// // Free now, but `first` arrived first: `second` (and a single attempt) must wait.
    /// assert!(matches!(b.fair_acquire(&key, &second, ttl, queued).await?, Acquire::Held { .. }));
    /// assert!(matches!(b.fair_acquire(&key, &Token::random(), ttl, FairAttempt::Once).await?, Acquire::Held { .. }));
    /// assert!(matches!(b.fair_acquire(&key, &first, ttl, queued).await?, Acquire::Acquired { .. }));
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    async fn fair_acquire(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        attempt: FairAttempt,
    ) -> Result<Acquire> {
        let _ = (key, token, ttl, attempt);
        Err(fair_unsupported::<Self>())
    }

    /// A wake-up source for the fair waiter `token` of `key`: it is woken when the lock is
    /// handed to it (the key was released while `token` was at the head of the queue), and
    /// not by hand-offs to other waiters.
    ///
    /// The default refuses: fair locks are not supported by this backend.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{Backend, FairAttempt, LeaseKey, MemoryBackend, Token};
    /// # futures::executor::block_on(async {
    /// let b = MemoryBackend::new();
    /// let key = LeaseKey::new("t:", "fifo");
    /// let (holder, waiter) = (Token::random(), Token::random());
    /// let ttl = Duration::from_secs(5);
    /// b.fair_acquire(&key, &holder, ttl, FairAttempt::Once).await?;
    /// let queued = FairAttempt::Queued { expire: Duration::from_secs(2) };
    /// b.fair_acquire(&key, &waiter, ttl, queued).await?;
    /// let sub = b.fair_subscribe(&key, &waiter).await?;
    /// let handed = sub.listen();          // armed before the release
    /// b.release(&key, &holder).await?;
    /// handed.await;                        // woken: the lock is the waiter's to take
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    async fn fair_subscribe(&self, key: &LeaseKey, token: &Token) -> Result<Subscription> {
        let _ = (key, token);
        Err(fair_unsupported::<Self>())
    }

    /// One atomic attempt to add the hold `hold` of `owner` to the reentrant lock `key`
    /// (see [`ReentrantLock`](crate::ReentrantLock)).
    ///
    /// The lease is the plain lock's key, so plain and reentrant acquirers exclude each
    /// other. If the key is free, a new *reign* starts: the lease is set to `hold` (which
    /// must come from [`Token::hold`]) for `ttl`, a fencing token is minted as by
    /// [`try_acquire_node`](Self::try_acquire_node) (honouring `terms`), and the count is 1.
    /// If the key is held by a reign of `owner`, the hold is added to it: the count goes up
    /// by one, the lease keeps its token and fencing token, and its TTL is raised to `ttl`
    /// if shorter. Otherwise the answer is `Held` (a `Waiting` attempt registers as a
    /// waiter, an `Arriving` one yields to registered waiters when the key is free, as in
    /// [`try_acquire`](Self::try_acquire)).
    ///
    /// Idempotent per hold: a replayed attempt for a hold already counted answers the same
    /// without counting it twice; a hold that was abandoned (see
    /// [`reentrant_release`](Self::reentrant_release)) is never counted. The reign's state
    /// lives exactly as long as its lease: [`extend`](Self::extend) with the lease token
    /// keeps all of it alive. A quorum backend ([`Redlock`](crate::Redlock)) ignores
    /// `terms` and sets its own for its nodes.
    ///
    /// The default refuses with [`Error::InvalidConfig`]: reentrant locks are not supported
    /// by this backend.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{Backend, LeaseKey, MemoryBackend, NodeTerms, Owner, ReentrantAcquire, Token, Waiting};
    /// # futures::executor::block_on(async {
    /// let b = MemoryBackend::new();
    /// let key = LeaseKey::new("t:", "job");
    /// let (job, other) = (Owner::named("job-1"), Owner::random());
    /// let (outer, inner) = (Token::hold(), Token::hold());
    /// let (ttl, once, terms) = (Duration::from_secs(5), Waiting::No, NodeTerms::new());
    /// let first = b.reentrant_acquire(&key, &job, &outer, ttl, once, terms).await?;
    /// let ReentrantAcquire::Acquired { count: 1, fencing_token, .. } = first else { panic!() };
    /// // The same owner again: counted, same fencing token.
    /// let again = b.reentrant_acquire(&key, &job, &inner, ttl, once, terms).await?;
    /// assert!(matches!(again, ReentrantAcquire::Acquired { count: 2, fencing_token: f, .. } if f == fencing_token));
    /// // A replay of the same hold is not counted twice.
    /// let replay = b.reentrant_acquire(&key, &job, &inner, ttl, once, terms).await?;
    /// assert!(matches!(replay, ReentrantAcquire::Acquired { count: 2, .. }));
    /// // Another owner waits.
    /// let theirs = b.reentrant_acquire(&key, &other, &Token::hold(), ttl, once, terms).await?;
    /// assert!(matches!(theirs, ReentrantAcquire::Held { .. }));
    /// // Release in any order; the lease goes at zero.
    /// assert_eq!(b.reentrant_release(&key, &job, &outer, Some(&outer)).await?, Some(1));
    /// assert_eq!(b.reentrant_release(&key, &job, &inner, Some(&outer)).await?, Some(0));
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    async fn reentrant_acquire(
        &self,
        key: &LeaseKey,
        owner: &Owner,
        hold: &Token,
        ttl: Duration,
        waiting: Waiting,
        terms: NodeTerms,
    ) -> Result<ReentrantAcquire> {
        let _ = (key, owner, hold, ttl, waiting, terms);
        Err(reentrant_unsupported::<Self>())
    }

    /// Takes the hold `hold` of `owner` out of the reentrant lock `key`: the count goes
    /// down by one, and at zero the lease is deleted and waiters are woken, as by
    /// [`release`](Self::release). Returns the count left (`Some(0)`: the lease is gone),
    /// or `None` if the hold is not counted in the reign that holds the key (it was never
    /// counted, or its reign was lost: a stale hold never touches another reign's count,
    /// and the count never goes below zero).
    ///
    /// `lease` is the reign's lease token as the caller knows it (from
    /// [`ReentrantAcquire::Acquired`]): a replayed release of a hold already released from
    /// that reign answers the count again instead of `None`, and never counts twice.
    /// `None` abandons an attempt whose outcome the caller never learnt: the hold is taken
    /// out if it was counted, and barred from being counted by a late copy of the attempt
    /// (as [`abandon`](Self::abandon)).
    ///
    /// The default refuses, as [`reentrant_acquire`](Self::reentrant_acquire).
    async fn reentrant_release(
        &self,
        key: &LeaseKey,
        owner: &Owner,
        hold: &Token,
        lease: Option<&Token>,
    ) -> Result<Option<u32>> {
        let _ = (key, owner, hold, lease);
        Err(reentrant_unsupported::<Self>())
    }
}

/// The outcome of one [`Backend::reentrant_acquire`] attempt.
///
/// ```
/// use std::time::Duration;
/// let held = redlease::ReentrantAcquire::Held { remaining: Some(Duration::from_millis(80)) };
/// assert!(!matches!(held, redlease::ReentrantAcquire::Acquired { .. }));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReentrantAcquire {
    /// The hold is counted.
    Acquired {
        /// The lease's token: the hold that started the reign. The guard's watchdog extends
        /// the lease with it.
        lease: Token,
        /// The reign's fencing token (a re-entry keeps it).
        fencing_token: u64,
        /// How long the lease is guaranteed, counted from the moment the attempt started.
        validity: Duration,
        /// The owner's hold count, this hold included.
        count: u32,
    },
    /// Someone else holds it (another owner, or a plain lock), or, for an
    /// [`Arriving`](Waiting::Arriving) attempt, others wait for it.
    Held {
        /// The holder's remaining TTL, if the store knows it.
        remaining: Option<Duration>,
    },
    /// A quorum member that has been up for less than the `min_uptime` it was asked for
    /// (see [`Acquire::Warming`]).
    Warming {
        /// How long until it has been up long enough.
        remaining: Duration,
    },
}

/// The refusal of a backend without reentrant locks (the trait's default methods).
fn reentrant_unsupported<B: ?Sized>() -> Error {
    Error::InvalidConfig(format!(
        "reentrant locks are not supported by this backend ({}): use RedisBackend, \
         MemoryBackend or Redlock, or a plain lock",
        std::any::type_name::<B>()
    ))
}

/// What a [`Backend::fair_acquire`] attempt is part of.
///
/// ```
/// use std::time::Duration;
/// let a = redlease::FairAttempt::Queued { expire: Duration::from_secs(2) };
/// assert_eq!(a.expire(), Some(Duration::from_secs(2)));
/// assert_eq!(redlease::FairAttempt::Once.expire(), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FairAttempt {
    /// A single attempt ([`Lock::try_acquire`](crate::Lock::try_acquire)): take the lock
    /// only if it is free and nobody is queued; never join the queue.
    Once,
    /// A waiter: join the queue at the tail (or stay where it is), with a deadline `expire`
    /// from now by the store's clock, and take the lock if it is free and this token is at
    /// the head. A waiter that does not come back before its deadline is evicted, so a
    /// crashed waiter holds up the queue for at most `expire`.
    Queued {
        /// How long the store keeps the waiter without hearing from it again.
        expire: Duration,
    },
}

impl FairAttempt {
    /// The waiter's deadline, for attempts that queue.
    pub fn expire(self) -> Option<Duration> {
        match self {
            FairAttempt::Once => None,
            FairAttempt::Queued { expire } => Some(expire),
        }
    }
}

/// The refusal of a backend without fair locks (the trait's default methods).
fn fair_unsupported<B: ?Sized>() -> Error {
    Error::InvalidConfig(format!(
        "fair locks are not supported by this backend ({}): use RedisBackend or \
         MemoryBackend, or turn `fair` off",
        std::any::type_name::<B>()
    ))
}

/// The clock-drift margin taken off a lease's TTL: 1 % plus 2 ms (the Redlock paper's
/// figures). It covers the rate difference between the client's and the server's clocks.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(redlease::clock_drift(Duration::from_secs(10)), Duration::from_millis(102));
/// ```
pub fn clock_drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// A registration for release wake-ups of one key, returned by [`Backend::subscribe`].
/// Dropping it unsubscribes.
///
/// ```
/// use std::sync::Arc;
/// use redlease::event_listener::Event;
/// # futures::executor::block_on(async {
/// let event = Arc::new(Event::new());
/// let sub = redlease::Subscription::new(event.clone());
/// let woken = sub.listen();
/// event.notify(usize::MAX);
/// woken.await;
/// # });
/// ```
pub struct Subscription {
    events: Vec<Arc<Event>>,
    _guards: Vec<Box<dyn Send + Sync>>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("sources", &self.events.len())
            .finish()
    }
}

impl Subscription {
    /// A subscription woken by `event`.
    pub fn new(event: Arc<Event>) -> Self {
        Subscription {
            events: vec![event],
            _guards: Vec::new(),
        }
    }

    /// Keeps `guard` alive as long as the subscription (its `Drop` can unsubscribe).
    pub fn with_guard(mut self, guard: impl Send + Sync + 'static) -> Self {
        self._guards.push(Box::new(guard));
        self
    }

    /// One subscription woken by any of `subs` (for backends composed of several stores).
    pub fn merge(subs: impl IntoIterator<Item = Subscription>) -> Self {
        let mut merged = Subscription {
            events: Vec::new(),
            _guards: Vec::new(),
        };
        for s in subs {
            merged.events.extend(s.events);
            merged._guards.extend(s._guards);
        }
        merged
    }

    /// A future that resolves at the next wake-up after this call. Arm it *before* checking
    /// the lock, so a release in between is not missed.
    pub fn listen(&self) -> Released {
        Released {
            listeners: self.events.iter().map(|e| e.listen()).collect(),
        }
    }
}

/// Resolves when the subscribed key is released (see [`Subscription::listen`]).
#[must_use = "futures do nothing unless awaited"]
pub struct Released {
    listeners: Vec<EventListener>,
}

impl fmt::Debug for Released {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Released").finish_non_exhaustive()
    }
}

impl Future for Released {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        for l in self.listeners.iter_mut() {
            if Pin::new(l).poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}
