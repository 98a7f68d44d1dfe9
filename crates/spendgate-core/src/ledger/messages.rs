//! What the ledger's operations take and answer.

use super::model::{ReservationId, ReservationState, RunId, RunState};
use super::refusal::Refusal;
use crate::money::{Micros, ModelPrice, TokenUsage, ToolPrice};
use crate::scope::{IpScope, RunBounds, ScopeKey, ScopeKind};
use crate::window::{UnixMs, WindowId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap as StdHashMap;

/// An answer and the ledger sequence number after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied<T> {
    pub value: T,
    /// The ledger's sequence number after this call; it grows with every change.
    pub seq: u64,
    /// Whether this call changed the ledger.
    pub changed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyKey {
    /// Namespaced key (e.g. `run:KEY` or `step:RUN:KEY`).
    pub key: String,
    /// A digest of the request body; a different body under the same key is a conflict.
    pub fingerprint: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    pub run_id: RunId,
    pub session: String,
    pub ips: Vec<IpScope>,
    pub conversation: String,
    pub input_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAdmitted {
    pub run_id: RunId,
    pub deadline: UnixMs,
    pub reserved: Micros,
    pub bounds: RunBounds,
    /// The request-rate scope with the least quota left after this admission (`None` when no
    /// scope of the run has a rate). Computed from the rate state the admission wrote.
    pub rate_left: Option<RateLeft>,
    /// The refusal a limit in dry-run would have given (the first, in the order enforcement
    /// checks: rates, concurrency, budgets); `None` when every limit passed.
    pub dry_run: Option<Refusal>,
}

/// What one request-rate (GCRA) scope has left right after an admission (see [`Rate::left`]).
///
/// Among the run's rate scopes (global, each address prefix, session, conversation) the one
/// with the least `remaining` is reported; on a tie the one with the longer `reset_s`, then
/// the first in that order.
///
/// [`Rate::left`]: crate::rate::Rate::left
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLeft {
    pub scope: ScopeKind,
    /// How many more runs this scope would admit right now (the burst left).
    pub remaining: u64,
    /// Seconds until this scope regains one more unit of quota, rounded up (at least 1).
    pub reset_s: u64,
}

impl RateLeft {
    /// Keeps the tighter of `self` and `other` (less remaining; on a tie the longer reset;
    /// on a full tie `self`).
    pub(super) fn tighter(self, other: RateLeft) -> RateLeft {
        if (other.remaining, std::cmp::Reverse(other.reset_s))
            < (self.remaining, std::cmp::Reverse(self.reset_s))
        {
            other
        } else {
            self
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepKind {
    Model {
        model: String,
        price: ModelPrice,
        prompt_tokens: u64,
        /// Requested output bound; `None` means "the run's bound".
        max_output_tokens: Option<u64>,
        retry: bool,
    },
    Tool {
        tool: String,
        price: ToolPrice,
        units: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRequest {
    pub run_id: RunId,
    pub step_id: ReservationId,
    pub kind: StepKind,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReserved {
    pub step_id: ReservationId,
    pub reserved: Micros,
    pub max_output_tokens: Option<u64>,
    /// The output bound was shrunk to fit the remaining budget (`run.shrink_to_fit`).
    pub shrunk: bool,
    /// The refusal a budget in dry-run would have given; `None` when every budget passed.
    pub dry_run: Option<Refusal>,
}

/// What a commit reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Settlement {
    Tokens(TokenUsage),
    /// Units a tool consumed (a charge of per_call + per_unit × units).
    Units(u64),
    /// A tool's result size; the charge is what was reserved.
    ResultBytes(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolved {
    pub state: ReservationState,
    pub charged: Micros,
    pub reserved: Micros,
    pub overrun: bool,
    /// The answer repeats an earlier resolution (idempotent retry).
    pub repeated: bool,
    /// A tool result above `max_tool_result_bytes`: charged, but must not be fed back.
    pub result_too_large: bool,
}

/// What an adjustment answers: the scope's budgets after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adjustment {
    pub lines: Vec<UsageLine>,
    /// The key was used before: nothing was applied this time.
    pub repeated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunEnded {
    pub state: RunState,
    /// The sum of its steps' charges (what `per_step` charged its budgets).
    pub charged: Micros,
    /// What its budgets were charged: `charged` (`per_step`), or its whole-run hold's charge
    /// (`whole_run`: at least its steps' sum; the whole hold when the run expired).
    pub budgets_charged: Micros,
    pub steps: u32,
    pub repeated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub lease_until: UnixMs,
    pub deadline: UnixMs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionGrant {
    /// Session creation is busier than half its allowance: adaptive challenges apply.
    pub pressure: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageLine {
    pub scope: ScopeKey,
    pub window: WindowId,
    pub limit: Micros,
    pub used: Micros,
    pub reserved: Micros,
    pub overrun: bool,
    pub resets_at: Option<UnixMs>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub seq: u64,
    pub cutoff: Option<String>,
    pub runs_active: u64,
    pub reservations: StdHashMap<String, u64>,
    pub held_micros: Micros,
    pub charged_micros: Micros,
    pub overruns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IdempotentOutcome {
    Run(Result<RunAdmitted, Refusal>),
    Step(Result<StepReserved, Refusal>),
    /// A single-use token was consumed.
    Used,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub key: String,
    pub fingerprint: String,
    pub outcome: IdempotentOutcome,
    pub expires: UnixMs,
}

/// How to resolve a held step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    Commit(Settlement),
    Release,
    Unknown,
}
