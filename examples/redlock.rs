//! Redlock on five local Redis servers: a majority grants the lock, a paused node costs at
//! most the per-node timeout, two dead nodes are survived, three are not.
//!
//! ```text
//! cargo run --example redlock
//! ```
//!
//! Starts five `redis-server` processes on free loopback ports (and stops them at the end).
//! With `REDLOCK_URLS=redis://h1:6379,redis://h2:6379,...` it uses those servers instead and
//! only takes and releases a lock (it does not stop servers it did not start). Without
//! `redis-server` on the PATH it says so and runs on five in-process stores.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlease::{
    Backend, Error, LockManager, LockOptions, MemoryBackend, RedisOptions, Redlock, RedlockOptions,
};

/// Short, so that the restart guard (fresh servers count after one maximum lease time) and
/// the demo stay quick. Real services keep the default 30 s.
const TTL: Duration = Duration::from_secs(2);

#[tokio::main]
async fn main() -> redlease::Result<()> {
    let options = RedlockOptions::new()
        .node_timeout(Duration::from_millis(50))
        .max_lease(TTL)
        // Deployment-wide: no client of these servers takes a longer lease.
        .restart_quarantine(TTL);
    let redis = RedisOptions::new().command_timeout(Duration::from_millis(500));

    if let Ok(urls) = std::env::var("REDLOCK_URLS") {
        let urls: Vec<&str> = urls.split(',').map(str::trim).collect();
        let redlock = Redlock::connect_with(&urls, redis, options).await?;
        println!("Redlock over {} given servers", redlock.nodes());
        return take_and_release(redlock).await;
    }

    let mut servers = match Servers::start(5) {
        Ok(servers) => servers,
        Err(why) => {
            println!("could not start redis-server ({why});");
            println!("running on five in-process stores instead (same algorithm, one process)");
            let nodes = (0..5).map(|_| MemoryBackend::new());
            return take_and_release(Redlock::with_options(nodes, options)?).await;
        }
    };
    let urls = servers.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    // Shared by the two managers below: an `Arc` of a backend is a backend too.
    let redlock = Arc::new(Redlock::connect_with(&urls, redis, options).await?);
    println!(
        "Redlock over {} local servers, quorum {}",
        redlock.nodes(),
        redlock.quorum()
    );
    println!("the servers just started: they count once they have been up for {TTL:?} (the restart guard)");
    take_and_release(redlock.clone()).await?;

    let locks = LockManager::with_options(redlock, LockOptions::new().ttl(TTL))?;
    let lock = locks.lock("reports:nightly");

    servers.signal(0, "STOP");
    let began = Instant::now();
    let guard = lock.acquire().await?;
    println!(
        "node 1 paused: acquired in {:?} (per-node timeout 50 ms)",
        began.elapsed()
    );
    guard.release().await?;
    servers.signal(0, "CONT");

    servers.kill(3);
    servers.kill(4);
    let guard = lock.acquire().await?;
    println!(
        "nodes 4 and 5 killed: acquired on the other three, fencing token {}",
        guard.fencing_token()
    );
    guard.release().await?;

    servers.kill(2);
    match lock.try_acquire().await {
        Err(Error::QuorumNotReached { acquired, required }) => println!(
            "node 3 killed too: QuorumNotReached ({acquired} of the {required} nodes needed)"
        ),
        other => println!("node 3 killed too: unexpected {other:?}"),
    }
    Ok(())
}

/// Takes a lock (waiting for the nodes to count, if they just started), shows its fencing
/// token, and releases it.
async fn take_and_release(redlock: impl Backend) -> redlease::Result<()> {
    let locks = LockManager::with_options(redlock, LockOptions::new().ttl(TTL))?;
    let began = Instant::now();
    let guard = locks.lock("reports:nightly").acquire().await?;
    println!(
        "acquired after {:?}: fencing token {}, valid for {:?}",
        began.elapsed(),
        guard.fencing_token(),
        guard
            .valid_until()
            .saturating_duration_since(Instant::now())
    );
    // Every write the holder makes carries the token; the store rejects older ones.
    guard.release().await?;
    println!("released on every node");
    Ok(())
}

/// Local redis-server processes, stopped when dropped.
struct Servers {
    children: Vec<(u16, Child)>,
}

impl Servers {
    fn start(n: usize) -> Result<Servers, String> {
        let mut servers = Servers {
            children: Vec::new(),
        };
        for _ in 0..n {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())?
                .port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| format!("redis-server: {e}"))?;
            servers.children.push((port, child));
        }
        // Ready when it accepts connections (Redlock::connect then waits for a majority).
        let deadline = Instant::now() + Duration::from_secs(5);
        for (port, _) in &servers.children {
            while std::net::TcpStream::connect(("127.0.0.1", *port)).is_err() {
                if Instant::now() > deadline {
                    return Err(format!("redis-server on port {port} did not start"));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(servers)
    }

    fn urls(&self) -> Vec<String> {
        self.children
            .iter()
            .map(|(port, _)| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    fn signal(&self, i: usize, signal: &str) {
        let pid = self.children[i].1.id().to_string();
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status();
    }

    fn kill(&mut self, i: usize) {
        let _ = self.children[i].1.kill();
        let _ = self.children[i].1.wait();
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
