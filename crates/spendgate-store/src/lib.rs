//! spendgate-store: the one small trait every ledger backend implements, the clock it reads,
//! and the `memory` and `sqlite` backends. The Redis backend lives in `spendgate-redis`.
//!
//! Every backend is held to the same answers by `spendgate-conformance`.

pub mod clock;
pub mod history;
pub mod history_read;
pub mod memory;
pub mod sqlite;
mod typed;

use async_trait::async_trait;
use spendgate_core::{Command, Ledger, LedgerError, Policy, Reply, UnixMs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use clock::{Clock, ManualClock, SystemClock};
pub use history::{HistoryFilter, HistoryReader, HistoryTap, Page, HISTORY_PAGE_MAX};
pub use memory::MemoryStore;
pub use memory::{MemoryHistory, MEMORY_HISTORY_MAX, MEMORY_REFUSAL_MINUTES_MAX};
pub use sqlite::{DiskGate, SqliteOptions, SqliteStore, WRITE_FAULT_ONCE};
pub use typed::Answers;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store could not be read or written (I3: fail closed; nothing is admitted).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store did not answer within its bound (`store.timeout_ms`, plus
    /// `store.slow_grace_ms` while the store is not known to be failing: see [`Timed`]). The
    /// command may still apply; a reservation made that way is held and charged at expiry
    /// unless committed.
    #[error("store did not answer within {0:?}")]
    Timeout(Duration),
    /// The ledger refused the command as invalid (unknown id, closed reservation, ...).
    /// `Some(seq)`: the call changed the ledger before it refused (a run whose lease had run
    /// out was expired first, say); `seq` is the ledger's sequence number after it, which the
    /// answer carries as `ledger_seq`.
    #[error("{0}")]
    Ledger(LedgerError, Option<u64>),
}

impl From<LedgerError> for StoreError {
    fn from(e: LedgerError) -> StoreError {
        StoreError::Ledger(e, None)
    }
}

/// Applies one command to a ledger; a refusal says whether the call changed the ledger
/// before it refused (its sequence number moved).
pub(crate) fn apply_to(
    ledger: &mut Ledger,
    policy: &Policy,
    now: UnixMs,
    cmd: &Command,
) -> Result<Reply, StoreError> {
    let before = ledger.seq();
    ledger.apply(policy, now, cmd).map_err(|e| {
        let after = ledger.seq();
        StoreError::Ledger(e, (after != before).then_some(after))
    })
}

impl StoreError {
    /// Whether the store itself failed (as opposed to the request being wrong).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Timeout(_))
            || matches!(self, StoreError::Ledger(LedgerError::Full(_), _))
    }
}

/// A ledger backend.
///
/// `execute` applies one [`Command`] atomically at the store's clock: it either applies in
/// full or not at all, across every scope it touches, and the answer it returns is what was
/// applied. Replies for commands that admit paid work ([`Command::needs_durability`]) are
/// given only once the change is as durable as the backend can make it. Resolutions are
/// idempotent by step id; admissions are idempotent by their idempotency key.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError>;

    /// Applies several commands in order, each atomically as in [`Store::execute`], and
    /// answers each. Backends that group commits (sqlite) apply them in one batch, so they
    /// become durable in one write; others apply them one after the other.
    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let mut out = Vec::with_capacity(cmds.len());
        for cmd in cmds {
            out.push(self.execute(cmd).await);
        }
        out
    }

    /// Whether the store is reachable and fit to admit work (SPEC `/readyz`).
    async fn ready(&self) -> Result<(), StoreError>;

    /// Short name of the backend ("memory", "sqlite", "redis").
    fn kind(&self) -> &'static str;

    /// Where this store's usage history is read back from; `None` when it keeps none.
    fn history(&self) -> Option<std::sync::Arc<dyn HistoryReader>> {
        None
    }

    /// Tells `tap` of every history event this store makes durable from now on (at most one
    /// tap; a second replaces the first).
    fn tap_history(&self, tap: std::sync::Arc<dyn HistoryTap>) {
        let _ = tap;
    }
}

/// Longest grace a slow call may be given past `store.timeout_ms` (`store.slow_grace_ms`).
pub const SLOW_GRACE_MAX: Duration = Duration::from_secs(5);
/// Calls answered in their grace are logged at most this often (a count and the slowest).
pub const SLOW_LOG_EVERY: Duration = Duration::from_secs(10);
/// While the store is failing, one admission this often is still given the grace (a probe),
/// so that a store that answers again, but slower than `store.timeout_ms`, is found.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);

/// Bounds every call of the inner store (I3: fail closed), and tells a store that is slow under
/// load from one that is not answering:
/// - while the store is not known to be failing, a call that has not answered within `timeout`
///   (`store.timeout_ms`) may wait `grace` (`store.slow_grace_ms`) more: one call queued
///   behind a batch's fsync, or one slow Redis call, is served, not refused;
/// - a call that has not answered within `timeout + grace` fails (`StoreError::Timeout`) and
///   marks the store failing (a circuit opens): later calls fail at `timeout` alone, until an
///   admission (a command that [needs durability](Command::needs_durability)) is answered (a
///   grant or a refusal: the store can admit again), which closes the circuit. While it is
///   open, one admission every [`PROBE_EVERY`] is still given the grace;
/// - errors (connection refused or reset, not a primary, epoch problems, a full queue) are
///   returned as they come, at once: they neither open nor close the circuit;
/// - `ready()` (`/readyz`) waits `timeout` alone, always, and changes nothing.
///
/// So a store that stopped answering costs the calls that started before the circuit opened
/// `timeout + grace`, and later calls `timeout` (a probe `timeout + grace`); nothing waits
/// longer than `timeout + grace`. A call that timed out may still apply later: an admission
/// made that way is held and charged in full at its lease's expiry (it was never answered,
/// so no paid work started on it).
pub struct Timed<S: ?Sized> {
    timeout: Duration,
    grace: Duration,
    /// [`PROBE_EVERY`] (shorter in tests).
    probe_every: Duration,
    inner: Arc<S>,
    circuit: Mutex<Circuit>,
    slow: Mutex<SlowCalls>,
}

/// Whether the store is failing, and since when a call was last given the grace meanwhile.
#[derive(Default)]
struct Circuit {
    /// `Some`: no admission was answered since a call failed by timeout after its grace; the
    /// instant is when that happened, or the last probe started.
    failing: Option<Instant>,
}

/// Calls that answered in their grace since the last log line.
#[derive(Default)]
struct SlowCalls {
    logged: Option<Instant>,
    count: u64,
    slowest: Duration,
}

/// What one call's outcome says of the store.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outcome {
    /// The ledger answered (a reply, or a refusal of the command).
    Answered,
    /// No answer within the call's bound.
    NoAnswer,
    /// An error of the store's (connection, queue, disk): nothing said about its speed.
    Failed,
}

impl Outcome {
    fn of<T>(r: &Result<T, StoreError>) -> Outcome {
        match r {
            Ok(_) | Err(StoreError::Ledger(..)) => Outcome::Answered,
            Err(StoreError::Timeout(_)) => Outcome::NoAnswer,
            Err(StoreError::Unavailable(_)) => Outcome::Failed,
        }
    }

    /// What several answers of one call say together: answered if any was.
    fn all<'a, T: 'a>(rs: impl IntoIterator<Item = &'a Result<T, StoreError>>) -> Outcome {
        rs.into_iter()
            .map(Outcome::of)
            .fold(Outcome::Failed, |a, b| match (a, b) {
                (Outcome::Answered, _) | (_, Outcome::Answered) => Outcome::Answered,
                (Outcome::NoAnswer, _) | (_, Outcome::NoAnswer) => Outcome::NoAnswer,
                _ => Outcome::Failed,
            })
    }
}

impl<S: Store + ?Sized> Timed<S> {
    /// Every call bounded by `timeout` alone (no grace).
    pub fn new(inner: Arc<S>, timeout: Duration) -> Timed<S> {
        Timed::with_grace(inner, timeout, Duration::ZERO)
    }

    /// Calls bounded by `timeout + grace` while the store answers, by `timeout` once it did
    /// not (see [`Timed`]). `grace` is capped at [`SLOW_GRACE_MAX`].
    pub fn with_grace(inner: Arc<S>, timeout: Duration, grace: Duration) -> Timed<S> {
        Timed {
            timeout,
            grace: grace.min(SLOW_GRACE_MAX),
            probe_every: PROBE_EVERY,
            inner,
            circuit: Mutex::new(Circuit::default()),
            slow: Mutex::new(SlowCalls::default()),
        }
    }

    /// Whether the store is marked failing: a call found it not answering within `timeout +
    /// grace` and no admission was answered since.
    pub fn failing(&self) -> bool {
        self.circuit().failing.is_some()
    }

    fn circuit(&self) -> std::sync::MutexGuard<'_, Circuit> {
        self.circuit.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bound of a call starting now (`admits`: it needs durability).
    fn bound(&self, admits: bool) -> Duration {
        let mut c = self.circuit();
        match &mut c.failing {
            None => self.timeout + self.grace,
            Some(since) if admits && since.elapsed() >= self.probe_every => {
                *since = Instant::now();
                self.timeout + self.grace
            }
            Some(_) => self.timeout,
        }
    }

    /// Records what a call that started at `started`, bounded by `bound`, found.
    fn settle(&self, started: Instant, bound: Duration, admits: bool, what: Outcome) {
        let took = started.elapsed();
        match what {
            Outcome::Answered => {
                if took > self.timeout {
                    self.slow_call(took);
                }
                if admits && self.circuit().failing.take().is_some() {
                    tracing::warn!(
                        took_ms = took.as_millis() as u64,
                        "the store admits again: its calls may take store.timeout_ms + \
                         store.slow_grace_ms again"
                    );
                }
            }
            // Only a call given the whole grace says that the store is not answering.
            Outcome::NoAnswer if bound >= self.timeout + self.grace => {
                let mut c = self.circuit();
                if c.failing.is_none() {
                    c.failing = Some(Instant::now());
                    drop(c);
                    tracing::error!(
                        waited_ms = took.as_millis() as u64,
                        "the store did not answer within store.timeout_ms + \
                         store.slow_grace_ms: it counts as failing; calls fail closed after \
                         store.timeout_ms until it admits again"
                    );
                }
            }
            Outcome::NoAnswer | Outcome::Failed => {}
        }
    }

    fn slow_call(&self, took: Duration) {
        let mut s = self.slow.lock().unwrap_or_else(|p| p.into_inner());
        s.count += 1;
        s.slowest = s.slowest.max(took);
        if s.logged.is_none_or(|t| t.elapsed() >= SLOW_LOG_EVERY) {
            tracing::warn!(
                calls = s.count,
                slowest_ms = s.slowest.as_millis() as u64,
                timeout_ms = self.timeout.as_millis() as u64,
                "store calls answered after store.timeout_ms, within store.slow_grace_ms (the \
                 store is slow; counted since the last such line)"
            );
            *s = SlowCalls {
                logged: Some(Instant::now()),
                ..SlowCalls::default()
            };
        }
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Timed<S> {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        let admits = cmd.needs_durability();
        let (started, bound) = (Instant::now(), self.bound(admits));
        let r = match tokio::time::timeout(bound, self.inner.execute(cmd)).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(bound)),
        };
        self.settle(started, bound, admits, Outcome::of(&r));
        r
    }
    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let admits = cmds.iter().any(Command::needs_durability);
        let (started, bound, n) = (Instant::now(), self.bound(admits), cmds.len());
        let answers = match tokio::time::timeout(bound, self.inner.execute_many(cmds)).await {
            Ok(answers) => answers,
            Err(_) => vec![Err(StoreError::Timeout(bound)); n],
        };
        self.settle(started, bound, admits, Outcome::all(&answers));
        answers
    }
    async fn ready(&self) -> Result<(), StoreError> {
        // Never given the grace, and it changes nothing: a sqlite store whose disk hangs
        // still answers it.
        tokio::time::timeout(self.timeout, self.inner.ready())
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn history(&self) -> Option<Arc<dyn HistoryReader>> {
        self.inner.history()
    }

    fn tap_history(&self, tap: Arc<dyn HistoryTap>) {
        self.inner.tap_history(tap)
    }
}

/// Runs `Command::Sweep` every `every` until the returned handle is dropped or aborted, so that
/// expired leases are charged and slots freed even when no traffic touches them.
pub fn spawn_sweeper(store: Arc<dyn Store>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = store.execute(Command::Sweep).await {
                tracing::warn!(error = %e, "sweep failed; will retry");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spendgate_core::{IpScope, RunId, RunRequest};

    /// A store that answers only after `delay` (settable): stands for a store that is slow or
    /// gone; `fail` makes it answer unavailable at once instead.
    struct Slow {
        delay: Mutex<Duration>,
        fail: std::sync::atomic::AtomicBool,
        inner: MemoryStore,
    }

    impl Slow {
        fn new(delay: Duration) -> Arc<Slow> {
            Arc::new(Slow {
                delay: Mutex::new(delay),
                fail: Default::default(),
                inner: MemoryStore::new(Policy::default(), Arc::new(SystemClock)),
            })
        }
        fn set(&self, delay: Duration) {
            *self.delay.lock().unwrap_or_else(|p| p.into_inner()) = delay;
        }
        fn delay(&self) -> Duration {
            *self.delay.lock().unwrap_or_else(|p| p.into_inner())
        }
    }

    #[async_trait]
    impl Store for Slow {
        async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
            if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Unavailable("connection refused".into()));
            }
            tokio::time::sleep(self.delay()).await;
            self.inner.execute(cmd).await
        }
        async fn ready(&self) -> Result<(), StoreError> {
            tokio::time::sleep(self.delay()).await;
            Ok(())
        }
        fn kind(&self) -> &'static str {
            "slow"
        }
    }

    fn ips() -> Vec<IpScope> {
        vec![IpScope {
            prefix: "192.0.2.1/32".into(),
            factor: 1,
        }]
    }

    /// Runs `f` and returns what it answered and how long it took.
    async fn clocked<T>(f: impl std::future::Future<Output = T>) -> (T, Duration) {
        let t = Instant::now();
        let r = f.await;
        (r, t.elapsed())
    }

    const T: Duration = Duration::from_millis(100);
    const GRACE: Duration = Duration::from_millis(400);
    /// Generous for 2 shared cores: the bound is what matters, not the scheduler's promptness.
    const MARGIN: Duration = Duration::from_millis(150);

    /// Finding 6: a call slower than `timeout_ms` (one slow fsync, one slow Redis call) is
    /// served within its grace instead of refused, and the store is not marked failing.
    #[tokio::test]
    async fn a_call_slower_than_the_timeout_is_served_within_the_grace() {
        let slow = Slow::new(Duration::from_millis(250));
        let timed: Arc<dyn Store> = Arc::new(Timed::with_grace(slow.clone(), T, GRACE));
        let (r, took) = clocked(timed.create_session(ips(), false)).await;
        assert!(r.is_ok(), "a slow store is not a failed one: {r:?}");
        assert!(
            took >= Duration::from_millis(250) && took < T + GRACE,
            "{took:?}"
        );
        let (r, _) = clocked(timed.admit_run(
            RunRequest {
                run_id: RunId("r".into()),
                session: "s".into(),
                ips: ips(),
                conversation: "c".into(),
                input_bytes: 1,
            },
            None,
        ))
        .await;
        assert!(r.is_ok_and(|a| a.value.is_ok()), "admitted");
        // Without a grace, the same store is refused at the timeout (what main did).
        let strict: Arc<dyn Store> = Arc::new(Timed::new(slow, T));
        let (r, took) = clocked(strict.create_session(ips(), false)).await;
        assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(T)));
        assert!(took < T + MARGIN, "{took:?}");
    }

    /// A store that stops answering: the first call fails at `timeout + grace` and opens the
    /// circuit; later calls (and `ready`) fail at `timeout` alone; errors pass at once and
    /// change nothing; an admission answered closes the circuit, and a slow call is given the
    /// grace again.
    #[tokio::test]
    async fn a_store_that_stops_answering_fails_at_the_timeout_once_known() {
        let slow = Slow::new(Duration::ZERO);
        let t = Arc::new(Timed::with_grace(slow.clone(), T, GRACE));
        let timed: Arc<dyn Store> = t.clone();
        timed.create_session(ips(), false).await.expect("answers");
        slow.set(Duration::from_secs(60));

        let (r, took) = clocked(timed.create_session(ips(), false)).await;
        assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(T + GRACE)));
        assert!(took >= T + GRACE && took < T + GRACE + MARGIN, "{took:?}");
        assert!(t.failing(), "no answer within timeout + grace: failing");
        for _ in 0..3 {
            let (r, took) = clocked(timed.create_session(ips(), false)).await;
            assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(T)));
            assert!(took >= T && took < T + MARGIN, "{took:?}");
            let (r, took) = clocked(timed.execute(Command::Summary)).await;
            assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(T)));
            assert!(took < T + MARGIN, "{took:?}");
            let (r, took) = clocked(timed.ready()).await;
            assert_eq!(r, Err(StoreError::Timeout(T)));
            assert!(took < T + MARGIN, "{took:?}");
        }
        // Errors come at once and do not close the circuit.
        slow.fail.store(true, std::sync::atomic::Ordering::SeqCst);
        let (r, took) = clocked(timed.create_session(ips(), false)).await;
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        assert!(took < Duration::from_millis(50), "{took:?}");
        assert!(t.failing());
        slow.fail.store(false, std::sync::atomic::Ordering::SeqCst);

        // Back, fast: a read does not close the circuit, an admission does.
        slow.set(Duration::ZERO);
        timed.execute(Command::Summary).await.expect("read");
        assert!(t.failing(), "a read says nothing of admitting");
        timed.create_session(ips(), false).await.expect("admitted");
        assert!(!t.failing(), "an answered admission closes the circuit");
        slow.set(Duration::from_millis(250));
        let (r, _) = clocked(timed.create_session(ips(), false)).await;
        assert!(r.is_ok(), "the grace is back: {r:?}");
    }

    /// While the circuit is open, one admission every `PROBE_EVERY` is given the grace: a store
    /// that answers again but slower than `timeout_ms` closes it.
    #[tokio::test]
    async fn a_probe_finds_a_store_that_answers_slowly_again() {
        let slow = Slow::new(Duration::from_secs(60));
        let probe_every = Duration::from_millis(700);
        let t = Arc::new(Timed {
            probe_every,
            ..Timed::with_grace(slow.clone(), T, GRACE)
        });
        let timed: Arc<dyn Store> = t.clone();
        let r = timed.create_session(ips(), false).await;
        assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(T + GRACE)));
        assert!(t.failing());
        slow.set(Duration::from_millis(250));
        let r = timed.create_session(ips(), false).await;
        assert_eq!(r.map(|_| ()), Err(StoreError::Timeout(T)), "no probe yet");
        tokio::time::sleep(probe_every).await;
        let r = timed.create_session(ips(), false).await;
        assert!(r.is_ok(), "the probe was given the grace: {r:?}");
        assert!(!t.failing());
    }

    #[tokio::test]
    async fn a_call_past_the_timeout_fails_closed() {
        let slow = Slow::new(Duration::from_millis(300));
        let timed: Arc<dyn Store> = Arc::new(Timed::new(slow, Duration::from_millis(50)));
        let started = std::time::Instant::now();
        let err = timed
            .create_session(
                vec![IpScope {
                    prefix: "192.0.2.1/32".into(),
                    factor: 1,
                }],
                false,
            )
            .await
            .expect_err("past the timeout the call fails");
        assert!(err.is_unavailable(), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_millis(250),
            "refused at the timeout, not after the store answered"
        );
        assert!(timed.ready().await.is_err());
        let fast: Arc<dyn Store> = Arc::new(Timed::new(
            Arc::new(MemoryStore::new(Policy::default(), Arc::new(SystemClock))),
            Duration::from_millis(50),
        ));
        assert!(fast.ready().await.is_ok());
    }
}
