//! The stampede cache's values on Redis, beside the compute lease under the same hash tag
//! (see `keys.rs`): one script reads everything a caller decides on, the fill and the failure
//! are fenced by the lease's token.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::keys::{failed, ms, part, Part};
use super::transport::Value;
use super::RedisBackend;
use crate::backend::values::{Cached, Failure, Fill, Read, ValueStore};
use crate::backend::{Backend, Subscription};
use crate::error::{Error, Result};
use crate::token::{LeaseKey, Token};
use async_trait::async_trait;
use bytes::Bytes;

/// A bulk reply as bytes (`None` for nil).
fn bulk(v: Value) -> Option<Bytes> {
    v.into_bytes()
}

fn us(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A non-negative reply in milliseconds; `None` for Redis' -1 / -2.
fn millis(v: &Value) -> Option<Duration> {
    v.as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .map(Duration::from_millis)
}

/// Values on Redis, beside the compute lease under the same hash tag.
pub(crate) struct RedisValues {
    backend: RedisBackend,
}

impl fmt::Debug for RedisValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisValues")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// The cache's values on this server.
    pub(crate) fn values(&self) -> RedisValues {
        RedisValues {
            backend: self.clone(),
        }
    }
}

impl RedisValues {
    fn scripts(&self) -> &super::Scripts {
        &self.backend.inner.scripts
    }
}

#[async_trait]
impl ValueStore for RedisValues {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read> {
        let awaited = awaited.unwrap_or(0);
        let keys = vec![
            part(key, Part::Value),
            key.as_str().to_owned(),
            failed(key, awaited),
            part(key, Part::Cooldown),
        ];
        let args = vec![awaited.to_string().into()];
        let reply = self
            .backend
            .serving(key.as_str())
            .await?
            .eval(&self.scripts().cache_read, keys, args)
            .await?;
        let Value::Array(parts) = reply else {
            return Err(Error::backend("the cache read script returned no array"));
        };
        let Ok::<[Value; 11], _>(parts) = parts.try_into() else {
            return Err(Error::backend(
                "the cache read script returned a reply of another shape",
            ));
        };
        let [has, payload, delta, grace, pttl, round, lease_pttl, failed, message, by, cooling] =
            parts;
        let flag = |v: &Value| v.as_i64() == Some(1);
        let failed = if flag(&failed) {
            Some(
                bulk(message)
                    .map_or_else(String::new, |b| String::from_utf8_lossy(&b).into_owned()),
            )
        } else {
            None
        };
        let value = match (flag(&has), bulk(payload)) {
            (true, Some(bytes)) => Some(Cached {
                bytes,
                delta: Duration::from_micros(delta.as_u64().unwrap_or(0)),
                grace: Duration::from_millis(grace.as_u64().unwrap_or(0)),
                // -1 (no expiry) cannot come from this crate's writes; treat it as long-lived.
                pttl: millis(&pttl).unwrap_or(Duration::MAX),
                round: by.as_u64().filter(|&r| r > 0),
                cooldown: flag(&cooling),
            }),
            _ => None,
        };
        Ok(Read {
            value,
            held: lease_pttl.as_i64() != Some(-2),
            round: round.as_u64().filter(|&r| r > 0),
            lease_pttl: millis(&lease_pttl),
            failed,
        })
    }

    async fn fill(&self, key: &LeaseKey, token: &Token, fill: Fill) -> Result<bool> {
        let backend = self.backend.serving(key.as_str()).await?;
        let keys = vec![key.as_str().to_owned(), part(key, Part::Value)];
        let lifetime = fill.ttl.saturating_add(fill.grace);
        let args = vec![
            token.as_str().into(),
            Value::Bytes(fill.bytes),
            us(fill.delta).into(),
            ms(fill.grace).into(),
            ms(lifetime).max(1).into(),
            part(key, Part::Filled).into(),
            fill.round.to_string().into(),
        ];
        let reply = backend.eval(&self.scripts().cache_fill, keys, args).await?;
        Ok(reply.as_i64() == Some(1))
    }

    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool> {
        let backend = self.backend.serving(key.as_str()).await?;
        let keys = vec![
            key.as_str().to_owned(),
            failed(key, failure.round),
            part(key, Part::Cooldown),
        ];
        let args = vec![
            token.as_str().into(),
            failure.message.into(),
            ms(failure.keep).max(1).into(),
            part(key, Part::Filled).into(),
            failure.cooldown.map_or(0, |d| ms(d).max(1)).into(),
        ];
        let reply = backend.eval(&self.scripts().cache_fail, keys, args).await?;
        Ok(reply.as_i64() == Some(1))
    }

    async fn notify(&self, key: &LeaseKey) -> Result<()> {
        let backend = self.backend.serving(key.as_str()).await?;
        let channel = part(key, Part::Filled);
        // On a cluster node, to the shard channel its waiters SSUBSCRIBE to.
        let command = match backend.inner.clustered {
            true => "SPUBLISH",
            false => "PUBLISH",
        };
        let args = vec![Value::from(channel), Value::from("1")];
        let published = backend.inner.connection.command(command, args).await;
        published.map(drop).map_err(super::errors::store_error)
    }

    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        // Every message wakes every local listener.
        let backend = self.backend.serving(key.as_str()).await?;
        backend
            .inner
            .pubsub
            .subscribe(part(key, Part::Filled), true, None)
            .await
    }
}
