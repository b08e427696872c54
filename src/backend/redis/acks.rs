//! Replica acknowledgement: a grant or an extension is reported only once enough replicas
//! (or the AOF) have it, so that a failover to one of them keeps it.
//!
//! `WAIT` (and `WAITAOF`) count the writes made on the connection that sends them, so the
//! acknowledgement goes on the backend's one command connection, after the write's reply.
//! Callers that arrive while one acknowledgement is out share the next: one `WAIT` covers
//! every grant and extension answered before it was sent (a group commit of its own). fred
//! holds later commands back behind a command it knows as blocking; `WAIT` is sent as one it
//! does not, so they go out behind it (Redis still runs them after it: at most the policy's
//! timeout, when a replica does not answer).
//!
//! A `WAIT` re-sent on a new connection would count no write and answer at once, so it is
//! sent once (never re-sent after a reconnect), and an acknowledgement counts only if the
//! connection stayed the same from before the write to after the `WAIT` (its `CLIENT ID`, and
//! no reconnect seen in between).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::transport::{Connection, Value};
use super::RedisBackend;
use crate::backend::{Acquire, Claim, Extended, Grant, Release};
use crate::error::{Error, Result};

/// How many copies a grant or an extension needs before it is reported: the replica
/// acknowledgement policy of a [`RedisBackend`](crate::RedisBackend) (see
/// [`RedisOptions::replica_ack`](crate::RedisOptions::replica_ack)).
///
/// Redis replicates asynchronously: a grant the primary answered may not have reached any
/// replica when the primary dies, and the replica promoted in its place then has the lock
/// free. With [`Off`](Self::Off) (the default) that window is the replication lag at the
/// moment of the failover. With [`replicas`](Self::replicas), an acquire is reported only
/// once `count` replicas have its write (`WAIT`); a grant that is not acknowledged within the
/// timeout is given back and the acquire fails with [`Error::NotAcknowledged`] (a waiting
/// acquire waits on). Extensions are acknowledged too, a whole watchdog round in one `WAIT`;
/// one that is not acknowledged counts as failed (retried, and the lease is lost at its
/// deadline if none is). Sentinel and Cluster promote the replica with the most data, so a
/// grant acknowledged by one replica survives the failover of its primary unless that
/// replica fails too (Redis: "WAIT does not make Redis a strongly consistent store").
///
/// ```
/// use std::time::Duration;
/// use redlease::{RedisOptions, ReplicaAck};
/// let opts = RedisOptions::new()
///     .replica_ack(ReplicaAck::replicas(1).timeout(Duration::from_millis(200)));
/// assert_eq!(opts.replica_ack, ReplicaAck::Replicas { count: 1, timeout: Duration::from_millis(200) });
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicaAck {
    /// Reported as soon as the primary answers (the default).
    #[default]
    Off,
    /// Reported once `count` replicas have the write (`WAIT count timeout`).
    Replicas {
        /// Replicas that must have the write: at least 1.
        count: u32,
        /// How long to wait for them.
        timeout: Duration,
    },
    /// Reported once the write is in the AOF on disk: the primary's own if `local`, and
    /// `replicas` replicas' (`WAITAOF`, Redis 7.2 and later; refused at connect on an older
    /// server).
    Aof {
        /// The primary's own AOF (needs `appendonly yes` there).
        local: bool,
        /// Replicas whose AOF must have the write.
        replicas: u32,
        /// How long to wait.
        timeout: Duration,
    },
}

impl ReplicaAck {
    /// The timeout of [`replicas`](Self::replicas) and [`aof`](Self::aof) unless set: long
    /// enough for a replica on a loaded LAN, short enough that an acquire with a replica
    /// down fails fast (and that the commands queued behind the `WAIT` are not held long).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

    /// At least `count` replicas, within [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT).
    pub const fn replicas(count: u32) -> Self {
        ReplicaAck::Replicas {
            count,
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// In the primary's AOF (`local`) and in `replicas` replicas' AOF, within
    /// [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT). Redis 7.2 and later.
    pub const fn aof(local: bool, replicas: u32) -> Self {
        ReplicaAck::Aof {
            local,
            replicas,
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// The same policy with another timeout (no effect on [`Off`](Self::Off)).
    pub const fn timeout(self, d: Duration) -> Self {
        match self {
            ReplicaAck::Off => ReplicaAck::Off,
            ReplicaAck::Replicas { count, .. } => ReplicaAck::Replicas { count, timeout: d },
            ReplicaAck::Aof {
                local, replicas, ..
            } => ReplicaAck::Aof {
                local,
                replicas,
                timeout: d,
            },
        }
    }

    /// The replicas a write needs (0 for `Off`).
    fn required(self) -> u32 {
        match self {
            ReplicaAck::Off => 0,
            ReplicaAck::Replicas { count, .. } => count,
            ReplicaAck::Aof { replicas, .. } => replicas,
        }
    }

    /// Refuses a policy that asks for nothing or waits past a command's own timeout.
    pub(super) fn validate(self, command_timeout: Duration) -> Result<()> {
        let timeout = match self {
            ReplicaAck::Off => return Ok(()),
            ReplicaAck::Replicas { count: 0, .. } => {
                return Err(Error::invalid(
                    "ReplicaAck::replicas(0) waits for nothing: use ReplicaAck::Off",
                ))
            }
            ReplicaAck::Aof {
                local: false,
                replicas: 0,
                ..
            } => {
                return Err(Error::invalid(
                    "ReplicaAck::aof(false, 0) waits for nothing: use ReplicaAck::Off",
                ))
            }
            ReplicaAck::Replicas { timeout, .. } | ReplicaAck::Aof { timeout, .. } => timeout,
        };
        if timeout < Duration::from_millis(1) || timeout >= command_timeout {
            return Err(Error::invalid(format!(
                "the replica acknowledgement timeout must be from 1 ms to less than the command \
                 timeout ({command_timeout:?}); got {timeout:?}"
            )));
        }
        Ok(())
    }

    /// Refuses `WAITAOF` on a server older than 7.2, from its `INFO server`.
    pub(super) fn check_server(self, info: &str) -> Result<()> {
        if !matches!(self, ReplicaAck::Aof { .. }) {
            return Ok(());
        }
        let Some(version) = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .map(str::trim)
        else {
            return Ok(());
        };
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if (major, minor) < (7, 2) {
            return Err(Error::invalid(format!(
                "ReplicaAck::aof needs WAITAOF, Redis 7.2 or later; the server runs Redis \
                 {version} (use ReplicaAck::replicas there)"
            )));
        }
        Ok(())
    }
}

/// A backend's acknowledgements: the policy, and the `WAIT`s shared by concurrent callers.
pub(super) struct Acks {
    policy: ReplicaAck,
    /// `WAIT`s sent so far.
    sent: AtomicU64,
    /// The last `WAIT` answered: its number (in `sent`) and what it counted. One `WAIT` at a
    /// time: callers queue here, and take the answer of one sent after they came.
    last: futures::lock::Mutex<(u64, std::result::Result<Counted, String>)>,
    /// Reconnects of the command connection seen so far.
    reconnects: Arc<AtomicU64>,
}

/// The command connection before a write: an acknowledgement counts only if it is the same
/// one after the `WAIT`. Told by its `CLIENT ID` (which fred reads as it connects); by the
/// count of reconnects where that is unknown (an ACL that refuses `CLIENT ID`).
#[derive(Clone, Debug)]
pub(super) struct Mark {
    reconnects: u64,
    /// The server's address and the connection's id there (ids count per server: a
    /// promoted replica may give a new connection the old one's id).
    id: Option<(String, i64)>,
}

impl Mark {
    fn same(&self, now: &Mark) -> bool {
        match (&self.id, &now.id) {
            (Some(before), Some(after)) => before == after,
            _ => self.reconnects == now.reconnects,
        }
    }
}

impl Acks {
    /// The acknowledgements of `policy` (`None` for `Off`) on `client`, which bumps
    /// `reconnects` at each reconnect.
    pub(super) fn new(policy: ReplicaAck, reconnects: Arc<AtomicU64>) -> Option<Self> {
        (policy != ReplicaAck::Off).then(|| Acks {
            policy,
            sent: AtomicU64::new(0),
            last: futures::lock::Mutex::new((0, Ok(Counted::default()))),
            reconnects,
        })
    }

    /// Taken before a write that is to be acknowledged.
    pub(super) fn mark(&self, connection: &dyn Connection) -> Mark {
        Mark {
            reconnects: self.reconnects.load(Ordering::Acquire),
            id: connection.identity(),
        }
    }

    /// After the reply of a write made after `mark`: how many replicas have it, or
    /// [`Error::NotAcknowledged`] if fewer than the policy needs (or the connection changed,
    /// so that a `WAIT` could not count the write).
    pub(super) async fn confirm(&self, connection: &dyn Connection, mark: Mark) -> Result<u32> {
        let came = self.sent.load(Ordering::Acquire);
        let counted = {
            let mut last = self.last.lock().await;
            if last.0 <= came {
                // No WAIT sent since this caller came: send one.
                let number = self.sent.fetch_add(1, Ordering::AcqRel) + 1;
                *last = (number, self.wait(connection).await);
            }
            last.1.clone()
        };
        let required = self.policy.required();
        let Counted {
            replicas: acked,
            local_missing,
        } = match counted {
            Ok(counted) => counted,
            Err(refused) if refused.starts_with("refused:") => {
                return Err(Error::invalid(
                    refused["refused:".len()..].trim().to_owned(),
                ))
            }
            // A dropped connection or a timeout: it may pass (a waiting acquire waits on).
            Err(failed) => return Err(Error::backend(crate::backend::Unavailable(failed))),
        };
        if !mark.same(&self.mark(connection)) {
            return Err(Error::NotAcknowledged {
                acked: 0,
                required,
                why: "the connection was remade between the write and its WAIT".to_owned(),
            });
        }
        if local_missing {
            return Err(Error::NotAcknowledged {
                acked,
                required,
                why: format!(
                    "the primary's own AOF did not have the write within {:?} ({acked} of \
                     {required} replicas' did)",
                    self.timeout()
                ),
            });
        }
        if acked < required {
            return Err(Error::NotAcknowledged {
                acked,
                required,
                why: format!("{acked} of {required} replicas within {:?}", self.timeout()),
            });
        }
        Ok(acked)
    }

    fn timeout(&self) -> Duration {
        match self.policy {
            ReplicaAck::Off => Duration::ZERO,
            ReplicaAck::Replicas { timeout, .. } | ReplicaAck::Aof { timeout, .. } => timeout,
        }
    }

    /// One `WAIT` (or `WAITAOF`), sent once: what it counted. `Err("refused: ...")` when the
    /// server does not know or allow the command.
    async fn wait(&self, connection: &dyn Connection) -> std::result::Result<Counted, String> {
        let timeout = self.timeout();
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let (command, args): (&'static str, Vec<Value>) = match self.policy {
            ReplicaAck::Off => return Ok(Counted::default()),
            ReplicaAck::Replicas { count, .. } => {
                ("WAIT", vec![i64::from(count).into(), ms.to_string().into()])
            }
            ReplicaAck::Aof {
                local, replicas, ..
            } => (
                "WAITAOF",
                vec![
                    i64::from(local).into(),
                    i64::from(replicas).into(),
                    ms.to_string().into(),
                ],
            ),
        };
        // Sent once, failing at once when the connection is down (a new connection's WAIT
        // would count nothing).
        let limit = timeout + connection.command_timeout();
        let reply = connection.command_once(command, args, limit).await;
        match reply {
            Ok(reply) => Counted::read(self.policy, reply)
                .map_err(|other| format!("{command} returned {other:?}")),
            Err(e) => {
                let said = e.said.clone();
                let upper = said.to_ascii_uppercase();
                if upper.contains("UNKNOWN COMMAND") || upper.starts_with("NOPERM") {
                    Err(format!(
                        "refused: the server refuses {command} ({said}): replica \
                         acknowledgement cannot be had here; use ReplicaAck::Off"
                    ))
                } else if upper.contains("APPENDONLY") || upper.contains("AOF") {
                    Err(format!(
                        "refused: {command} cannot be served ({said}): the local AOF needs \
                         appendonly yes"
                    ))
                } else {
                    Err(format!("{command} failed: {e}"))
                }
            }
        }
    }
}

/// What one `WAIT` or `WAITAOF` counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counted {
    /// Replicas that have the write (in their AOF, for `WAITAOF`).
    replicas: u32,
    /// The policy asks for the primary's own AOF (`ReplicaAck::aof(true, ..)`), and `WAITAOF`
    /// did not count it: the write is not acknowledged, whatever the replicas say (a policy
    /// of `aof(true, 0)` needs no replica, so "0 replicas" alone would pass it).
    local_missing: bool,
}

impl Counted {
    /// The reply of `WAIT` (an integer: the replicas) or `WAITAOF` (an array: `[local,
    /// replicas]`, local 1 when the primary's own AOF has the write) under `policy`; the
    /// reply back if it is neither.
    fn read(policy: ReplicaAck, reply: Value) -> std::result::Result<Counted, Value> {
        let count = |v: Option<&Value>| {
            v.and_then(Value::as_i64)
                .map(|n| u32::try_from(n).unwrap_or(0))
        };
        match reply {
            Value::Int(n) => Ok(Counted {
                replicas: u32::try_from(n).unwrap_or(0),
                local_missing: false,
            }),
            Value::Array(ref counts) if counts.len() == 2 => {
                match (count(counts.first()), count(counts.get(1))) {
                    (Some(local), Some(replicas)) => Ok(Counted {
                        replicas,
                        local_missing: matches!(policy, ReplicaAck::Aof { local: true, .. })
                            && local < 1,
                    }),
                    _ => Err(reply),
                }
            }
            other => Err(other),
        }
    }
}

impl RedisBackend {
    /// The connection before a write to acknowledge (`None`: acknowledgement is off). Taken
    /// once connected (a lazily made node's first call waits here, as it would for its write):
    /// the write goes on that connection.
    pub(super) async fn ack_mark(&self) -> Option<Mark> {
        let acks = self.inner.acks.as_ref()?;
        let connection = &*self.inner.connection;
        if !connection.is_connected() {
            let connect = self.ready();
            let deadline = std::time::Instant::now() + connection.command_timeout();
            let _ = crate::runtime::until(Some(deadline), connect).await;
        }
        Some(acks.mark(connection))
    }

    /// `grant` (of `claim`, written after `mark`) once acknowledged, with the replicas that
    /// have it; given back if it is not, and the acquire fails with the reason.
    pub(super) async fn grant_acknowledged(
        &self,
        claim: &Claim,
        grant: Grant,
        mark: Option<Mark>,
    ) -> Result<Acquire> {
        let (Some(acks), Some(mark)) = (&self.inner.acks, mark) else {
            return Ok(Acquire::Granted(grant));
        };
        match acks.confirm(&*self.inner.connection, mark).await {
            Ok(n) => Ok(Acquire::Granted(grant.with_replicas(n))),
            Err(e) => {
                // Nobody is told it is held, and a failover could lose it: given back (no
                // tombstone, so that a waiting acquire's next attempt can take it again).
                // If that fails too, the lease runs out at its TTL.
                let lease = Release::Confirmed {
                    lease: &grant.lease,
                };
                if let Err(release) = crate::backend::Backend::release(self, claim, lease).await {
                    tracing::warn!(key = %claim.key, error = %release, "giving back an unacknowledged grant failed; it runs out at its TTL");
                }
                Err(e)
            }
        }
    }

    /// The round's `extended` leases (written after `mark`) once acknowledged: if they are
    /// not, each extension counts as failed (the watchdog tries again, and the lease is lost
    /// at its deadline if none is acknowledged).
    pub(super) async fn extensions_acknowledged(
        &self,
        mut extended: Vec<Extended>,
        mark: Option<Mark>,
    ) -> Vec<Extended> {
        let (Some(acks), Some(mark)) = (&self.inner.acks, mark) else {
            return extended;
        };
        if !extended.iter().any(|e| matches!(e, Extended::Held(_))) {
            return extended;
        }
        if let Err(e) = acks.confirm(&*self.inner.connection, mark).await {
            for lease in &mut extended {
                if matches!(lease, Extended::Held(_)) {
                    *lease = Extended::Failed(again(&e));
                }
            }
        }
        extended
    }
}

/// The same error again, for each lease it fails.
fn again(e: &Error) -> Error {
    crate::backend::for_each_caller(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waitaof(local: i64, replicas: i64) -> Value {
        Value::Array(vec![Value::Int(local), Value::Int(replicas)])
    }

    #[test]
    fn a_wait_reply_counts_replicas_and_a_waitaof_reply_the_local_aof_too() {
        let counted = |replicas, local_missing| {
            Ok(Counted {
                replicas,
                local_missing,
            })
        };
        assert_eq!(
            Counted::read(ReplicaAck::replicas(2), Value::Int(2)),
            counted(2, false)
        );
        assert_eq!(
            Counted::read(ReplicaAck::aof(true, 2), waitaof(1, 2)),
            counted(2, false)
        );
        // The replicas have it, the primary's own AOF does not: not acknowledged, and the
        // replicas still counted (they are what the error reports).
        assert_eq!(
            Counted::read(ReplicaAck::aof(true, 2), waitaof(0, 2)),
            counted(2, true)
        );
        // `aof(true, 0)` needs no replica: without the local AOF it was taken for a success.
        assert_eq!(
            Counted::read(ReplicaAck::aof(true, 0), waitaof(0, 0)),
            counted(0, true)
        );
        // Not asked for the local AOF: its count does not matter.
        assert_eq!(
            Counted::read(ReplicaAck::aof(false, 1), waitaof(0, 1)),
            counted(1, false)
        );
        let odd = Value::Array(vec![Value::Int(1)]);
        assert_eq!(
            Counted::read(ReplicaAck::aof(true, 0), odd.clone()),
            Err(odd)
        );
        assert!(Counted::read(ReplicaAck::replicas(1), Value::Nil).is_err());
    }
}
