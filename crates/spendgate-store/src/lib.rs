//! spendgate-store: the one small trait every ledger backend implements, the clock it reads,
//! and the `memory` and `sqlite` backends. The Redis backend lives in `spendgate-redis`.
//!
//! Every backend is held to the same answers by `spendgate-conformance`.

pub mod clock;
pub mod memory;
pub mod sqlite;

use async_trait::async_trait;
use spendgate_core::*;
use std::sync::Arc;
use std::time::Duration;

pub use clock::{Clock, ManualClock, SystemClock};
pub use memory::MemoryStore;
pub use sqlite::{DiskGate, SqliteOptions, SqliteStore, WRITE_FAULT_ONCE};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store could not be read or written (I3: fail closed; nothing is admitted).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store did not answer within `store.timeout_ms`. The command may still apply; a
    /// reservation made that way is held and charged at expiry unless committed.
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
}

macro_rules! typed {
    ($(#[$doc:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty, $cmd:expr, $variant:ident) => {
        $(#[$doc])*
        pub async fn $name(&self, $($arg: $ty),*) -> Result<$out, StoreError> {
            match self.execute($cmd).await? {
                Reply::$variant(v) => Ok(v),
                other => Err(StoreError::Unavailable(format!(
                    "store answered {} with {other:?}", stringify!($name)
                ))),
            }
        }
    };
}

/// Typed calls over [`Store::execute`].
impl dyn Store {
    typed!(admit_run(req: RunRequest, idem: Option<IdempotencyKey>) -> Applied<Result<RunAdmitted, Refusal>>,
        Command::AdmitRun { req, idem }, Run);
    typed!(reserve_step(req: StepRequest, idem: Option<IdempotencyKey>) -> Applied<Result<StepReserved, Refusal>>,
        Command::ReserveStep { req, idem }, Step);
    typed!(resolve(step: ReservationId, how: Resolution) -> Applied<Resolved>,
        Command::Resolve { step, how }, Resolved);
    typed!(heartbeat(run: RunId) -> Applied<Heartbeat>, Command::Heartbeat { run }, Heartbeat);
    typed!(finish(run: RunId) -> Applied<RunEnded>, Command::Finish { run }, Finished);
    typed!(create_session(ips: Vec<IpScope>, dry: bool) -> Applied<Result<SessionGrant, Refusal>>,
        Command::CreateSession { ips, dry }, Session);
    typed!(usage(scopes: Vec<(ScopeKey, u64)>) -> Vec<UsageLine>, Command::Usage { scopes }, Usage);
    typed!(set_cutoff(engaged: bool, reason: String) -> Applied<bool>,
        Command::SetCutoff { engaged, reason }, Cutoff);
    typed!(adjust(scope: ScopeKey, factor: u64, amount: i64, once: Option<String>) -> Applied<Adjustment>,
        Command::Adjust { scope, factor, amount, once }, Adjusted);
    typed!(summary() -> Summary, Command::Summary, Summary);
    typed!(reservations(state: Option<ReservationState>, limit: usize) -> Vec<Reservation>,
        Command::Reservations { state, limit }, Reservations);
    typed!(top_counters(kind: Option<ScopeKind>, top: usize) -> Vec<(CounterKey, Counter)>,
        Command::TopCounters { kind, top }, TopCounters);
    typed!(sweep() -> Applied<usize>, Command::Sweep, Swept);
    typed!(consume_once(key: String, ttl_ms: u64) -> Applied<bool>, Command::ConsumeOnce { key, ttl_ms }, Consumed);
    typed!(
        /// Publishes this replica's policy fingerprint; answers every live replica's.
        announce(replica: String, fingerprint: String) -> Vec<ReplicaSeen>,
        Command::Announce { replica, fingerprint }, Replicas);
    typed!(
        /// Every live replica and its policy fingerprint.
        replicas() -> Vec<ReplicaSeen>, Command::Replicas, Replicas);
}

/// Bounds every call of the inner store by a timeout: past it the call counts as failed
/// (`StoreError::Timeout`) and the caller refuses (fail closed).
pub struct Timed<S: ?Sized> {
    timeout: Duration,
    inner: Arc<S>,
}

impl<S: Store + ?Sized> Timed<S> {
    pub fn new(inner: Arc<S>, timeout: Duration) -> Timed<S> {
        Timed { timeout, inner }
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Timed<S> {
    async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
        tokio::time::timeout(self.timeout, self.inner.execute(cmd))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
    async fn execute_many(&self, cmds: Vec<Command>) -> Vec<Result<Reply, StoreError>> {
        let n = cmds.len();
        match tokio::time::timeout(self.timeout, self.inner.execute_many(cmds)).await {
            Ok(answers) => answers,
            Err(_) => vec![Err(StoreError::Timeout(self.timeout)); n],
        }
    }
    async fn ready(&self) -> Result<(), StoreError> {
        tokio::time::timeout(self.timeout, self.inner.ready())
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
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

    /// A store that answers only after `delay`: stands for a store that is slow or gone.
    struct Slow {
        delay: Duration,
        inner: MemoryStore,
    }

    #[async_trait]
    impl Store for Slow {
        async fn execute(&self, cmd: Command) -> Result<Reply, StoreError> {
            tokio::time::sleep(self.delay).await;
            self.inner.execute(cmd).await
        }
        async fn ready(&self) -> Result<(), StoreError> {
            tokio::time::sleep(self.delay).await;
            Ok(())
        }
        fn kind(&self) -> &'static str {
            "slow"
        }
    }

    #[tokio::test]
    async fn a_call_past_the_timeout_fails_closed() {
        let slow = Arc::new(Slow {
            delay: Duration::from_millis(300),
            inner: MemoryStore::new(Policy::default(), Arc::new(SystemClock)),
        });
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
