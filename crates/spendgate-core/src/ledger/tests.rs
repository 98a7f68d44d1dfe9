//! Unit tests of the ledger as a whole (each module tests its own parts beside it).

use super::*;
use crate::money::{Micros, ToolPrice};
use crate::rate::Rate;
use crate::scope::{Budget, IpScope, Policy, ScopeKey, ScopeKind};
use crate::window::{UnixMs, Window};

fn policy() -> Policy {
    let rate = |count, burst| {
        Some(Rate {
            count,
            period_ms: 60_000,
            burst,
        })
    };
    let mut p = Policy::default();
    p.global.rate = rate(600, 100);
    p.ip.rate = rate(60, 10);
    p.session.rate = rate(6, 3);
    p.global.concurrency = None;
    p.ip.concurrency = None;
    p.session.concurrency = None;
    p.conversation.concurrency = None;
    p
}

fn req(run: &str, conversation: &str) -> RunRequest {
    RunRequest {
        run_id: RunId(run.into()),
        session: "s1".into(),
        ips: vec![IpScope {
            prefix: "192.0.2.1".into(),
            factor: 1,
        }],
        conversation: conversation.into(),
        input_bytes: 10,
    }
}

fn admit(l: &mut Ledger, p: &Policy, now: UnixMs, run: &str) -> Result<RunAdmitted, Refusal> {
    l.admit_run(p, now, &req(run, run), None)
        .expect("valid request")
        .value
}

/// A run's steps are not in its record: a ledger restored from its records lists them
/// again from the reservations, so a finish after a restart settles every held step.
#[test]
fn a_restored_ledger_lists_each_runs_steps() {
    let p = policy();
    let mut l = Ledger::new();
    let now = UnixMs(1_000);
    let tool = |run: &str, step: &str| StepRequest {
        run_id: RunId(run.into()),
        step_id: ReservationId(step.into()),
        kind: StepKind::Tool {
            tool: "t".into(),
            price: ToolPrice {
                per_call: Micros(10),
                per_unit: Micros(0),
            },
            units: 1,
        },
    };
    for (run, steps) in [("a", 3), ("b", 1), ("c", 0)] {
        admit(&mut l, &p, now, run).expect("admitted");
        for i in 0..steps {
            let r = l.reserve_step(&p, now, &tool(run, &format!("{run}.{i}")), None);
            r.expect("valid").value.expect("reserved");
        }
    }
    l.check_invariants().expect("invariants");
    let mut restored = Ledger::restore(l.records(), false);
    restored
        .check_invariants()
        .expect("invariants after restore");
    for (run, steps) in [("a", 3), ("b", 1), ("c", 0)] {
        let ended = restored
            .finish(&p, now, &RunId(run.into()))
            .expect("finish");
        assert_eq!(ended.value.steps, steps, "run {run}");
        assert_eq!(
            ended.value.charged,
            Micros(10 * u64::from(steps)),
            "run {run}"
        );
    }
    assert!(restored
        .reservations(None, 100)
        .iter()
        .all(|r| r.state == ReservationState::Unknown));
    restored
        .check_invariants()
        .expect("invariants after finish");
}

/// A backlog of expiries larger than one sweep's bound is worked off over several sweeps.
#[test]
fn a_sweep_expires_a_bounded_number() {
    let mut p = policy();
    for sp in [
        &mut p.global,
        &mut p.ip,
        &mut p.session,
        &mut p.conversation,
    ] {
        sp.rate = None;
        sp.budgets.clear();
    }
    let mut l = Ledger::new();
    let runs = SWEEP_EXPIRIES_MAX + 10;
    for i in 0..runs {
        admit(&mut l, &p, UnixMs(1_000), &format!("r{i}")).expect("admitted");
    }
    let later = UnixMs(1_000 + p.lease_ttl_ms + 1);
    let first = l.sweep(later).value;
    assert!(first >= SWEEP_EXPIRIES_MAX, "{first}");
    let active = |l: &Ledger| {
        l.runs
            .values()
            .filter(|r| r.state == RunState::Active)
            .count()
    };
    assert_eq!(active(&l), 10, "one sweep expired exactly its bound");
    l.sweep(later);
    assert_eq!(active(&l), 0);
}

#[test]
fn admission_reports_the_tightest_rate_scope() {
    let p = policy();
    let mut l = Ledger::new();
    let now = UnixMs(1_700_000_000_000);
    let mut seen = Vec::new();
    for run in ["r1", "r2", "r3"] {
        let a = admit(&mut l, &p, now, run).expect("within burst");
        seen.push(a.rate_left.expect("session has a rate"));
    }
    // Session: 6/minute (one unit per 10 s), burst 3.
    let left = |remaining| RateLeft {
        scope: ScopeKind::Session,
        remaining,
        reset_s: 10,
    };
    assert_eq!(seen, [left(2), left(1), left(0)]);
    let refused = admit(&mut l, &p, now, "r4").expect_err("burst spent");
    assert_eq!(refused.code, RefusalCode::RateLimited);
    assert_eq!(refused.retry_after_s, Some(10));
    // 2.5 s later: 7.5 s until the next unit, rounded up.
    let later = UnixMs(now.0 + 12_500);
    let a = admit(&mut l, &p, later, "r5").expect("one unit regained");
    assert_eq!(
        a.rate_left,
        Some(RateLeft {
            scope: ScopeKind::Session,
            remaining: 0,
            reset_s: 8,
        })
    );
}

#[test]
fn admission_without_rates_reports_none_and_ties_take_the_longer_reset() {
    let mut p = policy();
    p.global.rate = None;
    p.ip.rate = None;
    p.session.rate = None;
    let mut l = Ledger::new();
    let now = UnixMs(1_700_000_000_000);
    let a = admit(&mut l, &p, now, "r1").expect("admitted");
    assert_eq!(a.rate_left, None);
    // Same burst left on ip and session; the ip's unit comes back later.
    p.ip.rate = Some(Rate {
        count: 1,
        period_ms: 60_000,
        burst: 2,
    });
    p.session.rate = Some(Rate {
        count: 2,
        period_ms: 60_000,
        burst: 2,
    });
    let a = admit(&mut l, &p, now, "r2").expect("admitted");
    assert_eq!(
        a.rate_left,
        Some(RateLeft {
            scope: ScopeKind::Ip,
            remaining: 1,
            reset_s: 60,
        })
    );
}

/// An operator's adjustment sees a wider address prefix's scaled limit (a credit does not
/// close it as overrun), and records what it applied (a credit stops at zero), so that
/// used = charges + adjustments holds (I2).
#[test]
fn adjustments_keep_the_scaled_limit_and_record_what_they_applied() {
    let mut p = policy();
    p.ip.budgets = vec![Budget::new(Micros(1_000_000), Window::Day)];
    let now = UnixMs(1_700_000_000_000);
    let wide = ScopeKey::new(ScopeKind::Ip, "2001:db8::/48");
    let mut l = Ledger::new();
    // The /48 has spent 2.00 of its 16 × 1.00.
    let charged = l
        .adjust(&p, now, &wide, 16, 2_000_000, None)
        .expect("charge");
    assert_eq!(charged.value.lines[0].limit, Micros(16_000_000));
    let credited = l.adjust(&p, now, &wide, 16, -1, None).expect("credit");
    let line = &credited.value.lines[0];
    assert_eq!(
        (line.limit, line.used, line.overrun),
        (Micros(16_000_000), Micros(1_999_999), false)
    );
    let mut r = req("r1", "c1");
    r.ips.push(IpScope {
        prefix: wide.id.clone(),
        factor: 16,
    });
    let admitted = l.admit_run(&p, now, &r, None).expect("valid").value;
    assert!(admitted.is_ok(), "the /48 still has room: {admitted:?}");

    // A credit larger than what was used takes it to zero and records only that.
    let session = ScopeKey::new(ScopeKind::Session, "s9");
    p.session.budgets = p.ip.budgets.clone();
    l.adjust(&p, now, &session, 1, 300, None).expect("charge");
    let line = l
        .adjust(&p, now, &session, 1, -1_000, None)
        .expect("credit")
        .value
        .lines[0]
        .clone();
    assert_eq!(line.used, Micros(0));
    let counter = l
        .counters
        .iter()
        .find(|(k, _)| k.scope == session)
        .map(|(_, c)| *c)
        .expect("counter");
    assert_eq!(counter.adjusted, 0, "+300 then -300 applied");
    l.check_invariants().expect("I1 and I2 hold");
}
