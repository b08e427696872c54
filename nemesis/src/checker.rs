//! The checker: reads the holders' own records and says whether the locks kept their
//! promises.
//!
//! A hold is *valid* from its enter until the earliest of its exit, `lost()` firing and the
//! lease's validity end (the guard's `valid_until()`): that is what the library promised the
//! holder. Safety is about valid holds:
//!
//! - no two valid exclusive holds of one name overlap (plain, fair, reentrant, a multi
//!   lock's names and a read-write lock's write are all exclusive holds of their name);
//! - at no instant more valid permits of a semaphore than it has, nor a valid read beside a
//!   valid write of one read-write lock;
//! - fencing tokens strictly increase in grant order (by enter) among the valid exclusive
//!   holds of a name;
//! - the fenced resource accepted writes in token order: no accepted write finished before
//!   another accepted write of the same name began with a lower token.
//!
//! It also reports *raw* overlaps (enter to exit, whatever the lease said: a holder paused
//! past its TTL resumes and runs on) and how many of those `lost()` had told the holder of.
//!
//! A valid overlap (or permits over N, or a read beside a write) whose earlier hold's lease
//! may have been wiped by a server restart that lost data (a kill without persistence, the
//! last second of an `appendfsync everysec` AOF, a failover without `ReplicaAck`) is counted
//! apart, as *after data loss*: the README states that limit ("another client may take
//! those locks from the moment the server is back: fence"). One after a server's wall clock
//! jumped forward under the earlier lease is counted apart as *after a clock jump*, and so is
//! a token lower than an earlier hold's after a restart that lost data on a server whose
//! clock was off (the README's exception to "tokens never go backwards").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use crate::record::{FaultEvent, FenceWrite, Kind, Records, Section};

/// How long after a fault is healed a section still counts as under it.
pub const FAULT_TAIL_NS: u64 = 2_000_000_000;

/// The counts of one row of the summary (one fault, or the sections under no fault).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Row {
    /// Sections entered (open ones included).
    pub sections: usize,
    /// Sections never closed (the worker was stopped or killed in them).
    pub open: usize,
    /// Faults injected.
    pub faults: usize,
    /// Valid exclusive holds that overlapped: safety violations.
    pub valid_overlaps: usize,
    /// Valid overlaps after a restart that lost data (the stated limit).
    pub after_data_loss: usize,
    /// Valid overlaps after a server's wall clock jumped forward under the earlier lease
    /// (on as many servers as the configuration's jump quorum): the stated limit of
    /// clocks (the server expires keys by its wall clock). Also tokens lower than an
    /// earlier hold's after a clock that ran ahead and a restart that lost data.
    pub after_clock_jump: usize,
    /// Raw (enter..exit) exclusive overlaps.
    pub raw_overlaps: usize,
    /// Raw overlaps whose earlier holder `lost()` had told.
    pub raw_caught: usize,
    /// Sections whose `lost()` fired before exit.
    pub lost: usize,
    /// Holds whose lease had ended before the holder had the guard in hand (a multi lock
    /// whose first lease ran out while it waited for the next; a holder paused between the
    /// grant and its enter): never valid, and not in the token order.
    pub dead_on_arrival: usize,
    /// Instants with more valid permits than the semaphore has.
    pub permits_over: usize,
    /// Instants with a valid read beside a valid write.
    pub read_beside_write: usize,
    /// Fencing tokens not strictly increasing in grant order.
    pub token_order: usize,
    /// Fenced writes accepted.
    pub writes_accepted: usize,
    /// Fenced writes rejected (stale: a newer token had written).
    pub writes_rejected: usize,
    /// Fenced writes whose server did not answer.
    pub writes_failed: usize,
    /// Accepted fenced writes out of token order: safety violations.
    pub fence_order: usize,
}

impl Row {
    /// Whether the row holds a safety violation.
    pub fn violated(&self) -> bool {
        self.valid_overlaps
            + self.permits_over
            + self.read_beside_write
            + self.token_order
            + self.fence_order
            > 0
    }

    fn add(&mut self, o: &Row) {
        self.sections += o.sections;
        self.open += o.open;
        self.faults += o.faults;
        self.valid_overlaps += o.valid_overlaps;
        self.after_data_loss += o.after_data_loss;
        self.after_clock_jump += o.after_clock_jump;
        self.raw_overlaps += o.raw_overlaps;
        self.raw_caught += o.raw_caught;
        self.lost += o.lost;
        self.dead_on_arrival += o.dead_on_arrival;
        self.permits_over += o.permits_over;
        self.read_beside_write += o.read_beside_write;
        self.token_order += o.token_order;
        self.writes_accepted += o.writes_accepted;
        self.writes_rejected += o.writes_rejected;
        self.writes_failed += o.writes_failed;
        self.fence_order += o.fence_order;
    }
}

/// The checker's verdict: a row per fault (`none` for sections under no fault), and a line
/// of evidence per violation.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Rows by fault name.
    pub rows: BTreeMap<String, Row>,
    /// One line per safety violation (and per overlap after data loss, marked so).
    pub evidence: Vec<String>,
}

impl Report {
    /// All rows added up.
    pub fn total(&self) -> Row {
        let mut t = Row::default();
        for r in self.rows.values() {
            t.add(r);
        }
        t
    }

    /// Whether any safety property failed.
    pub fn violated(&self) -> bool {
        self.total().violated()
    }

    /// Adds another run's report into this one.
    pub fn merge(&mut self, other: Report) {
        for (k, r) in other.rows {
            self.rows.entry(k).or_default().add(&r);
        }
        self.evidence.extend(other.evidence);
    }
}

/// Header of [`Row`]'s `Display`.
pub const HEADER: &str = "fault          sections   open faults valid-ovl after-loss after-clock raw-ovl (lost-told)  lost   doa permits>N rd+wr token-ord  fenced-acc fenced-rej fenced-err fence-ord";

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:>10} {:>6} {:>6} {:>9} {:>10} {:>11} {:>7} ({:>10}) {:>5} {:>5} {:>9} {:>5} {:>9}  {:>10} {:>10} {:>10} {:>9}",
            self.sections,
            self.open,
            self.faults,
            self.valid_overlaps,
            self.after_data_loss,
            self.after_clock_jump,
            self.raw_overlaps,
            self.raw_caught,
            self.lost,
            self.dead_on_arrival,
            self.permits_over,
            self.read_beside_write,
            self.token_order,
            self.writes_accepted,
            self.writes_rejected,
            self.writes_failed,
            self.fence_order
        )
    }
}

/// The fault a section ran under: the last fault injected before its enter whose heal
/// (plus [`FAULT_TAIL_NS`]) is not yet past; `none` otherwise.
fn fault_of(faults: &[FaultEvent], t: u64) -> &str {
    faults
        .iter()
        .filter(|f| f.start <= t && t <= f.end.saturating_add(FAULT_TAIL_NS))
        .max_by_key(|f| f.start)
        .map_or("none", |f| f.kind.as_str())
}

fn describe(s: &Section) -> String {
    format!(
        "{} {:?} {} token {} asked {} enter {} exit {} valid-end {} lost {} write {:?}",
        s.id,
        s.kind,
        s.holder,
        s.token,
        s.asked,
        s.enter,
        s.exit.map_or("open".into(), |e| e.to_string()),
        s.valid_end().map_or("-".into(), |e| e.to_string()),
        s.lost.map_or("-".into(), |e| e.to_string()),
        s.write
    )
}

/// Checks the records.
pub fn check(records: &Records) -> Report {
    let mut report = Report::default();
    let faults = &records.faults;
    let label = |t: u64| fault_of(faults, t).to_string();
    for f in faults {
        report.rows.entry(f.kind.clone()).or_default().faults += 1;
    }
    let mut by_name: HashMap<&str, Vec<&Section>> = HashMap::new();
    for s in &records.sections {
        let row = report.rows.entry(label(s.enter)).or_default();
        row.sections += 1;
        row.open += s.exit.is_none() as usize;
        row.lost += s.lost.is_some() as usize;
        row.dead_on_arrival += (s.valid_until() <= s.enter) as usize;
        match s.write {
            FenceWrite::Accepted { .. } => row.writes_accepted += 1,
            FenceWrite::Rejected { .. } => row.writes_rejected += 1,
            FenceWrite::Failed => row.writes_failed += 1,
            FenceWrite::None => {}
        }
        by_name.entry(&s.name).or_default().push(s);
    }
    let mut names: Vec<_> = by_name.into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(b.0));
    for (name, mut sections) in names {
        sections.sort_by_key(|s| (s.enter, s.id.clone()));
        let excuse = Excuses {
            faults,
            jump_quorum: records.jump_quorum.unwrap_or(1),
        };
        exclusive(name, &sections, &excuse, &mut report);
        shared(name, &sections, &excuse, &mut report);
        fence_order(name, &sections, faults, &mut report);
    }
    report
}

/// The faults that excuse an overlap as a stated limit.
struct Excuses<'a> {
    faults: &'a [FaultEvent],
    jump_quorum: usize,
}

/// Why an overlap is a stated limit, if it is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Excuse {
    None,
    DataLoss,
    ClockJump,
    /// A restart that lost data on a server whose clock was off (tokens only).
    ClockOffRestart,
}

/// Counts one failed property in `row`: apart, as the stated limit `why` names, or as a
/// violation in the counter `violation` picks. Returns the evidence's opening words: `what`
/// with its limit, or `what` in capitals for a violation.
fn tally(row: &mut Row, why: Excuse, violation: fn(&mut Row) -> &mut usize, what: &str) -> String {
    let limit = match why {
        Excuse::None => {
            *violation(row) += 1;
            return what.to_uppercase();
        }
        Excuse::DataLoss => {
            row.after_data_loss += 1;
            "a restart that lost data"
        }
        Excuse::ClockJump => {
            row.after_clock_jump += 1;
            "a clock jump"
        }
        Excuse::ClockOffRestart => {
            row.after_clock_jump += 1;
            "a restart that lost data on a server whose clock was off"
        }
    };
    format!("{what} after {limit} (stated limit)")
}

impl Excuses<'_> {
    /// Whether a restart that lost data fell between `from` (when the earlier of two holds
    /// was asked for: it was granted after) and `to` (the later hold's enter): the earlier
    /// lease may have been wiped. Else whether the wall clocks of `jump_quorum` distinct
    /// servers jumped forward between them: the earlier lease may have expired early on
    /// enough of them. A jump back is harmless to a lease (it lives longer), but its heal
    /// is a jump forward, and counted so.
    fn of(&self, from: u64, to: u64) -> Excuse {
        if self
            .faults
            .iter()
            .any(|f| f.data_loss && from <= f.end && f.start <= to)
        {
            return Excuse::DataLoss;
        }
        let jumped: BTreeSet<&str> = self
            .faults
            .iter()
            .filter(|f| f.clock_forward.is_some_and(|t| from <= t && t <= to))
            .map(|f| f.target.split(':').next().unwrap_or_default())
            .collect();
        if jumped.len() >= self.jump_quorum.max(1) {
            Excuse::ClockJump
        } else {
            Excuse::None
        }
    }
}

impl Excuses<'_> {
    /// Whether hold `s`'s token, not above the earlier hold `a`'s, is the stated limit of a
    /// restart that lost data on a server whose clock was off: the restart lost the fencing
    /// counter, and the next token counts from the server clock's µs, which was below the
    /// tokens already issued. Either the clock had been set ahead by J ms before `a` entered
    /// (the counter counted from that clock), and the server restarted, between `a`'s ask
    /// and `s`'s enter, less than J after the clock was set right; or the server restarted
    /// after `a`'s ask and its clock was set behind when `s` was asked for.
    fn lower_token(&self, a: &Section, s: &Section) -> bool {
        let server = |f: &FaultEvent| f.target.split(':').next().unwrap_or_default().to_string();
        self.faults
            .iter()
            .filter(|l| l.data_loss && a.asked <= l.end && l.start <= s.enter)
            .any(|l| {
                self.faults.iter().any(|c| {
                    server(c) == server(l)
                        && match clock_jump_ms(c) {
                            Some(j) if j > 0 => {
                                let j = j.unsigned_abs().saturating_mul(1_000_000);
                                c.start < a.enter
                                    && c.start <= l.start
                                    && l.start <= c.end.saturating_add(j)
                            }
                            Some(_) => c.start <= s.enter && s.asked <= c.end,
                            None => false,
                        }
                })
            })
    }
}

/// How far a clock fault set its server's clock, ms (`server2:+5300ms`, `server0:-900ms`);
/// `None` for any other fault.
fn clock_jump_ms(f: &FaultEvent) -> Option<i64> {
    let jump = f.target.split_once(':')?.1.strip_suffix("ms")?;
    if !(jump.starts_with('+') || jump.starts_with('-')) {
        return None;
    }
    jump.parse().ok()
}

/// Overlaps among the exclusive holds of one name (sorted by enter), valid and raw, and the
/// tokens' order.
fn exclusive(name: &str, sections: &[&Section], excuse: &Excuses, report: &mut Report) {
    let faults = excuse.faults;
    let holds: Vec<&Section> = sections
        .iter()
        .copied()
        .filter(|s| s.kind.is_exclusive())
        .collect();
    // Valid holds: the one reaching furthest so far against each next one.
    let valid: Vec<&Section> = holds
        .iter()
        .copied()
        .filter(|s| s.valid_until() > s.enter)
        .collect();
    // A multi lock's first names were granted long before its enter: its token is checked
    // against the holds that had ended before it asked, not by its enter.
    let mut backwards = |a: &Section, s: &Section, what: &str| {
        let row = report
            .rows
            .entry(fault_of(faults, s.enter).into())
            .or_default();
        let why = match excuse.lower_token(a, s) {
            true => Excuse::ClockOffRestart,
            false => Excuse::None,
        };
        let why = tally(row, why, |r| &mut r.token_order, "token order");
        report.evidence.push(format!(
            "{why} on {name}: {what}:\n  {}\n  {}",
            describe(a),
            describe(s)
        ));
    };
    for &m in valid.iter().filter(|s| s.kind == Kind::Multi) {
        if let Some(b) = valid
            .iter()
            .filter(|b| b.valid_until() < m.asked && b.token >= m.token)
            .max_by_key(|b| b.token)
        {
            backwards(
                b,
                m,
                "a multi lock's token not above that of a hold ended before it asked",
            );
        }
    }
    let ordered: Vec<&Section> = valid
        .iter()
        .copied()
        .filter(|s| s.kind != Kind::Multi)
        .collect();
    for pair in ordered.windows(2) {
        let (a, s) = (pair[0], pair[1]);
        if s.token <= a.token {
            backwards(
                a,
                s,
                "a later valid hold has a token not above the earlier's",
            );
        }
    }
    let mut furthest: Option<&Section> = None;
    for &s in &valid {
        if let Some(a) = furthest {
            if s.enter < a.valid_until() {
                let why = excuse.of(a.asked.min(s.asked), s.enter);
                let row = report
                    .rows
                    .entry(fault_of(faults, s.enter).into())
                    .or_default();
                let what = tally(row, why, |r| &mut r.valid_overlaps, "valid overlap");
                report.evidence.push(format!(
                    "{what} on {name}:\n  {}\n  {}",
                    describe(a),
                    describe(s)
                ));
            }
        }
        if furthest.is_none_or(|a| s.valid_until() > a.valid_until()) {
            furthest = Some(s);
        }
    }
    // Raw sections: enter..exit, whatever the lease said.
    let mut furthest: Option<&Section> = None;
    for &s in &holds {
        if let Some(a) = furthest {
            if s.enter < a.raw_until() {
                let row = report
                    .rows
                    .entry(fault_of(faults, s.enter).into())
                    .or_default();
                row.raw_overlaps += 1;
                row.raw_caught += a.lost.is_some() as usize;
            }
        }
        if furthest.is_none_or(|a| s.raw_until() > a.raw_until()) {
            furthest = Some(s);
        }
    }
}

/// Permits over N and reads beside writes, by a sweep over the valid holds of one name.
fn shared(name: &str, sections: &[&Section], excuse: &Excuses, report: &mut Report) {
    let faults = excuse.faults;
    // (time, is_start, kind): ends sort before starts at one instant.
    let mut events: Vec<(u64, bool, Kind, &Section)> = Vec::new();
    for &s in sections {
        if matches!(s.kind, Kind::Permit(_) | Kind::Read | Kind::Write) && s.valid_until() > s.enter
        {
            events.push((s.enter, true, s.kind, s));
            events.push((s.valid_until(), false, s.kind, s));
        }
    }
    events.sort_by_key(|e| (e.0, e.1));
    let (mut permits, mut reads, mut writes) = (0u32, 0u32, 0u32);
    // The holds valid now, by enter: the oldest tells whether a data-losing restart fell
    // while they were held.
    let mut active: BTreeSet<(u64, &str)> = BTreeSet::new();
    for (_, start, kind, s) in events {
        let d = |n: &mut u32| if start { *n += 1 } else { *n -= 1 };
        match kind {
            Kind::Permit(_) => d(&mut permits),
            Kind::Read => d(&mut reads),
            _ => d(&mut writes),
        }
        if !start {
            active.remove(&(s.asked, s.id.as_str()));
            continue;
        }
        active.insert((s.asked, s.id.as_str()));
        let oldest = active.first().map_or(s.asked, |a| a.0);
        let why = excuse.of(oldest, s.enter);
        if let Kind::Permit(n) = kind {
            if permits > n {
                let row = report
                    .rows
                    .entry(fault_of(faults, s.enter).into())
                    .or_default();
                let what = tally(row, why, |r| &mut r.permits_over, "permits over N");
                report.evidence.push(format!(
                    "{what} on {name}: {permits} valid of {n} as this one entered:\n  {}",
                    describe(s)
                ));
            }
        }
        if reads > 0 && writes > 0 && matches!(kind, Kind::Read | Kind::Write) {
            let row = report
                .rows
                .entry(fault_of(faults, s.enter).into())
                .or_default();
            let what = tally(
                row,
                why,
                |r| &mut r.read_beside_write,
                "read beside a write",
            );
            report.evidence.push(format!(
                "{what} on {name} ({reads} reads, {writes} writes) as this one entered:\n  {}",
                describe(s)
            ));
        }
    }
}

/// Accepted fenced writes of one name in token order: no write accepted (answered) before
/// another began may carry a higher token than it.
fn fence_order(name: &str, sections: &[&Section], faults: &[FaultEvent], report: &mut Report) {
    let mut writes: Vec<(u64, u64, &Section)> = sections
        .iter()
        .filter_map(|s| match s.write {
            FenceWrite::Accepted { start, end } => Some((start, end, *s)),
            _ => None,
        })
        .collect();
    let mut by_end = writes.clone();
    by_end.sort_by_key(|w| w.1);
    writes.sort_by_key(|w| w.0);
    let mut done = 0;
    let mut highest: Option<&Section> = None;
    for (start, _, s) in writes {
        while done < by_end.len() && by_end[done].1 < start {
            let w = by_end[done].2;
            if highest.is_none_or(|h| w.token > h.token) {
                highest = Some(w);
            }
            done += 1;
        }
        if let Some(h) = highest {
            if h.token > s.token {
                report
                    .rows
                    .entry(fault_of(faults, start).into())
                    .or_default()
                    .fence_order += 1;
                report.evidence.push(format!(
                    "FENCED WRITE OUT OF ORDER on {name}: accepted after a higher token's write:\n  {}\n  {}",
                    describe(h),
                    describe(s)
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A closed section: valid until `valid`, token `token`, no lost, an accepted write at exit.
    fn sec(
        id: &str,
        kind: Kind,
        name: &str,
        token: u64,
        enter: u64,
        exit: u64,
        valid: u64,
    ) -> Section {
        Section {
            id: id.into(),
            kind,
            name: name.into(),
            holder: id.into(),
            token,
            asked: enter,
            enter,
            valid_at_enter: Some(valid),
            exit: Some(exit),
            valid_at_exit: Some(valid),
            lost: None,
            write: if kind.is_exclusive() {
                FenceWrite::Accepted {
                    start: exit - 1,
                    end: exit,
                }
            } else {
                FenceWrite::None
            },
        }
    }

    fn records(sections: Vec<Section>, faults: Vec<FaultEvent>) -> Records {
        Records {
            sections,
            faults,
            bad_lines: 0,
            jump_quorum: None,
        }
    }

    fn run(sections: Vec<Section>, faults: Vec<FaultEvent>) -> Report {
        check(&records(sections, faults))
    }

    #[test]
    fn back_to_back_holds_pass() {
        let r = run(
            vec![
                sec("a", Kind::Plain, "n", 1, 10, 20, 50),
                sec("b", Kind::Fair, "n", 2, 20, 30, 60),
                sec("c", Kind::Multi, "n", 3, 31, 40, 70),
            ],
            vec![],
        );
        assert!(!r.violated(), "{:?}", r.evidence);
        assert_eq!(r.total().sections, 3);
        assert_eq!(r.total().writes_accepted, 3);
    }

    #[test]
    fn overlapping_valid_holds_fail() {
        let r = run(
            vec![
                sec("a", Kind::Plain, "n", 1, 10, 30, 50),
                sec("b", Kind::Reentrant, "n", 2, 20, 40, 60),
            ],
            vec![],
        );
        assert_eq!(r.total().valid_overlaps, 1);
        assert_eq!(r.total().raw_overlaps, 1);
        assert!(r.violated());
    }

    #[test]
    fn paused_holder_past_its_validity_is_a_raw_overlap_only() {
        // a's lease ended at 15 (paused); b took the lock at 20; a ran on to 30 and its
        // lost() fired at 25; its late write was rejected.
        let mut a = sec("a", Kind::Plain, "n", 1, 10, 30, 15);
        a.lost = Some(25);
        a.write = FenceWrite::Rejected {
            start: 29,
            end: 30,
            newest: 2,
        };
        let r = run(vec![a, sec("b", Kind::Plain, "n", 2, 20, 40, 60)], vec![]);
        let t = r.total();
        assert!(!r.violated(), "{:?}", r.evidence);
        assert_eq!((t.valid_overlaps, t.raw_overlaps, t.raw_caught), (0, 1, 1));
        assert_eq!((t.writes_accepted, t.writes_rejected), (1, 1));
    }

    #[test]
    fn lost_ends_the_valid_part() {
        let mut a = sec("a", Kind::Write, "n", 1, 10, 30, 50);
        a.lost = Some(18);
        let r = run(vec![a, sec("b", Kind::Write, "n", 2, 20, 40, 60)], vec![]);
        assert_eq!(r.total().valid_overlaps, 0);
        assert_eq!(r.total().raw_overlaps, 1);
    }

    #[test]
    fn open_section_holds_until_its_validity_end() {
        let mut a = sec("a", Kind::Plain, "n", 1, 10, 11, 50);
        a.exit = None;
        a.valid_at_exit = None;
        a.write = FenceWrite::None;
        let r = run(vec![a, sec("b", Kind::Plain, "n", 2, 40, 45, 60)], vec![]);
        assert_eq!(r.total().valid_overlaps, 1);
        assert_eq!(r.total().open, 1);
    }

    #[test]
    fn overlap_after_data_loss_is_counted_apart() {
        let faults = vec![FaultEvent {
            kind: "kill".into(),
            target: "s0".into(),
            start: 12,
            end: 14,
            data_loss: true,
            clock_forward: None,
        }];
        let r = run(
            vec![
                sec("a", Kind::Plain, "n", 1, 10, 30, 50),
                sec("b", Kind::Plain, "n", 2, 20, 40, 60),
            ],
            faults,
        );
        let t = r.total();
        assert_eq!((t.valid_overlaps, t.after_data_loss, t.faults), (0, 1, 1));
        assert!(!r.violated());
        assert_eq!(r.rows["kill"].after_data_loss, 1);
    }

    fn jump(target: &str, start: u64, end: u64, forward: u64) -> FaultEvent {
        FaultEvent {
            kind: "clock".into(),
            target: target.into(),
            start,
            end,
            data_loss: false,
            clock_forward: Some(forward),
        }
    }

    #[test]
    fn overlap_after_a_clock_jump_is_counted_apart_on_a_quorum_of_servers() {
        let holds = || {
            vec![
                sec("a", Kind::Plain, "n", 1, 10, 30, 50),
                sec("b", Kind::Plain, "n", 2, 20, 40, 60),
            ]
        };
        // One server (quorum 1): a jump forward under the earlier lease excuses it.
        let r = run(holds(), vec![jump("server0", 12, 14, 12)]);
        let t = r.total();
        assert_eq!((t.valid_overlaps, t.after_clock_jump), (0, 1));
        assert!(!r.violated());
        // A jump back healed (forward) after the later hold entered excuses nothing.
        let r = run(holds(), vec![jump("server0", 12, 25, 25)]);
        assert_eq!(r.total().valid_overlaps, 1);
        // Redlock (quorum 2): one server's jump is not enough; two servers' are.
        let mut recs = records(holds(), vec![jump("server1", 12, 14, 12)]);
        recs.jump_quorum = Some(2);
        assert_eq!(check(&recs).total().valid_overlaps, 1);
        let mut recs = records(
            holds(),
            vec![jump("server1", 11, 12, 11), jump("server3", 13, 16, 16)],
        );
        recs.jump_quorum = Some(2);
        let t = check(&recs).total();
        assert_eq!((t.valid_overlaps, t.after_clock_jump), (0, 1));
    }

    #[test]
    fn multi_granted_before_a_data_loss_and_entered_late() {
        // The multi lock took "n" at 5 (token 1), waited for its next name across a restart
        // that lost data (12..14); "n" went to b (token 2) at 20; the multi entered at 21
        // and was told lost at 22.
        let faults = vec![FaultEvent {
            kind: "kill".into(),
            target: "s0".into(),
            start: 12,
            end: 14,
            data_loss: true,
            clock_forward: None,
        }];
        let mut m = sec("m", Kind::Multi, "n", 1, 21, 30, 50);
        m.asked = 5;
        m.lost = Some(22);
        let r = run(
            vec![sec("b", Kind::Plain, "n", 2, 20, 40, 60), m.clone()],
            faults,
        );
        let t = r.total();
        assert_eq!(
            (t.valid_overlaps, t.after_data_loss, t.token_order),
            (0, 1, 0)
        );
        // Without the restart the same records are an overlap.
        let r = run(vec![sec("b", Kind::Plain, "n", 2, 20, 40, 60), m], vec![]);
        assert_eq!(r.total().valid_overlaps, 1);
        // A multi lock asked for after a hold with a higher token had ended: tokens went back.
        let mut late = sec("m", Kind::Multi, "n", 1, 50, 60, 90);
        late.asked = 45;
        let r = run(
            vec![sec("b", Kind::Plain, "n", 2, 20, 40, 60), late],
            vec![],
        );
        assert_eq!(r.total().token_order, 1);
    }

    #[test]
    fn n_plus_one_permits_fail() {
        let p = Kind::Permit(2);
        let ok = run(
            vec![
                sec("a", p, "s", 1, 10, 30, 50),
                sec("b", p, "s", 2, 11, 30, 50),
                sec("c", p, "s", 3, 30, 40, 50),
            ],
            vec![],
        );
        assert!(!ok.violated(), "{:?}", ok.evidence);
        let bad = run(
            vec![
                sec("a", p, "s", 1, 10, 30, 50),
                sec("b", p, "s", 2, 11, 30, 50),
                sec("c", p, "s", 3, 29, 40, 50),
            ],
            vec![],
        );
        assert_eq!(bad.total().permits_over, 1);
        assert!(bad.violated());
    }

    #[test]
    fn shared_excess_after_data_loss_is_counted_apart() {
        let faults = vec![FaultEvent {
            kind: "kill".into(),
            target: "s0".into(),
            start: 12,
            end: 14,
            data_loss: true,
            clock_forward: None,
        }];
        let r = run(
            vec![
                sec("w", Kind::Write, "rw", 3, 10, 30, 50),
                sec("r", Kind::Read, "rw", 4, 25, 35, 50),
            ],
            faults,
        );
        assert_eq!(r.total().read_beside_write, 0);
        assert_eq!(r.total().after_data_loss, 1);
        assert!(!r.violated());
    }

    #[test]
    fn a_read_beside_a_write_fails() {
        let ok = run(
            vec![
                sec("r1", Kind::Read, "rw", 1, 10, 20, 50),
                sec("r2", Kind::Read, "rw", 2, 12, 22, 50),
                sec("w", Kind::Write, "rw", 3, 22, 30, 50),
            ],
            vec![],
        );
        assert!(!ok.violated(), "{:?}", ok.evidence);
        let bad = run(
            vec![
                sec("w", Kind::Write, "rw", 3, 10, 30, 50),
                sec("r", Kind::Read, "rw", 4, 25, 35, 50),
            ],
            vec![],
        );
        assert_eq!(bad.total().read_beside_write, 1);
        assert!(bad.violated());
    }

    #[test]
    fn tokens_going_backwards_fail() {
        let r = run(
            vec![
                sec("a", Kind::Plain, "n", 5, 10, 20, 50),
                sec("b", Kind::Plain, "n", 5, 21, 30, 60),
            ],
            vec![],
        );
        assert_eq!(r.total().token_order, 1);
        // A hold whose lease had ended before its holder saw the guard is not in the order.
        let mut late = sec("a", Kind::Plain, "n", 4, 25, 26, 22);
        late.write = FenceWrite::Rejected {
            start: 25,
            end: 26,
            newest: 5,
        };
        let r = run(
            vec![sec("b", Kind::Plain, "n", 5, 21, 24, 60), late],
            vec![],
        );
        assert!(!r.violated(), "{:?}", r.evidence);
        assert_eq!(r.total().dead_on_arrival, 1);
    }

    #[test]
    fn a_lower_token_after_a_restart_on_a_server_whose_clock_was_off_is_counted_apart() {
        // server0's clock ran 5 s ahead from 10 to 12; `a` (token 9) entered at 15; server0
        // restarted empty at 20; `b` got a lower token at 30.
        let ahead = FaultEvent {
            kind: "clock>ttl".into(),
            target: "server0:+5000ms".into(),
            start: 10,
            end: 12,
            data_loss: false,
            clock_forward: Some(10),
        };
        let kill = |target: &str, at: u64| FaultEvent {
            kind: "kill".into(),
            target: target.into(),
            start: at,
            end: at + 1,
            data_loss: true,
            clock_forward: None,
        };
        // (The fenced resource refuses `b`'s write: a newer token had written.)
        let holds = || {
            let mut b = sec("b", Kind::Plain, "n", 8, 30, 31, 40);
            b.write = FenceWrite::Rejected {
                start: 30,
                end: 31,
                newest: 9,
            };
            vec![sec("a", Kind::Plain, "n", 9, 15, 16, 17), b]
        };
        let r = run(holds(), vec![ahead.clone(), kill("server0", 20)]);
        let t = r.total();
        assert_eq!(
            (t.token_order, t.after_clock_jump),
            (0, 1),
            "{:?}",
            r.evidence
        );
        assert!(!r.violated());
        // Without the restart, or with the restart on another server, or with a clock set
        // behind instead, it is a violation.
        assert_eq!(run(holds(), vec![ahead.clone()]).total().token_order, 1);
        let r = run(holds(), vec![ahead.clone(), kill("server1", 20)]);
        assert_eq!(r.total().token_order, 1);
        let behind = FaultEvent {
            target: "server0:-5000ms".into(),
            clock_forward: Some(12),
            ..ahead.clone()
        };
        assert_eq!(
            run(holds(), vec![behind.clone(), kill("server0", 20)])
                .total()
                .token_order,
            1
        );
        // A restart, then the clock set behind while `b` was asked for: counted apart.
        let behind_at_b = FaultEvent {
            start: 25,
            end: 35,
            clock_forward: Some(35),
            ..behind
        };
        let t = run(holds(), vec![kill("server0", 20), behind_at_b]).total();
        assert_eq!((t.token_order, t.after_clock_jump), (0, 1));
        // A restart once the clock had caught up (more than the jump after the heal).
        let t = 5_000_000_200;
        let late = vec![
            sec("a", Kind::Plain, "n", 9, 15, 16, 17),
            sec("b", Kind::Plain, "n", 8, t, t + 1, t + 10),
        ];
        let r = run(late, vec![ahead, kill("server0", t - 100)]);
        assert_eq!(r.total().token_order, 1);
    }

    #[test]
    fn fenced_write_accepted_out_of_token_order_fails() {
        let mut a = sec("a", Kind::Plain, "n", 2, 10, 20, 15);
        a.write = FenceWrite::Accepted { start: 18, end: 19 };
        let mut b = sec("b", Kind::Plain, "n", 1, 5, 30, 8);
        b.write = FenceWrite::Accepted { start: 25, end: 26 };
        let r = run(vec![a, b], vec![]);
        assert_eq!(r.total().fence_order, 1);
        assert!(r.violated());
    }
}
