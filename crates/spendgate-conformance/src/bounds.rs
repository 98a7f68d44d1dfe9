//! I5 bounded runs: rounds, tool calls, retries, deadline, context, output, input, cost, and
//! shrinking the output bound to fit.

use crate::support::{
    admit, admit_refused, check_ledger, day, finish, held_refusal, micros_step, model_step, policy,
    reservation, reserve, reserve_refused, resolve, retry_step, seq, summary, tool_step, units, ur,
    Who, START, TOOL_PER_CALL,
};
use crate::Backend;
use spendgate_core::{Micros, Refusal, RefusalCode, Resolution, ScopeKind};

fn run_bound(r: &Refusal) {
    assert_eq!(r.code, RefusalCode::RunBoundExceeded, "{r:?}");
    assert_eq!(r.scope, Some(ScopeKind::Run), "{r:?}");
}

/// Model rounds, retries and tool calls are counted per run, each against its own bound; a
/// released step still counted as an attempt; other runs are unaffected.
pub async fn i5_rounds_tools_and_retries(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_model_rounds = 2;
    p.run.max_tool_calls = 2;
    p.run.max_retries = 1;
    let s = b.open(p, START).await;
    admit(&s, Who::new("s1", "c1", "192.0.2.1/32").run("r1")).await;
    reserve(&s, model_step("r1", "m1", 10, None)).await;
    reserve(&s, model_step("r1", "m2", 10, None)).await;
    let before = seq(&s).await;
    run_bound(&reserve_refused(&s, model_step("r1", "m3", 10, None)).await);
    assert_eq!(seq(&s).await, before, "a refusal changes nothing");
    // Retries count against retries, not rounds.
    reserve(&s, retry_step("r1", "x1", 10, None)).await;
    run_bound(&reserve_refused(&s, retry_step("r1", "x2", 10, None)).await);
    reserve(&s, tool_step("r1", "t1", TOOL_PER_CALL, 0)).await;
    reserve(&s, tool_step("r1", "t2", TOOL_PER_CALL, 0)).await;
    run_bound(&reserve_refused(&s, tool_step("r1", "t3", TOOL_PER_CALL, 0)).await);
    // Resolving a step gives its attempt back to no one.
    resolve(&s, "m1", Resolution::Release).await;
    resolve(&s, "t1", Resolution::Release).await;
    run_bound(&reserve_refused(&s, model_step("r1", "m4", 10, None)).await);
    run_bound(&reserve_refused(&s, tool_step("r1", "t4", TOOL_PER_CALL, 0)).await);
    // Bounds are per run.
    admit(&s, Who::new("s1", "c2", "192.0.2.1/32").run("r2")).await;
    reserve(&s, model_step("r2", "r2.m1", 10, None)).await;
    reserve(&s, tool_step("r2", "r2.t1", TOOL_PER_CALL, 0)).await;
    reserve(&s, retry_step("r2", "r2.x1", 10, None)).await;
    check_ledger(&s, &Who::new("s1", "c2", "192.0.2.1/32").scopes()).await;
}

/// Steps up to the deadline are admitted; at the deadline they are refused.
pub async fn i5_deadline_refuses_steps(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_seconds = 20;
    let s = b.open(p, START).await;
    let a = admit(&s, Who::new("s1", "c1", "192.0.2.1/32").run("r1")).await;
    assert_eq!(a.value.deadline, START.plus_ms(20_000));
    b.advance(19_999);
    reserve(&s, micros_step("r1", "a", 100)).await;
    b.advance(1);
    run_bound(&reserve_refused(&s, micros_step("r1", "b", 100)).await);
    check_ledger(&s, &Who::new("s1", "c1", "192.0.2.1/32").scopes()).await;
}

/// The prompt is bounded (refused, never truncated); the output bound is clamped to the run's
/// bound and inserted when absent, and the reservation is priced at it.
pub async fn i5_context_and_output_tokens(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_context_tokens = 1000;
    p.run.max_output_tokens = 100;
    let s = b.open(p, START).await;
    admit(&s, Who::new("s1", "c1", "192.0.2.1/32").run("r1")).await;
    let before = seq(&s).await;
    let r = reserve_refused(&s, model_step("r1", "big", 1001, None)).await;
    assert_eq!(r.code, RefusalCode::ContextTooLarge, "{r:?}");
    assert_eq!(r.scope, Some(ScopeKind::Run), "{r:?}");
    assert_eq!(seq(&s).await, before);
    let g = reserve(&s, model_step("r1", "a", 1000, None)).await;
    assert_eq!(
        (g.max_output_tokens, g.reserved, g.shrunk),
        (Some(100), Micros(1000 + 200), false),
        "absent: the run's bound is inserted"
    );
    let g = reserve(&s, model_step("r1", "b", 10, Some(500))).await;
    assert_eq!(
        (g.max_output_tokens, g.reserved),
        (Some(100), Micros(10 + 200)),
        "above the bound: clamped to it"
    );
    let g = reserve(&s, model_step("r1", "c", 10, Some(50))).await;
    assert_eq!(
        (g.max_output_tokens, g.reserved),
        (Some(50), Micros(10 + 100)),
        "below the bound: kept"
    );
    assert_eq!(reservation(&s, "a").await.max_output_tokens, Some(100));
    let lines = check_ledger(&s, &Who::new("s1", "c1", "192.0.2.1/32").scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 1200 + 210 + 110));
}

/// Input above `max_input_bytes` is refused at admission as too large; at the bound it is
/// admitted.
pub async fn i5_input_bytes(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_input_bytes = 1000;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let before = seq(&s).await;
    let mut req = w.run("r1");
    req.input_bytes = 1001;
    let r = admit_refused(&s, req).await;
    assert_eq!(r.code, RefusalCode::PayloadTooLarge, "{r:?}");
    assert_eq!(r.scope, Some(ScopeKind::Run), "{r:?}");
    assert_eq!(seq(&s).await, before);
    let mut req = w.run("r1");
    req.input_bytes = 1000;
    admit(&s, req).await;
    assert_eq!(summary(&s).await.runs_active, 1);
}

/// Held and charged steps together never exceed the run's cost bound; released holds give
/// their room back.
pub async fn i5_run_max_cost(b: &dyn Backend) {
    let mut p = policy();
    p.run.max_cost = Micros(10_000);
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "a", 4_000)).await;
    reserve(&s, micros_step("r1", "b", 4_000)).await;
    // Refused by the run's own holds, with room in its used spend: a wait (the hold of b is
    // released below, and the same step fits).
    let r = reserve_refused(&s, micros_step("r1", "c", 4_000)).await;
    held_refusal(&r, ScopeKind::Run);
    resolve(&s, "b", Resolution::Release).await;
    reserve(&s, micros_step("r1", "c2", 4_000)).await;
    resolve(&s, "a", units(4_000)).await;
    held_refusal(
        &reserve_refused(&s, micros_step("r1", "d", 2_001)).await,
        ScopeKind::Run,
    );
    reserve(&s, micros_step("r1", "d2", 2_000)).await;
    resolve(&s, "c2", units(4_000)).await;
    resolve(&s, "d2", units(2_000)).await;
    // Spent: retrying never helps a run bound.
    let r = reserve_refused(&s, micros_step("r1", "e", 1)).await;
    run_bound(&r);
    assert_eq!(
        r.retry_after_s, None,
        "retrying never helps a spent run bound"
    );
    let f = finish(&s, "r1").await.value;
    assert_eq!(f.charged, Micros(10_000));
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (10_000, 0));

    // A step no run can fit is over the run's bound (400, never retried), even when it is
    // also larger than a scope's whole budget: that budget is not spent (nothing to wait for).
    let mut p = policy();
    p.run.max_cost = Micros(10_000);
    p.session.budgets = vec![day(50_000)];
    let s = b.open(p, START).await;
    admit(&s, w.run("r2")).await;
    let r = reserve_refused(&s, micros_step("r2", "huge", 60_000)).await;
    run_bound(&r);
    assert_eq!(r.retry_after_s, None);
    check_ledger(&s, &w.scopes()).await;
}

/// With `shrink_to_fit`, a model step whose full output bound does not fit gets the largest
/// output bound that does, if that is at least `min_output_tokens`; below it, it is refused.
pub async fn i5_shrink_to_fit(b: &dyn Backend) {
    let mut p = policy();
    p.session.budgets = vec![day(5_000)];
    p.run.shrink_to_fit = true;
    p.run.min_output_tokens = 10;
    p.run.max_output_tokens = 100;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "t", 3_900)).await;
    // 1_100 left: 1000 prompt + 2 × 50 output.
    let g = reserve(&s, model_step("r1", "m", 1000, None)).await;
    assert_eq!(
        (g.shrunk, g.max_output_tokens, g.reserved),
        (true, Some(50), Micros(1_100))
    );
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (0, 5_000));
    // (held, not spent: nothing is used yet)
    let r = reserve_refused(&s, model_step("r1", "m2", 1000, None)).await;
    held_refusal(&r, ScopeKind::Session);
    resolve(&s, "m", Resolution::Release).await;
    resolve(&s, "t", Resolution::Release).await;
    // 1_015 left: 7 output tokens fit, fewer than the minimum of 10.
    reserve(&s, micros_step("r1", "t2", 3_985)).await;
    let r = reserve_refused(&s, model_step("r1", "m3", 1000, None)).await;
    held_refusal(&r, ScopeKind::Session);
    resolve(&s, "t2", Resolution::Release).await;
    let g = reserve(&s, model_step("r1", "m4", 1000, None)).await;
    assert_eq!(
        (g.shrunk, g.max_output_tokens, g.reserved),
        (false, Some(100), Micros(1_200))
    );
    check_ledger(&s, &w.scopes()).await;
}
