//! Reserving one paid step of a run.

use super::error::{check_id, LedgerError};
use super::messages::{
    Applied, IdempotencyKey, IdempotentOutcome, StepKind, StepRequest, StepReserved,
};
use super::model::{CounterKey, Reservation, ReservationKind, ReservationState, Run, RunState};
use super::records::Entity;
use super::refusal::{Refusal, RefusalCode};
use super::{Ledger, LEDGER_RECORDS_MAX};
use crate::money::Micros;
use crate::scope::{Policy, ReservationMode, ScopeKind};
use crate::window::UnixMs;

impl Ledger {
    /// Reserves one paid step of a run against every scope (per_step) or against the run's
    /// hold (whole_run), after checking the run's bounds.
    pub fn reserve_step(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &StepRequest,
        idem: Option<&IdempotencyKey>,
    ) -> Result<Applied<Result<StepReserved, Refusal>>, LedgerError> {
        let (now, swept) = self.advance_for(now, &req.run_id);
        match self.recall(idem)? {
            Some(IdempotentOutcome::Step(o)) => return Ok(self.answer(o, swept)),
            Some(_) => return Err(LedgerError::IdempotencyConflict),
            None => {}
        }
        check_id("step id", &req.step_id.0)?;
        if self.reservations.contains_key(&req.step_id) {
            return Err(LedgerError::Invalid("step id already exists".into()));
        }
        let run = self
            .runs
            .get(&req.run_id)
            .ok_or_else(|| LedgerError::NotFound(format!("run {}", req.run_id.0)))?;
        if self.records_held() >= LEDGER_RECORDS_MAX {
            return Err(LedgerError::Full(LEDGER_RECORDS_MAX));
        }
        let outcome = match self.decide_step(policy, now, run, req) {
            Err(refusal) => {
                self.record_refusal(now, &refusal, Some(&req.run_id));
                Err(refusal)
            }
            Ok(plan) => Ok(self.apply_step(policy, now, req, plan)),
        };
        let remembered = idem.map(|_| IdempotentOutcome::Step(outcome.clone()));
        Ok(self.conclude(outcome, remembered, idem, now, policy.lease_ttl_ms, swept))
    }

    /// Whether the step may be reserved, and what against: the run's state and bounds, the
    /// cutoff, then every counter it touches (shrinking a model step's output bound to fit,
    /// when the run allows it).
    fn decide_step(
        &self,
        policy: &Policy,
        now: UnixMs,
        run: &Run,
        req: &StepRequest,
    ) -> Result<StepPlan, Refusal> {
        match run.state {
            RunState::Active => {}
            RunState::Finished => return Err(bound_refusal("run is finished".into())),
            RunState::Expired => {
                return Err(bound_refusal("run deadline or lease has passed".into()))
            }
        }
        if now >= run.deadline {
            return Err(bound_refusal("run deadline has passed".into()));
        }
        if let Some(refusal) = self.cutoff_refusal() {
            return Err(refusal);
        }
        let (amount, max_out, counter_kind) = step_cost(run, &req.kind)?;
        // The run's own cost bound first: a step it can never fit is refused as over the
        // run's bound (400), not as a spent scope budget to retry after its window.
        let run_counter = (run.counter_key(), run.bounds.max_cost);
        let counters = match run.mode {
            ReservationMode::PerStep => {
                let mut c = vec![run_counter];
                c.extend(Self::budget_counters(policy, &run.scope_keys(), now));
                c
            }
            ReservationMode::WholeRun => vec![run_counter],
        };
        let plan = StepPlan {
            amount,
            max_out,
            shrunk: false,
            counters,
            counter_kind,
            dry_run: None,
        };
        match self.check_budgets(policy, &plan.counters, amount, now) {
            Ok(dry_run) => Ok(StepPlan { dry_run, ..plan }),
            Err(refusal) => match self.shrink_to_fit(policy, now, run, &req.kind, plan)? {
                Some(shrunk) => Ok(shrunk),
                None => Err(over_run_bound(refusal, run.bounds.max_cost)),
            },
        }
    }

    /// `shrink_to_fit`: a model step that does not fit, with its output bound lowered to what
    /// the tightest counter allows, when the run allows it and that is at least its
    /// `min_output_tokens`. `None`: it cannot be shrunk to fit.
    fn shrink_to_fit(
        &self,
        policy: &Policy,
        now: UnixMs,
        run: &Run,
        kind: &StepKind,
        plan: StepPlan,
    ) -> Result<Option<StepPlan>, Refusal> {
        let b = run.bounds;
        let StepKind::Model {
            price,
            prompt_tokens,
            ..
        } = kind
        else {
            return Ok(None);
        };
        if !b.shrink_to_fit {
            return Ok(None);
        }
        // Only enforced limits bound the output (a limit in dry-run never refuses).
        let room = plan
            .counters
            .iter()
            .filter(|(k, _)| !policy.dry_run(k.scope.kind))
            .map(|(k, l)| self.counter_view(k, *l).remaining())
            .min()
            .unwrap_or_default();
        let Some(fit) = price.max_output_within(*prompt_tokens, room) else {
            return Ok(None);
        };
        let fit = fit.min(plan.max_out.unwrap_or(0));
        if fit < b.min_output_tokens {
            return Ok(None);
        }
        let amount = price.bound(*prompt_tokens, fit);
        let dry_run = self.check_budgets(policy, &plan.counters, amount, now)?;
        Ok(Some(StepPlan {
            amount,
            max_out: Some(fit),
            shrunk: true,
            dry_run,
            ..plan
        }))
    }

    fn apply_step(
        &mut self,
        policy: &Policy,
        now: UnixMs,
        req: &StepRequest,
        plan: StepPlan,
    ) -> StepReserved {
        self.hold(policy, &plan.counters, plan.amount);
        let kind = match &req.kind {
            StepKind::Model {
                model,
                price,
                retry,
                ..
            } => ReservationKind::Model {
                model: model.clone(),
                price: *price,
                retry: *retry,
            },
            StepKind::Tool { tool, price, units } => ReservationKind::Tool {
                tool: tool.clone(),
                price: *price,
                units: *units,
            },
        };
        self.insert_reservation(Reservation {
            id: req.step_id.clone(),
            run_id: req.run_id.clone(),
            kind,
            amount: plan.amount,
            counters: plan.counters.into_iter().map(|(k, _)| k).collect(),
            state: ReservationState::Held,
            charged: Micros::ZERO,
            created: now,
            resolved_at: None,
            max_output_tokens: plan.max_out,
            overrun: false,
            result_too_large: false,
        });
        self.touch(Entity::Reservation(req.step_id.clone()));
        if let Some(run) = self.runs.get_mut(&req.run_id) {
            match plan.counter_kind {
                StepCounter::Model(true) => run.retries += 1,
                StepCounter::Model(false) => run.rounds += 1,
                StepCounter::Tool => run.tool_calls += 1,
            }
            if let StepKind::Model { prompt_tokens, .. } = &req.kind {
                run.tally.context_tokens = run.tally.context_tokens.max(*prompt_tokens);
            }
            self.run_steps
                .entry(req.run_id.clone())
                .or_default()
                .push(req.step_id.clone());
        }
        self.touch(Entity::Run(req.run_id.clone()));
        self.renew(&req.run_id, now, policy.lease_ttl_ms);
        StepReserved {
            step_id: req.step_id.clone(),
            reserved: plan.amount,
            max_output_tokens: plan.max_out,
            shrunk: plan.shrunk,
            dry_run: plan.dry_run,
        }
    }
}

#[derive(Clone, Copy)]
enum StepCounter {
    Model(bool),
    Tool,
}

struct StepPlan {
    amount: Micros,
    max_out: Option<u64>,
    shrunk: bool,
    counters: Vec<(CounterKey, Micros)>,
    counter_kind: StepCounter,
    dry_run: Option<Refusal>,
}

/// A refusal by one of the run's own bounds.
fn bound_refusal(message: String) -> Refusal {
    Refusal::new(RefusalCode::RunBoundExceeded, Some(ScopeKind::Run), message)
}

/// What the step would hold, its output bound and which of the run's counts it takes, once
/// the run's bounds on those counts and on the context allow it.
fn step_cost(run: &Run, kind: &StepKind) -> Result<(Micros, Option<u64>, StepCounter), Refusal> {
    let b = run.bounds;
    match kind {
        StepKind::Model {
            price,
            prompt_tokens,
            max_output_tokens,
            retry,
            ..
        } => {
            if *retry && run.retries >= b.max_retries {
                return Err(bound_refusal(format!(
                    "run already used its {} retries",
                    b.max_retries
                )));
            }
            if !*retry && run.rounds >= b.max_model_rounds {
                return Err(bound_refusal(format!(
                    "run already used its {} model rounds",
                    b.max_model_rounds
                )));
            }
            if *prompt_tokens > b.max_context_tokens {
                return Err(Refusal::new(
                    RefusalCode::ContextTooLarge,
                    Some(ScopeKind::Run),
                    format!(
                        "prompt of {prompt_tokens} tokens is over the context limit of {} tokens",
                        b.max_context_tokens
                    ),
                ));
            }
            let out = max_output_tokens
                .unwrap_or(b.max_output_tokens)
                .min(b.max_output_tokens);
            Ok((
                price.bound(*prompt_tokens, out),
                Some(out),
                StepCounter::Model(*retry),
            ))
        }
        StepKind::Tool { price, units, .. } => {
            if run.tool_calls >= b.max_tool_calls {
                return Err(bound_refusal(format!(
                    "run already used its {} tool calls",
                    b.max_tool_calls
                )));
            }
            Ok((price.cost(*units), None, StepCounter::Tool))
        }
    }
}

/// A step the run's own counter refuses as spent is over the run's cost bound (a 400, not a
/// budget to retry after its window). (A run bound its own steps in flight hold is a wait:
/// `budget_held`.)
fn over_run_bound(mut refusal: Refusal, max_cost: Micros) -> Refusal {
    if refusal.scope == Some(ScopeKind::Run) && refusal.code == RefusalCode::BudgetExhausted {
        refusal.code = RefusalCode::RunBoundExceeded;
        refusal.message = format!("run cost bound of {max_cost} reached");
        refusal.retry_after_s = None;
    }
    refusal
}
