//! A backend that serves plain claims only (over a `MemoryBackend`), declaring so in its
//! capabilities: the way to test what a lock of another kind gets on such a store.

use std::time::Duration;

use async_trait::async_trait;
use redlease::backend::{
    Acquire, Attempt, Backend, Capabilities, Claim, Lease, NodeTerms, Release, Subscription,
};
use redlease::{LeaseKey, LockInfo, MemoryBackend, Result};

#[derive(Debug, Clone, Default)]
pub struct PlainOnly(pub MemoryBackend);

#[async_trait]
impl Backend for PlainOnly {
    fn capabilities(&self) -> Capabilities {
        Capabilities::PLAIN
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        self.0.acquire(claim, attempt, terms).await
    }

    async fn extend(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> Result<Vec<redlease::backend::Extended>> {
        self.0.extend(leases, terms).await
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        self.0.release(claim, how).await
    }

    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        self.0.subscribe(claim).await
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        self.0.inspect(key).await
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        self.0.raise_fence(key, at_least).await
    }
}
