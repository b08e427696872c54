//! The faults the nemesis injects that need more than a signal: a server's wall clock shifted
//! (an `LD_PRELOAD` shim on the server process only), network partitions (network namespaces
//! and veth pairs), and delays, stalls and connection kills (a userspace TCP proxy).
//!
//! How each works, its limits and its clean-up: see each module, and `nemesis/shim/README`.
#![forbid(unsafe_code)]

pub mod clock;
pub mod net;
pub mod proxy;
#[cfg(test)]
mod testing;

pub use clock::{ClockOffset, ClockShim};
pub use net::Net;
pub use proxy::{Counters, DelayProxy};
