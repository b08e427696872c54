//! A worker process's workload: a few tasks, each looping over seeded critical sections of
//! every lock kind the store serves, on a few names per kind, recording each section
//! ([`crate::record`]) and ending each exclusive one with a fenced write to a server the
//! nemesis never faults.
//!
//! Names ([`NAMES`] per kind): `plain:N` (plain locks, and the names multi locks take two or
//! three adjacent ones of, so a multi lock excludes plain holders too), `fair:N`, `re:N`
//! (reentrant: a nested hold inside each reign), `sem:N` (semaphores of [`PERMITS`]), `rw:N`
//! (reads and writes).
//! TTLs are 300 ms, 500 ms or 1 s with the watchdog on; sections last 0–20 ms, and one in 50
//! outlasts its TTL (1.2–2 TTLs) so that the watchdog must extend it.
//!
//! Every exclusive holder writes at the end of its section, even one that `lost()` told it
//! is no longer safe, so that the fenced resource's refusal of stale writes is exercised on
//! every late holder.
//!
//! The *mutant* worker (`--mutant`) is what the checker must catch: the watchdog off, one
//! section in three longer than its TTL, and `lost()` and the validity end ignored (its
//! records claim every hold valid until its exit).

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlease::{
    FencedWrite, Lock, LockGuard, LockManager, LockOptions, MultiLock, Owner, RedisBackend,
    RedisOptions, Redlock, RedlockOptions, ReplicaAck, Transport,
};

use crate::record::{instant_ns, mono_ns, FenceWrite, Kind, Recorder, Section};

/// Names per lock kind.
pub const NAMES: usize = 4;
/// Permits of each semaphore.
pub const PERMITS: u32 = 2;
/// The longest TTL a section takes (see [`TTLS`]).
pub const LONGEST_TTL: Duration = Duration::from_millis(1000);
/// The TTLs a section picks from, ms.
const TTLS: [u64; 3] = [300, 500, 1000];
/// How long an acquire waits before it gives up (and the task tries another section).
const WAIT: Duration = Duration::from_secs(5);
/// The Redlock deployment's longest lease and restart quarantine (short, for a test).
pub const REDLOCK_MAX_LEASE: Duration = Duration::from_secs(2);

/// What a worker process is told by the harness: the `worker` subcommand's arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerConfig {
    /// The worker's number.
    #[arg(long)]
    pub id: usize,
    /// The run's seed (each task's generator is seeded from it, the worker and the task).
    #[arg(long)]
    pub seed: u64,
    /// The lock store's URLs: one server (or a cluster's or Sentinel deployment's URL), or
    /// a Redlock's nodes.
    #[arg(long, value_delimiter = ',')]
    pub urls: Vec<String>,
    /// Whether `urls` are Redlock nodes.
    #[arg(long)]
    pub redlock: bool,
    /// How many replicas must acknowledge each grant and extension (0: `ReplicaAck::Off`).
    #[arg(long, default_value_t = 0)]
    pub replica_ack: u32,
    /// The restart quarantine, ms (`RedisOptions::restart_quarantine`; 0: none).
    #[arg(long, default_value_t = 0)]
    pub restart_quarantine_ms: u64,
    /// The fenced resource's server.
    #[arg(long)]
    pub fence_url: String,
    /// The record file.
    #[arg(long)]
    pub out: PathBuf,
    /// `CLOCK_MONOTONIC` ns at which to stop starting sections.
    #[arg(long)]
    pub until_ns: u64,
    /// Concurrent tasks in the worker.
    #[arg(long)]
    pub tasks: usize,
    /// Run the mutant workload (see the module docs).
    #[arg(long)]
    pub mutant: bool,
    /// Carry the lock store's commands over redis-rs (`Transport::RedisRs`), not fred.
    #[arg(long)]
    pub redis_rs: bool,
}

impl WorkerConfig {
    /// The `worker` subcommand's arguments that give this configuration.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "worker".to_string(),
            format!("--id={}", self.id),
            format!("--seed={}", self.seed),
            format!("--urls={}", self.urls.join(",")),
            format!("--replica-ack={}", self.replica_ack),
            format!("--restart-quarantine-ms={}", self.restart_quarantine_ms),
            format!("--fence-url={}", self.fence_url),
            format!("--out={}", self.out.display()),
            format!("--until-ns={}", self.until_ns),
            format!("--tasks={}", self.tasks),
        ];
        if self.redlock {
            a.push("--redlock".into());
        }
        if self.mutant {
            a.push("--mutant".into());
        }
        if self.redis_rs {
            a.push("--redis-rs".into());
        }
        a
    }
}

/// What a worker counted, printed as its last line.
#[derive(Clone, Debug, Default)]
pub struct WorkerStats {
    /// Sections recorded (a multi lock's names each count).
    pub sections: u64,
    /// Acquires that failed or timed out.
    pub acquire_errors: u64,
    /// Nested reentrant holds whose token differed from their reign's while the reign's
    /// guard was not lost.
    pub reentrant_mismatch: u64,
}

/// The lock kinds a task picks from, with weights.
#[derive(Clone, Copy, Debug)]
enum Pick {
    Plain,
    Fair,
    Reentrant,
    Multi,
    Permit,
    Read,
    Write,
}

struct Worker {
    cfg: WorkerConfig,
    locks: LockManager,
    fence: RedisBackend,
    rec: Mutex<Recorder>,
    stats: Mutex<WorkerStats>,
}

/// Runs a worker until `until_ns`; its stats.
///
/// # Errors
///
/// If the record file cannot be written or a store cannot be reached at the start.
pub async fn run(cfg: WorkerConfig) -> io::Result<WorkerStats> {
    let err = |e: redlease::Error| io::Error::other(e.to_string());
    let mut redis = RedisOptions::new().command_timeout(Duration::from_millis(500));
    if cfg.replica_ack > 0 {
        redis = redis.replica_ack(ReplicaAck::replicas(cfg.replica_ack));
    }
    redis = redis.restart_quarantine(Duration::from_millis(cfg.restart_quarantine_ms));
    if cfg.redis_rs {
        redis = redis.transport(Transport::RedisRs);
    }
    let defaults = LockOptions::new()
        .watchdog(!cfg.mutant)
        .wait_timeout(Some(WAIT));
    let locks = if cfg.redlock {
        let urls: Vec<&str> = cfg.urls.iter().map(String::as_str).collect();
        let options = RedlockOptions::new()
            .max_lease(REDLOCK_MAX_LEASE)
            .restart_quarantine(REDLOCK_MAX_LEASE);
        let store = Redlock::connect_with(&urls, redis, options)
            .await
            .map_err(err)?;
        LockManager::with_options(store, defaults).map_err(err)?
    } else {
        let store = RedisBackend::connect_with(&cfg.urls[0], redis)
            .await
            .map_err(err)?;
        LockManager::with_options(store, defaults).map_err(err)?
    };
    let fence = RedisBackend::connect(&cfg.fence_url).await.map_err(err)?;
    let worker = Arc::new(Worker {
        rec: Mutex::new(Recorder::create(&cfg.out)?),
        cfg,
        locks,
        fence,
        stats: Mutex::default(),
    });
    let tasks: Vec<_> = (0..worker.cfg.tasks)
        .map(|t| tokio::spawn(worker.clone().task(t)))
        .collect();
    for t in tasks {
        t.await.map_err(io::Error::other)??;
    }
    let stats = worker
        .stats
        .lock()
        .map_err(|_| io::Error::other("poisoned"))?;
    Ok(stats.clone())
}

impl Worker {
    async fn task(self: Arc<Self>, task: usize) -> io::Result<()> {
        let mut rng = StdRng::seed_from_u64(
            self.cfg.seed ^ ((self.cfg.id as u64) << 40) ^ ((task as u64) << 20),
        );
        let holder = format!("w{}.t{}", self.cfg.id, task);
        let picks: &[(Pick, u32)] = if self.cfg.redlock {
            &[(Pick::Plain, 3), (Pick::Reentrant, 1), (Pick::Multi, 1)]
        } else {
            &[
                (Pick::Plain, 3),
                (Pick::Fair, 1),
                (Pick::Reentrant, 1),
                (Pick::Multi, 1),
                (Pick::Permit, 2),
                (Pick::Read, 2),
                (Pick::Write, 1),
            ]
        };
        let total: u32 = picks.iter().map(|p| p.1).sum();
        let mut seq = 0u64;
        while mono_ns() < self.cfg.until_ns {
            let mut n = rng.random_range(0..total);
            let pick = picks
                .iter()
                .find(|p| {
                    if n < p.1 {
                        true
                    } else {
                        n -= p.1;
                        false
                    }
                })
                .map_or(Pick::Plain, |p| p.0);
            seq += 1;
            if let Err(e) = self.section(&mut rng, &holder, seq, pick).await {
                self.count(|s| s.acquire_errors += 1);
                if e.kind() != io::ErrorKind::TimedOut {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        Ok(())
    }

    fn count(&self, f: impl FnOnce(&mut WorkerStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }

    fn line(&self, line: &str) -> io::Result<()> {
        self.rec
            .lock()
            .map_err(|_| io::Error::other("recorder poisoned"))?
            .line(line)
    }

    /// One critical section of kind `pick`: acquire, record enter, work (racing `lost()`),
    /// fenced writes, record exit, release. An `Err` is an acquire that failed.
    async fn section(
        &self,
        rng: &mut StdRng,
        holder: &str,
        seq: u64,
        pick: Pick,
    ) -> io::Result<()> {
        let ttl = Duration::from_millis(TTLS[rng.random_range(0..TTLS.len())]);
        let long = if self.cfg.mutant {
            rng.random_ratio(1, 3)
        } else {
            rng.random_ratio(1, 50)
        };
        let work = if long {
            ttl.mul_f64(rng.random_range(1.2..2.0))
        } else {
            Duration::from_micros(rng.random_range(0..20_000))
        };
        let lock = |name: &str| -> io::Result<Lock> {
            self.locks
                .lock_with(name, |o| o.ttl(ttl))
                .map_err(|e| io::Error::other(e.to_string()))
        };
        let e = |e: redlease::Error| match e {
            redlease::Error::Timeout { .. } => io::Error::new(io::ErrorKind::TimedOut, "timeout"),
            e => io::Error::other(e.to_string()),
        };
        let owner = Owner::named(holder);
        let i = rng.random_range(0..NAMES);
        // The holds, each with its kind and name; the reentrant lock for the nested hold.
        let mut reentrant = None;
        let asked = mono_ns();
        let held: Vec<(Kind, String, LockGuard)> = match pick {
            Pick::Plain => {
                let name = format!("plain:{}", rng.random_range(0..NAMES));
                let g = lock(&name)?.acquire().await.map_err(e)?;
                vec![(Kind::Plain, name, g)]
            }
            Pick::Fair => {
                let name = format!("fair:{i}");
                let l = lock(&name)?.fair().map_err(e)?;
                vec![(Kind::Fair, name, l.acquire().await.map_err(e)?)]
            }
            Pick::Reentrant => {
                let name = format!("re:{i}");
                let l = lock(&name)?.reentrant(&owner).map_err(e)?;
                let g = l.acquire().await.map_err(e)?;
                reentrant = Some(l);
                vec![(Kind::Reentrant, name, g)]
            }
            Pick::Multi => {
                // Two or three adjacent plain names (wrapping), so sets overlap in part.
                let first = rng.random_range(0..NAMES);
                let names: Vec<String> = (0..rng.random_range(2..4))
                    .map(|k| format!("plain:{}", (first + k) % NAMES))
                    .collect();
                let locks = names
                    .iter()
                    .map(|n| lock(n))
                    .collect::<io::Result<Vec<_>>>()?;
                let g = MultiLock::of(locks).acquire().await.map_err(e)?;
                // The guards come in the global order of their keys: each names itself.
                g.into_guards()
                    .into_iter()
                    .map(|g| (Kind::Multi, g.name().to_string(), g))
                    .collect()
            }
            Pick::Permit => {
                let name = format!("sem:{i}");
                let s = lock(&name)?.semaphore(PERMITS).map_err(e)?;
                vec![(Kind::Permit(PERMITS), name, s.acquire().await.map_err(e)?)]
            }
            Pick::Read | Pick::Write => {
                let name = format!("rw:{i}");
                let rw = lock(&name)?.rw().map_err(e)?;
                if matches!(pick, Pick::Read) {
                    vec![(Kind::Read, name, rw.read().await.map_err(e)?)]
                } else {
                    vec![(Kind::Write, name, rw.write().await.map_err(e)?)]
                }
            }
        };
        let enter = mono_ns();
        let honest = !self.cfg.mutant;
        let mut sections: Vec<Section> = held
            .iter()
            .enumerate()
            .map(|(k, (kind, name, g))| Section {
                id: format!("{holder}.{seq}.{k}"),
                kind: *kind,
                name: name.clone(),
                holder: holder.to_string(),
                token: g.fencing_token(),
                asked,
                enter,
                valid_at_enter: honest.then(|| instant_ns(g.valid_until())),
                exit: None,
                valid_at_exit: None,
                lost: None,
                write: FenceWrite::None,
            })
            .collect();
        for s in &sections {
            self.line(&s.enter_line())?;
        }
        // The work: a nested hold for a reentrant reign, then a sleep, raced against lost().
        if let (Some(l), Some((_, _, outer))) = (&reentrant, held.first()) {
            let nested_at = mono_ns();
            if let Ok(inner) = l.acquire().await {
                // A nested hold shares its reign's token, unless the reign's lease was lost
                // (then the nested acquire began a new reign, and the outer guard says lost).
                if inner.fencing_token() != outer.fencing_token() {
                    let outer_lost = outer.is_lost();
                    if !outer_lost {
                        self.count(|s| s.reentrant_mismatch += 1);
                    }
                    eprintln!(
                        "{holder}.{seq}: nested reentrant hold of {} has token {} (reign {}, asked at {nested_at}, got at {}); outer lost: {outer_lost}, outer valid until {}",
                        outer.name(),
                        inner.fencing_token(),
                        outer.fencing_token(),
                        mono_ns(),
                        instant_ns(outer.valid_until())
                    );
                }
                drop(inner);
            }
        }
        let lost = futures::future::select_all(held.iter().map(|h| h.2.lost()));
        if honest {
            tokio::select! {
                _ = tokio::time::sleep(work) => {}
                _ = lost => {
                    let t = mono_ns();
                    for (s, h) in sections.iter_mut().zip(&held) {
                        if h.2.is_lost() {
                            s.lost = Some(t);
                        }
                    }
                }
            }
        } else {
            tokio::time::sleep(work).await;
        }
        // The fenced writes, one per exclusive hold.
        for (s, h) in sections.iter_mut().zip(&held) {
            if !s.kind.is_exclusive() {
                continue;
            }
            let start = mono_ns();
            let r = self
                .fence
                .fenced_set(
                    &format!("fence:{}", s.name),
                    s.id.clone(),
                    h.2.fencing_token(),
                )
                .await;
            let end = mono_ns();
            s.write = match r {
                Ok(FencedWrite::Applied) => FenceWrite::Accepted { start, end },
                Ok(FencedWrite::Rejected { newest }) => FenceWrite::Rejected { start, end, newest },
                Err(_) => FenceWrite::Failed,
            };
        }
        let exit = mono_ns();
        for (s, h) in sections.iter_mut().zip(&held) {
            s.exit = Some(exit);
            if honest {
                s.valid_at_exit = Some(instant_ns(h.2.valid_until()));
                if s.lost.is_none() && h.2.is_lost() {
                    s.lost = Some(exit);
                }
            }
            self.line(&s.exit_line())?;
        }
        self.count(|st| st.sections += sections.len() as u64);
        drop(held);
        Ok(())
    }
}
