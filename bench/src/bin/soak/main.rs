//! Soak: a chaos run beside the benchmark (not in CI). Four lock managers, each with its own
//! connections (as four processes), contend on a few lock names over one redis-server and
//! over Redlock on five, while servers are killed and restarted, paused for less than the TTL
//! and have their client connections killed. Every critical section is recorded; the report
//! says how many overlapped (must be 0), whether fencing tokens kept their order, how many
//! leases were lost and what faults were injected.
//!
//! ```text
//! cargo run --release -p redlease-bench --bin soak                  # both setups
//! cargo run --release -p redlease-bench --bin soak -- --single --sections 20000
//! cargo run --release -p redlease-bench --bin soak -- --redlock --seconds 120 --seed 7 --verbose
//! ```
//!
//! See bench/README.md ("Soak: chaos beside the benchmark") for what it checks and how the
//! setups are made.

#[allow(dead_code)] // the shared server harness has more than the soak uses
#[path = "../../harness.rs"]
mod harness;
#[allow(dead_code)]
#[path = "../../stats.rs"]
mod stats;

mod book;
mod chaos;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlease::{
    Error, Lock, LockManager, LockOptions, RedisBackend, RedisOptions, Redlock, RedlockOptions,
};

use book::{Book, Pair, Verdict};
use chaos::{Chaos, Comeback};
use harness::server::RedisServer;

const MANAGERS: usize = 4;
const TASKS: usize = 4;
const NAMES: usize = 4;
/// A short hold is uniform in 0..=5 ms.
const SHORT_HOLD_US: u64 = 5_000;

/// The two setups, each with the one setting its guarantee rests on. Turning that setting
/// off (`--no-aof`, `--no-restart-guard`) makes a control run: one the guarantees do not
/// cover, to show the soak does catch overlaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    /// One redis-server; `aof`: `appendonly yes`, `appendfsync always`, so that a killed
    /// server comes back with its leases. Without it, it comes back empty.
    Single { aof: bool },
    /// Redlock over five redis-servers without persistence; `guard`: the restart guard, which
    /// keeps a node that came back empty out of every majority for one lease time.
    Redlock { guard: bool },
}

impl Setup {
    fn control(self) -> bool {
        matches!(
            self,
            Setup::Single { aof: false } | Setup::Redlock { guard: false }
        )
    }

    fn title(self) -> &'static str {
        match self {
            Setup::Single { aof: true } => "one redis-server (AOF, appendfsync always)",
            Setup::Single { aof: false } => {
                "control: one redis-server without persistence (restarts come back empty)"
            }
            Setup::Redlock { guard: true } => {
                "Redlock over 5 redis-servers (no persistence, restart guard on)"
            }
            Setup::Redlock { guard: false } => {
                "control: Redlock over 5 redis-servers without persistence, restart guard off"
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Plan {
    setups: Vec<Setup>,
    sections: usize,
    cap: Duration,
    seed: u64,
    ttl: Duration,
    acquire_timeout: Duration,
    /// Share of holds that last TTL/2 to 2×TTL (so the watchdog has to extend through
    /// faults, and some leases are lost).
    long_share: f64,
    out: Option<std::path::PathBuf>,
    verbose: bool,
}

impl Plan {
    fn from_args() -> Plan {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let has = |f: &str| args.iter().any(|a| a == f);
        let value = |f: &str| {
            args.iter()
                .position(|a| a == f)
                .and_then(|i| args.get(i + 1))
                .map(String::as_str)
        };
        let num = |f: &str, default: u64| {
            value(f).map_or(default, |v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{f} wants a whole number, got {v:?}"))
            })
        };
        let single = Setup::Single {
            aof: !has("--no-aof"),
        };
        let redlock = Setup::Redlock {
            guard: !has("--no-restart-guard"),
        };
        let setups = match (has("--single"), has("--redlock")) {
            (true, false) => vec![single],
            (false, true) => vec![redlock],
            _ => vec![single, redlock],
        };
        let clock_seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 % 1_000_000);
        let ttl = Duration::from_millis(num("--ttl-ms", 1000));
        Plan {
            setups,
            sections: num("--sections", 10_000) as usize,
            cap: Duration::from_secs(num("--seconds", 600)),
            seed: num("--seed", clock_seed),
            ttl,
            acquire_timeout: ttl * 3,
            long_share: value("--long-share").map_or(0.005, |v| v.parse().expect("--long-share")),
            out: value("--out").map(Into::into),
            verbose: has("--verbose"),
        }
    }
}

/// What one task saw, merged at the end.
#[derive(Debug, Default)]
struct Tally {
    acquired: u64,
    /// Acquire errors by kind: (count, first message).
    acquire_errors: BTreeMap<&'static str, (u64, String)>,
    /// Acquired, but the lease was lost before the section began: not entered.
    lost_before_entry: u64,
    long_holds: u64,
    released: u64,
    release_errors: BTreeMap<&'static str, (u64, String)>,
    waits: Vec<Duration>,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.acquired += o.acquired;
        self.lost_before_entry += o.lost_before_entry;
        self.long_holds += o.long_holds;
        self.released += o.released;
        for (mine, theirs) in [
            (&mut self.acquire_errors, o.acquire_errors),
            (&mut self.release_errors, o.release_errors),
        ] {
            for (k, (n, msg)) in theirs {
                mine.entry(k).or_insert((0, msg)).0 += n;
            }
        }
        self.waits.extend(o.waits);
    }
}

fn count(map: &mut BTreeMap<&'static str, (u64, String)>, e: &Error) {
    let kind = match e {
        Error::Timeout { .. } => "timeout",
        Error::QuorumNotReached { .. } => "quorum not reached",
        Error::Backend { .. } => "backend",
        Error::NotHeld => "not held",
        Error::InvalidConfig(_) => "invalid config",
        _ => "other",
    };
    map.entry(kind).or_insert_with(|| (0, e.to_string())).0 += 1;
}

/// One task: acquire a random name, check in, hold, check out, release; until `stop`.
async fn task(
    locks: Vec<Lock>,
    book: Arc<Book>,
    who: book::Who,
    plan: Plan,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = Tally::default();
    while !stop.load(Ordering::Relaxed) {
        let name = rng.random_range(0..locks.len());
        let asked = Instant::now();
        let guard = match locks[name].acquire_timeout(plan.acquire_timeout).await {
            Ok(g) => g,
            Err(e) => {
                count(&mut t.acquire_errors, &e);
                // A server that is down fails at once: do not spin on it.
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..=25))).await;
                continue;
            }
        };
        t.acquired += 1;
        t.waits.push(asked.elapsed());
        if guard.is_lost() {
            // What an application does: a lease that is lost already guards nothing.
            t.lost_before_entry += 1;
            let _ = guard.release().await;
            continue;
        }
        let hold = if rng.random_bool(plan.long_share) {
            t.long_holds += 1;
            Duration::from_micros(
                rng.random_range(plan.ttl.as_micros() as u64 / 2..=plan.ttl.as_micros() as u64 * 2),
            )
        } else {
            Duration::from_micros(rng.random_range(0..=SHORT_HOLD_US))
        };
        let section = book.enter(name, who, guard.fencing_token());
        // The work races the lease: a holder told its lease is lost stops at once.
        tokio::select! {
            _ = tokio::time::sleep(hold) => {}
            _ = guard.lost() => {}
        }
        let lost_at = guard
            .is_lost()
            .then(|| Instant::now().min(guard.valid_until()));
        section.exit(lost_at);
        match guard.release().await {
            Ok(_) => t.released += 1,
            Err(e) => count(&mut t.release_errors, &e),
        }
    }
    t
}

/// Waits until every server has been up for `d` (Redlock's restart guard counts a node only
/// then), so that the run starts with every node in.
fn wait_for_uptime(servers: &[RedisServer], d: Duration) {
    let need = d.as_secs_f64().ceil() as u64 + 1;
    for s in servers {
        s.wait_until(Duration::from_secs(need + 10), |s| {
            s.info_field("server", "uptime_in_seconds")
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|up| up >= need)
        });
    }
}

struct Outcome {
    setup: Setup,
    elapsed: Duration,
    verdict: Verdict,
    tally: Tally,
    counts: chaos::Counts,
    events: Vec<chaos::Event>,
    watchdog: (u64, u64),
    stuck: usize,
    /// Sections still inside once the tasks were stopped (0 unless some task hung).
    inside: usize,
    start: Instant,
    chaos_plan: chaos::Plan,
}

async fn soak(setup: Setup, plan: &Plan) -> Outcome {
    let ttl = plan.ttl;
    let (servers, chaos_plan) = match setup {
        Setup::Single { aof } => (
            vec![if aof {
                RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
            } else {
                RedisServer::start()
            }],
            chaos::Plan {
                comeback: if aof {
                    Comeback::Persisted
                } else {
                    Comeback::Empty {
                        warm_up: Duration::ZERO,
                    }
                },
                max_down: 1,
                gap: (Duration::from_millis(100), Duration::from_millis(500)),
                down: (Duration::ZERO, ttl / 2),
                pause: (Duration::from_millis(20), ttl.mul_f64(0.8)),
                weights: [2, 3, 3, 2],
            },
        ),
        Setup::Redlock { guard } => {
            let servers: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
            eprintln!("waiting for the nodes to have been up for one TTL (the restart guard)");
            wait_for_uptime(&servers, ttl);
            // A node restarted empty counts again once up for the TTL (uptime is read in whole
            // seconds, rounded down): until then it is out.
            let warm_up = if guard {
                Duration::from_secs(ttl.as_secs_f64().ceil() as u64 + 1)
            } else {
                Duration::ZERO
            };
            (
                servers,
                chaos::Plan {
                    comeback: Comeback::Empty { warm_up },
                    max_down: 2,
                    gap: (Duration::from_millis(100), Duration::from_millis(500)),
                    down: (Duration::ZERO, ttl / 2),
                    pause: (Duration::from_millis(20), ttl.mul_f64(0.8)),
                    weights: [2, 3, 3, 2],
                },
            )
        }
    };
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let options = LockOptions::new().ttl(ttl);
    let mut managers = Vec::new();
    for _ in 0..MANAGERS {
        let m = match setup {
            Setup::Single { .. } => LockManager::with_options(
                RedisBackend::connect(&urls[0]).await.expect("connect"),
                options.clone(),
            ),
            Setup::Redlock { guard } => {
                let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
                // Every client here takes leases of `ttl`: restarted nodes sit out that long.
                let redlock = RedlockOptions::new()
                    .restart_guard(guard)
                    .max_lease(ttl)
                    .restart_quarantine(ttl);
                LockManager::with_options(
                    Redlock::connect_with(&refs, RedisOptions::new(), redlock)
                        .await
                        .expect("redlock connects"),
                    options.clone(),
                )
            }
        };
        managers.push(m.expect("lock options"));
    }
    let names: Vec<String> = (0..NAMES).map(|i| format!("soak:{i}")).collect();

    let book = Book::new(NAMES);
    let stop = Arc::new(AtomicBool::new(false));
    let stop_chaos = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let chaos = Chaos::new(servers, chaos_plan.clone(), start, plan.verbose);
    let injector = chaos.spawn(stop_chaos.clone(), plan.seed ^ 0x5eed);
    let mut tasks = Vec::new();
    for (m, locks) in managers.iter().enumerate() {
        for t in 0..TASKS {
            let locks: Vec<Lock> = names.iter().map(|n| locks.lock(n)).collect();
            let seed = plan
                .seed
                .wrapping_mul(1000)
                .wrapping_add((m * TASKS + t) as u64);
            tasks.push(tokio::spawn(task(
                locks,
                book.clone(),
                (m, t),
                plan.clone(),
                stop.clone(),
                seed,
            )));
        }
    }
    let mut told = Instant::now();
    while book.done() < plan.sections && start.elapsed() < plan.cap {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if told.elapsed() >= Duration::from_secs(10) {
            told = Instant::now();
            eprintln!(
                "{:?}: {:.0} s, {} sections",
                setup,
                start.elapsed().as_secs_f64(),
                book.done()
            );
        }
    }
    let elapsed = start.elapsed();
    stop.store(true, Ordering::SeqCst);
    stop_chaos.store(true, Ordering::SeqCst);
    // Each task ends within one acquire timeout and one hold; the injector brings every
    // server back first.
    let mut tally = Tally::default();
    let mut stuck = 0;
    let grace = plan.acquire_timeout + ttl * 4 + Duration::from_secs(10);
    for t in tasks {
        match tokio::time::timeout(grace, t).await {
            Ok(Ok(t)) => tally.merge(t),
            _ => stuck += 1,
        }
    }
    tokio::task::spawn_blocking(move || injector.join())
        .await
        .expect("join")
        .expect("the fault injector panicked");
    let watchdog = managers.iter().fold((0, 0), |(e, l), m| {
        let s = m.watchdog_stats();
        (e + s.extended, l + s.lost)
    });
    let verdict = book.verdict();
    let inside = book.inside();
    let events = chaos.events();
    let counts = copy_counts(&chaos.counts);
    drop(managers);
    drop(chaos);
    Outcome {
        setup,
        elapsed,
        verdict,
        tally,
        counts,
        events,
        watchdog,
        stuck,
        inside,
        start,
        chaos_plan,
    }
}

fn copy_counts(c: &chaos::Counts) -> chaos::Counts {
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed).into();
    chaos::Counts {
        kills: get(&c.kills),
        restarts: get(&c.restarts),
        pauses: get(&c.pauses),
        client_kills: get(&c.client_kills),
        pubsub_kills: get(&c.pubsub_kills),
        connections_closed: get(&c.connections_closed),
        skipped: get(&c.skipped),
        longest_pause_us: get(&c.longest_pause_us),
        longest_down_us: get(&c.longest_down_us),
        harness_errors: get(&c.harness_errors),
    }
}

/// How many sections the pairs' later sections overlapped.
fn holders(pairs: &[Pair]) -> usize {
    pairs
        .iter()
        .map(|p| p.earlier.id)
        .collect::<BTreeSet<_>>()
        .len()
}

fn at(start: Instant, t: Instant) -> String {
    format!("{:.3} s", t.saturating_duration_since(start).as_secs_f64())
}

fn describe(o: &Outcome, p: &Pair, plan: &Plan) -> String {
    let r = |r: &book::Record| {
        format!(
            "section #{} (manager {}, task {}) token {}: in {} – {}, lease {}",
            r.id,
            r.who.0,
            r.who.1,
            r.token,
            at(o.start, r.enter),
            at(o.start, r.exit),
            r.lost_at.map_or("not lost".to_owned(), |t| format!(
                "known lost at {}",
                at(o.start, t)
            ))
        )
    };
    let mut s = format!(
        "  name soak:{}\n    earlier: {}\n    later:   {}\n    faults around it:\n",
        p.later.name,
        r(&p.earlier),
        r(&p.later)
    );
    let from = p.later.enter.checked_sub(plan.ttl * 3).unwrap_or(o.start);
    let to = p.later.enter + plan.ttl;
    for e in o.events.iter().filter(|e| e.at >= from && e.at <= to) {
        let _ = writeln!(s, "      {}  {}", at(o.start, e.at), e.what);
    }
    s
}

fn report(o: &Outcome, plan: &Plan) -> String {
    let v = &o.verdict;
    let t = &o.tally;
    let c = &o.counts;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut waits = t.waits.clone();
    let errs = |m: &BTreeMap<&'static str, (u64, String)>| {
        if m.is_empty() {
            "none".to_owned()
        } else {
            m.iter()
                .map(|(k, (n, _))| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let mut md = String::new();
    let _ = writeln!(md, "### {}\n", o.setup.title());
    let _ = writeln!(
        md,
        "seed {}, TTL {:?}, {MANAGERS} managers × {TASKS} tasks on {NAMES} names, holds 0–5 ms \
         ({:.1} % of them TTL/2–2×TTL), acquire timeout {:?}; ran {:.1} s\n",
        plan.seed,
        plan.ttl,
        plan.long_share * 100.0,
        plan.acquire_timeout,
        o.elapsed.as_secs_f64()
    );
    let _ = writeln!(md, "| | |\n|---|---|");
    let row = |md: &mut String, k: &str, val: String| {
        let _ = writeln!(md, "| {k} | {val} |");
    };
    row(
        &mut md,
        "critical sections",
        format!(
            "{} ({:.0}/s; {} long holds)",
            v.sections,
            v.sections as f64 / o.elapsed.as_secs_f64(),
            t.long_holds
        ),
    );
    row(
        &mut md,
        "**overlaps** (entered while a section of the same name was inside whose lease was not known lost)",
        format!(
            "**{}** ({} holders overlapped; pairs inside at once: {} at entry, {} from the \
             timestamps)",
            v.overlaps.len(),
            holders(&v.overlaps),
            v.live_pairs,
            v.post_hoc_pairs
        ),
    );
    row(
        &mut md,
        "overlaps after a lost lease (the earlier holder had been told)",
        v.overlaps_after_loss.len().to_string(),
    );
    row(
        &mut md,
        "**token order** (each entry's token above every earlier one of its name)",
        format!(
            "**{} breaks** ({} at entry, {} from the timestamps; {} more by leases lost before entry)",
            v.token_order.len(),
            v.live_token_breaks,
            v.post_hoc_token_breaks,
            v.token_order_after_loss.len()
        ),
    );
    row(
        &mut md,
        "lost leases",
        format!(
            "{} sections ended with the lease lost; {} acquired but lost before entering; \
             watchdog: {} extensions, {} lost",
            v.lost, t.lost_before_entry, o.watchdog.0, o.watchdog.1
        ),
    );
    row(
        &mut md,
        "acquires",
        format!(
            "{} granted, wait p50 {} p99 {} max {}; errors: {}",
            t.acquired,
            stats::ms(stats::quantile(&mut waits, 0.5)),
            stats::ms(stats::quantile(&mut waits, 0.99)),
            stats::ms(waits.last().copied().unwrap_or_default()),
            errs(&t.acquire_errors)
        ),
    );
    row(
        &mut md,
        "releases",
        format!("{} ok; errors: {}", t.released, errs(&t.release_errors)),
    );
    row(
        &mut md,
        "faults injected",
        format!(
            "{} kills (SIGKILL) and {} restarts ({}; longest down {:.0} ms), {} pauses \
             (SIGSTOP, longest {:.0} ms), {} `CLIENT KILL TYPE normal` and {} `pubsub` \
             ({} connections closed); {} skipped with {} server(s) out already",
            n(&c.kills),
            n(&c.restarts),
            match o.chaos_plan.comeback {
                Comeback::Persisted => "from the AOF".to_owned(),
                Comeback::Empty { warm_up } if warm_up > Duration::ZERO => {
                    format!("empty, out of every majority for {warm_up:?} after")
                }
                Comeback::Empty { .. } => "empty".to_owned(),
            },
            n(&c.longest_down_us) as f64 / 1e3,
            n(&c.pauses),
            n(&c.longest_pause_us) as f64 / 1e3,
            n(&c.client_kills),
            n(&c.pubsub_kills),
            n(&c.connections_closed),
            n(&c.skipped),
            o.chaos_plan.max_down
        ),
    );
    if n(&c.harness_errors) > 0 || o.stuck > 0 || o.inside > 0 {
        row(
            &mut md,
            "harness",
            format!(
                "{} harness calls failed; {} tasks did not stop, {} sections left inside",
                n(&c.harness_errors),
                o.stuck,
                o.inside
            ),
        );
    }
    let _ = writeln!(md);
    for (what, pairs) in [("OVERLAP", &v.overlaps), ("TOKEN ORDER", &v.token_order)] {
        // The first overlap of each of the first five holders overlapped.
        let mut shown = BTreeSet::new();
        for p in pairs.iter().filter(|p| shown.insert(p.earlier.id)).take(5) {
            let _ = writeln!(
                md,
                "```text\n{what} (seed {}):\n{}```\n",
                plan.seed,
                describe(o, p, plan)
            );
        }
    }
    for (k, (_, msg)) in &t.acquire_errors {
        let _ = writeln!(md, "- first acquire error of kind {k}: {msg}");
    }
    for (k, (_, msg)) in &t.release_errors {
        let _ = writeln!(md, "- first release error of kind {k}: {msg}");
    }
    md
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let plan = Plan::from_args();
    let mut md = String::from("## Soak\n\n");
    let mut broken = false;
    for &setup in &plan.setups {
        eprintln!("soak: {} (seed {})", setup.title(), plan.seed);
        let o = soak(setup, &plan).await;
        // A control run is expected to break exclusion: that is what it is for.
        broken |= !o.setup.control()
            && (!o.verdict.overlaps.is_empty() || !o.verdict.token_order.is_empty());
        let r = report(&o, &plan);
        print!("{r}");
        md.push_str(&r);
        md.push('\n');
    }
    if let Some(out) = &plan.out {
        std::fs::write(out, &md).expect("write the report");
        eprintln!("wrote {}", out.display());
    }
    if broken {
        std::process::exit(1);
    }
}
