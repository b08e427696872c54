//! The test suite's redis-server spawner, Redis Cluster and Sentinel deployment (one copy of
//! the code, shared with the tests and the benchmark), and the polling helper they call as
//! `super::wait_for_interval`.

#[path = "../../tests/support/server.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
pub mod server;

#[path = "../../tests/support/cluster.rs"]
#[allow(
    dead_code,
    unreachable_pub,
    missing_docs,
    missing_debug_implementations
)]
pub mod cluster;

#[path = "../../tests/support/sentinel.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
pub mod sentinel;

#[path = "../../tests/support/wait.rs"]
mod wait;
pub use wait::wait_for_interval;
