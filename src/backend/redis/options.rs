//! `RedisOptions`: how a Redis backend connects (timeouts, retries, the eviction policy it
//! accepts, replica acknowledgement, the restart quarantine, the client, TLS), read by
//! `connect.rs` and by each client below the seam.

use std::time::Duration;

use super::transport::Transport;
use crate::error::{Error, Result};

/// Connection settings for [`RedisBackend::connect_with`](crate::RedisBackend::connect_with).
///
/// ```
/// use std::time::Duration;
/// let opts = redlease::RedisOptions::new()
///     .command_timeout(Duration::from_millis(500))
///     .connect_timeout(Duration::from_secs(2));
/// assert_eq!(opts.command_timeout, Duration::from_millis(500));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RedisOptions {
    /// How long one command may take; see [`command_timeout`](Self::command_timeout()).
    /// Default 2 s.
    pub command_timeout: Duration,
    /// How long to wait for a connection. Default 5 s.
    pub connect_timeout: Duration,
    /// How many times a command is sent when the connection drops while it is in flight.
    /// Default 3.
    pub max_command_attempts: u32,
    /// Whether a server that may evict keys is accepted; see
    /// [`allow_eviction`](Self::allow_eviction()). Default `false`.
    pub allow_eviction: bool,
    /// How many replicas must have a grant or an extension before it is reported; see
    /// [`replica_ack`](Self::replica_ack()). Default [`ReplicaAck::Off`](super::ReplicaAck::Off).
    pub replica_ack: super::ReplicaAck,
    /// How long a server grants nothing after it starts; see
    /// [`restart_quarantine`](Self::restart_quarantine()). Default zero: off.
    pub restart_quarantine: Duration,
    /// Which client carries the commands; see [`transport`](Self::transport()). Default
    /// [`Transport::Fred`].
    pub transport: Transport,
    /// TLS settings for `rediss://` URLs; see [`tls`](Self::tls()). Default: the system's
    /// roots, no client certificate, the URL's host as the server name.
    #[cfg(feature = "tls")]
    pub tls: super::TlsOptions,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            command_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            max_command_attempts: 3,
            allow_eviction: false,
            replica_ack: super::ReplicaAck::Off,
            restart_quarantine: Duration::ZERO,
            transport: Transport::Fred,
            #[cfg(feature = "tls")]
            tls: super::TlsOptions::default(),
        }
    }
}

impl RedisOptions {
    /// The shortest command and connect timeouts accepted: below it every command would fail
    /// (a nanosecond was accepted once, and then nothing worked), even on loopback.
    pub const MIN_TIMEOUT: Duration = Duration::from_millis(10);

    /// The defaults: command timeout 2 s, connect timeout 5 s, 3 attempts per command.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long one command may take before it fails with [`Error::Backend`] (a paused
    /// server, a stalled network). A silent connection is also dropped and re-opened after
    /// twice this. Defaults to 2 s; from [`MIN_TIMEOUT`](Self::MIN_TIMEOUT) (10 ms) to an
    /// hour.
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// How long to wait for a connection (also the first one, in `connect`). Defaults to 5 s.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// How many times a command is sent when the connection drops while it is in flight.
    /// Every script is idempotent for the same token, so a re-sent command is harmless.
    /// Defaults to 3.
    pub fn max_command_attempts(mut self, n: u32) -> Self {
        self.max_command_attempts = n;
        self
    }

    /// Accept a server whose `maxmemory-policy` may evict keys (anything but `noeviction`:
    /// the `volatile-*` policies evict leases too, since every lease has a TTL). Defaults to
    /// `false`: such a server is refused at connect with [`Error::InvalidConfig`] naming the
    /// policy, and if a reconnect finds one, every acquire is refused the same way.
    ///
    /// Why: a full server evicting lease keys frees locks behind their holders' backs; another
    /// client takes them while the holder still holds a guard that is not lost (until its next
    /// extension is refused). With `true`, a warning is logged at every connect, and mutual
    /// exclusion holds only while the server is below `maxmemory`.
    pub fn allow_eviction(mut self, yes: bool) -> Self {
        self.allow_eviction = yes;
        self
    }

    /// Replica acknowledgement (see [`ReplicaAck`](super::ReplicaAck)): with
    /// [`ReplicaAck::replicas(n)`](super::ReplicaAck::replicas), an acquire is reported only
    /// once `n` replicas have its grant (`WAIT`), and extensions count once acknowledged; a
    /// grant that is not is given back and the acquire fails with
    /// [`Error::NotAcknowledged`](crate::Error::NotAcknowledged) (a waiting acquire waits
    /// on). Defaults to [`ReplicaAck::Off`](super::ReplicaAck::Off): see the README's
    /// "Failover" section for the window each policy leaves. On a cluster it holds for every
    /// primary, on its own replicas. A policy that asks for nothing, or whose timeout is not
    /// below the command timeout, is refused with [`Error::InvalidConfig`]; so is
    /// [`ReplicaAck::aof`](super::ReplicaAck::aof) at connect to a server older than 7.2.
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// use redlease::{LockManager, RedisBackend, RedisOptions, ReplicaAck};
    /// let options = RedisOptions::new().replica_ack(ReplicaAck::replicas(1));
    /// let backend = RedisBackend::connect_with("redis://127.0.0.1:6379", options).await?;
    /// let guard = LockManager::new(backend).lock("job").acquire().await?;
    /// assert!(guard.replicas_acked() >= Some(1));
    /// # Ok(()) }
    /// ```
    pub fn replica_ack(mut self, policy: super::ReplicaAck) -> Self {
        self.replica_ack = policy;
        self
    }

    /// A restart quarantine: the server grants nothing until it has been up this long (its
    /// own uptime, read in the same script as the grant), and no lease is granted or
    /// extended for longer (such an acquire or extension fails with
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig)). Set it to at least your
    /// longest TTL. Defaults to zero: off.
    ///
    /// What it closes: a server without persistence (or with `appendfsync everysec`, which
    /// may lose its last second) that restarts comes back without the leases it had granted,
    /// and another client could take a lock while the old holder's guard was still valid
    /// (the README's "A server that comes back empty"). With the quarantine, every lease
    /// granted before the restart has run out by the holder's own reckoning before the
    /// server grants again. What it costs: after every restart of the server (a deploy, a
    /// crash), and for that long after it first starts, acquires wait (`try_acquire`
    /// answers `None`). Holders of leases that survived on the server (with AOF) keep them:
    /// extensions are not held back. On a cluster it holds for each primary; a failover to a
    /// replica is what [`replica_ack`](Self::replica_ack()) covers. A Redlock's own
    /// quarantine ([`RedlockOptions`](crate::RedlockOptions)) applies to its nodes instead.
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// use std::time::Duration;
    /// use redlease::{LockManager, LockOptions, RedisBackend, RedisOptions};
    /// let options = RedisOptions::new().restart_quarantine(Duration::from_secs(30));
    /// let backend = RedisBackend::connect_with("redis://127.0.0.1:6379", options).await?;
    /// let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(30)))?;
    /// # Ok(()) }
    /// ```
    pub fn restart_quarantine(mut self, d: Duration) -> Self {
        self.restart_quarantine = d;
        self
    }

    /// Which client carries the backend's commands: [`Transport::Fred`] (the default), or
    /// with the `redis-rs` feature `Transport::RedisRs`. The locks behave the same on both
    /// (the scripts, group commit, the watchdog's rounds, routing on a cluster and replica
    /// acknowledgement are the backend's own, above the client); choose redis-rs when the
    /// application already runs it, so that one client crate serves both (see
    /// `RedisBackend::from_redis_client` for sharing its client). What a client cannot do
    /// is refused at connect with [`Error::Unsupported`](crate::Error::Unsupported) naming
    /// it.
    ///
    /// ```
    /// use redlease::{RedisOptions, Transport};
    /// let options = RedisOptions::new().transport(Transport::Fred);
    /// assert_eq!(options.transport, Transport::Fred);
    /// ```
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// TLS settings for a `rediss://` URL (feature `tls`): a private CA to trust instead of
    /// the system's roots, a client certificate for `tls-auth-clients yes`, the name to check
    /// the server's certificate against. See [`TlsOptions`](super::TlsOptions). A plain
    /// `redis://` URL with any of them set is refused with [`Error::InvalidConfig`]: the
    /// connection would not be encrypted.
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// use redlease::{RedisBackend, RedisOptions, TlsOptions};
    /// let tls = TlsOptions::new()
    ///     .ca_file("/etc/redis/tls/ca.crt")
    ///     .identity_files("/etc/redis/tls/client.crt", "/etc/redis/tls/client.key");
    /// let backend =
    ///     RedisBackend::connect_with("rediss://redis.internal:6380", RedisOptions::new().tls(tls))
    ///         .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub fn tls(mut self, tls: super::TlsOptions) -> Self {
        self.tls = tls;
        self
    }

    pub(super) fn validate(&self) -> Result<()> {
        let hour = Duration::from_secs(3600);
        for (name, t) in [
            ("command", self.command_timeout),
            ("connect", self.connect_timeout),
        ] {
            if t < Self::MIN_TIMEOUT || t > hour {
                return Err(Error::invalid(format!(
                    "Redis {name} timeout must be at least {:?} and at most an hour, got {t:?}",
                    Self::MIN_TIMEOUT
                )));
            }
        }
        if self.max_command_attempts == 0 {
            return Err(Error::invalid("max_command_attempts must be at least 1"));
        }
        super::check_quarantine(self.restart_quarantine)?;
        self.replica_ack.validate(self.command_timeout)
    }
}
