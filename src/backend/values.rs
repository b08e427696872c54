//! What the stampede cache needs of a store besides leases: a value beside a compute lease,
//! written only while the writer's token holds the lease (a fenced fill), and fill
//! notifications. Implemented for Redis in `redis/cache.rs`; the cache keeps its in-process
//! values itself, beside a `MemoryBackend`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::backend::{Backend, Subscription};
use crate::error::Result;
use crate::token::{LeaseKey, Token};

/// A value as read, with what the caller decides on.
#[derive(Debug)]
pub(crate) struct Cached {
    pub(crate) bytes: Bytes,
    /// How long the last compute took (XFetch's delta).
    pub(crate) delta: Duration,
    /// The stale-while-revalidate window it was written with.
    pub(crate) grace: Duration,
    /// The value's remaining lifetime on the store (grace included).
    pub(crate) pttl: Duration,
    /// The compute round (fencing token) that wrote it, if known.
    pub(crate) round: Option<u64>,
    /// A background refresh failed lately: none is started until the marker expires.
    pub(crate) cooldown: bool,
}

/// One read: the value, and the state of the compute lease.
#[derive(Debug, Default)]
pub(crate) struct Read {
    pub(crate) value: Option<Cached>,
    /// Whether the compute lease exists: a round is under way, known or not.
    pub(crate) held: bool,
    /// The fencing token of the lease's current holder: the compute round under way (`None`
    /// if the lease is free, or its fence is unknown, as after an eviction).
    pub(crate) round: Option<u64>,
    pub(crate) lease_pttl: Option<Duration>,
    /// The message of the awaited round, if it failed.
    pub(crate) failed: Option<String>,
}

/// A value to write.
#[derive(Debug)]
pub(crate) struct Fill {
    pub(crate) bytes: Bytes,
    pub(crate) delta: Duration,
    pub(crate) grace: Duration,
    pub(crate) ttl: Duration,
    /// The writing round (the lease's fencing token).
    pub(crate) round: u64,
}

/// A failed round to record.
#[derive(Debug)]
pub(crate) struct Failure<'a> {
    pub(crate) round: u64,
    pub(crate) message: &'a str,
    pub(crate) keep: Duration,
    /// Set after a failed background refresh: no refresh starts for this long.
    pub(crate) cooldown: Option<Duration>,
}

#[async_trait]
pub(crate) trait ValueStore: Send + Sync + fmt::Debug + 'static {
    /// The lease backend the compute locks use.
    fn backend(&self) -> Arc<dyn Backend>;

    /// The value, the current round, and whether `awaited` failed.
    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read>;

    /// Writes the value if `token` holds the lease, and wakes waiters.
    async fn fill(&self, key: &LeaseKey, token: &Token, fill: Fill) -> Result<bool>;

    /// Records round `round` as failed with `message` (kept `keep`) if `token` holds the
    /// lease, sets the refresh cooldown marker for `cooldown` if given, and wakes waiters.
    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool>;

    /// Wakes waiters with no value written (a round that ended without a fill).
    async fn notify(&self, key: &LeaseKey) -> Result<()>;

    /// Wake-ups for fills and failures of `key`; every listener is woken.
    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription>;
}
