//! The redis-rs transport (feature `redis-rs`): per server, a multiplexed connection for
//! commands and one for pub/sub, each kept up by a supervisor of its own.
//!
//! redis-rs' `ConnectionManager` reconnects, but tells nobody: no notice, no new `CLIENT ID`
//! (the backend needs both: a reconnect may mean a server that restarted empty, and a
//! `WAIT` counts only its own connection's writes), and it re-subscribes on its own without
//! saying when that is done. So each connection here is a `MultiplexedConnection` (RESP3,
//! so that redis-rs pushes a notice the moment the socket drops), remade by [`Supervised`]
//! with an exponential back-off (10 ms to 1 s, unlimited), which reads the new connection's
//! `CLIENT ID` and then tells the backend. A command waits for a connection up to its
//! timeout, and is sent again after a dropped connection up to
//! [`RedisOptions::max_command_attempts`] times (every script is idempotent per claim); a
//! command that times out has the connection checked with a `PING`, and remade if that goes
//! unanswered too (a paused server, a silent network), as fred drops an unresponsive one.
//!
//! Behind Sentinel (`redis-sentinel://`), each connection asks the sentinels for the primary
//! every time it is made, and checks with `ROLE` that the server it reached is the primary
//! (redis-rs' own Sentinel client gives a connection that does not find the primary again
//! after a failover). After a `READONLY` the backend has the connection remade, which asks
//! again.
//!
//! TLS (`rediss://`, feature `tls`) goes through redis-rs' rustls: the CA and the client's
//! identity of [`TlsOptions`](crate::TlsOptions) are given to it as PEM; a server name other
//! than the URL's host cannot be, and is refused with [`Error::Unsupported`] naming it.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use event_listener::Event;
use futures::stream::{self, BoxStream, StreamExt};
use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, ProtocolVersion,
    PushInfo, PushKind, RedisError,
};
use tokio::sync::{broadcast, mpsc};

use super::{Connection, Connector, Failure, Node, Notice, Said, Subscriber, Target, Value};
use crate::backend::redis::{RedisBackend, RedisOptions};
use crate::error::{Error, Result};
use crate::runtime::in_tokio;

/// The shortest and longest pause between two connection attempts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

/// Opens what `url` names with `options`.
pub(in crate::backend::redis) async fn open(
    url: &str,
    options: &RedisOptions,
    _wait: bool,
) -> Result<Target> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let settings = Settings::of(options);
    // The connection settings, over TLS if the URL asks (`connect` has refused a TLS URL
    // without the `tls` feature).
    let secure = |info: ConnectionInfo| async move {
        #[cfg(feature = "tls")]
        if matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
            return with_tls(info, &options.tls).await;
        }
        Ok::<_, Error>(info)
    };
    if let Some(plain) = scheme.strip_suffix("-cluster") {
        let (info, seeds, _) = hosts_url(plain, rest, 6379)?;
        let info = secure(info).await?;
        return Ok(Target::Cluster {
            seeds,
            connector: Arc::new(RedisRsConnector { info, settings }),
        });
    }
    if let Some(plain) = scheme.strip_suffix("-sentinel") {
        let mut sentinels = Sentinels::of(plain, rest)?;
        sentinels.template = secure(sentinels.template).await?;
        return Ok(Target::Single(node(
            Source::Sentinel(Arc::new(sentinels)),
            &settings,
        )));
    }
    let info = secure(parse(url)?).await?;
    Ok(Target::Single(node(
        Source::Fixed(Box::new(info)),
        &settings,
    )))
}

/// `info` (a `rediss://` URL's) with [`TlsOptions`](crate::TlsOptions)' CA and identity,
/// read on a blocking thread. A server name of its own cannot be given to redis-rs: refused.
#[cfg(feature = "tls")]
async fn with_tls(info: ConnectionInfo, tls: &super::TlsOptions) -> Result<ConnectionInfo> {
    if let Some(name) = tls.name() {
        return Err(Error::Unsupported(format!(
            "TlsOptions::server_name({name:?}) on the redis-rs transport: redis-rs checks the \
             certificate against the URL's host only; use Transport::Fred, or a URL whose host \
             the certificate names"
        )));
    }
    let tls = tls.clone();
    let read = move || -> Result<redis::TlsCertificates> {
        let identity = tls.identity_text()?;
        Ok(redis::TlsCertificates {
            client_tls: identity.map(|((chain, _), (key, _))| redis::ClientTlsConfig {
                client_cert: chain,
                client_key: key,
            }),
            root_cert: tls.ca_text()?.map(|(ca, _)| ca),
        })
    };
    let certificates = in_tokio(tokio::task::spawn_blocking(read))
        .await
        .map_err(|e| Error::backend(format!("reading the TLS settings: {e}")))??;
    // redis-rs builds its rustls configuration with the process's default provider: ring,
    // unless the application installed one already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::build_with_tls(info, certificates)
        .map_err(|e| Error::invalid(format!("TLS settings refused by redis-rs: {e}")))?;
    Ok(client.get_connection_info().clone())
}

/// `info` for the server at `host:port`, over TLS if `info` is.
fn at(info: &ConnectionInfo, host: &str, port: u16) -> ConnectionInfo {
    let addr = match info.addr().clone() {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure,
            tls_params,
        },
        _ => ConnectionAddr::Tcp(host.to_owned(), port),
    };
    info.clone().set_addr(addr)
}

impl RedisBackend {
    /// A backend over the server an application's redis-rs client names (feature
    /// `redis-rs`): its address, credentials, database and TLS settings, with `options`
    /// (timeouts, replica acknowledgement, the restart quarantine; its transport and TLS
    /// options are the client's) and connections of the backend's own (a multiplexed one for
    /// commands, one for pub/sub; see [`Transport::RedisRs`](crate::Transport)). Connects
    /// now, and checks the server as [`connect`](Self::connect) does. For an application
    /// that holds a `ConnectionManager`, give the client it was made from.
    ///
    /// **A Redis Cluster node's client** (its server says `cluster_enabled:1`) stands for the
    /// cluster: as [`connect`](Self::connect) does with a `redis-cluster://` URL, the backend
    /// asks it for the slot table and opens a connection per primary with the client's
    /// settings, sending each lock's calls to the primary that serves its slot, so one dead
    /// primary costs only the locks it serves.
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// use redlease::{LockManager, RedisBackend, RedisOptions};
    /// let client = redis::Client::open("redis://127.0.0.1:6379/").expect("a valid URL");
    /// let backend = RedisBackend::from_redis_client(&client, RedisOptions::new()).await?;
    /// let locks = LockManager::new(backend);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a client on a Unix socket; [`Error::InvalidConfig`] for
    /// bad options; otherwise as [`connect`](Self::connect).
    pub async fn from_redis_client(client: &Client, options: RedisOptions) -> Result<Self> {
        options.validate()?;
        let info = client.get_connection_info().clone();
        let (host, port) = match info.addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                (host.clone(), *port)
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "a redis-rs client at {other} on the redis-rs transport: only TCP is \
                     served"
                )))
            }
        };
        let settings = Settings::of(&options);
        let target = if clustered(&info, options.connect_timeout).await? {
            Target::Cluster {
                seeds: vec![(host, port)],
                connector: Arc::new(RedisRsConnector { info, settings }),
            }
        } else {
            Target::Single(node(Source::Fixed(Box::new(info)), &settings))
        };
        RedisBackend::with_options_over(target, &options, true).await
    }
}

/// Whether the server `info` names is a Redis Cluster node (`INFO cluster`), asked on a
/// connection of its own within `timeout`.
async fn clustered(info: &ConnectionInfo, timeout: Duration) -> Result<bool> {
    let client = Client::open(info.clone()).map_err(Error::backend)?;
    let ask = async {
        let mut connection = client.get_multiplexed_async_connection().await?;
        let mut info = redis::cmd("INFO");
        info.arg("cluster");
        connection.send_packed_command(&info).await
    };
    match in_tokio(tokio::time::timeout(timeout, ask)).await {
        Ok(Ok(reply)) => Ok(from_redis(reply)
            .as_string()
            .is_some_and(|text| text.lines().any(|l| l.trim() == "cluster_enabled:1"))),
        Ok(Err(e)) => Err(Error::backend(failure(&e))),
        Err(_) => Err(Error::backend(format!(
            "{} did not answer within the connect timeout",
            address(info)
        ))),
    }
}

/// redis-rs' connection settings for `url` (RESP3: pushes tell of a dropped socket).
fn parse(url: &str) -> Result<ConnectionInfo> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    // redis-rs reads redis:// and valkey:// alike.
    let url = match scheme {
        "valkey" => format!("redis://{rest}"),
        "valkeys" => format!("rediss://{rest}"),
        _ => url.to_owned(),
    };
    let client = Client::open(url.as_str())
        .map_err(|e| Error::invalid(format!("malformed Redis URL: {}", e)))?;
    Ok(client.get_connection_info().clone())
}

/// The query of a URL with several hosts, as pairs.
type Query = Vec<(String, String)>;

/// Hosts as `(host, port)`.
type Hosts = Vec<(String, u16)>;

/// A URL with several hosts (`redis-cluster://` or `redis-sentinel://`:
/// `[user:pass@]host:port[,host:port...][/db][?node=host:port&...]`, fred's form) as the first
/// host's settings, every host (`default_port` where none is given), and the query.
fn hosts_url(plain: &str, rest: &str, default_port: u16) -> Result<(ConnectionInfo, Hosts, Query)> {
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (credentials, hosts) = match authority.rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority),
    };
    let mut seeds = Vec::new();
    let mut add = |hostport: &str| -> Result<()> {
        let (host, port) = hostport
            .rsplit_once(':')
            .map_or((hostport, Ok(default_port)), |(h, p)| (h, p.parse::<u16>()));
        let port = port.map_err(|_| Error::invalid(format!("bad port in {hostport:?}")))?;
        seeds.push((host.to_owned(), port));
        Ok(())
    };
    for host in hosts.split(',').filter(|h| !h.is_empty()) {
        add(host)?;
    }
    let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
    let mut pairs = Query::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "node" => add(value)?,
            _ => pairs.push((name.to_owned(), value.to_owned())),
        }
    }
    let Some((host, port)) = seeds.first().cloned() else {
        return Err(Error::invalid("Redis URL has no host"));
    };
    let scheme = match plain {
        "rediss" | "valkeys" => "rediss",
        _ => "redis",
    };
    let credentials = credentials.map_or(String::new(), |c| format!("{c}@"));
    let info = parse(&format!("{scheme}://{credentials}{host}:{port}{path}"))?;
    Ok((info, seeds, pairs))
}

/// The sentinels of a `redis-sentinel://` URL, and how to reach the primary they name.
struct Sentinels {
    /// The sentinels' addresses.
    nodes: Vec<(String, u16)>,
    /// The service they monitor (`sentinelServiceName`).
    service: String,
    /// The sentinels' own credentials (`sentinelUsername`, `sentinelPassword`), if any.
    auth: (Option<String>, Option<String>),
    /// The primary's settings (credentials, database), made its own by its address.
    template: ConnectionInfo,
}

impl Sentinels {
    fn of(plain: &str, rest: &str) -> Result<Self> {
        let (template, nodes, query) = hosts_url(plain, rest, 26379)?;
        let value = |name: &str| {
            query
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let service = value("sentinelServiceName")
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                Error::invalid(
                    "a redis-sentinel:// URL needs ?sentinelServiceName=<the monitored service>",
                )
            })?;
        Ok(Sentinels {
            nodes,
            service,
            auth: (value("sentinelUsername"), value("sentinelPassword")),
            template,
        })
    }

    /// The primary's settings, as the first sentinel that answers names it
    /// (`SENTINEL get-master-addr-by-name`), each asked within `timeout`.
    async fn primary(&self, timeout: Duration) -> Said<ConnectionInfo> {
        let mut last = Failure::connection("no sentinel answered");
        for (host, port) in &self.nodes {
            match tokio::time::timeout(timeout, self.ask(host, *port)).await {
                Ok(Ok(info)) => return Ok(info),
                Ok(Err(f)) => last = f,
                Err(_) => last = Failure::connection(format!("sentinel {host}:{port} timed out")),
            }
        }
        Err(last)
    }

    async fn ask(&self, host: &str, port: u16) -> Said<ConnectionInfo> {
        let mut redis = redis::RedisConnectionInfo::default();
        if let Some(user) = &self.auth.0 {
            redis = redis.set_username(user);
        }
        if let Some(password) = &self.auth.1 {
            redis = redis.set_password(password);
        }
        // Over TLS if the primary is reached over TLS.
        let info = at(&self.template, host, port).set_redis_settings(redis);
        let client = Client::open(info).map_err(|e| failure(&e))?;
        let mut connection = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| failure(&e))?;
        let mut ask = redis::cmd("SENTINEL");
        ask.arg("get-master-addr-by-name").arg(&self.service);
        let reply = connection
            .send_packed_command(&ask)
            .await
            .map_err(|e| failure(&e))?;
        let named = from_redis(reply).into_array();
        match (
            named.first().and_then(Value::as_string),
            named.get(1).and_then(Value::as_i64),
        ) {
            (Some(ip), Some(port)) => {
                let port = u16::try_from(port)
                    .map_err(|_| Failure::connection(format!("sentinel named port {port}")))?;
                Ok(at(&self.template, &ip, port))
            }
            _ => Err(Failure::connection(format!(
                "sentinel {host}:{port} knows no service {:?}",
                self.service
            ))),
        }
    }
}

/// Where a connection goes: one server, or the primary that sentinels name (asked again at
/// every connection).
#[derive(Clone)]
enum Source {
    Fixed(Box<ConnectionInfo>),
    Sentinel(Arc<Sentinels>),
}

impl Source {
    /// The address named in messages, before a connection says where it went.
    fn named(&self) -> String {
        match self {
            Source::Fixed(info) => address(info),
            Source::Sentinel(s) => format!("the primary of {:?}", s.service),
        }
    }
}

/// `host:port` of `info`.
fn address(info: &ConnectionInfo) -> String {
    match info.addr() {
        ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        other => other.to_string(),
    }
}

/// The connection settings of a backend's connections.
#[derive(Clone, Copy)]
struct Settings {
    command_timeout: Duration,
    connect_timeout: Duration,
    attempts: u32,
}

impl Settings {
    fn of(options: &RedisOptions) -> Self {
        Settings {
            command_timeout: options.command_timeout,
            connect_timeout: options.connect_timeout,
            attempts: options.max_command_attempts.max(1),
        }
    }
}

/// A server's two connections.
fn node(source: Source, settings: &Settings) -> Node {
    let (messages, received) = mpsc::unbounded_channel();
    Node {
        connection: Arc::new(RedisRsConnection {
            link: Supervised::new(source.clone(), *settings, None),
        }),
        subscriber: Arc::new(RedisRsSubscriber {
            link: Supervised::new(source, *settings, Some(messages)),
            received: Mutex::new(Some(received)),
        }),
    }
}

/// `info` on RESP3: redis-rs pushes a notice the moment its socket drops.
fn resp3(info: ConnectionInfo) -> ConnectionInfo {
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    info.set_redis_settings(settings)
}

/// A cluster's nodes, with the cluster's settings.
struct RedisRsConnector {
    info: ConnectionInfo,
    settings: Settings,
}

impl Connector for RedisRsConnector {
    fn node(&self, host: &str, port: u16, _wait: bool) -> Result<Node> {
        Ok(node(
            Source::Fixed(Box::new(at(&self.info, host, port))),
            &self.settings,
        ))
    }
}

/// A redis-rs error as a [`Failure`].
fn failure(e: &RedisError) -> Failure {
    let connection = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(e.kind(), ErrorKind::Client);
    let said = match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        (Some(code), None) => code.to_owned(),
        _ => e.to_string(),
    };
    Failure {
        said,
        connection,
        message: e.to_string(),
    }
}

/// A server's error reply, in its words (`CODE detail`).
fn said(e: &redis::ServerError) -> String {
    match e.details() {
        Some(detail) => format!("{} {detail}", e.code()),
        None => e.code().to_owned(),
    }
}

fn from_redis(v: redis::Value) -> Value {
    use redis::Value as R;
    match v {
        R::Nil => Value::Nil,
        R::Int(n) => Value::Int(n),
        R::Boolean(b) => Value::Int(i64::from(b)),
        R::BulkString(b) => Value::Bytes(Bytes::from(b)),
        R::SimpleString(s) => Value::from(s),
        R::Okay => Value::from("OK"),
        R::Double(d) => Value::from(d.to_string()),
        R::VerbatimString { text, .. } => Value::from(text),
        R::Array(items) | R::Set(items) | R::Push { data: items, .. } => {
            Value::Array(items.into_iter().map(from_redis).collect())
        }
        R::Map(pairs) => Value::Array(
            pairs
                .into_iter()
                .flat_map(|(k, v)| [from_redis(k), from_redis(v)])
                .collect(),
        ),
        R::Attribute { data, .. } => from_redis(*data),
        R::ServerError(e) => Value::from(said(&e)),
        other => Value::from(format!("{other:?}")),
    }
}

fn command(name: &str, args: &[Value]) -> Cmd {
    let mut cmd = redis::cmd(name);
    for arg in args {
        push(&mut cmd, arg);
    }
    cmd
}

fn push(cmd: &mut Cmd, arg: &Value) {
    match arg {
        Value::Nil => {
            cmd.arg("");
        }
        Value::Int(n) => {
            cmd.arg(*n);
        }
        Value::Bytes(b) => {
            cmd.arg(&b[..]);
        }
        Value::Array(items) => items.iter().for_each(|i| push(cmd, i)),
    }
}

/// A live connection: the connection, its `CLIENT ID`, and its number among the
/// connections made.
#[derive(Clone)]
struct Live {
    connection: MultiplexedConnection,
    epoch: u64,
}

/// A connection kept up: made again, in the background, whenever it drops.
struct Supervised {
    source: Source,
    /// The server's address (behind Sentinel: the primary last reached).
    server: Mutex<String>,
    settings: Settings,
    /// The connection now (`None` while it is being made).
    live: Mutex<Option<Live>>,
    /// The live connection's `CLIENT ID` (`-1`: unknown).
    id: AtomicI64,
    /// Connections made so far.
    epochs: AtomicU64,
    /// Notified when a connection is made.
    changed: Event,
    /// Set while a task makes the connection.
    connecting: AtomicBool,
    /// Set when the backend is dropped: no more connections.
    closed: AtomicBool,
    /// A notice per connection made.
    reconnects: broadcast::Sender<()>,
    /// Pub/sub messages are sent here (a subscriber's connection).
    messages: Option<mpsc::UnboundedSender<Notice>>,
}

impl Supervised {
    fn new(
        source: Source,
        settings: Settings,
        messages: Option<mpsc::UnboundedSender<Notice>>,
    ) -> Arc<Self> {
        let (reconnects, _) = broadcast::channel(16);
        Arc::new(Supervised {
            server: Mutex::new(source.named()),
            source,
            settings,
            live: Mutex::new(None),
            id: AtomicI64::new(-1),
            epochs: AtomicU64::new(0),
            changed: Event::new(),
            connecting: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            reconnects,
            messages,
        })
    }

    /// No more connections: the backend is dropped.
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        *self.live.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
    fn live(&self) -> Option<Live> {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One connection attempt, within the connect timeout: the connection, with its `CLIENT
    /// ID` read and the backend told.
    async fn attempt(self: &Arc<Self>) -> Said<()> {
        let weak = Arc::downgrade(self);
        let pushes = self.messages.clone();
        // This connection's number once installed (0 before; `u64::MAX`: it dropped before):
        // a late notice of an old connection's drop must not drop its successor.
        let mine = Arc::new(AtomicU64::new(0));
        let installed = mine.clone();
        let sender = move |info: PushInfo| -> std::result::Result<(), ()> {
            on_push(&weak, pushes.as_ref(), &mine, info);
            Ok(())
        };
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.settings.connect_timeout))
            .set_response_timeout(None)
            .set_push_sender(sender);
        let info = match &self.source {
            Source::Fixed(info) => (**info).clone(),
            Source::Sentinel(sentinels) => sentinels.primary(self.settings.connect_timeout).await?,
        };
        let client = Client::open(resp3(info.clone())).map_err(|e| failure(&e))?;
        let made = tokio::time::timeout(
            self.settings.connect_timeout,
            client.get_multiplexed_async_connection_with_config(&config),
        )
        .await;
        let mut connection = match made {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(failure(&e)),
            Err(_) => return Err(Failure::connection("timed out connecting")),
        };
        let id = tokio::time::timeout(
            self.settings.connect_timeout,
            connection.send_packed_command(&redis::cmd("CLIENT").arg("ID").clone()),
        )
        .await;
        let id = match id {
            Ok(Ok(redis::Value::Int(id))) => id,
            // An ACL that refuses CLIENT ID: acknowledgements count reconnects instead.
            _ => -1,
        };
        if let Source::Sentinel(sentinels) = &self.source {
            // A failover in progress: the sentinels may still name the old primary.
            let role = tokio::time::timeout(
                self.settings.connect_timeout,
                connection.send_packed_command(&redis::cmd("ROLE")),
            )
            .await;
            let role = match role {
                Ok(Ok(reply)) => from_redis(reply)
                    .into_array()
                    .first()
                    .and_then(Value::as_string),
                _ => None,
            };
            if role.as_deref() != Some("master") {
                return Err(Failure::connection(format!(
                    "{} is not the primary of {:?} (yet)",
                    address(&info),
                    sentinels.service
                )));
            }
        }
        *self.server.lock().unwrap_or_else(|p| p.into_inner()) = address(&info);
        let epoch = self.epochs.fetch_add(1, Ordering::AcqRel) + 1;
        self.id.store(id, Ordering::Release);
        *self.live.lock().unwrap_or_else(|p| p.into_inner()) = Some(Live { connection, epoch });
        if installed.swap(epoch, Ordering::AcqRel) == u64::MAX {
            // It dropped while it was being set up.
            self.dropped(epoch);
            return Err(Failure::connection("the connection dropped as it was made"));
        }
        self.changed.notify(usize::MAX);
        // Every connection, the first too (as fred tells it): a lazily made backend loads its
        // scripts and reads the eviction policy then.
        let _ = self.reconnects.send(());
        Ok(())
    }

    /// Makes the connection in the background (unless a task does already), trying again
    /// with a growing pause until it is made or the backend is dropped.
    fn reconnect_soon(self: &Arc<Self>) {
        if self.closed.load(Ordering::Acquire) || self.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = Arc::downgrade(self);
        let task = async move {
            let mut pause = BACKOFF.0;
            loop {
                let Some(shared) = this.upgrade() else { return };
                if shared.closed.load(Ordering::Acquire) {
                    return;
                }
                if shared.attempt().await.is_ok() {
                    shared.connecting.store(false, Ordering::Release);
                    return;
                }
                drop(shared);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(BACKOFF.1);
            }
        };
        crate::runtime::background().spawn(in_tokio(task));
    }

    /// The connection numbered `epoch` dropped (or does not answer): it is forgotten and
    /// made again.
    fn dropped(self: &Arc<Self>, epoch: u64) {
        {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            if live.as_ref().is_none_or(|l| l.epoch != epoch) {
                return;
            }
            *live = None;
        }
        self.id.store(-1, Ordering::Release);
        self.reconnect_soon();
    }

    /// The live connection, waiting for one until `deadline`.
    async fn connection(self: &Arc<Self>, deadline: Instant) -> Said<Live> {
        loop {
            if let Some(live) = self.live() {
                return Ok(live);
            }
            self.reconnect_soon();
            let changed = self.changed.listen();
            if let Some(live) = self.live() {
                return Ok(live);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, changed).await.is_err() {
                return Err(Failure::connection(format!(
                    "not connected to {} (reconnecting)",
                    self.server()
                )));
            }
        }
    }

    /// Sends `cmd`, waiting for a connection until its timeout; after a dropped connection,
    /// again on the next, up to `attempts` times in all. A command that times out has the
    /// connection checked.
    async fn send(self: &Arc<Self>, cmd: &Cmd, timeout: Duration, attempts: u32) -> Said<Value> {
        let deadline = Instant::now() + timeout;
        let mut tries = 0;
        loop {
            tries += 1;
            let Live {
                mut connection,
                epoch,
            } = self.connection(deadline).await?;
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, connection.send_packed_command(cmd)).await {
                Ok(Ok(redis::Value::ServerError(e))) => {
                    let said = said(&e);
                    return Err(Failure {
                        message: said.clone(),
                        said,
                        connection: false,
                    });
                }
                Ok(Ok(reply)) => return Ok(from_redis(reply)),
                Ok(Err(e)) if e.is_connection_dropped() || e.is_io_error() => {
                    self.dropped(epoch);
                    if tries >= attempts {
                        return Err(failure(&e));
                    }
                }
                Ok(Err(e)) => return Err(failure(&e)),
                Err(_) => {
                    self.check(connection, epoch);
                    return Err(Failure::connection(format!(
                        "a command to {} timed out after {timeout:?}",
                        self.server()
                    )));
                }
            }
        }
    }

    /// After a command timed out: a `PING` within the command timeout, and the connection
    /// made again if it goes unanswered (a paused server, a silent network).
    fn check(self: &Arc<Self>, mut connection: MultiplexedConnection, epoch: u64) {
        let this = Arc::downgrade(self);
        let timeout = self.settings.command_timeout;
        crate::runtime::background().spawn(in_tokio(async move {
            let ping = redis::cmd("PING");
            let answered = tokio::time::timeout(timeout, connection.send_packed_command(&ping))
                .await
                .is_ok_and(|r| r.is_ok());
            if let (false, Some(shared)) = (answered, this.upgrade()) {
                shared.dropped(epoch);
            }
        }));
    }

    fn is_connected(&self) -> bool {
        self.live().is_some()
    }

    fn server(&self) -> String {
        self.server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A push from the server or redis-rs: a dropped socket has the connection made again; a
/// message goes to the subscriber.
fn on_push(
    shared: &Weak<Supervised>,
    messages: Option<&mpsc::UnboundedSender<Notice>>,
    mine: &AtomicU64,
    info: PushInfo,
) {
    match info.kind {
        PushKind::Disconnection => {
            let epoch =
                match mine.compare_exchange(0, u64::MAX, Ordering::AcqRel, Ordering::Acquire) {
                    // Not installed yet: `attempt` sees the mark.
                    Ok(_) => return,
                    Err(epoch) => epoch,
                };
            if let Some(shared) = shared.upgrade() {
                shared.dropped(epoch);
            }
        }
        PushKind::Message | PushKind::SMessage => {
            let (Some(messages), [channel, payload, ..]) = (messages, &info.data[..]) else {
                return;
            };
            let channel = from_redis(channel.clone()).as_string().unwrap_or_default();
            let payload = from_redis(payload.clone());
            let _ = messages.send(Notice::Message { channel, payload });
        }
        _ => {}
    }
}

/// A stream of `()`, one per reconnect (a lag counts as one more).
fn notices(rx: broadcast::Receiver<()>) -> BoxStream<'static, ()> {
    stream::unfold(rx, |mut rx| async move {
        match rx.recv().await {
            Ok(()) | Err(broadcast::error::RecvError::Lagged(_)) => Some(((), rx)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    })
    .boxed()
}

/// The command connection to one server.
struct RedisRsConnection {
    link: Arc<Supervised>,
}

impl Drop for RedisRsConnection {
    fn drop(&mut self) {
        self.quit();
    }
}

#[async_trait]
impl Connection for RedisRsConnection {
    async fn evalsha(&self, sha: &str, keys: &[String], args: &[Value]) -> Said<Value> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha).arg(keys.len()).arg(keys);
        for arg in args {
            push(&mut cmd, arg);
        }
        let shared = &self.link;
        let (timeout, attempts) = (shared.settings.command_timeout, shared.settings.attempts);
        in_tokio(shared.send(&cmd, timeout, attempts)).await
    }

    async fn command(&self, name: &'static str, args: Vec<Value>) -> Said<Value> {
        let shared = &self.link;
        let (timeout, attempts) = (shared.settings.command_timeout, shared.settings.attempts);
        in_tokio(shared.send(&command(name, &args), timeout, attempts)).await
    }

    async fn command_once(
        &self,
        name: &'static str,
        args: Vec<Value>,
        timeout: Duration,
    ) -> Said<Value> {
        let shared = &self.link;
        if !shared.is_connected() {
            return Err(Failure::connection(format!(
                "not connected to {} (reconnecting)",
                shared.server()
            )));
        }
        in_tokio(shared.send(&command(name, &args), timeout, 1)).await
    }

    async fn connect(&self) -> Result<()> {
        let shared = &self.link;
        if shared.is_connected() {
            return Ok(());
        }
        match in_tokio(shared.attempt()).await {
            Ok(()) => Ok(()),
            Err(f) => Err(Error::backend(f)),
        }
    }

    async fn connect_lazily(&self) {
        self.link.reconnect_soon();
    }

    async fn ready(&self) -> bool {
        let shared = &self.link;
        loop {
            let changed = shared.changed.listen();
            if shared.is_connected() {
                return true;
            }
            shared.reconnect_soon();
            changed.await;
        }
    }

    fn is_connected(&self) -> bool {
        self.link.is_connected()
    }

    fn identity(&self) -> Option<(String, i64)> {
        let shared = &self.link;
        let id = shared.id.load(Ordering::Acquire);
        (id >= 0 && shared.is_connected()).then(|| (self.server(), id))
    }

    fn server(&self) -> String {
        self.link.server()
    }

    fn user(&self) -> String {
        let info = match &self.link.source {
            Source::Fixed(info) => info,
            Source::Sentinel(sentinels) => &sentinels.template,
        };
        info.redis_settings()
            .username()
            .unwrap_or("default")
            .to_owned()
    }

    fn command_timeout(&self) -> Duration {
        self.link.settings.command_timeout
    }

    fn reconnects(&self) -> BoxStream<'static, ()> {
        notices(self.link.reconnects.subscribe())
    }

    fn reconnect(&self) {
        let shared = &self.link;
        if let Some(live) = shared.live() {
            shared.dropped(live.epoch);
        }
    }

    fn quit(&self) {
        self.link.close();
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The pub/sub connection to one server.
struct RedisRsSubscriber {
    link: Arc<Supervised>,
    /// The messages, until [`start`](Subscriber::start) takes them.
    received: Mutex<Option<mpsc::UnboundedReceiver<Notice>>>,
}

impl Drop for RedisRsSubscriber {
    fn drop(&mut self) {
        self.quit();
    }
}

#[async_trait]
impl Subscriber for RedisRsSubscriber {
    async fn start(&self) -> Result<(BoxStream<'static, Notice>, BoxStream<'static, ()>)> {
        let shared = &self.link;
        let reconnects = notices(shared.reconnects.subscribe());
        if !shared.is_connected() {
            in_tokio(shared.attempt()).await.map_err(Error::backend)?;
        }
        let received = self
            .received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| Error::backend("the subscriber was started twice"))?;
        let messages = stream::unfold(received, |mut rx| async move {
            rx.recv().await.map(|notice| (notice, rx))
        })
        .boxed();
        Ok((messages, reconnects))
    }

    /// One command per channel: redis-rs takes a subscription's confirmation for its reply
    /// (one per channel), so each returns once the server has it. A refused one (an ACL)
    /// is no error here: the backend's check finds it.
    async fn subscribe(&self, channels: Vec<String>, sharded: bool) -> Said<()> {
        let name = if sharded { "SSUBSCRIBE" } else { "SUBSCRIBE" };
        let shared = &self.link;
        let timeout = shared.settings.command_timeout;
        let each = channels.into_iter().map(|c| {
            let cmd = command(name, &[Value::from(c)]);
            async move {
                match in_tokio(shared.send(&cmd, timeout, 1)).await {
                    Err(f) if f.is("NOPERM") => Ok(()),
                    other => other.map(drop),
                }
            }
        });
        futures::future::try_join_all(each).await.map(drop)
    }

    async fn unsubscribe(&self, channel: String, sharded: bool) -> Said<()> {
        let name = if sharded {
            "SUNSUBSCRIBE"
        } else {
            "UNSUBSCRIBE"
        };
        let shared = &self.link;
        let cmd = command(name, &[Value::from(channel)]);
        in_tokio(shared.send(&cmd, shared.settings.command_timeout, 1))
            .await
            .map(drop)
    }

    fn connection_id(&self) -> Option<i64> {
        let id = self.link.id.load(Ordering::Acquire);
        (id >= 0).then_some(id)
    }

    fn is_connected(&self) -> bool {
        self.link.is_connected()
    }

    fn quit(&self) {
        self.link.close();
    }
}

#[cfg(test)]
mod tests {
    use super::{hosts_url, Sentinels};

    #[test]
    fn cluster_urls_name_their_seeds_and_credentials() {
        let (info, seeds, _) = hosts_url(
            "redis",
            "app:pw@10.0.0.1:7000,10.0.0.2:7001/0?node=10.0.0.3:7002",
            6379,
        )
        .expect("a valid URL");
        assert_eq!(
            seeds,
            vec![
                ("10.0.0.1".to_owned(), 7000),
                ("10.0.0.2".to_owned(), 7001),
                ("10.0.0.3".to_owned(), 7002)
            ]
        );
        assert_eq!(info.redis_settings().username(), Some("app"));
        assert_eq!(info.redis_settings().password(), Some("pw"));
        assert!(hosts_url("redis", "10.0.0.1:x", 6379).is_err());
    }

    #[test]
    fn sentinel_urls_name_the_service_the_sentinels_and_their_credentials() {
        let sentinels = Sentinels::of(
            "redis",
            "app:pw@10.0.0.1?sentinelServiceName=orders&sentinelUsername=s&sentinelPassword=t\
             &node=10.0.0.2:26380",
        )
        .expect("a valid URL");
        assert_eq!(sentinels.service, "orders");
        assert_eq!(
            sentinels.nodes,
            vec![
                ("10.0.0.1".to_owned(), 26379),
                ("10.0.0.2".to_owned(), 26380)
            ]
        );
        assert_eq!(sentinels.auth, (Some("s".to_owned()), Some("t".to_owned())));
        assert_eq!(sentinels.template.redis_settings().username(), Some("app"));
        let Err(missing) = Sentinels::of("redis", "10.0.0.1:26379") else {
            panic!("a sentinel URL without a service was accepted");
        };
        assert!(
            missing.to_string().contains("sentinelServiceName"),
            "{missing}"
        );
    }
}
