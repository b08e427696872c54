//! `MemoryBackend`: leases in this process, with the same semantics as Redis.

use std::any::{Any, TypeId};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use event_listener::{Event, IntoNotification};

use crate::backend::{
    Acquire, Attempt, Backend, Capabilities, Claim, ClaimKind, Extended, Grant, Lease, NodeTerms,
    Release, Subscription,
};
use crate::error::Result;
use crate::info::LockInfo;
use crate::token::{LeaseKey, Owner, Token};

/// How long an abandoned reentrant hold stays barred (as the Redis backend's tombstones).
const BARRED: Duration = Duration::from_secs(300);

/// How long the answer for a replayed reentrant release is kept (as the Redis record's hour).
const ENDED_KEPT: Duration = Duration::from_secs(3600);

/// How long a waiting plain claim holds new reads back after its last attempt, at most, as on
/// Redis (`PREFERENCE` in prelude.lua).
const PREFERENCE: Duration = Duration::from_millis(2100);

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
    /// State that layers built on this store keep beside it, one value per type, shared by
    /// the store's clones (see [`attached`](Self::attached)).
    attached: Arc<Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>>,
}

#[derive(Debug, Default)]
struct State {
    leases: HashMap<LeaseKey, (Token, Instant)>,
    fences: HashMap<LeaseKey, u64>,
    events: HashMap<LeaseKey, Weak<Event>>,
    /// Fair locks: each key's waiters in arrival order, with their deadlines.
    queues: HashMap<LeaseKey, Queue>,
    /// Fair locks: each waiter's hand-off wake-up (tokens are unique, so one map).
    targets: HashMap<Token, Weak<Event>>,
    /// Reentrant locks: the reign of each key, valid while the lease holds its token.
    reigns: HashMap<LeaseKey, Reign>,
    /// Reentrant locks: the hold whose release ended each key's last reign (a replayed
    /// release of it answers 0 again).
    ended: HashMap<LeaseKey, (Token, Instant)>,
    /// Reentrant locks: abandoned holds, never counted until the instant given.
    barred: HashMap<Token, Instant>,
    /// Shared holds (reads, permits) of each key held in a shared mode; the lease is then
    /// held by the mode's marker until the latest of them runs out, as on Redis.
    shared: HashMap<LeaseKey, Shared>,
    /// The plain claims waiting for each key, each with until when its preference runs: new
    /// reads wait behind the latest (writer preference), as behind the Redis record's `v`
    /// (the latest of `:writers`).
    writers: HashMap<LeaseKey, HashMap<Token, Instant>>,
    /// Until when shared claims wait for each key: a release that frees it wakes every
    /// waiter, as the Redis record's `s`.
    sharers_waiting: HashMap<LeaseKey, Instant>,
    ops: u64,
}

/// The shared holds of one key: each hold's expiry and fencing token, by its token (which
/// carries its label).
#[derive(Debug)]
struct Shared {
    /// The mode's marker, the lease's token while holds run ([`READS`] or [`PERMITS`]).
    mode: &'static str,
    holds: HashMap<Token, (Instant, u64)>,
}

/// The markers a key held in a shared mode is leased under (no token equals them).
const READS: &str = "*r";
const PERMITS: &str = "*p";

impl Shared {
    fn live(&mut self, now: Instant) -> usize {
        self.holds.retain(|_, (exp, _)| *exp > now);
        self.holds.len()
    }

    fn latest(&self) -> Option<Instant> {
        self.holds.values().map(|(exp, _)| *exp).max()
    }
}

/// The reign of one owner over a reentrant lock.
#[derive(Debug)]
struct Reign {
    owner: Owner,
    /// The lease token (the hold that started the reign).
    token: Token,
    fence: u64,
    /// The live holds; the count is their number.
    holds: std::collections::HashSet<Token>,
}

/// The fair queue of one key.
#[derive(Debug, Default)]
struct Queue {
    order: VecDeque<Token>,
    deadlines: HashMap<Token, Instant>,
}

impl Queue {
    /// Drops the waiters whose deadline passed (they stopped coming back: crashed, or
    /// stuck).
    fn evict(&mut self, now: Instant) {
        if self.deadlines.values().any(|d| *d <= now) {
            self.deadlines.retain(|_, d| *d > now);
            let live = &self.deadlines;
            self.order.retain(|t| live.contains_key(t));
        }
    }

    fn remove(&mut self, token: &Token) -> bool {
        if self.deadlines.remove(token).is_some() {
            self.order.retain(|t| t != token);
            return true;
        }
        false
    }
}

impl State {
    /// Drops expired leases and dead subscriptions now and then (amortised O(1)).
    fn sweep(&mut self, now: Instant) {
        self.ops += 1;
        if self.ops % 1024 == 0 {
            self.leases.retain(|_, (_, exp)| *exp > now);
            self.events.retain(|_, e| e.strong_count() > 0);
            self.targets.retain(|_, e| e.strong_count() > 0);
            self.queues.retain(|_, q| {
                q.evict(now);
                !q.order.is_empty()
            });
            self.barred.retain(|_, until| *until > now);
            self.writers.retain(|_, waiting| {
                waiting.retain(|_, until| *until > now);
                !waiting.is_empty()
            });
            self.sharers_waiting.retain(|_, until| *until > now);
            // A replayed release comes within seconds; the Redis backend keeps its answer an
            // hour (the record's `t` and `r`). Kept as long here, then dropped.
            self.ended
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < ENDED_KEPT);
            let leases = &self.leases;
            self.reigns.retain(|k, r| {
                leases
                    .get(k)
                    .is_some_and(|(t, exp)| *t == r.token && *exp > now)
            });
            self.shared.retain(|k, sh| {
                leases
                    .get(k)
                    .is_some_and(|(t, exp)| t.as_str() == sh.mode && *exp > now)
            });
        }
    }

    /// The reign holding `key` now, if the lease is a live reentrant one.
    fn reign(&mut self, key: &LeaseKey, now: Instant) -> Option<&mut Reign> {
        let token = self.holder(key, now).map(|(t, _)| t.clone())?;
        self.reigns.get_mut(key).filter(|r| r.token == token)
    }

    fn holder(&self, key: &LeaseKey, now: Instant) -> Option<&(Token, Instant)> {
        self.leases.get(key).filter(|(_, exp)| *exp > now)
    }

    fn wake(&self, key: &LeaseKey) {
        // One release, one waiter (the longest waiting); see the Redis backend. Every waiter
        // while shared claims wait: the readers a write held back may all go in.
        if let Some(event) = self.events.get(key).and_then(Weak::upgrade) {
            let now = Instant::now();
            if self
                .sharers_waiting
                .get(key)
                .is_some_and(|until| *until > now)
            {
                event.notify(usize::MAX);
            } else {
                event.notify(1.additional());
            }
        }
    }

    /// The shared holds of `key` while the lease is held in a shared mode.
    fn shared_holds(&mut self, key: &LeaseKey, now: Instant) -> Option<&mut Shared> {
        let mode = self.holder(key, now).map(|(t, _)| t.as_str().to_owned())?;
        self.shared.get_mut(key).filter(|sh| sh.mode == mode)
    }

    /// Hands a free key to its fair queue: wakes the head (after evicting dead waiters), and
    /// only the head.
    fn wake_head(&mut self, key: &LeaseKey, now: Instant) {
        let Some(q) = self.queues.get_mut(key) else {
            return;
        };
        q.evict(now);
        if let Some(event) = q
            .order
            .front()
            .and_then(|head| self.targets.get(head))
            .and_then(Weak::upgrade)
        {
            event.notify(usize::MAX);
        }
    }

    /// Grants `key` to `token`, minting the next fencing token (at least `floor`).
    fn grant(
        &mut self,
        key: &LeaseKey,
        token: &Token,
        ttl: Duration,
        floor: u64,
        now: Instant,
    ) -> u64 {
        let expires = now.checked_add(ttl).unwrap_or(now);
        self.leases.insert(key.clone(), (token.clone(), expires));
        let fence = self.fences.entry(key.clone()).or_insert(0);
        *fence = (*fence + 1).max(floor);
        *fence
    }

    /// Whether anyone waits for `key`: its live release subscriptions.
    fn waiters(&self, key: &LeaseKey) -> bool {
        self.events.get(key).is_some_and(|e| e.strong_count() > 0)
    }

    /// Until when new reads of `key` wait behind a waiting writer, if one's preference runs.
    fn preference(&self, key: &LeaseKey, now: Instant) -> Option<Instant> {
        let latest = self.writers.get(key)?.values().max().copied()?;
        (latest > now).then_some(latest)
    }

    /// Withdraws the preference of `token`, a waiting plain claim that gave up; when that
    /// lets reads in sooner while readers wait and no write holds the key, every waiter is
    /// woken (as on Redis: `withdraw` in release.lua).
    fn withdraw(&mut self, key: &LeaseKey, token: &Token, now: Instant) {
        let before = self.preference(key, now);
        let Some(waiting) = self.writers.get_mut(key) else {
            return;
        };
        if waiting.remove(token).is_none() {
            return;
        }
        if waiting.is_empty() {
            self.writers.remove(key);
        }
        let readers_wait = self
            .sharers_waiting
            .get(key)
            .is_some_and(|until| *until > now);
        let write_held = self
            .holder(key, now)
            .is_some_and(|(t, _)| t.as_str() != READS);
        if before > self.preference(key, now) && readers_wait && !write_held {
            self.wake(key);
        }
    }
}

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value of type `T` attached to this store (made with `T::default()` on first use),
    /// shared by its clones: where a layer built on the store keeps its own state beside the
    /// leases, without the store knowing of it.
    pub(crate) fn attached<T: Default + Send + Sync + 'static>(&self) -> Arc<T> {
        let mut map = self.attached.lock().unwrap_or_else(|p| p.into_inner());
        let any = map
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()))
            .clone();
        any.downcast::<T>()
            .expect("the value attached under a type's id is of that type")
    }

    /// Runs `f` while `key` is held by `token`, atomically with respect to every lease
    /// operation (a write fenced by the lease).
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
    /// Everything; the uptime condition of [`NodeTerms`] always holds (an in-process store
    /// cannot restart under the leases it holds: they go with the process).
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        claim.check_token()?;
        let now = Instant::now();
        let mut st = self.state();
        st.sweep(now);
        Ok(match &claim.kind {
            ClaimKind::Plain => plain_acquire(&mut st, claim, attempt, terms, now),
            ClaimKind::Fair => fair_acquire(&mut st, claim, attempt, terms, now),
            ClaimKind::Reentrant(owner) => {
                reentrant_acquire(&mut st, claim, owner, attempt, terms, now)
            }
            ClaimKind::Read => shared_acquire(&mut st, claim, None, attempt, now),
            ClaimKind::Permit(0) => {
                return Err(crate::error::Error::invalid(
                    "a semaphore needs at least one permit",
                ))
            }
            ClaimKind::Permit(n) => shared_acquire(&mut st, claim, Some(*n), attempt, now),
        })
    }

    async fn extend(&self, leases: &[Lease<'_>], _terms: NodeTerms) -> Result<Vec<Extended>> {
        let now = Instant::now();
        let mut st = self.state();
        Ok(leases
            .iter()
            .map(|l| match st.leases.get_mut(l.key) {
                _ if l.token.is_shared() => shared_extend(&mut st, l, now),
                Some((t, exp)) if t == l.token && *exp > now => {
                    // Callers bound ttl by MAX_TTL; saturate anyway rather than panic.
                    *exp = now.checked_add(l.ttl).unwrap_or(*exp);
                    Extended::Held(l.ttl)
                }
                _ => Extended::Gone,
            })
            .collect())
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        let mut st = self.state();
        let fence = st.fences.entry(key.clone()).or_insert(0);
        *fence = (*fence).max(at_least);
        Ok(())
    }

    /// In-process attempts run to completion under one mutex: no late copy can exist, so an
    /// abandon is a release (of a hold that may have been counted, for a reentrant claim),
    /// plus leaving the fair queue; an abandoned reentrant hold is also barred, as on Redis.
    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        let now = Instant::now();
        let mut st = self.state();
        let key = &claim.key;
        if let ClaimKind::Reentrant(owner) = &claim.kind {
            let lease = match how {
                Release::Confirmed { lease } => Some(lease),
                _ => None,
            };
            return Ok(reentrant_release(
                &mut st,
                key,
                owner,
                &claim.token,
                lease,
                now,
            ));
        }
        if claim.kind.shared() {
            return Ok(shared_release(&mut st, key, &claim.token, now));
        }
        let released = if st.holder(key, now).is_some_and(|(t, _)| *t == claim.token) {
            st.leases.remove(key);
            st.wake(key);
            st.wake_head(key, now);
            Some(0)
        } else {
            None
        };
        if how == Release::Abandon {
            st.withdraw(key, &claim.token, now);
            if let Some(q) = st.queues.get_mut(key) {
                let was_head = q.order.front() == Some(&claim.token);
                if q.remove(&claim.token) && was_head && st.holder(key, now).is_none() {
                    st.wake_head(key, now);
                }
            }
        }
        Ok(released)
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        let now = Instant::now();
        let mut st = self.state();
        let mut info = LockInfo::new();
        if let Some((token, expires)) = st.holder(key, now) {
            info.held = true;
            info.remaining = Some(*expires - now);
            info.holder_label = token.label().map(str::to_owned);
        }
        info.fencing_token = st.fences.get(key).copied();
        info.reentrant_count = st.reign(key, now).map(|r| r.holds.len() as u64);
        if let Some(sh) = st.shared_holds(key, now) {
            info.shared_holds = Some(sh.live(now) as u64);
            info.shared_labels = sh
                .holds
                .keys()
                .filter_map(|t| t.label().map(str::to_owned))
                .collect();
            info.holder_label = None;
        }
        if let Some(q) = st.queues.get_mut(key) {
            q.evict(now);
            info.queue_len = q.order.len() as u64;
        }
        Ok((!info.is_blank()).then_some(info))
    }

    /// A fair claim is woken when the lock is handed to it (released while it was at the
    /// head of the queue), and not by hand-offs to other waiters; other kinds by releases.
    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        let mut st = self.state();
        if claim.kind == ClaimKind::Fair {
            let event = Arc::new(Event::new());
            st.targets
                .insert(claim.token.clone(), Arc::downgrade(&event));
            return Ok(Subscription::new(event));
        }
        let key = &claim.key;
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

fn plain_acquire(
    st: &mut State,
    claim: &Claim,
    attempt: Attempt,
    terms: NodeTerms,
    now: Instant,
) -> Acquire {
    let (key, token) = (&claim.key, &claim.token);
    if matches!(attempt, Attempt::Arriving { .. }) && st.waiters(key) {
        let remaining = st.holder(key, now).map(|(_, exp)| *exp - now);
        return Acquire::Held { remaining };
    }
    match st.holder(key, now) {
        Some((holder, expires)) if holder != token => {
            let remaining = Some(*expires - now);
            if let Some(keep) = attempt.keep_waiter() {
                // New reads wait behind a waiting writer, for a short lease that its next
                // attempts renew.
                let until = now.checked_add(keep.min(PREFERENCE)).unwrap_or(now);
                let waiting = st.writers.entry(key.clone()).or_default();
                waiting.retain(|_, until| *until > now);
                waiting.insert(token.clone(), until);
            }
            Acquire::Held { remaining }
        }
        Some(_) => self_replay(st, claim, now),
        None => {
            // The writer that new reads waited behind has the lock.
            st.writers.remove(key);
            let fence = st.grant(key, token, claim.ttl, terms.fence_floor, now);
            Acquire::Granted(Grant::new(fence, claim.ttl, token.clone()))
        }
    }
}

/// The fair queue: granted to the head of the queue (or anyone when nobody is queued) when
/// the key is free; a waiting attempt joins the queue (or refreshes its deadline).
fn fair_acquire(
    st: &mut State,
    claim: &Claim,
    attempt: Attempt,
    terms: NodeTerms,
    now: Instant,
) -> Acquire {
    let (key, token) = (&claim.key, &claim.token);
    let holder = st.holder(key, now).map(|(t, exp)| (t == token, *exp - now));
    if let Some((true, _)) = holder {
        // Ours already (a repeated attempt): same as the plain path.
        return self_replay(st, claim, now);
    }
    let q = st.queues.entry(key.clone()).or_default();
    q.evict(now);
    let at_head = q.order.front().is_none_or(|head| head == token);
    if holder.is_none() && at_head {
        q.remove(token);
        if q.order.is_empty() {
            st.queues.remove(key);
        }
        let fence = st.grant(key, token, claim.ttl, terms.fence_floor, now);
        return Acquire::Granted(Grant::new(fence, claim.ttl, token.clone()));
    }
    if let Some(expire) = attempt.keep_waiter() {
        if !q.deadlines.contains_key(token) {
            q.order.push_back(token.clone());
        }
        q.deadlines
            .insert(token.clone(), now.checked_add(expire).unwrap_or(now));
    }
    let remaining = match holder {
        Some((_, pttl)) => Some(pttl),
        None => {
            // Free, and another waiter is at the head: wake it (its wake-up may have been
            // missed), and come back by its deadline at the latest.
            let head_left = q
                .order
                .front()
                .and_then(|h| q.deadlines.get(h))
                .map(|d| d.saturating_duration_since(now));
            st.wake_head(key, now);
            head_left
        }
    };
    if st.queues.get(key).is_some_and(|q| q.order.is_empty()) {
        st.queues.remove(key);
    }
    Acquire::Held { remaining }
}

/// As on Redis: a new reign when free, one more hold for the reign's owner.
fn reentrant_acquire(
    st: &mut State,
    claim: &Claim,
    owner: &Owner,
    attempt: Attempt,
    terms: NodeTerms,
    now: Instant,
) -> Acquire {
    let (key, hold, ttl) = (&claim.key, &claim.token, claim.ttl);
    let remaining = |st: &State| st.holder(key, now).map(|(_, exp)| *exp - now);
    if st.barred.get(hold).is_some_and(|until| *until > now) {
        return Acquire::Held {
            remaining: remaining(st),
        };
    }
    if let Some(reign) = st.reign(key, now).filter(|r| r.owner == *owner) {
        reign.holds.insert(hold.clone());
        let (lease, fence) = (reign.token.clone(), reign.fence);
        let count = u32::try_from(reign.holds.len()).unwrap_or(u32::MAX);
        if let Some((_, exp)) = st.leases.get_mut(key) {
            // Never shortened by a re-entry with a shorter TTL.
            *exp = (*exp).max(now.checked_add(ttl).unwrap_or(*exp));
        }
        return Acquire::Granted(Grant::new(fence, ttl, lease).with_hold_count(count));
    }
    if st.holder(key, now).is_some() {
        return Acquire::Held {
            remaining: remaining(st),
        };
    }
    if matches!(attempt, Attempt::Arriving { .. }) && st.waiters(key) {
        return Acquire::Held { remaining: None };
    }
    let fence = st.grant(key, hold, ttl, terms.fence_floor, now);
    st.reigns.insert(
        key.clone(),
        Reign {
            owner: owner.clone(),
            token: hold.clone(),
            fence,
            holds: std::iter::once(hold.clone()).collect(),
        },
    );
    Acquire::Granted(Grant::new(fence, ttl, hold.clone()).with_hold_count(1))
}

/// Takes `hold` out of its owner's reign; see [`Backend::release`]. `lease`: the reign's
/// token as the caller knows it, `None` for an abandon (the hold is barred too).
fn reentrant_release(
    st: &mut State,
    key: &LeaseKey,
    owner: &Owner,
    hold: &Token,
    lease: Option<&Token>,
    now: Instant,
) -> Option<u32> {
    if lease.is_none() {
        st.barred
            .insert(hold.clone(), now.checked_add(BARRED).unwrap_or(now));
    }
    if let Some(reign) = st.reign(key, now).filter(|r| r.owner == *owner) {
        if reign.holds.remove(hold) {
            if reign.holds.is_empty() {
                st.reigns.remove(key);
                st.leases.remove(key);
                st.ended.insert(key.clone(), (hold.clone(), now));
                st.wake(key);
                st.wake_head(key, now);
                return Some(0);
            }
            return Some(u32::try_from(reign.holds.len()).unwrap_or(u32::MAX));
        }
        if lease == Some(&reign.token) {
            // Counted in this reign and gone already: a repeated release.
            return Some(u32::try_from(reign.holds.len()).unwrap_or(u32::MAX));
        }
        return None;
    }
    if st.holder(key, now).is_none() && st.ended.get(key).is_some_and(|(h, _)| h == hold) {
        return Some(0);
    }
    None
}

/// A repeated attempt by the holder: extends, keeps the fencing token.
fn self_replay(st: &mut State, claim: &Claim, now: Instant) -> Acquire {
    if let Some((_, exp)) = st.leases.get_mut(&claim.key) {
        *exp = now.checked_add(claim.ttl).unwrap_or(*exp);
    }
    let fence = st.fences.get(&claim.key).copied().unwrap_or(0);
    Acquire::Granted(Grant::new(fence, claim.ttl, claim.token.clone()))
}

/// A read (`permits` `None`) or one of `permits` permits, as on Redis (`shared_acquire.lua`):
/// granted unless another kind holds the key, a writer waits (reads), or the permits are all
/// taken; each hold its own lease and fencing token.
fn shared_acquire(
    st: &mut State,
    claim: &Claim,
    permits: Option<u32>,
    attempt: Attempt,
    now: Instant,
) -> Acquire {
    let (key, token) = (&claim.key, &claim.token);
    let mode = if permits.is_some() { PERMITS } else { READS };
    let until = now.checked_add(claim.ttl).unwrap_or(now);
    let held = st
        .holder(key, now)
        .map(|(t, exp)| (t.as_str() == mode, *exp));
    let left = held.map(|(_, exp)| exp - now);
    let wait_here = |st: &mut State| {
        if let Some(keep) = attempt.keep_waiter() {
            let until = now.checked_add(keep).unwrap_or(now);
            st.sharers_waiting.insert(key.clone(), until);
        }
        Acquire::Held { remaining: left }
    };
    if let Some((true, _)) = held {
        if let Some(sh) = st.shared.get_mut(key) {
            if let Some((exp, fence)) = sh.holds.get_mut(token).filter(|(exp, _)| *exp > now) {
                // Ours already: a repeated attempt.
                *exp = until;
                let fence = *fence;
                extend_shared_lease(st, key, until);
                return Acquire::Granted(Grant::new(fence, claim.ttl, token.clone()));
            }
        }
    }
    // A read waits behind a waiting writer, until its preference lapses at the latest.
    let lapse = st
        .preference(key, now)
        .filter(|_| permits.is_none())
        .map(|p| p - now);
    match (held, lapse) {
        (Some((false, _)), _) => return wait_here(st),
        (_, Some(lapse)) => {
            wait_here(st);
            return Acquire::Held {
                remaining: Some(left.map_or(lapse, |l| l.min(lapse))),
            };
        }
        _ if permits.is_some()
            && matches!(attempt, Attempt::Arriving { .. })
            && st.waiters(key) =>
        {
            return Acquire::Held { remaining: left };
        }
        _ => {}
    }
    if let (Some(n), Some(_)) = (permits, held) {
        let sh = st.shared.get_mut(key).filter(|sh| sh.mode == mode);
        if let Some(sh) = sh {
            if sh.live(now) >= n as usize {
                let first = sh.holds.values().map(|(exp, _)| *exp).min();
                wait_here(st);
                return Acquire::Held {
                    remaining: first.map(|f| f.saturating_duration_since(now)),
                };
            }
        }
    }
    let fence = match held {
        Some(_) => {
            let fence = st.fences.entry(key.clone()).or_insert(0);
            *fence += 1;
            let fence = *fence;
            extend_shared_lease(st, key, until);
            fence
        }
        None => {
            st.shared.remove(key);
            st.grant(key, &Token::from_store(mode), claim.ttl, 0, now)
        }
    };
    st.shared
        .entry(key.clone())
        .or_insert_with(|| Shared {
            mode,
            holds: HashMap::new(),
        })
        .holds
        .insert(token.clone(), (until, fence));
    Acquire::Granted(Grant::new(fence, claim.ttl, token.clone()))
}

/// Keeps `key`'s shared lease (the mode's marker) until `until` at least.
fn extend_shared_lease(st: &mut State, key: &LeaseKey, until: Instant) {
    if let Some((_, exp)) = st.leases.get_mut(key) {
        *exp = (*exp).max(until);
    }
}

/// One shared hold's extension: only while it is live and the key is held in its mode.
fn shared_extend(st: &mut State, lease: &Lease<'_>, now: Instant) -> Extended {
    let until = now.checked_add(lease.ttl).unwrap_or(now);
    let Some(sh) = st.shared_holds(lease.key, now) else {
        return Extended::Gone;
    };
    match sh.holds.get_mut(lease.token) {
        Some((exp, _)) if *exp > now => {
            *exp = until;
            extend_shared_lease(st, lease.key, until);
            Extended::Held(lease.ttl)
        }
        _ => Extended::Gone,
    }
}

/// Gives one shared hold back: the last one ends the lease and wakes the waiters; one that
/// leaves permits held wakes one waiter. `Some(0)` when it was held.
fn shared_release(st: &mut State, key: &LeaseKey, token: &Token, now: Instant) -> Option<u32> {
    let sh = st.shared_holds(key, now)?;
    let (exp, _) = sh.holds.remove(token)?;
    if exp <= now {
        return None;
    }
    let permits = sh.mode == PERMITS;
    sh.live(now);
    match sh.latest() {
        None => {
            st.shared.remove(key);
            st.leases.remove(key);
            st.wake(key);
            st.wake_head(key, now);
        }
        Some(latest) => {
            if let Some((_, e)) = st.leases.get_mut(key) {
                *e = latest;
            }
            if permits {
                if let Some(event) = st.events.get(key).and_then(Weak::upgrade) {
                    event.notify(1.additional());
                }
            }
        }
    }
    Some(0)
}
