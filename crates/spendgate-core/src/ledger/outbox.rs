//! The usage history's outbox: the [`HistoryEvent`]s the last call made, for the store to
//! take ([`Ledger::take_history`]) and write with the change they record.
//!
//! Off unless asked ([`Ledger::with_history`], [`Ledger::set_history`]): a ledger without a
//! history makes no record and keeps no refusal count. When on:
//! - every reservation that reaches a terminal state (`settle`: commit, release, unknown,
//!   expiry, a finish's held steps and a whole-run hold's settlement) makes its
//!   [`ReservationRecord`]; a late overrun (`top_up`) makes it again with the larger charge;
//! - every run that ends (`end_run`: finished or expired) makes its [`RunRecord`];
//! - every operator adjustment makes an [`AdjustmentRecord`] (its id: the ledger's sequence
//!   number after it);
//! - every refusal of an admission (run, step, session creation; not a dry run's "would have
//!   refused") is counted in its minute, code and scope kind, coalesced within a call.
//!
//! The store drains the outbox after every call, so it holds what one call made: at most one
//! record per reservation and per run the ledger holds (a reservation settles or is topped up
//! once in a call), one adjustment, and a handful of refusal minutes: [`HISTORY_OUTBOX_MAX`]
//! bounds it (checked in debug builds).

use super::messages::Settlement;
use super::model::{ReservationId, ReservationKind, ReservationState, RunId};
use super::refusal::Refusal;
use super::{Ledger, LEDGER_RECORDS_MAX};
use crate::history::{
    AdjustmentRecord, HistoryEvent, RefusalMinute, ReservationRecord, RunRecord, StepClass,
    RUN_REFUSALS_MAX,
};
use crate::ledger::model::CounterKey;
use crate::money::Micros;
use crate::scope::ReservationMode;
use crate::window::UnixMs;
use std::collections::BTreeMap;

/// Events one call leaves in the outbox at most: a record for each reservation and run the
/// ledger can hold (a sweep that expires every run at once), an adjustment and the refusal
/// minutes of one call, with room to spare. The store drains the outbox after every call.
pub const HISTORY_OUTBOX_MAX: usize = 2 * LEDGER_RECORDS_MAX + 64;

/// What the ledger made since the store last took it.
#[derive(Debug, Default)]
pub(super) struct Outbox {
    events: Vec<HistoryEvent>,
    /// Refusals of this call per minute, code and scope kind (made into events when taken).
    refusals: BTreeMap<RefusalMinute, u64>,
}

impl Ledger {
    /// This ledger, keeping a usage history (see [`Ledger::take_history`]).
    pub fn with_history(mut self) -> Ledger {
        self.set_history(true);
        self
    }

    /// Turns the usage history on or off (off drops what was not taken).
    pub fn set_history(&mut self, on: bool) {
        match (on, self.history.is_some()) {
            (true, false) => self.history = Some(Outbox::default()),
            (false, true) => self.history = None,
            _ => {}
        }
    }

    /// Whether this ledger keeps a usage history.
    pub fn keeps_history(&self) -> bool {
        self.history.is_some()
    }

    /// The history events made since the last call, in the order the ledger made them, then
    /// the refusal counts (one event per minute, code and scope kind). Empty when the ledger
    /// keeps no history.
    pub fn take_history(&mut self) -> Vec<HistoryEvent> {
        let Some(outbox) = self.history.as_mut() else {
            return Vec::new();
        };
        let mut events = std::mem::take(&mut outbox.events);
        for (at, count) in std::mem::take(&mut outbox.refusals) {
            events.push(HistoryEvent::Refusals { at, count });
        }
        events
    }

    fn emit(&mut self, event: HistoryEvent) {
        if let Some(outbox) = self.history.as_mut() {
            outbox.events.push(event);
            debug_assert!(
                outbox.events.len() <= HISTORY_OUTBOX_MAX,
                "the store drains the history outbox after every call"
            );
        }
    }

    /// A refusal answered to an admission (`run`: the run whose step it refused).
    pub(super) fn record_refusal(&mut self, now: UnixMs, refusal: &Refusal, run: Option<&RunId>) {
        let Some(outbox) = self.history.as_mut() else {
            return;
        };
        let at = RefusalMinute::of(now, refusal.code, refusal.scope);
        *outbox.refusals.entry(at).or_insert(0) += 1;
        let Some(run) = run.and_then(|id| self.runs.get_mut(id)) else {
            return;
        };
        let refused = &mut run.tally.refused;
        if refused.contains(&refusal.code) || refused.len() >= RUN_REFUSALS_MAX {
            return;
        }
        refused.push(refusal.code);
        let id = run.id.clone();
        // (the run's record changed; the sequence number does not move for a refusal)
        self.touch(super::Entity::Run(id));
    }

    /// A step just settled (`detail`: what its commit reported): its run's tally follows.
    /// Kept whether or not the ledger keeps a history (the run is rewritten by the
    /// settlement anyway).
    pub(super) fn tally_settled(&mut self, id: &ReservationId, detail: Option<Settlement>) {
        let Some(res) = self.reservations.get(id) else {
            return;
        };
        let (model, state, max_out) = (
            matches!(res.kind, ReservationKind::Model { .. }),
            res.state,
            res.max_output_tokens,
        );
        let Some(run) = self.runs.get_mut(&res.run_id) else {
            return;
        };
        let t = &mut run.tally;
        match (state, detail) {
            (ReservationState::Committed, Some(Settlement::Tokens(u))) => {
                t.output_tokens = t.output_tokens.saturating_add(u.completion_tokens);
            }
            (ReservationState::Committed, Some(Settlement::ResultBytes(b))) => {
                t.tool_result_bytes = t.tool_result_bytes.max(b);
            }
            (ReservationState::Unknown | ReservationState::Expired, _) if model => {
                t.output_tokens = t.output_tokens.saturating_add(max_out.unwrap_or(0));
            }
            _ => return,
        }
        let run_id = run.id.clone();
        self.touch(super::Entity::Run(run_id));
    }

    /// The record of a reservation that just reached a terminal state, or whose charge a
    /// late overrun just raised (`detail`: what the settlement reported).
    pub(super) fn record_reservation(&mut self, id: &ReservationId, detail: Option<Settlement>) {
        if self.history.is_none() {
            return;
        }
        let Some(res) = self.reservations.get(id) else {
            return;
        };
        let run = self.runs.get(&res.run_id);
        let (class, name, retry) = match &res.kind {
            ReservationKind::Model { model, retry, .. } => {
                (StepClass::Model, model.clone(), *retry)
            }
            ReservationKind::Tool { tool, .. } => (StepClass::Tool, tool.clone(), false),
            ReservationKind::RunHold => (StepClass::RunHold, String::new(), false),
        };
        let (usage, units, result_bytes) = match detail {
            Some(Settlement::Tokens(u)) => (Some(u), None, None),
            Some(Settlement::Units(n)) => (None, Some(n), None),
            Some(Settlement::ResultBytes(b)) => (None, None, Some(b)),
            None => (None, None, None),
        };
        let record = ReservationRecord {
            id: res.id.clone(),
            run_id: res.run_id.clone(),
            session: run.map(|r| r.session.clone()).unwrap_or_default(),
            conversation: run.map(|r| r.conversation.clone()).unwrap_or_default(),
            address: run
                .and_then(|r| r.ips.first())
                .map(|ip| ip.prefix.clone())
                .unwrap_or_default(),
            class,
            name,
            retry,
            usage,
            units,
            result_bytes,
            reserved: res.amount,
            charged: res.charged,
            state: res.state,
            created: res.created,
            resolved_at: res.resolved_at.unwrap_or(self.clock),
            overrun: res.overrun,
            result_too_large: res.result_too_large,
            counters: res.counters.clone(),
        };
        self.emit(HistoryEvent::Reservation(record));
    }

    /// The record of a run that just ended.
    pub(super) fn record_run(&mut self, run_id: &RunId) {
        if self.history.is_none() {
            return;
        }
        let Some(run) = self.runs.get(run_id) else {
            return;
        };
        let cost = self.budgets_charged(run);
        let ended_at = run.ended_at.unwrap_or(self.clock);
        let record = RunRecord {
            id: run.id.clone(),
            session: run.session.clone(),
            conversation: run.conversation.clone(),
            address: run
                .ips
                .first()
                .map(|ip| ip.prefix.clone())
                .unwrap_or_default(),
            created: run.created,
            ended_at,
            ended: run.state,
            input_bytes: run.tally.input_bytes,
            context_tokens: run.tally.context_tokens,
            output_tokens: run.tally.output_tokens,
            tool_result_bytes: run.tally.tool_result_bytes,
            rounds: run.rounds,
            tool_calls: run.tool_calls,
            retries: run.retries,
            duration_ms: ended_at.0.saturating_sub(run.created.0),
            cost,
            refused: run.tally.refused.clone(),
        };
        self.emit(HistoryEvent::Run(record));
    }

    /// An operator's adjustment, just applied: `applied` is what each counter moved by.
    pub(super) fn record_adjustment(&mut self, amount: i64, applied: Vec<(CounterKey, i64)>) {
        if self.history.is_none() {
            return;
        }
        let (counters, applied): (Vec<CounterKey>, Vec<i64>) = applied.into_iter().unzip();
        let record = AdjustmentRecord {
            id: self.seq.to_string(),
            at: self.clock,
            counters,
            amount_micros: amount,
            applied,
        };
        self.emit(HistoryEvent::Adjustment(record));
    }

    /// What a run's budgets were charged: its whole-run hold's charge (`whole_run`; while the
    /// hold is held, what its steps were charged), or the sum of its steps' charges.
    pub(super) fn budgets_charged(&self, run: &super::Run) -> Micros {
        let steps = self.run_charged(run);
        if run.mode != ReservationMode::WholeRun {
            return steps;
        }
        match run.hold.as_ref().and_then(|h| self.reservations.get(h)) {
            Some(h) if h.state != ReservationState::Held => h.charged,
            _ => steps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use crate::history::HistoryEvent;
    use crate::money::{Micros, ModelPrice, TokenUsage, ToolPrice};
    use crate::scope::{IpScope, Policy, ReservationMode, ScopeKey};
    use std::collections::HashMap as StdMap;

    const T0: UnixMs = UnixMs(1_796_040_000_000);
    const PRICE: ModelPrice = ModelPrice {
        input_per_million: Micros(1_000_000),
        cached_input_per_million: Micros(1_000_000),
        output_per_million: Micros(1_000_000),
    };

    fn policy(mode: ReservationMode) -> Policy {
        let mut p = Policy::default();
        for s in [
            &mut p.global,
            &mut p.ip,
            &mut p.session,
            &mut p.conversation,
        ] {
            s.rate = None;
            s.concurrency = None;
        }
        p.mode = mode;
        p.run.max_cost = Micros(100_000);
        p.run.max_input_bytes = 1000;
        p.lease_ttl_ms = 30_000;
        p
    }

    fn admit(l: &mut Ledger, p: &Policy, now: UnixMs, run: &str, bytes: u64) {
        let req = RunRequest {
            run_id: RunId(run.into()),
            session: "s".into(),
            ips: vec![IpScope {
                prefix: "192.0.2.1".into(),
                factor: 1,
            }],
            conversation: run.into(),
            input_bytes: bytes,
        };
        let _ = l.admit_run(p, now, &req, None).expect("valid").value;
    }

    fn model(l: &mut Ledger, p: &Policy, now: UnixMs, run: &str, step: &str, prompt: u64) {
        let req = StepRequest {
            run_id: RunId(run.into()),
            step_id: ReservationId(step.into()),
            kind: StepKind::Model {
                model: "m".into(),
                price: PRICE,
                prompt_tokens: prompt,
                max_output_tokens: Some(1000),
                retry: false,
            },
        };
        let r = l.reserve_step(p, now, &req, None).expect("valid").value;
        r.expect("reserved");
    }

    fn tokens(prompt: u64, out: u64) -> Resolution {
        Resolution::Commit(Settlement::Tokens(TokenUsage {
            prompt_tokens: prompt,
            completion_tokens: out,
            cached_tokens: 0,
        }))
    }

    fn id(s: &str) -> ReservationId {
        ReservationId(s.into())
    }

    /// Every budget counter's used spend equals the charges of the records that name it
    /// (the larger of two writes of one record) plus the adjustments.
    fn check_sums(l: &Ledger, events: &[HistoryEvent]) {
        let mut records: StdMap<ReservationId, crate::history::ReservationRecord> = StdMap::new();
        let mut sums: StdMap<CounterKey, i128> = StdMap::new();
        for e in events {
            match e {
                HistoryEvent::Reservation(r) => match records.get_mut(&r.id) {
                    Some(old) => old.merge(r),
                    None => {
                        records.insert(r.id.clone(), r.clone());
                    }
                },
                HistoryEvent::Adjustment(a) => {
                    for (i, k) in a.counters.iter().enumerate() {
                        *sums.entry(k.clone()).or_default() += i128::from(a.applied_to(i));
                    }
                }
                _ => {}
            }
        }
        for r in records.values() {
            for k in &r.counters {
                *sums.entry(k.clone()).or_default() += i128::from(r.charged.0);
            }
        }
        for (k, c) in &l.counters {
            if k.scope.kind == crate::scope::ScopeKind::Run {
                continue;
            }
            let sum = sums.get(k).copied().unwrap_or(0);
            assert_eq!(sum, i128::from(c.used.0), "counter {k:?}");
        }
    }

    #[test]
    fn a_ledger_without_history_makes_none() {
        let p = policy(ReservationMode::PerStep);
        let mut l = Ledger::new();
        admit(&mut l, &p, T0, "r", 10);
        model(&mut l, &p, T0, "r", "a", 10);
        l.finish(&p, T0, &RunId("r".into())).expect("finished");
        assert!(!l.keeps_history());
        assert!(l.take_history().is_empty());
    }

    #[test]
    fn per_step_records_every_end_once_and_sum_to_the_counters() {
        let p = policy(ReservationMode::PerStep);
        let mut l = Ledger::new().with_history();
        let mut events = Vec::new();
        admit(&mut l, &p, T0, "r", 77);
        model(&mut l, &p, T0, "r", "a", 100);
        model(&mut l, &p, T0, "r", "b", 300);
        model(&mut l, &p, T0, "r", "c", 10);
        l.resolve(&p, T0, &id("a"), tokens(100, 50))
            .expect("commit");
        l.resolve(&p, T0, &id("b"), Resolution::Release)
            .expect("release");
        events.extend(l.take_history());
        assert_eq!(events.len(), 2, "{events:?}");
        // (a repeat records nothing)
        l.resolve(&p, T0, &id("a"), tokens(100, 50))
            .expect("repeat");
        assert!(l.take_history().is_empty());
        let ended = l.finish(&p, T0, &RunId("r".into())).expect("finish").value;
        assert_eq!(ended.charged, ended.budgets_charged);
        let more = l.take_history();
        assert_eq!(more.len(), 2, "c unknown, then the run: {more:?}");
        let HistoryEvent::Run(run) = &more[1] else {
            panic!("the run's record comes last: {more:?}");
        };
        assert_eq!(
            (run.input_bytes, run.context_tokens, run.output_tokens),
            (77, 300, 50 + 1000)
        );
        assert_eq!(run.cost, ended.charged);
        assert_eq!(run.rounds, 3);
        events.extend(more);
        // A late overrun of the unknown step: recorded again with the larger charge.
        l.resolve(&p, T0, &id("c"), tokens(10, 5000)).expect("late");
        let late = l.take_history();
        assert!(
            matches!(&late[..], [HistoryEvent::Reservation(r)] if r.charged == Micros(5010)),
            "{late:?}"
        );
        events.extend(late);
        check_sums(&l, &events);
    }

    #[test]
    fn an_expired_whole_run_reports_its_hold_as_charged() {
        let p = policy(ReservationMode::WholeRun);
        let mut l = Ledger::new().with_history();
        admit(&mut l, &p, T0, "w", 1);
        model(&mut l, &p, T0, "w", "a", 1000);
        l.resolve(&p, T0, &id("a"), tokens(1000, 97_000))
            .expect("commit");
        let later = T0.plus_ms(p.lease_ttl_ms + 1);
        let ended = l.finish(&p, later, &RunId("w".into())).expect("finish");
        let ended = ended.value;
        assert_eq!(ended.state, RunState::Expired);
        assert_eq!(ended.charged, Micros(98_000));
        assert_eq!(ended.budgets_charged, Micros(100_000));
        let events = l.take_history();
        let hold = events.iter().find_map(|e| match e {
            HistoryEvent::Reservation(r) if r.class == crate::history::StepClass::RunHold => {
                Some(r)
            }
            _ => None,
        });
        assert_eq!(hold.map(|h| h.charged), Some(Micros(100_000)));
        let run = events.iter().find_map(|e| match e {
            HistoryEvent::Run(r) => Some(r),
            _ => None,
        });
        assert_eq!(
            run.map(|r| (r.cost, r.ended)),
            Some((Micros(100_000), RunState::Expired))
        );
        check_sums(&l, &events);
    }

    #[test]
    fn refusals_count_per_minute_and_adjustments_are_recorded() {
        let mut p = policy(ReservationMode::PerStep);
        p.run.max_model_rounds = 1;
        let mut l = Ledger::new().with_history();
        admit(&mut l, &p, T0, "r", 5000); // over max_input_bytes: refused
        admit(&mut l, &p, T0, "r", 5000);
        let counts = l.take_history();
        assert!(
            matches!(&counts[..], [HistoryEvent::Refusals { at, count: 2 }]
                if at.code == RefusalCode::PayloadTooLarge),
            "{counts:?}"
        );
        admit(&mut l, &p, T0, "r", 1);
        model(&mut l, &p, T0, "r", "a", 1);
        let req = StepRequest {
            run_id: RunId("r".into()),
            step_id: id("b"),
            kind: StepKind::Tool {
                tool: "t".into(),
                price: ToolPrice {
                    per_call: Micros(1),
                    per_unit: Micros(0),
                },
                units: 0,
            },
        };
        l.reserve_step(&p, T0, &req, None)
            .expect("valid")
            .value
            .expect("tool");
        let mut again = req.clone();
        again.step_id = id("c");
        again.kind = StepKind::Model {
            model: "m".into(),
            price: PRICE,
            prompt_tokens: 1,
            max_output_tokens: None,
            retry: false,
        };
        let refused = l.reserve_step(&p, T0, &again, None).expect("valid").value;
        assert_eq!(
            refused.map(|_| ()).map_err(|r| r.code),
            Err(RefusalCode::RunBoundExceeded)
        );
        let adjusted = l.adjust(&p, T0, &ScopeKey::global(), 1, 1234, None);
        adjusted.expect("adjusted");
        l.finish(&p, T0, &RunId("r".into())).expect("finish");
        let events = l.take_history();
        let run = events.iter().find_map(|e| match e {
            HistoryEvent::Run(r) => Some(r),
            _ => None,
        });
        assert_eq!(
            run.map(|r| r.refused.clone()),
            Some(vec![RefusalCode::RunBoundExceeded])
        );
        assert!(events
            .iter()
            .any(|e| matches!(e, HistoryEvent::Adjustment(a)
            if a.amount_micros == 1234 && a.counters.len() == 2)));
        check_sums(&l, &events);
    }
}
