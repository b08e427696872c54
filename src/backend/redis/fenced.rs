//! Fenced writes: let the fencing token protect data, not just the lock.
//!
//! A lease cannot stop a holder that was paused past its TTL (GC, swap, a stopped VM) from
//! waking up and writing after the next holder took over. The resource has to refuse it:
//! every write carries the writer's [fencing token](crate::LockGuard::fencing_token), and the
//! resource remembers the newest token it applied and rejects older ones.

use bytes::Bytes;

use super::transport::Value;
use super::RedisBackend;
use crate::error::{Error, Result};

/// The outcome of [`RedisBackend::fenced_set`].
///
/// ```
/// let done = redlease::FencedWrite::Applied;
/// assert!(done.is_applied());
/// assert!(!redlease::FencedWrite::Rejected { newest: 7 }.is_applied());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a rejected write means a newer holder has written: stop and do not retry"]
pub enum FencedWrite {
    /// The value was written.
    Applied,
    /// Refused: a write with a newer fencing token was applied already. The caller's lease
    /// is over; it must not retry.
    Rejected {
        /// The fencing token of the write that set the value now.
        newest: u64,
    },
}

impl FencedWrite {
    /// Whether the value was written.
    pub fn is_applied(self) -> bool {
        matches!(self, FencedWrite::Applied)
    }
}

impl RedisBackend {
    /// Writes `value` to the Redis hash `key` (field `v`) only if `fencing_token` is not
    /// older than the token of the write that set the value now (kept beside it, field `f`,
    /// in the same key, so it works on Redis Cluster): one atomic script. A holder that was
    /// paused past its lease gets [`FencedWrite::Rejected`] once a later holder has written,
    /// so its late write cannot overwrite the later holder's work. Equal tokens pass (one
    /// holder may write several times).
    ///
    /// Read the value with [`fenced_get`](Self::fenced_get) (or `HGET key v`).
    ///
    /// ```no_run
    /// use redlease::{FencedWrite, LockManager, RedisBackend};
    /// # async fn demo() -> redlease::Result<()> {
    /// let redis = RedisBackend::connect("redis://127.0.0.1:6379").await?;
    /// let locks = LockManager::new(redis.clone());
    /// let guard = locks.lock("report:2024").acquire().await?;
    /// let report = b"...".to_vec();
    /// match redis.fenced_set("report:2024:data", report, guard.fencing_token()).await? {
    ///     FencedWrite::Applied => {
    ///         guard.release().await?;
    ///     }
    ///     FencedWrite::Rejected { newest } => {
    ///         // Our lease ran out while we worked, and holder #newest has written since.
    ///         eprintln!("lost the lock to holder {newest}; our result is discarded");
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # The same pattern elsewhere
    ///
    /// Any store that can compare on write can be fenced: keep the token of the last write
    /// beside the data and make the write conditional on it.
    ///
    /// - SQL: `UPDATE reports SET body = $1, fence = $2 WHERE id = $3 AND fence <= $2` (a row
    ///   count of 0 means rejected); for inserts, `INSERT ... ON CONFLICT (id) DO UPDATE SET
    ///   ... WHERE reports.fence <= EXCLUDED.fence`.
    /// - Object stores: put the token in the object's metadata and write with a conditional
    ///   request (`If-Match` on the ETag read together with an older token).
    /// - Services you own: accept the token with the request and refuse older ones.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if Redis fails, or `key` holds something other than a hash.
    pub async fn fenced_set(
        &self,
        key: &str,
        value: impl Into<Bytes>,
        fencing_token: u64,
    ) -> Result<FencedWrite> {
        let value = value.into();
        on_shard!(self, key, |node| node.fenced_set(
            key,
            value.clone(),
            fencing_token
        ));
        let keys = vec![key.to_owned()];
        let args = vec![Value::Bytes(value), Value::from(fencing_token.to_string())];
        let reply = self
            .eval(&self.inner.scripts.fenced_set, keys, args)
            .await?
            .into_array();
        let token = |v: &Value| {
            v.as_string()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| Error::backend(format!("fenced write: bad token in reply {v:?}")))
        };
        match reply.as_slice() {
            [ok, _] if ok.as_i64() == Some(1) => Ok(FencedWrite::Applied),
            [_, newest] => Ok(FencedWrite::Rejected {
                newest: token(newest)?,
            }),
            other => Err(Error::backend(format!(
                "fenced write: unexpected reply {other:?}"
            ))),
        }
    }

    /// The value at `key` written by [`fenced_set`](Self::fenced_set), with the fencing token
    /// of the write that set it; `None` if nothing was written.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if Redis fails, or `key` holds something other than a hash.
    pub async fn fenced_get(&self, key: &str) -> Result<Option<(Bytes, u64)>> {
        on_shard!(self, key, |node| node.fenced_get(key));
        let args = vec![Value::from(key), Value::from("v"), Value::from("f")];
        let fields: Vec<Option<Bytes>> = self
            .inner
            .connection
            .command("HMGET", args)
            .await
            .map_err(super::errors::store_error)?
            .into_array()
            .into_iter()
            .map(Value::into_bytes)
            .collect();
        match fields.as_slice() {
            [Some(v), Some(f)] => {
                let token = std::str::from_utf8(f)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| Error::backend("fenced value has a malformed token"))?;
                Ok(Some((v.clone(), token)))
            }
            _ => Ok(None),
        }
    }
}
