//! What both binaries share: the test harness's redis-server spawner and its Redis Cluster
//! (one copy of the code, used by the tests too), and the polling helper the spawner calls as
//! `super::wait_for_interval`.

#[path = "../../tests/support/server.rs"]
pub mod server;

#[path = "../../tests/support/cluster.rs"]
pub mod cluster;

#[path = "../../tests/support/wait.rs"]
mod wait;
pub use wait::wait_for_interval;
