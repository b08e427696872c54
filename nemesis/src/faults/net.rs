//! Network partitions between hosts, each host a network namespace of its own.
//!
//! # Layout
//! `Net::new(prefix, hosts)` makes a hub namespace `<prefix>-hub` holding a bridge, and one
//! namespace `<prefix>-<host>` per host with one veth pair to the bridge (`eth0` in the host,
//! created there directly: no interface, route or sysctl of the root namespace is touched).
//! Hosts get 10.213.0.1, .2, ... in the order given; the bridge itself is 10.213.0.254, the
//! [`CONTROL`] host, which no partition cuts: the harness in the root namespace reaches any
//! host through it with [`Net::connect`] (a socket made in the hub's namespace and used from
//! the root one), or runs a command there with `exec_prefix(CONTROL)`. Every address is
//! private to these namespaces: two `Net`s with other prefixes do not see each other.
//! The harness's own clients can be placed in a host without a process there: a
//! `DelayProxy::start_with(loopback, net.connector(host, server, timeout)?)` in the root
//! namespace makes its upstream connections from `host`, so cutting `host` from the server's
//! host stalls those clients as it would a process running in `host`.
//!
//! # How a cut works
//! Every host knows every other host's MAC address through a permanent neighbour (ARP) entry,
//! so no ARP is ever sent. Cutting `a` from `b` points `a`'s entry for `b` (and `b`'s for `a`)
//! at a MAC address nobody has: the frames still leave, the bridge floods them, and every
//! interface discards them as not its own. Nothing reports an error to the sender (unlike a
//! blackhole or unreachable route, which fails `connect` and `send` at once): a connect waits
//! for its SYN to be answered, an established connection's data waits in its send queue and is
//! retransmitted with backoff, nothing is reset. Healing points the entry back: the next
//! retransmission gets through and the same connections carry on, at their next
//! retransmission: the timeout doubles from 200 ms (to 120 s at most), so a PING sent into a
//! cut was answered 0.65 s after the heal of a 1 s cut, 1.8 s after a 5 s one, 11.6 s after a
//! 15 s one (measured here); a new connection's SYN backs off from 1 s likewise.
//! `cut_one_way(from, to)` changes only `from`'s entry: `from`'s packets to `to` vanish, the
//! other way still works (so a connection stalls there too, for want of acknowledgements).
//!
//! # Limits
//! A cut outlasting TCP's retransmission limit (`tcp_retries2`, about 15 minutes) ends
//! connections with `ETIMEDOUT`, as a real partition would; keepalives do the same sooner
//! where enabled (Redis: `tcp-keepalive 300`). Only IPv4 between the hosts is cut.
//!
//! # Clean-up
//! Dropping the `Net` (also while unwinding from a panic) deletes every namespace it made;
//! `Net::new` first deletes any namespace left with the same prefix (after a `SIGKILL`). A
//! process still running in a deleted host namespace keeps it alive, alone with its loopback
//! (the veth pair goes with the hub): stop the servers before dropping the `Net`.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nix::sched::CloneFlags;

/// The name of the hub, as a host: the control path that no partition cuts.
pub const CONTROL: &str = "control";

/// The MAC address a cut host's neighbour entry points at: on no interface.
const NOWHERE: &str = "02:52:4c:ff:ff:fe";

/// A set of hosts on one bridge, each in its own network namespace; see the module docs.
#[derive(Debug)]
pub struct Net {
    prefix: String,
    hub: Host,
    hosts: Vec<Host>,
    /// The namespaces made so far, deleted on drop.
    made: Vec<String>,
    /// The directions cut: (from, to) as indexes into `hosts`.
    cuts: Mutex<BTreeSet<(usize, usize)>>,
}

#[derive(Clone, Debug)]
struct Host {
    name: String,
    ns: String,
    addr: Ipv4Addr,
    mac: String,
    dev: &'static str,
}

impl Net {
    /// Whether partitions can be made here: running as root, with `ip` (iproute2) present.
    pub fn available() -> bool {
        nix::unistd::Uid::effective().is_root()
            && Command::new("ip")
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    }

    /// Makes the hub and one namespace per host (at most 250 hosts, names of letters, digits
    /// and `-`, not [`CONTROL`]), after deleting any namespace named `<prefix>-*`.
    pub fn new(prefix: &str, hosts: &[&str]) -> io::Result<Net> {
        let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
        let ok_name =
            |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !ok_name(prefix) {
            return Err(invalid(format!("net: bad prefix {prefix:?}")));
        }
        if hosts.len() > 250 {
            return Err(invalid("net: more than 250 hosts".into()));
        }
        for (i, h) in hosts.iter().enumerate() {
            if !ok_name(h) || *h == CONTROL || *h == "hub" || hosts[..i].contains(h) {
                return Err(invalid(format!("net: bad or repeated host name {h:?}")));
            }
        }
        clean(prefix)?;
        let hub = Host {
            name: CONTROL.into(),
            ns: format!("{prefix}-hub"),
            addr: Ipv4Addr::new(10, 213, 0, 254),
            mac: "02:52:4c:00:00:fe".into(),
            dev: "br0",
        };
        let mut net = Net {
            prefix: prefix.into(),
            hub: hub.clone(),
            hosts: Vec::new(),
            made: Vec::new(),
            cuts: Mutex::new(BTreeSet::new()),
        };
        // From here on, an error drops `net`, which deletes what was made.
        ip(&["netns", "add", &hub.ns])?;
        net.made.push(hub.ns.clone());
        batch(
            &hub.ns,
            &[
                "link set lo up".into(),
                format!("link add br0 address {} type bridge", hub.mac),
                format!("addr add {}/24 dev br0", hub.addr),
                "link set br0 up".into(),
            ],
        )?;
        for (i, name) in hosts.iter().enumerate() {
            let host = Host {
                name: name.to_string(),
                ns: format!("{prefix}-{name}"),
                addr: Ipv4Addr::new(10, 213, 0, i as u8 + 1),
                mac: format!("02:52:4c:00:00:{:02x}", i + 1),
                dev: "eth0",
            };
            ip(&["netns", "add", &host.ns])?;
            net.made.push(host.ns.clone());
            batch(
                &hub.ns,
                &[
                    format!(
                        "link add v{i} type veth peer name eth0 address {} netns {}",
                        host.mac, host.ns
                    ),
                    format!("link set v{i} master br0 up"),
                ],
            )?;
            batch(
                &host.ns,
                &[
                    "link set lo up".into(),
                    format!("addr add {}/24 dev eth0", host.addr),
                    "link set eth0 up".into(),
                ],
            )?;
            net.hosts.push(host);
        }
        // Permanent neighbour entries everywhere: no ARP, and a cut is one entry changed.
        let everyone: Vec<Host> = net.hosts.iter().chain([&net.hub]).cloned().collect();
        for me in &everyone {
            let lines: Vec<String> = everyone
                .iter()
                .filter(|o| o.addr != me.addr)
                .map(|o| neigh(me, o, &o.mac))
                .collect();
            batch(&me.ns, &lines)?;
        }
        Ok(net)
    }

    /// The host's address (10.213.0.254 for [`CONTROL`]).
    ///
    /// # Panics
    /// If `host` is not one of this `Net`'s hosts.
    pub fn addr(&self, host: &str) -> Ipv4Addr {
        self.host(host).addr
    }

    /// The host's namespace name (`<prefix>-<host>`; `<prefix>-hub` for [`CONTROL`]).
    ///
    /// # Panics
    /// If `host` is not one of this `Net`'s hosts.
    pub fn ns(&self, host: &str) -> &str {
        &self.host(host).ns
    }

    /// `["ip", "netns", "exec", <ns>]`: put it before a command to run it in the host. `ip
    /// netns exec` execs the command, so the child's pid is the command's own (signals reach
    /// it directly), and the environment passes through (a clock shim's too).
    ///
    /// # Panics
    /// If `host` is not one of this `Net`'s hosts.
    pub fn exec_prefix(&self, host: &str) -> Vec<String> {
        ["ip", "netns", "exec", self.ns(host)]
            .map(String::from)
            .to_vec()
    }

    /// Runs `f` on a thread of its own that has entered `host`'s network namespace: a socket
    /// it makes belongs to that namespace for its whole life, wherever it is used afterwards.
    pub fn within<T, F>(&self, host: &str, f: F) -> io::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> io::Result<T> + Send + 'static,
    {
        within(&self.try_host(host)?.ns, f)
    }

    /// A TCP connection from `from` (a host, or [`CONTROL`] for the uncut control path) to
    /// `to`, giving up after `timeout` (a cut makes a connect wait, not fail).
    pub fn connect(&self, from: &str, to: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
        self.connector(from, to, timeout)?()
    }

    /// What [`connect`](Self::connect) does, as a function that holds only the namespace's
    /// name (not the `Net`): for `DelayProxy::start_with(listen, net.connector(CONTROL, server,
    /// timeout)?)`, a loopback port in the root namespace for a server in a host, which no cut
    /// affects (and which the proxy can still delay, stall or kill).
    pub fn connector(
        &self,
        from: &str,
        to: SocketAddr,
        timeout: Duration,
    ) -> io::Result<impl Fn() -> io::Result<TcpStream> + Send + Sync + 'static> {
        let ns = self.try_host(from)?.ns.clone();
        Ok(move || within(&ns, move || TcpStream::connect_timeout(&to, timeout)))
    }

    /// Cuts `a` and `b` apart both ways: their packets to each other vanish silently.
    pub fn cut(&self, a: &str, b: &str) -> io::Result<()> {
        self.cut_one_way(a, b)?;
        self.cut_one_way(b, a)
    }

    /// Cuts one direction: `from`'s packets to `to` vanish; `to`'s still reach `from`.
    pub fn cut_one_way(&self, from: &str, to: &str) -> io::Result<()> {
        let (f, t) = (self.index(from)?, self.index(to)?);
        let (hf, ht) = (&self.hosts[f], &self.hosts[t]);
        batch(&hf.ns, &[neigh(hf, ht, NOWHERE)])?;
        self.cuts().insert((f, t));
        Ok(())
    }

    /// Heals both directions between `a` and `b` (a direction not cut is left alone).
    pub fn heal(&self, a: &str, b: &str) -> io::Result<()> {
        self.heal_one_way(a, b)?;
        self.heal_one_way(b, a)
    }

    /// Heals one direction: `from`'s packets reach `to` again.
    pub fn heal_one_way(&self, from: &str, to: &str) -> io::Result<()> {
        let (f, t) = (self.index(from)?, self.index(to)?);
        let (hf, ht) = (&self.hosts[f], &self.hosts[t]);
        batch(&hf.ns, &[neigh(hf, ht, &ht.mac)])?;
        self.cuts().remove(&(f, t));
        Ok(())
    }

    /// Heals every cut.
    pub fn heal_all(&self) -> io::Result<()> {
        let cuts: Vec<(usize, usize)> = self.cuts().iter().copied().collect();
        for (f, t) in cuts {
            let (from, to) = (self.hosts[f].name.clone(), self.hosts[t].name.clone());
            self.heal_one_way(&from, &to)?;
        }
        Ok(())
    }

    /// The directions cut now, as `(from, to)` host names.
    pub fn cuts_now(&self) -> Vec<(String, String)> {
        self.cuts()
            .iter()
            .map(|&(f, t)| (self.hosts[f].name.clone(), self.hosts[t].name.clone()))
            .collect()
    }

    /// The prefix of this `Net`'s namespaces.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn cuts(&self) -> MutexGuard<'_, BTreeSet<(usize, usize)>> {
        self.cuts.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn try_host(&self, name: &str) -> io::Result<&Host> {
        if name == CONTROL {
            return Ok(&self.hub);
        }
        self.hosts.iter().find(|h| h.name == name).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("net: no host {name:?}"),
            )
        })
    }

    fn host(&self, name: &str) -> &Host {
        match self.try_host(name) {
            Ok(h) => h,
            Err(e) => panic!("{e}"),
        }
    }

    /// A host's index for a cut: the control path is never cut.
    fn index(&self, name: &str) -> io::Result<usize> {
        if name == CONTROL {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "net: the control path is never cut",
            ));
        }
        let host = self.try_host(name)?;
        Ok(self.hosts.iter().position(|h| h.ns == host.ns).unwrap_or(0))
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // The hub first: its veth ends take the hosts' with them.
        for ns in &self.made {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Runs `f` on a new thread inside the namespace `ns`.
pub(crate) fn within<T, F>(ns: &str, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> io::Result<T> + Send + 'static,
{
    let file = File::open(format!("/run/netns/{ns}"))?;
    let name = ns.to_string();
    std::thread::spawn(move || {
        nix::sched::setns(&file, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        f()
    })
    .join()
    .map_err(|_| io::Error::other(format!("net: a thread in {name} panicked")))?
}

/// The `ip neigh` line making `me` send `other`'s packets to `mac`.
fn neigh(me: &Host, other: &Host, mac: &str) -> String {
    format!(
        "neigh replace {} lladdr {mac} dev {} nud permanent",
        other.addr, me.dev
    )
}

/// Deletes every namespace named `<prefix>-*`.
fn clean(prefix: &str) -> io::Result<()> {
    let out = Command::new("ip").args(["netns", "list"]).output()?;
    let list = String::from_utf8_lossy(&out.stdout);
    let stale = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|ns| ns.strip_prefix(prefix).is_some_and(|r| r.starts_with('-')));
    for ns in stale {
        ip(&["netns", "del", ns])?;
    }
    Ok(())
}

/// Runs `ip <args>`; its stderr in the error.
fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "net: `ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Runs `lines` as one `ip -n <ns> -batch -`.
fn batch(ns: &str, lines: &[String]) -> io::Result<()> {
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(lines.join("\n").as_bytes())?;
        stdin.write_all(b"\n")?;
    }
    let out = child.wait_with_output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "net: in {ns}, `ip -batch` of {lines:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::testing::{Conn, Reply, Server};
    use crate::faults::DelayProxy;
    use std::net::SocketAddrV4;

    const PORT: u16 = 6379;

    fn server(net: &Net, host: &str, extra: &[&str]) -> Server {
        let bind = net.addr(host).to_string();
        let mut args = vec!["--port", "6379", "--bind", &bind, "--protected-mode", "no"];
        args.extend_from_slice(extra);
        Server::start(&net.exec_prefix(host), &args, &[])
    }

    fn at(net: &Net, host: &str) -> SocketAddr {
        SocketAddrV4::new(net.addr(host), PORT).into()
    }

    fn conn(net: &Net, from: &str, to: &str) -> Conn {
        let s = net
            .connect(from, at(net, to), Duration::from_secs(10))
            .expect("connect");
        Conn::from_stream(s).expect("conn")
    }

    fn pong() -> Reply {
        Reply::Status("PONG".into())
    }

    /// A read that gets nothing: no reply, no error from the peer, no reset.
    fn silent(c: &mut Conn, wait: Duration) {
        match c.read(wait) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            other => panic!("expected silence, got {other:?}"),
        }
    }

    #[test]
    fn a_cut_stalls_a_connection_silently_and_a_heal_resumes_it() {
        assert!(Net::available(), "these self-tests need root and iproute2");
        let net = Net::new("rlf-cut", &["a", "b", "c"]).expect("net");
        let srv = server(&net, "a", &[]);
        assert!(srv.pid() > 0);
        let mut b = conn(&net, "b", "a");
        assert_eq!(b.call(&["PING"]).expect("PING"), pong());

        // Proxies in the root namespace, on loopback: one to `a` over the control path, one
        // whose upstream connections are made from `b` (the harness's own clients, placed).
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let _in = rt.enter();
        let any = || "127.0.0.1:0".parse().expect("addr");
        let timeout = Duration::from_secs(10);
        let to_control = net
            .connector(CONTROL, at(&net, "a"), timeout)
            .expect("connector");
        let to_control = DelayProxy::start_with(any(), to_control).expect("proxy");
        let from_b = net
            .connector("b", at(&net, "a"), timeout)
            .expect("connector");
        let from_b = DelayProxy::start_with(any(), from_b).expect("proxy");
        let mut as_b = Conn::connect(from_b.addr()).expect("connect through the proxy");
        assert_eq!(as_b.call(&["PING"]).expect("PING"), pong());

        net.cut("a", "b").expect("cut");
        assert_eq!(net.cuts_now().len(), 2);
        b.send(&["PING"])
            .expect("a write into the send queue succeeds");
        silent(&mut b, Duration::from_secs(2));
        // A new connection waits for an answer to its SYN too, rather than failing.
        let e = net
            .connect("b", at(&net, "a"), Duration::from_secs(1))
            .expect_err("no connection across a cut");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        // Other hosts and the control path still reach `a`.
        assert_eq!(conn(&net, "c", "a").call(&["PING"]).expect("PING"), pong());
        assert_eq!(
            conn(&net, CONTROL, "a").call(&["PING"]).expect("PING"),
            pong()
        );
        // So does the root namespace, through a proxy on loopback to the control path.
        let mut root = Conn::connect(to_control.addr()).expect("connect through the proxy");
        assert_eq!(root.call(&["PING"]).expect("PING"), pong());
        // A client in the root namespace whose proxy connects from `b` is cut with `b`.
        as_b.send(&["PING"]).expect("send");
        silent(&mut as_b, Duration::from_secs(2));

        net.heal("a", "b").expect("heal");
        assert!(net.cuts_now().is_empty());
        // The PING sent during the cut is retransmitted and answered on the same connection.
        assert_eq!(
            b.read(Duration::from_secs(60)).expect("the held PING"),
            pong()
        );
        assert_eq!(b.call(&["PING"]).expect("PING"), pong());
        assert_eq!(
            as_b.read(Duration::from_secs(60)).expect("held PING"),
            pong()
        );

        // One way: `b`'s packets to `a` vanish, so `b`'s PING is never answered; `a`'s
        // packets to `b` still arrive (its earlier replies were all acknowledged).
        net.cut_one_way("b", "a").expect("cut one way");
        b.send(&["PING"]).expect("send");
        silent(&mut b, Duration::from_secs(2));
        net.heal_all().expect("heal all");
        assert_eq!(
            b.read(Duration::from_secs(60)).expect("the held PING"),
            pong()
        );
        // The control path cannot be cut.
        assert!(net.cut(CONTROL, "a").is_err());
    }

    #[test]
    fn a_replica_cut_from_its_primary_misses_writes_until_healed() {
        assert!(Net::available(), "these self-tests need root and iproute2");
        let net = Net::new("rlf-repl", &["a", "c"]).expect("net");
        let _primary = server(&net, "a", &[]);
        let replica_of = net.addr("a").to_string();
        let _replica = server(&net, "c", &["--replicaof", &replica_of, "6379"]);
        let mut p = conn(&net, CONTROL, "a");
        let mut r = conn(&net, CONTROL, "c");
        let ok = Reply::Status("OK".into());

        assert_eq!(p.call(&["SET", "k1", "v1"]).expect("SET"), ok);
        // WAIT returns once the replica acknowledged (an event, not a sleep).
        assert_eq!(
            p.call(&["WAIT", "1", "60000"]).expect("WAIT"),
            Reply::Int(1)
        );
        assert_eq!(
            r.call(&["GET", "k1"]).expect("GET"),
            Reply::Bulk(Some("v1".into()))
        );

        net.cut("a", "c").expect("cut");
        assert_eq!(p.call(&["SET", "k2", "v2"]).expect("SET"), ok);
        assert_eq!(p.call(&["WAIT", "1", "1000"]).expect("WAIT"), Reply::Int(0));
        assert_eq!(r.call(&["GET", "k2"]).expect("GET"), Reply::Bulk(None));

        net.heal("a", "c").expect("heal");
        assert_eq!(
            p.call(&["WAIT", "1", "60000"]).expect("WAIT"),
            Reply::Int(1)
        );
        assert_eq!(
            r.call(&["GET", "k2"]).expect("GET"),
            Reply::Bulk(Some("v2".into()))
        );
    }

    #[test]
    fn a_new_net_removes_a_stale_one_and_drop_leaves_nothing() {
        assert!(Net::available(), "these self-tests need root and iproute2");
        let listed = |prefix: &str| -> usize {
            let out = Command::new("ip")
                .args(["netns", "list"])
                .output()
                .expect("ip");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with(&format!("{prefix}-")))
                .count()
        };
        // Left behind as after a SIGKILL: no drop runs.
        std::mem::forget(Net::new("rlf-stale", &["x", "y"]).expect("net"));
        assert_eq!(listed("rlf-stale"), 3);
        let net = Net::new("rlf-stale", &["x"]).expect("net over a stale one");
        assert_eq!(listed("rlf-stale"), 2);
        drop(net);
        assert_eq!(listed("rlf-stale"), 0);
        // And while unwinding from a panic.
        let unwound = std::panic::catch_unwind(|| {
            let _net = Net::new("rlf-stale", &["x"]).expect("net");
            panic!("a test failing with a Net alive");
        });
        assert!(unwound.is_err());
        assert_eq!(listed("rlf-stale"), 0);
    }
}
