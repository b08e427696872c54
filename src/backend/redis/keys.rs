//! The Redis key layout: every key and channel a lock (or a cached value) uses, in one place.
//!
//! A lock `name` under prefix `p` (default `redlease:`) lives at `p{name}` (see
//! [`LeaseKey`]: the name is escaped so any name gives a distinct key with a non-empty hash
//! tag). Every key below shares that `{name}` hash tag, so each script touches one slot on
//! Redis Cluster.
//!
//! | key or channel | type | what |
//! |---|---|---|
//! | `p{name}` | hash | **the lock record**, below |
//! | `p{name}:abandoned` | sorted set | abandoned tokens → until when they are barred (an attempt given up, so that a late copy is never granted) |
//! | `p{name}:released` | channel | a release, for waiters (one local waiter woken per message) |
//! | `p{name}:queue` | list | fair waiters' tokens, oldest first |
//! | `p{name}:timeouts` | sorted set | fair waiters' tokens → deadline (server ms) |
//! | `p{name}:handoff` | channel | a release hands the lock to the queue's head: its token |
//! | `p{name}:owners` | hash | reentrant: {owner: hold count} of the reign holding the lease |
//! | `p{name}:holds` | hash | reentrant: the reign's live holds {hold token: the send number of the acquire that counted it}, plus `owner`, `token` (the lease token) and `fence` |
//! | `p{name}:shared` | sorted set | reads of a read-write lock, or a semaphore's permits: {hold token: its expiry (server ms)}; the last 1,000 released holds (and, on a name with shared holds in its hour, released exclusive leases) with a negative score (minus the release's time), for a re-sent release (see `prelude.lua`); lives until the record's `z` |
//! | `p{name}:sharers` | hash | the shared holds' {hold token: `'<fencing token>/<send number> <label>'`} (the number of the acquire that granted or last renewed it; written before send numbers: `'<fencing token> <label>'`, number 0) |
//! | `p{name}:writers` | sorted set | waiting plain claims (a read-write lock's writers): {token: until when (server ms) its preference runs}, at most 2.1 s past its last attempt; `v` is the latest; lives until `v` |
//! | `p{name}:value` | hash | the cache: `v` payload, `d` compute time (µs), `g` grace (ms), `r` the round that wrote it |
//! | `p{name}:filled` | channel | the cache: a value was written, or a round failed |
//! | `p{name}:failed:<round>` | string | the cache: a failed compute round's message |
//! | `p{name}:cooldown` | string | the cache: no background refresh until it expires |
//!
//! The record, one hash per lock, is what a plain cycle touches: a grant is one HMGET and one
//! HSET of it, a release one HMGET and one HSET (plus one TIME per script call). Its fields:
//!
//! | field | what |
//! |---|---|
//! | `t` | the token of the last grant (a reentrant reign's lease token); while shared holds run, their mode's marker, `*r` (reads) or `*p` (permits), which no token equals |
//! | `e` | until when (server ms) `t` holds the lease; `0` once `t` released it. The lease is held while `e` is ahead of the server's clock. While shared holds run, the latest of their expiries |
//! | `f` | the last fencing token |
//! | `h` | the holder's label (`''` for none), shown while held |
//! | `r` | the token released before `t` was granted, so a re-sent release still says "ours" |
//! | `n` | the send number (see "Send order" in `scripts/prelude.lua`) of the acquire that granted or last renewed `t`'s lease, or of the release that ended it: a release ends the lease only if it was sent after that acquire, and an acquire of `t` sent before that release is not granted; absent (0) in records written before send numbers |
//! | `m` | `n` as it was when `r` was released: an acquire of `r` sent before that release is not granted |
//! | `w` | until when (server ms) plain waiters want a message on release |
//! | `v` | until when (server ms) a plain claim (a read-write lock's writer) waits: new reads wait behind it. The latest of the waiters' leases in `:writers` (each at most 2.1 s past that waiter's last attempt, which renews it); lowered when a waiter gives up; `0` once a plain claim is granted |
//! | `s` | until when (server ms) shared waiters (reads, permits) want a message on release |
//! | `z` | until when (server ms) `:shared` and `:sharers` live: an hour past the latest shared hold, renewed when half of it is gone |
//! | `q` | until when (server ms) the fair queue may hold waiters |
//! | `a` | until when (server ms) some token is barred (look in `:abandoned`) |
//! | `x` | until when (server ms) the record itself lives: an hour past the lease, renewed when half of it is gone |
//!
//! Only the record's key is passed to the scripts; they derive the names beside it (with the
//! suffixes above) when a rare path needs them. All share the `{name}` hash tag, so a script
//! stays in one slot on a cluster; there a call also declares those names (after the locks'
//! keys, see [`BESIDE`]), so that a slot being migrated is answered before the script runs.
//!
//! Fencing tokens never go backwards: each grant mints at least last + 1 and at least the
//! server's clock in microseconds, so a restarted server without persistence (or a record
//! gone an hour after its last lease) still hands out larger tokens.
//!
//! The scripts in `scripts/` say per call which of these they read and write, and what
//! they return; `scripts/prelude.lua` holds the record's helpers they share.

use std::time::Duration;

use crate::token::LeaseKey;

/// The names beside a lock's key that the client uses (the scripts derive the others).
#[derive(Clone, Copy, Debug)]
pub(super) enum Part {
    Released,
    Handoff,
    /// The cache's value.
    Value,
    /// The cache's fill channel.
    Filled,
    /// The cache's failed rounds (`:failed:<round>`).
    Failed,
    /// The cache's refresh cooldown marker.
    Cooldown,
}

impl Part {
    fn suffix(self) -> &'static str {
        match self {
            Part::Released => "released",
            Part::Handoff => "handoff",
            Part::Value => "value",
            Part::Filled => "filled",
            Part::Failed => "failed",
            Part::Cooldown => "cooldown",
        }
    }
}

/// A name beside `key`, made when a call needs it: a held lease keeps only its key (the
/// watchdog may hold a hundred thousand of them).
pub(super) fn part(key: &LeaseKey, part: Part) -> String {
    key.derived(part.suffix())
}

/// The keys beside a lock's record that the lock scripts reach (they derive the names in Lua).
/// On a cluster a call declares them too, after the locks' keys: a call on a slot being
/// migrated is then answered `ASK` or `TRYAGAIN` before anything runs, instead of failing
/// halfway at a key that has moved.
pub(super) const BESIDE: [&str; 8] = [
    "abandoned",
    "queue",
    "timeouts",
    "owners",
    "holds",
    "shared",
    "sharers",
    "writers",
];

/// The key of the cache's failed round `round`.
pub(super) fn failed(key: &LeaseKey, round: u64) -> String {
    format!("{}:{round}", part(key, Part::Failed))
}

/// Refuses a lease TTL past [`MAX_TTL`](crate::MAX_TTL) before anything is sent: the scripts
/// turn a TTL into absolute server times (the lease's and the record's expiry), and one far
/// past the cap would write a record whose expiry Redis then refuses.
pub(super) fn check_ttl(ttl: Duration) -> crate::error::Result<()> {
    if ttl > crate::options::MAX_TTL {
        return Err(crate::error::Error::invalid(format!(
            "a lease TTL is at most {:?} (a year), got {ttl:?}",
            crate::options::MAX_TTL
        )));
    }
    Ok(())
}

/// Milliseconds, saturating.
pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_the_derived_names_with_the_lock_hash_tag() {
        let k = LeaseKey::new("p:", "a{b}");
        assert_eq!(k.as_str(), "p:{a%7Bb%7D}");
        for (p, suffix) in [
            (Part::Released, "released"),
            (Part::Handoff, "handoff"),
            (Part::Value, "value"),
            (Part::Filled, "filled"),
            (Part::Cooldown, "cooldown"),
        ] {
            assert_eq!(part(&k, p), k.derived(suffix));
            assert!(part(&k, p).starts_with("p:{a%7Bb%7D}:"));
        }
        assert_eq!(failed(&k, 7), "p:{a%7Bb%7D}:failed:7");
    }
}
