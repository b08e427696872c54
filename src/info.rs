//! `LockInfo`: what the store knows about one lock, for operators ("who holds it?").

use std::fmt;
use std::time::Duration;

/// What the store knows about one lock, from [`Lock::inspect`](crate::Lock::inspect) (and
/// `redlease inspect NAME`). It never carries the holder's secret token: only its public
/// [label](crate::LockOptions::holder_label).
///
/// A snapshot: by the time you read it the lock may have changed hands.
///
/// ```
/// use redlease::{LockManager, LockOptions, MemoryBackend};
/// # futures::executor::block_on(async {
/// let locks = LockManager::with_options(
///     MemoryBackend::new(),
///     LockOptions::new().holder_label("billing-worker-2"),
/// )?;
/// let lock = locks.lock("invoices");
/// assert!(lock.inspect().await?.is_none());          // never held: no trace
/// let guard = lock.acquire().await?;
/// let info = lock.inspect().await?.expect("held");
/// assert!(info.held);
/// assert_eq!(info.fencing_token, Some(guard.fencing_token()));
/// assert_eq!(info.holder_label.as_deref(), Some("billing-worker-2"));
/// assert!(info.remaining.is_some());
/// guard.release().await?;
/// let after = lock.inspect().await?.expect("the fence is remembered");
/// assert!(!after.held);
/// assert_eq!(after.holder_label, None);
/// println!("{after}");
/// # Ok::<(), redlease::Error>(()) }).unwrap();
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// Whether a lease is held now.
    pub held: bool,
    /// The holder's remaining TTL on the store (`None` when not held).
    pub remaining: Option<Duration>,
    /// The last fencing token granted for this name, held or not (`None` when the store has
    /// forgotten it: Redis keeps it for an hour after the last grant or release).
    pub fencing_token: Option<u64>,
    /// Waiters in the fair (FIFO) queue that are still alive.
    pub queue_len: u64,
    /// For a reentrant lock, how many holds the owner has taken (the sum of the owners'
    /// counts); `None` when the lock is not held reentrantly.
    pub reentrant_count: Option<u64>,
    /// The holder's [label](crate::LockOptions::holder_label), if it set one (`None` when
    /// not held, and while shared holds run: see `shared_labels`).
    pub holder_label: Option<String>,
    /// For a lock held in a shared mode (the reads of a [`RwLock`](crate::RwLock), the
    /// permits of a [`Semaphore`](crate::Semaphore)), how many holds are live; `None`
    /// otherwise.
    pub shared_holds: Option<u64>,
    /// The labels of the live shared holds that have one (in no particular order).
    pub shared_labels: Vec<String>,
}

impl LockInfo {
    /// An empty record (nothing held, nothing known), for [`Backend`](crate::Backend)
    /// implementors to fill in.
    ///
    /// ```
    /// let mut info = redlease::LockInfo::new();
    /// info.held = true;
    /// assert!(info.held && info.fencing_token.is_none());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the record says nothing at all (not held, no fencing token, no waiters, no
    /// reentrant count): the store has no trace of the lock.
    pub(crate) fn is_blank(&self) -> bool {
        !self.held
            && self.fencing_token.is_none()
            && self.queue_len == 0
            && self.reentrant_count.is_none()
            && self.shared_holds.is_none()
    }
}

/// One `field: value` line per field, as `redlease inspect` prints it.
impl fmt::Display for LockInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "held: {}", if self.held { "yes" } else { "no" })?;
        if let Some(label) = &self.holder_label {
            // Escaped: a label is anyone's text, and must not fake lines of this output.
            writeln!(f, "holder: {}", label.escape_debug())?;
        } else if self.held && self.shared_holds.is_none() {
            writeln!(f, "holder: (no label)")?;
        }
        if let Some(r) = self.remaining {
            writeln!(f, "ttl left: {} ms", r.as_millis())?;
        }
        match self.fencing_token {
            Some(t) => writeln!(f, "fencing token: {t}")?,
            None => writeln!(f, "fencing token: (none recorded)")?,
        }
        writeln!(f, "queued: {}", self.queue_len)?;
        if let Some(n) = self.reentrant_count {
            writeln!(f, "reentrant count: {n}")?;
        }
        if let Some(n) = self.shared_holds {
            writeln!(f, "shared holds: {n}")?;
            for label in &self.shared_labels {
                writeln!(f, "shared holder: {}", label.escape_debug())?;
            }
        }
        Ok(())
    }
}
