//! Delays, stalls and connection kills: a userspace TCP proxy (tokio) between clients and one
//! server, for what `tc netem` would do if the kernel had it.
//!
//! Each connection accepted is proxied by a task of its own: per direction one read loop and
//! one write loop joined by a bounded queue of chunks (at most 64 of 16 KiB), so many
//! connections and pipelined traffic cost no thread each, and a held direction pushes back on
//! its sender (the proxy stops reading, the sender's socket buffers fill, as behind a real
//! stall).
//!
//! - [`set_delay`](DelayProxy::set_delay): every chunk is written on no earlier than `delay`
//!   after it was read, in order, both directions; a new delay applies to chunks read after it
//!   (a chunk never overtakes an earlier one, so shortening the delay drains the queue first).
//! - [`set_stall`](DelayProxy::set_stall): nothing is written on while on: no error, no
//!   reset, the bytes wait (as a partition's retransmissions would) and go on, in order, when
//!   it is off. New connections are still accepted by the proxy's kernel (a real partition
//!   would leave the SYN unanswered) and wait like the others.
//! - [`kill_connections`](DelayProxy::kill_connections): every connection open through the
//!   proxy is closed abruptly on both sides (`SO_LINGER` 0: a reset, queued bytes dropped).
//!
//! Limits: a chunk is whatever one `read` returned, so the delay applies per read, not per
//! packet; the proxy sees connections, not Redis commands. Clean-up: dropping the proxy stops
//! accepting and kills every connection through it. It runs on the tokio runtime it was
//! started in.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Chunks queued per direction before the proxy stops reading.
const QUEUED: usize = 64;
/// The most one read takes.
const CHUNK: usize = 16 * 1024;

/// Makes a blocking connection to the upstream (for [`DelayProxy::start_with`]).
type Connect = Arc<dyn Fn() -> io::Result<std::net::TcpStream> + Send + Sync>;

/// A proxy to one upstream; see the module docs. Dropping it kills every connection.
#[derive(Debug)]
pub struct DelayProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

/// What the proxy has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Connections accepted from clients.
    pub accepted: u64,
    /// Connections proxied now (accepted and connected upstream, not yet closed).
    pub open: u64,
    /// Connections closed by [`DelayProxy::kill_connections`] (or the proxy's drop).
    pub killed: u64,
    /// Connections accepted whose upstream connect failed (the client's side was reset).
    pub upstream_failed: u64,
    /// Bytes read from clients.
    pub bytes_up: u64,
    /// Bytes read from the upstream.
    pub bytes_down: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Settings {
    delay: Duration,
    stall: bool,
}

#[derive(Debug)]
struct Shared {
    settings: watch::Sender<Settings>,
    /// Bumped by each kill: connections watch it.
    kills: watch::Sender<u64>,
    accepted: AtomicU64,
    open: AtomicU64,
    killed: AtomicU64,
    upstream_failed: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

enum Upstream {
    Addr(SocketAddr),
    Connect(Connect),
}

impl Upstream {
    fn connect(&self) -> Pin<Box<dyn Future<Output = io::Result<TcpStream>> + Send + 'static>> {
        match self {
            Upstream::Addr(a) => Box::pin(TcpStream::connect(*a)),
            Upstream::Connect(f) => {
                let f = f.clone();
                Box::pin(async move {
                    let s = tokio::task::spawn_blocking(move || f())
                        .await
                        .map_err(io::Error::other)??;
                    s.set_nonblocking(true)?;
                    TcpStream::from_std(s)
                })
            }
        }
    }
}

impl DelayProxy {
    /// Listens on `listen` (port 0 for any) and proxies each connection to `upstream`. Must
    /// be called within a tokio runtime (the proxy's tasks run on it).
    pub fn start(listen: SocketAddr, upstream: SocketAddr) -> io::Result<DelayProxy> {
        DelayProxy::spawn(listen, Upstream::Addr(upstream))
    }

    /// Like [`start`](Self::start), but each upstream connection is made by `connect` (a
    /// blocking call, run off the runtime's workers): for instance
    /// `Net::connect(CONTROL, server, timeout)`, which gives the root namespace a loopback
    /// port for a server inside a network namespace.
    pub fn start_with<F>(listen: SocketAddr, connect: F) -> io::Result<DelayProxy>
    where
        F: Fn() -> io::Result<std::net::TcpStream> + Send + Sync + 'static,
    {
        DelayProxy::spawn(listen, Upstream::Connect(Arc::new(connect)))
    }

    fn spawn(listen: SocketAddr, upstream: Upstream) -> io::Result<DelayProxy> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            io::Error::other("proxy: DelayProxy::start must be called within a tokio runtime")
        })?;
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = {
            let _in = runtime.enter();
            TcpListener::from_std(listener)?
        };
        let shared = Arc::new(Shared {
            settings: watch::Sender::new(Settings::default()),
            kills: watch::Sender::new(0),
            accepted: AtomicU64::new(0),
            open: AtomicU64::new(0),
            killed: AtomicU64::new(0),
            upstream_failed: AtomicU64::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
        });
        let accept = runtime.spawn(accept(listener, upstream, shared.clone()));
        Ok(DelayProxy {
            addr,
            shared,
            accept,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds every chunk read from now on `delay` before writing it on (0: none).
    pub fn set_delay(&self, delay: Duration) {
        self.shared.settings.send_modify(|s| s.delay = delay);
    }

    /// The delay now.
    pub fn delay(&self) -> Duration {
        self.shared.settings.borrow().delay
    }

    /// Holds everything (`true`), or lets it go on in order (`false`).
    pub fn set_stall(&self, stall: bool) {
        self.shared.settings.send_modify(|s| s.stall = stall);
    }

    /// Whether everything is held now.
    pub fn stalled(&self) -> bool {
        self.shared.settings.borrow().stall
    }

    /// Closes every connection open through the proxy abruptly, both sides (a reset).
    /// Connections accepted afterwards are proxied as usual.
    pub fn kill_connections(&self) {
        self.shared.kills.send_modify(|k| *k += 1);
    }

    /// What the proxy has done so far.
    pub fn counters(&self) -> Counters {
        let s = &self.shared;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            accepted: get(&s.accepted),
            open: get(&s.open),
            killed: get(&s.killed),
            upstream_failed: get(&s.upstream_failed),
            bytes_up: get(&s.bytes_up),
            bytes_down: get(&s.bytes_down),
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.kill_connections();
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Upstream::Addr(a) => write!(f, "{a}"),
            Upstream::Connect(_) => f.write_str("<connect fn>"),
        }
    }
}

async fn accept(listener: TcpListener, upstream: Upstream, shared: Arc<Shared>) {
    let upstream = Arc::new(upstream);
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            // Out of descriptors and the like: the next accept may do better.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        // Subscribed before the task runs: a kill from now on reaches this connection.
        let kills = shared.kills.subscribe();
        tokio::spawn(serve(client, upstream.clone(), shared.clone(), kills));
    }
}

/// Decrements `open` however the connection's task ends.
struct Open<'a>(&'a AtomicU64);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve(
    client: TcpStream,
    upstream: Arc<Upstream>,
    shared: Arc<Shared>,
    mut kills: watch::Receiver<u64>,
) {
    let server = tokio::select! {
        s = upstream.connect() => s,
        _ = kills.changed() => {
            let _ = client.set_zero_linger();
            shared.killed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let server = match server {
        Ok(s) => s,
        Err(_) => {
            let _ = client.set_zero_linger();
            shared.upstream_failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    shared.open.fetch_add(1, Ordering::Relaxed);
    let _open = Open(&shared.open);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let killed = tokio::select! {
        _ = async {
            tokio::try_join!(
                pipe(&mut cr, &mut sw, &shared, &shared.bytes_up),
                pipe(&mut sr, &mut cw, &shared, &shared.bytes_down),
            )
        } => false,
        _ = kills.changed() => true,
    };
    if killed {
        let _ = cr.as_ref().set_zero_linger();
        let _ = sr.as_ref().set_zero_linger();
        // A write half dropped sends a FIN first; forgotten, it leaves the close (a reset,
        // with no linger) to the read half's drop.
        cw.forget();
        sw.forget();
        shared.killed.fetch_add(1, Ordering::Relaxed);
    }
    // Dropping the halves closes both sockets.
}

/// Copies `r` to `w`, each chunk held per the settings; shuts `w`'s writing down at `r`'s end.
async fn pipe(
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
    shared: &Shared,
    bytes: &AtomicU64,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUED);
    let read = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), io::Error>(());
            }
            bytes.fetch_add(n as u64, Ordering::Relaxed);
            let at = Instant::now() + shared.settings.borrow().delay;
            if tx.send((at, buf[..n].to_vec())).await.is_err() {
                return Ok(());
            }
        }
    };
    let write = async {
        let mut settings = shared.settings.subscribe();
        while let Some((at, chunk)) = rx.recv().await {
            loop {
                if settings.wait_for(|s| !s.stall).await.is_err() {
                    return Ok(());
                }
                tokio::time::sleep_until(at).await;
                if !settings.borrow().stall {
                    break;
                }
            }
            w.write_all(&chunk).await?;
        }
        w.shutdown().await
    };
    tokio::try_join!(read, write).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::testing::{free_port, Server};
    use tokio::time::timeout;

    const PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";
    const PONG: &[u8] = b"+PONG\r\n";

    async fn reply(s: &mut TcpStream, len: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await?;
        Ok(buf)
    }

    fn any() -> SocketAddr {
        "127.0.0.1:0".parse().expect("address")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delays_stalls_and_kills_against_a_real_server() {
        let port = free_port();
        let _server = Server::start(&[], &["--port", &port.to_string()], &[]);
        let upstream: SocketAddr = ([127, 0, 0, 1], port).into();
        let proxy = DelayProxy::start(any(), upstream).expect("proxy");
        let mut c = TcpStream::connect(proxy.addr()).await.expect("connect");
        c.write_all(PING).await.expect("write");
        assert_eq!(reply(&mut c, 7).await.expect("PONG"), PONG);

        // A delay holds each direction at least that long (a lower bound: load only adds).
        proxy.set_delay(Duration::from_millis(150));
        let start = Instant::now();
        c.write_all(PING).await.expect("write");
        assert_eq!(reply(&mut c, 7).await.expect("PONG"), PONG);
        assert!(start.elapsed() >= Duration::from_millis(300));

        // Many connections, each pipelining writes, through the delay: all in order.
        proxy.set_delay(Duration::from_millis(5));
        let clients = (0..40).map(|i| {
            let addr = proxy.addr();
            tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await?;
                let mut out = Vec::new();
                for j in 0..50 {
                    let (k, v) = (format!("k{i}"), format!("{j:04}"));
                    out.extend(
                        format!("*3\r\n$3\r\nSET\r\n${}\r\n{k}\r\n$4\r\n{v}\r\n", k.len()).bytes(),
                    );
                    // Written a few commands at a time: many chunks, kept in order.
                    if j % 7 == 0 {
                        s.write_all(&out).await?;
                        out.clear();
                    }
                }
                let k = format!("k{i}");
                out.extend(format!("*2\r\n$3\r\nGET\r\n${}\r\n{k}\r\n", k.len()).bytes());
                s.write_all(&out).await?;
                let oks = reply(&mut s, 5 * 50).await?;
                assert!(oks.chunks(5).all(|r| r == b"+OK\r\n"));
                reply(&mut s, 10).await
            })
        });
        for client in clients.collect::<Vec<_>>() {
            let last = client.await.expect("client task").expect("client");
            assert_eq!(last, b"$4\r\n0049\r\n");
        }
        proxy.set_delay(Duration::ZERO);

        // A stall: nothing comes back (no error, no close) until it is lifted.
        proxy.set_stall(true);
        c.write_all(PING)
            .await
            .expect("a write during a stall succeeds");
        let mut one = [0u8; 1];
        assert!(timeout(Duration::from_millis(500), c.read(&mut one))
            .await
            .is_err());
        proxy.set_stall(false);
        assert_eq!(reply(&mut c, 7).await.expect("the held PONG"), PONG);

        // A kill resets the client's connection; new ones are proxied as before.
        let before = proxy.counters();
        assert_eq!(before.open, 1, "{before:?}");
        proxy.kill_connections();
        let end = c.read(&mut one).await;
        assert!(
            matches!(&end, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "{end:?}"
        );
        let mut d = TcpStream::connect(proxy.addr()).await.expect("connect");
        d.write_all(PING).await.expect("write");
        assert_eq!(reply(&mut d, 7).await.expect("PONG"), PONG);
        let after = proxy.counters();
        assert_eq!(after.killed, 1, "{after:?}");
        assert_eq!(after.accepted, 42, "{after:?}");
        assert!(after.bytes_up > before.bytes_up && after.bytes_down > 0);

        // No upstream: the client is reset, and counted.
        let dead = DelayProxy::start(any(), ([127, 0, 0, 1], free_port()).into()).expect("proxy");
        // The reset may come before the connect is seen complete, or after.
        let end = match TcpStream::connect(dead.addr()).await {
            Ok(mut e) => e.read(&mut one).await,
            Err(e) => Err(e),
        };
        assert!(
            matches!(&end, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "{end:?}"
        );
        assert_eq!(dead.counters().upstream_failed, 1);
    }

    #[test]
    fn start_outside_a_runtime_says_so() {
        let e = DelayProxy::start(any(), any()).expect_err("no runtime");
        assert!(e.to_string().contains("tokio runtime"), "{e}");
    }
}
