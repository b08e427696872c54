//! A throw-away Redis Cluster: `redis-server --cluster-enabled yes` on free loopback ports,
//! joined by `redis-cli --cluster create`, killed on drop (its nodes are [`RedisServer`]s).

use std::process::Command;
use std::time::Duration;

use super::server::RedisServer;
use super::wait_for_interval;

/// How long the nodes may take to agree that the cluster is up.
const READY: Duration = Duration::from_secs(20);
/// How often the nodes are asked meanwhile.
const POLL: Duration = Duration::from_millis(20);

/// A cluster of primaries (and their replicas), for tests.
pub struct RedisCluster {
    /// The primaries first, in the order `redis-cli` was given them, then the replicas.
    pub nodes: Vec<RedisServer>,
    primaries: usize,
}

impl RedisCluster {
    /// `primaries` primaries with `replicas` replicas each, slots spread evenly, every node
    /// reporting `cluster_state:ok`. A node that dies is noticed by the others after 1 s
    /// (`cluster-node-timeout`), and a cluster missing a shard keeps serving the others
    /// (`cluster-require-full-coverage no`).
    pub fn start(primaries: usize, replicas: usize) -> RedisCluster {
        let redis_cli = std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".into());
        let nodes: Vec<RedisServer> = (0..primaries * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-require-full-coverage",
                    "no",
                    // Replicas sync at once (a replica that never synced does not fail over).
                    "--repl-diskless-sync-delay",
                    "0",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut args = vec!["--cluster".to_string(), "create".into()];
        args.extend(addrs);
        args.extend([
            "--cluster-replicas".into(),
            replicas.to_string(),
            "--cluster-yes".into(),
        ]);
        let out = Command::new(&redis_cli)
            .args(&args)
            .output()
            .unwrap_or_else(|e| panic!("support: cannot run {redis_cli}: {e}"));
        assert!(
            out.status.success(),
            "support: redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes, primaries };
        cluster.wait_ok(&(0..cluster.nodes.len()).collect::<Vec<_>>());
        // Every replica has synced with its primary.
        let synced = wait_for_interval(READY, POLL, || {
            cluster.nodes.iter().all(|n| {
                let role = n.info_field("replication", "role").unwrap_or_default();
                role != "slave"
                    || n.info_field("replication", "master_link_status").as_deref() == Some("up")
            })
        });
        assert!(
            synced,
            "support: the replicas did not sync within {READY:?}"
        );
        cluster
    }

    /// The URL of the cluster, naming every primary.
    pub fn url(&self) -> String {
        self.url_of(&(0..self.primaries).collect::<Vec<_>>())
    }

    /// A URL naming only the nodes `which` (the backend learns the others from them).
    pub fn url_of(&self, which: &[usize]) -> String {
        let mut url = String::from("redis-cluster://");
        for (i, &n) in which.iter().enumerate() {
            if i == 0 {
                url.push_str(&format!("127.0.0.1:{}", self.nodes[n].port()));
            } else {
                url.push(if i == 1 { '?' } else { '&' });
                url.push_str(&format!("node=127.0.0.1:{}", self.nodes[n].port()));
            }
        }
        url
    }

    /// The primaries.
    pub fn primaries(&self) -> &[RedisServer] {
        &self.nodes[..self.primaries]
    }

    /// The index in [`nodes`](Self::nodes) of the node serving `key`'s slot now, as `nodes[from]`
    /// sees it.
    pub fn owner(&self, key: &str, from: usize) -> usize {
        let slot = self.nodes[from]
            .cmd(&["CLUSTER", "KEYSLOT", key])
            .as_int()
            .expect("CLUSTER KEYSLOT");
        let slots = self.nodes[from].cmd(&["CLUSTER", "SLOTS"]);
        for range in slots.as_array().expect("CLUSTER SLOTS") {
            let r = range.as_array().expect("a slot range");
            let (lo, hi) = (r[0].as_int().unwrap_or(-1), r[1].as_int().unwrap_or(-1));
            if (lo..=hi).contains(&slot) {
                let port = r[2].as_array().and_then(|n| n.get(1)?.as_int());
                return self
                    .nodes
                    .iter()
                    .position(|n| Some(i64::from(n.port())) == port)
                    .expect("the owner is one of ours");
            }
        }
        panic!("support: slot {slot} of {key} is served by no node");
    }

    /// Waits until the nodes `which` all report `cluster_state:ok`.
    pub fn wait_ok(&self, which: &[usize]) {
        let ok = wait_for_interval(READY, POLL, || {
            which
                .iter()
                .all(|&i| self.nodes[i].info_cluster().contains("cluster_state:ok"))
        });
        assert!(ok, "support: the cluster did not come up within {READY:?}");
    }

    /// Lock names, one per primary (`names[i]`'s slot is served by primary `i`), made from
    /// `stem` and the key prefix `prefix`.
    pub fn names_per_primary(&self, prefix: &str, stem: &str) -> Vec<String> {
        let mut names: Vec<Option<String>> = vec![None; self.primaries];
        for n in 0.. {
            let name = format!("{stem}-{n}");
            let owner = self.owner(&format!("{prefix}{{{name}}}"), 0);
            if owner < self.primaries && names[owner].is_none() {
                names[owner] = Some(name);
            }
            if names.iter().all(Option::is_some) {
                break;
            }
        }
        names.into_iter().map(Option::unwrap).collect()
    }
}

impl RedisServer {
    /// `CLUSTER INFO`, or "" when the node does not answer.
    pub fn info_cluster(&self) -> String {
        self.cmd_timeout(&["CLUSTER", "INFO"], Duration::from_secs(1))
            .ok()
            .and_then(|r| r.as_str())
            .unwrap_or_default()
    }
}

impl RedisCluster {
    /// Moves `key`'s slot, with its keys, from the primary serving it to `nodes[to]`, as
    /// `redis-cli --cluster reshard` does (`CLUSTER SETSLOT ... IMPORTING/MIGRATING`,
    /// `MIGRATE`, then `SETSLOT ... NODE` on the new owner, the old one and every other
    /// primary). Returns the index of the node it came from.
    pub fn move_slot(&self, key: &str, to: usize) -> usize {
        let from = self.owner(key, to);
        let id = |i: usize| {
            self.nodes[i]
                .cmd(&["CLUSTER", "MYID"])
                .as_str()
                .expect("CLUSTER MYID")
        };
        let (from_id, to_id) = (id(from), id(to));
        let slot = self.nodes[from]
            .cmd(&["CLUSTER", "KEYSLOT", key])
            .as_int()
            .expect("CLUSTER KEYSLOT")
            .to_string();
        let ok = |r: super::server::Resp| assert!(r.is_ok(), "support: moving slot {slot}: {r:?}");
        ok(self.nodes[to].cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]));
        ok(self.nodes[from].cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]));
        let keys = self.nodes[from].cmd(&["CLUSTER", "GETKEYSINSLOT", &slot, "1000"]);
        let keys: Vec<String> = keys
            .as_array()
            .expect("CLUSTER GETKEYSINSLOT")
            .iter()
            .filter_map(|k| k.as_str())
            .collect();
        if !keys.is_empty() {
            let port = self.nodes[to].port().to_string();
            let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            migrate.extend(keys.iter().map(String::as_str));
            ok(self.nodes[from].cmd(&migrate));
        }
        // The new owner first, then the old, then the others, as `redis-cli --cluster
        // reshard` does: told first, the old owner would redirect calls to a node that sends
        // them back while it still imports the slot.
        let others = (0..self.primaries).filter(|&i| i != to && i != from);
        for i in [to, from].into_iter().chain(others) {
            ok(self.nodes[i].cmd(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]));
        }
        from
    }
}
