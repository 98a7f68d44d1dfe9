//! spendgate-core: the whole domain and admission logic of spendgate.
//!
//! Architecture invariant: this crate performs no I/O and never reads a clock. Every
//! operation takes `now` (the store's clock) as an argument and returns a decision; business
//! refusals are values ([`Refusal`]), not errors.

pub mod admission;
pub mod command;
pub mod history;
pub mod ledger;
pub mod money;
pub mod rate;
pub mod replicas;
pub mod scope;
pub mod window;

pub use admission::{
    decide, BudgetRefusal, BudgetView, Shortfall, HELD_RETRY_AFTER_S, LIFETIME_RETRY_AFTER_S,
};
pub use command::{Command, Reply};
pub use ledger::{
    budget_message, Adjustment, Applied, Counter, CounterKey, Entity, Heartbeat, IdempotencyKey,
    IdempotencyRecord, IdempotentOutcome, Ledger, LedgerError, RateLeft, Record, RecordRef,
    Refusal, RefusalCode, Reservation, ReservationId, ReservationKind, ReservationState,
    Resolution, Resolved, Run, RunAdmitted, RunEnded, RunId, RunRequest, RunState, RunTally,
    SessionGrant, Settlement, StepKind, StepRequest, StepReserved, Summary, UsageLine,
    ADJUSTMENT_KEY_TTL_MS, COMPACT_EVERY_MS, CUTOFF_MESSAGE, EXPIRIES_PER_CALL_MAX,
    HISTORY_OUTBOX_MAX, IDEMPOTENCY_RETENTION_MS, ID_BYTES_MAX, IP_SCOPES_MAX, LEDGER_RECORDS_MAX,
    RECORD_RETENTION_MS, SWEEP_EXPIRIES_MAX,
};
pub use money::{parse_amount, AmountError, Micros, ModelPrice, TokenUsage, ToolPrice, MICROS_MAX};
pub use rate::{Rate, RateError};
pub use replicas::{
    fingerprint_counts, ReplicaSeen, FINGERPRINT_BYTES_MAX, REPLICAS_MAX, REPLICA_ID_BYTES_MAX,
    REPLICA_STALE_MS,
};
pub use scope::{
    Budget, IpScope, Policy, ReservationMode, RunBounds, ScopeKey, ScopeKind, ScopePolicy,
};
pub use window::{rfc3339, UnixMs, Window, WindowId};
