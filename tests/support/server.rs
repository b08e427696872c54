//! A throw-away `redis-server` per test, plus a minimal synchronous RESP client.

use std::collections::HashSet;
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Timeout for the harness's own connections (connect, read, write).
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for a freshly spawned server to answer PING.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts (each on a new port) in `start_with`.
const START_ATTEMPTS: usize = 5;
/// How long `restart` keeps retrying to bind the same port.
const RESTART_BIND_WINDOW: Duration = Duration::from_secs(5);

/// Ports held by live `RedisServer`s of this process, so that parallel tests
/// in one binary never get the same port handed out twice.
fn ports_in_use() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

fn lock_ports() -> std::sync::MutexGuard<'static, HashSet<u16>> {
    ports_in_use().lock().unwrap_or_else(|e| e.into_inner())
}

/// Picks a free loopback port (from the OS) not held by another server of this process.
fn reserve_port() -> u16 {
    for _ in 0..100 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .expect("support: cannot bind 127.0.0.1:0 to pick a free port");
        let port = listener
            .local_addr()
            .expect("support: local_addr of probe listener")
            .port();
        drop(listener);
        if lock_ports().insert(port) {
            return port;
        }
    }
    panic!("support: could not find a free port after 100 tries");
}

fn release_port(port: u16) {
    lock_ports().remove(&port);
}

fn redis_server_bin() -> String {
    if let Ok(p) = std::env::var("REDIS_SERVER_BIN") {
        return p;
    }
    if Path::new("/usr/bin/redis-server").exists() {
        "/usr/bin/redis-server".to_string()
    } else {
        "redis-server".to_string()
    }
}

const DIR_PREFIX: &str = "redlease-test-redis-";

/// Once per process: kills servers leaked by earlier test processes that died
/// without running `Drop` (e.g. killed by a timeout) and removes their dirs.
/// A leaked server is recognised by its dir (named after the dead test
/// process), its pidfile, and its cwd (redis chdirs into `--dir`).
fn sweep_stale_servers() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(DIR_PREFIX) else {
                continue;
            };
            let Some(owner) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if owner == std::process::id() || Path::new(&format!("/proc/{owner}")).exists() {
                continue; // the owning test process is still alive
            }
            let dir = entry.path();
            if let Some(pid) = fs::read_to_string(dir.join("redis.pid"))
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
            {
                let cwd = fs::read_link(format!("/proc/{pid}/cwd")).ok();
                let same = match (cwd, fs::canonicalize(&dir).ok()) {
                    (Some(c), Some(d)) => c == d,
                    _ => false,
                };
                if same {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status();
                }
            }
            let _ = fs::remove_dir_all(&dir);
        }
    });
}

/// A fresh private directory for a test's own files (certificates, say): removed by
/// [`ScratchDir`]'s drop, or, if the test process dies first, by the next test process.
pub fn scratch_dir() -> ScratchDir {
    ScratchDir(fresh_temp_dir())
}

/// A directory removed on drop; see [`scratch_dir`].
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn fresh_temp_dir() -> PathBuf {
    sweep_stale_servers();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "{DIR_PREFIX}{}-{}-{}",
        std::process::id(),
        n,
        nanos
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("support: cannot create temp dir {}: {e}", dir.display()));
    dir
}

fn tail(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            let start = all.len().saturating_sub(lines);
            all[start..].join("\n")
        }
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

fn file_len(path: &Path) -> u64 {
    fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Whether the log, from byte `offset` on, says the server is listening.
fn log_says_ready(path: &Path, offset: u64) -> bool {
    let Ok(bytes) = fs::read(path) else {
        return false;
    };
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).contains("Ready to accept connections")
}

/// Harness credentials: (username, password).
type Auth = Option<(Option<String>, String)>;

/// A `redis-server` child process on `127.0.0.1:<port>` with a private temp
/// dir. Killed (SIGKILL) and cleaned up on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    last_pid: u32,
    dir: PathBuf,
    extra: Vec<String>,
    /// Credentials the harness's own connections send with AUTH first:
    /// (username, password). Auto-set from `--requirepass`.
    auth: Auth,
    /// The port speaks TLS only (`--port 0 --tls-port PORT`).
    tls: bool,
    /// The config file given as the first argument (a Sentinel's, which it rewrites).
    conf: Option<PathBuf>,
}

impl RedisServer {
    /// Starts a fresh, empty redis-server on a free loopback port and waits
    /// until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Same as [`start`](Self::start) with extra `redis-server` arguments,
    /// e.g. `["--requirepass", "x"]`. Each config word is its own argument:
    /// `["--user", "alice", "on", ">pw", "~*", "+@all"]`. Do not pass
    /// `--port`, `--dir` or `--logfile`.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        RedisServer::start_mode(extra, false, None)
    }

    /// A server whose port speaks TLS only (`--port 0 --tls-port PORT`); `extra` names the
    /// certificates (`--tls-cert-file`, `--tls-key-file`, `--tls-ca-cert-file`, and e.g.
    /// `--tls-auth-clients no`). Ready once its own log says it listens. The harness's
    /// plain-text connections (`cmd`, `connect`, ...) do not work with it.
    pub fn start_tls(extra: &[&str]) -> RedisServer {
        RedisServer::start_mode(extra, true, None)
    }

    /// A Redis Sentinel (`redis-server <config> --sentinel`) on a free loopback port, its
    /// config file made of `conf_lines` (e.g. `sentinel monitor mymaster 127.0.0.1 6379 2`)
    /// in its private temp dir, where Sentinel rewrites it (its id, the replicas and
    /// sentinels it learns, the primary after a failover; a [`restart`](Self::restart)
    /// keeps what it wrote). Ready once it answers PING and its INFO names its pid.
    /// Killed on drop like any other server.
    pub fn start_sentinel(conf_lines: &[String]) -> RedisServer {
        RedisServer::start_mode(&[], false, Some(conf_lines))
    }

    /// `sentinel`: the config lines of a Sentinel (see [`start_sentinel`](Self::start_sentinel)).
    fn start_mode(extra: &[&str], tls: bool, sentinel: Option<&[String]>) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let auth = extra
            .iter()
            .position(|a| a == "--requirepass")
            .and_then(|i| extra.get(i + 1))
            .map(|pw| (None, pw.clone()));
        let dir = fresh_temp_dir();
        let mut errors = Vec::new();
        let conf = sentinel.map(|_| dir.join("sentinel.conf"));
        for attempt in 1..=START_ATTEMPTS {
            let port = reserve_port();
            if let (Some(path), Some(lines)) = (&conf, sentinel) {
                // Written afresh for each attempt: a failed one may have rewritten it.
                let mut text = lines.join("\n");
                text.push('\n');
                fs::write(path, text)
                    .unwrap_or_else(|e| panic!("support: cannot write {}: {e}", path.display()));
            }
            match spawn_and_wait(port, &dir, conf.as_deref(), &extra, &auth, tls) {
                Ok(child) => {
                    return RedisServer {
                        last_pid: child.id(),
                        child: Some(child),
                        port,
                        dir,
                        extra,
                        auth,
                        tls,
                        conf,
                    };
                }
                Err(e) => {
                    release_port(port);
                    errors.push(format!("attempt {attempt} (port {port}): {e}"));
                }
            }
        }
        let msg = format!(
            "support: redis-server failed to start {START_ATTEMPTS} times:\n{}\n{}",
            errors.join("\n"),
            diagnostics(&dir)
        );
        let _ = fs::remove_dir_all(&dir);
        panic!("{msg}");
    }

    /// The TCP port the server listens on (stable across [`restart`](Self::restart)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT` (no credentials).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process id of the current (or, after `kill`, the last) server process.
    pub fn pid(&self) -> u32 {
        self.last_pid
    }

    /// The server's private temp dir (holds `redis.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Last `n` lines of the server log.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.dir.join("redis.log"), n)
    }

    /// Whether the process is (believed to be) running: false after `kill`.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Credentials the harness's own connections (`cmd`, `connect`, ...)
    /// authenticate with. Set automatically from `--requirepass`; set it by
    /// hand for ACL setups (e.g. when the default user is disabled).
    pub fn set_auth(&mut self, user: Option<&str>, password: &str) {
        self.auth = Some((user.map(str::to_string), password.to_string()));
    }

    /// SIGKILLs the process and reaps it. Idempotent; never panics.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `kill()` if running, then starts a new, empty server on the same port
    /// with the same arguments and waits for PING. Retries bind failures for a
    /// few seconds.
    pub fn restart(&mut self) {
        self.respawn(true);
    }

    /// `kill()` if running, then starts the server again on the same port with the same
    /// arguments and its data dir as it was: a crash and recovery. A server started with
    /// `--appendonly yes` reloads what it had persisted; without persistence it comes back
    /// empty, as with [`restart`](Self::restart).
    pub fn restart_keeping_data(&mut self) {
        self.respawn(false);
    }

    fn respawn(&mut self, wipe: bool) {
        self.kill();
        if wipe {
            // Make sure nothing is reloaded: the new server must be empty.
            let _ = fs::remove_file(self.dir.join("dump.rdb"));
            let _ = fs::remove_dir_all(self.dir.join("appendonlydir"));
        }
        let deadline = Instant::now() + RESTART_BIND_WINDOW;
        let mut errors = Vec::new();
        loop {
            let conf = self.conf.as_deref();
            match spawn_and_wait(
                self.port,
                &self.dir,
                conf,
                &self.extra,
                &self.auth,
                self.tls,
            ) {
                Ok(child) => {
                    self.last_pid = child.id();
                    self.child = Some(child);
                    return;
                }
                Err(e) => {
                    errors.push(e);
                    if Instant::now() >= deadline {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        let last: Vec<_> = errors.iter().rev().take(3).cloned().collect();
        panic!(
            "support: redis-server failed to restart on port {} ({} attempts); last errors: {:?}\n{}",
            self.port,
            errors.len(),
            last,
            diagnostics(&self.dir)
        );
    }

    /// SIGSTOPs the server process (it stops answering but keeps its sockets).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONTs the server process.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        assert!(
            self.child.is_some(),
            "support: cannot send {sig} to redis-server on port {}: it is not running",
            self.port
        );
        let status = Command::new("kill")
            .args([sig, &self.last_pid.to_string()])
            .status()
            .unwrap_or_else(|e| panic!("support: cannot run `kill {sig}`: {e}"));
        assert!(
            status.success(),
            "support: `kill {sig} {}` failed: {status}",
            self.last_pid
        );
    }

    /// Opens a new harness connection (5 s timeouts, AUTH sent if configured).
    pub fn try_connect(&self) -> io::Result<Conn> {
        let mut conn = Conn::connect(self.port, IO_TIMEOUT)?;
        conn.auth(&self.auth)?;
        Ok(conn)
    }

    /// Like [`try_connect`](Self::try_connect) but panics on failure. Handy to
    /// hold a connection open (e.g. to see it killed), or for pub/sub.
    pub fn connect(&self) -> Conn {
        self.try_connect().unwrap_or_else(|e| {
            panic!(
                "support: cannot connect to redis-server on port {}: {e}",
                self.port
            )
        })
    }

    /// Runs one command on a new short-lived connection (5 s timeouts) and
    /// returns the reply (an error reply is returned, not panicked on).
    /// Panics on I/O errors.
    pub fn cmd(&self, args: &[&str]) -> Resp {
        let bytes: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.cmd_bytes(&bytes)
    }

    /// Binary-safe [`cmd`](Self::cmd).
    pub fn cmd_bytes(&self, args: &[&[u8]]) -> Resp {
        self.try_connect()
            .and_then(|mut c| c.cmd_bytes(args))
            .unwrap_or_else(|e| {
                panic!(
                    "support: command {:?} on port {} failed: {e}",
                    args.iter()
                        .map(|a| String::from_utf8_lossy(a).into_owned())
                        .collect::<Vec<_>>(),
                    self.port
                )
            })
    }

    /// Runs one command on a new connection with the given connect/read/write
    /// timeout; I/O errors (e.g. a timeout while the server is paused) are
    /// returned instead of panicking.
    pub fn cmd_timeout(&self, args: &[&str], timeout: Duration) -> io::Result<Resp> {
        let mut conn = Conn::connect(self.port, timeout)?;
        conn.auth(&self.auth)?;
        conn.cmd(args)
    }

    /// `CLIENT KILL TYPE normal` (spares the harness's own connection);
    /// returns how many connections were killed.
    pub fn kill_clients(&self) -> i64 {
        let r = self.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
        r.as_int()
            .unwrap_or_else(|| panic!("support: CLIENT KILL TYPE normal replied {r:?}"))
    }

    /// `CLIENT KILL TYPE pubsub`; returns how many connections were killed.
    pub fn kill_pubsub_clients(&self) -> i64 {
        let r = self.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
        r.as_int()
            .unwrap_or_else(|| panic!("support: CLIENT KILL TYPE pubsub replied {r:?}"))
    }

    /// Script calls (`EVALSHA`) the server has run, from `INFO commandstats`. (Redis counts
    /// the commands a script makes as commands too, so `total_commands` cannot show how many
    /// leases rode in one call.)
    pub fn script_calls(&self) -> u64 {
        self.command_calls("evalsha")
    }

    /// Calls of command `name` (lower case, e.g. `subscribe`) so far, from
    /// `INFO commandstats`.
    pub fn command_calls(&self, name: &str) -> u64 {
        self.info_field("commandstats", &format!("cmdstat_{name}"))
            .and_then(|s| {
                s.split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))
                    .and_then(|n| n.parse().ok())
            })
            .unwrap_or(0)
    }

    /// Calls of command `name` the server refused before running them (a `MOVED`
    /// redirection, an ACL), from `INFO commandstats` (`rejected_calls`).
    pub fn rejected_calls(&self, name: &str) -> u64 {
        self.info_field("commandstats", &format!("cmdstat_{name}"))
            .and_then(|s| {
                s.split(',')
                    .find_map(|kv| kv.strip_prefix("rejected_calls="))
                    .and_then(|n| n.parse().ok())
            })
            .unwrap_or(0)
    }

    /// `total_commands_processed` from `INFO stats`. The harness's own commands
    /// count too: each `total_commands()` call adds 1 (its INFO, counted after
    /// it replies), plus 1 for AUTH when harness auth is configured.
    pub fn total_commands(&self) -> u64 {
        self.info_field("stats", "total_commands_processed")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("support: no total_commands_processed in INFO stats"))
    }

    /// One `field` of `INFO section`, as a string.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let r = self.cmd(&["INFO", section]);
        let text = r.as_str()?;
        let prefix = format!("{field}:");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_string()))
    }

    /// Blocks (polling every 5 ms) until `f(self)` is true; panics if that
    /// takes longer than `timeout`.
    pub fn wait_until(&self, timeout: Duration, mut f: impl FnMut(&RedisServer) -> bool) {
        let start = Instant::now();
        let ok = super::wait_for_interval(timeout, Duration::from_millis(5), || f(self));
        assert!(
            ok,
            "support: wait_until timed out after {:?} (server on port {})",
            start.elapsed(),
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
        release_port(self.port);
    }
}

fn diagnostics(dir: &Path) -> String {
    format!(
        "--- redis.log (tail) ---\n{}\n--- stderr (tail) ---\n{}",
        tail(&dir.join("redis.log"), 30),
        tail(&dir.join("stderr.log"), 20)
    )
}

/// Spawns redis-server on `port` and waits until it is ready (its own log says
/// it listens, and PING gets an answer). On failure the child is killed and
/// reaped. `conf`: a Sentinel's config file, passed first and followed by
/// `--sentinel` (a Sentinel's log never says it listens: its INFO names its pid).
fn spawn_and_wait(
    port: u16,
    dir: &Path,
    conf: Option<&Path>,
    extra: &[String],
    auth: &Auth,
    tls: bool,
) -> Result<Child, String> {
    let log = dir.join("redis.log");
    let log_offset = file_len(&log);
    let stderr = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("stderr.log"))
        .map_err(|e| format!("cannot open stderr.log: {e}"))?;
    let ports: Vec<String> = if tls {
        vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
        ]
    } else {
        vec!["--port".into(), port.to_string()]
    };
    let mut command = Command::new(redis_server_bin());
    if let Some(conf) = conf {
        command.arg(conf).arg("--sentinel");
    }
    let mut child = command
        .args(&ports)
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        .args(["--protected-mode", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .arg("--pidfile")
        .arg(dir.join("redis.pid"))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr))
        .spawn()
        .map_err(|e| format!("cannot spawn {}: {e}", redis_server_bin()))?;

    let fail = |child: &mut Child, msg: String| {
        let _ = child.kill();
        let _ = child.wait();
        Err(msg)
    };

    let deadline = Instant::now() + START_TIMEOUT;
    let mut backoff = Duration::from_millis(2);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let _ = child.wait();
                return Err(format!("redis-server exited early ({status})"));
            }
            Ok(None) => {}
            Err(e) => return fail(&mut child, format!("try_wait failed: {e}")),
        }
        // A TLS port: our own log says it listens (a port taken by another process
        // makes ours exit, seen above).
        if tls {
            if log_says_ready(&log, log_offset) {
                return Ok(child);
            }
            if Instant::now() >= deadline {
                return fail(
                    &mut child,
                    format!("TLS port not ready after {START_TIMEOUT:?}"),
                );
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(50));
            continue;
        }
        // Make sure we talk to *our* process, not to whoever else might be
        // listening on a colliding port: either our own log says we listen,
        // or (e.g. with `--loglevel warning`) INFO reports our pid.
        let last_err = match ping(port) {
            Ok(()) => {
                if log_says_ready(&log, log_offset) || reports_pid(port, auth, child.id()) {
                    return Ok(child);
                }
                String::from("PING answered, but not (yet) by our process")
            }
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return fail(
                &mut child,
                format!("not ready after {START_TIMEOUT:?}: {last_err}"),
            );
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(50));
    }
}

/// Whether the server on `port` says (INFO server) that its pid is `pid`.
fn reports_pid(port: u16, auth: &Auth, pid: u32) -> bool {
    let Ok(mut conn) = Conn::connect(port, Duration::from_secs(1)) else {
        return false;
    };
    if conn.auth(auth).is_err() {
        return false;
    }
    let Ok(reply) = conn.cmd(&["INFO", "server"]) else {
        return false;
    };
    let want = format!("process_id:{pid}");
    reply
        .as_str()
        .is_some_and(|t| t.lines().any(|l| l.trim() == want))
}

/// Ready = PING answered with PONG, or with an auth error (the server is up;
/// it just wants credentials). LOADING and I/O errors mean "not yet".
fn ping(port: u16) -> Result<(), String> {
    let mut conn = Conn::connect(port, Duration::from_secs(1)).map_err(|e| e.to_string())?;
    match conn.cmd(&["PING"]).map_err(|e| e.to_string())? {
        Resp::Simple(s) if s == "PONG" => Ok(()),
        Resp::Error(e) if e.starts_with("LOADING") => Err(e),
        Resp::Error(_) => Ok(()),
        other => Err(format!("unexpected PING reply {other:?}")),
    }
}

/// A RESP reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    /// `+OK`
    Simple(String),
    /// `-ERR ...` (the text without the leading `-`)
    Error(String),
    /// `:42`
    Int(i64),
    /// `$n ...`; `None` for the nil bulk string `$-1`
    Bulk(Option<Vec<u8>>),
    /// `*n ...`; `None` for the nil array `*-1`
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The integer of an `Int` reply (also parses a `Simple`/`Bulk` holding an integer).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Resp::Int(i) => Some(*i),
            Resp::Simple(_) | Resp::Bulk(Some(_)) => self.as_str()?.parse().ok(),
            _ => None,
        }
    }

    /// `Simple` or `Bulk(Some)` as a string (lossy UTF-8).
    pub fn as_str(&self) -> Option<String> {
        match self {
            Resp::Simple(s) => Some(s.clone()),
            Resp::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// The bytes of a `Bulk(Some)` (or `Simple`) reply.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Resp::Simple(s) => Some(s.as_bytes()),
            Resp::Bulk(Some(b)) => Some(b),
            _ => None,
        }
    }

    /// The elements of an `Array(Some)` reply.
    pub fn as_array(&self) -> Option<&[Resp]> {
        match self {
            Resp::Array(Some(a)) => Some(a),
            _ => None,
        }
    }

    /// `Bulk(None)` or `Array(None)`.
    pub fn is_nil(&self) -> bool {
        matches!(self, Resp::Bulk(None) | Resp::Array(None))
    }

    /// An `Error` reply.
    pub fn is_error(&self) -> bool {
        matches!(self, Resp::Error(_))
    }

    /// `Simple("OK")`.
    pub fn is_ok(&self) -> bool {
        matches!(self, Resp::Simple(s) if s == "OK")
    }
}

/// A raw harness connection (RESP2 over a blocking `TcpStream`).
#[derive(Debug)]
pub struct Conn {
    stream: BufReader<TcpStream>,
}

impl Conn {
    /// Connects to `127.0.0.1:port` with `timeout` as connect, read and write timeout.
    pub fn connect(port: u16, timeout: Duration) -> io::Result<Conn> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream: BufReader::new(stream),
        })
    }

    /// Sends AUTH if `auth` is set; an error reply becomes an `io::Error`.
    fn auth(&mut self, auth: &Auth) -> io::Result<()> {
        let Some((user, pw)) = auth else {
            return Ok(());
        };
        let reply = match user {
            Some(u) => self.cmd(&["AUTH", u, pw])?,
            None => self.cmd(&["AUTH", pw])?,
        };
        match reply {
            Resp::Error(e) => Err(io::Error::other(format!("harness AUTH failed: {e}"))),
            _ => Ok(()),
        }
    }

    /// Changes the read timeout (`None` = block forever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.stream.get_ref().set_read_timeout(timeout)
    }

    /// Sends one command and reads one reply.
    pub fn cmd(&mut self, args: &[&str]) -> io::Result<Resp> {
        let bytes: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.cmd_bytes(&bytes)
    }

    /// Binary-safe [`cmd`](Self::cmd).
    pub fn cmd_bytes(&mut self, args: &[&[u8]]) -> io::Result<Resp> {
        self.send_bytes(args)?;
        self.read_reply()
    }

    /// Sends one command without reading the reply (pipelining, pub/sub).
    pub fn send(&mut self, args: &[&str]) -> io::Result<()> {
        let bytes: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.send_bytes(&bytes)
    }

    /// Binary-safe [`send`](Self::send).
    pub fn send_bytes(&mut self, args: &[&[u8]]) -> io::Result<()> {
        let buf = encode(args);
        let s = self.stream.get_mut();
        s.write_all(&buf)?;
        s.flush()
    }

    /// Reads one reply (e.g. a pub/sub message).
    pub fn read_reply(&mut self) -> io::Result<Resp> {
        read_resp(&mut self.stream)
    }
}

/// Encodes a command as a RESP array of bulk strings.
pub fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        buf.extend_from_slice(a);
        buf.extend_from_slice(b"\r\n");
    }
    buf
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_line(r: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    let n = r.read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by server",
        ));
    }
    if !line.ends_with(b"\r\n") {
        return Err(bad(format!(
            "RESP line not terminated by CRLF: {:?}",
            String::from_utf8_lossy(&line)
        )));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn parse_int(b: &[u8]) -> io::Result<i64> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad RESP integer {:?}", String::from_utf8_lossy(b))))
}

fn read_bulk(r: &mut impl BufRead, len: i64) -> io::Result<Option<Vec<u8>>> {
    if len < 0 {
        return Ok(None);
    }
    let len = usize::try_from(len).map_err(|_| bad("bulk length overflow"))?;
    let mut data = vec![0u8; len + 2];
    r.read_exact(&mut data)?;
    if !data.ends_with(b"\r\n") {
        return Err(bad("bulk string not terminated by CRLF"));
    }
    data.truncate(len);
    Ok(Some(data))
}

fn read_elems(r: &mut impl BufRead, n: i64) -> io::Result<Option<Vec<Resp>>> {
    if n < 0 {
        return Ok(None);
    }
    let mut v = Vec::with_capacity(usize::try_from(n.min(1024)).unwrap_or(0));
    for _ in 0..n {
        v.push(read_resp(r)?);
    }
    Ok(Some(v))
}

/// Reads one RESP2 reply (the common RESP3 types are mapped onto RESP2 shapes).
pub fn read_resp(r: &mut impl BufRead) -> io::Result<Resp> {
    let line = read_line(r)?;
    let (&kind, rest) = line.split_first().ok_or_else(|| bad("empty RESP line"))?;
    let text = || String::from_utf8_lossy(rest).into_owned();
    Ok(match kind {
        b'+' => Resp::Simple(text()),
        b'-' => Resp::Error(text()),
        b':' => Resp::Int(parse_int(rest)?),
        b'$' => Resp::Bulk(read_bulk(r, parse_int(rest)?)?),
        b'*' => Resp::Array(read_elems(r, parse_int(rest)?)?),
        // RESP3 (only if someone sends HELLO 3 on a harness connection).
        b'_' => Resp::Bulk(None),
        b'#' => Resp::Int(i64::from(rest == b"t")),
        b',' | b'(' => Resp::Simple(text()),
        b'=' => {
            let b = read_bulk(r, parse_int(rest)?)?;
            Resp::Bulk(b.map(|mut v| v.split_off(4.min(v.len()))))
        }
        b'~' | b'>' => Resp::Array(read_elems(r, parse_int(rest)?)?),
        b'%' => Resp::Array(read_elems(r, parse_int(rest)?.saturating_mul(2))?),
        b'!' => Resp::Error(
            String::from_utf8_lossy(&read_bulk(r, parse_int(rest)?)?.unwrap_or_default())
                .into_owned(),
        ),
        b'|' => {
            // Attribute: skip it, return the reply it decorates.
            let _ = read_elems(r, parse_int(rest)?.saturating_mul(2))?;
            read_resp(r)?
        }
        other => {
            return Err(bad(format!(
                "unknown RESP type byte {:?} in line {:?}",
                other as char,
                String::from_utf8_lossy(&line)
            )))
        }
    })
}
