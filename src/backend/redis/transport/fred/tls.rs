//! TLS for `rediss://` on fred (feature `tls`): the rustls configuration made from
//! [`TlsOptions`], and the first connection, which tells a server that does not speak TLS from
//! one that is slow.

use std::fmt;
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

use super::super::tls::TlsOptions;
use crate::error::{Error, Result};
use crate::runtime::{self, in_tokio};

impl TlsOptions {
    /// Gives `config` (from a TLS URL) these settings: the rustls configuration, and the
    /// server name. Files and the system's roots are read on a blocking thread.
    pub(super) async fn apply(&self, config: &mut Config) -> Result<()> {
        let name = match self.name() {
            Some(name) => {
                ServerName::try_from(name).map_err(|_| {
                    Error::invalid(format!(
                        "TLS server name {name:?} is neither a DNS name nor an IP address"
                    ))
                })?;
                Some(fred::bytes_utils::Str::from(name))
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
        let Some(((chain, chain_source), (key, key_source))) = self.identity_text()? else {
            return Ok(builder.with_no_client_auth());
        };
        let chain = certificates(&chain, &chain_source, "client certificate chain")?;
        let key = PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
            Error::invalid(format!(
                "TLS client key {key_source}: {e} (expected a -----BEGIN PRIVATE KEY----- section, \
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
        if let Some((ca, source)) = self.ca_text()? {
            for cert in certificates(&ca, &source, "CA")? {
                roots.add(cert).map_err(|e| {
                    Error::invalid(format!("TLS CA {source}: not a usable certificate: {e}"))
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
fn certificates(pem: &[u8], source: &str, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::invalid(format!("TLS {what} {source}: {e}")))?;
    if certs.is_empty() {
        return Err(Error::invalid(format!(
            "TLS {what} {source}: no certificate found (expected a -----BEGIN CERTIFICATE----- \
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
