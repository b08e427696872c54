//! Shared-hold checker: records the sections of a semaphore's permits or a read-write lock's
//! reads and writes, and counts the moments its rule was broken: more than `max` shared
//! holders at once, a writer inside with anyone else, or a writer's fencing token not
//! greater than every token entered before it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Cheap to clone (an `Arc` inside); `Send + Sync`.
#[derive(Clone, Debug)]
pub struct SharedChecker {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    max: usize,
    state: Mutex<State>,
    violations: AtomicUsize,
    sections: AtomicU64,
    /// The most shared holders seen inside at once.
    peak: AtomicUsize,
}

#[derive(Debug, Default)]
struct State {
    shared: usize,
    writers: usize,
    /// The largest fencing token entered so far.
    top: u64,
    notes: Vec<String>,
}

/// One section inside; exits on [`SharedSection::exit`] or drop.
#[derive(Debug)]
pub struct SharedSection {
    checker: SharedChecker,
    writer: bool,
    done: bool,
}

impl SharedChecker {
    /// At most `max` shared holders at once (`usize::MAX` for the reads of a read-write lock).
    pub fn new(max: usize) -> SharedChecker {
        SharedChecker {
            inner: Arc::new(Inner {
                max,
                state: Mutex::new(State::default()),
                violations: AtomicUsize::new(0),
                sections: AtomicU64::new(0),
                peak: AtomicUsize::new(0),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn violate(&self, st: &mut State, note: String) {
        self.inner.violations.fetch_add(1, Ordering::SeqCst);
        if st.notes.len() < 20 {
            st.notes.push(note);
        }
    }

    /// A permit holder or a reader enters, with its fencing token.
    pub fn enter_shared(&self, token: u64) -> SharedSection {
        let mut st = self.state();
        st.shared += 1;
        if st.shared > self.inner.max {
            let note = format!(
                "{} shared holders inside (max {})",
                st.shared, self.inner.max
            );
            self.violate(&mut st, note);
        }
        if st.writers > 0 {
            let note = format!("a shared holder (token {token}) entered while a writer was inside");
            self.violate(&mut st, note);
        }
        st.top = st.top.max(token);
        self.inner.peak.fetch_max(st.shared, Ordering::SeqCst);
        SharedSection {
            checker: self.clone(),
            writer: false,
            done: false,
        }
    }

    /// A writer enters, with its fencing token: alone, and with a token greater than every
    /// one entered before.
    pub fn enter_writer(&self, token: u64) -> SharedSection {
        let mut st = self.state();
        st.writers += 1;
        if st.writers > 1 || st.shared > 0 {
            let note = format!(
                "a writer (token {token}) entered with {} writer(s) and {} shared holder(s) inside",
                st.writers - 1,
                st.shared
            );
            self.violate(&mut st, note);
        }
        if token <= st.top {
            let note = format!(
                "a writer's token {token} is not above the last token {}",
                st.top
            );
            self.violate(&mut st, note);
        }
        st.top = st.top.max(token);
        SharedSection {
            checker: self.clone(),
            writer: true,
            done: false,
        }
    }

    /// Broken rules counted so far.
    pub fn violations(&self) -> usize {
        self.inner.violations.load(Ordering::SeqCst)
    }

    /// Sections completed.
    pub fn sections(&self) -> u64 {
        self.inner.sections.load(Ordering::SeqCst)
    }

    /// The most shared holders inside at once.
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::SeqCst)
    }

    /// What went wrong, for an assertion's message.
    pub fn report(&self) -> String {
        let st = self.state();
        format!(
            "{} violation(s) over {} sections (peak {} shared): {:?}",
            self.violations(),
            self.sections(),
            self.peak(),
            st.notes
        )
    }
}

impl SharedSection {
    /// Leaves the section (call just before releasing, or when the holder "crashes").
    pub fn exit(mut self) {
        self.leave();
    }

    fn leave(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let mut st = self.checker.state();
        if self.writer {
            st.writers -= 1;
        } else {
            st.shared -= 1;
        }
        self.checker.inner.sections.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for SharedSection {
    fn drop(&mut self) {
        self.leave();
    }
}
