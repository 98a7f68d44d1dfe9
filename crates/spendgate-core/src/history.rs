//! The usage history: what the ledger tells the outside world it did, one record per
//! reservation that reached a terminal state, one per run that ended, one per operator
//! adjustment, and refusals counted per minute. Stores keep it as exactly as the ledger
//! (written with the change it records: in the same sqlite transaction, by the same Redis
//! script), and `report`, `tune`, the dashboard and `/admin/v1/history` read any period of it.
//!
//! Records are keyed (`HistoryEvent::key`) so that a sink that sees one twice (a drain retried
//! after a crash) keeps one: a reservation's record is written again only when a late overrun
//! tops its charge up, and a sink keeps the larger charge ([`ReservationRecord::merge`]).
//! Refusal counts are per minute, code and scope kind; a sink adds them up (sqlite, in the
//! transaction that applied them) or keeps the largest count seen for the same minute, code,
//! kind and source (a drain from a Redis counter that only grows).
//!
//! Aggregation ([`aggregate`]) is here, pure, so that every backend groups and ranks the same
//! way: a backend selects the records of a period, this groups them.

use crate::ledger::{CounterKey, RefusalCode, ReservationId, ReservationState, RunId, RunState};
use crate::money::{Micros, TokenUsage};
use crate::scope::ScopeKind;
use crate::window::UnixMs;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Distinct refusal codes one run's record keeps at most.
pub const RUN_REFUSALS_MAX: usize = 8;
/// Groups one aggregation keeps at most before it ranks them (a `--by session` report over a
/// flood of sessions keeps the top ones by charge, and says it truncated).
pub const GROUPS_MAX: usize = 100_000;

/// What kind of paid work a reservation held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepClass {
    Model,
    Tool,
    /// The whole-run hold of `whole_run` mode: what the run's budgets were charged.
    RunHold,
}

impl StepClass {
    pub fn name(self) -> &'static str {
        match self {
            StepClass::Model => "model",
            StepClass::Tool => "tool",
            StepClass::RunHold => "run_hold",
        }
    }
}

/// One reservation's terminal record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationRecord {
    pub id: ReservationId,
    pub run_id: RunId,
    pub session: String,
    pub conversation: String,
    /// The client's address prefix (the narrowest one of the run).
    pub address: String,
    pub class: StepClass,
    /// The model or tool; empty for a run hold.
    pub name: String,
    pub retry: bool,
    /// Observed token usage (a committed model step).
    pub usage: Option<TokenUsage>,
    /// Units a tool reported (a committed tool step).
    pub units: Option<u64>,
    /// A tool result's size (a tool step committed with `result_bytes`).
    pub result_bytes: Option<u64>,
    pub reserved: Micros,
    pub charged: Micros,
    pub state: ReservationState,
    pub created: UnixMs,
    pub resolved_at: UnixMs,
    pub overrun: bool,
    pub result_too_large: bool,
    /// Every budget counter (scope and window) the charge went to.
    pub counters: Vec<CounterKey>,
}

impl ReservationRecord {
    /// Two writes of one reservation's record (a late overrun re-writes it): the larger charge
    /// wins, and what only the later one knows (its usage) is kept.
    pub fn merge(&mut self, later: &ReservationRecord) {
        debug_assert_eq!(self.id, later.id);
        if later.charged > self.charged {
            self.charged = later.charged;
            self.overrun = later.overrun;
            if later.usage.is_some() {
                self.usage = later.usage;
            }
            if later.units.is_some() {
                self.units = later.units;
            }
        }
    }
}

/// One run's summary, written when it ends (finished or expired).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: RunId,
    pub session: String,
    pub conversation: String,
    pub address: String,
    pub created: UnixMs,
    pub ended_at: UnixMs,
    /// `finished` or `expired`.
    pub ended: RunState,
    pub input_bytes: u64,
    /// The largest prompt (tokens) of one of its model steps.
    pub context_tokens: u64,
    /// Output tokens: the sum of its committed model steps' completion tokens and, for a step
    /// whose usage is unknown, the output bound it was reserved for.
    pub output_tokens: u64,
    /// The largest tool result (bytes) it committed.
    pub tool_result_bytes: u64,
    pub rounds: u32,
    pub tool_calls: u32,
    pub retries: u32,
    /// `ended_at - created`, in milliseconds.
    pub duration_ms: u64,
    /// What its budgets were charged: the sum of its steps' charges (`per_step`), or its hold's
    /// charge (`whole_run`), at the time it ended.
    pub cost: Micros,
    /// Distinct refusal codes its steps got (at most [`RUN_REFUSALS_MAX`]).
    pub refused: Vec<RefusalCode>,
}

/// An operator's adjustment of one scope's used spend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdjustmentRecord {
    /// Unique per adjustment (the ledger's sequence number when it applied).
    pub id: String,
    pub at: UnixMs,
    pub counters: Vec<CounterKey>,
    pub amount_micros: i64,
    /// What each of `counters` moved by, in order (a credit stops at zero, a charge at
    /// `MICROS_MAX`); empty: `amount_micros` each.
    #[serde(default)]
    pub applied: Vec<i64>,
}

impl AdjustmentRecord {
    /// What counter `i` of `counters` moved by.
    pub fn applied_to(&self, i: usize) -> i64 {
        self.applied.get(i).copied().unwrap_or(self.amount_micros)
    }
}

/// Refusals of one code by one scope kind in one minute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RefusalMinute {
    /// The minute's start.
    pub minute: UnixMs,
    pub code: RefusalCode,
    pub scope: Option<ScopeKind>,
}

impl RefusalMinute {
    pub fn of(at: UnixMs, code: RefusalCode, scope: Option<ScopeKind>) -> RefusalMinute {
        RefusalMinute {
            minute: UnixMs(at.0 - at.0 % 60_000),
            code,
            scope,
        }
    }
}

/// One entry of the history, as a store hands it to a sink.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HistoryEvent {
    Reservation(ReservationRecord),
    Run(RunRecord),
    Adjustment(AdjustmentRecord),
    Refusals { at: RefusalMinute, count: u64 },
}

impl HistoryEvent {
    /// The record's identity: a sink keeps one record per key. A reservation's and a run's
    /// include their creation time and a reservation's its run: an id may be taken again once
    /// the ledger purged the first one (a minute after its run ended).
    pub fn key(&self) -> String {
        match self {
            HistoryEvent::Reservation(r) => {
                format!("r:{}:{}:{}", r.created.0, r.run_id.0, r.id.0)
            }
            HistoryEvent::Run(r) => format!("u:{}:{}", r.created.0, r.id.0),
            HistoryEvent::Adjustment(a) => format!("a:{}", a.id),
            HistoryEvent::Refusals { at, .. } => format!(
                "x:{}:{}:{}",
                at.minute.0,
                at.code.name(),
                at.scope.map_or("", |s| s.name())
            ),
        }
    }
}

/// How a history query groups its records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupBy {
    Minute,
    Hour,
    Day,
    /// Each record counts once under every scope kind it charged.
    ScopeKind,
    Model,
    Tool,
    Session,
    Address,
    Conversation,
    /// The terminal state.
    State,
}

impl GroupBy {
    pub fn parse(s: &str) -> Option<GroupBy> {
        Some(match s {
            "minute" => GroupBy::Minute,
            "hour" => GroupBy::Hour,
            "day" => GroupBy::Day,
            "scope-kind" | "scope_kind" => GroupBy::ScopeKind,
            "model" => GroupBy::Model,
            "tool" => GroupBy::Tool,
            "session" => GroupBy::Session,
            "address" => GroupBy::Address,
            "conversation" => GroupBy::Conversation,
            "state" => GroupBy::State,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            GroupBy::Minute => "minute",
            GroupBy::Hour => "hour",
            GroupBy::Day => "day",
            GroupBy::ScopeKind => "scope-kind",
            GroupBy::Model => "model",
            GroupBy::Tool => "tool",
            GroupBy::Session => "session",
            GroupBy::Address => "address",
            GroupBy::Conversation => "conversation",
            GroupBy::State => "state",
        }
    }
    /// Whether groups are periods (ordered by time) rather than ranked by charge.
    pub fn is_time(self) -> bool {
        matches!(self, GroupBy::Minute | GroupBy::Hour | GroupBy::Day)
    }
}

/// One group of a history report. Run holds (`whole_run`) are counted under their run's
/// session, address and conversation, and never under a model or tool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryRow {
    /// The grouping key: an RFC 3339 period start, a scope kind, a model, a session...
    pub key: String,
    pub reservations: u64,
    pub reserved_micros: u64,
    pub charged_micros: u64,
    pub overruns: u64,
    pub unknown_or_expired: u64,
}

/// Groups reservation records resolved in `[since, until)` by `by`; periods in time order,
/// other groups by charge (largest first, then key), `top` of them when given. Whether the
/// group count reached [`GROUPS_MAX`] (the rest were dropped before ranking) comes second.
pub fn aggregate<'a>(
    records: impl IntoIterator<Item = &'a ReservationRecord>,
    by: GroupBy,
    top: Option<usize>,
) -> (Vec<HistoryRow>, bool) {
    let mut groups: BTreeMap<String, HistoryRow> = BTreeMap::new();
    let mut truncated = false;
    for r in records {
        for key in group_keys(r, by) {
            if !groups.contains_key(&key) && groups.len() >= GROUPS_MAX {
                truncated = true;
                continue;
            }
            let row = groups.entry(key.clone()).or_insert_with(|| HistoryRow {
                key,
                ..HistoryRow::default()
            });
            row.reservations += 1;
            row.reserved_micros = row.reserved_micros.saturating_add(r.reserved.0);
            row.charged_micros = row.charged_micros.saturating_add(r.charged.0);
            row.overruns += u64::from(r.overrun);
            row.unknown_or_expired += u64::from(matches!(
                r.state,
                ReservationState::Unknown | ReservationState::Expired
            ));
        }
    }
    let mut rows: Vec<HistoryRow> = groups.into_values().collect();
    if !by.is_time() {
        rows.sort_by(|a, b| {
            b.charged_micros
                .cmp(&a.charged_micros)
                .then_with(|| a.key.cmp(&b.key))
        });
    }
    if let Some(top) = top {
        rows.truncate(top);
    }
    (rows, truncated)
}

/// The keys one record counts under (none: it is not in this grouping, e.g. a run hold by
/// model).
fn group_keys(r: &ReservationRecord, by: GroupBy) -> Vec<String> {
    let period = |ms: u64| crate::window::rfc3339(UnixMs(r.resolved_at.0 - r.resolved_at.0 % ms));
    match by {
        GroupBy::Minute => vec![period(60_000)],
        GroupBy::Hour => vec![period(3_600_000)],
        GroupBy::Day => vec![period(86_400_000)],
        GroupBy::ScopeKind => {
            let mut kinds: Vec<&str> = r.counters.iter().map(|c| c.scope.kind.name()).collect();
            kinds.sort_unstable();
            kinds.dedup();
            kinds.into_iter().map(str::to_owned).collect()
        }
        GroupBy::Model => match r.class {
            StepClass::Model => vec![r.name.clone()],
            _ => vec![],
        },
        GroupBy::Tool => match r.class {
            StepClass::Tool => vec![r.name.clone()],
            _ => vec![],
        },
        GroupBy::Session => vec![r.session.clone()],
        GroupBy::Address => vec![r.address.clone()],
        GroupBy::Conversation => vec![r.conversation.clone()],
        GroupBy::State => vec![r.state.name().to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::ScopeKey;
    use crate::window::Window;

    fn record(
        id: &str,
        class: StepClass,
        name: &str,
        session: &str,
        charged: u64,
    ) -> ReservationRecord {
        ReservationRecord {
            id: ReservationId(id.into()),
            run_id: RunId("run".into()),
            session: session.into(),
            conversation: "c".into(),
            address: "10.0.0.1/32".into(),
            class,
            name: name.into(),
            retry: false,
            usage: None,
            units: None,
            result_bytes: None,
            reserved: Micros(charged + 1),
            charged: Micros(charged),
            state: ReservationState::Committed,
            created: UnixMs(1_000),
            resolved_at: UnixMs(90_061_000),
            overrun: false,
            result_too_large: false,
            counters: vec![
                CounterKey {
                    scope: ScopeKey::global(),
                    window: Window::Day.at(UnixMs(90_061_000)),
                },
                CounterKey {
                    scope: ScopeKey::new(ScopeKind::Session, session),
                    window: Window::Day.at(UnixMs(90_061_000)),
                },
            ],
        }
    }

    #[test]
    fn groups_rank_by_charge_and_skip_what_is_not_in_the_grouping() {
        let rs = [
            record("a", StepClass::Model, "m1", "s1", 10),
            record("b", StepClass::Model, "m2", "s1", 30),
            record("c", StepClass::Tool, "t", "s2", 5),
            record("d", StepClass::RunHold, "", "s2", 100),
        ];
        let (rows, truncated) = aggregate(&rs, GroupBy::Model, None);
        assert!(!truncated);
        let keys: Vec<(&str, u64)> = rows
            .iter()
            .map(|r| (r.key.as_str(), r.charged_micros))
            .collect();
        assert_eq!(keys, [("m2", 30), ("m1", 10)]);
        let (rows, _) = aggregate(&rs, GroupBy::Session, Some(1));
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (
                rows[0].key.as_str(),
                rows[0].charged_micros,
                rows[0].reservations
            ),
            ("s2", 105, 2)
        );
        let (rows, _) = aggregate(&rs, GroupBy::ScopeKind, None);
        assert_eq!(rows.len(), 2);
        assert!(rows
            .iter()
            .all(|r| r.charged_micros == 145 && r.reservations == 4));
        let (rows, _) = aggregate(&rs, GroupBy::Day, None);
        assert_eq!(rows[0].key, "1970-01-02T00:00:00Z");
    }

    #[test]
    fn a_later_write_keeps_the_larger_charge() {
        let mut first = record("a", StepClass::Model, "m", "s", 10);
        let mut later = first.clone();
        later.charged = Micros(25);
        later.overrun = true;
        first.merge(&later);
        assert_eq!((first.charged, first.overrun), (Micros(25), true));
        let lower = record("a", StepClass::Model, "m", "s", 3);
        first.merge(&lower);
        assert_eq!(first.charged, Micros(25));
    }

    #[test]
    fn refusals_fall_in_their_minute() {
        let m = RefusalMinute::of(
            UnixMs(125_999),
            RefusalCode::RateLimited,
            Some(ScopeKind::Ip),
        );
        assert_eq!(m.minute, UnixMs(120_000));
        let e = HistoryEvent::Refusals { at: m, count: 3 };
        assert_eq!(e.key(), "x:120000:rate_limited:ip");
    }
}
