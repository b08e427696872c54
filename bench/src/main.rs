//! redlease benchmark: redlease beside the raw floor (the same commands by hand on fred and
//! on redis-rs) and the rslock crate, on redis-server processes it starts itself on loopback.
//!
//! ```text
//! cargo run --release -p redlease-bench            # full run, writes bench/RESULTS.md
//! cargo run --release -p redlease-bench -- --quick # every workload once, in under 2 minutes
//! ```
//!
//! W1–W3 also run redlease on PostgreSQL and on etcd (`PostgresBackend`, `EtcdBackend`), on
//! servers started the way the tests start them; `--stores redis` leaves them out.
//!
//! See bench/README.md for the workloads and how to read the tables.
#![allow(dead_code)] // the shared server harness has more than the benchmark uses

// The test harness's redis-server spawner, shared rather than copied (with the soak binary).
mod harness;
mod libs;
mod stats;
mod workloads;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use harness::etcd::EtcdServer;
use harness::postgres::PgServer;
use harness::server;
use libs::{Clients, Lib, Store, StoreUrls};
use server::RedisServer;
use stats::{fmt_spread, ms, spread};

struct Plan {
    quick: bool,
    /// `--only W2,W3`: run just these workloads (for iterating on one number).
    only: Option<Vec<String>>,
    /// `--lib drop`: in W1 and W2, run only the rows whose name contains this (to profile one
    /// row under perf; the ratios of the rows left out read 0 or inf).
    lib: Option<String>,
    /// `--stores redis,postgres`: the stores whose rows W1–W3 run (Redis's always run: the
    /// other rows' ratios are to them). Default: all three.
    stores: Vec<Store>,
    repeats: usize,
    dur: Duration,
    w3_quota: u64,
    w3_cap: Duration,
    w5_leases: usize,
    w5_window: Duration,
    out: std::path::PathBuf,
}

impl Plan {
    fn runs(&self, w: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.iter().any(|x| x == w))
    }

    /// Whether W1–W3 run `store`'s rows.
    fn on(&self, store: Store) -> bool {
        self.stores.contains(&store) && ["W1", "W2", "W3"].iter().any(|w| self.runs(w))
    }

    fn from_args() -> Plan {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let only = args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .map(|s| s.split(',').map(|w| w.trim().to_uppercase()).collect());
        let lib = args
            .iter()
            .position(|a| a == "--lib")
            .and_then(|i| args.get(i + 1))
            .cloned();
        let stores = match args.iter().position(|a| a == "--stores") {
            None => Store::ALL.to_vec(),
            Some(i) => {
                let list = args.get(i + 1).map_or("", String::as_str);
                let mut stores = vec![Store::Redis];
                for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    match Store::ALL.iter().find(|s| s.arg() == name) {
                        Some(s) if !stores.contains(s) => stores.push(*s),
                        Some(_) => {}
                        None => {
                            eprintln!("--stores: unknown store {name:?} (redis, postgres, etcd)");
                            std::process::exit(2);
                        }
                    }
                }
                stores
            }
        };
        let out = args
            .iter()
            .position(|a| a == "--out")
            .and_then(|i| args.get(i + 1))
            .map(Into::into)
            .unwrap_or_else(|| {
                let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
                if quick {
                    dir.join("../target/bench-quick.md")
                } else {
                    dir.join("RESULTS.md")
                }
            });
        if quick {
            Plan {
                quick,
                only,
                lib: lib.clone(),
                stores,
                repeats: 1,
                dur: Duration::from_millis(1500),
                w3_quota: 60,
                w3_cap: Duration::from_secs(6),
                w5_leases: 100_000,
                w5_window: Duration::from_secs(4),
                out,
            }
        } else {
            Plan {
                quick,
                only,
                lib,
                stores,
                repeats: 5,
                dur: Duration::from_secs(3),
                w3_quota: 200,
                w3_cap: Duration::from_secs(20),
                w5_leases: 100_000,
                w5_window: Duration::from_secs(10),
                out,
            }
        }
    }
}

fn machine(plan: &Plan) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cmd = |c: &str, a: &str| {
        std::process::Command::new(c)
            .arg(a)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let mut servers = cmd("redis-server", "--version");
    if plan.on(Store::Postgres) {
        servers.push_str("; ");
        servers.push_str(&cmd(PG_BIN, "--version"));
    }
    if plan.on(Store::Etcd) {
        servers.push_str("; ");
        servers.push_str(cmd(ETCD_BIN, "--version").lines().next().unwrap_or(""));
    }
    format!(
        "- machine: {cores} cores, {cpu}; load average at start: {}\n- {}; {servers}\n- crates: redlease {}, fred 10.1, redis-rs 1.x, rslock 0.10.0; `--release`\n",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        cmd("rustc", "--version"),
        env!("CARGO_PKG_VERSION").replace("0.0.0", "0.1.0"),
    )
}

/// One W5M row in a process of its own (`--w5m-row LEASES EXTENDED WINDOW_MS`), so that its
/// memory per lease is the growth of a fresh process, not memory an earlier workload freed
/// and this one reused. Prints the row's numbers on one line for the parent.
async fn w5m_row(args: &[String]) {
    let arg = |i: usize| args.get(i).and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
    let (n, extended, window) = (arg(0) as usize, arg(1) == 1, Duration::from_millis(arg(2)));
    let node = RedisServer::start();
    let ttl = extended.then_some(Duration::from_secs(30));
    let (h, churn) = workloads::w5_churn(&node.url(), &node, n, ttl, window, 64).await;
    println!(
        "W5MROW {} {:.0} {:.4} {:.4} {:.1} {} {:.1} {}",
        h.acquire_time.as_millis(),
        h.bytes_per_lease,
        h.client_cpu_share,
        h.redis_cpu_share,
        h.scripts_per_sec,
        h.rounds,
        churn,
        h.lost
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--w5m-row") {
        return w5m_row(&args[i + 1..]).await;
    }
    let plan = Plan::from_args();
    let started = Instant::now();
    let mut md = String::new();
    writeln!(md, "# redlease benchmark results\n").unwrap();
    writeln!(
        md,
        "{}- run: {} ({} repeats, interleaved; medians with min–max)\n",
        machine(&plan),
        if plan.quick { "--quick" } else { "full" },
        plan.repeats
    )
    .unwrap();

    // Started first: by the time W4 runs they have been up for a TTL (see W4).
    let w4_nodes: (Vec<RedisServer>, Vec<RedisServer>) = if plan.runs("W4") {
        (
            (0..3).map(|_| RedisServer::start()).collect(),
            (0..5).map(|_| RedisServer::start()).collect(),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let node = RedisServer::start();
    let url = node.url();
    // The other stores of W1–W3, each server found in /proc for its CPU.
    let pg = plan.on(Store::Postgres).then(|| {
        need(PG_BIN, "PostgreSQL 15", "postgresql", "postgres");
        let srv = PgServer::start();
        let pid = harness::find_process(PG_BIN, &srv.port().to_string())
            .expect("the postmaster's process");
        (srv, pid)
    });
    let etcd = plan.on(Store::Etcd).then(|| {
        need(ETCD_BIN, "etcd", "etcd-server", "etcd");
        let srv = EtcdServer::start();
        let pid = harness::find_process(ETCD_BIN, &srv.url()).expect("the etcd server's process");
        (srv, pid)
    });
    let stores = StoreUrls {
        postgres: pg.as_ref().map(|(s, _)| s.url()),
        etcd: etcd.as_ref().map(|(s, _)| s.url()),
    };
    // CPU seconds of the server `lib` runs on.
    let server_cpu = |lib: Lib| -> f64 {
        match (lib.store(), &pg, &etcd) {
            (Store::Postgres, Some((_, pid)), _) | (Store::Etcd, _, Some((_, pid))) => {
                harness::process_tree_cpu(*pid)
            }
            _ => workloads::redis_cpu(&node),
        }
    };
    let clients = Clients::connect(&url, &stores).await;
    let groups: Vec<Clients> =
        futures::future::join_all((0..4).map(|_| Clients::connect(&url, &stores))).await;
    let single: Vec<Lib> = [
        Lib::Redlease,
        Lib::RedleaseDrop,
        Lib::RedleaseRedisRs,
        Lib::RedleaseRedisRsDrop,
        Lib::FredRaw,
        Lib::RedisRsRaw,
        Lib::Rslock,
        Lib::RedleasePostgres,
        Lib::RedleaseEtcd,
    ]
    .into_iter()
    .filter(|l| plan.stores.contains(&l.store()))
    .collect();
    let at = |lib: Lib| single.iter().position(|l| *l == lib).expect("a W1/W2 row");

    // W1 and W2, interleaved: each repeat runs every library once, in a rotated order.
    // The "same key" rows re-take the key the last cycle let go: a drop release must not make
    // the next acquire race it.
    for (w, name, tasks, same) in [
        ("W1", "W1: 1 task, sequential, 1 node", 1, false),
        (
            "W1",
            "W1 same key: 1 task, sequential, one key, 1 node",
            1,
            true,
        ),
        (
            "W2",
            "W2: 64 tasks, distinct keys, 1 node, one shared client",
            64,
            false,
        ),
        (
            "W2",
            "W2 same key: 64 tasks, one key each, re-taken every cycle, 1 node, one shared client",
            64,
            true,
        ),
    ] {
        if !plan.runs(w) {
            continue;
        }
        eprintln!("{name}");
        let mut results: Vec<Vec<f64>> = vec![Vec::new(); single.len()];
        let mut redis_us: Vec<Vec<f64>> = vec![Vec::new(); single.len()];
        let mut client_us: Vec<Vec<f64>> = vec![Vec::new(); single.len()];
        for r in 0..plan.repeats {
            for k in 0..single.len() {
                let i = (k + r) % single.len();
                if plan
                    .lib
                    .as_ref()
                    .is_some_and(|l| !single[i].name().contains(l.as_str()))
                {
                    continue;
                }
                let cpu0 = server_cpu(single[i]);
                let client0 = stats::process_cpu();
                let v = if tasks == 1 {
                    workloads::w1(&clients, single[i], plan.dur, same).await
                } else {
                    workloads::w2(&clients, single[i], plan.dur, same).await
                };
                let cycles = v * plan.dur.as_secs_f64();
                client_us[i].push((stats::process_cpu() - client0) * 1e6 / cycles.max(1.0));
                redis_us[i].push((server_cpu(single[i]) - cpu0) * 1e6 / cycles.max(1.0));
                results[i].push(v);
            }
        }
        let floor = spread(&results[at(Lib::FredRaw)]).0;
        let rslock = spread(&results[at(Lib::Rslock)]).0;
        writeln!(md, "## {name}\n\n| library | cycles/s | vs fred floor | vs rslock | server CPU per cycle | client CPU per cycle |\n|---|---|---|---|---|---|").unwrap();
        for (i, lib) in single.iter().enumerate() {
            let m = spread(&results[i]).0;
            writeln!(
                md,
                "| {} | {} | {:.2}× | {:.2}× | {:.1} µs | {:.1} µs |",
                lib.name(),
                fmt_spread(&results[i], ""),
                m / floor,
                m / rslock,
                spread(&redis_us[i]).0,
                spread(&client_us[i]).0
            )
            .unwrap();
        }
        let on_redis = spread(&results[at(Lib::Redlease)]).0;
        let others: Vec<String> = [Lib::RedleasePostgres, Lib::RedleaseEtcd]
            .iter()
            .filter(|l| single.contains(l))
            .map(|l| {
                let m = spread(&results[at(*l)]).0;
                format!("{} {:.2}×", l.store().arg(), m / on_redis)
            })
            .collect();
        if !others.is_empty() {
            writeln!(
                md,
                "\nredlease (explicit release) on another store / on Redis: {}",
                others.join(", ")
            )
            .unwrap();
        }
        writeln!(md).unwrap();
    }

    // W3: one key, 16 tasks in 4 client groups (as 4 processes), hold 1 ms.
    if plan.runs("W3") {
        eprintln!("W3");
        // Redis's three rows first: the summary below reads them by index.
        let contenders: Vec<Lib> = [
            Lib::Redlease,
            Lib::RedleaseFair,
            Lib::Rslock,
            Lib::RedleasePostgres,
            Lib::RedleasePostgresFair,
            Lib::RedleaseEtcd,
            Lib::RedleaseEtcdFair,
        ]
        .into_iter()
        .filter(|l| plan.stores.contains(&l.store()))
        .collect();
        let n = contenders.len();
        let mut w3: Vec<Vec<workloads::Contended>> = (0..n).map(|_| Vec::new()).collect();
        for r in 0..plan.repeats {
            for k in 0..n {
                let i = (k + r) % n;
                let lib = contenders[i];
                let cpu = || server_cpu(lib);
                w3[i].push(workloads::w3(&groups, lib, &cpu, plan.w3_quota, plan.w3_cap).await);
            }
        }
        writeln!(
            md,
            "## W3: 16 tasks, one key, hold 1 ms (4 clients × 4 tasks)\n"
        )
        .unwrap();
        writeln!(md, "| library | acq/s | hand-off gap p50 / p99 | wait p50 / p99 / max | hold p50 | fairness max/min at first finish | same-task re-acquire | server CPU per acq | violations |\n|---|---|---|---|---|---|---|---|---|").unwrap();
        let mut p99s = Vec::new();
        let mut tputs = Vec::new();
        for (i, lib) in contenders.iter().enumerate() {
            // The median repeat by wait p99.
            let mut runs: Vec<&workloads::Contended> = w3[i].iter().collect();
            runs.sort_by_key(|c| c.wait_p99);
            let c = runs[runs.len() / 2];
            p99s.push(c.wait_p99);
            let tput: Vec<f64> = w3[i].iter().map(|c| c.throughput).collect();
            tputs.push(spread(&tput).0);
            let (max, min) = c.fairness;
            let fair = if min == 0 {
                format!("{max}/0 (a task starved)")
            } else {
                format!("{:.2} ({max}/{min})", max as f64 / min as f64)
            };
            writeln!(
                md,
                "| {} | {} | {} / {} | {} / {} / {} | {} | {} | {:.1} % | {:.0} µs | {} |",
                lib.name(),
                fmt_spread(&tput, ""),
                ms(c.gap_p50),
                ms(c.gap_p99),
                ms(c.wait_p50),
                ms(c.wait_p99),
                ms(c.wait_max),
                ms(c.hold_p50),
                fair,
                c.same_task_share * 100.0,
                c.redis_cpu_us_per_acq,
                w3[i].iter().map(|c| c.violations).sum::<usize>()
            )
            .unwrap();
        }
        writeln!(
            md,
            "\nwait p99: rslock / redlease = {:.1}×, rslock / redlease fair = {:.1}×; \
             throughput fair / plain = {:.2}\n",
            p99s[2].as_secs_f64() / p99s[0].as_secs_f64().max(1e-9),
            p99s[2].as_secs_f64() / p99s[1].as_secs_f64().max(1e-9),
            tputs[1] / tputs[0].max(1e-9)
        )
        .unwrap();
        // The other stores against redlease on Redis, plain against plain, fair against fair.
        for (i, lib) in contenders.iter().enumerate().skip(3) {
            let base = if matches!(lib, Lib::RedleasePostgresFair | Lib::RedleaseEtcdFair) {
                1
            } else {
                0
            };
            writeln!(
                md,
                "- {} against the same on Redis: throughput {:.2}×, wait p99 {:.1}×",
                lib.name().replace(" (explicit release)", ""),
                tputs[i] / tputs[base].max(1e-9),
                p99s[i].as_secs_f64() / p99s[base].as_secs_f64().max(1e-9)
            )
            .unwrap();
        }
        if contenders.len() > 3 {
            writeln!(md).unwrap();
        }
    }

    // W4: Redlock over 3 and 5 nodes, redlease beside rslock, interleaved; then with one
    // node paused. The nodes were started at the beginning of the run, so that they have
    // been up for one TTL by now and redlease's restart guard lets them count (it is on,
    // as in production: its cost is in the numbers).
    if plan.runs("W4") {
        eprintln!("W4");
        writeln!(md, "## W4: Redlock over 3 and 5 nodes\n\nOne shared client per library, W1 (1 task) and W2 (64 tasks, distinct keys) shapes; TTL 30 s; redlease with its restart guard on and the default 50 ms node timeout.\n\n| nodes | shape | redlease explicit | redlease drop | rslock | explicit vs rslock | drop vs rslock | redlease acquire p50 / p99 | Redis CPU per cycle, all nodes: redlease / rslock |\n|---|---|---|---|---|---|---|---|---|").unwrap();
        let mut paused_rows = Vec::new();
        for (n, nodes) in [(3usize, &w4_nodes.0), (5, &w4_nodes.1)] {
            let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
            let url_refs: Vec<&str> = urls.iter().map(String::as_str).collect();
            wait_for_uptime(nodes, libs::TTL);
            // The nodes are fresh: a quarantine of the TTL (no client here takes longer).
            let options = redlease::RedlockOptions::new()
                .max_lease(libs::TTL)
                .restart_quarantine(libs::TTL);
            let redlock =
                redlease::Redlock::connect_with(&url_refs, redlease::RedisOptions::new(), options)
                    .await
                    .expect("redlock connects");
            let locks = redlease::LockManager::with_options(
                redlock,
                redlease::LockOptions::new().ttl(libs::TTL),
            )
            .expect("options");
            let stall = Duration::from_secs(5);
            for (shape, tasks) in [("W1", 1usize), ("W2", 64)] {
                let (mut explicit, mut dropped, mut rs) = (Vec::new(), Vec::new(), Vec::new());
                let mut lat = (Vec::new(), Vec::new());
                // Redis CPU (all nodes) per cycle: redlease explicit, rslock.
                let mut cpu = (Vec::new(), Vec::new());
                let nodes_cpu = || nodes.iter().map(workloads::redis_cpu).sum::<f64>();
                for r in 0..plan.repeats {
                    for k in 0..3 {
                        let cpu0 = nodes_cpu();
                        match (k + r) % 3 {
                            0 => {
                                let (c, p50, p99) =
                                    workloads::w4_redlease(&locks, tasks, plan.dur, stall, false)
                                        .await
                                        .expect("redlease W4 stalled");
                                explicit.push(c);
                                lat.0.push(p50.as_secs_f64() * 1e3);
                                lat.1.push(p99.as_secs_f64() * 1e3);
                                let cycles = c * plan.dur.as_secs_f64();
                                cpu.0.push((nodes_cpu() - cpu0) * 1e6 / cycles.max(1.0));
                            }
                            1 => dropped.extend(
                                workloads::w4_redlease(&locks, tasks, plan.dur, stall, true)
                                    .await
                                    .map(|(c, _, _)| c),
                            ),
                            _ => {
                                let c = workloads::w4_rslock(&urls, tasks, plan.dur, stall).await;
                                if let Some(c) = c {
                                    let cycles = c * plan.dur.as_secs_f64();
                                    cpu.1.push((nodes_cpu() - cpu0) * 1e6 / cycles.max(1.0));
                                }
                                rs.extend(c)
                            }
                        }
                    }
                }
                let rsm = spread(&rs).0.max(1e-9);
                writeln!(
                    md,
                    "| {n} | {shape} | {} | {} | {} | {:.2}× | {:.2}× | {:.2} / {:.2} ms | {:.1} / {:.1} µs |",
                    fmt_spread(&explicit, ""),
                    fmt_spread(&dropped, ""),
                    fmt_spread(&rs, ""),
                    spread(&explicit).0 / rsm,
                    spread(&dropped).0 / rsm,
                    spread(&lat.0).0,
                    spread(&lat.1).0,
                    spread(&cpu.0).0,
                    spread(&cpu.1).0,
                )
                .unwrap();

                nodes[0].pause();
                let ours = workloads::w4_redlease(&locks, tasks, plan.dur, stall, false).await;
                let theirs = workloads::w4_rslock(&urls, tasks, plan.dur, stall).await;
                nodes[0].resume();
                let ours =
                    ours.map_or("stalled: a cycle took > 5 s".to_owned(), |(c, p50, p99)| {
                        format!(
                            "{c:.0} cycles/s, acquire p50 {} p99 {}",
                            stats::ms(p50),
                            stats::ms(p99)
                        )
                    });
                let theirs = theirs.map_or("stalled: a cycle took > 5 s".to_owned(), |c| {
                    format!("{c:.0} cycles/s")
                });
                paused_rows.push(format!("| {n} | {shape} | {ours} | {theirs} |"));
            }
        }
        writeln!(md, "\nWith the first node paused (SIGSTOP) for the whole run:\n\n| nodes | shape | redlease explicit | rslock |\n|---|---|---|---|\n{}\n", paused_rows.join("\n")).unwrap();
    }

    // W5: many leases held at once under the watchdog: at the default TTL (the target), and
    // at a tenth of it to show the cost grows with rounds, not with round trips per lease.
    if plan.runs("W5") {
        eprintln!("W5");
        let w5_node = RedisServer::start();
        let mut rows = Vec::new();
        for (ttl, window) in [
            (Duration::from_secs(30), plan.w5_window * 3),
            (Duration::from_secs(3), plan.w5_window),
        ] {
            let h = workloads::w5(&w5_node.url(), &w5_node, plan.w5_leases, ttl, window).await;
            rows.push((ttl, window, h));
        }
        writeln!(
            md,
            "## W5: {} leases held at once under the watchdog\n",
            plan.w5_leases
        )
        .unwrap();
        writeln!(md, "| ttl (extended every ttl/3), window | acquire all (1000 concurrent) | client memory per lease | client CPU | watchdog rounds | Redis script calls/s | Redis CPU | lost |\n|---|---|---|---|---|---|---|---|").unwrap();
        for (ttl, window, h) in rows {
            writeln!(
                md,
                "| {ttl:?}, {window:?} | {} | {:.0} B | {:.2} % of a core | {} | {:.1} | {:.2} % of a core | {} |",
                ms(h.acquire_time), h.bytes_per_lease, h.client_cpu_share * 100.0, h.rounds, h.scripts_per_sec, h.redis_cpu_share * 100.0, h.lost
            )
            .unwrap();
        }
        writeln!(
            md,
            "\nA watchdog call extends up to 256 leases in one script call; a part has a few calls in flight (\"watchdog rounds\" counts calls).\n"
        )
        .unwrap();
    }

    // W5 at scale: 10k, 100k and a million leases held in one manager (TTL 30 s) while 64
    // tasks of the same manager acquire and release: memory per lease, CPU on both sides,
    // leases lost, and the churn's rate beside its rate at 10k leases. A server of its own
    // per row. The million row only in full runs (or `--only W5M`): acquiring it takes
    // about a minute.
    if plan.runs("W5M") && (!plan.quick || plan.only.is_some()) {
        eprintln!("W5M");
        // The last row: the same million not extended, for the store's own cost.
        let sizes: &[(usize, bool)] = if plan.quick {
            &[(10_000, true), (100_000, true)]
        } else {
            &[
                (10_000, true),
                (100_000, true),
                (1_000_000, true),
                (1_000_000, false),
            ]
        };
        let window = plan.w5_window * 4;
        writeln!(md, "## W5 at scale: leases held in one manager (TTL 30 s) while 64 tasks acquire and release, over {window:?}\n\n| leases | acquire all (1000 concurrent) | client memory per lease | client CPU | Redis CPU | Redis script calls/s | watchdog calls | churn cycles/s | churn vs 10k | lost |\n|---|---|---|---|---|---|---|---|---|---|").unwrap();
        let mut base = None;
        for &(n, extended) in sizes {
            // Each row in a fresh process (see `w5m_row`).
            let out = std::process::Command::new(std::env::current_exe().expect("exe"))
                .args([
                    "--w5m-row",
                    &n.to_string(),
                    if extended { "1" } else { "0" },
                ])
                .arg(window.as_millis().to_string())
                .stderr(std::process::Stdio::inherit())
                .output()
                .expect("run a W5M row");
            let line = String::from_utf8_lossy(&out.stdout);
            let f: Vec<f64> = line
                .lines()
                .find_map(|l| l.strip_prefix("W5MROW "))
                .unwrap_or_else(|| panic!("a W5M row printed no numbers: {line}"))
                .split_whitespace()
                .map(|x| x.parse().unwrap_or(f64::NAN))
                .collect();
            let churn = f[6];
            let base = *base.get_or_insert(churn);
            let leases = if extended {
                n.to_string()
            } else {
                format!("{n}, not extended (watchdog off, TTL 10 min)")
            };
            writeln!(
                md,
                "| {leases} | {:.0} ms | {:.0} B | {:.1} % of a core | {:.1} % of a core | {:.1} | {} | {churn:.0} | {:.2}x | {} |",
                f[0],
                f[1],
                f[2] * 100.0,
                f[3] * 100.0,
                f[4],
                f[5],
                churn / base,
                f[7]
            )
            .unwrap();
        }
        writeln!(md).unwrap();
    }

    // W7: W2 on a Redis Cluster of three primaries, one replica each: without and with one
    // replica's acknowledgement.
    if plan.runs("W7") {
        eprintln!("W7");
        let cluster = harness::cluster::RedisCluster::start(3, 1);
        let clients = libs::ClusterClients::connect(&cluster.url(), true).await;
        let rows = [
            Lib::Redlease,
            Lib::RedleaseDrop,
            Lib::FredRaw,
            Lib::RedleaseAcked,
            Lib::FredRawAcked,
        ];
        let mut results: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        let mut redis_us: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        let cpu = |c: &harness::cluster::RedisCluster| -> f64 {
            c.primaries().iter().map(workloads::redis_cpu).sum()
        };
        for r in 0..plan.repeats {
            for k in 0..rows.len() {
                let i = (k + r) % rows.len();
                let cpu0 = cpu(&cluster);
                let v = workloads::w7(&clients, rows[i], plan.dur).await;
                let cycles = v * plan.dur.as_secs_f64();
                redis_us[i].push((cpu(&cluster) - cpu0) * 1e6 / cycles.max(1.0));
                results[i].push(v);
            }
        }
        let floor = spread(&results[2]).0;
        let acked_floor = spread(&results[4]).0;
        writeln!(md, "## W7: W2 on a Redis Cluster (3 primaries, 1 replica each), 64 tasks, distinct keys, one shared client\n\nredlease keeps a connection per primary; the floor is the same commands sent by hand on fred's cluster client. The last two rows wait for one replica (`ReplicaAck::replicas(1)`; the floor sends `WAIT 1` after its SET) and are compared with the floor that does.\n\n| library | cycles/s | vs fred floor | Redis CPU per cycle, all primaries |\n|---|---|---|---|").unwrap();
        for (i, lib) in rows.iter().enumerate() {
            let floor = if i >= 3 { acked_floor } else { floor };
            writeln!(
                md,
                "| {} | {} | {:.2}× | {:.1} µs |",
                lib.name()
                    .replace("raw floor: fred", "raw floor: fred cluster client,"),
                fmt_spread(&results[i], ""),
                spread(&results[i]).0 / floor,
                spread(&redis_us[i]).0
            )
            .unwrap();
        }
        let mut gaps = workloads::w7_handoff(&cluster.url(), 200).await;
        writeln!(
            md,
            "\nHand-off on the cluster (a waiter in another manager, woken by the release's message on the lock's shard; 200 locks over every shard): release call to the waiter's guard p50 {}, p99 {}.\n",
            ms(stats::quantile(&mut gaps, 0.5)),
            ms(stats::quantile(&mut gaps, 0.99))
        )
        .unwrap();
    }

    // W6: idle waiters on one held lock in one process.
    if plan.runs("W6") {
        eprintln!("W6");
        let w6_node = RedisServer::start();
        let window = plan.w5_window;
        let i = workloads::w6(&w6_node.url(), &w6_node, 10_000, window).await;
        writeln!(
            md,
            "## W6: {} tasks in one process waiting on one held lock, idle for {window:?}\n\n| Redis commands/s (all clients) | client CPU | Redis CPU | release to every waiter served once |\n|---|---|---|---|\n| {:.1} | {:.2} % of a core | {:.2} % of a core | {} |\n",
            i.waiters,
            i.commands_per_sec,
            i.client_cpu_share * 100.0,
            i.redis_cpu_share * 100.0,
            ms(i.drained)
        )
        .unwrap();
    }

    // W8 and W9: the shared kinds on one name, 64 tasks, one shared client, beside the same
    // server-side work written by hand on fred and the plain lock doing the same loop. Each
    // run gets a lock manager (or the floor's connections) of its own.

    // W8: a semaphore of 8 permits, 64 tasks; each cycle acquire -> release, no work.
    if plan.runs("W8") {
        eprintln!("W8");
        use workloads::W8Row;
        let rows = [
            W8Row::Semaphore,
            W8Row::SemaphoreDrop,
            W8Row::PlainLocks,
            W8Row::Floor,
        ];
        let mut runs: Vec<Vec<workloads::SharedRun>> =
            (0..rows.len()).map(|_| Vec::new()).collect();
        let mut redis_us: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        let mut client_us: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        let mut calls: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        for r in 0..plan.repeats {
            for k in 0..rows.len() {
                let i = (k + r) % rows.len();
                let run = workloads::w8(&url, &node, rows[i], plan.dur).await;
                client_us[i].push(run.cost.client_us);
                redis_us[i].push(run.cost.redis_us);
                calls[i].push(run.cost.scripts);
                runs[i].push(run);
            }
        }
        let rate = |i: usize| -> Vec<f64> { runs[i].iter().map(|r| r.rate).collect() };
        let med = |i: usize, f: fn(&workloads::SharedRun) -> Duration| -> String {
            let v: Vec<f64> = runs[i].iter().map(|r| f(r).as_secs_f64() * 1e3).collect();
            format!("{:.2}", spread(&v).0)
        };
        let floor_rate = spread(&rate(3)).0.max(1e-9);
        let plain_rate = spread(&rate(2)).0.max(1e-9);
        writeln!(
            md,
            "## W8: semaphore of {} permits, 64 tasks on one name, 1 node, one shared client\n\nEach task loops acquire -> release with no work between. The plain-lock row runs the same 64 tasks on 8 locks (8 waiting on each): the same 8 holders at a time. The floor is the same server-side work written by hand (see README). Acquires ≥ 0.5 s and violations count every repeat; \"wake-ups lost after the run\" is a plain-lock hand-off in the run's manager afterwards.\n\n| row | permits/s | vs floor | vs 8 plain locks | acquire p50 / p99 / max | acquires ≥ 0.5 s | wake-ups lost after the run | Redis CPU per cycle | script calls per cycle | client CPU per cycle | grants per task max/min | violations |\n|---|---|---|---|---|---|---|---|---|---|---|---|",
            workloads::W8_PERMITS
        )
        .unwrap();
        for (i, row) in rows.iter().enumerate() {
            let m = spread(&rate(i)).0;
            // The median repeat by rate, for the fairness column.
            let mut by_rate: Vec<&workloads::SharedRun> = runs[i].iter().collect();
            by_rate.sort_by(|a, b| a.rate.total_cmp(&b.rate));
            let Some(c) = by_rate.get(by_rate.len() / 2) else {
                continue;
            };
            writeln!(
                md,
                "| {} | {} | {:.2}× | {:.2}× | {} / {} / {} ms | {} | {} | {:.1} µs | {:.2} | {:.1} µs | {}/{} | {} |",
                row.name(),
                fmt_spread(&rate(i), ""),
                m / floor_rate,
                m / plain_rate,
                med(i, |r| r.p50),
                med(i, |r| r.p99),
                med(i, |r| r.max),
                runs[i].iter().map(|r| r.slow).sum::<usize>(),
                wakes_lost(&runs[i]),
                spread(&redis_us[i]).0,
                spread(&calls[i]).0,
                spread(&client_us[i]).0,
                c.fairness.0,
                c.fairness.1,
                runs[i].iter().map(|r| r.violations).sum::<usize>()
            )
            .unwrap();
        }
        writeln!(md).unwrap();
    }

    // W9: a read-write lock, 63 readers and 1 writer on one name, each holding 1 ms.
    if plan.runs("W9") {
        eprintln!("W9");
        use workloads::W9Row;
        let rows = [W9Row::RwLock, W9Row::Exclusive, W9Row::Floor];
        let mut runs: Vec<Vec<workloads::SharedRun>> =
            (0..rows.len()).map(|_| Vec::new()).collect();
        let mut redis_us: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        let mut calls: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
        for r in 0..plan.repeats {
            for k in 0..rows.len() {
                let i = (k + r) % rows.len();
                let run = workloads::w9(&url, &node, rows[i], plan.dur).await;
                redis_us[i].push(run.cost.redis_us);
                calls[i].push(run.cost.scripts);
                runs[i].push(run);
            }
        }
        let col = |i: usize, f: fn(&workloads::SharedRun) -> f64| -> Vec<f64> {
            runs[i].iter().map(f).collect()
        };
        let med = |i: usize, f: fn(&workloads::SharedRun) -> Duration| -> String {
            let v: Vec<f64> = runs[i].iter().map(|r| f(r).as_secs_f64() * 1e3).collect();
            format!("{:.2}", spread(&v).0)
        };
        let total = |i: usize| spread(&col(i, |r| r.rate + r.writes_rate)).0.max(1e-9);
        writeln!(
            md,
            "## W9: read-write lock, 63 readers + 1 writer on one name, 1 node, one shared client\n\nEach read and each write holds for a {:?} sleep (1–2 ms by tokio's timer). The exclusive row has every task take one plain lock (everything serialised); the floor is a read-write lock with writer preference written by hand (see README). Ratios are of acquisitions (reads + writes) per second.\n\n| row | reads/s | writes/s | vs exclusive | vs floor | read wait p50 / p99 / max | write wait p50 / p99 / max | waits ≥ 0.5 s | wake-ups lost after the run | Redis CPU per acquisition | script calls per acquisition | reads per reader max/min | most readers inside | violations |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            workloads::W9_SECTION
        )
        .unwrap();
        for (i, row) in rows.iter().enumerate() {
            let mut by_rate: Vec<&workloads::SharedRun> = runs[i].iter().collect();
            by_rate.sort_by(|a, b| a.rate.total_cmp(&b.rate));
            let Some(c) = by_rate.get(by_rate.len() / 2) else {
                continue;
            };
            writeln!(
                md,
                "| {} | {} | {} | {:.2}× | {:.2}× | {} / {} / {} ms | {} / {} / {} ms | {} | {} | {:.1} µs | {:.2} | {}/{} | {} | {} |",
                row.name(),
                fmt_spread(&col(i, |r| r.rate), ""),
                fmt_spread(&col(i, |r| r.writes_rate), ""),
                total(i) / total(1),
                total(i) / total(2),
                med(i, |r| r.p50),
                med(i, |r| r.p99),
                med(i, |r| r.max),
                med(i, |r| r.write_p50),
                med(i, |r| r.write_p99),
                med(i, |r| r.write_max),
                runs[i].iter().map(|r| r.slow).sum::<usize>(),
                wakes_lost(&runs[i]),
                spread(&redis_us[i]).0,
                spread(&calls[i]).0,
                c.fairness.0,
                c.fairness.1,
                c.max_inside,
                runs[i].iter().map(|r| r.violations).sum::<usize>()
            )
            .unwrap();
        }
        writeln!(md).unwrap();
    }

    writeln!(md, "_Run took {:.0} s._", started.elapsed().as_secs_f64()).unwrap();
    print!("{md}");
    if let Some(dir) = plan.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // Sections another tool measures (bench/valkey-primitives.sh) are kept as they were.
    if let Ok(old) = std::fs::read_to_string(&plan.out) {
        if let Some(at) = old.find(KEPT_SECTIONS) {
            md.push('\n');
            md.push_str(&old[at + 1..]);
        }
    }
    std::fs::write(&plan.out, &md).expect("write results");
    eprintln!("wrote {}", plan.out.display());
}

/// Where the tests' harness finds the servers (tests/support/postgres.rs and etcd.rs).
const PG_BIN: &str = "/usr/lib/postgresql/15/bin/postgres";
const ETCD_BIN: &str = "/usr/bin/etcd";

/// Exits with a message naming the package if `path` is missing.
fn need(path: &str, what: &str, package: &str, store: &str) {
    if !std::path::Path::new(path).exists() {
        eprintln!(
            "{path} is missing: the {what} rows of W1–W3 need it (Debian: apt-get install -y \
             {package}); or leave them out: --stores redis,{}",
            if store == "postgres" {
                "etcd"
            } else {
                "postgres"
            }
        );
        std::process::exit(2);
    }
}

/// The first heading of the results file's sections that this program does not write (and
/// keeps, with everything after it, when it writes the file again).
const KEPT_SECTIONS: &str = "\n## Valkey primitives";

/// W8/W9's "wake-ups lost after the run" column: in how many of the runs a hand-off in the
/// run's manager afterwards took the fallback re-check (≥ 0.5 s) rather than a wake-up, with
/// the slowest hand-off; "—" for the floor.
fn wakes_lost(runs: &[workloads::SharedRun]) -> String {
    let checks: Vec<Duration> = runs.iter().filter_map(|r| r.wake_after).collect();
    if checks.is_empty() {
        return "—".into();
    }
    let lost = checks.iter().filter(|d| **d >= workloads::SLOW).count();
    let worst = checks.iter().max().copied().unwrap_or_default();
    format!(
        "{lost} of {} (slowest hand-off {})",
        checks.len(),
        ms(worst)
    )
}

/// Waits until every node has been up for `d` (the restart guard's condition), saying so.
fn wait_for_uptime(nodes: &[RedisServer], d: Duration) {
    let up = |n: &RedisServer| {
        n.info_field("server", "uptime_in_seconds")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let need = d.as_secs() + 1;
    let least = nodes.iter().map(up).min().unwrap_or(need);
    if least < need {
        eprintln!(
            "W4: waiting {}s for the nodes to have been up for one TTL",
            need - least
        );
        std::thread::sleep(Duration::from_secs(need - least));
    }
}
