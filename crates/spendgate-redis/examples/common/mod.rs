//! What the Redis examples (`opbench`, `opcount`) share.

use spendgate_core::{
    Budget, Micros, Policy, Rate, ReservationId, RunId, StepKind, StepRequest, ToolPrice, Window,
};
use spendgate_redis::{ClockSource, InitMode, RedisOptions, RedisStore};
use std::time::Duration;

/// A store on the server at `url` under `prefix`: its ledger created when there is none
/// (`InitMode::Routine`), then opened with `policy`; calls bounded by `timeout`.
pub async fn open_store(
    url: &str,
    prefix: &str,
    timeout: Duration,
    policy: Policy,
) -> Result<RedisStore, String> {
    let opts = RedisOptions {
        url: url.to_string(),
        prefix: prefix.to_string(),
        timeout,
        slow_grace: Duration::ZERO,
        clock: ClockSource::Server,
        ledger_id: None,
        witness: None,
    };
    let ledger = RedisStore::init(&opts, InitMode::Routine)
        .await
        .map_err(|e| e.to_string())?;
    let opts = RedisOptions {
        ledger_id: Some(ledger.ledger().to_string()),
        ..opts
    };
    RedisStore::open(opts, policy)
        .await
        .map_err(|e| e.to_string())
}

/// The policy of a measurement: limits that never refuse. `full`: every scope keeps its kinds
/// of limits (five counters a step); `bench`: one global day budget and nothing else.
pub fn policy(kind: &str) -> Policy {
    let mut p = Policy::default();
    let big = Rate {
        count: 1_000_000,
        period_ms: 1000,
        burst: 1_000_000,
    };
    for sp in [
        &mut p.global,
        &mut p.ip,
        &mut p.session,
        &mut p.conversation,
    ] {
        if sp.rate.is_some() {
            sp.rate = Some(big);
        }
        if sp.concurrency.is_some() {
            sp.concurrency = Some(100_000);
        }
        for b in &mut sp.budgets {
            b.amount = Micros(1_000_000_000_000);
        }
    }
    if kind == "bench" {
        p.global.budgets = vec![Budget::new(Micros(1_000_000_000_000), Window::Day)];
        p.ip.budgets.clear();
        p.ip.concurrency = None;
        p.session.budgets.clear();
        p.session.concurrency = None;
        p.conversation.budgets.clear();
        p.conversation.rate = None;
        p.conversation.concurrency = None;
    }
    p.run.max_tool_calls = 64;
    p.run.max_seconds = 3600;
    p.run.max_cost = Micros(1_000_000_000_000);
    p
}

/// The measured step: a tool call of 1 micro.
pub fn tool_step(run: &RunId, step: ReservationId) -> StepRequest {
    StepRequest {
        run_id: run.clone(),
        step_id: step,
        kind: StepKind::Tool {
            tool: "bench_tool".into(),
            price: ToolPrice {
                per_call: Micros(1),
                per_unit: Micros::ZERO,
            },
            units: 0,
        },
    }
}
