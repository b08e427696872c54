//! `rediss://` against redis-server TLS ports (`--port 0 --tls-port`), with a throw-away
//! certificate authority made at run time: a private CA to trust, client certificates for
//! `tls-auth-clients yes`, an explicit server name, a plain-text port named as such at once,
//! and bad PEM refused with `Error::InvalidConfig`.

mod support;

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use redlease::{Error, LockManager, RedisBackend, RedisOptions, TlsOptions};
use support::{scratch_dir, RedisServer, ScratchDir};

/// Bounds a connect: returning at all is what is tested, not speed.
async fn connect(url: &str, options: RedisOptions) -> redlease::Result<RedisBackend> {
    tokio::time::timeout(
        Duration::from_secs(20),
        RedisBackend::connect_with(url, options),
    )
    .await
    .expect("connect must fail or succeed, not hang")
}

/// A certificate authority made for one test, and the files it signed, in a private
/// directory removed at the end.
struct Pki {
    dir: ScratchDir,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Pki {
    fn new() -> Pki {
        Pki::named("redlease test CA")
    }

    /// A CA whose certificate has the common name `name`.
    fn named(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.distinguished_name.push(DnType::CommonName, name);
        let ca_key = KeyPair::generate().unwrap();
        let ca = params.self_signed(&ca_key).unwrap();
        let pki = Pki {
            dir: scratch_dir(),
            ca,
            ca_key,
        };
        fs::write(pki.path("ca.crt"), pki.ca.pem()).unwrap();
        pki
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses) for `purpose`, signed by the CA:
    /// (certificate PEM, key PEM), also written to `<stem>.crt` and `<stem>.key`.
    fn issue(
        &self,
        stem: &str,
        names: &[&str],
        purpose: ExtendedKeyUsagePurpose,
    ) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = vec![purpose];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let (cert, key) = (cert.pem(), key.serialize_pem());
        fs::write(self.path(&format!("{stem}.crt")), &cert).unwrap();
        fs::write(self.path(&format!("{stem}.key")), &key).unwrap();
        (cert, key)
    }

    /// A client certificate signed by the CA, as `trust` plus its files and plus its PEM
    /// text.
    fn client_identity(&self, trust: &TlsOptions) -> (TlsOptions, TlsOptions) {
        let (cert, key) = self.issue(
            "client",
            &["client.test"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let files = trust
            .clone()
            .identity_files(self.path("client.crt"), self.path("client.key"));
        (files, trust.clone().identity_pem(cert, key))
    }

    /// A redis-server whose only port speaks TLS, with a certificate for `names`; with
    /// `auth_clients`, it requires a client certificate signed by the CA.
    fn server(&self, names: &[&str], auth_clients: bool) -> RedisServer {
        let stem = format!("server-{}", names.join("-"));
        self.issue(&stem, names, ExtendedKeyUsagePurpose::ServerAuth);
        let (cert, key, ca) = (
            self.path(&format!("{stem}.crt")),
            self.path(&format!("{stem}.key")),
            self.path("ca.crt"),
        );
        let args = [
            "--tls-cert-file",
            cert.to_str().unwrap(),
            "--tls-key-file",
            key.to_str().unwrap(),
            "--tls-ca-cert-file",
            ca.to_str().unwrap(),
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ];
        RedisServer::start_tls(&args)
    }
}

fn url(srv: &RedisServer) -> String {
    format!("rediss://127.0.0.1:{}", srv.port())
}

/// Acquires and releases a lock, and has a waiter woken by the release (the pub/sub
/// connection speaks TLS too).
async fn round_trip(backend: RedisBackend) {
    assert!(
        backend.wakes_by_message(),
        "the subscriber connected over TLS"
    );
    let locks = LockManager::new(backend);
    let held = locks.lock("tls").acquire().await.unwrap();
    let waiter = {
        let lock = locks.lock("tls");
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(10)).await })
    };
    held.release().await.unwrap();
    let next = waiter.await.unwrap().expect("the waiter gets the lock");
    next.release().await.unwrap();
}

fn backend_message(r: redlease::Result<RedisBackend>) -> String {
    match r {
        Err(Error::Backend { source }) => source.to_string(),
        other => panic!("expected a backend error, got {other:?}"),
    }
}

fn invalid_message(r: redlease::Result<RedisBackend>) -> String {
    match r {
        Err(Error::InvalidConfig(msg)) => msg,
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// The private CA is what makes the difference: trusting another CA, the server's
/// certificate is refused at once, with a message that says so and what to set; trusting it
/// (file or PEM text), a lock round-trips.
#[tokio::test]
async fn a_client_trusting_the_private_ca_connects_and_a_lock_round_trips() {
    let pki = Pki::new();
    let srv = pki.server(&["127.0.0.1"], false);

    let started = Instant::now();
    let elsewhere =
        RedisOptions::new().tls(TlsOptions::new().ca_pem(Pki::named("another CA").ca_pem()));
    let refused = backend_message(connect(&url(&srv), elsewhere).await);
    assert!(
        refused.contains("not signed by a CA this client trusts") && refused.contains("ca_file"),
        "says the certificate's issuer is unknown, and what to do: {refused}"
    );
    assert!(
        started.elapsed() < RedisOptions::new().connect_timeout,
        "not a hang"
    );
    // The default, the system's roots, does not know the private CA either (a machine with
    // no roots at all is told so before anything is sent).
    match connect(&url(&srv), RedisOptions::new()).await {
        Err(Error::Backend { source }) => {
            assert!(source.to_string().contains("ca_file"), "{source}")
        }
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("no trusted root"), "{msg}"),
        other => panic!("the system's roots accepted a private CA: {other:?}"),
    }

    let by_file = RedisOptions::new().tls(TlsOptions::new().ca_file(pki.path("ca.crt")));
    round_trip(connect(&url(&srv), by_file).await.unwrap()).await;
    let by_pem = RedisOptions::new().tls(TlsOptions::new().ca_pem(pki.ca_pem()));
    round_trip(connect(&url(&srv), by_pem).await.unwrap()).await;
}

/// `tls-auth-clients yes`: without a client certificate the server's refusal is the error
/// (within the connect timeout); with one signed by the CA, locks work.
#[tokio::test]
async fn mutual_tls_needs_the_client_identity() {
    let pki = Pki::new();
    let srv = pki.server(&["127.0.0.1"], true);
    let trust = TlsOptions::new().ca_file(pki.path("ca.crt"));
    let timeout = Duration::from_secs(2);

    let started = Instant::now();
    let anonymous = RedisOptions::new()
        .connect_timeout(timeout)
        .tls(trust.clone());
    let refused = connect(&url(&srv), anonymous).await;
    let elapsed = started.elapsed();
    let refused = backend_message(refused);
    assert!(
        refused.contains("wants a client certificate") && refused.contains("identity_files"),
        "says a client certificate was wanted, and how to give one: {refused}"
    );
    assert!(elapsed < timeout, "took {elapsed:?}: not a hang");

    let (files, text) = pki.client_identity(&trust);
    round_trip(
        connect(&url(&srv), RedisOptions::new().tls(files))
            .await
            .unwrap(),
    )
    .await;
    round_trip(
        connect(&url(&srv), RedisOptions::new().tls(text))
            .await
            .unwrap(),
    )
    .await;
}

/// A certificate that names a host, reached by address: refused for the address, accepted
/// once the name to check is given.
#[tokio::test]
async fn an_explicit_server_name_is_checked_instead_of_the_host() {
    let pki = Pki::new();
    let srv = pki.server(&["redis.test"], false);
    let trust = TlsOptions::new().ca_pem(pki.ca_pem());

    let refused = connect(&url(&srv), RedisOptions::new().tls(trust.clone())).await;
    let refused = backend_message(refused);
    assert!(
        refused.contains("does not name the URL's host") && refused.contains("server_name"),
        "{refused}"
    );

    let named = RedisOptions::new().tls(trust.server_name("redis.test"));
    round_trip(connect(&url(&srv), named).await.unwrap()).await;
}

/// A plain-text Redis does not answer a TLS hello (it waits for the end of a line): the
/// handshake waited out the connect timeout (5 s) and said only "timeout". Now a plain-text
/// server is named as such, well within the timeout.
#[tokio::test]
async fn rediss_to_a_plain_text_port_says_so_within_the_connect_timeout() {
    let srv = RedisServer::start();
    let options = RedisOptions::new();
    let timeout = options.connect_timeout;
    let started = Instant::now();
    let msg = invalid_message(connect(&url(&srv), options).await);
    let elapsed = started.elapsed();
    assert!(msg.contains("did not speak TLS"), "{msg}");
    assert!(
        msg.contains(&srv.port().to_string()),
        "names the server: {msg}"
    );
    assert!(
        elapsed < timeout / 2,
        "took {elapsed:?} of the {timeout:?} timeout"
    );
}

/// Bad TLS input is `InvalidConfig` naming the part, before anything is sent (nothing
/// listens on port 1): never a panic, never a connection attempt.
#[tokio::test]
async fn bad_pem_and_names_are_invalid_config() {
    let pki = Pki::new();
    let (client_cert, client_key) = pki.issue(
        "client",
        &["client.test"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let (_, other_key) = pki.issue(
        "other",
        &["other.test"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let trust = || TlsOptions::new().ca_pem(pki.ca_pem());
    let truncated = pki.ca_pem().replace("-----END CERTIFICATE-----", "");
    let bad_base64 = "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
    let not_der = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    let cases: Vec<(TlsOptions, &str)> = vec![
        (
            TlsOptions::new().ca_pem("not PEM at all"),
            "no certificate found",
        ),
        (
            TlsOptions::new().ca_pem(client_key.clone()),
            "no certificate found",
        ),
        (TlsOptions::new().ca_pem(truncated), "CA"),
        (TlsOptions::new().ca_pem(bad_base64), "base64"),
        (
            TlsOptions::new().ca_pem(not_der),
            "not a usable certificate",
        ),
        (
            TlsOptions::new().ca_file(pki.path("missing.crt")),
            "missing.crt",
        ),
        (
            trust().identity_pem(client_cert.clone(), "garbage"),
            "client key",
        ),
        (
            trust().identity_pem("garbage", client_key.clone()),
            "client certificate chain",
        ),
        (
            trust().identity_pem(client_cert.clone(), other_key),
            "client identity",
        ),
        (
            trust().identity_files(pki.path("client.crt"), pki.path("nope.key")),
            "nope.key",
        ),
        (trust().server_name("not a name!"), "server name"),
    ];
    for (tls, needle) in cases {
        let shown = format!("{tls:?}");
        let options = RedisOptions::new().tls(tls);
        let msg = invalid_message(connect("rediss://127.0.0.1:1", options.clone()).await);
        assert!(
            msg.contains(needle),
            "{shown}: {msg:?} should mention {needle:?}"
        );
        let lazy = RedisBackend::connect_lazy("rediss://127.0.0.1:1", options).await;
        assert!(
            matches!(lazy, Err(Error::InvalidConfig(_))),
            "{shown}: {lazy:?}"
        );
    }
    // The key never shows in Debug.
    let shown = format!(
        "{:?}",
        trust().identity_pem(client_cert, client_key.clone())
    );
    let body = client_key.lines().nth(1).unwrap();
    assert!(!shown.contains(body), "{shown}");
    // TLS options with a plain URL would not encrypt: refused.
    let plain = RedisOptions::new().tls(trust());
    let msg = invalid_message(connect("redis://127.0.0.1:1", plain).await);
    assert!(msg.contains("rediss://"), "{msg}");
}

/// On the redis-rs transport (feature `redis-rs`): a server that wants a client certificate,
/// trusted through a private CA; locks round-trip with the identity given as files and as
/// text (the pub/sub connection speaks TLS too), a client without one is refused, and a
/// server name other than the host is refused as `Unsupported` (redis-rs cannot check
/// another name), naming the way out.
#[cfg(feature = "redis-rs")]
#[tokio::test]
async fn redis_rs_speaks_tls_with_a_private_ca_and_a_client_certificate() {
    use redlease::Transport;
    let on_redis_rs = || RedisOptions::new().transport(Transport::RedisRs);
    let pki = Pki::new();
    let srv = pki.server(&["127.0.0.1"], true);
    let trust = TlsOptions::new().ca_file(pki.path("ca.crt"));

    let anonymous = on_redis_rs()
        .connect_timeout(Duration::from_secs(2))
        .tls(trust.clone());
    assert!(
        matches!(
            connect(&url(&srv), anonymous).await,
            Err(Error::Backend { .. })
        ),
        "a client without a certificate was let in"
    );

    let (files, text) = pki.client_identity(&trust);
    let backend = connect(&url(&srv), on_redis_rs().tls(files)).await.unwrap();
    assert!(backend.client().is_none(), "redis-rs carries it");
    round_trip(backend).await;
    round_trip(connect(&url(&srv), on_redis_rs().tls(text)).await.unwrap()).await;

    let named = trust.server_name("redis.test");
    match connect(&url(&srv), on_redis_rs().tls(named)).await {
        Err(Error::Unsupported(m)) => {
            assert!(
                m.contains("server_name") && m.contains("Transport::Fred"),
                "{m}"
            )
        }
        other => panic!("server_name on redis-rs: expected Unsupported, got {other:?}"),
    }
}
