//! Extensions: many leases per script call (`extend.lua` for plain leases,
//! `reentrant_extend.lua` for a reign's, which keeps its owners and holds hashes alive with
//! the lease, `shared_extend.lua` for reads' and permits'), the calls of one round sent at
//! once.

use std::collections::HashMap;

use super::errors::{passing, readonly};
use super::keys::{check_ttl, ms};
use super::transport::{self, Script, Value};
use super::RedisBackend;
use crate::backend::{clock_drift, Extended, Lease, NodeTerms};
use crate::error::{Error, Result};

/// Leases extended by one script call; bigger batches are split and the calls pipelined.
const EXTEND_CHUNK: usize = 256;

impl RedisBackend {
    pub(super) async fn extend_leases(
        &self,
        leases: &[Lease<'_>],
        terms: NodeTerms,
    ) -> Result<Vec<Extended>> {
        self.check_connected(terms)?;
        // Boxed: most backends have acknowledgement off, and their calls' futures stay small.
        let mark = match self.inner.acks {
            Some(_) => Box::pin(self.ack_mark()).await,
            None => None,
        };
        let min_uptime = ms(terms.min_uptime);
        let sendable: Vec<usize> = (0..leases.len())
            .filter(|&i| check_ttl(leases[i].ttl).is_ok())
            .collect();
        // Reentrant and shared leases are told by their token (a reign's lease token is a
        // hold; a read's or a permit's, a shared token).
        let script = |lease: &Lease<'_>| {
            let scripts = &self.inner.scripts;
            if lease.token.is_hold() {
                &scripts.reentrant_extend
            } else if lease.token.is_shared() {
                &scripts.shared_extend
            } else {
                &scripts.extend
            }
        };
        let mut kinds: Vec<(&Script, Vec<usize>)> = Vec::new();
        for i in sendable {
            let s = script(&leases[i]);
            match kinds.iter_mut().find(|(k, _)| std::ptr::eq(*k, s)) {
                Some((_, idx)) => idx.push(i),
                None => kinds.push((s, vec![i])),
            }
        }
        let calls = kinds.iter().flat_map(|(script, which)| {
            self.chunks(leases, which)
                .into_iter()
                .map(move |idx| async move {
                    let (keys, args) = lease_args(leases, &idx, min_uptime);
                    let reply = self
                        .eval(script, self.declared(keys), args)
                        .await
                        .map(Value::into_array);
                    (idx, reply)
                })
        });
        // Every kind at once: one round trip for the round, not one per kind; and the
        // server's eviction policy beside them (at most every 100 ms), so that a policy
        // changed at run time is seen by the next round.
        let (replies, evicting) = futures::join!(
            futures::future::join_all(calls),
            self.inner.policy.read_in(&*self.inner.connection)
        );
        if evicting {
            // Any lease may be evicted now without a word: none can be guaranteed.
            tracing::warn!(
                "the Redis server's maxmemory-policy may evict leases now: every lease on it is lost"
            );
            return Ok(leases.iter().map(|_| Extended::Gone).collect());
        }
        let mut out: Vec<Option<Extended>> = (0..leases.len()).map(|_| None).collect();
        // A lease answered READONLY: the server is a replica now.
        let mut demoted = false;
        for (idx, reply) in replies {
            // A call that failed as a whole (a timeout, say) fails its own leases only.
            let reply = reply.and_then(|r| {
                if r.len() == idx.len() {
                    Ok(r)
                } else {
                    Err(Error::backend("extend script returned the wrong count"))
                }
            });
            match reply {
                Ok(reply) => {
                    for (i, v) in idx.into_iter().zip(reply) {
                        // (Only an error's text is a string: no conversion per lease.)
                        demoted |= matches!(&v, Value::Bytes(s) if s.starts_with(b"READONLY"));
                        out[i] = Some(extended(&leases[i], v));
                    }
                }
                Err(e) => {
                    // (The call's own error, from the server: no user data in its text.)
                    let gone = e.to_string().contains("READONLY");
                    for i in idx {
                        out[i] = Some(if gone {
                            Extended::Gone
                        } else {
                            Extended::Failed(crate::backend::for_each_caller(&e))
                        });
                    }
                }
            }
        }
        let out = out
            .into_iter()
            .zip(leases)
            .map(|(e, lease)| {
                e.unwrap_or_else(|| match check_ttl(lease.ttl) {
                    Err(invalid) => Extended::Failed(invalid),
                    Ok(()) => Extended::Failed(Error::backend("no reply")),
                })
            })
            .collect();
        if demoted {
            self.said("READONLY");
        }
        // The round's extensions, acknowledged by one WAIT (shared with concurrent grants).
        Ok(self.extensions_acknowledged(out, mark).await)
    }

    /// Splits the leases `which` into script calls of at most [`EXTEND_CHUNK`], per hash slot
    /// on a cluster (a script may only touch one slot there).
    fn chunks(&self, leases: &[Lease<'_>], which: &[usize]) -> Vec<Vec<usize>> {
        if !self.inner.clustered {
            return which.chunks(EXTEND_CHUNK).map(<[usize]>::to_vec).collect();
        }
        let mut by_slot: HashMap<u16, Vec<usize>> = HashMap::new();
        for &i in which {
            let slot = transport::slot(leases[i].key.as_str().as_bytes());
            by_slot.entry(slot).or_default().push(i);
        }
        by_slot
            .into_values()
            .flat_map(|idx| {
                idx.chunks(EXTEND_CHUNK)
                    .map(<[usize]>::to_vec)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// An extend script's keys and arguments for the leases `idx`: each lock's key; the minimum
/// uptime, then each lease's token and TTL.
fn lease_args(leases: &[Lease<'_>], idx: &[usize], min_uptime: i64) -> (Vec<String>, Vec<Value>) {
    let keys = idx
        .iter()
        .map(|&i| leases[i].key.as_str().to_owned())
        .collect();
    let mut args: Vec<Value> = Vec::with_capacity(idx.len() * 2 + 1);
    args.push(min_uptime.into());
    for &i in idx {
        args.push(leases[i].token.as_str().into());
        args.push(ms(leases[i].ttl).into());
    }
    (keys, args)
}

/// One lease's entry in an extend script's reply: 1, 0, or the text of its error.
fn extended(lease: &Lease<'_>, v: Value) -> Extended {
    match v.as_i64() {
        Some(1) => Extended::Held(lease.ttl.saturating_sub(clock_drift(lease.ttl))),
        Some(0) => Extended::Gone,
        // The server is a replica now (a demoted primary): whether the lease is on the new
        // primary is unknown here, so it is lost at once, not at its deadline.
        _ if v.as_str().is_some_and(|s| readonly(&s)) => Extended::Gone,
        _ => {
            let said = v.as_string().unwrap_or_default();
            let what = format!("extending {}: {said}", lease.key);
            Extended::Failed(if passing(&said) {
                Error::backend(crate::backend::Unavailable(what))
            } else {
                Error::backend(what)
            })
        }
    }
}
