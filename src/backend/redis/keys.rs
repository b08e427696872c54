//! The Redis key layout: every key and channel a lock (or a cached value) uses, in one place.
//!
//! A lock `name` under prefix `p` (default `redlease:`) lives at `p{name}` (see
//! [`LeaseKey`]: the name is escaped so any name gives a distinct key with a non-empty hash
//! tag). Every key below shares that `{name}` hash tag, so each script touches one slot on
//! Redis Cluster.
//!
//! | key or channel | type | what |
//! |---|---|---|
//! | `p{name}` | string | the lease: the holder's token, with the lease TTL |
//! | `p{name}:fence` | hash | `f` last fencing token, `h` holder label, `r` last released token, `w` until when (server ms) plain waiters want a release message, `q` until when the fair queue may hold waiters, `a` until when some token is barred; expires an hour after the lease |
//! | `p{name}:abandoned` | sorted set | abandoned tokens → until when they are barred (an attempt given up, so that a late copy is never granted) |
//! | `p{name}:released` | channel | a release, for waiters (one local waiter woken per message) |
//! | `p{name}:queue` | list | fair waiters' tokens, oldest first |
//! | `p{name}:timeouts` | sorted set | fair waiters' tokens → deadline (server ms) |
//! | `p{name}:handoff` | channel | a release hands the lock to the queue's head: its token |
//! | `p{name}:owners` | hash | reentrant: {owner: hold count} of the reign holding the lease |
//! | `p{name}:holds` | hash | reentrant: the reign's live holds {hold token: 1}, plus `owner`, `token` (the lease token) and `fence` |
//! | `p{name}:value` | hash | the cache: `v` payload, `d` compute time (µs), `g` grace (ms), `r` the round that wrote it |
//! | `p{name}:filled` | channel | the cache: a value was written, or a round failed |
//! | `p{name}:failed:<round>` | string | the cache: a failed compute round's message |
//! | `p{name}:cooldown` | string | the cache: no background refresh until it expires |
//!
//! Fencing tokens never go backwards: each grant mints at least last + 1 and at least the
//! server's clock in microseconds, so a restarted server without persistence (or the fence
//! hash expiring an hour after the last lease) still hands out larger tokens.
//!
//! The scripts in `scripts/` say per call which of these they read and write, and what
//! they return.

use std::time::Duration;

use crate::token::LeaseKey;

/// The names beside a lock's lease key.
#[derive(Clone, Copy, Debug)]
pub(super) enum Part {
    Fence,
    Abandoned,
    Released,
    Queue,
    Timeouts,
    Handoff,
    Owners,
    Holds,
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
            Part::Fence => "fence",
            Part::Abandoned => "abandoned",
            Part::Released => "released",
            Part::Queue => "queue",
            Part::Timeouts => "timeouts",
            Part::Handoff => "handoff",
            Part::Owners => "owners",
            Part::Holds => "holds",
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

/// The key of the cache's failed round `round`.
pub(super) fn failed(key: &LeaseKey, round: u64) -> String {
    format!("{}:{round}", part(key, Part::Failed))
}

/// Milliseconds, saturating.
pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The fence hash's TTL when a lease of `ttl` is granted: an hour past the lease.
pub(super) fn fence_ttl(ttl: Duration) -> i64 {
    ms(ttl).saturating_add(3_600_000)
}

/// How often, at the latest, an extended lease's fence hash gets its hour renewed: well
/// inside the hour a grant or renewal gives it.
pub(super) const FENCE_RENEWAL: Duration = Duration::from_secs(30 * 60);

/// Milliseconds on the process's monotonic clock, for [`fence_due`].
pub(super) fn fence_clock() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    u64::try_from(
        EPOCH
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

/// Whether an extension of `ttl` made at `now` (ms, [`fence_clock`]) also renews the fence
/// hash of `key`. Time is cut into slots of `ttl`, and a lease renews in one slot of every
/// `k = FENCE_RENEWAL / ttl`, picked by its key. A lease kept alive is extended at least once
/// per slot (each extension comes before the last one runs out), so it renews at least once
/// per `k` slots, that is every `FENCE_RENEWAL`; at a 30 s TTL, one extension in 60 does.
pub(super) fn fence_due(key: &str, ttl: Duration, now: u64) -> bool {
    use std::hash::{Hash, Hasher};
    let slot_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
    let k = (u64::try_from(FENCE_RENEWAL.as_millis()).unwrap_or(u64::MAX) / slot_ms).max(1);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (now / slot_ms) % k == h.finish() % k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_the_derived_names_with_the_lock_hash_tag() {
        let k = LeaseKey::new("p:", "a{b}");
        assert_eq!(k.as_str(), "p:{a%7Bb%7D}");
        for (p, suffix) in [
            (Part::Fence, "fence"),
            (Part::Abandoned, "abandoned"),
            (Part::Released, "released"),
            (Part::Queue, "queue"),
            (Part::Timeouts, "timeouts"),
            (Part::Handoff, "handoff"),
            (Part::Owners, "owners"),
            (Part::Holds, "holds"),
            (Part::Value, "value"),
            (Part::Filled, "filled"),
            (Part::Cooldown, "cooldown"),
        ] {
            assert_eq!(part(&k, p), k.derived(suffix));
            assert!(part(&k, p).starts_with("p:{a%7Bb%7D}:"));
        }
        assert_eq!(failed(&k, 7), "p:{a%7Bb%7D}:failed:7");
    }

    #[test]
    fn a_lease_extended_within_each_ttl_renews_its_fence_hash_within_the_renewal_time() {
        for (ttl_ms, period_ms) in [
            (30_000, 10_000),
            (30_000, 29_999),
            (3_000, 1_000),
            (3_600_000, 1_200_000),
        ] {
            let ttl = Duration::from_millis(ttl_ms);
            for key in ["a", "orders:42", "redlease:{x}"] {
                let bound = FENCE_RENEWAL.as_millis() as u64 + ttl_ms;
                let (mut last, mut now, mut renewals) = (0u64, 12_345u64, 0);
                while now < 5 * 3_600_000 {
                    if fence_due(key, ttl, now) {
                        assert!(
                            now - last <= bound,
                            "{key} ttl {ttl_ms}: renewed after {} ms",
                            now - last
                        );
                        last = now;
                        renewals += 1;
                    }
                    now += period_ms;
                }
                assert!(
                    renewals >= 5,
                    "{key} ttl {ttl_ms}: {renewals} renewals in 5 h"
                );
                // Not at every extension when the TTL is short.
                let extensions = (5 * 3_600_000 - 12_345) / period_ms;
                assert!(ttl_ms >= FENCE_RENEWAL.as_millis() as u64 || renewals * 10 < extensions);
            }
        }
    }
}
