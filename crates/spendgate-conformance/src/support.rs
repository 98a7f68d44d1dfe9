//! Shared vocabulary of the cases: the start time, prices, a policy to vary, request builders,
//! expectations that unwrap answers with a useful message, and the ledger-wide invariant check.

use spendgate_core::{
    Applied, Budget, CounterKey, Heartbeat, IpScope, LedgerError, Micros, ModelPrice, Policy,
    Refusal, RefusalCode, Reservation, ReservationId, ReservationKind, ReservationMode,
    ReservationState, Resolution, Resolved, RunAdmitted, RunBounds, RunEnded, RunId, RunRequest,
    ScopeKey, ScopeKind, ScopePolicy, Settlement, StepKind, StepRequest, StepReserved, Summary,
    TokenUsage, ToolPrice, UnixMs, UsageLine, Window, HELD_RETRY_AFTER_S,
};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;

/// 2026-11-30T12:00:00Z: every case starts here.
pub const START: UnixMs = UnixMs(1_796_040_000_000);
/// 2026-12-01T00:00:00Z: the first day boundary after [`START`].
pub const MIDNIGHT: UnixMs = UnixMs(1_796_083_200_000);
/// Seconds from [`START`] to [`MIDNIGHT`]: the `Retry-After` of a spent day budget at START.
pub const SECS_TO_MIDNIGHT: u64 = 43_200;
/// Upper bound on reservations listed by [`check_ledger`].
pub const LIST_MAX: usize = 100_000;

/// One micro per prompt token, two per output token, half a micro per cached token.
pub const MODEL_PRICE: ModelPrice = ModelPrice {
    input_per_million: Micros(1_000_000),
    cached_input_per_million: Micros(500_000),
    output_per_million: Micros(2_000_000),
};
/// 0.01 per call.
pub const TOOL_PER_CALL: ToolPrice = ToolPrice {
    per_call: Micros(10_000),
    per_unit: Micros(0),
};
/// One micro per unit: a tool step of `n` units costs exactly `n` micros.
pub const TOOL_PER_UNIT: ToolPrice = ToolPrice {
    per_call: Micros(0),
    per_unit: Micros(1),
};

/// A day budget of `micros`.
pub fn day(micros: u64) -> Budget {
    Budget::new(Micros(micros), Window::Day)
}

/// A policy with room everywhere, to be narrowed by each case: a global day budget of 100.00,
/// no ip/session/conversation budgets, no rates, one active run per conversation, generous
/// run bounds, per-step reservations, a 30 s lease.
pub fn policy() -> Policy {
    Policy {
        global: ScopePolicy {
            budgets: vec![day(100_000_000)],
            rate: None,
            concurrency: None,
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        ip: ScopePolicy::default(),
        session: ScopePolicy::default(),
        conversation: ScopePolicy {
            budgets: vec![],
            rate: None,
            concurrency: Some(1),
            dry_run: false,
            rate_dry_run: false,
            concurrency_dry_run: false,
        },
        run: RunBounds {
            max_input_bytes: 16_384,
            max_context_tokens: 100_000,
            max_output_tokens: 10_000,
            max_tool_result_bytes: 65_536,
            max_model_rounds: 1000,
            max_tool_calls: 1000,
            max_retries: 1000,
            max_seconds: 600,
            max_cost: Micros(100_000_000),
            shrink_to_fit: false,
            min_output_tokens: 1,
        },
        mode: ReservationMode::PerStep,
        lease_ttl_ms: 30_000,
        session_create_per_ip: None,
        session_create_global: None,
    }
}

/// Who a run is for: session, conversation and client address prefix.
#[derive(Clone, Debug)]
pub struct Who {
    pub session: String,
    pub conversation: String,
    pub ip: String,
}

impl Who {
    pub fn new(session: &str, conversation: &str, ip: &str) -> Who {
        Who {
            session: session.into(),
            conversation: conversation.into(),
            ip: ip.into(),
        }
    }

    /// The run request of run `run` with 100 bytes of input.
    pub fn run(&self, run: &str) -> RunRequest {
        RunRequest {
            run_id: RunId(run.into()),
            session: self.session.clone(),
            ips: vec![IpScope {
                prefix: self.ip.clone(),
                factor: 1,
            }],
            conversation: self.conversation.clone(),
            input_bytes: 100,
        }
    }

    /// Every scope of this identity, in the order usage reports them.
    pub fn scopes(&self) -> Vec<(ScopeKey, u64)> {
        vec![
            (ScopeKey::global(), 1),
            (ScopeKey::new(ScopeKind::Ip, self.ip.clone()), 1),
            (ScopeKey::new(ScopeKind::Session, self.session.clone()), 1),
            (
                ScopeKey::new(ScopeKind::Conversation, self.conversation.clone()),
                1,
            ),
        ]
    }
}

pub fn run_id(id: &str) -> RunId {
    RunId(id.into())
}

pub fn step_id(id: &str) -> ReservationId {
    ReservationId(id.into())
}

/// A model step priced at [`MODEL_PRICE`].
pub fn model_step(run: &str, step: &str, prompt: u64, max_out: Option<u64>) -> StepRequest {
    StepRequest {
        run_id: run_id(run),
        step_id: step_id(step),
        kind: StepKind::Model {
            model: "m".into(),
            price: MODEL_PRICE,
            prompt_tokens: prompt,
            max_output_tokens: max_out,
            retry: false,
        },
    }
}

/// A retry of a model step priced at [`MODEL_PRICE`].
pub fn retry_step(run: &str, step: &str, prompt: u64, max_out: Option<u64>) -> StepRequest {
    let mut s = model_step(run, step, prompt, max_out);
    if let StepKind::Model { retry, .. } = &mut s.kind {
        *retry = true;
    }
    s
}

/// A tool step of `price` and `units`.
pub fn tool_step(run: &str, step: &str, price: ToolPrice, units: u64) -> StepRequest {
    StepRequest {
        run_id: run_id(run),
        step_id: step_id(step),
        kind: StepKind::Tool {
            tool: "t".into(),
            price,
            units,
        },
    }
}

/// A step costing exactly `micros` (a per-unit tool).
pub fn micros_step(run: &str, step: &str, micros: u64) -> StepRequest {
    tool_step(run, step, TOOL_PER_UNIT, micros)
}

pub fn tokens(prompt: u64, completion: u64) -> Resolution {
    Resolution::Commit(Settlement::Tokens(TokenUsage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: 0,
    }))
}

pub fn units(n: u64) -> Resolution {
    Resolution::Commit(Settlement::Units(n))
}

/// Admits a run, panicking on a refusal or error.
pub async fn admit(s: &Arc<dyn Store>, req: RunRequest) -> Applied<RunAdmitted> {
    let a = s
        .admit_run(req.clone(), None)
        .await
        .unwrap_or_else(|e| panic!("admit {req:?}: store error {e}"));
    match a.value {
        Ok(v) => Applied {
            value: v,
            seq: a.seq,
            changed: a.changed,
        },
        Err(r) => panic!("admit {:?} refused: {r:?}", req.run_id),
    }
}

/// Asks to admit a run that must be refused; returns the refusal.
pub async fn admit_refused(s: &Arc<dyn Store>, req: RunRequest) -> Refusal {
    let a = s
        .admit_run(req.clone(), None)
        .await
        .unwrap_or_else(|e| panic!("admit {req:?}: store error {e}"));
    match a.value {
        Ok(v) => panic!(
            "admit {:?} must be refused, was admitted: {v:?}",
            req.run_id
        ),
        Err(r) => r,
    }
}

/// Reserves a step, panicking on a refusal or error.
pub async fn reserve(s: &Arc<dyn Store>, req: StepRequest) -> StepReserved {
    let a = s
        .reserve_step(req.clone(), None)
        .await
        .unwrap_or_else(|e| panic!("reserve {req:?}: store error {e}"));
    match a.value {
        Ok(v) => v,
        Err(r) => panic!("reserve {:?} refused: {r:?}", req.step_id),
    }
}

/// Asks to reserve a step that must be refused; returns the refusal.
pub async fn reserve_refused(s: &Arc<dyn Store>, req: StepRequest) -> Refusal {
    let a = s
        .reserve_step(req.clone(), None)
        .await
        .unwrap_or_else(|e| panic!("reserve {req:?}: store error {e}"));
    match a.value {
        Ok(v) => panic!(
            "reserve {:?} must be refused, was granted: {v:?}",
            req.step_id
        ),
        Err(r) => r,
    }
}

/// Resolves a step, panicking on an error.
pub async fn resolve(s: &Arc<dyn Store>, step: &str, how: Resolution) -> Applied<Resolved> {
    s.resolve(step_id(step), how)
        .await
        .unwrap_or_else(|e| panic!("resolve {step} {how:?}: {e}"))
}

/// Resolves a step that must be refused as closed; returns the ledger error.
pub async fn resolve_err(s: &Arc<dyn Store>, step: &str, how: Resolution) -> LedgerError {
    match s.resolve(step_id(step), how).await {
        Ok(v) => panic!("resolve {step} {how:?} must fail, answered {v:?}"),
        Err(StoreError::Ledger(e, _)) => e,
        Err(e) => panic!("resolve {step} {how:?}: store error {e}"),
    }
}

pub async fn finish(s: &Arc<dyn Store>, run: &str) -> Applied<RunEnded> {
    s.finish(run_id(run))
        .await
        .unwrap_or_else(|e| panic!("finish {run}: {e}"))
}

pub async fn heartbeat(s: &Arc<dyn Store>, run: &str) -> Applied<Heartbeat> {
    s.heartbeat(run_id(run))
        .await
        .unwrap_or_else(|e| panic!("heartbeat {run}: {e}"))
}

pub async fn sweep(s: &Arc<dyn Store>) -> Applied<usize> {
    s.sweep().await.unwrap_or_else(|e| panic!("sweep: {e}"))
}

pub async fn seq(s: &Arc<dyn Store>) -> u64 {
    summary(s).await.seq
}

pub async fn summary(s: &Arc<dyn Store>) -> Summary {
    s.summary().await.unwrap_or_else(|e| panic!("summary: {e}"))
}

pub async fn usage(s: &Arc<dyn Store>, scopes: &[(ScopeKey, u64)]) -> Vec<UsageLine> {
    s.usage(scopes.to_vec())
        .await
        .unwrap_or_else(|e| panic!("usage: {e}"))
}

/// The usage line of scope `kind` (the first, if several windows apply).
pub fn line(lines: &[UsageLine], kind: ScopeKind) -> &UsageLine {
    lines
        .iter()
        .find(|l| l.scope.kind == kind)
        .unwrap_or_else(|| panic!("no {kind:?} line in {lines:?}"))
}

/// `(used, reserved)` of the line of scope `kind`.
pub fn ur(lines: &[UsageLine], kind: ScopeKind) -> (u64, u64) {
    let l = line(lines, kind);
    (l.used.0, l.reserved.0)
}

pub async fn reservation(s: &Arc<dyn Store>, id: &str) -> Reservation {
    reservations(s)
        .await
        .into_iter()
        .find(|r| r.id.0 == id)
        .unwrap_or_else(|| panic!("reservation {id} not listed"))
}

pub async fn reservations(s: &Arc<dyn Store>) -> Vec<Reservation> {
    s.reservations(None, LIST_MAX)
        .await
        .unwrap_or_else(|e| panic!("reservations: {e}"))
}

/// Checks I1 and I2 as far as the store's answers show them, for the budget counters of
/// `scopes` in the current windows:
/// - every usage line has `used + reserved <= limit`, unless an overrun was charged to it;
/// - `reserved` is the sum of the held reservations on that counter, and `used` the sum of the
///   charges of the resolved ones (no adjustments are made by the suite);
/// - every reservation's charge fits its state (released: zero; unknown and expired: at least
///   the amount, exactly it for steps; held: nothing charged yet; overrun iff charged above
///   the amount).
///
/// Returns the usage lines.
pub async fn check_ledger(s: &Arc<dyn Store>, scopes: &[(ScopeKey, u64)]) -> Vec<UsageLine> {
    let lines = usage(s, scopes).await;
    let all = reservations(s).await;
    check_lines(&lines, &all);
    lines
}

/// The pure part of [`check_ledger`]; panics on the first violation.
pub fn check_lines(lines: &[UsageLine], all: &[Reservation]) {
    if let Err(e) = lines_hold(lines, all) {
        panic!("{e}");
    }
}

/// The pure part of [`check_ledger`]: the first violation, if any.
pub fn lines_hold(lines: &[UsageLine], all: &[Reservation]) -> Result<(), String> {
    for l in lines {
        let key = CounterKey {
            scope: l.scope.clone(),
            window: l.window,
        };
        let (mut charged, mut held, mut overran) = (0u64, 0u64, false);
        for r in all.iter().filter(|r| r.counters.contains(&key)) {
            if r.state == ReservationState::Held {
                held += r.amount.0;
            } else {
                charged += r.charged.0;
            }
            overran |= r.overrun;
        }
        // The one exception: an overrun (charged above its hold) may take the counter past
        // its limit; it is then marked, or its charge is visible as an overrun.
        if !l.overrun && !overran && l.used.0 + l.reserved.0 > l.limit.0 {
            return Err(format!("I1: used + reserved > limit on {l:?}"));
        }
        if l.reserved.0 != held {
            return Err(format!(
                "I2: reserved on {key:?} is {} but its held reservations sum to {held}",
                l.reserved.0
            ));
        }
        if l.used.0 != charged {
            return Err(format!(
                "I2: used on {key:?} is {} but the charges of its resolved reservations sum to {charged}",
                l.used.0
            ));
        }
    }
    for r in all {
        let step = r.kind != ReservationKind::RunHold;
        let ok = match r.state {
            ReservationState::Held => r.charged == Micros::ZERO,
            ReservationState::Released => r.charged == Micros::ZERO,
            ReservationState::Committed => r.overrun == (r.charged > r.amount),
            // (a step above its amount: a late overrun, flagged as one)
            ReservationState::Unknown | ReservationState::Expired => {
                r.charged >= r.amount && (!step || r.overrun == (r.charged > r.amount))
            }
        };
        if !ok {
            return Err(format!(
                "I2: reservation charge does not fit its state: {r:?}"
            ));
        }
    }
    Ok(())
}

/// Asserts a refusal by the holds of calls in flight (`budget_held`): used spend alone would
/// admit, so it is a short wait (`HELD_RETRY_AFTER_S`), not a spent budget.
pub fn held_refusal(r: &Refusal, scope: ScopeKind) {
    assert_eq!(
        (r.code, r.scope, r.retry_after_s),
        (
            RefusalCode::BudgetHeld,
            Some(scope),
            Some(HELD_RETRY_AFTER_S)
        ),
        "a budget that holds refuse is a wait of {HELD_RETRY_AFTER_S} s: {r:?}"
    );
}
