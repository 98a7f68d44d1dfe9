//! Typed calls over [`Store::execute`] (`store.admit_run(..)` answers what an admission
//! answers) and typed answers of [`Store::execute_many`] ([`Answers`]): each reply is taken
//! as the one its command has, in one place, and any other is the store's fault.

use crate::{Store, StoreError};
use spendgate_core::{
    Adjustment, Applied, Command, Counter, CounterKey, Heartbeat, IdempotencyKey, IpScope, Refusal,
    ReplicaSeen, Reply, Reservation, ReservationId, ReservationState, Resolution, Resolved,
    RunAdmitted, RunEnded, RunId, RunRequest, ScopeKey, ScopeKind, SessionGrant, StepRequest,
    StepReserved, Summary, UsageLine,
};

/// The value of `reply` when it is `Reply::$variant`; any other reply (to the call `$what`)
/// is an unavailable store: a backend answered a command with another's reply.
macro_rules! unpack {
    ($reply:expr, $variant:ident, $what:expr) => {
        match $reply {
            Reply::$variant(v) => Ok(v),
            other => Err(StoreError::Unavailable(format!(
                "store answered {} with {other:?}",
                $what
            ))),
        }
    };
}

macro_rules! typed {
    ($(#[$doc:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty, $cmd:expr, $variant:ident) => {
        $(#[$doc])*
        pub async fn $name(&self, $($arg: $ty),*) -> Result<$out, StoreError> {
            unpack!(self.execute($cmd).await?, $variant, stringify!($name))
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

    /// [`Store::execute_many`], its answers typed: take them in the order of `cmds`.
    pub async fn batch(&self, cmds: Vec<Command>) -> Answers {
        Answers::new(self.execute_many(cmds).await)
    }
}

/// The answers of one [`Store::execute_many`] call, taken one by one in the order of its
/// commands, each as the reply its command has:
///
/// ```
/// # use spendgate_core::Command;
/// # use spendgate_store::Store;
/// # async fn admit_and_reserve(store: &dyn Store, admit: Command, reserve: Command) {
/// let mut answers = store.batch(vec![admit, reserve]).await;
/// let (admitted, reserved) = (answers.run(), answers.step());
/// # }
/// ```
///
/// An answer of another kind, or none (a batch answered fewer commands than it was given),
/// is [`StoreError::Unavailable`].
#[derive(Debug)]
pub struct Answers {
    answers: std::vec::IntoIter<Result<Reply, StoreError>>,
}

macro_rules! answer {
    ($(#[$doc:meta])* $name:ident -> $out:ty, $variant:ident) => {
        $(#[$doc])*
        pub fn $name(&mut self) -> Result<$out, StoreError> {
            unpack!(self.next_reply()?, $variant, stringify!($name))
        }
    };
}

impl Answers {
    pub fn new(answers: Vec<Result<Reply, StoreError>>) -> Answers {
        Answers {
            answers: answers.into_iter(),
        }
    }

    /// The next answer, whatever its reply.
    pub fn next_reply(&mut self) -> Result<Reply, StoreError> {
        self.answers.next().unwrap_or_else(|| {
            Err(StoreError::Unavailable(
                "store answered fewer commands than it was given".into(),
            ))
        })
    }

    answer!(
        /// The next answer, to a [`Command::AdmitRun`].
        run -> Applied<Result<RunAdmitted, Refusal>>, Run);
    answer!(
        /// The next answer, to a [`Command::ReserveStep`].
        step -> Applied<Result<StepReserved, Refusal>>, Step);
    answer!(
        /// The next answer, to a [`Command::Resolve`].
        resolved -> Applied<Resolved>, Resolved);
    answer!(
        /// The next answer, to a [`Command::Heartbeat`].
        heartbeat -> Applied<Heartbeat>, Heartbeat);
    answer!(
        /// The next answer, to a [`Command::Finish`].
        finished -> Applied<RunEnded>, Finished);
    answer!(
        /// The next answer, to a [`Command::CreateSession`].
        session -> Applied<Result<SessionGrant, Refusal>>, Session);
    answer!(
        /// The next answer, to a [`Command::ConsumeOnce`].
        consumed -> Applied<bool>, Consumed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryStore, SystemClock};
    use spendgate_core::{Micros, Policy, StepKind, ToolPrice};
    use std::sync::Arc;

    fn who(run: &str) -> RunRequest {
        RunRequest {
            run_id: RunId(run.into()),
            session: "s1".into(),
            ips: vec![IpScope {
                prefix: "192.0.2.1".into(),
                factor: 1,
            }],
            conversation: "c1".into(),
            input_bytes: 10,
        }
    }

    fn tool_step(run: &str, step: &str) -> StepRequest {
        StepRequest {
            run_id: RunId(run.into()),
            step_id: ReservationId(step.into()),
            kind: StepKind::Tool {
                tool: "t".into(),
                price: ToolPrice {
                    per_call: Micros(10),
                    per_unit: Micros(0),
                },
                units: 1,
            },
        }
    }

    /// Each answer is taken as its command's reply, in order; a ledger error stays the error
    /// it was, a reply of another kind and a missing answer are the store's fault.
    #[tokio::test]
    async fn a_batch_answers_each_command_in_order_typed() {
        let store: Arc<dyn Store> =
            Arc::new(MemoryStore::new(Policy::default(), Arc::new(SystemClock)));
        let mut answers = store
            .batch(vec![
                Command::AdmitRun {
                    req: who("r1"),
                    idem: None,
                },
                Command::ReserveStep {
                    req: tool_step("r1", "a"),
                    idem: None,
                },
                Command::ReserveStep {
                    req: tool_step("nope", "b"),
                    idem: None,
                },
                Command::Finish {
                    run: RunId("r1".into()),
                },
            ])
            .await;
        let admitted = answers.run().expect("answered").value.expect("admitted");
        assert_eq!(admitted.run_id, RunId("r1".into()));
        let reserved = answers.step().expect("answered").value.expect("reserved");
        assert_eq!(reserved.reserved, Micros(10));
        assert!(
            matches!(answers.step(), Err(StoreError::Ledger(..))),
            "a step of an unknown run is the ledger's refusal"
        );
        // A finish taken as a resolution: the store's fault, not a panic.
        assert!(matches!(
            answers.resolved(),
            Err(StoreError::Unavailable(m)) if m.contains("resolved")
        ));
        assert!(matches!(
            answers.finished(),
            Err(StoreError::Unavailable(m)) if m.contains("fewer")
        ));
    }
}
