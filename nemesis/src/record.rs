//! What a holder writes down about each critical section, and the line format of the
//! per-worker record files.
//!
//! Times are `CLOCK_MONOTONIC` in nanoseconds ([`mono_ns`]): the clock is system-wide, so
//! the records of different worker processes (and the harness's fault log) compare.
//!
//! A section is two lines, written (and flushed) as they happen, so a worker stopped or
//! killed mid-section leaves its section open:
//!
//! ```text
//! S <id> <kind> <name> <holder> <token> <asked> <enter> <valid_end at enter|->
//! X <id> <exit> <valid_end at exit|-> <lost|-> <write>
//! ```
//!
//! `<write>` is `-` (none), `A:<start>:<end>` (accepted), `R:<start>:<end>:<newest>`
//! (rejected: a newer token had written) or `E` (the write failed). The harness's fault log
//! uses `F <kind> <target> <start> <end> <data_loss 0|1> <forward jump|->` (the instant a
//! server's wall clock jumped forward, for a clock fault) and `Q <n>`: how many servers'
//! clocks must jump forward under one lease before the configuration no longer promises
//! it (1 for one server, 2 for Redlock over 5, whose holder normally has 4 or 5 nodes).

use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::time::Instant;

use nix::time::{clock_gettime, ClockId};

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn mono_ns() -> u64 {
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always readable");
    u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec()).unwrap_or(0)
}

/// A monotonic [`Instant`] (Rust's `Instant` is `CLOCK_MONOTONIC` on Linux) as [`mono_ns`].
pub fn instant_ns(t: Instant) -> u64 {
    let (now, now_ns) = (Instant::now(), mono_ns());
    if t >= now {
        now_ns + u64::try_from((t - now).as_nanos()).unwrap_or(u64::MAX / 2)
    } else {
        now_ns.saturating_sub(u64::try_from((now - t).as_nanos()).unwrap_or(u64::MAX))
    }
}

/// The kind of a hold, as the checker sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `Lock::acquire` (exclusive).
    Plain,
    /// A fair lock (exclusive).
    Fair,
    /// A reentrant reign: the outer hold, with a nested hold inside (exclusive).
    Reentrant,
    /// One name of a `MultiLock` (exclusive; its names are plain locks).
    Multi,
    /// A read-write lock's write (exclusive, and excludes reads).
    Write,
    /// A read-write lock's read (shared among reads).
    Read,
    /// A semaphore permit, out of this many (shared, at most that many at once).
    Permit(u32),
}

impl Kind {
    /// Whether no other exclusive hold of the name may overlap this one.
    pub fn is_exclusive(self) -> bool {
        !matches!(self, Kind::Read | Kind::Permit(_))
    }

    fn encode(self) -> String {
        match self {
            Kind::Plain => "plain".into(),
            Kind::Fair => "fair".into(),
            Kind::Reentrant => "reentrant".into(),
            Kind::Multi => "multi".into(),
            Kind::Write => "write".into(),
            Kind::Read => "read".into(),
            Kind::Permit(n) => format!("permit/{n}"),
        }
    }

    fn decode(s: &str) -> Option<Kind> {
        Some(match s {
            "plain" => Kind::Plain,
            "fair" => Kind::Fair,
            "reentrant" => Kind::Reentrant,
            "multi" => Kind::Multi,
            "write" => Kind::Write,
            "read" => Kind::Read,
            _ => Kind::Permit(s.strip_prefix("permit/")?.parse().ok()?),
        })
    }
}

/// The fenced write at the end of an exclusive section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceWrite {
    /// No write (shared holds).
    None,
    /// Applied, between these two instants.
    Accepted {
        /// Sent.
        start: u64,
        /// Answered.
        end: u64,
    },
    /// Refused: a write with token `newest` had been applied.
    Rejected {
        /// Sent.
        start: u64,
        /// Answered.
        end: u64,
        /// The token the resource held.
        newest: u64,
    },
    /// The resource's server did not answer (counted, not checked).
    Failed,
}

/// One critical section, as its holder recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    /// `w<worker>.t<task>.<seq>`: unique in a run.
    pub id: String,
    /// The kind of hold.
    pub kind: Kind,
    /// The lock's name.
    pub name: String,
    /// `w<worker>.t<task>`.
    pub holder: String,
    /// The guard's fencing token.
    pub token: u64,
    /// When the acquire began: the grant fell between this and `enter` (for a multi lock,
    /// its first names were granted well before its enter).
    pub asked: u64,
    /// When the guard was in hand.
    pub enter: u64,
    /// The guard's `valid_until()` at enter; `None` when the holder ignores it (mutant).
    pub valid_at_enter: Option<u64>,
    /// When the section ended (before the release was sent); `None` if never recorded.
    pub exit: Option<u64>,
    /// The guard's `valid_until()` at exit (the last confirmed deadline).
    pub valid_at_exit: Option<u64>,
    /// When the holder saw `lost()` resolve, if it did before exit.
    pub lost: Option<u64>,
    /// The fenced write.
    pub write: FenceWrite,
}

impl Section {
    /// The lease's validity end as last known: at exit if the section closed, else at enter.
    pub fn valid_end(&self) -> Option<u64> {
        if self.exit.is_some() {
            self.valid_at_exit
        } else {
            self.valid_at_enter
        }
    }

    /// The end of the hold's *valid* part: the earliest of exit, `lost()` and the validity
    /// end (an open section with no known validity end never ends).
    pub fn valid_until(&self) -> u64 {
        [self.exit, self.lost, self.valid_end()]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The end of the *raw* section: exit, or for an open one its validity end.
    pub fn raw_until(&self) -> u64 {
        self.exit.or(self.valid_end()).unwrap_or(u64::MAX)
    }

    /// The enter line.
    pub fn enter_line(&self) -> String {
        format!(
            "S {} {} {} {} {} {} {} {}\n",
            self.id,
            self.kind.encode(),
            self.name,
            self.holder,
            self.token,
            self.asked,
            self.enter,
            opt(self.valid_at_enter)
        )
    }

    /// The exit line (call once `exit` is set).
    pub fn exit_line(&self) -> String {
        let write = match self.write {
            FenceWrite::None => "-".to_string(),
            FenceWrite::Accepted { start, end } => format!("A:{start}:{end}"),
            FenceWrite::Rejected { start, end, newest } => format!("R:{start}:{end}:{newest}"),
            FenceWrite::Failed => "E".to_string(),
        };
        format!(
            "X {} {} {} {} {}\n",
            self.id,
            opt(self.exit),
            opt(self.valid_at_exit),
            opt(self.lost),
            write
        )
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn parse_opt(s: &str) -> Option<Option<u64>> {
    if s == "-" {
        Some(None)
    } else {
        s.parse().ok().map(Some)
    }
}

/// A fault the harness injected, as logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultEvent {
    /// The fault's name (`kill`, `pause`, ...).
    pub kind: String,
    /// What it hit (a server or worker).
    pub target: String,
    /// Injected.
    pub start: u64,
    /// Healed.
    pub end: u64,
    /// Whether it may have lost acknowledged writes (a kill without `appendfsync always`, a
    /// failover without `ReplicaAck`).
    pub data_loss: bool,
    /// When the target server's wall clock jumped forward (a clock fault's injection when
    /// it set the clock ahead, its heal when it had set it behind): the leases on that
    /// server ended early by the jump.
    pub clock_forward: Option<u64>,
}

impl FaultEvent {
    /// Its line in the fault log.
    pub fn line(&self) -> String {
        format!(
            "F {} {} {} {} {} {}\n",
            self.kind,
            self.target,
            self.start,
            self.end,
            self.data_loss as u8,
            self.clock_forward.map_or("-".into(), |t| t.to_string())
        )
    }
}

/// Appends a worker's sections to its file, one `write` per line (flushed at once).
#[derive(Debug)]
pub struct Recorder {
    file: File,
}

impl Recorder {
    /// Creates (truncates) the file.
    pub fn create(path: &Path) -> io::Result<Recorder> {
        Ok(Recorder {
            file: File::create(path)?,
        })
    }

    /// Writes one line.
    pub fn line(&mut self, line: &str) -> io::Result<()> {
        self.file.write_all(line.as_bytes())
    }
}

/// Everything read back from record files: sections (open ones too) and faults.
#[derive(Debug, Default)]
pub struct Records {
    /// The sections, in file order.
    pub sections: Vec<Section>,
    /// The faults.
    pub faults: Vec<FaultEvent>,
    /// Lines that did not parse (a line cut by a kill).
    pub bad_lines: usize,
    /// Servers whose clocks must jump forward under one lease for it to be lost (the `Q`
    /// line; 1 if none).
    pub jump_quorum: Option<usize>,
}

impl Records {
    /// Reads one file's lines into these records.
    pub fn read_file(&mut self, path: &Path) -> io::Result<()> {
        let mut open: std::collections::HashMap<String, usize> = Default::default();
        for line in BufReader::new(File::open(path)?).lines() {
            let line = line?;
            if self.parse_line(&line, &mut open).is_none() {
                self.bad_lines += 1;
            }
        }
        Ok(())
    }

    fn parse_line(
        &mut self,
        line: &str,
        open: &mut std::collections::HashMap<String, usize>,
    ) -> Option<()> {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["S", id, kind, name, holder, token, asked, enter, valid] => {
                open.insert(id.to_string(), self.sections.len());
                self.sections.push(Section {
                    id: id.to_string(),
                    kind: Kind::decode(kind)?,
                    name: name.to_string(),
                    holder: holder.to_string(),
                    token: token.parse().ok()?,
                    asked: asked.parse().ok()?,
                    enter: enter.parse().ok()?,
                    valid_at_enter: parse_opt(valid)?,
                    exit: None,
                    valid_at_exit: None,
                    lost: None,
                    write: FenceWrite::None,
                });
            }
            ["X", id, exit, valid, lost, write] => {
                let s = &mut self.sections[*open.get(*id)?];
                s.exit = parse_opt(exit)?;
                s.valid_at_exit = parse_opt(valid)?;
                s.lost = parse_opt(lost)?;
                let w: Vec<&str> = write.split(':').collect();
                s.write = match w.as_slice() {
                    ["-"] => FenceWrite::None,
                    ["E"] => FenceWrite::Failed,
                    ["A", a, b] => FenceWrite::Accepted {
                        start: a.parse().ok()?,
                        end: b.parse().ok()?,
                    },
                    ["R", a, b, n] => FenceWrite::Rejected {
                        start: a.parse().ok()?,
                        end: b.parse().ok()?,
                        newest: n.parse().ok()?,
                    },
                    _ => return None,
                };
            }
            ["F", kind, target, start, end, loss, rest @ ..] if rest.len() <= 1 => {
                self.faults.push(FaultEvent {
                    kind: kind.to_string(),
                    target: target.to_string(),
                    start: start.parse().ok()?,
                    end: end.parse().ok()?,
                    data_loss: *loss == "1",
                    clock_forward: match rest.first() {
                        Some(t) => parse_opt(t)?,
                        None => None,
                    },
                })
            }
            ["Q", n] => self.jump_quorum = Some(n.parse().ok()?),
            _ => return None,
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let s = Section {
            id: "w1.t0.7".into(),
            kind: Kind::Permit(3),
            name: "sem:0".into(),
            holder: "w1.t0".into(),
            token: 42,
            asked: 90,
            enter: 100,
            valid_at_enter: Some(400),
            exit: Some(200),
            valid_at_exit: Some(500),
            lost: None,
            write: FenceWrite::Rejected {
                start: 150,
                end: 160,
                newest: 43,
            },
        };
        let dir = std::env::temp_dir().join(format!("nemesis-rec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w1");
        let mut r = Recorder::create(&path).unwrap();
        r.line(&s.enter_line()).unwrap();
        r.line(&s.exit_line()).unwrap();
        let open = Section {
            id: "w1.t1.0".into(),
            exit: None,
            valid_at_exit: None,
            write: FenceWrite::None,
            ..s.clone()
        };
        r.line(&open.enter_line()).unwrap();
        let mut recs = Records::default();
        recs.read_file(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(recs.sections, vec![s, open]);
        assert_eq!(recs.bad_lines, 0);
    }
}
