//! Tests of the shared test harness in `tests/support/` itself.

mod support;

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{wait_for, wait_for_async, Checker, RedisServer, Resp};

fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = e.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = e.downcast_ref::<&str>() {
        (*s).to_string()
    } else {
        String::from("<non-string panic>")
    }
}

#[test]
fn start_ping_set_get_round_trip() {
    let srv = RedisServer::start();
    assert_eq!(srv.url(), format!("redis://127.0.0.1:{}", srv.port()));
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
    assert!(srv.cmd(&["SET", "k", "v"]).is_ok());
    assert_eq!(srv.cmd(&["GET", "k"]), Resp::Bulk(Some(b"v".to_vec())));
    assert_eq!(srv.cmd(&["GET", "k"]).as_str().as_deref(), Some("v"));
    assert!(srv.cmd(&["GET", "missing"]).is_nil());
    assert_eq!(srv.cmd(&["INCR", "n"]).as_int(), Some(1));
    assert!(srv.cmd(&["NOSUCHCOMMAND"]).is_error());

    // Binary-safe arguments and replies.
    let bin: &[u8] = b"\x00\xff\r\n$*";
    assert!(srv.cmd_bytes(&[b"SET", b"bin", bin]).is_ok());
    assert_eq!(
        srv.cmd_bytes(&[b"GET", b"bin"]),
        Resp::Bulk(Some(bin.to_vec()))
    );

    // Arrays, including nested ones.
    srv.cmd(&["RPUSH", "l", "a", "b"]);
    assert_eq!(
        srv.cmd(&["LRANGE", "l", "0", "-1"]),
        Resp::Array(Some(vec![
            Resp::Bulk(Some(b"a".to_vec())),
            Resp::Bulk(Some(b"b".to_vec()))
        ]))
    );
    assert!(srv.cmd(&["BLPOP", "empty", "0.01"]).is_nil());

    // A Lua script that returns the key, like a lock script would.
    let r = srv.cmd(&["EVAL", "return redis.call('GET', KEYS[1])", "1", "k"]);
    assert_eq!(r.as_str().as_deref(), Some("v"));
}

#[test]
fn pause_and_resume() {
    let srv = RedisServer::start();
    srv.pause();
    let t = Instant::now();
    let r = srv.cmd_timeout(&["PING"], Duration::from_millis(200));
    assert!(r.is_err(), "PING answered while paused: {r:?}");
    assert!(t.elapsed() < Duration::from_secs(2));
    srv.resume();
    let r = srv.cmd_timeout(&["PING"], Duration::from_millis(1000));
    assert_eq!(r.expect("PING after resume"), Resp::Simple("PONG".into()));
}

#[test]
fn kill_and_restart_gives_empty_server_on_same_port() {
    let mut srv = RedisServer::start();
    let port = srv.port();
    let pid = srv.pid();
    assert!(srv.cmd(&["SET", "k", "v"]).is_ok());
    srv.kill();
    srv.kill(); // idempotent
    assert!(!srv.is_running());
    assert!(srv
        .cmd_timeout(&["PING"], Duration::from_millis(500))
        .is_err());
    srv.restart();
    assert_eq!(srv.port(), port);
    assert_ne!(srv.pid(), pid);
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
    assert_eq!(srv.cmd(&["DBSIZE"]), Resp::Int(0));
    assert!(srv.cmd(&["GET", "k"]).is_nil());

    // restart() on a running server kills it first.
    srv.cmd(&["SET", "k2", "v"]);
    srv.restart();
    assert_eq!(srv.port(), port);
    assert_eq!(srv.cmd(&["DBSIZE"]), Resp::Int(0));
}

#[test]
fn restart_keeping_data_reloads_the_aof_after_a_sigkill() {
    let mut srv = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let port = srv.port();
    assert!(srv.cmd(&["SET", "k", "v", "PX", "60000"]).is_ok());
    srv.restart_keeping_data();
    assert_eq!(srv.port(), port);
    assert_eq!(srv.cmd(&["GET", "k"]).as_str().as_deref(), Some("v"));
    let ttl = srv.cmd(&["PTTL", "k"]).as_int().unwrap_or(-1);
    assert!(ttl > 0 && ttl <= 60_000, "the expiry survives too: {ttl}");
}

#[test]
fn restart_while_paused() {
    let mut srv = RedisServer::start();
    srv.pause();
    srv.restart();
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
}

#[test]
fn kill_clients_kills_a_held_connection() {
    let srv = RedisServer::start();
    let mut held = srv.connect();
    assert_eq!(
        held.cmd(&["PING"]).expect("ping"),
        Resp::Simple("PONG".into())
    );
    assert!(srv.kill_clients() >= 1);
    assert!(held.cmd(&["PING"]).is_err(), "held connection survived");
    // The harness itself still works.
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
}

#[test]
fn kill_pubsub_clients_kills_a_subscriber() {
    let srv = RedisServer::start();
    let mut sub = srv.connect();
    let r = sub.cmd(&["SUBSCRIBE", "ch"]).expect("subscribe");
    assert_eq!(r.as_array().map(|a| a.len()), Some(3));
    let mut normal = srv.connect();
    assert_eq!(srv.cmd(&["PUBLISH", "ch", "hi"]), Resp::Int(1));
    let msg = sub.read_reply().expect("message");
    assert_eq!(
        msg.as_array().and_then(|a| a[2].as_str()).as_deref(),
        Some("hi")
    );
    assert_eq!(srv.kill_pubsub_clients(), 1);
    assert!(sub.read_reply().is_err(), "subscriber survived");
    // Normal clients are spared.
    assert_eq!(
        normal.cmd(&["PING"]).expect("ping"),
        Resp::Simple("PONG".into())
    );
}

#[test]
fn requirepass_is_used_by_the_harness() {
    let srv = RedisServer::start_with(&["--requirepass", "s3cret"]);
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
    // A connection without AUTH is refused.
    let mut raw = support::Conn::connect(srv.port(), Duration::from_secs(2)).expect("connect");
    let r = raw.cmd(&["PING"]).expect("reply");
    assert!(
        matches!(&r, Resp::Error(e) if e.starts_with("NOAUTH")),
        "{r:?}"
    );
}

#[test]
fn acl_user_args() {
    let mut srv = RedisServer::start_with(&[
        "--user", "default", "off", "--user", "alice", "on", ">pw", "~*", "&*", "+@all",
    ]);
    srv.set_auth(Some("alice"), "pw");
    assert_eq!(
        srv.cmd(&["ACL", "WHOAMI"]).as_str().as_deref(),
        Some("alice")
    );
    srv.restart();
    assert_eq!(
        srv.cmd(&["ACL", "WHOAMI"]).as_str().as_deref(),
        Some("alice")
    );
}

#[test]
fn quiet_log_level_still_starts() {
    // Readiness falls back to checking INFO's process_id when the log is quiet.
    let mut srv = RedisServer::start_with(&["--loglevel", "warning"]);
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
    srv.restart();
    assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
}

#[test]
fn total_commands_counts() {
    let srv = RedisServer::start();
    let before = srv.total_commands();
    for _ in 0..5 {
        srv.cmd(&["PING"]);
    }
    let after = srv.total_commands();
    // 5 PINGs + the first INFO.
    assert_eq!(after - before, 6);
}

#[test]
fn wait_until_sees_expiry() {
    let srv = RedisServer::start();
    assert!(srv.cmd(&["SET", "k", "v", "PX", "100"]).is_ok());
    srv.wait_until(Duration::from_secs(5), |s| {
        s.cmd(&["EXISTS", "k"]) == Resp::Int(0)
    });
    let r = catch_unwind(AssertUnwindSafe(|| {
        srv.wait_until(Duration::from_millis(50), |_| false)
    }));
    assert!(panic_message(&*r.expect_err("must time out")).contains("timed out"));
}

#[test]
fn parallel_servers_get_distinct_ports() {
    let handles: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(|| {
                let srv = RedisServer::start();
                assert_eq!(srv.cmd(&["PING"]), Resp::Simple("PONG".into()));
                srv
            })
        })
        .collect();
    let servers: Vec<RedisServer> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    let ports: HashSet<u16> = servers.iter().map(|s| s.port()).collect();
    assert_eq!(ports.len(), servers.len());
}

#[test]
fn drop_kills_the_server_and_removes_its_dir() {
    let srv = RedisServer::start();
    let pid = srv.pid();
    let dir = srv.dir().to_path_buf();
    assert!(dir.join("redis.log").exists());
    srv.pause(); // dropping a paused server must work too
    drop(srv);
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert!(!dir.exists());
}

#[test]
fn checker_detects_overlap() {
    let c = Checker::new();
    let a = c.enter(1);
    let b = c.enter(2);
    assert_eq!(c.violations(), 1);
    b.exit();
    a.exit();
    assert_eq!(c.sections(), 2);
    let r = catch_unwind(AssertUnwindSafe(|| c.assert_ok()));
    assert!(panic_message(&*r.expect_err("overlap must fail")).contains("overlap"));
}

#[test]
fn checker_detects_non_increasing_tokens() {
    let c = Checker::new();
    c.enter(5).exit();
    c.enter(3).exit();
    assert_eq!(c.violations(), 0);
    assert_eq!(c.sections(), 2);
    let r = catch_unwind(AssertUnwindSafe(|| c.assert_ok()));
    let msg = panic_message(&*r.expect_err("decreasing token must fail"));
    assert!(msg.contains("strictly increasing"), "{msg}");

    let c = Checker::new();
    c.enter(4).exit();
    c.enter(4).exit();
    assert!(catch_unwind(AssertUnwindSafe(|| c.assert_ok())).is_err());
}

#[test]
fn checker_requires_a_section() {
    let c = Checker::new();
    assert!(catch_unwind(AssertUnwindSafe(|| c.assert_ok())).is_err());
}

#[test]
fn checker_accepts_real_mutual_exclusion() {
    let c = Checker::new();
    let lock = Arc::new(Mutex::new(()));
    let next = Arc::new(AtomicU64::new(1));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (c, lock, next) = (c.clone(), Arc::clone(&lock), Arc::clone(&next));
            std::thread::spawn(move || {
                for _ in 0..50 {
                    let _g = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let s = c.enter(next.fetch_add(1, Ordering::SeqCst));
                    std::hint::black_box(0);
                    s.exit();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    assert_eq!(c.sections(), 200);
    assert_eq!(c.violations(), 0);
    c.assert_ok();
}

#[test]
fn checker_section_drop_records_exit() {
    let c = Checker::new();
    {
        let _s = c.enter(1);
    }
    assert_eq!(c.sections(), 1);
    let _s2 = c.enter(2);
    assert_eq!(c.violations(), 0);
}

#[test]
fn wait_for_polls() {
    let flag = Arc::new(AtomicBool::new(false));
    let f2 = Arc::clone(&flag);
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        f2.store(true, Ordering::SeqCst);
    });
    assert!(wait_for(Duration::from_secs(5), || flag.load(Ordering::SeqCst)));
    t.join().expect("thread");
    let start = Instant::now();
    assert!(!wait_for(Duration::from_millis(50), || false));
    assert!(start.elapsed() >= Duration::from_millis(50));
}

#[tokio::test]
async fn wait_for_async_on_current_thread_runtime() {
    let flag = Arc::new(AtomicBool::new(false));
    let f2 = Arc::clone(&flag);
    // A task on the same (single-threaded) runtime must get to run.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        f2.store(true, Ordering::SeqCst);
    });
    assert!(wait_for_async(Duration::from_secs(5), || flag.load(Ordering::SeqCst)).await);
    assert!(!wait_for_async(Duration::from_millis(30), || false).await);
}
