//! `PostgresBackend`: leases in PostgreSQL tables, behind the `postgres` feature.
//!
//! One row per lock name (`<prefix>lock`: token, expiry on the server's clock, the send number
//! of the operation that last touched it, the fencing counter, the holder's label, the token
//! released last, until when waiters, writers and sharers wait, a reentrant reign's owner),
//! beside rows for abandoned attempts (`barred`), fair waiters (`queue`), a reign's holds
//! (`hold`), reads and permits (`shared`), waiting writers (`writer`) and the cache's values
//! (`value`, `failed`). Every operation is one call of a PL/pgSQL function (`schema.sql`): one
//! round trip, one short transaction that locks the name's row first. Releases notify a
//! channel (`LISTEN`/`NOTIFY`, delivered at commit) while waiters are registered; each backend
//! keeps one connection of its own listening on it (`listen.rs`), and commands go over a
//! second connection that it re-opens when it breaks (`conn.rs`), or over an application's
//! pool.
//!
//! Fences are `max(last + 1, server clock in µs)`, so a database restored from an old backup
//! or created again still mints larger ones (as the Redis backend's).

mod cache;
mod conn;
mod listen;
mod schema;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use event_listener::{Event, IntoNotification};
use futures::future::BoxFuture;

use crate::backend::{
    Acquire, Attempt, Backend, Capabilities, Claim, ClaimKind, Extended, Grant, Lease, NodeTerms,
    Refused, Release, Subscription, Unavailable,
};
use crate::error::{Error, Result};
use crate::info::LockInfo;
use crate::token::{LeaseKey, Token};

use conn::Commands;
use schema::{Names, Stmt};

/// Connection settings for [`PostgresBackend::connect_with`]: where the tables live and how
/// long a command or a connection may take.
///
/// ```
/// use std::time::Duration;
/// let opts = redlease::PostgresOptions::new()
///     .schema("locks")
///     .table_prefix("app_")
///     .command_timeout(Duration::from_millis(500));
/// assert_eq!(opts.schema, "locks");
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PostgresOptions {
    /// The schema the tables and functions are made in (created if missing). Default
    /// `public`.
    pub schema: String,
    /// The prefix of every table and function name. Default `redlease_`.
    pub table_prefix: String,
    /// How long one command may take before it fails with [`Error::Backend`]; the connection
    /// is then closed and opened again (a statement that was still running is cancelled).
    /// Default 2 s.
    pub command_timeout: Duration,
    /// How long to wait for a connection. Default 5 s.
    pub connect_timeout: Duration,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            schema: "public".into(),
            table_prefix: "redlease_".into(),
            command_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl PostgresOptions {
    /// The shortest command and connect timeouts accepted.
    pub const MIN_TIMEOUT: Duration = Duration::from_millis(10);

    /// The defaults: schema `public`, prefix `redlease_`, command timeout 2 s, connect
    /// timeout 5 s.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`schema`](Self::schema): lower-case letters, digits and `_`, not starting with
    /// a digit, at most 24 characters.
    ///
    /// ```
    /// let opts = redlease::PostgresOptions::new().schema("locks");
    /// assert_eq!(opts.schema, "locks");
    /// ```
    pub fn schema(mut self, name: impl Into<String>) -> Self {
        self.schema = name.into();
        self
    }

    /// Sets [`table_prefix`](Self::table_prefix): lower-case letters, digits and `_`, not
    /// starting with a digit, at most 24 characters.
    ///
    /// ```
    /// let opts = redlease::PostgresOptions::new().table_prefix("jobs_");
    /// assert_eq!(opts.table_prefix, "jobs_");
    /// ```
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.table_prefix = prefix.into();
        self
    }

    /// Sets [`command_timeout`](Self::command_timeout), from
    /// [`MIN_TIMEOUT`](Self::MIN_TIMEOUT) to an hour.
    ///
    /// ```
    /// use std::time::Duration;
    /// let opts = redlease::PostgresOptions::new().command_timeout(Duration::from_secs(1));
    /// assert_eq!(opts.command_timeout, Duration::from_secs(1));
    /// ```
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout), from
    /// [`MIN_TIMEOUT`](Self::MIN_TIMEOUT) to an hour.
    ///
    /// ```
    /// use std::time::Duration;
    /// let opts = redlease::PostgresOptions::new().connect_timeout(Duration::from_secs(1));
    /// assert_eq!(opts.connect_timeout, Duration::from_secs(1));
    /// ```
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    fn check(&self) -> Result<()> {
        for (what, name) in [
            ("schema", &self.schema),
            ("table prefix", &self.table_prefix),
        ] {
            let ok = !name.is_empty()
                && name.len() <= 24
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                && !name.as_bytes()[0].is_ascii_digit();
            if !ok {
                return Err(Error::invalid(format!(
                    "the {what} must be 1 to 24 lower-case letters, digits or `_`, not starting \
                     with a digit, got {name:?}"
                )));
            }
        }
        let hour = Duration::from_secs(3600);
        for (what, d) in [
            ("command timeout", self.command_timeout),
            ("connect timeout", self.connect_timeout),
        ] {
            if d < Self::MIN_TIMEOUT || d > hour {
                return Err(Error::invalid(format!(
                    "the {what} must be between {:?} and an hour, got {d:?}",
                    Self::MIN_TIMEOUT
                )));
            }
        }
        Ok(())
    }
}

/// Leases in a PostgreSQL database (tested on 15; needs 10 or later), behind the
/// `postgres` feature.
///
/// The tables and functions are created on first use (in [`PostgresOptions::schema`], named
/// after [`PostgresOptions::table_prefix`], under an advisory lock, with a schema version);
/// the connecting role needs the right to create them there, or an administrator makes the
/// first connection. Expiry uses the server's clock only.
///
/// Serves every kind of claim (fair, reentrant, reads and permits; see
/// [`capabilities`](Backend::capabilities)); it is one logical store, so it is not a
/// [`Redlock`](crate::Redlock) node.
///
/// # What it guarantees
///
/// - A lease is a committed row: it survives a server restart or crash (a lease whose TTL
///   ran out meanwhile is free when the server is back; a holder that kept it is told
///   nothing, one that lost it is told `lost()`). It is as durable as the server's commits:
///   with `fsync = off` or `synchronous_commit = off` a machine crash can forget a grant and
///   hand it out again. Behind a replica failover, only a synchronous replica has every grant.
/// - Fencing tokens are `max(last + 1, server clock in µs)` per name: strictly increasing,
///   also after the tables were dropped or the database restored from a backup (as long as
///   the server's clock does not go back).
/// - A call whose connection broke may still commit later on the server (it keeps running
///   until it next writes to the socket). A give-up after such a call (an abandon) bars its
///   token, so a late grant is either refused or ended by the abandon; each acquire and
///   release carries a send number, so a late copy never undoes a later operation.
/// - Wake-ups use `LISTEN`/`NOTIFY` on a connection of the backend's own. While that
///   connection is down notifications are lost: when it is back every local waiter looks
///   again and [`disturbed`](Backend::disturbed) resolves (the watchdog re-checks every
///   lease).
///
/// # What it costs
///
/// One round trip per acquire attempt, release, inspect and fence raise (one function call,
/// one short transaction on the name's row); one per watchdog round for any number of
/// leases; none to subscribe. Two connections per backend (commands and the listener), or
/// the application's pool for commands and one listener connection. A release sends a
/// `NOTIFY` only while waiters are registered (a commit that notifies takes a lock shared
/// by every notifying transaction of the database). Every acquire and release is a commit:
/// with `fsync` on, its cost is the server's WAL flush. Each name keeps a row (its fence)
/// for good.
///
/// ```no_run
/// use redlease::{LockManager, PostgresBackend};
/// # async fn run() -> redlease::Result<()> {
/// let store = PostgresBackend::connect("postgres://app@db.internal/app").await?;
/// let locks = LockManager::new(store);
/// let guard = locks.lock("nightly-report").acquire().await?;
/// // ... work, fenced by guard.fencing_token() ...
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    opts: PostgresOptions,
    commands: Commands,
    hub: Arc<Hub>,
    /// Where the listener connects (shown, without a password, by `Debug`).
    target: String,
    /// Dropped with the backend: stops the listener.
    _stop: futures::channel::oneshot::Sender<()>,
}

/// What the listener and the command connection share with the backend: local waiters by key,
/// the disturbance event, and whether the listener is subscribed.
pub(super) struct Hub {
    /// Waiters by key (the key's [`payload`] form).
    events: Mutex<HashMap<String, Weak<Event>>>,
    /// Fair waiters by token: woken by a hand-off to them.
    targets: Mutex<HashMap<String, Weak<Event>>>,
    disturbed: Event,
    ready: tokio::sync::watch::Sender<bool>,
}

impl Hub {
    fn new() -> Self {
        Hub {
            events: Mutex::new(HashMap::new()),
            targets: Mutex::new(HashMap::new()),
            disturbed: Event::new(),
            ready: tokio::sync::watch::channel(false).0,
        }
    }

    fn events(&self) -> std::sync::MutexGuard<'_, HashMap<String, Weak<Event>>> {
        // Every update is one insert or remove: a poisoned map is still consistent.
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn targets(&self) -> std::sync::MutexGuard<'_, HashMap<String, Weak<Event>>> {
        self.targets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One notification's payload (see `Q_notify` in schema.sql): `1:<key>` wakes one local
    /// waiter of the key (as on Redis: one release, one waiter), `a:<key>` every one (shared
    /// claims wait), `t:<token>` the fair waiter handed the lock, `v:<key>` every waiter for
    /// the key's cached value, `*` every waiter.
    fn wake(&self, payload: &str) {
        let (event, n) = match payload.split_once(':') {
            Some(("1", key)) => (self.events().get(key).and_then(Weak::upgrade), 1),
            Some(("a", key)) => (self.events().get(key).and_then(Weak::upgrade), usize::MAX),
            // The cache's fills (its subscriptions are keyed `v<key>`).
            Some(("v", key)) => (
                self.events()
                    .get(&format!("v{key}"))
                    .and_then(Weak::upgrade),
                usize::MAX,
            ),
            Some(("t", token)) => (
                self.targets().get(token).and_then(Weak::upgrade),
                usize::MAX,
            ),
            _ => {
                self.wake_waiters();
                return;
            }
        };
        if let Some(event) = event {
            if n == 1 {
                event.notify(1.additional());
            } else {
                event.notify(usize::MAX);
            }
        }
    }

    /// Every local waiter looks again.
    fn wake_waiters(&self) {
        let mut events: Vec<Arc<Event>> = Vec::new();
        for map in [&self.events, &self.targets] {
            let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, e| e.strong_count() > 0);
            events.extend(map.values().filter_map(Weak::upgrade));
        }
        for e in events {
            e.notify(usize::MAX);
        }
    }

    /// Notifications may have been lost (the listener's connection broke): every local
    /// waiter looks again, and the watchdog checks every lease.
    fn wake_all(&self) {
        self.wake_waiters();
        self.disturbed.notify(usize::MAX);
    }

    fn event(&self, map: &Mutex<HashMap<String, Weak<Event>>>, key: &str) -> Arc<Event> {
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = map.get(key).and_then(Weak::upgrade) {
            return e;
        }
        if map.len() > 64 {
            map.retain(|_, e| e.strong_count() > 0);
        }
        let e = Arc::new(Event::new());
        map.insert(key.to_owned(), Arc::downgrade(&e));
        e
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("target", &self.inner.target)
            .field("schema", &self.inner.opts.schema)
            .field("table_prefix", &self.inner.opts.table_prefix)
            .field("pool", &self.inner.commands.is_pool())
            .finish()
    }
}

/// The last send number taken in this process (see "Send order" in [`Backend`]): a token is
/// used by one process only, so the numbers compared for one token all come from here.
static SENT: AtomicU64 = AtomicU64::new(0);

fn next_sent() -> i64 {
    i64::try_from(SENT.fetch_add(1, Ordering::Relaxed) + 1).unwrap_or(i64::MAX)
}

/// A key as a release's notification names it: its bytes in hex (`encode(k, 'hex')`).
fn payload(key: &LeaseKey) -> String {
    use std::fmt::Write;
    let bytes = key.as_str().as_bytes();
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// Milliseconds, saturating.
fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A claim's kind as the SQL functions take it: `kind`, `owner_`, `permits`.
fn kind_args(kind: &ClaimKind) -> Result<(&'static str, Option<&str>, i32)> {
    Ok(match kind {
        ClaimKind::Plain => ("p", None, 0),
        ClaimKind::Fair => ("f", None, 0),
        ClaimKind::Reentrant(owner) => ("r", Some(owner.as_str()), 0),
        ClaimKind::Read => ("s", None, 0),
        ClaimKind::Permit(0) => {
            return Err(Error::invalid("a semaphore needs at least one permit"))
        }
        ClaimKind::Permit(n) => ("s", None, i32::try_from(*n).unwrap_or(i32::MAX)),
    })
}

/// Refuses a configuration that demands TLS: the backend's connections are plain (`sslmode`
/// `disable` or `prefer`, which falls back to plain), and a demand it cannot meet is named
/// here rather than failing at connect as an unreachable server.
fn check_tls(config: &tokio_postgres::Config) -> Result<()> {
    use tokio_postgres::config::SslMode;
    if matches!(config.get_ssl_mode(), SslMode::Disable | SslMode::Prefer) {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "PostgresBackend connects without TLS, so sslmode={:?} cannot be served: use \
         sslmode=disable or prefer (behind a TLS-terminating proxy if the network needs it)",
        format!("{:?}", config.get_ssl_mode()).to_lowercase()
    )))
}

/// What a lease of `ttl` is promised for, counted from the call's start: the TTL less the
/// drift margin between the server's clock, which ends it, and the holder's.
fn validity(ttl: Duration) -> Duration {
    ttl.saturating_sub(crate::backend::clock_drift(ttl))
}

/// A client error as the crate's: a server that refused the statement (a missing privilege,
/// a broken schema) is [`Refused`]; a lost connection, a server shutting down or starting,
/// too many connections, a serialization failure or deadlock is [`Unavailable`].
pub(super) fn pg_error(e: tokio_postgres::Error) -> Error {
    let transient = match e.code() {
        None => true,
        Some(code) => {
            let class = &code.code()[..2];
            matches!(class, "08" | "40" | "53" | "57" | "58")
        }
    };
    let text = match e.as_db_error() {
        Some(db) => format!("postgres: {} ({})", db.message(), db.code().code()),
        None => format!("postgres: {e}"),
    };
    if transient {
        Error::backend(Unavailable(text))
    } else {
        Error::backend(Refused(text))
    }
}

fn unavailable(what: impl Into<String>) -> Error {
    Error::backend(Unavailable(what.into()))
}

fn parse_url(url: &str) -> Result<tokio_postgres::Config> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(Error::invalid(format!(
            "a PostgreSQL URL starts with postgres:// or postgresql://, got {:?}",
            url.split("://").next().unwrap_or("")
        )));
    }
    tokio_postgres::Config::from_str(url)
        .map_err(|e| Error::invalid(format!("bad PostgreSQL URL: {e}")))
}

/// `host:port/db` of a config, for `Debug` and errors (never the password).
fn target(config: &tokio_postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{host}:{port}/{}",
        config.get_dbname().or(config.get_user()).unwrap_or("")
    )
}

impl PostgresBackend {
    /// Connects to the database at `url` (`postgres://user:password@host:port/db`), with the
    /// default [`PostgresOptions`]. A bad URL is [`Error::InvalidConfig`]; a server that
    /// cannot be reached within the connect timeout is [`Error::Backend`].
    ///
    /// ```no_run
    /// # async fn run() -> redlease::Result<()> {
    /// let store = redlease::PostgresBackend::connect("postgres://postgres@127.0.0.1:5432/postgres").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, PostgresOptions::new()).await
    }

    /// [`connect`](Self::connect) with options.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use redlease::{PostgresBackend, PostgresOptions};
    /// # async fn run() -> redlease::Result<()> {
    /// let opts = PostgresOptions::new().schema("locks").command_timeout(Duration::from_secs(1));
    /// let store = PostgresBackend::connect_with("postgres://app@db/app", opts).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(url: &str, options: PostgresOptions) -> Result<Self> {
        let config = parse_url(url)?;
        Self::from_config(config, options).await
    }

    /// Connects with a [`tokio_postgres::Config`] the application built.
    ///
    /// ```no_run
    /// # async fn run() -> redlease::Result<()> {
    /// let mut config = tokio_postgres::Config::new();
    /// config.host("127.0.0.1").port(5432).user("postgres").dbname("postgres");
    /// let store = redlease::PostgresBackend::from_config(config, Default::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn from_config(
        mut config: tokio_postgres::Config,
        options: PostgresOptions,
    ) -> Result<Self> {
        options.check()?;
        check_tls(&config)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(options.connect_timeout);
        }
        let hub = Arc::new(Hub::new());
        let names = Names::new(&options);
        let commands = Commands::own(config.clone(), &names, hub.clone());
        Self::start(commands, config, options, names, hub).await
    }

    /// Uses an application's [`deadpool_postgres::Pool`] for commands, and `listener`
    /// (the same database's settings) for the one connection of its own that listens for
    /// releases: a pooled connection never sees notifications.
    ///
    /// ```no_run
    /// # async fn run(pool: deadpool_postgres::Pool) -> redlease::Result<()> {
    /// let listener: tokio_postgres::Config = "postgres://app@db/app".parse().unwrap();
    /// let store = redlease::PostgresBackend::from_pool(pool, listener, Default::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn from_pool(
        pool: deadpool_postgres::Pool,
        mut listener: tokio_postgres::Config,
        options: PostgresOptions,
    ) -> Result<Self> {
        options.check()?;
        check_tls(&listener)?;
        if listener.get_connect_timeout().is_none() {
            listener.connect_timeout(options.connect_timeout);
        }
        let hub = Arc::new(Hub::new());
        let names = Names::new(&options);
        let commands = Commands::pool(pool, &names);
        Self::start(commands, listener, options, names, hub).await
    }

    async fn start(
        commands: Commands,
        listener: tokio_postgres::Config,
        opts: PostgresOptions,
        names: Names,
        hub: Arc<Hub>,
    ) -> Result<Self> {
        // The first connection creates the schema: an unreachable server or a role that may
        // not create it fails here, not at the first lock.
        commands.ready(opts.connect_timeout).await?;
        let (stop, stopped) = futures::channel::oneshot::channel();
        crate::runtime::background().spawn(listen::run(
            listener.clone(),
            names.listen(),
            hub.clone(),
            stopped,
        ));
        Ok(PostgresBackend {
            inner: Arc::new(Inner {
                target: target(&listener),
                opts,
                commands,
                hub,
                _stop: stop,
            }),
        })
    }

    async fn query(
        &self,
        stmt: Stmt,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>> {
        self.inner
            .commands
            .query(stmt, params, self.inner.opts.command_timeout)
            .await
    }

    /// Returns once the listener is subscribed (at once but while it reconnects: then within
    /// the command timeout, or an error).
    async fn listening(&self) -> Result<()> {
        let mut ready = self.inner.hub.ready.subscribe();
        let deadline = std::time::Instant::now() + self.inner.opts.command_timeout;
        let subscribed = async move { ready.wait_for(|r| *r).await.is_ok() };
        match crate::runtime::until(Some(deadline), subscribed).await {
            Some(true) => Ok(()),
            _ => Err(unavailable(
                "postgres: the listener is not connected (reconnecting)",
            )),
        }
    }

    /// How many keys this backend's waiters are subscribed to now (lock releases, fair
    /// hand-offs and cached values each count): for tests, which cannot see a waiter on the
    /// server (subscriptions are local, behind the one listener).
    ///
    /// ```no_run
    /// # async fn run(store: redlease::PostgresBackend) {
    /// assert_eq!(store.subscribed_keys(), 0); // nobody waits in this process
    /// # }
    /// ```
    #[doc(hidden)]
    pub fn subscribed_keys(&self) -> usize {
        let hub = &self.inner.hub;
        let live = |m: &Mutex<HashMap<String, Weak<Event>>>| {
            let m = m.lock().unwrap_or_else(|p| p.into_inner());
            m.values().filter(|e| e.strong_count() > 0).count()
        };
        live(&hub.events) + live(&hub.targets)
    }

    fn unsupported(&self, kind: &ClaimKind) -> Result<()> {
        self.capabilities().check(kind, self)
    }
}

#[async_trait]
impl Backend for PostgresBackend {
    /// Every kind: fair, reentrant and shared (reads, permits). One logical store: not a
    /// Redlock node (`node: false`).
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::ALL;
        caps.node = false;
        caps
    }

    async fn acquire(&self, claim: &Claim, attempt: Attempt, terms: NodeTerms) -> Result<Acquire> {
        claim.check_token()?;
        crate::options::check_ttl(claim.ttl)?;
        self.unsupported(&claim.kind)?;
        let (kind, owner, permits) = kind_args(&claim.kind)?;
        let sent = next_sent();
        let wait_ms = attempt.keep_waiter().map_or(0, ms);
        let arriving = matches!(attempt, Attempt::Arriving { .. });
        let floor = i64::try_from(terms.fence_floor).unwrap_or(i64::MAX);
        let rows = self
            .query(
                Stmt::Acquire,
                &[
                    &claim.key.as_str().as_bytes(),
                    &claim.token.as_str(),
                    &kind,
                    &owner,
                    &permits,
                    &ms(claim.ttl),
                    &wait_ms,
                    &arriving,
                    &floor,
                    &claim.token.label().map(str::as_bytes),
                    &sent,
                ],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| Error::backend(Refused("acquire returned no row".into())))?;
        let code: i32 = row.try_get(0).map_err(pg_error)?;
        let val: i64 = row.try_get(1).map_err(pg_error)?;
        let lease: Option<String> = row.try_get(2).map_err(pg_error)?;
        let holds: Option<i32> = row.try_get(3).map_err(pg_error)?;
        if code != 1 {
            return Ok(Acquire::Held {
                remaining: u64::try_from(val)
                    .ok()
                    .filter(|v| *v > 0)
                    .map(Duration::from_millis),
            });
        }
        let lease = match lease {
            Some(t) if t != claim.token.as_str() => Token::from_store(&t),
            _ => claim.token.clone(),
        };
        // The server ends the lease on its clock, the holder counts on its own from the
        // call's start: the drift margin between the two, as on every store.
        let grant = Grant::new(u64::try_from(val).unwrap_or(0), validity(claim.ttl), lease);
        Ok(Acquire::Granted(match (&claim.kind, holds) {
            (ClaimKind::Reentrant(_), Some(n)) => {
                grant.with_hold_count(u32::try_from(n).unwrap_or(u32::MAX))
            }
            _ => grant,
        }))
    }

    async fn extend(&self, leases: &[Lease<'_>], _terms: NodeTerms) -> Result<Vec<Extended>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&[u8]> = leases.iter().map(|l| l.key.as_str().as_bytes()).collect();
        let tokens: Vec<&str> = leases.iter().map(|l| l.token.as_str()).collect();
        let ttls: Vec<i64> = leases
            .iter()
            .map(|l| ms(l.ttl.min(crate::options::MAX_TTL)))
            .collect();
        let rows = self.query(Stmt::Extend, &[&keys, &tokens, &ttls]).await?;
        let mut held = vec![false; leases.len()];
        for row in rows {
            let i: i64 = row.try_get(0).map_err(pg_error)?;
            if let Some(h) = usize::try_from(i - 1).ok().and_then(|i| held.get_mut(i)) {
                *h = true;
            }
        }
        Ok(leases
            .iter()
            .zip(held)
            .map(|(l, h)| {
                if h {
                    Extended::Held(validity(l.ttl.min(crate::options::MAX_TTL)))
                } else {
                    Extended::Gone
                }
            })
            .collect())
    }

    /// Resolves when a connection was opened again (the listener's, whose notifications
    /// may have been lost, or the commands'): the watchdog then checks every lease.
    fn disturbed(&self) -> BoxFuture<'static, ()> {
        Box::pin(self.inner.hub.disturbed.listen())
    }

    async fn release(&self, claim: &Claim, how: Release<'_>) -> Result<Option<u32>> {
        let (kind, owner, _) = kind_args(&claim.kind)?;
        let sent = next_sent();
        let (lease, abandon) = match how {
            Release::Confirmed { lease } => (Some(lease.as_str()), false),
            Release::Abandon => (None, true),
        };
        let rows = self
            .query(
                Stmt::Release,
                &[
                    &claim.key.as_str().as_bytes(),
                    &claim.token.as_str(),
                    &kind,
                    &owner,
                    &lease,
                    &sent,
                    &abandon,
                ],
            )
            .await?;
        let left: i32 = match rows.first() {
            Some(row) => row.try_get(0).map_err(pg_error)?,
            None => -1,
        };
        Ok(u32::try_from(left).ok())
    }

    /// Returns once the backend's listener is subscribed to the release channel (at once,
    /// but while it reconnects: then within the command timeout, or an error). A fair claim
    /// is woken when the lock is handed to it, other kinds by releases of the key.
    async fn subscribe(&self, claim: &Claim) -> Result<Subscription> {
        let hub = &self.inner.hub;
        let event = if claim.kind == ClaimKind::Fair {
            hub.event(&hub.targets, claim.token.as_str())
        } else {
            hub.event(&hub.events, &payload(&claim.key))
        };
        self.listening().await?;
        Ok(Subscription::new(event))
    }

    async fn inspect(&self, key: &LeaseKey) -> Result<Option<LockInfo>> {
        let rows = self
            .query(Stmt::Inspect, &[&key.as_str().as_bytes()])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let held: Option<bool> = row.try_get(0).map_err(pg_error)?;
        let left: Option<i64> = row.try_get(1).map_err(pg_error)?;
        let fence: Option<i64> = row.try_get(2).map_err(pg_error)?;
        let label: Option<Vec<u8>> = row.try_get(3).map_err(pg_error)?;
        let reentrant: Option<i64> = row.try_get(4).map_err(pg_error)?;
        let shared: Option<i64> = row.try_get(5).map_err(pg_error)?;
        let shared_labels: Option<Vec<Vec<u8>>> = row.try_get(6).map_err(pg_error)?;
        let queued: Option<i64> = row.try_get(7).map_err(pg_error)?;
        let mut info = LockInfo::new();
        info.held = held.unwrap_or(false);
        info.remaining = left
            .and_then(|l| u64::try_from(l).ok())
            .map(Duration::from_millis);
        info.fencing_token = fence.and_then(|f| u64::try_from(f).ok()).filter(|f| *f > 0);
        let text = |l: Vec<u8>| String::from_utf8_lossy(&l).into_owned();
        info.holder_label = label.map(text);
        info.reentrant_count = reentrant.and_then(|n| u64::try_from(n).ok());
        info.shared_holds = shared.and_then(|n| u64::try_from(n).ok());
        info.shared_labels = shared_labels
            .unwrap_or_default()
            .into_iter()
            .map(text)
            .collect();
        info.queue_len = queued.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
        Ok((!info.is_blank()).then_some(info))
    }

    async fn raise_fence(&self, key: &LeaseKey, at_least: u64) -> Result<()> {
        let at_least = i64::try_from(at_least).unwrap_or(i64::MAX);
        self.query(Stmt::RaiseFence, &[&key.as_str().as_bytes(), &at_least])
            .await?;
        Ok(())
    }
}
