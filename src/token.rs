//! Lease tokens (who owns a lease) and lease keys (where a lock lives in the store).

use std::fmt;
use std::sync::Arc;

/// The secret value a lease is stored under: 128 bits from a CSPRNG, as 32 hex digits, plus
/// an optional public description of the holder (its *label*).
///
/// Every acquire makes a fresh token, so two acquirers never share one (the seeds'
/// `LockTake("LockTakeValue")` pitfall, where every caller used one value and could release
/// each other's lock, cannot happen). Release and extend compare it on the server.
///
/// `Debug` shows only a prefix: the token is a capability to release the lease. The label is
/// not part of the token's identity (equality and hashing look at the secret only); a store
/// keeps it beside the lease when it grants one, for
/// [`Lock::inspect`](crate::Lock::inspect) to show.
///
/// ```
/// let a = redlease::Token::random();
/// let b = redlease::Token::random();
/// assert_ne!(a, b);
/// assert_eq!(a.as_str().len(), 32);
/// let labelled = a.clone().with_label(Some("worker-3".into()));
/// assert_eq!(labelled, a);                       // same secret, same token
/// assert_eq!(labelled.label(), Some("worker-3"));
/// ```
#[derive(Clone)]
pub struct Token {
    secret: Arc<str>,
    label: Option<Arc<str>>,
}

impl Token {
    /// A fresh token from the thread-local CSPRNG (ChaCha, seeded by the OS).
    pub fn random() -> Self {
        let bits: u128 = rand::random();
        Token {
            secret: format!("{bits:032x}").into(),
            label: None,
        }
    }

    /// The same token, carrying `label` (a holder description, see
    /// [`LockOptions::holder_label`](crate::LockOptions::holder_label)) to the store.
    pub fn with_label(mut self, label: Option<Arc<str>>) -> Self {
        self.label = label;
        self
    }

    /// The token as stored in the backend.
    pub fn as_str(&self) -> &str {
        &self.secret
    }

    /// The holder description carried with this token, if any.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// A fresh token for one hold of a reentrant lock (see
    /// [`Backend::reentrant_acquire`](crate::Backend::reentrant_acquire)): 128 bits from the
    /// CSPRNG, as `h` and 32 hex digits. The hold that starts a reign is also the lease's
    /// token, so a store can tell a reentrant lease from a plain one by its token when it
    /// extends it (a reentrant lease has more keys to keep alive).
    ///
    /// ```
    /// let hold = redlease::Token::hold();
    /// assert!(hold.is_hold());
    /// assert!(!redlease::Token::random().is_hold());
    /// assert_eq!(hold.as_str().len(), 33);
    /// ```
    pub fn hold() -> Self {
        let bits: u128 = rand::random();
        Token {
            secret: format!("h{bits:032x}").into(),
            label: None,
        }
    }

    /// A token as read back from the store (a reign's lease token).
    pub(crate) fn from_store(s: &str) -> Self {
        Token {
            secret: s.into(),
            label: None,
        }
    }

    /// Whether this token was made by [`hold`](Self::hold) (hex digits never include `h`).
    pub fn is_hold(&self) -> bool {
        self.secret.starts_with('h')
    }
}

impl PartialEq for Token {
    fn eq(&self, other: &Self) -> bool {
        self.secret == other.secret
    }
}

impl Eq for Token {}

impl std::hash::Hash for Token {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.secret.hash(state);
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}…)", &self.secret[..self.secret.len().min(6)])
    }
}

/// Where one lock lives: `<prefix>{<name>}`, plus the derived keys that share its hash tag.
///
/// Every key of one lock carries the same `{...}` hash tag, so multi-key scripts stay in one
/// slot on Redis Cluster. The name is escaped (`%` → `%25`, `{` → `%7B`, `}` → `%7D`) so that
/// any name (braces, unicode, NUL, 10 KB) maps to a distinct key with a non-empty tag. Cheap
/// to clone (one shared string); the derived names are made when a call needs them.
///
/// ```
/// let k = redlease::LeaseKey::new("redlease:", "orders:42");
/// assert_eq!(k.as_str(), "redlease:{orders:42}");
/// assert_eq!(k.derived("fence"), "redlease:{orders:42}:fence");
/// assert_ne!(
///     redlease::LeaseKey::new("p:", "a}b").as_str(),
///     redlease::LeaseKey::new("p:", "a%7Db").as_str()
/// );
/// ```
#[derive(Clone)]
pub struct LeaseKey(Arc<str>);

/// The derived names' suffixes, in [`Part`] order.
const PARTS: [&str; 8] = [
    "fence",
    "abandoned",
    "released",
    "queue",
    "timeouts",
    "handoff",
    "owners",
    "holds",
];

/// A derived name of a lock (the Redis layout's keys and channel beside the lease).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Part {
    Fence = 0,
    Abandoned = 1,
    Released = 2,
    /// Fair locks: the list of waiting tokens, in arrival order.
    Queue = 3,
    /// Fair locks: the sorted set of waiting tokens by deadline (server time, ms).
    Timeouts = 4,
    /// Fair locks: the channel a release publishes the new queue head's token on.
    Handoff = 5,
    /// Reentrant locks: the hash {owner: hold count} of the reign holding the lease.
    Owners = 6,
    /// Reentrant locks: the reign's live holds {hold token: 1}, plus its `owner`, `token`
    /// (the lease token) and `fence`.
    Holds = 7,
}

/// A name beside a cached key's compute lease (see the stampede module). Made when used, not
/// stored with every key: most keys are plain locks, and each held lease keeps its key.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CachePart {
    /// The cached value (payload, compute time, grace).
    Value,
    /// The channel a cache fill (or a failed compute) is published on.
    Filled,
    /// Failed compute rounds, by round, for waiters in other processes.
    Failed,
}

impl LeaseKey {
    /// The key of lock `name` under `prefix`. The caller validates both (non-empty name,
    /// prefix without braces); see [`LockOptions::validate`](crate::LockOptions::validate).
    pub fn new(prefix: &str, name: &str) -> Self {
        let mut key = String::with_capacity(prefix.len() + name.len() + 2);
        key.push_str(prefix);
        key.push('{');
        for c in name.chars() {
            match c {
                '%' => key.push_str("%25"),
                '{' => key.push_str("%7B"),
                '}' => key.push_str("%7D"),
                c => key.push(c),
            }
        }
        key.push('}');
        LeaseKey(key.into())
    }

    /// The lease key itself.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A key beside the lease that shares its hash tag: `<key>:<suffix>`.
    pub fn derived(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.as_str())
    }

    /// A derived name, made when used: a held lease keeps only its key (the watchdog may
    /// hold a hundred thousand of them), and the calls that need these names send them
    /// once.
    pub(crate) fn part(&self, part: Part) -> String {
        self.derived(PARTS[part as usize])
    }

    /// A cache name beside this key: `<key>:value`, `<key>:filled` or `<key>:failed`.
    pub(crate) fn cache_part(&self, part: CachePart) -> String {
        let suffix = match part {
            CachePart::Value => "value",
            CachePart::Filled => "filled",
            CachePart::Failed => "failed",
        };
        format!("{}:{suffix}", self.as_str())
    }
}

impl PartialEq for LeaseKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for LeaseKey {}

impl std::hash::Hash for LeaseKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.as_str().chars().take(80).collect();
        write!(f, "LeaseKey({shown:?})")
    }
}

impl fmt::Display for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_the_derived_names() {
        let k = LeaseKey::new("p:", "a{b}");
        for (part, suffix) in [
            (Part::Fence, "fence"),
            (Part::Abandoned, "abandoned"),
            (Part::Released, "released"),
            (Part::Queue, "queue"),
            (Part::Timeouts, "timeouts"),
            (Part::Handoff, "handoff"),
            (Part::Owners, "owners"),
            (Part::Holds, "holds"),
        ] {
            assert_eq!(k.part(part), k.derived(suffix));
        }
        assert_eq!(k.as_str(), "p:{a%7Bb%7D}");
        assert_eq!(k.cache_part(CachePart::Value), k.derived("value"));
        assert_eq!(k.cache_part(CachePart::Filled), k.derived("filled"));
        assert_eq!(k.cache_part(CachePart::Failed), k.derived("failed"));
    }
}
