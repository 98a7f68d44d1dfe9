//! What the ledger holds: budget counters, runs and their reservations.

use super::RECORD_RETENTION_MS;
use crate::money::{Micros, ModelPrice, ToolPrice};
use crate::scope::{IpScope, ReservationMode, RunBounds, ScopeKey, ScopeKind};
use crate::window::{UnixMs, Window, WindowId};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunId(pub String);

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReservationId(pub String);

/// The counter of one scope in one window.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CounterKey {
    pub scope: ScopeKey,
    pub window: WindowId,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// The limit in force the last time this counter was touched.
    pub limit: Micros,
    pub used: Micros,
    pub reserved: Micros,
    /// Observed usage went above the limit: nothing more is admitted in this window.
    pub overrun: bool,
    /// Net operator adjustments (micros, signed), for reconciliation.
    pub adjusted: i64,
}

impl Counter {
    /// Room left for new holds; zero once overrun.
    pub fn remaining(&self) -> Micros {
        if self.overrun {
            return Micros::ZERO;
        }
        self.limit
            .saturating_sub(self.used)
            .saturating_sub(self.reserved)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationState {
    Held,
    Committed,
    Released,
    Unknown,
    Expired,
}

impl ReservationState {
    pub fn name(self) -> &'static str {
        match self {
            ReservationState::Held => "held",
            ReservationState::Committed => "committed",
            ReservationState::Released => "released",
            ReservationState::Unknown => "unknown",
            ReservationState::Expired => "expired",
        }
    }
    pub fn parse(s: &str) -> Option<ReservationState> {
        Some(match s {
            "held" => ReservationState::Held,
            "committed" => ReservationState::Committed,
            "released" => ReservationState::Released,
            "unknown" => ReservationState::Unknown,
            "expired" => ReservationState::Expired,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationKind {
    Model {
        model: String,
        price: ModelPrice,
        retry: bool,
    },
    Tool {
        tool: String,
        price: ToolPrice,
        units: u64,
    },
    /// The whole-run hold of `whole_run` mode.
    RunHold,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub id: ReservationId,
    pub run_id: RunId,
    pub kind: ReservationKind,
    pub amount: Micros,
    pub counters: Vec<CounterKey>,
    pub state: ReservationState,
    pub charged: Micros,
    pub created: UnixMs,
    pub resolved_at: Option<UnixMs>,
    pub max_output_tokens: Option<u64>,
    pub overrun: bool,
    /// Committed with a tool result above its run's `max_tool_result_bytes` (kept so that a
    /// repeated commit answers what the first one did).
    pub result_too_large: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Active,
    Finished,
    Expired,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    pub id: RunId,
    pub session: String,
    pub conversation: String,
    pub ips: Vec<IpScope>,
    pub created: UnixMs,
    pub deadline: UnixMs,
    pub lease_until: UnixMs,
    pub rounds: u32,
    pub tool_calls: u32,
    pub retries: u32,
    pub state: RunState,
    pub ended_at: Option<UnixMs>,
    /// Concurrency slots held while active.
    pub slots: Vec<ScopeKey>,
    pub hold: Option<ReservationId>,
    pub bounds: RunBounds,
    pub mode: ReservationMode,
    /// What the usage history's run record tells of it (files of schema 6 and older load it
    /// empty: postcard is positional, so the sqlite store reads their layout apart).
    #[serde(default)]
    pub tally: RunTally,
}

/// A run's figures for its history record ([`crate::history::RunRecord`]), kept as it goes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunTally {
    /// The input size it was admitted with.
    pub input_bytes: u64,
    /// The largest prompt (tokens) one of its model steps reserved for.
    pub context_tokens: u64,
    /// Completion tokens of its committed model steps, plus the output bound of each model
    /// step resolved `unknown` or `expired` (saturating).
    pub output_tokens: u64,
    /// The largest tool result (bytes) one of its steps committed.
    pub tool_result_bytes: u64,
    /// Distinct refusal codes its steps got, at most [`crate::history::RUN_REFUSALS_MAX`]
    /// (kept only while the ledger keeps a history).
    pub refused: Vec<super::RefusalCode>,
}

impl Run {
    pub(super) fn scope_keys(&self) -> Vec<(ScopeKey, u64)> {
        run_scopes(&self.session, &self.ips, &self.conversation)
    }
    pub(super) fn counter_key(&self) -> CounterKey {
        CounterKey {
            scope: ScopeKey::new(ScopeKind::Run, self.id.0.clone()),
            window: Window::Lifetime.at(UnixMs(0)),
        }
    }
}

pub(super) fn run_scopes(
    session: &str,
    ips: &[IpScope],
    conversation: &str,
) -> Vec<(ScopeKey, u64)> {
    let mut v = Vec::with_capacity(3 + ips.len());
    v.push((ScopeKey::global(), 1));
    for ip in ips {
        v.push((
            ScopeKey::new(ScopeKind::Ip, ip.prefix.clone()),
            ip.factor.max(1),
        ));
    }
    v.push((ScopeKey::new(ScopeKind::Session, session), 1));
    v.push((ScopeKey::new(ScopeKind::Conversation, conversation), 1));
    v
}

/// When a counter becomes stale (droppable by a sweep once it holds nothing): its window's
/// end plus `RECORD_RETENTION_MS`; never for global counters and lifetime windows.
pub(super) fn stale_from(key: &CounterKey) -> Option<UnixMs> {
    if key.scope.kind == ScopeKind::Global {
        return None;
    }
    Some(key.window.resets_at()?.plus_ms(RECORD_RETENTION_MS))
}
