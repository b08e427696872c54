//! What every example does first: connect to Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), or say that none answered and use the in-process backend.

use std::sync::Arc;
use std::time::Duration;

use redlease::{Backend, Error, MemoryBackend, RedisBackend, RedisOptions};

/// Redis if a server answers within 2 s; otherwise the in-process `MemoryBackend`, with a
/// message saying so. A malformed `REDIS_URL` is an error, not a fallback.
pub(crate) async fn redis_or_memory() -> redlease::Result<Arc<dyn Backend>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let options = RedisOptions::new().connect_timeout(Duration::from_secs(2));
    match RedisBackend::connect_with(&url, options).await {
        Ok(redis) => {
            println!("using Redis at {url}");
            Ok(Arc::new(redis))
        }
        Err(e @ Error::InvalidConfig(_)) => Err(e),
        Err(e) => {
            println!("no Redis answered at {url} ({e});");
            println!(
                "running on the in-process MemoryBackend instead (same API, one process only)"
            );
            Ok(Arc::new(MemoryBackend::new()))
        }
    }
}
