//! `LockManager` and `Lock`: naming locks and acquiring them.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future;

use crate::backend::{Acquire, Backend, Subscription, Waiting};
use crate::error::{Error, Result};
use crate::guard::{LockGuard, ReleaseOnDrop};
use crate::inspect::LockInfo;
use crate::options::LockOptions;
use crate::runtime::{self, Rt};
use crate::token::{LeaseKey, Token};
use crate::watchdog::{Watchdog, WatchdogStats};

pub(crate) struct ManagerInner {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) defaults: LockOptions,
    pub(crate) watchdog: Watchdog,
}

/// Hands out [`Lock`]s on one backend, with default [`LockOptions`] and one shared watchdog
/// task that keeps every held lease alive (one batched round trip per tick, however many
/// leases are held).
///
/// Cheap to clone; clones share the backend and the watchdog.
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
/// let reports = locks.lock_with("reports", |o| o.ttl(Duration::from_secs(60)));
/// assert_eq!(reports.options().get_ttl(), Duration::from_secs(60));
/// # let _ = orders; Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockManager {
    inner: Arc<ManagerInner>,
}

impl fmt::Debug for LockManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManager")
            .field("backend", &self.inner.backend)
            .field("defaults", &self.inner.defaults)
            .field("watchdog", &self.inner.watchdog)
            .finish()
    }
}

impl LockManager {
    /// A manager with default options.
    pub fn new(backend: impl Backend) -> Self {
        Self::build(Arc::new(backend), LockOptions::default())
    }

    /// A manager with the given defaults, checked now.
    pub fn with_options(backend: impl Backend, defaults: LockOptions) -> Result<Self> {
        Self::shared(Arc::new(backend), defaults)
    }

    /// Like [`with_options`](Self::with_options), for a backend that is already shared.
    pub fn shared(backend: Arc<dyn Backend>, defaults: LockOptions) -> Result<Self> {
        defaults.validate()?;
        Ok(Self::build(backend, defaults))
    }

    fn build(backend: Arc<dyn Backend>, defaults: LockOptions) -> Self {
        LockManager {
            inner: Arc::new(ManagerInner {
                watchdog: Watchdog::new(backend.clone()),
                backend,
                defaults,
            }),
        }
    }

    /// A handle on the lock `name`, with the manager's default options. Any non-empty
    /// string is a valid name (an empty one makes `acquire` fail with
    /// [`Error::InvalidConfig`]).
    pub fn lock(&self, name: &str) -> Lock {
        self.lock_with(name, |o| o)
    }

    /// A handle with options derived from the manager's defaults.
    pub fn lock_with(&self, name: &str, options: impl FnOnce(LockOptions) -> LockOptions) -> Lock {
        let options = options(self.inner.defaults.clone());
        Lock {
            manager: self.inner.clone(),
            key: LeaseKey::new(&options.key_prefix, name),
            name: name.into(),
            options,
        }
    }

    /// The default options.
    pub fn options(&self) -> &LockOptions {
        &self.inner.defaults
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// Counters of the shared watchdog (leases kept alive, batched round trips).
    pub fn watchdog_stats(&self) -> WatchdogStats {
        self.inner.watchdog.stats()
    }
}

/// A named lock. Cheap to clone; `Send + Sync`. Acquiring returns a [`LockGuard`].
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
    pub(crate) manager: Arc<ManagerInner>,
    pub(crate) name: Arc<str>,
    key: LeaseKey,
    pub(crate) options: LockOptions,
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("key", &self.key)
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

    /// The same lock, served in arrival order: shorthand for
    /// `options.fair(true)` (see [`LockOptions::fair`]).
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let lock = locks.lock("queue:emails").fair();
    /// let held = lock.acquire().await?;
    /// assert!(lock.try_acquire().await?.is_none());
    /// held.release().await?;
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn fair(mut self) -> Lock {
        self.options.fair = true;
        self
    }

    /// Waits until the lock is ours (or the options' `wait_timeout` passes).
    ///
    /// Waiters are woken by the holder's release (pub/sub on Redis), with a bounded fallback
    /// re-check; see [`RetryPolicy`](crate::RetryPolicy). A [fair](LockOptions::fair) lock
    /// serves waiters in arrival order.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after `wait_timeout`; [`Error::InvalidConfig`] for an empty name or
    /// invalid options; [`Error::Backend`] if the store fails.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any point leaves no lease behind: if an attempt may have
    /// reached the store, a compare-and-delete for its token is run in the background.
    pub async fn acquire(&self) -> Result<LockGuard> {
        self.observed(Some(self.options.wait_timeout))
            .await?
            .ok_or(Error::NotHeld)
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
        self.observed(Some(Some(timeout)))
            .await?
            .ok_or(Error::NotHeld)
    }

    /// One attempt: `Ok(None)` if someone else holds the lock.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        self.observed(None).await
    }

    /// [`run`](Self::run) in a `redlease.acquire` span that records the outcome and the
    /// wait, and counted in the metrics.
    async fn observed(&self, wait: Option<Option<Duration>>) -> Result<Option<LockGuard>> {
        use tracing::field::Empty;
        use tracing::Instrument;
        let span = tracing::debug_span!(
            "redlease.acquire",
            key = %self.key,
            fair = self.options.fair,
            outcome = Empty,
            waited_ms = Empty,
            fencing_token = Empty,
        );
        let began = Instant::now();
        let result = self.run(wait).instrument(span.clone()).await;
        let waited = began.elapsed();
        let outcome = match &result {
            Ok(Some(guard)) => {
                span.record("fencing_token", guard.fencing_token());
                "acquired"
            }
            Ok(None) => "busy",
            Err(Error::Timeout { .. }) => "timeout",
            Err(_) => "error",
        };
        span.record("outcome", outcome);
        span.record(
            "waited_ms",
            u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
        );
        crate::telemetry::acquire(outcome, waited);
        result
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
    /// [`Error::InvalidConfig`] for an empty name or a backend that cannot inspect;
    /// [`Error::Backend`] if the store fails.
    pub async fn inspect(&self) -> Result<Option<LockInfo>> {
        if self.name.is_empty() {
            return Err(Error::invalid("lock name must not be empty"));
        }
        self.manager.backend.inspect(&self.key).await
    }

    fn check(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::invalid("lock name must not be empty"));
        }
        self.options.validate()
    }

    /// The acquire loop. `wait`: `None` = one attempt; `Some(limit)` = wait, up to `limit`.
    async fn run(&self, wait: Option<Option<Duration>>) -> Result<Option<LockGuard>> {
        self.check()?;
        if self.options.fair {
            // Boxed: inline, its state would add to every acquire future's size, plain ones
            // included (a caller's block_on runs them on its own thread's stack).
            return Box::pin(crate::fair::run(self, wait)).await;
        }
        let opts = &self.options;
        let began = Instant::now();
        // A limit too far to represent (Duration::MAX) means no limit.
        let deadline = wait.flatten().and_then(|d| began.checked_add(d));
        let timeout = || Error::Timeout {
            waited: began.elapsed(),
        };
        let mut pending = ReleaseOnDrop {
            backend: self.manager.backend.clone(),
            key: self.key.clone(),
            token: Token::random().with_label(opts.holder_label.clone()),
            rt: Rt::current(),
            armed: false,
            confirmed: false,
        };
        let notify = wait.is_some() && opts.retry.notify;
        let recheck = opts.retry.max_delay;
        let mut sub: Option<Subscription> = None;
        let mut pauses = Pauses::new(&opts.retry, notify);
        // A waiting acquire's first attempt yields to the waiters already there; later ones
        // compete as a waiter.
        let mut arriving = true;
        loop {
            let woken = sub.as_ref().map(Subscription::listen);
            let started = Instant::now();
            // From here until a definite answer, the attempt may hold the lease.
            pending.armed = true;
            let waiting = match (notify, arriving) {
                (false, _) => Waiting::No,
                (true, true) => Waiting::Arriving { recheck },
                (true, false) => Waiting::Waiting { recheck },
            };
            let attempt = pending
                .backend
                .try_acquire(&self.key, &pending.token, opts.ttl, waiting);
            // The first attempt always gets its answer (bounded by the store's own
            // timeouts), so that a zero or tiny wait still takes a free lock.
            let limit = if arriving { None } else { deadline };
            let outcome = runtime::until(limit, attempt).await.ok_or_else(timeout)??;
            let round_trip = started.elapsed();
            let remaining = match outcome {
                Acquire::Acquired {
                    fencing_token,
                    validity,
                } => {
                    tracing::debug!(key = %self.key, fencing_token, waited = ?began.elapsed(), "acquired");
                    return Ok(Some(LockGuard::new(
                        self,
                        fencing_token,
                        started,
                        validity,
                        pending,
                    )));
                }
                Acquire::Held { remaining } => {
                    crate::telemetry::contended();
                    remaining
                }
                // Only a quorum member answers this, and only to `try_acquire_node`.
                Acquire::Warming { remaining } => Some(remaining),
            };
            // A first attempt turned away from a free lock: it yielded to registered waiters.
            let yielded = arriving && remaining.is_none();
            arriving = false;
            pending.armed = false;
            if wait.is_none() {
                return Ok(None);
            }
            let mut woken = woken;
            let mut remaining = remaining;
            if notify && sub.is_none() {
                // Subscribe, then check again: a release that came before the subscription
                // was confirmed is seen by that check.
                let subscribed = self.manager.backend.subscribe(&self.key);
                let subscribed = runtime::until(deadline, subscribed)
                    .await
                    .ok_or_else(timeout)??;
                if !yielded {
                    sub = Some(subscribed);
                    continue;
                }
                // The lock was free, and the waiters the release woke are on their way to
                // it: check again after they have had two of our round trips and a
                // millisecond to take it, or at the next release. Checking at once would race
                // them, and a holder that releases and acquires again would mostly win its
                // lock back (a flag left by waiters that have gone costs this short pause,
                // not a fallback re-check's whole second).
                woken = Some(subscribed.listen());
                sub = Some(subscribed);
                remaining = Some(round_trip.saturating_mul(2));
            }
            // The holder's lease runs out after `remaining` (a crashed holder never
            // publishes): the pause is no longer than that.
            if !pauses.wait(woken, remaining, deadline).await {
                return Err(timeout());
            }
        }
    }
}

/// The waits between a waiting acquire's attempts: until a wake-up (a release or hand-off)
/// or a pause, whichever comes first. With wake-ups the pause is a fallback re-check at
/// most every `max_delay`; without (polling) it grows from `min_delay` to `max_delay`. Either
/// way it is jittered, and no longer than what the store said is left of the holder's lease.
pub(crate) struct Pauses {
    notify: bool,
    next: Duration,
    max: Duration,
}

impl Pauses {
    pub(crate) fn new(retry: &crate::RetryPolicy, notify: bool) -> Self {
        Pauses {
            notify,
            next: retry.min_delay,
            max: retry.max_delay,
        }
    }

    /// Waits for `woken` or the next pause (at most `remaining` + 1 ms); `false` if
    /// `deadline` came first.
    pub(crate) async fn wait(
        &mut self,
        woken: Option<crate::backend::Released>,
        remaining: Option<Duration>,
        deadline: Option<Instant>,
    ) -> bool {
        let mut pause = if self.notify {
            jitter(self.max, 0.8)
        } else {
            let p = jitter(self.next, 0.5);
            self.next = self.next.saturating_mul(2).min(self.max);
            p
        };
        if let Some(r) = remaining {
            pause = pause.min(r + Duration::from_millis(1));
        }
        let sleep = std::pin::pin!(runtime::sleep(pause));
        match woken {
            Some(w) => runtime::until(deadline, future::select(w, sleep))
                .await
                .is_some(),
            None => runtime::until(deadline, sleep).await.is_some(),
        }
    }
}

/// `d` scaled by a random factor in `[low, 1]`, so waiters do not retry in lockstep.
pub(crate) fn jitter(d: Duration, low: f64) -> Duration {
    d.mul_f64(rand::random_range(low..=1.0))
}
