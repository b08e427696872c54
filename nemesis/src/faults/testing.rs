//! What the faults' self-tests share: a redis-server child that is killed on drop, and a
//! blocking RESP client small enough to see exactly what a socket does under a fault.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A redis-server child; killed (and reaped) on drop.
pub struct Server {
    child: Child,
    dir: PathBuf,
}

impl Server {
    /// Starts `prefix... redis-server <args>` with `env`, and returns once it logged that it
    /// accepts connections (read from its stdout: an event, not a sleep).
    pub fn start(prefix: &[String], args: &[&str], env: &[(String, String)]) -> Server {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "redlease-faults-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("test: server dir");
        let mut argv: Vec<String> = prefix.to_vec();
        argv.push("redis-server".into());
        argv.extend(["--save", "", "--appendonly", "no", "--daemonize", "no"].map(String::from));
        // A replica writes the RDB it receives: into a directory of its own.
        argv.extend(["--dir".to_string(), dir.display().to_string()]);
        argv.extend(args.iter().map(|a| a.to_string()));
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("test: start redis-server");
        let out = child.stdout.take().expect("test: server stdout");
        let mut lines = BufReader::new(out).lines();
        let mut log = Vec::new();
        loop {
            match lines.next() {
                Some(Ok(line)) => {
                    let ready = line.contains("Ready to accept connections");
                    log.push(line);
                    if ready {
                        break;
                    }
                }
                _ => panic!("test: redis-server {args:?} exited before it was ready: {log:#?}"),
            }
        }
        // Keeps draining its log so that it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, dir }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free loopback port (free when asked; the server binds it right after).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("test: bind a free port");
    l.local_addr().expect("test: port").port()
}

/// A reply, as far as these tests read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `+...`
    Status(String),
    /// `-...`
    Error(String),
    /// `:...`
    Int(i64),
    /// `$...` (`None`: nil)
    Bulk(Option<String>),
    /// `*...` (`None`: nil)
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// The text of a bulk or status reply.
    pub fn text(&self) -> Option<&str> {
        match self {
            Reply::Status(s) | Reply::Bulk(Some(s)) => Some(s),
            _ => None,
        }
    }
}

/// One blocking connection speaking RESP 2.
pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Conn {
    /// Connects to `addr`.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<Conn> {
        Conn::from_stream(TcpStream::connect(addr)?)
    }

    /// Wraps a connected stream.
    pub fn from_stream(stream: TcpStream) -> io::Result<Conn> {
        stream.set_nodelay(true)?;
        Ok(Conn {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// Sends a command without waiting for its reply.
    pub fn send(&mut self, args: &[&str]) -> io::Result<()> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend(format!("${}\r\n{a}\r\n", a.len()).bytes());
        }
        self.writer.write_all(&out)
    }

    /// Reads one reply, waiting at most `timeout` for it to start.
    pub fn read(&mut self, timeout: Duration) -> io::Result<Reply> {
        self.writer.set_read_timeout(Some(timeout))?;
        read_reply(&mut self.reader)
    }

    /// Sends a command and reads its reply (waiting at most 10 s).
    pub fn call(&mut self, args: &[&str]) -> io::Result<Reply> {
        self.send(args)?;
        self.read(Duration::from_secs(10))
    }
}

fn read_reply(r: &mut BufReader<TcpStream>) -> io::Result<Reply> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let line = line.trim_end_matches("\r\n");
    let (kind, rest) = line.split_at(1);
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("bad reply {line:?}"));
    let n = || rest.parse::<i64>().map_err(|_| bad());
    Ok(match kind {
        "+" => Reply::Status(rest.into()),
        "-" => Reply::Error(rest.into()),
        ":" => Reply::Int(n()?),
        "$" if n()? < 0 => Reply::Bulk(None),
        "$" => {
            let mut buf = vec![0u8; n()? as usize + 2];
            r.read_exact(&mut buf)?;
            buf.truncate(buf.len() - 2);
            Reply::Bulk(Some(String::from_utf8_lossy(&buf).into()))
        }
        "*" if n()? < 0 => Reply::Array(None),
        "*" => Reply::Array(Some(
            (0..n()?)
                .map(|_| read_reply(r))
                .collect::<io::Result<_>>()?,
        )),
        _ => return Err(bad()),
    })
}
