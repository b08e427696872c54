//! Reentrant locks: code that takes a lock calls other code that takes it again, for the same
//! owner, without deadlocking; another owner waits until the outermost hold is released.
//!
//! Uses Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); when no server answers, it
//! says so and runs on the in-process backend instead.
//!
//! ```text
//! cargo run --example reentrant
//! ```

mod common;

use std::time::Duration;

use redlease::{Lock, LockGuard, LockManager, LockOptions, Owner};

/// Moves money between accounts under the ledger lock, and writes an audit line, which takes
/// the ledger lock too: fine, it is the same owner.
async fn transfer(ledger: &Lock, amount: u32) -> redlease::Result<()> {
    let guard = ledger.acquire().await?;
    println!(
        "  transfer {amount}: holds {} (fencing token {})",
        holds(&guard),
        guard.fencing_token()
    );
    audit(ledger, amount).await?;
    let left = guard.release().await?;
    println!("  transfer {amount}: released, {left} hold(s) left");
    Ok(())
}

async fn audit(ledger: &Lock, amount: u32) -> redlease::Result<()> {
    let guard = ledger.acquire().await?; // nested: no deadlock
    println!("    audit {amount}: holds {}", holds(&guard));
    guard.release().await?;
    Ok(())
}

/// How many holds the owner had when this one was counted (this one included).
fn holds(guard: &LockGuard) -> u32 {
    guard
        .hold_count()
        .expect("a reentrant lock's guard counts its holds")
}

#[tokio::main]
async fn main() -> redlease::Result<()> {
    let backend = common::redis_or_memory().await?;
    let locks = LockManager::with_options(backend, LockOptions::new().ttl(Duration::from_secs(5)))?;

    // The owner is explicit: a task is not a thread. Here, one job; a second process working
    // on the same job could use `Owner::named("nightly-close")` and share the lock.
    let job = Owner::named("nightly-close");
    let ledger = locks.lock("example:ledger").reentrant(&job)?;
    println!("job {job:?}:");
    transfer(&ledger, 10).await?;

    // Another owner is kept out while the job holds the lock, however deeply nested.
    let outer = ledger.acquire().await?;
    let someone_else = locks.lock("example:ledger").reentrant(&Owner::random())?;
    let attempt = someone_else.try_acquire().await?;
    println!(
        "while the job holds it, another owner gets {:?}",
        attempt.map(|g| g.fencing_token())
    );
    // A plain lock on the same name is excluded too.
    let plain = locks.lock("example:ledger").try_acquire().await?;
    println!(
        "and a plain lock gets {:?}",
        plain.map(|g| g.fencing_token())
    );
    outer.release().await?;

    let theirs = someone_else.acquire().await?;
    println!(
        "after the job's last release, the other owner holds it (fencing token {})",
        theirs.fencing_token()
    );
    theirs.release().await?;
    Ok(())
}
