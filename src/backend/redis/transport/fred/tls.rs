//! TLS for `rediss://` (feature `tls`): whom to trust, the client's certificate, the name to
//! check; the rustls configuration made from them; and the first connection, which tells a
//! server that does not speak TLS from one that is slow.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::interfaces::ClientLike;
use fred::prelude::{Client, Config};
use fred::rustls::pki_types::pem::PemObject;
use fred::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use fred::rustls::{self, ClientConfig, RootCertStore};
use fred::rustls_native_certs;
use fred::types::config::{HostMapping, ServerConfig, TlsConfig, TlsConnector, TlsHostMapping};
use futures::future::{self, Either};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::runtime::{self, in_tokio};

/// TLS settings for `rediss://` URLs (feature `tls`), given with
/// [`RedisOptions::tls`](crate::RedisOptions::tls()).
///
/// - **Trust.** By default the system's root certificates are trusted. With
///   [`ca_file`](Self::ca_file) or [`ca_pem`](Self::ca_pem), the CA certificates given are
///   trusted *instead*: a server whose certificate a private CA signed is accepted, and
///   one signed by a public CA is not (as `redis-cli --cacert` does). To trust both, put
///   the public roots you need in the same PEM.
/// - **Identity.** For a server started with `tls-auth-clients yes`, the client's
///   certificate chain and private key ([`identity_files`](Self::identity_files) or
///   [`identity_pem`](Self::identity_pem)).
/// - **Server name.** The certificate is checked against the URL's host (a DNS name or an
///   IP address); [`server_name`](Self::server_name) checks another name (and sends it as
///   SNI), for a server reached by an address its certificate does not name.
///
/// PEM text is read and checked at connect, before anything is sent: unreadable files, text
/// without the expected PEM sections, a certificate or key that cannot be decoded, or a key
/// that does not match its certificate fail with [`Error::InvalidConfig`] naming the part.
/// `Debug` shows where each part comes from, never a key.
///
/// ```
/// use redlease::{RedisOptions, TlsOptions};
/// let opts = RedisOptions::new().tls(
///     TlsOptions::new()
///         .ca_file("/etc/redis/tls/ca.crt")
///         .identity_files("/etc/redis/tls/client.crt", "/etc/redis/tls/client.key")
///         .server_name("redis.internal"),
/// );
/// let shown = format!("{opts:?}");
/// assert!(shown.contains("client.key") && shown.contains("redis.internal"));
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct TlsOptions {
    ca: Option<Pem>,
    identity: Option<(Pem, Pem)>,
    server_name: Option<String>,
}

/// Where a PEM text comes from.
#[derive(Clone)]
enum Pem {
    Text(Arc<[u8]>),
    File(PathBuf),
}

impl Pem {
    /// The text; `what` names the part in the error.
    fn read(&self, what: &str) -> Result<Vec<u8>> {
        match self {
            Pem::Text(text) => Ok(text.to_vec()),
            Pem::File(path) => std::fs::read(path).map_err(|e| {
                Error::invalid(format!("TLS {what}: cannot read {}: {e}", path.display()))
            }),
        }
    }
}

impl fmt::Debug for Pem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pem::Text(text) => write!(f, "<PEM, {} bytes>", text.len()),
            Pem::File(path) => write!(f, "{}", path.display()),
        }
    }
}

impl fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsOptions")
            .field("ca", &self.ca)
            .field("identity", &self.identity)
            .field("server_name", &self.server_name)
            .finish()
    }
}

impl TlsOptions {
    /// The defaults: the system's roots, no client certificate, the URL's host.
    ///
    /// ```
    /// let tls = redlease::TlsOptions::new();
    /// assert!(format!("{tls:?}").contains("ca: None"));
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts the CA certificates in the PEM file at `path` (one or more), instead of the
    /// system's roots. The file is read at connect.
    ///
    /// ```
    /// let tls = redlease::TlsOptions::new().ca_file("ca.crt");
    /// assert!(format!("{tls:?}").contains("ca.crt"));
    /// ```
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca = Some(Pem::File(path.into()));
        self
    }

    /// Trusts the CA certificates in `pem` (one or more `-----BEGIN CERTIFICATE-----`
    /// sections), instead of the system's roots.
    ///
    /// ```
    /// # let ca_pem = String::new();
    /// let tls = redlease::TlsOptions::new().ca_pem(ca_pem);
    /// ```
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(Pem::Text(pem.into().into()));
        self
    }

    /// Presents the certificate chain in the PEM file `cert_chain` (the client's certificate
    /// first) with the private key in the PEM file `key` (PKCS#8, PKCS#1 or SEC1): for a
    /// server that requires client certificates (`tls-auth-clients yes`). Read at connect.
    ///
    /// ```
    /// let tls = redlease::TlsOptions::new().identity_files("client.crt", "client.key");
    /// assert!(format!("{tls:?}").contains("client.key"));
    /// ```
    pub fn identity_files(
        mut self,
        cert_chain: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.identity = Some((Pem::File(cert_chain.into()), Pem::File(key.into())));
        self
    }

    /// [`identity_files`](Self::identity_files) from PEM text. `Debug` shows the key's
    /// length, not the key.
    ///
    /// ```
    /// # let (chain, key) = (String::new(), String::new());
    /// let tls = redlease::TlsOptions::new().identity_pem(chain, key);
    /// ```
    pub fn identity_pem(mut self, cert_chain: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        let chain = Pem::Text(cert_chain.into().into());
        self.identity = Some((chain, Pem::Text(key.into().into())));
        self
    }

    /// Checks the server's certificate against `name` (a DNS name or an IP address), and
    /// sends it as SNI, instead of the URL's host; on a Redis Cluster, for every node.
    ///
    /// ```
    /// let tls = redlease::TlsOptions::new().server_name("redis.internal");
    /// assert!(format!("{tls:?}").contains("redis.internal"));
    /// ```
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Whether anything is set (a plain `redis://` URL refuses TLS options).
    pub(in crate::backend::redis) fn is_set(&self) -> bool {
        self.ca.is_some() || self.identity.is_some() || self.server_name.is_some()
    }

    /// Gives `config` (from a TLS URL) these settings: the rustls configuration, and the
    /// server name. Files and the system's roots are read on a blocking thread.
    pub(super) async fn apply(&self, config: &mut Config) -> Result<()> {
        let name = match &self.server_name {
            Some(name) => {
                ServerName::try_from(name.as_str()).map_err(|_| {
                    Error::invalid(format!(
                        "TLS server name {name:?} is neither a DNS name nor an IP address"
                    ))
                })?;
                Some(fred::bytes_utils::Str::from(name.as_str()))
            }
            None => None,
        };
        let this = self.clone();
        let rustls = blocking(move || this.rustls_config()).await?;
        let mut hostnames = TlsHostMapping::None;
        if let Some(name) = name {
            match &mut config.server {
                ServerConfig::Centralized { server } => server.tls_server_name = Some(name),
                ServerConfig::Clustered { hosts, .. } | ServerConfig::Sentinel { hosts, .. } => {
                    for host in hosts.iter_mut() {
                        host.tls_server_name = Some(name.clone());
                    }
                    // The nodes found by CLUSTER SLOTS (the primary a sentinel names) too.
                    hostnames = TlsHostMapping::Custom(Arc::new(OneName(name.to_string())));
                }
                // A Unix socket, with fred's `unix-sockets` feature.
                #[allow(unreachable_patterns)]
                _ => {}
            }
        }
        config.tls = Some(TlsConfig {
            connector: TlsConnector::from(rustls),
            hostnames,
        });
        Ok(())
    }

    /// The rustls configuration (ring provider, TLS 1.2 and 1.3). Reads files: call it where
    /// blocking is allowed.
    fn rustls_config(&self) -> Result<ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid(format!("TLS: {e}")))?
            .with_root_certificates(self.roots()?);
        let Some((chain, key)) = &self.identity else {
            return Ok(builder.with_no_client_auth());
        };
        let chain = certificates(
            &chain.read("client certificate chain")?,
            chain,
            "client certificate chain",
        )?;
        let key = PrivateKeyDer::from_pem_slice(&key.read("client key")?).map_err(|e| {
            Error::invalid(format!(
                "TLS client key {key:?}: {e} (expected a -----BEGIN PRIVATE KEY----- section, \
                 or an RSA or EC one)"
            ))
        })?;
        builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| Error::invalid(format!("TLS client identity: {e}")))
    }

    /// The CA certificates given, else the system's roots.
    fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        if let Some(ca) = &self.ca {
            for cert in certificates(&ca.read("CA")?, ca, "CA")? {
                roots.add(cert).map_err(|e| {
                    Error::invalid(format!("TLS CA {ca:?}: not a usable certificate: {e}"))
                })?;
            }
            return Ok(roots);
        }
        let native = rustls_native_certs::load_native_certs();
        let _ = roots.add_parsable_certificates(native.certs);
        if roots.is_empty() {
            let why = native.errors.first().map(ToString::to_string);
            return Err(Error::invalid(format!(
                "TLS: no trusted root certificates: the system's store is empty or unreadable \
                 ({}); give the server's CA with TlsOptions::ca_file",
                why.as_deref().unwrap_or("no certificates found")
            )));
        }
        Ok(roots)
    }
}

/// Every certificate in `pem` (from `source`), at least one.
fn certificates(pem: &[u8], source: &Pem, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::invalid(format!("TLS {what} {source:?}: {e}")))?;
    if certs.is_empty() {
        return Err(Error::invalid(format!(
            "TLS {what} {source:?}: no certificate found (expected a -----BEGIN CERTIFICATE----- \
             section)"
        )));
    }
    Ok(certs)
}

/// The one server name every cluster node's certificate is checked against.
#[derive(Debug)]
struct OneName(String);

impl HostMapping for OneName {
    fn map(&self, _: &std::net::IpAddr, _: &str) -> Option<String> {
        Some(self.0.clone())
    }
}

/// Runs `f` on a thread where blocking is allowed (tokio's blocking pool), or here if there
/// is no tokio runtime to lend one.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    in_tokio(async move {
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => handle
                .spawn_blocking(f)
                .await
                .unwrap_or_else(|e| Err(Error::backend(format!("reading the TLS settings: {e}")))),
            Err(_) => f(),
        }
    })
    .await
}

/// Connects `client` (its URL uses TLS) for the first time. A server that does not speak
/// TLS answers a TLS hello with silence (it waits for the end of a line), so the handshake
/// would wait out the connect timeout: once the handshake is slow, or has failed, one plain
/// `PING` on a connection of its own tells whether a plain-text Redis is there, and then the
/// error says so at once.
pub(super) async fn first_connection(client: &Client) -> Result<()> {
    let config = client.client_config();
    let Some(server) = config.server.hosts().into_iter().next() else {
        return in_tokio(client.init())
            .await
            .map(drop)
            .map_err(Error::backend);
    };
    let timeout = client.connection_config().connection_timeout;
    let deadline = Instant::now() + timeout;
    // Longer than a TLS handshake takes on a healthy network; a slower one gets a PING it
    // refuses (one line in its log), nothing worse.
    let patience = (timeout / 4).min(Duration::from_millis(500));
    let address = (server.host.to_string(), server.port);
    let init = std::pin::pin!(in_tokio(client.init()));
    let probe = std::pin::pin!(async {
        runtime::sleep(patience).await;
        speaks_plain_text(&address, deadline).await
    });
    let failed = match future::select(init, probe).await {
        Either::Left((Ok(_), _)) => return Ok(()),
        Either::Left((Err(e), _)) => e,
        // The handshake goes on alone until its timeout; its task then ends.
        Either::Right((true, _)) => return Err(not_tls(&server)),
        Either::Right((false, init)) => match init.await {
            Ok(_) => return Ok(()),
            // Already asked: not a plain-text server.
            Err(e) => return Err(handshake_failed(&server, e)),
        },
    };
    if speaks_plain_text(&address, deadline.max(Instant::now() + patience)).await {
        return Err(not_tls(&server));
    }
    Err(handshake_failed(&server, failed))
}

fn not_tls(server: &impl fmt::Display) -> Error {
    Error::invalid(format!(
        "the server at {server} did not speak TLS: it answered a plain-text PING. Use a \
         redis:// URL for a plain-text port, or the server's TLS port (tls-port)"
    ))
}

/// fred's words for a failed handshake (rustls's error, printed with `Debug`), after what
/// they most likely mean.
fn handshake_failed(server: &impl fmt::Display, e: fred::error::Error) -> Error {
    let said = e.details();
    let meaning = [
        (
            "UnknownIssuer",
            "the server's certificate is not signed by a CA this client trusts: give its CA \
             with TlsOptions::ca_file or ca_pem",
        ),
        (
            "NotValidForName",
            "the server's certificate does not name the URL's host: connect by a name it \
             has, or set TlsOptions::server_name",
        ),
        (
            "CertificateRequired",
            "the server wants a client certificate: give one with \
             TlsOptions::identity_files or identity_pem",
        ),
        (
            "BadSignature",
            "the server's certificate does not carry the signature of the trusted CA of that \
             name (a CA made again with a new key?)",
        ),
        ("Expired", "a certificate has expired"),
        (
            "BadCertificate",
            "the server refused the client's certificate",
        ),
        (
            "UnknownCA",
            "the server does not trust the client certificate's CA",
        ),
    ]
    .into_iter()
    .find(|(word, _)| said.contains(word))
    .map_or("", |(_, meaning)| meaning);
    let sep = if meaning.is_empty() { "" } else { ": " };
    Error::backend(format!(
        "TLS connection to {server} failed{sep}{meaning} ({said})"
    ))
}

/// Whether a plain-text Redis answers at `address` before `deadline`: a `PING` gets `+PONG`
/// or an error reply (`-NOAUTH`, `-DENIED`) from one, and a TLS alert or nothing from a TLS
/// server.
async fn speaks_plain_text(address: &(String, u16), deadline: Instant) -> bool {
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect((address.0.as_str(), address.1)).await?;
        stream.write_all(b"PING\r\n").await?;
        let mut first = [0u8; 1];
        let n = stream.read(&mut first).await?;
        Ok::<_, std::io::Error>(n == 1 && matches!(first[0], b'+' | b'-'))
    };
    let left = deadline.saturating_duration_since(Instant::now());
    in_tokio(async { tokio::time::timeout(left, ask).await })
        .await
        .is_ok_and(|answer| answer.unwrap_or(false))
}
