//! `redlease-nemesis run --config single --seconds 60 --workers 4 --seed S --faults kill,pause`
//!
//! Prints the seed first (a failure replays with `--seed`), then, per configuration, a row
//! per fault; exits 1 on any safety violation. The `worker` mode is what `run` spawns.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use redlease_nemesis::checker::{Report, HEADER};
use redlease_nemesis::run::{check_dir, clean, run, RunSpec};
use redlease_nemesis::schedule::Fault;
use redlease_nemesis::topology::{Config, Launch};
use redlease_nemesis::workload::{self, WorkerConfig};

#[derive(Parser, Debug)]
#[command(
    about = "Runs every redlease lock kind against real servers under faults, and checks the holders' records"
)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Runs configurations under a seeded schedule of faults and checks the records.
    Run {
        /// Configurations, comma-separated: single, single-aof, single-quarantine, redlock5,
        /// cluster, sentinel, sentinel-ack.
        #[arg(long, default_value = "single", value_delimiter = ',')]
        config: Vec<Config>,
        /// Seconds of workload per configuration.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Worker processes.
        #[arg(long, default_value_t = 4)]
        workers: usize,
        /// Concurrent tasks per worker.
        #[arg(long, default_value_t = 6)]
        tasks: usize,
        /// The seed (default: random, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Faults, comma-separated: kill, pause, client-pause, client-kill, starve, clock,
        /// delay, partition, failover (empty: none; clock, delay and partition not on cluster
        /// or Sentinel; failover on Sentinel only).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "kill,pause,client-pause,client-kill,starve"
        )]
        faults: Vec<String>,
        /// Mutant workers that the checker must catch (watchdog off, long sections,
        /// `lost()` and the validity end ignored).
        #[arg(long)]
        mutant: bool,
        /// The workers' lock store speaks through redis-rs (`Transport::RedisRs`), not fred.
        #[arg(long)]
        redis_rs: bool,
        /// Keep the record files (always kept on a violation).
        #[arg(long)]
        keep: bool,
        /// Where the record files go (default: a directory under the temp dir).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Start every store server under this command (comma-separated words, e.g.
        /// `env,A=1`): the launcher the faults' namespaces and clock shim use.
        #[arg(long, value_delimiter = ',')]
        server_prefix: Vec<String>,
    },
    /// Checks a kept run's records again (a configuration's directory under `--dir`).
    Check {
        /// The directory of one configuration's records (`<dir>/<config>`).
        dir: PathBuf,
    },
    /// One worker process (spawned by `run`).
    #[command(hide = true)]
    Worker(WorkerConfig),
}

fn main() -> ExitCode {
    match Cli::parse().mode {
        Mode::Worker(cfg) => {
            let id = cfg.id;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("nemesis worker: cannot build a runtime");
            match rt.block_on(workload::run(cfg)) {
                Ok(s) => {
                    println!(
                        "worker {id}: {} sections, {} acquire errors, {} reentrant token mismatches",
                        s.sections, s.acquire_errors, s.reentrant_mismatch
                    );
                    if s.reentrant_mismatch > 0 {
                        return ExitCode::FAILURE;
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    println!("worker {id}: failed: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Mode::Check { dir } => {
            let report = check_dir(&dir);
            print_report(&dir.display(), &report);
            if report.violated() {
                println!("SAFETY VIOLATION");
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Mode::Run {
            config,
            seconds,
            workers,
            tasks,
            seed,
            faults,
            mutant,
            redis_rs,
            keep,
            dir,
            server_prefix,
        } => {
            let seed = seed.unwrap_or_else(rand::random);
            println!("seed {seed}");
            let faults: Vec<Fault> = faults
                .iter()
                .filter(|f| !f.is_empty())
                .map(|f| f.parse().unwrap_or_else(|e| panic!("--faults: {e}")))
                .collect();
            let base = dir.unwrap_or_else(|| {
                std::env::temp_dir().join(format!("redlease-nemesis-{}", std::process::id()))
            });
            let mut violated = false;
            for c in config {
                let spec = RunSpec {
                    config: c,
                    seconds,
                    workers,
                    tasks,
                    seed,
                    faults: faults.clone(),
                    mutant,
                    redis_rs,
                    dir: base.join(c.to_string()),
                    launch: Launch {
                        prefix: server_prefix.clone(),
                        ..Launch::default()
                    },
                };
                let report = run(&spec);
                print_report(&c, &report);
                if report.violated() {
                    violated = true;
                    println!("records kept in {}", spec.dir.display());
                } else if !keep {
                    clean(&spec.dir);
                }
            }
            if !keep && !violated {
                clean(&base);
            }
            if violated {
                println!("SAFETY VIOLATION (replay: --seed {seed})");
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}

fn print_report(config: &dyn std::fmt::Display, report: &Report) {
    println!("configuration {config}");
    println!("{HEADER}");
    for (fault, row) in &report.rows {
        println!("{fault:<12} {row}");
    }
    println!("{:<12} {}", "total", report.total());
    for e in report.evidence.iter().take(20) {
        println!("{e}");
    }
    if report.evidence.len() > 20 {
        println!("... {} more", report.evidence.len() - 20);
    }
}
