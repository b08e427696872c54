//! Shared integration-test harness (std only, synchronous, runtime-agnostic).
//!
//! * [`RedisServer`]: a throw-away `redis-server` on a free loopback port, killed on drop.
//! * [`RedisCluster`]: a throw-away Redis Cluster of such servers.
//! * `EtcdServer` (feature `etcd`): a throw-away one-member etcd on free loopback ports.
//! * [`RedisSentinels`]: a throw-away primary, its replicas and the Sentinels watching them.
//! * [`Resp`] / [`Conn`]: a tiny RESP2 client for poking at the server from tests.
//! * [`Checker`] / [`Section`]: a mutual-exclusion and fencing-token checker.
//! * [`SharedChecker`]: at most N permit holders, a writer alone, writers' tokens above all.
//! * [`Store`]: a test's leases in memory or on a server it started; [`within`] [`SOON`].
//! * [`wait_for`] / [`wait_for_async`]: bounded polling instead of sleeps.
//! * [`Wrap`] / [`Wrapped`]: a test store that passes calls on to another but the ones it
//!   changes; [`plain_only`]: one that serves plain claims only.
//! * [`Proxy`]: a loopback TCP proxy that can hold back a client's command.
//! * [`holder`] / [`lease_ms`] / [`field`]: a lock's record on a test server.
//! * [`redis_options`] / [`transport`]: the client the Redis backends use
//!   (`REDLEASE_TEST_TRANSPORT`).
//!
//! Each test binary uses only part of this module, hence the `allow`s below
//! (`unreachable_pub`: the module is private to each test crate).
#![allow(dead_code, unused_imports, unreachable_pub)]

mod checker;
mod cluster;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "postgres")]
mod postgres;
mod proxy;
mod record;
mod sentinel;
mod server;
mod shared_checker;
mod store;
mod transport;
mod wait;
mod wrap;

pub use checker::{Checker, Section};
pub use cluster::RedisCluster;
#[cfg(feature = "etcd")]
pub use etcd::EtcdServer;
#[cfg(feature = "postgres")]
pub use postgres::PgServer;
pub use proxy::Proxy;
pub use record::{field, held, holder, int_field, lease_ms, plant, server_ms, LEASE};
pub use sentinel::RedisSentinels;
pub use server::{scratch_dir, Conn, RedisServer, Resp, ScratchDir};
pub use shared_checker::{SharedChecker, SharedSection};
pub use store::{within, Store, SOON};
pub use transport::{redis_options, transport};
pub use wait::wait_for_interval;
pub use wrap::{plain_only, Wrap, Wrapped};

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Polls `f` every 2 ms until it returns `true` or `timeout` elapses.
/// Returns whether `f` became true (it is always evaluated at least once, and
/// once more at the deadline).
///
/// This blocks the calling thread: inside a single-threaded async runtime
/// (e.g. a default `#[tokio::test]`) it stalls the runtime's other tasks, so
/// use [`wait_for_async`] there (or a multi-thread runtime).
pub fn wait_for(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    wait_for_interval(timeout, Duration::from_millis(2), f)
}

/// Async version of [`wait_for`]: same contract, but yields to the executor
/// between polls instead of blocking the thread. Works on any runtime (the
/// 2 ms ticks are driven by a helper std thread, not by a runtime timer).
pub async fn wait_for_async(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        sleep_async(Duration::from_millis(2).min(deadline - now)).await;
    }
}

/// A runtime-agnostic sleep future (a std thread sleeps and then wakes the task).
/// Meant for the polling helpers above, not as a synchronisation primitive.
pub fn sleep_async(d: Duration) -> impl Future<Output = ()> + Send {
    StdSleep {
        dur: d,
        state: None,
    }
}

struct StdSleep {
    dur: Duration,
    state: Option<Arc<SleepState>>,
}

struct SleepState {
    done: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Future for StdSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let dur = self.dur;
        let state = self
            .state
            .get_or_insert_with(|| {
                let st = Arc::new(SleepState {
                    done: AtomicBool::new(false),
                    waker: Mutex::new(None),
                });
                let st2 = Arc::clone(&st);
                std::thread::spawn(move || {
                    std::thread::sleep(dur);
                    st2.done.store(true, Ordering::SeqCst);
                    let w = st2.waker.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(w) = w {
                        w.wake();
                    }
                });
                st
            })
            .clone();
        if state.done.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        *state.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        // Re-check: the thread may have finished between the load and storing the waker.
        if state.done.load(Ordering::SeqCst) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// The lock `name` of `locks`, taken at once: the test knows it is free (panics otherwise).
pub async fn take(locks: &redlease::LockManager, name: &str) -> redlease::LockGuard {
    locks
        .lock(name)
        .try_acquire()
        .await
        .unwrap_or_else(|e| panic!("{name}: the acquire failed: {e}"))
        .unwrap_or_else(|| panic!("{name}: the lock was held"))
}
