//! The backend's one watch stream: one watch per subscribed lock key, shared by this process's
//! subscribers of that key; re-opened (watches re-created from the last revision seen + 1)
//! when the stream breaks or goes silent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, WatchOptions, WatchRequestSender, WatchResponseStream};
use event_listener::{Event, IntoNotification};
use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, StreamExt};

use crate::backend::Unavailable;
use crate::error::{Error, Result};
use crate::runtime::{self, in_tokio};

/// What the backend asks of the watch task.
pub(super) enum Cmd {
    /// One more subscriber of `key`: answered with the key's wake-up once its watch is
    /// created on the server.
    Watch {
        key: Vec<u8>,
        /// Every key under `key`.
        prefix: bool,
        /// Called on a delete instead of waking one subscriber (fair waiters: the backend
        /// wakes its waiter nearest the head of the queue); `true` when everyone must look.
        hook: Option<Hook>,
        /// Every event (a put too) wakes every subscriber (the cache's fill notifications).
        every: bool,
        reply: oneshot::Sender<Result<Arc<Event>>>,
    },
    /// One subscriber fewer (its subscription was dropped).
    Unwatch { key: Vec<u8> },
}

/// What a delete of a watched key does instead of waking one subscriber.
pub(super) type Hook = Arc<dyn Fn(bool) + Send + Sync>;

/// Settings of the watch task.
pub(super) struct Settings {
    pub(super) client: Client,
    /// A key the stream always watches (the epoch key), so that it is never empty.
    pub(super) sentinel: Vec<u8>,
    /// Bound on opening the stream.
    pub(super) timeout: Duration,
    /// How often the stream is asked for progress; silent for this plus `timeout`, it is
    /// taken for dead and re-opened (a paused server, a dead connection).
    pub(super) heartbeat: Duration,
    /// Resolved after each re-open (the backend's `disturbed`).
    pub(super) disturbance: Arc<Event>,
    /// The highest revision the backend has seen anywhere, raised here too.
    pub(super) max_rev: Arc<AtomicI64>,
}

struct Entry {
    id: i64,
    prefix: bool,
    hook: Option<Hook>,
    every: bool,
    event: Arc<Event>,
    users: usize,
    created: bool,
    waiting: Vec<oneshot::Sender<Result<Arc<Event>>>>,
}

struct State {
    entries: HashMap<Vec<u8>, Entry>,
    by_id: HashMap<i64, Vec<u8>>,
    next_id: i64,
    /// The last revision this stream saw (events and headers).
    last_rev: i64,
}

enum Msg {
    Cmd(Option<Cmd>),
    Resp(Option<std::result::Result<etcd_client::WatchResponse, etcd_client::Error>>),
    Tick,
}

const SENTINEL_ID: i64 = 0;

fn watch_options(id: i64, prefix: bool) -> WatchOptions {
    let opts = WatchOptions::new().with_watch_id(id);
    if prefix {
        opts.with_prefix()
    } else {
        opts
    }
}

/// Runs until the backend (every command sender) is gone.
pub(super) async fn run(settings: Settings, mut cmds: mpsc::UnboundedReceiver<Cmd>) {
    let mut st = State {
        entries: HashMap::new(),
        by_id: HashMap::new(),
        next_id: SENTINEL_ID + 1,
        last_rev: 0,
    };
    let mut first = true;
    let mut backoff = Duration::from_millis(20);
    loop {
        let opened = in_tokio(tokio::time::timeout(
            settings.timeout,
            open(&settings, &mut st),
        ))
        .await;
        let (mut tx, mut rx) = match opened {
            Ok(Ok(pair)) => pair,
            _ => {
                // Down: subscribers are told at once (they fall back to re-checks), and the
                // stream is tried again after a pause.
                let pause = backoff;
                backoff = (backoff * 2).min(Duration::from_millis(500));
                if !refuse_while(&mut cmds, &mut st, pause).await {
                    return;
                }
                continue;
            }
        };
        backoff = Duration::from_millis(20);
        if !first {
            // Releases while the stream was down may have been missed (and the server may
            // have restarted, even empty): every waiter looks again, the watchdog too.
            for e in st.entries.values() {
                wake_all(e);
            }
            settings.disturbance.notify(usize::MAX);
        }
        first = false;
        let mut heard = Instant::now();
        let mut asked = false;
        loop {
            let msg = {
                // Counted from the last answer heard, not from this pass: commands coming
                // more often than the heartbeat must not put the check off for ever.
                let due = if asked {
                    settings.heartbeat + settings.timeout
                } else {
                    settings.heartbeat
                };
                let mut tick = Box::pin(runtime::sleep(due.saturating_sub(heard.elapsed())).fuse());
                let mut c = cmds.next().fuse();
                let mut r = rx.next().fuse();
                futures::select! {
                    c = c => Msg::Cmd(c),
                    r = r => Msg::Resp(r),
                    _ = tick => Msg::Tick,
                }
            };
            match msg {
                Msg::Cmd(None) => return,
                Msg::Cmd(Some(cmd)) => {
                    if !command(&mut st, &mut tx, cmd, settings.timeout).await {
                        break;
                    }
                }
                Msg::Resp(Some(Ok(resp))) => {
                    heard = Instant::now();
                    asked = false;
                    response(&settings, &mut st, &mut tx, resp).await;
                }
                Msg::Resp(_) => break,
                Msg::Tick => {
                    if asked && heard.elapsed() >= settings.heartbeat + settings.timeout {
                        break;
                    }
                    if heard.elapsed() >= settings.heartbeat && !asked {
                        asked = true;
                        if !sent(settings.timeout, tx.request_progress()).await {
                            break;
                        }
                    }
                }
            }
        }
        for e in st.entries.values_mut() {
            e.created = false;
        }
    }
}

/// Opens the stream (watching the sentinel), then re-creates every watch: from the last
/// revision seen + 1, unless the store's revision went backwards (a wiped data directory),
/// when from now (every waiter is woken anyway).
async fn open(
    settings: &Settings,
    st: &mut State,
) -> std::result::Result<(WatchRequestSender, WatchResponseStream), etcd_client::Error> {
    let mut client = settings.client.clone();
    let opts = WatchOptions::new().with_watch_id(SENTINEL_ID);
    let ws = client.watch(settings.sentinel.clone(), Some(opts)).await?;
    let (mut tx, mut rx) = ws.split();
    // The sentinel's creation answers with the store's revision now.
    let now = loop {
        match rx.message().await? {
            Some(resp) if resp.created() && resp.watch_id() == SENTINEL_ID => {
                break resp.header().map_or(0, |h| h.revision());
            }
            Some(_) => continue,
            None => return Err(etcd_client::Error::WatchError("stream closed".into())),
        }
    };
    settings.max_rev.fetch_max(now, Ordering::Relaxed);
    let resume = (st.last_rev > 0 && now >= st.last_rev).then_some(st.last_rev + 1);
    st.last_rev = now.max(if resume.is_some() { st.last_rev } else { 0 });
    for (key, e) in &st.entries {
        let mut opts = watch_options(e.id, e.prefix);
        if let Some(rev) = resume {
            opts = opts.with_start_revision(rev);
        }
        tx.watch(key.clone(), Some(opts)).await?;
    }
    Ok((tx, rx))
}

/// Answers commands while the stream is down, until `pause` ends; `false` when the backend
/// is gone.
async fn refuse_while(
    cmds: &mut mpsc::UnboundedReceiver<Cmd>,
    st: &mut State,
    pause: Duration,
) -> bool {
    let mut pause = Box::pin(runtime::sleep(pause).fuse());
    loop {
        let mut c = cmds.next().fuse();
        let cmd = futures::select! {
            c = c => c,
            _ = pause => return true,
        };
        match cmd {
            None => return false,
            Some(Cmd::Watch { reply, .. }) => {
                let _ = reply.send(Err(Error::backend(Unavailable(
                    "etcd: the watch stream is down (reconnecting)".into(),
                ))));
            }
            Some(Cmd::Unwatch { key }) => unwatch(st, &key).map_or((), drop),
        }
    }
}

/// Drops one user of `key`; the watch id to cancel when it was the last.
fn unwatch(st: &mut State, key: &[u8]) -> Option<i64> {
    let e = st.entries.get_mut(key)?;
    e.users = e.users.saturating_sub(1);
    if e.users > 0 {
        return None;
    }
    let id = e.id;
    st.entries.remove(key);
    st.by_id.remove(&id);
    Some(id)
}

/// `false` when the stream broke.
/// Sends a request on the stream within `timeout`: `false` if it failed or the stream took
/// no more requests (a dead stream whose buffer is full), which ends the stream.
async fn sent<F, T>(timeout: Duration, send: F) -> bool
where
    F: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let deadline = Some(Instant::now() + timeout);
    matches!(runtime::until(deadline, in_tokio(send)).await, Some(Ok(_)))
}

async fn command(st: &mut State, tx: &mut WatchRequestSender, cmd: Cmd, timeout: Duration) -> bool {
    match cmd {
        Cmd::Watch {
            key,
            prefix,
            hook,
            every,
            reply,
        } => {
            if let Some(e) = st.entries.get_mut(&key) {
                e.users += 1;
                if e.hook.is_none() {
                    e.hook = hook;
                }
                if e.created {
                    if reply.send(Ok(e.event.clone())).is_err() {
                        e.users -= 1;
                    }
                } else {
                    e.waiting.push(reply);
                }
                return true;
            }
            let id = st.next_id;
            st.next_id += 1;
            let opts = watch_options(id, prefix);
            st.entries.insert(
                key.clone(),
                Entry {
                    id,
                    prefix,
                    hook,
                    every,
                    event: Arc::new(Event::new()),
                    users: 1,
                    created: false,
                    waiting: vec![reply],
                },
            );
            st.by_id.insert(id, key.clone());
            sent(timeout, tx.watch(key, Some(opts))).await
        }
        Cmd::Unwatch { key } => match unwatch(st, &key) {
            Some(id) => sent(timeout, tx.cancel(id)).await,
            None => true,
        },
    }
}

async fn response(
    settings: &Settings,
    st: &mut State,
    tx: &mut WatchRequestSender,
    resp: etcd_client::WatchResponse,
) {
    if let Some(h) = resp.header() {
        st.last_rev = st.last_rev.max(h.revision());
        settings.max_rev.fetch_max(h.revision(), Ordering::Relaxed);
    }
    let id = resp.watch_id();
    let Some(key) = st.by_id.get(&id).cloned() else {
        return;
    };
    let Some(e) = st.entries.get_mut(&key) else {
        return;
    };
    if resp.created() {
        e.created = true;
        for reply in e.waiting.drain(..) {
            if reply.send(Ok(e.event.clone())).is_err() {
                e.users = e.users.saturating_sub(1);
            }
        }
    }
    if resp.canceled() {
        // Cancelled by the server (a compacted start revision): watch from now, and wake
        // everyone, since events may have been missed.
        e.created = false;
        wake_all(e);
        let opts = watch_options(id, e.prefix);
        let _ = sent(settings.timeout, tx.watch(key.clone(), Some(opts))).await;
        return;
    }
    for ev in resp.events() {
        if let Some(kv) = ev.kv() {
            st.last_rev = st.last_rev.max(kv.mod_revision());
        }
        if e.every {
            e.event.notify(usize::MAX);
        } else if ev.event_type() == EventType::Delete {
            // One release, one waiter of this process (as on Redis); the others are woken by
            // the next release, or re-check.
            match &e.hook {
                Some(hook) => hook(false),
                None => {
                    e.event.notify(1.additional());
                }
            }
        }
    }
}

/// Wakes every subscriber of `e` (events may have been missed).
fn wake_all(e: &Entry) {
    e.event.notify(usize::MAX);
    if let Some(hook) = &e.hook {
        hook(true);
    }
}
