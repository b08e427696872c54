//! Where commands go: a connection of the backend's own that it opens again when it breaks
//! (tokio-postgres never reconnects), or an application's pool. Each operation's statement
//! is prepared once per connection, so that a call is one round trip.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row, Statement};

use super::schema::{Names, Stmt, VERSION};
use super::{pg_error, unavailable, Hub};
use crate::error::Result;
use crate::runtime::{self, in_tokio};

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

pub(super) enum Commands {
    Own(Box<Supervised>),
    Pool(Pooled),
}

/// The backend's own command connection.
pub(super) struct Supervised {
    config: tokio_postgres::Config,
    names: Names,
    sqls: Vec<String>,
    hub: Arc<Hub>,
    /// The open connection, if any; held while one is being opened, so that callers wait for
    /// that one rather than each opening their own.
    live: tokio::sync::Mutex<Option<Arc<Live>>>,
    /// Whether a connection was ever opened: each later one is a disturbance.
    opened: std::sync::atomic::AtomicBool,
}

struct Live {
    client: Client,
    statements: Vec<Statement>,
}

/// An application's pool.
pub(super) struct Pooled {
    pool: deadpool_postgres::Pool,
    names: Names,
    sqls: Vec<String>,
    /// Whether the schema is known to be there; cleared when a statement finds it gone (a
    /// wiped or restored database), so that the next call makes it again.
    schema: std::sync::atomic::AtomicBool,
}

impl Commands {
    pub(super) fn own(config: tokio_postgres::Config, names: &Names, hub: Arc<Hub>) -> Self {
        Commands::Own(Box::new(Supervised {
            config,
            names: names.clone(),
            sqls: Stmt::ALL.iter().map(|s| names.sql(*s)).collect(),
            hub,
            live: tokio::sync::Mutex::new(None),
            opened: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    pub(super) fn pool(pool: deadpool_postgres::Pool, names: &Names) -> Self {
        Commands::Pool(Pooled {
            pool,
            names: names.clone(),
            sqls: Stmt::ALL.iter().map(|s| names.sql(*s)).collect(),
            schema: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub(super) fn is_pool(&self) -> bool {
        matches!(self, Commands::Pool(_))
    }

    /// Opens a first connection (creating the schema), within `timeout`.
    pub(super) async fn ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let opened = async {
            match self {
                Commands::Own(s) => s.get().await.map(drop),
                Commands::Pool(p) => p.get().await.map(drop),
            }
        };
        match runtime::until(Some(deadline), in_tokio(opened)).await {
            Some(r) => r,
            None => Err(unavailable(format!(
                "postgres: no connection within {timeout:?}"
            ))),
        }
    }

    /// Runs `stmt` with `params`, within `timeout`. A statement that times out is cancelled
    /// and its connection closed (a command queued behind it would wait as long).
    pub(super) async fn query(
        &self,
        stmt: Stmt,
        params: Params<'_>,
        timeout: Duration,
    ) -> Result<Vec<Row>> {
        let deadline = Instant::now() + timeout;
        let late = || unavailable(format!("postgres: no answer within {timeout:?}"));
        match self {
            Commands::Own(s) => {
                let live = runtime::until(Some(deadline), in_tokio(s.get()))
                    .await
                    .ok_or_else(late)??;
                let index = stmt as usize;
                let ran = in_tokio(live.client.query(&live.statements[index], params));
                match runtime::until(Some(deadline), ran).await {
                    Some(Ok(rows)) => Ok(rows),
                    Some(Err(e)) => {
                        if live.client.is_closed() || schema_gone(&e) {
                            // A schema dropped under the connection (its statements name
                            // functions that are gone): the next one makes it again.
                            s.discard(&live).await;
                        }
                        Err(pg_error(e))
                    }
                    None => {
                        s.discard(&live).await;
                        cancel(live.client.cancel_token());
                        Err(late())
                    }
                }
            }
            Commands::Pool(p) => {
                let client = runtime::until(Some(deadline), in_tokio(p.get()))
                    .await
                    .ok_or_else(late)??;
                let sql = &p.sqls[stmt as usize];
                let ran = in_tokio(async {
                    let statement = client.prepare_cached(sql).await?;
                    client.query(&statement, params).await
                });
                match runtime::until(Some(deadline), ran).await {
                    Some(Ok(rows)) => Ok(rows),
                    Some(Err(e)) => {
                        if schema_gone(&e) {
                            p.schema.store(false, std::sync::atomic::Ordering::Release);
                        }
                        Err(pg_error(e))
                    }
                    None => {
                        // Out of the pool: its next user would wait behind the statement.
                        let token = client.cancel_token();
                        drop(deadpool_postgres::Object::take(client));
                        cancel(token);
                        Err(late())
                    }
                }
            }
        }
    }
}

/// Whether `e` says the statement's objects are gone (undefined function or table, a plan
/// that no longer fits).
fn schema_gone(e: &tokio_postgres::Error) -> bool {
    e.code()
        .is_some_and(|c| matches!(c.code(), "42883" | "42P01" | "0A000" | "42704"))
}

/// Cancels whatever the connection runs, in the background (a statement still waiting for a
/// row lock then ends without committing; one that committed already stays committed).
fn cancel(token: tokio_postgres::CancelToken) {
    runtime::background().spawn(async move {
        let _ = token.cancel_query(NoTls).await;
    });
}

/// Creates the schema unless it is there at this version.
async fn ensure_schema(client: &Client, names: &Names) -> Result<()> {
    let current: Option<i32> = match client.query_opt(&names.version(), &[]).await {
        Ok(row) => row.and_then(|r| r.try_get(0).ok()),
        Err(_) => None,
    };
    if current.is_some_and(|v| v >= VERSION) {
        return Ok(());
    }
    client
        .batch_execute(&names.create())
        .await
        .map_err(pg_error)
}

impl Supervised {
    /// The open connection, opening one (on the crate's runtime, so that it outlives the
    /// caller's) if there is none or it broke.
    async fn get(&self) -> Result<Arc<Live>> {
        let mut slot = self.live.lock().await;
        if let Some(live) = slot.as_ref().filter(|l| !l.client.is_closed()) {
            return Ok(live.clone());
        }
        *slot = None;
        let (tx, rx) = futures::channel::oneshot::channel();
        let config = self.config.clone();
        // The config's connect timeout bounds the socket's connect only: a paused server
        // accepts the socket and never answers the start-up, so the whole of it is bounded.
        let limit = config
            .get_connect_timeout()
            .copied()
            .unwrap_or(Duration::from_secs(5));
        runtime::background().spawn(async move {
            match tokio::time::timeout(limit, config.connect(NoTls)).await {
                Ok(Ok((client, connection))) => {
                    if tx.send(Ok(client)).is_ok() {
                        let _ = connection.await;
                    }
                }
                Ok(Err(e)) => {
                    let _ = tx.send(Err(pg_error(e)));
                }
                Err(_) => {
                    let _ = tx.send(Err(unavailable(format!(
                        "postgres: no connection within {limit:?}"
                    ))));
                }
            }
        });
        let client = match rx.await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(unavailable("postgres: the connection task ended")),
        };
        ensure_schema(&client, &self.names).await?;
        let prepared =
            futures::future::join_all(self.sqls.iter().map(|sql| client.prepare(sql))).await;
        let statements = prepared
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(pg_error)?;
        let live = Arc::new(Live { client, statements });
        *slot = Some(live.clone());
        if self.opened.swap(true, std::sync::atomic::Ordering::Relaxed) {
            // Opened again: whatever the server did meanwhile, the watchdog checks now.
            self.hub.disturbed.notify(usize::MAX);
        }
        Ok(live)
    }

    /// Closes `live` if it is still the open connection.
    async fn discard(&self, live: &Arc<Live>) {
        let mut slot = self.live.lock().await;
        if slot.as_ref().is_some_and(|l| Arc::ptr_eq(l, live)) {
            *slot = None;
        }
    }
}

impl Pooled {
    async fn get(&self) -> Result<deadpool_postgres::Object> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| unavailable(format!("postgres pool: {e}")))?;
        // Made under the schema's advisory lock and only if missing: two calls that both
        // find it unknown make it once.
        if !self.schema.load(std::sync::atomic::Ordering::Acquire) {
            ensure_schema(&client, &self.names).await?;
            self.schema
                .store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(client)
    }
}
