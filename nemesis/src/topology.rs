//! The servers of each configuration: the lock store's servers (which the nemesis faults) and
//! the fenced resource's server (which it never faults).
//!
//! Servers are `tests/support/server.rs`'s `RedisServer` on loopback ports. [`Launch`] is
//! the place for what that spawner cannot do (an environment such as a clock shim's
//! `LD_PRELOAD`, a command prefix such as `ip netns exec`, an address other than
//! 127.0.0.1): see its docs.

use std::fmt;
use std::str::FromStr;

use crate::support::server::RedisServer;

/// A configuration of the lock store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    /// One server, no persistence: a kill loses every lease (a stated limit: fence).
    Single,
    /// One server, `appendonly yes`, `appendfsync everysec`: a kill loses up to ~1 s.
    SingleAof,
    /// Redlock over 5 servers without persistence, with the restart quarantine.
    Redlock5,
}

impl Config {
    /// All configurations, in the order a run takes them.
    pub const ALL: [Config; 3] = [Config::Single, Config::SingleAof, Config::Redlock5];

    /// Whether killing a server may lose leases that holders still consider valid, as the
    /// README states for one server (restart without persistence, or AOF's last second).
    /// Redlock's restart quarantine is meant to cover its nodes' kills: not excused.
    pub fn kill_loses_leases(self) -> bool {
        matches!(self, Config::Single | Config::SingleAof)
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Config::Single => "single",
            Config::SingleAof => "single-aof",
            Config::Redlock5 => "redlock5",
        })
    }
}

impl FromStr for Config {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Config::ALL
            .into_iter()
            .find(|c| c.to_string() == s)
            .ok_or_else(|| format!("unknown configuration {s:?} (single, single-aof, redlock5)"))
    }
}

/// How to start a server beyond the defaults: the seam for the faults under
/// `crate::faults` (a clock shim's environment, a network namespace's `ip netns exec`
/// prefix and address). Only the default (all empty) is served by `RedisServer` today; a
/// topology asked for more panics with a clear message until a launcher that honours it is
/// wired in here.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    /// Extra environment of the server process.
    pub env: Vec<(String, String)>,
    /// A command the server runs under (`["ip", "netns", "exec", "h1"]`).
    pub prefix: Vec<String>,
    /// The address to bind instead of 127.0.0.1.
    pub bind: Option<String>,
}

/// A configuration's servers.
#[derive(Debug)]
pub struct Topology {
    /// The configuration.
    pub config: Config,
    /// The lock store's servers (faulted).
    pub servers: Vec<RedisServer>,
    /// The fenced resource's server (never faulted).
    pub fence: RedisServer,
}

impl Topology {
    /// Starts the servers of `config`, each launched as `launch` says.
    pub fn start(config: Config, launch: &Launch) -> Topology {
        assert!(
            launch.env.is_empty() && launch.prefix.is_empty() && launch.bind.is_none(),
            "nemesis: servers with an environment, a prefix or an address need the faults' launcher"
        );
        let servers = match config {
            Config::Single => vec![RedisServer::start()],
            Config::SingleAof => vec![RedisServer::start_with(&[
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
            ])],
            Config::Redlock5 => (0..5).map(|_| RedisServer::start()).collect(),
        };
        Topology {
            config,
            servers,
            fence: RedisServer::start(),
        }
    }

    /// The lock store's URLs.
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(RedisServer::url).collect()
    }
}
