//! redlease on tokio: two tasks take turns on one lock, then a guard is moved into a spawned
//! task whose work races the lease's `lost()` signal with `tokio::select!`.
//!
//! Uses Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); when no server answers, it
//! says so and runs on the in-process backend instead.
//!
//! ```text
//! cargo run --example tokio
//! ```

mod common;

use std::time::Duration;

use redlease::{LockManager, LockOptions};

#[tokio::main]
async fn main() -> redlease::Result<()> {
    let backend = common::redis_or_memory().await?;
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(5)))?;

    // Two tasks on tokio's executor take the same lock, one after the other.
    let mut tasks = Vec::new();
    for task in 1..=2 {
        let lock = locks.lock("examples:tokio");
        tasks.push(tokio::spawn(async move {
            let guard = lock.acquire().await?; // waits while the other task holds it
            println!(
                "task {task} holds the lock, fencing token {}",
                guard.fencing_token()
            );
            tokio::time::sleep(Duration::from_millis(50)).await; // the critical section
            guard.release().await
        }));
    }
    for t in tasks {
        t.await.expect("task panicked")?;
    }

    // A guard is `Send + 'static`: move it into a spawned task. The work races the lease's
    // lost signal, so it stops if the lease can no longer be guaranteed (Redis unreachable
    // past the TTL, or the key taken over).
    let guard = locks.lock("examples:tokio").acquire().await?;
    let job = tokio::spawn(async move {
        let fencing_token = guard.fencing_token();
        let work = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            fencing_token // send it with every write to the protected resource
        };
        tokio::select! {
            written = work => {
                println!("job finished under fencing token {written}");
                guard.release().await
            }
            () = guard.lost() => {
                println!("lease lost: stopping without committing");
                Err(redlease::Error::NotHeld)
            }
        }
    });
    job.await.expect("job panicked")?;
    println!("done");
    Ok(())
}
