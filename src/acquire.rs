//! The one acquire engine: runs a claim of any kind (plain, fair, a reentrant hold) to a
//! [`LockGuard`]. Attempts, waiting (wake-ups, fallback re-checks, back-off), cancel-safe
//! clean-up, the `redlease.acquire` span and the acquire metrics live here and nowhere else;
//! the kind of claim is data the store acts on.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use event_listener::{Event, EventListener};
use futures::future::{self, FutureExt};

use crate::backend::{
    Acquire, Attempt, Backend, Capabilities, Claim, ClaimKind, Grant, NodeTerms, Release,
    Subscription, WakeUp,
};
use crate::error::{Error, Result};
use crate::guard::{store_id, LockGuard, PendingClaim, Releasing};
use crate::options::LockOptions;
use crate::options::RetryPolicy;
use crate::runtime;
use crate::token::LeaseKey;
use crate::token::Token;
use crate::watchdog::{ToKeep, Watchdog};

/// How long an attempt waits for this process's release of the same key still in flight
/// before it goes ahead anyway (a release takes one round trip).
const RELEASE_WAIT: Duration = Duration::from_millis(500);

/// The longest pause of a waiting plain claim that registers with the store, whatever its
/// `max_delay`: its attempts renew its writer preference (new reads of its name wait behind
/// it), which the store keeps `2 × this + 100 ms` past its last attempt, so that a waiter
/// that died holds readers back that long at most.
const WRITER_RECHECK: Duration = Duration::from_secs(1);

/// What a manager's locks share: the store (and what it can serve) and the watchdog.
pub(crate) struct Engine {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) capabilities: Capabilities,
    pub(crate) watchdog: Watchdog,
}

impl Engine {
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Self {
        Engine {
            capabilities: backend.capabilities(),
            watchdog: Watchdog::new(backend.clone()),
            backend,
        }
    }

    /// Refuses a claim kind the store cannot serve, naming it and the store.
    pub(crate) fn check(&self, kind: &ClaimKind) -> Result<()> {
        self.capabilities.check(kind, &self.backend)
    }
}

/// What the engine needs of a lock: the facade ([`Lock`](crate::Lock)) hands it over.
pub(crate) struct Target<'a> {
    pub(crate) manager: &'a Engine,
    pub(crate) name: &'a Arc<str>,
    pub(crate) key: &'a LeaseKey,
    pub(crate) options: &'a LockOptions,
    pub(crate) kind: &'a ClaimKind,
}

/// One attempt: `Ok(None)` if someone else holds the lock.
pub(crate) async fn once(target: Target<'_>) -> Result<Option<LockGuard>> {
    observed(&target, async {
        let mut claim = Attempts::new(&target);
        let started = Instant::now();
        match claim.attempt(Attempt::Once, None).await? {
            Tried::Granted(grant) => Ok(Some(claim.into_guard(grant, started))),
            Tried::Held(_) => Ok(None),
        }
    })
    .await
}

/// Waits until the lock is ours, or `limit` passes ([`Error::Timeout`]).
pub(crate) async fn wait(target: Target<'_>, limit: Option<Duration>) -> Result<LockGuard> {
    let run = async {
        let mut claim = Attempts::new(&target);
        let retry = &target.options.retry;
        // A limit too far to represent (Duration::MAX) means no limit.
        let deadline = limit.and_then(|d| claim.began.checked_add(d));
        let notify = retry.notify;
        // Waiters register with the store when they are woken by it, and a kind that
        // queues always does (its place in the queue is the registration).
        let registers = notify || target.kind.queues();
        let recheck = match target.kind {
            ClaimKind::Plain if registers => retry.max_delay.min(WRITER_RECHECK),
            _ => retry.max_delay,
        };
        let mut sub: Option<Subscription> = None;
        let mut pauses = Pauses::new(retry, notify, recheck);
        // Woken by the store, this process's waiters on one lock share one fallback re-check
        // (a waiter in a fair queue keeps its own place, so it re-checks for itself).
        // Joined at the first pause: an acquire granted at once never touches the registry.
        let shares_rechecks = notify && !target.kind.queues();
        let mut rechecks: Option<Rechecks> = None;
        let mut unavailable_pause = retry.min_delay;
        // The first attempt yields to the waiters already there; later ones compete as a
        // waiter. The first attempt always gets its answer (bounded by the store's own
        // timeouts), so that a zero or tiny wait still takes a free lock.
        let mut arriving = true;
        loop {
            let woken = sub.as_ref().map(Subscription::listen);
            let attempt = match (registers, arriving) {
                (false, _) => Attempt::Once,
                (true, true) => Attempt::Arriving { recheck },
                (true, false) => Attempt::Waiting { recheck },
            };
            let started = Instant::now();
            let limit = if arriving { None } else { deadline };
            let remaining = match claim.attempt(attempt, limit).await {
                Ok(Tried::Granted(grant)) => return Ok(claim.into_guard(grant, started)),
                Ok(Tried::Held(remaining)) => {
                    claim.unavailable = None;
                    unavailable_pause = retry.min_delay;
                    remaining
                }
                // Too few quorum members now (down, reconnecting, warming up): the wait goes
                // on while it lasts, trying again after a pause of its own (no holder is there
                // to wake it). Its clean-up stays armed: a silent member may have granted.
                // Or too few replicas acknowledged a grant (given back): the same. So is a
                // store unavailable for a moment (a failover, a reconnect) within a wait
                // limit: its outcome is unknown, and the next attempt, with this claim's
                // token, finds a grant it made (if the wait ends first, the clean-up gives it
                // back). An unlimited wait reports the outage instead of hiding it.
                Err(e)
                    if matches!(
                        e,
                        Error::QuorumNotReached { .. } | Error::NotAcknowledged { .. }
                    ) || (deadline.is_some() && crate::backend::unavailable(&e)) =>
                {
                    arriving = false;
                    if !claim
                        .wait_on(e, &mut unavailable_pause, recheck, deadline)
                        .await
                    {
                        return Err(claim.timeout());
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let round_trip = started.elapsed();
            // A first attempt turned away from a free lock: it yielded to registered waiters.
            let yielded = arriving && remaining.is_none();
            arriving = false;
            let mut woken = woken;
            let mut remaining = remaining;
            if notify && sub.is_none() {
                // Subscribe, then check again: a release (or hand-off) that came before the
                // subscription was confirmed is seen by that check.
                let subscribed = (*target.manager.backend).subscribe(&claim.pending.claim);
                let subscribed = match runtime::until(deadline, subscribed).await {
                    None => return Err(claim.timeout()),
                    Some(Ok(subscribed)) => subscribed,
                    // As for an attempt (above): a store unavailable for a moment.
                    Some(Err(e)) if deadline.is_some() && crate::backend::unavailable(&e) => {
                        if !claim
                            .wait_on(e, &mut unavailable_pause, recheck, deadline)
                            .await
                        {
                            return Err(claim.timeout());
                        }
                        continue;
                    }
                    Some(Err(e)) => return Err(e),
                };
                if !yielded {
                    sub = Some(subscribed);
                    continue;
                }
                // The lock was free, and the waiters the release woke are on their way to
                // it: check again after they have had two of our round trips and a
                // millisecond to take it, or at the next release. Checking at once would race
                // them, and a holder that releases and acquires again would mostly win its
                // lock back (a flag left by waiters that have gone costs this short pause,
                // not a fallback re-check's whole second).
                woken = Some(subscribed.listen());
                sub = Some(subscribed);
                remaining = Some(round_trip.saturating_mul(2));
            }
            // One waiter of this lock in this process re-checks now and then (a wake-up may
            // be lost, a crashed holder never publishes); the others wait for a wake-up, or
            // for the re-checker to leave and hand its turn on.
            if shares_rechecks && rechecks.is_none() {
                rechecks = Some(Rechecks::join(&target));
            }
            let handover = match &mut rechecks {
                Some(r) if !yielded => r.unless_mine(),
                _ => None,
            };
            // The holder's lease runs out after `remaining` (a crashed holder never
            // publishes), or a fair queue's head's deadline passes: the pause is no longer.
            if !pauses.wait(woken, remaining, handover, deadline).await {
                return Err(claim.timeout());
            }
        }
    };
    observed(&target, run).await
}

/// The answer to one attempt.
enum Tried {
    Granted(Grant),
    Held(Option<Duration>),
}

/// One acquire call's claim, and the attempts made with it.
struct Attempts<'a> {
    target: &'a Target<'a>,
    pending: PendingClaim,
    began: Instant,
    /// The last attempt found too few quorum members, or too few replicas acknowledged its
    /// grant (a waiting acquire goes on; if its wait ends now, this is its error rather than
    /// a timeout).
    unavailable: Option<Error>,
}

impl<'a> Attempts<'a> {
    fn new(target: &'a Target<'a>) -> Self {
        let claim = Claim::new(target.key.clone(), Self::token(target), target.options.ttl)
            .kind(target.kind.clone());
        Attempts {
            target,
            pending: PendingClaim::new(target.manager.backend.clone(), claim),
            began: Instant::now(),
            unavailable: None,
        }
    }

    /// A fresh token for `target`'s claim, with its holder label.
    fn token(target: &Target<'_>) -> Token {
        let token = match target.kind {
            ClaimKind::Reentrant(_) => Token::hold(),
            ClaimKind::Read | ClaimKind::Permit(_) => Token::shared(),
            _ => Token::random(),
        };
        token.with_label(target.options.holder_label.clone())
    }

    /// Keeps `e` as the reason the wait goes on (the error if it runs out), and pauses,
    /// backing off from `pause` (doubled up to `max`: an outage may be long); `false` if the
    /// deadline came first.
    async fn wait_on(
        &mut self,
        e: Error,
        pause: &mut Duration,
        max: Duration,
        deadline: Option<Instant>,
    ) -> bool {
        if self.unavailable.is_none() {
            tracing::warn!(key = %self.target.key, error = %e, "waiting on");
        }
        self.unavailable = Some(e);
        let this = jitter(*pause, 0.5);
        *pause = pause.saturating_mul(2).min(max);
        runtime::until(deadline, runtime::sleep(this))
            .await
            .is_some()
    }

    /// The error of a wait that ran out.
    fn timeout(&mut self) -> Error {
        let waited = self.began.elapsed();
        self.unavailable.take().unwrap_or(Error::Timeout { waited })
    }

    /// Sends one attempt and waits for its answer until `limit`.
    async fn attempt(&mut self, attempt: Attempt, limit: Option<Instant>) -> Result<Tried> {
        // A release of this key dropped by this process a moment ago goes first: racing it
        // would find the lease still held, and wait for a wake-up. Only an ordering: if the
        // release takes long (a slow store, its runtime not polled), the attempt goes ahead
        // after a while.
        let released = Releasing::wait(&self.target.manager.backend, self.target.key);
        let cap = Instant::now() + RELEASE_WAIT;
        if runtime::until(Some(limit.map_or(cap, |l| l.min(cap))), released)
            .await
            .is_none()
            && limit.is_some_and(|l| Instant::now() >= l)
        {
            return Err(self.timeout());
        }
        // From here until a definite answer, the claim may hold the lease (or a place in a
        // queue): until a guard takes it over, giving up (an error, the deadline, a dropped
        // future) abandons it in the background.
        self.pending.armed = true;
        let backend = &*self.target.manager.backend;
        let sent_at = Instant::now();
        let sent = backend.acquire(&self.pending.claim, attempt, NodeTerms::new());
        let outcome = match runtime::until(limit, sent).await {
            None => return Err(self.timeout()),
            Some(Ok(outcome)) => outcome,
            Some(Err(e)) => {
                // Refused before anything was sent (bad input, or a store that cannot serve
                // it or will not now, as a server that may evict keys): nothing to give
                // back. Any other error leaves the outcome unknown, and the claim armed.
                if matches!(e, Error::InvalidConfig(_) | Error::Unsupported(_)) {
                    self.pending.armed = false;
                }
                return Err(e);
            }
        };
        Ok(match outcome {
            Acquire::Granted(grant) if sent_at.elapsed() >= grant.validity => {
                // Granted, but the answer came back after the lease's validity (the store or
                // this process paused in between): a guard would be lost from the start.
                // Given back now; the caller tries again, or is told it did not get it.
                let lease = Release::Confirmed {
                    lease: &grant.lease,
                };
                backend.release(&self.pending.claim, lease).await?;
                self.pending.armed = false;
                // A released token may stay refused on the store, so that a re-sent release
                // is answered "released" again (a shared hold's on Redis; every kind's on
                // etcd, whose tombstone bars the token): the next attempt goes with a fresh
                // one, whatever the kind.
                self.pending.claim.token = Self::token(self.target);
                tracing::warn!(key = %self.target.key, late = ?sent_at.elapsed(), "a grant came back after its validity; given back");
                Tried::Held(Some(Duration::ZERO))
            }
            Acquire::Granted(grant) => Tried::Granted(grant),
            Acquire::Held { remaining } => {
                crate::telemetry::contended();
                // Turned away: it holds nothing, unless it stands in a queue or holds new
                // reads back (a plain waiter): giving up withdraws that.
                self.pending.armed = attempt.recheck().is_some()
                    && (self.target.kind.queues() || *self.target.kind == ClaimKind::Plain);
                Tried::Held(remaining)
            }
            // A server in its restart quarantine (a quorum member, or one server with
            // `RedisOptions::restart_quarantine`), or a store passing that on: come back when
            // it counts.
            Acquire::Warming { remaining } => {
                self.pending.armed = false;
                Tried::Held(Some(remaining))
            }
        })
    }

    /// The guard of a granted attempt sent at `sent`.
    fn into_guard(mut self, grant: Grant, sent: Instant) -> LockGuard {
        let t = self.target;
        let opts = t.options;
        let kept = t.manager.watchdog.keep(ToKeep {
            key: t.key.clone(),
            token: grant.lease.clone(),
            ttl: opts.ttl,
            interval: opts.watchdog.then(|| opts.effective_watchdog_interval()),
            cap: opts.max_hold.and_then(|cap| sent.checked_add(cap)),
            sent,
            validity: grant.validity,
            shared: grant.hold_count.is_some(),
            fence: grant.fencing_token,
        });
        // One reign, one token: a re-entry reports its reign's.
        let fence = kept.reign_fence().unwrap_or(grant.fencing_token);
        tracing::debug!(key = %t.key, fencing_token = fence, waited = ?self.began.elapsed(), "acquired");
        self.pending.granted(grant.lease);
        self.pending.armed = true;
        LockGuard::new(
            t.name.clone(),
            fence,
            (grant.hold_count, grant.replicas),
            kept,
            self.pending,
            sent,
        )
    }
}

/// Runs an acquire in a `redlease.acquire` span that records the outcome and the wait, and
/// counts it in the metrics.
async fn observed<G: Held>(target: &Target<'_>, run: impl Future<Output = Result<G>>) -> Result<G> {
    use tracing::field::Empty;
    use tracing::Instrument;
    let span = tracing::debug_span!(
        "redlease.acquire",
        key = %target.key,
        kind = kind_name(target.kind),
        outcome = Empty,
        waited_ms = Empty,
        fencing_token = Empty,
    );
    let began = Instant::now();
    let result = run.instrument(span.clone()).await;
    let waited = began.elapsed();
    let outcome = match &result {
        Ok(held) => match held.guard() {
            Some(guard) => {
                span.record("fencing_token", guard.fencing_token());
                "acquired"
            }
            None => "busy",
        },
        Err(Error::Timeout { .. }) => "timeout",
        Err(_) => "error",
    };
    span.record("outcome", outcome);
    span.record(
        "waited_ms",
        u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
    );
    crate::telemetry::acquire(outcome, waited);
    result
}

/// The kind, for spans (a reentrant owner's name can be a credential: never logged).
fn kind_name(kind: &ClaimKind) -> &'static str {
    match kind {
        ClaimKind::Plain => "plain",
        ClaimKind::Fair => "fair",
        ClaimKind::Reentrant(_) => "reentrant",
        ClaimKind::Read => "read",
        ClaimKind::Permit(_) => "permit",
    }
}

/// What an acquire returns: a guard, or (a single attempt) perhaps none.
trait Held {
    fn guard(&self) -> Option<&LockGuard>;
}

impl Held for LockGuard {
    fn guard(&self) -> Option<&LockGuard> {
        Some(self)
    }
}

impl Held for Option<LockGuard> {
    fn guard(&self) -> Option<&LockGuard> {
        self.as_ref()
    }
}

/// The fallback re-checks of one lock's waiters in this process, shared: one waiter at a time
/// (the re-checker) re-checks now and then; the others wait for a wake-up from the store. So
/// 10,000 idle waiters on one lock cost the store what one does. A re-checker that leaves
/// (granted, timed out, dropped) hands the turn to another waiter.
///
/// Waiters share a re-checker only with waiters that the same state of the lock lets in
/// ([`Class`]): a reader held back by a waiting writer, or a permit waiter counting fewer
/// permits, must not be the one that re-checks for a writer or for a larger count.
struct Rechecks {
    at: (usize, LeaseKey, Class),
    /// Taken (under the registry's lock) when this waiter leaves.
    shared: Option<Arc<Recheck>>,
    mine: bool,
}

#[derive(Default)]
struct Recheck {
    /// A waiter re-checks for the others.
    taken: AtomicBool,
    /// Notified when the re-checker leaves.
    handover: Event,
}

type RecheckKeys = HashMap<(usize, LeaseKey, Class), Arc<Recheck>>;

/// Which waiters of one lock a free state lets in alike: exclusive claims (reentrant: the
/// lock free), plain ones (the same, but their attempts also keep their writer preference
/// alive, which a reentrant re-checker's do not), reads, and permits by their count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Class {
    Exclusive,
    Write,
    Read,
    Permits(u32),
}

impl Class {
    fn of(kind: &ClaimKind) -> Class {
        match kind {
            ClaimKind::Plain => Class::Write,
            ClaimKind::Read => Class::Read,
            ClaimKind::Permit(n) => Class::Permits(*n),
            _ => Class::Exclusive,
        }
    }
}

static RECHECKS: LazyLock<Mutex<RecheckKeys>> = LazyLock::new(Mutex::default);

fn rechecks() -> MutexGuard<'static, RecheckKeys> {
    RECHECKS.lock().unwrap_or_else(|p| p.into_inner())
}

impl Rechecks {
    fn join(target: &Target<'_>) -> Self {
        let at = (
            store_id(&target.manager.backend),
            target.key.clone(),
            Class::of(target.kind),
        );
        let shared = rechecks().entry(at.clone()).or_default().clone();
        Rechecks {
            at,
            shared: Some(shared),
            mine: false,
        }
    }

    /// `None` if this waiter re-checks (the turn was free, or is its own already); else
    /// what tells it that the re-checker has left.
    fn unless_mine(&mut self) -> Option<EventListener> {
        let shared = self.shared.as_ref()?;
        if self.mine {
            return None;
        }
        // Listening first: a re-checker leaving after the look below notifies this listener.
        let handover = shared.handover.listen();
        if shared.taken.swap(true, Ordering::AcqRel) {
            Some(handover)
        } else {
            self.mine = true;
            None
        }
    }
}

impl Drop for Rechecks {
    fn drop(&mut self) {
        let mut keys = rechecks();
        let Some(shared) = self.shared.take() else {
            return;
        };
        if self.mine {
            shared.taken.store(false, Ordering::Release);
        }
        // The turn is free: wake a waiter to take it. Also when this waiter was not the
        // re-checker: it may have been woken by the last handover and be leaving with it
        // (granted, failed, cancelled) before it took the turn.
        if !shared.taken.load(Ordering::Acquire) {
            shared.handover.notify(1);
        }
        drop(shared);
        // Only the map's reference is left: the last waiter of this lock here has gone.
        if keys
            .get(&self.at)
            .is_some_and(|r| Arc::strong_count(r) == 1)
        {
            keys.remove(&self.at);
        }
    }
}

/// The waits between a waiting acquire's attempts: until a wake-up (a release or hand-off)
/// or a pause, whichever comes first. With wake-ups the pause is a fallback re-check at
/// most every `max_delay` (a plain claim's at most every [`WRITER_RECHECK`]); without
/// (polling) it grows from `min_delay` to `max_delay`. Either way it is jittered, and no
/// longer than what the store said is left of the holder's lease (or of what else turned the
/// attempt away: a writer's preference, for a read).
struct Pauses {
    notify: bool,
    next: Duration,
    max: Duration,
}

impl Pauses {
    /// `max`: the longest pause (`max_delay`, or less).
    fn new(retry: &RetryPolicy, notify: bool, max: Duration) -> Self {
        Pauses {
            notify,
            next: retry.min_delay.min(max),
            max,
        }
    }

    /// Waits for `woken` or the next pause (at most `remaining` + 1 ms), or, instead of the
    /// pause, for `handover` (another waiter re-checks); `false` if `deadline` came first.
    async fn wait(
        &mut self,
        woken: Option<WakeUp>,
        remaining: Option<Duration>,
        handover: Option<EventListener>,
        deadline: Option<Instant>,
    ) -> bool {
        if let Some(handover) = handover {
            let woken = woken.map_or_else(|| future::pending().left_future(), |w| w.right_future());
            return runtime::until(deadline, future::select(woken, handover))
                .await
                .is_some();
        }
        let mut pause = if self.notify {
            jitter(self.max, 0.8)
        } else {
            let p = jitter(self.next, 0.5);
            self.next = self.next.saturating_mul(2).min(self.max);
            p
        };
        if let Some(r) = remaining {
            pause = pause.min(r + Duration::from_millis(1));
        }
        let sleep = std::pin::pin!(runtime::sleep(pause));
        match woken {
            Some(w) => runtime::until(deadline, future::select(w, sleep))
                .await
                .is_some(),
            None => runtime::until(deadline, sleep).await.is_some(),
        }
    }
}

/// `d` scaled by a random factor in `[low, 1]`, so waiters do not retry in lockstep.
fn jitter(d: Duration, low: f64) -> Duration {
    d.mul_f64(rand::random_range(low..=1.0))
}
