//! Which client carries the Redis backends that tests make: fred, or redis-rs when
//! `REDLEASE_TEST_TRANSPORT=redis-rs` (the crate's `redis-rs` feature on). `.ci/run` runs
//! the cluster and fault suites once more that way; the conformance suite has modules of its
//! own for each client.

use redlease::{RedisOptions, Transport};

/// The client named by `REDLEASE_TEST_TRANSPORT` (`fred`, the default, or `redis-rs`).
pub fn transport() -> Transport {
    match std::env::var("REDLEASE_TEST_TRANSPORT").as_deref() {
        Err(_) | Ok("") | Ok("fred") => Transport::Fred,
        #[cfg(feature = "redis-rs")]
        Ok("redis-rs") => Transport::RedisRs,
        Ok(other) => panic!(
            "REDLEASE_TEST_TRANSPORT={other:?}: expected fred or redis-rs (the latter with \
             --features redis-rs)"
        ),
    }
}

/// Default options on [`transport`]'s client.
pub fn redis_options() -> RedisOptions {
    RedisOptions::new().transport(transport())
}
