//! Test stores made from another store. A [`Wrap`] passes every call on to the store it
//! wraps but the ones a test changes; [`Wrapped`] makes it a store. [`PlainOnly`] is one: it
//! serves plain claims only (over a `MemoryBackend`), declaring so in its capabilities, the
//! way to test what a lock of another kind gets on such a store.

use std::fmt;
use std::ops::Deref;

use async_trait::async_trait;
use futures::future::BoxFuture;
use redlease::backend::{
    Acquire, Attempt, Backend, Capabilities, Claim, Extended, Lease, NodeTerms, Release,
    Subscription,
};
use redlease::{LeaseKey, LockInfo, MemoryBackend, Result};

/// What a test store changes of the store it wraps: each method passes the call on unless
/// the test overrides it.
#[async_trait]
pub trait Wrap: fmt::Debug + Send + Sync + 'static {
    /// The wrapped store.
    fn inner(&self) -> &dyn Backend;

    fn capabilities(&self) -> Capabilities {
        self.inner().capabilities()
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        self.inner().acquire(claim, attempt, terms).await
    }

    async fn extend(&self, leases: &[Lease<'_>], terms: NodeTerms) -> Result<Vec<Extended>> {
        self.inner().extend(leases, terms).await
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        self.inner().release(claim, how).await
    }

    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        self.inner().subscribe(claim).await
    }
}

/// A [`Wrap`] as a store (its fields reached through `Deref`; its `Debug` is the wrap's, so
/// errors name it).
#[derive(Clone, Default)]
pub struct Wrapped<W>(pub W);

impl<W> Deref for Wrapped<W> {
    type Target = W;
    fn deref(&self) -> &W {
        &self.0
    }
}

impl<W: fmt::Debug> fmt::Debug for Wrapped<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[async_trait]
impl<W: Wrap> Backend for Wrapped<W> {
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        self.0.acquire(claim, attempt, terms).await
    }

    async fn extend(&self, leases: &[Lease<'_>], terms: NodeTerms) -> Result<Vec<Extended>> {
        self.0.extend(leases, terms).await
    }

    fn extend_group(&self, key: &LeaseKey) -> u64 {
        self.0.inner().extend_group(key)
    }

    fn disturbed(&self) -> BoxFuture<'static, ()> {
        self.0.inner().disturbed()
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        self.0.release(claim, how).await
    }

    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        self.0.subscribe(claim).await
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        self.0.inner().inspect(key).await
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        self.0.inner().raise_fence(key, at_least).await
    }
}

/// Plain claims only, over a `MemoryBackend` ([`plain_only`] makes the store).
#[derive(Debug, Clone, Default)]
pub struct PlainOnly(pub MemoryBackend);

impl Wrap for PlainOnly {
    fn inner(&self) -> &dyn Backend {
        &self.0
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::PLAIN
    }
}

/// A store that serves plain claims only.
pub fn plain_only() -> Wrapped<PlainOnly> {
    Wrapped(PlainOnly::default())
}
