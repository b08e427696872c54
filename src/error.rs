//! The crate's one error type.

use std::time::Duration;

/// A boxed error from a backend, kept as the [`Error::Backend`] source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in redlease.
///
/// Contention is not an error: [`Lock::try_acquire`](crate::Lock::try_acquire) returns
/// `Ok(None)` when someone else holds the lock.
///
/// # Examples
///
/// ```
/// use redlease::{Error, LockManager, LockOptions, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::new(MemoryBackend::new());
/// let err = locks.lock("").acquire().await.unwrap_err();
/// assert!(matches!(err, Error::InvalidConfig(_)));
/// # });
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input: the message says what was wrong. Never retried.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The store cannot serve what was asked of it (a fair lock over a store without fair
    /// queues, say): refused when the lock is made, never at its first acquire. The message
    /// names the feature and the store.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The wait for the lock ran past its time limit; no lease is left behind.
    #[error("timed out after {waited:?} waiting for the lock")]
    Timeout {
        /// How long the caller waited.
        waited: Duration,
    },
    /// The lease is no longer held: it expired, was lost (see
    /// [`LockGuard::lost`](crate::LockGuard::lost)) or was released already.
    #[error("the lease is no longer held (it expired, was lost or was taken over)")]
    NotHeld,
    /// A [`Redlock`](crate::Redlock) could not get a majority of its nodes to answer: too
    /// many were down, slow, or had restarted too recently to count (contention is not this
    /// error: it is waited for, or `Ok(None)` from `try_acquire`). Nothing is left behind on
    /// the nodes that did grant.
    #[error("quorum not reached: {acquired} of the {required} nodes needed")]
    QuorumNotReached {
        /// Nodes that granted (or confirmed) in the best round.
        acquired: usize,
        /// The quorum: a majority of the nodes.
        required: usize,
    },
    /// The primary granted the lease (or extended it) but too few replicas acknowledged the
    /// write within the [`ReplicaAck`](crate::ReplicaAck) policy's timeout, so a failover
    /// could lose it: a grant is given back (a waiting acquire waits on, trying again), an
    /// extension counts as failed (tried again; the lease is lost at its deadline if none is
    /// acknowledged).
    #[error("not acknowledged by enough replicas: {why}")]
    NotAcknowledged {
        /// Replicas that acknowledged.
        acked: u32,
        /// Replicas the policy needs.
        required: u32,
        /// What was seen (the counts and the timeout, or a connection remade).
        why: String,
    },
    /// A cached value could not be computed here: the loader panicked or ran past its time
    /// limit, failed in another process (its message is kept), or its value could not be
    /// encoded or decoded. See [`Cache`](crate::Cache).
    #[error("the value could not be loaded: {message}")]
    LoadFailed {
        /// What went wrong, as the loader's process saw it.
        message: String,
    },
    /// The store failed (connection refused, command timeout, script error, ...).
    #[error("backend error: {source}")]
    Backend {
        /// What the store said.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Wraps a store's error as [`Error::Backend`] (for [`Backend`](crate::Backend) implementors).
    ///
    /// ```
    /// let e = redlease::Error::backend(std::io::Error::other("connection reset"));
    /// assert!(e.to_string().contains("connection reset"));
    /// ```
    pub fn backend(source: impl Into<BoxError>) -> Self {
        Error::Backend {
            source: source.into(),
        }
    }

    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        Error::InvalidConfig(what.into())
    }

    /// The same error again, for every variant but [`Error::Backend`] (whose source cannot
    /// be copied): for an error handed to several callers.
    pub(crate) fn copied(&self) -> Option<Error> {
        Some(match self {
            Error::InvalidConfig(m) => Error::InvalidConfig(m.clone()),
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::Timeout { waited } => Error::Timeout { waited: *waited },
            Error::NotHeld => Error::NotHeld,
            Error::QuorumNotReached { acquired, required } => Error::QuorumNotReached {
                acquired: *acquired,
                required: *required,
            },
            Error::NotAcknowledged {
                acked,
                required,
                why,
            } => Error::NotAcknowledged {
                acked: *acked,
                required: *required,
                why: why.clone(),
            },
            Error::LoadFailed { message } => Error::LoadFailed {
                message: message.clone(),
            },
            Error::Backend { .. } => return None,
        })
    }
}
