//! The Redis server's errors, read: which may pass if a call is tried again soon (a
//! failover, a reconnect), and which say the server is a replica now.

use super::transport::Failure;
use crate::error::Error;

/// A client's failure as the crate's error: [`Unavailable`](crate::backend::Unavailable)
/// for one that may pass if the call is tried again soon (the connection, a timeout, a
/// failover or a resharding in progress, a server still loading), so that a waiting acquire
/// waits on through it; any other as it is.
pub(super) fn store_error(f: Failure) -> Error {
    if f.connection || passing(&f.said) {
        Error::backend(crate::backend::Unavailable(f.message))
    } else {
        Error::backend(f)
    }
}

/// Whether a server's error (a call's, or one entry's of a batch) says the server cannot
/// serve writes now but may soon: a failover or a resharding in progress, a server still
/// loading, too few replicas for `min-replicas-to-write`.
pub(super) fn passing(said: &str) -> bool {
    const PASSING: [&str; 7] = [
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "CLUSTERDOWN",
        "TRYAGAIN",
        "BUSY ",
        "NOREPLICAS",
    ];
    PASSING.iter().any(|p| said.starts_with(p))
}

/// Whether a server's error (a call's, or one entry's of a batch) says it is a replica now: a
/// primary demoted behind the connection's back (a failover that did not kill its clients, a
/// URL that names a fixed host).
pub(super) fn readonly(said: &str) -> bool {
    said.starts_with("READONLY")
}
