//! A throw-away PostgreSQL 15 server (Debian's `postgresql` package) for the tests: its own
//! data directory in a temp dir, a free loopback port, `fsync=off`, run as the `postgres`
//! user (initdb and postgres refuse root). Killed and removed on drop.
//!
//! The data directory is copied from one `initdb` per test process (its template is left in
//! the temp dir, and removed, with anything else a test process that is gone left behind,
//! by the next test process).
//!
//! `fsync=off` loses nothing when a process is killed (the OS keeps the written pages); only
//! a machine crash could, which no test makes. Commits stay synchronous, so a grant that was
//! answered is never forgotten by a restart.

use std::collections::HashSet;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redlease::{PostgresBackend, PostgresOptions};

const BIN: &str = "/usr/lib/postgresql/15/bin";

fn bin(name: &str) -> String {
    let path = format!("{BIN}/{name}");
    if !Path::new(&path).exists() {
        panic!(
            "{path} is missing: the PostgreSQL tests need Debian's PostgreSQL 15 \
             (apt-get install -y postgresql)"
        );
    }
    path
}

/// Runs `cmd` as the `postgres` user.
fn as_postgres(program: &str) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid=postgres",
        "--regid=postgres",
        "--init-groups",
        program,
    ]);
    cmd
}

fn chown(path: &Path) {
    let ok = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(path)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "chown -R postgres {}", path.display());
}

/// Removes what test processes that are gone left behind (a process killed before its
/// servers were dropped): their servers are killed, their directories removed.
fn sweep_stale() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("redlease-pg-") else {
                continue;
            };
            let Some(owner) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if owner == std::process::id() || Path::new(&format!("/proc/{owner}")).exists() {
                continue; // the owning test process is still alive
            }
            let data = entry.path().join("data");
            let pid = fs::read_to_string(data.join("postmaster.pid"))
                .ok()
                .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()));
            if let Some(pid) = pid {
                // Only a postmaster running in that very directory.
                let cwd = fs::read_link(format!("/proc/{pid}/cwd")).ok();
                if cwd.is_some() && cwd == fs::canonicalize(&data).ok() {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .stderr(Stdio::null())
                        .status();
                }
            }
            let _ = fs::remove_dir_all(entry.path());
        }
    });
}

fn fresh_dir(what: &str) -> PathBuf {
    sweep_stale();
    static N: Mutex<u64> = Mutex::new(0);
    let n = {
        let mut n = N.lock().unwrap_or_else(|p| p.into_inner());
        *n += 1;
        *n
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "redlease-pg-{}-{what}-{n}-{nanos}",
        std::process::id()
    ));
    fs::create_dir_all(&dir).expect("create a temp dir");
    dir
}

/// One initdb per test process, copied for each server (initdb takes most of a second).
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dir = fresh_dir("template");
        chown(&dir);
        let out = as_postgres(&bin("initdb"))
            .arg("-D")
            .arg(dir.join("data"))
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
                "--no-sync",
            ])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir.join("data")
    })
}

fn free_port() -> u16 {
    static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
        if taken.get_or_insert_with(HashSet::new).insert(port) {
            return port;
        }
    }
}

/// A PostgreSQL server of the test's own.
#[derive(Debug)]
pub struct PgServer {
    dir: PathBuf,
    port: u16,
    child: Mutex<Option<Child>>,
    /// The harness's own connection, for [`psql`](Self::psql).
    conn: Mutex<Option<std::net::TcpStream>>,
}

impl PgServer {
    /// Starts a server and waits until it accepts connections.
    pub fn start() -> Self {
        let dir = fresh_dir("server");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(template())
            .arg(dir.join("data"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(copied, "copy the template data dir");
        chown(&dir);
        let srv = PgServer {
            dir,
            port: free_port(),
            child: Mutex::new(None),
            conn: Mutex::new(None),
        };
        srv.launch();
        srv
    }

    fn launch(&self) {
        let log = fs::File::create(self.dir.join("postgres.log")).expect("log file");
        let child = as_postgres(&bin("postgres"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=200",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn postgres");
        *self.child.lock().unwrap() = Some(child);
        let began = Instant::now();
        loop {
            let ready = Command::new(bin("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-p"])
                .arg(self.port.to_string())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ready {
                return;
            }
            if let Some(Some(status)) = self
                .child
                .lock()
                .unwrap()
                .as_mut()
                .map(|c| c.try_wait().ok().flatten())
            {
                panic!("postgres exited ({status}): {}", self.log());
            }
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "postgres not ready in 30 s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A backend of its own (its own connections), with a short command timeout.
    pub async fn backend(&self) -> PostgresBackend {
        self.backend_with(PostgresOptions::new()).await
    }

    /// A backend of its own with `opts` (a 2 s command timeout unless they set another).
    pub async fn backend_with(&self, opts: PostgresOptions) -> PostgresBackend {
        PostgresBackend::connect_with(&self.url(), opts)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()))
    }

    fn postmaster(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// The postmaster's children (each in its own session: signals to the group miss them).
    fn children(&self) -> Vec<u32> {
        let Some(pid) = self.postmaster() else {
            return Vec::new();
        };
        let out = Command::new("pgrep")
            .args(["-P", &pid.to_string()])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        out.lines().filter_map(|l| l.trim().parse().ok()).collect()
    }

    fn signal(pids: &[u32], sig: &str) {
        if pids.is_empty() {
            return;
        }
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .args(pids.iter().map(u32::to_string))
            .stderr(Stdio::null())
            .status();
    }

    /// Kills the server (SIGKILL) and waits until every one of its processes is gone.
    pub fn kill(&self) {
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let children = self.children();
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Self::signal(&children, "KILL");
        let began = Instant::now();
        while children
            .iter()
            .any(|pid| Path::new(&format!("/proc/{pid}")).exists())
            && began.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Starts the server again on the same data and port (crash recovery).
    pub fn restart(&self) {
        self.kill();
        self.launch();
    }

    /// Stops every process of the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        let mut pids: Vec<u32> = self.postmaster().into_iter().collect();
        pids.extend(self.children());
        Self::signal(&pids, "STOP");
    }

    /// Lets a paused server go on.
    pub fn resume(&self) {
        let mut pids: Vec<u32> = self.postmaster().into_iter().collect();
        pids.extend(self.children());
        Self::signal(&pids, "CONT");
    }

    /// Runs `sql` (one statement, the simple query protocol) on a connection of the
    /// harness's own and returns its rows as psql's unaligned output would: one line per
    /// row, columns joined by `|`, NULL as the empty string. Panics on an error.
    pub fn psql(&self, sql: &str) -> String {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.is_none() {
            *conn = Some(wire::connect(self.port));
        }
        let stream = conn.as_mut().expect("connected above");
        match wire::query(stream, sql) {
            Ok(out) => out,
            Err(e) => {
                *conn = None;
                panic!("{sql:?}: {e}");
            }
        }
    }
}

/// Just enough of PostgreSQL's wire protocol (v3, trust authentication, simple queries) for
/// the tests to read the store's tables quickly: a psql process costs tens of milliseconds.
mod wire {
    use std::io::{self, Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    pub fn connect(port: u16) -> TcpStream {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to postgres");
        s.set_read_timeout(Some(Duration::from_secs(10))).ok();
        let mut body = Vec::new();
        body.extend_from_slice(&196608u32.to_be_bytes());
        for part in ["user", "postgres", "database", "postgres", ""] {
            body.extend_from_slice(part.as_bytes());
            body.push(0);
        }
        let mut msg = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        s.write_all(&msg).expect("send the startup message");
        if let Err(e) = ready(&mut s).expect("the server's greeting") {
            panic!("postgres refused the harness's connection: {e}");
        }
        s
    }

    fn message(s: &mut TcpStream) -> io::Result<(u8, Vec<u8>)> {
        let mut head = [0u8; 5];
        s.read_exact(&mut head)?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut body = vec![0u8; len.saturating_sub(4)];
        s.read_exact(&mut body)?;
        Ok((head[0], body))
    }

    /// Reads until ReadyForQuery: the data rows, or the error's message.
    fn ready(s: &mut TcpStream) -> io::Result<Result<Vec<String>, String>> {
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let (kind, body) = message(s)?;
            match kind {
                b'D' => {
                    let n = u16::from_be_bytes([body[0], body[1]]) as usize;
                    let mut at = 2;
                    let mut cols = Vec::with_capacity(n);
                    for _ in 0..n {
                        let len = i32::from_be_bytes([
                            body[at],
                            body[at + 1],
                            body[at + 2],
                            body[at + 3],
                        ]);
                        at += 4;
                        if len < 0 {
                            cols.push(String::new());
                        } else {
                            let len = len as usize;
                            cols.push(String::from_utf8_lossy(&body[at..at + len]).into_owned());
                            at += len;
                        }
                    }
                    rows.push(cols.join("|"));
                }
                b'E' => {
                    let fields: Vec<String> = body
                        .split(|b| *b == 0)
                        .filter(|f| f.first() == Some(&b'M'))
                        .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
                        .collect();
                    error = Some(fields.join("; "));
                }
                b'Z' => return Ok(error.map_or(Ok(rows), Err)),
                _ => {}
            }
        }
    }

    pub fn query(s: &mut TcpStream, sql: &str) -> Result<String, String> {
        let mut msg = vec![b'Q'];
        msg.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
        msg.extend_from_slice(sql.as_bytes());
        msg.push(0);
        s.write_all(&msg).map_err(|e| e.to_string())?;
        match ready(s) {
            Ok(Ok(rows)) => Ok(rows.join("\n")),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
