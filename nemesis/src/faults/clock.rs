//! A server's wall clock, shifted: an `LD_PRELOAD` shim (`nemesis/shim/clockshift.c`) on the
//! server process only adds an offset, read from a file, to `clock_gettime(CLOCK_REALTIME)`,
//! `clock_gettime(CLOCK_REALTIME_COARSE)`, `gettimeofday` and `time`. The machine's clock is
//! never touched.
//!
//! The offset file holds 8 bytes (a signed count of milliseconds, native byte order); the
//! shim maps it once and reads it on every call, so [`ClockOffset::set`] takes effect at the
//! server's next clock read, without a signal or a restart. The file is rewritten in place
//! and never truncated (a mapped file that shrinks would kill the server with `SIGBUS`).
//!
//! What moves with the offset on Redis 7.0: `TIME`, key expiry (a key set with `PX 10000`
//! expires at once after a jump of +20 s), `uptime_in_seconds` (computed from the wall clock:
//! it jumps with the offset, and goes negative after a jump back larger than the uptime) and
//! the distance `TIME - LASTSAVE` (`LASTSAVE` itself stays: it is a stored instant). Both are
//! what a restart quarantine reads, so a forward jump ends a quarantine at once and a jump back
//! prolongs it by the jump (past the last save or start: uptime 0 until the clock catches
//! up). The timeouts of blocked commands, `WAIT` included, are instants on the wall clock: a
//! jump ahead ends them at once, a jump back lengthens them by the jump. A replica whose clock
//! jumps ahead by more than `repl-timeout` (60 s) drops its primary ("MASTER timeout") and
//! resyncs. What does not move: `CLOCK_MONOTONIC` and the other clocks, so the event loop's
//! timers and `serverCron`'s pace stay real. See `nemesis/shim/README` for the measurements.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The shim's source, compiled by [`ClockShim::build`].
const SOURCE: &str = include_str!("../../shim/clockshift.c");

/// The environment variable naming the offset file, as the shim reads it.
const FILE_VAR: &str = "CLOCKSHIFT_FILE";

/// The compiled shim: a shared library to preload into a server.
#[derive(Clone, Debug)]
pub struct ClockShim {
    lib: PathBuf,
}

impl ClockShim {
    /// Compiles the shim into `dir` (created if missing) with the C compiler in `$CC`, else
    /// `cc`, else `gcc`. Fails with [`io::ErrorKind::NotFound`] and a sentence saying so when
    /// no compiler runs, or with the compiler's own output when it fails.
    pub fn build(dir: &Path) -> io::Result<ClockShim> {
        fs::create_dir_all(dir)?;
        let dir = dir.canonicalize()?;
        let src = dir.join("clockshift.c");
        let lib = dir.join("clockshift.so");
        fs::write(&src, SOURCE)?;
        let mut compilers: Vec<String> = Vec::new();
        if let Ok(cc) = std::env::var("CC") {
            compilers.push(cc);
        }
        compilers.extend(["cc".to_string(), "gcc".to_string()]);
        for cc in &compilers {
            let out = match Command::new(cc)
                .args(["-O2", "-Wall", "-shared", "-fPIC", "-o"])
                .arg(&lib)
                .arg(&src)
                .arg("-ldl")
                .output()
            {
                Ok(out) => out,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "clock shim: `{cc}` failed on {}: {}",
                    src.display(),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            return Ok(ClockShim { lib });
        }
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "clock shim: no C compiler found (tried {}); install gcc to shift a server's clock",
                compilers.join(", ")
            ),
        ))
    }

    /// The compiled library (an absolute path, fit for `LD_PRELOAD`).
    pub fn lib(&self) -> &Path {
        &self.lib
    }

    /// A new offset file `<dir>/<name>.clock`, set to 0, for one server: pass
    /// [`ClockOffset::env`] to that server's command. Creating it again resets it to 0.
    pub fn offset(&self, dir: &Path, name: &str) -> io::Result<ClockOffset> {
        fs::create_dir_all(dir)?;
        let path = dir.canonicalize()?.join(format!("{name}.clock"));
        let offset = ClockOffset {
            lib: self.lib.clone(),
            path,
        };
        // Created at its full size before any server maps it; later writes are in place.
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&offset.path)?;
        file.set_len(8)?;
        file.write_all_at(&0i64.to_ne_bytes(), 0)?;
        Ok(offset)
    }
}

/// One server's clock offset: the file the shim in that server reads.
#[derive(Clone, Debug)]
pub struct ClockOffset {
    lib: PathBuf,
    path: PathBuf,
}

impl ClockOffset {
    /// The environment to give the server's command: `LD_PRELOAD` (the shim) and the
    /// variable naming this offset file. Any process started with it has its wall clock
    /// shifted, including `ip netns exec` in front of the server, which is harmless.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".to_string(), self.lib.display().to_string()),
            (FILE_VAR.to_string(), self.path.display().to_string()),
        ]
    }

    /// The offset file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Shifts the clock to `ms` milliseconds from the real wall clock (positive: ahead,
    /// negative: behind; 0: the real clock). Not cumulative: `set(5000)` twice is +5 s.
    pub fn set(&self, ms: i64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(&self.path)?;
        file.write_all_at(&ms.to_ne_bytes(), 0)
    }

    /// The offset now, in milliseconds.
    pub fn get(&self) -> io::Result<i64> {
        let mut bytes = [0u8; 8];
        File::open(&self.path)?.read_exact(&mut bytes)?;
        Ok(i64::from_ne_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::testing::{free_port, Conn, Reply, Server};

    fn int(r: Reply) -> i64 {
        match r {
            Reply::Int(n) => n,
            other => panic!("not an integer: {other:?}"),
        }
    }

    /// `TIME` in milliseconds.
    fn time_ms(c: &mut Conn) -> i64 {
        match c.call(&["TIME"]).expect("TIME") {
            Reply::Array(Some(parts)) => {
                let s: i64 = parts[0].text().expect("seconds").parse().expect("seconds");
                let us: i64 = parts[1].text().expect("micros").parse().expect("micros");
                s * 1000 + us / 1000
            }
            other => panic!("TIME answered {other:?}"),
        }
    }

    fn uptime(c: &mut Conn) -> i64 {
        let info = c.call(&["INFO", "server"]).expect("INFO");
        let info = info.text().expect("INFO text").to_string();
        info.lines()
            .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
            .expect("uptime_in_seconds")
            .trim()
            .parse()
            .expect("uptime")
    }

    #[test]
    fn a_shifted_server_moves_time_expiry_uptime_and_timeouts_with_the_offset() {
        let dir =
            std::env::temp_dir().join(format!("redlease-faults-clock-{}", std::process::id()));
        let shim = ClockShim::build(&dir).expect("build the shim (needs a C compiler)");
        let offset = shim.offset(&dir, "s1").expect("offset file");
        assert_eq!(offset.get().expect("get"), 0);
        let port = free_port();
        let _server = Server::start(&[], &["--port", &port.to_string()], &offset.env());
        let mut c = Conn::connect(("127.0.0.1", port)).expect("connect");

        // The server's TIME minus the machine's clock just before asking: the offset, plus
        // however long the answer took (up to 30 s on a loaded machine).
        let shift = |c: &mut Conn| {
            let before = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_millis() as i64;
            time_ms(c) - before
        };
        let near = |shift: i64, offset: i64| shift >= offset - 1_000 && shift < offset + 30_000;
        let s0 = shift(&mut c);
        assert!(near(s0, 0), "unshifted, TIME is {s0} ms off");
        let lastsave = int(c.call(&["LASTSAVE"]).expect("LASTSAVE"));
        assert_eq!(
            c.call(&["SET", "k", "v", "PX", "10000"]).expect("SET"),
            Reply::Status("OK".into())
        );
        assert_eq!(int(c.call(&["EXISTS", "k"]).expect("EXISTS")), 1);

        // Forward 20 s: TIME jumps, the key with 10 s left is gone at once, uptime and the
        // distance to LASTSAVE jump too (LASTSAVE itself stays).
        offset.set(20_000).expect("set");
        assert_eq!(offset.get().expect("get"), 20_000);
        let s1 = shift(&mut c);
        assert!(near(s1, 20_000), "shifted +20 s, TIME is {s1} ms off");
        assert_eq!(int(c.call(&["EXISTS", "k"]).expect("EXISTS")), 0);
        assert!(uptime(&mut c) >= 20, "uptime follows the wall clock");
        assert_eq!(int(c.call(&["LASTSAVE"]).expect("LASTSAVE")), lastsave);

        // Back to 60 s behind: a key's expiry is an instant on the server's clock, so a key
        // set now with 10 s lives for 70 s of the shifted clock once the clock is back.
        offset.set(0).expect("set");
        assert_eq!(
            c.call(&["SET", "k", "v", "PX", "10000"]).expect("SET"),
            Reply::Status("OK".into())
        );
        offset.set(-60_000).expect("set");
        let s2 = shift(&mut c);
        assert!(near(s2, -60_000), "shifted -60 s, TIME is {s2} ms off");
        assert!(int(c.call(&["PTTL", "k"]).expect("PTTL")) > 60_000);
        // Back by more than the server has been up: uptime goes negative.
        assert!(
            uptime(&mut c) < 0,
            "uptime after a jump back past the start"
        );

        // Blocked commands time out on the wall clock too: a WAIT for a replica that does
        // not exist, for 10 minutes, ends at once when the clock jumps 11 minutes ahead
        // (ReplicaAck's WAIT on a primary whose clock jumps returns early; back, late).
        offset.set(0).expect("set");
        c.send(&["WAIT", "1", "600000"]).expect("WAIT");
        let mut d = Conn::connect(("127.0.0.1", port)).expect("connect");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let info = d.call(&["INFO", "clients"]).expect("INFO");
            if info.text().is_some_and(|t| t.contains("blocked_clients:1")) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "WAIT never blocked");
        }
        offset.set(660_000).expect("set");
        let woke = c.read(std::time::Duration::from_secs(60));
        assert_eq!(woke.expect("WAIT ended by the jump"), Reply::Int(0));
        let _ = fs::remove_dir_all(&dir);
    }
}
