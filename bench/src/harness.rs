//! What both binaries share: the test harness's redis-server spawner and its Redis Cluster
//! (one copy of the code, used by the tests too), the tests' PostgreSQL and etcd servers, and
//! the items those files reach as `super::` (the polling helper, the scratch directory).

#[path = "../../tests/support/server.rs"]
pub mod server;

#[path = "../../tests/support/cluster.rs"]
pub mod cluster;

#[path = "../../tests/support/postgres.rs"]
pub mod postgres;

#[path = "../../tests/support/etcd.rs"]
pub mod etcd;

#[path = "../../tests/support/wait.rs"]
mod wait;
pub use server::{scratch_dir, ScratchDir};
pub use wait::wait_for_interval;

/// CPU seconds (user + system) of process `root` and its live children, and of the children
/// it has reaped (a PostgreSQL server: the postmaster and a backend per connection).
pub fn process_tree_cpu(root: u32) -> f64 {
    let stat = |pid: &str| -> Option<(u32, [f64; 4])> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name, which is in parentheses and may contain spaces.
        let f: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
        let n = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
        // ppid is field 4 of the file; utime, stime, cutime, cstime fields 14 to 17.
        Some((n(1) as u32, [n(11), n(12), n(13), n(14)]))
    };
    let mut ticks = 0.0;
    if let Some((_, [u, s, cu, cs])) = stat(&root.to_string()) {
        ticks += u + s + cu + cs;
    }
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Some((ppid, [u, s, _, _])) = stat(&name) {
            if ppid == root {
                ticks += u + s;
            }
        }
    }
    ticks / clock_ticks()
}

fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The process whose command line has `arg0` as its program and `needle` as one of its
/// arguments (a server found by its port).
pub fn find_process(arg0: &str, needle: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Ok(pid) = name.to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if args.first() == Some(&arg0.as_bytes()) && args.contains(&needle.as_bytes()) {
            return Some(pid);
        }
    }
    None
}
