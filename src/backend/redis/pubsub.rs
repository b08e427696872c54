//! Wake-ups: one subscriber connection per backend, one SUBSCRIBE (on a cluster node, a
//! shard channel's SSUBSCRIBE) per channel with local waiters, reference-counted; a message wakes one local waiter (a release), the waiter it
//! names (a fair hand-off), or all of them (a cache fill). When the subscriber connects, a
//! check finds out whether messages reach it at all (an ACL may refuse the channels).
//!
//! On a cluster node, Redis ends the shard channels of a slot that leaves the node, and says
//! so only in a notice that a client may drop (fred does): [`PubSub::verify`] finds such
//! losses (the cluster's slot watch calls it), and [`PubSub::ended`] keeps an ended channel
//! from being sent a SUNSUBSCRIBE that the node would answer `MOVED` (fred takes
//! (S)UNSUBSCRIBE to have no reply of its own, and hands such an error to the next command
//! on the connection as its reply).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use event_listener::{Event, IntoNotification};
use futures::StreamExt;

use super::keys::{part, Part};
use super::transport::{self, Connection, Notice, Said, Subscriber, Value};
use crate::backend::Subscription;
use crate::error::Result;
use crate::runtime;
use crate::token::{LeaseKey, Token};

/// The subscriber connection and its channels.
pub(super) struct PubSub {
    pub(super) subscriber: Arc<dyn Subscriber>,
    /// The backend's command connection: it publishes the check's message.
    publisher: Arc<dyn Connection>,
    /// A cluster node: shard channels (SSUBSCRIBE, SPUBLISH). The check's channel is mostly
    /// served by another node (answered MOVED), so a count of 0 proves nothing there: only a
    /// refused publish is seen.
    clustered: bool,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE (and the re-subscription after a reconnect) so they
    /// reach the server in the order of the count changes; `true` once the connection is up.
    ops: Arc<futures::lock::Mutex<bool>>,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    /// Cleared when the check found that messages on the lock channels do not reach the
    /// subscriber: waiters then find a release by their fallback re-check only.
    by_message: AtomicBool,
    /// Cleared when the node refused to say how many shard channels the subscriber
    /// connection has (`CLIENT LIST` needs the `@admin` category): [`verify`](Self::verify)
    /// then does nothing.
    verifiable: AtomicBool,
    /// A [`verify`](Self::verify) runs: another returns at once.
    verifying: AtomicBool,
}

/// What the check found.
#[derive(Debug, PartialEq, Eq)]
enum Check {
    /// Its own message came back.
    Delivered,
    /// PUBLISH was refused (the server's words): releases wake nobody.
    PublishRefused(String),
    /// PUBLISH reached no subscriber: the SUBSCRIBE was refused (a client may report no
    /// error for it, as its reply comes out of band).
    SubscribeRefused,
    /// The check could not tell (a timeout, a dropped connection, a cluster).
    Unknown,
}

struct Channel {
    event: Arc<Event>,
    subscribers: usize,
    /// A message wakes every local listener (cache fills), not just one (releases).
    broadcast: bool,
    /// Fair waiters on a hand-off channel, by token: a message wakes only the one it names.
    targets: HashMap<String, Arc<Event>>,
    /// The node ended the subscription (its slot left the node): no SUNSUBSCRIBE is sent
    /// for it. Cleared when it is subscribed again.
    ended: bool,
}

fn lock_map(m: &Mutex<HashMap<String, Channel>>) -> MutexGuard<'_, HashMap<String, Channel>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A message on `channel`: wakes one local waiter (a release: waking them all would send
/// every waiter's attempt to Redis for one lease), the waiter it names (a fair hand-off), or
/// every local listener (a cache fill, or a release that shared claims wait for: `*`, as the
/// readers a write held back may all go in).
fn deliver(channels: &Mutex<HashMap<String, Channel>>, channel: &str, value: &Value) {
    if let Some(c) = lock_map(channels).get(channel) {
        let said = value.as_str();
        match said.as_deref().and_then(|t| c.targets.get(t)) {
            Some(waiter) => waiter.notify(usize::MAX),
            None if c.broadcast || said.as_deref() == Some("*") => c.event.notify(usize::MAX),
            None => c.event.notify(1.additional()),
        };
    }
}

/// Wakes every local waiter of every channel, to look again: messages may have been lost.
fn wake_all(channels: &Mutex<HashMap<String, Channel>>) {
    for c in lock_map(channels).values() {
        c.event.notify(usize::MAX);
        for waiter in c.targets.values() {
            waiter.notify(usize::MAX);
        }
    }
}

impl PubSub {
    pub(super) fn new(
        subscriber: Arc<dyn Subscriber>,
        publisher: Arc<dyn Connection>,
        clustered: bool,
    ) -> Self {
        PubSub {
            subscriber,
            publisher,
            clustered,
            ops: Arc::new(futures::lock::Mutex::new(false)),
            channels: Arc::default(),
            by_message: AtomicBool::new(true),
            verifiable: AtomicBool::new(true),
            verifying: AtomicBool::new(false),
        }
    }

    /// `false` once the check found that messages on the lock channels do not reach this
    /// backend's subscriber.
    pub(super) fn by_message(&self) -> bool {
        self.by_message.load(Ordering::Acquire)
    }

    /// Connects the subscriber now (not at the first wait) and checks that messages reach
    /// it. A subscriber that cannot connect is no error here: the first waiter tries again
    /// (and fails if it still cannot).
    pub(super) async fn connect(self: &Arc<Self>) {
        let mut started = self.ops.lock().await;
        if let Err(e) = self.ensure_started(&mut started).await {
            tracing::warn!(
                error = %e,
                "the Redis pub/sub connection failed; the first waiter will try again"
            );
        }
    }

    /// Starts the subscriber once (`started` is the flag behind `ops`), and checks it.
    async fn ensure_started(&self, started: &mut bool) -> Result<()> {
        if !*started {
            self.start().await?;
            *started = true;
            self.report(self.check().await);
        }
        Ok(())
    }

    /// SUBSCRIBEs to a fresh channel named as the lock channels are under the default key
    /// prefix, then PUBLISHes to it from the command connection: PUBLISH says how many
    /// subscribers got the message.
    async fn check(&self) -> Check {
        let probe = LeaseKey::new("redlease:", &format!("check:{}", Token::random().as_str()));
        let channel = part(&probe, Part::Released);
        // Answered once the server has processed the SUBSCRIBE (refused or not).
        if self.subscribe_to(channel.clone()).await.is_err() {
            return Check::Unknown;
        }
        let command = if self.clustered {
            "SPUBLISH"
        } else {
            "PUBLISH"
        };
        let args = vec![Value::from(channel.as_str()), Value::from("")];
        let published = self.publisher.command(command, args).await;
        let _ = self.unsubscribe(channel).await;
        match published.map(|n| n.as_i64()) {
            Err(e) if e.is("NOPERM") => Check::PublishRefused(e.said),
            Err(_) | Ok(None) => Check::Unknown,
            Ok(Some(0)) if !self.clustered => Check::SubscribeRefused,
            Ok(Some(_)) => Check::Delivered,
        }
    }

    /// Says what the check found (a warning when waiters are left to poll), and keeps it.
    fn report(&self, check: Check) {
        let server = self.publisher.server();
        let user = self.publisher.user();
        let why = match check {
            Check::Delivered | Check::Unknown => return,
            Check::PublishRefused(said) => format!("may not PUBLISH to them ({said})"),
            Check::SubscribeRefused => "may not SUBSCRIBE to them".to_owned(),
        };
        self.by_message.store(false, Ordering::Release);
        tracing::warn!(
            server,
            user,
            "the Redis user {user} {why}: waiters are not woken by releases and find a free \
             lock only by their fallback re-check (RetryPolicy max_delay), so hand-offs take \
             that long instead of a round trip; locks still work. Grant the lock channels, \
             e.g. ACL SETUSER {user} +subscribe +publish +ssubscribe +spublish &redlease:* \
             (the key prefix in use; the s- commands for a cluster)"
        );
    }

    /// Connects the subscriber and installs its handlers on the crate's background runtime,
    /// so they keep running whichever runtime the waiters use. A lag (messages the client
    /// dropped) wakes every waiter to look again, as a reconnect does.
    ///
    /// After a reconnect the handler subscribes to the channels again itself (not a
    /// client's own re-subscription), and wakes the waiters only once the server has
    /// confirmed it: a waiter woken earlier would re-check while a release's message could
    /// still reach nobody, and then sleep until its fallback re-check.
    async fn start(&self) -> Result<()> {
        let (mut messages, mut reconnects) = self.subscriber.start().await?;
        let on_message = self.channels.clone();
        runtime::background().spawn(async move {
            while let Some(notice) = messages.next().await {
                match notice {
                    Notice::Message { channel, payload } => {
                        deliver(&on_message, &channel, &payload)
                    }
                    Notice::Lagged => wake_all(&on_message),
                }
            }
        });
        let (subscriber, channels, ops) = (
            self.subscriber.clone(),
            self.channels.clone(),
            self.ops.clone(),
        );
        let clustered = self.clustered;
        runtime::background().spawn(async move {
            // Messages published while the connection was down are lost: wake every
            // waiter to re-check at once instead of at its fallback timer, once the
            // channels are subscribed again.
            while reconnects.next().await.is_some() {
                resubscribe_and_wake(&*subscriber, clustered, &ops, &channels).await;
            }
        });
        Ok(())
    }

    /// SUBSCRIBE, or on a cluster node SSUBSCRIBE: a cluster's releases are published to
    /// their shard only (`SPUBLISH`, see `Scripts::new`).
    async fn subscribe_to(&self, channel: String) -> Said<()> {
        self.subscriber
            .subscribe(vec![channel], self.clustered)
            .await
    }

    /// UNSUBSCRIBE, or on a cluster node SUNSUBSCRIBE.
    async fn unsubscribe(&self, channel: String) -> Said<()> {
        self.subscriber.unsubscribe(channel, self.clustered).await
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
        self.ensure_started(&mut started).await?;
        let (event, first) = {
            let mut map = lock_map(&self.channels);
            let c = map.entry(channel.clone()).or_insert_with(|| Channel {
                event: Arc::new(Event::new()),
                subscribers: 0,
                broadcast,
                targets: HashMap::new(),
                ended: false,
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
            self.subscribe_to(guard.channel.clone())
                .await
                .map_err(super::errors::store_error)?;
            self.subscribed_again(&guard.channel);
        }
        drop(started);
        Ok(Subscription::new(event).with_guard(guard))
    }

    /// Clears `channel`'s [`ended`](Channel::ended) mark after a SSUBSCRIBE of it succeeded.
    fn subscribed_again(&self, channel: &str) {
        if let Some(c) = lock_map(&self.channels).get_mut(channel) {
            c.ended = false;
        }
    }

    /// Redis ended this connection's shard channels of `slot`: the slot has left the node
    /// (a cluster's slot table says so). Those channels are left without a SUNSUBSCRIBE when
    /// their last waiter here goes: the node would answer it `MOVED`, an error that fred hands
    /// to the next command on the connection as its reply (another lock's SSUBSCRIBE then
    /// fails, or, once the replies have shifted, takes the reply of the command before it).
    pub(super) fn ended(&self, slot: u16) {
        for (name, c) in lock_map(&self.channels).iter_mut() {
            if transport::slot(name.as_bytes()) == slot {
                c.ended = true;
            }
        }
    }

    /// On a cluster node: checks that the node still has every shard channel that waiters
    /// here listen to and whose slot the cluster's slot table puts on this node (`serves`),
    /// and subscribes them again if not. Redis ends the shard channels of a slot that leaves
    /// the node (a client may drop the notice); a slot that leaves and comes back between
    /// two looks at the slot table changes nothing in the table, and its waiters would hear
    /// nothing more. The count the node keeps for the subscriber connection (`CLIENT LIST
    /// ID`, field `ssub`) is compared with those channels; when it is lower, each of them is
    /// subscribed again (a SSUBSCRIBE of a channel the connection has already changes
    /// nothing), and if that brought any back, every waiter here looks again (a release may
    /// have come meanwhile). Channels whose slot the table puts elsewhere are left to the
    /// table, which moves their waiters. Nothing is remembered between checks: a channel
    /// refused `MOVED` (its slot was away at that moment, or the table was behind) is tried
    /// again at the next one, so a slot that comes back is found there.
    pub(super) async fn verify(&self, serves: impl Fn(&str) -> bool + Send + Sync) {
        if !self.clustered
            || !self.verifiable.load(Ordering::Acquire)
            || self.verifying.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.verify_once(&serves).await;
        self.verifying.store(false, Ordering::Release);
    }

    /// [`verify`](Self::verify), one at a time.
    async fn verify_once(&self, serves: &(dyn Fn(&str) -> bool + Send + Sync)) {
        // No SSUBSCRIBE of ours is in flight meanwhile (a SUNSUBSCRIBE may be: the node then
        // counts one more, and a loss is found at the next call).
        let started = self.ops.lock().await;
        if !*started {
            return;
        }
        let listened: Vec<String> = lock_map(&self.channels)
            .iter()
            .filter(|(name, c)| c.subscribers > 0 && serves(name))
            .map(|(name, _)| name.clone())
            .collect();
        if listened.is_empty() {
            return;
        }
        let Some(before) = self.shard_channels().await else {
            return;
        };
        if before >= listened.len() {
            return;
        }
        for channel in listened {
            if self.subscribe_to(channel.clone()).await.is_ok() {
                self.subscribed_again(&channel);
            }
        }
        let after = self.shard_channels().await;
        drop(started);
        if after.is_some_and(|after| after > before) {
            tracing::debug!(
                before,
                ?after,
                "shard channels the node had ended, subscribed again"
            );
            wake_all(&self.channels);
        }
    }

    /// How many shard channels the node counts for the subscriber connection (`CLIENT LIST
    /// ID`, field `ssub`, Redis 7.0 and later); `None` when it cannot tell (not connected, or
    /// the command refused: then never asked again, with a warning).
    async fn shard_channels(&self) -> Option<usize> {
        let id = self.subscriber.connection_id()?;
        let args: Vec<Value> = vec!["LIST".into(), "ID".into(), id.into()];
        match self.publisher.command("CLIENT", args).await {
            Ok(line) => line
                .as_string()?
                .split_whitespace()
                .find_map(|field| field.strip_prefix("ssub="))
                .and_then(|n| n.parse().ok()),
            Err(e) if e.is("NOPERM") => {
                self.verifiable.store(false, Ordering::Release);
                tracing::warn!(
                    error = %e,
                    "the Redis user may not run CLIENT LIST: a lock's slot that leaves a \
                     cluster node and comes back between two looks at the slot table (100 ms) \
                     ends its waiters' subscriptions there unseen, and they find a release by \
                     their fallback re-check only (RetryPolicy max_delay)"
                );
                None
            }
            Err(_) => None,
        }
    }
}

/// After a reconnect: subscribes the new connection to every channel that has local waiters,
/// and wakes them all once the server has confirmed it, so that a release whose message
/// reached nobody (published before the server had the subscription again) is seen by their
/// re-check. A try that fails (a command timeout on a starved machine or server) wakes them
/// too, and is made again after a pause while the connection is up; a connection that drops
/// again leaves it to the next reconnect.
async fn resubscribe_and_wake(
    subscriber: &dyn Subscriber,
    clustered: bool,
    ops: &futures::lock::Mutex<bool>,
    channels: &Mutex<HashMap<String, Channel>>,
) {
    let mut pause = Duration::from_millis(10);
    loop {
        let tried = {
            // In order with the waiters' SUBSCRIBE/UNSUBSCRIBE: the map is the server's set.
            let _order = ops.lock().await;
            let names = lock_map(channels).keys().cloned().collect();
            subscriber.subscribe(names, clustered).await
        };
        wake_all(channels);
        let Err(e) = tried else { return };
        tracing::warn!(error = %e, "re-subscribing after a reconnect failed; trying again");
        if !subscriber.is_connected() {
            return;
        }
        runtime::sleep(pause).await;
        pause = pause.saturating_mul(2).min(Duration::from_secs(1));
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
            // A channel the node ended is not unsubscribed (see `PubSub::ended`).
            let unsubscribe = {
                let mut map = lock_map(&pubsub.channels);
                match map.get(&channel) {
                    Some(c) if c.subscribers == 0 => map.remove(&channel).is_some_and(|c| !c.ended),
                    _ => false,
                }
            };
            if unsubscribe {
                let _ = pubsub.unsubscribe(channel).await;
            }
        });
    }
}
