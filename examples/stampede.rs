//! Cache-stampede protection in a web handler: a burst of requests for a product page whose
//! cache entry is missing reaches the (fake, counted) database once, across three "servers"
//! that each have their own Redis connection.
//!
//! Uses Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); when no server answers, it
//! says so and runs on the in-process backend instead.
//!
//! ```text
//! cargo run --example stampede
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlease::{Cache, CacheOptions, Error, MemoryBackend, RedisBackend, RedisOptions};

/// The origin: a slow query, counted.
#[derive(Clone, Default)]
struct Database {
    queries: Arc<AtomicUsize>,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error("database: {0}")]
    Database(String),
    #[error(transparent)]
    Cache(#[from] Error),
}

impl Database {
    async fn product_json(&self, id: u32) -> Result<String, AppError> {
        self.queries.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await; // an expensive query
        if id == 0 {
            return Err(AppError::Database("connection reset by peer".into()));
        }
        Ok(format!(
            r#"{{"id":{id},"name":"desk lamp","price_cents":4999}}"#
        ))
    }
}

/// `GET /products/{id}`: (status, body), the shape of any web framework's handler.
async fn get_product(cache: &Cache, db: &Database, run: &str, id: u32) -> (u16, String) {
    let db = db.clone();
    let key = format!("product:{id}:{run}");
    let ttl = Duration::from_secs(60);
    match cache
        .try_get_with(&key, ttl, move || async move { db.product_json(id).await })
        .await
    {
        Ok(body) => (200, String::from_utf8_lossy(&body).into_owned()),
        Err(e) => match &*e {
            AppError::Cache(Error::Timeout { .. }) => (504, e.to_string()),
            _ => (503, e.to_string()),
        },
    }
}

/// Three caches, as three app servers would have: on Redis each with its own connection,
/// otherwise over one in-process store (which only coalesces within this process).
async fn servers(options: &CacheOptions) -> redlease::Result<Vec<Cache>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let connect = RedisOptions::new().connect_timeout(Duration::from_secs(2));
    let mut caches = Vec::new();
    match RedisBackend::connect_with(&url, connect.clone()).await {
        Ok(first) => {
            println!("using Redis at {url}");
            caches.push(Cache::with_options(first, options.clone())?);
            for _ in 1..3 {
                let backend = RedisBackend::connect_with(&url, connect.clone()).await?;
                caches.push(Cache::with_options(backend, options.clone())?);
            }
        }
        Err(e @ Error::InvalidConfig(_)) => return Err(e),
        Err(e) => {
            println!("no Redis answered at {url} ({e});");
            println!("running on the in-process MemoryBackend instead (one process only)");
            let memory = MemoryBackend::new();
            for _ in 0..3 {
                caches.push(Cache::with_options(memory.clone(), options.clone())?);
            }
        }
    }
    Ok(caches)
}

#[tokio::main]
async fn main() -> redlease::Result<()> {
    let options = CacheOptions::new().wait_timeout(Duration::from_secs(5));
    let caches = servers(&options).await?;
    let db = Database::default();
    // A fresh key per run, so that running the example again starts cold.
    let run = format!("{}", std::process::id());

    for (round, what) in [(1, "cold cache"), (2, "warm cache")] {
        let began = Instant::now();
        let before = db.queries.load(Ordering::SeqCst);
        let mut requests = Vec::new();
        for i in 0..300 {
            let (cache, db, run) = (caches[i % 3].clone(), db.clone(), run.clone());
            requests.push(tokio::spawn(async move {
                get_product(&cache, &db, &run, 42).await
            }));
        }
        let mut ok = 0;
        for r in requests {
            let (status, body) = r.await.expect("request task panicked");
            if status == 200 {
                ok += 1;
            } else {
                println!("{status}: {body}");
            }
        }
        println!(
            "round {round} ({what}): 300 requests over 3 servers -> {ok} x 200 OK, \
             {} database queries, {:?}",
            db.queries.load(Ordering::SeqCst) - before,
            began.elapsed()
        );
    }
    let (status, body) = get_product(&caches[0], &db, &run, 42).await;
    println!("GET /products/42 -> {status} {body}");
    // A failed query reaches its callers and is not cached: each request below retries.
    for _ in 0..2 {
        let (status, body) = get_product(&caches[1], &db, &run, 0).await;
        println!("GET /products/0 -> {status} {body}");
    }
    println!(
        "origin calls in total: {}",
        db.queries.load(Ordering::SeqCst)
    );
    Ok(())
}
