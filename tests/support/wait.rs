//! The polling helper the server harness calls (as `super::wait_for_interval`), in a file of
//! its own so that the benchmark's harness shares it too.

use std::time::{Duration, Instant};

/// Polls `f` every `interval` until it returns `true` or `timeout` elapses; whether it did
/// (`f` is always evaluated at least once, and once more at the deadline).
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
