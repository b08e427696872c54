//! A throw-away etcd server (one member, loopback, free ports, temp data dir) for the
//! `etcd` backend's tests.

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use redlease::{EtcdBackend, EtcdOptions};

use super::{scratch_dir, ScratchDir};

const ETCD_BIN: &str = "/usr/bin/etcd";
/// How long a start may take to answer `/health` (it answers once a leader exists).
const START_TIMEOUT: Duration = Duration::from_secs(15);

fn ports() -> std::sync::MutexGuard<'static, HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS
        .get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn reserve_port() -> u16 {
    for _ in 0..100 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .expect("support: cannot bind 127.0.0.1:0 to pick a free port");
        let port = listener.local_addr().expect("support: local_addr").port();
        drop(listener);
        if ports().insert(port) {
            return port;
        }
    }
    panic!("support: no free port after 100 tries");
}

/// One etcd member on loopback, killed and its directory removed on drop.
pub struct EtcdServer {
    dir: ScratchDir,
    /// The data directory now (a wipe moves to a new one).
    data: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    wipes: u32,
}

impl EtcdServer {
    /// Starts a server and waits until it answers `/health`. Panics with the install
    /// command if etcd is missing, and with its log if it does not come up.
    pub fn start() -> Self {
        assert!(
            Path::new(ETCD_BIN).exists(),
            "support: {ETCD_BIN} is missing: apt-get install -y etcd-server"
        );
        let mut last = String::new();
        for _ in 0..5 {
            let dir = scratch_dir();
            let data = dir.path().join("data0");
            let mut srv = EtcdServer {
                dir,
                data,
                client_port: reserve_port(),
                peer_port: reserve_port(),
                child: None,
                wipes: 0,
            };
            match srv.spawn() {
                Ok(()) => return srv,
                Err(e) => last = e, // a port taken meanwhile: new ports
            }
        }
        panic!("support: etcd did not start: {last}");
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client endpoint as `etcd-client` takes it.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.url()]
    }

    /// A backend of its own (own client, own watch stream), with short timeouts.
    pub async fn backend(&self) -> EtcdBackend {
        EtcdBackend::connect_with(&self.url(), Self::options())
            .await
            .unwrap_or_else(|e| panic!("connect to etcd at {}: {e}", self.url()))
    }

    /// The options the tests' backends use.
    pub fn options() -> EtcdOptions {
        EtcdOptions::new()
            .timeout(Duration::from_secs(2))
            .heartbeat(Duration::from_millis(500))
    }

    fn spawn(&mut self) -> Result<(), String> {
        let (c, p) = (self.client_port, self.peer_port);
        let log = fs::File::create(self.dir.path().join("etcd.log"))
            .map_err(|e| format!("support: etcd log: {e}"))?;
        let mut cmd = Command::new(ETCD_BIN);
        // etcd reads every ETCD_* variable as a flag.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(k);
            }
        }
        cmd.arg("--name")
            .arg("t0")
            .arg("--data-dir")
            .arg(&self.data)
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{c}"))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{c}"))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{p}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{p}"))
            .arg("--initial-cluster")
            .arg(format!("t0=http://127.0.0.1:{p}"))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg("redlease-test")
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = cmd
            .spawn()
            .map_err(|e| format!("support: cannot run {ETCD_BIN}: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.healthy() {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(format!("etcd exited ({status}):\n{}", self.log_tail(20)));
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(format!(
                    "etcd not healthy within {START_TIMEOUT:?}:\n{}",
                    self.log_tail(20)
                ));
            }
            // Polling the health endpoint: etcd offers no readiness event to wait on.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether `/health` answers `{"health":"true"}`.
    fn healthy(&self) -> bool {
        let addr = (Ipv4Addr::LOCALHOST, self.client_port).into();
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.client_port
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
    }

    /// How many waiters stand in `key`'s fair queue (the backend's keys under the default
    /// prefix), read through etcd's JSON gateway (synchronous, for polling).
    pub fn queued(&self, key: &redlease::LeaseKey) -> i64 {
        self.count("q", key)
    }

    /// How many waiters are registered for `key` (an [`Attempt::Waiting`] made after its
    /// subscription: a registered waiter is woken by a release).
    ///
    /// [`Attempt::Waiting`]: redlease::backend::Attempt::Waiting
    pub fn waiters(&self, key: &redlease::LeaseKey) -> i64 {
        self.count("w", key)
    }

    /// How many holds `key`'s reentrant reign counts (its hold keys).
    pub fn holds(&self, key: &redlease::LeaseKey) -> i64 {
        self.count("h", key)
    }

    /// The keys of `kind` under `key` (the backend's `P kind/len:K/...`).
    fn count(&self, kind: &str, key: &redlease::LeaseKey) -> i64 {
        let k = key.as_str();
        let prefix = format!("redlease/{kind}/{}:{k}/", k.len()).into_bytes();
        let mut end = prefix.clone();
        if let Some(last) = end.last_mut() {
            *last += 1; // '/' + 1: the end of the prefix's range
        }
        let body = format!(
            r#"{{"key":"{}","range_end":"{}","count_only":true}}"#,
            base64(&prefix),
            base64(&end)
        );
        let answer = self.post("/v3/kv/range", &body);
        // {"header":{...},"count":"2"}; no "count" when it is 0.
        answer
            .split("\"count\":\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .map_or(0, |n| {
                n.parse()
                    .unwrap_or_else(|_| panic!("etcd range answer: {answer}"))
            })
    }

    /// The gRPC calls etcd has served, by method (`Txn`, `LeaseGrant`, ...), from its
    /// `/metrics` (`grpc_server_handled_total`, every code; a stream counts once).
    pub fn calls(&self) -> std::collections::BTreeMap<String, u64> {
        let text = self.get("/metrics");
        let mut out = std::collections::BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| l.starts_with("grpc_server_handled_total{"))
        {
            let Some(method) = line
                .split("grpc_method=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            else {
                continue;
            };
            let n: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0.0);
            *out.entry(method.to_owned()).or_insert(0) += n as u64;
        }
        out
    }

    /// etcd's write-ahead-log fsyncs so far: their number and total seconds.
    pub fn fsyncs(&self) -> (u64, f64) {
        let text = self.get("/metrics");
        let read = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (
            read("etcd_disk_wal_fsync_duration_seconds_count ") as u64,
            read("etcd_disk_wal_fsync_duration_seconds_sum "),
        )
    }

    fn get(&self, path: &str) -> String {
        let addr = (Ipv4Addr::LOCALHOST, self.client_port).into();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("support: connect to etcd: {e}"));
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes())
            .unwrap_or_else(|e| panic!("support: write to etcd: {e}"));
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    }

    fn post(&self, path: &str, body: &str) -> String {
        let addr = (Ipv4Addr::LOCALHOST, self.client_port).into();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("support: connect to etcd: {e}"));
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .unwrap_or_else(|e| panic!("support: write to etcd: {e}"));
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    }

    /// The last `n` lines of etcd's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        // Failed applies (a revoke of a lease gone already, say) are routine here.
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.contains("failed to apply request"))
            .collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// SIGKILLs the server and reaps it. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts it again on the same ports and data dir (a crash and
    /// recovery), waiting until it is healthy.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(e) = self.spawn() {
            panic!("support: etcd did not restart: {e}");
        }
    }

    /// Kills the server and starts it on the same ports with a new, empty data dir: the
    /// store forgets everything, its revision starts at 1 again.
    pub fn wipe_and_restart(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.data);
        self.wipes += 1;
        self.data = self.dir.path().join(format!("data{}", self.wipes));
        if let Err(e) = self.spawn() {
            panic!("support: etcd did not restart empty: {e}");
        }
    }

    /// SIGSTOPs the server (it keeps its sockets and stops answering).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONTs the server.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("support: etcd is not running; cannot send {sig}"))
            .id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "support: kill {sig} {pid} failed");
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("etcd log (last 30 lines):\n{}", self.log_tail(30));
        }
        // A paused server must be able to die.
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
        self.kill();
        let mut p = ports();
        p.remove(&self.client_port);
        p.remove(&self.peer_port);
    }
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
