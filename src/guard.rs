//! `LockGuard`: a held lease, released when dropped.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tracing::Instrument;

use crate::backend::{Backend, Lease};
use crate::error::{Error, Result};
use crate::lock::{Lock, ManagerInner};
use crate::options::check_ttl;
use crate::runtime::Rt;
use crate::token::{LeaseKey, Token};
use crate::watchdog::LeaseState;

/// A compare-and-delete that runs in the background when dropped while armed: the one
/// mechanism behind drop release, cancelled acquires and cancelled releases.
pub(crate) struct ReleaseOnDrop {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) key: LeaseKey,
    pub(crate) token: Token,
    pub(crate) rt: Rt,
    pub(crate) armed: bool,
    /// The acquire was confirmed (a guard exists). Until then the attempt's outcome is
    /// unknown and the clean-up must [`abandon`](Backend::abandon) the token.
    pub(crate) confirmed: bool,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (backend, key, token) = (self.backend.clone(), self.key.clone(), self.token.clone());
        let confirmed = self.confirmed;
        self.rt.spawn(async move {
            let released = if confirmed {
                backend.release(&key, &token).await
            } else {
                backend.abandon(&key, &token).await
            };
            match released {
                Ok(released) => {
                    if confirmed {
                        crate::telemetry::release(if released { "released" } else { "not_held" });
                    }
                    tracing::debug!(%key, released, "background release");
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

/// A held lock. Dropping it releases the lease in the background (never blocking, never
/// panicking; with no runtime left to run the release, the TTL frees the lock).
///
/// While the guard lives, the manager's watchdog extends the lease. If the lease can no
/// longer be guaranteed (an extension was refused, or its deadline passed without a
/// confirmed extension, e.g. because Redis was unreachable), the guard is *lost*:
/// [`is_lost`](Self::is_lost) turns true and [`lost`](Self::lost) resolves. Stop touching the
/// protected resource then, and pass [`fencing_token`](Self::fencing_token) with every write
/// so the resource itself can refuse a stale holder.
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
    held: Option<Held>,
}

struct Held {
    manager: Arc<ManagerInner>,
    name: Arc<str>,
    fence: u64,
    state: Arc<LeaseState>,
    watch: Option<u64>,
    release: ReleaseOnDrop,
    /// When the winning attempt was sent, for the hold-time metric.
    since: Instant,
}

impl Drop for Held {
    fn drop(&mut self) {
        crate::telemetry::held(self.since.elapsed());
        if let Some(id) = self.watch.take() {
            self.manager.watchdog.unregister(id);
        }
        // Whoever awaits `lost()` learns that this hold is over.
        self.state.mark_lost();
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockGuard");
        if let Some(h) = &self.held {
            d.field("name", &h.name)
                .field("fencing_token", &h.fence)
                .field("lost", &h.state.check_lost());
        }
        d.finish()
    }
}

impl LockGuard {
    pub(crate) fn new(
        lock: &Lock,
        fence: u64,
        sent: Instant,
        validity: Duration,
        mut release: ReleaseOnDrop,
    ) -> Self {
        release.confirmed = true;
        let manager = lock.manager.clone();
        let name = lock.name.clone();
        let opts = &lock.options;
        let state = Arc::new(LeaseState::new(sent, sent + validity));
        let watch = opts.watchdog.then(|| {
            manager.watchdog.register(
                release.key.clone(),
                release.token.clone(),
                opts.ttl,
                opts.effective_watchdog_interval(),
                state.clone(),
            )
        });
        if let (Some(id), Some(cap)) = (watch, opts.max_hold) {
            manager.watchdog.cap(id, sent + cap);
        }
        LockGuard {
            held: Some(Held {
                manager,
                name,
                fence,
                state,
                watch,
                release,
                since: sent,
            }),
        }
    }

    fn held(&self) -> &Held {
        // Only `release`/`forget` take `held`, and they consume the guard.
        self.held
            .as_ref()
            .expect("a live guard always holds its lease")
    }

    /// The lease's token, for writes fenced by this lease (the stampede cache's fill).
    pub(crate) fn token(&self) -> &Token {
        &self.held().release.token
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.held().name
    }

    /// The fencing token of this hold: strictly greater than the token of every earlier hold
    /// of this lock name. Send it with each write to the protected resource, and have the
    /// resource refuse a token lower than the highest it has seen: that is what keeps a
    /// holder that was paused past its lease from overwriting the next holder's work.
    pub fn fencing_token(&self) -> u64 {
        self.held().fence
    }

    /// Whether the lease can no longer be guaranteed. Once true, stays true.
    pub fn is_lost(&self) -> bool {
        self.held().state.check_lost()
    }

    /// The monotonic instant until which the lease is guaranteed, as last confirmed.
    pub fn valid_until(&self) -> Instant {
        self.held().state.deadline()
    }

    /// A future that resolves when the lease is lost: at once if it is already, otherwise
    /// on a refused extension or when the deadline passes without a confirmed extension.
    /// It is `'static`, so it can race the critical section:
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
        Lost {
            inner: Box::pin(self.held().state.clone().lost()),
        }
    }

    /// Extends the lease to `ttl` from now (and the watchdog keeps using `ttl`).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the lease is lost or the store no longer holds it (the guard is
    /// then lost); [`Error::InvalidConfig`] for a ttl outside [`MIN_TTL`](crate::MIN_TTL) ..=
    /// [`MAX_TTL`](crate::MAX_TTL); [`Error::Backend`] if
    /// the store failed (the lease is not lost by that alone).
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        check_ttl(ttl)?;
        let h = self.held();
        if h.state.check_lost() {
            return Err(Error::NotHeld);
        }
        let started = Instant::now();
        let lease = Lease {
            key: &h.release.key,
            token: &h.release.token,
            ttl,
        };
        let span = tracing::debug_span!("redlease.extend", key = %h.release.key, ?ttl);
        let reply = h.release.backend.extend(&[lease]).instrument(span).await?;
        match reply.first().copied().flatten() {
            Some(validity) if h.state.confirm(started, validity) => {
                if let Some(id) = h.watch {
                    h.manager.watchdog.set_ttl(id, ttl);
                }
                Ok(())
            }
            _ => {
                // Counted as lost by the watchdog, which drops the lease at its next look.
                tracing::warn!(key = %h.release.key, "lease lost: extension refused");
                h.state.mark_lost();
                Err(Error::NotHeld)
            }
        }
    }

    /// Releases the lease now.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] if the lease was lost before (even if the key was deleted now) or
    /// was no longer ours in the store; [`Error::Backend`] if the store failed (the TTL will
    /// free the lock).
    ///
    /// # Cancel safety
    ///
    /// If this future is dropped before it completes, the release still happens in the
    /// background.
    pub async fn release(mut self) -> Result<()> {
        let Some(mut held) = self.held.take() else {
            return Err(Error::NotHeld);
        };
        if let Some(id) = held.watch.take() {
            held.manager.watchdog.unregister(id);
        }
        let was_lost = held.state.check_lost();
        let span = tracing::debug_span!(
            "redlease.release",
            key = %held.release.key,
            outcome = tracing::field::Empty
        );
        let released = held
            .release
            .backend
            .release(&held.release.key, &held.release.token)
            .instrument(span.clone())
            .await;
        // Dropping `held` below marks the lease lost, so `lost()` resolves.
        held.release.armed = false;
        let outcome = match released {
            Ok(true) if !was_lost => Ok(()),
            Ok(_) => Err(Error::NotHeld),
            Err(e) => Err(e),
        };
        let name = match &outcome {
            Ok(()) => "released",
            Err(Error::NotHeld) => "not_held",
            Err(_) => "error",
        };
        span.record("outcome", name);
        crate::telemetry::release(name);
        outcome
    }

    /// Gives the lease up without releasing it: the watchdog stops, and the key expires by
    /// its TTL. Returns the fencing token.
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

/// Resolves when a [`LockGuard`]'s lease is lost; see [`LockGuard::lost`].
#[must_use = "futures do nothing unless awaited"]
pub struct Lost {
    inner: BoxFuture<'static, ()>,
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
