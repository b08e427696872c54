//! Every check at CI's bounds: the protocol as written finds exactly the counterexamples its
//! stated limits predict, and each mutant finds its own.
use redlease_model::{check, checks, Action, Check, ABANDONED, EXCLUSION};

fn named(name: &str) -> Check {
    checks(false)
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check named {name}"))
}

/// Runs a check of the protocol as written: exactly the expected properties fail.
fn exact(name: &str) {
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
fn single_clock_gain_within_margin() {
    exact("single: clock gain within the drift margin");
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
