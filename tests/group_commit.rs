//! Group commit on the Redis backend: concurrent acquires and releases on one connection
//! share script calls, and cancelling callers at any point neither loses nor leaks anything.

mod support;

use std::time::Duration;

use redlease::{LockManager, LockOptions, RedisBackend};
use support::{wait_for_async, RedisServer};

async fn manager(srv: &RedisServer) -> LockManager {
    let backend = RedisBackend::connect(&srv.url()).await.expect("connect");
    LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(30)))
        .expect("options")
}

/// 64 tasks cycling on distinct keys through one connection: every cycle succeeds, and the
/// server runs fewer script calls than there were acquires and releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_script_calls() {
    let srv = RedisServer::start();
    let locks = manager(&srv).await;
    let before = srv.script_calls();
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let locks = locks.clone();
            tokio::spawn(async move {
                for n in 0..50 {
                    let g = locks.lock(&format!("gc:{t}:{n}")).try_acquire().await;
                    let g = g.expect("acquire").expect("distinct keys are free");
                    g.release().await.expect("release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    let calls = srv.script_calls() - before;
    let operations = 64 * 50 * 2;
    assert!(
        calls < operations,
        "{calls} script calls for {operations} acquires and releases: no call was shared"
    );
}

/// Callers cancelled at every point while others keep going: every surviving caller gets
/// its answer, nothing is left held, and the batcher still works afterwards (a leaked
/// in-flight slot would make later calls queue forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_callers_leave_no_lease_and_no_stuck_queue() {
    let srv = RedisServer::start();
    let locks = manager(&srv).await;
    for round in 0..20u64 {
        let tasks: Vec<_> = (0..32u64)
            .map(|t| {
                let locks = locks.clone();
                tokio::spawn(async move {
                    let lock = locks.lock(&format!("cancel:{t}"));
                    // Half the callers are cut after a few microseconds, at varying points.
                    if t % 2 == 0 {
                        let cut = Duration::from_micros((round * 7 + t * 13) % 300);
                        if let Ok(Ok(Some(g))) = tokio::time::timeout(cut, lock.try_acquire()).await
                        {
                            g.release().await.expect("release");
                        }
                    } else {
                        let g = lock.try_acquire().await.expect("acquire");
                        g.expect("free").release().await.expect("release");
                    }
                })
            })
            .collect();
        let all = tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(tasks));
        for t in all.await.expect("no caller hangs") {
            t.expect("task");
        }
    }
    // Cancelled attempts are cleaned up in the background: every key ends up free.
    let locks2 = locks.clone();
    let free = wait_for_async(Duration::from_secs(10), move || {
        let locks = locks2.clone();
        futures::executor::block_on(async move {
            let mut all_free = true;
            for t in 0..32 {
                match locks.lock(&format!("cancel:{t}")).try_acquire().await {
                    Ok(Some(g)) => {
                        g.release().await.expect("release");
                    }
                    _ => all_free = false,
                }
            }
            all_free
        })
    })
    .await;
    assert!(free, "an orphan lease was left by a cancelled caller");
    // And sequential calls still go through at once.
    for n in 0..200 {
        let g = tokio::time::timeout(
            Duration::from_secs(5),
            locks.lock(&format!("after:{n}")).acquire(),
        )
        .await
        .expect("the queue is not stuck")
        .expect("acquire");
        g.release().await.expect("release");
    }
}

/// A caller that stops polling its future holds up only its own request: here a stream of
/// acquires is left half-consumed (its in-flight futures are alive but no longer polled)
/// while the same manager serves another call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpolled_future_does_not_hold_up_other_callers() {
    use futures::StreamExt;
    let srv = RedisServer::start();
    let locks = manager(&srv).await;
    let mut stream = futures::stream::iter(0..32)
        .map(|i| {
            let lock = locks.lock(&format!("stalled:{i}"));
            async move { lock.try_acquire().await }
        })
        .buffer_unordered(32);
    let first = stream.next().await.expect("an item").expect("acquire");
    assert!(first.is_some());
    // `stream` is not polled again until the end of the test.
    for n in 0..20 {
        let other = tokio::time::timeout(
            Duration::from_secs(5),
            locks.lock(&format!("other:{n}")).try_acquire(),
        )
        .await
        .expect("another caller is served while the stream sits unpolled");
        other
            .expect("acquire")
            .expect("free")
            .release()
            .await
            .expect("release");
    }
    drop(stream);
}

/// The server dies while calls are queued for a shared script call: every caller gets an
/// answer (an error) within the command timeout instead of hanging, and once the server is
/// back the same connection batches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_fail_promptly_when_the_server_dies_and_work_after_restart() {
    let mut srv = RedisServer::start();
    let opts = redlease::RedisOptions::new()
        .command_timeout(Duration::from_millis(200))
        .connect_timeout(Duration::from_millis(300));
    let backend = RedisBackend::connect_with(&srv.url(), opts)
        .await
        .expect("connect");
    let locks = LockManager::new(backend);
    srv.kill();
    let calls = (0..64).map(|i| {
        let lock = locks.lock(&format!("outage:{i}"));
        async move { lock.try_acquire().await }
    });
    let answers = tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(calls))
        .await
        .expect("no queued caller hangs while the server is down");
    assert!(
        answers.iter().all(|a| a.is_err()),
        "a call succeeded with no server"
    );
    srv.restart();
    let mut ok = false;
    for _ in 0..100 {
        let calls = (0..64).map(|i| {
            let lock = locks.lock(&format!("after-outage:{i}"));
            async move { lock.try_acquire().await }
        });
        let answers = futures::future::join_all(calls).await;
        if answers.iter().all(|a| matches!(a, Ok(Some(_)))) {
            ok = true;
            break;
        }
        support::sleep_async(Duration::from_millis(50)).await; // reconnect back-off
    }
    assert!(ok, "batched calls did not recover after the restart");
}
