//! Every check at CI's bounds: the protocol as written finds exactly the counterexamples its
//! stated limits predict, and each mutant finds its own.
use redlease_model::scripts::Answer;
use redlease_model::{
    check, checks, Action, Check, Lease, Req, Setup, State, ABANDONED, EXCLUSION, FENCES, RELEASED,
};
use stateright::Model;

fn named(name: &str) -> Check {
    checks(false)
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check named {name}"))
}

/// Runs a check of the protocol as written: exactly the expected properties fail.
fn exact(name: &str) {
    outcome(name);
}

/// [`exact`], returning what the check found.
fn outcome(name: &str) -> redlease_model::Outcome {
    let c = named(name);
    let o = check(c.setup.clone(), 2, None);
    let found: Vec<&str> = o.found.iter().map(|(p, _)| *p).collect();
    println!(
        "{name}: {} states, {} unique, depth {}, found {found:?}",
        o.states, o.unique, o.depth
    );
    let mut want = c.fails.to_vec();
    want.sort_unstable();
    assert_eq!(found, want, "{name}: {:?}", o.found);
    assert!(o.unique > 1000, "{name} explored too little: {}", o.unique);
    o
}

/// Runs a mutant until its counterexamples appear; returns them.
fn mutant(name: &str) -> redlease_model::Outcome {
    let c = named(name);
    let o = check(c.setup.clone(), 2, Some(c.fails));
    for f in c.fails {
        assert!(
            o.trace(f).is_some(),
            "{name}: no counterexample for {f}: {:?}",
            o.found
        );
    }
    o
}

#[test]
fn single_reconnects_keep_send_order() {
    exact("single: reconnects, re-sends, waiters, extensions");
}

#[test]
fn single_late_acquire_after_its_lease_ran_out_is_a_limit() {
    let o = outcome("single: a late acquire after its lease ran out (limit)");
    let t = o.trace(RELEASED).expect("checked");
    // A copy of an acquire left on a dropped connection runs after its token's release.
    let reconnect = t
        .iter()
        .position(|a| matches!(a, Action::Reconnect(..)))
        .unwrap_or_else(|| panic!("a reconnect: {t:?}"));
    let Action::Reconnect(c, _) = t[reconnect] else {
        unreachable!()
    };
    let release = t
        .iter()
        .position(|a| *a == Action::Release(c))
        .unwrap_or_else(|| panic!("its release: {t:?}"));
    assert!(
        reconnect < release
            && t[release..]
                .iter()
                .any(|a| matches!(a, Action::DeliverStale(s, ..) if *s == c)),
        "the stale copy runs after the release: {t:?}"
    );
}

#[test]
fn single_clock_gain_within_margin() {
    exact("single: clock gain within the drift margin");
}

#[test]
fn single_clock_set_back_without_crash() {
    exact("single: clock set back, no crash");
}

/// Replays `trace` of `setup`, every action enabled where it comes: the last state and the
/// fences granted, as (position in the trace, fence).
fn replay(setup: &Setup, trace: &[Action]) -> (State, Vec<(usize, u32)>) {
    let model = Lease(setup.clone());
    let mut s = model.init_states().pop().expect("an initial state");
    let mut out = Vec::new();
    let mut enabled = Vec::new();
    for (i, a) in trace.iter().enumerate() {
        enabled.clear();
        model.actions(&s, &mut enabled);
        assert!(enabled.contains(a), "{a:?} not enabled at {i} of {trace:?}");
        s = model.next_state(&s, *a).expect("a step of the model");
        if let Action::Deliver(cl, n) = *a {
            let conn = &s.conns[usize::from(cl) * usize::from(setup.nodes) + usize::from(n)];
            if let Some(r) = conn.replies.last() {
                if let (Req::Acquire { .. }, Answer::Granted(f)) = (r.msg.req, r.answer) {
                    out.push((i, f));
                }
            }
        }
    }
    (s, out)
}

#[test]
fn clock_ahead_set_right_then_crash_sends_fences_back() {
    let name = "single: clock ahead, set right, crash without persistence (limit)";
    exact(name);
    let c = named(name);
    // The shortest: the clock goes ahead, a grant, a crash, the clock goes back, and the
    // re-sent acquire is granted the same token again.
    let o = check(c.setup.clone(), 2, Some(&[FENCES]));
    let t = o.trace(FENCES).expect("checked");
    let at = |want: fn(&Action) -> bool| t.iter().position(want).unwrap_or_else(|| panic!("{t:?}"));
    let (gain, back, crash) = (
        at(|a| matches!(a, Action::Gain(_))),
        at(|a| matches!(a, Action::SetBack(_))),
        at(|a| matches!(a, Action::Crash(_))),
    );
    let (_, g) = replay(&c.setup, t);
    let before = g.iter().find(|(i, _)| gain < *i && *i < crash.min(back));
    let after = g.iter().find(|(i, _)| *i > crash.max(back));
    assert!(
        matches!((before, after), (Some((_, f0)), Some((_, f1))) if f1 <= f0),
        "{t:?}: grants {g:?}"
    );
    // Another client's guard below an earlier guard's token, as the nemesis saw: two grants
    // in one tick while the clock is ahead (2000, then the counter's 2001), the clock set
    // right, a crash, and a new claim's grant from the clock's floor (2000).
    let mut setup = c.setup.clone();
    setup.claims = 2;
    use Action::*;
    let trace = [
        Gain(0),
        Start(0),
        Deliver(0, 0),
        Read(0, 0),
        Release(0),
        Deliver(0, 0),
        Read(0, 0),
        Start(1),
        Deliver(1, 0),
        Read(1, 0),
        Release(1),
        Deliver(1, 0),
        Read(1, 0),
        SetBack(0),
        Crash(0),
        Tick,
        Restart(0),
        Start(0),
        Deliver(0, 0),
        Read(0, 0),
    ];
    let (s, g) = replay(&setup, &trace);
    assert_eq!(
        g.iter().map(|(_, f)| *f).collect::<Vec<_>>(),
        [2000, 2001, 2000]
    );
    assert!(s.guard_back, "a guard's token below an earlier guard's");
}

#[test]
fn redlock_clock_set_back_and_reconnects() {
    exact("redlock 3: clock set back, reconnects");
}

#[test]
fn single_crash_aof_always() {
    exact("single: crash, AOF always");
}

#[test]
fn single_crash_aof_everysec_is_a_limit() {
    exact("single: crash, AOF everysec (limit)");
}

#[test]
fn single_crash_without_persistence_is_a_limit() {
    exact("single: crash, no persistence (limit)");
}

#[test]
fn single_crash_without_persistence_with_a_restart_quarantine() {
    exact("single: crash, no persistence, restart quarantine");
}

#[test]
fn failover_with_ack() {
    exact("single: failover with replica acknowledgement");
}

#[test]
fn failover_without_ack_is_a_limit() {
    exact("single: failover without acknowledgement (limit)");
}

#[test]
fn semaphore_permits() {
    exact("semaphore: 3 clients, 2 permits");
}

#[test]
fn read_write_lock() {
    exact("read-write lock: a writer, 2 readers, waiters");
}

#[test]
fn redlock_restart_with_quarantine() {
    exact("redlock 3: restart without persistence, quarantine");
}

#[test]
fn redlock5_restarts_with_quarantine_random_walks() {
    exact("redlock 5: restarts without persistence, quarantine, random walks");
}

#[test]
fn redlock5_restarts_reconnects_give_ups_are_limits() {
    exact("redlock 5: restarts, reconnects, give-ups, random walks (limit)");
}

#[test]
fn redlock_gain_and_reconnects() {
    exact("redlock 3: clock gain, reconnects");
}

#[test]
fn clock_gain_past_margin_is_a_limit() {
    exact("clock gain past the drift margin (limit)");
}

#[test]
fn mutant_no_quarantine_gives_the_redlock_counterexample() {
    let o = mutant("mutant: redlock 3 without the quarantine");
    let t = o.trace(EXCLUSION).expect("checked");
    // A node crashes and restarts, and the second client's grants include it.
    let crash = t
        .iter()
        .position(|a| matches!(a, Action::Crash(_)))
        .expect("a crash");
    let Action::Crash(n) = t[crash] else {
        unreachable!()
    };
    let restart = t
        .iter()
        .position(|a| *a == Action::Restart(n))
        .expect("its restart");
    assert!(crash < restart);
    assert!(t[restart..]
        .iter()
        .any(|a| matches!(a, Action::Deliver(_, m) if *m == n)));
}

#[test]
fn mutant_redlock5_no_quarantine_gives_the_redlock_counterexample() {
    let o = mutant("mutant: redlock 5 without the quarantine, random walks");
    let t = o.trace(EXCLUSION).expect("checked");
    // One client's grant on node n is lost in n's crash; after n's restart the other client's
    // grant there completes a second majority (3 of 5).
    let crash = t
        .iter()
        .position(|a| matches!(a, Action::Crash(_)))
        .unwrap_or_else(|| panic!("a crash: {t:?}"));
    let Action::Crash(n) = t[crash] else {
        unreachable!()
    };
    let restart = t
        .iter()
        .position(|a| *a == Action::Restart(n))
        .unwrap_or_else(|| panic!("its restart: {t:?}"));
    let before: Vec<u8> = t[..crash]
        .iter()
        .filter_map(|a| match a {
            Action::Deliver(c, m) if *m == n => Some(*c),
            _ => None,
        })
        .collect();
    assert!(
        t[restart..]
            .iter()
            .any(|a| matches!(a, Action::Deliver(c, m) if *m == n && !before.contains(c))),
        "another client is granted on the restarted node: {t:?}"
    );
    assert!(t.len() <= 30, "shrunk: {t:?}");
}

#[test]
fn mutant_no_clock_floor_sends_fences_back() {
    let o = mutant("mutant: no clock floor on the fence");
    let t = o.trace(redlease_model::FENCES).expect("checked");
    assert!(t.iter().any(|a| matches!(a, Action::Crash(_))), "{t:?}");
}

#[test]
fn mutant_no_tombstone_lets_a_late_copy_in() {
    let o = mutant("mutant: no tombstone");
    let t = o.trace(ABANDONED).expect("checked");
    assert!(t.iter().any(|a| matches!(a, Action::GiveUp(_))), "{t:?}");
}

#[test]
fn mutant_no_drift_margin_overlaps() {
    let o = mutant("mutant: validity without the drift margin");
    let t = o.trace(EXCLUSION).expect("checked");
    assert!(t.iter().any(|a| matches!(a, Action::Gain(_))), "{t:?}");
}

#[test]
fn mutant_no_send_order_lets_a_stale_release_end_the_next_grant() {
    let o = mutant("mutant: no send order");
    let t = o.trace(EXCLUSION).expect("checked");
    // A connection drops, and a request of the dead connection runs later.
    let reconnect = t
        .iter()
        .position(|a| matches!(a, Action::Reconnect(..)))
        .unwrap_or_else(|| panic!("a reconnect: {t:?}"));
    assert!(
        t[reconnect..]
            .iter()
            .any(|a| matches!(a, Action::DeliverStale(..))),
        "a stale delivery after the reconnect: {t:?}"
    );
}
