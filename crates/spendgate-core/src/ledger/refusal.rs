//! Business refusals: values, not errors.

use crate::scope::ScopeKind;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    RateLimited,
    ConcurrencyLimited,
    BudgetExhausted,
    RunBoundExceeded,
    PayloadTooLarge,
    ContextTooLarge,
    CutoffEngaged,
    /// Used spend alone would admit the call; the holds of calls in flight refuse it: a
    /// short wait, not a spent budget. (Last: stored refusals name their code by position.)
    BudgetHeld,
}

impl RefusalCode {
    pub fn name(self) -> &'static str {
        match self {
            RefusalCode::RateLimited => "rate_limited",
            RefusalCode::ConcurrencyLimited => "concurrency_limited",
            RefusalCode::BudgetExhausted => "budget_exhausted",
            RefusalCode::RunBoundExceeded => "run_bound_exceeded",
            RefusalCode::PayloadTooLarge => "payload_too_large",
            RefusalCode::ContextTooLarge => "context_too_large",
            RefusalCode::CutoffEngaged => "cutoff_engaged",
            RefusalCode::BudgetHeld => "budget_held",
        }
    }
}

/// A business refusal: a value, not an error. Says which scope refused and when to retry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub code: RefusalCode,
    pub scope: Option<ScopeKind>,
    pub retry_after_s: Option<u64>,
    pub message: String,
}

impl Refusal {
    pub(super) fn new(
        code: RefusalCode,
        scope: Option<ScopeKind>,
        message: impl Into<String>,
    ) -> Refusal {
        Refusal {
            code,
            scope,
            retry_after_s: None,
            message: message.into(),
        }
    }
    pub(super) fn retry_after(mut self, s: u64) -> Refusal {
        self.retry_after_s = Some(s.max(1));
        self
    }
}
