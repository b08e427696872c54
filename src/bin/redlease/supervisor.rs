//! The command's keeper, on Linux. `redlease run` does not start the command itself: it
//! starts `redlease supervise --parent PID -- COMMAND...` (this binary again) as the leader of
//! a new process group, and the supervisor starts the command in that group. The supervisor:
//!
//! - **dies with `redlease`, and takes the group with it.** Its parent-death signal
//!   (`PR_SET_PDEATHSIG`) tells it when `redlease` is gone, even by SIGKILL, and it then
//!   SIGKILLs the whole group, itself included: nothing runs on without the lease.
//! - **lives as long as the group.** It exits only once the command *and* every process the
//!   command left running in its group have exited, so `redlease` holds the lock until then,
//!   as flock(1)'s inherited descriptor keeps a lock while a background child runs.
//! - **reaps the group.** It is their subreaper (`PR_SET_CHILD_SUBREAPER`): an orphan of the
//!   group is its child and is reaped by it, not left a zombie that would look like a member.
//! - **hands on the command's exit:** its code, or 128 + N for a death by signal N (what
//!   `redlease` reports either way).
//! - **has a keeper, for when it dies too.** Killed together with `redlease` (`kill -9` of
//!   both, `pkill -9 -f redlease`), the supervisor can do nothing, and the group would run on
//!   without the lease (reparented above us, where nobody kills it). So before the command
//!   starts, the supervisor starts a keeper (`redlease keep`, this binary again, shown in `ps`
//!   as `lease-keeper`, so that a pattern that names redlease does not match it), outside the
//!   group, holding one end of a socket pair whose other end only the supervisor holds. The
//!   kernel closes that end when the supervisor dies however it dies, and the keeper then
//!   SIGKILLs the group. A supervisor that ends normally (the group is empty) dismisses it
//!   first with a byte on the socket. The command's own parent-death signal would not do:
//!   it reaches the command only (not what it started), and can be set only between fork and
//!   exec (`unsafe` in std), or by a third exec in between that a set-uid command clears.
//!
//! Why a process of its own: the parent-death signal must be set in the child between fork
//! and exec, which std offers only through `CommandExt::pre_exec`, an `unsafe` function, and
//! the crate forbids `unsafe` code. A process can set it on itself with a safe call, so the
//! child is this binary, which sets it before it starts the command. It stays, rather than
//! exec'ing the command, because only a live process can kill the rest of the group when
//! `redlease` dies, and wait for it.
//!
//! The parent-death signal fires when the *thread* that spawned the process exits: `redlease`
//! spawns the supervisor from its main thread (the future given to `block_on`), which lives as
//! long as the process.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use nix::errno::Errno;
use nix::sys::prctl;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpgrp, getppid, Pid};
use tokio::signal::unix::{signal, SignalKind};

use super::{EXIT_CANNOT_RUN, EXIT_NOT_FOUND, EXIT_USAGE};

/// The running binary, as the kernel knows it: this path still works when the file has been
/// replaced or deleted since `redlease` started (an upgrade while a job runs).
const SELF_EXE: &str = "/proc/self/exe";

/// The signal the kernel sends the supervisor when `redlease` dies. It is caught like the
/// others: each of them makes the supervisor look whether its parent is still there.
const PARENT_DEATH: Signal = Signal::SIGHUP;

/// The keeper's argv[0]: what `ps` shows, and what `pkill -f` matches. It does not contain
/// "redlease" on purpose (see the module docs).
const KEEPER_NAME: &str = "lease-keeper";

/// What `redlease run` spawns to run `program` with `args`: the supervisor, told who its
/// parent is.
pub(super) fn command(program: &OsString, args: &[OsString]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(SELF_EXE);
    cmd.arg0("redlease")
        .arg("supervise")
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--")
        .arg(program)
        .args(args);
    cmd
}

/// What to tell the user when the supervisor itself cannot be started.
pub(super) fn cannot_start(e: &std::io::Error) -> String {
    format!("cannot start the command's supervisor ({SELF_EXE}): {e}")
}

/// `redlease supervise`: runs `command` for the `redlease run` process `parent` (see the
/// module docs) and returns the exit code to hand on.
pub(super) fn main(parent: u32, command: &[OsString]) -> u8 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("redlease: cannot start the async runtime: {e}");
            return EXIT_CANNOT_RUN;
        }
    };
    match runtime.block_on(supervise(parent, command)) {
        // The group is empty: the keeper has nothing left to guard.
        Ok((code, keeper)) => {
            keeper.dismiss();
            code
        }
        // The keeper, if it was started, is not dismissed: it kills whatever is left of the
        // group once this process is gone.
        Err(msg) => {
            eprintln!("redlease: {msg}");
            EXIT_CANNOT_RUN
        }
    }
}

/// Runs the command and waits for its group; the command's exit code, and the keeper to
/// dismiss now that the group is empty.
async fn supervise(parent: u32, command: &[OsString]) -> Result<(u8, Keeper), String> {
    let parent = i32::try_from(parent)
        .map(Pid::from_raw)
        .map_err(|_| format!("supervise: bad parent pid {parent}"))?;
    let (program, args) = command
        .split_first()
        .ok_or_else(|| "supervise: no command given".to_owned())?;
    // The handlers first: the group's signals (forwarded by `redlease`, or a command's
    // `kill 0`) must not kill the supervisor, and the parent-death signal must find one.
    let mut signals = Signals::new().map_err(|e| format!("cannot listen for signals: {e}"))?;
    prctl::set_child_subreaper(true)
        .and_then(|()| prctl::set_pdeathsig(PARENT_DEATH))
        .map_err(|e| format!("cannot tie the command to redlease (prctl): {e}"))?;
    // `redlease` may have died before the signal was set: nothing would tell us later.
    if getppid() != parent {
        return Err("redlease exited before the command started".into());
    }
    let group = getpgrp();
    // Before the command: from its first instant, the group has someone to kill it if this
    // process dies with `redlease`.
    let keeper =
        Keeper::start(group).map_err(|e| format!("cannot start the group's keeper: {e}"))?;
    let child = match std::process::Command::new(program).args(args).spawn() {
        Ok(child) => child,
        Err(e) => {
            let shown = program.to_string_lossy();
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => {
                    eprintln!("redlease: {shown}: command not found");
                    EXIT_NOT_FOUND
                }
                _ => {
                    eprintln!("redlease: {shown}: cannot run it: {e}");
                    EXIT_CANNOT_RUN
                }
            };
            return Ok((code, keeper));
        }
    };
    let pid = i32::try_from(child.id())
        .map(Pid::from_raw)
        .map_err(|_| format!("the command's pid {} is out of range", child.id()))?;
    // `reap` waits with waitpid, so nothing else may wait for the command: `child` is only
    // dropped (which neither waits nor kills).
    drop(child);
    let shown = program.to_string_lossy().into_owned();
    let reaper = tokio::task::spawn_blocking(move || reap(group, pid, &shown));
    tokio::pin!(reaper);
    loop {
        tokio::select! {
            code = &mut reaper => {
                let code = code.map_err(|e| format!("waiting for the command: {e}"))?;
                return Ok((code, keeper));
            }
            () = signals.recv() => {
                if getppid() != parent {
                    // `redlease` is gone and nobody renews the lease: stop everything now.
                    let _ = killpg(group, Signal::SIGKILL);
                }
            }
        }
    }
}

/// Waits (blocking) for the command, then for the rest of its process group; returns the
/// command's exit code, or 128 + N if signal N killed it.
fn reap(group: Pid, command: Pid, shown: &str) -> u8 {
    let code = loop {
        match waitpid(command, None) {
            Ok(WaitStatus::Exited(_, code)) => break u8::try_from(code & 0xff).unwrap_or(1),
            Ok(WaitStatus::Signaled(_, sig, _)) => {
                break u8::try_from(128 + sig as i32).unwrap_or(255)
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                eprintln!("redlease: waiting for {shown}: {e}");
                break EXIT_CANNOT_RUN;
            }
        }
    };
    // The command's orphans in the group are our children now (we are their subreaper):
    // wait for each, until none is left (ECHILD). A process that left the group (setsid) is
    // not waited for; it was on its own from then on.
    let in_group = Pid::from_raw(-group.as_raw());
    let mut told = false;
    loop {
        let flags = if told {
            None
        } else {
            Some(WaitPidFlag::WNOHANG)
        };
        match waitpid(in_group, flags) {
            Ok(WaitStatus::StillAlive) => {
                eprintln!(
                    "redlease: {shown} exited; waiting for the processes it left running in \
                     its process group"
                );
                told = true;
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    code
}

/// The supervisor's side of the keeper (see the module docs): the socket whose closing sets
/// the keeper off, and the keeper's process.
struct Keeper {
    line: UnixStream,
    process: std::process::Child,
}

impl Keeper {
    /// Starts `redlease keep --group GROUP` in a process group of its own (the command's
    /// group is for the command: the supervisor waits for all of it), with its end of the
    /// socket pair as its stdin. Both ends are close-on-exec: the command does not inherit
    /// ours (else the keeper would not hear of our death while the command lived).
    fn start(group: Pid) -> std::io::Result<Self> {
        let (line, theirs) = UnixStream::pair()?;
        let process = std::process::Command::new(SELF_EXE)
            .arg0(KEEPER_NAME)
            .arg("keep")
            .arg("--group")
            .arg(group.as_raw().to_string())
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()?;
        Ok(Keeper { line, process })
    }

    /// Tells the keeper that the group is done, and waits for it to exit. Runs after the
    /// runtime is gone: the keeper exits as soon as it reads the byte (or is gone already).
    fn dismiss(mut self) {
        // A failed write means the keeper is gone already: nothing to dismiss.
        let _ = self.line.write_all(&[1]);
        drop(self.line);
        let _ = self.process.wait();
    }
}

/// `redlease keep --group GROUP`: waits on stdin for the supervisor's byte (the group is
/// done: exit) or for the end of the stream (the supervisor died: SIGKILL the group).
pub(super) fn keep(group: u32) -> u8 {
    let group = match i32::try_from(group) {
        Ok(g) if g > 1 => Pid::from_raw(g),
        _ => {
            eprintln!("redlease: keep: bad process group {group}");
            return EXIT_USAGE;
        }
    };
    let mut byte = [0_u8; 1];
    let dismissed = loop {
        match std::io::stdin().lock().read(&mut byte) {
            Ok(n) => break n == 1,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // The supervisor cannot be watched any longer: as if it had died.
            Err(_) => break false,
        }
    };
    if dismissed {
        return 0;
    }
    // One signal reaches every member, and one forking at this instant too (the kernel
    // gives a group's signal to a child forked while it is sent).
    if killpg(group, Signal::SIGKILL).is_ok() {
        // stderr may be a closed terminal by now: the message is best effort.
        let _ = writeln!(
            std::io::stderr(),
            "redlease: the supervisor of process group {group} died: sent SIGKILL to the group"
        );
    }
    0
}

/// The signals a process group commonly gets. The supervisor survives them all (they are
/// for the command), and looks after each whether `redlease` is still there.
struct Signals(Vec<tokio::signal::unix::Signal>);

impl Signals {
    fn new() -> std::io::Result<Self> {
        let kinds = [
            SignalKind::hangup(),
            SignalKind::interrupt(),
            SignalKind::terminate(),
            SignalKind::quit(),
            SignalKind::user_defined1(),
            SignalKind::user_defined2(),
            SignalKind::alarm(),
        ];
        kinds
            .into_iter()
            .map(signal)
            .collect::<std::io::Result<_>>()
            .map(Signals)
    }

    /// The next signal, whichever it is.
    async fn recv(&mut self) {
        let next = self.0.iter_mut().map(|s| Box::pin(s.recv()));
        // A stream ends only with the runtime; then there is nothing left to watch.
        if futures::future::select_all(next).await.0.is_none() {
            std::future::pending::<()>().await;
        }
    }
}
