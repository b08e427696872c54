//! `LockGuard`: a held claim of any kind, given back when dropped; and [`PendingClaim`],
//! the one clean-up behind drop release, cancelled acquires and cancelled releases.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use event_listener::Event;
use futures::future::{self, BoxFuture};
use tracing::Instrument;

use crate::backend::{Backend, Claim, ClaimKind, Extended, NodeTerms, Release};
use crate::error::{Error, Result};
use crate::options::{check_ttl, MIN_TTL};
use crate::runtime::Rt;
use crate::token::{LeaseKey, Owner, Token};
use crate::watchdog::Kept;

/// A claim that is given back in the background when dropped while armed: released if its
/// lease token is known (a guard's), abandoned if not (an attempt whose outcome is unknown,
/// or a fair waiter standing in the queue).
pub(crate) struct PendingClaim {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) claim: Claim,
    /// Granted: the lease token is known (the claim's own, or `reign`).
    confirmed: bool,
    /// The lease token when it is not the claim's own (a reentrant re-entry's reign).
    /// Boxed: rare, and a held lease is kept small.
    reign: Option<Box<Token>>,
    pub(crate) rt: Rt,
    pub(crate) armed: bool,
}

impl PendingClaim {
    pub(crate) fn new(backend: Arc<dyn Backend>, claim: Claim) -> Self {
        PendingClaim {
            backend,
            claim,
            confirmed: false,
            reign: None,
            rt: Rt::current(),
            armed: false,
        }
    }

    /// The claim was granted the lease `lease`.
    pub(crate) fn granted(&mut self, lease: Token) {
        self.confirmed = true;
        self.reign = (lease != self.claim.token).then(|| Box::new(lease));
    }

    /// The lease token, once granted.
    fn lease(&self) -> Option<&Token> {
        self.confirmed
            .then(|| self.reign.as_deref().unwrap_or(&self.claim.token))
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let lease = self.lease().cloned();
        let (backend, claim) = (self.backend.clone(), self.claim.clone());
        // Registered now, before the task runs: an acquire of this key that follows the drop
        // waits for this release instead of racing it.
        let releasing = Releasing::start(&backend, &claim.key);
        self.rt.spawn(async move {
            let confirmed = lease.is_some();
            let how = match &lease {
                Some(lease) => Release::Confirmed { lease },
                None => Release::Abandon,
            };
            let key = &claim.key;
            let mut release = std::pin::pin!((*backend).release(&claim, how));
            // The first poll hands the release to the store's connection (the crate's stores
            // do): an acquire of this key sent after that follows it there, in order, so it
            // need not wait for the answer. (A store that sends later is only raced: the
            // acquire then finds the lease held and waits for its release.)
            let first = futures::poll!(release.as_mut());
            drop(releasing);
            let outcome = match first {
                Poll::Ready(outcome) => outcome,
                Poll::Pending => release.await,
            };
            match outcome {
                Ok(left) => {
                    if confirmed {
                        crate::telemetry::release(if left.is_some() { "released" } else { "not_held" });
                    }
                    tracing::debug!(%key, ?left, "background release");
                }
                Err(e) => {
                    if confirmed {
                        crate::telemetry::release("error");
                    }
                    tracing::warn!(%key, error = %e, "background release failed; the TTL will free the lock");
                }
            }
        });
    }
}

/// Background releases (and abandons) not yet handed to the store, per store and key, in this
/// process. An acquire of the same key on the same store waits for them before its attempt
/// ([`Releasing::wait`]): `drop(guard); lock.acquire()` is then sent after the release, on the
/// same connection, with no attempt wasted on the lease being released, no subscription and
/// no wake-up.
pub(crate) struct Releasing {
    /// The store's address and the key.
    at: (usize, LeaseKey),
}

/// Releases in flight per store and key, and the event set when the last one ends.
type InFlightKeys = HashMap<(usize, LeaseKey), (usize, Arc<Event>)>;

struct InFlight {
    /// Entries in `keys`: an acquire skips the lock while there are none.
    count: AtomicUsize,
    keys: Mutex<InFlightKeys>,
}

static IN_FLIGHT: LazyLock<InFlight> = LazyLock::new(|| InFlight {
    count: AtomicUsize::new(0),
    keys: Mutex::new(HashMap::new()),
});

fn in_flight() -> MutexGuard<'static, InFlightKeys> {
    IN_FLIGHT.keys.lock().unwrap_or_else(|p| p.into_inner())
}

/// One store's identity: the address of what its `Arc` points to.
pub(crate) fn store_id(backend: &Arc<dyn Backend>) -> usize {
    Arc::as_ptr(backend).cast::<()>() as usize
}

impl Releasing {
    /// Counts a release of `key` on `backend` in flight until the value is dropped.
    fn start(backend: &Arc<dyn Backend>, key: &LeaseKey) -> Self {
        let at = (store_id(backend), key.clone());
        let mut keys = in_flight();
        let entry = keys.entry(at.clone()).or_insert_with(|| {
            IN_FLIGHT.count.fetch_add(1, Ordering::AcqRel);
            (0, Arc::new(Event::new()))
        });
        entry.0 += 1;
        Releasing { at }
    }

    /// Waits until no release of `key` on `backend` is in flight.
    pub(crate) async fn wait(backend: &Arc<dyn Backend>, key: &LeaseKey) {
        if IN_FLIGHT.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let at = (store_id(backend), key.clone());
        // Listening under the lock: the last release's end notifies after this.
        let listener = match in_flight().get(&at) {
            Some((_, ended)) => ended.listen(),
            None => return,
        };
        listener.await;
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        let mut keys = in_flight();
        if let Some(entry) = keys.get_mut(&self.at) {
            entry.0 -= 1;
            if entry.0 == 0 {
                if let Some((_, ended)) = keys.remove(&self.at) {
                    IN_FLIGHT.count.fetch_sub(1, Ordering::AcqRel);
                    ended.notify(usize::MAX);
                }
            }
        }
    }
}

/// A held lock, of any kind (plain, fair, a reentrant hold). Dropping it gives the claim back
/// in the background (never blocking, never panicking; with no runtime left to run the
/// release, the TTL frees the lock).
///
/// While the guard lives, the manager's watchdog extends the lease (one registration per
/// lease, however many reentrant holds share it). If the lease can no longer be guaranteed
/// (an extension was refused, or its deadline passed without a confirmed extension, e.g.
/// because Redis was unreachable), the guard is *lost*: [`is_lost`](Self::is_lost) turns true
/// and [`lost`](Self::lost) resolves, for every guard of that lease in this manager. Stop
/// touching the protected resource then, and pass [`fencing_token`](Self::fencing_token)
/// with every write so the resource itself can refuse a stale holder.
///
/// The guard is `Send + 'static`: move it into a spawned task freely.
///
/// ```
/// use redlease::{LockManager, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let guard = locks.lock("orders:42").acquire().await?;
/// let token = guard.fencing_token();          // send it with every write
/// assert!(!guard.is_lost());
/// guard.release().await?;                      // or just drop it
/// # let _ = token;
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[must_use = "if unused the lock is released at once"]
pub struct LockGuard {
    /// Boxed: a guard is moved around by its holder, and kept small.
    held: Option<Box<Held>>,
}

struct Held {
    /// The lock's name, unless the key holds it as it is (most names: a held lease is kept
    /// small, and a lock made per acquire would hold its name twice).
    name: Option<Arc<str>>,
    fence: u64,
    /// The hold count and the replicas that acknowledged the grant (see `ReplicaAck`), each
    /// `NONE` when not known (a held lease is kept small).
    counts: [u32; 2],
    kept: Arc<Kept>,
    /// Set when this guard ends, so its `lost()` resolves then; made by the first `lost()`.
    done: OnceLock<Arc<Done>>,
    release: PendingClaim,
    /// When the winning attempt was sent, for the hold-time metric.
    since: u64,
}

/// A count that is not known, in `Held::counts`.
const NONE: u32 = u32::MAX;

fn known(n: u32) -> Option<u32> {
    (n != NONE).then_some(n)
}

impl Drop for Held {
    fn drop(&mut self) {
        crate::telemetry::held(
            (crate::watchdog::epoch() + Duration::from_nanos(self.since)).elapsed(),
        );
        if let Some(done) = self.done.get() {
            done.set();
        }
    }
}

/// Set when a guard is released, forgotten or dropped.
#[derive(Default)]
struct Done {
    flag: AtomicBool,
    event: Event,
}

impl Done {
    fn set(&self) {
        if !self.flag.swap(true, Ordering::AcqRel) {
            self.event.notify(usize::MAX);
        }
    }

    async fn wait(self: Arc<Self>) {
        loop {
            let listener = self.event.listen();
            if self.flag.load(Ordering::Acquire) {
                return;
            }
            listener.await;
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockGuard");
        if let Some(h) = &self.held {
            d.field("name", &self.name())
                .field("kind", &h.release.claim.kind)
                .field("fencing_token", &h.fence)
                .field("lost", &h.kept.state.check_lost());
            if let Some(n) = self.hold_count() {
                d.field("hold_count", &n);
            }
        }
        d.finish()
    }
}

impl LockGuard {
    /// The guard of a granted claim: `release` holds the claim (armed, its lease known),
    /// `kept` the lease's state and watchdog registration.
    pub(crate) fn new(
        name: Arc<str>,
        fence: u64,
        (hold_count, replicas): (Option<u32>, Option<u32>),
        kept: Arc<Kept>,
        release: PendingClaim,
        sent: Instant,
    ) -> Self {
        let name = (release.claim.key.plain_name() != Some(&*name)).then_some(name);
        LockGuard {
            held: Some(Box::new(Held {
                name,
                fence,
                counts: [hold_count.unwrap_or(NONE), replicas.unwrap_or(NONE)],
                kept,
                done: OnceLock::new(),
                release,
                since: crate::watchdog::to_nanos(sent),
            })),
        }
    }

    fn held(&self) -> &Held {
        // Only `release` and `forget` take `held`, and they consume the guard.
        self.held
            .as_ref()
            .expect("a live guard always holds its lease")
    }

    /// The claim's token, for writes fenced by this lease (the stampede cache's fill).
    pub(crate) fn token(&self) -> &Token {
        &self.held().release.claim.token
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        let held = self.held();
        match &held.name {
            Some(name) => name,
            None => held.release.claim.key.plain_name().unwrap_or_default(),
        }
    }

    /// The owner of a reentrant hold; `None` for other kinds.
    pub fn owner(&self) -> Option<&Owner> {
        match &self.held().release.claim.kind {
            ClaimKind::Reentrant(owner) => Some(owner),
            _ => None,
        }
    }

    /// For a reentrant hold, the owner's hold count when this hold was counted, this hold
    /// included (1 for the hold that started the reign); `None` for other kinds. Other holds
    /// of the owner, here or in other processes, may have come and gone since;
    /// [`release`](Self::release) returns the count left. Over [`Redlock`](crate::Redlock),
    /// the largest count among the nodes that answered.
    pub fn hold_count(&self) -> Option<u32> {
        known(self.held().counts[0])
    }

    /// How many replicas acknowledged this hold's grant before it was reported, under a
    /// [`ReplicaAck`](crate::ReplicaAck) policy of a [`RedisBackend`](crate::RedisBackend)
    /// (at least the policy's count); `None` when no policy applies (the default
    /// `ReplicaAck::Off`, other stores, and over [`Redlock`](crate::Redlock)).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let locks = redlease::LockManager::new(redlease::MemoryBackend::new());
    /// let guard = locks.lock("job").acquire().await?;
    /// assert_eq!(guard.replicas_acked(), None); // no replicas in process memory
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn replicas_acked(&self) -> Option<u32> {
        known(self.held().counts[1])
    }

    /// The fencing token of this hold: strictly greater than the token of every earlier hold
    /// of this lock name (the holds of one reentrant reign share one). Send it with each write
    /// to the protected resource, and have the resource refuse a token lower than the highest
    /// it has seen: that is what keeps a holder that was paused past its lease from
    /// overwriting the next holder's work.
    pub fn fencing_token(&self) -> u64 {
        self.held().fence
    }

    /// Whether the lease can no longer be guaranteed. Once true, stays true.
    pub fn is_lost(&self) -> bool {
        self.held().kept.state.check_lost()
    }

    /// The monotonic instant until which the lease is guaranteed, as last confirmed.
    pub fn valid_until(&self) -> Instant {
        self.held().kept.state.deadline()
    }

    /// A future that resolves when the lease is lost (at once if it is already: on a refused
    /// extension, or when the deadline passes without a confirmed extension), or when this
    /// guard is released, forgotten or dropped. It is `'static`, so it can race the critical
    /// section:
    ///
    /// ```
    /// use redlease::{LockManager, MemoryBackend};
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::new(MemoryBackend::new());
    /// let guard = locks.lock("job").acquire().await?;
    /// let work = async { 42 };
    /// futures::pin_mut!(work);
    /// let lost = guard.lost();
    /// match futures::future::select(work, lost).await {
    ///     futures::future::Either::Left((n, _)) => assert_eq!(n, 42),
    ///     futures::future::Either::Right(_) => panic!("lease lost: stop and do not commit"),
    /// }
    /// # Ok::<(), redlease::Error>(()) }).unwrap();
    /// ```
    pub fn lost(&self) -> Lost {
        let h = self.held();
        let lost = h.kept.state.clone().lost();
        let done = h.done.get_or_init(Arc::default).clone().wait();
        Lost {
            inner: Box::pin(async move {
                future::select(Box::pin(lost), Box::pin(done)).await;
            }),
        }
    }

    /// Extends the lease to `ttl` from now (and the watchdog keeps using `ttl`). For a
    /// reentrant hold, this extends the reign's lease, which every hold of it shares. With a
    /// [`max_hold`](crate::LockOptions::max_hold), the extension is cut short to end at the
    /// cap.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the lease is lost or the store no longer holds it (the guard is
    /// then lost), or if less than [`MIN_TTL`](crate::MIN_TTL) is left before the maximum
    /// hold; [`Error::InvalidConfig`] for a ttl outside [`MIN_TTL`](crate::MIN_TTL) ..=
    /// [`MAX_TTL`](crate::MAX_TTL); [`Error::Backend`] if the store failed (the lease is not
    /// lost by that alone).
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        let h = self.held();
        if h.kept.state.check_lost() {
            return Err(Error::NotHeld);
        }
        let claim = &h.release.claim;
        let lease = h.release.lease().unwrap_or(&claim.token);
        let started = Instant::now();
        let mut one = claim.lease(lease);
        one.ttl = match h.kept.cap() {
            // Never past the maximum hold (a reentrant reign's lease is never shortened by
            // the store, so the watchdog could not bring it back).
            Some(cap) => {
                let left = cap.saturating_duration_since(started);
                if left < MIN_TTL {
                    return Err(Error::NotHeld);
                }
                ttl.min(left)
            }
            None => ttl,
        };
        let span = tracing::debug_span!("redlease.extend", key = %claim.key, ?ttl);
        let sent_ttl = one.ttl;
        let reply = (*h.release.backend)
            .extend(&[one], NodeTerms::new())
            .instrument(span)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                h.kept.state.unconfirmed(started, sent_ttl);
                return Err(e);
            }
        };
        match reply.into_iter().next() {
            Some(Extended::Held(validity)) if h.kept.state.confirm(started, validity) => {
                h.kept.set_ttl(ttl);
                Ok(())
            }
            // This lease's command failed: not lost by that alone (but a shorter TTL it may
            // have set counts).
            Some(Extended::Failed(e)) => {
                h.kept.state.unconfirmed(started, sent_ttl);
                Err(e)
            }
            _ => {
                // Counted as lost by the watchdog, which drops the lease at its next look.
                tracing::warn!(key = %claim.key, "lease lost: extension refused");
                h.kept.state.mark_lost();
                Err(Error::NotHeld)
            }
        }
    }

    /// Releases the lock now. Returns how many holds are left on the lease: 0 when the lock
    /// is free (always, but for a reentrant hold whose owner has other holds).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the lease was lost before (even if the key was deleted now) or
    /// was no longer the claim's in the store; [`Error::Backend`] if the store failed: the
    /// release is then tried again in the background (it is idempotent), and the TTL frees
    /// the lock if that fails too.
    ///
    /// # Cancel safety
    ///
    /// If this future is dropped before it completes, the release still happens in the
    /// background.
    pub async fn release(mut self) -> Result<u32> {
        let Some(mut held) = self.held.take() else {
            return Err(Error::NotHeld);
        };
        let was_lost = held.kept.state.check_lost();
        let r = &held.release;
        let span = tracing::debug_span!(
            "redlease.release",
            key = %r.claim.key,
            outcome = tracing::field::Empty
        );
        let lease = r.lease().unwrap_or(&r.claim.token);
        let released = (*r.backend)
            .release(&r.claim, Release::Confirmed { lease })
            .instrument(span.clone())
            .await;
        // On an error the outcome is unknown: the claim stays armed, so dropping `held`
        // below tries the release again in the background instead of leaking the hold.
        held.release.armed = released.is_err();
        let outcome = match released {
            Ok(Some(left)) if !was_lost => Ok(left),
            Ok(_) => Err(Error::NotHeld),
            Err(e) => Err(e),
        };
        let name = match &outcome {
            Ok(_) => "released",
            Err(Error::NotHeld) => "not_held",
            Err(_) => "error",
        };
        span.record("outcome", name);
        crate::telemetry::release(name);
        outcome
    }

    /// Gives the lock up without releasing it: the watchdog stops (for a reentrant hold, once
    /// no other guard of its reign lives here), and the key expires by its TTL. Returns the
    /// fencing token.
    pub fn forget(mut self) -> u64 {
        match self.held.take() {
            Some(mut held) => {
                held.release.armed = false;
                held.fence
            }
            None => 0,
        }
    }
}

/// Resolves when a [`LockGuard`]'s lease is lost or the guard is gone; see
/// [`LockGuard::lost`].
#[must_use = "futures do nothing unless awaited"]
pub struct Lost {
    inner: BoxFuture<'static, ()>,
}

impl Lost {
    /// Resolves when any of `all` does (at once for none).
    pub(crate) fn any(all: Vec<Lost>) -> Lost {
        Lost {
            inner: Box::pin(async move {
                if !all.is_empty() {
                    future::select_all(all).await;
                }
            }),
        }
    }
}

impl fmt::Debug for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lost").finish_non_exhaustive()
    }
}

impl Future for Lost {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.inner.as_mut().poll(cx)
    }
}
