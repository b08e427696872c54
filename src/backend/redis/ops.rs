//! Acquires and releases: the scripts' arguments and replies, and group commit (concurrent
//! calls of one kind sent as one script call, see `batch.rs`). Reentrant claims go alone.
//! Shared holds (reads, permits) have their acquire script, and are released with the
//! plain leases (`release.lua` tells them by their token).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::keys::ms;
use super::transport::{self, Script, Value};
use super::RedisBackend;
use crate::backend::{clock_drift, Acquire, Attempt, Claim, Grant, NodeTerms, NotSent, Refused};
use crate::error::{Error, Result};
use crate::token::{LeaseKey, Owner, Token};

/// How long an abandoned attempt's token stays barred. A late copy of an attempt arrives
/// after a reconnect (seconds); this leaves a wide margin at the cost of one sorted-set entry
/// per abandoned attempt.
pub(super) const TOMBSTONE: Duration = Duration::from_secs(300);

/// The last send number taken in this process (see [`next_sent`]).
static SENT: AtomicU64 = AtomicU64::new(0);

/// A new send number: strictly larger than every one taken before in this process. Every
/// acquire and release takes one when it is made, before anything is sent, and sends it with
/// each lease ("Send order" in `scripts/prelude.lua`): a release ends only a lease granted by
/// an acquire sent before it, so a late copy of a release (re-sent by a client after a reconnect
/// while the first copy still waited somewhere on its way) cannot end the lease that a later
/// acquire with the same token was granted. A token is used by one process only, so the
/// numbers compared for one token all come from this counter.
pub(super) fn next_sent() -> u64 {
    SENT.fetch_add(1, Ordering::Relaxed) + 1
}

/// One plain, fair or shared acquire attempt, or one release (no tombstone) or abandon (a
/// tombstone), as queued for a batched script call. Acquires and releases share one queue, so that
/// they reach the server in the order they were made: a release (or a quorum's clean-up) that
/// a caller made before its next attempt with the same token can never run after that
/// attempt and delete its grant.
#[derive(Clone)]
pub(super) enum Op {
    Acquire {
        claim: Claim,
        attempt: Attempt,
        terms: NodeTerms,
        sent: u64,
    },
    /// `min_uptime`: a single server's restart quarantine (`NodeTerms::min_uptime`; fair
    /// claims are not served over Redlock).
    Fair {
        claim: Claim,
        attempt: Attempt,
        min_uptime: Duration,
        sent: u64,
    },
    /// A read (`permits` 0) or one of `permits` permits; `min_uptime` as for `Fair`.
    Shared {
        claim: Claim,
        permits: u32,
        attempt: Attempt,
        min_uptime: Duration,
        sent: u64,
    },
    Release {
        key: LeaseKey,
        token: Token,
        tombstone: Duration,
        sent: u64,
    },
}

/// A script's answer for one operation, as it came (an acquire's `{code, value}` pair, a
/// release's `{n, 0}`): the caller, who knows what it sent, reads it.
pub(super) type Reply = (i64, i64);

/// One operation's outcome in a batch: its reply, or the error of its own commands (or of
/// its script call as a whole), never a neighbour's.
pub(super) type Outcome = Result<Reply>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Acquire,
    Fair,
    Shared,
    Release,
}

impl Op {
    fn kind(&self) -> Kind {
        match self {
            Op::Acquire { .. } => Kind::Acquire,
            Op::Fair { .. } => Kind::Fair,
            Op::Shared { .. } => Kind::Shared,
            Op::Release { .. } => Kind::Release,
        }
    }

    fn key(&self) -> &LeaseKey {
        match self {
            Op::Acquire { claim, .. } | Op::Fair { claim, .. } | Op::Shared { claim, .. } => {
                &claim.key
            }
            Op::Release { key, .. } => key,
        }
    }
}

/// Reads an acquire script's `{1, fence} | {0, ms} | {2, ms}` answer for `claim`.
pub(super) fn acquired(claim: &Claim, (code, value): Reply) -> Result<Acquire> {
    let remaining = |ms: i64| u64::try_from(ms).ok().map(Duration::from_millis);
    let validity = claim.ttl.saturating_sub(clock_drift(claim.ttl));
    match code {
        1 => Ok(Acquire::Granted(Grant::new(
            u64::try_from(value).unwrap_or(0),
            validity,
            claim.token.clone(),
        ))),
        0 => Ok(Acquire::Held {
            remaining: remaining(value),
        }),
        2 => Ok(Acquire::Warming {
            remaining: remaining(value).unwrap_or_default(),
        }),
        other => Err(Error::backend(format!(
            "unexpected reply from the acquire script: {{{other}, {value}}}"
        ))),
    }
}

impl RedisBackend {
    /// Sends one acquire or release through the shared queue (group commit).
    pub(super) async fn op(&self, op: Op) -> Result<Reply> {
        // A release is sent even if its caller stops waiting for the answer.
        let keep = matches!(op, Op::Release { .. });
        let this = self.clone();
        let outcome = self
            .inner
            .ops
            .call(op, keep, move |ops| this.clone().ops_batch(ops))
            .await?;
        if let Err(Error::Backend { source }) = &outcome {
            // An entry's own error: "<key>: <what the server said>".
            let text = source.to_string();
            self.said(
                text.split_once(": ")
                    .map_or(text.as_str(), |(_, said)| said),
            );
        }
        outcome
    }

    /// Sends queued operations as few script calls as their order allows: operations on
    /// different keys may be regrouped freely, those on one key run in the order they were
    /// made. Each operation joins the first phase of its kind that is not before its key's
    /// previous operation (the same phase if of the same kind: a script runs its entries in
    /// order); phases are sent back to back, in order, on the one connection. Distinct keys
    /// (the common case) make at most one phase per kind. On a cluster node a script call
    /// may touch one slot only: a phase holds one slot's operations.
    async fn ops_batch(self, ops: Vec<Op>) -> Result<Vec<Outcome>> {
        let count = ops.len();
        let clustered = self.inner.clustered;
        let slot = |op: &Op| clustered.then(|| transport::slot(op.key().as_str().as_bytes()));
        let phases = if count == 1 {
            // A lone call (the inline path): no grouping to do.
            ops.iter()
                .map(|op| ((op.kind(), slot(op)), vec![0]))
                .collect()
        } else {
            phases(
                ops.iter()
                    .map(|op| ((op.kind(), slot(op)), op.key().as_str())),
            )
        };
        let mut slots: Vec<Option<Op>> = ops.into_iter().map(Some).collect();
        let calls = phases.into_iter().map(|((kind, _), idx)| {
            let taken: Vec<Op> = idx.iter().filter_map(|&i| slots[i].take()).collect();
            let this = self.clone();
            async move {
                let replies = match kind {
                    Kind::Acquire => this.acquire_batch(&taken).await,
                    Kind::Fair => this.fair_batch(&taken).await,
                    Kind::Shared => this.shared_batch(&taken).await,
                    Kind::Release => this.release_batch(&taken).await,
                };
                let replies = replies.and_then(|r| {
                    if r.len() == idx.len() {
                        Ok(r)
                    } else {
                        Err(Error::backend("a batched call returned the wrong count"))
                    }
                });
                (idx, replies)
            }
        });
        // Polled in order, each call is handed to the connection on its first poll: the
        // phases go out back to back, and the server runs them in that order.
        let calls: Vec<_> = calls.collect();
        let mut out: Vec<Option<Outcome>> = (0..count).map(|_| None).collect();
        for (idx, replies) in futures::future::join_all(calls).await {
            match replies {
                Ok(replies) => {
                    for (i, reply) in idx.into_iter().zip(replies) {
                        out[i] = Some(reply);
                    }
                }
                // A phase that failed as a whole fails its own operations only.
                Err(e) => {
                    for i in idx {
                        out[i] = Some(Err(crate::backend::for_each_caller(&e)));
                    }
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::backend("a batched operation got no reply"))))
            .collect())
    }

    /// Attempts as one call of `script`: each operation that `entry` reads gives its key and
    /// its arguments (`width` of them); one `{code, value}` per attempt, in order.
    async fn attempts<I: IntoIterator<Item = Value>>(
        &self,
        script: &Script,
        ops: &[Op],
        width: usize,
        entry: impl Fn(&Op) -> Option<(&Claim, I)>,
    ) -> Result<Vec<Outcome>> {
        let mut keys: Vec<String> = Vec::with_capacity(ops.len());
        let mut args: Vec<Value> = Vec::with_capacity(ops.len() * width);
        for (claim, values) in ops.iter().filter_map(entry) {
            keys.push(claim.key.as_str().to_owned());
            args.extend(values);
        }
        let reply = self.eval(script, self.declared(keys), args).await?;
        pairs(reply.into_array(), ops)
    }

    /// Plain attempts as one `acquire.lua` call.
    async fn acquire_batch(&self, ops: &[Op]) -> Result<Vec<Outcome>> {
        self.attempts(&self.inner.scripts.acquire, ops, 8, |op| {
            let Op::Acquire {
                claim,
                attempt,
                terms,
                sent,
            } = op
            else {
                return None;
            };
            // The waiters flag outlives the waiter's next re-check, so a release in between
            // still publishes.
            let flag = attempt.keep_waiter().map_or(0, ms);
            let arriving = i64::from(matches!(attempt, Attempt::Arriving { .. }));
            Some((
                claim,
                [
                    claim.token.as_str().into(),
                    ms(claim.ttl).into(),
                    flag.into(),
                    arriving.into(),
                    // Lua numbers are doubles: exact up to 2^53, far above any token.
                    terms.fence_floor.to_string().into(),
                    ms(terms.min_uptime).into(),
                    claim.token.label().unwrap_or_default().into(),
                    i64::try_from(*sent).unwrap_or(i64::MAX).into(),
                ],
            ))
        })
        .await
    }

    /// Fair attempts as one `fair_acquire.lua` call.
    async fn fair_batch(&self, ops: &[Op]) -> Result<Vec<Outcome>> {
        self.attempts(&self.inner.scripts.fair_acquire, ops, 6, |op| {
            let Op::Fair {
                claim,
                attempt,
                min_uptime,
                sent,
            } = op
            else {
                return None;
            };
            // At least 1 ms for a waiter: 0 means a single attempt.
            let expire = attempt.keep_waiter().map_or(0, |e| ms(e).max(1));
            Some((
                claim,
                [
                    claim.token.as_str().into(),
                    ms(claim.ttl).into(),
                    expire.into(),
                    claim.token.label().unwrap_or_default().into(),
                    i64::try_from(*sent).unwrap_or(i64::MAX).into(),
                    ms(*min_uptime).into(),
                ],
            ))
        })
        .await
    }

    /// Shared attempts (reads, permits) as one `shared_acquire.lua` call.
    async fn shared_batch(&self, ops: &[Op]) -> Result<Vec<Outcome>> {
        self.attempts(&self.inner.scripts.shared_acquire, ops, 8, |op| {
            let Op::Shared {
                claim,
                permits,
                attempt,
                min_uptime,
                sent,
            } = op
            else {
                return None;
            };
            // As for plain attempts: the waiters flag outlives the next re-check.
            let flag = attempt.keep_waiter().map_or(0, ms);
            let arriving = i64::from(matches!(attempt, Attempt::Arriving { .. }));
            Some((
                claim,
                [
                    claim.token.as_str().into(),
                    ms(claim.ttl).into(),
                    flag.into(),
                    arriving.into(),
                    i64::from(*permits).into(),
                    claim.token.label().unwrap_or_default().into(),
                    i64::try_from(*sent).unwrap_or(i64::MAX).into(),
                    ms(*min_uptime).into(),
                ],
            ))
        })
        .await
    }

    /// Releases and abandons as one `release.lua` call; one `{1|0, 0}` (or the error of its
    /// own commands) per request.
    async fn release_batch(&self, ops: &[Op]) -> Result<Vec<Outcome>> {
        let mut keys: Vec<String> = Vec::with_capacity(ops.len());
        let mut args: Vec<Value> = Vec::with_capacity(ops.len() * 3);
        for op in ops {
            let Op::Release {
                key,
                token,
                tombstone,
                sent,
            } = op
            else {
                continue;
            };
            keys.push(key.as_str().to_owned());
            args.extend([
                token.as_str().into(),
                ms(*tombstone).into(),
                i64::try_from(*sent).unwrap_or(i64::MAX).into(),
            ]);
        }
        let reply = self
            .eval(&self.inner.scripts.release, self.declared(keys), args)
            .await?
            .into_array();
        Ok(ops
            .iter()
            .zip(reply)
            .map(|(op, n)| match n.as_i64() {
                Some(n) => Ok((n, 0)),
                None => Err(failed(op, &n)),
            })
            .collect())
    }

    /// Fails at once when the connection is down and the caller asked to (a quorum member
    /// that does not answer now is better skipped than waited for).
    pub(super) fn check_connected(&self, terms: NodeTerms) -> Result<()> {
        let connection = &self.inner.connection;
        if terms.fail_fast && !connection.is_connected() {
            return Err(Error::backend(NotSent(format!(
                "not connected to {} (reconnecting)",
                connection.server()
            ))));
        }
        Ok(())
    }

    /// One `reentrant_acquire.lua` call (not group-committed: reentrant attempts are rare
    /// next to plain ones, and each is one EVALSHA).
    pub(super) async fn reentrant_acquire(
        &self,
        claim: &Claim,
        owner: &Owner,
        attempt: Attempt,
        terms: NodeTerms,
        sent: u64,
    ) -> Result<Acquire> {
        let (key, hold) = (&claim.key, &claim.token);
        let keys = vec![key.as_str().to_owned()];
        // As for plain attempts: the waiters flag outlives the next re-check.
        let flag = attempt.keep_waiter().map_or(0, ms);
        let arriving = i64::from(matches!(attempt, Attempt::Arriving { .. }));
        let args: Vec<Value> = vec![
            owner.as_str().into(),
            hold.as_str().into(),
            ms(claim.ttl).into(),
            flag.into(),
            arriving.into(),
            terms.fence_floor.to_string().into(),
            ms(terms.min_uptime).into(),
            hold.label().unwrap_or_default().into(),
            i64::try_from(sent).unwrap_or(i64::MAX).into(),
        ];
        let reply = self
            .eval(
                &self.inner.scripts.reentrant_acquire,
                self.declared(keys),
                args,
            )
            .await?
            .into_array();
        let int = |v: Option<&Value>| v.and_then(Value::as_i64);
        match (int(reply.first()), reply.len()) {
            (Some(1), 4) => {
                let lease = reply[2]
                    .as_string()
                    .filter(|t| t.starts_with('h'))
                    .ok_or_else(|| Error::backend("reentrant acquire returned no lease token"))?;
                let fence = int(reply.get(1)).and_then(|f| u64::try_from(f).ok());
                let count = int(reply.get(3)).and_then(|c| u32::try_from(c).ok());
                let validity = claim.ttl.saturating_sub(clock_drift(claim.ttl));
                Ok(Acquire::Granted(
                    Grant::new(fence.unwrap_or(0), validity, Token::from_store(&lease))
                        .with_hold_count(count.unwrap_or(0)),
                ))
            }
            (Some(code @ (0 | 2)), 2) => acquired(claim, (code, int(reply.get(1)).unwrap_or(-1))),
            _ => Err(Error::backend(format!(
                "unexpected reply from the reentrant acquire script: {reply:?}"
            ))),
        }
    }

    /// One `reentrant_release.lua` call; `lease` as in `Release::Confirmed` (`None`: abandon).
    pub(super) async fn reentrant_release(
        &self,
        claim: &Claim,
        owner: &Owner,
        lease: Option<&Token>,
        sent: u64,
    ) -> Result<Option<u32>> {
        let (key, hold) = (&claim.key, &claim.token);
        let keys = vec![key.as_str().to_owned()];
        let tombstone = if lease.is_some() { 0 } else { ms(TOMBSTONE) };
        let args: Vec<Value> = vec![
            owner.as_str().into(),
            hold.as_str().into(),
            lease.map_or("", Token::as_str).into(),
            tombstone.into(),
            i64::try_from(sent).unwrap_or(i64::MAX).into(),
        ];
        let reply: Vec<Option<i64>> = self
            .eval(
                &self.inner.scripts.reentrant_release,
                self.declared(keys),
                args,
            )
            .await?
            .into_array()
            .iter()
            .map(Value::as_i64)
            .collect();
        match reply.as_slice() {
            [Some(1), Some(left)] => Ok(Some(u32::try_from(*left).unwrap_or(0))),
            [Some(0), _] => Ok(None),
            other => Err(Error::backend(format!(
                "unexpected reply from the reentrant release script: {other:?}"
            ))),
        }
    }
}

impl RedisBackend {
    /// Ends the lease on the lock at `key` whoever holds it, for an operator (`redlease
    /// release --force`), and deletes a reentrant reign's counts; its waiters are woken (a
    /// fair queue's head by name). The lock's record stays with its fencing counter, so the
    /// next holder's token is still larger; the holder, if alive, finds its lease lost at its
    /// next extension. Returns whether a lease was held.
    ///
    /// This breaks the lock's promise for its current holder: use it for a holder known to
    /// be gone whose lease is too long to wait out.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if Redis fails.
    pub async fn force_release(&self, key: &LeaseKey) -> Result<bool> {
        on_shard!(self, key.as_str(), |node| node.force_release(key));
        let keys = vec![key.as_str().to_owned()];
        let deleted = self
            .eval(
                &self.inner.scripts.force_release,
                self.declared(keys),
                Vec::new(),
            )
            .await?;
        Ok(deleted.as_i64().unwrap_or(0) > 0)
    }
}

/// A flat `{code, value, code, value, …}` reply as one pair per request; `{-1, text}` is the
/// request's own error (see `prelude.lua`).
fn pairs(reply: Vec<Value>, ops: &[Op]) -> Result<Vec<Outcome>> {
    if reply.len() != ops.len() * 2 {
        return Err(Error::backend(format!(
            "acquire script returned {} values for {} attempts",
            reply.len(),
            ops.len(),
        )));
    }
    Ok(reply
        .chunks(2)
        .zip(ops)
        .map(|(p, op)| match (p[0].as_i64(), p[1].as_i64()) {
            (Some(code), Some(value)) if code != -1 => Ok((code, value)),
            // (A nil value reads as -1, as the acquire scripts' PTTL of a missing key.)
            (Some(code), None) if code != -1 && p[1].is_null() => Ok((code, -1)),
            _ => Err(failed(op, &p[1])),
        })
        .collect())
}

/// The error of one operation's own commands, as its script reported it: refused for good,
/// unless the server said it cannot write now but may soon (a failover, too few replicas).
fn failed(op: &Op, text: &Value) -> Error {
    let said = text.as_string().unwrap_or_else(|| format!("{text:?}"));
    let what = format!("{}: {said}", op.key());
    if super::errors::passing(&said) {
        Error::backend(crate::backend::Unavailable(what))
    } else {
        Error::backend(Refused(what))
    }
}

/// Groups operations `(kind, key)` into phases (see `RedisBackend::ops_batch`): indices per
/// phase, in order. A kind is whatever must be the same within one script call (the
/// operation, and on a cluster the slot).
fn phases<'a, K: PartialEq + Copy>(
    ops: impl Iterator<Item = (K, &'a str)>,
) -> Vec<(K, Vec<usize>)> {
    let mut phases: Vec<(K, Vec<usize>)> = Vec::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (i, (kind, key)) in ops.enumerate() {
        let after = last.get(key).copied();
        let fits = |p: usize| phases[p].0 == kind && after.is_none_or(|a| p >= a);
        let phase = match (0..phases.len()).find(|&p| fits(p)) {
            Some(p) => p,
            None => {
                phases.push((kind, Vec::new()));
                phases.len() - 1
            }
        };
        phases[phase].1.push(i);
        last.insert(key, phase);
    }
    phases
}

#[cfg(test)]
mod tests {
    use super::{phases, Kind};

    #[test]
    fn distinct_keys_make_one_phase_per_kind_and_one_key_keeps_its_order() {
        use Kind::{Acquire as A, Release as R};
        // Distinct keys, interleaved kinds: one acquire phase, one release phase.
        let ops = [(A, "a"), (R, "b"), (A, "c"), (R, "d"), (A, "e")];
        assert_eq!(
            phases(ops.into_iter()),
            vec![(A, vec![0, 2, 4]), (R, vec![1, 3])]
        );
        // One key released then acquired again: the acquire waits for a later phase.
        let ops = [(A, "a"), (R, "k"), (A, "k"), (R, "b")];
        assert_eq!(
            phases(ops.into_iter()),
            vec![(A, vec![0]), (R, vec![1, 3]), (A, vec![2])]
        );
        // The same kind twice on one key shares a phase (a script runs entries in order).
        let ops = [(R, "k"), (R, "k"), (A, "x")];
        assert_eq!(phases(ops.into_iter()), vec![(R, vec![0, 1]), (A, vec![2])]);
    }
}
