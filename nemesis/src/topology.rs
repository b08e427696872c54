//! The servers of each configuration: the lock store's servers (which the nemesis faults) and
//! the fenced resource's server (which it never faults).
//!
//! Servers are `tests/support/server.rs`'s `RedisServer` on loopback ports, or, when a
//! [`Launch`] asks for what that spawner cannot do (an environment such as a clock shim's
//! `LD_PRELOAD`, a command prefix such as `ip netns exec`, an address other than
//! 127.0.0.1), a [`LaunchedServer`]. The nemesis handles either as a [`Node`].

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::support::cluster::RedisCluster;
use crate::support::sentinel::RedisSentinels;
use crate::support::server::RedisServer;

/// A Sentinel configuration's replicas (beside its primary).
pub const SENTINEL_REPLICAS: usize = 2;
/// A Sentinel configuration's sentinels (quorum 2).
pub const SENTINELS: usize = 3;

/// A configuration of the lock store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    /// One server, no persistence: a kill loses every lease (a stated limit: fence).
    Single,
    /// One server, `appendonly yes`, `appendfsync everysec`: a kill loses up to ~1 s.
    SingleAof,
    /// One server, no persistence, and the clients' restart quarantine
    /// (`RedisOptions::restart_quarantine`, at the workload's longest TTL): a kill must lose
    /// no lease a holder still counts valid.
    SingleQuarantine,
    /// Redlock over 5 servers without persistence, with the restart quarantine.
    Redlock5,
    /// A Redis Cluster of 3 primaries with a replica each, no persistence, no `ReplicaAck`:
    /// a kill or a pause past the node timeout (1 s) fails over to a replica that may lack
    /// the last grants (a stated limit without `ReplicaAck`).
    Cluster,
    /// A primary with 2 replicas behind 3 sentinels, no persistence, no `ReplicaAck`: a
    /// failover may promote a replica that lacks the last grants (a stated limit).
    Sentinel,
    /// As [`Config::Sentinel`], with `ReplicaAck::replicas(2)`: every replica acknowledges
    /// each grant and extension before it counts, so whichever replica is promoted has it.
    SentinelAck,
}

impl Config {
    /// All configurations, in the order a run takes them.
    pub const ALL: [Config; 7] = [
        Config::Single,
        Config::SingleAof,
        Config::SingleQuarantine,
        Config::Redlock5,
        Config::Cluster,
        Config::Sentinel,
        Config::SentinelAck,
    ];

    /// How many replicas must acknowledge a grant or an extension (`ReplicaAck::replicas`;
    /// 0: off).
    pub fn replica_ack(self) -> u32 {
        match self {
            Config::SentinelAck => SENTINEL_REPLICAS as u32,
            _ => 0,
        }
    }

    /// The clients' restart quarantine (zero: none).
    pub fn restart_quarantine(self) -> Duration {
        match self {
            Config::SingleQuarantine => crate::workload::LONGEST_TTL,
            _ => Duration::ZERO,
        }
    }

    /// Whether the store is a Sentinel deployment.
    pub fn is_sentinel(self) -> bool {
        matches!(self, Config::Sentinel | Config::SentinelAck)
    }

    /// Whether killing a server may lose leases that holders still consider valid, as the
    /// README states for one server (restart without persistence, or AOF's last second).
    /// Redlock's restart quarantine is meant to cover its nodes' kills: not excused.
    pub fn kill_loses_leases(self) -> bool {
        matches!(self, Config::Single | Config::SingleAof | Config::Cluster)
    }

    /// Whether pausing a server may lose leases: on a cluster, a pause past the node
    /// timeout fails over to a replica that may lack the last grants.
    pub fn pause_loses_leases(self) -> bool {
        matches!(self, Config::Cluster)
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Config::Single => "single",
            Config::SingleAof => "single-aof",
            Config::SingleQuarantine => "single-quarantine",
            Config::Redlock5 => "redlock5",
            Config::Cluster => "cluster",
            Config::Sentinel => "sentinel",
            Config::SentinelAck => "sentinel-ack",
        })
    }
}

impl FromStr for Config {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Config::ALL
            .into_iter()
            .find(|c| c.to_string() == s)
            .ok_or_else(|| {
                format!(
                    "unknown configuration {s:?} (single, single-aof, single-quarantine, \
                     redlock5, cluster, sentinel, sentinel-ack)"
                )
            })
    }
}

/// How to start a server beyond the defaults: the seam for the faults under
/// `crate::faults`. A clock shim gives an environment (`ClockOffset::env()`), a network
/// namespace a command prefix (`Net::exec_prefix(host)`) and an address (`Net::addr(host)`).
/// The default (all empty) starts `tests/support/server.rs`'s `RedisServer`; anything else
/// starts a [`LaunchedServer`].
#[derive(Clone, Debug, Default)]
pub struct Launch {
    /// Extra environment of the server process.
    pub env: Vec<(String, String)>,
    /// A command the server runs under (`["ip", "netns", "exec", "h1"]`); it must exec the
    /// server (so that signals to the child reach it).
    pub prefix: Vec<String>,
    /// The address to bind and to reach the server at, instead of 127.0.0.1.
    pub bind: Option<String>,
    /// The network namespace the harness reaches the server from (a `Net`'s hub, for a
    /// server in a host of that `Net`), instead of its own.
    pub control_ns: Option<String>,
}

impl Launch {
    fn is_default(&self) -> bool {
        self.env.is_empty() && self.prefix.is_empty() && self.bind.is_none()
    }
}

/// A store server as the nemesis handles it.
pub trait Node: fmt::Debug + Send {
    /// `redis://HOST:PORT`.
    fn url(&self) -> String;
    /// SIGKILL.
    fn kill(&mut self);
    /// Starts it again on the same port and data dir (AOF reloaded, if any).
    fn restart_keeping_data(&mut self);
    /// SIGSTOP.
    fn pause(&self);
    /// SIGCONT.
    fn resume(&self);
    /// `CLIENT KILL TYPE normal`.
    fn kill_clients(&self);
}

impl Node for RedisServer {
    fn url(&self) -> String {
        RedisServer::url(self)
    }
    fn kill(&mut self) {
        RedisServer::kill(self)
    }
    fn restart_keeping_data(&mut self) {
        RedisServer::restart_keeping_data(self)
    }
    fn pause(&self) {
        RedisServer::pause(self)
    }
    fn resume(&self) {
        RedisServer::resume(self)
    }
    fn kill_clients(&self) {
        RedisServer::kill_clients(self);
    }
}

/// A redis-server started with a [`Launch`]: its environment, under its prefix, bound to
/// its address, in a private directory (removed on drop, when the process is killed).
#[derive(Debug)]
pub struct LaunchedServer {
    launch: Launch,
    args: Vec<String>,
    host: String,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl LaunchedServer {
    /// Starts `redis-server` with `args` (beside port, bind, dir and the defaults of
    /// `tests/support/server.rs`: no RDB, no AOF unless `args` say so) and waits until it
    /// answers PING.
    pub fn start(launch: &Launch, args: &[&str]) -> LaunchedServer {
        let host = launch.bind.clone().unwrap_or_else(|| "127.0.0.1".into());
        let port = TcpListener::bind((host.as_str(), 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|_| {
                // An address of another namespace: any high port is free there.
                20_000 + (std::process::id() % 20_000) as u16
            });
        let dir = std::env::temp_dir().join(format!(
            "redlease-nemesis-srv-{}-{host}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("nemesis: cannot create a server directory");
        let mut s = LaunchedServer {
            launch: launch.clone(),
            args: args.iter().map(|a| a.to_string()).collect(),
            host,
            port,
            dir,
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let mut words: Vec<String> = self.launch.prefix.clone();
        words.push(bin);
        let port = self.port.to_string();
        let dir = self.dir.display().to_string();
        let log = self.dir.join("redis.log").display().to_string();
        for w in [
            "--port",
            &port,
            "--bind",
            &self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            &dir,
            "--logfile",
            &log,
        ] {
            words.push(w.to_string());
        }
        words.extend(self.args.iter().cloned());
        let child = Command::new(&words[0])
            .args(&words[1..])
            .envs(self.launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("nemesis: cannot start {words:?}: {e}"));
        self.child = Some(child);
        let up = crate::support::wait_for_interval(
            Duration::from_secs(10),
            Duration::from_millis(20),
            || self.command("PING").is_ok_and(|r| r.starts_with("+PONG")),
        );
        assert!(up, "nemesis: {words:?} did not answer PING in 10 s");
    }

    /// Sends one inline command on a fresh connection; the first reply line.
    fn command(&self, cmd: &str) -> std::io::Result<String> {
        let addr: std::net::SocketAddr = format!("{}:{}", self.host, self.port)
            .parse()
            .map_err(std::io::Error::other)?;
        let mut c = match &self.launch.control_ns {
            Some(ns) => crate::faults::net::within(ns, move || {
                TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            })?,
            None => TcpStream::connect(addr)?,
        };
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
        c.write_all(format!("{cmd}\r\n").as_bytes())?;
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line)?;
        Ok(line)
    }

    fn signal(&self, sig: Signal) {
        if let Some(c) = &self.child {
            let _ = kill(Pid::from_raw(c.id() as i32), sig);
        }
    }
}

impl Node for LaunchedServer {
    fn url(&self) -> String {
        format!("redis://{}:{}", self.host, self.port)
    }
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    fn restart_keeping_data(&mut self) {
        self.kill();
        self.spawn();
    }
    fn pause(&self) {
        self.signal(Signal::SIGSTOP)
    }
    fn resume(&self) {
        self.signal(Signal::SIGCONT)
    }
    fn kill_clients(&self) {
        let _ = self.command("CLIENT KILL TYPE normal");
    }
}

impl Drop for LaunchedServer {
    fn drop(&mut self) {
        self.signal(Signal::SIGCONT);
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A configuration's servers.
pub struct Topology {
    /// The configuration.
    pub config: Config,
    /// The lock store's servers (faulted); a cluster's primaries first, then replicas.
    /// Empty for a Sentinel configuration, whose data nodes are in [`sentinels`](Self::sentinels).
    pub servers: Vec<Box<dyn Node>>,
    /// A cluster's URL (naming its first primaries); `None`: the servers' own URLs.
    pub cluster_url: Option<String>,
    /// A Sentinel configuration's data nodes (faulted) and sentinels (never faulted).
    pub sentinels: Option<RedisSentinels>,
    /// The fenced resource's server (never faulted).
    pub fence: RedisServer,
}

impl fmt::Debug for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Topology")
            .field("config", &self.config)
            .field("urls", &self.urls())
            .finish_non_exhaustive()
    }
}

impl Topology {
    /// Starts the servers of `config`; server `i` as `launch(i)` says.
    pub fn start(config: Config, launch: &dyn Fn(usize) -> Launch) -> Topology {
        if config.is_sentinel() {
            assert!(
                launch(0).is_default(),
                "nemesis: a Sentinel deployment's nodes start as tests/support/sentinel.rs \
                 starts them"
            );
            return Topology {
                config,
                servers: Vec::new(),
                cluster_url: None,
                sentinels: Some(RedisSentinels::start(SENTINEL_REPLICAS, SENTINELS)),
                fence: RedisServer::start(),
            };
        }
        if config == Config::Cluster {
            assert!(
                launch(0).is_default(),
                "nemesis: a cluster's nodes start as tests/support/cluster.rs starts them"
            );
            let mut cluster = RedisCluster::start(3, 1);
            let url = cluster.url();
            let servers = std::mem::take(&mut cluster.nodes)
                .into_iter()
                .map(|n| Box::new(n) as Box<dyn Node>)
                .collect();
            return Topology {
                config,
                servers,
                cluster_url: Some(url),
                sentinels: None,
                fence: RedisServer::start(),
            };
        }
        let (count, args): (usize, &[&str]) = match config {
            Config::Single
            | Config::SingleQuarantine
            | Config::Cluster
            | Config::Sentinel
            | Config::SentinelAck => (1, &[]),
            Config::SingleAof => (1, &["--appendonly", "yes", "--appendfsync", "everysec"]),
            Config::Redlock5 => (5, &[]),
        };
        let servers = (0..count)
            .map(|i| {
                let l = launch(i);
                if l.is_default() {
                    Box::new(RedisServer::start_with(args)) as Box<dyn Node>
                } else {
                    Box::new(LaunchedServer::start(&l, args)) as Box<dyn Node>
                }
            })
            .collect();
        Topology {
            config,
            servers,
            cluster_url: None,
            sentinels: None,
            fence: RedisServer::start(),
        }
    }

    /// The lock store's URLs: a cluster's one URL, a Sentinel deployment's one
    /// `redis-sentinel://` URL, or each server's.
    pub fn urls(&self) -> Vec<String> {
        if let Some(d) = &self.sentinels {
            return vec![d.url()];
        }
        match &self.cluster_url {
            Some(url) => vec![url.clone()],
            None => self.servers.iter().map(|s| s.url()).collect(),
        }
    }

    /// How many store servers the nemesis may fault.
    pub fn node_count(&self) -> usize {
        match &self.sentinels {
            Some(d) => d.nodes.len(),
            None => self.servers.len(),
        }
    }

    /// Store server `i` (`i < node_count()`).
    pub fn node(&mut self, i: usize) -> &mut dyn Node {
        match &mut self.sentinels {
            Some(d) => &mut d.nodes[i],
            None => self.servers[i].as_mut(),
        }
    }
}
