//! spendgate-core: the whole domain and admission logic of spendgate.
//!
//! Architecture invariant: this crate performs no I/O and never reads a clock. Every
//! operation takes `now` (the store's clock) as an argument and returns a decision; business
//! refusals are values ([`Refusal`]), not errors.

pub mod admission;
pub mod command;
pub mod ledger;
pub mod money;
pub mod rate;
pub mod replicas;
pub mod scope;
pub mod window;

pub use admission::{decide, BudgetRefusal, BudgetView, Shortfall};
pub use command::{Command, Reply};
pub use ledger::*;
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
