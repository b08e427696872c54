//! Where cached values live: Redis (scripts beside this file) or this process (beside a
//! `MemoryBackend`). The compute lease itself is an ordinary lock of the crate.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use event_listener::Event;
use fred::types::scripts::Script;
use fred::types::{Key, Value};

use crate::backend::{Backend, Subscription};
use crate::error::{Error, Result};
use crate::runtime::in_tokio;
use crate::token::{CachePart, LeaseKey, Part, Token};
use crate::{MemoryBackend, RedisBackend};

/// A value as read, with what the caller decides on.
#[derive(Debug)]
pub(crate) struct Cached {
    pub(crate) bytes: Bytes,
    /// How long the last compute took (XFetch's delta).
    pub(crate) delta: Duration,
    /// The stale-while-revalidate window it was written with.
    pub(crate) grace: Duration,
    /// The value's remaining lifetime on the store (grace included).
    pub(crate) pttl: Duration,
    /// The compute round (fencing token) that wrote it, if known.
    pub(crate) round: Option<u64>,
    /// A background refresh failed lately: none is started until the marker expires.
    pub(crate) cooldown: bool,
}

/// One read: the value, and the state of the compute lease.
#[derive(Debug, Default)]
pub(crate) struct Read {
    pub(crate) value: Option<Cached>,
    /// Whether the compute lease exists: a round is under way, known or not.
    pub(crate) held: bool,
    /// The fencing token of the lease's current holder: the compute round under way (`None`
    /// if the lease is free, or its fence is unknown, as after an eviction).
    pub(crate) round: Option<u64>,
    pub(crate) lease_pttl: Option<Duration>,
    /// The message of the awaited round, if it failed.
    pub(crate) failed: Option<String>,
}

/// A value to write.
#[derive(Debug)]
pub(crate) struct Fill {
    pub(crate) bytes: Bytes,
    pub(crate) delta: Duration,
    pub(crate) grace: Duration,
    pub(crate) ttl: Duration,
    /// The writing round (the lease's fencing token).
    pub(crate) round: u64,
}

/// A failed round to record.
#[derive(Debug)]
pub(crate) struct Failure<'a> {
    pub(crate) round: u64,
    pub(crate) message: &'a str,
    pub(crate) keep: Duration,
    /// Set after a failed background refresh: no refresh starts for this long.
    pub(crate) cooldown: Option<Duration>,
}

/// The key of round `round`'s failure (same hash tag as the lease).
fn failed_key(key: &LeaseKey, round: u64) -> String {
    format!("{}:{round}", key.cache_part(CachePart::Failed))
}

/// The refresh cooldown marker (same hash tag as the lease).
fn cooldown_key(key: &LeaseKey) -> String {
    format!("{}:cooldown", key.as_str())
}

/// A bulk reply as bytes. `Null` is matched first: with fred's `default-nil-types` feature
/// (which any crate in the build may turn on) `into_bytes` maps it to `Some("")`.
fn bulk(v: Value) -> Option<Bytes> {
    match v {
        Value::Null => None,
        Value::Bytes(b) => Some(b),
        Value::String(s) => Some(s.into_inner()),
        other => other.into_bytes(),
    }
}

#[async_trait]
pub(crate) trait Store: Send + Sync + fmt::Debug + 'static {
    /// The lease backend the compute locks use.
    fn backend(&self) -> Arc<dyn Backend>;

    /// The value, the current round, and whether `awaited` failed.
    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read>;

    /// Writes the value if `token` holds the lease, and wakes waiters.
    async fn fill(&self, key: &LeaseKey, token: &Token, fill: Fill) -> Result<bool>;

    /// Records round `round` as failed with `message` (kept `keep`) if `token` holds the
    /// lease, sets the refresh cooldown marker for `cooldown` if given, and wakes waiters.
    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool>;

    /// Wakes waiters with no value written (a round that ended without a fill).
    async fn notify(&self, key: &LeaseKey) -> Result<()>;

    /// Wake-ups for fills and failures of `key`; every listener is woken.
    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription>;
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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
pub(crate) struct RedisStore {
    backend: RedisBackend,
    read: Script,
    fill: Script,
    fail: Script,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    pub(crate) fn new(backend: RedisBackend) -> Self {
        RedisStore {
            backend,
            read: Script::from_lua(include_str!("read.lua")),
            fill: Script::from_lua(include_str!("fill.lua")),
            fail: Script::from_lua(include_str!("fail.lua")),
        }
    }

    async fn eval(&self, script: &Script, keys: Vec<Key>, args: Vec<Value>) -> Result<Value> {
        in_tokio(script.evalsha_with_reload(self.backend.client(), keys, args))
            .await
            .map_err(Error::backend)
    }
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }

    async fn read(&self, key: &LeaseKey, awaited: Option<u64>) -> Result<Read> {
        let awaited = awaited.unwrap_or(0);
        let keys = vec![
            key.cache_part(CachePart::Value).into(),
            key.as_str().into(),
            key.part(Part::Fence).into(),
            failed_key(key, awaited).into(),
            cooldown_key(key).into(),
        ];
        let args = vec![awaited.to_string().into()];
        let reply = self.eval(&self.read, keys, args).await?;
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
        let keys = vec![key.as_str().into(), key.cache_part(CachePart::Value).into()];
        let lifetime = fill.ttl.saturating_add(fill.grace);
        let args = vec![
            token.as_str().into(),
            Value::Bytes(fill.bytes),
            us(fill.delta).into(),
            ms(fill.grace).into(),
            ms(lifetime).max(1).into(),
            key.cache_part(CachePart::Filled).into(),
            fill.round.to_string().into(),
        ];
        let reply = self.eval(&self.fill, keys, args).await?;
        Ok(reply.as_i64() == Some(1))
    }

    async fn fail(&self, key: &LeaseKey, token: &Token, failure: Failure<'_>) -> Result<bool> {
        let keys = vec![
            key.as_str().into(),
            failed_key(key, failure.round).into(),
            cooldown_key(key).into(),
        ];
        let args = vec![
            token.as_str().into(),
            failure.message.into(),
            ms(failure.keep).max(1).into(),
            key.cache_part(CachePart::Filled).into(),
            failure.cooldown.map_or(0, |d| ms(d).max(1)).into(),
        ];
        let reply = self.eval(&self.fail, keys, args).await?;
        Ok(reply.as_i64() == Some(1))
    }

    async fn notify(&self, key: &LeaseKey) -> Result<()> {
        use fred::interfaces::PubsubInterface;
        let client = self.backend.client();
        in_tokio(client.publish::<i64, _, _>(key.cache_part(CachePart::Filled), "1"))
            .await
            .map(drop)
            .map_err(Error::backend)
    }

    async fn subscribe(&self, key: &LeaseKey) -> Result<Subscription> {
        self.backend
            .subscribe_broadcast(key.cache_part(CachePart::Filled))
            .await
    }
}

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
}

impl MemoryStore {
    pub(crate) fn new(backend: MemoryBackend) -> Self {
        MemoryStore { backend }
    }

    fn values(&self) -> MutexGuard<'_, MemoryState> {
        self.backend.cache.state()
    }
}

#[async_trait]
impl Store for MemoryStore {
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
