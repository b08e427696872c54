//! Read-write locks (`RwLock`), on a real redis-server and in memory: many readers or one
//! writer checked by a `SharedChecker` under chaos (killed connections, crashed readers),
//! writer preference (a stream of readers cannot starve a writer; a writer that gives up
//! withdraws its preference, and one that dies loses it within a bound that does not grow
//! with its `max_delay`), a dead reader's lease expiring alone,
//! readers woken together by a write's release, fencing tokens, single attempts, a plain lock
//! as the writer, and the locks that refuse to be made read-write (Redlock, fair, reentrant).
//!
//! Every wait is bounded; where a wake-up is the point, the fallback re-check is far longer
//! than the test's bound.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use redlease::backend::{Acquire, Attempt, Claim, ClaimKind, Grant, NodeTerms, Release};
use redlease::{
    Backend, Error, LockGuard, LockManager, LockOptions, MemoryBackend, Owner, RedisBackend,
    RedisOptions, Redlock, RedlockOptions, RetryPolicy, RwLock, Token,
};
use support::{wait_for_async, within, RedisServer, SharedChecker, Store, SOON};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn redis_opts() -> RedisOptions {
    RedisOptions::new()
        .command_timeout(ms(500))
        .connect_timeout(secs(2))
}

impl Store {
    /// Whether the record of `rw` says a writer waits now (its `v` flag runs, by the server's
    /// clock). In memory there is nothing to read: `true` (the callers start the writer with
    /// [`start`], whose first poll has made its attempts there).
    fn writer_waits(&self, rw: &RwLock) -> bool {
        self.flag_live(rw, "v")
    }

    /// Whether the record of `rw` says shared claims (readers) wait now (its `s` flag).
    fn readers_wait(&self, rw: &RwLock) -> bool {
        self.flag_live(rw, "s")
    }

    fn flag_live(&self, rw: &RwLock, flag: &str) -> bool {
        match self {
            Store::Memory(_) => true,
            Store::Redis(srv) => {
                let key = rw.reader().key().as_str();
                support::int_field(srv, key, flag).is_some_and(|v| v > support::server_ms(srv))
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(srv) => {
                let column = if flag == "v" {
                    "writers_until"
                } else {
                    "sharers_until"
                };
                let hex: String = (rw.reader().key().as_str().bytes())
                    .map(|b| format!("{b:02x}"))
                    .collect();
                srv.psql(&format!(
                    "SELECT count(*) FROM redlease_lock WHERE key = decode('{hex}', 'hex') \
                     AND {column} > clock_timestamp()"
                )) == "1"
            }
        }
    }

    /// Waits until the record says a writer waits (see [`writer_waits`](Self::writer_waits)).
    async fn wait_writer_waits(&self, rw: &RwLock) {
        let seen = wait_for_async(SOON, || self.writer_waits(rw)).await;
        assert!(seen, "the writer never registered as waiting");
    }

    /// Waits until `n` connections are subscribed to the release channel of `rw` (at once
    /// in memory).
    async fn wait_subscribed(&self, rw: &RwLock, n: i64) {
        let Some(srv) = self.server() else { return };
        let channel = rw.reader().key().derived("released");
        let subscribed = || {
            srv.cmd(&["PUBSUB", "NUMSUB", &channel])
                .as_array()
                .and_then(|a| a.get(1).and_then(|n| n.as_int()))
                .unwrap_or(0)
        };
        let seen = wait_for_async(SOON, || subscribed() >= n).await;
        assert!(seen, "{} subscriptions, expected {n}", subscribed());
    }

    /// Waits until the record says readers wait (see [`readers_wait`](Self::readers_wait)).
    async fn wait_readers_wait(&self, rw: &RwLock) {
        let seen = wait_for_async(SOON, || self.readers_wait(rw)).await;
        assert!(seen, "the readers never registered as waiting");
    }
}

/// A future that records that it has been polled once.
struct Polled<F> {
    inner: Pin<Box<F>>,
    polled: Arc<AtomicBool>,
}

impl<F: Future> Future for Polled<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let out = self.inner.as_mut().poll(cx);
        self.polled.store(true, Ordering::SeqCst);
        out
    }
}

/// Starts `fut` (an acquire) on its own task and returns once its first poll is done (in
/// memory its first attempts are made by then).
async fn start<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let polled = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn(Polled {
        inner: Box::pin(fut),
        polled: polled.clone(),
    });
    assert!(
        wait_for_async(SOON, || polled.load(Ordering::SeqCst)).await,
        "the task was never polled"
    );
    task
}

/// Polls the async condition `f` every 5 ms until it holds (`true`) or `timeout` passes
/// (`false`).
async fn poll_until<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(ms(5)).await;
    }
}

/// Live reads of `rw` by the store (`LockInfo::shared_holds`), 0 when none.
async fn reads_held(rw: &RwLock) -> u64 {
    rw.inspect()
        .await
        .expect("inspect")
        .and_then(|i| i.shared_holds)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// 1 and 10. The checker: many readers or one writer, under chaos.
// ---------------------------------------------------------------------------------------

/// The shape of a checker run.
#[derive(Clone, Copy, Debug)]
struct Plan {
    managers: usize,
    readers: usize,
    writers: usize,
    reads_each: usize,
    writes_each: usize,
    /// Readers that crash once (forget their read after leaving the section), halfway.
    crashes: usize,
    /// `CLIENT KILL`s during the run (Redis only).
    kills: usize,
    ttl: Duration,
}

/// What a checker run saw.
#[derive(Debug, Default)]
struct Figures {
    sections: u64,
    reads: usize,
    writes: usize,
    peak: usize,
    crashed: usize,
    kills: usize,
    killed_connections: i64,
    /// Sections done when the last kill came (to show that it came in the middle of the run).
    sections_at_last_kill: u64,
    /// Guards found lost at the end of their section.
    lost: usize,
    /// Releases answered `NotHeld` though the guard was not lost: the store would no longer
    /// know the release as this guard's (see
    /// `a_replayed_write_release_is_still_answered_released_after_the_lock_moved_on`).
    not_held_releases: usize,
    /// Releases that failed (a killed connection; retried in the background).
    release_errors: usize,
    elapsed: Duration,
    violations: usize,
    report: String,
}

async fn run_checker(store: &Store, plan: Plan) -> Figures {
    let options = LockOptions::new()
        .ttl(plan.ttl)
        // A store unavailable for a moment (a killed connection) is waited out.
        .wait_timeout(Some(secs(30)));
    let mut managers = Vec::new();
    for _ in 0..plan.managers {
        managers.push(store.manager(options.clone()).await);
    }
    let checker = SharedChecker::new(usize::MAX);
    let reads = Arc::new(AtomicUsize::new(0));
    let writes = Arc::new(AtomicUsize::new(0));
    let crashed = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(AtomicUsize::new(0));
    let release_errors = Arc::new(AtomicUsize::new(0));
    let not_held = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..plan.readers {
        let rw = managers[i % plan.managers].rw("checked").unwrap();
        let (checker, reads, crashed) = (checker.clone(), reads.clone(), crashed.clone());
        let (lost, release_errors) = (lost.clone(), release_errors.clone());
        let not_held = not_held.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..plan.reads_each {
                let g = rw
                    .read()
                    .await
                    .unwrap_or_else(|e| panic!("reader {i}: {e}"));
                let section = checker.enter_shared(g.fencing_token());
                // Sections of 0 to 2 ms: readers overlap, and writers wait for them.
                let hold = (i + n) % 3;
                if hold == 0 {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(ms(hold as u64)).await;
                }
                if g.is_lost() {
                    lost.fetch_add(1, Ordering::SeqCst);
                }
                section.exit();
                reads.fetch_add(1, Ordering::SeqCst);
                if i < plan.crashes && n == plan.reads_each / 2 {
                    // As if the process died: no release, no watchdog; the lease runs out.
                    crashed.fetch_add(1, Ordering::SeqCst);
                    g.forget();
                    continue;
                }
                match g.release().await {
                    Ok(_) => {}
                    Err(Error::NotHeld) => {
                        not_held.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => {
                        release_errors.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }));
    }
    for i in 0..plan.writers {
        let rw = managers[(i + 1) % plan.managers].rw("checked").unwrap();
        let (checker, writes) = (checker.clone(), writes.clone());
        let (lost, release_errors) = (lost.clone(), release_errors.clone());
        let not_held = not_held.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..plan.writes_each {
                let g = rw
                    .write()
                    .await
                    .unwrap_or_else(|e| panic!("writer {i}: {e}"));
                let section = checker.enter_writer(g.fencing_token());
                tokio::time::sleep(ms(1)).await;
                if g.is_lost() {
                    lost.fetch_add(1, Ordering::SeqCst);
                }
                section.exit();
                writes.fetch_add(1, Ordering::SeqCst);
                match g.release().await {
                    Ok(_) => {}
                    Err(Error::NotHeld) => {
                        not_held.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => {
                        release_errors.fetch_add(1, Ordering::SeqCst);
                    }
                }
                // Pacing: writers that always wait would hold every reader back (writer
                // preference), and the run would be a plain lock's.
                tokio::time::sleep(ms(10)).await;
            }
        }));
    }
    let mut killed_connections = 0;
    let mut kills = 0;
    let mut sections_at_last_kill = 0;
    if let Some(srv) = store.server() {
        for _ in 0..plan.kills {
            tokio::time::sleep(ms(250)).await;
            killed_connections += srv.kill_clients();
            kills += 1;
            sections_at_last_kill = checker.sections();
        }
    }
    for t in tasks {
        tokio::time::timeout(secs(60), t)
            .await
            .expect("a checker task hung")
            .expect("a checker task panicked");
    }
    Figures {
        sections: checker.sections(),
        reads: reads.load(Ordering::SeqCst),
        writes: writes.load(Ordering::SeqCst),
        peak: checker.peak(),
        crashed: crashed.load(Ordering::SeqCst),
        kills,
        killed_connections,
        sections_at_last_kill,
        lost: lost.load(Ordering::SeqCst),
        not_held_releases: not_held.load(Ordering::SeqCst),
        release_errors: release_errors.load(Ordering::SeqCst),
        elapsed: started.elapsed(),
        violations: checker.violations(),
        report: checker.report(),
    }
}

fn check_figures(what: &str, plan: Plan, f: &Figures) {
    println!(
        "{what}: {} sections ({} reads, {} writes), peak {} readers at once, {} crashed \
         readers, {} kills ({} connections, the last after {} sections), {} lost guards, \
         {} releases answered not held, {} failed releases, {} violations, in {:?}",
        f.sections,
        f.reads,
        f.writes,
        f.peak,
        f.crashed,
        f.kills,
        f.killed_connections,
        f.sections_at_last_kill,
        f.lost,
        f.not_held_releases,
        f.release_errors,
        f.violations,
        f.elapsed
    );
    assert_eq!(f.violations, 0, "{what}: {}", f.report);
    assert_eq!(f.reads, plan.readers * plan.reads_each, "{what}");
    assert_eq!(f.writes, plan.writers * plan.writes_each, "{what}");
    assert!(f.writes > 0, "{what}: no writer got in");
    assert_eq!(f.sections as usize, f.reads + f.writes, "{what}");
    assert!(
        f.peak > 1,
        "{what}: readers never overlapped (peak {}): the check is vacuous",
        f.peak
    );
    assert_eq!(f.crashed, plan.crashes, "{what}");
    assert_eq!(
        f.lost, 0,
        "{what}: guards were lost in their sections: {f:?}"
    );
    // A release re-sent by the client after a kill is still answered "released" (see
    // `a_replayed_write_release_is_still_answered_released_after_the_lock_moved_on`).
    assert_eq!(
        f.not_held_releases, 0,
        "{what}: releases of guards that were not lost answered \"not held\": {f:?}"
    );
}

/// 48 readers and 4 writers in 4 managers (processes), 3000 sections, with connections killed
/// three times and 4 readers crashing: never a writer with anyone else, never a writer's token
/// below an earlier one, readers together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_readers_and_writers_across_managers_with_chaos() {
    let store = Store::redis();
    let plan = Plan {
        managers: 4,
        readers: 48,
        writers: 4,
        reads_each: 60,
        writes_each: 30,
        crashes: 4,
        kills: 3,
        ttl: secs(1),
    };
    let f = run_checker(&store, plan).await;
    check_figures("redis checker", plan, &f);
    assert_eq!(f.kills, plan.kills);
    assert!(
        f.killed_connections >= plan.kills as i64,
        "the kills killed nothing: {f:?}"
    );
    assert!(
        f.sections_at_last_kill < f.sections,
        "the kills came after the run: {f:?}"
    );
}

/// The same checker in memory, smaller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_checker_readers_and_writers() {
    let store = Store::memory();
    let plan = Plan {
        managers: 3,
        readers: 16,
        writers: 2,
        reads_each: 40,
        writes_each: 20,
        crashes: 2,
        kills: 0,
        ttl: secs(1),
    };
    let f = run_checker(&store, plan).await;
    check_figures("memory checker", plan, &f);
}

// ---------------------------------------------------------------------------------------
// 2 and 10. Writer preference: a stream of readers does not starve a writer.
// ---------------------------------------------------------------------------------------

/// How long each reader of the stream holds its read.
const STREAM_HOLD: Duration = Duration::from_millis(20);

/// 16 readers in two managers loop read, hold 20 ms, release, each taking its next read
/// before it releases the last (hand over hand: the lock is never free of readers, however
/// the tasks are scheduled; checked: sampled, it is always held by reads and a single write
/// attempt always fails). A writer that starts waiting gets the lock within a bound set by
/// the reads already inside (20 ms + slack, far below 1 s), and no read begun after the
/// writer registered gets in before it (fencing tokens).
async fn writer_is_not_starved_by_a_stream_of_readers(store: Store) {
    const READERS: usize = 16;
    const SLACK: Duration = Duration::from_millis(400);
    // A fallback re-check far beyond the bound: the writer is let in by the releases.
    let options = LockOptions::new()
        .ttl(secs(2))
        .retry(RetryPolicy::notify().max_delay(secs(5)))
        .wait_timeout(Some(SOON));
    let readers_m = [
        store.manager(options.clone()).await,
        store.manager(options.clone()).await,
    ];
    let writer_m = store.manager(options.clone()).await;
    let probe_m = store.manager(options).await;
    let probe = probe_m.rw("stream").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // (when the read call began, its fencing token)
    let reads: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..READERS {
        let rw = readers_m[i % 2].rw("stream").unwrap();
        let (stop, reads) = (stop.clone(), reads.clone());
        tasks.push(tokio::spawn(async move {
            // Staggered starts: the reads' ends are spread over the hold time.
            tokio::time::sleep(STREAM_HOLD * i as u32 / READERS as u32).await;
            let mut began = Instant::now();
            let mut g = rw
                .read()
                .await
                .unwrap_or_else(|e| panic!("reader {i}: {e}"));
            loop {
                reads.lock().unwrap().push((began, g.fencing_token()));
                tokio::time::sleep(STREAM_HOLD).await;
                if stop.load(Ordering::SeqCst) {
                    g.release().await.expect("release a read");
                    break;
                }
                // Hand over hand: the next read is tried (once) before this one is released,
                // so the lock is never free of reads however late a starved machine runs this
                // task. Once a writer waits the try is turned away (writer preference): this
                // read is released and the next one waits behind the writer.
                began = Instant::now();
                let next = rw
                    .try_read()
                    .await
                    .unwrap_or_else(|e| panic!("reader {i}: {e}"));
                g.release().await.expect("release a read");
                g = match next {
                    Some(next) => next,
                    None => {
                        // Turned away: this read begins now, behind the writer.
                        began = Instant::now();
                        rw.read()
                            .await
                            .unwrap_or_else(|e| panic!("reader {i}: {e}"))
                    }
                };
            }
        }));
    }
    let count = |reads: &Arc<Mutex<Vec<(Instant, u64)>>>| reads.lock().unwrap().len();
    assert!(
        wait_for_async(SOON, || count(&reads) >= 3 * READERS).await,
        "the readers did not get going"
    );

    // Without writer preference a writer would wait forever: the lock is never free.
    let samples = 25;
    let mut held_samples = 0;
    for _ in 0..samples {
        if reads_held(&probe).await > 0 {
            held_samples += 1;
        }
        if let Some(w) = probe.try_write().await.expect("try_write") {
            w.release().await.unwrap();
            panic!("a single write attempt got in between the readers: the stream has gaps");
        }
        tokio::time::sleep(ms(8)).await;
    }
    assert_eq!(
        held_samples, samples,
        "the readers left the lock free at some samples: the bound below would mean nothing"
    );

    let writer_rw = writer_m.rw("stream").unwrap();
    let writer_began = Instant::now();
    let writer = tokio::spawn(async move {
        let g = writer_rw.write().await.expect("the writer gets in");
        let at = Instant::now();
        let token = g.fencing_token();
        tokio::time::sleep(ms(5)).await;
        g.release().await.expect("release the write");
        (at, token)
    });
    // The writer has registered once a single read attempt is turned away while only readers
    // hold (or the writer holds).
    let registered = loop {
        match probe.try_read().await.expect("try_read") {
            Some(g) => {
                g.release().await.unwrap();
            }
            None => break Instant::now(),
        }
        assert!(
            writer_began.elapsed() < SOON,
            "the writer never held new reads back"
        );
    };
    let (granted_at, write_token) = within("the writer's grant", writer)
        .await
        .expect("writer task");
    let waited = granted_at - writer_began;
    // The readers go on after the write (two reads each: the second begins after it).
    let before = count(&reads);
    assert!(
        wait_for_async(SOON, || count(&reads) >= before + 2 * READERS).await,
        "the readers did not come back after the write"
    );
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        within("a reader's end", t).await.expect("reader task");
    }
    let reads = reads.lock().unwrap().clone();
    let late: Vec<u64> = reads
        .iter()
        .filter(|(began, _)| *began > registered)
        .map(|(_, token)| *token)
        .collect();
    let jumped: Vec<u64> = late.iter().copied().filter(|t| *t < write_token).collect();
    println!(
        "writer preference: the writer waited {waited:?} behind a stream of {READERS} readers \
         ({} reads in all, {} begun after the writer registered)",
        reads.len(),
        late.len()
    );
    assert!(
        jumped.is_empty(),
        "reads begun after the writer registered got in before it (write token {write_token}): \
         {jumped:?}"
    );
    assert!(
        !late.is_empty(),
        "no read began after the writer registered"
    );
    assert!(
        waited <= STREAM_HOLD + SLACK,
        "the writer waited {waited:?} behind reads of {STREAM_HOLD:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_writer_is_not_starved_by_a_stream_of_readers() {
    writer_is_not_starved_by_a_stream_of_readers(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_writer_is_not_starved_by_a_stream_of_readers() {
    writer_is_not_starved_by_a_stream_of_readers(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 3. A dead reader's lease expires alone.
// ---------------------------------------------------------------------------------------

/// Two readers in two managers; one crashes (forgets its read). After its TTL the live one is
/// still held (extended by its own watchdog, not lost), the dead one's hold is gone from the
/// count and the labels, a writer still waits while the live reader holds, and gets in once
/// it releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_readers_lease_expires_alone() {
    let store = Store::redis();
    let ttl = secs(1);
    let base = LockOptions::new()
        .ttl(ttl)
        .retry(RetryPolicy::notify().max_delay(secs(5)))
        .wait_timeout(Some(SOON));
    let live_m = store
        .manager(base.clone().holder_label("live-reader"))
        .await;
    let dead_m = store
        .manager(base.clone().holder_label("dead-reader"))
        .await;
    let writer_m = store.manager(base.holder_label("writer")).await;
    let live_rw = live_m.rw("alone").unwrap();
    let live = live_rw.read().await.unwrap();
    let dead = dead_m.rw("alone").unwrap().read().await.unwrap();
    let info = live_rw.inspect().await.unwrap().expect("held");
    assert_eq!(info.shared_holds, Some(2));
    let mut labels = info.shared_labels.clone();
    labels.sort();
    assert_eq!(labels, ["dead-reader", "live-reader"]);
    assert_eq!(info.holder_label, None);
    let live_token = live.fencing_token();
    let dead_token = dead.fencing_token();
    assert_ne!(live_token, dead_token);
    let crashed_at = Instant::now();
    dead.forget();

    let writer_rw = writer_m.rw("alone").unwrap();
    let writer = start(async move {
        let g = writer_rw.write().await;
        (Instant::now(), g)
    })
    .await;
    store.wait_writer_waits(&live_rw).await;

    // The dead read leaves the count once its TTL has run out, not before.
    assert!(
        poll_until(ttl * 3, || async { reads_held(&live_rw).await == 1 }).await,
        "the dead read is still counted {:?} after the crash",
        crashed_at.elapsed()
    );
    let gone_after = crashed_at.elapsed();
    assert!(
        gone_after >= ttl / 2,
        "the dead read was gone {gone_after:?} after the crash, well before its TTL {ttl:?}"
    );
    // Another whole TTL: the live read outlives it, extended by its own watchdog.
    tokio::time::sleep(ttl + ms(200)).await;
    assert!(!live.is_lost(), "{:?}", live_m.watchdog_stats());
    let info = live_rw.inspect().await.unwrap().expect("held");
    assert!(info.held);
    assert_eq!(info.shared_holds, Some(1), "{info:?}");
    assert_eq!(info.shared_labels, ["live-reader"]);
    assert!(
        !writer.is_finished(),
        "the writer got in while the live reader held"
    );

    let released_at = Instant::now();
    live.release().await.expect("the live read is still ours");
    let (granted_at, g) = within("the writer's grant", writer)
        .await
        .expect("writer task");
    let g = g.expect("the writer gets in");
    assert!(
        granted_at - released_at < ms(500),
        "the writer took {:?} after the live read's release",
        granted_at - released_at
    );
    assert!(g.fencing_token() > live_token.max(dead_token));
    let info = live_rw.inspect().await.unwrap().expect("held");
    assert_eq!(info.shared_holds, None);
    assert_eq!(info.holder_label.as_deref(), Some("writer"));
    g.release().await.unwrap();
    println!("dead reader: its hold left the count {gone_after:?} after the crash (TTL {ttl:?})");
}

// ---------------------------------------------------------------------------------------
// 4. Readers woken together by a write's release.
// ---------------------------------------------------------------------------------------

/// A writer holds; 5 readers (3 in one manager, 2 in another) wait with a 10 s fallback
/// re-check; the write's release lets all of them in within a second, together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_waiting_for_a_write_are_woken_together_by_its_release() {
    let store = Store::redis();
    // A long TTL: the readers' re-check is bounded by the holder's time left, too.
    let options = LockOptions::new()
        .ttl(secs(30))
        .retry(RetryPolicy::notify().max_delay(secs(10)))
        .wait_timeout(Some(secs(20)));
    let writer_m = store.manager(options.clone()).await;
    let readers_m = [
        store.manager(options.clone()).await,
        store.manager(options).await,
    ];
    let rw = writer_m.rw("woken").unwrap();
    let w = rw.write().await.unwrap();
    let mut readers = Vec::new();
    for i in 0..5 {
        let r = readers_m[i % 2].rw("woken").unwrap();
        readers.push(
            start(async move {
                let g = r.read().await;
                (Instant::now(), g)
            })
            .await,
        );
    }
    store.wait_readers_wait(&rw).await;
    // Every reader's subscription is up (both managers subscribed to the channel).
    store.wait_subscribed(&rw, 2).await;
    assert!(readers.iter().all(|r| !r.is_finished()));
    let write_token = w.fencing_token();
    let released_at = Instant::now();
    w.release().await.unwrap();
    let mut guards = Vec::new();
    let mut slowest = Duration::ZERO;
    for r in readers {
        let (at, g) = within("a reader's grant", r).await.expect("reader task");
        let g = g.expect("the reader gets in");
        assert!(g.fencing_token() > write_token);
        slowest = slowest.max(at - released_at);
        guards.push(g);
    }
    println!("woken together: the 5 readers were in {slowest:?} after the write's release");
    assert!(
        slowest < secs(1),
        "a reader took {slowest:?} after the release: not woken by it (fallback 10 s)"
    );
    assert_eq!(reads_held(&rw).await, 5, "the readers hold together");
    for g in guards {
        g.release().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// 5. Fencing.
// ---------------------------------------------------------------------------------------

/// A write's token is greater than every earlier read's (in any manager) and the previous
/// write's; every read has a token of its own, above the previous write's.
async fn write_tokens_exceed_every_earlier_token(store: Store) {
    let options = LockOptions::new().ttl(secs(5));
    let a = store.manager(options.clone()).await.rw("fence").unwrap();
    let b = store.manager(options).await.rw("fence").unwrap();
    let mut last_write = 0;
    for round in 0..3 {
        let w = if round % 2 == 0 { &a } else { &b }.write().await.unwrap();
        let write_token = w.fencing_token();
        assert!(
            write_token > last_write,
            "round {round}: write token {write_token} after a write's {last_write}"
        );
        let info = a.inspect().await.unwrap().expect("held");
        assert_eq!(info.fencing_token, Some(write_token));
        w.release().await.unwrap();
        let mut reads = Vec::new();
        for i in 0..4 {
            reads.push(if i % 2 == 0 { &a } else { &b }.read().await.unwrap());
        }
        let mut tokens: Vec<u64> = reads.iter().map(LockGuard::fencing_token).collect();
        assert!(
            tokens.iter().all(|t| *t > write_token),
            "round {round}: reads {tokens:?} after the write's {write_token}"
        );
        // Released in another order than taken: the next write is above all of them anyway.
        for g in reads.into_iter().rev() {
            g.release().await.unwrap();
        }
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 4, "round {round}: reads share a token");
        let top = *tokens.last().unwrap();
        let next = b.write().await.unwrap();
        assert!(
            next.fencing_token() > top,
            "round {round}: write token {} not above the reads' {tokens:?}",
            next.fencing_token()
        );
        last_write = next.fencing_token();
        next.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_write_tokens_exceed_every_earlier_token() {
    write_tokens_exceed_every_earlier_token(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_write_tokens_exceed_every_earlier_token() {
    write_tokens_exceed_every_earlier_token(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 6. A writer that gives up, or dies: its preference ends within a bound of its own.
// ---------------------------------------------------------------------------------------

/// The longest fallback re-check (`MAX_RETRY_DELAY`): with it a waiting writer would once
/// hold new readers back for two hours after its last attempt, and a waiting reader would
/// re-check once an hour. Every waiter below uses it, and every lease a TTL far beyond the
/// tests' bounds (a read held lets a reader turned away come back when its TTL would run
/// out), so that only the store's messages and the writer's preference lease let a reader in.
const HOUR: Duration = Duration::from_secs(3600);

fn hour_options() -> LockOptions {
    LockOptions::new()
        .ttl(SOON * 6)
        .retry(RetryPolicy::notify().max_delay(HOUR))
        .wait_timeout(Some(SOON))
}

/// The environment variable that makes this test binary the waiting writer of
/// [`redis_a_killed_waiting_writers_preference_lapses_whatever_its_max_delay`], in a process of
/// its own: the server's URL.
const CHILD_WRITER: &str = "REDLEASE_TEST_RW_CHILD_WRITER";

/// The lock name the dead writer tests use.
const DEAD: &str = "dead-writer";

/// A waiting writer that is made to die while it waits: on Redis a process of its own (this
/// test binary run again, as [`CHILD_WRITER`]) killed with SIGKILL; in memory an acquire
/// frozen in the middle of its wait (never polled again, never dropped), which is what a
/// killed process is to an in-process store.
enum DeadWriter {
    Process(Child),
    Frozen(Pin<Box<dyn Future<Output = redlease::Result<LockGuard>> + Send>>),
}

impl DeadWriter {
    /// Starts the writer; it waits (for a read held by the caller) once the record says so.
    async fn start(store: &Store) -> DeadWriter {
        match store.server() {
            Some(srv) => {
                let child = std::process::Command::new(std::env::current_exe().expect("exe"))
                    .args([
                        "redis_a_killed_waiting_writers_preference_lapses_whatever_its_max_delay",
                        "--exact",
                        "--nocapture",
                    ])
                    .env(CHILD_WRITER, srv.url())
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("start the writer's process");
                DeadWriter::Process(Child(child))
            }
            None => {
                let rw = store.manager(hour_options()).await.rw(DEAD).unwrap();
                let mut acquire: Pin<Box<dyn Future<Output = _> + Send>> =
                    Box::pin(async move { rw.write().await });
                // In memory the first poll makes the writer's attempts: it waits after it.
                assert!(futures::poll!(acquire.as_mut()).is_pending());
                DeadWriter::Frozen(acquire)
            }
        }
    }

    /// Dies: SIGKILL (its connections close with it), or frozen for good.
    fn die(self) {
        match self {
            DeadWriter::Process(mut child) => {
                child.0.kill().expect("SIGKILL the writer's process");
                child.0.wait().expect("reap the writer's process");
            }
            DeadWriter::Frozen(acquire) => std::mem::forget(acquire),
        }
    }
}

/// A child process, killed when dropped: a test that fails before the kill leaves no process
/// behind.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        // (Killed and reaped already when the test went as planned: nothing to do.)
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child process of the Redis test: a writer (fallback re-check an hour) waiting for the
/// read its parent holds, until the parent kills it.
async fn child_writer(url: &str) {
    let backend = RedisBackend::connect_with(url, redis_opts())
        .await
        .expect("the child connects");
    let locks = LockManager::with_options(backend, hour_options()).expect("options");
    let outcome = locks
        .rw(DEAD)
        .unwrap()
        .write_timeout(SOON * 3)
        .await
        .map(|g| g.fencing_token());
    panic!("the child writer was to wait until killed, and ended with {outcome:?}");
}

/// A read is held; a writer waits (fallback re-check an hour), then a reader waits behind it
/// (the same), and the writer dies without a word. The waiting reader must get in, and so
/// must a reader that comes after the death, within a bound that does not grow with the
/// writer's `max_delay` (`within` SOON). Before, the dead writer's preference ran
/// 2 x max_delay + 100 ms past its last attempt (two hours here) and the waiting reader's
/// next re-check was an hour away: both readers timed out. Now the preference is a lease of
/// at most 2.1 s that the writer's own attempts renew, and a reader turned away by it comes
/// back when it lapses.
async fn a_dead_writers_preference_lapses_whatever_its_max_delay(store: Store) {
    let holder_m = store.manager(hour_options()).await;
    let reader_m = store.manager(hour_options()).await;
    let late_m = store.manager(hour_options()).await;
    let rw = holder_m.rw(DEAD).unwrap();
    let held = rw.read().await.unwrap();
    let writer = DeadWriter::start(&store).await;
    store.wait_writer_waits(&rw).await;
    let reader_rw = reader_m.rw(DEAD).unwrap();
    let reader = start(async move { reader_rw.read().await.map(|g| (Instant::now(), g)) }).await;
    store.wait_readers_wait(&rw).await;
    // The writer's and the reader's processes are subscribed: both wait.
    store.wait_subscribed(&rw, 2).await;
    let died = Instant::now();
    writer.die();
    let (at, waiting) = within("the waiting reader", reader)
        .await
        .expect("reader task")
        .expect("the reader waiting behind the dead writer gets in");
    let late = late_m
        .rw(DEAD)
        .unwrap()
        .read()
        .await
        .expect("a reader that comes after the writer died gets in");
    println!(
        "dead writer (max_delay {HOUR:?}): the waiting reader got in {:?} after it died, a \
         later one {:?} after",
        at - died,
        died.elapsed()
    );
    assert!(!held.is_lost());
    assert_eq!(reads_held(&rw).await, 3);
    for g in [waiting, late, held] {
        g.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_killed_waiting_writers_preference_lapses_whatever_its_max_delay() {
    if let Ok(url) = std::env::var(CHILD_WRITER) {
        return child_writer(&url).await;
    }
    a_dead_writers_preference_lapses_whatever_its_max_delay(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_frozen_waiting_writers_preference_lapses_whatever_its_max_delay() {
    a_dead_writers_preference_lapses_whatever_its_max_delay(Store::memory()).await;
}

/// A read is held; a writer waits (fallback re-check an hour), then a reader waits behind it
/// (the same). The writer gives up (its acquire dropped, as a wait limit ends it). Its
/// preference is withdrawn with its clean-up: a read attempted after the give-up in the
/// writer's own manager (whose attempts follow that clean-up) gets in at once, and the
/// waiting reader is woken: on Redis by a message on the release channel, seen here by a
/// subscriber of the test's own. Before, a waiting writer's give-up sent nothing: the read
/// attempt was turned away and the waiting reader waited out the writer's two hours.
async fn a_writer_that_gives_up_withdraws_its_preference(store: Store) {
    const NAME: &str = "gives-up";
    let holder_m = store.manager(hour_options()).await;
    let writer_m = store.manager(hour_options()).await;
    let reader_m = store.manager(hour_options()).await;
    let rw = holder_m.rw(NAME).unwrap();
    let held = rw.read().await.unwrap();
    let writer_rw = writer_m.rw(NAME).unwrap();
    let writer = start(async move { writer_rw.write().await }).await;
    store.wait_writer_waits(&rw).await;
    let reader_rw = reader_m.rw(NAME).unwrap();
    let reader = start(async move { reader_rw.read().await.map(|g| (Instant::now(), g)) }).await;
    store.wait_readers_wait(&rw).await;
    store.wait_subscribed(&rw, 2).await;
    let channel = rw.reader().key().derived("released");
    let mut sub = store.server().map(|srv| {
        let mut sub = srv.connect();
        sub.cmd(&["SUBSCRIBE", &channel]).expect("subscribe");
        sub
    });
    let gave_up = Instant::now();
    writer.abort();
    assert!(
        within("the writer's end", writer).await.is_err(),
        "the writer was to be cancelled, waiting"
    );
    let after = writer_m
        .rw(NAME)
        .unwrap()
        .try_read()
        .await
        .expect("try_read")
        .expect("a read attempted after the writer gave up is turned away: its preference stayed");
    let (at, waiting) = within("the waiting reader", reader)
        .await
        .expect("reader task")
        .expect("the waiting reader gets in");
    println!(
        "a writer gave up (max_delay {HOUR:?}): the waiting reader got in {:?} after",
        at - gave_up
    );
    if let Some(mut sub) = sub.take() {
        let message = tokio::task::spawn_blocking(move || {
            sub.set_read_timeout(Some(SOON)).expect("timeout");
            sub.read_reply()
        })
        .await
        .expect("reader thread")
        .expect("a message on the release channel after the give-up");
        let parts = message.as_array().expect("a pub/sub message");
        assert_eq!(parts[0].as_str().as_deref(), Some("message"), "{message:?}");
        assert_eq!(
            parts[2].as_str().as_deref(),
            Some("*"),
            "the give-up wakes every reader: {message:?}"
        );
    }
    assert_eq!(reads_held(&rw).await, 3);
    for g in [after, waiting, held] {
        g.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_writer_that_gives_up_withdraws_its_preference() {
    a_writer_that_gives_up_withdraws_its_preference(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_writer_that_gives_up_withdraws_its_preference() {
    a_writer_that_gives_up_withdraws_its_preference(Store::memory()).await;
}

/// A live writer waiting with a fallback re-check of an hour keeps new readers back past
/// the end of the preference lease it first took: its attempts renew the lease well before
/// it lapses, whatever its `max_delay`. Before, the first lease ran two hours (the wait for
/// its end fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_writer_renews_its_preference_whatever_its_max_delay() {
    let store = Store::redis();
    let srv = store.server().expect("redis").clone();
    const NAME: &str = "renewed";
    let holder_m = store.manager(hour_options()).await;
    let writer_m = store.manager(hour_options()).await;
    let probe_m = store.manager(hour_options()).await;
    let rw = holder_m.rw(NAME).unwrap();
    let held = rw.read().await.unwrap();
    let writer_rw = writer_m.rw(NAME).unwrap();
    let writer = start(async move { writer_rw.write().await }).await;
    store.wait_writer_waits(&rw).await;
    let key = rw.reader().key().as_str().to_owned();
    let first = support::int_field(&srv, &key, "v").expect("the writer's preference");
    assert!(
        wait_for_async(SOON, || support::server_ms(&srv) > first).await,
        "the writer's first preference lease runs {} ms",
        first - support::server_ms(&srv)
    );
    let renewed = support::int_field(&srv, &key, "v").expect("the writer's preference");
    assert!(
        renewed > first,
        "the preference was not renewed: {renewed} <= {first}"
    );
    assert!(
        probe_m
            .rw(NAME)
            .unwrap()
            .try_read()
            .await
            .unwrap()
            .is_none(),
        "a read got in past a live writer once its first preference lease ran out"
    );
    writer.abort();
    held.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// 7. Single attempts.
// ---------------------------------------------------------------------------------------

/// `try_read` is `None` while a writer holds and while a writer waits; `try_write` is `None`
/// while readers hold; both succeed when nothing stands in the way.
async fn single_attempts(store: Store) {
    let options = LockOptions::new()
        .ttl(secs(5))
        .retry(RetryPolicy::notify().max_delay(secs(5)))
        .wait_timeout(Some(SOON));
    let a = store.manager(options.clone()).await.rw("try").unwrap();
    let b = store.manager(options).await.rw("try").unwrap();

    let w = a.try_write().await.unwrap().expect("a free lock's write");
    assert!(
        b.try_read().await.unwrap().is_none(),
        "a read beside a write"
    );
    assert!(b.try_write().await.unwrap().is_none(), "two writes");
    w.release().await.unwrap();

    let r1 = a.try_read().await.unwrap().expect("a free lock's read");
    let r2 = b.try_read().await.unwrap().expect("readers share");
    assert!(
        a.try_write().await.unwrap().is_none(),
        "a write beside reads"
    );
    assert_eq!(reads_held(&a).await, 2);
    // A single write attempt does not register as a waiting writer.
    let r3 = b.try_read().await.unwrap().expect("a third reader");
    r3.release().await.unwrap();

    // A writer waits: new single read attempts are turned away, though only readers hold.
    let writer_rw = b.clone();
    let writer = start(async move { writer_rw.write().await }).await;
    store.wait_writer_waits(&a).await;
    assert!(
        a.try_read().await.unwrap().is_none(),
        "a read got in while a writer waited"
    );
    assert!(b.try_read().await.unwrap().is_none());
    r1.release().await.unwrap();
    assert!(a.try_read().await.unwrap().is_none());
    r2.release().await.unwrap();
    let w = within("the writer's grant", writer)
        .await
        .unwrap()
        .expect("the writer gets in");
    assert!(
        a.try_read().await.unwrap().is_none(),
        "a read beside the write"
    );
    w.release().await.unwrap();
    // The granted writer cleared its preference: reads are let in at once.
    let r = a.try_read().await.unwrap().expect("a read after the write");
    r.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_single_attempts() {
    single_attempts(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_single_attempts() {
    single_attempts(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 8. A plain lock on the same name is the writer.
// ---------------------------------------------------------------------------------------

async fn plain_lock_is_the_writer(store: Store) {
    let options = LockOptions::new()
        .ttl(secs(5))
        .retry(RetryPolicy::notify().max_delay(secs(5)))
        .wait_timeout(Some(SOON));
    let rw_m = store.manager(options.clone()).await;
    let plain_m = store.manager(options.holder_label("plain")).await;
    let rw = rw_m.rw("both").unwrap();
    let plain = plain_m.lock("both");
    assert_eq!(rw.writer().key(), plain.key());

    let r = rw.read().await.unwrap();
    assert!(
        plain.try_acquire().await.unwrap().is_none(),
        "a plain lock beside a read"
    );
    // A waiting plain acquire is a waiting writer: new reads wait behind it.
    let waiting_plain = plain.clone();
    let waiter = start(async move { waiting_plain.acquire().await }).await;
    store.wait_writer_waits(&rw).await;
    assert!(
        rw.try_read().await.unwrap().is_none(),
        "a read got in while a plain lock waited"
    );
    let read_token = r.fencing_token();
    r.release().await.unwrap();
    let g = within("the plain lock's grant", waiter)
        .await
        .unwrap()
        .expect("the plain lock gets in");
    assert!(g.fencing_token() > read_token);
    assert!(
        rw.try_read().await.unwrap().is_none(),
        "a read beside a plain lock"
    );
    assert!(rw.try_write().await.unwrap().is_none());
    let info = rw.inspect().await.unwrap().expect("held");
    assert!(info.held);
    assert_eq!(info.holder_label.as_deref(), Some("plain"));
    assert_eq!(info.shared_holds, None);
    let plain_token = g.fencing_token();
    g.release().await.unwrap();
    let r = rw
        .try_read()
        .await
        .unwrap()
        .expect("a read after the plain lock");
    assert!(r.fencing_token() > plain_token);
    r.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_plain_lock_is_the_writer() {
    plain_lock_is_the_writer(Store::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_plain_lock_is_the_writer() {
    plain_lock_is_the_writer(Store::memory()).await;
}

// ---------------------------------------------------------------------------------------
// 9. Locks that cannot be read-write.
// ---------------------------------------------------------------------------------------

/// Redlock refuses read-write locks (`Unsupported`); fair and reentrant locks cannot be made
/// read-write (`InvalidConfig`), on Redis and in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_fair_and_reentrant_locks_refuse_rw() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let mut nodes = Vec::new();
    for srv in &servers {
        nodes.push(
            RedisBackend::connect_with(&srv.url(), redis_opts())
                .await
                .unwrap(),
        );
    }
    let redlock = Redlock::with_options(
        nodes,
        RedlockOptions::new()
            .restart_guard(false)
            .node_timeout(ms(500)),
    )
    .unwrap();
    let locks = LockManager::new(redlock);
    for refused in [locks.rw("rw"), locks.lock("rw").rw()] {
        match refused {
            Err(Error::Unsupported(msg)) => {
                assert!(msg.contains("read-write"), "{msg}")
            }
            other => panic!("Redlock made a read-write lock: {other:?}"),
        }
    }
    // The Redlock's plain locks still work.
    let g = locks.lock("rw").acquire().await.unwrap();
    g.release().await.unwrap();

    let redis = RedisBackend::connect_with(&servers[0].url(), redis_opts())
        .await
        .unwrap();
    for backend in [
        Arc::new(redis) as Arc<dyn Backend>,
        Arc::new(MemoryBackend::new()),
    ] {
        let locks = LockManager::new(backend.clone());
        let invalid = |r: redlease::Result<RwLock>, what: &str| match r {
            Err(Error::InvalidConfig(_)) => {}
            other => panic!("{what} made a read-write lock: {other:?}"),
        };
        invalid(locks.lock("rw").fair().unwrap().rw(), "a fair lock");
        invalid(
            locks.lock_with("rw", |o| o.fair(true)).unwrap().rw(),
            "a lock with fair options",
        );
        let fair_m = LockManager::with_options(backend, LockOptions::new().fair(true)).unwrap();
        invalid(fair_m.rw("rw"), "a fair manager");
        let owner = Owner::named("rw-owner");
        invalid(
            locks.lock("rw").reentrant(&owner).unwrap().rw(),
            "a reentrant lock",
        );
        // The plain lock of the same name can.
        let rw = locks.rw("rw").unwrap();
        let r = rw.try_read().await.unwrap().expect("free");
        r.release().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// 11. Connections killed while readers hold.
// ---------------------------------------------------------------------------------------

/// Four readers in two managers hold across several `CLIENT KILL`s spread over more than a
/// TTL (2 s): their watchdogs extend them again after the reconnect and none is lost. No
/// write gets in meanwhile (a third manager tries one between the kills; its calls may fail
/// while its connection is down), and a writer waiting after the kills gets in only once they
/// have released (checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_survive_killed_connections() {
    let store = Store::redis();
    let srv = store.server().unwrap();
    let ttl = secs(2);
    let options = LockOptions::new().ttl(ttl).wait_timeout(Some(secs(20)));
    let readers_m = [
        store.manager(options.clone()).await,
        store.manager(options.clone()).await,
    ];
    let writer_m = store.manager(options).await;
    let checker = SharedChecker::new(usize::MAX);
    let rw = readers_m[0].rw("kills").unwrap();
    let mut held = Vec::new();
    for i in 0..4 {
        let g = readers_m[i % 2].rw("kills").unwrap().read().await.unwrap();
        let section = checker.enter_shared(g.fencing_token());
        held.push((g, section));
    }
    let writer_rw = writer_m.rw("kills").unwrap();

    let started = Instant::now();
    let (mut killed, mut tries, mut failed_tries) = (0, 0, 0);
    // Longer than a TTL: the reads live on only if they are extended after the kills.
    while started.elapsed() < ttl + ms(800) {
        killed += srv.kill_clients();
        if killed % 2 == 0 {
            srv.kill_pubsub_clients();
        }
        for (g, _) in &held {
            assert!(
                !g.is_lost(),
                "a read was lost {:?} into the kills",
                started.elapsed()
            );
        }
        tokio::time::sleep(ms(150)).await;
        tries += 1;
        match writer_rw.try_write().await {
            Ok(Some(w)) => {
                checker.enter_writer(w.fencing_token()).exit();
                w.release().await.unwrap();
            }
            Ok(None) => {}
            Err(_) => failed_tries += 1,
        }
        tokio::time::sleep(ms(150)).await;
    }
    assert!(killed >= 4, "only {killed} connections were killed");
    assert!(
        failed_tries < tries,
        "no write attempt was answered between the kills"
    );
    let info = rw.inspect().await.unwrap().expect("held");
    assert_eq!(info.shared_holds, Some(4), "{info:?}");
    let writer_checker = checker.clone();
    let writer = start(async move {
        let g = writer_rw.write().await.expect("the writer gets in");
        writer_checker.enter_writer(g.fencing_token()).exit();
        g.release().await.expect("release the write");
    })
    .await;
    store.wait_writer_waits(&rw).await;
    for (g, section) in held {
        assert!(!g.is_lost());
        section.exit();
        within("a read's release", g.release())
            .await
            .expect("the read is still ours after the kills");
    }
    within("the writer", writer).await.expect("writer task");
    println!(
        "killed connections: {killed} connections killed over {:?}, 4 reads kept, {} of {tries} \
         write attempts refused by the store, {failed_tries} failed, {}",
        started.elapsed(),
        tries - failed_tries,
        checker.report()
    );
    assert_eq!(checker.violations(), 0, "{}", checker.report());
    assert_eq!(checker.sections(), 5);
}

// ---------------------------------------------------------------------------------------
// A writer waiting beside a reader of its own process.
// ---------------------------------------------------------------------------------------

/// A writer crashes while holding (its lease runs out, nobody publishes). In another process
/// a reader waits for it; then a writer waits, in the reader's process (`beside`) or in one of
/// its own; a third process's reader arrives after that writer registered. When the crashed
/// write's TTL runs out, the waiting writer must find the lock free by its fallback re-check
/// (after at most the holder's time left or `max_delay`) and get it before both readers: the
/// later one arrived after it, and the earlier one cannot get in while the writer's
/// preference runs.
async fn writer_is_served_when_a_crashed_write_runs_out(store: Store, beside: bool) {
    let ttl = secs(1);
    let max_delay = secs(1);
    let options = LockOptions::new()
        .ttl(ttl)
        .retry(RetryPolicy::notify().max_delay(max_delay))
        .wait_timeout(Some(SOON));
    let crashed_m = store.manager(options.clone()).await;
    let reader_m = store.manager(options.clone()).await;
    let own_m = store.manager(options.clone()).await;
    let writer_m = if beside { &reader_m } else { &own_m };
    let other_m = store.manager(options).await;
    let rw = crashed_m.rw("beside").unwrap();
    let crashed = rw.write().await.unwrap();

    let reader_rw = reader_m.rw("beside").unwrap();
    let reader = start(async move {
        let g = reader_rw.read().await.expect("the reader gets in");
        let token = g.fencing_token();
        g.release().await.unwrap();
        token
    })
    .await;
    store.wait_readers_wait(&rw).await;
    // The reader has subscribed, and so makes its second attempt and settles to wait before
    // the writer comes.
    store.wait_subscribed(&rw, 1).await;
    let crashed_at = Instant::now();
    let crashed_token = crashed.forget();

    let writer_rw = writer_m.rw("beside").unwrap();
    let writer = start(async move {
        let g = writer_rw.write().await.expect("the writer gets in");
        let at = Instant::now();
        let token = g.fencing_token();
        g.release().await.unwrap();
        (at, token)
    })
    .await;
    store.wait_writer_waits(&rw).await;
    let later_rw = other_m.rw("beside").unwrap();
    let later = start(async move {
        let g = later_rw.read().await.expect("the later reader gets in");
        let token = g.fencing_token();
        g.release().await.unwrap();
        token
    })
    .await;

    let (granted_at, write_token) = within("the writer's grant", writer)
        .await
        .expect("writer task");
    let reader_token = within("the reader", reader).await.expect("reader task");
    let later_token = within("the later reader", later)
        .await
        .expect("later reader task");
    let waited = granted_at - crashed_at;
    let place = if beside { "beside" } else { "away from" };
    println!(
        "writer {place} a waiting reader: granted {waited:?} after the crash (TTL {ttl:?}, \
         max_delay {max_delay:?}); tokens: crashed write {crashed_token}, write {write_token}, \
         reader {reader_token}, later reader {later_token}"
    );
    assert!(
        write_token < later_token,
        "a reader that arrived after the writer registered got in before it (write token \
         {write_token}, read token {later_token}); the writer was granted {waited:?} after the \
         crash"
    );
    assert!(
        write_token < reader_token,
        "the waiting reader got in before the waiting writer (write token {write_token}, read \
         token {reader_token}); the writer was granted {waited:?} after the crash"
    );
    assert!(
        waited <= ttl + max_delay + ms(300),
        "the writer was granted {waited:?} after the crashed write (TTL {ttl:?}, max_delay \
         {max_delay:?}): its fallback re-check did not run"
    );
}

/// The writer waits in the same process as a waiting reader.
///
/// A process's waiters on one lock share one fallback re-check (`Rechecks` in
/// src/acquire.rs). At ae0d69c they shared it whatever their kind, and this failed (in memory
/// too): the reader, waiting first, held the turn, and the writer only waited for a wake-up
/// or a handover, with no timer. The crashed write runs out without a release, so no wake-up
/// comes; the reader's re-checks are turned away by the writer's own preference (`v`), so it
/// never left and never handed the turn over. The writer made no attempt, so its `v` ran out
/// 2 x max_delay + 100 ms after its last one; then the readers (the later one too) got in,
/// and the writer only after their releases: about 2.8 s after the crash instead of 1 s, and
/// behind a reader that arrived after it. Since 60af7bc waiters share a re-checker only with
/// waiters of their class (exclusive, read, permits), and this passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_writer_beside_a_waiting_reader_is_served_when_a_crashed_write_runs_out() {
    writer_is_served_when_a_crashed_write_runs_out(Store::redis(), true).await;
}

/// The same with the writer in a process of its own (the contrast: the reader and the
/// writer do not share one process's fallback re-check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_writer_away_from_the_waiting_reader_is_served_when_a_crashed_write_runs_out() {
    writer_is_served_when_a_crashed_write_runs_out(Store::redis(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_writer_beside_a_waiting_reader_is_served_when_a_crashed_write_runs_out() {
    writer_is_served_when_a_crashed_write_runs_out(Store::memory(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_writer_away_from_the_waiting_reader_is_served_when_a_crashed_write_runs_out() {
    writer_is_served_when_a_crashed_write_runs_out(Store::memory(), false).await;
}

// ---------------------------------------------------------------------------------------
// Waiters with a wait limit while connections are killed.
// ---------------------------------------------------------------------------------------

/// Four writers and four readers (behind them) wait, with a wait limit, for a read held by
/// another manager, re-checking every few milliseconds, while the server's connections are
/// killed every 10 ms for 1.5 s. A store unavailable for a moment is waited out with a wait
/// limit (the doc of `Lock::acquire`: "a lost connection ... is waited out"), so no wait may
/// fail during the kills, and no writer gets in while the read is held; once the read is
/// released, all of them get in.
///
/// A reader may get in during the kills: the writers' preference is a lease that their
/// turned-away attempts renew (2 x max_delay + 100 ms, 106 ms here), and with every
/// connection killed every 10 ms on a loaded machine none of the four may reach the server
/// for that long (seen under `.ci/hog`: the record's `v` ran out 300 ms into the kills, and
/// a reader got in). Its release, sent while connections are being killed, may fail.
///
/// Fails at ae0d69c: a command sent in the moment after fred drops the killed connection
/// and before it reconnects fails with fred's `ErrorKind::Unknown` "Failed to route command."
/// (fred's router/commands.rs, no connection to route to), which `store_error`
/// (src/backend/redis/errors.rs) does not count as unavailable: the waiting acquire ends with
/// `Error::Backend` instead of waiting on. The waiters' clients make one attempt per command
/// (`max_command_attempts(1)`, a valid setting), which makes this happen at nearly every
/// kill; with the default 3 attempts it happens too, less often (it ended the waiting writer
/// of `readers_survive_killed_connections` in about one run in ten, before that test stopped
/// waiting across the kills).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_with_a_wait_limit_ride_out_killed_connections() {
    let store = Store::redis();
    let srv = store.server().unwrap();
    let holder_m = store.manager(LockOptions::new().ttl(secs(2))).await;
    let rw = holder_m.rw("ride-out").unwrap();
    let held = rw.read().await.unwrap();
    let waiting = LockOptions::new()
        .ttl(secs(2))
        .retry(RetryPolicy::notify().min_delay(ms(1)).max_delay(ms(3)))
        .wait_timeout(Some(secs(20)));
    let mut waiters = Vec::new();
    for i in 0..8 {
        let backend = RedisBackend::connect_with(&srv.url(), redis_opts().max_command_attempts(1))
            .await
            .unwrap();
        let m = LockManager::with_options(backend, waiting.clone()).unwrap();
        let w = m.rw("ride-out").unwrap();
        let writer = i % 2 == 0;
        // (writer, the wait's outcome: when it got in, and the release's outcome)
        waiters.push(tokio::spawn(async move {
            let g = if writer {
                w.write().await
            } else {
                w.read().await
            };
            let waited = match g {
                Ok(g) => {
                    let at = Instant::now();
                    Ok((at, g.release().await))
                }
                Err(e) => Err(e),
            };
            drop(m);
            (writer, waited)
        }));
        if writer {
            store.wait_writer_waits(&rw).await;
        }
    }
    store.wait_readers_wait(&rw).await;
    let started = Instant::now();
    let mut killed = 0;
    while started.elapsed() < ms(1500) {
        killed += srv.kill_clients();
        tokio::time::sleep(ms(10)).await;
    }
    let kills_ended = Instant::now();
    let during = kills_ended - started;
    // Taken before the release is sent: a writer's grant follows the release's arrival,
    // which may be before its answer does.
    let releasing = Instant::now();
    held.release().await.expect("the read survived the kills");
    let mut outcomes = Vec::new();
    for w in waiters {
        outcomes.push(within("a waiter's grant", w).await.expect("waiter task"));
    }
    let early = outcomes
        .iter()
        .filter(|(_, w)| matches!(w, Ok((at, _)) if *at < kills_ended))
        .count();
    println!(
        "ride out: {killed} connections killed in {during:?}; {early} reader(s) got in during \
         the kills"
    );
    for (writer, waited) in outcomes {
        let (at, released) = waited.unwrap_or_else(|e| {
            panic!(
                "a wait with a 20 s limit failed ({during:?} of kills, {killed} connections \
                 killed): {e}"
            )
        });
        assert!(
            !writer || at >= releasing,
            "a writer got in while a read was held"
        );
        // A release sent during the kills may fail (it is then tried again in the
        // background, as `LockGuard::release` says); one sent after them may not.
        if at >= kills_ended {
            released.expect("release after the kills");
        }
    }
}

// ---------------------------------------------------------------------------------------
// A release re-sent after a reconnect.
// ---------------------------------------------------------------------------------------

/// One attempt at `claim` on `backend`, which must be granted.
async fn granted(backend: &Arc<dyn Backend>, claim: &Claim) -> Grant {
    match backend
        .acquire(claim, Attempt::Once, NodeTerms::new())
        .await
        .expect("attempt")
    {
        Acquire::Granted(grant) => grant,
        other => panic!("{:?} was not granted: {other:?}", claim.kind),
    }
}

/// A write is released, and its release is sent again later, as the client re-sends a
/// command whose answer a killed connection lost (the first copy ran). Meanwhile readers
/// came and went and the next writer got the lock. The Backend contract: `release` returns
/// `Some` "also for a replayed release of a confirmed claim"; so the copy must be answered
/// "released" (and leave the next writer alone), as a read's copy is (the reads' releases are
/// kept a minute, see prelude.lua).
///
/// Fails at ae0d69c: release.lua recognises a replay only while the record's `t` is the
/// token (with `e` 0) or `r` is: a read's grant sets `r` to the write's token and `t` to the
/// read marker `*r`, which the reads' release keeps; the next write's grant then sets `r` to
/// `*r`, and the write's token is forgotten. The copy is answered 0, and
/// `LockGuard::release` returns `Error::NotHeld` for a write that was held to the end and
/// released: the checker under connection kills sees this now and then (a write released
/// 40 ms after a kill, answered "not held"). (Plain locks alone forget the same way after two
/// more grants; with readers a read and a write suffice, within milliseconds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_write_release_is_still_answered_released_after_the_lock_moved_on() {
    let store = Store::redis();
    let locks = store.manager(LockOptions::new()).await;
    let backend = locks.backend().clone();
    let key = locks.rw("replay").unwrap().writer().key().clone();
    let ttl = secs(5);
    let release = |claim: &Claim, lease: &Token| {
        let (backend, claim, lease) = (backend.clone(), claim.clone(), lease.clone());
        async move {
            backend
                .release(&claim, Release::Confirmed { lease: &lease })
                .await
                .expect("release")
        }
    };

    let write = Claim::new(key.clone(), Token::random(), ttl);
    let w = granted(&backend, &write).await;
    assert_eq!(release(&write, &w.lease).await, Some(0));
    assert_eq!(
        release(&write, &w.lease).await,
        Some(0),
        "a replay right after the release"
    );
    let read = Claim::new(key.clone(), Token::shared(), ttl).kind(ClaimKind::Read);
    let r = granted(&backend, &read).await;
    assert!(r.fencing_token > w.fencing_token);
    assert_eq!(release(&read, &r.lease).await, Some(0));
    assert_eq!(
        release(&write, &w.lease).await,
        Some(0),
        "the write's replay after a read came and went"
    );
    let next = Claim::new(key.clone(), Token::random(), ttl);
    let n = granted(&backend, &next).await;
    assert!(n.fencing_token > r.fencing_token);
    // The read's replay is still known as released, and leaves the write alone.
    assert_eq!(
        release(&read, &r.lease).await,
        Some(0),
        "the read's replay after the next write's grant"
    );
    let write_replay = release(&write, &w.lease).await;
    // Whatever it answered, the next writer's lease is untouched.
    let info = locks
        .rw("replay")
        .unwrap()
        .inspect()
        .await
        .unwrap()
        .unwrap();
    assert!(info.held && info.fencing_token == Some(n.fencing_token));
    assert_eq!(release(&next, &n.lease).await, Some(0));
    assert_eq!(
        write_replay,
        Some(0),
        "the write's replayed release, after a read and the next write's grant, is answered \
         not held: its guard would report Error::NotHeld for a write held to the end"
    );
    // Two more writes granted and released: the record's `r` no longer names the write
    // released after the read, and its replay is still answered "released" (the name has
    // had reads within the hour: its writes' releases are kept beside the reads').
    for _ in 0..2 {
        let more = Claim::new(key.clone(), Token::random(), ttl);
        let m = granted(&backend, &more).await;
        assert_eq!(release(&more, &m.lease).await, Some(0));
    }
    assert_eq!(
        release(&next, &n.lease).await,
        Some(0),
        "the next write's replay after two more writes"
    );
    // A token that never held it is still not released.
    let stranger = Claim::new(key, Token::random(), ttl);
    assert_eq!(release(&stranger, &stranger.token).await, None);
}

/// A polling waiter makes single attempts that register nothing with the store, so a polling
/// writer could not hold new readers back: a read-write lock with a polling retry policy is
/// refused when it is made, not left to starve its writers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_read_write_lock_is_refused() {
    let store = Store::memory();
    let locks = store
        .manager(LockOptions::new().retry(RetryPolicy::polling()))
        .await;
    match locks.rw("config") {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("notify"), "{msg}"),
        other => panic!("a polling rw lock: expected InvalidConfig, got {other:?}"),
    }
    let notify = locks
        .lock_with("config", |o| o.retry(RetryPolicy::notify()))
        .expect("options");
    assert!(notify.rw().is_ok());
}

/// A store tells a lease's kind by its token: a claim whose token is of another kind's make
/// (here through the `Backend` API) is refused, on Redis and in memory, instead of being
/// granted and then lost at its first extension.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_with_another_kinds_token_is_refused() {
    for store in [Store::redis(), Store::memory()] {
        let backend = store.backend().await;
        let key = redlease::LeaseKey::new("redlease:", "tokens");
        for (token, kind) in [
            (Token::shared(), ClaimKind::Plain),
            (Token::hold(), ClaimKind::Plain),
            (Token::random(), ClaimKind::Read),
            (Token::random(), ClaimKind::Permit(2)),
        ] {
            let claim = Claim::new(key.clone(), token, secs(5)).kind(kind.clone());
            let got = backend
                .acquire(&claim, Attempt::Once, NodeTerms::new())
                .await;
            assert!(
                matches!(got, Err(Error::InvalidConfig(_))),
                "{kind:?}: expected InvalidConfig, got {got:?}"
            );
        }
    }
}

/// The cases above that take a store, on PostgreSQL.
#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    /// The checker, as in memory: 16 readers and 2 writers in 3 managers, 2 readers
    /// crashing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checker_readers_and_writers() {
        let store = Store::postgres();
        let plan = Plan {
            managers: 3,
            readers: 16,
            writers: 2,
            reads_each: 40,
            writes_each: 20,
            crashes: 2,
            kills: 0,
            ttl: secs(1),
        };
        let f = run_checker(&store, plan).await;
        check_figures("postgres checker", plan, &f);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writer_is_not_starved_by_a_stream_of_readers() {
        super::writer_is_not_starved_by_a_stream_of_readers(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn write_tokens_exceed_every_earlier_token() {
        super::write_tokens_exceed_every_earlier_token(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_writers_preference_lapses_whatever_its_max_delay() {
        super::a_dead_writers_preference_lapses_whatever_its_max_delay(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_that_gives_up_withdraws_its_preference() {
        super::a_writer_that_gives_up_withdraws_its_preference(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single_attempts() {
        super::single_attempts(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plain_lock_is_the_writer() {
        super::plain_lock_is_the_writer(Store::postgres()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writer_is_served_when_a_crashed_write_runs_out() {
        super::writer_is_served_when_a_crashed_write_runs_out(Store::postgres(), false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writer_is_served_when_a_crashed_write_runs_out_beside_a_read() {
        super::writer_is_served_when_a_crashed_write_runs_out(Store::postgres(), true).await;
    }
}
