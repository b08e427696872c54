//! One run of one configuration: start its servers, spawn the workers (this executable in
//! `worker` mode), let the nemesis strike until the time is up, collect the records and
//! check them.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use std::net::SocketAddr;

use crate::checker::{check, Report};
use crate::faults::net::CONTROL;
use crate::faults::{ClockOffset, ClockShim, DelayProxy, Net};
use crate::record::{mono_ns, Records};
use crate::schedule::{Fault, Nemesis};
use crate::topology::{Config, Launch, Topology};
use crate::workload::{WorkerConfig, REDLOCK_MAX_LEASE};

/// What a run is asked to do.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// The configuration.
    pub config: Config,
    /// How long the workload runs.
    pub seconds: u64,
    /// Worker processes.
    pub workers: usize,
    /// Tasks per worker.
    pub tasks: usize,
    /// The seed of the workload and the schedule.
    pub seed: u64,
    /// The faults to draw from (none: a clean run).
    pub faults: Vec<Fault>,
    /// Mutant workers (see `crate::workload`).
    pub mutant: bool,
    /// The workers' lock store on redis-rs instead of fred.
    pub redis_rs: bool,
    /// Where the record files go.
    pub dir: PathBuf,
    /// How every store server is started (the default: `RedisServer`).
    pub launch: Launch,
}

/// Runs `spec`; the checker's report, and the record directory.
pub fn run(spec: &RunSpec) -> Report {
    fs::create_dir_all(&spec.dir).expect("nemesis: cannot create the record directory");
    let clocked = spec.faults.contains(&Fault::ClockShift);
    let parted = spec.faults.contains(&Fault::Partition);
    let proxied = parted || spec.faults.contains(&Fault::Delay);
    assert!(
        !(spec.config == Config::Cluster || spec.config.is_sentinel()) || !(clocked || proxied),
        "nemesis: clock, delay and partition faults are wired for single, single-aof and \
         redlock5 only (a cluster's or a Sentinel deployment's clients follow the nodes' own \
         addresses, past any proxy)"
    );
    assert!(
        spec.config.is_sentinel() || !spec.faults.contains(&Fault::Failover),
        "nemesis: the failover fault is for the sentinel and sentinel-ack configurations"
    );
    let count = if spec.config == Config::Redlock5 {
        5
    } else {
        1
    };
    let clocks: Vec<ClockOffset> = if clocked {
        let dir = spec.dir.join("clock");
        let shim = ClockShim::build(&dir).expect("nemesis: cannot build the clock shim");
        (0..count)
            .map(|i| {
                shim.offset(&dir, &format!("server{i}"))
                    .expect("nemesis: cannot create a clock offset")
            })
            .collect()
    } else {
        Vec::new()
    };
    // With partitions: server i in host s<i>, worker w's connections made from host w<w>.
    let net = parted.then(|| {
        let hosts: Vec<String> = (0..count)
            .map(|i| format!("s{i}"))
            .chain((0..spec.workers).map(|w| format!("w{w}")))
            .collect();
        let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
        Net::new("nem26", &hosts).expect("nemesis: cannot make the network namespaces")
    });
    let mut topo = Topology::start(spec.config, &|i| {
        let mut l = spec.launch.clone();
        if let Some(c) = clocks.get(i) {
            l.env.extend(c.env());
        }
        if let Some(net) = &net {
            let host = format!("s{i}");
            let mut prefix = net.exec_prefix(&host);
            prefix.append(&mut l.prefix);
            l.prefix = prefix;
            l.bind = Some(net.addr(&host).to_string());
            l.control_ns = Some(net.ns(CONTROL).to_string());
        }
        l
    });
    // The proxies' tasks run on a runtime of their own, alive until the workers are done.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("nemesis: cannot build the proxies' runtime");
    // proxies[i][g]: in front of server i for the workers of group g (each worker its own
    // group with partitions, one group without).
    let groups = if parted { spec.workers } else { 1 };
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let proxies: Vec<Vec<DelayProxy>> = if proxied {
        let _in = runtime.enter();
        topo.urls()
            .iter()
            .map(|url| {
                let addr: SocketAddr = url
                    .trim_start_matches("redis://")
                    .parse()
                    .expect("nemesis: a server's URL is not HOST:PORT");
                (0..groups)
                    .map(|g| match &net {
                        Some(net) => {
                            let from = net
                                .connector(&format!("w{g}"), addr, Duration::from_secs(2))
                                .expect("nemesis: no such host");
                            DelayProxy::start_with(loopback, from)
                        }
                        None => DelayProxy::start(loopback, addr),
                    })
                    .collect::<std::io::Result<Vec<_>>>()
                    .expect("nemesis: cannot start a proxy")
            })
            .collect()
    } else {
        Vec::new()
    };
    let urls = |w: usize| -> Vec<String> {
        if proxied {
            proxies
                .iter()
                .map(|p| format!("redis://{}", p[w % groups].addr()))
                .collect()
        } else {
            topo.urls()
        }
    };
    if spec.config == Config::Redlock5 {
        // A fresh Redlock node counts toward no majority for its first quarantine.
        std::thread::sleep(REDLOCK_MAX_LEASE);
    }
    let exe = std::env::current_exe().expect("nemesis: cannot find its own executable");
    let start = mono_ns();
    let until_ns = start + spec.seconds * 1_000_000_000;
    let mut workers: Vec<Child> = (0..spec.workers)
        .map(|id| {
            let cfg = WorkerConfig {
                id,
                seed: spec.seed,
                urls: urls(id),
                redlock: spec.config == Config::Redlock5,
                replica_ack: spec.config.replica_ack(),
                restart_quarantine_ms: spec.config.restart_quarantine().as_millis() as u64,
                fence_url: topo.fence.url(),
                out: spec.dir.join(format!("worker{id}.rec")),
                until_ns,
                tasks: spec.tasks,
                mutant: spec.mutant,
                redis_rs: spec.redis_rs,
            };
            Command::new(&exe)
                .args(cfg.to_args())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .expect("nemesis: cannot spawn a worker")
        })
        .collect();
    let pids: Vec<u32> = workers.iter().map(Child::id).collect();
    let mut nemesis = Nemesis::new(spec.seed, spec.faults.clone(), pids.clone());
    nemesis.clocks = clocks;
    nemesis.proxies = proxies;
    nemesis.net = net;
    let mut log = fs::File::create(spec.dir.join("faults.rec"))
        .expect("nemesis: cannot create the fault log");
    // One server's clock jumping ahead is enough to end a lease early, on Redlock too: a
    // holder that won a bare majority (3 of 5, under contention) loses it when one of its
    // nodes jumps, and a second client's majority can include that node (the Kleppmann
    // case; README, "What Redlock does not promise"). So one jump excuses an overlap.
    let quorum = 1;
    log.write_all(format!("Q {quorum}\n").as_bytes())
        .expect("nemesis: cannot write the fault log");
    loop {
        let gap = nemesis.gap();
        if mono_ns() + u64::try_from(gap.as_nanos()).unwrap_or(0) >= until_ns {
            break;
        }
        std::thread::sleep(gap);
        match nemesis.strike(&mut topo) {
            Some(event) => log
                .write_all(event.line().as_bytes())
                .expect("nemesis: cannot write the fault log"),
            None => {
                let left = until_ns.saturating_sub(mono_ns());
                std::thread::sleep(Duration::from_nanos(left));
                break;
            }
        }
    }
    drop(log);
    // Every worker runs again (a late SIGCONT is harmless) and ends its last section.
    for &pid in &pids {
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
    }
    for (id, w) in workers.iter_mut().enumerate() {
        let out = w.stdout.take().map(BufReader::new);
        let status = w.wait().expect("nemesis: cannot wait for a worker");
        let last = out
            .and_then(|o| o.lines().map_while(Result::ok).last())
            .unwrap_or_default();
        if !status.success() {
            eprintln!("worker{id} exited with {status}: {last}");
        }
    }
    // The servers stop before their namespaces go (a process in a deleted namespace lives
    // on), and the proxies before their runtime.
    let net = nemesis.net.take();
    drop(nemesis);
    drop(topo);
    drop(net);
    drop(runtime);
    check_dir(&spec.dir)
}

/// Checks the records of a run kept in `dir` (its `*.rec` files).
pub fn check_dir(dir: &Path) -> Report {
    let mut records = Records::default();
    for entry in fs::read_dir(dir).expect("nemesis: cannot list the records") {
        let path = entry.expect("nemesis: cannot list the records").path();
        if path.extension().is_some_and(|e| e == "rec") {
            records
                .read_file(&path)
                .unwrap_or_else(|e| panic!("nemesis: cannot read {}: {e}", path.display()));
        }
    }
    check(&records)
}

/// Removes a run's record directory.
pub fn clean(dir: &Path) {
    let _ = fs::remove_dir_all(dir);
}
