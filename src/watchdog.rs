//! One shared task per manager that keeps every held lease alive, in batches; and the
//! [`Kept`] lease a guard holds: its lost state and its registration with that task.

use std::collections::HashMap;
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
    confirmed_sent: Mutex<Instant>,
    lost: AtomicBool,
    event: Event,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn to_nanos(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

impl LeaseState {
    pub(crate) fn new(sent: Instant, deadline: Instant) -> Self {
        LeaseState {
            deadline: AtomicU64::new(to_nanos(deadline)),
            confirmed_sent: Mutex::new(sent),
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
        if sent >= *last {
            *last = sent;
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
    token: Token,
    ttl: Duration,
    interval: Duration,
    next_due: Instant,
    state: Arc<LeaseState>,
    /// The maximum hold's end (see `LockOptions::max_hold`): no extension reaches past it.
    hold_until: Option<Instant>,
    /// An extension of it is on its way: it is not sent again until that one is answered.
    in_flight: bool,
}

#[derive(Default)]
struct Registry {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// The generation of the live task, if one runs.
    running: Option<u64>,
    /// When the sleeping task will look again (`None` while it works on a round): a new
    /// lease wakes it only if it is due earlier, so registering n leases costs O(n).
    wake_at: Option<Instant>,
    generations: u64,
    stats: WatchdogStats,
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
}

/// A held lease in this manager: its lost state, and its registration with the watchdog
/// (unregistered when the last guard holding it goes).
pub(crate) struct Kept {
    pub(crate) state: Arc<LeaseState>,
    /// The maximum hold's end, if any: no extension reaches past it.
    pub(crate) cap: Option<Instant>,
    watch: Option<Registration>,
    /// The map entry to take out when the last holder goes, for a shared lease (boxed: most
    /// leases are not shared, and a held lease is kept small).
    shared: Option<Box<(Arc<SharedLeases>, Token)>>,
}

impl Kept {
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
        if let Some((map, token)) = self.shared.as_deref() {
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
        let Some(e) = reg.entries.get_mut(&self.id) else {
            return;
        };
        e.ttl = ttl;
        e.interval = e.interval.min(ttl / 3);
        e.next_due = Instant::now() + e.interval;
        let next_due = e.next_due;
        if reg.wake_at.is_some_and(|at| next_due < at) {
            drop(reg);
            self.shared.wake.notify(1);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.shared.registry().entries.remove(&self.id);
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
            cap: lease.cap,
            watch,
            shared: lease
                .shared
                .then(|| Box::new((self.shared_leases.clone(), lease.token.clone()))),
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
        let id = reg.next_id;
        reg.next_id += 1;
        let next_due = Instant::now() + interval;
        reg.entries.insert(
            id,
            Entry {
                key,
                token,
                ttl,
                interval,
                next_due,
                state,
                hold_until,
                in_flight: false,
            },
        );
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
        // Its calls on their way went with it: the next task sends those leases again.
        for e in reg.entries.values_mut() {
            e.in_flight = false;
        }
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

/// An extension call's answer: `None` if a lease's deadline came first.
struct Answered {
    due: Vec<Due>,
    started: Instant,
    result: Option<crate::Result<Vec<Extended>>>,
}

/// The watchdog task. Each round takes the leases due, sends them in one call per part of
/// the store ([`Backend::extend_group`]), and goes on: each call's answer is applied when it
/// comes, while the next leases fall due and are sent, so a part that does not answer (a
/// paused primary) holds up only its own leases, which are not sent again meanwhile.
async fn run(running: Running) {
    let shared = &running.shared;
    let mut idle_since: Option<Instant> = None;
    let mut calls: futures::stream::FuturesUnordered<Call> = Default::default();
    loop {
        let wake = shared.wake.listen();
        let now = Instant::now();
        let mut due = Vec::new();
        let next_wake = {
            let mut reg = shared.registry();
            let before = reg.entries.len();
            reg.entries.retain(|_, e| {
                let lost = e.state.check_lost();
                if lost {
                    // Its deadline passed without a confirmed extension (or a max_hold ran
                    // out); a guard dropped first is unregistered and never seen here.
                    let _span = tracing::info_span!("redlease.lost", key = %e.key).entered();
                    tracing::warn!("lease lost: no confirmed extension before its deadline");
                    crate::telemetry::lost();
                }
                !lost
            });
            reg.stats.lost += (before - reg.entries.len()) as u64;
            let waiting = reg.entries.values().filter(|e| !e.in_flight);
            match waiting.map(|e| e.next_due).min() {
                None if reg.entries.is_empty() => {
                    let since = *idle_since.get_or_insert(now);
                    if now >= since + LINGER {
                        // Cleared under the lock that saw the registry empty: a registration
                        // after it starts a new task. A call still on its way is dropped:
                        // nobody holds its leases any more.
                        reg.running = None;
                        reg.wake_at = None;
                        return;
                    }
                    // Idle: a registration wakes the task only if due before the linger ends.
                    reg.wake_at = Some(since + LINGER);
                    since + LINGER
                }
                None => {
                    // Every lease is on its way: their answers (or deadlines) wake the task.
                    idle_since = None;
                    let later = now + LINGER;
                    reg.wake_at = Some(later);
                    later
                }
                Some(first_due) => {
                    idle_since = None;
                    // A round starts when the first lease is due, and takes along every lease
                    // due within half its interval: leases acquired at different moments fall
                    // into the same round after their first extension.
                    if first_due <= now {
                        for (&id, e) in reg.entries.iter_mut() {
                            if !e.in_flight && e.next_due <= now + e.interval / 2 {
                                // A capped hold gets extensions that end at the cap; once
                                // too little is left, none, and the lease runs out.
                                let left = e.hold_until.map(|u| u.saturating_duration_since(now));
                                if left.is_some_and(|l| l < MIN_TTL) {
                                    let deadline = e.state.deadline();
                                    if e.next_due < deadline {
                                        tracing::info!(key = %e.key, "max_hold reached: the lease is no longer extended");
                                    }
                                    // Looked at again at its deadline, when it is lost.
                                    e.next_due = deadline;
                                    continue;
                                }
                                e.in_flight = true;
                                due.push(Due {
                                    id,
                                    key: e.key.clone(),
                                    token: e.token.clone(),
                                    ttl: left.map_or(e.ttl, |l| e.ttl.min(l)),
                                    deadline: e.state.deadline(),
                                });
                            }
                        }
                    }
                    reg.wake_at = due.is_empty().then_some(first_due);
                    first_due
                }
            }
        };
        if !due.is_empty() {
            let mut groups: HashMap<u64, Vec<Due>> = HashMap::new();
            for d in due {
                groups
                    .entry((*shared.backend).extend_group(&d.key))
                    .or_default()
                    .push(d);
            }
            for group in groups.into_values() {
                calls.push(Box::pin(call(shared.backend.clone(), group)));
            }
            continue;
        }
        let timer = std::pin::pin!(runtime::sleep_until(next_wake));
        let wait = future::select(wake, timer);
        if calls.is_empty() {
            wait.await;
            continue;
        }
        use futures::StreamExt;
        if let future::Either::Left((Some(answered), _)) = future::select(calls.next(), wait).await
        {
            apply(shared, answered);
        }
    }
}

/// Sends one part's due leases in one call, cut short at the earliest of their deadlines:
/// the lost signal must not wait on a hung call.
async fn call(backend: Arc<dyn Backend>, due: Vec<Due>) -> Answered {
    let started = Instant::now();
    let earliest = due.iter().map(|d| d.deadline).min();
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
        runtime::until(earliest, extending).await
    };
    crate::telemetry::watchdog_round(started.elapsed());
    Answered {
        due,
        started,
        result,
    }
}

/// Applies one call's answer to the leases it carried (those still registered).
fn apply(shared: &Shared, answered: Answered) {
    let Answered {
        due,
        started,
        result,
    } = answered;
    let mut reg = shared.registry();
    reg.stats.rounds += 1;
    for d in &due {
        if let Some(e) = reg.entries.get_mut(&d.id) {
            e.in_flight = false;
        }
    }
    match result {
        Some(Ok(outcomes)) => {
            let mut failed = 0;
            let retry_at = Instant::now();
            for (d, outcome) in due.iter().zip(outcomes) {
                let Some(e) = reg.entries.get_mut(&d.id) else {
                    continue;
                };
                match outcome {
                    Extended::Held(v) if e.state.confirm(started, v) => {
                        e.next_due = started + e.interval;
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
                        e.next_due = retry_at + retry_after(e.interval);
                    }
                    _ => {
                        // Refused, or confirmed only after the deadline had passed.
                        let _span = tracing::info_span!("redlease.lost", key = %d.key).entered();
                        tracing::warn!("lease lost: extension refused or too late");
                        crate::telemetry::lost();
                        e.state.mark_lost();
                        reg.entries.remove(&d.id);
                        reg.stats.lost += 1;
                    }
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
                _ => tracing::warn!("watchdog extension timed out at a lease deadline"),
            }
            let retry_at = Instant::now();
            for d in &due {
                if let Some(e) = reg.entries.get_mut(&d.id) {
                    e.state.unconfirmed(started, d.ttl);
                    e.next_due = retry_at + retry_after(e.interval);
                }
            }
        }
    }
}

/// How soon a lease whose extension failed is tried again.
fn retry_after(interval: Duration) -> Duration {
    (interval / 8).max(Duration::from_millis(5))
}
