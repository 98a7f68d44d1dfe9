//! Concurrent hammering of one budget: atomic admission grants exactly what fits, never more,
//! and refuses nothing that fits.

use crate::support::{
    admit, check_ledger, day, finish, held_refusal, micros_step, policy, reserve, resolve, summary,
    tool_step, units, ur, Who, START, TOOL_PER_CALL,
};
use crate::Backend;
use spendgate_core::{Micros, Policy, RefusalCode, ScopeKind};
use spendgate_store::Store;
use std::sync::Arc;
use tokio::sync::Barrier;

/// Tasks hammering the budget at once.
const TASKS: usize = 16;
/// Reservations racing for the last cent.
const RACERS: usize = 100;

fn hammer_policy() -> Policy {
    let mut p = policy();
    p.global.budgets = vec![day(1_000_000)];
    p
}

/// Attempts one task makes at most (grants, and refusals by other tasks' holds).
const ATTEMPTS_MAX: u32 = 10_000;

/// Reserves 0.01 steps and commits each at its reservation until the budget is spent; a
/// refusal by other tasks' holds (`budget_held`) is a wait: tried again. Returns the grants.
async fn spend_until_refused(s: Arc<dyn Store>, task: usize, start: Arc<Barrier>) -> u64 {
    let run = format!("run-{task}");
    let who = Who::new(
        &format!("session-{task}"),
        &format!("conversation-{task}"),
        &format!("10.0.0.{task}/32"),
    );
    admit(&s, who.run(&run)).await;
    start.wait().await;
    let mut granted = 0;
    for n in 0..=ATTEMPTS_MAX {
        assert!(n < ATTEMPTS_MAX, "task {task} was never refused");
        let step = format!("{run}.{n}");
        let a = s
            .reserve_step(tool_step(&run, &step, TOOL_PER_CALL, 0), None)
            .await
            .unwrap_or_else(|e| panic!("reserve {step}: {e}"));
        match a.value {
            Ok(g) => {
                assert_eq!(g.reserved, Micros(10_000));
                let c = resolve(&s, &step, units(0)).await.value;
                assert_eq!((c.charged, c.repeated), (Micros(10_000), false));
                granted += 1;
            }
            Err(r) if r.code == RefusalCode::BudgetHeld => {
                held_refusal(&r, ScopeKind::Global);
                tokio::task::yield_now().await;
            }
            Err(r) => {
                assert_eq!(
                    (r.code, r.scope),
                    (RefusalCode::BudgetExhausted, Some(ScopeKind::Global)),
                    "the only other refusal is the spent global budget: {r:?}"
                );
                break;
            }
        }
    }
    finish(&s, &run).await;
    granted
}

/// 16 tasks, each with its own session and run, spend one global budget of 1.00 in steps of
/// 0.01: exactly 100 are granted in total, and the budget ends spent to the micro.
pub async fn hammer_one_budget(b: &dyn Backend) {
    let s = b.open(hammer_policy(), START).await;
    let start = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| tokio::spawn(spend_until_refused(s.clone(), t, start.clone())))
        .collect();
    let mut total = 0;
    for t in futures::future::join_all(tasks).await {
        total += t.expect("task panicked");
    }
    assert_eq!(
        total, 100,
        "exactly the budget is granted: no more, no less"
    );
    let w = Who::new("session-0", "conversation-0", "10.0.0.0/32");
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (1_000_000, 0));
    let sum = summary(&s).await;
    assert_eq!(
        (sum.charged_micros, sum.held_micros, sum.runs_active),
        (Micros(1_000_000), Micros(0), 0)
    );
}

/// With 0.01 left, 100 concurrent reservations of 0.01: exactly one is granted.
pub async fn hammer_last_cent(b: &dyn Backend) {
    let s = b.open(hammer_policy(), START).await;
    let w = Who::new("s0", "c0", "10.0.0.0/32");
    admit(&s, w.run("r0")).await;
    reserve(&s, micros_step("r0", "r0.a", 990_000)).await;
    resolve(&s, "r0.a", units(990_000)).await;
    finish(&s, "r0").await;

    let admissions: Vec<_> = (0..RACERS)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                let who = Who::new(&format!("s{i}"), &format!("c{i}"), "10.0.1.0/32");
                admit(&s, who.run(&format!("run-{i}"))).await;
            })
        })
        .collect();
    for a in futures::future::join_all(admissions).await {
        a.expect("admission task panicked");
    }
    let start = Arc::new(Barrier::new(RACERS));
    let racers: Vec<_> = (0..RACERS)
        .map(|i| {
            let (s, start) = (s.clone(), start.clone());
            tokio::spawn(async move {
                let run = format!("run-{i}");
                start.wait().await;
                let step = tool_step(&run, &format!("{run}.last"), TOOL_PER_CALL, 0);
                s.reserve_step(step, None)
                    .await
                    .unwrap_or_else(|e| panic!("reserve: {e}"))
                    .value
            })
        })
        .collect();
    let mut granted = 0;
    for r in futures::future::join_all(racers).await {
        match r.expect("racer panicked") {
            Ok(g) => {
                assert_eq!(g.reserved, Micros(10_000));
                granted += 1;
            }
            // (the last cent is held, 0.99 used: a wait, in case the grant is released)
            Err(r) => held_refusal(&r, ScopeKind::Global),
        }
    }
    assert_eq!(granted, 1, "exactly one racer gets the last cent");
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (990_000, 10_000));
}
