//! Group commit: concurrent calls of one kind on one connection go to Redis as one script
//! call.
//!
//! fred writes the socket once per script call, and Redis pays a fixed cost per call, so 64
//! tasks acquiring distinct locks cost 64 writes and 64 script dispatches. Here the first
//! callers (up to [`MAX_IN_FLIGHT`]) send at once, alone; callers that arrive while those are
//! in flight queue up, and when a call completes, its leader hands the queue to the first
//! queued caller still waiting, which sends the whole queue (up to [`MAX_BATCH`]) as one call.
//! No task is spawned: every call is sent by one of the callers' own futures, so a lone call
//! costs only an uncontended mutex, and batches form only under load.
//!
//! Cancellation: a queued caller whose future is dropped is never sent (its request never
//! reached the store). A leader dropped mid-call hands the queue on as usual, and the callers
//! in its in-flight batch submit their requests again: every script is idempotent for the
//! same token (an acquire that did run finds its own lease, a release that did run finds its
//! latch), so one caller's cancellation never fails another's call.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::channel::oneshot;

use crate::error::{Error, Result};

/// Calls sent at once before callers start queueing.
pub(super) const MAX_IN_FLIGHT: usize = 4;
/// Requests in one script call at most (Redis runs a script without interruption).
pub(super) const MAX_BATCH: usize = 128;

pub(super) struct Batcher<Req, Resp> {
    queue: Arc<Mutex<Queue<Req, Resp>>>,
}

struct Queue<Req, Resp> {
    in_flight: usize,
    waiting: Vec<Waiter<Req, Resp>>,
}

struct Waiter<Req, Resp> {
    req: Req,
    tx: oneshot::Sender<Message<Req, Resp>>,
}

enum Message<Req, Resp> {
    Done(Result<Resp>),
    /// You lead: send your own request (handed back) with these, in this slot. If the message
    /// is dropped unread (the caller gave up at that moment), the slot passes on by itself
    /// and the callers in `others` submit again.
    Lead(Req, Vec<Waiter<Req, Resp>>, Slot<Req, Resp>),
}

impl<Req, Resp> Default for Batcher<Req, Resp> {
    fn default() -> Self {
        Batcher {
            queue: Arc::new(Mutex::new(Queue {
                in_flight: 0,
                waiting: Vec::new(),
            })),
        }
    }
}

fn lock<Req, Resp>(q: &Mutex<Queue<Req, Resp>>) -> MutexGuard<'_, Queue<Req, Resp>> {
    q.lock().unwrap_or_else(|p| p.into_inner())
}

/// Holds one in-flight slot; dropping it (done or cancelled) passes the slot to the queue.
struct Slot<Req, Resp> {
    queue: Arc<Mutex<Queue<Req, Resp>>>,
}

impl<Req, Resp> Drop for Slot<Req, Resp> {
    fn drop(&mut self) {
        let mut q = lock(&self.queue);
        loop {
            // Callers that gave up are not sent.
            q.waiting.retain(|w| !w.tx.is_canceled());
            if q.waiting.is_empty() {
                q.in_flight -= 1;
                return;
            }
            let take = q.waiting.len().min(MAX_BATCH);
            let mut batch: Vec<_> = q.waiting.drain(..take).collect();
            let first = batch.remove(0);
            let slot = Slot {
                queue: self.queue.clone(),
            };
            match first.tx.send(Message::Lead(first.req, batch, slot)) {
                // The slot went with the message: nothing to give back here.
                Ok(()) => return,
                // It gave up just now (its request is not sent): put the others back and
                // pick again. The slot is still ours; its clone must not run its `Drop`
                // (that would take this lock again).
                Err(Message::Lead(_, rest, slot)) => {
                    std::mem::forget(slot);
                    let later = std::mem::take(&mut q.waiting);
                    q.waiting = rest;
                    q.waiting.extend(later);
                }
                Err(Message::Done(_)) => return,
            }
        }
    }
}

impl<Req: Clone, Resp> Batcher<Req, Resp> {
    /// Runs `req`, possibly together with others, through `send` (one script call for all the
    /// requests it is given, returning one response per request, in order). `send` must be
    /// idempotent per request: a request whose leader was cancelled is sent again.
    pub(super) async fn call<F, Fut>(&self, req: Req, send: F) -> Result<Resp>
    where
        F: Fn(Vec<Req>) -> Fut,
        Fut: Future<Output = Result<Vec<Resp>>>,
    {
        loop {
            if let Some(resp) = self.try_call(req.clone(), &send).await {
                return resp;
            }
        }
    }

    /// One submission; `None` if the call carrying it was cancelled before it answered.
    async fn try_call<F, Fut>(&self, req: Req, send: &F) -> Option<Result<Resp>>
    where
        F: Fn(Vec<Req>) -> Fut,
        Fut: Future<Output = Result<Vec<Resp>>>,
    {
        let queued = {
            let mut q = lock(&self.queue);
            if q.in_flight < MAX_IN_FLIGHT {
                q.in_flight += 1;
                Err(req)
            } else {
                let (tx, rx) = oneshot::channel();
                q.waiting.push(Waiter { req, tx });
                Ok(rx)
            }
        };
        let (own, others, slot) = match queued {
            Err(own) => {
                let slot = Slot {
                    queue: self.queue.clone(),
                };
                (own, Vec::new(), slot)
            }
            Ok(rx) => match rx.await {
                Ok(Message::Done(resp)) => return Some(resp),
                // The slot of the call that just finished is ours now.
                Ok(Message::Lead(own, others, slot)) => (own, others, slot),
                // The leader carrying this request was cancelled.
                Err(_) => return None,
            },
        };
        let resp = lead(own, others, send).await;
        drop(slot);
        Some(resp)
    }
}

/// Sends `own` with `others` and hands every caller its reply.
async fn lead<Req, Resp, F, Fut>(own: Req, others: Vec<Waiter<Req, Resp>>, send: &F) -> Result<Resp>
where
    F: Fn(Vec<Req>) -> Fut,
    Fut: Future<Output = Result<Vec<Resp>>>,
{
    {
        let (reqs, txs): (Vec<Req>, Vec<_>) = others.into_iter().map(|w| (w.req, w.tx)).unzip();
        let mut all = Vec::with_capacity(reqs.len() + 1);
        all.push(own);
        all.extend(reqs);
        let count = all.len();
        match send(all).await {
            Ok(resps) if resps.len() == count => {
                let mut resps = resps.into_iter();
                let mine = resps.next();
                for (tx, resp) in txs.into_iter().zip(resps) {
                    let _ = tx.send(Message::Done(Ok(resp)));
                }
                mine.ok_or_else(|| Error::backend("empty batched reply"))
            }
            Ok(resps) => {
                let msg = format!(
                    "batched call returned {} replies for {count} requests",
                    resps.len()
                );
                for tx in txs {
                    let _ = tx.send(Message::Done(Err(Error::backend(msg.clone()))));
                }
                Err(Error::backend(msg))
            }
            Err(e) => {
                let msg = e.to_string();
                for tx in txs {
                    let _ = tx.send(Message::Done(Err(Error::backend(msg.clone()))));
                }
                Err(e)
            }
        }
    }
}
