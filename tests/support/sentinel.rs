//! A throw-away Redis Sentinel deployment: one primary, its replicas, and the sentinels that
//! monitor them as service [`SERVICE`], all [`RedisServer`]s on free loopback ports, killed
//! on drop.

use std::time::Duration;

use super::server::{RedisServer, Resp};
use super::wait_for_interval;

/// The service name the sentinels monitor.
pub const SERVICE: &str = "mymaster";
/// How long a node may go unanswered before a sentinel thinks it down (Sentinel's
/// `down-after-milliseconds`). Above a second on purpose: a sentinel pings every
/// min(down-after, 1 s), and right after it switches to a new primary it sends the first ping
/// only one such period later, so with 1 s or less it can find the new primary down before
/// the first answer and fail over again (seen here with 500 and 1000 ms: a second failover,
/// two nodes with `role:master` for a while, clients killed on the new primary).
pub const DOWN_AFTER: Duration = Duration::from_millis(1500);
/// Sentinels' `failover-timeout`: also how long a failover may take before it is retried
/// (by another sentinel), and twice it before the same sentinel tries the same primary again.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the deployment may take to come up (replicas synced, sentinels acquainted), and
/// a failover to complete.
const READY: Duration = Duration::from_secs(20);
/// How often the nodes are asked meanwhile.
const POLL: Duration = Duration::from_millis(20);
/// The harness's commands to a node that may be paused or dead.
const ASK: Duration = Duration::from_millis(500);

/// One primary with replicas, watched by sentinels (quorum 2, or 1 with a single sentinel).
pub struct RedisSentinels {
    /// The data nodes: the first primary first, then its replicas. Which one is the primary
    /// now: [`primary`](Self::primary).
    pub nodes: Vec<RedisServer>,
    /// The sentinels, in the order [`url`](Self::url) names them.
    pub sentinels: Vec<RedisServer>,
}

impl RedisSentinels {
    /// A primary, `replicas` replicas of it (see [`wait_synced`](Self::wait_synced))
    /// and `sentinels` sentinels, each of which knows every replica and every other sentinel.
    /// A node is thought down after [`DOWN_AFTER`]; quorum 2 (1 with a single sentinel); one
    /// replica at a time is moved to a new primary (`parallel-syncs 1`). With no sentinel it
    /// is a plain primary and its replicas.
    pub fn start(replicas: usize, sentinels: usize) -> RedisSentinels {
        RedisSentinels::start_with(replicas, sentinels, &[])
    }

    /// The same as [`start`](Self::start), each data node (the primary and every replica)
    /// started with the server arguments `extra` too, e.g. `["--appendonly", "yes"]`.
    pub fn start_with(replicas: usize, sentinels: usize, extra: &[&str]) -> RedisSentinels {
        // Replicas sync at once (a replica that never synced is not promoted).
        let mut data = vec!["--repl-diskless-sync-delay", "0"];
        data.extend_from_slice(extra);
        let primary = RedisServer::start_with(&data);
        let primary_port = primary.port().to_string();
        let mut nodes = vec![primary];
        for _ in 0..replicas {
            let mut args = data.clone();
            args.extend(["--replicaof", "127.0.0.1", &primary_port]);
            nodes.push(RedisServer::start_with(&args));
        }
        let quorum = sentinels.min(2);
        let conf = vec![
            format!("sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {quorum}"),
            format!(
                "sentinel down-after-milliseconds {SERVICE} {}",
                DOWN_AFTER.as_millis()
            ),
            format!(
                "sentinel failover-timeout {SERVICE} {}",
                FAILOVER_TIMEOUT.as_millis()
            ),
            format!("sentinel parallel-syncs {SERVICE} 1"),
        ];
        let sentinels = (0..sentinels)
            .map(|_| RedisServer::start_sentinel(&conf))
            .collect();
        let deployment = RedisSentinels { nodes, sentinels };
        deployment.wait_synced(0);
        let acquainted = wait_for_interval(READY, POLL, || {
            deployment.sentinels.iter().all(|s| {
                let known = |what: &str| {
                    s.cmd_timeout(&["SENTINEL", what, SERVICE], ASK)
                        .ok()
                        .and_then(|r| r.as_array().map(<[Resp]>::len))
                        .unwrap_or(0)
                };
                known("REPLICAS") == replicas
                    && known("SENTINELS") + 1 == deployment.sentinels.len()
            })
        });
        assert!(
            acquainted,
            "support: the sentinels did not learn every replica and each other within {READY:?}"
        );
        deployment
    }

    /// `redis-sentinel://` naming every sentinel (fred's form: the first as the host, the
    /// others as `node=`), for service [`SERVICE`].
    pub fn url(&self) -> String {
        let mut url = format!(
            "redis-sentinel://127.0.0.1:{}?sentinelServiceName={SERVICE}",
            self.sentinels[0].port()
        );
        for s in &self.sentinels[1..] {
            url.push_str(&format!("&node=127.0.0.1:{}", s.port()));
        }
        url
    }

    /// The index in [`nodes`](Self::nodes) of the node the first sentinel that answers names
    /// as the primary now (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub fn primary(&self) -> usize {
        self.named()
            .into_iter()
            .flatten()
            .next()
            .unwrap_or_else(|| panic!("support: no sentinel names a primary"))
    }

    /// What each sentinel names as the primary (`None`: it does not answer, or names a node
    /// that is not one of ours).
    fn named(&self) -> Vec<Option<usize>> {
        self.sentinels
            .iter()
            .map(|s| {
                if !s.is_running() {
                    return None;
                }
                let reply = s
                    .cmd_timeout(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE], ASK)
                    .ok()?;
                let port = reply.as_array()?.get(1)?.as_int()?;
                self.nodes.iter().position(|n| i64::from(n.port()) == port)
            })
            .collect()
    }

    /// What each running sentinel names as the primary (see [`named`](Self::named)).
    fn named_by_running(&self) -> Vec<Option<usize>> {
        self.sentinels
            .iter()
            .zip(self.named())
            .filter(|(s, _)| s.is_running())
            .map(|(_, n)| n)
            .collect()
    }

    /// Whether node `i` is running and says `role:master`.
    fn is_master(&self, i: usize) -> bool {
        self.role(i).as_deref() == Some("master")
    }

    /// Node `i`'s `role` (INFO replication), `None` if it is not running or does not answer.
    fn role(&self, i: usize) -> Option<String> {
        self.info(i, "role")
    }

    /// One field of node `i`'s INFO replication, `None` if it does not answer.
    fn info(&self, i: usize, field: &str) -> Option<String> {
        let node = &self.nodes[i];
        if !node.is_running() {
            return None;
        }
        let text = node
            .cmd_timeout(&["INFO", "replication"], ASK)
            .ok()?
            .as_str()?;
        let prefix = format!("{field}:");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_string()))
    }

    /// Forces a failover (`SENTINEL FAILOVER` on the first sentinel that accepts it: one
    /// that has no replica to promote yet, say one just resumed, is asked again; one already
    /// failing over counts) and waits until every running sentinel names a new primary that
    /// says `role:master`. Returns its index in [`nodes`](Self::nodes).
    pub fn failover(&self) -> usize {
        self.try_failover()
            .unwrap_or_else(|e| panic!("support: {e}"))
    }

    /// [`failover`](Self::failover), or why it did not happen within [`READY`]: no
    /// sentinel started it, or Sentinel gave it up.
    pub fn try_failover(&self) -> Result<usize, String> {
        let old = self.primary();
        let mut said = Vec::new();
        let started = wait_for_interval(READY, POLL, || {
            self.sentinels.iter().filter(|s| s.is_running()).any(|s| {
                match s.cmd_timeout(&["SENTINEL", "FAILOVER", SERVICE], ASK) {
                    Ok(r) if r.is_ok() => true,
                    Ok(Resp::Error(e)) if e.starts_with("INPROG") => true,
                    other => {
                        said.push(format!("{other:?}"));
                        false
                    }
                }
            })
        });
        said.dedup();
        if !started {
            return Err(format!(
                "no sentinel started a failover within {READY:?}; they said {said:?}"
            ));
        }
        self.try_wait_primary_changed(old)
    }

    /// Waits until every running sentinel names the same primary other than node `old`, and
    /// that node says `role:master`; its index in [`nodes`](Self::nodes).
    pub fn wait_primary_changed(&self, old: usize) -> usize {
        self.try_wait_primary_changed(old)
            .unwrap_or_else(|e| panic!("support: {e}"))
    }

    /// [`wait_primary_changed`](Self::wait_primary_changed), or what the sentinels name
    /// when they did not agree on a new primary within [`READY`] (a failover Sentinel
    /// gave up on: no replica it would promote).
    pub fn try_wait_primary_changed(&self, old: usize) -> Result<usize, String> {
        let mut new = None;
        let changed = wait_for_interval(READY, POLL, || {
            let named = self.named_by_running();
            new = named.first().copied().flatten();
            match new {
                Some(p) if p != old => named.iter().all(|&n| n == Some(p)) && self.is_master(p),
                _ => false,
            }
        });
        match new {
            Some(p) if changed => Ok(p),
            _ => Err(format!(
                "the sentinels did not agree on a new primary (other than node {old}) within \
                 {READY:?}; they name {:?}",
                self.named()
            )),
        }
    }

    /// Waits until the deployment is at rest after a fault: every running sentinel thinks
    /// nothing down and runs no failover (its `SENTINEL MASTER` flags say `master` alone),
    /// all of them name the same primary, that node says `role:master`, and every other
    /// running node says `role:slave`. A node back from a pause or a kill may say
    /// `role:master` for a while after a failover (Sentinel converts it some seconds later);
    /// this waits that out. Returns the primary's index in [`nodes`](Self::nodes).
    pub fn wait_settled(&self) -> usize {
        let mut primary = None;
        let at_rest = wait_for_interval(READY, POLL, || {
            let calm = self.sentinels.iter().filter(|s| s.is_running()).all(|s| {
                let Ok(reply) = s.cmd_timeout(&["SENTINEL", "MASTER", SERVICE], ASK) else {
                    return false;
                };
                let fields = reply.as_array().unwrap_or_default();
                fields.chunks(2).any(|kv| {
                    kv[0].as_str().as_deref() == Some("flags")
                        && kv.get(1).and_then(Resp::as_str).as_deref() == Some("master")
                })
            });
            let named = self.named_by_running();
            primary = named.first().copied().flatten();
            let Some(p) = primary else { return false };
            calm && named.iter().all(|&n| n == Some(p))
                && (0..self.nodes.len()).all(|i| {
                    !self.nodes[i].is_running()
                        || self.role(i).as_deref() == Some(if i == p { "master" } else { "slave" })
                })
        });
        assert!(
            at_rest,
            "support: the sentinel deployment did not come to rest within {READY:?}; the \
             sentinels name {:?}",
            self.named()
        );
        primary.expect("a primary")
    }

    /// Waits until every running node other than `primary` replicates it and acknowledges
    /// its writes: each says its link is up (`master_link_status:up`), and a write on the
    /// primary is acknowledged by all of them (`WAIT`). The link being up is not enough: after
    /// a full sync the primary streams to a replica only once it has its first acknowledgement
    /// after the transfer, up to a second later (`state=online` already shows meanwhile), and
    /// until then `WAIT` does not count it. The probe leaves no key behind.
    pub fn wait_synced(&self, primary: usize) {
        let port = self.nodes[primary].port().to_string();
        let replicas: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| i != primary && self.nodes[i].is_running())
            .collect();
        let want = replicas.len() as i64;
        let probe = || -> Option<i64> {
            let mut conn = self.nodes[primary].try_connect().ok()?;
            conn.cmd(&["SET", "support:sync-probe", "1"]).ok()?;
            conn.cmd(&["DEL", "support:sync-probe"]).ok()?;
            conn.cmd(&["WAIT", &want.to_string(), "100"]).ok()?.as_int()
        };
        let synced = wait_for_interval(READY, POLL, || {
            replicas.iter().all(|&i| {
                self.info(i, "master_port").as_deref() == Some(&port)
                    && self.info(i, "master_link_status").as_deref() == Some("up")
            }) && probe() == Some(want)
        });
        assert!(
            synced,
            "support: the replicas of node {primary} did not sync within {READY:?}"
        );
    }
}
