//! Reading a lock's record on a test server (the layout is documented in
//! `src/backend/redis/keys.rs`): one hash per lock at its key, with the holder's token `t`,
//! the lease's expiry `e` (server ms; `0` once released), the fencing counter `f`, the label
//! `h`, and the flags. The lease's time left is the server's: `e` against its `TIME`.

use super::server::RedisServer;

/// The server's clock in ms (TIME).
pub fn server_ms(srv: &RedisServer) -> i64 {
    let t = srv.cmd(&["TIME"]);
    let part = |i: usize| {
        t.as_array()
            .and_then(|a| a.get(i))
            .and_then(|v| v.as_int())
            .unwrap_or_else(|| panic!("TIME replied {t:?}"))
    };
    part(0) * 1000 + part(1) / 1000
}

/// A field of the record at `key`, `None` if absent (or no record).
pub fn field(srv: &RedisServer, key: &str, name: &str) -> Option<String> {
    srv.cmd(&["HGET", key, name]).as_str()
}

/// A numeric field of the record at `key`.
pub fn int_field(srv: &RedisServer, key: &str, name: &str) -> Option<i64> {
    field(srv, key, name).and_then(|v| v.parse().ok())
}

/// The lease at `key` read in one step on the server (a script, so that an extension cannot
/// land between the reads): its holder's token and ms left, or `None` when not held
/// (released, run out, or no record).
fn lease(srv: &RedisServer, key: &str) -> Option<(String, i64)> {
    let reply = srv.cmd(&["EVAL", LEASE, "1", key]);
    let parts = reply.as_array()?;
    match (
        parts.first().and_then(|t| t.as_str()),
        parts.get(1).and_then(|l| l.as_int()),
    ) {
        (Some(token), Some(left)) => Some((token, left)),
        _ => None,
    }
}

/// The script [`holder`] and [`lease_ms`] run (`EVAL LEASE 1 key`, for a test that polls on
/// a connection of its own): `{token, ms left}` while held, else nil.
pub const LEASE: &str = "local t = redis.call('TIME') \
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
        local r = redis.call('HMGET', KEYS[1], 't', 'e') \
        if r[1] and r[1] ~= '' and tonumber(r[2] or '0') > now then \
          return {r[1], tonumber(r[2]) - now} end \
        return false";

/// The token holding the lease at `key` now, `None` when free (released, run out, or no
/// record).
pub fn holder(srv: &RedisServer, key: &str) -> Option<String> {
    lease(srv, key).map(|(token, _)| token)
}

/// Whether a lease is held at `key` now.
pub fn held(srv: &RedisServer, key: &str) -> bool {
    lease(srv, key).is_some()
}

/// The lease's time left at `key` in ms, by the server's clock: -2 when not held (as PTTL
/// answers for a missing key).
pub fn lease_ms(srv: &RedisServer, key: &str) -> i64 {
    lease(srv, key).map_or(-2, |(_, left)| left)
}

/// Writes a record at `key` held by `token` for `ms`, as another client's grant would leave
/// it (a holder this test does not control).
pub fn plant(srv: &RedisServer, key: &str, token: &str, ms: i64) {
    let until = server_ms(srv) + ms;
    let reply = srv.cmd(&[
        "HSET",
        key,
        "t",
        token,
        "e",
        &until.to_string(),
        "x",
        &(until + 3_600_000).to_string(),
    ]);
    assert!(reply.as_int().is_some(), "HSET replied {reply:?}");
    assert_eq!(
        srv.cmd(&["PEXPIREAT", key, &(until + 3_600_000).to_string()])
            .as_int(),
        Some(1)
    );
}
