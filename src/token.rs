//! Lease tokens (who owns a lease) and lease keys (where a lock lives in the store).

use std::fmt;
use std::sync::Arc;

/// The secret value a lease is stored under: 128 bits from a CSPRNG, as 32 hex digits.
///
/// Every acquire makes a fresh token, so two acquirers never share one (the seeds'
/// `LockTake("LockTakeValue")` pitfall, where every caller used one value and could release
/// each other's lock, cannot happen). Release and extend compare it on the server.
///
/// `Debug` shows only a prefix: the token is a capability to release the lease.
///
/// ```
/// let a = redlease::Token::random();
/// let b = redlease::Token::random();
/// assert_ne!(a, b);
/// assert_eq!(a.as_str().len(), 32);
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token(Arc<str>);

impl Token {
    /// A fresh token from the thread-local CSPRNG (ChaCha, seeded by the OS).
    pub fn random() -> Self {
        let bits: u128 = rand::random();
        Token(format!("{bits:032x}").into())
    }

    /// The token as stored in the backend.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}…)", &self.0[..self.0.len().min(6)])
    }
}

/// Where one lock lives: `<prefix>{<name>}`, plus the derived keys that share its hash tag.
///
/// Every key of one lock carries the same `{...}` hash tag, so multi-key scripts stay in one
/// slot on Redis Cluster. The name is escaped (`%` → `%25`, `{` → `%7B`, `}` → `%7D`) so that
/// any name (braces, unicode, NUL, 10 KB) maps to a distinct key with a non-empty tag.
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
#[derive(Clone, PartialEq, Eq, Hash)]
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

    /// A key beside the lease that shares its hash tag: `<key>:<suffix>`.
    pub fn derived(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.0)
    }
}

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.0.chars().take(80).collect();
        write!(f, "LeaseKey({shown:?})")
    }
}

impl fmt::Display for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
