//! The record of every critical section, and what counts as an overlap.
//!
//! The rules are the test checker's (tests/support/checker.rs), kept per lock name: a section
//! that enters while another section of the same name is inside is an overlap (an "inside"
//! list per name, read at entry), and fencing tokens must be strictly increasing in entry
//! order. Both are checked twice: live, at entry, and after the run, from the recorded
//! enter/exit times (both timestamps are taken under the name's mutex, so the two agree).
//!
//! One addition: lost leases. A lease only promises that its holder is told when it can no
//! longer be guaranteed (`is_lost()`, `lost()`), no later than its deadline. So a section that
//! is still inside when another enters breaks mutual exclusion only if its own lease was not
//! yet known lost at that moment. "Known lost at" is the earlier of the guard's deadline
//! (`valid_until()`, the end of what was promised) and the moment the loss was seen: a lease
//! refused by the store before its deadline counts from when it was refused and seen, so a
//! store that forgets a lease early shows up as an overlap. Overlaps after a loss are counted
//! apart; a well-behaved holder (here: one that races its work against `lost()`) leaves at once.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Who ran a section: (manager, task).
pub type Who = (usize, usize);

/// Every section of a run, per lock name. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Book {
    names: Vec<Mutex<Slot>>,
    records: Mutex<Vec<Record>>,
    next_id: AtomicU64,
    /// Completed sections, for the stop condition.
    done: AtomicUsize,
}

#[derive(Debug, Default)]
struct Slot {
    /// Sections of this name inside now.
    inside: Vec<u64>,
    /// The largest token entered so far, and its section.
    last: Option<(u64, u64)>,
}

/// One completed critical section.
#[derive(Clone, Debug)]
pub struct Record {
    pub id: u64,
    pub name: usize,
    pub who: Who,
    pub token: u64,
    pub enter: Instant,
    pub exit: Instant,
    /// When the lease was known lost, if it was by the exit.
    pub lost_at: Option<Instant>,
    /// Sections of the same name that were inside when this one entered (the live check).
    pub met: Vec<u64>,
    /// The section with the largest token so far, when this token was not above it.
    pub behind: Option<(u64, u64)>,
}

/// A section between [`Book::enter`] and [`Section::exit`].
#[derive(Debug)]
pub struct Section {
    book: Arc<Book>,
    id: u64,
    name: usize,
    who: Who,
    token: u64,
    enter: Instant,
    met: Vec<u64>,
    behind: Option<(u64, u64)>,
}

/// Two sections of one name that were inside at once: `later` entered while `earlier` was in.
#[derive(Clone, Debug)]
pub struct Pair {
    pub earlier: Record,
    pub later: Record,
}

/// What the records come to.
#[derive(Debug, Default)]
pub struct Verdict {
    pub sections: usize,
    /// Sections whose lease was known lost by their exit.
    pub lost: usize,
    /// Overlaps where the earlier section's lease was not known lost: mutual exclusion broken.
    pub overlaps: Vec<Pair>,
    /// Overlaps where the earlier section had been told its lease was lost before the later
    /// one entered.
    pub overlaps_after_loss: Vec<Pair>,
    /// Entries whose token was not above every token entered before on that name (`earlier`:
    /// the section holding the larger token), with the later lease not lost at its entry.
    pub token_order: Vec<Pair>,
    /// The same, but the later section's own lease was known lost before it entered.
    pub token_order_after_loss: Vec<Pair>,
    /// Overlaps seen by the live check at entry (pairs), to set beside the ones found after
    /// the run from the timestamps.
    pub live_pairs: usize,
    pub post_hoc_pairs: usize,
    /// Token-order breaks seen live at entry, beside the ones found after the run.
    pub live_token_breaks: usize,
    pub post_hoc_token_breaks: usize,
}

impl Book {
    pub fn new(names: usize) -> Arc<Book> {
        Arc::new(Book {
            names: (0..names).map(|_| Mutex::new(Slot::default())).collect(),
            records: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            done: AtomicUsize::new(0),
        })
    }

    /// Call right after acquiring, with the guard's fencing token.
    pub fn enter(self: &Arc<Self>, name: usize, who: Who, token: u64) -> Section {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut slot = lock(&self.names[name]);
        let met = slot.inside.clone();
        let behind = slot.last.filter(|&(_, last)| token <= last);
        if behind.is_none() {
            slot.last = Some((id, token));
        }
        slot.inside.push(id);
        // Under the name's mutex, after joining the inside list: a section that exits before
        // this one enters has exit <= enter.
        let enter = Instant::now();
        drop(slot);
        Section {
            book: self.clone(),
            id,
            name,
            who,
            token,
            enter,
            met,
            behind,
        }
    }

    /// Completed sections so far.
    pub fn done(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }

    /// Sections inside now (0 once every task has stopped).
    pub fn inside(&self) -> usize {
        self.names.iter().map(|s| lock(s).inside.len()).sum()
    }

    /// Sorts the records out; see the module docs for the rules.
    pub fn verdict(&self) -> Verdict {
        let records = lock(&self.records).clone();
        let by_id: std::collections::HashMap<u64, &Record> =
            records.iter().map(|r| (r.id, r)).collect();
        let mut v = Verdict {
            sections: records.len(),
            lost: records.iter().filter(|r| r.lost_at.is_some()).count(),
            ..Verdict::default()
        };
        let known_lost_by = |r: &Record, t: Instant| r.lost_at.is_some_and(|l| l <= t);
        // Live: what each section met at its entry.
        for later in &records {
            for id in &later.met {
                // Every task has stopped, so every section it met has its record.
                let Some(earlier) = by_id.get(id) else {
                    continue;
                };
                v.live_pairs += 1;
                let pair = Pair {
                    earlier: (*earlier).clone(),
                    later: later.clone(),
                };
                if known_lost_by(earlier, later.enter) {
                    v.overlaps_after_loss.push(pair);
                } else {
                    v.overlaps.push(pair);
                }
            }
            if let Some((id, _)) = later.behind {
                v.live_token_breaks += 1;
                let Some(earlier) = by_id.get(&id) else {
                    continue;
                };
                let pair = Pair {
                    earlier: (*earlier).clone(),
                    later: later.clone(),
                };
                if known_lost_by(later, later.enter) {
                    v.token_order_after_loss.push(pair);
                } else {
                    v.token_order.push(pair);
                }
            }
        }
        // After the run, from the timestamps alone (the checker's post-hoc rules).
        for name in 0..self.names.len() {
            let mut mine: Vec<&Record> = records.iter().filter(|r| r.name == name).collect();
            mine.sort_by_key(|r| (r.enter, r.id));
            let mut open: Vec<&Record> = Vec::new();
            let mut top = 0u64;
            for r in mine {
                open.retain(|o| o.exit > r.enter);
                v.post_hoc_pairs += open.len();
                open.push(r);
                if r.token <= top {
                    v.post_hoc_token_breaks += 1;
                }
                top = top.max(r.token);
            }
        }
        v
    }
}

impl Section {
    /// Call just before releasing, with when the lease was known lost (if it was).
    pub fn exit(self, lost_at: Option<Instant>) {
        let book = &self.book;
        let mut slot = lock(&book.names[self.name]);
        let exit = Instant::now();
        slot.inside.retain(|&i| i != self.id);
        drop(slot);
        lock(&book.records).push(Record {
            id: self.id,
            name: self.name,
            who: self.who,
            token: self.token,
            enter: self.enter,
            exit,
            lost_at,
            met: self.met,
            behind: self.behind,
        });
        book.done.fetch_add(1, Ordering::Relaxed);
    }
}
