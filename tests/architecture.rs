//! The architecture test: the import rules of ARCHITECTURE.md ("What must never import
//! what"), checked on the source.
//!
//! It reads every `.rs` file under `src/`, finds the references to the crate's own modules in
//! code (`use crate::…` lines, multi-line `use crate::{a::{b, c}, d}` groups, `super::` and
//! `self::` paths, inline paths like `crate::telemetry::lost()`; never comments, doc comments
//! or string literals, where intra-doc links may point anywhere), maps each file to its module
//! (`src/backend/redis/ops.rs` is `backend::redis::ops`) and each reference to the deepest
//! module file it names, and checks the graph against the rules below. A reference through
//! the crate root (`crate::LeaseKey`) is followed through the `use` items of `src/lib.rs` to
//! the module that defines it.
//!
//! The rules are data: edit [`LAYERS`], [`FORBIDDEN`], [`CONFINED_CRATES`] and
//! [`PUBLIC_API_ONLY`], and keep ARCHITECTURE.md in step. Std only, no dependencies.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

// ---------------------------------------------------------------------------------------
// The rules.
// ---------------------------------------------------------------------------------------

/// The layers, top to bottom, each with the modules it holds (a module stands for its file
/// and all its submodules: `backend` is backend.rs and backend/**). A file may reference its
/// own layer or a lower one, never a higher one; within a layer anything goes but a cycle.
/// A file in no layer is reported: place every new top-level module here.
const LAYERS: &[(&str, &[&str])] = &[
    ("stampede", &["stampede"]),
    ("lock", &["lock"]),
    ("acquire", &["acquire"]),
    ("guard", &["guard"]),
    ("watchdog", &["watchdog"]),
    ("backend", &["backend"]),
    (
        "basics",
        &["error", "token", "options", "info", "telemetry", "runtime"],
    ),
];

/// References forbidden beyond the layering: a file in module `from` (or under it), unless
/// in one of `except`, never references `to` (or anything under it).
struct Forbid {
    from: &'static str,
    except: &'static [&'static str],
    to: &'static [&'static str],
    why: &'static str,
}

const FORBIDDEN: &[Forbid] = &[
    Forbid {
        from: "backend",
        except: &[],
        to: &["lock", "acquire", "guard", "watchdog", "stampede"],
        why: "a store knows claims and leases, nothing of locks, guards, the watchdog or the cache",
    },
    Forbid {
        from: "backend::redlock",
        except: &[],
        to: &["backend::redis", "backend::memory"],
        why: "Redlock composes any Backend and names no concrete store",
    },
    Forbid {
        from: "backend::memory",
        except: &[],
        to: &["backend::redis", "backend::redlock", "backend::values"],
        why: "the memory store knows no other store, and nothing of the cache",
    },
    Forbid {
        from: "backend::redis",
        except: &["backend::redis::connect"],
        to: &["backend::redlock"],
        why: "in the Redis store only connect.rs, which hosts Redlock::connect, names Redlock",
    },
    Forbid {
        from: "backend::redis",
        except: &["backend::redis::transport", "backend::redis::connect"],
        to: &[
            "backend::redis::transport::fred",
            "backend::redis::transport::redis_rs",
        ],
        why: "the Redis backend's logic reaches a client only through the seam (transport.rs); \
              connect.rs picks the client a backend is opened with",
    },
    Forbid {
        from: "backend::etcd",
        except: &[],
        to: &[
            "backend::redis",
            "backend::memory",
            "backend::redlock",
            "backend::postgres",
        ],
        why: "a store knows no other store",
    },
    Forbid {
        from: "backend::postgres",
        except: &[],
        to: &[
            "backend::redis",
            "backend::memory",
            "backend::redlock",
            "backend::etcd",
        ],
        why: "a store knows no other store",
    },
    Forbid {
        from: "backend::redis::transport::fred",
        except: &[],
        to: &["backend::redis::transport::redis_rs"],
        why: "each client's code stands alone below the seam",
    },
    Forbid {
        from: "backend::redis::transport::redis_rs",
        except: &[],
        to: &["backend::redis::transport::fred"],
        why: "each client's code stands alone below the seam",
    },
];

/// External crates that may be named (`use fred…`, `fred::…` in code) only in the source
/// files under these paths (a path ending in `/` is a directory).
const CONFINED_CRATES: &[(&str, &[&str])] = &[
    (
        "fred",
        &[
            "src/backend/redis/transport/fred.rs",
            "src/backend/redis/transport/fred/",
        ],
    ),
    (
        "redis",
        &[
            "src/backend/redis/transport/redis_rs.rs",
            "src/backend/redis/transport/redis_rs/",
        ],
    ),
    ("etcd_client", &["src/backend/etcd.rs", "src/backend/etcd/"]),
    (
        "tokio_postgres",
        &["src/backend/postgres.rs", "src/backend/postgres/"],
    ),
    (
        "deadpool_postgres",
        &["src/backend/postgres.rs", "src/backend/postgres/"],
    ),
];

/// Source paths that are other crates using the public API only: no `crate::` at all, and
/// not part of the module graph.
const PUBLIC_API_ONLY: &[&str] = &["src/bin/"];

// ---------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------

#[test]
fn the_source_tree_keeps_its_architecture() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    read_tree(root, &root.join("src"), &mut files);
    assert!(
        files.iter().any(|(p, _)| p == "src/lib.rs"),
        "src/lib.rs not found under {}",
        root.display()
    );
    let report = check(&files);
    if std::env::var_os("ARCHITECTURE_DUMP").is_some() {
        // `ARCHITECTURE_DUMP=1 cargo test --test architecture -- --nocapture`: the graph.
        for e in &report.edges {
            let how = if e.structural { " (own child)" } else { "" };
            println!(
                "{} → {}{how}    line {}: `{}`",
                e.from, e.to, e.line, e.written
            );
        }
    }
    // The checker must see the imports at all: the lock facade hands claims to the engine.
    assert!(
        report
            .edges
            .iter()
            .any(|e| e.from == "lock" && e.to == "acquire"),
        "the checker found no reference from src/lock.rs to src/acquire.rs: it no longer sees \
         imports (or the lock layer no longer uses the engine: update this test)"
    );
    assert!(
        report.violations.is_empty(),
        "{} architecture violation(s); the rules are at the top of tests/architecture.rs, the \
         map in ARCHITECTURE.md:\n{}\n",
        report.violations.len(),
        report.violations.join("\n")
    );
}

/// The checker can fail: a fake tree with a planted cycle, an upward import and the other
/// kinds of violation is reported, line by line, and the allowed patterns are not.
#[test]
fn the_checker_reports_planted_violations() {
    let tree: &[(&str, &str)] = &[
        (
            "src/lib.rs",
            "mod backend;\nmod error;\nmod lock;\nmod stampede;\nmod token;\n\
             pub use token::Token;\npub mod futures {\n    pub use crate::lock::Lock;\n}\n",
        ),
        // A parent declaring and re-exporting its children, which reach it through `super`:
        // not a cycle.
        (
            "src/backend.rs",
            "mod memory;\nmod redis;\nmod redlock;\npub use memory::MemoryBackend;\n\
             pub use self::redis::RedisBackend;\nuse crate::error::Result;\n\
             pub struct Backendish;\n",
        ),
        // Comments, doc comments and strings may name anything.
        (
            "src/backend/memory.rs",
            "//! Like [`Lock`](crate::lock::Lock).\nuse super::Backendish;\n\
             /// See [`Cache`](crate::stampede::Cache).\nuse crate::token::Token;\n\
             const S: &str = \"crate::lock::Lock\"; /* crate::stampede::x() */\n\
             const R: &str = r#\"use crate::lock;\"#; const C: char = '{';\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        ),
        (
            "src/backend/redis.rs",
            "mod ops;\nmod transport;\nuse super::Backendish;\n",
        ),
        // A client's module may name its crate; a parent names it as its child `fred`.
        (
            "src/backend/redis/transport.rs",
            "pub(super) mod fred;\npub use fred::Client;\n",
        ),
        (
            "src/backend/redis/transport/fred.rs",
            "use fred::prelude::Client;\nuse super::Failure;\n",
        ),
        // Planted: the backend's logic reaching a client's module past the seam (line 1),
        // and naming a client crate (line 2).
        (
            "src/backend/redis/ops.rs",
            "use super::transport::fred::x;\nfn f() { redis::cmd(); }\n",
        ),
        // Planted: Redlock naming a concrete store.
        (
            "src/backend/redlock.rs",
            "use super::Backendish;\nfn f() { let _ = crate::backend::memory::x(); }\n",
        ),
        // Planted: an upward import in a multi-line group (line 3), and fred outside redis.
        (
            "src/lock.rs",
            "use crate::{\n    backend::MemoryBackend,\n    stampede::Cache,\n};\n\
             fn f() { fred::x(); }\n",
        ),
        // Through the crate root: `crate::Token` is token's, `crate::futures::Lock` lock's.
        (
            "src/stampede.rs",
            "use crate::lock::Lock;\nuse crate::Token;\nuse crate::futures::Lock as L;\n",
        ),
        // Planted: a cycle within basics.
        ("src/error.rs", "use crate::token::Token;\n"),
        ("src/token.rs", "pub fn t() {\n    crate::error::e();\n}\n"),
        // Planted: a file in no layer.
        ("src/newthing.rs", "use crate::error::Error;\n"),
        // Planted: a binary reaching inside the crate.
        (
            "src/bin/tool.rs",
            "fn main() {\n    use crate::Lock;\n    pub(crate) fn g() {}\n}\n",
        ),
    ];
    let files: Vec<(String, String)> = tree
        .iter()
        .map(|(p, s)| (p.to_string(), s.to_string()))
        .collect();
    let v = check(&files).violations;
    let all = v.join("\n");
    let has = |needles: &[&str]| v.iter().any(|m| needles.iter().all(|n| m.contains(n)));
    assert!(
        has(&["import cycle", "src/error.rs:1", "src/token.rs:2"]),
        "planted cycle not reported:\n{all}"
    );
    assert!(
        has(&["src/lock.rs:3", "crate::stampede::Cache", "layer lock"]),
        "planted upward import not reported:\n{all}"
    );
    assert!(
        has(&["src/lock.rs:5", "fred"]),
        "fred outside redis not reported:\n{all}"
    );
    assert!(
        has(&["src/backend/redis/ops.rs:1", "through the seam"]),
        "a client's module reached past the seam not reported:\n{all}"
    );
    assert!(
        has(&["src/backend/redis/ops.rs:2", "`redis` crate"]),
        "redis-rs outside its module not reported:\n{all}"
    );
    assert!(
        has(&["src/backend/redlock.rs:2", "crate::backend::memory::x"]),
        "redlock → memory not reported:\n{all}"
    );
    assert!(
        has(&["src/newthing.rs", "no layer"]),
        "unlayered file not reported:\n{all}"
    );
    assert!(
        has(&["src/bin/tool.rs:2", "crate::"]),
        "crate:: in src/bin not reported:\n{all}"
    );
    // The upward import also closes a cycle with stampede's import of lock.
    assert!(
        has(&["import cycle", "src/lock.rs:3", "src/stampede.rs:1"]),
        "lock ↔ stampede cycle not reported:\n{all}"
    );
    assert_eq!(
        v.len(),
        9,
        "expected exactly the planted violations:\n{all}"
    );
}

// ---------------------------------------------------------------------------------------
// The checker.
// ---------------------------------------------------------------------------------------

/// Reads every `.rs` file under `dir`, as (path relative to `root` with `/`, text).
fn read_tree(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            read_tree(root, &path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            let text = fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            let rel = path.strip_prefix(root).expect("under the root");
            let rel: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            out.push((rel.join("/"), text));
        }
    }
}

/// One reference from a module file to another, as the graph keeps it.
#[derive(Clone, Debug)]
struct Edge {
    /// Module paths, `""` for the crate root.
    from: String,
    to: String,
    line: usize,
    /// The path as written, e.g. `crate::backend::Claim`.
    written: String,
    /// A module reaching its own submodule by a relative path (`mod x;`, `pub use x::Y`,
    /// `use self::x`): how a parent owns its children; left out of cycle detection.
    structural: bool,
}

struct Report {
    edges: Vec<Edge>,
    violations: Vec<String>,
}

/// Checks `files` (paths `src/…`) against the rules.
fn check(files: &[(String, String)]) -> Report {
    let mut violations = Vec::new();
    let mut modules: BTreeMap<String, String> = BTreeMap::new(); // module → file
    let mut parsed: Vec<(String, String, Parsed)> = Vec::new(); // (file, module, refs)
    for (path, text) in files {
        if !path.starts_with("src/") || !path.ends_with(".rs") {
            continue;
        }
        if PUBLIC_API_ONLY.iter().any(|p| path.starts_with(p)) {
            let parsed = parse(text, &[], &BTreeSet::new());
            for r in &parsed.refs {
                if r.segs.first().is_some_and(|s| s == "crate") {
                    violations.push(format!(
                        "{path}:{}: `{}`: this file may use the public API only, never `crate::`",
                        r.line,
                        r.written()
                    ));
                }
            }
            confined(path, &parsed, &mut violations);
            continue;
        }
        let module = module_of(path);
        modules.insert(module.clone(), path.clone());
        parsed.push((path.clone(), module, Parsed::default()));
    }
    // Parse with the module set known (a bare path may name a child module).
    let texts: BTreeMap<&str, &str> = files
        .iter()
        .map(|(p, t)| (p.as_str(), t.as_str()))
        .collect();
    for (path, module, refs) in &mut parsed {
        let children: BTreeSet<String> = modules
            .keys()
            .filter_map(|m| child_name(module, m))
            .collect();
        *refs = parse(texts[path.as_str()], &split(module), &children);
    }
    for (path, _, refs) in &parsed {
        confined(path, refs, &mut violations);
    }
    // What the crate root's `use` items name: `crate::X` is followed through them.
    let root_uses: BTreeMap<Vec<String>, Target> = parsed
        .iter()
        .filter(|(_, m, _)| m.is_empty())
        .flat_map(|(_, _, refs)| refs.refs.iter())
        .filter(|r| r.kind == Kind::Use)
        .filter_map(|r| {
            let name = r.alias.clone().or_else(|| r.segs.last().cloned())?;
            let mut key = r.scope.clone();
            key.push(name);
            Some((key, r.target()))
        })
        .collect();

    let mut edges = Vec::new();
    for (path, module, refs) in &parsed {
        if module.is_empty() {
            continue; // the root re-exports everything
        }
        for r in &refs.refs {
            let abs = match r.target() {
                Target::Internal(abs, _) => abs,
                Target::External(_) => continue,
                Target::Invalid => {
                    violations.push(format!(
                        "{path}:{}: `{}` goes above the crate root",
                        r.line,
                        r.written()
                    ));
                    continue;
                }
            };
            let Some(to) = resolve(&abs, &modules, &root_uses, 0) else {
                violations.push(format!(
                    "{path}:{}: `{}` names an item of the crate root that this test cannot trace \
                     to a module: name the defining module (`crate::module::Item`)",
                    r.line,
                    r.written()
                ));
                continue;
            };
            if to.is_empty() || &to == module {
                continue;
            }
            let relative = matches!(r.target(), Target::Internal(_, true));
            edges.push(Edge {
                from: module.clone(),
                structural: relative && is_under(&to, module),
                to,
                line: r.line,
                written: r.written(),
            });
        }
    }

    let file = |m: &str| modules.get(m).cloned().unwrap_or_else(|| format!("<{m}>"));
    // Layers.
    for (path, module, _) in &parsed {
        if !module.is_empty() && layer_of(module).is_none() {
            violations.push(format!(
                "{path}: module `{module}` is in no layer: add it to LAYERS in tests/architecture.rs \
                 (and to ARCHITECTURE.md)"
            ));
        }
    }
    let order: Vec<&str> = LAYERS.iter().map(|(name, _)| *name).collect();
    for e in &edges {
        let (Some(from), Some(to)) = (layer_of(&e.from), layer_of(&e.to)) else {
            continue;
        };
        if to < from {
            violations.push(format!(
                "{}:{}: `{}` → {}: layer {} may not reference layer {} above it (top to bottom: {})",
                file(&e.from),
                e.line,
                e.written,
                file(&e.to),
                LAYERS[from].0,
                LAYERS[to].0,
                order.join(" > ")
            ));
        }
    }
    // Forbidden references.
    for e in &edges {
        for rule in FORBIDDEN {
            if is_under(&e.from, rule.from)
                && !rule.except.iter().any(|x| is_under(&e.from, x))
                && rule.to.iter().any(|t| is_under(&e.to, t))
            {
                violations.push(format!(
                    "{}:{}: `{}` → {}: {} may not reference {} ({})",
                    file(&e.from),
                    e.line,
                    e.written,
                    file(&e.to),
                    rule.from,
                    rule.to.join(", "),
                    rule.why
                ));
            }
        }
    }
    // Cycles.
    let nodes: Vec<&str> = modules
        .keys()
        .map(String::as_str)
        .filter(|m| !m.is_empty())
        .collect();
    let graph: Vec<&Edge> = edges.iter().filter(|e| !e.structural).collect();
    for scc in components(&nodes, &graph) {
        let members: BTreeSet<&str> = scc.iter().copied().collect();
        let mut lines: Vec<String> = graph
            .iter()
            .filter(|e| members.contains(e.from.as_str()) && members.contains(e.to.as_str()))
            .map(|e| {
                format!(
                    "    {}:{}: `{}` → {}",
                    file(&e.from),
                    e.line,
                    e.written,
                    file(&e.to)
                )
            })
            .collect();
        lines.sort();
        lines.dedup();
        let names: Vec<String> = members.iter().map(|m| file(m)).collect();
        violations.push(format!(
            "import cycle among {}; its references:\n{}",
            names.join(", "),
            lines.join("\n")
        ));
    }
    violations.dedup();
    Report { edges, violations }
}

/// Reports the confined crates named outside their place.
fn confined(path: &str, parsed: &Parsed, violations: &mut Vec<String>) {
    for r in &parsed.refs {
        let Target::External(name) = r.target() else {
            continue;
        };
        for (krate, allowed) in CONFINED_CRATES {
            if name == *krate
                && !allowed
                    .iter()
                    .any(|a| path == *a || (a.ends_with('/') && path.starts_with(a)))
            {
                violations.push(format!(
                    "{path}:{}: `{}`: the `{krate}` crate may appear only under {}",
                    r.line,
                    r.written(),
                    allowed.join(", ")
                ));
            }
        }
    }
}

/// `src/lib.rs` → `""`, `src/backend.rs` → `backend`, `src/backend/redis/ops.rs` →
/// `backend::redis::ops` (`x/mod.rs` → `x`).
fn module_of(path: &str) -> String {
    let rel = path.trim_start_matches("src/").trim_end_matches(".rs");
    let mut parts: Vec<&str> = rel.split('/').collect();
    if parts.last() == Some(&"mod") || parts == ["lib"] {
        parts.pop();
    }
    parts.join("::")
}

fn split(module: &str) -> Vec<String> {
    if module.is_empty() {
        Vec::new()
    } else {
        module.split("::").map(str::to_owned).collect()
    }
}

/// `candidate`'s name if it is a direct child of `parent`.
fn child_name(parent: &str, candidate: &str) -> Option<String> {
    let rest = if parent.is_empty() {
        candidate
    } else {
        candidate.strip_prefix(parent)?.strip_prefix("::")?
    };
    (!rest.is_empty() && !rest.contains("::")).then(|| rest.to_owned())
}

/// Whether `module` is `prefix` or under it.
fn is_under(module: &str, prefix: &str) -> bool {
    module == prefix
        || prefix.is_empty()
        || module
            .strip_prefix(prefix)
            .is_some_and(|r| r.starts_with("::"))
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, members)| members.iter().any(|m| is_under(module, m)))
}

/// The deepest module file an absolute path names (`""` the root); a path that stops at the
/// root is followed through the root's `use` items. `None` if that fails.
fn resolve(
    abs: &[String],
    modules: &BTreeMap<String, String>,
    root_uses: &BTreeMap<Vec<String>, Target>,
    depth: usize,
) -> Option<String> {
    let deepest = (0..=abs.len())
        .rev()
        .map(|n| abs[..n].join("::"))
        .find(|m| modules.contains_key(m) || m.is_empty())?;
    if !deepest.is_empty() || abs.is_empty() {
        return Some(deepest);
    }
    if depth > 8 {
        return None;
    }
    for n in (1..=abs.len()).rev() {
        match root_uses.get(&abs[..n]) {
            Some(Target::Internal(to, _)) => {
                let mut next = to.clone();
                next.extend_from_slice(&abs[n..]);
                return resolve(&next, modules, root_uses, depth + 1);
            }
            // A re-exported crate (`crate::event_listener::…`): no module of ours.
            Some(Target::External(_)) => return Some(String::new()),
            _ => {}
        }
    }
    None
}

/// The strongly connected components of more than one module (Tarjan).
fn components<'a>(nodes: &[&'a str], edges: &[&Edge]) -> Vec<Vec<&'a str>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
        next: BTreeMap<&'a str, BTreeSet<&'a str>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        let next: Vec<&'a str> = s
            .next
            .get(v)
            .map(|n| n.iter().copied().collect())
            .unwrap_or_default();
        for w in next {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                s.out.push(scc);
            }
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
        next: BTreeMap::new(),
    };
    for e in edges {
        if let (Some(a), Some(b)) = (
            nodes.iter().find(|n| **n == e.from),
            nodes.iter().find(|n| **n == e.to),
        ) {
            s.next.entry(*a).or_default().insert(*b);
        }
    }
    for n in nodes {
        if !s.index.contains_key(n) {
            visit(&mut s, n);
        }
    }
    s.out
}

// ---------------------------------------------------------------------------------------
// Reading Rust: just enough to find paths in code.
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `mod x;`
    Mod,
    /// A leaf of a `use` item.
    Use,
    /// A path in code.
    Inline,
}

/// A path found in code.
#[derive(Clone, Debug)]
struct Ref {
    line: usize,
    segs: Vec<String>,
    /// `use … as alias`.
    alias: Option<String>,
    kind: Kind,
    /// The module the path is written in (the file's, plus inline `mod x { … }`).
    scope: Vec<String>,
    /// Whether the path starts with the name of a child module file of the file it is in
    /// (a bare `redis::X` in backend.rs; never inside an inline module).
    bare_children: bool,
}

#[derive(Clone, Debug, PartialEq)]
enum Target {
    /// An absolute module path; `true` if written relative to the current module (`self::`,
    /// a bare child name, `mod x;`).
    Internal(Vec<String>, bool),
    External(String),
    Invalid,
}

impl Ref {
    fn written(&self) -> String {
        match self.kind {
            Kind::Mod => format!("mod {}", self.segs.join("::")),
            _ => self.segs.join("::"),
        }
    }

    fn target(&self) -> Target {
        let Some(first) = self.segs.first() else {
            return Target::Invalid;
        };
        let rest = |n: usize| self.segs[n..].to_vec();
        match first.as_str() {
            _ if self.kind == Kind::Mod => {
                let mut abs = self.scope.clone();
                abs.extend(rest(0));
                Target::Internal(abs, true)
            }
            "crate" => Target::Internal(rest(1), false),
            "self" => {
                let mut abs = self.scope.clone();
                abs.extend(rest(1));
                Target::Internal(abs, true)
            }
            "super" => {
                let ups = self.segs.iter().take_while(|s| *s == "super").count();
                if ups > self.scope.len() {
                    return Target::Invalid;
                }
                let mut abs = self.scope[..self.scope.len() - ups].to_vec();
                abs.extend(rest(ups));
                Target::Internal(abs, false)
            }
            _ if self.bare_children => {
                let mut abs = self.scope.clone();
                abs.extend(rest(0));
                Target::Internal(abs, true)
            }
            name => Target::External(name.to_owned()),
        }
    }
}

#[derive(Default)]
struct Parsed {
    refs: Vec<Ref>,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// Finds the module paths in `text`, a file of module `module` whose child module files are
/// `children`.
fn parse(text: &str, module: &[String], children: &BTreeSet<String>) -> Parsed {
    let toks = tokens(&strip(text));
    let ident = |i: usize| match toks.get(i) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let is = |i: usize, t: &Tok| toks.get(i).is_some_and(|(x, _)| x == t);
    let mut out = Parsed::default();
    let mut depth = 0usize;
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut pending_mod: Option<String> = None;
    let mut i = 0;
    while i < toks.len() {
        let line = toks[i].1;
        let mut scope: Vec<String> = module.to_vec();
        scope.extend(inline.iter().map(|(n, _)| n.clone()));
        let at_file_level = inline.is_empty();
        let child_root =
            |segs: &[String]| at_file_level && segs.first().is_some_and(|s| children.contains(s));
        match &toks[i].0 {
            Tok::Punct('{') => {
                depth += 1;
                if let Some(name) = pending_mod.take() {
                    inline.push((name, depth));
                }
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(k) if k == "mod" => match (ident(i + 1), toks.get(i + 2).map(|t| &t.0)) {
                (Some(name), Some(Tok::Punct(';'))) => {
                    out.refs.push(Ref {
                        line,
                        segs: vec![name.to_owned()],
                        alias: None,
                        kind: Kind::Mod,
                        scope: scope.clone(),
                        bare_children: false,
                    });
                    i += 3;
                }
                (Some(name), Some(Tok::Punct('{'))) => {
                    pending_mod = Some(name.to_owned());
                    i += 2;
                }
                _ => i += 1,
            },
            Tok::Ident(k) if k == "use" && !is(i + 1, &Tok::Punct('<')) => {
                let mut leaves = Vec::new();
                let mut j = i + 1;
                use_tree(&toks, &mut j, Vec::new(), &mut leaves);
                while j < toks.len() && !is(j, &Tok::Punct(';')) {
                    j += 1;
                }
                for (segs, alias, line) in leaves {
                    let bare = child_root(&segs);
                    out.refs.push(Ref {
                        line,
                        segs,
                        alias,
                        kind: Kind::Use,
                        scope: scope.clone(),
                        bare_children: bare,
                    });
                }
                i = j + 1;
            }
            Tok::Ident(k) if k == "extern" && ident(i + 1) == Some("crate") => {
                if let Some(name) = ident(i + 2) {
                    out.refs.push(Ref {
                        line,
                        segs: vec![name.to_owned()],
                        alias: None,
                        kind: Kind::Use,
                        scope: scope.clone(),
                        bare_children: false,
                    });
                }
                i += 3;
            }
            Tok::Ident(first) if is(i + 1, &Tok::Sep) && (i == 0 || !is(i - 1, &Tok::Sep)) => {
                // `pub(in crate::x)` is a visibility, not a reference.
                let visibility = i >= 3
                    && ident(i - 1) == Some("in")
                    && is(i - 2, &Tok::Punct('('))
                    && ident(i - 3) == Some("pub");
                let mut segs = vec![first.clone()];
                let mut j = i + 1;
                while is(j, &Tok::Sep) {
                    match ident(j + 1) {
                        Some(s) => {
                            segs.push(s.to_owned());
                            j += 2;
                        }
                        None => break,
                    }
                }
                let named = matches!(first.as_str(), "crate" | "super" | "self")
                    || CONFINED_CRATES.iter().any(|(c, _)| c == first)
                    || child_root(&segs);
                if named && !visibility {
                    let bare = child_root(&segs);
                    out.refs.push(Ref {
                        line,
                        segs,
                        alias: None,
                        kind: Kind::Inline,
                        scope,
                        bare_children: bare,
                    });
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    out
}

/// Expands one use tree at `*i` into its leaves: (full path, alias, line of the leaf).
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>, usize)>,
) {
    let at = |i: usize| toks.get(i).map(|t| &t.0);
    if at(*i) == Some(&Tok::Sep) {
        *i += 1; // `use ::name` (an external crate)
    }
    let mut segs = prefix;
    loop {
        match at(*i) {
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match at(*i) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None | Some(Tok::Punct(';')) => return,
                        Some(_) => {
                            let before = *i;
                            use_tree(toks, i, segs.clone(), out);
                            if *i == before {
                                *i += 1; // not Rust we understand: move on
                            }
                        }
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                out.push((segs, None, toks[*i].1));
                *i += 1;
                return;
            }
            Some(Tok::Ident(name)) => {
                let line = toks[*i].1;
                segs.push(name.clone());
                *i += 1;
                if at(*i) == Some(&Tok::Sep) {
                    *i += 1;
                    continue;
                }
                let mut alias = None;
                if matches!(at(*i), Some(Tok::Ident(a)) if a == "as") {
                    if let Some(Tok::Ident(a)) = at(*i + 1) {
                        alias = Some(a.clone());
                    }
                    *i += 2;
                }
                // `a::{self, b}`: `self` is `a`.
                if segs.len() > 1 && segs.last().is_some_and(|s| s == "self") {
                    segs.pop();
                }
                out.push((segs, alias, line));
                return;
            }
            _ => return,
        }
    }
}

/// Splits stripped source into tokens with their line numbers (1-based).
fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push((Tok::Sep, line));
            i += 2;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            // `r#name` is `name`.
            if word == "r"
                && chars.get(i) == Some(&'#')
                && chars
                    .get(i + 1)
                    .is_some_and(|c| c.is_alphabetic() || *c == '_')
            {
                i += 1;
                continue;
            }
            out.push((Tok::Ident(word), line));
        } else {
            out.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// `src` with comments and the contents of string and char literals blanked out (newlines
/// kept, so line numbers stay true).
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(c.len());
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && ident_char(c[i - 1]);
        // Line comment (also `///`, `//!`).
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
            continue;
        }
        // Block comment, nested.
        if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.extend([' ', ' ']);
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.extend([' ', ' ']);
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
            continue;
        }
        // Raw string: r"…", r#"…"#, br#"…"#.
        if !prev_ident && (c[i] == 'r' || (c[i] == 'b' && c.get(i + 1) == Some(&'r'))) {
            let mut j = if c[i] == 'b' { i + 2 } else { i + 1 };
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if c.get(j) == Some(&'"') {
                out.extend(std::iter::repeat_n(' ', j + 1 - i));
                i = j + 1;
                while i < c.len() {
                    if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
                        out.extend(std::iter::repeat_n(' ', hashes + 1));
                        i += hashes + 1;
                        break;
                    }
                    out.push(blank(c[i]));
                    i += 1;
                }
                continue;
            }
        }
        // String.
        if c[i] == '"' {
            out.push(' ');
            i += 1;
            while i < c.len() {
                if c[i] == '\\' {
                    out.push(' ');
                    if let Some(&n) = c.get(i + 1) {
                        out.push(blank(n));
                    }
                    i += 2;
                    continue;
                }
                if c[i] == '"' {
                    out.push(' ');
                    i += 1;
                    break;
                }
                out.push(blank(c[i]));
                i += 1;
            }
            continue;
        }
        // Char literal (a lifetime `'a` is left alone).
        if c[i] == '\'' {
            let end = if c.get(i + 1) == Some(&'\\') {
                // An escape: `'\n'`, `'\''`, `'\\'`, `'\x7f'`, `'\u{1F600}'`.
                (i + 3..c.len()).find(|&k| c[k] == '\'')
            } else if c.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            if let Some(end) = end {
                out.extend(std::iter::repeat_n(' ', end + 1 - i));
                i = end + 1;
                continue;
            }
        }
        out.push(c[i]);
        i += 1;
    }
    out.into_iter().collect()
}
