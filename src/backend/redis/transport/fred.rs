//! The fred transport (the default): fred's multiplexed client per server for commands, its
//! subscriber client for wake-ups, the client's settings made from a URL and
//! [`RedisOptions`] or copied from an application's client, and TLS (`tls.rs`). fred runs in
//! a tokio context: every call here is made in one (`in_tokio`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fred::clients::SubscriberClient;
use fred::interfaces::{
    ClientInterface, ClientLike, EventInterface, LuaInterface, PubsubInterface,
};
use fred::prelude::{Builder, Client, Config, ReconnectPolicy};
use fred::types::config::{
    ConnectionConfig, Options, PerformanceConfig, ServerConfig, UnresponsiveConfig,
};
use fred::types::{ClusterHash, CustomCommand};
use futures::stream::{self, BoxStream, StreamExt};
use tokio::sync::broadcast::{self, error::RecvError};

use super::{Connection, Connector, Failure, Node, Notice, Said, Subscriber, Target, Value};

use crate::backend::redis::{Checks, RedisBackend, RedisOptions};
use crate::error::{Error, Result};
use crate::runtime::{self, in_tokio};

#[cfg(feature = "tls")]
pub(in crate::backend::redis) mod tls;

/// How many pub/sub messages fred keeps for the subscriber's handler while it is not running
/// (fred's default: 32). More than that in a burst and the handler misses some: it then wakes
/// every waiter to look again (see `pubsub.rs`), which costs a round of attempts.
const MESSAGES_BUFFERED: usize = 1024;

/// Opens what `url` names with `options` (the first connection is made by the backend);
/// `tls`: the URL asks for TLS (checked by the backend).
pub(in crate::backend::redis) async fn open(
    url: &str,
    tls: bool,
    options: &RedisOptions,
    wait: bool,
) -> Result<Target> {
    #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
    let mut config = parse_url(url)?;
    #[cfg(feature = "tls")]
    if tls {
        options.tls.apply(&mut config).await?;
    }
    #[cfg(not(feature = "tls"))]
    let _ = tls;
    let settings = Settings::Options(options.clone());
    if config.server.is_clustered() {
        return Ok(cluster(config, settings));
    }
    Ok(Target::Single(settings.node(config, wait)?))
}

/// The connections of [`RedisBackend::from_client`]: the
/// application's client for commands (a cluster client's settings for a connection per
/// primary), and a subscriber made from its settings.
fn from_client(client: Client) -> Result<Target> {
    let config = client.client_config();
    let settings = ClientSettings::of(&client);
    if config.server.is_clustered() {
        return Ok(cluster(config, Settings::Client(settings)));
    }
    let subscriber = settings.builder(config).build_subscriber_client();
    Ok(Target::Single(Node {
        connection: Arc::new(FredConnection { client }),
        subscriber: Arc::new(FredSubscriber {
            client: subscriber.map_err(Error::backend)?,
        }),
    }))
}

impl RedisBackend {
    /// The fred client underneath, for commands of your own on the same connection (on a
    /// cluster, the connection to the first primary that answered at connect, also when the
    /// backend was made by [`from_client`](Self::from_client) over a cluster client); `None`
    /// when another client carries the backend (see
    /// [`RedisOptions::transport`](crate::RedisOptions::transport())).
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// use fred::interfaces::ClientLike;
    /// let backend = redlease::RedisBackend::connect("redis://127.0.0.1:6379").await?;
    /// assert!(backend.client().is_some_and(|c| c.is_connected()));
    /// # Ok(()) }
    /// ```
    pub fn client(&self) -> Option<&Client> {
        client_of(&*self.inner.connection)
    }

    /// A backend over the fred client the application already has (its connection, its
    /// settings): the locks share it with the application's own commands. The client is
    /// connected here if it is not yet; a second, subscriber connection is made from its
    /// settings for wake-ups. Give the client a reconnect policy and a command timeout (see
    /// `RedisOptions` for the ones [`connect`](Self::connect) sets): without them, fred lets
    /// calls hang while the server is away.
    ///
    /// **A cluster client** (its config is `ServerConfig::Clustered`) is used for its settings
    /// only, not for the locks' calls: as [`connect`](Self::connect) does with a
    /// `redis-cluster://` URL, the backend asks the client's configured nodes for the slot
    /// table and opens a connection (and, once someone waits, a pub/sub connection) per
    /// primary, with the client's credentials, TLS, timeouts and reconnect policy, sending
    /// each lock's calls to the primary that serves its slot. So a primary that is down costs
    /// only the locks it serves; through fred's cluster client, whose one router stalls every
    /// shard while it cannot reach one primary, every lease was lost. The client itself need
    /// not be connected, and [`client`](Self::client) is then the connection to the first
    /// primary that answered, not the client given here.
    ///
    /// ```no_run
    /// # async fn demo() -> redlease::Result<()> {
    /// use fred::prelude::{Builder, ClientLike, Config, ReconnectPolicy};
    /// let mut builder = Builder::from_config(Config::from_url("redis://127.0.0.1:6379").unwrap());
    /// builder.set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2));
    /// let client = builder.build().unwrap();
    /// client.init().await.unwrap();
    /// let backend = redlease::RedisBackend::from_client(client).await?;
    /// # let _ = backend; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if the client cannot connect or its settings cannot make a
    /// subscriber (on a cluster: if none of its configured nodes gives the slot table);
    /// [`Error::InvalidConfig`] for a server older than Redis 7.0, or one whose
    /// `maxmemory-policy` may evict keys (see [`RedisOptions::allow_eviction`]).
    pub async fn from_client(client: Client) -> Result<Self> {
        let target = from_client(client)?;
        RedisBackend::of_target(target, Checks::default(), true).await
    }
}

/// The fred client under a backend's connection, if fred carries it.
fn client_of(connection: &dyn Connection) -> Option<&Client> {
    connection
        .as_any()
        .downcast_ref::<FredConnection>()
        .map(|c| &c.client)
}

fn cluster(template: Config, settings: Settings) -> Target {
    let seeds = match &template.server {
        ServerConfig::Clustered { hosts, .. } => {
            hosts.iter().map(|h| (h.host.to_string(), h.port)).collect()
        }
        _ => Vec::new(),
    };
    Target::Cluster {
        seeds,
        connector: Arc::new(FredConnector { template, settings }),
    }
}

/// fred's configuration for `url` (checked by the backend first: scheme, host, TLS), with a
/// TLS scheme's plain twin: for a TLS one fred would load the system's roots here (blocking,
/// and failing on any unreadable certificate); `open` adds the TLS settings.
fn parse_url(url: &str) -> Result<Config> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let plain = match scheme {
        "rediss" => format!("redis://{rest}"),
        "rediss-cluster" => format!("redis-cluster://{rest}"),
        "valkeys" => format!("valkey://{rest}"),
        "valkeys-cluster" => format!("valkey-cluster://{rest}"),
        "rediss-sentinel" => format!("redis-sentinel://{rest}"),
        "valkeys-sentinel" => format!("valkey-sentinel://{rest}"),
        _ => url.to_owned(),
    };
    // fred's message names the part that failed; it does not echo credentials.
    Config::from_url(&plain).map_err(|e| Error::invalid(format!("malformed Redis URL: {e}")))
}

/// How a server's connections are made, besides its address.
#[derive(Clone)]
enum Settings {
    /// With the options given to `connect_with`.
    Options(RedisOptions),
    /// With the settings of an application's client (`from_client`).
    Client(ClientSettings),
}

impl Settings {
    /// The connections to the server `config` names.
    fn node(&self, mut config: Config, wait: bool) -> Result<Node> {
        let builder = match self {
            Settings::Options(options) => options_builder(config.clone(), options),
            Settings::Client(settings) => settings.builder(config.clone()),
        };
        // The subscriber connects at `PubSub::start` (a lazy backend's at its first wait),
        // and fails then if the server is away.
        let subscriber = builder.build_subscriber_client().map_err(Error::backend)?;
        // A lazy node's first connection is retried by the policy.
        config.fail_fast = wait;
        let mut builder = builder;
        builder.set_config(config);
        let client = builder.build().map_err(Error::backend)?;
        Ok(Node {
            connection: Arc::new(FredConnection { client }),
            subscriber: Arc::new(FredSubscriber { client: subscriber }),
        })
    }
}

/// A builder for `config`'s server with `options`: unlimited reconnects (exponential back-off
/// up to 1 s), the command and connect timeouts, and a silent connection dropped after twice
/// the command timeout.
fn options_builder(config: Config, options: &RedisOptions) -> Builder {
    let mut builder = Builder::from_config(config);
    builder
        .set_policy(ReconnectPolicy::new_exponential(0, 10, 1000, 2))
        .with_performance_config(|p| {
            p.default_command_timeout = options.command_timeout;
            p.broadcast_channel_capacity = MESSAGES_BUFFERED;
        })
        .with_connection_config(|c| {
            c.connection_timeout = options.connect_timeout;
            c.internal_command_timeout = options.connect_timeout;
            c.max_command_attempts = options.max_command_attempts;
            let silent = options.command_timeout.saturating_mul(2);
            c.unresponsive = UnresponsiveConfig {
                max_timeout: Some(silent),
                interval: (silent / 4).max(Duration::from_millis(5)),
            };
        });
    builder
}

/// What `from_client` copies from the application's client for connections of its own (the
/// credentials and TLS are in the client's `Config`).
#[derive(Clone)]
struct ClientSettings {
    performance: PerformanceConfig,
    connection: ConnectionConfig,
    /// `None`: the client has no reconnect policy, and neither have these connections.
    reconnect: Option<ReconnectPolicy>,
}

impl ClientSettings {
    fn of(client: &Client) -> Self {
        ClientSettings {
            performance: client.perf_config(),
            connection: client.connection_config().clone(),
            reconnect: client.client_reconnect_policy(),
        }
    }

    /// A builder of connections to `config`'s server with these settings; its subscribers
    /// buffer at least [`MESSAGES_BUFFERED`] messages.
    fn builder(&self, config: Config) -> Builder {
        let mut builder = Builder::from_config(config);
        builder
            .set_performance_config(self.performance.clone())
            .set_connection_config(self.connection.clone())
            .with_performance_config(|p| {
                p.broadcast_channel_capacity = p.broadcast_channel_capacity.max(MESSAGES_BUFFERED)
            });
        if let Some(policy) = &self.reconnect {
            builder.set_policy(policy.clone());
        }
        builder
    }
}

/// A cluster's nodes, with the cluster's settings.
struct FredConnector {
    /// The cluster's configuration (credentials, TLS), made into one node's by replacing the
    /// server.
    template: Config,
    settings: Settings,
}

impl Connector for FredConnector {
    fn node(&self, host: &str, port: u16, wait: bool) -> Result<Node> {
        let mut config = self.template.clone();
        #[cfg(feature = "tls")]
        let name = match &self.template.server {
            ServerConfig::Clustered { hosts, .. } => {
                hosts.first().and_then(|h| h.tls_server_name.clone())
            }
            _ => None,
        };
        config.server = ServerConfig::new_centralized(host, port);
        // `TlsOptions::server_name`, given for the cluster, holds for each of its nodes.
        #[cfg(feature = "tls")]
        if let ServerConfig::Centralized { server } = &mut config.server {
            server.tls_server_name = name;
        }
        self.settings.node(config, wait)
    }
}

/// A fred error as a [`Failure`]: the connection's (it may pass if tried again soon: the
/// connection, a timeout, a failover, no connection to send it on yet) or the server's words.
fn failure(e: fred::error::Error) -> Failure {
    use fred::error::ErrorKind;
    let connection = matches!(
        e.kind(),
        ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Routing
            | ErrorKind::Sentinel
            | ErrorKind::Cluster
            | ErrorKind::Backpressure
    )
        // fred's word for a command with no connection to go on (dropped, not yet remade),
        // of kind `Unknown` (fred 10.1, router/commands.rs).
        || e.details().starts_with("Failed to route command");
    Failure {
        said: e.details().to_owned(),
        connection,
        message: e.to_string(),
    }
}

fn to_fred(v: &Value) -> fred::types::Value {
    match v {
        Value::Nil => fred::types::Value::Null,
        Value::Int(n) => fred::types::Value::Integer(*n),
        Value::Bytes(b) => fred::types::Value::Bytes(b.clone()),
        Value::Array(items) => fred::types::Value::Array(items.iter().map(to_fred).collect()),
    }
}

fn from_fred(v: fred::types::Value) -> Value {
    use fred::types::Value as F;
    match v {
        F::Null => Value::Nil,
        F::Integer(n) => Value::Int(n),
        F::Boolean(b) => Value::Int(i64::from(b)),
        F::Double(d) => Value::from(d.to_string()),
        F::String(s) => Value::Bytes(s.into_inner()),
        F::Bytes(b) => Value::Bytes(b),
        F::Queued => Value::from("QUEUED"),
        F::Array(items) => Value::Array(items.into_iter().map(from_fred).collect()),
        F::Map(map) => Value::Array(
            map.inner()
                .into_iter()
                .flat_map(|(k, v)| [Value::Bytes(k.into_bytes()), from_fred(v)])
                .collect(),
        ),
    }
}

/// A stream of `()`, one per event on `rx` (a lag counts as one more); it ends with the
/// channel.
fn events<T: Clone + Send + 'static>(rx: broadcast::Receiver<T>) -> BoxStream<'static, ()> {
    stream::unfold(rx, |mut rx| async move {
        match rx.recv().await {
            Ok(_) | Err(RecvError::Lagged(_)) => Some(((), rx)),
            Err(RecvError::Closed) => None,
        }
    })
    .boxed()
}

/// fred's multiplexed client to one server.
struct FredConnection {
    client: Client,
}

#[async_trait]
impl Connection for FredConnection {
    async fn evalsha(&self, sha: &str, keys: &[String], args: &[Value]) -> Said<Value> {
        let keys: Vec<fred::types::Key> = keys.iter().map(|k| k.as_str().into()).collect();
        let args: Vec<fred::types::Value> = args.iter().map(to_fred).collect();
        in_tokio(
            self.client
                .evalsha::<fred::types::Value, _, _, _>(sha, keys, args),
        )
        .await
        .map(from_fred)
        .map_err(failure)
    }

    async fn command(&self, name: &'static str, args: Vec<Value>) -> Said<Value> {
        let command = CustomCommand::new_static(name, ClusterHash::Random, false);
        let args: Vec<fred::types::Value> = args.iter().map(to_fred).collect();
        in_tokio(self.client.custom::<fred::types::Value, _>(command, args))
            .await
            .map(from_fred)
            .map_err(failure)
    }

    async fn command_once(
        &self,
        name: &'static str,
        args: Vec<Value>,
        timeout: Duration,
    ) -> Said<Value> {
        // Not blocking to fred (the commands behind it are sent), sent once, failing at
        // once when the connection is down (a new connection's WAIT would count nothing).
        let command = CustomCommand::new_static(name, ClusterHash::Random, false);
        let options = Options {
            max_attempts: Some(1),
            fail_fast: true,
            timeout: Some(timeout),
            ..Options::default()
        };
        let args: Vec<fred::types::Value> = args.iter().map(to_fred).collect();
        in_tokio(
            self.client
                .with_options(&options)
                .custom::<fred::types::Value, _>(command, args),
        )
        .await
        .map(from_fred)
        .map_err(failure)
    }

    async fn connect(&self) -> Result<()> {
        if self.client.is_connected() {
            return Ok(());
        }
        #[cfg(feature = "tls")]
        if self.client.client_config().uses_tls() {
            return Box::pin(tls::first_connection(&self.client)).await;
        }
        in_tokio(self.client.init())
            .await
            .map(drop)
            .map_err(Error::backend)
    }

    async fn connect_lazily(&self) {
        let connecting = self.client.clone();
        in_tokio(async move { drop(connecting.connect()) }).await;
    }

    async fn ready(&self) -> bool {
        in_tokio(self.client.wait_for_connect()).await.is_ok()
    }

    fn is_connected(&self) -> bool {
        self.client.is_connected()
    }

    fn identity(&self) -> Option<(String, i64)> {
        self.client
            .connection_ids()
            .into_iter()
            .next()
            .map(|(server, id)| (server.to_string(), id))
    }

    fn server(&self) -> String {
        let config = self.client.client_config();
        config
            .server
            .hosts()
            .first()
            .map(|h| format!("{}:{}", h.host, h.port))
            .unwrap_or_default()
    }

    fn user(&self) -> String {
        let config = self.client.client_config();
        config.username.unwrap_or_else(|| "default".to_owned())
    }

    fn command_timeout(&self) -> Duration {
        self.client.perf_config().default_command_timeout
    }

    fn reconnects(&self) -> BoxStream<'static, ()> {
        // Read from fred's channel, not through `on_reconnect`, whose loop ends for good at
        // the first lag. A lag is taken for one more reconnect.
        events(self.client.reconnect_rx())
    }

    fn reconnect(&self) {
        let client = self.client.clone();
        runtime::background().spawn(async move {
            let _ = in_tokio(client.force_reconnection()).await;
        });
    }

    fn quit(&self) {
        let client = self.client.clone();
        runtime::Rt::current().spawn(async move {
            let _ = in_tokio(client.quit()).await;
        });
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// fred's subscriber client to one server.
struct FredSubscriber {
    client: SubscriberClient,
}

#[async_trait]
impl Subscriber for FredSubscriber {
    /// Connects on the crate's background runtime, so that fred's tasks keep running
    /// whichever runtime the waiters use.
    ///
    /// The streams read fred's broadcast channels themselves rather than through
    /// `on_message`/`on_reconnect`, whose loop ends for good at the first `Lagged` (a burst
    /// of messages larger than the channel while the handler was not running): every later
    /// release would then wake nobody in this process. Here a lag is told as such.
    async fn start(&self) -> Result<(BoxStream<'static, Notice>, BoxStream<'static, ()>)> {
        let client = self.client.clone();
        let started = runtime::background().run(async move {
            let messages = client.message_rx();
            let reconnects = client.reconnect_rx();
            client.init().await?;
            Ok::<_, fred::error::Error>((messages, reconnects))
        });
        let (messages, reconnects) = match started.await {
            Some(result) => result.map_err(|e| super::super::errors::store_error(failure(e)))?,
            None => return Err(Error::backend("the background runtime is gone")),
        };
        let messages = stream::unfold(messages, |mut rx| async move {
            let notice = match rx.recv().await {
                Ok(msg) => Notice::Message {
                    channel: msg.channel.to_string(),
                    payload: from_fred(msg.value),
                },
                Err(RecvError::Lagged(_)) => Notice::Lagged,
                Err(RecvError::Closed) => return None,
            };
            Some((notice, rx))
        })
        .boxed();
        Ok((messages, events(reconnects)))
    }

    /// fred answers a SUBSCRIBE's caller before the command is even written (its reply comes
    /// out of band), so a PING follows it on the same connection: the server answers in
    /// order. A SUBSCRIBE the server refused (an ACL) hands its `NOPERM` to the PING:
    /// answered too. No answer (a timeout, a dropped connection, fred's router gone) is the
    /// connection's trouble: the subscription may not be in place. fred waits for an
    /// SSUBSCRIBE's own reply (one per channel: a cluster node's SSUBSCRIBE takes the
    /// channels of one slot).
    async fn subscribe(&self, channels: Vec<String>, sharded: bool) -> Said<()> {
        if channels.is_empty() {
            return Ok(());
        }
        let client = &self.client;
        if sharded {
            let each = channels.into_iter().map(|c| in_tokio(client.ssubscribe(c)));
            return futures::future::try_join_all(each)
                .await
                .map(drop)
                .map_err(failure);
        }
        in_tokio(client.subscribe(channels))
            .await
            .map_err(failure)?;
        match in_tokio(client.ping::<fred::types::Value>(None)).await {
            Ok(_) => Ok(()),
            Err(e) if e.details().starts_with("NOPERM") => Ok(()),
            Err(e) => Err(Failure::connection(format!(
                "the subscription was not confirmed: {e}"
            ))),
        }
    }

    async fn unsubscribe(&self, channel: String, sharded: bool) -> Said<()> {
        let unsubscribed = if sharded {
            in_tokio(self.client.sunsubscribe(channel)).await
        } else {
            in_tokio(self.client.unsubscribe(channel)).await
        };
        unsubscribed.map_err(failure)
    }

    fn connection_id(&self) -> Option<i64> {
        self.client.connection_ids().into_values().next()
    }

    fn is_connected(&self) -> bool {
        self.client.is_connected()
    }

    fn quit(&self) {
        let client = self.client.clone();
        runtime::Rt::current().spawn(async move {
            let _ = in_tokio(client.quit()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn slots_are_fred_s() {
        for key in [
            "foo",
            "{user1000}.following",
            "foo{}{bar}",
            "{}foo",
            "a{b",
            "redlease:{job}:queue",
            "",
        ] {
            assert_eq!(
                super::super::slot(key.as_bytes()),
                fred::util::redis_keyslot(key.as_bytes()),
                "{key}"
            );
        }
    }
}
