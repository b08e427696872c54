//! Which script calls on one connection still wait for an answer, so that a quorum member
//! whose server stopped answering (paused or wedged, while its connection still looks up) is
//! skipped rather than sent calls that would only queue behind the unanswered ones.
//!
//! Redis answers the calls of one connection in the order they were sent, so an answer
//! settles every call sent before it: a call whose caller stopped polling it, or dropped it,
//! needs nobody to watch for its answer. (Calls numbered at the same moment on two threads
//! may reach the connection in the other order; that settles a call a moment early, never
//! holds one back; so does a cluster, whose servers each answer in their own order.) While
//! the oldest unanswered call is older than the limit, one call per limit still goes out as
//! a probe: its answer settles everything before it.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub(super) struct Calls {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    /// Calls sent and not known to be answered: number and when sent, oldest first.
    out: VecDeque<(u64, Instant)>,
    /// When the last probe went out.
    probe: Option<Instant>,
}

impl Calls {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A call is about to be handed to the connection: its number, for [`answered`].
    ///
    /// [`answered`]: Self::answered
    pub(super) fn sent(&self) -> u64 {
        let mut s = self.state();
        let n = s.next;
        s.next += 1;
        s.out.push_back((n, Instant::now()));
        n
    }

    /// Call `n` was answered (a reply or a server error): so were all sent before it.
    pub(super) fn answered(&self, n: u64) {
        let mut s = self.state();
        while s.out.front().is_some_and(|&(m, _)| m <= n) {
            s.out.pop_front();
        }
    }

    /// `Err(how long)` while calls have gone unanswered for longer than `limit`, except once
    /// per `limit`, when the caller may go out as the probe.
    pub(super) fn may_send(&self, limit: Duration) -> Result<(), Duration> {
        let mut s = self.state();
        let Some(quiet) = s.out.front().map(|&(_, at)| at.elapsed()) else {
            return Ok(());
        };
        if quiet <= limit {
            return Ok(());
        }
        if s.probe.is_some_and(|p| p.elapsed() < limit) {
            return Err(quiet);
        }
        s.probe = Some(Instant::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_settles_every_call_before_it_and_a_probe_goes_out_once_per_limit() {
        let calls = Calls::default();
        let limit = Duration::from_millis(20);
        let first = calls.sent();
        let second = calls.sent();
        assert_eq!(
            calls.may_send(limit),
            Ok(()),
            "unanswered, but not for long"
        );
        std::thread::sleep(limit * 2);
        assert_eq!(calls.may_send(limit), Ok(()), "the probe");
        assert!(calls.may_send(limit).is_err(), "one probe per limit");
        let probe = calls.sent();
        calls.answered(probe);
        assert_eq!(
            calls.may_send(limit),
            Ok(()),
            "the probe's answer settled all"
        );
        assert!(calls.state().out.is_empty(), "{first} {second} settled");
    }
}
