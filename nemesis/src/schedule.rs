//! The faults, a seeded schedule of them, and how each is injected and healed.
//!
//! One fault at a time: a gap of 0.2–2 s, a fault on a random target, held for its
//! duration, healed, logged ([`FaultEvent`]). The same seed gives the same sequence of
//! faults, targets and durations (the workers' timing still varies from run to run).

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::faults::{ClockOffset, DelayProxy, Net};
use crate::record::{mono_ns, FaultEvent};
use crate::topology::Topology;

/// A fault the nemesis can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// `kill -9` a store server, restart it after 0–500 ms keeping its data dir (with AOF
    /// it reloads what it persisted; without, it comes back empty). On Sentinel, a killed
    /// primary stays down until the sentinels have failed it over (a primary without
    /// persistence restarted before that comes back empty, and its replicas copy the
    /// emptiness: Redis's own docs warn against it).
    Kill,
    /// SIGSTOP a store server for 0.2–2 s (0.2–4 s on Sentinel, so that some pauses of the
    /// primary outlast `down-after-milliseconds` and fail it over), then SIGCONT.
    Pause,
    /// SIGSTOP a worker for 1.5–3 s (past every TTL it uses), then SIGCONT.
    ClientPause,
    /// `CLIENT KILL TYPE normal` on every store server.
    ClientKill,
    /// Busy loops (4 threads on this 2-core machine) for 1–3 s: the workers starve.
    Starve,
    /// A store server's wall clock shifted for 0.5–3 s, then set right (the clock shim of
    /// `crate::faults`): ahead by 50–250 ms (less than any TTL), ahead by 1–30 s (more than
    /// any TTL), or behind by 0.5–30 s (whose heal is a jump forward).
    ClockShift,
    /// A worker's host cut from a store server's host (`crate::faults`' `Net`: the servers
    /// in network namespaces, each worker's connections made from a host of its own), or,
    /// on Redlock, from three of the five, for 0.5–5 s, then healed.
    Partition,
    /// Through the proxy between the workers and a store server (`crate::faults`'
    /// `DelayProxy`): a delay of 10–500 ms for 0.5–3 s, a stall of 0.5–3 s, or every proxied
    /// connection reset.
    Delay,
    /// `SENTINEL FAILOVER`: the sentinels promote a replica while the primary still runs
    /// (Sentinel configurations only).
    Failover,
}

impl Fault {
    /// The faults this harness injects today.
    pub const WIRED: [Fault; 9] = [
        Fault::Kill,
        Fault::Pause,
        Fault::ClientPause,
        Fault::ClientKill,
        Fault::Starve,
        Fault::ClockShift,
        Fault::Delay,
        Fault::Partition,
        Fault::Failover,
    ];

    const NAMES: [(Fault, &'static str); 9] = [
        (Fault::Kill, "kill"),
        (Fault::Pause, "pause"),
        (Fault::ClientPause, "client-pause"),
        (Fault::ClientKill, "client-kill"),
        (Fault::Starve, "starve"),
        (Fault::ClockShift, "clock"),
        (Fault::Partition, "partition"),
        (Fault::Delay, "delay"),
        (Fault::Failover, "failover"),
    ];
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = Fault::NAMES
            .iter()
            .find(|(k, _)| k == self)
            .map_or("?", |(_, n)| n);
        f.write_str(name)
    }
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let f = Fault::NAMES
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(k, _)| *k)
            .ok_or_else(|| format!("unknown fault {s:?}"))?;
        if !Fault::WIRED.contains(&f) {
            return Err(format!(
                "fault {s:?} needs the faults module's launcher, not wired into the schedule yet"
            ));
        }
        Ok(f)
    }
}

/// Injects a seeded sequence of faults into a topology and its workers.
#[derive(Debug)]
pub struct Nemesis {
    rng: StdRng,
    faults: Vec<Fault>,
    /// The worker processes' ids (targets of client pauses).
    pub workers: Vec<u32>,
    /// Each store server's clock offset (empty unless clock faults were asked for).
    pub clocks: Vec<ClockOffset>,
    /// The proxies in front of each store server (one per worker with partitions, one for
    /// all without; empty unless delays or partitions were asked for).
    pub proxies: Vec<Vec<DelayProxy>>,
    /// The hosts of the servers (`s0`, ...) and of the workers' connections (`w0`, ...),
    /// with partitions.
    pub net: Option<Net>,
}

impl Nemesis {
    /// A schedule of `faults` drawn by `seed`.
    pub fn new(seed: u64, faults: Vec<Fault>, workers: Vec<u32>) -> Nemesis {
        Nemesis {
            rng: StdRng::seed_from_u64(seed ^ 0x6e656d65),
            faults,
            workers,
            clocks: Vec::new(),
            proxies: Vec::new(),
            net: None,
        }
    }

    /// The gap before the next fault.
    pub fn gap(&mut self) -> Duration {
        Duration::from_millis(self.rng.random_range(200..2000))
    }

    /// Injects the next fault, holds it, heals it; what happened. `None` if no faults were
    /// asked for.
    pub fn strike(&mut self, topo: &mut Topology) -> Option<FaultEvent> {
        if self.faults.is_empty() {
            return None;
        }
        let fault = self.faults[self.rng.random_range(0..self.faults.len())];
        let server = self.rng.random_range(0..topo.node_count());
        let ms = |rng: &mut StdRng, a: u64, b: u64| Duration::from_millis(rng.random_range(a..b));
        let start = mono_ns();
        let mut data_loss = false;
        let mut clock_forward = None;
        let mut kind = fault.to_string();
        let target = match fault {
            Fault::Kill => {
                let down = ms(&mut self.rng, 0, 500);
                let acked = topo.config.replica_ack() > 0;
                if let Some(d) = &mut topo.sentinels {
                    let primary = d.primary() == server;
                    d.nodes[server].kill();
                    if primary {
                        d.wait_primary_changed(server);
                    } else {
                        std::thread::sleep(down);
                    }
                    d.nodes[server].restart_keeping_data();
                    d.wait_settled();
                    // Without acknowledgement, the promoted replica may lack the last grants.
                    data_loss = primary && !acked;
                    kind = role_kind("kill", primary);
                } else {
                    let srv = topo.node(server);
                    srv.kill();
                    std::thread::sleep(down);
                    srv.restart_keeping_data();
                    data_loss = topo.config.kill_loses_leases();
                }
                format!("server{server}")
            }
            Fault::Pause => {
                let longest = if topo.sentinels.is_some() { 4000 } else { 2000 };
                let d = ms(&mut self.rng, 200, longest);
                let acked = topo.config.replica_ack() > 0;
                let primary = topo.sentinels.as_ref().map(|s| s.primary() == server);
                let srv = topo.node(server);
                srv.pause();
                std::thread::sleep(d);
                srv.resume();
                data_loss = topo.config.pause_loses_leases() && d >= Duration::from_secs(1);
                if let (Some(dep), Some(primary)) = (&topo.sentinels, primary) {
                    // A failover while the primary was paused: what it granted after its
                    // last replication is lost (without acknowledgement), and so is what it
                    // grants once resumed, until the sentinels demote it.
                    let failed_over = dep.wait_settled() != server && primary;
                    data_loss = failed_over && !acked;
                    kind = role_kind("pause", primary);
                    if failed_over {
                        kind.push_str("-failover");
                    }
                }
                format!("server{server}")
            }
            Fault::Failover => {
                let dep = topo
                    .sentinels
                    .as_ref()
                    .expect("nemesis: a failover fault on a configuration without sentinels");
                let old = dep.primary();
                // Sentinel may give a forced failover up (no replica it would promote, say
                // one still syncing after a restart): counted apart, as it may have promoted
                // a replica for a while.
                let new = dep.try_failover();
                dep.wait_settled();
                data_loss = topo.config.replica_ack() == 0;
                match new {
                    Ok(new) => format!("server{old}->server{new}"),
                    Err(_) => {
                        kind = "failover-given-up".into();
                        format!("server{old}")
                    }
                }
            }
            Fault::ClientPause => {
                let d = ms(&mut self.rng, 1500, 3000);
                let w = self.rng.random_range(0..self.workers.len());
                let pid = Pid::from_raw(self.workers[w] as i32);
                if kill(pid, Signal::SIGSTOP).is_ok() {
                    std::thread::sleep(d);
                    let _ = kill(pid, Signal::SIGCONT);
                }
                format!("worker{w}")
            }
            Fault::ClientKill => {
                for i in 0..topo.node_count() {
                    topo.node(i).kill_clients();
                }
                "all".to_string()
            }
            Fault::Starve => {
                let d = ms(&mut self.rng, 1000, 3000);
                starve(4, d);
                "workers".to_string()
            }
            Fault::ClockShift => {
                let clock = self
                    .clocks
                    .get(server)
                    .expect("nemesis: a clock fault without the servers' clock offsets");
                let jump: i64 = match self.rng.random_range(0..3) {
                    0 => self.rng.random_range(50..250),
                    1 => self.rng.random_range(1_000..30_000),
                    _ => -self.rng.random_range(500..30_000),
                };
                let d = ms(&mut self.rng, 500, 3000);
                kind = match jump {
                    j if j < 0 => "clock-back",
                    j if j < 300 => "clock<ttl",
                    _ => "clock>ttl",
                }
                .to_string();
                clock.set(jump).expect("nemesis: cannot set a clock offset");
                if jump > 0 {
                    clock_forward = Some(mono_ns());
                }
                std::thread::sleep(d);
                clock.set(0).expect("nemesis: cannot set a clock offset");
                if jump < 0 {
                    clock_forward = Some(mono_ns());
                }
                format!("server{server}:{jump:+}ms")
            }
            Fault::Delay => {
                let proxies = self
                    .proxies
                    .get(server)
                    .expect("nemesis: a delay fault without the servers' proxies");
                match self.rng.random_range(0..3) {
                    0 => {
                        let delay = ms(&mut self.rng, 10, 500);
                        let d = ms(&mut self.rng, 500, 3000);
                        proxies.iter().for_each(|p| p.set_delay(delay));
                        std::thread::sleep(d);
                        proxies.iter().for_each(|p| p.set_delay(Duration::ZERO));
                        format!("server{server}:{}ms", delay.as_millis())
                    }
                    1 => {
                        let d = ms(&mut self.rng, 500, 3000);
                        kind = "stall".into();
                        proxies.iter().for_each(|p| p.set_stall(true));
                        std::thread::sleep(d);
                        proxies.iter().for_each(|p| p.set_stall(false));
                        format!("server{server}:{}ms", d.as_millis())
                    }
                    _ => {
                        kind = "conn-reset".into();
                        proxies.iter().for_each(DelayProxy::kill_connections);
                        format!("server{server}")
                    }
                }
            }
            Fault::Partition => {
                let net = self
                    .net
                    .as_ref()
                    .expect("nemesis: a partition without the servers' network");
                let w = self.rng.random_range(0..self.workers.len());
                let n = topo.node_count();
                // On Redlock, half the time a majority of the nodes.
                let cut: Vec<usize> = if n > 1 && self.rng.random_bool(0.5) {
                    (0..n / 2 + 1).map(|k| (server + k) % n).collect()
                } else {
                    vec![server]
                };
                let d = ms(&mut self.rng, 500, 5000);
                let host = format!("w{w}");
                for &i in &cut {
                    net.cut(&host, &format!("s{i}"))
                        .expect("nemesis: cannot cut a host from a server");
                }
                std::thread::sleep(d);
                net.heal_all().expect("nemesis: cannot heal a partition");
                let names: Vec<String> = cut.iter().map(|i| format!("server{i}")).collect();
                format!("worker{w}|{}:{}ms", names.join("+"), d.as_millis())
            }
        };
        Some(FaultEvent {
            kind,
            target,
            start,
            end: mono_ns(),
            data_loss,
            clock_forward,
        })
    }
}

/// A fault's row name on Sentinel, by the node's role when struck.
fn role_kind(fault: &str, primary: bool) -> String {
    format!("{fault}-{}", if primary { "primary" } else { "replica" })
}

/// Runs `threads` busy loops for `d`.
fn starve(threads: usize, d: Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..threads)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        })
        .collect();
    std::thread::sleep(d);
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        let _ = h.join();
    }
}
