//! The few runtime services the crate needs (spawn, sleep, a tokio context for fred), for
//! whichever runtime features are on.
//!
//! Rule when several runtime features are enabled: the choice is made at run time, per call.
//! Inside a tokio runtime, tokio is used. Outside one, `smol` is used if enabled, else
//! `async-std`, else (only the `tokio` feature, called from no runtime at all) a private
//! one-thread tokio runtime. fred always runs in a tokio context: the ambient runtime, or the
//! private one through [`async_compat::Compat`].

use std::future::Future;
use std::time::{Duration, Instant};

use async_compat::Compat;
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
            Rt::Tokio(fallback_handle())
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
            Rt::Smol => smol::spawn(Compat::new(fut)).detach(),
            #[cfg(all(feature = "async-std", not(feature = "smol")))]
            Rt::AsyncStd => {
                drop(async_std::task::spawn(Compat::new(fut)));
            }
        }
    }
}

/// The private tokio runtime (async-compat's fallback, one thread), used when the caller runs
/// no tokio runtime.
#[cfg(not(any(feature = "smol", feature = "async-std")))]
fn fallback_handle() -> tokio::runtime::Handle {
    use futures::FutureExt;
    Compat::new(future::lazy(|_| tokio::runtime::Handle::current()))
        .now_or_never()
        .expect("a lazy future is ready on its first poll")
}

/// Polls a fred future in a tokio context (the ambient one, or the private fallback).
pub(crate) fn compat<F: Future>(fut: F) -> Compat<F> {
    Compat::new(fut)
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
        // Created inside the Compat context: tokio's timer needs the runtime at creation.
        Compat::new(async move { tokio::time::sleep(d).await }).await;
    }
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
