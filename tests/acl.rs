//! An ACL user with narrow pub/sub rights: told at connect (a warning, and
//! `RedisBackend::wakes_by_message`), and its locks still work, waiters finding a release by
//! their fallback re-check.

mod support;

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use redlease::{LockManager, LockOptions, RedisBackend, RetryPolicy};
use support::{field, wait_for_async, RedisServer};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Generous bound for what must happen "soon": failing it means a hang, not slowness.
const SOON: Duration = Duration::from_secs(10);

/// Every warning logged in this test binary, as `field=value` text.
fn warnings() -> &'static Mutex<Vec<String>> {
    static WARNINGS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    WARNINGS.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(Capture);
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        Mutex::default()
    })
}

/// The warnings that name `server` (tests run in parallel, each with its own server).
fn warnings_about(server: &RedisServer) -> Vec<String> {
    let port = format!("127.0.0.1:{}", server.port());
    let all = warnings().lock().unwrap_or_else(|p| p.into_inner());
    all.iter().filter(|w| w.contains(&port)).cloned().collect()
}

struct Capture;

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            let mut text = Text(String::new());
            event.record(&mut text);
            warnings()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(text.0);
        }
    }
}

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

/// A server with the ACL user `app` (password `pw`, every key and command) given `rules`.
fn server_with_user(rules: &[&str]) -> (RedisServer, String) {
    let mut args = vec!["--user", "app", "on", ">pw", "~*", "+@all"];
    args.extend_from_slice(rules);
    let srv = RedisServer::start_with(&args);
    let url = format!("redis://app:pw@127.0.0.1:{}", srv.port());
    (srv, url)
}

async fn connect(url: &str) -> RedisBackend {
    let _ = warnings(); // installed before anything can log
    tokio::time::timeout(SOON, RedisBackend::connect(url))
        .await
        .expect("connect must not hang")
        .expect("connects")
}

/// A holder, a waiter that registers as one on the server, the holder's release, and the
/// waiter's grant: all must work for a user whatever its pub/sub rights. The waiter's fallback
/// re-check is short, as a user who knows that its waiters poll would set it.
async fn hand_over(srv: &RedisServer, backend: RedisBackend) {
    let options =
        LockOptions::new().retry(RetryPolicy::notify().max_delay(Duration::from_millis(50)));
    let locks = LockManager::with_options(backend, options).unwrap();
    let lock = locks.lock("acl");
    let held = lock.acquire().await.unwrap();
    let waiter = {
        let lock = lock.clone();
        tokio::spawn(async move { lock.acquire_timeout(SOON).await })
    };
    // The waiter has asked the server for a release message (the release then PUBLISHes).
    let key = lock.key().as_str().to_owned();
    let registered = wait_for_async(SOON, || field(srv, &key, "w").is_some()).await;
    assert!(registered, "the waiter registered");
    held.release().await.expect("the release works");
    let granted = tokio::time::timeout(SOON, waiter).await;
    let granted = granted.expect("the waiter is not left waiting").unwrap();
    granted
        .expect("the waiter gets the lock")
        .release()
        .await
        .unwrap();
}

/// A user whose ACL refuses SUBSCRIBE connected silently, its waiters polling (a hand-off
/// took 637 ms instead of 1.4 ms): now it is told at connect, and locks still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_who_may_not_subscribe_is_told_at_connect_and_locks_still_work() {
    let (srv, url) = server_with_user(&["&*", "-subscribe"]);
    let backend = connect(&url).await;
    assert!(!backend.wakes_by_message());
    let said = warnings_about(&srv);
    assert!(
        said.iter()
            .any(|w| w.contains("SUBSCRIBE") && w.contains("app")),
        "a warning names the refused command and the user: {said:?}"
    );
    hand_over(&srv, backend).await;
}

/// Without the lock channels (`resetchannels`, the default for a user made in Redis 7), the
/// release's PUBLISH was refused and failed the release itself; now the message is dropped,
/// the release works, the waiter finds the lock by its re-check, and the user is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_the_channels_still_releases_to_waiters() {
    let (srv, url) = server_with_user(&["resetchannels"]);
    let backend = connect(&url).await;
    assert!(!backend.wakes_by_message());
    let said = warnings_about(&srv);
    assert!(
        said.iter()
            .any(|w| w.contains("PUBLISH") && w.contains("NOPERM")),
        "a warning names the refused PUBLISH and the server's words: {said:?}"
    );
    hand_over(&srv, backend).await;
}

/// The control: a user with the channels is woken by message, and nothing is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_the_channels_is_woken_by_message_without_warnings() {
    let (srv, url) = server_with_user(&["&*"]);
    let backend = connect(&url).await;
    assert!(backend.wakes_by_message());
    assert_eq!(warnings_about(&srv), Vec::<String>::new());
    hand_over(&srv, backend).await;
}
