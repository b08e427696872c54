//! Distributed lease locks on Redis, for async Rust: an RAII guard, one batched watchdog per
//! manager, an awaitable lost-lease signal, fencing tokens, and wake-up on release.
//!
//! ```
//! use redlease::{LockManager, MemoryBackend};
//! # futures::executor::block_on(async {
//! // With Redis: LockManager::new(RedisBackend::connect("redis://127.0.0.1:6379").await?)
//! let locks = LockManager::new(MemoryBackend::new());
//! let lock = locks.lock("orders:42");
//! let guard = lock.acquire().await?;   // waits; the watchdog keeps the lease alive
//! let token = guard.fencing_token();   // pass it with every write you protect
//! // ... critical section ...
//! drop(guard);                         // released in the background
//! # let _ = token;
//! # Ok::<(), redlease::Error>(()) }).unwrap();
//! ```
//!
//! # What a lease promises, and what it does not
//!
//! A lock here is a *lease*: the store grants it for a TTL, the watchdog extends it while
//! the guard lives, and a holder that crashes loses it when the TTL runs out, so a dead
//! process never blocks the others for longer than one TTL. Only the holder's random 128-bit
//! token can extend or release it (compare-and-delete), so a late release never frees
//! someone else's lease.
//!
//! Mutual exclusion holds **only while the holder is running and in touch with the store**. A
//! process paused longer than the TTL (GC, swap, SIGSTOP, a stalled network) can wake up
//! still believing it holds the lock after another process has taken it. No lease library can
//! prevent that; what this one does:
//!
//! - the guard knows its deadline (monotonic clock: attempt start + TTL − drift margin) and
//!   reports itself lost when the deadline passes without a confirmed extension, or when an
//!   extension is refused: [`LockGuard::is_lost`], [`LockGuard::lost`];
//! - every hold gets a [fencing token](LockGuard::fencing_token) strictly greater than all
//!   earlier ones for that name (also across a Redis restart without persistence). Send it
//!   with each write and let the resource refuse tokens older than the newest it has seen:
//!   that is what actually protects data from a paused holder.
//!
//! Client clocks are never compared with each other or with the server's: expiry happens on
//! the server, and each client measures only elapsed time on its own monotonic clock, with a
//! 1 % + 2 ms margin for clock rate drift ([`backend::clock_drift`]).
//!
//! A single Redis server is a single point of failure, and a replicated Redis can lose a
//! lease on failover (replication is asynchronous). Use locks for efficiency (avoid doing
//! work twice) freely; for correctness, fence your writes.
//!
//! # When a local mutex will do
//!
//! If every contender lives in one process, use `tokio::sync::Mutex` or
//! [`MemoryBackend`] (same API, no server). Reach for Redis when contenders are separate
//! processes or machines.
//!
//! # Runtimes
//!
//! Cargo features choose the executor for background work (drop releases, the watchdog):
//! `tokio` (default), `smol`, `async-std` (discontinued upstream; smol is its successor). At
//! least one must be on, or the crate fails to compile with a message saying so. Several may
//! be on at once (for example with `--all-features`); then the choice is made per call at run
//! time: inside a tokio runtime tokio is used, otherwise smol if enabled, otherwise
//! async-std. The Redis client (fred, or redis-rs) always runs in a tokio context: the caller's tokio
//! runtime, or the crate's private one-thread runtime when the caller runs smol or
//! async-std, so [`RedisBackend`] works under `smol::block_on` and `async_std::task::block_on`
//! too. Background work shared by all users of a manager or backend (the watchdog, pub/sub
//! handlers) runs on that private runtime, so it never stops with the runtime that started it.
//!
//! # Kinds of lock
//!
//! Every lock is acquired by the same engine and held by the same [`LockGuard`], with the
//! same watchdog, release on drop, [`lost`](LockGuard::lost) signal, fencing tokens, maximum
//! hold, holder label, tracing span and metrics; the kind is what the lock asks the store for:
//!
//! - **plain** (the default): one holder at a time;
//! - **fair** ([`LockOptions::fair`], [`Lock::fair`]): waiters queue on the store and are
//!   served in arrival order, across processes: a release wakes only the head of the queue, a
//!   crashed waiter is evicted after a short deadline, and one that gives up leaves at once;
//! - **reentrant** ([`Lock::reentrant`]): takes an explicit [`Owner`] (a task is not a
//!   thread, so a thread id cannot be the owner): holds of the same owner nest, the store
//!   counts them per hold (a re-sent command never counts twice), and the lease goes when the
//!   last hold is released ([`LockGuard::hold_count`], the count left from
//!   [`LockGuard::release`]);
//! - **a semaphore's permit** ([`LockManager::semaphore`], [`Semaphore`]): at most N holders
//!   at once, each permit a lease of its own (a crashed holder's comes back after its TTL);
//! - **a read or the write of a read-write lock** ([`LockManager::rw`], [`RwLock`]): many
//!   readers or one writer, each read its own lease, with writer preference (a waiting
//!   writer makes new readers wait).
//!
//! Several locks of any kinds can be held as one, all or nothing, taken in one global order
//! so that callers never deadlock: [`LockManager::lock_all`], [`MultiLock`], [`MultiGuard`].
//!
//! ```
//! use redlease::{LockManager, MemoryBackend};
//! # futures::executor::block_on(async {
//! let locks = LockManager::new(MemoryBackend::new());
//! let permit = locks.semaphore("encoders", 4)?.acquire().await?;
//! let read = locks.rw("catalog")?.read().await?;
//! let both = locks.lock_all(["account:1", "account:2"]).acquire().await?;
//! assert!(locks.rw("catalog")?.try_write().await?.is_none()); // a reader is inside
//! assert!(locks.lock("account:2").try_acquire().await?.is_none());
//! # drop((permit, read, both)); Ok::<(), redlease::Error>(()) }).unwrap();
//! ```
//!
//! Acquirers of different kinds on one name exclude each other. A store declares the kinds it
//! can serve ([`backend::Capabilities`]); a lock of a kind its store cannot serve (a fair lock
//! over [`Redlock`]) is refused when it is made, with [`Error::Unsupported`].
//!
//! # Drop and cancellation
//!
//! Dropping a [`LockGuard`] schedules its release on the runtime it was acquired on and
//! returns at once; it never blocks or panics, also outside any runtime. If that runtime has
//! shut down, the release cannot run and the TTL frees the key. Dropping an `acquire()`
//! future at any point leaves no lease behind: if an attempt may have reached the store, a
//! compare-and-delete for its token is scheduled.
//!
//! # Features
//!
//! | feature | default | what it does |
//! |---|---|---|
//! | `tokio` | yes | tokio executor for background work |
//! | `smol` | no | smol executor when not inside tokio |
//! | `async-std` | no | async-std executor when not inside tokio (and smol is off) |
//! | `tls` | no | `rediss://` URLs (rustls), `TlsOptions` (private CA, client certificate, server name); without it they are refused, never sent in plain text |
//! | `serde` | no | typed values in [`Cache`] (`get_typed_with`), stored as JSON |
//! | `metrics` | no | counters and histograms through the `metrics` facade (names in the README) |
//! | `cli` | no | the `redlease` command-line tool, a distributed flock(1) |
//!
//! # Operating locks
//!
//! [`Lock::inspect`] tells who holds a lock ([`LockInfo`]: held, TTL left, fencing token,
//! queue length, the holder's [label](LockOptions::holder_label)); [`LockOptions::max_hold`]
//! caps how long the watchdog keeps one hold alive; [`RedisBackend::fenced_set`] applies a
//! write only if its fencing token is not older than the last applied one.
//! [`RedisBackend::from_client`] builds a backend over a fred client the application has;
//! with the `redis-rs` feature, [`RedisOptions::transport`] carries the commands over
//! redis-rs instead, and `RedisBackend::from_redis_client` builds a backend from an
//! application's redis-rs client.
//!
//! # Beyond Redis
//!
//! The same locks run on etcd v3 (`EtcdBackend`, feature `etcd`: a grant is a consensus
//! write; plain, fair and reentrant locks and the cache) and on PostgreSQL
//! (`PostgresBackend`, feature `postgres`: leases in tables created on first use; every
//! lock kind and the cache). The README says what each guarantees and costs.
//!
//! # Writing a store
//!
//! The [`backend`] module holds what a store implements: the [`Backend`] trait (seven
//! methods, each taking a [`Claim`](backend::Claim)) and its types. A shared store
//! (`Arc<dyn Backend>`, or an `Arc` of any store) is a store too, so it can be handed to
//! [`LockManager::new`], [`Redlock::new`] and friends as it is. Acquire, extend,
//! release and lost leases emit `tracing` spans (`redlease.acquire`, ...), and with the
//! `metrics` feature, metrics (`redlease_acquire_total`, `redlease_hold_seconds`, ...).
#![cfg_attr(docsrs, feature(doc_cfg))]
// No unwrap on I/O paths: errors are returned; the few `expect`s state an invariant.
#![warn(clippy::unwrap_used)]

mod acquire;
pub mod backend;
mod error;
mod guard;
mod info;
mod lock;
mod options;
mod runtime;
mod stampede;
mod telemetry;
mod token;
mod watchdog;

/// The named futures the crate hands out.
pub mod futures {
    pub use crate::backend::WakeUp;
    pub use crate::guard::Lost;
}

#[cfg(feature = "tls")]
pub use backend::TlsOptions;
pub use backend::{
    Backend, FencedWrite, MemoryBackend, RedisBackend, RedisOptions, Redlock, RedlockOptions,
    ReplicaAck, Transport,
};
#[cfg(feature = "etcd")]
pub use backend::{EtcdBackend, EtcdOptions};
#[cfg(feature = "postgres")]
pub use backend::{PostgresBackend, PostgresOptions};
pub use error::{BoxError, Error, Result};
/// The notification primitive behind [`Subscription`](backend::Subscription), re-exported for
/// backend authors.
pub use event_listener;
pub use guard::LockGuard;
pub use info::LockInfo;
pub use lock::{Lock, LockManager, MultiGuard, MultiLock, RwLock, Semaphore};
pub use options::{
    host_pid_label, LockOptions, RetryPolicy, MAX_LABEL_LEN, MAX_RETRY_DELAY, MAX_TTL,
    MIN_INTERVAL, MIN_TTL,
};
pub use stampede::{Cache, CacheBackend, CacheOptions, CacheStats};
pub use token::{LeaseKey, Owner, Token};
pub use watchdog::WatchdogStats;
