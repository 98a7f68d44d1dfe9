//! I2 conservation: every reservation reaches exactly one terminal state, exactly once; a
//! repeat returns the first outcome and charges nothing more; the sums reconcile.

use crate::support::{
    admit, admit_refused, check_ledger, day, finish, micros_step, model_step, policy, reservation,
    reservations, reserve, resolve, resolve_err, run_id, seq, step_id, summary, sweep, tokens,
    tool_step, units, ur, Who, START, TOOL_PER_CALL,
};
use crate::Backend;
use spendgate_core::{
    Command, IdempotencyKey, LedgerError, Micros, RefusalCode, Reply, ReservationState, Resolution,
    Resolved, ScopeKind, Settlement,
};
use spendgate_store::Store;
use std::sync::Arc;

fn closed(e: &LedgerError, state: ReservationState, charged: u64) {
    assert_eq!(
        *e,
        LedgerError::Closed {
            state,
            charged: Micros(charged)
        },
        "a different transition after a terminal state is refused with that state"
    );
}

/// Commit, release and unknown each end a reservation once; repeats return the first outcome
/// (`repeated: true`, same charge, ledger unchanged); any other transition is refused; used is
/// the sum of the charges.
pub async fn i2_each_reservation_ends_once(b: &dyn Backend) {
    let mut p = policy();
    p.session.budgets = vec![day(1_000_000)];
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    assert_eq!(
        reserve(&s, model_step("r1", "a", 100, Some(100)))
            .await
            .reserved,
        Micros(300)
    );
    assert_eq!(
        reserve(&s, tool_step("r1", "b", TOOL_PER_CALL, 0))
            .await
            .reserved,
        Micros(10_000)
    );
    reserve(&s, micros_step("r1", "c", 5_000)).await;
    reserve(&s, micros_step("r1", "d", 7_000)).await;
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (0, 22_300));

    commit_ends_once(&s).await;
    release_ends_once(&s).await;
    unknown_ends_once(&s).await;
    held_at_finish_ends_once(&s).await;

    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (12_200, 0));
    assert_eq!(ur(&lines, ScopeKind::Session), (12_200, 0));
    let all = reservations(&s).await;
    let charged: u64 = all.iter().map(|r| r.charged.0).sum();
    assert_eq!(charged, 12_200, "used == the sum of the charges");
    let sum = summary(&s).await;
    assert_eq!(sum.charged_micros, Micros(12_200));
    assert_eq!(sum.held_micros, Micros(0));
    let count = |k: &str| sum.reservations.get(k).copied().unwrap_or(0);
    assert_eq!(
        (
            count("held"),
            count("committed"),
            count("released"),
            count("unknown")
        ),
        (0, 1, 1, 2),
        "{sum:?}"
    );
}

/// Step "a" of [`i2_each_reservation_ends_once`]: committed below its hold; a retried commit repeats the first outcome, other transitions are refused.
async fn commit_ends_once(s: &Arc<dyn Store>) {
    let first = resolve(s, "a", tokens(100, 50)).await;
    let want = Resolved {
        state: ReservationState::Committed,
        charged: Micros(200),
        reserved: Micros(300),
        overrun: false,
        repeated: false,
        result_too_large: false,
    };
    assert_eq!(first.value, want);
    assert_eq!(seq(s).await, first.seq);
    let again = resolve(s, "a", tokens(100, 100)).await;
    assert_eq!(
        again.value,
        Resolved {
            repeated: true,
            ..want
        },
        "a retried commit returns the first outcome, whatever usage it carries"
    );
    assert_eq!(again.seq, first.seq, "a repeat changes nothing");
    assert_eq!(seq(s).await, first.seq);
    closed(
        &resolve_err(s, "a", Resolution::Release).await,
        ReservationState::Committed,
        200,
    );
    closed(
        &resolve_err(s, "a", Resolution::Unknown).await,
        ReservationState::Committed,
        200,
    );
}

/// Step "b": released, charged nothing.
async fn release_ends_once(s: &Arc<dyn Store>) {
    let r = resolve(s, "b", Resolution::Release).await.value;
    assert_eq!(
        (r.state, r.charged, r.repeated),
        (ReservationState::Released, Micros(0), false)
    );
    let r = resolve(s, "b", Resolution::Release).await.value;
    assert_eq!(
        (r.state, r.charged, r.repeated),
        (ReservationState::Released, Micros(0), true)
    );
    closed(
        &resolve_err(s, "b", units(0)).await,
        ReservationState::Released,
        0,
    );
    closed(
        &resolve_err(s, "b", Resolution::Unknown).await,
        ReservationState::Released,
        0,
    );
}

/// Step "c": unknown, charged in full.
async fn unknown_ends_once(s: &Arc<dyn Store>) {
    let r = resolve(s, "c", Resolution::Unknown).await.value;
    assert_eq!(
        (r.state, r.charged, r.repeated),
        (ReservationState::Unknown, Micros(5_000), false)
    );
    let before = seq(s).await;
    let r = resolve(s, "c", Resolution::Unknown).await.value;
    assert_eq!(
        (r.state, r.charged, r.repeated),
        (ReservationState::Unknown, Micros(5_000), true)
    );
    assert_eq!(seq(s).await, before);
    closed(
        &resolve_err(s, "c", units(1)).await,
        ReservationState::Unknown,
        5_000,
    );
    closed(
        &resolve_err(s, "c", Resolution::Release).await,
        ReservationState::Unknown,
        5_000,
    );
}

/// Step "d": still held at finish, so unknown and charged in full; an unknown step is not found.
async fn held_at_finish_ends_once(s: &Arc<dyn Store>) {
    let f = finish(s, "r1").await.value;
    assert_eq!(f.charged, Micros(200 + 5_000 + 7_000));
    assert_eq!((f.steps, f.repeated), (4, false));
    let r = resolve(s, "d", Resolution::Unknown).await.value;
    assert_eq!(
        (r.state, r.charged, r.repeated),
        (ReservationState::Unknown, Micros(7_000), true)
    );
    closed(
        &resolve_err(s, "d", units(1)).await,
        ReservationState::Unknown,
        7_000,
    );
    assert!(
        matches!(
            resolve_err(s, "no-such-step", Resolution::Release).await,
            LedgerError::NotFound(_)
        ),
        "an unknown step is not found"
    );
}

/// Expiry is a terminal state like the others: charged in full, and every later transition
/// is refused with it. Earlier outcomes stand.
pub async fn i2_expired_reservations_are_closed(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    let s = b.open(p, START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    reserve(&s, micros_step("r1", "e", 4_000)).await;
    reserve(&s, micros_step("r1", "f", 3_000)).await;
    let r = resolve(&s, "f", units(2_500)).await.value;
    assert_eq!((r.charged, r.overrun), (Micros(2_500), false));

    b.advance(10_001);
    sweep(&s).await;
    let e = reservation(&s, "e").await;
    assert_eq!(
        (e.state, e.charged),
        (ReservationState::Expired, Micros(4_000))
    );
    for how in [units(1), Resolution::Release, Resolution::Unknown] {
        closed(
            &resolve_err(&s, "e", how).await,
            ReservationState::Expired,
            4_000,
        );
    }
    let r = resolve(&s, "f", units(3_000)).await.value;
    assert_eq!(
        (r.state, r.charged, r.repeated),
        (ReservationState::Committed, Micros(2_500), true)
    );
    // A commit that costs no more than the expiry charged is refused (above: units(1)); one
    // that costs more is a late overrun: the difference is charged, the state stays, and a
    // repeat of it changes nothing more.
    closed(
        &resolve_err(&s, "e", units(4_000)).await,
        ReservationState::Expired,
        4_000,
    );
    let before = seq(&s).await;
    let late = resolve(&s, "e", units(4_600)).await;
    assert_eq!(
        (
            late.value.state,
            late.value.charged,
            late.value.overrun,
            late.value.repeated
        ),
        (ReservationState::Expired, Micros(4_600), true, false),
        "a late overrun"
    );
    assert!(
        late.seq > before,
        "a late overrun is a change of the ledger"
    );
    closed(
        &resolve_err(&s, "e", units(4_600)).await,
        ReservationState::Expired,
        4_600,
    );
    let e = reservation(&s, "e").await;
    assert_eq!(
        (e.state, e.charged, e.overrun),
        (ReservationState::Expired, Micros(4_600), true)
    );
    let lines = check_ledger(&s, &w.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Global), (7_100, 0));
    let sum = summary(&s).await;
    assert_eq!(sum.charged_micros, Micros(7_100));
    assert_eq!(sum.reservations.get("expired").copied(), Some(1));
    assert_eq!(sum.reservations.get("committed").copied(), Some(1));
}

/// A tool result's size is judged once, at the first commit: a retried commit answers
/// `result_too_large` as the first did, whatever size it carries, and the flag is kept on the
/// reservation.
pub async fn i2_a_repeated_commit_keeps_its_result_size_verdict(b: &dyn Backend) {
    let bytes = |n: u64| Resolution::Commit(Settlement::ResultBytes(n));
    let s = b.open(policy(), START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    admit(&s, w.run("r1")).await;
    let max = policy().run.max_tool_result_bytes;
    reserve(&s, tool_step("r1", "big", TOOL_PER_CALL, 0)).await;
    reserve(&s, tool_step("r1", "small", TOOL_PER_CALL, 0)).await;

    let first = resolve(&s, "big", bytes(max + 1)).await.value;
    assert_eq!(
        (first.charged, first.result_too_large, first.repeated),
        (Micros(10_000), true, false),
        "charged as reserved, flagged"
    );
    let again = resolve(&s, "big", bytes(1)).await.value;
    assert_eq!(
        again,
        Resolved {
            repeated: true,
            ..first
        }
    );
    assert!(reservation(&s, "big").await.result_too_large);

    let first = resolve(&s, "small", bytes(max)).await.value;
    assert!(!first.result_too_large, "at the bound is within it");
    let again = resolve(&s, "small", bytes(max + 1)).await.value;
    assert_eq!(
        again,
        Resolved {
            repeated: true,
            ..first
        }
    );
    assert!(!reservation(&s, "small").await.result_too_large);
}

/// A durable backend keeps everything it answered across a crash: counters, reservations,
/// runs and their slots, idempotency records and the sequence; afterwards the ledger goes on
/// where it stopped (leases still expire and charge). Backends that are not durable have
/// nothing to keep.
pub async fn durable_reopen_keeps_the_ledger(b: &dyn Backend) {
    let mut p = policy();
    p.lease_ttl_ms = 10_000;
    p.session.budgets = vec![day(100_000)];
    let s = b.open(p, START).await;
    let w1 = Who::new("s1", "c1", "192.0.2.1/32");
    let w2 = Who::new("s1", "c2", "192.0.2.1/32");
    let idem = Some(IdempotencyKey {
        key: "run:k1".into(),
        fingerprint: "f1".into(),
    });
    let first = s
        .admit_run(w1.run("r1"), idem.clone())
        .await
        .expect("store answers");
    assert!(first.value.is_ok(), "{first:?}");
    reserve(&s, micros_step("r1", "a", 4_000)).await;
    resolve(&s, "a", units(3_000)).await;
    reserve(&s, micros_step("r1", "b", 2_000)).await;
    finish(&s, "r1").await;
    admit(&s, w2.run("r2")).await;
    reserve(&s, model_step("r2", "h", 100, Some(100))).await;
    let before_sum = summary(&s).await;
    let before_lines = check_ledger(&s, &w2.scopes()).await;
    let mut before_res = reservations(&s).await;
    before_res.sort_by(|x, y| x.id.cmp(&y.id));
    drop(s);

    let Some(s) = b.reopen().await else {
        return;
    };
    assert_eq!(summary(&s).await, before_sum);
    assert_eq!(check_ledger(&s, &w2.scopes()).await, before_lines);
    let mut res = reservations(&s).await;
    res.sort_by(|x, y| x.id.cmp(&y.id));
    assert_eq!(res, before_res);

    // The slot of the active run, the idempotency record and the first outcomes survived.
    let r = admit_refused(&s, w2.run("r3")).await;
    assert_eq!(r.code, RefusalCode::ConcurrencyLimited, "{r:?}");
    let again = s
        .admit_run(w1.run("r1"), idem)
        .await
        .expect("store answers");
    assert_eq!(again.value, first.value);
    let c = resolve(&s, "a", units(1)).await.value;
    assert_eq!((c.charged, c.repeated), (Micros(3_000), true));
    // Leases still run out: the held step is charged in full.
    b.advance(10_001);
    let sw = sweep(&s).await;
    assert!(sw.seq > before_sum.seq);
    let h = reservation(&s, "h").await;
    assert_eq!(
        (h.state, h.charged),
        (ReservationState::Expired, Micros(300))
    );
    let lines = check_ledger(&s, &w2.scopes()).await;
    assert_eq!(ur(&lines, ScopeKind::Session), (3_000 + 2_000 + 300, 0));
    admit(&s, w2.run("r3")).await;
}

/// `execute_many` applies commands in order, each on its own: a later command sees the earlier
/// ones, and one failing does not stop or undo the others.
pub async fn many_commands_apply_in_order(b: &dyn Backend) {
    let s = b.open(policy(), START).await;
    let w = Who::new("s1", "c1", "192.0.2.1/32");
    let answers = s
        .execute_many(vec![
            Command::AdmitRun {
                req: w.run("r1"),
                idem: None,
            },
            Command::ReserveStep {
                req: tool_step("r1", "a", TOOL_PER_CALL, 0),
                idem: None,
            },
            Command::ReserveStep {
                req: tool_step("nope", "b", TOOL_PER_CALL, 0),
                idem: None,
            },
            Command::Resolve {
                step: step_id("a"),
                how: units(0),
            },
            Command::Finish { run: run_id("r1") },
        ])
        .await;
    assert_eq!(answers.len(), 5);
    assert!(
        matches!(&answers[0], Ok(Reply::Run(a)) if a.value.is_ok()),
        "{:?}",
        answers[0]
    );
    assert!(
        matches!(&answers[1], Ok(Reply::Step(a)) if a.value.is_ok()),
        "{:?}",
        answers[1]
    );
    assert!(
        matches!(
            &answers[2],
            Err(spendgate_store::StoreError::Ledger(
                LedgerError::NotFound(_),
                _
            ))
        ),
        "{:?}",
        answers[2]
    );
    let charged = TOOL_PER_CALL.cost(0);
    assert!(
        matches!(&answers[3], Ok(Reply::Resolved(a)) if a.value.charged == charged && a.value.state == ReservationState::Committed),
        "{:?}",
        answers[3]
    );
    assert!(
        matches!(&answers[4], Ok(Reply::Finished(a)) if a.value.charged == charged),
        "{:?}",
        answers[4]
    );
    let r = reservation(&s, "a").await;
    assert_eq!((r.state, r.charged), (ReservationState::Committed, charged));
    check_ledger(&s, &w.scopes()).await;
}
