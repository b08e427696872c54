//! The workloads W1–W9 (see bench/README.md).

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
    /// CPU of the store's server (Redis, or PostgreSQL's or etcd's processes).
    pub redis_cpu_us_per_acq: f64,
    pub violations: usize,
}

/// W3: 16 tasks on one key, each holding 1 ms, until the first task reaches `quota` or
/// `cap` passes. `clients` are one set per task group (4 groups, like 4 processes);
/// `server_cpu` reads the CPU seconds of the server `lib` runs on.
pub async fn w3(
    groups: &[Clients],
    lib: Lib,
    server_cpu: &(dyn Fn() -> f64 + Sync),
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
    let cpu_before = server_cpu();
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
    let cpu = server_cpu() - cpu_before;
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
    w5_churn(url, srv, n, Some(ttl), window, 0).await.0
}

/// W5 at scale: as [`w5`], while `tasks` tasks of the same manager acquire and release locks
/// of their own (16 rotating keys each) for the whole window; also returns the churn's
/// cycles per second. `ttl` `None`: the held leases are not extended (a 10-minute TTL, the
/// watchdog off for them), to tell what the watchdog costs from what the store's size costs.
pub async fn w5_churn(
    url: &str,
    srv: &RedisServer,
    n: usize,
    ttl: Option<Duration>,
    window: Duration,
    tasks: usize,
) -> (Held, f64) {
    let backend = redlease::RedisBackend::connect(url).await.expect("connect");
    let held = match ttl {
        Some(ttl) => redlease::LockOptions::new().ttl(ttl),
        None => redlease::LockOptions::new()
            .ttl(Duration::from_secs(600))
            .watchdog(false),
    };
    let locks = redlease::LockManager::with_options(backend, held).expect("opts");
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
    let stop = Arc::new(AtomicBool::new(false));
    let churn: Vec<_> = (0..tasks)
        .map(|t| {
            let (locks, stop) = (locks.clone(), stop.clone());
            tokio::spawn(async move {
                let mut cycles = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let lock = locks.lock(&format!("w5c:{run}:{t}:{}", cycles % 16));
                    match lock.acquire().await {
                        Ok(g) => {
                            let _ = g.release().await;
                            cycles += 1;
                        }
                        Err(e) => eprintln!("W5 churn: {e}"),
                    }
                }
                cycles
            })
        })
        .collect();
    tokio::time::sleep(window).await;
    stop.store(true, Ordering::Relaxed);
    let wall = t0.elapsed().as_secs_f64();
    let mut cycles = 0;
    for c in churn {
        cycles += c.await.unwrap_or(0);
    }
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
    (
        Held {
            leases: n,
            acquire_time,
            bytes_per_lease: rss_after.saturating_sub(rss_before) as f64 / n as f64,
            client_cpu_share: (cpu1 - cpu0) / wall,
            scripts_per_sec: (calls1 - calls0) as f64 / wall,
            redis_cpu_share: (rcpu1 - rcpu0) / wall,
            rounds: rounds1 - rounds0,
            lost,
        },
        cycles as f64 / wall,
    )
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

/// Permits of W8's semaphore, and locks of its plain-lock row.
pub const W8_PERMITS: u32 = 8;

/// The rows of W8: 64 tasks, 8 holders at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum W8Row {
    /// `locks.semaphore(name, 8)`, `guard.release().await`.
    Semaphore,
    /// The same, `drop(guard)`.
    SemaphoreDrop,
    /// 8 plain locks, 8 tasks waiting on each (`acquire()`), explicit release.
    PlainLocks,
    /// The hand-written semaphore on fred (see [`crate::libs::SharedFloor`]).
    Floor,
}

impl W8Row {
    pub fn name(self) -> &'static str {
        match self {
            W8Row::Semaphore => "redlease semaphore(8) (explicit release)",
            W8Row::SemaphoreDrop => "redlease semaphore(8) (drop release)",
            W8Row::PlainLocks => "redlease, 8 plain locks × 8 tasks (explicit release)",
            W8Row::Floor => "floor by hand: fred, sorted-set script + PUBLISH",
        }
    }
}

/// What W8 and W9 measure for one row.
#[derive(Debug, Default)]
pub struct SharedRun {
    /// Acquisitions per second: permits (W8), or reads and writes (W9).
    pub rate: f64,
    pub writes_rate: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub write_p50: Duration,
    pub write_p99: Duration,
    pub write_max: Duration,
    /// Grants per task, most and fewest (W8); for W9, of the readers.
    pub fairness: (u64, u64),
    /// Most holders inside at once (W8: all; W9: readers).
    pub max_inside: usize,
    /// Too many inside at once (W8: more than 8, or 2 on one plain lock; W9: a write beside
    /// anything, or two reads on the exclusive lock).
    pub violations: usize,
    pub acquisitions: u64,
    /// Acquisitions that waited [`SLOW`] or more: a waiter that no release woke, found the
    /// lock by its fallback re-check (every 0.8–1 s).
    pub slow: usize,
    /// After the run, in the run's lock manager: from a release to the waiter it should wake
    /// (a lock of its own, the waiter in the same manager). About a round trip while the
    /// manager's wake-ups work; the fallback re-check (0.8–1 s) once they are lost. `None`
    /// for the floor.
    pub wake_after: Option<Duration>,
    /// Per acquisition, over the run's loop only (not the connections made for it, nor the
    /// check after it).
    pub cost: Cost,
}

/// Per acquisition: Redis CPU (µs), script calls, client CPU (µs).
#[derive(Debug, Default, Clone, Copy)]
pub struct Cost {
    pub redis_us: f64,
    pub scripts: f64,
    pub client_us: f64,
}

impl Cost {
    /// The counters now (as totals; see [`Cost::per`]).
    fn start(srv: &RedisServer) -> Cost {
        Cost {
            redis_us: redis_cpu(srv) * 1e6,
            scripts: srv.script_calls() as f64,
            client_us: stats::process_cpu() * 1e6,
        }
    }

    /// What has been spent since `self` was taken, per one of `n` acquisitions.
    fn per(self, srv: &RedisServer, n: u64) -> Cost {
        let now = Cost::start(srv);
        let n = n.max(1) as f64;
        Cost {
            redis_us: (now.redis_us - self.redis_us) / n,
            scripts: (now.scripts - self.scripts) / n,
            client_us: (now.client_us - self.client_us) / n,
        }
    }
}

/// After a run: one hand-off of a plain lock between two tasks of `manager` (see
/// [`SharedRun::wake_after`]).
async fn wake_check(manager: &redlease::LockManager, name: &str) -> Duration {
    let name = format!("{name}:wake-check");
    let held = manager
        .lock(&name)
        .try_acquire()
        .await
        .expect("acquire")
        .expect("free");
    let lock = manager.lock(&name);
    let waiting = tokio::spawn(async move {
        let g = lock.acquire().await.expect("the waiter's acquire");
        (Instant::now(), g)
    });
    // Time for the waiter's first attempt and subscription.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let released = Instant::now();
    held.release().await.expect("release");
    let (got, g) = waiting.await.expect("waiter task");
    g.release().await.expect("release");
    got.saturating_duration_since(released)
}

/// A wait this long suggests a missed wake-up (see [`SharedRun::slow`]).
pub const SLOW: Duration = Duration::from_millis(500);

/// How a W8/W9 task holds what it acquired.
enum Holding {
    Guard(redlease::LockGuard),
    Floor(String),
}

/// W8: 64 tasks on one semaphore of 8 permits (or the row's equivalent), one shared client
/// (a lock manager of its own, or the floor's connections, made for this run); each loops
/// acquire -> release with no work, until `dur` has passed.
pub async fn w8(url: &str, srv: &RedisServer, row: W8Row, dur: Duration) -> SharedRun {
    const TASKS: usize = 64;
    let name = format!("w8:{}", rand::random::<u32>());
    let manager = crate::libs::fresh_manager(url).await;
    let sem = manager.semaphore(&name, W8_PERMITS).expect("semaphore");
    let locks: Vec<redlease::Lock> = (0..W8_PERMITS)
        .map(|k| manager.lock(&format!("{name}:{k}")))
        .collect();
    let floor_sem = if row == W8Row::Floor {
        Some(
            crate::libs::SharedFloor::connect(url)
                .await
                .watch(&name)
                .await,
        )
    } else {
        None
    };
    // One slot of 8 (the semaphore), or 8 slots of 1 (the plain locks).
    let (slots, limit) = if row == W8Row::PlainLocks {
        (W8_PERMITS as usize, 1)
    } else {
        (1, W8_PERMITS as usize)
    };
    let inside: Arc<Vec<AtomicUsize>> = Arc::new((0..slots).map(|_| AtomicUsize::new(0)).collect());
    let all_inside = Arc::new(AtomicUsize::new(0));
    let max_inside = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let cost = Cost::start(srv);
    let began = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (sem, floor_sem) = (sem.clone(), floor_sem.clone());
            let lock = locks[t % locks.len()].clone();
            let (inside, all_inside, max_inside, violations) = (
                inside.clone(),
                all_inside.clone(),
                max_inside.clone(),
                violations.clone(),
            );
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let slot = &inside[t % inside.len()];
                while began.elapsed() < dur {
                    let t0 = Instant::now();
                    let held = match row {
                        W8Row::Semaphore | W8Row::SemaphoreDrop => {
                            Holding::Guard(sem.acquire().await.expect("permit"))
                        }
                        W8Row::PlainLocks => Holding::Guard(lock.acquire().await.expect("acquire")),
                        W8Row::Floor => Holding::Floor(
                            floor_sem
                                .as_ref()
                                .expect("the floor's row")
                                .acquire_permit(W8_PERMITS)
                                .await,
                        ),
                    };
                    lat.push(t0.elapsed());
                    if slot.fetch_add(1, Ordering::SeqCst) + 1 > limit {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    let n = all_inside.fetch_add(1, Ordering::SeqCst) + 1;
                    max_inside.fetch_max(n, Ordering::Relaxed);
                    all_inside.fetch_sub(1, Ordering::SeqCst);
                    slot.fetch_sub(1, Ordering::SeqCst);
                    match held {
                        Holding::Guard(g) if row == W8Row::SemaphoreDrop => drop(g),
                        Holding::Guard(g) => {
                            g.release().await.expect("release");
                        }
                        Holding::Floor(token) => {
                            let floor = floor_sem.as_ref().expect("the floor's row");
                            floor.release_permit(&token).await;
                        }
                    }
                }
                lat
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut per_task = Vec::new();
    for t in tasks {
        let mine = t.await.expect("w8 task");
        per_task.push(mine.len() as u64);
        lat.extend(mine);
    }
    let elapsed = began.elapsed();
    let cost = cost.per(srv, lat.len() as u64);
    let wake_after = match floor_sem {
        Some(floor) => {
            floor.close().await;
            None
        }
        None => Some(wake_check(&manager, &name).await),
    };
    let total = lat.len() as u64;
    let slow = lat.iter().filter(|l| **l >= SLOW).count();
    SharedRun {
        rate: total as f64 / elapsed.as_secs_f64(),
        p50: stats::quantile(&mut lat, 0.5),
        p99: stats::quantile(&mut lat, 0.99),
        max: stats::quantile(&mut lat, 1.0),
        fairness: (
            per_task.iter().copied().max().unwrap_or(0),
            per_task.iter().copied().min().unwrap_or(0),
        ),
        max_inside: max_inside.load(Ordering::Relaxed),
        violations: violations.load(Ordering::SeqCst),
        acquisitions: total,
        slow,
        wake_after,
        cost,
        ..SharedRun::default()
    }
}

/// The rows of W9: 63 readers and 1 writer on one name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum W9Row {
    /// `locks.rw(name)`: `read()` and `write()`, explicit release.
    RwLock,
    /// One plain lock that readers and the writer all take (`acquire()`), explicit release.
    Exclusive,
    /// The hand-written read-write lock on fred (see [`crate::libs::SharedFloor`]).
    Floor,
}

impl W9Row {
    pub fn name(self) -> &'static str {
        match self {
            W9Row::RwLock => "redlease rw() (explicit release)",
            W9Row::Exclusive => "redlease plain lock, reads exclusive too (explicit release)",
            W9Row::Floor => "floor by hand: fred, sorted set + SET NX + 2 flags + PUBLISH",
        }
    }
}

/// How long W9's reads and writes hold: a 1 ms sleep (1–2 ms by tokio's timer), no CPU.
pub const W9_SECTION: Duration = Duration::from_millis(1);

/// W9: 64 tasks on one name, one shared client: task 0 writes in a loop, the 63 others read
/// in a loop, each holding for [`W9_SECTION`], until `dur` has passed.
pub async fn w9(url: &str, srv: &RedisServer, row: W9Row, dur: Duration) -> SharedRun {
    const TASKS: usize = 64;
    let name = format!("w9:{}", rand::random::<u32>());
    let manager = crate::libs::fresh_manager(url).await;
    let rw = manager.rw(&name).expect("rw lock");
    let plain = manager.lock(&name);
    let floor_rw = if row == W9Row::Floor {
        Some(
            crate::libs::SharedFloor::connect(url)
                .await
                .watch(&name)
                .await,
        )
    } else {
        None
    };
    let readers = Arc::new(AtomicUsize::new(0));
    let writing = Arc::new(AtomicBool::new(false));
    let max_readers = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let cost = Cost::start(srv);
    let began = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (rw, plain, floor_rw) = (rw.clone(), plain.clone(), floor_rw.clone());
            let (readers, writing, max_readers, violations) = (
                readers.clone(),
                writing.clone(),
                max_readers.clone(),
                violations.clone(),
            );
            let writer = t == 0;
            tokio::spawn(async move {
                let mut lat = Vec::new();
                while began.elapsed() < dur {
                    let t0 = Instant::now();
                    let held = match (row, writer) {
                        (W9Row::RwLock, true) => Holding::Guard(rw.write().await.expect("write")),
                        (W9Row::RwLock, false) => Holding::Guard(rw.read().await.expect("read")),
                        (W9Row::Exclusive, _) => {
                            Holding::Guard(plain.acquire().await.expect("acquire"))
                        }
                        (W9Row::Floor, true) => {
                            Holding::Floor(floor_rw.as_ref().expect("floor").write().await)
                        }
                        (W9Row::Floor, false) => {
                            Holding::Floor(floor_rw.as_ref().expect("floor").read().await)
                        }
                    };
                    lat.push(t0.elapsed());
                    // Each side announces itself, then looks at the other (so that of two
                    // overlapping, at least one sees the other).
                    if writer {
                        writing.store(true, Ordering::SeqCst);
                        if readers.load(Ordering::SeqCst) > 0 {
                            violations.fetch_add(1, Ordering::SeqCst);
                        }
                    } else {
                        let n = readers.fetch_add(1, Ordering::SeqCst) + 1;
                        max_readers.fetch_max(n, Ordering::Relaxed);
                        if writing.load(Ordering::SeqCst) || (row == W9Row::Exclusive && n > 1) {
                            violations.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    tokio::time::sleep(W9_SECTION).await;
                    if writer {
                        writing.store(false, Ordering::SeqCst);
                    } else {
                        readers.fetch_sub(1, Ordering::SeqCst);
                    }
                    match held {
                        Holding::Guard(g) => {
                            g.release().await.expect("release");
                        }
                        Holding::Floor(token) => {
                            let floor = floor_rw.as_ref().expect("floor");
                            if writer {
                                floor.release_write(&token).await;
                            } else {
                                floor.release_read(&token).await;
                            }
                        }
                    }
                }
                lat
            })
        })
        .collect();
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    let mut per_reader = Vec::new();
    for (t, task) in tasks.into_iter().enumerate() {
        let mine = task.await.expect("w9 task");
        if t == 0 {
            writes = mine;
        } else {
            per_reader.push(mine.len() as u64);
            reads.extend(mine);
        }
    }
    let elapsed = began.elapsed().as_secs_f64();
    let cost = cost.per(srv, (reads.len() + writes.len()) as u64);
    let wake_after = match floor_rw {
        Some(floor) => {
            floor.close().await;
            None
        }
        None => Some(wake_check(&manager, &name).await),
    };
    let (r, w) = (reads.len() as u64, writes.len() as u64);
    let slow = reads.iter().chain(&writes).filter(|l| **l >= SLOW).count();
    SharedRun {
        rate: r as f64 / elapsed,
        writes_rate: w as f64 / elapsed,
        p50: stats::quantile(&mut reads, 0.5),
        p99: stats::quantile(&mut reads, 0.99),
        max: stats::quantile(&mut reads, 1.0),
        write_p50: stats::quantile(&mut writes, 0.5),
        write_p99: stats::quantile(&mut writes, 0.99),
        write_max: stats::quantile(&mut writes, 1.0),
        fairness: (
            per_reader.iter().copied().max().unwrap_or(0),
            per_reader.iter().copied().min().unwrap_or(0),
        ),
        max_inside: max_readers.load(Ordering::Relaxed),
        violations: violations.load(Ordering::SeqCst),
        acquisitions: r + w,
        slow,
        wake_after,
        cost,
    }
}
