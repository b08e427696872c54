//! The `redlease` command-line tool, end to end: the built binary against a real
//! redis-server. Two runs on one name serialise, `--no-wait` and `--wait` give their exit
//! codes, a lost lease (key deleted, server killed) makes the command receive SIGTERM (and
//! SIGKILL after the grace period) and the tool exit with the lost code, signals are
//! forwarded (during the grace period too), and `inspect` and `release --force` print what
//! they see and do. On Linux, the command's process group dies with a killed `redlease` (also
//! when its supervisor is killed with it), is SIGKILLed whole after the grace period, and
//! keeps the lock until all of it has exited; a URL with a password shows in no argv, and the
//! command's environment has no REDIS_URL.
//! `--permits N` lets N runs hold one name at once, each with its own fencing token.
#![cfg(unix)]

mod support;

#[cfg(target_os = "linux")]
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use redlease::{LockManager, LockOptions, RedisBackend};
use support::{held, wait_for, RedisServer};

const EXIT_CONFLICT: i32 = 1;
const EXIT_USAGE: i32 = 2;
const EXIT_LOST: i32 = 3;
const EXIT_TIMEOUT: i32 = 4;
const EXIT_UNAVAILABLE: i32 = 5;

/// Bound for things that must happen "soon": failing it means a hang, not slowness.
const SOON: Duration = Duration::from_secs(15);

fn redlease(srv: &RedisServer, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redlease"));
    cmd.args(args)
        .env("REDIS_URL", srv.url())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn output(mut cmd: Command) -> Output {
    cmd.output().expect("the redlease binary runs")
}

/// Waits (bounded) for `child` to exit; its output.
fn finish(child: Child) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(SOON) {
        Ok(out) => out.expect("waited for redlease"),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("redlease (pid {pid}) did not exit within {SOON:?}");
        }
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn scratch(srv: &RedisServer, name: &str) -> PathBuf {
    let dir = srv.dir().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A script that writes "ready" to `ready`, traps SIGTERM (writes "TERM" to `marker`), and
/// runs until stopped.
fn trapping(ready: &Path, marker: &Path, on_term: &str) -> String {
    format!(
        "trap 'echo TERM > {m}; {on_term}' TERM; echo ready > {r}; while :; do sleep 0.02; done",
        m = marker.display(),
        r = ready.display()
    )
}

#[test]
fn two_runs_on_one_name_serialise() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "serialise");
    let log = dir.join("log");
    let script = format!(
        "echo start $$ >> {log}; sleep 0.3; echo end $$ >> {log}",
        log = log.display()
    );
    let runs: Vec<Child> = (0..2)
        .map(|_| {
            redlease(
                &srv,
                &["run", "--ttl", "2s", "job", "--", "sh", "-c", &script],
            )
            .spawn()
            .unwrap()
        })
        .collect();
    for run in runs {
        let out = finish(run);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    }
    let lines: Vec<String> = read(&log).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    // Each start is followed by its own end: no interleaving.
    for pair in lines.chunks(2) {
        let (start, end) = (&pair[0], &pair[1]);
        assert!(start.starts_with("start "), "{lines:?}");
        assert_eq!(end, &start.replace("start", "end"), "{lines:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wait_and_wait_give_the_conflict_and_timeout_codes() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().holder_label("test-holder");
    let locks =
        LockManager::with_options(RedisBackend::connect(&srv.url()).await.unwrap(), opts).unwrap();
    let held = locks.lock("busy").acquire().await.unwrap();

    let cmd = redlease(&srv, &["run", "--no-wait", "busy", "--", "true"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(EXIT_CONFLICT), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("held by test-holder"),
        "{}",
        stderr(&out)
    );

    let cmd = redlease(&srv, &["run", "-n", "-E", "9", "busy", "--", "true"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(9));

    let cmd = redlease(&srv, &["run", "--wait", "300ms", "busy", "--", "true"]);
    let began = Instant::now();
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(EXIT_TIMEOUT), "{}", stderr(&out));
    assert!(began.elapsed() >= Duration::from_millis(300));

    // Once released, the same --no-wait run gets the lock and passes the command's code on.
    held.release().await.unwrap();
    let cmd = redlease(&srv, &["run", "-n", "busy", "--", "sh", "-c", "exit 7"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
}

#[test]
fn permits_let_n_runs_hold_one_name_at_once_each_with_its_own_token() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "permits");
    // Each run writes its fencing token, then waits for `go` (bounded): two of them hold a
    // permit at the same time, or the first never sees the second's file.
    let go = dir.join("go");
    let script = |n: usize| {
        format!(
            "echo $REDLEASE_FENCING_TOKEN > {dir}/tok{n}; i=0; \
             while [ ! -e {go} ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done",
            dir = dir.display(),
            go = go.display()
        )
    };
    let runs: Vec<Child> = (0..2)
        .map(|n| {
            redlease(
                &srv,
                &[
                    "run",
                    "-p",
                    "2",
                    "--ttl",
                    "2s",
                    "pool",
                    "--",
                    "sh",
                    "-c",
                    &script(n),
                ],
            )
            .spawn()
            .unwrap()
        })
        .collect();
    let both = wait_for(SOON, || {
        (0..2).all(|n| !read(&dir.join(format!("tok{n}"))).is_empty())
    });
    assert!(both, "two runs did not hold the 2 permits at once");
    // A third finds both permits taken.
    let out = output(redlease(
        &srv,
        &[
            "run",
            "--permits",
            "2",
            "--no-wait",
            "-l",
            "third",
            "pool",
            "--",
            "true",
        ],
    ));
    assert_eq!(out.status.code(), Some(EXIT_CONFLICT), "{}", stderr(&out));
    assert!(stderr(&out).contains("2 permits"), "{}", stderr(&out));
    let shown = stdout(&output(redlease(&srv, &["inspect", "pool"])));
    assert!(shown.contains("shared holds: 2"), "{shown}");
    // The plain lock of that name is held by the permits too.
    let out = output(redlease(&srv, &["run", "-n", "pool", "--", "true"]));
    assert_eq!(out.status.code(), Some(EXIT_CONFLICT), "{}", stderr(&out));
    std::fs::write(&go, "").unwrap();
    let tokens: Vec<u64> = runs
        .into_iter()
        .enumerate()
        .map(|(n, run)| {
            let out = finish(run);
            assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
            read(&dir.join(format!("tok{n}"))).trim().parse().unwrap()
        })
        .collect();
    assert_ne!(
        tokens[0], tokens[1],
        "each permit has its own fencing token"
    );
    // Zero permits: a usage error, not a hang.
    let out = output(redlease(&srv, &["run", "-p", "0", "pool", "--", "true"]));
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", stderr(&out));
    // Released: a run with one permit gets it at once.
    let out = output(redlease(
        &srv,
        &["run", "-p", "1", "-n", "pool", "--", "true"],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn the_command_gets_the_fencing_token_and_its_codes_pass_through() {
    let srv = RedisServer::start();
    let out = output(redlease(
        &srv,
        &[
            "run",
            "tok",
            "--",
            "sh",
            "-c",
            "echo $REDLEASE_NAME $REDLEASE_FENCING_TOKEN",
        ],
    ));
    assert_eq!(out.status.code(), Some(0));
    let printed = stdout(&out);
    let mut words = printed.split_whitespace();
    assert_eq!(words.next(), Some("tok"));
    let token: u64 = words.next().unwrap().parse().unwrap();
    assert!(token > 0);
    // Killed by a signal: 128 + N, as a shell reports it.
    let out = output(redlease(
        &srv,
        &["run", "sig", "--", "sh", "-c", "kill -9 $$"],
    ));
    assert_eq!(out.status.code(), Some(128 + 9));
    // Not found: 127, as the shell's.
    let out = output(redlease(&srv, &["run", "nf", "--", "/nonexistent/cmd"]));
    assert_eq!(out.status.code(), Some(127), "{}", stderr(&out));
    // The lock was released in each case: free at once.
    let out = output(redlease(&srv, &["run", "-n", "nf", "--", "true"]));
    assert_eq!(out.status.code(), Some(0));
}

/// Runs a trapping command under a short lease, makes the lease go away with `lose`, and
/// checks that the command got SIGTERM and the tool exited with the lost code.
fn lost_lease_terminates_the_command(lose: impl FnOnce(&mut RedisServer)) {
    let mut srv = RedisServer::start();
    let dir = scratch(&srv, "lost");
    let (ready, marker) = (dir.join("ready"), dir.join("marker"));
    let script = trapping(&ready, &marker, "exit 0");
    let run = redlease(
        &srv,
        &[
            "run", "--ttl", "600ms", "--grace", "5s", "victim", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    assert!(
        wait_for(SOON, || read(&ready).contains("ready")),
        "the command started"
    );
    lose(&mut srv);
    let out = finish(run);
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", stderr(&out));
    assert!(read(&marker).contains("TERM"), "the command got SIGTERM");
    assert!(stderr(&out).contains("lost the lease"), "{}", stderr(&out));
}

#[test]
fn deleting_the_key_terminates_the_command_with_the_lost_code() {
    lost_lease_terminates_the_command(|srv| {
        assert_eq!(srv.cmd(&["DEL", "redlease:{victim}"]).as_int(), Some(1));
    });
}

#[test]
fn killing_redis_terminates_the_command_with_the_lost_code() {
    lost_lease_terminates_the_command(|srv| srv.kill());
}

#[test]
fn a_command_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "grace");
    let (ready, marker) = (dir.join("ready"), dir.join("marker"));
    // The trap swallows SIGTERM and keeps running.
    let script = trapping(&ready, &marker, "true");
    let run = redlease(
        &srv,
        &[
            "run", "--ttl", "600ms", "--grace", "300ms", "stubborn", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    assert!(wait_for(SOON, || read(&ready).contains("ready")));
    srv.cmd(&["DEL", "redlease:{stubborn}"]);
    let out = finish(run);
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", stderr(&out));
    assert!(read(&marker).contains("TERM"));
}

#[test]
fn sigterm_to_the_tool_is_forwarded_to_the_command() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "forward");
    let (ready, marker) = (dir.join("ready"), dir.join("marker"));
    let script = trapping(&ready, &marker, "exit 42");
    let run = redlease(&srv, &["run", "fwd", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    assert!(wait_for(SOON, || read(&ready).contains("ready")));
    let killed = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = finish(run);
    // The command handled it and exited 42; the tool passes that on and releases.
    assert_eq!(out.status.code(), Some(42), "{}", stderr(&out));
    assert!(read(&marker).contains("TERM"));
    assert!(!held(&srv, "redlease:{fwd}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_force_release_print_what_they_see_and_delete() {
    let srv = RedisServer::start();
    let opts = LockOptions::new().holder_label("batch-7");
    let locks =
        LockManager::with_options(RedisBackend::connect(&srv.url()).await.unwrap(), opts).unwrap();
    let guard = locks.lock("nightly").acquire().await.unwrap();
    let token = guard.fencing_token();

    let cmd = redlease(&srv, &["inspect", "nightly"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(text.contains("held: yes"), "{text}");
    assert!(text.contains("holder: batch-7"), "{text}");
    assert!(text.contains(&format!("fencing token: {token}")), "{text}");
    assert!(text.contains("key: redlease:{nightly}"), "{text}");

    // Without --force: refused, nothing released.
    let cmd = redlease(&srv, &["release", "nightly"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(EXIT_USAGE));
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    assert!(held(&srv, "redlease:{nightly}"));

    let cmd = redlease(&srv, &["release", "nightly", "--force"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(text.contains("released redlease:{nightly}"), "{text}");
    assert!(text.contains("holder: batch-7"), "{text}");
    assert!(!held(&srv, "redlease:{nightly}"));
    // The holder finds out: its lease is gone.
    assert!(matches!(
        guard.release().await,
        Err(redlease::Error::NotHeld)
    ));

    let cmd = redlease(&srv, &["release", "nightly", "--force"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert!(
        stdout(&out).contains("not held: nothing released"),
        "{}",
        stdout(&out)
    );

    let cmd = redlease(&srv, &["inspect", "never-used"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert!(stdout(&out).contains("held: no"), "{}", stdout(&out));
}

#[test]
fn bad_input_and_unreachable_servers_get_clear_messages() {
    let srv = RedisServer::start();
    let out = output(redlease(&srv, &["run", "--ttl", "soon", "x", "--", "true"]));
    assert_eq!(out.status.code(), Some(EXIT_USAGE));
    assert!(stderr(&out).contains("--ttl"), "{}", stderr(&out));

    let out = output(redlease(&srv, &["run", "--ttl", "1ms", "x", "--", "true"]));
    assert_eq!(out.status.code(), Some(EXIT_USAGE));
    assert!(stderr(&out).contains("ttl"), "{}", stderr(&out));

    let mut cmd = redlease(&srv, &["--connect-timeout", "1s", "inspect", "x"]);
    cmd.env("REDIS_URL", "redis://user:secret@127.0.0.1:1");
    let out = output(cmd);
    assert_eq!(out.status.code(), Some(EXIT_UNAVAILABLE));
    let err = stderr(&out);
    assert!(
        err.contains("cannot reach Redis at redis://***@127.0.0.1:1"),
        "{err}"
    );
    assert!(!err.contains("secret"), "{err}");
    // A password with an `@` in it is masked whole.
    let mut cmd = redlease(&srv, &["--connect-timeout", "1s", "inspect", "x"]);
    cmd.env("REDIS_URL", "redis://user:p@ss@127.0.0.1:1");
    let err = stderr(&output(cmd));
    assert!(err.contains("redis://***@127.0.0.1:1"), "{err}");
    assert!(!err.contains("ss@"), "{err}");
    // `--help` names REDIS_URL but never shows its value.
    let mut cmd = redlease(&srv, &["--help"]);
    cmd.env("REDIS_URL", "redis://user:s3cret@127.0.0.1:1");
    let help = stdout(&output(cmd));
    assert!(
        help.contains("REDIS_URL") && !help.contains("s3cret"),
        "{help}"
    );

    let mut cmd = redlease(&srv, &["inspect", "x"]);
    cmd.env("REDIS_URL", "http://127.0.0.1");
    let out = output(cmd);
    assert_eq!(out.status.code(), Some(EXIT_USAGE));
    assert!(stderr(&out).contains("scheme"), "{}", stderr(&out));

    // The URL from a file: not both --url and --url-file, the file must be there and hold a URL.
    let out = output(redlease(
        &srv,
        &[
            "--url",
            "redis://127.0.0.1:1",
            "--url-file",
            "/nonexistent/url",
            "inspect",
            "x",
        ],
    ));
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", stderr(&out));
    assert!(stderr(&out).contains("--url-file"), "{}", stderr(&out));
    let out = output(redlease(
        &srv,
        &["--url-file", "/nonexistent/url", "inspect", "x"],
    ));
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("/nonexistent/url"),
        "{}",
        stderr(&out)
    );
    let empty = srv.dir().join("empty-url");
    std::fs::write(&empty, "\n").unwrap();
    let out = output(redlease(
        &srv,
        &["--url-file", empty.to_str().unwrap(), "inspect", "x"],
    ));
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", stderr(&out));
    assert!(stderr(&out).contains("empty"), "{}", stderr(&out));

    let out = output(redlease(&srv, &["--help"]));
    let help = stdout(&out);
    assert!(
        help.contains("Examples:") && help.contains("Exit codes"),
        "{help}"
    );
}

/// `--wait 0` is one attempt (like `flock -w 0`): it takes a free lock, and gives the timeout
/// code on a held one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_zero_takes_a_free_lock_and_times_out_on_a_held_one() {
    let srv = RedisServer::start();
    let cmd = redlease(
        &srv,
        &["run", "--wait", "0s", "zero", "--", "sh", "-c", "exit 5"],
    );
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));

    let locks = LockManager::new(RedisBackend::connect(&srv.url()).await.unwrap());
    let held = locks.lock("zero").acquire().await.unwrap();
    let cmd = redlease(&srv, &["run", "--wait", "0s", "zero", "--", "true"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(EXIT_TIMEOUT), "{}", stderr(&out));
    held.release().await.unwrap();
}

/// A lost lease stops everything the command started, not just the command: it runs in a
/// process group of its own, and the group gets the SIGTERM.
#[test]
fn a_lost_lease_also_stops_the_commands_children() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "group");
    let pidfile = dir.join("grandchild");
    let script = format!("sleep 300 & echo $! > {p}; wait", p = pidfile.display());
    let run = redlease(
        &srv,
        &[
            "run", "--ttl", "600ms", "--grace", "2s", "family", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    assert!(
        wait_for(SOON, || !read(&pidfile).trim().is_empty()),
        "the grandchild started"
    );
    let pid: u32 = read(&pidfile).trim().parse().unwrap();
    assert_eq!(srv.cmd(&["DEL", "redlease:{family}"]).as_int(), Some(1));
    let out = finish(run);
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", stderr(&out));
    // The group's SIGTERM was sent before the tool exited; the grandchild dies of it.
    assert!(
        wait_for(SOON, || !alive(pid)),
        "the grandchild {pid} outlived the lease"
    );
}

/// Whether process `pid` is running: not gone, and not a zombie waiting to be reaped (by
/// whoever adopted it). Reads /proc: false where there is none.
fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// The state letter and process group of `pid`, from /proc.
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid pgrp ...`; comm may hold spaces and parentheses.
    let mut fields = text.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let pgrp = fields.nth(1)?.parse().ok()?;
    Some((state, pgrp))
}

/// The running processes of process group `pgid`.
#[cfg(target_os = "linux")]
fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| matches!(stat(pid), Some((state, g)) if g == pgid && state != 'Z' && state != 'X'))
        .collect()
}

/// The pid a script wrote to `path`, once it is there.
#[cfg(target_os = "linux")]
fn pid_in(path: &Path) -> u32 {
    assert!(
        wait_for(SOON, || read(path).trim().parse::<u32>().is_ok()),
        "no pid in {}",
        path.display()
    );
    read(path).trim().parse().unwrap()
}

/// SIGKILLs, when dropped, the processes whose pids are in these files, so that a failing
/// test leaves nothing running.
#[cfg(target_os = "linux")]
struct Leftovers(Vec<PathBuf>);

#[cfg(target_os = "linux")]
impl Drop for Leftovers {
    fn drop(&mut self) {
        for path in &self.0 {
            if let Ok(pid) = read(path).trim().parse::<u32>() {
                if alive(pid) {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                }
            }
        }
    }
}

/// `kill -9` of `redlease run` leaves nothing running: the command, and what it started in
/// its process group, are killed with it (otherwise they would run on without the lock, and
/// another run would take it once the lease expired).
#[test]
#[cfg(target_os = "linux")]
fn the_command_dies_with_a_killed_redlease() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "orphan");
    let (pidfile, childfile) = (dir.join("pid"), dir.join("child"));
    let _leftovers = Leftovers(vec![pidfile.clone(), childfile.clone()]);
    let script = format!(
        "sleep 300 & echo $! > {c}; echo $$ > {p}; wait",
        c = childfile.display(),
        p = pidfile.display()
    );
    let mut run = redlease(&srv, &["run", "orphan", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let (pid, child) = (pid_in(&pidfile), pid_in(&childfile));
    run.kill().unwrap();
    run.wait().unwrap();
    assert!(
        wait_for(SOON, || !alive(pid) && !alive(child)),
        "the command ({pid}: {}) or its child ({child}: {}) outlived redlease",
        alive(pid),
        alive(child)
    );
}

/// What `pkill -9 -f redlease` does, to this run only: `kill -9` of every process of the run
/// whose argv names redlease (`redlease run` and its supervisor), at once, i.e. neither acts
/// on the other's death; the command's group is then checked: nothing of it runs on, though
/// nobody is left to hold the lock. The command ignores SIGTERM and SIGHUP, and has a
/// pipeline and a child shell with a child of its own in the background. Its argv and paths
/// are relative (it runs in its own directory), so that only redlease's own processes match;
/// its output goes elsewhere, so that redlease's pipes close when redlease's processes are
/// gone.
#[test]
#[cfg(target_os = "linux")]
fn the_group_dies_when_redlease_and_its_supervisor_are_killed_together() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "both-killed");
    std::fs::write(
        dir.join("job.sh"),
        "exec < /dev/null > /dev/null 2>&1\n\
         trap '' TERM HUP INT\n\
         sleep 300 | cat &\n\
         echo $! > pipe.pid\n\
         sh -c 'sleep 300 & echo $! > grandchild.pid; wait' &\n\
         echo $$ > command.pid\n\
         wait\n",
    )
    .unwrap();
    let mut cmd = redlease(&srv, &["run", "--ttl", "3s", "both", "--", "sh", "job.sh"]);
    cmd.current_dir(&dir);
    let run = cmd.spawn().unwrap();
    let command = pid_in(&dir.join("command.pid"));
    let pipe = pid_in(&dir.join("pipe.pid"));
    let grandchild = pid_in(&dir.join("grandchild.pid"));
    let (_, group) = stat(command).expect("the command runs");
    let _leftovers = GroupLeftovers(group);
    let mut named: Vec<u32> = descendants(run.id())
        .into_iter()
        .chain([run.id()])
        .filter(|&pid| cmdline(pid).contains("redlease"))
        .collect();
    named.sort_unstable();
    let mut expected = vec![run.id(), group];
    expected.sort_unstable();
    assert_eq!(
        named, expected,
        "redlease run and its supervisor (the group's leader)"
    );
    // At once: neither may act on the other's death. `redlease run` is stopped first (every
    // thread of it), then the supervisor is killed, then `redlease run`. (Stopping the
    // supervisor instead would not do: a stopped member makes the kernel send SIGHUP and
    // SIGCONT to a group that its parent's death orphans, and it could act on that.)
    let signal = |sig: &str, pids: &[u32]| {
        let sent = Command::new("kill")
            .arg(sig)
            .args(pids.iter().map(u32::to_string))
            .status()
            .unwrap();
        assert!(sent.success(), "kill {sig} {pids:?}");
    };
    signal("-STOP", &[run.id()]);
    assert!(wait_for(SOON, || stopped(run.id())), "redlease run stopped");
    signal("-KILL", &[group, run.id()]);
    let out = finish(run);
    assert_eq!(out.status.signal(), Some(9));
    assert!(
        wait_for(SOON, || group_members(group).is_empty()),
        "left running without the lock: {:?} (command {command}, pipeline {pipe}, \
         grandchild {grandchild})",
        group_members(group)
    );
}

/// The pids of `pid`'s descendants (running or not yet reaped), from /proc.
#[cfg(target_os = "linux")]
fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|p| Some((p, ppid(p)?)))
                .collect()
        })
        .unwrap_or_default();
    let mut found = vec![pid];
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(
            parents
                .iter()
                .filter(|&&(_, pp)| pp == parent)
                .map(|&(p, _)| p),
        );
        next += 1;
    }
    found.remove(0);
    found
}

/// Whether every thread of `pid` is stopped (by a signal), from /proc.
#[cfg(target_os = "linux")]
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|text| {
            text.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T")
        })
    })
}

/// The parent of `pid`, from /proc.
#[cfg(target_os = "linux")]
fn ppid(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    text.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The argv of `pid`, its words joined by spaces (as `pkill -f` matches it).
#[cfg(target_os = "linux")]
fn cmdline(pid: u32) -> String {
    let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&argv).replace('\0', " ")
}

/// SIGKILLs, when dropped, what is left of process group `pgid`, so that a failing test
/// leaves nothing running.
#[cfg(target_os = "linux")]
struct GroupLeftovers(u32);

#[cfg(target_os = "linux")]
impl Drop for GroupLeftovers {
    fn drop(&mut self) {
        if !group_members(self.0).is_empty() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.0)])
                .status();
        }
    }
}

/// On a lost lease, a worker of the command's group that ignores SIGTERM gets SIGKILL once
/// the grace period is over, though the command itself obeyed SIGTERM at once.
#[test]
#[cfg(target_os = "linux")]
fn a_lost_lease_kills_the_whole_group_after_the_grace_period() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "stubborn-worker");
    let (leader, worker, worker_sh) = (dir.join("leader"), dir.join("worker"), dir.join("w.sh"));
    let _leftovers = Leftovers(vec![leader.clone(), worker.clone()]);
    std::fs::write(
        &worker_sh,
        format!(
            "trap '' TERM; echo $$ > {w}; while :; do sleep 0.02; done",
            w = worker.display()
        ),
    )
    .unwrap();
    let script = format!(
        "sh {sh} & echo $$ > {l}; wait",
        sh = worker_sh.display(),
        l = leader.display()
    );
    let run = redlease(
        &srv,
        &[
            "run", "--ttl", "600ms", "--grace", "300ms", "crew", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    let (leader, worker) = (pid_in(&leader), pid_in(&worker));
    let (_, group) = stat(worker).expect("the worker runs");
    assert_eq!(stat(leader).map(|(_, g)| g), Some(group), "one group");
    assert_eq!(srv.cmd(&["DEL", "redlease:{crew}"]).as_int(), Some(1));
    let out = finish(run);
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", stderr(&out));
    assert!(
        wait_for(SOON, || group_members(group).is_empty()),
        "left in the group after the grace period: {:?} (worker {worker})",
        group_members(group)
    );
}

/// The lock is held until every process of the command's group has exited, as flock(1)'s
/// descriptor is while a background child that inherited it runs: a process the command left
/// running in the background keeps a second run out, and the tool exits (with the command's
/// code) only when it is gone.
#[test]
#[cfg(target_os = "linux")]
fn the_lock_is_held_until_the_commands_background_processes_exit() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "background");
    let (leader, bg, bg_sh, go) = (
        dir.join("leader"),
        dir.join("bg"),
        dir.join("bg.sh"),
        dir.join("go"),
    );
    let _leftovers = Leftovers(vec![bg.clone()]);
    std::fs::write(
        &bg_sh,
        format!("while [ ! -e {g} ]; do sleep 0.02; done", g = go.display()),
    )
    .unwrap();
    let script = format!(
        "sh {sh} & echo $! > {b}; echo $$ > {l}; exit 7",
        sh = bg_sh.display(),
        b = bg.display(),
        l = leader.display()
    );
    let mut run = redlease(
        &srv,
        &["run", "--ttl", "2s", "shared", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    let (leader, bg) = (pid_in(&leader), pid_in(&bg));
    assert!(wait_for(SOON, || !alive(leader)), "the command exited");
    assert!(alive(bg), "the background process runs");

    let out = output(redlease(
        &srv,
        &["run", "--no-wait", "shared", "--", "true"],
    ));
    assert_eq!(
        out.status.code(),
        Some(EXIT_CONFLICT),
        "a second run got the lock while the first command's background process ran: {}",
        stderr(&out)
    );
    assert!(
        run.try_wait().unwrap().is_none(),
        "the first run still holds"
    );

    std::fs::write(&go, "").unwrap();
    let out = finish(run);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert!(!alive(bg));
    let out = output(redlease(
        &srv,
        &["run", "--no-wait", "shared", "--", "true"],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// A URL with a password, from REDIS_URL or `--url-file`, is in no process's argv, and the
/// command's environment does not have it: REDIS_URL is removed when the URL came from it.
#[test]
#[cfg(target_os = "linux")]
fn the_url_stays_out_of_argv_and_the_commands_environment() {
    const PASSWORD: &str = "pw-for-the-argv-test-91c3";
    let srv = RedisServer::start_with(&["--requirepass", PASSWORD]);
    let url = format!("redis://default:{PASSWORD}@127.0.0.1:{}", srv.port());
    let url_file = srv.dir().join("url");
    std::fs::write(&url_file, format!("{url}\n")).unwrap();

    let mut from_env = redlease(&srv, &[]);
    from_env.env("REDIS_URL", &url);
    // The file wins over REDIS_URL, which is then not redlease's, and reaches the command as
    // it is (it may name the command's own store).
    let theirs = "redis://127.0.0.1:1/3";
    let mut from_file = redlease(&srv, &["--url-file", url_file.to_str().unwrap()]);
    from_file.env("REDIS_URL", theirs);

    for (how, mut cmd) in [("REDIS_URL", from_env), ("--url-file", from_file)] {
        let dir = scratch(&srv, &how.replace('-', ""));
        let (env, parent, ready, go) = (
            dir.join("env"),
            dir.join("parent"),
            dir.join("ready"),
            dir.join("go"),
        );
        let script = format!(
            "env > {e}; tr '\\0' ' ' < /proc/$PPID/cmdline > {p}; echo ready > {r}; \
             while [ ! -e {g} ]; do sleep 0.02; done",
            e = env.display(),
            p = parent.display(),
            r = ready.display(),
            g = go.display()
        );
        cmd.args(["run", "secret", "--", "sh", "-c", &script]);
        let run = cmd.spawn().unwrap();
        let ready_soon = wait_for(SOON, || read(&ready).contains("ready"));
        let argv = std::fs::read(format!("/proc/{}/cmdline", run.id())).unwrap_or_default();
        let argv = String::from_utf8_lossy(&argv).replace('\0', " ");
        std::fs::write(&go, "").unwrap();
        let out = finish(run);
        assert!(ready_soon, "{how}: the command ran: {}", stderr(&out));
        assert_eq!(out.status.code(), Some(0), "{how}: {}", stderr(&out));
        assert!(
            argv.contains("secret") && !argv.contains(PASSWORD),
            "{how}: {argv}"
        );
        let parent = read(&parent);
        assert!(!parent.contains(PASSWORD), "{how}: {parent}");
        let env = read(&env);
        assert!(env.contains("REDLEASE_NAME=secret"), "{how}: {env}");
        assert!(!env.contains(PASSWORD), "{how}: {env}");
        let redis_url: Vec<&str> = env
            .lines()
            .filter(|l| l.starts_with("REDIS_URL="))
            .collect();
        if how == "REDIS_URL" {
            assert_eq!(redis_url, Vec::<&str>::new(), "{how}");
        } else {
            assert_eq!(redis_url, [format!("REDIS_URL={theirs}")], "{how}");
        }
    }
}

/// Signals that reach the tool while a command stopped for a lost lease is in its grace
/// period are forwarded too: here SIGINT makes the command exit long before the grace is over.
#[test]
fn signals_during_the_grace_period_are_forwarded() {
    let srv = RedisServer::start();
    let dir = scratch(&srv, "grace-forward");
    let (ready, marker) = (dir.join("ready"), dir.join("marker"));
    let script = format!(
        "trap 'echo TERM >> {m}' TERM; trap 'echo INT >> {m}; exit 0' INT; \
         echo ready > {r}; while :; do sleep 0.02; done",
        m = marker.display(),
        r = ready.display()
    );
    let run = redlease(
        &srv,
        &[
            "run", "--ttl", "600ms", "--grace", "60s", "patient", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    assert!(wait_for(SOON, || read(&ready).contains("ready")));
    assert_eq!(srv.cmd(&["DEL", "redlease:{patient}"]).as_int(), Some(1));
    assert!(
        wait_for(SOON, || read(&marker).contains("TERM")),
        "the command got the lost lease's SIGTERM"
    );
    let sent = Command::new("kill")
        .args(["-INT", &run.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = finish(run);
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", stderr(&out));
    assert!(read(&marker).contains("INT"), "{}", read(&marker));
}

/// A command that signals its own process group (`kill 0`, common in shell scripts that
/// clean up after themselves) still ends with its own exit code.
#[test]
fn a_command_that_signals_its_own_group_keeps_its_exit_code() {
    let srv = RedisServer::start();
    let out = output(redlease(
        &srv,
        &[
            "run",
            "selfish",
            "--",
            "sh",
            "-c",
            "trap '' TERM HUP USR1; kill 0; kill -HUP 0; kill -USR1 0; exit 5",
        ],
    ));
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
}
