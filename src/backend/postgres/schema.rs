//! The store's tables and functions (`schema.sql`), named after the options' schema and table
//! prefix, and created on first use under an advisory lock.

use super::PostgresOptions;

/// The schema's version, kept in the `meta` table.
pub(super) const VERSION: i32 = 1;

/// The statements the backend runs, one per operation (each one round trip).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stmt {
    Acquire,
    Release,
    Extend,
    RaiseFence,
    Inspect,
    CacheRead,
    CacheFill,
    CacheFail,
    CacheNotify,
}

impl Stmt {
    pub(super) const ALL: [Stmt; 9] = [
        Stmt::Acquire,
        Stmt::Release,
        Stmt::Extend,
        Stmt::RaiseFence,
        Stmt::Inspect,
        Stmt::CacheRead,
        Stmt::CacheFill,
        Stmt::CacheFail,
        Stmt::CacheNotify,
    ];
}

/// The names of one store's tables, functions and channel.
#[derive(Clone, Debug)]
pub(super) struct Names {
    /// `"schema".prefix`, before a table's or function's name.
    qualified: String,
    /// The bare prefix (for index names, which take no schema).
    prefix: String,
    schema: String,
    /// The notification channel (a release while waiters are registered).
    channel: String,
}

impl Names {
    pub(super) fn new(opts: &PostgresOptions) -> Self {
        Names {
            qualified: format!("\"{}\".{}", opts.schema, opts.table_prefix),
            prefix: opts.table_prefix.clone(),
            schema: opts.schema.clone(),
            channel: format!("{}{}released", opts.schema, opts.table_prefix),
        }
    }

    /// The SQL text of `stmt`.
    pub(super) fn sql(&self, stmt: Stmt) -> String {
        let q = &self.qualified;
        match stmt {
            Stmt::Acquire => {
                format!(
                    "SELECT code, val, lease, holds FROM \
                 {q}acquire($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
                )
            }
            Stmt::Release => format!("SELECT {q}release($1, $2, $3, $4, $5, $6, $7)"),
            Stmt::Extend => format!("SELECT * FROM {q}extend($1, $2, $3)"),
            Stmt::RaiseFence => format!("SELECT {q}raise_fence($1, $2)"),
            Stmt::Inspect => format!(
                "SELECT held, left_ms, fence, label, reentrant, shared, shared_labels, queued \
                 FROM {q}inspect($1)"
            ),
            Stmt::CacheRead => format!(
                "SELECT has, payload, delta_us, grace_ms, pttl, round, lease_pttl, failed, \
                 message, by_round, cooling FROM {q}cache_read($1, $2)"
            ),
            Stmt::CacheFill => format!("SELECT {q}cache_fill($1, $2, $3, $4, $5, $6, $7)"),
            Stmt::CacheFail => format!("SELECT {q}cache_fail($1, $2, $3, $4, $5, $6)"),
            Stmt::CacheNotify => format!("SELECT {q}notify($1, 'v')"),
        }
    }

    /// The script that creates (or upgrades) the schema: one transaction, under an advisory
    /// lock so that backends starting together do not race (two concurrent `CREATE OR
    /// REPLACE FUNCTION`s of one function can fail).
    pub(super) fn create(&self) -> String {
        let body = include_str!("schema.sql")
            .replace("Q_", &self.qualified)
            .replace("P_", &self.prefix)
            .replace("C_", &self.channel);
        format!(
            "BEGIN;\nSELECT pg_advisory_xact_lock(hashtext('redlease schema {schema}.{prefix}'));\n\
             CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n{body}\nCOMMIT;",
            schema = self.schema,
            prefix = self.prefix,
        )
    }

    /// The query that reads the schema's version (an error while it does not exist).
    pub(super) fn version(&self) -> String {
        format!("SELECT version FROM {}meta WHERE id = 1", self.qualified)
    }

    /// The statement that listens for releases.
    pub(super) fn listen(&self) -> String {
        format!("LISTEN \"{}\"", self.channel)
    }
}
