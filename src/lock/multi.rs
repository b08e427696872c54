//! Locking several names at once: [`MultiLock`] takes its locks in one global order, all or
//! nothing, and hands back one [`MultiGuard`].

use std::fmt;
use std::time::{Duration, Instant};

use super::{Lock, LockManager};
use crate::error::{Error, Result};
use crate::guard::{LockGuard, Lost};

impl LockManager {
    /// The locks `names` taken together, with the manager's default options: see
    /// [`MultiLock`]. Bad names (none at all, an empty one, one key twice) fail the
    /// acquire with [`Error::InvalidConfig`].
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let both = locks.lock_all(["account:1", "account:2"]).acquire().await?;
    /// assert!(locks.lock("account:2").try_acquire().await?.is_none());
    /// assert_eq!(both.guards().len(), 2);
    /// both.release().await?;
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn lock_all<I>(&self, names: I) -> MultiLock
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        MultiLock::of(names.into_iter().map(|n| self.lock(n.as_ref())))
    }
}

/// Several locks held as one: [`acquire`](Self::acquire) returns once it holds all of them,
/// or fails holding none.
///
/// The locks are taken one by one in a fixed global order (by key), whatever order they
/// were named in, so two callers asking for overlapping sets in different orders
/// never deadlock: each waits only for locks after the ones it holds. When one cannot be
/// had (a timeout, an error), the ones already taken are given back before the call
/// returns its error. Dropping the future at any point gives back everything it took, and
/// the attempt in flight is cleaned up as for a single lock.
///
/// The locks may be of any kind and on any manager: reads of a [`RwLock`](crate::RwLock)'s
/// [`reader`](crate::RwLock::reader), a [`Semaphore`](crate::Semaphore)'s
/// [`as_lock`](crate::Semaphore::as_lock), plain locks with options of their own.
///
/// ```
/// use std::time::Duration;
/// use redlease::{LockManager, MemoryBackend, MultiLock};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let config = locks.rw("config")?;
/// let job = MultiLock::of([locks.lock("job:7"), config.reader().clone()]);
/// let held = job.acquire_timeout(Duration::from_secs(1)).await?;
/// assert!(config.try_read().await?.is_some());     // the read is shared
/// assert!(held.get("job:7").is_some());
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone)]
pub struct MultiLock {
    /// In the global order.
    locks: Vec<Lock>,
}

impl fmt::Debug for MultiLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.locks.iter().map(Lock::key))
            .finish()
    }
}

impl MultiLock {
    /// The locks `locks`, held together.
    pub fn of(locks: impl IntoIterator<Item = Lock>) -> MultiLock {
        let mut locks: Vec<Lock> = locks.into_iter().collect();
        locks.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
        MultiLock { locks }
    }

    /// The locks, in the order they are taken.
    pub fn locks(&self) -> &[Lock] {
        &self.locks
    }

    /// Refuses a set that could not be taken: none at all, an empty name, or one key twice
    /// (the same lock would wait for itself; and two stores' locks of one key could not be
    /// put in the same order by every caller).
    fn check(&self) -> Result<()> {
        if self.locks.is_empty() {
            return Err(Error::invalid("a multi-lock needs at least one lock"));
        }
        if self.locks.iter().any(|l| l.name().is_empty()) {
            return Err(Error::invalid("lock name must not be empty"));
        }
        for pair in self.locks.windows(2) {
            if pair[0].key == pair[1].key {
                return Err(Error::invalid(format!(
                    "a multi-lock names the key {} twice: the same lock would wait for itself, \
                     and one key on two stores cannot be ordered alike by every caller \
                     (give one of them another key prefix)",
                    pair[0].key
                )));
            }
        }
        Ok(())
    }

    /// Waits until every lock is held. The wait is limited by the smallest `wait_timeout`
    /// of the locks' options, if any has one. A lock taken early and lost while a later one
    /// was waited for (its store paused past the lease's validity) is not handed out: all are
    /// given back and taken again, within the same limit.
    ///
    /// # Errors
    ///
    /// As [`Lock::acquire`], for the first lock that could not be had; the locks taken
    /// before it are given back first. [`Error::InvalidConfig`] for no locks at all, or one
    /// named twice.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future gives back the locks it holds (in the background) and cleans up
    /// the attempt in flight, as [`Lock::acquire`] does.
    pub async fn acquire(&self) -> Result<MultiGuard> {
        let limit = self
            .locks
            .iter()
            .filter_map(|l| l.options.wait_timeout)
            .min();
        self.take(limit).await
    }

    /// Waits at most `timeout` in all. As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<MultiGuard> {
        self.take(Some(timeout)).await
    }

    /// One attempt at each lock, in order: `Ok(None)` (holding none) as soon as one is held
    /// by someone else, or when a lock taken earlier was lost before the last was taken.
    ///
    /// # Errors
    ///
    /// As [`Lock::try_acquire`]; the locks taken before are given back first.
    pub async fn try_acquire(&self) -> Result<Option<MultiGuard>> {
        self.check()?;
        let mut held = Taken::default();
        for lock in &self.locks {
            match lock.try_acquire().await {
                // A lock taken earlier lost in the meantime: not all of them are held.
                Ok(Some(guard)) if held.any_lost() => {
                    held.0.push(guard);
                    held.give_back().await;
                    return Ok(None);
                }
                Ok(Some(guard)) => held.0.push(guard),
                Ok(None) => {
                    held.give_back().await;
                    return Ok(None);
                }
                Err(e) => {
                    held.give_back().await;
                    return Err(e);
                }
            }
        }
        Ok(Some(MultiGuard::new(std::mem::take(&mut held.0))))
    }

    /// Takes every lock in order. A lock taken early may be lost while a later one is
    /// waited for (its store paused or unreachable past its validity, the watchdog unable to
    /// extend it): then everything is given back and taken again from the first, within the
    /// same limit, so the guard returned never holds a lost lease.
    async fn take(&self, limit: Option<Duration>) -> Result<MultiGuard> {
        self.check()?;
        let deadline = limit.and_then(|d| Instant::now().checked_add(d));
        let mut held = Taken::default();
        'again: loop {
            for lock in &self.locks {
                let taken = match deadline {
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        lock.acquire_timeout(left).await
                    }
                    // No lock has a wait limit of its own.
                    None => lock.acquire().await,
                };
                match taken {
                    Ok(guard) => held.0.push(guard),
                    Err(e) => {
                        held.give_back().await;
                        return Err(e);
                    }
                }
                if held.any_lost() {
                    tracing::debug!(
                        names = self.locks.len(),
                        "a lock taken earlier was lost while a later one was waited for; taking all again"
                    );
                    held.give_back().await;
                    continue 'again;
                }
            }
            return Ok(MultiGuard::new(std::mem::take(&mut held.0)));
        }
    }
}

/// The guards taken so far; dropped (a cancelled acquire), they are released in the
/// background, as any guard.
#[derive(Default)]
struct Taken(Vec<LockGuard>);

impl Taken {
    /// Whether a guard taken so far has been lost.
    fn any_lost(&self) -> bool {
        self.0.iter().any(LockGuard::is_lost)
    }

    /// Releases the guards taken, all at once, before an acquire returns its failure.
    async fn give_back(&mut self) {
        let guards = std::mem::take(&mut self.0);
        futures::future::join_all(guards.into_iter().map(LockGuard::release)).await;
    }
}

/// Several locks held as one, from [`MultiLock`]: dropping it releases all of them (in the
/// background), [`lost`](Self::lost) resolves when any of them is lost.
///
/// ```
/// use redlease::{LockManager, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let held = locks.lock_all(["b", "a"]).acquire().await?;
/// let names: Vec<&str> = held.guards().iter().map(|g| g.name()).collect();
/// assert_eq!(names, ["a", "b"]);                       // in the global order
/// assert!(!held.is_lost());
/// let tokens = held.fencing_tokens();                   // one per lock, same order
/// assert_eq!(tokens.len(), 2);
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[must_use = "if unused the locks are released at once"]
#[derive(Debug)]
pub struct MultiGuard {
    guards: Vec<LockGuard>,
}

impl MultiGuard {
    fn new(guards: Vec<LockGuard>) -> Self {
        MultiGuard { guards }
    }

    /// The guards, in the order the locks were taken.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The guard of the lock `name` (the first, if locks of several stores share it).
    pub fn get(&self, name: &str) -> Option<&LockGuard> {
        self.guards.iter().find(|g| g.name() == name)
    }

    /// Each lock's fencing token, in the order of [`guards`](Self::guards).
    pub fn fencing_tokens(&self) -> Vec<u64> {
        self.guards.iter().map(LockGuard::fencing_token).collect()
    }

    /// Whether any of the locks is lost.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(LockGuard::is_lost)
    }

    /// Resolves when any of the locks is lost (or this guard is gone): stop touching what
    /// they protect.
    pub fn lost(&self) -> Lost {
        Lost::any(self.guards.iter().map(LockGuard::lost).collect())
    }

    /// The guards, to release or keep one by one.
    pub fn into_guards(self) -> Vec<LockGuard> {
        self.guards
    }

    /// Releases every lock now, all at once.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if any of them was lost; otherwise the first store error (each
    /// failed release is tried again in the background, as [`LockGuard::release`] does).
    pub async fn release(self) -> Result<()> {
        let results =
            futures::future::join_all(self.guards.into_iter().map(LockGuard::release)).await;
        let mut first = None;
        for r in results {
            match r {
                Ok(_) => {}
                Err(Error::NotHeld) => return Err(Error::NotHeld),
                Err(e) => first = first.or(Some(e)),
            }
        }
        first.map_or(Ok(()), Err)
    }
}
