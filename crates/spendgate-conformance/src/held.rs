//! A refusal caused by the holds of calls in flight is a wait, not a spent budget (issue 18,
//! finding 7): when used spend alone would admit a request, the refusal is `budget_held` with
//! a `Retry-After` of `HELD_RETRY_AFTER_S` (within any lease), and the request is admitted once
//! the holds resolve; a spent budget stays `budget_exhausted` until its window resets, and is
//! named before a held one.

use crate::support::{
    admit, admit_refused, check_ledger, day, finish, held_refusal, micros_step, policy, reserve,
    reserve_refused, resolve, seq, units, Who, SECS_TO_MIDNIGHT, START,
};
use crate::Backend;
use spendgate_core::{Micros, RefusalCode, ReservationMode, Resolution, ScopeKind};

/// Per-step mode, a global day budget of 0.10 and session day budgets of 0.07.
pub async fn i1_a_refusal_by_holds_is_a_wait(b: &dyn Backend) {
    let mut p = policy();
    p.global.budgets = vec![day(100_000)];
    p.session.budgets = vec![day(70_000)];
    let s = b.open(p.clone(), START).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    let w3 = Who::new("s3", "c3", "192.0.2.3/32");
    let w4 = Who::new("s4", "c4", "192.0.2.4/32");

    // A hold of 0.06 in flight: 0.05 more is refused by it (0 used + 0.05 fits), a wait.
    admit(&s, w1.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 60_000)).await;
    admit(&s, w2.run("r2")).await;
    let before = (seq(&s).await, check_ledger(&s, &w2.scopes()).await);
    let r = reserve_refused(&s, micros_step("r2", "b", 50_000)).await;
    held_refusal(&r, ScopeKind::Global);
    assert_eq!(
        (seq(&s).await, check_ledger(&s, &w2.scopes()).await),
        before,
        "a refusal changes nothing"
    );
    // The hold ends at 0.03: the same request, retried, is admitted.
    resolve(&s, "a", units(30_000)).await;
    reserve(&s, micros_step("r2", "b", 50_000)).await;
    // 0.03 used + 0.05 held: 0.021 more is held (0.03 + 0.021 fits), 0.071 is spent.
    let r = reserve_refused(&s, micros_step("r2", "c", 21_000)).await;
    held_refusal(&r, ScopeKind::Global);
    let r = reserve_refused(&s, micros_step("r2", "c", 71_000)).await;
    assert_eq!(
        (r.code, r.scope, r.retry_after_s),
        (
            RefusalCode::BudgetExhausted,
            Some(ScopeKind::Global),
            Some(SECS_TO_MIDNIGHT)
        ),
        "used spend alone leaves no room: spent until midnight: {r:?}"
    );

    for w in [&w1, &w2] {
        check_ledger(&s, &w.scopes()).await;
    }

    // Session s2 spends its 0.07; then s3 holds the rest of the global budget.
    let s = b.open(p, START).await;
    admit(&s, w2.run("r2")).await;
    reserve(&s, micros_step("r2", "b", 70_000)).await;
    resolve(&s, "b", units(70_000)).await;
    finish(&s, "r2").await;
    admit(&s, w3.run("r3")).await;
    reserve(&s, micros_step("r3", "e", 30_000)).await;
    // s2 again: its spent session is named before the held global budget (checked first),
    // with its wait to midnight.
    let w2b = Who::new("s2", "c2b", "192.0.2.2/32");
    let r = admit_refused(&s, w2b.run("r2b")).await;
    assert_eq!(
        (r.code, r.scope, r.retry_after_s),
        (
            RefusalCode::BudgetExhausted,
            Some(ScopeKind::Session),
            Some(SECS_TO_MIDNIGHT)
        ),
        "a spent budget is named before a held one: {r:?}"
    );
    // A run of s4 (nothing spent) is refused up front by the held global budget: a wait,
    // never "exhausted" (per_step's run check).
    let r = admit_refused(&s, w4.run("r4")).await;
    held_refusal(&r, ScopeKind::Global);
    // The hold is released: s4 is admitted, s2 still is not.
    resolve(&s, "e", Resolution::Release).await;
    admit(&s, w4.run("r4")).await;
    let r = admit_refused(&s, w2b.run("r2c")).await;
    assert_eq!(r.code, RefusalCode::BudgetExhausted, "{r:?}");
    for w in [&w2, &w3, &w4] {
        check_ledger(&s, &w.scopes()).await;
    }
}

/// The run's own cost bound: while its own steps in flight hold it, a step that used spend
/// alone would admit is a wait (`budget_held`, scope `run`); once spent, it is
/// `run_bound_exceeded` (never worth a retry).
pub async fn i5_a_run_bound_held_by_its_own_steps_is_a_wait(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_cost = Micros(10_000);
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 6_000)).await;
    let r = reserve_refused(&s, micros_step("r1", "b", 5_000)).await;
    held_refusal(&r, ScopeKind::Run);
    resolve(&s, "a", units(4_000)).await;
    reserve(&s, micros_step("r1", "b", 5_000)).await;
    resolve(&s, "b", units(5_000)).await;
    let r = reserve_refused(&s, micros_step("r1", "c", 2_000)).await;
    assert_eq!(
        (r.code, r.scope, r.retry_after_s),
        (RefusalCode::RunBoundExceeded, Some(ScopeKind::Run), None),
        "{r:?}"
    );
    check_ledger(&s, &w.scopes()).await;
}

/// Whole-run mode: a run's admission reserves its cost bound; one refused only by other
/// runs' holds is a wait, and is admitted once they end.
pub async fn whole_run_admission_held_by_other_runs_is_a_wait(b: &dyn Backend) {
    let mut p = policy();
    p.mode = ReservationMode::WholeRun;
    p.global.budgets = vec![day(100_000)];
    p.run.max_cost = Micros(60_000);
    let s = b.open(p, START).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s2", "c2", "192.0.2.2/32");
    let w3 = Who::new("s3", "c3", "192.0.2.3/32");
    admit(&s, w1.run("r1")).await;
    let r = admit_refused(&s, w2.run("r2")).await;
    held_refusal(&r, ScopeKind::Global);
    // r1 ends having spent 0.04: r2's bound of 0.06 fits.
    reserve(&s, micros_step("r1", "a", 40_000)).await;
    resolve(&s, "a", units(40_000)).await;
    finish(&s, "r1").await;
    admit(&s, w2.run("r2")).await;
    let r = admit_refused(&s, w3.run("r3")).await;
    held_refusal(&r, ScopeKind::Global);
    // r2 ends having spent 0.02: 0.04 left, less than a run's bound: spent.
    reserve(&s, micros_step("r2", "b", 20_000)).await;
    resolve(&s, "b", units(20_000)).await;
    finish(&s, "r2").await;
    let r = admit_refused(&s, w3.run("r3")).await;
    assert_eq!(
        (r.code, r.scope, r.retry_after_s),
        (
            RefusalCode::BudgetExhausted,
            Some(ScopeKind::Global),
            Some(SECS_TO_MIDNIGHT)
        ),
        "{r:?}"
    );
    for w in [&w1, &w2, &w3] {
        check_ledger(&s, &w.scopes()).await;
    }
}
