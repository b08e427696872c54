//! One shared task per manager that keeps every held lease alive, in batches; and the
//! [`Kept`] lease a guard holds: its lost state and its registration with that task.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use event_listener::Event;
use futures::future;
use tracing::Instrument;

use crate::backend::{clock_drift, Backend, Extended, Lease, NodeTerms};
use crate::options::MIN_TTL;
use crate::runtime;
use crate::token::{LeaseKey, Token};

/// What a guard and the watchdog share about one lease: its local deadline and the lost
/// latch. A lease is lost once an extension is refused, or once the deadline (monotonic
/// clock: attempt start + validity) passes without a confirmed extension. Lost is final.
#[derive(Debug)]
pub(crate) struct LeaseState {
    deadline: AtomicU64,
    /// When the confirmed extension behind `deadline` was sent. Extensions can be confirmed
    /// out of order (the watchdog's and a manual `extend`); the one sent last wins, since the
    /// server ran it last on the one connection.
    confirmed_sent: Mutex<u64>,
    lost: AtomicBool,
    event: Event,
}

pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) fn to_nanos(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

impl LeaseState {
    pub(crate) fn new(sent: Instant, deadline: Instant) -> Self {
        LeaseState {
            deadline: AtomicU64::new(to_nanos(deadline)),
            confirmed_sent: Mutex::new(to_nanos(sent)),
            lost: AtomicBool::new(false),
            event: Event::new(),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        epoch() + Duration::from_nanos(self.deadline.load(Ordering::Acquire))
    }

    /// Records an extension sent at `sent` and confirmed valid for `validity`; `false` if the
    /// lease is lost already. A confirmation older than the last one changes nothing.
    pub(crate) fn confirm(&self, sent: Instant, validity: Duration) -> bool {
        let mut last = self
            .confirmed_sent
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.check_lost() {
            return false;
        }
        if to_nanos(sent) >= *last {
            *last = to_nanos(sent);
            self.deadline
                .store(to_nanos(sent + validity), Ordering::Release);
        }
        true
    }

    /// Moves the deadline to `deadline` if that is later; `false` if the lease is lost.
    pub(crate) fn confirm_later(&self, deadline: Instant) -> bool {
        let _order = self
            .confirmed_sent
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.check_lost() {
            return false;
        }
        self.deadline
            .fetch_max(to_nanos(deadline), Ordering::AcqRel);
        true
    }

    /// An extension sent at `sent` with `ttl` may have run without its answer arriving: if
    /// it would end the lease before the deadline (a shorter TTL, near a maximum hold), the
    /// deadline comes forward to where that extension would leave it.
    pub(crate) fn unconfirmed(&self, sent: Instant, ttl: Duration) {
        let end = to_nanos(sent + ttl.saturating_sub(clock_drift(ttl)));
        if self.deadline.fetch_min(end, Ordering::AcqRel) > end {
            // `lost()` sleeps until the deadline it read: wake it to read the new one.
            self.event.notify(usize::MAX);
        }
    }

    pub(crate) fn mark_lost(&self) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            self.event.notify(usize::MAX);
        }
    }

    /// Whether the lease is lost, latching it if the deadline has passed.
    pub(crate) fn check_lost(&self) -> bool {
        if self.lost.load(Ordering::Acquire) {
            return true;
        }
        if Instant::now() >= self.deadline() {
            self.mark_lost();
            return true;
        }
        false
    }

    /// Resolves once the lease is lost: on the latch, or at the deadline by its own timer, so
    /// it fires on time even if the watchdog task is gone.
    pub(crate) async fn lost(self: Arc<Self>) {
        loop {
            let latch = self.event.listen();
            if self.check_lost() {
                return;
            }
            let timer = std::pin::pin!(runtime::sleep_until(self.deadline()));
            future::select(latch, timer).await;
        }
    }
}

/// Counters of a manager's watchdog, from [`LockManager::watchdog_stats`](crate::LockManager::watchdog_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WatchdogStats {
    /// Leases the watchdog keeps alive now.
    pub leases: usize,
    /// Batched extension calls made so far (one round trip each, however many leases).
    pub rounds: u64,
    /// Lease extensions confirmed so far.
    pub extended: u64,
    /// Leases found lost by the watchdog (refused extension or passed deadline).
    pub lost: u64,
}

struct Entry {
    key: LeaseKey,
    /// The lease token's secret (its label is not sent with extensions).
    token: Arc<str>,
    state: Arc<LeaseState>,
    /// The TTL and the interval, in ns (kept small: a manager may hold a million leases).
    ttl: u64,
    interval: u64,
    /// When it is due, in ns since [`epoch`] (while `Waiting`).
    next_due: u64,
    /// The maximum hold's end (see `LockOptions::max_hold`), in ns since [`epoch`]; 0 for
    /// none: no extension reaches past it.
    hold_until: u64,
    phase: Phase,
}

impl Entry {
    fn ttl(&self) -> Duration {
        Duration::from_nanos(self.ttl)
    }

    fn interval(&self) -> Duration {
        Duration::from_nanos(self.interval)
    }

    fn hold_until(&self) -> Option<Instant> {
        (self.hold_until != 0).then(|| epoch() + Duration::from_nanos(self.hold_until))
    }
}

/// The watchdog's leases, by id: a slab (a million leases take a million slots, where a hash
/// map would take up to two million buckets). An id is the slot's index and its generation,
/// so an id whose lease has gone never names the lease that took its slot.
#[derive(Default)]
struct Entries {
    slots: Vec<Option<Entry>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    len: usize,
}

impl Entries {
    fn split(id: u64) -> (usize, u32) {
        ((id & u64::from(u32::MAX)) as usize, (id >> 32) as u32)
    }

    fn insert(&mut self, entry: Entry) -> u64 {
        self.len += 1;
        let index = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.slots.push(None);
                self.generations.push(0);
                self.slots.len() - 1
            }
        };
        self.slots[index] = Some(entry);
        (u64::from(self.generations[index]) << 32) | index as u64
    }

    fn get(&self, id: u64) -> Option<&Entry> {
        let (i, generation) = Self::split(id);
        match self.generations.get(i) {
            Some(&g) if g == generation => self.slots[i].as_ref(),
            _ => None,
        }
    }

    fn get_mut(&mut self, id: u64) -> Option<&mut Entry> {
        let (i, generation) = Self::split(id);
        match self.generations.get(i) {
            Some(&g) if g == generation => self.slots[i].as_mut(),
            _ => None,
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let (i, generation) = Self::split(id);
        if self.generations.get(i) != Some(&generation) {
            return None;
        }
        let entry = self.slots[i].take()?;
        self.generations[i] = generation.wrapping_add(1);
        // (A slab of 2^32 slots is not reached: the ids of its last slot would wrap.)
        if let Ok(free) = u32::try_from(i) {
            self.free.push(free);
        }
        self.len -= 1;
        Some(entry)
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut Entry)> {
        self.slots
            .iter_mut()
            .zip(&self.generations)
            .enumerate()
            .filter_map(|(i, (slot, &g))| {
                slot.as_mut().map(|e| ((u64::from(g) << 32) | i as u64, e))
            })
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where a lease is in the watchdog: waiting for its due time, due and waiting for room in its
/// part's window, or on its way (it is not sent again until that call is answered).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Ready,
    InFlight { recheck: bool },
}

/// Extension calls in flight per part of the store: the window, between [`WINDOW_MIN`] and
/// [`WINDOW_MAX`]. A call carries at most [`CALL_LEASES`] leases: one script call on one
/// Redis server, about a millisecond of its time. The window stays small while the part
/// keeps up, so that the application's own commands on the same connection wait behind
/// little extension work; it doubles when a due lease has waited for room until less than
/// half its TTL is left, and shrinks by one call when a call is answered with nothing
/// waiting. Even at its widest it is a fraction of any command timeout's work: a call is
/// written when it is made, so its deadline counts from then, and what waits for room waits
/// here, in deadline order, not in the client's queue.
const WINDOW_MIN: usize = 2;
const WINDOW_MAX: usize = 64;

/// Leases per extension call.
const CALL_LEASES: usize = 256;

/// A round starts when the first lease is due, and takes along the leases due within a
/// quarter of their interval, at most [`LOOKAHEAD_MAX`] ns: leases acquired close together
/// are extended together, leases acquired far apart stay spread over the interval, and a
/// million leases acquired over half a minute are extended as they fall due, a few calls
/// every 100 ms, not in bursts that would hold up the application's own commands.
const LOOKAHEAD_DIV: u64 = 4;
const LOOKAHEAD_MAX: u64 = 100_000_000;

/// Leases taken from the due times in one go: the task then yields, so that what shares its
/// thread (the group commit's flusher, the wake-ups) is not held up by a round of a million
/// leases.
const TAKE_AT_ONCE: usize = 1024;

/// One part of the store's due leases, by deadline, its calls in flight and its window.
struct Part {
    ready: BinaryHeap<Reverse<(u64, u64)>>,
    in_flight: usize,
    window: usize,
}

impl Default for Part {
    fn default() -> Self {
        Part {
            ready: BinaryHeap::new(),
            in_flight: 0,
            window: WINDOW_MIN,
        }
    }
}

#[derive(Default)]
struct Registry {
    entries: Entries,
    /// Waiting leases by due time, in buckets of a millisecond: ids, each bucket's in no
    /// order. An id whose entry was dropped, is no longer waiting, or is due in another
    /// bucket now, is skipped when it comes up. (A bucket's ids lie together: a round of ten
    /// thousand leases is read from a few vectors, not popped one by one from a heap of a
    /// million, and an id costs 8 bytes.)
    due: DueTimes,
    /// Due leases per part of the store ([`Backend::extend_group`]).
    parts: HashMap<u64, Part>,
    /// The generation of the live task, if one runs.
    running: Option<u64>,
    /// When the sleeping task will look again (`None` while it works on a round): a new
    /// lease wakes it only if it is due earlier, so registering n leases costs O(n log n).
    wake_at: Option<Instant>,
    generations: u64,
    stats: WatchdogStats,
}

/// Ids by due time in buckets of [`BUCKET_NS`]: see `Registry::due`.
type DueTimes = std::collections::BTreeMap<u64, Vec<u64>>;

/// One bucket of the due times.
const BUCKET_NS: u64 = 1_000_000;

fn bucket(due_ns: u64) -> u64 {
    due_ns / BUCKET_NS
}

impl Registry {
    fn push_due(&mut self, due_ns: u64, id: u64) {
        self.due.entry(bucket(due_ns)).or_default().push(id);
    }

    fn wait(&mut self, id: u64, due: Instant) {
        if let Some(e) = self.entries.get_mut(id) {
            e.phase = Phase::Waiting;
            e.next_due = to_nanos(due);
            let due_ns = e.next_due;
            self.push_due(due_ns, id);
        }
    }

    /// When the task must look again for waiting leases: the end of the first bucket (every
    /// lease in it is due then).
    fn next_due(&self) -> Option<Instant> {
        self.due
            .first_key_value()
            .map(|(b, _)| epoch() + Duration::from_nanos((b + 1).saturating_mul(BUCKET_NS)))
    }

    fn count_lost(&mut self, id: u64, why: &str) {
        if let Some(e) = self.entries.remove(id) {
            let _span = tracing::info_span!("redlease.lost", key = %e.key).entered();
            tracing::warn!("lease lost: {why}");
            crate::telemetry::lost();
            e.state.mark_lost();
            self.stats.lost += 1;
        }
    }

    /// Starts a round if the first waiting lease is due: moves it, and the leases due
    /// within their lookahead, to their parts' queues, at most [`TAKE_AT_ONCE`] of them;
    /// `true` if more are due now (the task yields, then takes the rest).
    fn take_due(&mut self, now: Instant, backend: &dyn Backend) -> bool {
        let now_ns = to_nanos(now);
        let mut round = false;
        let mut budget = TAKE_AT_ONCE;
        while let Some((&b, _)) = self.due.first_key_value() {
            let mut ids = self.due.remove(&b).unwrap_or_default();
            let mut not_yet = Vec::new();
            while let Some(id) = ids.pop() {
                let Some(e) = self.entries.get_mut(id) else {
                    continue;
                };
                if e.phase != Phase::Waiting || bucket(e.next_due) != b {
                    continue;
                }
                let lookahead = if round {
                    (e.interval / LOOKAHEAD_DIV).min(LOOKAHEAD_MAX)
                } else {
                    0
                };
                if e.next_due > now_ns.saturating_add(lookahead) {
                    not_yet.push(id);
                    continue;
                }
                if budget == 0 {
                    ids.push(id);
                    ids.append(&mut not_yet);
                    self.due.insert(b, ids);
                    return true;
                }
                budget -= 1;
                round = true;
                if e.state.check_lost() {
                    // Its deadline passed without a confirmed extension (or a max_hold ran
                    // out); a guard dropped first is unregistered and never seen here.
                    self.count_lost(id, "no confirmed extension before its deadline");
                    continue;
                }
                e.phase = Phase::Ready;
                let deadline = to_nanos(e.state.deadline());
                let part = backend.extend_group(&e.key);
                self.parts
                    .entry(part)
                    .or_default()
                    .ready
                    .push(Reverse((deadline, id)));
            }
            if !not_yet.is_empty() {
                // What is left of this bucket is not due yet: the round ends here.
                self.due.insert(b, not_yet);
                break;
            }
        }
        false
    }

    /// Every held lease is sent now (the store may have lost leases: a reconnect, a restart):
    /// those waiting go to their parts' queues, those on their way are sent again once
    /// answered.
    fn take_all(&mut self, backend: &dyn Backend) {
        let mut ready = Vec::new();
        for (id, e) in self.entries.iter_mut() {
            match e.phase {
                Phase::Waiting => {
                    e.phase = Phase::Ready;
                    ready.push((
                        backend.extend_group(&e.key),
                        to_nanos(e.state.deadline()),
                        id,
                    ));
                }
                Phase::InFlight { .. } => e.phase = Phase::InFlight { recheck: true },
                Phase::Ready => {}
            }
        }
        for (part, deadline, id) in ready {
            self.parts
                .entry(part)
                .or_default()
                .ready
                .push(Reverse((deadline, id)));
        }
    }

    /// The calls to send now: while a part has due leases and room in its window, one more
    /// call of its earliest deadlines.
    fn fill_windows(&mut self, now: Instant) -> Vec<(u64, Vec<Due>)> {
        let mut calls = Vec::new();
        let Registry { entries, parts, .. } = self;
        let (mut lost, mut parked) = (Vec::new(), Vec::new());
        for (&part_id, part) in parts.iter_mut() {
            while part.in_flight < part.window && !part.ready.is_empty() {
                let mut due = Vec::new();
                while due.len() < CALL_LEASES {
                    let Some(Reverse((_, id))) = part.ready.pop() else {
                        break;
                    };
                    let Some(e) = entries.get_mut(id) else {
                        continue;
                    };
                    if e.phase != Phase::Ready {
                        continue;
                    }
                    if e.state.check_lost() {
                        lost.push(id);
                        continue;
                    }
                    // A capped hold gets extensions that end at the cap; once too little is
                    // left, none, and the lease runs out.
                    let left = e.hold_until().map(|u| u.saturating_duration_since(now));
                    if left.is_some_and(|l| l < MIN_TTL) {
                        let deadline = e.state.deadline();
                        if e.next_due < to_nanos(deadline) {
                            tracing::info!(key = %e.key, "max_hold reached: the lease is no longer extended");
                        }
                        // Looked at again at its deadline, when it is lost.
                        parked.push((id, deadline));
                        continue;
                    }
                    e.phase = Phase::InFlight { recheck: false };
                    due.push(Due {
                        id,
                        key: e.key.clone(),
                        token: Token::from_secret(e.token.clone()),
                        ttl: left.map_or(e.ttl(), |l| e.ttl().min(l)),
                        deadline: e.state.deadline(),
                    });
                }
                if due.is_empty() {
                    break;
                }
                part.in_flight += 1;
                calls.push((part_id, due));
            }
        }
        // (A part keeps its window while it has work: an idle one starts small again.)
        parts.retain(|_, p| p.in_flight > 0 || !p.ready.is_empty());
        for (id, deadline) in parked {
            self.wait(id, deadline);
        }
        for id in lost {
            self.count_lost(id, "no confirmed extension before its deadline");
        }
        calls
    }

    /// A call of `part` was answered: one call fewer in flight, and the window adjusted (see
    /// [`WINDOW_MIN`]): wider when the earliest due lease has less than half its TTL left,
    /// narrower when nothing waits.
    fn pace(&mut self, part: u64) {
        let Some(p) = self.parts.get_mut(&part) else {
            return;
        };
        p.in_flight = p.in_flight.saturating_sub(1);
        let behind = p.ready.peek().is_some_and(|Reverse((deadline, id))| {
            self.entries.get(*id).is_some_and(|e| {
                let left = deadline.saturating_sub(to_nanos(Instant::now()));
                left < e.ttl / 2
            })
        });
        if behind {
            p.window = (p.window * 2).min(WINDOW_MAX);
        } else if p.ready.is_empty() {
            p.window = p.window.saturating_sub(1).max(WINDOW_MIN);
        }
    }

    /// After the task ended: nothing is on its way or queued any more; every lease waits.
    fn reset(&mut self) {
        self.parts.clear();
        self.due.clear();
        let mut waiting = Vec::with_capacity(self.entries.len());
        for (id, e) in self.entries.iter_mut() {
            e.phase = Phase::Waiting;
            waiting.push((e.next_due, id));
        }
        for (due, id) in waiting {
            self.push_due(due, id);
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

struct Shared {
    backend: Arc<dyn Backend>,
    registry: Mutex<Registry>,
    wake: Event,
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The handle a manager keeps; the task runs only while leases are registered.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    /// The leases held under a token shared by several guards (a reentrant reign's), so that
    /// they share one registration and one lost state: lease token → lease.
    shared_leases: Arc<SharedLeases>,
}

/// Leases held under one token by several guards: lease token → lease.
type SharedLeases = Mutex<HashMap<Token, Weak<Kept>>>;

/// What to keep alive: a granted lease, as [`Watchdog::keep`] takes it.
pub(crate) struct ToKeep {
    pub(crate) key: LeaseKey,
    /// The lease token.
    pub(crate) token: Token,
    pub(crate) ttl: Duration,
    /// How often to extend it; `None`: the watchdog is off for it.
    pub(crate) interval: Option<Duration>,
    /// No extension reaches past this (a maximum hold).
    pub(crate) cap: Option<Instant>,
    /// When the winning attempt was sent, and the validity it was granted.
    pub(crate) sent: Instant,
    pub(crate) validity: Duration,
    /// Other guards may hold the same lease token (a reentrant reign): share one entry.
    pub(crate) shared: bool,
    /// The grant's fencing token: a shared entry keeps its first (the reign's).
    pub(crate) fence: u64,
}

/// A held lease in this manager: its lost state, and its registration with the watchdog
/// (unregistered when the last guard holding it goes).
pub(crate) struct Kept {
    pub(crate) state: Arc<LeaseState>,
    /// The maximum hold's end, in ns since [`epoch`] (0: none): no extension reaches past
    /// it. (A held lease is kept small.)
    cap: u64,
    watch: Option<Registration>,
    /// For a shared lease: the map entry to take out when the last holder goes, and the
    /// reign's fencing token (boxed: most leases are not shared, and a held lease is kept
    /// small).
    shared: Option<Box<(Arc<SharedLeases>, Token, u64)>>,
}

impl Kept {
    /// The maximum hold's end, if any: no extension reaches past it.
    pub(crate) fn cap(&self) -> Option<Instant> {
        (self.cap != 0).then(|| epoch() + Duration::from_nanos(self.cap))
    }

    /// A shared lease's fencing token: the first grant's of its reign. Every hold of a reign
    /// in this manager reports it, even where a store of several nodes reports more for a
    /// re-entry (a Redlock node that granted the reign late, after its clock passed the
    /// floor the round proposed, minted more than the token the round took).
    pub(crate) fn reign_fence(&self) -> Option<u64> {
        self.shared.as_deref().map(|s| s.2)
    }

    /// After a manual extend: keep extending with the new TTL.
    pub(crate) fn set_ttl(&self, ttl: Duration) {
        if let Some(w) = &self.watch {
            w.set_ttl(ttl);
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        drop(self.watch.take());
        if let Some((map, token, _)) = self.shared.as_deref() {
            let mut map = lock_map(map);
            // Only if no newer lease took the slot.
            if map.get(token).is_some_and(|w| w.strong_count() == 0) {
                map.remove(token);
            }
        }
    }
}

fn lock_map(m: &SharedLeases) -> MutexGuard<'_, HashMap<Token, Weak<Kept>>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One lease's entry in the watchdog; dropping it unregisters.
struct Registration {
    shared: Arc<Shared>,
    id: u64,
}

impl Registration {
    fn set_ttl(&self, ttl: Duration) {
        let mut reg = self.shared.registry();
        let Some(e) = reg.entries.get_mut(self.id) else {
            return;
        };
        e.ttl = nanos(ttl);
        e.interval = e.interval.min(nanos(ttl / 3));
        if e.phase != Phase::Waiting {
            // On its way or queued: its answer sets the next due time from the new interval.
            return;
        }
        let next_due = Instant::now() + e.interval();
        reg.wait(self.id, next_due);
        if reg.wake_at.is_some_and(|at| next_due < at) {
            drop(reg);
            self.shared.wake.notify(1);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.shared.registry().entries.remove(self.id);
    }
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Watchdog").field(&self.stats()).finish()
    }
}

impl Watchdog {
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Self {
        Watchdog {
            shared: Arc::new(Shared {
                backend,
                registry: Mutex::default(),
                wake: Event::new(),
            }),
            shared_leases: Arc::default(),
        }
    }

    /// The lease `lease` held in this manager: for a shared lease token, the live entry of
    /// it (whose deadline this grant confirms), else a new one, registered with the task
    /// unless the watchdog is off for it.
    pub(crate) fn keep(&self, lease: ToKeep) -> Arc<Kept> {
        let deadline = lease.sent + lease.validity;
        // Kept until the map is unlocked: dropping the last handle of a lease locks it.
        let existing = lease
            .shared
            .then(|| {
                lock_map(&self.shared_leases)
                    .get(&lease.token)
                    .and_then(Weak::upgrade)
            })
            .flatten();
        if let Some(k) = &existing {
            // A re-entry only ever moves the deadline later (the store never shortens the
            // lease: a re-entry with a shorter TTL keeps the longer one).
            if k.state.confirm_later(deadline) {
                return k.clone();
            }
            // Lost here already (a passed deadline, say) though the store still had it: the
            // old guards stay lost, this one starts afresh.
        }
        let state = Arc::new(LeaseState::new(lease.sent, deadline));
        let watch = lease.interval.map(|interval| {
            self.register(
                lease.key,
                lease.token.clone(),
                lease.ttl,
                interval,
                lease.cap,
                state.clone(),
            )
        });
        let kept = Arc::new(Kept {
            state,
            cap: lease.cap.map_or(0, |c| to_nanos(c).max(1)),
            watch,
            shared: lease
                .shared
                .then(|| Box::new((self.shared_leases.clone(), lease.token.clone(), lease.fence))),
        });
        if lease.shared {
            let replaced = lock_map(&self.shared_leases).insert(lease.token, Arc::downgrade(&kept));
            drop((replaced, existing));
        }
        kept
    }

    fn register(
        &self,
        key: LeaseKey,
        token: Token,
        ttl: Duration,
        interval: Duration,
        hold_until: Option<Instant>,
        state: Arc<LeaseState>,
    ) -> Registration {
        let mut reg = self.shared.registry();
        let next_due = Instant::now() + interval;
        let id = reg.entries.insert(Entry {
            key,
            token: token.secret().clone(),
            state,
            ttl: nanos(ttl),
            interval: nanos(interval),
            next_due: to_nanos(next_due),
            hold_until: hold_until.map_or(0, |u| to_nanos(u).max(1)),
            phase: Phase::Waiting,
        });
        reg.push_due(to_nanos(next_due), id);
        let wake = reg.wake_at.is_some_and(|at| next_due < at);
        let start = reg.running.is_none().then(|| {
            reg.generations += 1;
            reg.running = Some(reg.generations);
            reg.generations
        });
        drop(reg);
        if let Some(generation) = start {
            // Spawned with the registry unlocked: a task dropped at once (a runtime shutting
            // down) runs `Running::drop`, which takes the lock. The guard is made here, not
            // inside `run`, so that even a task never polled clears `running`.
            runtime::background().spawn(run(Running {
                shared: self.shared.clone(),
                generation,
            }));
        }
        if wake {
            self.shared.wake.notify(1);
        }
        Registration {
            shared: self.shared.clone(),
            id,
        }
    }

    pub(crate) fn stats(&self) -> WatchdogStats {
        let reg = self.shared.registry();
        WatchdogStats {
            leases: reg.entries.len(),
            ..reg.stats
        }
    }
}

struct Due {
    id: u64,
    key: LeaseKey,
    token: Token,
    ttl: Duration,
    /// The lease's deadline when it was sent.
    deadline: Instant,
}

/// Owned by the watchdog task: clears `running` when the task ends for any reason (its
/// runtime shut down, say), so the next registration starts a new task. The generation
/// keeps a finished task from clearing the mark of a newer one.
struct Running {
    shared: Arc<Shared>,
    generation: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut reg = self.shared.registry();
        if reg.running != Some(self.generation) {
            return;
        }
        reg.running = None;
        // Its calls on their way and its queues went with it: the next task sends those
        // leases again.
        reg.reset();
        // A task that panicked (a store's bug) is started again after a pause, if leases
        // are held: a registration made while it unwound saw it running and started none.
        // (A task dropped by a runtime shutting down is not: it would be dropped again.)
        if std::thread::panicking() && !reg.entries.is_empty() {
            reg.generations += 1;
            let generation = reg.generations;
            reg.running = Some(generation);
            drop(reg);
            let running = Running {
                shared: self.shared.clone(),
                generation,
            };
            runtime::background().spawn(async move {
                runtime::sleep(RESTART_AFTER_PANIC).await;
                run(running).await;
            });
        }
    }
}

/// How long a watchdog task that panicked waits before it starts again.
const RESTART_AFTER_PANIC: Duration = Duration::from_millis(50);

/// How long the task stays when no lease is held, so that a manager taking one lease at a
/// time does not start a task per lease.
const LINGER: Duration = Duration::from_secs(10);

/// An extension call on its way: the leases it carries and when it was sent.
type Call = futures::future::BoxFuture<'static, Answered>;

/// An extension call's answer: `None` if every lease's deadline came first.
struct Answered {
    part: u64,
    due: Vec<Due>,
    started: Instant,
    result: Option<crate::Result<Vec<Extended>>>,
}

/// The watchdog task. A round starts when the first lease falls due and takes the leases due
/// soon after it ([`LOOKAHEAD_DIV`]) into their parts' queues ([`Backend::extend_group`]);
/// each part sends its queue in deadline order, a few calls at a time ([`WINDOW`]), and each
/// call's answer is applied when it comes, which frees room for the next. So a round of a
/// million leases is paced by the server's answers, a short lease is sent before the long
/// ones due with it, and a part that does not answer (a paused primary) holds up only its
/// own leases, which are not sent again meanwhile. When the store says it may have lost
/// leases ([`Backend::disturbed`]: a reconnect), every lease is sent at once.
async fn run(running: Running) {
    use futures::StreamExt;
    let shared = &running.shared;
    let backend = &*shared.backend;
    let mut idle_since: Option<Instant> = None;
    let mut calls: futures::stream::FuturesUnordered<Call> = Default::default();
    let mut disturbed = backend.disturbed();
    loop {
        let wake = shared.wake.listen();
        let now = Instant::now();
        let (sends, next_wake, more) = {
            let mut reg = shared.registry();
            let more = reg.take_due(now, backend);
            let sends = reg.fill_windows(now);
            let next_due = reg.next_due();
            let next_wake = if reg.entries.is_empty() && calls.is_empty() {
                let since = *idle_since.get_or_insert(now);
                if now >= since + LINGER {
                    // Cleared under the lock that saw the registry empty: a registration
                    // after it starts a new task.
                    reg.running = None;
                    reg.wake_at = None;
                    return;
                }
                // Idle: a registration wakes the task only if due before the linger ends.
                since + LINGER
            } else {
                idle_since = None;
                // With nothing waiting, the calls' answers (or their deadlines) wake the task.
                next_due.unwrap_or(now + LINGER)
            };
            reg.wake_at = (sends.is_empty() && !more).then_some(next_wake);
            (sends, next_wake, more)
        };
        if !sends.is_empty() || more {
            for (part, due) in sends {
                calls.push(Box::pin(call(shared.backend.clone(), part, due)));
            }
            if more {
                runtime::yield_now().await;
            }
            continue;
        }
        let timer = std::pin::pin!(runtime::sleep_until(next_wake));
        let wait = future::select(wake, timer);
        let answer = async {
            match calls.next().await {
                Some(answered) => answered,
                None => future::pending().await,
            }
        };
        match future::select(std::pin::pin!(answer), future::select(wait, &mut disturbed)).await {
            future::Either::Left((answered, _)) => apply(shared, answered),
            future::Either::Right((future::Either::Right(_), _)) => {
                // Listen again before the leases are sent, so a disturbance during the
                // check is not missed.
                disturbed = backend.disturbed();
                tracing::info!("the store may have lost leases: checking every lease now");
                shared.registry().take_all(backend);
            }
            future::Either::Right((future::Either::Left(_), _)) => {}
        }
    }
}

/// Sends one part's leases in one call. The call is waited for until the last of their
/// deadlines, never cut earlier, so that a lease is never sent again while a copy may still
/// run; a lease whose deadline passes meanwhile is lost by its own timer (see
/// [`LeaseState::lost`]).
async fn call(backend: Arc<dyn Backend>, part: u64, due: Vec<Due>) -> Answered {
    let started = Instant::now();
    let latest = due.iter().map(|d| d.deadline).max();
    let result = {
        let leases: Vec<Lease<'_>> = due
            .iter()
            .map(|d| Lease {
                key: &d.key,
                token: &d.token,
                ttl: d.ttl,
            })
            .collect();
        let span = tracing::debug_span!("redlease.extend", leases = leases.len());
        let extending = (*backend)
            .extend(&leases, NodeTerms::new())
            .instrument(span);
        runtime::until(latest, extending).await
    };
    crate::telemetry::watchdog_round(started.elapsed());
    Answered {
        part,
        due,
        started,
        result,
    }
}

/// Applies one call's answer to the leases it carried (those still registered).
fn apply(shared: &Shared, answered: Answered) {
    let Answered {
        part,
        due,
        started,
        result,
    } = answered;
    let mut reg = shared.registry();
    reg.stats.rounds += 1;
    reg.pace(part);
    let now = Instant::now();
    // The next due time of a lease answered `Held`, unless a disturbance asked for a check.
    let next = |e: &Entry, held: Instant| match e.phase {
        Phase::InFlight { recheck: true } => now,
        _ => held,
    };
    match result {
        Some(Ok(outcomes)) => {
            let mut failed = 0;
            for (d, outcome) in due.iter().zip(outcomes) {
                let Some(e) = reg.entries.get(d.id) else {
                    continue;
                };
                match outcome {
                    Extended::Held(v) if e.state.confirm(started, v) => {
                        let due_at = next(e, started + e.interval());
                        reg.wait(d.id, due_at);
                        reg.stats.extended += 1;
                    }
                    Extended::Failed(err) => {
                        // This lease's command failed, its neighbours' did not: only it is
                        // tried again, and it is lost only at its deadline.
                        e.state.unconfirmed(started, d.ttl);
                        if failed == 0 {
                            tracing::warn!(key = %d.key, error = %err, "lease extension failed; retrying");
                        }
                        failed += 1;
                        let due_at = now + retry_after(e.interval());
                        reg.wait(d.id, due_at);
                    }
                    _ => reg.count_lost(d.id, "extension refused or too late"),
                }
            }
            if failed > 1 {
                tracing::warn!(leases = failed, "lease extensions failed; retrying");
            }
        }
        failed => {
            match failed {
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "watchdog extension failed; retrying")
                }
                _ => tracing::warn!("watchdog extension timed out at the leases' deadlines"),
            }
            for d in &due {
                if let Some(e) = reg.entries.get(d.id) {
                    e.state.unconfirmed(started, d.ttl);
                    let due_at = now + retry_after(e.interval());
                    reg.wait(d.id, due_at);
                }
            }
        }
    }
}

/// How soon a lease whose extension failed is tried again.
fn retry_after(interval: Duration) -> Duration {
    (interval / 8).max(Duration::from_millis(5))
}
