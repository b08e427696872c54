//! The store layer: the [`Backend`] trait, the [`Claim`] every operation takes, and the
//! stores that implement it ([`RedisBackend`], [`MemoryBackend`], [`Redlock`], and with their
//! features `EtcdBackend` and `PostgresBackend`).
//!
//! Users need this module only to write a store of their own, or to call one directly: the
//! lock layer ([`LockManager`](crate::LockManager), [`Lock`](crate::Lock)) builds the claims
//! and runs them. Nothing here knows of locks, guards, the watchdog or the cache.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::error::{Error, Result};
use crate::info::LockInfo;
use crate::token::{LeaseKey, Owner, Token};

#[cfg(feature = "etcd")]
mod etcd;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
mod redis;
mod redlock;
mod subscription;
pub(crate) mod values;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdBackend, EtcdOptions};
pub use memory::MemoryBackend;
#[cfg(feature = "postgres")]
pub use postgres::{PostgresBackend, PostgresOptions};
#[cfg(feature = "tls")]
pub use redis::TlsOptions;
pub use redis::{FencedWrite, RedisBackend, RedisOptions, ReplicaAck, Transport};
pub use redlock::{Redlock, RedlockOptions};
pub use subscription::{Subscription, WakeUp};

/// What a claim asks of the store: which kind of hold on the lock.
///
/// Every kind takes the same lease key, so acquirers of different kinds on one name exclude
/// each other.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimKind {
    /// An exclusive lease under the claim's token.
    Plain,
    /// An exclusive lease served in arrival order: a waiting attempt joins the key's FIFO
    /// queue, and the lease is granted only to the head of the queue (see
    /// [`Capabilities::fair`]).
    Fair,
    /// One hold of a reentrant lock by `Owner`: holds of the same owner nest, the store
    /// counts them per hold token, and the lease goes when the count reaches zero (see
    /// [`Capabilities::reentrant`]). The claim's token must come from [`Token::hold`].
    Reentrant(Owner),
    /// One read of a read-write lock: any number of reads hold the lock together, each its
    /// own lease (a reader that dies loses only its own); a plain claim on the name is the
    /// write. Writer preference: while a plain claim waits for the lock, new reads wait
    /// behind it. See [`Capabilities::shared`]; the token must come from [`Token::shared`].
    Read,
    /// One of a semaphore's permits: granted while fewer than this many permits of the name
    /// are held, each its own lease. The count is the claim's: a claim made with a lower one
    /// than the holders' waits until enough of them are gone (nobody's permit is taken away),
    /// and one made with a higher one may be granted at once. See [`Capabilities::shared`];
    /// the token must come from [`Token::shared`].
    Permit(u32),
}

impl ClaimKind {
    /// Whether a waiting claim of this kind holds a place on the store while it waits (a
    /// fair waiter stands in the queue), which giving up must give back.
    pub fn queues(&self) -> bool {
        matches!(self, ClaimKind::Fair)
    }

    /// Whether holds of this kind share the lock, each its own lease ([`Read`](Self::Read),
    /// [`Permit`](Self::Permit)).
    ///
    /// ```
    /// use redlease::backend::ClaimKind;
    /// assert!(ClaimKind::Permit(8).shared() && ClaimKind::Read.shared());
    /// assert!(!ClaimKind::Plain.shared());
    /// ```
    pub fn shared(&self) -> bool {
        matches!(self, ClaimKind::Read | ClaimKind::Permit(_))
    }
}

/// One claim on one lock: the unit every [`Backend`] operation takes.
///
/// ```
/// use std::time::Duration;
/// use redlease::backend::{Claim, ClaimKind};
/// use redlease::{LeaseKey, Owner, Token};
/// let key = LeaseKey::new("app:", "report");
/// let plain = Claim::new(key.clone(), Token::random(), Duration::from_secs(10));
/// assert_eq!(plain.kind, ClaimKind::Plain);
/// let hold = Claim::new(key, Token::hold(), Duration::from_secs(10))
///     .kind(ClaimKind::Reentrant(Owner::named("job-7")));
/// assert!(hold.token.is_hold());
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Claim {
    /// Where the lock lives.
    pub key: LeaseKey,
    /// Who claims it: the lease's token (plain, fair), or the hold's (reentrant).
    pub token: Token,
    /// The lease TTL asked for.
    pub ttl: Duration,
    /// What kind of hold.
    pub kind: ClaimKind,
}

impl Claim {
    /// A plain claim on `key` by `token` for `ttl`.
    pub fn new(key: LeaseKey, token: Token, ttl: Duration) -> Self {
        Claim {
            key,
            token,
            ttl,
            kind: ClaimKind::Plain,
        }
    }

    /// The same claim, of another kind.
    pub fn kind(mut self, kind: ClaimKind) -> Self {
        self.kind = kind;
        self
    }

    /// Refuses a token of the wrong make for the claim's kind, with [`Error::InvalidConfig`]:
    /// a store tells a lease's kind by its token when it extends or releases it, so a
    /// reentrant hold's must come from [`Token::hold`], a read's or a permit's from
    /// [`Token::shared`], and a plain or fair claim's from neither.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::backend::{Claim, ClaimKind};
    /// use redlease::{LeaseKey, Token};
    /// let key = LeaseKey::new("t:", "pool");
    /// let permit = Claim::new(key.clone(), Token::shared(), Duration::from_secs(5));
    /// assert!(permit.clone().kind(ClaimKind::Permit(2)).check_token().is_ok());
    /// assert!(permit.check_token().is_err()); // a plain claim with a permit's token
    /// ```
    pub fn check_token(&self) -> Result<()> {
        let (hold, shared) = (self.token.is_hold(), self.token.is_shared());
        let wanted = match self.kind {
            ClaimKind::Reentrant(_) if !hold => {
                "a reentrant hold's token must come from Token::hold"
            }
            ClaimKind::Read | ClaimKind::Permit(_) if !shared => {
                "a read's or a permit's token must come from Token::shared"
            }
            ClaimKind::Plain | ClaimKind::Fair if hold || shared => {
                "a plain or fair claim's token must not come from Token::hold or Token::shared"
            }
            _ => return Ok(()),
        };
        Err(Error::invalid(format!(
            "{wanted} (a store tells a lease's kind by its token when it extends or releases it)"
        )))
    }

    /// The lease this claim keeps alive once granted, with the TTL asked for.
    pub fn lease<'a>(&'a self, token: &'a Token) -> Lease<'a> {
        Lease {
            key: &self.key,
            token,
            ttl: self.ttl,
        }
    }
}

/// What an acquire attempt is part of.
///
/// Waiters register with the store (on Redis a deadline in the lock's record, so the
/// release knows to publish; fair waiters stand in the queue). A waiting acquire's first
/// attempt yields to waiters already registered: it does not take the lock out from under
/// them. Its later attempts compete as a waiter. This keeps a holder that releases and
/// re-acquires at once from taking the lock back before the waiter that was woken can ask
/// for it, and a flag left by a waiter that has gone costs a newcomer one round trip, never a
/// wait. A fair claim queues from its first waiting attempt on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Attempt {
    /// A single attempt ([`Lock::try_acquire`](crate::Lock::try_acquire)): take the lock if it
    /// is free (and, for a fair claim, nobody is queued); never register.
    #[default]
    Once,
    /// A waiting acquire's first attempt: take the lock only if it is free and nobody is
    /// registered as waiting; do not register (a fair claim joins the queue).
    Arriving {
        /// How long until the caller checks again at the latest.
        recheck: Duration,
    },
    /// A registered waiter: take the lock if it is free; otherwise stay registered.
    Waiting {
        /// How long until the caller checks again at the latest.
        recheck: Duration,
    },
}

impl Attempt {
    /// The re-check interval, for attempts that wait.
    pub fn recheck(self) -> Option<Duration> {
        match self {
            Attempt::Once => None,
            Attempt::Arriving { recheck } | Attempt::Waiting { recheck } => Some(recheck),
        }
    }

    /// How long the store keeps a waiter registered without hearing from it again: one missed
    /// re-check of slack plus a margin for the round trip. A waiter that stops coming back (a
    /// crashed process) is forgotten after this (a fair waiter leaves the queue).
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::backend::Attempt;
    /// let w = Attempt::Waiting { recheck: Duration::from_secs(1) };
    /// assert_eq!(w.keep_waiter(), Some(Duration::from_millis(2100)));
    /// assert_eq!(Attempt::Once.keep_waiter(), None);
    /// ```
    pub fn keep_waiter(self) -> Option<Duration> {
        self.recheck().map(|r| {
            r.saturating_mul(2)
                .saturating_add(Duration::from_millis(100))
        })
    }
}

/// A granted claim: see [`Acquire::Granted`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Grant {
    /// Strictly greater than every token handed out before for this key (a reentrant
    /// re-entry keeps its reign's).
    pub fencing_token: u64,
    /// How long the lease is guaranteed, counted from the moment the call started: the TTL
    /// less the clock-drift margin.
    pub validity: Duration,
    /// The token the lease is stored under, which extends it: the claim's own, or for a
    /// reentrant hold the token of the hold that started the reign.
    pub lease: Token,
    /// For a reentrant hold, the owner's hold count, this hold included.
    pub hold_count: Option<u32>,
    /// The replicas that acknowledged the grant, under a [`ReplicaAck`] policy; `None` when
    /// none applies.
    pub replicas: Option<u32>,
}

impl Grant {
    /// A grant of the lease `lease`.
    pub fn new(fencing_token: u64, validity: Duration, lease: Token) -> Self {
        Grant {
            fencing_token,
            validity,
            lease,
            hold_count: None,
            replicas: None,
        }
    }

    /// The same grant, for a reentrant hold counted `count`.
    pub fn with_hold_count(mut self, count: u32) -> Self {
        self.hold_count = Some(count);
        self
    }

    /// The same grant, acknowledged by `count` replicas.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{backend::Grant, Token};
    /// let grant = Grant::new(7, Duration::from_secs(1), Token::random()).with_replicas(2);
    /// assert_eq!(grant.replicas, Some(2));
    /// ```
    pub fn with_replicas(mut self, count: u32) -> Self {
        self.replicas = Some(count);
        self
    }
}

/// The outcome of one acquire attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The claim holds (newly, or already: a replayed attempt with the same token).
    Granted(Grant),
    /// Someone else holds it (or, for an [`Arriving`](Attempt::Arriving) attempt, others
    /// are waiting for it; for a fair claim, another waiter is at the head of the queue).
    Held {
        /// How long until a re-check is worth it: the holder's remaining TTL, or the queue
        /// head's time left to take a free lock, if the store knows it.
        remaining: Option<Duration>,
    },
    /// A server that has been up for less than the [`min_uptime`](NodeTerms::min_uptime) it
    /// was asked for (a quorum member, or one server with a restart quarantine): it may have
    /// restarted empty and forgotten leases that others hold, so it grants nothing and counts
    /// toward no quorum.
    Warming {
        /// How long until it has been up long enough.
        remaining: Duration,
    },
}

/// How a claim is given back, for [`Backend::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Release<'a> {
    /// A granted claim, whose lease token the caller knows: compare-and-delete.
    Confirmed {
        /// The lease token from the [`Grant`].
        lease: &'a Token,
    },
    /// An attempt whose outcome the caller never learnt (a timeout, a dropped future): the
    /// store may still run a late copy of it (a client re-sends in-flight commands after a
    /// reconnect), so besides releasing what it may hold, the store makes sure such a copy
    /// can no longer be granted, and takes the token out of a fair queue.
    Abandon,
}

/// What a quorum backend ([`Redlock`]) asks of each of its nodes besides the claim itself,
/// for [`Backend::acquire`] and [`Backend::extend`]. [`NodeTerms::new`] (all off) is what a
/// single store is asked.
///
/// ```
/// use std::time::Duration;
/// let terms = redlease::backend::NodeTerms::new()
///     .fence_floor(1_700_000_000_000_000)
///     .min_uptime(Duration::from_secs(30));
/// assert_eq!(terms.min_uptime, Duration::from_secs(30));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeTerms {
    /// A new grant mints a fencing token of at least this. Nodes given the same floor mint
    /// the same token when their counters are below it, so the quorum agrees on the token
    /// without a write-back. Default 0.
    pub fence_floor: u64,
    /// The node grants and extends nothing (answers [`Acquire::Warming`], or `None` per
    /// lease) until it has been up for this long, by its own uptime, checked in the same
    /// atomic step as the grant. Default zero.
    pub min_uptime: Duration,
    /// Fail at once, rather than queue the command, while the node's connection is down.
    /// Default `false`.
    pub fail_fast: bool,
}

impl NodeTerms {
    /// No floor, no uptime condition, no fail-fast.
    pub const fn new() -> Self {
        NodeTerms {
            fence_floor: 0,
            min_uptime: Duration::ZERO,
            fail_fast: false,
        }
    }

    /// Sets [`fence_floor`](Self::fence_floor).
    pub const fn fence_floor(mut self, floor: u64) -> Self {
        self.fence_floor = floor;
        self
    }

    /// Sets [`min_uptime`](Self::min_uptime).
    pub const fn min_uptime(mut self, d: Duration) -> Self {
        self.min_uptime = d;
        self
    }

    /// Sets [`fail_fast`](Self::fail_fast).
    pub const fn fail_fast(mut self, yes: bool) -> Self {
        self.fail_fast = yes;
        self
    }
}

/// What a store can serve beyond plain leases, from [`Backend::capabilities`]. A lock of a
/// kind its store cannot serve is refused when it is made, with [`Error::Unsupported`].
///
/// ```
/// use redlease::backend::{Backend, Capabilities};
/// let caps = redlease::MemoryBackend::new().capabilities();
/// assert!(caps.fair && caps.reentrant && caps.shared && caps.node);
/// assert!(!Capabilities::PLAIN.fair);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Fair claims ([`ClaimKind::Fair`]): a FIFO queue per key; a release (or an abandon
    /// of the queue's head) wakes the head's [subscription](Backend::subscribe).
    pub fair: bool,
    /// Reentrant claims ([`ClaimKind::Reentrant`]): holds counted per owner; an
    /// [`extend`](Backend::extend) with a reign's lease token keeps the whole reign alive.
    pub reentrant: bool,
    /// Shared claims ([`ClaimKind::Read`], [`ClaimKind::Permit`]): many holds of one name at
    /// once, each a lease of its own, extended and released by its own token; their expiry
    /// by the store's clock. A quorum of stores cannot serve them: entering a semaphore on a
    /// majority of nodes does not keep its count (two majorities overlap in one node only).
    pub shared: bool,
    /// The store honours every [`NodeTerms`], so it can be a [`Redlock`] node.
    pub node: bool,
}

impl Capabilities {
    /// Plain leases only.
    pub const PLAIN: Capabilities = Capabilities {
        fair: false,
        reentrant: false,
        shared: false,
        node: false,
    };

    /// Everything.
    pub const ALL: Capabilities = Capabilities {
        fair: true,
        reentrant: true,
        shared: true,
        node: true,
    };

    /// Refuses `kind` with [`Error::Unsupported`] if these capabilities do not include it.
    pub fn check(&self, kind: &ClaimKind, store: &dyn fmt::Debug) -> Result<()> {
        let missing = match kind {
            ClaimKind::Plain => None,
            ClaimKind::Fair => (!self.fair).then_some("fair (FIFO) locks"),
            ClaimKind::Reentrant(_) => (!self.reentrant).then_some("reentrant locks"),
            ClaimKind::Read => (!self.shared).then_some("read-write locks"),
            ClaimKind::Permit(_) => (!self.shared).then_some("semaphores"),
        };
        match missing {
            None => Ok(()),
            Some(what) => Err(Error::Unsupported(format!(
                "{what} are not supported by this backend: {}",
                short_debug(store)
            ))),
        }
    }
}

/// A store's `Debug`, cut to one short line for an error message.
pub(crate) fn short_debug(store: &dyn fmt::Debug) -> String {
    let s = format!("{store:?}");
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// One held lease, as the watchdog hands it to [`Backend::extend`].
#[derive(Clone, Copy, Debug)]
pub struct Lease<'a> {
    /// Where it lives.
    pub key: &'a LeaseKey,
    /// The lease token (a [`Grant::lease`]).
    pub token: &'a Token,
    /// The TTL to set.
    pub ttl: Duration,
}

/// What became of one lease in [`Backend::extend`].
///
/// ```
/// use std::time::Duration;
/// use redlease::backend::Extended;
///
/// let held = Extended::Held(Duration::from_secs(5));
/// assert_eq!(held.validity(), Some(Duration::from_secs(5)));
/// assert_eq!(Extended::Gone.validity(), None);
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Extended {
    /// Extended: valid for this long, counted from the call's start.
    Held(Duration),
    /// Lost: the key no longer holds that token (expired, taken over, or no longer a lease at
    /// all), or the node is up for less than `terms.min_uptime`.
    Gone,
    /// Not known now: this lease's command failed while its neighbours' did not (or the node
    /// did not answer). The watchdog tries it again soon; it is lost only if its deadline
    /// passes first.
    Failed(Error),
}

impl Extended {
    /// The validity, when extended.
    pub fn validity(&self) -> Option<Duration> {
        match self {
            Extended::Held(v) => Some(*v),
            _ => None,
        }
    }
}

/// A store that can hold leases: the only thing the lock layer talks to.
///
/// # Contract
///
/// Every operation is atomic on the store and **idempotent for the same claim**: a client
/// may re-send a command after a reconnect even though the store already ran it. A
/// store or script error for one lease of a batch affects that lease only.
///
/// - [`acquire`](Self::acquire) grants the claim if the key is free (and, for a fair claim,
///   nobody else is at the head of the queue) or already holds it, minting a fencing token
///   greater than any before it for that key (and at least `terms.fence_floor`); otherwise it
///   reports `Held`. It never grants a claim that was [abandoned](Release::Abandon), and an
///   [`Arriving`](Attempt::Arriving) attempt yields to registered waiters.
/// - [`extend`](Self::extend) sets each lease's TTL only where the key still holds that
///   lease's token.
/// - [`release`](Self::release) deletes the lease only if the claim holds it
///   (compare-and-delete; a reentrant hold counts down first), and wakes the key's
///   subscribers.
/// - **Send order.** Calls for one claim are made in order (the engine awaits a give-back
///   before it tries again, with a fresh token; a Redlock round's clean-up is made before
///   its next round, with the same token), but a copy of a command re-sent after a reconnect may run after a
///   later one. A store where that can happen numbers each operation as it is made and
///   keeps the number with the lease: a release ends only a lease granted by an acquire made
///   before it (a late copy of an earlier release changes nothing and answers `None`), and
///   an acquire made before the release that ended its token's lease is not granted again.
///   A store that runs each call once, in the order made (as [`MemoryBackend`] does), keeps
///   this as it is.
/// - [`subscribe`](Self::subscribe) returns once a release will wake the subscription.
/// - [`capabilities`](Self::capabilities) says which claim kinds the store serves; the lock
///   layer never sends it another kind. A store may answer one it does not serve with
///   [`Error::Unsupported`].
///
/// A wrapper around a store (as `Arc<dyn Backend>` is, through the blanket impl) must
/// forward every method.
///
/// ```
/// use std::time::Duration;
/// use redlease::backend::{Acquire, Attempt, Backend, Claim, NodeTerms, Release};
/// use redlease::{LeaseKey, MemoryBackend, Token};
/// # futures::executor::block_on(async {
/// let b = MemoryBackend::new();
/// let key = LeaseKey::new("t:", "job");
/// let ttl = Duration::from_secs(5);
/// let (c1, c2) = (Claim::new(key.clone(), Token::random(), ttl), Claim::new(key, Token::random(), ttl));
/// let (once, terms) = (Attempt::Once, NodeTerms::new());
/// let Acquire::Granted(grant) = b.acquire(&c1, once, terms).await? else { panic!("free") };
/// assert!(matches!(b.acquire(&c2, once, terms).await?, Acquire::Held { .. }));
/// // Not c2's lease: untouched.
/// assert_eq!(b.release(&c2, Release::Confirmed { lease: &c2.token }).await?, None);
/// assert_eq!(b.release(&c1, Release::Confirmed { lease: &grant.lease }).await?, Some(0));
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// What this store can serve besides plain claims. Cheap; asked when a lock is made.
    fn capabilities(&self) -> Capabilities;

    /// One atomic attempt to grant `claim`; `attempt` says whether the caller waits.
    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire>;

    /// Extends many leases in as few round trips as the store allows. Returns what became of
    /// each lease, in order; an error for one lease is that lease's
    /// [`Extended::Failed`], and `Err` is for a call that reached no lease at all.
    async fn extend(&self, leases: &[Lease<'_>], terms: NodeTerms) -> Result<Vec<Extended>>;

    /// Which independent part of the store serves `key`: the watchdog extends each part's
    /// leases in a call of its own and applies each call's answer as it comes, so a slow or
    /// unreachable part (a paused primary of a cluster) delays and fails only its own leases.
    /// One part (`0`, the default) for a store whose calls succeed or fail together.
    ///
    /// ```
    /// use redlease::backend::Backend;
    /// use redlease::{LeaseKey, MemoryBackend};
    /// let b = MemoryBackend::new();
    /// assert_eq!(b.extend_group(&LeaseKey::new("t:", "a")), b.extend_group(&LeaseKey::new("t:", "b")));
    /// ```
    fn extend_group(&self, key: &LeaseKey) -> u64 {
        let _ = key;
        0
    }

    /// Resolves the next time the store may have lost leases without any command failing:
    /// a reconnect (the server may have restarted empty, or be another server now), or a
    /// setting that lets it drop keys (an eviction policy). The watchdog then checks every
    /// held lease at once rather than at its due time, so that holders are told within a
    /// round trip. Each call returns a new future, listening from the moment it is made.
    /// Never, by default (a store that cannot lose leases that way).
    ///
    /// ```
    /// use redlease::backend::Backend;
    /// use redlease::MemoryBackend;
    /// use futures::FutureExt;
    /// // The memory store loses nothing behind the watchdog's back.
    /// assert!(MemoryBackend::new().disturbed().now_or_never().is_none());
    /// ```
    fn disturbed(&self) -> BoxFuture<'static, ()> {
        Box::pin(futures::future::pending())
    }

    /// Gives `claim` back (see [`Release`]). Returns `Some(left)` when the claim held the
    /// lease, `left` being the holds still on it (0: the lease is deleted; always 0 but for
    /// reentrant claims), also for a replayed release of a confirmed claim; `None` when it
    /// did not hold (it was lost, or never granted).
    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>>;

    /// A wake-up source for `claim`: releases of its key (a fair claim: hand-offs to it).
    async fn subscribe(&self, claim: &Claim) -> Result<Subscription>;

    /// What the store knows about `key` (see [`LockInfo`]), read in one atomic step; `None`
    /// when it has no trace of the lock. Never returns the holder's token.
    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>>;

    /// Raises `key`'s fence counter to at least `at_least` (never lowers it), so the next
    /// grant on this store mints a larger token. [`Redlock`] writes the quorum's token back
    /// with it.
    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()>;
}

/// A shared store is a store: `LockManager::new`, `Redlock::new` and `Cache` take an
/// `Arc<dyn Backend>` (or any `Arc` of a store) like the store itself.
///
/// Inside the crate, call a held `Arc<dyn Backend>` through the trait object
/// (`(*arc).acquire(..)`): a method call on the `Arc` itself picks this impl, which boxes one
/// more future per call.
#[async_trait]
impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        (**self).acquire(claim, attempt, terms).await
    }

    async fn extend(&self, leases: &[Lease<'_>], terms: NodeTerms) -> Result<Vec<Extended>> {
        (**self).extend(leases, terms).await
    }

    fn extend_group(&self, key: &LeaseKey) -> u64 {
        (**self).extend_group(key)
    }

    fn disturbed(&self) -> BoxFuture<'static, ()> {
        (**self).disturbed()
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        (**self).release(claim, how).await
    }

    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        (**self).subscribe(claim).await
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        (**self).inspect(key).await
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        (**self).raise_fence(key, at_least).await
    }
}

/// The clock-drift margin taken off a lease's TTL: 1 % plus 2 ms (the Redlock paper's
/// figures). It covers the rate difference between the client's and the server's clocks.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(redlease::backend::clock_drift(Duration::from_secs(10)), Duration::from_millis(102));
/// ```
pub fn clock_drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// A failure's kind, kept as the source of an [`Error::Backend`] (it reads as its text):
/// the callers look for it by downcasting.
macro_rules! failure_kind {
    ($name:ident) => {
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::error::Error for $name {}
    };
}

/// A call that failed before anything reached the store (a quorum member's connection was
/// down and the caller asked to fail fast): it cannot have taken effect.
#[derive(Debug)]
pub(crate) struct NotSent(pub(crate) String);

failure_kind!(NotSent);

/// Whether `e` is a [`NotSent`] failure.
pub(crate) fn not_sent(e: &Error) -> bool {
    matches!(e, Error::Backend { source } if source.downcast_ref::<NotSent>().is_some())
}

/// A command the store ran and answered with an error of its own (a key of the wrong type,
/// a command an ACL refuses): trying again will not help, unlike a timeout or a lost
/// connection.
#[derive(Debug)]
pub(crate) struct Refused(pub(crate) String);

failure_kind!(Refused);

/// Whether `e` says the store will not serve the call however often it is tried: a
/// [`Refused`] command, bad input, or a store that cannot serve it (a server that may evict
/// keys, say).
pub(crate) fn refused(e: &Error) -> bool {
    match e {
        Error::InvalidConfig(_) | Error::Unsupported(_) => true,
        Error::Backend { source } => source.downcast_ref::<Refused>().is_some(),
        _ => false,
    }
}

/// A call the store could not serve now but may serve soon: its connection is down or
/// timed out, or it is failing over or short of replicas (`LOADING`, `READONLY`,
/// `MASTERDOWN`, `CLUSTERDOWN`, `TRYAGAIN`, `BUSY`, `NOREPLICAS`). A waiting acquire waits on through it (its outcome unknown: the
/// next attempt, with the same token, finds a grant it made).
#[derive(Debug)]
pub(crate) struct Unavailable(pub(crate) String);

failure_kind!(Unavailable);

/// Whether `e` says the store may serve the call if it is tried again soon: an
/// [`Unavailable`] store, or a call [`NotSent`].
pub(crate) fn unavailable(e: &Error) -> bool {
    matches!(e, Error::Backend { source }
        if source.downcast_ref::<Unavailable>().is_some() || source.downcast_ref::<NotSent>().is_some())
}

/// The same error for another caller of one failed call (a batch's entries): the text, and
/// whether it was [`Refused`], [`Unavailable`] or [`NotSent`].
pub(crate) fn for_each_caller(e: &Error) -> Error {
    match e {
        Error::Backend { source } => {
            if source.downcast_ref::<Refused>().is_some() {
                Error::backend(Refused(source.to_string()))
            } else if source.downcast_ref::<Unavailable>().is_some() {
                Error::backend(Unavailable(source.to_string()))
            } else if source.downcast_ref::<NotSent>().is_some() {
                Error::backend(NotSent(source.to_string()))
            } else {
                Error::backend(source.to_string())
            }
        }
        other => other
            .copied()
            .unwrap_or_else(|| Error::backend(other.to_string())),
    }
}

/// The same error again, for reporting one node's refusal as a quorum's answer.
pub(crate) fn same_error(e: &Error) -> Error {
    match e {
        Error::InvalidConfig(m) => Error::InvalidConfig(m.clone()),
        Error::Unsupported(m) => Error::Unsupported(m.clone()),
        other => Error::backend(Refused(other.to_string())),
    }
}
