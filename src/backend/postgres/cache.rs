//! The stampede cache's values on PostgreSQL (`value` and `failed` tables beside the compute
//! lease's row, see schema.sql): one call reads everything a caller decides on; the fill and
//! the failure are fenced by the lease's token, in the same transaction as the check.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::schema::Stmt;
use super::{ms, payload, pg_error, PostgresBackend};
use crate::backend::values::{Cached, Failure, Fill, Read, ValueStore};
use crate::backend::{Backend, Subscription};
use crate::error::Result;
use crate::token::{LeaseKey, Token};

/// Values on PostgreSQL, beside the compute leases.
pub(crate) struct PostgresValues {
    backend: PostgresBackend,
}

impl fmt::Debug for PostgresValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresValues")
            .field("backend", &self.backend)
            .finish()
    }
}

impl PostgresBackend {
    /// The cache's values in this database.
    pub(crate) fn values(&self) -> PostgresValues {
        PostgresValues {
            backend: self.clone(),
        }
    }
}

fn us(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn millis(v: Option<i64>) -> Option<Duration> {
    v.and_then(|n| u64::try_from(n).ok())
        .map(Duration::from_millis)
}

fn round(v: Option<i64>) -> Option<u64> {
    v.and_then(|n| u64::try_from(n).ok()).filter(|r| *r > 0)
}

#[async_trait]
impl ValueStore for PostgresValues {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read> {
        let awaited = i64::try_from(awaited.unwrap_or(0)).unwrap_or(0);
        let rows = self
            .backend
            .query(Stmt::CacheRead, &[&key.as_str().as_bytes(), &awaited])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(Read::default());
        };
        let get_i64 = |i: usize| row.try_get::<_, Option<i64>>(i).map_err(pg_error);
        let has: Option<bool> = row.try_get(0).map_err(pg_error)?;
        let bytes: Option<Vec<u8>> = row.try_get(1).map_err(pg_error)?;
        let failed: Option<bool> = row.try_get(7).map_err(pg_error)?;
        let message: Option<String> = row.try_get(8).map_err(pg_error)?;
        let cooling: Option<bool> = row.try_get(10).map_err(pg_error)?;
        let lease_pttl = get_i64(6)?;
        let value = match (has, bytes) {
            (Some(true), Some(bytes)) => Some(Cached {
                bytes: Bytes::from(bytes),
                delta: Duration::from_micros(u64::try_from(get_i64(2)?.unwrap_or(0)).unwrap_or(0)),
                grace: millis(get_i64(3)?).unwrap_or(Duration::ZERO),
                pttl: millis(get_i64(4)?).unwrap_or(Duration::ZERO),
                round: round(get_i64(9)?),
                cooldown: cooling.unwrap_or(false),
            }),
            _ => None,
        };
        Ok(Read {
            value,
            held: lease_pttl.is_some_and(|p| p != -2),
            round: round(get_i64(5)?),
            lease_pttl: millis(lease_pttl),
            failed: failed.unwrap_or(false).then(|| message.unwrap_or_default()),
        })
    }

    async fn fill(&self, key: &LeaseKey, token: &Token, fill: Fill) -> Result<bool> {
        let lifetime = ms(fill.ttl.saturating_add(fill.grace)).max(1);
        let round = i64::try_from(fill.round).unwrap_or(i64::MAX);
        let rows = self
            .backend
            .query(
                Stmt::CacheFill,
                &[
                    &key.as_str().as_bytes(),
                    &token.as_str(),
                    &&fill.bytes[..],
                    &us(fill.delta),
                    &ms(fill.grace),
                    &lifetime,
                    &round,
                ],
            )
            .await?;
        let done: Option<i32> = match rows.first() {
            Some(row) => row.try_get(0).map_err(pg_error)?,
            None => None,
        };
        Ok(done == Some(1))
    }

    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool> {
        let round = i64::try_from(failure.round).unwrap_or(i64::MAX);
        let cooldown = failure.cooldown.map_or(0, |d| ms(d).max(1));
        let rows = self
            .backend
            .query(
                Stmt::CacheFail,
                &[
                    &key.as_str().as_bytes(),
                    &token.as_str(),
                    &failure.message,
                    &ms(failure.keep).max(1),
                    &cooldown,
                    &round,
                ],
            )
            .await?;
        let done: Option<i32> = match rows.first() {
            Some(row) => row.try_get(0).map_err(pg_error)?,
            None => None,
        };
        Ok(done == Some(1))
    }

    async fn notify(&self, key: &LeaseKey) -> Result<()> {
        self.backend
            .query(Stmt::CacheNotify, &[&key.as_str().as_bytes()])
            .await
            .map(drop)
    }

    /// Every fill, failure or notice of `key` wakes every local listener.
    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        let hub = &self.backend.inner.hub;
        let event = hub.event(&hub.events, &format!("v{}", payload(key)));
        self.backend.listening().await?;
        Ok(Subscription::new(event))
    }
}
