//! The stampede cache's values on etcd, beside the compute lease (the lock key `P l/K`):
//!
//! - `P v/K`: the value, on a lease of its lifetime (TTL + grace, rounded up to seconds);
//!   its bytes are a header (the compute's delta in µs, the grace in ms, the round, the
//!   expiry in wall-clock µs, 8 bytes each, big-endian) and the payload. The expiry is the
//!   writer's clock: the lease's seconds are too coarse for XFetch.
//! - `P x/len:K/round`: a failed round's message, on a lease of its keep time.
//! - `P c/K`: the refresh cooldown's end (wall-clock µs), on a lease of the cooldown.
//! - `P n/K`: the fill notification: a put of it (in the fill's or failure's transaction,
//!   or by itself) wakes every local subscriber through the backend's watch stream.
//!
//! A fill or a failure is one lease grant and one transaction that writes only while the
//! lock key holds the writer's token (a fenced write); a read is one transaction (and a
//! lease TTL read while a round is under way).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};

use super::{first_kv, lease_secs, now_us, EtcdBackend};
use crate::backend::values::{Cached, Failure, Fill, Read, ValueStore};
use crate::backend::{Backend, Subscription};
use crate::error::Result;
use crate::token::{LeaseKey, Token};

const HEADER: usize = 32;

/// Values on etcd, beside the compute leases of an [`EtcdBackend`].
pub(crate) struct EtcdValues {
    backend: EtcdBackend,
}

impl fmt::Debug for EtcdValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdValues")
            .field("backend", &self.backend)
            .finish()
    }
}

impl EtcdBackend {
    /// The cache's values on this store.
    pub(crate) fn values(&self) -> EtcdValues {
        EtcdValues {
            backend: self.clone(),
        }
    }

    fn failed_key(&self, key: &LeaseKey, round: u64) -> Vec<u8> {
        let mut k = self.range_prefix("x", key);
        k.extend_from_slice(round.to_string().as_bytes());
        k
    }
}

fn be(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i * 8..i * 8 + 8]);
    u64::from_be_bytes(a)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl EtcdValues {
    /// A lease of `ttl` (rounded up) for the cache's keys.
    async fn lease(&self, ttl: Duration) -> Result<i64> {
        let mut c = self.backend.client();
        let resp = self
            .backend
            .call("lease grant", c.lease_grant(lease_secs(ttl), None))
            .await?;
        Ok(resp.id())
    }

    /// Runs `then` if `token` holds `key`'s lock; whether it did. The leases in `leases`
    /// go if it did not.
    async fn fenced(
        &self,
        key: &LeaseKey,
        token: &Token,
        then: Vec<TxnOp>,
        leases: Vec<i64>,
    ) -> Result<bool> {
        let txn = Txn::new()
            .when([Compare::value(
                self.backend.lock_key(key),
                CompareOp::Equal,
                token.as_str(),
            )])
            .and_then(then);
        let resp = self.backend.txn("cache write", txn).await;
        let written = matches!(&resp, Ok(r) if r.succeeded());
        if written {
            // The value's earlier lease, read before the put, has no keys left: it goes.
            if let Ok(r) = &resp {
                let old: Vec<i64> = r
                    .op_responses()
                    .iter()
                    .filter_map(first_kv)
                    .map(|kv| kv.lease())
                    .filter(|l| *l != 0 && !leases.contains(l))
                    .collect();
                self.backend.revoke_later(old);
            }
        } else {
            self.backend.revoke_later(leases);
        }
        resp.map(|_| written)
    }
}

#[async_trait]
impl ValueStore for EtcdValues {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read> {
        let b = &self.backend;
        let epoch = b.epoch().await?;
        let mut ops = vec![
            TxnOp::get(b.key("v", key.as_str()), None),
            TxnOp::get(b.lock_key(key), None),
            TxnOp::get(b.key("c", key.as_str()), None),
        ];
        if let Some(round) = awaited {
            ops.push(TxnOp::get(self.backend.failed_key(key, round), None));
        }
        let resp = b.txn("cache read", Txn::new().and_then(ops)).await?;
        let answers = resp.op_responses();
        let got = |i: usize| answers.get(i).and_then(first_kv);
        let now = now_us();
        let cooldown = got(2)
            .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse::<u64>().ok())
            .is_some_and(|until| until > now);
        let value = got(0)
            .filter(|kv| kv.value().len() >= HEADER)
            .and_then(|kv| {
                let v = kv.value();
                let expires = be(v, 3);
                (expires > now).then(|| Cached {
                    bytes: Bytes::copy_from_slice(&v[HEADER..]),
                    delta: Duration::from_micros(be(v, 0)),
                    grace: Duration::from_millis(be(v, 1)),
                    pttl: Duration::from_micros(expires - now),
                    round: Some(be(v, 2)).filter(|r| *r > 0),
                    cooldown,
                })
            });
        let lock = got(1);
        let failed = got(3).map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
        let (held, round, lease_pttl) = match lock {
            Some(kv) => {
                let round = epoch.saturating_add(u64::try_from(kv.create_revision()).unwrap_or(0));
                // A holder that dies never fills: waiters look again when its lease ends.
                let mut c = b.client();
                let ttl = b
                    .call("lease ttl", c.lease_time_to_live(kv.lease(), None))
                    .await?;
                let left = u64::try_from(ttl.ttl()).ok().map(Duration::from_secs);
                (true, Some(round), left)
            }
            None => (false, None, None),
        };
        Ok(Read {
            value,
            held,
            round,
            lease_pttl,
            failed,
        })
    }

    async fn fill(&self, key: &LeaseKey, token: &Token, fill: Fill) -> Result<bool> {
        let b = &self.backend;
        let lifetime = fill.ttl.saturating_add(fill.grace);
        let lease = self.lease(lifetime).await?;
        let mut bytes = Vec::with_capacity(HEADER + fill.bytes.len());
        let expires = now_us().saturating_add(us(lifetime));
        for n in [us(fill.delta), ms(fill.grace), fill.round, expires] {
            bytes.extend_from_slice(&n.to_be_bytes());
        }
        bytes.extend_from_slice(&fill.bytes);
        let on = || Some(PutOptions::new().with_lease(lease));
        let value = b.key("v", key.as_str());
        let then = vec![
            TxnOp::get(value.clone(), None),
            TxnOp::put(value, bytes, on()),
            TxnOp::put(b.key("n", key.as_str()), "", on()),
        ];
        self.fenced(key, token, then, vec![lease]).await
    }

    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool> {
        let b = &self.backend;
        let keep = self.lease(failure.keep).await?;
        let mut leases = vec![keep];
        let mut then = vec![
            TxnOp::put(
                b.failed_key(key, failure.round),
                failure.message,
                Some(PutOptions::new().with_lease(keep)),
            ),
            TxnOp::put(
                b.key("n", key.as_str()),
                "",
                Some(PutOptions::new().with_lease(keep)),
            ),
        ];
        if let Some(cooldown) = failure.cooldown {
            let lease = self.lease(cooldown).await?;
            leases.push(lease);
            let until = now_us().saturating_add(us(cooldown));
            then.push(TxnOp::put(
                b.key("c", key.as_str()),
                until.to_string(),
                Some(PutOptions::new().with_lease(lease)),
            ));
        }
        self.fenced(key, token, then, leases).await
    }

    async fn notify(&self, key: &LeaseKey) -> Result<()> {
        let b = &self.backend;
        let mut fresh = false;
        loop {
            let tomb = b.tomb_lease(fresh).await?;
            let put = TxnOp::put(
                b.key("n", key.as_str()),
                "",
                Some(PutOptions::new().with_lease(tomb)),
            );
            match b.txn("cache notify", Txn::new().and_then([put])).await {
                Ok(_) => return Ok(()),
                // The tombstone lease was lost (a wiped store): once more with a new one.
                Err(e) if !fresh && e.to_string().contains("lease not found") => fresh = true,
                Err(e) => return Err(e),
            }
        }
    }

    /// Every put of the notification key wakes every local listener.
    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        let b = &self.backend;
        b.subscribe_key_every(b.key("n", key.as_str())).await
    }
}
