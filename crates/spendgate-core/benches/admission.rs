//! Core admission benchmarks: the pure decision over 5 scopes, and a whole ledger
//! reserve + commit pair (5 scopes: global, ip, session, conversation, run).
//!
//! Run: `cargo bench -p spendgate-core --bench admission`

use criterion::{criterion_group, criterion_main, Criterion};
use spendgate_core::{
    decide, Budget, BudgetView, IpScope, Ledger, Micros, Policy, ReservationId, Resolution, RunId,
    RunRequest, ScopeKind, Settlement, StepKind, StepRequest, ToolPrice, UnixMs, Window,
    MICROS_MAX,
};
use std::hint::black_box;
use std::time::Instant;

fn views() -> [BudgetView; 5] {
    let kinds = [
        ScopeKind::Global,
        ScopeKind::Ip,
        ScopeKind::Session,
        ScopeKind::Conversation,
        ScopeKind::Run,
    ];
    kinds.map(|scope| BudgetView {
        scope,
        limit: Micros(50_000_000),
        used: Micros(1_234_567),
        reserved: Micros(89_000),
        overrun: false,
        resets_at: Some(UnixMs(1_796_083_200_000)),
    })
}

fn policy() -> Policy {
    let mut p = Policy::default();
    for sp in [
        &mut p.global,
        &mut p.ip,
        &mut p.session,
        &mut p.conversation,
    ] {
        sp.rate = None;
        sp.concurrency = None;
        sp.budgets = vec![Budget::new(Micros(MICROS_MAX.0 / 2), Window::Day)];
    }
    p.run.max_tool_calls = u32::MAX;
    p.run.max_cost = Micros(MICROS_MAX.0 / 2);
    p.run.max_seconds = 1_000_000;
    p
}

/// Percentiles of one call, timed one by one (includes the ~20 ns of reading the clock).
fn percentiles(mut f: impl FnMut()) -> (f64, u128, u128) {
    const N: usize = 200_000;
    let mut samples = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_nanos());
    }
    samples.sort_unstable();
    let mean = samples.iter().sum::<u128>() as f64 / N as f64;
    (mean, samples[N / 2], samples[N * 99 / 100])
}

fn bench(c: &mut Criterion) {
    let v = views();
    let now = UnixMs(1_796_042_096_000);
    c.bench_function("core/decide_5_scopes", |b| {
        b.iter(|| decide(black_box(&v), black_box(Micros(10_000)), black_box(now)))
    });
    let (mean, p50, p99) = percentiles(|| {
        let _ = black_box(decide(
            black_box(&v),
            black_box(Micros(10_000)),
            black_box(now),
        ));
    });
    println!("core/decide_5_scopes timed singly: mean {mean:.0} ns, p50 {p50} ns, p99 {p99} ns");

    let policy = policy();
    let mut ledger = Ledger::new();
    let run = RunRequest {
        run_id: RunId("run_bench".into()),
        session: "s".into(),
        ips: vec![IpScope {
            prefix: "192.0.2.0/32".into(),
            factor: 1,
        }],
        conversation: "c".into(),
        input_bytes: 1,
    };
    let mut t = now;
    ledger
        .admit_run(&policy, t, &run, None)
        .expect("admit")
        .value
        .expect("admitted");
    let tool = ToolPrice {
        per_call: Micros(10_000),
        per_unit: Micros(0),
    };
    let mut i = 0u64;
    let mut pair = move || {
        i += 1;
        t = t.plus_ms(0);
        let step = ReservationId(format!("s{i}"));
        let req = StepRequest {
            run_id: RunId("run_bench".into()),
            step_id: step.clone(),
            kind: StepKind::Tool {
                tool: "t".into(),
                price: tool,
                units: 0,
            },
        };
        let r = ledger
            .reserve_step(&policy, t, &req, None)
            .expect("reserve");
        assert!(r.value.is_ok());
        ledger
            .resolve(&policy, t, &step, Resolution::Commit(Settlement::Units(0)))
            .expect("commit");
    };
    c.bench_function("core/ledger_reserve_commit_pair_5_scopes", |b| {
        b.iter(&mut pair)
    });
    let (mean, p50, p99) = percentiles(&mut pair);
    println!("core/ledger_reserve_commit_pair_5_scopes timed singly: mean {mean:.0} ns, p50 {p50} ns, p99 {p99} ns");
}

criterion_group!(benches, bench);
criterion_main!(benches);
