//! `LockManager` and `Lock`: naming locks, choosing their kind, and handing them to the one
//! acquire engine. The shared kinds' facades (`Semaphore`, `RwLock`) are in `lock/shared.rs`,
//! locking several names at once (`MultiLock`) in `lock/multi.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::acquire::{self, Engine, Target};
use crate::backend::{Backend, ClaimKind};
use crate::error::{Error, Result};
use crate::guard::LockGuard;
use crate::info::LockInfo;
use crate::options::LockOptions;
use crate::token::{LeaseKey, Owner};
use crate::watchdog::WatchdogStats;

mod multi;
mod shared;

pub use multi::{MultiGuard, MultiLock};
pub use shared::{RwLock, Semaphore};

struct Shared {
    engine: Engine,
    defaults: LockOptions,
}

/// Hands out [`Lock`]s on one backend, with default [`LockOptions`] and one shared watchdog
/// task that keeps every held lease alive (one batched round trip per tick, however many
/// leases are held).
///
/// Cheap to clone; clones share the backend and the watchdog. A backend that is already
/// shared (an `Arc<dyn Backend>`, or an `Arc` of any store) is a backend too.
///
/// ```
/// use std::time::Duration;
/// use redlease::{LockManager, LockOptions, MemoryBackend};
/// # fn main() -> redlease::Result<()> {
/// let locks = LockManager::with_options(
///     MemoryBackend::new(),
///     LockOptions::new().ttl(Duration::from_secs(10)),
/// )?;
/// let orders = locks.lock("orders:42");
/// let reports = locks.lock_with("reports", |o| o.ttl(Duration::from_secs(60)))?;
/// assert_eq!(reports.options().ttl, Duration::from_secs(60));
/// # let _ = orders; Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockManager {
    shared: Arc<Shared>,
}

impl fmt::Debug for LockManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManager")
            .field("backend", &self.shared.engine.backend)
            .field("defaults", &self.shared.defaults)
            .field("watchdog", &self.shared.engine.watchdog)
            .finish()
    }
}

impl LockManager {
    /// A manager with default options.
    pub fn new(backend: impl Backend) -> Self {
        Self::build(Arc::new(backend), LockOptions::default())
    }

    /// A manager with the given defaults, checked now.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for invalid options; [`Error::Unsupported`] for fair
    /// defaults on a store without fair locks.
    pub fn with_options(backend: impl Backend, defaults: LockOptions) -> Result<Self> {
        Self::over(Arc::new(backend), defaults)
    }

    /// [`with_options`](Self::with_options) for a store the crate holds as a trait object
    /// already (the cache's): not wrapped in one more `Arc`, whose calls would box one more
    /// future each.
    pub(crate) fn over(backend: Arc<dyn Backend>, defaults: LockOptions) -> Result<Self> {
        defaults.validate()?;
        let manager = Self::build(backend, defaults);
        manager.shared.engine.check(&manager.default_kind())?;
        Ok(manager)
    }

    fn build(backend: Arc<dyn Backend>, defaults: LockOptions) -> Self {
        LockManager {
            shared: Arc::new(Shared {
                engine: Engine::new(backend),
                defaults,
            }),
        }
    }

    fn default_kind(&self) -> ClaimKind {
        kind_of(&self.shared.defaults)
    }

    /// A handle on the lock `name`, with the manager's default options. Any non-empty
    /// string is a valid name (an empty one makes `acquire` fail with
    /// [`Error::InvalidConfig`]).
    pub fn lock(&self, name: &str) -> Lock {
        let options = self.shared.defaults.clone();
        Lock {
            shared: self.shared.clone(),
            key: LeaseKey::new(&options.key_prefix, name),
            name: name.into(),
            kind: kind_of(&options),
            options,
        }
    }

    /// A handle with options derived from the manager's defaults, checked now.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for an empty name or invalid options; [`Error::Unsupported`]
    /// for a fair lock on a store without fair locks.
    pub fn lock_with(
        &self,
        name: &str,
        options: impl FnOnce(LockOptions) -> LockOptions,
    ) -> Result<Lock> {
        let options = options(self.shared.defaults.clone());
        options.validate()?;
        let kind = kind_of(&options);
        let lock = Lock {
            shared: self.shared.clone(),
            key: LeaseKey::new(&options.key_prefix, name),
            name: name.into(),
            kind,
            options,
        };
        lock.check()?;
        Ok(lock)
    }

    /// The default options.
    pub fn options(&self) -> &LockOptions {
        &self.shared.defaults
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.shared.engine.backend
    }

    /// Counters of the shared watchdog (leases kept alive, batched round trips).
    pub fn watchdog_stats(&self) -> WatchdogStats {
        self.shared.engine.watchdog.stats()
    }
}

fn kind_of(options: &LockOptions) -> ClaimKind {
    if options.fair {
        ClaimKind::Fair
    } else {
        ClaimKind::Plain
    }
}

/// A named lock of one kind: plain (the default), [fair](Lock::fair) or
/// [reentrant](Lock::reentrant). Cheap to clone; `Send + Sync`. Acquiring returns a
/// [`LockGuard`], whatever the kind.
///
/// ```
/// use std::time::Duration;
/// use redlease::{Error, LockManager, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let lock = locks.lock("nightly-report");
/// let held = lock.acquire().await?;
/// assert!(lock.try_acquire().await?.is_none());               // contention is Ok(None)
/// let err = lock.acquire_timeout(Duration::from_millis(20)).await.unwrap_err();
/// assert!(matches!(err, Error::Timeout { .. }));
/// drop(held);
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone)]
pub struct Lock {
    shared: Arc<Shared>,
    name: Arc<str>,
    key: LeaseKey,
    options: LockOptions,
    kind: ClaimKind,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("key", &self.key)
            .field("kind", &self.kind)
            .field("options", &self.options)
            .finish()
    }
}

impl Lock {
    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The key the lease is stored under.
    pub fn key(&self) -> &LeaseKey {
        &self.key
    }

    /// This lock's options.
    pub fn options(&self) -> &LockOptions {
        &self.options
    }

    /// The kind of claim this lock makes.
    pub fn kind(&self) -> &ClaimKind {
        &self.kind
    }

    /// The same lock, served in arrival order (see [`LockOptions::fair`]).
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let lock = locks.lock("queue:emails").fair()?;
    /// let held = lock.acquire().await?;
    /// assert!(lock.try_acquire().await?.is_none());
    /// held.release().await?;
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] if the store has no fair locks ([`Redlock`](crate::Redlock));
    /// [`Error::InvalidConfig`] for a reentrant lock (a re-entry would have to jump the
    /// queue).
    pub fn fair(mut self) -> Result<Lock> {
        if matches!(self.kind, ClaimKind::Reentrant(_)) {
            return Err(both_fair_and_reentrant());
        }
        self.options.fair = true;
        self.kind = ClaimKind::Fair;
        self.check()?;
        Ok(self)
    }

    /// This lock, held reentrantly by `owner`: acquiring it while `owner` already holds it
    /// succeeds at once and counts one more hold; the lease is deleted when the last hold is
    /// released. Plain and reentrant acquirers of one name exclude each other.
    ///
    /// Holds are counted on the store per hold (a re-sent command never counts twice), so
    /// the guards of one owner may live in different processes ([`Owner::named`]). In this
    /// process the guards of one reign share one watchdog registration and one lost state:
    /// the lease is extended while any of them lives, and when it is lost, all of them are.
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend, Owner};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let me = Owner::random();
    /// let lock = locks.lock("account:7").reentrant(&me)?;
    /// let outer = lock.acquire().await?;
    /// let inner = lock.acquire().await?;            // no deadlock: same owner
    /// assert_eq!(inner.hold_count(), Some(2));
    /// assert_eq!(inner.fencing_token(), outer.fencing_token()); // one reign, one token
    /// assert!(locks.lock("account:7").try_acquire().await?.is_none());
    /// assert_eq!(inner.release().await?, 1);         // one hold left
    /// assert_eq!(outer.release().await?, 0);         // the lease is gone
    /// assert!(locks.lock("account:7").try_acquire().await?.is_some());
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for an empty owner name or a fair lock;
    /// [`Error::Unsupported`] if the store has no reentrant locks.
    pub fn reentrant(&self, owner: &Owner) -> Result<Lock> {
        if self.options.fair {
            return Err(both_fair_and_reentrant());
        }
        if owner.as_str().is_empty() {
            return Err(Error::invalid(
                "a reentrant lock's owner name must not be empty",
            ));
        }
        let lock = Lock {
            kind: ClaimKind::Reentrant(owner.clone()),
            ..self.clone()
        };
        lock.check()?;
        Ok(lock)
    }

    fn check(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::invalid("lock name must not be empty"));
        }
        self.shared.engine.check(&self.kind)
    }

    fn target(&self) -> Result<Target<'_>> {
        if self.name.is_empty() {
            return Err(Error::invalid("lock name must not be empty"));
        }
        Ok(Target {
            manager: &self.shared.engine,
            name: &self.name,
            key: &self.key,
            options: &self.options,
            kind: &self.kind,
        })
    }

    /// Waits until the lock is ours (or the options' `wait_timeout` passes).
    ///
    /// Waiters are woken by the holder's release (pub/sub on Redis), with a bounded fallback
    /// re-check; see [`RetryPolicy`](crate::RetryPolicy). A [fair](LockOptions::fair) lock
    /// serves waiters in arrival order.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after `wait_timeout`; [`Error::InvalidConfig`] for an empty name;
    /// [`Error::Backend`] if the store fails in a way waiting does not cure (a refused
    /// command, a script error), or is unavailable (a lost connection, a command timeout, a
    /// failover in progress) and no `wait_timeout` is set: an outage is reported within the
    /// command timeout, not hidden. With a `wait_timeout`, a store unavailable for a moment
    /// is waited out, trying again with back-off, as are a [`Redlock`](crate::Redlock) that
    /// cannot reach a majority and too few replicas acknowledging a grant
    /// ([`ReplicaAck`](crate::ReplicaAck)) in any case; if the wait runs out meanwhile, the
    /// last such error is returned ([`Error::Backend`], [`Error::QuorumNotReached`],
    /// [`Error::NotAcknowledged`]) rather than [`Error::Timeout`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any point leaves no lease behind: if an attempt may have
    /// reached the store, its claim is abandoned in the background (a compare-and-delete
    /// that also bars a late copy of the attempt). A fair waiter that is dropped loses its
    /// place in the queue.
    pub async fn acquire(&self) -> Result<LockGuard> {
        acquire::wait(self.target()?, self.options.wait_timeout).await
    }

    /// Waits at most `timeout` (overrides the options' `wait_timeout`). The first attempt
    /// always gets its answer (bounded by the store's own timeouts), so a zero timeout takes
    /// a free lock, like `flock -w 0`.
    ///
    /// ```
    /// use std::time::Duration;
    /// # futures::executor::block_on(async {
    /// let locks = redlease::LockManager::new(redlease::MemoryBackend::new());
    /// let g = locks.lock("free").acquire_timeout(Duration::ZERO).await?;
    /// let busy = locks.lock("free").acquire_timeout(Duration::ZERO).await;
    /// assert!(matches!(busy, Err(redlease::Error::Timeout { .. })));
    /// # drop(g); Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::Timeout`] when `timeout` passes.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        acquire::wait(self.target()?, Some(timeout)).await
    }

    /// One attempt: `Ok(None)` if someone else holds the lock (for a fair lock, also when
    /// others are queued: a single attempt never joins the queue).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        acquire::once(self.target()?).await
    }

    /// What the store knows about this lock now: whether it is held and for how long yet,
    /// the last fencing token, the holder's [label](LockOptions::holder_label), how many
    /// fair waiters are queued and, for a reentrant hold, its count. `None` when the store has
    /// no trace of the lock. Never reveals the holder's secret token, so it is safe to log.
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let lock = locks.lock("nightly-report");
    /// let _held = lock.acquire().await?;
    /// let info = lock.inspect().await?.expect("held");
    /// assert!(info.held && info.queue_len == 0);
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for an empty name; [`Error::Backend`] if the store fails.
    pub async fn inspect(&self) -> Result<Option<LockInfo>> {
        let target = self.target()?;
        (*target.manager.backend).inspect(target.key).await
    }
}

fn both_fair_and_reentrant() -> Error {
    Error::invalid(
        "a lock cannot be both fair and reentrant: a re-entry would have to jump the queue; \
         turn `fair` off for this lock",
    )
}
