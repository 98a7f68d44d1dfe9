//! Runs: admission, lease renewal, heartbeat and finish.

use super::error::{check_id, LedgerError};
use super::messages::{
    Applied, Heartbeat, IdempotencyKey, IdempotentOutcome, RateLeft, RunAdmitted, RunEnded,
    RunRequest,
};
use super::model::{
    run_scopes, CounterKey, Reservation, ReservationId, ReservationKind, ReservationState, Run,
    RunId, RunState, RunTally,
};
use super::records::Entity;
use super::refusal::{Refusal, RefusalCode};
use super::{Ledger, Timer, IP_SCOPES_MAX, LEDGER_RECORDS_MAX, RECORD_RETENTION_MS};
use crate::money::Micros;
use crate::scope::{Policy, ReservationMode, ScopeKey, ScopeKind};
use crate::window::UnixMs;

impl Ledger {
    /// Admits a run: checks rate, concurrency and budgets of every scope, and applies all of
    /// them or none. In `whole_run` mode the run's cost bound is reserved here.
    pub fn admit_run(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &RunRequest,
        idem: Option<&IdempotencyKey>,
    ) -> Result<Applied<Result<RunAdmitted, Refusal>>, LedgerError> {
        let (now, swept) = self.advance(now);
        match self.recall(idem)? {
            Some(IdempotentOutcome::Run(o)) => return Ok(self.answer(o, swept)),
            Some(_) => return Err(LedgerError::IdempotencyConflict),
            None => {}
        }
        check_id("run id", &req.run_id.0)?;
        check_id("session", &req.session)?;
        check_id("conversation", &req.conversation)?;
        if req.ips.is_empty() || req.ips.len() > IP_SCOPES_MAX {
            return Err(LedgerError::Invalid("one to four address prefixes".into()));
        }
        for (i, ip) in req.ips.iter().enumerate() {
            check_id("address prefix", &ip.prefix)?;
            // The same prefix twice would be checked once but held twice (I1).
            if req.ips[..i].iter().any(|o| o.prefix == ip.prefix) {
                return Err(LedgerError::Invalid(
                    "address prefixes must be distinct".into(),
                ));
            }
        }
        if self.runs.contains_key(&req.run_id) {
            return Err(LedgerError::Invalid("run id already exists".into()));
        }
        if self.records_held() >= LEDGER_RECORDS_MAX {
            return Err(LedgerError::Full(LEDGER_RECORDS_MAX));
        }
        let outcome = match self.decide_run(policy, now, req) {
            Err(refusal) => {
                self.record_refusal(now, &refusal, None);
                Err(refusal)
            }
            Ok(plan) => Ok(self.apply_run(policy, now, req, plan)),
        };
        let remembered = idem.map(|_| IdempotentOutcome::Run(outcome.clone()));
        Ok(self.conclude(outcome, remembered, idem, now, policy.lease_ttl_ms, swept))
    }

    fn decide_run(
        &self,
        policy: &Policy,
        now: UnixMs,
        req: &RunRequest,
    ) -> Result<RunPlan, Refusal> {
        if let Some(refusal) = self.cutoff_refusal() {
            return Err(refusal);
        }
        let bounds = policy.run;
        if req.input_bytes > bounds.max_input_bytes {
            return Err(Refusal::new(
                RefusalCode::PayloadTooLarge,
                Some(ScopeKind::Run),
                format!(
                    "input of {} bytes is over the limit of {} bytes",
                    req.input_bytes, bounds.max_input_bytes
                ),
            ));
        }
        let scopes = run_scopes(&req.session, &req.ips, &req.conversation);
        // Rates: every scope with a rate, computed but not yet applied.
        let now_us = now.0.saturating_mul(1000);
        let mut tats = Vec::new();
        let mut rate_left: Option<RateLeft> = None;
        // The first refusal of a limit in dry-run (see `ScopePolicy::dry_run`).
        let mut dry_run: Option<Refusal> = None;
        for (scope, factor) in &scopes {
            let Some(p) = policy.for_kind(scope.kind) else {
                continue;
            };
            let Some(rate) = p.rate.map(|r| r.scaled(*factor)) else {
                continue;
            };
            let key = format!("run|{scope}");
            let tat = self.rates.get(&key).copied().unwrap_or(0);
            match rate.check(tat, now_us) {
                Ok(new_tat) => {
                    let (remaining, reset_s) = rate.left(new_tat, now_us);
                    let left = RateLeft {
                        scope: scope.kind,
                        remaining,
                        reset_s,
                    };
                    rate_left = Some(rate_left.map_or(left, |l| l.tighter(left)));
                    tats.push((key, new_tat));
                }
                Err(wait_us) => {
                    let refusal = Refusal::new(
                        RefusalCode::RateLimited,
                        Some(scope.kind),
                        format!("{} request rate exceeded", scope.kind.name()),
                    )
                    .retry_after(wait_us.div_ceil(1_000_000));
                    if !p.dry_run {
                        return Err(refusal);
                    }
                    // The rate's state stays: a refused request would not have moved it.
                    dry_run.get_or_insert(refusal);
                }
            }
        }
        let slots = self.run_slots(policy, &scopes, &mut dry_run)?;
        // Budgets: whole_run reserves the run's cost bound; per_step needs some room left.
        let counters = Self::budget_counters(policy, &scopes, now);
        let hold = match policy.mode {
            ReservationMode::WholeRun => bounds.max_cost,
            ReservationMode::PerStep => Micros(1),
        };
        if let Some(refusal) = self.check_budgets(policy, &counters, hold, now)? {
            dry_run.get_or_insert(refusal);
        }
        Ok(RunPlan {
            tats,
            rate_left,
            slots,
            counters,
            dry_run,
        })
    }

    /// The concurrency slots a run takes, one per scope with a cap; a scope at its cap
    /// refuses (in dry-run, the first such refusal is noted in `dry_run` instead).
    fn run_slots(
        &self,
        policy: &Policy,
        scopes: &[(ScopeKey, u64)],
        dry_run: &mut Option<Refusal>,
    ) -> Result<Vec<ScopeKey>, Refusal> {
        let mut slots = Vec::new();
        for (scope, factor) in scopes {
            let Some(p) = policy.for_kind(scope.kind) else {
                continue;
            };
            let Some(cap) = p.scaled(*factor).concurrency else {
                continue;
            };
            let held = self.slots.get(scope).copied().unwrap_or(0);
            if held >= cap {
                let refusal = Refusal::new(
                    RefusalCode::ConcurrencyLimited,
                    Some(scope.kind),
                    format!(
                        "{} already has {held} active run(s) (limit {cap})",
                        scope.kind.name()
                    ),
                )
                .retry_after(1);
                if !p.dry_run {
                    return Err(refusal);
                }
                dry_run.get_or_insert(refusal);
            }
            slots.push(scope.clone());
        }
        Ok(slots)
    }

    fn apply_run(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &RunRequest,
        plan: RunPlan,
    ) -> RunAdmitted {
        let bounds = policy.run;
        for (k, t) in plan.tats {
            self.rates.insert(k.clone(), t);
            self.touch(Entity::Rate(k));
        }
        for s in &plan.slots {
            *self.slots.entry(s.clone()).or_insert(0) += 1;
        }
        let deadline = now.plus_ms(bounds.max_seconds.saturating_mul(1000));
        let lease_until = now.plus_ms(policy.lease_ttl_ms).min(deadline);
        let mut run = Run {
            id: req.run_id.clone(),
            session: req.session.clone(),
            conversation: req.conversation.clone(),
            ips: req.ips.clone(),
            created: now,
            deadline,
            lease_until,
            rounds: 0,
            tool_calls: 0,
            retries: 0,
            state: RunState::Active,
            ended_at: None,
            slots: plan.slots,
            hold: None,
            bounds,
            mode: policy.mode,
            tally: RunTally {
                input_bytes: req.input_bytes,
                ..RunTally::default()
            },
        };
        let mut reserved = Micros::ZERO;
        if policy.mode == ReservationMode::WholeRun {
            let id = ReservationId(format!("{}.hold", req.run_id.0));
            self.hold(policy, &plan.counters, bounds.max_cost);
            reserved = bounds.max_cost;
            self.insert_reservation(Reservation {
                id: id.clone(),
                run_id: req.run_id.clone(),
                kind: ReservationKind::RunHold,
                amount: bounds.max_cost,
                counters: plan.counters.into_iter().map(|(k, _)| k).collect(),
                state: ReservationState::Held,
                charged: Micros::ZERO,
                created: now,
                resolved_at: None,
                max_output_tokens: None,
                overrun: false,
                result_too_large: false,
            });
            self.touch(Entity::Reservation(id.clone()));
            run.hold = Some(id);
        }
        self.timers
            .insert((lease_until, Timer::Lease(req.run_id.clone())));
        self.runs.insert(req.run_id.clone(), run);
        self.stats.runs_active += 1;
        self.touch(Entity::Run(req.run_id.clone()));
        RunAdmitted {
            run_id: req.run_id.clone(),
            deadline,
            reserved,
            bounds,
            rate_left: plan.rate_left,
            dry_run: plan.dry_run,
        }
    }

    pub(super) fn renew(&mut self, run_id: &RunId, now: UnixMs, ttl_ms: u64) -> Option<UnixMs> {
        let run = self.runs.get_mut(run_id)?;
        if run.state != RunState::Active {
            return None;
        }
        let new = now
            .plus_ms(ttl_ms)
            .min(run.deadline)
            .max(run.lease_until.min(run.deadline));
        if new != run.lease_until {
            self.timers
                .remove(&(run.lease_until, Timer::Lease(run_id.clone())));
            run.lease_until = new;
            self.timers.insert((new, Timer::Lease(run_id.clone())));
            self.touch(Entity::Run(run_id.clone()));
        }
        Some(new)
    }

    /// Ends a run: held steps become `unknown` (finish) or `expired` (lease ran out), both
    /// charged in full; the whole-run hold is reconciled; slots are freed.
    pub(super) fn end_run(&mut self, run_id: &RunId, now: UnixMs, end: RunState) {
        let Some(run) = self.runs.get(run_id) else {
            return;
        };
        debug_assert_eq!(run.state, RunState::Active);
        let (hold, slots) = (run.hold.clone(), run.slots.clone());
        let steps = self.run_steps.get(run_id).cloned().unwrap_or_default();
        let lease_until = run.lease_until;
        let step_end = if end == RunState::Expired {
            ReservationState::Expired
        } else {
            ReservationState::Unknown
        };
        for s in &steps {
            if self
                .reservations
                .get(s)
                .is_some_and(|r| r.state == ReservationState::Held)
            {
                let amount = self
                    .reservations
                    .get(s)
                    .map(|r| r.amount)
                    .unwrap_or_default();
                self.settle(s, step_end, amount, now, None);
            }
        }
        if let Some(h) = &hold {
            let run_used = self
                .runs
                .get(run_id)
                .map(|r| r.counter_key())
                .and_then(|k| self.counters.get(&k).map(|c| c.used));
            let amount = self
                .reservations
                .get(h)
                .map(|r| r.amount)
                .unwrap_or_default();
            let run_used = run_used.unwrap_or_default();
            if end == RunState::Expired {
                self.settle(
                    h,
                    ReservationState::Expired,
                    amount.max(run_used),
                    now,
                    None,
                );
            } else {
                self.settle(h, ReservationState::Committed, run_used, now, None);
            }
        }
        for s in &slots {
            if let Some(n) = self.slots.get_mut(s) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.slots.remove(s);
                }
            }
        }
        self.timers
            .remove(&(lease_until, Timer::Lease(run_id.clone())));
        self.timers.insert((
            now.plus_ms(RECORD_RETENTION_MS),
            Timer::Purge(run_id.clone()),
        ));
        if let Some(run) = self.runs.get_mut(run_id) {
            debug_assert_eq!(run.state, RunState::Active);
            run.state = end;
            self.stats.runs_active = self.stats.runs_active.saturating_sub(1);
            run.ended_at = Some(now);
        }
        self.touch(Entity::Run(run_id.clone()));
        self.record_run(run_id);
    }

    pub(super) fn purge_run(&mut self, run_id: &RunId) {
        let Some(run) = self.runs.remove(run_id) else {
            return;
        };
        debug_assert!(run.state != RunState::Active, "only ended runs are purged");
        let steps = self.run_steps.remove(run_id).unwrap_or_default();
        for s in steps.iter().chain(run.hold.iter()) {
            if let Some(r) = self.reservations.remove(s) {
                self.stats.count(&r, false);
            }
            self.touch(Entity::Reservation(s.clone()));
        }
        let ck = run.counter_key();
        self.counters.remove(&ck);
        self.touch(Entity::Counter(ck));
        self.touch(Entity::Run(run_id.clone()));
    }

    /// Extends a run's lease (and so its reservations' and slots') by one TTL, never past
    /// its deadline.
    pub fn heartbeat(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        run_id: &RunId,
    ) -> Result<Applied<Heartbeat>, LedgerError> {
        let (now, swept) = self.advance_for(now, run_id);
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", run_id.0)))?;
        if run.state != RunState::Active {
            return Err(LedgerError::RunClosed(run.state));
        }
        let before = run.lease_until;
        let lease_until = self
            .renew(run_id, now, policy.lease_ttl_ms)
            .unwrap_or(before);
        let deadline = self
            .runs
            .get(run_id)
            .map(|r| r.deadline)
            .unwrap_or(lease_until);
        let changed = swept || lease_until != before;
        if changed {
            self.bump();
        }
        Ok(self.answer(
            Heartbeat {
                lease_until,
                deadline,
            },
            changed,
        ))
    }

    /// Ends a run: held steps are charged in full as `unknown`, the whole-run hold is
    /// reconciled, slots are freed. Idempotent: a run already ended (finished, or expired
    /// with its lease) is answered as it ended, `repeated`.
    pub fn finish(
        &mut self,
        _policy: &Policy,
        now: UnixMs,
        run_id: &RunId,
    ) -> Result<Applied<RunEnded>, LedgerError> {
        let (now, swept) = self.advance_for(now, run_id);
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", run_id.0)))?;
        // A run that expired was ended by its lease: finishing it again repeats that end, with
        // what it was charged, so the caller learns the run's cost whichever came first.
        let repeated = run.state != RunState::Active;
        if !repeated {
            self.end_run(run_id, now, RunState::Finished);
            self.bump();
        }
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", run_id.0)))?;
        let charged = self.run_charged(run);
        let value = RunEnded {
            state: run.state,
            charged,
            budgets_charged: self.budgets_charged(run),
            steps: self.steps_of(run_id).len() as u32,
            repeated,
        };
        Ok(self.answer(value, swept || !repeated))
    }

    /// A run's step reservations (its whole-run hold is not one).
    pub(super) fn steps_of(&self, run_id: &RunId) -> &[ReservationId] {
        self.run_steps.get(run_id).map_or(&[], Vec::as_slice)
    }

    pub(super) fn run_charged(&self, run: &Run) -> Micros {
        self.steps_of(&run.id)
            .iter()
            .filter_map(|s| self.reservations.get(s))
            .fold(Micros::ZERO, |a, r| a.add_capped(r.charged))
    }
}

struct RunPlan {
    tats: Vec<(String, u64)>,
    rate_left: Option<RateLeft>,
    slots: Vec<ScopeKey>,
    counters: Vec<(CounterKey, Micros)>,
    dry_run: Option<Refusal>,
}
