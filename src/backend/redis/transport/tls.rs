//! `TlsOptions` (feature `tls`): whom to trust, the client's certificate, the name to check.
//! Each client turns them into its own TLS settings (`fred/tls.rs`, `redis_rs.rs`).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{Error, Result};

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
    /// sends it as SNI, instead of the URL's host; on a Redis Cluster, for every node. On
    /// the redis-rs transport it is refused at connect with
    /// [`Error::Unsupported`](crate::Error::Unsupported): redis-rs checks the URL's host only.
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

    /// The CA certificates' PEM text and where it came from (for messages), if given;
    /// files are read here (call it where blocking is allowed).
    pub(in crate::backend::redis) fn ca_text(&self) -> Result<Option<(Vec<u8>, String)>> {
        self.ca
            .as_ref()
            .map(|ca| Ok((ca.read("CA")?, format!("{ca:?}"))))
            .transpose()
    }

    /// The client's certificate chain and key as PEM text, each with where it came from, if
    /// given (read as [`ca_text`](Self::ca_text)).
    #[allow(clippy::type_complexity)]
    pub(in crate::backend::redis) fn identity_text(
        &self,
    ) -> Result<Option<((Vec<u8>, String), (Vec<u8>, String))>> {
        let Some((chain, key)) = &self.identity else {
            return Ok(None);
        };
        let chain_text = chain.read("client certificate chain")?;
        let key_text = key.read("client key")?;
        Ok(Some((
            (chain_text, format!("{chain:?}")),
            (key_text, format!("{key:?}")),
        )))
    }

    /// The name the server's certificate is checked against, if not the URL's host.
    pub(in crate::backend::redis) fn name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }
}
