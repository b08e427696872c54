//! Wake-ups: one subscriber connection per backend, one SUBSCRIBE per channel with local
//! waiters, reference-counted; a message wakes one local waiter (a release), the waiter it
//! names (a fair hand-off), or all of them (a cache fill).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use event_listener::{Event, IntoNotification};
use fred::clients::SubscriberClient;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};

use crate::backend::Subscription;
use crate::error::{Error, Result};
use crate::runtime::{self, in_tokio};

/// The subscriber connection and its channels.
pub(super) struct PubSub {
    pub(super) client: SubscriberClient,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so they reach the server in the order of the count
    /// changes; `true` once the connection is up.
    ops: futures::lock::Mutex<bool>,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
}

struct Channel {
    event: Arc<Event>,
    subscribers: usize,
    /// A message wakes every local listener (cache fills), not just one (releases).
    broadcast: bool,
    /// Fair waiters on a hand-off channel, by token: a message wakes only the one it names.
    targets: HashMap<String, Arc<Event>>,
}

fn lock_map(m: &Mutex<HashMap<String, Channel>>) -> MutexGuard<'_, HashMap<String, Channel>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PubSub {
    pub(super) fn new(client: SubscriberClient) -> Self {
        PubSub {
            client,
            ops: futures::lock::Mutex::new(false),
            channels: Arc::default(),
        }
    }

    /// Connects the subscriber and installs its handlers on the crate's background runtime,
    /// so they keep running whichever runtime the waiters use.
    async fn start(&self) -> Result<()> {
        let client = self.client.clone();
        let channels = self.channels.clone();
        let started = runtime::background().run(async move {
            client.init().await?;
            let on_message = channels.clone();
            drop(client.on_message(move |msg| {
                // One release, one local waiter (the longest waiting): waking them all would
                // send every waiter's attempt to Redis for one lease.
                if let Some(c) = lock_map(&on_message).get(&*msg.channel) {
                    let target = msg.value.as_str().and_then(|t| c.targets.get(&*t).cloned());
                    match target {
                        // A hand-off: only the waiter it names acts on it.
                        Some(waiter) => waiter.notify(usize::MAX),
                        // A cache fill wakes every local listener; a release, one.
                        None if c.broadcast => c.event.notify(usize::MAX),
                        None => c.event.notify(1.additional()),
                    };
                }
                futures::future::ready(Ok(()))
            }));
            // Messages published while the connection was down are lost: wake every waiter
            // to re-check at once instead of at its fallback timer.
            drop(client.on_reconnect(move |_| {
                for c in lock_map(&channels).values() {
                    c.event.notify(usize::MAX);
                    for waiter in c.targets.values() {
                        waiter.notify(usize::MAX);
                    }
                }
                futures::future::ready(Ok(()))
            }));
            drop(client.manage_subscriptions());
            Ok::<_, fred::error::Error>(())
        });
        match started.await {
            Some(result) => result.map_err(Error::backend),
            None => Err(Error::backend("the background runtime is gone")),
        }
    }

    /// Subscribes to `channel`. `broadcast`: every message wakes every local listener (cache
    /// fills); otherwise one (releases). With a `target`, the subscription is woken only by
    /// messages that carry that token (fair hand-offs).
    pub(super) async fn subscribe(
        self: &Arc<Self>,
        channel: String,
        broadcast: bool,
        target: Option<String>,
    ) -> Result<Subscription> {
        let mut started = self.ops.lock().await;
        if !*started {
            self.start().await?;
            *started = true;
        }
        let (event, first) = {
            let mut map = lock_map(&self.channels);
            let c = map.entry(channel.clone()).or_insert_with(|| Channel {
                event: Arc::new(Event::new()),
                subscribers: 0,
                broadcast,
                targets: HashMap::new(),
            });
            c.subscribers += 1;
            let event = match &target {
                Some(token) => {
                    let own = Arc::new(Event::new());
                    c.targets.insert(token.clone(), own.clone());
                    own
                }
                None => c.event.clone(),
            };
            (event, c.subscribers == 1)
        };
        // Made before the SUBSCRIBE is awaited: if this future is dropped or the command
        // fails, the guard still takes the count back down.
        let guard = Unsubscribe {
            pubsub: self.clone(),
            channel,
            target,
        };
        if first {
            in_tokio(self.client.subscribe(guard.channel.clone()))
                .await
                .map_err(Error::backend)?;
        }
        drop(started);
        Ok(Subscription::new(event).with_guard(guard))
    }
}

struct Unsubscribe {
    pubsub: Arc<PubSub>,
    channel: String,
    target: Option<String>,
}

impl Drop for Unsubscribe {
    fn drop(&mut self) {
        let last = {
            let mut map = lock_map(&self.pubsub.channels);
            let count = map.get_mut(&self.channel).map(|c| {
                if let Some(token) = &self.target {
                    c.targets.remove(token);
                }
                c.subscribers -= 1;
                c.subscribers
            });
            count == Some(0)
        };
        if !last {
            return;
        }
        let (pubsub, channel) = (self.pubsub.clone(), std::mem::take(&mut self.channel));
        // On the background runtime, in the SUBSCRIBE/UNSUBSCRIBE order: a waiter that came
        // back for this channel in the meantime keeps it subscribed.
        runtime::background().spawn(async move {
            let _order = pubsub.ops.lock().await;
            let idle = {
                let mut map = lock_map(&pubsub.channels);
                let idle = map.get(&channel).is_some_and(|c| c.subscribers == 0);
                if idle {
                    map.remove(&channel);
                }
                idle
            };
            if idle {
                let _ = pubsub.client.unsubscribe(channel).await;
            }
        });
    }
}
