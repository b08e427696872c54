//! `Subscription`: a registration for wake-ups of one claim, and the future it hands out.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use event_listener::{Event, EventListener};

/// A registration for wake-ups of one claim (a release of its key, or for a fair claim a
/// hand-off to it), returned by [`Backend::subscribe`](crate::backend::Backend::subscribe).
/// Dropping it unsubscribes.
///
/// ```
/// use std::sync::{Arc, Mutex};
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
    /// Subscriptions the store may replace while this one lives (a cluster's, when the key's
    /// slot moves to another node), listened to as they are at each [`listen`](Self::listen).
    routed: Vec<Arc<Mutex<Subscription>>>,
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
            routed: Vec::new(),
        }
    }

    /// A subscription woken by `moved`, and by whatever `current` holds at each
    /// [`listen`](Self::listen): the store swaps `current` for a subscription on the node
    /// that serves the key now, then notifies `moved`, so that a waiter looks again (and
    /// listens to the new one).
    pub(crate) fn routed(current: Arc<Mutex<Subscription>>, moved: Arc<Event>) -> Self {
        Subscription {
            events: vec![moved],
            guards: Vec::new(),
            routed: vec![current],
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
            routed: Vec::new(),
        };
        for s in subs {
            merged.events.extend(s.events);
            merged.guards.extend(s.guards);
            merged.routed.extend(s.routed);
        }
        merged
    }

    /// A future that resolves at the next wake-up after this call. Arm it *before* checking
    /// the lock, so a release in between is not missed.
    pub fn listen(&self) -> WakeUp {
        let mut listeners: Vec<EventListener> = self.events.iter().map(|e| e.listen()).collect();
        for routed in &self.routed {
            let current = routed.lock().unwrap_or_else(|p| p.into_inner());
            listeners.extend(current.listen().listeners);
        }
        WakeUp { listeners }
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
