//! A backend that implements only the `Backend` trait's required methods (over a
//! `MemoryBackend`), so it inherits every optional method's default: the way to test what a
//! backend without fair, reentrant or node support gets.

use std::time::Duration;

use async_trait::async_trait;
use redlease::{
    Acquire, Backend, Lease, LeaseKey, MemoryBackend, Result, Subscription, Token, Waiting,
};

#[derive(Debug, Clone, Default)]
pub struct PlainOnly(pub MemoryBackend);

#[async_trait]
impl Backend for PlainOnly {
    async fn try_acquire(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
    ) -> Result<Acquire> {
        self.0.try_acquire(key, token, ttl, waiting).await
    }

    async fn extend(&self, leases: &[Lease<'_>]) -> Result<Vec<Option<Duration>>> {
        self.0.extend(leases).await
    }

    async fn release(&self, key: &LeaseKey, token: &Token) -> Result<bool> {
        self.0.release(key, token).await
    }

    async fn abandon(&self, key: &LeaseKey, token: &Token) -> Result<bool> {
        self.0.abandon(key, token).await
    }

    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        self.0.subscribe(key).await
    }
}
