//! A TCP proxy on loopback in front of a test server that can hold back what clients send:
//! a write containing a given command (say `SUBSCRIBE`) waits at the proxy until the test
//! lets it through, so a test can put its own step between a client sending a command and
//! the server seeing it (the races a starved machine produces by chance). A write can also be
//! held on its connection alone ([`hold_first`](Proxy::hold_first)) while the client's side
//! of every connection is cut ([`cut_clients`](Proxy::cut_clients)): the client reconnects and
//! re-sends, and the held copy reaches the server later on the old connection, as a partition
//! that heals (or a server's socket buffer) delivers it.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// The proxy; dropping it closes every connection through it.
pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    gate: Mutex<Gate>,
    changed: Condvar,
    stop: AtomicBool,
    /// Every connection's two sockets, shut down when the proxy goes.
    sockets: Mutex<Vec<TcpStream>>,
    /// The client's side of every connection (also in `sockets`).
    clients: Mutex<Vec<TcpStream>>,
}

#[derive(Default)]
struct Gate {
    /// Client writes containing these bytes wait while set.
    hold: Option<Vec<u8>>,
    /// Writes waiting (or that waited) since the last `hold`.
    held: usize,
    /// The rules of [`Proxy::hold_first`], by their number.
    first: Vec<First>,
}

/// Holds the first client write containing `what` until it is passed; later ones go through.
struct First {
    what: Vec<u8>,
    /// Whether a write was held.
    held: bool,
    /// Whether the held write may go (and a write still to come is no longer held).
    open: bool,
    /// Whether the held write has been written to the server.
    delivered: bool,
}

impl Shared {
    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Proxy {
    /// A proxy to `127.0.0.1:upstream` on a free loopback port.
    pub fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("support: proxy bind");
        let port = listener
            .local_addr()
            .expect("support: proxy address")
            .port();
        let shared = Arc::new(Shared::default());
        let accepting = shared.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                if accepting.stop.load(Ordering::Acquire) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                connect(&accepting, client, server);
            }
        });
        Proxy { port, shared }
    }

    /// `redis://127.0.0.1:<port>`: the server, through the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// From now on, a client write containing `what` waits at the proxy until [`pass`](Self::pass).
    pub fn hold(&self, what: &[u8]) {
        let mut gate = self.shared.gate();
        gate.hold = Some(what.to_vec());
        gate.held = 0;
    }

    /// Waits until a write is held (at most `timeout`); whether one is.
    pub fn wait_held(&self, timeout: Duration) -> bool {
        self.wait_gate(timeout, |gate| gate.held > 0)
    }

    /// Lets the held writes through, and holds nothing more.
    pub fn pass(&self) {
        self.shared.gate().hold = None;
        self.shared.changed.notify_all();
    }

    /// From now on, holds the first client write containing `what` (on whichever connection)
    /// until [`pass_first`](Self::pass_first) with the number returned; later writes
    /// containing it go through. Independent of [`hold`](Self::hold) and of other such rules.
    pub fn hold_first(&self, what: &[u8]) -> usize {
        let mut gate = self.shared.gate();
        gate.first.push(First {
            what: what.to_vec(),
            held: false,
            open: false,
            delivered: false,
        });
        gate.first.len() - 1
    }

    /// Waits until rule `rule`'s write is held (at most `timeout`); whether it is.
    pub fn wait_first_held(&self, rule: usize, timeout: Duration) -> bool {
        self.wait_gate(timeout, |g| g.first[rule].held)
    }

    /// Lets rule `rule`'s held write through (on its own connection, if that is still open
    /// towards the server), and holds nothing more under that rule.
    pub fn pass_first(&self, rule: usize) {
        self.shared.gate().first[rule].open = true;
        self.shared.changed.notify_all();
    }

    /// Waits until rule `rule`'s held write has been written to the server (at most
    /// `timeout`); whether it has.
    pub fn wait_first_delivered(&self, rule: usize, timeout: Duration) -> bool {
        self.wait_gate(timeout, |g| g.first[rule].delivered)
    }

    /// Closes the client's side of every connection made so far, keeping the server's side
    /// open (with any write held on it): the client sees its connection drop and makes a new
    /// one; the server sees nothing.
    pub fn cut_clients(&self) {
        let clients = std::mem::take(
            &mut *self
                .shared
                .clients
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for c in clients {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    fn wait_gate(&self, timeout: Duration, done: impl Fn(&Gate) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut gate = self.shared.gate();
        while !done(&gate) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            gate = self
                .shared
                .changed
                .wait_timeout(gate, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.pass();
        for rule in &mut self.shared.gate().first {
            rule.open = true;
        }
        self.shared.changed.notify_all();
        let sockets = std::mem::take(
            &mut *self
                .shared
                .sockets
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for s in sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
        // Wakes the accepting thread, which sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Pumps both ways between `client` and `server` on two threads.
fn connect(shared: &Arc<Shared>, client: TcpStream, server: TcpStream) {
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3), Ok(c4)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
    ) else {
        return;
    };
    shared
        .sockets
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend([c3, s3]);
    shared
        .clients
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(c4);
    let up = shared.clone();
    thread::spawn(move || {
        let _ = pump(client, server, Some(&up));
    });
    thread::spawn(move || {
        let _ = pump(s2, c2, None);
    });
}

/// Copies `from` to `to` until either end closes, then closes both; a client's write that
/// the gate holds waits first.
fn pump(mut from: TcpStream, mut to: TcpStream, gated: Option<&Shared>) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    // The end of the previous read, so that a command split across two reads is still seen.
    let mut tail: Vec<u8> = Vec::new();
    let result = loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            Err(e) => break Err(e),
        };
        if let Some(shared) = gated {
            let old = tail.len();
            tail.extend_from_slice(&buf[..n]);
            let mut gate = shared.gate();
            if let Some(what) = gate.hold.clone() {
                if ends_in_new(&tail, old, &what) {
                    gate.held += 1;
                    shared.changed.notify_all();
                    while gate.hold.is_some() && !shared.stop.load(Ordering::Acquire) {
                        gate = shared.changed.wait(gate).unwrap_or_else(|p| p.into_inner());
                    }
                }
            }
            let rule = gate
                .first
                .iter()
                .position(|r| !r.held && !r.open && ends_in_new(&tail, old, &r.what));
            if let Some(rule) = rule {
                gate.first[rule].held = true;
                shared.changed.notify_all();
                while !gate.first[rule].open && !shared.stop.load(Ordering::Acquire) {
                    gate = shared.changed.wait(gate).unwrap_or_else(|p| p.into_inner());
                }
            }
            drop(gate);
            let keep = tail.len().min(64);
            tail.drain(..tail.len() - keep);
            let written = to.write_all(&buf[..n]);
            if let Some(rule) = rule {
                shared.gate().first[rule].delivered = written.is_ok();
                shared.changed.notify_all();
            }
            if let Err(e) = written {
                break Err(e);
            }
            continue;
        }
        if let Err(e) = to.write_all(&buf[..n]) {
            break Err(e);
        }
    };
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
    result
}

/// Whether `needle` occurs in `haystack` and ends past `old` (in the bytes just read: an
/// occurrence in the kept tail alone was seen, and let through, before).
fn ends_in_new(haystack: &[u8], old: usize, needle: &[u8]) -> bool {
    let k = needle.len();
    k > 0
        && haystack
            .windows(k)
            .enumerate()
            .any(|(i, w)| i + k > old && w == needle)
}
