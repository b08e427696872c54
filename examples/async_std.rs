//! redlease on async-std: two tasks on async-std's executor take turns on one lock.
//!
//! async-std is discontinued upstream; smol is its successor (see `examples/smol.rs`). The
//! `async-std` feature keeps working for programs that still run on it.
//!
//! Build with the `async-std` feature. fred (the Redis client) needs tokio underneath;
//! redlease runs it on a private tokio thread, so the program itself only uses async-std.
//!
//! Uses Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); when no server answers, it
//! says so and runs on the in-process backend instead.
//!
//! ```text
//! cargo run --example async_std --no-default-features --features async-std
//! ```

mod common;

use std::time::Duration;

use redlease::{LockManager, LockOptions};

fn main() -> redlease::Result<()> {
    async_std::task::block_on(async {
        let backend = common::redis_or_memory().await?;
        let locks =
            LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(5)))?;

        // Two tasks on async-std's executor take the same lock, one after the other.
        let tasks: Vec<_> = (1..=2)
            .map(|task| {
                let lock = locks.lock("examples:async-std");
                async_std::task::spawn(async move {
                    let guard = lock.acquire().await?; // waits while the other task holds it
                    println!(
                        "task {task} holds the lock, fencing token {}",
                        guard.fencing_token()
                    );
                    async_std::task::sleep(Duration::from_millis(50)).await; // the critical section
                    guard.release().await
                })
            })
            .collect();
        for t in tasks {
            t.await?;
        }

        // Contention is not an error: try_acquire says None.
        let held = locks.lock("examples:async-std").acquire().await?;
        let other = locks.lock("examples:async-std").try_acquire().await?;
        println!(
            "while held, try_acquire gives {:?}",
            other.map(|g| g.fencing_token())
        );
        held.release().await?;
        println!("done");
        Ok(())
    })
}
