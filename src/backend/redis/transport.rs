//! The seam between the Redis backend and the client that carries its commands: what the
//! backend needs from a client, and nothing more. Everything above it (the scripts, group
//! commit, the watchdog's extension rounds, routing per primary, replica acknowledgement,
//! reading the server's errors) is written once, in the modules beside this one; each client
//! has a module of its own below it: `fred` (the default) and `redis_rs` (feature
//! `redis-rs`). A cluster is routed above the seam (`shards.rs`): a client only ever speaks
//! to one server.
//!
//! A client gives, per server:
//! - a command [`Connection`]: one multiplexed connection that reconnects by itself, sends
//!   a script call (`EVALSHA`) or any other command and reads its reply, says who it is
//!   (`CLIENT ID`, for `WAIT`'s accounting), and tells of each reconnect;
//! - a [`Subscriber`]: a pub/sub connection that subscribes (or shard-subscribes) and
//!   returns once the server has the subscription, hands out messages, and tells of each
//!   reconnect (the backend subscribes again itself);
//! - a [`Connector`] that opens both for another server with the same settings (a cluster's
//!   nodes).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;

use crate::error::Result;

pub(super) mod fred;
#[cfg(feature = "redis-rs")]
pub(super) mod redis_rs;

#[cfg(feature = "tls")]
mod tls;

#[cfg(feature = "tls")]
pub use tls::TlsOptions;

/// Which client carries a [`RedisBackend`](super::RedisBackend)'s commands; see
/// [`RedisOptions::transport`](crate::RedisOptions::transport()).
///
/// ```
/// use redlease::{RedisOptions, Transport};
/// let options = RedisOptions::new().transport(Transport::Fred);
/// assert_eq!(options.transport, Transport::Fred);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// fred (the default).
    #[default]
    Fred,
    /// redis-rs (the `redis` crate; feature `redis-rs`): its connection manager per server.
    #[cfg(feature = "redis-rs")]
    RedisRs,
}

/// A value sent to the server or read from it, the same whichever client carries it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Value {
    Nil,
    Int(i64),
    /// A bulk or simple string (a script's string, a status reply).
    Bytes(Bytes),
    Array(Vec<Value>),
}

impl Value {
    /// An integer, or a string that reads as one.
    pub(super) fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(n) => Some(*n),
            Value::Bytes(b) => std::str::from_utf8(b).ok()?.trim().parse().ok(),
            _ => None,
        }
    }

    /// [`as_i64`](Self::as_i64), if not negative.
    pub(super) fn as_u64(&self) -> Option<u64> {
        self.as_i64().and_then(|n| u64::try_from(n).ok())
    }

    /// A string (or an integer as text); `None` for nil, an array or bytes that are not
    /// UTF-8.
    pub(super) fn as_str(&self) -> Option<Cow<'_, str>> {
        match self {
            Value::Int(n) => Some(Cow::Owned(n.to_string())),
            Value::Bytes(b) => std::str::from_utf8(b).ok().map(Cow::Borrowed),
            _ => None,
        }
    }

    /// [`as_str`](Self::as_str), owned.
    pub(super) fn as_string(&self) -> Option<String> {
        self.as_str().map(Cow::into_owned)
    }

    pub(super) fn is_null(&self) -> bool {
        matches!(self, Value::Nil)
    }

    /// A string's bytes; `None` for anything else.
    pub(super) fn into_bytes(self) -> Option<Bytes> {
        match self {
            Value::Bytes(b) => Some(b),
            Value::Int(n) => Some(Bytes::from(n.to_string())),
            _ => None,
        }
    }

    /// An array's items (anything else as none).
    pub(super) fn into_array(self) -> Vec<Value> {
        match self {
            Value::Array(items) => items,
            _ => Vec::new(),
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Bytes(Bytes::copy_from_slice(s.as_bytes()))
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Bytes(Bytes::from(s))
    }
}

impl From<Bytes> for Value {
    fn from(b: Bytes) -> Self {
        Value::Bytes(b)
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Int(n)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        i64::try_from(n).map_or_else(|_| Value::from(n.to_string()), Value::Int)
    }
}

/// A Lua script and its SHA-1 (sent as `EVALSHA`; loaded at each connection, and again on
/// `NOSCRIPT`).
#[derive(Clone, Debug)]
pub(super) struct Script {
    text: Arc<str>,
    sha: Arc<str>,
}

impl Script {
    pub(super) fn new(text: impl Into<Arc<str>>) -> Self {
        let text: Arc<str> = text.into();
        let sha = sha1_smol::Sha1::from(text.as_bytes()).digest().to_string();
        Script {
            text,
            sha: sha.into(),
        }
    }

    pub(super) fn text(&self) -> &str {
        &self.text
    }

    pub(super) fn sha(&self) -> &str {
        &self.sha
    }
}

/// A command that failed, as the client reported it.
#[derive(Clone, Debug)]
pub(super) struct Failure {
    /// The server's words for an error reply (`NOSCRIPT ...`, `READONLY ...`), or the
    /// client's description of what went wrong.
    pub(super) said: String,
    /// The connection's trouble (dropped, timed out, not yet made, being remade): the
    /// command may pass if tried again soon.
    pub(super) connection: bool,
    /// The client's full message, for the caller's error.
    pub(super) message: String,
}

impl Failure {
    /// A failure of the connection (see [`connection`](Self::connection)).
    pub(super) fn connection(message: impl Into<String>) -> Self {
        let message = message.into();
        Failure {
            said: message.clone(),
            connection: true,
            message,
        }
    }

    /// Whether the server's words start with `code` (`NOPERM`, `NOSCRIPT`).
    pub(super) fn is(&self, code: &str) -> bool {
        self.said.starts_with(code)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

/// What a command's client said.
pub(super) type Said<T> = std::result::Result<T, Failure>;

/// A pub/sub message: its channel and payload.
#[derive(Debug)]
pub(super) enum Notice {
    Message {
        channel: String,
        payload: Value,
    },
    /// Messages were dropped (the handler fell behind): every waiter looks again.
    Lagged,
}

/// One server's command connection (see the module docs).
#[async_trait]
pub(super) trait Connection: Send + Sync + 'static {
    /// `EVALSHA sha numkeys keys... args...`, its reply as it came.
    async fn evalsha(&self, sha: &str, keys: &[String], args: &[Value]) -> Said<Value>;

    /// Any other command (`INFO`, `SCRIPT LOAD`, `PUBLISH`, `CLUSTER SLOTS`...).
    async fn command(&self, name: &'static str, args: Vec<Value>) -> Said<Value>;

    /// A command sent once (never re-sent after a reconnect), failing at once when the
    /// connection is down, with `timeout` as its own time limit: `WAIT`, whose count is of
    /// the writes made on this connection.
    async fn command_once(
        &self,
        name: &'static str,
        args: Vec<Value>,
        timeout: Duration,
    ) -> Said<Value>;

    /// Connects, waiting for the first connection (within the connect timeout).
    async fn connect(&self) -> Result<()>;

    /// Starts connecting in the background; commands wait for it.
    async fn connect_lazily(&self);

    /// Resolves once connected: `false` if the client gave up on the first connection.
    async fn ready(&self) -> bool;

    fn is_connected(&self) -> bool;

    /// The server's address and this connection's `CLIENT ID` there, if known: a `WAIT`
    /// counts only the writes made on the same connection.
    fn identity(&self) -> Option<(String, i64)>;

    /// The server's address as configured (`host:port`), for messages.
    fn server(&self) -> String;

    /// The user it authenticates as (`default` if none).
    fn user(&self) -> String;

    /// How long one command may take.
    fn command_timeout(&self) -> Duration;

    /// A notice after each reconnect (the connection is up again, nothing reloaded yet).
    /// Taken before [`connect`](Self::connect) to see the first connection's too.
    fn reconnects(&self) -> BoxStream<'static, ()>;

    /// Drops the connection and makes a new one (in the background): after `READONLY`, so
    /// that a client behind Sentinel finds the primary again.
    fn reconnect(&self);

    /// Closes the connection (in the background): the backend is dropped.
    fn quit(&self);

    /// The client's own type, for [`RedisBackend::client`](crate::RedisBackend::client).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// One server's pub/sub connection (see the module docs).
#[async_trait]
pub(super) trait Subscriber: Send + Sync + 'static {
    /// Connects; from then on, messages and reconnects are told on the two streams
    /// (taken once).
    async fn start(&self) -> Result<(BoxStream<'static, Notice>, BoxStream<'static, ()>)>;

    /// SUBSCRIBE (`sharded`: SSUBSCRIBE, one per channel) of `channels`; returns once the
    /// server has processed it, so that a check of a lock made after it cannot miss a
    /// release's message. A subscription the server refused (an ACL) is no error here: the
    /// backend's check finds it.
    async fn subscribe(&self, channels: Vec<String>, sharded: bool) -> Said<()>;

    /// UNSUBSCRIBE (`sharded`: SUNSUBSCRIBE) of `channel`.
    async fn unsubscribe(&self, channel: String, sharded: bool) -> Said<()>;

    /// This connection's `CLIENT ID`, if known.
    fn connection_id(&self) -> Option<i64>;

    fn is_connected(&self) -> bool;

    /// Closes the connection (in the background).
    fn quit(&self);
}

/// A server's two connections, made by a client.
pub(super) struct Node {
    pub(super) connection: Arc<dyn Connection>,
    pub(super) subscriber: Arc<dyn Subscriber>,
}

/// Opens a cluster node's connections, with the cluster's settings (credentials, TLS,
/// timeouts, reconnects).
pub(super) trait Connector: Send + Sync + 'static {
    /// The connections to the node at `host:port`; `wait`: the first command connection is
    /// to fail at once if the server does not answer (otherwise it is retried in the
    /// background).
    fn node(&self, host: &str, port: u16, wait: bool) -> Result<Node>;
}

/// What a URL names, as a client opened it.
pub(super) enum Target {
    /// One server (also the primary that Sentinel names).
    Single(Node),
    /// A Redis Cluster: its seed nodes, and how to open any node's connections.
    Cluster {
        seeds: Vec<(String, u16)>,
        connector: Arc<dyn Connector>,
    },
}

/// The cluster slot of `key` (CRC16 of the key, or of its hash tag: the part between the
/// first `{` and the next `}`, if not empty).
pub(super) fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % 16384
}

#[cfg(test)]
mod tests {
    use super::{slot, Value};

    #[test]
    fn slots_are_those_redis_computes() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        assert_eq!(slot(b"redlease:{job}:queue"), slot(b"job"));
    }

    #[test]
    fn values_read_as_the_scripts_answer() {
        assert_eq!(Value::from("42").as_i64(), Some(42));
        assert_eq!(Value::Int(-1).as_string().as_deref(), Some("-1"));
        assert_eq!(Value::Nil.as_i64(), None);
        assert!(Value::Nil.is_null());
        assert_eq!(
            Value::from(u64::MAX).as_string(),
            Some(u64::MAX.to_string())
        );
    }
}
