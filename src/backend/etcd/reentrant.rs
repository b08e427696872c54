//! Reentrant claims on etcd: a reign is the lock key (its value the first hold's token, the
//! reign's lease token), `P o/K` (the owner) and one key per hold, `P h/len:K/hold`, all on
//! the reign's etcd lease; `P e/K` (on the tombstone lease) names the hold whose release
//! ended the last reign, so a re-sent release of it answers `Some(0)` again.
//!
//! A hold is counted by a key of its own, so counting needs no arithmetic in a transaction
//! (etcd has none): the count is the number of hold keys, read in the same transaction that
//! puts or deletes one (a read after a write in one transaction sees it). A new reign is one
//! transaction; a re-entry is two (the first reads the reign's lease, the second puts the
//! hold on it while the lock, its lease and the owner are still those read). The last hold's
//! release is two: the second ends the reign only while no hold key is left (a range
//! compare on the hold keys, false when empty, guards it), so an owner's re-entry between
//! the two keeps its reign.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp};

use super::{first_kv, nested, yield_layer, EtcdBackend};
use crate::backend::{clock_drift, Acquire, Attempt, Claim, Grant, Release};
use crate::error::{Error, Result};
use crate::token::{LeaseKey, Owner, Token};

fn count_of(resp: Option<&etcd_client::TxnOpResponse>) -> u32 {
    match resp {
        Some(etcd_client::TxnOpResponse::Get(g)) => u32::try_from(g.count()).unwrap_or(u32::MAX),
        _ => 0,
    }
}

impl EtcdBackend {
    fn owner_key(&self, key: &LeaseKey) -> Vec<u8> {
        self.key("o", key.as_str())
    }

    fn ended_key(&self, key: &LeaseKey) -> Vec<u8> {
        self.key("e", key.as_str())
    }

    fn holds(&self, key: &LeaseKey) -> Vec<u8> {
        self.range_prefix("h", key)
    }

    fn count_holds(&self, key: &LeaseKey) -> TxnOp {
        TxnOp::get(
            self.holds(key),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
    }

    /// The number of holds of `key`'s reign, for `inspect` (`None` when none).
    pub(super) fn hold_count_op(&self, key: &LeaseKey) -> TxnOp {
        self.count_holds(key)
    }

    pub(super) async fn acquire_reentrant(
        &self,
        claim: &Claim,
        owner: &Owner,
        attempt: Attempt,
    ) -> Result<Acquire> {
        let (key, hold) = (&claim.key, &claim.token);
        let lock = self.lock_key(key);
        let lease = self.grant_for(hold, claim.ttl).await?;
        let on = || Some(PutOptions::new().with_lease(lease));
        let mut then = vec![
            TxnOp::put(lock.clone(), hold.as_str(), on()),
            TxnOp::put(self.owner_key(key), owner.as_str(), on()),
            TxnOp::put(self.in_range("h", key, hold), "", on()),
        ];
        if let Some(label) = hold.label() {
            then.push(TxnOp::put(self.label_key(key), label, on()));
        }
        then.push(TxnOp::delete(self.in_range("w", key, hold), None));
        then.push(TxnOp::get(lock.clone(), None));
        let mut els = vec![TxnOp::get(lock.clone(), None)];
        if matches!(attempt, Attempt::Waiting { .. }) {
            els.push(TxnOp::txn(
                Txn::new()
                    .when([Compare::create_revision(
                        self.bar_key(hold),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([TxnOp::put(self.in_range("w", key, hold), "", on())]),
            ));
        }
        let grant = Txn::new()
            .when([
                Compare::create_revision(lock.clone(), CompareOp::Equal, 0),
                Compare::create_revision(self.bar_key(hold), CompareOp::Equal, 0),
            ])
            .and_then(then)
            .or_else(els);
        let layer = matches!(attempt, Attempt::Arriving { .. });
        let inner = if layer {
            yield_layer(self.range_prefix("w", key), lock.clone(), grant)
        } else {
            grant
        };
        let mut epoch = self.epoch().await?;
        let mut tried = false;
        let (granted, kv) = loop {
            let resp = self
                .txn("acquire", self.under_epoch(inner.clone(), epoch))
                .await?;
            if !resp.succeeded() {
                if tried {
                    return Err(Error::backend(crate::backend::Unavailable(
                        "etcd: the fencing epoch keeps changing".into(),
                    )));
                }
                tried = true;
                epoch = self.refresh_epoch(Some(epoch)).await?;
                continue;
            }
            break super::read_acquire(&resp, layer)?;
        };
        let validity = claim.ttl.saturating_sub(clock_drift(claim.ttl));
        let fence =
            |kv: &KeyValue| epoch.saturating_add(u64::try_from(kv.create_revision()).unwrap_or(0));
        if granted {
            let kv = kv.ok_or_else(|| super::malformed("acquire"))?;
            let others = self.keep_only(hold, Some(lease));
            self.revoke_later(others);
            return Ok(Acquire::Granted(
                Grant::new(fence(&kv), validity, hold.clone()).with_hold_count(1),
            ));
        }
        let kept = matches!(attempt, Attempt::Waiting { .. }).then_some(lease);
        let Some(kv) = kv else {
            // Free, yet refused: waiters go first, or the hold was abandoned.
            let others = self.keep_only(hold, kept);
            self.revoke_later(others);
            return Ok(Acquire::Held { remaining: None });
        };
        // Held: a re-entry if the reign is the owner's (the hold on the reign's lease).
        let reign = Token::from_store(&String::from_utf8_lossy(kv.value()));
        let reign_lease = kv.lease();
        let txn = Txn::new()
            .when([
                Compare::value(lock.clone(), CompareOp::Equal, kv.value().to_vec()),
                Compare::lease(lock.clone(), CompareOp::Equal, reign_lease),
                Compare::value(self.owner_key(key), CompareOp::Equal, owner.as_str()),
                Compare::create_revision(self.bar_key(hold), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(
                    self.in_range("h", key, hold),
                    "",
                    Some(PutOptions::new().with_lease(reign_lease)),
                ),
                self.count_holds(key),
            ]);
        let resp = self.txn("re-entry", txn).await?;
        // The reign's lease stays (it is this token's own when this is a re-sent first
        // hold); the attempt's goes, or stays for a registered waiter.
        let keep = if resp.succeeded() {
            Some(reign_lease)
        } else {
            kept
        };
        let others = self.keep_only(hold, keep);
        self.revoke_later(others);
        if !resp.succeeded() {
            let remaining = Some(attempt.recheck().unwrap_or(Duration::ZERO));
            return Ok(Acquire::Held { remaining });
        }
        let count = count_of(resp.op_responses().get(1));
        // The reign's lease is kept alive again; it is promised no longer than it was
        // granted (a keep-alive cannot lengthen it).
        let Some(granted_secs) = self.keep_alive(reign_lease).await? else {
            return Ok(Acquire::Held { remaining: None });
        };
        let held_for = Duration::from_secs(u64::try_from(granted_secs).unwrap_or(0));
        let ttl = claim.ttl.min(held_for);
        let validity = ttl.saturating_sub(clock_drift(ttl));
        Ok(Acquire::Granted(
            Grant::new(fence(&kv), validity, reign).with_hold_count(count.max(1)),
        ))
    }

    pub(super) async fn release_reentrant(
        &self,
        claim: &Claim,
        how: Release<'_>,
    ) -> Result<Option<u32>> {
        let (key, hold) = (&claim.key, &claim.token);
        let lock = self.lock_key(key);
        let held = self.in_range("h", key, hold);
        let tomb = self.tomb_lease(false).await?;
        let on_tomb = || Some(PutOptions::new().with_lease(tomb));
        let abandon = how == Release::Abandon;
        let mut when = vec![Compare::create_revision(
            held.clone(),
            CompareOp::Greater,
            0,
        )];
        if let Release::Confirmed { lease } = how {
            when.push(Compare::value(
                lock.clone(),
                CompareOp::Equal,
                lease.as_str(),
            ));
        }
        let mut then = vec![
            TxnOp::delete(held, None),
            TxnOp::get(lock.clone(), None),
            self.count_holds(key),
        ];
        let mut els = vec![
            TxnOp::get(lock.clone(), None),
            self.count_holds(key),
            TxnOp::get(self.ended_key(key), None),
        ];
        if abandon {
            then.push(TxnOp::put(self.bar_key(hold), "", on_tomb()));
            els.push(TxnOp::put(self.bar_key(hold), "", on_tomb()));
            then.push(TxnOp::delete(self.in_range("w", key, hold), None));
            els.push(TxnOp::delete(self.in_range("w", key, hold), None));
        }
        let resp = self
            .txn("release", Txn::new().when(when).and_then(then).or_else(els))
            .await?;
        let ops = resp.op_responses();
        // This hold's attempts' leases go, but the reign's (this token's own, when it started
        // the reign) only with the reign.
        let lock_at = if resp.succeeded() { 1 } else { 0 };
        let reign_lease = ops.get(lock_at).and_then(first_kv).map(KeyValue::lease);
        let mut ids = self.keep_only(hold, None);
        ids.retain(|i| Some(*i) != reign_lease);
        self.revoke_later(ids);
        if !resp.succeeded() {
            if abandon {
                return Ok(None);
            }
            let lock_kv = ops.first().and_then(first_kv);
            let lease = match how {
                Release::Confirmed { lease } => lease.as_str().as_bytes(),
                Release::Abandon => &[],
            };
            if lock_kv.is_some_and(|kv| kv.value() == lease) {
                // Counted in this reign and gone already: a re-sent release.
                return Ok(Some(count_of(ops.get(1))));
            }
            let ended = ops.get(2).and_then(first_kv);
            let by_this = ended.is_some_and(|kv| kv.value() == hold.as_str().as_bytes());
            return Ok((lock_kv.is_none() && by_this).then_some(0));
        }
        let left = count_of(ops.get(2));
        if left > 0 {
            return Ok(Some(left));
        }
        // The last hold: the reign ends, unless a re-entry came in between.
        let Some(reign) = ops.get(1).and_then(first_kv).cloned() else {
            return Ok(Some(0));
        };
        let end = Txn::new()
            .when([Compare::value(
                lock.clone(),
                CompareOp::Equal,
                reign.value().to_vec(),
            )])
            .and_then([
                TxnOp::delete(lock, None),
                TxnOp::delete(self.owner_key(key), None),
                TxnOp::delete(self.label_key(key), None),
                TxnOp::put(self.ended_key(key), hold.as_str(), on_tomb()),
            ]);
        let txn = Txn::new()
            .when([Compare::create_revision(self.holds(key), CompareOp::Greater, 0).with_prefix()])
            .and_then([self.count_holds(key)])
            .or_else([TxnOp::txn(end)]);
        let resp = self.txn("release", txn).await?;
        if resp.succeeded() {
            return Ok(Some(count_of(resp.op_responses().first())));
        }
        let ended = resp
            .op_responses()
            .first()
            .and_then(nested)
            .is_some_and(|t| t.succeeded());
        if ended {
            self.revoke_later(vec![reign.lease()]);
        }
        Ok(Some(0))
    }
}
