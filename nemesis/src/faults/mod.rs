//! The faults the nemesis injects that need more than a signal: a server's wall clock shifted
//! (an `LD_PRELOAD` shim on the server process only), network partitions (network namespaces
//! and veth pairs), and delays, stalls and connection kills (a userspace TCP proxy).
//!
//! How each works, its limits and its clean-up: see each module, and `nemesis/shim/README`.
//!
//! Put together: a server in host `a` with its clock shifted, reached by the harness's
//! clients from host `b` (so that cutting `a` from `b` cuts them off), with delays on top.
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! use std::net::SocketAddr;
//! use std::path::Path;
//! use std::process::Command;
//! use std::time::Duration;
//! use redlease_nemesis::faults::{ClockShim, DelayProxy, Net};
//!
//! let net = Net::new("nem", &["a", "b"])?;
//! let shim = ClockShim::build(Path::new("/tmp/nem"))?;
//! let clock = shim.offset(Path::new("/tmp/nem"), "a")?;
//! let mut server = Command::new(&net.exec_prefix("a")[0])
//!     .args(&net.exec_prefix("a")[1..])
//!     .args(["redis-server", "--bind", &net.addr("a").to_string(), "--protected-mode", "no"])
//!     .envs(clock.env())
//!     .spawn()?;
//! let rt = tokio::runtime::Runtime::new()?;
//! let _in = rt.enter();
//! let server_addr = SocketAddr::from((net.addr("a"), 6379));
//! let from_b = net.connector("b", server_addr, Duration::from_secs(5))?;
//! let proxy = DelayProxy::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), from_b)?;
//! // Clients use redis://{proxy.addr()}; then:
//! clock.set(30_000)?; // the server's clock 30 s ahead
//! net.cut("a", "b")?; // the clients stall, silently
//! net.heal_all()?;
//! proxy.set_delay(Duration::from_millis(50));
//! server.kill()?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod clock;
pub mod net;
pub mod proxy;
#[cfg(test)]
mod testing;

pub use clock::{ClockOffset, ClockShim};
pub use net::Net;
pub use proxy::{Counters, DelayProxy};
