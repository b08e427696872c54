//! The cache's values in this process, beside a `MemoryBackend`'s leases (attached to the
//! store, so that every cache over it and its clones shares them), with the same semantics
//! as on Redis.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use event_listener::Event;

use crate::backend::values::{Cached, Failure, Fill, Read, ValueStore};
use crate::backend::{Backend, MemoryBackend, Subscription};
use crate::error::Result;
use crate::token::{LeaseKey, Token};

/// Cached values of one [`MemoryBackend`] (and its clones), kept beside its leases.
#[derive(Debug, Default)]
pub(crate) struct MemoryValues {
    state: Mutex<MemoryState>,
}

#[derive(Debug, Default)]
struct MemoryState {
    values: HashMap<LeaseKey, Stored>,
    /// Failed rounds: key → (round, message, kept until).
    failed: HashMap<LeaseKey, Vec<(u64, String, Instant)>>,
    events: HashMap<LeaseKey, Weak<Event>>,
    /// Refresh cooldowns: key → until.
    cooldowns: HashMap<LeaseKey, Instant>,
}

/// A value beside a `MemoryBackend`.
#[derive(Debug)]
struct Stored {
    bytes: Bytes,
    delta: Duration,
    grace: Duration,
    round: u64,
    expires: Instant,
}

impl MemoryValues {
    fn state(&self) -> MutexGuard<'_, MemoryState> {
        // Every update is a single insert or remove: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl MemoryState {
    fn wake(&self, key: &LeaseKey) {
        if let Some(event) = self.events.get(key).and_then(Weak::upgrade) {
            event.notify(usize::MAX);
        }
    }
}

/// Values beside a [`MemoryBackend`]: one process, same semantics as on Redis.
#[derive(Debug)]
pub(crate) struct MemoryStore {
    backend: MemoryBackend,
    values: Arc<MemoryValues>,
}

impl MemoryStore {
    pub(crate) fn new(backend: MemoryBackend) -> Self {
        MemoryStore {
            values: backend.attached::<MemoryValues>(),
            backend,
        }
    }

    fn values(&self) -> MutexGuard<'_, MemoryState> {
        self.values.state()
    }
}

#[async_trait]
impl ValueStore for MemoryStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read> {
        let now = Instant::now();
        let holder = self.backend.holder(key);
        let mut st = self.values();
        let cooldown = match st.cooldowns.get(key) {
            Some(until) if *until > now => true,
            Some(_) => {
                st.cooldowns.remove(key);
                false
            }
            None => false,
        };
        let value = match st.values.get(key) {
            Some(v) if v.expires > now => Some(Cached {
                bytes: v.bytes.clone(),
                delta: v.delta,
                grace: v.grace,
                pttl: v.expires - now,
                round: Some(v.round),
                cooldown,
            }),
            Some(_) => {
                st.values.remove(key);
                None
            }
            None => None,
        };
        let failed = awaited.and_then(|round| {
            st.failed.get(key).and_then(|rounds| {
                rounds
                    .iter()
                    .find(|(r, _, until)| *r == round && *until > now)
                    .map(|(_, m, _)| m.clone())
            })
        });
        Ok(Read {
            value,
            held: holder.is_some(),
            round: holder.map(|(round, _)| round),
            lease_pttl: holder.map(|(_, left)| left),
            failed,
        })
    }

    async fn fill(&self, key: &LeaseKey, token: &Token, fill: Fill) -> Result<bool> {
        let written = self.backend.while_held(key, token, || {
            let now = Instant::now();
            let lifetime = fill.ttl.saturating_add(fill.grace);
            let expires = now.checked_add(lifetime).unwrap_or(now);
            let mut st = self.values();
            let stored = Stored {
                bytes: fill.bytes,
                delta: fill.delta,
                grace: fill.grace,
                round: fill.round,
                expires,
            };
            st.values.insert(key.clone(), stored);
            st.wake(key);
        });
        Ok(written.is_some())
    }

    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool> {
        let written = self.backend.while_held(key, token, || {
            let now = Instant::now();
            let later = |d: Duration| now.checked_add(d).unwrap_or(now);
            let mut st = self.values();
            let rounds = st.failed.entry(key.clone()).or_default();
            rounds.retain(|(_, _, until)| *until > now);
            rounds.push((
                failure.round,
                failure.message.to_owned(),
                later(failure.keep),
            ));
            if let Some(cooldown) = failure.cooldown {
                st.cooldowns.insert(key.clone(), later(cooldown));
            }
            st.wake(key);
        });
        Ok(written.is_some())
    }

    async fn notify(&self, key: &LeaseKey) -> Result<()> {
        self.values().wake(key);
        Ok(())
    }

    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        let mut st = self.values();
        st.events.retain(|_, e| e.strong_count() > 0);
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
