//! Per-lock settings: TTL, watchdog, waiting, key prefix.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};

/// The shortest TTL accepted. Below it the validity left after the clock-drift margin
/// (1 % + 2 ms) would be next to nothing.
pub const MIN_TTL: Duration = Duration::from_millis(10);

/// The longest TTL accepted (a year): a lease is meant to run out when its holder dies.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// The longest wait between two checks of a waiting acquire.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(3600);

/// The shortest [watchdog interval](LockOptions::watchdog_interval) and
/// [retry delay](RetryPolicy::min_delay) accepted: below it the watchdog or a waiter would
/// spin (a nanosecond made thousands of rounds a second), and no store answers sooner.
pub const MIN_INTERVAL: Duration = Duration::from_millis(1);

pub(crate) fn check_ttl(ttl: Duration) -> Result<()> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(Error::invalid(format!(
            "ttl must be between {MIN_TTL:?} and {MAX_TTL:?} (a year), got {ttl:?}"
        )));
    }
    Ok(())
}

/// Settings for locks: set defaults on the [`LockManager`](crate::LockManager), override them
/// per lock with [`LockManager::lock_with`](crate::LockManager::lock_with).
///
/// Options are checked when used: an invalid set makes `acquire` return
/// [`Error::InvalidConfig`] saying what is wrong (and [`LockManager::with_options`](crate::LockManager::with_options)
/// checks them up front).
///
/// ```
/// use std::time::Duration;
/// use redlease::LockOptions;
///
/// let opts = LockOptions::new()
///     .ttl(Duration::from_secs(10))                  // lease time on the server
///     .watchdog_interval(Duration::from_secs(2))     // extend every 2 s while held
///     .wait_timeout(Some(Duration::from_secs(5)))    // acquire() gives up after 5 s
///     .key_prefix("myapp:locks:");
/// assert!(opts.validate().is_ok());
/// assert!(LockOptions::new().ttl(Duration::ZERO).validate().is_err());
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LockOptions {
    /// How long a lease lives on the server without being extended; see
    /// [`ttl`](Self::ttl()). Default 30 s.
    pub ttl: Duration,
    /// Whether the shared watchdog keeps held leases alive. Default `true`.
    pub watchdog: bool,
    /// How often the watchdog extends a held lease; `None`: ttl/3. Default `None`.
    pub watchdog_interval: Option<Duration>,
    /// How long [`Lock::acquire`](crate::Lock::acquire) waits; `None`: as long as it takes.
    /// Default `None`.
    pub wait_timeout: Option<Duration>,
    /// How waiters learn that the lock is free. Default [`RetryPolicy::notify`].
    pub retry: RetryPolicy,
    /// Prefix of every key. Default `redlease:`.
    pub key_prefix: Arc<str>,
    /// Whether acquirers are served in arrival order. Default `false`.
    pub fair: bool,
    /// A public description of the holder, kept beside the lease. Default `None`.
    pub holder_label: Option<Arc<str>>,
    /// The longest the watchdog keeps one hold alive; `None`: no cap. Default `None`.
    pub max_hold: Option<Duration>,
}

/// The longest [holder label](LockOptions::holder_label) accepted, in bytes.
pub const MAX_LABEL_LEN: usize = 1024;

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(30),
            watchdog: true,
            watchdog_interval: None,
            wait_timeout: None,
            retry: RetryPolicy::default(),
            key_prefix: "redlease:".into(),
            fair: false,
            holder_label: None,
            max_hold: None,
        }
    }
}

impl LockOptions {
    /// The defaults: ttl 30 s, watchdog on at ttl/3, wait forever, woken on release,
    /// prefix `redlease:`.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a lease lives on the server without being extended. A crashed holder's lock
    /// is free again after at most this long. Defaults to 30 s; from 10 ms to a year.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Whether the shared watchdog keeps held leases alive. Defaults to `true`. With it off,
    /// the guard is lost when its first TTL runs out unless you call
    /// [`LockGuard::extend`](crate::LockGuard::extend).
    pub fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = on;
        self
    }

    /// How often the watchdog extends a held lease. Defaults to ttl/3; must be at least
    /// [`MIN_INTERVAL`] (1 ms) and at most ttl/2, so that a failed extension can be retried
    /// before the lease runs out.
    pub fn watchdog_interval(mut self, interval: Duration) -> Self {
        self.watchdog_interval = Some(interval);
        self
    }

    /// How long [`Lock::acquire`](crate::Lock::acquire) waits before [`Error::Timeout`].
    /// Defaults to `None`: wait as long as it takes.
    pub fn wait_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// How waiters learn that the lock is free. See [`RetryPolicy`].
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Prefix of every key this lock uses. Defaults to `redlease:`. Must not contain `{` or
    /// `}` (the lock name is the key's hash tag).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into().into();
        self
    }

    /// Whether acquirers are served in arrival order (FIFO), across processes. Defaults to
    /// `false`.
    ///
    /// A fair lock's waiters queue on the store; when the lock is released it is handed to
    /// the longest-waiting live waiter, which is woken directly (no herd, no polling
    /// delay). [`try_acquire`](crate::Lock::try_acquire) succeeds only when nobody is queued.
    /// The guard, watchdog, drop release, fencing tokens and cancel safety are the plain
    /// lock's; fair and plain acquirers of one name exclude each other (a plain acquirer
    /// does not queue, so it may take a free lock before the queue's head).
    ///
    /// A waiter re-checks at least every [`RetryPolicy::max_delay`], which keeps it in the
    /// queue; one that stops (a crashed process) is evicted by the store
    /// `2 × max_delay + 100 ms` after it was last heard from. A waiter that gives up (timeout,
    /// dropped future) leaves the queue at once.
    ///
    /// Needs a backend with fair locks ([`RedisBackend`](crate::RedisBackend),
    /// [`MemoryBackend`](crate::MemoryBackend)); with any other the lock (or the manager, for
    /// defaults) is refused when it is made, with [`Error::Unsupported`](crate::Error::Unsupported).
    ///
    /// ```
    /// use redlease::{LockManager, LockOptions, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::with_options(MemoryBackend::new(), LockOptions::new().fair(true))?;
    /// let lock = locks.lock("printer");
    /// assert!(lock.options().fair);
    /// let guard = lock.acquire().await?;
    /// guard.release().await?;
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// A description of the holder (host, pid, task name), stored beside the lease while it
    /// is held, for [`Lock::inspect`](crate::Lock::inspect) and `redlease inspect` to show
    /// who holds a lock. It is public: never put secrets in it. Defaults to none; at most
    /// [`MAX_LABEL_LEN`] bytes. [`host_pid_label`] makes the usual `host:pid`.
    ///
    /// ```
    /// use redlease::{LockManager, LockOptions, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let opts = LockOptions::new().holder_label(redlease::host_pid_label());
    /// let locks = LockManager::with_options(MemoryBackend::new(), opts)?;
    /// let lock = locks.lock("report");
    /// let _held = lock.acquire().await?;
    /// let info = lock.inspect().await?.expect("held");
    /// assert_eq!(info.holder_label.as_deref(), Some(redlease::host_pid_label().as_str()));
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn holder_label(mut self, label: impl Into<String>) -> Self {
        self.holder_label = Some(label.into().into());
        self
    }

    /// The longest the watchdog keeps one hold alive. Once a lease has been held for `d`
    /// (counted from the acquire attempt that won it), the watchdog stops extending it: its
    /// last extension is cut short so that the lease runs out at `d`, the guard turns
    /// [lost](crate::LockGuard::lost), and the lock is free for the next acquirer.
    ///
    /// Why: the watchdog extends a lease as long as the holder's *process* is alive, not as
    /// long as its work makes progress. A holder stuck in a deadlock, an endless retry loop
    /// or a hung call would otherwise keep the lock forever while every other contender
    /// waits. With a cap, a stuck holder costs at most `d`. Set it well above the longest
    /// legitimate hold, and watch [`lost`](crate::LockGuard::lost) in the critical section.
    ///
    /// Defaults to `None` (no cap). Must be at least the ttl (a lease lives one ttl anyway)
    /// and at most [`MAX_TTL`]. The cap covers explicit
    /// [`LockGuard::extend`](crate::LockGuard::extend) calls too: they are cut short to end
    /// at it. It applies to every kind of lock; for a reentrant lock it counts from the hold
    /// that started the reign, and a re-entry made in the last TTL before the cap may keep the
    /// lease on the store up to one TTL past it (the store never shortens a reign's lease,
    /// which other holders of the owner may be extending), while the guards turn lost at the
    /// cap.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::LockOptions;
    /// let opts = LockOptions::new().ttl(Duration::from_secs(10)).max_hold(Duration::from_secs(600));
    /// assert!(opts.validate().is_ok());
    /// assert_eq!(opts.max_hold, Some(Duration::from_secs(600)));
    /// let too_short = LockOptions::new().ttl(Duration::from_secs(10)).max_hold(Duration::from_secs(1));
    /// assert!(too_short.validate().is_err());
    /// ```
    pub fn max_hold(mut self, d: Duration) -> Self {
        self.max_hold = Some(d);
        self
    }

    /// The interval the watchdog uses: the configured one, or ttl/3.
    pub fn effective_watchdog_interval(&self) -> Duration {
        self.watchdog_interval.unwrap_or(self.ttl / 3)
    }

    /// Checks the options, naming the first problem found.
    ///
    /// ```
    /// use std::time::Duration;
    /// let bad = redlease::LockOptions::new()
    ///     .ttl(Duration::from_secs(1))
    ///     .watchdog_interval(Duration::from_secs(1));
    /// let msg = bad.validate().unwrap_err().to_string();
    /// assert!(msg.contains("watchdog interval"), "{msg}");
    /// ```
    pub fn validate(&self) -> Result<()> {
        check_ttl(self.ttl)?;
        if let Some(interval) = self.watchdog_interval {
            if interval < MIN_INTERVAL {
                return Err(Error::invalid(format!(
                    "watchdog interval must be at least {MIN_INTERVAL:?}, got {interval:?}"
                )));
            }
            if interval >= self.ttl {
                return Err(Error::invalid(format!(
                    "watchdog interval {interval:?} must be shorter than the ttl {:?}",
                    self.ttl
                )));
            }
            if interval > self.ttl / 2 {
                return Err(Error::invalid(format!(
                    "watchdog interval {interval:?} must be at most half the ttl {:?}, so that a \
                     failed extension can be retried before the lease runs out",
                    self.ttl
                )));
            }
        }
        if let Some(d) = self.max_hold {
            if d < self.ttl || d > MAX_TTL {
                return Err(Error::invalid(format!(
                    "max_hold {d:?} must be between the ttl {:?} (a lease lives that long \
                     anyway) and {MAX_TTL:?} (a year)",
                    self.ttl
                )));
            }
        }
        if let Some(label) = &self.holder_label {
            if label.len() > MAX_LABEL_LEN {
                return Err(Error::invalid(format!(
                    "holder label is {} bytes long; at most {MAX_LABEL_LEN} are kept",
                    label.len()
                )));
            }
        }
        if self.key_prefix.contains(['{', '}']) {
            return Err(Error::invalid(format!(
                "key prefix {:?} must not contain '{{' or '}}': the lock name is the hash tag",
                self.key_prefix
            )));
        }
        self.retry.validate()
    }
}

/// A holder label naming this process: `<host name>:<process id>`, for
/// [`LockOptions::holder_label`]. The host name is read from the kernel
/// (`/proc/sys/kernel/hostname`, then `/etc/hostname`, then `$HOSTNAME`), or is `unknown`;
/// it reads a small file, so call it once at start-up, not in an async hot path.
///
/// ```
/// let label = redlease::host_pid_label();
/// assert!(label.ends_with(&format!(":{}", std::process::id())));
/// ```
pub fn host_pid_label() -> String {
    let from_file = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    let host = from_file("/proc/sys/kernel/hostname")
        .or_else(|| from_file("/etc/hostname"))
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown".to_owned());
    format!("{host}:{}", std::process::id())
}

/// How a waiting [`acquire`](crate::Lock::acquire) learns that the lock is free.
///
/// The default, [`RetryPolicy::notify`], subscribes to the lock's release channel (pub/sub
/// on Redis, a notify in memory) and is woken by the release itself; as a fallback for a lost
/// wake-up (a reconnect, an expiry with no release) it re-checks after the holder's remaining
/// TTL or `max_delay`, whichever is sooner. [`RetryPolicy::polling`] never subscribes and
/// re-checks with jittered exponential back-off from `min_delay` to `max_delay`.
///
/// ```
/// use std::time::Duration;
/// use redlease::RetryPolicy;
/// let p = RetryPolicy::polling().min_delay(Duration::from_millis(5)).max_delay(Duration::from_millis(200));
/// assert!(redlease::LockOptions::new().retry(p).validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Whether waiters subscribe to releases (`true`) or poll.
    pub notify: bool,
    /// The first back-off delay when polling.
    pub min_delay: Duration,
    /// The longest wait between two checks.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::notify()
    }
}

impl RetryPolicy {
    /// Woken by the release; fallback re-check at most every second (`max_delay`).
    pub fn notify() -> Self {
        RetryPolicy {
            notify: true,
            min_delay: Duration::from_millis(10),
            max_delay: Duration::from_secs(1),
        }
    }

    /// No subscription; poll with back-off from 10 ms to 500 ms (jittered).
    pub fn polling() -> Self {
        RetryPolicy {
            notify: false,
            min_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(500),
        }
    }

    /// First back-off delay when polling. Defaults to 10 ms; at least [`MIN_INTERVAL`].
    pub fn min_delay(mut self, d: Duration) -> Self {
        self.min_delay = d;
        self
    }

    /// Longest wait between two checks (the fallback re-check when notified). At least
    /// [`MIN_INTERVAL`] and at most [`MAX_RETRY_DELAY`].
    ///
    /// A waiting plain lock notified by the store (the write of a [`RwLock`](crate::RwLock)
    /// is one) checks again at least every second whatever this is: each of its attempts
    /// renews its writer preference (new reads of the name wait behind it), which ends
    /// `2 × min(max_delay, 1 s) + 100 ms` after its last attempt. So a writer that dies holds
    /// new readers back for 2.1 s at most, and one that gives up (a wait limit, a dropped
    /// acquire) withdraws its preference at once, waking the readers it held back.
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }

    /// Checks the policy, naming the first problem found.
    pub fn validate(&self) -> Result<()> {
        if self.min_delay < MIN_INTERVAL || self.max_delay < MIN_INTERVAL {
            return Err(Error::invalid(format!(
                "retry delays must be at least {MIN_INTERVAL:?}, got min_delay {:?} and \
                 max_delay {:?}",
                self.min_delay, self.max_delay
            )));
        }
        if self.max_delay > MAX_RETRY_DELAY {
            return Err(Error::invalid(format!(
                "retry max_delay must be at most {MAX_RETRY_DELAY:?}, got {:?}",
                self.max_delay
            )));
        }
        if self.min_delay > self.max_delay {
            return Err(Error::invalid(format!(
                "retry min_delay {:?} is above max_delay {:?}",
                self.min_delay, self.max_delay
            )));
        }
        Ok(())
    }
}
