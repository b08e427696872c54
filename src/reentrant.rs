//! Reentrant locks: an explicit [`Owner`] may take the same lock again; the store counts
//! its holds, and the lease goes when the count reaches zero.
//!
//! # Layout (Redis)
//!
//! The lease key `<prefix>{<name>}` stays the exclusion point: it holds the reign's lease
//! token as a plain string, so plain and reentrant acquirers of one name exclude each other.
//! Beside it, with the same hash tag and always the same TTL (the three keys expire
//! together):
//!
//! - `<key>:owners`: a hash {owner id: hold count} (one field while held), the count an
//!   inspection reads;
//! - `<key>:holds`: the reign's live holds {hold token: 1}, plus `owner`, `token` (the lease
//!   token) and `fence` (the reign's fencing token).
//!
//! Every guard is one *hold* with its own random token ([`Token::hold`]); the hold that
//! starts a reign is also its lease token. Counting holds by their token, not by
//! incrementing blindly, is what makes a re-sent command harmless: a replayed acquire finds
//! its hold counted already, a replayed release finds it gone. Redisson keeps a time-limited
//! latch key per unlock request for the same purpose, which forgets the answer when the latch
//! expires and leaves a key per unlock; here the answer lives in the reign's own hash, as
//! long as the reign.
//!
//! # In this process
//!
//! The guards of one reign on one manager share one watchdog registration and one lost
//! state ([`Reign`]): the lease is extended while any of them lives, and when it is lost,
//! all of them are.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use event_listener::Event;
use futures::future::{self, BoxFuture};

use crate::backend::{Backend, NodeTerms, ReentrantAcquire, Subscription, Waiting};
use crate::error::{Error, Result};
use crate::lock::{Lock, ManagerInner, Pauses};
use crate::runtime::{self, Rt};
use crate::token::{LeaseKey, Token};
use crate::watchdog::LeaseState;

/// Who holds a reentrant lock: holds by the same owner nest instead of excluding each other.
///
/// An async task is not a thread: it moves between threads at every `.await`, and one
/// thread runs many tasks, so a thread id (what Java's reentrant locks use) says nothing
/// about who holds a lock. The owner is therefore explicit: make one per logical holder (a
/// request, a job) and pass it down to the code that locks.
///
/// [`Owner::named`] lets separate processes act as one owner (say, two workers of one job):
/// anyone with the name shares the lock, so treat it like a credential.
///
/// ```
/// use redlease::Owner;
/// let me = Owner::random();
/// assert_ne!(me, Owner::random());
/// assert_eq!(Owner::named("job-1234"), Owner::named("job-1234"));
/// assert_eq!(Owner::named("job-1234").as_str(), "job-1234");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<str>);

impl Owner {
    /// A fresh owner: 128 random bits, as 32 hex digits.
    pub fn random() -> Self {
        let bits: u128 = rand::random();
        Owner(format!("{bits:032x}").into())
    }

    /// The owner called `name` (a job id, say); every holder using the same name is the
    /// same owner, in any process. An empty name makes acquire fail with
    /// [`Error::InvalidConfig`].
    pub fn named(name: impl AsRef<str>) -> Self {
        Owner(name.as_ref().into())
    }

    /// The owner's id, as stored (the field of the `:owners` hash).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.0.chars().take(40).collect();
        write!(f, "Owner({shown:?})")
    }
}

impl Lock {
    /// This lock, held reentrantly by `owner`: acquiring it while `owner` already holds it
    /// succeeds at once and counts one more hold; the lease is deleted when the last hold is
    /// released. Plain and reentrant acquirers of one name exclude each other.
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend, Owner};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let me = Owner::random();
    /// let lock = locks.lock("account:7").reentrant(&me);
    /// let outer = lock.acquire().await?;
    /// let inner = lock.acquire().await?;            // no deadlock: same owner
    /// assert_eq!(inner.hold_count(), 2);
    /// assert!(locks.lock("account:7").try_acquire().await?.is_none());
    /// assert_eq!(inner.release().await?, 1);         // one hold left
    /// assert_eq!(outer.release().await?, 0);         // the lease is gone
    /// assert!(locks.lock("account:7").try_acquire().await?.is_some());
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn reentrant(&self, owner: &Owner) -> ReentrantLock {
        ReentrantLock {
            lock: self.clone(),
            owner: owner.clone(),
        }
    }
}

/// A lock held reentrantly by one [`Owner`]; made by [`Lock::reentrant`]. Cheap to clone.
///
/// Needs a backend with reentrant locks ([`RedisBackend`](crate::RedisBackend),
/// [`MemoryBackend`](crate::MemoryBackend), [`Redlock`](crate::Redlock) over them); others
/// refuse with [`Error::InvalidConfig`], as does a [fair](crate::LockOptions::fair) lock.
///
/// ```
/// use std::time::Duration;
/// use redlease::{LockManager, MemoryBackend, Owner};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let (a, b) = (Owner::random(), Owner::random());
/// let held = locks.lock("l").reentrant(&a).acquire().await?;
/// assert!(locks.lock("l").reentrant(&b).try_acquire().await?.is_none());
/// let theirs = locks.lock("l").reentrant(&b);
/// let waited = theirs.acquire_timeout(Duration::from_millis(20)).await;
/// assert!(matches!(waited, Err(redlease::Error::Timeout { .. })));
/// drop(held);
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone, Debug)]
pub struct ReentrantLock {
    lock: Lock,
    owner: Owner,
}

impl ReentrantLock {
    /// The owner this handle acquires for.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The lock underneath.
    pub fn lock(&self) -> &Lock {
        &self.lock
    }

    /// Waits until the lock is free or held by this owner (or the options' `wait_timeout`
    /// passes), then counts one more hold.
    ///
    /// # Errors
    ///
    /// As [`Lock::acquire`]; [`Error::InvalidConfig`] also for an empty owner name, a fair
    /// lock, or a backend without reentrant locks.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any point leaves the count right: if an attempt may have
    /// reached the store, its hold is abandoned in the background (taken out if it was
    /// counted, and barred from being counted by a late copy of the attempt).
    pub async fn acquire(&self) -> Result<ReentrantGuard> {
        let limit = self.lock.options.wait_timeout;
        self.run(Some(limit)).await?.ok_or(Error::NotHeld)
    }

    /// Waits at most `timeout` (overrides the options' `wait_timeout`).
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::Timeout`] when `timeout` passes.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<ReentrantGuard> {
        self.run(Some(Some(timeout))).await?.ok_or(Error::NotHeld)
    }

    /// One attempt: `Ok(None)` if another owner (or a plain lock) holds it.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn try_acquire(&self) -> Result<Option<ReentrantGuard>> {
        self.run(None).await
    }

    fn check(&self) -> Result<()> {
        if self.lock.name().is_empty() {
            return Err(Error::invalid("lock name must not be empty"));
        }
        if self.owner.as_str().is_empty() {
            return Err(Error::invalid(
                "a reentrant lock's owner name must not be empty",
            ));
        }
        if self.lock.options.fair {
            return Err(Error::invalid(
                "a lock cannot be both fair and reentrant: a re-entry would have to jump \
                 the queue; turn `fair` off for this lock",
            ));
        }
        if self.lock.options.max_hold.is_some() {
            return Err(Error::invalid(
                "max_hold is not supported on reentrant locks yet: turn it off for this lock",
            ));
        }
        if self.lock.options.holder_label.is_some() {
            return Err(Error::invalid(
                "holder labels are not supported on reentrant locks yet: turn holder_label \
                 off for this lock",
            ));
        }
        self.lock.options.validate()
    }

    /// The acquire loop (see `Lock::run`). `wait`: `None` = one attempt; `Some(limit)` =
    /// wait, up to `limit`.
    async fn run(&self, wait: Option<Option<Duration>>) -> Result<Option<ReentrantGuard>> {
        self.check()?;
        let lock = &self.lock;
        let opts = &lock.options;
        let key = lock.key();
        let backend = lock.manager.backend.clone();
        let began = Instant::now();
        let deadline = wait.flatten().and_then(|d| began.checked_add(d));
        let timeout = || Error::Timeout {
            waited: began.elapsed(),
        };
        let mut pending = HoldOnDrop {
            backend: backend.clone(),
            key: key.clone(),
            owner: self.owner.clone(),
            hold: Token::hold(),
            lease: None,
            rt: Rt::current(),
            armed: false,
        };
        let notify = wait.is_some() && opts.retry.notify;
        let recheck = opts.retry.max_delay;
        let mut sub: Option<Subscription> = None;
        let mut pauses = Pauses::new(&opts.retry, notify);
        let mut arriving = true;
        loop {
            let woken = sub.as_ref().map(Subscription::listen);
            let started = Instant::now();
            // From here until a definite answer, the hold may be counted.
            pending.armed = true;
            let waiting = match (notify, arriving) {
                (false, _) => Waiting::No,
                (true, true) => Waiting::Arriving { recheck },
                (true, false) => Waiting::Waiting { recheck },
            };
            let attempt = backend.reentrant_acquire(
                key,
                &self.owner,
                &pending.hold,
                opts.ttl,
                waiting,
                NodeTerms::new(),
            );
            // The first attempt always gets its answer (see `Lock::run`).
            let limit = if arriving { None } else { deadline };
            let outcome = match runtime::until(limit, attempt).await.ok_or_else(timeout)? {
                Ok(outcome) => outcome,
                Err(e @ Error::InvalidConfig(_)) => {
                    // Refused up front (a backend without reentrant locks): nothing to undo.
                    pending.armed = false;
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            let remaining = match outcome {
                ReentrantAcquire::Acquired {
                    lease,
                    fencing_token,
                    validity,
                    count,
                } => {
                    tracing::debug!(key = %key, fencing_token, count, waited = ?began.elapsed(), "acquired (reentrant)");
                    pending.lease = Some(lease);
                    return Ok(Some(ReentrantGuard::new(
                        lock,
                        fencing_token,
                        count,
                        started,
                        validity,
                        pending,
                    )));
                }
                ReentrantAcquire::Held { remaining } => remaining,
                ReentrantAcquire::Warming { remaining } => Some(remaining),
            };
            arriving = false;
            pending.armed = false;
            if wait.is_none() {
                return Ok(None);
            }
            if notify && sub.is_none() {
                // Subscribe, then check again at once (see `Lock::run`).
                let subscribed = backend.subscribe(key);
                sub = Some(
                    runtime::until(deadline, subscribed)
                        .await
                        .ok_or_else(timeout)??,
                );
                continue;
            }
            if !pauses.wait(woken, remaining, deadline).await {
                return Err(timeout());
            }
        }
    }
}

/// Takes one hold out in the background when dropped while armed: the release of a dropped
/// guard (`lease` known), or the abandon of an attempt whose outcome is unknown (`lease`
/// unknown: the hold is also barred from being counted later).
struct HoldOnDrop {
    backend: Arc<dyn Backend>,
    key: LeaseKey,
    owner: Owner,
    hold: Token,
    lease: Option<Token>,
    rt: Rt,
    armed: bool,
}

impl Drop for HoldOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (backend, key, owner, hold) = (
            self.backend.clone(),
            self.key.clone(),
            self.owner.clone(),
            self.hold.clone(),
        );
        let lease = self.lease.take();
        self.rt.spawn(async move {
            match backend
                .reentrant_release(&key, &owner, &hold, lease.as_ref())
                .await
            {
                Ok(left) => tracing::debug!(%key, ?left, "background reentrant release"),
                Err(e) => tracing::warn!(%key, error = %e, "background reentrant release failed; the TTL will free the lock"),
            }
        });
    }
}

/// The guards of one reign (one lease token) on one manager in this process: one watchdog
/// registration and one lost state for all of them. Unregistered when the last goes.
struct Reign {
    manager: Arc<ManagerInner>,
    id: ReignId,
    state: Arc<LeaseState>,
    watch: Option<u64>,
}

/// A reign as this process knows it: the manager (by address; the reign keeps it alive)
/// and the lease token.
type ReignId = (usize, Token);

fn reigns() -> MutexGuard<'static, HashMap<ReignId, Weak<Reign>>> {
    static REIGNS: OnceLock<Mutex<HashMap<ReignId, Weak<Reign>>>> = OnceLock::new();
    REIGNS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

impl Drop for Reign {
    fn drop(&mut self) {
        if let Some(id) = self.watch.take() {
            self.manager.watchdog.unregister(id);
        }
        let mut map = reigns();
        // Only if no newer reign took the slot.
        if map.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&self.id);
        }
    }
}

/// The reign this new guard belongs to: the live one of this manager and lease token (whose
/// deadline this acquire confirms), or a new one registered with the watchdog.
fn join_reign(lock: &Lock, lease: &Token, sent: Instant, validity: Duration) -> Arc<Reign> {
    let manager = &lock.manager;
    let id: ReignId = (Arc::as_ptr(manager) as usize, lease.clone());
    // Kept until the map is unlocked: dropping the last handle of a reign locks the map.
    let existing = reigns().get(&id).and_then(Weak::upgrade);
    if let Some(r) = &existing {
        // A re-entry only ever moves the reign's deadline later (the store never shortens
        // the lease: a re-entry with a shorter TTL keeps the longer one).
        if r.state.confirm_later(sent + validity) {
            return r.clone();
        }
        // Lost here already (a passed deadline, say) though the store still had it: the
        // old guards stay lost, this one starts afresh.
    }
    let opts = &lock.options;
    let state = Arc::new(LeaseState::new(sent, sent + validity));
    let watch = opts.watchdog.then(|| {
        manager.watchdog.register(
            lock.key().clone(),
            lease.clone(),
            opts.ttl,
            opts.effective_watchdog_interval(),
            state.clone(),
        )
    });
    let reign = Arc::new(Reign {
        manager: manager.clone(),
        id: id.clone(),
        state,
        watch,
    });
    let replaced = reigns().insert(id, Arc::downgrade(&reign));
    drop((replaced, existing));
    reign
}

/// Set when a guard is released or dropped, so its `lost()` future resolves then.
#[derive(Default)]
struct Done {
    flag: AtomicBool,
    event: Event,
}

impl Done {
    fn set(&self) {
        if !self.flag.swap(true, Ordering::AcqRel) {
            self.event.notify(usize::MAX);
        }
    }

    async fn wait(self: Arc<Self>) {
        loop {
            let listener = self.event.listen();
            if self.flag.load(Ordering::Acquire) {
                return;
            }
            listener.await;
        }
    }
}

/// One hold of a reentrant lock; made by [`ReentrantLock`]. Dropping it releases the hold
/// in the background (never blocking, never panicking); the lease goes when its owner's
/// last hold does.
///
/// While any guard of the reign lives in this process, the manager's watchdog keeps the
/// lease alive (one registration per reign, however many guards). When the lease is lost,
/// every guard of that reign on that manager reports it: [`is_lost`](Self::is_lost),
/// [`lost`](Self::lost).
///
/// ```
/// use redlease::{LockManager, MemoryBackend, Owner};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let job = Owner::named("job-42");
/// let outer = locks.lock("report").reentrant(&job).acquire().await?;
/// let inner = locks.lock("report").reentrant(&job).acquire().await?;
/// assert_eq!(inner.fencing_token(), outer.fencing_token()); // one reign, one token
/// assert_eq!((outer.hold_count(), inner.hold_count()), (1, 2));
/// assert_eq!(outer.release().await?, 1);                    // any order
/// assert_eq!(inner.release().await?, 0);                    // the lease is gone
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[must_use = "if unused the hold is released at once"]
pub struct ReentrantGuard {
    held: Option<Held>,
}

struct Held {
    reign: Arc<Reign>,
    name: Arc<str>,
    fence: u64,
    count: u32,
    done: Arc<Done>,
    release: HoldOnDrop,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.done.set();
    }
}

impl fmt::Debug for ReentrantGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("ReentrantGuard");
        if let Some(h) = &self.held {
            d.field("name", &h.name)
                .field("owner", &h.release.owner)
                .field("fencing_token", &h.fence)
                .field("hold_count", &h.count)
                .field("lost", &h.reign.state.check_lost());
        }
        d.finish()
    }
}

impl ReentrantGuard {
    fn new(
        lock: &Lock,
        fence: u64,
        count: u32,
        sent: Instant,
        validity: Duration,
        mut release: HoldOnDrop,
    ) -> Self {
        release.armed = true;
        let lease = release
            .lease
            .clone()
            .unwrap_or_else(|| release.hold.clone());
        let reign = join_reign(lock, &lease, sent, validity);
        ReentrantGuard {
            held: Some(Held {
                reign,
                name: lock.name.clone(),
                fence,
                count,
                done: Arc::default(),
                release,
            }),
        }
    }

    fn held(&self) -> &Held {
        // Only `release` takes `held`, and it consumes the guard.
        self.held
            .as_ref()
            .expect("a live guard always holds its lease")
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.held().name
    }

    /// The owner this hold belongs to.
    pub fn owner(&self) -> &Owner {
        &self.held().release.owner
    }

    /// The owner's hold count when this hold was counted, this hold included (1 for the
    /// hold that started the reign). Other holds of the owner, here or in other processes,
    /// may have come and gone since; [`release`](Self::release) returns the count left.
    /// Over [`Redlock`](crate::Redlock), the largest count among the nodes that answered (a
    /// node that missed a hold, being down then, counts less).
    pub fn hold_count(&self) -> u32 {
        self.held().count
    }

    /// The reign's fencing token: every hold of one reign has the same one, strictly
    /// greater than the token of every earlier hold of this lock name (plain or
    /// reentrant). See [`LockGuard::fencing_token`](crate::LockGuard::fencing_token).
    pub fn fencing_token(&self) -> u64 {
        self.held().fence
    }

    /// Whether the lease can no longer be guaranteed. Once true, stays true.
    pub fn is_lost(&self) -> bool {
        self.held().reign.state.check_lost()
    }

    /// The monotonic instant until which the lease is guaranteed, as last confirmed.
    pub fn valid_until(&self) -> Instant {
        self.held().reign.state.deadline()
    }

    /// A future that resolves when the lease is lost (for every guard of the reign), or
    /// when this guard is released or dropped. `'static`, so it can race the critical
    /// section, as [`LockGuard::lost`](crate::LockGuard::lost).
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend, Owner};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let guard = locks.lock("job").reentrant(&Owner::random()).acquire().await?;
    /// let lost = guard.lost();
    /// drop(guard);
    /// lost.await;                          // this hold is over
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn lost(&self) -> ReentrantLost {
        let h = self.held();
        let lost = h.reign.state.clone().lost();
        let done = h.done.clone().wait();
        ReentrantLost {
            inner: Box::pin(async move {
                future::select(Box::pin(lost), Box::pin(done)).await;
            }),
        }
    }

    /// Releases this hold now. Returns the owner's count left: `0` means the lease was
    /// deleted (the lock is free).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the lease was lost before, or the hold was no longer counted
    /// in the store (its reign was lost); [`Error::Backend`] if the store failed (the TTL
    /// frees the lock once no hold of the reign is left to keep it alive).
    ///
    /// # Cancel safety
    ///
    /// If this future is dropped before it completes, the release still happens in the
    /// background.
    pub async fn release(mut self) -> Result<u32> {
        let Some(mut held) = self.held.take() else {
            return Err(Error::NotHeld);
        };
        let was_lost = held.reign.state.check_lost();
        let r = &held.release;
        let released = r
            .backend
            .reentrant_release(&r.key, &r.owner, &r.hold, r.lease.as_ref())
            .await;
        // On an error the outcome is unknown: the hold stays armed, so dropping it retries
        // the release in the background (idempotent per hold) instead of leaking the hold.
        held.release.armed = released.is_err();
        match released {
            Ok(Some(left)) if !was_lost => Ok(left),
            Ok(_) => Err(Error::NotHeld),
            Err(e) => Err(e),
        }
    }
}

/// Resolves when a [`ReentrantGuard`]'s lease is lost or the guard is gone; see
/// [`ReentrantGuard::lost`].
#[must_use = "futures do nothing unless awaited"]
pub struct ReentrantLost {
    inner: BoxFuture<'static, ()>,
}

impl fmt::Debug for ReentrantLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReentrantLost").finish_non_exhaustive()
    }
}

impl Future for ReentrantLost {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.inner.as_mut().poll(cx)
    }
}
