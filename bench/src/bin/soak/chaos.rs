//! The fault injector: at random intervals it kills (SIGKILL) and restarts servers, pauses
//! them (SIGSTOP, then SIGCONT before one TTL has passed) and kills their client connections
//! (`CLIENT KILL TYPE normal` and `pubsub`), never taking more than `max_down` servers out
//! at once.
//!
//! It runs on threads of its own (the harness's calls block): one that picks the faults, and
//! one per kill or pause, which owns its server until the fault is over, so a restart that
//! takes long never stretches another server's pause.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::harness::server::RedisServer;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How a server comes back after a kill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comeback {
    /// With the data it had persisted (`--appendonly yes --appendfsync always`).
    Persisted,
    /// Empty (no persistence). Redlock's restart guard keeps it out of every majority for
    /// `warm_up`, so it counts as down until then.
    Empty { warm_up: Duration },
}

/// The faults, counted.
#[derive(Debug, Default)]
pub struct Counts {
    pub kills: AtomicU64,
    pub restarts: AtomicU64,
    pub pauses: AtomicU64,
    pub client_kills: AtomicU64,
    pub pubsub_kills: AtomicU64,
    /// Connections those two closed.
    pub connections_closed: AtomicU64,
    /// Kills and pauses not made because `max_down` servers were out already.
    pub skipped: AtomicU64,
    /// The longest pause, from SIGSTOP sent to SIGCONT sent, in µs.
    pub longest_pause_us: AtomicU64,
    /// The longest time a server was down (killed until it answered again), in µs.
    pub longest_down_us: AtomicU64,
    /// Harness calls that failed (a restart that did not come up, a CLIENT KILL that errored).
    pub harness_errors: AtomicU64,
}

/// One line of the timeline.
#[derive(Clone, Debug)]
pub struct Event {
    pub at: Instant,
    pub what: String,
}

#[derive(Debug)]
struct Node {
    server: Mutex<RedisServer>,
    /// A kill or pause is under way.
    busy: AtomicBool,
    /// Restarted empty: out of every majority until then.
    warm_until: Mutex<Option<Instant>>,
}

impl Node {
    fn out(&self, now: Instant) -> bool {
        self.busy.load(Ordering::SeqCst) || lock(&self.warm_until).is_some_and(|t| t > now)
    }
}

/// The injector's settings.
#[derive(Clone, Debug)]
pub struct Plan {
    pub comeback: Comeback,
    /// The most servers out (killed, paused or warming up) at once.
    pub max_down: usize,
    /// Time between two faults: uniform in this range.
    pub gap: (Duration, Duration),
    /// How long a killed server stays down before its restart: uniform in this range.
    pub down: (Duration, Duration),
    /// How long a pause lasts: uniform in this range (its top below the TTL).
    pub pause: (Duration, Duration),
    /// Shares of kill, pause, CLIENT KILL normal and CLIENT KILL pubsub (weights).
    pub weights: [u32; 4],
}

/// The injector of one run.
#[derive(Debug)]
pub struct Chaos {
    nodes: Vec<Arc<Node>>,
    plan: Plan,
    pub counts: Counts,
    events: Mutex<Vec<Event>>,
    verbose: bool,
    start: Instant,
}

impl Chaos {
    pub fn new(servers: Vec<RedisServer>, plan: Plan, start: Instant, verbose: bool) -> Arc<Chaos> {
        Arc::new(Chaos {
            nodes: servers
                .into_iter()
                .map(|s| {
                    Arc::new(Node {
                        server: Mutex::new(s),
                        busy: AtomicBool::new(false),
                        warm_until: Mutex::new(None),
                    })
                })
                .collect(),
            plan,
            counts: Counts::default(),
            events: Mutex::new(Vec::new()),
            verbose,
            start,
        })
    }

    pub fn events(&self) -> Vec<Event> {
        lock(&self.events).clone()
    }

    fn note(&self, what: String) {
        let at = Instant::now();
        if self.verbose {
            eprintln!(
                "{:>9.3} s  {what}",
                at.duration_since(self.start).as_secs_f64()
            );
        }
        lock(&self.events).push(Event { at, what });
    }

    /// Starts injecting until `stop` is set; the handle returns once every server is up again.
    pub fn spawn(self: &Arc<Self>, stop: Arc<AtomicBool>, seed: u64) -> JoinHandle<()> {
        let me = self.clone();
        std::thread::spawn(move || me.run(&stop, seed))
    }

    fn run(self: Arc<Self>, stop: &AtomicBool, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut faults: Vec<JoinHandle<()>> = Vec::new();
        let total: u32 = self.plan.weights.iter().sum();
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(between(&mut rng, self.plan.gap));
            if stop.load(Ordering::SeqCst) {
                break;
            }
            faults.retain(|h| !h.is_finished());
            let mut pick = rng.random_range(0..total);
            let kind = self
                .plan
                .weights
                .iter()
                .position(|&w| {
                    let hit = pick < w;
                    pick = pick.saturating_sub(w);
                    hit
                })
                .unwrap_or(0);
            let now = Instant::now();
            let up: Vec<usize> = (0..self.nodes.len())
                .filter(|&i| !self.nodes[i].out(now))
                .collect();
            match kind {
                0 | 1 => {
                    let out = self.nodes.len() - up.len();
                    if out >= self.plan.max_down || up.is_empty() {
                        self.counts.skipped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let i = up[rng.random_range(0..up.len())];
                    self.nodes[i].busy.store(true, Ordering::SeqCst);
                    let (me, seed) = (self.clone(), rng.random::<u64>());
                    faults.push(std::thread::spawn(move || {
                        let mut rng = StdRng::seed_from_u64(seed);
                        if kind == 0 {
                            me.kill_and_restart(i, between(&mut rng, me.plan.down));
                        } else {
                            me.pause(i, between(&mut rng, me.plan.pause));
                        }
                        me.nodes[i].busy.store(false, Ordering::SeqCst);
                    }));
                }
                _ => {
                    // Connections of any server that is running and not paused (a warming
                    // one too).
                    let live: Vec<usize> = (0..self.nodes.len())
                        .filter(|&i| !self.nodes[i].busy.load(Ordering::SeqCst))
                        .collect();
                    if live.is_empty() {
                        self.counts.skipped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let i = live[rng.random_range(0..live.len())];
                    let Ok(server) = self.nodes[i].server.try_lock() else {
                        self.counts.skipped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let kind = if kind == 2 { "normal" } else { "pubsub" };
                    match server
                        .cmd_timeout(&["CLIENT", "KILL", "TYPE", kind], Duration::from_secs(1))
                    {
                        Ok(reply) if reply.as_int().is_some() => {
                            let n = reply.as_int().unwrap_or(0);
                            drop(server);
                            let counter = if kind == "normal" {
                                &self.counts.client_kills
                            } else {
                                &self.counts.pubsub_kills
                            };
                            counter.fetch_add(1, Ordering::Relaxed);
                            self.counts
                                .connections_closed
                                .fetch_add(n.max(0) as u64, Ordering::Relaxed);
                            self.note(format!("node {i}: CLIENT KILL TYPE {kind}: {n} closed"));
                        }
                        other => {
                            drop(server);
                            self.counts.harness_errors.fetch_add(1, Ordering::Relaxed);
                            self.note(format!(
                                "node {i}: CLIENT KILL TYPE {kind} failed: {other:?}"
                            ));
                        }
                    }
                }
            }
        }
        for h in faults {
            let _ = h.join();
        }
        // Every server up again (a restart that panicked is tried once more).
        for (i, node) in self.nodes.iter().enumerate() {
            let mut server = lock(&node.server);
            if !server.is_running() {
                let again = catch_unwind(AssertUnwindSafe(|| server.restart_keeping_data()));
                self.note(format!(
                    "node {i}: restarted at the end: {:?}",
                    again.is_ok()
                ));
            }
        }
    }

    fn kill_and_restart(&self, i: usize, down: Duration) {
        let node = &self.nodes[i];
        let mut server = lock(&node.server);
        let pid = server.pid();
        server.kill();
        let killed = Instant::now();
        self.counts.kills.fetch_add(1, Ordering::Relaxed);
        self.note(format!("node {i}: SIGKILL (pid {pid}), down for {down:?}"));
        std::thread::sleep(down);
        let persisted = self.plan.comeback == Comeback::Persisted;
        let restarted = catch_unwind(AssertUnwindSafe(|| {
            if persisted {
                server.restart_keeping_data();
            } else {
                server.restart();
            }
        }));
        let was_down = killed.elapsed();
        fetch_max(&self.counts.longest_down_us, was_down);
        match restarted {
            Ok(()) => {
                self.counts.restarts.fetch_add(1, Ordering::Relaxed);
                if let Comeback::Empty { warm_up } = self.plan.comeback {
                    *lock(&node.warm_until) = Some(Instant::now() + warm_up);
                }
                self.note(format!(
                    "node {i}: restarted {} (pid {}), down {:.0} ms",
                    if persisted { "from its AOF" } else { "empty" },
                    server.pid(),
                    was_down.as_secs_f64() * 1e3
                ));
            }
            Err(_) => {
                self.counts.harness_errors.fetch_add(1, Ordering::Relaxed);
                self.note(format!("node {i}: restart failed"));
            }
        }
    }

    fn pause(&self, i: usize, d: Duration) {
        let server = lock(&self.nodes[i].server);
        // From before SIGSTOP is sent to after SIGCONT is: the longest it can have lasted.
        let t0 = Instant::now();
        let stopped = catch_unwind(AssertUnwindSafe(|| server.pause()));
        if stopped.is_err() {
            self.counts.harness_errors.fetch_add(1, Ordering::Relaxed);
            self.note(format!("node {i}: SIGSTOP failed"));
            return;
        }
        self.counts.pauses.fetch_add(1, Ordering::Relaxed);
        self.note(format!("node {i}: SIGSTOP for {d:?}"));
        std::thread::sleep(d);
        let resumed = catch_unwind(AssertUnwindSafe(|| server.resume()));
        let paused = t0.elapsed();
        fetch_max(&self.counts.longest_pause_us, paused);
        if resumed.is_err() {
            self.counts.harness_errors.fetch_add(1, Ordering::Relaxed);
        }
        self.note(format!(
            "node {i}: SIGCONT after {:.0} ms",
            paused.as_secs_f64() * 1e3
        ));
    }
}

fn between(rng: &mut StdRng, (lo, hi): (Duration, Duration)) -> Duration {
    if hi <= lo {
        return lo;
    }
    Duration::from_micros(rng.random_range(lo.as_micros() as u64..=hi.as_micros() as u64))
}

fn fetch_max(a: &AtomicU64, d: Duration) {
    a.fetch_max(d.as_micros() as u64, Ordering::Relaxed);
}
