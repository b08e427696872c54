//! `Cache`: compute a missing or expiring value once, across processes (cache-stampede
//! protection on top of [`Lock`]).

use std::any::{Any, TypeId};
use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use event_listener::Event;
use futures::future::{self, BoxFuture};
use futures::FutureExt;

use crate::backend::values::{Cached, Failure, Fill, Read, ValueStore};
use crate::backend::{MemoryBackend, RedisBackend, Subscription};
use crate::error::{Error, Result};
use crate::guard::LockGuard;
use crate::lock::{Lock, LockManager};
use crate::options::{LockOptions, MAX_TTL};
use crate::runtime::{self, Rt};
use crate::token::LeaseKey;

mod memory;

use memory::MemoryStore;

/// The largest factor `-ln(u)` may reach in XFetch's early-refresh test: a very small random
/// draw would otherwise refresh absurdly early (the Internet Archive harness' lesson).
const XFETCH_CAP: f64 = 14.0;

/// After a background refresh failed, no other starts for this long (or the lease TTL, if
/// shorter): with the origin down in the stale window, flights serve the stale value instead
/// of each starting a refresh.
const REFRESH_COOLDOWN: Duration = Duration::from_secs(1);

/// Settings of a [`Cache`]; every setter says its default.
///
/// ```
/// use std::time::Duration;
/// use redlease::{Cache, CacheOptions, MemoryBackend};
/// # fn main() -> redlease::Result<()> {
/// let options = CacheOptions::new()
///     .stale_while_revalidate(Duration::from_secs(30))
///     .wait_timeout(Duration::from_secs(2));
/// let cache = Cache::with_options(MemoryBackend::new(), options)?;
/// # let _ = cache; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CacheOptions {
    key_prefix: Arc<str>,
    lease_ttl: Duration,
    compute_timeout: Duration,
    wait_timeout: Duration,
    stale_while_revalidate: Option<Duration>,
    xfetch_beta: Option<f64>,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            key_prefix: "redlease:cache:".into(),
            lease_ttl: Duration::from_secs(10),
            compute_timeout: Duration::from_secs(60),
            wait_timeout: Duration::from_secs(30),
            stale_while_revalidate: None,
            xfetch_beta: None,
        }
    }
}

impl CacheOptions {
    /// The longest [`compute_timeout`](Self::compute_timeout) and
    /// [`wait_timeout`](Self::wait_timeout): a year, as [`MAX_TTL`]. Longer ones are
    /// [`Error::InvalidConfig`], never "no limit".
    ///
    /// ```
    /// use redlease::CacheOptions;
    /// let never = CacheOptions::new().compute_timeout(std::time::Duration::MAX);
    /// assert!(matches!(never.validate(), Err(redlease::Error::InvalidConfig(_))));
    /// assert!(CacheOptions::new().compute_timeout(CacheOptions::MAX_TIMEOUT).validate().is_ok());
    /// ```
    pub const MAX_TIMEOUT: Duration = MAX_TTL;

    /// The shortest [`stale_while_revalidate`](Self::stale_while_revalidate) window (the
    /// store keeps it in whole milliseconds; a shorter one would be stored as none).
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::CacheOptions;
    /// let tiny = CacheOptions::new().stale_while_revalidate(Duration::from_micros(500));
    /// assert!(matches!(tiny.validate(), Err(redlease::Error::InvalidConfig(_))));
    /// ```
    pub const MIN_STALE_WINDOW: Duration = Duration::from_millis(1);

    /// The defaults.
    ///
    /// ```
    /// let options = redlease::CacheOptions::new();
    /// assert!(options.validate().is_ok());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Prefix of every key the cache writes (the value, the compute lease and its derived
    /// keys: `<prefix>{<key>}:value` and so on). Defaults to `redlease:cache:`, apart from
    /// the locks' `redlease:`, so a cache key never collides with a lock of the same name.
    /// Braces are refused ([`Error::InvalidConfig`]): the key's hash tag is the cache key.
    ///
    /// ```
    /// let options = redlease::CacheOptions::new().key_prefix("shop:cache:");
    /// assert!(options.validate().is_ok());
    /// assert!(redlease::CacheOptions::new().key_prefix("a{b").validate().is_err());
    /// ```
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into().into();
        self
    }

    /// TTL of the compute lease. The watchdog keeps it alive while the loader runs; if the
    /// loader's process dies, another caller takes over within this time. Defaults to 10 s;
    /// [`MIN_TTL`](crate::MIN_TTL) to [`MAX_TTL`] as for any lease. It also bounds the
    /// cooldown after a failed background refresh (at most 1 s).
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = redlease::CacheOptions::new().lease_ttl(Duration::from_secs(3));
    /// assert!(options.validate().is_ok());
    /// ```
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How long a loader may run. Past it the loader is dropped (cancelled), the lease is
    /// released, and the round fails with [`Error::Timeout`]: a hung loader never wedges a
    /// key. Defaults to 60 s; at most [`MAX_TIMEOUT`](Self::MAX_TIMEOUT).
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = redlease::CacheOptions::new().compute_timeout(Duration::from_secs(5));
    /// assert!(options.validate().is_ok());
    /// ```
    pub fn compute_timeout(mut self, timeout: Duration) -> Self {
        self.compute_timeout = timeout;
        self
    }

    /// How long a caller waits for a value being computed (here or in another process)
    /// before it gets [`Error::Timeout`]. The computation goes on and still fills the cache.
    /// Transient store errors while waiting are retried (with back-off) within this time.
    /// Defaults to 30 s; at most [`MAX_TIMEOUT`](Self::MAX_TIMEOUT).
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = redlease::CacheOptions::new().wait_timeout(Duration::from_millis(500));
    /// assert!(options.validate().is_ok());
    /// ```
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// Stale-while-revalidate: keep a value `window` past its ttl. In that window callers
    /// get the stale value at once, and one caller (across all processes) refreshes it in
    /// the background. If that refresh fails, the stale value stays and no refresh starts
    /// for a cooldown of `min(lease_ttl, 1 s)`, so a down origin is tried about once a
    /// second, not once per flight. Off by default; the window is
    /// [`MIN_STALE_WINDOW`](Self::MIN_STALE_WINDOW) to [`MAX_TTL`].
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = redlease::CacheOptions::new().stale_while_revalidate(Duration::from_secs(60));
    /// assert!(options.validate().is_ok());
    /// ```
    pub fn stale_while_revalidate(mut self, window: Duration) -> Self {
        self.stale_while_revalidate = Some(window);
        self
    }

    /// Probabilistic early refresh (XFetch, Vattani et al., VLDB 2015) with factor `beta`
    /// (1.0 is the paper's choice; larger refreshes earlier). A caller that reads a fresh
    /// value refreshes it in the background, while still returning it, when
    /// `delta · beta · −ln(rand)` reaches the value's remaining fresh time, `delta` being
    /// the measured duration of the last compute. The remaining time is the server's PTTL,
    /// read with the value, so client clocks are never compared.
    ///
    /// `−ln(rand)` is capped at 14 (`XFETCH_CAP`): a draw that small (one in about 1.2
    /// million) would otherwise refresh absurdly early, so a value is never refreshed more
    /// than `14 · beta · delta` before its fresh time ends. A refresh that failed lately (see
    /// [`stale_while_revalidate`](Self::stale_while_revalidate)) holds XFetch off too.
    /// `beta` must be finite and above 0. Off by default.
    ///
    /// ```
    /// let options = redlease::CacheOptions::new().xfetch(1.0);
    /// assert!(options.validate().is_ok());
    /// ```
    pub fn xfetch(mut self, beta: f64) -> Self {
        self.xfetch_beta = Some(beta);
        self
    }

    /// Checks the options; [`Error::InvalidConfig`] says what is wrong.
    ///
    /// ```
    /// use std::time::Duration;
    /// let bad = redlease::CacheOptions::new().xfetch(-1.0);
    /// assert!(matches!(bad.validate(), Err(redlease::Error::InvalidConfig(_))));
    /// ```
    pub fn validate(&self) -> Result<()> {
        self.lock_options().validate()?;
        // Past the maxima a deadline is unrepresentable and would silently mean "none":
        // a hung loader would then wedge a key after all.
        for (what, d) in [
            ("compute_timeout", self.compute_timeout),
            ("wait_timeout", self.wait_timeout),
        ] {
            if d.is_zero() || d > Self::MAX_TIMEOUT {
                return Err(Error::invalid(format!(
                    "{what} must be in (0, {max:?}] (a year), got {d:?}",
                    max = Self::MAX_TIMEOUT
                )));
            }
        }
        if let Some(window) = self.stale_while_revalidate {
            // Stored in whole milliseconds: a shorter window would be stored as 0 (off).
            if window < Self::MIN_STALE_WINDOW || window > MAX_TTL {
                return Err(Error::invalid(format!(
                    "stale_while_revalidate window must be in [{min:?}, {MAX_TTL:?}], got \
                     {window:?}",
                    min = Self::MIN_STALE_WINDOW
                )));
            }
        }
        if let Some(beta) = self.xfetch_beta {
            if !(beta.is_finite() && beta > 0.0) {
                return Err(Error::invalid(format!(
                    "xfetch beta must be a finite number above 0, got {beta}"
                )));
            }
        }
        Ok(())
    }

    fn lock_options(&self) -> LockOptions {
        LockOptions::new()
            .ttl(self.lease_ttl)
            .key_prefix(&*self.key_prefix)
    }

    fn grace(&self) -> Duration {
        self.stale_while_revalidate.unwrap_or_default()
    }
}

mod sealed {
    /// Where a cache keeps its values; opaque outside the crate.
    #[derive(Debug)]
    pub struct StoreHandle(pub(super) std::sync::Arc<dyn super::ValueStore>);

    pub trait Sealed {
        fn into_store(self) -> StoreHandle;
    }
}

/// A backend a [`Cache`] can keep values in: [`RedisBackend`], `EtcdBackend` (feature
/// `etcd`) or `PostgresBackend` (feature `postgres`), across processes, or [`MemoryBackend`]
/// (one process). Sealed: the cache needs a fenced write and fill notifications, which the
/// [`Backend`](crate::Backend) trait does not have.
///
/// ```
/// use redlease::{Cache, CacheBackend, MemoryBackend};
/// // Generic over where the values live.
/// fn page_cache(backend: impl CacheBackend) -> Cache {
///     Cache::new(backend)
/// }
/// let cache = page_cache(MemoryBackend::new());
/// # let _ = cache;
/// ```
pub trait CacheBackend: sealed::Sealed {}

impl sealed::Sealed for RedisBackend {
    fn into_store(self) -> sealed::StoreHandle {
        sealed::StoreHandle(Arc::new(self.values()))
    }
}
impl CacheBackend for RedisBackend {}

impl sealed::Sealed for MemoryBackend {
    fn into_store(self) -> sealed::StoreHandle {
        sealed::StoreHandle(Arc::new(MemoryStore::new(self)))
    }
}
impl CacheBackend for MemoryBackend {}

#[cfg(feature = "etcd")]
impl sealed::Sealed for crate::backend::EtcdBackend {
    fn into_store(self) -> sealed::StoreHandle {
        sealed::StoreHandle(Arc::new(self.values()))
    }
}
#[cfg(feature = "etcd")]
impl CacheBackend for crate::backend::EtcdBackend {}

#[cfg(feature = "postgres")]
impl sealed::Sealed for crate::backend::PostgresBackend {
    fn into_store(self) -> sealed::StoreHandle {
        sealed::StoreHandle(Arc::new(self.values()))
    }
}
#[cfg(feature = "postgres")]
impl CacheBackend for crate::backend::PostgresBackend {}

/// Counters of one [`Cache`] (this process only), from [`Cache::stats`].
///
/// ```
/// use std::time::Duration;
/// # futures::executor::block_on(async {
/// let cache = redlease::Cache::new(redlease::MemoryBackend::new());
/// cache.get_with("k", Duration::from_secs(5), || async { "v" }).await?;
/// let stats: redlease::CacheStats = cache.stats();
/// assert_eq!((stats.calls, stats.loads, stats.coalesced), (1, 1, 0));
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Calls of `get_with` and friends.
    pub calls: u64,
    /// Calls that joined a flight already under way in this process (no Redis call of
    /// their own).
    pub coalesced: u64,
    /// Loader runs started in this process (origin calls).
    pub loads: u64,
    /// Flights answered with a stale value (stale-while-revalidate) or an early-refreshed
    /// one (XFetch) while a refresh was started.
    pub served_stale: u64,
    /// Background refreshes this process ran the loader for.
    pub refreshes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    calls: AtomicU64,
    coalesced: AtomicU64,
    loads: AtomicU64,
    served_stale: AtomicU64,
    refreshes: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Computes a missing or expiring value once while every other caller waits for it, in
/// this process and in any other that uses the same Redis: cache-stampede protection.
///
/// A value lives at `<prefix>{<key>}:value`. On a miss, callers in one process share one
/// flight (one Redis round trip); across processes one of them takes the *compute lease*
/// (an ordinary lease of this crate, kept alive by the watchdog) and runs its loader; the
/// others wait for a pub/sub message on `<prefix>{<key>}:filled` and read the value then.
/// The write is fenced by the lease: a loader that outlived its lease cannot overwrite a
/// newer value.
///
/// A loader that panics, fails or runs past [`CacheOptions::compute_timeout`] frees the key
/// at once; one whose process dies frees it within [`CacheOptions::lease_ttl`].
///
/// # Which runtime a loader runs on
///
/// The flight (the read, the wait, the loader and any background refresh) is spawned on
/// the runtime of the caller that started it: the caller's tokio runtime if it runs in one,
/// else smol's or async-std's executor when those features are on. It runs detached there,
/// so a caller's timeout or drop ends only its own wait, and the value still fills the
/// cache.
///
/// With only the `tokio` feature and a caller outside any runtime (say
/// `futures::executor::block_on`), there is nothing to spawn on: the flight then runs
/// inside the callers' own futures, on their threads, in a tokio context so tokio timers
/// work. It is never put on the crate's private runtime, whose one thread runs the watchdog
/// and pub/sub handlers of every lease in the process. The caller that started such a
/// flight drives it to its end (a background refresh included, within its `wait_timeout`);
/// the others return as soon as the value is there. When all of its callers have left
/// (timed out or dropped), the flight is cancelled: its lease is released and other
/// processes are told, and the next call starts again.
///
/// Cheap to clone; clones share flights and counters.
///
/// ```
/// use std::time::Duration;
/// use redlease::{Cache, MemoryBackend};
/// # futures::executor::block_on(async {
/// // With Redis: Cache::new(RedisBackend::connect("redis://127.0.0.1:6379").await?)
/// let cache = Cache::new(MemoryBackend::new());
/// let ttl = Duration::from_secs(60);
/// let page = cache.get_with("page:/home", ttl, || async { "<h1>home</h1>" }).await?;
/// assert_eq!(&page[..], b"<h1>home</h1>");
/// // Cached now: this loader is not called.
/// let again = cache.get_with("page:/home", ttl, || async { "unused" }).await?;
/// assert_eq!(again, page);
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
///
/// # Concurrent calls on the same key
///
/// Only one loader runs per key and round; the loaders of the other callers are dropped
/// unused. Flights are keyed by key and, for [`try_get_with`](Self::try_get_with), by the
/// error type (as moka does), so each caller gets its own error type back.
#[derive(Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

type FlightKey = (String, TypeId);

struct Inner {
    store: Arc<dyn ValueStore>,
    locks: LockManager,
    options: CacheOptions,
    flights: Mutex<HashMap<FlightKey, Arc<Flight>>>,
    refreshing: Mutex<HashSet<String>>,
    stats: Counters,
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("store", &self.inner.store)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is one insert or remove: a poisoned lock is consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A loader's failure as the flight carries it: the error itself (for callers in this
/// process, as `Arc<E>`) and its message (for callers in other processes).
struct LoadError {
    error: Arc<dyn Any + Send + Sync>,
    message: String,
}

type Loader = Box<dyn FnOnce() -> BoxFuture<'static, Result<Bytes, LoadError>> + Send>;

/// What every caller of a flight gets.
#[derive(Clone)]
enum Outcome {
    Value(Bytes),
    Loader(Arc<dyn Any + Send + Sync>),
    Failed(Arc<Error>),
}

/// Why a call did not return a value.
enum Fail {
    Loader(Arc<dyn Any + Send + Sync>),
    Cache(Error),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Cache(e)
    }
}

/// One in-process computation or read of a key, shared by its callers.
struct Flight {
    outcome: OnceLock<Outcome>,
    done: Event,
    callers: AtomicUsize,
    gone: Event,
    /// With no runtime to spawn on, the flight's future, driven by its callers (each holds
    /// a strong clone; this weak one lets later callers join). Unset when it was spawned.
    driver: OnceLock<WeakDriver>,
}

/// A flight's future driven by its callers (see [`caller_runtime`]).
type Driver = future::Shared<BoxFuture<'static, ()>>;
type WeakDriver = future::WeakShared<BoxFuture<'static, ()>>;

/// The runtime to run a flight on: the caller's. `None` when the caller runs none that the
/// crate can spawn on (only the `tokio` feature, called from `futures::executor::block_on`
/// or the like): the flight is then driven inside the callers' own futures, never on the
/// crate's private runtime, whose one thread runs the watchdog and pub/sub handlers of every
/// lease in the process and must not run user code.
fn caller_runtime() -> Option<Rt> {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        return Some(Rt::Tokio(handle));
    }
    #[cfg(any(feature = "smol", feature = "async-std"))]
    {
        Some(Rt::current())
    }
    #[cfg(not(any(feature = "smol", feature = "async-std")))]
    {
        None
    }
}

impl Flight {
    async fn wait(&self) -> Outcome {
        loop {
            if let Some(o) = self.outcome.get() {
                return o.clone();
            }
            let listener = self.done.listen();
            if let Some(o) = self.outcome.get() {
                return o.clone();
            }
            listener.await;
        }
    }
}

/// A caller's place in a flight; leaving (done, timed out or dropped) takes it back.
struct Ticket(Arc<Flight>);

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.0.callers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.gone.notify(usize::MAX);
        }
    }
}

/// A shared error handed to one more caller: the same variant, the backend's source shared.
fn duplicate(e: &Arc<Error>) -> Error {
    e.copied()
        .unwrap_or_else(|| Error::backend(SharedError(e.clone())))
}

/// A backend error shared by every caller of a flight.
struct SharedError(Arc<Error>);

impl fmt::Debug for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.0 {
            Error::Backend { source } => fmt::Display::fmt(source, f),
            other => fmt::Display::fmt(other, f),
        }
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &*self.0 {
            Error::Backend { source } => source.source(),
            _ => None,
        }
    }
}

impl Cache {
    /// A cache with default [`CacheOptions`] over `backend`.
    pub fn new(backend: impl CacheBackend) -> Self {
        Self::build(backend.into_store().0, CacheOptions::default())
            .expect("the default cache options are valid")
    }

    /// A cache with the given options, checked now.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redlease::{Cache, CacheOptions, MemoryBackend};
    /// let options = CacheOptions::new().xfetch(1.0).lease_ttl(Duration::from_secs(5));
    /// let cache = Cache::with_options(MemoryBackend::new(), options)?;
    /// // Refused at once, not at the first call:
    /// let bad = CacheOptions::new().wait_timeout(Duration::ZERO);
    /// assert!(Cache::with_options(MemoryBackend::new(), bad).is_err());
    /// # let _ = cache; Ok::<(), redlease::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for invalid options.
    pub fn with_options(backend: impl CacheBackend, options: CacheOptions) -> Result<Self> {
        Self::build(backend.into_store().0, options)
    }

    fn build(store: Arc<dyn ValueStore>, options: CacheOptions) -> Result<Self> {
        options.validate()?;
        let locks = LockManager::over(store.backend(), options.lock_options())?;
        Ok(Cache {
            inner: Arc::new(Inner {
                store,
                locks,
                options,
                flights: Mutex::default(),
                refreshing: Mutex::default(),
                stats: Counters::default(),
            }),
        })
    }

    /// The options.
    ///
    /// ```
    /// use redlease::{Cache, CacheOptions, MemoryBackend};
    /// let cache = Cache::with_options(MemoryBackend::new(), CacheOptions::new().xfetch(2.0))?;
    /// // Another cache with the same settings:
    /// let twin = Cache::with_options(MemoryBackend::new(), cache.options().clone())?;
    /// # let _ = twin; Ok::<(), redlease::Error>(())
    /// ```
    pub fn options(&self) -> &CacheOptions {
        &self.inner.options
    }

    /// This process' counters for this cache (and its clones).
    ///
    /// ```
    /// use std::time::Duration;
    /// # futures::executor::block_on(async {
    /// let cache = redlease::Cache::new(redlease::MemoryBackend::new());
    /// cache.get_with("k", Duration::from_secs(5), || async { "v" }).await?;
    /// cache.get_with("k", Duration::from_secs(5), || async { "w" }).await?;
    /// assert_eq!(cache.stats().loads, 1);
    /// assert_eq!(cache.stats().calls, 2);
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn stats(&self) -> CacheStats {
        let s = &self.inner.stats;
        CacheStats {
            calls: s.calls.load(Ordering::Relaxed),
            coalesced: s.coalesced.load(Ordering::Relaxed),
            loads: s.loads.load(Ordering::Relaxed),
            served_stale: s.served_stale.load(Ordering::Relaxed),
            refreshes: s.refreshes.load(Ordering::Relaxed),
        }
    }

    /// The value of `key`, or the one `loader` computes when it is missing: computed once
    /// across every caller of this key, in this process and in every other on the same
    /// store, while the others wait for it. The value is kept `ttl` (plus the
    /// stale-while-revalidate window, if set).
    ///
    /// `loader` is called at most once, and only by the caller whose flight took the
    /// compute lease; it runs detached, so it must be `Send + 'static`.
    ///
    /// ```
    /// use std::time::Duration;
    /// # futures::executor::block_on(async {
    /// let cache = redlease::Cache::new(redlease::MemoryBackend::new());
    /// let v = cache
    ///     .get_with("user:42", Duration::from_secs(30), || async { b"Ada".to_vec() })
    ///     .await?;
    /// assert_eq!(&v[..], b"Ada");
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after [`CacheOptions::wait_timeout`] (the compute goes on), or when
    /// the loader ran past [`CacheOptions::compute_timeout`]; [`Error::LoadFailed`] if the
    /// loader panicked; [`Error::InvalidConfig`] for an empty key or a ttl out of range;
    /// [`Error::Backend`] if the store failed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future ends only this caller's wait: a loader already started runs to
    /// its end and fills the cache for the next caller.
    pub async fn get_with<F, Fut, V>(&self, key: &str, ttl: Duration, loader: F) -> Result<Bytes>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = V> + Send + 'static,
        V: Into<Bytes>,
    {
        let load: Loader = Box::new(move || Box::pin(async move { Ok(loader().await.into()) }));
        match self.fetch(key, ttl, TypeId::of::<Infallible>(), load).await {
            Ok(bytes) => Ok(bytes),
            Err(Fail::Cache(e)) => Err(e),
            Err(Fail::Loader(_)) => Err(Error::LoadFailed {
                message: "an infallible loader reported an error".into(),
            }),
        }
    }

    /// Like [`get_with`](Self::get_with) for a loader that can fail. A failure is not
    /// cached: every caller waiting on that round gets it (callers in this process share one
    /// `Arc<E>`; callers in other processes get `E::from(Error::LoadFailed { message })`
    /// with the error's `Display` text), and the next call runs a loader again. Errors of
    /// the cache itself (timeouts, Redis) arrive as `E::from(Error)`.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// enum AppError {
    ///     #[error("database: {0}")]
    ///     Db(String),
    ///     #[error(transparent)]
    ///     Cache(#[from] redlease::Error),
    /// }
    ///
    /// # futures::executor::block_on(async {
    /// let cache = redlease::Cache::new(redlease::MemoryBackend::new());
    /// let ttl = Duration::from_secs(30);
    /// let err = cache
    ///     .try_get_with("q", ttl, || async { Err::<Vec<u8>, _>(AppError::Db("down".into())) })
    ///     .await
    ///     .unwrap_err();
    /// assert!(matches!(&*err, AppError::Db(_)));
    /// // Not cached: the next call runs its loader.
    /// let ok = cache.try_get_with("q", ttl, || async { Ok::<_, AppError>("rows") }).await?;
    /// assert_eq!(&ok[..], b"rows");
    /// # Ok::<(), Arc<AppError>>(()) }).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// The loader's error as `Arc<E>`; the cache's errors (see
    /// [`get_with`](Self::get_with)) converted with `E::from`.
    ///
    /// # Cancel safety
    ///
    /// As [`get_with`](Self::get_with).
    pub async fn try_get_with<F, Fut, V, E>(
        &self,
        key: &str,
        ttl: Duration,
        loader: F,
    ) -> Result<Bytes, Arc<E>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<V, E>> + Send + 'static,
        V: Into<Bytes>,
        E: From<Error> + fmt::Display + Send + Sync + 'static,
    {
        let load: Loader = Box::new(move || {
            Box::pin(async move {
                loader().await.map(Into::into).map_err(|e| LoadError {
                    message: e.to_string(),
                    error: Arc::new(e),
                })
            })
        });
        match self.fetch(key, ttl, TypeId::of::<E>(), load).await {
            Ok(bytes) => Ok(bytes),
            Err(Fail::Cache(e)) => Err(Arc::new(E::from(e))),
            Err(Fail::Loader(any)) => Err(any.downcast::<E>().unwrap_or_else(|_| {
                Arc::new(E::from(Error::LoadFailed {
                    message: "the loader's error had another type".into(),
                }))
            })),
        }
    }

    fn check(&self, key: &str, ttl: Duration) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid("cache key must not be empty"));
        }
        if ttl.is_zero() || ttl > MAX_TTL {
            return Err(Error::invalid(format!(
                "cache ttl must be in (0, {MAX_TTL:?}], got {ttl:?}"
            )));
        }
        Ok(())
    }

    async fn fetch(
        &self,
        key: &str,
        ttl: Duration,
        kind: TypeId,
        load: Loader,
    ) -> Result<Bytes, Fail> {
        let began = Instant::now();
        self.check(key, ttl)?;
        let inner = &self.inner;
        bump(&inner.stats.calls);
        let fkey = (key.to_owned(), kind);
        let rt = caller_runtime();
        let joined = inner.join(&fkey, rt.is_none(), ttl, load);
        let ticket = Ticket(joined.flight.clone());
        let mut driver = joined.driver;
        match (joined.spawn, rt) {
            (Some(task), Some(rt)) => rt.spawn(task),
            // Not reached: a flight is spawned only when there is a runtime.
            (Some(task), None) => drop(task),
            (None, _) if !joined.created => bump(&inner.stats.coalesced),
            (None, _) => {}
        }
        // Unused: another caller's loader runs (dropped here, outside the map's lock).
        drop(joined.unused);
        // Validated options: the deadline is always representable.
        let deadline = began.checked_add(inner.options.wait_timeout);
        let flight = &ticket.0;
        let outcome = match driver.take() {
            None => runtime::until(deadline, flight.wait()).await,
            // The caller that started an unspawned flight drives it to its end (a background
            // refresh included, within its wait_timeout), then answers.
            Some(d) if joined.created => {
                let _ = runtime::until(deadline, d).await;
                flight.outcome.get().cloned()
            }
            // Others drive it until their answer is there; a flight whose callers have all
            // left is dropped (its lease released, its waiters told).
            Some(d) => {
                let wait = pin!(flight.wait());
                runtime::until(deadline, future::select(d, wait))
                    .await
                    .and_then(|either| match either {
                        future::Either::Left(((), _)) => flight.outcome.get().cloned(),
                        future::Either::Right((o, _)) => Some(o),
                    })
            }
        };
        drop(ticket);
        match outcome {
            None => Err(Fail::Cache(Error::Timeout {
                waited: began.elapsed(),
            })),
            Some(Outcome::Value(bytes)) => Ok(bytes),
            Some(Outcome::Loader(e)) => Err(Fail::Loader(e)),
            Some(Outcome::Failed(e)) => Err(Fail::Cache(duplicate(&e))),
        }
    }
}

/// A caller's place, from [`Inner::join`].
struct Joined {
    flight: Arc<Flight>,
    created: bool,
    /// The new flight's task, to spawn on the caller's runtime.
    spawn: Option<BoxFuture<'static, ()>>,
    /// The flight's future, when the callers drive it.
    driver: Option<Driver>,
    /// The loader, if this caller joined a flight that has its own.
    unused: Option<Loader>,
}

/// How a flight ended.
enum Resolved {
    /// A fresh value (read or computed).
    Value(Bytes),
    /// A value to serve now while it is refreshed in the background (stale, or picked for
    /// early refresh), with the lease if this flight holds it already.
    /// Carries the round that wrote the value, to tell whether another refreshed it since.
    Serve(Bytes, Option<u64>, Option<Round>),
    Failed(Outcome),
    /// Every caller left while another process computed: nothing to do.
    Unwatched,
}

/// What a read value calls for.
enum Judged {
    Fresh,
    Refresh,
}

/// Ends a flight with an outcome exactly once, also when its task is dropped (its runtime
/// shut down): callers then learn it at once instead of at their timeout.
struct Finish {
    inner: Arc<Inner>,
    flight: Arc<Flight>,
    fkey: FlightKey,
    done: bool,
}

impl Finish {
    fn publish(&mut self, outcome: Outcome) {
        self.done = true;
        self.inner.finish(&self.fkey, &self.flight, outcome);
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        if !self.done {
            let e = Error::LoadFailed {
                message: "the computation was dropped (its runtime shut down, or every caller \
                          of a flight driven by its callers left)"
                    .into(),
            };
            self.inner
                .finish(&self.fkey, &self.flight, Outcome::Failed(Arc::new(e)));
        }
    }
}

/// Removes a key from the set of background refreshes in this process when dropped.
struct Refreshing<'a>(&'a Inner, String);

impl Drop for Refreshing<'_> {
    fn drop(&mut self) {
        locked(&self.0.refreshing).remove(&self.1);
    }
}

impl Inner {
    /// Joins the flight of `fkey`, or starts one with `load`: spawned (`inline` false) or
    /// driven by its callers. The flight's end ([`Finish`]) exists before its task is
    /// spawned, so a task dropped before its first poll (its runtime shut down) still ends
    /// the flight instead of leaving it in the map for every later caller to time out on.
    fn join(
        self: &Arc<Self>,
        fkey: &FlightKey,
        inline: bool,
        ttl: Duration,
        load: Loader,
    ) -> Joined {
        let mut flights = locked(&self.flights);
        if let Some(f) = flights.get(fkey) {
            // A driven flight whose callers have all gone is being dropped: start anew.
            let driver = f.driver.get().map(|w| w.upgrade());
            if !matches!(driver, Some(None)) {
                f.callers.fetch_add(1, Ordering::AcqRel);
                return Joined {
                    flight: f.clone(),
                    created: false,
                    spawn: None,
                    driver: driver.flatten(),
                    unused: Some(load),
                };
            }
        }
        let flight = Arc::new(Flight {
            outcome: OnceLock::new(),
            done: Event::new(),
            callers: AtomicUsize::new(1),
            gone: Event::new(),
            driver: OnceLock::new(),
        });
        let finish = Finish {
            inner: self.clone(),
            flight: flight.clone(),
            fkey: fkey.clone(),
            done: false,
        };
        let task = Inner::run_flight(finish, ttl, load).boxed();
        let (spawn, driver) = if inline {
            // Polled in a tokio context (the private runtime's) so that tokio timers work,
            // but on the caller's thread.
            let driver = runtime::in_tokio(task).boxed().shared();
            if let Some(weak) = driver.downgrade() {
                let _ = flight.driver.set(weak);
            }
            (None, Some(driver))
        } else {
            (Some(task), None)
        };
        flights.insert(fkey.clone(), flight.clone());
        Joined {
            flight,
            created: true,
            spawn,
            driver,
            unused: None,
        }
    }

    /// Takes the flight out of the map (later callers start a new one), then hands the
    /// outcome to its callers.
    fn finish(&self, fkey: &FlightKey, flight: &Arc<Flight>, outcome: Outcome) {
        {
            let mut flights = locked(&self.flights);
            if flights.get(fkey).is_some_and(|f| Arc::ptr_eq(f, flight)) {
                flights.remove(fkey);
            }
        }
        let _ = flight.outcome.set(outcome);
        flight.done.notify(usize::MAX);
    }

    /// Ends the flight if no caller waits on it any more (checked under the map lock, so
    /// no caller can join it in between).
    fn unwatched(&self, fkey: &FlightKey, flight: &Arc<Flight>) -> bool {
        let mut flights = locked(&self.flights);
        if flight.callers.load(Ordering::Acquire) > 0 {
            return false;
        }
        if flights.get(fkey).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            flights.remove(fkey);
        }
        true
    }

    /// What value `v` calls for, `u` being a uniform draw in (0, 1] (XFetch's `rand`).
    /// Pure, so both sides of the threshold can be tested.
    fn judge(v: &Cached, xfetch_beta: Option<f64>, u: f64) -> Judged {
        if v.cooldown {
            // A refresh failed lately: serve what is there until the cooldown ends.
            return Judged::Fresh;
        }
        if !v.grace.is_zero() && v.pttl <= v.grace {
            return Judged::Refresh;
        }
        if let Some(beta) = xfetch_beta {
            let fresh_left = v.pttl.saturating_sub(v.grace).as_secs_f64();
            let x = (-u.ln()).min(XFETCH_CAP);
            if v.delta.as_secs_f64() * beta * x >= fresh_left {
                return Judged::Refresh;
            }
        }
        Judged::Fresh
    }

    /// [`judge`](Self::judge) with a fresh random draw.
    fn judge_now(&self, v: &Cached) -> Judged {
        // u in (0, 1], so -ln(u) is finite and >= 0.
        let u = 1.0 - rand::random::<f64>();
        Self::judge(v, self.options.xfetch_beta, u)
    }

    /// How long no background refresh starts after one failed.
    fn cooldown(&self) -> Duration {
        self.options.lease_ttl.min(REFRESH_COOLDOWN)
    }

    /// A lease this flight took, as a compute round.
    fn round(&self, guard: LockGuard, key: &LeaseKey) -> Round {
        Round {
            key: key.clone(),
            guard: Some(guard),
            store: self.store.clone(),
        }
    }

    /// The flight's task: read, wait or compute, hand the outcome to the callers, then
    /// refresh in the background if the value called for it.
    async fn run_flight(mut finish: Finish, ttl: Duration, load: Loader) {
        let inner = finish.inner.clone();
        let flight = finish.flight.clone();
        let lock = inner.locks.lock(&finish.fkey.0);
        let mut load = Some(load);
        let resolved = inner
            .resolve(&flight, &finish.fkey, &lock, ttl, &mut load)
            .await;
        match resolved {
            Ok(Resolved::Value(bytes)) => finish.publish(Outcome::Value(bytes)),
            Ok(Resolved::Failed(outcome)) => finish.publish(outcome),
            Ok(Resolved::Unwatched) => finish.done = true,
            Ok(Resolved::Serve(bytes, seen, round)) => {
                bump(&inner.stats.served_stale);
                finish.publish(Outcome::Value(bytes));
                match load.take() {
                    Some(load) => inner.refresh(&lock, ttl, seen, round, load).await,
                    None => {
                        if let Some(round) = round {
                            round.end().await;
                        }
                    }
                }
            }
            Err(e) => finish.publish(Outcome::Failed(Arc::new(e))),
        }
    }

    async fn resolve(
        &self,
        flight: &Arc<Flight>,
        fkey: &FlightKey,
        lock: &Lock,
        ttl: Duration,
        load: &mut Option<Loader>,
    ) -> Result<Resolved> {
        let key = lock.key();
        // The round (the holder's fencing token) this flight waits on, once it has seen one.
        let mut awaited: Option<u64> = None;
        let mut sub: Option<Subscription> = None;
        let mut retry = Backoff::new(self.options.wait_timeout);
        loop {
            // Armed before the read, so a fill between the read and the wait is not missed.
            let woken = sub.as_ref().map(Subscription::listen);
            let read = match self.store.read(key, awaited).await {
                Ok(read) => read,
                Err(e) => {
                    retry.pause(e, key).await?;
                    continue;
                }
            };
            if let Some(v) = read.value {
                return Ok(match self.judge_now(&v) {
                    Judged::Fresh => Resolved::Value(v.bytes),
                    Judged::Refresh => Resolved::Serve(v.bytes, v.round, None),
                });
            }
            if let Some(message) = read.failed {
                let e = Error::LoadFailed { message };
                return Ok(Resolved::Failed(Outcome::Failed(Arc::new(e))));
            }
            if !read.held {
                // Nobody computes: take the lease, check again (another process may have
                // filled the value between the read and now), and compute.
                match lock.try_acquire().await {
                    Ok(Some(guard)) => {
                        let round = self.round(guard, key);
                        let again = match self.store.read(key, None).await {
                            Ok(again) => again,
                            Err(e) => {
                                round.end().await;
                                retry.pause(e, key).await?;
                                continue;
                            }
                        };
                        if let Some(v) = again.value {
                            return Ok(match self.judge_now(&v) {
                                Judged::Fresh => {
                                    round.end().await;
                                    Resolved::Value(v.bytes)
                                }
                                Judged::Refresh => Resolved::Serve(v.bytes, v.round, Some(round)),
                            });
                        }
                        let Some(load) = load.take() else {
                            round.end().await;
                            return Err(Error::LoadFailed {
                                message: "the flight's loader was used already".into(),
                            });
                        };
                        return Ok(self.compute(key, round, ttl, load, None).await);
                    }
                    // Taken since the read: wait for that round like any other.
                    Ok(None) => {}
                    Err(e) => {
                        retry.pause(e, key).await?;
                        continue;
                    }
                }
            }
            // A round is under way. Its number may be unknown (the lease's fence was evicted):
            // then its failure cannot be read, but its end still wakes this flight.
            if read.round.is_some() {
                awaited = read.round;
            }
            let Some(woken) = woken else {
                // Subscribe, then read again at once: a fill that came before the
                // subscription took effect is seen by that read. The only pass of this loop
                // that does not wait.
                match self.store.subscribe(key).await {
                    Ok(s) => sub = Some(s),
                    Err(e) => retry.pause(e, key).await?,
                }
                continue;
            };
            let gone = flight.gone.listen();
            if self.unwatched(fkey, flight) {
                return Ok(Resolved::Unwatched);
            }
            // Reset only here, where every call of a pass has succeeded: a read that works
            // between subscriptions that fail must not keep the back-off at its first step.
            retry.reset();
            // A holder that died never publishes: look again when its lease runs out.
            let pause = read
                .lease_pttl
                .unwrap_or(self.options.lease_ttl)
                .min(self.options.lease_ttl)
                + Duration::from_millis(1);
            let sleep = pin!(runtime::sleep(pause));
            let woken_or_gone = future::select(woken, gone);
            drop(future::select(woken_or_gone, sleep).await);
        }
    }

    /// Runs the loader in `round`, writes its value fenced by the lease, and ends the round.
    /// `refreshing`: the value there now, if this is a background refresh (a failure then
    /// starts the refresh cooldown).
    async fn compute(
        &self,
        key: &LeaseKey,
        round: Round,
        ttl: Duration,
        load: Loader,
        refreshing: Option<()>,
    ) -> Resolved {
        bump(&self.stats.loads);
        let number = round.guard().fencing_token();
        let started = Instant::now();
        let run = AssertUnwindSafe(async move { load().await }).catch_unwind();
        let deadline = started.checked_add(self.options.compute_timeout);
        let result = runtime::until(deadline, run).await;
        let delta = started.elapsed();
        let (resolved, message) = match result {
            Some(Ok(Ok(bytes))) => {
                let fill = Fill {
                    bytes: bytes.clone(),
                    delta,
                    grace: self.options.grace(),
                    ttl,
                    round: number,
                };
                match self.store.fill(key, round.guard().token(), fill).await {
                    // Released after the fill: waiters read the value as soon as they are
                    // told (the fill told them).
                    Ok(true) => {
                        round.release().await;
                        return Resolved::Value(bytes);
                    }
                    Ok(false) => {
                        tracing::warn!(
                            %key,
                            "computed value not cached: the compute lease was lost meanwhile"
                        );
                        round.end().await;
                        // Fenced out: a newer round may have written; its value is the one
                        // every other caller gets, so this flight's callers get it too.
                        if let Ok(Read {
                            value: Some(newer), ..
                        }) = self.store.read(key, None).await
                        {
                            return Resolved::Value(newer.bytes);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%key, error = %e, "computed value not cached");
                        round.end().await;
                    }
                }
                return Resolved::Value(bytes);
            }
            Some(Ok(Err(e))) => (Outcome::Loader(e.error), e.message),
            Some(Err(panic)) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".into());
                let message = format!("the loader panicked: {what}");
                let e = Error::LoadFailed {
                    message: message.clone(),
                };
                (Outcome::Failed(Arc::new(e)), message)
            }
            None => {
                let waited = self.options.compute_timeout;
                let e = Error::Timeout { waited };
                let message = format!("the loader ran past compute_timeout ({waited:?})");
                (Outcome::Failed(Arc::new(e)), message)
            }
        };
        tracing::debug!(%key, %message, "compute failed; not cached");
        // Callers in other processes waiting on this round read the message; later rounds
        // never see it. Kept as long as a waiter may sleep before it looks again.
        let failure = Failure {
            round: number,
            message: &message,
            keep: self.options.lease_ttl.saturating_mul(2),
            cooldown: refreshing.map(|()| self.cooldown()),
        };
        match self.store.fail(key, round.guard().token(), failure).await {
            // The script told the waiters.
            Ok(true) => round.release().await,
            Ok(false) => round.end().await,
            Err(e) => {
                tracing::warn!(%key, error = %e, "could not record the failed compute");
                round.end().await;
            }
        }
        Resolved::Failed(resolved)
    }

    /// One background refresh of a stale or early-expiring value, unless this process or
    /// another one is refreshing it already ("duck out": the current value is served
    /// meanwhile), or a refresh failed lately (the cooldown).
    async fn refresh(
        &self,
        lock: &Lock,
        ttl: Duration,
        seen_round: Option<u64>,
        round: Option<Round>,
        load: Loader,
    ) {
        let name = lock.name().to_owned();
        if !locked(&self.refreshing).insert(name.clone()) {
            if let Some(round) = round {
                round.end().await;
            }
            return;
        }
        let _unmark = Refreshing(self, name);
        let key = lock.key();
        let round = match round {
            Some(r) => r,
            None => match lock.try_acquire().await {
                Ok(Some(g)) => self.round(g, key),
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(%key, error = %e, "background refresh skipped");
                    return;
                }
            },
        };
        // Someone refreshed between our read and the lease (another round wrote the value),
        // or a refresh failed meanwhile: nothing to do.
        match self.store.read(key, None).await {
            Ok(Read { value: Some(v), .. }) if v.cooldown || v.round != seen_round => {
                round.end().await;
                return;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(%key, error = %e, "background refresh skipped");
                round.end().await;
                return;
            }
        }
        bump(&self.stats.refreshes);
        if let Resolved::Failed(_) = self.compute(key, round, ttl, load, Some(())).await {
            tracing::warn!(%key, "background refresh failed; the current value stays");
        }
    }
}

/// A compute round this flight holds the lease of. Every way it ends without a fill wakes
/// the waiters (in every process) at once, so they look again instead of sleeping until the
/// lease's TTL: [`end`](Self::end), and dropping it (the flight was cancelled), which does
/// the same in the background.
struct Round {
    key: LeaseKey,
    guard: Option<LockGuard>,
    store: Arc<dyn ValueStore>,
}

impl Round {
    fn guard(&self) -> &LockGuard {
        // Taken only by the methods that consume the round.
        self.guard
            .as_ref()
            .expect("a round holds its guard until it ends")
    }

    /// Releases the lease after a fill or failure that told the waiters already.
    async fn release(mut self) {
        if let Some(g) = self.guard.take() {
            let _ = g.release().await;
        }
    }

    /// Ends a round that wrote nothing: release the lease, then wake the waiters.
    async fn end(mut self) {
        if let Some(g) = self.guard.take() {
            let _ = g.release().await;
        }
        let key = &self.key;
        if let Err(e) = self.store.notify(key).await {
            tracing::debug!(%key, error = %e, "could not wake the waiters");
        }
    }
}

impl Drop for Round {
    fn drop(&mut self) {
        if let Some(g) = self.guard.take() {
            let (store, key) = (self.store.clone(), self.key.clone());
            runtime::background().spawn(async move {
                let _ = g.release().await;
                let _ = store.notify(&key).await;
            });
        }
    }
}

/// Retries of a store call that failed while a flight reads or waits: one transient error
/// must not fail the flight (another process may be computing). Backs off from 10 ms,
/// doubling up to 500 ms, and gives up (returning the error) when the failures have lasted
/// about `wait_timeout`, so the callers that started the flight get that error rather
/// than a timeout.
struct Backoff {
    budget: Duration,
    since: Option<Instant>,
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_millis(500);

    fn new(budget: Duration) -> Self {
        Backoff {
            budget,
            since: None,
            next: Self::FIRST,
        }
    }

    fn reset(&mut self) {
        self.since = None;
        self.next = Self::FIRST;
    }

    async fn pause(&mut self, e: Error, key: &LeaseKey) -> Result<()> {
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed().saturating_add(self.next) >= self.budget {
            return Err(e);
        }
        tracing::debug!(%key, error = %e, retry_in = ?self.next, "cache store call failed; retrying");
        runtime::sleep(self.next).await;
        self.next = self.next.saturating_mul(2).min(Self::MAX);
        Ok(())
    }
}

#[cfg(feature = "serde")]
mod typed;

/// Errors out of a loader whose value is typed: see `Cache::get_typed_with` (feature
/// `serde`).
#[cfg(feature = "serde")]
fn encode_error(e: impl fmt::Display) -> Error {
    Error::LoadFailed {
        message: format!("the value could not be encoded: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked() {
        let bad = [
            CacheOptions::new().lease_ttl(Duration::ZERO),
            CacheOptions::new().compute_timeout(Duration::ZERO),
            CacheOptions::new().wait_timeout(Duration::ZERO),
            CacheOptions::new().stale_while_revalidate(Duration::ZERO),
            CacheOptions::new().stale_while_revalidate(Duration::from_micros(999)),
            CacheOptions::new().stale_while_revalidate(MAX_TTL + Duration::from_millis(1)),
            CacheOptions::new().compute_timeout(Duration::MAX),
            CacheOptions::new().wait_timeout(Duration::MAX),
            CacheOptions::new()
                .compute_timeout(CacheOptions::MAX_TIMEOUT + Duration::from_nanos(1)),
            CacheOptions::new().xfetch(f64::INFINITY),
            CacheOptions::new().xfetch(f64::NAN),
            CacheOptions::new().xfetch(0.0),
            CacheOptions::new().key_prefix("a{b"),
        ];
        for o in bad {
            assert!(
                matches!(o.validate(), Err(Error::InvalidConfig(_))),
                "{o:?} must be refused"
            );
        }
        assert!(CacheOptions::new().xfetch(1.0).validate().is_ok());
        let edges = CacheOptions::new()
            .compute_timeout(CacheOptions::MAX_TIMEOUT)
            .wait_timeout(CacheOptions::MAX_TIMEOUT)
            .stale_while_revalidate(CacheOptions::MIN_STALE_WINDOW);
        assert!(edges.validate().is_ok());
    }

    fn value(pttl_ms: u64, grace_ms: u64, delta_ms: u64) -> Cached {
        Cached {
            bytes: Bytes::new(),
            delta: Duration::from_millis(delta_ms),
            grace: Duration::from_millis(grace_ms),
            pttl: Duration::from_millis(pttl_ms),
            round: Some(1),
            cooldown: false,
        }
    }

    fn refreshes(v: &Cached, beta: Option<f64>, u: f64) -> bool {
        matches!(Inner::judge(v, beta, u), Judged::Refresh)
    }

    #[test]
    fn stale_values_are_refreshed_and_fresh_ones_kept() {
        assert!(refreshes(&value(500, 1000, 5), None, 0.5));
        assert!(!refreshes(&value(1500, 1000, 5), None, 0.5));
        assert!(!refreshes(&value(1500, 0, 5), None, 0.5));
    }

    #[test]
    fn a_refresh_cooldown_serves_the_stale_value_without_refreshing() {
        let mut v = value(500, 1000, 5);
        v.cooldown = true;
        assert!(!refreshes(&v, None, 0.5));
        assert!(!refreshes(&v, Some(1e9), 1e-300));
    }

    /// delta = 100 ms, beta = 1, 150 ms of fresh time left: the draw decides. u = e^-1
    /// gives 100 ms < 150 ms (fresh), u = e^-2 gives 200 ms >= 150 ms (refresh). A delta
    /// read in the wrong unit (µs as ms, or the reverse) flips one of them.
    #[test]
    fn xfetch_refreshes_exactly_when_the_draw_passes_the_threshold() {
        let v = value(150, 0, 100);
        assert!(!refreshes(&v, Some(1.0), (-1.0f64).exp()));
        assert!(refreshes(&v, Some(1.0), (-2.0f64).exp()));
        // The fresh time is what is left before the stale window, not the whole PTTL.
        let swr = value(1150, 1000, 100);
        assert!(!refreshes(&swr, Some(1.0), (-1.0f64).exp()));
        assert!(refreshes(&swr, Some(1.0), (-2.0f64).exp()));
        // beta scales the draw: 0.5 · 2 · 100 ms = 100 ms < 150 ms.
        assert!(!refreshes(&v, Some(0.5), (-2.0f64).exp()));
        // u = 1 never refreshes early; off never does.
        assert!(!refreshes(&value(1, 0, 100), Some(1.0), 1.0));
        assert!(!refreshes(&value(1, 0, 100), None, 1e-300));
    }

    /// A tiny draw is capped at XFETCH_CAP: 100 ms · 14 = 1.4 s early at most.
    #[test]
    fn xfetch_caps_the_draw() {
        let tiny = 1e-300; // -ln = 690
        assert!(!refreshes(&value(1500, 0, 100), Some(1.0), tiny));
        assert!(refreshes(&value(1300, 0, 100), Some(1.0), tiny));
    }
}
