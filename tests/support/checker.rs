//! Mutual-exclusion checker: records critical sections, detects overlaps and
//! non-increasing fencing tokens.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Records every critical section and detects overlaps. Cheap to clone (an
/// `Arc` inside); `Send + Sync`.
#[derive(Clone, Default, Debug)]
pub struct Checker {
    inner: Arc<Inner>,
}

#[derive(Default, Debug)]
struct Inner {
    /// Sections currently inside (entered, not yet exited).
    inside: AtomicUsize,
    /// Overlaps detected at `enter` time.
    violations: AtomicUsize,
    /// Order of `enter` calls (tie-breaker for equal `Instant`s).
    seq: AtomicU64,
    /// Completed sections.
    records: Mutex<Vec<Record>>,
    /// Human-readable descriptions of the overlaps seen at `enter` time.
    notes: Mutex<Vec<String>>,
}

#[derive(Clone, Copy, Debug)]
struct Record {
    seq: u64,
    token: u64,
    enter: Instant,
    exit: Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Checker {
    /// A fresh checker with no sections recorded.
    pub fn new() -> Checker {
        Checker::default()
    }

    /// Call right after acquiring, with the guard's fencing token. Call
    /// [`Section::exit`] just before releasing (dropping the section counts as
    /// an exit too, e.g. on panic). Keep the section in a named binding:
    /// `let _ = checker.enter(t)` exits immediately.
    pub fn enter(&self, token: u64) -> Section {
        let prev = self.inner.inside.fetch_add(1, Ordering::SeqCst);
        let seq = self.inner.seq.fetch_add(1, Ordering::SeqCst);
        // Timestamp taken after incrementing `inside` (and before decrementing
        // it in exit), so non-overlapping sections have enter >= previous exit.
        let enter = Instant::now();
        if prev > 0 {
            self.inner.violations.fetch_add(1, Ordering::SeqCst);
            lock(&self.inner.notes).push(format!(
                "section with token {token} (enter #{seq}) entered while {prev} other section(s) were inside"
            ));
        }
        Section {
            checker: self.clone(),
            token,
            seq,
            enter,
        }
    }

    /// Number of completed (exited) sections.
    pub fn sections(&self) -> usize {
        lock(&self.inner.records).len()
    }

    /// Number of overlaps seen at `enter` time.
    pub fn violations(&self) -> usize {
        self.inner.violations.load(Ordering::SeqCst)
    }

    /// Sections currently inside (entered but not exited).
    pub fn inside(&self) -> usize {
        self.inner.inside.load(Ordering::SeqCst)
    }

    /// Fencing tokens of the completed sections, in enter order.
    pub fn tokens(&self) -> Vec<u64> {
        self.sorted().iter().map(|r| r.token).collect()
    }

    fn sorted(&self) -> Vec<Record> {
        let mut recs = lock(&self.inner.records).clone();
        recs.sort_by_key(|r| (r.enter, r.seq));
        recs
    }

    /// Panics with a descriptive message unless: at least one section was
    /// completed, no overlap was seen (neither by the live `inside` counter nor
    /// post hoc: sorted by enter time, each enter >= the previous exit), and
    /// fencing tokens are strictly increasing in enter order.
    pub fn assert_ok(&self) {
        let recs = self.sorted();
        let mut problems = Vec::new();
        if recs.is_empty() {
            problems.push("no critical section was recorded".to_string());
        }
        let v = self.violations();
        if v > 0 {
            problems.push(format!("{v} overlap(s) detected at enter time"));
            problems.extend(lock(&self.inner.notes).iter().take(10).cloned());
        }
        let inside = self.inside();
        if inside > 0 {
            problems.push(format!(
                "note: {inside} section(s) still inside (not exited) at assert time"
            ));
        }
        for (i, w) in recs.windows(2).enumerate() {
            let (a, b) = (w[0], w[1]);
            if b.enter < a.exit {
                problems.push(format!(
                    "post-hoc overlap: section #{i} (token {}) exited {:?} after section #{} (token {}) entered",
                    a.token,
                    a.exit.duration_since(b.enter),
                    i + 1,
                    b.token
                ));
            }
            if b.token <= a.token {
                problems.push(format!(
                    "fencing tokens not strictly increasing: section #{i} had token {}, section #{} had token {}",
                    a.token,
                    i + 1,
                    b.token
                ));
            }
        }
        // The "still inside" note alone is not a failure.
        let failing = problems.iter().filter(|p| !p.starts_with("note:")).count();
        if failing > 0 {
            let mut msg = format!(
                "mutual-exclusion checker failed ({} completed sections, tokens {:?}{}):",
                recs.len(),
                recs.iter().map(|r| r.token).take(50).collect::<Vec<_>>(),
                if recs.len() > 50 { ", ..." } else { "" }
            );
            for p in problems.iter().take(30) {
                let _ = write!(msg, "\n  - {p}");
            }
            panic!("{msg}");
        }
    }
}

/// One critical section, from [`Checker::enter`] to [`Section::exit`] (or drop).
#[derive(Debug)]
pub struct Section {
    checker: Checker,
    token: u64,
    seq: u64,
    enter: Instant,
}

impl Section {
    /// Call just before releasing the lock. Records (token, enter, exit).
    pub fn exit(self) {
        // Recording happens in Drop.
    }

    /// The fencing token this section was entered with.
    pub fn token(&self) -> u64 {
        self.token
    }
}

impl Drop for Section {
    fn drop(&mut self) {
        let exit = Instant::now();
        let inner = &self.checker.inner;
        lock(&inner.records).push(Record {
            seq: self.seq,
            token: self.token,
            enter: self.enter,
            exit,
        });
        inner.inside.fetch_sub(1, Ordering::SeqCst);
    }
}
