//! I6 leases: a run's slots and holds are leases; a lapsed lease frees the slots and charges
//! the holds in full; heartbeats (and calls on the run) extend it, never past the deadline;
//! `finish` ends a run at once.

use crate::support::{
    admit, admit_refused, check_ledger, finish, heartbeat, micros_step, model_step, policy,
    reservation, reserve, reserve_refused, resolve, run_id, seq, step_id, summary, sweep,
    tool_step, units, ur, Who, START, TOOL_PER_CALL,
};
use crate::Backend;
use spendgate_core::{
    Command, LedgerError, Micros, RefusalCode, Reply, ReservationState, RunEnded, RunState,
    ScopeKind, EXPIRIES_PER_CALL_MAX,
};
use spendgate_store::{Store, StoreError};
use std::sync::Arc;

/// Heartbeat of a run that must have ended; the ledger's sequence number when the call
/// changed it first (the run's lease ran out and this call expired it).
async fn heartbeat_closed(s: &Arc<dyn Store>, run: &str, state: RunState) -> Option<u64> {
    match s.heartbeat(run_id(run)).await {
        Err(StoreError::Ledger(LedgerError::RunClosed(st), seq)) => {
            assert_eq!(st, state);
            seq
        }
        other => panic!("heartbeat of {state:?} run {run} answered {other:?}"),
    }
}

/// Finish of an expired run: answered as the expired run it is, with what it was charged, as a
/// repeat; it charges nothing more.
async fn finish_expired(s: &Arc<dyn Store>, run: &str, charged: u64) {
    match s.finish(run_id(run)).await {
        Ok(a) if a.value.state == RunState::Expired && a.value.repeated => {
            assert_eq!(a.value.charged, Micros(charged), "{a:?}");
        }
        other => panic!("finish of expired run {run} answered {other:?}"),
    }
}

/// A run that stops heartbeating: once its lease ran out (and a sweep ran), its held steps are
/// expired and charged in full, its finished ones stand, and its conversation slot is free.
pub async fn i6_expired_lease_charges_and_frees(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, model_step("r1", "h", 100, Some(100))).await;
    reserve(&s, micros_step("r1", "t", 1_000)).await;
    resolve(&s, "t", units(600)).await;
    let r = admit_refused(&s, w.run("r2")).await;
    assert_eq!(
        (r.code, r.scope),
        (
            RefusalCode::ConcurrencyLimited,
            Some(ScopeKind::Conversation)
        )
    );

    b.advance(10_001);
    let before = seq(&s).await;
    let sw = sweep(&s).await;
    assert!(
        sw.value >= 1 && sw.changed,
        "the sweep expired a run: {sw:?}"
    );
    assert!(sw.seq > before, "an expiry is a change of the ledger");
    let h = reservation(&s, "h").await;
    assert_eq!(
        (h.state, h.charged),
        (ReservationState::Expired, Micros(300))
    );
    let t = reservation(&s, "t").await;
    assert_eq!(
        (t.state, t.charged),
        (ReservationState::Committed, Micros(600))
    );
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (900, 0));
    assert_eq!(summary(&s).await.runs_active, 0);

    admit(&s, w.run("r3")).await;
    heartbeat_closed(&s, "r1", RunState::Expired).await;
    let r = reserve_refused(&s, micros_step("r1", "late", 1)).await;
    assert_eq!(
        (r.code, r.scope),
        (RefusalCode::RunBoundExceeded, Some(ScopeKind::Run))
    );
    finish_expired(&s, "r1", 900).await;
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (900, 0));
}

/// A heartbeat moves the lease to one TTL from now; so does every reservation on the run.
pub async fn i6_heartbeat_extends_lease(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let a = admit(&s, w.run("r1")).await.value;
    reserve(&s, micros_step("r1", "h", 500)).await;
    b.advance(5_000);
    let hb = heartbeat(&s, "r1").await.value;
    assert_eq!(hb.lease_until, START.plus_ms(15_000));
    assert_eq!(hb.deadline, a.deadline);
    b.advance(5_000);
    sweep(&s).await;
    assert_eq!(
        reservation(&s, "h").await.state,
        ReservationState::Held,
        "the heartbeat kept the run alive past its first lease"
    );
    // A step renews the lease too: to START + 20 s.
    reserve(&s, micros_step("r1", "h2", 500)).await;
    b.advance(9_999);
    sweep(&s).await;
    assert_eq!(summary(&s).await.runs_active, 1);
    b.advance(1);
    sweep(&s).await;
    assert_eq!(summary(&s).await.runs_active, 0);
    for id in ["h", "h2"] {
        let r = reservation(&s, id).await;
        assert_eq!(
            (r.state, r.charged),
            (ReservationState::Expired, Micros(500))
        );
    }
    check_ledger(&s, &w.scopes()).await;
}

/// The lease ends with the deadline at the latest, whatever heartbeats and steps ask.
pub async fn i6_lease_never_extends_past_deadline(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    p.run.max_seconds = 15;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let a = admit(&s, w.run("r1")).await.value;
    assert_eq!(a.deadline, START.plus_ms(15_000));
    b.advance(8_000);
    let hb = heartbeat(&s, "r1").await.value;
    assert_eq!(hb.lease_until, a.deadline, "capped at the deadline");
    b.advance(6_999);
    reserve(&s, micros_step("r1", "h", 700)).await;
    let hb = heartbeat(&s, "r1").await.value;
    assert_eq!(hb.lease_until, a.deadline);
    b.advance(1);
    sweep(&s).await;
    let h = reservation(&s, "h").await;
    assert_eq!(
        (h.state, h.charged),
        (ReservationState::Expired, Micros(700))
    );
    heartbeat_closed(&s, "r1", RunState::Expired).await;
    admit(&s, w.run("r2")).await;
    check_ledger(&s, &w.scopes()).await;
}

/// `finish` makes every held step `unknown` (charged in full), frees the run's slots at once,
/// and is idempotent.
pub async fn i6_finish_resolves_held_steps(b: &dyn Backend) {
    let s = b.open(policy(), START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, model_step("r1", "m", 100, Some(100))).await;
    reserve(&s, tool_step("r1", "t", TOOL_PER_CALL, 0)).await;
    reserve(&s, micros_step("r1", "c", 1_000)).await;
    resolve(&s, "c", units(400)).await;
    let f = finish(&s, "r1").await;
    let want = RunEnded {
        state: RunState::Finished,
        charged: Micros(300 + 10_000 + 400),
        budgets_charged: Micros(300 + 10_000 + 400),
        steps: 3,
        repeated: false,
    };
    assert_eq!(f.value, want);
    for (id, amount) in [("m", 300), ("t", 10_000)] {
        let r = reservation(&s, id).await;
        assert_eq!(
            (r.state, r.charged),
            (ReservationState::Unknown, Micros(amount))
        );
    }
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (10_700, 0));
    assert_eq!(summary(&s).await.runs_active, 0);

    let again = finish(&s, "r1").await;
    assert_eq!(
        again.value,
        RunEnded {
            repeated: true,
            ..want
        }
    );
    assert_eq!(again.seq, f.seq, "a repeated finish changes nothing");
    heartbeat_closed(&s, "r1", RunState::Finished).await;
    let r = reserve_refused(&s, micros_step("r1", "late", 1)).await;
    assert_eq!(
        (r.code, r.scope),
        (RefusalCode::RunBoundExceeded, Some(ScopeKind::Run))
    );
    admit(&s, w.run("r2")).await;
    check_ledger(&s, &w.scopes()).await;
}

/// A call on a run whose lease ran out sees the run expired even when more timers are due
/// than one call processes (`EXPIRIES_PER_CALL_MAX`) and no sweep has run: a late commit is
/// refused and its step stays charged in full, a late step, heartbeat or finish finds the run
/// expired, and the run's conversation slot is free.
pub async fn i6_a_lapsed_lease_is_seen_behind_a_backlog_of_timers(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    let s = b.open(p, START).await;
    let who: Vec<Who> = (1..=4)
        .map(|i| Who::new("s1", &format!("c{i}"), "192.0.2.1/32"))
        .collect();
    for (i, w) in who.iter().enumerate() {
        admit(&s, w.run(&format!("r{}", i + 1))).await;
    }
    reserve(&s, micros_step("r1", "h1", 1_000)).await;
    reserve(&s, micros_step("r4", "h4", 1_000)).await;
    // Single-use keys due long before the leases: more than four calls' worth of expiries.
    let keys = EXPIRIES_PER_CALL_MAX * 4 + 8;
    let cmds = (0..keys)
        .map(|i| Command::ConsumeOnce {
            key: format!("backlog-{i}"),
            ttl_ms: 1,
        })
        .collect();
    for a in s.execute_many(cmds).await {
        assert!(
            matches!(&a, Ok(Reply::Consumed(c)) if c.value),
            "single-use key: {a:?}"
        );
    }
    b.advance(10_001);

    // The refusal comes from a call that expired the run first: it says where the ledger
    // stands after that change (SPEC: every answer that changed the ledger carries its seq).
    let before = s.summary().await.expect("summary").seq;
    let changed_at = match s.resolve(step_id("h1"), units(1)).await {
        Err(StoreError::Ledger(
            LedgerError::Closed {
                state: ReservationState::Expired,
                charged,
            },
            seq,
        )) => {
            assert_eq!(charged, Micros(1_000));
            seq
        }
        other => panic!("a commit after its run's lease ran out answered {other:?}"),
    };
    let after = s.summary().await.expect("summary").seq;
    assert!(
        after > before,
        "the call expired the run: {before} -> {after}"
    );
    assert_eq!(
        changed_at,
        Some(after),
        "the refusal carries the seq of its change"
    );
    // The same refusal again carries a seq only if the call changed something (it may
    // still expire some of the backlog).
    match s.resolve(step_id("h1"), units(1)).await {
        Err(StoreError::Ledger(LedgerError::Closed { .. }, seq)) => {
            let now = s.summary().await.expect("summary").seq;
            assert_eq!(seq, (now != after).then_some(now));
        }
        other => panic!("a repeated late commit answered {other:?}"),
    }
    let r = reserve_refused(&s, micros_step("r2", "late", 1)).await;
    assert_eq!(
        (r.code, r.scope),
        (RefusalCode::RunBoundExceeded, Some(ScopeKind::Run))
    );
    heartbeat_closed(&s, "r3", RunState::Expired).await;
    finish_expired(&s, "r4", 1_000).await;
    for id in ["h1", "h4"] {
        let h = reservation(&s, id).await;
        assert_eq!(
            (h.state, h.charged),
            (ReservationState::Expired, Micros(1_000)),
            "{id}"
        );
    }
    // r1's conversation slot was freed with its lease.
    admit(&s, who[0].run("r5")).await;
    let lines = check_ledger(&s, &who[0].scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (2_000, 0));
}
