//! `MemoryBackend`: leases in this process, with the same semantics as Redis.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use event_listener::{Event, IntoNotification};

use crate::backend::{Acquire, Backend, Lease, NodeTerms, Subscription, Waiting};
use crate::error::Result;
use crate::token::{LeaseKey, Token};

/// Leases held in this process: for tests, and for single-process apps that want the same
/// API (guards, watchdog, fencing tokens, waiting) without a server.
///
/// Clones share the same store. Expiry uses the monotonic clock; a release wakes waiters
/// through an in-process notify.
///
/// ```
/// use redlease::{LockManager, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let guard = locks.lock("report").acquire().await?;
/// assert!(locks.lock("report").try_acquire().await?.is_none());
/// guard.release().await?;
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryBackend {
    state: Arc<Mutex<State>>,
    /// Values of the stampede cache over this backend, shared by its clones.
    pub(crate) cache: Arc<crate::stampede::MemoryValues>,
}

#[derive(Debug, Default)]
struct State {
    leases: HashMap<LeaseKey, (Token, Instant)>,
    fences: HashMap<LeaseKey, u64>,
    events: HashMap<LeaseKey, Weak<Event>>,
    ops: u64,
}

impl State {
    /// Drops expired leases and dead subscriptions now and then (amortised O(1)).
    fn sweep(&mut self, now: Instant) {
        self.ops += 1;
        if self.ops % 1024 == 0 {
            self.leases.retain(|_, (_, exp)| *exp > now);
            self.events.retain(|_, e| e.strong_count() > 0);
        }
    }

    fn holder(&self, key: &LeaseKey, now: Instant) -> Option<&(Token, Instant)> {
        self.leases.get(key).filter(|(_, exp)| *exp > now)
    }

    fn wake(&self, key: &LeaseKey) {
        // One release, one waiter (the longest waiting); see the Redis backend.
        if let Some(event) = self.events.get(key).and_then(Weak::upgrade) {
            event.notify(1.additional());
        }
    }
}

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` while `key` is held by `token`, atomically with respect to every lease
    /// operation (a write fenced by the lease, for the stampede cache).
    pub(crate) fn while_held<R>(
        &self,
        key: &LeaseKey,
        token: &Token,
        f: impl FnOnce() -> R,
    ) -> Option<R> {
        let st = self.state();
        let held = st
            .holder(key, Instant::now())
            .is_some_and(|(t, _)| t == token);
        held.then(f)
    }

    /// The fencing token and remaining time of the current holder of `key`, if any.
    pub(crate) fn holder(&self, key: &LeaseKey) -> Option<(u64, Duration)> {
        let now = Instant::now();
        let st = self.state();
        let (_, expires) = st.holder(key, now)?;
        Some((st.fences.get(key).copied().unwrap_or(0), *expires - now))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the maps inconsistent (every update
        // is a single insert/remove), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn try_acquire(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
    ) -> Result<Acquire> {
        self.try_acquire_node(key, token, ttl, waiting, NodeTerms::new())
            .await
    }

    /// The uptime condition always holds: an in-process store cannot restart under the
    /// leases it holds (they go with the process).
    async fn try_acquire_node(
        &self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        waiting: Waiting,
        terms: NodeTerms,
    ) -> Result<Acquire> {
        let now = Instant::now();
        let mut st = self.state();
        st.sweep(now);
        // Waiters here are the live subscriptions to the key's release event.
        let waiters = st.events.get(key).is_some_and(|e| e.strong_count() > 0);
        if matches!(waiting, Waiting::Arriving { .. }) && waiters {
            let remaining = st.holder(key, now).map(|(_, exp)| *exp - now);
            return Ok(Acquire::Held { remaining });
        }
        match st.holder(key, now) {
            Some((holder, expires)) if holder != token => Ok(Acquire::Held {
                remaining: Some(*expires - now),
            }),
            held => {
                let replay = held.is_some();
                let expires = now.checked_add(ttl).unwrap_or(now);
                st.leases.insert(key.clone(), (token.clone(), expires));
                let fence = st.fences.entry(key.clone()).or_insert(0);
                if !replay {
                    *fence = (*fence + 1).max(terms.get_fence_floor());
                }
                Ok(Acquire::Acquired {
                    fencing_token: *fence,
                    validity: ttl,
                })
            }
        }
    }

    async fn extend(&self, leases: &[Lease<'_>]) -> Result<Vec<Option<Duration>>> {
        let now = Instant::now();
        let mut st = self.state();
        Ok(leases
            .iter()
            .map(|l| match st.leases.get_mut(l.key) {
                Some((t, exp)) if t == l.token && *exp > now => {
                    // Callers bound ttl by MAX_TTL; saturate anyway rather than panic.
                    *exp = now.checked_add(l.ttl).unwrap_or(*exp);
                    Some(l.ttl)
                }
                _ => None,
            })
            .collect())
    }

    async fn extend_node(
        &self,
        leases: &[Lease<'_>],
        _terms: NodeTerms,
    ) -> Result<Vec<Option<Duration>>> {
        self.extend(leases).await
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        let mut st = self.state();
        let fence = st.fences.entry(key.clone()).or_insert(0);
        *fence = (*fence).max(at_least);
        Ok(())
    }

    async fn release(&self, key: &LeaseKey, token: &Token) -> Result<bool> {
        let now = Instant::now();
        let mut st = self.state();
        if st.holder(key, now).is_some_and(|(t, _)| t == token) {
            st.leases.remove(key);
            st.wake(key);
            return Ok(true);
        }
        Ok(false)
    }

    /// In-process attempts run to completion under one mutex: no late copy can exist, so
    /// abandoning is releasing.
    async fn abandon(&self, key: &LeaseKey, token: &Token) -> Result<bool> {
        self.release(key, token).await
    }

    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        let mut st = self.state();
        let event = match st.events.get(key).and_then(Weak::upgrade) {
            Some(e) => e,
            None => {
                let e = Arc::new(Event::new());
                st.events.insert(key.clone(), Arc::downgrade(&e));
                e
            }
        };
        Ok(Subscription::new(event))
    }
}
