//! Who holds a lease ([`Token`], [`Owner`]) and where a lock lives ([`LeaseKey`]).

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

    /// The token without its label (what the watchdog keeps of it: a held lease is kept
    /// small).
    pub(crate) fn secret(&self) -> &Arc<str> {
        &self.secret
    }

    /// The token whose secret is `secret`, with no label.
    pub(crate) fn from_secret(secret: Arc<str>) -> Self {
        Token {
            secret,
            label: None,
        }
    }

    /// The holder description carried with this token, if any.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// A fresh token for one hold of a reentrant lock (see
    /// [`ClaimKind::Reentrant`](crate::backend::ClaimKind::Reentrant)): 128 bits from the
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

    /// A fresh token for one shared hold (a read of a read-write lock, a semaphore's permit:
    /// see [`ClaimKind::Read`](crate::backend::ClaimKind::Read)): 128 bits from the CSPRNG,
    /// as `s` and 32 hex digits, so that a store can tell a shared hold's lease by its token
    /// when it extends it.
    ///
    /// ```
    /// let permit = redlease::Token::shared();
    /// assert!(permit.is_shared() && !permit.is_hold());
    /// assert!(!redlease::Token::random().is_shared());
    /// ```
    pub fn shared() -> Self {
        let bits: u128 = rand::random();
        Token {
            secret: format!("s{bits:032x}").into(),
            label: None,
        }
    }

    /// Whether this token was made by [`shared`](Self::shared).
    pub fn is_shared(&self) -> bool {
        self.secret.starts_with('s')
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

    /// The lock's name as the key holds it between its braces, when it needed no escape
    /// there (`None` if it did: the braces hold `%XX` escapes).
    pub(crate) fn plain_name(&self) -> Option<&str> {
        let inner = &self.0[self.0.find('{')? + 1..self.0.rfind('}')?];
        (!inner.contains('%')).then_some(inner)
    }

    /// A key beside the lease that shares its hash tag: `<key>:<suffix>`.
    pub fn derived(&self, suffix: &str) -> String {
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

/// Who holds a reentrant lock: holds by the same owner nest instead of excluding each other.
///
/// An async task is not a thread: it moves between threads at every `.await`, and one
/// thread runs many tasks, so a thread id (what Java's reentrant locks use) says nothing
/// about who holds a lock. The owner is therefore explicit: make one per logical holder (a
/// request, a job) and pass it down to the code that locks.
///
/// [`Owner::named`] lets separate processes act as one owner (say, two workers of one job):
/// anyone with the name shares the lock, so treat it like a credential.
///
/// ```
/// use redlease::Owner;
/// let me = Owner::random();
/// assert_ne!(me, Owner::random());
/// assert_eq!(Owner::named("job-1234"), Owner::named("job-1234"));
/// assert_eq!(Owner::named("job-1234").as_str(), "job-1234");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<str>);

impl Owner {
    /// A fresh owner: 128 random bits, as 32 hex digits.
    pub fn random() -> Self {
        let bits: u128 = rand::random();
        Owner(format!("{bits:032x}").into())
    }

    /// The owner called `name` (a job id, say); every holder using the same name is the
    /// same owner, in any process. An empty name is refused with
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) when the lock is made.
    pub fn named(name: impl AsRef<str>) -> Self {
        Owner(name.as_ref().into())
    }

    /// The owner's id, as stored (the field of the `:owners` hash on Redis).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.0.chars().take(40).collect();
        write!(f, "Owner({shown:?})")
    }
}
