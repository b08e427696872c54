//! Where a test's leases live, in memory or on a Redis server the test started, so that one
//! test body runs on both; and a bounded wait for the things that must happen soon.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redlease::{Backend, LockManager, LockOptions, MemoryBackend, RedisBackend, RedisOptions};

use super::RedisServer;

/// Generous bound for things that must happen "soon": failing it means a hang, not slowness.
pub const SOON: Duration = Duration::from_secs(10);

/// Awaits `fut`, failing the test (naming `what`) if it takes longer than [`SOON`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(SOON, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {SOON:?}"))
}

/// The store of a test. On Redis each manager has its own connections, as separate
/// processes would; in memory the managers share one store.
pub enum Store {
    Memory(MemoryBackend),
    Redis(Arc<RedisServer>),
    /// A PostgreSQL server (each manager its own connections).
    #[cfg(feature = "postgres")]
    Postgres(Arc<super::PgServer>),
}

impl Store {
    pub fn memory() -> Self {
        Store::Memory(MemoryBackend::new())
    }

    pub fn redis() -> Self {
        Store::Redis(Arc::new(RedisServer::start()))
    }

    #[cfg(feature = "postgres")]
    pub fn postgres() -> Self {
        Store::Postgres(Arc::new(super::PgServer::start()))
    }

    /// The server, on Redis.
    pub fn server(&self) -> Option<&Arc<RedisServer>> {
        match self {
            Store::Memory(_) => None,
            Store::Redis(srv) => Some(srv),
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => None,
        }
    }

    /// The server, on PostgreSQL.
    #[cfg(feature = "postgres")]
    pub fn pg(&self) -> Option<&Arc<super::PgServer>> {
        match self {
            Store::Postgres(srv) => Some(srv),
            _ => None,
        }
    }

    /// A backend of its own (on Redis: its own connections, short timeouts).
    pub async fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Store::Memory(m) => Arc::new(m.clone()),
            Store::Redis(srv) => {
                let opts = super::redis_options()
                    .command_timeout(Duration::from_millis(500))
                    .connect_timeout(Duration::from_secs(2));
                Arc::new(
                    RedisBackend::connect_with(&srv.url(), opts)
                        .await
                        .unwrap_or_else(|e| panic!("connect to {}: {e}", srv.url())),
                )
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(srv) => Arc::new(
                srv.backend_with(
                    redlease::PostgresOptions::new()
                        .command_timeout(Duration::from_millis(500))
                        .connect_timeout(Duration::from_secs(2)),
                )
                .await,
            ),
        }
    }

    /// A manager of its own (own backend, own watchdog).
    pub async fn manager(&self, options: LockOptions) -> LockManager {
        LockManager::with_options(self.backend().await, options).expect("valid options")
    }
}
