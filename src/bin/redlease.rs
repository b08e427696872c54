//! `redlease`: a distributed flock(1) on Redis. Holds a lease while a command runs,
//! terminates the command if the lease is lost, and inspects or force-releases locks.
//! Run `redlease --help` for the options, examples and exit codes.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use redlease::{Error, LockGuard, LockManager, LockOptions, RedisBackend, RedisOptions};

// Beside this file, where cargo does not take it for a binary of its own.
#[cfg(target_os = "linux")]
#[path = "redlease/supervisor.rs"]
mod supervisor;

/// Exit code: the lock is held by someone else and `--no-wait` was given (flock's default;
/// change it with `-E`).
const EXIT_CONFLICT: u8 = 1;
/// Exit code: bad arguments or options (clap's own code for usage errors).
const EXIT_USAGE: u8 = 2;
/// Exit code: the lease was lost while the command ran; the command was terminated.
const EXIT_LOST: u8 = 3;
/// Exit code: `--wait` ran out before the lock was free.
const EXIT_TIMEOUT: u8 = 4;
/// Exit code: Redis could not be reached, or failed.
const EXIT_UNAVAILABLE: u8 = 5;
/// Exit code: the command was found but could not be run (as the shell's).
const EXIT_CANNOT_RUN: u8 = 126;
/// Exit code: the command was not found (as the shell's).
const EXIT_NOT_FOUND: u8 = 127;

const EXAMPLES: &str = "\
Examples:
  # Run a nightly job on at most one machine at a time; skip this run if it is busy:
  redlease run --no-wait nightly-report -- /usr/local/bin/report --since yesterday

  # In a crontab, with the server in REDIS_URL (quiet when another host has it):
  */5 * * * * REDIS_URL=redis://locks.internal:6379 redlease run -n sync -- /opt/sync.sh

  # A URL with a password: from a file (mode 600), not --url, which `ps` shows to anyone:
  redlease --url-file /etc/redlease/url run nightly-report -- /usr/local/bin/report

  # Wait up to 2 minutes for the lock, holding it with a 10 s lease (renewed while the
  # command runs); give the command 30 s to stop after a SIGTERM if the lease is lost:
  redlease run --wait 2m --ttl 10s --grace 30s migrate -- ./migrate.sh

  # At most 3 backups at once across the fleet (one of 3 permits of \"backup\"):
  redlease run --permits 3 backup -- /usr/local/bin/backup.sh

  # Who holds it, and for how long yet?
  redlease inspect nightly-report

  # Clear a lock by hand (prints what it deletes):
  redlease release nightly-report --force

The command gets REDLEASE_NAME and REDLEASE_FENCING_TOKEN in its environment: pass the
token with its writes so that the store can refuse a late write from a holder that lost
the lock (see the README, \"Fenced writes\"). When redlease's URL comes from REDIS_URL,
the command does not get REDIS_URL.

The command runs in a process group of its own. On Linux the lock is held until every
process of that group has exited, not just the command (as flock's descriptor is while a
background child that inherited it runs), and if redlease dies, even of SIGKILL, the whole
group is killed with it: nothing runs on without the lock. That holds too when redlease
and its `redlease supervise` process are killed together (`pkill -9 -f redlease`): a third
process, shown as `lease-keeper` in ps, then kills the group. A process that must outlive
the lock has to leave the group (setsid).

Exit codes of `run`:
  the command's own code   when it ran to its end with the lease held
  128+N                    the command died of signal N
  1                        the lock is held and --no-wait was given (change with -E)
  2                        bad arguments
  3                        the lease was lost: the command's group was sent SIGTERM (and
                           SIGKILL after --grace) and the tool gave up
  4                        --wait ran out
  5                        Redis could not be reached, or failed
  126, 127                 the command could not be run, or was not found";

/// Where Redis is when neither `--url`, `--url-file` nor `REDIS_URL` says.
const DEFAULT_URL: &str = "redis://127.0.0.1:6379";

/// The environment variable that may hold the URL; the command never sees it.
const URL_ENV: &str = "REDIS_URL";

/// A distributed flock(1): hold a lock on Redis while a command runs.
#[derive(Debug, Parser)]
#[command(name = "redlease", version, after_long_help = EXAMPLES)]
struct Cli {
    /// The Redis server, e.g. redis://user:password@host:6379 [env: REDIS_URL] [default:
    /// redis://127.0.0.1:6379]. Any user of the machine can read it in `ps`: give a URL with
    /// a password in REDIS_URL or --url-file instead.
    #[arg(long, value_name = "URL", global = true, conflicts_with = "url_file")]
    url: Option<String>,

    /// Read the Redis URL from this file (keep it private, e.g. mode 600); it wins over
    /// REDIS_URL, which the command then gets as it is.
    #[arg(long, value_name = "PATH", global = true)]
    url_file: Option<PathBuf>,

    /// Prefix of the lock's keys (as `LockOptions::key_prefix` in the library).
    #[arg(long, default_value = "redlease:", global = true)]
    prefix: String,

    /// How long to wait for Redis to answer when connecting.
    #[arg(long, default_value = "5s", value_parser = duration, global = true)]
    connect_timeout: Duration,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hold the lock NAME (or one of its --permits) while COMMAND runs (waits for it unless
    /// --no-wait or --wait).
    Run(RunArgs),
    /// Print who holds the lock NAME, for how long yet, its fencing token and queue.
    Inspect {
        /// The lock's name.
        name: String,
    },
    /// End the lease on NAME whoever holds it (needs --force), and print what was released.
    Release {
        /// The lock's name.
        name: String,
        /// Yes, delete another holder's lease: it will find out when its next renewal fails.
        #[arg(long)]
        force: bool,
    },
    /// Internal: what `run` starts on Linux to run COMMAND and keep it tied to `redlease`
    /// (see src/bin/redlease/supervisor.rs).
    #[command(hide = true)]
    Supervise {
        /// The `redlease run` process: when it dies, the command's process group is killed.
        #[arg(long)]
        parent: u32,
        /// The command and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// Internal: what the supervisor starts on Linux (shown as `lease-keeper`) to SIGKILL the
    /// command's process group if the supervisor dies before the group is done, e.g. killed
    /// together with `redlease` (see src/bin/redlease/supervisor.rs).
    #[command(hide = true)]
    Keep {
        /// The command's process group (the supervisor's pid).
        #[arg(long)]
        group: u32,
    },
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The lock's name.
    name: String,

    /// The lease's time to live; renewed every third of it while the command runs. A
    /// crashed `redlease` frees the lock after at most this long.
    #[arg(long, default_value = "30s", value_parser = duration)]
    ttl: Duration,

    /// Wait at most this long for the lock (e.g. 500ms, 10s, 2m); default: as long as it
    /// takes.
    #[arg(short, long, value_parser = duration, conflicts_with = "no_wait")]
    wait: Option<Duration>,

    /// Fail at once (exit 1, or -E) if the lock is held.
    #[arg(short, long)]
    no_wait: bool,

    /// Hold one of N permits of NAME instead of the lock itself: at most N commands run
    /// under NAME at once (a semaphore, like `consul lock -n`). Each gets its permit's own
    /// fencing token.
    #[arg(short, long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    permits: Option<u32>,

    /// Exit code when the lock is held and --no-wait was given.
    #[arg(short = 'E', long, default_value_t = EXIT_CONFLICT)]
    conflict_exit_code: u8,

    /// Who holds the lock, as `inspect` shows it. Default: host:pid.
    #[arg(short, long)]
    label: Option<String>,

    /// Stop renewing the lease after this long: the command is then terminated as on a
    /// lost lease.
    #[arg(long, value_parser = duration)]
    max_hold: Option<Duration>,

    /// After a lost lease, how long the command has to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value = "10s", value_parser = duration)]
    grace: Duration,

    /// The command and its arguments (put `--` before it if it has options of its own).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 500ms, 10s, 2m, 1h)"))
}

/// An error to print, with the exit code that goes with it.
struct Fail(u8, String);

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Supervise { parent, command } = &cli.command {
        return ExitCode::from(supervise(*parent, command));
    }
    if let Command::Keep { group } = &cli.command {
        return ExitCode::from(keep(*group));
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("redlease: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    let code = runtime.block_on(async {
        let result = match &cli.command {
            Command::Run(args) => run(&cli, args).await,
            Command::Inspect { name } => inspect(&cli, name).await,
            Command::Release { name, force } => release(&cli, name, *force).await,
            // Run before the runtime starts, above.
            Command::Supervise { .. } | Command::Keep { .. } => Ok(0),
        };
        result.unwrap_or_else(|Fail(code, msg)| {
            eprintln!("redlease: {msg}");
            code
        })
    });
    // The background runtime's tasks (the watchdog, pub/sub) must not hold up the exit.
    runtime.shutdown_timeout(Duration::from_millis(200));
    ExitCode::from(code)
}

#[cfg(target_os = "linux")]
fn supervise(parent: u32, command: &[OsString]) -> u8 {
    supervisor::main(parent, command)
}

#[cfg(not(target_os = "linux"))]
fn supervise(_parent: u32, _command: &[OsString]) -> u8 {
    eprintln!("redlease: supervise is for Linux only");
    EXIT_USAGE
}

#[cfg(target_os = "linux")]
fn keep(group: u32) -> u8 {
    supervisor::keep(group)
}

#[cfg(not(target_os = "linux"))]
fn keep(_group: u32) -> u8 {
    eprintln!("redlease: keep is for Linux only");
    EXIT_USAGE
}

/// The URL without its password, for messages.
fn shown_url(url: &str) -> String {
    match url.split_once("://") {
        // The host is after the last `@` (a password may contain one).
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// The Redis URL and where it came from: `--url`, else `--url-file`, else `REDIS_URL`, else
/// the default. A blank `--url` or `REDIS_URL` (set but empty, as shells and cron do) means
/// the default; a blank file is an error.
fn url(cli: &Cli) -> Result<(String, String), Fail> {
    if let Some(url) = &cli.url {
        return Ok(match url.trim() {
            "" => (DEFAULT_URL.to_owned(), "the default".into()),
            url => (url.to_owned(), "--url".into()),
        });
    }
    if let Some(path) = &cli.url_file {
        let from = format!("--url-file {}", path.display());
        let text = std::fs::read_to_string(path)
            .map_err(|e| Fail(EXIT_USAGE, format!("cannot read {from}: {e}")))?;
        let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
        return match (lines.next(), lines.next()) {
            (Some(url), None) => Ok((url.to_owned(), from)),
            (None, _) => Err(Fail(
                EXIT_USAGE,
                format!("{from} is empty: write the URL in it"),
            )),
            (Some(_), Some(_)) => Err(Fail(
                EXIT_USAGE,
                format!("{from} holds more than one line: write the URL alone in it"),
            )),
        };
    }
    match std::env::var(URL_ENV) {
        Ok(url) if !url.trim().is_empty() => Ok((url.trim().to_owned(), URL_ENV.into())),
        Ok(_) | Err(std::env::VarError::NotPresent) => {
            Ok((DEFAULT_URL.to_owned(), "the default".into()))
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Fail(EXIT_USAGE, format!("{URL_ENV} is not valid UTF-8")))
        }
    }
}

/// Whether the URL comes from `REDIS_URL` (or would, were it set): then the command does not
/// get it. Given `--url` or `--url-file`, `REDIS_URL` is not ours, and the command keeps it
/// (it may be the command's own data store).
fn url_from_env(cli: &Cli) -> bool {
    cli.url.is_none() && cli.url_file.is_none()
}

async fn connect(cli: &Cli) -> Result<RedisBackend, Fail> {
    let opts = RedisOptions::new().connect_timeout(cli.connect_timeout);
    let (url, from) = url(cli)?;
    RedisBackend::connect_with(&url, opts)
        .await
        .map_err(|e| match e {
            Error::InvalidConfig(msg) => Fail(EXIT_USAGE, format!("bad URL (from {from}): {msg}")),
            e => Fail(
                EXIT_UNAVAILABLE,
                format!("cannot reach Redis at {}: {e}", shown_url(&url)),
            ),
        })
}

fn manager(cli: &Cli, backend: RedisBackend, opts: LockOptions) -> Result<LockManager, Fail> {
    LockManager::with_options(backend, opts.key_prefix(cli.prefix.as_str()))
        .map_err(|e| Fail(EXIT_USAGE, e.to_string()))
}

fn store_error(e: Error) -> Fail {
    match e {
        Error::InvalidConfig(msg) => Fail(EXIT_USAGE, msg),
        e => Fail(EXIT_UNAVAILABLE, format!("Redis failed: {e}")),
    }
}

async fn inspect(cli: &Cli, name: &str) -> Result<u8, Fail> {
    let locks = manager(cli, connect(cli).await?, LockOptions::new())?;
    let lock = locks.lock(name);
    let info = lock.inspect().await.map_err(store_error)?;
    println!("name: {name}");
    println!("key: {}", lock.key());
    match info {
        Some(info) => print!("{info}"),
        None => println!("held: no\n(no trace: never held, or not for over an hour)"),
    }
    Ok(0)
}

async fn release(cli: &Cli, name: &str, force: bool) -> Result<u8, Fail> {
    if !force {
        return Err(Fail(
            EXIT_USAGE,
            "release deletes another holder's lease: add --force if that is what you want".into(),
        ));
    }
    let backend = connect(cli).await?;
    let locks = manager(cli, backend.clone(), LockOptions::new())?;
    let lock = locks.lock(name);
    let before = lock.inspect().await.map_err(store_error)?;
    let key = lock.key();
    let deleted = backend
        .force_release(key)
        .await
        .map_err(|e| Fail(EXIT_UNAVAILABLE, format!("Redis failed: {e}")))?;
    if !deleted {
        println!("{name} is not held: nothing released");
        return Ok(0);
    }
    let mut what = format!("released {key}");
    let reentrant = before.as_ref().is_some_and(|i| i.reentrant_count.is_some());
    if let Some(info) = before.filter(|i| i.held) {
        if let Some(label) = &info.holder_label {
            what.push_str(&format!(" (holder: {label}"));
        } else {
            what.push_str(" (holder: no label");
        }
        if let Some(t) = info.fencing_token {
            what.push_str(&format!(", fencing token {t}"));
        }
        if let Some(r) = info.remaining {
            what.push_str(&format!(", {} ms left", r.as_millis()));
        }
        what.push(')');
    }
    println!("{what}");
    if reentrant {
        println!("deleted the reentrant holds' counts too");
    }
    Ok(0)
}

async fn run(cli: &Cli, args: &RunArgs) -> Result<u8, Fail> {
    let label = args.label.clone().unwrap_or_else(redlease::host_pid_label);
    let mut opts = LockOptions::new().ttl(args.ttl).holder_label(label);
    if let Some(cap) = args.max_hold {
        opts = opts.max_hold(cap);
    }
    opts.validate()
        .map_err(|e| Fail(EXIT_USAGE, e.to_string()))?;
    let mut signals = signals::Signals::new()
        .map_err(|e| Fail(EXIT_UNAVAILABLE, format!("cannot listen for signals: {e}")))?;
    let locks = manager(cli, connect(cli).await?, opts)?;
    let lock = match args.permits {
        Some(n) => locks
            .semaphore(&args.name, n)
            .map_err(|e| Fail(EXIT_USAGE, e.to_string()))?
            .as_lock()
            .clone(),
        None => locks.lock(&args.name),
    };

    let acquiring = async {
        if args.no_wait {
            lock.try_acquire().await
        } else if let Some(limit) = args.wait {
            lock.acquire_timeout(limit).await.map(Some)
        } else {
            lock.acquire().await.map(Some)
        }
    };
    let acquired = tokio::select! {
        acquired = acquiring => acquired,
        // Interrupted while waiting: nothing is held (a dropped acquire leaves no lease).
        sig = signals.recv() => return Ok(128 + sig.unwrap_or(0)),
    };
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            let info = lock.inspect().await.ok().flatten();
            let holder = match (&info, args.permits) {
                (Some(i), Some(n)) if !i.shared_labels.is_empty() => {
                    format!(" ({n} permits, held by {})", i.shared_labels.join(", "))
                }
                (_, Some(n)) => format!(" ({n} permits)"),
                (Some(i), None) => i
                    .holder_label
                    .as_ref()
                    .map(|l| format!(" by {l}"))
                    .unwrap_or_default(),
                (None, None) => String::new(),
            };
            eprintln!("redlease: {} is held{holder}", args.name);
            return Ok(args.conflict_exit_code);
        }
        Err(Error::Timeout { waited }) => {
            return Err(Fail(
                EXIT_TIMEOUT,
                format!("{} still held after waiting {waited:.1?}", args.name),
            ))
        }
        Err(e) => return Err(store_error(e)),
    };
    hold(args, guard, &mut signals, url_from_env(cli)).await
}

/// Runs the command while `guard` holds the lease.
async fn hold(
    args: &RunArgs,
    guard: LockGuard,
    signals: &mut signals::Signals,
    url_from_env: bool,
) -> Result<u8, Fail> {
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Fail(EXIT_USAGE, "no command given".into()))?;
    let mut command = command(program, rest);
    command
        .env("REDLEASE_NAME", &args.name)
        .env("REDLEASE_FENCING_TOKEN", guard.fencing_token().to_string());
    if url_from_env {
        // Our URL may hold a password, and the command has no use for it.
        command.env_remove(URL_ENV);
    }
    // Its own process group: signals (forwarded, or the lost lease's SIGTERM and SIGKILL)
    // reach everything the command started, not just the command. On Linux the supervisor
    // leads it.
    #[cfg(unix)]
    command.process_group(0);
    // Spawned from the main thread (this future runs in `block_on`), which lives as long as
    // the process: the supervisor's parent-death signal is tied to the thread that spawned it.
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = guard.release().await;
            return Err(cannot_spawn(program, &e));
        }
    };
    let group = signals::Group::of(&child);
    let lost = guard.lost();
    tokio::pin!(lost);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            Some(sig) = signals.recv() => group.forward(sig),
            () = &mut lost => {
                eprintln!(
                    "redlease: lost the lease on {}: stopping the command (SIGTERM, SIGKILL after {:?})",
                    args.name, args.grace
                );
                terminate(&mut child, &group, args.grace, signals).await;
                return Ok(EXIT_LOST);
            }
        }
    };
    let status =
        status.map_err(|e| Fail(EXIT_UNAVAILABLE, format!("waiting for the command: {e}")))?;
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::ExitStatusExt;
        // The supervisor hands the command's death by a signal on as an exit code: its own
        // death by one means someone killed it, and what is left of the group would run on
        // untied to us. Stop it as if redlease had died.
        if status.signal().is_some() {
            group.kill_rest();
        }
    }
    match guard.release().await {
        Ok(_) => {}
        Err(Error::NotHeld) => {
            eprintln!(
                "redlease: the lease on {} was lost as the command ended",
                args.name
            );
            return Ok(EXIT_LOST);
        }
        // The command ran under the lease; the TTL frees the lock.
        Err(e) => eprintln!(
            "redlease: could not release {} ({e}); it expires by its TTL",
            args.name
        ),
    }
    Ok(exit_code(status))
}

/// What to spawn for the command: on Linux the supervisor, which runs it (see
/// `supervisor.rs`); elsewhere the command itself.
#[cfg(target_os = "linux")]
fn command(program: &OsString, args: &[OsString]) -> tokio::process::Command {
    supervisor::command(program, args)
}

#[cfg(not(target_os = "linux"))]
fn command(program: &OsString, args: &[OsString]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(program);
    command.args(args);
    command
}

/// Why the spawn failed. On Linux the supervisor reports a command that cannot be run itself
/// (with the same exit codes), so a failure here is the supervisor's.
#[cfg(target_os = "linux")]
fn cannot_spawn(_program: &OsString, e: &std::io::Error) -> Fail {
    Fail(EXIT_CANNOT_RUN, supervisor::cannot_start(e))
}

#[cfg(not(target_os = "linux"))]
fn cannot_spawn(program: &OsString, e: &std::io::Error) -> Fail {
    let shown = program.to_string_lossy();
    match e.kind() {
        std::io::ErrorKind::NotFound => Fail(EXIT_NOT_FOUND, format!("{shown}: command not found")),
        _ => Fail(EXIT_CANNOT_RUN, format!("{shown}: cannot run it: {e}")),
    }
}

/// How often `terminate` looks whether the command's group is gone, once the command is.
const GROUP_POLL: Duration = Duration::from_millis(20);

/// SIGTERM to the command's group, then SIGKILL to whatever of it is left once `grace` has
/// passed: a worker that ignores SIGTERM does not outlive the lease because the command obeyed
/// it. Signals that reach redlease meanwhile are forwarded, as while the command ran.
async fn terminate(
    child: &mut tokio::process::Child,
    group: &signals::Group,
    grace: Duration,
    signals: &mut signals::Signals,
) {
    group.terminate(child);
    let stopped = async {
        loop {
            tokio::select! {
                _ = child.wait() => break,
                Some(sig) = signals.recv() => group.forward(sig),
            }
        }
        // On Linux the supervisor has waited for the whole group: it is empty by now.
        // Elsewhere the command leads the group, and what it started may still run.
        while group.exists() {
            tokio::select! {
                () = tokio::time::sleep(GROUP_POLL) => {}
                Some(sig) = signals.recv() => group.forward(sig),
            }
        }
    };
    if tokio::time::timeout(grace, stopped).await.is_err() {
        group.kill(child);
        let _ = child.wait().await;
    }
}

/// The command's exit code, or 128 + the signal that killed it.
fn exit_code(status: std::process::ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code & 0xff).unwrap_or(1);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return u8::try_from(128 + sig).unwrap_or(255);
        }
    }
    1
}

/// Forwarded signals: SIGINT, SIGTERM and SIGHUP, on unix.
#[cfg(unix)]
mod signals {
    use nix::errno::Errno;
    use nix::sys::signal::{killpg, Signal};
    use nix::unistd::Pid;
    use tokio::signal::unix::{signal, SignalKind};

    pub(crate) struct Signals {
        int: tokio::signal::unix::Signal,
        term: tokio::signal::unix::Signal,
        hup: tokio::signal::unix::Signal,
    }

    impl Signals {
        pub(crate) fn new() -> std::io::Result<Self> {
            Ok(Signals {
                int: signal(SignalKind::interrupt())?,
                term: signal(SignalKind::terminate())?,
                hup: signal(SignalKind::hangup())?,
            })
        }

        /// The next signal's number.
        pub(crate) async fn recv(&mut self) -> Option<u8> {
            tokio::select! {
                s = self.int.recv() => s.map(|()| Signal::SIGINT as u8),
                s = self.term.recv() => s.map(|()| Signal::SIGTERM as u8),
                s = self.hup.recv() => s.map(|()| Signal::SIGHUP as u8),
            }
        }
    }

    /// The command's process group: its id is the pid of the process `run` spawned, which
    /// leads it (the supervisor on Linux, the command elsewhere).
    pub(crate) struct Group(Option<Pid>);

    impl Group {
        pub(crate) fn of(child: &tokio::process::Child) -> Self {
            Group(
                child
                    .id()
                    .and_then(|id| i32::try_from(id).ok())
                    .map(Pid::from_raw),
            )
        }

        fn send(&self, sig: Signal) {
            if let Some(group) = self.0 {
                // The group may be gone in the meantime: nothing to do then.
                let _ = killpg(group, sig);
            }
        }

        pub(crate) fn forward(&self, sig: u8) {
            if let Ok(sig) = Signal::try_from(i32::from(sig)) {
                self.send(sig);
            }
        }

        /// Whether any process of the group is left (a zombie counts until it is reaped).
        pub(crate) fn exists(&self) -> bool {
            self.0
                .is_some_and(|group| killpg(group, None) != Err(Errno::ESRCH))
        }

        pub(crate) fn terminate(&self, _child: &mut tokio::process::Child) {
            self.send(Signal::SIGTERM);
        }

        pub(crate) fn kill(&self, child: &mut tokio::process::Child) {
            self.send(Signal::SIGKILL);
            let _ = child.start_kill();
        }

        /// SIGKILL to what is left of the group once its leader has been reaped. The group's
        /// id cannot name another group while any member lives; once none does, it could
        /// only after the pids wrapped around, between the reaping and this call.
        #[cfg(target_os = "linux")]
        pub(crate) fn kill_rest(&self) {
            self.send(Signal::SIGKILL);
        }
    }
}

/// Elsewhere: Ctrl-C is watched while waiting; the command is killed outright on a lost
/// lease (there is no SIGTERM to send).
#[cfg(not(unix))]
mod signals {
    pub(crate) struct Signals;

    impl Signals {
        pub(crate) fn new() -> std::io::Result<Self> {
            Ok(Signals)
        }

        pub(crate) async fn recv(&mut self) -> Option<u8> {
            tokio::signal::ctrl_c().await.ok().map(|()| 2)
        }
    }

    pub(crate) struct Group;

    impl Group {
        pub(crate) fn of(_child: &tokio::process::Child) -> Self {
            Group
        }

        pub(crate) fn forward(&self, _sig: u8) {}

        pub(crate) fn exists(&self) -> bool {
            false
        }

        pub(crate) fn terminate(&self, child: &mut tokio::process::Child) {
            let _ = child.start_kill();
        }

        pub(crate) fn kill(&self, child: &mut tokio::process::Child) {
            let _ = child.start_kill();
        }
    }
}
