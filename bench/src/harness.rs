//! What both binaries share: the test harness's redis-server spawner (one copy of the code,
//! used by the tests too) and the polling helper it calls as `super::wait_for_interval`.

use std::time::{Duration, Instant};

#[path = "../../tests/support/server.rs"]
pub mod server;

/// Polls `f` every `interval` until it returns `true` or `timeout` passes; whether it did.
pub fn wait_for_interval(
    timeout: Duration,
    interval: Duration,
    mut f: impl FnMut() -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(interval.min(deadline - now));
    }
}
