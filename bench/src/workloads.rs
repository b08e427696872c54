//! The workloads W1–W5 (see bench/README.md).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::libs::{Clients, ClusterClients, Lib};
use crate::server::RedisServer;
use crate::stats;

/// W1: one task, sequential cycles on rotating keys (`same`: on one key, each cycle taking
/// the key its last one let go). Returns cycles per second.
pub async fn w1(clients: &Clients, lib: Lib, dur: Duration, same: bool) -> f64 {
    let began = Instant::now();
    let mut n = 0u64;
    let keys = if same { 1 } else { 1024 };
    while began.elapsed() < dur {
        clients.cycle(lib, &format!("w1:{}", n % keys), same).await;
        n += 1;
    }
    n as f64 / began.elapsed().as_secs_f64()
}

/// W2: 64 tasks on distinct keys sharing one set of clients (`same`: each task on one key of
/// its own, re-taking it every cycle). Returns cycles per second.
pub async fn w2(clients: &Clients, lib: Lib, dur: Duration, same: bool) -> f64 {
    let keys = if same { 1 } else { 64 };
    let clients = clients.clone();
    sixty_four_tasks(dur, move |t, n| {
        let clients = clients.clone();
        async move {
            clients
                .cycle(lib, &format!("w2:{t}:{}", n % keys), same)
                .await
        }
    })
    .await
}

/// W7: W2's shape (64 tasks, distinct keys, one shared client) on a Redis Cluster. Returns
/// cycles per second.
pub async fn w7(clients: &ClusterClients, lib: Lib, dur: Duration) -> f64 {
    let clients = clients.clone();
    sixty_four_tasks(dur, move |t, n| {
        let clients = clients.clone();
        async move { clients.cycle(lib, &format!("w7:{t}:{}", n % 64)).await }
    })
    .await
}

/// W7's hand-off: `n` times, one manager holds a lock (a new name each time, so over every
/// shard) while a second manager's `acquire()` waits on it (woken by the release's message:
/// its fallback re-check is 5 s away); the time from the release call to the waiter's guard.
pub async fn w7_handoff(url: &str, n: usize) -> Vec<Duration> {
    let manager = |retry: redlease::RetryPolicy| async move {
        let backend = redlease::RedisBackend::connect(url)
            .await
            .expect("redlease connects");
        let opts = redlease::LockOptions::new()
            .ttl(Duration::from_secs(10))
            .retry(retry);
        redlease::LockManager::with_options(backend, opts).expect("options")
    };
    let holder = manager(redlease::RetryPolicy::default()).await;
    let slow = Duration::from_secs(5);
    let waiter = manager(
        redlease::RetryPolicy::notify()
            .min_delay(slow)
            .max_delay(slow),
    )
    .await;
    let mut gaps = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("w7h:{i}:{}", rand::random::<u32>());
        let held = holder
            .lock(&name)
            .try_acquire()
            .await
            .expect("acquire")
            .expect("free");
        let lock = waiter.lock(&name);
        let waiting = tokio::spawn(async move {
            let g = lock.acquire().await.expect("the waiter's acquire");
            (Instant::now(), g)
        });
        // Time for the waiter's first attempt and subscription.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let released = Instant::now();
        held.release().await.expect("release");
        let (got, g) = waiting.await.expect("waiter task");
        gaps.push(got.saturating_duration_since(released));
        g.release().await.expect("release");
    }
    gaps
}

/// 64 tasks each running `cycle(task, n)` for n = 0, 1, ... until `dur` has passed; cycles
/// per second, all tasks together.
async fn sixty_four_tasks<F, Fut>(dur: Duration, cycle: F) -> f64
where
    F: Fn(u64, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let began = Instant::now();
    let tasks: Vec<_> = (0..64u64)
        .map(|t| {
            let (cycle, done) = (cycle.clone(), done.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while began.elapsed() < dur {
                    cycle(t, n).await;
                    n += 1;
                }
                done.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("a task of 64");
    }
    done.load(Ordering::Relaxed) as f64 / began.elapsed().as_secs_f64()
}

/// What W3 measures.
#[derive(Debug, Default)]
pub struct Contended {
    pub acquisitions: u64,
    pub throughput: f64,
    pub gap_p50: Duration,
    pub gap_p99: Duration,
    pub wait_p50: Duration,
    pub wait_p99: Duration,
    pub wait_max: Duration,
    /// How long the "1 ms" hold really took (timer granularity and scheduling): with strict
    /// FIFO every waiter waits for the 15 others' holds and hand-offs.
    pub hold_p50: Duration,
    /// max/min acquisitions per task when the first task reached its quota.
    pub fairness: (u64, u64),
    pub same_task_share: f64,
    pub redis_cpu_us_per_acq: f64,
    pub violations: usize,
}

/// W3: 16 tasks on one key, each holding 1 ms, until the first task reaches `quota` or
/// `cap` passes. `clients` are one set per task group (4 groups, like 4 processes).
pub async fn w3(
    groups: &[Clients],
    lib: Lib,
    srv: &RedisServer,
    quota: u64,
    cap: Duration,
) -> Contended {
    const TASKS: usize = 16;
    let key = format!("w3:{lib:?}:{}", rand::random::<u32>());
    let counts: Arc<Vec<AtomicU64>> = Arc::new((0..TASKS).map(|_| AtomicU64::new(0)).collect());
    let inside = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let last_holder = Arc::new(AtomicUsize::new(usize::MAX));
    let same = Arc::new(AtomicU64::new(0));
    let last_release = Arc::new(Mutex::new(None::<Instant>));
    let waits = Arc::new(Mutex::new(Vec::new()));
    let gaps = Arc::new(Mutex::new(Vec::new()));
    let holds = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let snapshot = Arc::new(Mutex::new(None::<(u64, u64)>));
    let cpu_before = redis_cpu(srv);
    let began = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|me| {
            let clients = groups[me % groups.len()].clone();
            let key = key.clone();
            let (counts, inside, violations) = (counts.clone(), inside.clone(), violations.clone());
            let (last_holder, same, last_release) =
                (last_holder.clone(), same.clone(), last_release.clone());
            let (waits, gaps, stop, snapshot) =
                (waits.clone(), gaps.clone(), stop.clone(), snapshot.clone());
            let holds = holds.clone();
            tokio::spawn(async move {
                let mut last_fence = 0;
                while !stop.load(Ordering::Relaxed) && began.elapsed() < cap {
                    let asked = Instant::now();
                    let held = match tokio::time::timeout(
                        cap.saturating_sub(began.elapsed()),
                        clients.acquire_waiting(lib, &key),
                    )
                    .await
                    {
                        Ok(h) => h,
                        Err(_) => break,
                    };
                    let got = Instant::now();
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    if let Some(f) = held.fencing_token() {
                        if f <= last_fence {
                            violations.fetch_add(1, Ordering::SeqCst);
                        }
                        last_fence = f;
                    }
                    waits.lock().unwrap().push(got - asked);
                    if let Some(released) = *last_release.lock().unwrap() {
                        if released >= asked {
                            gaps.lock()
                                .unwrap()
                                .push(got.saturating_duration_since(released));
                        }
                    }
                    if last_holder.swap(me, Ordering::SeqCst) == me {
                        same.fetch_add(1, Ordering::Relaxed);
                    }
                    let n = counts[me].fetch_add(1, Ordering::SeqCst) + 1;
                    // 1 ms of work that needs no CPU, timed by the OS (tokio's timer rounds a
                    // 1 ms sleep up to about 2 ms); the worker is handed off meanwhile.
                    tokio::task::block_in_place(|| std::thread::sleep(Duration::from_millis(1)));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    let released = Instant::now();
                    holds.lock().unwrap().push(released - got);
                    *last_release.lock().unwrap() = Some(released);
                    held.release().await;
                    if n >= quota {
                        let mut snap = snapshot.lock().unwrap();
                        if snap.is_none() {
                            let all: Vec<u64> =
                                counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
                            *snap = Some((*all.iter().max().unwrap(), *all.iter().min().unwrap()));
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("w3 task");
    }
    let elapsed = began.elapsed();
    let total: u64 = counts.iter().map(|c| c.load(Ordering::SeqCst)).sum();
    let cpu = redis_cpu(srv) - cpu_before;
    let mut waits = std::mem::take(&mut *waits.lock().unwrap());
    let mut gaps = std::mem::take(&mut *gaps.lock().unwrap());
    let mut holds = std::mem::take(&mut *holds.lock().unwrap());
    let fairness = snapshot.lock().unwrap().unwrap_or_else(|| {
        let all: Vec<u64> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        (*all.iter().max().unwrap(), *all.iter().min().unwrap())
    });
    Contended {
        acquisitions: total,
        throughput: total as f64 / elapsed.as_secs_f64(),
        gap_p50: stats::quantile(&mut gaps, 0.5),
        gap_p99: stats::quantile(&mut gaps, 0.99),
        wait_p50: stats::quantile(&mut waits, 0.5),
        wait_p99: stats::quantile(&mut waits, 0.99),
        wait_max: stats::quantile(&mut waits, 1.0),
        hold_p50: stats::quantile(&mut holds, 0.5),
        fairness,
        same_task_share: same.load(Ordering::Relaxed) as f64 / total.max(1) as f64,
        redis_cpu_us_per_acq: cpu * 1e6 / total.max(1) as f64,
        violations: violations.load(Ordering::SeqCst),
    }
}

/// Redis server CPU seconds (user + system) so far.
pub fn redis_cpu(srv: &RedisServer) -> f64 {
    let f = |k| {
        srv.info_field("cpu", k)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    f("used_cpu_user") + f("used_cpu_sys")
}

/// What W5 measures.
#[derive(Debug)]
pub struct Held {
    pub leases: usize,
    pub acquire_time: Duration,
    pub bytes_per_lease: f64,
    pub client_cpu_share: f64,
    pub scripts_per_sec: f64,
    pub redis_cpu_share: f64,
    pub rounds: u64,
    pub lost: usize,
}

/// W5: `n` leases held at once under the watchdog (ttl `ttl`, extended every ttl/3) for
/// `window`.
pub async fn w5(url: &str, srv: &RedisServer, n: usize, ttl: Duration, window: Duration) -> Held {
    let backend = redlease::RedisBackend::connect(url).await.expect("connect");
    let locks = redlease::LockManager::with_options(backend, redlease::LockOptions::new().ttl(ttl))
        .expect("opts");
    let rss_before = stats::rss_bytes();
    let began = Instant::now();
    let mut guards = Vec::with_capacity(n);
    let run: u32 = rand::random();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let batch = futures::future::join_all(chunk.iter().map(|i| {
            let lock = locks.lock(&format!("w5:{run}:{i}"));
            async move { lock.try_acquire().await.expect("acquire").expect("free") }
        }))
        .await;
        guards.extend(batch);
    }
    let acquire_time = began.elapsed();
    let rss_after = stats::rss_bytes();
    let (cpu0, calls0, rcpu0, rounds0) = (
        stats::process_cpu(),
        srv.script_calls(),
        redis_cpu(srv),
        locks.watchdog_stats().rounds,
    );
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let wall = t0.elapsed().as_secs_f64();
    let (cpu1, calls1, rcpu1, rounds1) = (
        stats::process_cpu(),
        srv.script_calls(),
        redis_cpu(srv),
        locks.watchdog_stats().rounds,
    );
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    for g in guards {
        g.forget();
    }
    Held {
        leases: n,
        acquire_time,
        bytes_per_lease: rss_after.saturating_sub(rss_before) as f64 / n as f64,
        client_cpu_share: (cpu1 - cpu0) / wall,
        scripts_per_sec: (calls1 - calls0) as f64 / wall,
        redis_cpu_share: (rcpu1 - rcpu0) / wall,
        rounds: rounds1 - rounds0,
        lost,
    }
}

/// What W6 measures.
pub struct Idle {
    pub waiters: usize,
    pub commands_per_sec: f64,
    pub client_cpu_share: f64,
    pub redis_cpu_share: f64,
    /// From the holder's release until every waiter had the lock once (one after another).
    pub drained: Duration,
}

/// W6: `n` tasks in one process wait on one lock held by another client, idle for `window`;
/// then the holder lets go and each waiter takes the lock once, in turn.
pub async fn w6(url: &str, srv: &RedisServer, n: usize, window: Duration) -> Idle {
    let manager = || async {
        let backend = redlease::RedisBackend::connect(url).await.expect("connect");
        redlease::LockManager::with_options(backend, redlease::LockOptions::new()).expect("opts")
    };
    let (holder, waiters) = (manager().await, manager().await);
    let name = format!("w6:{}", rand::random::<u32>());
    let held = holder.lock(&name).acquire().await.expect("acquire");
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let lock = waiters.lock(&name);
            tokio::spawn(async move {
                let g = lock.acquire().await.expect("acquire");
                g.release().await.expect("release");
            })
        })
        .collect();
    // Until the waiters' first attempts are over: a half second with few commands.
    let settle = Instant::now();
    loop {
        let before = srv.total_commands();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if srv.total_commands() - before < 100 || settle.elapsed() > Duration::from_secs(30) {
            break;
        }
    }
    let (cpu0, cmd0, rcpu0) = (stats::process_cpu(), srv.total_commands(), redis_cpu(srv));
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let wall = t0.elapsed().as_secs_f64();
    let (cpu1, cmd1, rcpu1) = (stats::process_cpu(), srv.total_commands(), redis_cpu(srv));
    let released = Instant::now();
    held.release().await.expect("release");
    for t in tasks {
        t.await.expect("waiter");
    }
    Idle {
        waiters: n,
        commands_per_sec: (cmd1 - cmd0) as f64 / wall,
        client_cpu_share: (cpu1 - cpu0) / wall,
        redis_cpu_share: (rcpu1 - rcpu0) / wall,
        drained: released.elapsed(),
    }
}

/// W4 for rslock over `urls`: W1 and W2 shapes. Returns cycles/s; `None` if a cycle stalled
/// past `stall`.
pub async fn w4_rslock(
    urls: &[String],
    shape_tasks: usize,
    dur: Duration,
    stall: Duration,
) -> Option<f64> {
    let lm = rslock::LockManager::new(urls.to_vec());
    let done = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(AtomicBool::new(false));
    let began = Instant::now();
    let tasks: Vec<_> = (0..shape_tasks)
        .map(|t| {
            let (lm, done, stalled) = (lm.clone(), done.clone(), stalled.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while began.elapsed() < dur && !stalled.load(Ordering::Relaxed) {
                    let key = format!("w4:{t}:{}", n % 64);
                    let cycle = async {
                        let lock = lm
                            .lock(key.as_bytes(), crate::libs::TTL)
                            .await
                            .expect("rslock lock");
                        lm.unlock(&lock).await;
                    };
                    if tokio::time::timeout(stall, cycle).await.is_err() {
                        stalled.store(true, Ordering::Relaxed);
                        return;
                    }
                    n += 1;
                }
                done.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("w4 task");
    }
    if stalled.load(Ordering::Relaxed) {
        return None;
    }
    Some(done.load(Ordering::Relaxed) as f64 / began.elapsed().as_secs_f64())
}

/// W4 for redlease's Redlock over `urls`, one manager shared by `shape_tasks` tasks, like
/// rslock's one `LockManager`. `drop_release`: release by dropping the guard. Returns
/// cycles/s and acquire latency p50/p99; `None` if a cycle stalled past `stall`.
pub async fn w4_redlease(
    locks: &redlease::LockManager,
    shape_tasks: usize,
    dur: Duration,
    stall: Duration,
    drop_release: bool,
) -> Option<(f64, Duration, Duration)> {
    let done = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(AtomicBool::new(false));
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let began = Instant::now();
    let tasks: Vec<_> = (0..shape_tasks)
        .map(|t| {
            let (locks, done, stalled, latencies) = (
                locks.clone(),
                done.clone(),
                stalled.clone(),
                latencies.clone(),
            );
            tokio::spawn(async move {
                let mut n = 0u64;
                let mut mine = Vec::new();
                while began.elapsed() < dur && !stalled.load(Ordering::Relaxed) {
                    let key = format!("w4:{t}:{}", n % 64);
                    let cycle = async {
                        let t0 = Instant::now();
                        let g = locks
                            .lock(&key)
                            .try_acquire()
                            .await
                            .expect("redlock acquire")
                            .expect("free key");
                        let took = t0.elapsed();
                        if drop_release {
                            drop(g);
                        } else {
                            g.release().await.expect("redlock release");
                        }
                        took
                    };
                    match tokio::time::timeout(stall, cycle).await {
                        Ok(took) => mine.push(took),
                        Err(_) => {
                            stalled.store(true, Ordering::Relaxed);
                            return;
                        }
                    }
                    n += 1;
                }
                done.fetch_add(n, Ordering::Relaxed);
                latencies.lock().expect("latencies").extend(mine);
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("w4 task");
    }
    if stalled.load(Ordering::Relaxed) {
        return None;
    }
    let mut lat = std::mem::take(&mut *latencies.lock().expect("latencies"));
    let rate = done.load(Ordering::Relaxed) as f64 / began.elapsed().as_secs_f64();
    Some((
        rate,
        stats::quantile(&mut lat, 0.50),
        stats::quantile(&mut lat, 0.99),
    ))
}
