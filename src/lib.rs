//! redlease: distributed lease locks on Redis.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
mod error;
mod guard;
mod lock;
mod options;
mod runtime;
mod token;
mod watchdog;

pub use backend::memory::MemoryBackend;
pub use backend::redis::{RedisBackend, RedisOptions};
pub use backend::{clock_drift, Acquire, Backend, Lease, Released, Subscription};
pub use error::{BoxError, Error, Result};
pub use event_listener;
pub use guard::{LockGuard, Lost};
pub use lock::{Lock, LockManager};
pub use options::{LockOptions, RetryPolicy, MIN_TTL};
pub use token::{LeaseKey, Token};
pub use watchdog::WatchdogStats;
