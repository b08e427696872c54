//! Group commit: concurrent calls of one kind on one connection go to Redis as one script
//! call.
//!
//! fred writes the socket once per script call, and Redis pays a fixed cost per call, so 64
//! tasks acquiring distinct locks cost 64 writes and 64 script dispatches. Here up to
//! [`MAX_INLINE`] calls are sent by their callers' own futures, each alone: a lone call costs
//! an uncontended mutex and nothing else. Calls that arrive while those are out queue up, and
//! a flusher task on the crate's private runtime sends the queue, [`MAX_BATCH`] requests per
//! script call, until it is empty. The flusher keeps up to [`MAX_IN_FLIGHT`] batches out at
//! once (pipelined: Redis runs one while the client hands out the replies of another and the
//! callers make their next requests), and sends what queued up as soon as one is free.
//! Batches are handed to the connection in queue order, so Redis runs them in that order.
//!
//! Queued callers depend on nobody else's future: a caller that stops polling its future
//! (or drops it) holds up only its own request. The flusher runs on a runtime that is always
//! polled and never cancelled. A queued caller that gave up before its batch was taken is not
//! sent, unless it asked to be sent anyway (a release: what the caller let go of should still
//! be let go); one that gives up after that is answered into the void.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use event_listener::Event;
use futures::channel::oneshot;
use futures::future;
use futures::stream::{FuturesUnordered, StreamExt};

use crate::error::{Error, Result};
use crate::runtime;

/// Calls sent by their own callers, at once, before callers start queueing. (W2 of the
/// benchmark, 64 tasks on one connection: about 56k cycles/s with 16, 45k with 4 or 1.)
pub(super) const MAX_INLINE: usize = 16;
/// Requests in one script call at most (Redis runs a script without interruption).
pub(super) const MAX_BATCH: usize = 128;
/// Batches out at once (sent, not yet answered) from one flusher.
pub(super) const MAX_IN_FLIGHT: usize = 4;

pub(super) struct Batcher<Req, Resp> {
    state: Arc<Shared<Req, Resp>>,
}

struct Shared<Req, Resp> {
    state: Mutex<State<Req, Resp>>,
    /// Notified when a call joins the queue of a running flusher.
    queued: Event,
}

struct State<Req, Resp> {
    /// Calls out now that their callers sent themselves.
    inline: usize,
    queue: Vec<Waiter<Req, Resp>>,
    /// A flusher task is at work on the queue.
    flushing: bool,
}

struct Waiter<Req, Resp> {
    req: Req,
    tx: oneshot::Sender<Result<Resp>>,
    /// Sent even if the caller gives up while it is queued.
    keep: bool,
}

impl<Req, Resp> Default for Batcher<Req, Resp> {
    fn default() -> Self {
        Batcher {
            state: Arc::new(Shared {
                state: Mutex::new(State {
                    inline: 0,
                    queue: Vec::new(),
                    flushing: false,
                }),
                queued: Event::new(),
            }),
        }
    }
}

fn lock<Req, Resp>(s: &Shared<Req, Resp>) -> MutexGuard<'_, State<Req, Resp>> {
    s.state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts one inline call while it lives (done, failed or cancelled).
struct Inline<Req, Resp> {
    state: Arc<Shared<Req, Resp>>,
}

impl<Req, Resp> Drop for Inline<Req, Resp> {
    fn drop(&mut self) {
        lock(&self.state).inline -= 1;
    }
}

/// Clears `flushing` if the flusher ends abnormally (its task dropped or panicking), so the
/// next queued call starts one. A normal end clears it under the lock and disarms this.
struct Flushing<Req, Resp> {
    state: Arc<Shared<Req, Resp>>,
    armed: bool,
}

impl<Req, Resp> Drop for Flushing<Req, Resp> {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.state).flushing = false;
        }
    }
}

impl<Req, Resp> Batcher<Req, Resp>
where
    Req: Clone + Send + 'static,
    Resp: Send + 'static,
{
    /// Runs `req`, alone or together with others, through `send` (one script call for all the
    /// requests it is given, one response per request, in order). `send` must be idempotent
    /// per request: if the flusher's runtime dropped a batch, its requests are sent again.
    /// `keep`: send the request even if this future is dropped while it waits in the queue.
    pub(super) async fn call<F, Fut>(&self, req: Req, keep: bool, send: F) -> Result<Resp>
    where
        F: Fn(Vec<Req>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<Vec<Resp>>> + Send + 'static,
    {
        loop {
            let queued = {
                let mut s = lock(&self.state);
                if s.inline < MAX_INLINE && s.queue.is_empty() && !s.flushing {
                    s.inline += 1;
                    None
                } else {
                    let (tx, rx) = oneshot::channel();
                    s.queue.push(Waiter {
                        req: req.clone(),
                        tx,
                        keep,
                    });
                    let start = !s.flushing;
                    s.flushing = true;
                    Some((rx, start))
                }
            };
            if let Some((_, false)) = queued {
                // A running flusher may be waiting for work, with room for another batch.
                self.state.queued.notify(1);
            }
            let Some((rx, start)) = queued else {
                let _inline = Inline {
                    state: self.state.clone(),
                };
                return single(send(vec![req]).await?);
            };
            if start {
                let guard = Flushing {
                    state: self.state.clone(),
                    armed: true,
                };
                runtime::background().spawn(flush(guard, send.clone()));
            }
            match rx.await {
                Ok(resp) => return resp,
                // The flusher's runtime dropped the batch: send again (idempotent).
                Err(_) => continue,
            }
        }
    }
}

/// The one reply to a call of one request.
pub(super) fn single<Resp>(mut resps: Vec<Resp>) -> Result<Resp> {
    match resps.pop() {
        Some(resp) if resps.is_empty() => Ok(resp),
        _ => Err(Error::backend(
            "a script call returned the wrong number of replies",
        )),
    }
}

/// Sends the queue, batch after batch, until it is empty: up to [`MAX_IN_FLIGHT`] batches
/// out at once, each handed to the connection (its first poll) before the next is taken.
async fn flush<Req, Resp, F, Fut>(mut guard: Flushing<Req, Resp>, send: F)
where
    F: Fn(Vec<Req>) -> Fut,
    Fut: Future<Output = Result<Vec<Resp>>>,
{
    let mut in_flight = FuturesUnordered::new();
    loop {
        // Listening before looking at the queue: a call queued after the look notifies it.
        let more = guard.state.queued.listen();
        while in_flight.len() < MAX_IN_FLIGHT {
            let batch: Vec<Waiter<Req, Resp>> = {
                let mut s = lock(&guard.state);
                // Callers that gave up are not sent (unless they asked to be).
                s.queue.retain(|w| w.keep || !w.tx.is_canceled());
                if s.queue.is_empty() {
                    if in_flight.is_empty() {
                        // Cleared with the lock still held: a call queued after this starts a
                        // new flusher, which this one's guard must then leave alone.
                        s.flushing = false;
                        drop(s);
                        guard.armed = false;
                        return;
                    }
                    break;
                }
                let take = s.queue.len().min(MAX_BATCH);
                s.queue.drain(..take).collect()
            };
            let (reqs, txs): (Vec<Req>, Vec<_>) = batch.into_iter().map(|w| (w.req, w.tx)).unzip();
            let mut call = Box::pin(answer(send(reqs), txs));
            // The first poll hands the batch to the connection: batches go out in queue order.
            if futures::poll!(call.as_mut()).is_pending() {
                in_flight.push(call);
            }
        }
        if in_flight.len() < MAX_IN_FLIGHT {
            // Room for another batch: go on when one is answered or more is queued.
            let _ = future::select(in_flight.next(), more).await;
        } else {
            let _ = in_flight.next().await;
        }
    }
}

/// Waits for one batch's call and hands out its replies (with no lock held).
async fn answer<Resp>(
    call: impl Future<Output = Result<Vec<Resp>>>,
    txs: Vec<oneshot::Sender<Result<Resp>>>,
) {
    let count = txs.len();
    match call.await {
        Ok(resps) if resps.len() == count => {
            for (tx, resp) in txs.into_iter().zip(resps) {
                let _ = tx.send(Ok(resp));
            }
        }
        Ok(resps) => {
            let msg = format!("batched call returned {} replies for {count}", resps.len());
            for tx in txs {
                let _ = tx.send(Err(Error::backend(msg.clone())));
            }
        }
        Err(e) => {
            for tx in txs {
                let _ = tx.send(Err(crate::backend::for_each_caller(&e)));
            }
        }
    }
}
