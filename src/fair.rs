//! The fair (FIFO) acquire loop: waiters queue on the store and the lock is handed to them
//! in arrival order.
//!
//! The store keeps the queue (on Redis a list of tokens plus a sorted set of their
//! deadlines, see `backend/redis/fair_acquire.lua`). A waiter joins it with its first
//! attempt and stays in it by coming back at least every `retry.max_delay`; the store evicts
//! a waiter that has not come back within [`waiter_expiry`]. A release hands the free lock
//! to the head by waking only the head's subscription (on Redis, the head's token published
//! on the key's hand-off channel); the fallback re-check covers a lost wake-up.
//!
//! A waiter that gives up (timeout, error, dropped future) has its token abandoned in the
//! background, which also takes it out of the queue and, if it was the head of a free lock,
//! wakes the next waiter at once.

use std::time::{Duration, Instant};

use crate::backend::{Acquire, FairAttempt, Subscription};
use crate::error::{Error, Result};
use crate::guard::{LockGuard, ReleaseOnDrop};
use crate::lock::{Lock, Pauses};
use crate::runtime::{self, Rt};
use crate::token::Token;

/// How long the store keeps a waiter that re-checks every `recheck` at the latest: one
/// missed re-check of slack, plus a margin for the round trip.
pub(crate) fn waiter_expiry(recheck: Duration) -> Duration {
    recheck
        .saturating_mul(2)
        .saturating_add(Duration::from_millis(100))
}

/// The fair acquire loop. `wait`: `None` = one attempt (never queues); `Some(limit)` =
/// queue and wait, up to `limit`.
pub(crate) async fn run(lock: &Lock, wait: Option<Option<Duration>>) -> Result<Option<LockGuard>> {
    let opts = lock.options();
    let began = Instant::now();
    let deadline = wait.flatten().and_then(|d| began.checked_add(d));
    let timeout = || Error::Timeout {
        waited: began.elapsed(),
    };
    let backend = lock.manager.backend.clone();
    let key = lock.key();
    let mut pending = ReleaseOnDrop {
        backend: backend.clone(),
        key: key.clone(),
        token: Token::random().with_label(opts.holder_label.clone()),
        rt: Rt::current(),
        armed: false,
        confirmed: false,
    };
    let recheck = opts.retry.max_delay;
    let attempt = match wait {
        None => FairAttempt::Once,
        Some(_) => FairAttempt::Queued {
            expire: waiter_expiry(recheck),
        },
    };
    let notify = wait.is_some() && opts.retry.notify;
    let mut sub: Option<Subscription> = None;
    let mut pauses = Pauses::new(&opts.retry, notify);
    let mut first = true;
    loop {
        let woken = sub.as_ref().map(Subscription::listen);
        let started = Instant::now();
        // From the first attempt on, the token may hold the lease or stand in the queue:
        // until a guard takes it over, giving up (an error, the deadline, a dropped future)
        // abandons it in the background, which also leaves the queue.
        pending.armed = true;
        let tried = backend.fair_acquire(key, &pending.token, opts.ttl, attempt);
        // The first attempt always gets its answer (see `Lock::run`).
        let limit = if std::mem::take(&mut first) {
            None
        } else {
            deadline
        };
        let outcome = match runtime::until(limit, tried).await.ok_or_else(timeout)? {
            Ok(outcome) => outcome,
            Err(e @ Error::InvalidConfig(_)) => {
                // Refused up front (a backend without fair locks): nothing to clean up.
                pending.armed = false;
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let remaining = match outcome {
            Acquire::Acquired {
                fencing_token,
                validity,
            } => {
                tracing::debug!(key = %key, fencing_token, waited = ?began.elapsed(), "acquired (fair)");
                return Ok(Some(LockGuard::new(
                    lock,
                    fencing_token,
                    started,
                    validity,
                    pending,
                )));
            }
            Acquire::Held { remaining } => {
                crate::telemetry::contended();
                remaining
            }
            // Only a quorum member answers this, and only to `try_acquire_node`.
            Acquire::Warming { remaining } => Some(remaining),
        };
        if wait.is_none() {
            // A single attempt never joins the queue.
            pending.armed = false;
            return Ok(None);
        }
        if notify && sub.is_none() {
            // Subscribe, then check again at once: a hand-off that came before the
            // subscription was in place is seen by that check.
            let subscribed = backend.fair_subscribe(key, &pending.token);
            sub = Some(
                runtime::until(deadline, subscribed)
                    .await
                    .ok_or_else(timeout)??,
            );
            continue;
        }
        // The holder's lease runs out after `remaining` (a crashed holder never publishes),
        // or the head's deadline passes (a crashed head is evicted then).
        if !pauses.wait(woken, remaining, deadline).await {
            return Err(timeout());
        }
    }
}
