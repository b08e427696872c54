//! `Subscription`: a registration for wake-ups of one claim, and the future it hands out.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use event_listener::{Event, EventListener};

/// A registration for wake-ups of one claim (a release of its key, or for a fair claim a
/// hand-off to it), returned by [`Backend::subscribe`](crate::backend::Backend::subscribe).
/// Dropping it unsubscribes.
///
/// ```
/// use std::sync::Arc;
/// use redlease::event_listener::Event;
/// # futures::executor::block_on(async {
/// let event = Arc::new(Event::new());
/// let sub = redlease::backend::Subscription::new(event.clone());
/// let woken = sub.listen();
/// event.notify(usize::MAX);
/// woken.await;
/// # });
/// ```
pub struct Subscription {
    events: Vec<Arc<Event>>,
    guards: Vec<Box<dyn Send + Sync>>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("sources", &self.events.len())
            .finish()
    }
}

impl Subscription {
    /// A subscription woken by `event`.
    pub fn new(event: Arc<Event>) -> Self {
        Subscription {
            events: vec![event],
            guards: Vec::new(),
        }
    }

    /// Keeps `guard` alive as long as the subscription (its `Drop` can unsubscribe).
    pub fn with_guard(mut self, guard: impl Send + Sync + 'static) -> Self {
        self.guards.push(Box::new(guard));
        self
    }

    /// One subscription woken by any of `subs` (for backends composed of several stores).
    pub fn merge(subs: impl IntoIterator<Item = Subscription>) -> Self {
        let mut merged = Subscription {
            events: Vec::new(),
            guards: Vec::new(),
        };
        for s in subs {
            merged.events.extend(s.events);
            merged.guards.extend(s.guards);
        }
        merged
    }

    /// A future that resolves at the next wake-up after this call. Arm it *before* checking
    /// the lock, so a release in between is not missed.
    pub fn listen(&self) -> WakeUp {
        WakeUp {
            listeners: self.events.iter().map(|e| e.listen()).collect(),
        }
    }
}

/// Resolves at the next wake-up of a [`Subscription`]; see [`Subscription::listen`].
#[must_use = "futures do nothing unless awaited"]
pub struct WakeUp {
    listeners: Vec<EventListener>,
}

impl fmt::Debug for WakeUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeUp").finish_non_exhaustive()
    }
}

impl Future for WakeUp {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        for l in self.listeners.iter_mut() {
            if Pin::new(l).poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}
