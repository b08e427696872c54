//! The shared kinds' facades: [`Semaphore`] (permits) and [`RwLock`] (reads and a write),
//! each a [`Lock`] of a shared claim kind run by the one engine.

use std::time::Duration;

use super::{Lock, LockManager};
use crate::backend::ClaimKind;
use crate::error::{Error, Result};
use crate::guard::LockGuard;
use crate::info::LockInfo;

impl LockManager {
    /// A semaphore: at most `permits` holders of `name` at once (see [`Semaphore`]), with the
    /// manager's default options. Shorthand for `locks.lock(name).semaphore(permits)`.
    ///
    /// # Errors
    ///
    /// As [`Lock::semaphore`].
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore> {
        self.lock(name).semaphore(permits)
    }

    /// A read-write lock on `name` (see [`RwLock`]), with the manager's default options.
    /// Shorthand for `locks.lock(name).rw()`.
    ///
    /// # Errors
    ///
    /// As [`Lock::rw`].
    pub fn rw(&self, name: &str) -> Result<RwLock> {
        self.lock(name).rw()
    }
}

impl Lock {
    /// This lock's name as a semaphore of `permits` permits, with this lock's options (TTL,
    /// label, waiting policy, maximum hold).
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{LockManager, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let pool = locks.lock_with("pool", |o| o.ttl(Duration::from_secs(30)))?.semaphore(2)?;
    /// assert_eq!(pool.permits(), 2);
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for zero permits, an empty name, or a fair or reentrant lock
    /// (semaphores are served in no order, and a permit is nobody's to re-enter);
    /// [`Error::Unsupported`] if the store cannot serve semaphores ([`Redlock`](crate::Redlock):
    /// entering a semaphore on a majority of nodes does not keep its count).
    pub fn semaphore(&self, permits: u32) -> Result<Semaphore> {
        if permits == 0 {
            return Err(Error::invalid("a semaphore needs at least one permit"));
        }
        Ok(Semaphore {
            lock: self.shared_kind(ClaimKind::Permit(permits), "a semaphore")?,
            permits,
        })
    }

    /// This lock's name as a read-write lock, with this lock's options.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for an empty name, a fair or reentrant lock, or a polling
    /// [`RetryPolicy`](crate::RetryPolicy) (its waiters make single attempts that register
    /// nothing, so a waiting writer could not hold new readers back); [`Error::Unsupported`]
    /// if the store cannot serve read-write locks
    /// ([`Redlock`](crate::Redlock)).
    pub fn rw(&self) -> Result<RwLock> {
        if !self.options.retry.notify {
            // A polling waiter makes single attempts, which register nothing with the store:
            // a writer could not make new readers wait, and a stream of them would starve it.
            return Err(Error::invalid(
                "a read-write lock's waiters register with the store (writer preference): \
                 use RetryPolicy::notify() for it, not polling",
            ));
        }
        let read = self.shared_kind(ClaimKind::Read, "a read-write lock")?;
        let write = Lock {
            kind: ClaimKind::Plain,
            ..read.clone()
        };
        Ok(RwLock { read, write })
    }

    /// This lock, making claims of the shared `kind`.
    fn shared_kind(&self, kind: ClaimKind, what: &str) -> Result<Lock> {
        if self.options.fair || !matches!(self.kind, ClaimKind::Plain) {
            return Err(Error::invalid(format!(
                "{what} is neither fair nor reentrant: make it from a plain lock (turn `fair` off)"
            )));
        }
        let lock = Lock {
            kind,
            ..self.clone()
        };
        lock.check()?;
        Ok(lock)
    }
}

/// At most N holders of one name at once, across processes: each permit is a lease of its
/// own, with everything a lock's lease has.
///
/// A permit is a [`LockGuard`]: the manager's watchdog keeps it alive, dropping it gives it
/// back, [`lost`](LockGuard::lost) says when it can no longer be guaranteed, and it has its
/// own [fencing token](LockGuard::fencing_token). A holder that crashes loses only its own
/// permit, which comes back when its TTL runs out by the store's clock (no client clock is
/// compared). Waiters are woken by a release (pub/sub on Redis), not by polling.
///
/// The count is each acquirer's own: a permit is granted while fewer than *its* count are
/// held. Lowering the count (a new deployment) takes no permit away: new acquirers wait
/// until fewer than the new count remain. Raising it lets new acquirers in at once, while
/// acquirers still on the old count wait for fewer than theirs.
///
/// A semaphore and a plain, fair or reentrant lock on one name exclude each other, as a
/// semaphore and a read-write lock do. [`Redlock`](crate::Redlock) refuses semaphores.
///
/// ```
/// use redlease::{LockManager, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let pool = locks.semaphore("db-pool", 2)?;
/// let a = pool.acquire().await?;
/// let b = pool.acquire().await?;
/// assert!(pool.try_acquire().await?.is_none());            // both permits taken
/// assert!(b.fencing_token() > a.fencing_token());          // a token per permit
/// assert_eq!(pool.inspect().await?.and_then(|i| i.shared_holds), Some(2));
/// drop(a);
/// let c = pool.acquire().await?;                           // a's permit, given back
/// # drop((b, c)); Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone, Debug)]
pub struct Semaphore {
    lock: Lock,
    permits: u32,
}

impl Semaphore {
    /// The semaphore's name.
    pub fn name(&self) -> &str {
        self.lock.name()
    }

    /// How many permits this handle asks for at most.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// The lock that makes this semaphore's claims ([`ClaimKind::Permit`]).
    pub fn as_lock(&self) -> &Lock {
        &self.lock
    }

    /// Waits for a permit (or the options' `wait_timeout`). As [`Lock::acquire`], errors and
    /// cancel safety included.
    pub async fn acquire(&self) -> Result<LockGuard> {
        self.lock.acquire().await
    }

    /// Waits at most `timeout` for a permit. As [`Lock::acquire_timeout`].
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        self.lock.acquire_timeout(timeout).await
    }

    /// One attempt: `Ok(None)` when every permit is taken. As [`Lock::try_acquire`].
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        self.lock.try_acquire().await
    }

    /// What the store knows now: [`LockInfo::shared_holds`] is how many permits are taken,
    /// [`LockInfo::shared_labels`] the labels of their holders.
    pub async fn inspect(&self) -> Result<Option<LockInfo>> {
        self.lock.inspect().await
    }
}

/// Many readers or one writer of one name, across processes, with **writer preference**:
/// once a writer waits, new readers wait behind it, so a steady stream of readers cannot
/// starve it (its wait is bounded by the reads already inside). When one of several waiting
/// writers gets the lock, the others say again that they wait at their next attempt (at the
/// latest their fallback re-check); a read may get in before that.
///
/// Every read and the write are [`LockGuard`]s with the usual lease machinery. Each read is
/// a lease of its own: a reader that dies loses only its own read, which runs out by its TTL;
/// nobody extends another's. Fencing: a write's token is greater than every earlier read's
/// and write's (one counter per name).
///
/// Readers waiting for a write are all woken by its release. A waiting writer's preference
/// is a lease its own attempts renew (at least every second, whatever
/// [`RetryPolicy`](crate::RetryPolicy)'s `max_delay`): a writer that dies holds new readers
/// back for at most 2.1 s, and one that gives up withdraws it at once and wakes the waiting
/// readers. [`Redlock`](crate::Redlock) refuses read-write locks.
///
/// ```
/// use redlease::{LockManager, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let config = locks.rw("config")?;
/// let r1 = config.read().await?;
/// let r2 = config.read().await?;                    // readers share
/// assert!(config.try_write().await?.is_none());     // the writer waits for them
/// drop((r1, r2));
/// let w = config.write().await?;
/// assert!(config.try_read().await?.is_none());      // and readers for the writer
/// # drop(w); Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone, Debug)]
pub struct RwLock {
    read: Lock,
    write: Lock,
}

impl RwLock {
    /// The lock's name.
    pub fn name(&self) -> &str {
        self.read.name()
    }

    /// The lock that makes the reads' claims ([`ClaimKind::Read`]).
    pub fn reader(&self) -> &Lock {
        &self.read
    }

    /// The lock that makes the write's claims (a plain lock of the same name).
    pub fn writer(&self) -> &Lock {
        &self.write
    }

    /// Waits for a read (or the options' `wait_timeout`). As [`Lock::acquire`].
    pub async fn read(&self) -> Result<LockGuard> {
        self.read.acquire().await
    }

    /// Waits at most `timeout` for a read. As [`Lock::acquire_timeout`].
    pub async fn read_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        self.read.acquire_timeout(timeout).await
    }

    /// One attempt at a read: `Ok(None)` while a writer holds or waits.
    pub async fn try_read(&self) -> Result<Option<LockGuard>> {
        self.read.try_acquire().await
    }

    /// Waits for the write (or the options' `wait_timeout`). As [`Lock::acquire`].
    pub async fn write(&self) -> Result<LockGuard> {
        self.write.acquire().await
    }

    /// Waits at most `timeout` for the write. As [`Lock::acquire_timeout`].
    pub async fn write_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        self.write.acquire_timeout(timeout).await
    }

    /// One attempt at the write: `Ok(None)` while anyone reads or writes.
    pub async fn try_write(&self) -> Result<Option<LockGuard>> {
        self.write.try_acquire().await
    }

    /// What the store knows now: while reads are held, [`LockInfo::shared_holds`] counts
    /// them; while the write is, [`LockInfo::holder_label`] is its label.
    pub async fn inspect(&self) -> Result<Option<LockInfo>> {
        self.read.inspect().await
    }
}
