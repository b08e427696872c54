//! The few runtime services the crate needs (spawn, sleep, a tokio context for fred), for
//! whichever runtime features are on.
//!
//! Rule when several runtime features are enabled: the choice is made at run time, per call.
//! Inside a tokio runtime, tokio is used. Outside one, `smol` is used if enabled, else
//! `async-std`, else (only the `tokio` feature, called from no runtime at all) a private
//! one-thread tokio runtime. fred always runs in a tokio context: the ambient runtime, or the
//! private one (see [`InTokio`]). Background tasks shared by all users of a manager or
//! backend run on that private runtime ([`background`]).

use std::future::Future;
use std::time::{Duration, Instant};

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use futures::future::{self, Either};

#[cfg(not(any(feature = "tokio", feature = "async-std", feature = "smol")))]
compile_error!(
    "redlease needs a runtime: enable at least one of the features `tokio` (default), \
     `async-std` or `smol`"
);

/// Where background work (drop releases, the watchdog) is spawned: captured when a lease is
/// acquired, so a guard dropped on a thread with no runtime still releases.
#[derive(Clone, Debug)]
pub(crate) enum Rt {
    Tokio(tokio::runtime::Handle),
    #[cfg(feature = "smol")]
    Smol,
    // With smol also on, smol takes precedence and this variant is never built.
    #[cfg(all(feature = "async-std", not(feature = "smol")))]
    AsyncStd,
    /// Only tokio is enabled, the caller runs no runtime, and the private runtime could not
    /// be started: nothing can be spawned (a release is then left to the TTL).
    #[cfg(not(any(feature = "smol", feature = "async-std")))]
    Unavailable,
}

impl Rt {
    /// The runtime of the calling context, by the rule in the module docs.
    pub(crate) fn current() -> Rt {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            return Rt::Tokio(handle);
        }
        #[cfg(feature = "smol")]
        {
            Rt::Smol
        }
        #[cfg(all(feature = "async-std", not(feature = "smol")))]
        {
            Rt::AsyncStd
        }
        #[cfg(not(any(feature = "smol", feature = "async-std")))]
        {
            match private() {
                Some(handle) => Rt::Tokio(handle.clone()),
                None => Rt::Unavailable,
            }
        }
    }

    /// Spawns `fut` detached. Never blocks and never panics: on a tokio runtime that has shut
    /// down the task is dropped at once (a lease it would have released then runs out by TTL).
    pub(crate) fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        match self {
            Rt::Tokio(handle) => {
                drop(handle.spawn(fut));
            }
            #[cfg(feature = "smol")]
            Rt::Smol => smol::spawn(in_tokio(fut)).detach(),
            #[cfg(all(feature = "async-std", not(feature = "smol")))]
            Rt::AsyncStd => {
                drop(async_std::task::spawn(in_tokio(fut)));
            }
            #[cfg(not(any(feature = "smol", feature = "async-std")))]
            Rt::Unavailable => drop(fut),
        }
    }
}

impl Rt {
    /// Runs `fut` on this runtime and waits for its output (from any executor); `None` if
    /// the runtime dropped the task (it shut down).
    pub(crate) async fn run<F>(self, fut: F) -> Option<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let (tx, rx) = futures::channel::oneshot::channel();
        self.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.await.ok()
    }
}

/// The crate's own runtime, for the background tasks that serve every user of a manager or
/// backend (the watchdog, pub/sub bookkeeping): they must not stop when the runtime that
/// happened to start them goes idle or shuts down. One tokio thread, started on first use,
/// living as long as the process. Should the OS refuse the thread, the caller's runtime is
/// used instead.
pub(crate) fn background() -> Rt {
    match private() {
        Some(handle) => Rt::Tokio(handle.clone()),
        None => Rt::current(),
    }
}

/// The private runtime's handle, if it could be started.
fn private() -> Option<&'static tokio::runtime::Handle> {
    static PRIVATE: OnceLock<Option<tokio::runtime::Handle>> = OnceLock::new();
    PRIVATE
        .get_or_init(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            let handle = rt.handle().clone();
            // A current-thread runtime runs its tasks while some thread is in `block_on`.
            std::thread::Builder::new()
                .name("redlease-runtime".into())
                .spawn(move || rt.block_on(future::pending::<()>()))
                .ok()?;
            Some(handle)
        })
        .as_ref()
}

/// Enters a tokio context if the caller is in none: the private runtime's.
fn enter() -> Option<tokio::runtime::EnterGuard<'static>> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return None;
    }
    private().map(tokio::runtime::Handle::enter)
}

/// A future polled (and dropped) inside a tokio context: fred needs one, for its timers and
/// the tasks it spawns. The caller's tokio runtime if there is one, else the private one (the
/// idea of the async-compat crate, sharing this crate's one private runtime).
#[pin_project::pin_project(PinnedDrop)]
pub(crate) struct InTokio<F> {
    #[pin]
    inner: Option<F>,
}

impl<F: Future> Future for InTokio<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _context = enter();
        match self.project().inner.as_pin_mut() {
            Some(inner) => inner.poll(cx),
            None => Poll::Pending,
        }
    }
}

#[pin_project::pinned_drop]
impl<F> PinnedDrop for InTokio<F> {
    fn drop(self: Pin<&mut Self>) {
        let _context = enter();
        self.project().inner.set(None);
    }
}

/// Polls a fred future in a tokio context.
pub(crate) fn in_tokio<F: Future>(fut: F) -> InTokio<F> {
    InTokio { inner: Some(fut) }
}

/// Sleeps on the caller's runtime.
pub(crate) async fn sleep(d: Duration) {
    if tokio::runtime::Handle::try_current().is_ok() {
        return tokio::time::sleep(d).await;
    }
    #[cfg(feature = "smol")]
    {
        smol::Timer::after(d).await;
    }
    #[cfg(all(feature = "async-std", not(feature = "smol")))]
    {
        async_std::task::sleep(d).await;
    }
    #[cfg(not(any(feature = "smol", feature = "async-std")))]
    {
        // Created inside the context: tokio's timer needs the runtime at creation.
        in_tokio(async move { tokio::time::sleep(d).await }).await;
    }
}

/// Lets the other tasks of the executor run once before going on.
pub(crate) async fn yield_now() {
    let mut yielded = false;
    future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// Sleeps until `deadline` (returns at once if it has passed).
pub(crate) async fn sleep_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        sleep(deadline - now).await;
    }
}

/// Runs `fut` until `deadline`; `None` if the deadline came first (`fut` is dropped).
pub(crate) async fn until<F: Future>(deadline: Option<Instant>, fut: F) -> Option<F::Output> {
    let Some(deadline) = deadline else {
        return Some(fut.await);
    };
    let fut = std::pin::pin!(fut);
    let timer = std::pin::pin!(sleep_until(deadline));
    match future::select(fut, timer).await {
        Either::Left((out, _)) => Some(out),
        Either::Right(_) => None,
    }
}
