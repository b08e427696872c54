//! The main example: two workers take turns on one lock.
//!
//! Uses Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); when no server answers, it
//! says so and runs on the in-process backend instead.
//!
//! ```text
//! cargo run --example quickstart
//! ```

mod common;

use std::time::Duration;

use redlease::{LockManager, LockOptions};

#[tokio::main]
async fn main() -> redlease::Result<()> {
    let backend = common::redis_or_memory().await?;
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(5)))?;

    let mut workers = Vec::new();
    for worker in 1..=2 {
        let lock = locks.lock("quickstart:report");
        workers.push(tokio::spawn(async move {
            for round in 1..=3 {
                // Waits until the lock is free; the watchdog keeps the lease alive meanwhile.
                let guard = lock.acquire().await?;
                println!(
                    "worker {worker} holds the lock (round {round}, fencing token {})",
                    guard.fencing_token()
                );
                tokio::time::sleep(Duration::from_millis(50)).await; // the critical section
                guard.release().await?; // or just drop the guard
            }
            Ok::<_, redlease::Error>(())
        }));
    }
    for w in workers {
        w.await.expect("worker panicked")?;
    }

    // Contention is not an error: try_acquire says None.
    let held = locks.lock("quickstart:report").acquire().await?;
    let other = locks.lock("quickstart:report").try_acquire().await?;
    println!(
        "while held, try_acquire gives {:?}",
        other.map(|g| g.fencing_token())
    );
    drop(held); // released in the background
    println!("done");
    Ok(())
}
